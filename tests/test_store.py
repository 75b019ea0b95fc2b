"""layerstore end to end on both backends: publish, dedup, refs, compose, verify, gc, cache."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

from converters.ocispec import REF_NAME, DiffIdMismatch
from converters.publish import publish
from layerstore.backend import ObjectNotFound
from layerstore.erofs.reader import ErofsImage
from layerstore.errors import FormatError
from layerstore.gc import collect
from layerstore.locks import StoreLocked
from layerstore.objects import (
    SCHEMA_TRACE,
    BadName,
    DigestMismatch,
    canonical,
    digest_of,
    doc_key,
    meta_key,
    pack_key,
    trace_key,
)
from layerstore.packs import decompress
from layerstore.store import Store
from layerstore.verify import verify
from tests.support.env import FIXTURE_IMAGE, in_ci
from tests.support.moto import (  # noqa: F401
    MotoServer,
    aws_test_env,
    file_and_s3_store_url,
    moto_fixture,
    opened_store,
)
from tests.support.registry import LayoutBuilder, tar_of

REPO = Path(__file__).resolve().parents[1]
FIXTURE = FIXTURE_IMAGE


moto = moto_fixture("module")


def make_tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return root


def sample_files(seed: int = 0, n: int = 50) -> dict[str, bytes]:
    rnd = __import__("random").Random(seed)
    files = {f"pkg/mod{i}.py": f"# module {i}\n".encode() * rnd.randint(1, 200) for i in range(n)}
    files["data/big.bin"] = rnd.randbytes(3 << 20)
    files["data/zeros.bin"] = bytes(2 << 20)
    return files


async def read_back(store: Store, name: str) -> dict[str, bytes]:
    """Every regular file of the (single-layer) image, reassembled from store chunks."""
    resolved = await store.resolve(name, refresh=True)
    out: dict[str, bytes] = {}
    for layer in resolved.layers:
        await store.load_layer_locations(layer)
        image = ErofsImage(await store.get_meta(layer.digest), layer.digest)
        for path, node in image.walk():
            if (node.mode & 0o170000) != 0o100000:
                continue
            parts = []
            for chunk in image.chunks(node.nid):
                if chunk.hole:
                    parts.append(bytes(chunk.length))
                else:
                    assert chunk.digest is not None
                    parts.append(await store.read_chunk(chunk.digest))
            out[path.decode().lstrip("/")] = b"".join(parts)
    return out


@pytest.mark.asyncio
async def test_publish_read_back_and_dedup(store: Store, tmp_path: Path) -> None:
    files = sample_files()
    src = make_tree(tmp_path / "src", files)
    first = await publish(store, str(src), "work/app:v1")
    assert first.bytes_present == 0
    assert first.bytes_new == sum(len(v) for k, v in files.items() if k != "data/zeros.bin")
    assert await read_back(store, "work/app:v1") == files

    again = await publish(store, str(src), "work/app:v2")
    assert again.digest == first.digest  # same content, same document
    assert again.bytes_new == 0
    assert again.chunks_new == 0
    assert again.bytes_present == first.bytes_new

    (src / "pkg/mod3.py").write_bytes(b"changed\n")
    changed = await publish(store, str(src), "work/app:v3")
    assert changed.bytes_new == len(b"changed\n")
    assert changed.digest != first.digest

    refs = {r.name: r.digest for r in await store.list_refs("work/")}
    assert refs == {"work/app:v1": first.digest, "work/app:v2": first.digest, "work/app:v3": changed.digest}


@pytest.mark.asyncio
async def test_small_files_are_packed(store: Store, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {f"f/{i:05}": f"file {i}\n".encode() for i in range(3000)})
    result = await publish(store, str(src), "many/small")
    assert result.chunks_new == 3000
    packs = [i async for i in store.backend.list("packs/")]
    assert len(packs) == 1  # not one object per file
    assert result.requests < 20


@pytest.mark.asyncio
async def test_compose_keeps_parts_independent(store: Store, tmp_path: Path) -> None:
    base = await publish(store, str(make_tree(tmp_path / "b", {"etc/os": b"base"})), "base/os")
    ws = await publish(store, str(make_tree(tmp_path / "w", {"work/x": b"ws"})), "ws/one")
    tk1 = await publish(store, str(make_tree(tmp_path / "t1", {"opt/tk": b"tk1"})), "tk/py:1")
    tk2 = await publish(store, str(make_tree(tmp_path / "t2", {"opt/tk": b"tk2"})), "tk/py:2")
    c1 = await store.compose("env/a", {"base": "base/os", "workspace": "ws/one", "toolkit": "tk/py:1"})
    r1 = await store.resolve("env/a")
    assert r1.kind == "composition"
    order = [(await store.resolve(n)).layers[0].digest for n in ("base/os", "ws/one", "tk/py:1")]
    assert [layer.digest for layer in r1.layers] == order
    c2 = await store.compose("env/a", {"base": "base/os", "workspace": "ws/one", "toolkit": "tk/py:2"})
    r2 = await store.resolve("env/a", refresh=True)
    assert r2.layers[:2] == r1.layers[:2]
    assert r2.layers[2] != r1.layers[2]
    assert c1.digest != c2.digest
    # the parts' own documents are untouched by composing
    assert [(await store.resolve(n)).digest for n in ("base/os", "ws/one", "tk/py:1", "tk/py:2")] == [
        base.digest, ws.digest, tk1.digest, tk2.digest]
    ref = await store.read_ref("env/a")
    assert ref.history[0]["digest"] == c1.digest


@pytest.mark.asyncio
async def test_a_ref_name_longer_than_a_file_name_is_refused_by_name(store: Store) -> None:
    doc = await store.put_doc({"schema": "layerbox.image.v1", "layers": [], "config": {}, "source": {}})
    for name in ("x" * 300, "a/" + "b" * 200 + ":" + "t" * 50, "/".join(["c"] * 300)):
        with pytest.raises(BadName, match="at most 240|at most 512"):
            await store.set_ref(name, doc, "image")
    await store.set_ref("a/" + "b" * 200 + ":" + "t" * 39, doc, "image")  # 240 characters: fits


@pytest.mark.asyncio
async def test_concurrent_ref_updates_are_never_lost(store: Store, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "s", {"a": b"1"})
    base = await publish(store, str(src), "race/target")
    docs = [await store.put_doc({"schema": "layerbox.image.v1", "layers": [], "config": {"n": i}, "source": {}})
            for i in range(12)]

    async def writer(d: str) -> None:
        await store.set_ref("race/target", d, "image")

    await asyncio.gather(*(writer(d) for d in docs))
    ref = await store.read_ref("race/target")
    seen = {ref.digest} | {h["digest"] for h in ref.history}
    assert set(docs) | {base.digest} == seen


@pytest.mark.asyncio
async def test_corruption_is_never_returned_and_verify_names_it(store: Store, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", sample_files(1, 5))
    result = await publish(store, str(src), "c/x")
    assert (await verify(store)).ok
    pack = [i async for i in store.backend.list("packs/")][0].key
    data = bytearray(await store.backend.get(pack))
    data[100] ^= 0xFF
    await store.backend.put(pack, bytes(data))
    resolved = await store.resolve("c/x")
    image = ErofsImage(await store.get_meta(resolved.layers[0].digest), "m")
    digests = [rec.digest for rec in image.blob_map]
    errors = []
    for d in digests:
        try:
            await store.read_chunk(d)
        except DigestMismatch as exc:
            errors.append(str(exc))
    assert errors
    assert pack in errors[0]
    assert store.url in errors[0]
    report = await verify(store)
    assert not report.ok
    assert any(pack in p for p in report.problems)
    # documents too: a corrupt document is refused even from a fresh host
    doc = doc_key(result.digest)
    await store.backend.put(doc, b'{"schema":"layerbox.image.v1","layers":[]}')
    fresh = await Store.open(store.url, tmp_path / "host2")
    try:
        with pytest.raises(DigestMismatch, match=doc):
            await fresh.get_doc(result.digest)
    finally:
        await fresh.close()
    assert any(doc in p for p in (await verify(store)).problems)


@pytest.mark.asyncio
async def test_gc_sweeps_only_unreachable(store: Store, tmp_path: Path) -> None:
    keep = await publish(store, str(make_tree(tmp_path / "k", {"k/file": os.urandom(100_000)})), "gc/keep")
    gone = await publish(store, str(make_tree(tmp_path / "g", {"g/file": os.urandom(100_000)})), "gc/gone")
    await store.delete_ref("gc/gone")
    young = await collect(store, grace=3600, dry_run=False)
    assert young.deleted == []
    assert young.kept_young > 0
    dry = await collect(store, grace=0, dry_run=True)
    assert doc_key(gone.digest) in dry.deleted
    assert doc_key(keep.digest) not in dry.deleted
    assert [i async for i in store.backend.list("docs/")]  # dry run deleted nothing
    await collect(store, grace=0)
    with pytest.raises(ObjectNotFound):
        await store.backend.get(doc_key(gone.digest))
    fresh = await Store.open(store.url, tmp_path / "host3")
    try:
        assert (await read_back(fresh, "gc/keep"))["k/file"]
        assert (await verify(fresh)).ok
    finally:
        await fresh.close()


@pytest.mark.asyncio
async def test_cache_answers_without_the_store_and_rebuilds(store_url: str, tmp_path: Path) -> None:
    data_dir = tmp_path / "hostc"
    src = make_tree(tmp_path / "src", sample_files(2, 3))
    async with await Store.open(store_url, data_dir) as s:
        result = await publish(s, str(src), "cache/img")
        layer = (await s.resolve("cache/img")).layers[0]
        await s.get_meta(layer.digest)
    # the store goes away: resolving the ref and listing the tree come from LMDB
    from layerstore.backends.wrappers import FaultyBackend

    async with await Store.open(store_url, data_dir) as s:
        faulty = FaultyBackend(s.backend)
        faulty.fail_everything = True
        s.backend = faulty
        resolved = await s.resolve("cache/img")
        assert resolved.digest == result.digest
        image = ErofsImage(await s.get_meta(resolved.layers[0].digest), "m")
        assert any(p == b"/data/big.bin" for p, _ in image.walk())
    shutil.rmtree(data_dir / "cache")
    async with await Store.open(store_url, data_dir) as s:
        assert (await s.resolve("cache/img")).digest == result.digest


PUBLISHER = textwrap.dedent("""
    import asyncio, sys, time
    from converters.publish import publish
    from layerstore.store import Store

    async def main():
        async with await Store.open(sys.argv[1], sys.argv[2]) as s:
            def hook():
                print("READY", flush=True)
                time.sleep(60)
            r = await publish(s, sys.argv[3], sys.argv[4], before_ref=hook if sys.argv[5] == "stall" else None)
            print("DONE", r.bytes_uploaded, r.bytes_new, flush=True)
    asyncio.run(main())
