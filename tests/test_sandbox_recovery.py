"""What a crashed or stopped edge leaves behind: real service processes, real crun, real mounts.

``python -m sandbox.edge`` runs as a child process on its own data dir against a store
with the fixture image, and is then ended the two ways an operator ends it:

* ``kill -9`` while a job's sandbox streams two long commands and a FnCall warm pool is
  ready, then a new service on the same data dir.  Its reconcile must adopt the job's
  sandbox, kill the commands that outlived the old service and close their receipts as
  ``interrupted: "restart"``, reap the pool, and leave no exec file, container or cgroup
  that belongs to no sandbox.
* SIGTERM after it served a sandbox (with a network namespace), a FnCall and a file upload
  and download: it must exit in bounded time with nothing of its data dir left on the host,
  its lazyfetch daemon included.

What the code under test would report about itself is not trusted: processes are read
from /proc, cgroups from every hierarchy in the kernel's mount table, containers from crun.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import io
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lazyfetch import kmount
from lazyfetch.mounts import HostMounts
from sandbox.backends.container.spec import IDLE_INIT
from sandbox.core.model import POOL_LABEL, SandboxState
from sandbox.edge.app import SHUTDOWN_GRACE
from sandbox.isolation.cgroups import KEPT_PREFIX
from sandbox.sdk import AsyncSandbox
from sandbox.sdk import call as sdk_call
from tests.support.edges import EdgeProcess, cgroup_dirs, cgroup_hierarchies, leftovers
from tests.support.sandboxes import REF

pytestmark = [pytest.mark.usefixtures("need_root"), pytest.mark.root("erofs", "overlay", "fuse", "cmd:crun")]

TOKEN = "recovery-token-0123456789"
TOKENS = {"projects": {"p": {"tokens": [TOKEN], "max_sandboxes": 10}}}
LONG = "sleep 300; echo done > /root/late"  # would write /root/late only if it ran on to its end
KEY = "long-1"
WAIT = 60.0  # seconds for anything a loaded 2-core host should do in well under 10
STOP_LIMIT = 30.0  # a SIGTERM'd service that takes longer than this is hung (or waits out a command)


def wait_for(what: str, check: Callable[[], Any], timeout: float = WAIT) -> Any:
    """Poll ``check`` until it returns something truthy; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout} s (last: {value!r})")
        time.sleep(0.05)


