"""User-namespace plumbing for sandboxes: a mapping holder and idmapped mounts.

A sandbox in a user namespace runs its root as an unprivileged host uid
(``host_base``), but its rootfs is an overlay of EROFS layers and an upper
directory whose files are owned by host uid 0.  An idmapped mount of the
rootfs shifts ownership for the container only: host uid 0 files appear as
``host_base`` (container root), and what container root writes is stored as
host uid 0, so the upper directory (and the checkpoints made from it) keep
the image's ownership.  The host-side mount the manager's file API uses is
left as it is.

The kernel takes the mapping of an idmapped mount from a user namespace fd
(``mount_setattr(2)`` with ``MOUNT_ATTR_IDMAP``).  The namespace only has to
exist while the mount is made: the mount keeps its own reference, so the
holder process is killed straight away.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import signal
import struct
from collections.abc import Iterator
from typing import Final

from lazyfetch import kmount

CLONE_NEWUSER: Final = 0x10000000

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


class IdmapError(OSError):
    """A kernel refusal while setting up a user namespace or an idmapped mount (errno kept)."""


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
def idmapped_clone(src: str | os.PathLike[str], target: str | os.PathLike[str], ns_fd: int, *,
                   recursive: bool = False) -> None:
    """Attach a copy of the mount at ``src`` on ``target``, idmapped through the user namespace ``ns_fd``.

    ``src`` stays as it is.  The copy is a detached mount (``open_tree`` with
    ``OPEN_TREE_CLONE``) until ``move_mount`` attaches it, so a refusal leaves
    nothing behind.  Raises :class:`IdmapError` naming the step and errno:
    EINVAL from ``mount_setattr`` means the filesystem does not support
    idmapped mounts.
    """
    src_b, dst_b = os.fsencode(os.path.abspath(src)), os.fsencode(os.path.abspath(target))
    flags = OPEN_TREE_CLONE | os.O_CLOEXEC | (AT_RECURSIVE if recursive else 0)
    step = "open_tree"
    try:
        tree = _syscall("open_tree", _AT_FDCWD, src_b, flags)
    except OSError as exc:
        raise IdmapError(exc.errno or errno.EIO, f"open_tree({os.fsdecode(src_b)!r}): {exc.strerror}") from exc
    try:
        step = "mount_setattr(MOUNT_ATTR_IDMAP)"
        attr = _MOUNT_ATTR.pack(MOUNT_ATTR_IDMAP, 0, 0, ns_fd)
        _syscall("mount_setattr", tree, b"", AT_EMPTY_PATH | (AT_RECURSIVE if recursive else 0),
                 attr, _MOUNT_ATTR.size)
        step = "move_mount"
        _syscall("move_mount", tree, b"", _AT_FDCWD, dst_b, MOVE_MOUNT_F_EMPTY_PATH)
    except OSError as exc:
        hint = ""
        if step.startswith("mount_setattr") and exc.errno == errno.EINVAL:
            hint = " (the filesystem does not support idmapped mounts, or the mount is already idmapped)"
        raise IdmapError(exc.errno or errno.EIO,
                         f"{step} of {os.fsdecode(src_b)!r} onto {os.fsdecode(dst_b)!r}: {exc.strerror}{hint}"
                         ) from exc
    finally:
        os.close(tree)


def unmount(target: str | os.PathLike[str]) -> None:
    """Remove the idmapped mount at ``target`` if there is one (lazily: a dying container may hold it)."""
    kmount.umount(target, lazy=True, missing_ok=True)
