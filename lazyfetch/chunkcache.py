"""The host's bounded on-disk cache of verified, uncompressed chunks.

The lazyfetch daemon serves layer blobs out of this cache: a FUSE read looks
chunks up here, the fetcher puts what it fetched and verified from the store.
The cache is local, bounded by a byte capacity, evicts the least recently used
chunks that nobody is reading, and survives daemon restarts.  Everything in it
can be fetched again, so the cache never fsyncs and may lose chunks in a
crash, but it never serves a chunk that is torn or (with ``verify_on_read``)
whose bytes no longer hash to its name.

On-disk layout (``root`` is the cache directory, used by one process at a time)::

    root/lock                 flock()ed exclusively by the open ChunkCache
    root/chunks/<xx>/<hex>    one chunk, its raw bytes; <hex> = 64 hex digits of the
                              blake3 digest, <xx> = its first two; read-only mode
    root/tmp/<hex>.<n>        a chunk being written; renamed to its final name once
                              complete; anything here at open is a leftover and deleted
    root/tmp/<hex>.evicted.<n>  an evicted chunk about to be unlinked
    root/index/               LMDB environment (data.mdb; no lock.mdb: root/lock
                              already excludes every other process)
        db "chunks"           digest (32 bytes) -> _ENTRY: size, last access time
        db "meta"             b"format" -> _FORMAT_VERSION (u32 LE)

The index is derived data.  While the cache runs, the in-memory table is the
truth and the index lags behind it: changes (puts, evictions and, above all,
access times, so that a hit costs no LMDB write) are written in one
transaction every ``_FLUSH_OPS`` changes or ``_FLUSH_SECONDS`` seconds and at
``close``.  Opening reconciles the index with the files:

* index entry, file of the same size     -> kept, with its recorded access time
* index entry, file of another size      -> torn: file deleted, entry dropped
* index entry, no file                   -> dropped (eviction not yet flushed)
* file, no index entry                   -> re-hashed with blake3; adopted (access
                                            time = its mtime) if it matches its name,
                                            deleted otherwise
* anything in root/tmp, odd names        -> deleted

A missing, unreadable or foreign-version index is deleted and rebuilt that
way, from the files alone.  Write order of ``put`` and what a crash leaves:
(1) write root/tmp/<hex>.<n> -- a crash leaves a temp file, deleted at open;
(2) rename it to root/chunks/<xx>/<hex> -- a crash leaves an unindexed file,
re-hashed at open (without fsync its content may be lost: then it is deleted);
(3) index entry written with the next flush.  Eviction renames the file into
root/tmp (under the lock), unlinks it there (outside the lock) and drops the
entry with the next flush, so a crash leaves a file in root/tmp and an entry
without a file, both cleaned up at open.

Accounting: every chunk is charged its size rounded up to whole 4 KiB blocks,
at least one block (what a typical ext4/xfs/tmpfs really allocates for it,
inode and directory entry not counted); ``size``, ``capacity``, ``evict`` and
``stats()["bytes"]`` are in those charged bytes.

Recency: each access stamps the chunk with a "last access time" in
nanoseconds since the epoch that is forced to increase strictly (a clock that
steps back cannot reorder the LRU), and it continues from the largest stamp in
the index after a restart, so the LRU order survives restarts exactly up to
the last flush.

Concurrency: one ``threading.Lock`` guards the table, the pins, the open file
descriptors and the index; file data is read (``os.pread``) and written
outside of it.  A reader holds a use count on the descriptor it reads from,
so eviction can unlink a chunk while it is being read: the reader finishes
from the unlinked inode and the descriptor is closed by whoever uses it last.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import os
import shutil
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType

import blake3
import lmdb

from lazyfetch.client import private_dir
from lazyfetch.errors import LazyfetchError

log = logging.getLogger(__name__)

DIGEST_SIZE = 32
BLOCK_SIZE = 4096  # allocation unit charged per chunk file

# index value: chunk size in bytes, last access time (ns since the epoch, strictly increasing)
_ENTRY = struct.Struct("<QQ")
assert _ENTRY.size == 16
_VERSION = struct.Struct("<I")
assert _VERSION.size == 4
_FORMAT_VERSION = 1
_VERSION_KEY = b"format"

_FLUSH_OPS = 1024  # pending index changes that trigger a write transaction
_FLUSH_SECONDS = 2.0  # ... or the age of the oldest unwritten change
_MAP_SIZE = 1 << 30  # address space only (~10M entries); the file grows with use
_LOAD_WARNINGS = 20  # bad files named one by one at open; the rest only counted
_PUT_WARNING_INTERVAL = 10.0  # seconds between put-failure warnings (the rest go to DEBUG)
_HEX = frozenset("0123456789abcdef")


class CacheFull(LazyfetchError, OSError):
    """A chunk could not be stored in the cache.

    ``put`` does not raise it: it logs its message as one line and returns
    False, and the caller serves the chunk from memory.  ``errno`` is the
    reason (ENOSPC, EDQUOT, EIO ... from the filesystem; ENOSPC too when the
    capacity is taken by pinned chunks or is smaller than the chunk),
    ``filename`` the cache directory and ``digest`` the chunk.
    """

    def __init__(self, err: int, root: Path, digest: bytes, length: int, detail: str = "") -> None:
        OSError.__init__(self, err, os.strerror(err), str(root))
        self.root = root
        self.digest = digest
        self.length = length
        self.detail = detail

    def __str__(self) -> str:
        detail = f" ({self.detail})" if self.detail else ""
        return (
            f"chunk cache {self.root}: cannot store chunk {self.digest.hex()} ({self.length} bytes): "
            f"[Errno {self.errno}] {self.strerror}{detail}; serving it from memory "
            "(free space on that filesystem or lower the cache capacity)"
        )


class CacheUnavailable(LazyfetchError, OSError):
    """The cache directory cannot be opened: another process uses it, or its
    index cannot be created.  The message names the directory and the fix."""


class CacheClosed(LazyfetchError, ValueError):
    """The ChunkCache was used after ``close()`` (like I/O on a closed file)."""


class InvalidDigest(LazyfetchError, ValueError):
    """A chunk name is not a 32-byte blake3 digest."""


def charged(length: int) -> int:
    """Bytes a chunk of ``length`` bytes counts against the capacity."""
    return max(1, -(-length // BLOCK_SIZE)) * BLOCK_SIZE


def _check_digest(digest: bytes) -> None:
    if type(digest) is not bytes or len(digest) != DIGEST_SIZE:
        raise InvalidDigest(f"a chunk digest is {DIGEST_SIZE} raw bytes, not {digest!r:.80}")


def _parse_name(name: str, prefix: str) -> bytes | None:
    """The digest a chunk file name stands for, or None if it is not one of ours."""
    if len(name) != 2 * DIGEST_SIZE or not name.startswith(prefix) or not _HEX.issuperset(name):
        return None
    return bytes.fromhex(name)


def _blake3(data: bytes) -> bytes:
    return blake3.blake3(data, max_threads=blake3.blake3.AUTO).digest()


class _Entry:
    """One cached chunk: what the index stores about it."""

    __slots__ = ("atime", "size")

    def __init__(self, size: int, atime: int) -> None:
        self.size = size
        self.atime = atime


class _Fd:
    """An open chunk file shared by readers; closed by whoever lets go of it last."""

    __slots__ = ("doomed", "fd", "users")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.users = 0
        self.doomed = False


class ChunkCache:
    """A bounded, persistent, thread-safe cache of chunks named by their blake3 digest.

    Contract:

    * ``get`` returns the bytes ``[offset, offset+size)`` of a cached chunk
      (clipped at its end; ``size=-1`` means to the end), or None if the
      chunk is not cached.  A chunk whose file turns out torn (shorter than
      recorded) or, with ``verify_on_read``, corrupt is dropped, logged and
      reported as a miss: the caller fetches it again.  A hit makes the chunk
      the most recently used.
    * ``put`` stores a chunk atomically (only complete chunks ever have their
      final name) and returns True, also when it was cached already; it
      evicts least recently used unpinned chunks to stay within capacity.  It
      returns False, after logging why (``CacheFull``), when the chunk cannot be
      stored; nothing of it is left behind then.  ``put`` trusts ``data`` to be
      the chunk named ``digest``: verifying is the fetcher's job.
    * Chunks inside a ``pinned`` block are never evicted, not even by
      ``evict`` or a capacity shrink; pinning a chunk that is not cached yet
      protects it from the moment it is put.
    * The committed ``size`` never exceeds ``capacity``, except after the
      capacity was lowered below what is pinned (the excess goes with the
      next put or ``evict``).
    * Every method may be called from any thread.  ``close`` is idempotent;
      other methods raise ``CacheClosed`` after it.
    * A second ChunkCache on the same ``root`` (in any process) is refused
      with ``CacheUnavailable`` while the first is open.
    """

    def __init__(
        self,
        root: Path,
        capacity: int,
        *,
        verify_on_read: bool = False,
        max_open_files: int = 256,
    ) -> None:
        if capacity < 0:
            raise ValueError(f"chunk cache capacity must be >= 0, not {capacity}")
        if max_open_files < 1:
            raise ValueError(f"max_open_files must be >= 1, not {max_open_files}")
        self.root = Path(root)
        self.verify_on_read = verify_on_read
        self._capacity = capacity
        self._max_open = max_open_files
        self._chunks_dir = self.root / "chunks"
        self._tmp_dir = self.root / "tmp"

        self._lock = threading.Lock()
        self._lru: OrderedDict[bytes, _Entry] = OrderedDict()  # oldest access first
        self._fds: OrderedDict[bytes, _Fd] = OrderedDict()  # least recently opened/used first
        self._pins: dict[bytes, int] = {}
        self._pending: dict[bytes, _Entry | None] = {}  # index changes not yet written; None = delete
        self._last_flush = time.monotonic()
        self._flush_failing = False
        self._clock = 0  # largest access time handed out
        self._size = 0  # charged bytes of committed chunks
        self._apparent = 0  # their exact sizes
        self._reserved = 0  # charged bytes of chunks being written
        self._tmp_names = itertools.count()
        self._graveyard: list[str] = []  # evicted files moved into root/tmp, to unlink
        self._closed = False
        self._hits = self._misses = self._evictions = self._put_failures = self._corrupt = 0
        self._last_put_warning = -_PUT_WARNING_INTERVAL
        self._unlogged_put_failures = 0

        private_dir(self.root)  # chunks of every image this host ran
        self._lock_fd = self._take_dir_lock()
        try:
            for i in range(256):
                (self._chunks_dir / f"{i:02x}").mkdir(parents=True, exist_ok=True)
            self._tmp_dir.mkdir(exist_ok=True)
            self._env, self._db = self._open_index()
            self._load()
        except BaseException:
            self._release_resources()
            raise

    # -- opening ---------------------------------------------------------------------
    def _take_dir_lock(self) -> int:
        fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise CacheUnavailable(
                errno.EBUSY,
                f"chunk cache {self.root} is in use by another ChunkCache or process "
                "(stop the other lazyfetch daemon, or give this one its own cache directory)",
                str(self.root),
            ) from None
        return fd

    def _lmdb_open(self, path: Path) -> tuple[lmdb.Environment, lmdb._Database]:
        # lock=False: root/lock already keeps other processes out, and every
        # transaction runs under self._lock.  sync=False: the index is derived.
        env = lmdb.open(str(path), map_size=_MAP_SIZE, max_dbs=2, subdir=True, lock=False,
                        sync=False, metasync=False, readahead=False)
        try:
            db = env.open_db(b"chunks")
            meta = env.open_db(b"meta")
            with env.begin(write=True) as txn:
                version = txn.get(_VERSION_KEY, db=meta)
                if version is None:
                    if txn.stat(db)["entries"]:
                        raise lmdb.CorruptedError("entries but no format version")
                    txn.put(_VERSION_KEY, _VERSION.pack(_FORMAT_VERSION), db=meta)
                elif len(version) != _VERSION.size or _VERSION.unpack(version)[0] != _FORMAT_VERSION:
                    raise lmdb.VersionMismatchError(f"index format {bytes(version)!r}, "
                                                    f"this code writes {_FORMAT_VERSION}")
        except BaseException:
            env.close()
            raise
        return env, db

    def _open_index(self) -> tuple[lmdb.Environment, lmdb._Database]:
        path = self.root / "index"
        try:
            return self._lmdb_open(path)
        except lmdb.Error as exc:
            log.warning("chunk cache %s: index %s is unusable (%s); rebuilding it from the chunk files",
                        self.root, path, exc)
        shutil.rmtree(path, ignore_errors=True)
        try:
            return self._lmdb_open(path)
        except lmdb.Error as exc:
            raise CacheUnavailable(
                errno.EIO, f"chunk cache {self.root}: cannot create its index {path}: {exc} "
                "(check free space and permissions there)", str(path)) from exc

    def _read_index(self) -> dict[bytes, _Entry]:
        entries: dict[bytes, _Entry] = {}
        with self._env.begin(db=self._db) as txn:
            for key, value in txn.cursor():
                if len(key) != DIGEST_SIZE or len(value) != _ENTRY.size:
                    # a stray record costs nothing: the file scan decides what is cached
                    log.warning("chunk cache %s: ignoring malformed index record %r", self.root, bytes(key))
                    self._pending[bytes(key)] = None
                    continue
                size, atime = _ENTRY.unpack(value)
                entries[bytes(key)] = _Entry(size, atime)
        return entries

    def _load(self) -> None:
        """Reconcile the index with the files (see the module docstring)."""
        started = time.monotonic()
        indexed = self._read_index()
        with os.scandir(self._tmp_dir) as leftovers:
            for item in leftovers:  # writes a crash interrupted
                self._remove_path(item.path, item.is_dir(follow_symlinks=False))
        found: list[tuple[bytes, _Entry]] = []
        torn = adopted = strays = 0
        for i in range(256):
            prefix = f"{i:02x}"
            with os.scandir(self._chunks_dir / prefix) as listing:
                for item in listing:
                    digest = _parse_name(item.name, prefix)
                    if digest is None or not item.is_file(follow_symlinks=False):
                        log.log(self._load_level(torn + strays),
                                "chunk cache %s: removing %s, which is not a chunk file",
                                self.root, item.path)
                        strays += 1
                        self._remove_path(item.path, item.is_dir(follow_symlinks=False))
                        continue
                    length = item.stat(follow_symlinks=False).st_size
                    known = indexed.pop(digest, None)
                    if known is not None and known.size == length:
                        found.append((digest, known))
                        continue
                    if known is None and self._file_matches(item.path, digest, length):
                        # written before a crash or a lost index: trust only what re-hashes
                        entry = _Entry(length, item.stat(follow_symlinks=False).st_mtime_ns)
                        found.append((digest, entry))
                        self._pending[digest] = entry
                        adopted += 1
                        continue
                    log.log(self._load_level(torn + strays),
                            "chunk cache %s: dropping torn chunk %s (%d bytes on disk, %s)",
                            self.root, digest.hex(), length,
                            "no index entry, content does not match its name" if known is None
                            else f"index says {known.size}")
                    self._remove_path(item.path, False)
                    self._pending[digest] = None
                    torn += 1
        for digest in indexed:  # evicted before a crash, or deleted behind our back
            self._pending[digest] = None
        found.sort(key=lambda pair: pair[1].atime)
        for digest, entry in found:
            self._lru[digest] = entry
            self._size += charged(entry.size)
            self._apparent += entry.size
        self._clock = max((e.atime for _, e in found), default=0)
        with self._lock:
            if self._size > self._capacity:  # the capacity was lowered since the last run
                self._evict_locked(self._capacity)
            self._flush_locked()
        self._reap()
        log.log(logging.WARNING if torn + strays > _LOAD_WARNINGS else logging.INFO,
                "chunk cache %s: %d chunks, %d bytes of %d (%d adopted from files, %d torn dropped, "
                "%d gone, %d stray files removed) in %.3f s", self.root, len(self._lru), self._size,
                self._capacity, adopted, torn, len(indexed), strays, time.monotonic() - started)

    @staticmethod
    def _load_level(complaints: int) -> int:
        # a wiped or foreign directory could have thousands of bad files: name the
        # first few, count the rest in the summary line
        return logging.WARNING if complaints < _LOAD_WARNINGS else logging.DEBUG

    def _file_matches(self, path: str, digest: bytes, length: int) -> bool:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            log.warning("chunk cache %s: cannot read %s: %s", self.root, path, exc)
            return False
        return len(data) == length and _blake3(data) == digest

    def _remove_path(self, path: str, is_dir: bool) -> None:
        try:
            if is_dir:
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("chunk cache %s: cannot remove %s: %s", self.root, path, exc)

    # -- the public interface ----------------------------------------------------------
    def _path(self, digest: bytes) -> str:
        hexd = digest.hex()
        return f"{self._chunks_dir}/{hexd[:2]}/{hexd}"

    def _check_open(self) -> None:
        if self._closed:
            raise CacheClosed(f"chunk cache {self.root} is closed")

    def contains(self, digest: bytes) -> bool:
        """Whether the chunk is cached (does not count as an access)."""
        _check_digest(digest)
        with self._lock:
            self._check_open()
            return digest in self._lru

    def get(self, digest: bytes, offset: int = 0, size: int = -1) -> bytes | None:
        """Bytes ``[offset, offset+size)`` of a cached chunk, clipped at its end; None if absent."""
        _check_digest(digest)
        if offset < 0:
            raise ValueError(f"negative offset {offset} into chunk {digest.hex()}")
        with self._lock:
            self._check_open()
            entry = self._lru.get(digest)
            if entry is None:
                self._misses += 1
                return None
            handle = self._fds.get(digest)
            if handle is None:
                try:
                    # opened under the lock: an evictor cannot unlink the file between
                    # the lookup and the open, and once open it stays readable
                    handle = _Fd(os.open(self._path(digest), os.O_RDONLY | os.O_CLOEXEC))
                except FileNotFoundError:
                    self._misses += 1
                    self._drop_locked(digest, entry, "gone: its file was deleted behind our back")
                    return None  # (nothing to reap: there was no file)
                except OSError as exc:  # EMFILE, EIO ...: a miss, but the chunk may be fine
                    self._misses += 1
                    log.warning("chunk cache %s: cannot open chunk %s: %s", self.root, digest.hex(), exc)
                    return None
                self._fds[digest] = handle
                if len(self._fds) > self._max_open:
                    self._close_fd_locked(*self._fds.popitem(last=False))
            else:
                self._fds.move_to_end(digest)
            handle.users += 1
            self._touch_locked(digest, entry)
        try:
            data, problem = self._read(handle.fd, digest, entry.size, offset, size)
        except BaseException:
            self._let_go(handle)
            raise
        with self._lock:  # one acquisition for both: this is the hot path
            handle.users -= 1
            last = handle.doomed and handle.users == 0
            if problem is None:
                self._hits += 1
            else:
                self._misses += 1
                self._corrupt += 1
                self._drop_locked(digest, entry, problem)
        if last:  # evicted while we read: the file may be freed now, outside the lock
            os.close(handle.fd)
        if problem is None:
            return data
        self._reap()
        return None

    def _read(self, fd: int, digest: bytes, length: int, offset: int,
              size: int) -> tuple[bytes | None, str | None]:
        """(the wanted bytes, None) or (None, what is wrong with the file)."""
        start = min(offset, length)
        want = length - start if size < 0 else min(size, length - start)
        try:
            if self.verify_on_read:
                whole = os.pread(fd, length, 0)
                if len(whole) != length:
                    return None, f"torn: {len(whole)} of {length} bytes on disk"
                if _blake3(whole) != digest:
                    return None, "corrupt: its content no longer hashes to its name"
                return whole[start:start + want], None
            data = os.pread(fd, want, start) if want else b""
            if want:
                # the kernel keeps what it read in EROFS's page cache already: a second
                # copy in this file's page cache would hold every served byte twice
                os.posix_fadvise(fd, start, want, os.POSIX_FADV_DONTNEED)
        except OSError as exc:  # EIO from a failing disk: refetching is the cure
            return None, f"unreadable: {exc}"
        if len(data) != want:
            return None, f"torn: file ends before byte {start + want} of {length}"
        return data, None

    def put(self, digest: bytes, data: bytes) -> bool:
        """Store a chunk; True once it is cached, False (logged) if it cannot be."""
        _check_digest(digest)
        length = len(data)
        need = charged(length)
        with self._lock:
            self._check_open()
            entry = self._lru.get(digest)
            if entry is not None:
                self._touch_locked(digest, entry)
                return True
            problem = self._reserve_locked(digest, length)
            if problem is not None:
                self._put_failures += 1
        if problem is not None:
            self._log_put_failure(problem)
            return False
        self._reap()  # the space of what was evicted for us, before we write
        failure: CacheFull | None = None
        try:
            tmp = self._write_tmp(digest, data)
        except CacheFull as exc:
            failure = exc
        except BaseException:
            with self._lock:
                self._reserved -= need
            raise
        with self._lock:
            self._reserved -= need
            if failure is None:
                failure = self._commit_locked(digest, length, tmp)
            else:
                self._put_failures += 1
        self._reap()
        if failure is None:
            return True
        self._log_put_failure(failure)
        return False

    def _commit_locked(self, digest: bytes, length: int, tmp: str) -> CacheFull | None:
        """Give a written temp file its final name and index it."""
        if self._closed:
            self._remove_path(tmp, False)
            return CacheFull(errno.ESHUTDOWN, self.root, digest, length, "the cache was closed")
        existing = self._lru.get(digest)
        if existing is not None:  # another thread stored the same chunk meanwhile
            self._remove_path(tmp, False)
            self._touch_locked(digest, existing)
            return None
        try:
            # under the lock: an evictor may be moving this very name aside
            os.rename(tmp, self._path(digest))
        except OSError as exc:
            self._remove_path(tmp, False)
            self._put_failures += 1
            return CacheFull(exc.errno or errno.EIO, self.root, digest, length, "rename")
        self._clock = max(self._clock + 1, time.time_ns())
        entry = _Entry(length, self._clock)
        self._lru[digest] = entry
        self._size += charged(length)
        self._apparent += length
        self._pending[digest] = entry
        if self._size > self._capacity:  # the capacity shrank while we wrote
            self._evict_locked(self._capacity)
        self._maybe_flush_locked()
        return None

    def _reserve_locked(self, digest: bytes, length: int) -> CacheFull | None:
        """Make room for a chunk and reserve it, or say why there is none."""
        need = charged(length)
        target = self._capacity - self._reserved - need
        if target < 0:
            return CacheFull(errno.ENOSPC, self.root, digest, length,
                             f"larger than the capacity of {self._capacity} bytes less "
                             f"{self._reserved} being written")
        if self._size > target:
            evictable = self._size - self._pinned_bytes_locked()
            if self._size - evictable > target:
                # evicting would not make enough room: keep what we have
                return CacheFull(errno.ENOSPC, self.root, digest, length,
                                 f"{self._size - evictable} of the {self._capacity} bytes of "
                                 "capacity hold pinned chunks")
            self._evict_locked(target)
        self._reserved += need
        return None

    def _write_tmp(self, digest: bytes, data: bytes) -> str:
        """Write ``data`` to a new temp file; its path.  Retries once after a full disk."""
        length = len(data)
        for attempt in (1, 2):
            tmp = f"{self._tmp_dir}/{digest.hex()}.{next(self._tmp_names)}"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                    # start writeback now so the pages can be dropped instead of lingering
                    # as a second copy of what the reader gets from memory
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
                return tmp
            except OSError as exc:
                self._remove_path(tmp, False)
                err = exc.errno or errno.EIO
                if attempt == 2 or err not in (errno.ENOSPC, errno.EDQUOT):
                    raise CacheFull(err, self.root, digest, length,
                                    "after evicting to make room" if attempt == 2 else "") from exc
                if not self._make_disk_room(err, length):
                    raise CacheFull(err, self.root, digest, length,
                                    "evicting every unpinned chunk would not make enough room"
                                    ) from exc
        raise AssertionError("unreachable")

    def _make_disk_room(self, err: int, length: int) -> bool:
        """Evict for a filesystem that is fuller than our capacity; False if hopeless."""
        need = charged(length)
        shortfall = need
        if err == errno.ENOSPC:
            # the disk is shared: other users may have taken what our capacity assumed
            try:
                st = os.statvfs(self._tmp_dir)
                shortfall = max(BLOCK_SIZE, need - st.f_bavail * st.f_frsize)
            except OSError:
                pass
        with self._lock:
            evictable = self._size - self._pinned_bytes_locked()
            if evictable < shortfall:
                return False
            freed = self._evict_locked(self._size - shortfall)
        self._reap()
        log.info("chunk cache %s: filesystem full (errno %d); evicted %d bytes and retrying",
                 self.root, err, freed)
        return True

    def _log_put_failure(self, exc: CacheFull) -> None:
        # a full disk fails every put: one warning per interval, the rest at DEBUG
        with self._lock:
            now = time.monotonic()
            loud = now - self._last_put_warning >= _PUT_WARNING_INTERVAL
            if loud:
                self._last_put_warning = now
                unlogged, self._unlogged_put_failures = self._unlogged_put_failures, 0
            else:
                self._unlogged_put_failures += 1
        if loud:
            more = f" [{unlogged} more put failures since the last warning]" if unlogged else ""
            log.warning("%s%s", exc, more)
        else:
            log.debug("%s", exc)

    @contextmanager
    def pinned(self, digests: Iterable[bytes]) -> Iterator[None]:
        """Keep these chunks (cached now or put later) from eviction inside the block."""
        wanted = list(digests)
        for digest in wanted:
            _check_digest(digest)
        with self._lock:
            for digest in wanted:
                self._pins[digest] = self._pins.get(digest, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                for digest in wanted:
                    left = self._pins[digest] - 1
                    if left:
                        self._pins[digest] = left
                    else:
                        del self._pins[digest]

    def evict(self, target_bytes: int) -> int:
        """Evict least recently used unpinned chunks until ``size <= target_bytes``.

        Returns the charged bytes freed; stops early if only pinned chunks are left.
        """
        with self._lock:
            self._check_open()
            freed = self._evict_locked(max(0, target_bytes))
            self._maybe_flush_locked()
        self._reap()
        return freed

    @property
    def size(self) -> int:
        """Charged bytes (whole 4 KiB blocks per chunk) of the cached chunks."""
        return self._size

    @property
    def count(self) -> int:
        return len(self._lru)

    @property
    def capacity(self) -> int:
        return self._capacity

    @capacity.setter
    def capacity(self, value: int) -> None:
        if value < 0:
            raise ValueError(f"chunk cache capacity must be >= 0, not {value}")
        with self._lock:
            self._check_open()
            self._capacity = value
            self._evict_locked(value)
            self._maybe_flush_locked()
        self._reap()

    def stats(self) -> dict[str, int]:
        """Counters since open, and the current occupancy."""
        with self._lock:
            return {
                "hits": self._hits,
                "misses": self._misses,
                "evictions": self._evictions,
                "bytes": self._size,
                "count": len(self._lru),
                "put_failures": self._put_failures,
                "corrupt": self._corrupt,  # torn or (verify_on_read) mismatching chunks dropped
                "apparent_bytes": self._apparent,
                "capacity": self._capacity,
                "pinned": len(self._pins),
                "open_files": len(self._fds),
            }

    def flush(self) -> None:
        """Write pending index changes (recency, puts, evictions) now."""
        with self._lock:
            self._check_open()
            self._flush_locked()

    def close(self) -> None:
        """Write the index, close every file; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._flush_locked()
            while self._fds:
                self._close_fd_locked(*self._fds.popitem(last=False))
        self._reap()
        self._release_resources()

    def _release_resources(self) -> None:
        env = getattr(self, "_env", None)
        if env is not None:
            env.close()
        os.close(self._lock_fd)  # releases the flock

    def __enter__(self) -> ChunkCache:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- under the lock ----------------------------------------------------------------
    def _touch_locked(self, digest: bytes, entry: _Entry) -> None:
        self._lru.move_to_end(digest)
        # strictly increasing, so equal clock readings or a clock stepped back
        # cannot reorder the LRU, here or after a restart
        self._clock = max(self._clock + 1, time.time_ns())
        entry.atime = self._clock
        self._pending[digest] = entry
        self._maybe_flush_locked()

    def _pinned_bytes_locked(self) -> int:
        # O(pins), not O(chunks): pins are the few chunks being read right now
        return sum(charged(e.size) for e in map(self._lru.get, self._pins) if e is not None)

    def _evict_locked(self, target: int) -> int:
        if self._size <= target:
            return 0
        victims: list[tuple[bytes, _Entry]] = []
        left = self._size
        for digest, entry in self._lru.items():  # oldest access first
            if left <= target:
                break
            if digest in self._pins:
                continue
            victims.append((digest, entry))
            left -= charged(entry.size)
        freed = self._size - left
        for digest, entry in victims:
            self._remove_locked(digest, entry)
        self._evictions += len(victims)
        if victims:
            log.debug("chunk cache %s: evicted %d chunks, %d bytes", self.root, len(victims), freed)
        return freed

    def _drop_locked(self, digest: bytes, entry: _Entry, why: str) -> None:
        if self._lru.get(digest) is not entry:
            return  # already evicted (and maybe put again) by another thread
        log.error("chunk cache %s: chunk %s is %s; dropped, it will be fetched again",
                  self.root, digest.hex(), why)
        self._remove_locked(digest, entry)

    def _remove_locked(self, digest: bytes, entry: _Entry) -> None:
        del self._lru[digest]
        self._size -= charged(entry.size)
        self._apparent -= entry.size
        self._pending[digest] = None
        handle = self._fds.pop(digest, None)
        if handle is not None:
            self._close_fd_locked(digest, handle)  # cheap: the file still has a name
        # Renamed out of the way under the lock, so that a put of the same chunk
        # cannot rename its new file into place before we are done with the old
        # name; unlinked by _reap outside the lock, because freeing the blocks of
        # a written-back 1 MiB file costs ~0.4 ms on ext4 against ~12 us for the
        # rename.  A crash in between leaves it in root/tmp, emptied at open.
        grave = f"{self._tmp_dir}/{digest.hex()}.evicted.{next(self._tmp_names)}"
        try:
            os.rename(self._path(digest), grave)
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("chunk cache %s: cannot move evicted chunk %s aside (%s); unlinking it",
                        self.root, digest.hex(), exc)
            self._remove_path(self._path(digest), False)
            return
        self._graveyard.append(grave)

    def _let_go(self, handle: _Fd) -> None:
        """A reader is done with ``handle``; the last one out closes a doomed fd."""
        with self._lock:
            handle.users -= 1
            last = handle.doomed and handle.users == 0
        if last:  # no longer reachable by anyone; closing may free an unlinked file
            os.close(handle.fd)

    def _reap(self) -> None:
        """Unlink evicted files, outside the lock."""
        if not self._graveyard:
            return
        with self._lock:
            doomed, self._graveyard = self._graveyard, []
        for path in doomed:
            self._remove_path(path, False)

    def _close_fd_locked(self, digest: bytes, handle: _Fd) -> None:
        if handle.users:
            handle.doomed = True  # the last reader closes it
        else:
            os.close(handle.fd)

    def _maybe_flush_locked(self) -> None:
        if len(self._pending) >= _FLUSH_OPS or (
            self._pending and time.monotonic() - self._last_flush >= _FLUSH_SECONDS
        ):
            self._flush_locked()

    def _flush_locked(self) -> None:
        self._last_flush = time.monotonic()
        if not self._pending:
            return
        try:
            with self._env.begin(write=True, db=self._db) as txn:
                for digest, entry in self._pending.items():
                    if entry is None:
                        txn.delete(digest)
                    else:
                        txn.put(digest, _ENTRY.pack(entry.size, entry.atime))
        except lmdb.Error as exc:
            # only recency and restart speed are at stake: keep the changes, retry later
            if not self._flush_failing:
                log.warning("chunk cache %s: cannot write its index (%s); %d changes kept in "
                            "memory and retried", self.root, exc, len(self._pending))
            self._flush_failing = True
            return
        if self._flush_failing:
            log.info("chunk cache %s: index writable again", self.root)
        self._flush_failing = False
        self._pending.clear()
