"""The per-host lazyfetch daemon: layer blobs for the kernel, fetched lazily, kept across restarts.

Data path (chosen at start, reported by ``/health`` and ``layerbox daemon status``):

* **fanotify** (Linux 6.14+, blobs on ext4/xfs/btrfs): each layer's blob is a
  sparse local file (lazyfetch/blobcache.py) that a file-backed EROFS mount
  reads directly; a FAN_PRE_ACCESS mark makes each read of it wait until
  :meth:`BlobServer.allow` has filled the range.  Filled blobs read at
  local-disk speed: once complete, an ignore mark stops the events.
* **fuse** (everywhere else): the same blob files, served by our FUSE file
  system (lazyfetch/fuseserver.py) at ``<data>/blobs/<hex>``.

Either way the kernel state the mounts depend on (the fanotify group or the
/dev/fuse connection, and each blob's event-free write fd) is also held by a
separate holder process (lazyfetch/holder.py).  A daemon that dies leaves
readers waiting, not reading zeros; the next daemon takes the fds back,
answers what the dead one left (fanotify: the events its in-flight journal,
lazyfetch/inflight.py, names get their bytes; FUSE: the kernel resends) and serves on:
no mount is re-stacked, no sandbox restarted.  The holder's ``generation``
names that kernel state; mounts made under another generation are stale.

Threads: one runs the asyncio loop (store, fetcher, prefetch, background fill,
the control server: HTTP over a unix socket under the data dir: /health,
/layers, /check, /prefetch, /stats, /metrics, /shutdown; /layers answers 503 until
the daemon serves the kernel, and names its generation); the main thread serves
the kernel (FUSE workers, or the fanotify event loop with a worker pool).
Everything host-side lives under ``--data-dir``, so two daemons with different
data dirs act as two hosts sharing one store.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import errno
import fcntl
import json
import logging
import os
import resource
import shutil
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layerstore.erofs.reader import ErofsImage
from layerstore.hoststate import make_private_dirs, open_private
from layerstore.objects import SCHEMA_TRACE, LayerEntry, digest_of, hex_digest
from layerstore.store import Store
from lazyfetch import fanotify, kmount
from lazyfetch.blobcache import EVICT_LOW_WATER, EVICT_MIN_AGE, BlobCache, LayerBlob, boot_id
from lazyfetch.blobfs import BlobServer
from lazyfetch.client import (
    EXIT_ALREADY_RUNNING,
    STARTING,
    holder_socket_path,
    private_dir,
    private_dirs,
    socket_path,
)
from lazyfetch.control import ControlServer, HTTPError, Request, Response, json_response
from lazyfetch.errors import FanotifyError
from lazyfetch.fetcher import Fetcher
from lazyfetch.fillpolicy import (
    DEFAULT_FILL_AFTER_SECONDS,
    DEFAULT_FILL_AFTER_USES,
    DEFAULT_FILL_MAX_BUSY,
    DEFAULT_FILL_MISS_BYTES,
    DiskIdle,
    FillPolicy,
    add_policy_flags,
)
from lazyfetch.holder import SWEEP_FDS, Holder
from lazyfetch.inflight import Journal, Pending
from lazyfetch.metrics import Metrics

log = logging.getLogger("layerbox.lazyfetch")

DEFAULT_CACHE_SIZE = 10 << 30
DEFAULT_FILL_BELOW = 4 << 30  # images with more blob bytes are never filled in full (lazyfetch/fillpolicy.py)
DEFAULT_FILL_BANDWIDTH = 200 << 20  # bytes per second the background fill may take from the store
FILL_BUDGET = 0.8  # ... and it stops before the cache is this full, leaving room to readers
FILL_BATCH = 64  # chunks per background fetch
FILL_ATTEMPTS = 3  # tries of one batch before the fill leaves it to the readers
BLOB_IO = ("buffered", "direct")
PREFETCH_BATCH = 32
PREFETCH_CONCURRENCY = 4
EVENT_WORKERS = 16
EXECUTOR_THREADS = 48
DATA_PATHS = ("auto", "fanotify", "fuse")


@dataclass
class DaemonConfig:
    data_dir: Path
    store_url: str | None
    s3_endpoint: str | None = None
    cache_size: int = DEFAULT_CACHE_SIZE
    fetch_timeout: float = 30.0
    trace_seconds: float = 10.0
    data_path: str = "auto"
    fill_below: int = DEFAULT_FILL_BELOW
    fill_bandwidth: int = DEFAULT_FILL_BANDWIDTH
    holder_grace: float = 60.0
    evict_min_age: float = EVICT_MIN_AGE
    blob_io: str = "buffered"
    fill_after_uses: int = DEFAULT_FILL_AFTER_USES
    fill_after_seconds: float = DEFAULT_FILL_AFTER_SECONDS
    fill_max_busy: float = DEFAULT_FILL_MAX_BUSY
    fill_miss_bytes: int = DEFAULT_FILL_MISS_BYTES

    def fill_policy(self) -> FillPolicy:
        return FillPolicy(self.fill_below, self.fill_after_uses, self.fill_after_seconds, self.fill_max_busy,
                          self.fill_miss_bytes)

    @property
    def fuse_dir(self) -> Path:
        return self.data_dir / "blobs"

    @property
    def blob_dir(self) -> Path:
        return self.data_dir / "blobcache"

    @property
    def socket(self) -> Path:
        return socket_path(self.data_dir)

    @property
    def meta_dir(self) -> Path:
        return self.data_dir / "meta"


class _Bucket:
    """A token bucket: ``take(n)`` waits until n more bytes fit the rate."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self.allowance = float(rate)
        self.at = time.monotonic()

    async def take(self, n: int) -> None:
        while True:
            now = time.monotonic()
            self.allowance = min(float(self.rate), self.allowance + (now - self.at) * self.rate)
            self.at = now
            if self.allowance >= min(n, self.rate):
                self.allowance -= n
                return
            await asyncio.sleep((min(n, self.rate) - self.allowance) / self.rate)


