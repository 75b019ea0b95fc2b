"""The fairness section of bench/sandbox.py: one project hostile, another working, on one edge.

The edge runs as documented (``python -m sandbox.edge``, a subprocess with its own data dir on
the bench's store) from ``repo``: this checkout, or another one (``--edge-repo``) to measure a
former version against the same load.  Project beta runs rounds of create -> first exec of
``true`` -> list -> destroy, first on the quiet edge, then while project alpha does what
issue 24 found to hurt (all at once, for the whole hostile phase):

* streaming execs of ``sleep 30``, more than its caps allow, re-opened as they end or are refused;
* FnCalls of ``sleep 600`` it abandons after 3 s, again and again;
* JSON bodies built to be slow to walk (3.9 MB of ``{}``) and one of 64 MiB, in a loop;
* port-proxy WebSockets to a server in its sandbox that floods them (bench/ws_flooder.py),
  opened by clients that never read.

Reported: beta's create -> first exit and list, p50/p99, quiet and hostile (and their ratio),
beta's failures, the edge's RSS quiet and at its peak, and what alpha's attacks were answered.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from common import BenchError, log, ratio, summary

HERE = Path(__file__).resolve().parent
FLOODER = (HERE / "ws_flooder.py").read_text()
FLOOD_PORT = 8090
READY_TIMEOUT = 60.0
B_TIMEOUT = 120.0  # one of beta's requests; past it the round fails (a frozen edge answers nothing)
HOSTILE_WARMUP = 10.0  # seconds of alpha alone before beta's rounds
EXECS = 24  # alpha's concurrent exec streams: above its command cap, and above a 6-thread executor
CALLERS = 6  # alpha's workers abandoning FnCalls
SOCKETS = 40  # alpha's flooded WebSockets: above its connection cap
NESTED = b'{"x":[' + b"{}," * 1_300_000 + b"{}]}"  # 3.9 MB: under a 4 MiB bound, 1.3M elements
HUGE = b"[" + b"0," * (32 << 20) + b"0]"  # 64 MiB


@dataclass
class Edge:
    proc: subprocess.Popen[bytes]
    url: str
    data_dir: Path
    log: Path
    repo: Path
    store_url: str
    tokens: dict[str, str]


@dataclass
class Tally:
    """What alpha's attacks were answered: status (or exception name) per attack."""

    answers: dict[str, Counter[str]] = field(default_factory=dict)

    def add(self, attack: str, answer: str) -> None:
        self.answers.setdefault(attack, Counter())[answer] += 1


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss(pid: int, field_name: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) * 1024
    return 0


# the projects of the fairness edge: alpha attacks, beta measures
FAIR_PROJECTS: dict[str, dict[str, Any]] = {"alpha": {"max_sandboxes": 16}, "beta": {"max_sandboxes": 8}}


def spawn_edge(repo: Path, work: Path, store_url: str, *, name: str = "fair",
               projects: dict[str, dict[str, Any]] = FAIR_PROJECTS) -> Edge:
    """``python -m sandbox.edge`` from ``repo``'s checkout as an operator runs it, with ``projects``
    (name -> tokens-file settings; each gets a fresh token, ``edge.tokens[name]``)."""
    tokens = {p: f"{p}-" + secrets.token_hex(12) for p in projects}
    doc = {"projects": {p: {"tokens": [tokens[p]], **spec} for p, spec in projects.items()}}
    tokens_file = work / f"{name}-tokens.json"
    tokens_file.write_text(json.dumps(doc))
    data_dir, log_path, port = work / f"{name}-edge", work / f"{name}-edge.log", _port()
    env = {**os.environ, "PYTHONPATH": str(repo), "PYTHONUNBUFFERED": "1"}
    with open(log_path, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sandbox.edge", "--data-dir", str(data_dir), "--store",
                                 store_url, "--port", str(port), "--tokens", str(tokens_file), "--edge-id", name],
                                cwd=repo, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return Edge(proc, f"http://127.0.0.1:{port}", data_dir, log_path, repo, store_url, tokens)


