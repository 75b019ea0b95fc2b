"""The one place that talks to the kernel's mount API.

Everything goes through libc via ctypes: ``mount(2)`` for file-backed EROFS
layers (``mount -t erofs FILE`` from util-linux would silently set up a loop
device instead), the new mount API (``fsopen``/``fsconfig``/``fsmount``/
``move_mount``) for overlayfs so that many long ``lowerdir+`` paths never hit
the one-page limit of ``mount(2)``'s option string, ``mount(2)`` of a FUSE
connection (lazyfetch/fuseserver.py serves it), and ``umount2(2)``.
Mount state is read from ``/proc/self/mountinfo``, never guessed from
``st_dev`` (bind mounts and same-device mounts defeat that).

Nothing here prints; every failure is a :class:`KernelMountError` (an
``OSError`` with the kernel's errno) or a :class:`MountArgumentError`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import platform
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, NoReturn, TypeAlias

from lazyfetch.errors import KernelMountError, MountArgumentError

StrPath: TypeAlias = str | os.PathLike[str]

# mount(2) flags (<linux/mount.h>); callers combine them for ``flags=``.
MS_RDONLY: Final = 0x1
MS_NOSUID: Final = 0x2
MS_NODEV: Final = 0x4
MS_NOEXEC: Final = 0x8
MS_NOATIME: Final = 0x400
MS_NODIRATIME: Final = 0x800
MS_RELATIME: Final = 0x200000
MS_STRICTATIME: Final = 0x1000000

# umount2(2) flags.
MS_REMOUNT: Final = 0x20
MS_BIND: Final = 0x1000
MNT_DETACH: Final = 0x2
UMOUNT_NOFOLLOW: Final = 0x8

# New mount API constants (<linux/mount.h>).
_FSOPEN_CLOEXEC: Final = 0x1
_FSCONFIG_SET_FLAG: Final = 0
_FSCONFIG_SET_STRING: Final = 1
_FSCONFIG_CMD_CREATE: Final = 6
_FSMOUNT_CLOEXEC: Final = 0x1
_MOVE_MOUNT_F_EMPTY_PATH: Final = 0x4
_AT_FDCWD: Final = -100

# MS_* flag -> MOUNT_ATTR_* for fsmount(2); MS_RELATIME is fsmount's default.
_MS_TO_MOUNT_ATTR: Final = {
    MS_RDONLY: 0x1,
    MS_NOSUID: 0x2,
    MS_NODEV: 0x4,
    MS_NOEXEC: 0x8,
    MS_NOATIME: 0x10,
    MS_STRICTATIME: 0x20,
    MS_NODIRATIME: 0x80,
    MS_RELATIME: 0x0,
}

# The new mount syscalls got one number on every architecture except alpha;
# we list only those we have run on.  Elsewhere we behave as if the kernel
# lacked them (ENOSYS) and use mount(2).
_SYSCALL_NUMBERS: Final = {
    "x86_64": {"move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "mount_setattr": 442},
    "aarch64": {"move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "mount_setattr": 442},
}
_SYSCALL_NUMBERS["arm64"] = _SYSCALL_NUMBERS["aarch64"]

# The two EROFS superblock fields mount_erofs checks: magic and extra_devices
# (<fs/erofs/erofs_fs.h>: superblock at byte 1024, extra_devices at +86).
_EROFS_SUPER_OFFSET: Final = 1024
_EROFS_MAGIC: Final = 0xE0F5E1E2
_EROFS_SB_PREFIX: Final = struct.Struct("<I82xH")
assert _EROFS_SB_PREFIX.size == 88

_MOUNTINFO: Final = "/proc/self/mountinfo"
_OCTAL_ESCAPE: Final = re.compile(rb"\\([0-7]{3})")


# --------------------------------------------------------------------------
# libc access


@functools.cache
def _libc() -> ctypes.CDLL:
    # Loaded on first use, not at import, so importing this module has no
    # side effects (and works on hosts without a glibc-compatible libc).
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mount.argtypes = [
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_ulong,
        ctypes.c_char_p,
    ]
    libc.mount.restype = ctypes.c_int
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.umount2.restype = ctypes.c_int
    libc.statx.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
    libc.statx.restype = ctypes.c_int
    # syscall() is variadic: no argtypes; every integer is passed as c_long
    # because glibc reads each variadic argument as a long.
    libc.syscall.restype = ctypes.c_long
    return libc


def _syscall(name: str, *args: int | bytes | None) -> int:
    """Run one of the new mount syscalls; raise ``OSError`` on failure."""
    numbers = _SYSCALL_NUMBERS.get(platform.machine())
    if numbers is None:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))
    cargs: list[ctypes.c_long | ctypes.c_char_p] = [
        ctypes.c_char_p(a) if isinstance(a, bytes) or a is None else ctypes.c_long(a)
        for a in args
    ]
    ctypes.set_errno(0)
    result = int(_libc().syscall(ctypes.c_long(numbers[name]), *cargs))
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


# --------------------------------------------------------------------------
# argument checks


def _path_bytes(path: StrPath, role: str) -> bytes:
    """Absolute path as bytes; absolute so that errors and mountinfo agree."""
    raw = os.fsencode(os.path.abspath(os.fspath(path)))
    if b"\0" in raw:
        raise MountArgumentError(f"{role} path {os.fsdecode(raw)!r} contains a NUL byte")
    return raw


def _page_size() -> int:
    return os.sysconf("SC_PAGE_SIZE")


def _check_data_fits(data: bytes, what: str) -> None:
    # path_mount() copies exactly one page of options and NUL-terminates it,
    # so anything longer would be silently truncated by the kernel.
    limit = _page_size() - 1
    if len(data) > limit:
        raise MountArgumentError(
            f"{what}: the option string is {len(data)} bytes but mount(2) accepts at most "
            f"{limit}; use shorter layer paths (short symlinks to the layers work) or fewer "
            "layers, or run on Linux 6.8+ where overlayfs takes layers one by one (lowerdir+)"
        )


def _mount_attr(flags: int) -> int:
    attr = 0
    for ms_flag, mount_attr in _MS_TO_MOUNT_ATTR.items():
        if flags & ms_flag:
            attr |= mount_attr
            flags &= ~ms_flag
    if flags:
        raise MountArgumentError(
            f"mount flags {flags:#x} are not supported by the overlay mount; "
            "use MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC or the atime flags"
        )
    return attr


# --------------------------------------------------------------------------
# error diagnosis


def _missing(paths: dict[str, bytes]) -> list[str]:
    return [f"{role} {os.fsdecode(p)!r} does not exist" for role, p in paths.items()
            if not os.path.lexists(p)]


def _hint(err: int, fstype: str, paths: dict[str, bytes]) -> str:
    """The likely cause of a refused mount, checked against the paths involved."""
    mountpoint = paths.get("mount point", b"")
    if err == errno.ENOENT:
        missing = _missing(paths)
        return "; ".join(missing) if missing else "a path component does not exist"
    if err == errno.ENOTDIR:
        if mountpoint and os.path.exists(mountpoint) and not os.path.isdir(mountpoint):
            return "the mount point is not a directory"
        return "a path that must be a directory is not one"
    if err == errno.ENODEV:
        return f"the kernel does not know {fstype!r}: is the {fstype} module loaded? (modprobe {fstype})"
    if err == errno.ENOTBLK and fstype == "erofs":
        return ("this kernel cannot mount EROFS images from regular files; "
                "it needs Linux 6.12+ with CONFIG_EROFS_FS_BACKED_BY_FILE=y")
    if err in (errno.EPERM, errno.EACCES):
        return "mounting needs CAP_SYS_ADMIN in the initial user namespace: run as root"
    if err == errno.EBUSY:
        return "something is already mounted there or the source is in use"
    if err == errno.EINVAL and fstype == "erofs":
        return ("the file is not a valid EROFS image or its blob does not match it; "
                "dmesg has the kernel's reason; check with fsck.erofs --device=BLOB META")
    if err == errno.EINVAL and fstype == "overlay":
        return ("overlayfs rejected the layers or options; dmesg has the reason "
                "(upper and work must be on one filesystem, neither inside the other)")
    return ""


def _raise_mount_error(
    err: int,
    *,
    operation: str,
    source: bytes,
    fstype: str,
    options: str,
    paths: dict[str, bytes],
    kernel_log: tuple[str, ...] = (),
) -> NoReturn:
    raise KernelMountError(
        err,
        operation=operation,
        source=os.fsdecode(source),
        mountpoint=os.fsdecode(paths["mount point"]),
        fstype=fstype,
        options=options,
        # The kernel's own words beat our generic EINVAL guess.
        hint="" if kernel_log and err == errno.EINVAL else _hint(err, fstype, paths),
        kernel_log=kernel_log,
    )


# --------------------------------------------------------------------------
# mount(2)


def _mount2(
    source: bytes, target: bytes, fstype: str, flags: int, data: bytes, paths: dict[str, bytes]
) -> None:
    ctypes.set_errno(0)
    if _libc().mount(source, target, fstype.encode(), flags, data or None) != 0:
        _raise_mount_error(
            ctypes.get_errno(),
            operation="mount",
            source=source,
            fstype=fstype,
            options=os.fsdecode(data),
            paths=paths,
        )


def bind_mount(source: StrPath, mountpoint: StrPath, *, readonly: bool = True, flags: int = 0) -> None:
    """Bind ``source`` at ``mountpoint`` (read-only by default: a one-layer image view).

    ``flags`` are ``MS_*`` flags (``MS_NOSUID``, ``MS_NODEV``, ``MS_NOEXEC``,
    atime).  With ``readonly`` or ``flags`` the bind carries exactly those,
    whatever the source mount has; a bare bind copies the source's.
    """
    src = _path_bytes(source, "bind source")
    dst = _path_bytes(mountpoint, "mount point")
    paths = {"bind source": src, "mount point": dst}
    _mount2(src, dst, "none", MS_BIND, b"", paths)
    flags |= MS_RDONLY if readonly else 0
    if flags:
        # the initial bind ignores these flags and copies the source's: a remount of the bind
        # sets exactly the ones given
        try:
            remount_bind(mountpoint, flags)
        except KernelMountError:
            umount(mountpoint, lazy=True, missing_ok=True)
            raise


def mount_sysfs(mountpoint: StrPath, *, flags: int = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC) -> None:
    """A sysfs at ``mountpoint``: of the calling thread's network namespace (its ``class/net``)."""
    dst = _path_bytes(mountpoint, "mount point")
    _mount2(b"sysfs", dst, "sysfs", flags, b"", {"mount point": dst})


