"""A sample agent-framework program on the SDK, async and blocking.

An "agent" gets a task, works in a sandbox under a job lease (tools are commands and
files), checkpoints after its step, branches from the checkpoint, and asks a stateless
FnCall on the side.  tests/test_sdk.py runs both versions against the real service and
type-checks this file with ``mypy --strict``: every result here is typed, so reading a
field that is not there, or passing an option that does not exist, fails the suite.
"""

from __future__ import annotations

from dataclasses import dataclass

from sandbox.sdk import (
    AsyncClient,
    AsyncJob,
    AsyncSandbox,
    CallResult,
    Checkpoint,
    Client,
    CommandExitError,
    CommandResult,
    FileNotFound,
    Job,
    Lease,
    Sandbox,
    SandboxInfo,
)

TASK = "print(sum(range(10)))\n"
DOUBLE = "def double(x):\n    return 2 * x\n"


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


def _answer(result: CommandResult) -> int:
    return int(result.stdout.strip())


def _doubled(result: CallResult) -> int:
    assert isinstance(result.value, int), result
    return result.value


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
        ckpt: Checkpoint = await sb.checkpoint(name=f"{job}-step-1", labels={"step": "1"})
        async with AsyncJob(job, url=url, token=token) as handle:
            lease: Lease = await handle.renew(120)
    async with await AsyncSandbox.restore(ckpt.name, url=url, token=token, job=job) as branch:
        branch_saw = await branch.files.read("/root/task.py")
    async with AsyncClient(url=url, token=token) as client:
        caps = await client.capabilities()
        doubled = await client.call(image, function=DOUBLE, args=[21])
    assert info.limits is not None
    return Report(info.status, info.limits.memory, _answer(result), listed, failed_with, missing_raised,
                  ckpt.name, branch_saw, lease.state, caps.isolation, _doubled(doubled))


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
        ckpt: Checkpoint = sb.checkpoint(name=f"{job}-step-1", labels={"step": "1"})
        with Job(job, url=url, token=token) as handle:
            lease: Lease = handle.renew(120)
    with Sandbox.restore(ckpt.name, url=url, token=token, job=job) as branch:
        branch_saw = branch.files.read("/root/task.py")
    with Client(url=url, token=token) as client:
        caps = client.capabilities()
        doubled = client.call(image, function=DOUBLE, args=[21])
    assert info.limits is not None
    return Report(info.status, info.limits.memory, _answer(result), listed, failed_with, missing_raised,
                  ckpt.name, branch_saw, lease.state, caps.isolation, _doubled(doubled))
