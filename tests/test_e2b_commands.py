"""The stock ``e2b`` SDK against a layerbox edge: sandboxes, commands (envd's process service),
ports, and what a hostile client sends to the Connect surface.

Every test drives a real edge process (tests/support/e2b.py) with real sandboxes through the
unmodified ``e2b`` package, configured only by ``E2B_API_KEY``, ``E2B_API_URL`` and
``E2B_SANDBOX_URL``; what the SDK cannot send (tags, keepalive intervals, bad envelopes, other
host names) goes as raw HTTP to the same edge.  The edge also answers ``<port>-<id>.sandboxes.test``
host names (``--e2b-domain``), as it would behind a TLS proxy for ``E2B_DOMAIN``.
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from e2b import (
    AsyncSandbox,
    CommandExitException,
    InvalidArgumentException,
    PtySize,
    Sandbox,
    SandboxException,
    SandboxNotRunningException,
    TimeoutException,
)
from support.e2b import (
    ALPHA,
    BETA,
    ENVD,
    SOURCE_IMAGE,
    TEMPLATE,
    E2bEdge,
    e2b_edge,
    echo_through,
    envd_headers,
    ws_echo,
)
from support.edges import http
from support.sandboxes import store_url  # noqa: F401  (a module's store with the fixture image)

pytestmark = pytest.mark.root
DOMAIN = "sandboxes.test"


@pytest.fixture(scope="module")
def served(store_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2bEdge]:  # noqa: F811
    with e2b_edge(tmp_path_factory.mktemp("e2b"), store_url, "--e2b-domain", DOMAIN) as edge:
        yield edge


@pytest.fixture
def sbx(served: E2bEdge) -> Iterator[Sandbox]:
    box = Sandbox.create(TEMPLATE, timeout=120)
    try:
        yield box
    finally:
        box.kill()


def test_a_command_runs_as_e2bs_user_in_its_home_with_streamed_output(sbx: Sandbox) -> None:
    seen: list[str] = []
    result = sbx.commands.run("echo out; whoami; pwd; echo $HOME; echo err >&2", on_stdout=seen.append)
    assert result.exit_code == 0
    assert result.stdout == "out\nuser\n/home/user\n/home/user\n"
    assert result.stderr == "err\n"
    assert "".join(seen) == result.stdout


def test_root_cwd_and_envs_are_the_callers(sbx: Sandbox) -> None:
    result = sbx.commands.run("whoami; pwd; echo $GREETING", user="root", cwd="/tmp", envs={"GREETING": "hej"})
    assert result.stdout == "root\n/tmp\nhej\n"


def test_a_failing_command_raises_the_sdks_exit_exception_with_its_code(sbx: Sandbox) -> None:
    with pytest.raises(CommandExitException) as caught:
        sbx.commands.run("echo partial; exit 7")
    assert caught.value.exit_code == 7
    assert caught.value.stdout == "partial\n"


def test_a_background_command_is_listed_connected_to_and_killed(sbx: Sandbox) -> None:
    handle = sbx.commands.run("echo started; sleep 60", background=True)
    assert handle.pid in [p.pid for p in sbx.commands.list()]
    again = sbx.commands.connect(handle.pid)
    assert sbx.commands.kill(handle.pid) is True
    with pytest.raises(CommandExitException) as caught:
        again.wait()
    assert "started" in caught.value.stdout  # replayed from what the edge keeps
    assert handle.pid not in [p.pid for p in sbx.commands.list()]


def test_the_sandbox_is_described_listed_and_killed(served: E2bEdge) -> None:
    box = Sandbox.create(TEMPLATE, timeout=60, metadata={"run": "r1"})
    try:
        info = box.get_info()
        assert info.sandbox_id == box.sandbox_id
        assert info.template_id == TEMPLATE
        assert info.metadata == {"run": "r1"}
        assert info.end_at > info.started_at
        listed = [s.sandbox_id for s in Sandbox.list().next_items()]
        assert box.sandbox_id in listed
        assert box.is_running()
    finally:
        box.kill()
    assert box.sandbox_id not in served.sandboxes()
    assert not box.is_running()


def test_the_async_client_runs_commands_too(served: E2bEdge) -> None:
    async def scenario() -> tuple[str, int]:
        box = await AsyncSandbox.create(TEMPLATE, timeout=60)
        try:
            started = time.perf_counter()
            result = await box.commands.run("echo async; whoami")
            assert time.perf_counter() - started < 60
            return result.stdout, result.exit_code
        finally:
            await box.kill()

    assert asyncio.run(scenario()) == ("async\nuser\n", 0)


# -- raw Connect and HTTP, for what the SDK does not send ----------------------------------------------------
def envelope(doc: dict[str, Any], flags: int = 0) -> bytes:
    data = json.dumps(doc).encode()
    return struct.pack(">BI", flags, len(data)) + data


def frames(raw: bytes) -> list[tuple[int, dict[str, Any]]]:
    """A Connect stream's envelopes: ``(flags, message)``; the last (flags 2) is the end."""
    out, i = [], 0
    while i + 5 <= len(raw):
        flags, n = struct.unpack(">BI", raw[i:i + 5])
        out.append((flags, json.loads(raw[i + 5:i + 5 + n])))
        i += 5 + n
    assert i == len(raw), f"{len(raw) - i} bytes after the last envelope"
    return out


