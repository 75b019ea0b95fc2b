"""The fleet for real: ``layerbox fleet up`` starts PostgreSQL, two gateways and four edges as
separate processes (their own data dirs, one shared store), and every test goes through the
gateways as a client would: the native API and SDK, the stock ``e2b`` SDK, and the attacks.

The edges admit 5 sandboxes each (20 in the fleet); the project ``demo`` may hold 40 across it.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandbox.edge.trust import GATEWAY_HEADER, sign_request
from tests import sdk_sample
from tests.support.edges import free_port, http
from tests.support.env import require
from tests.support.sandboxes import REF, store_url  # noqa: F401  (the module's store with the fixture image)

REPO = Path(__file__).resolve().parents[1]
PER_EDGE = 5
EDGES = 4
LOST_AFTER = 6.0
DOMAIN = "sandboxes.test"


def layerbox(*args: str, timeout: float = 300) -> Any:
    """``layerbox ARGS --json``, its JSON (the CLI as scripts use it)."""
    done = subprocess.run([sys.executable, "-m", "tools.cli", *args, "--json"], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"layerbox {' '.join(args)}: {done.stderr[-3000:]}"
    return json.loads(done.stdout)


class Fleet:
    def __init__(self, root: Path, state: dict[str, Any]) -> None:
        self.root, self.state = root, state
        self.gateways = [g["url"] for g in state["gateways"]]
        self.token = state["project"]["token"]
        self.admin = state["admin_token"]

    def cli(self, *args: str) -> Any:
        return layerbox("fleet", "--dir", str(self.root), *args)

    def edges(self) -> dict[str, dict[str, Any]]:
        return {e["id"]: e for e in self.cli("edges")}

    def reload(self) -> None:
        self.state = json.loads((self.root / "fleet.json").read_text())

    def edge_pid(self, edge_id: str) -> int:
        self.reload()
        return int(next(e["pid"] for e in self.state["edges"] if e["id"] == edge_id))

    def on_edges(self, project: str = "demo") -> dict[str, list[str]]:
        """Which of ``project``'s sandboxes each edge runs, asked of the edges (signed as a gateway would)."""
        out = {}
        for e in self.state["edges"]:
            key = bytes.fromhex((self.root / f"{e['id']}.key").read_text())
            try:
                status, _, body = edge_http(e["url"], "GET", "/v1/sandboxes", key, admin=False, project=project)
            except OSError:
                continue
            out[e["id"]] = [] if status != 200 else [b["id"] for b in body["sandboxes"]]
        return out


def edge_http(url: str, method: str, path: str, key: bytes, *, admin: bool, project: str = "demo",
              header: str | None = None) -> tuple[int, dict[str, str], Any]:
    from sandbox.edge.trust import Caller

    signed = header or sign_request(key, method, path, Caller(project, 100, admin), time.time())
    req = urllib.request.Request(url + path, method=method, headers={GATEWAY_HEADER: signed})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read() or b"null")


