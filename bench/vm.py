"""Benchmark: microVM sandboxes (QEMU microvm, TCG or KVM) against containers, in one run.

On the fixture's ``python`` image published to a ``file://`` store:

* **create to first exec**: the first microVM of an image on a host (a cold boot of the
  template and its save, then the restore), later ones (a template restore), and a crun
  container for reference; each then runs ``/bin/true``.
* **exec latency**: ``/bin/true`` in a running microVM and in a container, ``--execs`` times.
* **idle memory**: ``--idle`` microVMs started and left alone; per VM, the VMM cgroup's
  memory against what the guest uses (MemTotal - MemAvailable in the guest).  Goal: host
  memory per idle VM <= guest memory used + 20 MiB.
* **pause with reclaim / resume**: a pause to the store (a checkpoint with memory, then the
  VMM stopped and its files removed): bytes uploaded, the time the guest was stopped, the
  pause and the resume here; then the same pause resumed on the second host.
* **block checkpoint**: ``--writes`` MB written in the guest, then ``checkpoint()``: its
  freeze and total time and bytes uploaded against bytes written.
* **restore**: the checkpoint restored into a microVM on a second host (another data dir,
  an empty cache: every block and layer chunk fetched from the store, the template mapped
  from the store) against a restore on the host that made it (warm cache).
* **template from the store**: a third fresh host creates a microVM of the image: the
  template the first host published is mounted lazily instead of booted; against the cold
  boot on the first host; bytes fetched.
* **memory checkpoint**: ``checkpoint(memory=True)`` of the running VM (disk, RAM and device
  state in one stop): its freeze and total time, RAM captured and bytes uploaded (unchanged
  RAM is its template's chunks); restored on the third host, where the guest's processes go
  on, against the disk-only restore there.
* **full VM** (``isolation="vm"``, q35): its cold boot and template restore to first exec and
  its exec latency, against the microVM's of the same run; with ``--image-kernel`` also an
  image that brings its own kernel (Debian's newest cloud kernel, installed in a layer over
  the fixture): its first boot (its set built from the image, then the template) and restore.

TCG inflates everything the guest executes (boot, exec, guest work) by 10-50x; it does not
inflate the host side: QEMU's save and restore of device state, the store's upload and
fetch, the qcow2 work.  Anchors: E2B resumes in ~1 s, CubeSandbox restores across nodes in
836 ms from S3, Firecracker resumes in under 10 ms from local memory (all with KVM).
Everything made is removed at exit.  Run ``python bench/vm.py --help``.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import BenchError, emit, log  # noqa: E402

from converters.publish import publish  # noqa: E402
from layerstore.store import Store  # noqa: E402
from sandbox.core.model import SandboxOptions  # noqa: E402
from sandbox.host.manager import Sandbox, SandboxManager  # noqa: E402

FIXTURE = ROOT.parent / "shared" / "fixtures" / "debian-bookworm.oci.tar"
REF = "img/python"
KERNEL_REF = "img/python-own-kernel"
MiB = 1 << 20


def _fixture() -> Path:
    for p in (FIXTURE, *sorted((ROOT.parent / "shared" / "fixtures").glob("*.tar"))):
        if p.exists():
            return p
    raise BenchError("no fixture archive under ../shared/fixtures")


async def _publish(url: str, work: Path) -> None:
    async with await Store.open(url, work / "pub") as s:
        await publish(s, f"oci-archive:{_fixture()}:python", REF)


async def _publish_kernel(url: str, work: Path, tree: Path) -> None:
    async with await Store.open(url, work / "pub") as s:
        await publish(s, str(tree), "kernels/cloud")
        await s.compose(KERNEL_REF, {"base": REF, "toolkit": "kernels/cloud"})


def _ms(t: float) -> float:
    return round(t * 1000, 1)


def guest_used(box: Sandbox) -> int:
    info = dict(line.split(":", 1) for line in box.read("/proc/meminfo").decode().splitlines() if ":" in line)
    kb = int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])
    return kb * 1024


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def host_busy() -> tuple[float, float]:
    """(busy, total) jiffies of every CPU since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def idle_figures(mgr: SandboxManager, idle: list[Sandbox], available: int, window: float) -> dict[str, Any]:
    """What idle microVMs cost the host: memory (each VMM's cgroup, and the host's MemAvailable drop)
    and CPU (each VMM cgroup's CPU time over ``window`` seconds, and the host's), and how many
    such VMs this host would hold by each (an extrapolation from the ``len(idle)`` measured)."""
    per = [{"host": mgr.layout.memory_current(b.state.cgroups_path) or 0, "guest_used": guest_used(b)} for b in idle]
    drop = (available - mem_available()) / len(idle)
    cpu0 = [mgr.layout.cpu_seconds(b.state.cgroups_path) or 0.0 for b in idle]
    busy0, total0 = host_busy()
    time.sleep(window)
    busy1, total1 = host_busy()
    cpu1 = [mgr.layout.cpu_seconds(b.state.cgroups_path) or 0.0 for b in idle]
    cores = os.cpu_count() or 1
    per_vm = statistics.mean(b - a for a, b in zip(cpu0, cpu1, strict=True)) / window * 100  # % of a core
    host_pct = (busy1 - busy0) / max(total1 - total0, 1) * 100 * cores
    return {"vms": len(per), "host_mib_mean": round(statistics.mean(p["host"] for p in per) / MiB, 1),
            "guest_used_mib_mean": round(statistics.mean(p["guest_used"] for p in per) / MiB, 1),
            "overhead_mib_mean": round(statistics.mean(p["host"] - p["guest_used"] for p in per) / MiB, 1),
            "goal_overhead_mib": 20, "mem_available_drop_mib_per_vm": round(drop / MiB, 1),
            "cpu_pct_of_a_core_per_vm": round(per_vm, 2), "host_cpu_pct_of_a_core": round(host_pct, 1),
            "window_s": window,
            "would_hold_by_memory": int(available / max(drop, 1)),
            "would_hold_by_cpu": int(cores * 100 / per_vm) if per_vm > 0 else None}


