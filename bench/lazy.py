"""Benchmark: lazy mounts from a layerbox store against eager pulls (skopeo copy + umoci unpack).

One run, on the fixture images published to a ``file://`` store and to an
``s3://`` store on a moto server started for the run:

* **first output from an empty host**: for each (image, command) case, a fresh
  host (new data dir, its own lazyfetch daemon, empty caches) with the kernel
  page cache dropped runs ``unshare --mount chroot MNT CMD``; timed from the
  start of the mount (resolve, daemon start, layer mounts, overlay) to the
  command's first byte of output, with the bytes the daemon fetched from the
  store.  Peers, in the same run: **eager** (``skopeo copy`` + ``umoci
  unpack`` of the whole image, then the same chroot) and **layerbox eager**
  (``layerbox prefetch`` of the whole image, then the mount).  What the
  command really reads is measured once with ``strace`` on the unpacked tree.
  Images: ``minbase``, ``python`` and ``big`` (``python`` plus a layer of
  incompressible filler), so the time can be compared across image sizes.
* **replay of a task** (a unittest run, a venv, imports, ``dpkg -l``) in a
  writable mount: cold, on a second host replaying the access trace the first
  one stored, then fully cached (page cache dropped) and hot.
* **sequential reads** of every file under ``/usr`` through the mount (from the
  store, from the chunk cache, warm) against the unpacked plain directory, and
  the page cache used per byte read.
* **mount time** of a cached image: ``--mounts`` mounts and unmounts,
  read-only and writable, with the layers mounted by the call or shared.
* **cold reads against the decode ceiling** (``cold``, issue 27): the files of
  at least 256 KiB of ``python`` read from a fresh host with 1 and with
  ``--readers`` threads, each against decompress + blake3 of exactly their
  chunks from memory on every core, measured right after it; ``--backends
  rgw`` runs every section on a Ceph RGW booted for the run.

Every host is torn down in ``finally`` (``umount_all(stop_daemon=True)``), and
at exit nothing may remain mounted under the work directory.  Run
``python bench/lazy.py --help``; bench/README.md explains every number.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import hashlib
import io
import json
import math
import os
import platform
import random
import re
import selectors
import shlex
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: import the checkout, installed or not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import blake3  # noqa: E402
from common import (  # shared by the benchmarks
    BenchError,
    _f,
    _table,
    aws_environment,
    emit,
    log,
    rate,
    remove_tree,
    workspace,
)

from converters.errors import ConvertError  # noqa: E402
from converters.oci import inspect_image  # noqa: E402
from converters.publish import publish  # noqa: E402
from layerstore.erofs.reader import ErofsImage  # noqa: E402
from layerstore.errors import LayerstoreError  # noqa: E402
from layerstore.objects import Resolved, doc_key, index_key, meta_key, trace_key  # noqa: E402
from layerstore.packs import decompress  # noqa: E402
from layerstore.store import Store  # noqa: E402
from lazyfetch import kmount  # noqa: E402
from lazyfetch.blobcache import holes, padded  # noqa: E402
from lazyfetch.errors import LazyfetchError  # noqa: E402
from lazyfetch.fetcher import plan_runs  # noqa: E402
from lazyfetch.mounts import HostMounts  # noqa: E402

SCHEMA = "layerbox.bench.lazy.v1"
MB = 1_000_000
READ_SIZE = 1 << 20
FIXTURE_NAME = "debian-bookworm.oci.tar"
FIXTURE_TAGS = ("minbase", "python")
BIG = "big"  # python + a filler layer
FILLER_FILE = 8 << 20
CHROOT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root", "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",  # the plain directory must not change between runs
}
COMMANDS: dict[str, tuple[str, ...]] = {
    "cat": ("/bin/cat", "/etc/os-release"),
    "python": ("/usr/bin/python3", "-c", "import json, email, http.client; print(1)"),
}
TASK_SCRIPT = (
    "cd /workspace/calc && python3 -m unittest discover -s tests"
    " && python3 -m venv --without-pip --clear /tmp/venv"
    " && /tmp/venv/bin/python -c 'import json, email, http.client, asyncio, sqlite3, ssl, decimal'"
    " && dpkg -l > /dev/null && echo done"
)
TASK = ("/bin/sh", "-c", TASK_SCRIPT)
CASES = (("minbase", "cat"), ("python", "cat"), ("python", "python"), (BIG, "cat"), (BIG, "python"))
READ_TREE = "usr"  # what the sequential read reads, in the python image
SECTIONS = ("first", "replay", "read", "mount", "start", "burst", "cold")
DEFAULT_SECTIONS = ("first", "replay", "read", "mount", "start", "cold")
BACKENDS = ("file", "s3", "rgw")
COLD_MIN_SIZE = 256 << 10  # the cold section reads the image's files of at least this size
DATA_PATHS = ("fanotify", "fuse")
TOOLS = {"skopeo": "skopeo", "umoci": "umoci", "strace": "strace", "unshare": "util-linux",
         "chroot": "coreutils", "fincore": "util-linux", "sync": "coreutils"}
COMMAND_TIMEOUT = 600.0
TOOL_TIMEOUT = 1800.0
TRACE_WAIT = 30.0  # seconds past the trace window to wait for the trace object
SETTLE_TIMEOUT = 120.0  # for a replayed trace's prefetch to finish

GOAL_FETCH_OVER_READ = 1.3  # bytes fetched <= this x the bytes of the files the command opened
GOAL_SIZE_RATIO = 1.25  # first output on the largest image <= this x on the smallest
GOAL_CACHED_ONCE = 1.1  # page cache per byte read through the mount <= this x the plain directory's
GOAL_REREAD = 0.9  # issue 13: re-read, page cache dropped >= this x EROFS on a local blob
GOAL_COLD = 0.8  # issue 13: cold reads >= this x the store's raw delivery (1 and 16 readers)
GOAL_COLD_DECODE = 0.8  # issue 27: cold reads >= this x decompress+verify of their chunks on every core
GOAL_TASK_COLD = 2.0  # issue 13: the task cold <= this x the plain dir with dropped caches
GOAL_TASK_TRACE = 1.3  # issue 13: ... with its trace



# -- processes ---------------------------------------------------------------------------------


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_tool(argv: Sequence[str | os.PathLike[str]], timeout: float = TOOL_TIMEOUT) -> str:
    """Run a command and return its stdout; its whole process group dies with us."""
    args = [os.fspath(a) for a in argv]
    try:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
    except OSError as exc:
        raise BenchError(f"cannot run {args[0]}: {exc.strerror}") from None
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException as exc:
        _kill_group(proc)
        if isinstance(exc, subprocess.TimeoutExpired):
            raise BenchError(f"{shlex.join(args)} ran longer than {timeout:.0f} s; killed") from None
        raise
    if proc.returncode != 0:
        tail = err.decode("utf-8", "replace")[-4000:].strip()
        raise BenchError(f"{shlex.join(args)} failed with exit status {proc.returncode}: {tail}")
    return out.decode("utf-8", "replace")


@dataclass
class Timed:
    first_output: float  # perf_counter() when the first stdout byte arrived (or the exit)
    exited: float
    stdout: bytes


def run_timed(argv: Sequence[str | os.PathLike[str]], *, env: Mapping[str, str] | None = None,
              timeout: float = COMMAND_TIMEOUT) -> Timed:
    """Run ``argv``, noting when its first byte of stdout arrives; fail on a non-zero exit."""
    args = [os.fspath(a) for a in argv]
    deadline = time.monotonic() + timeout
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(env) if env is not None else None, start_new_session=True)
    first: float | None = None
    out, err = bytearray(), bytearray()
    try:
        assert proc.stdout is not None
        assert proc.stderr is not None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ, out)
            sel.register(proc.stderr, selectors.EVENT_READ, err)
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BenchError(f"{shlex.join(args)} ran longer than {timeout:.0f} s; killed")
                for key, _ in sel.select(left):
                    data = os.read(key.fd, 65536)
                    if not data:
                        sel.unregister(key.fileobj)
                        continue
                    if key.data is out and first is None:
                        first = time.perf_counter()
                    key.data.extend(data)
        rc = proc.wait(max(deadline - time.monotonic(), 1.0))
        exited = time.perf_counter()
    except BaseException:
        _kill_group(proc)
        raise
    finally:
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    if rc != 0:
        raise BenchError(f"{shlex.join(args)} failed with exit status {rc}: "
                         f"{err.decode('utf-8', 'replace')[-3000:].strip()}")
    return Timed(first if first is not None else exited, exited, bytes(out))


# In the private mount namespace, the host's /dev/null over the image's: layerbox mounts its
# layers and overlays nodev (an image's device nodes open nothing), and a sandbox gets its own
# /dev anyway; the plain directory gets the same bind, so both methods run the same command.
_WITH_DEV_NULL = 'mount --bind /dev/null "$1/dev/null" && exec "${@:2}"'


def chroot_argv(root: Path, command: Sequence[str], *, tracer: Sequence[str] = ()) -> list[str]:
    return ["unshare", "--mount", "--propagation", "private", "/bin/bash", "-c", _WITH_DEV_NULL, "bash",
            str(root), *tracer, "/usr/sbin/chroot", str(root), *command]


def drop_caches() -> None:
    """Write back dirty pages, then drop the page cache, dentries and inodes: a cold host."""
    run_tool(["sync"])
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def meminfo_cached() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    raise BenchError("/proc/meminfo has no Cached: line")


def resident_bytes(paths: Sequence[str | os.PathLike[str]]) -> int:
    """Bytes of these files' data in the page cache (util-linux ``fincore``, i.e. mincore(2))."""
    total = 0
    names = [os.fspath(p) for p in paths]
    for i in range(0, len(names), 400):
        out = run_tool(["fincore", "--json", "--bytes", "--output", "RES", *names[i : i + 400]])
        total += sum(int(row["res"]) for row in json.loads(out)["fincore"])
    return total


# -- files -------------------------------------------------------------------------------------


def regular_files(root: Path) -> list[str]:
    """Every regular file under ``root`` once (hard links once), in a stable order."""
    seen: set[tuple[int, int]] = set()
    out = []
    for top, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(top, name)
            st = os.lstat(path)
            if (st.st_mode & 0o170000) == 0o100000 and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                out.append(path)
    return out


def read_files(paths: Sequence[str]) -> int:
    total = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            while block := os.read(fd, READ_SIZE):
                total += len(block)
        finally:
            os.close(fd)
    return total


def resolve_in_root(root: Path, path: str) -> Path | None:
    """``path`` as a process chrooted to ``root`` sees it, symlinks followed inside ``root``."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    current = root
    hops = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            current = current.parent if current != root else root
            continue
        candidate = current / part
        if candidate.is_symlink():
            hops += 1
            if hops > 40:
                return None
            target = os.readlink(candidate)
            if target.startswith("/"):
                current = root
            parts = [p for p in target.split("/") if p not in ("", ".")] + parts
            continue
        if not candidate.exists():
            return None
        current = candidate
    return current


def elf_interpreter(path: Path) -> str | None:
    """The PT_INTERP of a 64-bit ELF file, or the program of a ``#!`` script."""
    try:
        with path.open("rb") as f:
            head = f.read(64)
            if head.startswith(b"#!"):
                line = (head + f.read(192)).split(b"\n", 1)[0][2:].strip()
                return line.split()[0].decode() if line else None
            if head[:4] != b"\x7fELF" or head[4] != 2:
                return None
            phoff, = struct.unpack_from("<Q", head, 0x20)
            phentsize, phnum = struct.unpack_from("<HH", head, 0x36)
            for i in range(phnum):
                f.seek(phoff + i * phentsize)
                ph = f.read(phentsize)
                p_type, = struct.unpack_from("<I", ph, 0)
                if p_type == 3:  # PT_INTERP
                    p_offset, = struct.unpack_from("<Q", ph, 8)
                    p_filesz, = struct.unpack_from("<Q", ph, 32)
                    f.seek(p_offset)
                    return f.read(p_filesz).rstrip(b"\0").decode()
    except (OSError, struct.error, UnicodeDecodeError):
        return None
    return None


_OPEN_RE = re.compile(r"\b(?:openat|open)\((.*) = \d+<(.+)>$")
_EXEC_RE = re.compile(r'\bexecve\("((?:[^"\\]|\\.)*)", .* = 0$')


def opened_files(root: Path, command: Sequence[str], log_path: Path) -> dict[str, Any]:
    """The image files a command reads, from ``strace -f -y`` of it chrooted to ``root``.

    Counted: files opened read-only (the kernel prints their real path, so only
    those under ``root`` are the image's), every program executed and its ELF
    interpreter (the kernel loads those without an ``openat``).  Bytes are the
    files' sizes: an upper bound of what was read (a library is mapped, not
    read in full).
    """
    argv = chroot_argv(root, command, tracer=["strace", "-f", "-y", "-qq", "-e", "trace=open,openat,execve",
                                               "-o", str(log_path)])
    run_timed(argv, env=CHROOT_ENV)
    real_root = os.path.realpath(root)
    found: dict[tuple[int, int], tuple[str, int]] = {}

    def add(path: Path | None) -> None:
        if path is None:
            return
        real = os.path.realpath(path)
        if not real.startswith(real_root + "/"):
            return
        st = os.stat(real)
        if (st.st_mode & 0o170000) == 0o100000:
            found.setdefault((st.st_dev, st.st_ino), (real[len(real_root):], st.st_size))

    execs = 0
    pending: dict[str, str] = {}  # pid -> the first half of a call another process interrupted
    for raw in log_path.read_text(errors="replace").splitlines():
        pid, _, line = raw.partition(" ")
        if line.endswith("<unfinished ...>"):
            pending[pid] = line.removesuffix("<unfinished ...>")
            continue
        if "resumed>" in line:
            line = pending.pop(pid, "") + line.split("resumed>", 1)[1]
        m = _OPEN_RE.search(line)
        if m:
            if "O_RDONLY" in m.group(1) and "O_DIRECTORY" not in m.group(1):
                add(Path(m.group(2)))
            continue
        m = _EXEC_RE.search(line)
        if m:
            execs += 1
            if execs == 1:  # /usr/sbin/chroot itself, from the host
                continue
            program = resolve_in_root(root, m.group(1))
            add(program)
            interp = elf_interpreter(program) if program is not None else None
            if interp:
                target = resolve_in_root(root, interp)
                add(target)
                second = elf_interpreter(target) if target is not None else None
                if second:
                    add(resolve_in_root(root, second))
    log_path.unlink()
    files = sorted(found.values())
    return {"files": len(files), "bytes": sum(size for _, size in files),
            "largest": [{"path": p, "bytes": s} for p, s in sorted(files, key=lambda x: -x[1])[:5]]}


# -- inputs ------------------------------------------------------------------------------------


@dataclass
class ImageInput:
    tag: str
    src: str  # oci:LAYOUT:TAG, what both eager and publish read
    name: str  # the ref in the stores
    layers: int
    compressed_bytes: int  # the layer blobs: what an eager pull downloads
    files: int = 0
    file_bytes: int = 0


