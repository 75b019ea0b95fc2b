"""The sandbox service and its SDK end to end: real crun, a real store, the HTTP API on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from lazyfetch import kmount
from sandbox.host.manager import SandboxManager
from sandbox.sdk import (
    AsyncSandbox,
    AuthError,
    FileNotFound,
    QuotaExceeded,
    Sandbox,
    SandboxNotFound,
    UnsupportedIsolation,
)
from tests.support.sandboxes import REF, ServerThread, no_sandboxes_left, serving

pytestmark = [pytest.mark.usefixtures("need_root"), pytest.mark.root("erofs", "overlay", "fuse", "cmd:crun")]

ALPHA, BETA, GAMMA = "alpha-token-0123456789", "beta-token-0123456789", "gamma-token-0123456789"
OPS = "ops-token-0123456789abc"
MANY = "many-token-0123456789abc"
TOKENS = {"projects": {"alpha": {"tokens": [ALPHA], "max_sandboxes": 2},
                       "beta": {"tokens": [BETA], "max_sandboxes": 1},
                       "gamma": {"tokens": [GAMMA], "disabled": True},
                       "ops": {"tokens": [OPS], "max_sandboxes": 0, "admin": True},
                       "many": {"tokens": [MANY], "max_sandboxes": 8}}}




@pytest.fixture(scope="module")
def server(manager: SandboxManager) -> Iterator[ServerThread]:
    with serving(manager, TOKENS, reap_interval=0.3) as srv:
        yield srv


@pytest.fixture
def url(server: ServerThread, manager: SandboxManager) -> Iterator[str]:
    """The service URL; every sandbox a test leaves behind is destroyed, then nothing may remain."""
    with no_sandboxes_left(manager):
        yield server.url
    assert manager.backend("container").runtime.list() == []
    assert kmount.mounts_under(manager.boxes) == []


def get(url: str, token: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_lifecycle_through_the_blocking_sdk(url: str) -> None:
    with Sandbox.create(REF, url=url, token=ALPHA, env={"GREETING": "hi"}) as sb:
        streamed: list[str] = []
        res = sb.commands.run("for i in 1 2 3; do echo $i; done; echo $GREETING", on_stdout=streamed.append)
        assert (res.exit_code, res.stdout, res.truncated) == (0, "1\n2\n3\nhi\n", False)
        assert "".join(streamed) == res.stdout
        assert sb.commands.run(["python3", "-c", "import sys; sys.exit(3)"]).exit_code == 3
        assert sb.commands.run("cat", stdin="piped").stdout == "piped"

        sb.files.write("/root/notes.txt", "hello sandbox\n", mode=0o600)
        assert sb.files.read("/root/notes.txt") == "hello sandbox\n"
        assert sb.files.read("/root/notes.txt", format="bytes") == b"hello sandbox\n"
        assert sb.commands.run("cat /root/notes.txt").stdout == "hello sandbox\n"
        entries = {e.name: e for e in sb.files.list("/root")}
        assert (entries["notes.txt"].type, entries["notes.txt"].mode) == ("file", 0o600)
        sb.files.remove("/root/notes.txt")
        assert "notes.txt" not in {e.name for e in sb.files.list("/root")}
        with pytest.raises(FileNotFound):
            sb.files.read("/root/notes.txt")

        sb.pause()
        assert sb.refresh().status == "paused"
        again = Sandbox.connect(sb.sandbox_id, url=url, token=ALPHA)  # resumes it
        try:
            assert again.info.status == "running"
            assert again.commands.run("echo back").stdout == "back\n"
        finally:
            again.close()  # the session only; the sandbox lives on

        ckpt = sb.checkpoint(labels={"step": "1"})
        assert ckpt.layers >= 2
        sid = sb.sandbox_id
    with pytest.raises(SandboxNotFound):  # the with block killed it
        Sandbox.connect(sid, url=url, token=ALPHA)


def test_auth_ownership_quota_and_isolation(url: str, manager: SandboxManager) -> None:
    async def scenario() -> None:
        with pytest.raises(UnsupportedIsolation, match="gvisor"):  # refused before any request:
            await AsyncSandbox.create(REF, url="http://127.0.0.1:9", token=ALPHA, isolation="gvisor")
        with pytest.raises(AuthError) as unknown:
            await AsyncSandbox.create(REF, url=url, token="not-a-token-at-all")
        assert unknown.value.status == 401
        with pytest.raises(AuthError) as disabled:
            await AsyncSandbox.create(REF, url=url, token=GAMMA)
        assert disabled.value.status == 403

        async with await AsyncSandbox.create(REF, url=url, token=BETA) as sb:
            seen: list[str] = []
            res = await sb.commands.run("echo out; echo err >&2; exit 4", on_stderr=seen.append)
            assert (res.exit_code, res.stdout, res.stderr, seen) == (4, "out\n", "err\n", ["err\n"])
            with pytest.raises(SandboxNotFound):  # alpha cannot see beta's sandbox
                await AsyncSandbox.connect(sb.sandbox_id, url=url, token=ALPHA)
            status, body = get(f"{url}/v1/sandboxes", ALPHA)
            assert (status, json.loads(body)) == (200, {"sandboxes": []})
            status, _ = get(f"{url}/v1/sandboxes/{sb.sandbox_id}/files?path=/etc/hostname", ALPHA)
            assert status == 404
            with pytest.raises(QuotaExceeded) as quota:
                await AsyncSandbox.create(REF, url=url, token=BETA)
            assert quota.value.retryable
            assert quota.value.status == 429
            assert "1 of 1" in str(quota.value)
        assert [st.id for st in manager.list()] == []

    asyncio.run(scenario())
    status, _ = get(f"{url}/v1/sandboxes")
    assert status == 401


def test_openapi_lists_exactly_the_routes_and_metrics_count(url: str, server: ServerThread) -> None:
    status, body = get(f"{url}/openapi.json")
    assert status == 200
    doc = json.loads(body)
    assert doc["openapi"].startswith("3.")
    described = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    routes = [r for r in server.service.app().router.routes() if r.method != "HEAD" and r.resource is not None]
    served = {(r.method, r.resource.canonical) for r in routes if not (r.name or "").startswith("e2b:")}
    assert described == served
    # E2B's routes are E2B's API (its own OpenAPI spec): docs/E2B.md maps every one of them
    mapped = (Path(__file__).resolve().parents[1] / "docs" / "E2B.md").read_text()
    e2b = {r.resource.canonical.removesuffix("/{tail}") for r in routes if (r.name or "").startswith("e2b:")}
    assert "/v2/sandboxes" in e2b
    assert [p for p in sorted(e2b) if f"`{p}`" not in mapped and f"{p}`" not in mapped] == []
    # what /v1/capabilities claims, the routes serve
    caps = json.loads(get(f"{url}/v1/capabilities", ALPHA)[1])
    paths = {p for _, p in served}
    assert caps["commands"]["pty"]
    assert "/v1/sandboxes/{id}/commands/{command}/connect" in paths
    assert caps["ports"]["signed_urls"]
    assert "/v1/sandboxes/{id}/ports/{port}/url" in paths
    assert caps["fork"]
    assert "/v1/sandboxes/{id}/fork" in paths

    assert get(f"{url}/v1/sandboxes/lb-0123456789ab", ALPHA)[0] == 404  # well formed, nobody's
    status, body = get(f"{url}/v1/sandboxes/lb-nope", ALPHA)  # not an id at all: named, never a path
    assert (status, json.loads(body)["error"]["field"]) == (400, "id")
    assert get(f"{url}/metrics")[0] == 401  # they name every project: an operator's token only
    assert get(f"{url}/metrics", ALPHA)[0] == 403
    status, body = get(f"{url}/metrics", OPS)
    assert status == 200
    text = body.decode()
    assert 'layerbox_api_errors_total{code="sandbox_not_found"}' in text
    for family in ("layerbox_execs_total", "layerbox_sandboxes", "layerbox_exec_duration_seconds",
                   "layerbox_reaped_total", "layerbox_preempt_duration_seconds", "layerbox_fncall_duration_seconds"):
        assert f"# HELP {family} " in text


def test_the_exit_follows_all_output_in_order(url: str) -> None:
    # the exit event is sent the moment the command ends: nothing may be lost or reordered for it
    async def scenario() -> None:
        async with await AsyncSandbox.create(REF, url=url, token=ALPHA) as sb:
            for _ in range(5):
                streamed: list[str] = []
                res = await sb.commands.run("seq 1 20000; echo end >&2", on_stdout=streamed.append)
                assert res.exit_code == 0
                assert "".join(streamed) == res.stdout
                assert res.stdout.split() == [str(i) for i in range(1, 20001)]
                assert res.stderr == "end\n"
            quick = [await sb.commands.run(f"echo {i}") for i in range(20)]
            assert [r.stdout for r in quick] == [f"{i}\n" for i in range(20)]
            assert all(r.exit_code == 0 for r in quick)

    asyncio.run(scenario())


def test_a_restore_keeps_the_sandboxs_env_workdir_and_labels(url: str) -> None:
    async def scenario() -> None:
        async with await AsyncSandbox.create(REF, url=url, token=ALPHA, env={"GREETING": "hi", "KEEP": "1"},
                                             workdir="/tmp", labels={"role": "a"}, memory=300 << 20) as sb:
            ckpt = await sb.checkpoint()
        async with await AsyncSandbox.restore(ckpt.name, url=url, token=ALPHA) as copy:
            res = await copy.commands.run("pwd; echo $GREETING $KEEP")
            assert res.stdout == "/tmp\nhi 1\n"
            assert copy.info.labels == {"role": "a"}
            assert copy.info.limits is not None
            assert copy.info.limits.memory == 300 << 20
        # what the restore asks for wins; the rest is still the sandbox's
        async with await AsyncSandbox.restore(ckpt.name, url=url, token=ALPHA, env={"GREETING": "bye"},
                                              labels={"step": "2"}) as other:
            assert (await other.commands.run("pwd; echo $GREETING $KEEP")).stdout == "/tmp\nbye\n"
            assert other.info.labels == {"role": "a", "step": "2"}

    asyncio.run(scenario())


def test_the_quota_is_exact_under_concurrent_creates(url: str, manager: SandboxManager) -> None:
    # a create in flight counts once (it used to count as pending and as a sandbox being created)
    async def scenario() -> None:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {MANY}"}) as s:
            async def create() -> tuple[int, Any]:
                async with s.post(f"{url}/v1/sandboxes", json={"image": REF, "memory": 64 << 20}) as r:
                    return r.status, await r.json()

            answers = await asyncio.gather(*(create() for _ in range(20)))
            statuses = sorted(status for status, _ in answers)
            assert statuses == [201] * 8 + [429] * 12, repr(statuses)
            refused = [body for status, body in answers if status == 429]
            assert all("8 of 8" in body["error"]["message"] for body in refused), refused
            assert len([st for st in manager.list() if st.project == "many"]) == 8
            for status, body in answers:
                if status == 201:
                    async with s.delete(f"{url}/v1/sandboxes/{body['id']}") as r:
                        assert r.status == 204

    asyncio.run(scenario())


def test_a_command_running_when_its_sandbox_is_destroyed_says_so(url: str) -> None:
    async def scenario() -> None:
        sb = await AsyncSandbox.create(REF, url=url, token=ALPHA)
        started = asyncio.Event()
        running = asyncio.create_task(sb.commands.run("echo started; sleep 60", on_stdout=lambda _: started.set()))
        await asyncio.wait_for(started.wait(), 30)
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {ALPHA}"}) as s:
            async with s.delete(f"{url}/v1/sandboxes/{sb.sandbox_id}") as r:
                assert r.status == 204
        result = await asyncio.wait_for(running, 30)
        assert (result.interrupted, result.signal) == ("destroy", 9)
        await sb.close()

    asyncio.run(scenario())
