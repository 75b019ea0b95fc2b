"""envd's filesystem side: the Connect ``filesystem.Filesystem`` service and ``/files``.

**As whom.**  Every operation runs as the caller's account (:func:`~.envd.run_as`: the one
named, else E2B's ``user`` when the sandbox has it; ``username`` for ``/files``).  In a
container the edge does the path work itself (openat2 ``RESOLVE_IN_ROOT`` from the sandbox's
root, on a thread Landlock confines to it: ``RootFiles.within``) **with that account's
credentials**: the thread's fsuid, fsgid and supplementary groups (from the sandbox's own
/etc/passwd and /etc/group; shifted by the idmap of a user-namespaced sandbox) are the
account's, so the kernel checks every lookup, read and write as it would for a process of that
account, and what it creates is the account's (overlayfs creates as the caller's fsuid).
Leaving fsuid 0 drops the filesystem capabilities from the thread's effective set; the
supplementary groups are set with the raw syscall, which changes one thread (glibc's
``setgroups`` changes every thread of the edge).  ``root`` in a user-namespaced sandbox is its
own root (``idmap.fs_identity``).  A file written over an existing one keeps its owner (E2B's
envd chowns it; an account cannot); a new one is chowned to its owner as envd's is, so a
watcher sees envd's create, chmod, write.

**Paths** are envd's: ``~`` and relative paths start at the account's home, ``..`` is folded
before the lookup, and the result is resolved inside the sandbox (a symlink to ``/etc`` names
the sandbox's ``/etc``; a path that would leave the root is refused, 403, never the host).
Lookups stay on the root's own mount (``RESOLVE_NO_XDEV``: the sandbox's /proc, /sys, /dev
and other mounts are not reached from the host, as in the native files API); a download that
lands on one of them is read inside the sandbox instead, as the account (:mod:`.guestfs`'s
``cat``, as on a microVM), so ``/proc/meminfo`` reads as under envd and nothing there is read
with the host's rights.

**EntryInfo** is envd's: ``mode`` the permission bits (a symlink's: its target's),
``permissions`` Go's ``FileMode.String()`` (``-rw-r--r--``, ``drwxr-xr-x``, ``Lrwxrwxrwx``),
owner and group names from the sandbox's own files, ``symlink_target`` the link fully
resolved inside the sandbox with ``is_symlink`` set and ``type`` the target's, ``metadata``
the ``user.e2b.*`` extended attributes (set by an upload's ``X-Metadata-*`` headers).

**Watching** (containers) is inotify on the directories of the sandbox's root as the host
reaches it (the overlay's inodes are the sandbox's own, so its processes' changes are seen);
at most :data:`MAX_WATCHERS` per sandbox, :data:`MAX_WATCH_DIRS` directories each, and
:data:`MAX_EVENTS` events kept unread: a watcher whose reader falls that far behind ends with
RESOURCE_EXHAUSTED (the kernel's own queue is bounded too), so a client that stops reading
costs the edge a fixed amount.  A polled watcher (``CreateWatcher``) not polled for
:data:`WATCH_IDLE` seconds is dropped.  Recursive watches follow directories created later
(each new directory is scanned, so entries made before its watch was added are still reported
as created); a renamed directory keeps reporting under its old name.

**MicroVMs**: every call but watching is a command in the guest run as the account
(:mod:`.guestfs`, whose docstring says why and what differs); entries are described here as for
a container.  Watching is the guest kernel's inotify, read by a child of the guest agent run as
the account (:mod:`.guestwatch`), with the same events, bounds and recursion as a container's.

**/files**: ``GET`` streams a file (``Accept-Encoding: gzip`` compresses it), ``POST`` writes
one or several (``multipart/form-data``, each part's file name its path unless ``path`` is
given) or one (``application/octet-stream``, ``path`` required); a gzip request body is
decoded as it arrives; both stream, and count against the project's transfers as the native
files API's do.  The answer is envd's: 200 with ``[{"name", "type": "file", "path"}]``.
A request without ``X-Access-Token`` may carry envd's URL signature (``signature``,
``signature_expiration``: sha256 of ``path:operation:username:token[:expiration]`` under the
sandbox's envd access token), checked in constant time; an expired one is refused (401).
(With ``E2B_SANDBOX_URL`` the SDK's signed URLs do not name the sandbox; a proxy must add
``E2b-Sandbox-Id``, or the edge is reached by ``<port>-<id>.<domain>`` host names.)

**Known gaps**: a gzipped download serves no ``Range`` (an uncompressed one does); a directory renamed
under a recursive watch keeps reporting under its old name; renaming a directory that comes
from a lower layer of the overlay fails (EXDEV, 400) where the kernel's overlay has no
``redirect_dir``; microVMs: no metadata (:mod:`.guestfs`).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import ctypes
import errno
import functools
import hashlib
import hmac
import os
import platform
import posixpath
import re
import secrets
import stat
import struct
import time
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast

from aiohttp import web
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.filesystem import filesystem_pb as pb
from e2b.envd.filesystem.filesystem_connect import FilesystemASGIApplication
from protobuf import Oneof
from protobuf.wkt import Timestamp

from sandbox.backends.container.files import openat2_in_root, rmtree_at
from sandbox.core.errors import (
    ApiError,
    HostUnsupported,
    InvalidField,
    NotARegularFile,
    PathEscape,
    UnsupportedOption,
)
from sandbox.core.model import check_path
from sandbox.core.paths import RESOLVE_NO_XDEV
from sandbox.edge.auth import Project
from sandbox.edge.context import EdgeContext
from sandbox.host.sandbox import Sandbox
from sandbox.isolation import idmap

from . import guestfs
from .base import DEFAULT_USER, E2bContext, error_response
from .envd import EnvdCall, check_user, current, rpc, rpc_stream
from .guestfs import Download, Found, Guest, guest_for
from .guestwatch import GuestWatch
from .inotify import (
    IN_CREATE,
    IN_DELETE_SELF,
    IN_IGNORED,
    IN_ISDIR,
    IN_MOVE_SELF,
    IN_MOVED_TO,
    IN_Q_OVERFLOW,
    IN_UNMOUNT,
    KINDS,
    MAX_EVENTS,
    MAX_WATCH_DIRS,
    WATCH_MASK,
    take_events,
)
from .multipart import MultipartStream, boundary_of, media_type, next_chunk
from .process import keepalive

T = TypeVar("T")
W = TypeVar("W", "Watch", GuestWatch)
CHUNK = 1 << 20
SMALL_PIECE = 64 << 10  # a body's pieces below this are gathered into one buffer (so a batch stays ~33 iovecs)
READ_MAX_BYTES = 64 << 10  # a Connect request of this service holds paths, never data
ID_FILE_LIMIT = 1 << 20
MAX_ACCOUNTS = 16384  # accounts remembered across sandboxes (FilesystemService._remember)
MAX_ENTRIES = 100_000  # a listing's entries, every depth
MAX_DEPTH = 64
MAX_LINKS = 40  # symlinks followed while resolving one symlink's target (the kernel's)
MAX_WATCHERS = 16  # per sandbox, streams and polled watchers together
WATCH_IDLE = 600.0  # seconds a polled watcher lives without a GetWatcherEvents
ENDED_IDLE = 60.0  # the same for one that ended (its sandbox, its directory gone; overflowed)
MAX_METADATA = 64
GZIP_LEVEL = 1  # a download compressed as it streams: the edge's CPU, not the ratio, is what counts
NEW_FILE, NEW_DIR = 0o644, 0o755  # envd's 0666/0777 under its umask 022
OVERFLOW_ID = 65534

_LIBC = ctypes.CDLL(None, use_errno=True)
SYS_SETGROUPS = {"x86_64": 116, "aarch64": 159}.get(platform.machine())
EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then the name)


# -- who --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Account:
    """The account an operation runs as, as the sandbox names it, and its id names."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str
    users: dict[int, str] = field(repr=False)
    group_names: dict[int, str] = field(repr=False)


