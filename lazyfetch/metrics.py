"""The daemon's counters, exported as Prometheus text and as JSON for ``layerbox stats``.

docs/STATS.md defines every counter.  The fetch counters are kept by one
method each (:meth:`Metrics.fetched` for a GET's body, :meth:`Metrics.verified`
for a chunk decoded from it), which adds to the total and to the layer the
fetch is attributed to in one step under one lock, so a snapshot's totals
always equal the sums of their per-layer breakdowns.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


@dataclass
class LayerFetched:
    """What the store delivered for fetches attributed to one layer, and what its readers saw."""

    bytes_fetched: int = 0  # GET body bytes (compressed frames)
    bytes_fetched_uncompressed: int = 0  # the verified chunks decoded from them
    events_served: int = 0  # kernel reads of its blob answered (FUSE READs, fanotify events)
    store_wait_seconds: float = 0.0  # time those reads spent waiting for the store


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.hits = Counter("layerbox_chunk_hits", "chunk reads served from the local cache", registry=r)
        self.misses = Counter("layerbox_chunk_misses", "chunk reads that waited for the store",
                              registry=r)
        self.bytes_fetched = Counter("layerbox_store_bytes_fetched",
                                     "body bytes of chunk GETs from the store (compressed frames)", registry=r)
        self.bytes_fetched_uncompressed = Counter(
            "layerbox_store_bytes_fetched_uncompressed",
            "uncompressed bytes of the verified chunks the store delivered", registry=r)
        self.bytes_served = Counter("layerbox_bytes_served", "blob bytes returned to the kernel", registry=r)
        self.requests = Counter("layerbox_store_requests", "ranged GETs of chunk data sent to the store",
                                registry=r)
        self.chunks_fetched = Counter("layerbox_chunks_fetched", "chunks fetched and verified", registry=r)
        self.corrupt = Counter("layerbox_chunks_corrupt", "chunks refused: digest mismatch", registry=r)
        self.cache_put_failures = Counter("layerbox_cache_put_failures",
                                          "verified chunks the blob files' disk refused",
                                          registry=r)
        self.read_errors = Counter("layerbox_read_errors", "kernel reads answered with EIO", registry=r)
        self.layers_filled = Counter("layerbox_layers_filled",
                                     "layers the background fill completed", registry=r)
        self.prefetched = Counter("layerbox_chunks_prefetched",
                                  "chunks fetched and verified for a prefetch or the background fill",
                                  registry=r)
        self.inflight = Gauge("layerbox_fetches_in_flight", "chunks being fetched now", registry=r)
        self.cache_bytes = Gauge("layerbox_cache_bytes", "bytes of chunks in the local blob files", registry=r)
        self.fetch_seconds = Histogram(
            "layerbox_fetch_seconds", "latency of one ranged GET with decode", registry=r,
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30),
        )
        self._lock = threading.Lock()
        self._per_layer: dict[str, LayerFetched] = {}

    # -- the fetch counters: a total and its layer, together ----------------------------
    def _layer_locked(self, layer: str) -> LayerFetched:
        found = self._per_layer.get(layer)
        if found is None:
            found = self._per_layer[layer] = LayerFetched()
        return found

    def requested(self) -> None:
        """One ranged GET of chunk data is about to be sent."""
        with self._lock:
            self.requests.inc()

    def fetched(self, layer: str, body_bytes: int) -> None:
        """A GET's body arrived (``body_bytes`` compressed bytes, however many it should have had)."""
        with self._lock:
            self.bytes_fetched.inc(body_bytes)
            self._layer_locked(layer).bytes_fetched += body_bytes

    def verified(self, layer: str, raw_bytes: int, *, prefetch: bool) -> None:
        """A chunk of ``raw_bytes`` decoded from a GET's body matched its digest."""
        with self._lock:
            self.chunks_fetched.inc()
            if prefetch:
                self.prefetched.inc()
            self.bytes_fetched_uncompressed.inc(raw_bytes)
            self._layer_locked(layer).bytes_fetched_uncompressed += raw_bytes

    def served(self, layer: str, events: int) -> None:
        """``events`` kernel reads of the layer's blob were answered (allowed, or EIO)."""
        with self._lock:
            self._layer_locked(layer).events_served += events

    def waited(self, layer: str, seconds: float) -> None:
        """A read of the layer waited ``seconds`` for chunks from the store (or for its timeout)."""
        with self._lock:
            self._layer_locked(layer).store_wait_seconds += seconds

    # -- exports ------------------------------------------------------------------------
    def prometheus(self) -> bytes:
        return generate_latest(self.registry)

    def snapshot(self, layers: dict[str, set[str]] | None = None) -> dict[str, Any]:
        """Every counter; ``layers`` (layer -> images using it) adds the layers nothing was
        fetched for yet (as zeros) and the per-image sums."""
        def value(c: Counter | Gauge) -> float:
            return next(iter(c.collect())).samples[0].value

        with self._lock:  # no fetch counter moves while we read them
            hist = next(iter(self.fetch_seconds.collect())).samples
            count = next(s.value for s in hist if s.name.endswith("_count"))
            total = next(s.value for s in hist if s.name.endswith("_sum"))
            per_layer = {layer: LayerFetched() for layer in layers or {}}
            per_layer.update({k: LayerFetched(v.bytes_fetched, v.bytes_fetched_uncompressed, v.events_served,
                                              v.store_wait_seconds)
                              for k, v in self._per_layer.items()})
            snap: dict[str, Any] = {
                "hits": int(value(self.hits)), "misses": int(value(self.misses)),
                "bytes_fetched": int(value(self.bytes_fetched)),
                "bytes_fetched_uncompressed": int(value(self.bytes_fetched_uncompressed)),
                "bytes_served": int(value(self.bytes_served)),
                "store_requests": int(value(self.requests)),
                "chunks_fetched": int(value(self.chunks_fetched)),
                "chunks_corrupt": int(value(self.corrupt)),
                "cache_put_failures": int(value(self.cache_put_failures)),
                "read_errors": int(value(self.read_errors)), "chunks_prefetched": int(value(self.prefetched)),
                "layers_filled": int(value(self.layers_filled)),
                "fetches_in_flight": int(value(self.inflight)), "cache_bytes": int(value(self.cache_bytes)),
                "fetch_count": int(count), "fetch_seconds_total": round(total, 6),
            }
        per_image: dict[str, int] = {}
        for layer, images in (layers or {}).items():
            for image in images:
                per_image[image] = per_image.get(image, 0) + per_layer[layer].bytes_fetched
        snap["bytes_fetched_per_layer"] = {k: v.bytes_fetched for k, v in per_layer.items()}
        snap["bytes_fetched_uncompressed_per_layer"] = {k: v.bytes_fetched_uncompressed
                                                         for k, v in per_layer.items()}
        snap["bytes_fetched_per_image"] = per_image
        snap["events_served_per_layer"] = {k: v.events_served for k, v in per_layer.items()}
        snap["store_wait_seconds_per_layer"] = {k: round(v.store_wait_seconds, 6) for k, v in per_layer.items()}
        return snap
