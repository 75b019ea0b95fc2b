"""lazyfetch with the real daemon, real FUSE and EROFS/overlay mounts, real stores.

Each "host" is a data dir with its own daemon; two hosts share one store.
Teardown unmounts everything and stops the daemon even when a test fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from layerstore.objects import pack_key, trace_key
from layerstore.store import Store
from lazyfetch import kmount
from tests.support.hosts import Host, publish_sync, resolve_sync  # noqa: F401
from tests.support.moto import MotoServer, aws_test_env, file_and_s3_store_url, moto_fixture  # noqa: F401
from tests.support.s3proxy import Fault, FaultProxy
from tests.support.treecmp import assert_trees_equal

pytestmark = [pytest.mark.usefixtures("need_root"), pytest.mark.root("erofs", "overlay", "fuse")]

moto = moto_fixture("module")
CHUNK = 1 << 20




def make_source(root: Path, big_mb: int = 0, seed: int = 0) -> Path:
    rnd = random.Random(seed)
    (root / "etc").mkdir(parents=True)
    (root / "etc/os-release").write_text('ID=layerbox-test\nNAME="test"\n')
    (root / "bin").mkdir()
    for i in range(30):
        (root / "bin" / f"tool{i}").write_bytes(rnd.randbytes(rnd.randint(10, 50_000)))
        os.chmod(root / "bin" / f"tool{i}", 0o755)
    os.symlink("tool1", root / "bin/alias")
    (root / "data").mkdir()
    for i in range(big_mb // 8):
        (root / "data" / f"blob{i}").write_bytes(rnd.randbytes(8 << 20))
    return root


def read_in_subprocess(path: Path, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    """Read a file from a separate process so that a hang shows up as a timeout, not a stuck test."""
    return subprocess.run([sys.executable, "-c", f"open({str(path)!r}, 'rb').read()"],
                          capture_output=True, text=True, timeout=timeout)


def test_mount_equals_source_on_both_backends(hosts, store_url: str, tmp_path: Path) -> None:
    src = make_source(tmp_path / "src")
    host = hosts(store_url)
    publish_sync(store_url, host.data_dir, str(src), "app/one")
    mnt = host.mount("app/one")
    assert_trees_equal(src, mnt, check_root_meta=False)
    out = subprocess.run(["cat", str(mnt / "etc/os-release")], capture_output=True, text=True, check=True)
    assert "layerbox-test" in out.stdout
    metrics = host.mounts.client.request("GET", "/metrics")
    assert "layerbox_chunk_misses_total" in metrics


def test_lazy_reads_fetch_a_tiny_fraction(hosts, store_url: str, tmp_path: Path) -> None:
    src = make_source(tmp_path / "src", big_mb=112)
    publisher = tmp_path / "publisher"
    publish_sync(store_url, publisher, str(src), "big/img")
    host = hosts(store_url, "fresh")  # a second host with an empty cache
    mnt = host.mount("big/img")
    image_bytes = sum(p.stat().st_size for p in src.rglob("*") if p.is_file() and not p.is_symlink())
    assert image_bytes > 100 << 20
    for name in ("etc/os-release", "bin/tool3", "bin/tool7"):
        assert (mnt / name).read_bytes() == (src / name).read_bytes()
    st = host.stats()
    # each small file is one chunk; nothing else may be fetched
    assert 0 < st["bytes_fetched"] <= 3 * CHUNK
    assert st["bytes_fetched"] < image_bytes / 100
    assert st["bytes_fetched_per_image"]


def test_layers_are_shared_and_refcounted(hosts, tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    base = make_source(tmp_path / "b")
    top = tmp_path / "t"
    (top / "opt").mkdir(parents=True)
    (top / "opt/tool").write_bytes(b"toolkit")
    host = hosts(url)
    publish_sync(url, host.data_dir, str(base), "base/img")
    publish_sync(url, host.data_dir, str(top), "tk/img")

    async def compose() -> None:
        async with await Store.open(url, host.data_dir) as s:
            await s.compose("env/x", {"base": "base/img", "toolkit": "tk/img"})

    asyncio.run(compose())
    a = host.mount("env/x")
    b = host.mount("env/x", writable=True)
    assert (a / "opt/tool").read_bytes() == b"toolkit"
    assert (a / "etc/os-release").exists()
    (b / "new-file").write_text("written")
    assert not (a / "new-file").exists()
    layers = host.mounts.status()["layers"]
    assert len(layers) == 2
    assert all(len(info["users"]) == 2 for info in layers.values())
    host.mounts.umount(a)
    assert len(host.mounts.status()["layers"]) == 2
    host.mounts.umount(b)
    assert host.mounts.status()["layers"] == {}
    assert kmount.mounts_under(host.data_dir / "layers") == []


@contextlib.contextmanager
def proxied_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, big_mb: int = 0
                  ) -> Iterator[tuple[str, Path, FaultProxy]]:
    """A moto bucket behind a fault proxy (what the daemons talk to), an image published there."""
    server = MotoServer()
    proxy = FaultProxy(server.endpoint).start()
    try:
        bucket = server.new_bucket()
        for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                     "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        url = f"s3://{bucket}/lb"
        src = make_source(tmp_path / "src", big_mb=big_mb)
        publish_sync(url, tmp_path / "pub", str(src), name)
        yield url, src, proxy
    finally:
        proxy.stop()
        server.stop()


@pytest.mark.parametrize("data_path", ["fanotify", "fuse"])
def test_store_stall_gives_eio_then_recovers(hosts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             data_path: str) -> None:
    with proxied_store(tmp_path, monkeypatch, "stall/img") as (url, src, proxy):
        host = hosts(url, fetch_timeout=2.0, data_path=data_path)
        mnt = host.mount("stall/img")
        proxy.inject(Fault.stall(6.0), times=100, method="GET")
        started = time.monotonic()
        res = read_in_subprocess(mnt / "bin/tool5", timeout=30)
        assert res.returncode != 0
        assert "Input/output error" in res.stderr or "Errno 5" in res.stderr
        assert time.monotonic() - started < 5  # bounded by the fetch timeout, never forever
        assert host.stats()["read_errors"] >= 1
        proxy.clear()
        time.sleep(7)  # the stalled request ends; the store answers again
        # the mount stays usable: the same data, and data nobody asked for yet
        assert (mnt / "bin/tool5").read_bytes() == (src / "bin/tool5").read_bytes()
        assert (mnt / "bin/tool17").read_bytes() == (src / "bin/tool17").read_bytes()


@pytest.mark.parametrize("data_path", ["fanotify", "fuse"])
def test_s3_slowdown_is_retried_with_backoff_and_bounded(hosts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         data_path: str) -> None:
    with proxied_store(tmp_path, monkeypatch, "slow/img", big_mb=8) as (url, src, proxy):
        host = hosts(url, fetch_timeout=20.0, data_path=data_path)
        mnt = host.mount("slow/img")
        before = len(proxy.requests("GET"))
        proxy.inject(Fault.error(503, "SlowDown"), times=2, method="GET")
        assert (mnt / "bin/tool5").read_bytes() == (src / "bin/tool5").read_bytes()  # after two back-offs
        kinds = [kind for _, _, kind in proxy.requests("GET")[before:]]
        assert kinds[:3] == ["error", "error", None]
        logtext = (host.data_dir / "lazyfetch.log").read_text()
        assert "failed (attempt 1 of 6), retrying" in logtext
        assert "SlowDown" in logtext
        assert host.stats()["read_errors"] == 0
        # a store that keeps throttling: the read fails after the retries (6 attempts), well before
        # the fetch timeout, with EIO, and the mount stays usable
        proxy.inject(Fault.error(503, "SlowDown"), times=1000, method="GET")
        started = time.monotonic()
        res = read_in_subprocess(mnt / "data/blob0", timeout=60)  # (nothing of it fetched yet)
        assert res.returncode != 0
        assert "Input/output error" in res.stderr or "Errno 5" in res.stderr
        assert time.monotonic() - started < 15  # the back-off is bounded (< 4 s), not the 20 s timeout
        logtext = (host.data_dir / "lazyfetch.log").read_text()
        assert "gave up after 6 attempts" in logtext
        assert host.stats()["read_errors"] >= 1
        proxy.clear()
        assert (mnt / "data/blob0").read_bytes() == (src / "data/blob0").read_bytes()
        assert (mnt / "bin/tool8").read_bytes() == (src / "bin/tool8").read_bytes()


def test_corrupt_chunk_is_refused_then_refetched(hosts, tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    src = make_source(tmp_path / "src")
    host = hosts(url)
    publish_sync(url, tmp_path / "pub", str(src), "corrupt/img")
    packs = list((tmp_path / "store" / "packs").rglob("*"))
    pack = next(p for p in packs if p.is_file() and not p.name.startswith("."))
    original = pack.read_bytes()
    damaged = bytearray(original)
    for i in range(0, len(damaged) - 100, 997):
        damaged[i] ^= 0x55
    pack.write_bytes(bytes(damaged))
    mnt = host.mount("corrupt/img")
    res = read_in_subprocess(mnt / "bin/tool9")
    assert res.returncode != 0
    logtext = (host.data_dir / "lazyfetch.log").read_text()
    assert "does not match its digest" in logtext or "corrupt chunk" in logtext
    assert host.stats()["chunks_corrupt"] >= 1
    pack.write_bytes(original)
    assert (mnt / "bin/tool9").read_bytes() == (src / "bin/tool9").read_bytes()
    assert pack_key(bytes.fromhex(pack.name)).endswith(pack.name)


def test_full_cache_disk_still_serves_reads(hosts, tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    src = make_source(tmp_path / "src", big_mb=16)
    host = hosts(url, cache_size=64 << 20)
    chunks = host.data_dir / "blobcache"
    chunks.mkdir(parents=True)
    # smaller than one 1 MiB chunk: eviction cannot make room, so every put fails (and on tmpfs
    # there are no pre-content events: the daemon chooses FUSE, which can serve from memory)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(chunks)], check=True)
    try:
        publish_sync(url, tmp_path / "pub", str(src), "full/img")
        mnt = host.mount("full/img")
        health = host.mounts.client.health()
        assert health is not None
        assert health["data_path"] == "fuse"
        # the read succeeds from memory (better than the EIO the issue allows) ...
        assert (mnt / "data/blob0").read_bytes() == (src / "data/blob0").read_bytes()
        assert host.stats()["cache_put_failures"] > 0
        # ... and the log says why the cache did not keep it
        log = (host.data_dir / "lazyfetch.log").read_text()
        assert str(chunks) in log
        assert "No space left" in log
    finally:
        host.close()
        subprocess.run(["umount", "-l", str(chunks)], check=False)


def test_trace_recorded_then_replayed_on_another_host(hosts, tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    src = make_source(tmp_path / "src")
    publish_sync(url, tmp_path / "pub", str(src), "trace/img")
    first = hosts(url, "h1", trace_seconds=1.0)
    mnt = first.mount("trace/img")
    for name in ("bin/tool1", "bin/tool2", "etc/os-release"):
        (mnt / name).read_bytes()
    traces = tmp_path / "store" / "traces"

    def stored() -> list[Path]:
        return [p for p in traces.rglob("*") if p.is_file()] if traces.exists() else []

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not stored():
        time.sleep(0.1)
    trace_files = stored()
    assert trace_files, "no access trace was stored"
    doc = json.loads(trace_files[0].read_text())
    assert sum(len(v) for v in doc["layers"].values()) == 3
    second = hosts(url, "h2")
    mnt2 = second.mount("trace/img")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and second.stats()["chunks_prefetched"] < 3:
        time.sleep(0.05)
    before = second.stats()["misses"]
    for name in ("bin/tool1", "bin/tool2", "etc/os-release"):
        assert (mnt2 / name).read_bytes() == (src / name).read_bytes()
    assert second.stats()["misses"] == before  # every read was a cache hit


def test_a_new_image_replays_the_traces_its_layers_got_from_other_images(hosts, tmp_path: Path) -> None:
    """A new workspace on a base other tasks read: its first mount on a fresh host prefetches what
    the base's layer trace names (recorded by a mount of another image), and records its own."""
    url = f"file://{tmp_path / 'store'}"
    src = make_source(tmp_path / "src")
    publish_sync(url, tmp_path / "pub", str(src), "trace/base")
    for name in ("a", "b"):
        ws = tmp_path / f"ws-{name}"
        (ws / "workspace").mkdir(parents=True)
        (ws / "workspace" / "notes").write_text(f"workspace {name}\n")
        publish_sync(url, tmp_path / "pub", str(ws), f"trace/ws-{name}")

    async def compose() -> tuple[str, str]:
        async with await Store.open(url, tmp_path / "pub") as s:
            for name in ("a", "b"):
                await s.compose(f"trace/env-{name}", {"base": "trace/base", "workspace": f"trace/ws-{name}"})
            base = (await s.resolve("trace/base")).layers[0].digest
            return base, (await s.resolve("trace/env-b")).digest

    base_layer, env_b = asyncio.run(compose())
    read = ("bin/tool1", "bin/tool2", "bin/tool3", "etc/os-release")
    first = hosts(url, "h1", trace_seconds=1.0)
    mnt = first.mount("trace/env-a")
    for name in read:
        (mnt / name).read_bytes()
    trace_of_base = tmp_path / "store" / trace_key(base_layer)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not trace_of_base.exists():
        time.sleep(0.1)
    assert trace_of_base.exists(), "no access trace of the base layer was stored"
    doc = json.loads(trace_of_base.read_text())
    assert doc["image"] == base_layer
    assert list(doc["layers"]) == [base_layer]
    assert len(doc["layers"][base_layer]) == len(read)

    second = hosts(url, "h2", trace_seconds=3.0)
    mnt2 = second.mount("trace/env-b")  # no trace of its own: the base layer's replays
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and second.stats()["chunks_prefetched"] < len(read):
        time.sleep(0.05)
    assert second.stats()["chunks_prefetched"] == len(read)
    before = second.stats()["misses"]
    for name in read:
        assert (mnt2 / name).read_bytes() == (src / name).read_bytes()
    assert second.stats()["misses"] == before  # every read was a hit
    assert (mnt2 / "workspace/notes").read_text() == "workspace b\n"
    # ... and the new image got a trace of its own, workspace included
    own = tmp_path / "store" / trace_key(env_b)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not own.exists():
        time.sleep(0.1)
    assert len(json.loads(own.read_text())["layers"]) == 2