""")


def _run_publisher(store_url: str, data_dir: Path, src: Path, name: str, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", PUBLISHER, store_url, str(data_dir), str(src), name, mode],
                            stdout=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ})


@pytest.mark.asyncio
async def test_killed_publish_leaves_store_consistent_and_rerun_completes(store_url: str, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", sample_files(3, 20))
    proc = _run_publisher(store_url, tmp_path / "h1", src, "kill/me", "stall")
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "READY"  # every object stored, ref not yet moved
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    async with await Store.open(store_url, tmp_path / "h2") as s:
        assert await s.list_refs() == []  # nothing points at the half-published image
        assert (await verify(s)).ok
    rerun = _run_publisher(store_url, tmp_path / "h1", src, "kill/me", "run")
    out, _ = rerun.communicate(timeout=120)
    assert rerun.returncode == 0, out
    _, uploaded, new = out.split()
    assert int(new) == 0  # every chunk was already there
    async with await Store.open(store_url, tmp_path / "h3") as s:
        assert (await read_back(s, "kill/me")) == sample_files(3, 20)
        assert (await verify(s, "kill/me")).ok


def test_cli_store_commands(store_url: str, tmp_path: Path) -> None:
    base = [str(Path(sys.executable).with_name("layerbox"))]
    glob = ["--store", store_url, "--data-dir", str(tmp_path / "cli-host"), "--json"]

    def cli(*args: str, check: bool = True) -> dict | list:
        out = subprocess.run([*base, *args, *glob], capture_output=True, text=True, timeout=300)
        if check:
            assert out.returncode == 0, out.stderr
        return json.loads(out.stdout) if out.stdout.strip() else {"rc": out.returncode, "err": out.stderr}

    src = make_tree(tmp_path / "src", {"a/b": b"hello", "c": os.urandom(10_000)})
    pub = cli("publish", str(src), "--name", "cli/img:1")
    assert pub["files"] == 4  # the root, a, a/b and c
    assert pub["bytes_present"] == 0
    assert cli("tag", "cli/img:1", "cli/img:latest")["digest"] == pub["digest"]
    assert {r["name"] for r in cli("ls")} == {"cli/img:1", "cli/img:latest"}
    shown = cli("show", "cli/img")
    assert shown["digest"] == pub["digest"]
    assert len(shown["layers"]) == 1
    comp = cli("compose", "cli/env", "--base", "cli/img:1", "--toolkit", "cli/img:latest")
    assert len(comp["layers"]) == 2
    assert cli("verify")["ok"] is True
    gc = cli("gc", "--dry-run", "--grace", "0")
    assert gc["deleted"] == []
    missing = cli("show", "cli/nope", check=False)
    assert missing["rc"] != 0
    assert "cli/nope" in missing["err"]


@pytest.mark.asyncio
async def test_fixture_images_share_their_base_layer(store: Store) -> None:
    if not FIXTURE.exists():
        reason = f"{FIXTURE} is absent (the shared fixtures are not beside this checkout)"
        if in_ci():
            pytest.fail(reason)
        pytest.skip(reason)
    mini = await publish(store, f"oci-archive:{FIXTURE}:minbase", "debian/minbase")
    py = await publish(store, f"oci-archive:{FIXTURE}:python", "debian/python")
    assert py.layers == 3
    assert py.bytes_present >= mini.bytes_new  # the shared first layer is not stored twice
    shown = await store.resolve("debian/python")
    assert shown.layers[0].digest == (await store.resolve("debian/minbase")).layers[0].digest
    assert shown.config["config"]["Cmd"] == ["/bin/bash"]
    assert meta_key(shown.layers[0].digest).startswith("meta/")
    with tarfile.open(FIXTURE) as tar:  # the config's diff ids, read with tarfile alone
        index = json.load(tar.extractfile("./index.json"))  # type: ignore[arg-type]
        (desc,) = [m for m in index["manifests"] if m["annotations"][REF_NAME] == "python"]
        manifest = json.load(tar.extractfile("./blobs/sha256/" + desc["digest"][7:]))  # type: ignore[arg-type]
        config = json.load(tar.extractfile("./blobs/sha256/" + manifest["config"]["digest"][7:]))  # type: ignore[arg-type]
    diff_ids = config["rootfs"]["diff_ids"]
    assert [e.source["diff_id"] for e in shown.layers] == diff_ids
    assert [e.source["chain_id"] for e in shown.layers] == _chain_ids(diff_ids)
    assert pack_key(shown.layers[0].packs[0]).startswith("packs/")


def _chain_ids(diff_ids: list[str]) -> list[str]:
    """The OCI image spec's ChainID, written out with hashlib (not the code under test)."""
    chain = [diff_ids[0]]
    for diff_id in diff_ids[1:]:
        chain.append("sha256:" + hashlib.sha256(f"{chain[-1]} {diff_id}".encode()).hexdigest())
    return chain


