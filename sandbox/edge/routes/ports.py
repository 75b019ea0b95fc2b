"""Port exposure: HTTP and WebSocket through the edge to a port a sandbox listens on.

Routes (added by :func:`add_routes`; ``{port}`` is 1-65535, ``{tail}`` is the path the
sandbox's server sees, query string kept)::

    * /v1/sandboxes/{id}/ports/{port}/proxy/{tail}                           bearer token
    * /v1/sandboxes/{id}/ports/{port}/signed/{expires}/{signature}/{tail}     signed URL
    POST /v1/sandboxes/{id}/ports/{port}/url  {"ttl": seconds}                mints a signed URL

Where a connection goes: ``127.0.0.1:<port>`` *inside the sandbox's own network
namespace* (its backend's ``connect_port``).  For a container the edge opens the socket
on a short-lived thread that has ``setns``'d into the namespace of the sandbox's init
(``/proc/<init>/ns/net``, opened, then the init checked again against its recorded
start time and cgroup, as the files API does) and connects it there; a socket keeps
the namespace it was made in, so everything after runs on the event loop.  For a
microVM or VM the guest agent connects to the guest's own ``127.0.0.1:<port>`` and
relays the stream over its channel (sandbox/backends/vm/agent.py ``GuestPort``); the
edge holds one end of a socket pair.  Nothing is routed: the sandbox gains no path to the
host, its egress policy is untouched (loopback is always allowed inside it, in both
directions), and the host's own ``127.0.0.1`` is never the target.  A port nobody
listens on is refused by the sandbox's kernel at once: 502 ``port_closed`` naming it.

Who may connect: the owning project's bearer token (another project's sandbox
answers 404, as everywhere in the API); or anyone holding a signed URL, an
HMAC-SHA256 under the service's ``url_secret`` over (sandbox id, port, expiry),
compared in constant time, :data:`DEFAULT_URL_TTL` by default and at most
:data:`MAX_URL_TTL`.  A bad or expired signature is 403, checked before the
sandbox is looked up (so signatures reveal nothing about which ids exist).  The
bearer route never forwards the caller's ``Authorization`` header; the signed
route forwards it (it is then the application's own).

Limits: at most :data:`MAX_CONNECTIONS` proxied requests and WebSockets open per
sandbox on this edge (429 ``too_many_connections`` past it); :data:`CONNECT_TIMEOUT`
for the connect, :data:`IDLE_TIMEOUT` without a byte (HTTP) or a message (WebSocket)
in either direction.  Hop-by-hop headers (RFC 9110 7.6.1, and every header the
``Connection`` header names) are dropped both ways; ``Host`` becomes
``127.0.0.1:<port>``; bodies are streamed both ways, byte for byte (no
decompression).  A proxied connection is activity: it renews the job's lease and
keeps the sandbox from being paused as idle.

The upstream client is aiohttp's, over a connector whose only job is to hand it the
namespaced socket (``BaseConnector._create_connection``, the hook aiohttp's own Unix
and named-pipe connectors implement); ``tests/test_sandbox_ports.py`` covers it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import re
import time
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from sandbox.core.errors import ApiError, InvalidField, SandboxNotFound
from sandbox.core.model import SandboxState, check_int, check_number, check_object, check_sandbox_id
from sandbox.edge.context import EdgeContext
from sandbox.host.sandbox import Sandbox

if TYPE_CHECKING:
    from aiohttp.client_proto import ResponseHandler
    from aiohttp.client_reqrep import ClientRequest
    from aiohttp.tracing import Trace


PREFIX = "/v1/sandboxes/{id}/ports/{port}"
# every method but CONNECT and TRACE; HEAD is registered, not described (aiohttp pairs it with GET)
METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
MAX_CONNECTIONS = 32  # proxied requests and WebSockets open at once, per sandbox and edge
CONNECT_TIMEOUT = 5.0  # loopback answers at once; only a full accept backlog waits
IDLE_TIMEOUT = 300.0  # seconds without a byte or message either way
DEFAULT_URL_TTL = 300.0
MAX_URL_TTL = 3600.0
# one WebSocket message either way: a relay may hold one on each side while its reader lags, so
# connections x 3 x this bounds what a project's proxied sockets make the edge buffer
MAX_WS_MESSAGE = 2 << 20  # (a 1 MiB message, what previews send at most in practice, passes)
ACTIVITY_INTERVAL = 30.0  # how often a proxied connection renews lease and idle time, at most
SIGNATURE = re.compile(r"[0-9a-f]{64}")
EXPIRES = re.compile(r"[0-9]{1,12}")
_DOMAIN = b"layerbox.port-url.v1"  # what the MAC is of: never valid as any other HMAC of this secret

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"})
_NOT_FORWARDED = frozenset({"host", "expect"})  # Host is the sandbox's; aiohttp answered Expect already
_WS_HANDSHAKE = frozenset({"sec-websocket-key", "sec-websocket-version", "sec-websocket-accept",
                           "sec-websocket-extensions", "sec-websocket-protocol"})
# aiohttp's client adds these unless told not to: the sandbox sees only what the caller sent
_NO_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")


# -- signed URLs ------------------------------------------------------------------------------------------
def sign(secret: bytes, sid: str, port: int, expires: int) -> str:
    """The signature of a URL to ``port`` of sandbox ``sid`` that expires at Unix time ``expires``."""
    message = b"\0".join((_DOMAIN, sid.encode(), str(port).encode(), str(expires).encode()))
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def verify(secret: bytes, sid: str, port: int, expires: int, signature: str, *, now: float) -> None:
    """Raise 403 unless ``signature`` is this service's for (sid, port, expires) and still valid."""
    if not hmac.compare_digest(sign(secret, sid, port, expires), signature):
        raise ApiError(None, "bad_signature", "the URL's signature does not match its sandbox, port and expiry "
                                             "(mint another with POST .../ports/{port}/url)")
    if expires <= now:
        raise ApiError(None, "expired", f"the URL expired {now - expires:.0f} s ago "
                                       "(mint another with POST .../ports/{port}/url)")
    if expires > now + MAX_URL_TTL + 60:  # minted under a longer maximum than this edge allows
        raise ApiError(None, "expired", f"the URL is valid for more than this edge's maximum of {MAX_URL_TTL:g} s")


