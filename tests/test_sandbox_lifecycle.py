"""Fork and lifecycle control through the real edge service (raw HTTP on 127.0.0.1, real crun and store):
fork and restore with count, set ttl, list filters, metrics, checkpoints by owner, output kept at the head or
the tail with the cut said, and re-running an interrupted keyed command."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from support.sandboxes import REF, ServerThread, no_sandboxes_left, serving

from layerstore import gc
from layerstore.backend import ObjectNotFound
from layerstore.store import Store
from sandbox.core.model import Maxima, MiB
from sandbox.host.manager import SandboxManager

pytestmark = [pytest.mark.usefixtures("need_root"), pytest.mark.root("erofs", "overlay", "fuse", "cmd:crun")]

ALPHA, BETA = "alpha-life-token-0123456789", "beta-life-token-0123456789"
TOKENS = {"projects": {"alpha": {"tokens": [ALPHA], "max_sandboxes": 10},
                       "beta": {"tokens": [BETA], "max_sandboxes": 3}}}
MAX_LIFETIME = 3600.0
MAXIMA = Maxima(ttl=MAX_LIFETIME, idle_timeout=MAX_LIFETIME, fork=8, output_tail=1 * MiB)
LINES = 100_000  # lines of 8 bytes: 800,000 bytes of stdout
NUMBERS = f"python3 -c \"import sys; sys.stdout.write(''.join(f'{{i:07d}}\\n' for i in range({LINES})))\""
EXPECTED = "".join(f"{i:07d}\n" for i in range(LINES)).encode()


@pytest.fixture(scope="module")
def server(manager: SandboxManager) -> Iterator[ServerThread]:
    with serving(manager, TOKENS, reap_interval=0.3, maxima=MAXIMA) as srv:
        yield srv


@pytest.fixture
def url(server: ServerThread, manager: SandboxManager) -> Iterator[str]:
    with no_sandboxes_left(manager):
        yield server.url


class Api:
    """The service's HTTP API as one project sees it."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.s, self.url = session, url

    async def call(self, method: str, path: str, body: Any = None, *, status: int | None = None,
                   params: Any = None) -> Any:
        async with self.s.request(method, self.url + path, json=body, params=params) as r:
            raw = await r.read()
            if status is not None:
                assert r.status == status, (r.status, raw[:500])
            return json.loads(raw) if raw else None

    async def create(self, **body: Any) -> dict[str, Any]:
        return await self.call("POST", "/v1/sandboxes", {"image": REF, **body}, status=201)

    async def exec(self, sid: str, cmd: Any, **fields: Any) -> list[dict[str, Any]]:
        async with self.s.post(f"{self.url}/v1/sandboxes/{sid}/exec", json={"cmd": cmd, **fields}) as r:
            assert r.status == 200, (r.status, await r.text())
            return [json.loads(line) async for line in r.content if line.strip()]

    async def sh(self, sid: str, cmd: str) -> str:
        events = await self.exec(sid, cmd)
        assert (events[-1]["type"], events[-1].get("exit_code")) == ("exit", 0), events[-3:]
        return output(events).decode()

    async def kill(self, sid: str) -> None:
        await self.call("DELETE", f"/v1/sandboxes/{sid}", status=204)


def output(events: list[dict[str, Any]], stream: str = "stdout") -> bytes:
    return b"".join(base64.b64decode(e["data"]) for e in events if e["type"] == stream)


def cuts(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in e.items() if k != "type"} for e in events if e["type"] == "truncated"]


@asynccontextmanager
async def api(url: str, token: str = ALPHA) -> AsyncIterator[Api]:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"},
                                     timeout=aiohttp.ClientTimeout(total=300)) as s:
        yield Api(s, url)


def field_of(doc: dict[str, Any]) -> str:
    return str(doc["error"].get("field"))


