"""Real-kernel tests of lazyfetch.fuseserver: our own FUSE server on /dev/fuse.

Every test mounts a real FUSE connection (root, /dev/fuse).  The takeover
tests run the server in child processes (tests/support/fuseserver_child.py),
SIGKILL one while reads are in flight and let the next take the fd from a
holder process: readers must see neither errors nor wrong bytes.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import random
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from support.env import require

from lazyfetch import fuseserver, kmount

if TYPE_CHECKING:
    from conftest import Mounts

MIB = 1 << 20
CHILD = Path(__file__).resolve().parent / "support" / "fuseserver_child.py"


def _name(i: int) -> str:
    return hashlib.sha256(b"blob %d" % i).hexdigest()


class MemorySource:
    """Blobs in memory; records the largest read the server asked for."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.largest_read = 0

    def names(self) -> list[str]:
        return list(self.files)

    def size(self, name: str) -> int | None:
        data = self.files.get(name)
        return None if data is None else len(data)

    def read(self, name: str, offset: int, size: int) -> memoryview:
        self.largest_read = max(self.largest_read, size)
        return memoryview(self.files[name])[offset:offset + size]


class FuseMounts:
    """FUSE mounts, servers, holders and reader threads of one test, all gone at its end.

    ``release`` stops the in-process servers and kills the child processes, so that
    no process holds the /dev/fuse fd any more: the kernel then aborts the
    connection and a reader still waiting for an answer gets an error and ends.
    The ``mounts`` fixture unmounts afterwards.
    """

    def __init__(self, mounts: Mounts) -> None:
        self._mounts = mounts
        self._fds: list[int] = []
        self._servers: list[tuple[fuseserver.FuseServer, threading.Thread]] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self._threads: list[threading.Thread] = []

    def mount(self) -> tuple[Path, int]:
        require("root")
        require("fuse")
        mountpoint = self._mounts.fresh_dir("fuse")
        fd = fuseserver.open_and_mount(str(mountpoint))
        self._mounts.adopt(mountpoint)
        self._fds.append(fd)
        return mountpoint, fd

    def close_fd(self, fd: int) -> None:
        self._fds.remove(fd)
        os.close(fd)

    def serve(self, source: fuseserver.BlobSource, fd: int) -> threading.Thread:
        """Serve in this process, on a thread (so the test sees the source's records)."""
        return self._serve(source, fd, resumed=False)

    def serve_resumed(self, source: fuseserver.BlobSource, fd: int) -> threading.Thread:
        return self._serve(source, fd, resumed=True)

    def _serve(self, source: fuseserver.BlobSource, fd: int, *, resumed: bool) -> threading.Thread:
        server = fuseserver.FuseServer(source, fd, threads=4)
        thread = threading.Thread(target=server.serve, kwargs={"resumed": resumed},
                                  name="fuse-serve", daemon=True)
        thread.start()
        self._servers.append((server, thread))
        return thread

    def spawn(self, argv: list[str], *, pass_fds: tuple[int, ...] = (),
              stdout: int | None = None) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv, pass_fds=pass_fds, stdout=stdout, start_new_session=True)
        self._procs.append(proc)
        return proc

    def thread(self, target: Callable[[], None], name: str) -> threading.Thread:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()
        return thread

    def release(self) -> list[str]:
        problems = []
        for server, thread in self._servers:
            server.stop()
            thread.join(30)
            if thread.is_alive():
                problems.append("an in-process FUSE server did not stop")
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
            if proc.stdout is not None:
                proc.stdout.close()
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        for thread in self._threads:
            thread.join(60)
            if thread.is_alive():
                problems.append(f"thread {thread.name} still runs after the connection ended")
        return problems


