"""`layerbox sync`: refs copied between real stores (file, moto S3), only missing objects moved.

The figures the tests compare against (distinct chunks, stored bytes) are computed here
from the source store's layer entries, blob maps and pack indexes, not taken from the
sync's own report.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from converters.publish import publish
from layerstore.backend import TransientError
from layerstore.backends.wrappers import FaultyBackend
from layerstore.eligibility import SCHEMA_ELIGIBILITY, Eligibility, PolicyError, why_not_eligible
from layerstore.erofs.reader import ErofsImage
from layerstore.objects import (
    SCHEMA_TRACE,
    DigestMismatch,
    digest_of,
    doc_key,
    index_key,
    meta_key,
    pack_key,
    trace_key,
)
from layerstore.replicate import replicate
from layerstore.store import Store
from layerstore.verify import verify
from tests.support.env import FIXTURE_IMAGE, unavailable
from tests.support.moto import MotoServer, aws_test_env, moto_fixture  # noqa: F401
from tests.support.real_s3 import use_server
from tests.support.registry import LayoutBuilder, tar_of
from tests.test_store import make_tree, read_back

moto = moto_fixture("module")
LAYERBOX = str(Path(sys.executable).with_name("layerbox"))


def _url(kind: str, tmp_path: Path, name: str, request: pytest.FixtureRequest) -> str:
    if kind == "file":
        return f"file://{tmp_path / name}"
    server: MotoServer = request.getfixturevalue("moto")
    return f"s3://{server.new_bucket()}/{name}"


@pytest_asyncio.fixture(params=["file-file", "file-moto", "moto-file"])
async def stores(request: pytest.FixtureRequest, tmp_path: Path,
                 monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[Store, Store]]:
    """A source and a destination store (kinds from the param), each with its own host cache."""
    kinds = request.param.split("-")
    if "moto" in kinds:
        use_server(monkeypatch, tmp_path, request.getfixturevalue("moto"))
    src = await Store.open(_url(kinds[0], tmp_path, "src", request), tmp_path / "src-host")
    dst = await Store.open(_url(kinds[1], tmp_path, "dst", request), tmp_path / "dst-host")
    try:
        yield src, dst
    finally:
        await src.close()
        await dst.close()


@pytest_asyncio.fixture
async def file_pair(tmp_path: Path) -> AsyncIterator[tuple[Store, Store]]:
    """Two file stores, source and destination."""
    async with await Store.open(f"file://{tmp_path / 'src'}", tmp_path / "h1") as src, \
            await Store.open(f"file://{tmp_path / 'dst'}", tmp_path / "h2") as dst:
        yield src, dst


def shared_base_trees(tmp_path: Path) -> dict[str, dict[str, bytes]]:
    """Two trees that share a big file (so their images share its chunks) and differ in one."""
    big = os.urandom(3 << 20)
    return {
        "app/one:1": {"base/big.bin": big, "one.txt": b"one\n" * 1000, "one.bin": os.urandom(500_000)},
        "app/two:1": {"base/big.bin": big, "two.txt": b"two\n" * 1000, "two.bin": os.urandom(700_000)},
    }


async def publish_shared(store: Store, tmp_path: Path) -> dict[str, dict[str, bytes]]:
    """Publish :func:`shared_base_trees` to ``store``; returns them by ref name."""
    trees = shared_base_trees(tmp_path)
    for name, files in trees.items():
        await publish(store, str(make_tree(tmp_path / "trees" / name.replace("/", "_"), files)), name)
    return trees


async def chunk_frames(store: Store, name: str) -> dict[bytes, int]:
    """Chunk digest -> compressed frame length, for every chunk of ``name``'s layers."""
    out = {}
    for layer in (await store.resolve(name, refresh=True)).layers:
        await store.load_layer_locations(layer)
        for rec in ErofsImage(await store.get_meta(layer.digest), layer.digest).blob_map:
            loc = store.locate(rec.digest)
            assert loc is not None
            assert loc.pack.hex() in layer.packs  # where its layer entry says
            out[rec.digest] = loc.length
    return out


