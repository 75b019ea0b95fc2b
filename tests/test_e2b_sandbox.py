"""The stock ``e2b`` SDK against a layerbox edge: the rest of the control plane.

Fork, snapshots (create from one, list, delete), templates and aliases, network updates,
metrics, logs, pause and resume, timeout expiry (the reaper), list filters and pagination,
and the exception of each failure the SDK maps; sync and async.  Every test drives a real
edge process (tests/support/e2b.py) with real sandboxes through the unmodified ``e2b``
package; raw requests only for what the SDK has no method for (templates, logs).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import json
import os
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import (
    AsyncSandbox,
    AuthenticationException,
    NotFoundException,
    RateLimitException,
    Sandbox,
    SandboxException,
    SandboxNotFoundException,
    SandboxQuery,
    SandboxState,
    Template,
)
from support.e2b import ADMIN, ALPHA, BETA, TEMPLATE, TOKENS, E2bEdge, e2b_edge, envd_headers
from support.edges import EdgeProcess, http, running
from support.sandboxes import store_url  # noqa: F401  (a module's store with the fixture image)

pytestmark = pytest.mark.root
REAP = "0.5"  # seconds between reaper rounds: a timeout expires within a second of its end


@pytest.fixture(scope="module")
def secret(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The URL secret both edges share (the envd and traffic tokens they hand out are its HMACs)."""
    path = tmp_path_factory.mktemp("secret") / "url-secret"
    path.write_bytes(os.urandom(32))
    return path


@pytest.fixture(scope="module")
def served(store_url: str, secret: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2bEdge]:  # noqa: F811
    with e2b_edge(tmp_path_factory.mktemp("e2b"), store_url, "--reap-interval", REAP,
                  "--url-secret-file", str(secret)) as edge:
        yield edge


