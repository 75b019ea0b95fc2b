"""Fuzz the sandbox service's HTTP API with schemathesis, as root, against real sandboxes.

The service is the documented entry point, ``python -m sandbox.edge``, run as a child
process (tests.support.edges.EdgeProcess) on 127.0.0.1 with containers only, a fast reaper
(``--reap-interval``) and a real store with ``img/python``.  The schema is the running
service's own ``/openapi.json``; every operation gets schemathesis's examples, coverage
(boundary and negative values of every field) and fuzzing phases, in both schema-conforming
and negative modes, sent with the ``fuzz`` project's token.

Fuzzing reaches past the id check: most requests to ``{id}`` name a live sandbox
of the fuzzed project (a plain one, or one with a policed network for the
network route), most ``{job}`` requests name their real jobs, most create and
FnCall bodies name the real image, restore bodies a real checkpoint and run
resume bodies the run a fuzzed preempt wrote; the rest keep the generated value
or name the bystander's sandbox.  Targets that fuzzing destroyed, paused or
preempted are brought back before the next request, and what fuzzed creates
made is destroyed after them (so the quota never stops a create early).  The test
sees and changes the service's state only through its API, as a tenant would; the host's
mount table and crun's list, which the API does not show, it reads from the data dir.

Every response must come within ``DEADLINE``, never be a 5xx (nor an exec stream
ending in an internal error), and have a documented status.  Afterwards the
bystander project's sandbox still runs with its files unchanged, every sandbox
the fuzzed project made is destroyed, nothing new is mounted under the data
dir but the host's shared layer mounts (and the fuzzed project's FnCall pool), a plain
create, exec and destroy still work, and once the edge has stopped nothing of it is left
on the host.

Host names in egress rules never reach the host's resolver (a private-range address): the
edge starts with tests/support/nodns first on its ``PYTHONPATH``, whose ``sitecustomize``
makes ``getaddrinfo`` answer numeric hosts and ``localhost`` only; before fuzzing, a host name
in an egress rule must get its refusal (test_the_edge_resolves_no_host_name).

The regression tests at the end replay, as plain requests, what fuzzing found.
"""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import time
import zlib
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from schemathesis import Case, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import status_code_conformance

from lazyfetch import kmount
from sandbox.core.model import MAX_REF_NAME, POOL_PROJECT_LABEL
from sandbox.host.manager import SandboxManager
from tests.support.edges import REPO, EdgeProcess, running
from tests.support.sandboxes import REF

pytestmark = [pytest.mark.usefixtures("need_root"),
              pytest.mark.root("erofs", "overlay", "fuse", "cmd:crun", "cmd:nft", "cmd:ip")]

FUZZ, BYSTANDER = "fuzz-token-0123456789abc", "bystander-token-0123456789"
# fuzz: its 2 targets, its FnCall pool's 2 ready sandboxes (they count against its quota, and it
# cannot name them to free them) and 1 for the request under test
TOKENS = {"projects": {"fuzz": {"tokens": [FUZZ], "max_sandboxes": 5},
                       "bystander": {"tokens": [BYSTANDER], "max_sandboxes": 1}}}
DEADLINE = 30.0  # per request: exec, create and checkpoint take a second or two, a hang takes forever
EXAMPLES = 10  # per operation in the fuzzing phase (examples and coverage add their own; fewer for the 20-minute budget)
# exec streams end with an "error" event instead of a status: these codes are the service's fault
INTERNAL_CODES = ("internal", "sandbox_error", "receipts_broken")
# the 503s the document promises: the edge is full (a create asking for more disk than it has free),
# every warm pool is busy, the edge is stopping; always retryable
REFUSALS = ("capacity", "busy", "stopping")
# a 502 the document promises: nothing listens on the fuzzed port inside the sandbox (sandbox/edge/ports.py)
CLOSED_PORT = "port_closed"


# -- HTTP for setup and the regression tests ----------------------------------------------------------
def call(url: str, method: str, path: str, token: str | None = FUZZ, body: Any = None,
         **kw: Any) -> requests.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return requests.request(method, url + path, headers=headers, json=body, timeout=DEADLINE, **kw)


def exec_events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def run(url: str, sid: str, cmd: str | list[str], token: str = FUZZ) -> tuple[int, str]:
    resp = call(url, "POST", f"/v1/sandboxes/{sid}/exec", token, {"cmd": cmd})
    assert resp.status_code == 200, resp.text
    events = exec_events(resp.text)
    assert events[-1]["type"] == "exit", events[-1]
    out = b"".join(base64.b64decode(e["data"]) for e in events if e["type"] == "stdout")
    return events[-1]["exit_code"], out.decode()