def find_fixture(option: str | None) -> Path:
    if option:
        path = Path(option)
        if not path.is_file():
            raise BenchError(f"--fixture {option}: no such file (pass the oci-archive with tags minbase and python)")
        return path
    here = Path(__file__).resolve().parents[1]
    candidate = here.parent / "shared" / "fixtures" / FIXTURE_NAME
    if candidate.is_file():
        return candidate
    raise BenchError(f"the fixture image ../shared/fixtures/{FIXTURE_NAME} is not here; pass --fixture PATH")


def write_filler(path: Path, total: int) -> None:
    """A layer tarball of incompressible files under /opt/filler (an image made large)."""
    rng = random.Random(20240917)
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("opt/filler")
        info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 1_700_000_000
        tar.addfile(info)
        n = 0
        while total > 0:
            data = rng.randbytes(min(FILLER_FILE, total))
            info = tarfile.TarInfo(f"opt/filler/part-{n:04d}.bin")
            info.size, info.mode, info.mtime = len(data), 0o644, 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
            total -= len(data)
            n += 1


def prepare_images(fixture: Path, work: Path, filler_mb: int) -> dict[str, ImageInput]:
    """Copy the fixture's tags into one OCI layout (untimed) and add the big image."""
    layout = work / "layout"
    for tag in FIXTURE_TAGS:
        log(f"layout: skopeo copy {tag}")
        run_tool(["skopeo", "copy", "-q", f"oci-archive:{fixture}:{tag}", f"oci:{layout}:{tag}"])
    tags = list(FIXTURE_TAGS)
    if filler_mb > 0:
        filler = work / "filler.tar"
        log(f"layout: {BIG} = python + {filler_mb} MB of filler (umoci raw add-layer)")
        write_filler(filler, filler_mb * MB)
        run_tool(["umoci", "raw", "add-layer", "--image", f"{layout}:python", "--tag", BIG, str(filler)])
        filler.unlink()
        tags.append(BIG)
    images = {}
    for tag in tags:
        src = f"oci:{layout}:{tag}"
        try:
            resolved = inspect_image(src)
        except ConvertError as exc:
            raise BenchError(f"{src}: {exc}") from None
        images[tag] = ImageInput(tag, src, f"bench/{tag}", len(resolved.layers),
                                 sum(layer.size or 0 for layer in resolved.layers))
    return images


# -- eager: skopeo copy + umoci unpack ---------------------------------------------------------


class Trash:
    """Outputs moved aside, deleted at exit: deleting ~10k files and unpacking again at once is
    slow on ext4 without a journal (see bench/README.md, convert.py caveats)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.n = 0

    def put(self, path: Path) -> None:
        self.root.mkdir(exist_ok=True)
        self.n += 1
        os.rename(path, self.root / f"{self.n:04d}")


def eager_run(image: ImageInput, command: Sequence[str], dest: Path) -> dict[str, Any]:
    """Download every layer whole and unpack it, then run the command: the time to its first output."""
    oci, bundle = dest / "oci", dest / "bundle"
    dest.mkdir(parents=True)
    drop_caches()
    t0 = time.perf_counter()
    run_tool(["skopeo", "copy", "-q", image.src, f"oci:{oci}:{image.tag}"])
    t1 = time.perf_counter()
    run_tool(["umoci", "unpack", "--image", f"{oci}:{image.tag}", str(bundle)])
    t2 = time.perf_counter()
    out = run_timed(chroot_argv(bundle / "rootfs", command), env=CHROOT_ENV)
    return {
        "first_output": out.first_output - t0, "seconds": out.exited - t0,
        "download": t1 - t0, "unpack": t2 - t1, "command": out.first_output - t2,
        "bytes_downloaded": image.compressed_bytes,
    }


def eager_section(images: Mapping[str, ImageInput], work: Path, trash: Trash, repeat: int, *,
                  first: bool = True, with_task: bool = True) -> tuple[dict[str, Any], Path]:
    """Every case eagerly (``first``); what each command opens; the task (``with_task``); and the python
    tree kept as the plain directory (returned; unpacked untimed when no case made it)."""
    base = work / "eager"
    cases = []
    n = 0
    kept = base / "plain-python"
    for tag, cmd in CASES:
        if tag not in images or not first:
            continue
        runs = []
        opened: dict[str, Any] = {}
        for i in range(repeat):
            n += 1
            dest = base / f"{n:03d}-{tag}-{cmd}"
            log(f"eager: {tag} {cmd} ({i + 1}/{repeat})")
            runs.append(eager_run(images[tag], COMMANDS[cmd], dest))
            if i == repeat - 1:
                opened = opened_files(dest / "bundle" / "rootfs", COMMANDS[cmd], work / "strace.log")
            if tag == "python" and not kept.exists():
                os.rename(dest, kept)
            else:
                trash.put(dest)
        cases.append({"image": tag, "command": cmd, "argv": list(COMMANDS[cmd]), "runs": runs,
                      "median": medians(runs), "opened": opened})
    rootfs = kept / "bundle" / "rootfs"
    if not kept.exists():
        log("plain directory: skopeo copy + umoci unpack of python")
        kept.mkdir(parents=True)
        run_tool(["skopeo", "copy", "-q", images["python"].src, f"oci:{kept / 'oci'}:python"])
        run_tool(["umoci", "unpack", "--image", f"{kept / 'oci'}:python", str(kept / "bundle")])
    if not with_task:
        return {"cases": cases}, rootfs
    task_runs, plain_cold, plain_hot = [], [], []
    for i in range(repeat):
        n += 1
        dest = base / f"{n:03d}-python-task"
        log(f"eager: python task ({i + 1}/{repeat})")
        task_runs.append(eager_run(images["python"], TASK, dest))
        trash.put(dest)
        drop_caches()
        t0 = time.perf_counter()
        out = run_timed(chroot_argv(rootfs, TASK), env=CHROOT_ENV)
        plain_cold.append({"seconds": out.exited - t0})
        t0 = time.perf_counter()
        out = run_timed(chroot_argv(rootfs, TASK), env=CHROOT_ENV)
        plain_hot.append({"seconds": out.exited - t0})
    task_opened = opened_files(rootfs, TASK, work / "strace.log")
    task = {"argv": list(TASK), "opened": task_opened,
            "eager": {"runs": task_runs, "median": medians(task_runs)},
            "plain_cold": {"runs": plain_cold, "median": medians(plain_cold)},
            "plain_hot": {"runs": plain_hot, "median": medians(plain_hot)}}
    return {"cases": cases, "task": task}, rootfs


def plain_read(rootfs: Path) -> dict[str, Any]:
    """Sequential reads of the plain (unpacked) tree: cold page cache, then warm."""
    files = regular_files(rootfs / READ_TREE)
    drop_caches()
    c0 = meminfo_cached()
    t0 = time.perf_counter()
    n = read_files(files)
    cold = time.perf_counter() - t0
    c1 = meminfo_cached()
    resident = resident_bytes(files)
    t0 = time.perf_counter()
    read_files(files)
    warm = time.perf_counter() - t0
    return {
        "files": len(files), "bytes": n,
        "passes": {"cold": pass_row(n, cold), "warm": pass_row(n, warm)},
        "page_cache": page_cache_row(n, c1 - c0, resident, 0),
    }


# -- layerbox hosts ----------------------------------------------------------------------------


@dataclass
class Ctx:
    kind: str  # "file" or "s3"
    path: str  # the daemon's data path: "fanotify" or "fuse"
    url: str
    work: Path
    hosts: Path
    mnt: Path
    trace_seconds: float
    n: int = 0

    @property
    def label(self) -> str:
        return f"{self.kind}/{self.path}"

    def fresh(self, label: str) -> tuple[Path, Path]:
        """A new host data dir and a new mount point."""
        self.n += 1
        root = self.hosts / f"{self.n:03d}-{label}"
        mp = self.mnt / f"{self.kind}-{self.path}-{self.n:03d}-{label}"
        mp.mkdir(parents=True)
        return root, mp

    def options(self, *, fill: bool = False, blob_io: str = "buffered") -> dict[str, Any]:
        """The daemon's flags: this data path; the background fill off unless asked for, so that
        every figure but the burst's "defaults" shows reads alone."""
        opts: dict[str, Any] = {"trace_seconds": self.trace_seconds, "fetch_timeout": 60.0,
                                "data_path": self.path, "blob_io": blob_io}
        if not fill:
            opts["fill_below"] = 0
        return opts


@contextlib.contextmanager
def host(ctx: Ctx, root: Path, *, fill: bool = False, blob_io: str = "buffered") -> Iterator[HostMounts]:
    """One host: its own data dir and daemon; everything unmounted and stopped however we leave."""
    hm = HostMounts(root, ctx.url, daemon_options=ctx.options(fill=fill, blob_io=blob_io))
    try:
        yield hm
    finally:
        try:
            hm.umount_all(stop_daemon=True)
        finally:
            for mp in kmount.mounts_under(root):
                kmount.umount(mp, lazy=True, missing_ok=True)
            remove_tree(root)


async def _resolve(url: str, data_dir: Path, name: str) -> Resolved:
    async with await Store.open(url, data_dir) as store:
        return await store.resolve(name)


def resolve(url: str, data_dir: Path, name: str) -> Resolved:
    return asyncio.run(_resolve(url, data_dir, name))


def stats(hm: HostMounts) -> dict[str, Any]:
    return dict(hm.client.request("GET", "/stats"))


STAT_KEYS = ("bytes_fetched", "bytes_served", "store_requests", "chunks_fetched", "misses", "hits",
             "chunks_prefetched")


def stat_delta(after: Mapping[str, Any], before: Mapping[str, Any] | None = None) -> dict[str, int]:
    return {k: int(after[k]) - int(before[k] if before else 0) for k in STAT_KEYS}


def lazy_run(ctx: Ctx, image: ImageInput, command: Sequence[str], *, prefetch: bool) -> dict[str, Any]:
    """A fresh host: resolve, start the daemon, [prefetch everything,] mount, run; empty caches."""
    root, mp = ctx.fresh(f"{'pf' if prefetch else 'lazy'}-{image.tag}")
    with host(ctx, root) as hm:
        drop_caches()
        t0 = time.perf_counter()
        resolved = resolve(ctx.url, root, image.name)
        t1 = time.perf_counter()
        hm.client.ensure_running(ctx.url, **hm.daemon_options)
        t2 = time.perf_counter()
        t3 = t2
        if prefetch:  # what `layerbox prefetch REF` does
            hm.client.request("POST", "/prefetch", {"image": resolved.digest,
                                                     "layers": [x.to_json() for x in resolved.layers]})
            t3 = time.perf_counter()
        hm.mount(resolved, mp, trace=False)
        t4 = time.perf_counter()
        out = run_timed(chroot_argv(mp, command), env=CHROOT_ENV)
        st = stats(hm)
    mp.rmdir()
    return {"first_output": out.first_output - t0, "seconds": out.exited - t0, "resolve": t1 - t0,
            "daemon": t2 - t1, "prefetch": t3 - t2, "mount": t4 - t3, "command": out.first_output - t4,
            **stat_delta(st)}


async def _store_facts(url: str, data_dir: Path, images: Mapping[str, ImageInput]) -> dict[str, Any]:
    """What a fresh host fetches besides chunks: ref, document, metadata images, pack indexes."""
    out: dict[str, Any] = {}
    async with await Store.open(url, data_dir) as store:

        async def size(key: str) -> int:
            info = await store.backend.head(key)
            return info.size if info is not None else 0

        for tag, image in images.items():
            resolved = await store.resolve(image.name, refresh=True)
            packs = sorted({p for layer in resolved.layers for p in layer.packs})
            meta = [await size(meta_key(layer.digest)) for layer in resolved.layers]
            index = [await size(index_key(p)) for p in packs]
            out[tag] = {"digest": resolved.digest, "doc_bytes": await size(doc_key(resolved.digest)),
                        "meta_bytes": sum(meta), "meta_raw_bytes": sum(x.meta_size for x in resolved.layers),
                        "index_bytes": sum(index), "packs": len(packs),
                        "blob_bytes": sum(x.blob_size for x in resolved.layers),
                        "chunks": sum(x.chunks for x in resolved.layers)}
            out[tag]["metadata_bytes"] = out[tag]["doc_bytes"] + sum(meta) + sum(index)
    return out


async def _publish_all(url: str, data_dir: Path, images: Mapping[str, ImageInput], work: Path
                       ) -> list[dict[str, Any]]:
    rows = []
    async with await Store.open(url, data_dir) as store:
        for image in images.values():
            log(f"publish {image.src} -> {image.name}")
            r = await publish(store, image.src, image.name, work_dir=work)
            image.files, image.file_bytes = r.files, r.bytes
            rows.append({"image": image.tag, "name": image.name, "digest": r.digest, "seconds": r.seconds,
                         "files": r.files, "file_bytes": r.bytes, "bytes_uploaded": r.bytes_uploaded,
                         "chunks_new": r.chunks_new, "requests": r.requests})
    return rows


async def _trace_state(url: str, data_dir: Path, digest: str, *, delete: bool = False) -> int | None:
    async with await Store.open(url, data_dir) as store:
        if delete:
            await store.backend.delete(trace_key(digest))
            return None
        info = await store.backend.head(trace_key(digest))
        return info.size if info is not None else None


def wait_settled(hm: HostMounts, timeout: float = SETTLE_TIMEOUT) -> dict[str, Any]:
    """Stats once no fetch is in flight and the counters stop moving (a replayed prefetch ended)."""
    deadline = time.monotonic() + timeout
    last = stats(hm)
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = stats(hm)
        if now["fetches_in_flight"] == 0 and not any(stat_delta(now, last).values()):
            return now
        last = now
    raise BenchError(f"the daemon of {hm.data_dir} was still fetching after {timeout:.0f} s")


def timed_task(ctx: Ctx, hm: HostMounts, root: Path, mp: Path, image: ImageInput, *, trace: bool
               ) -> tuple[dict[str, Any], str | None]:
    t0 = time.perf_counter()
    resolved = resolve(ctx.url, root, image.name)
    ta = time.perf_counter()
    hm.client.ensure_running(ctx.url, **hm.daemon_options)
    tb = time.perf_counter()
    result = hm.mount(resolved, mp, writable=True, trace=trace)
    t1 = time.perf_counter()
    out = run_timed(chroot_argv(mp, TASK), env=CHROOT_ENV)
    return {"seconds": out.exited - t0, "mount": t1 - t0, "daemon": tb - ta, "task": out.exited - t1,
            "without_daemon": out.exited - t0 - (tb - ta)}, result.trace


