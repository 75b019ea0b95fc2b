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

Every host is torn down in ``finally`` (``umount_all(stop_daemon=True)``), and
at exit nothing may remain mounted under the work directory.  Run
``python bench/lazy.py --help``; bench/README.md explains every number.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: import the checkout, installed or not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
from layerstore.errors import LayerstoreError  # noqa: E402
from layerstore.objects import Resolved, doc_key, index_key, meta_key, trace_key  # noqa: E402
from layerstore.store import Store  # noqa: E402
from lazyfetch import kmount  # noqa: E402
from lazyfetch.errors import LazyfetchError  # noqa: E402
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
TOOLS = {"skopeo": "skopeo", "umoci": "umoci", "strace": "strace", "unshare": "util-linux",
         "chroot": "coreutils", "fincore": "util-linux", "sync": "coreutils"}
COMMAND_TIMEOUT = 600.0
TOOL_TIMEOUT = 1800.0
TRACE_WAIT = 30.0  # seconds past the trace window to wait for the trace object
SETTLE_TIMEOUT = 120.0  # for a replayed trace's prefetch to finish

GOAL_FETCH_OVER_READ = 1.3  # bytes fetched <= this x the bytes of the files the command opened
GOAL_SIZE_RATIO = 1.25  # first output on the largest image <= this x on the smallest
GOAL_CACHED_ONCE = 1.1  # page cache per byte read through the mount <= this x the plain directory's



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


def eager_section(images: Mapping[str, ImageInput], work: Path, trash: Trash, repeat: int
                  ) -> tuple[dict[str, Any], Path]:
    """Every case eagerly; what each command opens; the task; and the python tree kept as the
    plain directory (returned)."""
    base = work / "eager"
    cases = []
    n = 0
    kept = base / "plain-python"
    for tag, cmd in CASES:
        if tag not in images:
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
        "page_cache": {"bytes_read": n, "cached_delta": c1 - c0, "files_resident": resident,
                       "chunk_cache_resident": 0, "blob_resident": 0,
                       "resident_per_byte": ratio(resident, n), "cached_delta_per_byte": ratio(c1 - c0, n)},
    }


# -- layerbox hosts ----------------------------------------------------------------------------


@dataclass
class Ctx:
    kind: str  # "file" or "s3"
    url: str
    work: Path
    hosts: Path
    mnt: Path
    trace_seconds: float
    n: int = 0

    def fresh(self, label: str) -> tuple[Path, Path]:
        """A new host data dir and a new mount point."""
        self.n += 1
        root = self.hosts / f"{self.n:03d}-{label}"
        mp = self.mnt / f"{self.kind}-{self.n:03d}-{label}"
        mp.mkdir(parents=True)
        return root, mp


@contextlib.contextmanager
def host(ctx: Ctx, root: Path) -> Iterator[HostMounts]:
    """One host: its own data dir and daemon; everything unmounted and stopped however we leave."""
    hm = HostMounts(root, ctx.url, daemon_options={"trace_seconds": ctx.trace_seconds, "fetch_timeout": 60.0})
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
    hm.client.ensure_running(ctx.url, **hm.daemon_options)
    result = hm.mount(resolved, mp, writable=True, trace=trace)
    t1 = time.perf_counter()
    out = run_timed(chroot_argv(mp, TASK), env=CHROOT_ENV)
    return {"seconds": out.exited - t0, "mount": t1 - t0, "task": out.exited - t1}, result.trace


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
        log(f"[{ctx.kind}] replay: cold task {row['seconds']:.2f} s; waiting for its trace")
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


def pass_row(nbytes: int, seconds: float) -> dict[str, Any]:
    return {"bytes": nbytes, "seconds": seconds, "mb_per_s": rate(nbytes, seconds)}


