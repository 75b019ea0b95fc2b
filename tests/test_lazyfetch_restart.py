"""Fail closed across daemon deaths, through both data paths, with the real kernel.

The attacks on "never a wrong byte": SIGKILL of the daemon while cold readers
(processes, one through mmap) are inside its reads; no successor at all; the
holder killed too; a blob without its fanotify mark; eviction under a tiny
cache while readers run.  Every reader compares what it read with the
source: zeros where the source is not zero count as wrong.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lazyfetch import kmount
from tests.support.hosts import Host, publish_sync, resolve_sync  # noqa: F401
from tests.support.treecmp import assert_trees_equal
from tests.test_lazyfetch import make_source

pytestmark = [pytest.mark.usefixtures("need_root"), pytest.mark.root("erofs", "overlay", "fuse")]

READER = r"""
import hashlib, mmap, os, random, sys
path, how = sys.argv[1], sys.argv[2]
try:
    with open(path, "rb") as f:
        if how == "mmap":
            with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
                data = bytes(m)
        elif how == "random":  # 4-64 KiB preads at random offsets until every byte was read once
            size = os.fstat(f.fileno()).st_size
            pieces, rnd = {}, random.Random(size)
            starts = list(range(0, size, 65536))
            rnd.shuffle(starts)
            for start in starts:
                for at in range(start, min(start + 65536, size), 16384):
                    pieces[at] = os.pread(f.fileno(), min(16384, size - at), at)
            data = b"".join(pieces[k] for k in sorted(pieces))
        else:
            data = b"".join(iter(lambda: f.read(65536), b""))
except OSError as exc:
    print("error", exc.errno)
    sys.exit(0)