# -- fork and restore with count ---------------------------------------------------------------------------
def test_fork_of_eight_continue_from_the_same_state_and_are_independent(url: str) -> None:
    async def scenario() -> None:
        async with api(url) as a:
            src = await a.create(env={"GREETING": "hi"}, workdir="/root", labels={"team": "x"})
            await a.sh(src["id"], "echo before-fork > /root/state.txt; mkdir -p /root/deep/er")
            res = await a.call("POST", f"/v1/sandboxes/{src['id']}/fork", {"count": 8}, status=201)
            forks = res["sandboxes"]
            assert res["source"] == src["id"]
            assert len(forks) == 8
            assert res["checkpoint"]["name"].startswith("projects/alpha/checkpoints/")
            assert len({f["id"] for f in forks} | {src["id"]}) == 9
            for f in forks:
                assert (f["status"], f["labels"], f["image"]) == ("running", {"team": "x"}, res["checkpoint"]["name"])
            seen = await asyncio.gather(*(a.sh(f["id"], "cat state.txt; echo $GREETING; pwd; ls -d deep/er")
                                          for f in forks))
            assert set(seen) == {"before-fork\nhi\n/root\ndeep/er\n"}
            # independent from here on: each writes its own, nobody sees another's
            await asyncio.gather(*(a.sh(f["id"], f"echo {f['id']} > state.txt") for f in forks))
            await a.sh(src["id"], "echo source-after > state.txt")
            for f in forks:
                assert await a.sh(f["id"], "cat state.txt") == f"{f['id']}\n"
            assert await a.sh(src["id"], "cat state.txt") == "source-after\n"
            # a fork's options over the source's
            one = await a.call("POST", f"/v1/sandboxes/{src['id']}/fork", {"count": 1, "env": {"GREETING": "yo"},
                                                                          "labels": {"extra": "1"}}, status=201)
            fork = one["sandboxes"][0]
            assert fork["labels"] == {"team": "x", "extra": "1"}
            assert await a.sh(fork["id"], "echo $GREETING; cat state.txt") == "yo\nsource-after\n"
            for sid in [src["id"], fork["id"], *(f["id"] for f in forks)]:
                await a.kill(sid)

    asyncio.run(scenario())


def test_fork_quota_is_exact_and_nothing_is_half_made(url: str, manager: SandboxManager) -> None:
    async def scenario() -> None:
        async with api(url, BETA) as b:
            src = await b.create()
            before = await b.call("GET", "/v1/checkpoints", status=200)
            err = await b.call("POST", f"/v1/sandboxes/{src['id']}/fork", {"count": 3}, status=429)
            assert "has 1 of 3 sandboxes; this needs 3 more" in err["error"]["message"]
            assert [st.id for st in manager.list() if st.project == "beta"] == [src["id"]]
            assert await b.call("GET", "/v1/checkpoints", status=200) == before  # not even the checkpoint
            # bounds: count is 1 to the edge's fork maximum (8 here), an integer
            for bad in (0, 9, "2", 1.5, True):
                err = await b.call("POST", f"/v1/sandboxes/{src['id']}/fork", {"count": bad}, status=400)
                assert field_of(err) == "count"
            err = await b.call("POST", f"/v1/sandboxes/{src['id']}/fork", {"count": 1, "memory": 1}, status=400)
            assert field_of(err) == "memory"
            # exactly at the quota: two more
            res = await b.call("POST", f"/v1/sandboxes/{src['id']}/fork", {"count": 2}, status=201)
            assert len(res["sandboxes"]) == 2
            await b.call("POST", f"/v1/sandboxes/{src['id']}/fork", {"count": 1}, status=429)
            async with api(url) as a:  # another project's sandbox is not there to fork
                await a.call("POST", f"/v1/sandboxes/{src['id']}/fork", {"count": 1}, status=404)
            for sid in [src["id"], *(f["id"] for f in res["sandboxes"])]:
                await b.kill(sid)
            await b.call("DELETE", f"/v1/checkpoints/{res['checkpoint']['name']}", status=204)

    asyncio.run(scenario())


