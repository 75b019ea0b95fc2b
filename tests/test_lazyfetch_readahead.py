"""Read-ahead of a cold miss: the rest of the reader's file in the same GET, within the blob and the
cache's share, never a corrupt chunk served; and the fetch units streaming readers of a remote store
get (lazyfetch/units.py): a range in flight is fetched once, never past the pack's end.

Real daemons, kernels and file stores for the read-ahead; the units against a real pack file.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from layerstore.objects import hex_digest
from layerstore.packs import ChunkLocation
from layerstore.store import Store
from lazyfetch.blobfs import SYNC_AHEAD
from lazyfetch.units import MAX_SPAN, UNIT, PackUnits
from tests.support.hosts import Host, publish_sync, resolve_sync  # noqa: F401
from tests.test_lazyfetch import CHUNK

PATHS = ("fanotify", "fuse")
BIG = "data/big"  # 3 whole chunks and a tail: the last file of the blob
BIG_SIZE = 3 * CHUNK + 100_000
SETTLE = 30.0  # seconds: a bound on waiting for the daemon's background work, never a speed


def make_source(root: Path) -> Path:
    rnd = random.Random(7)
    (root / "bin").mkdir(parents=True)
    for i in range(8):
        (root / "bin" / f"tool{i}").write_bytes(rnd.randbytes(rnd.randint(1000, 30_000)))
    (root / "data").mkdir()
    (root / BIG).write_bytes(rnd.randbytes(BIG_SIZE))
    return root


def pread_in_subprocess(path: Path, offset: int, size: int) -> subprocess.CompletedProcess[bytes]:
    """One pread from another process: a hang is a timeout, an EIO a non-zero exit."""
    code = (f"import os, sys; fd = os.open({str(path)!r}, os.O_RDONLY); "
            f"sys.stdout.buffer.write(os.pread(fd, {size}, {offset}))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)


def wait_settled(host: Host, until: str = "fetches_in_flight") -> dict:
    """The daemon's stats once nothing is in flight (bounded)."""
    deadline = time.monotonic() + SETTLE
    while True:
        st = host.stats()
        if st["fetches_in_flight"] == 0:
            return st
        assert time.monotonic() < deadline, f"the daemon did not settle within {SETTLE} s: {st}"
        time.sleep(0.05)


def chunk_locations(url: str, data_dir: Path, ref: str, path: str) -> list[ChunkLocation]:
    """Where each chunk of ``path`` (in the image's only layer) lies in the store's packs."""

    async def run() -> list[ChunkLocation]:
        from layerstore.erofs.reader import ErofsImage

        async with await Store.open(url, data_dir) as store:
            resolved = await store.resolve(ref)
            layer = resolved.layers[-1]
            img = ErofsImage(await store.get_meta(layer.digest), hex_digest(layer.digest))
            await store.load_layer_locations(layer)
            locs = []
            for c in img.chunks(img.lookup(path)):
                assert c.digest is not None
                loc = store.locate(c.digest)
                assert loc is not None
                locs.append(loc)
            return locs

    return asyncio.run(run())


def pack_file(store_root: Path, loc: ChunkLocation) -> Path:
    return next(p for p in (store_root / "packs").rglob(loc.pack.hex()) if p.is_file())


@pytest.fixture
def published(tmp_path: Path) -> tuple[str, Path]:
    url = f"file://{tmp_path / 'store'}"
    src = make_source(tmp_path / "src")
    publish_sync(url, tmp_path / "pub", str(src), "ahead/img")
    return url, src


@pytest.mark.usefixtures("need_root")
@pytest.mark.root("erofs", "overlay", "fuse")
@pytest.mark.parametrize("data_path", PATHS)
def test_a_miss_fetches_the_rest_of_its_file_in_the_same_get(hosts, published, data_path: str) -> None:
    url, src = published
    host = hosts(url, data_path=data_path)
    mnt = host.mount("ahead/img")
    wait_settled(host)
    before = host.stats()
    res = pread_in_subprocess(mnt / BIG, 0, 4096)
    assert res.returncode == 0, res.stderr
    assert res.stdout == (src / BIG).read_bytes()[:4096]
    st = wait_settled(host)
    # the first page waited for chunk 0; chunks 1-3 came along in the same GET (adjacent frames of
    # one pack, 3.1 MB of random data: under one GET's 4 MiB); past the file only small neighbours
    assert st["chunks_fetched"] - before["chunks_fetched"] >= 4
    assert st["store_requests"] - before["store_requests"] == 1
    assert BIG_SIZE <= st["bytes_fetched_uncompressed"] - before["bytes_fetched_uncompressed"] <= BIG_SIZE + SYNC_AHEAD
    # the rest of the file reads without waiting for the store, byte for byte
    assert (mnt / BIG).read_bytes() == (src / BIG).read_bytes()
    after = host.stats()
    assert after["misses"] == st["misses"]
    assert after["store_requests"] == st["store_requests"]


