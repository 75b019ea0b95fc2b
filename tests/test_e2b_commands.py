"""The stock ``e2b`` SDK against a layerbox edge: sandboxes and commands (envd's process service).

Every test drives a real edge process (tests/support/e2b.py) with real sandboxes through the
unmodified ``e2b`` package, configured only by ``E2B_API_KEY``, ``E2B_API_URL`` and
``E2B_SANDBOX_URL``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from e2b import AsyncSandbox, CommandExitException, Sandbox
from support.e2b import TEMPLATE, E2bEdge, e2b_edge
from support.sandboxes import store_url  # noqa: F401  (a module's store with the fixture image)

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def served(store_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2bEdge]:  # noqa: F811
    with e2b_edge(tmp_path_factory.mktemp("e2b"), store_url) as edge:
        yield edge


@pytest.fixture
def sbx(served: E2bEdge) -> Iterator[Sandbox]:
    box = Sandbox.create(TEMPLATE, timeout=120)
    try:
        yield box
    finally:
        box.kill()


def test_a_command_runs_as_e2bs_user_in_its_home_with_streamed_output(sbx: Sandbox) -> None:
    seen: list[str] = []
    result = sbx.commands.run("echo out; whoami; pwd; echo $HOME; echo err >&2", on_stdout=seen.append)
    assert result.exit_code == 0
    assert result.stdout == "out\nuser\n/home/user\n/home/user\n"
    assert result.stderr == "err\n"
    assert "".join(seen) == result.stdout


def test_root_cwd_and_envs_are_the_callers(sbx: Sandbox) -> None:
    result = sbx.commands.run("whoami; pwd; echo $GREETING", user="root", cwd="/tmp", envs={"GREETING": "hej"})
    assert result.stdout == "root\n/tmp\nhej\n"


def test_a_failing_command_raises_the_sdks_exit_exception_with_its_code(sbx: Sandbox) -> None:
    with pytest.raises(CommandExitException) as caught:
        sbx.commands.run("echo partial; exit 7")
    assert caught.value.exit_code == 7
    assert caught.value.stdout == "partial\n"


def test_a_background_command_is_listed_connected_to_and_killed(sbx: Sandbox) -> None:
    handle = sbx.commands.run("echo started; sleep 60", background=True)
    assert handle.pid in [p.pid for p in sbx.commands.list()]
    again = sbx.commands.connect(handle.pid)
    assert sbx.commands.kill(handle.pid) is True
    with pytest.raises(CommandExitException) as caught:
        again.wait()
    assert "started" in caught.value.stdout  # replayed from what the edge keeps
    assert handle.pid not in [p.pid for p in sbx.commands.list()]


def test_the_sandbox_is_described_listed_and_killed(served: E2bEdge) -> None:
    box = Sandbox.create(TEMPLATE, timeout=60, metadata={"run": "r1"})
    try:
        info = box.get_info()
        assert info.sandbox_id == box.sandbox_id
        assert info.template_id == TEMPLATE
        assert info.metadata == {"run": "r1"}
        assert info.end_at > info.started_at
        listed = [s.sandbox_id for s in Sandbox.list().next_items()]
        assert box.sandbox_id in listed
        assert box.is_running()
    finally:
        box.kill()
    assert box.sandbox_id not in served.sandboxes()
    assert not box.is_running()


def test_the_async_client_runs_commands_too(served: E2bEdge) -> None:
    async def scenario() -> tuple[str, int]:
        box = await AsyncSandbox.create(TEMPLATE, timeout=60)
        try:
            started = time.perf_counter()
            result = await box.commands.run("echo async; whoami")
            assert time.perf_counter() - started < 60
            return result.stdout, result.exit_code
        finally:
            await box.kill()

    assert asyncio.run(scenario()) == ("async\nuser\n", 0)
