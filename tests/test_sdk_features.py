"""The SDK's bindings of background commands, terminals, ports, fork and lifecycle, through the real
service with crun and the fixture image, with the async and the blocking API.

What a test checks about processes is read inside the sandbox (the fixture image has no ps: /proc),
never only from what the service says; every sandbox a test makes is killed by it (the ``url``
fixture fails a test that leaves one).
"""

from __future__ import annotations

import asyncio
import inspect
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import pytest

import sandbox.sdk as sdk
from sandbox.core.errors import InvalidField
from sandbox.core.model import Maxima, MiB
from sandbox.edge.routes.commands import CommandLimits as Limits
from sandbox.host.manager import SandboxManager
from sandbox.sdk import (
    AsyncClient,
    AsyncCommandHandle,
    AsyncSandbox,
    CheckpointNotFound,
    Client,
    CommandExitError,
    CommandNotFound,
    Conflict,
    Cut,
    InvalidRequest,
    LimitExceeded,
    Sandbox,
    SandboxClosed,
    SandboxKilled,
)
from tests.support.sandboxes import PROCESS_ARGS, REF, ServerThread, no_sandboxes_left, serving
from tests.test_sandbox_interactive import until
from tests.test_sdk import _public_methods

pytestmark = [pytest.mark.usefixtures("need_root"), pytest.mark.root("erofs", "overlay", "fuse", "cmd:crun")]

ALPHA, BETA = "alpha-features-token-0123456789", "beta-features-token-0123456789"
TOKENS = {"projects": {"alpha": {"tokens": [ALPHA], "max_sandboxes": 10},
                       "beta": {"tokens": [BETA], "max_sandboxes": 2}}}
MAXIMA = Maxima(ttl=3600.0, idle_timeout=3600.0, fork=8, output_tail=1 * MiB)
LIMITS = Limits(commands=3, terminals=2)  # small, so that the SDK meets the bound
WAIT = 60.0  # seconds for anything a loaded 2-core host does in well under 10
LINES = 100_000  # lines of 8 bytes: 800,000 bytes of stdout
NUMBERS = f"python3 -c \"import sys; sys.stdout.write(''.join(f'{{i:07d}}\\n' for i in range({LINES})))\""
EXPECTED = "".join(f"{i:07d}\n" for i in range(LINES))
SITE_PORT = 8123
SERVE = f"exec python3 -m http.server {SITE_PORT} --bind 127.0.0.1 --directory /root/site"


@pytest.fixture(scope="module")
def server(manager: SandboxManager) -> Iterator[ServerThread]:
    with serving(manager, TOKENS, reap_interval=0.3, maxima=MAXIMA, command_limits=LIMITS) as srv:
        yield srv


@pytest.fixture
def url(server: ServerThread, manager: SandboxManager) -> Iterator[str]:
    """The service URL; a sandbox a test leaves fails it."""
    with no_sandboxes_left(manager):
        yield server.url


def run(coro: Awaitable[Any]) -> Any:
    async def bounded() -> Any:
        async with asyncio.timeout(240):
            return await coro
    return asyncio.run(bounded())


class Screen:
    """What a terminal printed (its ``on_data``), and a wait for a pattern in it."""

    def __init__(self) -> None:
        self.data = b""
        self.changed = asyncio.Event()

    def __call__(self, data: bytes) -> None:
        self.data += data
        self.changed.set()

    async def expect(self, pattern: bytes) -> re.Match[bytes]:
        try:
            async with asyncio.timeout(WAIT):
                while (found := re.search(pattern, self.data)) is None:
                    self.changed.clear()
                    await self.changed.wait()
        except TimeoutError:
            raise AssertionError(f"{pattern!r} not printed within {WAIT} s: {self.data[-800:]!r}") from None
        return found


async def processes(sb: AsyncSandbox) -> list[str]:
    return (await sb.commands.run(PROCESS_ARGS)).stdout.splitlines()


