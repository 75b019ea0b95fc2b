"""cgroups of sandboxes: the host's layout (v1, hybrid or v2) and what the manager reads and writes there.

crun makes each sandbox's cgroup (``/<parent>/<id>``, one parent per data dir)
from the OCI config; this module only finds the directories, reads usage for
receipts and a sandbox's metrics (CPU seconds, memory now and peak, pids, OOM kills), reclaims a paused
sandbox's memory, tells whether a pid really lives in a sandbox's cgroup (the
identity check of its init: a state file's pid is never trusted alone), and
removes the directories once their tasks are gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from sandbox.core.errors import HostUnsupported

log = logging.getLogger("layerbox.sandbox")

CGROUP_ROOT = Path("/sys/fs/cgroup")
KEPT_PREFIX = "kept-"  # an emptied cgroup kept for the next sandbox (never a sandbox id: those are lb-...)
V1_CONTROLLERS = ("cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "blkio", "pids", "hugetlb",
                  "net_cls", "net_prio", "perf_event", "rdma", "misc")


@dataclass(frozen=True)
class CgroupLayout:
    """How this host mounts cgroups: ``v2`` (unified) or ``v1`` (legacy or hybrid)."""

    version: int
    v1: dict[str, Path] = field(default_factory=dict)  # controller -> hierarchy mount
    # hierarchies without a controller we use that crun still puts every container in (on a hybrid
    # host: name=systemd and the cgroup2 at unified/); only ever cleaned up, never read or written
    others: tuple[Path, ...] = ()
    # of those, the cgroup2 ones: the kernel renames no cgroup there (see :meth:`reuse`)
    unified: tuple[Path, ...] = ()

    def dirs(self, cgroups_path: str) -> list[Path]:
        """Every directory a container with ``cgroups_path`` has (or had) on this host."""
        rel = cgroups_path.lstrip("/")
        if self.version == 2:
            return [CGROUP_ROOT / rel]
        return sorted({root / rel for root in (*self.v1.values(), *self.others)})

    def binds(self, cgroups_path: str) -> list[tuple[str, Path]]:
        """On cgroup v1, each hierarchy's name under ``/sys/fs/cgroup`` and the directory a container
        with ``cgroups_path`` has in it: what the container sees there, bound read-only
        (sandbox.backends.container.spec).  Empty on v2, whose one cgroup2 mount is cheap."""
        if self.version == 2:
            return []
        rel = cgroups_path.lstrip("/")
        return sorted((str(root.relative_to(CGROUP_ROOT)), root / rel)
                      for root in {*self.v1.values(), *self.others} if root.parent == CGROUP_ROOT)

    def controller_dir(self, controller: str, cgroups_path: str) -> Path | None:
        rel = cgroups_path.lstrip("/")
        if self.version == 2:
            return CGROUP_ROOT / rel
        root = self.v1.get(controller)
        return root / rel if root else None

    def _read(self, cgroups_path: str, controller: str, v1: str, v2: str) -> str | None:
        d = self.controller_dir(controller, cgroups_path)
        try:
            return (d / (v2 if self.version == 2 else v1)).read_text() if d else None
        except OSError:
            return None

    def cpu_bandwidth(self, cgroups_path: str) -> tuple[int, int] | None:
        """The CFS quota and period (microseconds; quota -1: none) of ``cgroups_path`` as the
        kernel has them; None when it has no CPU controller directory (not made yet)."""
        if self.version == 2:
            text = self._read(cgroups_path, "cpu", "", "cpu.max")
            if text is None or len(fields := text.split()) != 2:
                return None
            quota, period = fields
            return (-1 if quota == "max" else int(quota)), int(period)
        quota_text = self._read(cgroups_path, "cpu", "cpu.cfs_quota_us", "")
        period_text = self._read(cgroups_path, "cpu", "cpu.cfs_period_us", "")
        if quota_text is None or period_text is None:
            return None
        return int(quota_text), int(period_text)

    # -- what receipts record -----------------------------------------------------------------------
    def oom_kills(self, cgroups_path: str) -> int:
        text = self._read(cgroups_path, "memory", "memory.oom_control", "memory.events") or ""
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def cpu_seconds(self, cgroups_path: str) -> float | None:
        """CPU seconds the cgroup has used so far."""
        text = self._read(cgroups_path, "cpuacct", "cpuacct.usage", "cpu.stat")
        if text is None:
            return None
        if self.version == 1:
            return int(text) / 1e9
        fields = dict(line.split() for line in text.splitlines() if line.strip())
        return int(fields.get("usage_usec", 0)) / 1e6

    def memory_peak(self, cgroups_path: str) -> int | None:
        text = self._read(cgroups_path, "memory", "memory.max_usage_in_bytes", "memory.peak")
        return int(text) if text and text.strip().isdigit() else None

    def memory_current(self, cgroups_path: str) -> int | None:
        """Bytes the cgroup is charged now (page cache included, as the limit counts it)."""
        text = self._read(cgroups_path, "memory", "memory.usage_in_bytes", "memory.current")
        return int(text) if text and text.strip().isdigit() else None

    def pids_current(self, cgroups_path: str) -> int | None:
        text = self._read(cgroups_path, "pids", "pids.current", "pids.current")
        return int(text) if text and text.strip().isdigit() else None

    # -- pause with reclaim ---------------------------------------------------------------------------
    def reclaim(self, cgroups_path: str) -> dict[str, int] | None:
        """Push the cgroup's page cache out of memory: ``{"before", "after"}`` bytes charged."""
        d = self.controller_dir("memory", cgroups_path)
        if d is None:
            return None
        usage_file = d / ("memory.current" if self.version == 2 else "memory.usage_in_bytes")
        before = int(usage_file.read_text())
        try:
            if self.version == 2:
                (d / "memory.reclaim").write_text(str(before))
            else:
                (d / "memory.force_empty").write_text("0")
        except OSError as exc:  # EAGAIN/EBUSY: reclaimed what it could
            log.info("reclaim of %s stopped early: %s", d, exc)
        return {"before": before, "after": int(usage_file.read_text())}

    # -- identity and removal -------------------------------------------------------------------------
    def holds(self, pid: int, cgroups_path: str) -> bool:
        """Whether ``pid`` is a task of the cgroup ``cgroups_path`` (or of one below it).

        A pid from a state file names the sandbox's init only if the kernel puts it in
        the sandbox's own cgroup: a reused pid, or a number from anywhere else, does not.
        """
        want = "/" + cgroups_path.strip("/")
        try:
            text = Path(f"/proc/{pid}/cgroup").read_text()
        except OSError:
            return False
        for line in text.splitlines():
            _, controllers, path = line.split(":", 2)
            # v2 ("0::/path"); on v1 one memory or pids line is enough (crun sets them all)
            if self.version == 2 and controllers != "":
                continue
            if self.version == 1 and not {"memory", "pids"} & set(controllers.split(",")):
                continue
            if path == want or path.startswith(want + "/"):
                return True
        return False

    def make(self, cgroups_path: str, limits: dict[str, int]) -> list[Path]:
        """Make ``cgroups_path`` with ``limits`` (memory, pids, cpu_quota per 100 ms, cpu_shares) for a
        process the manager starts itself (a VMM; crun makes a container's).  Returns the
        ``cgroup.procs`` files the process writes its pid to before it execs."""
        wants: dict[str, dict[str, dict[str, int | str]]] = {"memory": {"v1": {"memory.limit_in_bytes": limits["memory"]}, "v2": {"memory.max": limits["memory"],
                                                                                     "memory.swap.max": 0}},
                 "pids": {"v1": {"pids.max": limits["pids"]}, "v2": {"pids.max": limits["pids"]}},
                 "cpu": {"v1": {"cpu.cfs_period_us": 100_000, "cpu.cfs_quota_us": limits["cpu_quota"],
                                "cpu.shares": limits["cpu_shares"]},
                         "v2": {"cpu.max": f"{limits['cpu_quota']} 100000",
                                "cpu.weight": max(1, min(10_000, limits["cpu_shares"] * 100 // 1024))}}}
        rel = cgroups_path.strip("/")
        if self.version == 2:
            parts = rel.split("/")
            for depth in range(len(parts)):  # every level passes the controllers down
                d = CGROUP_ROOT.joinpath(*parts[:depth])
                (d / parts[depth]).mkdir(exist_ok=True)
                with open(d / "cgroup.subtree_control", "w") as f:
                    f.write("+memory +pids +cpu")
            d = CGROUP_ROOT / rel
            for files in wants.values():
                for name, value in files["v2"].items():
                    (d / name).write_text(str(value))
            return [d / "cgroup.procs"]
        procs = []
        for d in sorted(set(self.dirs(cgroups_path))):
            d.mkdir(parents=True, exist_ok=True)
            procs.append(d / "cgroup.procs")
        cpuset = self.v1.get("cpuset")
        if cpuset is not None:  # a v1 cpuset takes no task until its cpus and mems are set
            d = cpuset
            for part in rel.split("/"):
                parent, d = d, d / part
                for name in ("cpuset.cpus", "cpuset.mems"):
                    if not (d / name).read_text().strip():
                        (d / name).write_text((parent / name).read_text())
        for controller, files in wants.items():
            cd = self.controller_dir(controller, cgroups_path)
            if cd is None:
                continue
            for name, value in files["v1"].items():
                (cd / name).write_text(str(value))
        devices = self.controller_dir("devices", cgroups_path)
        if devices is not None:  # a kept container's (reuse) allowed only its few devices; a VMM opens more
            (devices / "devices.allow").write_text("a")
        return procs

    def prepare_parent(self, parent: str) -> None:
        """Make ``parent`` (the cgroup every sandbox's is made under) ready for thousands of
        children.  With cgroup v1's cpuset, a new child has no cpus and mems: crun copies them from
        the parent with a write the kernel validates against every sibling (``validate_change``)
        and follows with a rebuild of the scheduling domains, so each create cost more the more
        sandboxes the host held (crun create 21.6 ms with none held, 28.8 ms with 1,600).  With
        ``cgroup.clone_children`` set on the parent, the kernel gives a child the parent's cpus
        and mems as it makes it, and crun finds them set.  A no-op on cgroup v2."""
        cpuset = self.v1.get("cpuset")
        if self.version == 2 or cpuset is None:
            return
        # the common case, one read: ready (the parent goes with its last child, and is made again)
        with contextlib.suppress(OSError):
            if (cpuset / parent.strip("/") / "cgroup.clone_children").read_text().strip() == "1":
                return
        d = cpuset
        for part in parent.strip("/").split("/"):
            up, d = d, d / part
            d.mkdir(exist_ok=True)
            for name in ("cpuset.cpus", "cpuset.mems"):
                if not (d / name).read_text().strip():
                    (d / name).write_text((up / name).read_text())
        (d / "cgroup.clone_children").write_text("1")

    # -- empty cgroups kept for the next sandbox -------------------------------------------------------
    # Making a cgroup and removing it again is most of what a create and a destroy cost the kernel on
    # a dense host: a memory cgroup going offline walks every superblock's LRU lists (7 per
    # sandbox), a cpuset's going offline rebuilds scheduling state, and each of the ~10 v1
    # hierarchies takes the cgroup mutex twice.  With 3,200 held, create + exec + destroy cycles
    # ran 26.4/s with no cgroups at all against 21.0/s with them (bench/README.md, "Dense
    # hosts").  So an emptied cgroup is renamed, not removed, and the next sandbox's is that one
    # renamed again: crun finds its directories made and writes its limits into them.  Only
    # cgroup v1 renames (``cgroup1_rename``); on v2 every sandbox's is made and removed.
    def _lead(self) -> Path | None:
        """The hierarchy whose rename claims a kept cgroup: one rename there wins, and only one."""
        if self.version != 1:
            return None
        return self.v1.get("memory") or self.v1.get("pids")

    def reuse(self, kept: str, cgroups_path: str, memory: int) -> bool:
        """Rename the kept, empty cgroup ``kept`` to ``cgroups_path`` in every hierarchy; False when
        another took it first (or it is gone), or when it is still charged more than half of the
        new sandbox's ``memory`` limit: what its last sandbox left charged (page cache, shmem
        another process holds) must be reclaimed before the lower limit is set, and crun's create
        would fail (EBUSY) where it cannot be.  A hierarchy where it is missing (a crash between
        renames) gets a new directory from crun."""
        lead = self._lead()
        if lead is None:
            return False
        src, dst = kept.strip("/"), cgroups_path.strip("/")
        charged = self._read(kept, "memory", "memory.usage_in_bytes", "memory.current")
        if charged is None or not charged.strip().isdigit() or int(charged) > memory // 2:
            return False
        try:
            os.rename(lead / src, lead / dst)
        except OSError:
            return False
        for root in {*self.v1.values(), *self.others} - {lead, *self.unified}:
            with contextlib.suppress(OSError):
                os.rename(root / src, root / dst)
        return True

    def keep(self, cgroups_path: str, kept: str) -> bool:
        """Rename ``cgroups_path``, once its last task is gone, to ``kept`` (its counters reset) for
        :meth:`reuse`; False, with nothing renamed, when it still has a task, is frozen, had an
        OOM kill (a counter no write resets), or this host cannot rename cgroups."""
        lead = self._lead()
        if lead is None:
            return False
        rel, dst = cgroups_path.strip("/"), kept.strip("/")
        try:
            if (lead / rel / "cgroup.procs").read_text().strip() or self.oom_kills(cgroups_path):
                return False
            freezer = self.controller_dir("freezer", cgroups_path)
            if freezer is not None and (freezer / "freezer.state").read_text().strip() != "THAWED":
                return False
            for controller, name in (("cpuacct", "cpuacct.usage"), ("memory", "memory.max_usage_in_bytes"),
                                     ("memory", "memory.failcnt")):
                d = self.controller_dir(controller, cgroups_path)
                if d is not None:
                    (d / name).write_text("0")
        except OSError:
            return False
        for root in self.unified:  # no controller there: cheap to make again
            with contextlib.suppress(OSError):
                (root / rel).rmdir()
        for root in {*self.v1.values(), *self.others} - {lead, *self.unified}:
            with contextlib.suppress(OSError):
                os.rename(root / rel, root / dst)
        try:  # last: the lead's name is what makes it another sandbox's to take
            os.rename(lead / rel, lead / dst)
        except OSError:
            return False
        return True

    def kept(self, parent: str) -> list[str]:
        """The kept cgroups under ``parent`` (names), as the lead hierarchy has them."""
        lead = self._lead()
        if lead is None:
            return []
        try:
            return [name for name in os.listdir(lead / parent.strip("/")) if name.startswith(KEPT_PREFIX)]
        except OSError:
            return []

    def drop_kept(self, parent: str) -> None:
        """Remove every kept cgroup under ``parent``, in every hierarchy (a crash's half-renamed too)."""
        for d in self.dirs(parent):
            try:
                names = [name for name in os.listdir(d) if name.startswith(KEPT_PREFIX)]
            except OSError:
                continue
            for name in names:
                with contextlib.suppress(OSError):
                    (d / name).rmdir()

    def remove(self, cgroups_path: str, *, wait: float = 5.0) -> bool:
        """rmdir every directory of ``cgroups_path``; True when none is left.

        A killed init lingers a few ms (longer: a zombie of a slow PID 1, a loaded host),
        so a busy directory is retried for up to ``wait`` seconds, then left (and logged)
        for the next reconcile.
        """
        clean = True
        for d in self.dirs(cgroups_path):
            deadline, pause = time.monotonic() + wait, 0.002
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(pause)
                    pause = min(pause * 2, 0.05)
            if d.exists():
                log.warning("cgroup %s still busy; left for the next reconcile", d)
                clean = False
        return clean


def _cgroup_mounts() -> list[tuple[str, str, set[str]]]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, _source, options = (right.split() + ["", "", ""])[:3]
            if fstype in ("cgroup", "cgroup2"):
                mountpoint = left.split()[4].replace("\\040", " ")
                out.append((fstype, mountpoint, set(options.split(","))))
    return out


MS_REMOUNT = 32
MNT_DETACH = 2


def _mount(source: bytes | None, target: str | os.PathLike[str], fstype: bytes | None, flags: int,
           data: str) -> None:
    """mount(2); an OSError with its errno (its strerror names the target and the options)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.mount(source, os.fsencode(target), fstype, flags, data.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount of {os.fspath(target)} ({data}): {os.strerror(err)}")


def _mount_cgroup_v1(controller: str, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    try:
        _mount(b"cgroup", target, b"cgroup", 0, controller)
    except OSError as exc:
        raise HostUnsupported(f"moving {controller} to a cgroup v1 hierarchy at {target} failed: "
                              f"{os.strerror(exc.errno or 0)}; crun refuses hybrid cgroups while cgroup2 holds "
                              "controllers") from None


def favor_dynamic_moves(mounts: list[tuple[str, str, set[str]]]) -> bool:
    """Set cgroup2's ``favordynmods`` on this host, as every sandbox host needs; whether it is set.

    Each create moves a new task into its cgroups (crun's init, then each ``crun exec``).
    Without the option the first move takes a host-wide lock whose writer waits for an RCU
    grace period: measured here 7.6 ms (p50 of 20, 6.6-15.7) per first move of a new task
    into a new cgroup, 0.05 ms with it (bench/README.md, "The first move into a cgroup").  The
    kernel's own words for the price: "forks and exits more expensive", which a sandbox host
    pays gladly.  On Linux 6.18 a move then takes a lock of the task's own thread group, and
    the switch stays on until reboot.  The option belongs to the cgroup2 root, so a host
    with only v1 hierarchies gets it through a cgroup2 mounted for a moment; a remount keeps
    the mount's other options (``nsdelegate`` and the like).
    """
    v2 = [(mp, opts) for fs, mp, opts in mounts if fs == "cgroup2"]
    if any("favordynmods" in opts for _, opts in v2):
        return True
    try:
        if v2:
            mountpoint, opts = v2[0]
            _mount(None, mountpoint, None, MS_REMOUNT, ",".join([*sorted(opts - {"rw", "ro"}), "favordynmods"]))
        else:
            with tempfile.TemporaryDirectory(prefix="layerbox-cgroup2-") as d:
                _mount(b"cgroup2", d, b"cgroup2", 0, "favordynmods")
                ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).umount2(os.fsencode(d), MNT_DETACH)
    except OSError as exc:
        log.warning("cgroup2 favordynmods could not be set (%s): each sandbox's first move into its "
                    "cgroups waits for an RCU grace period", exc.strerror)
        return False
    log.info("cgroup2 favordynmods set: moves of new tasks into cgroups no longer wait for RCU grace periods")
    return True


def preflight_cgroups() -> CgroupLayout:
    """Detect the cgroup layout; on a hybrid host move ``hugetlb`` off cgroup2 so crun accepts it;
    set ``favordynmods`` (:func:`favor_dynamic_moves`).

    crun refuses a hybrid layout whose cgroup2 tree still holds controllers
    ("drop all controllers from cgroupv2").  The only one seen there is
    hugetlb, which is moved to its own v1 hierarchy; anything else is an error
    naming the controllers.
    """
    mounts = _cgroup_mounts()
    favor_dynamic_moves(mounts)
    if any(fs == "cgroup2" and Path(mp) == CGROUP_ROOT for fs, mp, _ in mounts):
        return CgroupLayout(2)
    v1 = {c: Path(mp) for fs, mp, opts in mounts if fs == "cgroup" for c in opts if c in V1_CONTROLLERS}
    if not v1:
        raise HostUnsupported("no cgroup v1 controllers and no cgroup2 at /sys/fs/cgroup: mount cgroups first")
    others = tuple(sorted({Path(mp) for fs, mp, opts in mounts
                           if fs == "cgroup2" or not opts & set(V1_CONTROLLERS)} - set(v1.values())))
    for fs, mp, _ in mounts:
        if fs != "cgroup2":
            continue
        try:
            held = set(Path(mp, "cgroup.controllers").read_text().split())
        except OSError:
            continue
        if not held:
            continue
        if held - {"hugetlb"}:
            raise HostUnsupported(f"hybrid cgroups: the cgroup2 tree at {mp} holds {sorted(held)}; crun needs "
                                  "them on v1 hierarchies (or boot with a pure cgroup v2 layout)")
        target = CGROUP_ROOT / "hugetlb"
        log.warning("hybrid cgroups: moving hugetlb from cgroup2 (%s) to cgroup v1 at %s for crun", mp, target)
        _mount_cgroup_v1("hugetlb", target)
        v1["hugetlb"] = target
    unified = tuple(root for root in others if (root / "cgroup.controllers").exists())
    return CgroupLayout(1, v1, others, unified)


