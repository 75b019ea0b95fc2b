"""The host's cache of layer data: one sparse local file per layer blob.

A layer's blob (the data device of its EROFS image: chunks at the block
offsets its blob map gives) is kept as ``<root>/<hex>.blob``, a sparse file of
the blob's size rounded up to 2 MiB.  The kernel reads that very file: a
file-backed EROFS mount names it as its ``device=`` (fanotify pre-content
events hold each read of a missing range until the daemon has filled it), or
the daemon's FUSE file system preads it.  So a chunk on this host costs one
``pread`` of a local file, with the kernel's readahead and page cache, not a
lookup in a chunk index and an fd per chunk.

What is present is decided by the file alone, never by memory: a chunk is
here iff its byte range has no hole (``SEEK_HOLE``).  A chunk is written only
after it was verified against its blake3 digest (lazyfetch/fetcher.py), with
one ``pwrite``; a crash mid-write leaves a hole in the range, so the chunk
counts as missing and is fetched again.  Eviction punches the chunk's range
(``FALLOC_FL_PUNCH_HOLE``), after which the next read asks for it again.

Power loss is the one case where a range can read as data without being the
chunk: an extent allocated whose data never reached the disk.  So the kernel's
boot id is kept in ``<root>/boot_id``; when it changed since the files were
written, each blob gets a ``<hex>.unverified`` marker and every present chunk
of it is hashed again before the blob is first served (mismatches punched).

Trades (issue 13): a chunk shared by two layers is stored once per layer (no
local dedup across layers; the store still keeps it once), and recency is
kept in memory only: after a restart every present chunk starts as the
oldest.  Layout and rules: docs/FORMAT.md, "Host blob cache".
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import errno
import fcntl
import functools
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import blake3

from layerstore.erofs import format as F
from layerstore.erofs.reader import BlobRecord
from layerstore.hoststate import open_private
from lazyfetch.client import private_dir
from lazyfetch.errors import LazyfetchError

log = logging.getLogger("layerbox.lazyfetch")

PAD = 2 << 20  # blob files are this aligned: a VM maps a blob as virtio-pmem in 2 MiB pages
BLOCK = 4096  # what a chunk's range is charged: whole filesystem blocks
EVICT_MIN_AGE = 30.0  # seconds since its last read before a chunk of a served layer is punched
EVICT_LOW_WATER = 0.9  # eviction frees down to this fraction of the capacity
_FALLOC_PUNCH = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
_HEX64 = re.compile(r"[0-9a-f]{64}")
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


class BlobCacheError(LazyfetchError):
    pass


def charged(start: int, length: int) -> int:
    """Bytes of whole blocks the range [start, start+length) occupies."""
    if length <= 0:
        return 0
    return (start + length + BLOCK - 1) // BLOCK * BLOCK - start // BLOCK * BLOCK


def padded(size: int) -> int:
    return max((size + PAD - 1) // PAD * PAD, PAD)


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    libc.fallocate.restype = ctypes.c_int
    return libc


def punch_hole(fd: int, offset: int, length: int) -> None:
    if _libc().fallocate(fd, _FALLOC_PUNCH, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"punching [{offset}, {offset + length}) of a blob file: {os.strerror(err)}")


def holes(fd: int, offset: int, end: int) -> Iterator[tuple[int, int]]:
    """The holes of the file in [offset, end), as (start, end) pairs, from the filesystem."""
    pos = offset
    while pos < end:
        try:
            hole = os.lseek(fd, pos, os.SEEK_HOLE)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # pos at or past EOF
                return
            raise
        if hole >= end:
            return
        try:
            data = os.lseek(fd, hole, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                raise
            data = end  # a hole up to EOF
        yield hole, min(data, end)
        pos = data


def boot_id() -> str:
    try:
        return Path(_BOOT_ID).read_text().strip()
    except OSError:
        return ""


class LayerBlob:
    """One layer's blob file: which chunks it holds, and filling, reading and punching them."""

    def __init__(self, hexd: str, path: Path, fd: int, blob_size: int, records: list[BlobRecord]) -> None:
        self.hexd = hexd
        self.digest = "blake3:" + hexd
        self.path = path
        self.fd = fd
        self.blob_size = blob_size
        self.size = padded(blob_size)
        self.records = sorted(records, key=lambda r: r.block)
        self.starts = [r.block * F.BLOCK_SIZE for r in self.records]
        self.positions: dict[bytes, list[int]] = {}
        for i, rec in enumerate(self.records):
            self.positions.setdefault(rec.digest, []).append(i)
        self.present = bytearray(len(self.records))  # a hint for accounting and eviction; reads ask the file
        self.missing_count = len(self.records)
        self.complete_hint = False
        self.lock = threading.Lock()  # "complete and ignored" vs "about to punch": one at a time
        self.trace: dict[bytes, None] | None = None  # chunk digests in first-read order while recording
        self.trace_until = 0.0
        self.images: set[str] = set()
        # read-ahead (lazyfetch/blobfs.py): the region fetched lately is [seen_from, ahead_end); a
        # read past ahead_mark starts the next window of ``window`` bytes (0: not sequential)
        self.seen_from = self.ahead_mark = self.ahead_end = -(1 << 62)
        self.window = 0
        self.streak = 0  # sequential misses in a row
        # record i -> 1 + the last record of the file record i belongs to: what a reader inside a
        # file is heading into (lazyfetch/blobfs.py reads ahead to there)
        self.file_end = self._file_ends()

    def _file_ends(self) -> list[int]:
        """Where each record's file ends, from the blob map alone (one pass, no metadata walk: a
        walk of a 10,000-file image costs ~0.1 s of the daemon's CPU while mounts wait for it).

        A chunk-based file's chunks are consecutive records, all but its last as long as its
        chunk size (a power of two, whole blocks), the last no longer: record i runs on into
        i + 1 when it is that full and i + 1 starts right after it.  A file whose size is a
        multiple of its chunk size runs on into the next file: read-ahead is a hint, bounded
        by its budget.
        """
        ends = list(range(1, len(self.records) + 1))
        for i in range(len(self.records) - 2, -1, -1):
            length = self.records[i].length
            full = length >= F.BLOCK_SIZE and length & (length - 1) == 0
            if full and self.starts[i + 1] == self.starts[i] + length and self.records[i + 1].length <= length:
                ends[i] = ends[i + 1]
        return ends

    def overlapping(self, offset: int, end: int) -> range:
        """Indices of the records overlapping [offset, end)."""
        i = max(bisect.bisect_right(self.starts, offset) - 1, 0)
        if i < len(self.records) and self.starts[i] + self.records[i].length <= offset:
            i += 1
        j = bisect.bisect_left(self.starts, end)
        return range(i, max(i, j))

    def span(self, i: int) -> tuple[int, int]:
        return self.starts[i], self.starts[i] + self.records[i].length

    def missing(self, idxs: Iterable[int]) -> list[int]:
        """Of the records ``idxs`` (ascending), those whose range has a hole in the file."""
        idxs = list(idxs)
        if not idxs:
            return []
        lo, hi = self.span(idxs[0])[0], self.span(idxs[-1])[1]
        try:  # the common answer, in one lseek: no hole in the whole range
            if os.lseek(self.fd, lo, os.SEEK_HOLE) >= hi:
                return []
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                raise
            return []  # lo at or past the end of the file: nothing there is a hole
        gaps = list(holes(self.fd, lo, hi))
        if not gaps:
            return []
        out = []
        for i in idxs:
            a, b = self.span(i)
            k = bisect.bisect_right(gaps, (b, b)) - 1  # the last hole starting before b
            if k >= 0 and gaps[k][1] > a:
                out.append(i)
        return out

    def read(self, offset: int, size: int) -> bytes:
        return os.pread(self.fd, size, offset)

    def complete(self) -> bool:
        """True when no chunk's range has a hole (asked of the file)."""
        return not self.missing(range(len(self.records)))

    def present_bytes(self) -> int:
        """Raw bytes of the chunks present, by the accounting hint (reads still ask the file)."""
        return sum(rec.length for rec, here in zip(self.records, self.present, strict=True) if here)


