"""A store in a POSIX directory: a local disk or a shared mount (NFS, CephFS, 3FS).

Layout: the object ``a/b/c`` is the regular file ``<root>/a/b/c``.  Names
starting with ``.`` belong to the backend (keys cannot start a component
with ``.``, see :func:`~layerstore.backend.check_key`) and ``list`` never
shows them:

- ``.tmp-<16 hex>`` a write in progress, or one a crash interrupted.  Such a
  file is garbage once it is older than any write can take:
  ``sweep_leftovers`` (run by gc with its grace period) deletes those.
- ``.<name>.lock`` the lock file that serializes ``put_conditional`` on
  ``<name>`` (see below).  Never deleted: removing a lock file somebody waits
  on would let two writers in.

Write order, and what a crash after each step leaves behind:

1. create ``.tmp-*`` in the object's directory (``O_EXCL``), write, set the
   etag xattr, ``fsync``: crash → a hidden temp file; the object unchanged.
2. ``rename(tmp, final)`` (``put``, compare-and-swap) or ``link(tmp, final)``
   (``put_if_absent``: fails with ``EEXIST`` atomically, also on NFS): the
   object is complete under its name (rename and link are atomic), maybe
   not yet durable.
3. ``fsync`` the directory: the name is durable.
4. (link only) unlink the temp name.

Etags are the blake3 hex digest of the content: stable across hosts and
mounts, unlike inode numbers and timestamps (and safe from ABA: a recycled
inode with the same mtime tick and size cannot fool a compare-and-swap).  The
digest is stored with the data as the xattr ``user.layerbox.blake3`` so that
``head`` and ``list`` need no read; a file without it (a filesystem without
user xattrs, a copy made by other tools) is hashed when asked.

Compare-and-swap holds ``flock(2)`` on the key's lock file around
read-etag/compare/rename, plus a per-process lock (on NFS, Linux emulates
``flock`` with POSIX locks, which do not exclude threads of one process).
Limits:

- Across hosts this is only as good as the filesystem's ``flock``: coherent
  on NFSv4 (and v3 with NLM), CephFS and local filesystems; a FUSE
  filesystem whose daemon does not implement locks (check your 3FS client's
  version) only locks per host.  Run the multi-process CAS conformance test
  on the real mount before relying on it from many hosts.
- Plain ``put`` and ``delete`` do not take the lock (see the contract).
- ``delete`` leaves empty directories behind: removing them would race with
  writers creating files in them.
- Blocking calls run in threads, which cannot be interrupted: a cancelled
  write may still complete, and a hung mount hangs the call.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import functools
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import blake3

from layerstore.backend import (
    Backend,
    BackendError,
    CredentialsError,
    InvalidKey,
    Leftovers,
    ObjectInfo,
    ObjectNotFound,
    PreconditionFailed,
    TransientError,
    check_key,
    check_prefix,
    check_range,
)
from layerstore.hoststate import open_private

log = logging.getLogger(__name__)

T = TypeVar("T")

ETAG_XATTR = "user.layerbox.blake3"
TEMP_PREFIX = ".tmp-"
WRITE_PIECE = 8 << 20  # bytes per write(2): keeps a torn write visibly partial, never final
_HASH_PIECE = 4 << 20
_LOCK_STRIPES = [threading.Lock() for _ in range(64)]
_NO_XATTRS = {errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENODATA, errno.EPERM, errno.E2BIG, errno.ERANGE}
_RETRYABLE_ERRNOS = {errno.ESTALE, errno.EIO, errno.ETIMEDOUT, errno.EAGAIN, errno.EINTR,
                     errno.ENOLCK, errno.ECONNRESET, errno.EHOSTDOWN, errno.EHOSTUNREACH}
_NO_HARDLINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EMLINK}
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


# One directory's objects and subdirectories (info None), in key order.
_Entries = list[tuple[str, ObjectInfo | None]]


class StoreFull(BackendError):
    """The filesystem holding the store has no space (or quota) left; nothing was written."""

    fix = "free space, raise the quota or move the store"

    def __init__(self, message: str, errno_: int) -> None:
        super().__init__(message)
        self.errno = errno_


class PermissionDenied(CredentialsError, PermissionError):
    """The store's files refuse this user; retrying will not help."""

    def __init__(self, message: str, errno_: int) -> None:
        super().__init__(message)
        self.errno = errno_


