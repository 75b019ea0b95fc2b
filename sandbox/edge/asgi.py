"""An ASGI application served from an aiohttp handler: how the edge runs the Connect-RPC services
that ``connectrpc`` implements (sandbox.edge.e2b) without a second HTTP server.

The request body is handed over as aiohttp reads it, never whole (the application bounds what it
reads: connectrpc's ``read_max_bytes``); each piece of the answer is written when the
application sends it and awaits the client's socket (backpressure, no buffering here); once the
body is read, ``receive`` reports ``http.disconnect`` when the client's connection closes, which
is how a server stream notices a client that left.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from aiohttp import web

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
AsgiApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]

READ_PIECE = 64 << 10
DISCONNECT_POLL = 0.5  # seconds between looks at the client's connection once its body is read


async def serve(app: AsgiApp, request: web.Request, *, path: str | None = None) -> web.StreamResponse:
    """Run ``app`` for ``request`` (at ``path``, default the request's) and return what it answered."""
    peer = request.transport.get_extra_info("peername") if request.transport else None
    scope: Scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": f"{request.version.major}.{request.version.minor}",
        "method": request.method, "scheme": request.scheme,
        "path": path or request.path, "raw_path": (path or request.path).encode(),
        "query_string": request.query_string.encode(), "root_path": "",
        "headers": [(k.lower(), v) for k, v in request.raw_headers],
        "client": tuple(peer[:2]) if isinstance(peer, tuple) else None, "server": None, "extensions": {},
    }
    out = _Answer(request)
    body_done = False

    async def receive() -> Message:
        nonlocal body_done
        if not body_done:
            piece = await request.content.read(READ_PIECE)
            body_done = not piece or request.content.at_eof()
            return {"type": "http.request", "body": piece, "more_body": not body_done}
        # aiohttp tells a handler nothing when its client leaves: look
        while request.transport is not None and not request.transport.is_closing():  # noqa: ASYNC110
            await asyncio.sleep(DISCONNECT_POLL)
        return {"type": "http.disconnect"}

    await app(scope, receive, out.send)
    return await out.finish()


class _Answer:
    """What the application sends, written to aiohttp's response as it comes."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None
        self.ended = False

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            resp = web.StreamResponse(status=message["status"])
            for name, value in message.get("headers", ()):
                resp.headers.add(name.decode("latin-1"), value.decode("latin-1"))
            if "Content-Length" not in resp.headers:
                resp.enable_chunked_encoding()
            self.response = resp
            await resp.prepare(self.request)
        elif kind == "http.response.body":
            assert self.response is not None, "a body before the response's start"
            body = message.get("body", b"")
            if body:
                await self.response.write(body)
            if not message.get("more_body", False):
                await self.response.write_eof()
                self.ended = True

    async def finish(self) -> web.StreamResponse:
        if self.response is None:  # the application answered nothing: its failure
            return web.Response(status=500, text="the application sent no answer")
        if not self.ended:
            await self.response.write_eof()
        return self.response
