"""VM memory snapshots in the store: a saved VM's RAM file and device state as one layer.

A template (sandbox/backends/vm/qemu.py) is a guest booted once and saved: its RAM stays in a
``share=on`` memory file and QEMU writes only device state (``x-ignore-shared``).  Published
here, the two files become one EROFS layer like any other, so the memory file's all-zero
chunks are holes, its chunks dedup against every other chunk in the store, and a host
that mounts the layer fetches only what its VMs touch: QEMU maps the file privately and
read-only, so a page is fetched when a guest first reads it and copied when it first
writes it.  A template booted on one host starts VMs on every host of the store.

Write order, as for every publish: chunks, the layer's metadata image, the template
document (``layerbox.vm-template.v2``, the host's ``template.json`` plus ``layers``),
then the ref ``vm-templates/<key>``.  A crash leaves no ref naming missing data; the next
boot of the template publishes again.  Layout: docs/FORMAT.md Part 5, "Templates in the store".
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from converters.dirsource import walk_directory
from converters.layer import convert_entries
from converters.publish import LocalLayer, upload_layers
from layerstore.objects import Resolved
from layerstore.store import RefNotFound, Store, UploadStats
from snapshots.errors import SnapshotError

TEMPLATE_PREFIX = "vm-templates/"
TEMPLATE_REF = TEMPLATE_PREFIX + "{key}"
# The chunk of everything a VM saves (templates, checkpoint disks and memory images): the unit
# a host fetches when its guest first touches a page or block, smaller than an image's 1 MiB
# since a restored guest touches pages scattered over its RAM, not files read end to end.
# One size for all, so a checkpoint's RAM dedups against its template's and a disk against
# its parent's.
VM_CHUNK_SIZE = 256 << 10


@dataclass(frozen=True)
class PublishedTemplate:
    ref: str
    digest: str
    layer: str
    bytes_stored: int  # bytes of the files the layer holds, holes excluded
    bytes_uploaded: int
    seconds: float


async def publish_template(store: Store, src: Path, files: Sequence[str], doc: Mapping[str, Any],
                           work_dir: Path) -> PublishedTemplate:
    """Publish the template in ``src`` (its ``files``: the memory file, the device state and
    ``template.json``) under ``vm-templates/<doc["key"]>``; ``work_dir`` holds the conversion."""
    started = time.perf_counter()
    key = str(doc["key"])
    ref = TEMPLATE_REF.format(key=key)
    async with store.writer_lock("template"):
        with tempfile.TemporaryDirectory(prefix="template-", dir=work_dir) as tmp:
            tree = Path(tmp) / "tree"
            tree.mkdir()
            for name in files:  # hard links: the memory file is hundreds of MiB, never copied
                os.link(src / name, tree / name)
            meta, blob = Path(tmp) / "layer.erofs", Path(tmp) / "layer.blob"
            result = await asyncio.to_thread(convert_entries, walk_directory(tree), meta, blob,
                                             chunk_size=VM_CHUNK_SIZE, oci_whiteouts=False)
            stats = UploadStats()
            (layer,) = await upload_layers(store, [LocalLayer(meta, blob, {"vm_template": key})], stats,
                                           chunk_size=VM_CHUNK_SIZE)
        digest = await store.put_doc({**doc, "layers": [layer.to_json()]}, stats)
        await store.set_ref(ref, digest, "vm-template", stats=stats)
    return PublishedTemplate(ref, digest, layer.digest, result.data_bytes, stats.bytes_uploaded,
                             round(time.perf_counter() - started, 6))


async def find_template(store: Store, key: str) -> Resolved | None:
    """The store's template ``key``, or None when no host published one."""
    try:
        found = await store.resolve(TEMPLATE_REF.format(key=key), refresh=True)
    except RefNotFound:
        return None
    if found.kind != "vm-template" or found.doc.get("key") != key or len(found.layers) != 1:
        raise SnapshotError(f"{store.url}: {TEMPLATE_REF.format(key=key)} is not the template {key} "
                            f"(a {found.kind} document {found.digest}); delete the ref")
    return found


__all__ = ["VM_CHUNK_SIZE", "TEMPLATE_PREFIX", "TEMPLATE_REF", "PublishedTemplate", "find_template", "publish_template"]