def connect_stream(url: str, sid: str, method: str, doc: dict[str, Any], **headers: str) -> list[dict[str, Any]]:
    """A server-streaming call of process.Process: its messages, then its end message."""
    hdrs = envd_headers(sid, **{"X-API-Key": ALPHA, **headers})
    hdrs.update({"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"})
    resp = httpx.post(f"{url}/process.Process/{method}", content=envelope(doc), headers=hdrs, timeout=60)
    assert resp.status_code == 200, resp.text
    return [msg for _, msg in frames(resp.content)]


def connect_unary(url: str, sid: str, method: str, doc: dict[str, Any], **headers: str) -> httpx.Response:
    """A unary call of process.Process, as alpha unless ``headers`` carry another credential."""
    own = {} if {"X-Access-Token", "X-API-Key"} & set(headers) else {"X-API-Key": ALPHA}
    hdrs = envd_headers(sid, **own, **headers)
    hdrs.update({"Content-Type": "application/json", "Connect-Protocol-Version": "1"})
    return httpx.post(f"{url}/process.Process/{method}", content=json.dumps(doc), headers=hdrs, timeout=60)


def native_commands(served: E2bEdge, sid: str) -> list[dict[str, Any]]:
    status, _, body = http("GET", f"{served.url}/v1/sandboxes/{sid}/commands", token=ALPHA)
    assert status == 200, body
    return list(body["commands"])


def envd_token(served: E2bEdge, sid: str) -> str:
    resp = httpx.post(f"{served.url}/sandboxes/{sid}/connect", json={"timeout": 120}, headers={"X-API-Key": ALPHA})
    assert resp.status_code in (200, 201), resp.text
    return str(resp.json()["envdAccessToken"])


# -- stdin ---------------------------------------------------------------------------------------------------
def test_stdin_is_sent_streamed_and_closed(sbx: Sandbox) -> None:
    cat = sbx.commands.run("cat; echo done", background=True, stdin=True)
    sbx.commands.send_stdin(cat.pid, "one\n")
    cat.send_stdin(b"two\n")
    sbx.commands.stream_input(cat.pid, ["three", b"\n"])
    sbx.commands.close_stdin(cat.pid)
    assert cat.wait().stdout == "one\ntwo\nthree\ndone\n"


def test_without_stdin_a_command_reads_end_of_input_and_takes_none(sbx: Sandbox) -> None:
    assert sbx.commands.run("cat; echo eof").stdout == "eof\n"  # never waits for input
    handle = sbx.commands.run("sleep 60", background=True)
    with pytest.raises(SandboxException, match="input was closed"):
        sbx.commands.send_stdin(handle.pid, "ignored")
    assert handle.kill() is True


def test_the_async_client_streams_stdin_through_one_input_handle(served: E2bEdge) -> None:
    async def scenario() -> str:
        box = await AsyncSandbox.create(TEMPLATE, timeout=60)
        try:
            cat = await box.commands.run("cat", background=True, stdin=True)
            async with box.commands.stream_input(cat.pid) as feed:
                await feed.send("a")
                await feed.send(b"b\n")
            await box.commands.send_stdin(cat.pid, "c\n")
            await box.commands.close_stdin(cat.pid)
            return (await cat.wait()).stdout
        finally:
            await box.kill()

    assert asyncio.run(scenario()) == "ab\nc\n"