class Daemon:
    def __init__(self, cfg: DaemonConfig, loop: asyncio.AbstractEventLoop, store: Store, holder: Holder,
                 path: str, generation: str, group: fanotify.Group | None, reason: str | None = None) -> None:
        self.cfg = cfg
        self.loop = loop
        self.store = store
        self.holder = holder
        self.data_path = path
        self.data_path_reason = reason  # why not fanotify, when FUSE serves
        self.generation = generation
        self.group = group
        self.journal: Journal | None = None  # fanotify: the in-flight events (lazyfetch/inflight.py)
        self.recovered: dict[str, int] | None = None  # what the events a dead daemon left came to
        self.instance = uuid.uuid4().hex
        self.started = time.time()
        self.metrics = Metrics()
        self.cache = BlobCache(cfg.blob_dir, cfg.cache_size, min_age=cfg.evict_min_age,
                               reads_pinned=path == "fuse")
        self.fetcher = Fetcher(store, self.cache, self.metrics, loop, timeout=cfg.fetch_timeout)
        self.server = BlobServer(self.cache, self.fetcher, self.metrics)
        self.ready = threading.Event()
        self.stopping = threading.Event()
        self.release = False  # on exit: let the holder go too (nothing is mounted any more)
        self.fuse: Any = None
        self.holder_pid = int(holder.ping()["pid"])
        self._register_lock = asyncio.Lock()
        self._holder_lock = threading.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._tracing: set[str] = set()
        self._filling: set[str] = set()
        self._replays: dict[str, asyncio.Task[int]] = {}  # layer hex -> its trace replay
        self._bucket = _Bucket(max(cfg.fill_bandwidth, 1))
        self.fill_policy = cfg.fill_policy()
        self._uses: dict[str, int] = {}  # image digest -> its mounts on this host since the start
        self._long_lived: set[str] = set()  # images whose long-life check is scheduled
        self._armed: set[str] = set()  # layer hexes whose misses start their fill
        self._missed: dict[str, int] = {}  # armed layer hex -> bytes its reads missed since
        self._missed_lock = threading.Lock()
        self.server.on_miss = self._on_miss
        self.fill_state: dict[str, str] = {}  # layer hex -> what the fill does about it (daemon status)
        self._disk = DiskIdle(cfg.blob_dir)
        if group is not None:
            self.cache.on_complete = lambda layer: group.ignore(str(layer.path))
            self.cache.on_punch = lambda layer: group.unignore(str(layer.path))

    async def cancel_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro: Any) -> None:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- layers -------------------------------------------------------------------------
    def _meta_path(self, hexd: str) -> Path:
        return self.cfg.meta_dir / f"{hexd}.erofs"

    def _blob_path(self, layer: LayerBlob) -> str:
        return str(layer.path) if self.data_path == "fanotify" else str(self.cfg.fuse_dir / layer.hexd)

    async def register(self, entry: LayerEntry, image: str | None) -> dict[str, str]:
        hexd = hex_digest(entry.digest)
        meta_path = self._meta_path(hexd)
        known = self.cache.layers.get(hexd)
        # A layer is in the cache before its blob has its mark (_open_layer, in a thread): a
        # caller that finds it unmarked waits for the registration under way, then asks again.
        if known is None or not meta_path.exists() or not self._served(known):
            async with self._register_lock:
                known = await self._register_locked(entry, hexd, meta_path)
            self._check_served(known)
        if image:
            known.images.add(image)
        return {"meta": str(meta_path), "blob": self._blob_path(known), "path": self.data_path,
                "blob_io": self.cfg.blob_io}

    async def _register_locked(self, entry: LayerEntry, hexd: str, meta_path: Path) -> LayerBlob:
        raw = await asyncio.to_thread(self._local_meta, meta_path, entry)
        if raw is None:
            raw = await self.store.get_meta(entry.digest)
            await asyncio.to_thread(self._save_meta, meta_path, raw, entry)
        img = ErofsImage(raw, str(meta_path))
        await self.store.load_layer_locations(entry)
        layer = self.cache.layers.get(hexd)
        if layer is None:
            layer = await asyncio.to_thread(self._open_layer, hexd, img)
        return layer

    @staticmethod
    def _local_meta(meta_path: Path, entry: LayerEntry) -> bytes | None:
        if not meta_path.exists():
            return None
        raw = meta_path.read_bytes()
        if digest_of(raw) != entry.digest:  # damaged local copy: fetch it again
            meta_path.unlink()
            return None
        return raw

    def _save_meta(self, meta_path: Path, raw: bytes, entry: LayerEntry) -> None:
        private_dir(self.cfg.meta_dir)
        # the entry too: what a restarted daemon needs to fetch this layer's chunks
        for path, data in ((meta_path.with_suffix(".entry.json"), json.dumps(entry.to_json()).encode()),
                           (meta_path, raw)):
            tmp = path.with_suffix(f".tmp-{os.getpid()}")
            tmp.write_bytes(data)
            os.replace(tmp, path)

    def _open_layer(self, hexd: str, img: ErofsImage, fd: int | None = None) -> LayerBlob:
        """Open (or, after a restart, take back) the layer's blob; mark it before anyone mounts it."""
        held = fd is not None
        if fd is None:
            fd = self.cache.open_fd(hexd, img.blob_size)  # before the mark: its I/O raises no events
        layer = self.cache.add(hexd, img.blob_size, list(img.blob_map), fd=fd)
        self.server.add(layer)
        if not held:
            with self._holder_lock:
                self.holder.put(f"blob:{hexd}", layer.fd, {"blob_size": img.blob_size})
            if self.group is not None and os.environ.get("LAYERBOX_FAULT") != "skip-mark":
                self.group.watch(str(layer.path))  # (the fault: what a lost mark would look like)
        self.cache.note_complete(layer)
        return layer

    def _served(self, layer: LayerBlob) -> bool:
        return self.group is None or self._marked(layer)

    def _check_served(self, layer: LayerBlob) -> None:
        """The canary: a layer is handed out only while its reads are sure to reach us."""
        if not self._served(layer):
            raise HTTPError(500, (
                f"refusing to serve layer {layer.digest}: its blob {layer.path} has no fanotify mark "
                "of this daemon's group, so a mount would read holes as zeros; "
                "`layerbox umount --all` and mount again"))

    def _marked(self, layer: LayerBlob) -> bool:
        assert self.group is not None
        mark = self.group.mark_of(os.fstat(layer.fd))
        if mark is None:
            return False
        # an ignore mark only on a complete blob: a hole under it would read zeros
        return not (mark.ignored_mask & fanotify.FAN_PRE_ACCESS) or layer.complete()

    def adopt_layers(self, held: dict[str, tuple[int, dict[str, Any]]]) -> int:
        """After a restart: serve again every layer whose blob fd the holder kept."""
        count = 0
        for name, (fd, _) in held.items():
            if not name.startswith("blob:"):
                continue
            hexd = name.removeprefix("blob:")
            meta_path = self._meta_path(hexd)
            try:
                raw = meta_path.read_bytes()
                if digest_of(raw) != "blake3:" + hexd:
                    raise ValueError(f"{meta_path} does not match its name")
                entry = LayerEntry.from_json(json.loads(meta_path.with_suffix(".entry.json").read_text()),
                                             str(meta_path))
                asyncio.run_coroutine_threadsafe(self.store.load_layer_locations(entry), self.loop).result(60)
                self._open_layer(hexd, ErofsImage(raw, str(meta_path)), fd=fd)
                count += 1
            except Exception as exc:  # its reads fail with EIO (not zeros): the layer is not ours any more
                log.error("cannot serve layer %s again after the restart: %s", hexd, exc)
                os.close(fd)
        return count

    async def start_trace_or_prefetch(self, image: str, layers: list[str]) -> str:
        """Replay the image's stored access trace, or record one if there is none yet.

        An image without a trace of its own is often a new workspace on a base and toolkit that
        other images' tasks read already: while its trace records, the traces its layers got from
        those mounts (docs/FORMAT.md "Access traces") replay in the background."""
        doc = await self._trace_of(image)
        if doc:
            self._replay([(hex_digest(layer), bytes.fromhex(d))
                          for layer in layers for d in doc.get("layers", {}).get(layer, [])], layers)
            return "replaying"
        if image in self._tracing:
            return "recording"
        self._tracing.add(image)
        until = time.monotonic() + self.cfg.trace_seconds
        for layer in layers:
            bl = self.cache.layers.get(hex_digest(layer))
            if bl is not None and bl.trace is None:
                bl.trace, bl.trace_until = {}, until
        self._spawn(self._replay_layer_traces(layers))
        self._spawn(self._finish_trace(image, layers))
        return "recording"

    async def _trace_of(self, digest: str) -> dict[str, Any] | None:
        try:
            return await self.store.get_trace(digest)
        except Exception as exc:  # a store that cannot give the trace only costs speed
            log.warning("ignoring the access trace of %s: %s", digest, exc)
            return None

    def _replay(self, wanted: list[tuple[str, bytes]], layers: list[str]) -> None:
        replay = self.loop.create_task(self.prefetch(wanted))
        self._tasks.add(replay)
        replay.add_done_callback(self._tasks.discard)
        for layer in layers:  # the background fill of these layers starts after it
            self._replays[hex_digest(layer)] = replay

    async def _replay_layer_traces(self, layers: list[str]) -> None:
        """Prefetch what the stored trace of each layer (not yet whole here) names."""
        todo = [layer for layer in layers
                if (bl := self.cache.layers.get(hex_digest(layer))) is not None and not bl.complete_hint]
        docs = await asyncio.gather(*(self._trace_of(layer) for layer in todo))
        found = [(layer, doc) for layer, doc in zip(todo, docs, strict=True) if doc]
        if found:
            self._replay([(hex_digest(layer), bytes.fromhex(d)) for layer, doc in found
                          for d in doc["layers"].get(layer, [])], [layer for layer, _ in found])

    async def _finish_trace(self, image: str, layers: list[str]) -> None:
        await asyncio.sleep(self.cfg.trace_seconds)
        doc: dict[str, Any] = {"schema": SCHEMA_TRACE, "image": image, "layers": {}}
        for layer in layers:
            bl = self.cache.layers.get(hex_digest(layer))
            if bl is None or bl.trace is None:
                continue
            doc["layers"][layer] = [d.hex() for d in bl.trace]
            bl.trace = None
        self._tracing.discard(image)
        if not any(doc["layers"].values()):
            return
        # the image's own trace, and each layer's (the latest mount's read of it replaces the last)
        objects = [(image, doc)] + [(layer, {"schema": SCHEMA_TRACE, "image": layer, "layers": {layer: chunks}})
                                    for layer, chunks in doc["layers"].items() if chunks]

        async def put(digest: str, trace: dict[str, Any]) -> None:
            try:
                await self.store.put_trace(digest, trace)
                log.info("stored access trace of %s: %d chunks", digest,
                         sum(len(v) for v in trace["layers"].values()))
            except Exception as exc:
                log.warning("could not store the access trace of %s: %s", digest, exc)

        # side by side: a remote store's round trips do not add up (an image has a few layers)
        await asyncio.gather(*(put(digest, trace) for digest, trace in objects))

    async def prefetch(self, wanted: Iterable[tuple[str, bytes]]) -> int:
        """Fetch the ``(layer hex, chunk digest)`` pairs the blobs lack, in batches per layer.

        Returns how many of the chunks missing at the start are present now
        (fetched by this call or by a read that was fetching them already).
        """
        by_layer: dict[str, list[bytes]] = {}
        for hexd, digest in wanted:
            by_layer.setdefault(hexd, []).append(digest)
        jobs: list[tuple[LayerBlob, list[bytes]]] = []
        for hexd, digests in by_layer.items():
            layer = self.cache.layers.get(hexd)
            if layer is None:
                continue
            idxs = sorted({i for d in digests for i in layer.positions.get(d, ())})
            todo = list(dict.fromkeys(layer.records[i].digest for i in layer.missing(idxs)))
            jobs.extend((layer, todo[i : i + PREFETCH_BATCH]) for i in range(0, len(todo), PREFETCH_BATCH))
        sem = asyncio.Semaphore(PREFETCH_CONCURRENCY)

        async def batch(layer: LayerBlob, part: list[bytes]) -> int:
            async with sem:
                try:
                    await self.fetcher.fetch_many(layer, part, prefetch=True)
                    return len(part)
                except Exception as exc:
                    log.warning("prefetch of %d chunks of %s failed: %s", len(part), layer.digest, exc)
                    return 0

        done = await asyncio.gather(*(batch(layer, part) for layer, part in jobs))
        for layer in {id(j[0]): j[0] for j in jobs}.values():
            await asyncio.to_thread(self.cache.note_complete, layer)
        return sum(done)

    async def keep_capacity(self) -> None:
        """Evict what fills could not (chunks too young then) once they have aged."""
        while True:
            await asyncio.sleep(min(max(self.cfg.evict_min_age / 2, 0.1), 5.0))
            if self.cache.used > self.cache.capacity:
                await asyncio.to_thread(self.cache.evict, int(self.cache.capacity * EVICT_LOW_WATER))

    def maybe_fill(self, image: str | None, layers: list[str]) -> bool:
        """A mount of ``image``: start the background fill of its layers if the fill policy says so
        (lazyfetch/fillpolicy.py); True if a fill runs for them."""
        blobs = [self.cache.layers[h] for h in map(hex_digest, layers) if h in self.cache.layers]
        uses = 1
        if image:
            uses = self._uses[image] = self._uses.get(image, 0) + 1
        decision = self.fill_policy.on_use(sum(b.blob_size for b in blobs), uses)
        if decision == "never":
            self._note_fill(blobs, "off" if not self.fill_policy.below else
                            f"never: the image is above --fill-below ({self.fill_policy.below} bytes)")
            return False
        if decision == "arm":
            for b in blobs:
                if b.hexd not in self._filling and not b.complete_hint:
                    self._armed.add(b.hexd)
            self._note_fill(blobs, f"armed: used {uses} time(s); fills once its reads miss "
                                   f"{self.fill_policy.miss_bytes} bytes")
            return False
        if decision == "wait":
            self._note_fill(blobs, "waiting: " + self.fill_policy.waiting_reason(uses))
            if image and self.fill_policy.after_seconds and image not in self._long_lived:
                self._long_lived.add(image)
                self._spawn(self._fill_if_long_lived(image, blobs))
            return False
        self._start_fill(blobs)
        return True

    def _on_miss(self, layer: LayerBlob, missed: int) -> None:
        """(A thread serving the kernel) a read of ``layer`` waits for ``missed`` bytes from the
        store: an armed layer whose reads missed ``miss_bytes`` since it was armed is filled."""
        if layer.hexd not in self._armed:
            return
        with self._missed_lock:
            total = self._missed[layer.hexd] = self._missed.get(layer.hexd, 0) + missed
            if total < self.fill_policy.miss_bytes or layer.hexd not in self._armed:
                return
            self._armed.discard(layer.hexd)
        log.info("layer %s missed %d bytes since its image came back: filling it in the background",
                 layer.digest, total)
        self.loop.call_soon_threadsafe(self._start_fill, [layer])

    def _note_fill(self, blobs: list[LayerBlob], state: str) -> None:
        for b in blobs:
            if b.hexd in self._filling or self.fill_state.get(b.hexd) in ("filling", "whole"):
                continue
            if b.hexd in self._armed and not state.startswith("armed"):
                continue  # (a layer another image armed stays armed)
            self.fill_state[b.hexd] = state

    def _start_fill(self, blobs: list[LayerBlob]) -> None:
        todo = [b for b in blobs if b.hexd not in self._filling and not b.complete_hint]
        for b in todo:
            self._armed.discard(b.hexd)
            self._filling.add(b.hexd)
            self.fill_state[b.hexd] = "filling"
        for b in blobs:
            if b.complete_hint:
                self.fill_state[b.hexd] = "whole"
        if todo:
            self._spawn(self._fill(todo))

    async def _fill_if_long_lived(self, image: str, blobs: list[LayerBlob]) -> None:
        """``after_seconds`` after the image's first mount: fill it if a layer of it is still mounted."""
        try:
            await asyncio.sleep(self.fill_policy.after_seconds)
            under = self.cfg.data_dir / "layers"
            mounted = {Path(mp).name for mp in await asyncio.to_thread(kmount.mounts_under, under)}
            if any(b.hexd in mounted for b in blobs):
                log.info("image %s is mounted since %.0f s: filling it in the background", image,
                         self.fill_policy.after_seconds)
                self._start_fill(blobs)
        finally:
            self._long_lived.discard(image)

    async def _wait_for_idle_disk(self) -> None:
        """The fill goes on only while the blob cache's disk has bandwidth to spare."""
        while (busy := await asyncio.to_thread(self._disk.busy)) > self.fill_policy.max_busy:
            log.debug("background fill waits: the blob disk was %d%% busy", 100 * busy)
            await asyncio.sleep(0.5)

    async def _fill(self, layers: list[LayerBlob]) -> None:
        """The rest of each layer, at low priority: after its trace replay and readers, within a rate,
        a cache budget and the disk's idle time."""
        try:
            for layer in layers:
                replay = self._replays.pop(layer.hexd, None)
                if replay is not None:
                    await asyncio.wait([replay])
                stopped = await self._fill_layer(layer)
                if stopped:
                    self.fill_state[layer.hexd] = f"stopped: {stopped}"
                    return
                if await asyncio.to_thread(self.cache.note_complete, layer):
                    self.metrics.layers_filled.inc()
                    self.fill_state[layer.hexd] = "whole"
        finally:
            for layer in layers:
                self._filling.discard(layer.hexd)
                if self.fill_state.get(layer.hexd) == "filling":
                    self.fill_state[layer.hexd] = "stopped: the daemon is stopping, or a chunk failed"

    async def _fill_layer(self, layer: LayerBlob) -> str | None:
        """Fetch every missing chunk of ``layer``, ``FILL_BATCH`` at a time; why it stopped, if it did."""
        for start in range(0, len(layer.records), FILL_BATCH):
            for attempt in range(1, FILL_ATTEMPTS + 1):
                idxs = layer.missing(range(start, min(start + FILL_BATCH, len(layer.records))))
                if not idxs:
                    break
                while self.fetcher.foreground:  # noqa: ASYNC110 (a reader waits for the store: it goes first)
                    await asyncio.sleep(0.02)
                await self._wait_for_idle_disk()
                size = sum(layer.records[i].length for i in idxs)
                if self.cache.used + size > self.cache.capacity * FILL_BUDGET:
                    full = 100 * self.cache.used // max(self.cache.capacity, 1)
                    log.info("background fill of %s stops: the cache is %d%% full", layer.digest, full)
                    return f"the cache is {full}% full"
                await self._bucket.take(size)
                try:
                    await self.fetcher.fetch_many(layer, list(dict.fromkeys(layer.records[i].digest for i in idxs)),
                                                  prefetch=True)
                except Exception as exc:  # a read that needs these chunks fetches them itself
                    log.warning("background fill of %s at chunk %d (attempt %d of %d): %s", layer.digest,
                                start, attempt, FILL_ATTEMPTS, exc)
                    await asyncio.sleep(1.0)
        return None

    def stats(self) -> dict[str, Any]:
        """``GET /stats``, ``layerbox stats --json``: every field is defined in docs/STATS.md."""
        cache = self.cache.stats()
        self.metrics.cache_bytes.set(cache["bytes"])
        layers = {layer.digest: set(layer.images) for layer in list(self.cache.layers.values())}
        snap = self.metrics.snapshot(layers)
        snap["cache"] = cache
        snap["layers"] = len(self.cache.layers)
        served = list(self.cache.layers.values())
        snap["bytes_present_per_layer"] = {b.digest: b.present_bytes() for b in served}
        snap["blob_bytes_per_layer"] = {b.digest: b.blob_size for b in served}
        snap["fill_per_layer"] = {b.digest: "whole" if b.complete_hint else self.fill_state.get(b.hexd, "not asked")
                                  for b in served}
        snap["pack_units"] = self.fetcher.units.stats()
        snap["instance"] = self.instance
        snap["generation"] = self.generation
        snap["data_path"] = self.data_path
        snap["uptime"] = round(time.time() - self.started, 3)
        return snap

    def health(self) -> dict[str, Any]:
        return {"ready": self.ready.is_set(), "instance": self.instance, "generation": self.generation,
                "pid": os.getpid(), "data_path": self.data_path, "data_path_reason": self.data_path_reason,
                "blob_io": self.cfg.blob_io,
                "fuse": str(self.cfg.fuse_dir),
                "blobs": str(self.cfg.blob_dir), "holder": self.holder_pid, "recovered": self.recovered}

    # -- control server -----------------------------------------------------------------
    def control(self) -> ControlServer:
        async def health(_: Request) -> Response:
            return json_response(self.health())

        async def layers(req: Request) -> Response:
            # Layers registered before the daemon serves the kernel would be mounted on a blob
            # nobody answers yet, or while the reads a dead daemon left are still being answered.
            if not self.ready.is_set():
                raise HTTPError(STARTING, "starting: it does not serve the kernel yet; ask again when "
                                "/health says ready")
            body = req.json()
            image = body.get("image")
            out = []
            for obj in body["layers"]:
                out.append(await self.register(LayerEntry.from_json(obj, "request"), image))
            digests = [o["digest"] for o in body["layers"]]
            mode = None
            if image and body.get("trace", True):
                mode = await self.start_trace_or_prefetch(image, digests)
            filling = self.maybe_fill(image, digests) if body.get("fill", True) else False
            # (the generation: the caller's mount needs no /health of its own to know whose layers these are)
            return json_response({"layers": out, "trace": mode, "fill": filling, "generation": self.generation})

        async def check(req: Request) -> Response:
            """After a mount: are the layers' reads still sure to reach this daemon?"""
            for hexd in req.json()["layers"]:
                layer = self.cache.layers.get(hexd)
                if layer is None:
                    raise HTTPError(404, f"layer {hexd} is not served by this daemon")
                self._check_served(layer)
            return json_response({"ok": True, "generation": self.generation})

        async def prefetch(req: Request) -> Response:
            body = req.json()
            wanted: list[tuple[str, bytes]] = []
            for obj in body["layers"]:
                entry = LayerEntry.from_json(obj, "request")
                await self.register(entry, body.get("image"))
                layer = self.cache.layers[hex_digest(entry.digest)]
                wanted.extend((layer.hexd, r.digest) for r in layer.records)
            fetched = await self.prefetch(wanted)
            return json_response({"chunks": len(wanted), "fetched": fetched})

        async def stats(_: Request) -> Response:
            return json_response(self.stats())

        async def metrics(_: Request) -> Response:
            self.metrics.cache_bytes.set(self.cache.used)
            return Response(body=self.metrics.prometheus(), content_type="text/plain")

        async def shutdown(req: Request) -> Response:
            self.release = bool(req.json().get("release", False))
            self.loop.call_later(0.05, self.request_exit)
            return json_response({"stopping": True, "release": self.release})

        return ControlServer({("GET", "/health"): health, ("POST", "/layers"): layers, ("POST", "/check"): check,
                              ("POST", "/prefetch"): prefetch, ("GET", "/stats"): stats,
                              ("GET", "/metrics"): metrics, ("POST", "/shutdown"): shutdown})

    def watch_holder(self, main: tuple[str, int, dict[str, Any]]) -> None:
        """A holder that died (killed, OOM) is replaced at once, with every fd it held.

        While this daemon lives it holds the same fds, so nothing was lost yet; the
        new holder makes the next daemon restart safe again.
        """
        while not self.stopping.wait(1.0):
            try:
                with self._holder_lock:
                    self.holder.ping()
                continue
            except Exception as exc:
                log.error("the fd holder is gone (%s): starting a new one", exc)
            try:
                with self._holder_lock:
                    self.holder.close()
                    self.holder = Holder.spawn(str(holder_socket_path(self.cfg.data_dir)),
                                               grace=self.cfg.holder_grace)
                    self.holder.put(main[0], main[1], main[2])
                    if self.journal is not None:
                        self.holder.put("inflight", self.journal.fd)
                    for layer in list(self.cache.layers.values()):
                        self.holder.put(f"blob:{layer.hexd}", layer.fd, {"blob_size": layer.blob_size})
                    self.holder_pid = int(self.holder.ping()["pid"])
            except Exception:
                log.exception("cannot start a new fd holder; a daemon restart now would lose the mounts")

    def request_exit(self) -> None:
        self.stopping.set()
        if self.fuse is not None:
            self.fuse.stop()

    # -- serving the kernel ---------------------------------------------------------------
    def recover(self, pending: list[Pending]) -> dict[str, int]:
        """Answer the events a dead daemon had read, before reading any (fd numbers would clash).

        Each one the journal holds gets its range filled and FAN_ALLOW (EIO if the
        fill fails); a sweep then denies any the journal could not name (a daemon
        of an older version, or a journal of another layout).
        """
        assert self.group is not None
        assert self.journal is not None
        group, journal = self.group, self.journal
        by_ino = {os.fstat(layer.fd).st_ino: layer for layer in list(self.cache.layers.values())}

        def answer(p: Pending) -> bool:
            if p.ino:  # the blob it was for, as tagged; a blob not served any more: EIO
                layers = [by_ino[p.ino]] if p.ino in by_ino else []
            else:  # the daemon died between read() and the tag: every blob the range fits
                layers = [layer for layer in by_ino.values() if p.offset < layer.blob_size]
            ok = bool(layers) and all([self.server.fill(layer, p.offset, p.count) for layer in layers])
            try:
                group.respond(p.fd, ok)
            except FanotifyError as exc:
                if exc.errno != errno.ENOENT:  # ENOENT: answered already (the holder's watchdog)
                    log.error("cannot answer a read the previous daemon left: %s", exc)
            journal.forget(p.at)
            return ok

        with concurrent.futures.ThreadPoolExecutor(EVENT_WORKERS, thread_name_prefix="layerbox-recover") as pool:
            filled = sum(pool.map(answer, pending))
        swept = group.sweep()
        journal.reset()
        done = {"events": len(pending), "filled": filled, "denied": len(pending) - filled, "swept": swept}
        if pending or swept:
            log.warning("answered the %d read(s) the previous daemon left: %d with their bytes, %d with EIO; "
                        "%d more it had not journalled denied (EIO)", len(pending), filled,
                        len(pending) - filled, swept)
        return done

    def serve_fanotify(self, pending: list[Pending] | None) -> None:
        """Serve the group; ``pending``: adopted, the events the journal says the dead daemon left."""
        assert self.group is not None
        assert self.journal is not None
        group, journal = self.group, self.journal
        if pending is not None:
            self.recovered = self.recover(pending)
        self.ready.set()
        pool = concurrent.futures.ThreadPoolExecutor(EVENT_WORKERS, thread_name_prefix="layerbox-event")

        def responder(event: fanotify.Event) -> Callable[[bool], None]:
            def respond(ok: bool) -> None:
                try:
                    group.respond(event.fd, ok)
                except OSError as exc:
                    log.error("cannot answer a fanotify event: %s", exc)
                journal.answered(event.at)  # before the fd closes: its number names the event till then
            return respond

        def answer(event: fanotify.Event) -> None:
            respond = responder(event)
            answered = [False]

            def once(ok: bool) -> None:
                answered[0] = True
                respond(ok)

            try:
                self.server.allow(event.fd, event.offset, event.count, once)
            except Exception:
                log.exception("fanotify event of pid %d at %d+%d", event.pid, event.offset, event.count)
            finally:
                if not answered[0]:
                    respond(False)
                os.close(event.fd)

        def read(buf: memoryview) -> int:
            return group.read_into(buf, timeout=0.2)

        os.set_blocking(group.fd, False)  # (shared with the holder: its watchdog may flip it back)
        try:
            while not self.stopping.is_set():
                for event in journal.read(read, self.stopping, _inode):
                    if event.fd < 0:
                        continue
                    try:
                        here = self.server.present(event.fd, event.offset, event.count, responder(event))
                    except Exception:
                        here = False  # the worker finds out and answers
                    if here:
                        os.close(event.fd)
                    else:
                        pool.submit(answer, event)
                self.server.count_batch()
        finally:
            pool.shutdown(wait=True)

    def serve_fuse(self, fd: int, adopted: bool) -> None:
        from lazyfetch.fuseserver import FuseServer

        self.fuse = FuseServer(self.server, fd)
        self.ready.set()
        if self.stopping.is_set():
            return
        self.fuse.serve(resumed=adopted)