def refusal(response: Any) -> bool:
    if response.status_code not in (502, 503):
        return False
    try:
        err = json.loads(response.text)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    codes = (CLOSED_PORT,) if response.status_code == 502 else REFUSALS
    return err.get("code") in codes and err.get("retryable") is True


def create(url: str, token: str = FUZZ, **body: Any) -> str:
    resp = call(url, "POST", "/v1/sandboxes", token, {"image": REF, **body})
    assert resp.status_code == 201, resp.text
    return str(resp.json()["id"])


# -- the edge, without DNS -------------------------------------------------------------------------------
NO_DNS = Path(__file__).resolve().parent / "support" / "nodns"  # its sitecustomize patches getaddrinfo
NO_DNS_REFUSAL = "numeric hosts and localhost only"  # in the message of what it refuses


@pytest.fixture(scope="module")
def edge(store_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EdgeProcess]:
    # containers only: a microVM create boots a template (seconds under TCG) past the fuzzer's
    # timeouts (the microVM path is tested in test_sandbox_microvm.py); a reaper round every 0.3 s,
    # so the TTLs, leases and idle timeouts fuzzing sets take effect while it still sends requests
    with running("fuzz", tmp_path_factory.mktemp("fuzz"), store_url, TOKENS, "--isolation", "container",
                 "--reap-interval", "0.3", token=FUZZ, pythonpath=[NO_DNS]) as e:
        yield e


# -- what fuzzing aims at, and what it must leave alone -------------------------------------------------
ROLES: dict[str, dict[str, Any]] = {"plain": {}, "net": {"network": []}}  # target -> its create options
LONG_LEASE = 300.0  # a renew aimed at a target's job must outlive the test (see World.aim)


@dataclass
class World:
    edge: EdgeProcess
    bystander: str
    bystander_files: str
    mounts_before: set[str] = field(default_factory=set)
    checkpoint: str = ""  # a checkpoint of the fuzzed project, for restore bodies
    run: str = ""  # the run manifest of the last preempted target job, for run resume bodies
    targets: dict[str, str] = field(default_factory=dict)  # role -> live sandbox id
    # role -> its job; a preempted job takes no creates, so the next target gets a fresh one
    jobs: dict[str, str] = field(default_factory=lambda: {role: f"fuzz-{role}-0" for role in ROLES})
    generation: int = 0
    sent: int = 0
    aimed: Counter[str] = field(default_factory=Counter)
    statuses: dict[str, Counter[int]] = field(default_factory=lambda: defaultdict(Counter))  # by operation
    seconds: Counter[str] = field(default_factory=Counter)  # by operation
    session: requests.Session = field(default_factory=requests.Session)

    @property
    def url(self) -> str:
        return self.edge.url

    def listed(self, token: str = FUZZ) -> dict[str, str]:
        """The sandboxes the API lists for ``token``'s project: id -> status."""
        resp = call(self.url, "GET", "/v1/sandboxes", token)
        assert resp.status_code == 200, resp.text
        return {sb["id"]: sb["status"] for sb in resp.json()["sandboxes"]}

    def keep_targets(self) -> None:
        """One live, running sandbox per role (fuzzing destroys, pauses and preempts them)."""
        live = self.listed()
        for role, options in ROLES.items():
            sid = self.targets.get(role)
            status = live.get(sid) if sid is not None else None  # None: destroyed or preempted
            if status == "paused":
                resp = call(self.url, "POST", f"/v1/sandboxes/{sid}/resume")
                assert resp.status_code == 200, resp.text
            elif status != "running":
                self.targets.pop(role, None)
                self.sweep()  # room in the quota (and a half-made target goes too)
                resp = call(self.url, "POST", "/v1/sandboxes", body={"image": REF, "job": self.jobs[role], **options})
                if resp.status_code == 409:  # fuzzing preempted the job
                    self.generation += 1
                    self.jobs[role] = f"fuzz-{role}-{self.generation}"
                    resp = call(self.url, "POST", "/v1/sandboxes",
                                body={"image": REF, "job": self.jobs[role], **options})
                assert resp.status_code == 201, resp.text
                self.targets[role] = resp.json()["id"]

    def sweep(self, token: str = FUZZ) -> None:
        """Destroy what fuzzed creates made, so that the quota never stops the next create early."""
        for sid in self.listed(token):
            if sid not in self.targets.values():
                resp = call(self.url, "DELETE", f"/v1/sandboxes/{sid}", token)
                assert resp.status_code in (204, 404), resp.text  # 404: the reaper was first

    def aim(self, case: Case) -> str:
        """Point most ``{id}``, ``{job}`` and ref fields at real things; return what it aimed at.

        The choice is a hash of the generated case, so a case replays (and shrinks) the same
        way: 5/8 a target (the networked one for the network route and 1/8 of the rest),
        1/8 the bystander's sandbox, 2/8 the generated value.
        """
        spin = zlib.crc32(json.dumps([case.path_parameters, case.query, case.body], sort_keys=True,
                                     default=repr).encode()) % 8
        aimed = "generated"
        params = case.path_parameters
        body = case.body if isinstance(case.body, dict) else {}
        role = "net" if spin == 5 or case.operation.path.endswith("/network") else "plain"
        if params and "id" in params:
            if spin == 6:
                params["id"], aimed = self.bystander, "bystander"
            elif spin < 6:
                params["id"], aimed = self.targets[role], "target"
        # A short lease makes the reaper destroy the job's sandboxes while the next request uses them,
        # and the manager answers that race with a 500 (reported; not a matter of input): renew
        # names a target's job only with a lease that outlives the test.
        renews_briefly = case.operation.path.endswith("/renew") and not (
            isinstance(body.get("ttl"), (int, float)) and body["ttl"] >= LONG_LEASE)
        if params and "job" in params and spin < 6 and not renews_briefly:
            params["job"], aimed = self.jobs[role], "job"
        if spin < 6:
            for key, real in (("image", REF), ("checkpoint", self.checkpoint), ("manifest", self.run)):
                if isinstance(body.get(key), str) and real:
                    body[key], aimed = real, key
        self.aimed[aimed] += 1
        return aimed

    def files_digest(self) -> str:
        return bystander_digest(self.url, self.bystander)