async def independent_figures(store: Store, names: Iterable[str]) -> dict[str, int]:
    """What the refs ``names`` reach in ``store``, summed here without layerstore/replicate.py:
    ``chunk_bytes`` (compressed frames of the distinct chunks), ``chunk_bytes_per_image``
    (the same, counted per ref), and ``stored`` (packs, index copies, metadata and documents)."""
    chunks: dict[bytes, int] = {}
    per_image = 0
    keys: set[str] = set()
    for name in names:
        resolved = await store.resolve(name, refresh=True)
        pending = [resolved.digest]
        while pending:  # the documents: parts of compositions, parents of checkpoints
            digest = pending.pop()
            keys.add(doc_key(digest))
            doc = await store.get_doc(digest)
            pending += [p["digest"] for p in (doc.get("parts") or {}).values()]
            pending += [doc["parent"]] if doc.get("parent") else []
            pending += list((doc.get("attachments") or {}).values())
            for layer in (await store.resolve(digest)).layers:
                keys.add(meta_key(layer.digest))
                keys.update(k(p) for p in layer.packs for k in (pack_key, index_key))
        mine = await chunk_frames(store, name)
        chunks.update(mine)
        per_image += sum(mine.values())
    stored = 0
    for key in keys:
        info = await store.backend.head(key)
        assert info is not None, key
        stored += info.size
    return {"chunk_bytes": sum(chunks.values()), "chunk_bytes_per_image": per_image, "stored": stored}


@pytest.mark.asyncio
async def test_shared_chunks_move_once_and_a_second_sync_moves_nothing(
        stores: tuple[Store, Store], tmp_path: Path) -> None:
    src, dst = stores
    trees = await publish_shared(src, tmp_path)
    expected = await independent_figures(src, trees)
    assert expected["chunk_bytes_per_image"] > expected["chunk_bytes"] + (3 << 20) // 2  # the shared file counts twice

    first = await replicate(src, dst, jobs=3)
    assert first.ok
    assert {(r.name, r.status) for r in first.refs} == {(n, "copied") for n in trees}
    assert first.chunk_bytes_moved == expected["chunk_bytes"]  # each shared chunk moved once
    assert first.chunks_redundant == 0
    assert first.bytes_moved == expected["stored"] == first.bytes_total
    assert first.moved["packs"] == first.moved["indexes"] >= 2
    assert first.logical_bytes == sum(len(d) for files in trees.values() for d in files.values())
    for name, files in trees.items():
        assert await read_back(dst, name) == files
        assert (await dst.read_ref(name)).digest == (await src.read_ref(name)).digest
    assert (await verify(dst)).ok

    second = await replicate(src, dst)
    assert second.ok
    assert {r.status for r in second.refs} == {"unchanged"}
    assert second.bytes_moved == 0
    assert sum(second.moved.values()) == 0
    assert sum(second.skipped.values()) == sum(first.moved.values())
    assert second.chunks_skipped == first.chunks_moved


@pytest.mark.asyncio
async def test_the_traces_of_reached_documents_and_layers_move_with_them(
        file_pair: tuple[Store, Store], tmp_path: Path) -> None:
    src, dst = file_pair
    await publish_shared(src, tmp_path)
    one = await src.resolve("app/one:1")
    layer = one.layers[0].digest
    chunk = [bytes(32).hex()]
    await src.put_trace(one.digest, {"schema": SCHEMA_TRACE, "image": one.digest, "layers": {layer: chunk}})
    await src.put_trace(layer, {"schema": SCHEMA_TRACE, "image": layer, "layers": {layer: chunk}})
    stray = digest_of(b"a layer no ref reaches")
    await src.put_trace(stray, {"schema": SCHEMA_TRACE, "image": stray, "layers": {stray: chunk}})
    report = await replicate(src, dst, ["app/one:1"])
    assert report.moved["traces"] == 2
    assert (await dst.get_trace(layer))["layers"] == {layer: chunk}
    assert (await dst.get_trace(one.digest))["layers"] == {layer: chunk}
    assert await dst.backend.head(trace_key(stray)) is None


@pytest.mark.asyncio
async def test_one_image_then_the_other_moves_only_the_new_chunks(
        file_pair: tuple[Store, Store], tmp_path: Path) -> None:
    src, dst = file_pair
    trees = await publish_shared(src, tmp_path)
    one = await replicate(src, dst, ["app/one"])
    assert [r.name for r in one.refs] == ["app/one:1"]
    two = await replicate(src, dst, ["app/two"])
    both = await independent_figures(src, trees)
    only_one = await independent_figures(src, ["app/one:1"])
    assert one.chunk_bytes_moved == only_one["chunk_bytes"]
    assert two.chunk_bytes_moved == both["chunk_bytes"] - only_one["chunk_bytes"]  # the shared pack stayed
    assert two.skipped["packs"] >= 1
    assert await read_back(dst, "app/two:1") == trees["app/two:1"]


