"""Benchmark: incremental checkpoints of a writable mount against tar + zstd of its upper directory.

One run, on one disk, against one ``file://`` store:

1. **Base image**: a tree of random (incompressible) data, a few large files
   and many small ones (~1 GB; ``--tree-mb``), published as ``bench/base``.
2. **Host 1** mounts it writable (lazy EROFS layers under an overlayfs with an
   upper directory) and runs a sequence of *steps*.  Each step writes into
   the mount (new files, half-overwritten existing small files, which
   overlayfs copies up whole, a few deletions, and a 256 KB probe file), then
   ``Snapshots.checkpoint`` captures it, and then the **naive method** packs
   the whole upper directory: ``tar -C UPPER -cf - . | zstd -3`` to a file.
   Steps: 1, 10 and 100 MB changes (``--changes``); 1 MB written in place into
   one large file (copied up whole, its other chunks already in the store); a
   bulk write as large as the tree (``--bulk-mb``), checkpointed like the
   others; and 1 MB again, now on an upper directory holding all of that.
3. **Restore**, per checkpoint, on a **fresh host** (new data dir, new daemon,
   empty cache): ``Snapshots.restore`` and the first read of that step's
   probe file, with the bytes the daemon fetched; against the naive restore,
   ``zstd -d | tar -x`` of that step's archive and the same read.

The goal, from the issue: checkpoint cost proportional to what changed, not
to what the upper directory holds.

Nothing is deleted before the end (ext4 without a journal slows file creation
after deletions; bench/README.md, convert.py caveats).  Every mount and daemon
is removed in ``finally`` (also on Ctrl-C and SIGTERM), then the work directory;
the run checks that no mount is left under it.

Run ``python bench/snapshots.py --help``; bench/README.md explains every number.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import math
import os
import platform
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: import the checkout, installed or not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import BenchError, _f, _table, emit, log  # shared by the benchmarks

from converters.layer import DEFAULT_CHUNK_SIZE  # noqa: E402
from converters.publish import PublishResult, publish  # noqa: E402
from layerstore.errors import LayerboxError  # noqa: E402
from layerstore.store import Store  # noqa: E402
from lazyfetch import kmount  # noqa: E402
from lazyfetch.mounts import HostMounts  # noqa: E402
from snapshots.checkpoint import Checkpoint, Snapshots  # noqa: E402

SCHEMA = "layerbox.bench.snapshots.v1"
MB = 1_000_000
READ_SIZE = 1 << 20
ZSTD_LEVEL = 3
TOOL_TIMEOUT = 3600.0
BASE_REF = "bench/base"
PROBE_BYTES = 256_000  # every step writes one; restores read it
LARGE_SHARE = 0.5  # of the base tree's bytes, in the large files
SMALL_SIZES = (512, 512_000)  # log-uniform sizes of the base's small files
NEW_SIZES = (1_000, 1_000_000)  # log-uniform sizes of the files a step creates
MODIFY_SHARE = 0.3  # of a step's bytes written into existing small files (half of each, from offset 0)
BULK_MODIFY_SHARE = 0.1  # the bulk step's share, so later steps still find untouched base files
DELETES_PER_STEP = 2
TOP_DIRS, SUB_DIRS = 16, 8  # the base's small files live in small/dNN/eN/
GOAL_FACTOR = 2.0  # the last 1 MB step may cost at most this many times the first one's
GOAL_UPLOAD_PER_WRITTEN = 2.0  # no step may upload more than this many times what it wrote



class Signals:
    """SIGINT, SIGTERM and SIGHUP end the run with an exception that unwinds through every ``finally``.

    Inside ``critical()`` (starting a daemon, mounting, unmounting, the final
    cleanup) a signal waits until the section ends: a daemon whose start is
    interrupted comes up afterwards, before it answers on its socket, and
    ``umount_all(stop_daemon=True)`` cannot stop what does not answer yet.
    Signals the caller ignores (a background job's SIGINT, nohup's SIGHUP)
    stay ignored.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.pending: int | None = None

    @staticmethod
    def _raise(signum: int) -> None:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def _handler(self, signum: int, _frame: Any) -> None:
        if self.depth:
            self.pending = signum
        else:
            self._raise(signum)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        old = {}
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is not signal.SIG_IGN:
                old[sig] = signal.signal(sig, self._handler)
        try:
            yield
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    @contextlib.contextmanager
    def critical(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if not self.depth and self.pending is not None:
                signum, self.pending = self.pending, None
                self._raise(signum)


SIGNALS = Signals()


# -- the base tree ---------------------------------------------------------------------------


@dataclass
class BaseTree:
    root: Path
    large: list[tuple[str, int]]  # (relative path, size)
    small: list[tuple[str, int]]
    dirs: list[str]  # directories holding small files

    @property
    def file_bytes(self) -> int:
        return sum(size for _, size in self.large + self.small)


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def write_file(path: Path, size: int) -> None:
    with path.open("wb") as f:
        left = size
        while left:
            n = min(left, READ_SIZE)
            f.write(os.urandom(n))
            left -= n


def overwrite(path: Path, offset: int, size: int) -> None:
    """Write ``size`` random bytes at ``offset`` of an existing file (overlayfs copies it up first).

    A file object, not a bare ``os.open`` descriptor: a Ctrl-C that lands
    right after the (slow, copy-up) open would leak the descriptor and keep
    the detached overlay, its layers and the FUSE daemon busy.
    """
    with path.open("r+b", buffering=0) as f:
        os.pwrite(f.fileno(), os.urandom(size), offset)


def build_tree(root: Path, total: int, large_files: int, rng: random.Random) -> BaseTree:
    """``total`` bytes of random data: ``large_files`` equal large files and many small ones."""
    tree = BaseTree(root, [], [], [])
    (root / "large").mkdir(parents=True)
    large_each = int(total * LARGE_SHARE) // large_files
    for i in range(large_files):
        rel = f"large/big-{i}.bin"
        write_file(root / rel, large_each)
        tree.large.append((rel, large_each))
    tree.dirs = [f"small/d{i:02d}/e{j}" for i in range(TOP_DIRS) for j in range(SUB_DIRS)]
    for d in tree.dirs:
        (root / d).mkdir(parents=True)
    left = total - large_each * large_files
    n = 0
    while left > 0:
        size = min(left, log_uniform(rng, *SMALL_SIZES))
        rel = f"{tree.dirs[rng.randrange(len(tree.dirs))]}/f{n:05d}.bin"
        write_file(root / rel, size)
        tree.small.append((rel, size))
        left -= size
        n += 1
    return tree


# -- steps ------------------------------------------------------------------------------------


@dataclass
class StepPlan:
    name: str
    kind: str  # "mixed", "in-place" or "bulk"
    target: int  # bytes to write


@dataclass
class Written:
    """What one step did to the mount."""

    bytes: int = 0
    files_new: int = 0
    files_modified: int = 0
    files_deleted: int = 0
    copied_up_bytes: int = 0  # sizes of the existing files it modified (overlayfs copies them up whole)
    probe: str = ""
    probe_sha256: str = ""
    seconds: float = 0.0


@dataclass
class Mutator:
    """Applies steps to the mount; remembers which base files are still untouched."""

    mnt: Path
    tree: BaseTree
    rng: random.Random
    untouched_small: list[tuple[str, int]] = field(default_factory=list)
    untouched_large: list[tuple[str, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.untouched_small = list(self.tree.small)
        self.rng.shuffle(self.untouched_small)
        self.untouched_large = list(self.tree.large)

    def apply(self, index: int, plan: StepPlan) -> Written:
        start = time.perf_counter()
        out = Written()
        step_dir = self.mnt / "changes" / f"s{index:02d}"
        step_dir.mkdir(parents=True)
        data = os.urandom(PROBE_BYTES)
        (step_dir / "probe.bin").write_bytes(data)
        out.probe = f"changes/s{index:02d}/probe.bin"
        out.probe_sha256 = hashlib.sha256(data).hexdigest()
        out.bytes = PROBE_BYTES
        out.files_new = 1
        if plan.kind == "in-place":
            if not self.untouched_large:
                raise BenchError("no untouched large file left for the in-place step")
            rel, size = self.untouched_large.pop(0)
            n = plan.target - out.bytes
            # one chunk-aligned range: the rest of the file's chunks are in the store already
            offset = (size // 2) // DEFAULT_CHUNK_SIZE * DEFAULT_CHUNK_SIZE
            overwrite(self.mnt / rel, offset, n)
            out.bytes += n
            out.files_modified += 1
            out.copied_up_bytes += size
        else:
            for _ in range(DELETES_PER_STEP):
                if self.untouched_small:
                    rel, _size = self.untouched_small.pop()
                    (self.mnt / rel).unlink()
                    out.files_deleted += 1
            share = BULK_MODIFY_SHARE if plan.kind == "bulk" else MODIFY_SHARE
            budget = int(plan.target * share)
            while budget > 0 and self.untouched_small:
                rel, size = self.untouched_small.pop()
                n = min(max(1, size // 2), budget, plan.target - out.bytes)
                overwrite(self.mnt / rel, 0, n)
                budget -= n
                out.bytes += n
                out.files_modified += 1
                out.copied_up_bytes += size
            n_new = 0
            while out.bytes < plan.target:
                size = min(plan.target - out.bytes, log_uniform(self.rng, *NEW_SIZES))
                if n_new % 4 == 3:  # some into the base's directories (overlayfs copies those up)
                    d = self.mnt / self.tree.dirs[self.rng.randrange(len(self.tree.dirs))]
                    path = d / f"new-s{index:02d}-{n_new:05d}.bin"
                else:
                    d = step_dir / f"d{n_new // 64:03d}"
                    d.mkdir(exist_ok=True)
                    path = d / f"n{n_new:05d}.bin"
                write_file(path, size)
                out.bytes += size
                out.files_new += 1
                n_new += 1
        os.sync()  # the step's writeback must not land in the checkpoint's or tar's timing
        out.seconds = time.perf_counter() - start
        return out


def upper_size(upper: Path) -> tuple[int, int]:
    """(regular-file bytes, entries) of an upper directory."""
    nbytes = entries = 0
    for dirpath, dirnames, filenames in os.walk(upper):
        entries += len(dirnames) + len(filenames)
        for name in filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if stat.S_ISREG(st.st_mode):
                nbytes += st.st_size
    return nbytes, entries


def read_file(path: Path) -> bytes:
    with path.open("rb") as f:
        return f.read()


# -- the naive method: tar + zstd of the whole upper directory ---------------------------------


def pipeline(first: list[str], second: list[str], *, stdout: Any = subprocess.DEVNULL) -> None:
    """``first | second``, each in its own session; both are killed if anything goes wrong."""
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryFile() as err1, tempfile.TemporaryFile() as err2:
        try:
            p1 = subprocess.Popen(first, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err1,
                                  start_new_session=True)
            procs.append(p1)
            assert p1.stdout is not None
            p2 = subprocess.Popen(second, stdin=p1.stdout, stdout=stdout, stderr=err2, start_new_session=True)
            procs.append(p2)
            p1.stdout.close()
            deadline = time.monotonic() + TOOL_TIMEOUT
            rc2 = p2.wait(timeout=TOOL_TIMEOUT)
            rc1 = p1.wait(timeout=max(1.0, deadline - time.monotonic()))
        except OSError as exc:
            raise BenchError(f"cannot run {exc.filename or first[0]}: {exc.strerror} "
                             "(apt-get install tar zstd)") from None
        except BaseException:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            raise
        for argv, rc, err in ((first, rc1, err1), (second, rc2, err2)):
            if rc != 0:
                err.seek(0)
                raise BenchError(f"{' '.join(argv)} failed ({rc}): "
                                 f"{err.read()[-2000:].decode(errors='replace')}")


def fsync_path(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def naive_checkpoint(upper: Path, out: Path) -> dict[str, Any]:
    start = time.perf_counter()
    pipeline(["tar", "-C", str(upper), "-cf", "-", "."],
             ["zstd", f"-{ZSTD_LEVEL}", "-q", "-o", str(out)])
    fsync_path(out)  # a checkpoint that is not on disk is not one; the store fsyncs its packs too
    return {"seconds": time.perf_counter() - start, "bytes": out.stat().st_size}


def naive_restore(archive: Path, dest: Path, probe: str, sha256: str) -> dict[str, Any]:
    dest.mkdir(parents=True)
    start = time.perf_counter()
    pipeline(["zstd", "-d", "-q", "-c", str(archive)], ["tar", "-x", "-C", str(dest)])
    data = read_file(dest / probe)
    seconds = time.perf_counter() - start
    if hashlib.sha256(data).hexdigest() != sha256:
        raise BenchError(f"naive restore of {archive}: {probe} does not hold what was written")
    return {"seconds": seconds, "bytes": archive.stat().st_size}


# -- layerbox ------------------------------------------------------------------------------------


class Hosts:
    """Every HostMounts the run made; ``close`` unmounts them all and stops their daemons."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.made: list[HostMounts] = []

    def new(self, data_dir: Path) -> HostMounts:
        # no background fill: the restore rows measure what a lazy restore fetches by itself
        host = HostMounts(data_dir, self.url, daemon_options={"fill_below": 0})
        self.made.append(host)
        return host

    def start(self, data_dir: Path) -> tuple[HostMounts, float]:
        """A new host with its daemon running (a host's daemon runs before work arrives), and its start seconds."""
        host = self.new(data_dir)
        start = time.perf_counter()
        with SIGNALS.critical():
            host.start_daemon()
        return host, time.perf_counter() - start

    def release(self, host: HostMounts) -> None:
        with SIGNALS.critical():
            host.umount_all(stop_daemon=True)
        self.made.remove(host)

    def close(self) -> list[str]:
        problems = []
        for host in reversed(self.made):
            try:
                host.umount_all(stop_daemon=True)
            except Exception as exc:  # keep tearing the others down; reported at the end
                problems.append(f"{host.data_dir}: umount_all: {exc}")
        self.made.clear()
        return problems


SUN_PATH_MAX = 107  # bytes of a unix socket path (sockaddr_un.sun_path is 108 with the NUL)


def host_dir(work: Path, name: str) -> Path:
    """A host's data dir; its daemon listens on DATA_DIR/lazyfetch.sock, so the path must stay short."""
    path = work / "h" / name
    sock = os.fsencode(path / "lazyfetch.sock")
    if len(sock) > SUN_PATH_MAX:
        raise BenchError(f"{os.fsdecode(sock)} is {len(sock)} bytes, more than a unix socket path may be "
                         f"({SUN_PATH_MAX}); pass a shorter --tmpdir")
    return path


async def _publish(url: str, data_dir: Path, src: Path, work: Path) -> PublishResult:
    async with await Store.open(url, data_dir) as store:
        return await publish(store, str(src), BASE_REF, work_dir=work)


async def _resolve(url: str, data_dir: Path, ref: str) -> Any:
    async with await Store.open(url, data_dir) as store:
        return await store.resolve(ref, refresh=True)


async def _checkpoint(url: str, host: HostMounts, mnt: Path, label: str) -> tuple[Checkpoint, float]:
    start = time.perf_counter()
    async with await Store.open(url, host.data_dir) as store:
        ckpt = await Snapshots(store, host).checkpoint(str(mnt), labels={"bench": label})
    return ckpt, time.perf_counter() - start


async def _restore(url: str, host: HostMounts, ref: str, mnt: Path) -> float:
    async with await Store.open(url, host.data_dir) as store:
        snaps = Snapshots(store, host)
        start = time.perf_counter()
        await snaps.restore(ref, str(mnt))
        return time.perf_counter() - start


def restore_ours(url: str, hosts: Hosts, work: Path, index: int, ckpt: Checkpoint,
                 written: Written) -> dict[str, Any]:
    host, daemon_seconds = hosts.start(host_dir(work, f"r{index:02d}"))
    mnt = work / "mnt" / f"r{index:02d}"
    mnt.mkdir(parents=True)
    with SIGNALS.critical():  # it mounts
        restore_seconds = asyncio.run(_restore(url, host, ckpt.name, mnt))
    start = time.perf_counter()
    data = read_file(mnt / written.probe)
    read_seconds = time.perf_counter() - start
    if hashlib.sha256(data).hexdigest() != written.probe_sha256:
        raise BenchError(f"restore of {ckpt.name}: {written.probe} does not hold what was written")
    stats = host.client.request("GET", "/stats")
    meta_bytes = sum(p.stat().st_size for p in (host.data_dir / "meta").glob("*.erofs"))
    hosts.release(host)
    return {
        "layers": ckpt.layers, "daemon_start_seconds": daemon_seconds, "restore_seconds": restore_seconds,
        "read_seconds": read_seconds, "first_read_seconds": restore_seconds + read_seconds,
        "bytes_fetched": int(stats["bytes_fetched"]), "store_requests": int(stats["store_requests"]),
        "chunks_prefetched": int(stats["chunks_prefetched"]), "misses": int(stats["misses"]),
        "meta_bytes": meta_bytes,
    }


def ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def step_plans(changes: Sequence[int], bulk: int) -> list[StepPlan]:
    plans = [StepPlan(f"{c} MB", "mixed", c * MB) for c in changes]
    plans.append(StepPlan("1 MB in a large file", "in-place", MB))
    plans.append(StepPlan(f"{bulk} MB bulk", "bulk", bulk * MB))
    plans.append(StepPlan(f"{changes[0]} MB, full upper", "mixed", changes[0] * MB))
    return plans


def run_bench(args: argparse.Namespace, work: Path, hosts: Hosts) -> dict[str, Any]:
    url = f"file://{work / 'store'}"
    host_dir(work, "r00")  # the longest data dir: fail now if it is too long, not after the checkpoints
    rng = random.Random(args.seed)
    log(f"building the base tree: {args.tree_mb} MB of random data")
    start = time.perf_counter()
    tree = build_tree(work / "base", args.tree_mb * MB, args.large_files, rng)
    build_seconds = time.perf_counter() - start
    os.sync()
    log(f"publishing it as {BASE_REF} ({len(tree.large)} large + {len(tree.small)} small files)")
    pub_work = work / "publish-work"
    pub_work.mkdir()
    pub = asyncio.run(_publish(url, host_dir(work, "pub"), tree.root, pub_work))

    host1, _ = hosts.start(host_dir(work, "1"))
    mnt = work / "mnt" / "1"
    mnt.mkdir(parents=True)
    resolved = asyncio.run(_resolve(url, host1.data_dir, BASE_REF))
    with SIGNALS.critical():
        result = host1.mount(resolved, mnt, writable=True)
    assert result.upper is not None
    upper = Path(result.upper)
    mutator = Mutator(mnt, tree, rng)
    naive_dir = work / "naive"
    naive_dir.mkdir()

    steps: list[dict[str, Any]] = []
    records: list[tuple[Checkpoint, Written]] = []
    for i, plan in enumerate(step_plans(args.changes, args.bulk_mb)):
        log(f"step {i + 1}: {plan.name}: writing")
        written = mutator.apply(i, plan)
        upper_bytes, upper_entries = upper_size(upper)
        log(f"step {i + 1}: checkpoint (upper {upper_bytes / MB:.1f} MB, {upper_entries} entries)")
        ckpt, call_seconds = asyncio.run(_checkpoint(url, host1, mnt, plan.name))
        log(f"step {i + 1}: naive tar | zstd -{ZSTD_LEVEL} of the upper directory")
        naive = naive_checkpoint(upper, naive_dir / f"step-{i:02d}.tar.zst")
        records.append((ckpt, written))
        steps.append({
            "name": plan.name, "kind": plan.kind, "written_bytes": written.bytes,
            "files_new": written.files_new, "files_modified": written.files_modified,
            "files_deleted": written.files_deleted, "copied_up_bytes": written.copied_up_bytes,
            "write_seconds": written.seconds, "probe": written.probe,
            "upper_bytes": upper_bytes, "upper_entries": upper_entries,
            "checkpoint": {
                "name": ckpt.name, "digest": ckpt.digest, "layers": ckpt.layers, "entries": ckpt.entries,
                "bytes_captured": ckpt.bytes_changed, "bytes_uploaded": ckpt.bytes_uploaded,
                "seconds": ckpt.seconds, "freeze_seconds": ckpt.freeze_seconds, "call_seconds": call_seconds,
            },
            "naive": naive,
            "uploaded_over_written": ratio(ckpt.bytes_uploaded, written.bytes),
            "naive_over_ours": {"seconds": ratio(naive["seconds"], ckpt.seconds),
                                "bytes": ratio(naive["bytes"], ckpt.bytes_uploaded)},
        })
    host1_stats = host1.client.request("GET", "/stats")
    hosts.release(host1)  # restores happen elsewhere; host 1's mount is done

    for i, (ckpt, written) in enumerate(records):
        log(f"restore {i + 1}/{len(records)}: {ckpt.name} on a fresh host, then the naive archive")
        ours = restore_ours(url, hosts, work, i, ckpt, written)
        naive = naive_restore(naive_dir / f"step-{i:02d}.tar.zst", work / "naive-restore" / f"step-{i:02d}",
                              written.probe, written.probe_sha256)
        steps[i]["restore"] = {"ours": ours, "naive": naive,
                               "naive_over_ours_seconds": ratio(naive["seconds"], ours["first_read_seconds"])}

    return {
        "base": {"ref": BASE_REF, "file_bytes": tree.file_bytes, "large_files": len(tree.large),
                 "large_file_bytes": tree.large[0][1], "small_files": len(tree.small),
                 "small_file_bytes": sum(s for _, s in tree.small), "dirs": len(tree.dirs),
                 "build_seconds": build_seconds, "publish": pub.to_json()},
        "host1": {"bytes_fetched": int(host1_stats["bytes_fetched"]), "upper": str(upper)},
        "steps": steps,
    }


def goals(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """'Checkpoint cost proportional to what changed', not to what the upper directory holds.

    * the last step (the first step's change, on an upper directory holding
      everything written before, the bulk included) costs at most
      ``GOAL_FACTOR`` times the first step's, in checkpoint seconds and in
      bytes uploaded;
    * no step uploads more than ``GOAL_UPLOAD_PER_WRITTEN`` times what it wrote.
    """
    first, last = steps[0], steps[-1]
    seconds = ratio(last["checkpoint"]["seconds"], first["checkpoint"]["seconds"])
    uploaded = ratio(last["checkpoint"]["bytes_uploaded"], first["checkpoint"]["bytes_uploaded"])
    worst = max(steps, key=lambda s: s["uploaded_over_written"] or 0)
    seconds_met = seconds is not None and seconds <= GOAL_FACTOR
    uploaded_met = uploaded is not None and uploaded <= GOAL_FACTOR
    per_written_met = all(s["uploaded_over_written"] is not None
                          and s["uploaded_over_written"] <= GOAL_UPLOAD_PER_WRITTEN for s in steps)
    return {"proportional": {
        "first": first["name"], "last": last["name"],
        "upper_bytes": {"first": first["upper_bytes"], "last": last["upper_bytes"]},
        "seconds_ratio": seconds, "uploaded_ratio": uploaded, "want": GOAL_FACTOR,
        "seconds_met": seconds_met, "uploaded_met": uploaded_met,
        "worst_uploaded_over_written": {"step": worst["name"], "ratio": worst["uploaded_over_written"]},
        "want_uploaded_over_written": GOAL_UPLOAD_PER_WRITTEN, "uploaded_over_written_met": per_written_met,
        "naive_over_ours_last": last["naive_over_ours"],
        "met": seconds_met and uploaded_met and per_written_met,
    }}


# -- output -------------------------------------------------------------------------------------


def _mb(n: int | float) -> str:
    return f"{n / MB:.2f}"


def _kb(n: int | float) -> str:
    return f"{n / 1000:.1f}"


def _x(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}x" if value >= 100 else f"{value:.1f}x" if value >= 10 else f"{value:.2f}x"


def render(doc: dict[str, Any]) -> str:
    s, env, base, steps = doc["settings"], doc["environment"], doc["base"], doc["steps"]
    pub = base["publish"]
    out = [
        f"layerbox snapshot benchmark: base tree {_mb(base['file_bytes'])} MB of random data "
        f"({base['large_files']} files of {_mb(base['large_file_bytes'])} MB + {base['small_files']} small "
        f"files in {base['dirs']} dirs), file store; MB = 10^6 bytes",
        f"workdir: {env['workdir']} ({env['filesystem']}); {env['cpus']} CPUs; kernel {env['kernel']}; "
        f"Python {env['python']}; {env['zstd']}; {env['tar']}",
        f"publish of the base: {_f(pub['seconds'])} s ({_f(pub['bytes'] / MB / pub['seconds'], 1)} MB/s), "
        f"{_mb(pub['bytes_uploaded'])} MB uploaded; steps: changes of {', '.join(map(str, s['changes_mb']))} MB, "
        f"1 MB in place in a large file, {s['bulk_mb']} MB bulk, {s['changes_mb'][0]} MB again; "
        f"chunk size {s['chunk_size'] >> 10} KiB",
        "",
        "Checkpoints on host 1 (one writable mount; each step written, synced, then checkpointed; "
        f"naive = tar -C UPPER -cf - . | zstd -{ZSTD_LEVEL} + fsync)",
    ]
    rows = []
    for st in steps:
        c, n = st["checkpoint"], st["naive"]
        rows.append([
            st["name"], _mb(st["written_bytes"]), f"{_mb(st['upper_bytes'])} ({st['upper_entries']})",
            _mb(c["bytes_captured"]), str(c["entries"]), _mb(c["bytes_uploaded"]),
            _f(st["uploaded_over_written"]), _f(c["seconds"], 3), _f(c["freeze_seconds"], 3),
            _f(n["seconds"], 3), _mb(n["bytes"]), _x(st["naive_over_ours"]["seconds"]),
            _x(st["naive_over_ours"]["bytes"]),
        ])
    out.append(_table(["step", "written MB", "upper MB (entries)", "captured MB", "entries", "uploaded MB",
                       "upl/written", "ckpt s", "freeze s", "naive s", "naive MB", "naive/ours s",
                       "naive/ours MB"], rows))
    out.append("  captured = regular-file bytes in the checkpoint layer (Checkpoint.bytes_changed): a modified "
               "file is captured whole; uploaded = compressed bytes sent (chunks the store lacks, pack index, "
               "metadata image, document)")
    out.append("")

    out.append("Restore on a fresh host (new data dir and daemon, empty cache): restore + first read of the "
               f"step's {PROBE_BYTES // 1000} KB probe file; naive = zstd -d | tar -x of the step's archive + "
               "the same read")
    rows = []
    for st in steps:
        r = st["restore"]
        o, n = r["ours"], r["naive"]
        rows.append([
            st["name"], str(o["layers"]), _f(o["restore_seconds"], 3), _f(o["read_seconds"], 3),
            _f(o["first_read_seconds"], 3), _kb(o["bytes_fetched"]), str(o["store_requests"]),
            _kb(o["meta_bytes"]), _f(n["seconds"], 3), _mb(n["bytes"]), _x(r["naive_over_ours_seconds"]),
        ])
    out.append(_table(["checkpoint of", "layers", "restore s", "read s", "first read s", "fetched KB",
                       "GETs", "meta KB", "naive s", "naive MB", "naive/ours s"], rows))
    starts = [st["restore"]["ours"]["daemon_start_seconds"] for st in steps]
    out.append(f"  fetched = chunk bytes the daemon read from the store (compressed); meta = the layers' "
               f"metadata images the host holds (uncompressed); daemon start (not in the rows) "
               f"{_f(min(starts), 2)}-{_f(max(starts), 2)} s")
    out.append("")

    g = doc["goals"]["proportional"]

    def met(flag: bool) -> str:
        return "MET" if flag else "MISSED"

    out.append("Goal: checkpoint cost proportional to what changed")
    out.append(f"  '{g['last']}' (upper {_mb(g['upper_bytes']['last'])} MB) vs '{g['first']}' (upper "
               f"{_mb(g['upper_bytes']['first'])} MB): checkpoint seconds {_x(g['seconds_ratio'])} "
               f"({met(g['seconds_met'])}, want <= {g['want']:.1f}x), bytes uploaded {_x(g['uploaded_ratio'])} "
               f"({met(g['uploaded_met'])}, want <= {g['want']:.1f}x)")
    worst = g["worst_uploaded_over_written"]
    out.append(f"  uploaded/written at every step <= {g['want_uploaded_over_written']:.1f}: "
               f"{met(g['uploaded_over_written_met'])} (worst: '{worst['step']}', {_f(worst['ratio'])})")
    nl = g["naive_over_ours_last"]
    out.append(f"  naive method on '{g['last']}': {_x(nl['seconds'])} the seconds, {_x(nl['bytes'])} the bytes")
    out.append(f"  overall: {met(g['met'])}")
    c = doc["cleanup"]
    out.append("")
    out.append(f"cleanup: mounts left under the workdir: {', '.join(c['mounts_left']) or 'none'}; "
               f"workdir removed: {'yes' if c['workdir_removed'] else 'NO'}"
               + (f"; problems: {'; '.join(c['problems'])}" if c["problems"] else ""))
    return "\n".join(out)


# -- command line ---------------------------------------------------------------------------------


def filesystem_of(path: Path) -> str:
    """'fstype device' of the mount holding ``path``, from /proc/self/mounts."""
    real = os.path.realpath(path)
    best = ("", "?", "?")
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 3:
                continue
            point = parts[1].replace("\\040", " ")
            if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best[0]):
                best = (point, parts[2], parts[0])
    return f"{best[1]} on {best[2]}"


def tool_version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BenchError(f"cannot run {argv[0]}: {exc} (apt-get install tar zstd)") from None
    lines = (out.stdout or out.stderr).strip().splitlines()
    return lines[0].strip("* ") if lines else argv[0]


def cleanup(work: Path, hosts: Hosts) -> dict[str, Any]:
    """Unmount everything, stop every daemon, then remove the work directory unless a mount is left."""
    problems = hosts.close()
    left = kmount.mounts_under(work)
    for mp in left:  # not expected: detach so the host survives, and report it
        try:
            kmount.umount(mp, lazy=True, missing_ok=True)
        except OSError as exc:
            problems.append(f"{mp}: {exc}")
    removed = False
    if not kmount.mounts_under(work):  # never rmtree through a mount
        shutil.rmtree(work, ignore_errors=True)
        removed = not work.exists()
    return {"mounts_left": left, "workdir_removed": removed, "problems": problems}


def _mb_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want whole MB, comma-separated (e.g. 1,10,100)") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: want at least one size, each at least 1 MB")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench/snapshots.py",
        description="Checkpoint a writable mount after 1, 10 and 100 MB of changes to a 1 GB tree, then "
        "after 1 MB more on an upper directory holding ~1 GB; report checkpoint and freeze seconds and "
        "bytes uploaded against bytes written, restore to first read on a fresh host, and the naive "
        "method (tar | zstd of the whole upper directory) in the same run.",
    )
    p.add_argument("--quick", action="store_true", help="50 MB tree, 1 and 5 MB changes, 50 MB bulk: a smoke test")
    p.add_argument("--tree-mb", type=int, default=None, metavar="N", help="base tree size (default 1000; 50 with --quick)")
    p.add_argument("--changes", type=_mb_list, default=None, metavar="LIST",
                   help="MB written per step on the growing upper (default 1,10,100; 1,5 with --quick); "
                   "the first size is repeated last, after the bulk step")
    p.add_argument("--bulk-mb", type=int, default=None, metavar="N",
                   help="the bulk step that fills the upper directory (default: the tree size)")
    p.add_argument("--large-files", type=int, default=None, metavar="N",
                   help=f"large files in the base tree, holding {LARGE_SHARE:.0%}% of it (default 4; 2 with --quick)")
    p.add_argument("--seed", type=int, default=20240601, help="seed for sizes and picks (the data is os.urandom)")
    p.add_argument("--tmpdir", type=Path, default=Path("/var/tmp"), metavar="DIR",
                   help="where the tree, the store, the hosts and the archives go (default /var/tmp); removed at exit")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the tables")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.tree_mb = args.tree_mb or (50 if args.quick else 1000)
    args.changes = args.changes or ([1, 5] if args.quick else [1, 10, 100])
    args.bulk_mb = args.bulk_mb or args.tree_mb
    args.large_files = args.large_files or (2 if args.quick else 4)
    if args.tree_mb < 10 or args.large_files < 1 or args.bulk_mb < 1:
        print("bench/snapshots.py: --tree-mb must be at least 10, --large-files and --bulk-mb at least 1",
              file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("bench/snapshots.py: needs root (EROFS, overlayfs and FUSE mounts)", file=sys.stderr)
        return 1
    started = time.time()
    args.tmpdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="lb-snap-", dir=args.tmpdir))  # short: see host_dir
    hosts = Hosts(f"file://{work / 'store'}")
    doc: dict[str, Any] = {}
    status = 0
    try:
        with SIGNALS.installed():
            try:
                tools = {"zstd": tool_version(["zstd", "--version"]), "tar": tool_version(["tar", "--version"])}
                results = run_bench(args, work, hosts)
                doc = {
                    "schema": SCHEMA,
                    "settings": {"quick": args.quick, "tree_mb": args.tree_mb, "changes_mb": args.changes,
                                 "bulk_mb": args.bulk_mb, "large_files": args.large_files, "seed": args.seed,
                                 "tmpdir": str(args.tmpdir), "chunk_size": DEFAULT_CHUNK_SIZE,
                                 "zstd_level": ZSTD_LEVEL, "probe_bytes": PROBE_BYTES},
                    "environment": {"workdir": str(work), "filesystem": filesystem_of(work),
                                    "cpus": os.cpu_count(), "kernel": platform.release(),
                                    "python": platform.python_version(), **tools,
                                    "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))},
                    **results,
                    "goals": goals(results["steps"]),
                }
            finally:
                log("cleaning up: unmounting, stopping daemons, removing the workdir")
                with SIGNALS.critical():  # a second Ctrl-C must not cut the cleanup short
                    done = cleanup(work, hosts)
                    if doc:
                        doc["cleanup"] = done
                        doc["environment"]["wall_seconds"] = round(time.time() - started, 1)
                    if done["mounts_left"] or not done["workdir_removed"] or done["problems"]:
                        log(f"bench/snapshots.py: cleanup incomplete: {done}")
                        status = 1
                    else:
                        log(f"cleanup: no mount left under {work}, daemons stopped, workdir removed")
    except BenchError as exc:
        log(f"bench/snapshots.py: {exc}")
        return 1
    except LayerboxError as exc:
        log(f"bench/snapshots.py: layerbox failed: {exc}")
        return 1
    except KeyboardInterrupt:
        log("bench/snapshots.py: interrupted")
        return 130
    emit(doc, args.json, render)
    return status


if __name__ == "__main__":
    sys.exit(main())