def read_and_mount_section(ctx: Ctx, image: ImageInput, mounts: int) -> dict[str, Any]:
    """Sequential reads of /usr through the mount, the page cache they use, then mount times."""
    root, mp = ctx.fresh("read")
    with host(ctx, root) as hm:
        resolved = resolve(ctx.url, root, image.name)
        hm.mount(resolved, mp, trace=False)
        files = regular_files(mp / READ_TREE)
        passes = {}
        drop_caches()
        before = stats(hm)
        t0 = time.perf_counter()
        n = read_files(files)
        passes["store"] = {**pass_row(n, time.perf_counter() - t0), **stat_delta(stats(hm), before)}
        drop_caches()
        c0 = meminfo_cached()
        before = stats(hm)
        t0 = time.perf_counter()
        n = read_files(files)
        passes["chunk_cache"] = {**pass_row(n, time.perf_counter() - t0), **stat_delta(stats(hm), before)}
        c1 = meminfo_cached()
        files_res = resident_bytes(files)
        chunk_res = resident_bytes(regular_files(root / "chunks"))
        blobs = [root / "blobs" / layer.digest.removeprefix("blake3:") for layer in resolved.layers]
        blob_res = resident_bytes(blobs)
        before = stats(hm)
        t0 = time.perf_counter()
        n = read_files(files)
        passes["warm"] = {**pass_row(n, time.perf_counter() - t0), **stat_delta(stats(hm), before)}
        page_cache = {
            "bytes_read": n, "cached_delta": c1 - c0, "files_resident": files_res,
            "chunk_cache_resident": chunk_res, "blob_resident": blob_res,
            "resident_per_byte": ratio(files_res + chunk_res + blob_res, n),
            "cached_delta_per_byte": ratio(c1 - c0, n),
        }
        # unmounting the layers drops EROFS's page cache; the chunk files stay in memory, so
        # this pass costs only the FUSE round trips and the daemon
        hm.umount(mp)
        hm.mount(resolved, mp, trace=False)
        before = stats(hm)
        t0 = time.perf_counter()
        n = read_files(files)
        passes["fuse"] = {**pass_row(n, time.perf_counter() - t0), **stat_delta(stats(hm), before)}
        hm.umount(mp)
        log(f"[{ctx.kind}] mount times: {mounts} x 4 variants")
        times = mount_times(hm, resolved, mp, ctx.mnt / f"{ctx.kind}-holder", mounts)
    mp.rmdir()
    return {"files": len(files), "bytes": n, "passes": passes, "page_cache": page_cache, "mount_times": times}


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


def bench_backend(ctx: Ctx, images: Mapping[str, ImageInput], opened: Mapping[tuple[str, str], Any],
                  repeat: int, mounts: int) -> dict[str, Any]:
    publisher = ctx.hosts / "publisher"
    convert_dir = ctx.work / "convert"
    convert_dir.mkdir(exist_ok=True)
    published = asyncio.run(_publish_all(ctx.url, publisher, images, convert_dir))
    facts = asyncio.run(_store_facts(ctx.url, publisher, images))
    cases = []
    for tag, cmd in CASES:
        if tag not in images:
            continue
        lazy, pf = [], []
        for i in range(repeat):  # interleaved, so drift hits both alike
            log(f"[{ctx.kind}] first output: {tag} {cmd} ({i + 1}/{repeat})")
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
    log(f"[{ctx.kind}] replay of the task")
    replay = replay_section(ctx, images["python"], facts["python"]["digest"])
    log(f"[{ctx.kind}] sequential reads of /{READ_TREE}")
    reads = read_and_mount_section(ctx, images["python"], mounts)
    return {"url": ctx.url, "publish": published, "store": facts, "first_output": cases,
            "replay": replay, "read": {k: reads[k] for k in ("files", "bytes", "passes", "page_cache")},
            "mount_times": reads["mount_times"]}


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


def goals(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The issue's goals, per backend (see bench/README.md)."""
    out: dict[str, Any] = {}
    eager = {(c["image"], c["command"]): c for c in doc["eager"]["cases"]}
    sizes = {tag: img["compressed_bytes"] for tag, img in doc["images"].items()}
    plain_pc = doc["plain"]["page_cache"]["resident_per_byte"]
    for name, b in doc["backends"].items():
        fetch = [{"image": c["image"], "command": c["command"], "ratio": c["fetched_over_opened"],
                  "met": c["fetched_over_opened"] is not None and c["fetched_over_opened"] <= GOAL_FETCH_OVER_READ}
                 for c in b["first_output"]]
        size_rows = []
        for cmd in COMMANDS:
            rows = sorted((c for c in b["first_output"] if c["command"] == cmd), key=lambda c: sizes[c["image"]])
            if len(rows) < 2:
                continue
            small, large = rows[0], rows[-1]
            lazy_ratio = ratio(large["lazy"]["median"]["first_output"], small["lazy"]["median"]["first_output"])
            lm, sm = large["lazy"]["median"], small["lazy"]["median"]
            size_rows.append({
                "command": cmd, "small": small["image"], "large": large["image"],
                "size_ratio": ratio(sizes[large["image"]], sizes[small["image"]]),
                "lazy_ratio": lazy_ratio,
                "lazy_ratio_without_daemon": ratio(lm["first_output"] - lm["daemon"], sm["first_output"] - sm["daemon"]),
                "eager_ratio": ratio(eager[(large["image"], cmd)]["median"]["first_output"],
                                     eager[(small["image"], cmd)]["median"]["first_output"]),
                "met": lazy_ratio is not None and lazy_ratio <= GOAL_SIZE_RATIO,
            })
        mount_pc = b["read"]["page_cache"]["resident_per_byte"]
        out[name] = {
            "fetch_over_read": {"want": GOAL_FETCH_OVER_READ, "cases": fetch, "met": all(f["met"] for f in fetch)},
            "size_independent": {"want": GOAL_SIZE_RATIO, "pairs": size_rows,
                                 "met": bool(size_rows) and all(r["met"] for r in size_rows)},
            "cached_once": {"want": GOAL_CACHED_ONCE, "mount_per_byte": mount_pc, "plain_per_byte": plain_pc,
                            "ratio": ratio(mount_pc, plain_pc),
                            "met": (ratio(mount_pc, plain_pc) or math.inf) <= GOAL_CACHED_ONCE},
        }
    return out


# -- output ------------------------------------------------------------------------------------


def _mb(n: float | None, digits: int = 2) -> str:
    return "-" if n is None else f"{n / MB:.{digits}f}"


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1000:.1f}"


