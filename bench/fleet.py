"""Benchmark: a burst of creates through the fleet's gateways against the same burst straight to the edges.

``layerbox fleet up`` on this machine: PostgreSQL, ``--gateways`` gateways and ``--edges`` edges
(separate processes, their own data dirs, one ``file://`` store holding the fixture's ``python``
image).  Then, in rounds (the order alternating), the same burst two ways:

* **fleet**: ``--creates`` creates, ``--concurrency`` at a time, through the gateways in turn,
  each followed by its first exec (``echo ready``) through the same gateway;
* **direct**: the same burst straight to the edges, round robin, each request signed as a
  gateway signs it (``sandbox.edge.trust.sign_request`` with the edge's key from the fleet's
  directory): the same processes, only the gateway taken out.

The sandboxes sit idle until the burst ends, then every one is destroyed (the same way it was
made) and the run waits ``--settle`` seconds.  Reported per burst: creates/s, create and
create -> first exec p50/p99, rejections by status and code, the sandboxes per edge (max/min),
the gateways' CPU seconds and database transactions (their ``db_transactions``) per create, and
PostgreSQL's own ``xact_commit`` per create (psql, over the whole lifecycle: creates, execs,
destroys, settle).  Background work (heartbeats, the registry refresh, housekeeping) runs in
both modes; an idle window measured first gives its rate, which is subtracted ("net").

Before the bursts, ``--latency`` creates one at a time per mode (what a gateway adds without
queueing).  After them, the database alone (``--hot-seconds``; 0 leaves it out):
``FleetDb.reserve`` + ``release`` in a loop from this process at several concurrencies on one
project (every reservation takes its row lock) against each worker on a project of its own, and
again with 10,000 and 100,000 live sandboxes in the hot project (``reserve`` counts them); the
routing table's bytes per row and one reconcile of a full report of 2,375 sandboxes; a
heartbeat's body size with 0 .. 2,375 sandboxes (a full report).

``fleet down`` runs at the end however the run ends.  ``python bench/fleet.py --help``;
bench/README.md explains every number and docs/SCALE.md extrapolates them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: import the checkout, installed or not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402
from common import BenchError, _f, _table, emit, log, ratio, summary, workspace  # noqa: E402
from sdk import IMAGE, find_fixture, publish_image  # noqa: E402  (the fixture's python image, published)

from lazyfetch import kmount  # noqa: E402
from sandbox.core.errors import ApiError  # noqa: E402
from sandbox.edge.link import FULL_EVERY  # noqa: E402
from sandbox.edge.trust import GATEWAY_HEADER, Caller, sign_request  # noqa: E402
from sandbox.fleet.db import FleetDb  # noqa: E402

SCHEMA = "layerbox.bench.fleet.v1"
REPO = Path(__file__).resolve().parents[1]
PROJECT = "demo"  # the project `fleet up` makes
TIMEOUT = 180.0  # one request; past it the create counts as failed
HOT_PROJECT = "hot"
HOT_CONCURRENCY = (1, 4, 16, 64)
HOT_LIVE = (10_000, 100_000)
REPORT_SIZES = (0, 25, 250, 2375)  # sandboxes in a full heartbeat: idle, this bench's peak, 10x, DSec's per host
CLK_TCK = os.sysconf("SC_CLK_TCK")
GOAL_MS = 10.0


def layerbox(*args: str, timeout: float = 600) -> Any:
    """``layerbox ARGS --json`` (the CLI as an operator's script runs it), its JSON."""
    done = subprocess.run([sys.executable, "-m", "tools.cli", *args, "--json"], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})
    if done.returncode != 0:
        raise BenchError(f"layerbox {' '.join(args[:4])}: exit {done.returncode}: {done.stderr[-3000:]}")
    return json.loads(done.stdout)


