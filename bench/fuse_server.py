"""Sequential reads of one blob through lazyfetch.fuseserver, against the disk and fusepy.

    sudo .venv/bin/python bench/fuse_server.py [--size-mb 256] [--repeat 3] [--json]

One file of random bytes on the bench disk (``--tmpdir``, default /var/tmp) is read
start to end in 1 MiB reads, each run on a fresh mount (an empty FUSE page cache):

* ``disk``: the file itself;
* ``layerbox``: through our server (a child process serving the file's directory);
* ``fusepy``: through fusepy on libfuse 2, as the daemon served blobs before
  (skipped when ``fuse`` cannot be imported or libfuse 2 is missing).

Each is run *cold* (``echo 3 > /proc/sys/vm/drop_caches`` first, so the backing
file comes from the disk) and *cached* (the backing file in the page cache: what
is left is the FUSE round trips and the server).  The table shows the median of
``--repeat`` runs and the ratios against the peers of the same run.  Needs root.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: import the checkout, installed or not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import BenchError, _f, _table, emit, log, rate, workspace

from lazyfetch import fuseserver, kmount

CHUNK = 1 << 20
NAME = hashlib.sha256(b"bench blob").hexdigest()


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def read_all(path: Path) -> tuple[int, float]:
    """Bytes read and seconds taken, reading ``path`` sequentially in 1 MiB reads."""
    buf = bytearray(CHUNK)
    fd = os.open(path, os.O_RDONLY)
    try:
        total = 0
        began = time.perf_counter()
        while n := os.readv(fd, [buf]):
            total += n
        return total, time.perf_counter() - began
    finally:
        os.close(fd)


# --------------------------------------------------------------------------
# the servers, each in a child process (this script with --serve)


def serve_layerbox(blobs: str, fd: int) -> None:
    source = fuseserver.DirectorySource(blobs)
    fuseserver.FuseServer(source, fd).serve()


def serve_fusepy(blobs: str, mountpoint: str, ready_fd: int) -> None:
    import errno
    import stat

    from fuse import FUSE, FuseOSError, Operations

    class Blobs(Operations):
        def __init__(self) -> None:
            self.source = fuseserver.DirectorySource(blobs)
            self.fds: dict[str, int] = {}

        def init(self, path: str) -> None:
            os.write(ready_fd, b"ready\n")
            os.close(ready_fd)

        def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
            if path == "/":
                return {"st_mode": stat.S_IFDIR | 0o500, "st_nlink": 2}
            size = self.source.size(path[1:])
            if size is None:
                raise FuseOSError(errno.ENOENT)
            return {"st_mode": stat.S_IFREG | 0o400, "st_nlink": 1, "st_size": size}

        def readdir(self, path: str, fh: int) -> list[str]:
            return [".", "..", *self.source.names()]

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            # fusepy copies bytes into libfuse's buffer; a view of ours would need another copy
            fd = self.fds.get(path)
            if fd is None:
                fd = self.fds[path] = os.open(os.path.join(blobs, path[1:]), os.O_RDONLY)
            return os.pread(fd, size, offset)

    FUSE(Blobs(), mountpoint, foreground=True, ro=True, allow_other=True,
         default_permissions=True, max_read=1 << 20)


class Server:
    """A server child on a fresh mount; stopped by unmounting."""

    def __init__(self, kind: str, blobs: Path, mountpoint: Path) -> None:
        self.mountpoint = mountpoint
        script = [sys.executable, str(Path(__file__).resolve()), "--serve", kind, str(blobs)]
        if kind == "layerbox":
            fd = fuseserver.open_and_mount(str(mountpoint))
            try:
                self.proc = subprocess.Popen([*script, str(fd)], pass_fds=(fd,))
            finally:
                os.close(fd)
            return
        ready_r, ready_w = os.pipe()
        try:
            self.proc = subprocess.Popen([*script, str(mountpoint), str(ready_w)], pass_fds=(ready_w,))
        finally:
            os.close(ready_w)
        with os.fdopen(ready_r, "rb") as ready:
            if ready.readline() != b"ready\n":  # fusepy calls init() once the kernel's INIT is answered
                self.proc.kill()
                raise BenchError(f"fusepy did not mount on {mountpoint} (exit status {self.proc.wait()})")

    def cpu_seconds(self) -> float:
        """User + system CPU seconds the server process has used so far (all its threads)."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime

    def close(self) -> None:
        try:
            kmount.umount(self.mountpoint, missing_ok=True)
        finally:
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# --------------------------------------------------------------------------
# the runs