# -- fields -----------------------------------------------------------------------------------------------
def _port(request: web.Request) -> int:
    text = request.match_info["port"]
    if not text.isascii() or not text.isdigit() or len(text) > 5:
        raise InvalidField("port", f"{text[:20]!r} is not a TCP port (1-65535)")
    return check_int("port", int(text), 1, 65535)


def _match(request: web.Request, name: str, grammar: re.Pattern[str], what: str) -> str:
    text = request.match_info[name]
    if not grammar.fullmatch(text):
        raise InvalidField(name, f"{text[:80]!r} is not {what}")
    return text


def _target(request: web.Request, segments: int) -> str:
    """The request's path after the route's first ``segments`` segments, as sent (still encoded), and
    its query: what the sandbox's server is asked for.  The prefix is compared with what the router
    matched (decoded), so an encoded ``/`` in it cannot shift the tail."""
    parts = request.rel_url.raw_path.split("/", segments + 1)
    prefix = [unquote(p) for p in parts[:segments + 1]]
    if len(parts) != segments + 2 or prefix != request.path.split("/", segments + 1)[:segments + 1]:
        raise InvalidField("tail", "the path after the port's prefix must follow a '/'")
    query = request.rel_url.raw_query_string
    return "/" + parts[-1] + (f"?{query}" if query else "")


def _forwarded(headers: Any, drop: frozenset[str]) -> CIMultiDict[str]:
    """``headers`` without hop-by-hop ones, those the Connection header names, and ``drop``."""
    named = {token.strip().lower() for value in headers.getall("Connection", ()) for token in value.split(",")}
    out: CIMultiDict[str] = CIMultiDict()
    for key, value in headers.items():
        lowered = key.lower()
        if lowered not in HOP_BY_HOP and lowered not in named and lowered not in drop:
            out.add(key, value)
    return out


# what a sandbox's answer may not say to the edge's origin: a service worker scoped above its prefix
_NOT_RETURNED = frozenset({"service-worker-allowed"})


def _returned(headers: Any, prefix: str) -> CIMultiDict[str]:
    """A sandbox's response headers as the caller gets them: hop-by-hop ones dropped, no
    ``Service-Worker-Allowed``, and every cookie kept to the sandbox's own prefix (its ``Path``
    under ``prefix``, no ``Domain``): a hostile preview never sets state for the edge's origin."""
    out = _forwarded(headers, _NOT_RETURNED)
    cookies = out.popall("Set-Cookie", [])
    for cookie in cookies:
        out.add("Set-Cookie", _scoped_cookie(cookie, prefix))
    return out


