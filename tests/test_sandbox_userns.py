"""Sandboxes in a user namespace on an idmapped rootfs: real kernel, real crun, the fixture image.

The manager does not do this yet (sandbox/manager.py is not wired), so the
``userbox`` fixture builds a sandbox the way ``SandboxManager._launch`` /
``_start`` would, plus the two new steps: ``idmap.remap_rootfs`` after the
image is mounted and ``build_spec(..., userns=...)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.env import require
from support.sandboxes import REF

from lazyfetch import kmount
from sandbox import idmap
from sandbox.files import RootFiles
from sandbox.manager import SandboxManager
from sandbox.spec import DEFAULT_PATH, IDLE_INIT, Limits, build_process, build_spec

pytestmark = [pytest.mark.usefixtures("need_root"), pytest.mark.root("erofs", "overlay", "fuse", "cmd:crun")]

HOST_BASE, SIZE = 100000, 65536


def _user_ns_inode(pid: int | str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/user").st_ino
    except OSError:
        return None


def _holders_of(ns_inode: int) -> list[str]:
    return [p for p in os.listdir("/proc") if p.isdigit() and _user_ns_inode(p) == ns_inode]


@dataclass
class UserBox:
    manager: SandboxManager
    id: str
    dir: Path
    rootfs: Path
    upper: Path
    pid: int
    cgroups_path: str
    timings: dict[str, float]

    def exec(self, cmd: str, *, uid: int = 0, gid: int = 0) -> subprocess.CompletedProcess[bytes]:
        tag = uuid.uuid4().hex[:8]
        process_file, pid_file = self.dir / f"exec-{tag}.json", self.dir / f"exec-{tag}.pid"
        process_file.write_text(json.dumps(build_process(["/bin/sh", "-c", cmd], env={"PATH": DEFAULT_PATH},
                                                         cwd="/", uid=uid, gid=gid)))
        proc = self.manager.runtime.exec(self.id, process_file, pid_file=pid_file, stdin=subprocess.DEVNULL)
        try:
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    def sh(self, cmd: str, **kw: int) -> str:
        res = self.exec(cmd, **kw)
        assert res.returncode == 0, (cmd, res.returncode, res.stderr.decode(errors="replace"))
        return res.stdout.decode()


def _teardown(manager: SandboxManager, sid: str, rootfs: Path, cgroups_path: str) -> None:
    """What SandboxManager.destroy does for a real sandbox; nothing extra is needed for the idmap."""
    if manager.runtime.state(sid) is not None:
        manager.runtime.delete(sid, force=True)
    if kmount.is_mountpoint(rootfs):
        manager.host.umount(rootfs, discard=True)  # the idmapped overlay sits where the plain one was
    manager._remove_cgroups(cgroups_path)
    manager._remove_cgroups(f"/{manager.cgroup_parent}")


@contextlib.contextmanager
def _userbox(manager: SandboxManager, *, netns: str | None = None, ns_fd: int | None = None) -> Iterator[UserBox]:
    require("cmd:crun")
    async def resolve() -> Any:
        async with await manager._store() as store:
            return await store.resolve(REF)

    resolved = asyncio.run(resolve())
    sid = "lbu-" + uuid.uuid4().hex[:10]
    box_dir = manager.data_dir / "userns" / sid
    bundle = box_dir / "bundle"
    bundle.mkdir(parents=True)
    # crun enters the user namespace before it mounts the rootfs: every directory on the way to
    # it must be searchable by the host uid HOST_BASE, which pytest's 0700 temp root is not
    top = Path(tempfile.mkdtemp(prefix=f"{sid}-", dir="/run"))
    top.chmod(0o711)
    rootfs = top / "rootfs"
    rootfs.mkdir()
    cgroups_path = f"/{manager.cgroup_parent}/{sid}"
    timings: dict[str, float] = {}
    try:
        t0 = time.perf_counter()
        result = manager.host.mount(resolved, rootfs, writable=True)
        t1 = time.perf_counter()
        idmap.remap_rootfs(rootfs, HOST_BASE, SIZE, ns_fd=ns_fd)  # the one new mount step
        t2 = time.perf_counter()
        process = build_process(IDLE_INIT, env={"PATH": DEFAULT_PATH, "HOME": "/root"}, cwd="/", uid=0, gid=0)
        spec = build_spec(str(rootfs), process, hostname=sid, cgroups_path=cgroups_path, limits=Limits(),
                          cgroup_version=manager.layout.version, netns_path=netns, userns=(HOST_BASE, SIZE))
        (bundle / "config.json").write_text(json.dumps(spec))
        manager.runtime.create(sid, bundle, pid_file=box_dir / "init.pid")
        manager.runtime.start(sid)
        t3 = time.perf_counter()
        timings.update(mount=t1 - t0, remap=t2 - t1, crun=t3 - t2)
        assert result.upper is not None
        yield UserBox(manager, sid, box_dir, rootfs, Path(result.upper), int((box_dir / "init.pid").read_text()),
                      cgroups_path, timings)
    finally:
        _teardown(manager, sid, rootfs, cgroups_path)
        shutil.rmtree(box_dir, ignore_errors=True)
        assert kmount.mounts_under(box_dir) == []
        assert kmount.mounts_under(top) == []
        shutil.rmtree(top, ignore_errors=True)
        assert all(c["id"] != sid for c in manager.runtime.list())


@pytest.fixture
def userbox(manager: SandboxManager) -> Iterator[UserBox]:
    with _userbox(manager) as box:
        yield box


# -- kernel facts the design rests on ------------------------------------------------------------
def test_userns_fd_maps_and_leaves_no_holder() -> None:
    started = time.perf_counter()
    with idmap.userns(HOST_BASE, SIZE) as fd:
        elapsed = time.perf_counter() - started
        ino = os.fstat(fd).st_ino
        assert _holders_of(ino) == []  # the fd alone keeps it: the holder child is gone and reaped
        # the mapping is what we asked for: enter it in a throwaway child and read its own map
        child = subprocess.run(["nsenter", f"--user=/proc/self/fd/{fd}", "cat", "/proc/self/uid_map",
                                "/proc/self/gid_map"], pass_fds=(fd,), capture_output=True, timeout=30)
        assert child.returncode == 0, child.stderr
        assert child.stdout.split() == [b"0", str(HOST_BASE).encode(), str(SIZE).encode()] * 2
    assert elapsed < 0.5, elapsed
    with pytest.raises(ValueError, match="non-root uid range"):
        idmap.userns_fd(0, SIZE)  # mapping host root would defeat the point


def test_overlay_cannot_be_idmapped_but_its_layers_can(manager: SandboxManager, userbox: UserBox) -> None:
    """Why remap_rootfs rebuilds the overlay: mount_setattr(MOUNT_ATTR_IDMAP) on overlayfs is EINVAL."""
    target = userbox.dir / "probe"
    target.mkdir()
    with idmap.userns(HOST_BASE, SIZE) as fd:
        with pytest.raises(idmap.IdmapError) as info:
            idmap.idmapped_clone(userbox.rootfs, target, fd)
        assert info.value.errno == errno.EINVAL
        assert not kmount.is_mountpoint(target)  # a refused clone leaves nothing attached
        layer = next(iter(manager.host.status()["layers"].values()))["mountpoint"]  # one EROFS layer
        idmap.idmapped_clone(layer, target, fd)
        try:
            assert os.stat(target).st_uid == HOST_BASE  # image root (uid 0 in EROFS) seen shifted
            assert "idmapped" in next(m for m in kmount.read_mountinfo()
                                      if m.mountpoint == str(target)).mount_options.split(",")
        finally:
            idmap.unmount(target)
    assert not kmount.is_mountpoint(target)


# -- the sandbox -----------------------------------------------------------------------------------
def test_root_inside_is_an_unprivileged_host_uid(userbox: UserBox) -> None:
    box = userbox
    print(f"\nuserns sandbox timings (ms): { {k: round(v * 1000, 1) for k, v in box.timings.items()} }")
    assert box.sh("id -u; id -g").split() == ["0", "0"]
    assert box.sh("cat /proc/self/uid_map").split() == ["0", str(HOST_BASE), str(SIZE)]
    # the image's ownership is intact inside: root files, and a group-owned one (shadow is 42 in Debian)
    assert box.sh("stat -c %u:%g /etc/passwd /usr/bin/python3 /").split() == ["0:0"] * 3
    assert box.sh("stat -c %g /etc/shadow").strip() == "42"
    # from the host, the container's processes run as the unprivileged range
    for pid in (box.pid, ):
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        assert status["Uid"].split() == [str(HOST_BASE)] * 4
        assert status["Gid"].split() == [str(HOST_BASE)] * 4
    sleeper = box.exec("sleep 30 >/dev/null 2>&1 & echo $!")  # an exec's process, seen from the host
    assert sleeper.returncode == 0
    host_uids = {Path(f"/proc/{p}/status").read_text().split("Uid:")[1].split()[0]
                 for p in Path(box.manager.layout.controller_dir("pids", box.cgroups_path) or "/nonexistent",
                               ).joinpath("cgroup.procs").read_text().split()}
    assert host_uids == {str(HOST_BASE)}
    # cgroups (v1 here) still apply: the memory limit is set on the sandbox's cgroup
    mem = box.manager.layout.controller_dir("memory", box.cgroups_path)
    assert mem is not None
    limit = (mem / ("memory.max" if box.manager.layout.version == 2 else "memory.limit_in_bytes")).read_text()
    assert int(limit) == Limits().memory


def test_writes_land_with_image_ownership_on_disk(userbox: UserBox) -> None:
    box = userbox
    box.sh("echo new > /root/new.txt; echo '# appended' >> /etc/passwd; mkdir -p /srv/app;"
           "chown 1000:1000 /srv/app; touch /srv/app/by-root")
    box.sh("touch /srv/app/by-1000", uid=1000, gid=1000)
    nobody = box.sh("grep ^nobody: /etc/passwd").split(":")  # a user of the image's /etc/passwd
    box.sh("echo hi > /tmp/by-nobody", uid=int(nobody[2]), gid=int(nobody[3]))
    assert box.sh("stat -c %u:%g /root/new.txt /etc/passwd /srv/app/by-1000 /tmp/by-nobody").split() == [
        "0:0", "0:0", "1000:1000", f"{nobody[2]}:{nobody[3]}"]
    # on disk (what a checkpoint reads): the image's ids, never the host range
    upper = box.upper
    owners = {p: (os.lstat(upper / p).st_uid, os.lstat(upper / p).st_gid)
              for p in ("root/new.txt", "etc/passwd", "srv/app", "srv/app/by-root", "srv/app/by-1000",
                        "tmp/by-nobody")}
    assert owners == {"root/new.txt": (0, 0), "etc/passwd": (0, 0), "srv/app": (1000, 1000),
                      "srv/app/by-root": (0, 0), "srv/app/by-1000": (1000, 1000),
                      "tmp/by-nobody": (int(nobody[2]), int(nobody[3]))}
    assert (upper / "etc/passwd").read_text().endswith("# appended\n")
    for dirpath, dirnames, filenames in os.walk(upper):
        for name in dirnames + filenames:
            assert os.lstat(os.path.join(dirpath, name)).st_uid < SIZE, os.path.join(dirpath, name)
    # uids outside the mapping cannot be created inside
    denied = box.exec("chown 70000 /root/new.txt")
    assert denied.returncode != 0


def test_confinement_still_holds(userbox: UserBox) -> None:
    box = userbox
    status = dict(line.split(":\t", 1) for line in box.sh("cat /proc/self/status").splitlines() if ":\t" in line)
    assert status["Seccomp"].strip() == "2"
    assert status["NoNewPrivs"].strip() == "1"
    # nested user namespaces stay refused: inside one, a process would hold every capability again
    res = box.exec("unshare -U true")
    assert res.returncode != 0
    assert b"Operation not permitted" in res.stderr
    assert b"Read-only file system" in box.exec("echo 1 > /proc/sys/kernel/hostname").stderr
    # root of the sandbox is not root of the host: host-owned objects it can still see are nobody's
    assert box.sh("stat -c %u /proc/1/ns/user; ls /sys/fs/cgroup | head -1").split()[0] == "0"
    assert box.sh("stat -c %U /proc/sys/kernel/hostname").strip() == "nobody"
    assert box.sh("ls /dev | sort").split() == sorted(
        "core fd full mqueue null ptmx pts random shm stderr stdin stdout tty urandom zero".split())
    assert box.sh("echo ok > /dev/null; head -c 4 /dev/urandom | wc -c").strip() == "4"


def test_host_file_api_needs_the_sandbox_fs_identity(userbox: UserBox) -> None:
    """Host root has no mapping in the idmapped layers: the files API must act as container root."""
    files = RootFiles(userbox.rootfs)
    assert files.read("/etc/hostname") is not None
    assert files.stat("/etc/passwd").st_uid == HOST_BASE  # the host sees the shifted ids
    with pytest.raises(OSError, match="Value too large") as info:
        files.write("/root/from-host.txt", b"x")
    assert info.value.errno == errno.EOVERFLOW
    with idmap.fs_identity(HOST_BASE, HOST_BASE):
        files.write("/root/from-host.txt", b"x")
    assert os.lstat(userbox.upper / "root/from-host.txt").st_uid == 0
    assert userbox.sh("stat -c %u /root/from-host.txt; cat /root/from-host.txt").split() == ["0", "x"]


def test_creation_cost(manager: SandboxManager) -> None:
    """Measured: the remap step (userns + idmapped overlay), and crun create+start under a userns."""
    fresh = [_timed(manager, None) for _ in range(3)]
    with idmap.userns(HOST_BASE, SIZE) as fd:  # what a manager keeping one namespace per range pays
        cached = [_timed(manager, fd) for _ in range(3)]
    med = {name: {k: sorted(t[k] for t in runs)[1] * 1000 for k in ("mount", "remap", "crun")}
           for name, runs in (("fresh userns", fresh), ("cached userns", cached))}
    print(f"\ncreation cost, median of 3 (ms): {med}")
    assert med["fresh userns"]["remap"] < 500


def _timed(manager: SandboxManager, ns_fd: int | None) -> dict[str, float]:
    with _userbox(manager, ns_fd=ns_fd) as box:
        assert box.sh("id -u").strip() == "0"
        return box.timings


@pytest.mark.xfail(strict=True, reason="netns owned by the initial userns: crun 1.8 cannot mount sysfs and "
                   "silently bind-mounts the host's /sys (host interfaces visible); needs the netns created "
                   "inside the sandbox's userns (sandbox/network.py) - see the report")
def test_joined_network_namespace(manager: SandboxManager) -> None:
    """sandbox.network hands crun a netns made by host root: sysfs cannot be mounted from our userns."""
    name = "lbu-" + uuid.uuid4().hex[:8]
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        with _userbox(manager, netns=f"/run/netns/{name}") as box:
            assert box.sh("ls /sys/class/net | sort").split() == ["lo"]
            assert box.sh("id -u").strip() == "0"
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True, timeout=30)


def test_unmapped_exec_uid_is_refused(manager: SandboxManager) -> None:
    """A process uid outside the mapping cannot exist inside: crun exec fails, the sandbox lives on."""
    with _userbox(manager) as box:
        res = box.exec("true", uid=SIZE + 5)
        assert res.returncode != 0
        print(f"\ncrun exec with uid {SIZE + 5}: rc={res.returncode} {res.stderr.decode(errors='replace')!r}")
        assert box.sh("id -u").strip() == "0"