async def start_edge(repo: Path, work: Path, store_url: str, *, name: str = "fair",
                     projects: dict[str, dict[str, Any]] = FAIR_PROJECTS) -> Edge:
    """:func:`spawn_edge`, once it answers its own API (stopped and cleaned if it never does)."""
    edge = spawn_edge(repo, work, store_url, name=name, projects=projects)
    proc, log_path = edge.proc, edge.log
    deadline = time.monotonic() + READY_TIMEOUT
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                problems = stop_edge(edge)
                raise BenchError(f"{name}: the edge exited with {proc.returncode}; see {log_path} {problems}")
            with contextlib.suppress(OSError, aiohttp.ClientError):
                async with s.get(edge.url + "/v1/load", headers=_auth(edge, next(iter(projects)))) as r:
                    if r.status == 200:
                        return edge
            await asyncio.sleep(0.1)
    problems = stop_edge(edge)
    raise BenchError(f"{name}: the edge was not ready after {READY_TIMEOUT:.0f} s; see {log_path} {problems}")


CLEAN = """
import sys
from sandbox.host.manager import SandboxManager
m = SandboxManager(sys.argv[1], sys.argv[2])
m.reconcile()
for st in m.list():
    m.destroy(st.id)
left = [st.id for st in m.list()]
m.close()
print(len(left))
"""


def stop_edge(edge: Edge) -> list[str]:
    """SIGTERM (then SIGKILL), and destroy what it left with the same code it ran; problems, or []."""
    problems = []
    if edge.proc.poll() is None:
        edge.proc.send_signal(signal.SIGTERM)
        try:
            edge.proc.wait(60)
        except subprocess.TimeoutExpired:
            problems.append("the edge ignored SIGTERM for 60 s: killed")
            edge.proc.kill()
            edge.proc.wait(10)
    done = subprocess.run([sys.executable, "-c", CLEAN, str(edge.data_dir), edge.store_url], cwd=edge.repo,
                          env={**os.environ, "PYTHONPATH": str(edge.repo)}, capture_output=True, text=True,
                          timeout=600, check=False)
    if done.returncode != 0 or done.stdout.strip() != "0":
        problems.append(f"cleaning the edge's data dir failed: {done.stdout[-500:]} {done.stderr[-2000:]}")
    return problems


def _auth(edge: Edge, project: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {edge.tokens[project]}"}


async def _json(s: aiohttp.ClientSession, method: str, url: str, headers: dict[str, str],
                body: Any = None) -> tuple[int, Any]:
    async with s.request(method, url, json=body, headers=headers) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text) if text else None
        except ValueError:
            return r.status, text


# -- beta: the tenant that only works ------------------------------------------------------------------


async def beta_rounds(edge: Edge, ref: str, n: int, deadline: float) -> dict[str, Any]:
    """``n`` rounds (fewer if ``deadline`` passes): seconds create -> first exit, and list; failures."""
    first, listed, failures = [], [], Counter[str]()
    head = _auth(edge, "beta")
    timeout = aiohttp.ClientTimeout(total=B_TIMEOUT)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        for _ in range(n):
            if time.monotonic() > deadline:
                failures["phase over"] += 1
                break
            sid = None
            try:
                t0 = time.perf_counter()
                status, doc = await _json(s, "POST", edge.url + "/v1/sandboxes", head, {"image": ref})
                if status != 201:
                    failures[f"create {status}"] += 1
                    continue
                sid = doc["id"]
                async with s.post(f"{edge.url}/v1/sandboxes/{sid}/exec", json={"cmd": "true"}, headers=head) as r:
                    events = [json.loads(line) for line in (await r.text()).splitlines() if line.strip()]
                if r.status != 200 or not events or events[-1].get("type") != "exit":
                    failures[f"exec {r.status}"] += 1
                    continue
                first.append(time.perf_counter() - t0)
                t1 = time.perf_counter()
                status, _ = await _json(s, "GET", edge.url + "/v1/sandboxes", head)
                if status != 200:
                    failures[f"list {status}"] += 1
                    continue
                listed.append(time.perf_counter() - t1)
            except (TimeoutError, aiohttp.ClientError) as exc:
                failures[type(exc).__name__] += 1
            finally:
                if sid is not None:
                    with contextlib.suppress(TimeoutError, aiohttp.ClientError):
                        await _json(s, "DELETE", f"{edge.url}/v1/sandboxes/{sid}", head)
    return {"first_exit": summary(first), "list": summary(listed), "failures": dict(failures),
            "first_exit_runs": first, "list_runs": listed}


# -- alpha: the tenant that attacks ----------------------------------------------------------------------


async def _forever(attack: Callable[[], Awaitable[None]], pause: float) -> None:
    while True:
        await attack()
        await asyncio.sleep(pause)


