"""The hostile tenant through the E2B surface: another project's sandbox looks exactly like a missing one.

One real edge (tests/support/e2b.py's projects alpha and beta, and gamma, disabled) serving
``<port>-<id>.sbx.layerbox.test`` host names, one sandbox of alpha's and one of beta's.  Beta
tries alpha's sandbox on every control-plane route, on envd's routes (by ``E2b-Sandbox-Id`` and
by host name) with its API key and with its own sandbox's envd and traffic tokens; every answer
(status, content type and body, the id written as ``<id>``) is compared whole with the answer
for a well-formed id nobody has, so a tenant learns nothing.  Ids with a bad grammar are 400
naming the field, before any lookup (alpha's own id in upper case is refused, not folded);
missing and unknown keys are 401, a disabled project's 403.

A route this commit does not serve yet (aiohttp's own 404) is skipped with its name: the
comparison runs once it is merged.
"""

from __future__ import annotations

import base64
import http.client
import importlib.util
import json
import secrets
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.e2b import ADMIN, ALPHA, BETA, TEMPLATE, TOKENS, make_template
from support.edges import EdgeProcess, running
from support.edges import http as native
from support.sandboxes import store_url  # noqa: F401  (a module's store with the fixture image)

pytestmark = pytest.mark.root

DOMAIN = "sbx.layerbox.test"
GAMMA = "gamma-token-0123456789"  # a disabled project's
UNKNOWN = "nobody-token-0123456789"
ENVD = 49983
GONE = "sandbox_not_found: The sandbox <id> was not found"  # E2B proxy's words, after the native code
PROJECTS = {"projects": {**TOKENS["projects"], "gamma": {"tokens": [GAMMA], "disabled": True}}}


@dataclass(frozen=True)
class Answer:
    status: int
    content_type: str
    body: Any  # JSON decoded, else the bytes

    def message(self) -> str:
        body = self.body if isinstance(self.body, dict) else {}
        native = body.get("error") if isinstance(body.get("error"), dict) else {}
        return str(body.get("message") or native.get("message") or "")


@dataclass
class World:
    edge: EdgeProcess
    alpha: dict[str, Any]  # the create answers: sandboxID, envdAccessToken, trafficAccessToken
    beta: dict[str, Any]
    pid: int = 0  # a process (sleep 600) running in alpha's sandbox

    def call(self, method: str, path: str, headers: dict[str, str], body: bytes | dict[str, Any] | None = None, *,
             sid: str = "") -> Answer:
        """One request as a client sends it (any Host, any header); ``sid`` written as ``<id>``."""
        raw = json.dumps(body).encode() if isinstance(body, dict) else body
        headers = {"Content-Type": "application/json", **headers} if isinstance(body, dict) else headers
        conn = http.client.HTTPConnection("127.0.0.1", self.edge.port, timeout=60)
        try:
            conn.request(method, path, body=raw, headers=headers)
            r = conn.getresponse()
            data, status, kind = r.read(), r.status, r.getheader("Content-Type", "")
        finally:
            conn.close()
        if sid:
            data = data.replace(sid.encode(), b"<id>")
        try:
            return Answer(status, kind, json.loads(data) if data else None)
        except ValueError:
            return Answer(status, kind, data)

    def alphas(self) -> Answer:
        """Alpha's own view of its sandbox."""
        return self.call("GET", f"/sandboxes/{self.alpha['sandboxID']}", {"X-API-Key": ALPHA})

    def alphas_processes(self) -> list[int]:
        answer = self.call("POST", "/process.Process/List", {**UNARY, "X-API-Key": ALPHA,
                                                             "E2b-Sandbox-Id": self.alpha["sandboxID"]}, b"{}")
        assert answer.status == 200, answer
        return [int(p["pid"]) for p in answer.body.get("processes", [])]


def missing_id(world: World) -> str:
    while (sid := "lb-" + secrets.token_hex(6)) in (world.alpha["sandboxID"], world.beta["sandboxID"]):
        pass
    return sid


