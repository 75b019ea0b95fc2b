"""Benchmark: sandboxes (SandboxManager: a writable lazy overlay run by crun) against podman and plain crun.

One run, on the fixture's ``python`` image published to a ``file://`` store
and, for the peers, loaded into podman's storage (``skopeo copy`` from the
archive, never a pull) and unpacked once into a plain rootfs (``umoci
unpack``); every container has no network (``--network none`` / a new network
namespace with only ``lo``) and the same limits (1 CPU, 512 MiB, 256 pids,
nofile 1024):

* **create to first exec** with cached layers, ``--latency`` times per method,
  methods interleaved: ``manager.create`` + ``box.exec(["/bin/true"])``
  (layers mounted by the call, and with another sandbox holding them);
  ``podman run --rm IMAGE /bin/true``; ``podman create`` + ``start`` +
  ``exec``; crun on the unpacked rootfs with a config from
  ``sandbox.backends.container.spec.build_spec`` (the same isolation as ours): ``create`` +
  ``start`` + ``exec``, and ``crun run``.  Teardown is timed apart, so each
  method has a *first exec* and a *cycle* (first exec + teardown) figure.
* **sustained creations**: ``--concurrency`` workers (creates concurrent too) doing create + first
  exec + destroy cycles for ``--sustain-seconds``, for ours and the peers.
* **idle sandboxes**: ``--idle N`` created and held, then the host's memory
  per sandbox (MemAvailable and "used" deltas) against the sandboxes' own
  processes (Pss of every process in their cgroups, and the cgroups' memory
  usage), the difference being the per-sandbox overhead outside them; then
  all destroyed, timed.
* **pause / resume** latency, with and without page-cache reclaim, and the
  peers' ``pause``/``resume`` (``podman pause``/``unpause``, ``crun
  pause``/``resume``).
* **FnCall** latency through ``sandbox.pools.fncall.WarmPool`` (when that module
  exists): a command and a python function.
* **policed network**: create to first exec and exec with a default-deny egress
  policy against none, and one egress counter read in-process (libnftables)
  against the ``nft`` command in the same namespace.
* **through the SDK**: the edge service on 127.0.0.1 and ``sandbox.sdk``: create to the first
  command's exit, a command on a live sandbox (and the manager's own exec time beside it), one
  byte typed into a terminal and echoed back over its WebSocket, and ``sb.fork(8)``.
* **CPU classes**: ``/bin/true`` and a short ``python3`` job in a latency-sensitive
  sandbox, alone, next to best-effort neighbours burning every CPU, and next to
  the same neighbours in the default class (``--only cpu-class`` runs it alone).

Everything the run creates (sandboxes, mounts, the daemon, crun containers and
their cgroups, podman containers) is removed in ``finally``, on Ctrl-C and on
SIGTERM/SIGHUP; the podman image stays in podman's storage as a cache.
Run ``python bench/sandbox.py --help``; bench/README.md explains every number.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: import the checkout, installed or not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fairness  # noqa: E402  (the fairness section, bench/fairness.py)
from common import (  # shared by the benchmarks
    BenchError,
    _f,
    _table,
    emit,
    log,
    pct,
    ratio,
    summary,
)

from converters.publish import publish  # noqa: E402
from layerstore.errors import LayerboxError  # noqa: E402
from layerstore.store import Store  # noqa: E402
from lazyfetch import kmount  # noqa: E402
from sandbox.backends.container.runtime import OciRuntime  # noqa: E402
from sandbox.backends.container.spec import (  # noqa: E402
    DEFAULT_PATH,
    IDLE_INIT,
    OciLimits,
    build_process,
    build_spec,
)
from sandbox.host.manager import Cancel, Sandbox, SandboxManager  # noqa: E402
from sandbox.isolation.cgroups import CgroupLayout  # noqa: E402

SCHEMA = "layerbox.bench.sandbox.v1"
MiB = 1 << 20
FIXTURE_NAME = "debian-bookworm.oci.tar"
TAG = "python"
REF = "bench/python"
PODMAN_IMAGE = "localhost/layerbox-bench:python"
TRUE = ["/bin/true"]
# podman's container runs the image's own idle shell (it has no bind of our init): the shape our
# containers had before their init was the host's catatonit
SHELL_IDLE = ["/bin/sh", "-c", 'trap "exit 0" TERM; while :; do sleep 3600 & wait; done']
ENV = {"PATH": DEFAULT_PATH, "HOME": "/root"}
LIMITS = OciLimits()  # what manager.create uses by default: 1 CPU, 512 MiB, 256 pids
PODMAN_GLOBAL = ["--cgroup-manager", "cgroupfs", "--events-backend", "file"]  # no systemd on these hosts
PODMAN_LIMITS = ["--network", "none", "--cpus", f"{LIMITS.cpu:g}", "--memory", f"{LIMITS.memory // MiB}m",
                 "--pids-limit", str(LIMITS.pids), "--ulimit", "nofile=1024:1024",
                 # podman's default nproc is above this host's hard limit, which crun may not raise
                 "--ulimit", "nproc=4096:4096"]
PAGE_CACHE_CMD = ["/usr/bin/python3", "-c", "import json, email, http.client, decimal, sqlite3"]
FN_SOURCE = "def f(x):\n    return x+1"
TOOL_TIMEOUT = 120.0
STEP_TIMEOUT = 300.0
SUN_PATH_MAX = 107

GOAL_IDLE = 1000
GOAL_OVERHEAD_MIB = 5.0



# -- small helpers ------------------------------------------------------------------------------


def run_tool(argv: Sequence[str], timeout: float = TOOL_TIMEOUT, *, check: bool = True) -> str:
    """Run a command (own session: a terminal's Ctrl-C reaches only us) and return its stdout."""
    try:
        proc = subprocess.run(list(argv), stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout,
                              start_new_session=True, check=False)
    except FileNotFoundError:
        raise BenchError(f"{argv[0]}: not installed (make bench-deps)") from None
    except subprocess.TimeoutExpired:
        raise BenchError(f"{' '.join(argv)}: no answer in {timeout:.0f} s") from None
    if check and proc.returncode != 0:
        raise BenchError(f"{' '.join(argv)} exited {proc.returncode}: "
                         f"{proc.stderr.decode(errors='replace').strip()[-2000:]}")
    return proc.stdout.decode(errors="replace")


def timed_tool(argv: Sequence[str], timeout: float = TOOL_TIMEOUT) -> float:
    start = time.perf_counter()
    run_tool(argv, timeout)
    return time.perf_counter() - start


def tool_version(argv: list[str]) -> str:
    try:
        lines = run_tool(argv, 30).strip().splitlines()
    except BenchError:
        return "unknown"
    return lines[0] if lines else "unknown"


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


REPORTED = Path("/sys/module/page_reporting/parameters/reported_kib")


def reported_kib() -> int | None:
    """KiB this VM has given back to its host so far (virtio-balloon free page reporting), or None
    where the kernel does not report.  Memory given back costs a fault in the host when the guest
    uses it again, ~10 us per 4 KiB page here: what a create pays more as a fill goes on
    (bench/README.md, "The fill's end is memory the VM gave back")."""
    try:
        return int(REPORTED.read_text())
    except (OSError, ValueError):
        return None


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[key] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    return out


def used_bytes(m: dict[str, int]) -> int:
    """The classic 'used' of free(1): neither free nor page cache, buffers or reclaimable slab."""
    return m["MemTotal"] - m["MemFree"] - m["Buffers"] - m["Cached"] - m.get("SReclaimable", 0)


def pss_rss(pid: int) -> tuple[int, int]:
    """(Pss, Rss) bytes of a process from smaps_rollup; (0, 0) when it is gone."""
    pss = rss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
                elif line.startswith("Rss:"):
                    rss = int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0, 0
    return pss, rss


def count_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def host_counters() -> dict[str, Any]:
    """What a host runs out of when it holds many sandboxes."""
    procs = [n for n in os.listdir("/proc") if n.isdigit()]
    threads = 0
    for pid in procs:
        with contextlib.suppress(OSError):
            threads += len(os.listdir(f"/proc/{pid}/task"))
    with open("/proc/sys/fs/file-nr") as f:
        file_nr = int(f.read().split()[0])
    m = meminfo()
    return {"processes": len(procs), "threads": threads, "pid_max": int(Path("/proc/sys/kernel/pid_max").read_text()),
            "host_mounts": len(kmount.read_mountinfo()), "open_files": file_nr,
            "file_max": int(Path("/proc/sys/fs/file-max").read_text()),
            "mem_available": m["MemAvailable"], "used": used_bytes(m),
            "bench_fds": count_fds(os.getpid())}


# -- the work directory, cleanup ----------------------------------------------------------------


def host_dir(work: Path) -> Path:
    """The manager's data dir; its daemon listens on DATA_DIR/lazyfetch.sock, so the path must stay short."""
    path = work / "h"
    sock = os.fsencode(path / "lazyfetch.sock")
    if len(sock) > SUN_PATH_MAX:
        raise BenchError(f"{os.fsdecode(sock)} is {len(sock)} bytes, more than a unix socket path may be "
                         f"({SUN_PATH_MAX}); pass a shorter --tmpdir")
    return path


@dataclass
class Peers:
    """The peer tools' state: podman containers carry a per-run label, plain crun has its own --root."""

    run_id: str
    work: Path
    podman: bool
    layout: CgroupLayout | None = None
    rootfs: Path | None = None
    crun: OciRuntime = field(init=False)
    cgroup_parent: str = field(init=False)

    def __post_init__(self) -> None:
        self.crun = OciRuntime(self.work / "crun")
        self.cgroup_parent = f"layerbox-bench-{self.run_id}"

    def podman_argv(self, *args: str) -> list[str]:
        return ["podman", *PODMAN_GLOBAL, *args]

    def label(self) -> list[str]:
        return ["--label", f"layerbox-bench={self.run_id}"]

    def cleanup(self) -> list[str]:
        problems: list[str] = []
        if self.podman:
            try:
                ids = run_tool(self.podman_argv("ps", "-a", "-q", "--filter", f"label=layerbox-bench={self.run_id}"),
                               60).split()
                if ids:
                    run_tool(self.podman_argv("rm", "-f", "-t", "0", *ids), 300)
                    left = run_tool(self.podman_argv("ps", "-a", "-q", "--filter",
                                                     f"label=layerbox-bench={self.run_id}"), 60).split()
                    if left:
                        problems.append(f"podman containers left: {left}")
            except BenchError as exc:
                problems.append(f"podman cleanup: {exc}")
        if self.crun.root.exists():
            try:
                for c in self.crun.list():
                    with contextlib.suppress(LayerboxError):
                        self.crun.delete(c["id"], force=True)
                if self.crun.list():
                    problems.append(f"crun containers left under {self.crun.root}")
            except LayerboxError as exc:
                problems.append(f"crun cleanup: {exc}")
        if self.layout is not None:
            for d in self.layout.dirs("/" + self.cgroup_parent):
                for child in sorted(d.glob("*/"), reverse=True) if d.exists() else []:
                    with contextlib.suppress(OSError):
                        child.rmdir()
                if d.exists():
                    try:
                        d.rmdir()
                    except OSError as exc:
                        problems.append(f"cgroup {d}: {exc.strerror}")
        return problems


def cleanup(work: Path, manager: SandboxManager | None, peers: Peers | None) -> dict[str, Any]:
    """Destroy every sandbox and peer container, stop the daemon, unmount, remove the work directory."""
    problems: list[str] = []
    if manager is not None:
        try:
            manager.close()
        except Exception as exc:  # keep tearing down; report at the end
            problems.append(f"manager.close: {type(exc).__name__}: {exc}")
            with contextlib.suppress(Exception):
                manager.host.umount_all(stop_daemon=True)
        with contextlib.suppress(Exception):
            left = [c["id"] for c in manager.backend("container").runtime.list()] if manager.backend("container").runtime.root.exists() else []
            if left:
                problems.append(f"sandboxes left in crun: {left}")
        with contextlib.suppress(Exception):
            left_cg = [str(d) for d in manager.layout.dirs("/" + manager.cgroup_parent) if d.exists()]
            if left_cg:
                problems.append(f"cgroups left: {left_cg}")
    if peers is not None:
        problems += peers.cleanup()
    left_mounts = kmount.mounts_under(work)
    for mp in reversed(left_mounts):  # not expected: detach so the host survives, and report it
        try:
            kmount.umount(mp, lazy=True, missing_ok=True)
        except OSError as exc:
            problems.append(f"{mp}: {exc}")
    removed = False
    if not kmount.mounts_under(work):  # never rmtree through a mount
        shutil.rmtree(work, ignore_errors=True)
        removed = not work.exists()
    return {"mounts_left": left_mounts, "workdir_removed": removed, "problems": problems}


# -- setup --------------------------------------------------------------------------------------


def find_fixture(option: str | None) -> Path:
    if option:
        path = Path(option)
        if not path.is_file():
            raise BenchError(f"--fixture {option}: no such file (the oci-archive with tag {TAG})")
        return path.resolve()
    here = Path(__file__).resolve().parents[1]
    for candidate in (here.parent / "shared" / "fixtures" / FIXTURE_NAME, Path("/work/shared/fixtures") / FIXTURE_NAME):
        if candidate.is_file():
            return candidate
    raise BenchError(f"the fixture image ../shared/fixtures/{FIXTURE_NAME} is not here; pass --fixture PATH")


async def publish_image(url: str, data_dir: Path, src: str, work: Path) -> dict[str, Any]:
    start = time.perf_counter()
    async with await Store.open(url, data_dir) as store:
        r = await publish(store, src, REF, work_dir=work)
    return {"digest": r.digest, "seconds": round(time.perf_counter() - start, 3)}


def podman_load(peers: Peers, fixture: Path) -> dict[str, Any]:
    """The fixture's python tag in podman's storage: copied from the archive once, then cached."""
    exists = subprocess.run(peers.podman_argv("image", "exists", PODMAN_IMAGE), capture_output=True,
                            start_new_session=True, check=False).returncode == 0
    seconds = None
    if not exists:
        log(f"podman: skopeo copy oci-archive:{fixture}:{TAG} containers-storage:{PODMAN_IMAGE}")
        seconds = timed_tool(["skopeo", "copy", "-q", f"oci-archive:{fixture}:{TAG}",
                              f"containers-storage:{PODMAN_IMAGE}"], 900)
    image_id = run_tool(peers.podman_argv("image", "inspect", "--format", "{{.Id}}", PODMAN_IMAGE)).strip()
    return {"image": PODMAN_IMAGE, "id": image_id, "cached": exists, "load_seconds": seconds}


def unpack_plain(peers: Peers, fixture: Path) -> dict[str, Any]:
    """The image unpacked once into a directory (what crun runs without layerbox)."""
    start = time.perf_counter()
    layout, bundle = peers.work / "plain-oci", peers.work / "plain"
    run_tool(["skopeo", "copy", "-q", f"oci-archive:{fixture}:{TAG}", f"oci:{layout}:{TAG}"], 900)
    run_tool(["umoci", "unpack", "--image", f"{layout}:{TAG}", str(bundle)], 900)
    shutil.rmtree(layout, ignore_errors=True)
    peers.rootfs = bundle / "rootfs"
    return {"rootfs": str(peers.rootfs), "seconds": round(time.perf_counter() - start, 3)}


# -- one create, per method ------------------------------------------------------------------------

@dataclass
class Cycle:
    first_exec: float | None  # None: not separable (podman run, crun run)
    total: float  # first exec + teardown


async def ours_cycle(manager: SandboxManager) -> Cycle:
    start = time.perf_counter()
    box = await manager.create(REF)
    try:
        r = await asyncio.to_thread(box.exec, TRUE)
        first = time.perf_counter() - start
        if r.exit_code != 0:
            raise BenchError(f"exec /bin/true in {box.id} exited {r.exit_code}: {r.stderr[-500:]!r}")
    finally:
        await asyncio.to_thread(manager.destroy, box.id)
    return Cycle(first, time.perf_counter() - start)


def podman_run_cycle(peers: Peers) -> Cycle:
    total = timed_tool(peers.podman_argv("run", "--rm", *peers.label(), *PODMAN_LIMITS, PODMAN_IMAGE, *TRUE))
    return Cycle(None, total)


def podman_cse_cycle(peers: Peers) -> Cycle:
    name = f"lbb-{peers.run_id}-{uuid.uuid4().hex[:8]}"
    start = time.perf_counter()
    try:
        run_tool(peers.podman_argv("create", "-q", "--name", name, *peers.label(), *PODMAN_LIMITS,
                                   PODMAN_IMAGE, *SHELL_IDLE))
        run_tool(peers.podman_argv("start", name))
        run_tool(peers.podman_argv("exec", name, *TRUE))
        first = time.perf_counter() - start
    finally:
        run_tool(peers.podman_argv("rm", "-f", "-t", "0", name), check=False)
    return Cycle(first, time.perf_counter() - start)


def plain_bundle(peers: Peers, cid: str, args: Sequence[str]) -> Path:
    assert peers.rootfs is not None
    assert peers.layout is not None
    bundle = peers.work / "bundles" / cid
    bundle.mkdir(parents=True)
    spec = build_spec(str(peers.rootfs), build_process(args, env=ENV, cwd="/", uid=0, gid=0), hostname=cid,
                      cgroups_path=f"/{peers.cgroup_parent}/{cid}", limits=LIMITS,
                      cgroup_version=peers.layout.version)
    (bundle / "config.json").write_text(json.dumps(spec))
    return bundle


def plain_exec(peers: Peers, cid: str, args: Sequence[str]) -> None:
    bundle = peers.work / "bundles" / cid
    tag = uuid.uuid4().hex[:8]
    proc_file, pid_file = bundle / f"exec-{tag}.json", bundle / f"exec-{tag}.pid"
    proc_file.write_text(json.dumps(build_process(args, env=ENV, cwd="/", uid=0, gid=0)))
    proc = peers.crun.exec(cid, proc_file, pid_file=pid_file, stdin=subprocess.DEVNULL)
    try:
        _out, err = proc.communicate(timeout=TOOL_TIMEOUT)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if proc.returncode != 0:
        raise BenchError(f"crun exec {cid} {' '.join(args)} exited {proc.returncode}: {err.decode(errors='replace')}")


def plain_start(peers: Peers) -> str:
    cid = f"lbb-{uuid.uuid4().hex[:10]}"
    bundle = plain_bundle(peers, cid, IDLE_INIT)
    peers.crun.create(cid, bundle, pid_file=bundle / "init.pid")
    peers.crun.start(cid)
    return cid


def plain_delete(peers: Peers, cid: str) -> None:
    peers.crun.delete(cid, force=True)
    shutil.rmtree(peers.work / "bundles" / cid, ignore_errors=True)


def crun_cse_cycle(peers: Peers) -> Cycle:
    start = time.perf_counter()
    cid = ""
    try:
        cid = plain_start(peers)
        plain_exec(peers, cid, TRUE)
        first = time.perf_counter() - start
    finally:
        if cid:
            plain_delete(peers, cid)
    return Cycle(first, time.perf_counter() - start)


def crun_run_cycle(peers: Peers) -> Cycle:
    cid = f"lbb-{uuid.uuid4().hex[:10]}"
    start = time.perf_counter()
    try:
        bundle = plain_bundle(peers, cid, TRUE)
        run_tool(peers.crun.argv("run", "--bundle", str(bundle), cid))
    finally:
        shutil.rmtree(peers.work / "bundles" / cid, ignore_errors=True)
    return Cycle(None, time.perf_counter() - start)


# -- sections -------------------------------------------------------------------------------------

METHODS = {
    "ours": "manager.create + exec /bin/true (layers mounted by the call) | destroy",
    "ours, layers held": "the same while another sandbox holds the image's layers (only the overlay is mounted)",
    "podman run --rm": "podman run --rm IMAGE /bin/true, end to end (includes the removal)",
    "podman create+start+exec": "podman create IMAGE SHELL_IDLE + start + exec /bin/true | rm -f -t 0",
    "crun plain create+start+exec": "crun create + start (IDLE_INIT) + exec /bin/true on the unpacked rootfs | delete -f",
    "crun plain run": "crun run with /bin/true as the process, end to end (includes the delete)",
}


async def latency_section(manager: SandboxManager, peers: Peers, n: int, use_podman: bool) -> dict[str, Any]:
    methods: dict[str, Callable[[], Awaitable[Cycle]]] = {
        "ours": lambda: ours_cycle(manager),
        "crun plain create+start+exec": lambda: asyncio.to_thread(crun_cse_cycle, peers),
        "crun plain run": lambda: asyncio.to_thread(crun_run_cycle, peers),
    }
    if use_podman:
        methods["podman run --rm"] = lambda: asyncio.to_thread(podman_run_cycle, peers)
        methods["podman create+start+exec"] = lambda: asyncio.to_thread(podman_cse_cycle, peers)
    log("latency: warm-up (one untimed cycle per method)")
    for fn in methods.values():
        await fn()
    runs: dict[str, list[Cycle]] = {name: [] for name in [*methods, "ours, layers held"]}
    for i in range(n):
        log(f"latency: round {i + 1}/{n}")
        for name, fn in methods.items():
            runs[name].append(await fn())
    holder = await manager.create(REF)
    try:
        await ours_cycle(manager)  # warm-up with shared layers
        for i in range(n):
            log(f"latency: layers held, {i + 1}/{n}")
            runs["ours, layers held"].append(await ours_cycle(manager))
    finally:
        await asyncio.to_thread(manager.destroy, holder.id)
    out: dict[str, Any] = {}
    for name, cycles in runs.items():
        firsts = [c.first_exec for c in cycles if c.first_exec is not None]
        out[name] = {"what": METHODS[name], "first_exec": summary(firsts) if firsts else None,
                     "cycle": summary([c.total for c in cycles]),
                     "runs": [{"first_exec": c.first_exec, "total": c.total} for c in cycles]}
    ours = out["ours"]
    ratios: dict[str, Any] = {}
    for peer, data in out.items():
        if peer.startswith("ours"):
            continue
        peer_first = data["first_exec"]["p50"] if data["first_exec"] else data["cycle"]["p50"]
        ratios[peer] = {
            "first_exec_p50": ratio(ours["first_exec"]["p50"], peer_first),
            "first_exec_p99": ratio(ours["first_exec"]["p99"],
                                    data["first_exec"]["p99"] if data["first_exec"] else data["cycle"]["p99"]),
            "cycle_p50": ratio(ours["cycle"]["p50"], data["cycle"]["p50"]),
            "peer_first_exec_is_end_to_end": data["first_exec"] is None,
        }
    return {"methods": out, "ours_over_peer": ratios}


async def sustain_section(manager: SandboxManager, peers: Peers, seconds: float, concurrency: int,
                          peer_names: Sequence[str]) -> dict[str, Any]:
    async def drive(name: str, cycle: Callable[[], Awaitable[Cycle]],
                    alive: Callable[[], int] | None) -> dict[str, Any]:
        log(f"sustain: {name}, {concurrency} workers for {seconds:.0f} s")
        start = time.perf_counter()
        deadline = start + seconds
        totals: list[float] = []
        errors: list[str] = []
        peak = 0

        async def worker() -> None:
            while time.perf_counter() < deadline:
                try:
                    c = await cycle()
                    totals.append(c.total)
                except (BenchError, LayerboxError) as exc:
                    errors.append(f"{type(exc).__name__}: {exc}"[:500])
                    await asyncio.sleep(0.1)

        async def sampler() -> int:
            nonlocal peak
            while time.perf_counter() < deadline:
                if alive is not None:
                    peak = max(peak, await asyncio.to_thread(alive))
                await asyncio.sleep(min(1.0, max(0.0, deadline - time.perf_counter())))
            return await asyncio.to_thread(alive) if alive is not None else -1

        sampling = asyncio.create_task(sampler())
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        at_deadline = await sampling
        elapsed = time.perf_counter() - start
        return {"method": name, "concurrency": concurrency, "seconds": round(elapsed, 2), "cycles": len(totals),
                "per_second": len(totals) / elapsed if elapsed > 0 else None,
                "cycle": summary(totals), "errors": len(errors), "first_errors": errors[:3],
                "alive_at_deadline": at_deadline if at_deadline >= 0 else None, "alive_peak": peak if alive else None}

    def ours_alive() -> int:
        return len(manager.list())

    def plain_alive() -> int:
        return len(peers.crun.list())

    rows = [await drive("ours", lambda: ours_cycle(manager), ours_alive)]
    if "podman" in peer_names:
        rows.append(await drive("podman run --rm", lambda: asyncio.to_thread(podman_run_cycle, peers), None))
    if "crun" in peer_names:
        rows.append(await drive("crun plain create+start+exec", lambda: asyncio.to_thread(crun_cse_cycle, peers),
                                plain_alive))
    for row in rows[1:]:
        row["ours_over_peer"] = ratio(rows[0]["per_second"], row["per_second"])
    return {"rows": rows}


def own_memory(manager: SandboxManager, boxes: Sequence[Sandbox]) -> dict[str, Any]:
    """The sandboxes' own processes: Pss/Rss from smaps_rollup, and what their memory cgroups hold."""
    pss = rss = procs = usage = kmem = cg_rss = cg_cache = 0
    for box in boxes:
        d = manager.layout.controller_dir("memory", box.state.cgroups_path)
        if d is None:
            continue
        v2 = manager.layout.version == 2
        with contextlib.suppress(OSError):
            for line in (d / "cgroup.procs").read_text().split():
                p, r = pss_rss(int(line))
                pss, rss, procs = pss + p, rss + r, procs + 1
        with contextlib.suppress(OSError, ValueError):
            usage += int((d / ("memory.current" if v2 else "memory.usage_in_bytes")).read_text())
        with contextlib.suppress(OSError, ValueError):
            kmem += int((d / "memory.kmem.usage_in_bytes").read_text())
        with contextlib.suppress(OSError, ValueError):
            stat: dict[str, str] = {}
            for line in (d / "memory.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                stat[key] = value
            cg_rss += int(stat.get("total_rss", stat.get("anon", "0")))
            cg_cache += int(stat.get("total_cache", stat.get("file", "0")))
    return {"processes": procs, "pss": pss, "rss": rss, "cgroup_usage": usage, "cgroup_kmem": kmem,
            "cgroup_rss": cg_rss, "cgroup_cache": cg_cache}


def host_side(manager: SandboxManager) -> dict[str, int]:
    """Pss of the processes outside the sandboxes that grow with them: this process and the daemon."""
    out = {"bench_pss": pss_rss(os.getpid())[0], "daemon_pss": 0, "daemon_fds": -1}
    with contextlib.suppress(Exception):
        health = manager.host.client.health()
        if health:
            out["daemon_pss"] = pss_rss(int(health["pid"]))[0]
            out["daemon_fds"] = count_fds(int(health["pid"]))
    return out


async def settle(seconds: float) -> dict[str, int]:
    """Let deferred frees (RCU, workqueues) run, then read /proc/meminfo (median of three reads)."""
    await asyncio.sleep(seconds)
    reads = []
    for _ in range(3):
        reads.append(meminfo())
        await asyncio.sleep(0.5)
    return {k: sorted(r[k] for r in reads)[1] for k in reads[0]}


async def idle_section(manager: SandboxManager, n: int, concurrency: int, settle_s: float) -> dict[str, Any]:
    log(f"idle: baseline (settle {settle_s:.0f} s)")
    before = await settle(settle_s)
    side_before = host_side(manager)
    counters_before = await asyncio.to_thread(host_counters)
    boxes: list[Sandbox] = []
    create_s: list[float] = []
    failure: dict[str, Any] | None = None
    stop = False
    next_index = 0
    start = time.perf_counter()

    async def creator() -> None:
        nonlocal stop, failure, next_index
        while not stop and next_index < n:
            next_index += 1
            t0 = time.perf_counter()
            try:
                box = await manager.create(REF)
            except (LayerboxError, OSError) as exc:
                if failure is None:
                    failure = {"count_reached": len(boxes), "error": f"{type(exc).__name__}: {exc}"[:2000],
                               "counters": await asyncio.to_thread(host_counters)}
                stop = True
                return
            create_s.append(time.perf_counter() - t0)
            boxes.append(box)
            if len(boxes) % 100 == 0:
                log(f"idle: {len(boxes)} sandboxes, {len(boxes) / (time.perf_counter() - start):.1f}/s, "
                    f"MemAvailable {meminfo()['MemAvailable'] / MiB:.0f} MiB")

    try:
        await asyncio.gather(*(creator() for _ in range(concurrency)))
        create_elapsed = time.perf_counter() - start
        held = len(boxes)
        log(f"idle: {held} held after {create_elapsed:.1f} s; measuring")
        # a few execs on the loaded host, and the idle sandboxes' own memory
        probe = random.Random(1).sample(boxes, min(20, held)) if held else []
        exec_s = []
        for box in probe:
            t0 = time.perf_counter()
            r = await asyncio.to_thread(box.exec, TRUE)
            exec_s.append(time.perf_counter() - t0)
            if r.exit_code != 0:
                raise BenchError(f"exec in idle sandbox {box.id} exited {r.exit_code}")
        after = await settle(settle_s)
        counters_at_peak = await asyncio.to_thread(host_counters)
        own = await asyncio.to_thread(own_memory, manager, boxes)
        side_after = host_side(manager)
    finally:
        log(f"idle: destroying {len(boxes)}")
        destroy_s: list[float] = []
        queue = list(boxes)
        d_start = time.perf_counter()

        async def destroyer() -> None:
            while queue:
                box = queue.pop()
                t0 = time.perf_counter()
                await asyncio.to_thread(manager.destroy, box.id)
                destroy_s.append(time.perf_counter() - t0)

        await asyncio.gather(*(destroyer() for _ in range(concurrency)))
        destroy_elapsed = time.perf_counter() - d_start
    end = await settle(settle_s)
    avail_drop = before["MemAvailable"] - after["MemAvailable"]
    used_growth = used_bytes(after) - used_bytes(before)
    per: dict[str, float | None] = {}
    if held:
        per = {
            "mem_available_drop": avail_drop / held,
            "used_growth": used_growth / held,
            "own_pss": own["pss"] / held,
            "own_rss": own["rss"] / held,
            "cgroup_usage": own["cgroup_usage"] / held,
            "overhead_available": (avail_drop - own["pss"]) / held,
            "overhead_used": (used_growth - own["pss"]) / held,
            "daemon_pss": (side_after["daemon_pss"] - side_before["daemon_pss"]) / held,
            "bench_pss": (side_after["bench_pss"] - side_before["bench_pss"]) / held,
        }
        for key in ("Slab", "SUnreclaim", "SReclaimable", "KernelStack", "PageTables", "Shmem", "AnonPages",
                    "Cached", "Percpu", "VmallocUsed"):
            per[f"delta_{key}"] = (after.get(key, 0) - before.get(key, 0)) / held
        # kernel memory the sandboxes' objects pin (namespaces, cgroups, mounts, tasks): less noisy than the
        # host-wide figures, which also move with every other job on the host
        per["kernel_attributable"] = sum(per[f"delta_{k}"] or 0.0 for k in (
            "SUnreclaim", "Percpu", "KernelStack", "PageTables", "VmallocUsed"))
    tenth = max(1, len(create_s) // 10)
    return {
        "requested": n, "held": held, "concurrency": concurrency, "failure": failure,
        "create_seconds": round(create_elapsed, 2), "create_per_second": held / create_elapsed if create_elapsed else None,
        "create": summary(create_s), "create_first_tenth_p50": pct(create_s[:tenth], 50),
        "create_last_tenth_p50": pct(create_s[-tenth:], 50),
        "exec_when_held": summary(exec_s),
        "destroy_seconds": round(destroy_elapsed, 2),
        "destroy_per_second": len(destroy_s) / destroy_elapsed if destroy_elapsed else None,
        "destroy": summary(destroy_s),
        "destroy_first_tenth_p50": pct(destroy_s[:tenth], 50), "destroy_last_tenth_p50": pct(destroy_s[-tenth:], 50),
        "meminfo_before": before, "meminfo_after": after, "meminfo_end": end,
        "mem_available_drop": avail_drop, "used_growth": used_growth,
        "residual_after_destroy": before["MemAvailable"] - end["MemAvailable"],
        "own": own, "host_side_before": side_before, "host_side_after": side_after,
        "per_sandbox": per, "counters_before": counters_before, "counters_at_peak": counters_at_peak,
        "settle_seconds": settle_s,
    }


async def pause_section(manager: SandboxManager, peers: Peers, n: int, use_podman: bool) -> dict[str, Any]:
    box = await manager.create(REF)
    rows: dict[str, list[float]] = {"pause (reclaim)": [], "resume after reclaim": [],
                                    "pause (no reclaim)": [], "resume": []}
    reclaimed: list[int] = []
    no_reclaim_api = None
    try:
        for i in range(n):
            log(f"pause/resume: {i + 1}/{n}")
            await asyncio.to_thread(box.exec, PAGE_CACHE_CMD)  # gives the reclaim page cache to push out
            t0 = time.perf_counter()
            info = box.pause()
            t1 = time.perf_counter()
            box.resume()
            t2 = time.perf_counter()
            rows["pause (reclaim)"].append(t1 - t0)
            rows["resume after reclaim"].append(t2 - t1)
            rec = info.get("reclaim") if isinstance(info, dict) else None
            if rec:
                reclaimed.append(int(rec["before"]) - int(rec["after"]))
            if no_reclaim_api is None or no_reclaim_api:
                await asyncio.to_thread(box.exec, PAGE_CACHE_CMD)
                t0 = time.perf_counter()
                try:
                    box.pause(reclaim=False)
                except TypeError:
                    no_reclaim_api = False
                    continue
                no_reclaim_api = True
                t1 = time.perf_counter()
                box.resume()
                t2 = time.perf_counter()
                rows["pause (no reclaim)"].append(t1 - t0)
                rows["resume"].append(t2 - t1)
    finally:
        await asyncio.to_thread(manager.destroy, box.id)
    out: dict[str, Any] = {name: summary(v) for name, v in rows.items() if v}
    out["reclaimed_bytes_p50"] = pct(reclaimed, 50) if reclaimed else None
    # peers: the freezer alone (crun pause/resume of a plain container) and podman pause/unpause
    cid = await asyncio.to_thread(plain_start, peers)
    try:
        pr: list[float] = []
        rr: list[float] = []
        for _ in range(n):
            t0 = time.perf_counter()
            peers.crun.pause(cid)
            t1 = time.perf_counter()
            peers.crun.resume(cid)
            pr.append(t1 - t0)
            rr.append(time.perf_counter() - t1)
        out["crun pause"], out["crun resume"] = summary(pr), summary(rr)
    finally:
        await asyncio.to_thread(plain_delete, peers, cid)
    if use_podman:
        name = f"lbb-{peers.run_id}-pause"
        try:
            run_tool(peers.podman_argv("create", "-q", "--name", name, *peers.label(), *PODMAN_LIMITS,
                                       PODMAN_IMAGE, *SHELL_IDLE))
            run_tool(peers.podman_argv("start", name))
            pr, rr = [], []
            for _ in range(n):
                pr.append(timed_tool(peers.podman_argv("pause", name)))
                rr.append(timed_tool(peers.podman_argv("unpause", name)))
            out["podman pause"], out["podman unpause"] = summary(pr), summary(rr)
        finally:
            run_tool(peers.podman_argv("rm", "-f", "-t", "0", name), check=False)
    return out


NET_RULES = [{"cidr": "203.0.113.0/24", "ports": 443, "protocol": "tcp"}]  # TEST-NET-3: never contacted


async def network_section(manager: SandboxManager, n: int) -> dict[str, Any]:
    """What a policed network (own netns, veth, default-deny table, egress receipts) costs.

    Create to first exec and a held sandbox's exec, with and without a policy,
    interleaved; then one counter read (two per policed exec) through libnftables
    in-process against ``nft -j list table`` run in the same namespace, which is
    what the manager did before.
    """
    rows: dict[str, list[float]] = {"create+first exec, no network": [], "create+first exec, policed": [],
                                    "exec, no network": [], "exec, policed": []}
    for i in range(n):
        log(f"network: create round {i + 1}/{n}")
        for name, options in (("no network", {}), ("policed", {"network": NET_RULES})):
            t0 = time.perf_counter()
            box = await manager.create(REF, **options)
            try:
                await asyncio.to_thread(box.exec, TRUE)
                rows[f"create+first exec, {name}"].append(time.perf_counter() - t0)
            finally:
                await asyncio.to_thread(manager.destroy, box.id)
    plain = await manager.create(REF)
    policed = await manager.create(REF, network=NET_RULES)
    out: dict[str, Any] = {}
    try:
        for _ in range(n):
            for name, box in (("no network", plain), ("policed", policed)):
                t0 = time.perf_counter()
                await asyncio.to_thread(box.exec, TRUE)
                rows[f"exec, {name}"].append(time.perf_counter() - t0)
        net = manager.net
        lib: list[float] = []
        tool: list[float] = []
        argv = ["nsenter", f"--net={net.netns_path(policed.id)}", "nft", "-j", "list", "table", "inet", "layerbox"]
        for _ in range(n):
            t0 = time.perf_counter()
            await asyncio.to_thread(net.counters, policed.id)
            lib.append(time.perf_counter() - t0)
            tool.append(await asyncio.to_thread(timed_tool, argv))
        out["counters (libnftables, in-process)"] = summary(lib)
        out["counters (nsenter + nft -j list table)"] = summary(tool)
        t0 = time.perf_counter()
        await asyncio.to_thread(net.set_policy, policed.id, [*NET_RULES, {"cidr": "198.51.100.0/24"}])
        out["set_policy_seconds"] = time.perf_counter() - t0
    finally:
        for box in (plain, policed):
            await asyncio.to_thread(manager.destroy, box.id)
    out.update({name: summary(v) for name, v in rows.items()})
    out["policed_over_plain"] = {
        "create": ratio(out["create+first exec, policed"]["p50"], out["create+first exec, no network"]["p50"]),
        "exec": ratio(out["exec, policed"]["p50"], out["exec, no network"]["p50"]),
        "counters_lib_over_tool": ratio(out["counters (libnftables, in-process)"]["p50"],
                                        out["counters (nsenter + nft -j list table)"]["p50"])}
    return out


async def fncall_section(manager: SandboxManager, n: int) -> dict[str, Any]:
    try:
        fncall = importlib.import_module("sandbox.pools.fncall")
    except ModuleNotFoundError as exc:
        if exc.name != "sandbox.pools.fncall":
            return {"available": False, "error": f"sandbox.pools.fncall failed to import: {exc}"}
        return {"available": False, "error": "sandbox.pools.fncall not available"}
    except Exception as exc:  # the module exists but is broken: say how
        return {"available": False, "error": f"sandbox.pools.fncall failed to import: {type(exc).__name__}: {exc}"}
    out: dict[str, Any] = {"available": True}
    pool: Any = None
    try:
        pool = fncall.WarmPool(manager, REF, size=2)
        t0 = time.perf_counter()
        await asyncio.wait_for(pool.start(), STEP_TIMEOUT)
        out["start_seconds"] = time.perf_counter() - t0
        cases: dict[str, Callable[[], Awaitable[Any]]] = {
            "cmd true": lambda: pool.call("true"),
            "python f(1)": lambda: pool.call(function=FN_SOURCE, args=[1]),
        }
        for name, call in cases.items():
            first = await asyncio.wait_for(call(), STEP_TIMEOUT)  # warm-up
            wall: list[float] = []
            reported: list[float] = []
            for i in range(n):
                if i % 10 == 0:
                    log(f"fncall: {name} {i + 1}/{n}")
                t0 = time.perf_counter()
                r = await asyncio.wait_for(call(), STEP_TIMEOUT)
                wall.append(time.perf_counter() - t0)
                d = getattr(r, "duration", None)
                if isinstance(d, int | float):
                    reported.append(float(d))
            out[name] = {"wall": summary(wall), "duration": summary(reported) if reported else None,
                         "first_result": repr(first)[:300]}
    except Exception as exc:  # report and carry on: the module is being written in parallel
        out["error"] = f"{type(exc).__name__}: {exc}"[:1000]
    finally:
        if pool is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(pool.close(), STEP_TIMEOUT)
    return out


# -- CPU classes ------------------------------------------------------------------------------------

# A small fixed CPU job (interpreter start + ~3 ms of arithmetic) and the cheapest command.
CPU_COMMANDS = {"/bin/true": TRUE, "python3 sum(range(200000))": ["python3", "-c", "sum(range(200000))"]}
# One burner process: spins until the stop file exists (checked every ~20k iterations) or `limit` seconds pass,
# then prints its iterations, wall and CPU seconds and its scheduling policy (SCHED_IDLE is 5).
BURN_SOURCE = """\
import os, sys, time
stop, limit = sys.argv[1], float(sys.argv[2])
t0, c0, n = time.monotonic(), time.process_time(), 0
print("go", flush=True)
while True:
    for _ in range(20000):
        pass
    n += 1
    if os.path.exists(stop) or time.monotonic() - t0 > limit:
        break
print(n * 20000, time.monotonic() - t0, time.process_time() - c0, os.sched_getscheduler(0))
"""
BURN_LIMIT = 900.0  # a burner ends by itself after this even if nobody stops it
CPU_CASES = {"alone": "no neighbour running",
             "best-effort": "neighbours with cpu_class='best-effort' burning CPU",
             "latency": "the same neighbours with the default class (latency) burning CPU"}


class Burners:
    """``per_box`` spinning processes in each neighbour, each an exec in a thread; stopped by a file, or killed."""

    def __init__(self, boxes: Sequence[Sandbox], per_box: int, tag: str) -> None:
        self.boxes, self.per_box = list(boxes), per_box
        self.stop_path = f"/tmp/lb-bench-stop-{tag}"
        self.cancels: list[Cancel] = []
        self.tasks: list[asyncio.Task[Any]] = []
        self.started: list[bool] = []  # appended from the exec threads (atomic)

    def _on_stdout(self, data: bytes) -> None:
        if data.startswith(b"go"):
            self.started.append(True)

    async def start(self) -> None:
        wait = 60.0
        argv = ["python3", "-c", BURN_SOURCE, self.stop_path, str(BURN_LIMIT)]
        for box in self.boxes:
            for _ in range(self.per_box):
                cancel = Cancel()
                self.cancels.append(cancel)
                self.tasks.append(asyncio.create_task(asyncio.to_thread(
                    box.exec, argv, timeout=BURN_LIMIT + 60, cancel=cancel, on_stdout=self._on_stdout)))
        deadline = time.monotonic() + wait
        while len(self.started) < len(self.tasks):
            failed = [t for t in self.tasks if t.done()]
            if failed:
                why = failed[0].exception() or failed[0].result()
                raise BenchError(f"a burner ended before it started: {why!r}"[:1000])
            if time.monotonic() > deadline:
                raise BenchError(f"{len(self.started)} of {len(self.tasks)} burners started in {wait:.0f} s")
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # let the scheduler settle on the new load

    async def stop(self) -> dict[str, Any]:
        """Ask the burners to stop (the file) and collect what they did."""
        for box in self.boxes:
            await asyncio.to_thread(box.write, self.stop_path, b"")
        done, pending = await asyncio.wait(self.tasks, timeout=30) if self.tasks else (set(), set())
        if pending:
            raise BenchError(f"{len(pending)} burners did not stop within 30 s of the stop file")
        iterations = wall = cpu = 0.0
        policies: set[int] = set()
        for task in self.tasks:
            r = task.result()
            fields = r.stdout.decode(errors="replace").split()
            if r.exit_code != 0 or len(fields) < 5:
                raise BenchError(f"burner exited {r.exit_code}: {r.stdout[-300:]!r} {r.stderr[-500:]!r}")
            iterations += float(fields[1])
            wall = max(wall, float(fields[2]))
            cpu += float(fields[3])
            policies.add(int(fields[4]))
        self.tasks = []
        return {"burners": len(done), "iterations": iterations, "wall_seconds": wall, "cpu_seconds": cpu,
                "iterations_per_second": iterations / wall if wall else None,
                "cpus_used": cpu / wall if wall else None,
                "sched_policies": sorted(policies)}

    async def kill(self) -> None:
        """On any failure: kill every burner's process tree (the manager freezes and SIGKILLs it)."""
        for cancel in self.cancels:
            cancel.cancel("bench cleanup")
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=60)
            for task in self.tasks:
                if task.done() and not task.cancelled():
                    task.exception()  # retrieved: no "exception never retrieved" noise
        self.tasks = []


# Published start figures of the services an agent framework would use instead; not measured here
# (their hosts, not this one): the issue quotes them, the table puts ours beside them.
PUBLISHED_STARTS = {"E2B (claim)": 0.150, "E2B (third-party time-to-interactive p50)": 0.44,
                    "Daytona (claim)": 0.090, "Daytona (third-party p50)": 0.11, "CubeSandbox (claim)": 0.060}


SDK_READY = 2  # the ready pool's size in the SDK section (each round starts with it full)
SDK_FORKS = 8  # sandboxes per fork through the SDK (the fork section's figure, plus HTTP)
SDK_MEMORY = 256 << 20  # each sandbox's memory limit in the SDK section: 1 + SDK_FORKS fit any test host
ECHO = ["/bin/sh", "-c", "stty raw -echo && echo ready && exec cat"]  # a terminal that sends each byte back


async def pty_round_trips(sb: Any, rounds: int) -> list[float]:
    """Seconds from one byte typed into a terminal (over its WebSocket) until the program on it (cat,
    on a raw terminal) has sent it back to the client, ``rounds`` times, one byte at a time."""
    received = bytearray()
    arrived = asyncio.Event()

    def on_data(data: bytes) -> None:
        received.extend(data)
        arrived.set()

    async def until(pattern: bytes, size: int = 0) -> None:
        """Until ``received`` holds ``size`` bytes at least and ends with ``pattern``."""
        async with asyncio.timeout(60):
            while len(received) < size or not received.rstrip().endswith(pattern):
                arrived.clear()
                await arrived.wait()

    term = await sb.pty.create(80, 24, on_data=on_data, cmd=ECHO)
    try:
        await until(b"ready")
        await term.send_stdin(b"x")  # untimed: the first byte after the shell's own output
        await until(b"x")
        out = []
        for i in range(rounds):
            key = bytes([ord("a") + i % 26])
            before = len(received)
            t0 = time.perf_counter()
            await term.send_stdin(key)
            await until(b"", before + 1)
            out.append(time.perf_counter() - t0)
            if bytes(received[before:]) != key:
                raise BenchError(f"sdk: the terminal sent back {bytes(received[before:])!r} for {key!r}")
        return out
    finally:
        await term.kill()


async def full(service: Any) -> None:
    """Until every ready pool of ``service`` holds its size (a replacement starts a while after an adopt)."""
    async with asyncio.timeout(120):
        for pool in service.context.ready_pools.values():
            await pool.full()
            await pool.settle()


async def sdk_section(manager: SandboxManager, n: int) -> dict[str, Any]:
    """Through the real edge service on 127.0.0.1 and the SDK, as an agent framework uses it: create to
    the first command's exit, from a new sandbox and adopting one of a ready pool (a second service
    on the same manager with ``ready={REF: SDK_READY}``, the two alternated round by round); a
    command (`true`) on a live sandbox, and the manager's own exec time beside it (the HTTP and
    streaming overhead is the difference); a terminal's round trip (one byte typed over the
    WebSocket and echoed back); and a fork of SDK_FORKS until every fork runs."""
    from aiohttp import web

    from sandbox.edge.app import AuthConfig, SandboxService
    from sandbox.sdk import AsyncSandbox

    token = "bench-sdk-token-" + uuid.uuid4().hex
    auth = AuthConfig.from_dict({"projects": {"bench": {"tokens": [token], "max_sandboxes": SDK_FORKS + 4}}})
    runners: list[web.AppRunner] = []

    async def serve(service: SandboxService) -> str:
        runner = web.AppRunner(service.app())
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}"

    out: dict[str, Any] = {}
    try:
        url = out["url"] = await serve(SandboxService(manager, auth))
        pooled = SandboxService(manager, auth, ready={REF: SDK_READY})
        ready_url = await serve(pooled)
        await full(pooled)
        runs: dict[str, tuple[list[float], list[float]]] = {"cold": ([], []), "ready": ([], [])}
        for i in range(n):
            if i % 10 == 0:
                log(f"sdk: create + first command {i + 1}/{n}, new and from a ready pool of {SDK_READY}")
            for mode, where in (("cold", url), ("ready", ready_url))[::1 if i % 2 else -1]:
                starts, firsts = runs[mode]
                t0 = time.perf_counter()
                sb = await AsyncSandbox.create(REF, url=where, token=token)
                t1 = time.perf_counter()
                await sb.commands.run("true")
                firsts.append(time.perf_counter() - t0)
                starts.append(t1 - t0)
                if mode == "ready" and not any(r.details.get("ready") for r in await sb.receipts()):
                    raise BenchError(f"sdk: sandbox {sb.sandbox_id} from the ready service was not adopted")
                await sb.kill()
            await full(pooled)  # each round starts with the pool full, as on an edge not at its limit
        out["create"] = summary(runs["cold"][0])
        out["create_to_first_exit"] = summary(runs["cold"][1])
        out["ready_create"] = summary(runs["ready"][0])
        out["ready_create_to_first_exit"] = summary(runs["ready"][1])
        out["ready_size"] = SDK_READY
        sb = await AsyncSandbox.create(REF, url=url, token=token)
        try:
            await sb.commands.run("true")
            wall, own = [], []
            for _ in range(n * 3):
                t0 = time.perf_counter()
                r = await sb.commands.run("true")
                wall.append(time.perf_counter() - t0)
                own.append(r.duration)
            out["exec_true"] = summary(wall)
            out["exec_true_manager"] = summary(own)
            log(f"sdk: terminal round trips ({n * 10})")
            out["pty_round_trip"] = summary(await pty_round_trips(sb, n * 10))
        finally:
            await sb.kill()
        out["fork"] = await sdk_forks(url, token, max(2, n // 5))
    finally:
        for runner in runners:
            await runner.cleanup()
    out["published_starts"] = PUBLISHED_STARTS
    return out


async def sdk_forks(url: str, token: str, rounds: int) -> dict[str, Any]:
    """``sb.fork(SDK_FORKS)`` of a sandbox that wrote a file, ``rounds`` times: seconds from the request
    until the answer (every fork running), the forks checked to read the source's file."""
    from sandbox.sdk import AsyncSandbox

    seconds: list[float] = []
    async with await AsyncSandbox.create(REF, url=url, token=token, memory=SDK_MEMORY) as sb:
        await sb.files.write("/root/state.txt", "forked\n")
        for i in range(rounds):
            log(f"sdk: fork of {SDK_FORKS}, round {i + 1}/{rounds}")
            t0 = time.perf_counter()
            forked = await sb.fork(SDK_FORKS)
            seconds.append(time.perf_counter() - t0)
            try:
                seen = {await f.files.read("/root/state.txt") for f in forked.sandboxes}
                if seen != {"forked\n"}:
                    raise BenchError(f"sdk: the forks read {seen}, not the source's file")
            finally:
                await asyncio.gather(*(f.kill() for f in forked.sandboxes), return_exceptions=True)
    return {**summary(seconds), "forks": SDK_FORKS, "rounds": rounds, "runs": seconds}


def cpu_weight(manager: SandboxManager, box: Sandbox) -> str | None:
    """The sandbox cgroup's cpu.shares (v1) or cpu.weight (v2), as the kernel has it."""
    d = manager.layout.controller_dir("cpu", box.state.cgroups_path)
    if d is None:
        return None
    for name in ("cpu.shares", "cpu.weight"):
        with contextlib.suppress(OSError):
            return f"{name}={(d / name).read_text().strip()}"
    return None


async def cpu_class_section(manager: SandboxManager, rounds: int, blocks: int, n_neighbours: int,
                            burners: int) -> dict[str, Any]:
    """Latency of short commands in a latency-sensitive sandbox: alone, next to best-effort burners, next to
    latency-class burners; cases interleaved block by block (rotating the order) so drift in the host's other
    load spreads over all three."""
    load_start = loadavg()
    boxes: list[Sandbox] = []
    active: Burners | None = None
    samples: dict[str, dict[str, list[float]]] = {case: {cmd: [] for cmd in CPU_COMMANDS} for case in CPU_CASES}
    throughput: dict[str, list[dict[str, Any]]] = {"best-effort": [], "latency": []}
    try:
        log(f"cpu-class: creating the measured sandbox and {n_neighbours} + {n_neighbours} neighbours "
            "(best-effort, latency), concurrently")
        made = await asyncio.gather(
            manager.create(REF),
            *(manager.create(REF, cpu_class="best-effort") for _ in range(n_neighbours)),
            *(manager.create(REF) for _ in range(n_neighbours)), return_exceptions=True)
        boxes = [b for b in made if isinstance(b, Sandbox)]
        errors = [b for b in made if isinstance(b, BaseException)]
        if errors:
            raise BenchError(f"cpu-class: {len(errors)} of {len(made)} concurrent creates failed: "
                             f"{type(errors[0]).__name__}: {errors[0]}"[:1500])
        target, neighbours = made[0], {"best-effort": made[1:1 + n_neighbours], "latency": made[1 + n_neighbours:]}
        assert isinstance(target, Sandbox)
        weights = {"measured": cpu_weight(manager, target),
                   **{case: sorted({str(cpu_weight(manager, b)) for b in bs}) for case, bs in neighbours.items()}}
        for cmd in CPU_COMMANDS.values():  # warm-up: the chunks python3 needs, the page cache
            await asyncio.to_thread(target.exec, cmd, timeout=STEP_TIMEOUT)
        per_block = [rounds // blocks + (1 if i < rounds % blocks else 0) for i in range(blocks)]
        order = list(CPU_CASES)
        for b, count in enumerate(per_block):
            for case in order[b % 3:] + order[:b % 3]:
                log(f"cpu-class: block {b + 1}/{blocks}, {case}: {count} rounds (load {loadavg()})")
                if case != "alone":
                    active = Burners(neighbours[case], burners, f"{b}-{case}")
                    await active.start()
                for _ in range(count):
                    for name, cmd in CPU_COMMANDS.items():
                        t0 = time.perf_counter()
                        r = await asyncio.to_thread(target.exec, cmd, timeout=STEP_TIMEOUT)
                        samples[case][name].append(time.perf_counter() - t0)
                        if r.exit_code != 0:
                            raise BenchError(f"{name} in {target.id} exited {r.exit_code}: {r.stderr[-500:]!r}")
                        await asyncio.sleep(0.02)  # a pause between requests, as a served sandbox sees them
                if active is not None:
                    throughput[case].append(await active.stop())
                    active = None
    finally:
        if active is not None:
            log("cpu-class: killing the burners")
            await active.kill()
        log(f"cpu-class: destroying {len(boxes)} sandboxes")
        for box in boxes:
            try:
                await asyncio.to_thread(manager.destroy, box.id)
            except Exception as exc:  # manager.close() in the final cleanup tries again and reports
                log(f"cpu-class: destroy {box.id}: {type(exc).__name__}: {exc}")
    out: dict[str, Any] = {"rounds": rounds, "blocks": blocks, "neighbours": n_neighbours,
                           "burners_per_neighbour": burners, "cases": CPU_CASES, "cpu_weights": weights,
                           "loadavg_start": load_start, "loadavg_end": loadavg(), "latency": {}, "ratios": {},
                           "neighbour_throughput": {}}
    for case, by_cmd in samples.items():
        out["latency"][case] = {name: summary(v) | {"runs": v} for name, v in by_cmd.items()}
    for name in CPU_COMMANDS:
        alone = out["latency"]["alone"][name]
        out["ratios"][name] = {f"{case}/alone": {q: ratio(out["latency"][case][name][q], alone[q]) for q in ("p50", "p99")}
                               for case in ("best-effort", "latency")}
    for case, phases in throughput.items():
        wall = sum(p["wall_seconds"] for p in phases)
        its = sum(p["iterations"] for p in phases)
        cpu = sum(p["cpu_seconds"] for p in phases)
        out["neighbour_throughput"][case] = {
            "phases": phases, "wall_seconds": wall, "iterations_per_second": its / wall if wall else None,
            "cpus_used": cpu / wall if wall else None,
            "sched_policies": sorted({x for p in phases for x in p["sched_policies"]})}
    return out


# -- fork -------------------------------------------------------------------------------------------------

FORK_WRITE = ["/bin/sh", "-c", "mkdir -p /root/work && head -c 16M /dev/urandom > /root/work/data.bin && "
              "for i in $(seq 1 200); do echo $i > /root/work/f$i; done"]


async def fork_section(manager: SandboxManager, n: int, rounds: int) -> dict[str, Any]:
    """``Sandbox.fork(n)`` (one checkpoint of a sandbox that wrote 16 MiB and 200 files, restored n times
    together) against n creates of the image started together, interleaved: seconds until all n are
    running (both return once every sandbox answers exec), and the first exec in each afterwards."""
    source = await manager.create(REF)
    fork_s: list[float] = []
    ckpt_s: list[float] = []
    create_s: list[float] = []
    try:
        r = await asyncio.to_thread(source.exec, FORK_WRITE, timeout=STEP_TIMEOUT)
        if r.exit_code != 0:
            raise BenchError(f"fork: writing the source's files exited {r.exit_code}: {r.stderr[-500:]!r}")
        for i in range(rounds):
            log(f"fork: round {i + 1}/{rounds}: fork of {n}, then {n} creates")
            t0 = time.perf_counter()
            ckpt, forks = await source.fork(n)
            fork_s.append(time.perf_counter() - t0)
            ckpt_s.append(ckpt.seconds)
            try:
                seen = {(await asyncio.to_thread(b.exec, ["cat", "/root/work/f200"])).stdout for b in forks}
                if seen != {b"200\n"}:
                    raise BenchError(f"fork: the forks read {seen}, not the source's files")
            finally:
                await asyncio.to_thread(manager.destroy_all, forks)
            t0 = time.perf_counter()
            made = await asyncio.gather(*(manager.create(REF) for _ in range(n)), return_exceptions=True)
            create_s.append(time.perf_counter() - t0)
            boxes = [b for b in made if isinstance(b, Sandbox)]
            await asyncio.to_thread(manager.destroy_all, boxes)
            failed = [b for b in made if isinstance(b, BaseException)]
            if failed:
                raise BenchError(f"fork: {len(failed)} of {n} creates failed: {failed[0]!r}")
    finally:
        await asyncio.to_thread(manager.destroy, source.id)
    out: dict[str, Any] = {"n": n, "rounds": rounds, "fork": summary(fork_s), "checkpoint": summary(ckpt_s),
           "creates": summary(create_s), "fork_runs": fork_s, "create_runs": create_s}
    out["fork_over_creates_p50"] = ratio(out["fork"]["p50"], out["creates"]["p50"])
    return out


# -- the run ------------------------------------------------------------------------------------------


async def run_bench(args: argparse.Namespace, work: Path, fixture: Path, manager: SandboxManager,
                    peers: Peers) -> dict[str, Any]:
    results: dict[str, Any] = {}
    log(f"publish oci-archive:{fixture}:{TAG} -> {REF} (file store)")
    results["publish"] = await publish_image(manager.store_url or "", work / "pub", f"oci-archive:{fixture}:{TAG}",
                                             work / "convert")
    peers.layout = manager.layout  # crun's cgroup preflight (hybrid hosts) done once, for both
    sections = args.sections
    # the peers' images only when a section compares with them
    need_peers = bool({"latency", "pause"} & set(sections)) or ("sustain" in sections and args.sustain_peers)
    if args.podman and need_peers:
        results["podman"] = await asyncio.to_thread(podman_load, peers, fixture)
    if need_peers:
        log("plain rootfs: skopeo copy + umoci unpack")
        results["plain"] = await asyncio.to_thread(unpack_plain, peers, fixture)
    log("ours: first sandbox (starts the daemon, fetches the chunks /bin/true needs)")
    t0 = time.perf_counter()
    first = await ours_cycle(manager)
    results["first_create_seconds"] = {"first_exec": first.first_exec, "wall": time.perf_counter() - t0}
    if "latency" in sections:
        results["latency"] = await latency_section(manager, peers, args.latency, args.podman)
    if "pause" in sections:
        results["pause"] = await pause_section(manager, peers, args.pauses, args.podman)
    if "fncall" in sections:
        results["fncall"] = await fncall_section(manager, args.calls)
    if "sdk" in sections:
        results["sdk"] = await sdk_section(manager, args.latency)
    if "fork" in sections:
        results["fork"] = await fork_section(manager, args.forks, args.fork_rounds)
    if "network" in sections:
        results["network"] = await network_section(manager, args.net_rounds)
    if "sustain" in sections:
        peer_names = [p for p in args.sustain_peers if p != "podman" or args.podman]
        results["sustain"] = await sustain_section(manager, peers, args.sustain_seconds, args.concurrency,
                                                   peer_names)
    if "idle" in sections:
        results["idle"] = await idle_section(manager, args.idle, args.concurrency, args.settle)
    if "cpu-class" in sections:
        results["cpu_class"] = await cpu_class_section(manager, args.cpu_rounds, args.cpu_blocks,
                                                       args.cpu_neighbours, args.cpu_burners)
    if "fairness" in sections:
        results["fairness"] = await fairness.fairness_section(args.edge_repo, work, manager.store_url or "", REF,
                                                              args.fair_rounds, args.fair_phase_seconds)
    return results


# -- output ---------------------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _mib(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value / MiB:.{digits}f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def render_cpu_class(cc: dict[str, Any]) -> list[str]:
    n = cc["latency"]["alone"]["/bin/true"]["n"]
    out = [f"CPU classes: commands in a latency-sensitive sandbox (ms; n={n} per command and case, cases interleaved "
           f"in {cc['blocks']} block{'s' if cc['blocks'] != 1 else ''}); neighbours: {cc['neighbours']} sandboxes x {cc['burners_per_neighbour']} "
           f"spinning python3 processes; load {cc['loadavg_start']} -> {cc['loadavg_end']}"]
    rows = []
    for name in CPU_COMMANDS:
        alone = cc["latency"]["alone"][name]
        for case in CPU_CASES:
            v = cc["latency"][case][name]
            rows.append([name if case == "alone" else "", case, str(v["n"]), _ms(v["p50"]), _ms(v["p99"]),
                         _ms(v["max"]), "-" if case == "alone" else _x(ratio(v["p50"], alone["p50"])),
                         "-" if case == "alone" else _x(ratio(v["p99"], alone["p99"]))])
    out.append(_table(["command", "neighbours", "n", "p50", "p99", "max", "p50/alone", "p99/alone"], rows))
    for case, what in CPU_CASES.items():
        out.append(f"  {case}: {what}")
    for name, r in cc["ratios"].items():
        be, lat = r["best-effort/alone"], r["latency/alone"]
        out.append(f"  {name}: (b) best-effort/alone p50 {_x(be['p50'])}, p99 {_x(be['p99'])}; "
                   f"(c) latency/alone p50 {_x(lat['p50'])}, p99 {_x(lat['p99'])}")
    rows = []
    for case, t in cc["neighbour_throughput"].items():
        rows.append([case, str(cc["cpu_weights"].get(case)), ",".join(str(p) for p in t["sched_policies"]),
                     _f(t["wall_seconds"], 1),
                     "-" if t["iterations_per_second"] is None else f"{t['iterations_per_second'] / 1e6:.1f}",
                     _f(t["cpus_used"], 2)])
    out.append(_table(["neighbours", "cgroup cpu weight", "sched policy", "burn s", "M iterations/s (all)",
                       "CPUs used"], rows))
    out.append(f"  measured sandbox: {cc['cpu_weights'].get('measured')}; sched policy 5 = SCHED_IDLE, 0 = SCHED_OTHER; "
               f"CPUs used = the burners' CPU seconds / wall seconds ({os.cpu_count()} CPUs here)")
    out.append("")
    return out


def render(doc: dict[str, Any]) -> str:
    s, env = doc["settings"], doc["environment"]
    out = [
        f"layerbox sandbox benchmark: image {s['fixture']}:{TAG} ({REF}, file store); limits {LIMITS.cpu:g} CPU, "
        f"{LIMITS.memory // MiB} MiB, {LIMITS.pids} pids; no network for every method",
        f"{env['cpus']} CPUs, {env['mem_total'] / (1 << 30):.1f} GiB; kernel {env['kernel']}; cgroup v{env['cgroup']}; "
        f"{env['crun']}; {env['podman']}; Python {env['python']}; load {env['loadavg_start']} -> {env['loadavg_end']}; "
        f"wall {env.get('wall_seconds', '-')} s; "
        + ("no count of memory given back to a VM host" if env.get("reported_kib") is None else
           f"free page reporting on: {env['reported_kib'] / 1024:.0f} MiB given back to the VM's host during the run"),
        f"publish {_f(doc['publish']['seconds'])} s; "
        f"plain rootfs unpack {_f(doc['plain']['seconds']) + ' s' if doc.get('plain') else 'skipped'}; "
        f"first sandbox of the run (daemon start, chunk fetches) {_ms(doc['first_create_seconds']['first_exec'])} ms"
        + (f"; podman image {'cached' if doc['podman']['cached'] else 'loaded in ' + _f(doc['podman']['load_seconds']) + ' s'}"
           if doc.get("podman") else ""),
        "",
    ]
    lat = doc.get("latency")
    if lat:
        n = lat["methods"]["ours"]["cycle"]["n"]
        out.append(f"Create to first exec, cached layers (ms; n={n} per method, methods interleaved; p99 = nearest "
                   "rank; cycle = first exec + teardown)")
        rows = []
        for name, m in lat["methods"].items():
            fe = m["first_exec"]
            rows.append([name, _ms(fe["p50"]) if fe else "(end to end)", _ms(fe["p99"]) if fe else "-",
                         _ms(m["cycle"]["p50"]), _ms(m["cycle"]["p99"]), _ms(m["cycle"]["min"])])
        out.append(_table(["method", "first exec p50", "p99", "cycle p50", "cycle p99", "cycle min"], rows))
        for name in lat["methods"]:
            out.append(f"  {name}: {METHODS[name]}")
        out.append("Ratios ours/peer (< 1.00x: ours is faster):")
        for peer, r in lat["ours_over_peer"].items():
            note = " (peer's figure is end to end, removal included)" if r["peer_first_exec_is_end_to_end"] else ""
            out.append(f"  ours/{peer}: first exec p50 {_x(r['first_exec_p50'])}, p99 {_x(r['first_exec_p99'])}{note}; "
                       f"cycle p50 {_x(r['cycle_p50'])}")
        out.append("")
    sus = doc.get("sustain")
    if sus:
        out.append("Sustained creations (create + first exec + destroy cycles, back to back per worker)")
        rows = []
        for r in sus["rows"]:
            rows.append([r["method"], str(r["concurrency"]), _f(r["seconds"], 1), str(r["cycles"]),
                         _f(r["per_second"], 1), _ms(r["cycle"]["p50"]), _ms(r["cycle"]["p99"]), str(r["errors"]),
                         "-" if r["alive_at_deadline"] is None else str(r["alive_at_deadline"]),
                         "-" if r["alive_peak"] is None else str(r["alive_peak"]), _x(r.get("ours_over_peer"))])
        out.append(_table(["method", "workers", "s", "cycles", "per s", "cycle p50 ms", "p99 ms", "errors",
                           "alive at end", "alive peak", "ours/peer per s"], rows))
        for r in sus["rows"]:
            for e in r["first_errors"]:
                out.append(f"  error ({r['method']}): {e}")
        out.append("")
    idle = doc.get("idle")
    if idle:
        p = idle["per_sandbox"]
        out.append(f"Idle sandboxes: {idle['held']} of {idle['requested']} held ({idle['concurrency']} creators); "
                   f"goal {GOAL_IDLE} at <= {GOAL_OVERHEAD_MIB:g} MiB each beyond their own processes")
        if idle["failure"]:
            f = idle["failure"]
            out.append(f"  STOPPED at {f['count_reached']}: {f['error']}")
            out.append(f"  counters then: {json.dumps(f['counters'])}")
        out.append(f"  created in {_f(idle['create_seconds'], 1)} s = {_f(idle['create_per_second'], 1)}/s "
                   f"(held, not destroyed); create p50 {_ms(idle['create']['p50'])} ms, p99 {_ms(idle['create']['p99'])} ms; "
                   f"first tenth p50 {_ms(idle['create_first_tenth_p50'])} ms -> last tenth {_ms(idle['create_last_tenth_p50'])} ms")
        out.append(f"  exec /bin/true in {idle['exec_when_held']['n']} of them while all are held: "
                   f"p50 {_ms(idle['exec_when_held']['p50'])} ms, p99 {_ms(idle['exec_when_held']['p99'])} ms")
        out.append(f"  destroyed in {_f(idle['destroy_seconds'], 1)} s = {_f(idle['destroy_per_second'], 1)}/s; "
                   f"destroy p50 {_ms(idle['destroy']['p50'])} ms, p99 {_ms(idle['destroy']['p99'])} ms; first tenth "
                   f"p50 {_ms(idle['destroy_first_tenth_p50'])} ms -> last tenth {_ms(idle['destroy_last_tenth_p50'])} ms")
        if p:
            rows = [
                ["host MemAvailable drop", _mib(p["mem_available_drop"]), _mib(idle["mem_available_drop"], 0)],
                ["host used growth (free's classic used)", _mib(p["used_growth"]), _mib(idle["used_growth"], 0)],
                [f"own processes Pss ({idle['own']['processes']} procs)", _mib(p["own_pss"]), _mib(idle["own"]["pss"], 0)],
                ["own processes Rss", _mib(p["own_rss"]), _mib(idle["own"]["rss"], 0)],
                ["own cgroups memory usage", _mib(p["cgroup_usage"]), _mib(idle["own"]["cgroup_usage"], 0)],
                ["overhead = MemAvailable drop - own Pss", _mib(p["overhead_available"]),
                 _mib(idle["mem_available_drop"] - idle["own"]["pss"], 0)],
                ["overhead = used growth - own Pss", _mib(p["overhead_used"]),
                 _mib(idle["used_growth"] - idle["own"]["pss"], 0)],
                ["  of which: Slab (SUnreclaim)", f"{_mib(p['delta_Slab'])} ({_mib(p['delta_SUnreclaim'])})", ""],
                ["  Percpu / VmallocUsed", f"{_mib(p['delta_Percpu'])} / {_mib(p['delta_VmallocUsed'])}", ""],
                ["  KernelStack / PageTables", f"{_mib(p['delta_KernelStack'])} / {_mib(p['delta_PageTables'])}", ""],
                ["kernel attributable (SUnreclaim+Percpu+KernelStack+PageTables+Vmalloc)",
                 _mib(p["kernel_attributable"]), ""],
                ["  Shmem / Cached", f"{_mib(p['delta_Shmem'])} / {_mib(p['delta_Cached'])}", ""],
                ["  lazyfetch daemon Pss / bench (manager) Pss", f"{_mib(p['daemon_pss'])} / {_mib(p['bench_pss'])}", ""],
            ]
            out.append(_table(["memory", "MiB per sandbox", "MiB total"], rows))
            c = idle["counters_at_peak"]
            out.append(f"  at peak: {c['processes']} processes, {c['threads']} threads (pid_max {c['pid_max']}), "
                       f"{c['host_mounts']} host mounts (before: {idle['counters_before']['host_mounts']}), "
                       f"{c['open_files']} open files, daemon fds {idle['host_side_after']['daemon_fds']}, "
                       f"bench fds {c['bench_fds']}")
            out.append(f"  MemAvailable after destroying all vs before: {_mib(idle['residual_after_destroy'], 1)} MiB lower")
            ok = idle["held"] >= GOAL_IDLE and (p["overhead_available"] or 0) <= GOAL_OVERHEAD_MIB * MiB
            out.append(f"  goal: {'MET' if ok else 'MISSED'} ({idle['held']} held, "
                       f"{_mib(p['overhead_available'])} MiB overhead each by MemAvailable)")
        out.append("")
    pause = doc.get("pause")
    if pause:
        out.append(f"Pause / resume (ms; reclaim after {' '.join(PAGE_CACHE_CMD[:2])} ... each round)")
        rows = [[name, str(v["n"]), _ms(v["p50"]), _ms(v["p99"])] for name, v in pause.items()
                if isinstance(v, dict)]
        out.append(_table(["operation", "n", "p50", "p99"], rows))
        out.append(f"  page cache pushed out per reclaiming pause: {_mib(pause['reclaimed_bytes_p50'])} MiB (p50)")
        ours_p = pause.get("pause (no reclaim)", pause.get("pause (reclaim)"))
        for peer in ("crun pause", "podman pause"):
            if peer in pause and ours_p:
                out.append(f"  ours/{peer} p50: {_x(ratio(ours_p['p50'], pause[peer]['p50']))} (no-reclaim pause)")
        out.append("")
    fn = doc.get("fncall")
    if fn is not None:
        if not fn.get("available"):
            out.append(f"FnCall: {fn['error']}")
        else:
            out.append(f"FnCall (WarmPool size 2; pool start {_f(fn.get('start_seconds'), 2)} s; ms)")
            rows = []
            for name in ("cmd true", "python f(1)"):
                if name in fn:
                    d = fn[name]["duration"]
                    rows.append([name, str(fn[name]["wall"]["n"]), _ms(fn[name]["wall"]["p50"]),
                                 _ms(fn[name]["wall"]["p99"]), _ms(d["p50"]) if d else "-", _ms(d["p99"]) if d else "-"])
            out.append(_table(["call", "n", "wall p50", "wall p99", "r.duration p50", "p99"], rows))
            if fn.get("error"):
                out.append(f"  error: {fn['error']}")
        out.append("")
    fork = doc.get("fork")
    if fork:
        out.append(f"Fork of {fork['n']} (one checkpoint, {fork['n']} restores together) against {fork['n']} "
                   f"creates together: seconds until all {fork['n']} run ({fork['rounds']} rounds)")
        rows = [[name, str(fork[key]["n"]), _f(fork[key]["p50"], 3), _f(fork[key]["max"], 3)]
                for name, key in ((f"fork({fork['n']})", "fork"), ("  of which the checkpoint", "checkpoint"),
                                  (f"{fork['n']} x create", "creates"))]
        out.append(_table(["operation", "n", "p50 s", "max s"], rows))
        out.append(f"  fork/creates p50: {_x(fork['fork_over_creates_p50'])}")
        out.append("")
    sdk = doc.get("sdk")
    if sdk:
        out.append("Through the edge service and the SDK (HTTP on 127.0.0.1; ms)")
        rows = [[name, str(sdk[key]["n"]), _ms(sdk[key]["p50"]), _ms(sdk[key]["p99"])] for name, key in (
            ("create (POST /v1/sandboxes)", "create"), ("create to first command's exit", "create_to_first_exit"),
            ("exec true, a live sandbox", "exec_true"), ("  the manager's own exec time", "exec_true_manager"))]
        if "ready_create" in sdk:
            rows[2:2] = [[f"create, a ready pool of {sdk['ready_size']}", str(sdk["ready_create"]["n"]),
                          _ms(sdk["ready_create"]["p50"]), _ms(sdk["ready_create"]["p99"])],
                         ["create to first exit, ready pool", str(sdk["ready_create_to_first_exit"]["n"]),
                          _ms(sdk["ready_create_to_first_exit"]["p50"]), _ms(sdk["ready_create_to_first_exit"]["p99"])]]
        if "pty_round_trip" in sdk:
            pty = sdk["pty_round_trip"]
            rows.append(["terminal round trip, 1 byte (WebSocket)", str(pty["n"]), _ms(pty["p50"]), _ms(pty["p99"])])
        if "fork" in sdk:
            fork = sdk["fork"]
            rows.append([f"sb.fork({fork['forks']}) until all {fork['forks']} run", str(fork["n"]),
                         _ms(fork["p50"]), _ms(fork["p99"])])
        out.append(_table(["step", "n", "p50", "p99"], rows))
        for label, key in (("new sandbox", "create_to_first_exit"), ("ready pool", "ready_create_to_first_exit")):
            if key not in sdk:
                continue
            first = sdk[key]["p50"]
            out.append(f"  ours, {label} (create to first exit, p50 {first * 1000:.1f} ms) against published start "
                       "figures (theirs, not measured here): "
                       + ", ".join(f"{name} {v * 1000:.0f} ms -> {_x(ratio(first, v))}"
                                   for name, v in sdk["published_starts"].items()))
        out.append("")
    net = doc.get("network")
    if net:
        out.append(f"Policed network (own netns + veth + default-deny nftables table, egress counted per exec; "
                   f"rules {json.dumps(NET_RULES)}; ms)")
        rows = [[name, str(v["n"]), _ms(v["p50"]), _ms(v["p99"])] for name, v in net.items()
                if isinstance(v, dict) and "p50" in v]
        out.append(_table(["operation", "n", "p50", "p99"], rows))
        r = net["policed_over_plain"]
        out.append(f"  policed/no network p50: create+first exec {_x(r['create'])}, exec {_x(r['exec'])}; "
                   f"counter read in-process/nft command {_x(r['counters_lib_over_tool'])}; "
                   f"set_policy {_ms(net['set_policy_seconds'])} ms")
        out.append("")
    cc = doc.get("cpu_class")
    if cc:
        out.extend(render_cpu_class(cc))
    if doc.get("fairness"):
        out.extend(fairness.render(doc["fairness"], _ms, _x))
    c = doc.get("cleanup", {})
    out.append(f"cleanup: mounts left {c.get('mounts_left')}, workdir removed {c.get('workdir_removed')}, "
               f"problems {c.get('problems')}")
    return "\n".join(out)


# -- main ---------------------------------------------------------------------------------------------

SECTIONS = ("latency", "pause", "fncall", "sdk", "fork", "network", "sustain", "idle", "cpu-class", "fairness")


def _list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"{', '.join(bad)}: choose from {', '.join(choices)}")
        return items
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench/sandbox.py",
        description="Sandboxes (create to first exec, sustained creations, idle sandboxes per host and memory "
        "each, pause/resume, FnCall) against podman run and plain crun on an unpacked rootfs, and command latency "
        "next to best-effort and latency-class neighbours burning CPU, in one run.",
    )
    p.add_argument("--quick", action="store_true",
                   help="10 latency rounds, 10 s sustain, 50 idle, 10 pauses, 20 calls, 12 cpu-class rounds: "
                   "a smoke test")
    p.add_argument("--latency", type=int, default=None, metavar="N", help="rounds per method (default 30; 10 quick)")
    p.add_argument("--sustain-seconds", type=float, default=None, metavar="S",
                   help="seconds of create+exec+destroy cycles per method (default 60; 10 quick)")
    p.add_argument("--sustain-peers", type=_list(("podman", "crun")), default=["podman", "crun"], metavar="LIST",
                   help="peers of the sustain section: podman, crun (default both; '' for ours only)")
    p.add_argument("--concurrency", type=int, default=2, metavar="C",
                   help="workers creating/destroying at once in sustain and idle (default 2)")
    p.add_argument("--idle", type=int, default=None, metavar="N", help="idle sandboxes to hold (default 1000; 50 quick)")
    p.add_argument("--settle", type=float, default=None, metavar="S",
                   help="seconds to wait before each memory reading (default 10; 3 quick)")
    p.add_argument("--pauses", type=int, default=None, metavar="N", help="pause/resume rounds (default 50; 10 quick)")
    p.add_argument("--calls", type=int, default=None, metavar="N", help="FnCall calls per case (default 100; 20 quick)")
    p.add_argument("--net-rounds", type=int, default=None, metavar="N",
                   help="network: rounds of each case (default 30; 5 quick)")
    p.add_argument("--cpu-rounds", type=int, default=None, metavar="N",
                   help="cpu-class: runs of each command per case (default 60; 12 quick)")
    p.add_argument("--cpu-blocks", type=int, default=None, metavar="B",
                   help="cpu-class: the cases are interleaved in B blocks (default 3; 1 quick)")
    p.add_argument("--cpu-neighbours", type=int, default=2, metavar="N",
                   help="cpu-class: neighbour sandboxes burning CPU (default 2)")
    p.add_argument("--forks", type=int, default=8, metavar="N", help="fork: sandboxes per fork (default 8)")
    p.add_argument("--fork-rounds", type=int, default=None, metavar="R",
                   help="fork: rounds of fork and creates (default 5; 2 quick)")
    p.add_argument("--cpu-burners", type=int, default=os.cpu_count() or 1, metavar="P",
                   help="cpu-class: spinning processes per neighbour (default: the host's CPUs)")
    p.add_argument("--fair-rounds", type=int, default=None, metavar="N",
                   help="fairness: beta's rounds quiet and with alpha hostile (default 30; 10 quick)")
    p.add_argument("--fair-phase-seconds", type=float, default=900.0, metavar="S",
                   help="fairness: at most this long per phase (a frozen edge ends it; default 900)")
    p.add_argument("--edge-repo", type=Path, default=Path(__file__).resolve().parents[1], metavar="DIR",
                   help="fairness: run the edge from this checkout (another commit: its figures before a change; "
                   "default this one)")
    p.add_argument("--sections", "--only", type=_list(SECTIONS), default=list(SECTIONS), metavar="LIST",
                   help=f"which sections to run (default {','.join(SECTIONS)})")
    p.add_argument("--no-podman", dest="podman", action="store_false", help="leave podman out (not installed)")
    p.add_argument("--fixture", default=None, metavar="PATH",
                   help=f"the oci-archive with tag {TAG} (default ../shared/fixtures/{FIXTURE_NAME})")
    p.add_argument("--tmpdir", type=Path, default=Path("/var/tmp"), metavar="DIR",
                   help="where the store, the data dir, the plain rootfs go (default /var/tmp); removed at exit")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the tables")
    return p


@contextlib.contextmanager
def signals_as_exit() -> Iterator[None]:
    """SIGTERM/SIGHUP outside the event loop unwind through every finally, like Ctrl-C."""
    def terminate(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    old = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            old[sig] = signal.signal(sig, terminate)
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    q = args.quick
    args.latency = args.latency if args.latency is not None else (10 if q else 30)
    args.sustain_seconds = args.sustain_seconds if args.sustain_seconds is not None else (10.0 if q else 60.0)
    args.idle = args.idle if args.idle is not None else (50 if q else 1000)
    args.settle = args.settle if args.settle is not None else (3.0 if q else 10.0)
    args.pauses = args.pauses if args.pauses is not None else (10 if q else 50)
    args.calls = args.calls if args.calls is not None else (20 if q else 100)
    args.net_rounds = args.net_rounds if args.net_rounds is not None else (5 if q else 30)
    args.cpu_rounds = args.cpu_rounds if args.cpu_rounds is not None else (12 if q else 60)
    args.cpu_blocks = args.cpu_blocks if args.cpu_blocks is not None else (1 if q else 3)
    args.fork_rounds = args.fork_rounds if args.fork_rounds is not None else (2 if q else 5)
    args.fair_rounds = args.fair_rounds if args.fair_rounds is not None else (10 if q else 30)
    if min(args.latency, args.idle, args.pauses, args.calls, args.net_rounds, args.concurrency, args.cpu_rounds,
           args.cpu_blocks, args.cpu_neighbours, args.cpu_burners, args.forks, args.fork_rounds, args.fair_rounds) < 1 or args.sustain_seconds <= 0 \
            or args.settle < 0:
        print("bench/sandbox.py: counts must be at least 1, --sustain-seconds positive", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("bench/sandbox.py: needs root (mounts, cgroups, crun)", file=sys.stderr)
        return 1
    needed = ["crun", "skopeo", "umoci"] + (["podman"] if args.podman else [])
    if args.cpu_blocks > args.cpu_rounds:
        print("bench/sandbox.py: --cpu-blocks must not exceed --cpu-rounds", file=sys.stderr)
        return 2
    missing = [t for t in needed if shutil.which(t) is None]
    if missing:
        print(f"bench/sandbox.py: missing {', '.join(missing)} (make bench-deps; --no-podman leaves podman out)",
              file=sys.stderr)
        return 1
    started = time.time()
    load_start, reported_start = loadavg(), reported_kib()
    args.tmpdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="lb-sbx-", dir=args.tmpdir))
    (work / "convert").mkdir()
    doc: dict[str, Any] = {}
    status = 0
    manager: SandboxManager | None = None
    peers = Peers(uuid.uuid4().hex[:8], work, args.podman)
    try:
        with signals_as_exit():
            try:
                fixture = find_fixture(args.fixture)
                manager = SandboxManager(host_dir(work), f"file://{work / 'store'}")
                results = asyncio.run(run_bench(args, work, fixture, manager, peers))
                doc = {
                    "schema": SCHEMA,
                    "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
                    | {"fixture": str(fixture), "ref": REF, "limits": dataclasses.asdict(LIMITS),
                       "podman_flags": PODMAN_LIMITS},
                    "environment": {
                        "workdir": str(work), "cpus": os.cpu_count(), "mem_total": meminfo()["MemTotal"],
                        "kernel": platform.release(), "python": platform.python_version(),
                        "cgroup": manager.layout.version, "crun": tool_version(["crun", "--version"]),
                        "podman": tool_version(["podman", "--version"]) if args.podman else "no podman",
                        "loadavg_start": load_start, "loadavg_end": loadavg(),
                        "reported_kib": None if reported_start is None else (reported_kib() or 0) - reported_start,
                        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
                    },
                    **results,
                }
            finally:
                log("cleaning up: sandboxes, daemon, mounts, crun and podman containers, the workdir")
                done = cleanup(work, manager, peers)
                if doc:
                    doc["cleanup"] = done
                    doc["environment"]["wall_seconds"] = round(time.time() - started, 1)
                if done["mounts_left"] or not done["workdir_removed"] or done["problems"]:
                    log(f"bench/sandbox.py: cleanup incomplete: {done}")
                    status = 1
                else:
                    log(f"cleanup: nothing left under {work}; workdir removed")
    except BenchError as exc:
        log(f"bench/sandbox.py: {exc}")
        return 1
    except LayerboxError as exc:
        log(f"bench/sandbox.py: layerbox failed: {type(exc).__name__}: {exc}")
        return 1
    except (KeyboardInterrupt, asyncio.CancelledError):
        log("bench/sandbox.py: interrupted; everything it created was removed")
        return 130
    emit(doc, args.json, render)
    return status


if __name__ == "__main__":
    sys.exit(main())