@pytest.mark.usefixtures("need_root")
@pytest.mark.root("erofs", "overlay", "fuse")
def test_read_ahead_takes_at_most_its_share_of_a_small_cache(hosts, published) -> None:
    url, src = published
    cache = 16 << 20  # read-ahead may take 1/16 of it: 1 MiB, one whole chunk
    host = hosts(url, cache_size=cache)
    mnt = host.mount("ahead/img")
    before = wait_settled(host)
    res = pread_in_subprocess(mnt / BIG, 0, 4096)
    assert res.returncode == 0, res.stderr
    st = wait_settled(host)
    fetched = st["bytes_fetched_uncompressed"] - before["bytes_fetched_uncompressed"]
    assert CHUNK <= fetched <= CHUNK + cache // 16
    assert (mnt / BIG).read_bytes() == (src / BIG).read_bytes()


@pytest.mark.usefixtures("need_root")
@pytest.mark.root("erofs", "overlay", "fuse")
@pytest.mark.parametrize("data_path", PATHS)
def test_a_corrupt_chunk_in_a_read_ahead_range_is_never_served(hosts, published, tmp_path: Path,
                                                               data_path: str) -> None:
    url, src = published
    locs = chunk_locations(url, tmp_path / "pub", "ahead/img", BIG)
    assert len(locs) == 4
    bad = locs[2]  # read ahead with chunk 0, needed only by a read at 2 MiB
    pack = pack_file(tmp_path / "store", bad)
    original = pack.read_bytes()
    damaged = bytearray(original)
    for i in range(bad.offset, bad.offset + bad.length, 251):
        damaged[i] ^= 0x5A
    pack.write_bytes(bytes(damaged))
    want = (src / BIG).read_bytes()
    host = hosts(url, data_path=data_path)
    mnt = host.mount("ahead/img")
    wait_settled(host)

    res = pread_in_subprocess(mnt / BIG, 0, 4096)  # chunk 0 is good: served
    assert res.returncode == 0, res.stderr
    assert res.stdout == want[:4096]
    st = wait_settled(host)
    assert st["chunks_corrupt"] >= 1  # the read-ahead decoded chunk 2 and refused it

    res = pread_in_subprocess(mnt / BIG, 2 * CHUNK, 4096)  # the reader that needs it: EIO, not bytes
    assert res.returncode != 0
    assert b"Errno 5" in res.stderr, res.stderr
    assert wait_settled(host)["read_errors"] >= 1

    pack.write_bytes(original)  # the store is right again: the next read fetches it anew
    assert (mnt / BIG).read_bytes() == want


# -- fetch units (no kernel) ----------------------------------------------------------------------