@pytest.fixture(scope="module")
def fleet(store_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:  # noqa: F811
    require("root")
    root = tmp_path_factory.mktemp("fleet") / "f"
    state = layerbox("fleet", "--dir", str(root), "up", "--store", store_url, "--pools", f"onprem={EDGES}",
                     "--gateways", "2", "--max-sandboxes", "40", "--edge-arg=--max-sandboxes", f"--edge-arg={PER_EDGE}",
                     "--gateway-arg=--lost-after", f"--gateway-arg={LOST_AFTER}", "--e2b-domain", DOMAIN, timeout=300)
    try:
        yield Fleet(root, state)
    finally:
        down = layerbox("fleet", "--dir", str(root), "down")
        assert down["postgres"] is True
        assert not root.exists()
        for proc in [*state["gateways"], *state["edges"]]:
            assert not Path(f"/proc/{proc['pid']}").exists() or "Z" in Path(f"/proc/{proc['pid']}/stat").read_text()


@pytest.fixture
def clean(fleet: Fleet) -> Iterator[Fleet]:
    """The test's fleet; every sandbox the project holds is removed after it (and the test fails if
    the gateways' view and the edges' disagree then)."""
    yield fleet
    for token in (fleet.token, fleet.admin):
        status, _, body = http("GET", fleet.gateways[0] + "/v1/sandboxes", token=token)
        assert status == 200, body
        for sb in body["sandboxes"]:
            http("DELETE", f"{fleet.gateways[0]}/v1/sandboxes/{sb['id']}", token=token)


def create(url: str, token: str, **body: Any) -> tuple[int, Any]:
    status, _, doc = http("POST", url + "/v1/sandboxes", {"image": REF, **body}, token=token, timeout=120)
    return status, doc


def run(url: str, token: str, sid: str, cmd: str) -> str:
    """``cmd``'s stdout (it must exit 0), from the exec stream's events."""
    status, _, out = http("POST", f"{url}/v1/sandboxes/{sid}/exec", {"cmd": cmd}, token=token, timeout=120)
    assert status == 200, out
    events = [out] if isinstance(out, dict) else [json.loads(line) for line in str(out).splitlines() if line.strip()]
    assert (events[-1]["type"], events[-1].get("exit_code")) == ("exit", 0), events
    return b"".join(base64.b64decode(e["data"]) for e in events if e["type"] == "stdout").decode()


# -- the CLI's promises ---------------------------------------------------------------------------------
def test_fleet_up_json_and_the_registry(fleet: Fleet) -> None:
    s = fleet.state
    assert s["db"].startswith("postgresql://")
    assert len(s["gateways"]) == 2
    assert s["project"]["name"] == "demo"
    assert s["project"]["token"].startswith("lbk_")
    assert [(e["id"], e["pool"]) for e in s["edges"]] == [(f"edge-{i}", "onprem") for i in range(EDGES)]
    assert all(isinstance(e["pid"], int) and e["url"].startswith("http://127.0.0.1:") for e in s["edges"])
    edges = fleet.edges()
    assert sorted(edges) == [f"edge-{i}" for i in range(EDGES)]
    for e in edges.values():
        assert e["pool"] == "onprem"
        assert e["state"] == "active"
        assert e["last_seen_age"] < 5
        assert e["load"]["sandboxes"]["max"] == PER_EDGE
        assert "container" in e["capabilities"]["isolation"]
    added = fleet.cli("project", "add", "scratch", "--max-sandboxes", "2")
    assert added["name"] == "scratch"
    assert added["token"].startswith("lbk_")
    status, _, body = http("GET", fleet.gateways[1] + "/v1/sandboxes", token=added["token"])
    assert (status, body) == (200, {"sandboxes": []})
    listed = {p["name"]: p for p in fleet.cli("projects")}
    assert listed["scratch"]["max_sandboxes"] == 2
    assert listed["scratch"]["live"] == 0
    # the tokens are kept hashed: the database holds no token in the clear
    from sandbox.fleet.pg import bin_dir

    dump = subprocess.run([str(bin_dir() / "pg_dump"), "--data-only", s["db"]], capture_output=True,
                          text=True, timeout=60)
    assert dump.returncode == 0, dump.stderr
    assert added["token"] not in dump.stdout
    assert fleet.token not in dump.stdout


# -- routing ----------------------------------------------------------------------------------------------
def test_every_per_sandbox_call_routes_through_the_other_gateway(clean: Fleet) -> None:
    """The SDK's sample agent (files, commands, a background server behind a signed preview URL, a
    terminal over a WebSocket, a checkpoint, a job lease, fork, restore, a FnCall) against one
    gateway, on sandboxes another gateway created."""
    g0, g1 = clean.gateways
    status, box = create(g0, clean.token)
    assert status == 201, box
    assert "hello" in run(g1, clean.token, box["id"], "echo hello")
    status, _, _ = http("PUT", f"{g1}/v1/sandboxes/{box['id']}/files?path=/root/x.txt", token=clean.token)
    report = asyncio.run(sdk_sample.async_agent(g1, clean.token, REF, "fleet-job"))
    assert (report.answer, report.failed_with, report.served, report.terminal_exit, report.fork_saw,
            report.branch_saw, report.doubled, report.lease_state) == (
        45, 3, sdk_sample.TASK, 4, sdk_sample.TASK, sdk_sample.TASK, 42, "active")
    assert report.checkpoint == "projects/demo/fleet-job-step-1"
    status, _, _ = http("DELETE", f"{g1}/v1/sandboxes/{box['id']}", token=clean.token)
    assert status == 204
    status, _, _ = http("GET", f"{g0}/v1/sandboxes/{box['id']}", token=clean.token)
    assert status == 404


def test_another_projects_sandbox_is_missing_from_every_gateway(clean: Fleet) -> None:
    other = clean.cli("project", "add", "intruder", "--max-sandboxes", "5")["token"]
    status, box = create(clean.gateways[0], clean.token)
    assert status == 201, box
    sid = box["id"]
    for g in clean.gateways:
        for method, path, body in (("GET", "", None), ("POST", "/exec", {"cmd": "id"}), ("DELETE", "", None),
                                   ("GET", "/files?path=/etc/passwd", None), ("POST", "/fork", {})):
            status, _, answer = http(method, f"{g}/v1/sandboxes/{sid}{path}", body, token=other)
            assert status == 404, (g, method, path, answer)
        # E2B's in-sandbox routing with the intruder's key: E2B's "not found"
        req = urllib.request.Request(g + "/health", headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983",
                                                              "X-API-Key": other})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 502
    assert "lb-" in run(clean.gateways[1], clean.token, sid, "hostname")  # still there, still theirs


