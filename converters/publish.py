"""Publish a source (directory, tarball, OCI image, registry image) into a store.

Conversion happens in a private temporary directory; chunks then go to the
store in packs, followed by metadata images, the image document and last the
ref (layerstore/store.py explains why that order makes a crash harmless).
Re-running an interrupted publish converts again but uploads only what the
store does not have: chunks are found in the store's pack index, packs and
documents are content-addressed.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from converters.layer import DEFAULT_CHUNK_SIZE, convert
from converters.oci import convert_image
from layerstore.erofs import format as F
from layerstore.erofs.reader import ErofsImage
from layerstore.objects import ImageDoc, LayerEntry
from layerstore.store import ChunkUploader, Progress, RefNotFound, Store, UploadStats

IMAGE_SCHEMES = ("oci:", "oci-archive:", "docker-archive:", "docker://")
# keys of an image layer's LayerEntry.source: the OCI diff id and chain id, "sha256:<64 hex>"
LAYER_SOURCE_DIFF_ID = "diff_id"
LAYER_SOURCE_CHAIN_ID = "chain_id"
WORK_PREFIX = "publish-"
OWNER_FILE = "owner"  # in a publish's work directory; flock'ed while the publish runs


@contextlib.contextmanager
def _work_dir(work_dir: str | os.PathLike[str] | None) -> Iterator[Path]:
    """A private ``publish-*/work`` directory, its ``owner`` file locked until it is removed.

    The owner file gets its name only once locked, and the directory is
    removed before the lock is released, so ``sweep_work_dirs`` can never
    take a live publish's directory.
    """
    tmp = Path(tempfile.mkdtemp(prefix=WORK_PREFIX, dir=work_dir))
    fd = -1
    try:
        fd = os.open(tmp / ".owner", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, f"{os.getpid()} {socket.gethostname()} {time.time():.0f}\n".encode())
        os.rename(tmp / ".owner", tmp / OWNER_FILE)
        work = tmp / "work"
        work.mkdir()
        yield work
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if fd >= 0:
            os.close(fd)


def sweep_work_dirs(work_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """Remove the work directories of publishes that were killed; returns their paths.

    Each publish converts inside ``<work_dir>/publish-*/work`` and holds
    ``flock`` on ``publish-*/owner`` until it ends, so a directory whose owner
    file can be locked belongs to a dead process (also one in another PID
    namespace on this host).  Directories without an owner file (a publish
    that died before locking it, or an older layerbox) are left alone.
    """
    base = Path(work_dir) if work_dir is not None else Path(tempfile.gettempdir())
    removed = []
    for path in sorted(base.glob(WORK_PREFIX + "*")):
        try:
            fd = os.open(path / OWNER_FILE, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue  # not ours, not yet locked, or already gone
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its publish is running
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
        finally:
            os.close(fd)
    return removed


@dataclass(frozen=True)
class PublishResult:
    name: str
    digest: str
    layers: int
    files: int
    bytes: int  # regular-file bytes in the image
    chunks_new: int
    chunks_present: int
    bytes_new: int  # uncompressed chunk bytes the store did not have
    bytes_present: int  # uncompressed chunk bytes already in the store
    bytes_uploaded: int  # compressed bytes sent
    requests: int
    convert_seconds: float
    upload_seconds: float
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# The OCI index of a store (docs/FORMAT.md "OCI indexes"): one ref per chain id and one per
# layer (compressed blob) digest, each naming an image document of the stack up to that layer.
# containerd asks for layers by chain id (the unpacker) and, from the CRI plugin, by layer digest.
CHAIN_REFS = "oci/chains"
LAYER_REFS = "oci/layers"
_OCI_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


def chain_ref(chain_id: str) -> str:
    """The ref of chain id ``sha256:<hex>`` (``ValueError`` for anything else: never a path)."""
    if not _OCI_DIGEST.match(chain_id):
        raise ValueError(f"chain id {chain_id[:80]!r}: not sha256:<64 hex>")
    return f"{CHAIN_REFS}/sha256/{chain_id[7:]}"


def layer_ref(digest: str) -> str:
    if not _OCI_DIGEST.match(digest):
        raise ValueError(f"layer digest {digest[:80]!r}: not sha256:<64 hex>")
    return f"{LAYER_REFS}/sha256/{digest[7:]}"


def oci_ids(entry: LayerEntry) -> dict[str, str]:
    """A layer entry's OCI identities (``digest``, ``diff_id``, ``chain_id``), as far as known."""
    source = entry.source or {}
    nested = source.get("oci")
    oci: Mapping[str, Any] = nested if isinstance(nested, dict) else {}
    out = {}
    for key in ("digest", "diff_id", "chain_id"):
        value = oci.get(key) or (source.get(key) if key != "digest" else None)
        if isinstance(value, str) and _OCI_DIGEST.match(value):
            out[key] = value
    return out


async def publish_oci_index(store: Store, entries: list[LayerEntry], stats: UploadStats | None = None
                            ) -> list[str]:
    """Ref every prefix of ``entries`` (base first) by its top layer's chain id and layer digest.

    Only layers whose chain id is known (an OCI image's, whose diff ids the
    conversion verified) are indexed; the first one without stops it, since
    everything above depends on it.  Call with the writer lock held, after the
    layers' objects are stored; returns the refs set.
    """
    made = []
    for i, entry in enumerate(entries):
        ids = oci_ids(entry)
        if "chain_id" not in ids:
            break
        source = {"type": "oci-chain", "chain_id": ids["chain_id"], "diff_id": ids.get("diff_id")}
        digest = await store.put_doc(ImageDoc(tuple(entries[: i + 1]), {}, source).to_json(), stats)
        names = [chain_ref(ids["chain_id"])] + ([layer_ref(ids["digest"])] if "digest" in ids else [])
        for name in names:
            try:
                current = (await store.read_ref(name)).digest
            except RefNotFound:
                current = None
            if current != digest:  # a re-publish of the same stack moves nothing
                await store.set_ref(name, digest, "image", stats=stats)
            made.append(name)
    return made