@dataclass
class Fleet:
    root: Path
    state: dict[str, Any]
    quota: int

    @property
    def gateways(self) -> list[str]:
        return [g["url"] for g in self.state["gateways"]]

    @property
    def edges(self) -> list[dict[str, Any]]:
        return list(self.state["edges"])

    def key(self, edge_id: str) -> bytes:
        return bytes.fromhex((self.root / f"{edge_id}.key").read_text())

    def token_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.state['project']['token']}"}

    def signed(self, edge_id: str, method: str, path: str) -> dict[str, str]:
        """What a gateway sends the edge for ``method path`` of the project (sandbox.edge.trust)."""
        caller = Caller(PROJECT, self.quota)
        return {GATEWAY_HEADER: sign_request(self.key(edge_id), method, path, caller, time.time())}


# -- counters ------------------------------------------------------------------------------------------


def cpu_seconds(pids: Sequence[int]) -> float:
    """utime + stime of ``pids`` (their threads included), from /proc/<pid>/stat."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5)
    return total / CLK_TCK


def postgres_pids(state: dict[str, Any]) -> list[int]:
    """The cluster's postmaster and its children (the gateways' connections among them)."""
    pg = state.get("postgres")
    if not pg:
        return []
    head = Path(pg["root"]) / "data" / "postmaster.pid"
    try:
        master = int(head.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return []
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == master:
                kids.append(int(stat.parent.name))
    return [master, *kids]


def pg_commits(db_url: str) -> int:
    """PostgreSQL's own count of committed transactions in the fleet's database (pg_stat_database)."""
    done = subprocess.run(["psql", db_url, "-At", "-c", "SELECT xact_commit FROM pg_stat_database "
                           "WHERE datname = current_database()"], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise BenchError(f"psql: {done.stderr.strip()[-500:]}")
    return int(done.stdout.strip())


async def gateway_health(session: aiohttp.ClientSession, fleet: Fleet) -> list[dict[str, Any]]:
    out = []
    for url in fleet.gateways:
        async with session.get(url + "/fleet/v1/health") as r:
            out.append(await r.json())
    return out


async def counters(session: aiohttp.ClientSession, fleet: Fleet, *, pg: bool = True) -> dict[str, Any]:
    """Every counter the figures are deltas of, read now."""
    health = await gateway_health(session, fleet)
    return {"t": time.perf_counter(),
            "gw_cpu": cpu_seconds([g["pid"] for g in fleet.state["gateways"]]),
            "edge_cpu": cpu_seconds([e["pid"] for e in fleet.edges]),
            "pg_cpu": cpu_seconds(postgres_pids(fleet.state)),
            "gw_tx": sum(h["db_transactions"] for h in health),
            "gw_creates": sum(h["creates"] for h in health),
            "placed_retries": sum(h["placed_retries"] for h in health),
            "pg_commits": await asyncio.to_thread(pg_commits, fleet.state["db"]) if pg else None}


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if after[k] is None or before[k] is None else after[k] - before[k]) for k in after}


# -- one burst -------------------------------------------------------------------------------------------


@dataclass
class Target:
    """Where request ``i`` of a burst goes: a gateway (the project's token) or an edge (signed)."""

    mode: str
    fleet: Fleet

    def url(self, i: int) -> str:
        if self.mode == "fleet":
            return self.fleet.gateways[i % len(self.fleet.gateways)]
        return str(self.fleet.edges[i % len(self.fleet.edges)]["url"])

    def headers(self, i: int, method: str, path: str) -> dict[str, str]:
        if self.mode == "fleet":
            return self.fleet.token_headers()
        return self.fleet.signed(self.fleet.edges[i % len(self.fleet.edges)]["id"], method, path)


def _code(status: int, text: str) -> str:
    try:
        doc = json.loads(text)
    except ValueError:
        return f"{status}"
    err = doc.get("error") if isinstance(doc, dict) else None
    code = err.get("code") if isinstance(err, dict) else None
    message = str(err.get("message", ""))[:60] if isinstance(err, dict) else ""
    return f"{status} {code}: {message}" if code else f"{status}"


async def one(session: aiohttp.ClientSession, target: Target, i: int, out: dict[str, Any]) -> None:
    """Create ``i`` and its first exec; its times, or its rejection."""
    url, path = target.url(i), "/v1/sandboxes"
    t0 = time.perf_counter()
    try:
        async with session.post(url + path, json={"image": IMAGE}, headers=target.headers(i, "POST", path)) as r:
            text = await r.text()
        if r.status != 201:
            out["rejections"][_code(r.status, text)] += 1
            return
        sid = json.loads(text)["id"]
        out["made"].append((i, sid))
        t1 = time.perf_counter()
        exec_path = f"{path}/{sid}/exec"
        async with session.post(url + exec_path, json={"cmd": "echo ready"},
                                headers=target.headers(i, "POST", exec_path)) as r:
            text = await r.text()
        events = [json.loads(line) for line in text.splitlines() if line.strip()] if r.status == 200 else []
        if not events or events[-1].get("type") != "exit" or events[-1].get("exit_code") != 0:
            out["rejections"][f"exec {_code(r.status, text)}"] += 1
            return
        t2 = time.perf_counter()
        out["create"].append(t1 - t0)
        out["first_exec"].append(t2 - t0)
    except (TimeoutError, aiohttp.ClientError, ValueError, KeyError) as exc:
        out["rejections"][f"client {type(exc).__name__}"] += 1


async def run_burst(session: aiohttp.ClientSession, target: Target, n: int, concurrency: int) -> dict[str, Any]:
    out: dict[str, Any] = {"create": [], "first_exec": [], "rejections": Counter(), "made": []}
    queue = iter(range(n))

    async def worker() -> None:
        for i in queue:
            await one(session, target, i, out)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    out["seconds"] = time.perf_counter() - t0
    return out


async def per_edge(session: aiohttp.ClientSession, fleet: Fleet) -> dict[str, int]:
    """Sandboxes of the project each edge runs, asked of the edges themselves (signed)."""
    out = {}
    for e in fleet.edges:
        async with session.get(e["url"] + "/v1/sandboxes", headers=fleet.signed(e["id"], "GET", "/v1/sandboxes")) as r:
            out[e["id"]] = len((await r.json())["sandboxes"]) if r.status == 200 else -1
    return out


async def destroy(session: aiohttp.ClientSession, target: Target, made: list[tuple[int, str]],
                  concurrency: int) -> dict[str, Any]:
    failed: Counter[str] = Counter()
    queue = iter(made)

    async def worker() -> None:
        for i, sid in queue:
            path = f"/v1/sandboxes/{sid}"
            try:
                async with session.delete(target.url(i) + path, headers=target.headers(i, "DELETE", path)) as r:
                    if r.status not in (204, 404):
                        failed[_code(r.status, await r.text())] += 1
            except (TimeoutError, aiohttp.ClientError) as exc:
                failed[type(exc).__name__] += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"seconds": time.perf_counter() - t0, "failed": dict(failed)}