def test_e2b_host_names_route_through_any_gateway(clean: Fleet) -> None:
    """``<port>-<id>.<domain>`` (E2B_DOMAIN behind a TLS proxy) reaches the sandbox's envd through
    either gateway, with the sandbox's own access token."""
    g0, g1 = clean.gateways
    status, box = create(g0, clean.token)
    assert status == 201, box
    req = urllib.request.Request(f"{g0}/sandboxes/{box['id']}", headers={"X-API-Key": clean.token})
    with urllib.request.urlopen(req, timeout=30) as r:
        token = json.loads(r.read())["envdAccessToken"]

    def envd(gateway: str, sid: str, access: str) -> int:
        req = urllib.request.Request(gateway + "/envs", headers={"Host": f"49983-{sid}.{DOMAIN}",
                                                                 "X-Access-Token": access})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return int(r.status)
        except urllib.error.HTTPError as exc:
            return exc.code

    assert envd(g1, box["id"], token) == 200
    assert envd(g0, box["id"], token) == 200
    assert envd(g1, box["id"], "not-its-token") in (401, 502)
    assert envd(g1, "lb-000000000000", token) == 502


def test_ids_and_fields_are_checked_at_the_gateway(clean: Fleet) -> None:
    g = clean.gateways[0]
    for bad in ("..%2F..%2Fetc", "lb-XYZ", "lb-0123456789abc"):
        status, _, body = http("GET", f"{g}/v1/sandboxes/{bad}", token=clean.token)
        assert (status, body["error"]["field"]) == (400, "id"), body
        # on E2B's control plane such an id names no sandbox: its 404, as at an edge, never routed
        req = urllib.request.Request(f"{g}/sandboxes/{bad}", method="DELETE", headers={"X-API-Key": clean.token})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 404
        assert "sandboxID" in json.loads(err.value.read())["message"]
    before = {p["name"]: p for p in clean.cli("projects")}["demo"]
    status, body = create(g, clean.token, memory="lots")
    assert (status, body["error"]["field"]) == (400, "memory"), body
    status, body = create(g, clean.token, isolation="teleport")
    assert (status, body["error"]["field"]) == (400, "isolation"), body
    status, _, body = http("POST", g + "/v1/sandboxes", {"image": REF}, token="lbk_not-a-token-at-all")
    assert status == 401, body
    after = {p["name"]: p for p in clean.cli("projects")}["demo"]
    assert after["live"] == before["live"]
    assert after["reserved"] == 0


