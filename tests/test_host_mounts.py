"""Host-side mounts and the data dir, attacked the way a local user of the host would.

A setuid-root binary that an agent writes into its upper or that an image ships, and a
device node with the host disk's numbers in a layer, must give a non-root host user
nothing through any host path layerbox makes: the data dir's private subtrees are 0700
(traversal fails with EACCES), and every mount carries nosuid,nodev (layers, and a
sandbox's own ext4, also noexec), so even root reaching them keeps its euid and cannot
open the host's disk.  Containers still execute through their overlay.

The data dir is made 0755 (as /var/lib/layerbox usually is) and pytest's 0700 temp root
is opened for traversal, so that only layerbox's own modes and flags stand in the way.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from support.proc import run as run_cmd
from support.sandboxes import REF, kill_daemon, run
from support.tarbuild import TarBuilder

from lazyfetch.client import private_dirs
from lazyfetch.errors import LazyfetchError
from sandbox.host.manager import Sandbox, SandboxManager
from tests.support.hosts import Host, publish_sync

pytestmark = [pytest.mark.usefixtures("need_root"), pytest.mark.root("erofs", "overlay", "fuse", "cmd:crun")]

NOBODY = 65534
# The data dir's subtrees that hold layers, uppers and work dirs, metadata images, chunks, the
# store's cache and mount state (lazyfetch.client.PRIVATE_DIRS, spelled out: this is the contract)
PRIVATE_DIRS = ("state", "layers", "uppers", "meta", "blobcache", "cache")
# The payload: `id -u` prints the effective uid, and unlike a shell (dash, bash) id does not
# drop a setuid one, so a working setuid bit shows as "euid=0".
PAYLOAD = "/usr/bin/id"
# What an agent does to leave a setuid-root program behind, and one owned by another uid (run
# by host root, only nosuid keeps its euid at 0).  It opens /root too (0700 in the image): the
# test is about the directories and mounts layerbox controls, not the image's own modes.
AGENT = (f"cp {PAYLOAD} /root/s && chmod 4755 /root/s && cp {PAYLOAD} /root/s1000 && "
         "chown 1000:1000 /root/s1000 && chmod 4755 /root/s1000 && chmod 755 /root")

# Run as root or, with setpriv, as an unprivileged host user (setuid bits honoured: no
# no_new_privs).  Per path: the errno of the first step that failed, or what the last gave.
PROBE = r"""
import errno, json, os, stat, subprocess, sys
out = {}
for path in sys.argv[1:]:
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISDIR(mode):
            os.listdir(path)
            out[path] = "listed"
        elif stat.S_ISBLK(mode) or stat.S_ISCHR(mode):
            os.close(os.open(path, os.O_RDONLY))
            out[path] = "opened"
        elif not mode & 0o111:
            os.close(os.open(path, os.O_RDONLY))
            out[path] = "read"
        else:
            done = subprocess.run([path, "-u"], capture_output=True, timeout=60)
            out[path] = "euid=" + done.stdout.decode().strip() if done.returncode == 0 else f"exit {done.returncode}"
    except OSError as exc:
        out[path] = errno.errorcode[exc.errno]
print(json.dumps(out))
"""


def probe(paths: Sequence[str | os.PathLike[str]], *, uid: int | None = None) -> dict[str, str]:
    """Reach each path as host root (``uid=None``) or as host ``uid``: "EACCES", "ENOENT", ...,
    "listed" (a directory), "opened" (a device), "read" (a file without x bits) or "euid=N" (a
    program's ``-u`` output)."""
    argv = ["/usr/bin/python3", "-I", "-c", PROBE, *map(os.fspath, paths)]
    if uid is not None:
        argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *argv]
    return dict(json.loads(run_cmd(argv, timeout=300).stdout))


def _mount_options(line: str) -> tuple[str, str, set[str]]:
    """(mount point, fstype, per-mount options) of one mountinfo line (paths without escapes)."""
    fields = line.split(" ")
    sep = fields.index("-", 6)
    return fields[4], fields[sep + 1], set(fields[5].split(","))


def host_mounts(root: Path) -> list[tuple[str, str, set[str]]]:
    below = os.path.realpath(root) + "/"
    lines = Path("/proc/self/mountinfo").read_text().splitlines()
    return [m for m in map(_mount_options, lines) if m[0].startswith(below)]


def mount_at(path: str | os.PathLike[str], table: str = "/proc/self/mountinfo") -> tuple[str, set[str]]:
    """(fstype, per-mount options) of the topmost mount at ``path`` in a mount table."""
    found = [m for m in map(_mount_options, Path(table).read_text().splitlines()) if m[0] == os.fspath(path)]
    assert found, f"nothing is mounted at {path} in {table}"
    return found[-1][1], found[-1][2]


