"""Sandbox fixtures shared by the sandbox test modules: a store with the fixture image, a manager, boxes.

Import the fixtures into a test module (``from support.sandboxes import boxes, manager, store_url``);
each module then gets its own store and manager (module scope), torn down even on failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from lazyfetch import kmount
from sandbox.core.model import POOL_LABEL
from sandbox.edge.app import AuthConfig, SandboxService
from sandbox.host.manager import Sandbox, SandboxManager
from tests.support.hosts import publish_sync

from .env import FIXTURE_IMAGE, require

FIXTURE = FIXTURE_IMAGE
REF = "img/python"
# the fixture image has no ps: one line per process inside the sandbox, its arguments joined by
# spaces (and a trailing one), read from /proc; count matches with `| grep -c '^sleep 60 '`
PROCESS_ARGS = "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null && echo; done"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def assert_clean(mgr: SandboxManager) -> None:
    assert mgr.backend("container").runtime.list() == []
    assert kmount.mounts_under(mgr.data_dir) == []
    assert not [d for d in mgr.layout.dirs("/" + mgr.cgroup_parent) if d.exists()]


@pytest.fixture(scope="module")
def store_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    require("root")
    if not FIXTURE.exists():
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


@contextlib.contextmanager
def vm_host(store_url: str, tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[SandboxManager]:
    """A manager for microVM tests on ``store_url``, closed after the block: no background fill
    of the layers' caches, so what is fetched is what the guests read."""
    mgr = SandboxManager(tmp_path_factory.mktemp(name), store_url)
    mgr.host.daemon_options = {"fill_below": 0}
    try:
        yield mgr
    finally:
        mgr.close()


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
    assert manager.backend("container").runtime.list() == []
    assert [m for m in kmount.mounts_under(manager.boxes)] == []


class ServerThread:
    """The service on its own event loop in a thread (so tests can use the blocking SDK too)."""

    def __init__(self, service: SandboxService) -> None:
        self.service = service
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(service.app())
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.url = ""

    def start(self) -> None:
        self.thread.start()

        async def up() -> str:
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            host, port = self.runner.addresses[0][:2]
            return f"http://{host}:{port}"

        self.url = asyncio.run_coroutine_threadsafe(up(), self.loop).result(30)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@contextlib.contextmanager
def serving(manager: SandboxManager, tokens: dict[str, Any], **service_options: Any) -> Iterator[ServerThread]:
    """The edge service over ``manager`` with the projects of ``tokens``, stopped however the block ends."""
    srv = ServerThread(SandboxService(manager, AuthConfig.from_dict(tokens), **service_options))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@contextlib.contextmanager
def no_sandboxes_left(manager: SandboxManager) -> Iterator[None]:
    """Destroy every sandbox (but warm-pool ones) a test left, then fail it for leaving them."""
    try:
        yield
    finally:
        left = [st.id for st in manager.list() if POOL_LABEL not in st.labels]
        for sid in left:
            manager.destroy(sid)
    assert left == [], "the test left sandboxes behind"


def kill_daemon(mgr: SandboxManager, *, holder: bool = False) -> None:
    """SIGKILL the host's lazyfetch daemon and wait until it no longer answers.

    ``holder``: its fd holder too, so the kernel state the layer mounts read through is
    gone (a new generation): the mounts must be stacked again and the sandboxes restarted.
    """
    import signal
    import time

    health = mgr.host.client.health()
    assert health is not None
    if holder:
        os.kill(health["holder"], signal.SIGKILL)
    os.kill(health["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while mgr.host.client.health() is not None and time.monotonic() < deadline:
        time.sleep(0.05)