# -- terminals -----------------------------------------------------------------------------------------------
def test_a_pty_takes_keys_resizes_and_ends_with_its_shell(sbx: Sandbox) -> None:
    term = sbx.pty.create(PtySize(rows=24, cols=80))
    sbx.pty.send_stdin(term.pid, b"stty size; echo T=$TERM\n")
    seen: list[bytes] = []
    for _, _, data in term:  # the shell's answer, before the resize
        seen.append(data or b"")
        if b"T=xterm-256color\r\n" in b"".join(seen):
            break
    sbx.pty.resize(term.pid, PtySize(rows=30, cols=100))
    sbx.pty.send_stdin(term.pid, b"stty size; whoami; exit 3\n")
    with pytest.raises(CommandExitException) as caught:
        term.wait(on_pty=seen.append)
    screen = b"".join(seen).decode(errors="replace")
    assert caught.value.exit_code == 3
    for line in ("24 80\r\n", "30 100\r\n", "\nuser\r\n"):
        assert line in screen, repr(screen)
    assert sbx.pty.kill(term.pid) is False  # it ended


def test_the_async_pty_delivers_data_to_on_data_and_is_killed(served: E2bEdge) -> None:
    async def scenario() -> tuple[bytes, bool]:
        box = await AsyncSandbox.create(TEMPLATE, timeout=60)
        try:
            seen: list[bytes] = []
            answered = asyncio.Event()

            def on_data(data: bytes) -> None:  # the output arrives as pty data
                seen.append(data)
                if b"ready-42\r\nroot\r\n" in b"".join(seen):
                    answered.set()

            term = await box.pty.create(PtySize(rows=10, cols=40), on_data=on_data, user="root")
            await box.pty.send_stdin(term.pid, b"echo ready-$((6*7)); whoami\n")
            await asyncio.wait_for(answered.wait(), 60)  # on_data runs in the handle's own task
            got = b"".join(seen)
            killed = await box.pty.kill(term.pid)
            with pytest.raises(CommandExitException):
                await term.wait()
            return got, killed
        finally:
            await box.kill()

    screen, killed = asyncio.run(scenario())
    assert b"ready-42" in screen
    assert killed is True


# -- timeout, stderr, connect, kill, list --------------------------------------------------------------------
def test_the_command_timeout_raises_the_sdks_timeout_and_ends_the_process(served: E2bEdge, sbx: Sandbox) -> None:
    with pytest.raises(TimeoutException):
        sbx.commands.run("echo begun; sleep 120", timeout=2)
    # the process is bounded by the same deadline, as under envd: the native API sees it end so
    (cmd,) = [c for c in native_commands(served, sbx.sandbox_id) if "sleep 120" in " ".join(c["command"])]
    status, _, body = http("GET", f"{served.url}/v1/sandboxes/{sbx.sandbox_id}/commands/{cmd['id']}?wait=60",
                           token=ALPHA)
    assert status == 200, body
    assert body["exit"]["timed_out"] is True, body
    assert cmd["command"] == ["/bin/bash", "-l", "-c", "echo begun; sleep 120"]


def test_on_stderr_gets_stderr_and_on_stdout_stdout(sbx: Sandbox) -> None:
    out: list[str] = []
    err: list[str] = []
    result = sbx.commands.run("for i in 1 2 3; do echo o$i; echo e$i >&2; done", on_stdout=out.append,
                              on_stderr=err.append)
    assert ("".join(out), "".join(err)) == ("o1\no2\no3\n", "e1\ne2\ne3\n")
    assert (result.stdout, result.stderr) == ("o1\no2\no3\n", "e1\ne2\ne3\n")


def test_a_finished_process_replays_on_connect_and_is_not_killed(served: E2bEdge, sbx: Sandbox) -> None:
    handle = sbx.commands.run("echo kept; echo also >&2", background=True)
    assert handle.wait().stdout == "kept\n"
    again = sbx.commands.connect(handle.pid)
    result = again.wait()
    assert (result.stdout, result.stderr, result.exit_code) == ("kept\n", "also\n", 0)
    assert sbx.commands.kill(handle.pid) is False
    assert sbx.commands.kill(99999) is False
    assert handle.pid not in [p.pid for p in sbx.commands.list()]
    # an E2B process is a background command of the native API, listed there too
    assert any(c["command"][-1] == "echo kept; echo also >&2" for c in native_commands(served, sbx.sandbox_id))