ID_FILES = ("/etc/passwd", "/etc/group")
Identity = tuple[tuple[int, ...] | None, ...]  # of ID_FILES: (dev, ino, size, mtime, ctime) each, None if absent


def read_account(root_fd: int, name: str) -> tuple[Account, Identity]:
    """``name``'s ids, groups and home from the sandbox's /etc/passwd and /etc/group, read from the
    root ``root_fd`` (on a confined thread), and the identity of the two files it was read from
    (:func:`id_files_identity`)."""
    (passwd, pid), (group, gid_) = (_id_file(root_fd, p) for p in ID_FILES)
    return _account(name, passwd, group), (pid, gid_)


def id_files_identity(root_fd: int) -> Identity:
    """What changes when the sandbox edits, replaces or removes /etc/passwd or /etc/group: each
    one's device, inode, size, mtime and ctime (an overlay's copy-up is a new inode)."""
    out: list[tuple[int, ...] | None] = []
    for path in ID_FILES:
        try:
            with _fd(root_fd, path, os.O_PATH) as fd:
                out.append(_stamp(os.fstat(fd)))
        except OSError:
            out.append(None)
    return tuple(out)


def _stamp(st: os.stat_result) -> tuple[int, ...]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _account(name: str, passwd: str, group: str) -> Account:
    users: dict[int, str] = {}
    groups: dict[int, str] = {}
    found: tuple[int, int, str] | None = None
    for line in passwd.splitlines():
        parts = line.split(":")
        if len(parts) > 5 and parts[2].isdigit() and parts[3].isdigit():
            users.setdefault(int(parts[2]), parts[0])
            if found is None and parts[0] == name:
                found = int(parts[2]), int(parts[3]), parts[5] or "/"
    if found is None and name == "root":
        found = 0, 0, "/root"
    if found is None:
        if not name.isdigit():
            raise UnsupportedOption(f"user {name!r} is not in the sandbox's /etc/passwd")
        found = int(name), int(name), "/"
    uid, gid, home = found
    member_of = {gid}
    for line in group.splitlines():
        parts = line.split(":")
        if len(parts) > 3 and parts[2].isdigit():
            groups.setdefault(int(parts[2]), parts[0])
            if name in parts[3].split(","):
                member_of.add(int(parts[2]))
    return Account(name, uid, gid, tuple(sorted(member_of)), home, users, groups)


def _id_file(root_fd: int, path: str) -> tuple[str, tuple[int, ...] | None]:
    try:
        fd = _regular(root_fd, path, os.O_RDONLY)
    except (OSError, InvalidField):
        return "", None
    try:
        stamp = _stamp(os.fstat(fd))
        data = b""
        while len(data) <= ID_FILE_LIMIT and (piece := os.read(fd, CHUNK)):
            data += piece
        return data[:ID_FILE_LIMIT].decode(errors="replace"), stamp
    finally:
        os.close(fd)


def _setgroups(groups: tuple[int, ...]) -> None:
    if SYS_SETGROUPS is None:
        raise HostUnsupported(f"setgroups: the syscall's number on {platform.machine()} is not known here")
    arr = (ctypes.c_uint * max(1, len(groups)))(*groups)
    if _LIBC.syscall(SYS_SETGROUPS, len(groups), arr) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setgroups: {os.strerror(err)}")


@contextlib.contextmanager
def _credentials(uid: int, gid: int, groups: tuple[int, ...]) -> Iterator[None]:
    """This thread's filesystem identity is ``uid``/``gid``/``groups`` for the block (see the module's
    docstring); the thread's own, which it gets back after, is host root's."""
    saved = tuple(os.getgroups())
    _setgroups(groups)
    try:
        _LIBC.setfsgid(gid)
        _LIBC.setfsuid(uid)
        if _LIBC.setfsuid(ctypes.c_uint32(0xFFFFFFFF)) != uid:  # (an invalid id reads the current one)
            raise HostUnsupported(f"setfsuid({uid}) did not take on this thread")
        yield
    finally:
        _LIBC.setfsuid(0)
        _LIBC.setfsgid(0)
        _setgroups(saved)


class Rooted(Protocol):
    """A container's files (``RootFiles``): path work of the caller's inside the sandbox's root."""

    def within(self, fn: Callable[[int], T]) -> T: ...


class Root:
    """A container's root as one account reaches it: :meth:`run` is blocking."""

    def __init__(self, files: Rooted, who: Account, userns: tuple[int, int] | None,
                 identity: Identity | None = None, remember: Callable[[Account, Identity], None] | None = None
                 ) -> None:
        self.files = files
        self.who = who
        self.userns = userns
        self.identity = identity  # of the files ``who`` was read from: checked before every operation
        self.remember = remember

    def _current(self, root_fd: int) -> None:
        """``who`` as the sandbox's files say now: a remembered account is read again when its
        passwd or group changed since (on the operation's own thread: no extra hop)."""
        if self.identity is None or id_files_identity(root_fd) == self.identity:
            return
        fresh, identity = read_account(root_fd, self.who.name)
        if fresh.home != self.who.home:  # the request's paths were resolved from the old home
            raise ApiError(409, "conflict", f"the home of account {self.who.name!r} changed during the request; "
                                            "retry it")
        self.who, self.identity = fresh, identity
        if self.remember is not None:
            self.remember(fresh, identity)

    def _identity(self) -> contextlib.AbstractContextManager[None]:
        base = self.userns[0] if self.userns else 0
        if self.who.uid == 0:
            return idmap.fs_identity(base, base) if self.userns else contextlib.nullcontext()
        return _credentials(base + self.who.uid, base + self.who.gid, tuple(base + g for g in self.who.groups))

    def run(self, fn: Callable[[int], T]) -> T:
        """``fn(root_fd)`` as the account, confined to the sandbox's root."""
        def work(root_fd: int) -> T:
            self._current(root_fd)
            with self._identity():
                return fn(root_fd)
        return self.files.within(work)

    def ids(self, st: os.stat_result) -> tuple[int, int]:
        """The owner and group of ``st`` as the sandbox sees them."""
        if self.userns is None:
            return st.st_uid, st.st_gid
        base, size = self.userns
        return tuple(i - base if base <= i < base + size else OVERFLOW_ID  # type: ignore[return-value]
                     for i in (st.st_uid, st.st_gid))


# -- paths ------------------------------------------------------------------------------------------------
def resolve(field_name: str, path: str, home: str) -> str:
    """envd's path for ``path``: ``~`` and relative paths from ``home``, ``..`` folded."""
    if "\0" in path or len(path) > 4096:
        raise InvalidField(field_name, "must be a path of at most 4096 characters without NUL")
    if path.startswith("~"):
        if path != "~" and path[1] != "/":
            raise InvalidField(field_name, f"{path[:80]!r}: cannot expand another user's home (~name)")
        path = home + path[1:]
    if not path.startswith("/"):
        path = f"{home}/{path}"
    return check_path(field_name, "/" + posixpath.normpath(path).lstrip("/"))


def _split(path: str) -> tuple[str, str]:
    parent, name = posixpath.split(path)
    if not name:
        raise InvalidField("path", "'/' is the sandbox's root: name an entry inside it")
    return parent or "/", name


def _open(root_fd: int, path: str, flags: int) -> int:
    return openat2_in_root(root_fd, path, flags | os.O_CLOEXEC, 0, RESOLVE_NO_XDEV)


@contextlib.contextmanager
def _fd(root_fd: int, path: str, flags: int = os.O_PATH | os.O_DIRECTORY) -> Iterator[int]:
    fd = _open(root_fd, path, flags)
    try:
        yield fd
    finally:
        os.close(fd)