@pytest.mark.asyncio
async def test_image_layer_entries_carry_diff_and_chain_ids(store: Store, tmp_path: Path) -> None:
    """What a containerd snapshotter looks layers up by: LayerEntry.source "diff_id" and "chain_id"."""
    tars = [tar_of({"etc/a": b"a" * 5000}), tar_of({"etc/b": b"b\n"}), tar_of({"etc/c": b"c\n"})]
    diff_ids = ["sha256:" + hashlib.sha256(t).hexdigest() for t in tars]
    lay = LayoutBuilder(tmp_path / "layout")
    lay.tag(lay.image(tars), "good")
    wrong = [*diff_ids[:2], "sha256:" + "0" * 64]
    lay.tag(lay.image(tars, diff_ids=wrong), "wrong")
    await publish(store, f"oci:{lay.root}:good", "oci/good")
    entries = (await store.resolve("oci/good")).layers
    assert [e.source["diff_id"] for e in entries] == diff_ids
    assert [e.source["chain_id"] for e in entries] == _chain_ids(diff_ids)
    assert [e.source["oci"]["chain_id"] for e in entries] == _chain_ids(diff_ids)
    gzipped = [d["digest"] for d in lay.manifest(lay.image(tars))["layers"]]
    assert [e.source["oci"]["digest"] for e in entries] == gzipped
    # a config whose diff ids do not describe the layers publishes nothing
    with pytest.raises(DiffIdMismatch, match=r"layer 3 of 3 .*rootfs.diff_ids\[2\] is sha256:0{64}"):
        await publish(store, f"oci:{lay.root}:wrong", "oci/wrong")
    assert [r.name for r in await store.list_refs("oci/good")] == ["oci/good:latest"]


