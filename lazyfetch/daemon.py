"""The per-host lazyfetch daemon: FUSE blob files, chunk cache, prefetch, control socket.

Threads: the main thread runs fusepy's loop (which spawns a thread per
concurrent request); one background thread runs the asyncio loop with the
store, the fetcher, prefetch tasks and the control server (HTTP over a unix
socket under the data dir: /health, /layers, /prefetch, /stats, /metrics,
/shutdown).  Everything host-side lives under ``--data-dir``, so two daemons
with different data dirs act as two hosts sharing one store.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from layerstore.erofs.reader import ErofsImage
from layerstore.objects import LayerEntry, digest_of, hex_digest
from layerstore.store import Store
from lazyfetch import kmount
from lazyfetch.blobfs import BlobFS, BlobLayer
from lazyfetch.chunkcache import ChunkCache
from lazyfetch.client import EXIT_ALREADY_RUNNING, private_dir, private_dirs, socket_path
from lazyfetch.fetcher import Fetcher
from lazyfetch.metrics import Metrics

log = logging.getLogger("layerbox.lazyfetch")

DEFAULT_CACHE_SIZE = 10 << 30
PREFETCH_BATCH = 32
PREFETCH_CONCURRENCY = 4


@dataclass
class DaemonConfig:
    data_dir: Path
    store_url: str | None
    s3_endpoint: str | None = None
    cache_size: int = DEFAULT_CACHE_SIZE
    fetch_timeout: float = 30.0
    trace_seconds: float = 10.0

    @property
    def fuse_dir(self) -> Path:
        return self.data_dir / "blobs"

    @property
    def socket(self) -> Path:
        return socket_path(self.data_dir)

    @property
    def meta_dir(self) -> Path:
        return self.data_dir / "meta"


def trace_key(image: str) -> str:
    h = hex_digest(image)
    return f"traces/{h[:2]}/{h}"


class Daemon:
    def __init__(self, cfg: DaemonConfig, loop: asyncio.AbstractEventLoop, store: Store) -> None:
        self.cfg = cfg
        self.loop = loop
        self.store = store
        self.instance = uuid.uuid4().hex
        self.started = time.time()
        self.metrics = Metrics()
        self.cache = ChunkCache(cfg.data_dir / "chunks", cfg.cache_size)
        self.fetcher = Fetcher(store, self.cache, self.metrics, loop, timeout=cfg.fetch_timeout)
        self.fs = BlobFS(self.cache, self.fetcher, self.metrics)
        self._register_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._tracing: set[str] = set()

    async def cancel_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro: Any) -> None:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- layers -------------------------------------------------------------------------
    async def register(self, entry: LayerEntry, image: str | None) -> dict[str, str]:
        hexd = hex_digest(entry.digest)
        meta_path = self.cfg.meta_dir / f"{hexd}.erofs"
        paths = {"meta": str(meta_path), "blob": str(self.cfg.fuse_dir / hexd)}
        known = self.fs.layers.get(hexd)
        if known is not None and meta_path.exists():
            if image:
                known.images.add(image)
            return paths  # registered already: mounting a cached image costs no parsing
        async with self._register_lock:
            if meta_path.exists():
                raw = meta_path.read_bytes()
                if digest_of(raw) != entry.digest:  # damaged local copy: fetch it again
                    meta_path.unlink()
            if not meta_path.exists():
                raw = await self.store.get_meta(entry.digest)
                private_dir(self.cfg.meta_dir)
                tmp = meta_path.with_suffix(f".tmp-{os.getpid()}")
                tmp.write_bytes(raw)
                os.replace(tmp, meta_path)
            img = ErofsImage(raw, str(meta_path))
            await self.store.load_layer_locations(entry)
            layer = BlobLayer("blake3:" + hexd, img.blob_size, list(img.blob_map),
                              images={image} if image else set())
            self.fs.add_layer(layer)
        return paths

    async def start_trace_or_prefetch(self, image: str, layers: list[str]) -> str:
        """Replay the image's stored access trace, or record one if there is none yet."""
        try:
            doc = json.loads(await self.store.backend.get(trace_key(image)))
        except FileNotFoundError:
            doc = None
        except Exception as exc:  # a broken trace only costs speed
            log.warning("ignoring unreadable trace for %s: %s", image, exc)
            doc = None
        if doc:
            wanted = [("blake3:" + hex_digest(layer), bytes.fromhex(d))
                      for layer in layers for d in doc.get("layers", {}).get(layer, [])]
            self._spawn(self.prefetch(wanted))
            return "replaying"
        if image in self._tracing:
            return "recording"
        self._tracing.add(image)
        until = time.monotonic() + self.cfg.trace_seconds
        for layer in layers:
            bl = self.fs.layers.get(hex_digest(layer))
            if bl is not None and bl.trace is None:
                bl.trace, bl.trace_until = {}, until
        self._spawn(self._finish_trace(image, layers))
        return "recording"

    async def _finish_trace(self, image: str, layers: list[str]) -> None:
        await asyncio.sleep(self.cfg.trace_seconds)
        doc: dict[str, Any] = {"schema": "layerbox.trace.v1", "image": image, "layers": {}}
        for layer in layers:
            bl = self.fs.layers.get(hex_digest(layer))
            if bl is None or bl.trace is None:
                continue
            doc["layers"][layer] = [d.hex() for d in bl.trace]
            bl.trace = None
        self._tracing.discard(image)
        if any(doc["layers"].values()):
            try:
                await self.store.backend.put(trace_key(image), json.dumps(doc).encode())
                log.info("stored access trace of %s: %d chunks", image,
                         sum(len(v) for v in doc["layers"].values()))
            except Exception as exc:
                log.warning("could not store the access trace of %s: %s", image, exc)

    async def prefetch(self, wanted: Iterable[tuple[str, bytes]]) -> int:
        """Fetch the ``(layer, chunk digest)`` pairs not cached yet, in batches per layer.

        A chunk named by two layers is fetched (and counted) for the first.
        Returns how many of the chunks not cached at the start are available
        now (fetched by this call or by a read that was fetching it already).
        """
        by_layer: dict[str, list[bytes]] = {}
        seen: set[bytes] = set()
        for layer, digest in wanted:
            if digest not in seen and not self.cache.contains(digest):
                by_layer.setdefault(layer, []).append(digest)
            seen.add(digest)
        sem = asyncio.Semaphore(PREFETCH_CONCURRENCY)

        async def batch(layer: str, part: list[bytes]) -> int:
            async with sem:
                try:
                    await self.fetcher.fetch_many(part, layer, prefetch=True)
                    return len(part)
                except Exception as exc:
                    log.warning("prefetch of %d chunks of %s failed: %s", len(part), layer, exc)
                    return 0

        done = await asyncio.gather(*(batch(layer, todo[i : i + PREFETCH_BATCH])
                                      for layer, todo in by_layer.items()
                                      for i in range(0, len(todo), PREFETCH_BATCH)))
        return sum(done)

    def stats(self) -> dict[str, Any]:
        """``GET /stats``, ``layerbox stats --json``: every field is defined in docs/STATS.md."""
        cache = self.cache.stats()
        self.metrics.cache_bytes.set(cache["bytes"])
        layers = {layer.digest: set(layer.images) for layer in list(self.fs.layers.values())}
        snap = self.metrics.snapshot(layers)
        snap["cache"] = cache
        snap["layers"] = len(self.fs.layers)
        snap["instance"] = self.instance
        snap["uptime"] = round(time.time() - self.started, 3)
        return snap

    # -- control server -----------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application()
        routes = web.RouteTableDef()

        @routes.get("/health")
        async def health(_: web.Request) -> web.Response:
            return web.json_response({"ready": self.fs.ready.is_set(), "instance": self.instance,
                                      "pid": os.getpid(), "fuse": str(self.cfg.fuse_dir)})

        @routes.post("/layers")
        async def layers(req: web.Request) -> web.Response:
            body = await req.json()
            image = body.get("image")
            out = []
            for obj in body["layers"]:
                out.append(await self.register(LayerEntry.from_json(obj, "request"), image))
            mode = None
            if image and body.get("trace", True):
                mode = await self.start_trace_or_prefetch(image, [o["digest"] for o in body["layers"]])
            return web.json_response({"layers": out, "trace": mode})

        @routes.post("/prefetch")
        async def prefetch(req: web.Request) -> web.Response:
            body = await req.json()
            wanted: list[tuple[str, bytes]] = []
            for obj in body["layers"]:
                entry = LayerEntry.from_json(obj, "request")
                await self.register(entry, body.get("image"))
                layer = self.fs.layers[hex_digest(entry.digest)]
                wanted.extend((layer.digest, r.digest) for r in layer.records)
            fetched = await self.prefetch(wanted)
            return web.json_response({"chunks": len(wanted), "fetched": fetched})

        @routes.get("/stats")
        async def stats(_: web.Request) -> web.Response:
            return web.json_response(self.stats())

        @routes.get("/metrics")
        async def metrics(_: web.Request) -> web.Response:
            self.metrics.cache_bytes.set(self.cache.size)
            return web.Response(body=self.metrics.prometheus(), content_type="text/plain")

        @routes.post("/shutdown")
        async def shutdown(_: web.Request) -> web.Response:
            self.loop.call_later(0.05, request_exit, self.cfg)
            return web.json_response({"stopping": True})

        app.add_routes(routes)
        return app


