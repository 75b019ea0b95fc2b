"""Garbage collection: mark from every ref, sweep what nothing reaches.

Roots are the documents refs point at (and checkpoint documents, which are
refs too).  Marking follows documents to layers, layers to their metadata
images and chunk digests (from the images' blob maps), chunks to packs.
Sweeping deletes unreached objects older than the grace period, so an upload
in progress (whose objects nothing references yet) is never swept; the gc
lock additionally keeps publishers out while gc runs.  A pack with any live
chunk is kept whole; its dead bytes are reported.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from layerstore.erofs.reader import ErofsImage
from layerstore.errors import FormatError
from layerstore.locks import store_lock
from layerstore.objects import doc_references, hex_digest, resolve_document
from layerstore.packs import parse_index, split_pack
from layerstore.store import Store

DEFAULT_GRACE = 3600.0


@dataclass
class GcReport:
    roots: int = 0
    live_docs: int = 0
    live_layers: int = 0
    live_chunks: int = 0
    deleted: list[str] = field(default_factory=list)
    deleted_bytes: int = 0
    kept_young: int = 0  # unreferenced but inside the grace period
    partly_dead_packs: int = 0
    dead_bytes_in_live_packs: int = 0
    dry_run: bool = False

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["deleted_count"] = len(self.deleted)
        return doc


async def _mark(store: Store, report: GcReport) -> tuple[set[str], set[str], set[bytes]]:
    docs: set[str] = set()
    layers: set[str] = set()
    chunks: set[bytes] = set()
    pending = [ref.digest for ref in await store.list_refs()]
    report.roots = len(pending)
    while pending:
        digest = "blake3:" + hex_digest(pending.pop())
        if digest in docs:
            continue
        docs.add(digest)
        doc = await store.get_doc(digest)
        resolved = resolve_document(digest, doc)
        pending.extend(doc_references(doc))
        for layer in resolved.layers:
            if layer.digest in layers:
                continue
            layers.add(layer.digest)
            image = ErofsImage(await store.get_meta(layer.digest), layer.digest)
            chunks.update(rec.digest for rec in image.blob_map)
    report.live_docs, report.live_layers, report.live_chunks = len(docs), len(layers), len(chunks)
    return docs, layers, chunks


async def collect(store: Store, *, grace: float = DEFAULT_GRACE, dry_run: bool = False) -> GcReport:
    report = GcReport(dry_run=dry_run)
    async with store_lock(store.backend, "gc"):
        docs, layers, chunks = await _mark(store, report)
        now = time.time()
        doomed: list[tuple[str, int]] = []
        dead_packs: list[bytes] = []

        def consider(key: str, size: int, mtime: float) -> None:
            if now - mtime < grace:
                report.kept_young += 1
            else:
                doomed.append((key, size))

        async for info in store.backend.list("docs/"):
            if "blake3:" + info.key.rsplit("/", 1)[-1] not in docs:
                consider(info.key, info.size, info.mtime)
        async for info in store.backend.list("meta/"):
            if "blake3:" + info.key.rsplit("/", 1)[-1] not in layers:
                consider(info.key, info.size, info.mtime)
        pack_keys: set[str] = set()
        async for info in store.backend.list("packs/"):
            pack_hex = info.key.rsplit("/", 1)[-1]
            pack_keys.add(pack_hex)
            index_key = f"index/{pack_hex[:2]}/{pack_hex}"
            try:
                records = parse_index(await store.backend.get(index_key), bytes.fromhex(pack_hex), index_key)
            except (FileNotFoundError, FormatError):
                # the copy is derived data: the pack's own index decides
                try:
                    _, records = split_pack(await store.backend.get(info.key), info.key)
                except FormatError:
                    records = []  # not a readable pack: nothing can reach its chunks
            live = [loc for d, loc in records if d in chunks]
            if live:
                dead = sum(loc.length for d, loc in records if d not in chunks)
                if dead:
                    report.partly_dead_packs += 1
                    report.dead_bytes_in_live_packs += dead
                continue
            before = len(doomed)
            consider(info.key, info.size, info.mtime)
            if len(doomed) > before:
                doomed.append((index_key, len(records) * 48))
                dead_packs.append(bytes.fromhex(pack_hex))
        async for info in store.backend.list("index/"):
            # copies left behind by an interrupted gc, whose pack is already gone
            if info.key.rsplit("/", 1)[-1] not in pack_keys:
                consider(info.key, info.size, info.mtime)
        report.deleted = [key for key, _ in doomed]
        report.deleted_bytes = sum(size for _, size in doomed)
        if not dry_run:
            # index copies before their packs: once a copy is gone no host dedups
            # against the pack (Store.sync_index forgets it), and a crash in
            # between leaves a pack without a copy, which the next run sweeps
            for key, _ in sorted(doomed, key=lambda d: not d[0].startswith("index/")):
                await store.backend.delete(key)
            store.cache.forget_packs(dead_packs)
    return report
