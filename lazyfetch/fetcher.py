"""Fetch chunks from the store into a layer's blob file: single flight, coalesced, verified.

Runs on the daemon's event loop.  The threads that serve the kernel (FUSE
requests, fanotify events) reach it through :meth:`Fetcher.fetch_blocking`,
the one bridge between those threads and asyncio; it waits a bounded time and
then gives up with :class:`FetchTimeout` (the read fails with EIO) while the
fetch itself may finish later and fill the blob, so the next read succeeds
once the store answers again.  A chunk is written to the blob only after its
bytes matched its digest.

Every fetch is attributed to one layer: the layer whose read (or prefetch)
started it.  Readers that join a fetch already in flight add nothing, so the
per-layer counters of :class:`~lazyfetch.metrics.Metrics` sum to the totals
(docs/STATS.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import blake3

from layerstore.objects import pack_key
from layerstore.packs import ChunkLocation, decompress
from layerstore.store import Store
from lazyfetch.blobcache import BlobCache, LayerBlob
from lazyfetch.errors import LazyfetchError
from lazyfetch.metrics import Metrics
from lazyfetch.units import PackUnits

log = logging.getLogger("layerbox.lazyfetch")

MAX_RUN = 4 << 20  # one ranged GET covers at most this many compressed bytes
SETTLE_EVERY = 0.001  # seconds: how long a decoded chunk may wait for its waiters to be woken
MAX_GAP = 0  # only exactly adjacent frames are merged; gaps would fetch bytes nobody asked for
DECODE_GROUP = 256 << 10  # raw bytes of consecutive chunks one decode job takes (a larger chunk: alone)
STREAM_MISSES = 16  # a layer streams (its GETs take whole units, lazyfetch/units.py) once this many
STREAM_SECONDS = 1.0  # ... reads waited for the store within this many seconds


_NO_LIMIT = contextlib.nullcontext()


class FetchError(LazyfetchError):
    """Chunks of a layer could not be fetched from the store; the read that needed them fails (EIO)."""


class FetchTimeout(FetchError):
    """The store did not deliver in time; the fetch goes on, so a later read may find the chunk."""

    retryable = True


class CorruptChunk(FetchError):
    """A chunk from the store does not match its digest: it is never served (nor cached)."""


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
    def __init__(self, store: Store, cache: BlobCache, metrics: Metrics, loop: asyncio.AbstractEventLoop,
                 *, timeout: float = 30.0, concurrency: int = 16) -> None:
        self.store = store
        self.cache = cache
        self.metrics = metrics
        self.loop = loop
        self.timeout = timeout
        self._inflight: dict[tuple[str, bytes], asyncio.Future[bytes]] = {}
        # in-flight chunks a reader waits for -> when the first reader started waiting (loop time)
        self._waited_since: dict[tuple[str, bytes], float] = {}
        self._sem = asyncio.Semaphore(concurrency)
        # read-ahead, prefetch and fill take at most this many of the GETs in flight, so a
        # reader's own fetch never queues behind a window nobody waits for yet
        self._ahead_sem = asyncio.Semaphore(max(concurrency // 4, 1))
        self.foreground = 0  # fetches a reader waits for: background fill yields to them
        # decompress + verify + write, one job per group of chunks, on as many threads as cores
        # (zstandard, blake3 and pwrite release the GIL): a run's chunks decode side by side, and
        # a handful of busy threads switch less than the loop's 48-thread executor would
        # (background runs have their own: a reader's chunk never queues behind a window's)
        threads = max(os.cpu_count() or 1, 2)
        self._decoder = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="layerbox-decode")
        self._bg_decoder = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="layerbox-decode-bg")
        self.units = PackUnits(self._get)
        # whole units only from a remote store: a file store's packs are local files the kernel
        # reads ahead itself, and larger reads of them only cost disk time (measured: no faster)
        self.stream_units = not store.url.startswith("file:")
        self._recent: dict[str, deque[float]] = {}  # layer hex -> when its last misses started (loop time)
        self._packs_noted: set[str] = set()  # layers whose packs' ends are known to the units

    def close(self) -> None:
        for pool in (self._decoder, self._bg_decoder):
            pool.shutdown(wait=False, cancel_futures=True)

    def note_packs(self, layer: LayerBlob) -> None:
        """(A worker thread, once a layer of a remote store first streams) where the layer's packs
        end, as far as its chunks tell: units stop there.  Until then its runs are GET exactly."""
        ends: dict[bytes, int] = {}
        for rec in layer.records:
            loc = self.store.locate(rec.digest)
            if loc is not None and loc.offset + loc.length > ends.get(loc.pack, 0):
                ends[loc.pack] = loc.offset + loc.length
        for pack, end in ends.items():
            self.loop.call_soon_threadsafe(self.units.note_end, pack, end)

    def _streaming(self, layer: LayerBlob) -> bool:
        recent = self._recent.get(layer.hexd)
        return self.stream_units and recent is not None and len(recent) == STREAM_MISSES and \
            self.loop.time() - recent[0] <= STREAM_SECONDS

    # -- called from the threads serving the kernel -------------------------------------
    def fetch_blocking(self, layer: LayerBlob, wanted: list[bytes], ahead: list[bytes] | None = None,
                       along: list[bytes] | None = None) -> dict[bytes, bytes]:
        """Fetch ``wanted`` into the layer's blob and wait; ``ahead`` and ``along`` are fetched too,
        not waited for: ``along`` in the same requests as ``wanted`` (the rest of the range the
        reader is in: adjacent frames share a GET), ``ahead`` as a window of its own.

        A read waits at most ``timeout`` seconds from the start of the oldest fetch a reader
        waits for among its chunks: the kernel retries a failed readahead page by page, and
        each retry joins the same stalled fetch, so without that bound one reader would wait
        ``timeout`` once per retry.
        """
        future = asyncio.run_coroutine_threadsafe(self._foreground(layer, wanted, ahead, along), self.loop)
        try:
            return future.result(self.timeout + 1.0)  # (the coroutine's own deadline comes first)
        except concurrent.futures.TimeoutError:
            # the fetch goes on in the background; a later read may find the chunk present
            raise self._timeout(layer, wanted) from None

    def _timeout(self, layer: LayerBlob, wanted: list[bytes]) -> FetchTimeout:
        return FetchTimeout(
            f"store {self.store.url} did not deliver {len(wanted)} chunk(s) of layer {layer.digest} "
            f"within {self.timeout:.0f} s (first {wanted[0].hex()})")

    def fetch_later(self, layer: LayerBlob, wanted: list[bytes]) -> None:
        """Start fetching ``wanted`` (counted as prefetched) and return at once."""
        future = asyncio.run_coroutine_threadsafe(self.fetch_many(layer, wanted, prefetch=True), self.loop)
        future.add_done_callback(_log_failure)

    async def _foreground(self, layer: LayerBlob, wanted: list[bytes], ahead: list[bytes] | None,
                          along: list[bytes] | None = None) -> dict[bytes, bytes]:
        self.foreground += 1
        try:
            if ahead:
                task = asyncio.ensure_future(self.fetch_many(layer, ahead, prefetch=True))
                task.add_done_callback(_log_failure)
            now = self.loop.time()
            oldest = min((self._waited_since.get((layer.hexd, d), now) for d in wanted), default=now)
            remaining = oldest + self.timeout - now
            if remaining <= 0:  # the fetch it would join has kept readers waiting too long already
                raise self._timeout(layer, wanted)
            try:
                return await asyncio.wait_for(self.fetch_many(layer, wanted, waited=True, along=along), remaining)
            except TimeoutError:
                raise self._timeout(layer, wanted) from None
        finally:
            self.foreground -= 1

    # -- on the loop --------------------------------------------------------------------
    async def fetch_many(self, layer: LayerBlob, wanted: Iterable[bytes], *, prefetch: bool = False,
                         waited: bool = False, along: Iterable[bytes] | None = None) -> dict[bytes, bytes]:
        """Fetch every wanted chunk of ``layer`` into its blob; each at most once at a time.

        Returns the bytes of the chunks this call waited for (a chunk the blob
        could not store is served from them).  The chunks it starts fetching are
        counted for the layer and, with ``prefetch``, as prefetched; chunks in
        flight already are not counted again.  The caller asked the blob which
        chunks are missing; ``waited``: a reader waits for them (the deadline of
        :meth:`fetch_blocking` counts from the first such reader).  ``along``: more chunks
        fetched in the same requests (counted as prefetched), not waited for.
        """
        out: dict[bytes, bytes] = {}
        waiting: list[tuple[bytes, asyncio.Future[bytes]]] = []
        todo: list[tuple[bytes, ChunkLocation]] = []
        wanted = list(dict.fromkeys(wanted))
        if waited:
            self._recent.setdefault(layer.hexd, deque(maxlen=STREAM_MISSES)).append(self.loop.time())
        extra = [d for d in dict.fromkeys(along or ()) if d not in wanted]
        # the caller looked at the blob on its own thread: a fetch may have settled since
        wanted = [d for d in wanted if not self._landed(layer, d)]
        extra = [d for d in extra if not self._landed(layer, d)]
        shared = [d for d in wanted + extra if self.cache.shared(layer, d) and (layer.hexd, d) not in self._inflight]
        if shared:  # another layer on this host has them: no store request
            copied = await asyncio.to_thread(self.cache.copy_local, layer, shared)
            wanted = [d for d in wanted if d not in copied]
            extra = [d for d in extra if d not in copied]
        for digest in wanted:
            fut = self._claim(layer, digest, todo)
            if waited:
                self._waited_since.setdefault((layer.hexd, digest), self.loop.time())
            waiting.append((digest, fut))
        ahead = {d for d in extra if (layer.hexd, d) not in self._inflight}
        for digest in ahead:  # (the caller asked the blob: these are missing)
            self._claim(layer, digest, todo)
        if todo:
            # started as tasks so that a caller that stops waiting does not cancel
            # the fetch for everybody else sharing it
            for run in plan_runs(todo):
                asyncio.ensure_future(self._fetch_run(run, layer, prefetch, ahead))  # noqa: RUF006 (they resolve futures)
        for digest, fut in waiting:
            out[digest] = await asyncio.shield(fut)
        return out

    def _landed(self, layer: LayerBlob, digest: bytes) -> bool:
        """Whether a chunk the caller saw missing is in the blob now, with no fetch of it in flight
        (one that settled between the caller's look and this call): claiming it would fetch it twice.

        The present hint is set before a fetch settles, so a chunk still missing costs no I/O;
        the file has the last word (eviction may have punched it since).
        """
        if (layer.hexd, digest) in self._inflight:
            return False
        idxs = layer.positions.get(digest, ())
        return bool(idxs) and all(layer.present[i] for i in idxs) and not layer.missing(idxs)

    def _claim(self, layer: LayerBlob, digest: bytes, todo: list[tuple[bytes, ChunkLocation]]
               ) -> asyncio.Future[bytes]:
        """The chunk's fetch in flight; a new one (added to ``todo``) when there is none: a range
        asked for twice is fetched once."""
        key = (layer.hexd, digest)
        fut = self._inflight.get(key)
        if fut is None:
            loc = self.store.locate(digest)
            if loc is None:
                raise FetchError(f"chunk {digest.hex()} of layer {layer.digest} has no known location "
                                 f"in {self.store.url}")
            fut = self.loop.create_future()
            self._inflight[key] = fut
            todo.append((digest, loc))
        return fut

    async def _fetch_run(self, run: _Run, layer: LayerBlob, prefetch: bool, ahead: set[bytes] | None = None
                         ) -> None:
        self.metrics.inflight.inc(len(run.items))
        started: float | None = None
        background = prefetch or (ahead is not None and all(d in ahead for d, _ in run.items))
        try:
            data = self.units.cached(run.pack, run.start, run.end)
            streaming = data is None and not background and self.stream_units and self._streaming(layer)
            if streaming and run.pack in self.units.pack_end:
                data = await self.units.read(run.pack, run.start, run.end, layer)
            elif streaming and layer.hexd not in self._packs_noted:
                self._packs_noted.add(layer.hexd)
                noted = self.loop.run_in_executor(None, self.note_packs, layer)
                noted.add_done_callback(_log_failure)
            if data is None:
                async with self._ahead_sem if background else _NO_LIMIT, self._sem:
                    started = time.perf_counter()
                    self.metrics.requested()
                    data = await self.store.read_pack_range(run.pack, run.start, run.end)
                self.metrics.fetched(layer.digest, len(data))  # received, even if it is not what we asked for
            if len(data) != run.end - run.start:
                raise FetchError(f"{self.store.url}: short read of {pack_key(run.pack)} "
                                 f"[{run.start}, {run.end}): got {len(data)} bytes")
            # a group of chunks fetched only along goes to the background decoders: a reader's next
            # miss never queues behind the rest of the file this one read ahead
            jobs = []
            for items in _decode_groups(run.items):
                along = background or (ahead is not None and all(d in ahead for d, _ in items))
                jobs.append(self.loop.run_in_executor(self._bg_decoder if along else self._decoder, self._decode_run,
                                                      run, data, layer, prefetch, items, ahead))
            await asyncio.gather(*jobs)
        except BaseException as exc:
            failure = exc
            if isinstance(exc, Exception) and not isinstance(exc, FetchError):
                # a store error (throttled past its retries, refused): the reader's EIO names the range
                failure = FetchError(f"{self.store.url}: GET of {pack_key(run.pack)} [{run.start}, {run.end}) "
                                     f"for layer {layer.digest} failed: {exc}")
                failure.__cause__ = exc
            for digest, _ in run.items:  # (the chunks settled already are not in flight any more)
                self._fail((layer.hexd, digest), failure)
            if not isinstance(exc, Exception):
                raise
            return
        finally:
            self.metrics.inflight.dec(len(run.items))
            if started is not None:  # one observation per GET sent: fetch_count == store_requests
                self.metrics.fetch_seconds.observe(time.perf_counter() - started)

    async def _get(self, pack: bytes, start: int, end: int, layer: Any, background: bool) -> bytes:
        """One GET of whole units (lazyfetch/units.py), counted and timed as a GET of its own."""
        async with self._ahead_sem if background else _NO_LIMIT, self._sem:
            started = time.perf_counter()
            self.metrics.requested()
            try:
                data = await self.store.read_pack_range(pack, start, end)
            finally:
                self.metrics.fetch_seconds.observe(time.perf_counter() - started)
        self.metrics.fetched(layer.digest, len(data))
        return data

    def _settle(self, key: tuple[str, bytes], value: bytes | Exception) -> None:
        self._waited_since.pop(key, None)
        fut = self._inflight.pop(key, None)
        if fut is None or fut.done():
            return
        if isinstance(value, Exception):
            fut.set_exception(value)
            fut.exception()  # retrieved: nobody may be waiting any more
        else:
            fut.set_result(value)

    def _fail(self, key: tuple[str, bytes], exc: BaseException) -> None:
        self._waited_since.pop(key, None)
        fut = self._inflight.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_exception(exc if isinstance(exc, Exception) else FetchError(repr(exc)))
            fut.exception()

    def _decode_run(self, run: _Run, data: bytes, layer: LayerBlob, prefetch: bool,
                    items: list[tuple[bytes, ChunkLocation]], ahead: set[bytes] | None = None) -> None:
        """Decompress and verify ``items`` of the run, write the good ones into the blob (a decode
        thread; the run's other groups decode on the others at the same time).

        A chunk's waiters are woken within ``SETTLE_EVERY`` seconds of it being in the
        blob, not when the whole run is: a reader waiting for the first chunk of a 4 MiB run
        waits for about one chunk; the loop is woken once per batch, not once per chunk.
        """
        done: list[tuple[tuple[str, bytes], bytes | Exception]] = []
        woken = time.perf_counter()
        for digest, loc in items:
            frame = data[loc.offset - run.start : loc.offset - run.start + loc.length]
            where = f"{pack_key(run.pack)}@{loc.offset}+{loc.length}"
            try:
                chunk = decompress(frame, loc.raw_length)
                ok = blake3.blake3(chunk).digest() == digest
            except Exception as exc:  # zstd's own error type for undecodable frames
                chunk, ok = b"", False
                log.error("corrupt chunk %s from %s (%s): %s", digest.hex(), self.store.url, where, exc)
            value: bytes | Exception
            if ok:
                self.metrics.verified(layer.digest, len(chunk), prefetch=prefetch or (ahead is not None and digest in ahead))
                if not self.cache.fill(layer, digest, chunk):
                    self.metrics.cache_put_failures.inc()
                value = chunk
            else:
                self.metrics.corrupt.inc()
                # (before its waiters hear of it: the refetch must not find the same bytes in memory)
                self.loop.call_soon_threadsafe(self.units.drop, run.pack, loc.offset, loc.offset + loc.length)
                log.error("chunk %s from %s (%s) does not match its digest; not served, will refetch",
                          digest.hex(), self.store.url, where)
                value = CorruptChunk(f"chunk {digest.hex()} from {self.store.url} ({where}) is corrupt")
            done.append(((layer.hexd, digest), value))
            if time.perf_counter() - woken >= SETTLE_EVERY:
                self.loop.call_soon_threadsafe(self._settle_all, done)
                done, woken = [], time.perf_counter()
        if done:
            self.loop.call_soon_threadsafe(self._settle_all, done)

    def _settle_all(self, done: list[tuple[tuple[str, bytes], bytes | Exception]]) -> None:
        for key, value in done:
            self._settle(key, value)


def _decode_groups(items: list[tuple[bytes, ChunkLocation]]) -> list[list[tuple[bytes, ChunkLocation]]]:
    """The run's chunks in order, in groups of about ``DECODE_GROUP`` raw bytes: one decode job each."""
    groups: list[list[tuple[bytes, ChunkLocation]]] = []
    size = DECODE_GROUP
    for item in items:
        if size >= DECODE_GROUP:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item[1].raw_length
    return groups


def _log_failure(future: concurrent.futures.Future[Any] | asyncio.Future[Any]) -> None:
    """Read-ahead (or its preparation) nobody waits for: its failure is logged (the read that needs
    it fetches again)."""
    if not future.cancelled() and future.exception() is not None:
        log.warning("read-ahead failed: %s", future.exception())