@pytest.mark.asyncio
async def test_chunks_the_destination_holds_in_its_own_packs_move_again_and_are_reported(
        file_pair: tuple[Store, Store], tmp_path: Path) -> None:
    """The documented gap: a pack moves whole, also when the destination has some of its
    chunks in a pack of its own; the report counts those chunks as redundant."""
    src, dst = file_pair
    trees = await publish_shared(src, tmp_path)
    big = {"base/big.bin": trees["app/one:1"]["base/big.bin"]}
    async with await Store.open(dst.url, tmp_path / "other-host") as elsewhere:  # dst's cache knows nothing of it
        await publish(elsewhere, str(make_tree(tmp_path / "theirs", big)), "local/big:1")  # packed on its own
        theirs = await chunk_frames(elsewhere, "local/big:1")
    ours = await chunk_frames(src, "app/one:1")
    report = await replicate(src, dst, ["app/one"])
    assert report.chunks_redundant == len(theirs)
    assert report.chunk_bytes_redundant == sum(ours[d] for d in theirs) > 0
    assert report.chunk_bytes_moved == sum(ours.values())


def labeled_image(tmp_path: Path, name: str, files: dict[str, bytes], labels: dict[str, str] | None) -> str:
    layout = LayoutBuilder(tmp_path / "oci" / name)
    layout.tag(layout.image([tar_of(files)], labels=labels), "latest")
    return f"oci:{layout.root}:latest"


@pytest.mark.asyncio
async def test_eligible_only_copies_by_prefix_and_label_and_refuses_mixed_compositions(
        stores: tuple[Store, Store], tmp_path: Path) -> None:
    src, dst = stores
    await publish(src, str(make_tree(tmp_path / "base", {"etc/os": b"team base\n"})), "team/base:1")
    await publish(src, labeled_image(tmp_path, "tk", {"opt/tk": b"toolkit"}, {"burst": "yes", "x": "y"}), "vendor/tk:1")
    await publish(src, labeled_image(tmp_path, "secret", {"opt/s": b"secret"}, {"burst": "no"}), "vendor/secret:1")
    await src.compose("env/ok:1", {"base": "team/base:1", "toolkit": "vendor/tk:1"})
    await src.compose("env/bad:1", {"base": "team/base:1", "toolkit": "vendor/secret:1"})
    policy = Eligibility(prefixes=("team/",), labels={"burst": "yes"})

    report = await replicate(src, dst, ["team/", "vendor/", "env/"], policy=policy)
    status = {r.name: r.status for r in report.refs}
    assert status == {"team/base:1": "copied", "vendor/tk:1": "copied", "vendor/secret:1": "ineligible",
                      "env/ok:1": "copied", "env/bad:1": "ineligible"}
    reasons = {r.name: r.reason for r in report.refs}
    assert "toolkit part vendor/secret:1" in reasons["env/bad:1"]
    assert "burst=yes" in reasons["vendor/secret:1"]
    assert report.ok  # ineligible refs are left out on purpose, not refused
    assert sorted(r.name for r in await dst.list_refs()) == ["env/ok:1", "team/base:1", "vendor/tk:1"]
    secret = await src.resolve("vendor/secret:1")
    assert await dst.backend.head(doc_key(secret.digest)) is None
    assert await dst.backend.head(meta_key(secret.layers[-1].digest)) is None  # not one object of it moved
    assert (await verify(dst, "env/ok:1")).ok

    # a composition's own name does not make it eligible: every part must be
    by_name = await replicate(src, dst, ["env/"], policy=Eligibility(prefixes=("env/",)))
    assert {r.status for r in by_name.refs} == {"ineligible"}
    # the fleet asks the same question of one ref; exact names select exactly
    assert await why_not_eligible(src, policy, "env/ok:1") is None
    assert "vendor/secret:1" in (await why_not_eligible(src, policy, "env/bad:1") or "")
    exact = await replicate(src, dst, names=["team/base:1"])
    assert [(r.name, r.status) for r in exact.refs] == [("team/base:1", "unchanged")]