def test_tags_envs_and_cwd_are_listed_and_a_tag_connects(served: E2bEdge, sbx: Sandbox) -> None:
    start = {"process": {"cmd": "/bin/sh", "args": ["-c", "echo tagged; sleep 60"], "envs": {"K": "v"},
                         "cwd": "/tmp"}, "tag": "web"}
    hdrs = envd_headers(sbx.sandbox_id, **{"X-API-Key": ALPHA, "Content-Type": "application/connect+json",
                                           "Connect-Protocol-Version": "1", "Connect-Timeout-Ms": "120000"})
    with httpx.stream("POST", f"{served.url}/process.Process/Start", content=envelope(start), headers=hdrs,
                      timeout=60) as resp:
        assert resp.status_code == 200
        head = next(resp.iter_bytes())  # the start event, then the command runs on without this client
    pid = json.loads(head[5:5 + struct.unpack(">I", head[1:5])[0]])["event"]["start"]["pid"]
    (info,) = [p for p in sbx.commands.list() if p.pid == pid]
    assert (info.tag, info.cmd, info.args, info.envs, info.cwd) == (
        "web", "/bin/sh", ["-c", "echo tagged; sleep 60"], {"K": "v"}, "/tmp")
    assert connect_unary(served.url, sbx.sandbox_id, "SendSignal",
                         {"process": {"tag": "web"}, "signal": "SIGNAL_SIGKILL"}).status_code == 200
    events = connect_stream(served.url, sbx.sandbox_id, "Connect", {"process": {"tag": "web"}})
    assert events[0]["event"]["start"]["pid"] == pid
    assert any(e.get("event", {}).get("data", {}).get("stdout") for e in events)
    assert "end" in events[-2]["event"]
    assert events[-1] == {}


def test_keepalives_come_at_the_interval_the_client_asks(served: E2bEdge, sbx: Sandbox) -> None:
    start = {"process": {"cmd": "/bin/sh", "args": ["-c", "sleep 3; echo late"]}}
    events = connect_stream(served.url, sbx.sandbox_id, "Start", start, **{"Keepalive-Ping-Interval": "1"})
    kinds = [next(iter(e["event"])) for e in events[:-1]]
    assert kinds[0] == "start"
    assert kinds[-1] == "end"
    assert "keepalive" in kinds  # at least one second passed without output
    assert kinds.index("keepalive") < kinds.index("data")


# -- users -------------------------------------------------------------------------------------------------
def test_a_template_without_the_account_user_runs_as_the_images_own_user(served: E2bEdge) -> None:
    box = Sandbox.create(SOURCE_IMAGE, timeout=60)  # the image itself: no account "user"
    try:
        own = box.commands.run("id -un").stdout
        assert own == box.commands.run("id -un", user="root").stdout == "root\n"
        with pytest.raises(InvalidArgumentException, match="'user'"):
            box.commands.run("true", user="user")
    finally:
        box.kill()


def test_on_the_e2b_template_user_is_the_default_and_root_is_asked_for(sbx: Sandbox) -> None:
    assert sbx.commands.run("id -un; echo $HOME").stdout == "user\n/home/user\n"
    assert sbx.commands.run("id -un; echo $HOME", user="root").stdout == "root\n/root\n"
    assert sbx.commands.run("id -un", user="user").stdout == "user\n"


def test_a_command_on_a_paused_sandbox_says_it_is_paused(served: E2bEdge) -> None:
    box = Sandbox.create(TEMPLATE, timeout=120)
    try:
        box.pause()
        with pytest.raises(SandboxNotRunningException, match="paused"):
            box.commands.run("true")
        with pytest.raises(SandboxNotRunningException, match="paused"):
            box.commands.list()
    finally:
        box.kill()


# -- ports -------------------------------------------------------------------------------------------------
WEB, WS = 8000, 8001


@pytest.fixture(scope="module")
def web(served: E2bEdge) -> Iterator[Sandbox]:
    """A sandbox serving HTTP on WEB (``python3 -m http.server``) and a WebSocket echo on WS, both
    started through the SDK as background commands."""
    box = Sandbox.create(TEMPLATE, timeout=600)
    try:
        box.commands.run(f"mkdir -p www && echo hello-from-{WEB} > www/index.txt && cat > ws.py <<'EOF'{ws_echo(WS)}EOF")
        box.commands.run(f"cd www && exec python3 -m http.server {WEB} --bind 127.0.0.1", background=True, timeout=0)
        box.commands.run("exec python3 ws.py", background=True, timeout=0)
        box.commands.run(f"for port in {WEB} {WS}; do for i in $(seq 200); do "
                         "(exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null && continue 2; sleep 0.05; done; "
                         "exit 1; done")
        yield box
    finally:
        box.kill()