def test_sync_api_and_cache_rebuild(tmp_path: Path) -> None:
    from converters.publish import publish_sync
    from layerstore.sync import SyncStore

    url = f"file://{tmp_path / 'store'}"
    src = make_tree(tmp_path / "src", {"x/y": b"sync"})
    result = publish_sync(str(src), "sync/img", store=url, data_dir=tmp_path / "h")
    with SyncStore(url, tmp_path / "h") as s:
        assert s.resolve("sync/img").digest == result.digest
        assert s.compose("sync/env", {"base": "sync/img"}).kind == "composition"
        assert [r.name for r in s.list_refs("sync/")] == ["sync/env:latest", "sync/img:latest"]
        assert s.verify().ok
        assert s.gc(grace=0, dry_run=True).deleted == []
        cache_dir = s.store.cache.path
    layerbox = str(Path(sys.executable).with_name("layerbox"))
    out = subprocess.run([layerbox, "cache", "rebuild", "--store", url, "--data-dir", str(tmp_path / "h"), "--json"],
                         capture_output=True, text=True, check=True)
    doc = json.loads(out.stdout)
    assert doc["refs"] == "2"
    assert doc["layers"] == "2"  # the image's layer, and again through the composition
    assert cache_dir.exists()


@pytest.mark.asyncio
async def test_gc_elsewhere_does_not_poison_other_hosts(store_url: str, tmp_path: Path) -> None:
    """Host B's cache remembers chunks a gc on host A deleted; B must not dedup against them."""
    tree = make_tree(tmp_path / "t", {"f": os.urandom(200_000)})
    other = make_tree(tmp_path / "o", {"g": os.urandom(1000)})
    async with await Store.open(store_url, tmp_path / "A") as a, await Store.open(store_url, tmp_path / "B") as b:
        await publish(a, str(tree), "p/n1")
        await publish(b, str(other), "p/n2")  # B loads the index, learning n1's chunks
        await a.delete_ref("p/n1")
        assert (await collect(a, grace=0)).deleted
        again = await publish(b, str(tree), "p/n3")  # the same content, from the stale host
        assert again.bytes_new > 0
        assert (await verify(b, "p/n3")).ok
        assert (await read_back(b, "p/n3")) == {"f": (tree / "f").read_bytes()}
        # and on the gc host itself (its cache remembers the deleted document and metadata)
        again_a = await publish(a, str(tree), "p/n4")
        assert (await verify(a, "p/n4")).ok
        assert again_a.digest == again.digest