print("sha256", hashlib.sha256(data).hexdigest())
"""


@pytest.fixture(params=["fanotify", "fuse"])
def data_path(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def readers(mnt: Path, names: list[str]) -> list[tuple[str, subprocess.Popen[str]]]:
    out = []
    for k, name in enumerate(names):
        how = ("read", "random", "mmap")[k % 3]
        out.append((name, subprocess.Popen([sys.executable, "-c", READER, str(mnt / name), how],
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    return out


def outcomes(running: list[tuple[str, subprocess.Popen[str]]], src: Path, timeout: float = 60
             ) -> list[str]:
    """'ok' or 'eio' per reader; a wrong byte fails the test at once."""
    results = []
    for name, proc in running:
        out, err = proc.communicate(timeout=timeout)
        if proc.returncode == -signal.SIGBUS:  # how a failed read of an mmap'd page is reported
            results.append("eio")
            continue
        kind, _, value = out.strip().partition(" ")
        assert kind in ("sha256", "error"), (name, out, err)
        if kind == "sha256":
            assert value == sha(src / name), f"{name}: WRONG BYTES read through the mount"
            results.append("ok")
        else:
            assert value == "5", f"{name}: failed with errno {value}, not EIO"
            results.append("eio")
    return results


def mount_id(path: Path) -> int:
    return next(m.mount_id for m in kmount.read_mountinfo() if m.mountpoint == str(path))


def lazy_host(hosts, tmp_path: Path, data_path: str, *, big_mb: int, writable: bool = False,  # type: ignore[no-untyped-def]
              **options: object) -> tuple[Path, Host, Path]:
    """A source tree published to a file store, a host serving it through ``data_path``, its mount."""
    url = f"file://{tmp_path / 'store'}"
    src = make_source(tmp_path / "src", big_mb=big_mb)
    publish_sync(url, tmp_path / "pub", str(src), "test/img")
    host = hosts(url, data_path=data_path, **options)
    assert isinstance(host, Host)
    return src, host, host.mount("test/img", writable=writable)


def test_killed_daemon_leaves_readers_waiting_and_its_successor_serves_them(
        hosts, tmp_path: Path, data_path: str) -> None:
    src, host, mnt = lazy_host(hosts, tmp_path, data_path, big_mb=32, writable=True)
    (mnt / "agent-wrote").write_text("state")
    before = host.mounts.client.health()
    assert before is not None
    assert before["data_path"] == data_path
    mid = mount_id(mnt)
    os.kill(int(before["pid"]), signal.SIGKILL)
    running = readers(mnt, ["data/blob0", "data/blob1", "data/blob2", "bin/tool11"])
    time.sleep(1.5)
    # no daemon: every cold reader waits; none failed, none got zeros
    assert [name for name, p in running if p.poll() is not None] == []
    assert host.mounts.remount() == 0  # the successor took the mounts over: nothing re-stacked
    assert outcomes(running, src) == ["ok"] * 4
    after = host.mounts.client.health()
    assert after is not None
    assert after["pid"] != before["pid"]
    assert after["generation"] == before["generation"]
    assert mount_id(mnt) == mid  # the sandbox's view is the very same mount
    assert (mnt / "agent-wrote").read_text() == "state"
    assert_trees_equal(src, mnt, ignore=lambda p: p == b"agent-wrote", check_mtime=False)


def test_sigkill_during_cold_reads_never_gives_a_wrong_byte(hosts, tmp_path: Path, data_path: str) -> None:
    src, host, mnt = lazy_host(hosts, tmp_path, data_path, big_mb=48)
    names = [f"data/blob{i}" for i in range(6)] + ["bin/tool3", "bin/tool4"]
    running = readers(mnt, names)
    for _ in range(3):  # kill it while the readers are inside its reads, three times over
        time.sleep(0.3)
        health = host.mounts.client.health()
        assert health is not None
        os.kill(int(health["pid"]), signal.SIGKILL)
        time.sleep(0.3)
        assert host.mounts.remount() == 0
    results = outcomes(running, src)
    assert "ok" in results  # (an EIO is allowed: a read the dead daemon held was answered so)
    assert_trees_equal(src, mnt)


def test_without_a_successor_readers_get_eio_after_the_grace(hosts, tmp_path: Path, data_path: str) -> None:
    src, host, mnt = lazy_host(hosts, tmp_path, data_path, big_mb=8, holder_grace=2.0)
    health = host.mounts.client.health()
    assert health is not None
    os.kill(int(health["pid"]), signal.SIGKILL)
    started = time.monotonic()
    assert outcomes(readers(mnt, ["data/blob0"]), src, timeout=60) == ["eio"]
    assert time.monotonic() - started >= 1.5  # it waited for a successor first
    # a successor serves again: the group's reads (fanotify), or a new FUSE connection once the
    # holder aborted the old one (FUSE: its mounts are stacked again)
    assert host.mounts.remount() == (0 if data_path == "fanotify" else 1)
    assert_trees_equal(src, mnt)


def test_holder_and_daemon_both_gone_means_a_new_generation(hosts, tmp_path: Path, data_path: str) -> None:
    src, host, mnt = lazy_host(hosts, tmp_path, data_path, big_mb=0, writable=True)
    (mnt / "agent-wrote").write_text("kept")
    health = host.mounts.client.health()
    assert health is not None
    os.kill(int(health["holder"]), signal.SIGKILL)
    os.kill(int(health["pid"]), signal.SIGKILL)
    time.sleep(0.3)
    assert host.mounts.remount() >= 1  # the old kernel state is gone: re-stacked on a new generation
    after = host.mounts.client.health()
    assert after is not None
    assert after["generation"] != health["generation"]
    assert (mnt / "agent-wrote").read_text() == "kept"
    assert_trees_equal(src, mnt, ignore=lambda p: p == b"agent-wrote", check_mtime=False)


def test_a_mount_asks_a_serving_daemon_once_and_learns_its_generation_from_the_answer(
        hosts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One round trip per mount to a daemon that serves; an older daemon, whose answer does not
    name its generation, is asked for its health (which waits until it serves) and asked again."""
    src, host, mnt = lazy_host(hosts, tmp_path, "fanotify", big_mb=0)
    client = host.mounts.client
    health = client.health()
    assert health is not None
    asked: list[str] = []
    real = type(client).request
    older = [False]

    def spy(self, method: str, path: str, body=None, **kw):  # type: ignore[no-untyped-def]
        asked.append(path)
        reply = real(self, method, path, body, **kw)
        if older[0] and path == "/layers":
            reply.pop("generation")
        return reply

    monkeypatch.setattr(type(client), "request", spy)
    second = host.mount("test/img")
    assert asked == ["/layers"]
    assert_trees_equal(src, second)
    older[0] = True
    asked.clear()
    third = host.mount("test/img")
    assert asked == ["/layers", "/health", "/layers"]
    assert_trees_equal(src, third)
    layers = host.mounts.table.read()["layers"]
    assert {info["generation"] for info in layers.values()} == {health["generation"]}
    assert mnt.is_dir()


