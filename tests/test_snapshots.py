"""Checkpoints of writable mounts restored on a second host (own data dir and daemon, empty cache)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from layerstore.gc import collect
from layerstore.store import Store
from layerstore.verify import verify
from snapshots.checkpoint import Snapshots
from snapshots.errors import CheckpointMismatch, SnapshotError
from tests.support.hosts import Host, publish_sync
from tests.support.moto import MotoServer, aws_test_env, file_and_s3_store_url, moto_fixture  # noqa: F401
from tests.support.treecmp import assert_trees_equal

pytestmark = [pytest.mark.usefixtures("need_root"), pytest.mark.root("erofs", "overlay", "fuse")]

moto = moto_fixture("module")
REPO = Path(__file__).resolve().parents[1]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _with_snapshots(host: Host, fn: Any) -> Any:
    async with await Store.open(host.url, host.data_dir) as store:
        return await fn(Snapshots(store, host.mounts))


def checkpoint(host: Host, mnt: Path, **kw: Any) -> Any:
    return run(_with_snapshots(host, lambda s: s.checkpoint(str(mnt), **kw)))


def restore(host: Host, ref: str, **kw: Any) -> Path:
    mp = host.data_dir.parent / f"restored-{host.data_dir.name}-{len(host.points)}"
    mp.mkdir(exist_ok=True)  # a refused restore leaves its (empty) mount point behind
    run(_with_snapshots(host, lambda s: s.restore(ref, str(mp), **kw)))
    host.points.append(mp)
    return mp


def base_tree(root: Path) -> Path:
    (root / "etc").mkdir(parents=True)
    (root / "etc/config").write_text("base config\n")
    (root / "etc/remove-me").write_text("doomed\n")
    (root / "lib/deep/dir").mkdir(parents=True)
    (root / "lib/deep/dir/file").write_bytes(os.urandom(300_000))
    (root / "lib/keep").write_text("keep")
    (root / "replace-dir/sub").mkdir(parents=True)
    (root / "replace-dir/sub/x").write_text("x")
    (root / "will-be-dir").write_text("a file first")
    (root / "big.bin").write_bytes(os.urandom(3 << 20))
    return root


def snapshot_view(src: Path, dst: Path) -> Path:
    """What a restore must reproduce: a full copy of the mount's merged view."""
    subprocess.run(["cp", "-a", "--preserve=all", f"{src}/.", str(dst)], check=True)
    return dst




def test_checkpoint_restores_on_another_host(hosts, store_url: str, tmp_path: Path) -> None:
    publish_sync(store_url, tmp_path / "pub", str(base_tree(tmp_path / "base")), "img/base")
    h1 = hosts(store_url, "h1")
    mnt = h1.mount("img/base", writable=True)
    (mnt / "etc/config").write_text("modified\n")
    (mnt / "etc/remove-me").unlink()
    (mnt / "new/nested").mkdir(parents=True)
    (mnt / "new/nested/file").write_bytes(os.urandom(200_000))
    os.rename(mnt / "lib/keep", mnt / "lib/renamed")
    os.chmod(mnt / "lib/deep/dir/file", 0o600)
    shutil.rmtree(mnt / "replace-dir")
    (mnt / "replace-dir").write_text("now a file")
    (mnt / "will-be-dir").unlink()
    (mnt / "will-be-dir").mkdir()
    (mnt / "will-be-dir/inside").write_text("inside")
    os.link(mnt / "new/nested/file", mnt / "new/hardlink")
    os.setxattr(mnt / "etc/config", "user.note", b"checkpointed")
    os.symlink("../etc/config", mnt / "new/link")
    os.chown(mnt / "new/nested", 1234, 4321)
    expected = snapshot_view(mnt, tmp_path / "expected")
    ckpt = checkpoint(h1, mnt, labels={"step": "1"}, trajectory_offset=17, receipt_id="r-17", policy_version="p1")
    assert ckpt.bytes_changed < 1 << 20  # big.bin was not touched: not captured
    h2 = hosts(store_url, "h2")
    restored = restore(h2, ckpt.name, policy_version="p1")
    assert_trees_equal(expected, restored, check_root_meta=False)
    # the restored mount is writable with a fresh upper
    (restored / "after-restore").write_text("ok")
    shown = run(_with_snapshots(h2, lambda s: s.show(ckpt.name)))
    assert (shown["trajectory_offset"], shown["receipt_id"], shown["labels"]) == (17, "r-17", {"step": "1"})
    assert shown["bound"]["policy_version"] == "p1"