def _realpath(root_fd: int, path: str) -> str | None:
    """``path`` with every symlink resolved inside the root (envd's ``symlink_target``), None when
    it dangles or loops."""
    done, todo, hops = "/", collections.deque(path.split("/")), MAX_LINKS
    while todo:
        part = todo.popleft()
        if part in ("", "."):
            continue
        if part == "..":
            done = posixpath.dirname(done)
            continue
        try:
            with _fd(root_fd, done) as dfd:
                st = os.stat(part, dir_fd=dfd, follow_symlinks=False)
                link = os.readlink(part, dir_fd=dfd) if stat.S_ISLNK(st.st_mode) else None
        except OSError:
            return None
        if link is None:
            done = posixpath.join(done, part)
            continue
        hops -= 1
        if hops < 0:
            return None
        if link.startswith("/"):
            done = "/"
        todo.extendleft(reversed(link.split("/")))
    return done


# -- entries ----------------------------------------------------------------------------------------------
def permissions(mode: int) -> str:
    """Go's ``FileMode.String()``, which envd reports."""
    kind = stat.S_IFMT(mode)
    letters = "".join(c for c, on in (
        ("d", kind == stat.S_IFDIR), ("L", kind == stat.S_IFLNK), ("D", kind in (stat.S_IFBLK, stat.S_IFCHR)),
        ("p", kind == stat.S_IFIFO), ("S", kind == stat.S_IFSOCK), ("u", bool(mode & stat.S_ISUID)),
        ("g", bool(mode & stat.S_ISGID)), ("c", kind == stat.S_IFCHR), ("t", bool(mode & stat.S_ISVTX))) if on)
    bits = "".join(c if mode & (1 << (8 - i)) else "-" for i, c in enumerate("rwxrwxrwx"))
    return (letters or "-") + bits


def file_type(mode: int) -> pb.FileType:
    kind = stat.S_IFMT(mode)
    return {stat.S_IFREG: pb.FileType.FILE, stat.S_IFDIR: pb.FileType.DIRECTORY,
            stat.S_IFLNK: pb.FileType.SYMLINK}.get(kind, pb.FileType.UNSPECIFIED)


def read_metadata(dfd: int, name: str) -> dict[str, str]:
    """The entry's ``user.e2b.*`` attributes (none where the filesystem or the account reads none)."""
    where = f"/proc/self/fd/{dfd}/{name}"
    out = {}
    with contextlib.suppress(OSError):
        for key in os.listxattr(where, follow_symlinks=False):
            if key.startswith("user.e2b."):
                out[key[len("user.e2b."):]] = os.getxattr(where, key, follow_symlinks=False).decode(errors="replace")
    return out


def entry(root: Root, root_fd: int, dfd: int, name: str, path: str, st: os.stat_result) -> pb.EntryInfo:
    """envd's EntryInfo of ``name`` in the directory ``dfd`` (at ``path``), lstat'ed as ``st``."""
    mode, kind, target = stat.S_IMODE(st.st_mode), file_type(st.st_mode), None
    if stat.S_ISLNK(st.st_mode):
        target = _realpath(root_fd, path)
        kind, mode = pb.FileType.UNSPECIFIED, 0
        if target is not None:
            with contextlib.suppress(OSError), _fd(root_fd, target, os.O_PATH) as tfd:
                tst = os.fstat(tfd)
                kind, mode = file_type(tst.st_mode), stat.S_IMODE(tst.st_mode)
        target = target or path
    uid, gid = root.ids(st)
    metadata = read_metadata(dfd, name) if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode) else {}
    return pb.EntryInfo(
        name=posixpath.basename(path) or "/", type=kind, path=path, size=st.st_size, mode=mode, permissions=permissions(st.st_mode),
        owner=root.who.users.get(uid, str(uid)), group=root.who.group_names.get(gid, str(gid)),
        modified_time=Timestamp(seconds=st.st_mtime_ns // 10**9, nanos=st.st_mtime_ns % 10**9),
        symlink_target=target, metadata=metadata or None, is_symlink=target is not None)


def guest_entry(f: Found) -> pb.EntryInfo:
    """envd's EntryInfo of an entry a microVM's guest described (as :func:`entry` does a container's)."""
    mode, kind, target = stat.S_IMODE(f.mode), file_type(f.mode), None
    if stat.S_ISLNK(f.mode):
        kind, mode, target = file_type(f.target_mode), stat.S_IMODE(f.target_mode), f.target or f.path
    return pb.EntryInfo(
        name=posixpath.basename(f.path) or "/", type=kind, path=f.path, size=f.size, mode=mode,
        permissions=permissions(f.mode), owner=f.owner, group=f.group,
        modified_time=Timestamp(seconds=f.mtime_ns // 10**9, nanos=f.mtime_ns % 10**9),
        symlink_target=target, is_symlink=target is not None)


def stat_entry(root: Root, root_fd: int, path: str) -> pb.EntryInfo:
    """The entry at ``path`` itself (a symlink is described, and its target resolved)."""
    if path == "/":
        with _fd(root_fd, "/") as fd:
            return entry(root, root_fd, fd, ".", "/", os.fstat(fd))
    parent, name = _split(path)
    with _fd(root_fd, parent) as dfd:
        return entry(root, root_fd, dfd, name, path, os.stat(name, dir_fd=dfd, follow_symlinks=False))


def list_dir(root: Root, root_fd: int, path: str, depth: int) -> list[pb.EntryInfo]:
    """envd's ListDir: the directory at ``path`` (symlinks to it followed), ``depth`` levels,
    depth first in name order; entries' paths under ``path`` as asked."""
    try:
        fd = _open(root_fd, path, os.O_RDONLY | os.O_DIRECTORY)
    except NotADirectoryError:
        raise InvalidField("path", f"{path} is not a directory") from None
    out: list[pb.EntryInfo] = []
    try:
        _walk(root, root_fd, fd, path, depth, out)
    finally:
        os.close(fd)
    return out


def _walk(root: Root, root_fd: int, dfd: int, path: str, depth: int, out: list[pb.EntryInfo]) -> None:
    for name in sorted(os.listdir(dfd)):
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:  # removed since the listing
            continue
        if len(out) >= MAX_ENTRIES:
            raise ApiError(413, "body_too_large", f"{path}: more than {MAX_ENTRIES} entries; list less deep")
        child = posixpath.join(path, name)
        out.append(entry(root, root_fd, dfd, name, child, st))
        if depth > 1 and stat.S_ISDIR(st.st_mode):
            fd = openat2_in_root(dfd, name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, 0,
                                 RESOLVE_NO_XDEV)
            try:
                _walk(root, root_fd, fd, child, depth - 1, out)
            finally:
                os.close(fd)


def make_dirs(root_fd: int, path: str) -> bool:
    """``mkdir -p``: every missing directory made by the account (0755); False when ``path`` is a
    directory already, InvalidField when it, or a directory on the way, is something else."""
    done, made = "/", False
    for part in [p for p in path.split("/") if p]:
        here = posixpath.join(done, part)
        try:
            with _fd(root_fd, here, os.O_PATH) as fd:
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    raise InvalidField("path", f"{here} exists and is not a directory")
        except FileNotFoundError:
            with _fd(root_fd, done) as dfd:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, NEW_DIR, dir_fd=dfd)
                    if stat.S_IMODE(os.stat(part, dir_fd=dfd, follow_symlinks=False).st_mode) != NEW_DIR:
                        os.chmod(part, NEW_DIR, dir_fd=dfd, follow_symlinks=False)  # (the edge's umask)
                    made = True
        done = here
    return made


def move(root_fd: int, source: str, destination: str) -> None:
    make_dirs(root_fd, posixpath.dirname(destination))
    (sparent, sname), (dparent, dname) = _split(source), _split(destination)
    with _fd(root_fd, sparent) as sfd, _fd(root_fd, dparent) as dfd:
        os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)