@pytest.mark.asyncio
async def test_a_destination_ref_that_points_elsewhere_is_refused_by_name_unless_forced(
        file_pair: tuple[Store, Store], tmp_path: Path) -> None:
    src, dst = file_pair
    await publish_shared(src, tmp_path)
    theirs = await publish(dst, str(make_tree(tmp_path / "theirs", {"x": b"other"})), "app/one:1")
    report = await replicate(src, dst)
    (one,) = report.with_status("conflict")
    assert one.name == "app/one:1"
    assert "app/one:1" in one.reason
    assert theirs.digest in one.reason
    assert not report.ok
    assert (await dst.read_ref("app/one:1")).digest == theirs.digest  # not clobbered
    assert (await dst.read_ref("app/two:1")).digest == (await src.read_ref("app/two:1")).digest
    only_one = (await src.resolve("app/one:1")).layers[0]
    assert await dst.backend.head(meta_key(only_one.digest)) is None  # the refused ref's data stayed home

    forced = await replicate(src, dst, force=True)
    assert forced.ok
    assert {r.name: r.status for r in forced.refs} == {"app/one:1": "moved", "app/two:1": "unchanged"}
    moved = await dst.read_ref("app/one:1")
    assert moved.digest == (await src.read_ref("app/one:1")).digest
    assert moved.history[0]["digest"] == theirs.digest  # the old value stays in the history
    assert (await verify(dst)).ok


@pytest.mark.asyncio
@pytest.mark.parametrize(("dst_kind", "fault"), [("file", "pack"), ("moto", "pack"), ("file", "ref"), ("moto", "ref")])
async def test_an_interrupted_sync_leaves_no_ref_to_missing_objects_and_a_retry_completes(
        dst_kind: str, fault: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        request: pytest.FixtureRequest) -> None:
    """``pack``: the destination fails for good right after the first pack is written (its
    index copy is not); ``ref``: the first ref write fails, every object being in."""
    if dst_kind == "moto":
        use_server(monkeypatch, tmp_path, request.getfixturevalue("moto"))
    dst_url = _url(dst_kind, tmp_path, "dst", request)
    async with await Store.open(f"file://{tmp_path / 'src'}", tmp_path / "h1") as src:
        trees = await publish_shared(src, tmp_path)
        expected = await independent_figures(src, trees)
        async with await Store.open(dst_url, tmp_path / "h2") as dst:
            faulty = FaultyBackend(dst.backend)
            dst.backend = faulty
            written: list[str] = []

            def progress(kind: str, size: int) -> None:
                written.append(kind)
                if kind == "packs" and fault == "pack":
                    faulty.fail_everything = True

            if fault == "ref":
                faulty.fail_next("put_conditional")
            with pytest.raises(TransientError):
                await replicate(src, dst, jobs=1, progress=progress)
            faulty.fail_everything = False
            assert await dst.list_refs() == []  # the refs come last: none names a missing object
            docs = [i.key async for i in dst.backend.list("docs/")]
            if fault == "pack":
                assert written == ["packs"]
                assert docs == []
            else:
                assert sorted(docs) == sorted([doc_key((await src.read_ref(n)).digest) for n in trees])

            retry = await replicate(src, dst)
            assert retry.ok
            assert {r.status for r in retry.refs} == {"copied"}
            if fault == "pack":
                assert retry.skipped["packs"] == 1
                assert retry.moved["indexes"] == retry.moved["packs"] + 1  # the first pack's copy
            else:
                assert retry.bytes_moved == 0
            assert (await verify(dst)).ok
            assert retry.bytes_total == expected["stored"]
            for name, files in trees.items():
                assert await read_back(dst, name) == files


@pytest.mark.asyncio
async def test_a_corrupt_source_pack_is_never_written_to_the_destination(
        file_pair: tuple[Store, Store], tmp_path: Path) -> None:
    src, dst = file_pair
    await publish(src, str(make_tree(tmp_path / "t", {"f": os.urandom(100_000)})), "bad/img:1")
    (pack,) = (await src.resolve("bad/img:1")).layers[0].packs
    path = tmp_path / "src" / pack_key(pack)
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF
    path.write_bytes(bytes(data))

    with pytest.raises(DigestMismatch, match=pack_key(pack)):
        await replicate(src, dst)
    assert await dst.backend.head(pack_key(pack)) is None
    assert await dst.list_refs() == []