def mount_tmpfs(mountpoint: StrPath, options: str, *, flags: int = MS_NOSUID | MS_NODEV | MS_NOEXEC) -> None:
    """A tmpfs at ``mountpoint`` with ``options`` (``mode=0700,size=...``)."""
    dst = _path_bytes(mountpoint, "mount point")
    _mount2(b"tmpfs", dst, "tmpfs", flags, options.encode(), {"mount point": dst})


def remount_bind(mountpoint: StrPath, flags: int) -> None:
    """Set exactly ``flags`` (``MS_RDONLY``, ``MS_NOSUID``, ...) on the bind mount at ``mountpoint``."""
    dst = _path_bytes(mountpoint, "mount point")
    _mount2(b"none", dst, "none", MS_BIND | MS_REMOUNT | flags, b"", {"mount point": dst})


def _declared_extra_devices(meta: bytes) -> int | None:
    """The image's extra device count, or None if it is not readable as EROFS."""
    try:
        with open(meta, "rb") as f:
            f.seek(_EROFS_SUPER_OFFSET)
            raw = f.read(_EROFS_SB_PREFIX.size)
    except OSError:
        return None  # let the kernel report it with its errno
    if len(raw) < _EROFS_SB_PREFIX.size:
        return None
    magic, extra_devices = _EROFS_SB_PREFIX.unpack(raw)
    return int(extra_devices) if magic == _EROFS_MAGIC else None


