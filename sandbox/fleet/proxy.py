"""The gateway's relay to an edge: requests and answers stream through, WebSockets too.

Nothing is buffered whole except what the gateway must read itself (a create's body, to check
it, and its answer, to learn the sandbox's id; both bounded by the edge's own limits).  Hop-by-hop
headers stop here; the caller's credentials (a bearer token, an E2B API key) never go on: the
edge gets the gateway's signed word for the caller instead (sandbox.edge.trust).  What stays is
what the edge itself checks per sandbox: envd's access token and Basic user, a traffic token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping

import aiohttp
from aiohttp import web
from yarl import URL

from sandbox.core.errors import ApiError, SandboxError

log = logging.getLogger("layerbox.fleet.proxy")

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade", "content-length"})
CREDENTIALS = frozenset({"x-api-key"})
WS_HEADERS = frozenset({"sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
                        "sec-websocket-protocol"})


def outbound_headers(request: web.Request, extra: Mapping[str, str]) -> dict[str, str]:
    """The request's end-to-end headers for the edge: no hop-by-hop ones, no caller credential.
    ``Host`` stays: what the edge answers with its own origin (a signed port URL) names the
    gateway the caller used."""
    out: dict[str, str] = {}
    for name, value in request.headers.items():
        low = name.lower()
        if low in HOP_BY_HOP or low in CREDENTIALS or low in WS_HEADERS or low.startswith("x-layerbox-"):
            continue
        if low == "authorization" and value.lower().startswith("bearer "):
            continue  # a project token; envd's Basic user goes on
        out[name] = value
    out.update(extra)
    return out


def is_websocket(request: web.Request) -> bool:
    return request.headers.get("Upgrade", "").lower() == "websocket"


class NotThere(SandboxError):  # noqa: N818 (control flow between relay and the gateway, never answered)
    """The edge answered one of the statuses a request was relayed ``unless`` (its "no such
    sandbox"): the caller may look the route up again and resend (nothing was streamed yet)."""


class EdgeUnreachable(ApiError):
    """The edge did not answer (connection refused or cut, timeout): the breaker counts it."""

    def __init__(self, edge: str, why: str) -> None:
        super().__init__(502, "bad_gateway", f"edge {edge} did not answer: {why}", retryable=True)
        self.edge = edge


async def relay(session: aiohttp.ClientSession, request: web.Request, edge: str, url: str,
                headers: Mapping[str, str], body: bytes | None = None, *,
                unless: frozenset[int] = frozenset()) -> web.StreamResponse:
    """``request`` sent to ``url`` (the edge's base URL plus the request's raw path and query, sent
    as it came: the signature covers it), its answer streamed back; :class:`EdgeUnreachable` when the edge does not answer."""
    target = url + request.rel_url.raw_path_qs
    if is_websocket(request):
        return await _websocket(session, request, edge, target, headers)
    data = body if body is not None else (request.content.iter_any() if request.body_exists else None)
    try:
        async with session.request(request.method, URL(target, encoded=True), headers=headers, data=data, allow_redirects=False) as resp:
            if resp.status in unless:
                raise NotThere(edge)
            out = web.StreamResponse(status=resp.status, reason=resp.reason)
            for name, value in resp.headers.items():
                if name.lower() not in HOP_BY_HOP or name.lower() == "content-length":
                    out.headers.add(name, value)
            if resp.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out.headers.popall("Content-Length", None)
            await out.prepare(request)
            try:
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
                # the edge died mid-answer: the caller's stream is cut too (a truncated body is an
                # error to every client), never ended as if complete
                log.warning("edge %s cut %s %s: %s", edge, request.method, request.path, exc)
                out.force_close()
                if request.transport is not None:
                    request.transport.close()
                return out
            await out.write_eof()
            return out
    except (TimeoutError, aiohttp.ClientConnectionError) as exc:
        raise EdgeUnreachable(edge, str(exc) or type(exc).__name__) from None


async def fetch_json(session: aiohttp.ClientSession, method: str, edge: str, target: str,
                     headers: Mapping[str, str], body: bytes | None = None) -> tuple[int, dict[str, str], object]:
    """One request whose answer the gateway reads: (status, headers, parsed JSON or None)."""
    try:
        async with session.request(method, URL(target, encoded=True), headers=headers, data=body, allow_redirects=False) as resp:
            raw = await resp.read()
            try:
                doc = await resp.json(content_type=None) if raw else None
            except ValueError:
                doc = None
            return resp.status, dict(resp.headers), doc
    except (TimeoutError, aiohttp.ClientConnectionError) as exc:
        raise EdgeUnreachable(edge, str(exc) or type(exc).__name__) from None


async def _websocket(session: aiohttp.ClientSession, request: web.Request, edge: str, target: str,
                     headers: Mapping[str, str]) -> web.StreamResponse:
    offered = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
    try:
        upstream = await session.ws_connect(URL(target, encoded=True), headers=headers, protocols=offered, autoping=False,
                                            max_msg_size=0)
    except aiohttp.WSServerHandshakeError as exc:
        raise ApiError(exc.status, "bad_gateway" if exc.status >= 500 else "not_found" if exc.status == 404
                       else "bad_request", f"edge {edge} refused the WebSocket: {exc.message}") from None
    except (TimeoutError, aiohttp.ClientConnectionError) as exc:
        raise EdgeUnreachable(edge, str(exc) or type(exc).__name__) from None
    down = web.WebSocketResponse(protocols=(upstream.protocol,) if upstream.protocol else (), autoping=False,
                                 max_msg_size=0)
    await down.prepare(request)

    async def pump(src: aiohttp.ClientWebSocketResponse | web.WebSocketResponse,
                   dst: aiohttp.ClientWebSocketResponse | web.WebSocketResponse) -> None:
        async for msg in src:
            if msg.type == aiohttp.WSMsgType.TEXT:
                await dst.send_str(msg.data)
            elif msg.type == aiohttp.WSMsgType.BINARY:
                await dst.send_bytes(msg.data)
            elif msg.type == aiohttp.WSMsgType.PING:
                await dst.ping(msg.data)
            elif msg.type == aiohttp.WSMsgType.PONG:
                await dst.pong(msg.data)
            else:
                break
        await dst.close(code=src.close_code or aiohttp.WSCloseCode.OK)

    tasks = [asyncio.ensure_future(pump(down, upstream)), asyncio.ensure_future(pump(upstream, down))]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await upstream.close()
        await down.close()
    return down
