"""Port exposure through the edge: servers inside real sandboxes, reached through the real service.

The sandbox runs :data:`SERVER` (stdlib only): an HTTP server that reports what it was
sent, streams a response it finishes only once a gate file exists, and counts uploads;
and a minimal WebSocket echo (RFC 6455 handshake and framing by hand).  Every request
goes through the edge on 127.0.0.1, with the owner's token or a signed URL.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import http.client
import json
import os
import statistics
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sandbox.edge.routes import ports
from sandbox.host.manager import SandboxManager
from sandbox.isolation.network import _on_thread
from tests.support.sandboxes import REF, ServerThread, serving

pytestmark = [pytest.mark.usefixtures("need_root"),
              pytest.mark.root("erofs", "overlay", "fuse", "cmd:crun", "cmd:nft", "cmd:ip")]

ALPHA, BETA, GAMMA = "alpha-token-0123456789", "beta-token-0123456789", "gamma-token-0123456789"
TOKENS = {"projects": {"alpha": {"tokens": [ALPHA], "max_sandboxes": 4},
                       "beta": {"tokens": [BETA], "max_sandboxes": 1},
                       "gamma": {"tokens": [GAMMA], "disabled": True}}}
HTTP_PORT, WS_PORT, CLOSED_PORT = 8000, 8001, 8999
WAIT = 10.0  # seconds any readiness or gate wait may take

SERVER = r'''
import base64, hashlib, http.server, json, os, socket, struct, sys, threading, time

def wait_for(path):
    deadline = time.monotonic() + 10
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)

class Http(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, body, ctype="text/plain", extra=(), send=True):
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for key, value in extra:
            self.send_header(key, value)
        self.end_headers()
        if send:
            self.wfile.write(body)

    def hello(self, send=True):
        self.reply(b"hello from the sandbox\n", send=send, extra=[
            ("X-Up-Hop", "1"), ("Keep-Alive", "timeout=9"), ("Connection", "X-Up-Hop"),
            ("Set-Cookie", "a=1"), ("Set-Cookie", "b=2"),
            # a hostile preview's try at the edge's whole origin: a service worker over every path,
            # a cookie for every path of the edge and of its parent domain
            ("Service-Worker-Allowed", "/"), ("Set-Cookie", "c=3; Path=/; Domain=example.com; HttpOnly")])

    def do_HEAD(self):
        self.hello(send=False)

    def do_GET(self):
        if self.path == "/hello":
            return self.hello()
        if self.path.startswith("/slow?gate="):
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(b"first\n")
            self.wfile.flush()
            wait_for("/tmp/gate-" + self.path.partition("=")[2])
            self.wfile.write(b"second\n")
            return
        doc = {"method": self.command, "path": self.path, "headers": self.headers.items()}
        self.reply(json.dumps(doc).encode(), "application/json")

    do_DELETE = do_OPTIONS = do_GET

    def do_POST(self):
        size, digest, got = int(self.headers.get("Content-Length", 0)), hashlib.sha256(), 0
        while got < size:
            chunk = self.rfile.read(min(65536, size - got))
            if not chunk:
                break
            if not got:
                open("/tmp/upload-started", "w").close()
            digest.update(chunk)
            got += len(chunk)
        doc = {"method": self.command, "bytes": got, "sha256": digest.hexdigest()}
        self.reply(json.dumps(doc).encode(), "application/json")

    do_PUT = do_PATCH = do_POST

GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

def frame(op, data):
    n = len(data)
    head = bytes([0x80 | op]) + (bytes([n]) if n < 126 else
                                 bytes([126]) + struct.pack("!H", n) if n < 65536 else
                                 bytes([127]) + struct.pack("!Q", n))
    return head + data

def websocket(conn):
    with conn:
        f = conn.makefile("rb")
        lines = []
        while (line := f.readline()) not in (b"\r\n", b""):
            lines.append(line.decode())
        hdr = {k.strip().lower(): v.strip() for k, _, v in (l.partition(":") for l in lines[1:])}
        accept = base64.b64encode(hashlib.sha1((hdr["sec-websocket-key"] + GUID).encode()).digest())
        resp = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        resp += b"Sec-WebSocket-Accept: " + accept + b"\r\n"
        if "sec-websocket-protocol" in hdr:
            resp += b"Sec-WebSocket-Protocol: " + hdr["sec-websocket-protocol"].split(",")[0].encode() + b"\r\n"
        conn.sendall(resp + b"\r\n")
        while len(head := f.read(2)) == 2:
            op, n = head[0] & 0x0F, head[1] & 0x7F
            if n == 126:
                n = struct.unpack("!H", f.read(2))[0]
            elif n == 127:
                n = struct.unpack("!Q", f.read(8))[0]
            mask = f.read(4) if head[1] & 0x80 else b"\0\0\0\0"
            data = f.read(n)
            data = (int.from_bytes(data, "big") ^ int.from_bytes((mask * (n // 4 + 1))[:n], "big")).to_bytes(n, "big")
            if op == 8:
                with open("/tmp/ws-closed", "w") as f:  # the code the caller's close arrived with
                    f.write(str(struct.unpack("!H", data[:2])[0]) if len(data) >= 2 else "none")
                conn.sendall(frame(8, data))
                return
            if op == 1 and data.startswith(b"close:"):  # the server ends it, with that code
                conn.sendall(frame(8, struct.pack("!H", int(data[6:]))))
                return
            conn.sendall(frame(10 if op == 9 else op, data))

def serve_websockets(port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(64)
    return s

kind, port = sys.argv[1], int(sys.argv[2])
if kind == "http":
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Http)
    open(f"/tmp/ready-{port}", "w").close()
    server.serve_forever()
else:
    listener = serve_websockets(port)
    open(f"/tmp/ready-{port}", "w").close()
    while True:
        threading.Thread(target=websocket, args=(listener.accept()[0],), daemon=True).start()
'''


# -- HTTP helpers ---------------------------------------------------------------------------------------------
def call(url: str, method: str = "GET", token: str | None = ALPHA, body: Any = None,
         headers: dict[str, str] | None = None, data: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    hdrs = dict(headers or {})
    if token:
        hdrs["Authorization"] = f"Bearer {token}"
    if body is not None:
        data, hdrs["Content-Type"] = json.dumps(body).encode(), "application/json"
    req = urllib.request.Request(url, method=method, headers=hdrs, data=data)
    try:
        with urllib.request.urlopen(req, timeout=WAIT) as r:
            return r.status, dict(r.headers.items()), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers.items()), e.read()


def error(raw: bytes) -> dict[str, Any]:
    return dict(json.loads(raw)["error"])


def not_found(url: str, sid: str, token: str = ALPHA) -> str:
    """The code the rest of the API answers for a sandbox this token cannot see."""
    status, _, raw = call(f"{url}/v1/sandboxes/{sid}", token=token)
    assert status == 404, raw
    return str(error(raw)["code"])


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


def sh(url: str, sid: str, cmd: str, token: str = ALPHA) -> tuple[int, str]:
    status, _, raw = call(f"{url}/v1/sandboxes/{sid}/exec", "POST", token, {"cmd": cmd, "timeout": 30})
    assert status == 200, raw
    events = [json.loads(line) for line in raw.splitlines() if line.strip()]
    out = b"".join(base64.b64decode(e["data"]) for e in events if e["type"] in ("stdout", "stderr"))
    assert events[-1]["type"] == "exit", events[-1]
    return events[-1]["exit_code"], out.decode(errors="replace")


def start(url: str, sid: str, kind: str, port: int) -> None:
    """Start SERVER inside the sandbox and wait for its readiness file (bounded)."""
    code, out = sh(url, sid, f"nohup python3 /root/srv.py {kind} {port} >/tmp/srv-{port}.log 2>&1 & "
                             f"for i in $(seq 200); do [ -e /tmp/ready-{port} ] && exit 0; sleep 0.05; done; "
                             f"cat /tmp/srv-{port}.log; exit 1")
    assert code == 0, out


def create(url: str, token: str = ALPHA, **options: Any) -> str:
    status, _, raw = call(f"{url}/v1/sandboxes", "POST", token, {"image": REF, **options})
    assert status == 201, raw
    sid = str(json.loads(raw)["id"])
    status, _, raw = call(f"{url}/v1/sandboxes/{sid}/files?path=/root/srv.py&mode=644", "PUT", token,
                          data=SERVER.encode())
    assert status == 201, raw
    return sid


def proxy(url: str, sid: str, port: int, tail: str = "") -> str:
    return f"{url}/v1/sandboxes/{sid}/ports/{port}/proxy/{tail}"


def mint(url: str, sid: str, port: int, token: str = ALPHA, **body: Any) -> tuple[int, dict[str, Any]]:
    status, _, raw = call(f"{url}/v1/sandboxes/{sid}/ports/{port}/url", "POST", token, body)
    return status, json.loads(raw)


# -- fixtures -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(manager: SandboxManager) -> Iterator[ServerThread]:
    with serving(manager, TOKENS) as srv:
        try:
            yield srv
        finally:
            for st in manager.list():
                manager.destroy(st.id)


@pytest.fixture(scope="module")
def sid(server: ServerThread) -> str:
    """Alpha's sandbox with the HTTP server on HTTP_PORT and the WebSocket echo on WS_PORT."""
    sid = create(server.url)
    start(server.url, sid, "http", HTTP_PORT)
    start(server.url, sid, "ws", WS_PORT)
    return sid


