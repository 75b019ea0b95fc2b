"""FnCall warm pools with real crun, a real kernel and a real store (the Debian fixture image with python3)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from lazyfetch import kmount
from sandbox.core.errors import SandboxError
from sandbox.host.manager import SandboxManager
from sandbox.pools.fncall import (
    POOL_ID_LABEL,
    POOL_LABEL,
    CallArgumentError,
    FnCalls,
    PoolClosed,
    PoolCreateFailed,
    PoolsBusy,
    WarmPool,
    measure,
)
from tests.support.sandboxes import PROCESS_ARGS, REF

pytestmark = [pytest.mark.usefixtures("need_root"), pytest.mark.root("erofs", "overlay", "fuse", "cmd:crun")]





def assert_no_boxes(mgr: SandboxManager) -> None:
    assert mgr.backend("container").runtime.list() == []
    assert mgr.list() == []
    assert kmount.mounts_under(mgr.boxes) == []


@pytest.fixture
def mgr(manager: SandboxManager) -> Iterator[SandboxManager]:
    """The module's manager; every test must leave no sandbox behind (checked even after a failure)."""
    try:
        yield manager
    finally:
        leftovers = manager.list()
        for st in leftovers:
            manager.destroy(st.id)
    assert leftovers == []
    assert_no_boxes(manager)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


GREETER = '''
import os

def helper(x):
    return x * 2

def greet(name, *, times=1, tags=()):
    print("hello from", name)
    return {"name": name, "doubled": helper(times), "tags": sorted(tags), "uid": os.getuid(), "none": None}
'''


def test_shell_and_function_calls(mgr: SandboxManager) -> None:
    async def body() -> None:
        async with WarmPool(mgr, REF, size=2, labels={"team": "t1"}, env={"GREETING": "hi"}) as pool:
            states = mgr.list()
            assert len(states) == 2
            assert all(dict(st.labels) == {"team": "t1", POOL_LABEL: REF, POOL_ID_LABEL: pool.id} for st in states)

            res = await pool.call("echo $GREETING; echo err >&2; exit 3")
            assert (res.exit_code, res.stdout, res.stderr) == (3, b"hi\n", b"err\n")
            assert (res.value, res.error, res.timed_out, res.truncated) == (None, None, False, False)
            assert res.sandbox in {st.id for st in states}
            assert 0 <= res.wait_seconds <= res.duration

            res = await pool.call(["cat"], stdin=b"piped in")
            assert res.stdout == b"piped in"

            res = await pool.call(function=GREETER, args=["ada"], kwargs={"times": 21, "tags": ["b", "a"]})
            assert res.error is None, res.error
            assert res.exit_code == 0
            assert res.value == {"name": "ada", "doubled": 42, "tags": ["a", "b"], "uid": 0, "none": None}
            assert res.stdout == b"hello from ada\n"  # the answer frame is not part of stdout

            res = await pool.call(function=GREETER, entry="helper", args=[[1]])
            assert res.value == [1, 1]

            res = await pool.call(function="async def f(a, b):\n    return a / b\n", args=[1, 4])
            assert res.value == 0.25

            res = await pool.call(function="def f():\n    print('partial')\n    raise ValueError('boom')\n")
            assert res.value is None
            assert res.exit_code == 1
            assert res.stdout == b"partial\n"
            assert res.error is not None
            assert res.error.startswith("ValueError: boom\nTraceback (most recent call last):")
            assert 'File "<function>", line 3, in f' in res.error

            res = await pool.call(function="def f():\n    return {1, 2}\n")
            assert res.value is None
            assert res.error is not None
            assert res.error.startswith("TypeError: the return value of f() is not JSON-serializable")

            res = await pool.call(function="x = 1\n")
            assert res.error is not None
            assert res.error.startswith("ValueError: the function source defines no top-level function")

            res = await pool.call(function="def f(:\n")
            assert res.error is not None
            assert res.error.startswith("SyntaxError:")

            res = await pool.call(function="import sys\ndef f():\n    sys.stdout.close()\n    return 'still'\n")
            assert res.value == "still"

            # the pid is passed, not read as $PPID: on a loaded host the shell may start after the
            # function's process is gone, and its $PPID is then init's
            late = ("import os, subprocess\ndef f():\n"
                    "    subprocess.Popen('while kill -0 %d 2>/dev/null; do :; done; echo late' % os.getpid(),"
                    " shell=True)\n"
                    "    return 2\n")
            res = await pool.call(function=late)
            assert (res.value, res.error) == (2, None)
            assert res.stdout == b"late\n"  # printed after the answer by a process the function left behind

            res = await pool.call(function="def f():\n    print('x' * 5000)\n    return 1\n", output_cap=1000)
            assert res.truncated
            assert res.error is not None
            assert res.error.startswith("OutputTruncated:")

            with pytest.raises(CallArgumentError):
                await pool.call(function=GREETER, args=[object()])
            with pytest.raises(CallArgumentError):
                await pool.call("true", function=GREETER)
            with pytest.raises(CallArgumentError):
                await pool.call()
            with pytest.raises(CallArgumentError):
                await pool.call(function=GREETER, stdin=b"x")
            assert pool.stats()["calls"] == 12  # the refused calls never took a sandbox

        with pytest.raises(PoolClosed):
            await pool.call("true")

    run(body())