def create_first_exec(mgr: SandboxManager, options: SandboxOptions, ref: str = REF) -> tuple[Sandbox, float]:
    t = time.perf_counter()
    box = asyncio.run(mgr.create(ref, options))
    box.exec(["/bin/true"])
    return box, time.perf_counter() - t


def creates(mgr: SandboxManager, options: SandboxOptions, n: int, ref: str = REF) -> list[float]:
    """``n`` sandboxes created to their first exec and destroyed: the seconds of each."""
    took = []
    for _ in range(n):
        b, t = create_first_exec(mgr, options, ref)
        took.append(t)
        b.destroy()
    return took


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    url = f"file://{work / 'store'}"
    asyncio.run(_publish(url, work))
    vm = SandboxOptions(isolation="microvm", memory=args.memory * MiB, disk=512 * MiB)
    doc: dict[str, Any] = {"options": {"memory_mib": args.memory, "disk_mib": 512}}
    host1 = SandboxManager(work / "host1", url)
    host2 = SandboxManager(work / "host2", url)
    host2.host.daemon_options = {"fill_below": 0}  # what it fetches, the guest read
    host3 = SandboxManager(work / "host3", url)
    host3.host.daemon_options = {"fill_below": 0}
    made: list[Sandbox] = []  # destroyed by the hosts' close() at the end, whatever happens
    try:
        accel = host1.backend("microvm").capabilities("microvm").to_json()
        doc["vmm"] = {k: accel.get(k) for k in ("qemu", "accel", "accel_reason", "guest_assets", "kernel")}
        log("create: the first microVM (template boot)")
        box, cold = create_first_exec(host1, vm)
        made.append(box)
        rec = box.receipts()[0]
        warm = creates(host1, vm, args.creates)
        cont = creates(host1, SandboxOptions(), args.creates)
        doc["create"] = {"cold_boot_ms": _ms(cold), "template_seconds": rec.get("template_seconds"),
                         "template_restore_p50_ms": _ms(statistics.median(warm)),
                         "container_p50_ms": _ms(statistics.median(cont)),
                         "cold_vs_restore": round(cold / statistics.median(warm), 1),
                         "restore_vs_container": round(statistics.median(warm) / statistics.median(cont), 2)}
        log("exec latency")
        ct = asyncio.run(host1.create(REF, SandboxOptions()))
        made.append(ct)
        lat: dict[str, list[float]] = {"microvm": [], "container": []}
        for _ in range(args.execs):
            for name, b in (("microvm", box), ("container", ct)):
                t = time.perf_counter()
                b.exec(["/bin/true"])
                lat[name].append(time.perf_counter() - t)
        doc["exec"] = {k: {"p50_ms": _ms(statistics.median(v)), "max_ms": _ms(max(v))} for k, v in lat.items()}
        doc["exec"]["ratio"] = round(statistics.median(lat["microvm"]) / statistics.median(lat["container"]), 1)
        log(f"idle: {args.idle} microVMs")
        idle = []
        available = mem_available()
        for _ in range(args.idle):
            b, _t = create_first_exec(host1, vm)
            idle.append(b)
            made.append(b)
        time.sleep(args.settle)
        doc["idle"] = idle_figures(host1, idle, available, args.idle_window)
        for b in idle:
            b.destroy()
            made.remove(b)
        if args.idle_only:
            return doc
        log("pause with reclaim / resume")
        t = time.perf_counter()
        paused = box.pause(reclaim=True)
        pause_s = time.perf_counter() - t
        t = time.perf_counter()
        box.resume()
        resume_s = time.perf_counter() - t
        doc["pause"] = {"guest_ram_mib": args.memory, "uploaded_mb": round(paused["reclaim"]["bytes_uploaded"] / 1e6, 1),
                        "stopped_ms": _ms(paused["reclaim"]["stopped_seconds"]), "pause_ms": _ms(pause_s),
                        "resume_ms": _ms(resume_s)}
        log(f"block checkpoint of {args.writes} MB written")
        box.exec(f"head -c {args.writes * 1000000} /dev/urandom > /root/written; sync", timeout=600)
        t = time.perf_counter()
        ckpt = asyncio.run(box.checkpoint())
        ck_s = time.perf_counter() - t
        doc["checkpoint"] = {"written_mb": args.writes, "seconds": round(ck_s, 3),
                             "freeze_ms": _ms(ckpt.freeze_seconds), "bytes_uploaded_mb": round(ckpt.bytes_uploaded / 1e6, 1),
                             "uploaded_vs_written": round(ckpt.bytes_uploaded / (args.writes * 1e6), 2)}
        log("restore: warm (this host) and cold (a second host, empty cache)")
        out: dict[str, Any] = {}
        for name, mgr in (("warm", host1), ("cold", host2)):
            t = time.perf_counter()
            r = asyncio.run(mgr.restore(ckpt.digest))
            first = r.exec("wc -c < /root/written")
            out[f"{name}_to_first_exec_ms"] = _ms(time.perf_counter() - t)
            start = next(x for x in r.receipts() if x["action"] == "restore" and not x.get("inherited"))
            out[f"{name}_template_boot_ms"] = _ms(start["template_seconds"]) if start.get("template_made") else 0.0
            out[f"{name}_reads_back"] = int(first.stdout) == args.writes * 1000000
            made.append(r)
            out[f"{name}_template_source"] = start.get("template_source")
        stats = host2.host.client.request("GET", "/stats")
        out["cold_fetched_mb"] = round(stats["bytes_fetched"] / 1e6, 1)
        out["cold_vs_warm"] = round(out["cold_to_first_exec_ms"] / out["warm_to_first_exec_ms"], 2)
        doc["restore"] = out
        log("resume elsewhere: the pause's checkpoint restored on the second host")
        t = time.perf_counter()
        moved_pause = asyncio.run(host2.restore(paused["reclaim"]["digest"]))
        moved_pause.exec(["/bin/true"])
        doc["pause"]["resume_elsewhere_ms"] = _ms(time.perf_counter() - t)
        moved_pause.destroy()
        log("template from the store: a third fresh host")
        b3, t3 = create_first_exec(host3, vm)
        made.append(b3)
        start = b3.receipts()[0]
        fetched3 = host3.host.client.request("GET", "/stats")["bytes_fetched"]
        doc["store_template"] = {"create_to_first_exec_ms": _ms(t3), "template_source": start.get("template_source"),
                                 "template_mount_ms": _ms(start["template_seconds"]),
                                 "fetched_mb": round(fetched3 / 1e6, 1),
                                 "vs_cold_boot": round(t3 / cold, 2)}
        b3.destroy()
        made.remove(b3)
        log("memory checkpoint, restored on the third host")
        box.exec("nohup sh -c 'while true; do date +%s%N > /root/tick; sleep 0.1; done' >/dev/null 2>&1 &")
        box.exec("echo in-ram > /dev/shm/note")
        t = time.perf_counter()
        mem = asyncio.run(box.checkpoint(memory=True))
        mem_s = time.perf_counter() - t
        before = host3.host.client.request("GET", "/stats")["bytes_fetched"]
        t = time.perf_counter()
        moved = asyncio.run(host3.restore(mem.digest))
        note = moved.exec("cat /dev/shm/note")
        moved_s = time.perf_counter() - t
        made.append(moved)
        if note.stdout != b"in-ram\n":
            raise BenchError(f"the memory restore lost the guest's tmpfs: {note.stdout!r}")
        after = host3.host.client.request("GET", "/stats")["bytes_fetched"]
        t = time.perf_counter()
        disk_only = asyncio.run(host3.restore(ckpt.digest))
        disk_only.exec(["/bin/true"])
        disk_s = time.perf_counter() - t
        made.append(disk_only)
        doc["memory_checkpoint"] = {
            "guest_ram_mib": args.memory, "seconds": round(mem_s, 3), "freeze_ms": _ms(mem.freeze_seconds),
            "captured_mb": round(mem.bytes_changed / 1e6, 1), "uploaded_mb": round(mem.bytes_uploaded / 1e6, 1),
            "uploaded_vs_captured": round(mem.bytes_uploaded / max(1, mem.bytes_changed), 3),
            "restore_to_first_exec_ms": _ms(moved_s), "restore_fetched_mb": round((after - before) / 1e6, 1),
            "disk_only_restore_ms": _ms(disk_s), "memory_vs_disk_only": round(moved_s / disk_s, 2)}
        log("full VM (q35)")
        full = vm.replace(isolation="vm")
        fbox, fcold = create_first_exec(host1, full)
        made.append(fbox)
        fwarm = creates(host1, full, args.creates)
        flat = []
        for _ in range(args.execs):
            t = time.perf_counter()
            fbox.exec(["/bin/true"])
            flat.append(time.perf_counter() - t)
        doc["full_vm"] = {"cold_boot_ms": _ms(fcold), "template_restore_p50_ms": _ms(statistics.median(fwarm)),
                          "exec_p50_ms": _ms(statistics.median(flat)),
                          "cold_vs_microvm": round(fcold / cold, 2),
                          "restore_vs_microvm": round(statistics.median(fwarm) / statistics.median(warm), 2),
                          "exec_vs_microvm": round(statistics.median(flat) / statistics.median(lat["microvm"]), 2)}
        if args.image_kernel:
            log("full VM on the image's own kernel")
            from tests.support.vmkernel import kernel_tree
            tree, version = kernel_tree()
            asyncio.run(_publish_kernel(url, work, tree))
            own = full.replace(kernel="image")
            kbox, kcold = create_first_exec(host1, own, KERNEL_REF)
            made.append(kbox)
            kwarm = creates(host1, own, args.creates, KERNEL_REF)
            uname = kbox.exec("uname -r").stdout.decode().strip()
            if uname != version:
                raise BenchError(f"the image kernel VM runs {uname!r}, not the image's {version!r}")
            doc["image_kernel"] = {"kernel": version, "first_create_ms": _ms(kcold),
                                   "template_restore_p50_ms": _ms(statistics.median(kwarm)),
                                   "first_vs_layerbox_kernel": round(kcold / fcold, 2)}
    finally:
        # close() destroys every sandbox of a host (the ones a failed step left too), its mounts,
        # namespaces and daemon; a failure of the first host's does not keep the second's
        try:
            host1.close()
        finally:
            try:
                host2.close()
            finally:
                host3.close()
    return doc