def test_prefetch_whole_image(hosts, tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    src = make_source(tmp_path / "src", big_mb=8)
    publish_sync(url, tmp_path / "pub", str(src), "pf/img")
    host = hosts(url)
    host.mounts.client.ensure_running(url, **host.mounts.daemon_options)
    resolved = resolve_sync(url, host.data_dir, "pf/img")
    reply = host.mounts.client.request("POST", "/prefetch", {
        "image": resolved.digest, "layers": [x.to_json() for x in resolved.layers]})
    assert reply["fetched"] == reply["chunks"] > 30
    mnt = host.mount("pf/img")
    misses = host.stats()["misses"]
    assert_trees_equal(src, mnt, check_root_meta=False)
    assert host.stats()["misses"] == misses


def test_stale_state_after_host_restart_is_reconciled(hosts, tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    src = make_source(tmp_path / "src")
    publish_sync(url, tmp_path / "pub", str(src), "re/img")
    host = hosts(url)
    mnt = host.mount("re/img")
    # a "reboot": the kernel forgets every mount behind layerbox's back
    kmount.umount(mnt, lazy=True)
    for mp in kmount.mounts_under(host.data_dir / "layers"):
        kmount.umount(mp, lazy=True)
    again = host.mount("re/img")
    assert (again / "etc/os-release").exists()
    assert list(host.mounts.status()["mounts"]) == [str(again)]


def test_fixture_image_runs_from_a_lazy_mount(hosts, tmp_path: Path) -> None:
    from tests.support.env import FIXTURE_IMAGE, in_ci

    fixture = FIXTURE_IMAGE
    if not fixture.exists():
        (pytest.fail if in_ci() else pytest.skip)(f"{fixture} is absent")
    url = f"file://{tmp_path / 'store'}"
    publish_sync(url, tmp_path / "pub", f"oci-archive:{fixture}:python", "debian/python")
    host = hosts(url)
    mnt = host.mount("debian/python", writable=True)
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
    chroot = ["unshare", "--mount", "--propagation", "private", "/usr/sbin/chroot", str(mnt)]
    out = subprocess.run([*chroot, "/bin/cat", "/etc/os-release"], capture_output=True, text=True, env=env,
                         check=True, timeout=60)
    assert "bookworm" in out.stdout
    tests = subprocess.run([*chroot, "/usr/bin/python3", "-m", "unittest", "discover", "-s", "/workspace/calc/tests"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert tests.returncode == 0, tests.stderr
    st = host.stats()
    assert st["bytes_fetched"] < 0.2 * 86_000_000  # far less than the image's compressed layers


def test_a_second_daemon_on_a_data_dir_refuses_and_disturbs_nothing(hosts, tmp_path: Path) -> None:
    """Before the daemon held a lock, a second one (two callers starting it at once) detached the
    first's FUSE mount and took its socket: every mounted layer then read ENOENT or EIO."""
    url = f"file://{tmp_path / 'store'}"
    src = make_source(tmp_path / "src")
    publish_sync(url, tmp_path / "pub", str(src), "t/one")
    host = hosts(url)
    mp = host.mount("t/one")
    before = host.mounts.client.health()
    assert before is not None
    second = subprocess.run([sys.executable, "-m", "lazyfetch.daemon", "--data-dir", str(host.data_dir),
                             "--store", url], capture_output=True, text=True, timeout=60,
                            cwd=Path(__file__).resolve().parent.parent)
    assert second.returncode == 3, second.stderr
    assert "another lazyfetch daemon serves" in second.stderr
    after = host.mounts.client.health()
    assert after is not None
    assert (after["pid"], after["instance"]) == (before["pid"], before["instance"])
    assert_trees_equal(src, mp)  # the mounted layer still reads through the first daemon
    # and concurrent starts from this side serialise on the client's lock: one daemon, one FUSE mount
    # when it serves through FUSE, none when through fanotify
    fuse = [m for m in kmount.read_mountinfo() if m.mountpoint == str(host.data_dir / "blobs")]
    assert len(fuse) == (1 if after["data_path"] == "fuse" else 0)