# -- background commands -----------------------------------------------------------------------------
def test_a_background_command_survives_disconnect_takes_stdin_is_listed_and_killed(url: str) -> None:
    script = "echo first; read line; echo got:$line; exec sleep 301"

    async def scenario() -> None:
        async with await AsyncSandbox.create(REF, url=url, token=ALPHA) as sb:
            seen: list[str] = []
            handle = await sb.commands.run(script, background=True, on_stdout=seen.append)
            assert isinstance(handle, AsyncCommandHandle)
            assert re.fullmatch(r"cmd-[0-9a-f]{12}", handle.id)
            assert (handle.info.status, handle.info.pty, handle.info.stdin_open) == ("running", None, True)
            await until("the first line", lambda: asyncio.sleep(0, "first\n" in handle.stdout))
            await handle.disconnect()  # the command runs on
            listed = await sb.commands.list()
            assert [(c.id, c.status) for c in listed] == [(handle.id, "running")]
            assert listed[0].command == ("/bin/sh", "-c", script)

            # another session of the sandbox attaches and sees what was printed meanwhile
            async with await AsyncSandbox.connect(sb.sandbox_id, url=url, token=ALPHA) as other:
                again = await other.commands.connect(handle.id)
                await again.send_stdin("hello\n")
                await until("the echo of the input", lambda: asyncio.sleep(0, "got:hello" in again.stdout))
                assert again.stdout == "first\ngot:hello\n"
                assert "sleep 301 " in await processes(other)
                await other.close()  # keep the sandbox; its readers end with the session
                with pytest.raises(SandboxClosed):
                    await again.wait()

            # the first handle, disconnected, waits by attaching again; a kill ends the whole tree
            waiting = asyncio.ensure_future(handle.wait())
            assert await sb.commands.kill(handle.id) is True
            result = await asyncio.wait_for(waiting, WAIT)
            assert (result.exit_code, result.signal, result.interrupted) == (137, 9, "killed")
            assert result.stdout == "first\ngot:hello\n"
            assert "".join(seen) == result.stdout  # the callback got it once, across the reattach
            assert not [p for p in await processes(sb) if p.startswith("sleep 301")]
            assert await handle.kill() is False  # ended already
            assert (await sb.commands.list())[0].exit is not None

            # stdin given at the start, then more, then EOF; check applies at wait()
            cat = await sb.commands.run(["cat"], background=True, stdin="abc")
            await cat.send_stdin(b"def")
            await cat.close_stdin()
            assert (await cat.wait()).stdout == "abcdef"
            with pytest.raises(Conflict):
                await cat.send_stdin("late")
            failing = await sb.commands.run("echo out; exit 4", background=True, check=True)
            with pytest.raises(CommandExitError) as failed:
                await failing.wait()
            assert (failed.value.exit_code, failed.value.stdout) == (4, "out\n")

            # typed errors: an unknown id, a keyword that is not for a background command, the edge's bound
            with pytest.raises(CommandNotFound) as missing:
                await sb.commands.connect("cmd-0123456789ab")
            assert (missing.value.status, missing.value.code) == (404, "command_not_found")
            with pytest.raises(TypeError, match="idempotency_key"):
                await sb.commands.run("true", background=True, idempotency_key="k")  # type: ignore[call-overload]
            with pytest.raises(TypeError, match="colour"):
                await sb.commands.run("true", colour="red")  # type: ignore[call-overload]
            sleepers = [await sb.commands.run("exec sleep 302", background=True) for _ in range(LIMITS.commands)]
            with pytest.raises(LimitExceeded) as bound:
                await sb.commands.run("true", background=True)
            assert (bound.value.status, bound.value.code, bound.value.retryable) == (429, "command_limit", True)
            for sleeper in sleepers:
                assert await sleeper.kill() is True

    run(scenario())


def test_background_commands_with_the_blocking_sdk(url: str) -> None:
    with Sandbox.create(REF, url=url, token=ALPHA) as sb:
        handle = sb.commands.run("read line; echo got:$line; echo err >&2", background=True)
        handle.disconnect()
        assert [c.status for c in sb.commands.list()] == ["running"]
        again = sb.commands.connect(handle.id)
        again.send_stdin("hi\n")
        result = again.wait()
        assert (result.exit_code, result.stdout, result.stderr) == (0, "got:hi\n", "err\n")
        assert (again.stdout, again.stderr) == ("got:hi\n", "err\n")
        assert handle.wait().stdout == "got:hi\n"  # the disconnected one attaches again from where it was
        sleeper = sb.commands.run("exec sleep 303", background=True)
        assert sb.commands.kill(sleeper.id) is True
        assert sleeper.wait().interrupted == "killed"
        with pytest.raises(CommandNotFound):
            sb.commands.kill("cmd-0123456789ab")