def _refuse_missing_blob(meta: bytes) -> None:
    # Without device= the kernel mounts such an image anyway, in "flat
    # device" mode: chunk addresses then point into the metadata image
    # itself, so reads return its bytes (or EIO past its end) instead of
    # failing the mount.
    extra = _declared_extra_devices(meta)
    if extra:
        raise MountArgumentError(
            f"EROFS image {os.fsdecode(meta)!r} keeps file data on {extra} extra device(s) "
            "but no blob was given; pass blob=<its blob file>"
        )


def mount_erofs(
    meta: StrPath, mountpoint: StrPath, blob: StrPath | None = None, *, flags: int = MS_RDONLY,
    direct: bool = False,
) -> None:
    """Mount the EROFS metadata image ``meta`` (a regular file) on ``mountpoint``.

    ``blob`` is the extra device that holds the chunk-based files' data; it is
    passed as ``device=<blob>`` and may be a regular file or a block device.
    ``flags`` are ``MS_*`` flags; EROFS is read-only whatever they say.
    ``direct``: the kernel reads a file-backed image and its blob with direct I/O
    (``directio``, Linux 6.13+), so their bytes are not cached as well as the files'.

    Raises :class:`MountArgumentError` when the blob path contains a comma
    (the option string cannot express it) or when ``blob`` is missing but the
    image declares an extra device, and :class:`KernelMountError` when
    the kernel refuses, with the errno and a hint.
    """
    meta_b = _path_bytes(meta, "metadata image")
    target = _path_bytes(mountpoint, "mount point")
    paths = {"metadata image": meta_b, "mount point": target}
    data = b""
    if blob is None:
        _refuse_missing_blob(meta_b)
    else:
        blob_b = _path_bytes(blob, "blob")
        if b"," in blob_b:
            raise MountArgumentError(
                f"blob path {os.fsdecode(blob_b)!r} contains a comma, which cannot be passed "
                "in the device= mount option; move or link the blob to a path without commas"
            )
        paths["blob"] = blob_b
        data = b"device=" + blob_b
    if direct:
        data += b",directio" if data else b"directio"
    _check_data_fits(data, f"erofs mount of {os.fsdecode(meta_b)!r}")
    _mount2(meta_b, target, "erofs", flags, data, paths)


