"""An HTTP proxy in front of a real S3 server that fails requests on cue.

The S3 backend's retry and timeout behaviour is tested against moto through
this proxy rather than against mocks: the client sees real status codes,
real silent sockets and real connection resets.

``FaultProxy(upstream)`` listens on 127.0.0.1 (a free port), runs its own
asyncio loop in a background thread, and forwards each request to
``upstream`` on a fresh connection, unless a fault is queued:

- ``Fault.error(503, "SlowDown")``: answer with that S3 error (not forwarded);
- ``Fault.stall(seconds)``: read the request, then say nothing for
  ``seconds`` and close (not forwarded);
- ``Fault.reset()``: forward the request (so a write lands upstream), then
  send half of the response and reset the connection (RST);
- ``Fault.error_after(500, "InternalError")``: forward the request, then answer
  that S3 error instead of the server's answer.

``proxy.inject(fault, times=2)`` queues faults; ``method="PUT"`` limits one
to that method.  ``proxy.log`` records ``(method, path, fault kind or None)``
for every request, to count attempts; ``proxy.exchanges()`` records, for
every answer of the server the client was sent (whole, or half for a reset),
the request's ``Range`` header and the answer's status and body size, so a
test can count the bytes a client received independently of the client.
``fault_proxy`` is the fixture (it needs a ``moto_server`` fixture); it stops
the proxy and drops its open connections at teardown.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.support.moto import MotoServer

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "expect", "te",
               "trailer", "upgrade"}


@dataclass(frozen=True)
class Fault:
    kind: str  # "error", "stall" or "reset"
    status: int = 503
    code: str = "SlowDown"
    seconds: float = 0.0

    @staticmethod
    def error(status: int = 503, code: str = "SlowDown") -> Fault:
        return Fault("error", status=status, code=code)

    @staticmethod
    def stall(seconds: float = 60.0) -> Fault:
        return Fault("stall", seconds=seconds)

    @staticmethod
    def reset() -> Fault:
        return Fault("reset")

    @staticmethod
    def error_after(status: int = 500, code: str = "InternalError") -> Fault:
        """Forward the request (a write lands upstream), then answer that S3 error instead of
        the server's answer: what Ceph RGW does to some losers of a conditional-write race."""
        return Fault("error_after", status=status, code=code)


@dataclass(frozen=True)
class Exchange:
    """A forwarded request and what the client was sent of the server's answer."""

    method: str
    target: str
    range: str | None  # the request's Range header
    status: int | None  # None: the client was cut off inside the answer's head
    body_bytes: int  # body bytes the client was sent (part of the answer for a reset)
    fault: str | None


@dataclass
class _Request:
    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes


