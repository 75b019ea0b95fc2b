"""Real-kernel tests of fanotify pre-content serving (lazyfetch/fanotify.py) and the fd holder.

A layer is built with our converter, its blob is replaced by an empty sparse
file with a FAN_PRE_ACCESS mark, and the metadata image is mounted on that
file.  Readers are always other processes (a handler thread in the reading
process deadlocks on mmap faults).  What these tests pin down, with numbers,
is reported in the summary of each test (run with ``-s`` to see them).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from support.env import in_ci, require

from converters.layer import LayerResult, convert_directory
from lazyfetch import kmount
from lazyfetch.blobcache import punch_hole
from lazyfetch.errors import FanotifyError
from lazyfetch.fanotify import Group, probe
from lazyfetch.holder import Holder

if TYPE_CHECKING:
    from conftest import Mounts

pytestmark = pytest.mark.root("erofs")

REPO = Path(__file__).resolve().parents[1]
CHUNK = 64 * 1024
ENV = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}

# A reader process: copies FILE to OUT by read() (or through mmap), prints the outcome as JSON.
READER = r"""
import json, mmap, os, sys
path, out, how = sys.argv[1:4]
done = 0
with open(out, "wb") as dst:
    try:
        fd = os.open(path, os.O_RDONLY)
        if how == "mmap":
            size = os.fstat(fd).st_size
            m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            while done < size:
                dst.write(m[done:done + 65536]); done = min(size, done + 65536)
        else:
            while block := os.read(fd, 65536):
                dst.write(block); done += len(block)
        print(json.dumps({"ok": True, "bytes": done}))
    except OSError as exc:
        print(json.dumps({"ok": False, "bytes": done, "errno": exc.errno}))
"""

# Prints {relative path: sha256} of every regular file under a directory.
DIGESTS = r"""
import contextlib
import hashlib, json, os, sys
root = sys.argv[1]
out = {}
for d, _, files in os.walk(root):
    for n in files:
        p = os.path.join(d, n)
        if os.path.isfile(p) and not os.path.islink(p):
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = hashlib.sha256(f.read()).hexdigest()
print(json.dumps(out))
"""

# Connects to a holder as uid 65534 and asks for a ping; prints "closed" if it gets no answer.
STRANGER = r"""
import os, socket, sys
os.setgid(65534)
os.setuid(65534)
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sys.argv[1])
try:
    s.send(b'{"op": "ping"}')
    print("closed" if s.recv(100) == b"" else "answered")
except (BrokenPipeError, ConnectionResetError):
    print("closed")