def _inode(fd: int) -> int:
    """The inode number of an event's file (the journal's tag), 0 if it cannot be had."""
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return 0


def _keep_fds_below_sweep() -> None:
    """Event fds get the lowest free numbers, below RLIMIT_NOFILE: keep that within a sweep's reach."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft > SWEEP_FDS:
        resource.setrlimit(resource.RLIMIT_NOFILE, (SWEEP_FDS, hard))


def _journal(holder: Holder, held: dict[str, tuple[int, dict[str, Any]]]) -> tuple[Journal, list[Pending] | None]:
    """The in-flight journal: the dead daemon's, with what it left (adopted), or a new one."""
    if "fanotify" in held and "inflight" in held:
        journal, pending = Journal.adopt(held["inflight"][0])
        return journal, pending
    journal = Journal.create()
    holder.put("inflight", journal.fd)
    return journal, [] if "fanotify" in held else None


def _choose_path(cfg: DaemonConfig) -> tuple[str, str | None]:
    """The data path for a new generation, and why fanotify was not taken."""
    if cfg.data_path == "fuse":
        return "fuse", "--data-path fuse"
    reason = _probe_cached(cfg.blob_dir)
    if reason is None:
        return "fanotify", None
    if cfg.data_path == "fanotify":
        raise SystemExit(f"--data-path fanotify: {reason}")
    log.warning("serving layers through FUSE: fanotify pre-content events do not work here: %s", reason)
    return "fuse", reason