def test_restore_with_count_makes_that_many(url: str) -> None:
    async def scenario() -> None:
        async with api(url) as a:
            src = await a.create(env={"K": "v"})
            await a.sh(src["id"], "echo saved > /root/f")
            ckpt = await a.call("POST", f"/v1/sandboxes/{src['id']}/checkpoint", {"name": "counted"}, status=201)
            # two more with nothing changed: each adds the same empty layer, stacked once on restore
            for _ in range(2):
                same = await a.call("POST", f"/v1/sandboxes/{src['id']}/checkpoint", {"name": "unchanged"},
                                    status=201)
            assert same["layers"] == ckpt["layers"] + 2
            again = await a.call("POST", "/v1/sandboxes/restore", {"checkpoint": same["name"]}, status=201)
            assert await a.sh(again["id"], "cat /root/f") == "saved\n"
            await a.kill(again["id"])
            await a.call("DELETE", f"/v1/checkpoints/{same['name']}", status=204)
            res = await a.call("POST", "/v1/sandboxes/restore", {"checkpoint": ckpt["name"], "count": 3}, status=201)
            assert len(res["sandboxes"]) == 3
            for box in res["sandboxes"]:
                assert await a.sh(box["id"], "cat /root/f; echo $K") == "saved\nv\n"
                await a.kill(box["id"])
            one = await a.call("POST", "/v1/sandboxes/restore", {"checkpoint": ckpt["name"]}, status=201)
            assert one["status"] == "running"  # without count: the sandbox itself, as before
            await a.kill(one["id"])
            err = await a.call("POST", "/v1/sandboxes/restore", {"checkpoint": ckpt["name"], "count": 0}, status=400)
            assert field_of(err) == "count"
            await a.kill(src["id"])
            await a.call("DELETE", f"/v1/checkpoints/{ckpt['name']}", status=204)

    asyncio.run(scenario())


# -- ttl --------------------------------------------------------------------------------------------------------
async def gone(a: Api, sid: str, within: float) -> float:
    """Seconds until the sandbox answers 404 (fails after ``within``)."""
    start = time.monotonic()
    while time.monotonic() - start < within:
        async with a.s.get(f"{a.url}/v1/sandboxes/{sid}") as r:
            if r.status == 404:
                return time.monotonic() - start
        await asyncio.sleep(0.1)
    raise AssertionError(f"sandbox {sid} still there after {within} s")


def test_set_ttl_extends_and_shortens(url: str) -> None:
    async def scenario() -> None:
        async with api(url) as a:
            box = await a.create(ttl=3)
            view = await a.call("POST", f"/v1/sandboxes/{box['id']}/ttl", {"ttl": 60}, status=200)
            assert 60 <= view["ttl"] < 70
            assert abs(view["expires"] - (time.time() + 60)) < 5
            await asyncio.sleep(4)  # past the ttl it was created with
            assert (await a.call("GET", f"/v1/sandboxes/{box['id']}", status=200))["status"] == "running"
            # bounds: positive, a number, and the sandbox's age plus it within the edge's maximum lifetime
            for bad in (0, -1, "10", None):
                err = await a.call("POST", f"/v1/sandboxes/{box['id']}/ttl", {"ttl": bad}, status=400)
                assert field_of(err) == "ttl"
            err = await a.call("POST", f"/v1/sandboxes/{box['id']}/ttl", {"ttl": MAX_LIFETIME - 1}, status=400)
            assert field_of(err) == "ttl"
            assert "maximum lifetime" in err["error"]["message"]
            err = await a.call("POST", f"/v1/sandboxes/{box['id']}/ttl", {"ttl": 5, "idle": 1}, status=400)
            assert field_of(err) == "idle"
            async with api(url, BETA) as b:
                await b.call("POST", f"/v1/sandboxes/{box['id']}/ttl", {"ttl": 1}, status=404)
            # shorten: the reaper destroys it at the new ttl, not at the one it had
            await a.call("POST", f"/v1/sandboxes/{box['id']}/ttl", {"ttl": 1.5}, status=200)
            assert 1.0 < await gone(a, box["id"], within=15) < 10

    asyncio.run(scenario())


