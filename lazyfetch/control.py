"""The daemon's control API: HTTP/1.1 on its root-only unix socket, one request per connection.

Why not aiohttp here: importing it took 0.46 s of the daemon's 0.85 s start on
these hosts, and a daemon start is on the path of a fresh host's first mount and
of every restart readers wait through.  The API is a handful of JSON routes for
:class:`lazyfetch.client.DaemonClient` (``http.client``); this module speaks the
part of HTTP/1.1 they use: a request line, headers, a ``Content-Length`` body,
and ``Connection: close`` on every answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from lazyfetch.errors import LazyfetchError

log = logging.getLogger("layerbox.lazyfetch")

MAX_HEAD = 64 * 1024  # request line and headers
MAX_BODY = 64 * 1024 * 1024  # a /layers request of many large layers is a few MB of JSON
HEAD_TIMEOUT = 30.0  # a client that connects and sends nothing is dropped


# what a client may send again unchanged: a timeout, throttling, a daemon not ready
RETRYABLE_STATUSES = frozenset({408, 429, 503})


class HTTPError(LazyfetchError):
    """Answer the request with ``status`` and ``text`` (what went wrong, and what to do).

    A :class:`LazyfetchError`: :meth:`lazyfetch.daemon.Daemon.register`, a public method,
    raises it too, so a caller other than this server sees the package's root.
    ``retryable`` follows the status unless the raise says.
    """

    def __init__(self, status: int, text: str, *, retryable: bool | None = None) -> None:
        super().__init__(text, retryable=status in RETRYABLE_STATUSES if retryable is None else retryable)
        self.status = status
        self.text = text


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    body: bytes

    def json(self) -> dict[str, Any]:
        """The body as a JSON object; an empty body is ``{}``."""
        if not self.body:
            return {}
        try:
            obj = json.loads(self.body)
        except (UnicodeDecodeError, ValueError) as exc:
            raise HTTPError(400, f"{self.method} {self.path}: the body is not JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise HTTPError(400, f"{self.method} {self.path}: the body must be a JSON object, "
                                 f"not {type(obj).__name__}")
        return obj


@dataclass(frozen=True, slots=True)
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(status, json.dumps(obj).encode())


Handler = Callable[[Request], Awaitable[Response]]


class ControlServer:
    def __init__(self, routes: Mapping[tuple[str, str], Handler]) -> None:
        self.routes = dict(routes)
        self._server: asyncio.AbstractServer | None = None

    async def start(self, path: str) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path, limit=MAX_HEAD)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                resp = await self._answer(reader)
            except HTTPError as exc:
                resp = Response(exc.status, (exc.text + "\n").encode(), "text/plain; charset=utf-8")
            if resp is None:
                return  # the client went away before its request was whole
            try:
                reason = HTTPStatus(resp.status).phrase
            except ValueError:  # a status http.HTTPStatus does not name
                reason = ""
            writer.write(f"HTTP/1.1 {resp.status} {reason}\r\nContent-Type: {resp.content_type}\r\n"
                         f"Content-Length: {len(resp.body)}\r\nConnection: close\r\n\r\n".encode() + resp.body)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client hung up; nothing to tell it
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader) -> Response | None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT)
        except asyncio.IncompleteReadError:
            return None
        except (asyncio.LimitOverrunError, ValueError):
            raise HTTPError(431, f"request line and headers over {MAX_HEAD} bytes") from None
        except TimeoutError:
            raise HTTPError(408, f"no whole request within {HEAD_TIMEOUT:.0f} s") from None
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise HTTPError(400, f"not an HTTP/1.x request line: {lines[0][:100]!r}")
        method, target, _ = parts
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if line:
                name, sep, value = line.partition(":")
                if not sep:
                    raise HTTPError(400, f"malformed header line {line[:100]!r}")
                headers[name.strip().lower()] = value.strip()
        if "transfer-encoding" in headers:
            raise HTTPError(411, "send the body with a Content-Length, not chunked")
        try:
            length = int(headers.get("content-length", "0"))
        except ValueError:
            raise HTTPError(400, f"Content-Length {headers['content-length'][:40]!r} is not a number") from None
        if length < 0:
            raise HTTPError(400, f"Content-Length {length} is negative")
        if length > MAX_BODY:
            raise HTTPError(413, f"a body of {length} bytes is over the {MAX_BODY} the daemon takes")
        body = await reader.readexactly(length) if length else b""
        path = target.split("?", 1)[0]
        handler = self.routes.get((method, path))
        if handler is None:
            if any(p == path for _, p in self.routes):
                raise HTTPError(405, f"{method} is not allowed on {path}")
            raise HTTPError(404, f"no route {path}; the daemon answers {', '.join(sorted({p for _, p in self.routes}))}")
        try:
            return await handler(Request(method, path, body))
        except HTTPError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            # the request's shape (a missing key, a wrong type): the caller's to fix
            raise HTTPError(400, f"{method} {path}: bad request: {type(exc).__name__}: {exc}") from None
        except Exception as exc:
            log.exception("%s %s", method, path)
            raise HTTPError(500, f"{method} {path} failed: {type(exc).__name__}: {exc}") from None
