"""Host resources as steps: what a sandbox holds on its host, acquired at create, released at
destroy, and found by owner after a crash.

Each step wraps one kind of resource a sandbox of any isolation may hold, keyed by the
sandbox's id:

========== ==================================================== =========================
step        what                                                 its state
========== ==================================================== =========================
mount       the layer mounts under ``boxes/<id>/`` (a rootfs,    lazyfetch's mount table
            a VM's disk layers)
disk        its own ext4 with a disk limit (``boxes/<id>/disk``) the kernel's mount table
netns       its network namespace, veth or tap, egress policy   ``net/`` (sandbox.isolation.network)
cgroup      its cgroup in every hierarchy (``/<parent>/<id>``)  the cgroup file systems
userns      its host uid range (a user namespace, a VMM's jail) ``sandbox/userns.json``
========== ==================================================== =========================

Acquiring is each step's own call (the arguments differ: rules, a size, a mapping), made
by whoever starts the sandbox.  Releasing and listing owners are uniform, so the manager's
destroy releases every step in :data:`ORDER` (after the backend stopped the sandbox's
processes: nothing may hold a resource while it goes), and reconcile releases what an owner
no longer alive holds, step by step, instead of hand-written sequences.  Every ``release``
is idempotent: an interrupted destroy is finished by the next one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from layerstore.hoststate import closed_dir, flocked
from lazyfetch import kmount
from lazyfetch.errors import KernelMountError
from lazyfetch.mounts import HostMounts, MountError
from sandbox.core.errors import SandboxError
from sandbox.core.model import (
    POOL_PROJECT_LABEL,
    EgressRule,
    IPNetwork,
    SandboxOptions,
    check_sandbox_id,
)
from sandbox.core.paths import SandboxPaths
from sandbox.isolation import disk as sbdisk
from sandbox.isolation.cgroups import KEPT_PREFIX, CgroupLayout, preflight_cgroups
from sandbox.isolation.idmap import RangePool
from sandbox.isolation.network import NetnsInfo, NetworkManager, protected_ranges
from sandbox.isolation.runfs import RunFs
from sandbox.isolation.sysfs import SharedSysfs
from snapshots.checkpoint import forget_record

log = logging.getLogger("layerbox.sandbox")


class HostResource(Protocol):
    """One kind of host resource sandboxes hold, keyed by sandbox id."""

    name: str

    def release(self, sid: str) -> None:
        """Free what ``sid`` holds of this resource; nothing happens when it holds none."""

    def owners(self) -> set[str]:
        """The sandbox ids holding some of this resource now."""

    def reclaim(self, owner: str) -> None:
        """Free all an owner no longer alive holds (reconcile's sweep); for most steps, release."""


def _owner(paths: SandboxPaths, path: str) -> str | None:
    """The sandbox whose directory holds ``path`` (``boxes/<id>/...``), if its name is an id."""
    try:
        rel = Path(path).relative_to(paths.boxes)
    except ValueError:
        return None
    try:
        return check_sandbox_id(rel.parts[0]) if rel.parts else None
    except SandboxError:
        return None


class Mounts:
    """Layer mounts of lazyfetch under a sandbox's directory."""

    name = "mount"

    def __init__(self, host: HostMounts, paths: SandboxPaths) -> None:
        self.host = host
        self.paths = paths

    def release(self, sid: str) -> None:
        box = self.paths.box(sid)
        rootfs = box / "rootfs"
        mounted_here = kmount.is_mountpoint(rootfs)
        try:
            self.host.umount(rootfs, discard=True)  # also forgets a stale record
        except MountError:  # no record: a rootfs mounted here without one is only detached
            if mounted_here:
                kmount.umount(rootfs, lazy=True, missing_ok=True)
        except KernelMountError as exc:
            # EBUSY: something still reads the rootfs or a layer only it used.  Detached now and
            # freed when that reader lets go; raising would leave the cgroups, network, state (and,
            # from close(), every other sandbox and the daemon) behind
            log.warning("sandbox %s: %s; detaching it lazily", sid, exc)
            self.host.umount(rootfs, discard=True, lazy=True)
        forget_record(self.host, rootfs)  # its checkpoints' chain went with its writes
        # (a VM's disk layers are its backend's to unmount, after its VMM; what a crash left
        # under a sandbox's directory, reconcile's sweep finds by owner)

    def owners(self) -> set[str]:
        return {sid for mp in self.host.status()["mounts"] if (sid := _owner(self.paths, mp)) is not None}

    def reclaim(self, sid: str) -> None:
        """Every mount under ``sid``'s directory (what a crash left there)."""
        prefix = str(self.paths.box(sid)) + "/"
        for mp in self.host.status()["mounts"]:
            if mp.startswith(prefix):
                self.host.umount(mp, discard=True)


class Disks:
    """A sandbox's own ext4 (``disk=N``): ``boxes/<id>/disk.img`` loop-mounted at ``boxes/<id>/disk``."""

    name = "disk"

    def __init__(self, paths: SandboxPaths) -> None:
        self.paths = paths

    def acquire(self, sid: str, size: int) -> Path:
        """Make and mount the file system; the directory the overlay's upper goes in."""
        box = self.paths.box(sid)
        return sbdisk.make_disk(box / "disk.img", box / "disk", size) / "upper"

    def release(self, sid: str) -> None:
        box = self.paths.box(sid)
        sbdisk.remove_disk(box / "disk.img", box / "disk")

    def owners(self) -> set[str]:
        prefix = str(self.paths.boxes) + "/"
        return {sid for mp in kmount.mountpoints()
                if mp.startswith(prefix) and mp.endswith("/disk") and (sid := _owner(self.paths, mp)) is not None}

    reclaim = release


class Networks:
    """Network namespaces with their veth (a container) or tap (a VM) and egress policy.

    Made on first use: the manager's network reads the host's routes when it starts.
    ``protected``: the operator's ranges no rule may open (checked here, when the manager starts)."""

    name = "netns"

    def __init__(self, state_dir: Path, subnet: str, protected: Sequence[str | IPNetwork] = ()) -> None:
        self.state_dir = state_dir
        self.subnet = subnet
        self.protected = protected_ranges(protected)
        self._net: NetworkManager | None = None

    @property
    def manager(self) -> NetworkManager:
        if self._net is None:
            self._net = NetworkManager(self.state_dir, subnet=self.subnet, protected=self.protected)
        return self._net

    def check(self, rules: Sequence[EgressRule], *, allow_protected: bool = False) -> None:
        """Refuse, before a sandbox is made, the rules :meth:`acquire` would refuse."""
        self.manager.check(rules, allow_protected=allow_protected)

    def acquire(self, sid: str, rules: Sequence[EgressRule], *, userns_fd: int | None = None,
                vm: bool = False, allow_protected: bool = False) -> NetnsInfo:
        """A policed namespace: default deny with these allow rules; one that would open a
        protected range is refused (ProtectedDestination) before anything is made, unless
        ``allow_protected``."""
        return self.manager.create(sid, rules, userns_fd=userns_fd, vm=vm, allow_protected=allow_protected)

    def acquire_isolated(self, sid: str) -> Path:
        """A namespace with nothing but loopback (and a VM's tap)."""
        return self.manager.create_isolated(sid)

    def release(self, sid: str) -> None:
        if self.state_dir.exists():
            self.manager.destroy(sid)  # after the processes: nothing holds the namespace any more

    def owners(self) -> set[str]:
        return set(self.manager.list()) if self.state_dir.exists() else set()

    reclaim = release


class Cgroups:
    """A sandbox's cgroup (``/<parent>/<id>`` in every hierarchy), under one parent per data dir.

    A container's is made by crun, a VMM's by the VM backend; both go the same way.  An emptied
    container's is kept (renamed ``kept-<owner tag>-<id>``, up to ``KEEP`` of them) and the next
    sandbox of the same owner (project) gets that one renamed to its id (CgroupLayout.reuse:
    why).  Only the same owner's: a kept memory cgroup still has the page cache its sandbox
    left charged, a figure the next sandbox can read.

    The parent goes with the data dir's last sandbox, and a create may start at that moment, in
    this process or another manager's on the same data dir: ``lock`` (a file of the data dir)
    orders them.  A create has made its sandbox's directory before :meth:`acquire` takes the
    lock shared; :meth:`release_parent` takes it exclusive and looks again for a sandbox's
    directory first.  So the parent is either kept for that create or gone before it makes the
    parent again, never removed between its making and crun's mkdir of the child (which then
    failed: "creating cgroup directory ...: No such file or directory")."""

    name = "cgroup"
    KEEP = 256  # kept cgroups per data dir: creates and destroys alternate, so a few serve a busy host

    def __init__(self, parent: str, lock: Path, layout: Callable[[], CgroupLayout] | None = None,
                 sysfs: SharedSysfs | None = None, runfs: RunFs | None = None) -> None:
        self.parent = parent
        self.lock = lock
        # the data dir's mounts that go with its last sandbox: made and dropped with the parent,
        # under its lock (the runfs first: a create cannot go on without it)
        self.runfs = runfs
        self.sysfs = sysfs
        self._make_layout = layout or preflight_cgroups
        self._layout: CgroupLayout | None = None
        self._kept: dict[str, list[str]] | None = None  # owner tag -> names; another manager may take one first
        self._lock = threading.Lock()

    @property
    def layout(self) -> CgroupLayout:
        if self._layout is None:
            self._layout = self._make_layout()
        return self._layout

    def path(self, sid: str) -> str:
        return f"/{self.parent}/{check_sandbox_id(sid)}"

    def acquire(self, sid: str, owner: str = "", memory: int = 0) -> str:
        """The cgroup path of a new sandbox of ``owner`` with a ``memory`` limit, its parent made
        ready first (CgroupLayout.prepare_parent: the parent goes with the host's last sandbox, and
        whoever makes a child first makes it); one of the owner's kept cgroups when one fits.  One
        that does not fit is removed: left, it would be forgotten here and stay until the host
        empties (gone already when another manager took it)."""
        path = self.path(sid)
        with flocked(self.lock, shared=True):
            self.layout.prepare_parent(f"/{self.parent}")
            for shared in (self.runfs, self.sysfs):
                if shared is not None:
                    shared.prepare()
            while (name := self._take(_owner_tag(owner))) is not None:
                if self.layout.reuse(f"/{self.parent}/{name}", path, memory):
                    break
                self.layout.remove(f"/{self.parent}/{name}", wait=0)
        return path

    def _names(self) -> dict[str, list[str]]:
        """The kept cgroups this process knows of, by owner tag (under the lock): listed once,
        then its own keeps added and takes removed."""
        if self._kept is None:
            self._kept = {}
            for name in self.layout.kept(f"/{self.parent}"):
                self._kept.setdefault(name[len(KEPT_PREFIX):][:TAG_CHARS], []).append(name)
        return self._kept

    def _take(self, tag: str) -> str | None:
        with self._lock:
            names = self._names().get(tag)
            return names.pop() if names else None

    def keep(self, sid: str, owner: str = "") -> bool:
        """Keep the sandbox's cgroup for the owner's next one, when its last task is gone
        (CgroupLayout.keep); False when it is not kept (the caller's destroy removes it)."""
        with self._lock:
            if sum(map(len, self._names().values())) >= self.KEEP:
                return False
        tag = _owner_tag(owner)
        name = f"{KEPT_PREFIX}{tag}-{check_sandbox_id(sid)}"
        if not self.layout.keep(self.path(sid), f"/{self.parent}/{name}"):
            return False
        with self._lock:
            self._names().setdefault(tag, []).append(name)
        return True

    def release(self, sid: str) -> None:
        self.layout.remove(self.path(sid))

    def release_parent(self, empty: Callable[[], bool]) -> bool:
        """Remove the parent, and the cgroups kept under it, if ``empty()`` (no sandbox has a
        directory in the data dir) still holds under the lock; whether it did.  Not waited for: a
        cgroup still busy under it is the next reconcile's."""
        with flocked(closed_dir(self.lock.parent) / self.lock.name):
            if not empty():
                return False
            with self._lock:
                self._kept = None
            self.layout.drop_kept(f"/{self.parent}")
            self.layout.remove(f"/{self.parent}", wait=0)
            for shared in (self.sysfs, self.runfs):
                if shared is not None:
                    shared.drop()
        return True

    def owners(self) -> set[str]:
        found: set[str] = set()
        for d in self.layout.dirs(f"/{self.parent}"):
            try:
                names = os.listdir(d)
            except OSError:
                continue
            for name in names:
                try:
                    found.add(check_sandbox_id(name))
                except SandboxError:
                    continue
        return found

    reclaim = release


TAG_CHARS = 12


def cgroup_owner(options: SandboxOptions) -> str:
    """Whose kept cgroups a sandbox may get (Cgroups): its project's, a warm pool's sandbox its
    pool's project's; the host's own (no project) share theirs."""
    return options.project or options.labels.get(POOL_PROJECT_LABEL) or ""


def _owner_tag(owner: str) -> str:
    """A kept cgroup's owner in its name: a hash (a project name may be longer than a cgroup's)."""
    return hashlib.sha256(owner.encode()).hexdigest()[:TAG_CHARS]


class Uids:
    """Host uids from the manager's pools (sandbox.isolation.idmap.RangePool): a range of 65536
    for a user-namespaced sandbox, one uid for a VMM's jail (a pool of its own, so that VMs are
    not capped by the number of user namespace ranges)."""

    name = "userns"

    def __init__(self, pool: RangePool, jails: RangePool) -> None:
        self.pool = pool
        self.jails = jails

    def acquire(self, sid: str) -> tuple[int, int]:
        return self.pool.allocate(sid)

    def jail(self, owner: str) -> int:
        legacy = self.pool.owners().get(owner)  # a VMM jailed before its own pool: it keeps its uid
        return legacy if legacy is not None else self.jails.allocate(owner)[0]

    def release(self, sid: str) -> None:
        # after the processes: no process of the range is left
        self.pool.release(sid)
        self.jails.release(sid)

    def owners(self) -> set[str]:
        """Sandbox ids, and the names of template boots a crash interrupted (their VMM's jail)."""
        return set(self.pool.owners()) | set(self.jails.owners())

    reclaim = release


class HostResources:
    """Every step of one manager, in the order a destroy releases them."""

    def __init__(self, *, mounts: Mounts, disks: Disks, networks: Networks, cgroups: Cgroups, uids: Uids) -> None:
        self.mounts, self.disks, self.networks, self.cgroups, self.uids = mounts, disks, networks, cgroups, uids

    @property
    def order(self) -> tuple[HostResource, ...]:
        # mounts before the disk the upper lives on; the network and cgroup once no process is left
        # (the backend stopped them); the uid range last: no file or process of it remains
        return (self.mounts, self.disks, self.networks, self.cgroups, self.uids)

    def release(self, sid: str) -> None:
        for step in self.order:
            step.release(sid)

    def sweep(self, keep: set[str]) -> list[str]:
        """Release what sandboxes not in ``keep`` hold (owners a crash left); ``<step>:<id>`` each."""
        released = []
        for step in self.order:
            for sid in sorted(step.owners() - keep):
                step.reclaim(sid)
                released.append(f"{step.name}:{sid}")
        return released