def container_root(box: Sandbox) -> tuple[str, set[str]]:
    """The mount a sandbox's processes see as "/": its overlay, as crun left it in their namespace."""
    return mount_at("/", f"/proc/{box.pid}/mountinfo")


@pytest.fixture
def host_overlays(manager: SandboxManager, monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple[str, set[str]]]:
    """rootfs -> its overlay on the host, read just before it leaves the host's mount table for the
    container that holds it (at create, and when a daemon restart re-stacks it)."""
    seen: dict[str, tuple[str, set[str]]] = {}
    detach = manager.host._detach

    def recording(rec: dict[str, Any], target: str, pid: int, **how: bool) -> int | None:
        seen[target] = mount_at(target)
        return detach(rec, target, pid, **how)

    monkeypatch.setattr(manager.host, "_detach", recording)
    return seen


def assert_data_dir_mounts(mounts: list[tuple[str, str, set[str]]]) -> None:
    """Layers, a sandbox's disk, the blobs: nosuid,nodev; noexec where nothing runs from them;
    the shared sysfs and its namespace's file read-only as well; the tmpfs of crun's state and the
    bundles noexec."""
    for mountpoint, fstype, options in mounts:
        assert {"nosuid", "nodev"} <= options, (mountpoint, fstype, options)
        if fstype in ("erofs", "ext4", "sysfs", "nsfs", "tmpfs"):
            assert "noexec" in options, (mountpoint, fstype, options)
        if fstype in ("sysfs", "nsfs"):
            assert "ro" in options, (mountpoint, fstype, options)


def assert_view(where: str, options: set[str]) -> None:
    """A caller's mount of an image (a container's rootfs): nosuid,nodev, and it executes."""
    assert {"nosuid", "nodev"} <= options, (where, options)
    assert "noexec" not in options, (where, options)


# -- reachable paths, so that only layerbox's modes decide -------------------------------------
@pytest.fixture(autouse=True)
def _open_paths(tmp_path_factory: pytest.TempPathFactory, manager: SandboxManager) -> Iterator[None]:
    """pytest's temp root (and /tmp/pytest-of-<user>) searchable by others for the test, the data
    dir 0755: then only layerbox's own modes can stop a local user (suid_control checks the way)."""
    base = tmp_path_factory.getbasetemp()
    modes = {d: d.stat().st_mode & 0o7777 for d in (base.parent, base)}
    for d, mode in modes.items():
        d.chmod(mode | 0o001)
    manager.data_dir.chmod(0o755)
    yield
    for d, mode in modes.items():
        d.chmod(mode)


@pytest.fixture
def suid_control(tmp_path: Path) -> Path:
    """A setuid-root copy of the payload on an ordinary file system, reachable by anyone: the probe
    must see it work, or a host that ignores setuid bits would pass every test here."""
    tmp_path.chmod(0o755)
    control = tmp_path / "control"
    control.write_bytes(Path(PAYLOAD).read_bytes())
    control.chmod(0o4755)
    assert probe([control], uid=NOBODY) == {str(control): "euid=0"}
    return control


def _mount_record(manager: SandboxManager, box: Sandbox) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    status = manager.host.status()
    rec = status["mounts"][str(box.rootfs)]
    return rec, [status["layers"][h] for h in rec["layers"]]


def _data_dir_paths(manager: SandboxManager, box: Sandbox) -> list[str]:
    """Every data dir path of the box's mount that the host mount state names, and the private dirs."""
    rec, layers = _mount_record(manager, box)
    paths = [rec["upper"], rec["work"]]
    paths += [p for layer in layers for p in (layer["mountpoint"], layer["meta"])]
    return paths + [str(manager.data_dir / name) for name in PRIVATE_DIRS]


# -- sandboxes -----------------------------------------------------------------------------------
def _check_rootfs(box: Sandbox, host_overlays: dict[str, tuple[str, set[str]]], *, userns: bool) -> None:
    assert box.exec(f"{PAYLOAD} -u").stdout == b"0\n"  # the rootfs still executes
    fstype, options = host_overlays[str(box.rootfs)]
    assert fstype == "overlay"
    assert_view(str(box.rootfs), options)
    fstype, options = container_root(box)
    assert fstype == "overlay"
    # crun binds the rootfs onto itself and remounts the bind with only its own flags, which drops
    # nosuid,nodev: the manager sets them again before the first command (a user namespace locks them)
    assert_view(f"{box.id}:/", options)


