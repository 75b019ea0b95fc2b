"""What the kernel reads: a layer's blob, its missing chunks fetched first.

Both data paths end here.  FUSE (lazyfetch/fuseserver.py) calls :meth:`BlobServer.read`
for each READ of ``<blobs>/<layer hex>``; fanotify (lazyfetch/fanotify.py) calls
:meth:`BlobServer.present` and, when something is missing, :meth:`BlobServer.allow`
for each pre-content event of ``<blobcache>/<hex>.blob``, and answers FAN_ALLOW
only once every chunk the range overlaps is in the file.  Which chunks are
missing is asked of the file (SEEK_HOLE), never of memory.  A miss fetches the
chunks the read needs and waits for them only; the same requests carry the
rest of the file the reader is in (``RANGE_AHEAD`` at most, from the layer's
blob map: :meth:`LayerBlob._file_ends`) and, past its end, the next
``SYNC_AHEAD`` bytes of small neighbours: adjacent frames of one pack, so one
GET, decoded on every core while the reader reads the first chunk.  A reader
that reaches a chunk still in flight joins its fetch.  No read-ahead goes past
the blob's last chunk or takes more than 1/``CACHE_SHARE`` of the cache.

Read-ahead, one level below the kernel's and shaped like it: a miss inside or
right after the region fetched for the layer lately is sequential; from the
``SEQUENTIAL_STREAK``-th such miss in a row on, it gets a window fetched beyond what it waits for, without waiting, and a *mark* at the
window's start; a read (hit or miss) that reaches the mark starts the next
window, twice as large, up to ``ASYNC_AHEAD``.  So a sequential reader finds
the store's next window on its way and stops waiting, while random small reads
fetch no more than they need.  Every failure is logged once with the layer and
offset and becomes EIO.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable

from lazyfetch.blobcache import BlobCache, LayerBlob
from lazyfetch.fetcher import Fetcher, FetchError
from lazyfetch.metrics import Metrics

log = logging.getLogger("layerbox.lazyfetch")

SYNC_AHEAD = 128 << 10  # bytes of small following chunks fetched along with a miss
RANGE_AHEAD = 8 << 20  # raw bytes of the rest of the reader's file fetched along with a miss
CACHE_SHARE = 16  # ... and no read-ahead takes more than this fraction of the cache
FIRST_WINDOW = 512 << 10  # a sequential reader's first window beyond that, not waited for
ASYNC_AHEAD = 8 << 20  # the largest window
SEQUENTIAL_SLACK = 128 << 10  # a miss this close to the region fetched lately is sequential
SEQUENTIAL_STREAK = 3  # sequential misses in a row before a window opens (imports read neighbours too)


class BlobServer:
    def __init__(self, cache: BlobCache, fetcher: Fetcher, metrics: Metrics) -> None:
        self.cache = cache
        self.fetcher = fetcher
        self.metrics = metrics
        self._by_inode: dict[tuple[int, int], LayerBlob] = {}
        self._lock = threading.Lock()
        self._quick_hits = self._quick_bytes = 0
        # the daemon's fill policy hears of misses: the layer and the bytes a read waits for
        self.on_miss: Callable[[LayerBlob, int], None] | None = None
        self._quick_events: dict[str, int] = {}  # layer -> events present() answered since count_batch

    @property
    def layers(self) -> dict[str, LayerBlob]:
        return self.cache.layers

    def add(self, layer: LayerBlob) -> None:
        st = os.fstat(layer.fd)
        with self._lock:
            self._by_inode[(st.st_dev, st.st_ino)] = layer

    # -- the FUSE source ----------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self.cache.layers)

    def size(self, name: str) -> int | None:
        layer = self.cache.layers.get(name)
        return None if layer is None else layer.size

    def read(self, name: str, offset: int, size: int) -> bytes:
        layer = self.cache.layers.get(name)
        if layer is None:
            raise OSError(errno.ENOENT, f"no layer {name} on this host")
        end = min(offset + size, layer.size)
        if offset >= end:
            return b""
        idxs = layer.overlapping(offset, min(end, layer.blob_size))
        try:
            with self.cache.pinned(layer, idxs):
                fetched = self._ensure(layer, idxs)
                data = layer.read(offset, end - offset)
                if fetched:
                    data = self._patch(layer, offset, data, fetched)
        except FetchError as exc:
            self._failed(layer, offset, exc)
        except OSError as exc:
            self._failed(layer, offset, exc)
        finally:
            self.metrics.served(layer.digest, 1)
        self.metrics.bytes_served.inc(len(data))
        return data

    # -- the fanotify handler -----------------------------------------------------------
    def layer_of(self, fd: int) -> LayerBlob | None:
        st = os.fstat(fd)
        return self._by_inode.get((st.st_dev, st.st_ino))

    def present(self, fd: int, offset: int, count: int, answer: Callable[[bool], None]) -> bool:
        """Answer the event at once if its range needs nothing fetched; whether it did.

        Called by the event reader: most events of a warm host are this, only the others go
        to the worker pool (:meth:`allow`).  The answer is given while the chunks are pinned.
        """
        layer = self.layer_of(fd)
        if layer is None:
            answer(True)
            return True
        idxs = layer.overlapping(offset, min(offset + count, layer.blob_size))
        if not idxs:
            answer(True)
            return True
        keys = self.cache.pin(layer, idxs)
        try:
            if layer.missing(idxs):
                return False
            answer(True)
        finally:
            self.cache.unpin(keys)
        try:  # answered: nothing below may make the caller answer again
            if layer.trace is not None:
                self._record(layer, idxs)
            self._quick_hits += len(idxs)  # (only the event reader calls this: plain ints, counted per batch)
            self._quick_bytes += count
            self._quick_events[layer.digest] = self._quick_events.get(layer.digest, 0) + 1
            if layer.window and offset + count > layer.ahead_mark:
                self._next_window(layer)
        except Exception:
            log.exception("after answering a read of %s at %d+%d", layer.digest, offset, count)
        return True

    def count_batch(self) -> None:
        """Add what :meth:`present` answered since the last call to the counters."""
        if self._quick_hits:
            self.metrics.hits.inc(self._quick_hits)
            self.metrics.bytes_served.inc(self._quick_bytes)
            self._quick_hits = self._quick_bytes = 0
        if self._quick_events:
            events, self._quick_events = self._quick_events, {}
            for layer, n in events.items():
                self.metrics.served(layer, n)

    def allow(self, fd: int, offset: int, count: int, answer: Callable[[bool], None]) -> None:
        """Fill the chunks the event's range overlaps and answer: allow, or deny (EIO)."""
        layer = self.layer_of(fd)
        if layer is None:  # a file we never marked: nothing of ours to fill
            answer(True)
            return
        self._fill(layer, offset, count, answer)

    def fill(self, layer: LayerBlob, offset: int, count: int) -> bool:
        """Fill the chunks ``[offset, offset + count)`` of ``layer`` overlaps; whether they are all there
        (a failure is logged and counted as a read error)."""
        result = [False]

        def keep(ok: bool) -> None:
            result[0] = ok

        self._fill(layer, offset, count, keep)
        return result[0]

    def _fill(self, layer: LayerBlob, offset: int, count: int, answer: Callable[[bool], None]) -> None:
        self.metrics.served(layer.digest, 1)
        idxs = layer.overlapping(offset, min(offset + count, layer.blob_size))
        with self.cache.pinned(layer, idxs):
            try:
                fetched = self._ensure(layer, idxs)
                if fetched and layer.missing([i for i in idxs if layer.records[i].digest in fetched]):
                    # the disk refused a chunk: the kernel would read a hole, so the read fails
                    raise OSError(errno.ENOSPC, "the blob cache could not store a chunk this read needs")
            except (FetchError, OSError) as exc:
                self.metrics.read_errors.inc()
                log.error("read of %s at %d+%d: %s", layer.digest, offset, count, exc)
                answer(False)
                return
            answer(True)
        self.metrics.bytes_served.inc(count)

    # -- shared -----------------------------------------------------------------------
    def _ensure(self, layer: LayerBlob, idxs: range) -> dict[bytes, bytes]:
        if not idxs:
            return {}
        if layer.trace is not None:
            self._record(layer, idxs)
        missing = layer.missing(idxs)
        self.metrics.hits.inc(len(idxs) - len(missing))
        end = layer.span(idxs[-1])[1]
        if not missing:
            if layer.window and end > layer.ahead_mark:
                self._next_window(layer)
            return {}
        self.metrics.misses.inc(len(missing))
        if self.on_miss is not None:
            self.on_miss(layer, sum(layer.records[i].length for i in missing))
        first = layer.starts[missing[0]]
        sequential = layer.seen_from - SEQUENTIAL_SLACK <= first <= layer.ahead_end + SEQUENTIAL_SLACK
        along = self._along(layer, idxs[-1])
        along_end = layer.span(along[-1])[1] if along else end
        if sequential:
            layer.streak += 1
            if layer.streak >= SEQUENTIAL_STREAK:
                layer.window = min(max(layer.window * 2, FIRST_WINDOW), self._ahead_cap())
        else:
            layer.window, layer.seen_from, layer.streak = 0, first, 0
        layer.ahead_mark = layer.ahead_end = along_end
        wanted = [layer.records[i].digest for i in missing]
        rest = list(dict.fromkeys(layer.records[i].digest for i in along))
        ahead = self._window(layer) if layer.window else []
        started = time.perf_counter()
        try:
            fetched = self.fetcher.fetch_blocking(layer, wanted, ahead, rest)
        finally:
            self.metrics.waited(layer.digest, time.perf_counter() - started)
        self.cache.note_complete(layer)
        return fetched

    def _ahead_cap(self) -> int:
        """The largest read-ahead: ``ASYNC_AHEAD``, or less in a small cache (it must not evict
        what readers use)."""
        return max(min(ASYNC_AHEAD, self.cache.capacity // CACHE_SHARE), 0)

    def _along(self, layer: LayerBlob, last: int) -> list[int]:
        """The missing records after ``last`` that go along with a miss: the rest of its file
        (``RANGE_AHEAD`` bytes at most), then small neighbours up to ``SYNC_AHEAD`` bytes."""
        stop = layer.file_end[last]
        budget, small = min(RANGE_AHEAD, self._ahead_cap()), SYNC_AHEAD
        j, n = last + 1, len(layer.records)
        while j < n and layer.records[j].length <= budget:
            length = layer.records[j].length
            if j >= stop:
                if length > small:
                    break
                small -= length
            budget -= length
            j += 1
        return layer.missing(range(last + 1, j))

    def _next_window(self, layer: LayerBlob) -> None:
        """The reader reached the mark: fetch the next window (twice as large) without waiting."""
        layer.window = min(layer.window * 2, self._ahead_cap())
        ahead = self._window(layer)
        if ahead:
            self.fetcher.fetch_later(layer, ahead)

    def _window(self, layer: LayerBlob) -> list[bytes]:
        """The missing chunks of the next ``layer.window`` bytes after ``ahead_end``; moves the mark."""
        first = layer.overlapping(layer.ahead_end, layer.ahead_end + 1)
        start = first[0] if first else len(layer.records)
        todo = self._missing_from(layer, start, layer.window)
        layer.ahead_mark = layer.ahead_end
        layer.ahead_end = layer.ahead_end + layer.window
        return list(dict.fromkeys(layer.records[i].digest for i in todo))

    @staticmethod
    def _missing_from(layer: LayerBlob, first: int, budget: int) -> list[int]:
        """Missing records among those from ``first`` on that fit ``budget`` bytes.

        Publishing packs chunks in blob order, so the next chunks are usually the
        next frames of the same pack and cost no extra request.
        """
        last = first
        while last < len(layer.records) and layer.records[last].length <= budget:
            budget -= layer.records[last].length  # (a chunk larger than what is left is not fetched)
            last += 1
        return layer.missing(range(first, last))

    @staticmethod
    def _patch(layer: LayerBlob, offset: int, data: bytes, fetched: dict[bytes, bytes]) -> bytes:
        """Chunks the blob could not keep (a full disk) come from memory, never as zeros."""
        end = offset + len(data)
        idxs = layer.overlapping(offset, min(end, layer.blob_size))
        holes = [i for i in layer.missing(idxs)]
        if not holes:
            return data
        out = bytearray(data)
        for i in holes:
            rec = layer.records[i]
            chunk = fetched.get(rec.digest)
            if chunk is None:
                raise FetchError(f"chunk {rec.digest.hex()} of {layer.digest} vanished from the blob "
                                 "while being read")
            a, b = layer.span(i)
            lo, hi = max(a, offset), min(b, end)
            out[lo - offset : hi - offset] = chunk[lo - a : hi - a]
        return bytes(out)

    def _failed(self, layer: LayerBlob, offset: int, exc: Exception) -> None:
        self.metrics.read_errors.inc()
        log.error("read of %s at %d: %s", layer.digest, offset, exc)
        raise OSError(errno.EIO, str(exc)) from None

    def _record(self, layer: LayerBlob, idxs: range) -> None:
        if time.monotonic() > layer.trace_until:
            return
        with self._lock:
            if layer.trace is not None:
                for i in idxs:
                    layer.trace.setdefault(layer.records[i].digest, None)