@pytest.mark.asyncio
async def test_two_syncs_into_one_destination_at_once_write_each_object_once(
        file_pair: tuple[Store, Store], tmp_path: Path) -> None:
    src, dst = file_pair
    trees = await publish_shared(src, tmp_path)
    async with await Store.open(dst.url, tmp_path / "h3") as dst2:  # a second host syncing too
        a, b = await asyncio.gather(replicate(src, dst, jobs=2), replicate(src, dst2, jobs=2))
    assert a.ok
    assert b.ok
    statuses = sorted(r.status for r in [*a.refs, *b.refs])
    assert statuses.count("copied") + statuses.count("unchanged") == 2 * len(trees)
    packs = len({p for n in trees for layer in (await src.resolve(n)).layers for p in layer.packs})
    assert a.moved["packs"] + b.moved["packs"] == packs  # put_if_absent: one writer wins each
    assert (await verify(dst)).ok
    for name, files in trees.items():
        assert await read_back(dst, name) == files


@pytest.mark.asyncio
async def test_a_source_ref_that_reaches_a_missing_document_fails_alone(
        file_pair: tuple[Store, Store], tmp_path: Path) -> None:
    src, dst = file_pair
    await publish_shared(src, tmp_path)
    gone = (await src.read_ref("app/two:1")).digest
    (tmp_path / "src" / doc_key(gone)).unlink()
    async with await Store.open(src.url, tmp_path / "fresh-host") as fresh:  # no cached copy of it
        report = await replicate(fresh, dst)
    assert not report.ok
    assert {r.name: r.status for r in report.refs} == {"app/one:1": "copied", "app/two:1": "failed"}
    (failed,) = report.with_status("failed")
    assert "app/two:1" in failed.reason
    assert "layerbox verify" in failed.reason
    assert [r.name for r in await dst.list_refs()] == ["app/one:1"]


@pytest.mark.root("erofs", "overlay", "fuse")
@pytest.mark.usefixtures("need_root")
def test_a_checkpoint_chain_syncs_and_restores_identically_from_the_destination(hosts, tmp_path: Path) -> None:
    from snapshots.checkpoint import Snapshots
    from tests.support.treecmp import assert_trees_equal

    src_url, dst_url = f"file://{tmp_path / 'src'}", f"file://{tmp_path / 'dst'}"
    base = make_tree(tmp_path / "base", {"etc/config": b"base\n", "big.bin": os.urandom(2 << 20)})
    asyncio.run(_publish_at(src_url, tmp_path / "pub", str(base), "img/base:1"))
    h1 = hosts(src_url, "h1")
    mnt = h1.mount("img/base:1", writable=True)
    names, views = [], []
    for i in range(3):
        (mnt / f"step-{i}").write_bytes(os.urandom(50_000))
        (mnt / "etc/config").write_text(f"step {i}\n")
        names.append(asyncio.run(_checkpoint(h1, mnt)))
        views.append(tmp_path / f"view-{i}")
        subprocess.run(["cp", "-a", "--preserve=all", f"{mnt}/.", str(views[-1])], check=True)

    async def sync() -> Any:
        async with await Store.open(src_url, tmp_path / "s1") as src, \
                await Store.open(dst_url, tmp_path / "s2") as dst:
            # checkpoints are eligible through the image they started from
            report = await replicate(src, dst, ["checkpoints/"], policy=Eligibility(prefixes=("img/",)))
            return report, [await verify(dst, n) for n in names]

    report, checks = asyncio.run(sync())
    assert report.ok
    assert {r.name: r.status for r in report.refs} == dict.fromkeys(names, "copied")
    assert all(c.ok for c in checks)
    assert report.moved["docs"] >= 4  # three checkpoints and the image they continue
    h2 = hosts(dst_url, "h2")
    for name, view in zip(names, views, strict=True):
        mp = tmp_path / f"restored-{len(h2.points)}"
        mp.mkdir()

        async def restore(name: str = name, mp: Path = mp) -> None:
            async with await Store.open(dst_url, h2.data_dir) as store:
                await Snapshots(store, h2.mounts).restore(name, str(mp))

        asyncio.run(restore())
        h2.points.append(mp)
        assert_trees_equal(view, mp, check_root_meta=False)


async def _publish_at(url: str, data_dir: Path, src: str, name: str) -> None:
    async with await Store.open(url, data_dir) as store:
        await publish(store, src, name)


async def _checkpoint(host: Any, mnt: Path) -> str:
    from snapshots.checkpoint import Snapshots

    async with await Store.open(host.url, host.data_dir) as store:
        return (await Snapshots(store, host.mounts).checkpoint(str(mnt))).name