@pytest.fixture
def fuse(mounts: Mounts) -> Iterator[FuseMounts]:
    """The ``mounts`` fixture unmounts after this one has ended the connections."""
    tracker = FuseMounts(mounts)
    try:
        yield tracker
    finally:
        problems = tracker.release()
        if problems:
            pytest.fail("FUSE test left things behind:\n" + "\n".join(problems), pytrace=False)


def _random_files(rng: random.Random) -> dict[str, bytes]:
    sizes = [9 * MIB + 123, 5000, 0, 3 * 4096]
    return {_name(i): rng.randbytes(size) for i, size in enumerate(sizes)}


# --------------------------------------------------------------------------
# one server


def test_reads_listing_and_modes(fuse: FuseMounts) -> None:
    files = _random_files(random.Random(1))
    source = MemorySource(files)
    mountpoint, fd = fuse.mount()
    fuse.serve(source, fd)

    assert sorted(os.listdir(mountpoint)) == sorted(files)
    root = os.stat(mountpoint)
    assert (stat.S_IMODE(root.st_mode), root.st_uid, root.st_gid) == (0o500, 0, 0)
    assert stat.S_ISDIR(root.st_mode)
    for name, data in files.items():
        path = mountpoint / name
        st = os.stat(path)
        assert stat.S_ISREG(st.st_mode)
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_size) == (0o400, 0, len(data))
        assert path.read_bytes() == data
        if data:  # an empty file cannot be mapped
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
                assert m[:] == data
    # node ids are the names' (the kernel keeps them across servers)
    assert {os.stat(mountpoint / n).st_ino for n in files} == {fuseserver.node_id(n) for n in files}

    with pytest.raises(FileNotFoundError):
        os.stat(mountpoint / _name(99))
    with pytest.raises(FileNotFoundError):
        os.stat(mountpoint / "not-a-digest")
    with pytest.raises(OSError, match="Read-only file system") as writing:
        open(mountpoint / _name(0), "r+b")
    assert writing.value.errno == errno.EROFS


def test_only_root_reads(fuse: FuseMounts) -> None:
    require("cmd:setpriv")
    files = _random_files(random.Random(2))
    mountpoint, fd = fuse.mount()
    fuse.serve(MemorySource(files), fd)
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    for argv in (["cat", str(mountpoint / _name(1))], ["ls", str(mountpoint)]):
        result = subprocess.run(nobody + argv, capture_output=True, timeout=30)
        assert result.returncode != 0, argv
        assert b"Permission denied" in result.stderr, result.stderr
    assert (mountpoint / _name(1)).read_bytes() == files[_name(1)]  # root still can


def test_requests_are_bigger_than_libfuse2s(fuse: FuseMounts) -> None:
    data = random.Random(3).randbytes(64 * MIB)
    source = MemorySource({_name(0): data})
    mountpoint, fd = fuse.mount()
    fuse.serve(source, fd)
    began = time.perf_counter()
    with open(mountpoint / _name(0), "rb", buffering=0) as f:
        got = f.read()
    seconds = time.perf_counter() - began
    assert got == data
    print(f"\n64 MiB through the server: {len(data) / MIB / seconds:.0f} MiB/s, "
          f"largest READ {source.largest_read >> 10} KiB")
    assert source.largest_read > 128 << 10  # libfuse 2 (fusepy) never gets more


def test_unmount_ends_serve(fuse: FuseMounts) -> None:
    files = _random_files(random.Random(4))
    mountpoint, fd = fuse.mount()
    thread = fuse.serve(MemorySource(files), fd)
    assert (mountpoint / _name(1)).read_bytes() == files[_name(1)]
    kmount.umount(mountpoint)
    thread.join(30)
    assert not thread.is_alive()


# --------------------------------------------------------------------------
# a server killed while serving, and the next one taking over