async def _held_exec(s: aiohttp.ClientSession, edge: Edge, sid: str, tally: Tally) -> None:
    try:
        async with s.post(f"{edge.url}/v1/sandboxes/{sid}/exec", json={"cmd": "sleep 30"},
                          headers=_auth(edge, "alpha")) as r:
            tally.add("exec sleep 30", str(r.status))
            await r.read()  # the stream lasts as long as the command
    except (TimeoutError, aiohttp.ClientError) as exc:
        tally.add("exec sleep 30", type(exc).__name__)


async def _abandoned_call(s: aiohttp.ClientSession, edge: Edge, ref: str, tally: Tally) -> None:
    try:
        async with s.post(edge.url + "/v1/calls", json={"image": ref, "cmd": "sleep 600", "timeout": 600},
                          headers=_auth(edge, "alpha"), timeout=aiohttp.ClientTimeout(total=3)) as r:
            tally.add("abandoned FnCall", str(r.status))
            await r.read()
    except TimeoutError:
        tally.add("abandoned FnCall", "left after 3 s")
    except aiohttp.ClientError as exc:
        tally.add("abandoned FnCall", type(exc).__name__)


async def _bodies(s: aiohttp.ClientSession, edge: Edge, tally: Tally) -> None:
    head = {**_auth(edge, "alpha"), "Content-Type": "application/json"}
    for name, body in (("3.9 MB nested body", NESTED), ("64 MiB body", HUGE)):
        t0 = time.perf_counter()
        try:
            async with s.post(edge.url + "/v1/sandboxes", data=body, headers=head) as r:
                await r.read()
                tally.add(name, str(r.status))
        except (TimeoutError, aiohttp.ClientError) as exc:
            tally.add(name, type(exc).__name__)
        tally.add(name + " seconds", f"{time.perf_counter() - t0:.0f}")


async def _unread_socket(edge: Edge, sid: str, tally: Tally, held: list[asyncio.StreamWriter]) -> None:
    """A WebSocket upgrade through the port proxy whose client never reads a byte after the answer."""
    host, port = edge.url.removeprefix("http://").split(":")
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write((f"GET /v1/sandboxes/{sid}/ports/{FLOOD_PORT}/proxy/ HTTP/1.1\r\nHost: {host}\r\n"
                      f"Authorization: Bearer {edge.tokens['alpha']}\r\nUpgrade: websocket\r\n"
                      f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
                      ).encode())
        status = (await asyncio.wait_for(reader.readline(), 60)).split(b" ")[1].decode()
        tally.add("flooded WebSocket, never read", status)
        held.append(writer)  # kept open, never read: the kernel's buffers fill, then the edge's
    except (OSError, TimeoutError, IndexError) as exc:
        tally.add("flooded WebSocket, never read", type(exc).__name__)


async def _alpha_sandboxes(s: aiohttp.ClientSession, edge: Edge, ref: str) -> list[str]:
    head = _auth(edge, "alpha")
    sids = []
    for _ in range(3):
        status, doc = await _json(s, "POST", edge.url + "/v1/sandboxes", head, {"image": ref})
        if status != 201:
            raise BenchError(f"fairness: alpha's create answered {status}: {doc}")
        sids.append(doc["id"])
    status, doc = await _json(s, "POST", f"{edge.url}/v1/sandboxes/{sids[2]}/commands", head,
                              {"cmd": ["python3", "-c", FLOODER, str(FLOOD_PORT), "/tmp/flood.ready"]})
    if status not in (200, 201):
        raise BenchError(f"fairness: the flooding server did not start: {status} {doc}")
    deadline = time.monotonic() + READY_TIMEOUT
    while (await _json(s, "GET", f"{edge.url}/v1/sandboxes/{sids[2]}/files?path=/tmp/flood.ready&stat=1",
                       head))[0] != 200:
        if time.monotonic() > deadline:
            raise BenchError("fairness: the flooding server never listened")
        await asyncio.sleep(0.2)
    return sids


async def alpha_attacks(edge: Edge, ref: str, sids: list[str], tally: Tally,
                        held: list[asyncio.StreamWriter]) -> list[asyncio.Task[None]]:
    """Every attack as a task of its own, running until cancelled."""
    s = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
    tasks = [asyncio.ensure_future(_unread_socket(edge, sids[2], tally, held)) for _ in range(SOCKETS)]
    tasks += [asyncio.ensure_future(_forever(lambda i=i: _held_exec(s, edge, sids[i % 2], tally), 1.0))
              for i in range(EXECS)]
    tasks += [asyncio.ensure_future(_forever(lambda: _abandoned_call(s, edge, ref, tally), 7.0))
              for _ in range(CALLERS)]
    tasks.append(asyncio.ensure_future(_forever(lambda: _bodies(s, edge, tally), 1.0)))

    async def close_session() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await s.close()
    tasks.append(asyncio.ensure_future(close_session()))
    return tasks