# -- terminals ----------------------------------------------------------------------------------------------
def test_a_terminal_echoes_resizes_and_exits(url: str) -> None:
    async def scenario() -> None:
        async with await AsyncSandbox.create(REF, url=url, token=ALPHA) as sb:
            screen = Screen()
            term = await sb.pty.create(80, 24, on_data=screen, env={"PS1": "$ "})
            assert term.info.pty is not None
            assert (term.info.pty.cols, term.info.pty.rows) == (80, 24)
            await term.send_stdin(b"echo hi-$((6*7)); stty size\n")
            await screen.expect(rb"hi-42\r\n24 80\r\n")
            await term.resize(132, 40)
            assert term.info.pty is not None
            assert (term.info.pty.cols, term.info.pty.rows) == (132, 40)
            await term.send_stdin("stty size\n")
            await screen.expect(rb"[\r\n]40 132\r\n")

            # a client that leaves changes nothing; another one sees the screen again and ends it
            await term.disconnect()
            replay = Screen()
            again = await sb.pty.connect(term.id, on_data=replay)
            await replay.expect(rb"hi-42")
            await again.send_stdin("exit 7\n")
            ended = await again.wait()
            assert (ended.exit_code, ended.interrupted) == (7, None)
            assert (await term.wait()).exit_code == 7

            # a kill ends what runs on it
            sleeper = await sb.pty.create(on_data=Screen(), cmd=["/bin/bash"])
            await sleeper.send_stdin("sleep 304\n")
            await until("the terminal's sleep", lambda: _running(sb, "sleep 304 "))
            assert await sb.pty.kill(sleeper.id) is True
            assert (await sleeper.wait()).interrupted == "killed"
            with pytest.raises(InvalidRequest) as bad:
                await sb.pty.create(0, 24)
            assert bad.value.field == "pty.cols"

    run(scenario())


async def _running(sb: AsyncSandbox, prefix: str) -> bool:
    return any(p.startswith(prefix) for p in await processes(sb))


def test_a_terminal_with_the_blocking_sdk(url: str) -> None:
    with Sandbox.create(REF, url=url, token=ALPHA) as sb:
        screen: list[bytes] = []
        term = sb.pty.create(80, 24, on_data=screen.append)
        term.send_stdin(b"stty size; exit 5\n")
        assert term.wait().exit_code == 5
        assert re.search(rb"[\r\n]24 80\r\n", b"".join(screen)), b"".join(screen)[-500:]
        wide: list[bytes] = []
        term = sb.pty.create(80, 24, on_data=wide.append)
        term.resize(100, 30)  # answered before the input is sent: the shell's stty sees it
        term.send_stdin("stty size; exit\n")
        assert term.wait().exit_code == 0
        assert re.search(rb"[\r\n]30 100\r\n", b"".join(wide)), b"".join(wide)[-500:]


