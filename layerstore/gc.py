"""Garbage collection: mark from every ref, sweep what nothing reaches.

Roots are the documents refs point at (and checkpoint documents, which are
refs too).  Marking follows documents to layers, layers to their metadata
images and chunk digests (from the images' blob maps), chunks to packs; the
access trace of a document or a layer lives as long as it does.
Sweeping deletes unreached objects older than the grace period, so an upload
in progress (whose objects nothing references yet) is never swept; the gc
lock additionally keeps publishers out while gc runs.  A pack with any live
chunk is kept whole; its dead bytes are reported.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from layerstore.backend import ObjectNotFound
from layerstore.erofs.reader import ErofsImage
from layerstore.errors import FormatError
from layerstore.locks import LOCK_TTL, prune_stale_locks, store_lock
from layerstore.packs import PACK_FOOTER, ChunkLocation, parse_footer, parse_index
from layerstore.reach import reach
from layerstore.store import Store

DEFAULT_GRACE = 3600.0
STALE_LOCK_AGE = 24 * 3600.0  # lock objects older than this are deleted (live ones are < LOCK_TTL)


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
    unreadable_packs: list[str] = field(default_factory=list)  # kept: their own index is unreadable
    disagreeing_index_copies: list[str] = field(default_factory=list)  # differ from their pack's index
    stale_locks: list[str] = field(default_factory=list)  # lock objects deleted (or, dry, to delete)
    leftovers: list[str] = field(default_factory=list)  # the backend's debris of interrupted writes
    dry_run: bool = False

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["deleted_count"] = len(self.deleted)
        return doc


async def _mark(store: Store, report: GcReport) -> tuple[set[str], set[str], set[bytes]]:
    roots = [ref.digest for ref in await store.list_refs()]
    report.roots = len(roots)
    reached = await reach(roots, store.get_doc)
    chunks: set[bytes] = set()
    for layer in reached.layers:
        image = ErofsImage(await store.get_meta(layer), layer)
        chunks.update(rec.digest for rec in image.blob_map)
    docs, layers = set(reached.docs), set(reached.layers)
    report.live_docs, report.live_layers, report.live_chunks = len(docs), len(layers), len(chunks)
    return docs, layers, chunks


async def _own_records(store: Store, key: str, size: int) -> list[tuple[bytes, ChunkLocation]] | None:
    """The records of the pack's own index (two ranged GETs), or None if it cannot be read."""
    try:
        count, index_at = parse_footer(await store.backend.get(key, size - PACK_FOOTER.size, size), size, key)
        index = await store.backend.get(key, index_at, size - PACK_FOOTER.size)
        return parse_index(index, bytes.fromhex(key.rsplit("/", 1)[-1]), key)
    except (FormatError, ObjectNotFound):
        return None


async def collect(store: Store, *, grace: float = DEFAULT_GRACE, dry_run: bool = False,
                  stale_locks_after: float = STALE_LOCK_AGE) -> GcReport:
    """Delete what no ref reaches and is older than ``grace`` seconds (see docs/FORMAT.md).

    Also removes leftovers: lock objects not refreshed for ``stale_locks_after``
    seconds (at least ``LOCK_TTL``) and the backend's debris of interrupted
    writes older than ``grace``.  A pack is deleted only when its own index
    (not just its index copy) shows no live chunk; a pack whose own index
    cannot be read is kept and named in ``unreadable_packs``.
    """
    if stale_locks_after < LOCK_TTL:
        raise ValueError(f"stale_locks_after must be at least LOCK_TTL ({LOCK_TTL:g} s)")
    report = GcReport(dry_run=dry_run)
    await store.check_layout()
    async with store_lock(store.backend, "gc") as own_lock:
        docs, layers, chunks = await _mark(store, report)
        now = time.time()
        doomed: list[tuple[str, int]] = []
        dead_packs: list[bytes] = []

        def consider(key: str, size: int, mtime: float) -> bool:
            if now - mtime < grace:
                report.kept_young += 1
                return False
            doomed.append((key, size))
            return True

        # an access trace only speeds up mounts of its document or layer: it goes when that does
        for prefix, live in (("docs/", docs), ("meta/", layers), ("traces/", docs | layers)):
            async for info in store.backend.list(prefix):
                if "blake3:" + info.key.rsplit("/", 1)[-1] not in live:
                    consider(info.key, info.size, info.mtime)
        pack_keys: set[str] = set()
        async for info in store.backend.list("packs/"):
            pack_hex = info.key.rsplit("/", 1)[-1]
            pack_keys.add(pack_hex)
            index_key = f"index/{pack_hex[:2]}/{pack_hex}"
            records: list[tuple[bytes, ChunkLocation]] | None
            try:
                records = parse_index(await store.backend.get(index_key), bytes.fromhex(pack_hex), index_key)
            except (ObjectNotFound, FormatError):
                records = None  # missing or damaged: the pack's own index decides below
            if records is not None and any(d in chunks for d, _ in records):
                _count_dead(report, records, chunks)
                continue
            if now - info.mtime < grace:
                report.kept_young += 1
                continue
            # About to delete: the copy is derived data and may be wrong, so the
            # pack's own index has the last word.
            own = await _own_records(store, info.key, info.size)
            if own is None:
                report.unreadable_packs.append(info.key)
                continue
            if records is not None and records != own:
                report.disagreeing_index_copies.append(index_key)
            if any(d in chunks for d, _ in own):
                _count_dead(report, own, chunks)
                continue
            consider(info.key, info.size, info.mtime)
            doomed.append((index_key, len(own) * 48))
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
        report.stale_locks = await prune_stale_locks(store.backend, stale_locks_after, keep=own_lock,
                                                     dry_run=dry_run)
        report.leftovers = await store.backend.sweep_leftovers(grace, dry_run=dry_run)
    return report


def _count_dead(report: GcReport, records: list[tuple[bytes, ChunkLocation]], chunks: set[bytes]) -> None:
    dead = sum(loc.length for d, loc in records if d not in chunks)
    if dead:
        report.partly_dead_packs += 1
        report.dead_bytes_in_live_packs += dead