def test_every_host_mount_of_a_sandbox_carries_nosuid_nodev(manager: SandboxManager, boxes: Any,
                                                              host_overlays: dict[str, Any]) -> None:
    plain = boxes()
    made = {plain: False, boxes(disk=32 << 20): False, boxes(userns=True): True,
            boxes(disk=32 << 20, userns=True): True}
    assert plain.exec("echo kept > /root/kept").exit_code == 0
    restored = boxes(run(plain.checkpoint()).name)
    assert restored.exec("cat /root/kept").stdout == b"kept\n"
    made[restored] = False
    for box, userns in made.items():
        _check_rootfs(box, host_overlays, userns=userns)
    mounted = host_mounts(manager.data_dir)
    # the overlays have left for their containers; what stays is every layer, each disk (and the
    # blobs' FUSE mount, when the daemon serves through FUSE: here it uses fanotify), and the
    # sysfs the sandboxes without a network share, with the nsfs bind that keeps its namespace, and
    # the tmpfs of crun's state and the containers' bundles
    assert {fstype for _, fstype, _ in mounted} == {"erofs", "ext4", "sysfs", "nsfs", "tmpfs"}
    assert_data_dir_mounts(mounted)


def test_remounts_after_a_daemon_restart_keep_the_flags(manager: SandboxManager, boxes: Any,
                                                         host_overlays: dict[str, Any]) -> None:
    made = {boxes(): False, boxes(userns=True): True}
    before = {box.id: box.pid for box in made}
    kill_daemon(manager, holder=True)  # a new generation: everything is stacked again
    host_overlays.clear()
    assert manager.heal() >= 1
    for box, userns in made.items():
        assert box.pid != before[box.id]  # a new container on the re-stacked overlay
        _check_rootfs(box, host_overlays, userns=userns)
    mounted = host_mounts(manager.data_dir)
    assert "erofs" in {fstype for _, fstype, _ in mounted}
    assert_data_dir_mounts(mounted)


@pytest.mark.parametrize("kind", ["plain", "disk", "userns", "restored"])
def test_a_setuid_binary_the_agent_writes_gives_host_users_nothing(
        manager: SandboxManager, boxes: Any, suid_control: Path, kind: str) -> None:
    options: dict[str, Any] = {"disk": {"disk": 32 << 20}, "userns": {"userns": True}}.get(kind, {})
    box = boxes(**options)
    assert box.exec(AGENT).exit_code == 0
    if kind == "restored":  # the payload now lives in a layer: the checkpoint's
        box = boxes(run(box.checkpoint()).name)
    assert box.exec("stat -c %a:%u /root/s /root/s1000").stdout == b"4755:0\n4755:1000\n"
    rec, layers = _mount_record(manager, box)
    holder = Path(layers[-1]["mountpoint"] if kind == "restored" else rec["upper"]) / "root"
    assert (holder / "s").stat().st_mode & stat.S_ISUID  # the payload, as root sees it on the host
    inside = Path(f"/proc/{box.pid}/root/root")

    # a local user: no path leads there
    reach = [holder / "s", inside / "s", *_data_dir_paths(manager, box)]
    if kind == "disk":
        reach.append(box.dir / "disk")
    seen = probe([*reach, box.rootfs / "root" / "s"], uid=NOBODY)
    # the overlay has left for the container: an empty mount point, if the sandbox dir lets one in
    assert seen.pop(str(box.rootfs / "root" / "s")) in ("ENOENT", "EACCES")
    assert seen == {str(p): "EACCES" for p in reach}

    # host root reaching the mounts: a setuid file owned by another uid keeps root's euid, or
    # does not run.  A plain upper is a directory on the data dir's own file system, and a plain
    # container's "/" has lost nosuid to crun (see _check_rootfs): only host root reaches them.
    as_root: dict[Path, str] = {}
    if kind == "userns":
        as_root[inside / "s1000"] = "euid=0"  # nosuid on the overlay, in the container's namespace
    if kind in ("disk", "restored"):
        as_root[holder / "s1000"] = "EACCES"  # the sandbox's ext4, and the layer mount, are noexec
    assert probe(list(as_root)) == {str(p): want for p, want in as_root.items()}