# -- ports --------------------------------------------------------------------------------------------------
async def _fetch(target: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    """GET ``target`` until the sandbox's server listens (a 502 until then); its status and body."""
    async with aiohttp.ClientSession() as session:
        async def answered() -> tuple[int, str] | None:
            async with session.get(target, headers=headers) as r:
                return None if r.status == 502 else (r.status, await r.text())
        return await until(f"an answer from {target}", answered)


def test_a_port_through_port_url_with_the_token_and_preview_url_without(url: str) -> None:
    async def scenario() -> None:
        async with await AsyncSandbox.create(REF, url=url, token=ALPHA) as sb:
            await sb.commands.run("mkdir /root/site", check=True)
            await sb.files.write("/root/site/hello.txt", "hello from the sandbox\n")
            served = await sb.commands.run(SERVE, background=True)
            target = sb.port_url(SITE_PORT, "/hello.txt")
            assert target == f"{url}/v1/sandboxes/{sb.sandbox_id}/ports/{SITE_PORT}/proxy/hello.txt"
            token = {"Authorization": f"Bearer {ALPHA}"}
            assert await _fetch(target, token) == (200, "hello from the sandbox\n")
            assert (await _fetch(target))[0] == 401  # the token route needs the token
            preview = await sb.preview_url(SITE_PORT, ttl=60)
            assert preview.port == SITE_PORT
            assert preview.url == url + preview.path
            assert time.time() + 50 < preview.expires <= time.time() + 61
            assert await _fetch(preview.url + "hello.txt") == (200, "hello from the sandbox\n")
            with pytest.raises(InvalidField):
                sb.port_url(70000)
            with pytest.raises(InvalidRequest) as bad:
                await sb.preview_url(SITE_PORT, ttl=-1)
            assert bad.value.field == "ttl"
            await served.kill()

    run(scenario())


def test_ports_with_the_blocking_sdk(url: str) -> None:
    with Sandbox.create(REF, url=url, token=ALPHA) as sb:
        sb.commands.run("mkdir /root/site", check=True)
        sb.files.write("/root/site/index.html", "<p>blocking</p>")
        sb.commands.run(SERVE, background=True)
        preview = sb.preview_url(SITE_PORT)
        assert preview.expires > time.time() + 200  # the service's default ttl (300 s)
        assert run(_fetch(preview.url + "index.html")) == (200, "<p>blocking</p>")
        assert run(_fetch(sb.port_url(SITE_PORT), {"Authorization": f"Bearer {ALPHA}"}))[0] == 200


# -- fork, restore with count -----------------------------------------------------------------------------
def test_a_fork_of_three_continues_from_the_same_state(url: str) -> None:
    async def scenario() -> None:
        async with await AsyncSandbox.create(REF, url=url, token=ALPHA, labels={"role": "source"},
                                             env={"STEP": "7"}) as sb:
            await sb.files.write("/root/state.txt", "step 7\n")
            forked = await sb.fork(3)
            try:
                assert forked.source == sb.sandbox_id
                assert len({f.sandbox_id for f in forked.sandboxes} | {sb.sandbox_id}) == 4
                assert forked.checkpoint.name.startswith("projects/alpha/")
                for f in forked.sandboxes:
                    assert (f.info.status, f.info.labels) == ("running", {"role": "source"})
                    assert (await f.commands.run("cat /root/state.txt; echo $STEP")).stdout == "step 7\n7\n"
                # independent from then on
                await forked.sandboxes[0].files.write("/root/state.txt", "mine\n")
                assert await forked.sandboxes[1].files.read("/root/state.txt") == "step 7\n"
                assert await sb.files.read("/root/state.txt") == "step 7\n"
                # the fork's checkpoint is an ordinary one: restored again, with count
                copies = await AsyncSandbox.restore_many(forked.checkpoint.name, 2, url=url, token=ALPHA)
                assert len({c.sandbox_id for c in copies}) == 2
                for c in copies:
                    assert await c.files.read("/root/state.txt") == "step 7\n"
                    await c.kill()
                with pytest.raises(InvalidRequest) as over:
                    await sb.fork(MAXIMA.fork + 1)
                assert over.value.field == "count"
            finally:
                for f in forked.sandboxes:
                    await f.kill()

    run(scenario())


def test_fork_and_restore_many_with_the_blocking_sdk(url: str) -> None:
    with Sandbox.create(REF, url=url, token=ALPHA) as sb:
        sb.files.write("/root/state.txt", "blocking\n")
        forked = sb.fork(2, labels={"branch": "b"})
        for f in forked.sandboxes:
            with f:
                assert f.files.read("/root/state.txt") == "blocking\n"
                assert f.info.labels == {"branch": "b"}
        copies = Sandbox.restore_many(forked.checkpoint.name, 2, url=url, token=ALPHA)
        for c in copies:
            with c:
                assert c.commands.run("cat /root/state.txt").stdout == "blocking\n"
        with Client(url=url, token=ALPHA) as client:
            client.delete_checkpoint(forked.checkpoint.name)


# -- lifecycle -------------------------------------------------------------------------------------------
def test_set_timeout_shortens_and_the_reaper_destroys_it(url: str) -> None:
    async def scenario() -> None:
        sb = await AsyncSandbox.create(REF, url=url, token=ALPHA, ttl=600)
        try:
            with pytest.raises(InvalidRequest) as bad:
                await sb.set_timeout(MAXIMA.ttl + 1)  # past the edge's longest lifetime
            assert bad.value.field == "ttl"
            longer = await sb.set_timeout(900)
            assert longer.ttl is not None
            assert 900 <= longer.ttl < 960
            info = await sb.set_timeout(1.5)
            assert info is sb.info
            assert info.expires is not None
            assert abs(info.expires - (time.time() + 1.5)) < 2
            started = time.monotonic()

            async def gone() -> bool:
                try:
                    await sb.refresh()
                except SandboxKilled:
                    return True
                return False

            await until("the reaper's destroy", gone, within=20)
            assert time.monotonic() - started < 15
        finally:
            await sb.kill()  # gone already: fine

    run(scenario())


def test_metrics_list_filters_checkpoints(url: str) -> None:
    async def scenario() -> None:
        async with await AsyncSandbox.create(REF, url=url, token=ALPHA, labels={"tier": "web"}) as web, \
                await AsyncSandbox.create(REF, url=url, token=ALPHA, labels={"tier": "db"}) as db:
            before = await web.get_metrics()
            assert (before.sandbox, before.status) == (web.sandbox_id, "running")
            assert before.memory.limit == 512 * MiB
            assert before.pids.current is not None
            assert before.pids.current >= 1
            assert before.disk is not None
            assert before.disk.where == "upper"
            await web.commands.run("head -c 8M /dev/urandom > /root/blob && sync")
            after = await web.get_metrics()
            assert after.commands.count == before.commands.count + 1
            assert after.commands.last is not None
            assert after.commands.last["exit_code"] == 0
            assert after.disk is not None
            assert after.disk.used is not None
            assert before.disk.used is not None
            assert after.disk.used - before.disk.used >= 7 * MiB

            await db.pause()
            listing = {"url": url, "token": ALPHA}
            assert {s.id for s in await AsyncSandbox.list(**listing)} == {web.sandbox_id, db.sandbox_id}
            assert [s.id for s in await AsyncSandbox.list(**listing, labels={"tier": "web"})] == [web.sandbox_id]
            assert [s.id for s in await AsyncSandbox.list(**listing, state="paused")] == [db.sandbox_id]
            assert await AsyncSandbox.list(**listing, labels={"tier": "db"}, state="running") == []
            assert await AsyncSandbox.list(url=url, token=BETA, labels={"tier": "web"}) == []
            with pytest.raises(InvalidField) as bad:
                await AsyncSandbox.list(**listing, state="sleeping")  # type: ignore[arg-type]
            assert bad.value.field == "state"
            await db.resume()

            ckpt = await web.checkpoint(name="features:1", labels={"step": "1"})
            async with AsyncClient(url=url, token=ALPHA) as client, AsyncClient(url=url, token=BETA) as theirs:
                listed = {c.name: c for c in await client.checkpoints()}
                assert listed[ckpt.name].digest == ckpt.digest
                assert listed[ckpt.name].labels == {"tier": "web", "step": "1"}
                assert listed[ckpt.name].layers == ckpt.layers
                assert ckpt.name not in {c.name for c in await theirs.checkpoints()}
                with pytest.raises(CheckpointNotFound):
                    await theirs.delete_checkpoint(ckpt.name)
                await client.delete_checkpoint(ckpt.name)
                assert ckpt.name not in {c.name for c in await client.checkpoints()}
                with pytest.raises(CheckpointNotFound) as again:
                    await client.delete_checkpoint(ckpt.name)
                assert (again.value.status, again.value.code) == (404, "checkpoint_not_found")

    run(scenario())


def test_lifecycle_with_the_blocking_sdk(url: str) -> None:
    with Sandbox.create(REF, url=url, token=ALPHA, labels={"sync": "yes"}) as sb:
        assert sb.get_metrics().memory.limit == 512 * MiB
        assert [s.id for s in Sandbox.list(url=url, token=ALPHA, labels={"sync": "yes"})] == [sb.sandbox_id]
        ckpt = sb.checkpoint(name="features-sync:1")
        with Client(url=url, token=ALPHA) as client:
            assert ckpt.name in {c.name for c in client.checkpoints()}
            client.delete_checkpoint(ckpt.name)
        assert sb.set_timeout(120).ttl is not None


# -- output kept at the tail, rerun_if_interrupted ---------------------------------------------------------
def test_keep_tail_returns_the_last_bytes_and_reports_the_cut(url: str) -> None:
    cap = 8000

    async def scenario() -> None:
        async with await AsyncSandbox.create(REF, url=url, token=ALPHA) as sb:
            heard: list[Cut] = []
            streamed: list[str] = []
            tail = await sb.commands.run(NUMBERS, output_cap=cap, keep="tail", on_cut=heard.append,
                                         on_stdout=streamed.append)
            assert tail.stdout == EXPECTED[:cap] + EXPECTED[-cap:]
            assert "".join(streamed) == tail.stdout
            cut = Cut("stdout", cap, len(EXPECTED) - 2 * cap, "tail")
            assert tail.cuts == (cut,)
            assert heard == [cut]
            assert (tail.truncated, tail.exit_code) == (True, 0)
            head = await sb.commands.run(NUMBERS + " >&2", output_cap=cap)
            assert head.stderr == EXPECTED[:cap]
            assert head.cuts == (Cut("stderr", cap, len(EXPECTED) - cap, "head"),)
            assert (await sb.commands.run("echo short")).cuts == ()
            with pytest.raises(InvalidRequest) as bad:
                await sb.commands.run("true", keep="end")  # type: ignore[typeddict-item]
            assert bad.value.field == "keep"

    run(scenario())
    with Sandbox.create(REF, url=url, token=ALPHA) as sb:
        tail = sb.commands.run("seq 1 20000", output_cap=100, keep="tail")
        assert tail.stdout.endswith("19999\n20000\n")
        assert [c.keep for c in tail.cuts] == ["tail"]


def test_rerun_if_interrupted_runs_an_interrupted_keyed_command_again(url: str) -> None:
    # the first run counts itself and sleeps (it is cut short); a later run counts itself and ends
    cmd = "echo run >> /root/runs; n=$(wc -l < /root/runs); echo started; [ $n -gt 1 ] || sleep 300; echo run $n"

    async def scenario(sb: AsyncSandbox) -> None:
        started = asyncio.Event()
        first = asyncio.ensure_future(sb.commands.run(cmd, idempotency_key="job-1",
                                                      on_stdout=lambda _: started.set()))
        await asyncio.wait_for(started.wait(), WAIT)
        first.cancel()  # the client goes away: the service kills it, "disconnect"
        with pytest.raises(asyncio.CancelledError):
            await first

        async def recorded() -> bool:
            return bool(await sb.receipts(action="exec", idempotency_key="job-1"))

        await until("the interrupted run's receipt", recorded)
        replayed = await sb.commands.run(cmd, idempotency_key="job-1")
        assert (replayed.replayed, replayed.interrupted) == (True, "disconnect")

    with Sandbox.create(REF, url=url, token=ALPHA) as sb:
        run(_on_another_session(sb.sandbox_id, url, scenario))
        rerun = sb.commands.run(cmd, idempotency_key="job-1", rerun_if_interrupted=True)
        assert (rerun.replayed, rerun.interrupted, rerun.exit_code) == (False, None, 0)
        assert rerun.stdout == "started\nrun 2\n"
        done = sb.commands.run(cmd, idempotency_key="job-1", rerun_if_interrupted=True)
        assert (done.replayed, done.stdout) == (True, "started\nrun 2\n")
        assert sb.commands.run("wc -l < /root/runs").stdout == "2\n"
        with pytest.raises(InvalidRequest) as bad:
            sb.commands.run("true", rerun_if_interrupted=True)
        assert bad.value.field == "rerun_if_interrupted"


async def _on_another_session(sid: str, url: str, fn: Callable[[AsyncSandbox], Awaitable[None]]) -> None:
    other = await AsyncSandbox.connect(sid, url=url, token=ALPHA)
    try:
        await fn(other)
    finally:
        await other.close()


# -- the API's shape -----------------------------------------------------------------------------------------
PAIRS = [(sdk.AsyncCommandHandle, sdk.CommandHandle), (sdk.AsyncPty, sdk.Pty), (sdk.AsyncPtyHandle, sdk.PtyHandle)]


@pytest.mark.parametrize(("async_cls", "sync_cls"), PAIRS, ids=[s.__name__ for _, s in PAIRS])
def test_the_new_blocking_classes_are_their_async_twins(async_cls: type[Any], sync_cls: type[Any]) -> None:
    assert sync_cls._twin is async_cls
    async_methods, sync_methods = _public_methods(async_cls), _public_methods(sync_cls)
    assert sorted(sync_methods) == sorted(async_methods)
    for name, fn in async_methods.items():
        assert inspect.signature(fn).parameters == inspect.signature(sync_methods[name]).parameters, name
        assert sync_methods[name].__doc__ == fn.__doc__, name
    for name in ("fork", "restore_many", "list", "set_timeout", "get_metrics", "port_url", "preview_url"):
        assert getattr(sdk.Sandbox, name).__doc__ == getattr(sdk.AsyncSandbox, name).__doc__, name