class BlobCache:
    """The blob files of every layer this host serves, under one byte capacity.

    Thread-safe: one lock guards the recency order and the accounting; file
    data is written and read outside it.  ``on_complete(layer)`` is called once
    the file holds every chunk (the fanotify path then ignores the file's reads)
    and ``on_punch(layer)`` before the first range of such a layer is punched
    (the ignore mark goes first, so the next read raises an event again); both
    under the layer's lock, so a completeness check and a punch never interleave.
    """

    def __init__(self, root: str | os.PathLike[str], capacity: int, *, min_age: float = EVICT_MIN_AGE,
                 reads_pinned: bool = True) -> None:
        self.root = private_dir(root)
        self.capacity = capacity
        self.min_age = min_age
        # True when every read of the files pins what it reads (FUSE): then a full disk may
        # evict chunks read just now.  Through fanotify the kernel reads after our answer, and
        # only min_age keeps a hole from under an allowed read, so it holds even then.
        self.reads_pinned = reads_pinned
        self.on_complete: Callable[[LayerBlob], None] | None = None
        self.on_punch: Callable[[LayerBlob], None] | None = None
        self.layers: dict[str, LayerBlob] = {}
        self._holders: dict[bytes, list[LayerBlob]] = {}  # chunk digest -> the served layers whose blob map has it
        self.copied = 0  # chunks filled from another layer's blob instead of the store
        self._lock = threading.Lock()
        self._lru: OrderedDict[tuple[str, int], float] = OrderedDict()  # present chunks, oldest first
        self._pins: dict[tuple[str, int], int] = {}
        self._evicting: set[tuple[str, int]] = set()  # chosen and not yet punched: pins wait for them
        self._punched = threading.Condition(self._lock)
        self.used = 0
        self.apparent = 0  # bytes of the present chunks themselves (no block rounding)
        self.evictions = 0
        self.evicted_bytes = 0
        self.reverified = 0
        self.refused_at_verify = 0
        self._dirlock = open_private(self.root / "lock")
        try:
            fcntl.flock(self._dirlock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._dirlock)
            raise BlobCacheError(f"blob cache {self.root} is in use by another process (one daemon per data dir)") \
                from None
        self._mark_unverified_after_reboot()

    # -- opening ------------------------------------------------------------------------
    def _mark_unverified_after_reboot(self) -> None:
        now, path = boot_id(), self.root / "boot_id"
        before = path.read_text().strip() if path.exists() else None
        if before == now:
            return
        if before is not None:  # files written before a reboot (or a crash of the host): hash them again
            for blob in self.root.glob("*.blob"):
                (self.root / f"{blob.stem}.unverified").touch()
        tmp = path.with_suffix(".tmp")
        tmp.write_text(now + "\n")
        os.replace(tmp, path)

    def blob_path(self, hexd: str) -> Path:
        if not _HEX64.fullmatch(hexd):
            raise BlobCacheError(f"not a layer digest: {hexd!r}")
        return self.root / f"{hexd}.blob"

    def open_fd(self, hexd: str, blob_size: int) -> int:
        """The blob file's O_RDWR descriptor, made (sparse, padded) when absent.

        Opened before any fanotify mark is put on the file: I/O through it raises no events.
        """
        path = self.blob_path(hexd)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            st = os.fstat(fd)
            if st.st_size != padded(blob_size):
                if st.st_size > padded(blob_size) or st.st_size % PAD:  # not ours: start again
                    os.ftruncate(fd, 0)
                os.ftruncate(fd, padded(blob_size))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def add(self, hexd: str, blob_size: int, records: list[BlobRecord], fd: int | None = None) -> LayerBlob:
        """Serve layer ``hexd``: take its file (``fd`` when a holder kept one), learn what it holds."""
        with self._lock:
            known = self.layers.get(hexd)
        if known is not None:
            if fd is not None and fd != known.fd:
                os.close(fd)
            return known
        if fd is None:
            fd = self.open_fd(hexd, blob_size)
        layer = LayerBlob(hexd, self.blob_path(hexd), fd, blob_size, records)
        marker = self.root / f"{hexd}.unverified"
        if marker.exists():
            self._reverify(layer)
            marker.unlink()
        missing = set(layer.missing(range(len(layer.records))))
        now = time.monotonic() - self.min_age - 1  # present chunks of an earlier run: oldest, evictable
        with self._lock:
            if hexd in self.layers:  # added meanwhile by another thread
                os.close(fd)
                return self.layers[hexd]
            self.layers[hexd] = layer
            for digest in layer.positions:
                self._holders.setdefault(digest, []).append(layer)
            for i, rec in enumerate(layer.records):
                if i not in missing:
                    layer.present[i] = 1
                    self._lru[(hexd, i)] = now
                    self.used += charged(layer.starts[i], rec.length)
                    self.apparent += rec.length
            layer.missing_count = len(missing)
        return layer

    def _reverify(self, layer: LayerBlob) -> None:
        missing = set(layer.missing(range(len(layer.records))))
        bad = 0
        for i, rec in enumerate(layer.records):
            if i in missing:
                continue
            a, _ = layer.span(i)
            if blake3.blake3(os.pread(layer.fd, rec.length, a)).digest() != rec.digest:
                punch_hole(layer.fd, a, charged(a, rec.length))
                bad += 1
            self.reverified += 1
        self.refused_at_verify += bad
        log.info("blob %s: re-verified after a reboot, %d chunk(s) did not match and were dropped",
                 layer.hexd, bad)

    # -- filling ------------------------------------------------------------------------
    def fill(self, layer: LayerBlob, digest: bytes, chunk: bytes) -> bool:
        """Write a verified chunk at every place the layer has it; False when the disk refused it."""
        for i in layer.positions.get(digest, ()):
            a, _ = layer.span(i)
            try:
                if os.pwrite(layer.fd, chunk, a) != len(chunk):
                    raise OSError(errno.EIO, "short write")
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT) and self.evict(self.used // 2, force=True):
                    try:
                        os.pwrite(layer.fd, chunk, a)
                    except OSError as again:
                        self._refused(layer, digest, again)
                        return False
                else:
                    self._refused(layer, digest, exc)
                    return False
            with self._lock:
                if not layer.present[i]:
                    layer.present[i] = 1
                    layer.missing_count -= 1
                    self.used += charged(a, len(chunk))
                    self.apparent += len(chunk)
                self._lru[(layer.hexd, i)] = time.monotonic()
                self._lru.move_to_end((layer.hexd, i))
        if self.used > self.capacity:
            self.evict(int(self.capacity * EVICT_LOW_WATER))
        return True

    def shared(self, layer: LayerBlob, digest: bytes) -> bool:
        """Whether another served layer's blob map has this chunk too (a cheap look, no I/O)."""
        holders = self._holders.get(digest)
        return holders is not None and (len(holders) > 1 or holders[0] is not layer)

    def copy_local(self, layer: LayerBlob, digests: Iterable[bytes]) -> set[bytes]:
        """Fill chunks ``layer`` lacks from another served layer's blob that has them; which did.

        Layers share chunks (a checkpoint's copy of a large file, a rebuilt toolkit): a chunk
        is kept once per layer, but fetched once per host.  The copy is hashed again before it
        is written, like a fetched chunk.
        """
        done: set[bytes] = set()
        for digest in digests:
            for other in self._holders.get(digest, ()):
                i = other.positions[digest][0]
                if other is layer or not other.present[i]:  # (the hint only skips; the file decides)
                    continue
                with self.pinned(other, [i]):
                    if other.missing([i]):
                        continue
                    a, b = other.span(i)
                    data = os.pread(other.fd, b - a, a)
                if len(data) == b - a and blake3.blake3(data).digest() == digest and self.fill(layer, digest, data):
                    done.add(digest)
                    self.copied += 1
                    break
        return done

    def _refused(self, layer: LayerBlob, digest: bytes, exc: OSError) -> None:
        log.warning("blob cache %s: cannot store chunk %s of layer %s: %s (free space on that "
                    "filesystem or lower --cache-size)", self.root, digest.hex(), layer.hexd, exc)
        for i in layer.positions.get(digest, ()):  # a torn write must not look present
            a, _ = layer.span(i)
            try:
                punch_hole(layer.fd, a, charged(a, layer.records[i].length))
            except OSError:
                pass

    def touch(self, layer: LayerBlob, idxs: Iterable[int]) -> None:
        now = time.monotonic()
        with self._lock:
            for i in idxs:
                key = (layer.hexd, i)
                if key in self._lru:
                    self._lru[key] = now
                    self._lru.move_to_end(key)

    @contextmanager
    def pinned(self, layer: LayerBlob, idxs: Iterable[int]) -> Iterator[None]:
        """Keep these chunks from being punched while a read checks them and is served.

        Taken before the check: a chunk chosen for eviction already is punched first (the
        reader waits, then sees the hole and fetches the chunk, instead of finding it present
        and reading it after the punch: zeros); any other is not chosen while pinned, and is
        stamped as read now, so ``min_age`` keeps it for the kernel's read after a fanotify
        answer, which no pin covers.
        """
        keys = self.pin(layer, idxs)
        try:
            yield
        finally:
            self.unpin(keys)

    def pin(self, layer: LayerBlob, idxs: Iterable[int]) -> list[tuple[str, int]]:
        """:meth:`pinned` without the context manager (the fanotify event reader's hot path);
        the caller passes the keys to :meth:`unpin` in a ``finally``."""
        hexd = layer.hexd
        keys = [(hexd, i) for i in idxs]
        now = time.monotonic()
        pins, lru = self._pins, self._lru
        with self._lock:
            if self._evicting:
                while any(k in self._evicting for k in keys):
                    self._punched.wait()
            for k in keys:
                pins[k] = pins.get(k, 0) + 1
                if k in lru:
                    lru[k] = now
                    lru.move_to_end(k)
        return keys

    def unpin(self, keys: list[tuple[str, int]]) -> None:
        pins = self._pins
        with self._lock:
            for k in keys:
                n = pins[k] - 1
                if n:
                    pins[k] = n
                else:
                    del pins[k]

    # -- eviction -----------------------------------------------------------------------
    def evict(self, target: int, *, force: bool = False) -> int:
        """Punch least recently read chunks until at most ``target`` bytes are used; bytes freed.

        Chunks read within ``min_age`` seconds are kept (fanotify's allowed reads may still be
        on their way to the page cache), unless ``force`` (the disk is full: a read would fail)
        and reads are pinned.
        """
        freed = 0
        victims: list[tuple[LayerBlob, int]] = []
        with self._lock:
            cutoff = time.monotonic() - (0 if force and self.reads_pinned else self.min_age)
            skipped = []
            used = self.used
            while used > target and self._lru:
                key, stamp = next(iter(self._lru.items()))
                if stamp > cutoff:
                    break
                self._lru.popitem(last=False)
                if key in self._pins:
                    skipped.append((key, stamp))
                    continue
                layer = self.layers.get(key[0])
                if layer is None or not layer.present[key[1]]:
                    continue
                used -= charged(layer.starts[key[1]], layer.records[key[1]].length)
                victims.append((layer, key[1]))
                self._evicting.add(key)
            for key, stamp in reversed(skipped):
                self._lru[key] = stamp
                self._lru.move_to_end(key, last=False)
        try:
            freed = self._punch(victims)
        finally:
            with self._lock:
                self._evicting.difference_update((layer.hexd, i) for layer, i in victims)
                self._punched.notify_all()
        return freed

    def _punch(self, victims: list[tuple[LayerBlob, int]]) -> int:
        freed = 0
        for layer, i in victims:
            a, _ = layer.span(i)
            n = charged(a, layer.records[i].length)
            with layer.lock:
                if layer.complete_hint:
                    if self.on_punch is not None:
                        self.on_punch(layer)  # before the hole exists: its next read must raise an event
                    layer.complete_hint = False
                try:
                    punch_hole(layer.fd, a, n)
                except OSError as exc:
                    log.warning("blob cache: cannot evict [%d, %d) of %s: %s", a, a + n, layer.hexd, exc)
                    continue
            with self._lock:
                if layer.present[i]:
                    layer.present[i] = 0
                    layer.missing_count += 1
                    self.used -= n
                    self.apparent -= layer.records[i].length
                    freed += n
                    self.evictions += 1
                    self.evicted_bytes += n
        return freed

    def note_complete(self, layer: LayerBlob) -> bool:
        """Call ``on_complete`` once the file says the layer holds every chunk."""
        if layer.complete_hint or layer.missing_count:
            return layer.complete_hint
        with layer.lock:
            if not layer.complete_hint and layer.complete():
                if self.on_complete is not None:
                    self.on_complete(layer)
                layer.complete_hint = True
        return layer.complete_hint

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"bytes": self.used, "apparent_bytes": self.apparent, "capacity": self.capacity,
                    "layers": len(self.layers), "chunks": len(self._lru), "complete_layers": sum(1 for x in self.layers.values()
                                                                       if x.complete_hint),
                    "evictions": self.evictions, "evicted_bytes": self.evicted_bytes,
                    "pinned": len(self._pins), "reverified": self.reverified, "copied": self.copied,
                    "refused_at_verify": self.refused_at_verify}

    def close(self) -> None:
        with self._lock:
            layers, self.layers = list(self.layers.values()), {}
            self._lru.clear()
        for layer in layers:
            os.close(layer.fd)
        os.close(self._dirlock)