def bystander_digest(url: str, sid: str) -> str:
    code, out = run(url, sid, "cd /root && sha256sum marker && ls -la --time-style=+%s /root", BYSTANDER)
    assert code == 0, out
    return hashlib.sha256(out.encode()).hexdigest()


@pytest.fixture(scope="module")
def world(edge: EdgeProcess) -> Iterator[World]:
    url = edge.url
    bystander = create(url, BYSTANDER)
    resp = call(url, "PUT", f"/v1/sandboxes/{bystander}/files?path=/root/marker&mode=600", BYSTANDER,
                data=b"the bystander's own bytes\n")
    assert resp.status_code == 201, resp.text
    w = World(edge, bystander, bystander_digest(url, bystander))
    try:
        w.keep_targets()
        resp = call(url, "POST", f"/v1/sandboxes/{w.targets['plain']}/checkpoint", body={"name": "fuzz-base"})
        assert resp.status_code == 201, resp.text
        w.checkpoint = resp.json()["name"]
        refuses_host_names(w)  # before fuzzing sends any host name
        w.mounts_before = set(kmount.mounts_under(edge.manager().data_dir))
        yield w
    finally:
        w.session.close()
        w.targets.clear()
        for token in (FUZZ, BYSTANDER):
            w.sweep(token)


def refuses_host_names(world: World) -> None:
    """A host name in an egress rule gets the refusal of tests/support/nodns, not a lookup."""
    world.keep_targets()
    resp = call(world.url, "PUT", f"/v1/sandboxes/{world.targets['net']}/network",
                body={"rules": [{"host": "example.com", "ports": 443}]})
    assert invalid(resp) == "network"
    assert NO_DNS_REFUSAL in resp.json()["error"]["message"], resp.text


@pytest.fixture
def api(world: World, request: pytest.FixtureRequest) -> schemathesis.BaseSchema:
    """The running service's document, fuzzed with the ``fuzz`` project's token."""
    # schemathesis 4.32's from_fixture reads and renames the test item's `_nodeid`, which pytest 9.2
    # no longer has (it keeps `_id`); this fixture runs before that read, so give it the attribute
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid
    schema = schemathesis.openapi.from_url(f"{world.url}/openapi.json", timeout=10)
    schema.config.update(headers={"Authorization": f"Bearer {FUZZ}"}, request_timeout=DEADLINE)
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                                    max_examples=EXAMPLES)
    schema.config.phases.update(phases=["examples", "coverage", "fuzzing"])
    return schema


schema = schemathesis.pytest.from_fixture("api")


