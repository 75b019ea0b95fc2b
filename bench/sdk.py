"""Benchmark: the same workload through layerbox's own SDK and through the stock ``e2b`` SDK, on one edge.

One edge process (``python -m sandbox.edge``, this checkout) on a ``file://`` store holding the
fixture's ``python`` image, and one template made the way an E2B operator makes one: the image,
E2B's account ``user`` added, checkpointed as ``base`` in the bench's project.  Both clients
start from ``base`` and run, interleaved round by round (the order alternating):

* **create to first output**: create a sandbox and run ``echo ready`` until its output is back
  (native ``AsyncSandbox.create`` + ``commands.run``; E2B ``AsyncSandbox.create`` +
  ``commands.run``, which runs as ``user``, E2B's default);
* **command**: ``commands.run("true")`` on a live sandbox, ``--iterations`` times; the e2b SDK
  runs it as ``/bin/bash -l -c true`` (a login shell), so the native client also runs that argv,
  and the row "native: bash -l -c true" compares the protocols on the same process;
* **file**: a 10 MB file written then read back (checked equal);
* **fork**: a fork of ``--forks`` sandboxes, timed until the answer (every fork running);
* **pause** and **resume** (E2B resumes through ``connect``).

Each figure is printed for both with the ratio e2b/native (the goal: at most 1.2x).  Under the
command, file and pause figures, three more rows split it: **each SDK alone**, the same calls
answered by a server that replays the edge's recorded answers at once (:class:`Replay`: what the
client itself costs), **the edge's part**, the p50 minus that, and the ratio the stock client
would get from an edge whose E2B path cost exactly what its native one does (e2b alone + the
native edge's part): above 1.2x, no work on the edge meets the goal for that figure.  A section
whose E2B call the edge does not serve yet prints ``not available: <reason>``; the native side
still runs.  Everything the run makes (sandboxes, the edge, its mounts, the store) is removed
at exit, on Ctrl-C and on SIGTERM/SIGHUP.  ``python bench/sdk.py --help``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: import the checkout, installed or not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402
from common import BenchError, _f, _table, log, ratio, summary, workspace  # noqa: E402
from fairness import Edge, start_edge, stop_edge  # noqa: E402  (the edge as a subprocess, stopped clean)

from converters.publish import publish  # noqa: E402
from layerstore.errors import LayerboxError  # noqa: E402
from layerstore.store import Store  # noqa: E402
from lazyfetch import kmount  # noqa: E402

SCHEMA = "layerbox.bench.sdk.v1"
FIXTURE_NAME = "debian-bookworm.oci.tar"
IMAGE = "bench/python"
TEMPLATE = "base"
GOAL = 1.2
FILE_SIZE = 10_000_000
FILE_PATH = "/tmp/bench-10mb.bin"
TTL = 900  # seconds: every sandbox of the run outlives its section
REPO = Path(__file__).resolve().parents[1]
E2B_USER = "user"  # the account E2B's commands run as (the template has it)
E2B_ARGV = ["/bin/bash", "-l", "-c", "true"]  # what the e2b SDK runs for commands.run("true")
MISSING = "lb-000000000000"  # a well-formed id no sandbox has: what a route that exists answers 404 for


class Unavailable(BenchError):
    """The edge does not serve this E2B call yet; the section prints the reason."""


# -- the edge, the image, the template -----------------------------------------------------------------


def find_fixture(option: str | None) -> Path:
    if option:
        path = Path(option)
        if not path.is_file():
            raise BenchError(f"--fixture {option}: no such file (an oci-archive with tag python)")
        return path.resolve()
    for candidate in (REPO.parent / "shared" / "fixtures" / FIXTURE_NAME, Path("/work/shared/fixtures") / FIXTURE_NAME):
        if candidate.is_file():
            return candidate
    raise BenchError(f"the fixture image ../shared/fixtures/{FIXTURE_NAME} is not here; pass --fixture PATH")


async def publish_image(store_url: str, work: Path, fixture: Path) -> float:
    t0 = time.perf_counter()
    (work / "convert").mkdir(exist_ok=True)
    async with await Store.open(store_url, work / "pub") as store:
        await publish(store, f"oci-archive:{fixture}:python", IMAGE, work_dir=work / "convert")
    return time.perf_counter() - t0


def projects(quota: int) -> dict[str, dict[str, Any]]:
    """The bench's project (both clients use it) and the operator's, who publishes the template."""
    return {"bench": {"max_sandboxes": quota}, "ops": {"admin": True}}


async def make_template(edge: Edge) -> None:
    """``base`` as tests/support/e2b.py makes it: the image with E2B's account ``user``, checkpointed
    by the operator and shared with every project."""
    from sandbox.sdk import AsyncSandbox

    async with await AsyncSandbox.create(IMAGE, url=edge.url, token=edge.tokens["ops"], ttl=TTL) as sb:
        await sb.commands.run("useradd -m -u 1000 -s /bin/bash user")
        await sb.checkpoint(name=TEMPLATE, labels={"layerbox.shared": "true"})


def use_e2b(edge: Edge) -> None:
    """The stock SDK is configured only by its environment, as a user's would be."""
    os.environ.update({"E2B_API_KEY": edge.tokens["bench"], "E2B_API_URL": edge.url, "E2B_SANDBOX_URL": edge.url})