"""


def _digests_here(root: Path) -> dict[str, str]:
    out = {}
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _digests_in_child(root: Path) -> dict[str, str]:
    result = subprocess.run([sys.executable, "-c", DIGESTS, str(root)], capture_output=True,
                            timeout=60, check=True)
    return dict(json.loads(result.stdout))


def _drop_cache(path: Path) -> None:
    """Drop the clean page cache of one file (the mount's file or the blob)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _drop_tree_cache(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            _drop_cache(path)


# --------------------------------------------------------------------------
# fixtures


def _libc_path() -> str:
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith(("libc.so", "libc-")):
                return path
    raise AssertionError("no libc in /proc/self/maps")


@dataclass
class Layer:
    src: Path
    result: LayerResult
    sparse: Path
    big: list[str]  # files of at least 1 MiB, relative to src

    @property
    def meta(self) -> Path:
        return Path(self.result.meta_path)

    @property
    def real(self) -> Path:
        return Path(self.result.blob_path)


@pytest.fixture
def layer(tmp_path: Path) -> Layer:
    """A small real layer: stdlib modules, the python binary, random and partly zero files."""
    src = tmp_path / "src"
    src.mkdir()
    stdlib = Path(os.__file__).parent
    shutil.copytree(stdlib / "json", src / "json", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(stdlib / "email", src / "email", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copyfile(os.path.realpath(sys.executable), src / "python")
    shutil.copyfile(_libc_path(), src / "libc.so.6")  # a real binary of about 2 MB
    (src / "random-1m").write_bytes(os.urandom(1 << 20))
    (src / "random-3m-odd").write_bytes(os.urandom(3 * (1 << 20) + 4321))
    (src / "mixed").write_bytes(os.urandom(CHUNK) + bytes(3 * CHUNK) + os.urandom(100_007))
    (src / "tiny").write_bytes(b"hello, layer\n")
    (src / "empty").touch()
    result = convert_directory(src, tmp_path / "meta.erofs", tmp_path / "real.blob", chunk_size=CHUNK)
    sparse = tmp_path / "sparse.blob"
    with open(sparse, "wb") as f:
        f.truncate(os.path.getsize(result.blob_path))
    big = sorted(str(p.relative_to(src)) for p in src.rglob("*")
                 if p.is_file() and p.stat().st_size >= 1 << 20)
    return Layer(src, result, sparse, big)


@dataclass
class Filler:
    """A handler thread in the test process: fills the sparse blob from the real one."""

    group: Group
    write_fd: int  # -1: write through each event's own fd
    real_fd: int
    events: list[tuple[int, int, int]] = field(default_factory=list)  # pid, offset, count
    busy_ns: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> Filler:
        self.thread = threading.Thread(target=self._run, name="filler", daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stop.is_set():
            for event in self.group.events(timeout=0.05):
                began = time.perf_counter_ns()
                self.events.append((event.pid, event.offset, event.count))  # before the reader goes on
                data = os.pread(self.real_fd, event.count, event.offset)
                os.pwrite(event.fd if self.write_fd < 0 else self.write_fd, data, event.offset)
                self.group.respond(event.fd, True)
                os.close(event.fd)
                self.busy_ns += time.perf_counter_ns() - began

    def halt(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(10)


class Cleanup:
    """Everything a test starts, undone however the test ends: processes first (a reader
    blocked on an event is killable, and the mount is idle then), the rest newest first."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen[bytes]] = []
        self._fds: set[int] = set()
        self._stack = contextlib.ExitStack()

    def proc(self, proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
        self._procs.append(proc)
        return proc

    def fd(self, fd: int) -> int:
        self._fds.add(fd)
        self._stack.callback(self.close, fd)
        return fd

    def close(self, fd: int) -> None:
        """Close one of our fds now (never twice: its number may be reused)."""
        if fd in self._fds:
            self._fds.discard(fd)
            os.close(fd)

    def later(self, undo: Callable[..., object], *args: object, **kwargs: object) -> None:
        self._stack.callback(undo, *args, **kwargs)

    def holder(self, socket_path: Path, grace: float = 60.0) -> Holder:
        holder = Holder.spawn(str(socket_path), grace=grace)
        self.later(_kill, int(holder.ping()["pid"]))
        self.later(holder.close)
        return holder

    def run(self) -> None:
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        self._stack.close()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture
def cleanup(mounts: Mounts) -> Iterator[Cleanup]:
    # depends on mounts so that it runs first at teardown: processes die before the unmount
    undo = Cleanup()
    try:
        yield undo
    finally:
        undo.run()


def _mark_and_mount(layer: Layer, mounts: Mounts, cleanup: Cleanup) -> tuple[Group, int, Path]:
    """Write fd opened before the mark, group, mark, canary, mount, canary."""
    write_fd = cleanup.fd(os.open(layer.sparse, os.O_RDWR | os.O_CLOEXEC))
    group = _group(cleanup)
    group.watch(str(layer.sparse))
    assert group.watching(str(layer.sparse))
    mnt = mounts.erofs(layer.meta, layer.sparse)
    assert group.watching(str(layer.sparse))
    return group, write_fd, mnt


def _group(cleanup: Cleanup, fd: int | None = None) -> Group:
    group = Group.create() if fd is None else Group.adopt(fd)
    cleanup.later(group.close)
    return group


def _filler(group: Group, write_fd: int, layer: Layer, cleanup: Cleanup) -> Filler:
    real_fd = cleanup.fd(os.open(layer.real, os.O_RDONLY | os.O_CLOEXEC))
    filler = Filler(group, write_fd, real_fd).start()
    cleanup.later(filler.halt)
    return filler


def _start_reader(cleanup: Cleanup, path: Path, out: Path, how: str = "read") -> subprocess.Popen[bytes]:
    return cleanup.proc(subprocess.Popen([sys.executable, "-c", READER, str(path), str(out), how],
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE))


def _wrong_bytes(source: bytes, got: bytes) -> int:
    """Bytes of ``got`` that differ from ``source`` at the same offset (extra bytes count)."""
    n = min(len(source), len(got))
    wrong = sum(1 for a, b in zip(source[:n], got[:n], strict=True) if a != b) if source[:n] != got[:n] else 0
    return wrong + max(0, len(got) - len(source))


def _line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """One line of a child's stdout, or fail after ``timeout`` seconds."""
    import select

    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no output from {proc.args} within {timeout} s"
    return proc.stdout.readline().decode().strip()


# --------------------------------------------------------------------------
# probe


@pytest.fixture
def tmpfs_dir() -> Iterator[Path]:
    """A fresh directory on the host's tmpfs (/dev/shm)."""
    import tempfile

    if not any(m.mountpoint == "/dev/shm" and m.fstype == "tmpfs" for m in kmount.read_mountinfo()):
        if in_ci():
            pytest.fail("CI=true but /dev/shm is not a tmpfs", pytrace=False)
        pytest.skip("/dev/shm is not a tmpfs")
    path = Path(tempfile.mkdtemp(prefix="layerbox-fanotify-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_probe_works_here_and_names_tmpfs(tmp_path: Path, tmpfs_dir: Path) -> None:
    assert probe(str(tmp_path)) is None
    assert not list(tmp_path.iterdir()), "probe left files behind"
    reason = probe(str(tmpfs_dir))
    assert reason is not None
    assert "Errno 95" in reason
    assert "tmpfs" in reason
    assert not list(tmpfs_dir.iterdir()), "probe left files behind"


def test_watch_on_tmpfs_names_path_and_errno(tmpfs_dir: Path) -> None:
    path = tmpfs_dir / "blob"
    path.touch()
    with Group.create() as group, pytest.raises(FanotifyError) as info:
        group.watch(str(path))
    assert info.value.errno == 95
    assert str(path) in str(info.value)


# --------------------------------------------------------------------------
# fill on event, ignore, evict


def test_fill_on_event_ignore_and_evict(layer: Layer, mounts: Mounts, cleanup: Cleanup) -> None:
    group, write_fd, mnt = _mark_and_mount(layer, mounts, cleanup)
    filler = _filler(group, write_fd, layer, cleanup)
    expected = _digests_here(layer.src)

    began = time.perf_counter()
    assert _digests_in_child(mnt) == expected
    cold = time.perf_counter() - began
    first = len(filler.events)
    assert first > 0
    assert all(pid != os.getpid() for pid, _, _ in filler.events)
    blob_mb = os.path.getsize(layer.real) / 1e6
    print(f"\ncold read of {blob_mb:.1f} MB through {first} events in {cold * 1000:.0f} ms; "
          f"{filler.busy_ns / first / 1000:.0f} us handler time per event; "
          f"ranges {min(c for _, _, c in filler.events)}-{max(c for _, _, c in filler.events)} bytes")

    # filled, still marked: reads raise events again (page cache dropped), bytes identical
    _drop_tree_cache(mnt)
    _drop_cache(layer.sparse)
    began = time.perf_counter()
    assert _digests_in_child(mnt) == expected
    warm = time.perf_counter() - began
    marked_events = len(filler.events) - first
    print(f"filled + marked: {marked_events} events in {warm * 1000:.0f} ms "
          f"({marked_events / warm:.0f} events/s including hashing)")
    assert marked_events > 0

    # complete: the ignore mark stops the events
    group.ignore(str(layer.sparse))
    assert not group.watching(str(layer.sparse))
    _drop_tree_cache(mnt)
    _drop_cache(layer.sparse)
    before = len(filler.events)
    assert _digests_in_child(mnt) == expected
    assert len(filler.events) == before

    # evict: unignore first, then punch every byte of the blob; reads must raise events again
    group.unignore(str(layer.sparse))
    assert group.watching(str(layer.sparse))
    punch_hole(write_fd, 0, os.path.getsize(layer.sparse))
    assert os.stat(layer.sparse).st_blocks == 0
    _drop_tree_cache(mnt)
    assert _digests_in_child(mnt) == expected
    assert len(filler.events) > before


def test_event_fds_are_writable_and_raise_no_events(layer: Layer, mounts: Mounts, cleanup: Cleanup) -> None:
    """With event_f_flags O_RDWR a handler can fill through the event's own fd: one
    handler thread would deadlock if that write raised an event of its own."""
    group, _, mnt = _mark_and_mount(layer, mounts, cleanup)
    filler = _filler(group, -1, layer, cleanup)
    assert _digests_in_child(mnt) == _digests_here(layer.src)
    assert filler.events


def test_parse_events_batches_and_unknown_records() -> None:
    from lazyfetch.fanotify import EVENT_METADATA, FAN_PRE_ACCESS, RANGE_INFO, parse_events

    unknown = bytes([99, 0]) + (12).to_bytes(2, "little") + bytes(8)  # info type 99, 12 bytes
    ranged = RANGE_INFO.pack(6, 0, RANGE_INFO.size, 0, 4096, 131072)
    first = EVENT_METADATA.pack(24 + len(unknown) + len(ranged), 3, 0, 24, FAN_PRE_ACCESS, 7, 100)
    second = EVENT_METADATA.pack(24 + len(ranged), 3, 0, 24, FAN_PRE_ACCESS, 8, 101)
    events = parse_events(first + unknown + ranged + second + ranged)
    assert [(e.fd, e.pid, e.offset, e.count) for e in events] == [(7, 100, 4096, 131072),
                                                                  (8, 101, 4096, 131072)]
    with pytest.raises(FanotifyError, match="version 4"):
        parse_events(EVENT_METADATA.pack(24, 4, 0, 24, FAN_PRE_ACCESS, 7, 100))
    with pytest.raises(FanotifyError, match="malformed"):
        parse_events(EVENT_METADATA.pack(200, 3, 0, 24, FAN_PRE_ACCESS, 7, 100))


def test_the_fast_path_reads_range_events_as_the_full_parser_does() -> None:
    """A batch of metadata + range events (what a daemon reads thousands of a second) has its own
    decoder; it must give exactly what the general one gives (a swapped field fills the wrong
    range and allows a read of a hole), and step aside for anything else."""
    from lazyfetch.fanotify import (
        EVENT_METADATA,
        FAN_PRE_ACCESS,
        RANGE_INFO,
        _parse_events,
        parse_events,
    )

    batch = b"".join(EVENT_METADATA.pack(48, 3, 0, 24, FAN_PRE_ACCESS, 10 + i, 200 + i)
                     + RANGE_INFO.pack(6, 0, RANGE_INFO.size, 0, 4096 * (i + 1), 65536 * (i + 1))
                     for i in range(5))
    fast = parse_events(batch)
    assert fast == _parse_events(batch)
    # where each event starts (the in-flight journal marks it answered there)
    assert [e.at for e in parse_events(batch, 4096)] == [e.at for e in _parse_events(batch, 4096)] == [
        4096 + 48 * i for i in range(5)]
    assert [(e.fd, e.pid, e.mask, e.offset, e.count) for e in fast] == [
        (10 + i, 200 + i, FAN_PRE_ACCESS, 4096 * (i + 1), 65536 * (i + 1)) for i in range(5)]
    # 48-byte events that are not metadata + range go to the general parser, which refuses them
    odd = EVENT_METADATA.pack(48, 4, 0, 24, FAN_PRE_ACCESS, 7, 100) + RANGE_INFO.pack(6, 0, 24, 0, 1, 2)
    with pytest.raises(FanotifyError, match="version 4"):
        parse_events(batch + odd)


def test_watching_is_false_without_our_mark(layer: Layer, tmp_path: Path, cleanup: Cleanup) -> None:
    group = _group(cleanup)
    sparse = str(layer.sparse)
    assert not group.watching(sparse)  # never marked
    group.watch(sparse)
    assert group.watching(sparse)
    other = _group(cleanup)
    assert not other.watching(sparse)  # another group's mark is not ours
    group.ignore(sparse)
    assert not group.watching(sparse)  # ignored: reads raise no events
    group.unignore(sparse)
    assert group.watching(sparse)
    # the path now names another inode (a blob rewritten by rename): the mark stayed on the old one
    replacement = tmp_path / "replacement.blob"
    replacement.write_bytes(b"")
    os.rename(replacement, layer.sparse)
    assert not group.watching(sparse)
    group.watch(sparse)
    assert group.watching(sparse)
    group.unwatch(sparse)
    assert not group.watching(sparse)  # removed


def test_mark_added_after_the_mount_is_never_seen(layer: Layer, mounts: Mounts, cleanup: Cleanup) -> None:
    """Documents why the canary runs before the mount: watching() cannot see this case."""
    write_fd = cleanup.fd(os.open(layer.sparse, os.O_RDWR | os.O_CLOEXEC))
    mnt = mounts.erofs(layer.meta, layer.sparse)
    group = _group(cleanup)
    group.watch(str(layer.sparse))
    assert group.watching(str(layer.sparse))
    filler = _filler(group, write_fd, layer, cleanup)
    got = (mnt / "random-1m").read_bytes()  # no handler process needed: nothing waits
    assert got == bytes(len(got))
    assert filler.events == []


def test_fd_opened_after_the_mark_raises_events_to_our_own_group(layer: Layer, cleanup: Cleanup) -> None:
    """A restarted daemon cannot open an event-free write fd for a marked blob: it needs the old one."""
    from concurrent.futures import ThreadPoolExecutor

    before_fd = cleanup.fd(os.open(layer.sparse, os.O_RDWR | os.O_CLOEXEC))
    group = _group(cleanup)
    group.watch(str(layer.sparse))
    filler = _filler(group, before_fd, layer, cleanup)
    after_fd = cleanup.fd(os.open(layer.sparse, os.O_RDWR | os.O_CLOEXEC))

    os.pread(before_fd, 4096, 0)
    os.pwrite(before_fd, b"x", 0)
    assert filler.events == []  # opened before the mark: silent

    with ThreadPoolExecutor(4) as pool:  # the daemon's own thread pool
        list(pool.map(lambda off: os.pread(after_fd, 4096, off), range(0, 16 * CHUNK, CHUNK)))
    assert len(filler.events) == 16
    assert {pid for pid, _, _ in filler.events} == {os.getpid()}
    n = len(filler.events)
    os.pwrite(after_fd, b"y", 3 * CHUNK)
    assert len(filler.events) == n + 1  # writes raise FAN_PRE_ACCESS too

    # round trip from another process: one event per pread of a fresh fd's hole
    count = 2000
    timing = subprocess.run(
        [sys.executable, "-c",
         "import os, sys, time\n"
         "fd = os.open(sys.argv[1], os.O_RDONLY); n = int(sys.argv[2]); t = time.perf_counter()\n"
         "for i in range(n): os.pread(fd, 4096, (i * 4096) % (1 << 20))\n"
         "print((time.perf_counter() - t) / n)",
         str(layer.sparse), str(count)],
        capture_output=True, timeout=60, check=True)
    per_event = float(timing.stdout)
    print(f"\nround trip pread -> event -> FAN_ALLOW: {per_event * 1e6:.0f} us "
          f"({1 / per_event:.0f} events/s, one Python handler thread)")
    assert len(filler.events) >= n + 1 + count


# --------------------------------------------------------------------------
# the holder: a killed handler, the watchdog


def test_without_a_holder_the_last_group_fd_closing_reads_zeros(
    layer: Layer, mounts: Mounts, cleanup: Cleanup, tmp_path: Path
) -> None:
    """The hazard the holder exists for: a blocked reader gets zeros, and no error."""
    group, _, mnt = _mark_and_mount(layer, mounts, cleanup)
    keeper = cleanup.proc(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                           pass_fds=(group.fd,)))
    group.close()  # the keeper (a handler that reads nothing) holds the only group fd now
    out = tmp_path / "out"
    reader = _start_reader(cleanup, mnt / "random-1m", out)
    time.sleep(1.0)
    assert reader.poll() is None  # blocked on its event
    keeper.kill()
    stdout, _ = reader.communicate(timeout=20)
    assert json.loads(stdout) == {"ok": True, "bytes": 1 << 20}
    assert out.read_bytes() == bytes(1 << 20)  # zeros where the source is random


def _hand_to_holder(layer: Layer, mounts: Mounts, cleanup: Cleanup, tmp_path: Path,
                    grace: float) -> tuple[Holder, Path]:
    """Mark and mount, give group and write fd to a new holder, close our own copies."""
    holder = cleanup.holder(tmp_path / "holder.sock", grace=grace)
    group, write_fd, mnt = _mark_and_mount(layer, mounts, cleanup)
    # no meta saying what they are: the holder tells a group by its fd
    holder.put("group", group.fd)
    holder.put("blob", write_fd, {"path": str(layer.sparse)})
    group.close()
    cleanup.close(write_fd)
    return holder, mnt


def _start_handler(cleanup: Cleanup, socket_path: Path, layer: Layer, *args: str) -> subprocess.Popen[bytes]:
    return cleanup.proc(subprocess.Popen(
        [sys.executable, "-m", "support.fanotify_handler", str(socket_path), str(layer.real), *args],
        stdout=subprocess.PIPE, env=ENV, cwd=REPO / "tests", bufsize=0))


Readers = list[tuple[str, str, Path, subprocess.Popen[bytes]]]


def _big_readers(layer: Layer, mnt: Path, cleanup: Cleanup, tmp_path: Path
                 ) -> Readers:
    """Several processes, every file >= 1 MiB (8+ events: none can be done before a stall)."""
    plan = [(name, "read") for name in layer.big] + [("libc.so.6", "mmap"), ("random-1m", "read"),
                                                       ("random-3m-odd", "mmap")]
    assert len(layer.big) == 3
    readers = []
    for i, (name, how) in enumerate(plan):
        out = tmp_path / f"out-{i}"
        readers.append((name, how, out, _start_reader(cleanup, mnt / name, out, how)))
    return readers


def _outcome(layer: Layer, name: str, how: str, out: Path, proc: subprocess.Popen[bytes],
             timeout: float) -> str:
    """How one reader ended: complete (every byte right), EIO or SIGBUS; a wrong byte or a
    reader still running after ``timeout`` seconds fails the test."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name} via {how}: still waiting {timeout:g} s later (hung)")
    source = (layer.src / name).read_bytes()
    got = out.read_bytes()
    assert _wrong_bytes(source, got) == 0, f"{name} via {how}: wrong bytes"
    if proc.returncode != 0:
        assert proc.returncode == -signal.SIGBUS, stderr  # an mmap fault denied with EIO
        return f"{name}/{how}: SIGBUS after {len(got)} bytes"
    result = json.loads(stdout)
    if result["ok"]:
        assert got == source
        return f"{name}/{how}: complete"
    assert result["errno"] == 5
    return f"{name}/{how}: errno 5 after {result['bytes']}"


def _stall_and_kill(cleanup: Cleanup, tmp_path: Path, layer: Layer, mnt: Path, *args: str
                    ) -> tuple[int, Readers]:
    """A handler that reads a batch it never answers while readers run, killed: how many events
    the batch held, and the readers (all still waiting)."""
    first = _start_handler(cleanup, tmp_path / "holder.sock", layer, *args, "--stall-after", "3")
    assert _line(first, 20) == "ready"
    readers = _big_readers(layer, mnt, cleanup, tmp_path)
    stalled = _line(first, 20)
    assert stalled.startswith("stalled ")
    orphaned = int(stalled.split()[1])
    assert orphaned > 0
    time.sleep(1.0)
    assert [name for name, _, _, p in readers if p.poll() is not None] == []  # blocked, not zeros
    first.kill()
    first.wait(10)
    return orphaned, readers


def test_killed_handler_readers_block_then_new_handler_serves(
    layer: Layer, mounts: Mounts, cleanup: Cleanup, tmp_path: Path
) -> None:
    holder, mnt = _hand_to_holder(layer, mounts, cleanup, tmp_path, grace=60)
    orphaned, readers = _stall_and_kill(cleanup, tmp_path, layer, mnt)
    time.sleep(1.0)  # the holder keeps the group: readers still wait
    assert [name for name, _, _, p in readers if p.poll() is not None] == []

    second = _start_handler(cleanup, tmp_path / "holder.sock", layer, "--sweep")
    swept = _line(second, 30)
    assert _line(second, 30) == "ready"
    assert swept.startswith("swept ")
    denied = int(swept.split()[1])
    assert denied == orphaned  # exactly the batch the dead handler had read

    outcomes = [_outcome(layer, name, how, out, proc, 60) for name, how, out, proc in readers]
    print(f"\nswept {denied} orphaned event(s); " + "; ".join(outcomes))
    assert holder.ping()["names"] == 2


def test_the_journal_lets_the_next_handler_answer_the_dead_ones_events_with_their_bytes(
    layer: Layer, mounts: Mounts, cleanup: Cleanup, tmp_path: Path
) -> None:
    """Events a killed handler had read are answered ALLOW after their range is filled, not EIO:
    the kernel copied each into the journal before putting it on the access list."""
    _, mnt = _hand_to_holder(layer, mounts, cleanup, tmp_path, grace=60)
    orphaned, readers = _stall_and_kill(cleanup, tmp_path, layer, mnt, "--journal")
    second = _start_handler(cleanup, tmp_path / "holder.sock", layer, "--journal", "--sweep")
    assert _line(second, 30) == f"replayed {orphaned}"  # the journal named every one
    assert _line(second, 30) == "swept 0"  # and nothing else waited
    assert _line(second, 30) == "ready"
    outcomes = [_outcome(layer, name, how, out, proc, 60) for name, how, out, proc in readers]
    assert all(o.endswith("complete") for o in outcomes), outcomes


def test_without_a_successor_the_watchdog_answers_the_events_a_killed_handler_had_read(
    layer: Layer, mounts: Mounts, cleanup: Cleanup, tmp_path: Path
) -> None:
    """Not only the queued events: those on the access list too, within the grace and a bound."""
    socket_path = tmp_path / "holder.sock"
    holder, mnt = _hand_to_holder(layer, mounts, cleanup, tmp_path, grace=2)
    orphaned, readers = _stall_and_kill(cleanup, tmp_path, layer, mnt, "--journal")
    holder.close()  # no client from now on
    outcomes = [_outcome(layer, name, how, out, proc, 2 + 20) for name, how, out, proc in readers]
    log = Path(f"{socket_path}.log").read_text()
    assert f"denied {orphaned} event(s) of group fd" in log, log
    print(f"\n{orphaned} event(s) the killed handler had read denied by the watchdog; " + "; ".join(outcomes))


def test_watchdog_denies_without_a_client_and_stops_when_one_connects(
    layer: Layer, mounts: Mounts, cleanup: Cleanup, tmp_path: Path
) -> None:
    socket_path = tmp_path / "holder.sock"
    holder, mnt = _hand_to_holder(layer, mounts, cleanup, tmp_path, grace=2)
    generation = holder.ping()["generation"]
    holder.close()  # no client from now on
    alone = time.monotonic()
    reader = _start_reader(cleanup, mnt / "random-1m", tmp_path / "out-denied")
    stdout, _ = reader.communicate(timeout=20)
    waited = time.monotonic() - alone
    result = json.loads(stdout)
    assert result == {"ok": False, "bytes": 0, "errno": 5}  # EIO, not zeros, not a hang
    assert waited >= 1.5
    print(f"\nwatchdog: reader got EIO {waited:.1f} s after the last client left (grace 2 s)")

    again = Holder.connect(str(socket_path))
    assert again is not None
    assert again.ping()["generation"] == generation
    held = again.get_all()
    group = _group(cleanup, held["group"][0])
    write_fd = cleanup.fd(held["blob"][0])
    assert group.sweep() == 0  # the watchdog left no event unanswered
    _filler(group, write_fd, layer, cleanup)
    out = tmp_path / "out-served"
    reader = _start_reader(cleanup, mnt / "random-1m", out)
    stdout, _ = reader.communicate(timeout=30)
    assert json.loads(stdout)["ok"]
    assert out.read_bytes() == (layer.src / "random-1m").read_bytes()
    again.close()


def test_holder_protocol(tmp_path: Path, cleanup: Cleanup) -> None:
    socket_path = tmp_path / ("long-" * 20) / "holder.sock"  # past sun_path's 108 bytes
    socket_path.parent.mkdir()
    holder = cleanup.holder(socket_path)
    assert (socket_path.stat().st_mode & 0o777) == 0o600
    info = holder.ping()
    assert info["names"] == 0
    r, w = os.pipe()
    cleanup.fd(r)
    cleanup.fd(w)
    for i in range(600):  # three GET-ALL messages
        holder.put(f"n{i:03}", w, {"i": i})
    held = holder.get_all()
    assert sorted(held) == [f"n{i:03}" for i in range(600)]
    assert held["n599"][1] == {"i": 599}
    os.write(held["n123"][0], b"via the holder")
    assert os.read(r, 100) == b"via the holder"
    for fd, _ in held.values():
        os.close(fd)
    assert holder.drop("n000")
    assert not holder.drop("n000")
    assert holder.ping()["names"] == 599
    assert Holder.connect(str(tmp_path / "nothing.sock")) is None
    import socket

    from lazyfetch.holder import _address

    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as raw, _address(str(socket_path)) as short:
        raw.connect(short)  # garbage, with an fd the holder must not keep
        raw.sendmsg([b"not json"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, r.to_bytes(4, "little"))])
        assert b"bad request" in raw.recv(1000)
    assert holder.ping()["names"] == 599
    holder.exit()
    assert Holder.connect(str(socket_path)) is None
    assert not socket_path.exists()


def _mount_raw_fuse(mnt: Path, fuse_fd: int) -> int:
    """Mount a FUSE file system nobody serves (INIT stays unanswered); its st_dev, from mountinfo."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    options = f"fd={fuse_fd},rootmode=40000,user_id=0,group_id=0".encode()
    if libc.mount(b"layerbox-test", os.fsencode(mnt), b"fuse", ctypes.c_ulong(0x6), options) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(mnt))
    # stat() of the mount would wait for INIT: the device number comes from the mount table
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(mnt):
            major, minor = fields[2].split(":")
            return os.makedev(int(major), int(minor))
    raise AssertionError(f"{mnt} is not in the mount table")


def test_watchdog_aborts_a_held_fuse_connection(tmp_path: Path, cleanup: Cleanup) -> None:
    require("fuse")
    holder = cleanup.holder(tmp_path / "holder.sock", grace=2)
    mnt = tmp_path / "fuse"
    mnt.mkdir()
    fuse_fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    try:
        dev = _mount_raw_fuse(mnt, fuse_fd)
        cleanup.later(kmount.umount, mnt, lazy=True, missing_ok=True)
        holder.put("fuse", fuse_fd, {"dev": dev})
    finally:
        os.close(fuse_fd)  # the holder's dup keeps the connection
    holder.close()
    alone = time.monotonic()
    statter = cleanup.proc(subprocess.Popen(
        [sys.executable, "-c", "import os, sys\ntry: os.stat(sys.argv[1])\n"
         "except OSError as e: print(e.errno)", str(mnt / "x")], stdout=subprocess.PIPE))
    stdout, _ = statter.communicate(timeout=20)
    waited = time.monotonic() - alone
    assert int(stdout) == 107  # ENOTCONN: the connection was aborted, nobody hangs
    assert waited >= 1.5
    print(f"\nwatchdog: FUSE request failed with ENOTCONN {waited:.1f} s after the last client left")


def test_holder_survives_the_daemon(cleanup: Cleanup) -> None:
    """Own session, terminal signals ignored, fd limit raised, foreign uids refused."""
    import tempfile

    # outside pytest's 0700 temp root, so that another uid can reach the socket at all
    public = Path(tempfile.mkdtemp(prefix="layerbox-holder-"))
    cleanup.later(shutil.rmtree, public, ignore_errors=True)
    public.chmod(0o755)
    socket_path = public / "holder.sock"
    holder = cleanup.holder(socket_path)
    pid = int(holder.ping()["pid"])
    assert os.getsid(pid) == pid
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        os.kill(pid, sig)
    assert holder.ping()["pid"] == pid
    limits = Path(f"/proc/{pid}/limits").read_text()
    soft, hard = next(line for line in limits.splitlines() if line.startswith("Max open files")).split()[3:5]
    assert soft == hard
    oom = Path(f"/proc/{pid}/oom_score_adj").read_text().strip()
    log = Path(str(socket_path) + ".log").read_text()
    assert oom == "-1000" or "cannot set oom_score_adj to -1000" in log  # needs CAP_SYS_RESOURCE

    # the socket is 0600; opened wider, the uid check still refuses another user
    os.chmod(socket_path, 0o666)
    stranger = subprocess.run([sys.executable, "-c", STRANGER, str(socket_path)],
                              capture_output=True, timeout=20, check=True)
    assert stranger.stdout.strip() == b"closed"  # no answer
    assert "refused a client of uid 65534" in Path(str(socket_path) + ".log").read_text()
