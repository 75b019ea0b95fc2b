"""File access to a sandbox's rootfs from the host, confined to that root.

Every path is resolved by the kernel with ``openat2(RESOLVE_IN_ROOT)``: ``..``
and absolute symlinks are resolved as if the rootfs were ``/``, so a symlink
inside the sandbox pointing at ``/etc/shadow`` names the sandbox's own
``/etc/shadow``, never the host's.  Magic links (``/proc/self/root``-style)
are refused.  Hosts without openat2 (Linux < 5.6) get :class:`HostUnsupported`
rather than a weaker, racy userspace resolver.  Each operation's path work
also runs on a thread that Landlock confines to the root (:mod:`sandbox.isolation.landlock`),
so even a path our code got wrong cannot reach the host's files.

The sandbox also controls what kind of entry a path names, and opening a FIFO
blocks, and opening a device node (made in the image, or linked to by the agent)
reaches the host's device as host root, outside the sandbox's device cgroup.  So
an entry is first opened ``O_PATH`` (which opens nothing: no FIFO wait, no device
open), its type checked on that descriptor, and only a regular file is then
opened for real, by re-opening that very inode through ``/proc/self/fd``: a race
that swaps in another entry at the path after the check changes nothing.  Anything
else is refused with :class:`NotARegularFile` (a directory with
``IsADirectoryError``).  A new file is created with ``O_CREAT|O_EXCL`` in its
parent, so no existing entry (a dangling symlink, a FIFO raced in) is ever
followed or opened by the create.

A sandbox in a user namespace (``idmap=(host_base, size)``) has an idmapped
rootfs: the host sees its ids shifted by ``host_base`` and host root, which
has no mapping there, cannot create files in it (EOVERFLOW).  Writes then run
as the sandbox's root (:func:`sandbox.isolation.idmap.fs_identity`), so they land as
uid 0 like the sandbox's own, and :meth:`RootFiles.stat` reports ids as the
sandbox sees them.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import os
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, TypeVar, cast

from sandbox.backends.base import entry_kind, special_kind
from sandbox.core.errors import HostUnsupported, NotARegularFile, PathEscape
from sandbox.core.paths import RESOLVE_IN_ROOT, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_XDEV, openat2
from sandbox.isolation import idmap as _idmap
from sandbox.isolation import landlock

CHUNK = 1 << 20
OVERFLOW_ID = 65534  # what the kernel shows for an id without a mapping (nobody)
T = TypeVar("T")

def openat2_in_root(root_fd: int, path: str, flags: int, mode: int = 0, resolve: int = 0) -> int:
    """``openat2(root_fd, path, {flags, mode, RESOLVE_IN_ROOT|RESOLVE_NO_MAGICLINKS|resolve})``;
    a refusal to resolve inside the root (EXDEV, ELOOP, EAGAIN left) is :class:`PathEscape`."""
    try:
        return openat2(root_fd, path, flags, mode, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | resolve)
    except HostUnsupported:
        raise
    except OSError as exc:
        if exc.errno in (errno.EXDEV, errno.ELOOP, errno.EAGAIN) and flags & os.O_NOFOLLOW == 0:
            raise PathEscape(exc.errno, f"{path}: refused while resolving inside the sandbox root "
                                        f"({os.strerror(exc.errno)})", path) from None
        raise


def _split(path: str) -> tuple[str, str]:
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if not parts or parts[-1] == "..":
        raise PathEscape(errno.EINVAL, f"{path!r} does not name an entry inside the sandbox", path)
    return "/" + "/".join(parts[:-1]), parts[-1]


class RootFiles:
    """read/write/list/stat/remove plus chunked upload/download, all confined to ``root``.

    ``idmap``: ``(host_base, size)`` of a user-namespaced sandbox's idmapped rootfs.
    ``open_root`` returns an ``O_PATH`` descriptor of the root for each operation
    (a running sandbox's root is ``/proc/<init>/root`` once its overlay has left the
    host's mount table); ``no_xdev`` keeps resolution on the root's own mount (that
    root also has the sandbox's /proc, /sys and /dev mounted on it).
    """

    def __init__(self, root: str | os.PathLike[str], *, idmap: tuple[int, int] | None = None,
                 open_root: Callable[[], int] | None = None, no_xdev: bool = False) -> None:
        self.root = Path(root)
        self.idmap = idmap
        self._open_root = open_root
        self._resolve = RESOLVE_NO_XDEV if no_xdev else 0
        self._local = threading.local()  # the root descriptor of the operation on this thread

    def _as_sandbox_root(self) -> contextlib.AbstractContextManager[None]:
        """Writes in an idmapped rootfs must come from a mapped fsuid (this thread only)."""
        if self.idmap is None:
            return contextlib.nullcontext()
        return _idmap.fs_identity(self.idmap[0], self.idmap[0])

    def _root_fd(self) -> int:
        if self._open_root is not None:
            return self._open_root()
        return os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

    def _confined(self, fn: Callable[[], T]) -> T:
        """Run one operation's path work on a thread Landlock keeps inside the root (see landlock.py).

        The root is opened here, as the caller (host root), and used by every path the
        operation resolves, so an operation sees one root even if the sandbox restarts.
        """
        root_fd = self._root_fd()

        def work() -> T:
            self._local.root_fd = root_fd
            try:
                return fn()
            finally:
                self._local.root_fd = None

        try:
            return landlock.run_confined(root_fd, work)
        finally:
            os.close(root_fd)

    def within(self, fn: Callable[[int], T]) -> T:
        """``fn(root_fd)`` on a thread Landlock keeps inside the root, for a caller with path work of
        its own (resolved with :func:`openat2_in_root` from ``root_fd``, as this class does)."""
        return self._confined(lambda: fn(self._local.root_fd))

    def _inside(self, st: os.stat_result) -> os.stat_result:
        if self.idmap is None:
            return st
        base, size = self.idmap
        # (the 10 tuple fields, the named-only ones: ns times, blocks...)
        seq, extra = cast("tuple[tuple[Any, ...], dict[str, Any]]", st.__reduce__()[1])
        fields = list(seq)
        for i in (4, 5):  # st_uid, st_gid
            fields[i] = fields[i] - base if base <= fields[i] < base + size else OVERFLOW_ID
        return os.stat_result(fields, extra)

    def _open(self, path: str, flags: int, mode: int = 0) -> int:
        root_fd = getattr(self._local, "root_fd", None)
        if root_fd is None:
            # a bug in this class, not a condition a caller can act on
            raise AssertionError("RootFiles._open outside an operation (use _confined)")
        return openat2_in_root(root_fd, path, flags, mode, self._resolve)

    def _parent(self, path: str) -> tuple[int, str]:
        parent, name = _split(path)
        return self._open(parent, os.O_PATH | os.O_DIRECTORY), name

    def _open_file(self, path: str, flags: int) -> int:
        """The regular file at ``path`` opened with ``flags``; any other entry is refused before it is opened."""
        pfd = self._open(path, os.O_PATH)
        try:
            _require_regular(os.fstat(pfd), path)
            return _reopen(pfd, flags)
        finally:
            os.close(pfd)

    def _create(self, path: str, mode: int) -> int:
        """``path`` opened for writing and truncated: a new regular file, or an existing one once checked."""
        dfd, name = self._parent(path)
        try:
            # O_EXCL makes a new file or fails: it follows no symlink at ``name`` (a dangling one
            # aiming elsewhere) and opens no entry the sandbox raced in (a FIFO, a device node)
            return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                           dir_fd=dfd)
        except FileExistsError:
            pass
        finally:
            os.close(dfd)
        # it exists: resolved from the root like a read (symlinks inside the root are followed),
        # and truncated only once it is known to be a regular file
        return self._open_file(path, os.O_WRONLY | os.O_TRUNC)

    def iter_read(self, path: str, chunk: int = CHUNK) -> Iterator[bytes]:
        fd = self._confined(lambda: self._open_file(path, os.O_RDONLY))
        try:
            while data := os.read(fd, chunk):
                yield data
        finally:
            os.close(fd)

    def read(self, path: str, limit: int | None = None) -> bytes:
        out = bytearray()
        for data in self.iter_read(path):
            out += data
            if limit is not None and len(out) > limit:
                raise OSError(errno.EFBIG, f"{path}: more than {limit} bytes; stream it instead", path)
        return bytes(out)

    def download(self, path: str, dst: BinaryIO, chunk: int = CHUNK) -> int:
        total = 0
        for data in self.iter_read(path, chunk):
            dst.write(data)
            total += len(data)
        return total

    def upload(self, path: str, src: BinaryIO, mode: int = 0o644, chunk: int = CHUNK) -> int:
        def create() -> int:
            with self._as_sandbox_root():  # creation and copy-up; the writes need no identity after open
                fd = self._create(path, mode)
                try:
                    os.fchmod(fd, mode)
                except BaseException:
                    os.close(fd)
                    raise
                return fd

        fd = self._confined(create)
        total = 0
        try:
            while data := src.read(chunk):
                view = memoryview(data)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                total += len(data)
        finally:
            os.close(fd)
        return total

    def write(self, path: str, data: bytes, mode: int = 0o644) -> int:
        import io

        return self.upload(path, io.BytesIO(data), mode)

    def mkdir(self, path: str, mode: int = 0o755) -> None:
        self._confined(lambda: self._mkdir(path, mode))

    def _mkdir(self, path: str, mode: int) -> None:
        dfd, name = self._parent(path)
        try:
            with self._as_sandbox_root():
                os.mkdir(name, mode, dir_fd=dfd)
        finally:
            os.close(dfd)

    def stat(self, path: str) -> os.stat_result:
        """lstat of the entry itself (a symlink is reported, not followed)."""
        return self._confined(lambda: self._stat(path))

    def _stat(self, path: str) -> os.stat_result:
        if path.strip("/") in ("", "."):
            fd = self._open("/", os.O_PATH)
            try:
                return self._inside(os.fstat(fd))
            finally:
                os.close(fd)
        dfd, name = self._parent(path)
        try:
            return self._inside(os.stat(name, dir_fd=dfd, follow_symlinks=False))
        finally:
            os.close(dfd)

    def list(self, path: str = "/") -> list[dict[str, Any]]:
        return self._confined(lambda: self._list(path))

    def _list(self, path: str) -> builtins.list[dict[str, Any]]:
        # O_DIRECTORY is checked by the kernel before it opens anything: a FIFO or a device
        # at ``path`` fails with ENOTDIR unopened; the entries are only lstat'ed
        fd = self._open(path, os.O_RDONLY | os.O_DIRECTORY)
        out = []
        try:
            for name in sorted(os.listdir(fd)):
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                out.append({"name": name, "type": entry_kind(st.st_mode), "size": st.st_size,
                            "mode": stat.S_IMODE(st.st_mode), "mtime": st.st_mtime})
        finally:
            os.close(fd)
        return out

    def remove(self, path: str, *, recursive: bool = False) -> None:
        self._confined(lambda: self._remove(path, recursive))

    def _remove(self, path: str, recursive: bool) -> None:
        dfd, name = self._parent(path)
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            with self._as_sandbox_root():  # whiteouts in the upper are created like files
                if stat.S_ISDIR(st.st_mode):
                    if recursive:
                        rmtree_at(dfd, name, self._resolve)
                    else:
                        os.rmdir(name, dir_fd=dfd)
                else:
                    os.unlink(name, dir_fd=dfd)
        finally:
            os.close(dfd)


def _require_regular(st: os.stat_result, path: str) -> None:
    if stat.S_ISREG(st.st_mode):
        return
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    raise NotARegularFile(errno.EINVAL, path, special_kind(st.st_mode) or "special file")


def _reopen(pfd: int, flags: int) -> int:
    """Open the inode behind the ``O_PATH`` descriptor ``pfd`` for real.

    Through ``/proc/self/fd`` the kernel opens the descriptor's own file, not a path
    again, so the entry checked is the entry opened.  Landlock checks this open
    against the file's real path (inside the root); an inode outside it is refused.
    """
    # the inode is known to be regular, so O_NONBLOCK and O_NOCTTY change nothing for it; they
    # keep a FIFO from blocking, and a tty from becoming our terminal, should a check ever be missed
    return os.open(f"/proc/self/fd/{pfd}", flags | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)


def rmtree_at(dfd: int, name: str, resolve: int) -> None:
    # (resolve: RESOLVE_NO_XDEV keeps the walk off the sandbox's /proc, /sys and /dev)
    fd = openat2_in_root(dfd, name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, 0, resolve)
    try:
        for child in os.listdir(fd):
            st = os.stat(child, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                rmtree_at(fd, child, resolve)
            else:
                os.unlink(child, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dfd)
