"""The files API against the special files a sandbox controls: FIFOs, sockets, device nodes, races.

The host side of the files API runs as host root over a tree the sandbox writes.  Each test is
an attack: an entry that would block a service thread for ever (a FIFO), reach a host device as
host root (a node with /dev/null's or the host disk's numbers), or be swapped in between a check
and an open.  Every call runs on a thread with a deadline, so a regression fails instead of
hanging the suite, and an inotify watch on each special node shows whether anything opened it
(an ``O_PATH`` open makes no fsnotify event, Linux >= 6.5).

Nothing here ever writes to a node with the host disk's numbers, not even to show it is refused:
a regression would write to the host's disk.  Those nodes are only read, through a sink that
fails at the first byte; writes are tried on a loop device over a scratch file instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import io
import os
import shutil
import socket
import stat
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import pytest
from support.env import require
from support.proc import run

from sandbox.backends.container.files import RootFiles
from sandbox.core.errors import NotARegularFile, PathEscape
from sandbox.host.manager import Sandbox, SandboxManager
from sandbox.isolation import landlock

pytestmark = [pytest.mark.usefixtures("need_root"), pytest.mark.root("erofs", "overlay", "fuse", "cmd:crun")]

T = TypeVar("T")
DEADLINE = 5.0  # seconds: a refused call returns in well under a millisecond
DATA = bytes(range(100))
KINDS = {"fifo": "FIFO (named pipe)", "null": "character device", "loop": "block device",
         "disk": "block device", "sock": "socket"}

_libc = ctypes.CDLL(None, use_errno=True)
_IN_OPEN = 0x20
_INOTIFY_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (a name of len bytes follows)


def _poke(fifo: str | os.PathLike[str]) -> None:
    # opened read-write a FIFO counts as both ends: a thread stuck opening either side returns
    os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))


def bounded(fn: Callable[[], T], *, fifos: Sequence[str | os.PathLike[str]] = (), deadline: float = DEADLINE) -> T:
    """``fn()``'s result or exception; the test fails if it has not returned within ``deadline``.

    A call stuck on one of ``fifos`` is released afterwards (so no thread outlives the test).
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised on the test's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="files-attack", daemon=True)
    thread.start()
    thread.join(deadline)
    if thread.is_alive():
        release = time.monotonic() + deadline
        while thread.is_alive() and time.monotonic() < release:
            for fifo in fifos:
                _poke(fifo)
            thread.join(0.05)
        pytest.fail(f"the call blocked for more than {deadline} s (a FIFO or a device was opened)")
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value


class OpenWatch:
    """inotify ``IN_OPEN`` on some paths: which of them anything opened since the last look."""

    def __init__(self, paths: Sequence[str | os.PathLike[str]]) -> None:
        self.fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.names: dict[int, str] = {}
        for path in paths:
            wd = _libc.inotify_add_watch(self.fd, os.fsencode(path), _IN_OPEN)
            if wd < 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err), str(path))
            self.names[wd] = str(path)

    def opened(self) -> list[str]:
        out: list[str] = []
        while True:
            try:
                buf = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return out
            offset = 0
            while offset < len(buf):
                wd, mask, _, size = _INOTIFY_EVENT.unpack_from(buf, offset)
                if mask & _IN_OPEN:  # (IN_IGNORED comes unasked when a watched entry is removed)
                    out.append(self.names[wd])
                offset += _INOTIFY_EVENT.size + size

    def close(self) -> None:
        os.close(self.fd)


@contextlib.contextmanager
def watching(paths: Sequence[str | os.PathLike[str]]) -> Iterator[OpenWatch]:
    watch = OpenWatch(paths)
    try:
        yield watch
    finally:
        watch.close()


class RefusingSink(io.RawIOBase):
    """A download target that fails at the first byte: a host disk's data must never arrive."""

    def write(self, data: Any) -> int:
        raise AssertionError(f"{len(data)} bytes of device data reached the caller")


def _host_disk() -> int:
    """The device number of the block device behind /, else of any block device in /dev."""
    dev = os.stat("/").st_dev
    if os.major(dev) != 0:  # major 0: an anonymous device (tmpfs, overlay) has no node to copy
        return dev
    for entry in os.scandir("/dev"):
        st = entry.stat(follow_symlinks=False)
        if stat.S_ISBLK(st.st_mode):
            return st.st_rdev
    pytest.fail("no block device on this host to copy the numbers of")


class Loop(NamedTuple):
    rdev: int
    backing: Path
    content: bytes


@pytest.fixture(scope="module")
def loop(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Loop]:
    """A loop device over a 1 MiB scratch file: the block device writes are attempted on."""
    require("root")
    require("cmd:losetup")
    backing = tmp_path_factory.mktemp("files-loop") / "disk.img"
    content = bytes(range(256)) * 4096
    backing.write_bytes(content)
    dev = run(["losetup", "--find", "--show", backing], timeout=30).stdout.decode().strip()
    try:
        yield Loop(os.stat(dev).st_rdev, backing, content)
    finally:
        run(["losetup", "--detach", dev], timeout=30)
        backing.unlink()