def replay_section(ctx: Ctx, image: ImageInput, digest: str) -> dict[str, Any]:
    """The task cold (recording a trace), on a second host with the trace, then cached and hot."""
    publisher = ctx.hosts / "publisher"
    asyncio.run(_trace_state(ctx.url, publisher, digest, delete=True))
    rows: dict[str, Any] = {}
    root, mp = ctx.fresh("replay-cold")
    with host(ctx, root) as hm:
        drop_caches()
        row, mode = timed_task(ctx, hm, root, mp, image, trace=True)
        row.update(stat_delta(stats(hm)), trace=mode)
        rows["cold"] = row
        log(f"[{ctx.label}] replay: cold task {row['seconds']:.2f} s; waiting for its trace")
        deadline = time.monotonic() + ctx.trace_seconds + TRACE_WAIT
        trace_bytes = None
        while trace_bytes is None and time.monotonic() < deadline:
            time.sleep(0.2)
            trace_bytes = asyncio.run(_trace_state(ctx.url, publisher, digest))
        if trace_bytes is None:
            raise BenchError(f"no access trace for {image.name} appeared in {ctx.url} within "
                             f"{ctx.trace_seconds + TRACE_WAIT:.0f} s of the cold run")
    mp.rmdir()
    root, mp = ctx.fresh("replay-trace")
    with host(ctx, root) as hm:
        drop_caches()
        row, mode = timed_task(ctx, hm, root, mp, image, trace=True)
        at_end = stats(hm)
        settled = wait_settled(hm)
        row.update(stat_delta(settled), trace=mode, at_task_end=stat_delta(at_end))
        rows["trace"] = row
        hm.umount(mp, discard=True)
        drop_caches()
        row, _ = timed_task(ctx, hm, root, mp, image, trace=False)
        now = stats(hm)
        row.update(stat_delta(now, settled))
        rows["cached"] = row
        hm.umount(mp, discard=True)
        row, _ = timed_task(ctx, hm, root, mp, image, trace=False)
        row.update(stat_delta(stats(hm), now))
        rows["hot"] = row
        hm.umount(mp, discard=True)
    mp.rmdir()
    return {"trace_seconds": ctx.trace_seconds, "trace_bytes": trace_bytes, **rows}


def page_cache_row(nbytes: int, cached_delta: int, files_resident: int, blob_resident: int) -> dict[str, Any]:
    """What one pass of ``nbytes`` left in the page cache: the files read and the blobs under
    them (fincore), and /proc/meminfo's Cached growth (system-wide)."""
    return {"bytes_read": nbytes, "cached_delta": cached_delta, "files_resident": files_resident,
            "blob_resident": blob_resident, "resident_per_byte": ratio(files_resident + blob_resident, nbytes),
            "cached_delta_per_byte": ratio(cached_delta, nbytes)}


def pass_row(nbytes: int, seconds: float) -> dict[str, Any]:
    return {"bytes": nbytes, "seconds": seconds, "mb_per_s": rate(nbytes, seconds)}


@dataclass
class ReadPeers:
    """The peers of the sequential reads, made once per store: the plain (unpacked) tree, a
    ``cp -a`` copy of it, and the image's layers as EROFS on fully materialized local blob files
    (the same metadata images, ``device=`` a plain local file) stacked as the mount stacks them."""

    plain: Path  # the unpacked rootfs
    copy: Path  # a root holding a `cp -a` copy of READ_TREE
    local: Path | None = None  # the overlay of the local-blob EROFS mounts (per store)
    local_bytes: int = 0  # bytes of the local blob files


def _slices(items: Sequence[Any], n: int) -> list[list[Any]]:
    """``items`` in ``n`` contiguous slices of near-equal length (some empty when too few)."""
    k, extra = divmod(len(items), n)
    out, at = [], 0
    for i in range(n):
        size = k + (1 if i < extra else 0)
        out.append(list(items[at : at + size]))
        at += size
    return out


def read_concurrently(slices: Sequence[Sequence[str]]) -> int:
    """Every slice read by its own thread at once (os.read releases the GIL)."""
    with concurrent.futures.ThreadPoolExecutor(len(slices)) as pool:
        return sum(pool.map(read_files, slices))


def timed_read(files: Sequence[str], readers: int = 1) -> tuple[int, float]:
    t0 = time.perf_counter()
    n = read_files(files) if readers == 1 else read_concurrently(_slices(files, readers))
    return n, time.perf_counter() - t0


def present_chunks(root: Path, resolved: Resolved) -> list[bytes]:
    """The chunks a host's blob files hold (asked of the files: SEEK_HOLE), in blob order, once each."""
    out: dict[bytes, None] = {}
    for layer in resolved.layers:
        hexd = layer.digest.removeprefix("blake3:")
        img = ErofsImage.open(root / "meta" / f"{hexd}.erofs")
        fd = os.open(root / "blobcache" / f"{hexd}.blob", os.O_RDONLY | os.O_CLOEXEC)
        try:
            for rec in sorted(img.blob_map, key=lambda r: r.block):
                start = rec.block * img.block_size
                if not any(True for _ in holes(fd, start, start + rec.length)):
                    out.setdefault(rec.digest, None)
        finally:
            os.close(fd)
    return list(out)


async def _raw_gets(url: str, data_dir: Path, resolved: Resolved, chunks: Sequence[bytes], loops: int
                    ) -> dict[str, Any]:
    """The store's own delivery: ``loops`` concurrent loops of ranged GETs (Store.read_pack_range)
    of these chunks' frames, adjacent frames merged as the fetcher merges them (<= 4 MiB per GET),
    each loop one contiguous slice of ``chunks``; no decoding, no verifying, nothing written."""
    async with await Store.open(url, data_dir) as store:
        for layer in resolved.layers:
            await store.load_layer_locations(layer)
        plans = [plan_runs(_located(store, part, resolved.digest, url)) for part in _slices(chunks, loops)]

        async def loop(runs: Sequence[Any]) -> int:
            n = 0
            for run in runs:
                n += len(await store.read_pack_range(run.pack, run.start, run.end))
            return n

        await asyncio.to_thread(drop_caches)  # the pack files (file://) must not be in the page cache
        t0 = time.perf_counter()
        got = await asyncio.gather(*(loop(runs) for runs in plans))
        seconds = time.perf_counter() - t0
    return {"loops": loops, "chunks": len(chunks), "requests": sum(len(p) for p in plans), "bytes": sum(got),
            "seconds": seconds, "mb_per_s": rate(sum(got), seconds)}


def raw_gets(ctx: Ctx, resolved: Resolved, chunks: Sequence[bytes], loops: int) -> dict[str, Any]:
    root = ctx.hosts / f"raw-{ctx.n:03d}"
    try:
        return asyncio.run(_raw_gets(ctx.url, root, resolved, chunks, loops))
    finally:
        remove_tree(root)


def cold_pass(ctx: Ctx, image: ImageInput, readers: int) -> dict[str, Any]:
    """A fresh host (fill off), page cache dropped: /READ_TREE read by ``readers`` threads at once;
    then the same chunks fetched by as many raw ranged-GET loops."""
    root, mp = ctx.fresh(f"cold{readers}")
    with host(ctx, root) as hm:
        resolved = resolve(ctx.url, root, image.name)
        hm.mount(resolved, mp, trace=False)
        files = regular_files(mp / READ_TREE)
        drop_caches()
        before = stats(hm)
        n, seconds = timed_read(files, readers)
        row: dict[str, Any] = {"readers": readers, **pass_row(n, seconds), **stat_delta(stats(hm), before)}
        hm.umount(mp)
        chunks = present_chunks(root, resolved)
        row["fetched_mb_per_s"] = rate(row["bytes_fetched"], seconds)
        row["raw"] = raw_gets(ctx, resolved, chunks, readers)
        row["vs_raw"] = ratio(row["fetched_mb_per_s"], row["raw"]["mb_per_s"])
    mp.rmdir()
    return row


# -- cold reads against the decode ceiling (issue 27) -------------------------------------------


def cold_files(mp: Path) -> list[str]:
    """The mounted image's regular files of at least ``COLD_MIN_SIZE`` bytes, each inode once, sorted."""
    return [f for f in regular_files(mp) if os.path.getsize(f) >= COLD_MIN_SIZE]


def file_chunks(root: Path, resolved: Resolved, rel: Sequence[str]) -> list[bytes]:
    """The chunk digests holding these files' data (relative paths in the mounted image), in read
    order, once each: each file from the topmost layer that has it, as the overlay shows it."""
    images = [ErofsImage.open(root / "meta" / f"{layer.digest.removeprefix('blake3:')}.erofs")
              for layer in resolved.layers]
    out: dict[bytes, None] = {}
    for path in rel:
        for img in reversed(images):  # the last layer is the top one
            try:
                nid = img.lookup(path)
            except FileNotFoundError:
                continue
            for c in img.chunks(nid):
                if c.digest is None:
                    raise BenchError(f"{path}: a chunk at {c.file_offset} is not in the layer's blob map")
                out.setdefault(c.digest, None)
            break
        else:
            raise BenchError(f"{path} is in no layer of {resolved.digest}")
    return list(out)



def _located(store: Any, digests: Sequence[bytes], image: str, url: str) -> list[tuple[bytes, Any]]:
    """Each chunk with its place in the store's packs (the layers' locations loaded)."""
    wanted = []
    for digest in digests:
        loc = store.locate(digest)
        if loc is None:
            raise BenchError(f"chunk {digest.hex()} of {image} is in no pack index of {url}")
        wanted.append((digest, loc))
    return wanted

async def _frames(url: str, data_dir: Path, resolved: Resolved, chunks: Sequence[bytes]
                  ) -> list[tuple[bytes, bytes, int]]:
    """(digest, compressed frame, raw length) of each chunk, fetched from the store once (untimed)."""
    async with await Store.open(url, data_dir) as store:
        for layer in resolved.layers:
            await store.load_layer_locations(layer)
        out = []
        for run in plan_runs(_located(store, chunks, resolved.digest, url)):
            data = await store.read_pack_range(run.pack, run.start, run.end)
            for digest, loc in run.items:
                out.append((digest, data[loc.offset - run.start : loc.offset - run.start + loc.length],
                            loc.raw_length))
        return out


def _decode_part(part: Sequence[tuple[bytes, bytes, int]]) -> int:
    n = 0
    for digest, frame, raw_length in part:
        chunk = decompress(frame, raw_length)
        if blake3.blake3(chunk).digest() != digest:
            raise BenchError(f"chunk {digest.hex()} does not match its digest")
        n += len(chunk)
    return n


def decode_ceiling(frames: Sequence[tuple[bytes, bytes, int]], rounds: int = 3) -> dict[str, Any]:
    """Decompress + blake3 of these chunks from memory on every core (one thread per core, zstandard
    and blake3 release the GIL): no I/O. The best of ``rounds`` (the machine's limit, not its noise)."""
    threads = os.cpu_count() or 1
    parts = [list(frames[i::threads]) for i in range(threads)]
    best, n = math.inf, 0
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for _ in range(rounds):
            t0 = time.perf_counter()
            n = sum(pool.map(_decode_part, parts))
            best = min(best, time.perf_counter() - t0)
    return {"threads": threads, "chunks": len(frames), "bytes": n, "compressed_bytes": sum(len(f) for _, f, _ in frames),
            "seconds": best, "mb_per_s": rate(n, best)}


def cold_decode_pass(ctx: Ctx, image: ImageInput, readers: int) -> dict[str, Any]:
    """A fresh host (fill off), page cache dropped: the files >= COLD_MIN_SIZE read by ``readers``
    threads at once; then, in the same run, the decode ceiling of exactly their chunks."""
    root, mp = ctx.fresh(f"colddec{readers}")
    with host(ctx, root) as hm:
        resolved = resolve(ctx.url, root, image.name)
        hm.mount(resolved, mp, trace=False)
        files = cold_files(mp)
        rel = [os.path.relpath(f, mp) for f in files]
        drop_caches()
        before = stats(hm)
        n, seconds = timed_read(files, readers)
        row: dict[str, Any] = {"readers": readers, "files": len(files), **pass_row(n, seconds),
                               **stat_delta(stats(hm), before)}
        # the data path alone: mounted again (EROFS's page cache gone), every chunk in the blob
        # files and those in memory, so nothing is fetched or decoded
        hm.umount(mp)
        hm.mount(resolved, mp, trace=False)
        n, seconds = timed_read(files, readers)
        row["remount"] = pass_row(n, seconds)
        hm.umount(mp)
        frames = asyncio.run(_frames(ctx.url, root, resolved, file_chunks(root, resolved, rel)))
    mp.rmdir()
    row["ceiling"] = decode_ceiling(frames)
    row["vs_ceiling"] = ratio(row["mb_per_s"], row["ceiling"]["mb_per_s"])
    return row


def cold_section(ctx: Ctx, image: ImageInput, readers: int, repeat: int) -> dict[str, Any]:
    """``repeat`` rounds of the cold read with 1 and with ``readers`` readers, each against the
    ceiling measured right after it; medians of the ratios."""
    out: dict[str, Any] = {}
    for key, n in (("one", 1), ("many", readers)):
        runs = []
        for i in range(repeat):
            log(f"[{ctx.label}] cold read of files >= {COLD_MIN_SIZE >> 10} KiB, {n} reader(s), and the "
                f"decode ceiling ({i + 1}/{repeat})")
            runs.append(cold_decode_pass(ctx, image, n))
        out[key] = {"readers": n, "runs": runs,
                    "mb_per_s": statistics.median(r["mb_per_s"] for r in runs),
                    "remount_mb_per_s": statistics.median(r["remount"]["mb_per_s"] for r in runs),
                    "ceiling_mb_per_s": statistics.median(r["ceiling"]["mb_per_s"] for r in runs),
                    "vs_ceiling": statistics.median(r["vs_ceiling"] for r in runs)}
    return out


def served_blobs(ctx: Ctx, root: Path, resolved: Resolved) -> list[Path]:
    """The files holding a host's layer data: its blob files (fuse: and the FUSE files EROFS reads,
    whose page cache is apart from the blob cache's)."""
    hexes = [layer.digest.removeprefix("blake3:") for layer in resolved.layers]
    blobs = [root / "blobcache" / f"{h}.blob" for h in hexes]
    if ctx.path == "fuse":
        blobs += [root / "blobs" / h for h in hexes]
    return blobs


def direct_pass(ctx: Ctx, image: ImageInput) -> dict[str, Any]:
    """A host with ``--blob-io direct``: /READ_TREE read once (every chunk fetched), then again
    with the page cache dropped: its speed, and the page cache it leaves."""
    root, mp = ctx.fresh("direct")
    with host(ctx, root, blob_io="direct") as hm:
        resolved = resolve(ctx.url, root, image.name)
        hm.mount(resolved, mp, trace=False)
        files = regular_files(mp / READ_TREE)
        timed_read(files)
        drop_caches()
        c0 = meminfo_cached()
        n, seconds = timed_read(files)
        c1 = meminfo_cached()
        files_res, blob_res = resident_bytes(files), resident_bytes(served_blobs(ctx, root, resolved))
        hm.umount(mp)
    mp.rmdir()
    return {**pass_row(n, seconds), "page_cache": page_cache_row(n, c1 - c0, files_res, blob_res)}