class FaultProxy:
    def __init__(self, upstream: str) -> None:
        parts = urllib.parse.urlsplit(upstream)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.log: list[tuple[str, str, str | None]] = []
        self._exchanges: list[Exchange] = []
        self._faults: list[tuple[Fault, str | None]] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="s3-fault-proxy", daemon=True)
        self._ready = threading.Event()
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._startup_error: BaseException | None = None
        self.url = ""

    # -- control, from the test's thread -----------------------------------------------------
    def start(self) -> FaultProxy:
        self._thread.start()
        if not self._ready.wait(10) or self._startup_error is not None:
            raise RuntimeError(f"fault proxy did not start: {self._startup_error}")
        return self

    def inject(self, fault: Fault, times: int = 1, *, method: str | None = None) -> None:
        with self._lock:
            self._faults.extend([(fault, method)] * times)

    def clear(self) -> None:
        """Drop faults not yet used (requests already stalled stay stalled)."""
        with self._lock:
            self._faults.clear()

    def pending(self) -> int:
        with self._lock:
            return len(self._faults)

    def requests(self, method: str | None = None) -> list[tuple[str, str, str | None]]:
        with self._lock:
            return [entry for entry in self.log if method is None or entry[0] == method]

    def exchanges(self, method: str | None = None) -> list[Exchange]:
        with self._lock:
            return [x for x in self._exchanges if method is None or x.method == method]

    def stop(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        if not self._loop.is_closed() and not self._thread.is_alive():
            self._loop.close()

    # -- the proxy, in its own thread --------------------------------------------------------
    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._serve, "127.0.0.1", 0))
            port = self._server.sockets[0].getsockname()[1]
            self.url = f"http://127.0.0.1:{port}"
        except BaseException as exc:  # reported by start()
            self._startup_error = exc
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    def _take(self, method: str) -> Fault | None:
        with self._lock:
            for i, (fault, only) in enumerate(self._faults):
                if only is None or only == method:
                    del self._faults[i]
                    return fault
        return None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while True:
                request = await _read_request(reader, writer)
                if request is None:
                    return
                fault = self._take(request.method)
                with self._lock:
                    self.log.append((request.method, request.target, fault.kind if fault else None))
                if fault is None:
                    writer.write(self._record(request, await self._forward(request), None))
                elif fault.kind == "error":
                    writer.write(_error_response(request, fault))
                elif fault.kind == "error_after":
                    await self._forward(request)
                    writer.write(_error_response(request, fault))
                elif fault.kind == "stall":
                    await asyncio.sleep(fault.seconds)
                    return
                else:  # reset: the request reaches the server, half the answer reaches the client
                    response = await self._forward(request)
                    writer.write(self._record(request, response[: max(1, len(response) // 2)], fault.kind))
                    await writer.drain()
                    _reset(writer)
                    return
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            return  # the client went away
        except asyncio.CancelledError:
            # Only stop() cancels handlers; ending quietly keeps asyncio's stream callback
            # from logging the cancellation as an error.
            return
        finally:
            self._handlers.discard(task)
            writer.close()

    def _record(self, request: _Request, sent: bytes, fault: str | None) -> bytes:
        """Note what the client is sent of the server's answer; returns ``sent``."""
        head, sep, body = sent.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1]) if sep and head.startswith(b"HTTP/") else None
        ranges = [v for k, v in request.headers if k.lower() == "range"]
        with self._lock:
            self._exchanges.append(Exchange(request.method, request.target, ranges[0] if ranges else None,
                                            status, len(body) if request.method != "HEAD" else 0, fault))
        return sent

    async def _forward(self, request: _Request) -> bytes:
        reader, writer = await asyncio.open_connection(*self._upstream)
        try:
            head = [f"{request.method} {request.target} HTTP/1.1"]
            head += [f"{k}: {v}" for k, v in request.headers
                     if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length"]
            head += [f"Content-Length: {len(request.body)}", "Connection: close"]
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + request.body)
            await writer.drain()
            status_line, headers = _parse_head(await reader.readuntil(b"\r\n\r\n"))
            status = int(status_line.split(" ", 2)[1])
            fields = {k.lower(): v for k, v in headers}
            if request.method == "HEAD" or status in (204, 304):
                body = b""
            elif "content-length" in fields:
                body = await reader.readexactly(int(fields["content-length"]))
            elif "chunked" in fields.get("transfer-encoding", "").lower():
                body = await _read_chunked(reader)
            else:
                body = await reader.read()
        finally:
            writer.close()
        out = [status_line]
        out += [f"{k}: {v}" for k, v in headers
                if k.lower() not in _HOP_BY_HOP and (request.method == "HEAD" or k.lower() != "content-length")]
        if request.method != "HEAD":
            out.append(f"Content-Length: {len(body)}")
        return ("\r\n".join(out) + "\r\n\r\n").encode("latin-1") + body


def _parse_head(raw: bytes) -> tuple[str, list[tuple[str, str]]]:
    lines = raw.decode("latin-1").split("\r\n")
    headers = []
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers.append((name.strip(), value.strip()))
    return lines[0], headers


async def _read_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> _Request | None:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None  # the client closed its keep-alive connection
    request_line, headers = _parse_head(raw)
    method, target, _ = request_line.split(" ", 2)
    fields = {k.lower(): v for k, v in headers}
    if fields.get("expect", "").lower() == "100-continue":
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
    if "chunked" in fields.get("transfer-encoding", "").lower():
        body = await _read_chunked(reader)
    else:
        body = await reader.readexactly(int(fields.get("content-length", "0")))
    return _Request(method, target, headers, body)


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":
                pass  # trailers: dropped
            return bytes(body)
        body += await reader.readexactly(size)
        await reader.readexactly(2)


def _error_response(request: _Request, fault: Fault) -> bytes:
    reason = {500: "Internal Server Error", 503: "Service Unavailable", 403: "Forbidden"}.get(
        fault.status, "Error")
    body = b"" if request.method == "HEAD" else (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{fault.code}</Code><Message>injected by the test proxy</Message>"
        "<RequestId>fault-proxy</RequestId></Error>").encode()
    head = [f"HTTP/1.1 {fault.status} {reason}", "Content-Type: application/xml",
            f"Content-Length: {len(body)}", "x-amz-request-id: fault-proxy"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@pytest.fixture
def fault_proxy(moto_server: MotoServer) -> Iterator[FaultProxy]:
    """A FaultProxy in front of the ``moto_server`` fixture's server, stopped at teardown."""
    proxy = FaultProxy(moto_server.endpoint).start()
    try:
        yield proxy
    finally:
        proxy.stop()
