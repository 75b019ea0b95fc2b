"""Where a container's runtime files live: crun's state and its bundle in the data dir's tmpfs
(sandbox.isolation.runfs), a container an older layerbox made on disk still run and destroyed
where it is, and the checkpoint records of snapshots/ kept only as long as their mount.

Each create and command used to make ~10 files on the data dir's disk and each destroy to
remove them; on ext4 without a journal every new inode then skips the ones freed in the last
minute.  What the tests check is where the files are, that the on-disk leftovers of an older
layerbox still work, and that nothing stays behind (no mount, no file)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.sandboxes import REF, manager, run, store_url  # noqa: F401  (fixtures)

from lazyfetch import kmount
from sandbox.core.model import check_sandbox_id
from sandbox.core.paths import SandboxPaths
from sandbox.host.manager import SandboxManager


def mount_of(path: Path) -> tuple[str, set[str]] | None:
    """(fstype, mount and superblock options) of the mount exactly at ``path``, or None."""
    real = os.path.realpath(path)
    for info in kmount.read_mountinfo():
        if info.mountpoint == real:
            return info.fstype, set(info.mount_options.split(",")) | set(info.super_options.split(","))
    return None


def test_crun_state_and_bundles_live_in_a_tmpfs_that_goes_with_the_last_sandbox(
        manager: SandboxManager) -> None:  # noqa: F811
    run_dir = manager.paths.run
    assert mount_of(run_dir) is None
    box = run(manager.create(REF))
    fstype, options = mount_of(run_dir) or ("none", set())
    assert fstype == "tmpfs"
    assert {"nosuid", "nodev", "noexec", "mode=700"} <= options, options
    assert (run_dir / "crun" / box.id).is_dir()
    assert sorted(os.listdir(run_dir / "bundles" / box.id)) == ["config.json", "init.pid"]
    # on the disk: the state and the mount point, nothing that changes with each command
    # (and the state's previous version, which its next write reuses: sandbox.core.paths.replace_beneath)
    assert sorted(n for n in os.listdir(box.dir) if not n.startswith(".state.json.")) == ["rootfs", "state.json"]
    assert not (manager.paths.runtime / box.id).exists()
    r = box.exec("cat /proc/self/status | grep -c ^Pid")  # a command's files come and go in the tmpfs
    assert (r.exit_code, r.stdout) == (0, b"1\n")
    assert sorted(os.listdir(run_dir / "bundles" / box.id)) == ["config.json", "init.pid"]
    second = run(manager.create(REF))
    box.destroy()
    assert not (run_dir / "bundles" / box.id).exists()
    assert not (run_dir / "crun" / box.id).exists()
    assert mount_of(run_dir) is not None  # the second sandbox still runs in it
    second.destroy()
    assert mount_of(run_dir) is None  # with the last sandbox: made again by the next create
    third = run(manager.create(REF))
    assert third.exec("true").exit_code == 0
    assert mount_of(run_dir) is not None
    third.destroy()


def test_a_container_an_older_layerbox_made_on_disk_runs_and_goes_where_it_is(
        manager: SandboxManager, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    runtime = manager.backend("container").runtime
    # as a layerbox before the tmpfs made it: crun's --root and the bundle in the data dir's disk
    with monkeypatch.context() as old:
        old.setattr(SandboxPaths, "bundle", lambda self, sid: (self.boxes, f"{check_sandbox_id(sid)}/bundle"))
        old.setattr(runtime, "root", manager.paths.runtime)
        legacy = run(manager.create(REF))
    assert (manager.paths.runtime / legacy.id).is_dir()
    assert (legacy.dir / "bundle" / "config.json").is_file()
    fresh = run(manager.create(REF))
    assert (manager.paths.crun / fresh.id).is_dir()
    assert not (manager.paths.runtime / fresh.id).exists()
    assert {c["id"] for c in runtime.list()} == {legacy.id, fresh.id}
    assert legacy.exec("echo old").stdout == b"old\n"
    assert fresh.exec("echo new").stdout == b"new\n"
    legacy.pause()
    legacy.resume()
    assert legacy.exec("echo again").stdout == b"again\n"
    # an upgraded edge's restart (a manager of its own on the data dir) adopts both
    upgraded = SandboxManager(manager.data_dir, manager.store_url)
    try:
        report = upgraded.reconcile()
    finally:
        upgraded.backend("container").runtime.close()  # (its sealed crun; close() would destroy them all)
    assert sorted(report["adopted"]) == sorted([legacy.id, fresh.id]), report
    assert report["destroyed"] == [], report
    assert legacy.exec("echo adopted").stdout == b"adopted\n"
    legacy.destroy()
    assert os.listdir(manager.paths.runtime) == []
    assert not legacy.dir.exists()
    fresh.destroy()
    assert runtime.list() == []


def test_a_bundle_a_crash_left_without_its_sandbox_is_removed_and_the_tmpfs_goes(
        manager: SandboxManager) -> None:  # noqa: F811
    box = run(manager.create(REF))
    stray = "lb-0123456789ab"
    (manager.paths.bundles / stray).mkdir()
    (manager.paths.bundles / stray / "config.json").write_text("{}")
    box.destroy()
    assert mount_of(manager.paths.run) is not None  # not unmounted over a bundle: it would be lost, not removed
    report = manager.reconcile()
    assert stray in report["orphans"], report
    assert mount_of(manager.paths.run) is None


def test_forks_write_no_checkpoint_record_and_a_destroy_drops_its_sandboxs(
        manager: SandboxManager) -> None:  # noqa: F811
    records = manager.data_dir / "state" / "snapshots"
    source = run(manager.create(REF))
    assert source.exec("echo one > /root/f").exit_code == 0
    ckpt, forks = run(source.fork(3))
    assert len(os.listdir(records)) == 1  # the source's (its checkpoint chain), none for the forks
    child = forks[0]
    assert child.exec("echo two >> /root/f").exit_code == 0
    second = run(child.checkpoint())
    assert second.parent == ckpt.digest
    assert second.entries >= 1
    assert len(os.listdir(records)) == 2
    again = run(manager.restore(second.name))
    assert again.exec("cat /root/f").stdout == b"one\ntwo\n"
    for box in [source, *forks, again]:
        box.destroy()
    assert os.listdir(records) == []