class Tree(NamedTuple):
    root: Path
    files: RootFiles


@pytest.fixture
def tree(tmp_path: Path, loop: Loop) -> Iterator[Tree]:
    """A plain directory root holding one of each special entry and an absolute symlink to each."""
    root = tmp_path / "root"
    root.mkdir()
    os.mkfifo(root / "fifo")
    os.mknod(root / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    os.mknod(root / "loop", stat.S_IFBLK | 0o600, loop.rdev)
    os.mknod(root / "disk", stat.S_IFBLK | 0o600, _host_disk())
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(root / "sock"))
    sock.listen()
    for name in KINDS:
        (root / f"to-{name}").symlink_to(f"/{name}")  # absolute: resolved inside the root
    (root / "plain").write_bytes(DATA)
    try:
        yield Tree(root, RootFiles(root))
    finally:
        sock.close()
        shutil.rmtree(root)  # no device node (one has the host disk's numbers) outlives the test
        assert loop.backing.read_bytes() == loop.content


@pytest.fixture
def outside(tmp_path: Path) -> Iterator[Path]:
    """A host directory next to the root, where a link out of the root would land."""
    path = tmp_path / "outside"
    path.mkdir()
    yield path
    shutil.rmtree(path)


def _refused(call: Callable[[], object], path: str, kind: str, fifos: Sequence[Path] = ()) -> None:
    with pytest.raises(NotARegularFile) as info:
        bounded(call, fifos=fifos)
    assert (info.value.errno, info.value.filename, info.value.kind) == (errno.EINVAL, path, kind)
    assert str(info.value).startswith(f"{path} is a {kind}: the files API reads and writes only regular files")


def _every_transfer_refused(files: RootFiles | Sandbox, path: str, kind: str, fifos: Sequence[Path] = ()) -> None:
    _refused(lambda: files.read(path), path, kind, fifos)
    _refused(lambda: files.download(path, io.BytesIO()), path, kind, fifos)
    _refused(lambda: files.write(path, DATA), path, kind, fifos)
    _refused(lambda: files.upload(path, io.BytesIO(DATA)), path, kind, fifos)


def test_the_watch_sees_an_open(tree: Tree) -> None:
    # the detector the other tests rely on: an open through the files API is an IN_OPEN event
    with watching([tree.root / "plain"]) as watch:
        tree.files.stat("/plain")
        assert watch.opened() == []
        assert tree.files.read("/plain") == DATA
        assert watch.opened() == [str(tree.root / "plain")]


@pytest.mark.parametrize("name", ["fifo", "to-fifo", "null", "to-null", "loop", "to-loop", "sock", "to-sock"])
def test_special_files_are_refused_unopened(tree: Tree, name: str) -> None:
    kind = KINDS[name.removeprefix("to-")]
    before = os.lstat(tree.root / name)
    with watching([tree.root / n for n in ("fifo", "null", "loop")]) as watch:
        _every_transfer_refused(tree.files, f"/{name}", kind, fifos=[tree.root / "fifo"])
        assert watch.opened() == []
    after = os.lstat(tree.root / name)  # not replaced by a regular file either
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)


def test_fifo_with_a_reader_gets_nothing(tree: Tree) -> None:
    # with a reader waiting a write would not block: it would go to whoever holds the other end
    reader = os.open(tree.root / "fifo", os.O_RDONLY | os.O_NONBLOCK)
    try:
        _every_transfer_refused(tree.files, "/fifo", KINDS["fifo"], fifos=[tree.root / "fifo"])
        _every_transfer_refused(tree.files, "/to-fifo", KINDS["fifo"], fifos=[tree.root / "fifo"])
        assert os.read(reader, 1 << 16) == b""  # no writer: nothing was ever sent to it
    finally:
        os.close(reader)


def test_host_disk_node_is_never_opened(tree: Tree) -> None:
    # only reads here (see the module's docstring); each stops at the first byte of disk data
    with watching([tree.root / "disk"]) as watch:
        for path in ("/disk", "/to-disk"):
            _refused(lambda p=path: next(tree.files.iter_read(p, chunk=512)), path, "block device")
            _refused(lambda p=path: tree.files.download(p, RefusingSink()), path, "block device")
        st = tree.files.stat("/disk")  # lstat: the entry, reported as what it is
        assert (stat.S_ISBLK(st.st_mode), st.st_rdev) == (True, _host_disk())
        assert watch.opened() == []