def test_the_policy_round_trips_as_versioned_json_and_bad_ones_are_named(tmp_path: Path) -> None:
    policy = Eligibility(prefixes=("team/", "public/"), labels={"burst": "yes"})
    doc = policy.to_json()
    assert doc == {"schema": SCHEMA_ELIGIBILITY, "prefixes": ["team/", "public/"], "labels": {"burst": "yes"}}
    assert Eligibility.from_json(json.loads(json.dumps(doc))) == policy
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(doc))
    assert Eligibility.load(path) == policy
    for bad, field in (({**doc, "schema": "layerbox.eligibility.v2"}, "layerbox.eligibility.v1"),
                       ({**doc, "extra": 1}, "'extra'"), ({**doc, "prefixes": "team/"}, "'prefixes'"),
                       ({**doc, "prefixes": [""]}, "'prefixes'"), ({**doc, "labels": {"k": 1}}, "'labels'")):
        with pytest.raises(PolicyError, match=field):
            Eligibility.from_json(bad)
    path.write_text("{not json")
    with pytest.raises(PolicyError, match=str(path)):
        Eligibility.load(path)


def test_cli_sync_reports_json_refuses_conflicts_by_name_and_checks_its_flags(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    env = {**os.environ, "LAYERBOX_DATA_DIR": str(tmp_path / "host")}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([LAYERBOX, *args], capture_output=True, text=True, timeout=300, env=env)

    for name, files in shared_base_trees(tmp_path).items():
        tree = make_tree(tmp_path / name.replace("/", "_"), files)
        assert cli("publish", str(tree), "--name", name, "--store", str(src)).returncode == 0
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps(Eligibility(prefixes=("app/one",)).to_json()))
    out = cli("sync", str(src), f"file://{dst}", "--eligible-only", "--policy", str(policy), "--json", "--jobs", "2")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert {r["name"]: r["status"] for r in report["refs"]} == {"app/one:1": "copied", "app/two:1": "ineligible"}
    assert report["bytes_moved"] > 0
    assert report["bytes_total"] == report["bytes_moved"]
    assert report["objects_moved"] == sum(report["moved"].values())
    again = json.loads(cli("sync", str(src), str(dst), "app/one", "--json").stdout)
    assert again["bytes_moved"] == 0
    assert again["refs"][0]["status"] == "unchanged"

    other = make_tree(tmp_path / "other", {"o": b"other"})
    assert cli("publish", str(other), "--name", "app/two:1", "--store", str(dst)).returncode == 0
    refused = cli("sync", str(src), str(dst))
    assert refused.returncode == 3
    assert "conflict app/two:1" in refused.stderr
    assert "--force" in refused.stderr
    assert "conflict" in refused.stdout  # the human report lists it too
    assert cli("sync", str(src), str(dst), "--force").returncode == 0

    for flags, message in ((["--eligible-prefix", "app/"], "--eligible-only"),
                           (["--eligible-only"], "needs a policy"),
                           (["--eligible-only", "--eligible-label", "novalue"], "KEY=VALUE"),
                           (["--eligible-only", "--policy", str(policy), "--eligible-prefix", "x"], "not both"),
                           (["--jobs", "0"], "1 or more")):
        bad = cli("sync", str(src), str(dst), *flags)
        assert bad.returncode != 0, flags
        assert message in bad.stderr, (flags, bad.stderr)


@pytest.mark.asyncio
async def test_fixture_images_sync_moves_their_shared_base_once(
        file_pair: tuple[Store, Store], tmp_path: Path) -> None:
    if not FIXTURE_IMAGE.exists():
        unavailable(f"{FIXTURE_IMAGE} is absent (the shared fixtures are not beside this checkout)")
    src, dst = file_pair
    await publish(src, f"oci-archive:{FIXTURE_IMAGE}:minbase", "debian/minbase:1")
    await publish(src, f"oci-archive:{FIXTURE_IMAGE}:python", "debian/python:1")
    names = ["debian/minbase:1", "debian/python:1"]
    expected = await independent_figures(src, names)
    report = await replicate(src, dst, ["debian/"])
    assert report.ok
    assert report.chunk_bytes_moved == expected["chunk_bytes"] < expected["chunk_bytes_per_image"]
    assert report.bytes_moved == expected["stored"]
    print(f"\nfixture sync: moved {report.bytes_moved} bytes ({report.chunks_moved} chunks) for "
          f"{expected['chunk_bytes_per_image']} bytes of chunks counted per image; "
          f"{report.logical_bytes} bytes of file data")
    for name in names:
        assert (await verify(dst, name)).ok
    assert (await replicate(src, dst, ["debian/"])).bytes_moved == 0