@schema.parametrize()
def test_fuzz_every_operation(case: Case, world: World) -> None:
    world.keep_targets()
    aimed = world.aim(case)
    started = time.monotonic()
    response = case.call(session=world.session)
    elapsed = time.monotonic() - started
    world.sent += 1
    world.statuses[case.operation.label][response.status_code] += 1
    world.seconds[case.operation.label] += elapsed
    assert elapsed < DEADLINE, f"{case.operation.label} took {elapsed:.1f}s"
    checks = [status_code_conformance]
    if not refusal(response):  # a documented "retry later or elsewhere" is no server error
        checks.append(not_a_server_error)
    case.validate_response(response, checks=checks)
    # not this project's (a signed URL's route takes no token: its signature is checked before the id is looked up)
    if (aimed == "bystander" and case.method.upper() == case.operation.method.upper()
            and case.operation.definition.raw.get("security") != []):
        authorized = response.request.headers.get("Authorization") == f"Bearer {FUZZ}"
        assert response.status_code == (404 if authorized else 401), response.text
    if case.operation.path.endswith("/exec") and response.status_code == 200:
        final = exec_events(response.text)[-1]
        assert final["type"] in ("exit", "error"), final
        if final["type"] == "error":
            assert final["error"]["code"] not in INTERNAL_CODES, final
    if case.operation.path == "/v1/sandboxes" and case.method.upper() == "GET" and response.status_code == 200:
        assert world.bystander not in response.text
    if response.status_code == 201:
        if case.operation.path.endswith("/preempt"):
            world.run = response.json()["ref"]
        world.sweep()


def test_after_fuzzing_the_bystander_is_untouched_and_nothing_leaks(world: World) -> None:
    url = world.url
    print(f"\nfuzzing sent {world.sent} requests; aimed at {dict(world.aimed)}")
    for label, secs in world.seconds.most_common():
        print(f"  {label:36} {secs:5.1f} s  {dict(sorted(world.statuses[label].items()))}")
    assert world.edge.alive(), world.edge.tail()
    resp = call(url, "GET", f"/v1/sandboxes/{world.bystander}", BYSTANDER)
    assert resp.status_code == 200, resp.text
    assert resp.json()["status"] == "running"
    assert world.files_digest() == world.bystander_files
    assert world.bystander not in world.listed()

    world.targets.clear()
    world.sweep()
    assert world.listed() == {}
    # the mount table and crun's containers, which the API does not show, read from the data dir
    # (this manager only looks); the FnCall pool's ready sandboxes are the fuzzed project's but
    # not its to name: they go when the edge stops (the edge fixture's clean_up)
    looker = world.edge.manager()
    pools = pool_sandboxes(looker)
    after = set(kmount.mounts_under(looker.data_dir))
    pools |= pool_sandboxes(looker)  # one the pool made while the mounts were read
    after = {m for m in after if not any(f"/{sid}/" in f"{m}/" for sid in pools)}
    boxes = str(looker.boxes) + "/"
    # under boxes/ only the bystander's, as before; anything else new is a layer or the daemon's FUSE
    assert {m for m in after if m.startswith(boxes)} == {
        m for m in world.mounts_before if m.startswith(f"{boxes}{world.bystander}/")}
    shared = (str(looker.host.layer_root) + "/", str(looker.data_dir / "blobs") + "/")
    assert [m for m in after - world.mounts_before if not m.startswith(shared)] == []

    sid = create(url)
    assert run(url, sid, "echo still here") == (0, "still here\n")
    assert call(url, "DELETE", f"/v1/sandboxes/{sid}").status_code == 204
    assert world.listed() == {}
    known = {st.id for st in looker.list()}
    runtime = looker.backend("container").runtime
    assert [c["id"] for c in runtime.list() if c["id"] not in known] == []  # no orphaned container


def pool_sandboxes(looker: SandboxManager) -> set[str]:
    return {st.id for st in looker.list() if st.labels.get(POOL_PROJECT_LABEL) == "fuzz"}


# -- what fuzzing found, as plain requests ------------------------------------------------------------------
def _walk(doc: Any) -> Iterator[dict[str, Any]]:
    if isinstance(doc, dict):
        yield doc
        for value in doc.values():
            yield from _walk(value)
    elif isinstance(doc, list):
        for value in doc:
            yield from _walk(value)


def test_openapi_exclusive_bounds_are_draft_4_booleans(world: World) -> None:
    # was: {"exclusiveMinimum": 0} (a JSON Schema 2019 number), which OpenAPI 3.0 refuses, and
    # schemathesis with it: "Invalid `cpu` definition ... 'minimum' is a required property"
    doc = call(world.url, "GET", "/openapi.json", None).json()
    bounded = [s for s in _walk(doc) if "exclusiveMinimum" in s or "exclusiveMaximum" in s]
    assert bounded
    for schema in bounded:
        for bound, limit in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if bound in schema:
                assert schema[bound] is True, schema
                assert limit in schema, schema


