"""The daemon's fetch counters against the store's own record of the same reads.

A real daemon reads two layers (a base and a toolkit, composed) through real
EROFS/overlay mounts from moto through the real S3 backend.  Between them
sits ``FaultProxy`` with no faults queued: it records every GET's ``Range``
and the body bytes it forwarded, so the test knows, without asking the
daemon, how many chunk GETs were made, how many compressed bytes they
carried, which chunks (and so which layer and how many uncompressed bytes)
each range covered.  Every counter of ``/stats`` that describes fetching must
agree with that record and with the cache (see docs/STATS.md).

The reads cover every path that fetches: sequential misses with read-ahead,
readers waiting together on one in-flight fetch (identical files share
chunks), a refetch of nothing, and a prefetch of a whole layer.  The files
are text, so compressed and uncompressed sizes differ: a counter that mixes
them cannot pass.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
import urllib.parse
from collections import Counter
from pathlib import Path

import pytest

from layerstore.erofs.reader import ErofsImage
from layerstore.objects import LayerEntry, Resolved
from layerstore.packs import ChunkLocation
from layerstore.store import Store
from tests.support.hosts import Host, publish_sync, resolve_sync
from tests.support.moto import MotoServer, aws_test_env, moto_fixture  # noqa: F401
from tests.support.s3proxy import Exchange, FaultProxy

pytestmark = [pytest.mark.usefixtures("need_root"), pytest.mark.root("erofs", "overlay", "fuse")]

moto = moto_fixture("module")
_RANGE = re.compile(r"^bytes=(\d+)-(\d+)$")


def _text(tag: str, size: int) -> bytes:
    """Compressible, and unique to ``tag`` (so no chunk is shared between two tags)."""
    out = bytearray()
    line = 0
    while len(out) < size:
        out += f"{tag} line {line:09d} the quick brown fox jumps over the lazy dog\n".encode()
        line += 1
    return bytes(out[:size])


def _source(root: Path, tag: str, sizes: dict[str, int], copies: int = 0) -> Path:
    for name, size in sizes.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_text(f"{tag}/{name}", size))
    shared = _text(f"{tag}/shared", 2_500_000)
    for i in range(copies):  # identical files: one set of chunks, read by many at once
        (root / "same").mkdir(exist_ok=True)
        (root / "same" / f"copy{i}").write_bytes(shared)
    return root


class Chunks:
    """Where every chunk of some layers lives, read from the store (not from the daemon)."""

    def __init__(self) -> None:
        self.at: dict[tuple[str, int], tuple[bytes, ChunkLocation, str]] = {}  # (pack hex, offset) ->
        self.records: dict[str, list[bytes]] = {}  # layer -> chunk digests

    @classmethod
    def load(cls, url: str, data_dir: Path, layers: list[LayerEntry]) -> Chunks:
        out = cls()

        async def run() -> None:
            async with await Store.open(url, data_dir) as store:
                for entry in layers:
                    await store.load_layer_locations(entry)
                    image = ErofsImage(await store.get_meta(entry.digest))
                    digests = [r.digest for r in image.blob_map]
                    out.records[entry.digest] = digests
                    for digest in digests:
                        loc = store.locate(digest)
                        assert loc is not None, digest.hex()
                        out.at[(loc.pack.hex(), loc.offset)] = (digest, loc, entry.digest)

        asyncio.run(run())
        return out

    def covered(self, get: Exchange) -> list[tuple[bytes, ChunkLocation, str]]:
        """The chunks a ranged GET of a pack covers; they must tile its range exactly."""
        pack = urllib.parse.urlsplit(get.target).path.rsplit("/", 1)[1]
        match = _RANGE.match(get.range or "")
        assert match, f"a chunk GET without a byte range: {get}"
        start, end = int(match[1]), int(match[2]) + 1
        out, at = [], start
        while at < end:
            found = self.at.get((pack, at))
            assert found is not None, f"{get}: no chunk of these layers starts at {at}"
            out.append(found)
            at += found[1].length
        assert at == end, f"{get}: the range ends inside a frame"
        return out


def _read_together(paths: list[Path]) -> None:
    procs = [subprocess.Popen([sys.executable, "-c", f"open({str(p)!r}, 'rb').read()"],
                              stderr=subprocess.PIPE) for p in paths]
    for proc in procs:
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err.decode()


def _settled(host: Host) -> dict:
    """Stats once no fetch is in flight and the cache has every chunk fetched so far."""
    deadline = time.monotonic() + 20
    while True:
        st = host.stats()
        if st["fetches_in_flight"] == 0 and st["cache"]["chunks"] >= st["chunks_fetched"]:
            return st
        assert time.monotonic() < deadline, st
        time.sleep(0.05)


@pytest.mark.usefixtures("aws_test_env")
def test_fetch_counters_match_the_store_request_log(
    moto: MotoServer, hosts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the test process (publish, resolve) talks to moto directly; only the daemon goes through the proxy
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto.endpoint)
    url = f"s3://{moto.new_bucket()}/lb"
    base = _source(tmp_path / "base", "base", {
        "etc/os-release": 300, "bin/small": 40_000, "bin/medium": 700_000, "data/big": 3_300_000,
    }, copies=6)
    toolkit = _source(tmp_path / "tk", "tk", {"opt/tk/one": 90_000, "opt/tk/two": 1_600_000})
    pub = tmp_path / "pub"
    publish_sync(url, pub, str(base), "base/img")
    publish_sync(url, pub, str(toolkit), "tk/img")

    async def compose() -> None:
        async with await Store.open(url, pub) as s:
            await s.compose("env/x", {"base": "base/img", "toolkit": "tk/img"})

    asyncio.run(compose())

    proxy = FaultProxy(moto.endpoint).start()
    try:
        host = hosts(url)
        host.mounts.s3_endpoint = proxy.url  # the daemon it starts reads through the proxy
        env: Resolved = resolve_sync(url, host.data_dir, "env/x")
        tk: Resolved = resolve_sync(url, host.data_dir, "tk/img")
        assert len(env.layers) == 2
        base_layer, tk_layer = env.layers[0].digest, tk.layers[0].digest
        assert env.layers[1].digest == tk_layer
        mnt = host.mount("env/x")

        # misses, one at a time (each with its read-ahead)
        for name in ("etc/os-release", "bin/small", "bin/medium", "data/big"):
            assert (mnt / name).read_bytes() == (base / name).read_bytes()
        # six readers of one set of chunks at once: they wait on the same fetches
        _read_together([mnt / "same" / f"copy{i}" for i in range(6)])
        # the toolkit layer in the background, as a trace replay or `layerbox prefetch` does
        reply = host.mounts.client.request("POST", "/prefetch", {
            "image": tk.digest, "layers": [x.to_json() for x in tk.layers]})
        before = _settled(host)
        for name in ("opt/tk/one", "opt/tk/two"):  # all cached now
            assert (mnt / name).read_bytes() == (toolkit / name).read_bytes()
        st = _settled(host)
        gets = [x for x in proxy.exchanges("GET") if "/packs/" in x.target]
    finally:
        proxy.stop()

    chunks = Chunks.load(url, host.data_dir, list(env.layers))
    assert all(x.status == 206 for x in gets), gets
    covered = [(x, chunks.covered(x)) for x in gets]
    fetched = Counter(digest for _, items in covered for digest, _, _ in items)
    assert max(fetched.values()) == 1, "a chunk was fetched twice"

    # what the store sent, counted by the proxy
    assert st["store_requests"] == len(gets)
    assert st["bytes_fetched"] == sum(x.body_bytes for x in gets)
    assert st["fetch_count"] == st["store_requests"]
    # what those bytes were, from the layers' chunk locations
    want_per_layer = {base_layer: 0, tk_layer: 0}
    want_raw_per_layer = {base_layer: 0, tk_layer: 0}
    for get, items in covered:
        layers = {layer for _, _, layer in items}
        assert len(layers) == 1, f"{get} covers chunks of two layers"
        layer = layers.pop()
        want_per_layer[layer] += get.body_bytes
        want_raw_per_layer[layer] += sum(loc.raw_length for _, loc, _ in items)
    assert st["bytes_fetched_per_layer"] == want_per_layer
    assert st["bytes_fetched_uncompressed_per_layer"] == want_raw_per_layer
    assert st["bytes_fetched_uncompressed"] == sum(want_raw_per_layer.values())
    assert st["chunks_fetched"] == len(fetched)
    assert st["chunks_corrupt"] == 0
    assert st["bytes_fetched"] < st["bytes_fetched_uncompressed"]  # the text compresses
    # per image: the sum over the image's layers
    assert st["bytes_fetched_per_image"] == {env.digest: st["bytes_fetched"],
                                             tk.digest: want_per_layer[tk_layer]}
    # the prefetch fetched the whole toolkit layer, and nothing else did
    assert reply == {"chunks": len(chunks.records[tk_layer]), "fetched": len(chunks.records[tk_layer])}
    # (prefetched also counts the sequential reads' windows fetched ahead of them in the base layer)
    assert st["chunks_prefetched"] >= len(chunks.records[tk_layer])
    assert set(fetched) >= set(chunks.records[tk_layer])
    # reads after the prefetch wait for nothing (through fanotify a complete layer's reads are not
    # even seen: its blob has the ignore mark, so hits need not grow)
    assert st["misses"] == before["misses"]
    assert st["hits"] >= before["hits"]
    # the cache holds exactly the chunks fetched: nothing was evicted or refused
    cache = st["cache"]
    assert cache["chunks"] == st["chunks_fetched"]
    assert cache["apparent_bytes"] == st["bytes_fetched_uncompressed"]
    assert st["cache_bytes"] == cache["bytes"]