async def burst_section(session: aiohttp.ClientSession, fleet: Fleet, mode: str, args: argparse.Namespace,
                        idle: dict[str, float]) -> dict[str, Any]:
    target = Target(mode, fleet)
    log(f"{mode}: {args.creates} creates + first exec, {args.concurrency} at a time")
    start = await counters(session, fleet)
    raw = await run_burst(session, target, args.creates, args.concurrency)
    end_burst = await counters(session, fleet, pg=False)
    spread = await per_edge(session, fleet)
    gone = await destroy(session, target, raw["made"], args.concurrency)
    await asyncio.sleep(args.settle)
    left = await per_edge(session, fleet)
    end = await counters(session, fleet)
    made = len(raw["first_exec"])
    burst, life = delta(end_burst, start), delta(end, start)
    return {
        "mode": mode, "creates": args.creates, "made": made, "seconds": raw["seconds"],
        "creates_per_s": made / raw["seconds"] if raw["seconds"] > 0 else None,
        "create": summary(raw["create"]), "first_exec": summary(raw["first_exec"]),
        "rejections": dict(raw["rejections"]), "per_edge": spread,
        "spread_max": max(spread.values()), "spread_min": min(spread.values()),
        "left_after_destroy": sum(v for v in left.values() if v > 0), "destroy": gone,
        "burst": burst, "lifecycle": life,
        "per_create": per_create(burst, life, idle, made),
        "create_runs": raw["create"], "first_exec_runs": raw["first_exec"]}