@dataclass
class LocalLayer:
    meta: Path
    blob: Path
    source: dict[str, Any]


def _image_layer_source(oci: dict[str, Any]) -> dict[str, Any]:
    """A store layer entry's ``source`` for an image layer: its OCI descriptor, and its
    ``diff_id`` and ``chain_id`` at the top level, where a containerd snapshotter looks
    layers up (``LAYER_SOURCE_DIFF_ID``, ``LAYER_SOURCE_CHAIN_ID``)."""
    return {"oci": oci, LAYER_SOURCE_DIFF_ID: oci["diff_id"], LAYER_SOURCE_CHAIN_ID: oci["chain_id"]}


def _convert_source(src: str, work: Path, chunk_size: int, platform: str | None
                    ) -> tuple[list[LocalLayer], dict[str, Any], dict[str, Any]]:
    if src.startswith(IMAGE_SCHEMES):
        convert_image(src, work, chunk_size=chunk_size, platform=platform)
        doc = json.loads((work / "image.json").read_text())
        layers = [LocalLayer(work / layer["meta"], work / layer["blob"], _image_layer_source(layer["oci"]))
                  for layer in doc["layers"]]
        return layers, doc.get("config") or {}, {"ref": src, **(doc.get("source") or {})}
    meta, blob = work / "layer.erofs", work / "layer.blob"
    convert(src, meta, blob, chunk_size=chunk_size)
    kind = "directory" if os.path.isdir(src) else ("stdin" if src == "-" else "tarball")
    return [LocalLayer(meta, blob, {})], {}, {"ref": src if src == "-" else os.path.abspath(src), "type": kind}


async def upload_layers(store: Store, layers: list[LocalLayer], stats: UploadStats, *,
                        chunk_size: int = DEFAULT_CHUNK_SIZE, progress: Progress | None = None) -> list[LayerEntry]:
    """Upload converted layers (chunks, then metadata images); returns their entries.

    The caller writes the document that names them and then moves a ref: that
    order keeps a crash from leaving anything pointing at missing data.
    """
    uploader = ChunkUploader(store, stats, progress=progress)
    images: list[tuple[bytes, ErofsImage]] = []
    for layer in layers:
        raw = layer.meta.read_bytes()
        image = ErofsImage(raw, str(layer.meta))
        images.append((raw, image))
        fd = os.open(layer.blob, os.O_RDONLY)
        try:
            await uploader.add_many(
                (rec.digest, partial(os.pread, fd, rec.length, rec.block * F.BLOCK_SIZE))
                for rec in image.blob_map
            )
            await uploader.finish()  # the reads use fd
        finally:
            os.close(fd)
    entries = []
    for layer, (raw, image) in zip(layers, images, strict=True):
        digest = await store.put_meta(raw, stats)
        inodes = {node.nid: node for _, node in image.walk()}
        entries.append(LayerEntry(
            digest=digest,
            packs=uploader.packs_for(rec.digest for rec in image.blob_map),
            meta_size=len(raw),
            blob_size=image.blob_size,
            chunk_size=1 << image.chunk_bits_hint if image.chunk_bits_hint else chunk_size,
            files=len(inodes),
            bytes=sum(n.size for n in inodes.values() if stat.S_ISREG(n.mode)),
            chunks=len(image.blob_map),
            source=layer.source,
        ))
    return entries


async def publish(
    store: Store,
    src: str,
    name: str,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    platform: str | None = None,
    work_dir: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
    before_ref: Callable[[], None] | None = None,
) -> PublishResult:
    """Convert ``src`` and publish it as ``name`` (``repo[:tag]``).

    ``before_ref`` is a test hook run after every object is stored and before
    the ref moves (the commit point).
    """
    start = time.perf_counter()
    stats = UploadStats()
    await asyncio.to_thread(sweep_work_dirs, work_dir)
    async with store.writer_lock("publish"):
        await store.sync_index()
        with _work_dir(work_dir) as work:
            layers, config, source = await asyncio.to_thread(_convert_source, src, work, chunk_size, platform)
            converted = time.perf_counter()
            entries = await upload_layers(store, layers, stats, chunk_size=chunk_size, progress=progress)
        doc_digest = await store.put_doc(ImageDoc(tuple(entries), config, source).to_json(), stats)
        if before_ref is not None:
            before_ref()
        ref = await store.set_ref(name, doc_digest, "image", stats=stats)
        await publish_oci_index(store, entries, stats)
    end = time.perf_counter()
    return PublishResult(
        name=ref.name, digest=doc_digest, layers=len(entries), files=sum(e.files for e in entries),
        bytes=sum(e.bytes for e in entries), chunks_new=stats.chunks_new, chunks_present=stats.chunks_present,
        bytes_new=stats.bytes_new_raw, bytes_present=stats.bytes_present, bytes_uploaded=stats.bytes_uploaded,
        requests=stats.requests, convert_seconds=round(converted - start, 3),
        upload_seconds=round(end - converted, 3), seconds=round(end - start, 3),
    )


def publish_sync(src: str, name: str, *, store: str | None = None,
                 data_dir: str | os.PathLike[str] | None = None, **options: Any) -> PublishResult:
    """``publish`` for callers without an event loop."""

    async def run() -> PublishResult:
        async with await Store.open(store, data_dir) as s:
            return await publish(s, src, name, **options)

    return asyncio.run(run())
