"""Store safety fixes, on both backends: gc vs. lying index copies and concurrent writers,
retried ref writes, strict refs, leftovers, the store's layout version, stale host caches.

Each test here failed before its fix (docs/FORMAT.md, "Store known gaps" lists what is left).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import time
from pathlib import Path

import blake3
import boto3
import pytest

from converters.layer import convert
from converters.publish import LocalLayer, publish, sweep_work_dirs, upload_layers
from layerstore.backends.wrappers import FaultyBackend, RetryingBackend
from layerstore.errors import FormatError
from layerstore.gc import collect
from layerstore.locks import StoreLocked, store_lock
from layerstore.objects import (
    CONFIG_KEY,
    ImageDoc,
    StoreVersionError,
    canonical,
    doc_key,
    index_key,
    pack_key,
    ref_key,
)
from layerstore.packs import PACK_RECORD
from layerstore.store import Store, UploadStats
from layerstore.verify import verify
from tests.support.moto import (  # noqa: F401
    MotoServer,
    aws_test_env,
    file_and_s3_store_url,
    moto_fixture,
    opened_store,
)
from tests.test_store import make_tree, read_back

moto = moto_fixture("module")


async def _only_pack(store: Store) -> str:
    packs = [info.key async for info in store.backend.list("packs/")]
    assert len(packs) == 1, packs
    return packs[0]


# -- gap 3: gc must not trust index copies --------------------------------------------------


@pytest.mark.asyncio
async def test_gc_keeps_a_live_pack_whose_index_copy_lies(store: Store, tmp_path: Path) -> None:
    files = {"f": os.urandom(300_000)}
    await publish(store, str(make_tree(tmp_path / "t", files)), "gc/live")
    pack = await _only_pack(store)
    pack_hex = pack.rsplit("/", 1)[-1]
    copy = await store.backend.get(index_key(pack_hex))
    # right length, wrong records: every digest zeroed
    lie = b"".join(bytes(32) + copy[i + 32 : i + PACK_RECORD.size] for i in range(0, len(copy), PACK_RECORD.size))
    await store.backend.delete(index_key(pack_hex))
    await store.backend.put(index_key(pack_hex), lie)
    report = await collect(store, grace=0)
    assert pack not in report.deleted
    assert index_key(pack_hex) not in report.deleted
    assert report.disagreeing_index_copies == [index_key(pack_hex)]
    assert await store.backend.head(pack) is not None
    # the store still holds every chunk: restore the copy and read the image on a fresh host
    await store.backend.delete(index_key(pack_hex))
    await store.backend.put(index_key(pack_hex), copy)
    async with await Store.open(store.url, tmp_path / "fresh") as fresh:
        assert await read_back(fresh, "gc/live") == files


@pytest.mark.asyncio
async def test_gc_keeps_and_names_a_pack_it_cannot_read(store: Store, tmp_path: Path) -> None:
    garbage = os.urandom(1000)
    key = pack_key(blake3.blake3(garbage).hexdigest())
    await store.backend.put(key, garbage)  # no index copy, no footer
    report = await collect(store, grace=0)
    assert key not in report.deleted
    assert report.unreadable_packs == [key]
    assert await store.backend.head(key) is not None


# -- gap 9: compose and tag hold the shared writer lock ----------------------------------------


@pytest.mark.asyncio
async def test_compose_and_tag_are_refused_while_gc_runs(store: Store, tmp_path: Path) -> None:
    await publish(store, str(make_tree(tmp_path / "b", {"x": b"base"})), "lk/base")
    async with store_lock(store.backend, "gc"):
        with pytest.raises(StoreLocked):
            await store.compose("lk/env", {"base": "lk/base"})
        with pytest.raises(StoreLocked):
            await store.tag("lk/base", "lk/other")
    assert [r.name for r in await store.list_refs("lk/")] == ["lk/base:latest"]


@pytest.mark.asyncio
async def test_gc_is_refused_while_compose_runs(store: Store, tmp_path: Path) -> None:
    await publish(store, str(make_tree(tmp_path / "b", {"x": b"base"})), "lk/base")
    async with await Store.open(store.url, tmp_path / "composer") as composer:
        faulty = FaultyBackend(composer.backend)
        composer.backend = faulty
        faulty.stall_next("put_if_absent", 1, 3600.0)  # the composition document's write
        task = asyncio.create_task(composer.compose("lk/env", {"base": "lk/base"}))
        while faulty.calls["put_if_absent"] == 0 and not task.done():  # noqa: ASYNC110 (no hook to signal)
            await asyncio.sleep(0.01)  # until compose has resolved its parts and holds its lock
        assert not task.done(), task.exception()
        try:
            with pytest.raises(StoreLocked, match="locks/publish-"):
                await collect(store, grace=0)
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    assert [i async for i in store.backend.list("locks/")] == []  # the cancelled compose let go


# -- gap 12: a retried ref write adds no duplicate history entry --------------------------------


def _lossy(store: Store) -> FaultyBackend:
    """Put a fault injector under the store's retry wrapper (as the network would fail)."""
    assert isinstance(store.backend, RetryingBackend)
    faulty = FaultyBackend(store.backend.inner)
    store.backend = RetryingBackend(faulty, base_delay=0.0)
    return faulty


