"""Fetch chunks from the store into the local cache: single flight, coalesced, verified.

Runs on the daemon's event loop.  FUSE threads reach it through
:meth:`Fetcher.fetch_blocking`, the one bridge between fusepy's threads and
asyncio; it waits a bounded time and then gives up with
:class:`FetchTimeout` (the FUSE layer turns that into EIO) while the fetch
itself may finish later and fill the cache, so the next read succeeds once
the store answers again.

Every fetch is attributed to one layer: the layer whose read (or prefetch)
started it.  Readers that join a fetch already in flight add nothing, so the
per-layer counters of :class:`~lazyfetch.metrics.Metrics` sum to the totals
(docs/STATS.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import blake3

from layerstore.objects import pack_key
from layerstore.packs import ChunkLocation, decompress
from layerstore.store import Store
from lazyfetch.chunkcache import ChunkCache
from lazyfetch.errors import LazyfetchError
from lazyfetch.metrics import Metrics

log = logging.getLogger("layerbox.lazyfetch")

MAX_RUN = 4 << 20  # one ranged GET covers at most this many compressed bytes
MAX_GAP = 0  # only exactly adjacent frames are merged; gaps would fetch bytes nobody asked for


class FetchError(LazyfetchError):
    pass


class FetchTimeout(FetchError):
    pass


class CorruptChunk(FetchError):
    pass


@dataclass
class _Run:
    pack: bytes
    start: int
    end: int
    items: list[tuple[bytes, ChunkLocation]] = field(default_factory=list)


def plan_runs(wanted: Iterable[tuple[bytes, ChunkLocation]]) -> list[_Run]:
    """Group chunks by pack and merge adjacent frames into ranged GETs."""
    by_pack: dict[bytes, list[tuple[bytes, ChunkLocation]]] = {}
    for digest, loc in wanted:
        by_pack.setdefault(loc.pack, []).append((digest, loc))
    runs: list[_Run] = []
    for pack, items in by_pack.items():
        items.sort(key=lambda it: it[1].offset)
        run: _Run | None = None
        for digest, loc in items:
            if run is not None and loc.offset - run.end <= MAX_GAP and loc.offset + loc.length - run.start <= MAX_RUN:
                run.end = max(run.end, loc.offset + loc.length)
                run.items.append((digest, loc))
                continue
            run = _Run(pack, loc.offset, loc.offset + loc.length, [(digest, loc)])
            runs.append(run)
    return runs


class Fetcher:
    def __init__(self, store: Store, cache: ChunkCache, metrics: Metrics, loop: asyncio.AbstractEventLoop,
                 *, timeout: float = 30.0, concurrency: int = 16) -> None:
        self.store = store
        self.cache = cache
        self.metrics = metrics
        self.loop = loop
        self.timeout = timeout
        self._inflight: dict[bytes, asyncio.Future[bytes]] = {}
        self._sem = asyncio.Semaphore(concurrency)
        self.on_fetched: list[object] = []

    # -- called from FUSE threads -----------------------------------------------------
    def fetch_blocking(self, wanted: list[bytes], layer: str) -> dict[bytes, bytes]:
        future = asyncio.run_coroutine_threadsafe(self.fetch_many(wanted, layer), self.loop)
        try:
            return future.result(self.timeout)
        except concurrent.futures.TimeoutError:
            # the fetch goes on in the background; a later read may find the chunk cached
            raise FetchTimeout(
                f"store {self.store.url} did not deliver {len(wanted)} chunk(s) within {self.timeout:.0f} s "
                f"(first {wanted[0].hex()})"
            ) from None

    # -- on the loop --------------------------------------------------------------------
    async def fetch_many(self, wanted: Iterable[bytes], layer: str, *, prefetch: bool = False
                         ) -> dict[bytes, bytes]:
        """Bytes of every wanted chunk; each chunk is fetched at most once at a time.

        The chunks this call starts fetching are counted for ``layer``
        ("blake3:<hex>") and, with ``prefetch``, as prefetched; chunks it finds
        cached or already in flight are not counted again.
        """
        out: dict[bytes, bytes] = {}
        waiting: list[tuple[bytes, asyncio.Future[bytes]]] = []
        todo: list[tuple[bytes, ChunkLocation]] = []
        for digest in dict.fromkeys(wanted):
            cached = self.cache.get(digest)
            if cached is not None:
                out[digest] = cached
                continue
            fut = self._inflight.get(digest)
            if fut is None:
                loc = self.store.cache.locate(digest)
                if loc is None:
                    raise FetchError(f"chunk {digest.hex()} has no known location in {self.store.url}")
                fut = self.loop.create_future()
                self._inflight[digest] = fut
                todo.append((digest, loc))
            waiting.append((digest, fut))
        if todo:
            # started as tasks so that a caller that stops waiting does not cancel
            # the fetch for everybody else sharing it
            for run in plan_runs(todo):
                asyncio.ensure_future(self._fetch_run(run, layer, prefetch))
        for digest, fut in waiting:
            out[digest] = await asyncio.shield(fut)
        return out

    async def _fetch_run(self, run: _Run, layer: str, prefetch: bool) -> None:
        self.metrics.inflight.inc(len(run.items))
        started: float | None = None
        try:
            async with self._sem:
                started = time.perf_counter()
                self.metrics.requested()
                data = await self.store.backend.get(pack_key(run.pack), run.start, run.end)
            self.metrics.fetched(layer, len(data))  # received, even if it is not what we asked for
            if len(data) != run.end - run.start:
                raise FetchError(f"{self.store.url}: short read of {pack_key(run.pack)} "
                                 f"[{run.start}, {run.end}): got {len(data)} bytes")
            results = await asyncio.to_thread(self._decode_run, run, data, layer, prefetch)
        except BaseException as exc:
            for digest, _ in run.items:
                self._fail(digest, exc)
            if not isinstance(exc, Exception):
                raise
            return
        finally:
            self.metrics.inflight.dec(len(run.items))
            if started is not None:  # one observation per GET sent: fetch_count == store_requests
                self.metrics.fetch_seconds.observe(time.perf_counter() - started)
        for digest, value in results.items():
            fut = self._inflight.pop(digest, None)
            if fut is None or fut.done():
                continue
            if isinstance(value, Exception):
                fut.set_exception(value)
                fut.exception()  # retrieved: nobody may be waiting any more
            else:
                fut.set_result(value)

    def _fail(self, digest: bytes, exc: BaseException) -> None:
        fut = self._inflight.pop(digest, None)
        if fut is not None and not fut.done():
            fut.set_exception(exc if isinstance(exc, Exception) else FetchError(repr(exc)))
            fut.exception()

    def _decode_run(self, run: _Run, data: bytes, layer: str, prefetch: bool
                    ) -> dict[bytes, bytes | Exception]:
        """Decompress and verify each chunk; cache the good ones (off the loop)."""
        results: dict[bytes, bytes | Exception] = {}
        for digest, loc in run.items:
            frame = data[loc.offset - run.start : loc.offset - run.start + loc.length]
            where = f"{pack_key(run.pack)}@{loc.offset}+{loc.length}"
            try:
                chunk = decompress(frame, loc.raw_length)
                ok = blake3.blake3(chunk).digest() == digest
            except Exception as exc:  # zstd's own error type for undecodable frames
                chunk, ok = b"", False
                log.error("corrupt chunk %s from %s (%s): %s", digest.hex(), self.store.url, where, exc)
            if not ok:
                self.metrics.corrupt.inc()
                log.error("chunk %s from %s (%s) does not match its digest; not served, will refetch",
                          digest.hex(), self.store.url, where)
                results[digest] = CorruptChunk(f"chunk {digest.hex()} from {self.store.url} ({where}) is corrupt")
                continue
            self.metrics.verified(layer, len(chunk), prefetch=prefetch)
            if not self.cache.put(digest, chunk):
                self.metrics.cache_put_failures.inc()
            results[digest] = chunk
        return results
