"""Both data paths (fanotify pre-content, FUSE) serve exactly the layer's bytes, on file and S3 stores.

The reference is the same EROFS metadata image mounted on a complete local blob
assembled from the store's verified chunks: every file of the fixture image must
read the same through a lazy mount of each data path, cold, then again with the
page cache dropped.  A blob is also mapped the way a VM maps it (virtio-pmem:
a shared, read-only mapping of a file padded to 2 MiB).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from layerstore.erofs.reader import ErofsImage
from layerstore.objects import hex_digest
from layerstore.store import Store
from lazyfetch import kmount
from tests.support.hosts import publish_sync, resolve_sync  # noqa: F401
from tests.support.moto import file_and_s3_store_url, moto_fixture  # noqa: F401
from tests.support.treecmp import assert_trees_equal
from tests.test_lazyfetch import make_source

pytestmark = [pytest.mark.usefixtures("need_root"), pytest.mark.root("erofs", "overlay", "fuse")]

moto = moto_fixture("module")
PATHS = ("fanotify", "fuse")


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def materialize(url: str, data_dir: Path, ref: str, out: Path) -> list[tuple[Path, Path]]:
    """(metadata image, complete local blob) of each layer of ``ref``, from verified chunks."""

    async def run() -> list[tuple[Path, Path]]:
        made = []
        async with await Store.open(url, data_dir) as store:
            resolved = await store.resolve(ref, refresh=True)
            for layer in resolved.layers:
                hexd = hex_digest(layer.digest)
                raw = await store.get_meta(layer.digest)
                meta, blob = out / f"{hexd}.erofs", out / f"{hexd}.blob"
                meta.write_bytes(raw)
                img = ErofsImage(raw, str(meta))
                await store.load_layer_locations(layer)
                chunks = [(rec.block * 4096, await store.read_chunk(rec.digest)) for rec in img.blob_map]
                await asyncio.to_thread(write_blob, blob, img.blob_size, chunks)
                made.append((meta, blob))
        return made

    out.mkdir(parents=True, exist_ok=True)
    return asyncio.run(run())


def write_blob(path: Path, size: int, chunks: list[tuple[int, bytes]]) -> None:
    with open(path, "wb") as f:
        f.truncate(size)
        for offset, data in chunks:
            f.seek(offset)
            f.write(data)


def test_fixture_image_reads_the_same_through_each_data_path(hosts, tmp_path: Path, mounts) -> None:
    from tests.support.env import FIXTURE_IMAGE, in_ci

    if not FIXTURE_IMAGE.exists():
        (pytest.fail if in_ci() else pytest.skip)(f"{FIXTURE_IMAGE} is absent")
    url = f"file://{tmp_path / 'store'}"
    # python: the minbase layer and two over it (the minbase image alone is that same layer)
    publish_sync(url, tmp_path / "pub", f"oci-archive:{FIXTURE_IMAGE}:python", "debian/python")
    # the reference: every layer's image on a complete local blob, stacked as the lazy mounts are
    layers = materialize(url, tmp_path / "pub", "debian/python", tmp_path / "eager")
    assert len(layers) > 1
    reference = mounts.overlay([mounts.erofs(meta, blob) for meta, blob in layers])
    for path in PATHS:
        host = hosts(url, path, data_path=path)
        mnt = host.mount("debian/python")
        health = host.mounts.client.health()
        assert health is not None
        assert health["data_path"] == path
        assert_trees_equal(reference, mnt, check_root_meta=False)  # cold: every byte fetched on demand
        drop_caches()
        assert_trees_equal(reference, mnt, check_root_meta=False)  # from the host's blob files
        assert host.stats()["read_errors"] == 0


@pytest.mark.parametrize("path", PATHS)
def test_every_byte_on_file_and_s3_stores(hosts, store_url: str, tmp_path: Path, path: str) -> None:
    src = make_source(tmp_path / "src", big_mb=16)
    publish_sync(store_url, tmp_path / "pub", str(src), "paths/img")
    host = hosts(store_url, data_path=path)
    mnt = host.mount("paths/img")
    assert_trees_equal(src, mnt, check_root_meta=False)
    drop_caches()
    assert_trees_equal(src, mnt, check_root_meta=False)


MAPPER = r"""
import hashlib, mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
size = os.fstat(fd).st_size
with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as m:
    print(size, hashlib.sha256(m[: int(sys.argv[2])]).hexdigest(), m[int(sys.argv[2]):].count(0))