class Reader:
    """Reads a file through the mount in whole passes and checks every byte."""

    def __init__(self, path: Path, expected: bytes, passes: int, *, direct: bool) -> None:
        self.path = path
        self.expected = expected
        self.passes = passes
        self.direct = direct
        self.bytes_read = 0
        self.errors: list[str] = []
        self.done = False

    def run(self) -> None:
        try:
            for _ in range(self.passes):
                self._one_pass()
            self.done = True
        except OSError as exc:
            self.errors.append(f"{self.path.name}: {exc!r}")

    def _one_pass(self) -> None:
        chunk = MIB
        flags = os.O_RDONLY | (os.O_DIRECT if self.direct else 0)
        fd = os.open(self.path, flags)
        buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
        try:
            offset = 0
            while offset < len(self.expected):
                n = os.preadv(fd, [buf], offset)
                if buf[:n] != self.expected[offset:offset + n] or n == 0:
                    self.errors.append(f"wrong bytes at {offset} (direct={self.direct})")
                    return
                offset += n
                self.bytes_read += n
            if not self.direct:
                # drop our pages so the next pass asks the server again
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            buf.close()
            os.close(fd)


def _await_lines(proc: subprocess.Popen[bytes], prefix: bytes, count: int, timeout: float) -> None:
    """Wait until the child printed ``count`` lines starting with ``prefix``."""
    assert proc.stdout is not None
    seen = 0
    deadline = time.monotonic() + timeout
    found = threading.Event()

    def scan() -> None:
        nonlocal seen
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(prefix):
                seen += 1
                if seen >= count:
                    found.set()
                    return

    threading.Thread(target=scan, daemon=True).start()
    if not found.wait(max(0.0, deadline - time.monotonic())):
        pytest.fail(f"the server printed {seen} of {count} {prefix.decode()!r} lines "
                    f"in {timeout} s (exit status {proc.poll()})")


def test_killed_server_is_replaced_without_errors(fuse: FuseMounts, tmp_path: Path) -> None:
    require("cmd:sleep")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    data = random.Random(5).randbytes(48 * MIB)
    (blobs / _name(0)).write_bytes(data)
    mountpoint, fd = fuse.mount()
    # the holder: keeps the connection alive while no server runs
    holder = fuse.spawn(["sleep", "600"], pass_fds=(fd,))
    first = fuse.spawn([sys.executable, str(CHILD), str(blobs), f"{holder.pid}:{fd}",
                        "--stall-after", "20"], stdout=subprocess.PIPE)
    fuse.close_fd(fd)  # from now on only the holder and the servers have it

    readers = [Reader(mountpoint / _name(0), data, passes=3, direct=i % 2 == 0)
               for i in range(4)]
    threads = [fuse.thread(r.run, f"reader-{i}") for i, r in enumerate(readers)]
    # the first server answers 20 reads, then holds every further one
    _await_lines(first, b"stalled", 2, timeout=60)
    first.kill()
    first.wait(30)

    # no server at all for a while: readers wait, neither failing nor reading (once they
    # have used up what readahead had put in the page cache before the kill)
    time.sleep(0.5)
    progress = [r.bytes_read for r in readers]
    time.sleep(1.5)  # the test is that nothing happens in this interval
    assert [r.errors for r in readers] == [[]] * 4
    assert [r.bytes_read for r in readers] == progress
    assert all(t.is_alive() for t in threads)

    began = time.perf_counter()
    second = fuse.spawn([sys.executable, str(CHILD), str(blobs), f"{holder.pid}:{fd}",
                         "--resumed"], stdout=subprocess.PIPE)
    for thread in threads:
        thread.join(180)
    seconds = time.perf_counter() - began
    assert [r.errors for r in readers] == [[]] * 4
    assert all(r.done for r in readers)
    # the reads the first server held came again, marked as resent (FUSE_NOTIFY_RESEND)
    _await_lines(second, b"INFO:lazyfetch.fuseserver:request 0x8", 2, timeout=10)
    after = sum(r.bytes_read for r in readers) - sum(progress)
    print(f"\nafter the takeover: {after / MIB:.0f} MiB in {seconds:.1f} s by 4 readers")


