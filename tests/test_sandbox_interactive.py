"""Background commands and terminals through the real service: raw HTTP and WebSocket, real crun.

What a test checks about processes is read inside the sandbox from /proc (the fixture image
has no ps), never from what the service says about itself; receipts are read from the log.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import blake3
import pytest

from sandbox.edge.app import AuthConfig, SandboxService
from sandbox.edge.routes.commands import CommandLimits as Limits
from sandbox.host.manager import SandboxManager
from tests.support.edges import EdgeProcess
from tests.support.sandboxes import PROCESS_ARGS, REF, ServerThread, no_sandboxes_left, serving

pytestmark = [pytest.mark.usefixtures("need_root"), pytest.mark.root("erofs", "overlay", "fuse", "cmd:crun")]

ALPHA, BETA = "alpha-token-0123456789", "beta-token-0123456789"
TOKENS = {"projects": {"alpha": {"tokens": [ALPHA], "max_sandboxes": 4},
                       "beta": {"tokens": [BETA], "max_sandboxes": 2}}}
# small, so that each bound is reached by a test
LIMITS = Limits(commands=3, terminals=2, finished=3, buffer=64 << 10, readers=2, stdin=64 << 10, stdin_timeout=2.0)
WAIT = 60.0  # seconds for anything a loaded 2-core host does in well under 10
SCENARIO = 180.0  # one test's whole conversation with the service


@pytest.fixture(scope="module")
def server(manager: SandboxManager) -> Iterator[ServerThread]:
    with serving(manager, TOKENS, command_limits=LIMITS) as srv:
        yield srv


@pytest.fixture
def url(server: ServerThread, manager: SandboxManager) -> Iterator[str]:
    with no_sandboxes_left(manager):
        yield server.url
    assert manager.backend("container").runtime.list() == []


def scenario(fn: Callable[[Api], Awaitable[None]], base: str) -> None:
    """Run ``fn`` against the service at ``base`` with a fresh client session, within SCENARIO s;
    the sandboxes it made are destroyed afterwards (those already gone answer 404)."""
    async def main() -> None:
        async with aiohttp.ClientSession(base) as session:
            api = Api(session)
            try:
                async with asyncio.timeout(SCENARIO):
                    await fn(api)
            finally:
                async with asyncio.timeout(WAIT):
                    for sid, token in api.made:
                        with contextlib.suppress(aiohttp.ClientConnectionError):  # a stopped service
                            await api.call("DELETE", f"/v1/sandboxes/{sid}", token=token)

    asyncio.run(main())


class Api:
    """Raw requests to the service (no SDK): JSON in, (status, JSON) out."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session
        self.made: list[tuple[str, str]] = []  # (sandbox, its project's token)

    @staticmethod
    def auth(token: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}

    async def call(self, method: str, path: str, body: Any = None, *, token: str = ALPHA) -> tuple[int, Any]:
        async with self.session.request(method, path, json=body, headers=self.auth(token)) as r:
            raw = await r.read()
            return r.status, json.loads(raw) if raw else None

    async def ok(self, method: str, path: str, body: Any = None, *, status: int = 200, token: str = ALPHA) -> Any:
        got, doc = await self.call(method, path, body, token=token)
        assert got == status, (method, path, got, doc)
        return doc

    async def sandbox(self, token: str = ALPHA) -> str:
        sid = str((await self.ok("POST", "/v1/sandboxes", {"image": REF}, status=201, token=token))["id"])
        self.made.append((sid, token))
        return sid

    async def start(self, sid: str, body: dict[str, Any], *, token: str = ALPHA) -> dict[str, Any]:
        doc = await self.ok("POST", f"/v1/sandboxes/{sid}/commands", body, status=201, token=token)
        # the answer comes once the process exists: a short one may have ended by then
        assert doc["status"] in ("running", "exited"), doc
        return dict(doc)

    async def sh(self, sid: str, cmd: str) -> str:
        """A foreground command's stdout (through the exec route)."""
        async with self.session.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd}, headers=self.auth(ALPHA)) as r:
            assert r.status == 200, await r.text()
            events = [json.loads(line) for line in (await r.read()).splitlines() if line.strip()]
        assert events[-1]["type"] == "exit", events
        return b"".join(base64.b64decode(e["data"]) for e in events if e["type"] == "stdout").decode()

    async def processes(self, sid: str) -> list[str]:
        """Command lines of every process in the sandbox, from its own /proc."""
        return (await self.sh(sid, PROCESS_ARGS)).splitlines()

    async def output(self, sid: str, cid: str, *, since: int = 0,
                     until: Callable[[list[dict[str, Any]]], bool] | None = None) -> list[dict[str, Any]]:
        """The output stream's events up to the exit, or (then the client leaves) until ``until`` holds."""
        events: list[dict[str, Any]] = []
        path = f"/v1/sandboxes/{sid}/commands/{cid}/output?since={since}"
        async with asyncio.timeout(WAIT), self.session.get(path, headers=self.auth(ALPHA)) as r:
            assert r.status == 200, await r.text()
            while line := await r.content.readline():
                events.append(json.loads(line))
                if until is not None and until(events):
                    break
        return events

    async def receipts(self, sid: str, action: str = "exec") -> list[dict[str, Any]]:
        return list((await self.ok("GET", f"/v1/sandboxes/{sid}/receipts?action={action}"))["receipts"])


