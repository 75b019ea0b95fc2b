"""One sysfs for every container that has no network of its own.

A container's ``/sys`` is a sysfs mount, and sysfs has one superblock per network namespace: to
mount one, the kernel compares the new namespace with every sysfs superblock on the host
(``kernfs_test_super``), so each create cost more the more sandboxes the host held (2.2 ms of
crun's kernel time per create with 3,200 held; bench/README.md).  A sandbox with no network has
a namespace of its own that holds only ``lo``, and sysfs shows of a network namespace only its
interfaces (``/sys/class/net``; the rest of sysfs is the host's in every namespace).  So such
containers bind one sysfs, read-only, mounted once per data dir from an empty network namespace
made for it: what each would have mounted, without a superblock each.  (What differs: the
counters under ``/sys/class/net/lo/statistics`` are that namespace's, always 0; ``/proc/net/dev``
and netlink still give the sandbox's own.)  A sandbox with a network keeps a sysfs of its own.

The mount lives at ``<data>/sandbox/sysfs`` and goes with the data dir's last sandbox, under the
lock that orders the cgroup parent's life (:class:`sandbox.isolation.resources.Cgroups`): made
while a create holds it shared, removed only by whoever holds it exclusive and finds no sandbox.
"""

from __future__ import annotations

import logging
from pathlib import Path

from layerstore.hoststate import flocked
from lazyfetch import kmount
from lazyfetch.errors import KernelMountError
from sandbox.core.errors import SandboxError
from sandbox.isolation import network

log = logging.getLogger("layerbox.sandbox")


class SharedSysfs:
    def __init__(self, path: Path, lock: Path) -> None:
        self.path = path
        self.lock = lock  # who makes the mount (two creates may find it missing at once)
        # the empty network namespace, kept by a bind of its nsfs file: a sysfs holds only a passive
        # reference to its namespace, whose `lo` goes (from /sys/class/net) when its last process does
        self.netns = path.with_name(path.name + ".net")

    def ready(self) -> bool:
        return kmount.is_mountpoint(self.path)

    def prepare(self) -> None:
        """Mount it if it is not (the caller holds the parent's lock shared).  Where that fails,
        containers mount a sysfs each, as before: slower on a full host, never wrong."""
        if self.ready():
            return
        with flocked(self.lock):
            if self.ready():
                return
            self.path.mkdir(mode=0o755, exist_ok=True)
            kmount.umount(self.netns, lazy=True, missing_ok=True)  # (a half-made one, a crash's)
            self.netns.touch(mode=0o600)
            try:
                network.new_netns(self.netns)
                # bound as the namespace is: the data dir's mounts are all nosuid,nodev
                kmount.remount_bind(self.netns, kmount.MS_RDONLY | kmount.MS_NOSUID | kmount.MS_NODEV
                                    | kmount.MS_NOEXEC)
                # mounted from inside it (the mount's tag), into the host's mount namespace
                network.run_in(self.netns, lambda: kmount.mount_sysfs(self.path))
            except (SandboxError, KernelMountError, OSError) as exc:
                log.warning("no shared sysfs (each container mounts its own): %s", exc)
                self.drop()

    def drop(self) -> None:
        """Unmount it (the caller holds the parent's lock exclusive and found no sandbox); the
        containers that bound it keep theirs."""
        kmount.umount(self.path, lazy=True, missing_ok=True)
        kmount.umount(self.netns, lazy=True, missing_ok=True)
