"""User-namespace plumbing for sandboxes: a mapping holder and idmapped overlays.

A sandbox in a user namespace runs its root as an unprivileged host uid
(``host_base``), but its rootfs is an overlay of EROFS layers and an upper
directory whose files are owned by host uid 0.  Idmapped mounts shift that
ownership: host uid 0 files appear as ``host_base`` (container root), and
what container root writes is stored as uid 0, so the upper directory (and
the checkpoints made from it) keep the image's ownership.

Overlayfs itself cannot be idmapped (``mount_setattr`` gives EINVAL on this
kernel, 6.18); its layers can.  So the rootfs overlay is rebuilt on idmapped,
detached copies of the same EROFS layers and upper (:func:`remap_rootfs`).
The host then sees the shifted ids too, and host root (kuid 0, unmapped)
cannot create files there: host-side writers act as container root with
:func:`fs_identity`.

The kernel takes an idmapped mount's mapping from a user namespace fd
(``mount_setattr(2)`` with ``MOUNT_ATTR_IDMAP``); the namespace only has to
exist while the mount is made, so its holder process is reaped at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import signal
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from layerstore.hoststate import HostTable
from lazyfetch import kmount
from lazyfetch.mounts import HostMounts
from sandbox.core.errors import SandboxError

CLONE_NEWUSER: Final = 0x10000000
_PR_GET_SECUREBITS: Final = 27
_PR_SET_SECUREBITS: Final = 28
_SECBIT_NO_SETUID_FIXUP: Final = 1 << 2

# <linux/mount.h>
OPEN_TREE_CLONE: Final = 0x1
AT_EMPTY_PATH: Final = 0x1000
AT_RECURSIVE: Final = 0x8000
MOUNT_ATTR_IDMAP: Final = 0x00100000
MOVE_MOUNT_F_EMPTY_PATH: Final = 0x4
_AT_FDCWD: Final = -100
# struct mount_attr { __u64 attr_set, attr_clr, propagation, userns_fd; } (MOUNT_ATTR_SIZE_VER0)
_MOUNT_ATTR: Final = struct.Struct("=QQQQ")

# Same numbers on x86_64 and aarch64 (the generic table); kmount only lists its own four.
_SYSCALLS: Final = {"open_tree": 428, "move_mount": 429, "mount_setattr": 442}


class IdmapError(SandboxError, OSError):
    """A kernel refusal while setting up a user namespace or an idmapped mount (errno kept).

    Still an ``OSError``: :func:`fs_identity` raises it inside files-API operations,
    whose callers catch ``OSError``, and callers test ``errno`` (EINVAL for an overlay).
    """


def _syscall(name: str, *args: int | bytes) -> int:
    if platform.machine() not in ("x86_64", "aarch64", "arm64"):
        raise IdmapError(errno.ENOSYS, f"{name}: syscall numbers unknown on {platform.machine()}")
    libc = kmount._libc()  # ctypes handle with use_errno and a c_long syscall() return
    cargs = [ctypes.c_char_p(a) if isinstance(a, bytes) else ctypes.c_long(a) for a in args]
    ctypes.set_errno(0)
    result = int(libc.syscall(ctypes.c_long(_SYSCALLS[name]), *cargs))
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


# -- the user namespace -------------------------------------------------------------------------
def _holder(ready_w: int, go_r: int) -> None:
    """Child side: enter a new user namespace, say so, then wait until the parent closes ``go``."""
    code = 0
    try:
        libc = kmount._libc()
        if libc.unshare(CLONE_NEWUSER) != 0:
            code = 1
            os.write(ready_w, str(ctypes.get_errno()).encode())
        else:
            os.write(ready_w, b"ok")
            os.read(go_r, 1)  # EOF when the parent is done (or dies)
    finally:
        os._exit(code)


def userns_fd(host_base: int, size: int) -> int:
    """An O_CLOEXEC fd of a new user namespace mapping uids and gids 0..size-1 to host_base.. .

    The namespace is created by a forked child (``unshare(CLONE_NEWUSER)``)
    whose maps the parent writes; the child is reaped before this returns and
    the fd alone keeps the namespace alive.  Close it when done.
    """
    if host_base <= 0 or size <= 0 or host_base + size > 1 << 32:
        raise ValueError(f"host range {host_base}+{size} is not a valid non-root uid range")
    ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
    go_r, go_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:  # pragma: no cover  (child; exits via os._exit)
        os.close(ready_r)
        os.close(go_w)
        _holder(ready_w, go_r)
    os.close(ready_w)
    os.close(go_r)
    try:
        answer = os.read(ready_r, 32)
        if answer != b"ok":
            err = int(answer) if answer.isdigit() else errno.EIO
            raise IdmapError(err, f"unshare(CLONE_NEWUSER) in the holder child: {os.strerror(err)}")
        line = f"0 {host_base} {size}\n".encode()
        # uid_map and gid_map can be written once each; the parent's CAP_SETUID/SETGID in the
        # parent namespace allows any range (no setgroups=deny needed then).
        for name in ("uid_map", "gid_map"):
            try:
                with open(f"/proc/{pid}/{name}", "wb", buffering=0) as f:
                    f.write(line)
            except OSError as exc:
                raise IdmapError(exc.errno or errno.EIO, f"writing /proc/{pid}/{name} ({line!r}): "
                                 f"{exc.strerror}") from exc
        return os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(ready_r)
        os.close(go_w)  # the child's read returns: it exits
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


@contextlib.contextmanager
def userns(host_base: int, size: int) -> Iterator[int]:
    """:func:`userns_fd` that closes the fd on exit."""
    fd = userns_fd(host_base, size)
    try:
        yield fd
    finally:
        os.close(fd)


# -- idmapped mounts ----------------------------------------------------------------------------
def idmapped_tree(src: str | os.PathLike[str], ns_fd: int) -> int:
    """A detached, idmapped copy of the mount at ``src`` (an O_CLOEXEC fd; close it when done).

    Overlayfs accepts such a tree as a layer through ``/proc/self/fd/<fd>``
    and keeps its own private clone (Linux 6.15+ allows detached mounts there),
    so the copy never appears in any mount table and needs no cleanup.
    """
    src_b = os.fsencode(os.path.abspath(src))
    try:
        tree = _syscall("open_tree", _AT_FDCWD, src_b, OPEN_TREE_CLONE | os.O_CLOEXEC)
    except OSError as exc:
        raise IdmapError(exc.errno or errno.EIO, f"open_tree({os.fsdecode(src_b)!r}): {exc.strerror}") from exc
    try:
        _syscall("mount_setattr", tree, b"", AT_EMPTY_PATH, _MOUNT_ATTR.pack(MOUNT_ATTR_IDMAP, 0, 0, ns_fd),
                 _MOUNT_ATTR.size)
    except OSError as exc:
        os.close(tree)
        hint = " (this filesystem does not support idmapped mounts)" if exc.errno == errno.EINVAL else ""
        raise IdmapError(exc.errno or errno.EIO, f"mount_setattr(MOUNT_ATTR_IDMAP) of {os.fsdecode(src_b)!r}: "
                         f"{exc.strerror}{hint}") from exc
    return tree


def idmapped_clone(src: str | os.PathLike[str], target: str | os.PathLike[str], ns_fd: int) -> None:
    """Attach an idmapped copy of the mount at ``src`` on ``target`` (``src`` stays as it is).

    Works for EROFS and ext4/tmpfs-like filesystems; overlayfs itself refuses
    (EINVAL from ``mount_setattr``): use :func:`mount_idmapped_overlay`.
    """
    tree = idmapped_tree(src, ns_fd)
    try:
        _syscall("move_mount", tree, b"", _AT_FDCWD, os.fsencode(os.path.abspath(target)), MOVE_MOUNT_F_EMPTY_PATH)
    except OSError as exc:
        raise IdmapError(exc.errno or errno.EIO, f"move_mount onto {os.fspath(target)!r}: {exc.strerror}") from exc
    finally:
        os.close(tree)


@contextlib.contextmanager
def fs_identity(uid: int, gid: int) -> Iterator[None]:
    """Run the block with this thread's fsuid/fsgid set to ``uid``/``gid``, capabilities kept.

    Overlayfs does its upper-layer work (workdir, copy-up, whiteouts) with the
    credentials of whoever mounted it.  Host root (kuid 0) has no mapping in
    the idmapped upper, so every such write would fail with EOVERFLOW and the
    overlay would come up read-only; as fsuid ``host_base`` those writes land
    on disk as uid 0.  SECBIT_NO_SETUID_FIXUP keeps CAP_CHOWN/DAC_OVERRIDE/...
    in the captured credentials (copy-up chowns, and reads files root can).
    fsuid and securebits are per-thread, so other threads are unaffected.
    """
    libc = kmount._libc()
    old_bits = int(libc.prctl(_PR_GET_SECUREBITS, 0, 0, 0, 0))
    if old_bits < 0 or libc.prctl(_PR_SET_SECUREBITS, old_bits | _SECBIT_NO_SETUID_FIXUP, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise IdmapError(err, f"prctl(PR_SET_SECUREBITS): {os.strerror(err)} (needs CAP_SETPCAP)")
    libc.setfsgid(gid)
    libc.setfsuid(uid)
    try:
        yield
    finally:
        libc.setfsuid(0)
        libc.setfsgid(0)
        libc.prctl(_PR_SET_SECUREBITS, old_bits, 0, 0, 0)


def mount_idmapped_overlay(target: str | os.PathLike[str], lowers: Sequence[str], upper: str, work: str,
                           host_base: int, size: int, *, ns_fd: int | None = None) -> None:
    """Mount on ``target`` an overlay whose layers are idmapped copies (0..size-1 -> host_base..).

    ``lowers`` are topmost first, as for :func:`lazyfetch.kmount.mount_overlay`.
    ``upper`` and ``work`` must share a mount (overlayfs requires it); the
    mount holding them is idmapped once.  The overlay is made with fsuid
    ``host_base`` (see :func:`fs_identity`), in the initial user namespace,
    so it keeps ``trusted.overlay.*`` xattrs: uppers stay interchangeable
    with the manager's plain overlays and checkpoints.  It carries the flags
    of every other sandbox rootfs (``HostMounts.VIEW_FLAGS``: nosuid, nodev).
    The idmapped copies keep their sources' flags (noexec layers), which the
    overlay does not look at.  ``ns_fd``: a user
    namespace with exactly this mapping, kept by the caller (saves the ~2 ms
    of :func:`userns_fd` per sandbox); one is made and dropped otherwise.
    """
    if not lowers:
        raise ValueError("an overlay needs at least one lower layer")
    base = os.path.commonpath([os.path.abspath(upper), os.path.abspath(work)])
    trees: list[int] = []
    try:
        with contextlib.ExitStack() as stack:
            fd = ns_fd if ns_fd is not None else stack.enter_context(userns(host_base, size))
            for lower in lowers:
                trees.append(idmapped_tree(lower, fd))
            trees.append(idmapped_tree(base, fd))
        top = f"/proc/self/fd/{trees[-1]}"
        with fs_identity(host_base, host_base):
            kmount.mount_overlay([f"/proc/self/fd/{t}" for t in trees[:-1]], target,
                                 upper=os.path.join(top, os.path.relpath(upper, base)),
                                 work=os.path.join(top, os.path.relpath(work, base)), flags=HostMounts.VIEW_FLAGS)
    finally:
        for t in trees:
            os.close(t)
    # the kernel mounts an overlay read-only instead of failing when its workdir is unusable
    # (statvfs, not mountinfo: one read of a large mount table costs more than the whole mount)
    if os.statvfs(target).f_flag & os.ST_RDONLY:
        with contextlib.suppress(OSError):
            kmount.umount(target, lazy=True, missing_ok=True)
        raise IdmapError(errno.EROFS, f"idmapped overlay on {os.fspath(target)!r} came up read-only "
                         "(dmesg: overlayfs could not use its workdir)")


@dataclass(frozen=True)
class OverlayLayers:
    lowers: list[str]  # topmost first
    upper: str | None
    work: str | None


def _mount_at(path: str | os.PathLike[str]) -> kmount.MountInfo | None:
    real = os.path.realpath(path)
    found = [m for m in kmount.read_mountinfo() if m.mountpoint == real]
    return found[-1] if found else None  # the topmost of stacked mounts


def overlay_layers(mountpoint: str | os.PathLike[str]) -> OverlayLayers:
    """The layers of the overlay mounted at ``mountpoint``, from the kernel's own record (mountinfo)."""
    info = _mount_at(mountpoint)
    if info is None or info.fstype != "overlay":
        raise IdmapError(errno.EINVAL, f"{os.fspath(mountpoint)!r} is not an overlay mount")
    lowers: list[str] = []
    upper = work = None
    # options are comma-separated; commas inside values are octal-escaped by the kernel
    for option in info.super_options.split(","):
        key, _, value = option.partition("=")
        if key == "lowerdir+":
            lowers.append(value)
        elif key == "lowerdir":
            if ":" in value:  # legacy colon list (kernel < 6.8): escaping rules differ, not handled
                raise IdmapError(errno.EINVAL, f"{os.fspath(mountpoint)!r}: legacy multi-lowerdir overlay")
            lowers.append(value)
        elif key == "upperdir":
            upper = value
        elif key == "workdir":
            work = value
        elif key == "datadir+":
            raise IdmapError(errno.EINVAL, f"{os.fspath(mountpoint)!r}: data-only layers are not handled")
    if any(p.startswith("/proc/") for p in [*lowers, upper or "", work or ""]):
        raise IdmapError(errno.EINVAL, f"{os.fspath(mountpoint)!r} is already an overlay of fd-passed layers")
    return OverlayLayers(lowers, upper, work)