def _scoped_cookie(value: str, prefix: str) -> str:
    base = prefix.rstrip("/") or "/"
    name_value, *attributes = value.split(";")
    kept = []
    for attribute in attributes:
        key, _, path = attribute.strip().partition("=")
        if key.lower() == "domain":
            continue
        if key.lower() == "path":
            if path == base or path.startswith(base + "/"):
                kept.append(f"Path={path}")
            continue
        kept.append(attribute.strip())
    if not any(a.lower().startswith("path=") for a in kept):
        kept.append(f"Path={base}")
    return "; ".join([name_value.strip(), *kept])


def _is_websocket(request: web.Request) -> bool:
    connection = {t.strip().lower() for t in request.headers.get("Connection", "").split(",")}
    return (request.method == "GET" and "upgrade" in connection
            and request.headers.get("Upgrade", "").lower() == "websocket")


# -- the namespaced socket ----------------------------------------------------------------------------------
class _NetnsConnector(aiohttp.BaseConnector):
    """One connection to ``127.0.0.1:<port>`` inside one sandbox: aiohttp speaks HTTP over it."""

    def __init__(self, box: Sandbox, state: SandboxState, port: int) -> None:
        super().__init__(force_close=True, limit=1)
        self.box, self.state, self.port = box, state, port

    async def _create_connection(self, req: ClientRequest, traces: list[Trace],
                                 timeout: aiohttp.ClientTimeout) -> ResponseHandler:  # noqa: ASYNC109 (aiohttp's)
        where = f"port {self.port} of sandbox {self.box.id}"
        try:
            # a thread: a VM's connect is a request to its guest agent (the backend bounds it)
            sock = await asyncio.to_thread(self.box.connect_port, self.port, CONNECT_TIMEOUT)
        except ConnectionRefusedError:
            raise ApiError(None, "port_closed", f"nothing listens on {where} (127.0.0.1:{self.port} inside the "
                                               "sandbox; a server bound to another address is not reached)",
                           retryable=True) from None
        except TimeoutError:
            raise ApiError(None, "port_timeout", f"{where} did not accept within {CONNECT_TIMEOUT:g} s "
                                                "(its accept backlog is full)", retryable=True) from None
        try:
            _, proto = await self._loop.create_connection(self._factory, sock=sock)
        except BaseException:
            sock.close()
            raise
        return proto


