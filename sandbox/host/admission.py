"""Admission on one edge: admit a create only when the host really has room for it.

Capacity is measured, not summed from limits: idle sandboxes use a few MiB
each while their memory limits may be 512 MiB, so adding up limits would
refuse a host that could hold a thousand of them.  Each resource is::

    memory     MemAvailable (/proc/meminfo) - host reserve - memory of creates in flight
    pids       min(kernel.pid_max, kernel.threads-max) - current tasks - reserve - pids in flight
    disk       statvfs(data dir) free - reserve - disk of creates in flight
    sandboxes  max_sandboxes - live - creates in flight

A create in flight is reserved from the moment it is admitted until it
returns, because the kernel numbers only show a sandbox once it has started:
without the reservation, ten concurrent creates would all see the same free
memory.  The count of live sandboxes includes the directories of creates in
flight, so near ``max_sandboxes`` concurrent creates are refused slightly
early (never admitted past it).

Every probe is a read of a /proc file, one ``statvfs`` and one directory scan
(tens of microseconds; no JSON parsing per sandbox), so a create pays well
under a millisecond.  This module has no dependencies beyond the standard
library so that clients can import :func:`score`.
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbox.core.errors import SandboxError
from sandbox.core.model import DEFAULT_MEMORY, DEFAULT_PIDS, SandboxOptions

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
# The upper dir of an idle sandbox holds a few files; a request that names no disk is charged this.
DEFAULT_DISK = 64 * MiB

RESOURCES = ("sandboxes", "memory", "pids", "disk")


class CapacityExceeded(SandboxError):
    """The edge lacks room for this create right now; retry later or on another edge."""

    retryable = True

    def __init__(self, message: str, *, resources: tuple[str, ...], retry_after: float) -> None:
        super().__init__(message, fix=f"retry in {retry_after:g} s or on another edge")
        self.resources = resources  # every short resource, the first is the one named first
        self.retry_after = retry_after


def parse_size(text: str | int) -> int:
    """``"2G"``, ``"512MiB"``, ``"100m"`` or a plain byte count -> bytes (binary units)."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text, re.IGNORECASE)
        if m is None:
            raise ValueError(f"not a size: {text!r} (use bytes or a K/M/G/T suffix, e.g. 2G)")
        value = int(float(m.group(1)) * (1 << (10 * " kmgt".index(m.group(2).lower() or " "))))
    if value < 0:
        raise ValueError(f"a size cannot be negative: {text!r}")
    return value


def human(n: float) -> str:
    """Bytes for people: ``1.5 GiB``, ``300 MiB``."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            value = n / size
            return f"{value:.0f} {unit}" if value == int(value) or abs(value) >= 100 else f"{value:.1f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class AdmissionConfig:
    edge_id: str = "edge"
    max_sandboxes: int = 1000
    memory_reserve: int = 2 * GiB  # for the host itself: daemons, page cache the store needs, the edge
    disk_reserve: int = 1 * GiB
    pids_reserve: int = 512
    retry_after: float = 5.0  # seconds a rejected client should wait before asking this edge again


@dataclass(frozen=True)
class Demand:
    """What one create needs; the limits it asks for, or the manager's defaults."""

    memory: int = DEFAULT_MEMORY
    pids: int = DEFAULT_PIDS
    disk: int = DEFAULT_DISK

    @classmethod
    def of(cls, options: SandboxOptions) -> Demand:
        return cls(options.memory, options.pids, options.disk if options.disk is not None else DEFAULT_DISK)


@dataclass(frozen=True)
class Probe:
    """One reading of the host's real numbers (before reserves and creates in flight)."""

    time: float
    mem_total: int
    mem_available: int
    task_limit: int
    tasks: int
    disk_total: int
    disk_available: int
    live: int
    loadavg: tuple[float, float, float]
    cpus: int