def fetch(url: str, headers: dict[str, str], path: str = "/index.txt") -> httpx.Response:
    return httpx.get(url + path, headers=headers, timeout=30)


def test_a_port_is_proxied_for_the_traffic_token_the_envd_token_or_the_projects_key(served: E2bEdge,
                                                                                      web: Sandbox) -> None:
    sid = web.sandbox_id
    assert web.traffic_access_token
    for auth in ({"e2b-traffic-access-token": web.traffic_access_token},
                 {"X-Access-Token": envd_token(served, sid)}, {"X-API-Key": ALPHA}):
        resp = fetch(served.url, envd_headers(sid, WEB, **auth))
        assert (resp.status_code, resp.text) == (200, f"hello-from-{WEB}\n"), auth
    missing = fetch(served.url, envd_headers(sid, WEB))
    assert missing.status_code == 401
    closed = fetch(served.url, envd_headers(sid, 8999, **{"X-API-Key": ALPHA}))
    assert closed.status_code == 502
    assert "8999" in closed.json()["message"]


def test_a_token_of_another_sandbox_or_project_finds_no_sandbox(served: E2bEdge, web: Sandbox, sbx: Sandbox) -> None:
    sid = web.sandbox_id
    nowhere = fetch(served.url, envd_headers("lb-000000000000", WEB, **{"X-API-Key": ALPHA}))
    assert nowhere.status_code == 502
    assert nowhere.json()["message"] == "sandbox_not_found: The sandbox lb-000000000000 was not found"
    for auth in ({"X-Access-Token": envd_token(served, sbx.sandbox_id)}, {"X-API-Key": BETA}):
        listed = connect_unary(served.url, sid, "List", {}, **auth)  # the Connect surface answers the same
        assert listed.json() == {"code": "unavailable",
                                 "message": f"sandbox_not_found: The sandbox {sid} was not found"}, auth
    for auth in ({"e2b-traffic-access-token": str(sbx.traffic_access_token)},
                 {"X-Access-Token": envd_token(served, sbx.sandbox_id)}, {"X-API-Key": BETA}):
        # (a traffic token opens ports only, never envd: for envd it is no credential at all, a 401)
        for port in (WEB,) if "e2b-traffic-access-token" in auth else (WEB, ENVD):
            resp = fetch(served.url, envd_headers(sid, port, **auth), "/health" if port == ENVD else "/index.txt")
            assert resp.status_code == 502, (auth, port, resp.text)
            assert resp.json() == {"code": 502, "message": f"sandbox_not_found: The sandbox {sid} was not found"}


def test_a_websocket_is_proxied(served: E2bEdge, web: Sandbox) -> None:
    assert echo_through(served.url, web, WS, timeout=30) == ["echo:one", "echo:two"]