def test_chain_of_twenty_incremental_checkpoints(hosts, tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    publish_sync(url, tmp_path / "pub", str(base_tree(tmp_path / "base")), "img/chain")
    h1 = hosts(url, "h1")
    mnt = h1.mount("img/chain", writable=True)
    views = []
    ckpts = []
    for i in range(20):
        (mnt / f"step-{i}").write_text(f"step {i}\n")
        (mnt / "counter").write_text(str(i))
        if i % 3 == 0 and (mnt / f"step-{i - 1}").exists():
            (mnt / f"step-{i - 1}").unlink()
        if i == 10:
            shutil.rmtree(mnt / "lib")
        ckpts.append(checkpoint(h1, mnt, labels={"i": str(i)}))
        views.append(snapshot_view(mnt, tmp_path / f"view-{i}"))
    # incremental: each checkpoint captured a handful of entries, never the big file
    assert all(c.bytes_changed < 100 for c in ckpts)
    assert [c.layers for c in ckpts] == list(range(2, 22))
    unchanged = checkpoint(h1, mnt)
    assert unchanged.bytes_changed == 0
    h2 = hosts(url, "h2")
    for i in (0, 9, 10, 19):
        restored = restore(h2, ckpts[i].name)
        assert_trees_equal(views[i], restored, check_root_meta=False)
    listed = run(_with_snapshots(h2, lambda s: s.list()))
    assert len(listed) == 21
    # squashing keeps the final view in one layer above the image
    from snapshots.squash import squash

    result = run(_with_snapshots(h2, lambda s: squash(s.store, ckpts[19].name, name="checkpoints/squashed")))
    assert result["squashed"] == 20
    squashed = restore(h2, "checkpoints/squashed")
    assert_trees_equal(views[19], squashed, check_root_meta=False)
    shown = run(_with_snapshots(h2, lambda s: s.show("checkpoints/squashed")))
    assert len(shown["layers"]) == 2


PROGRAM = textwrap.dedent("""
    import json, os, sys
    path = os.path.join(sys.argv[1], "agent-state.json")
    state = json.load(open(path)) if os.path.exists(path) else {"steps": 0, "log": []}
    state["steps"] += 1
    state["log"].append(f"step {state['steps']}")
    json.dump(state, open(path, "w"))
    print(state["steps"])
""")


def test_program_state_survives_checkpoint_and_restore(hosts, tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    publish_sync(url, tmp_path / "pub", str(base_tree(tmp_path / "base")), "img/prog")
    h1 = hosts(url, "h1")
    mnt = h1.mount("img/prog", writable=True)
    for _ in range(3):
        subprocess.run([sys.executable, "-c", PROGRAM, str(mnt)], check=True, capture_output=True)
    ckpt = checkpoint(h1, mnt)
    h2 = hosts(url, "h2")
    restored = restore(h2, ckpt.name)
    out = subprocess.run([sys.executable, "-c", PROGRAM, str(restored)], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "4"  # it continued where it was preempted


CRASHER = textwrap.dedent("""
    import asyncio, sys, time
    from layerstore.store import Store
    from lazyfetch.mounts import HostMounts
    from snapshots.checkpoint import Snapshots

    def hang():
        print("STORED", flush=True)  # every object written, the ref not yet moved
        time.sleep(60)

    async def main():
        async with await Store.open(sys.argv[1], sys.argv[2]) as store:
            await Snapshots(store, HostMounts(sys.argv[2], sys.argv[1])).checkpoint(sys.argv[3], before_ref=hang)
            print("DONE", flush=True)
    asyncio.run(main())
""")


def test_crash_during_checkpoint_leaves_mount_usable_and_rerun_works(hosts, tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    publish_sync(url, tmp_path / "pub", str(base_tree(tmp_path / "base")), "img/crash")
    h1 = hosts(url, "h1")
    mnt = h1.mount("img/crash", writable=True)
    (mnt / "large-write").write_bytes(os.urandom(60 << 20))
    proc = subprocess.Popen([sys.executable, "-c", CRASHER, url, str(h1.data_dir), str(mnt)],
                            stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "STORED"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    async def refs(s: Snapshots) -> list[str]:
        return [r.name for r in await s.store.list_refs("checkpoints/")]

    assert run(_with_snapshots(h1, refs)) == []  # no checkpoint names missing data
    assert run(_with_snapshots(h1, lambda s: verify(s.store))).ok
    (mnt / "still-usable").write_text("yes")
    ckpt = checkpoint(h1, mnt)
    h2 = hosts(url, "h2")
    restored = restore(h2, ckpt.name)
    assert (restored / "still-usable").read_text() == "yes"
    assert (restored / "large-write").stat().st_size == 60 << 20


def test_restore_refuses_missing_objects_and_policy_mismatch(hosts, tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    publish_sync(url, tmp_path / "pub", str(base_tree(tmp_path / "base")), "img/refuse")
    h1 = hosts(url, "h1")
    mnt = h1.mount("img/refuse", writable=True)
    (mnt / "w").write_bytes(os.urandom(50_000))
    ckpt = checkpoint(h1, mnt, policy_version="v1")
    h2 = hosts(url, "h2")
    with pytest.raises(CheckpointMismatch, match="policy"):
        restore(h2, ckpt.name, policy_version="v2")
    packs = [p for p in (tmp_path / "store/packs").rglob("*") if p.is_file() and not p.name.startswith(".")]
    victim = max(packs, key=lambda p: p.stat().st_mtime)  # the checkpoint's own pack
    victim.unlink()
    with pytest.raises(SnapshotError, match=victim.name):
        restore(h2, ckpt.name)
    assert h2.mounts.status()["mounts"] == {}  # refused before mounting anything


def test_checkpoints_are_gc_roots(hosts, tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    publish_sync(url, tmp_path / "pub", str(base_tree(tmp_path / "base")), "img/gc")
    h1 = hosts(url, "h1")
    mnt = h1.mount("img/gc", writable=True)
    (mnt / "precious").write_bytes(os.urandom(100_000))
    ckpt = checkpoint(h1, mnt)

    async def gc_and_verify(s: Snapshots) -> bool:
        await collect(s.store, grace=0)
        return (await verify(s.store, ckpt.name)).ok

    assert run(_with_snapshots(h1, gc_and_verify))

    async def delete_and_gc(s: Snapshots) -> int:
        await s.delete(ckpt.name)
        return len((await collect(s.store, grace=0)).deleted)

    assert run(_with_snapshots(h1, delete_and_gc)) > 0


def test_sync_api(hosts, tmp_path: Path) -> None:
    from snapshots.sync import SyncSnapshots

    url = f"file://{tmp_path / 'store'}"
    publish_sync(url, tmp_path / "pub", str(base_tree(tmp_path / "base")), "img/sync")
    h1 = hosts(url, "h1")
    mnt = h1.mount("img/sync", writable=True)
    (mnt / "s").write_text("sync")
    api = SyncSnapshots(h1.data_dir, url)
    ckpt = api.checkpoint(str(mnt), name="ck/sync:1")
    assert [c["name"] for c in api.list("ck/")] == ["ck/sync:1"]
    assert api.show("ck/sync:1")["digest"] == ckpt.digest
    h2 = hosts(url, "h2")
    target = tmp_path / "sync-restore"
    target.mkdir()
    h2.points.append(target)
    SyncSnapshots(h2.data_dir, url).restore("ck/sync:1", str(target))
    assert (target / "s").read_text() == "sync"
    api.delete("ck/sync:1")
    assert api.list("ck/") == []