def request_exit(cfg: DaemonConfig) -> None:
    """Make fusepy's loop return: unmount our FUSE file system (layers must be unmounted first)."""
    try:
        kmount.umount(cfg.fuse_dir, missing_ok=True)
    except Exception as exc:
        log.error("cannot unmount %s (still used by layer mounts?): %s", cfg.fuse_dir, exc)


def _clear_stale_fuse(path: Path) -> None:
    # a daemon that was killed leaves its mount point "not connected": detach it
    if kmount.is_mountpoint(path):
        kmount.umount(path, lazy=True, missing_ok=True)


def run(cfg: DaemonConfig) -> int:
    cfg.data_dir.mkdir(parents=True, exist_ok=True)
    # held for the daemon's life: a second daemon on this data dir would detach the first's
    # FUSE mount ("stale") and take its socket, and every layer registered with it would vanish
    lock = open(cfg.data_dir / "lazyfetch.lock", "a")  # noqa: SIM115 (held until exit)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.error("another lazyfetch daemon serves %s; not starting a second one", cfg.data_dir)
        lock.close()
        return EXIT_ALREADY_RUNNING
    try:
        return _serve(cfg)
    finally:
        lock.close()


def _serve(cfg: DaemonConfig) -> int:
    from fuse import FUSE

    _clear_stale_fuse(cfg.fuse_dir)  # before touching it: a dead FUSE mount fails stat()
    private_dirs(cfg.data_dir)  # before the store makes its cache there
    private_dir(cfg.fuse_dir)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="layerbox-loop", daemon=True)
    thread.start()

    def on_loop(coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    opts: dict[str, Any] = {"s3_endpoint": cfg.s3_endpoint} if cfg.s3_endpoint else {}
    store = on_loop(Store.open(cfg.store_url, cfg.data_dir, **opts))
    daemon = Daemon(cfg, loop, store)
    runner = web.AppRunner(daemon.app())
    on_loop(runner.setup())
    with contextlib.suppress(FileNotFoundError):
        cfg.socket.unlink()
    if cfg.socket.parent == cfg.data_dir:
        cfg.socket.parent.mkdir(parents=True, exist_ok=True)
    else:  # /run/layerbox: closed to others already while the socket waits for its chmod below
        private_dir(cfg.socket.parent)
    site = web.UnixSite(runner, str(cfg.socket))
    on_loop(site.start())
    os.chmod(cfg.socket, 0o600)
    log.info("lazyfetch daemon %s serving %s from %s", daemon.instance, cfg.fuse_dir, store.url)
    try:
        # allow_other: the kernel's EROFS mounts read the blobs for every sandbox's processes;
        # default_permissions: the kernel enforces the 0500/0400 modes, so only root opens a blob
        FUSE(daemon.fs, str(cfg.fuse_dir), foreground=True, nothreads=False, ro=True, allow_other=True,
             default_permissions=True,
             direct_io=True, max_read=131072, attr_timeout=86400, entry_timeout=86400,
             fsname="layerbox", subtype="layerbox")
    finally:
        log.info("lazyfetch daemon %s stopping", daemon.instance)
        with contextlib.suppress(Exception):
            on_loop(daemon.cancel_tasks(), 5)
        with contextlib.suppress(Exception):
            on_loop(runner.cleanup(), 5)
        with contextlib.suppress(Exception):
            on_loop(store.close(), 5)
        daemon.cache.close()
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
    a = p.parse_args(argv)
    return DaemonConfig(Path(a.data_dir), a.store, a.s3_endpoint, a.cache_size, a.fetch_timeout, a.trace_seconds)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    cfg.data_dir.mkdir(parents=True, exist_ok=True)
    log_file = cfg.data_dir / "lazyfetch.log"
    os.close(os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
    os.chmod(log_file, 0o600)  # (older daemons made it 0644: it names layers and paths of this host)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=[logging.FileHandler(log_file), logging.StreamHandler(sys.stderr)],
    )
    # libfuse turns SIGTERM/SIGINT into a clean unmount and return from the FUSE loop
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