def not_served(answer: Answer) -> bool:
    """aiohttp's own 404/405 (the router's, in either error shape): the route is not there yet."""
    body = answer.body if isinstance(answer.body, dict) else {}
    native = body.get("error") if isinstance(body.get("error"), dict) else {}
    return answer.status in (404, 405) and (native.get("code") == "http" or answer.message().startswith("http:"))


def create(edge: EdgeProcess, key: str) -> dict[str, Any]:
    world = World(edge, {}, {})
    answer = world.call("POST", "/sandboxes", {"X-API-Key": key}, {"templateID": TEMPLATE, "timeout": 900})
    assert answer.status == 201, answer
    return dict(answer.body)


@pytest.fixture(scope="module")
def world(store_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:  # noqa: F811
    root = tmp_path_factory.mktemp("e2b-tenancy")
    with running("e2bt", root, store_url, PROJECTS, "--e2b-domain", DOMAIN, token=ADMIN) as edge:
        make_template(edge)
        made: list[tuple[str, str]] = []
        try:
            alpha = create(edge, ALPHA)
            made.append((ALPHA, alpha["sandboxID"]))
            beta = create(edge, BETA)
            made.append((BETA, beta["sandboxID"]))
            status, _, cmd = native("POST", f"{edge.url}/v1/sandboxes/{alpha['sandboxID']}/commands",
                                  {"cmd": "sleep 600"}, token=ALPHA)
            assert status in (200, 201), cmd
            world = World(edge, alpha, beta)
            (world.pid,) = world.alphas_processes()
            yield world
        finally:
            for key, sid in made:
                World(edge, {}, {}).call("DELETE", f"/sandboxes/{sid}", {"X-API-Key": key})
            assert edge.sandboxes() == []


# -- the control plane ----------------------------------------------------------------------------------

REST = [("GET", "/sandboxes/{id}", None), ("DELETE", "/sandboxes/{id}", None),
        ("POST", "/sandboxes/{id}/timeout", {"timeout": 30}), ("POST", "/sandboxes/{id}/timeout", {"timeout": "x"}),
        ("POST", "/sandboxes/{id}/refreshes", {"duration": 30}), ("POST", "/sandboxes/{id}/pause", None),
        ("POST", "/sandboxes/{id}/resume", {}), ("POST", "/sandboxes/{id}/connect", {"timeout": 30}),
        ("POST", "/v2/sandboxes/{id}/connect", {"timeout": 30}),
        ("PUT", "/sandboxes/{id}/network", {"allowOut": ["10.0.0.0/8"]}),
        ("GET", "/sandboxes/{id}/metrics", None), ("GET", "/sandboxes/{id}/logs", None),
        ("GET", "/v2/sandboxes/{id}/logs", None), ("POST", "/sandboxes/{id}/fork", {"count": 1}),
        ("POST", "/sandboxes/{id}/snapshots", {})]
REST_IDS = [f"{m} {p}" + (f" {json.dumps(b)}" if b else "") for m, p, b in REST]


@pytest.mark.parametrize(("method", "path", "body"), REST, ids=REST_IDS)
def test_betas_key_on_alphas_sandbox_answers_every_route_like_a_missing_id(
        world: World, method: str, path: str, body: dict[str, Any] | None) -> None:
    sid, nobody = world.alpha["sandboxID"], missing_id(world)
    before = world.alphas()
    theirs = world.call(method, path.format(id=sid), {"X-API-Key": BETA}, body, sid=sid)
    missing = world.call(method, path.format(id=nobody), {"X-API-Key": BETA}, body, sid=nobody)
    assert not not_served(missing), f"{method} {path} is not served"
    assert theirs == missing
    assert (missing.status, missing.body["code"]) == (404, 404), missing
    assert "<id>" in missing.message()
    after = world.alphas()  # and nothing happened to alpha's sandbox
    assert after == before
    assert (after.status, after.body["state"]) == (200, "running")


def test_beta_lists_none_of_alphas_sandboxes(world: World) -> None:
    sid = world.alpha["sandboxID"]
    for path in ("/sandboxes", "/v2/sandboxes", "/v2/sandboxes?state=running,paused"):
        answer = world.call("GET", path, {"X-API-Key": BETA})
        assert answer.status == 200, answer
        assert [s["sandboxID"] for s in answer.body] == [world.beta["sandboxID"]]
        mine = world.call("GET", path, {"X-API-Key": ALPHA})
        assert sid in [s["sandboxID"] for s in mine.body]


# -- envd, by header and by host name ----------------------------------------------------------------


def envelope(doc: dict[str, Any]) -> bytes:
    """One Connect streaming message: flags, length, JSON."""
    data = json.dumps(doc).encode()
    return struct.pack(">BI", 0, len(data)) + data


UNARY = {"Content-Type": "application/json", "Connect-Protocol-Version": "1"}
STREAM = {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"}
ENVD_ROUTES = ["health", "envs", "files", "process List", "process Start", "process SendSignal",
               "process Connect"]
OWNER_CONTROL = ("health", "envs", "files", "process List", "process Start")  # the others would end or hold alpha's


def envd_route(world: World, route: str) -> tuple[str, str, dict[str, str], bytes | None]:
    """method, path, headers, body of an envd call; the process calls name alpha's running process."""
    process = {"process": {"pid": world.pid}}
    return {
        "health": ("GET", "/health", {}, None),
        "envs": ("GET", "/envs", {}, None),
        "files": ("GET", "/files?path=/etc/hostname", {}, None),
        "process List": ("POST", "/process.Process/List", UNARY, b"{}"),
        "process Start": ("POST", "/process.Process/Start", STREAM,
                          envelope({"process": {"cmd": "/bin/sh", "args": ["-c", "echo hi"]}})),
        "process SendSignal": ("POST", "/process.Process/SendSignal", UNARY,
                               json.dumps({**process, "signal": "SIGNAL_SIGKILL"}).encode()),
        "process Connect": ("POST", "/process.Process/Connect", STREAM, envelope(process)),
    }[route]


CREDENTIALS = {
    "beta's key": lambda w: {"X-API-Key": BETA},
    "beta's sandbox's envd token": lambda w: {"X-Access-Token": w.beta["envdAccessToken"]},
}


def skip_unserved(route: str) -> None:
    """Every envd route is served: a module missing is this test's failure, never a skip."""
    if route == "files":
        assert importlib.util.find_spec("sandbox.edge.e2b.files") is not None, "envd's /files is not served"


def owners_answer_works(world: World, route: str, headers: dict[str, str]) -> None:
    """The control: alpha's own envd token on the same route succeeds, so a refusal is the tenancy's."""
    if route not in OWNER_CONTROL:
        assert world.pid in world.alphas_processes()
        return
    method, path, extra, body = envd_route(world, route)
    answer = world.call(method, path, {**headers, **extra, "X-Access-Token": world.alpha["envdAccessToken"]}, body)
    assert answer.status in (200, 204), answer
    if route == "process Start":
        assert base64.b64encode(b"hi\n") in answer.body
        assert b'"error"' not in answer.body


@pytest.mark.parametrize("route", ENVD_ROUTES)
@pytest.mark.parametrize("credential", list(CREDENTIALS))
def test_alphas_sandbox_id_on_envd_answers_like_a_missing_sandbox(world: World, route: str, credential: str) -> None:
    skip_unserved(route)
    method, path, extra, body = envd_route(world, route)
    sid, nobody = world.alpha["sandboxID"], missing_id(world)
    creds = CREDENTIALS[credential](world)
    owners_answer_works(world, route, {"E2b-Sandbox-Id": sid})
    theirs = world.call(method, path, {**creds, **extra, "E2b-Sandbox-Id": sid}, body, sid=sid)
    missing = world.call(method, path, {**creds, **extra, "E2b-Sandbox-Id": nobody}, body, sid=nobody)
    assert theirs == missing
    if route in ("health", "envs", "files"):  # E2B's proxy's answer for a sandbox that is not there
        assert (missing.status, missing.message()) == (502, GONE), missing
    else:  # a Connect error (unary) or an end of stream carrying one
        assert missing.status != 200 or b'"error"' in missing.body, missing
    assert world.alphas().body["state"] == "running"
    assert world.pid in world.alphas_processes()  # beta's SendSignal killed nothing


@pytest.mark.parametrize("route", ENVD_ROUTES)
@pytest.mark.parametrize("credential", list(CREDENTIALS))
def test_a_host_naming_another_projects_sandbox_answers_like_a_missing_one(
        world: World, route: str, credential: str) -> None:
    skip_unserved(route)
    method, path, extra, body = envd_route(world, route)
    sid, nobody = world.alpha["sandboxID"], missing_id(world)
    creds = CREDENTIALS[credential](world)
    owners_answer_works(world, route, {"Host": f"{ENVD}-{sid}.{DOMAIN}"})
    theirs = world.call(method, path, {**creds, **extra, "Host": f"{ENVD}-{sid}.{DOMAIN}"}, body, sid=sid)
    missing = world.call(method, path, {**creds, **extra, "Host": f"{ENVD}-{nobody}.{DOMAIN}"}, body, sid=nobody)
    assert theirs == missing
    assert missing.status != 200 or b'"error"' in missing.body, missing
    assert world.pid in world.alphas_processes()


@pytest.mark.parametrize("header", ["X-API-Key", "X-Access-Token", "e2b-traffic-access-token"])
def test_another_sandboxs_port_answers_like_a_missing_one(world: World, header: str) -> None:
    """A port other than envd's (the port proxy), with beta's key, or beta's sandbox's envd or traffic
    token: alpha's sandbox answers as a sandbox that is not there, before any connection to it."""
    sid, nobody = world.alpha["sandboxID"], missing_id(world)
    value = {"X-API-Key": BETA, "X-Access-Token": world.beta["envdAccessToken"],
             "e2b-traffic-access-token": world.beta["trafficAccessToken"]}[header]
    for target in (lambda s: {"Host": f"8080-{s}.{DOMAIN}"},
                   lambda s: {"E2b-Sandbox-Id": s, "E2b-Sandbox-Port": "8080"}):
        theirs = world.call("GET", "/", {header: value, **target(sid)}, sid=sid)
        missing = world.call("GET", "/", {header: value, **target(nobody)}, sid=nobody)
        assert theirs == missing
        assert (missing.status, missing.message()) == (502, GONE), missing


def test_alphas_paused_sandbox_stays_paused_and_missing_to_beta(world: World) -> None:
    """Beta's connect or resume must not thaw alpha's paused sandbox: every answer is a missing id's."""
    sid, nobody = world.alpha["sandboxID"], missing_id(world)
    assert world.call("POST", f"/sandboxes/{sid}/pause", {"X-API-Key": ALPHA}).status == 204
    try:
        paused = world.alphas()
        assert paused.body["state"] == "paused"
        for method, path, body in REST:
            theirs = world.call(method, path.format(id=sid), {"X-API-Key": BETA}, body, sid=sid)
            missing = world.call(method, path.format(id=nobody), {"X-API-Key": BETA}, body, sid=nobody)
            assert theirs == missing, (method, path)
        for headers in ({"X-API-Key": BETA}, {"X-Access-Token": world.beta["envdAccessToken"]}):
            theirs = world.call("GET", "/health", {**headers, "E2b-Sandbox-Id": sid}, sid=sid)
            missing = world.call("GET", "/health", {**headers, "E2b-Sandbox-Id": nobody}, sid=nobody)
            assert theirs == missing
        assert world.alphas() == paused
    finally:
        resumed = world.call("POST", f"/sandboxes/{sid}/connect", {"X-API-Key": ALPHA}, {})
    assert resumed.status == 201, resumed
    assert world.alphas().body["state"] == "running"


def test_another_projects_snapshot_as_a_template_answers_like_a_missing_one(world: World) -> None:
    sid = world.alpha["sandboxID"]
    status, _, ckpt = native("POST", f"{world.edge.url}/v1/sandboxes/{sid}/checkpoint", {"name": "tenancy-snap"},
                           token=ALPHA)
    assert status == 201, ckpt
    try:
        own = world.call("POST", "/sandboxes", {"X-API-Key": ALPHA}, {"templateID": ckpt["name"], "timeout": 60})
        assert own.status == 201, own  # the control: alpha starts from it
        assert world.call("DELETE", f"/sandboxes/{own.body['sandboxID']}", {"X-API-Key": ALPHA}).status == 204
        for ref, nothere in ((ckpt["name"], ckpt["name"] + "-not-there"),
                             (ckpt["digest"], ckpt["digest"][:-1] + ("0" if ckpt["digest"][-1] != "0" else "1"))):
            theirs = world.call("POST", "/sandboxes", {"X-API-Key": BETA}, {"templateID": ref}, sid=ref)
            missing = world.call("POST", "/sandboxes", {"X-API-Key": BETA}, {"templateID": nothere}, sid=nothere)
            assert theirs == missing
            assert (missing.status, missing.body["code"]) == (404, 404), missing
    finally:
        native("DELETE", f"{world.edge.url}/v1/checkpoints/{ckpt['name']}", token=ALPHA)


# -- ids with a bad grammar, and who calls ---------------------------------------------------------


def bad_ids(world: World) -> list[str]:
    """Ids nothing may look up: alpha's own in upper case (ids are lower case: not folded), a path
    out, a very long one, a non-hex digit, a control character."""
    sid = world.alpha["sandboxID"]
    return [sid.upper(), "..%2F..%2Fetc%2Fpasswd", "lb-" + "0" * 600, sid[:-1] + "g", sid[:6] + "%0A" + sid[6:]]


@pytest.mark.parametrize(("method", "path", "body"), [r for r in REST if r[2] != {"timeout": "x"}], ids=[
    i for i, r in zip(REST_IDS, REST, strict=True) if r[2] != {"timeout": "x"}])
def test_a_path_id_with_a_bad_grammar_is_404_naming_sandboxID(world: World, method: str, path: str,
                                                              body: dict[str, Any] | None) -> None:
    """An id that cannot be one names no sandbox: E2B's 404 (the SDK's kill of it returns False),
    the message naming the field, and nothing looked up or touched."""
    before = world.alphas()
    probe = world.call(method, path.format(id=missing_id(world)), {"X-API-Key": ALPHA}, body)
    assert not not_served(probe), f"{method} {path} is not served"
    for bad in bad_ids(world):
        answer = world.call(method, path.format(id=bad), {"X-API-Key": ALPHA}, body)
        assert (answer.status, answer.body["code"]) == (404, 404), (bad, answer)
        assert answer.message().startswith("sandbox_not_found: sandboxID:"), answer
    assert world.alphas() == before  # alpha's sandbox, named in upper case, was not touched


def test_an_envd_header_with_a_bad_grammar_is_400_naming_it(world: World) -> None:
    token = {"X-Access-Token": world.alpha["envdAccessToken"]}
    for bad in [*bad_ids(world), ""]:
        answer = world.call("GET", "/health", {**token, "E2b-Sandbox-Id": bad})
        assert (answer.status, answer.body["code"]) == (400, 400), (bad, answer)
        assert answer.message().startswith("invalid_field: E2b-Sandbox-Id:"), answer
    for port in ("0", "65536", "http", "-1", "+80"):
        answer = world.call("GET", "/health", {**token, "E2b-Sandbox-Id": world.alpha["sandboxID"],
                                               "E2b-Sandbox-Port": port})
        assert (answer.status, answer.body["code"]) == (400, 400), (port, answer)
        assert answer.message().startswith("invalid_field: E2b-Sandbox-Port:"), answer
    answer = world.call("GET", "/health", {**token, "E2b-Sandbox-Port": str(ENVD)})
    assert (answer.status, answer.body["code"]) == (400, 400)
    assert answer.message().startswith("invalid_field: E2b-Sandbox-Id:"), answer


def test_a_host_name_with_a_bad_grammar_is_400_naming_the_host(world: World) -> None:
    sid = world.alpha["sandboxID"]
    token = {"X-Access-Token": world.alpha["envdAccessToken"]}
    for label in (f"{ENVD}-{sid[:-1]}g", f"{ENVD}-{sid.replace('-', '_')}", f"{ENVD}-lb-{'0' * 58}", f"99999-{sid}",
                  f"0-{sid}"):
        answer = world.call("GET", "/health", {**token, "Host": f"{label}.{DOMAIN}"})
        assert (answer.status, answer.body["code"]) == (400, 400), (label, answer)
        assert answer.message().startswith("invalid_field: Host:"), answer
    # host names are case-insensitive (DNS): alpha's id in a host name in upper case is alpha's
    upper = world.call("GET", "/health", {**token, "Host": f"{ENVD}-{sid.upper()}.{DOMAIN.upper()}"})
    assert upper.status == 204, upper


@pytest.mark.parametrize("key", [None, UNKNOWN, GAMMA], ids=["no key", "unknown key", "disabled project"])
def test_no_key_unknown_key_and_disabled_project_answer_the_same_for_any_id(world: World, key: str | None) -> None:
    sid, nobody = world.alpha["sandboxID"], missing_id(world)
    headers = {} if key is None else {"X-API-Key": key}
    want = 403 if key == GAMMA else 401
    for method, path, body in [("GET", "/sandboxes", None), ("GET", "/v2/sandboxes", None),
                               ("POST", "/sandboxes", {"templateID": TEMPLATE}), *REST]:
        theirs = world.call(method, path.format(id=sid), headers, body, sid=sid)
        missing = world.call(method, path.format(id=nobody), headers, body, sid=nobody)
        if not_served(missing):
            continue
        assert theirs == missing, (method, path)
        assert (missing.status, missing.body["code"]) == (want, want), (method, path, missing)
    # envd: a key decides as on the control plane; no credential at all is 401
    envd = world.call("GET", "/health", {**headers, "E2b-Sandbox-Id": sid}, sid=sid)
    assert (envd.status, envd.body["code"]) == (want, want), envd
    assert world.alphas().body["state"] == "running"


def test_an_unknown_envd_token_answers_like_a_missing_sandbox(world: World) -> None:
    sid, nobody = world.alpha["sandboxID"], missing_id(world)
    forged = {"X-Access-Token": world.alpha["envdAccessToken"][:-2] + "AA"}
    theirs = world.call("GET", "/envs", {**forged, "E2b-Sandbox-Id": sid}, sid=sid)
    missing = world.call("GET", "/envs", {**forged, "E2b-Sandbox-Id": nobody}, sid=nobody)
    assert theirs == missing
    assert (missing.status, missing.message()) == (502, GONE)
    # alpha's traffic token is not its envd token, nor the reverse
    traffic = world.call("GET", "/envs", {"X-Access-Token": world.alpha["trafficAccessToken"], "E2b-Sandbox-Id": sid},
                         sid=sid)
    assert traffic == missing


def test_the_edge_log_has_no_internal_error(world: World) -> None:
    """No request above reached an unhandled exception in the edge (500s are logged with a traceback)."""
    log = Path(world.edge.log).read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]