# -- list filters -----------------------------------------------------------------------------------------
def test_list_filters_on_labels_and_status(url: str) -> None:
    async def scenario() -> None:
        async with api(url) as a:
            one = await a.create(labels={"tier": "web", "team": "a"})
            two = await a.create(labels={"tier": "db", "team": "a"})
            await a.call("POST", f"/v1/sandboxes/{two['id']}/pause", status=200)

            async def ids(params: list[tuple[str, str]]) -> set[str]:
                doc = await a.call("GET", "/v1/sandboxes", params=params, status=200)
                return {s["id"] for s in doc["sandboxes"]}

            assert await ids([]) == {one["id"], two["id"]}
            assert await ids([("label", "tier=web")]) == {one["id"]}
            assert await ids([("label", "team=a")]) == {one["id"], two["id"]}
            assert await ids([("label", "team=a"), ("label", "tier=db")]) == {two["id"]}
            assert await ids([("state", "paused")]) == {two["id"]}
            assert await ids([("state", "running"), ("label", "team=a")]) == {one["id"]}
            assert await ids([("label", "tier=cache")]) == set()
            assert await ids([("label", "nosuch=")]) == set()
            for params, field in (([("state", "sleeping")], "state"), ([("label", "tier")], "label"),
                                  ([("label", "layerbox.project=alpha")], "label.layerbox.project"),
                                  ([("label", "tier=web"), ("label", "tier=db")], "label"),
                                  ([("colour", "red")], "colour")):
                err = await a.call("GET", "/v1/sandboxes", params=params, status=400)
                assert field_of(err) == field, (params, err)
            async with api(url, BETA) as b:  # filters never reach past the project
                doc = await b.call("GET", "/v1/sandboxes", params=[("label", "team=a")], status=200)
                assert doc["sandboxes"] == []
            await a.kill(one["id"])
            await a.kill(two["id"])

    asyncio.run(scenario())


# -- metrics ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("disk", [None, 256 * MiB], ids=["upper", "disk"])
def test_metrics_move_when_a_command_allocates_memory_and_writes_disk(url: str, disk: int | None) -> None:
    async def scenario() -> None:
        async with api(url) as a:
            box = await a.create(**({"disk": disk} if disk else {}))
            path = f"/v1/sandboxes/{box['id']}/metrics"
            before = await a.call("GET", path, status=200)
            assert before["disk"]["where"] == ("disk" if disk else "upper")
            assert before["memory"]["limit"] == 512 * MiB
            assert before["pids"]["current"] >= 1
            await a.sh(box["id"], "python3 -c \"b = bytearray(96 << 20); b[::4096] = b'x' * len(b[::4096])\"")
            await a.sh(box["id"], "head -c 32M /dev/urandom > /root/blob && sync")
            after = await a.call("GET", path, status=200)
            assert after["memory"]["peak"] - before["memory"]["peak"] >= 64 * MiB
            assert after["disk"]["used"] - before["disk"]["used"] >= 30 * MiB
            assert after["cpu_seconds"] > before["cpu_seconds"]
            assert after["commands"]["count"] == before["commands"]["count"] + 2
            last = after["commands"]["last"]
            assert last["exit_code"] == 0
            assert last["resources"]["memory_peak"] >= 96 * MiB
            await a.sh(box["id"], "rm /root/blob")
            freed = await a.call("GET", path, status=200)
            assert after["disk"]["used"] - freed["disk"]["used"] >= 30 * MiB
            async with api(url, BETA) as b:
                await b.call("GET", path, status=404)
            await a.kill(box["id"])

    asyncio.run(scenario())