def have_fusepy() -> bool:
    try:
        import fuse  # noqa: F401
    except (ImportError, OSError):  # OSError: fusepy finds no libfuse
        return False
    return True


def one_run(kind: str, cold: bool, blobs: Path, work: Path, index: int) -> tuple[float, float | None]:
    """MB/s of one read of the blob, and the server's CPU seconds per GB (None: no server)."""
    blob = blobs / NAME
    if cold:
        drop_caches()
    else:
        read_all(blob)  # the backing file into the page cache
    cpu = None
    if kind == "disk":
        nbytes, seconds = read_all(blob)
    else:
        mountpoint = work / f"mnt-{kind}-{'cold' if cold else 'cached'}-{index}"
        mountpoint.mkdir()
        server = Server(kind, blobs, mountpoint)
        try:
            before = server.cpu_seconds()
            nbytes, seconds = read_all(mountpoint / NAME)
            cpu = server.cpu_seconds() - before
        finally:
            server.close()
    if nbytes != blob.stat().st_size:
        raise BenchError(f"{kind}: read {nbytes} bytes of {blob.stat().st_size}")
    value = rate(nbytes, seconds)
    assert value is not None
    return value, None if cpu is None else cpu / (nbytes / 1e9)


def render(doc: dict[str, Any]) -> str:
    rows = []
    for cond in ("cold", "cached"):
        results = doc["mb_per_s"][cond]
        for kind, value in results.items():
            vs_disk = value / results["disk"]
            vs_fusepy = value / results["fusepy"] if "fusepy" in results else None
            cpu = doc["server_cpu_s_per_gb"][cond].get(kind)
            rows.append([cond, kind, _f(value, 0), _f(vs_disk), _f(vs_fusepy), _f(cpu)])
    head = (f"sequential 1 MiB reads of a {doc['size_mb']} MiB blob, median of {doc['repeat']} "
            f"(MB/s = 10^6 bytes/s; server CPU = user + system seconds the server process used per GB read; "
            f"load average {doc['loadavg']:.1f} on {os.cpu_count()} CPUs at the start)\n")
    return head + _table(["backing file", "read through", "MB/s", "vs disk", "vs fusepy",
                          "server CPU s/GB"], rows, left=2)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=256, help="the blob's size in MiB (256)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per case; the median counts (3)")
    parser.add_argument("--tmpdir", type=Path, default=Path("/var/tmp"))
    parser.add_argument("--no-fusepy", action="store_true", help="skip the fusepy runs")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--serve", nargs="+", help=argparse.SUPPRESS)  # the server child
    args = parser.parse_args(argv)
    if args.serve:
        kind, blobs, *rest = args.serve
        if kind == "layerbox":
            serve_layerbox(blobs, int(rest[0]))
        else:
            serve_fusepy(blobs, rest[0], int(rest[1]))
        return 0
    try:
        if os.geteuid() != 0:
            raise BenchError("needs root: it mounts FUSE and drops the page cache")
        kinds = ["disk", "layerbox"] + ([] if args.no_fusepy or not have_fusepy() else ["fusepy"])
        with workspace(args.tmpdir, "layerbox-bench-fuse-") as work:
            blobs = work / "blobs"
            blobs.mkdir()
            log(f"writing a {args.size_mb} MiB blob under {work}")
            with open(blobs / NAME, "wb") as f:
                for _ in range(args.size_mb):
                    f.write(os.urandom(CHUNK))
            loadavg = os.getloadavg()[0]
            results: dict[str, dict[str, float]] = {}
            cpu: dict[str, dict[str, float]] = {}
            for cond in ("cold", "cached"):
                runs: dict[str, list[float]] = {k: [] for k in kinds}
                cpus: dict[str, list[float]] = {k: [] for k in kinds if k != "disk"}
                for i in range(args.repeat):
                    for kind in kinds:  # interleaved, so drift hits every kind alike
                        mb_s, cpu_s = one_run(kind, cond == "cold", blobs, work, i)
                        runs[kind].append(mb_s)
                        if cpu_s is not None:
                            cpus[kind].append(cpu_s)
                        log(f"{cond} {kind} run {i + 1}: {mb_s:.0f} MB/s")
                results[cond] = {k: statistics.median(v) for k, v in runs.items()}
                cpu[cond] = {k: statistics.median(v) for k, v in cpus.items()}
        doc = {"schema": "layerbox.bench.fuse_server.v1", "size_mb": args.size_mb,
               "repeat": args.repeat, "loadavg": loadavg, "mb_per_s": results,
               "server_cpu_s_per_gb": cpu}
        emit(doc, args.json, render)
    except BenchError as exc:
        print(f"bench/fuse_server.py: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