"""


@pytest.mark.parametrize("path", PATHS)
def test_a_vm_maps_a_blob_shared_and_padded_to_2_mib(hosts, tmp_path: Path, path: str) -> None:
    url = f"file://{tmp_path / 'store'}"
    src = make_source(tmp_path / "src", big_mb=8)
    publish_sync(url, tmp_path / "pub", str(src), "vm/img")
    ((_, blob),) = materialize(url, tmp_path / "pub", "vm/img", tmp_path / "eager")
    host = hosts(url, data_path=path)
    host.mount("vm/img")
    (hexd,) = host.mounts.status()["layers"]
    served = (host.data_dir / "blobcache" / f"{hexd}.blob") if path == "fanotify" else \
        (host.data_dir / "blobs" / hexd)
    drop_caches()
    # QEMU maps the file it is given (memory-backend-file, share=on, readonly): a separate process,
    # faulting in pages of chunks nobody has read yet
    out = subprocess.run([sys.executable, "-c", MAPPER, str(served), str(blob.stat().st_size)],
                         capture_output=True, text=True, timeout=120, check=True)
    size, digest, zeros = out.stdout.split()
    assert int(size) % (2 << 20) == 0
    assert int(size) >= blob.stat().st_size
    assert digest == hashlib.sha256(blob.read_bytes()).hexdigest()
    assert int(zeros) == int(size) - blob.stat().st_size  # the padding reads as zeros


def test_the_fanotify_path_leaves_no_fuse_mount(hosts, tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    src = make_source(tmp_path / "src")
    publish_sync(url, tmp_path / "pub", str(src), "nofuse/img")
    host = hosts(url, data_path="fanotify")
    host.mount("nofuse/img")
    assert [m.fstype for m in kmount.read_mountinfo() if m.mountpoint.startswith(str(host.data_dir))
            and m.fstype.startswith("fuse")] == []


@pytest.mark.parametrize("path", PATHS)
def test_a_chunk_another_layer_holds_is_copied_not_fetched(hosts, tmp_path: Path, path: str) -> None:
    """Blobs are per layer, so two layers sharing a chunk (a checkpoint's copy of a large file, a
    rebuilt toolkit) keep it twice on disk, but the host fetches it once."""
    url = f"file://{tmp_path / 'store'}"
    one = make_source(tmp_path / "one", big_mb=8, seed=1)
    two = tmp_path / "two"
    (two / "data").mkdir(parents=True)
    (two / "data" / "blob0").write_bytes((one / "data" / "blob0").read_bytes())  # the same 8 MB
    (two / "only-here").write_text("a different layer")
    publish_sync(url, tmp_path / "pub", str(one), "share/one")
    publish_sync(url, tmp_path / "pub", str(two), "share/two")
    host = hosts(url, data_path=path)
    a, b = host.mount("share/one"), host.mount("share/two")
    assert len(host.mounts.status()["layers"]) == 2
    assert (a / "data/blob0").read_bytes() == (one / "data/blob0").read_bytes()
    fetched = host.stats()["bytes_fetched"]
    drop_caches()
    assert (b / "data/blob0").read_bytes() == (one / "data/blob0").read_bytes()
    st = host.stats()
    # nothing of the 8 MB from the store again (the read-ahead may take the tiny file after it)
    assert st["bytes_fetched"] - fetched < 1024
    assert st["cache"]["copied"] >= 8


def resident(path: Path) -> int:
    """Bytes of ``path`` in the page cache (util-linux fincore, i.e. mincore(2))."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


@pytest.mark.parametrize("path", PATHS)
def test_direct_blob_io_reads_every_byte_and_caches_it_once(hosts, tmp_path: Path, path: str) -> None:
    """--blob-io direct: EROFS reads the blob with direct I/O, cold (every read fetched) and again
    from the host's blob; a re-read leaves the blob's own pages out of the page cache, where a
    buffered host caches them as well as the files."""
    url = f"file://{tmp_path / 'store'}"
    src = make_source(tmp_path / "src", big_mb=16)
    publish_sync(url, tmp_path / "pub", str(src), "dio/img")
    cached = {}
    for blob_io in ("direct", "buffered"):
        host = hosts(url, f"{path}-{blob_io}", data_path=path, blob_io=blob_io)
        mnt = host.mount("dio/img")
        assert host.mounts.client.health()["blob_io"] == blob_io  # type: ignore[index]
        (hexd,) = host.mounts.status()["layers"]
        layer_mp = host.data_dir / "layers" / hexd
        opts = [m for m in kmount.read_mountinfo() if m.mountpoint == str(layer_mp)][0].super_options
        assert ("directio" in opts.split(",")) == (blob_io == "direct"), opts
        assert_trees_equal(src, mnt, check_root_meta=False)  # cold
        drop_caches()
        assert_trees_equal(src, mnt, check_root_meta=False)  # from the host's blob
        served = (host.data_dir / "blobcache" / f"{hexd}.blob") if path == "fanotify" else \
            (host.data_dir / "blobs" / hexd)
        cached[blob_io] = resident(served)
        assert host.stats()["read_errors"] == 0
    assert cached["direct"] == 0
    assert cached["buffered"] >= 16 << 20  # the big file's bytes, cached as blob too