def per_create(burst: dict[str, Any], life: dict[str, Any], idle: dict[str, float], made: int) -> dict[str, Any]:
    """The burst's costs per create: raw, and net of the idle rate over the same seconds."""
    if not made:
        return {}

    def net(d: dict[str, Any], key: str) -> float | None:
        if d[key] is None:
            return None
        return (d[key] - idle[key] * d["t"]) / made

    return {"gw_cpu_ms": 1000 * burst["gw_cpu"] / made, "gw_cpu_ms_net": 1000 * (net(burst, "gw_cpu") or 0),
            "edge_cpu_ms": 1000 * burst["edge_cpu"] / made, "pg_cpu_ms_net": 1000 * (net(burst, "pg_cpu") or 0),
            "gw_tx": burst["gw_tx"] / made, "gw_tx_net": net(burst, "gw_tx"),
            "gw_tx_lifecycle_net": net(life, "gw_tx"), "pg_commits_lifecycle": life["pg_commits"] / made,
            "pg_commits_lifecycle_net": net(life, "pg_commits"),
            "pg_cpu_ms_lifecycle_net": 1000 * (net(life, "pg_cpu") or 0),
            "gw_cpu_ms_lifecycle_net": 1000 * (net(life, "gw_cpu") or 0)}


async def latency_section(session: aiohttp.ClientSession, fleet: Fleet, n: int) -> dict[str, Any]:
    """``n`` creates + first exec one at a time per mode, the modes alternating, each destroyed before
    the next: what the gateway adds to one create, without queueing behind the others."""
    log(f"latency: {n} creates + first exec one at a time, fleet and direct alternating")
    runs: dict[str, dict[str, Any]] = {}
    for i in range(2 * n):
        mode = ("fleet", "direct")[(i + i // 2) % 2]  # fleet, direct, direct, fleet, ...
        out = runs.setdefault(mode, {"create": [], "first_exec": [], "rejections": Counter(), "made": []})
        target, made = Target(mode, fleet), len(out["made"])
        await one(session, target, i, out)
        await destroy(session, target, out["made"][made:], 1)
    return {mode: {"create": summary(r["create"]), "first_exec": summary(r["first_exec"]),
                   "rejections": dict(r["rejections"]), "create_runs": r["create"], "first_exec_runs": r["first_exec"]}
            for mode, r in runs.items()}


async def idle_rates(session: aiohttp.ClientSession, fleet: Fleet, seconds: float) -> dict[str, float]:
    """Counters per second with nothing but the background running (heartbeats, refresh, housekeeping)."""
    log(f"idle: {seconds:g} s of background only")
    a = await counters(session, fleet)
    await asyncio.sleep(seconds)
    b = await counters(session, fleet)
    d = delta(b, a)
    return {k: (v / d["t"] if v is not None else 0.0) for k, v in d.items() if k != "t"} | {"t": 0.0}


async def warm(session: aiohttp.ClientSession, fleet: Fleet) -> None:
    """One unmeasured create + exec + destroy per edge (each edge's first mounts the image's layers)."""
    target = Target("direct", fleet)
    out: dict[str, Any] = {"create": [], "first_exec": [], "rejections": Counter(), "made": []}
    await asyncio.gather(*(one(session, target, i, out) for i in range(len(fleet.edges))))
    await destroy(session, target, out["made"], len(fleet.edges))
    if out["rejections"]:
        raise BenchError(f"warm-up creates failed: {dict(out['rejections'])}")


# -- the database alone ------------------------------------------------------------------------------------


async def reserve_rate(db: FleetDb, projects: Sequence[str], workers: int, seconds: float) -> float:
    """reserve + release pairs per second, ``workers`` at once, worker ``w`` on ``projects[w % len]``."""
    done = 0
    stop = time.perf_counter() + seconds
    refused: Counter[str] = Counter()

    async def worker(w: int) -> None:
        nonlocal done
        project = projects[w % len(projects)]
        while time.perf_counter() < stop:
            try:
                await db.release(await db.reserve(project, 1))
            except ApiError as exc:  # counted as a failure of the figure, not of the run
                refused[exc.code] += 1
                continue
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(workers)))
    if refused:
        raise BenchError(f"reservations were refused: {dict(refused)}")
    return done / (time.perf_counter() - t0)