def test_host_names_of_the_e2b_domain_name_the_sandbox_and_port(served: E2bEdge, web: Sandbox) -> None:
    sid = web.sandbox_id
    assert web.get_host(WEB) == f"{WEB}-{sid}.{DOMAIN}"  # what the SDK gives its user
    key = {"X-API-Key": ALPHA}
    for host in (f"{WEB}-{sid}.{DOMAIN}", f"{WEB}-{sid}.{DOMAIN.upper()}:443"):
        resp = fetch(served.url, {"Host": host, **key})
        assert (resp.status_code, resp.text) == (200, f"hello-from-{WEB}\n"), host
    traffic = fetch(served.url, {"Host": f"{WEB}-{sid}.{DOMAIN}",
                                 "e2b-traffic-access-token": str(web.traffic_access_token)})
    assert traffic.status_code == 200
    health = fetch(served.url, {"Host": f"{ENVD}-{sid}.{DOMAIN}", "X-Access-Token": envd_token(served, sid)},
                   "/health")
    assert health.status_code == 204
    # envd's Connect surface on the host name: what the SDK sends with E2B_DOMAIN behind a TLS proxy
    hdrs = {"Host": f"{ENVD}-{sid}.{DOMAIN}", "X-API-Key": ALPHA, "Content-Type": "application/json"}
    listed = httpx.post(f"{served.url}/process.Process/List", content=b"{}", headers=hdrs, timeout=30)
    assert listed.status_code == 200
    assert len(listed.json()["processes"]) >= 2
    bad = fetch(served.url, {"Host": f"{WEB}-lb-NOT_AN_ID.{DOMAIN}", **key})
    assert bad.status_code == 400
    assert "Host" in bad.json()["message"]  # the field the caller sent
    for host in (f"{WEB}-{sid}.elsewhere.test", f"api.{DOMAIN}"):  # not a sandbox's: the edge's own API
        other = fetch(served.url, {"Host": host, **key})
        assert other.status_code == 404, host
        assert "hello-from" not in other.text, host  # the router answered, not the sandbox (E2B shape: a key was sent)
    listed = httpx.get(f"{served.url}/v2/sandboxes", headers={"Host": f"api.{DOMAIN}", **key})
    assert sid in [s["sandboxID"] for s in listed.json()]  # E2B_DOMAIN's API URL, api.<domain>


# -- a hostile client on the Connect surface ----------------------------------------------------------------
def test_a_stdin_write_of_the_edges_largest_fits_and_a_larger_message_is_refused(served: E2bEdge,
                                                                                 sbx: Sandbox) -> None:
    counter = sbx.commands.run("wc -c", background=True, stdin=True)
    sbx.commands.send_stdin(counter.pid, b"x" * (1 << 20))  # one write of CommandLimits.stdin, JSON-encoded
    sbx.commands.close_stdin(counter.pid)
    assert counter.wait().stdout.strip() == str(1 << 20)
    big = {"process": {"pid": counter.pid}, "input": {"stdin": "eA==" * (1 << 20)}}  # 4 MiB of JSON
    resp = connect_unary(served.url, sbx.sandbox_id, "SendInput", big)
    assert resp.json()["code"] == "resource_exhausted", resp.text
    streamed = {"process": {"cmd": "/bin/true", "args": ["x" * (3 << 20)]}}
    hdrs = envd_headers(sbx.sandbox_id, **{"X-API-Key": ALPHA, "Content-Type": "application/connect+json"})
    resp = httpx.post(f"{served.url}/process.Process/Start", content=envelope(streamed), headers=hdrs, timeout=30)
    (flags, end), = frames(resp.content)
    assert flags == 2, end
    assert end["error"]["code"] == "resource_exhausted", end


def test_unknown_methods_bad_envelopes_and_other_content_types_are_refused(served: E2bEdge, sbx: Sandbox) -> None:
    sid = sbx.sandbox_id
    assert connect_unary(served.url, sid, "NoSuchMethod", {}).status_code == 404
    nowhere = httpx.post(f"{served.url}/nosuch.Service/Method", headers=envd_headers(sid, **{"X-API-Key": ALPHA}))
    assert nowhere.status_code == 404
    assert "no such route" in nowhere.json()["message"]
    plain = httpx.post(f"{served.url}/process.Process/List", content=b"{}", timeout=30,
                       headers=envd_headers(sid, **{"X-API-Key": ALPHA, "Content-Type": "text/plain"}))
    assert plain.status_code == 415
    hdrs = envd_headers(sid, **{"X-API-Key": ALPHA, "Content-Type": "application/json"})
    garbage = httpx.post(f"{served.url}/process.Process/List", content=b"{not json", headers=hdrs, timeout=30)
    assert garbage.json()["code"] == "invalid_argument", garbage.text
    hdrs = envd_headers(sid, **{"X-API-Key": ALPHA, "Content-Type": "application/connect+json"})
    whole = envelope({"process": {"cmd": "/bin/true"}})
    for body in (whole[:-3], b"\x00\x00\x00", struct.pack(">BI", 0, 1 << 30) + b"{}", b"\x07" + whole[1:]):
        resp = httpx.post(f"{served.url}/process.Process/Start", content=body, headers=hdrs, timeout=30)
        end = frames(resp.content)[-1] if resp.status_code == 200 else (0, resp.json())
        assert "error" in end[1] or "code" in end[1], (body[:12], resp.text)
    # nothing started by any of these
    assert [p for p in sbx.commands.list() if p.cmd == "/bin/true"] == []