def _met(flag: bool) -> str:
    return "MET" if flag else "MISSED"


def render(doc: Mapping[str, Any]) -> str:
    s, env = doc["settings"], doc["environment"]
    backends = list(doc["backends"])
    out = [
        f"layerbox lazy-mount benchmark: backends {', '.join(backends)}; median of {s['repeat']} run(s) per "
        f"case; MB = 10^6 bytes",
        f"fixture: {s['fixture']}; work dir {env['workdir']}; {env['cpus']} CPUs; kernel {env['kernel']}; "
        f"load average {env['loadavg_start']} at start, {env['loadavg_end']} at end",
        f"peers: {env['skopeo']}, {env['umoci']}; page cache dropped before every cold run",
        "",
        "Images",
    ]
    rows = []
    for tag, img in doc["images"].items():
        rows.append([tag, str(img["layers"]), _mb(img["compressed_bytes"]), str(img["files"]),
                     _mb(img["file_bytes"]), img["src"]])
    out.append(_table(["image", "layers", "gzip MB", "files", "file MB", "source"], rows, left=1))
    out.append("")

    out.append("Time to first output from an empty host (seconds; eager: download = skopeo copy, "
               "unpack = umoci unpack; layerbox: fresh data dir and daemon)")
    rows = []
    for c in doc["eager"]["cases"]:
        m = c["median"]
        rows.append([c["image"], c["command"], "eager skopeo+umoci", _f(m["first_output"], 3),
                     _f(m["first_output"], 3), "-", "-",
                     _f(m["download"], 3), _f(m["unpack"], 3), _f(m["command"], 3),
                     _mb(m["bytes_downloaded"]), "-"])
        for name in backends:
            fo = next(x for x in doc["backends"][name]["first_output"]
                      if (x["image"], x["command"]) == (c["image"], c["command"]))
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
               "the kernel read through FUSE; opened = sizes of the image files the command opened (strace)")
    rows = []
    opened = {(c["image"], c["command"]): c["opened"] for c in doc["eager"]["cases"]}
    for name in backends:
        for c in doc["backends"][name]["first_output"]:
            m = c["lazy"]["median"]
            o = opened[(c["image"], c["command"])]
            rows.append([name, c["image"], c["command"], str(o["files"]), _mb(o["bytes"]), _mb(m["bytes_served"]),
                         _mb(m["bytes_fetched"]), str(int(m["chunks_fetched"])), _mb(c["metadata_bytes"]),
                         _mb(doc["images"][c["image"]]["compressed_bytes"]),
                         _f(c["fetched_over_opened"]), _f(c["fetched_over_served"])])
    out.append(_table(["backend", "image", "cmd", "files opened", "opened MB", "served MB", "fetched MB",
                       "chunks", "metadata MB", "eager MB", "fetched/opened", "fetched/served"], rows, left=3))
    out.append("  metadata = image document + metadata images + pack indexes a fresh host also fetches "
               "(not in 'fetched'); eager MB = the gzip layers a pull downloads")
    out.append("")

    t = doc["eager"]["task"]
    out.append(f"Replay of a task (writable mount): {TASK_SCRIPT}")
    out.append(f"  opened by the task: {t['opened']['files']} files, {_mb(t['opened']['bytes'])} MB")
    rows = [["eager", "skopeo copy + umoci unpack + task", _f(t["eager"]["median"]["seconds"], 3), "-",
             _f(t["eager"]["median"]["download"] + t["eager"]["median"]["unpack"], 3),
             _f(t["eager"]["median"]["seconds"] - t["eager"]["median"]["download"] - t["eager"]["median"]["unpack"], 3),
             _mb(t["eager"]["median"]["bytes_downloaded"]), "-", "-", "-"],
            ["eager", "plain dir, page cache dropped", _f(t["plain_cold"]["median"]["seconds"], 3), "-", "-",
             _f(t["plain_cold"]["median"]["seconds"], 3), "0.00", "-", "-", "-"],
            ["eager", "plain dir, hot", _f(t["plain_hot"]["median"]["seconds"], 3), "-", "-",
             _f(t["plain_hot"]["median"]["seconds"], 3), "0.00", "-", "-", "-"]]
    labels = {"cold": "cold, empty cache (records trace)", "trace": "new host, trace replayed",
              "cached": "same host, page cache dropped", "hot": "same host, hot"}
    for name in backends:
        r = doc["backends"][name]["replay"]
        for key, label in labels.items():
            row = r[key]
            rows.append([name, label, _f(row["seconds"], 3), _f(row["mount"], 3), "-", _f(row["task"], 3),
                         _mb(row["bytes_fetched"]), str(row["store_requests"]), str(row["misses"]),
                         str(row["chunks_prefetched"])])
    out.append(_table(["backend", "run", "total s", "mount s", "pull s", "task s", "fetched MB", "req",
                       "misses", "prefetched"], rows, left=2))
    for name in backends:
        r = doc["backends"][name]["replay"]
        end = r["trace"]["at_task_end"]
        out.append(f"  [{name}] trace window {r['trace_seconds']} s, trace object {r['trace_bytes']} B; with the "
                   f"trace, at task end: {_mb(end['bytes_fetched'])} MB fetched, {end['misses']} misses "
                   f"(reads that waited for the store)")
    out.append("")

    p = doc["plain"]
    out.append(f"Sequential read of every file under /{READ_TREE} of the python image "
               f"({p['files']} files, {_mb(p['bytes'])} MB), 1 MiB reads, one thread")
    rows = [["plain dir", "page cache dropped", *_pass(p["passes"]["cold"])],
            ["plain dir", "warm", *_pass(p["passes"]["warm"])]]
    labels = {"store": "empty host cache (fetch from store)", "chunk_cache": "chunk cache, page cache dropped",
              "warm": "warm", "fuse": "fresh layer mounts, chunk files in page cache"}
    for name in backends:
        for key, label in labels.items():
            rows.append([f"mount [{name}]", label, *_pass(doc["backends"][name]["read"]["passes"][key])])
    out.append(_table(["what", "pass", "MB", "s", "MB/s", "FUSE chunk reads"], rows, left=2))
    out.append("")

    out.append("Page cache after one pass from a dropped page cache (mount: chunk cache full); resident = fincore")
    rows = [["plain dir", *_pc(p["page_cache"])]]
    for name in backends:
        rows.append([f"mount [{name}]", *_pc(doc["backends"][name]["read"]["page_cache"])])
    out.append(_table(["what", "MB read", "files res MB", "chunk cache res MB", "blob res MB",
                       "resident/byte", "Cached delta MB", "delta/byte"], rows))
    out.append("  files = the files read (EROFS's page cache through the overlay); chunk cache = the daemon's "
               "cache directory; blob = the FUSE blob files; Cached delta = /proc/meminfo, system-wide "
               "(other processes' I/O lands in it too)")
    out.append("")

    out.append("Mount time of a cached image (ms; HostMounts.mount on a running daemon; umount separately)")
    rows = []
    names = {"ro": "read-only", "ro_shared": "read-only, layers shared", "rw": "writable",
             "rw_shared": "writable, layers shared"}
    for name in backends:
        for key, label in names.items():
            m = doc["backends"][name]["mount_times"][key]
            rows.append([name, label, str(m["n"]), _ms(m["mount"]["p50"]), _ms(m["mount"]["p99"]),
                         _ms(m["mount"]["max"]), _ms(m["umount"]["p50"]), _ms(m["umount"]["p99"]),
                         f"{m['layer_mounts_created']:.0f}"])
    out.append(_table(["backend", "variant", "n", "mount p50", "p99", "max", "umount p50", "p99",
                       "EROFS mounts/call"], rows, left=2))
    out.append("")

    out.append("Goals")
    for name, g in doc["goals"].items():
        f = g["fetch_over_read"]
        worst = max((c["ratio"] for c in f["cases"] if c["ratio"] is not None), default=None)
        out.append(f"  [{name}] bytes fetched <= {f['want']} x bytes opened, every case: {_met(f['met'])} "
                   f"(worst {_f(worst)}: " + ", ".join(f"{c['image']}/{c['command']} {_f(c['ratio'])}"
                                                      for c in f["cases"]) + ")")
        si = g["size_independent"]
        for r in si["pairs"]:
            out.append(f"  [{name}] first output independent of image size ({r['command']}: {r['large']} is "
                       f"{_f(r['size_ratio'], 1)}x {r['small']}): lazy {_f(r['lazy_ratio'])}x, want <= "
                       f"{si['want']}: {_met(r['met'])} (without the daemon start {_f(r['lazy_ratio_without_daemon'])}x; "
                       f"eager {_f(r['eager_ratio'])}x)")
        co = g["cached_once"]
        out.append(f"  [{name}] data cached once: page cache per byte read {_f(co['mount_per_byte'])} through the "
                   f"mount vs {_f(co['plain_per_byte'])} plain = {_f(co['ratio'])}x, want <= {co['want']}x: "
                   f"{_met(co['met'])}")
    out.append(f"  mounts left under the work dir after every host's teardown: {len(doc['leftover_mounts'])}; "
               f"after cleanup: {len(doc['mounts_after_cleanup'])}")
    return "\n".join(out)