def remove(root_fd: int, path: str) -> None:
    """envd's Remove (``rm -rf``): a missing entry is no error."""
    parent, name = _split(path)
    try:
        with _fd(root_fd, parent) as dfd:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                rmtree_at(dfd, name, RESOLVE_NO_XDEV)
            else:
                os.unlink(name, dir_fd=dfd)
    except FileNotFoundError:
        return


def _regular(root_fd: int, path: str, flags: int) -> int:
    """The regular file at ``path`` opened with ``flags`` (checked on an O_PATH descriptor first:
    no FIFO waits, no device opens, as in RootFiles)."""
    pfd = _open(root_fd, path, os.O_PATH)
    try:
        st = os.fstat(pfd)
        if stat.S_ISDIR(st.st_mode):
            raise InvalidField("path", f"path '{path}' is a directory")
        if not stat.S_ISREG(st.st_mode):
            raise NotARegularFile(errno.EINVAL, path, "special file")
        return os.open(f"/proc/self/fd/{pfd}", flags | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    finally:
        os.close(pfd)


def create(root_fd: int, path: str) -> int:
    """``path`` opened for writing, truncated: a new file of the account's (0644), its parents
    made as :func:`make_dirs` does, or an existing regular file the account may write."""
    parent, name = _split(path)
    make_dirs(root_fd, parent)
    with _fd(root_fd, parent) as dfd:
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, NEW_FILE,
                         dir_fd=dfd)
        except FileExistsError:
            return _regular(root_fd, path, os.O_WRONLY | os.O_TRUNC)
    st = os.fstat(fd)
    if stat.S_IMODE(st.st_mode) != NEW_FILE:
        os.fchmod(fd, NEW_FILE)
    # what envd's chown of a new file tells a watcher (create, chmod, write), to the same owner
    os.fchown(fd, st.st_uid, st.st_gid)
    return fd


def write_metadata(fd: int, metadata: dict[str, str]) -> None:
    """Replace the file's ``user.e2b.*`` attributes with ``metadata`` (envd clears keys an upload
    does not name); a filesystem without user attributes keeps none, as envd's does."""
    with contextlib.suppress(OSError):
        for key in os.listxattr(fd):
            if key.startswith("user.e2b.") and key[len("user.e2b."):] not in metadata:
                os.removexattr(fd, key)
        for key, value in metadata.items():
            os.setxattr(fd, f"user.e2b.{key}", value.encode())


# -- watching ---------------------------------------------------------------------------------------------
def inotify_init() -> int:
    fd = int(_LIBC.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"inotify_init1: {os.strerror(err)}")
    return fd


def add_watches(root_fd: int, ifd: int, path: str, rel: str, recursive: bool, room: int) -> list[tuple[int, str]]:
    """Watch the directory at ``path`` (and, ``recursive``, those under it): ``(wd, relative path)``
    of each; at most ``room`` directories."""
    out: list[tuple[int, str]] = []
    todo = [(path, rel)]
    while todo:
        here, name = todo.pop()
        if len(out) >= room:
            raise ApiError(413, "body_too_large", f"{path}: more than {MAX_WATCH_DIRS} directories to watch")
        with _fd(root_fd, here, os.O_RDONLY | os.O_DIRECTORY) as fd:
            wd = int(_LIBC.inotify_add_watch(ifd, f"/proc/self/fd/{fd}".encode(), WATCH_MASK))
            if wd < 0:
                err = ctypes.get_errno()
                raise OSError(err, f"inotify_add_watch: {os.strerror(err)}", here)
            out.append((wd, name))
            if recursive:
                for child in sorted(os.listdir(fd)):
                    with contextlib.suppress(FileNotFoundError):
                        if stat.S_ISDIR(os.stat(child, dir_fd=fd, follow_symlinks=False).st_mode):
                            todo.append((posixpath.join(here, child), posixpath.join(name, child)))
    return out


def scan(root_fd: int, base: str, dirs: list[tuple[int, str]]) -> list[str]:
    """The entries now in the directories just watched (named from the watch's root ``base``):
    made before their watches could report them."""
    out: list[str] = []
    for _, rel in dirs:
        with contextlib.suppress(OSError), _fd(root_fd, posixpath.join(base, rel), os.O_RDONLY | os.O_DIRECTORY) as fd:
            out += [posixpath.join(rel, child) for child in sorted(os.listdir(fd))]
    return out


def grow(root_fd: int, ifd: int, base: str, rel: str, room: int) -> tuple[list[tuple[int, str]], list[str]]:
    """A directory made under a recursive watch: it and those under it watched, what they hold."""
    added = add_watches(root_fd, ifd, posixpath.join(base, rel), rel, True, room)
    return added, scan(root_fd, base, added)


class Watch:
    """One inotify instance on a directory of a container's root, read as events arrive."""

    def __init__(self, sid: str, root: Root, path: str, recursive: bool, include_entry: bool,
                 ctx: EdgeContext, project: Project) -> None:
        self.sid, self.root, self.path = sid, root, path
        self.recursive, self.include_entry = recursive, include_entry
        self.ctx, self.project = ctx, project
        self.fd = inotify_init()
        self.dirs: dict[int, str] = {}  # wd -> the directory relative to path ("" for path)
        self.events: collections.deque[tuple[str, pb.EventType]] = collections.deque()
        self.failed: ConnectError | None = None
        self.wake = asyncio.Event()
        self.polled = time.monotonic()
        self.closed = False
        self._growing: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        try:
            added = await self.ctx.files(self.project, lambda: self.root.run(
                lambda rfd: add_watches(rfd, self.fd, self.path, "", self.recursive, MAX_WATCH_DIRS)))
        except BaseException:
            self.close()
            raise
        self.dirs.update(added)
        asyncio.get_running_loop().add_reader(self.fd, self.read)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(ValueError, RuntimeError):
            asyncio.get_running_loop().remove_reader(self.fd)
        os.close(self.fd)
        for task in self._growing:
            task.cancel()
        self.wake.set()

    def _fail(self, code: Code, message: str) -> None:
        if self.failed is None:
            self.failed = ConnectError(code, message)
        with contextlib.suppress(ValueError, RuntimeError):
            asyncio.get_running_loop().remove_reader(self.fd)  # the kernel's queue bounds what waits now
        self.wake.set()

    def read(self) -> None:
        if self.closed or self.failed is not None:  # (after a failure nothing more is taken: no gaps)
            return
        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return
        except OSError as exc:
            self._fail(Code.INTERNAL, f"watcher: {exc}")
            return
        offset = 0
        while offset + EVENT.size <= len(data):
            wd, mask, _, length = EVENT.unpack_from(data, offset)
            name = data[offset + EVENT.size:offset + EVENT.size + length].rstrip(b"\0").decode(errors="surrogateescape")
            offset += EVENT.size + length
            self._event(wd, mask, name)
        self.wake.set()

    def _event(self, wd: int, mask: int, name: str) -> None:
        if mask & IN_Q_OVERFLOW:
            self._fail(Code.RESOURCE_EXHAUSTED, "watcher: the kernel's event queue overflowed")
            return
        rel = self.dirs.get(wd)
        if rel is None:
            return
        if mask & (IN_IGNORED | IN_UNMOUNT):
            del self.dirs[wd]
            if not self.dirs:
                self._fail(Code.NOT_FOUND, f"watcher: {self.path} is gone (removed, or the sandbox ended)")
            return
        if mask & (IN_DELETE_SELF | IN_MOVE_SELF) and rel:
            return  # a watched subdirectory: its parent reports it
        where = posixpath.join(rel, name) if name else rel
        for bits, kind in KINDS:
            if mask & bits:
                self._push(where, kind)
        if self.recursive and mask & IN_ISDIR and mask & (IN_CREATE | IN_MOVED_TO):
            task = asyncio.get_running_loop().create_task(self._grow(where))
            self._growing.add(task)
            task.add_done_callback(self._growing.discard)

    def _push(self, name: str, kind: pb.EventType) -> None:
        if len(self.events) >= MAX_EVENTS:
            self._fail(Code.RESOURCE_EXHAUSTED, f"watcher: more than {MAX_EVENTS} events unread")
            return
        self.events.append((name, kind))

    async def _grow(self, rel: str) -> None:
        """A directory made under a recursive watch: watched too, and what it holds reported."""
        room = MAX_WATCH_DIRS - len(self.dirs)
        try:
            added, found = await self.ctx.files(self.project, lambda: self.root.run(
                lambda rfd: grow(rfd, self.fd, self.path, rel, room)))
        except ApiError as exc:
            self._fail(Code.RESOURCE_EXHAUSTED, f"watcher: {exc.message}")
            return
        except OSError:
            return  # gone again already
        if self.closed:
            return
        self.dirs.update(added)
        for name in found:
            self._push(name, pb.EventType.CREATE)
        self.wake.set()

    async def settle(self) -> None:
        """Read what the kernel holds now, and finish following the directories it reports: a poll
        after a change sees it (envd's watcher reads as events come; so does this one, in the loop)."""
        self.read()
        while self._growing:
            await asyncio.gather(*self._growing, return_exceptions=True)
            self.read()

    async def take(self) -> list[pb.FilesystemEvent]:
        """The events so far (with their entries when asked), or the error that ended the watch."""
        taken = take_events(self.events, self.wake, self.failed)
        if not self.include_entry:
            return [pb.FilesystemEvent(name=n, type=k) for n, k in taken]
        return await self.ctx.files(self.project, lambda: self.root.run(lambda rfd: self._described(rfd, taken)))

    def _described(self, root_fd: int, taken: list[tuple[str, pb.EventType]]) -> list[pb.FilesystemEvent]:
        out = []
        for name, kind in taken:
            info = None
            if kind in (pb.EventType.CREATE, pb.EventType.WRITE, pb.EventType.CHMOD):  # (still there, maybe)
                with contextlib.suppress(OSError, ApiError, InvalidField):
                    info = stat_entry(self.root, root_fd, posixpath.join(self.path, name))
            out.append(pb.FilesystemEvent(name=name, type=kind, entry=info))
        return out


