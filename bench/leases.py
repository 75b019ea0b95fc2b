"""Job leases: a renew and the reaper's sweep at 10 and at 10,000 jobs, against one table for all.

    .venv/bin/python bench/leases.py [--jobs 10,10000] [--renews 1000] [--json]

For each number of jobs, a fresh directory on the bench disk (``--tmpdir``, default /var/tmp)
gets that many leases, spread over projects of ``MAX_JOBS`` each, every one with a sandbox.
Then, in rounds that take turns between the directories (so a disk busier at one moment than
another weighs on each count alike):

* ``renew``: ``--renews`` renews of jobs picked at random (``Leases.renew``: one lease file
  under its project's lock, written temp + fsync + rename + fsync of the directory);
* ``sweep``: what the reaper does once a round when nothing changed (``Leases.all`` then
  ``Leases.sweep`` with every sandbox alive: each lease read once, nothing written);
* ``one table``, the peer: the layout before, every lease in one host-state table rewritten
  whole under one lock on every renew (the same ``HostTable`` helper, so the difference is
  the layout alone).

The table shows the median milliseconds per renew (and the 99th percentile) and the seconds of
one sweep, and the ratio of the largest count to the smallest: 1.0 is a cost that does not
grow with the number of jobs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: import the checkout, installed or not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import _f, _table, emit, log, workspace

from layerstore.hoststate import HostTable
from sandbox.core.leases import MAX_JOBS, Lease, Leases

SID = "lb-000000000001"


def job_name(n: int) -> str:
    return f"project-{n // MAX_JOBS}/job-{n}"


def timed(calls: int, call: Callable[[int], Any]) -> list[float]:
    """Milliseconds of each of ``calls`` calls."""
    out = []
    for i in range(calls):
        t = time.perf_counter()
        call(i)
        out.append((time.perf_counter() - t) * 1000)
    return out


class Setup:
    """``jobs`` leases in a directory of their own, and the same leases in one table."""

    def __init__(self, tmp: Path, jobs: int) -> None:
        self.jobs = jobs
        self.leases = Leases(tmp / "leases")
        for n in range(jobs):
            self.leases.join(job_name(n), SID, 300.0)
        self.table = HostTable(tmp / "leases.json", "layerbox.leases", 1, empty=lambda: {"leases": {}})
        with self.table.locked() as body:
            body["leases"] = {job_name(n): Lease(job_name(n), 300.0, time.time() + 300).to_json()
                              for n in range(jobs)}
        self.renew: list[float] = []
        self.peer: list[float] = []
        self.sweep: list[float] = []

    def round(self, renews: int) -> None:
        picks = [random.randrange(self.jobs) for _ in range(renews)]
        self.renew += timed(renews, lambda i: self.leases.renew(job_name(picks[i])))

        def one_table_renew(i: int) -> None:
            with self.table.locked() as body:
                body["leases"][job_name(picks[i])]["expires"] = time.time() + 300

        self.peer += timed(renews, one_table_renew)
        t = time.perf_counter()
        self.leases.sweep(self.leases.all(), time.time(), alive=lambda sid: True)
        self.sweep.append(time.perf_counter() - t)

    def result(self) -> dict[str, Any]:
        return {"jobs": self.jobs, "renews": len(self.renew), "renew_ms": statistics.median(self.renew),
                "renew_p99_ms": sorted(self.renew)[int(0.99 * (len(self.renew) - 1))],
                "sweep_s": statistics.median(self.sweep), "one_table_renew_ms": statistics.median(self.peer)}


def measure(base: Path, counts: list[int], renews: int, rounds: int) -> list[dict[str, Any]]:
    with workspace(base, "lb-leases-") as tmp:
        setups = []
        for jobs in counts:
            log(f"{jobs} jobs ...")
            (tmp / str(jobs)).mkdir()
            setups.append(Setup(tmp / str(jobs), jobs))
        for r in range(rounds):
            log(f"round {r + 1}/{rounds}")
            for setup in setups:
                setup.round(renews // rounds)
        return [s.result() for s in setups]


def render(doc: dict[str, Any]) -> str:
    rows = [[str(r["jobs"]), _f(r["renew_ms"]), _f(r["renew_p99_ms"]), _f(r["sweep_s"], 3),
             _f(r["one_table_renew_ms"])] for r in doc["results"]]
    first, last = doc["results"][0], doc["results"][-1]
    rows.append([f"{last['jobs']} / {first['jobs']}", _f(last["renew_ms"] / first["renew_ms"]), "", "",
                 _f(last["one_table_renew_ms"] / first["one_table_renew_ms"])])
    return _table(["jobs", "renew ms (median)", "p99", "sweep s", "one table: renew ms"], rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", default="10,10000", help="comma-separated numbers of jobs")
    p.add_argument("--renews", type=int, default=1000, help="renews per number of jobs")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--tmpdir", type=Path, default=Path("/var/tmp"))
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    results = measure(a.tmpdir, [int(n) for n in a.jobs.split(",")], a.renews, a.rounds)
    emit({"results": results}, a.json, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