# --------------------------------------------------------------------------
# faults of the source, and names the server must refuse


class FaultySource(MemorySource):
    """Fails reads of the blobs named in ``faults`` in the way given there."""

    def __init__(self, files: dict[str, bytes], faults: dict[str, str]) -> None:
        super().__init__(files)
        self.faults = faults

    def read(self, name: str, offset: int, size: int) -> memoryview:
        fault = self.faults.get(name)
        if fault == "eio":
            raise OSError(errno.EIO, f"fetching {name} failed")
        if fault == "enospc":
            raise OSError(errno.ENOSPC, "cache full")
        if fault == "bug":
            raise ValueError("not an OSError")
        if fault == "short":
            return super().read(name, offset, size)[:-1]
        return super().read(name, offset, size)


def test_source_failures_become_errnos(fuse: FuseMounts, caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random(6)
    files = {_name(i): rng.randbytes(20000) for i in range(5)}
    faults = {_name(0): "eio", _name(1): "enospc", _name(2): "bug", _name(3): "short"}
    mountpoint, fd = fuse.mount()
    fuse.serve(FaultySource(files, faults), fd)
    expected = {"eio": errno.EIO, "enospc": errno.ENOSPC, "bug": errno.EIO, "short": errno.EIO}
    for name, fault in faults.items():
        with pytest.raises(OSError, match=os.strerror(expected[fault])) as failed:
            (mountpoint / name).read_bytes()
        assert failed.value.errno == expected[fault], fault
        assert name in caplog.text  # logged with the name (and the offset)
    assert (mountpoint / _name(4)).read_bytes() == files[_name(4)]  # the others still read


def test_names_sharing_a_node_id_are_both_refused(fuse: FuseMounts) -> None:
    prefix = "ab" * 7 + "c"  # 15 hex digits: the node id's
    twins = [prefix + "0" * 49, prefix + "1" * 49]
    files = {twins[0]: b"one", twins[1]: b"two", _name(0): b"three"}
    mountpoint, fd = fuse.mount()
    fuse.serve(MemorySource(files), fd)
    for twin in twins:
        with pytest.raises(OSError, match=os.strerror(errno.EIO)):
            os.stat(mountpoint / twin)
    assert (mountpoint / _name(0)).read_bytes() == b"three"


def test_stop_then_resume_in_process(fuse: FuseMounts, caplog: pytest.LogCaptureFixture) -> None:
    files = _random_files(random.Random(7))
    mountpoint, fd = fuse.mount()
    first = fuseserver.FuseServer(MemorySource(files), fd, threads=2)
    thread = threading.Thread(target=first.serve)
    thread.start()
    try:
        assert (mountpoint / _name(1)).read_bytes() == files[_name(1)]
    finally:
        first.stop()
        thread.join(30)
    assert not thread.is_alive()
    # the connection lives on: a new server resumes it without INIT
    fuse.serve_resumed(MemorySource(files), fd)
    assert (mountpoint / _name(3)).read_bytes() == files[_name(3)]
    assert os.stat(mountpoint / _name(0)).st_size == len(files[_name(0)])
    assert "FUSE_NOTIFY_RESEND refused" not in caplog.text  # the kernel took it (6.9+)


def test_init_read_by_a_dead_server_comes_again(fuse: FuseMounts) -> None:
    files = _random_files(random.Random(8))
    mountpoint, fd = fuse.mount()
    # a server that read the kernel's INIT and died before answering it
    request = os.read(fd, 256 << 10)
    opcode = int.from_bytes(request[4:8], "little")
    assert opcode == 26  # FUSE_INIT
    # resumed=True (its caller cannot know how far the dead server got): the RESEND brings
    # the INIT back, and the new server answers it
    fuse.serve_resumed(MemorySource(files), fd)
    assert (mountpoint / _name(1)).read_bytes() == files[_name(1)]
