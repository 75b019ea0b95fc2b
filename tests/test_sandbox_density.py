"""Correctness at density, at a small scale: 200 sandboxes held on one manager.

What the density work changed (one mount record per sandbox, the cgroup parent that clones its
cpusets) must hold with many sandboxes at once: every one of them still runs a command, pauses,
resumes and checkpoints, and destroying them all leaves no container, cgroup, mount, mount
record, state file or network namespace behind.  bench/profile_create.py measures the same at
3,200 (time, not correctness).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest
from support.sandboxes import REF, assert_clean, manager, run, store_url  # noqa: F401  (fixtures)

from sandbox.host.manager import Sandbox, SandboxManager

HELD = 200
POLICED = 20  # of them with a network namespace of their own and an egress policy (deny all)
AT_ONCE = 8  # creates and checkpoints in flight


@pytest.fixture(scope="module")
def held(manager: SandboxManager) -> Iterator[list[Sandbox]]:  # noqa: F811
    boxes: list[Sandbox] = []

    async def fill() -> None:
        gate = asyncio.Semaphore(AT_ONCE)

        async def one(i: int) -> None:
            async with gate:
                boxes.append(await manager.create(REF, network=[]) if i < POLICED else await manager.create(REF))

        await asyncio.gather(*(one(i) for i in range(HELD)))

    try:
        run(fill())
        yield boxes
    finally:
        for box in boxes:
            if box.id in manager.ids():
                manager.destroy(box.id)


def test_every_one_of_200_held_execs_pauses_resumes_and_checkpoints(manager: SandboxManager,  # noqa: F811
                                                                     held: list[Sandbox]) -> None:
    assert len({box.id for box in held}) == HELD
    assert sum(box.state.network is not None for box in held) == POLICED
    records = [n for n in os.listdir(manager.data_dir / "state" / "mounts") if n.endswith(".json")]
    assert len(records) == HELD  # one mount record per sandbox (layerbox.mounts v2)
    for box in held:
        assert box.exec(f"echo {box.id} > /tmp/who; cat /tmp/who").stdout == f"{box.id}\n".encode()
    for box in held:
        box.pause()
    assert {box.state.status for box in held} == {"paused"}
    for box in held:
        box.resume()
    assert [box.exec("cat /tmp/who").stdout for box in held] == [f"{box.id}\n".encode() for box in held]

    async def checkpoint_all() -> list[str]:
        gate = asyncio.Semaphore(AT_ONCE)

        async def one(box: Sandbox) -> str:
            async with gate:
                return (await box.checkpoint()).name

        return await asyncio.gather(*(one(box) for box in held))

    refs = run(checkpoint_all())
    assert len(set(refs)) == HELD
    assert {box.state.status for box in held} == {"running"}  # a checkpoint goes on running


def test_destroying_all_200_leaves_nothing(manager: SandboxManager, held: list[Sandbox]) -> None:  # noqa: F811
    for box in held:
        manager.destroy(box.id)
    assert manager.ids() == []
    assert_clean(manager)  # no container, no mount under the data dir, no cgroup
    assert [n for n in os.listdir(manager.data_dir / "state" / "mounts") if n != ".spare"] == []
    assert [p for p in manager.boxes.iterdir()] == []  # no state file, no bundle
    assert os.listdir(manager.data_dir / "net" / "netns") == []  # the policed ones' namespaces
    assert not [i for i in os.listdir("/sys/class/net") if i.startswith(manager.net.if_prefix)]  # veths


def test_the_host_favors_moves_into_cgroups_and_keeps_its_cgroup2_options(manager: SandboxManager) -> None:  # noqa: F811
    """A manager's preflight sets cgroup2's ``favordynmods`` (each create's first move into its
    cgroups would otherwise wait for an RCU grace period) and loses none of the mount's options."""
    from sandbox.isolation import cgroups

    assert manager.layout.version in (1, 2)  # (the preflight has run)
    mounts = cgroups._cgroup_mounts()
    before = {mp: opts for fs, mp, opts in mounts if fs == "cgroup2"}
    assert before, "this host has a cgroup2 mount (hybrid or v2)"
    assert all("favordynmods" in opts for opts in before.values()), before
    assert cgroups.favor_dynamic_moves(mounts) is True  # again: nothing to do
    after = {mp: opts for fs, mp, opts in cgroups._cgroup_mounts() if fs == "cgroup2"}
    assert after == before  # (nsdelegate and the like kept)
