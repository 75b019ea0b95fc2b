"""Host paths of the sandbox manager, opened only beneath the directory that owns them.

Every host path the manager touches for a sandbox is derived from its checked
id (:func:`sandbox.core.model.check_sandbox_id`) and opened with
``openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)``
relative to a directory of the data dir: even a name our code got wrong, or a
symlink someone planted, cannot make a state, receipt or bundle file resolve
outside it.  Directories are made mode 0700 (0711 where a user-namespaced
sandbox's uid must traverse them, see the manager).

Layout under ``<data-dir>/sandbox/`` (docs/FORMAT.md, "Sandbox host state")::

    run/                   a tmpfs while the data dir has sandboxes (sandbox.isolation.runfs):
    run/crun/              crun --root
    run/bundles/<id>/      a container's config.json, and each running exec's process document and pid file
    runtime/, boxes/<id>/bundle/   where an older layerbox kept those two, on disk (its containers stay)
    bin/<pid>-<n>/crun     the sealed copy of crun a manager process runs (a symlink into its fds)
    boxes/<id>/state.json  the sandbox's SandboxState
    receipts/<id>.jsonl    its receipt log's live segment (<id>.<n>.jsonl: sealed ones, sandbox.core.receipts)
    leases/<project>/      one file per job's lease, and the project's lock (sandbox.core.leases)
    cgroups.lock           creates (shared) against the removal of the cgroup parent (sandbox.isolation.resources.Cgroups)
    edge.key               the edge's secret for per-sandbox tokens (edge_key)
"""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

from layerstore.hoststate import closed_dir, private_fd, read_settled, swap_in, tightened
from sandbox.core.errors import HostUnsupported
from sandbox.core.model import check_sandbox_id

SYS_OPENAT2 = 437  # the same number on x86_64 and in the generic table (arm64)
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dir_fd: int, path: str, flags: int, mode: int, resolve: int) -> int:
    """``openat2(2)``; raises ``OSError`` with the kernel's errno (EAGAIN is retried: a rename
    somewhere made the kernel unsure a ``..`` stayed inside, the documented answer is to retry)."""
    # openat2 refuses a mode without O_CREAT/O_TMPFILE (EINVAL), unlike open(2)
    how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & (os.O_CREAT | os.O_TMPFILE) else 0, resolve)
    encoded = os.fsencode(path)
    for _ in range(64):
        fd = _libc.syscall(SYS_OPENAT2, dir_fd, encoded, ctypes.byref(how), ctypes.sizeof(how))
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err != errno.EAGAIN:
            break
    if err == errno.ENOSYS:
        raise HostUnsupported("openat2(2) is unavailable (Linux >= 5.6 needed): layerbox opens sandbox "
                              "paths only with its RESOLVE_* guarantees")
    raise OSError(err, os.strerror(err), path)


STRICT = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS


def open_beneath(base: str | os.PathLike[str], rel: str, flags: int, mode: int = 0o600) -> int:
    """Open ``rel`` (no symlinks anywhere, no ``..`` above) beneath the directory ``base``."""
    dir_fd = os.open(base, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return openat2(dir_fd, rel, flags, mode, STRICT)
    finally:
        os.close(dir_fd)


def read_beneath(base: str | os.PathLike[str], rel: str, *, private: bool = False) -> bytes:
    """The bytes of ``rel``; ``private``: a file only root may read, tightened to 0600 if an older
    layerbox left it looser (it sits in a directory other uids may have to traverse)."""
    def opened() -> int:
        fd = open_beneath(base, rel, os.O_RDONLY)
        return tightened(fd) if private else fd

    # (one version: replace_beneath reuses the inode of the one before.  The name's check is an
    # identity, so a plain lstat will do: a path that resolved elsewhere names another inode)
    return read_settled(opened, lambda: os.stat(os.path.join(base, rel), follow_symlinks=False))


def replace_beneath(base: str | os.PathLike[str], rel: str, data: bytes) -> None:
    """Write ``rel`` whole: a temp file beside it, then exchanged with it (``swap_in``; readers of
    :func:`read_beneath` see one version, old or new).

    No fsync: these files describe processes and mounts that a host crash ends anyway;
    reconcile rebuilds from what the kernel still has.
    """
    parent, _, name = rel.rpartition("/")
    dir_fd = os.open(base, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        pdir = openat2(dir_fd, parent or ".", os.O_PATH | os.O_DIRECTORY, 0, STRICT)
        try:
            tmp = f".{name}.{os.getpid()}.tmp"
            fd = openat2(pdir, tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600, STRICT)
            try:
                private_fd(fd)  # a temp file a crash left behind keeps its mode through O_CREAT
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            swap_in(tmp, name, dir_fd=pdir)  # (the old version stays at tmp: no inode freed or made)
        finally:
            os.close(pdir)
    finally:
        os.close(dir_fd)


EDGE_KEY_BYTES = 32


def edge_key(root: Path) -> bytes:
    """The edge's own secret, ``<root>/edge.key`` (32 random bytes, mode 0600), made on first use:
    what per-sandbox tokens are derived from when the operator gives no secret, so that they
    survive the edge's restart as its sandboxes do.  A file of another size is refused (a torn
    write cannot happen: the key is written beside and renamed over)."""
    path = root / "edge.key"
    try:
        key = path.read_bytes()
    except FileNotFoundError:
        closed_dir(root)  # one edge per data dir: nobody else writes it meanwhile
        replace_beneath(root, "edge.key", os.urandom(EDGE_KEY_BYTES))
        key = path.read_bytes()
    if len(key) != EDGE_KEY_BYTES:
        raise HostUnsupported(f"{path}: {len(key)} bytes, expected {EDGE_KEY_BYTES}; remove it to make a new key "
                              "(tokens given out before then stop working)")
    return key


class SandboxPaths:
    """Where one manager keeps what it knows; every per-sandbox path goes through a checked id."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.root = data_dir / "sandbox"
        self.boxes = self.root / "boxes"
        self.receipts = self.root / "receipts"
        self.runtime = self.root / "runtime"
        self.cgroups_lock = self.root / "cgroups.lock"
        self.sysfs = self.root / "sysfs"  # sandbox.isolation.sysfs
        self.sysfs_lock = self.root / "sysfs.lock"
        self.run = self.root / "run"  # sandbox.isolation.runfs: a tmpfs
        self.run_lock = self.root / "run.lock"
        self.crun = self.run / "crun"
        self.bundles = self.run / "bundles"

    def box(self, sid: str) -> Path:
        return self.boxes / check_sandbox_id(sid)

    def bundle(self, sid: str) -> tuple[Path, str]:
        """A container's OCI bundle as (the directory it is opened beneath, its path there):
        ``run/bundles/<id>``, or ``boxes/<id>/bundle`` where an older layerbox made it (docs/FORMAT.md)."""
        sid = check_sandbox_id(sid)
        if (self.boxes / sid / "bundle").is_dir():
            return self.boxes, f"{sid}/bundle"
        return self.bundles, sid

    def ensure(self) -> None:
        """Make the manager's directories 0700 (and tighten looser ones left by older versions):
        never readable or writable by others; o+x may stay (userns, see the manager)."""
        for d in (self.root, self.boxes, self.receipts):
            closed_dir(d)
        if self.runtime.is_dir():  # an older layerbox's crun state (its containers may live on)
            closed_dir(self.runtime)