# -- the proxy ---------------------------------------------------------------------------------------------
class PortProxy:
    """The port routes of one app: auth, the per-sandbox connection limit, HTTP and WebSocket relay."""

    def __init__(self, ctx: EdgeContext, url_secret: bytes) -> None:
        self.ctx = ctx
        self.url_secret = url_secret
        self.max_connections = MAX_CONNECTIONS
        self._open: dict[str, int] = {}  # proxied connections per sandbox (all on the loop's thread)
        self._active: dict[str, float] = {}  # sandbox -> when its activity was last recorded (monotonic)

    # -- routes -------------------------------------------------------------------------------------------
    async def mint(self, request: web.Request) -> web.Response:
        # ownership before the other fields, as on every route naming a sandbox: another project's is a 404
        box, _ = await self.ctx.sandbox(request, self.ctx.project(request))
        port = _port(request)
        body = check_object("", await self.ctx.body(request), ("ttl",))
        ttl = check_number("ttl", body.get("ttl", DEFAULT_URL_TTL), 0.0, MAX_URL_TTL, lo_open=True)
        expires = int(time.time() + ttl)
        path = (f"/v1/sandboxes/{box.id}/ports/{port}/signed/{expires}/"
                f"{sign(self.url_secret, box.id, port, expires)}/")
        await asyncio.to_thread(box.receipt, "port_url", port=port, expires=expires)
        return web.json_response({"sandbox": box.id, "port": port, "expires": expires, "path": path,
                                  "url": str(request.url.origin()) + path})

    async def bearer(self, request: web.Request) -> web.StreamResponse:
        box, state = await self.ctx.sandbox(request, self.ctx.project(request))
        port = _port(request)
        target = _target(request, 6)
        return await self.forward(request, box, state, port, target, keep_authorization=False)

    async def signed(self, request: web.Request) -> web.StreamResponse:
        sid = check_sandbox_id(request.match_info["id"])
        port = _port(request)
        expires = int(_match(request, "expires", EXPIRES, "a Unix time in seconds"))
        signature = _match(request, "signature", SIGNATURE, "a signature (64 hex digits)")
        target = _target(request, 8)
        verify(self.url_secret, sid, port, expires, signature, now=time.time())
        box, state = await self._signed_box(sid)
        return await self.forward(request, box, state, port, target, keep_authorization=True)

    async def _signed_box(self, sid: str) -> tuple[Sandbox, SandboxState]:
        """The sandbox a valid signature names, if it still exists and its project may still use it."""
        # SandboxNotFound answers as it does everywhere in the API (404)
        box = await asyncio.to_thread(self.ctx.manager.get, sid)
        state = await asyncio.to_thread(lambda: box.state)
        project = self.ctx.auth.named(state.project or "")
        if project is None:  # its project was removed from the tokens file
            raise SandboxNotFound(f"no sandbox {sid!r}")
        if project.disabled:
            raise ApiError(None, "forbidden", f"project {project.name!r} is disabled")
        await asyncio.to_thread(self.ctx.touch_lease, state)
        return box, state

    # -- relay ----------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _slot(self, sid: str) -> Iterator[None]:
        n = self._open.get(sid, 0)
        if n >= self.max_connections:
            raise ApiError(None, "too_many_connections", f"sandbox {sid} has {n} proxied connections open on this "
                                                        f"edge, at most {self.max_connections}; retry when one "
                                                        "ends", retryable=True, retry_after=1)
        self._open[sid] = n + 1
        try:
            yield
        finally:
            self._open[sid] -= 1
            if not self._open[sid]:
                del self._open[sid]

    async def _activity(self, box: Sandbox) -> None:
        """Record that the sandbox is in use (at most every ACTIVITY_INTERVAL): the reaper pauses only
        sandboxes idle past their idle_timeout, and a served preview is not idle."""
        now = time.monotonic()
        if now - self._active.get(box.id, -ACTIVITY_INTERVAL) < ACTIVITY_INTERVAL:
            return
        self._active[box.id] = now

        def touch() -> None:
            with contextlib.suppress(SandboxNotFound):  # destroyed meanwhile: the relay fails on its own
                box.update(last_active=time.time())

        await asyncio.to_thread(touch)

    async def forward(self, request: web.Request, box: Sandbox, state: SandboxState, port: int, target: str,
                      *, keep_authorization: bool, drop: frozenset[str] = frozenset()) -> web.StreamResponse:
        """Relay ``request`` to ``port`` of the sandbox at ``target`` (path and query), the caller
        already checked; headers in ``drop`` (lower case) stay here too."""
        if state.status != "running":
            raise ApiError(None, "conflict", f"sandbox {box.id} is {state.status}: its ports answer only while it "
                                            "runs" + (" (resume it)" if state.status == "paused" else ""))
        drop = drop | (_NOT_FORWARDED if keep_authorization else _NOT_FORWARDED | {"authorization"})
        websocket = _is_websocket(request)
        headers = _forwarded(request.headers, (drop | _WS_HANDSHAKE) if websocket else drop)
        headers["Host"] = f"127.0.0.1:{port}"
        if request.remote:
            headers.add("X-Forwarded-For", request.remote)
        raw_path = request.rel_url.raw_path  # what the caller's links are relative to
        headers["X-Forwarded-Prefix"] = raw_path[:len(raw_path) - len(target.partition("?")[0])]
        url = URL(f"http://127.0.0.1:{port}{target}", encoded=True)
        timeout = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT, sock_connect=CONNECT_TIMEOUT,
                                        sock_read=IDLE_TIMEOUT)
        with self.ctx.usage.take(state.project or "", "connections"), self._slot(box.id):
            await self._activity(box)
            async with aiohttp.ClientSession(connector=_NetnsConnector(box, state, port), timeout=timeout,
                                             auto_decompress=False, skip_auto_headers=_NO_AUTO_HEADERS) as session:
                if websocket:
                    return await self._websocket(request, session, url, headers, box, port)
                return await self._http(request, session, url, headers, box, port)

    async def _body(self, request: web.Request, box: Sandbox) -> AsyncIterator[bytes]:
        while True:
            async with asyncio.timeout(IDLE_TIMEOUT):
                chunk = await request.content.readany()
            if not chunk:
                return
            await self._activity(box)
            yield chunk

    async def _http(self, request: web.Request, session: aiohttp.ClientSession, url: URL,
                    headers: CIMultiDict[str], box: Sandbox, port: int) -> web.StreamResponse:
        where = f"port {port} of sandbox {box.id}"
        try:
            upstream = await session.request(request.method, url, headers=headers, allow_redirects=False,
                                             data=self._body(request, box) if request.body_exists else None)
        except aiohttp.ServerTimeoutError:
            raise ApiError(None, "port_timeout", f"{where} sent no response within {IDLE_TIMEOUT:g} s",
                           retryable=True) from None
        except aiohttp.ClientError as exc:
            raise ApiError(None, "bad_gateway", f"{where} answered no valid HTTP response: {exc}",
                           retryable=True) from None
        async with upstream:
            if upstream.status == 101:  # a switch the caller did not ask for (WebSockets go another way)
                raise ApiError(None, "bad_gateway", f"{where} switched protocols on a plain HTTP request")
            resp = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                      headers=_returned(upstream.headers, headers["X-Forwarded-Prefix"]))
            await resp.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
                    await self._activity(box)
            except (aiohttp.ClientError, TimeoutError, ConnectionError):
                # the status is out: cut the caller's connection, so a short body reads as an error
                if request.transport is not None:
                    request.transport.close()
                return resp
            await resp.write_eof()
            return resp

    async def _websocket(self, request: web.Request, session: aiohttp.ClientSession, url: URL,
                         headers: CIMultiDict[str], box: Sandbox, port: int) -> web.StreamResponse:
        where = f"port {port} of sandbox {box.id}"
        offered = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
        try:
            upstream = await session.ws_connect(url, protocols=offered, headers=headers, autoping=True,
                                                max_msg_size=MAX_WS_MESSAGE)
        except aiohttp.WSServerHandshakeError as exc:
            raise ApiError(None, "bad_gateway", f"{where} refused the WebSocket handshake ({exc.status} "
                                               f"{exc.message})") from None
        except aiohttp.ServerTimeoutError:
            raise ApiError(None, "port_timeout", f"{where} did not answer the WebSocket handshake within "
                                                f"{IDLE_TIMEOUT:g} s", retryable=True) from None
        except aiohttp.ClientError as exc:
            raise ApiError(None, "bad_gateway", f"{where}: {exc}", retryable=True) from None
        try:
            ws = web.WebSocketResponse(protocols=(upstream.protocol,) if upstream.protocol else (),
                                       max_msg_size=MAX_WS_MESSAGE, autoping=True)
            await ws.prepare(request)
            await self._relay(ws, upstream, box)
            return ws
        finally:
            await upstream.close()

    async def _relay(self, caller: web.WebSocketResponse, upstream: aiohttp.ClientWebSocketResponse,
                     box: Sandbox) -> None:
        """Messages both ways until either side closes (its close code goes to the other) or both are
        idle for IDLE_TIMEOUT."""
        last = time.monotonic()

        async def pump(src: Any, dst: Any) -> None:
            nonlocal last
            async for msg in src:  # ends at the peer's close
                last = time.monotonic()
                if msg.type == aiohttp.WSMsgType.TEXT:
                    await dst.send_str(msg.data)
                elif msg.type == aiohttp.WSMsgType.BINARY:
                    await dst.send_bytes(msg.data)
                elif msg.type == aiohttp.WSMsgType.ERROR:
                    break
                await self._activity(box)
            await dst.close(code=_close_code(src.close_code))

        tasks = {asyncio.ensure_future(pump(caller, upstream)), asyncio.ensure_future(pump(upstream, caller))}
        try:
            while not (await asyncio.wait(tasks, timeout=min(IDLE_TIMEOUT, 10.0),
                                          return_when=asyncio.FIRST_COMPLETED))[0]:
                if time.monotonic() - last > IDLE_TIMEOUT:
                    await caller.close(code=aiohttp.WSCloseCode.GOING_AWAY, message=b"idle")
                    break
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await caller.close()


def _close_code(code: int | None) -> int:
    """The code to close the other side with: the peer's, but never one RFC 6455 reserves for "no
    code" (1005) or an abnormal end (1006, 1015), which no close frame may carry."""
    if code is None or code == 1005:
        return int(aiohttp.WSCloseCode.OK)
    if code in (1006, 1015):
        return int(aiohttp.WSCloseCode.INTERNAL_ERROR)
    return code


def setup(ctx: EdgeContext, app: web.Application, url_secret: bytes) -> PortProxy:
    """Register the port routes on ``app`` (see the module's docstring); ``url_secret`` signs port URLs."""
    proxy = PortProxy(ctx, url_secret)
    router = app.router
    router.add_post(PREFIX + "/url", proxy.mint)
    for method in METHODS:
        router.add_route(method, PREFIX + "/proxy/{tail:.*}", proxy.bearer)
        router.add_route(method, PREFIX + "/signed/{expires}/{signature}/{tail:.*}", proxy.signed)
    return proxy