@pytest.fixture
def url(server: ServerThread, manager: SandboxManager, sid: str) -> Iterator[str]:
    """The edge's URL; every sandbox a test made beside the module's own is destroyed after it."""
    yield server.url
    left = [st.id for st in manager.list() if st.id != sid]
    for other in left:
        manager.destroy(other)
    assert left == [], "the test left sandboxes behind"


# -- HTTP ------------------------------------------------------------------------------------------------------
def test_http_with_the_owners_token_drops_hop_by_hop_headers_and_the_token(url: str, sid: str) -> None:
    status, headers, body = call(proxy(url, sid, HTTP_PORT, "hello"))
    assert (status, body) == (200, b"hello from the sandbox\n")
    assert "X-Up-Hop" not in headers  # the hop the server named
    assert "Keep-Alive" not in headers
    status, headers, body = call(proxy(url, sid, HTTP_PORT, "hello"), "HEAD")
    assert (status, headers["Content-Length"], body) == (200, "23", b"")

    host, port = url.removeprefix("http://").rsplit(":", 1)
    edge = http.client.HTTPConnection(host, int(port), timeout=WAIT)  # (urllib sets its own Connection)
    edge.request("GET", f"/v1/sandboxes/{sid}/ports/{HTTP_PORT}/proxy/echo/a%2Fb/../c?x=%41&y", headers={
        "Authorization": f"Bearer {ALPHA}", "Connection": "keep-alive, X-Hop", "X-Hop": "secret",
        "Proxy-Authorization": "Basic eA==", "TE": "trailers", "X-Kept": "yes", "Cookie": "session=1"})
    resp = edge.getresponse()
    status, raw = resp.status, resp.read()
    edge.close()
    assert status == 200, raw
    seen = json.loads(raw)
    sent = {k.lower(): v for k, v in seen["headers"]}
    assert seen["path"] == "/echo/a%2Fb/../c?x=%41&y"  # exactly as sent: the sandbox's server resolves it
    assert sent["host"] == f"127.0.0.1:{HTTP_PORT}"
    assert (sent["x-kept"], sent["cookie"]) == ("yes", "session=1")
    assert sent["x-forwarded-prefix"] == f"/v1/sandboxes/{sid}/ports/{HTTP_PORT}/proxy"
    for gone in ("authorization", "x-hop", "proxy-authorization", "te", "connection", "keep-alive"):
        assert gone not in sent or (gone == "connection" and sent[gone] == "close"), (gone, sent)
    assert ALPHA not in raw.decode()

    for method in ("PUT", "PATCH", "DELETE", "OPTIONS"):
        status, _, raw = call(proxy(url, sid, HTTP_PORT, "m"), method, data=b"x" if method in ("PUT", "PATCH") else None)
        assert (status, json.loads(raw)["method"]) == (200, method)