async def served(edge: Edge, method: str, path: str) -> None:
    """:class:`Unavailable` when the edge has no route for an E2B call: aiohttp's own 404/405 (error
    code ``http``, in the native or the E2B shape), not the route's "no such sandbox"."""
    async with aiohttp.ClientSession() as s, s.request(method, edge.url + path, json={},
                                                       headers={"X-API-Key": edge.tokens["bench"]}) as r:
        status, text = r.status, await r.text()
    try:
        doc = json.loads(text)
    except ValueError:
        doc = {}
    native = doc.get("error") if isinstance(doc.get("error"), dict) else {}
    if status in (404, 405) and (native.get("code") == "http" or str(doc.get("message", "")).startswith("http:")):
        raise Unavailable(f"the edge does not serve {method} {path.replace(MISSING, '{sandboxID}')} yet "
                          f"({status} from its router)")


# -- the two clients, side by side --------------------------------------------------------------------


class Native:
    name = "native"

    def __init__(self, edge: Edge) -> None:
        self.edge = edge

    async def create(self) -> Any:
        from sandbox.sdk import AsyncSandbox

        # as E2B's user, as the e2b SDK's commands run, and with E2B's default internet access (a policed
        # network namespace whose counters every command's receipt reads): the same sandbox both ways
        return await AsyncSandbox.create(TEMPLATE, url=self.edge.url, token=self.edge.tokens["bench"], ttl=TTL, user=E2B_USER,
                                         network=[{"cidr": "0.0.0.0/0"}])

    async def run(self, sb: Any, cmd: str | list[str]) -> str:
        return str((await sb.commands.run(cmd)).stdout)

    async def write(self, sb: Any, data: bytes) -> None:
        await sb.files.write(FILE_PATH, data)

    async def read(self, sb: Any) -> bytes:
        return bytes(await sb.files.read(FILE_PATH, format="bytes"))

    async def fork(self, sb: Any, count: int) -> list[Any]:
        return list((await sb.fork(count)).sandboxes)

    async def pause(self, sb: Any) -> None:
        await sb.pause()

    async def resume(self, sb: Any) -> None:
        await sb.resume()

    async def kill(self, sb: Any) -> None:
        await sb.kill()


class E2b:
    name = "e2b"

    def __init__(self, edge: Edge) -> None:
        self.edge = edge

    async def create(self) -> Any:
        from e2b import AsyncSandbox

        return await AsyncSandbox.create(TEMPLATE, timeout=TTL)

    async def run(self, sb: Any, cmd: str | list[str]) -> str:
        if not isinstance(cmd, str):  # (the SDK takes a shell line, which it runs as E2B_ARGV does)
            raise BenchError(f"sdk: the e2b SDK runs shell lines, not argv {cmd!r}")
        return str((await sb.commands.run(cmd)).stdout)

    async def write(self, sb: Any, data: bytes) -> None:
        await sb.files.write(FILE_PATH, data)

    async def read(self, sb: Any) -> bytes:
        return bytes(await sb.files.read(FILE_PATH, format="bytes"))

    async def fork(self, sb: Any, count: int) -> list[Any]:
        out = await sb.fork(count=count, timeout=TTL)
        failed = [r for r in out if isinstance(r, Exception)]
        if failed:
            await asyncio.gather(*(f.kill() for f in out if not isinstance(f, Exception)), return_exceptions=True)
            raise BenchError(f"sdk: {len(failed)} of {count} E2B forks failed: {failed[0]!r}")
        return list(out)

    async def pause(self, sb: Any) -> None:
        await sb.pause()

    async def resume(self, sb: Any) -> None:
        await sb.connect()  # E2B resumes a paused sandbox on connect

    async def kill(self, sb: Any) -> None:
        await sb.kill()