async def hot_section(db_url: str, seconds: float) -> dict[str, Any]:
    log(f"database: reserve + release, {seconds:g} s per figure")
    db = await FleetDb.open(db_url, max_size=max(HOT_CONCURRENCY))
    names = [f"{HOT_PROJECT}-{i}" for i in range(max(HOT_CONCURRENCY))]
    out: dict[str, Any] = {"one_project": {}, "own_project": {}, "live": {}}
    try:
        for name in names:
            await db.add_project(name, max_sandboxes=10_000_000, creates_per_second=1e9)
        for c in HOT_CONCURRENCY:
            out["one_project"][c] = await reserve_rate(db, names[:1], c, seconds)
            out["own_project"][c] = await reserve_rate(db, names[:c], c, seconds)
        inserted = 0
        for live in HOT_LIVE:
            await db.pool.execute(
                "INSERT INTO sandboxes (id, project, edge, state) SELECT 'lb-' || lpad(to_hex(g), 12, '0'), $1, "
                "'bench-edge-' || (g % 160), 'placed' FROM generate_series($2::int, $3::int - 1) AS g",
                names[0], inserted, live)
            inserted = live
            await db.pool.execute("ANALYZE sandboxes")
            out["live"][live] = {c: await reserve_rate(db, names[:1], c, seconds) for c in (1, 16)}
        out["reconcile_ms"] = await reconcile_ms(db, names[0])
        size = await db.pool.fetchval("SELECT pg_total_relation_size('sandboxes')")
        out["routing_bytes_per_row"] = size / inserted
        await db.pool.execute("DELETE FROM sandboxes WHERE project = $1", names[0])
    finally:
        await db.close()
    return out


async def reconcile_ms(db: FleetDb, project: str, per_edge: int = 2375, rounds: int = 5) -> float:
    """ms per reconcile of a full report of ``per_edge`` sandboxes that all are in the table already
    (the common case: nothing changed), against the table the section filled."""
    rows = await db.pool.fetch("UPDATE sandboxes SET edge = 'bench-edge-full' WHERE id IN (SELECT id FROM sandboxes "
                               "WHERE project = $1 LIMIT $2) RETURNING id", project, per_edge)
    pairs = [(r["id"], project) for r in rows]
    t0 = time.perf_counter()
    for _ in range(rounds):
        await db.reconcile("bench-edge-full", pairs, grace=10.0)
    return 1000 * (time.perf_counter() - t0) / rounds


def report_sizes(edge_row: dict[str, Any]) -> dict[int, dict[str, int]]:
    """A heartbeat's body as sandbox.edge.link builds it (this run's edge's own load, capabilities and
    images), with n sandboxes in its full report: bytes of a full beat and of the others."""
    base = {"edge": edge_row["id"], "pool": edge_row["pool"], "url": edge_row["url"], "boot": "0" * 16,
            "capabilities": edge_row["capabilities"], "load": edge_row["load"],
            "images": edge_row["images"].get("refs", []), "layers": edge_row["images"].get("layers", [])}
    light = len(json.dumps({**base, "sandboxes": None}).encode())
    return {n: {"full": len(json.dumps({**base, "sandboxes": [[f"lb-{i:012x}", "some-project"]
                                                               for i in range(n)]}).encode()),
                "light": light} for n in REPORT_SIZES}


