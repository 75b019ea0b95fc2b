"""A sample agent-framework program on the SDK, async and blocking.

An "agent" gets a task, works in a sandbox under a job lease (tools are commands and
files), serves its work on a port in the background and shares a preview URL of it, opens a
terminal, checkpoints after its step, branches from the checkpoint, forks, and asks a
stateless FnCall on the side.  tests/test_sdk.py runs both versions against the real service and
type-checks this file with ``mypy --strict``: every result here is typed, so reading a
field that is not there, or passing an option that does not exist, fails the suite.
"""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import aiohttp

from sandbox.sdk import (
    AsyncClient,
    AsyncCommandHandle,
    AsyncJob,
    AsyncPtyHandle,
    AsyncSandbox,
    CallResult,
    Checkpoint,
    Client,
    CommandExit,
    CommandExitError,
    CommandHandle,
    CommandResult,
    FileNotFound,
    ForkResult,
    Job,
    Lease,
    PreviewUrl,
    PtyHandle,
    Sandbox,
    SandboxInfo,
)

TASK = "print(sum(range(10)))\n"
DOUBLE = "def double(x):\n    return 2 * x\n"
PORT = 8000
SERVE = f"exec python3 -m http.server {PORT} --bind 127.0.0.1 --directory /root"
SERVER_START = 60.0  # seconds the sandbox's server may take to listen


@dataclass(frozen=True)
class Report:
    """What one agent run saw, for the test to check."""

    status: str
    memory: int
    answer: int
    listed: tuple[str, ...]
    failed_with: int
    missing_raised: bool
    checkpoint: str
    branch_saw: str
    lease_state: str
    isolation: tuple[str, ...]
    doubled: int
    served: str
    server_killed: bool
    terminal_exit: int | None
    fork_saw: str


def _answer(result: CommandResult) -> int:
    return int(result.stdout.strip())


def _doubled(result: CallResult) -> int:
    assert isinstance(result.value, int), result
    return result.value


async def _fetch(preview: PreviewUrl, name: str) -> str:
    """GET ``name`` under the preview URL (no token), once the sandbox's server listens."""
    deadline = time.monotonic() + SERVER_START
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(preview.url + name) as r:
                if r.status != 502 or time.monotonic() > deadline:  # 502: nothing listens yet
                    r.raise_for_status()
                    return await r.text()
            await asyncio.sleep(0.1)


def _fetch_blocking(preview: PreviewUrl, name: str) -> str:
    """The same with the standard library, for the blocking agent."""
    deadline = time.monotonic() + SERVER_START
    while True:
        try:
            with urllib.request.urlopen(preview.url + name, timeout=30) as r:
                return str(r.read().decode())
        except urllib.error.HTTPError as exc:
            if exc.code != 502 or time.monotonic() > deadline:
                raise
        time.sleep(0.1)


async def async_agent(url: str, token: str, image: str, job: str) -> Report:
    """The agent on the async API."""
    async with await AsyncSandbox.create(image, url=url, token=token, job=job, memory=256 << 20,
                                         env={"TASK": "sum"}, labels={"agent": "sample"}) as sb:
        info: SandboxInfo = sb.info
        await sb.files.write("/root/task.py", TASK)
        result = await sb.commands.run(["python3", "/root/task.py"], check=True)
        listed = tuple(e.name for e in await sb.files.list("/root") if e.type == "file")
        try:
            await sb.commands.run("echo trying >&2; exit 3", check=True)
            failed_with = 0
        except CommandExitError as exc:
            failed_with = exc.exit_code
        try:
            await sb.files.read("/root/no-such-file")
            missing_raised = False
        except FileNotFound:
            missing_raised = True
        server: AsyncCommandHandle = await sb.commands.run(SERVE, background=True)
        preview: PreviewUrl = await sb.preview_url(PORT, ttl=120)
        served = await _fetch(preview, "task.py")
        server_killed = await server.kill()
        screen: list[bytes] = []
        term: AsyncPtyHandle = await sb.pty.create(80, 24, on_data=screen.append)
        await term.send_stdin("exit 4\n")
        ended: CommandExit = await term.wait()
        ckpt: Checkpoint = await sb.checkpoint(name=f"{job}-step-1", labels={"step": "1"})
        async with AsyncJob(job, url=url, token=token) as handle:
            lease: Lease = await handle.renew(120)
        forks: ForkResult[AsyncSandbox] = await sb.fork(1)
    async with forks.sandboxes[0] as fork:
        fork_saw = await fork.files.read("/root/task.py")
    async with await AsyncSandbox.restore(ckpt.name, url=url, token=token, job=job) as branch:
        branch_saw = await branch.files.read("/root/task.py")
    async with AsyncClient(url=url, token=token) as client:
        caps = await client.capabilities()
        doubled = await client.call(image, function=DOUBLE, args=[21])
    assert info.limits is not None
    return Report(info.status, info.limits.memory, _answer(result), listed, failed_with, missing_raised,
                  ckpt.name, branch_saw, lease.state, caps.isolation, _doubled(doubled), served, server_killed,
                  ended.exit_code, fork_saw)


def sync_agent(url: str, token: str, image: str, job: str) -> Report:
    """The same agent on the blocking API: the same calls without ``await``."""
    with Sandbox.create(image, url=url, token=token, job=job, memory=256 << 20,
                        env={"TASK": "sum"}, labels={"agent": "sample"}) as sb:
        info: SandboxInfo = sb.info
        sb.files.write("/root/task.py", TASK)
        result = sb.commands.run(["python3", "/root/task.py"], check=True)
        listed = tuple(e.name for e in sb.files.list("/root") if e.type == "file")
        try:
            sb.commands.run("echo trying >&2; exit 3", check=True)
            failed_with = 0
        except CommandExitError as exc:
            failed_with = exc.exit_code
        try:
            sb.files.read("/root/no-such-file")
            missing_raised = False
        except FileNotFound:
            missing_raised = True
        server: CommandHandle = sb.commands.run(SERVE, background=True)
        preview: PreviewUrl = sb.preview_url(PORT, ttl=120)
        served = _fetch_blocking(preview, "task.py")
        server_killed = server.kill()
        screen: list[bytes] = []
        term: PtyHandle = sb.pty.create(80, 24, on_data=screen.append)
        term.send_stdin("exit 4\n")
        ended: CommandExit = term.wait()
        ckpt: Checkpoint = sb.checkpoint(name=f"{job}-step-1", labels={"step": "1"})
        with Job(job, url=url, token=token) as handle:
            lease: Lease = handle.renew(120)
        forks: ForkResult[Sandbox] = sb.fork(1)
    with forks.sandboxes[0] as fork:
        fork_saw = fork.files.read("/root/task.py")
    with Sandbox.restore(ckpt.name, url=url, token=token, job=job) as branch:
        branch_saw = branch.files.read("/root/task.py")
    with Client(url=url, token=token) as client:
        caps = client.capabilities()
        doubled = client.call(image, function=DOUBLE, args=[21])
    assert info.limits is not None
    return Report(info.status, info.limits.memory, _answer(result), listed, failed_with, missing_raised,
                  ckpt.name, branch_saw, lease.state, caps.isolation, _doubled(doubled), served, server_killed,
                  ended.exit_code, fork_saw)