def test_an_edge_takes_only_gateways(clean: Fleet) -> None:
    """An edge of a fleet: no token opens it, only a gateway's signature for that exact request, once."""
    e = clean.state["edges"][0]
    key = bytes.fromhex((clean.root / f"{e['id']}.key").read_text())
    status, _, body = http("GET", e["url"] + "/v1/sandboxes", token=clean.token)
    assert (status, "gateway" in body["error"]["message"]) == (401, True), body
    status, _, body = edge_http(e["url"], "GET", "/v1/sandboxes", bytes(32), admin=False)
    assert status == 401, body  # the wrong key
    other = bytes.fromhex((clean.root / "edge-1.key").read_text())
    status, _, body = edge_http(e["url"], "GET", "/v1/sandboxes", other, admin=False)
    assert status == 401, body  # another edge's key opens only that edge
    signed = sign_request(key, "GET", "/v1/sandboxes", None, time.time())
    status, _, body = edge_http(e["url"], "GET", "/v1/capabilities", key, admin=False, header=signed)
    assert status == 401, body  # signed for another path
    signed = sign_request(key, "GET", "/v1/load", None, time.time() - 3600)
    status, _, body = edge_http(e["url"], "GET", "/v1/load", key, admin=False, header=signed)
    assert (status, "clock" in body["error"]["message"]) == (401, True), body  # too old
    first = edge_http(e["url"], "GET", "/v1/sandboxes", key, admin=False)
    assert first[0] == 200
    fresh = sign_request(key, "GET", "/v1/sandboxes", None, time.time())
    assert edge_http(e["url"], "GET", "/v1/sandboxes", key, admin=False, header=fresh)[0] in (200, 401)
    assert edge_http(e["url"], "GET", "/v1/sandboxes", key, admin=False, header=fresh)[0] == 401  # replayed
    # a heartbeat signed with another edge's key is refused, and changes nothing
    body_bytes = json.dumps({"edge": e["id"], "pool": "evil", "url": "http://127.0.0.1:1", "boot": "x",
                             "capabilities": {}, "load": {}}).encode()
    from sandbox.edge.trust import EDGE_HEADER, sign_report

    req = urllib.request.Request(clean.gateways[0] + "/fleet/v1/heartbeat", data=body_bytes, method="POST",
                                 headers={EDGE_HEADER: sign_report(other, e["id"], body_bytes, time.time())})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 401
    assert clean.edges()[e["id"]]["pool"] == "onprem"


# -- quotas and placement ---------------------------------------------------------------------------------
def test_fleet_quota_is_exact_under_50_concurrent_creates_through_both_gateways(clean: Fleet) -> None:
    quota = 7
    token = clean.cli("project", "add", "racer", "--max-sandboxes", str(quota), "--creates-per-second", "1000")["token"]

    def one(i: int) -> tuple[int, Any]:
        return create(clean.gateways[i % 2], token)

    with concurrent.futures.ThreadPoolExecutor(50) as pool:
        answers = list(pool.map(one, range(50)))
    made = [doc["id"] for status, doc in answers if status == 201]
    refused = [doc["error"]["code"] for status, doc in answers if status != 201]
    try:
        assert len(made) == quota, answers
        assert set(refused) == {"quota_exceeded"}, refused
        racer = {p["name"]: p for p in clean.cli("projects")}["racer"]
        assert (racer["live"], racer["reserved"]) == (quota, 0)
        on_edges = [sid for ids in clean.on_edges("racer").values() for sid in ids]
        assert sorted(on_edges) == sorted(made)  # exactly what the table says: nothing leaked
    finally:
        for sid in made:
            http("DELETE", f"{clean.gateways[1]}/v1/sandboxes/{sid}", token=token)
    racer = {p["name"]: p for p in clean.cli("projects")}["racer"]
    assert racer["live"] == 0


def test_creates_spread_until_every_edge_is_full_then_capacity(clean: Fleet) -> None:
    """Creates go on until the fleet is full, and only then are refused (503 capacity, retryable):
    each edge's admission had the last word, and no edge was left with room."""
    made: list[str] = []
    tries = 0
    for i in range(2 * EDGES * PER_EDGE + 3):  # (FnCall pools left by other tests hold some slots too)
        status, body = create(clean.gateways[i % 2], clean.token)
        if status == 201:
            made.append(body["id"])
            continue
        # a 503 is retryable: one that did not ask every edge (one briefly out of the gateway's
        # candidates, its heartbeat late on a loaded host) is retried, as a client would
        tries += 1
        if tries == 3 or len(re.findall(r"edge-\d+: HTTP 503", str(body))) == EDGES:
            break
        time.sleep(2)
    assert (status, body["error"]["code"], body["error"]["retryable"]) == (503, "capacity", True), body
    on = clean.on_edges()
    assert sorted(sid for ids in on.values() for sid in ids) == sorted(made)
    assert all(ids for ids in on.values()), on  # every edge took some
    # Every edge was asked and its admission said it had no slot, at that moment: a later report may
    # show room again (a FnCall pool of another test idles out), so the refusals are the evidence.
    refused = dict(re.findall(r"(edge-\d+): HTTP 503 \(([^)]*)", body["error"]["message"]))
    assert sorted(refused) == sorted(on), body
    assert all(f"needs 1 sandbox slot, 0 of {PER_EDGE} free" in why for why in refused.values()), refused