def render(doc: dict[str, Any]) -> str:
    lines = [f"VMM: {doc.get('vmm')}"]
    for section in ("create", "exec", "idle", "pause", "checkpoint", "restore", "store_template", "memory_checkpoint",
                    "full_vm", "image_kernel"):
        if section in doc:
            lines.append(f"{section:<11} " + ", ".join(f"{k} {v}" for k, v in doc[section].items()))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(prog="bench/vm.py", description=__doc__.split("\n")[0])
    p.add_argument("--memory", type=int, default=512, help="guest RAM in MiB (default 512)")
    p.add_argument("--creates", type=int, default=5, help="restores and container creates timed (default 5)")
    p.add_argument("--execs", type=int, default=20, help="exec rounds (default 20)")
    p.add_argument("--idle", type=int, default=4, help="idle microVMs measured (default 4)")
    p.add_argument("--settle", type=float, default=5.0, help="seconds before the idle reading (default 5)")
    p.add_argument("--idle-window", type=float, default=10.0, metavar="S",
                   help="seconds over which idle CPU is measured (default 10)")
    p.add_argument("--idle-only", action="store_true",
                   help="stop after the idle section (to measure many idle microVMs)")
    p.add_argument("--writes", type=int, default=20, help="MB the guest writes before the checkpoint (default 20)")
    p.add_argument("--image-kernel", action="store_true",
                   help="also a full VM on an image's own kernel (downloads Debian's newest cloud kernel once)")
    p.add_argument("--tmpdir", type=Path, default=Path("/var/tmp"))
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-vm-", dir=args.tmpdir) as tmp:
        doc = run(args, Path(tmp))
    emit(doc, args.json, render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