# -- the section ---------------------------------------------------------------------------------------------


async def _sample_rss(pid: int, peak: list[int]) -> None:
    while True:
        with contextlib.suppress(OSError):
            peak[0] = max(peak[0], rss(pid))
        await asyncio.sleep(0.2)


async def fairness_section(repo: Path, work: Path, store_url: str, ref: str, rounds: int,
                           phase_seconds: float) -> dict[str, Any]:
    log(f"fairness: the edge from {repo} as a subprocess, beta {rounds} rounds quiet and with alpha hostile")
    edge = await start_edge(repo, work, store_url)
    out: dict[str, Any] = {"repo": str(repo), "commit": _commit(repo), "rounds": rounds}
    tally, held, tasks = Tally(), [], []
    sampler: asyncio.Task[None] | None = None
    try:
        await beta_rounds(edge, ref, 2, time.monotonic() + phase_seconds)  # unmeasured: the first start warms up
        out["quiet"] = await beta_rounds(edge, ref, rounds, time.monotonic() + phase_seconds)
        out["rss_quiet"] = rss(edge.proc.pid)
        peak = [out["rss_quiet"]]
        sampler = asyncio.ensure_future(_sample_rss(edge.proc.pid, peak))
        async with aiohttp.ClientSession() as s:
            sids = await _alpha_sandboxes(s, edge, ref)
        tasks = await alpha_attacks(edge, ref, sids, tally, held)
        await asyncio.sleep(HOSTILE_WARMUP)
        log(f"fairness: alpha hostile ({EXECS} execs, {CALLERS} abandoning FnCalls, bodies, {SOCKETS} sockets)")
        out["hostile"] = await beta_rounds(edge, ref, rounds, time.monotonic() + phase_seconds)
        out["rss_hostile_peak"] = peak[0]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for writer in held:
            writer.close()
        if sampler is not None:
            sampler.cancel()
        with contextlib.suppress(OSError):
            out["rss_after"] = rss(edge.proc.pid)
            out["rss_hwm"] = rss(edge.proc.pid, "VmHWM")
        out["cleanup_problems"] = await asyncio.to_thread(stop_edge, edge)
    out["attacks"] = {k: dict(v) for k, v in tally.answers.items()}
    for what in ("first_exit", "list"):
        out[f"{what}_p99_hostile_over_quiet"] = ratio(out["hostile"][what]["p99"], out["quiet"][what]["p99"])
    return out


def _commit(repo: Path) -> str:
    done = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=False)
    return done.stdout.strip() or "unknown"


def render(fair: dict[str, Any], ms: Callable[[float | None], str], x: Callable[[float | None], str]) -> list[str]:
    out = [f"Fairness (edge from {fair['repo']} at {fair['commit']}; beta's rounds, ms; alpha hostile: "
           f"{EXECS} execs, {CALLERS} abandoning FnCalls, slow and huge JSON bodies, {SOCKETS} flooded sockets)"]
    rows = []
    for phase in ("quiet", "hostile"):
        doc = fair.get(phase)
        if not doc:
            continue
        for what in ("first_exit", "list"):
            rows.append(f"  {phase:8} {what:11} n {doc[what]['n']:3}  p50 {ms(doc[what]['p50']):>9}  "
                        f"p99 {ms(doc[what]['p99']):>9}")
        if doc["failures"]:
            rows.append(f"  {phase:8} failures: {doc['failures']}")
    out += rows
    out.append(f"  p99 hostile/quiet: create to first exit {x(fair.get('first_exit_p99_hostile_over_quiet'))}, "
               f"list {x(fair.get('list_p99_hostile_over_quiet'))}")
    mib = 1 << 20
    out.append(f"  edge RSS: quiet {fair.get('rss_quiet', 0) / mib:.0f} MiB, hostile peak "
               f"{fair.get('rss_hostile_peak', 0) / mib:.0f} MiB, after {fair.get('rss_after', 0) / mib:.0f} MiB "
               f"(VmHWM {fair.get('rss_hwm', 0) / mib:.0f} MiB)")
    for attack, answers in fair.get("attacks", {}).items():
        out.append(f"  alpha {attack}: {answers}")
    if fair.get("cleanup_problems"):
        out.append(f"  cleanup problems: {fair['cleanup_problems']}")
    out.append("")
    return out
