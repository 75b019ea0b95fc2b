"""The SDK as agent frameworks use it, through the real service with crun and the fixture image.

Every error class is provoked by the condition that causes it (a missing image, a destroyed
sandbox, a path leaving the sandbox, a full quota, a host without room, a service that is
gone...), with the async and the blocking API, checking its fields and that nothing was
created.  The blocking API is checked to be the async one, method for method; a sample
agent program (tests/sdk_sample.py) runs both ways and passes ``mypy --strict``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_type_hints

import aiohttp
import pytest

import sandbox.sdk as sdk
from sandbox.core import errors
from sandbox.core.errors import InvalidField
from sandbox.core.model import POOL_LABEL, Maxima, SandboxOptions
from sandbox.edge.app import AuthConfig, SandboxService
from sandbox.host.manager import SandboxManager
from sandbox.pools.fncall import FnCalls
from sandbox.sdk import (
    AsyncClient,
    AsyncJob,
    AsyncSandbox,
    CapacityExceeded,
    CheckpointNotFound,
    Client,
    CommandExitError,
    FileAccessDenied,
    FileNotFound,
    ImageNotFound,
    InvalidRequest,
    Job,
    QuotaExceeded,
    RunNotFound,
    Sandbox,
    SandboxClosed,
    SandboxKilled,
    SandboxNotFound,
    ServiceUnavailable,
)
from sandbox.sdk import blocking as sdk_blocking
from sandbox.sdk import errors as sdk_errors
from sandbox.sdk import types as sdk_types
from tests import sdk_sample
from tests.support.sandboxes import REF, ServerThread, no_sandboxes_left, serving

pytestmark = [pytest.mark.usefixtures("need_root"), pytest.mark.root("erofs", "overlay", "fuse", "cmd:crun")]

ALPHA, BETA = "alpha-sdk-token-0123456789", "beta-sdk-token-0123456789"
TOKENS = {"projects": {"alpha": {"tokens": [ALPHA], "max_sandboxes": 4},
                       "beta": {"tokens": [BETA], "max_sandboxes": 1}}}
MAX_CPU = 4.0  # this edge's ceiling: cpu=8 is a valid option the service refuses
HUGE = 1 << 45  # 32 TiB: under this edge's memory ceiling, far beyond any host's MemAvailable
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server(manager: SandboxManager) -> Iterator[ServerThread]:
    with serving(manager, TOKENS, fncall_pool=1, maxima=Maxima(cpu=MAX_CPU, memory=1 << 46)) as srv:
        yield srv


@pytest.fixture
def url(server: ServerThread, manager: SandboxManager) -> Iterator[str]:
    """The service URL; every sandbox (but FnCall's warm ones) a test leaves fails it."""
    with no_sandboxes_left(manager):
        yield server.url


def closed_port() -> str:
    """A URL nothing listens on (the port was just free, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def own(manager: SandboxManager) -> list[str]:
    """The sandboxes on the host but FnCall's warm pools."""
    return [st.id for st in manager.list() if POOL_LABEL not in st.labels]


@contextlib.contextmanager
def nothing_created(manager: SandboxManager) -> Iterator[None]:
    before = set(own(manager))
    yield
    assert set(own(manager)) == before, "a refused request created a sandbox"


def check(exc: BaseException, cls: type[BaseException], **fields: Any) -> None:
    assert type(exc) is cls, f"{type(exc).__name__} is not {cls.__name__}: {exc}"
    for name, value in fields.items():
        assert getattr(exc, name) == value, (name, getattr(exc, name), value)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# -- not found: images, checkpoints, runs, FnCall -----------------------------------------------------
def test_missing_refs_are_typed_and_create_nothing(url: str, server: ServerThread,
                                                   manager: SandboxManager) -> None:
    async def scenario() -> None:
        for ref in ("img/nope", f"{REF.partition(':')[0]}:no-such-tag", "blake3:" + "0" * 64):
            with pytest.raises(ImageNotFound) as err:
                await AsyncSandbox.create(ref, url=url, token=ALPHA)
            check(err.value, ImageNotFound, status=404, code="image_not_found", retryable=False)
            assert ref in str(err.value)
            assert isinstance(err.value, errors.ImageNotFound)  # the manager-side class catches it too
        with pytest.raises(CheckpointNotFound) as ckpt:
            await AsyncSandbox.restore("no-such-checkpoint", url=url, token=ALPHA)
        check(ckpt.value, CheckpointNotFound, status=404, code="checkpoint_not_found")
        assert isinstance(ckpt.value, ImageNotFound)
        with pytest.raises(RunNotFound) as run_:
            await AsyncJob.resume_run("projects/alpha/runs/no-such-job:latest", url=url, token=ALPHA)
        check(run_.value, RunNotFound, status=404, code="run_not_found")
        async with AsyncClient(url=url, token=ALPHA) as client:
            with pytest.raises(ImageNotFound) as call:
                await client.call("img/nope", "true")
        check(call.value, ImageNotFound, status=404, code="image_not_found", retryable=False)

    with nothing_created(manager):
        run(scenario())
    calls = server.service.context.fncalls  # FnCall made no pool for the missing image
    assert calls is None or all("nope" not in ref for ref in calls.stats())
    assert [st.labels[POOL_LABEL] for st in manager.list() if POOL_LABEL in st.labels
            and "nope" in st.labels[POOL_LABEL]] == []


def test_another_projects_checkpoint_answers_as_a_missing_one(url: str) -> None:
    async def scenario() -> None:
        async with await AsyncSandbox.create(REF, url=url, token=ALPHA) as sb:
            ckpt = await sb.checkpoint(name="private-step")
        answers = []
        for ref in (ckpt.name, ckpt.name.replace("private-step", "no-such-step")):
            with pytest.raises(CheckpointNotFound) as err:
                await AsyncSandbox.restore(ref, url=url, token=BETA)
            answers.append((err.value.status, err.value.code, err.value.message.replace(ref, "<ref>")))
        assert answers[0] == answers[1]

    run(scenario())


def test_fncalls_refuses_a_missing_image_at_once_and_keeps_no_pool(manager: SandboxManager) -> None:
    async def scenario() -> None:
        async with FnCalls(manager, size=1) as calls:
            started = time.monotonic()
            with pytest.raises(errors.ImageNotFound, match="img/absent"):
                await calls.call("img/absent", "true")
            assert time.monotonic() - started < 10
            assert calls.stats() == {}  # no pool left to retry in the background
            assert not getattr(errors.ImageNotFound, "retryable", False)

    with nothing_created(manager):
        run(scenario())
    assert [st for st in manager.list() if POOL_LABEL in st.labels and "absent" in st.labels[POOL_LABEL]] == []


# -- sandboxes and files -------------------------------------------------------------------------------
def test_a_destroyed_sandbox_a_missing_file_and_a_path_escape_are_told_apart(
        url: str, manager: SandboxManager) -> None:
    async def scenario() -> None:
        sb = await AsyncSandbox.create(REF, url=url, token=ALPHA)
        try:
            with pytest.raises(FileNotFound) as missing:
                await sb.files.read("/root/nope")
            check(missing.value, FileNotFound, status=404, code="file_not_found")
            assert isinstance(missing.value, FileNotFoundError)
            assert not await sb.files.exists("/root/nope")
            with pytest.raises(FileAccessDenied) as escape:
                await sb.files.read("/proc/1/root/etc/passwd")  # the host's, were it followed
            check(escape.value, FileAccessDenied, status=403, code="path_escape")
            assert isinstance(escape.value, PermissionError)
            assert (await sb.commands.run("echo still here")).stdout == "still here\n"
        finally:
            other = await AsyncSandbox.connect(sb.sandbox_id, url=url, token=ALPHA)
            await other.kill()  # destroyed by another client while this session holds it
        for call in (sb.commands.run("true"), sb.files.read("/etc/hostname"), sb.refresh(),
                     sb.files.exists("/etc/hostname")):
            with pytest.raises(SandboxKilled) as killed:
                await call
            check(killed.value, SandboxKilled, status=404, code="sandbox_not_found")
            assert isinstance(killed.value, SandboxNotFound)
            assert isinstance(killed.value, errors.SandboxNotFound)
        with pytest.raises(SandboxNotFound) as unknown:  # an id nobody holds: not found, not "killed"
            await AsyncSandbox.connect(sb.sandbox_id, url=url, token=ALPHA)
        check(unknown.value, SandboxNotFound, status=404, code="sandbox_not_found")
        await sb.kill()  # a sandbox already gone is fine

    run(scenario())


def test_a_sandbox_destroyed_under_a_running_command(url: str, manager: SandboxManager) -> None:
    async def scenario() -> None:
        sb = await AsyncSandbox.create(REF, url=url, token=ALPHA)
        started = asyncio.Event()
        running = asyncio.create_task(sb.commands.run("echo started; sleep 60",
                                                      on_stdout=lambda _: started.set()))
        await asyncio.wait_for(started.wait(), 30)
        await asyncio.to_thread(manager.destroy, sb.sandbox_id)  # e.g. the reaper
        result = await asyncio.wait_for(running, 30)  # the stream ends at once, honestly: SIGKILL
        assert (result.exit_code, result.signal, result.stdout) == (137, 9, "started\n")
        assert result.interrupted == "destroy"  # the stream says why; the next request too
        with pytest.raises(SandboxKilled):
            await sb.commands.run("true")
        await sb.kill()

    run(scenario())


def test_use_after_kill_or_close_is_refused_before_any_request(url: str, manager: SandboxManager) -> None:
    async def scenario() -> None:
        sb = await AsyncSandbox.create(REF, url=url, token=ALPHA)
        await sb.kill()
        for call in (sb.commands.run("true"), sb.files.write("/root/x", "x"), sb.refresh(), sb.pause()):
            with pytest.raises(SandboxClosed, match="killed by this session"):
                await call
        await sb.kill()  # again, and close(): nothing to do
        await sb.close()
        kept = await AsyncSandbox.create(REF, url=url, token=ALPHA)
        await kept.close()
        with pytest.raises(SandboxClosed, match="keeps running") as closed:
            await kept.commands.run("true")
        assert isinstance(closed.value, RuntimeError)  # what "Session is closed" used to be
        assert kept.sandbox_id in own(manager)  # close() left it running
        again = await AsyncSandbox.connect(kept.sandbox_id, url=url, token=ALPHA)
        await again.kill()
        job = AsyncJob("closed-job", url=url, token=ALPHA)
        await job.close()
        with pytest.raises(SandboxClosed, match="closed-job"):
            await job.renew()

    run(scenario())


def test_check_raises_command_exit_error_with_the_result(url: str) -> None:
    async def scenario() -> None:
        async with await AsyncSandbox.create(REF, url=url, token=ALPHA) as sb:
            with pytest.raises(CommandExitError) as err:
                await sb.commands.run("echo partial; echo broke >&2; exit 3", check=True)
            check(err.value, CommandExitError, exit_code=3, stdout="partial\n", stderr="broke\n")
            assert err.value.result.exit_code == 3
            assert "exit" in str(err.value)
            assert "broke" in str(err.value)
            with pytest.raises(CommandExitError) as killed:
                await sb.commands.run("kill -9 $$", check=True)
            assert (killed.value.exit_code, killed.value.result.signal) == (137, 9)
            assert (await sb.commands.run("exit 3")).exit_code == 3  # without check: reported, not raised
            assert (await sb.commands.run("true", check=True)).exit_code == 0

    run(scenario())


# -- admission ----------------------------------------------------------------------------------------
def test_quota_and_capacity_carry_retry_after_and_resources(url: str, manager: SandboxManager) -> None:
    async def scenario() -> None:
        async with await AsyncSandbox.create(REF, url=url, token=BETA):  # beta's quota is 1
            with nothing_created(manager):
                with pytest.raises(QuotaExceeded) as quota:
                    await AsyncSandbox.create(REF, url=url, token=BETA)
        check(quota.value, QuotaExceeded, status=429, code="quota_exceeded", retryable=True, retry_after=5.0,
              resources=("sandboxes",))
        assert "1 of 1" in str(quota.value)
        with nothing_created(manager):
            with pytest.raises(CapacityExceeded) as full:
                await AsyncSandbox.create(REF, url=url, token=ALPHA, memory=HUGE)
        check(full.value, CapacityExceeded, status=503, code="capacity", retryable=True, resources=("memory",))
        assert full.value.retry_after is not None
        assert full.value.retry_after >= 1
        assert "memory" in str(full.value)

    run(scenario())


# -- bad fields ---------------------------------------------------------------------------------------
def test_bad_fields_name_the_field(url: str, manager: SandboxManager) -> None:
    nowhere = closed_port()  # a request would be ServiceUnavailable: these never get that far

    async def scenario() -> None:
        with pytest.raises(InvalidField) as local:
            await AsyncSandbox.create(REF, url=nowhere, token=ALPHA, memory=1)
        assert (type(local.value), local.value.field) == (InvalidField, "memory")
        with pytest.raises(TypeError, match="memroy"):
            await AsyncSandbox.create(REF, url=nowhere, token=ALPHA, memroy=1 << 30)  # type: ignore[call-arg]
        with pytest.raises(InvalidField) as rules:
            await AsyncSandbox.create(REF, url=nowhere, token=ALPHA, network=[{"cidr": "10.0.0.0/33"}])
        assert rules.value.field == "network"
        with pytest.raises(InvalidRequest) as edge:  # a valid option past this edge's ceiling
            await AsyncSandbox.create(REF, url=url, token=ALPHA, cpu=2 * MAX_CPU)
        check(edge.value, InvalidRequest, status=400, code="invalid_field", field="cpu", retryable=False)
        assert isinstance(edge.value, InvalidField)  # one except catches both kinds
        async with await AsyncSandbox.create(REF, url=url, token=ALPHA) as sb:
            with pytest.raises(InvalidRequest) as timeout:
                await sb.commands.run("true", timeout=-1)
            check(timeout.value, InvalidRequest, field="timeout")

    with nothing_created(manager):
        run(scenario())


# -- the service is gone --------------------------------------------------------------------------------
def test_a_service_that_is_not_there_is_service_unavailable(manager: SandboxManager) -> None:
    nowhere = closed_port()

    async def scenario() -> None:
        with pytest.raises(ServiceUnavailable) as refused:
            await AsyncSandbox.create(REF, url=nowhere, token=ALPHA)
        assert isinstance(refused.value, ConnectionError)
        assert refused.value.retryable
        assert refused.value.url == nowhere
        assert isinstance(refused.value.__cause__, aiohttp.ClientConnectionError)
        with pytest.raises(ServiceUnavailable):
            await sdk.capabilities(url=nowhere, token=ALPHA)
        with pytest.raises(ServiceUnavailable):
            await AsyncJob.resume_run("runs/x:latest", url=nowhere, token=ALPHA)

    run(scenario())
    # a service stopped under a live session
    with no_sandboxes_left(manager):
        srv = ServerThread(SandboxService(manager, AuthConfig.from_dict(TOKENS)))
        srv.start()
        try:
            sb = Sandbox.create(REF, url=srv.url, token=ALPHA)
        finally:
            srv.stop()
        with pytest.raises(ServiceUnavailable):
            sb.commands.run("true")
        with pytest.raises(ServiceUnavailable):
            sb.kill()
        with pytest.raises(SandboxClosed, match="may still run"):  # the kill closed the session all the same
            sb.refresh()
        assert sb.sandbox_id in own(manager)  # the kill never reached it
        manager.destroy(sb.sandbox_id)


# -- the blocking API: the same errors ---------------------------------------------------------------------
def test_the_blocking_sdk_raises_the_same_errors(url: str, manager: SandboxManager) -> None:
    nowhere = closed_port()
    with nothing_created(manager):
        with pytest.raises(ImageNotFound):
            Sandbox.create("img/nope", url=url, token=ALPHA)
        with pytest.raises(CheckpointNotFound):
            Sandbox.restore("no-such-checkpoint", url=url, token=ALPHA)
        with pytest.raises(RunNotFound):
            Job.resume_run("projects/alpha/runs/no-such-job:latest", url=url, token=ALPHA)
        with Client(url=url, token=ALPHA) as client, pytest.raises(ImageNotFound):
            client.call("img/nope", "true")
        with pytest.raises(CapacityExceeded) as full:
            Sandbox.create(REF, url=url, token=ALPHA, memory=HUGE)
        assert (full.value.resources, full.value.retry_after is not None) == (("memory",), True)
        with pytest.raises(InvalidRequest) as edge:
            Sandbox.create(REF, url=url, token=ALPHA, cpu=2 * MAX_CPU)
        assert edge.value.field == "cpu"
        with pytest.raises(InvalidField) as local:
            Sandbox.create(REF, url=nowhere, token=ALPHA, pids=1)
        assert local.value.field == "pids"
        with pytest.raises(ServiceUnavailable):
            Sandbox.create(REF, url=nowhere, token=ALPHA)
        with pytest.raises(ServiceUnavailable):
            Client(url=nowhere, token=ALPHA).capabilities()
    with Sandbox.create(REF, url=url, token=BETA) as held:
        with pytest.raises(QuotaExceeded) as quota:
            Sandbox.create(REF, url=url, token=BETA)
        assert quota.value.retry_after == 5.0
        with pytest.raises(FileNotFound):
            held.files.read("/root/nope")
        with pytest.raises(FileAccessDenied):
            held.files.stat("/proc/1/root/etc")
        with pytest.raises(CommandExitError) as failed:
            held.commands.run("exit 7", check=True)
        assert failed.value.exit_code == 7
        with pytest.raises(InvalidRequest) as timeout:
            held.commands.run("true", timeout=-1)
        assert timeout.value.field == "timeout"
        manager.destroy(held.sandbox_id)
        with pytest.raises(SandboxKilled):
            held.refresh()
    # the with block's kill found it gone (fine) and closed the loop: the object refuses now
    with pytest.raises(SandboxClosed, match="killed by this session"):
        held.commands.run("true")
    with pytest.raises(SandboxClosed):
        held.files.read("/etc/hostname")
    held.kill()  # again: nothing to do
    job = Job("sync-job", url=url, token=ALPHA)
    job.close()
    with pytest.raises(SandboxClosed, match="sync-job"):
        job.pause()


def test_the_blocking_sdk_is_not_for_a_running_loop(url: str) -> None:
    async def inside() -> None:
        with pytest.raises(errors.SandboxError, match="running event loop"):
            Sandbox.create(REF, url=url, token=ALPHA)

    run(inside())


# -- results ----------------------------------------------------------------------------------------------
def test_results_are_typed(url: str) -> None:
    with Sandbox.create(REF, url=url, token=ALPHA, job="typed", network=[], labels={"k": "v"}) as sb:
        info = sb.info
        assert (info.id, info.status, info.image, info.job, info.labels) == (sb.sandbox_id, "running", REF,
                                                                            "typed", {"k": "v"})
        assert info.limits is not None
        assert info.limits.memory == SandboxOptions().memory
        assert info.network is not None
        assert info.network.policy is not None
        assert info.network.policy.rules == ()
        policy = sb.set_network([{"cidr": "203.0.113.0/24", "ports": 80}])
        assert [dict(r)["cidr"] for r in policy.rules] == ["203.0.113.0/24"]
        assert sb.refresh().network is not None
        sb.files.write("/root/a.txt", "abc")
        st = sb.files.stat("/root/a.txt")
        assert (st.path, st.type, st.size, st.mode) == ("/root/a.txt", "file", 3, 0o644)
        assert "a.txt" in [e.name for e in sb.files.list("/root")]
        paused = sb.pause()
        assert paused.receipt
        assert sb.resume().status == "running"
        ckpt = sb.checkpoint()
        assert ckpt.name.startswith("projects/alpha/")
        assert ckpt.digest.startswith("blake3:")
        receipts = sb.receipts()
        assert [r.action for r in receipts][:1] == ["create"]
        assert all(r.sandbox == sb.sandbox_id and r.prev for r in receipts[1:])
        network = sb.receipts(action="network")
        assert network[0].details["version"] == policy.version
        with Job("typed", url=url, token=ALPHA) as job:
            lease = job.renew(60)
            assert (lease.job, lease.ttl, lease.state) == ("typed", 60.0, "active")
            assert job.pause() == [sb.sandbox_id]
            assert job.resume() == [sb.sandbox_id]
    with Client(url=url, token=ALPHA) as client:
        caps = client.capabilities()
        assert caps.isolation == ("container", "microvm", "vm")
        assert caps.fncall
        assert caps.preemption
        load = client.load()
        assert load.accepting
        assert load.score > 0
        assert load.memory["free"] > 0
        called = client.call(REF, "echo out; echo err >&2")
        assert (called.exit_code, called.stdout, called.stderr) == (0, "out\n", "err\n")
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.status = "paused"  # type: ignore[misc]
    results = [getattr(sdk_types, n) for n in sdk_types.__all__ if dataclasses.is_dataclass(getattr(sdk_types, n))]
    assert len(results) >= 14
    assert all(cls.__dataclass_params__.frozen for cls in results)


def test_the_create_keywords_are_the_models_client_fields() -> None:
    # isolation is create()'s own argument (a restore takes its checkpoint's)
    assert list(get_type_hints(sdk_types.SandboxFields)) == [
        f for f in SandboxOptions.CLIENT_FIELDS if f != "isolation"]


# -- sync and async are one API ----------------------------------------------------------------------------
PAIRS = [(sdk.AsyncSandbox, sdk.Sandbox), (sdk.AsyncCommands, sdk.Commands), (sdk.AsyncFiles, sdk.Files),
         (sdk.AsyncJob, sdk.Job), (sdk.AsyncClient, sdk.Client)]


def _public_methods(cls: type[Any]) -> dict[str, Any]:
    out = {}
    for name in dir(cls):
        if name.startswith("_") or isinstance(inspect.getattr_static(cls, name), property):
            continue
        attr = getattr(cls, name)
        if callable(attr):
            out[name] = attr
    return out


@pytest.mark.parametrize(("async_cls", "sync_cls"), PAIRS, ids=[s.__name__ for _, s in PAIRS])
def test_the_blocking_api_is_the_async_api(async_cls: type[Any], sync_cls: type[Any]) -> None:
    assert sync_cls._twin is async_cls
    async_methods, sync_methods = _public_methods(async_cls), _public_methods(sync_cls)
    assert sorted(sync_methods) == sorted(async_methods)
    for name, fn in async_methods.items():
        a, s = inspect.signature(fn), inspect.signature(sync_methods[name])
        assert list(a.parameters.values()) == list(s.parameters.values()), name
        assert sync_methods[name].__doc__ == fn.__doc__, name
    # the constructor a caller uses, and what each instance exposes besides methods
    if async_cls in (sdk.AsyncJob, sdk.AsyncClient):
        assert inspect.signature(async_cls) == inspect.signature(sync_cls)


def test_a_blocking_class_missing_a_twin_is_refused_at_import() -> None:
    class AsyncThing:
        async def one(self) -> int:
            """One."""
            return 1

        async def two(self) -> int:
            """Two."""
            return 2

    with pytest.raises(TypeError, match=r"lacks blocking twins of AsyncThing's coroutines two: "
                                        r"add two = blocking\(AsyncThing.two\)"):
        class Thing(sdk_blocking.Part[AsyncThing], twin=AsyncThing):
            one = sdk_blocking.blocking(AsyncThing.one)


def test_every_public_class_and_method_has_a_docstring() -> None:
    missing = []
    for module in (sdk, sdk_errors, sdk_types, sdk_blocking):
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if not inspect.getdoc(obj):
                missing.append(f"{module.__name__}.{name}")
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if attr.startswith("_") or not (callable(member) or isinstance(
                            member, (property, classmethod, staticmethod, sdk_blocking.opens))):
                        continue
                    if not inspect.getdoc(getattr(obj, attr)):
                        missing.append(f"{module.__name__}.{name}.{attr}")
    assert missing == []


# -- the sample agent program ----------------------------------------------------------------------------
def test_the_sample_agent_program_passes_mypy_strict() -> None:
    files = ["tests/sdk_sample.py", "sandbox/sdk/__init__.py", "sandbox/sdk/client.py", "sandbox/sdk/errors.py",
             "sandbox/sdk/types.py", "sandbox/sdk/blocking.py"]
    done = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", *files],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Success" in done.stdout


@pytest.mark.parametrize("flavour", ["async", "sync"])
def test_the_sample_agent_program_runs(url: str, flavour: str) -> None:
    job = f"sample-{flavour}"
    if flavour == "async":
        report = run(sdk_sample.async_agent(url, ALPHA, REF, job))
    else:
        report = sdk_sample.sync_agent(url, ALPHA, REF, job)
    assert report == sdk_sample.Report(
        status="running", memory=256 << 20, answer=45, listed=(".bashrc", ".profile", "task.py"),
        failed_with=3, missing_raised=True, checkpoint=f"projects/alpha/{job}-step-1", branch_saw=sdk_sample.TASK,
        lease_state="active", isolation=("container", "microvm", "vm"), doubled=42, served=sdk_sample.TASK, server_killed=True,
        terminal_exit=4, fork_saw=sdk_sample.TASK)