def mount_fuse(
    device_fd: int,
    mountpoint: StrPath,
    options: str,
    *,
    fstype: str = "fuse.layerbox",
    source: str = "layerbox",
    flags: int = MS_NOSUID | MS_NODEV | MS_RDONLY,
) -> int:
    """Mount the FUSE connection of the open ``/dev/fuse`` ``device_fd`` on ``mountpoint``.

    ``options`` are the FUSE options after ``fd=N`` (``rootmode=40000,user_id=0,...``).
    Returns the new mount's device number: it names the connection in
    /sys/fs/fuse/connections/ and its bdi in /sys/class/bdi/.  It is read with
    statx(AT_STATX_DONT_SYNC), because a plain stat would wait for a FUSE server that
    cannot be running yet (nobody has replied to the kernel's INIT).
    """
    target = _path_bytes(mountpoint, "mount point")
    data = f"fd={device_fd},{options}".encode()
    _check_data_fits(data, f"{fstype} mount on {os.fsdecode(target)!r}")
    _mount2(source.encode(), target, fstype, flags, data, {"mount point": target})
    buf = ctypes.create_string_buffer(_STATX_BUF)
    if _libc().statx(_AT_FDCWD, target, _AT_SYMLINK_NOFOLLOW | _AT_STATX_DONT_SYNC, 0, buf) != 0:
        err = ctypes.get_errno()
        umount(mountpoint, lazy=True, missing_ok=True)  # a mount nobody would serve
        raise KernelMountError(err, operation="statx of the new mount", source=source,
                               mountpoint=os.fsdecode(target), fstype=fstype)
    major, minor = _STATX_DEV.unpack_from(buf, 136)  # stx_dev_major, stx_dev_minor
    return os.makedev(major, minor)


# --------------------------------------------------------------------------
# overlayfs


def _ovl_escape(path: bytes, specials: bytes) -> bytes:
    # overlayfs drops a backslash before any character; mount(2)'s option
    # parser for overlay honours it before commas, lowerdir's split before ':'.
    out = bytearray()
    for byte in path:
        if byte in specials:
            out += b"\\"
        out.append(byte)
    return bytes(out)


def _split_option(option: str) -> tuple[bytes, bytes | None]:
    key, sep, value = option.partition("=")
    if not key or "," in option or "\0" in option:
        raise MountArgumentError(
            f"overlay option {option!r} is not a single 'key' or 'key=value' option; "
            "pass each option as its own string"
        )
    if key in ("lowerdir", "lowerdir+", "upperdir", "workdir"):
        raise MountArgumentError(
            f"overlay option {key!r} is set from the lowers/upper/work arguments; "
            "do not pass it in options"
        )
    return key.encode(), value.encode() if sep else None


def _drain_log(fd: int) -> tuple[str, ...]:
    """The messages the kernel attached to a filesystem context ("e overlay: ...")."""
    messages: list[str] = []
    for _ in range(32):
        try:
            raw = os.read(fd, 4096)
        except OSError:  # ENODATA: the log is empty
            break
        if not raw:
            break
        messages.append(raw.decode("utf-8", "backslashreplace").rstrip("\n"))
    return tuple(messages)


class _FallBack(Exception):
    """The new mount API or lowerdir+ is unavailable: use mount(2)."""