def test_data_dir_subtrees_are_0700_and_tightened_again(manager: SandboxManager, boxes: Any) -> None:
    plain, limited = boxes(), boxes(disk=32 << 20)
    owned = Path(_mount_record(manager, plain)[0]["upper"]).parent
    private = [manager.data_dir / name for name in PRIVATE_DIRS]
    assert {str(d): d.stat().st_mode & 0o7777 for d in [*private, owned, limited.dir / "disk"]} == {
        str(d): 0o700 for d in [*private, owned, limited.dir / "disk"]}
    assert (limited.dir / "disk.img").stat().st_mode & 0o777 == 0o600
    for log in ("lazyfetch.log", "lazyfetch.out"):  # they name this host's layers and paths
        assert (manager.data_dir / log).stat().st_mode & 0o777 == 0o600, log
    upper_root = Path(_mount_record(manager, plain)[0]["upper"])
    assert upper_root.stat().st_mode & 0o777 == 0o755  # the sandbox's "/": its users must traverse it
    # loosened by hand (a chmod -R, a restore from a backup): the next mount operation closes them
    for d in private:
        d.chmod(0o755)
    manager.host.status()
    assert {str(d): d.stat().st_mode & 0o7777 for d in private} == {str(d): 0o700 for d in private}


def test_a_private_dir_that_is_not_a_directory_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "state").write_text("not a directory")
    with pytest.raises(LazyfetchError, match=r"/state is not a directory"):
        private_dirs(tmp_path)
    assert (tmp_path / "state").read_text() == "not a directory"  # left as it was found
    (tmp_path / "state").unlink()
    private_dirs(tmp_path)
    assert {name: (tmp_path / name).stat().st_mode & 0o7777 for name in PRIVATE_DIRS} == dict.fromkeys(
        PRIVATE_DIRS, 0o700)


# -- a hostile image -----------------------------------------------------------------------------
def _hostile_layer(path: Path) -> Path:
    """Setuid copies of the payload (root's and uid 1000's), the host disk as a block device, and
    /dev/null's numbers: a device the host lets anyone open, so that only nodev can refuse it."""
    disk = os.stat("/").st_dev
    payload = Path(PAYLOAD).read_bytes()
    tar = TarBuilder()
    tar.file("bin/suid-root", payload, mode=0o4755)
    tar.file("bin/suid-1000", payload, mode=0o4755, uid=1000, gid=1000)
    tar.device("disk", "b", os.major(disk), os.minor(disk), mode=0o666)
    tar.device("null", "c", 1, 3, mode=0o666)
    return tar.write(path)