class PosixBackend(Backend):
    """Objects as files under ``root``; see the module docstring for the layout."""

    def __init__(self, root: str | os.PathLike[str], *, lock_timeout: float = 30.0) -> None:
        self.root = Path(os.path.abspath(root))
        self.url = f"file://{self.root}"
        self.lock_timeout = lock_timeout

    def __repr__(self) -> str:
        return f"PosixBackend({str(self.root)!r})"

    # -- the one bridge to blocking I/O ------------------------------------------------
    async def _run(self, op: str, key: str, fn: Callable[..., T], *args: object) -> T:
        try:
            return await asyncio.to_thread(fn, *args)
        except BackendError:
            raise
        except OSError as exc:
            raise self._error(exc, op, key) from exc

    def _error(self, exc: OSError, op: str, key: str) -> BackendError:
        """Turn an OSError into the BackendError that says what to do about it."""
        where = f"{self.url}: {op} {key!r}"
        path = exc.filename if isinstance(exc.filename, str) else self._path(key)
        code = exc.errno
        if code in (errno.ENOSPC, errno.EDQUOT):
            what = "disk quota exceeded" if code == errno.EDQUOT else "no space left"
            return StoreFull(f"{where}: {what} on the filesystem holding {path}; nothing was "
                             "written: free space, raise the quota or move the store", code)
        if code in (errno.EACCES, errno.EPERM):
            return PermissionDenied(
                f"{where}: permission denied on {path} (uid {os.geteuid()}): give this user "
                "access to the store directory (owner, mode, ACL) or run as its owner", code)
        if code == errno.EROFS:
            return BackendError(f"{where}: {path} is on a read-only filesystem: remount it "
                                "read-write or open the store elsewhere")
        if code in (errno.ENOTDIR, errno.EEXIST, errno.EISDIR):
            return InvalidKey(f"{where}: the key collides with another key in the directory tree "
                              f"at {path}: a POSIX store cannot hold both 'a' and 'a/b'")
        if code in _RETRYABLE_ERRNOS:
            return TransientError(f"{where}: {exc} (retryable)")
        return BackendError(f"{where}: {exc}")

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*key.split("/"))

    # -- reads ---------------------------------------------------------------------------
    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        check_key(key)
        check_range(start, end)
        return await self._run("get", key, self._get_sync, key, start, end)

    def _get_sync(self, key: str, start: int | None, end: int | None) -> bytes:
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFound(key, self.url) from None
        try:
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        if not stat.S_ISREG(st.st_mode):  # a directory of other keys
            os.close(fd)
            raise ObjectNotFound(key, self.url)
        with os.fdopen(fd, "rb", buffering=0) as f:
            if start is None and end is None:
                return f.readall()
            lo = start or 0
            hi = st.st_size if end is None else min(end, st.st_size)
            parts = []
            while lo < hi:
                piece = os.pread(fd, hi - lo, lo)
                if not piece:  # the file shrank: impossible for our files, but do not spin
                    break
                parts.append(piece)
                lo += len(piece)
            return b"".join(parts)

    async def head(self, key: str) -> ObjectInfo | None:
        check_key(key)
        return await self._run("head", key, self._info_sync, key, self._path(key))

    def _info_sync(self, key: str, path: Path) -> ObjectInfo | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None
            return ObjectInfo(key, st.st_size, _etag_of(fd), st.st_mtime)
        finally:
            os.close(fd)

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        check_prefix(prefix)
        head, _, tail = prefix.rpartition("/")
        start = self._path(head) if head else self.root
        async for info in self._walk(start, f"{head}/" if head else "", tail):
            yield info

    async def _walk(self, directory: Path, keybase: str, name_prefix: str) -> AsyncIterator[ObjectInfo]:
        entries = await self._run("list", keybase + name_prefix, self._scan_sync,
                                  directory, keybase, name_prefix)
        for name, info in entries:
            if info is None:
                async for below in self._walk(directory / name, f"{keybase}{name}/", ""):
                    yield below
            else:
                yield info

    def _scan_sync(self, directory: Path, keybase: str, name_prefix: str) -> _Entries:
        """One directory's objects and subdirectories (info None), in key order."""
        try:
            with os.scandir(directory) as it:
                found = [(e.name, e.is_dir(follow_symlinks=False)) for e in it
                         if not e.name.startswith(".") and e.name.startswith(name_prefix)]
        except (FileNotFoundError, NotADirectoryError):
            return []
        # Sort as the keys sort: everything below directory "a" starts with "a/",
        # which sorts after "a-b" and before "a0".
        found.sort(key=lambda entry: entry[0] + "/" if entry[1] else entry[0])
        result: _Entries = []
        for name, is_dir in found:
            if is_dir:
                result.append((name, None))
                continue
            info = self._info_sync(keybase + name, directory / name)
            if info is not None:  # else deleted meanwhile, or not a regular file
                result.append((name, info))
        return result

    # -- writes --------------------------------------------------------------------------
    async def put(self, key: str, data: bytes) -> None:
        check_key(key)
        await self._run("put", key, self._put_sync, key, data)

    def _put_sync(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = self._write_temp(path, data, _hash(data))
        try:
            os.rename(tmp, path)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        _fsync_dir(path.parent)

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        check_key(key)
        return await self._run("put_if_absent", key, self._put_if_absent_sync, key, data)

    def _put_if_absent_sync(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        if os.path.lexists(path):  # the common case for content-addressed objects: no write
            self._refuse_directory(path)
            return False
        tmp = self._write_temp(path, data, _hash(data))
        try:
            wrote = _link_noreplace(tmp, path)
            if not wrote:
                self._refuse_directory(path)
        finally:
            _unlink_quietly(tmp)
        _fsync_dir(path.parent)
        return wrote

    async def put_conditional(self, key: str, data: bytes, if_match: str | None) -> str:
        check_key(key)
        return await self._run("put_conditional", key, self._put_conditional_sync, key, data, if_match)

    def _put_conditional_sync(self, key: str, data: bytes, if_match: str | None) -> str:
        path = self._path(key)
        etag = _hash(data)
        tmp = self._write_temp(path, data, etag)  # outside the lock: hold it only to swap
        try:
            with self._locked(key, path):
                if if_match is None:
                    if not _link_noreplace(tmp, path):
                        self._refuse_directory(path)
                        raise PreconditionFailed(key, self.url, "it exists (if_match=None)")
                else:
                    current = self._info_sync(key, path)
                    if current is None:
                        self._refuse_directory(path)
                        raise PreconditionFailed(key, self.url, f"it no longer exists (expected {if_match})")
                    if current.etag != if_match:
                        raise PreconditionFailed(key, self.url, f"expected {if_match}, found {current.etag}")
                    os.rename(tmp, path)
                _fsync_dir(path.parent)
        finally:
            _unlink_quietly(tmp)
        return etag

    @staticmethod
    def _refuse_directory(path: Path) -> None:
        """A key whose path is a directory of other keys: raise what _error says about it."""
        if os.path.isdir(path):
            raise OSError(errno.EISDIR, "Is a directory", str(path))

    @contextlib.contextmanager
    def _locked(self, key: str, path: Path) -> Iterator[None]:
        lock_path = path.with_name(f".{path.name}.lock")
        with _LOCK_STRIPES[hash(str(lock_path)) % len(_LOCK_STRIPES)]:
            # 0600: the store's readers may list this directory, and a lock file they could open
            # is one they could hold, stalling every conditional write of the key
            fd = open_private(lock_path)
            try:
                deadline = time.monotonic() + self.lock_timeout
                pause = 0.001
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() > deadline:
                            raise TransientError(
                                f"{self.url}: put_conditional {key!r}: {lock_path} stayed locked for "
                                f"{self.lock_timeout:g} s (another writer hung or died holding it)"
                            ) from None
                        time.sleep(pause)  # in a worker thread, never on the event loop
                        pause = min(pause * 2, 0.05)
                yield
            finally:
                os.close(fd)  # releases the flock

    def _write_temp(self, path: Path, data: bytes, etag: str) -> Path:
        """Write ``data`` to a new fsync'ed temp file next to ``path``; return its path.

        Creates the store's directories on first use; leaves nothing behind on failure.
        """
        directory = path.parent
        tmp = directory / f"{TEMP_PREFIX}{secrets.token_hex(8)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o644)
        except FileNotFoundError:
            self._make_dirs(directory)
            fd = os.open(tmp, flags, 0o644)
        try:
            view = memoryview(data)
            written = 0
            while written < len(view):
                written += os.write(fd, view[written:written + WRITE_PIECE])
            _set_etag(fd, etag)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink_quietly(tmp)
            raise
        os.close(fd)
        return tmp

    def _make_dirs(self, directory: Path) -> None:
        if not self.root.is_dir():
            os.makedirs(self.root.parent, mode=0o755, exist_ok=True)
            try:
                os.mkdir(self.root, 0o755)
            except FileExistsError:
                pass  # another writer (maybe another host and user) made it: leave it be
            else:
                # Readable by every user whatever our umask, so that one writer and many
                # readers can share the store.
                os.chmod(self.root, 0o755)
        os.makedirs(directory, mode=0o755, exist_ok=True)

    async def delete(self, key: str) -> None:
        check_key(key)
        await self._run("delete", key, self._delete_sync, self._path(key))

    async def sweep_leftovers(self, older_than: float, *, dry_run: bool = False) -> Leftovers:
        """Temporary files (``.tmp-*``) not modified for ``older_than`` seconds, deleted.

        A write in progress rewrites its temporary file's mtime with every
        piece, and gives it its name within moments of the last one; a
        temporary file that stayed unchanged for long belongs to a write
        that died.  Lock files are never touched.
        """
        return await self._run("sweep_leftovers", "", self._sweep_sync, older_than, dry_run)

    def _sweep_sync(self, older_than: float, dry_run: bool) -> Leftovers:
        cutoff = time.time() - older_than
        found: Leftovers = []
        for directory, _, files in os.walk(self.root):
            for name in files:
                if not name.startswith(TEMP_PREFIX):
                    continue
                path = os.path.join(directory, name)
                try:
                    if os.lstat(path).st_mtime > cutoff:
                        continue
                    if not dry_run:
                        os.unlink(path)
                except FileNotFoundError:
                    continue  # renamed or removed meanwhile
                found.append(path)
        return sorted(found)

    def _delete_sync(self, path: Path) -> None:
        try:
            os.unlink(path)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return
        _fsync_dir(path.parent)


def _hash(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def _set_etag(fd: int, etag: str) -> None:
    try:
        os.setxattr(fd, ETAG_XATTR, etag.encode())
    except OSError as exc:
        if exc.errno not in _NO_XATTRS:
            raise  # ENOSPC and friends are real failures
        # Without user xattrs the etag is recomputed from the content when asked.


def _etag_of(fd: int) -> str:
    try:
        value = os.getxattr(fd, ETAG_XATTR).decode("ascii", "replace")
        if len(value) == 64:
            return value
    except OSError as exc:
        if exc.errno not in _NO_XATTRS:
            raise
    hasher = blake3.blake3()
    offset = 0
    while piece := os.pread(fd, _HASH_PIECE, offset):
        hasher.update(piece)
        offset += len(piece)
    return hasher.hexdigest()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise  # some network and FUSE filesystems cannot fsync a directory: nothing to do
    finally:
        os.close(fd)


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _link_noreplace(src: Path, dst: Path) -> bool:
    """Give ``src``'s file the name ``dst`` unless ``dst`` exists; atomic. True if it did."""
    try:
        os.link(src, dst)
        return True
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in _NO_HARDLINKS:
            raise
        first = exc
    # No hard links here (some FUSE filesystems): renameat2(RENAME_NOREPLACE) is just as
    # atomic where the filesystem supports it.  src is gone afterwards either way.
    try:
        return _rename_noreplace(src, dst)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(first.errno, f"{first.strerror}; the filesystem supports neither hard "
                                       "links nor RENAME_NOREPLACE, so put_if_absent cannot be "
                                       "atomic here", str(dst)) from exc
        raise


@functools.cache
def _renameat2() -> Callable[..., int] | None:
    libc = ctypes.CDLL(None, use_errno=True)
    return getattr(libc, "renameat2", None)


def _rename_noreplace(src: Path, dst: Path) -> bool:
    renameat2 = _renameat2()
    if renameat2 is None:
        raise OSError(errno.ENOSYS, "the C library has no renameat2", str(dst))
    if renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
        return True
    code = ctypes.get_errno()
    if code == errno.EEXIST:
        return False
    raise OSError(code, os.strerror(code), str(dst))
