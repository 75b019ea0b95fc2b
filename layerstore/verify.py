"""Re-read stored objects and check every digest.

``verify`` without a ref checks the whole store: each pack's own hash and
framing, every chunk in it against its digest, every index copy against its
pack (and index copies whose pack is gone), every metadata image and
document against its name, and that every ref names an existing document.
With a ref it checks just what that ref reaches: the documents it keeps alive
(a composition's parts, a checkpoint's parents and attachments, a run's
checkpoints), their layers' metadata images, and that every chunk of every
blob map is in one of the packs its layer entry names.  Every bad object is
reported by key; nothing stops at the first problem.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from typing import Any

import blake3

from layerstore.backend import ObjectNotFound
from layerstore.erofs.reader import ErofsImage
from layerstore.errors import LayerstoreError
from layerstore.objects import (
    digest_of,
    doc_key,
    index_key,
    load_json,
    meta_key,
    pack_key,
    resolve_document,
)
from layerstore.packs import decompress, split_pack
from layerstore.reach import reach
from layerstore.store import Store


@dataclass
class VerifyReport:
    checked: int = 0
    chunks: int = 0
    bytes: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["ok"] = self.ok
        return doc


def check_pack(key: str, data: bytes, wanted: set[bytes] | None) -> tuple[list[str], int, set[bytes]]:
    """Problems, chunks checked, and the digests of the sound chunks found."""
    pack_hex = key.rsplit("/", 1)[-1]
    problems = []
    found: set[bytes] = set()
    if blake3.blake3(data).hexdigest() != pack_hex:
        problems.append(f"{key}: content does not hash to its name")
    try:
        _, records = split_pack(data, key)
    except LayerstoreError as exc:
        return problems + [str(exc)], 0, found
    checked = 0
    for digest, loc in records:
        if wanted is not None and digest not in wanted:
            continue
        frame = data[loc.offset : loc.offset + loc.length]
        try:
            chunk = decompress(frame, loc.raw_length)
        except Exception as exc:
            problems.append(f"{key}: chunk {digest.hex()} at {loc.offset}: undecodable ({exc})")
            continue
        if blake3.blake3(chunk).digest() != digest:
            problems.append(f"{key}: chunk {digest.hex()} at {loc.offset}: content does not match its digest")
        else:
            found.add(digest)
        checked += 1
    return problems, checked, found


async def verify(store: Store, ref: str | None = None) -> VerifyReport:
    report = VerifyReport()
    wanted: set[bytes] | None = None
    packs: list[str] = []
    # chunk digest -> the layers whose blob map needs it (with a ref)
    needed_by: dict[bytes, set[str]] = {}
    if ref is None:
        async for info in store.backend.list("packs/"):
            packs.append(info.key)
        for prefix in ("docs/", "meta/"):
            async for info in store.backend.list(prefix):
                await _check_named(store, info.key, report)
        await _check_refs(store, report)
        have = {key.rsplit("/", 1)[-1] for key in packs}
        async for info in store.backend.list("index/"):
            if info.key.rsplit("/", 1)[-1] not in have:
                report.problems.append(f"{info.key}: index copy of a pack that is not in the store "
                                       "(gc removes it; until then hosts may load it)")
    else:
        wanted = set()
        resolved = await store.resolve(ref, refresh=True)
        pack_set: set[str] = set()

        async def load(digest: str) -> dict[str, Any] | None:
            """The document if it is sound; its problems reported otherwise."""
            doc_bytes = await _check_named(store, doc_key(digest), report)
            if doc_bytes is None:
                return None
            doc = load_json(doc_bytes, doc_key(digest))
            try:
                resolve_document(digest, doc)
            except LayerstoreError:
                return None  # reported by _check_named
            return doc

        # every document the ref keeps alive, and every layer of those
        for layer in (await reach([resolved.digest], load)).layers.values():
            key = meta_key(layer.digest)
            image_bytes = await _check_named(store, key, report)
            if image_bytes is not None:
                for rec in ErofsImage(image_bytes, key).blob_map:
                    wanted.add(rec.digest)
                    needed_by.setdefault(rec.digest, set()).add(layer.digest)
            pack_set.update(layer.packs)
        packs = [pack_key(p) for p in sorted(pack_set)]
    found: set[bytes] = set()
    for key in packs:
        try:
            data = await store.backend.get(key)
        except ObjectNotFound:
            report.problems.append(f"{key}: missing")
            continue
        problems, checked, sound = await asyncio.to_thread(check_pack, key, data, wanted)
        found |= sound
        report.problems.extend(problems)
        report.chunks += checked
        report.checked += 1
        report.bytes += len(data)
        pack_hex = key.rsplit("/", 1)[-1]
        try:
            index = await store.backend.get(index_key(pack_hex))
            if not problems and index != split_pack(data, key)[0]:
                report.problems.append(f"{index_key(pack_hex)}: differs from the index inside {key}")
        except ObjectNotFound:
            report.problems.append(f"{index_key(pack_hex)}: missing (chunks in {key} cannot be located)")
    if wanted is not None:
        # a chunk the blob map needs but no named pack holds soundly: reads of it will fail
        absent = sorted(wanted - found)
        for chunk in absent[:20]:
            report.problems.append(f"chunk {chunk.hex()} of layer {sorted(needed_by[chunk])[0]}: in none of the "
                                   "packs its layer entry names (or only damaged there)")
        if len(absent) > 20:
            report.problems.append(f"... and {len(absent) - 20} more chunks in none of their packs")
    return report


async def _check_refs(store: Store, report: VerifyReport) -> None:
    """Every ref names a document that is in the store."""
    async for info in store.backend.list("refs/"):
        try:
            state = await store.read_ref(info.key.removeprefix("refs/"))
        except ObjectNotFound:
            continue  # deleted while listing
        except LayerstoreError as exc:
            report.problems.append(f"{info.key}: {exc}")
            continue
        if await store.backend.head(doc_key(state.digest)) is None:
            report.problems.append(f"{info.key}: points at {state.digest}, which is not in the store")


async def _check_named(store: Store, key: str, report: VerifyReport) -> bytes | None:
    """Documents hash to their name as stored; metadata images after decompression."""
    want = "blake3:" + key.rsplit("/", 1)[-1]
    try:
        data = await store.backend.get(key)
    except ObjectNotFound:
        report.problems.append(f"{key}: missing")
        return None
    report.checked += 1
    report.bytes += len(data)
    if key.startswith("meta/"):
        try:
            data = await asyncio.to_thread(decompress, data, 1 << 31)
        except Exception as exc:
            report.problems.append(f"{key}: undecodable zstd data ({exc})")
            return None
    if digest_of(data) != want:
        report.problems.append(f"{key}: content does not hash to its name")
        return None
    if key.startswith("docs/"):
        try:
            resolve_document(want, load_json(data, key))
        except LayerstoreError as exc:
            report.problems.append(f"{key}: {exc}")
    return data