def test_a_bad_sandbox_id_header_is_a_400_naming_it(served: E2bEdge) -> None:
    for bad in ("../../etc", "lb-" + "0" * 300, "", "lb-00000000000g"):
        resp = httpx.get(f"{served.url}/health", headers={"E2b-Sandbox-Id": bad, "X-API-Key": ALPHA})
        assert resp.status_code == 400, bad
        assert resp.json()["code"] == 400, resp.text
        assert "E2b-Sandbox-Id" in resp.json()["message"], resp.text
    port = httpx.get(f"{served.url}/health", headers=envd_headers("lb-000000000000", 70000, **{"X-API-Key": ALPHA}))
    assert port.status_code == 400
    assert "E2b-Sandbox-Port" in port.json()["message"]


def rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError(f"no VmRSS for {pid}")


def test_a_client_that_stops_reading_holds_no_worker_and_no_unbounded_buffer(served: E2bEdge, sbx: Sandbox) -> None:
    """A Start whose client reads nothing while the command prints 64 MiB: the edge's writes wait
    for the socket (the ASGI bridge awaits its drain), its memory stays bounded, other calls are
    answered meanwhile, and the command runs to its end."""
    sid = sbx.sandbox_id
    edge_pid = served.edge.proc.pid if served.edge.proc else 0
    before = rss(edge_pid)

    async def stall() -> tuple[int, int]:
        reader, writer = await asyncio.open_connection("127.0.0.1", served.edge.port)
        body = envelope({"process": {"cmd": "/bin/sh", "args": ["-c", "head -c 67108864 /dev/zero | tr '\\0' a"]}})
        head = (f"POST /process.Process/Start HTTP/1.1\r\nHost: 127.0.0.1\r\nE2b-Sandbox-Id: {sid}\r\n"
                f"E2b-Sandbox-Port: {ENVD}\r\nX-API-Key: {ALPHA}\r\nContent-Type: application/connect+json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n")
        writer.write(head.encode() + body)
        await writer.drain()
        try:
            # the command ends while this client reads nothing; the native API answers meanwhile
            for _ in range(600):  # until the edge has started it (bounded)
                found = await asyncio.to_thread(lambda: [c for c in native_commands(served, sid)
                                                         if "67108864" in c["command"][-1]])
                if found:
                    break
                await asyncio.sleep(0.05)
            (cmd,) = found
            status, _, done = await asyncio.to_thread(
                http, "GET", f"{served.url}/v1/sandboxes/{sid}/commands/{cmd['id']}?wait=120", token=ALPHA)
            assert status == 200, done
            assert done["exit"]["exit_code"] == 0, done
            return done["output"]["end"], rss(edge_pid)
        finally:
            writer.close()

    printed, during = asyncio.run(stall())
    assert printed == 64 << 20
    assert during - before < 32 << 20, f"the edge grew by {(during - before) >> 20} MiB for a stalled reader"
    assert fetch(served.url, envd_headers(sid, **{"X-API-Key": ALPHA}), "/health").status_code == 204


def test_a_command_whose_sandbox_is_killed_ends_as_cancelled_not_as_its_exit(served: E2bEdge) -> None:
    box = Sandbox.create(TEMPLATE, timeout=120)
    try:
        handle = box.commands.run("sleep 600", background=True, timeout=0)
    finally:
        box.kill()
    # as at E2B's proxy: the stream ends UNAVAILABLE, and the SDK's health check that follows finds it gone
    with pytest.raises(TimeoutException, match="killed or reached its end of life"):
        handle.wait()


def test_a_relative_cwd_starts_at_the_accounts_home(sbx: Sandbox) -> None:
    sbx.commands.run("mkdir -p work/sub")
    assert sbx.commands.run("pwd", cwd="work/sub").stdout == "/home/user/work/sub\n"
    assert sbx.commands.run("pwd", cwd="..", user="root").stdout == "/\n"  # root's home is /root


def test_the_async_clients_command_timeout_is_the_sdks_timeout_exception(served: E2bEdge) -> None:
    async def scenario() -> None:
        box = await AsyncSandbox.create(TEMPLATE, timeout=60)
        try:
            with pytest.raises(TimeoutException):
                await box.commands.run("sleep 10", timeout=2)
        finally:
            await box.kill()

    asyncio.run(scenario())
