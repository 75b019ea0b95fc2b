"""The tenant boundary, attacked through the real edge service by a hostile project and a hostile agent.

Two projects share one edge: ``alpha`` (the attacker, who also runs code inside its own
sandboxes) and ``beta`` (the victim).  Every test sends the request an attacker would
send and checks the refusal, and that nothing of the host or of beta was reached.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import stat
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from support.hosts import publish_sync
from support.sandboxes import REF, ServerThread, no_sandboxes_left, serving
from support.tarbuild import TarBuilder

from layerstore.store import Store
from lazyfetch import kmount
from sandbox.core.model import Maxima
from sandbox.host.manager import SandboxManager

pytestmark = [pytest.mark.usefixtures("need_root"), pytest.mark.root("erofs", "overlay", "fuse", "cmd:crun")]

ALPHA, BETA, OPS = "alpha-sec-token-0123456789", "beta-sec-token-0123456789", "ops-sec-token-0123456789"
TOKENS = {"projects": {"alpha": {"tokens": [ALPHA], "max_sandboxes": 4},
                       "beta": {"tokens": [BETA], "max_sandboxes": 4},
                       "ops": {"tokens": [OPS], "max_sandboxes": 2, "admin": True}}}
MAXIMA = Maxima(memory=4 << 30, output_cap=8 << 20, lease_ttl=3600.0)


@pytest.fixture(scope="module")
def server(manager: SandboxManager) -> Iterator[ServerThread]:
    with serving(manager, TOKENS, reap_interval=0.5, maxima=MAXIMA) as srv:
        yield srv


@pytest.fixture
def url(server: ServerThread, manager: SandboxManager) -> Iterator[str]:
    with no_sandboxes_left(manager):
        yield server.url


async def call(method: str, url: str, token: str, *, body: Any = None, raw: bytes | None = None,
               timeout: float = 60) -> tuple[int, Any]:  # noqa: ASYNC109  (the request's own deadline)
    """One request; the JSON (or bytes) answer.  ``url`` is sent as given (no re-quoting)."""
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as s:
        kw: dict[str, Any] = {"data": raw} if raw is not None else {"json": body} if body is not None else {}
        async with s.request(method, aiohttp.client.URL(url, encoded=True), timeout=aiohttp.ClientTimeout(timeout),
                             **kw) as r:
            data = await r.read()
            if r.content_type == "application/json":
                return r.status, json.loads(data)
            return r.status, data


async def create(url: str, token: str, **fields: Any) -> dict[str, Any]:
    status, info = await call("POST", f"{url}/v1/sandboxes", token, body={"image": REF, **fields})
    assert status == 201, info
    return dict(info)


async def run(url: str, token: str, sid: str, cmd: str | list[str], **fields: Any) -> dict[str, Any]:
    """Exec through the stream: {"stdout", "stderr", "exit": final event}."""
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as s:
        async with s.post(f"{url}/v1/sandboxes/{sid}/exec", json={"cmd": cmd, **fields}) as r:
            assert r.status == 200, await r.text()
            out = {"stdout": b"", "stderr": b"", "exit": None}
            async for line in r.content:
                event = json.loads(line)
                if event["type"] in ("stdout", "stderr"):
                    out[event["type"]] += base64.b64decode(event["data"])
                else:
                    out["exit"] = event
    return out


def refused(status: int, body: Any, *, field: str | None = None) -> None:
    """A 4xx with the error shape; with ``field``, a 400 naming it."""
    assert 400 <= status < 500, (status, body)
    assert isinstance(body, dict), body
    assert set(body["error"]) >= {"code", "message", "retryable"}, body
    if field is not None:
        assert (status, body["error"].get("field")) == (400, field), body


# -- 1. an id is never a path ----------------------------------------------------------------------
def test_a_sandbox_id_that_walks_to_a_forged_state_is_refused(url: str, manager: SandboxManager) -> None:
    shadow = Path("/etc/shadow").read_bytes()
    marker = manager.data_dir / "host-marker"
    marker.write_bytes(b"host file")

    async def scenario() -> None:
        box = await create(url, ALPHA)
        sid = box["id"]
        # the agent reads where its upper dir is on the host and forges a manager state there
        mountinfo = (await run(url, ALPHA, sid, "cat /proc/self/mountinfo"))["stdout"].decode()
        upper = re.search(r"upperdir=([^,\s]+)", mountinfo)
        assert upper, mountinfo
        forged = {"version": 1, "id": "lb-000000000000", "status": "running", "ref": REF, "image_digest": "x",
                  "kind": "image", "options": {"labels": {"layerbox.project": "alpha"}}, "layer_digests": [],
                  "created": 0, "last_active": 0, "cgroups_path": "/", "pid": 1, "init_start": 0,
                  "admitting": True, "userns": None, "network": None, "env": {}, "cwd": "/", "uid": 0, "gid": 0}
        await run(url, ALPHA, sid, f"mkdir -p /root/fake && printf '%s' '{json.dumps(forged)}' > /root/fake/state.json")
        walk = os.path.relpath(Path(upper.group(1)) / "root" / "fake", manager.boxes)  # noqa: ASYNC240
        assert walk.startswith("../")
        spellings = [
            urllib.parse.quote(walk, safe=""),                      # ..%2F..%2Fuppers%2F...
            urllib.parse.quote(walk, safe="").replace("%2F", "%2f"),
            urllib.parse.quote(walk, safe="").replace("..", "%2E%2E"),
            walk.replace("/", "%5C"),                                # backslashes
            "..%5C..%5Chost-marker",
            f"{sid}%00",                                             # NUL after a real id
            f"{sid}%00..%2F..%2F",
            "%00",
            "lb-" + "a" * 4096,                                      # over long
            "lb-" + "0" * 11,                                        # one digit short
            "LB-0123456789AB",
            urllib.parse.quote("lb-０１２３４５６７８９ab"),           # full-width digits
            urllib.parse.quote(f"../boxes/{sid}", safe=""),
        ]
        for spelled in spellings:
            for method, suffix, raw in (("GET", "/files?path=/etc/shadow", None),
                                        ("PUT", "/files?path=/root/host-marker", b"overwritten"),
                                        ("GET", "", None), ("DELETE", "", None), ("POST", "/pause", None),
                                        ("GET", "/receipts", None)):
                status, body = await call(method, f"{url}/v1/sandboxes/{spelled}{suffix}", ALPHA, raw=raw)
                assert status in (400, 404), (spelled, method, suffix, status, body)
                if status == 400:
                    refused(status, body, field="id")
                assert shadow not in (body if isinstance(body, bytes) else json.dumps(body).encode())
        assert marker.read_bytes() == b"host file"
        assert (await run(url, ALPHA, sid, "echo still here"))["stdout"] == b"still here\n"
        await call("DELETE", f"{url}/v1/sandboxes/{sid}", ALPHA)

    asyncio.run(scenario())


def test_another_projects_sandbox_is_invisible(url: str) -> None:
    async def scenario() -> None:
        victim = await create(url, BETA)
        await call("PUT", f"{url}/v1/sandboxes/{victim['id']}/files?path=/root/secret", BETA, raw=b"beta's")
        for method, suffix, body in (("GET", "", None), ("GET", "/files?path=/root/secret", None),
                                     ("PUT", "/files?path=/root/secret", None), ("POST", "/exec", {"cmd": "id"}),
                                     ("POST", "/pause", None), ("POST", "/checkpoint", {}),
                                     ("GET", "/receipts", None), ("PUT", "/network", {"rules": []}),
                                     ("DELETE", "", None)):
            status, answer = await call(method, f"{url}/v1/sandboxes/{victim['id']}{suffix}", ALPHA, body=body)
            assert status == 404, (method, suffix, status, answer)  # 404, never 403: ids leak nothing
        status, listing = await call("GET", f"{url}/v1/sandboxes", ALPHA)
        assert victim["id"] not in json.dumps(listing)
        status, data = await call("GET", f"{url}/v1/sandboxes/{victim['id']}/files?path=/root/secret", BETA)
        assert (status, data) == (200, b"beta's")
        await call("DELETE", f"{url}/v1/sandboxes/{victim['id']}", BETA)

    asyncio.run(scenario())


# -- 2. checkpoints, refs and runs have owners ---------------------------------------------------------
def test_another_projects_checkpoints_and_runs_cannot_be_used(url: str, manager: SandboxManager) -> None:
    async def scenario() -> None:
        victim = await create(url, BETA, job="secret-job")
        await call("PUT", f"{url}/v1/sandboxes/{victim['id']}/files?path=/root/secret", BETA, raw=b"beta's")
        status, ckpt = await call("POST", f"{url}/v1/sandboxes/{victim['id']}/checkpoint", BETA,
                                  body={"name": "mine:v1"})
        assert status == 201, ckpt
        assert ckpt["name"] == "projects/beta/mine:v1"  # written in beta's namespace only
        for ref in (ckpt["name"], ckpt["digest"], ckpt["digest"].removeprefix("blake3:")):
            for path, body in (("/v1/sandboxes", {"image": ref}), ("/v1/sandboxes/restore", {"checkpoint": ref}),
                               ("/v1/calls", {"image": ref, "cmd": "cat /root/secret"})):
                status, answer = await call("POST", url + path, ALPHA, body=body)
                assert status == 404, (path, ref, status, answer)
                assert "beta's" not in json.dumps(answer)
        # beta's run manifest: alpha can neither resume it nor name it
        status, run_doc = await call("POST", f"{url}/v1/jobs/secret-job/preempt", BETA, body={"timeout": 0})
        assert status == 201, run_doc
        assert run_doc["ref"] == "projects/beta/runs/secret-job:latest"
        for ref in (run_doc["ref"], run_doc["digest"]):
            status, answer = await call("POST", f"{url}/v1/runs/resume", ALPHA, body={"manifest": ref})
            assert status == 404, (ref, answer)
        # alpha's job of the same name is alpha's own: nothing of beta's to pause, preempt or renew
        status, answer = await call("POST", f"{url}/v1/jobs/secret-job/preempt", ALPHA, body={"timeout": 0})
        assert status == 404, answer
        status, answer = await call("POST", f"{url}/v1/runs/resume", BETA, body={"manifest": run_doc["ref"]})
        assert status == 201, answer
        for sid in answer["sandboxes"].values():
            await call("DELETE", f"{url}/v1/sandboxes/{sid}", BETA)

    asyncio.run(scenario())


def test_a_checkpoint_name_moved_again_restores_its_latest(url: str) -> None:
    # the edge resolves refs once (then checks the owner): never from a stale cached ref
    async def scenario() -> None:
        box = await create(url, ALPHA)
        seen = []
        for content in (b"first", b"second"):
            await call("PUT", f"{url}/v1/sandboxes/{box['id']}/files?path=/root/step", ALPHA, raw=content)
            status, ckpt = await call("POST", f"{url}/v1/sandboxes/{box['id']}/checkpoint", ALPHA,
                                      body={"name": "steps:latest"})
            assert status == 201, ckpt
            for path, body in (("/v1/sandboxes/restore", {"checkpoint": ckpt["name"]}),
                               ("/v1/sandboxes", {"image": ckpt["name"]})):
                status, copy = await call("POST", url + path, ALPHA, body=body)
                assert status == 201, copy
                status, data = await call("GET", f"{url}/v1/sandboxes/{copy['id']}/files?path=/root/step", ALPHA)
                seen.append(data)
                await call("DELETE", f"{url}/v1/sandboxes/{copy['id']}", ALPHA)
        assert seen == [b"first", b"first", b"second", b"second"]
        await call("DELETE", f"{url}/v1/sandboxes/{box['id']}", ALPHA)

    asyncio.run(scenario())


def test_a_checkpoint_name_cannot_move_a_shared_or_foreign_ref(url: str, manager: SandboxManager) -> None:
    async def image_digest() -> str:
        async with await manager.open_store() as store:
            return str((await store.resolve(REF, refresh=True)).digest)

    async def scenario() -> None:
        before = await image_digest()
        victim = await create(url, BETA)
        status, theirs = await call("POST", f"{url}/v1/sandboxes/{victim['id']}/checkpoint", BETA,
                                    body={"name": "shared-name"})
        assert status == 201, theirs
        attacker = await create(url, ALPHA)
        await run(url, ALPHA, attacker["id"], "echo pwned > /root/owned")
        # the shared image's tag, beta's checkpoint name, and escapes out of alpha's namespace
        for name in ("img/python:latest", REF, "projects/beta/shared-name", "shared-name"):
            status, ckpt = await call("POST", f"{url}/v1/sandboxes/{attacker['id']}/checkpoint", ALPHA,
                                      body={"name": name})
            assert status == 201, ckpt
            assert ckpt["name"].startswith("projects/alpha/"), ckpt
        for name in ("../img/python", "/img/python", "..", "a//b", "UPPER", "x" * 300, "a:b:c"):
            status, answer = await call("POST", f"{url}/v1/sandboxes/{attacker['id']}/checkpoint", ALPHA,
                                        body={"name": name})
            refused(status, answer)
        assert await image_digest() == before  # every later sandbox of img/python still runs the image
        async with await manager.open_store() as store:
            assert (await store.resolve("projects/beta/shared-name", refresh=True)).digest == theirs["digest"]
        fresh = await create(url, BETA)
        probe = await run(url, BETA, fresh["id"], "cat /root/owned 2>&1 || echo absent")
        assert probe["stdout"].endswith(b"absent\n")
        # reserved labels: a project cannot claim another's ownership or sharing
        for labels in ({"layerbox.project": "beta"}, {"layerbox.shared": "true"}):
            status, answer = await call("POST", f"{url}/v1/sandboxes/{attacker['id']}/checkpoint", ALPHA,
                                        body={"labels": labels})
            refused(status, answer)
            status, answer = await call("POST", f"{url}/v1/sandboxes", ALPHA, body={"image": REF, "labels": labels})
            refused(status, answer)
        for sid, token in ((victim["id"], BETA), (attacker["id"], ALPHA), (fresh["id"], BETA)):
            await call("DELETE", f"{url}/v1/sandboxes/{sid}", token)

    asyncio.run(scenario())


def test_only_an_admin_project_shares_a_checkpoint(url: str, manager: SandboxManager) -> None:
    async def scenario() -> None:
        made = await create(url, OPS)
        await call("PUT", f"{url}/v1/sandboxes/{made['id']}/files?path=/root/tool", OPS, raw=b"shared tool")
        status, private = await call("POST", f"{url}/v1/sandboxes/{made['id']}/checkpoint", OPS,
                                     body={"name": "toolkits/private:v1"})
        assert status == 201, private
        status, shared = await call("POST", f"{url}/v1/sandboxes/{made['id']}/checkpoint", OPS,
                                    body={"name": "toolkits/shared:v1", "labels": {"layerbox.shared": "true"}})
        assert status == 201, shared
        assert shared["name"] == "toolkits/shared:v1"  # the operator's namespace is the shared one
        status, answer = await call("POST", f"{url}/v1/sandboxes", ALPHA, body={"image": private["name"]})
        assert status == 404, answer
        copy = await create(url, ALPHA, image=shared["name"])
        status, data = await call("GET", f"{url}/v1/sandboxes/{copy['id']}/files?path=/root/tool", ALPHA)
        assert (status, data) == (200, b"shared tool")
        status, answer = await call("POST", f"{url}/v1/sandboxes/{made['id']}/checkpoint", OPS,
                                    body={"labels": {"layerbox.project": "alpha"}})
        refused(status, answer, field="labels.layerbox.project")
        for sid, token in ((made["id"], OPS), (copy["id"], ALPHA)):
            await call("DELETE", f"{url}/v1/sandboxes/{sid}", token)

    asyncio.run(scenario())


# -- 3. every field is checked, with a 400 naming it ------------------------------------------------------
BAD_CREATES: list[tuple[str, Any]] = [
    ("memory", -1), ("memory", "lots"), ("memory", 1.5), ("memory", True), ("memory", 1 << 62),
    ("pids", 0), ("pids", -5), ("pids", "many"), ("cpu", 0), ("cpu", -1), ("cpu", "1"), ("cpu", float("inf")),
    ("disk", "x"), ("disk", 1), ("env", "x"), ("env", {"A=B": "c"}), ("env", {"A": 1}), ("env", ["A=1"]),
    ("workdir", "relative"), ("workdir", "/a\x00b"), ("user", "root; rm -rf /"), ("user", "99999999999999999999"),
    ("user", "0:4294967295"), ("cpu_class", "realtime"),
    ("labels", {"a": 1}), ("labels", "x"), ("ttl", 0), ("ttl", 1e300), ("idle_timeout", -1),
    ("lease_ttl", 1e300), ("lease_ttl", "soon"), ("job", "a/b"), ("job", "../x"), ("job", ""),
    ("network", "all"), ("network", [{"cidr": "0.0.0.0/0", "ports": 70000}]), ("network", [{"host": "a b"}]),
    ("userns", "yes"), ("policy_version", 7), ("unknown_field", 1),
]


@pytest.mark.parametrize(("field", "value"), BAD_CREATES, ids=[f"{f}={v!r}"[:40] for f, v in BAD_CREATES])
def test_a_bad_create_field_is_a_400_naming_it(url: str, manager: SandboxManager, field: str, value: Any) -> None:
    async def scenario() -> None:
        before = {st.id for st in manager.list()}
        status, body = await call("POST", f"{url}/v1/sandboxes", ALPHA, body={"image": REF, field: value})
        refused(status, body)
        assert body["error"]["field"].split(".")[0].split("[")[0] == field, body
        assert {st.id for st in manager.list()} == before  # nothing was started

    asyncio.run(scenario())


def test_bad_exec_lease_and_body_fields_are_400s(url: str, manager: SandboxManager) -> None:
    async def scenario() -> None:
        box = await create(url, ALPHA)
        sid = box["id"]
        for body, field in (({"cmd": "true", "output_cap": 4e9}, "output_cap"),
                            ({"cmd": "true", "output_cap": -1}, "output_cap"),
                            ({"cmd": "true", "timeout": 1e300}, "timeout"), ({"cmd": ""}, "cmd"),
                            ({"cmd": []}, "cmd"), ({"cmd": ["sh", 1]}, "cmd[1]"), ({"cmd": "a\x00b"}, "cmd"),
                            ({"cmd": "true", "stdin": "***"}, "stdin"), ({"cmd": "true", "env": "x"}, "env"),
                            ({"cmd": "true", "cwd": "tmp"}, "cwd"),
                            ({"cmd": "true", "idempotency_key": "\n"}, "idempotency_key"),
                            ({"cmd": "true", "bogus": 1}, "bogus"), ({}, "cmd")):
            status, answer = await call("POST", f"{url}/v1/sandboxes/{sid}/exec", ALPHA, body=body)
            refused(status, answer, field=field)
        for ttl in (1e300, -1, 0, "x"):
            status, answer = await call("POST", f"{url}/v1/jobs/default/renew", ALPHA, body={"ttl": ttl})
            refused(status, answer, field="ttl")
        for job in ("..", "a%2Fb", "A", "x" * 200):
            status, answer = await call("POST", f"{url}/v1/jobs/{job}/pause", ALPHA)
            refused(status, answer, field="job")
        # deeply nested, huge or malformed JSON: a 4xx, and the service stays up
        for raw in (b"[" * 100_000, b'{"image": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", b"{", b"\xff\xfe",
                    b'"just a string"', b"null"):
            status, answer = await call("POST", f"{url}/v1/sandboxes", ALPHA, raw=raw)
            refused(status, answer)
        status, answer = await call("POST", f"{url}/v1/sandboxes", ALPHA, raw=b" " * (65 << 20))
        assert status == 413, answer
        for mode in ("4755", "7777", "99", "-1", "0x1ff"):
            status, answer = await call("PUT", f"{url}/v1/sandboxes/{sid}/files?path=/root/x&mode={mode}", ALPHA,
                                        raw=b"x")
            refused(status, answer, field="mode")
        for path in ("relative", "", "/a\x00b"):
            status, answer = await call("GET", f"{url}/v1/sandboxes/{sid}/files?path={urllib.parse.quote(path)}",
                                        ALPHA)
            refused(status, answer, field="path")
        status, answer = await call("GET", f"{url}/v1/sandboxes/{sid}/files?path=/&list=maybe", ALPHA)
        refused(status, answer, field="list")
        # an output cap the edge allows is honoured and the service keeps nothing of it
        res = await run(url, ALPHA, sid, "head -c 3000000 /dev/zero", output_cap=1000)
        assert (len(res["stdout"]), res["exit"]["truncated"]) == (1000, True)
        status, answer = await call("GET", f"{url}/v1/sandboxes/{sid}", ALPHA)
        assert status == 200
        await call("DELETE", f"{url}/v1/sandboxes/{sid}", ALPHA)

    asyncio.run(scenario())


def test_the_limits_a_sandbox_gets_are_the_ones_asked_for(url: str, manager: SandboxManager) -> None:
    async def scenario() -> None:
        box = await create(url, ALPHA, memory=64 << 20, pids=32)
        st = manager.get(box["id"]).state
        mem = manager.layout.controller_dir("memory", st.cgroups_path)
        pids = manager.layout.controller_dir("pids", st.cgroups_path)
        assert mem is not None
        assert pids is not None
        limit_file = "memory.max" if manager.layout.version == 2 else "memory.limit_in_bytes"
        assert int((mem / limit_file).read_text()) == 64 << 20
        assert (pids / "pids.max").read_text().strip() == "32"
        # inside, as a runtime that sizes itself reads them (a JVM, Go's GOMAXPROCS libraries)
        sid, other = box["id"], (await create(url, BETA))["id"]
        inside = "/sys/fs/cgroup/" + ("memory.max" if manager.layout.version == 2 else "memory/memory.limit_in_bytes")
        res = await run(url, ALPHA, sid, f"cat {inside}; cat /sys/fs/cgroup/pids*/pids.max")
        assert res["stdout"].split() == [str(64 << 20).encode(), b"32"], res
        # the attack: root in the sandbox raises its own limits, or looks for its neighbours
        procs = "/sys/fs/cgroup/" + ("" if manager.layout.version == 2 else "memory/")
        for cmd in (f"echo -1 > {inside}", f"mkdir {procs}escape", f"echo 1 > {procs}cgroup.procs"):
            res = await run(url, ALPHA, sid, cmd)
            assert res["exit"]["exit_code"] != 0, (cmd, res)
            assert b"Read-only file system" in res["stderr"], (cmd, res)
        assert int((mem / limit_file).read_text()) == 64 << 20
        res = await run(url, ALPHA, sid, "find /sys/fs/cgroup -maxdepth 3; grep cgroup /proc/self/mountinfo")
        assert res["exit"]["exit_code"] == 0, res
        assert res["stdout"].count(b"\n") > 3, res
        for name in (other, sid):  # (its cgroup namespace shows its own cgroup as /)
            assert name.encode() not in res["stdout"], res["stdout"].decode()
        for gone in (sid, other):
            await call("DELETE", f"{url}/v1/sandboxes/{gone}", ALPHA if gone == sid else BETA)

    asyncio.run(scenario())


def test_masked_directories_are_empty_and_read_only_and_shared_by_none(url: str, manager: SandboxManager) -> None:
    """The masked directories (/proc/acpi, /sys/firmware where the host has them) and v1's
    /sys/fs/cgroup are read-only binds of directories every container shares (spec.Masks): root in
    a sandbox, with a user namespace or without, can neither read the host's entries there nor
    leave anything for the next sandbox."""
    masked = [p for p in ("/proc/acpi", "/proc/asound", "/proc/scsi", "/sys/firmware") if os.path.isdir(p)]
    assert masked, "this host's kernel has none of the masked directories: the test would show nothing"

    made: list[str] = []

    async def scenario() -> None:
        plain = await create(url, ALPHA)
        made.append(plain["id"])
        mapped = await create(url, ALPHA, userns=True)
        made.append(mapped["id"])
        for box in (plain, mapped):
            sid = box["id"]
            res = await run(url, ALPHA, sid, "find " + " ".join(masked) + " -mindepth 1 | wc -l")
            assert res["stdout"].split() == [b"0"], (sid, res)
            for target in (*masked, "/sys/fs/cgroup"):
                res = await run(url, ALPHA, sid, f"touch {target}/left-behind")
                assert res["exit"]["exit_code"] != 0, (sid, target, res)
                assert b"Read-only file system" in res["stderr"], (sid, target, res)
            res = await run(url, ALPHA, sid, f"umount {masked[0]} && ls -A {masked[0]} | head -3")
            assert res["exit"]["exit_code"] != 0 or not res["stdout"].strip(), (sid, res)
        shared = manager.data_dir / "sandbox" / "masks"
        if manager.layout.version == 1:
            assert sorted(p.name for p in (shared / "cgroup").iterdir()), shared
        assert not list((shared / "empty").iterdir())
        assert not [p for p in shared.rglob("*") if p.is_file()]
        # one sandbox's masks are the others': a sandbox made after sees the same, empty
        later = await create(url, ALPHA)
        made.append(later["id"])
        res = await run(url, ALPHA, later["id"], f"ls -A {masked[0]} | wc -l")
        assert res["stdout"].split() == [b"0"], res

    async def remove() -> None:
        for sid in made:
            await call("DELETE", f"{url}/v1/sandboxes/{sid}", ALPHA)

    # a user namespace's uids must traverse the data dir's parents (pytest's temp root is 0700)
    closed = {d: stat.S_IMODE(d.stat().st_mode) for d in manager.data_dir.parents if not d.stat().st_mode & 0o001}
    for d, mode in closed.items():
        d.chmod(mode | 0o001)
    try:
        asyncio.run(scenario())
    finally:
        asyncio.run(remove())
        for d, mode in closed.items():
            d.chmod(mode)


# -- 4. the files API: special files, and one project cannot starve the others ----------------------------
def test_special_files_answer_at_once_and_file_work_is_bounded_per_project(url: str,
                                                                            manager: SandboxManager) -> None:
    async def scenario() -> None:
        box = await create(url, ALPHA)
        sid = box["id"]
        await run(url, ALPHA, sid, "mkfifo /root/f && ln -s /root/f /root/link")
        for path in ("/root/f", "/root/link"):
            started = time.monotonic()
            for method, raw in (("PUT", b"x"), ("GET", None)):
                status, answer = await call("PUT" if raw else "GET", f"{url}/v1/sandboxes/{sid}/files?path={path}",
                                            ALPHA, raw=raw, timeout=10)
                assert (status, answer["error"]["code"]) == (409, "not_a_regular_file"), (method, path, answer)
            assert time.monotonic() - started < 10
        victim = await create(url, BETA)

        # alpha holds many uploads open (bodies that never finish); beta's file work still goes through
        async def stalled_upload() -> None:
            async def body() -> Any:
                yield b"start"
                await asyncio.sleep(3600)
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {ALPHA}"}) as s:
                await s.put(f"{url}/v1/sandboxes/{sid}/files?path=/root/slow", data=body())

        stalls = [asyncio.create_task(stalled_upload()) for _ in range(40)]
        await asyncio.sleep(2)
        try:
            status, answer = await asyncio.wait_for(
                call("PUT", f"{url}/v1/sandboxes/{victim['id']}/files?path=/root/ok", BETA, raw=b"fine"), 20)
            assert status == 201, answer
            status, data = await asyncio.wait_for(
                call("GET", f"{url}/v1/sandboxes/{victim['id']}/files?path=/root/ok", BETA), 20)
            assert (status, data) == (200, b"fine")
        finally:
            for task in stalls:
                task.cancel()
            await asyncio.gather(*stalls, return_exceptions=True)
        for sid_, token in ((sid, ALPHA), (victim["id"], BETA)):
            await call("DELETE", f"{url}/v1/sandboxes/{sid_}", token)

    asyncio.run(scenario())


# -- 5. host mounts carry nosuid,nodev ---------------------------------------------------------------
def test_every_host_mount_of_a_sandbox_is_nosuid_nodev(url: str, manager: SandboxManager) -> None:
    async def scenario() -> None:
        box = await create(url, ALPHA, disk=32 << 20)
        status, ckpt = await call("POST", f"{url}/v1/sandboxes/{box['id']}/checkpoint", ALPHA, body={})
        assert status == 201
        status, restored = await call("POST", f"{url}/v1/sandboxes/restore", ALPHA, body={"checkpoint": ckpt["name"]})
        assert status == 201, restored
        ours = [m for m in kmount.read_mountinfo() if m.mountpoint.startswith(str(manager.data_dir) + "/")
                and m.fstype != "fuse"]  # (the daemon's blob mount is FUSE's own: nosuid,nodev by default)
        assert ours
        for m in ours:
            opts = set(m.mount_options.split(","))
            assert {"nosuid", "nodev"} <= opts, (m.mountpoint, m.fstype, m.mount_options)
        for sid in (box["id"], restored["id"]):
            await call("DELETE", f"{url}/v1/sandboxes/{sid}", ALPHA)

    asyncio.run(scenario())


# -- a hostile image: nothing of the host reachable from inside, nothing usable from the host ---------------
@pytest.fixture(scope="module")
def hostile_image(manager: SandboxManager, store_url: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The fixture image with a toolkit layer an attacker built: setuid-root copies of ``id``, a
    4777 root-owned program, the host disk as a block device, /dev/null's numbers, and
    symlinks aiming at the host's files (absolute and through ``..``)."""
    work = tmp_path_factory.mktemp("hostile")
    disk = os.stat("/").st_dev
    payload = Path("/usr/bin/id").read_bytes()
    tar = TarBuilder()
    tar.file("opt/evil/suid-id", payload, mode=0o4755)
    tar.file("opt/evil/all-4777", payload, mode=0o4777)
    tar.device("opt/evil/disk", "b", os.major(disk), os.minor(disk), mode=0o666)
    tar.device("opt/evil/null", "c", 1, 3, mode=0o666)
    tar.symlink("opt/evil/abs-shadow", "/etc/shadow")
    tar.symlink("opt/evil/up-shadow", "../../../../../../../../etc/shadow")
    tar.symlink("opt/evil/host-root", "/proc/1/root")
    publish_sync(store_url, work / "pub", str(tar.write(work / "evil.tar")), "hostile/toolkit")

    async def compose() -> None:
        async with await Store.open(store_url, work / "pub") as store:
            await store.compose("hostile/python", {"base": REF, "toolkit": "hostile/toolkit"})

    asyncio.run(compose())
    return "hostile/python"


