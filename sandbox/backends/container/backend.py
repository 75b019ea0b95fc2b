"""The container backend: a sandbox is a crun container on a writable overlay of its image's
lazily mounted layers.

What it keeps per sandbox (docs/FORMAT.md, "Sandbox host state"): its bundle in the data dir's
tmpfs (sandbox.isolation.runfs), under ``run/bundles/<id>/``::

    config.json          the OCI runtime config (sandbox.backends.container.spec)
    init.pid             the init's pid as crun wrote it
    exec-*.json          each running command's process document, with its ``.pid`` file

(``boxes/<id>/bundle/`` for a container an older layerbox made: ``SandboxPaths.bundle``), and
under ``boxes/<id>/``::

    rootfs/              the overlay (a HostMounts mount), mounted here only until the
                         container is created: its init's mount namespace then holds it and
                         it leaves the host's mount table (files go through /proc/<init>/root)

The init's pid comes from crun and is trusted only while the kernel puts it in the
sandbox's own cgroup; nothing the sandbox can write is read as host state.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from layerstore.objects import Resolved
from lazyfetch import kmount
from lazyfetch.mounts import MountError
from sandbox.backends.base import (
    Accounts,
    Attach,
    Box,
    Capabilities,
    Checkpointed,
    CheckpointRequest,
    Files,
    HostContext,
    LeftOver,
    Process,
    StateChanges,
    main_pid,
    process_defaults,
    with_status,
)
from sandbox.backends.container.files import RootFiles
from sandbox.backends.container.runtime import ConsoleSocket, OciRuntime, kill_tree
from sandbox.backends.container.spec import (
    CFS_PERIOD,
    IDLE_INIT,
    Masks,
    OciLimits,
    build_process,
    build_spec,
)
from sandbox.core.errors import (
    RuntimeFailed,
    SandboxError,
    SandboxNotFound,
    SandboxStateError,
    UnsupportedOption,
)
from sandbox.core.model import SandboxOptions, SandboxState, check_sandbox_id
from sandbox.core.paths import read_beneath, replace_beneath
from sandbox.core.procs import kill_exited, kill_group, proc_stat
from sandbox.isolation import disk as sbdisk
from sandbox.isolation import idmap
from sandbox.isolation.network import socket_in
from sandbox.isolation.resources import cgroup_owner
from snapshots.checkpoint import Snapshots

log = logging.getLogger("layerbox.sandbox")

EXEC_PREFIX = "exec-"
MAX_WALK = 200_000  # entries of an upper directory counted for its disk use; past it the figure is partial
STARTED_POLL_S = 0.0002  # how often a background exec's pid file is looked for, at first
STARTED_FINE_S = 0.05  # ... for this long; then every 10 ms (a crun held up by a busy host)
DESTROY_KILL_WAIT = 2.0  # for the killed init to exit before crun deletes; past it crun kills and waits itself


def limits_of(options: SandboxOptions) -> OciLimits:
    return OciLimits(cpu=options.cpu, memory=options.memory, pids=options.pids,
                  best_effort=options.cpu_class == "best-effort")


class ContainerBackend:
    """Sandboxes as crun containers on this host (``isolation="container"``)."""

    isolations: tuple[str, ...] = ("container",)

    def __init__(self, ctx: HostContext, *, runtime: str = "crun") -> None:
        self.ctx = ctx
        self.runtime = OciRuntime(ctx.paths.crun, binary=runtime, copy_dir=ctx.paths.root / "bin",
                                  legacy_root=ctx.paths.runtime)
        self._lock = threading.Lock()
        self._userns_fds: dict[int, int] = {}  # host_base -> user namespace fd with that mapping (kept)
        self._accounts = Accounts()  # document digest -> its users (process_defaults)
        self._masks_made: Masks | None = None
        ctx.mounts.on_remount = self._on_remount

    def _masks(self, hierarchies: list[str]) -> Masks:
        """The shared mask directories (spec.Masks), made once per process."""
        with self._lock:
            if self._masks_made is None:
                masks = Masks(self.ctx.paths.root / "masks" / "empty", self.ctx.paths.root / "masks" / "cgroup")
                masks.ensure(hierarchies)
                self._masks_made = masks
            return self._masks_made

    # -- what it is ---------------------------------------------------------------------------------
    def capabilities(self, isolation: str = "container") -> Capabilities:
        return Capabilities(
            "container", True,
            provides=("exec", "files", "pause", "resume", "limits", "ttl", "leases", "checkpoint", "restore", "fork",
                      "network", "background", "interactive", "ports", "userns", "disk"),
            lacks=("memory_checkpoint",), details={"runtime": os.path.basename(self.runtime.installed)})

    async def check(self, options: SandboxOptions, resolved: Resolved, ref: str) -> None:
        if resolved.disk is not None:
            raise UnsupportedOption(f"{ref} is a VM's checkpoint (a disk): restore it with the isolation it had "
                                    "(microvm or vm)")
        if options.userns:
            self._check_traversable()

    def _check_traversable(self) -> None:
        """Refuse a user namespace when a directory above the data dir is closed to other uids."""
        for d in reversed(self.ctx.data_dir.parents):
            mode = d.stat().st_mode
            if not mode & 0o001:
                raise UnsupportedOption(
                    f"userns=True: {d} is mode {mode & 0o7777:04o}, so a sandbox's root (an unprivileged host "
                    f"uid) cannot reach its rootfs under {self.ctx.paths.boxes}; crun enters the user namespace "
                    f"before it mounts the rootfs. `chmod o+x {d}` or use a data dir whose parents are searchable")

    # -- launch -------------------------------------------------------------------------------------
    async def launch(self, box: Box, resolved: Resolved, ref: str) -> dict[str, Any]:
        st = box.state
        options, mapping = st.options, st.userns
        rootfs = box.dir / "rootfs"
        self._bundle(box.id).mkdir(mode=0o700)
        rootfs.mkdir()
        started = time.perf_counter()
        upper = None
        if options.disk is not None:
            upper = str(await asyncio.to_thread(self.ctx.resources.disks.acquire, box.id, options.disk))
        # a checkpoint as an image: the manager verified it (bound digests, policy) before this;
        # mounting needs no store of its own (a fork of 100 opened 100)
        await asyncio.to_thread(self.ctx.mounts.mount, resolved, rootfs, writable=True, upper=upper)
        if mapping is not None:  # on a thread: the overlay is made under a per-thread fsuid
            await asyncio.to_thread(self._remap_rootfs, rootfs, mapping)
        mounted = time.perf_counter()
        netns, network = None, None
        if options.network is not None:  # default deny with these allow rules; None = loopback only
            # with a user namespace the network namespace must belong to it, or crun cannot
            # mount a sysfs for it and falls back to the host's /sys (host interface names)
            ns_fd = self._userns_fd(*mapping) if mapping is not None else None
            networks = self.ctx.resources.networks
            info = await asyncio.to_thread(networks.acquire, box.id, options.network, userns_fd=ns_fd,
                                           allow_protected=options.protected_egress)
            netns, network = str(info.path), {**info.to_dict(), "policy": networks.manager.policy(box.id)}
        await asyncio.to_thread(self._start, box, resolved, netns, network)
        return {"mount_seconds": round(mounted - started, 6), "start_seconds": round(time.perf_counter() - mounted, 6),
                **({"userns": list(mapping)} if mapping is not None else {})}

    def _start(self, box: Box, resolved: Resolved, netns: str | None, network: Mapping[str, Any] | None) -> None:
        st = box.state
        options, userns = st.options, st.userns
        # the rootfs is the document's alone until the init runs: its users are looked up once per document
        defaults = process_defaults(self.files(box, st), resolved, options, self._accounts.of(resolved.digest))
        process = build_process(IDLE_INIT, env=defaults.env, cwd="/", uid=0, gid=0)
        # a policed network namespace was made inside the manager's user namespace for this range:
        # the sandbox joins that one, so the network namespace is its own
        joined = f"/proc/{os.getpid()}/fd/{self._userns_fd(*userns)}" if userns and netns else None
        limits = limits_of(options)
        binds = self.ctx.cgroups.binds(st.cgroups_path)
        # a kept cgroup (reused) whose last sandbox had the same CPU limit has its bandwidth already,
        # and a new one (None: crun makes it) the kernel's default period
        has, wanted = self.ctx.cgroups.cpu_bandwidth(st.cgroups_path), limits.cpu_bandwidth()
        period_set = (has[1] if has is not None else CFS_PERIOD) == wanted[1]
        spec = build_spec(str(box.dir / "rootfs"), process, hostname=box.id, cgroups_path=st.cgroups_path,
                          limits=limits, cgroup_version=self.ctx.cgroups.version, netns_path=netns, userns=userns,
                          userns_path=joined, cgroup_binds=binds, masks=self._masks([name for name, _ in binds]),
                          bandwidth_set=has == wanted, period_set=period_set,
                          sysfs=self._shared_sysfs(netns, userns))
        base, rel = self.ctx.paths.bundle(box.id)
        replace_beneath(base, f"{rel}/config.json", json.dumps(spec).encode())
        box.update(env=defaults.env, cwd=defaults.cwd, uid=defaults.uid, gid=defaults.gid, status="starting",
                   network=network)
        # created and started at once: the init (IDLE_INIT, root, waiting) runs before the seal, and
        # nothing else does until the status says running
        self.runtime.run(box.id, base / rel, pid_file=base / rel / "init.pid", sched_idle=limits.best_effort)
        pid = self._hold_rootfs(box)
        self._seal_root(pid, userns)
        init_start = (proc_stat(pid) or (0, None))[1]
        if userns is not None:
            self._await_init_exec(box.id, pid)
        box.update(pid=pid, init_start=init_start, status="running")

    def _shared_sysfs(self, netns: str | None, userns: tuple[int, int] | None) -> str | None:
        """The data dir's shared sysfs for a container in a new network namespace of its own (no
        network: only ``lo``), when it is mounted (the create's cgroup acquire made it)."""
        sysfs = self.ctx.resources.cgroups.sysfs
        if netns is not None or userns is not None or sysfs is None or not sysfs.ready():
            return None
        return str(sysfs.path)

    def _bundle(self, sid: str) -> Path:
        base, rel = self.ctx.paths.bundle(sid)
        return base / rel

    def _crun_pid(self, box: Box) -> int:
        """The init pid crun wrote (host side, in the sandbox's bundle)."""
        base, rel = self.ctx.paths.bundle(box.id)
        return int(read_beneath(base, f"{rel}/init.pid").strip())

    def _hold_rootfs(self, box: Box) -> int:
        """Hand the rootfs overlay to the created container (its init's mount namespace holds it)
        and take it out of the host's mount table: each create copies that table, so 1,000
        sandboxes' overlays in it made a create ~2x slower.  Returns the init's pid."""
        pid = self._crun_pid(box)
        try:
            self.ctx.mounts.detach(box.dir / "rootfs", pid)
        except MountError as exc:  # still correct while mounted here, only slower for later creates
            log.warning("sandbox %s: rootfs stays in the host's mount table: %s", box.id, exc)
        return pid

    @staticmethod
    def _seal_root(pid: int, userns: tuple[int, int] | None) -> None:
        """``nosuid,nodev`` on the sandbox's own ``/`` before its first command runs: crun re-binds
        the rootfs and remounts it with only its own flags, which drops the overlay's.  (A user
        namespace locks them; its sandboxes keep them anyway.)"""
        if userns is not None:
            return
        kmount.set_flags_in(pid, "/", kmount.MS_NOSUID | kmount.MS_NODEV)

    def _await_init_exec(self, sid: str, pid: int, limit: float = 10.0) -> None:
        """Return once the init has exec'd: ``crun start`` returns while it may still be crun, and a
        ``crun exec`` into a user-namespaced container then fails (setns EPERM: the process changed its
        credentials and is not dumpable until execve).  /proc offers no event for an exec, hence the poll."""
        runtime_comm = os.path.basename(self.runtime.installed)[:15]
        deadline = time.monotonic() + limit
        while True:
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() != runtime_comm:
                    return
            except OSError:
                raise RuntimeFailed(f"sandbox {sid}: init {pid} died while starting") from None
            if time.monotonic() > deadline:
                raise RuntimeFailed(f"sandbox {sid}: init {pid} did not exec its command within {limit}s")
            time.sleep(0.001)

    # -- user namespaces ------------------------------------------------------------------------------
    def _userns_fd(self, host_base: int, size: int) -> int:
        """A user namespace fd mapping 0..size-1 to host_base.., made once per range and kept."""
        with self._lock:
            fd = self._userns_fds.get(host_base)
            if fd is None:
                fd = self._userns_fds[host_base] = idmap.userns_fd(host_base, size)
            return fd

    def _remap_rootfs(self, rootfs: Path, mapping: tuple[int, int]) -> None:
        base, size = mapping
        idmap.remap_rootfs(rootfs, base, size, ns_fd=self._userns_fd(base, size))

    def forget_userns(self) -> None:
        """Close the kept user namespace fds (the next create of a range makes its own)."""
        with self._lock:
            for fd in self._userns_fds.values():
                os.close(fd)
            self._userns_fds.clear()

    # -- files and processes ------------------------------------------------------------------------
    def files(self, box: Box, st: SandboxState) -> Files:
        return RootFiles(box.dir / "rootfs", idmap=st.userns, open_root=functools.partial(self._open_root, box),
                         no_xdev=True)

    def _open_root(self, box: Box) -> int:
        """The rootfs on the host while it is mounted there (creating), else the container's root."""
        flags = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
        rootfs = box.dir / "rootfs"
        if kmount.is_mountpoint(rootfs):
            return os.open(rootfs, flags)
        st = box.state
        if not st.live:
            raise SandboxStateError(f"sandbox {box.id} is {st.status}: its files are reachable only "
                                    "while it runs (or is paused)")
        pid = main_pid(st, self.ctx.cgroups)
        fd = os.open(f"/proc/{pid}/root", flags)
        try:  # opened first, checked again after: a pid reused in between shows another start time
            main_pid(st, self.ctx.cgroups)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def spawn(self, box: Box, st: SandboxState, argv: Sequence[str], *, env: Mapping[str, str], cwd: str,
              uid: int, gid: int, tag: str, input_pipe: bool, attach: Attach | None = None) -> Process:
        base, rel = self.ctx.paths.bundle(box.id)
        process_file, pid_file = base / rel / f"{tag}.json", base / rel / f"{tag}.pid"
        process = build_process(list(argv), env=env, cwd=cwd, uid=uid, gid=gid)
        terminal = attach.terminal if attach is not None else None
        if terminal is not None:  # crun makes the pty in the sandbox's own devpts and sends us its master
            process.update(terminal=True, consoleSize={"width": terminal[0], "height": terminal[1]})
        replace_beneath(base, f"{rel}/{tag}.json", json.dumps(process).encode())
        oom_before = self.ctx.cgroups.oom_kills(st.cgroups_path)
        stdin: Any = subprocess.PIPE if input_pipe else subprocess.DEVNULL
        if attach is not None:  # its owner writes the input
            stdin = attach.stdin_fd if attach.stdin_fd is not None and terminal is None else subprocess.DEVNULL
        console = ConsoleSocket() if terminal is not None else None
        try:
            proc = self.runtime.exec(box.id, process_file, pid_file=pid_file, stdin=stdin,
                                     sched_idle=st.options.cpu_class == "best-effort",
                                     console_socket=console.path if console is not None else None)
        except BaseException:
            if console is not None:
                console.close()
            if attach is not None:
                attach.spawned()
            raise
        if attach is not None:
            if terminal is None:
                _wait_started(proc, pid_file, self.runtime.timeout)
            attach.spawned()
        master = None
        if console is not None:
            assert attach is not None
            master = self._terminal(box, proc, console, attach, process_file, pid_file)
        exec_start = proc_stat(proc.pid)
        return CrunProcess(self, box, st, proc, master, tag, exec_start[1] if exec_start else 0, oom_before,
                           base / rel)

    def _terminal(self, box: Box, proc: subprocess.Popen[bytes], console: ConsoleSocket, attach: Attach,
                  process_file: Path, pid_file: Path) -> int:
        """The pty master crun sends before it starts the command; handed to ``attach`` too."""
        master: int | None = None
        try:
            master = console.receive(proc)
            attach.on_terminal(os.dup(master))
            return master
        except BaseException as exc:
            kill_group(proc)
            if master is not None:
                os.close(master)
            process_file.unlink(missing_ok=True)
            pid_file.unlink(missing_ok=True)
            if isinstance(exc, RuntimeFailed):
                if not (self.ctx.paths.box(box.id) / "state.json").exists():
                    # destroyed meanwhile (the reaper, another request): crun found no container
                    raise SandboxNotFound(f"sandbox {box.id} was destroyed meanwhile") from None
                if "is paused" in str(exc) or (self.runtime.state(box.id) or {}).get("status") == "paused":
                    # a pause (a request, the reaper's idle pause) landed between our check and crun's,
                    # found by the API fuzzer; crun says so ("the container `...` is paused"), and its
                    # state may say running again by the time we ask: a 409 either way
                    raise SandboxStateError(f"sandbox {box.id} was paused meanwhile; resume it first") from None
            raise
        finally:
            console.close()

    def _kill_exec(self, box: Box, tag: str, since: int, st: SandboxState) -> bool:
        """Kill an exec's tree; False while crun has not yet written the command's pid."""
        try:
            base, rel = self.ctx.paths.bundle(box.id)
            root = int(read_beneath(base, f"{rel}/{tag}.pid").strip())
        except (OSError, ValueError):
            return False
        if not self.ctx.cgroups.holds(root, st.cgroups_path):
            # gone already (nothing left to kill), or not (yet) in the sandbox's cgroup: a pid
            # that is not the sandbox's own is never signalled, the caller tries again
            return proc_stat(root) is None
        try:
            init = main_pid(st, self.ctx.cgroups)
        except SandboxStateError:
            # the init is gone (a destroy kills it first): the kernel kills every process of
            # its PID namespace with it, this command's tree included
            return True
        kill_tree(self.runtime, box.id, init, root, since)
        return True

    def connect_port(self, box: Box, st: SandboxState, port: int, timeout: float) -> socket.socket:
        """A TCP socket made inside the network namespace of the sandbox's init, connected there."""
        sock = self._tcp_socket(box, st)
        try:
            sock.settimeout(timeout)
            sock.connect(("127.0.0.1", port))
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock

    def _tcp_socket(self, box: Box, st: SandboxState) -> socket.socket:
        """A TCP socket made inside the network namespace of the sandbox's init (blocking)."""
        if st.pid is None:
            main_pid(st, self.ctx.cgroups)  # raises: no init
        try:
            fd = os.open(f"/proc/{st.pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            main_pid(st, self.ctx.cgroups)  # raises: the init is gone
            raise
        try:
            main_pid(st, self.ctx.cgroups)  # opened first, checked after: a reused pid shows another start time
            return socket_in(Path(f"/proc/self/fd/{fd}"))
        finally:
            os.close(fd)

    # -- pause, resume, limits ------------------------------------------------------------------------
    def pause(self, box: Box, st: SandboxState, *, reclaim: bool, also: StateChanges | None = None) -> dict[str, Any]:
        """Freeze every process, then push the sandbox's page cache out of memory."""
        self._runtime(box, self.runtime.pause)
        box.update_from(with_status("paused", also))
        return {"reclaim": self.ctx.cgroups.reclaim(st.cgroups_path) if reclaim else None}

    def resume(self, box: Box, st: SandboxState, *, also: StateChanges | None = None) -> dict[str, Any]:
        self._runtime(box, self.runtime.resume)
        box.update_from(with_status("running", also))
        return {}

    def _runtime(self, box: Box, op: Callable[[str], None]) -> None:
        """One crun command on this sandbox; when it fails because the sandbox was destroyed
        meanwhile (the reaper, another request), that is :class:`SandboxNotFound`, not a fault."""
        try:
            op(box.id)
        except RuntimeFailed:
            if not (self.ctx.paths.box(box.id) / "state.json").exists():
                raise SandboxNotFound(f"sandbox {box.id} was destroyed meanwhile") from None
            raise

    def update_limits(self, box: Box, st: SandboxState, options: SandboxOptions) -> None:
        limits = limits_of(options)
        if limits == limits_of(st.options):
            return
        resources = limits.resources()
        resources.pop("devices")
        if self.ctx.cgroups.version == 1:
            resources["memory"].pop("swap")
        self.runtime.update(box.id, resources, box.dir / "resources.json")

    # -- checkpoint -----------------------------------------------------------------------------------
    def paused_capture(self, st: SandboxState) -> bool | None:
        return None  # frozen either way: a paused container is captured as it is

    async def checkpoint(self, box: Box, st: SandboxState, request: CheckpointRequest) -> Checkpointed:
        async with await self.ctx.open_store() as store:
            ckpt = await Snapshots(store, self.ctx.mounts).checkpoint(
                str(box.dir / "rootfs"), name=request.name, labels=dict(request.labels),
                trajectory_offset=request.trajectory_offset, receipt_id=request.receipt_id,
                policy_version=request.policy_version, freeze=functools.partial(self._frozen, box),
                attach_docs=dict(request.attach_docs), name_prefix=request.prefix)
        return Checkpointed(ckpt)

    @contextlib.contextmanager
    def _frozen(self, box: Box) -> Iterator[None]:
        if box.state.status == "paused":
            yield
            return
        self._runtime(box, self.runtime.pause)
        try:
            yield
        finally:
            self._runtime(box, self.runtime.resume)

    # -- usage ----------------------------------------------------------------------------------------
    def usage(self, box: Box, st: SandboxState) -> dict[str, Any]:
        """``used`` bytes of the sandbox's writes: its ext4's used blocks with a disk limit, else the
        blocks its upper directory's entries hold (``partial`` past MAX_WALK entries)."""
        if st.options.disk is not None:
            got = sbdisk.usage(box.dir / "disk")
            if got is not None:
                return {"disk": {"where": "disk", "used": got["size"] - got["free"], "free": got["free"],
                                 "limit": st.options.disk, "partial": False}}
        record = self.ctx.mounts.record(box.dir / "rootfs") or {}
        upper = record.get("upper")
        if not upper:
            return {"disk": {"where": "upper", "used": None, "free": None, "limit": None, "partial": False}}
        used, partial = tree_bytes(Path(upper))
        return {"disk": {"where": "upper", "used": used, "free": None, "limit": None, "partial": partial}}

    # -- destroy and recovery ---------------------------------------------------------------------------
    def destroy(self, sid: str, st: SandboxState | None) -> None:
        self._stop(sid, st)
        shutil.rmtree(self.ctx.paths.bundles / check_sandbox_id(sid), ignore_errors=True)  # (a legacy one: in boxes/)

    def _stop(self, sid: str, st: SandboxState | None) -> None:
        """The container gone (its bundle kept: a restart on a re-stacked rootfs runs it again)."""
        if st is not None and st.status == "running" and st.pid is not None:
            # crun's delete kills the container and at once rmdirs its cgroups; the killed are still
            # exiting, the rmdir fails EBUSY and crun sleeps 10 ms before it tries again (every
            # destroy, measured).  Its init gone first, the cgroups are empty when crun comes.
            if kill_exited(st.pid, st.init_start, DESTROY_KILL_WAIT):
                # the init gone, its PID namespace went with it: the cgroup is kept for the next
                # sandbox (Cgroups.keep) before crun's delete, which would remove it
                self.ctx.resources.cgroups.keep(sid, cgroup_owner(st.options))
        try:  # `crun delete --force` of an unknown container succeeds: no state query first
            self.runtime.delete(sid, force=True)
        except RuntimeFailed:
            with contextlib.suppress(RuntimeFailed):
                self.runtime.resume(sid)  # a frozen init cannot die
            self.runtime.delete(sid, force=True)

    def survivors(self) -> Mapping[str, Any]:
        mounted = set(self.ctx.mounts.status()["mounts"])
        found: dict[str, Any] = {c["id"]: {**c, "rootfs_mounted": str(self.ctx.paths.boxes / str(c["id"]) / "rootfs")
                                           in mounted} for c in self.runtime.list()}
        try:  # a bundle without a container (a crash in the create): destroyed by reconcile with it
            bundles = os.listdir(self.ctx.paths.bundles)
        except FileNotFoundError:
            bundles = []
        for name in bundles:
            found.setdefault(name, {"id": name, "status": "no container"})
        return found

    def adopt(self, box: Box, st: SandboxState, survivors: Mapping[str, Any]) -> list[LeftOver] | None:
        c = survivors.get(box.id)
        if c is None or c.get("status") not in ("running", "paused") or not c.get("rootfs_mounted"):
            return None
        try:
            pid = int(c["pid"])
            stat = proc_stat(pid)
            if stat is None or not self.ctx.cgroups.holds(pid, st.cgroups_path):
                raise SandboxStateError(f"sandbox {box.id}: crun's init {pid} is not in its cgroup")
            st = box.update(status=c["status"], pid=pid, init_start=stat[1])
            return self._stop_leftover_execs(box, st)
        except (SandboxError, OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("reconcile: not adopting %s: %s", box.id, exc)
            return None

    def _stop_leftover_execs(self, box: Box, st: SandboxState) -> list[LeftOver]:
        """Commands a dead manager started: kill each one's tree and remove its process document
        and pid file (a command must never run on unobserved)."""
        stopped: list[LeftOver] = []
        base, rel = self.ctx.paths.bundle(box.id)
        bundle = base / rel
        try:
            names = os.listdir(bundle)
        except FileNotFoundError:
            return stopped
        for tag in sorted({n.rsplit(".", 1)[0] for n in names if n.startswith(EXEC_PREFIX)}):
            command: Any = None
            with contextlib.suppress(OSError, ValueError):
                command = json.loads(read_beneath(base, f"{rel}/{tag}.json")).get("args")
            try:
                pid = int(read_beneath(base, f"{rel}/{tag}.pid").strip())
            except (OSError, ValueError):
                pid = None
            if pid is not None and self.ctx.cgroups.holds(pid, st.cgroups_path):
                stat = proc_stat(pid)
                with contextlib.suppress(SandboxError):
                    kill_tree(self.runtime, box.id, main_pid(st, self.ctx.cgroups), pid, stat[1] if stat else 0)
            for suffix in (".json", ".pid"):
                (bundle / f"{tag}{suffix}").unlink(missing_ok=True)
            stopped.append(LeftOver(tag, command))
        return stopped

    def _on_remount(self, mountpoint: str, phase: str) -> int | None:
        """The lazyfetch daemon died and its layers are re-stacked: a container keeps its own copy of
        the rootfs overlay, on layers of the dead daemon (every read fails with EIO).  Before the
        overlay is re-stacked its container goes (so no two overlays use the upper at once);
        afterwards a new container starts on the same bundle: processes are lost, files are kept,
        like a reboot."""
        path = Path(mountpoint)
        if path.name != "rootfs" or path.parent.parent != self.ctx.paths.boxes:
            return None
        try:
            box = self.ctx.box(path.parent.name)
            st = box.state
        except SandboxError:
            return None
        if phase == "detached":
            self._stop(box.id, st)
            return None
        if st.userns:
            self._remap_rootfs(box.dir / "rootfs", st.userns)
        bundle = self._bundle(box.id)
        self.runtime.run(box.id, bundle, pid_file=bundle / "init.pid", sched_idle=st.options.cpu_class == "best-effort")
        pid = self._crun_pid(box)
        self._seal_root(pid, st.userns)
        if st.userns:
            self._await_init_exec(box.id, pid)
        box.update(pid=pid, init_start=(proc_stat(pid) or (0, None))[1], status="running")
        if st.status == "paused":
            box.receipt("pause", **self.pause(box, box.state, reclaim=True))
        box.receipt("restarted", reason="the lazyfetch daemon restarted: the rootfs was remounted on it; "
                                        "processes were lost, files kept", was=st.status)
        log.warning("sandbox %s restarted on a new lazyfetch daemon (processes lost, files kept)", box.id)
        return pid  # HostMounts detaches the new overlay: this init holds it (called under its lock)

    def close(self) -> None:
        self.forget_userns()
        self.runtime.close()


class CrunProcess:
    """A command crun execs in the container (:class:`~sandbox.backends.base.Process`)."""

    def __init__(self, backend: ContainerBackend, box: Box, st: SandboxState, proc: subprocess.Popen[bytes],
                 master: int | None, tag: str, since: int, oom_before: int, bundle: Path) -> None:
        self._backend, self._box, self._st, self._proc = backend, box, st, proc
        self._master, self._tag, self._since, self._oom_before = master, tag, since, oom_before
        self._bundle = bundle

    @property
    def stdout(self) -> IO[bytes]:
        assert self._proc.stdout is not None
        return self._proc.stdout

    @property
    def stderr(self) -> IO[bytes]:
        assert self._proc.stderr is not None
        return self._proc.stderr

    @property
    def stdin(self) -> IO[bytes] | None:
        return self._proc.stdin

    @property
    def tty(self) -> int | None:
        return self._master

    def poll(self) -> int | None:
        return self._proc.poll()

    def kill_tree(self) -> bool:
        return self._backend._kill_exec(self._box, self._tag, self._since, self._st)

    def kill(self) -> None:
        self._proc.kill()

    def finish(self) -> int | None:
        try:
            if self._proc.poll() is None:
                kill_group(self._proc)
            self._proc.wait()
        finally:
            if self._master is not None:
                os.close(self._master)
                self._master = None
            (self._bundle / f"{self._tag}.json").unlink(missing_ok=True)
            (self._bundle / f"{self._tag}.pid").unlink(missing_ok=True)
        return self._proc.returncode

    def oom_killed(self) -> bool:
        return self._backend.ctx.cgroups.oom_kills(self._st.cgroups_path) > self._oom_before

    def receipt(self) -> Mapping[str, Any]:
        return {}


def tree_bytes(root: Path, limit: int = MAX_WALK) -> tuple[int, bool]:
    """Bytes allocated to the entries below ``root`` (hard links once, symlinks never followed),
    and whether the walk stopped at ``limit`` entries."""
    total, seen, entries = 0, set(), 0
    stack = [os.fsencode(root)]
    while stack:
        try:
            it = os.scandir(stack.pop())
        except OSError:  # removed meanwhile, or not a directory any more: the sandbox writes it
            continue
        with it:
            for entry in it:
                entries += 1
                if entries > limit:
                    return total, True
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if st.st_nlink > 1 and not entry.is_dir(follow_symlinks=False):
                    if st.st_ino in seen:
                        continue
                    seen.add(st.st_ino)
                total += st.st_blocks * 512
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
    return total, False


def _wait_started(proc: subprocess.Popen[bytes], pid_file: Path, bound: float) -> None:
    """Until ``crun exec`` has made its process (its pid file is written) or ended, at most ``bound``
    seconds: a background command is reported started only then, so a pause that follows at
    once freezes the command instead of making ``crun exec`` refuse a paused container."""
    # crun writes it 2-6 ms after it starts: a doubling poll (0.5, 1, 2, 4 ms) overslept by up to
    # half of that, and the caller's start answer waited with it.  Polling every 0.2 ms for the
    # first STARTED_FINE_S (a stat and a waitpid each, ~10 us) finds it within 0.2 ms.
    started = time.monotonic()
    deadline = started + bound
    while not pid_file.exists() and proc.poll() is None:
        now = time.monotonic()
        if now >= deadline:
            return
        time.sleep(STARTED_POLL_S if now - started < STARTED_FINE_S else 0.01)