def test_each_call_gets_a_fresh_layer(mgr: SandboxManager) -> None:
    async def body() -> None:
        async with WarmPool(mgr, REF, size=1) as pool:
            first = await pool.call("echo secret > /root/left; echo t > /tmp/left; sleep 600 & echo $!")
            assert first.exit_code == 0
            second = await pool.call("cat /root/left /tmp/left; " + PROCESS_ARGS)
            assert second.sandbox != first.sandbox
            assert b"secret" not in second.stdout
            assert b"No such file or directory" in second.stderr
            assert b"sleep 600" not in second.stdout
            await pool.settle()
            ids = {st.id for st in mgr.list()}
            assert first.sandbox not in ids
            assert second.sandbox not in ids

    run(body())


def test_timeout_kills_the_call_and_discards_the_sandbox(mgr: SandboxManager) -> None:
    async def body() -> None:
        async with WarmPool(mgr, REF, size=1) as pool:
            res = await pool.call("echo started; sleep 600", timeout=1)
            assert res.timed_out
            assert res.stdout == b"started\n"
            res = await pool.call(function="def spin():\n    while True:\n        pass\n", timeout=1)
            assert res.timed_out
            assert res.value is None
            assert res.error is not None
            assert res.error.startswith("TimeoutError:")
            await pool.settle()
            assert [st.id for st in mgr.list()] != [res.sandbox]
            assert (await pool.call("echo alive")).stdout == b"alive\n"

    run(body())


async def _until(done: Callable[[], bool], *, pause: float, limit: float = 60.0) -> None:
    """Poll the pool's state (it has no event for it) until ``done()``; fail after ``limit`` s."""
    deadline = time.monotonic() + limit
    while True:
        if done():
            return
        if time.monotonic() > deadline:
            pytest.fail(f"the pool did not reach the expected state in {limit:g} s")
        await asyncio.sleep(pause)