def test_a_hostile_image_gives_the_agent_nothing_of_the_host(url: str, manager: SandboxManager,
                                                              hostile_image: str) -> None:
    host_shadow = Path("/etc/shadow").read_bytes()

    async def scenario() -> None:
        as_root = await create(url, ALPHA, image=hostile_image)
        as_user = await create(url, ALPHA, image=hostile_image, user="1000:1000")
        sandbox_shadow = (await run(url, ALPHA, as_root["id"], "cat /etc/shadow"))["stdout"]
        assert sandbox_shadow
        assert sandbox_shadow != host_shadow
        # inside: links resolve in the sandbox's own root, devices stay shut, setuid gains nothing
        probe = ("for f in abs-shadow up-shadow; do cmp -s /opt/evil/$f /etc/shadow && echo $f:own; done; "
                 "ls /opt/evil/host-root/ >/dev/null 2>&1 && echo host-root:listed; "
                 "head -c1 /opt/evil/disk >/dev/null 2>&1 && echo disk:opened; "
                 "head -c1 /opt/evil/null >/dev/null 2>&1 && echo null:opened; "
                 "/opt/evil/suid-id -u; /opt/evil/all-4777 -u; echo end")
        inside_root = (await run(url, ALPHA, as_root["id"], probe))["stdout"].decode().split()
        assert inside_root[:2] == ["abs-shadow:own", "up-shadow:own"], inside_root
        # the device cgroup refuses the disk; the sandbox's own / is nodev, so even an allowed
        # device's numbers in the image open nothing
        assert "disk:opened" not in inside_root, inside_root
        assert "null:opened" not in inside_root, inside_root
        assert inside_root[-3:] == ["0", "0", "end"], inside_root  # root is root of its own sandbox only
        inside_user = (await run(url, ALPHA, as_user["id"], probe))["stdout"].decode().split()
        assert inside_user[-3:] == ["1000", "1000", "end"], inside_user  # setuid-root gains nothing
        assert "disk:opened" not in inside_user, inside_user
        # the host /proc/1/root is the sandbox's own /proc's (its pid 1 is its init): never the host's
        listing = (await run(url, ALPHA, as_root["id"], "ls /opt/evil/host-root/ 2>&1; echo"))["stdout"]
        assert b"layerbox" not in listing  # the host's / has the data dir's parents; the sandbox's has not
        # the files API: the same links resolve inside; the devices are refused, not opened
        for link in ("abs-shadow", "up-shadow"):
            status, data = await call("GET", f"{url}/v1/sandboxes/{as_root['id']}/files?path=/opt/evil/{link}",
                                      ALPHA)
            assert (status, data) == (200, sandbox_shadow), (link, status)
        for dev in ("disk", "null"):
            for method, raw in (("GET", None), ("PUT", b"x")):
                status, answer = await call(method, f"{url}/v1/sandboxes/{as_root['id']}/files?path=/opt/evil/{dev}",
                                            ALPHA, raw=raw)
                assert (status, answer["error"]["code"]) == (409, "not_a_regular_file"), (dev, method, answer)
        status, answer = await call("GET", f"{url}/v1/sandboxes/{as_root['id']}/files?path=/opt/evil/host-root/etc/shadow",
                                    ALPHA)
        assert status in (403, 404), answer  # a magic link: refused, never followed to the host
        for sid in (as_root["id"], as_user["id"]):
            await call("DELETE", f"{url}/v1/sandboxes/{sid}", ALPHA)

    asyncio.run(scenario())


