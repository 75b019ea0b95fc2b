"""Squash a checkpoint chain: the checkpoint layers above the base image become one layer.

The merge reads the layers' metadata images (no mounting) and applies
overlayfs's rules in order: a later entry replaces an earlier one, a later
directory merges with an earlier directory unless it is opaque, a whiteout
removes what lies below it and is itself kept (it still has to hide the
base image's file).  File data come from the store chunk by chunk; since every
chunk is already there, the new layer uploads only its metadata image.
"""

from __future__ import annotations

import asyncio
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from converters.layer import convert_entries
from converters.publish import LocalLayer, upload_layers
from converters.tarstream import (
    KIND_BLK,
    KIND_CHR,
    KIND_DIR,
    KIND_FIFO,
    KIND_HARDLINK,
    KIND_REG,
    KIND_SOCK,
    KIND_SYMLINK,
    Entry,
)
from layerstore.erofs.reader import ErofsImage, Inode
from layerstore.store import Store, UploadStats
from snapshots.errors import SnapshotError

OPAQUE = b"trusted.overlay.opaque"

_KINDS = ((stat.S_ISREG, KIND_REG), (stat.S_ISDIR, KIND_DIR), (stat.S_ISLNK, KIND_SYMLINK),
          (stat.S_ISCHR, KIND_CHR), (stat.S_ISBLK, KIND_BLK), (stat.S_ISFIFO, KIND_FIFO),
          (stat.S_ISSOCK, KIND_SOCK))


def _kind(mode: int) -> str:
    return next(kind for test, kind in _KINDS if test(mode))


def merge(images: list[ErofsImage]) -> dict[tuple[bytes, ...], tuple[int, Inode]]:
    """path -> (layer index, inode) of the merged view, whiteouts included."""
    merged: dict[tuple[bytes, ...], tuple[int, Inode]] = {}

    def drop_below(path: tuple[bytes, ...]) -> None:
        for key in [k for k in merged if len(k) > len(path) and k[: len(path)] == path]:
            del merged[key]

    for index, image in enumerate(images):
        for raw, node in image.walk():
            path = tuple(c for c in raw.split(b"/") if c)
            earlier = merged.get(path)
            if not stat.S_ISDIR(node.mode) or node.xattrs.get(OPAQUE) == b"y" or (
                    earlier is not None and not stat.S_ISDIR(earlier[1].mode)):
                drop_below(path)
            merged[path] = (index, node)
    return merged


async def squash(store: Store, ref: str, *, name: str | None = None) -> dict[str, Any]:
    resolved = await store.resolve(ref, refresh=True)
    if resolved.kind != "checkpoint":
        raise SnapshotError(f"{ref} is a {resolved.kind}, not a checkpoint")
    base = await store.resolve(resolved.doc["base"])
    ours = resolved.layers[len(base.layers):]
    if [x.digest for x in resolved.layers[: len(base.layers)]] != [x.digest for x in base.layers]:
        raise SnapshotError(f"{ref}: its layers do not start with its base image's layers")
    if len(ours) < 2:
        return {"name": ref, "digest": resolved.digest, "squashed": len(ours)}
    images = [ErofsImage(await store.get_meta(layer.digest), layer.digest) for layer in ours]
    for layer in ours:
        await store.load_layer_locations(layer)
    merged = merge(images)
    loop = asyncio.get_running_loop()

    def reader(image: ErofsImage, node: Inode) -> Callable[[], Iterator[bytes]]:
        def read() -> Iterator[bytes]:
            for chunk in image.chunks(node.nid):
                if chunk.hole or chunk.digest is None:
                    yield bytes(chunk.length)
                else:
                    yield asyncio.run_coroutine_threadsafe(store.read_chunk(chunk.digest), loop).result()
        return read

    def entries() -> Iterator[tuple[Entry, Any]]:
        first_path: dict[tuple[int, int], tuple[bytes, ...]] = {}
        for path in sorted(merged):
            index, node = merged[path]
            image = images[index]
            kind = _kind(node.mode)
            entry = Entry(path=path, kind=kind, mode=node.mode, uid=node.uid, gid=node.gid, mtime=node.mtime,
                          mtime_nsec=node.mtime_nsec, size=node.size if kind == KIND_REG else 0,
                          rdev=node.rdev, xattrs=dict(node.xattrs), name=b"/".join(path).decode(errors="replace"))
            key = (index, node.nid)
            if kind != KIND_DIR and key in first_path:
                entry.kind, entry.link_path = KIND_HARDLINK, first_path[key]
                yield entry, None
                continue
            first_path[key] = path
            if kind == KIND_SYMLINK:
                entry.link = image.readlink(node.nid)
            yield entry, (reader(image, node) if kind == KIND_REG and node.size else None)

    # shared with publishes, exclusive with gc: nothing this squash reuses can go meanwhile
    async with store.writer_lock("squash"):
        with tempfile.TemporaryDirectory(prefix="squash-") as tmp:
            meta, blob = Path(tmp) / "layer.erofs", Path(tmp) / "layer.blob"
            chunk_size = max(layer.chunk_size for layer in ours) or 1 << 20
            await asyncio.to_thread(convert_entries, entries(), meta, blob, chunk_size=chunk_size, oci_whiteouts=False)
            stats = UploadStats()
            (layer,) = await upload_layers(store, [LocalLayer(meta, blob, {"squashed": [x.digest for x in ours]})],
                                           stats, chunk_size=chunk_size)
        doc = dict(resolved.doc)
        layers = [*base.layers, layer]
        doc["layers"] = [x.to_json() for x in layers]
        doc["bound"] = {**doc.get("bound", {}), "layer_digests": [x.digest for x in layers]}
        doc["parent"] = base.digest
        doc["parent_kind"] = base.kind
        doc["squashed_from"] = resolved.digest
        digest = await store.put_doc(doc, stats)
        target = name or ref
        await store.set_ref(target, digest, "checkpoint")
    return {"name": target, "digest": digest, "squashed": len(ours), "bytes_uploaded": stats.bytes_uploaded}