class Watchers:
    """The polled watchers of every sandbox on this edge, and how many watches each sandbox has."""

    def __init__(self) -> None:
        self.polled: dict[str, Watch | GuestWatch] = {}
        self.open: collections.Counter[str] = collections.Counter()

    def admit(self, sid: str) -> None:
        self.sweep()
        if self.open[sid] >= MAX_WATCHERS:
            raise ApiError(429, "too_many_readers", f"sandbox {sid} has {MAX_WATCHERS} watchers, the most it "
                                                    "may: stop one (RemoveWatcher, or end its stream)")
        self.open[sid] += 1

    def release(self, watch: Watch | GuestWatch) -> None:
        watch.close()
        self.open[watch.sid] -= 1
        if self.open[watch.sid] <= 0:
            del self.open[watch.sid]

    def sweep(self) -> None:
        """Drop polled watchers nobody asked for in WATCH_IDLE seconds (ENDED_IDLE once they ended:
        their error is told to the next poll in that time)."""
        now = time.monotonic()
        for wid, watch in list(self.polled.items()):
            idle = now - watch.polled
            if idle > WATCH_IDLE or (watch.failed is not None and idle > ENDED_IDLE):
                del self.polled[wid]
                self.release(watch)

    def get(self, sid: str, wid: str) -> Watch | GuestWatch:
        self.sweep()
        watch = self.polled.get(wid)
        if watch is None or watch.sid != sid:
            raise ConnectError(Code.NOT_FOUND, f"watcher with id {wid[:40]} not found")
        return watch


class _SentFile(web.FileResponse):
    """A file answer sent inside its handler (while the descriptor it reopens is open): aiohttp
    prepares a handler's answer again after it returns, which a file answer would redo."""

    async def prepare(self, request: web.BaseRequest) -> Any:
        if self.prepared:
            return None
        return await super().prepare(request)


# -- the Connect service ----------------------------------------------------------------------------------
@dataclass
class Caller:
    """One call's sandbox and account."""

    project: Project
    box: Sandbox
    root: Root

    def path(self, field_name: str, given: str) -> str:
        return resolve(field_name, given, self.root.who.home)


def path_of(c: Caller | Guest, field_name: str, given: str) -> str:
    """envd's path for ``given`` as the call's account (from its home)."""
    return resolve(field_name, given, c.home if isinstance(c, Guest) else c.root.who.home)