def invalid(resp: requests.Response) -> str:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["code"] == "invalid_field", err
    return str(err["field"])


def test_exec_with_a_null_cmd_is_a_400_naming_cmd(world: World) -> None:
    world.keep_targets()
    resp = call(world.url, "POST", f"/v1/sandboxes/{world.targets['plain']}/exec", body={"cmd": None})
    assert invalid(resp) == "cmd"  # was 500: TypeError: ExecRequest.__init__() missing ... 'cmd'


def test_a_checkpoint_name_longer_than_a_ref_file_name_is_a_400(world: World) -> None:
    world.keep_targets()
    path = f"/v1/sandboxes/{world.targets['plain']}/checkpoint"
    # was 500: the store's ref file projects/fuzz/000...0:latest is longer than NAME_MAX (ENAMETOOLONG)
    assert invalid(call(world.url, "POST", path, body={"name": "0" * 256})) == "name"
    resp = call(world.url, "POST", path, body={"name": "0" * MAX_REF_NAME})  # the longest name fits
    assert resp.status_code == 201, resp.text


def test_restore_under_another_policy_version_is_a_409(world: World) -> None:
    # was 500: CheckpointMismatch ("made under policy None, refusing to resume under 'v2'")
    resp = call(world.url, "POST", "/v1/sandboxes/restore", body={"checkpoint": world.checkpoint,
                                                                   "policy_version": "v2"})
    assert resp.status_code == 409, resp.text
    assert resp.json()["error"]["code"] == "conflict"
    assert [sid for sid in world.listed() if sid not in world.targets.values()] == []


def test_a_call_of_a_command_with_function_arguments_is_a_400(world: World) -> None:
    # was 500: CallArgumentError("args, kwargs and entry go with function=, not with cmd")
    for extra, field_name in (({"args": [1]}, "args"), ({"kwargs": {"a": 1}}, "kwargs")):
        resp = call(world.url, "POST", "/v1/calls", body={"image": REF, "cmd": ["true"], **extra})
        assert invalid(resp) == field_name


@pytest.mark.parametrize(("route", "body", "field_name"), [
    # was 500 (UnicodeEncodeError writing the checkpoint document) or accepted into state and argv
    ("checkpoint", {"labels": {"k": "\ud800"}}, "labels.k"),
    ("create", {"labels": {"k": "\udfff"}}, "labels.k"),
    ("create", {"env": {"\ud800": "x"}}, "env"),
    ("create", {"workdir": "/\ud800"}, "workdir"),
    ("exec", {"cmd": ["/bin/echo", "\ud800"]}, "cmd[1]"),
    ("exec", {"cmd": "true", "env": {"A": "\ud800"}}, "env.A"),
    ("call", {"function": "\ud800"}, "function"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_a_lone_surrogate_in_a_body_is_a_400_naming_the_field(world: World, route: str, body: dict[str, Any],
                                                               field_name: str) -> None:
    world.keep_targets()
    sid = world.targets["plain"]
    method, path, base = {"checkpoint": ("POST", f"/v1/sandboxes/{sid}/checkpoint", {}),
                          "create": ("POST", "/v1/sandboxes", {"image": REF}),
                          "exec": ("POST", f"/v1/sandboxes/{sid}/exec", {}),
                          "call": ("POST", "/v1/calls", {"image": REF})}[route]
    try:
        assert invalid(call(world.url, method, path, body={**base, **body})) == field_name
    finally:
        world.sweep()  # what the old code accepted


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
def test_a_path_component_longer_than_name_max_is_a_400_naming_path(world: World, method: str) -> None:
    world.keep_targets()
    # was 400 os_error without a field ([Errno 36] File name too long)
    resp = call(world.url, method, f"/v1/sandboxes/{world.targets['plain']}/files?path=/tmp/{'a' * 256}",
                data=b"x" if method == "PUT" else None)
    assert invalid(resp) == "path"


# -- how the edge is started ------------------------------------------------------------------------------
def test_the_edge_resolves_no_host_name(world: World) -> None:
    """The sitecustomize of tests/support/nodns applies in the edge (the world checked it before
    fuzzing, too): no other sitecustomize came first on the edge's path."""
    refuses_host_names(world)


@pytest.mark.parametrize("interval", ["0", "-1", "nan", "soon"])
def test_the_reap_interval_is_more_than_0_seconds(tmp_path: Path, interval: str) -> None:
    bad = subprocess.run([sys.executable, "-m", "sandbox.edge", "--data-dir", str(tmp_path), "--store",
                          "file:///unused", "--tokens", "unread", "--reap-interval", interval],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert "argument --reap-interval" in bad.stderr