def processes_in(cgroups_path: str) -> dict[int, str]:
    """pid -> command line (arguments joined by spaces) of every process in ``cgroups_path`` or below,
    in any hierarchy, read from /proc (the fixture image has no ps)."""
    want = "/" + cgroups_path.strip("/")
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            groups = Path(f"/proc/{name}/cgroup").read_text().splitlines()
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue  # exited meanwhile
        paths = {line.split(":", 2)[2] for line in groups}
        if any(p == want or p.startswith(want + "/") for p in paths) and cmdline:
            found[int(name)] = cmdline.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def api(edge: EdgeProcess, method: str, path: str, data: bytes | None = None) -> tuple[int, bytes]:
    """One request with a raw body (a file, an exec's ndjson stream): (status, body)."""
    req = urllib.request.Request(edge.url + path, data=data, method=method,
                                 headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=WAIT) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def exec_events(edge: EdgeProcess, sid: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Run one command to its end through the API: the stream's events."""
    status, raw = api(edge, "POST", f"/v1/sandboxes/{sid}/exec", json.dumps(body).encode())
    assert status == 200, raw
    return [json.loads(line) for line in raw.splitlines() if line.strip()]


def open_stream(edge: EdgeProcess, sid: str,
                body: dict[str, Any]) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """Start a command and leave its output stream open (nothing of it is read here)."""
    conn = http.client.HTTPConnection("127.0.0.1", edge.port, timeout=WAIT)
    conn.request("POST", f"/v1/sandboxes/{sid}/exec", json.dumps(body),
                 {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    resp = conn.getresponse()  # the headers come once the command has been started
    assert resp.status == 200, resp.read()
    return conn, resp


def exec_files(edge: EdgeProcess, sid: str) -> list[str]:
    bundle = edge.data_dir / "sandbox" / "run" / "bundles" / sid
    return sorted(n for n in os.listdir(bundle) if n.startswith("exec-"))


def pool_states(edge: EdgeProcess) -> list[SandboxState]:
    return [st for st in edge.manager().list() if POOL_LABEL in st.labels]


@pytest.fixture
def make_edge(store_url: str, tmp_path: Path) -> Iterator[Callable[[str], EdgeProcess]]:
    """Make edges on ``store_url``; each one is stopped and everything of its data dir removed
    when the test ends however it ends (and the test fails if there was anything to remove)."""
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    made: list[EdgeProcess] = []

    def make(name: str) -> EdgeProcess:
        edge = EdgeProcess(name, tmp_path, store_url, tokens, "--memory-reserve", "256M",
                           "--disk-reserve", "256M", token=TOKEN)
        made.append(edge)
        return edge

    try:
        yield make
    finally:
        problems = []
        for edge in made:
            edge.stop()
            problems += edge.clean_up()
        assert not problems, problems


# -- kill -9 ------------------------------------------------------------------------------------------
def test_kill_9_then_restart_reaps_the_pool_and_stops_what_ran_unobserved(
        make_edge: Callable[[str], EdgeProcess]) -> None:
    edge = make_edge("crash")
    edge.start()
    status, _, info = edge.http("POST", "/v1/sandboxes", {"image": REF, "job": "train", "lease_ttl": 600})
    assert status == 201, info
    sid = info["id"]
    state = next(st for st in edge.manager().list() if st.id == sid)
    streams = []
    try:
        streams.append(open_stream(edge, sid, {"cmd": LONG, "idempotency_key": KEY})[0])
        streams.append(open_stream(edge, sid, {"cmd": LONG})[0])

        def long_commands() -> list[int]:
            found = [pid for pid, cmd in processes_in(state.cgroups_path).items()
                     if cmd in (f"/bin/sh -c {LONG}", "sleep 300")]
            # each command: its shell and the shell's sleep, its process document and pid file
            return found if len(found) == 4 and len(exec_files(edge, sid)) == 4 else []

        running = wait_for("both long commands running in the sandbox", long_commands)

        status, _, called = edge.http("POST", "/v1/calls", {"image": REF, "cmd": "true"}, timeout=WAIT)
        assert status == 200, called
        assert called["exit_code"] == 0

        def ready_pool() -> list[SandboxState]:
            """The used entry is destroyed and replaced in the background: two ready ones, or []."""
            pool = pool_states(edge)
            return pool if len(pool) == 2 and all(st.status == "running" for st in pool) else []

        pool = wait_for("a warm pool of two running sandboxes", ready_pool)
        pool_ids = sorted(st.id for st in pool)
        pool_inits = [st.pid for st in pool if st.pid is not None]

        daemon = HostMounts(edge.data_dir).client.health()
        assert daemon is not None
        edge.kill()  # the crash: nothing of the service's cleanup runs
    finally:
        for conn in streams:
            conn.close()

    # what the crash left is real: the daemon serves on, the pool's and the commands' processes run
    assert HostMounts(edge.data_dir).client.health() == daemon
    assert {c["id"] for c in edge.manager().backend("container").runtime.list()} == {sid, *pool_ids}
    assert all(alive(pid) for pid in running + pool_inits)

    edge.start()
    mgr = edge.manager()

    # the pool died with its service: no pool sandbox, container, box or cgroup survives
    assert [st.id for st in mgr.list()] == [sid], "only the job's sandbox is adopted"
    assert pool_states(edge) == []
    assert [c["id"] for c in mgr.backend("container").runtime.list()] == [sid], "no crun container beyond the adopted sandbox"
    assert sorted(os.listdir(mgr.boxes)) == [sid]
    assert not any(alive(pid) for pid in pool_inits)
    assert edge.sandboxes() == [sid]

    # the commands that outlived the service were killed: the sandbox runs its init alone
    assert not any(alive(pid) for pid in running), processes_in(state.cgroups_path)
    adopted = next(st for st in mgr.list() if st.id == sid)
    assert list(processes_in(adopted.cgroups_path).values()) == [" ".join(IDLE_INIT)]
    assert exec_files(edge, sid) == [], "the exec process documents and pid files are removed"

    # their receipts say what happened, in an intact chain (the service checks it before answering)
    status, _, doc = edge.http("GET", f"/v1/sandboxes/{sid}/receipts")
    assert status == 200, doc
    execs = [r for r in doc["receipts"] if r["action"] == "exec"]
    assert len(execs) == 2, execs
    assert doc["receipts"][-2:] == execs, "the interrupted commands' receipts are the last records"
    for rec in execs:
        assert rec["command"] == ["/bin/sh", "-c", LONG]
        assert (rec["interrupted"], rec["signal"], rec["exit_code"]) == ("restart", 9, None)
    assert sorted(str(r.get("idempotency_key")) for r in execs) == sorted([KEY, "None"]), \
        "only the keyed command's receipt carries its key"

    # a retry of the keyed command answers the interruption; it neither runs again nor says "still running"
    events = exec_events(edge, sid, {"cmd": LONG, "idempotency_key": KEY})
    final = events[-1]
    assert final["type"] == "exit", events
    assert (final["replayed"], final["interrupted"], final["exit_code"]) == (True, "restart", None)
    assert [e for e in events if e["type"] != "exit"] == []
    assert "sleep 300" not in " ".join(processes_in(adopted.cgroups_path).values())

    # the adopted sandbox works: commands and files
    events = exec_events(edge, sid, {"cmd": "echo alive; test ! -e /root/late"})
    assert events[-1]["exit_code"] == 0, events
    assert base64.b64decode(events[0]["data"]) == b"alive\n"
    files = f"/v1/sandboxes/{sid}/files?path=/root/after"
    assert api(edge, "PUT", files, b"restarted\n")[0] == 201
    assert api(edge, "GET", files) == (200, b"restarted\n")

    # cgroups: the adopted sandbox's, and no directory of this data dir's parent that holds no
    # sandbox, but for the empty ones kept for the next creates (Cgroups.keep)
    parent = mgr.cgroup_parent
    for root in cgroup_hierarchies():
        top = root / parent
        if top.is_dir():
            children = sorted(p.name for p in top.iterdir() if p.is_dir() and not p.name.startswith(KEPT_PREFIX))
            assert children == [sid], f"{top} holds {children}"
            for kept in top.glob(KEPT_PREFIX + "*"):
                assert (kept / "cgroup.procs").read_text() == "", f"{kept} has tasks"
    assert cgroup_dirs(parent), "the adopted sandbox has cgroups"
    for pool_id in pool_ids:
        assert not [d for d in cgroup_dirs(parent) if d.name == pool_id]

    # and the service that adopted it (and served the requests above) stops without a trace
    assert_stops_clean(edge)


# -- SIGTERM ------------------------------------------------------------------------------------------
def test_sigterm_leaves_nothing_of_its_data_dir_and_stops_its_daemon(
        make_edge: Callable[[str], EdgeProcess]) -> None:
    edge = make_edge("term")
    edge.start()
    payload = os.urandom(3 << 20) + b"end"  # several chunks of the service's 1 MiB file reads

    async def serve_requests() -> str:
        # not killed at the end: the stop has this sandbox (and its network namespace) to take down
        sb = await AsyncSandbox.create(REF, url=edge.url, token=TOKEN, job="term", network=[])
        try:
            assert await sb.files.upload("/root/blob", io.BytesIO(payload)) == len(payload)
            out = io.BytesIO()
            assert await sb.files.download("/root/blob", out) == len(payload)
            assert out.getvalue() == payload
            called = await sdk_call(REF, "true", url=edge.url, token=TOKEN)
            assert called.exit_code == 0
        finally:
            await sb.close()  # the client's session only
        return sb.sandbox_id

    sid = asyncio.run(serve_requests())
    mgr = edge.manager()
    wait_for("a warm pool sandbox", lambda: pool_states(edge))
    # a long command still streams when the stop comes: it must not hold the stop for its 300 s
    cgroups_path = next(st.cgroups_path for st in mgr.list() if st.id == sid)
    conn, stream = open_stream(edge, sid, {"cmd": LONG, "idempotency_key": KEY})
    try:
        wait_for("the long command running", lambda: "sleep 300" in processes_in(cgroups_path).values())
        before = leftovers(mgr)  # all of it is there before the stop: the checks below can fail
        for kind in ("crun containers", "mounts", "cgroups", "network namespaces", "the lazyfetch daemon"):
            assert any(p.startswith(kind) for p in before), (kind, before)
        health = mgr.host.client.health()
        assert health is not None
        # the daemon's kernel state: its FUSE mount, or (fanotify) the fd holder keeping the group
        if health["data_path"] == "fuse":
            assert str(edge.data_dir / "blobs") in kmount.mounts_under(edge.data_dir)
        else:
            assert alive(int(health["holder"]))

        # a reader still in a layer mount for a second into the stop (an operator's shell, a scanner,
        # the kernel releasing a container's copy): the layer cannot be unmounted at once, and its
        # blob keeps the daemon's FUSE mount busy; the stop must outlast it, not give up
        layers = kmount.mounts_under(edge.data_dir / "layers")
        assert layers
        held = os.open(layers[0], os.O_RDONLY | os.O_DIRECTORY)
        release = threading.Timer(1.0, os.close, [held])
        release.start()
        try:
            assert_stops_clean(edge)
        finally:
            release.join(5)
        # its caller got an answer, not a cut connection; the receipt log (kept after destroy) says it too
        try:
            rest = stream.read()
        except http.client.IncompleteRead as exc:
            raise AssertionError(f"the command's stream was cut without an exit event: {exc.partial!r}") from None
    finally:
        conn.close()
    events = [json.loads(line) for line in rest.splitlines() if line.strip()]
    assert events, rest
    assert events[-1]["type"] == "exit", rest
    assert (events[-1]["interrupted"], events[-1]["signal"]) == ("shutdown", 9)
    execs = [r for r in mgr.receipts(sid) if r["action"] == "exec"]
    assert [(r["interrupted"], r["idempotency_key"]) for r in execs] == [("shutdown", KEY)]
    assert mgr.receipts(sid)[-1]["action"] == "destroy"


def assert_stops_clean(edge: EdgeProcess) -> None:
    """SIGTERM ``edge``: it exits 0 in bounded time, and nothing of its data dir is left on the host."""
    daemon = HostMounts(edge.data_dir).client.health()
    assert daemon is not None
    log_start = edge.log.stat().st_size
    started = time.monotonic()
    code = edge.terminate(STOP_LIMIT)
    took = time.monotonic() - started
    assert code is not None, f"still running {STOP_LIMIT} s after SIGTERM:\n{edge.tail()}"
    said = edge.log.read_bytes()[log_start:].decode(errors="replace")
    assert code == 0, f"exit status {code} after SIGTERM:\n{said}"
    assert took < SHUTDOWN_GRACE, f"the stop took {took:.1f} s: a request in flight waited out the grace time"
    assert leftovers(edge.manager()) == [], said
    assert kmount.mounts_under(edge.data_dir) == []  # the FUSE blobs/ mount included
    assert HostMounts(edge.data_dir).client.health() is None
    assert not alive(int(daemon["pid"])), "the lazyfetch daemon process is gone"
    assert not alive(int(daemon["holder"])), "and its fd holder (nothing is mounted on its fds any more)"
    assert "Traceback" not in said, said