class FilesystemService:
    def __init__(self, ctx: EdgeContext) -> None:
        self.ctx = ctx
        self.watchers = Watchers()
        self._accounts: dict[tuple[str, str | None], tuple[Account, Identity]] = {}  # (sandbox, named): _remember

    async def caller(self, call: EnvdCall | None = None) -> Caller | Guest:
        """The calling RPC's sandbox, as the account its ``Authorization`` names (or the default)."""
        call = call or current()
        project, box, state = await call.sandbox()
        return await self.caller_for(project, box, state.userns, call.user)

    async def caller_for(self, project: Project, box: Sandbox, userns: tuple[int, int] | None,
                         named: str | None) -> Caller | Guest:
        files = box.files
        if not hasattr(files, "within"):
            return await guest_for(self.ctx, project, box, named)
        rooted = cast("Rooted", files)
        key = (box.id, named)
        known = self._accounts.get(key)
        if known is None:
            def load(rfd: int) -> tuple[Account, Identity]:  # (envd.run_as's choice, from one read)
                if named is not None:
                    return read_account(rfd, named)
                try:
                    return read_account(rfd, DEFAULT_USER)
                except UnsupportedOption:
                    return read_account(rfd, "root")
            known = await self.ctx.files(project, lambda: rooted.within(load))
            self._remember(key, known)
        return Caller(project, box, Root(rooted, known[0], userns, known[1],
                                         lambda who, identity: self._remember(key, (who, identity))))

    def _remember(self, key: tuple[str, str | None], known: tuple[Account, Identity]) -> None:
        """An account as last read, checked against its files' identity at each use (Root.run)."""
        if len(self._accounts) >= MAX_ACCOUNTS and key not in self._accounts:
            self._accounts.clear()  # sandboxes long gone (ids are never reused); each costs one read again
        self._accounts[key] = known

    async def run(self, c: Caller, fn: Callable[[int], T]) -> T:
        return await self.ctx.files(c.project, lambda: c.root.run(fn))

    @rpc
    async def stat(self, request: pb.StatRequest, ctx: RequestContext[Any, Any], /) -> pb.StatResponse:
        c = await self.caller()
        if isinstance(c, Guest):
            return pb.StatResponse(entry=guest_entry(await guestfs.stat(c, path_of(c, "path", request.path))))
        path = c.path("path", request.path)
        return pb.StatResponse(entry=await self.run(c, lambda rfd: stat_entry(c.root, rfd, path)))

    @rpc
    async def list_dir(self, request: pb.ListDirRequest, ctx: RequestContext[Any, Any], /) -> pb.ListDirResponse:
        c = await self.caller()
        depth = request.depth or 1
        if depth > MAX_DEPTH:
            raise InvalidField("depth", f"{depth}: at most {MAX_DEPTH}")
        if isinstance(c, Guest):
            found = await guestfs.list_dir(c, path_of(c, "path", request.path), depth)
            return pb.ListDirResponse(entries=[guest_entry(f) for f in found])
        path = c.path("path", request.path)
        return pb.ListDirResponse(entries=await self.run(c, lambda rfd: list_dir(c.root, rfd, path, depth)))

    @rpc
    async def make_dir(self, request: pb.MakeDirRequest, ctx: RequestContext[Any, Any], /) -> pb.MakeDirResponse:
        c = await self.caller()
        if isinstance(c, Guest):
            path = path_of(c, "path", request.path)
            made = await guestfs.make_dir(c, path)
            if made is None:
                raise ConnectError(Code.ALREADY_EXISTS, f"directory already exists: {path}")
            return pb.MakeDirResponse(entry=guest_entry(made))
        path = c.path("path", request.path)

        def work(rfd: int) -> pb.EntryInfo:
            if not make_dirs(rfd, path):
                raise ConnectError(Code.ALREADY_EXISTS, f"directory already exists: {path}")
            return stat_entry(c.root, rfd, path)
        return pb.MakeDirResponse(entry=await self.run(c, work))

    @rpc
    async def move(self, request: pb.MoveRequest, ctx: RequestContext[Any, Any], /) -> pb.MoveResponse:
        c = await self.caller()
        if isinstance(c, Guest):
            moved = await guestfs.move(c, path_of(c, "source", request.source),
                                       path_of(c, "destination", request.destination))
            return pb.MoveResponse(entry=guest_entry(moved))
        source = c.path("source", request.source)
        destination = c.path("destination", request.destination)

        def work(rfd: int) -> pb.EntryInfo:
            move(rfd, source, destination)
            return stat_entry(c.root, rfd, destination)
        return pb.MoveResponse(entry=await self.run(c, work))

    @rpc
    async def remove(self, request: pb.RemoveRequest, ctx: RequestContext[Any, Any], /) -> pb.RemoveResponse:
        c = await self.caller()
        if isinstance(c, Guest):
            await guestfs.remove(c, path_of(c, "path", request.path))
            return pb.RemoveResponse()
        path = c.path("path", request.path)
        await self.run(c, lambda rfd: remove(rfd, path))
        return pb.RemoveResponse()

    async def _watch(self, c: Caller | Guest, path: str, recursive: bool, include_entry: bool) -> Watch | GuestWatch:
        if isinstance(c, Guest):
            return await self._guest_watch(c, path_of(c, "path", path), recursive, include_entry)
        path = c.path("path", path)

        def check(rfd: int) -> None:
            with _fd(rfd, path, os.O_PATH) as fd:
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    raise InvalidField("path", f"path {path} not a directory")
        await self.run(c, check)
        self.watchers.admit(c.box.id)
        return await self._started(Watch(c.box.id, c.root, path, recursive, include_entry, self.ctx, c.project))

    async def _guest_watch(self, g: Guest, path: str, recursive: bool, include_entry: bool) -> GuestWatch:
        async def describe(where: str) -> pb.EntryInfo | None:
            with contextlib.suppress(OSError, ApiError, InvalidField):
                return guest_entry(await guestfs.stat(g, where))
            return None  # (gone again)

        self.watchers.admit(g.box.id)
        return await self._started(GuestWatch(g.box.id, g, path, recursive, include_entry, describe))

    async def _started(self, watch: W) -> W:
        """``watch`` (admitted) started; given back when it cannot start."""
        try:
            await watch.start()
        except BaseException:
            self.watchers.release(watch)
            raise
        return watch

    @rpc_stream
    async def watch_dir(self, request: pb.WatchDirRequest, ctx: RequestContext[Any, Any], /) -> AsyncIterator[
            pb.WatchDirResponse]:
        call = current()
        watch = await self._watch(await self.caller(call), request.path, request.recursive,
                                  request.include_entry)
        every = keepalive(ctx)
        try:
            yield pb.WatchDirResponse(event=Oneof("start", pb.WatchDirResponse.StartEvent()))  # type: ignore[arg-type]
            while call.present():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(watch.wake.wait(), every)
                events = await watch.take()
                if not events:
                    yield pb.WatchDirResponse(
                        event=Oneof("keepalive", pb.WatchDirResponse.KeepAlive()))  # type: ignore[arg-type]
                for each in events:
                    yield pb.WatchDirResponse(event=Oneof("filesystem", each))  # type: ignore[arg-type]
        finally:
            self.watchers.release(watch)

    @rpc
    async def create_watcher(self, request: pb.CreateWatcherRequest, ctx: RequestContext[Any, Any], /) -> \
            pb.CreateWatcherResponse:
        watch = await self._watch(await self.caller(), request.path, request.recursive, request.include_entry)
        wid = "w" + secrets.token_hex(12)
        self.watchers.polled[wid] = watch
        return pb.CreateWatcherResponse(watcher_id=wid)

    @rpc
    async def get_watcher_events(self, request: pb.GetWatcherEventsRequest, ctx: RequestContext[Any, Any], /) -> \
            pb.GetWatcherEventsResponse:
        _, box, _ = await current().sandbox()
        watch = self.watchers.get(box.id, request.watcher_id)
        watch.polled = time.monotonic()
        await watch.settle()
        return pb.GetWatcherEventsResponse(events=await watch.take())

    @rpc
    async def remove_watcher(self, request: pb.RemoveWatcherRequest, ctx: RequestContext[Any, Any], /) -> \
            pb.RemoveWatcherResponse:
        _, box, _ = await current().sandbox()
        watch = self.watchers.get(box.id, request.watcher_id)
        del self.watchers.polled[request.watcher_id]
        self.watchers.release(watch)
        return pb.RemoveWatcherResponse()

    def application(self) -> FilesystemASGIApplication:
        return FilesystemASGIApplication(self, read_max_bytes=READ_MAX_BYTES)  # type: ignore[arg-type]


# -- /files -----------------------------------------------------------------------------------------------
METADATA_KEY = frozenset("abcdefghijklmnopqrstuvwxyz0123456789!#$%&'*+-.^_`|~")


def metadata_of(request: web.Request) -> dict[str, str]:
    """The ``X-Metadata-<key>`` headers of an upload (keys lowercased, as envd stores them)."""
    out: dict[str, str] = {}
    for name, value in request.headers.items():
        if not name.lower().startswith("x-metadata-"):
            continue
        key = name[len("x-metadata-"):].lower()
        if not key or len(key) > 200 or not set(key) <= METADATA_KEY:
            raise InvalidField(name[:220], "a metadata key is 1-200 HTTP token characters")
        if len(value) > 4096 or not all(" " <= ch <= "~" for ch in value):
            raise InvalidField(name[:220], "a metadata value is at most 4096 printable US-ASCII characters")
        out[key] = value
    if len(out) > MAX_METADATA:
        raise InvalidField("X-Metadata-*", f"{len(out)} keys, at most {MAX_METADATA}")
    return out


def stored_metadata(fd: int, metadata: dict[str, str]) -> dict[str, str]:
    """:func:`write_metadata`, then what the file holds (envd answers what persisted)."""
    write_metadata(fd, metadata)
    out = {}
    with contextlib.suppress(OSError):
        for key in os.listxattr(fd):
            if key.startswith("user.e2b."):
                out[key[len("user.e2b."):]] = os.getxattr(fd, key).decode(errors="replace")
    return out


SIGNATURE = re.compile(r"v1_[A-Za-z0-9+/]{43}")  # envd's v1: base64 of a SHA-256, unpadded
MAX_SEARCH_WAITING = 16  # signed URLs naming no sandbox whose signer search may queue at once (then 429)


def _signed_around(path: str, operation: str, username: str, expiration: int | None) -> tuple[bytes, bytes]:
    """What envd's v1 signature hashes before and after the token: ``path:operation:username:``
    and ``[:expiration]``."""
    return f"{path}:{operation}:{username}:".encode(), b"" if expiration is None else f":{expiration}".encode()


