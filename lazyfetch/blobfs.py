"""The FUSE file system of layer blobs: ``<mountpoint>/<layer hex>``, read-only.

A read maps its byte range to the layer's chunks through the blob map (the
trailer of the metadata image), serves cached chunks from the local cache
and fetches the missing ones together (one ranged GET per run of adjacent
frames).  Bytes between chunks (block padding) read as zeros.  Every
exception is turned into an errno in one place, :meth:`BlobFS.__call__`,
after a log line naming the layer, offset and cause.
"""

from __future__ import annotations

import bisect
import errno
import logging
import stat
import threading
import time
from dataclasses import dataclass, field

from fuse import FuseOSError, Operations

from layerstore.erofs import format as F
from layerstore.erofs.reader import BlobRecord
from lazyfetch.chunkcache import ChunkCache
from lazyfetch.fetcher import Fetcher, FetchError
from lazyfetch.metrics import Metrics

log = logging.getLogger("layerbox.lazyfetch")

READ_AHEAD = 512 << 10  # uncompressed bytes of following chunks fetched along with a miss


@dataclass
class BlobLayer:
    digest: str  # "blake3:<hex>", the name fetches for this layer are counted under
    size: int
    records: list[BlobRecord]
    starts: list[int] = field(default_factory=list)
    images: set[str] = field(default_factory=set)
    # access trace: chunk digests in first-read order while recording
    trace: dict[bytes, None] | None = None
    trace_until: float = 0.0

    def __post_init__(self) -> None:
        self.records.sort(key=lambda r: r.block)
        self.starts = [r.block * F.BLOCK_SIZE for r in self.records]

    def overlapping(self, offset: int, end: int) -> list[BlobRecord]:
        i = max(bisect.bisect_right(self.starts, offset) - 1, 0)
        out = []
        while i < len(self.records) and self.starts[i] < end:
            rec = self.records[i]
            if self.starts[i] + rec.length > offset:
                out.append(rec)
            i += 1
        return out


class BlobFS(Operations):
    def __init__(self, cache: ChunkCache, fetcher: Fetcher, metrics: Metrics) -> None:
        self.ready = threading.Event()
        self.cache = cache
        self.fetcher = fetcher
        self.metrics = metrics
        self.layers: dict[str, BlobLayer] = {}  # hex -> layer
        self._lock = threading.Lock()
        self._mounted_at = time.time()

    def add_layer(self, layer: BlobLayer) -> None:
        with self._lock:
            existing = self.layers.get(layer.digest.removeprefix("blake3:"))
            if existing is not None:
                existing.images |= layer.images
                return
            self.layers[layer.digest.removeprefix("blake3:")] = layer

    def __call__(self, op: str, *args: object) -> object:
        try:
            return super().__call__(op, *args)
        except FuseOSError:
            raise
        except FetchError as exc:
            self.metrics.read_errors.inc()
            log.error("%s %s: %s", op, args[0] if args else "", exc)
            raise FuseOSError(errno.EIO) from None
        except Exception:
            self.metrics.read_errors.inc()
            log.exception("%s %s failed", op, args[0] if args else "")
            raise FuseOSError(errno.EIO) from None

    def init(self, path: str) -> None:
        self.ready.set()  # the kernel has the mount: blobs can be opened now

    # -- metadata ---------------------------------------------------------------------
    def _layer(self, path: str) -> BlobLayer:
        layer = self.layers.get(path.lstrip("/"))
        if layer is None:
            raise FuseOSError(errno.ENOENT)
        return layer

    def getattr(self, path: str, fh: int | None = None) -> dict[str, float]:
        t = self._mounted_at
        # root's only (the daemon mounts with default_permissions, so the kernel checks these):
        # a blob is a layer's raw data, which no other local user may read
        if path == "/":
            return {"st_mode": stat.S_IFDIR | 0o500, "st_nlink": 2, "st_size": 0,
                    "st_mtime": t, "st_ctime": t, "st_atime": t}
        layer = self._layer(path)
        return {"st_mode": stat.S_IFREG | 0o400, "st_nlink": 1, "st_size": layer.size,
                "st_mtime": t, "st_ctime": t, "st_atime": t, "st_blocks": (layer.size + 511) // 512}

    def readdir(self, path: str, fh: int) -> list[str]:
        if path != "/":
            raise FuseOSError(errno.ENOTDIR)
        return [".", "..", *sorted(self.layers)]

    def open(self, path: str, flags: int) -> int:
        self._layer(path)
        if flags & 3 != 0:  # O_WRONLY / O_RDWR
            raise FuseOSError(errno.EROFS)
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        return {"f_bsize": F.BLOCK_SIZE, "f_frsize": F.BLOCK_SIZE, "f_blocks": 0, "f_bfree": 0,
                "f_bavail": 0, "f_files": len(self.layers), "f_namemax": 255}

    # -- data -----------------------------------------------------------------------------
    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        layer = self._layer(path)
        end = min(offset + size, layer.size)
        if offset >= end:
            return b""
        records = layer.overlapping(offset, end)
        if layer.trace is not None:
            self._record(layer, records)
        out = bytearray(end - offset)
        missing = [r.digest for r in records if not self.cache.contains(r.digest)]
        fetched: dict[bytes, bytes] = {}
        if missing:
            self.metrics.misses.inc(len(missing))
            missing += self._read_ahead(layer, records[-1])
            fetched = self.fetcher.fetch_blocking(missing, layer.digest)
        with self.cache.pinned(r.digest for r in records):
            for rec in records:
                start = rec.block * F.BLOCK_SIZE
                a, b = max(offset, start), min(end, start + rec.length)
                chunk = fetched.get(rec.digest)
                if chunk is not None:
                    piece = chunk[a - start : b - start]
                else:
                    got = self.cache.get(rec.digest, a - start, b - a)
                    if got is None:  # evicted between the check and here: fetch again
                        self.metrics.misses.inc()
                        again = self.fetcher.fetch_blocking([rec.digest], layer.digest)
                        got = again[rec.digest][a - start : b - start]
                    else:
                        self.metrics.hits.inc()
                    piece = got
                if len(piece) != b - a:
                    raise FetchError(f"chunk {rec.digest.hex()} is shorter than the blob map says")
                out[a - offset : b - offset] = piece
        self.metrics.bytes_served.inc(len(out))
        return bytes(out)

    def _read_ahead(self, layer: BlobLayer, last: BlobRecord) -> list[bytes]:
        """Chunks right after a miss, up to READ_AHEAD bytes: fetched in the same request.

        Publishing packs chunks in blob order, so the next chunks are usually the
        next frames of the same pack and cost no extra request; sequential readers
        then wait on the store once per window instead of once per chunk.
        """
        i = bisect.bisect_left(layer.starts, last.block * F.BLOCK_SIZE) + 1
        extra: list[bytes] = []
        budget = READ_AHEAD
        while i < len(layer.records) and budget > 0:
            rec = layer.records[i]
            budget -= rec.length
            if budget < 0:
                break
            if not self.cache.contains(rec.digest):
                extra.append(rec.digest)
            i += 1
        return extra

    def _record(self, layer: BlobLayer, records: list[BlobRecord]) -> None:
        if time.monotonic() > layer.trace_until:
            return
        with self._lock:
            if layer.trace is not None:
                for r in records:
                    layer.trace.setdefault(r.digest, None)