def test_an_image_without_a_shell_runs_and_no_sandbox_can_touch_its_init(url: str, store_url: str,
                                                                          tmp_path: Path) -> None:
    """Every container's PID 1 is the host's static catatonit bound read-only into /dev's tmpfs:
    an image of one static program (no shell, no /etc) is a sandbox, the sandbox holds that one
    process, and an agent as root can neither write the init nor leave it in its rootfs (a
    checkpoint's upper)."""
    tar = TarBuilder()
    tar.file("hello", Path("/usr/bin/catatonit").read_bytes(), mode=0o755)  # (static: runs anywhere)
    publish_sync(store_url, tmp_path / "pub", str(tar.write(tmp_path / "hello.tar")), "noshell/hello")

    async def scenario() -> None:
        bare = await create(url, ALPHA, image="noshell/hello")
        out = await run(url, ALPHA, bare["id"], ["/hello", "-V"])
        assert out["exit"]["exit_code"] == 0, out
        assert b"catatonit" in out["stdout"] + out["stderr"], out
        full = await create(url, ALPHA)
        probe = ("for f in /dev/.layerbox-init /proc/1/exe; do (echo x > $f) 2>/dev/null && echo $f:written; done; "
                 "tr '\\0' ' ' < /proc/1/cmdline; echo; ls -d /proc/[0-9]* | wc -l; "
                 "ls -a / | grep -c layerbox; echo end")
        lines = (await run(url, ALPHA, full["id"], ["/bin/sh", "-c", probe]))["stdout"].decode().splitlines()
        assert not [x for x in lines if x.endswith(":written")], lines
        assert lines[0].split() == ["/dev/.layerbox-init", "-P"], lines
        # the init, this sh, its ls (and wc) at most: no idle shell or sleep beside the init
        assert int(lines[1]) <= 4, lines
        assert lines[2:] == ["0", "end"], lines  # nothing of the init's in the rootfs
        for sid in (bare["id"], full["id"]):
            await call("DELETE", f"{url}/v1/sandboxes/{sid}", ALPHA)

    asyncio.run(scenario())


# -- 9. metrics need an operator's token -----------------------------------------------------------------
def test_metrics_need_an_admin_token(url: str) -> None:
    async def scenario() -> None:
        for token in (ALPHA, BETA):
            status, answer = await call("GET", f"{url}/metrics", token)
            assert status == 403, answer
        status, text = await call("GET", f"{url}/metrics", OPS)
        assert status == 200
        assert b"layerbox_api_requests_total" in text

    asyncio.run(scenario())