def remap_rootfs(rootfs: str | os.PathLike[str], host_base: int, size: int, *,
                 ns_fd: int | None = None) -> OverlayLayers:
    """Replace the writable overlay at ``rootfs`` by the same overlay on idmapped layers.

    Same lowers, upper and work, same mount point: whatever unmounts the
    original (``HostMounts.umount``) unmounts this one.  If the idmapped
    overlay cannot be made, the original is mounted back before raising.
    """
    layers = overlay_layers(rootfs)
    if layers.upper is None or layers.work is None:
        raise IdmapError(errno.EINVAL, f"{os.fspath(rootfs)!r} is a read-only overlay (no upper)")
    kmount.umount(rootfs)
    try:
        mount_idmapped_overlay(rootfs, layers.lowers, layers.upper, layers.work, host_base, size, ns_fd=ns_fd)
    except BaseException:
        kmount.mount_overlay(layers.lowers, rootfs, upper=layers.upper, work=layers.work,
                             flags=HostMounts.VIEW_FLAGS)
        raise
    return layers


def unmount(target: str | os.PathLike[str]) -> None:
    """Remove the mount at ``target`` if there is one (lazily: a dying container may still hold it)."""
    kmount.umount(target, lazy=True, missing_ok=True)


# -- per-sandbox uid ranges ---------------------------------------------------------------------
RANGE_SIZE: Final = 65536  # uids 0..65535 inside: what Debian-style images use (nobody is 65534)