# -- checkpoints by owner --------------------------------------------------------------------------------
def test_checkpoints_are_listed_and_deleted_by_their_owner_only(url: str, store_url: str,
                                                                tmp_path: Path) -> None:
    async def scenario() -> None:
        async with api(url) as a, api(url, BETA) as b:
            box = await a.create(labels={"k": "v"})
            ckpt = await a.call("POST", f"/v1/sandboxes/{box['id']}/checkpoint", {"name": "mine:1",
                                                                                  "labels": {"step": "1"}}, status=201)
            name = ckpt["name"]
            assert name == "projects/alpha/mine:1"
            listed = {c["name"]: c for c in (await a.call("GET", "/v1/checkpoints", status=200))["checkpoints"]}
            assert listed[name]["digest"] == ckpt["digest"]
            assert listed[name]["labels"] == {"k": "v", "step": "1"}
            assert listed[name]["layers"] == ckpt["layers"]
            assert name not in {c["name"] for c in (await b.call("GET", "/v1/checkpoints", status=200))["checkpoints"]}
            await b.call("DELETE", f"/v1/checkpoints/{name}", status=404)  # another project's: as if missing
            await a.call("DELETE", f"/v1/checkpoints/{REF}", status=404)  # a shared image is nobody's to delete
            await a.call("DELETE", "/v1/checkpoints/projects/alpha/nothing:here", status=404)
            err = await a.call("DELETE", "/v1/checkpoints/projects/alpha/BAD NAME", status=400)
            assert field_of(err) == "name"
            await a.call("GET", "/v1/checkpoints", params={"all": "1"}, status=400)
            await a.call("DELETE", f"/v1/checkpoints/{name}", status=204)
            assert name not in {c["name"] for c in (await a.call("GET", "/v1/checkpoints", status=200))["checkpoints"]}
            await a.call("POST", "/v1/sandboxes/restore", {"checkpoint": name}, status=404)
            await a.call("DELETE", f"/v1/checkpoints/{name}", status=404)
            await a.kill(box["id"])
        # gc does the rest: the document and its receipts go (its options document is content shared
        # with every checkpoint of a sandbox with the same options)
        async with await Store.open(store_url, tmp_path / "gc") as store:
            doc = await store.get_doc(ckpt["digest"])
            await gc.collect(store, grace=0)
        async with await Store.open(store_url, tmp_path / "after") as store:  # (a fresh host cache)
            for digest in (ckpt["digest"], doc["attachments"]["receipts"]):
                with pytest.raises(ObjectNotFound):
                    await store.get_doc(digest)

    asyncio.run(scenario())


# -- output kept at the head or the tail -------------------------------------------------------------------
def test_keep_tail_ends_the_stream_with_the_last_bytes_and_says_how_much_was_cut(url: str) -> None:
    cap = 8000
    async def scenario() -> None:
        async with api(url) as a:
            box = await a.create()
            events = await a.exec(box["id"], NUMBERS, output_cap=cap, keep="tail")
            got = output(events)
            assert got == EXPECTED[:cap] + EXPECTED[-cap:]
            assert cuts(events) == [{"stream": "stdout", "offset": cap, "dropped_bytes": len(EXPECTED) - 2 * cap,
                                     "keep": "tail"}]
            kinds = [e["type"] for e in events]
            assert kinds.index("truncated") < len(kinds) - 2
            assert kinds[-1] == "exit"
            assert events[-1]["truncated"] is True
            assert events[-1]["exit_code"] == 0
            # under 2 caps nothing is dropped: head live, the rest at the end
            small = await a.exec(box["id"], "seq 1 3000", output_cap=cap, keep="tail")
            assert output(small) == b"".join(b"%d\n" % i for i in range(1, 3001))
            assert cuts(small) == []
            # a keyed tail replays its receipt's last bytes, the cut before them
            first = await a.exec(box["id"], NUMBERS, output_cap=cap, keep="tail", idempotency_key="numbers")
            again = await a.exec(box["id"], NUMBERS, output_cap=cap, keep="tail", idempotency_key="numbers")
            assert again[-1]["replayed"] is True
            assert output(first)[-cap:] == output(again) == EXPECTED[-cap:]
            assert cuts(again) == [{"stream": "stdout", "offset": 0, "dropped_bytes": len(EXPECTED) - cap,
                                    "keep": "tail"}]
            assert [e["type"] for e in again][0] == "truncated"
            # the tail is held in memory: its cap has the edge's lower maximum
            async with a.s.post(f"{url}/v1/sandboxes/{box['id']}/exec",
                                json={"cmd": "true", "keep": "tail", "output_cap": 2 * MiB}) as r:
                assert r.status == 400
                assert field_of(await r.json()) == "output_cap"
            async with a.s.post(f"{url}/v1/sandboxes/{box['id']}/exec", json={"cmd": "true", "keep": "end"}) as r:
                assert r.status == 400
                assert field_of(await r.json()) == "keep"
            await a.kill(box["id"])

    asyncio.run(scenario())


