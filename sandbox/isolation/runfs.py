"""A memory file system for what exists only while the data dir's containers run.

crun's state (its ``--root``) and each container's OCI bundle (``config.json``, the init's pid
file, each running command's process document and pid file) are made at every create and
command and removed at every destroy and exit.  On the data dir's disk each is a new inode, and
ext4 without a journal (this project's CI hosts) skips, at each inode it allocates, every inode
freed in the last minute (``recently_deleted``): on a host that creates and destroys sandboxes
all the time a file cost 0.4-0.9 ms to make, and a sandbox of a fork made 23 (bench/README.md,
"The data dir's inodes").  None of these files outlives the host's processes: after a reboot the
containers are gone too.  So they live in a tmpfs at ``<data>/sandbox/run``::

    run/crun/            crun --root of every container made while it is mounted
    run/bundles/<id>/    a container's bundle

It is mounted with the cgroup parent and unmounted with it, when the data dir's last sandbox
goes, under the same lock (:class:`sandbox.isolation.resources.Cgroups`); a manager that
restarts finds it, and its containers' state, still there.  A create that cannot mount it fails
(nothing is written to the directory beneath, which the mount would later hide).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from layerstore.hoststate import flocked
from lazyfetch import kmount
from lazyfetch.errors import KernelMountError
from sandbox.core.errors import HostUnsupported

log = logging.getLogger("layerbox.sandbox")

# Bounds a runaway, nothing more: a container takes ~30 KB here (crun's copy of its config and
# seccomp program, its bundle), 10,000 of them ~300 MB; tmpfs uses only what is written.
SIZE = "25%"


class RunFs:
    def __init__(self, path: Path, lock: Path) -> None:
        self.path = path
        self.lock = lock  # who mounts it (two creates may find it missing at once)
        self.crun = path / "crun"
        self.bundles = path / "bundles"

    def ready(self) -> bool:
        return kmount.is_mountpoint(self.path)

    def prepare(self) -> None:
        """Mount it if it is not (the caller holds the cgroup parent's lock shared)."""
        if self.ready():
            return
        with flocked(self.lock):
            if not self.ready():
                self.path.mkdir(mode=0o700, exist_ok=True)
                try:
                    kmount.mount_tmpfs(self.path, f"mode=0700,size={SIZE}")
                except KernelMountError as exc:
                    raise HostUnsupported(f"{self.path}: cannot mount the tmpfs for crun's state and the "
                                          f"containers' bundles: {exc}") from exc
            for d in (self.crun, self.bundles):
                d.mkdir(mode=0o700, exist_ok=True)

    def drop(self) -> None:
        """Unmount it (the caller holds the parent's lock exclusive and found no sandbox), unless a
        container's state or bundle is still in it: a destroy that failed half-way, which the
        next reconcile finishes with it mounted."""
        if not self.ready():
            return
        left = [f"{d.name}/{name}" for d in (self.crun, self.bundles) if d.is_dir() for name in os.listdir(d)]
        if left:
            log.warning("%s stays mounted: it still holds %s", self.path, ", ".join(sorted(left)[:5]))
            return
        kmount.umount(self.path, lazy=True, missing_ok=True)
