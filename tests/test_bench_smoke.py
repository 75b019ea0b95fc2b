"""bench/convert.py runs end to end on a small generated layer and reports consistent figures.

No timing thresholds: only that every figure is there, positive and agrees
with what the test put into the layer.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.env import FIXTURE_IMAGE, require
from tests.support.proc import run
from tests.support.tarbuild import TarBuilder

BENCH = Path(__file__).resolve().parents[1] / "bench" / "convert.py"
# erofs-utils 1.8 as bench/peers/erofs-utils.sh leaves it; measured when it is there
EROFS18 = Path(os.environ.get("LAYERBOX_PEERS_DIR", "/var/cache/layerbox/peers")) / "erofs-utils-1.8"
CHUNK = 64 << 10
DIRS = 10
SMALL_FILES = 250
BIG_FILES = 8  # copies of BIG_DISTINCT contents, so chunks dedup
BIG_DISTINCT = 2
BIG_SIZE = 200 << 10  # 3.125 chunks of CHUNK: the last chunk is short


def _make_layer(path: Path) -> dict[str, int]:
    rng = random.Random(20240601)
    tar = TarBuilder()
    file_bytes = unique_bytes = regular = 0
    for i in range(SMALL_FILES):
        data = rng.randbytes(rng.randint(2 << 10, 16 << 10))
        tar.file(f"d{i % DIRS:02d}/small-{i:03d}.bin", data)
        file_bytes += len(data)
        unique_bytes += len(data)
        regular += 1
    bigs = [rng.randbytes(BIG_SIZE) for _ in range(BIG_DISTINCT)]
    unique_bytes += BIG_DISTINCT * BIG_SIZE
    for i in range(BIG_FILES):
        tar.file(f"d{i % DIRS:02d}/big-{i}.bin", bigs[i % BIG_DISTINCT], mode=0o755)
        file_bytes += BIG_SIZE
        regular += 1
    tar.symlink("d00/link", "small-000.bin")
    tar.hardlink("d01/hard", "d00/small-000.bin")  # same inode, data counted once
    raw = tar.bytes()
    compressed = gzip.compress(raw, compresslevel=6)
    path.write_bytes(compressed)
    return {
        # inodes: the files, the directories, the symlink and the root directory
        "files": regular + DIRS + 1 + 1,
        "file_bytes": file_bytes,
        "unique_bytes": unique_bytes,
        "tar_bytes": len(raw),
        "compressed_bytes": len(compressed),
    }


def _positive(doc: dict[str, Any], *keys: str) -> None:
    for key in keys:
        value = doc[key]
        assert value is not None, key
        assert value > 0, (key, value)


@pytest.mark.slow
def test_bench_convert_json_on_small_layer(tmp_path: Path) -> None:
    require("cmd:mkfs.erofs")
    require("cmd:tar")
    layer = tmp_path / "layer.tar.gz"
    made = _make_layer(layer)
    work = tmp_path / "work"
    work.mkdir()
    with_peer = (EROFS18 / "complete").is_file()

    result = run(
        [sys.executable, BENCH, "--repeat", "1", "--json", "--chunk-size", "64K",
         "--tmpdir", work, "--image", layer, *([] if with_peer else ["--no-erofs18"])],
        timeout=600,
    )
    doc = json.loads(result.stdout)

    assert doc["schema"] == "layerbox.bench.convert.v1"
    assert doc["settings"]["chunk_size"] == CHUNK
    assert doc["settings"]["repeat"] == 1
    assert "--chunksize=65536" in doc["native"]["mkfs"]
    assert len(doc["layers"]) == 1
    row = doc["layers"][0]

    assert row["compression"] == "gzip"
    assert row["compressed_bytes"] == made["compressed_bytes"]
    assert row["tar_bytes"] == made["tar_bytes"]
    assert row["files"] == made["files"]
    assert row["file_bytes"] == made["file_bytes"]
    assert row["unique_bytes"] == made["unique_bytes"]
    chunks_per_big = -(-BIG_SIZE // CHUNK)
    assert row["chunks"] == SMALL_FILES + BIG_FILES * chunks_per_big
    assert row["unique_chunks"] == SMALL_FILES + BIG_DISTINCT * chunks_per_big
    assert 0 < row["dedup_ratio"] < 1
    assert row["dedup_ratio"] == pytest.approx(made["unique_bytes"] / made["file_bytes"])
    assert row["tar_bytes"] > row["file_bytes"]
    assert row["layerbox_digest"].startswith("blake3:")
    peers = ("erofs18", "erofs18_inline") if with_peer else ()
    _positive(row["meta_bytes"], "layerbox", "mkfs_erofs", *peers)
    _positive(row["blob_bytes"], "layerbox", "mkfs_erofs", *peers[:1])
    assert row["blob_bytes"]["layerbox"] >= row["unique_bytes"]
    _positive(row["floor_parts_seconds"], "read_inflate", "blake3", "zstd")
    for method in ("layerbox", "cli", "tar", "mkfs", *peers, "floor"):
        cpu = row["cpu_seconds"][method]
        assert cpu["user"] >= 0, (method, cpu)
        assert cpu["system"] >= 0, (method, cpu)
        assert cpu["user"] + cpu["system"] > 0, (method, cpu)

    methods = ("layerbox", "cli", "native", "tar", "mkfs", *peers, "floor")
    assert sorted(row["seconds"]) == sorted(methods)
    _positive(row["seconds"], *methods)
    _positive(row["mb_per_s"], *methods)
    for method in methods:
        assert row["runs"][method] == [row["seconds"][method]]
        assert row["mb_per_s"][method] == pytest.approx(row["tar_bytes"] / 1e6 / row["seconds"][method])
    assert row["seconds"]["native"] >= row["seconds"]["tar"]
    assert row["seconds"]["native"] >= row["seconds"]["mkfs"]
    assert row["ratio"] == pytest.approx(row["seconds"]["native"] / row["seconds"]["layerbox"])
    assert row["floor_ratio"] == pytest.approx(row["seconds"]["layerbox"] / row["seconds"]["floor"])
    if with_peer:
        assert "--tar=f" in doc["erofs18"]["chunked"]
        assert "--chunksize=65536" in doc["erofs18"]["chunked"]
        assert doc["erofs18"]["version"].startswith("1.8")
        # the inline image holds every file's data; 1.8 dedups chunks as layerbox does
        assert row["meta_bytes"]["erofs18_inline"] > row["file_bytes"]
        assert row["blob_bytes"]["erofs18"] == pytest.approx(row["blob_bytes"]["layerbox"], rel=0.05)
        assert row["erofs18_ratio"] == pytest.approx(row["seconds"]["layerbox"] / row["seconds"]["erofs18"])
        assert row["cli_erofs18_inline_ratio"] == pytest.approx(
            row["seconds"]["cli"] / row["seconds"]["erofs18_inline"])
    else:
        assert "erofs18" not in doc
        assert "erofs18_ratio" not in row

    total = doc["totals"]
    assert total["layers"] == 1
    for key in ("compressed_bytes", "tar_bytes", "file_bytes", "files", "chunks",
                "unique_chunks", "unique_bytes", "dedup_ratio", "ratio", "floor_ratio"):
        assert total[key] == pytest.approx(row[key]), key
    for goal in doc["goals"].values():
        assert isinstance(goal["met"], bool)

    leftovers = list(work.iterdir())
    assert leftovers == [], f"the benchmark left files behind: {leftovers}"


def test_bench_convert_names_the_script_for_a_missing_peer(tmp_path: Path) -> None:
    require("cmd:mkfs.erofs")
    layer = tmp_path / "layer.tar"
    layer.write_bytes(bytes(1024))
    work = tmp_path / "work"
    work.mkdir()
    result = run([sys.executable, BENCH, "--repeat", "1", "--tmpdir", work,
                  "--erofs18", tmp_path / "no-peer-here", layer], timeout=120, check=False)
    assert result.returncode == 1
    assert b"bench/peers/erofs-utils.sh" in result.stderr
    assert b"--no-erofs18" in result.stderr
    assert list(work.iterdir()) == []


def test_bench_convert_rejects_unknown_input(tmp_path: Path) -> None:
    require("cmd:mkfs.erofs")
    missing = tmp_path / "no-such-layer.tar.gz"
    result = run([sys.executable, BENCH, "--repeat", "1", "--no-erofs18", "--tmpdir", tmp_path, missing],
                 timeout=120, check=False)
    assert result.returncode == 1
    assert b"neither an image reference" in result.stderr
    assert [p.name for p in tmp_path.iterdir()] == []


STORE_BENCH = Path(__file__).resolve().parents[1] / "bench" / "store.py"
STORE_PREFIXES = ("packs", "index", "meta", "docs", "refs", "locks")


def _check_publish_row(row: dict[str, Any]) -> None:
    _positive(row, "files", "file_bytes", "tar_bytes", "gzip_bytes", "seconds", "requests", "calls")
    assert row["convert_seconds"] + row["upload_seconds"] == pytest.approx(row["seconds"], abs=0.005)
    assert row["file_mb_per_s"] == pytest.approx(row["file_bytes"] / 1e6 / row["seconds"])
    assert row["requests_per_mb"] == pytest.approx(row["requests"] / (row["file_bytes"] / 1e6))
    assert row["calls"] >= row["requests"]  # calls add the lock, index listing and ref read
    assert sum(row["calls_by_op"].values()) == row["calls"]
    assert row["bytes_new"] + row["bytes_present"] <= row["file_bytes"]  # holes are neither
    assert row["tar_bytes"] > row["file_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["default", "none"])
def test_bench_store_quick_json(tmp_path: Path, fixture: str) -> None:
    """--quick on the file backend; 'default' uses the shared fixture when it is there."""
    require("cmd:tar")
    work = tmp_path / "work"
    work.mkdir()
    argv: list[str | Path] = [sys.executable, STORE_BENCH, "--quick", "--backends", "file", "--json",
                              "--tmpdir", work]
    if fixture == "none":
        argv += ["--fixture", "none"]
    doc = json.loads(run(argv, timeout=900).stdout)

    assert doc["schema"] == "layerbox.bench.store.v1"
    assert doc["settings"]["backends"] == ["file"]
    assert (doc["settings"]["workspaces"], doc["settings"]["versions"]) == (3, 1)
    inputs = doc["inputs"]
    if fixture == "none":
        assert inputs["fixture"] == "generated"
    assert [w["kind"] for w in inputs["workspaces"]] == ["workspace"] * 3 + ["version"]
    version = inputs["workspaces"][-1]
    assert version["parent"] in {w["name"] for w in inputs["workspaces"][:3]}
    assert [e["role"] for e in inputs["edits"]] == ["small", "large"]
    for layer in inputs["layers"]:
        assert 0 < layer["gzip_bytes"] < layer["tar_bytes"], layer

    file = doc["backends"]["file"]
    store = file["store"]
    assert set(STORE_PREFIXES) <= set(store["by_prefix"])
    assert sum(p["bytes"] for p in store["by_prefix"].values()) == store["bytes"]
    assert sum(p["objects"] for p in store["by_prefix"].values()) == store["objects"]
    assert store["by_prefix"]["locks"]["objects"] == 0  # every publish released its lock
    for prefix in ("packs", "index", "meta", "docs", "refs"):
        assert store["by_prefix"][prefix]["bytes"] > 0, prefix
    # one ref per image, workspace and environment
    # an OCI image's layers are also indexed (docs/FORMAT.md "OCI indexes"): one chain ref and one
    # layer ref per distinct layer (the fixture's tags share their base)
    oci_layers = {layer for img in inputs["images"] if img["src"].startswith(("oci", "docker"))
                  for layer in img["layers"]}
    assert store["by_prefix"]["refs"]["objects"] == (len(inputs["images"]) + 2 * len(inputs["workspaces"])
                                                     + 2 * len(oci_layers))
    edits_refs = file["store_after_edits"]["by_prefix"]["refs"]["objects"] - store["by_prefix"]["refs"]["objects"]
    assert edits_refs == 2 * len(inputs["edits"])

    dedup = file["dedup"]
    assert dedup["store_bytes"] == store["bytes"]
    assert 0 < dedup["store_bytes"] < dedup["registry_bytes"] < dedup["product_bytes"]
    assert dedup["registry_over_store"] == pytest.approx(dedup["registry_bytes"] / dedup["store_bytes"])
    assert dedup["product_over_store"] > dedup["registry_over_store"] > 1

    publish = file["publish"]
    assert [r["name"] for r in publish["images"]] == [i["name"] for i in inputs["images"]]
    assert [r["name"] for r in publish["workspaces"]] == [w["name"] for w in inputs["workspaces"]]
    for row in publish["images"] + publish["workspaces"]:
        _check_publish_row(row)
    first = publish["images"][0]
    assert first["bytes_present"] == 0  # the first image goes into an empty store
    ver = publish["workspaces"][-1]
    assert 0 < ver["bytes_new"] <= version["changed_file_bytes"]  # only the changed file's chunk
    totals = publish["totals"]
    assert totals["all"]["count"] == len(inputs["images"]) + len(inputs["workspaces"])
    assert totals["all"]["file_bytes"] == sum(r["file_bytes"] for r in publish["images"] + publish["workspaces"])
    assert publish["compose"]["count"] == len(inputs["workspaces"])

    edits = file["one_file_change"]
    assert [e["role"] for e in edits] == ["small", "large"]
    for edit in edits:
        _check_publish_row(edit)
        fresh = edit["fresh"]
        _check_publish_row(fresh)
        assert fresh["file_bytes"] == edit["file_bytes"]
        assert 0 < edit["bytes_new"] <= edit["changed_file_bytes"]
        assert edit["bytes_new"] < 0.01 * edit["workspace_file_bytes"]
        assert fresh["bytes_new"] > 0.5 * fresh["file_bytes"]  # everything is new in an empty store
        assert fresh["bytes_present"] == 0
        assert edit["bytes_uploaded"] < fresh["bytes_uploaded"]
        assert edit["edit_over_fresh"]["bytes_uploaded"] < 0.5
        assert edit["registry"]["push_bytes"] > edit["bytes_uploaded"]
    assert edits[0]["file_bytes"] < edits[1]["file_bytes"]

    host = file["second_host"]
    assert [r["env"] for r in host["envs"]] == [w["env"] for w in inputs["workspaces"]]
    assert host["first_cold"]["calls"] > 0
    assert host["first_cold"]["bytes_downloaded"] > host["other_cold_median"]["bytes_downloaded"] > 0
    for env in host["envs"]:
        assert env["cold"]["layers"] == env["warm"]["layers"] >= 3
        assert env["warm"]["calls"] == 0  # everything a host needs to mount is cached
        assert env["warm"]["bytes_downloaded"] == 0

    goal = doc["goals"]["one_file_change"]
    assert goal["data_met"] is True
    assert goal["size_ratio"] > 1
    for key in ("upload_met", "time_met"):
        assert isinstance(goal[key], bool)

    leftovers = list(work.iterdir())
    assert leftovers == [], f"the benchmark left files behind: {leftovers}"


SNAPSHOTS_BENCH = Path(__file__).resolve().parents[1] / "bench" / "snapshots.py"


@pytest.mark.slow
@pytest.mark.root("erofs", "overlay", "fuse")
def test_bench_snapshots_quick_json(tmp_path: Path) -> None:
    """--quick: every step checkpointed and restored on a fresh host, against tar | zstd; nothing left behind."""
    from lazyfetch import kmount

    require("cmd:tar")
    require("cmd:zstd")
    work = tmp_path / "work"
    work.mkdir()
    doc = json.loads(run([sys.executable, SNAPSHOTS_BENCH, "--quick", "--json", "--tmpdir", work],
                         timeout=900).stdout)

    assert doc["schema"] == "layerbox.bench.snapshots.v1"
    s = doc["settings"]
    assert (s["tree_mb"], s["changes_mb"], s["bulk_mb"]) == (50, [1, 5], 50)
    base = doc["base"]
    assert base["file_bytes"] == 50 * 1_000_000
    assert base["large_files"] == 2
    assert base["small_files"] > 100
    assert base["publish"]["bytes"] == base["file_bytes"]

    steps = doc["steps"]
    assert [st["kind"] for st in steps] == ["mixed", "mixed", "in-place", "bulk", "mixed"]
    assert [st["written_bytes"] for st in steps] == [1_000_000, 5_000_000, 1_000_000, 50_000_000, 1_000_000]
    layers = [st["checkpoint"]["layers"] for st in steps]
    assert layers == list(range(2, 2 + len(steps)))  # one layer per checkpoint on top of the image
    for st in steps:
        c = st["checkpoint"]
        _positive(c, "bytes_captured", "bytes_uploaded", "entries", "seconds", "freeze_seconds")
        _positive(st["naive"], "seconds", "bytes")
        assert c["freeze_seconds"] <= c["seconds"]
        # random data does not compress: the naive archive is at least the upper's file bytes
        assert st["naive"]["bytes"] >= st["upper_bytes"]
        assert st["uploaded_over_written"] == pytest.approx(c["bytes_uploaded"] / st["written_bytes"])
        if st["kind"] != "in-place":
            # a modified file is captured whole: at most twice what was written into it
            assert st["written_bytes"] <= c["bytes_captured"] <= 2 * st["written_bytes"]
        r = st["restore"]
        assert r["ours"]["layers"] == c["layers"]
        _positive(r["ours"], "restore_seconds", "first_read_seconds", "bytes_fetched", "meta_bytes")
        assert r["ours"]["first_read_seconds"] == pytest.approx(
            r["ours"]["restore_seconds"] + r["ours"]["read_seconds"])
        assert r["ours"]["bytes_fetched"] < st["upper_bytes"]  # lazily: not the whole checkpoint
        assert r["naive"]["bytes"] == st["naive"]["bytes"]
    uppers = [st["upper_bytes"] for st in steps]
    assert uppers == sorted(uppers)

    inplace = steps[2]
    # the large file is captured whole but only its rewritten chunk is new to the store
    assert inplace["checkpoint"]["bytes_captured"] >= inplace["copied_up_bytes"]
    assert inplace["checkpoint"]["bytes_uploaded"] < inplace["copied_up_bytes"] / 2
    first, bulk, last = steps[0], steps[3], steps[-1]
    # incremental: the last 1 MB does not capture again what the bulk step wrote
    assert last["checkpoint"]["bytes_captured"] < bulk["written_bytes"] / 10
    assert last["naive"]["bytes"] > bulk["written_bytes"]  # the naive method pays for all of it

    g = doc["goals"]["proportional"]
    assert (g["first"], g["last"]) == (first["name"], last["name"])
    for key in ("seconds_met", "uploaded_met", "uploaded_over_written_met", "met"):
        assert isinstance(g[key], bool), key
    assert g["uploaded_ratio"] == pytest.approx(
        last["checkpoint"]["bytes_uploaded"] / first["checkpoint"]["bytes_uploaded"])

    assert doc["cleanup"] == {"mounts_left": [], "workdir_removed": True, "problems": []}
    assert kmount.mounts_under(work) == []
    leftovers = list(work.iterdir())
    assert leftovers == [], f"the benchmark left files behind: {leftovers}"


LAZY_BENCH = Path(__file__).resolve().parents[1] / "bench" / "lazy.py"
LAZY_FIXTURE = FIXTURE_IMAGE
LAZY_CASES = [("minbase", "cat"), ("python", "cat"), ("python", "python")]  # no filler image (--filler-mb 0)


@pytest.mark.slow
@pytest.mark.root("erofs", "overlay", "fuse")
def test_bench_lazy_quick_json(tmp_path: Path) -> None:
    """--quick on the file backend, every section but one (the burst on 2 sandboxes over 2 images), on the
    fanotify data path, without the filler image: every figure is there and agrees with the others; no
    timings checked.  (The filler image's four runs cost 20 s of the suite's budget; bench/containerd.py's
    test reads a whole image, and a filler adds nothing the python image's cases do not exercise.)

    One data path: the bench's code is the same for both but for which files hold a layer's bytes,
    and the second path cost a minute of the suite's budget; the fuse path itself is tested in
    test_lazyfetch_*.py.  Every section but the cold one, which
    test_bench_lazy_cold_section_on_both_paths runs on both paths."""
    for program in ("skopeo", "umoci", "strace", "fincore", "unshare"):
        require(f"cmd:{program}")
    if not LAZY_FIXTURE.exists():
        pytest.skip(f"{LAZY_FIXTURE} is absent (the shared fixtures are not beside this checkout)")
    work = tmp_path / "work"
    work.mkdir()
    doc = json.loads(run([sys.executable, LAZY_BENCH, "--quick", "--backends", "file",
                          "--sections", "first,replay,read,mount,start,burst",
                          "--data-paths", "fanotify", "--readers", "2", "--filler-mb", "0", "--burst", "2", "--mounts", "4", "--json", "--fixture", LAZY_FIXTURE, "--tmpdir", work],
                         timeout=1800).stdout)

    assert doc["schema"] == "layerbox.bench.lazy.v1"
    s = doc["settings"]
    assert (s["backends"], s["repeat"], s["mounts"], s["filler_mb"]) == (["file"], 1, 4, 0)
    assert s["data_paths"] == ["fanotify"]
    assert s["sections"] == ["first", "replay", "read", "mount", "start", "burst"]
    images = doc["images"]
    assert [(tag, images[tag]["layers"]) for tag in images] == [("minbase", 1), ("python", 3)]
    assert images["minbase"]["compressed_bytes"] < images["python"]["compressed_bytes"]

    eager = {(c["image"], c["command"]): c for c in doc["eager"]["cases"]}
    assert list(eager) == LAZY_CASES
    for (tag, _), case in eager.items():
        assert len(case["runs"]) == 1
        m = case["median"]
        assert m["bytes_downloaded"] == images[tag]["compressed_bytes"]
        assert m["first_output"] >= m["download"] + m["unpack"] > 0
        assert case["opened"]["files"] > 0
        assert 0 < case["opened"]["bytes"] < images[tag]["file_bytes"]
    assert eager[("python", "python")]["opened"]["bytes"] > eager[("python", "cat")]["opened"]["bytes"]
    task = doc["eager"]["task"]
    assert task["opened"]["bytes"] > eager[("python", "python")]["opened"]["bytes"]

    file = doc["backends"]["file"]
    assert [p["image"] for p in file["publish"]] == list(images)
    for p in file["publish"]:
        assert p["file_bytes"] == images[p["image"]]["file_bytes"]
    for tag in images:
        assert file["store"][tag]["metadata_bytes"] > file["store"][tag]["meta_bytes"] > 0
    assert list(file["paths"]) == ["fanotify"]
    assert file["local_blob_bytes"] >= file["store"]["python"]["blob_bytes"] > 0
    plain = doc["plain"]
    for path, r in file["paths"].items():
        cases = {(c["image"], c["command"]): c for c in r["first_output"]}
        assert list(cases) == LAZY_CASES, path
        for key, case in cases.items():
            lazy, pf = case["lazy"]["median"], case["prefetch"]["median"]
            for m in (lazy, pf):
                assert m["first_output"] >= m["resolve"] + m["daemon"] + m["prefetch"] + m["mount"] - 1e-9
            assert lazy["bytes_served"] > 0
            assert 0 < lazy["bytes_fetched"] < images[key[0]]["compressed_bytes"]
            assert lazy["prefetch"] == 0
            # the whole image (zstd chunks are about as large as its gzip layers), not what was read
            assert pf["bytes_fetched"] > max(0.5 * images[key[0]]["compressed_bytes"], 2 * lazy["bytes_fetched"])
            assert lazy["store_requests"] > 0
            assert case["opened_bytes"] == eager[key]["opened"]["bytes"]
            assert case["fetched_over_opened"] == pytest.approx(lazy["bytes_fetched"] / case["opened_bytes"])
            assert case["fetched_over_served"] == pytest.approx(lazy["bytes_fetched"] / lazy["bytes_served"])

        replay = r["replay"]
        assert replay["cold"]["trace"] == "recording"
        assert replay["trace"]["trace"] == "replaying"
        assert replay["trace_bytes"] > 0
        assert replay["cold"]["bytes_fetched"] > 0
        assert replay["trace"]["chunks_prefetched"] > 0
        # the same host again: nothing comes from the store (on the fuse path, with the page cache
        # dropped, the kernel's readahead through the FUSE file reaches chunks the first runs did not)
        assert replay["hot"]["bytes_fetched"] == replay["hot"]["store_requests"] == 0, path
        assert replay["cached"]["bytes_fetched"] == replay["cached"]["store_requests"] == 0

        read = r["read"]
        assert read["bytes"] == plain["bytes"] > 0  # the same files, through the mount and unpacked
        assert read["files"] == plain["files"]
        passes = read["passes"]
        assert set(passes) == {"store", "cached", "warm", "remount"}
        for p in passes.values():
            assert p["bytes"] == read["bytes"]
            assert p["mb_per_s"] == pytest.approx(p["bytes"] / 1e6 / p["seconds"])
        assert passes["store"]["bytes_fetched"] > 0
        for name in ("cached", "warm", "remount"):
            assert passes[name]["bytes_fetched"] == 0, (path, name)
        for pc in (read["page_cache"], plain["page_cache"]):
            assert pc["bytes_read"] == read["bytes"]
            assert pc["files_resident"] > 0
        assert read["page_cache"]["blob_resident"] > 0
        assert plain["page_cache"]["blob_resident"] == 0
        reread = read["reread"]  # the mount and its peers read the same bytes
        assert set(reread["methods"]) == {"mount", "local_blob", "plain", "copy"}
        for m in reread["methods"].values():
            assert m["bytes"] == read["bytes"]
            assert len(m["runs"]) == 1
        assert set(reread["ratios"]) == {"local_blob", "plain", "copy"}
        assert all(v > 0 for v in reread["ratios"].values())
        direct = read["direct"]  # --blob-io direct: the same bytes, the blobs' own pages not cached
        assert direct["bytes"] == read["bytes"]
        assert direct["page_cache"]["files_resident"] > 0
        assert direct["page_cache"]["blob_resident"] < read["page_cache"]["blob_resident"] / 10
        assert direct["vs_buffered"] == pytest.approx(direct["mb_per_s"] / reread["methods"]["mount"]["mb_per_s"])
        assert isinstance(doc["goals"][f"file/{path}"]["cached_once_direct"]["met"], bool)
        for key, readers in (("one", 1), ("many", 2)):
            c = read["cold"][key]
            assert (c["readers"], c["bytes"]) == (readers, read["bytes"]), (path, key)
            assert c["bytes_fetched"] > 0
            raw = c["raw"]  # the same chunks, once each: at most what the daemon fetched
            assert (raw["loops"], raw["requests"] > 0) == (readers, True)
            assert 0 < raw["bytes"] <= c["bytes_fetched"]
            assert c["vs_raw"] == pytest.approx(c["fetched_mb_per_s"] / raw["mb_per_s"])

        times = r["mount_times"]
        assert list(times) == ["ro", "ro_shared", "rw", "rw_shared"]
        for name, t in times.items():
            assert t["n"] == 4
            assert 0 < t["mount"]["p50"] <= t["mount"]["p99"] <= t["mount"]["max"]
            assert t["layer_mounts_created"] == (0 if t["layers_shared"] else 3), name

        start = r["start"]["median"]
        for key in ("fresh_host", "again", "daemon_start", "daemon_running"):
            assert start[key] > 0, (path, key)

        assert "cold" not in r

        goals = doc["goals"][f"file/{path}"]
        for goal in goals.values():
            assert isinstance(goal["met"], bool)
        assert [(c["image"], c["command"]) for c in goals["fetch_over_read"]["cases"]] == LAZY_CASES
        assert {"reread_vs_local_blob", "cold_vs_store_one", "cold_vs_store_many", "task_cold",
                "task_trace"} <= set(goals)

    burst = file["burst"]
    assert (burst["sandboxes"], burst["parallel"], len(burst["images"])) == (2, 2, 2)
    assert sorted(burst["eager"]["pulls"]) == ["0", "1"]  # each image pulled and unpacked once (JSON keys)
    assert burst["eager"]["allocated"] > file["store"]["python"]["blob_bytes"]  # two unpacked rootfs
    assert list(burst["lazy"]) == ["fanotify"]
    for path, rows in burst["lazy"].items():
        assert set(rows) == {"lazy", "cached", "warmup", "fill"}
        warmup = rows.pop("warmup")  # another host's sandbox of another workspace: its layers' traces stored
        assert warmup["image"] == "bench/burst-warmup"
        assert 1 <= warmup["layer_traces"] <= warmup["layers"] == 5
        for name, row in rows.items():
            assert len(row["runs"]) == 2, (path, name)
            assert [x["image"] for x in row["runs"]] == [0, 1]
            assert row["seconds"] >= max(x["seconds"] for x in row["runs"])
        assert rows["lazy"]["bytes_fetched"] > 0
        assert rows["fill"]["bytes_fetched"] > 0
        # the defaults row: counted again once the daemon's background fill ended
        assert rows["fill"]["allocated_settled"] > 0
        assert rows["fill"]["layers_filled"] >= 0
        assert rows["cached"]["bytes_fetched"] == 0  # the same host again: every chunk is there
        assert rows["lazy"]["allocated"] > 0
    assert doc["leftover_mounts"] == []
    assert doc["mounts_after_cleanup"] == []
    assert list(work.iterdir()) == [], "the benchmark left files behind"


def check_cold_section(cold: dict[str, Any], readers: int) -> None:
    """The cold reads against the decode ceiling: one run per reader count, figures that agree."""
    for key, n in (("one", 1), ("many", readers)):
        c = cold[key]
        assert (c["readers"], len(c["runs"])) == (n, 1), key
        run0 = c["runs"][0]
        assert run0["files"] > 0
        assert run0["bytes_fetched"] > 0
        assert run0["mb_per_s"] == pytest.approx(run0["bytes"] / 1e6 / run0["seconds"])
        ceiling = run0["ceiling"]
        assert ceiling["threads"] == os.cpu_count()
        # the chunks of the files read, each once (files with the same content share chunks)
        assert 0 < ceiling["bytes"] <= run0["bytes"]
        assert 0 < ceiling["compressed_bytes"] <= run0["bytes_fetched"]
        assert c["vs_ceiling"] == pytest.approx(run0["mb_per_s"] / ceiling["mb_per_s"])
        assert run0["remount"]["bytes"] == run0["bytes"]
    # the same files for any number of readers
    assert cold["one"]["runs"][0]["bytes"] == cold["many"]["runs"][0]["bytes"]


@pytest.mark.root("erofs", "overlay", "fuse")
def test_bench_lazy_cold_section_on_both_paths(tmp_path: Path) -> None:
    """--sections cold alone (no eager pull, no plain tree): both data paths, the goal lines there."""
    if not LAZY_FIXTURE.exists():
        pytest.skip(f"{LAZY_FIXTURE} is absent (the shared fixtures are not beside this checkout)")
    require("cmd:skopeo")
    work = tmp_path / "work"
    work.mkdir()
    doc = json.loads(run([sys.executable, LAZY_BENCH, "--quick", "--backends", "file", "--sections", "cold",
                          "--readers", "3", "--json", "--fixture", LAZY_FIXTURE, "--tmpdir", work],
                         timeout=900).stdout)
    assert doc["settings"]["sections"] == ["cold"]
    assert doc["eager"] == {"cases": []}
    paths = doc["backends"]["file"]["paths"]
    assert list(paths) == ["fanotify", "fuse"]
    for path, r in paths.items():
        assert set(r) == {"cold"}, path
        check_cold_section(r["cold"], readers=3)
        goals = doc["goals"][f"file/{path}"]
        assert set(goals) == {"cold_vs_decode_one", "cold_vs_decode_many"}
        for g in goals.values():
            assert g["want"] == 0.8
            assert g["met"] == (g["ratio"] >= 0.8)
    assert doc["leftover_mounts"] == doc["mounts_after_cleanup"] == []
    assert list(work.iterdir()) == [], "the benchmark left files behind"


SANDBOX_BENCH = Path(__file__).resolve().parents[1] / "bench" / "sandbox.py"


@pytest.mark.slow
@pytest.mark.root("erofs", "overlay", "fuse", "cmd:crun", "cmd:umoci")
def test_bench_sandbox_small_json(tmp_path: Path) -> None:
    """Every section but the long ones, tiny sizes, no podman: the figures are there and agree with each
    other, the CPU classes were applied, and nothing is left behind.  No timing is checked."""
    from lazyfetch import kmount

    work = tmp_path / "work"
    work.mkdir()
    doc = json.loads(run([sys.executable, SANDBOX_BENCH, "--quick", "--no-podman", "--sections",
                          "latency,pause,fncall,sdk,network,idle,cpu-class", "--idle", "6", "--latency", "2",
                          "--pauses", "2", "--calls", "3", "--net-rounds", "2", "--cpu-rounds", "2", "--json", "--tmpdir", work], timeout=900).stdout)
    assert doc["schema"] == "layerbox.bench.sandbox.v1"
    methods = doc["latency"]["methods"]
    for name in ("ours", "crun plain create+start+exec"):
        m = methods[name]
        assert m["first_exec"]["n"] == m["cycle"]["n"] == 2
        assert 0 < m["first_exec"]["p50"] <= m["first_exec"]["p99"]
        for r in m["runs"]:
            assert r["first_exec"] <= r["total"]  # the cycle includes the first exec
    for op in ("pause (reclaim)", "resume after reclaim", "pause (no reclaim)", "resume"):
        assert doc["pause"][op]["n"] == 2
    f = doc["fncall"]
    assert f["available"] is True
    assert f["cmd true"]["wall"]["n"] == f["python f(1)"]["wall"]["n"] == 3
    sdk = doc["sdk"]  # through the edge service and the SDK
    assert sdk["create"]["n"] == sdk["create_to_first_exit"]["n"] == 2
    assert sdk["create"]["p50"] <= sdk["create_to_first_exit"]["p50"]
    assert sdk["exec_true"]["n"] == sdk["exec_true_manager"]["n"] == 6
    assert sdk["ready_create"]["n"] == sdk["ready_create_to_first_exit"]["n"] == 2  # adopted (checked there)
    assert sdk["ready_create"]["p50"] <= sdk["ready_create_to_first_exit"]["p50"]
    assert sdk["pty_round_trip"]["n"] == 20  # one byte typed into a terminal and echoed, 10 per --latency
    assert sdk["pty_round_trip"]["p50"] <= sdk["pty_round_trip"]["p99"]
    fork = sdk["fork"]  # sb.fork(8) through the SDK
    assert (fork["forks"], fork["n"], fork["rounds"], len(fork["runs"])) == (8, 2, 2, 2)
    net = doc["network"]
    for case in ("create+first exec, no network", "create+first exec, policed", "exec, no network",
                 "exec, policed", "counters (libnftables, in-process)", "counters (nsenter + nft -j list table)"):
        assert net[case]["n"] == 2
    idle = doc["idle"]
    assert (idle["requested"], idle["held"], idle["failure"]) == (6, 6, None)
    weights = doc["cpu_class"]["cpu_weights"]
    assert set(weights["best-effort"]) == {"cpu.shares=2"} or set(weights["best-effort"]) == {"cpu.weight=1"}
    assert weights["latency"] != weights["best-effort"]
    assert doc["cleanup"] == {"mounts_left": [], "workdir_removed": True, "problems": []}
    assert kmount.mounts_under(work) == []
    assert list(work.iterdir()) == []


CONTAINERD_BENCH = Path(__file__).resolve().parents[1] / "bench" / "containerd.py"
CONTAINERD_PEERS = ["overlayfs", "layerbox", "layerbox-unpack"]
STARGZ_BINARIES = (Path("/opt/layerbox/stargz-snapshotter/usr/bin/ctr-remote"),
                   Path("/opt/layerbox/stargz-grpc/bin/stargz-grpc"))


@pytest.mark.slow
@pytest.mark.root("erofs", "overlay", "fuse")
def test_bench_containerd_minbase_json() -> None:
    """The fixture's minbase on each peer, once: the lazy peer pulls no layer blob and writes
    less to disk than overlayfs, which pulls each blob once; stargz (a benchmark peer, skipped
    with its reason when `make bench-peers` has not installed it) fetches ranges of its eStargz
    blob; every peer then reads the same bytes of the whole image; nothing is left behind."""
    from lazyfetch import kmount
    from tests.support.containerd import require_containerd2
    from tests.support.registry import fixture_archive, require_tools

    require_containerd2()
    require_tools()
    fixture_archive()
    require("cmd:runc")
    doc = json.loads(run([sys.executable, CONTAINERD_BENCH, "--image", "minbase", "--big-mb", "0",
                          "--repeat", "1", "--json"], timeout=300).stdout)

    assert doc["schema"] == "layerbox.bench.containerd.v1"
    assert doc["settings"]["images"] == ["minbase"]
    assert doc["environment"]["containerd"].startswith("containerd ")
    [image] = doc["images"]
    assert image["layers"] == 1
    assert image["layer_bytes"] > 10_000_000
    assert (image["probe"], image["probe_bytes"]) == ("/etc/passwd", None)
    by_peer = {r["peer"]: r for r in doc["results"]}
    with_stargz = all(p.exists() for p in STARGZ_BINARIES)
    assert list(by_peer) == CONTAINERD_PEERS + (["stargz"] if with_stargz else [])
    if not with_stargz:
        assert "make bench-peers" in doc["skipped"]["stargz"]
    for peer, r in by_peer.items():
        assert r["image"] == "minbase"
        _positive(r, "pull_seconds", "run_seconds", "run_exit_seconds", "registry_other_bytes")
        assert r["total_seconds"] == pytest.approx(r["pull_seconds"] + r["run_seconds"])
        assert r["run_seconds"] <= r["run_exit_seconds"]
        assert r["transferred_bytes"] == (r["registry_layer_bytes"] + r["registry_other_bytes"]
                                          + r["store_bytes_fetched"])
        assert len(r["runs"]) == 1, peer
        # the manifests and the config only: kilobytes
        assert r["registry_other_bytes"] < 100_000, peer
        # the whole image read: the same files, whatever the snapshotter
        assert r["read_bytes"] == by_peer["overlayfs"]["read_bytes"] > image["layer_bytes"], peer
        _positive(r, "read_seconds", "disk_bytes_after_read")
        assert r["transferred_bytes_after_read"] >= r["transferred_bytes"], peer

    ovl, lazy, unpack = (by_peer[p] for p in CONTAINERD_PEERS)
    # containerd's own path fetches each layer blob once, whole, and nothing from the store
    for r in (ovl, unpack):
        assert (r["registry_layer_blobs"], r["registry_layer_bytes"]) == (1, image["layer_bytes"])
        assert r["store_bytes_fetched"] == 0
        assert r["disk_bytes"] > image["layer_bytes"]  # the blob in the content store and its tree
    # the image in the store: no layer blob from the registry, only the chunks the run read
    assert (lazy["registry_layer_blobs"], lazy["registry_layer_bytes"]) == (0, 0)
    assert 0 < lazy["store_bytes_fetched"] < image["layer_bytes"] / 2
    assert 0 < lazy["disk_bytes"] < ovl["disk_bytes"] / 2
    assert ovl["ratios_to_overlayfs"] == {k: 1.0 for k in ovl["ratios_to_overlayfs"]}
    assert lazy["ratios_to_overlayfs"]["disk_bytes"] == pytest.approx(lazy["disk_bytes"] / ovl["disk_bytes"])
    # the unpacking peer publishes the image in the background, after its pull
    _positive(unpack, "publish_seconds", "store_bytes_uploaded", "disk_bytes_after_publish")
    assert unpack["publish_seconds"] > unpack["pull_seconds"]
    assert "publish_seconds" not in ovl
    assert "publish_seconds" not in lazy
    # reading everything fetches (nearly) every chunk from the store, still no blob from the registry
    assert lazy["registry_layer_bytes_after_read"] == 0
    assert lazy["store_bytes_fetched_after_read"] > image["layer_bytes"] / 2
    if with_stargz:
        stargz, esgz_bytes = by_peer["stargz"], image["esgz_layer_bytes"]
        # ranges of the eStargz blob: its footer and TOC and what the run read, then the rest
        assert 0 < stargz["registry_layer_bytes"] < esgz_bytes / 2
        assert stargz["registry_layer_blobs"] > 1
        assert stargz["registry_layer_bytes_after_read"] > esgz_bytes / 2
        assert stargz["store_bytes_fetched"] == 0

    cleanup = doc["cleanup"]
    assert cleanup["problems"] == []
    assert cleanup["mounts_left"] == []
    assert cleanup["workdir_removed"]
    assert not Path(cleanup["workdir"]).exists()
    assert kmount.mounts_under(Path(cleanup["workdir"])) == []
    # containerd, its shims, the snapshotter, the lazyfetch daemon, the registry: all name the workdir
    left = run(["pgrep", "-a", "-f", f"{cleanup['workdir']}/"], timeout=10, check=False).stdout
    assert left == b"", f"processes left running: {left.decode()}"


E2B_SDK_BENCH = Path(__file__).resolve().parents[1] / "bench" / "e2b_sdk_tests.py"


def test_bench_e2b_sdk_tests_reads_a_checkout_and_tells_known_failures_from_unexplained(tmp_path: Path) -> None:
    """bench/e2b_sdk_tests.py's report, without an edge: a checkout laid out as e2b-dev/E2B's, its
    tests run by pytest into JUnit XML, then read: a failure whose name the bench knows is listed
    with its reason, any other as unexplained."""
    sys.path.insert(0, str(E2B_SDK_BENCH.parent))
    try:
        import e2b_sdk_tests as bench
    finally:
        sys.path.remove(str(E2B_SDK_BENCH.parent))
    sdk = tmp_path / "E2B" / "packages" / "python-sdk"
    (sdk / "tests").mkdir(parents=True)
    (sdk / "pytest.ini").write_text("[pytest]\n")
    (sdk / "tests" / "test_some.py").write_text(
        "def test_fine():\n    pass\n\n"
        "def test_mask_request_host():\n    raise AssertionError('refused by design')\n\n"
        "def test_new_bug():\n    raise ValueError('nobody expected this')\n")
    copied = bench.tests_from(tmp_path / "E2B", "HEAD", tmp_path / "copy")
    junit = tmp_path / "junit.xml"
    run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(copied / "pytest.ini"),
         "--junitxml", str(junit), "tests"], cwd=copied, check=False, timeout=120)
    tests = bench.outcomes(junit)
    assert [(t["test"].split("::")[-1], t["result"]) for t in tests] == [
        ("test_fine", "passed"), ("test_mask_request_host", "failed"), ("test_new_bug", "failed")]
    assert tests[1]["known"] is not None
    assert "maskRequestHost" in tests[1]["known"]
    assert tests[2]["known"] is None
    assert "nobody expected this" in tests[2]["error"]
    text = bench.render({"tests": tests, "seconds": 1.0, "settings": {"e2b_repo": "E2B", "rev": "HEAD"},
                         "environment": {"e2b": "x"}})
    assert "1 passed, 2 failed, 0 skipped of 3" in text
    assert "unexplained (1):" in text
    assert "test_new_bug: " in text.split("unexplained (1):")[1]
