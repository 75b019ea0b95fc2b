"""The default background fill policy (lazyfetch/fillpolicy.py) and the per-layer daemon status.

Real kernel mounts and a real file store: a single-use image gets what its stored access
trace names and nothing more; a second use that still misses, and a mount that lives long
enough, fill the image in full.  `layerbox daemon status` shows each layer's data path,
bytes present, kernel reads served and time spent waiting on the store.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from layerstore.store import Store
from lazyfetch.daemon import DEFAULT_FILL_BELOW, parse_args
from lazyfetch.fillpolicy import DiskIdle, FillPolicy, FillPolicyError
from tests.support.hosts import Host, publish_sync
from tests.test_lazyfetch import make_source

# the daemon's defaults, spelled out: the hosts fixture turns the fill off unless a test asks
DEFAULTS: dict[str, Any] = {"fill_below": DEFAULT_FILL_BELOW}


def wait_for(what: str, check: Callable[[], bool], seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {seconds:.0f} s")
        time.sleep(0.1)


def stored_trace(url: str, data_dir: Path, image: str) -> dict[str, Any] | None:
    async def run() -> dict[str, Any] | None:
        async with await Store.open(url, data_dir) as s:
            return await s.get_trace(image)

    return asyncio.run(run())


def one_layer(host: Host) -> dict[str, Any]:
    served = host.mounts.status()["served"]
    assert len(served) == 1, served
    return dict(next(iter(served.values())))


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


@pytest.fixture(params=["fanotify", "fuse"])
def data_path(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def published(tmp_path: Path) -> tuple[str, Path, str]:
    url = f"file://{tmp_path / 'store'}"
    src = make_source(tmp_path / "src", big_mb=16)
    digest = publish_sync(url, tmp_path / "pub", str(src), "fill/img")
    return url, src, digest


def test_default_policy_fills_what_the_trace_names_not_a_single_use_image(
        hosts, tmp_path: Path, data_path: str) -> None:
    url, src, digest = published(tmp_path)
    # host 1: the image's first mount anywhere records what its task reads
    first = hosts(url, "first", data_path=data_path, **DEFAULTS)
    mnt = first.mount("fill/img")
    for name in ("bin/tool3", "bin/tool4", "etc/os-release"):
        assert (mnt / name).read_bytes() == (src / name).read_bytes()
    wait_for("the access trace in the store", lambda: stored_trace(url, tmp_path / "pub", digest) is not None)
    trace = stored_trace(url, tmp_path / "pub", digest)
    assert trace is not None
    traced = sum(len(v) for v in trace["layers"].values())
    assert traced > 0
    row = one_layer(first)
    assert row["data_path"] == data_path
    assert row["events_served"] > 0
    assert row["store_wait_seconds"] > 0  # it read from an empty host
    assert row["fill"].startswith("waiting: used 1 time(s)")
    # host 2, empty: one use of the image, with the stored trace
    second = hosts(url, "second", data_path=data_path, **DEFAULTS)
    mnt2 = second.mount("fill/img")
    wait_for("the trace replay", lambda: second.stats()["chunks_prefetched"] >= traced
             and second.stats()["fetches_in_flight"] == 0)
    st = second.stats()
    row = one_layer(second)
    assert row["fill"].startswith("waiting: used 1 time(s)"), row  # not armed, not filling
    assert st["layers_filled"] == 0
    assert row["bytes_present"] < row["blob_bytes"] // 4  # the 16 MB of data nobody read stay away
    fetched = st["bytes_fetched"]
    drop_caches()
    for name in ("bin/tool3", "bin/tool4", "etc/os-release"):  # what the trace named is here
        assert (mnt2 / name).read_bytes() == (src / name).read_bytes()
    after = second.stats()
    assert after["misses"] == 0
    assert after["bytes_fetched"] == fetched


def test_a_second_use_that_misses_fills_the_image(hosts, tmp_path: Path, data_path: str) -> None:
    url, src, _ = published(tmp_path)
    # any miss of an armed layer counts (the default waits for 4 MiB of them, which a sequential
    # reader's read-ahead may hide); a busy shared disk must not stall the fill
    host = hosts(url, data_path=data_path, fill_max_busy=1.0, fill_miss_bytes=1, **DEFAULTS)
    mnt = host.mount("fill/img")
    assert (mnt / "bin/tool3").read_bytes() == (src / "bin/tool3").read_bytes()
    assert one_layer(host)["fill"].startswith("waiting")
    again = host.mount("fill/img")
    assert one_layer(host)["fill"].startswith("armed: used 2 time(s)")
    assert (again / "bin/tool3").read_bytes() == (src / "bin/tool3").read_bytes()  # a hit: still armed
    assert one_layer(host)["fill"].startswith("armed")
    assert host.stats()["layers_filled"] == 0
    assert (again / "data/blob1").read_bytes() == (src / "data/blob1").read_bytes()  # a miss: the fill starts
    wait_for("the background fill", lambda: host.stats()["layers_filled"] == 1)
    row = one_layer(host)
    assert row["fill"] == "whole"
    assert row["bytes_present"] > 16 << 20
    fetched = host.stats()["bytes_fetched"]
    drop_caches()
    assert (mnt / "data/blob0").read_bytes() == (src / "data/blob0").read_bytes()
    assert host.stats()["bytes_fetched"] == fetched  # every read is local now


def test_a_long_lived_mount_is_filled(hosts, tmp_path: Path) -> None:
    url, src, _ = published(tmp_path)
    host = hosts(url, data_path="fanotify", fill_after_seconds=1.0, fill_max_busy=1.0, **DEFAULTS)
    mnt = host.mount("fill/img")
    wait_for("the long-life fill", lambda: host.stats()["layers_filled"] == 1)
    drop_caches()
    assert (mnt / "data/blob1").read_bytes() == (src / "data/blob1").read_bytes()
    assert host.stats()["misses"] == 0


def test_an_image_above_fill_below_is_never_filled(hosts, tmp_path: Path) -> None:
    url, src, _ = published(tmp_path)
    host = hosts(url, data_path="fanotify", fill_below=1 << 20, fill_after_uses=1)
    host.mount("fill/img")
    assert one_layer(host)["fill"].startswith("never: the image is above --fill-below")
    assert host.stats()["layers_filled"] == 0


def test_daemon_status_cli_shows_each_layer(hosts, tmp_path: Path) -> None:
    url, src, _ = published(tmp_path)
    host = hosts(url, data_path="fuse")
    mnt = host.mount("fill/img")
    assert (mnt / "bin/tool9").read_bytes() == (src / "bin/tool9").read_bytes()
    argv = [sys.executable, "-m", "tools.cli", "daemon", "status", "--data-dir", str(host.data_dir),
            "--store", url]
    doc = json.loads(subprocess.run([*argv, "--json"], capture_output=True, text=True, check=True,
                                    timeout=60).stdout)
    (layer, row), = doc["served"].items()
    assert layer.startswith("blake3:")
    assert row["data_path"] == "fuse"
    assert 0 < row["bytes_present"] < row["blob_bytes"]
    assert row["events_served"] > 0
    assert row["store_wait_seconds"] > 0
    assert row["fill"] == "off"  # the fixture's fill_below=0
    text = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60).stdout
    assert "store wait s" in text
    assert layer[:20] in text
    stats = host.stats()  # every counter `layerbox stats --json` had stays
    for key in ("hits", "misses", "bytes_fetched", "bytes_fetched_per_layer", "bytes_fetched_per_image",
                "store_requests", "layers_filled", "cache", "data_path"):
        assert key in stats


def test_bad_fill_options_are_refused_with_their_name(tmp_path: Path) -> None:
    with pytest.raises(FillPolicyError, match="--fill-after-uses must be at least 1"):
        FillPolicy(1 << 30, after_uses=0)
    with pytest.raises(FillPolicyError, match="--fill-max-busy"):
        FillPolicy(1 << 30, max_busy=0)
    with pytest.raises(FillPolicyError, match="--fill-below"):
        FillPolicy(-1)
    with pytest.raises(FillPolicyError, match="--fill-miss-bytes"):
        FillPolicy(1 << 30, miss_bytes=0)
    with pytest.raises(SystemExit):
        parse_args(["--data-dir", str(tmp_path), "--fill-after-seconds", "-1"])
    busy = DiskIdle(tmp_path).busy()
    assert 0.0 <= busy <= 1.0