PROBE_CACHE = Path("/run/layerbox")  # tmpfs: gone at reboot, as the probe's answer may be


def _probe_cached(blob_dir: Path) -> str | None:
    """``fanotify.probe`` of the blob dir, once per boot, kernel and filesystem (~0.2 s each).

    Kept for the whole host (every data dir on one filesystem gets the same answer), so a
    fresh data dir's first mount does not pay it again.
    """
    st = os.stat(blob_dir)
    key = {"boot_id": boot_id(), "kernel": os.uname().release, "dev": st.st_dev}
    private_dir(PROBE_CACHE)
    path = PROBE_CACHE / f"fanotify-probe-{st.st_dev:x}.json"
    with contextlib.suppress(OSError, ValueError):
        doc = json.loads(path.read_text())
        if doc.get("key") == key:
            return doc.get("reason")
    reason = fanotify.probe(str(blob_dir))
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"key": key, "reason": reason}))
    os.replace(tmp, path)
    return reason


def _clear_stale_fuse(path: Path) -> None:
    # a FUSE mount whose connection is gone is "not connected": detach it
    if kmount.is_mountpoint(path):
        kmount.umount(path, lazy=True, missing_ok=True)


def run(cfg: DaemonConfig) -> int:
    make_private_dirs(cfg.data_dir)
    # held for the daemon's life: a second daemon on this data dir would fight over the holder's
    # fds and the socket, and every layer registered with the first would vanish
    # (0600: a lock another local user could open, they could hold, and no daemon would start)
    lock = open_private(cfg.data_dir / "lazyfetch.lock")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.error("another lazyfetch daemon serves %s; not starting a second one", cfg.data_dir)
        os.close(lock)
        return EXIT_ALREADY_RUNNING
    try:
        return _serve(cfg)
    finally:
        os.close(lock)