def test_a_drained_edge_takes_no_creates(clean: Fleet) -> None:
    clean.cli("drain", "edge-0")
    try:
        assert clean.edges()["edge-0"]["state"] == "draining"
        time.sleep(1.5)  # one registry refresh of each gateway
        made = []
        for i in range(6):
            status, box = create(clean.gateways[i % 2], clean.token)
            assert status == 201, box
            made.append(box["id"])
        assert not set(made) & set(clean.on_edges()["edge-0"])
    finally:
        clean.cli("undrain", "edge-0")


def test_drain_move_takes_sandboxes_with_their_ids_and_files_to_other_edges(clean: Fleet) -> None:
    drained = _only(clean, "edge-3")
    try:
        made = []
        for i in range(2):
            status, box = create(clean.gateways[0], clean.token, env={"MARK": f"m{i}"}, workdir="/tmp")
            assert status == 201, box
            run(clean.gateways[0], clean.token, box["id"], f"echo kept-{i} > /root/state.txt")
            made.append(box["id"])
        assert sorted(clean.on_edges()["edge-3"]) == sorted(made)
    finally:
        _undrain(clean, drained)
    moved = clean.cli("drain", "edge-3", "--move")
    try:
        assert (moved["state"], moved["failed"]) == ("draining", []), moved
        assert sorted(m["sandbox"] for m in moved["moved"]) == sorted(made)
        on = clean.on_edges()
        assert not set(made) & set(on["edge-3"])
        for i, sid in enumerate(made):
            assert sid in {s for ids in on.values() for s in ids}
            out = run(clean.gateways[1], clean.token, sid, "cat /root/state.txt; echo $MARK; pwd")
            assert out.split() == [f"kept-{i}", f"m{i}", "/tmp"], out
        demo = {p["name"]: p for p in clean.cli("projects")}["demo"]
        assert demo["live"] == len(made)
    finally:
        clean.cli("undrain", "edge-3")


def test_a_gateway_with_a_stale_route_follows_a_sandbox_another_gateway_moved(clean: Fleet) -> None:
    g0, g1 = clean.gateways
    status, box = create(g0, clean.token)
    assert status == 201, box
    sid = box["id"]
    run(g0, clean.token, sid, "echo before > /root/moved.txt")  # g0 holds the route now
    first = next(e for e, ids in clean.on_edges().items() if sid in ids)
    drained = _only(clean, next(e for e in clean.edges() if e != first))  # only another edge takes creates
    try:
        headers = {"X-API-Key": clean.token, "Content-Type": "application/json"}
        for path, body, want in (("pause", {"memory": False}, 204), ("connect", {"timeout": 300}, 201)):
            req = urllib.request.Request(f"{g1}/sandboxes/{sid}/{path}", data=json.dumps(body).encode(),
                                         method="POST", headers=headers)
            with urllib.request.urlopen(req, timeout=120) as r:
                assert r.status == want
        now_on = next(e for e, ids in clean.on_edges().items() if sid in ids)
        assert now_on != first
        assert run(g0, clean.token, sid, "cat /root/moved.txt").strip() == "before"  # through g0's stale route
    finally:
        _undrain(clean, drained)