Client = Native | E2b
Step = Callable[[Client, Any], Awaitable[dict[str, float]]]


async def interleaved(clients: Sequence[Client], rounds: int, step: Step, sandboxes: dict[str, Any],
                      what: str) -> dict[str, dict[str, list[float]]]:
    """``step`` for every client, ``rounds`` times, the order alternating round by round; its figures
    (name -> seconds) collected per client."""
    out: dict[str, dict[str, list[float]]] = {c.name: {} for c in clients}
    for i in range(rounds):
        if rounds >= 10 and i % max(1, rounds // 5) == 0:
            log(f"sdk: {what} {i + 1}/{rounds}")
        for client in clients[::1 if i % 2 else -1]:
            for key, seconds in (await step(client, sandboxes.get(client.name))).items():
                out[client.name].setdefault(key, []).append(seconds)
    return out


# -- sections ------------------------------------------------------------------------------------------


async def create_section(clients: Sequence[Client], rounds: int) -> dict[str, Any]:
    async def first_output(client: Client, argv: str | list[str]) -> tuple[float, float]:
        t0 = time.perf_counter()
        sb = await client.create()
        t1 = time.perf_counter()
        try:
            out = await client.run(sb, argv)
            t2 = time.perf_counter()
            if out != "ready\n":
                raise BenchError(f"sdk: {client.name}'s first command printed {out!r}")
        finally:
            await client.kill(sb)
        return t1 - t0, t2 - t0

    async def step(client: Client, _sb: Any) -> dict[str, float]:
        create, first = await first_output(client, "echo ready")
        if client.name == "e2b":  # E2B's first command is a login shell's (E2B_ARGV) already
            return {"create": create, "create_to_first_output": first, "create_to_first_output_as_e2b": first}
        # the same first process as E2B's, in a sandbox of its own: a login shell's first run in a
        # new sandbox reads /etc/profile and ~/.profile through a fresh overlay (5-10 ms here)
        _, as_e2b = await first_output(client, [*E2B_ARGV[:-1], "echo ready"])
        return {"create": create, "create_to_first_output": first, "create_to_first_output_as_e2b": as_e2b}

    return figures(await interleaved(clients, rounds, step, {}, "create + first output"))


async def command_section(clients: Sequence[Client], live: dict[str, Any], n: int) -> dict[str, Any]:
    for client in clients:  # untimed: the first command of each sandbox
        await client.run(live[client.name], "true")

    async def step(client: Client, sb: Any) -> dict[str, float]:
        t0 = time.perf_counter()
        await client.run(sb, "true")
        t1 = time.perf_counter()
        if client.name == "e2b":  # its "true" is E2B's argv already, and a background command of the edge's
            return {"run_true": t1 - t0, "run_true_as_e2b": t1 - t0, "run_true_background": t1 - t0}
        await client.run(sb, E2B_ARGV)
        t2 = time.perf_counter()
        # the same argv as a native background command, attached to until it exits: the machinery E2B's
        # Start stands on (a process that outlives its stream, found again by pid), without E2B's wire
        handle = await sb.commands.run(E2B_ARGV, background=True)
        await handle.wait()
        return {"run_true": t1 - t0, "run_true_as_e2b": t2 - t1, "run_true_background": time.perf_counter() - t2}

    return figures(await interleaved(clients, n, step, live, 'commands.run("true")'))


async def file_section(clients: Sequence[Client], live: dict[str, Any], rounds: int) -> dict[str, Any]:
    data = os.urandom(FILE_SIZE)

    async def step(client: Client, sb: Any) -> dict[str, float]:
        t0 = time.perf_counter()
        await client.write(sb, data)
        t1 = time.perf_counter()
        back = await client.read(sb)
        t2 = time.perf_counter()
        if back != data:
            raise BenchError(f"sdk: {client.name} read back {len(back)} bytes that differ from the "
                             f"{len(data)} written")
        return {"write_10mb": t1 - t0, "read_10mb": t2 - t1}

    return figures(await interleaved(clients, rounds, step, live, "10 MB write + read"))


async def fork_section(clients: Sequence[Client], live: dict[str, Any], count: int, rounds: int) -> dict[str, Any]:
    async def step(client: Client, sb: Any) -> dict[str, float]:
        log(f"sdk: {client.name} fork of {count}")
        t0 = time.perf_counter()
        forks = await client.fork(sb, count)
        seconds = time.perf_counter() - t0
        try:
            if len(forks) != count:
                raise BenchError(f"sdk: {client.name}'s fork of {count} made {len(forks)}")
            outs = {await client.run(f, "cat /tmp/forked") for f in forks}
            if outs != {"source\n"}:
                raise BenchError(f"sdk: {client.name}'s forks read {outs}, not the source's file")
        finally:
            await asyncio.gather(*(client.kill(f) for f in forks), return_exceptions=True)
        return {f"fork_{count}": seconds}

    for client in clients:
        await client.run(live[client.name], "echo source > /tmp/forked")
    return figures(await interleaved(clients, rounds, step, live, f"fork of {count}"))


async def pause_section(clients: Sequence[Client], live: dict[str, Any], rounds: int) -> dict[str, Any]:
    async def step(client: Client, sb: Any) -> dict[str, float]:
        t0 = time.perf_counter()
        await client.pause(sb)
        t1 = time.perf_counter()
        await client.resume(sb)
        t2 = time.perf_counter()
        if await client.run(sb, "echo back") != "back\n":
            raise BenchError(f"sdk: {client.name}'s sandbox did not run a command after its resume")
        return {"pause": t1 - t0, "resume": t2 - t1}

    return figures(await interleaved(clients, rounds, step, live, "pause + resume"))


def figures(runs: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """Per figure: each client's summary, and e2b/native of p50 and p99."""
    out: dict[str, Any] = {}
    for key in runs["native"]:
        native, e2b = summary(runs["native"][key]), summary(runs.get("e2b", {}).get(key, []))
        out[key] = {"native": native, "e2b": e2b if e2b["n"] else None,
                    "ratio_p50": ratio(e2b["p50"], native["p50"]), "ratio_p99": ratio(e2b["p99"], native["p99"])}
    return out


async def guarded(name: str, clients: Sequence[Client], probe: Callable[[], Awaitable[None]] | None,
                  run: Callable[[Sequence[Client]], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """A section with both clients, or the native one alone and why E2B's is not there."""
    try:
        if probe is not None:
            await probe()
    except Unavailable as exc:
        log(f"sdk: {name}: e2b not available: {exc}")
        return {"e2b_unavailable": str(exc), **await run([c for c in clients if c.name == "native"])}
    return await run(clients)


async def files_probe(e2b: E2b, sb: Any) -> None:
    """The envd file routes answer a small write (a route the edge lacks fails the SDK's call)."""
    try:
        await sb.files.write("/tmp/bench-probe", b"probe")
    except Exception as exc:  # the SDK's exception for whatever the edge answered
        raise Unavailable(f"envd /files: {type(exc).__name__}: {str(exc)[:200]}") from exc


class Replay:
    """Each SDK's own cost with no edge behind it.  Recording, it is a proxy to the edge that keeps
    the answer to each (method, path) it forwards; replaying, it answers those bytes again at once
    (no sandbox, no work): what a client takes for a call whose server costs nothing."""

    DROPPED = frozenset({"transfer-encoding", "content-length", "connection", "keep-alive", "date", "server"})

    def __init__(self, edge_url: str) -> None:
        self.edge_url = edge_url
        self.recording = True
        self.answers: dict[tuple[str, str], tuple[int, list[tuple[str, str]], bytes]] = {}

    async def handle(self, request: Any) -> Any:
        from aiohttp import web

        key = (request.method, request.path)
        body = await request.read()
        if self.recording:
            headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", *self.DROPPED)}
            async with self.session.request(request.method, self.edge_url + request.path_qs, headers=headers,
                                            data=body) as r:
                self.answers[key] = (r.status, [(k, v) for k, v in r.headers.items()
                                                if k.lower() not in self.DROPPED], await r.read())
        if key not in self.answers:
            raise BenchError(f"sdk: replay: {request.method} {request.path} was not recorded")
        status, headers, data = self.answers[key]
        return web.Response(status=status, headers=headers, body=data)

    async def __aenter__(self) -> str:
        import aiohttp
        from aiohttp import web

        self.session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=4 * FILE_SIZE)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()
        await self.session.close()


async def client_floor(edge: Edge, live: dict[str, Any], rounds: int, iterations: int) -> dict[str, Any]:
    """What each SDK itself costs for the section's calls: one of each recorded through
    :class:`Replay` against the live sandboxes, then answered again ``rounds`` times (a command
    ``iterations`` times) with no edge behind (the clients interleaved as everywhere)."""
    from e2b import AsyncSandbox as E2bSandbox

    from sandbox.sdk import AsyncSandbox as NativeSandbox

    data = os.urandom(FILE_SIZE)
    replay = Replay(edge.url)
    async with replay as url:
        through = {"native": await NativeSandbox.connect(live["native"].sandbox_id, url=url,
                                                         token=edge.tokens["bench"]),
                   "e2b": await E2bSandbox.connect(live["e2b"].sandbox_id, api_url=url, sandbox_url=url)}
        clients: list[Client] = [Native(edge), E2b(edge)]

        async def step(client: Client, sb: Any) -> dict[str, float]:
            t = [time.perf_counter()]
            await client.run(sb, "true")
            t.append(time.perf_counter())
            await client.write(sb, data)
            t.append(time.perf_counter())
            back = await client.read(sb)
            t.append(time.perf_counter())
            await client.pause(sb)
            t.append(time.perf_counter())
            await client.resume(sb)
            t.append(time.perf_counter())
            if back != data and not replay.recording:
                raise BenchError(f"sdk: {client.name}'s replayed read gave other bytes")
            return {k: t[i + 1] - t[i] for i, k in enumerate(("run_true", "write_10mb", "read_10mb", "pause",
                                                               "resume"))}

        for client in clients:  # recorded: the edge's answer to each call (the sandbox ends as it began)
            await step(client, through[client.name])
        replay.recording = False
        runs = await interleaved(clients, rounds, step, through, "each client alone (answers replayed)")

        async def command(client: Client, sb: Any) -> dict[str, float]:
            t0 = time.perf_counter()
            await client.run(sb, "true")
            return {"run_true": time.perf_counter() - t0}

        commands = await interleaved(clients, iterations, command, through, 'each client alone: commands.run("true")')
        await through["native"].close()  # (the session only: the sandbox is the section's, killed after)
    for name, figs in commands.items():
        runs[name]["run_true"] = figs["run_true"]
    return figures(runs)


async def run_bench(args: argparse.Namespace, edge: Edge) -> dict[str, Any]:
    native, e2b = Native(edge), E2b(edge)
    clients: list[Client] = [native, e2b]
    results: dict[str, Any] = {"create": await create_section(clients, args.creates)}
    live = {c.name: await c.create() for c in clients}
    try:
        results["command"] = await command_section(clients, live, args.iterations)
        results["file"] = await guarded("file", clients, lambda: files_probe(e2b, live["e2b"]),
                                        lambda cs: file_section(cs, live, args.file_rounds))
        results["fork"] = await guarded("fork", clients, lambda: served(edge, "POST", f"/sandboxes/{MISSING}/fork"),
                                        lambda cs: fork_section(cs, live, args.forks, args.fork_rounds))
        results["pause"] = await guarded("pause", clients, lambda: served(edge, "POST", f"/sandboxes/{MISSING}/pause"),
                                         lambda cs: pause_section(cs, live, args.pauses))
        results["floor"] = await client_floor(edge, live, args.file_rounds * 2, args.iterations)
    finally:
        await asyncio.gather(*(c.kill(live[c.name]) for c in clients), return_exceptions=True)
    return results


# -- output --------------------------------------------------------------------------------------------

ROWS = [("create", "create", "create (answer)"), ("create", "create_to_first_output", "create to first output"),
        ("create", "create_to_first_output_as_e2b", "  native: first command bash -l -c"),
        ("command", "run_true", 'commands.run("true")'),
        ("command", "run_true_as_e2b", "  native: bash -l -c true"),
        ("command", "run_true_background", "  native: the same as a background command"), ("file", "write_10mb", "write 10 MB"),
        ("file", "read_10mb", "read 10 MB"), ("fork", None, "fork"), ("pause", "pause", "pause"),
        ("pause", "resume", "resume")]
FLOORED = ("run_true", "write_10mb", "read_10mb", "pause", "resume")  # rows followed by each SDK alone
SAME_WORK = {"run_true": "run_true_as_e2b"}  # the native row doing what the e2b SDK's call does


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def render(doc: dict[str, Any]) -> str:
    s, env = doc["settings"], doc["environment"]
    out = [f"layerbox native SDK vs the stock e2b SDK {env['e2b']} on one edge (template {TEMPLATE!r}: "
           f"{s['fixture']}:python + account user, container isolation)",
           f"{env['cpus']} CPUs; kernel {env['kernel']}; Python {env['python']}; load {env['loadavg_start']} -> "
           f"{env['loadavg_end']}; publish {_f(doc['publish_seconds'])} s; wall {env.get('wall_seconds', '-')} s",
           f"ms, p99 = nearest rank; the two clients interleaved round by round; goal e2b/native <= {GOAL}x", ""]
    rows, notes = [], []
    for section, key, label in ROWS:
        sec = doc.get(section) or {}
        for k in [key] if key else [k for k in sec if k.startswith("fork_")]:
            fig = sec.get(k)
            if fig is None:
                continue
            e, n, r50 = fig["e2b"], fig["native"], fig["ratio_p50"]
            rows.append([label if key else f"fork of {k.split('_')[1]}", str(n["n"]), _ms(n["p50"]), _ms(n["p99"]),
                         _ms(e and e["p50"]), _ms(e and e["p99"]), _x(r50), _x(fig["ratio_p99"]),
                         "-" if r50 is None else "ok" if r50 <= GOAL else "over"])
            alone = (doc.get("floor") or {}).get(k)
            if k in FLOORED and alone is not None and e is not None:
                a_n, a_e = alone["native"], alone["e2b"]
                rows.append(["  each SDK alone (answers replayed)", str(a_n["n"]), _ms(a_n["p50"]), _ms(a_n["p99"]),
                             _ms(a_e and a_e["p50"]), _ms(a_e and a_e["p99"]), _x(alone["ratio_p50"]),
                             _x(alone["ratio_p99"]), ""])
                share_n, share_e = n["p50"] - a_n["p50"], e["p50"] - (a_e["p50"] if a_e else 0.0)
                share = ratio(share_e, share_n) if share_n > 0 else None
                rows.append(["  the edge's part (p50 minus alone)", "", _ms(share_n), "", _ms(share_e), "", _x(share),
                             "", "-" if share is None else "ok" if share <= GOAL else "over"])
                # the best any edge could do for the stock client: its E2B path as cheap as its native one
                # for the same work (for commands.run, E2B's login shell: the native row running it)
                same = sec.get(SAME_WORK.get(k, k)) or fig
                edge_n = same["native"]["p50"] - a_n["p50"]
                best = ratio(a_e["p50"] + max(edge_n, 0.0), n["p50"]) if a_e else None
                rows.append(["  e2b alone + the native edge's part, same work", "", "", "", _ms(best and best * n["p50"]), "",
                             _x(best), "", "-" if best is None else "reachable" if best <= GOAL else "not by the edge"])
    for section in dict.fromkeys(s for s, _, _ in ROWS):
        if "e2b_unavailable" in (doc.get(section) or {}):
            notes.append(f"{section}: e2b not available: {doc[section]['e2b_unavailable']}")
    out.append(_table(["figure", "n", "native p50", "p99", "e2b p50", "p99", "e2b/native p50", "p99",
                       f"p50 <= {GOAL}x"], rows))
    out += ["", *notes] if notes else []
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/sdk.py", description=__doc__.split("\n")[0])
    p.add_argument("--iterations", type=int, default=200, metavar="N", help='commands.run("true") per client '
                   "(default 200)")
    p.add_argument("--creates", type=int, default=10, metavar="N", help="create + first output rounds (default 10)")
    p.add_argument("--file-rounds", type=int, default=20, metavar="N",
                   help="10 MB write + read rounds (default 20; the write's p50 of 5 moved by more than the goal's margin between runs)")
    p.add_argument("--forks", type=int, default=8, metavar="N", help="sandboxes per fork (default 8)")
    p.add_argument("--fork-rounds", type=int, default=3, metavar="N", help="fork rounds (default 3)")
    p.add_argument("--pauses", type=int, default=10, metavar="N", help="pause + resume rounds (default 10)")
    p.add_argument("--fixture", default=None, metavar="PATH",
                   help=f"the oci-archive with tag python (default ../shared/fixtures/{FIXTURE_NAME})")
    p.add_argument("--tmpdir", type=Path, default=Path("/var/tmp"), metavar="DIR",
                   help="where the store and the edge's data dir go (default /var/tmp); removed at exit")
    p.add_argument("--json", type=Path, default=None, metavar="FILE",
                   help=f"also write one JSON document ({SCHEMA}) to FILE ('-': stdout, instead of the table)")
    return p


async def bench(args: argparse.Namespace, work: Path, fixture: Path) -> dict[str, Any]:
    store_url = f"file://{work / 'store'}"
    log(f"publish oci-archive:{fixture}:python -> {IMAGE}")
    published = await publish_image(store_url, work, fixture)
    edge = await start_edge(REPO, work, store_url, name="bench-sdk", projects=projects(2 * args.forks + 8))
    try:
        log(f"template {TEMPLATE!r}: the image with E2B's account user, checkpointed")
        await make_template(edge)
        use_e2b(edge)
        results = await run_bench(args, edge)
    finally:
        log("stopping the edge (SIGTERM) and destroying what it left")
        problems = stop_edge(edge)
    if problems:
        raise BenchError(f"sdk: cleanup: {problems}")
    return {"publish_seconds": published, **results}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.iterations, args.creates, args.file_rounds, args.forks, args.fork_rounds, args.pauses) < 1:
        print("bench/sdk.py: counts must be at least 1", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("bench/sdk.py: needs root (the edge mounts and runs containers)", file=sys.stderr)
        return 1
    import e2b  # the stock SDK: a missing one is said before anything starts

    started, load_start = time.time(), _loadavg()
    left: list[str] = []
    try:
        fixture = find_fixture(args.fixture)
        with workspace(args.tmpdir, "lb-sdk-", before_removal=lambda w: left.extend(kmount.mounts_under(w))) as work:
            results = asyncio.run(bench(args, work, fixture))
    except BenchError as exc:
        log(f"bench/sdk.py: {exc}")
        return 1
    except LayerboxError as exc:
        log(f"bench/sdk.py: layerbox failed: {type(exc).__name__}: {exc}")
        return 1
    except KeyboardInterrupt:
        log("bench/sdk.py: interrupted; everything it created was removed")
        return 130
    if left:
        log(f"bench/sdk.py: mounts were left under the workdir: {left}")
        return 1
    doc = {"schema": SCHEMA,
           "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
           | {"fixture": str(fixture), "file_size": FILE_SIZE, "goal": GOAL},
           "environment": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
                           "e2b": getattr(e2b, "__version__", _version("e2b")), "loadavg_start": load_start,
                           "loadavg_end": _loadavg(), "wall_seconds": round(time.time() - started, 1),
                           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))},
           **results}
    if args.json is not None:
        text = json.dumps(doc, indent=2, default=str) + "\n"
        if str(args.json) == "-":
            sys.stdout.write(text)
            return 0
        args.json.write_text(text)
    print(render(doc))
    return 0


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


if __name__ == "__main__":
    sys.exit(main())
