"""Ready pools: sandboxes started ahead of need, adopted by a create, through the real service.

A ready sandbox belongs to nobody until a create adopts it; then it must be exactly the sandbox
that create would have started (limits in its cgroup, env, workdir, user, labels, owner), and
never one of another image, another project, or one somebody used before.  What a test checks
about the sandbox is read inside it or from the kernel, not only from what the service says.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from support.sandboxes import manager, store_url  # noqa: F401  (module fixtures)

from sandbox.core.model import POOL_LABEL, MiB
from sandbox.host.manager import SandboxManager
from sandbox.pools.fncall import WarmPool
from sandbox.sdk import AsyncSandbox, SandboxNotFound
from tests.support.hosts import publish_sync
from tests.support.sandboxes import FIXTURE, REF, ServerThread, no_sandboxes_left, serving

pytestmark = [pytest.mark.usefixtures("need_root"), pytest.mark.root("erofs", "overlay", "fuse", "cmd:crun")]

ALPHA, BETA = "alpha-ready-token-0123456789abcdef", "beta-ready-token-0123456789abcdef"
OPS = "ops-ready-token-0123456789abcdef"
TOKENS = {"projects": {"alpha": {"tokens": [ALPHA], "max_sandboxes": 6},
                       "beta": {"tokens": [BETA], "max_sandboxes": 6},
                       "ops": {"tokens": [OPS], "max_sandboxes": 0, "admin": True}}}
SIZE = 2
MOVING = "img/moving"  # a ref the operator re-points while the pool holds sandboxes of it


@pytest.fixture(scope="module")
def server(manager: SandboxManager) -> Iterator[ServerThread]:  # noqa: F811
    with serving(manager, TOKENS, reap_interval=0.3, ready={REF: SIZE}) as srv:
        yield srv
    # the pool's own sandboxes go with the service
    assert [st.id for st in manager.list() if POOL_LABEL in st.labels] == []


@pytest.fixture
def url(server: ServerThread, manager: SandboxManager) -> Iterator[str]:  # noqa: F811
    with no_sandboxes_left(manager):
        full(server)
        yield server.url


def full(server: ServerThread) -> None:
    """Until the service's ready pool holds its size again (a replacement starts a while after an adopt)."""
    (pool,) = server.service.context.ready_pools.values()
    asyncio.run_coroutine_threadsafe(pool.full(), server.loop).result(120)
    assert pool.stats()["ready"] == SIZE


def pooled(manager: SandboxManager) -> set[str]:  # noqa: F811
    return {st.id for st in manager.list() if POOL_LABEL in st.labels}


def run(coro: Any) -> Any:
    async def bounded() -> Any:
        async with asyncio.timeout(240):
            return await coro
    return asyncio.run(bounded())


def adopted(receipts: list[Any]) -> bool:
    return any(r.action == "create" and r.details.get("ready") for r in receipts)


def test_an_adopted_sandbox_is_the_one_its_create_asked_for(url: str, manager: SandboxManager) -> None:  # noqa: F811
    async def scenario() -> None:
        ready = pooled(manager)
        assert len(ready) == SIZE
        async with await AsyncSandbox.create(REF, url=url, token=ALPHA, memory=128 * MiB, pids=40, cpu=0.5,
                                             env={"EPISODE": "7"}, workdir="/workspace/calc", user="1000",
                                             labels={"tier": "a"}) as sb:
            assert sb.sandbox_id in ready  # it was one of the pool's
            assert adopted(await sb.receipts())
            st = manager.get(sb.sandbox_id).state
            assert POOL_LABEL not in st.labels
            assert st.project == "alpha"
            assert st.labels["tier"] == "a"
            # limits in the kernel, not only in the state
            mem = manager.layout.controller_dir("memory", st.cgroups_path)
            pids = manager.layout.controller_dir("pids", st.cgroups_path)
            assert mem is not None
            assert pids is not None
            limit = "memory.max" if manager.layout.version == 2 else "memory.limit_in_bytes"
            assert int((mem / limit).read_text()) == 128 * MiB
            assert (pids / "pids.max").read_text().strip() == "40"
            # the process defaults, read inside
            got = await sb.commands.run("echo $EPISODE; pwd; id -u")
            assert got.stdout.split() == ["7", "/workspace/calc", "1000"]
            # it is alpha's: beta cannot see or reach it
            with pytest.raises(SandboxNotFound):
                await AsyncSandbox.connect(sb.sandbox_id, url=url, token=BETA)
            assert sb.sandbox_id not in {s.id for s in await AsyncSandbox.list(url=url, token=BETA)}
            assert {s.id for s in await AsyncSandbox.list(url=url, token=ALPHA)} == {sb.sandbox_id}

    run(scenario())