class PackFile:
    """A pack file served as a store serves ranges (clipped at its end), every GET logged; a GET
    waits for ``gate`` so that concurrent readers are sure to overlap."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.gets: list[tuple[int, int]] = []
        self.gate = asyncio.Event()
        self.fail = False

    async def get(self, pack: bytes, start: int, end: int, layer: object, background: bool) -> bytes:
        self.gets.append((start, end))
        await self.gate.wait()
        if self.fail:
            raise OSError("the store is down")
        with self.path.open("rb") as f:
            f.seek(start)
            return f.read(end - start)


async def settled(units: PackUnits) -> None:
    """Until no unit is in flight (bounded)."""
    async with asyncio.timeout(SETTLE):
        while units.stats()["in_flight"]:  # noqa: ASYNC110 (the units have no event to wait on)
            await asyncio.sleep(0.01)


@pytest.fixture
def pack(tmp_path: Path) -> tuple[Path, bytes]:
    data = random.Random(3).randbytes(9 * UNIT + 12345)
    path = tmp_path / "pack"
    path.write_bytes(data)
    return path, data


PACK = b"\x01" * 32


def test_units_fetch_a_range_in_flight_once_and_read_ahead_within_the_pack(pack: tuple[Path, bytes]) -> None:
    path, data = pack

    async def run() -> None:
        store = PackFile(path)
        units = PackUnits(store.get)
        units.note_end(PACK, len(data))
        a = asyncio.ensure_future(units.read(PACK, 100, UNIT + 100, "layer"))
        b = asyncio.ensure_future(units.read(PACK, UNIT + 50, 2 * UNIT + 7, "layer"))
        await asyncio.sleep(0)
        store.gate.set()
        assert await a == data[100 : UNIT + 100]
        assert await b == data[UNIT + 50 : 2 * UNIT + 7]
        await settled(units)  # the read-ahead GETs end
        covered = sorted(u for lo, hi in store.gets for u in range(lo // UNIT, (hi - 1) // UNIT + 1))
        assert covered == sorted(set(covered)), f"a unit was fetched twice: {store.gets}"
        assert all(hi - lo <= MAX_SPAN * UNIT for lo, hi in store.gets)
        # what the read-ahead brought is cut from memory: no GET for it (only the next units ahead)
        assert units.cached(PACK, 3 * UNIT + 1, 4 * UNIT - 1) == data[3 * UNIT + 1 : 4 * UNIT - 1]
        assert await units.read(PACK, 3 * UNIT, 3 * UNIT + 10, "layer") == data[3 * UNIT : 3 * UNIT + 10]
        await settled(units)
        # the pack's last unit: one GET of it, nothing asked past its end
        tail = await units.read(PACK, len(data) - 10, len(data), "layer")
        assert tail == data[-10:]
        assert store.gets[-1] == (9 * UNIT, len(data))
        covered = [u for lo, hi in store.gets for u in range(lo // UNIT, (hi - 1) // UNIT + 1)]
        assert len(covered) == len(set(covered)), f"a unit was fetched twice: {store.gets}"

    asyncio.run(run())


def test_units_stay_within_their_memory_and_forget_what_was_corrupt_or_failed(pack: tuple[Path, bytes]) -> None:
    path, data = pack

    async def run() -> None:
        store = PackFile(path)
        store.gate.set()
        units = PackUnits(store.get, capacity=2 * UNIT)
        units.note_end(PACK, len(data))
        for u in range(0, 9, 3):
            assert await units.read(PACK, u * UNIT, u * UNIT + 5, "layer") == data[u * UNIT : u * UNIT + 5]
        await settled(units)
        assert units.stats()["bytes"] <= 2 * UNIT
        # a corrupt chunk's units are dropped: the refetch asks the store again
        await units.read(PACK, 5 * UNIT, 5 * UNIT + 5, "layer")
        assert units.cached(PACK, 5 * UNIT, 5 * UNIT + 5) is not None
        units.drop(PACK, 5 * UNIT + 2, 5 * UNIT + 3)
        assert units.cached(PACK, 5 * UNIT, 5 * UNIT + 5) is None
        # a failed GET fails its readers and leaves nothing in flight: the next read tries again
        units = PackUnits(store.get)
        units.note_end(PACK, len(data))
        store.fail = True
        with pytest.raises(OSError, match="the store is down"):
            await units.read(PACK, 0, 10, "layer")
        await settled(units)
        store.fail = False
        assert await units.read(PACK, 0, 10, "layer") == data[:10]

    asyncio.run(run())


def test_a_chunk_that_landed_after_the_reader_looked_is_not_fetched_again(
        published: tuple[str, Path], tmp_path: Path) -> None:
    """A reader looks at the blob on its own thread, then asks the loop to fetch what it saw
    missing; a fetch of the same chunk may settle in between (six readers of one file do this).
    The second ask must find the chunk in the blob, not fetch it twice."""
    from layerstore.erofs.reader import ErofsImage
    from lazyfetch.blobcache import BlobCache
    from lazyfetch.fetcher import Fetcher
    from lazyfetch.metrics import Metrics

    url, _ = published

    async def run() -> None:
        async with await Store.open(url, tmp_path / "data") as store:
            entry = (await store.resolve("ahead/img")).layers[-1]
            await store.load_layer_locations(entry)
            img = ErofsImage(await store.get_meta(entry.digest), hex_digest(entry.digest))
            cache = BlobCache(tmp_path / "blobs", 1 << 30)
            hexd = hex_digest(entry.digest)
            layer = cache.add(hexd, img.blob_size, list(img.blob_map), fd=cache.open_fd(hexd, img.blob_size))
            metrics = Metrics()
            fetcher = Fetcher(store, cache, metrics, asyncio.get_running_loop())
            try:
                first = layer.records[0].digest
                assert layer.missing([0]) == [0]
                got = await fetcher.fetch_many(layer, [first], waited=True)
                assert set(got) == {first}
                assert layer.missing([0]) == []
                once = metrics.snapshot()
                assert (once["store_requests"], once["chunks_fetched"]) == (1, 1)
                # the late ask: the chunk is there, so nothing more is requested or counted
                assert await fetcher.fetch_many(layer, [first], waited=True) == {}
                await fetcher.fetch_many(layer, [layer.records[1].digest], along=[first])
                again = metrics.snapshot()
                assert (again["store_requests"], again["chunks_fetched"]) == (2, 2), again
                # punched by eviction since: then it is fetched again
                assert cache.evict(0, force=True) > 0
                assert set(await fetcher.fetch_many(layer, [first], waited=True)) == {first}
                assert metrics.snapshot()["chunks_fetched"] == 3
            finally:
                fetcher.close()
                cache.close()

    asyncio.run(run())