def test_keep_head_is_the_default_and_now_says_where_it_cut(url: str) -> None:
    cap = 8000
    async def scenario() -> None:
        async with api(url) as a:
            box = await a.create()
            events = await a.exec(box["id"], NUMBERS + " >&2", output_cap=cap)
            assert output(events, "stderr") == EXPECTED[:cap]
            assert output(events) == b""
            assert cuts(events) == [{"stream": "stderr", "offset": cap, "dropped_bytes": len(EXPECTED) - cap,
                                     "keep": "head"}]
            assert [e["type"] for e in events][-2:] == ["truncated", "exit"]
            assert events[-1]["truncated"] is True
            whole = await a.exec(box["id"], "echo short")
            assert cuts(whole) == []
            assert output(whole) == b"short\n"
            assert whole[-1]["truncated"] is False
            none = await a.exec(box["id"], "echo gone", output_cap=0)
            assert output(none) == b""
            assert cuts(none) == [{"stream": "stdout", "offset": 0, "dropped_bytes": 5,
                                                           "keep": "head"}]
            await a.kill(box["id"])

    asyncio.run(scenario())


# -- rerun_if_interrupted -----------------------------------------------------------------------------------
def test_rerun_if_interrupted_runs_an_interrupted_keyed_command_again_and_replays_a_finished_one(url: str) -> None:
    # the first run counts itself and sleeps (it is cut short); a later run counts itself and ends
    cmd = "echo run >> /root/runs; n=$(wc -l < /root/runs); [ $n -gt 1 ] || sleep 300; echo run $n"

    async def scenario() -> None:
        async with api(url) as a:
            box = await a.create()
            async with a.s.post(f"{url}/v1/sandboxes/{box['id']}/exec",
                                json={"cmd": cmd, "idempotency_key": "job-1"}) as r:
                await asyncio.sleep(1.0)  # the command is running (sleeping); the client goes away
                r.close()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                doc = await a.call("GET", f"/v1/sandboxes/{box['id']}/receipts",
                                   params={"action": "exec", "idempotency_key": "job-1"}, status=200)
                if doc["receipts"]:
                    break
                await asyncio.sleep(0.1)
            assert doc["receipts"][-1]["interrupted"] == "disconnect"
            # a plain retry replays the interruption, as before
            replayed = await a.exec(box["id"], cmd, idempotency_key="job-1")
            assert (replayed[-1]["replayed"], replayed[-1]["interrupted"]) == (True, "disconnect")
            # asked to, it runs again
            rerun = await a.exec(box["id"], cmd, idempotency_key="job-1", rerun_if_interrupted=True)
            assert (rerun[-1]["replayed"], rerun[-1]["interrupted"], rerun[-1]["exit_code"]) == (False, None, 0)
            assert output(rerun) == b"run 2\n"
            # finished now: even with rerun_if_interrupted it replays, and runs nothing
            done = await a.exec(box["id"], cmd, idempotency_key="job-1", rerun_if_interrupted=True)
            assert (done[-1]["replayed"], output(done)) == (True, b"run 2\n")
            assert await a.sh(box["id"], "wc -l < /root/runs") == "2\n"
            async with a.s.post(f"{url}/v1/sandboxes/{box['id']}/exec",
                                json={"cmd": "true", "rerun_if_interrupted": True}) as r:
                assert r.status == 400
                assert field_of(await r.json()) == "rerun_if_interrupted"
            async with a.s.post(f"{url}/v1/sandboxes/{box['id']}/exec",
                                json={"cmd": "true", "idempotency_key": "x", "rerun_if_interrupted": 1}) as r:
                assert r.status == 400
                assert field_of(await r.json()) == "rerun_if_interrupted"
            await a.kill(box["id"])

    asyncio.run(scenario())