def _serve(cfg: DaemonConfig) -> int:
    private_dirs(cfg.data_dir)  # before the store makes its cache there
    private_dir(cfg.blob_dir)
    stale_chunks = cfg.data_dir / "chunks"  # the chunk cache of older daemons: the blobs replace it
    if stale_chunks.is_dir() and not kmount.is_mountpoint(stale_chunks):
        shutil.rmtree(stale_chunks, ignore_errors=True)
    hsock = holder_socket_path(cfg.data_dir)
    holder = Holder.connect(str(hsock))
    held = holder.get_all() if holder is not None else {}
    main = held.get("fanotify") or held.get("fuse")
    if main is not None and main[1].get("aborted"):
        log.warning("the holder aborted the FUSE connection (no daemon for %.0f s): starting a new one",
                    cfg.holder_grace)
        main = None
    if holder is None or main is None:  # a new generation: nothing mounted depends on old fds
        if holder is not None:
            holder.exit()
        for _name, (fd, _) in held.items():
            os.close(fd)
        held = {}
        holder = Holder.spawn(str(hsock), grace=cfg.holder_grace)
        path, reason = _choose_path(cfg)
        generation = uuid.uuid4().hex
        adopted = False
    else:
        path = "fanotify" if "fanotify" in held else "fuse"
        reason = main[1].get("reason")
        generation = str(main[1].get("generation", ""))
        adopted = True
    group: fanotify.Group | None = None
    journal: Journal | None = None
    pending: list[Pending] | None = None
    fuse_fd = fuse_dev = -1
    if path == "fanotify":
        _keep_fds_below_sweep()
        if adopted:
            group = fanotify.Group.adopt(held["fanotify"][0])
        else:
            group = fanotify.Group.create()
            holder.put("fanotify", group.fd, {"generation": generation})
        journal, pending = _journal(holder, held)
    else:
        private_dir(cfg.fuse_dir.parent)
        if adopted:
            fuse_fd = held["fuse"][0]
        else:
            from lazyfetch.fuseserver import open_and_mount

            _clear_stale_fuse(cfg.fuse_dir)  # before touching it: a dead FUSE mount fails stat()
            private_dir(cfg.fuse_dir)
            fuse_fd = open_and_mount(str(cfg.fuse_dir))
            fuse_dev = [m.dev for m in kmount.read_mountinfo() if m.mountpoint == str(cfg.fuse_dir)][-1]
            holder.put("fuse", fuse_fd, {"generation": generation, "dev": fuse_dev, "reason": reason})

    loop = asyncio.new_event_loop()
    # store GETs (the file store's are blocking reads) and chunk decoding run on the loop's
    # default executor: the stock one has cpu+4 threads, fewer than the fetches in flight
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(EXECUTOR_THREADS,
                                                                    thread_name_prefix="layerbox-io"))
    thread = threading.Thread(target=loop.run_forever, name="layerbox-loop", daemon=True)
    thread.start()

    def on_loop(coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    opts: dict[str, Any] = {"s3_endpoint": cfg.s3_endpoint} if cfg.s3_endpoint else {}
    store = on_loop(Store.open(cfg.store_url, cfg.data_dir, **opts))
    daemon = Daemon(cfg, loop, store, holder, path, generation, group, reason)
    daemon.journal = journal
    loop.call_soon_threadsafe(daemon._spawn, daemon.keep_capacity())
    if adopted:
        n = daemon.adopt_layers(held)
        log.info("took over generation %s from the holder: %d layer(s), data path %s", generation, n, path)
    elif reason:
        log.info("data path fuse (%s)", reason)
    control = daemon.control()
    with contextlib.suppress(FileNotFoundError):
        cfg.socket.unlink()
    if cfg.socket.parent == cfg.data_dir:
        cfg.socket.parent.mkdir(parents=True, exist_ok=True)
    else:  # /run/layerbox: closed to others already while the socket waits for its chmod below
        private_dir(cfg.socket.parent)
    on_loop(control.start(str(cfg.socket)))
    os.chmod(cfg.socket, 0o600)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: daemon.request_exit())
    # (never stat the FUSE mount here: adopted, nobody answers it until we serve)
    main_fd = ("fanotify", group.fd, {"generation": generation}) if group is not None else \
        ("fuse", fuse_fd, held["fuse"][1] if adopted else {"generation": generation, "dev": fuse_dev,
                                                            "reason": reason})
    threading.Thread(target=daemon.watch_holder, args=(main_fd,), name="layerbox-holder", daemon=True).start()
    log.info("lazyfetch daemon %s (generation %s, %s) serving from %s", daemon.instance, generation, path,
             store.url)
    try:
        if path == "fanotify":
            daemon.serve_fanotify(pending)
        else:
            daemon.serve_fuse(fuse_fd, adopted)
    finally:
        log.info("lazyfetch daemon %s stopping%s", daemon.instance, " and releasing its holder"
                 if daemon.release else "")
        with contextlib.suppress(Exception):
            on_loop(daemon.cancel_tasks(), 5)
        with contextlib.suppress(Exception):
            on_loop(control.close(), 5)
        with contextlib.suppress(Exception):
            on_loop(store.close(), 5)
        if daemon.release:
            # nothing is mounted on these fds any more (the client unmounted every layer first)
            if path == "fuse":
                with contextlib.suppress(Exception):
                    kmount.umount(cfg.fuse_dir, lazy=True, missing_ok=True)
            with contextlib.suppress(Exception):
                daemon.holder.exit()
        daemon.holder.close()
        daemon.fetcher.close()
        daemon.cache.close()
        if group is not None:
            group.close()
        if journal is not None:
            journal.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        with contextlib.suppress(FileNotFoundError):
            cfg.socket.unlink()
    return 0