def read_and_mount_section(ctx: Ctx, image: ImageInput, peers: ReadPeers, *, rounds: int, readers: int,
                           mounts: int | None) -> dict[str, Any]:
    """Sequential reads of /usr through the mount from an empty host (one reader, then ``readers``)
    against raw GET loops; with every chunk on the host and the page cache dropped, against the
    same EROFS on local blob files and the plain trees; the page cache they use; mount times."""
    log(f"[{ctx.label}] cold sequential read, 1 reader, and raw GETs")
    cold = cold_pass(ctx, image, 1)
    log(f"[{ctx.label}] cold read, {readers} readers, and {readers} raw GET loops")
    cold_many = cold_pass(ctx, image, readers)
    root, mp = ctx.fresh("read")
    with host(ctx, root) as hm:
        resolved = resolve(ctx.url, root, image.name)
        hm.mount(resolved, mp, trace=False)
        files = regular_files(mp / READ_TREE)
        rel = [os.path.relpath(f, mp) for f in files]
        trees = {"mount": mp, "local_blob": peers.local, "plain": peers.plain, "copy": peers.copy}
        lists = {k: [os.path.join(v, r) for r in rel] for k, v in trees.items() if v is not None}
        passes: dict[str, Any] = {}
        drop_caches()
        before = stats(hm)
        n, seconds = timed_read(files)
        passes["store"] = {**pass_row(n, seconds), **stat_delta(stats(hm), before)}
        drop_caches()
        c0 = meminfo_cached()
        before = stats(hm)
        n, seconds = timed_read(files)
        passes["cached"] = {**pass_row(n, seconds), **stat_delta(stats(hm), before)}
        c1 = meminfo_cached()
        files_res = resident_bytes(files)
        blob_res = resident_bytes(served_blobs(ctx, root, resolved))
        before = stats(hm)
        n, seconds = timed_read(files)
        passes["warm"] = {**pass_row(n, seconds), **stat_delta(stats(hm), before)}
        page_cache = page_cache_row(n, c1 - c0, files_res, blob_res)
        # unmounting the layers drops EROFS's page cache; the blob files stay in memory, so
        # this pass costs only the data path (fanotify marks or FUSE) and EROFS
        hm.umount(mp)
        hm.mount(resolved, mp, trace=False)
        before = stats(hm)
        n, seconds = timed_read(files)
        passes["remount"] = {**pass_row(n, seconds), **stat_delta(stats(hm), before)}
        # every chunk on the host, the page cache dropped: the mount and its peers in turns
        log(f"[{ctx.label}] re-reads, page cache dropped: mount vs local-blob EROFS vs plain dirs, {rounds} round(s)")
        seconds_by: dict[str, list[float]] = {k: [] for k in lists}
        bytes_by: dict[str, int] = {}
        for _ in range(rounds):
            for key, paths in lists.items():
                drop_caches()
                bytes_by[key], t = timed_read(paths)
                seconds_by[key].append(t)
        reread = {k: pass_row(bytes_by[k], statistics.median(v)) for k, v in seconds_by.items()}
        for key in reread:
            reread[key]["runs"] = seconds_by[key]
        mine = reread["mount"]["mb_per_s"]
        reread_ratios = {k: ratio(mine, reread[k]["mb_per_s"]) for k in reread if k != "mount"}
        hm.umount(mp)
        times = None
        if mounts:
            log(f"[{ctx.label}] mount times: {mounts} x 4 variants")
            times = mount_times(hm, resolved, mp, ctx.mnt / f"{ctx.kind}-{ctx.path}-holder", mounts)
    mp.rmdir()
    log(f"[{ctx.label}] --blob-io direct: re-read, page cache dropped, and the page cache it leaves")
    direct = direct_pass(ctx, image)
    direct["vs_buffered"] = ratio(direct["mb_per_s"], reread["mount"]["mb_per_s"])
    return {"files": len(files), "bytes": n, "passes": passes, "page_cache": page_cache, "direct": direct,
            "cold": {"one": cold, "many": cold_many},
            "reread": {"rounds": rounds, "methods": reread, "ratios": reread_ratios},
            "mount_times": times}


def _write_blob(path: Path, size: int, pieces: Sequence[tuple[int, bytes]]) -> None:
    with path.open("wb") as f:
        f.truncate(size)
        for offset, data in pieces:
            f.seek(offset)
            f.write(data)


async def _materialize(url: str, data_dir: Path, resolved: Resolved, dest: Path) -> list[tuple[Path, Path]]:
    """Each layer's metadata image and its blob as a plain local file (in ``dest``), every chunk
    fetched from the store, verified and written at its place: what a fully pulled host holds."""
    out = []
    async with await Store.open(url, data_dir) as store:
        for layer in resolved.layers:
            hexd = layer.digest.removeprefix("blake3:")
            meta, blob = dest / f"{hexd}.erofs", dest / f"{hexd}.blob"
            raw = await store.get_meta(layer.digest)
            await asyncio.to_thread(meta.write_bytes, raw)
            img = ErofsImage(raw, str(meta))
            await store.load_layer_locations(layer)
            pieces = [(rec.block * img.block_size, await store.read_chunk(rec.digest)) for rec in img.blob_map]
            await asyncio.to_thread(_write_blob, blob, padded(img.blob_size), pieces)
            out.append((meta, blob))
    return out


@contextlib.contextmanager
def read_peers(ctx: Ctx, image: ImageInput, rootfs: Path, local: bool) -> Iterator[ReadPeers]:
    """The plain tree, its `cp -a` copy and (``local``) the local-blob EROFS view, unmounted after."""
    copy = ctx.work / "plain-copy"
    if not (copy / READ_TREE).exists():
        log(f"cp -a of /{READ_TREE} of the plain tree")
        copy.mkdir(exist_ok=True)
        run_tool(["cp", "-a", str(rootfs / READ_TREE), str(copy / READ_TREE)])
    peers = ReadPeers(rootfs, copy)
    made: list[Path] = []
    try:
        if local:
            log(f"[{ctx.kind}] local blob files of {image.name} (every chunk from the store)")
            resolved = resolve(ctx.url, ctx.hosts / "publisher", image.name)
            (ctx.work / "localblob").mkdir()
            files = asyncio.run(_materialize(ctx.url, ctx.hosts / "publisher", resolved, ctx.work / "localblob"))
            lowers = []
            for i, (meta, blob) in enumerate(files):
                mp = ctx.mnt / f"{ctx.kind}-localblob-{i}"
                mp.mkdir(parents=True)
                kmount.mount_erofs(meta, mp, blob, flags=HostMounts.LAYER_FLAGS)
                made.append(mp)
                lowers.append(str(mp))
            view = ctx.mnt / f"{ctx.kind}-localblob-view"
            view.mkdir()
            kmount.mount_overlay(lowers, view, flags=HostMounts.VIEW_FLAGS)
            made.append(view)
            peers.local = view
            peers.local_bytes = sum(blob.stat().st_size for _, blob in files)
        yield peers
    finally:
        for mp in reversed(made):
            kmount.umount(mp, missing_ok=True)
            mp.rmdir()
        remove_tree(ctx.work / "localblob")


def layerbox_program() -> str:
    """The installed `layerbox` entry point beside this Python (pip install -e .)."""
    program = shutil.which("layerbox", path=str(Path(sys.executable).parent)) or shutil.which("layerbox")
    if program is None:
        raise BenchError("the layerbox command is not installed: make venv (pip install -e .)")
    return program


def layerbox_cli(ctx: Ctx, root: Path, *args: str) -> float:
    """Run ``layerbox ARGS`` (tools/cli.py, a new Python process as a user's shell would start) for
    this host; its wall time."""
    argv = [layerbox_program(), args[0], "--store", ctx.url, "--data-dir", str(root),
            "--data-path", ctx.path, "--fill-below", "0", *args[1:]]
    t0 = time.perf_counter()
    run_tool(argv, timeout=COMMAND_TIMEOUT)
    return time.perf_counter() - t0


def start_section(ctx: Ctx, image: ImageInput, repeat: int) -> dict[str, Any]:
    """`layerbox mount` on a fresh host, which starts the daemon and its holder, against the same
    first mount with the daemon already running (`layerbox daemon start` before, untimed), and a
    second mount of the image once the host knows its layers."""
    runs = []
    for i in range(repeat):
        log(f"[{ctx.label}] daemon first start ({i + 1}/{repeat})")
        row: dict[str, float] = {}
        root, mp = ctx.fresh("start")
        with host(ctx, root) as hm:
            drop_caches()
            row["fresh_host"] = layerbox_cli(ctx, root, "mount", image.name, str(mp))
            hm.umount(mp)
            row["again"] = layerbox_cli(ctx, root, "mount", image.name, str(mp))
            hm.umount(mp)
        mp.rmdir()
        root, mp = ctx.fresh("running")
        with host(ctx, root) as hm:
            row["daemon_start"] = layerbox_cli(ctx, root, "daemon", "start")
            drop_caches()
            row["daemon_running"] = layerbox_cli(ctx, root, "mount", image.name, str(mp))
            hm.umount(mp)
        mp.rmdir()
        runs.append(row)
    m = medians(runs)
    return {"runs": runs, "median": m, "first_over_running": ratio(m["fresh_host"], m["daemon_running"])}


# -- burst: N sandboxes over several workspace images on one base and toolkit -----------------

BURST_RUNNER = """#!/bin/sh
# the toolkit's test runner: a project's unittest suite, quietly
cd "$1" && exec python3 -m unittest discover -q -s tests -t .
"""
BURST_MODULE = '''"""{name}: a small library with a real test suite (generated by bench/lazy.py)."""
import hashlib
import json
import re
import sqlite3
from collections import Counter
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "data"
SEED = {seed}


def words(text):
    return re.findall(r"[a-z]+", text.lower())


def top_words(n=10):
    c = Counter()
    for path in sorted(DATA.glob("*.txt")):
        c.update(words(path.read_text()))
    return sorted(c.items(), key=lambda x: (-x[1], x[0]))[:n]


def digests():
    return {{p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(DATA.glob("*.txt"))}}


def primes(limit):
    sieve = bytearray([1]) * (limit + 1)
    sieve[0:2] = b"\\0\\0"
    for i in range(2, int(limit ** 0.5) + 1):
        if sieve[i]:
            sieve[i * i :: i] = bytearray(len(sieve[i * i :: i]))
    return [i for i, v in enumerate(sieve) if v]


def table_sums(rows):
    db = sqlite3.connect(":memory:")
    db.execute("create table t (k text, v integer)")
    db.executemany("insert into t values (?, ?)", rows)
    return dict(db.execute("select k, sum(v) from t group by k order by k"))


def roundtrip(obj):
    return json.loads(json.dumps(obj, sort_keys=True))
'''
BURST_TESTS = '''import json
import unittest
from pathlib import Path

from {name} import lib

MANIFEST = json.loads((Path(__file__).resolve().parent.parent / "manifest.json").read_text())


class DataTest(unittest.TestCase):
    def test_digests(self):
        self.assertEqual(lib.digests(), MANIFEST["digests"])

    def test_top_words(self):
        self.assertEqual([list(x) for x in lib.top_words(5)], MANIFEST["top"])


class ComputeTest(unittest.TestCase):
    def test_primes(self):
        self.assertEqual(len(lib.primes(200000)), 17984)

    def test_sums(self):
        rows = [(chr(97 + i % 7), i + lib.SEED) for i in range(5000)]
        sums = lib.table_sums(rows)
        self.assertEqual(sum(sums.values()), sum(v for _, v in rows))

    def test_roundtrip(self):
        obj = {{"seed": lib.SEED, "xs": list(range(1000)), "s": "\\u00e9" * 10}}
        self.assertEqual(lib.roundtrip(obj), obj)
'''


@dataclass
class BurstInputs:
    images: list[str]  # the compositions' refs in the store (one per workspace)
    tags: list[str]  # the same images as OCI tags in the layout (what eager pulls)
    projects: list[str]  # /workspace/<project> of each
    layer_bytes: dict[str, int]  # tar bytes of the toolkit and of each workspace
    warmup: tuple[str, str] = ("", "")  # another workspace on the same base and toolkit: (ref, project)


def _tar_tree(path: Path, files: Mapping[str, bytes], modes: Mapping[str, int] | None = None) -> int:
    """A layer tarball of ``files`` (their parent directories included)."""
    dirs = sorted({"/".join(name.split("/")[:i]) for name in files for i in range(1, name.count("/") + 1)})
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 1_700_000_000
            tar.addfile(info)
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), (modes or {}).get(name, 0o644), 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
    return path.stat().st_size