class RangesExhausted(SandboxError):
    """Every uid range of this manager's pool is taken (one per user-namespaced sandbox).

    Capacity, not a kernel refusal: retryable (a destroy frees a range), and not an
    ``OSError``, which callers read as a problem with the request's files.
    """

    retryable = True
    fix = "destroy a sandbox, or reconcile if sandboxes died with their manager, then retry"


class RangePool:
    """Distinct host uid ranges of ``size`` uids (``RANGE_SIZE``: a user namespace's; 1: a VMM's
    jail), one per owner, allocated from ``slots`` ranges at ``first``.

    ``first, first + size, ...``: slot ``k`` is host uids
    ``first + k*size ..``, so two sandboxes of one pool never share a
    host uid (root of one is not the owner of the other's processes or files).
    The table (``path``, host-state format ``layerbox.userns``: sid -> slot) is
    rewritten whole under an flock, so a CLI and the service on one data dir
    allocate consistently.  The lowest free slot is taken, which keeps the set
    of ranges (and the user namespace fds a manager caches per range) small.
    """

    def __init__(self, path: str | os.PathLike[str], first: int, slots: int, size: int = RANGE_SIZE) -> None:
        if first <= 0 or slots <= 0 or size <= 0 or first + slots * size > 1 << 32:
            raise ValueError(f"uid pool {first}+{slots}x{size} is not a valid non-root uid range")
        self.path = Path(path)
        self.first = first
        self.slots = slots
        self.size = size
        self.table = HostTable(self.path, "layerbox.userns", 1, upgrade=_unversioned_ranges,
                               empty=lambda: {"first": first, "size": size, "sandboxes": {}}, aside=(
                                   "only with no user-namespaced sandbox left: their ranges would be "
                                   "handed out again"))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, int]]:
        with self.table.locked() as body:
            yield body["sandboxes"]
            body.update(first=self.first, size=self.size)  # the pool the slots count in

    def base(self, slot: int) -> int:
        return self.first + slot * self.size

    def allocate(self, sid: str) -> tuple[int, int]:
        """``(host_base, size)`` for ``sid`` (the same one again if it already has a range)."""
        with self._locked() as table:
            if sid not in table:
                used = set(table.values())
                free = next((k for k in range(self.slots) if k not in used), None)
                if free is None:
                    raise RangesExhausted(f"all {self.slots} uid ranges of {self.path} are in use (one per "
                                          f"user-namespaced sandbox or VMM): {RangesExhausted.fix}")
                table[sid] = free
            return self.base(table[sid]), self.size

    def release(self, sid: str) -> None:
        """Free ``sid``'s range (nothing happens if it has none)."""
        if not self.path.exists():
            return
        with self._locked() as table:
            table.pop(sid, None)

    def owners(self) -> dict[str, int]:
        """sid -> host_base of every allocated range."""
        if not self.path.exists():
            return {}
        with self._locked() as table:
            return {sid: self.base(slot) for sid, slot in table.items()}


def _unversioned_ranges(doc: dict[str, Any], version: int | None) -> dict[str, Any]:
    """userns.json before the envelope: ``{"version": 1, "first", "size", "sandboxes"}``."""
    if doc.pop("version", None) != 1 or not isinstance(doc["sandboxes"], dict):
        raise ValueError("not a version 1 uid range table")
    return doc