@pytest.mark.asyncio
async def test_retried_ref_write_adds_no_history_entry(store: Store) -> None:
    docs = [await store.put_doc({"schema": "layerbox.image.v1", "layers": [], "config": {"n": i},
                                 "source": {}}) for i in range(3)]
    faulty = _lossy(store)
    faulty.lose_reply_next("put_conditional")  # the ref is created, the reply is lost
    created = await store.set_ref("h/r", docs[0], "image")
    assert (await store.read_ref("h/r")).history == ()
    assert created.etag == (await store.read_ref("h/r")).etag
    await store.set_ref("h/r", docs[1], "image")
    faulty.lose_reply_next("put_conditional")  # the ref is moved, the reply is lost
    moved = await store.set_ref("h/r", docs[2], "image")
    ref = await store.read_ref("h/r")
    assert ref.digest == docs[2]
    assert [h["digest"] for h in ref.history] == [docs[1], docs[0]]
    assert moved.etag == ref.etag
    assert faulty.calls["put_conditional"] == 5  # 2 + 1 + 2: no extra round


# -- gap 6: refs are read strictly ---------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(("change", "message"), [
    ({"schema": "layerbox.image.v1"}, "is not 'layerbox.ref.v1'"),
    ({"name": "other/name:latest"}, "names ref 'other/name:latest'"),
    ({"digest": None}, "'digest' must be"),
    ({"digest": "sha256:" + "0" * 64}, "'digest' must be"),
    ({"kind": 3}, "'kind' must be"),
    ({"history": "x"}, "'history' must be"),
])
async def test_malformed_refs_are_refused_with_their_key(store: Store, change: dict, message: str) -> None:
    doc = {"schema": "layerbox.ref.v1", "name": "bad/ref:latest", "digest": "blake3:" + "a" * 64,
           "kind": "image", "updated": "2026-01-01T00:00:00Z", "host": "h", "history": []}
    doc.update(change)
    await store.backend.put(ref_key("bad/ref"), canonical({k: v for k, v in doc.items() if v is not None}))
    with pytest.raises(FormatError, match=message) as info:
        await store.read_ref("bad/ref")
    assert "refs/bad/ref:latest" in str(info.value)
    assert store.url in str(info.value)


