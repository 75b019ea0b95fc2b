"""Landlock for the host side of the files API: a thread that can only reach one tree.

The files API runs as host root on paths a sandbox controls.  ``openat2``
with ``RESOLVE_IN_ROOT`` already keeps each path inside the sandbox's root;
this is the second fence, kept by the kernel for the whole operation: every
file-system access of the thread that performs it (open, create, unlink,
rename, truncate...) is refused with EACCES outside ``root``, whatever path a
bug in our code (or a race) would have produced.

A Landlock domain is per thread and cannot be lifted, so each operation runs on
a fresh thread that ends with it (:func:`run_confined`); the pool threads of
the caller are never restricted.  Descriptors the operation returns stay
usable afterwards (Landlock checks at open time).  Hosts without Landlock
(Linux < 5.13, or ``lsm=`` without it) run the operation unconfined, with
``openat2`` still in force; :func:`abi` says which.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import struct
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from sandbox.core.errors import SandboxError

T = TypeVar("T")

# include/uapi/asm-generic/unistd.h: the same numbers on x86_64 and arm64
_SYS_CREATE_RULESET = 444
_SYS_ADD_RULE = 445
_SYS_RESTRICT_SELF = 446
_CREATE_RULESET_VERSION = 1 << 0
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38

# access rights by ABI version: 1 has EXECUTE .. MAKE_SYM (bits 0-12), 2 adds REFER,
# 3 TRUNCATE, 5 IOCTL_DEV (4 and 6 add network and scope rights, not file-system ones)
_FS_RIGHTS = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}
_RULESET_ATTR = struct.Struct("=Q")  # handled_access_fs (a shorter attr is accepted)
_PATH_BENEATH_ATTR = struct.Struct("=Qi")  # allowed_access, parent_fd: packed, 12 bytes

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class LandlockError(SandboxError, OSError):
    """The kernel refused to build or apply the ruleset (``errno`` is the kernel's).

    Still an ``OSError``: it surfaces from :func:`run_confined`, i.e. from files-API
    operations, whose callers catch ``OSError``; :func:`abi` tests its ``errno``.
    """


def _syscall(number: int, *args: Any) -> int:
    ret = int(_libc.syscall(ctypes.c_long(number), *args))
    if ret < 0:
        err = ctypes.get_errno()
        raise LandlockError(err, os.strerror(err))
    return ret


@functools.cache
def abi() -> int:
    """The kernel's Landlock ABI version; 0 when Landlock is unavailable."""
    try:
        return _syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    except LandlockError as exc:
        if exc.errno in (errno.ENOSYS, errno.EOPNOTSUPP):
            return 0
        raise


def _fs_rights(version: int) -> int:
    return _FS_RIGHTS[max(v for v in _FS_RIGHTS if v <= version)]


def _restrict_to(root_fd: int) -> None:
    """Confine the calling thread to the tree under ``root_fd`` (every file-system right there)."""
    rights = _fs_rights(abi())
    attr = ctypes.create_string_buffer(_RULESET_ATTR.pack(rights), _RULESET_ATTR.size)
    ruleset = _syscall(_SYS_CREATE_RULESET, attr, ctypes.c_size_t(_RULESET_ATTR.size), ctypes.c_uint32(0))
    try:
        rule = ctypes.create_string_buffer(_PATH_BENEATH_ATTR.pack(rights, root_fd), _PATH_BENEATH_ATTR.size)
        _syscall(_SYS_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH), rule, ctypes.c_uint32(0))
        try:
            _syscall(_SYS_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0))
        except LandlockError as exc:
            if exc.errno != errno.EPERM:
                raise
            # without CAP_SYS_ADMIN the thread must first give up gaining privileges
            # (a per-thread flag, like the domain itself)
            if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
                err = ctypes.get_errno()
                raise LandlockError(err, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(err)}") from None
            _syscall(_SYS_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0))
    finally:
        os.close(ruleset)


def run_confined(root: str | os.PathLike[str] | int, fn: Callable[[], T]) -> T:
    """``fn()`` on a new thread that can reach nothing outside ``root``; its result or exception.

    ``root`` is a directory path or a descriptor of one (the caller keeps it).
    Without Landlock on this host, ``fn()`` still runs on its own thread, unconfined.
    """
    own = not isinstance(root, int)
    root_fd: int = root if isinstance(root, int) else os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            if abi() > 0:
                _restrict_to(root_fd)
            box["value"] = fn()
        except BaseException as exc:  # handed to the calling thread
            box["error"] = exc

    try:
        thread = threading.Thread(target=target, name="layerbox-files-confined")
        thread.start()
        thread.join()
    finally:
        if own:
            os.close(root_fd)
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value