def test_symlinks_out_of_the_root_name_the_roots_own_entries(tree: Tree, outside: Path) -> None:
    os.mkfifo(outside / "fifo")
    (tree.root / "dev").mkdir()
    os.mknod(tree.root / "dev" / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    (tree.root / "abs").symlink_to(outside / "fifo")
    (tree.root / "rel").symlink_to("../" * 20 + str(outside / "fifo").lstrip("/"))
    (tree.root / "devnull").symlink_to("/dev/null")  # the root's own /dev/null: a device, refused
    with watching([tree.root / "dev" / "null"]) as watch:
        for path in ("/abs", "/rel"):
            for call in (lambda p=path: tree.files.read(p), lambda p=path: tree.files.write(p, DATA)):
                with pytest.raises(FileNotFoundError):
                    bounded(call, fifos=[outside / "fifo"])
        _every_transfer_refused(tree.files, "/devnull", "character device")
        assert watch.opened() == []
    assert sorted(p.name for p in outside.iterdir()) == ["fifo"]


def test_create_through_a_dangling_symlink_is_refused(tree: Tree, outside: Path) -> None:
    # a dangling link must not redirect a new file: not to the host, and not elsewhere in the root
    mirror = tree.root / str(outside).lstrip("/")  # where RESOLVE_IN_ROOT puts the host path
    mirror.mkdir(parents=True)
    (tree.root / "etc" / "cron.d").mkdir(parents=True)
    (tree.root / "away").symlink_to(outside / "victim")
    (tree.root / "job").symlink_to("/etc/cron.d/job")
    for path in ("/away", "/job"):
        with pytest.raises(FileNotFoundError):
            bounded(lambda p=path: tree.files.write(p, DATA))
        with pytest.raises(FileNotFoundError):
            bounded(lambda p=path: tree.files.upload(p, io.BytesIO(DATA)))
    assert list(outside.iterdir()) == list(mirror.iterdir()) == list((tree.root / "etc" / "cron.d").iterdir()) == []
    assert os.readlink(tree.root / "away") == str(outside / "victim")
    # a new name is still created, with the mode asked for, and an existing file is overwritten
    tree.files.write("/etc/cron.d/new", DATA, mode=0o600)
    assert stat.S_IMODE(os.lstat(tree.root / "etc/cron.d/new").st_mode) == 0o600
    tree.files.write("/etc/cron.d/new", b"shorter", mode=0o640)
    assert (tree.root / "etc/cron.d/new").read_bytes() == b"shorter"
    assert stat.S_IMODE(os.lstat(tree.root / "etc/cron.d/new").st_mode) == 0o640


def test_swapping_special_files_in_never_blocks_nor_opens_them(tree: Tree) -> None:
    # between the type check and the open the sandbox renames a FIFO or a device over the file
    root, files = tree
    os.mkfifo(root / ".fifo")  # each swap hard-links one of these masters in: the watch sees every name
    os.mknod(root / ".null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    (root / "target").write_bytes(DATA)
    stop = threading.Event()
    swaps = Counter[str]()

    def swap() -> None:
        i = 0
        while not stop.is_set():
            tmp, kind = root / f".swap{i}", ("file", "fifo", "null")[i % 3]
            if kind == "file":
                tmp.write_bytes(DATA)
            else:
                os.link(root / f".{kind}", tmp)
            os.rename(tmp, root / "target")
            swaps[kind] += 1
            i += 1

    outcomes = Counter[str]()

    def attack() -> None:
        for _ in range(300):
            try:
                data = files.read("/target")
                assert data == DATA, f"read {data!r}: device data, not the file's"
                outcomes["read"] += 1
            except NotARegularFile:
                outcomes["read refused"] += 1
            try:
                files.write("/target", DATA)
                outcomes["written"] += 1
            except NotARegularFile:
                outcomes["write refused"] += 1

    swapper = threading.Thread(target=swap, name="files-swapper")
    with watching([root / ".fifo", root / ".null"]) as watch:
        swapper.start()
        try:
            bounded(attack, fifos=[root / ".fifo"], deadline=60)
        finally:
            stop.set()
            swapper.join()
        assert watch.opened() == []
    assert min(swaps.values()) > 10
    assert set(outcomes) == {"read", "read refused", "written", "write refused"}, outcomes


def test_list_stat_and_remove_of_special_entries(tree: Tree) -> None:
    with watching([tree.root / n for n in ("fifo", "null", "loop", "disk")]) as watch:
        entries = {e["name"]: e for e in bounded(lambda: tree.files.list("/"), fifos=[tree.root / "fifo"])}
        assert {name: entries[name]["type"] for name in KINDS} == dict.fromkeys(KINDS, "other")
        assert entries["to-fifo"]["type"] == "symlink"
        with pytest.raises(NotADirectoryError):  # a FIFO is not listed, nor waited on
            bounded(lambda: tree.files.list("/fifo"), fifos=[tree.root / "fifo"])
        with pytest.raises(NotADirectoryError):
            bounded(lambda: tree.files.list("/to-null"))
        assert stat.S_ISFIFO(tree.files.stat("/fifo").st_mode)
        assert stat.S_ISSOCK(tree.files.stat("/sock").st_mode)
        assert stat.S_ISLNK(tree.files.stat("/to-loop").st_mode)
        for name in KINDS:  # unlinking opens nothing: the sandbox's own junk can be cleared
            bounded(lambda n=name: tree.files.remove(f"/{n}"), fifos=[tree.root / "fifo"])
        assert watch.opened() == []
    assert not any((tree.root / name).exists() for name in KINDS)


def test_directories_are_refused_as_before(tree: Tree) -> None:
    (tree.root / "d").mkdir()
    with pytest.raises(IsADirectoryError):
        tree.files.read("/d")
    with pytest.raises(IsADirectoryError):
        tree.files.write("/d", DATA)
    assert tree.files.list("/d") == []


def test_through_a_sandbox(boxes: Any, manager: SandboxManager, loop: Loop) -> None:
    box = boxes()
    assert box.exec("mkfifo /root/f && echo plain > /root/plain").exit_code == 0  # /root is now in the upper
    upper = Path(manager.host.status()["mounts"][str(box.rootfs)]["upper"])
    # a device node as an image layer would carry it (the agent has no CAP_MKNOD)
    os.mknod(upper / "root" / "disk", stat.S_IFBLK | 0o600, _host_disk())
    os.mknod(upper / "root" / "loop", stat.S_IFBLK | 0o600, loop.rdev)
    links = "ln -s /dev/zero /root/zero; ln -s /root/f /root/to-f; ln -s /root/disk /root/to-disk; " \
            "ln -s ../root/loop /root/to-loop"
    assert box.exec(links).exit_code == 0
    assert box.exec("stat -c %F /root/f /root/disk").stdout == b"fifo\nblock special file\n"
    inside = Path(f"/proc/{box.pid}/root/root")  # the sandbox's /root on its own overlay
    fifo = inside / "f"
    with watching([inside / "plain", inside / "disk", inside / "loop"]) as watch:
        assert box.read("/root/plain") == b"plain\n"
        assert watch.opened() == [str(inside / "plain")]  # the watch sees opens through the overlay
        for path in ("/root/f", "/root/to-f"):
            _every_transfer_refused(box, path, KINDS["fifo"], fifos=[fifo])
        for path in ("/root/loop", "/root/to-loop"):
            _every_transfer_refused(box, path, "block device", fifos=[fifo])
        for path in ("/root/disk", "/root/to-disk"):  # read only: see the module's docstring
            _refused(lambda p=path: box.download(p, RefusingSink()), path, "block device")
        # the sandbox's /dev is a mount of its own, which the walk does not enter (RESOLVE_NO_XDEV)
        with pytest.raises(PathEscape):
            bounded(lambda: box.read("/root/zero"))
        with pytest.raises(PathEscape):
            bounded(lambda: box.write("/root/zero", DATA))
        entries = {e["name"]: e["type"] for e in bounded(lambda: box.list("/root"), fifos=[fifo])}
        assert (entries["f"], entries["disk"], entries["to-disk"]) == ("other", "other", "symlink")
        st = box.stat("/root/disk")
        assert (stat.S_ISBLK(st.st_mode), st.st_rdev) == (True, _host_disk())
        for path in ("/root/f", "/root/disk", "/root/loop"):
            bounded(lambda p=path: box.remove(p), fifos=[fifo])
        assert watch.opened() == []
    assert box.exec("ls /root").stdout.split() == [b"plain", b"to-disk", b"to-f", b"to-loop", b"zero"]
    assert not [r for r in box.receipts() if r.get("action") in ("read", "download", "write", "upload")
                and r.get("path") != "/root/plain"]


def test_the_reopen_through_proc_is_fenced_by_landlock(tree: Tree, outside: Path) -> None:
    # the real open goes through /proc/self/fd, outside the root: Landlock must still judge the file
    # itself, so a descriptor of a host file cannot be turned into an open one on a fenced thread
    assert landlock.abi() >= 1, "Landlock is unavailable: boot with lsm=...,landlock"
    (outside / "secret").write_bytes(b"host")
    host, own = os.open(outside / "secret", os.O_PATH), os.open(tree.root / "plain", os.O_PATH)
    try:
        with pytest.raises(PermissionError):
            landlock.run_confined(tree.root, lambda: os.open(f"/proc/self/fd/{host}", os.O_RDONLY))
        fd = landlock.run_confined(tree.root, lambda: os.open(f"/proc/self/fd/{own}", os.O_RDONLY))
        assert os.read(fd, 200) == DATA  # and the descriptor outlives its fenced thread
        os.close(fd)
    finally:
        os.close(host)
        os.close(own)