# -- gap 11: leftovers -----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_gc_removes_stale_locks_and_old_temp_files(tmp_path: Path) -> None:
    root = tmp_path / "store"
    async with await Store.open(f"file://{root}", tmp_path / "h") as s:
        await publish(s, str(make_tree(tmp_path / "t", {"a": b"1"})), "lo/x")
        day_old, hour_old = "locks/publish-" + "1" * 32, "locks/publish-" + "2" * 32
        for key, age in ((day_old, 2 * 86400), (hour_old, 3600)):
            await s.backend.put(key, b'{"kind": "publish", "host": "gone", "pid": 1, "time": 0}')
            then = time.time() - age
            os.utime(root / key, (then, then))
        fan = next((root / "packs").iterdir())
        old_tmp, new_tmp = fan / ".tmp-00000000000000aa", fan / ".tmp-00000000000000bb"
        old_tmp.write_bytes(b"x")
        new_tmp.write_bytes(b"y")
        os.utime(old_tmp, (time.time() - 7200, time.time() - 7200))
        dry = await collect(s, grace=3600, dry_run=True)
        assert dry.stale_locks == [day_old]
        assert dry.leftovers == [str(old_tmp)]
        assert old_tmp.exists()
        assert (root / day_old).exists()
        report = await collect(s, grace=3600)
        assert report.stale_locks == [day_old]
        assert report.leftovers == [str(old_tmp)]
        assert not old_tmp.exists()
        assert not (root / day_old).exists()
        assert new_tmp.exists()  # young
        assert (root / hour_old).exists()  # stale, but only for an hour
        with pytest.raises(ValueError, match="at least"):
            await collect(s, stale_locks_after=60)


@pytest.mark.asyncio
async def test_gc_aborts_old_incomplete_multipart_uploads(moto: MotoServer, aws_test_env: None,  # noqa: F811
                                                          tmp_path: Path) -> None:
    bucket = moto.new_bucket()
    client = boto3.client("s3", endpoint_url=moto.endpoint)
    client.create_multipart_upload(Bucket=bucket, Key="layerbox/packs/00/" + "0" * 64)
    client.create_multipart_upload(Bucket=bucket, Key="other/thing")  # not under the store's prefix
    async with await Store.open(f"s3://{bucket}/layerbox", tmp_path / "h", s3_endpoint=moto.endpoint) as s:
        # (moto reports every upload as started in 2010, so their age cannot be tested here)
        assert len(await s.backend.sweep_leftovers(3600, dry_run=True)) == 1
        report = await collect(s, grace=0)
    assert len(report.leftovers) == 1
    assert "layerbox/packs/00/" in report.leftovers[0]
    left = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert [u["Key"] for u in left] == ["other/thing"]