# -- the E2B SDK ------------------------------------------------------------------------------------------------
def test_the_e2b_sdk_through_two_gateways(clean: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    g0, g1 = clean.gateways
    status, box = create(g0, clean.admin)
    assert status == 201, box
    run(g0, clean.admin, box["id"], "useradd -m -u 1000 -s /bin/bash user")
    status, _, ckpt = http("POST", f"{g0}/v1/sandboxes/{box['id']}/checkpoint",
                           {"name": "fleet-base", "labels": {"layerbox.shared": "true"}}, token=clean.admin, timeout=300)
    assert status == 201, ckpt
    http("DELETE", f"{g0}/v1/sandboxes/{box['id']}", token=clean.admin)
    for key, value in {"E2B_API_KEY": clean.token, "E2B_API_URL": g0, "E2B_SANDBOX_URL": g1}.items():
        monkeypatch.setenv(key, value)
    from e2b import Sandbox

    sbx = Sandbox.create("fleet-base")
    try:
        assert sbx.commands.run("id -un").stdout.strip() == "user"
        sbx.files.write("/home/user/note.txt", "kept across edges")
        assert sbx.sandbox_id in [s.sandbox_id for s in Sandbox.list().next_items()]
        sbx.pause(mode="filesystem")  # into the store: it resumes on whichever edge placement picks
        again = Sandbox.connect(sbx.sandbox_id)
        assert again.files.read("/home/user/note.txt") == "kept across edges"
        assert again.commands.run("echo $((6*7))").stdout.strip() == "42"
    finally:
        Sandbox.kill(sbx.sandbox_id)
    assert sbx.sandbox_id not in [s.sandbox_id for s in Sandbox.list().next_items()]


# -- faults -------------------------------------------------------------------------------------------------------
def test_an_edge_killed_mid_exec_is_lost_then_comes_back(clean: Fleet) -> None:
    g0, g1 = clean.gateways
    status, box = create(g0, clean.token)
    assert status == 201, box
    sid = box["id"]
    edge = next(e for e, ids in clean.on_edges().items() if sid in ids)
    pid = clean.edge_pid(edge)
    live = {p["name"]: p for p in clean.cli("projects")}["demo"]["live"]

    def long_exec() -> tuple[int, Any]:
        status, _, out = http("POST", f"{g1}/v1/sandboxes/{sid}/exec", {"cmd": "sleep 30"}, token=clean.token,
                              timeout=60)
        return status, out

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(long_exec)
        time.sleep(1.0)
        os.kill(pid, signal.SIGKILL)
        try:  # the stream ends, at once, in an error (never a hang, never a clean exit)
            ended = str(pending.result(timeout=60))
        except Exception as exc:
            ended = repr(exc)
    try:
        assert '"exit_code": 0' not in ended, ended
        deadline = time.monotonic() + LOST_AFTER + 15
        while time.monotonic() < deadline:  # (both gateways answer "lost", so both have it cached so)
            answers = [http("GET", f"{g}/v1/sandboxes/{sid}", token=clean.token) for g in (g0, g1)]
            if all(status == 404 and "lost" in body["error"]["message"] for status, _, body in answers):
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"the sandbox was never reported lost by both gateways: {answers}")
        demo = {p["name"]: p for p in clean.cli("projects")}["demo"]
        assert demo["live"] == live - 1  # a lost sandbox leaves the quota
    finally:
        clean.cli("restart", edge)  # adopts its sandboxes, registers, reports them
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # through both: the one its reports reach and the other
        answers = [http("GET", f"{g}/v1/sandboxes/{sid}", token=clean.token) for g in (g0, g1)]
        if all(status == 200 for status, _, _ in answers):
            break
        time.sleep(0.5)
    assert [status for status, _, _ in answers] == [200, 200], answers
    assert "back" in run(g1, clean.token, sid, "echo back")


def test_a_killed_gateway_leaves_its_clients_to_the_other(clean: Fleet) -> None:
    g0, g1 = clean.gateways
    status, box = create(g0, clean.token)
    assert status == 201, box
    pid = next(g["pid"] for g in clean.state["gateways"] if g["url"] == g0)
    os.kill(pid, signal.SIGKILL)
    try:
        assert "still" in run(g1, clean.token, box["id"], "echo still")
        status, again = create(g1, clean.token)
        assert status == 201, again
    finally:
        clean.cli("restart", g0)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if http("GET", g0 + "/fleet/v1/health", token="")[0] == 200:
                break
        except OSError:
            time.sleep(0.2)
    assert "again" in run(g0, clean.token, box["id"], "echo again")


def test_a_stalled_edge_leaves_the_candidates_and_comes_back(clean: Fleet) -> None:
    """An edge that answers nothing (SIGSTOP: it accepts connections and says nothing) stops
    heartbeating: after the registry's staleness bound no create waits on it."""
    pid = clean.edge_pid("edge-1")
    os.kill(pid, signal.SIGSTOP)
    made = []
    try:
        deadline = time.monotonic() + 30
        while clean.edges()["edge-1"]["last_seen_age"] < 11:  # the placement's staleness bound is 10 s
            assert time.monotonic() < deadline
            time.sleep(0.5)
        for i in range(4):
            status, box = create(clean.gateways[i % 2], clean.token)
            assert status == 201, box
            made.append(box["id"])
    finally:
        os.kill(pid, signal.SIGCONT)
    assert not set(made) & set(clean.on_edges()["edge-1"])
    deadline = time.monotonic() + 30
    while clean.edges()["edge-1"]["last_seen_age"] > 2:
        assert time.monotonic() < deadline
        time.sleep(0.5)