def test_a_ready_sandbox_belongs_to_nobody_and_is_never_handed_out_twice(url: str, server: ServerThread,
                                                                          manager: SandboxManager) -> None:  # noqa: F811
    async def scenario() -> None:
        ready = pooled(manager)
        for token in (ALPHA, BETA):  # unowned: no project lists or reaches one
            assert not ready & {s.id for s in await AsyncSandbox.list(url=url, token=token)}
            for sid in ready:
                with pytest.raises(SandboxNotFound):
                    await AsyncSandbox.connect(sid, url=url, token=token)
        first = await AsyncSandbox.create(REF, url=url, token=ALPHA)
        try:
            await first.files.write("/root/secret.txt", "alpha's")
            await first.commands.run("echo agent-was-here > /tmp/mark")
        finally:
            await first.kill()
        seen = {first.sandbox_id}
        for _ in range(SIZE + 1):  # every later adopt is another sandbox, and none saw alpha's writes
            full(server)
            async with await AsyncSandbox.create(REF, url=url, token=BETA) as sb:
                assert adopted(await sb.receipts())
                assert sb.sandbox_id not in seen
                seen.add(sb.sandbox_id)
                assert not await sb.files.exists("/root/secret.txt")
                assert not await sb.files.exists("/tmp/mark")
        # not even an admin project sees the unowned ones in a listing
        assert not pooled(manager) & {s.id for s in await AsyncSandbox.list(url=url, token=OPS)}
        async with aiohttp.ClientSession() as http, \
                http.get(f"{url}/metrics", headers={"Authorization": f"Bearer {OPS}"}) as resp:
            text = await resp.text()
        adopted_count = re.search(r'layerbox_ready_sandboxes\{image="img/python",what="adopted"\} ([0-9.]+)', text)
        assert adopted_count is not None
        assert float(adopted_count.group(1)) >= SIZE + 2

    run(scenario())


def test_options_a_ready_sandbox_cannot_take_start_a_new_one(url: str, manager: SandboxManager) -> None:  # noqa: F811
    async def scenario() -> None:
        ready = pooled(manager)
        for fields in ({"network": []}, {"cpu_class": "best-effort"}, {"disk": 64 * MiB}):
            async with await AsyncSandbox.create(REF, url=url, token=ALPHA, **fields) as sb:
                assert sb.sandbox_id not in ready, fields
                assert not adopted(await sb.receipts()), fields
        assert pooled(manager) == ready  # the pool kept its sandboxes for creates that fit

    run(scenario())


def test_a_pool_whose_ref_moved_never_hands_out_the_old_image(manager: SandboxManager,  # noqa: F811
                                                              store_url: str,  # noqa: F811
                                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    work = tmp_path_factory.mktemp("ready-moving")
    python = publish_sync(store_url, work / "a", f"oci-archive:{FIXTURE}:python", MOVING)

    async def scenario() -> None:
        async with WarmPool(manager, MOVING, size=1, warm=["/bin/true"]) as pool:
            (old,) = pooled(manager) - {st.id for st in manager.list() if st.labels.get(POOL_LABEL) == REF}
            assert manager.get(old).state.image_digest == python
            # the operator points the ref at another image: a sandbox of the old one is stale now
            minbase = await asyncio.to_thread(publish_sync, store_url, work / "b",
                                              f"oci-archive:{FIXTURE}:minbase", MOVING)
            assert minbase != python
            assert pool.take(minbase) is None
            assert pool.stats()["stale"] == 1
            await pool.settle()
            assert old not in {st.id for st in manager.list()}  # destroyed, not handed out
            # what it makes from now on is of the image the ref names now
            await pool.full()
            box = pool.take(minbase)
            assert box is not None
            try:
                assert box.state.image_digest == minbase
                assert box.exec(["/bin/sh", "-c", "command -v python3 || echo none"]).stdout.strip() == b"none"
            finally:
                await asyncio.to_thread(manager.destroy, box.id)

    run(scenario())
