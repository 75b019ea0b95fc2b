"""Sandbox fixtures shared by the sandbox test modules: a store with the fixture image, a manager, boxes.

Import the fixtures into a test module (``from support.sandboxes import boxes, manager, store_url``);
each module then gets its own store and manager (module scope), torn down even on failure.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from typing import Any

import pytest

from lazyfetch import kmount
from sandbox.manager import Sandbox, SandboxManager
from support.env import require
from tests.support.hosts import publish_sync

FIXTURE = "/work/shared/fixtures/debian-bookworm.oci.tar"
REF = "img/python"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def assert_clean(mgr: SandboxManager) -> None:
    assert mgr.runtime.list() == []
    assert kmount.mounts_under(mgr.data_dir) == []
    assert not [d for d in mgr.layout.dirs("/" + mgr.cgroup_parent) if d.exists()]


@pytest.fixture(scope="module")
def store_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    require("root")
    if not os.path.exists(FIXTURE):
        pytest.fail(f"{FIXTURE} missing: the shared fixtures are part of the test environment")
    root = tmp_path_factory.mktemp("sbx-store")
    url = f"file://{root / 'store'}"
    publish_sync(url, root / "pub", f"oci-archive:{FIXTURE}:python", REF)
    return url


@pytest.fixture(scope="module")
def manager(store_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SandboxManager]:
    mgr = SandboxManager(tmp_path_factory.mktemp("sbx-host1"), store_url)
    try:
        yield mgr
    finally:
        mgr.close()
        assert_clean(mgr)


@pytest.fixture
def boxes(manager: SandboxManager) -> Iterator[Any]:
    """Create sandboxes on the module's manager; every one is destroyed when the test ends."""
    made: list[Sandbox] = []

    def make(ref: str = REF, **kw: Any) -> Sandbox:
        box = run(manager.create(ref, **kw))
        made.append(box)
        return box

    yield make
    for box in made:
        box.destroy()
    assert manager.runtime.list() == []
    assert [m for m in kmount.mounts_under(manager.boxes)] == []