def test_postgres_down_routes_from_cache_refuses_creates_and_recovers(clean: Fleet) -> None:
    from sandbox.fleet.pg import LocalPostgres

    g0, g1 = clean.gateways
    status, box = create(g0, clean.token)
    assert status == 201, box
    run(g1, clean.token, box["id"], "true")  # g1 has the route cached now
    pg = LocalPostgres(Path(clean.state["postgres"]["root"]), port=clean.state["postgres"]["port"])
    pg.stop(remove=False)
    try:
        assert "cached" in run(g1, clean.token, box["id"], "echo cached")
        status, body = create(g1, clean.token)
        assert (status, body["error"]["retryable"]) == (503, True), body
    finally:
        pg.password = clean.state["db"].split(":")[2].split("@")[0]
        pg.start()
    deadline = time.monotonic() + 30
    while True:
        status, again = create(g0, clean.token)
        if status == 201 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert status == 201, again  # no gateway restarted


def _only(fleet: Fleet, keep: str) -> list[str]:
    """Drain every edge but ``keep``; the ones drained (undrain them after)."""
    drained = [e for e in fleet.edges() if e != keep]
    for e in drained:
        fleet.cli("drain", e)
    time.sleep(1.5)  # each gateway's next registry refresh
    return drained


def _undrain(fleet: Fleet, edges: list[str]) -> None:
    for e in edges:
        fleet.cli("undrain", e)
    time.sleep(1.5)


def test_an_edge_killed_mid_create_leaks_nothing(clean: Fleet) -> None:
    """The create answers an error, its reservation goes, and whatever the edge had made by then
    is adopted by its restart and counted: the table, the quota and the edges agree."""
    drained = _only(clean, "edge-2")
    try:
        pid = clean.edge_pid("edge-2")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(create, clean.gateways[0], clean.token)
            time.sleep(0.15)
            os.kill(pid, signal.SIGKILL)
            status, body = pending.result(timeout=120)
        assert status in (201, 502, 503), body
        clean.cli("restart", "edge-2")
        deadline = time.monotonic() + 60
        while True:
            demo = {p["name"]: p for p in clean.cli("projects")}["demo"]
            on = clean.on_edges().get("edge-2", [])
            if (demo["live"], demo["reserved"]) == (len(on), 0) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert (demo["live"], demo["reserved"]) == (len(on), 0), (demo, on)
        if status == 201:
            assert body["id"] in on
    finally:
        _undrain(clean, drained)


def test_an_edge_on_a_skewed_clock_joins_and_serves(clean: Fleet, tmp_path: Path) -> None:
    """A host whose clock is 10 minutes ahead (libfaketime: the real fault, not a hook): its first
    heartbeat is refused with the fleet's time, it signs and checks by that from then on."""
    require("cmd:faketime")
    key = clean.cli("edge-key", "edge-skew")["key"]
    key_file = tmp_path / "edge-skew.key"
    key_file.write_text(key)
    key_file.chmod(0o600)
    argv = list(clean.state["edges"][0]["argv"])
    for flag, value in (("--data-dir", str(tmp_path / "data")), ("--edge-id", "edge-skew"),
                        ("--fleet-key-file", str(key_file)), ("--port", str(free_port()))):
        argv[argv.index(flag) + 1] = value
    # the edge process alone runs on the skewed clock: a sitecustomize drops the preload from what
    # its children (crun, the lazyfetch daemon) inherit
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\nfor k in ('LD_PRELOAD', 'FAKETIME', 'FAKETIME_DONT_FAKE_MONOTONIC'):\n    os.environ.pop(k, None)\n")
    env = {**os.environ, "FAKETIME": "+600s",
           "PYTHONPATH": f"{site}{os.pathsep}{REPO}",
           "LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"}
    with open(tmp_path / "edge.log", "wb") as log:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    drained: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while "edge-skew" not in clean.edges() or clean.edges()["edge-skew"]["last_seen_age"] > 2:
            assert (proc.poll(), time.monotonic() < deadline) == (None, True), (tmp_path / "edge.log").read_text()[-2000:]
            time.sleep(0.3)
        drained = _only(clean, "edge-skew")
        status, box = create(clean.gateways[1], clean.token)
        assert status == 201, box
        assert "skewed" in run(clean.gateways[0], clean.token, box["id"], "echo skewed")
        assert "signed -600 s from the gateway's clock" in (tmp_path / "edge.log").read_text()  # it was refused once
        http("DELETE", f"{clean.gateways[0]}/v1/sandboxes/{box['id']}", token=clean.token)
    finally:
        _undrain(clean, drained)
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        clean.cli("forget", "edge-skew")
    from sandbox.host.manager import SandboxManager

    mgr = SandboxManager(tmp_path / "data")
    mgr.reconcile()
    assert mgr.list() == []
    mgr.close()