def _workspace_files(k: int, data_bytes: int) -> tuple[str, dict[str, bytes]]:
    """Project ``k``: a package, its unittest suite and text data the tests read in full."""
    name = f"proj{k}"
    rng = random.Random(7000 + k)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9)))
             for _ in range(3000)]
    base = f"workspace/{name}"
    files: dict[str, bytes] = {}
    per = max(data_bytes // 8, 1)
    for i in range(8):
        out, n = [], 0
        while n < per:
            line = " ".join(rng.choice(vocab) for _ in range(12)) + "\n"
            out.append(line)
            n += len(line)
        files[f"{base}/data/part-{i}.txt"] = "".join(out).encode()
    counts: dict[str, int] = {}
    for data in files.values():
        for w in re.findall(r"[a-z]+", data.decode().lower()):
            counts[w] = counts.get(w, 0) + 1
    top = sorted(counts.items(), key=lambda x: (-x[1], x[0]))[:5]
    manifest = {"digests": {p.rsplit("/", 1)[1]: hashlib.sha256(d).hexdigest() for p, d in sorted(files.items())},
                "top": [[w, c] for w, c in top]}
    files[f"{base}/manifest.json"] = json.dumps(manifest).encode()
    files[f"{base}/{name}/__init__.py"] = b""
    files[f"{base}/{name}/lib.py"] = BURST_MODULE.format(name=name, seed=k).encode()
    files[f"{base}/tests/__init__.py"] = b""
    files[f"{base}/tests/test_{name}.py"] = BURST_TESTS.format(name=name).encode()
    return name, files


async def _publish_burst(url: str, data_dir: Path, parts: Mapping[str, Path], compositions: Mapping[str, str],
                         work: Path) -> None:
    async with await Store.open(url, data_dir) as store:
        for name, src in parts.items():
            await publish(store, str(src), name, work_dir=work)
        for name, ws in compositions.items():
            await store.compose(name, {"base": "bench/python", "workspace": ws, "toolkit": "bench/burst-toolkit"})


def prepare_burst(work: Path, layout: Path, url: str, publisher: Path, workspaces: int, data_bytes: int
                  ) -> BurstInputs:
    """The toolkit and ``workspaces`` workspace layers, as OCI images on python in the layout (what
    eager pulls) and as compositions (base = bench/python, workspace, toolkit) in the store."""
    src = work / "burst-src"
    src.mkdir(exist_ok=True)
    runner = "opt/toolkit/bin/run-tests"
    layer_bytes = {"toolkit": _tar_tree(src / "toolkit.tar", {runner: BURST_RUNNER.encode()}, {runner: 0o755})}
    parts: dict[str, Path] = {"bench/burst-toolkit": src / "toolkit.tar"}
    compositions: dict[str, str] = {}
    inputs = BurstInputs([], [], [], layer_bytes)
    index = json.loads((layout / "index.json").read_text())
    have = {m.get("annotations", {}).get("org.opencontainers.image.ref.name") for m in index["manifests"]}
    for k in range(workspaces):
        project, files = _workspace_files(k, data_bytes)
        tar = src / f"ws{k}.tar"
        layer_bytes[project] = _tar_tree(tar, files)
        parts[f"bench/burst-ws{k}"] = tar
        compositions[f"bench/burst-{k}"] = f"bench/burst-ws{k}"
        tag = f"burst-{k}"
        if tag not in have:  # a second store (s3) reuses the first one's
            run_tool(["umoci", "raw", "add-layer", "--image", f"{layout}:python", "--tag", f"{tag}-ws", str(tar)])
            run_tool(["umoci", "raw", "add-layer", "--image", f"{layout}:{tag}-ws", "--tag", tag,
                      str(src / "toolkit.tar")])
        inputs.images.append(f"bench/burst-{k}")
        inputs.tags.append(tag)
        inputs.projects.append(project)
    # the fleet's earlier use of the base and toolkit (burst_warmup): a workspace of its own
    project, files = _workspace_files(workspaces, data_bytes)
    _tar_tree(src / "ws-warmup.tar", files)
    parts["bench/burst-ws-warmup"] = src / "ws-warmup.tar"
    compositions["bench/burst-warmup"] = "bench/burst-ws-warmup"
    inputs.warmup = ("bench/burst-warmup", project)
    log(f"burst: publish the toolkit and {workspaces} workspaces (and a warm-up's), compose {workspaces + 1} images")
    convert_dir = work / "convert"
    convert_dir.mkdir(exist_ok=True)
    asyncio.run(_publish_burst(url, publisher, parts, compositions, convert_dir))
    return inputs


def block_device(path: Path) -> str | None:
    """/sys/dev/block/MAJ:MIN of the device holding ``path`` (None on a virtual filesystem)."""
    st = os.stat(path)
    dev = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    return dev if os.path.exists(f"{dev}/stat") else None


def disk_written(device: str | None) -> int | None:
    """Bytes written to ``device`` since boot (sectors written, field 7 of its stat, x 512), after a sync."""
    if device is None:
        return None
    run_tool(["sync"])
    with open(f"{device}/stat") as f:
        return int(f.read().split()[6]) * 512


def allocated(path: Path) -> int:
    """Bytes the files under ``path`` occupy on its filesystem (st_blocks; each inode once), not
    crossing into mounts below it (the layers' EROFS, the FUSE blob files: views, not disk)."""
    dev = os.lstat(path).st_dev
    seen: set[int] = set()
    total = 0
    for top, dirs, files in os.walk(path):
        keep = []
        for name in [*dirs, *files]:
            try:
                st = os.lstat(os.path.join(top, name))
            except FileNotFoundError:
                continue
            if st.st_dev != dev:
                continue
            if name in dirs:
                keep.append(name)
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_blocks * 512
        dirs[:] = [d for d in dirs if d in keep]
    return total


def burst_command(project: str) -> tuple[str, ...]:
    return ("/opt/toolkit/bin/run-tests", f"/workspace/{project}")


def burst_run(label: str, n: int, parallel: int, images: int, device: str | None, where: Path,
              prepare: Callable[[], None], one: Callable[[int, int], dict[str, Any]],
              settle: Callable[[], float] | None = None) -> dict[str, Any]:
    """``n`` sandboxes (image i mod ``images``), ``parallel`` at a time, timed from the first start to
    the last exit; the device's bytes written over the whole burst (a sync before and after), and
    what the files under ``where`` (the host's data) grew by on disk.  ``settle`` (after the last
    exit: wait for the host's background work to end, return how long that took) adds the same
    two figures once it returned, so work a host does after the burst is not missed."""
    log(f"burst: {label}: {n} sandboxes, {parallel} at a time")
    drop_caches()
    a0 = allocated(where) if where.exists() else 0
    w0 = disk_written(device)
    t0 = time.perf_counter()
    prepare()
    with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
        runs = list(pool.map(one, range(n), [i % images for i in range(n)]))
    seconds = time.perf_counter() - t0
    w1 = disk_written(device)
    row = {"label": label, "sandboxes": n, "parallel": parallel, "seconds": seconds,
           "disk_written": None if w0 is None or w1 is None else w1 - w0, "allocated": allocated(where) - a0,
           "sandbox": distribution([r["seconds"] for r in runs]), "runs": runs}
    if settle is not None:
        row["settle_seconds"] = settle()
        w2 = disk_written(device)
        row["disk_written_settled"] = None if w0 is None or w2 is None else w2 - w0
        row["allocated_settled"] = allocated(where) - a0
    return row


BURST_SETTLE_MAX = 300.0  # seconds the defaults host gets to finish its background fill after a burst


def settle_fill(hm: HostMounts) -> float:
    """Wait until the daemon fills no layer and fetches nothing (at most ``BURST_SETTLE_MAX`` s)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < BURST_SETTLE_MAX:
        st = stats(hm)
        if st["fetches_in_flight"] == 0 and "filling" not in st.get("fill_per_layer", {}).values():
            break
        time.sleep(0.5)
    return time.perf_counter() - t0


def burst_lazy(ctx: Ctx, hm: HostMounts, inputs: BurstInputs, n: int, parallel: int, device: str | None,
               label: str, *, defaults: bool = False) -> dict[str, Any]:
    """A burst of writable lazy mounts on the host ``hm`` (its daemon started by the first mount);
    ``defaults``: mounts as `layerbox mount` makes them (access traces recorded and replayed), and the
    figures again once the background fill the daemon's default policy started has ended."""
    resolved: dict[int, Resolved] = {}
    root = hm.data_dir
    before = stats(hm) if hm.client.health() else None
    # the daemon is a host service, running before any burst (as on a cached host): its start-up
    # is its own figure, not the first sandbox's (0 on a host where it runs already)
    t0 = time.perf_counter()
    hm.start_daemon()
    daemon_start = time.perf_counter() - t0 if before is None else 0.0

    def prepare() -> None:  # the refs, once per image (a host's metadata cache is one LMDB)
        for k, name in enumerate(inputs.images):
            resolved[k] = resolve(ctx.url, root, name)

    def one(i: int, k: int) -> dict[str, Any]:
        mp = ctx.mnt / f"burst-{ctx.kind}-{ctx.path}-{i:03d}"
        mp.mkdir(exist_ok=True)
        mine = HostMounts(root, ctx.url, daemon_options=hm.daemon_options)
        t0 = time.perf_counter()
        mine.mount(resolved[k], mp, writable=True, trace=defaults)
        try:
            out = run_timed(chroot_argv(mp, burst_command(inputs.projects[k])), env=CHROOT_ENV)
        finally:
            mine.umount(mp, discard=True)
        mp.rmdir()
        return {"image": k, "seconds": out.exited - t0}

    row = burst_run(label, n, parallel, len(inputs.images), device, root, prepare, one,
                    (lambda: settle_fill(hm)) if defaults else None)
    row["daemon_start_seconds"] = daemon_start
    after = stats(hm)
    row.update(stat_delta(after, before))
    row["layers_filled"] = after["layers_filled"] - (before["layers_filled"] if before else 0)
    return row


WARMUP_WAIT = 30.0  # seconds past the trace window for the warm-up host's traces to reach the store


def burst_warmup(ctx: Ctx, hm: HostMounts, inputs: BurstInputs) -> dict[str, Any]:
    """Another host of the fleet ran a task of another workspace on the same base and toolkit
    earlier: one sandbox of ``inputs.warmup``, its access traces recorded as `layerbox mount`
    records them, then waited for until the store holds a trace of each of its layers.  The
    defaults row's first mounts (new images: no trace of their own) replay the base's and the
    toolkit's; the fill-off and cached rows never read traces."""
    ref, project = inputs.warmup
    log(f"burst: warm-up [{ctx.label}]: one sandbox of {ref} on another host, its traces stored")
    resolved = resolve(ctx.url, hm.data_dir, ref)
    mp = ctx.mnt / f"burst-{ctx.kind}-{ctx.path}-warmup"
    mp.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    hm.mount(resolved, mp, writable=True, trace=True)
    try:
        run_timed(chroot_argv(mp, burst_command(project)), env=CHROOT_ENV)
    finally:
        hm.umount(mp, discard=True)
    mp.rmdir()
    seconds = time.perf_counter() - t0
    layers = [x.digest for x in resolved.layers]
    deadline = time.monotonic() + ctx.trace_seconds + WARMUP_WAIT
    stored: list[str] = []
    while time.monotonic() < deadline:
        stored = asyncio.run(_traces_stored(ctx.url, hm.data_dir, layers))
        if len(stored) == len(layers):
            break
        time.sleep(0.5)
    if not stored:
        raise RuntimeError(f"the warm-up host stored no layer trace of {ref} within "
                           f"{ctx.trace_seconds + WARMUP_WAIT:.0f} s")
    return {"image": ref, "seconds": seconds, "layers": len(layers), "layer_traces": len(stored)}


async def _traces_stored(url: str, data_dir: Path, digests: Sequence[str]) -> list[str]:
    async with await Store.open(url, data_dir) as store:
        return [d for d in digests if await store.get_trace(d) is not None]


def burst_eager(work: Path, mnt: Path, inputs: BurstInputs, layout: Path, n: int, parallel: int,
                device: str | None) -> dict[str, Any]:
    """The same burst, eagerly: each image pulled once (`skopeo copy` into one OCI layout for the host,
    so shared blobs are copied once) and unpacked once (`umoci unpack`) by the first sandbox that needs
    it, the others waiting; every sandbox on a writable overlay of its image's unpacked rootfs."""
    base = work / "burst-eager"
    oci = base / "oci"
    base.mkdir()
    pull_lock = threading.Lock()  # one writer of the layout's index.json at a time
    image_locks = [threading.Lock() for _ in inputs.images]
    pulled: dict[int, dict[str, float]] = {}

    def rootfs(k: int) -> Path:
        with image_locks[k]:
            if k not in pulled:
                t0 = time.perf_counter()
                with pull_lock:
                    run_tool(["skopeo", "copy", "-q", f"oci:{layout}:{inputs.tags[k]}", f"oci:{oci}:{inputs.tags[k]}"])
                t1 = time.perf_counter()
                run_tool(["umoci", "unpack", "--image", f"{oci}:{inputs.tags[k]}", str(base / f"bundle-{k}")])
                pulled[k] = {"download": t1 - t0, "unpack": time.perf_counter() - t1}
        return base / f"bundle-{k}" / "rootfs"

    def one(i: int, k: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        lower = rootfs(k)
        mp = mnt / f"burst-eager-{i:03d}"
        up = base / f"upper-{i:03d}"
        mp.mkdir(exist_ok=True)
        (up / "upper").mkdir(parents=True)
        (up / "work").mkdir()
        kmount.mount_overlay([lower], mp, upper=up / "upper", work=up / "work", flags=HostMounts.VIEW_FLAGS)
        try:
            out = run_timed(chroot_argv(mp, burst_command(inputs.projects[k])), env=CHROOT_ENV)
        finally:
            kmount.umount(mp, missing_ok=True)
        mp.rmdir()
        remove_tree(up)
        return {"image": k, "seconds": out.exited - t0}

    try:
        row = burst_run("eager (skopeo copy + umoci unpack)", n, parallel, len(inputs.images), device, base,
                        lambda: None, one)
    finally:
        for mp in kmount.mounts_under(mnt):
            if "burst-eager" in mp:
                kmount.umount(mp, lazy=True, missing_ok=True)
    row["pulls"] = pulled
    remove_tree(base)
    return row


def burst_section(kind: str, url: str, work: Path, layout: Path, paths: Sequence[str], args: argparse.Namespace
                  ) -> dict[str, Any]:
    """DSec's burst: from an empty host, N sandboxes over several workspace images on one base and
    toolkit, each running its test suite: lazy (fill off; the daemon's defaults), fully cached, eager."""
    publisher = work / "hosts" / kind / "publisher"
    inputs = prepare_burst(work, layout, url, publisher, args.burst_images, args.burst_data_mb * MB)
    device = block_device(work)
    n, parallel = args.burst, args.burst_parallel
    out: dict[str, Any] = {"images": inputs.images, "projects": inputs.projects, "layer_bytes": inputs.layer_bytes,
                           "device": device, "sandboxes": n, "parallel": parallel, "lazy": {}}
    for path in paths:
        ctx = Ctx(kind, path, url, work, work / "hosts" / kind, work / "mnt", args.trace_seconds)
        rows: dict[str, Any] = {}
        root, mp = ctx.fresh("burst")
        mp.rmdir()
        with host(ctx, root) as hm:
            rows["lazy"] = burst_lazy(ctx, hm, inputs, n, parallel, device, f"lazy [{ctx.label}], fill off")
            rows["cached"] = burst_lazy(ctx, hm, inputs, n, parallel, device,
                                        f"fully cached [{ctx.label}] (the same host again)")
        root, mp = ctx.fresh("burst-warmup")
        mp.rmdir()
        with host(ctx, root, fill=True) as hm:
            rows["warmup"] = burst_warmup(ctx, hm, inputs)
        root, mp = ctx.fresh("burst-fill")
        mp.rmdir()
        with host(ctx, root, fill=True) as hm:
            rows["fill"] = burst_lazy(ctx, hm, inputs, n, parallel, device, f"lazy [{ctx.label}], defaults",
                                      defaults=True)
        out["lazy"][path] = rows
    out["eager"] = burst_eager(work, work / "mnt", inputs, layout, n, parallel, device)
    return out


def mount_times(hm: HostMounts, resolved: Resolved, mp: Path, holder: Path, n: int) -> dict[str, Any]:
    """``n`` x (mount + umount) per variant on a host whose cache holds the image."""
    holder.mkdir(exist_ok=True)
    out = {}
    for label, writable, shared in (("ro", False, False), ("ro_shared", False, True),
                                    ("rw", True, False), ("rw_shared", True, True)):
        if shared:
            hm.mount(resolved, holder, trace=False)
        mount_s, umount_s, created = [], [], []
        try:
            for _ in range(n):
                t0 = time.perf_counter()
                result = hm.mount(resolved, mp, writable=writable, trace=False)
                t1 = time.perf_counter()
                hm.umount(mp, discard=True)
                t2 = time.perf_counter()
                mount_s.append(t1 - t0)
                umount_s.append(t2 - t1)
                created.append(result.layer_mounts_created)
        finally:
            if shared:
                hm.umount(holder)
        out[label] = {"writable": writable, "layers_shared": shared, "n": n,
                      "mount": distribution(mount_s), "umount": distribution(umount_s),
                      "layer_mounts_created": statistics.median(created)}
    holder.rmdir()
    return out


def first_output_section(ctx: Ctx, images: Mapping[str, ImageInput], opened: Mapping[tuple[str, str], Any],
                         facts: Mapping[str, Any], repeat: int) -> list[dict[str, Any]]:
    cases = []
    for tag, cmd in CASES:
        if tag not in images:
            continue
        lazy, pf = [], []
        for i in range(repeat):  # interleaved, so drift hits both alike
            log(f"[{ctx.label}] first output: {tag} {cmd} ({i + 1}/{repeat})")
            lazy.append(lazy_run(ctx, images[tag], COMMANDS[cmd], prefetch=False))
            pf.append(lazy_run(ctx, images[tag], COMMANDS[cmd], prefetch=True))
        lm = medians(lazy)
        read = opened[(tag, cmd)]["bytes"]
        cases.append({
            "image": tag, "command": cmd,
            "lazy": {"runs": lazy, "median": lm}, "prefetch": {"runs": pf, "median": medians(pf)},
            "opened_bytes": read, "metadata_bytes": facts[tag]["metadata_bytes"],
            "fetched_over_opened": ratio(lm["bytes_fetched"], read),
            "fetched_over_served": ratio(lm["bytes_fetched"], lm["bytes_served"]),
        })
    return cases


def bench_backend(kind: str, url: str, work: Path, images: Mapping[str, ImageInput],
                  opened: Mapping[tuple[str, str], Any], rootfs: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Publish the images to this store, then every selected section for each data path."""
    hosts = work / "hosts" / kind
    publisher = hosts / "publisher"
    convert_dir = work / "convert"
    convert_dir.mkdir(exist_ok=True)
    published = asyncio.run(_publish_all(url, publisher, images, convert_dir))
    facts = asyncio.run(_store_facts(url, publisher, images))
    sections = args.sections
    out: dict[str, Any] = {"url": url, "publish": published, "store": facts, "paths": {}}
    first_ctx = Ctx(kind, args.data_paths[0], url, work, hosts, work / "mnt", args.trace_seconds)
    with contextlib.ExitStack() as stack:
        peers = None
        if "read" in sections:
            peers = stack.enter_context(read_peers(first_ctx, images["python"], rootfs, local=True))
        for path in args.data_paths:
            ctx = Ctx(kind, path, url, work, hosts, work / "mnt", args.trace_seconds)
            r: dict[str, Any] = {}
            if "first" in sections:
                r["first_output"] = first_output_section(ctx, images, opened, facts, args.repeat)
            if "replay" in sections:
                log(f"[{ctx.label}] replay of the task")
                r["replay"] = replay_section(ctx, images["python"], facts["python"]["digest"])
            if peers is not None:
                log(f"[{ctx.label}] sequential reads of /{READ_TREE}")
                reads = read_and_mount_section(ctx, images["python"], peers, rounds=args.repeat,
                                               readers=args.readers,
                                               mounts=args.mounts if "mount" in sections else None)
                r["read"] = {k: v for k, v in reads.items() if k != "mount_times"}
                if reads["mount_times"] is not None:
                    r["mount_times"] = reads["mount_times"]
            elif "mount" in sections:
                r["mount_times"] = mount_only(ctx, images["python"], args.mounts)
            if "start" in sections:
                r["start"] = start_section(ctx, images["python"], args.repeat)
            if "cold" in sections:
                r["cold"] = cold_section(ctx, images["python"], args.readers, args.repeat)
            out["paths"][path] = r
        if peers is not None:
            out["local_blob_bytes"] = peers.local_bytes
    if "burst" in sections:
        out["burst"] = burst_section(kind, url, work, work / "layout", args.data_paths, args)
    return out


def mount_only(ctx: Ctx, image: ImageInput, mounts: int) -> dict[str, Any]:
    root, mp = ctx.fresh("mounts")
    with host(ctx, root) as hm:
        resolved = resolve(ctx.url, root, image.name)
        log(f"[{ctx.label}] mount times: {mounts} x 4 variants")
        times = mount_times(hm, resolved, mp, ctx.mnt / f"{ctx.kind}-{ctx.path}-holder", mounts)
    mp.rmdir()
    return times


# -- statistics --------------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def medians(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    keys = [k for k, v in runs[0].items() if isinstance(v, int | float) and not isinstance(v, bool)]
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(math.ceil(pct / 100 * len(ordered)) - 1, 0)]


def distribution(values: Sequence[float]) -> dict[str, float]:
    return {"p50": percentile(values, 50), "p99": percentile(values, 99), "max": max(values),
            "mean": statistics.fmean(values)}


def path_results(doc: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(``store/data path``, its results) for every store and data path measured."""
    return [(f"{kind}/{path}", r) for kind, b in doc["backends"].items() for path, r in b["paths"].items()]


def goals(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The issues' goals, per store and data path (see bench/README.md); absent sections are skipped."""
    out: dict[str, Any] = {}
    eager = {(c["image"], c["command"]): c for c in doc["eager"]["cases"]}
    sizes = {tag: img["compressed_bytes"] for tag, img in doc["images"].items()}
    for name, b in path_results(doc):
        g: dict[str, Any] = {}
        if "first_output" in b:
            fetch = [{"image": c["image"], "command": c["command"], "ratio": c["fetched_over_opened"],
                      "met": c["fetched_over_opened"] is not None
                      and c["fetched_over_opened"] <= GOAL_FETCH_OVER_READ}
                     for c in b["first_output"]]
            size_rows = []
            for cmd in COMMANDS:
                rows = sorted((c for c in b["first_output"] if c["command"] == cmd), key=lambda c: sizes[c["image"]])
                if len(rows) < 2:
                    continue
                small, large = rows[0], rows[-1]
                lm, sm = large["lazy"]["median"], small["lazy"]["median"]
                lazy_ratio = ratio(lm["first_output"], sm["first_output"])
                size_rows.append({
                    "command": cmd, "small": small["image"], "large": large["image"],
                    "size_ratio": ratio(sizes[large["image"]], sizes[small["image"]]),
                    "lazy_ratio": lazy_ratio,
                    "lazy_ratio_without_daemon": ratio(lm["first_output"] - lm["daemon"],
                                                       sm["first_output"] - sm["daemon"]),
                    "eager_ratio": ratio(eager[(large["image"], cmd)]["median"]["first_output"],
                                         eager[(small["image"], cmd)]["median"]["first_output"]),
                    "met": lazy_ratio is not None and lazy_ratio <= GOAL_SIZE_RATIO,
                })
            g["fetch_over_read"] = {"want": GOAL_FETCH_OVER_READ, "cases": fetch, "met": all(f["met"] for f in fetch)}
            g["size_independent"] = {"want": GOAL_SIZE_RATIO, "pairs": size_rows,
                                     "met": bool(size_rows) and all(r["met"] for r in size_rows)}
        if "read" in b:
            plain_pc = doc["plain"]["page_cache"]["resident_per_byte"]
            mount_pc = b["read"]["page_cache"]["resident_per_byte"]
            g["cached_once"] = {"want": GOAL_CACHED_ONCE, "mount_per_byte": mount_pc, "plain_per_byte": plain_pc,
                                "ratio": ratio(mount_pc, plain_pc),
                                "met": (ratio(mount_pc, plain_pc) or math.inf) <= GOAL_CACHED_ONCE}
            d = b["read"].get("direct")
            if d:
                direct_pc = d["page_cache"]["resident_per_byte"]
                g["cached_once_direct"] = {"want": GOAL_CACHED_ONCE, "mount_per_byte": direct_pc,
                                           "plain_per_byte": plain_pc, "ratio": ratio(direct_pc, plain_pc),
                                           "reread_vs_buffered": d["vs_buffered"],
                                           "met": (ratio(direct_pc, plain_pc) or math.inf) <= GOAL_CACHED_ONCE}
            rr = b["read"]["reread"]["ratios"].get("local_blob")
            g["reread_vs_local_blob"] = {"want": GOAL_REREAD, "ratio": rr, "met": (rr or 0) >= GOAL_REREAD}
            cold = b["read"]["cold"]
            for key in ("one", "many"):
                v = cold[key]["vs_raw"]
                g[f"cold_vs_store_{key}"] = {"want": GOAL_COLD, "readers": cold[key]["readers"], "ratio": v,
                                             "met": (v or 0) >= GOAL_COLD}
        if "cold" in b:
            for key in ("one", "many"):
                c = b["cold"][key]
                g[f"cold_vs_decode_{key}"] = {"want": GOAL_COLD_DECODE, "readers": c["readers"],
                                              "ratio": c["vs_ceiling"], "mb_per_s": c["mb_per_s"],
                                              "ceiling_mb_per_s": c["ceiling_mb_per_s"],
                                              "met": (c["vs_ceiling"] or 0) >= GOAL_COLD_DECODE}
        if "replay" in b:
            plain = doc["eager"]["task"]["plain_cold"]["median"]["seconds"]
            r = b["replay"]
            for key, want in (("cold", GOAL_TASK_COLD), ("trace", GOAL_TASK_TRACE)):
                # the daemon's start is a host's, once (the start section): not the task's
                v = ratio(r[key]["without_daemon"], plain)
                g[f"task_{key}"] = {"want": want, "ratio": v, "met": v is not None and v <= want,
                                    "with_daemon_start": ratio(r[key]["seconds"], plain)}
        out[name] = g
    return out


# -- output ------------------------------------------------------------------------------------


def _mb(n: float | None, digits: int = 2) -> str:
    return "-" if n is None else f"{n / MB:.{digits}f}"


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1000:.1f}"


def _met(flag: bool) -> str:
    return "MET" if flag else "MISSED"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def render(doc: Mapping[str, Any]) -> str:
    s, env = doc["settings"], doc["environment"]
    results = path_results(doc)
    out = [
        f"layerbox lazy-mount benchmark: stores {', '.join(s['backends'])}; data paths {', '.join(s['data_paths'])}; "
        f"sections {', '.join(s['sections'])}; median of {s['repeat']} run(s) per case; MB = 10^6 bytes",
        f"fixture: {s['fixture']}; work dir {env['workdir']}; {env['cpus']} CPUs; kernel {env['kernel']}; "
        f"load average {env['loadavg_start']} at start, {env['loadavg_end']} at end; {env['wall_seconds']} s",
        f"peers: {env['skopeo']}, {env['umoci']}; page cache dropped before every cold run; the daemons' "
        "background fill is off except in the burst's 'defaults' rows",
        "",
        "Images",
    ]
    rows = []
    for tag, img in doc["images"].items():
        rows.append([tag, str(img["layers"]), _mb(img["compressed_bytes"]), str(img["files"]),
                     _mb(img["file_bytes"]), img["src"]])
    out.append(_table(["image", "layers", "gzip MB", "files", "file MB", "source"], rows, left=1))
    out.append("")
    if "first" in s["sections"]:
        out += _render_first(doc, results)
    if "replay" in s["sections"]:
        out += _render_replay(doc, results)
    if "read" in s["sections"]:
        out += _render_read(doc, results)
    if "mount" in s["sections"]:
        out.append("Mount time of a cached image (ms; HostMounts.mount on a running daemon; umount separately)")
        rows = []
        variants = {"ro": "read-only", "ro_shared": "read-only, layers shared", "rw": "writable",
                    "rw_shared": "writable, layers shared"}
        for name, b in results:
            for key, label in variants.items():
                m = b["mount_times"][key]
                rows.append([name, label, str(m["n"]), _ms(m["mount"]["p50"]), _ms(m["mount"]["p99"]),
                             _ms(m["mount"]["max"]), _ms(m["umount"]["p50"]), _ms(m["umount"]["p99"]),
                             f"{m['layer_mounts_created']:.0f}"])
        out.append(_table(["store/path", "variant", "n", "mount p50", "p99", "max", "umount p50", "p99",
                           "EROFS mounts/call"], rows, left=2))
        out.append("")
    if "start" in s["sections"]:
        out.append("First `layerbox mount` of python (the CLI as a shell runs it: Python start, resolve, "
                   "layer mounts; seconds, median)")
        rows = []
        for name, b in results:
            m = b["start"]["median"]
            rows.append([name, _f(m["fresh_host"], 3), _f(m["daemon_running"], 3),
                         _x(b["start"]["first_over_running"]), _f(m["fresh_host"] - m["daemon_running"], 3),
                         _f(m["daemon_start"], 3), _f(m["again"], 3)])
        out.append(_table(["store/path", "fresh host (starts daemon+holder)", "daemon already running",
                           "ratio", "difference", "`layerbox daemon start` alone", "2nd mount, layers known"],
                          rows, left=1))
        out.append("")
    if "cold" in s["sections"]:
        out += _render_cold(results)
    for kind, b in doc["backends"].items():
        if "burst" in b:
            out += _render_burst(kind, b["burst"])
    if doc["goals"]:
        out += _render_goals(doc)
    out.append(f"  mounts left under the work dir after every host's teardown: {len(doc['leftover_mounts'])}; "
               f"after cleanup: {len(doc['mounts_after_cleanup'])}")
    return "\n".join(out)


def _render_first(doc: Mapping[str, Any], results: Sequence[tuple[str, Mapping[str, Any]]]) -> list[str]:
    out = ["Time to first output from an empty host (seconds; eager: download = skopeo copy, "
           "unpack = umoci unpack; layerbox: fresh data dir and daemon)"]
    rows = []
    for c in doc["eager"]["cases"]:
        m = c["median"]
        rows.append([c["image"], c["command"], "eager skopeo+umoci", _f(m["first_output"], 3),
                     _f(m["first_output"], 3), "-", "-",
                     _f(m["download"], 3), _f(m["unpack"], 3), _f(m["command"], 3),
                     _mb(m["bytes_downloaded"]), "-"])
        for name, b in results:
            fo = next(x for x in b["first_output"] if (x["image"], x["command"]) == (c["image"], c["command"]))
            for label, key in (("lazy", "lazy"), ("prefetch+mount", "prefetch")):
                m = fo[key]["median"]
                rows.append(["", "", f"{label} [{name}]", _f(m["first_output"], 3),
                             _f(m["first_output"] - m["daemon"], 3), _f(m["resolve"], 3),
                             _f(m["daemon"], 3), _f(m["prefetch"], 3) if key == "prefetch" else "-",
                             _f(m["mount"], 3), _f(m["command"], 3), _mb(m["bytes_fetched"]),
                             str(int(m["store_requests"]))])
    out.append(_table(["image", "cmd", "method", "first output", "w/o daemon", "resolve", "daemon", "download",
                       "mount/unpack", "command", "fetched MB", "req"], rows, left=3))
    out.append("  commands: " + "; ".join(f"{k} = {shlex.join(v)}" for k, v in COMMANDS.items())
               + "; run as `unshare --mount --propagation private chroot ROOT CMD`")
    out.append("")
    out.append("Bytes (lazy, empty cache): fetched = compressed chunk bytes from the store; served = blob bytes "
               "the daemon delivered; opened = sizes of the image files the command opened (strace)")
    rows = []
    opened = {(c["image"], c["command"]): c["opened"] for c in doc["eager"]["cases"]}
    for name, b in results:
        for c in b["first_output"]:
            m = c["lazy"]["median"]
            o = opened[(c["image"], c["command"])]
            rows.append([name, c["image"], c["command"], str(o["files"]), _mb(o["bytes"]), _mb(m["bytes_served"]),
                         _mb(m["bytes_fetched"]), str(int(m["chunks_fetched"])), _mb(c["metadata_bytes"]),
                         _mb(doc["images"][c["image"]]["compressed_bytes"]),
                         _f(c["fetched_over_opened"]), _f(c["fetched_over_served"])])
    out.append(_table(["store/path", "image", "cmd", "files opened", "opened MB", "served MB", "fetched MB",
                       "chunks", "metadata MB", "eager MB", "fetched/opened", "fetched/served"], rows, left=3))
    out.append("  metadata = image document + metadata images + pack indexes a fresh host also fetches "
               "(not in 'fetched'); eager MB = the gzip layers a pull downloads")
    out.append("")
    return out


def _render_replay(doc: Mapping[str, Any], results: Sequence[tuple[str, Mapping[str, Any]]]) -> list[str]:
    t = doc["eager"]["task"]
    plain = t["plain_cold"]["median"]["seconds"]
    out = [f"Replay of a task (writable mount): {TASK_SCRIPT}",
           f"  opened by the task: {t['opened']['files']} files, {_mb(t['opened']['bytes'])} MB; "
           "vs plain = the time before it / the plain dir's with its page cache dropped; "
           "w/o daemon start = total - the daemon's start (a host's, once)"]
    em = t["eager"]["median"]
    hot = t["plain_hot"]["median"]["seconds"]
    rows = [["eager", "skopeo copy + umoci unpack + task", _f(em["seconds"], 3), _x(ratio(em["seconds"], plain)),
             "-", "-", "-", _f(em["download"] + em["unpack"], 3), _f(em["seconds"] - em["download"] - em["unpack"], 3),
             _mb(em["bytes_downloaded"]), "-", "-", "-"],
            ["eager", "plain dir, page cache dropped", _f(plain, 3), "1.00x", "-", "-", "-", "-", _f(plain, 3),
             "0.00", "-", "-", "-"],
            ["eager", "plain dir, hot", _f(hot, 3), _x(ratio(hot, plain)), "-", "-", "-", "-", _f(hot, 3),
             "0.00", "-", "-", "-"]]
    labels = {"cold": "cold, empty cache (records trace)", "trace": "new host, trace replayed",
              "cached": "same host, page cache dropped", "hot": "same host, hot"}
    for name, b in results:
        r = b["replay"]
        for key, label in labels.items():
            row = r[key]
            rows.append([name, label, _f(row["seconds"], 3), _x(ratio(row["seconds"], plain)),
                         _f(row["without_daemon"], 3), _x(ratio(row["without_daemon"], plain)), _f(row["mount"], 3),
                         "-", _f(row["task"], 3), _mb(row["bytes_fetched"]), str(row["store_requests"]),
                         str(row["misses"]), str(row["chunks_prefetched"])])
    out.append(_table(["store/path", "run", "total s", "vs plain", "w/o daemon start", "vs plain", "mount s",
                       "pull s", "task s", "fetched MB", "req", "misses", "prefetched"], rows, left=2))
    for name, b in results:
        r = b["replay"]
        end = r["trace"]["at_task_end"]
        out.append(f"  [{name}] trace window {r['trace_seconds']} s, trace object {r['trace_bytes']} B; with the "
                   f"trace, at task end: {_mb(end['bytes_fetched'])} MB fetched, {end['misses']} misses "
                   f"(reads that waited for the store)")
    out.append("")
    return out


def _render_read(doc: Mapping[str, Any], results: Sequence[tuple[str, Mapping[str, Any]]]) -> list[str]:
    p = doc["plain"]
    out = [f"Sequential read of every file under /{READ_TREE} of the python image "
           f"({p['files']} files, {_mb(p['bytes'])} MB), 1 MiB reads"]
    out.append(f"  Re-read with every chunk on the host, page cache dropped before each pass (median of "
               f"{doc['settings']['repeat']} round(s), the methods in turns); ratio = the mount's MB/s / the peer's")
    rows = []
    peers = {"local_blob": "EROFS on local blob files", "plain": "plain dir (umoci unpack)",
             "copy": "plain dir (cp -a copy)"}
    for name, b in results:
        rr = b["read"]["reread"]
        m = rr["methods"]
        rows.append([name, "lazy mount", _mb(m["mount"]["bytes"]), _f(m["mount"]["seconds"], 3),
                     _f(m["mount"]["mb_per_s"], 1), "-"])
        for key, label in peers.items():
            if key in m:
                rows.append(["", label, _mb(m[key]["bytes"]), _f(m[key]["seconds"], 3), _f(m[key]["mb_per_s"], 1),
                             _x(rr["ratios"][key])])
        d = b["read"].get("direct")
        if d:
            rows.append(["", "lazy mount, --blob-io direct (vs buffered)", _mb(d["bytes"]), _f(d["seconds"], 3),
                         _f(d["mb_per_s"], 1), _x(d["vs_buffered"])])
    out.append(_table(["store/path", "what", "MB", "s", "MB/s", "mount/peer"], rows, left=2))
    out.append("  EROFS on local blob files = the same metadata images mounted with device= a plain local file "
               "holding every chunk (built from the store), stacked in the same overlay")
    out.append("")
    out.append("  Cold reads from an empty host (fill off) against the store's own delivery: raw ranged GETs "
               "(Store.read_pack_range) of the same chunks, adjacent frames merged up to 4 MiB, no decoding")
    rows = []
    for name, b in results:
        for key in ("one", "many"):
            c = b["read"]["cold"][key]
            raw = c["raw"]
            rows.append([name, str(c["readers"]), _mb(c["bytes"]), _f(c["seconds"], 3), _f(c["mb_per_s"], 1),
                         _mb(c["bytes_fetched"]), str(c["store_requests"]), _f(c["fetched_mb_per_s"], 1),
                         _mb(raw["bytes"]), str(raw["requests"]), _f(raw["seconds"], 3), _f(raw["mb_per_s"], 1),
                         _x(c["vs_raw"])])
    out.append(_table(["store/path", "readers", "file MB", "s", "file MB/s", "fetched MB", "GETs",
                       "fetched MB/s", "raw MB", "raw GETs", "raw s", "raw MB/s", "lazy/raw"], rows, left=2))
    out.append("  lazy/raw = compressed MB/s the mount drew from the store / what as many raw GET loops drew")
    out.append("")
    out.append("  Other passes (one reader)")
    rows = [["plain dir", "page cache dropped", *_pass(p["passes"]["cold"])],
            ["plain dir", "warm", *_pass(p["passes"]["warm"])]]
    labels = {"store": "empty host cache (fetch from store)", "cached": "blobs on the host, page cache dropped",
              "warm": "warm", "remount": "fresh layer mounts, blob files in page cache"}
    for name, b in results:
        for key, label in labels.items():
            rows.append([f"mount [{name}]", label, *_pass(b["read"]["passes"][key])])
    out.append(_table(["what", "pass", "MB", "s", "MB/s", "chunk reads"], rows, left=2))
    out.append("")
    out.append("Page cache after one pass from a dropped page cache (mount: blobs complete); resident = fincore")
    rows = [["plain dir", *_pc(p["page_cache"])]]
    for name, b in results:
        rows.append([f"mount [{name}]", *_pc(b["read"]["page_cache"])])
        if b["read"].get("direct"):
            rows.append([f"mount [{name}] --blob-io direct", *_pc(b["read"]["direct"]["page_cache"])])
    out.append(_table(["what", "MB read", "files res MB", "blob res MB", "resident/byte", "Cached delta MB",
                       "delta/byte"], rows))
    out.append("  files = the files read (EROFS's page cache through the overlay); blob = the layers' blob files "
               "in the blob cache (fuse: and the FUSE files EROFS reads); Cached delta = /proc/meminfo, system-wide (other processes' I/O lands in it too)")
    out.append("")
    return out


DSEC = {"lazy_over_cached": 1.0, "eager_over_lazy": 1.7, "eager_writes_over_lazy": 1.57}


def _burst_goals(kind: str, path: str, r: Mapping[str, Any], e: Mapping[str, Any]) -> list[str]:
    """Issue 27's goals for the burst, with the daemon's defaults: time against fully cached and eager,
    and writes against eager (also once the background fill the burst started has ended)."""
    d, cached = r["fill"], r["cached"]

    def verdict(ok: bool | None) -> str:
        return "n/a" if ok is None else ("met" if ok else "NOT met")

    def at_most(x: float | None, bound: float) -> bool | None:
        return None if x is None else x <= bound

    t_cached = ratio(d["seconds"], cached["seconds"])
    t_eager = ratio(e["seconds"], d["seconds"])
    written = ratio(d.get("disk_written_settled", d["disk_written"]), e["disk_written"])
    alloc = ratio(d.get("allocated_settled", d["allocated"]), e["allocated"])
    return [
        f"  [{kind}/{path}] issue 27, defaults: lazy/cached {_x(t_cached)} time (goal <= 1.05x: "
        f"{verdict(at_most(t_cached, 1.05))}); eager/lazy {_x(t_eager)} time (goal >= 1.5x: "
        f"{verdict(None if t_eager is None else t_eager >= 1.5)}); lazy/eager writes {_x(written)} disk written, "
        f"{_x(alloc)} allocated, counted {d.get('settle_seconds', 0):.1f} s after the last exit when the "
        f"fill had ended; {d.get('layers_filled', 0)} layer(s) filled (goal <= 0.5x: {verdict(at_most(written, 0.5))} "
        f"written, {verdict(at_most(alloc, 0.5))} allocated)"]


def _render_burst(kind: str, b: Mapping[str, Any]) -> list[str]:
    out = [f"Burst [{kind}]: {b['sandboxes']} sandboxes, {b['parallel']} at a time, over {len(b['images'])} images "
           f"(base python + one of {len(b['projects'])} workspaces + toolkit), each running its unittest suite "
           f"in a chroot on a writable mount; from an empty host; disk written = bytes written to {b['device']} "
           "(sync before and after; the whole device: other processes' writes count too); allocated = what the "
           "host's data dir (eager: its OCI layout and bundles) grew by on disk, uppers discarded after each sandbox"]
    e = b["eager"]
    rows = [["eager (skopeo copy + umoci unpack, once per image)", _f(e["seconds"], 2), _f(e["sandbox"]["p50"], 3),
             _f(e["sandbox"]["max"], 3), _mb(e["disk_written"], 1), _mb(e["allocated"], 1), "-", "-", "-", "-"]]
    for path, r in b["lazy"].items():
        lazy = r["lazy"]
        for key, label in (("lazy", "lazy, fill off"), ("fill", "lazy, defaults"),
                           ("cached", "fully cached (same host again)")):
            x = r[key]
            rows.append([f"{label} [{kind}/{path}]", _f(x["seconds"], 2), _f(x["sandbox"]["p50"], 3),
                         _f(x["sandbox"]["max"], 3), _mb(x["disk_written"], 1), _mb(x["allocated"], 1),
                         _mb(x["bytes_fetched"], 1), _x(ratio(x["seconds"], lazy["seconds"])),
                         _x(ratio(x["disk_written"], lazy["disk_written"])), _x(ratio(x["allocated"], lazy["allocated"]))])
    out.append(_table(["method", "total s", "sandbox p50 s", "max s", "disk written MB", "allocated MB",
                       "fetched MB", "time/lazy", "written/lazy", "allocated/lazy"], rows, left=1))
    for path, r in b["lazy"].items():
        lazy, cached = r["lazy"], r["cached"]
        out.append(f"  [{kind}/{path}] ours: lazy/cached {_x(ratio(lazy['seconds'], cached['seconds']))} time; "
                   f"eager/lazy {_x(ratio(e['seconds'], lazy['seconds']))} time, "
                   f"{_x(ratio(e['disk_written'], lazy['disk_written']))} disk writes "
                   f"({_x(ratio(e['allocated'], lazy['allocated']))} allocated); "
                   f"eager/lazy (defaults) {_x(ratio(e['seconds'], r['fill']['seconds']))} time, "
                   f"{_x(ratio(e['disk_written'], r['fill']['disk_written']))} disk writes "
                   f"({_x(ratio(e['allocated'], r['fill']['allocated']))} allocated)")
        out.extend(_burst_goals(kind, path, r, e))
        w = r.get("warmup")
        if w:
            out.append(f"  [{kind}/{path}] before the defaults row, another host ran one sandbox of {w['image']} "
                       f"(another workspace on the same base and toolkit) in {w['seconds']:.2f} s and stored traces "
                       f"of {w['layer_traces']} of its {w['layers']} layers: the defaults row's new images replay "
                       "the base's and the toolkit's")
        starts = ", ".join(f"{key} {r[key].get('daemon_start_seconds', 0):.2f} s" for key in ("lazy", "fill"))
        out.append(f"  [{kind}/{path}] the daemon's start-up on the empty hosts, before the burst's clock (a host "
                   f"service, running on the cached host too): {starts}")
    out.append(f"  DSec reports: lazy/cached {_x(DSEC['lazy_over_cached'])} (35 vs 35 min); eager/lazy "
               f"{_x(DSEC['eager_over_lazy'])} time, {_x(DSEC['eager_writes_over_lazy'])} disk writes (57% more)")
    out.append("  layer tar bytes: " + ", ".join(f"{k} {_mb(v)} MB" for k, v in b["layer_bytes"].items()))
    out.append("")
    return out


def _render_cold(results: Sequence[tuple[str, Mapping[str, Any]]]) -> list[str]:
    out = [f"Cold reads of the files >= {COLD_MIN_SIZE >> 10} KiB of python (fresh host, fill off, page cache "
           "dropped) against decompress+verify of the same chunks from memory on every core, measured right "
           "after each read (MB/s; medians)"]
    rows = []
    for name, b in results:
        if "cold" not in b:
            continue
        for key in ("one", "many"):
            c = b["cold"][key]
            r = c["runs"][0]
            rows.append([name, str(c["readers"]), str(r["files"]), _mb(r["bytes"]), _f(c["mb_per_s"], 1),
                         _f(c["remount_mb_per_s"], 1), _f(c["ceiling_mb_per_s"], 1), _x(c["vs_ceiling"]),
                         " ".join(_f(x["vs_ceiling"]) for x in c["runs"]),
                         _f(statistics.median(x["store_requests"] for x in c["runs"]), 0),
                         _f(statistics.median(x["misses"] for x in c["runs"]), 0)])
    out.append(_table(["store/path", "readers", "files", "MB", "cold MB/s", "remounted MB/s", "ceiling MB/s",
                       "ratio", "runs", "GETs", "misses"], rows, left=1))
    out.append("  remounted: the same read again after an umount and mount (every chunk on the host, the blob "
               "files in memory): the data path alone, nothing fetched or decoded")
    out.append("")
    return out


def _render_goals(doc: Mapping[str, Any]) -> list[str]:
    out = ["Goals (issue 12's and issue 13's; figures, not asserts)"]
    for name, g in doc["goals"].items():
        if "fetch_over_read" in g:
            f = g["fetch_over_read"]
            worst = max((c["ratio"] for c in f["cases"] if c["ratio"] is not None), default=None)
            out.append(f"  [{name}] bytes fetched <= {f['want']} x bytes opened, every case: {_met(f['met'])} "
                       f"(worst {_f(worst)}: " + ", ".join(f"{c['image']}/{c['command']} {_f(c['ratio'])}"
                                                          for c in f["cases"]) + ")")
            si = g["size_independent"]
            for r in si["pairs"]:
                out.append(f"  [{name}] first output independent of image size ({r['command']}: {r['large']} is "
                           f"{_f(r['size_ratio'], 1)}x {r['small']}): lazy {_f(r['lazy_ratio'])}x, want <= "
                           f"{si['want']}: {_met(r['met'])} (without the daemon start "
                           f"{_f(r['lazy_ratio_without_daemon'])}x; eager {_f(r['eager_ratio'])}x)")
        if "cached_once" in g:
            co = g["cached_once"]
            out.append(f"  [{name}] data cached once: page cache per byte read {_f(co['mount_per_byte'])} through "
                       f"the mount vs {_f(co['plain_per_byte'])} plain = {_f(co['ratio'])}x, want <= {co['want']}x: "
                       f"{_met(co['met'])}")
            if "cached_once_direct" in g:
                cd = g["cached_once_direct"]
                out.append(f"  [{name}] data cached once with --blob-io direct: {_f(cd['mount_per_byte'])} per byte "
                           f"= {_f(cd['ratio'])}x plain, want <= {cd['want']}x: {_met(cd['met'])} (its re-read "
                           f"{_x(cd['reread_vs_buffered'])} of buffered)")
            rr = g["reread_vs_local_blob"]
            out.append(f"  [{name}] re-read, page cache dropped: {_x(rr['ratio'])} of EROFS on a local blob, "
                       f"want >= {rr['want']}x: {_met(rr['met'])}")
            for key in ("one", "many"):
                c = g[f"cold_vs_store_{key}"]
                out.append(f"  [{name}] cold read, {c['readers']} reader(s): {_x(c['ratio'])} of the raw GET "
                           f"loop(s), want >= {c['want']}x: {_met(c['met'])}")
        for key in ("one", "many"):
            if f"cold_vs_decode_{key}" in g:
                c = g[f"cold_vs_decode_{key}"]
                out.append(f"  [{name}] cold read of files >= {COLD_MIN_SIZE >> 10} KiB, {c['readers']} reader(s): "
                           f"{_f(c['mb_per_s'], 1)} MB/s = {_x(c['ratio'])} of decompress+verify of their chunks on "
                           f"every core ({_f(c['ceiling_mb_per_s'], 1)} MB/s), want >= {c['want']}x: {_met(c['met'])}")
        for key, label in (("task_cold", "task cold"), ("task_trace", "task with its trace")):
            if key in g:
                t = g[key]
                out.append(f"  [{name}] {label} (resolve + mount + task, the daemon running): {_x(t['ratio'])} "
                           f"of the plain dir with dropped caches, want <= {t['want']}x: {_met(t['met'])} "
                           f"({_x(t['with_daemon_start'])} with the daemon's start)")
    return out


def _pass(p: Mapping[str, Any]) -> list[str]:
    reads = p["hits"] + p["misses"] if "hits" in p else None
    return [_mb(p["bytes"]), _f(p["seconds"], 3), _f(p["mb_per_s"], 1), "-" if reads is None else str(reads)]


def _pc(pc: Mapping[str, Any]) -> list[str]:
    return [_mb(pc["bytes_read"]), _mb(pc["files_resident"]), _mb(pc["blob_resident"]), _f(pc["resident_per_byte"]),
            _mb(pc["cached_delta"]), _f(pc["cached_delta_per_byte"])]


# -- command line ------------------------------------------------------------------------------


def s3_support() -> Any:
    """The moto server class the s3 backend runs on (checked before any work, so that a missing
    piece never throws away the file backend's figures)."""
    try:
        from tests.support.moto import MotoServer
    except ImportError as exc:
        raise BenchError(f"the s3 backend needs moto and the test support code ({exc}); "
                         "pip install -e '.[test]', or pass --backends file") from None
    return MotoServer


def rgw_support() -> Any:
    """The Ceph RGW the tests run (tests/support/rgw.py), checked before any work."""
    try:
        from tests.support import rgw
    except ImportError as exc:
        raise BenchError(f"the rgw backend needs the test support code ({exc}); pip install -e '.[test]'") from None
    absent = rgw.missing()
    if absent:
        raise BenchError(f"the rgw backend needs Ceph ({', '.join(absent)} missing): {rgw.install_hint()}")
    return rgw


def run_rgw(work: Path, images: Mapping[str, ImageInput], opened: Mapping[tuple[str, str], Any], rootfs: Path,
            args: argparse.Namespace) -> dict[str, Any]:
    """The s3 backend on a single-node Ceph RGW booted for the run (127.0.0.1 only), stopped after."""
    rgw = rgw_support()
    log("[rgw] booting a single-node Ceph RGW on 127.0.0.1")
    cluster = rgw.RgwCluster.create("bench")
    try:
        try:
            cluster.boot()
        except rgw.RgwStartError as exc:
            raise BenchError(f"cannot boot the Ceph RGW: {exc}") from None
        with aws_environment(cluster.endpoint, work, access_key=cluster.access_key, secret_key=cluster.secret_key,
                             region=cluster.region):
            url = f"s3://{cluster.new_bucket()}/layerbox"
            result = bench_backend("rgw", url, work, images, opened, rootfs, args)
            result["server"] = {"endpoint": cluster.endpoint, "kind": "ceph-rgw"}
            return result
    finally:
        cluster.stop()


def run_backend(kind: str, work: Path, images: Mapping[str, ImageInput], opened: Mapping[tuple[str, str], Any],
                rootfs: Path, args: argparse.Namespace) -> dict[str, Any]:
    if kind == "file":
        return bench_backend(kind, f"file://{work / 'stores' / 'file'}", work, images, opened, rootfs, args)
    if kind == "rgw":
        return run_rgw(work, images, opened, rootfs, args)
    MotoServer = s3_support()
    log("[s3] starting moto_server on 127.0.0.1")
    try:
        server = MotoServer()
    except (OSError, RuntimeError) as exc:
        raise BenchError(f"cannot start moto_server: {exc}") from None
    try:
        with aws_environment(server.endpoint, work):
            result = bench_backend(kind, f"s3://{server.new_bucket()}/layerbox", work, images, opened, rootfs, args)
            result["server"] = {"endpoint": server.endpoint, "kind": "moto_server"}
            return result
    finally:
        server.stop()


def check_host() -> None:
    if os.geteuid() != 0:
        raise BenchError("needs root: it mounts EROFS, overlayfs and FUSE and drops the page cache")
    for program, package in TOOLS.items():
        if shutil.which(program) is None:
            raise BenchError(f"{program} is not installed: apt-get install {package}")
    with open("/proc/filesystems") as f:
        have = {line.split()[-1] for line in f if line.strip()}
    missing = [fs for fs in ("erofs", "overlay", "fuse") if fs not in have]
    if missing or not os.path.exists("/dev/fuse"):
        raise BenchError(f"the kernel lacks {', '.join(missing) or '/dev/fuse'} (modprobe erofs overlay fuse)")


def tool_version(argv: list[str]) -> str:
    try:
        return run_tool(argv, timeout=30).strip().splitlines()[0]
    except (BenchError, IndexError):
        return "unknown"


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def unmount_leftovers(path: Path) -> None:
    for mp in kmount.mounts_under(path):  # only after a failure inside a host's teardown
        log(f"unmounting leftover {mp}")
        kmount.umount(mp, lazy=True, missing_ok=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench/lazy.py",
        description="Lazy mounts from a layerbox store (file and S3) against eager pulls (skopeo copy + umoci "
        "unpack): time to first output and bytes fetched from an empty host, a task replayed cold / with "
        "its access trace / cached, sequential read MB/s and page cache per byte, mount time p50/p99.",
    )
    p.add_argument("--backends", default="file,s3", metavar="LIST",
                   help="comma-separated: file, s3, rgw (default file,s3; s3 starts a moto server on 127.0.0.1, "
                        "rgw boots a single-node Ceph RGW on 127.0.0.1 as the tests do)")
    p.add_argument("--quick", action="store_true",
                   help="1 run per case, 10 mounts per variant, 32 MB of filler: a smoke test")
    p.add_argument("--repeat", type=int, default=None, metavar="N", help="runs per case (default 3; 1 with --quick)")
    p.add_argument("--mounts", type=int, default=None, metavar="N",
                   help="mounts per mount-time variant (default 100; 10 with --quick)")
    p.add_argument("--filler-mb", type=int, default=None, metavar="MB",
                   help="incompressible MB the 'big' image adds to python (default 512; 32 with --quick; 0: no big image)")
    p.add_argument("--trace-seconds", type=float, default=None, metavar="S",
                   help="the daemons' access-trace window (default 5; 3 with --quick); must cover the cold task")
    p.add_argument("--fixture", default=None, metavar="PATH",
                   help=f"the oci-archive with tags minbase and python (default ../shared/fixtures/{FIXTURE_NAME})")
    p.add_argument("--tmpdir", type=Path, default=Path("/var/tmp"), metavar="DIR",
                   help="where the layout, eager trees, stores, hosts and mounts go (default /var/tmp); removed at exit")
    p.add_argument("--sections", default=",".join(DEFAULT_SECTIONS), metavar="LIST",
                   help=f"comma-separated, of {', '.join(SECTIONS)}, or all (default {','.join(DEFAULT_SECTIONS)})")
    p.add_argument("--data-paths", default="fanotify,fuse", metavar="LIST",
                   help="the daemon's data paths to measure, side by side: fanotify, fuse (default both)")
    p.add_argument("--readers", type=int, default=16, metavar="N",
                   help="concurrent readers of the cold concurrent read, and raw GET loops (default 16)")
    p.add_argument("--burst", type=int, default=None, metavar="N", help="sandboxes of the burst (default 32; 4 with --quick)")
    p.add_argument("--burst-parallel", type=int, default=2, metavar="N", help="burst sandboxes at a time (default 2)")
    p.add_argument("--burst-images", type=int, default=None, metavar="N",
                   help="distinct workspace images of the burst (default 4; 2 with --quick)")
    p.add_argument("--burst-data-mb", type=int, default=None, metavar="MB",
                   help="text data per workspace its tests read (default 4; 1 with --quick)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the tables")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quick = args.quick
    args.repeat = args.repeat if args.repeat is not None else (1 if quick else 3)
    args.mounts = args.mounts if args.mounts is not None else (10 if quick else 100)
    args.filler_mb = args.filler_mb if args.filler_mb is not None else (32 if quick else 512)
    args.trace_seconds = args.trace_seconds if args.trace_seconds is not None else (3.0 if quick else 5.0)
    args.burst = args.burst if args.burst is not None else (4 if quick else 32)
    args.burst_images = args.burst_images if args.burst_images is not None else (2 if quick else 4)
    args.burst_data_mb = args.burst_data_mb if args.burst_data_mb is not None else (1 if quick else 4)
    names = [x.strip() for x in args.sections.split(",") if x.strip()]
    args.sections = list(SECTIONS) if names == ["all"] else names
    if not args.sections or any(x not in SECTIONS for x in args.sections):
        print(f"bench/lazy.py: --sections {','.join(names)!r}: use some of {', '.join(SECTIONS)}, or all",
              file=sys.stderr)
        return 2
    args.data_paths = [x.strip() for x in args.data_paths.split(",") if x.strip()]
    if not args.data_paths or any(x not in DATA_PATHS for x in args.data_paths) \
            or len(set(args.data_paths)) != len(args.data_paths):
        print("bench/lazy.py: --data-paths: use fanotify, fuse or fanotify,fuse", file=sys.stderr)
        return 2
    if args.readers < 1 or args.burst < 1 or args.burst_parallel < 1 or args.burst_images < 1 \
            or args.burst_data_mb < 1:
        print("bench/lazy.py: --readers, --burst, --burst-parallel, --burst-images and --burst-data-mb "
              "must be at least 1", file=sys.stderr)
        return 2
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or any(b not in BACKENDS for b in backends) or len(set(backends)) != len(backends):
        print(f"bench/lazy.py: --backends {args.backends!r}: use some of {', '.join(BACKENDS)}", file=sys.stderr)
        return 2
    if args.repeat < 1 or args.mounts < 1 or args.filler_mb < 0 or args.trace_seconds <= 0:
        print("bench/lazy.py: --repeat and --mounts must be at least 1, --filler-mb at least 0, "
              "--trace-seconds positive", file=sys.stderr)
        return 2
    started = time.time()
    load_start = loadavg()
    leftovers: list[str] = []
    try:
        check_host()
        if "s3" in backends:
            s3_support()
        if "rgw" in backends:
            rgw_support()
        fixture = find_fixture(args.fixture)
        with workspace(args.tmpdir, "layerbox-bench-lazy-", before_removal=unmount_leftovers) as work:
            try:
                trash = Trash(work / "trash")
                images = prepare_images(fixture, work, args.filler_mb if "first" in args.sections else 0)
                if {"first", "replay", "read"} & set(args.sections):
                    eager, rootfs = eager_section(images, work, trash, args.repeat, first="first" in args.sections,
                                                  with_task="replay" in args.sections)
                else:  # nothing compares with an eager pull or reads the plain tree
                    eager, rootfs = {"cases": []}, work / "no-plain-tree"
                plain = None
                if "read" in args.sections:
                    log("plain directory: sequential reads")
                    plain = plain_read(rootfs)
                opened = {(c["image"], c["command"]): c["opened"] for c in eager["cases"]}
                results = {kind: run_backend(kind, work, images, opened, rootfs, args) for kind in backends}
            finally:
                leftovers = kmount.mounts_under(work)
            doc: dict[str, Any] = {
                "schema": SCHEMA,
                "settings": {"backends": backends, "sections": args.sections, "data_paths": args.data_paths,
                             "readers": args.readers, "burst": args.burst, "burst_parallel": args.burst_parallel,
                             "burst_images": args.burst_images, "burst_data_mb": args.burst_data_mb,
                             "quick": quick, "repeat": args.repeat, "mounts": args.mounts,
                             "filler_mb": args.filler_mb, "trace_seconds": args.trace_seconds,
                             "fixture": str(fixture), "tmpdir": str(args.tmpdir),
                             "commands": {k: list(v) for k, v in COMMANDS.items()}, "task": list(TASK),
                             "read_tree": "/" + READ_TREE},
                "environment": {"workdir": str(work), "cpus": os.cpu_count(), "kernel": platform.release(),
                                "python": platform.python_version(),
                                "skopeo": tool_version(["skopeo", "--version"]),
                                "umoci": tool_version(["umoci", "--version"]),
                                "loadavg_start": load_start, "loadavg_end": loadavg(),
                                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
                                "wall_seconds": round(time.time() - started, 1)},
                "images": {tag: {"src": i.src, "name": i.name, "layers": i.layers,
                                 "compressed_bytes": i.compressed_bytes, "files": i.files,
                                 "file_bytes": i.file_bytes} for tag, i in images.items()},
                "eager": eager,
                "plain": plain,
                "backends": results,
                "leftover_mounts": leftovers,
            }
            doc["goals"] = goals(doc)
        # the work dir is gone: nothing of ours may remain in the mount table
        doc["mounts_after_cleanup"] = kmount.mounts_under(work)
    except BenchError as exc:
        log(f"bench/lazy.py: {exc}")
        return 1
    except (ConvertError, LayerstoreError, LazyfetchError) as exc:
        log(f"bench/lazy.py: layerbox failed: {exc}")
        return 1
    except KeyboardInterrupt:
        log("bench/lazy.py: interrupted; mounts, daemons, trees and the moto server removed")
        return 130
    if leftovers or doc["mounts_after_cleanup"]:
        log(f"bench/lazy.py: mounts were left behind: {leftovers}; after cleanup: {doc['mounts_after_cleanup']}")
    emit(doc, args.json, render)
    return 1 if leftovers or doc["mounts_after_cleanup"] else 0


if __name__ == "__main__":
    sys.exit(main())