def printed(events: list[dict[str, Any]], stream: str = "stdout") -> bytes:
    return b"".join(base64.b64decode(e["data"]) for e in events if e["type"] == stream)


async def until(what: str, check: Callable[[], Awaitable[Any]], within: float = WAIT) -> Any:
    """Poll ``check`` until it returns something truthy; fail naming ``what`` after ``within`` s."""
    deadline = time.monotonic() + within
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {within} s (last: {value!r})")
        await asyncio.sleep(0.05)


class Terminal:
    """One WebSocket to a command: what it printed so far, input, control messages."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.screen = b""
        self.events: list[dict[str, Any]] = []

    async def expect(self, pattern: bytes) -> re.Match[bytes]:
        """Read until the output (since the socket opened) matches ``pattern``."""
        try:
            async with asyncio.timeout(WAIT):
                while (found := re.search(pattern, self.screen)) is None:
                    await self.next()
        except TimeoutError:
            raise AssertionError(f"{pattern!r} not printed within {WAIT} s; the terminal showed "
                                 f"{self.screen[-800:]!r}, events {self.events[-5:]}") from None
        return found

    async def next(self) -> dict[str, Any]:
        msg = await self.ws.receive()
        assert msg.type == aiohttp.WSMsgType.TEXT, (msg, self.screen[-500:])
        event = json.loads(msg.data)
        self.events.append(event)
        if event["type"] in ("stdout", "stderr"):
            self.screen += base64.b64decode(event["data"])
        return dict(event)

    async def until_exit(self) -> dict[str, Any]:
        async with asyncio.timeout(WAIT):
            while (event := await self.next())["type"] not in ("exit", "error"):
                pass
        return event

    async def closed(self) -> bool:
        async with asyncio.timeout(WAIT):
            msg = await self.ws.receive()
        return msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED)

    async def send(self, **message: Any) -> None:
        await self.ws.send_str(json.dumps(message))

    async def type(self, keys: bytes) -> None:
        await self.ws.send_bytes(keys)


@contextlib.asynccontextmanager
async def terminal(api: Api, sid: str, cid: str, *, since: int = 0,
                   token: str = ALPHA) -> AsyncIterator[Terminal]:
    """A WebSocket to the command ``cid`` (closed when the block ends)."""
    async with api.session.ws_connect(f"/v1/sandboxes/{sid}/commands/{cid}/connect?since={since}",
                                      headers=api.auth(token)) as ws:
        yield Terminal(ws)


# -- background commands ----------------------------------------------------------------------------------
def test_a_background_command_outlives_its_client_takes_stdin_and_is_killed_whole(url: str) -> None:
    script = "echo first; read line; echo got:$line; (sleep 301 &); sleep 302 & wait"

    async def run(api: Api) -> None:
        sid = await api.sandbox()
        cmd = await api.start(sid, {"cmd": script})
        cid = cmd["id"]
        assert (cmd["command"], cmd["pty"], cmd["stdin_open"]) == (["/bin/sh", "-c", script], None, True)

        # the client reads the first line, then goes away: nothing happens to the command
        events = await api.output(sid, cid, until=lambda ev: b"first\n" in printed(ev))
        assert printed(events) == b"first\n"
        assert (await api.ok("GET", f"/v1/sandboxes/{sid}/commands/{cid}"))["status"] == "running"
        assert "/bin/sh -c " + script + " " in await api.processes(sid)

        # input reaches it; what it prints meanwhile is kept for the next client
        sent = await api.ok("POST", f"/v1/sandboxes/{sid}/commands/{cid}/stdin",
                            {"data": base64.b64encode(b"hello\n").decode()})
        assert sent["status"] == "running"

        async def started_both() -> bool:
            procs = await api.processes(sid)
            return "sleep 301 " in procs and "sleep 302 " in procs

        await until("the command's child and its orphaned grandchild", started_both)
        replay = await api.output(sid, cid, until=lambda ev: b"got:hello\n" in printed(ev))
        assert printed(replay) == b"first\ngot:hello\n"
        assert [e["offset"] for e in replay if e["type"] == "stdout"][0] == 0
        later = await api.output(sid, cid, since=6, until=lambda ev: bool(printed(ev)))
        assert printed(later) == b"got:hello\n"
        assert later[0]["offset"] == 6

        listed = await api.ok("GET", f"/v1/sandboxes/{sid}/commands")
        assert [(c["id"], c["status"]) for c in listed["commands"]] == [(cid, "running")]

        # kill: its whole tree, the grandchild it left to the init included
        killed = await api.ok("POST", f"/v1/sandboxes/{sid}/commands/{cid}/kill")
        assert killed["killed"] is True
        final = killed["command"]["exit"]
        assert (final["type"], final["interrupted"], final["signal"]) == ("exit", "killed", 9), killed
        procs = await api.processes(sid)
        assert not [p for p in procs if p.startswith(("sleep 30", "/bin/sh -c echo first"))], procs
        again = await api.ok("POST", f"/v1/sandboxes/{sid}/commands/{cid}/kill")
        assert again["killed"] is False
        ended = await api.output(sid, cid)
        assert ended[-1] == final
        assert printed(ended) == b"first\ngot:hello\n"

        # its receipts: started, then its end, with what went in and out
        started = [r for r in await api.receipts(sid, "exec_started") if r.get("command_id") == cid]
        assert len(started) == 1
        assert started[0]["background"] is True
        assert started[0]["tag"].startswith("exec-")
        (rec,) = [r for r in await api.receipts(sid) if r.get("command_id") == cid]
        assert (rec["background"], rec["tty"], rec["interrupted"], rec["signal"]) == (True, False, "killed", 9)
        assert (rec["stdin_bytes"], rec["stdin_blake3"]) == (6, blake3.blake3(b"hello\n").hexdigest())
        assert rec["stdout_bytes"] == len(b"first\ngot:hello\n")
        assert rec["stdout_blake3"] == blake3.blake3(b"first\ngot:hello\n").hexdigest()
        assert rec["command"] == ["/bin/sh", "-c", script]

    scenario(run, url)


def test_a_pause_right_after_a_start_freezes_the_command_and_resume_goes_on(url: str) -> None:
    """The start's answer comes once the process exists: a pause at once freezes it (before, the
    answer came as crun exec began, and a pause then made crun refuse a paused container)."""
    async def run(api: Api) -> None:
        sid = await api.sandbox()
        for _ in range(5):
            cid = (await api.start(sid, {"cmd": "sleep 600"}))["id"]
            await api.ok("POST", f"/v1/sandboxes/{sid}/pause")
            await api.ok("POST", f"/v1/sandboxes/{sid}/resume")
            assert (await api.ok("GET", f"/v1/sandboxes/{sid}/commands/{cid}"))["status"] == "running"
            await api.ok("POST", f"/v1/sandboxes/{sid}/commands/{cid}/kill")

    scenario(run, url)


def test_exit_wait_stderr_initial_stdin_and_eof(url: str) -> None:
    async def run(api: Api) -> None:
        sid = await api.sandbox()
        quick = await api.start(sid, {"cmd": "sleep 0.5; echo out; echo err >&2; exit 3", "env": {"A": "1"}})
        done = await api.ok("GET", f"/v1/sandboxes/{sid}/commands/{quick['id']}?wait=30")
        assert (done["status"], done["exit"]["exit_code"]) == ("exited", 3), done
        events = await api.output(sid, quick["id"])
        assert (printed(events), printed(events, "stderr")) == (b"out\n", b"err\n")
        assert events[-1]["type"] == "exit"
        assert events[-1]["exit_code"] == 3

        # stdin given at the start is written first; eof ends it
        cat = await api.start(sid, {"cmd": ["cat"], "stdin": base64.b64encode(b"abc").decode()})
        path = f"/v1/sandboxes/{sid}/commands/{cat['id']}"
        assert (await api.ok("GET", path))["status"] == "running"
        await api.ok("POST", path + "/stdin", {"data": base64.b64encode(b"def").decode(), "eof": True})
        assert (await api.ok("GET", path + "?wait=30"))["exit"]["exit_code"] == 0
        assert printed(await api.output(sid, cat["id"])) == b"abcdef"
        status, doc = await api.call("POST", path + "/stdin", {"data": base64.b64encode(b"x").decode()})
        assert (status, doc["error"]["code"]) == (409, "conflict"), doc
        (rec,) = [r for r in await api.receipts(sid) if r.get("command_id") == cat["id"]]
        assert (rec["exit_code"], rec["stdin_bytes"], rec["interrupted"]) == (0, 6, None)

        # a command that never reads its input: a write waits stdin_timeout, then says so (retryable)
        deaf = await api.start(sid, {"cmd": "exec sleep 300"})
        chunk = base64.b64encode(b"x" * (60 << 10)).decode()
        stalled = None
        for _ in range(4):  # the pipe takes 64 KiB, then nothing
            status, doc = await api.call("POST", f"/v1/sandboxes/{sid}/commands/{deaf['id']}/stdin", {"data": chunk})
            if status != 200:
                stalled = (status, doc)
                break
        assert stalled is not None
        assert (stalled[0], stalled[1]["error"]["retryable"]) == (409, True), stalled
        await api.ok("POST", f"/v1/sandboxes/{sid}/commands/{deaf['id']}/kill")

    scenario(run, url)


def test_limits_and_every_field_checked(url: str) -> None:
    async def run(api: Api) -> None:
        sid = await api.sandbox()
        base = f"/v1/sandboxes/{sid}/commands"
        for body, field in (({"cmd": "true", "idempotency_key": "k"}, "idempotency_key"),
                            ({"cmd": "true", "bogus": 1}, "bogus"), ({}, "cmd"),
                            ({"cmd": ["a\x00b"]}, "cmd[0]"), ({"cmd": "true", "timeout": 0}, "timeout"),
                            ({"pty": {"cols": 0, "rows": 24}}, "pty.cols"), ({"pty": {"cols": 80}}, "pty.rows"),
                            ({"pty": {"cols": 80, "rows": 24, "x": 1}}, "pty.x"),
                            ({"cmd": "true", "output_cap": 1 << 40}, "output_cap")):
            status, doc = await api.call("POST", base, body)
            assert (status, doc["error"].get("field")) == (400, field), (body, doc)
        status, doc = await api.call("GET", base + "/cmd-nope")
        assert (status, doc["error"]["field"]) == (400, "command"), doc
        status, doc = await api.call("GET", base + "/cmd-0123456789ab")
        assert (status, doc["error"]["code"]) == (404, "command_not_found"), doc
        status, doc = await api.call("GET", base + "/cmd-0123456789ab/output?since=-1")
        assert (status, doc["error"]["code"]) == (404, "command_not_found"), doc  # the owner first

        # running commands per sandbox, terminals among them
        first = await api.start(sid, {"pty": {"cols": 80, "rows": 24}})
        status, doc = await api.call("GET", f"{base}/{first['id']}/output?since=-1")
        assert (status, doc["error"]["field"]) == (400, "since"), doc
        status, doc = await api.call("GET", f"{base}/{first['id']}/connect")  # not a WebSocket upgrade
        assert (status, doc["error"]["code"]) == (400, "bad_request"), doc
        await api.start(sid, {"pty": {"cols": 80, "rows": 24}})
        status, doc = await api.call("POST", base, {"pty": {"cols": 80, "rows": 24}})
        assert (status, doc["error"]["code"]) == (429, "command_limit"), doc
        await api.start(sid, {"cmd": "exec sleep 300"})
        status, doc = await api.call("POST", base, {"cmd": "true"})
        assert (status, doc["error"]["code"], doc["error"]["retryable"]) == (429, "command_limit", True), doc
        await api.ok("POST", f"{base}/{first['id']}/kill")
        third = await api.start(sid, {"cmd": "head -c 200000 /dev/zero | tr '\\0' a; echo END"})

        # output kept per command: the oldest goes first, and a reader is told how much
        await api.ok("GET", f"{base}/{third['id']}?wait=30")
        events = await api.output(sid, third["id"])
        assert (events[0]["type"], events[0]["offset"]) == ("dropped", 0), events[0]
        kept = printed(events)
        assert kept.endswith(b"aaaaEND\n"), kept[-20:]
        assert set(kept[:-4]) == {ord("a")}
        assert len(kept) <= LIMITS.buffer
        assert events[0]["bytes"] + len(kept) == 200004
        view = await api.ok("GET", f"{base}/{third['id']}")
        assert view["output"] == {"start": events[0]["bytes"], "end": 200004}

        # one write at most LIMITS.stdin bytes
        running = [c for c in (await api.ok("GET", base))["commands"] if c["status"] == "running"]
        big = base64.b64encode(b"x" * (LIMITS.stdin + 1)).decode()
        status, doc = await api.call("POST", f"{base}/{running[0]['id']}/stdin", {"data": big})
        assert (status, doc["error"]["field"]) == (400, "data"), doc
        status, doc = await api.call("POST", f"{base}/{running[0]['id']}/stdin", {"data": "%%%"})
        assert (status, doc["error"]["field"]) == (400, "data"), doc
        status, doc = await api.call("POST", f"{base}/{running[0]['id']}/stdin", {"eof": "yes"})
        assert (status, doc["error"]["field"]) == (400, "eof"), doc

        # readers attached to one command at once
        sleeper = next(c for c in running if c["pty"] is None)
        path = f"{base}/{sleeper['id']}/output"
        async with api.session.get(path, headers=api.auth(ALPHA)) as r1, \
                api.session.get(path, headers=api.auth(ALPHA)) as r2:
            assert (r1.status, r2.status) == (200, 200)
            status, doc = await api.call("GET", path)
            assert (status, doc["error"]["code"]) == (429, "too_many_readers"), doc

        async def reader_gone() -> bool:
            return (await api.call("GET", f"{base}/{sleeper['id']}"))[1]["readers"] == 0

        await until("the readers' slots freed after they left", reader_gone)

        # finished commands kept per sandbox: the oldest forgotten first
        for _ in range(LIMITS.finished + 1):
            quick = await api.start(sid, {"cmd": "true"}) if len(running) < LIMITS.commands else None
            if quick is not None:
                await api.ok("GET", f"{base}/{quick['id']}?wait=30")
        listed = (await api.ok("GET", base))["commands"]
        assert len([c for c in listed if c["status"] == "exited"]) == LIMITS.finished, listed
        assert first["id"] not in {c["id"] for c in listed}

    scenario(run, url)


def test_another_project_can_neither_see_nor_touch_a_command(url: str) -> None:
    async def run(api: Api) -> None:
        sid = await api.sandbox()
        theirs = await api.sandbox(token=BETA)
        cmd = await api.start(sid, {"cmd": "exec sleep 300"})
        pty = await api.start(sid, {"pty": {"cols": 80, "rows": 24}})
        for cid in (cmd["id"], pty["id"]):
            base = f"/v1/sandboxes/{sid}/commands/{cid}"
            data = {"data": base64.b64encode(b"exit\n").decode()}
            for method, path, body in (("GET", f"/v1/sandboxes/{sid}/commands", None), ("GET", base, None),
                                       ("GET", base + "/output", None), ("POST", base + "/stdin", data),
                                       ("POST", base + "/resize", {"cols": 10, "rows": 10}),
                                       ("POST", base + "/kill", None),
                                       ("POST", f"/v1/sandboxes/{sid}/commands", {"cmd": "true"})):
                status, doc = await api.call(method, path, body, token=BETA)
                assert (status, doc["error"]["code"]) == (404, "sandbox_not_found"), (method, path, doc)
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                async with terminal(api, sid, cid, token=BETA):
                    pass
            assert refused.value.status == 404
            # its own sandbox knows no such command either
            status, doc = await api.call("POST", f"/v1/sandboxes/{theirs}/commands/{cid}/kill", token=BETA)
            assert (status, doc["error"]["code"]) == (404, "command_not_found"), doc
            assert (await api.ok("GET", base))["status"] == "running"
        assert (await api.ok("GET", f"/v1/sandboxes/{theirs}/commands", token=BETA))["commands"] == []
        assert "sleep 300 " in await api.processes(sid)

    scenario(run, url)


def test_destroying_the_sandbox_ends_its_commands_first(url: str, manager: SandboxManager) -> None:
    async def run(api: Api) -> None:
        sid = await api.sandbox()
        cmd = await api.start(sid, {"cmd": "exec sleep 300"})
        pty = await api.start(sid, {"pty": {"cols": 80, "rows": 24}})
        async with terminal(api, sid, pty["id"]) as term:
            await api.ok("DELETE", f"/v1/sandboxes/{sid}", status=204)
            final = await term.until_exit()
            assert (final["type"], final["interrupted"]) == ("exit", "destroy"), final
            assert await term.closed()
        log = manager.receipts(sid)  # kept after the sandbox is gone
        ended = {r["command_id"]: r for r in log if r["action"] == "exec" and r.get("background")}
        assert {c: r["interrupted"] for c, r in ended.items()} == {cmd["id"]: "destroy", pty["id"]: "destroy"}
        assert log[-1]["action"] == "destroy", "their receipts come before the sandbox's last"
        status, doc = await api.call("GET", f"/v1/sandboxes/{sid}/commands/{cmd['id']}")
        assert status == 404, doc

    scenario(run, url)


# -- terminals ------------------------------------------------------------------------------------------
def test_a_terminal_runs_a_shell_that_echoes_resizes_exits_and_is_killed(url: str) -> None:
    async def run(api: Api) -> None:
        sid = await api.sandbox()
        pty = await api.start(sid, {"pty": {"cols": 80, "rows": 24}, "env": {"PS1": "$ "}})
        assert pty["pty"] == {"cols": 80, "rows": 24}
        typed = b""
        async with terminal(api, sid, pty["id"]) as term:
            for keys in (b"echo hi-$((6*7)); stty size; tput cols; readlink /proc/self/fd/0\n",):
                typed += keys
                await term.type(keys)
            await term.expect(rb"hi-42\r\n24 80\r\n80\r\n/dev/pts/\d+\r\n")  # a real tty, the sandbox's own
            await term.send(type="resize", cols=132, rows=40)
            keys = b"stty size\n"
            typed += keys
            await term.send(type="stdin", data=base64.b64encode(keys).decode())
            await term.expect(rb"[\r\n]40 132\r\n")
            await term.send(type="resize", cols=0, rows=40)
            rejected = await term.next()
            while rejected["type"] != "rejected":
                rejected = await term.next()
            assert rejected["error"]["field"] == "cols", rejected
            await term.send(type="eof")
            while (rejected := await term.next())["type"] != "rejected":
                pass
            assert rejected["error"]["field"] == "type"
        # the client left: the session runs on, resized over HTTP, and a new client sees it all again
        path = f"/v1/sandboxes/{sid}/commands/{pty['id']}"
        assert (await api.ok("POST", path + "/resize", {"cols": 50, "rows": 10}))["pty"] == {"cols": 50, "rows": 10}
        async with terminal(api, sid, pty["id"]) as term:
            await term.expect(rb"hi-42")  # replayed
            keys = b"stty size; exit 7\n"
            typed += keys
            await term.type(keys)
            await term.expect(rb"[\r\n]10 50\r\n")
            final = await term.until_exit()
            assert (final["exit_code"], final["interrupted"]) == (7, None), final
            assert await term.closed(), "the exit ends the socket"
        (rec,) = [r for r in await api.receipts(sid) if r.get("command_id") == pty["id"]]
        assert (rec["tty"], rec["background"], rec["exit_code"]) == (True, True, 7)
        assert (rec["stdin_bytes"], rec["stdin_blake3"]) == (len(typed), blake3.blake3(typed).hexdigest())

        # kill over the socket: the shell and what it runs end
        pty = await api.start(sid, {"pty": {"cols": 80, "rows": 24}, "cmd": ["/bin/bash"]})
        async with terminal(api, sid, pty["id"]) as term:
            await term.type(b"sleep 303\n")

            async def sleeping() -> bool:
                return "sleep 303 " in await api.processes(sid)

            await until("the terminal's sleep", sleeping)
            await term.send(type="kill")
            final = await term.until_exit()
            assert (final["interrupted"], final["signal"]) == ("killed", 9), final
            assert await term.closed()
        procs = await api.processes(sid)
        assert not [p for p in procs if p.startswith(("sleep 303", "/bin/bash"))], procs

    scenario(run, url)


# -- the service's stop and its crash ---------------------------------------------------------------------
def test_a_stop_ends_background_commands_with_their_receipts(manager: SandboxManager) -> None:
    hooks = list(manager.on_destroy)  # another service on this manager has its own
    srv = ServerThread(SandboxService(manager, AuthConfig.from_dict(TOKENS), command_limits=LIMITS))
    srv.start()
    assert len(manager.on_destroy) == len(hooks) + 1
    stopped = False

    async def run(api: Api) -> None:
        nonlocal stopped
        sid = await api.sandbox()
        cmd = await api.start(sid, {"cmd": "exec sleep 300"})
        pty = await api.start(sid, {"pty": {"cols": 80, "rows": 24}})
        async with terminal(api, sid, pty["id"]) as term:
            await term.expect(rb"[#$] $")  # the shell's prompt
            began = time.monotonic()
            stop = asyncio.ensure_future(asyncio.to_thread(srv.stop))  # aiohttp's stop: on_shutdown first
            final = await term.until_exit()
            assert (final["interrupted"], final["signal"]) == ("shutdown", 9), final
            await stop
            stopped = True
        assert time.monotonic() - began < 20, "the stop waited for the commands"
        ended = {r["command_id"]: r["interrupted"] for r in manager.receipts(sid)
                 if r["action"] == "exec" and r.get("background")}
        assert ended == {cmd["id"]: "shutdown", pty["id"]: "shutdown"}
        box = manager.get(sid)
        procs = (await asyncio.to_thread(box.exec, PROCESS_ARGS)).stdout.decode().splitlines()
        assert not [p for p in procs if p.startswith(("sleep 300", "bash", "sh -l"))], procs
        assert manager.on_destroy == hooks, "the stopped service's destroy hook is gone"
        await asyncio.to_thread(manager.destroy, sid)

    with no_sandboxes_left(manager):
        try:
            scenario(run, srv.url)
        finally:
            if not stopped:
                srv.stop()


def test_after_a_crash_reconcile_ends_background_commands_and_terminals(store_url: str, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    edge = EdgeProcess("crash", tmp_path, store_url, tokens, "--memory-reserve", "256M", "--disk-reserve", "256M",
                       token=ALPHA)
    try:
        edge.start()

        async def before(api: Api) -> tuple[str, list[str]]:
            sid = await api.sandbox()
            cmd = await api.start(sid, {"cmd": "exec sleep 304"})
            pty = await api.start(sid, {"pty": {"cols": 80, "rows": 24}})
            async with terminal(api, sid, pty["id"]) as term:
                await term.type(b"sleep 305\n")

                async def both() -> bool:
                    procs = await api.processes(sid)
                    return "sleep 304 " in procs and "sleep 305 " in procs

                await until("the background command and the terminal's sleep", both)
                edge.kill()  # nothing of the service's cleanup runs
            return sid, [cmd["id"], pty["id"]]

        found: list[Any] = []

        async def first(api: Api) -> None:
            found.extend(await before(api))

        scenario(first, edge.url)
        sid, ids = found
        edge.start()  # reconcile: the exec files of both are found, their trees killed

        async def after(api: Api) -> None:
            procs = await api.processes(sid)
            assert not [p for p in procs if p.startswith(("sleep 30", "bash", "sh -l"))], procs
            ended = {r["command_id"]: r for r in await api.receipts(sid) if r.get("background")}
            assert sorted(ended) == sorted(ids), ended
            for rec in ended.values():
                assert (rec["interrupted"], rec["signal"]) == ("restart", 9), rec
            assert ended[ids[1]]["tty"] is True
            assert ended[ids[0]]["tty"] is False
            assert (await api.ok("GET", f"/v1/sandboxes/{sid}/commands"))["commands"] == []
            bundle = edge.data_dir / "sandbox" / "run" / "bundles" / sid
            assert sorted(p.name for p in bundle.iterdir() if p.name.startswith("exec-")) == []

        scenario(after, edge.url)
    finally:
        edge.stop()
        problems = edge.clean_up()
    assert problems == [], problems