def parse_args(argv: list[str] | None) -> DaemonConfig:
    p = argparse.ArgumentParser(prog="layerbox daemon")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--store", default=None)
    p.add_argument("--s3-endpoint", default=None)
    p.add_argument("--cache-size", type=int, default=DEFAULT_CACHE_SIZE)
    p.add_argument("--fetch-timeout", type=float, default=30.0)
    p.add_argument("--trace-seconds", type=float, default=10.0)
    p.add_argument("--data-path", choices=DATA_PATHS, default="auto",
                   help="how the kernel reads layer blobs: fanotify pre-content events where they work, "
                        "else FUSE (auto); or force one")
    p.add_argument("--fill-below", type=int, default=DEFAULT_FILL_BELOW,
                   help="never fill images with more blob bytes in full (0: no background fill)")
    add_policy_flags(p, defaults=True)
    p.add_argument("--fill-bandwidth", type=int, default=DEFAULT_FILL_BANDWIDTH,
                   help="bytes per second the background fill may fetch")
    p.add_argument("--holder-grace", type=float, default=60.0,
                   help="seconds readers wait for a dead daemon's successor before they get EIO")
    p.add_argument("--evict-min-age", type=float, default=EVICT_MIN_AGE,
                   help="seconds after its last read before a chunk may be evicted")
    p.add_argument("--blob-io", choices=BLOB_IO, default="buffered",
                   help="how EROFS reads a layer's blob: through the page cache (buffered: fastest re-reads, "
                        "but a read byte is cached twice, as blob and as file) or with direct I/O (direct: "
                        "cached once, as the file; re-reads ~0.6x buffered); applies to layers mounted from then on")
    a = p.parse_args(argv)
    cfg = DaemonConfig(Path(a.data_dir), a.store, a.s3_endpoint, a.cache_size, a.fetch_timeout, a.trace_seconds,
                       a.data_path, a.fill_below, a.fill_bandwidth, a.holder_grace, a.evict_min_age, a.blob_io,
                       a.fill_after_uses, a.fill_after_seconds, a.fill_max_busy, a.fill_miss_bytes)
    try:
        cfg.fill_policy()
    except ValueError as exc:
        p.error(str(exc))
    return cfg


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    make_private_dirs(cfg.data_dir)
    log_file = cfg.data_dir / "lazyfetch.log"
    os.close(os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
    os.chmod(log_file, 0o600)  # (older daemons made it 0644: it names layers and paths of this host)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=[logging.FileHandler(log_file), logging.StreamHandler(sys.stderr)],
    )
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