def test_set_cookie_headers_survive_kept_to_the_sandboxs_prefix(url: str, sid: str) -> None:
    """Several cookies pass, each scoped to the sandbox's own prefix (no Domain, no Path above it),
    and no Service-Worker-Allowed reaches the edge's origin."""
    async def scenario() -> tuple[list[str], str | None]:
        async with aiohttp.ClientSession() as s, s.get(proxy(url, sid, HTTP_PORT, "hello"),
                                                        headers={"Authorization": f"Bearer {ALPHA}"}) as r:
            return r.headers.getall("Set-Cookie"), r.headers.get("Service-Worker-Allowed")

    cookies, worker = run(scenario())
    prefix = f"/v1/sandboxes/{sid}/ports/{HTTP_PORT}/proxy"
    assert cookies == [f"a=1; Path={prefix}", f"b=2; Path={prefix}", f"c=3; HttpOnly; Path={prefix}"]
    assert worker is None


def test_bodies_stream_both_ways(url: str, sid: str) -> None:
    auth = {"Authorization": f"Bearer {ALPHA}"}
    sh(url, sid, "rm -f /tmp/upload-started /tmp/gate-stream")
    size = 32 << 20
    block = os.urandom(1 << 20)

    async def upload(s: aiohttp.ClientSession) -> dict[str, Any]:
        async def body() -> AsyncIterator[bytes]:
            yield block
            # the server has the first MiB before the rest is even produced: the upload is streamed
            deadline = time.monotonic() + WAIT
            while sh(url, sid, "test -e /tmp/upload-started")[0] != 0:
                assert time.monotonic() < deadline, "the first chunk never reached the sandbox"
                await asyncio.sleep(0.05)
            for _ in range(size // len(block) - 1):
                yield block

        async with s.post(proxy(url, sid, HTTP_PORT, "upload"), data=body(),
                          headers={**auth, "Content-Length": str(size)}) as r:
            assert r.status == 200
            return dict(await r.json())

    async def download(s: aiohttp.ClientSession) -> None:
        async with s.get(proxy(url, sid, HTTP_PORT, "slow?gate=stream"), headers=auth) as r:
            assert r.status == 200
            # the first line arrives while the server still waits for its gate: streamed, not buffered
            assert await asyncio.wait_for(r.content.readline(), WAIT) == b"first\n"
            status, _, raw = await asyncio.to_thread(
                call, f"{url}/v1/sandboxes/{sid}/files?path=/tmp/gate-stream", "PUT", data=b"")
            assert status == 201, raw
            assert await asyncio.wait_for(r.content.read(), WAIT) == b"second\n"

    async def scenario() -> dict[str, Any]:
        async with aiohttp.ClientSession() as s:
            await download(s)
            return await upload(s)

    expected = hashlib.sha256()
    for _ in range(size // len(block)):
        expected.update(block)
    assert run(scenario()) == {"method": "POST", "bytes": size, "sha256": expected.hexdigest()}


def test_a_port_nobody_listens_on_is_a_502_at_once(url: str, sid: str) -> None:
    started = time.monotonic()
    status, _, raw = call(proxy(url, sid, CLOSED_PORT, "x"))
    assert time.monotonic() - started < 1.0
    assert status == 502
    err = error(raw)
    assert (err["code"], err["retryable"]) == ("port_closed", True)
    assert f"port {CLOSED_PORT}" in err["message"]


# -- WebSocket ----------------------------------------------------------------------------------------------
async def _echo(ws_url: str, headers: dict[str, str]) -> tuple[str | None, str, bytes]:
    async with aiohttp.ClientSession() as s, s.ws_connect(ws_url, headers=headers,
                                                         protocols=("echo.v1", "other")) as ws:
        await ws.send_str("ping through the edge")
        text = await ws.receive_str(timeout=WAIT)
        big = os.urandom(1 << 20)
        await ws.send_bytes(big)
        echoed = await ws.receive_bytes(timeout=WAIT)
        assert echoed == big
        await ws.close()
        return ws.protocol, text, echoed[:4]


def test_websocket_echo_with_the_owners_token(url: str, sid: str) -> None:
    protocol, text, _ = run(_echo(proxy(url, sid, WS_PORT, "ws"), {"Authorization": f"Bearer {ALPHA}"}))
    assert (protocol, text) == ("echo.v1", "ping through the edge")


def test_websocket_to_a_closed_port_is_a_502(url: str, sid: str) -> None:
    with pytest.raises(aiohttp.WSServerHandshakeError) as info:
        run(_echo(proxy(url, sid, CLOSED_PORT, "ws"), {"Authorization": f"Bearer {ALPHA}"}))
    assert info.value.status == 502


def test_close_codes_are_relayed_both_ways(url: str, sid: str) -> None:
    auth = {"Authorization": f"Bearer {ALPHA}"}

    async def scenario() -> tuple[Any, Any]:
        async with aiohttp.ClientSession() as s:
            async with s.ws_connect(proxy(url, sid, WS_PORT, "ws"), headers=auth) as ws:
                await ws.send_str("close:4003")
                msg = await ws.receive(timeout=WAIT)
                by_server = (msg.type, msg.data)
            async with s.ws_connect(proxy(url, sid, WS_PORT, "ws"), headers=auth) as ws:
                await ws.close(code=4001)
            return by_server

    sh(url, sid, "rm -f /tmp/ws-closed")
    assert run(scenario()) == (aiohttp.WSMsgType.CLOSE, 4003)
    code, out = sh(url, sid, "for i in $(seq 100); do [ -e /tmp/ws-closed ] && break; sleep 0.05; done; "
                             "cat /tmp/ws-closed")
    assert (code, out) == (0, "4001")  # the edge closed the sandbox's side with the caller's code


def test_idle_connections_are_cut(url: str, sid: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "IDLE_TIMEOUT", 1.0)
    auth = {"Authorization": f"Bearer {ALPHA}"}

    async def scenario() -> tuple[bytes, float, Any]:
        async with aiohttp.ClientSession() as s:
            started = time.monotonic()
            async with s.get(proxy(url, sid, HTTP_PORT, "slow?gate=never"), headers=auth) as r:
                first = await r.content.readline()
                with pytest.raises(aiohttp.ClientPayloadError):  # cut: a short body reads as an error
                    await asyncio.wait_for(r.content.read(), WAIT)
            http_cut = time.monotonic() - started
            async with s.ws_connect(proxy(url, sid, WS_PORT, "ws"), headers=auth) as ws:
                msg = await ws.receive(timeout=WAIT)
            return first, http_cut, (msg.type, ws.close_code)

    first, http_cut, ws_end = run(scenario())
    assert first == b"first\n"
    assert 1.0 <= http_cut < 5.0  # the sandbox would have waited 10 s for its gate
    assert ws_end == (aiohttp.WSMsgType.CLOSE, aiohttp.WSCloseCode.GOING_AWAY)


# -- auth ------------------------------------------------------------------------------------------------------
def test_refused_without_the_owners_token(url: str, sid: str) -> None:
    assert call(proxy(url, sid, HTTP_PORT, "hello"), token=None)[0] == 401
    assert call(proxy(url, sid, HTTP_PORT, "hello"), token="not-a-token-0123456789")[0] == 401
    status, _, raw = call(proxy(url, sid, HTTP_PORT, "hello"), token=BETA)  # another project's: nobody's
    assert (status, error(raw)["code"]) == (404, not_found(url, sid, BETA))
    assert call(proxy(url, sid, HTTP_PORT, "hello"), token=GAMMA)[0] == 403  # a disabled project
    assert call(proxy(url, "lb-0123456789ab", HTTP_PORT, "hello"))[0] == 404
    with pytest.raises(aiohttp.WSServerHandshakeError) as info:
        run(_echo(proxy(url, sid, WS_PORT, "ws"), {"Authorization": f"Bearer {BETA}"}))
    assert info.value.status == 404
    assert mint(url, sid, HTTP_PORT, token=BETA)[0] == 404
    # ownership comes before the other fields, as on every route naming a sandbox
    assert call(proxy(url, sid, 0, "x"), token=BETA)[0] == 404
    assert call(f"{url}/v1/sandboxes/{sid}/ports/http/url", "POST", BETA, {"ttl": -1})[0] == 404
    assert mint(url, sid, HTTP_PORT, token=None)[0] == 401


@pytest.mark.parametrize(("where", "body", "field"), [
    ("{sid}/ports/0/url", {}, "port"), ("{sid}/ports/65536/url", {}, "port"), ("{sid}/ports/http/url", {}, "port"),
    ("{sid}/ports/8000/url", {"ttl": 0}, "ttl"), ("{sid}/ports/8000/url", {"ttl": -1}, "ttl"),
    ("{sid}/ports/8000/url", {"ttl": "5"}, "ttl"), ("{sid}/ports/8000/url", {"ttl": ports.MAX_URL_TTL + 1}, "ttl"),
    ("{sid}/ports/8000/url", {"ttl": 60, "port": 1}, "port"), ("lb-nope/ports/8000/url", {}, "id"),
])
def test_minting_checks_every_field(url: str, sid: str, where: str, body: dict[str, Any], field: str) -> None:
    status, _, raw = call(f"{url}/v1/sandboxes/{where.format(sid=sid)}", "POST", ALPHA, body)
    assert (status, error(raw)["field"]) == (400, field), raw


def test_a_signed_url_needs_no_token_and_forwards_the_apps_own(url: str, sid: str) -> None:
    status, doc = mint(url, sid, HTTP_PORT, ttl=60)
    assert status == 200, doc
    assert (doc["url"], doc["port"]) == (url + doc["path"], HTTP_PORT)
    assert time.time() < doc["expires"] <= time.time() + 61
    status, _, body = call(doc["url"] + "hello", token=None)
    assert (status, body) == (200, b"hello from the sandbox\n")
    status, _, raw = call(doc["url"] + "who?x=1", token="the-apps-own-token")  # the application's header
    sent = {k.lower(): v for k, v in json.loads(raw)["headers"]}
    assert (json.loads(raw)["path"], sent["authorization"]) == ("/who?x=1", "Bearer the-apps-own-token")
    assert sent["x-forwarded-prefix"] == doc["path"].rstrip("/")

    status, ws_doc = mint(url, sid, WS_PORT)  # the default ttl
    assert status == 200
    assert ws_doc["expires"] <= time.time() + ports.DEFAULT_URL_TTL + 1
    protocol, text, _ = run(_echo(ws_doc["url"] + "ws", {}))
    assert (protocol, text) == ("echo.v1", "ping through the edge")
    receipts = json.loads(call(f"{url}/v1/sandboxes/{sid}/receipts?action=port_url")[2])["receipts"]
    assert {(r["port"], r["expires"]) for r in receipts} >= {(HTTP_PORT, doc["expires"]),
                                                             (WS_PORT, ws_doc["expires"])}


def test_a_tampered_or_expired_signature_is_a_403(url: str, sid: str, server: ServerThread) -> None:
    _, doc = mint(url, sid, HTTP_PORT, ttl=60)
    expires, signature = doc["path"].rstrip("/").split("/")[-2:]
    base = f"{url}/v1/sandboxes/{sid}/ports"
    flipped = signature[:-1] + ("0" if signature[-1] != "0" else "1")
    secret = server.service.url_secret
    past = int(time.time()) - 1
    for variant, code in [
        (f"{base}/{HTTP_PORT}/signed/{expires}/{flipped}/hello", "bad_signature"),
        (f"{base}/{WS_PORT}/signed/{expires}/{signature}/hello", "bad_signature"),  # another port
        (f"{base}/{HTTP_PORT}/signed/{int(expires) + 1}/{signature}/hello", "bad_signature"),  # a later expiry
        (f"{url}/v1/sandboxes/lb-0123456789ab/ports/{HTTP_PORT}/signed/{expires}/{signature}/hello",
         "bad_signature"),  # another sandbox (no matter that it does not exist)
        (f"{base}/{HTTP_PORT}/signed/{past}/{ports.sign(secret, sid, HTTP_PORT, past)}/hello", "expired"),
        (f"{base}/{HTTP_PORT}/signed/{past}/{ports.sign(b'another edge', sid, HTTP_PORT, past)}/hello",
         "bad_signature"),
    ]:
        status, _, raw = call(variant, token=ALPHA)  # a token does not stand in for the signature
        assert (status, error(raw)["code"]) == (403, code), (variant, raw)
    far = int(time.time() + ports.MAX_URL_TTL * 2)
    status, _, raw = call(f"{base}/{HTTP_PORT}/signed/{far}/{ports.sign(secret, sid, HTTP_PORT, far)}/x", token=None)
    assert (status, error(raw)["code"]) == (403, "expired")
    status, _, raw = call(f"{base}/{HTTP_PORT}/signed/{expires}/{signature.upper()}/hello", token=None)
    assert (status, error(raw)["field"]) == (400, "signature")
    status, _, raw = call(f"{base}/{HTTP_PORT}/signed/soon/{signature}/hello", token=None)
    assert (status, error(raw)["field"]) == (400, "expires")
    with pytest.raises(aiohttp.WSServerHandshakeError) as info:
        run(_echo(f"{base}/{WS_PORT}/signed/{expires}/{signature}/ws", {}))
    assert info.value.status == 403


def test_a_signed_url_dies_with_its_sandbox(url: str) -> None:
    other = create(url)
    start(url, other, "http", HTTP_PORT)
    _, doc = mint(url, other, HTTP_PORT, ttl=60)
    assert call(doc["url"] + "hello", token=None)[0] == 200
    assert call(f"{url}/v1/sandboxes/{other}", "DELETE")[0] == 204
    status, _, raw = call(doc["url"] + "hello", token=None)
    assert (status, error(raw)["code"]) == (404, not_found(url, other))


def test_a_paused_sandbox_is_a_409_until_resumed(url: str) -> None:
    other = create(url)
    start(url, other, "http", HTTP_PORT)
    assert call(f"{url}/v1/sandboxes/{other}/pause", "POST")[0] == 200
    status, _, raw = call(proxy(url, other, HTTP_PORT, "hello"))
    assert (status, error(raw)["code"]) == (409, "conflict")
    assert call(f"{url}/v1/sandboxes/{other}/resume", "POST")[0] == 200
    assert call(proxy(url, other, HTTP_PORT, "hello"))[:1] == (200,)
    call(f"{url}/v1/sandboxes/{other}", "DELETE")


# -- limits ----------------------------------------------------------------------------------------------------
def test_past_the_per_sandbox_limit_is_a_429(manager: SandboxManager, sid: str, url: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "MAX_CONNECTIONS", 2)
    sh(url, sid, "rm -f /tmp/gate-limit")
    auth = {"Authorization": f"Bearer {ALPHA}"}
    with serving(manager, TOKENS) as small:
        async def scenario() -> None:
            async with aiohttp.ClientSession() as s:
                held = [await s.get(proxy(small.url, sid, HTTP_PORT, "slow?gate=limit"), headers=auth),
                        await s.ws_connect(proxy(small.url, sid, WS_PORT, "ws"), headers=auth)]
                assert await held[0].content.readline() == b"first\n"
                async with s.get(proxy(small.url, sid, HTTP_PORT, "hello"), headers=auth) as r:
                    assert (r.status, r.headers["Retry-After"]) == (429, "1")
                    assert (await r.json())["error"]["code"] == "too_many_connections"
                async with s.get(proxy(url, sid, HTTP_PORT, "hello"), headers=auth) as r:
                    assert r.status == 200  # the limit is per edge: the module's edge has its own count
                await held[1].close()
                # the edge frees the slot when its relay has torn down the upstream side, which ends a
                # moment after the client's close handshake: a 429 until then, 200 within a bound
                statuses = []
                for _ in range(50):
                    async with s.get(proxy(small.url, sid, HTTP_PORT, "hello"), headers=auth) as r:
                        statuses.append(r.status)
                    if r.status != 429:
                        break
                    await asyncio.sleep(0.1)
                assert statuses[-1] == 200, statuses  # a slot is free again
                await asyncio.to_thread(call, f"{url}/v1/sandboxes/{sid}/files?path=/tmp/gate-limit", "PUT",
                                        data=b"")
                assert await held[0].content.read() == b"second\n"
                held[0].release()

        run(scenario())


# -- the network boundary ----------------------------------------------------------------------------------------
def test_a_policed_default_deny_sandbox_serves_its_port_and_still_cannot_reach_out(url: str) -> None:
    other = create(url, network=[])
    before = json.loads(call(f"{url}/v1/sandboxes/{other}")[2])["network"]
    start(url, other, "http", HTTP_PORT)
    status, _, body = call(proxy(url, other, HTTP_PORT, "hello"))
    assert (status, body) == (200, b"hello from the sandbox\n")
    _, doc = mint(url, other, HTTP_PORT)
    assert call(doc["url"] + "hello", token=None)[:1] == (200,)
    edge_port = int(url.rsplit(":", 1)[1])
    for host, port in (("1.1.1.1", 80), (before["host_address"], edge_port), ("10.0.0.1", 22)):
        code, out = sh(url, other, f"python3 -c \"import socket; socket.create_connection(('{host}', {port}), "
                                   "timeout=3)\" 2>&1; echo rc=$?")
        assert "rc=1" in out, (host, out)
        assert "Error" in out, (host, out)
    after = json.loads(call(f"{url}/v1/sandboxes/{other}")[2])["network"]
    assert after["policy"] == before["policy"]
    assert before["policy"]["rules"] == []
    call(f"{url}/v1/sandboxes/{other}", "DELETE")


def test_the_hosts_own_services_are_not_reachable(url: str, sid: str) -> None:
    """The edge listens on the host's 127.0.0.1:<edge port>; the same port through the proxy is the
    sandbox's own loopback: refused until the sandbox listens there, then the sandbox's server."""
    edge_port = int(url.rsplit(":", 1)[1])
    status, _, raw = call(proxy(url, sid, edge_port, "openapi.json"))
    assert (status, error(raw)["code"]) == (502, "port_closed")
    start(url, sid, "http", edge_port)
    status, _, body = call(proxy(url, sid, edge_port, "hello"))
    assert (status, body) == (200, b"hello from the sandbox\n")


# -- cost ---------------------------------------------------------------------------------------------------------
def test_the_proxys_added_latency(url: str, sid: str, manager: SandboxManager) -> None:
    """p50 of GET /hello through the edge (one keep-alive connection to it) minus p50 of the same GET
    made directly inside the sandbox's namespace (a new connection each: the server closes them)."""
    n = 300
    box = manager.get(sid)

    def direct() -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            conn = http.client.HTTPConnection("127.0.0.1", HTTP_PORT, timeout=WAIT)
            conn.request("GET", "/hello")
            assert conn.getresponse().read() == b"hello from the sandbox\n"
            conn.close()
            out.append(time.perf_counter() - t0)
        return out

    fd = os.open(f"/proc/{box.init_pid()}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        inside = _on_thread(direct, netns=Path(f"/proc/self/fd/{fd}"))
    finally:
        os.close(fd)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    edge = http.client.HTTPConnection(host, int(port), timeout=WAIT)

    def timed(path: str) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            edge.request("GET", path, headers={"Authorization": f"Bearer {ALPHA}"})
            assert edge.getresponse().read().startswith(b"hello from the sandbox\n" if "/ports/" in path else b"{")
            out.append(time.perf_counter() - t0)
        return out

    through = timed(f"/v1/sandboxes/{sid}/ports/{HTTP_PORT}/proxy/hello")
    describe = timed(f"/v1/sandboxes/{sid}")  # the edge's own cost of a request on a sandbox, for scale
    edge.close()
    p50_in, p50_through = statistics.median(inside), statistics.median(through)
    p99 = sorted(through)[int(n * 0.99)]
    print(f"\nGET /hello p50: direct {p50_in * 1e3:.2f} ms, through the edge {p50_through * 1e3:.2f} ms "
          f"(p99 {p99 * 1e3:.2f} ms): added {(p50_through - p50_in) * 1e3:.2f} ms; GET /v1/sandboxes/{{id}} "
          f"p50 {statistics.median(describe) * 1e3:.2f} ms; load {os.getloadavg()[0]:.1f}")
    assert p50_through - p50_in < 0.05


def test_no_thread_is_left_in_a_sandbox_namespace(url: str, sid: str) -> None:
    before = threading.active_count()
    for _ in range(20):
        assert call(proxy(url, sid, HTTP_PORT, "hello"))[0] == 200
    deadline = time.monotonic() + WAIT
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    own = os.readlink("/proc/self/ns/net")
    for task in os.listdir("/proc/self/task"):
        try:
            assert os.readlink(f"/proc/self/task/{task}/ns/net") == own, Path(f"/proc/self/task/{task}/comm").read_text()
        except FileNotFoundError:  # ended meanwhile
            continue