# -- the run ------------------------------------------------------------------------------------------------


def fleet_up(args: argparse.Namespace, work: Path, store_url: str) -> Fleet:
    quota = args.creates * 4  # direct creates also enter the routing table (the edges' reports) until reconciled
    log(f"fleet up: {args.gateways} gateways, {args.edges} edges, PostgreSQL (in {work / 'fleet'})")
    state = layerbox("fleet", "--dir", str(work / "fleet"), "up", "--store", store_url, "--pools",
                     f"onprem={args.edges}", "--gateways", str(args.gateways), "--max-sandboxes", str(quota))
    fleet = Fleet(work / "fleet", state, quota)
    # the bench measures the fleet, not the project's rate limit (50/s by default)
    layerbox("fleet", "--dir", str(fleet.root), "project", "quota", PROJECT, "--creates-per-second", "1000000")
    return fleet


async def bench(args: argparse.Namespace, work: Path, fixture: Path) -> dict[str, Any]:
    store_url = f"file://{work / 'store'}"
    log(f"publish oci-archive:{fixture}:python -> {IMAGE}")
    published = await publish_image(store_url, work, fixture)
    fleet: Fleet | None = None
    try:
        fleet = await asyncio.to_thread(fleet_up, args, work, store_url)
        return {"publish_seconds": published, **await measure(args, fleet)}
    finally:
        if (work / "fleet" / "fleet.json").exists():
            log("fleet down")
            await asyncio.to_thread(layerbox, "fleet", "--dir", str(work / "fleet"), "down")


async def measure(args: argparse.Namespace, fleet: Fleet) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=TIMEOUT)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await warm(session, fleet)
        await asyncio.sleep(args.settle)
        idle = await idle_rates(session, fleet, args.idle_seconds)
        latency = await latency_section(session, fleet, args.latency) if args.latency else {}
        await asyncio.sleep(args.settle)
        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            order = ("fleet", "direct") if r % 2 == 0 else ("direct", "fleet")
            for mode in order:
                rounds.append(await burst_section(session, fleet, mode, args, idle))
    edges = layerbox("fleet", "--dir", str(fleet.root), "edges")
    out: dict[str, Any] = {"idle": idle, "latency": latency, "rounds": rounds, "compare": compare(rounds, latency),
                           "heartbeat_bytes": report_sizes(edges[0]), "full_every": FULL_EVERY}
    if args.hot_seconds > 0:
        out["database"] = await hot_section(fleet.state["db"], args.hot_seconds)
    return out


def compare(rounds: list[dict[str, Any]], latency: dict[str, Any]) -> dict[str, Any]:
    """fleet / direct over every round's runs pooled, and over the one-at-a-time creates."""
    def pooled(mode: str, what: str) -> dict[str, Any]:
        return summary([v for r in rounds if r["mode"] == mode for v in r[f"{what}_runs"]])

    def rate(mode: str) -> float | None:
        made = sum(r["made"] for r in rounds if r["mode"] == mode)
        secs = sum(r["seconds"] for r in rounds if r["mode"] == mode)
        return made / secs if secs else None

    out: dict[str, Any] = {"creates_per_s": {m: rate(m) for m in ("fleet", "direct")}}
    out["creates_per_s"]["ratio"] = ratio(out["creates_per_s"]["fleet"], out["creates_per_s"]["direct"])
    for what in ("create", "first_exec"):
        f, d = pooled("fleet", what), pooled("direct", what)
        out[what] = {"fleet": f, "direct": d, "p50_ratio": ratio(f["p50"], d["p50"]),
                     "p99_ratio": ratio(f["p99"], d["p99"]),
                     "p50_added_ms": added(f, d)}
    if latency:
        out["one_at_a_time"] = {what: {"p50_added_ms": added(latency["fleet"][what], latency["direct"][what]),
                                       "p50_ratio": ratio(latency["fleet"][what]["p50"], latency["direct"][what]["p50"])}
                                for what in ("create", "first_exec")}
    return out