def _pass(p: Mapping[str, Any]) -> list[str]:
    reads = p["hits"] + p["misses"] if "hits" in p else None
    return [_mb(p["bytes"]), _f(p["seconds"], 3), _f(p["mb_per_s"], 1), "-" if reads is None else str(reads)]


def _pc(pc: Mapping[str, Any]) -> list[str]:
    return [_mb(pc["bytes_read"]), _mb(pc["files_resident"]), _mb(pc["chunk_cache_resident"]),
            _mb(pc["blob_resident"]), _f(pc["resident_per_byte"]), _mb(pc["cached_delta"]),
            _f(pc["cached_delta_per_byte"])]


# -- command line ------------------------------------------------------------------------------


def run_backend(kind: str, work: Path, images: Mapping[str, ImageInput], opened: Mapping[tuple[str, str], Any],
                args: argparse.Namespace) -> dict[str, Any]:
    def ctx(url: str) -> Ctx:
        return Ctx(kind, url, work, work / "hosts" / kind, work / "mnt", args.trace_seconds)

    if kind == "file":
        return bench_backend(ctx(f"file://{work / 'stores' / 'file'}"), images, opened, args.repeat, args.mounts)
    try:
        from tests.support.moto import MotoServer
    except ImportError as exc:
        raise BenchError(f"the s3 backend needs moto and the test support code ({exc}); "
                         "pip install -e '.[test]', or pass --backends file") from None
    log("[s3] starting moto_server on 127.0.0.1")
    try:
        server = MotoServer()
    except (OSError, RuntimeError) as exc:
        raise BenchError(f"cannot start moto_server: {exc}") from None
    try:
        with aws_environment(server.endpoint, work):
            result = bench_backend(ctx(f"s3://{server.new_bucket()}/layerbox"), images, opened,
                                   args.repeat, args.mounts)
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
                   help="comma-separated: file, s3 (default file,s3; s3 starts a moto server on 127.0.0.1)")
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
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the tables")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quick = args.quick
    args.repeat = args.repeat if args.repeat is not None else (1 if quick else 3)
    args.mounts = args.mounts if args.mounts is not None else (10 if quick else 100)
    args.filler_mb = args.filler_mb if args.filler_mb is not None else (32 if quick else 512)
    args.trace_seconds = args.trace_seconds if args.trace_seconds is not None else (3.0 if quick else 5.0)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or any(b not in ("file", "s3") for b in backends) or len(set(backends)) != len(backends):
        print(f"bench/lazy.py: --backends {args.backends!r}: use file, s3 or file,s3", file=sys.stderr)
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
        fixture = find_fixture(args.fixture)
        with workspace(args.tmpdir, "layerbox-bench-lazy-", before_removal=unmount_leftovers) as work:
            try:
                trash = Trash(work / "trash")
                images = prepare_images(fixture, work, args.filler_mb)
                eager, rootfs = eager_section(images, work, trash, args.repeat)
                log("plain directory: sequential reads")
                plain = plain_read(rootfs)
                opened = {(c["image"], c["command"]): c["opened"] for c in eager["cases"]}
                results = {kind: run_backend(kind, work, images, opened, args) for kind in backends}
            finally:
                leftovers = kmount.mounts_under(work)
            doc: dict[str, Any] = {
                "schema": SCHEMA,
                "settings": {"backends": backends, "quick": quick, "repeat": args.repeat, "mounts": args.mounts,
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