class FakeEdge:
    """An edge that answers every request 500 and records what reached it: the fault a real edge
    does not produce on demand (a broken edge), behind the same interface (it heartbeats, signed)."""

    def __init__(self, fleet: Fleet, edge_id: str) -> None:
        from aiohttp import web

        self.fleet, self.id, self.seen = fleet, edge_id, []
        self.key = bytes.fromhex(fleet.cli("edge-key", edge_id)["key"])
        self.port = free_port()

        async def any_request(request: web.Request) -> web.Response:
            self.seen.append(dict(request.headers))
            return web.json_response({"error": {"code": "internal", "message": "broken", "retryable": False}},
                                     status=500)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", any_request)
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        self.threads = concurrent.futures.ThreadPoolExecutor(2)
        self.stopping = False
        self.serving = self.threads.submit(self.loop.run_forever)
        self.beats = self.threads.submit(self._beat_forever)

    def _beat_forever(self) -> None:
        from sandbox.edge.trust import EDGE_HEADER, sign_report

        load = {"time": 0, "accepting": True, "short": [], "sandboxes": {"live": 0, "in_flight": 0, "max": 100,
                                                                         "free": 100},
                "memory": {"total": 1 << 40, "free": 1 << 40}, "pids": {}, "disk": {},
                "load": {"avg1": 0.0, "avg5": 0.0, "avg15": 0.0, "cpus": 64}}
        while not self.stopping:
            load["time"] = time.time()
            body = json.dumps({"edge": self.id, "pool": "onprem", "url": f"http://127.0.0.1:{self.port}",
                               "boot": "fake", "capabilities": {"isolation": ["container"], "cpus": 64},
                               "load": load, "images": [], "layers": [], "sandboxes": []}).encode()
            req = urllib.request.Request(self.fleet.gateways[0] + "/fleet/v1/heartbeat", data=body, method="POST",
                                         headers={EDGE_HEADER: sign_report(self.key, self.id, body, time.time())})
            with contextlib.suppress(OSError):
                urllib.request.urlopen(req, timeout=5).read()
            time.sleep(0.5)

    def close(self) -> None:
        self.stopping = True
        self.beats.result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.serving.result(timeout=30)
        self.threads.shutdown()
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()
        self.fleet.cli("forget", self.id)


def test_a_broken_edge_is_ejected_and_never_sees_a_callers_token(clean: Fleet) -> None:
    fake = FakeEdge(clean, "edge-broken")
    drained = []
    try:
        deadline = time.monotonic() + 30
        while "edge-broken" not in clean.edges():
            assert time.monotonic() < deadline
            time.sleep(0.3)
        drained = _only(clean, "edge-broken")
        answers = [create(clean.gateways[0], clean.token)[0] for _ in range(5)]
        # a create the edge may have made is not retried elsewhere: its 500 is the answer, until the
        # breaker opens (3 in a row) and the edge leaves the candidates: then 503, no edge has room
        assert answers == [500, 500, 500, 503, 503], answers
        assert len(fake.seen) == 3
        for headers in fake.seen:
            lowered = {k.lower(): v for k, v in headers.items()}
            assert "x-api-key" not in lowered
            assert "bearer" not in lowered.get("authorization", "").lower()
            assert clean.token not in json.dumps(headers)
            assert lowered["x-layerbox-gateway"].startswith("v1;")
        _undrain(clean, drained)
        drained = []
        status, box = create(clean.gateways[0], clean.token)
        assert status == 201, box  # a healthy edge takes it; the broken one is still ejected
        assert len(fake.seen) == 3
    finally:
        _undrain(clean, drained)
        fake.close()