def _meminfo() -> tuple[int, int]:
    total = available = -1
    with open("/proc/meminfo", "rb") as f:
        for line in f:
            if line.startswith(b"MemTotal:"):
                total = int(line.split()[1]) * KiB
            elif line.startswith(b"MemAvailable:"):
                available = int(line.split()[1]) * KiB
            if total >= 0 and available >= 0:
                break
    if total < 0 or available < 0:
        raise SandboxError("/proc/meminfo has no MemTotal/MemAvailable (kernel older than 3.14?)")
    return total, available


def _read_int(path: str) -> int:
    with open(path, "rb") as f:
        return int(f.read().split()[0])


def _loadavg() -> tuple[tuple[float, float, float], int]:
    # "0.13 0.75 1.13 3/94 22991": the fourth field's total counts every task (thread) on the host
    with open("/proc/loadavg", "rb") as f:
        fields = f.read().split()
    return (float(fields[0]), float(fields[1]), float(fields[2])), int(fields[3].split(b"/")[1])


def _count_dirs(path: Path) -> int:
    try:
        with os.scandir(path) as it:
            return sum(1 for e in it if e.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        return 0


class Admission:
    """Reserves a create's resources while it runs; refuses with :class:`CapacityExceeded`.

    ``disk_path`` is the filesystem sandboxes write to (the data dir);
    ``boxes`` the directory holding one subdirectory per live sandbox.
    Thread-safe: the check and the reservation happen under one lock.
    """

    def __init__(self, config: AdmissionConfig, *, disk_path: str | os.PathLike[str],
                 boxes: str | os.PathLike[str]) -> None:
        self.config = config
        self.disk_path = Path(disk_path)
        self.boxes = Path(boxes)
        self._lock = threading.Lock()
        self._in_flight = 0
        self._memory = self._pids = self._disk = 0  # reserved by creates in flight
        self.cpus = len(os.sched_getaffinity(0))
        self.disk_path.mkdir(parents=True, exist_ok=True)

    # -- measuring ----------------------------------------------------------------------------------
    def probe(self) -> Probe:
        mem_total, mem_available = _meminfo()
        # a new task needs both a pid and a thread slot: the smaller limit binds
        task_limit = min(_read_int("/proc/sys/kernel/pid_max"), _read_int("/proc/sys/kernel/threads-max"))
        loadavg, tasks = _loadavg()
        st = os.statvfs(self.disk_path)
        return Probe(time=time.time(), mem_total=mem_total, mem_available=mem_available, task_limit=task_limit,
                     tasks=tasks, disk_total=st.f_blocks * st.f_frsize, disk_available=st.f_bavail * st.f_frsize,
                     live=_count_dirs(self.boxes), loadavg=loadavg, cpus=self.cpus)

    def _free(self, p: Probe) -> dict[str, int]:
        c = self.config
        return {"sandboxes": c.max_sandboxes - p.live - self._in_flight,
                "memory": p.mem_available - c.memory_reserve - self._memory,
                "pids": p.task_limit - p.tasks - c.pids_reserve - self._pids,
                "disk": p.disk_available - c.disk_reserve - self._disk}

    def _shortages(self, p: Probe, free: Mapping[str, int], d: Demand) -> list[tuple[str, str]]:
        c, out = self.config, []
        n = self._in_flight
        flight = f", {n} create{'s' if n != 1 else ''} in flight" if n else ""
        if free["sandboxes"] < 1:
            out.append(("sandboxes", f"needs 1 sandbox slot, {max(free['sandboxes'], 0)} of {c.max_sandboxes} "
                                     f"free ({p.live} live{flight})"))
        if free["memory"] < d.memory:
            held = f" and {human(self._memory)} held by creates in flight" if self._memory else ""
            out.append(("memory", f"needs {human(d.memory)} memory, {human(max(free['memory'], 0))} available "
                                  f"after the {human(c.memory_reserve)} host reserve{held}"))
        if free["pids"] < d.pids:
            out.append(("pids", f"needs {d.pids} pids, {max(free['pids'], 0)} available ({p.tasks} tasks of a "
                                f"{p.task_limit} limit, {c.pids_reserve} reserved for the host{flight})"))
        if free["disk"] < d.disk:
            held = f" and {human(self._disk)} held by creates in flight" if self._disk else ""
            out.append(("disk", f"needs {human(d.disk)} disk, {human(max(free['disk'], 0))} free after the "
                                f"{human(c.disk_reserve)} reserve{held}"))
        return out

    # -- admitting ----------------------------------------------------------------------------------
    @contextmanager
    def reserve(self, demand: Demand) -> Iterator[None]:
        """Admit ``demand`` and hold its resources until the block ends, or raise CapacityExceeded."""
        probe = self.probe()  # outside the lock: it only reads the kernel
        with self._lock:
            short = self._shortages(probe, self._free(probe), demand)
            if short:
                raise CapacityExceeded(
                    f"edge {self.config.edge_id!r} cannot admit this sandbox now: "
                    + "; ".join(msg for _, msg in short)
                    + f"; retry in {self.config.retry_after:g} s or on another edge",
                    resources=tuple(name for name, _ in short), retry_after=self.config.retry_after)
            self._in_flight += 1
            self._memory += demand.memory
            self._pids += demand.pids
            self._disk += demand.disk
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1
                self._memory -= demand.memory
                self._pids -= demand.pids
                self._disk -= demand.disk

    def report(self) -> dict[str, Any]:
        """The load report clients place by (JSON-ready); ``accepting`` means a default create would fit."""
        p = self.probe()
        c = self.config
        with self._lock:
            free = self._free(p)
            short = [name for name, _ in self._shortages(p, free, Demand())]
            in_flight, memory, pids, disk = self._in_flight, self._memory, self._pids, self._disk
        doc: dict[str, Any] = {
            "edge": c.edge_id, "time": p.time, "accepting": not short, "short": short,
            "sandboxes": {"live": p.live, "in_flight": in_flight, "max": c.max_sandboxes,
                          "free": max(free["sandboxes"], 0)},
            "memory": {"total": p.mem_total, "available": p.mem_available, "reserve": c.memory_reserve,
                       "in_flight": memory, "free": max(free["memory"], 0)},
            "pids": {"limit": p.task_limit, "tasks": p.tasks, "reserve": c.pids_reserve, "in_flight": pids,
                     "free": max(free["pids"], 0)},
            "disk": {"total": p.disk_total, "available": p.disk_available, "reserve": c.disk_reserve,
                     "in_flight": disk, "free": max(free["disk"], 0)},
            "load": {"avg1": p.loadavg[0], "avg5": p.loadavg[1], "avg15": p.loadavg[2], "cpus": p.cpus},
        }
        doc["score"] = score(doc)
        return doc

    def free(self) -> dict[str, int]:
        """Free capacity per resource right now (for metrics)."""
        p = self.probe()
        with self._lock:
            return self._free(p)


def score(report: Mapping[str, Any]) -> float:
    """Higher is better; ``-inf`` for an edge that says it is not accepting.

    Free memory and free sandbox slots weigh most (they are what runs out);
    CPU load per core breaks ties between otherwise equal edges, which on one
    machine share memory and load and so differ by sandbox count alone.
    """
    if not report.get("accepting"):
        return -math.inf
    mem, boxes, load = report["memory"], report["sandboxes"], report["load"]
    mem_frac = mem["free"] / mem["total"] if mem["total"] else 0.0
    slot_frac = boxes["free"] / boxes["max"] if boxes["max"] else 0.0
    busy = min(load["avg1"] / max(load["cpus"], 1), 2.0) / 2.0
    return round(0.4 * mem_frac + 0.4 * slot_frac + 0.2 * (1.0 - busy), 6)