def added(f: dict[str, Any], d: dict[str, Any]) -> float | None:
    return None if f["p50"] is None or d["p50"] is None else 1000 * (f["p50"] - d["p50"])


# -- output -------------------------------------------------------------------------------------------------


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def render(doc: dict[str, Any]) -> str:
    env, s = doc["environment"], doc["settings"]
    lines = [f"layerbox fleet benchmark: {s['gateways']} gateways, {s['edges']} edges, PostgreSQL, on "
             f"{env['cpus']} CPUs; {s['creates']} creates, {s['concurrency']} at a time, {s['rounds']} round(s); "
             f"load {env['loadavg_start']} -> {env['loadavg_end']}; wall {env['wall_seconds']} s", ""]
    rows = []
    for r in doc["rounds"]:
        pc = r["per_create"]
        rows.append([r["mode"], f"{r['made']}/{r['creates']}", _f(r["creates_per_s"], 1), _ms(r["create"]["p50"]),
                     _ms(r["create"]["p99"]), _ms(r["first_exec"]["p50"]), _ms(r["first_exec"]["p99"]),
                     f"{r['spread_max']}/{r['spread_min']}", _f(pc.get("gw_cpu_ms_net"), 2),
                     _f(pc.get("gw_tx_net"), 2), _f(pc.get("pg_commits_lifecycle_net"), 2),
                     str(sum(r["rejections"].values()))])
    lines.append(_table(["mode", "made", "creates/s", "create p50", "p99", "->exec p50", "p99", "max/min",
                         "gw CPU ms", "gw tx", "pg commits", "rejected"], rows))
    lines.append("  (ms; max/min: sandboxes per edge at the burst's end; gw CPU ms, gw tx: per create net of the "
                 "idle rate, burst only; pg commits: per create, lifecycle incl. destroys, net)")
    for r in doc["rounds"]:
        if r["rejections"]:
            lines.append(f"  {r['mode']} rejections: {r['rejections']}")
    c = doc["compare"]
    lines += ["", f"fleet/direct: creates/s {_f(c['creates_per_s']['ratio'])}x; create p50 "
              f"{_f(c['create']['p50_ratio'])}x ({_f(c['create']['p50_added_ms'], 1)} ms added), p99 "
              f"{_f(c['create']['p99_ratio'])}x; create->first exec p50 {_f(c['first_exec']['p50_ratio'])}x "
              f"({_f(c['first_exec']['p50_added_ms'], 1)} ms added), p99 {_f(c['first_exec']['p99_ratio'])}x "
              f"(goal: at most {GOAL_MS:g} ms added at p50, creates/s ratio at least 1)"]
    lat = doc.get("latency")
    if lat:
        lines.append(f"one at a time ({lat['fleet']['create']['n']} each): " + "; ".join(
            f"{mode} create p50 {_ms(lat[mode]['create']['p50'])} p99 {_ms(lat[mode]['create']['p99'])}, ->exec p50 "
            f"{_ms(lat[mode]['first_exec']['p50'])} p99 {_ms(lat[mode]['first_exec']['p99'])}" for mode in ("fleet", "direct"))
            + f"; added at p50: create {_f(c['one_at_a_time']['create']['p50_added_ms'], 1)} ms, ->exec "
            f"{_f(c['one_at_a_time']['first_exec']['p50_added_ms'], 1)} ms")
    i = doc["idle"]
    lines.append(f"idle (background): gateways {i['gw_cpu'] * 1000:.1f} ms CPU/s, {i['gw_tx']:.1f} db tx/s; "
                 f"PostgreSQL {i['pg_cpu'] * 1000:.1f} ms CPU/s, {i['pg_commits']:.1f} commits/s")
    hb = doc["heartbeat_bytes"]
    lines.append("heartbeat body bytes (light / full with n sandboxes): " + ", ".join(
        f"n={n}: {v['light']}/{v['full']}" for n, v in hb.items()) + f"; a full one every {doc['full_every']} beats")
    db = doc.get("database")
    if db:
        lines.append("reserve+release per s, one project / each worker its own: " + ", ".join(
            f"{c} workers {db['one_project'][c]:.0f}/{db['own_project'][c]:.0f}" for c in db["one_project"]))
        lines.append("  one project with live sandboxes: " + ", ".join(
            f"{n} live: " + "/".join(f"{v:.0f}" for v in by.values()) + " (1/16 workers)"
            for n, by in db["live"].items()) + f"; routing table {db['routing_bytes_per_row']:.0f} bytes per row; reconcile of a full report "
            f"of 2375 sandboxes {db['reconcile_ms']:.1f} ms")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/fleet.py", description=__doc__.split("\n")[0])
    p.add_argument("--creates", type=int, default=200, help="creates per burst (default %(default)s)")
    p.add_argument("--concurrency", type=int, default=16, help="creates at once (default %(default)s)")
    p.add_argument("--rounds", type=int, default=1, help="rounds of fleet + direct bursts, the order alternating "
                   "(default %(default)s)")
    p.add_argument("--latency", type=int, default=30, help="creates one at a time per mode before the bursts; 0 "
                   "leaves them out (default %(default)s)")
    p.add_argument("--gateways", type=int, default=2)
    p.add_argument("--edges", type=int, default=8)
    p.add_argument("--settle", type=float, default=12.0, metavar="SECONDS",
                   help="wait after each burst's destroys: the edges' full reports reconcile the routing table and "
                        "PostgreSQL's statistics reach pg_stat_database (default %(default)s)")
    p.add_argument("--idle-seconds", type=float, default=15.0, help="the idle window measuring the background "
                   "(default %(default)s)")
    p.add_argument("--hot-seconds", type=float, default=3.0, help="seconds per database figure; 0 leaves the "
                   "database section out (default %(default)s)")
    p.add_argument("--fixture", default=None, metavar="PATH", help="the oci-archive with tag python "
                   "(default ../shared/fixtures/debian-bookworm.oci.tar)")
    p.add_argument("--tmpdir", type=Path, default=Path("/var/tmp"), metavar="DIR")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.creates, args.concurrency, args.rounds, args.gateways, args.edges) < 1 or args.settle < 0 \
            or args.idle_seconds <= 0 or args.hot_seconds < 0 or args.latency < 0:
        print("bench/fleet.py: counts must be at least 1, --idle-seconds positive", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("bench/fleet.py: needs root (the edges mount and run containers; PostgreSQL runs as postgres)",
              file=sys.stderr)
        return 1
    started, load_start = time.time(), _loadavg()
    left: list[str] = []
    try:
        fixture = find_fixture(args.fixture)
        with workspace(args.tmpdir, "lb-fleet-", before_removal=lambda w: left.extend(kmount.mounts_under(w))) as work:
            results = asyncio.run(bench(args, work, fixture))
    except BenchError as exc:
        log(f"bench/fleet.py: {exc}")
        return 1
    except KeyboardInterrupt:
        log("bench/fleet.py: interrupted; the fleet was stopped and its directory removed")
        return 130
    if left:
        log(f"bench/fleet.py: mounts were left under the workdir: {left}")
        return 1
    doc = {"schema": SCHEMA, "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "environment": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
                           "loadavg_start": load_start, "loadavg_end": _loadavg(),
                           "wall_seconds": round(time.time() - started, 1),
                           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))},
           **results}
    emit(doc, args.json, render)
    return 0


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


if __name__ == "__main__":
    sys.exit(main())