def test_zstd_frames_cannot_claim_more_than_expected() -> None:
    import zstandard

    from layerstore.errors import FormatError
    from layerstore.packs import decompress

    bomb = zstandard.ZstdCompressor().compress(bytes(10 << 20))
    with pytest.raises(FormatError, match="claims"):
        decompress(bomb, 1000)
    streamed = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(200 << 20))
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match="more than"):
            decompress(streamed, 1000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # a frame without a stated size is cut off at the bound, not inflated first
    assert decompress(zstandard.ZstdCompressor().compress(b"ok"), 2) == b"ok"
    no_size = zstandard.ZstdCompressor(write_content_size=False).compress(b"x" * 5000)
    assert decompress(no_size, 5000) == b"x" * 5000


@pytest.mark.asyncio
async def test_compose_keeps_the_base_config_even_when_empty(store: Store, tmp_path: Path) -> None:
    await publish(store, str(make_tree(tmp_path / "b", {"x": b"1"})), "cfg/base")  # a directory: no config
    digest = await store.put_doc({"schema": "layerbox.image.v1", "layers": [], "source": {},
                                  "config": {"config": {"Cmd": ["/bin/sh"], "Env": ["A=1"]}}})
    await store.set_ref("cfg/ws", digest, "image")
    await store.compose("cfg/env", {"base": "cfg/base", "workspace": "cfg/ws"})
    config = (await store.resolve("cfg/env")).config
    assert "Cmd" not in config.get("config", {})
    assert config["config"]["Env"] == ["A=1"]


def _trace(image: str, layer: str, *chunks: bytes) -> dict:
    return {"schema": SCHEMA_TRACE, "image": image, "layers": {layer: [c.hex() for c in chunks]}}


@pytest.mark.asyncio
async def test_traces_round_trip_and_a_bad_one_reads_as_none(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    image, layer = digest_of(b"some image"), digest_of(b"some layer")
    assert await store.get_trace(image) is None
    chunks = [bytes([i]) * 32 for i in range(3)]
    await store.put_trace(image, _trace(image, layer, *chunks, chunks[0]))
    assert await store.get_trace(image) == _trace(image, layer, *chunks)  # repeats dropped
    key = trace_key(image)
    assert key == f"traces/{image[7:9]}/{image[7:]}"  # where daemons stored traces before the Store methods
    stored = await store.backend.get(key)
    assert stored == canonical(_trace(image, layer, *chunks))
    # a trace as the daemon wrote it (json.dumps, insertion order) still reads
    await store.backend.put(key, json.dumps({"schema": SCHEMA_TRACE, "image": image,
                                             "layers": {layer: [chunks[1].hex()]}}).encode())
    assert (await store.get_trace(image) or {})["layers"] == {layer: [chunks[1].hex()]}
    for bad in (b"\xff not json", b'{"schema":"layerbox.trace.v1","image":"' + digest_of(b"other").encode()
                + b'","layers":{}}', b'{"schema":"layerbox.trace.v1","image":"' + image.encode()
                + b'","layers":{"' + layer.encode() + b'":["nothex"]}}', b"[]"):
        await store.backend.put(key, bad)
        caplog.clear()
        assert await store.get_trace(image) is None
        assert key in caplog.text
    await store.backend.put(key, stored)
    for wrong in ({**_trace(image, layer), "schema": "layerbox.trace.v2"},
                  _trace(digest_of(b"other"), layer), {**_trace(image, layer), "extra": 1},
                  {**_trace(image, layer), "layers": {"not-a-digest": []}},
                  {**_trace(image, layer), "layers": {layer: "abc"}}):
        with pytest.raises(FormatError):
            await store.put_trace(image, wrong)
    assert await store.backend.get(key) == stored  # refused before the store was touched
    with pytest.raises(BadName):
        await store.put_trace("sha256:" + "0" * 64, _trace(image, layer))


@pytest.mark.asyncio
async def test_gc_collects_the_traces_of_unreachable_documents(store: Store, tmp_path: Path) -> None:
    keep = await publish(store, str(make_tree(tmp_path / "k", {"k/file": os.urandom(10_000)})), "trace/keep")
    gone = await publish(store, str(make_tree(tmp_path / "g", {"g/file": os.urandom(10_000)})), "trace/gone")
    for pub in (keep, gone):
        layer = (await store.resolve(pub.digest)).layers[0].digest
        await store.put_trace(pub.digest, _trace(pub.digest, layer, bytes(32)))
    orphan = digest_of(b"a document that never was")
    await store.put_trace(orphan, _trace(orphan, digest_of(b"layer")))
    await store.delete_ref("trace/gone")
    young = await collect(store, grace=3600)
    assert not [k for k in young.deleted if k.startswith("traces/")]  # inside the grace period
    assert await store.get_trace(gone.digest) is not None
    dry = await collect(store, grace=0, dry_run=True)
    assert {trace_key(gone.digest), trace_key(orphan)} <= set(dry.deleted)
    assert trace_key(keep.digest) not in dry.deleted
    report = await collect(store, grace=0)
    assert {trace_key(gone.digest), trace_key(orphan), doc_key(gone.digest)} <= set(report.deleted)
    assert await store.get_trace(gone.digest) is None
    assert await store.get_trace(orphan) is None
    assert await store.get_trace(keep.digest) is not None
    assert [i.key async for i in store.backend.list("traces/")] == [trace_key(keep.digest)]


@pytest.mark.asyncio
async def test_a_layer_trace_lives_while_a_reachable_document_has_the_layer(store: Store, tmp_path: Path) -> None:
    base = await publish(store, str(make_tree(tmp_path / "b", {"b/file": os.urandom(10_000)})), "lt/base")
    gone = await publish(store, str(make_tree(tmp_path / "g", {"g/file": os.urandom(10_000)})), "lt/gone")
    layers = {}
    for ref, pub in (("lt/base", base), ("lt/gone", gone)):
        layer = (await store.resolve(pub.digest)).layers[0].digest
        await store.put_trace(layer, _trace(layer, layer, bytes(32)))
        layers[ref] = layer
    assert (await store.get_trace(layers["lt/base"]))["layers"] == {layers["lt/base"]: [bytes(32).hex()]}
    await store.compose("lt/env", {"base": "lt/base", "workspace": "lt/gone"})
    for ref in ("lt/base", "lt/gone"):
        await store.delete_ref(ref)
    report = await collect(store, grace=0)  # the composition keeps both layers, and their traces
    assert not [k for k in report.deleted if k.startswith("traces/")]
    await store.delete_ref("lt/env")
    report = await collect(store, grace=0)
    assert {trace_key(layers["lt/base"]), trace_key(layers["lt/gone"])} <= set(report.deleted)
    assert [i.key async for i in store.backend.list("traces/")] == []


@pytest.mark.asyncio
async def test_what_other_packages_ask_of_a_store(store: Store, tmp_path: Path) -> None:
    """The Store methods lazyfetch, snapshots, sandbox and tools use instead of its backend."""
    await publish(store, str(make_tree(tmp_path / "m", {"m/file": os.urandom(300_000)})), "api/img")
    (layer,) = (await store.resolve("api/img")).layers
    assert await store.missing_objects([layer]) == []
    await store.load_layer_locations(layer)
    digest = ErofsImage(await store.get_meta(layer.digest), layer.digest).blob_map[0].digest
    loc = store.locate(digest)
    assert loc is not None
    assert loc.pack.hex() in layer.packs
    assert store.locate(bytes(32)) is None
    frame = await store.read_pack_range(loc.pack, loc.offset, loc.offset + loc.length)
    assert decompress(frame, loc.raw_length) == await store.read_chunk(digest)
    async with store.writer_lock("checkpoint") as held:
        assert held.startswith("locks/publish-")
        with pytest.raises(StoreLocked):
            await collect(store, grace=0)
    assert store.cache_path.is_dir()
    found = await store.check_conditional_writes()
    if store.url.startswith("file://"):
        assert (found.kind, found.endpoint, found.support) == ("posix", None, None)
    else:
        assert (found.kind, found.support is not None) == ("s3", True)
        assert found.endpoint
    await store.backend.delete(pack_key(loc.pack))
    assert await store.missing_objects([layer, layer]) == [pack_key(loc.pack)]
    with pytest.raises(ObjectNotFound):
        await store.read_pack_range(loc.pack, 0, 10)