def _kill_host_daemon(host: Host) -> None:
    """The daemon and its fd holder: the layers' kernel state is gone, so they are mounted again."""
    health = host.mounts.client.health()
    assert health is not None
    os.kill(int(health["holder"]), signal.SIGKILL)
    os.kill(int(health["pid"]), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while host.mounts.client.health() is not None and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_hostile_layer_gives_host_users_nothing(hosts: Any, store_url: str, tmp_path: Path,
                                                   suid_control: Path) -> None:
    publish_sync(store_url, tmp_path / "pub", str(_hostile_layer(tmp_path / "hostile.tar")), "hostile/img")
    host = hosts(store_url)
    host.data_dir.mkdir(mode=0o755)  # as /var/lib/layerbox usually is
    ro, rw = host.mount("hostile/img"), host.mount("hostile/img", writable=True)  # one layer: overlays
    multi = host.mount(REF)  # several layers read-only: an overlay without an upper
    status = host.mounts.status()
    assert status["mounts"][str(ro)]["layers"] == status["mounts"][str(rw)]["layers"]
    (hexd,) = status["mounts"][str(ro)]["layers"]
    layer, meta = Path(status["layers"][hexd]["mountpoint"]), Path(status["layers"][hexd]["meta"])
    views = [ro, rw]
    setuid_root, setuid_1000, devices = "bin/suid-root", "bin/suid-1000", ["disk", "null"]
    for where in [layer, *views]:  # the hostile entries made it through conversion
        assert (where / setuid_root).stat().st_mode & 0o7777 == 0o4755
        assert (where / setuid_1000).stat().st_uid == 1000
        assert stat.S_ISBLK((where / "disk").stat().st_mode)
        assert (where / "disk").stat().st_rdev == os.stat("/").st_dev

    def check_flags() -> None:
        mounted = host_mounts(host.data_dir)
        assert {fstype for _, fstype, _ in mounted} == {"erofs"}
        assert_data_dir_mounts(mounted)
        by_mountpoint = {mp: (fstype, options) for mp, fstype, options in host_mounts(tmp_path)}
        assert [by_mountpoint[str(v)][0] for v in (ro, rw, multi)] == ["overlay", "overlay", "overlay"]
        for view in (ro, rw, multi):  # a view executes, though the layers under it are noexec
            assert_view(str(view), by_mountpoint[str(view)][1])
        assert {"ro"} <= by_mountpoint[str(ro)][1] & by_mountpoint[str(multi)][1]

    def attack() -> None:
        # a local user: nothing under the layer mount, nor its metadata image, can be reached; in a
        # view the caller put in the open, setuid bits and device nodes are dead
        want = {layer / p: "EACCES" for p in [setuid_root, *devices]}
        want[meta] = "EACCES"
        blobs = sorted((host.data_dir / "blobcache").glob("*.blob"))  # a layer's raw data
        assert blobs
        want.update({blob: "EACCES" for blob in blobs})
        want[host.data_dir / "blobcache"] = "EACCES"
        for view in views:
            want[view / setuid_root] = f"euid={NOBODY}"
            want.update({view / d: "EACCES" for d in devices})
        assert probe(list(want), uid=NOBODY) == {str(p): w for p, w in want.items()}
        # host root: the layer executes nothing and opens no device; a view executes, without setuid
        want = {layer / p: "EACCES" for p in [setuid_1000, *devices]}
        want.update({blob: "read" for blob in blobs})  # root reads them (the kernel's EROFS mounts do)
        for view in views:
            want[view / setuid_1000] = "euid=0"
            want.update({view / d: "EACCES" for d in devices})
        assert probe(list(want)) == {str(p): w for p, w in want.items()}

    check_flags()
    attack()
    _kill_host_daemon(host)  # the layers go stale; remount() brings layers and views back
    assert host.mounts.remount() == len(status["layers"])
    check_flags()
    attack()


# -- whiteouts in a single layer -----------------------------------------------------------------
def _whiteout_layer(path: Path) -> Path:
    """One layer as an image build leaves it: whiteouts for entries of some lower layer (in the
    root and in directories), and an opaque directory (``.wh..wh..opq``) with an entry of its own."""
    tar = TarBuilder()
    tar.file(".wh.gone", b"")
    tar.file("etc/keep", b"kept\n")
    tar.file("etc/.wh.gone", b"")
    tar.file("usr/lib/deep/.wh.gone", b"")
    tar.dir("opaque")
    tar.file("opaque/.wh..wh..opq", b"")
    tar.file("opaque/own", b"own\n")
    return tar.write(path)


def test_a_single_layer_view_shows_no_whiteouts_nor_opaque_markers(hosts: Any, store_url: str,
                                                                   tmp_path: Path) -> None:
    """OCI (image-spec layer.md, "Whiteouts"): a whiteout hides the lower layers' entry of its
    name and is itself never part of the view, so with nothing below it the name is absent; an
    opaque directory shows its own entries only, and its marker is not one of them."""
    publish_sync(store_url, tmp_path / "pub", str(_whiteout_layer(tmp_path / "wh.tar")), "whiteouts/img")
    host = hosts(store_url)
    views = [host.mount("whiteouts/img"), host.mount("whiteouts/img")]  # the empty lower is reused
    status = host.mounts.status()
    (hexd,) = status["mounts"][str(views[0])]["layers"]
    layer = Path(status["layers"][hexd]["mountpoint"])
    gone = (layer / "etc/gone").lstat()  # the layer holds overlayfs's spelling of both
    assert (stat.S_ISCHR(gone.st_mode), gone.st_rdev) == (True, 0)
    assert os.getxattr(layer / "opaque", "trusted.overlay.opaque") == b"y"
    for view in [*views, host.mount("whiteouts/img", writable=True)]:
        assert mount_at(view)[0] == "overlay"
        assert sorted(os.listdir(view)) == ["etc", "opaque", "usr"]
        assert sorted(os.listdir(view / "etc")) == ["keep"]
        assert os.listdir(view / "usr/lib/deep") == []
        for gone in ("gone", "etc/gone", "usr/lib/deep/gone"):
            assert not os.path.lexists(view / gone)
        assert sorted(os.listdir(view / "opaque")) == ["own"]
        assert (view / "opaque/own").read_bytes() == b"own\n"
        assert [x for x in os.listxattr(view / "opaque") if x.startswith("trusted.overlay.")] == []
        assert [p for p in view.rglob("*") if stat.S_ISCHR(p.lstat().st_mode)] == []
    # under it: empty twins of the directories holding whiteouts, in the 0700 layer root
    skeleton = Path(f"{layer}.skeleton")
    assert sorted(str(p.relative_to(skeleton)) for p in skeleton.rglob("*")) == [
        "etc", "usr", "usr/lib", "usr/lib/deep"]
    assert [p for p in skeleton.rglob("*") if not p.is_dir()] == []
    assert skeleton.parent.stat().st_mode & 0o7777 == 0o700