def _overlay_new_api(
    lowers_top_first: list[bytes],
    target: bytes,
    upper: bytes | None,
    work: bytes | None,
    options: list[tuple[bytes, bytes | None]],
    attr: int,
    paths: dict[str, bytes],
) -> None:
    try:
        fs_fd = _syscall("fsopen", b"overlay", _FSOPEN_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ENOSYS:
            raise _FallBack from exc
        _raise_mount_error(exc.errno or errno.EIO, operation="fsopen", source=b"overlay",
                           fstype="overlay", options="", paths=paths)
    step = "fsconfig source"
    try:
        _syscall("fsconfig", fs_fd, _FSCONFIG_SET_STRING, b"source", b"overlay", 0)
        for index, lower in enumerate(lowers_top_first):
            step = f"fsconfig lowerdir+ {os.fsdecode(lower)!r}"
            try:
                # lowerdir+ values are taken literally: no escaping needed.
                _syscall("fsconfig", fs_fd, _FSCONFIG_SET_STRING, b"lowerdir+", lower, 0)
            except OSError as exc:
                if index == 0 and exc.errno == errno.EINVAL:
                    raise _FallBack from exc  # kernel < 6.8 knows no lowerdir+
                raise
        if upper is not None and work is not None:
            # upperdir/workdir values are unescaped by overlayfs even here.
            step = f"fsconfig upperdir {os.fsdecode(upper)!r}"
            _syscall("fsconfig", fs_fd, _FSCONFIG_SET_STRING, b"upperdir",
                     _ovl_escape(upper, b"\\"), 0)
            step = f"fsconfig workdir {os.fsdecode(work)!r}"
            _syscall("fsconfig", fs_fd, _FSCONFIG_SET_STRING, b"workdir",
                     _ovl_escape(work, b"\\"), 0)
        for key, value in options:
            step = f"fsconfig {key.decode()}"
            if value is None:
                _syscall("fsconfig", fs_fd, _FSCONFIG_SET_FLAG, key, None, 0)
            else:
                _syscall("fsconfig", fs_fd, _FSCONFIG_SET_STRING, key, value, 0)
        step = "fsconfig create"
        _syscall("fsconfig", fs_fd, _FSCONFIG_CMD_CREATE, None, None, 0)
        step = "fsmount"
        mnt_fd = _syscall("fsmount", fs_fd, _FSMOUNT_CLOEXEC, attr)
        try:
            step = "move_mount"
            _syscall("move_mount", mnt_fd, b"", _AT_FDCWD, target, _MOVE_MOUNT_F_EMPTY_PATH)
        finally:
            os.close(mnt_fd)
    except OSError as exc:
        _raise_mount_error(
            exc.errno or errno.EIO,
            operation=step,
            source=b"overlay",
            fstype="overlay",
            options=_describe_layers(lowers_top_first, upper, work, options),
            paths=paths,
            kernel_log=_drain_log(fs_fd),
        )
    finally:
        os.close(fs_fd)


def _describe_layers(
    lowers_top_first: list[bytes],
    upper: bytes | None,
    work: bytes | None,
    options: list[tuple[bytes, bytes | None]],
) -> str:
    parts = [f"{len(lowers_top_first)} lower layers, top {os.fsdecode(lowers_top_first[0])}"]
    if upper is not None and work is not None:
        parts += [f"upperdir={os.fsdecode(upper)}", f"workdir={os.fsdecode(work)}"]
    parts += [k.decode() + ("" if v is None else "=" + v.decode("utf-8", "replace"))
              for k, v in options]
    return ",".join(parts)


def _overlay_legacy_data(
    lowers_top_first: list[bytes],
    upper: bytes | None,
    work: bytes | None,
    options: list[tuple[bytes, bytes | None]],
) -> bytes:
    """The mount(2) option string; raises MountArgumentError beyond one page."""
    fields = [b"lowerdir=" + b":".join(_ovl_escape(p, b"\\:,") for p in lowers_top_first)]
    if upper is not None and work is not None:
        fields.append(b"upperdir=" + _ovl_escape(upper, b"\\,"))
        fields.append(b"workdir=" + _ovl_escape(work, b"\\,"))
    fields += [key if value is None else key + b"=" + value for key, value in options]
    data = b",".join(fields)
    _check_data_fits(data, f"overlay mount of {len(lowers_top_first)} lower layers")
    return data


def mount_overlay(
    lowers: Sequence[StrPath],
    mountpoint: StrPath,
    *,
    upper: StrPath | None = None,
    work: StrPath | None = None,
    options: Sequence[str] = (),
    flags: int = 0,
) -> None:
    """Mount an overlay of ``lowers`` (given **lowest first**) on ``mountpoint``.

    Without ``upper`` the overlay is read-only; with it, ``work`` is required
    (an empty directory on the same filesystem as ``upper``).  ``options`` are
    extra overlayfs options, one ``key`` or ``key=value`` per string
    (``"redirect_dir=on"``, ``"userxattr"``).  ``flags`` are ``MS_*`` flags.

    Uses fsopen/fsconfig("lowerdir+")/fsmount/move_mount so that the layer
    list is not limited to one page; falls back to mount(2) when the kernel
    lacks the new API (ENOSYS) or lowerdir+ (EINVAL, Linux < 6.8), raising
    :class:`MountArgumentError` if the option string then exceeds a page.
    """
    if not lowers:
        raise MountArgumentError("an overlay needs at least one lower layer")
    if upper is None and len(lowers) < 2:
        # overlayfs refuses this with a bare EINVAL ("at least 2 lowerdir are
        # needed while upperdir nonexistent" goes to dmesg only).
        raise MountArgumentError(
            f"a read-only overlay needs at least two lower layers, got {os.fspath(lowers[0])!r}; "
            "mount the single layer directly or add an upper and work directory"
        )
    if (upper is None) != (work is None):
        raise MountArgumentError(
            "overlay upper and work directories go together: pass both or neither"
        )
    target = _path_bytes(mountpoint, "mount point")
    # overlayfs lists the top layer first; our callers list the lowest first.
    lowers_top_first = [_path_bytes(p, "lower layer") for p in reversed(lowers)]
    upper_b = None if upper is None else _path_bytes(upper, "upper directory")
    work_b = None if work is None else _path_bytes(work, "work directory")
    parsed = [_split_option(o) for o in options]
    if upper is None:
        flags |= MS_RDONLY
    paths = {"mount point": target}
    paths.update({f"lower layer {i}": p for i, p in enumerate(reversed(lowers_top_first))})
    if upper_b is not None and work_b is not None:
        paths.update({"upper directory": upper_b, "work directory": work_b})
    try:
        _overlay_new_api(lowers_top_first, target, upper_b, work_b, parsed,
                         _mount_attr(flags), paths)
        return
    except _FallBack:
        pass
    data = _overlay_legacy_data(lowers_top_first, upper_b, work_b, parsed)
    _mount2(b"overlay", target, "overlay", flags, data, paths)


# --------------------------------------------------------------------------
# unmounting and mount state


def umount(mountpoint: StrPath, *, lazy: bool = False, missing_ok: bool = False) -> None:
    """Unmount the filesystem mounted on ``mountpoint`` (the topmost one if stacked).

    ``lazy`` detaches it now and frees it when the last user goes
    (MNT_DETACH).  A final symlink is not followed, so pass the real path.
    When nothing is mounted there (EINVAL) or the path does not exist
    (ENOENT), raises :class:`KernelMountError` unless ``missing_ok``.
    """
    target = _path_bytes(mountpoint, "mount point")
    flags = UMOUNT_NOFOLLOW | (MNT_DETACH if lazy else 0)
    ctypes.set_errno(0)
    if _libc().umount2(target, flags) == 0:
        return
    err = ctypes.get_errno()
    if missing_ok and err in (errno.EINVAL, errno.ENOENT):
        return
    hint = ""
    if err == errno.EINVAL:
        hint = "nothing is mounted there (umount does not follow a final symlink)"
    elif err == errno.EBUSY:
        hint = "the mount is in use: stop its users or pass lazy=True to detach it"
    elif err == errno.EPERM:
        hint = "unmounting needs CAP_SYS_ADMIN: run as root"
    raise KernelMountError(
        err,
        operation="umount2",
        source=None,
        mountpoint=os.fsdecode(target),
        fstype=None,
        hint=hint,
    )


@dataclass(frozen=True, slots=True)
class MountInfo:
    """One line of /proc/self/mountinfo, escapes decoded."""

    mount_id: int
    parent_id: int
    root: str
    mountpoint: str
    mount_options: str
    fstype: str
    source: str
    super_options: str
    dev: int = 0  # st_dev of the mount's files, from the "major:minor" field (no stat: a FUSE mount may hang)


def _unescape(field: bytes) -> str:
    return os.fsdecode(_OCTAL_ESCAPE.sub(lambda m: bytes([int(m.group(1), 8)]), field))


def _parse_mountinfo_line(line: bytes) -> MountInfo:
    fields = line.split(b" ")
    sep = fields.index(b"-", 6)  # optional fields (shared:N ...) end at "-"
    return MountInfo(
        mount_id=int(fields[0]),
        parent_id=int(fields[1]),
        root=_unescape(fields[3]),
        mountpoint=_unescape(fields[4]),
        mount_options=fields[5].decode(),
        fstype=_unescape(fields[sep + 1]),
        source=_unescape(fields[sep + 2]),
        super_options=_unescape(fields[sep + 3]) if len(fields) > sep + 3 else "",
        dev=os.makedev(*map(int, fields[2].split(b":"))),
    )


def read_mountinfo() -> list[MountInfo]:
    """This process's mount table, in mount order (parents before children)."""
    with open(_MOUNTINFO, "rb") as f:
        return [_parse_mountinfo_line(line) for line in f.read().splitlines() if line]


def _escape(path: str) -> bytes:
    # the kernel's show_path escaping (seq_path with " \t\n\\")
    return (os.fsencode(path).replace(b"\\", b"\\134").replace(b" ", b"\\040")
            .replace(b"\t", b"\\011").replace(b"\n", b"\\012"))


def _raw_mountpoints() -> list[bytes]:
    # Only field 5 (the mount point), still escaped.  A host holding 1,000 sandboxes has
    # 1,000+ mounts, and each create and destroy asks several times: parsing every
    # field of every line (read_mountinfo) cost ~13 ms per sandbox cycle at 300 held.
    with open(_MOUNTINFO, "rb") as f:
        return [line.split(b" ", 5)[4] for line in f.read().splitlines() if line]


def mountpoints() -> list[str]:
    """Every mount point of this process's mount table, in mount order."""
    return [_unescape(mp) if b"\\" in mp else os.fsdecode(mp) for mp in _raw_mountpoints()]


_AT_SYMLINK_NOFOLLOW: Final = 0x100
_AT_NO_AUTOMOUNT: Final = 0x800
_AT_STATX_DONT_SYNC: Final = 0x4000
_STATX_ATTR_MOUNT_ROOT: Final = 0x2000
_STATX_BUF: Final = 256  # sizeof(struct statx)
_STATX_ATTRIBUTES = struct.Struct("=Q")  # stx_attributes at 8, stx_attributes_mask at 56
_STATX_DEV = struct.Struct("=II")  # stx_dev_major, stx_dev_minor at 136


def _statx_mount_root(path: bytes) -> bool | None:
    """statx's own answer (Linux >= 5.8) for what ``path`` names (symlinks followed), or None
    when it has none and mountinfo must say."""
    libc = _libc()
    buf = ctypes.create_string_buffer(_STATX_BUF)
    # DONT_SYNC: a FUSE mount point answers from cached attributes, so a hung daemon
    # cannot hang the question
    flags = _AT_NO_AUTOMOUNT | _AT_STATX_DONT_SYNC
    if libc.statx(_AT_FDCWD, path, flags, 0, buf) != 0:
        err = ctypes.get_errno()
        return False if err in (errno.ENOENT, errno.ENOTDIR) else None
    (supported,) = _STATX_ATTRIBUTES.unpack_from(buf, 56)
    if not supported & _STATX_ATTR_MOUNT_ROOT:
        return None
    (attributes,) = _STATX_ATTRIBUTES.unpack_from(buf, 8)
    return bool(attributes & _STATX_ATTR_MOUNT_ROOT)


_STATX_MNT_ID: Final = 0x1000
_STATX_MNT_ID_UNIQUE: Final = 0x4000  # Linux 6.8+
_STATX_MASK = struct.Struct("=I")  # stx_mask at 0
_STATX_U64 = struct.Struct("=Q")  # stx_mnt_id at 144


def mount_id(mountpoint: StrPath) -> int | None:
    """The id of the mount whose root is ``mountpoint`` (a final symlink is not followed), or
    None when nothing is mounted exactly there.

    The unique id where the kernel has it (``STATX_MNT_ID_UNIQUE``, Linux 6.8+: never given
    to another mount while the host runs), else the plain one (reused once the mount is
    gone); one kernel always answers with the same kind, which :func:`umount_mount` relies on.
    """
    target = _path_bytes(mountpoint, "mount point")
    buf = ctypes.create_string_buffer(_STATX_BUF)
    flags = _AT_SYMLINK_NOFOLLOW | _AT_NO_AUTOMOUNT | _AT_STATX_DONT_SYNC
    if _libc().statx(_AT_FDCWD, target, flags, _STATX_MNT_ID | _STATX_MNT_ID_UNIQUE, buf) != 0:
        return None
    (supported,) = _STATX_ATTRIBUTES.unpack_from(buf, 56)
    (attributes,) = _STATX_ATTRIBUTES.unpack_from(buf, 8)
    (mask,) = _STATX_MASK.unpack_from(buf, 0)
    if not supported & _STATX_ATTR_MOUNT_ROOT or not attributes & _STATX_ATTR_MOUNT_ROOT:
        return None
    if not mask & (_STATX_MNT_ID | _STATX_MNT_ID_UNIQUE):
        return None
    return int(_STATX_U64.unpack_from(buf, 144)[0])


def umount_mount(mountpoint: StrPath, mount: int) -> bool:
    """Detach (``MNT_DETACH``) the mount on ``mountpoint`` if it is still the one
    :func:`mount_id` called ``mount``; whether it did.  For an unmount made outside the lock
    that chose it: a mount stacked there since, or nothing, is left alone.  (Between the check
    and the unmount a new mount could still come: the window is one system call wide.)"""
    if mount_id(mountpoint) != mount:
        return False
    umount(mountpoint, lazy=True, missing_ok=True)
    return True


def is_mountpoint(path: StrPath) -> bool:
    """Whether something is mounted exactly on ``path`` (after resolving symlinks).

    One statx call, which resolves the symlinks itself (``os.path.realpath`` walked
    every component again in Python: ~9 calls per sandbox create); the mount table is
    read only where statx cannot tell (a dead FUSE daemon's mount point answers
    ENOTCONN), since reading it costs ~5 ms with 600 sandboxes' mounts on the host.
    """
    answer = _statx_mount_root(os.fsencode(path))
    if answer is not None:
        return answer
    wanted = _escape(os.path.realpath(path))
    return any(mp == wanted for mp in _raw_mountpoints())


def mounts_under(prefix: StrPath) -> list[str]:
    """Mount points at or below ``prefix``, deepest first, so unmounting in order works.

    A path with several stacked mounts appears once per mount, topmost first.
    """
    real = _escape(os.path.realpath(prefix))
    below = real.rstrip(b"/") + b"/"
    found = [_unescape(mp) for mp in reversed(_raw_mountpoints()) if mp == real or mp.startswith(below)]
    # sorted() is stable, so stacked mounts keep their topmost-first order.
    return sorted(found, key=lambda p: p.rstrip("/").count("/"), reverse=True)


# --------------------------------------------------------------------------
# a mount in another process's namespace

_CLONE_FS: Final = 0x00000200
_CLONE_NEWNS: Final = 0x00020000
_MOUNT_ATTR_STRUCT: Final = struct.Struct("=QQQQ")  # struct mount_attr, MOUNT_ATTR_SIZE_VER0


def set_flags_in(pid: int, path: str, flags: int) -> None:
    """Add ``MS_*`` ``flags`` (``MS_NOSUID``, ``MS_NODEV``, ...) to the mount at ``path`` as
    process ``pid`` sees it, in ``pid``'s mount namespace (``mount_setattr``, not recursive).

    Runs on a short-lived thread: ``setns`` into a mount namespace needs a thread that shares
    no file-system context (``unshare(CLONE_FS)`` first), and the thread ends with it, so the
    caller's namespace, root and cwd are untouched.
    """
    import threading

    attr = _mount_attr(flags)
    failure: list[BaseException] = []

    def work() -> None:
        try:
            ns = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
            try:
                libc = _libc()
                if libc.unshare(_CLONE_FS) != 0 or libc.setns(ns, _CLONE_NEWNS) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"entering the mount namespace of {pid}: {os.strerror(err)}")
            finally:
                os.close(ns)
            _syscall("mount_setattr", _AT_FDCWD, os.fsencode(path), 0,
                     _MOUNT_ATTR_STRUCT.pack(attr, 0, 0, 0), _MOUNT_ATTR_STRUCT.size)
        except BaseException as exc:  # re-raised on the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=work, name=f"mountns-{pid}")
    thread.start()
    thread.join()
    if failure:
        exc = failure[0]
        if isinstance(exc, OSError) and exc.errno is not None:
            raise KernelMountError(exc.errno, operation=f"mount_setattr in process {pid}'s mount namespace",
                                   source=None, mountpoint=path, fstype=None, options=f"{flags:#x}") from None
        raise exc