def signature(token: str, path: str, operation: str, username: str, expiration: int | None) -> str:
    """envd's v1 URL signature (what ``e2b.sandbox.signature.get_signature`` computes)."""
    head, tail = _signed_around(path, operation, username, expiration)
    return "v1_" + base64.b64encode(hashlib.sha256(head + token.encode() + tail).digest()).rstrip(b"=").decode()


def expiration_of(request: web.Request) -> int | None:
    text = request.query.get("signature_expiration")
    if text is None:
        return None
    digits = text[1:] if text.startswith("-") else text
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 18):
        raise InvalidField("signature_expiration", f"{text[:20]!r} is not a Unix time in seconds")
    return int(text)


def accepts_gzip(request: web.Request) -> bool:
    """Whether the client asked for a gzip download: ``Accept-Encoding`` takes gzip (``gzip``
    with a quality above 0) and names no other compression.  An HTTP library's default list
    (httpx's ``gzip, deflate``, a browser's ``gzip, deflate, br, zstd``) gets the file as it is:
    compressing is the edge's CPU, shared by every sandbox (about 20x the time of sending 10 MB
    on a local network), so it is spent only for a client that asks for exactly that, as the
    SDK's ``gzip=True`` does (envd compresses for any list that takes gzip)."""
    wanted = False
    for item in request.headers.get("Accept-Encoding", "").split(","):
        name, _, params = item.partition(";")
        name, params = name.strip().lower(), params.strip().lower()
        quality = params.removeprefix("q=") if params.startswith("q=") else "1"
        try:
            taken = float(quality) > 0
        except ValueError:
            continue
        if name == "gzip":
            wanted = taken
        elif name not in ("", "identity") and taken:
            return False
    return wanted


def _write_all(fd: int, pieces: list[bytes]) -> None:
    """Write ``pieces`` one after another, with as few system calls as the kernel takes them in."""
    views = [memoryview(p) for p in pieces if p]
    try:
        while views:
            n = os.writev(fd, views)
            while views and n >= len(views[0]):
                n -= len(views.pop(0))
            if n:
                views[0] = views[0][n:]
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ApiError(507, "no_space", f"not enough disk space in the sandbox: {os.strerror(exc.errno)}") from None
        raise


async def _piece(read: Callable[[int], Any]) -> list[bytes]:
    """About CHUNK bytes of a body, as the pieces the client's connection delivered (gathered, so
    that the disk sees large writes, and not joined: :func:`_write_all` takes them as they are;
    joining copied every byte once more); empty at the body's end.  Pieces under SMALL_PIECE are
    copied once into a buffer between the large ones: a batch stays within what one ``writev``
    takes, and a client sending its body a byte per HTTP chunk costs a copy per byte, not the
    growing re-joins of what came before (quadratic)."""
    pieces: list[bytes] = []
    small = bytearray()
    n = 0
    while n < CHUNK:
        piece = await read(CHUNK)
        if not piece:
            break
        n += len(piece)
        if len(piece) < SMALL_PIECE:
            small += piece
            continue
        if small:
            pieces.append(bytes(small))
            small.clear()
        pieces.append(bytes(piece))
    if small:
        pieces.append(bytes(small))
    return pieces


async def _settle(work: asyncio.Future[T], release: Callable[[T], None] | None = None) -> None:
    """Until ``work`` (file work on a thread, which no cancel stops) is done, even if this task is
    cancelled meanwhile: a descriptor it uses may be closed only then.  The work's outcome is left
    in it; a cancellation is raised after, once ``release`` has had what the work made."""
    cancelled = False
    while not work.done():
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            cancelled = True
        except Exception:
            pass
    if cancelled:
        if release is not None and not work.cancelled() and work.exception() is None:
            release(work.result())
        raise asyncio.CancelledError


async def _pieces(read: Callable[[int], Any]) -> AsyncIterator[bytes]:
    while pieces := await _piece(read):
        yield b"".join(pieces)