def test_a_mount_whose_daemon_dies_mid_request_is_served_by_its_successor(hosts, tmp_path: Path) -> None:
    """The daemon takes a mount's request and dies before it answers: the mount starts a successor
    (which takes the kernel state over from the holder) and asks it, instead of failing."""
    src, host, _ = lazy_host(hosts, tmp_path, "fanotify", big_mb=0)
    before = host.mounts.client.health()
    assert before is not None
    pid = int(before["pid"])
    os.kill(pid, signal.SIGSTOP)  # a stopped daemon still takes connections: the request waits in its socket
    with ThreadPoolExecutor(1) as pool:
        # (the kill comes before the pool's exit waits for the mount, even when an assertion fails:
        # a stopped daemon would hold the mount for the client's whole timeout)
        try:
            mounting = pool.submit(host.mount, "test/img")
            time.sleep(0.5)
            assert not mounting.done()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        second = mounting.result(60)
    assert_trees_equal(src, second)
    after = host.mounts.client.health()
    assert after is not None
    assert (after["pid"] != pid, after["generation"]) == (True, before["generation"])


def test_a_killed_holder_is_replaced_while_the_daemon_lives(hosts, tmp_path: Path, data_path: str) -> None:
    src, host, mnt = lazy_host(hosts, tmp_path, data_path, big_mb=8)
    health = host.mounts.client.health()
    assert health is not None
    os.kill(int(health["holder"]), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = host.mounts.client.health()
        if now and now["holder"] != health["holder"]:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the daemon did not start a new holder")
    # and the new holder makes a daemon restart as safe as before
    os.kill(int(health["pid"]), signal.SIGKILL)
    running = readers(mnt, ["data/blob0"])
    assert host.mounts.remount() == 0
    assert outcomes(running, src) == ["ok"]


def test_a_blob_without_its_mark_is_refused_not_mounted(hosts, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAYERBOX_FAULT", "skip-mark")  # the daemon "loses" the mark of new blobs
    with pytest.raises(Exception, match="no fanotify mark"):
        lazy_host(hosts, tmp_path, "fanotify", big_mb=0)
    assert kmount.mounts_under(tmp_path / "host" / "layers") == []  # nothing reads zeros anywhere


def test_eviction_under_a_tiny_cache_while_readers_run(hosts, tmp_path: Path, data_path: str) -> None:
    src, host, mnt = lazy_host(hosts, tmp_path, data_path, big_mb=48, cache_size=8 << 20,
                               evict_min_age=0.2)
    names = [f"data/blob{i}" for i in range(6)]
    for _ in range(2):
        drop_caches()
        assert outcomes(readers(mnt, names), src) == ["ok"] * 6
    deadline = time.monotonic() + 20  # chunks read within evict_min_age wait for their turn
    while host.stats()["cache"]["bytes"] > 8 << 20 and time.monotonic() < deadline:
        time.sleep(0.1)
    st = host.stats()
    assert st["cache"]["evictions"] > 0
    assert st["cache"]["bytes"] <= 8 << 20
    assert st["read_errors"] == 0
    blob = host.data_dir / "blobcache" / next(iter(st["bytes_fetched_per_layer"])).removeprefix("blake3:")
    assert os.stat(f"{blob}.blob").st_blocks * 512 <= (8 << 20) + (1 << 20)  # the file, not only the count


def test_background_fill_makes_the_layer_whole(hosts, tmp_path: Path, data_path: str) -> None:
    # --fill-after-uses 1: the whole image at its first mount (the default waits for a second use
    # that misses, or a long life: tests/test_lazyfetch_fill.py)
    src, host, mnt = lazy_host(hosts, tmp_path, data_path, big_mb=16, fill_below=1 << 30, fill_after_uses=1,
                               fill_max_busy=1.0)
    deadline = time.monotonic() + 60
    while host.stats()["layers_filled"] < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    st = host.stats()
    assert st["layers_filled"] == 1
    assert st["cache"]["complete_layers"] == 1
    fetched = st["bytes_fetched"]
    drop_caches()
    assert_trees_equal(src, mnt)
    assert host.stats()["bytes_fetched"] == fetched  # every read is local now
    assert host.stats()["chunks_prefetched"] > 0


def test_a_mounted_image_is_not_filled_above_the_threshold(hosts, tmp_path: Path) -> None:
    _, host, _ = lazy_host(hosts, tmp_path, "fanotify", big_mb=16, fill_below=1 << 20, fill_after_uses=1)
    time.sleep(1.0)
    st = host.stats()
    assert st["layers_filled"] == 0
    assert st["bytes_fetched"] < 4 << 20


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def test_a_full_blob_disk_gives_the_bytes_or_eio_never_zeros(hosts, tmp_path: Path) -> None:
    """Through fanotify the kernel reads the blob file itself, so a chunk the disk refuses cannot be
    served from memory: the read must fail (EIO), or succeed once eviction made room."""
    image, blobs = tmp_path / "blobs.img", tmp_path / "host" / "blobcache"
    with open(image, "wb") as f:
        f.truncate(6 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-m", "0", str(image)], check=True)
    blobs.mkdir(parents=True)
    # (util-linux sets the loop device up with autoclear: it goes with the umount)
    subprocess.run(["mount", "-t", "ext4", "-o", "loop", str(image), str(blobs)], check=True)
    try:
        src, host, mnt = lazy_host(hosts, tmp_path, "fanotify", big_mb=24, cache_size=1 << 30)
        results = outcomes(readers(mnt, [f"data/blob{i}" for i in range(3)]), src)
        st = host.stats()
        assert st["cache_put_failures"] > 0  # the disk did refuse chunks
        assert "eio" in results or st["cache"]["evictions"] > 0  # and each read failed or made room
        assert st["read_errors"] >= results.count("eio")
        host.close()
    finally:
        subprocess.run(["umount", "-l", str(blobs)], check=False)


def test_callers_asking_for_a_new_layer_at_once_all_get_it_served(hosts, tmp_path: Path) -> None:
    """The daemon puts a new layer in its cache a moment before its blob has its fanotify mark:
    a caller that came in that moment was refused ("no fanotify mark"; 100 sandboxes forked at
    once hit it).  Now it waits for the registration under way, and every caller gets the layer."""
    url = f"file://{tmp_path / 'store'}"
    refs = [f"test/img{i}" for i in range(12)]
    for i, ref in enumerate(refs):
        src = make_source(tmp_path / f"src{i}", big_mb=0)
        (src / "which").write_text(ref)  # a layer of its own each
        publish_sync(url, tmp_path / "pub", str(src), ref)
    host = hosts(url, data_path="fanotify")
    host.mounts.start_daemon()
    for ref in refs:
        resolved = resolve_sync(url, host.data_dir, ref)
        with ThreadPoolExecutor(48) as pool:
            answers = list(pool.map(functools.partial(host.mounts.layer_files, trace=False, fill=False),
                                    [resolved] * 48))
        assert all(a == answers[0] for a in answers)
    mnt = host.mount(refs[0])
    assert (mnt / "which").read_text() == refs[0]
