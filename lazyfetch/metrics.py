"""The daemon's counters, exported as Prometheus text and as JSON for ``layerbox stats``."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.hits = Counter("layerbox_chunk_hits", "chunk reads served from the local cache", registry=r)
        self.misses = Counter("layerbox_chunk_misses", "chunk reads that needed the store", registry=r)
        self.bytes_fetched = Counter("layerbox_store_bytes_fetched", "compressed bytes read from the store",
                                     registry=r)
        self.bytes_served = Counter("layerbox_bytes_served", "blob bytes returned to the kernel", registry=r)
        self.requests = Counter("layerbox_store_requests", "ranged GETs sent to the store", registry=r)
        self.chunks_fetched = Counter("layerbox_chunks_fetched", "chunks fetched and verified", registry=r)
        self.corrupt = Counter("layerbox_chunks_corrupt", "chunks refused: digest mismatch", registry=r)
        self.cache_put_failures = Counter("layerbox_cache_put_failures",
                                          "chunks served from memory because the cache disk refused them",
                                          registry=r)
        self.read_errors = Counter("layerbox_read_errors", "FUSE reads answered with EIO", registry=r)
        self.prefetched = Counter("layerbox_chunks_prefetched", "chunks fetched ahead of reads", registry=r)
        self.inflight = Gauge("layerbox_fetches_in_flight", "chunks being fetched now", registry=r)
        self.cache_bytes = Gauge("layerbox_cache_bytes", "bytes in the local chunk cache", registry=r)
        self.fetch_seconds = Histogram(
            "layerbox_fetch_seconds", "latency of one ranged GET with decode", registry=r,
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30),
        )
        self.per_layer_fetched: dict[str, int] = {}

    def prometheus(self) -> bytes:
        return generate_latest(self.registry)

    def snapshot(self) -> dict[str, Any]:
        def value(c: Counter | Gauge) -> float:
            return next(iter(c.collect())).samples[0].value

        hist = next(iter(self.fetch_seconds.collect())).samples
        count = next(s.value for s in hist if s.name.endswith("_count"))
        total = next(s.value for s in hist if s.name.endswith("_sum"))
        return {
            "hits": int(value(self.hits)), "misses": int(value(self.misses)),
            "bytes_fetched": int(value(self.bytes_fetched)), "bytes_served": int(value(self.bytes_served)),
            "store_requests": int(value(self.requests)), "chunks_fetched": int(value(self.chunks_fetched)),
            "chunks_corrupt": int(value(self.corrupt)), "cache_put_failures": int(value(self.cache_put_failures)),
            "read_errors": int(value(self.read_errors)), "chunks_prefetched": int(value(self.prefetched)),
            "fetches_in_flight": int(value(self.inflight)), "cache_bytes": int(value(self.cache_bytes)),
            "fetch_count": int(count), "fetch_seconds_total": round(total, 6),
            "bytes_fetched_per_layer": dict(self.per_layer_fetched),
        }