def test_killed_publishes_work_dirs_are_swept(tmp_path: Path) -> None:
    dead, live, foreign = tmp_path / "publish-dead", tmp_path / "publish-live", tmp_path / "publish-foreign"
    for d in (dead, live, foreign):
        (d / "work").mkdir(parents=True)
    (dead / "owner").write_text("123 host 0\n")  # its process is gone: nobody holds the lock
    (live / "owner").write_text(f"{os.getpid()} host 0\n")
    fd = os.open(live / "owner", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a running publish holds it
        assert sweep_work_dirs(tmp_path) == [str(dead)]
    finally:
        os.close(fd)
    assert live.exists()
    assert foreign.exists()
    assert not dead.exists()


# -- gap 10: the store's layout version -------------------------------------------------------


@pytest.mark.asyncio
async def test_store_config_is_written_once_and_a_newer_layout_is_refused(store: Store, tmp_path: Path) -> None:
    assert await store.list_refs() == []
    assert await store.backend.head(CONFIG_KEY) is None  # reading an empty store writes nothing
    await publish(store, str(make_tree(tmp_path / "t", {"a": b"1"})), "v/x")
    config = json.loads(await store.backend.get(CONFIG_KEY))
    assert (config["schema"], config["layout"], len(config["id"])) == ("layerbox.store", 1, 32)
    async with await Store.open(store.url, tmp_path / "other") as other:
        await publish(other, str(make_tree(tmp_path / "u", {"b": b"2"})), "v/y")
    assert json.loads(await store.backend.get(CONFIG_KEY)) == config  # put-if-absent: kept
    await store.backend.put(CONFIG_KEY, canonical({**config, "layout": 2}))
    async with await Store.open(store.url, tmp_path / "old") as old:
        with pytest.raises(StoreVersionError, match="layout 2.*upgrade layerbox"):
            await old.list_refs()
        with pytest.raises(StoreVersionError):
            await publish(old, str(make_tree(tmp_path / "w", {"c": b"3"})), "v/z")
        with pytest.raises(StoreVersionError):
            await collect(old, grace=0)
    async with await Store.open(store.url, tmp_path / "old2") as old:
        with pytest.raises(StoreVersionError):
            await old.resolve("v/x")


# -- gap 1 (rest): a writer that does not sync the index first (checkpoints) -------------------


@pytest.mark.asyncio
async def test_unsynced_upload_does_not_dedup_against_a_deleted_pack(store_url: str, tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "t", {"f": os.urandom(200_000)})
    async with await Store.open(store_url, tmp_path / "A") as a, await Store.open(store_url, tmp_path / "B") as b:
        await publish(a, str(tree), "u/n1")
        await publish(b, str(make_tree(tmp_path / "o", {"g": b"other"})), "u/n2")  # B learns n1's pack
        await a.delete_ref("u/n1")
        assert (await collect(a, grace=0)).deleted
        meta, blob = tmp_path / "l.erofs", tmp_path / "l.blob"
        await asyncio.to_thread(convert, str(tree), meta, blob)
        stats = UploadStats()
        entries = await upload_layers(b, [LocalLayer(meta, blob, {})], stats)  # as a checkpoint does
        assert stats.chunks_new > 0
        digest = await b.put_doc(ImageDoc(tuple(entries), {}, {}).to_json())
        await b.set_ref("u/n3", digest, "image")
        assert (await verify(b, "u/n3")).ok


# -- verify reaches everything ----------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_verify_finds_dangling_refs_and_orphan_index_copies(store: Store, tmp_path: Path) -> None:
    await publish(store, str(make_tree(tmp_path / "a", {"f": b"alpha" * 1000})), "v/a")
    assert (await verify(store)).ok
    ghost = "blake3:" + "ab" * 32
    await store.set_ref("v/ghost", ghost, "image")  # a ref whose document never existed
    orphan = index_key("cd" * 32)
    await store.backend.put(orphan, b"\0" * 8)  # an index copy without its pack
    problems = (await verify(store)).problems
    assert any(p.startswith("refs/v/ghost") and ghost in p for p in problems), problems
    assert any(p.startswith(orphan) for p in problems), problems


@pytest.mark.asyncio
async def test_verify_with_a_ref_checks_every_chunk_is_in_a_named_pack(store: Store, tmp_path: Path) -> None:
    await publish(store, str(make_tree(tmp_path / "one", {"f": os.urandom(300_000)})), "v/one")
    await publish(store, str(make_tree(tmp_path / "two", {"g": os.urandom(300_000)})), "v/two")
    one, two = await store.resolve("v/one"), await store.resolve("v/two")
    assert set(one.layers[0].packs) != set(two.layers[0].packs)
    # an image whose layer entry names the wrong packs: every document and image hashes fine
    doc = json.loads(json.dumps(two.doc))
    doc["layers"][0]["packs"] = list(one.layers[0].packs)
    await store.set_ref("v/wrong", await store.put_doc(doc), "image")
    assert (await verify(store, "v/two")).ok
    problems = (await verify(store, "v/wrong")).problems
    assert any("in none of the packs" in p and two.layers[0].digest in p for p in problems), problems


@pytest.mark.asyncio
async def test_verify_with_a_ref_follows_composition_parts(store: Store, tmp_path: Path) -> None:
    await publish(store, str(make_tree(tmp_path / "base", {"b": b"base"})), "v/base")
    await publish(store, str(make_tree(tmp_path / "ws", {"w": b"workspace"})), "v/ws")
    await store.compose("v/env", {"base": "v/base", "workspace": "v/ws"})
    assert (await verify(store, "v/env")).ok
    part = (await store.resolve("v/ws")).digest
    await store.backend.delete(doc_key(part))  # the workspace's own document goes missing
    problems = (await verify(store, "v/env")).problems
    assert any(p.startswith(doc_key(part)) and "missing" in p for p in problems), problems