@pytest.fixture
def second(served: E2bEdge, store_url: str, secret: Path,  # noqa: F811
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[EdgeProcess]:
    """Another edge on the same store, tokens and URL secret."""
    with running("e2b-second", tmp_path_factory.mktemp("second"), store_url, TOKENS,
                 "--url-secret-file", str(secret), token=ADMIN) as edge:
        yield edge


def alpha_ids(url: str) -> list[str]:
    """The alpha project's sandboxes an edge runs (its native API)."""
    status, _, body = http("GET", url + "/v1/sandboxes", token=ALPHA)
    assert status == 200, body
    return [sb["id"] for sb in body["sandboxes"]]


@pytest.fixture
def sbx(served: E2bEdge) -> Iterator[Sandbox]:
    box = Sandbox.create(TEMPLATE, timeout=300)
    try:
        yield box
    finally:
        box.kill()


def call(served: E2bEdge, method: str, path: str, *, key: str = ALPHA, body: Any = None) -> tuple[int, Any]:
    """One request to E2B's REST API as the SDK authenticates it (X-API-Key)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(served.url + path, data=data, method=method,
                                 headers={"X-API-Key": key, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    return status, json.loads(raw) if raw else None


def put(box: Sandbox, path: str, text: str) -> None:
    box.commands.run(f"printf %s '{text}' > {path}")


def get(box: Sandbox, path: str) -> str:
    return box.commands.run(f"cat {path}").stdout


def kill_all(boxes: list[Any]) -> None:
    for box in boxes:
        if isinstance(box, Sandbox):
            box.kill()


# -- fork --------------------------------------------------------------------------------------------------
def test_a_fork_of_two_continues_from_the_sandboxs_files(sbx: Sandbox) -> None:
    put(sbx, "/home/user/state.txt", "before the fork")
    forks = sbx.fork(count=2, timeout=120)
    try:
        assert len(forks) == 2
        assert all(isinstance(f, Sandbox) for f in forks), forks
        ids = {f.sandbox_id for f in forks if isinstance(f, Sandbox)}
        assert len(ids) == 2
        assert sbx.sandbox_id not in ids
        for f in forks:
            assert isinstance(f, Sandbox)
            assert get(f, "/home/user/state.txt") == "before the fork"
            put(f, "/home/user/state.txt", f"changed in {f.sandbox_id}")
            assert f.get_info().template_id == TEMPLATE
        assert get(sbx, "/home/user/state.txt") == "before the fork"  # independent from then on
    finally:
        kill_all(forks)


def test_a_fork_past_the_quota_is_refused_whole_before_anything_starts(served: E2bEdge) -> None:
    box = Sandbox.create(TEMPLATE, timeout=120, api_key=BETA)  # beta may hold 4 sandboxes
    try:
        with pytest.raises(RateLimitException):
            box.fork(count=4, retries=0)  # (the SDK would retry a 429 after its Retry-After: 5 s)
        assert [s.sandbox_id for s in Sandbox.list(api_key=BETA).next_items()] == [box.sandbox_id]
        status, err = call(served, "POST", f"/sandboxes/{box.sandbox_id}/fork", key=BETA, body={"count": 0})
        assert status == 400
        assert "count" in err["message"]
    finally:
        box.kill()


# -- snapshots ---------------------------------------------------------------------------------------------
def test_a_snapshot_is_a_template_listed_paginated_and_deleted(sbx: Sandbox, served: E2bEdge) -> None:
    put(sbx, "/home/user/snap.txt", "in the snapshot")
    name = f"snap-{uuid.uuid4().hex[:8]}"
    first = sbx.create_snapshot(name=name)
    second = sbx.create_snapshot()
    assert first.snapshot_id.endswith(f"/snapshots/{name}:latest")
    assert first.names == [first.snapshot_id]
    assert second.snapshot_id != first.snapshot_id

    mine = {s.snapshot_id for s in sbx.list_snapshots().next_items()}
    assert {first.snapshot_id, second.snapshot_id} <= mine
    pages = Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id, limit=1)
    seen = [s.snapshot_id for s in pages.next_items()]
    assert pages.has_next
    seen += [s.snapshot_id for s in pages.next_items()]
    assert sorted(seen) == sorted([first.snapshot_id, second.snapshot_id])
    assert not pages.has_next
    assert [s.snapshot_id for s in Sandbox.list_snapshots(name=name).next_items()] == [first.snapshot_id]
    assert Sandbox.list_snapshots(api_key=BETA).next_items() == []  # another project's: not there
    status, beta_templates = call(served, "GET", "/templates", key=BETA)
    assert status == 200
    assert not [t for t in beta_templates if "alpha" in t["names"][0]]

    for template in (first.snapshot_id, name):  # its id, or its short name
        restored = Sandbox.create(template, timeout=60)
        try:
            assert get(restored, "/home/user/snap.txt") == "in the snapshot"
        finally:
            restored.kill()
    with pytest.raises(SandboxException) as caught:
        Sandbox.create(first.snapshot_id, api_key=BETA)
    assert caught.value.status_code == 404  # type: ignore[attr-defined]

    assert Sandbox.delete_snapshot(first.snapshot_id) is True
    assert Sandbox.delete_snapshot(first.snapshot_id) is False
    assert Sandbox.delete_snapshot(second.snapshot_id, api_key=BETA) is False  # another's looks missing
    assert Sandbox.delete_snapshot(second.snapshot_id) is True
    assert Sandbox.delete_snapshot(TEMPLATE) is False  # a published template is not a snapshot
    with pytest.raises(SandboxException) as caught:
        Sandbox.create(first.snapshot_id)
    assert caught.value.status_code == 404  # type: ignore[attr-defined]


def test_async_fork_and_snapshot(served: E2bEdge) -> None:
    async def scenario() -> tuple[str, str]:
        box = await AsyncSandbox.create(TEMPLATE, timeout=120)
        made: list[Any] = []
        try:
            await box.commands.run("printf async > /home/user/a.txt")
            forks = await box.fork(count=1)
            made += forks
            snap = await box.create_snapshot()
            restored = await AsyncSandbox.create(snap.snapshot_id, timeout=60)
            made.append(restored)
            assert snap.snapshot_id in [s.snapshot_id for s in await box.list_snapshots().next_items()]
            assert await AsyncSandbox.delete_snapshot(snap.snapshot_id) is True
            cat = "cat /home/user/a.txt"
            return (await forks[0].commands.run(cat)).stdout, (await restored.commands.run(cat)).stdout
        finally:
            for b in [box, *made]:
                if isinstance(b, AsyncSandbox):
                    await b.kill()

    assert asyncio.run(scenario()) == ("async", "async")


# -- templates ---------------------------------------------------------------------------------------------
def test_templates_are_listed_with_aliases_and_isolation_and_building_is_refused(served: E2bEdge) -> None:
    name = "e2b-vm-template"
    status, _, box = served.edge.http("POST", "/v1/sandboxes", {"image": "img/python"})
    assert status == 201, box
    try:
        status, _, ckpt = served.edge.http("POST", f"/v1/sandboxes/{box['id']}/checkpoint", {
            "name": name, "labels": {"layerbox.shared": "true", "layerbox.isolation": "microvm"}})
        assert status == 201, ckpt
    finally:
        served.edge.http("DELETE", f"/v1/sandboxes/{box['id']}")
    status, listed = call(served, "GET", "/templates")
    assert status == 200, listed
    by_id = {t["templateID"]: t for t in listed}
    assert by_id[TEMPLATE]["aliases"] == [TEMPLATE]
    assert by_id[TEMPLATE]["public"] is True
    assert by_id[TEMPLATE]["buildStatus"] == "ready"
    assert "isolation container" in by_id[TEMPLATE]["description"]
    assert "isolation microvm" in by_id[name]["description"]
    assert "img/python" in by_id
    assert Template.exists(TEMPLATE) is True
    assert Template.exists("no-such-template") is False
    status, err = call(served, "GET", "/templates/aliases/Bad%20Name")
    assert status == 400
    assert "templateID" in err["message"], err
    for method, path in (("POST", "/v3/templates"), ("POST", "/v2/templates/x/builds/b"),
                         ("GET", "/templates/x/builds/b/status")):
        status, err = call(served, method, path, body={} if method == "POST" else None)
        assert status == 501, (path, err)
        assert "layerbox publish" in err["message"]


# -- network, metrics, logs ---------------------------------------------------------------------------------
def test_network_is_updated_at_run_time_and_logged(sbx: Sandbox, served: E2bEdge) -> None:
    assert sbx.get_info().allow_internet_access is True
    sbx.update_network({"allow_out": ["10.1.2.3"], "deny_out": ["0.0.0.0/0"]})
    assert sbx.get_info().allow_internet_access is False
    sbx.update_network({})  # omitted fields are cleared: the internet again
    assert sbx.get_info().allow_internet_access is True
    status, err = call(served, "PUT", f"/sandboxes/{sbx.sandbox_id}/network", body={"denyOut": ["8.8.8.8"]})
    assert status == 400
    assert "denyOut" in err["message"]
    status, logs = call(served, "GET", f"/v2/sandboxes/{sbx.sandbox_id}/logs?search=network")
    assert status == 200
    assert [e["fields"]["action"] for e in logs["logs"]] == ["network", "network"]


def test_metrics_are_a_real_sample(sbx: Sandbox, served: E2bEdge) -> None:
    spin = sbx.commands.run("while :; do :; done", background=True, timeout=0)
    try:
        sbx.commands.run("head -c 1048576 /dev/zero > /home/user/blob.bin")
        for _ in range(20):  # a loaded host may not run the loop in one 0.2 s sample: a few, bounded
            metrics = sbx.get_metrics()
            if metrics[0].cpu_used_pct > 0:
                break
    finally:
        spin.kill()
    assert len(metrics) == 1
    m = metrics[0]
    assert m.cpu_count >= 1
    assert 0 < m.cpu_used_pct <= 100
    assert 0 < m.mem_used <= m.mem_total
    assert (1 << 20) <= m.disk_used <= m.disk_total
    now = time.time()
    assert Sandbox.get_metrics(sbx.sandbox_id, start=_dt(now - 60), end=_dt(now + 60)) != []
    assert Sandbox.get_metrics(sbx.sandbox_id, start=_dt(now + 3600)) == []  # a window in the future
    status, many = call(served, "GET", f"/sandboxes/metrics?sandbox_ids={sbx.sandbox_id},lb-000000000000")
    assert status == 200
    assert list(many["sandboxes"]) == [sbx.sandbox_id]
    status, err = call(served, "GET", f"/sandboxes/{sbx.sandbox_id}/metrics?start=5&end=4")
    assert status == 400
    assert "end" in err["message"]


def test_logs_are_the_sandboxs_receipts(sbx: Sandbox, served: E2bEdge) -> None:
    sbx.commands.run("echo one")
    with pytest.raises(Exception):  # noqa: B017,PT011  (CommandExitException: the exit code is the point)
        sbx.commands.run("exit 3")
    status, v2 = call(served, "GET", f"/v2/sandboxes/{sbx.sandbox_id}/logs")
    assert status == 200
    actions = [e["fields"]["action"] for e in v2["logs"]]
    assert actions[0] in ("create", "restore")
    assert "exec" in actions
    warned = [e for e in v2["logs"] if e["level"] == "warn"]
    assert warned
    assert all("exit_code=3" in e["message"] for e in warned)
    status, only = call(served, "GET", f"/v2/sandboxes/{sbx.sandbox_id}/logs?level=warn&direction=backward&limit=1")
    assert status == 200
    assert len(only["logs"]) == 1
    assert only["logs"][0]["level"] == "warn"
    status, v1 = call(served, "GET", f"/sandboxes/{sbx.sandbox_id}/logs?limit=2")
    assert status == 200
    assert len(v1["logs"]) == 2
    assert len(v1["logEntries"]) == 2
    assert v1["logs"][0]["line"] == v2["logs"][0]["message"]
    status, err = call(served, "GET", f"/v2/sandboxes/{sbx.sandbox_id}/logs?direction=sideways")
    assert status == 400
    assert "direction" in err["message"]
    status, _ = call(served, "GET", f"/v2/sandboxes/{sbx.sandbox_id}/logs", key=BETA)
    assert status == 404


# -- lifetime ------------------------------------------------------------------------------------------------
def test_pause_then_connect_resumes_with_its_processes_and_files(served: E2bEdge) -> None:
    box = Sandbox.create(TEMPLATE, timeout=120, metadata={"case": "pause"})
    try:
        put(box, "/home/user/kept.txt", "kept")
        handle = box.commands.run("sleep 600", background=True)
        assert box.pause() is True
        assert box.pause() is False  # already paused: the SDK's False (409)
        info = Sandbox.get_info(box.sandbox_id)
        assert info.state == SandboxState.PAUSED
        assert info.end_at > info.started_at
        again = Sandbox.connect(box.sandbox_id, timeout=60)
        assert Sandbox.get_info(box.sandbox_id).state == SandboxState.RUNNING
        assert get(again, "/home/user/kept.txt") == "kept"
        assert handle.pid in [p.pid for p in again.commands.list()]
        assert again.commands.run("echo awake").stdout == "awake\n"
    finally:
        box.kill()


def test_a_filesystem_pause_goes_to_the_store_and_resumes_on_another_edge(served: E2bEdge,
                                                                        second: EdgeProcess) -> None:
    on_b = {"api_url": second.url, "sandbox_url": second.url}
    box = Sandbox.create(TEMPLATE, timeout=120, metadata={"case": "move"})
    try:
        put(box, "/home/user/moved.txt", "moved")
        assert box.pause(mode="filesystem") is True
        assert box.sandbox_id not in alpha_ids(served.url)  # nothing of it left on the first edge
        assert box.pause(mode="filesystem") is False  # already paused
        info = Sandbox.get_info(box.sandbox_id, **on_b)  # the other edge reads it from the store
        assert info.state == SandboxState.PAUSED
        assert info.metadata == {"case": "move"}
        assert info.template_id == TEMPLATE
        paused = Sandbox.list(query=SandboxQuery(metadata={"case": "move"}), **on_b).next_items()
        assert [s.sandbox_id for s in paused] == [box.sandbox_id]
        with pytest.raises(SandboxNotFoundException):
            Sandbox.get_info(box.sandbox_id, api_key=BETA, **on_b)  # another project's: missing

        moved = Sandbox.connect(box.sandbox_id, timeout=60, **on_b)
        assert moved.sandbox_id == box.sandbox_id
        assert get(moved, "/home/user/moved.txt") == "moved"
        assert box.sandbox_id in alpha_ids(second.url)
        assert box.sandbox_id not in alpha_ids(served.url)
        assert Sandbox.get_info(box.sandbox_id, **on_b).state == SandboxState.RUNNING
        with pytest.raises(SandboxNotFoundException):  # it runs on the other edge now, not here
            Sandbox.connect(box.sandbox_id)
    finally:
        Sandbox.kill(box.sandbox_id, **on_b)
        Sandbox.kill(box.sandbox_id)
    assert Sandbox.list(query=SandboxQuery(metadata={"case": "move"}), **on_b).next_items() == []


def test_two_edges_resuming_one_paused_sandbox_at_once_start_it_once(served: E2bEdge,
                                                                      second: EdgeProcess) -> None:
    box = Sandbox.create(TEMPLATE, timeout=120)
    try:
        box.pause(mode="filesystem")

        def connect(url: str) -> str:
            try:
                Sandbox.connect(box.sandbox_id, timeout=60, api_url=url, sandbox_url=url)
                return "resumed"
            except SandboxException as exc:  # 409 (claimed by the other) or 404 (runs on the other now)
                return str(exc.status_code)  # type: ignore[attr-defined]

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            outcomes = sorted(pool.map(connect, [served.url, second.url]))
        assert outcomes[1] == "resumed"
        assert outcomes[0] in ("404", "409")
        assert [box.sandbox_id in alpha_ids(url) for url in (served.url, second.url)].count(True) == 1
    finally:
        for url in (served.url, second.url):
            Sandbox.kill(box.sandbox_id, api_url=url)


def test_a_sandbox_paused_into_the_store_is_resumed_here_or_killed(served: E2bEdge) -> None:
    box = Sandbox.create(TEMPLATE, timeout=120)
    other = Sandbox.create(TEMPLATE, timeout=120)
    try:
        put(box, "/home/user/f.txt", "kept")
        box.pause(mode="filesystem")
        other.pause(mode="filesystem")
        with pytest.raises(SandboxException) as caught:  # in the store: resume it first
            Sandbox.set_timeout(other.sandbox_id, 30)
        assert caught.value.status_code == 409  # type: ignore[attr-defined]
        assert Sandbox.kill(other.sandbox_id, api_key=BETA) is False
        assert other.kill() is True  # a paused one is killed in the store
        assert Sandbox.kill(other.sandbox_id) is False
        again = Sandbox.connect(box.sandbox_id, timeout=60)  # the same edge: restored with its id
        assert get(again, "/home/user/f.txt") == "kept"
        assert again.is_running()
    finally:
        box.kill()
        other.kill()


def test_a_sandbox_past_its_timeout_is_reaped_and_seen_gone(served: E2bEdge) -> None:
    box = Sandbox.create(TEMPLATE, timeout=1)
    deadline = time.monotonic() + 120  # a bound on a hung reaper, not a measure of it
    while box.is_running() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not box.is_running()
    assert box.sandbox_id not in alpha_ids(served.url)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(box.sandbox_id)
    assert box.kill() is False


def test_a_timeout_ends_at_its_deadline_not_at_the_reapers_next_round(served: E2bEdge, store_url: str,  # noqa: F811
                                                                       tmp_path_factory: pytest.TempPathFactory) -> None:
    """An edge whose full reaper round comes every 10 minutes still ends a sandbox at the timeout a
    client set (E2B's ``set_timeout``), and pauses one whose timeout is set to 0 (now) with
    ``on_timeout: pause``: the reaper wakes at the soonest deadline (sandbox/host/deadlines.py),
    not at its next round."""
    with running("e2b-slow-reaper", tmp_path_factory.mktemp("slow"), store_url, TOKENS, "--reap-interval", "600",
                 token=ADMIN) as edge:
        on = {"api_url": edge.url, "sandbox_url": edge.url}
        box = Sandbox.create(TEMPLATE, timeout=300, **on)
        paused = Sandbox.create(TEMPLATE, timeout=300, lifecycle={"on_timeout": "pause"}, **on)
        try:
            box.set_timeout(1)
            paused.set_timeout(0)  # E2B's "time out now": paused at once, as on_timeout says
            deadline = time.monotonic() + 60  # a bound on a hung reaper: its next full round is 600 s away
            while (box.is_running() or paused.get_info().state != SandboxState.PAUSED) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not box.is_running()
            assert box.sandbox_id not in alpha_ids(edge.url)
            assert paused.get_info().state == SandboxState.PAUSED
        finally:
            box.kill()
            paused.kill()


def test_auto_pause_pauses_at_the_timeout_with_the_processes_and_connect_resumes(served: E2bEdge) -> None:
    box = Sandbox.create(TEMPLATE, timeout=2, lifecycle={"on_timeout": "pause"})
    try:
        counter = box.commands.run("n=0; while true; do n=$((n+1)); echo $n > /tmp/n.new; mv /tmp/n.new /tmp/n; sleep 0.1; done",
                                   background=True, timeout=0)
        deadline = time.monotonic() + 120  # a bound on a hung reaper, not a measure of it
        while Sandbox.get_info(box.sandbox_id).state != SandboxState.PAUSED and time.monotonic() < deadline:
            time.sleep(0.2)
        info = Sandbox.get_info(box.sandbox_id)
        assert info.state == SandboxState.PAUSED  # paused, not killed
        assert info.end_at - info.started_at > datetime.timedelta(hours=1)  # it waits for a resume
        again = Sandbox.connect(box.sandbox_id, timeout=60)
        first = int(again.commands.run("cat /tmp/n").stdout)
        time.sleep(0.5)
        assert int(again.commands.run("cat /tmp/n").stdout) > first  # the same process counts on
        assert counter.pid in [p.pid for p in again.commands.list()]
        with pytest.raises(SandboxException) as caught:  # a filesystem pause at the timeout is not served
            Sandbox.create(TEMPLATE, lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}})
        assert caught.value.status_code == 400
        assert "autoPauseMemory" in str(caught.value)
    finally:
        box.kill()


def wait_paused(sid: str) -> None:
    deadline = time.monotonic() + 120  # a bound on a hung reaper, not a measure of it
    while Sandbox.get_info(sid).state != SandboxState.PAUSED and time.monotonic() < deadline:
        time.sleep(0.2)
    assert Sandbox.get_info(sid).state == SandboxState.PAUSED


def resumes(served: E2bEdge, sid: str) -> int:
    status, logs = call(served, "GET", f"/v2/sandboxes/{sid}/logs")
    assert status == 200
    return [e["fields"]["action"] for e in logs["logs"]].count("resume")


def test_auto_resume_wakes_a_paused_sandbox_on_its_traffic_once_and_only_for_its_owner(served: E2bEdge) -> None:
    box = Sandbox.create(TEMPLATE, timeout=2, lifecycle={"on_timeout": "pause", "auto_resume": True})
    sid = box.sandbox_id
    try:
        assert box.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": True}
        box.commands.run("n=0; while true; do n=$((n+1)); echo $n > /tmp/n.new; mv /tmp/n.new /tmp/n; sleep 0.1; done", background=True,
                         timeout=0)
        box.commands.run("mkdir -p www && echo woken > www/index.txt")
        box.commands.run("cd www && exec python3 -m http.server 8000 --bind 127.0.0.1", background=True, timeout=0)
        box.commands.run("for i in $(seq 200); do (exec 3<>/dev/tcp/127.0.0.1/8000) 2>/dev/null && exit 0; "
                         "sleep 0.05; done; exit 1")
        wait_paused(sid)
        before = resumes(served, sid)
        # the attack first: another project's key naming it, a token of another sandbox: not woken
        other = httpx.get(served.url + "/health", headers=envd_headers(sid, **{"X-API-Key": BETA}), timeout=30)
        assert other.status_code == 502
        forged = httpx.get(served.url + "/index.txt", timeout=30,
                           headers=envd_headers(sid, 8000, **{"e2b-traffic-access-token": "A" * 43}))
        assert forged.status_code == 502
        assert Sandbox.get_info(sid).state == SandboxState.PAUSED
        # its own traffic to a port wakes it: the request is answered, not refused
        served_page = httpx.get(served.url + "/index.txt", timeout=30,
                                headers=envd_headers(sid, 8000, **{"e2b-traffic-access-token": str(box.traffic_access_token)}))
        assert (served_page.status_code, served_page.text) == (200, "woken\n")
        info = Sandbox.get_info(sid)
        assert info.state == SandboxState.RUNNING
        # E2B's rule: at least five minutes from the resume, then it pauses again
        assert datetime.timedelta(seconds=250) < info.end_at - datetime.datetime.now(datetime.UTC) \
            <= datetime.timedelta(seconds=301)
        first = int(box.files.read("/tmp/n"))
        time.sleep(0.5)
        assert int(box.files.read("/tmp/n")) > first  # the same process counts on
        # paused again (by hand): calls racing to its envd share one resume
        assert box.pause() is True
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            read = list(pool.map(lambda _: box.files.read("/tmp/n"), range(6)))
        assert all(int(n) > first for n in read)
        assert Sandbox.get_info(sid).state == SandboxState.RUNNING
        assert resumes(served, sid) == before + 2  # one per wake, not one per request
    finally:
        box.kill()


def test_without_auto_resume_a_paused_sandbox_waits_for_connect(served: E2bEdge) -> None:
    box = Sandbox.create(TEMPLATE, timeout=120, lifecycle={"on_timeout": "pause", "auto_resume": False})
    try:
        assert box.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": False}
        assert box.pause() is True
        assert box.is_running() is False
        with pytest.raises(SandboxException):
            box.commands.run("true")
        assert Sandbox.get_info(box.sandbox_id).state == SandboxState.PAUSED
        box.connect()
        assert box.is_running() is True
    finally:
        box.kill()
    for body, field in (({"autoResume": {"enabled": True}}, "autoResume"),  # no pause for it to follow
                        ({"autoPause": True, "autoResume": {"enabled": "yes"}}, "autoResume.enabled"),
                        ({"autoPause": True, "autoResume": {"enabled": True, "after": 1}}, "autoResume")):
        status, err = call(served, "POST", "/sandboxes", body={"templateID": TEMPLATE, **body})
        assert status == 400, body
        assert field in err["message"], err
    # the service's own labels (project, template, on-ttl, auto-resume) fit beside the most metadata
    most = {"templateID": TEMPLATE, "autoPause": True, "autoResume": {"enabled": True}, "timeout": 60,
            "metadata": {f"k{i}": "v" for i in range(59)}}
    status, made = call(served, "POST", "/sandboxes", body=most)
    assert status == 201, made
    assert call(served, "DELETE", f"/sandboxes/{made['sandboxID']}")[0] == 204
    status, err = call(served, "POST", "/sandboxes", body={**most, "metadata": {f"k{i}": "v" for i in range(60)}})
    assert status == 400
    assert "metadata" in err["message"]


def test_connect_lengthens_a_running_sandboxs_timeout_never_shortens_it(served: E2bEdge) -> None:
    box = Sandbox.create(TEMPLATE, timeout=600)
    try:
        end = Sandbox.get_info(box.sandbox_id).end_at
        Sandbox.connect(box.sandbox_id, timeout=30)
        assert Sandbox.get_info(box.sandbox_id).end_at == end
        Sandbox.connect(box.sandbox_id, timeout=1200)
        assert Sandbox.get_info(box.sandbox_id).end_at > end
    finally:
        box.kill()


# -- list, and the errors the SDK maps ------------------------------------------------------------------------
def test_list_filters_by_metadata_and_state_and_pages(served: E2bEdge) -> None:
    run = uuid.uuid4().hex[:8]
    boxes = [Sandbox.create(TEMPLATE, timeout=120, metadata={"run": run, "n": str(i)}) for i in range(3)]
    try:
        boxes[0].pause()
        pages = Sandbox.list(query=SandboxQuery(metadata={"run": run}), limit=2)
        first = pages.next_items()
        assert len(first) == 2
        assert pages.has_next
        rest = pages.next_items()
        assert not pages.has_next
        assert sorted(s.sandbox_id for s in first + rest) == sorted(b.sandbox_id for b in boxes)
        paused = Sandbox.list(query=SandboxQuery(metadata={"run": run}, state=[SandboxState.PAUSED])).next_items()
        assert [s.sandbox_id for s in paused] == [boxes[0].sandbox_id]
        running = Sandbox.list(query=SandboxQuery(metadata={"run": run, "n": "2"},
                                                  state=[SandboxState.RUNNING])).next_items()
        assert [s.sandbox_id for s in running] == [boxes[2].sandbox_id]
        assert Sandbox.list(query=SandboxQuery(metadata={"run": run}), api_key=BETA).next_items() == []
        # E2B's order: newest first unless asked; startedAfter and template filter
        query = SandboxQuery(metadata={"run": run})
        made = [b.sandbox_id for b in boxes]
        assert [s.sandbox_id for s in Sandbox.list(query=query).next_items()] == made[::-1]
        assert [s.sandbox_id for s in Sandbox.list(query=query, order="asc").next_items()] == made
        second_started = Sandbox.get_info(made[1]).started_at  # then or later, as E2B's
        later = Sandbox.list(query=SandboxQuery(metadata={"run": run}, started_after=second_started)).next_items()
        assert [s.sandbox_id for s in later] == made[:0:-1]
        assert Sandbox.list(query=SandboxQuery(metadata={"run": run}, template="no-such")).next_items() == []
        assert len(Sandbox.list(query=SandboxQuery(metadata={"run": run}, template=TEMPLATE)).next_items()) == 3
    finally:
        kill_all(boxes)


def test_each_failure_raises_the_sdks_exception(sbx: Sandbox, served: E2bEdge) -> None:
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info("lb-000000000000")
    with pytest.raises(SandboxNotFoundException):  # another project's sandbox looks missing
        Sandbox.get_info(sbx.sandbox_id, api_key=BETA)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(sbx.sandbox_id, api_key=BETA)
    assert Sandbox.kill(sbx.sandbox_id, api_key=BETA) is False
    assert sbx.is_running()
    with pytest.raises(NotFoundException):
        Sandbox.fork(sbx.sandbox_id, api_key=BETA)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.create_snapshot(sbx.sandbox_id, api_key=BETA)
    with pytest.raises(SandboxException) as caught:
        Sandbox.create("no-such-template")
    assert caught.value.status_code == 404  # type: ignore[attr-defined]
    with pytest.raises(AuthenticationException):
        Sandbox.create(TEMPLATE, api_key="not-a-key-0123456789")
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key="not-a-key-0123456789").next_items()
    for kwargs, field in (({"metadata": {"bad key!": "v"}}, "metadata"), ({"timeout": -1}, "timeout")):
        with pytest.raises(SandboxException) as caught:
            Sandbox.create(TEMPLATE, **kwargs)
        assert caught.value.status_code == 400, kwargs  # type: ignore[attr-defined]
        assert field in str(caught.value)
    status, err = call(served, "GET", "/sandboxes/not-an-id")  # names no sandbox: E2B's 404
    assert status == 404
    assert "sandboxID" in err["message"]
    assert Sandbox.kill("not-an-id") is False  # as against E2B: the SDK's kill of an unknown id
    status, err = call(served, "GET", "/v2/sandboxes?limit=0")
    assert status == 400
    assert "limit" in err["message"]


def test_metadata_cannot_claim_the_services_own_labels(served: E2bEdge) -> None:
    """The attack: a tenant naming the owner, sharing, egress or reaper labels through E2B's metadata."""
    before = alpha_ids(served.url)
    for key in ("layerbox.project", "layerbox.shared", "layerbox.egress.protected", "layerbox.on-ttl",
                "layerbox.e2b.template"):
        with pytest.raises(SandboxException) as caught:
            Sandbox.create(TEMPLATE, metadata={key: "beta" if key == "layerbox.project" else "true"})
        assert caught.value.status_code == 400, key  # type: ignore[attr-defined]
        assert "metadata" in str(caught.value)
    assert alpha_ids(served.url) == before  # nothing was made


def test_the_project_quota_is_a_rate_limit(served: E2bEdge) -> None:
    boxes: list[Sandbox] = []
    try:
        for _ in range(4):
            boxes.append(Sandbox.create(TEMPLATE, timeout=120, api_key=BETA))
        with pytest.raises(RateLimitException):
            Sandbox.create(TEMPLATE, api_key=BETA, retries=0)
    finally:
        kill_all(boxes)


def _dt(t: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(t, datetime.UTC)
