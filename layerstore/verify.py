"""Re-read stored objects and check every digest.

``verify`` without a ref checks the whole store: each pack's own hash and
framing, every chunk in it against its digest, every index copy against its
pack, every metadata image and document against its name.  With a ref it
checks just what that ref reaches.  Every bad object is reported by key;
nothing stops at the first problem.
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
    hex_digest,
    index_key,
    load_json,
    pack_key,
    resolve_document,
)
from layerstore.packs import decompress, split_pack
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


def _check_pack(key: str, data: bytes, wanted: set[bytes] | None) -> tuple[list[str], int]:
    pack_hex = key.rsplit("/", 1)[-1]
    problems = []
    if blake3.blake3(data).hexdigest() != pack_hex:
        problems.append(f"{key}: content does not hash to its name")
    try:
        _, records = split_pack(data, key)
    except LayerstoreError as exc:
        return problems + [str(exc)], 0
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
        checked += 1
    return problems, checked


async def verify(store: Store, ref: str | None = None) -> VerifyReport:
    report = VerifyReport()
    wanted: set[bytes] | None = None
    packs: list[str] = []
    if ref is None:
        async for info in store.backend.list("packs/"):
            packs.append(info.key)
        for prefix in ("docs/", "meta/"):
            async for info in store.backend.list(prefix):
                await _check_named(store, info.key, report)
    else:
        wanted = set()
        resolved = await store.resolve(ref, refresh=True)
        await _check_named(store, f"docs/{hex_digest(resolved.digest)[:2]}/{hex_digest(resolved.digest)}", report)
        pack_set: set[str] = set()
        for layer in resolved.layers:
            key = f"meta/{hex_digest(layer.digest)[:2]}/{hex_digest(layer.digest)}"
            image_bytes = await _check_named(store, key, report)
            if image_bytes is not None:
                wanted.update(rec.digest for rec in ErofsImage(image_bytes, key).blob_map)
            pack_set.update(layer.packs)
        packs = [pack_key(p) for p in sorted(pack_set)]
    for key in packs:
        try:
            data = await store.backend.get(key)
        except ObjectNotFound:
            report.problems.append(f"{key}: missing")
            continue
        problems, checked = await asyncio.to_thread(_check_pack, key, data, wanted)
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
    return report


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
