"""What the kernel reads: a layer's blob, its missing chunks fetched first.

Both data paths end here.  FUSE (lazyfetch/fuseserver.py) calls :meth:`BlobServer.read`
for each READ of ``<blobs>/<layer hex>``; fanotify (lazyfetch/fanotify.py) calls
:meth:`BlobServer.allow` for each pre-content event of ``<blobcache>/<hex>.blob``
and answers FAN_ALLOW only once every chunk the range overlaps is in the
file.  Which chunks are missing is asked of the file (SEEK_HOLE), never of
memory; the missing ones and the next ``SYNC_AHEAD`` bytes are fetched
together and waited for.  A reader that goes on where the last miss of the
layer ended is sequential: it gets a window fetched beyond that, without
waiting, that doubles with each such miss up to ``ASYNC_AHEAD`` (the kernel's
readahead, one level down), so it finds the store's next window on its way,
while random small reads fetch no more than before.  Every failure is logged once with the layer and offset and becomes EIO.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time

from lazyfetch.blobcache import BlobCache, LayerBlob
from lazyfetch.fetcher import Fetcher, FetchError
from lazyfetch.metrics import Metrics

log = logging.getLogger("layerbox.lazyfetch")

SYNC_AHEAD = 512 << 10  # bytes of following chunks fetched along with a miss and waited for
ASYNC_AHEAD = 8 << 20  # at most this many more for a sequential reader, not waited for
SEQUENTIAL_SLACK = 1 << 20  # a miss this close to where the last one's fetch ended is sequential


class BlobServer:
    def __init__(self, cache: BlobCache, fetcher: Fetcher, metrics: Metrics) -> None:
        self.cache = cache
        self.fetcher = fetcher
        self.metrics = metrics
        self._by_inode: dict[tuple[int, int], LayerBlob] = {}
        self._lock = threading.Lock()

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
        self.metrics.bytes_served.inc(len(data))
        return data

    # -- the fanotify handler -----------------------------------------------------------
    def layer_of(self, fd: int) -> LayerBlob | None:
        st = os.fstat(fd)
        return self._by_inode.get((st.st_dev, st.st_ino))

    def allow(self, fd: int, offset: int, count: int) -> bool:
        """Fill the chunks [offset, offset+count) of the event's file overlaps; False: deny (EIO)."""
        layer = self.layer_of(fd)
        if layer is None:  # a file we never marked: nothing of ours to fill
            return True
        idxs = layer.overlapping(offset, min(offset + count, layer.blob_size))
        try:
            fetched = self._ensure(layer, idxs)
            if fetched and layer.missing([i for i in idxs if layer.records[i].digest in fetched]):
                # the disk refused a chunk: the kernel would read a hole, so the read fails
                raise OSError(errno.ENOSPC, "the blob cache could not store a chunk this read needs")
        except (FetchError, OSError) as exc:
            self.metrics.read_errors.inc()
            log.error("read of %s at %d+%d: %s", layer.digest, offset, count, exc)
            return False
        self.metrics.bytes_served.inc(count)
        return True

    # -- shared -----------------------------------------------------------------------
    def _ensure(self, layer: LayerBlob, idxs: range) -> dict[bytes, bytes]:
        if not idxs:
            return {}
        if layer.trace is not None:
            self._record(layer, idxs)
        missing = layer.missing(idxs)
        self.metrics.hits.inc(len(idxs) - len(missing))
        if not missing:
            self.cache.touch(layer, idxs)
            return {}
        self.metrics.misses.inc(len(missing))
        first = layer.starts[missing[0]]
        if abs(first - layer.next_miss) <= SEQUENTIAL_SLACK:
            layer.window = min(max(layer.window * 2, SYNC_AHEAD), ASYNC_AHEAD)
        else:
            layer.window = 0
        sync, later = self._ahead(layer, idxs[-1] + 1, layer.window)
        tail = (later or sync or missing)[-1]
        layer.next_miss = layer.span(tail)[1]
        wanted = [layer.records[i].digest for i in missing + sync]
        ahead = [layer.records[i].digest for i in later]
        fetched = self.fetcher.fetch_blocking(layer, wanted, ahead)
        self.cache.touch(layer, idxs)
        self.cache.note_complete(layer)
        return fetched

    def _ahead(self, layer: LayerBlob, first: int, window: int) -> tuple[list[int], list[int]]:
        """Missing records from ``first`` on: SYNC_AHEAD bytes of them, then ``window`` more.

        Publishing packs chunks in blob order, so the next chunks are usually the
        next frames of the same pack and cost no extra request.
        """
        if first >= len(layer.records):
            return [], []
        last, budget = first, SYNC_AHEAD + window
        while last < len(layer.records) and budget > 0:
            budget -= layer.records[last].length
            last += 1
        todo = layer.missing(range(first, last))
        sync: list[int] = []
        spent = 0
        for k, i in enumerate(todo):
            if spent >= SYNC_AHEAD:
                return sync, todo[k:]
            sync.append(i)
            spent += layer.records[i].length
        return sync, []

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