class Files:
    """envd's filesystem: the Connect service (:attr:`service`) and ``/files`` (:meth:`http`)."""

    def __init__(self, e2b: E2bContext) -> None:
        self.e2b = e2b
        self.ctx = e2b.ctx
        self.service = FilesystemService(e2b.ctx)
        self._searching = asyncio.Lock()
        self._search_waiting = 0  # signed-URL searches queued or running

    async def signer(self, request: web.Request) -> str:
        """The sandbox whose envd token signed a ``/files`` URL that names no sandbox: what the
        SDK's ``download_url`` and ``upload_url`` give with ``E2B_SANDBOX_URL``, which carries
        no id.  The signature covers the token, so the edge tries the token of each sandbox it
        holds (about 0.7 us each: 2.3 ms at 3,200), one search at a time so that unsigned traffic
        costs at most one thread, and at most ``MAX_SEARCH_WAITING`` waiting (429 past that, so a
        flood of forged URLs delays a genuine one by a bounded time); a URL no token signed is
        401 as a bad signature is."""
        given = request.query.get("signature")
        if given is None:
            raise ApiError(401, "unauthenticated", "a /files request that names no sandbox (E2b-Sandbox-Id, or a "
                                                   "<port>-<id> host name) must be a signed URL: missing signature")
        if not SIGNATURE.fullmatch(given):
            raise ApiError(401, "unauthenticated", "invalid signature")
        expiration = expiration_of(request)
        if expiration is not None and expiration < time.time():
            raise ApiError(401, "unauthenticated", "signature is already expired")
        named = request.query.get("username") or ""
        if named:
            check_user("username", named)
        operation = "write" if request.method == "POST" else "read"
        signed = (request.query.get("path", ""), operation, named, expiration)
        if self._search_waiting >= MAX_SEARCH_WAITING:
            # a flood of forged URLs must not queue the genuine ones behind it for ever
            raise ApiError(429, "busy", f"{MAX_SEARCH_WAITING} signed URLs that name no sandbox wait for the search "
                                        "of their signer already; retry shortly, or name the sandbox (E2b-Sandbox-Id, "
                                        "or a <port>-<id> host name)", retryable=True, retry_after=1)
        self._search_waiting += 1
        try:
            async with self._searching:
                sid = await asyncio.to_thread(self._signed_by, given, *signed)
        finally:
            self._search_waiting -= 1
        if sid is None:
            raise ApiError(401, "unauthenticated", "invalid signature")
        return sid

    def _signed_by(self, given: str, path: str, operation: str, named: str, expiration: int | None) -> str | None:
        """The search itself: what every candidate shares is hashed once (the digest's state is
        copied per sandbox) and the signature decoded once, so a candidate costs a copy, one short
        update and a compare of 32 bytes (0.72 us against 4.33 us, measured on one host)."""
        want = base64.b64decode(given[3:] + "=")  # (SIGNATURE checked its alphabet and length)
        before, tail = _signed_around(path, operation, named, expiration)
        head = hashlib.sha256(before)
        keys = self.e2b.keys
        for sid in self.ctx.manager.ids():
            h = head.copy()
            h.update(keys.access_token_bytes(sid) + tail)
            if hmac.compare_digest(h.digest(), want):
                return sid
        return None

    async def http(self, request: web.Request, call: EnvdCall) -> web.StreamResponse:
        try:
            if request.method == "POST":
                return await self.upload(request, call)
            return await self.download(request, call)
        except Exception as exc:
            return error_response(exc)

    async def _caller(self, request: web.Request, call: EnvdCall, operation: str) -> Caller | Guest:
        """The sandbox and account of a /files request: its envd token (or key), else its signature."""
        headers = request.headers
        named = request.query.get("username") or None
        if named is not None:
            check_user("username", named)
        if "X-Access-Token" in headers or "X-API-Key" in headers or \
                headers.get("Authorization", "").lower().startswith("bearer "):
            project, box, state = await call.sandbox()
        else:
            given = request.query.get("signature")
            if given is None:
                raise ApiError(401, "unauthenticated", "missing signature query parameter (or X-Access-Token)")
            expiration = expiration_of(request)
            want = signature(self.e2b.keys.access_token(call.target.sid), request.query.get("path", ""),
                             operation, named or "", expiration)
            if not hmac.compare_digest(want.encode(), given.encode(errors="surrogateescape")):
                raise ApiError(401, "unauthenticated", "invalid signature")
            if expiration is not None and expiration < time.time():
                raise ApiError(401, "unauthenticated", "signature is already expired")
            project, box, state = await self.e2b.for_owner(call.target.sid)
        return await self.service.caller_for(project, box, state.userns, named)

    async def download(self, request: web.Request, call: EnvdCall) -> web.StreamResponse:
        c = await self._caller(request, call, "read")
        if isinstance(c, Guest):
            with self.ctx.usage.take(c.project.name, "transfers"):
                return await self._send_guest(request, c, path_of(c, "path", request.query.get("path", "")))
        path = c.path("path", request.query.get("path", ""))
        with self.ctx.usage.take(c.project.name, "transfers"):  # for as long as the client reads
            try:
                fd = await self.service.run(c, lambda rfd: _regular(rfd, path, os.O_RDONLY))
            except PathEscape as exc:
                if exc.errno != errno.EXDEV:
                    raise
                # on another of the sandbox's mounts (/proc, /sys, /dev), which the host's view of
                # its root does not reach: read inside the sandbox, as the account, as envd does
                who = c.root.who
                return await self._send_guest(request, Guest(self.ctx, c.project, c.box, who.name, who.home), path)
            try:
                return await self._send(request, c, path, fd)
            finally:
                os.close(fd)

    @staticmethod
    async def _prepared(request: web.Request) -> tuple[web.StreamResponse, Any]:
        """A download's response, begun (a HEAD's ended); the gzip compressor when the client takes gzip."""
        gz = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 31) if accepts_gzip(request) else None
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream", "Vary": "Accept-Encoding"})
        if gz is not None:
            resp.headers["Content-Encoding"] = "gzip"
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        if request.method == "HEAD":
            await resp.write_eof()
        return resp, gz

    async def _send(self, request: web.Request, c: Caller, path: str, fd: int) -> web.StreamResponse:
        if not accepts_gzip(request):
            return await self._send_file(request, c, path, fd)
        resp, gz = await self._prepared(request)
        if request.method == "HEAD":
            return resp

        def piece() -> tuple[int, bytes]:
            data = os.read(fd, CHUNK)
            if gz is None:
                return len(data), data
            return len(data), gz.compress(data) if data else gz.flush()

        total = 0
        while True:
            n, out = await self.ctx.files(c.project, piece)
            total += n
            if out:
                await resp.write(out)
            if not n:
                break
        await asyncio.to_thread(c.box.receipt, "download", path=path, bytes=total)
        await resp.write_eof()
        return resp

    async def _send_file(self, request: web.Request, c: Caller, path: str, fd: int) -> web.StreamResponse:
        """The file as it is: aiohttp's file answer over the descriptor opened in the sandbox's root
        (``/proc/self/fd/N`` reopens that very file, never a path), sent with ``sendfile`` and with
        ``Range`` and conditional requests served; sent before the descriptor is closed."""
        size = os.fstat(fd).st_size
        resp = _SentFile(f"/proc/self/fd/{fd}", chunk_size=CHUNK,
                                headers={"Content-Type": "application/octet-stream", "Vary": "Accept-Encoding"})
        await resp.prepare(request)
        if request.method != "HEAD":
            await asyncio.to_thread(c.box.receipt, "download", path=path, bytes=size)
        return resp

    async def _send_guest(self, request: web.Request, g: Guest, path: str) -> web.StreamResponse:
        """A file as the account's ``cat`` in the sandbox gives it (a microVM's, or one on a
        container's other mounts): the answer waits for its first piece
        (or its end), so a refusal is an error answer, not a cut stream."""
        download = Download(g, path)
        try:
            data = await download.next()
            resp, gz = await self._prepared(request)
            while data and request.method != "HEAD":
                await resp.write(gz.compress(data) if gz is not None else data)
                data = await download.next()
        finally:
            await download.close()
        if request.method == "HEAD":
            return resp
        if gz is not None:
            await resp.write(gz.flush())
        await asyncio.to_thread(g.box.receipt, "download", path=path, bytes=download.total)
        await resp.write_eof()
        return resp

    async def upload(self, request: web.Request, call: EnvdCall) -> web.Response:
        c = await self._caller(request, call, "write")
        metadata = metadata_of(request)
        given = request.query.get("path")
        kind = media_type(request.headers.get("Content-Type", ""))
        with self.ctx.usage.take(c.project.name, "transfers"):
            if kind == "application/octet-stream":
                if given is None:
                    raise InvalidField("path", "is required for an application/octet-stream upload")
                path = path_of(c, "path", given)
                written = [await self._write(c, path, lambda _: next_chunk(request.content), metadata)]
            elif kind.startswith("multipart/"):
                written = await self._parts(c, request, given, metadata)
            else:
                raise InvalidField("Content-Type", f"{kind[:80]!r}: expected multipart/form-data or "
                                                   "application/octet-stream")
        return web.json_response(written)

    async def _parts(self, c: Caller | Guest, request: web.Request, given: str | None,
                     metadata: dict[str, str]) -> list[dict[str, Any]]:
        """Each ``file`` part of a multipart upload, written as it arrives."""
        body = MultipartStream(request.content, boundary_of(request.headers.get("Content-Type", "")))
        written: list[dict[str, Any]] = []
        while (part := await body.next_part()) is not None:
            if part.name != "file":  # (its body is skipped by the next next_part)
                continue
            raw = given if given is not None else part.filename
            if raw is None:
                raise InvalidField("filename", "a file part names its path as its file name (or give ?path=)")
            path = path_of(c, "path", raw)
            if any(w["path"] == path for w in written):
                raise InvalidField("path", f"you cannot upload multiple files to the same path '{path}' in one "
                                           "upload request")
            written.append(await self._write(c, path, body.read, metadata))
        return written

    async def _write(self, c: Caller | Guest, path: str, read: Callable[[int], Any],
                     metadata: dict[str, str]) -> dict[str, Any]:
        if isinstance(c, Guest):  # (no metadata: the module's docstring)
            total = await guestfs.upload(c, path, _pieces(read))
            await asyncio.to_thread(c.box.receipt, "upload", path=path, bytes=total)
            return {"name": posixpath.basename(path), "type": "file", "path": path}
        # The body is read while the file is opened (truncating an old 10 MB file frees its pages:
        # milliseconds) and while the piece before is written: a 10 MB upload took 16 ms of the
        # edge's time one step after another, ~4 of them the open and ~4 the writes.
        opened = asyncio.ensure_future(self.service.run(c, lambda rfd: create(rfd, path)))
        try:
            data = await _piece(read)
        except BaseException:
            await _settle(opened, release=os.close)
            if not opened.cancelled() and opened.exception() is None:
                os.close(opened.result())
            raise
        await _settle(opened, release=os.close)
        fd = opened.result()
        total = 0
        try:
            while data:
                written = asyncio.ensure_future(self.ctx.files(c.project, functools.partial(_write_all, fd, data)))
                try:
                    following = await _piece(read)
                finally:
                    await _settle(written)  # no write is left running on the descriptor
                written.result()
                total += sum(map(len, data))
                data = following
            stored = await self.service.run(c, lambda _: stored_metadata(fd, metadata))
        finally:
            os.close(fd)
        await asyncio.to_thread(c.box.receipt, "upload", path=path, bytes=total)
        info: dict[str, Any] = {"name": posixpath.basename(path), "type": "file", "path": path}
        if stored:
            info["metadata"] = stored
        return info