def test_concurrent_calls_queue_and_the_pool_refills(mgr: SandboxManager) -> None:
    async def body() -> None:
        async with WarmPool(mgr, REF, size=2) as pool:
            assert pool.stats()["ready"] == 2
            results = await asyncio.gather(*(
                pool.call(function="def f(i):\n    return i * i\n", args=[i]) for i in range(4)))
            assert [r.value for r in results] == [0, 1, 4, 9]
            assert len({r.sandbox for r in results}) == 4
            waited = [r for r in results if r.wait_seconds > 0.0]
            assert len(waited) >= 2
            stats = pool.stats()
            assert (stats["calls"], stats["misses"]) == (4, 2)  # two were ready, two had to wait
            await pool.settle()
            stats = pool.stats()
            assert (stats["ready"], stats["busy"], stats["waiting"], stats["creating"]) == (2, 0, 0, 0)
            assert (stats["created"], stats["destroyed"], stats["failures"]) == (6, 4, 0)
            assert len(mgr.list()) == 2

            # a caller cancelled while it waits does not take (or leak) the sandbox made for it.
            # Both ready sandboxes are held by running calls, so the next call must wait; a
            # replacement may still finish first on a loaded host, and then the attempt is
            # repeated (the waiting state is what is under test, not its timing)
            calls = stats["calls"]
            for _attempt in range(5):
                holders = [asyncio.ensure_future(pool.call("sleep 1")) for _ in range(2)]
                calls += 2
                await _until(lambda: pool.stats()["busy"] == 2, pause=0.005)
                waiting = asyncio.ensure_future(pool.call("true"))
                calls += 1
                await _until(lambda w=waiting: w.done() or pool.stats()["waiting"] > 0, pause=0.0)
                if waiting.done():  # a replacement was ready first; try again
                    assert (await waiting).exit_code == 0
                    await asyncio.gather(*holders)
                    await pool.settle()
                    continue
                assert pool.stats()["waiting"] == 1
                waiting.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await waiting
                assert [r.exit_code for r in await asyncio.gather(*holders)] == [0, 0]
                break
            else:
                pytest.fail("in 5 attempts a replacement was always ready before the call queued")
            await pool.settle()
            stats = pool.stats()
            assert (stats["ready"], stats["waiting"], stats["calls"]) == (2, 0, calls)
            assert len(mgr.list()) == 2
        stats = pool.stats()
        assert stats["destroyed"] == stats["created"]

    run(body())


def test_creation_failures_reach_callers(mgr: SandboxManager) -> None:
    async def body() -> None:
        with pytest.raises(PoolCreateFailed, match="img/absent"):
            await WarmPool(mgr, "img/absent", size=2).start()

        pool = WarmPool(mgr, REF, size=1, user="no-such-user")  # refused after the rootfs is mounted
        try:
            with pytest.raises(PoolCreateFailed, match="no-such-user") as info:
                await pool.call("true")
            assert isinstance(info.value.__cause__, SandboxError)
            results = await asyncio.gather(pool.call("true"), pool.call("true"), return_exceptions=True)
            assert all(isinstance(r, PoolCreateFailed) for r in results)
            assert pool.stats()["failures"] >= 3
        finally:
            await pool.close()

    run(body())


def test_fncalls_pools_by_image_and_close_leaves_nothing(mgr: SandboxManager) -> None:
    async def body() -> None:
        calls = FnCalls(mgr, size=1)
        try:
            res = await calls.call(REF, "cat /etc/debian_version")
            assert res.exit_code == 0
            assert res.wait_seconds > 0  # the pool was made by this first call
            res = await calls.call(REF, function="def f(**kw):\n    return kw\n", kwargs={"a": [1]})
            assert res.value == {"a": [1]}
            assert list(calls.stats()) == [REF]
            assert calls.stats()[REF]["calls"] == 2
            report = await measure(mgr, REF, calls=3, size=1)
            for key in ("true_warm", "true_back_to_back", "function_warm", "function_back_to_back"):
                assert report[key]["n"] == 3
                assert 0 < report[key]["p50"] <= report[key]["p99"]
        finally:
            await calls.close()
        assert_no_boxes(mgr)
        with pytest.raises(PoolClosed):
            await calls.call(REF, "true")

    run(body())


def test_fncalls_keeps_at_most_max_pools(mgr: SandboxManager) -> None:
    """Callers naming ever new images must not grow the host's sandbox count: idle pools are closed
    (least recently used first), and with every pool busy a new image is refused, retryably."""
    async def body() -> None:
        async with await mgr.open_store() as store:
            digest = (await store.resolve(REF)).digest  # the same image under a second name
        calls = FnCalls(mgr, size=1, max_pools=1)
        try:
            assert (await calls.call(REF, "true")).exit_code == 0
            assert (await calls.call(digest, "true")).exit_code == 0
            assert list(calls.stats()) == [digest]  # REF's idle pool was closed for it
            await calls.pool(digest).settle()
            assert {st.labels[POOL_LABEL] for st in mgr.list()} == {digest}
            slow = asyncio.create_task(calls.call(digest, "sleep 2"))
            await asyncio.sleep(0.5)
            with pytest.raises(PoolsBusy) as err:
                await calls.call(REF, "true")
            assert err.value.retryable
            assert (await slow).exit_code == 0
        finally:
            await calls.close()
        assert_no_boxes(mgr)

    run(body())
