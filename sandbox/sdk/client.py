"""Client SDK for the sandbox service, shaped like E2B's: an async core and its blocking twin.

::

    async with await AsyncSandbox.create("img/python", url=URL, token=TOKEN, memory=512 << 20) as sb:
        r = await sb.commands.run("python3 -c 'print(1)'", on_stdout=print, check=True)
        await sb.files.write("/root/a.txt", "hi")
        ckpt = await sb.checkpoint(name="step-1")
        server = await sb.commands.run("python3 -m http.server 8000", background=True)  # a handle
        url = (await sb.preview_url(8000)).url                 # for anyone, for 5 minutes
        term = await sb.pty.create(80, 24, on_data=screen.write)
        forked = await sb.fork(3)                              # 3 more sandboxes on these files
    copy = await AsyncSandbox.restore(ckpt.name, url=URL, token=TOKEN)

    with Sandbox.create("img/python", url=URL, token=TOKEN) as sb:   # the same API, blocking
        sb.commands.run("echo hi").stdout

Classes: :class:`AsyncSandbox` (with ``commands``, ``files`` and ``pty``; fork, ports,
ttl, metrics), :class:`AsyncCommandHandle` and :class:`AsyncPtyHandle` (a background
command or terminal, which outlives its client), :class:`AsyncJob` (a job's lease,
pause/resume, preemption), :class:`AsyncClient` (capabilities, load report, checkpoints,
FnCall); their blocking twins :class:`Sandbox`, :class:`CommandHandle`,
:class:`PtyHandle`, :class:`Job`, :class:`Client` are derived from them
(:mod:`sandbox.sdk.blocking`), with the same methods, parameters and docstrings.
:func:`call` and :func:`capabilities` are one-shot async shortcuts.  Leaving a sandbox's
``with`` block kills it (not its forks); :meth:`AsyncSandbox.close` leaves it running.

Options are checked here by the model the service uses (:class:`~sandbox.core.model.SandboxOptions`):
a mistyped keyword is a type error (mypy) or ``TypeError``, a bad value an
:class:`~sandbox.core.errors.InvalidField`, before any request.  Results are frozen
dataclasses (:mod:`sandbox.sdk.types`); errors are typed by what happened
(:mod:`sandbox.sdk.errors`): ``ImageNotFound``, ``SandboxKilled``, ``FileNotFound``,
``CapacityExceeded`` with ``retry_after`` and ``resources``, ``ServiceUnavailable`` for a
service that does not answer, ``SandboxClosed`` after ``kill()``...
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import codecs
import contextlib
import dataclasses
import json
import os
import time
import urllib.parse
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Mapping, Sequence
from types import TracebackType
from typing import Any, BinaryIO, Literal, Self, TypeVar, Unpack, overload

import aiofiles
import aiohttp

from sandbox.core.model import (
    ISOLATIONS,
    EgressRule,
    SandboxFilter,
    SandboxOptions,
    Status,
    check_int,
    check_job,
    check_labels,
    parse_rules,
)
from sandbox.sdk.blocking import (
    Blocking,
    Loop,
    Part,
    blocking,
    delegated,
    handing_out,
    oneshot,
    opens,
    opens_each,
    twin_of,
)
from sandbox.sdk.errors import (
    ApiError,
    AuthError,
    CapacityExceeded,
    CheckpointNotFound,
    CommandExitError,
    CommandNotFound,
    Conflict,
    FileAccessDenied,
    FileNotFound,
    ImageNotFound,
    InvalidRequest,
    LimitExceeded,
    NotFound,
    QuotaExceeded,
    RunNotFound,
    SandboxClosed,
    SandboxKilled,
    SandboxNotFound,
    ServiceUnavailable,
    UnsupportedIsolation,
    from_answer,
    status_of,
)
from sandbox.sdk.types import (
    CallResult,
    Capabilities,
    Checkpoint,
    CheckpointInfo,
    CommandExit,
    CommandFields,
    CommandInfo,
    CommandResult,
    CommandsUsage,
    Cut,
    DiskUsage,
    EdgeLoad,
    FileEntry,
    FileStat,
    ForkResult,
    Lease,
    Limits,
    MemoryUsage,
    NetworkPolicy,
    OutputSpan,
    Paused,
    PidsUsage,
    PreviewUrl,
    PtySize,
    Receipt,
    Run,
    RunFields,
    SandboxFields,
    SandboxInfo,
    SandboxMetrics,
    SandboxNetwork,
    parse,
    parse_list,
)

__all__ = [
    # async
    "AsyncClient", "AsyncCommandHandle", "AsyncCommands", "AsyncFiles", "AsyncJob", "AsyncPty", "AsyncPtyHandle",
    "AsyncSandbox", "call", "capabilities",
    # blocking
    "Client", "CommandHandle", "Commands", "Files", "Job", "Pty", "PtyHandle", "Sandbox",
    # results and options
    "CallResult", "Capabilities", "Checkpoint", "CheckpointInfo", "CommandExit", "CommandFields", "CommandInfo",
    "CommandResult", "CommandsUsage", "Cut", "DiskUsage", "EdgeLoad", "FileEntry", "FileStat", "ForkResult",
    "Lease", "Limits", "MemoryUsage", "NetworkPolicy", "OutputSpan", "Paused", "PidsUsage", "PreviewUrl",
    "PtySize", "Receipt", "Run", "RunFields", "SandboxFields", "SandboxInfo", "SandboxMetrics", "SandboxNetwork",
    # errors
    "ApiError", "AuthError", "CapacityExceeded", "CheckpointNotFound", "CommandExitError", "CommandNotFound",
    "Conflict", "FileAccessDenied", "FileNotFound", "ImageNotFound", "InvalidRequest", "LimitExceeded", "NotFound",
    "QuotaExceeded", "RunNotFound", "SandboxClosed", "SandboxKilled", "SandboxNotFound", "ServiceUnavailable",
    "UnsupportedIsolation",
]

SUPPORTED_ISOLATION = ISOLATIONS  # what some layerbox edge runs; /v1/capabilities says what this one does
CONNECT_TIMEOUT = 30.0  # seconds to reach the service
READ_TIMEOUT = 300.0  # seconds a request may wait for the service's next bytes (not exec streams)
_REQUEST = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT, sock_read=READ_TIMEOUT)
_STREAM = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT, sock_read=None)  # a quiet command is fine
_WEBSOCKET = aiohttp.ClientWSTimeout(ws_receive=None, ws_close=10.0)  # a quiet terminal is fine too
_WEBSOCKET_MESSAGE = 4 << 20  # an output event carries at most 64 KiB (as base64 in JSON)
RECONNECTS = 5  # attempts in a row, with no event between them, to attach a reader again
STDIN_CHUNK = 256 << 10  # bytes of input per request or WebSocket frame (the edge takes 1 MiB at most)
# A terminal's input goes over its WebSocket only if the socket carried something this recently: the
# service drops a socket whose client missed its pings (every 30 s, 15 s to answer), which a blocking
# client does between calls, and input sent into a dropped socket is lost without a word.  Past
# this, input goes by a request, which is answered.
LIVE_SOCKET = 10.0
STREAMS = ("stdout", "stderr")
Params = Mapping[str, str] | Sequence[tuple[str, str]]  # a query (repeated keys as pairs)
H = TypeVar("H", bound="_Attached")  # an async handle (of a background command or a terminal)


# -- HTTP -----------------------------------------------------------------------------------------
class _Http:
    """One HTTP session against one service with one token: every request of the SDK goes through
    :meth:`open`, so every failure becomes an SDK error in one place.

    The aiohttp session is made on the first request (on the loop that runs it), so an object
    can be constructed outside a running loop.  ``sandbox`` is the sandbox a session works on
    once it exists; ``closed`` says why the session was closed, and then no request is sent.
    """

    def __init__(self, url: str, token: str) -> None:
        self.url = url.rstrip("/")
        self._token = token
        self._session: aiohttp.ClientSession | None = None
        self.sandbox: str | None = None
        self.closed: str | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # readers of command output, ended by close()

    def sibling(self) -> _Http:
        """Another session with this one's service and token (for another sandbox: a fork's)."""
        return _Http(self.url, self._token)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``coro`` (a reader of this session's) in the background until it ends or :meth:`close`."""
        if self.closed is not None:
            coro.close()
            raise SandboxClosed(self.closed)
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _live(self) -> aiohttp.ClientSession:
        if self.closed is not None:
            raise SandboxClosed(self.closed)
        if self._session is None:
            self._session = aiohttp.ClientSession(headers={"Authorization": f"Bearer {self._token}"},
                                                  timeout=_REQUEST)
        return self._session

    @contextlib.asynccontextmanager
    async def open(self, method: str, path: str, *, json_body: Any = None, data: Any = None,
                   params: Params | None = None, stream: bool = False
                   ) -> AsyncIterator[aiohttp.ClientResponse]:
        """A successful response (status < 400) to read; an error answer raises its SDK error, no
        answer :class:`ServiceUnavailable`.  ``stream``: no read timeout (an exec stream)."""
        session = self._live()
        try:
            async with session.request(method, self.url + path, json=json_body, data=data, params=params,
                                       timeout=_STREAM if stream else _REQUEST) as r:
                if r.status >= 400:
                    raise from_answer(r.status, await r.read(), retry_after=r.headers.get("Retry-After"),
                                      sandbox=self.sandbox)
                yield r
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
            raise ServiceUnavailable(self.url, f"{method} {path}", exc) from exc

    @contextlib.asynccontextmanager
    async def websocket(self, path: str, *, params: Params, refused: str
                        ) -> AsyncIterator[aiohttp.ClientWebSocketResponse]:
        """A WebSocket to ``path``, closed when the block ends.  A refused handshake raises the SDK error
        that a GET of ``refused`` answers (aiohttp keeps no body of a refused handshake; that route
        checks the same things), no answer :class:`ServiceUnavailable`."""
        session = self._live()
        try:
            ws = await session.ws_connect(self.url + path, params=params, autoping=True, heartbeat=None,
                                          timeout=_WEBSOCKET, max_msg_size=_WEBSOCKET_MESSAGE)
        except aiohttp.WSServerHandshakeError as exc:
            await self.request("GET", refused)  # raises the error the refusal was
            raise from_answer(exc.status, exc.message.encode(), sandbox=self.sandbox) from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
            raise ServiceUnavailable(self.url, f"GET {path} (WebSocket)", exc) from exc
        try:
            yield ws
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
            raise ServiceUnavailable(self.url, f"GET {path} (WebSocket)", exc) from exc
        finally:
            await ws.close()

    async def request(self, method: str, path: str, **kw: Any) -> bytes:
        """The body of a successful answer."""
        async with self.open(method, path, **kw) as r:
            return await r.read()

    async def json(self, method: str, path: str, **kw: Any) -> Any:
        """The JSON body of a successful answer (None for an empty one)."""
        body = await self.request(method, path, **kw)
        try:
            return json.loads(body) if body else None
        except ValueError:
            raise ApiError(502, "bad_response", f"{method} {path}: the answer is not JSON: {body[:200]!r}") from None

    async def close(self, why: str) -> None:
        """Close the session (idempotent; the first reason is kept for :class:`SandboxClosed`)."""
        if self.closed is None:
            self.closed = why
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)  # (never raises: their own errors stay on the tasks)
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()


def _options_body(options: SandboxOptions | None, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON fields of a create: validated by the same model the service uses; unset ones left
    out so the service's defaults apply (its lease ttl, for one)."""
    if options is not None and fields:
        raise TypeError(f"give options or its fields, not both (got {sorted(fields)} too)")
    opts = options if options is not None else SandboxOptions(**fields)
    check_labels("labels", opts.labels, reserved_ok=False)
    given = set(fields) if options is None else {k for k, v in opts.to_json().items() if v is not None}
    return {k: v for k, v in opts.to_json().items() if k in given and v is not None}


def _check_isolation(isolation: str) -> None:
    if isolation not in SUPPORTED_ISOLATION:
        raise UnsupportedIsolation(
            f"isolation={isolation!r} is not available: layerbox runs sandboxes as crun containers or "
            f"QEMU microvms and VMs (supported: {', '.join(SUPPORTED_ISOLATION)}); it never falls back silently")


def _event(line: bytes) -> dict[str, Any]:
    """One event of an exec stream (a JSON object per line)."""
    try:
        event = json.loads(line)
    except ValueError:
        event = None
    if not isinstance(event, dict):
        raise ApiError(502, "bad_response", f"an exec stream line that is not a JSON object: {line[:200]!r}")
    return event


def _chunk(event: Mapping[str, Any]) -> bytes:
    """The output bytes of a ``stdout`` or ``stderr`` event."""
    try:
        return base64.b64decode(event["data"], validate=True)
    except (KeyError, TypeError, ValueError):
        raise ApiError(502, "bad_response", f"a {event.get('type')} event without base64 data") from None


# -- async core -----------------------------------------------------------------------------------
class _Session:
    """An object holding one HTTP session (:class:`_Http`); leaving ``async with`` closes it."""

    _http: _Http

    async def close(self) -> None:
        """Close the HTTP session (subclasses say what that leaves running)."""
        await self._http.close("closed (close())")

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()


_RUN_KEYS = RunFields.__optional_keys__
_FOREGROUND_ONLY = ("idempotency_key", "rerun_if_interrupted", "on_cut")


def _exec_body(cmd: str | Sequence[str] | None, opts: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON of an exec or a background command (or a terminal, whose ``cmd`` may be None: the
    edge's login shell); what is unset is left out, so an older service takes the request too."""
    env, stdin, keep = opts.get("env"), opts.get("stdin"), opts.get("keep", "head")
    body: dict[str, Any] = {
        "cmd": cmd if cmd is None or isinstance(cmd, str) else list(cmd), "timeout": opts.get("timeout"),
        "env": dict(env) if env else None, "cwd": opts.get("cwd"), "output_cap": opts.get("output_cap"),
        "idempotency_key": opts.get("idempotency_key"), "keep": None if keep == "head" else keep,
        "rerun_if_interrupted": True if opts.get("rerun_if_interrupted") else None}
    if stdin is not None:
        raw = stdin.encode() if isinstance(stdin, str) else stdin
        body["stdin"] = base64.b64encode(raw).decode()
    return {k: v for k, v in body.items() if v is not None}


def _shown(argv: Sequence[str]) -> str:
    """A command as its caller wrote it: the shell string of ``/bin/sh -c``, else the argv joined."""
    return argv[2] if len(argv) == 3 and tuple(argv[:2]) == ("/bin/sh", "-c") else " ".join(argv)


class _Printed:
    """A command's output as it arrives: kept per stream, each span between cuts apart (a cut never
    joins the halves of a character), and handed to the callbacks decoded as UTF-8."""

    def __init__(self, on_stdout: Callable[[str], Any] | None, on_stderr: Callable[[str], Any] | None) -> None:
        self._spans = {k: [bytearray()] for k in STREAMS}
        self._decoders = {k: codecs.getincrementaldecoder("utf-8")(errors="replace") for k in STREAMS}
        self._callbacks = {"stdout": on_stdout, "stderr": on_stderr}

    def add(self, stream: str, data: bytes) -> None:
        self._spans[stream][-1] += data
        self._hand(stream, self._decoders[stream].decode(data))

    def cut(self, stream: str) -> None:
        if stream in self._spans:
            self._hand(stream, self._decoders[stream].decode(b"", final=True))
            self._spans[stream].append(bytearray())

    def end(self) -> None:
        for stream in STREAMS:
            self._hand(stream, self._decoders[stream].decode(b"", final=True))

    def text(self, stream: str) -> str:
        return "".join(span.decode(errors="replace") for span in self._spans[stream])

    def _hand(self, stream: str, text: str) -> None:
        callback = self._callbacks[stream]
        if callback is not None and text:
            callback(text)


# -- background commands and terminals, by id ------------------------------------------------------
def _command_path(sb: AsyncSandbox, command_id: str | None = None) -> str:
    return f"/v1/sandboxes/{sb.sandbox_id}/commands" + (f"/{command_id}" if command_id is not None else "")


async def _describe(sb: AsyncSandbox, command_id: str) -> CommandInfo:
    return CommandInfo.from_json(await sb._http.json("GET", _command_path(sb, command_id)))


async def _kill(sb: AsyncSandbox, command_id: str) -> bool:
    doc = await sb._http.json("POST", _command_path(sb, command_id) + "/kill")
    killed = doc.get("killed") if isinstance(doc, Mapping) else None
    if not isinstance(killed, bool):
        raise ApiError(502, "bad_response", f"a kill answer without killed: {str(doc)[:200]}")
    return killed


async def _write(sb: AsyncSandbox, command_id: str, data: str | bytes, *, eof: bool = False) -> None:
    raw = data.encode() if isinstance(data, str) else data
    path = _command_path(sb, command_id) + "/stdin"
    for i in range(0, len(raw), STDIN_CHUNK):
        await sb._http.request("POST", path, json_body={"data": base64.b64encode(raw[i:i + STDIN_CHUNK]).decode()})
    if eof:
        await sb._http.request("POST", path, json_body={"eof": True})


async def _resize(sb: AsyncSandbox, command_id: str, cols: int, rows: int) -> CommandInfo:
    return CommandInfo.from_json(await sb._http.json(
        "POST", _command_path(sb, command_id) + "/resize", json_body={"cols": cols, "rows": rows}))


class _Attached:
    """A handle on a background command or terminal: its ``id``, the output this handle received
    (from the offset it attached at), the reader that receives it, and how the command ended.

    The reader runs in the background from the handle's making until the command's exit event,
    :meth:`disconnect` or the sandbox session's close; it attaches again by itself, from where it
    was, when the connection ends early (RECONNECTS attempts in a row).  ``dropped`` counts output
    the service no longer held when it was read (it keeps each command's most recent output).
    """

    def __init__(self, sb: AsyncSandbox, info: CommandInfo, since: int) -> None:
        self._sb = sb
        self.id = info.id
        self.info = info
        self.dropped = 0
        self._offset = since
        self._final: dict[str, Any] | None = None
        self._failed: BaseException | None = None
        self._reader: asyncio.Task[None] | None = None
        self._attach()

    def _attach(self) -> None:
        if self._final is None and (self._reader is None or self._reader.done()):
            self._failed = None
            self._reader = self._sb._http.spawn(self._read())

    async def _read(self) -> None:
        misses = 0
        while True:
            try:
                async with contextlib.aclosing(self._events(self._offset)) as events:
                    async for event in events:
                        misses = 0
                        self._take(event)
                        if self._final is not None:
                            return
                why: Exception = ServiceUnavailable(self._sb._http.url, f"the output of command {self.id} ended "
                                                    "before its exit event")
            except ServiceUnavailable as exc:
                why = exc
            except ApiError as exc:
                if not exc.retryable:
                    self._failed = exc
                    return
                why = exc
            except Exception as exc:  # SandboxClosed, a malformed event, a callback's own error
                self._failed = exc
                return
            misses += 1
            if misses > RECONNECTS:
                self._failed = why
                return
            await asyncio.sleep(min(2.0, 0.05 * 2 ** misses))

    def _take(self, event: Mapping[str, Any]) -> None:
        kind = event.get("type")
        if kind in STREAMS:
            data = _chunk(event)
            at = event.get("offset")
            end = at + len(data) if isinstance(at, int) else self._offset + len(data)
            if end > self._offset:  # (a reader attached again is sent what it had from its offset on)
                fresh = data[max(0, len(data) - (end - self._offset)):]
                self._offset = end
                self._print(str(kind), fresh)
        elif kind == "dropped":
            n, at = event.get("bytes"), event.get("offset")
            if not isinstance(n, int) or not isinstance(at, int):
                raise ApiError(502, "bad_response", f"a dropped event without offset and bytes: {sorted(event)}")
            self.dropped += n
            self._offset = max(self._offset, at + n)
            self._skipped()
        elif kind in ("exit", "error"):
            self._final = dict(event)
        elif kind == "rejected":
            self._rejected(event)
        # other events (a newer service's) carry nothing this SDK uses: skipped

    async def _ended(self) -> dict[str, Any]:
        """The command's final event once it arrives (an ``error`` one raised as its SDK error)."""
        if self._final is None:
            self._attach()
            assert self._reader is not None
            await asyncio.wait([self._reader])  # a cancelled wait() leaves the reader running
        if self._final is None:
            raise self._failed or SandboxClosed(self._sb._http.closed or f"command {self.id}: this handle was "
                                                "disconnected while waiting")
        if self._final.get("type") == "error":
            err = self._final.get("error") or {}
            raise from_answer(status_of(str(err.get("code"))), err, sandbox=self._sb._http.sandbox)
        return self._final

    async def _detach(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None and not reader.done():
            reader.cancel()
            await asyncio.wait([reader])

    def _events(self, since: int) -> AsyncGenerator[dict[str, Any], None]:
        raise NotImplementedError

    def _print(self, stream: str, data: bytes) -> None:
        raise NotImplementedError

    def _skipped(self) -> None:
        """Output was dropped before this handle read it."""

    def _rejected(self, event: Mapping[str, Any]) -> None:
        """The service refused a message of this handle's (a terminal's input)."""


class AsyncCommandHandle(_Attached):
    """A background command: from ``commands.run(..., background=True)`` or ``commands.connect(id)``.

    ``id`` finds it again (also from another client); ``stdout`` and ``stderr`` are what this
    handle has received so far, and the callbacks get it as it arrives.  The command runs on
    the sandbox whatever the handle does: :meth:`disconnect` only stops listening, :meth:`kill`
    ends it.  ``info`` is how the service described it when the handle was made.
    """

    def __init__(self, sb: AsyncSandbox, info: CommandInfo, *, since: int = 0,
                 on_stdout: Callable[[str], Any] | None = None, on_stderr: Callable[[str], Any] | None = None,
                 check: bool = False, label: str | None = None) -> None:
        self._printed = _Printed(on_stdout, on_stderr)
        self._check = check
        self._label = label if label is not None else _shown(info.command)
        super().__init__(sb, info, since)

    @property
    def stdout(self) -> str:
        """What the command printed to stdout, as far as this handle has received it."""
        return self._printed.text("stdout")

    @property
    def stderr(self) -> str:
        """What the command printed to stderr, as far as this handle has received it."""
        return self._printed.text("stderr")

    async def wait(self) -> CommandResult:
        """Wait for the command to end; its result carries the output this handle received.

        Attaches again first if the handle was disconnected.  With ``check`` (given to ``run``),
        anything but exit 0 raises :class:`CommandExitError`.  A sandbox destroyed meanwhile ends
        the command with ``interrupted: "destroy"``; a service that stays away raises
        :class:`ServiceUnavailable` (the command may still run: wait again later).
        """
        final = await self._ended()
        self._printed.end()
        result = CommandResult.from_exit(final, self.stdout, self.stderr, dropped=self.dropped)
        if self._check and result.exit_code != 0:
            raise CommandExitError(self._label, result)
        return result

    async def kill(self) -> bool:
        """SIGKILL the command's whole process tree; True if it was running (False: it had ended).
        Its end (``interrupted: "killed"``) is what :meth:`wait` returns then."""
        return await _kill(self._sb, self.id)

    async def disconnect(self) -> None:
        """Stop receiving the command's output here; the command runs on, and ``commands.connect(id)``
        (or this handle's :meth:`wait`) attaches again, with the output the service still holds."""
        await self._detach()

    async def send_stdin(self, data: str | bytes) -> None:
        """Write ``data`` (a str as UTF-8) to the command's stdin; a command that does not read it in
        time (or has ended) raises :class:`Conflict` (``retryable`` when it is only slow)."""
        await _write(self._sb, self.id, data)

    async def close_stdin(self) -> None:
        """End the command's stdin (it reads EOF)."""
        await _write(self._sb, self.id, b"", eof=True)

    async def _events(self, since: int) -> AsyncGenerator[dict[str, Any], None]:
        async with self._sb._http.open("GET", _command_path(self._sb, self.id) + "/output",
                                       params={"since": str(since)}, stream=True) as r:
            async for line in r.content:
                if line.strip():
                    yield _event(line)

    def _print(self, stream: str, data: bytes) -> None:
        self._printed.add(stream, data)

    def _skipped(self) -> None:
        for stream in STREAMS:
            self._printed.cut(stream)


class AsyncPtyHandle(_Attached):
    """A terminal: from ``pty.create(...)`` or ``pty.connect(id)``, over one WebSocket.

    ``on_data`` gets the terminal's output (bytes, as the programs on it wrote them, escape
    sequences included) as it arrives; :meth:`send_stdin` types into it over the same socket
    (no request per keystroke).  The session runs on the sandbox whatever the handle does:
    :meth:`disconnect` only stops listening, :meth:`kill` ends it; it also ends when its program
    exits (``exit`` or ^D, ``b"\x04"``, to a shell).
    """

    def __init__(self, sb: AsyncSandbox, info: CommandInfo, *, since: int = 0,
                 on_data: Callable[[bytes], Any] | None = None) -> None:
        self._on_data = on_data
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._heard = 0.0  # time.monotonic() of the socket's last message
        self._open = asyncio.Event()
        self._rejection: ApiError | None = None
        super().__init__(sb, info, since)

    async def send_stdin(self, data: bytes | str) -> None:
        """Type ``data`` (a str as UTF-8) into the terminal: over the WebSocket while it is live (it
        carried output in the last LIVE_SOCKET seconds), else by a request.  Input the service
        refused on the socket (a program not reading it in time) is raised by the next call of
        this method, as its SDK error; by a request, at once."""
        raw = data.encode() if isinstance(data, str) else data
        if self._rejection is not None:
            rejected, self._rejection = self._rejection, None
            raise rejected
        sent = 0
        ws = await self._socket()
        if ws is not None and time.monotonic() - self._heard < LIVE_SOCKET:
            try:
                while sent < len(raw):
                    await ws.send_bytes(raw[sent:sent + STDIN_CHUNK])
                    sent += min(STDIN_CHUNK, len(raw) - sent)
                return
            except (ConnectionError, aiohttp.ClientConnectionError):
                pass  # the socket went down under the send: the rest by a request
        await _write(self._sb, self.id, raw[sent:])

    async def resize(self, cols: int, rows: int) -> None:
        """Give the terminal ``cols`` x ``rows`` cells (1-1000 each); its programs get SIGWINCH."""
        self.info = await _resize(self._sb, self.id, cols, rows)

    async def wait(self) -> CommandExit:
        """Wait for the terminal's program to end (attaching again first if disconnected); how it ended
        (its output went to ``on_data``)."""
        return parse(CommandExit, await self._ended())

    async def kill(self) -> bool:
        """End the terminal's session and what runs on it (SIGKILL); True if it was running."""
        return await _kill(self._sb, self.id)

    async def disconnect(self) -> None:
        """Close this handle's WebSocket; the session runs on.  This handle's :meth:`send_stdin` and
        :meth:`wait` attach again from where it was; ``pty.connect(id)`` replays the screen so far."""
        await self._detach()

    async def _socket(self) -> aiohttp.ClientWebSocketResponse | None:
        """The reader's WebSocket once it is open, or None when there is none to be had (ended)."""
        self._attach()
        if (self._ws is None or self._ws.closed) and self._reader is not None:
            opened = asyncio.ensure_future(self._open.wait())
            await asyncio.wait({opened, self._reader}, return_when=asyncio.FIRST_COMPLETED)
            opened.cancel()
        ws = self._ws
        return ws if ws is not None and not ws.closed else None

    async def _events(self, since: int) -> AsyncGenerator[dict[str, Any], None]:
        path = _command_path(self._sb, self.id)
        async with self._sb._http.websocket(path + "/connect", params={"since": str(since)}, refused=path) as ws:
            self._ws, self._heard = ws, time.monotonic()
            self._open.set()
            try:
                async for msg in ws:  # ends with the socket (the service closes it after the exit event)
                    self._heard = time.monotonic()
                    if msg.type == aiohttp.WSMsgType.TEXT:
                        yield _event(msg.data.encode())
            finally:
                self._open.clear()
                self._ws = None

    def _print(self, stream: str, data: bytes) -> None:
        if self._on_data is not None:
            self._on_data(data)

    def _rejected(self, event: Mapping[str, Any]) -> None:
        err = event.get("error")
        err = err if isinstance(err, Mapping) else {}
        self._rejection = from_answer(status_of(str(err.get("code"))), err, sandbox=self._sb._http.sandbox)


class AsyncCommands:
    """Commands in one sandbox (``sandbox.commands``): run to their end, or in the background."""

    def __init__(self, sb: AsyncSandbox) -> None:
        self._sb = sb

    @overload
    async def run(self, cmd: str | Sequence[str], *, background: Literal[False] = False,
                  **fields: Unpack[RunFields]) -> CommandResult: ...
    @overload
    async def run(self, cmd: str | Sequence[str], *, background: Literal[True],
                  **fields: Unpack[CommandFields]) -> AsyncCommandHandle: ...
    @overload
    async def run(self, cmd: str | Sequence[str], *, background: bool,
                  **fields: Unpack[RunFields]) -> CommandResult | AsyncCommandHandle: ...

    async def run(self, cmd: str | Sequence[str], *, background: bool = False,
                  **fields: Unpack[RunFields]) -> CommandResult | AsyncCommandHandle:
        """Run ``cmd`` (a string goes through ``/bin/sh -c``); callbacks get decoded output as it arrives.

        The keywords are :class:`~sandbox.sdk.types.RunFields`: ``on_stdout``, ``on_stderr``,
        ``timeout``, ``env``, ``cwd``, ``stdin``, ``output_cap``, ``keep``, ``check``, and for a
        foreground command ``idempotency_key``, ``rerun_if_interrupted``, ``on_cut``.

        A non-zero exit is reported in ``exit_code``, not raised, unless ``check``: then
        anything but exit 0 raises :class:`CommandExitError` carrying the result.  A
        ``timeout`` kills the command tree and sets ``timed_out``.  Past ``output_cap`` bytes a
        stream is cut (``keep="tail"``: its last ``output_cap`` bytes follow once the command
        ends); the result's ``cuts`` say where, and ``on_cut`` hears each as it comes.  With an
        ``idempotency_key``, retrying (also after a preempted job was resumed elsewhere)
        returns the first run's result instead of running again; ``rerun_if_interrupted``
        runs it again instead when that first run was cut short.  Leaving the stream early
        (cancelling this coroutine) kills the command.  A sandbox destroyed meanwhile ends the
        command by SIGKILL (``signal`` 9) and its next request raises :class:`SandboxKilled`;
        a service that goes away mid-command raises :class:`ServiceUnavailable`.

        ``background=True`` returns as soon as the command runs, with an
        :class:`AsyncCommandHandle` (``wait()`` for its result, ``check`` applying there): the
        command outlives this client, takes input (``send_stdin``), and is found again by its
        id (:meth:`connect`, :meth:`list`).  It has no idempotency key, so the foreground-only
        keywords are a ``TypeError``; too many running in the sandbox is :class:`LimitExceeded`.
        """
        opts: dict[str, Any] = dict(fields)
        unknown = sorted(set(opts) - _RUN_KEYS)
        if unknown:
            raise TypeError(f"commands.run() got unexpected keyword arguments {unknown} "
                            f"(it takes {', '.join(sorted(_RUN_KEYS))})")
        if background:
            given = [k for k in _FOREGROUND_ONLY if opts.get(k)]
            if given:
                raise TypeError(f"{', '.join(given)}: not for a background command (it runs once, found again "
                                "by its id)")
            doc = await self._sb._http.json("POST", _command_path(self._sb), json_body=_exec_body(cmd, opts))
            return AsyncCommandHandle(self._sb, CommandInfo.from_json(doc), on_stdout=opts.get("on_stdout"),
                                      on_stderr=opts.get("on_stderr"), check=bool(opts.get("check")),
                                      label=cmd if isinstance(cmd, str) else " ".join(cmd))
        return await self._run(cmd, opts)

    async def _run(self, cmd: str | Sequence[str], opts: Mapping[str, Any]) -> CommandResult:
        http = self._sb._http
        printed = _Printed(opts.get("on_stdout"), opts.get("on_stderr"))
        on_cut: Callable[[Cut], Any] | None = opts.get("on_cut")
        cuts: list[Cut] = []
        final: dict[str, Any] | None = None
        path = f"/v1/sandboxes/{self._sb.sandbox_id}/exec"
        async with http.open("POST", path, json_body=_exec_body(cmd, opts), stream=True) as r:
            async for line in r.content:
                if not line.strip():
                    continue
                event = _event(line)
                kind = event.get("type")
                if kind in STREAMS:
                    printed.add(str(kind), _chunk(event))
                elif kind == "truncated":
                    cut = parse(Cut, event)
                    cuts.append(cut)
                    printed.cut(cut.stream)
                    if on_cut is not None:
                        on_cut(cut)
                elif kind in ("exit", "error"):
                    final = event
                # other events (a newer service's) carry nothing this SDK uses: skipped
        if final is None:
            raise ServiceUnavailable(http.url, f"POST {path}: the stream ended before the command's exit event "
                                     "(the command may have run; an idempotency_key makes a retry safe)")
        if final["type"] == "error":
            err = final.get("error") or {}
            raise from_answer(status_of(str(err.get("code"))), err, sandbox=http.sandbox)
        printed.end()
        result = CommandResult.from_exit(final, printed.text("stdout"), printed.text("stderr"), cuts=cuts)
        if opts.get("check") and result.exit_code != 0:
            raise CommandExitError(cmd if isinstance(cmd, str) else " ".join(cmd), result)
        return result

    async def list(self) -> builtins.list[CommandInfo]:
        """The sandbox's background commands and terminals, running and recently ended, oldest first."""
        return parse_list(CommandInfo, await self._sb._http.json("GET", _command_path(self._sb)), "commands")

    async def connect(self, command_id: str, *, on_stdout: Callable[[str], Any] | None = None,
                      on_stderr: Callable[[str], Any] | None = None, since: int = 0) -> AsyncCommandHandle:
        """Attach to the background command ``command_id`` (started by this client or another): its
        output from offset ``since`` (both streams counted together) as far as the service still
        holds it, then live.  :class:`CommandNotFound` if the sandbox has none by that id."""
        info = await _describe(self._sb, command_id)
        return AsyncCommandHandle(self._sb, info, since=since, on_stdout=on_stdout, on_stderr=on_stderr)

    async def kill(self, command_id: str) -> bool:
        """SIGKILL the background command's whole process tree; True if it was running (False: it had
        ended).  :class:`CommandNotFound` if the sandbox has none by that id."""
        return await _kill(self._sb, command_id)

    async def send_stdin(self, command_id: str, data: str | bytes) -> None:
        """Write ``data`` (a str as UTF-8) to a background command's stdin (see
        :meth:`AsyncCommandHandle.send_stdin`)."""
        await _write(self._sb, command_id, data)

    async def close_stdin(self, command_id: str) -> None:
        """End a background command's stdin (it reads EOF)."""
        await _write(self._sb, command_id, b"", eof=True)


class AsyncPty:
    """Terminals in one sandbox (``sandbox.pty``): a program on a pseudo-terminal of the sandbox's
    own, attached over a WebSocket; the session outlives the client, as a background command does."""

    def __init__(self, sb: AsyncSandbox) -> None:
        self._sb = sb

    async def create(self, cols: int = 80, rows: int = 24, *, on_data: Callable[[bytes], Any] | None = None,
                     cmd: str | Sequence[str] | None = None, env: Mapping[str, str] | None = None,
                     cwd: str | None = None,
                     timeout: float | None = None) -> AsyncPtyHandle:  # noqa: ASYNC109 (the session's limit)
        """Open a terminal of ``cols`` x ``rows`` running ``cmd`` (default: the image's bash, else its
        sh, as a login shell; ``TERM`` is ``xterm-256color`` unless ``env`` says otherwise), and
        attach to it.  ``timeout`` seconds end the session.  Too many terminals open in the
        sandbox is :class:`LimitExceeded`."""
        body = {**_exec_body(cmd, {"env": env, "cwd": cwd, "timeout": timeout}), "pty": {"cols": cols, "rows": rows}}
        doc = await self._sb._http.json("POST", _command_path(self._sb), json_body=body)
        return AsyncPtyHandle(self._sb, CommandInfo.from_json(doc), on_data=on_data)

    async def connect(self, command_id: str, *, on_data: Callable[[bytes], Any] | None = None,
                      since: int = 0) -> AsyncPtyHandle:
        """Attach to the terminal ``command_id``: its output from offset ``since`` as far as the
        service still holds it (the screen so far), then live.  :class:`CommandNotFound` if the
        sandbox has none by that id."""
        info = await _describe(self._sb, command_id)
        return AsyncPtyHandle(self._sb, info, since=since, on_data=on_data)

    async def send_stdin(self, command_id: str, data: bytes | str) -> None:
        """Type ``data`` into the terminal ``command_id`` (by a request; a handle uses its socket)."""
        await _write(self._sb, command_id, data)

    async def resize(self, command_id: str, cols: int, rows: int) -> None:
        """Give the terminal ``command_id`` ``cols`` x ``rows`` cells (1-1000 each)."""
        await _resize(self._sb, command_id, cols, rows)

    async def kill(self, command_id: str) -> bool:
        """End the terminal ``command_id`` and what runs on it (SIGKILL); True if it was running."""
        return await _kill(self._sb, command_id)


class AsyncFiles:
    """Files in one sandbox (``sandbox.backends.container.files``): paths are absolute and resolved inside its root."""

    def __init__(self, sb: AsyncSandbox) -> None:
        self._sb = sb

    @property
    def _base(self) -> str:
        return f"/v1/sandboxes/{self._sb.sandbox_id}/files"

    @overload
    async def read(self, path: str, *, format: Literal["text"] = "text") -> str: ...
    @overload
    async def read(self, path: str, *, format: Literal["bytes"]) -> bytes: ...

    async def read(self, path: str, *, format: Literal["text", "bytes"] = "text") -> str | bytes:
        """The whole file at ``path``, decoded as UTF-8 (``format="bytes"``: as bytes).

        :class:`FileNotFound` if it does not exist, :class:`FileAccessDenied` if the path
        leaves the sandbox (through /proc or a magic link).
        """
        data = await self._sb._http.request("GET", self._base, params={"path": path})
        return data if format == "bytes" else data.decode()

    async def write(self, path: str, data: str | bytes, *, mode: int = 0o644) -> None:
        """Create or replace the file at ``path`` with ``data`` (a str is written as UTF-8)."""
        raw = data.encode() if isinstance(data, str) else data
        await self._sb._http.request("PUT", self._base, data=raw, params={"path": path, "mode": f"{mode:o}"})

    async def upload(self, path: str, src: str | os.PathLike[str] | BinaryIO, *, mode: int = 0o644) -> int:
        """Stream a local file (a path or a binary file object) of any size into the sandbox; returns its size."""
        params = {"path": path, "mode": f"{mode:o}"}
        http = self._sb._http
        if isinstance(src, (str, os.PathLike)):
            async with aiofiles.open(src, "rb") as f:
                async def chunks() -> AsyncIterator[bytes]:
                    while data := await f.read(1 << 20):
                        yield data
                doc = await http.json("PUT", self._base, data=chunks(), params=params)
        else:
            doc = await http.json("PUT", self._base, data=src, params=params)  # aiohttp streams it
        return int(doc["bytes"])

    async def download(self, path: str, dst: str | os.PathLike[str] | BinaryIO) -> int:
        """Stream a sandbox file of any size to a local path or binary file object; returns its size."""
        total = 0
        async with self._sb._http.open("GET", self._base, params={"path": path}, stream=True) as r:
            if isinstance(dst, (str, os.PathLike)):
                async with aiofiles.open(dst, "wb") as f:
                    async for chunk in r.content.iter_chunked(1 << 20):
                        await f.write(chunk)
                        total += len(chunk)
            else:
                async for chunk in r.content.iter_chunked(1 << 20):
                    dst.write(chunk)
                    total += len(chunk)
        return total

    async def stat(self, path: str) -> FileStat:
        """Type, size, mode, owner and mtime of one entry (a symlink is reported, not followed)."""
        return parse(FileStat, await self._sb._http.json("GET", self._base, params={"path": path, "stat": "1"}))

    async def exists(self, path: str) -> bool:
        """Whether ``path`` exists in the sandbox (a sandbox that is gone still raises)."""
        try:
            await self.stat(path)
        except FileNotFound:
            return False
        return True

    async def list(self, path: str = "/") -> builtins.list[FileEntry]:
        """The entries of the directory ``path``, sorted by name."""
        doc = await self._sb._http.json("GET", self._base, params={"path": path, "list": "1"})
        return [parse(FileEntry, e) for e in doc["entries"]]

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove a file, a symlink or an empty directory (``recursive``: a whole tree)."""
        await self._sb._http.request("DELETE", self._base,
                                     params={"path": path, "recursive": "1" if recursive else "0"})


class AsyncSandbox(_Session):
    """A sandbox on a layerbox service; get one with :meth:`create`, :meth:`restore` or :meth:`connect`.

    ``info`` is what the service last said about it (:meth:`refresh` asks again),
    ``commands`` runs commands, ``files`` reads and writes files.  Leaving ``async with``
    kills the sandbox; after :meth:`kill` or :meth:`close` every method raises
    :class:`SandboxClosed`.  A sandbox destroyed by someone else (its ttl, lease, another
    client) answers every request with :class:`SandboxKilled`.
    """

    def __init__(self, http: _Http, info: SandboxInfo) -> None:
        self._http = http
        http.sandbox = info.id
        self._killed = False
        self.info = info
        self.sandbox_id: str = info.id
        self.commands = AsyncCommands(self)
        self.files = AsyncFiles(self)
        self.pty = AsyncPty(self)

    @classmethod
    async def create(cls, image: str, *, url: str, token: str, isolation: str = "container",
                     options: SandboxOptions | None = None, **fields: Unpack[SandboxFields]) -> AsyncSandbox:
        """Start a sandbox on ``image`` (an image, composition or checkpoint of your project).

        ``options`` is a :class:`~sandbox.core.model.SandboxOptions`, or give its fields as
        keywords (:class:`~sandbox.sdk.types.SandboxFields`: ``cpu``, ``memory``, ``pids``,
        ``disk``, ``cpu_class``, ``env``, ``workdir``, ``user``, ``labels``, ``ttl``,
        ``idle_timeout``, ``job``, ``lease_ttl``, ``network``, ``userns``,
        ``policy_version``): they are checked here as the service checks them, so a typo is
        a ``TypeError`` and a bad value an :class:`~sandbox.core.errors.InvalidField` before any
        request.  ``job`` names the caller's lease (renewed by every request on the job's
        sandboxes and by :meth:`AsyncJob.renew`); when it lapses for ``lease_ttl`` seconds
        the service destroys the job's sandboxes.  ``network`` is a list of egress allow rules.

        Raises :class:`ImageNotFound` for a ref that does not resolve, :class:`QuotaExceeded`
        or :class:`CapacityExceeded` (with ``retry_after``) when it cannot be admitted now,
        :class:`InvalidRequest` for a value past this service's limits; nothing is created then.
        """
        _check_isolation(isolation)  # before any request
        body = _options_body(options, fields)
        wanted = isolation if isolation != "container" else body.get("isolation", "container")
        if wanted != "container":  # refused here when this edge lacks it, with its reason
            caps = await capabilities(url=url, token=token)
            if wanted not in caps.isolation:
                why = (caps.backends.get(wanted) or {}).get("reason", "the edge does not list it")
                raise UnsupportedIsolation(f"isolation={wanted!r} is not available at {url}: {why}")
            if body.get("kernel") == "image" and "image_kernel" not in (caps.backends.get(wanted) or {}).get(
                    "provides", ()):
                raise UnsupportedIsolation(f"kernel='image' is not available for isolation={wanted!r} at {url}")
        if isolation != "container" or "isolation" not in body:  # the argument, unless options say microvm
            body["isolation"] = isolation
        body = {"image": image, **body}
        return await cls._post(url, token, "/v1/sandboxes", body)

    @classmethod
    async def restore(cls, checkpoint: str, *, url: str, token: str, options: SandboxOptions | None = None,
                      **fields: Unpack[SandboxFields]) -> AsyncSandbox:
        """A new sandbox from ``checkpoint`` (made on any host of the same store), with the options its
        sandbox had and the ones given here over them (``policy_version`` must match the checkpoint's
        when given).  :class:`CheckpointNotFound` for a checkpoint that does not resolve."""
        body = {"checkpoint": checkpoint, **_options_body(options, fields)}
        return await cls._post(url, token, "/v1/sandboxes/restore", body)

    @classmethod
    async def restore_many(cls, checkpoint: str, count: int, *, url: str, token: str,
                           options: SandboxOptions | None = None,
                           **fields: Unpack[SandboxFields]) -> builtins.list[AsyncSandbox]:
        """``count`` new sandboxes from ``checkpoint``, as :meth:`restore` makes one: quota and room are
        checked for all of them first, and either all are running when this returns or none is
        left (:class:`QuotaExceeded`, :class:`CapacityExceeded`, :class:`InvalidRequest` past the
        edge's most per request).  Each is its own session, to kill or close apart."""
        body = {"checkpoint": checkpoint, "count": count, **_options_body(options, fields)}
        http = _Http(url, token)
        try:
            doc = await http.json("POST", "/v1/sandboxes/restore", json_body=body)
        finally:
            await http.close("the restore is done")
        return [cls(http.sibling(), info) for info in parse_list(SandboxInfo, doc, "sandboxes")]

    @classmethod
    async def list(cls, *, url: str, token: str, labels: Mapping[str, str] | None = None,
                   state: Status | None = None) -> builtins.list[SandboxInfo]:
        """The project's sandboxes that have every one of ``labels`` and, if given, the status ``state``
        (``running``, ``paused``...).  The filter is checked here as the service checks it."""
        query = SandboxFilter(dict(labels or {}), state).to_query()  # InvalidField before any request
        async with AsyncClient(url=url, token=token) as client:
            return parse_list(SandboxInfo, await client._http.json("GET", "/v1/sandboxes", params=query),
                              "sandboxes")

    @classmethod
    async def _post(cls, url: str, token: str, path: str, body: Mapping[str, Any]) -> AsyncSandbox:
        http = _Http(url, token)
        try:
            info = parse(SandboxInfo, await http.json("POST", path, json_body=body))
        except BaseException:
            await http.close("the create failed")
            raise
        return cls(http, info)

    @classmethod
    async def connect(cls, sandbox_id: str, *, url: str, token: str) -> AsyncSandbox:
        """Attach to an existing sandbox of this token's project, resuming it when paused.

        :class:`SandboxNotFound` if there is none by that id in the project.
        """
        http = _Http(url, token)
        try:
            info = parse(SandboxInfo, await http.json("GET", f"/v1/sandboxes/{sandbox_id}"))
            if info.status == "paused":
                info = parse(SandboxInfo, await http.json("POST", f"/v1/sandboxes/{sandbox_id}/resume"))
        except BaseException:
            await http.close("the connect failed")
            raise
        return cls(http, info)

    @property
    def _path(self) -> str:
        return f"/v1/sandboxes/{self.sandbox_id}"

    async def refresh(self) -> SandboxInfo:
        """Ask the service about the sandbox again; updates and returns ``info``."""
        self.info = parse(SandboxInfo, await self._http.json("GET", self._path))
        return self.info

    async def pause(self) -> Paused:
        """Freeze the sandbox (reclaiming its memory); :meth:`connect` or :meth:`resume` thaws it."""
        return Paused.from_json(await self._http.json("POST", self._path + "/pause"))

    async def resume(self) -> SandboxInfo:
        """Thaw a paused sandbox; updates and returns ``info``."""
        self.info = parse(SandboxInfo, await self._http.json("POST", self._path + "/resume"))
        return self.info

    async def checkpoint(self, *, name: str | None = None, labels: Mapping[str, str] | None = None,
                         memory: bool = False) -> Checkpoint:
        """Snapshot the sandbox's filesystem to the store; restore it anywhere with :meth:`restore`
        by the returned ``name`` (``name`` given: a ref in your project's namespace).  ``memory``
        (microVMs): its processes too, which a restore on an edge of the same QEMU and guest
        assets continues."""
        body: dict[str, Any] = {"name": name, "labels": dict(labels or {})}
        if memory:
            body["memory"] = True
        return parse(Checkpoint, await self._http.json("POST", self._path + "/checkpoint", json_body=body))

    async def receipts(self, *, action: str | None = None, since: float | None = None,
                       idempotency_key: str | None = None) -> builtins.list[Receipt]:
        """Actions recorded for this sandbox (and the checkpoint it was restored from), oldest first,
        filtered by ``action``, ``since`` (Unix time) and ``idempotency_key``."""
        params = {k: str(v) for k, v in {"action": action, "since": since,
                                         "idempotency_key": idempotency_key}.items() if v is not None}
        doc = await self._http.json("GET", self._path + "/receipts", params=params)
        return [Receipt.from_json(r) for r in doc["receipts"]]

    async def set_network(self, rules: Sequence[EgressRule | Mapping[str, Any]]) -> NetworkPolicy:
        """Replace the egress allow rules (default deny) while the sandbox runs; returns the policy in force."""
        checked = parse_rules(rules, "rules")  # the model's check, before any request
        return parse(NetworkPolicy, await self._http.json(
            "PUT", self._path + "/network", json_body={"rules": [r.to_dict() for r in checked]}))

    async def fork(self, count: int = 1, *, options: SandboxOptions | None = None,
                   **fields: Unpack[SandboxFields]) -> ForkResult[AsyncSandbox]:
        """``count`` new sandboxes that continue from this one's files as they are now (one checkpoint,
        restored ``count`` times on this edge; processes are not carried).

        They start with this sandbox's options (env, workdir, user, limits, labels, network,
        policy version) and the ones given here over them, and are independent of it and of
        each other from then on.  Quota and room are checked for all of them first: either every
        fork is running when this returns or none is left.  Each is its own session (leaving
        this sandbox's ``with`` block kills only this one); the checkpoint is an ordinary one of
        the project, restorable again and listed by :meth:`AsyncClient.checkpoints`: forks on
        other edges are ``AsyncSandbox.restore(result.checkpoint.name, url=<edge>, count=n)``.
        """
        body = {"count": count, **_options_body(options, fields)}
        doc = await self._http.json("POST", self._path + "/fork", json_body=body)
        forks = tuple(AsyncSandbox(self._http.sibling(), info) for info in parse_list(SandboxInfo, doc, "sandboxes"))
        return ForkResult(forks, parse(Checkpoint, doc.get("checkpoint")), str(doc.get("source", self.sandbox_id)))

    async def set_timeout(self, seconds: float) -> SandboxInfo:
        """Destroy the sandbox ``seconds`` from now instead of when its ttl said (longer or shorter); its
        age plus ``seconds`` must stay within the edge's longest lifetime (:class:`InvalidRequest`
        naming ``ttl``).  Updates and returns ``info`` (``ttl``, ``expires``)."""
        self.info = parse(SandboxInfo, await self._http.json("POST", self._path + "/ttl",
                                                             json_body={"ttl": seconds}))
        return self.info

    async def get_metrics(self) -> SandboxMetrics:
        """What the sandbox uses now: CPU seconds, memory (now, peak, limit), pids, the bytes its writes
        take, and its commands' totals."""
        return parse(SandboxMetrics, await self._http.json("GET", self._path + "/metrics"))

    def port_url(self, port: int, path: str = "/") -> str:
        """The URL of ``path`` on the server the sandbox runs on ``127.0.0.1:port`` (inside it), through
        the service: requests to it need this project's token (``Authorization: Bearer``), which
        the service does not pass on.  Built here, without a request; see :meth:`preview_url` for
        a URL that needs no token."""
        check_int("port", port, 1, 65535)
        tail = path[1:] if path.startswith("/") else path
        return f"{self._http.url}{self._path}/ports/{port}/proxy/{tail}"

    async def preview_url(self, port: int, *, ttl: float | None = None) -> PreviewUrl:
        """A signed URL to the sandbox's ``port`` that anyone can use without a token, for ``ttl`` seconds
        (the service's default, 300, when None; at most 3600).  Its ``url`` is on the service's
        address as this client reaches it (``path`` is the part after it)."""
        check_int("port", port, 1, 65535)
        doc = await self._http.json("POST", f"{self._path}/ports/{port}/url",
                                    json_body={} if ttl is None else {"ttl": ttl})
        preview = parse(PreviewUrl, doc)
        return dataclasses.replace(preview, url=self._http.url + preview.path)

    async def kill(self) -> None:
        """Destroy the sandbox and close this session (a sandbox already gone is fine; a second kill
        does nothing).  If the service cannot be reached the session is closed all the same and the
        sandbox may still run: :meth:`connect` to it later and kill it again."""
        if self._killed:
            return
        was_open = self._http.closed is None
        why = (f"sandbox {self.sandbox_id} was killed by this session (kill() or the end of its with block); "
               "create, restore or connect to another one")
        try:
            await self._http.request("DELETE", self._path)
        except SandboxNotFound:
            pass
        except BaseException as exc:
            why = (f"kill() of sandbox {self.sandbox_id} failed ({type(exc).__name__}) and closed this session; "
                   f"the sandbox may still run: connect({self.sandbox_id!r}) and kill it again")
            raise
        finally:
            self._killed = was_open
            await self._http.close(why)

    async def close(self) -> None:
        """Close the HTTP session; the sandbox keeps running (until its ttl or lease) and :meth:`connect`
        attaches to it again."""
        await self._http.close(f"sandbox {self.sandbox_id}: this session was closed (close()); the sandbox "
                               f"keeps running and connect({self.sandbox_id!r}) attaches to it again")

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._http.closed is None:  # close() inside the block: the caller keeps the sandbox
            await self.kill()


class AsyncJob(_Session):
    """All sandboxes of one job at once: the lease, pause/resume, and preemption."""

    def __init__(self, job: str, *, url: str, token: str) -> None:
        self.job = check_job(job)
        self._http = _Http(url, token)
        self._base = f"/v1/jobs/{job}"

    async def renew(self, ttl: float | None = None) -> Lease:
        """Renew the job's lease (for ``ttl`` seconds, default the one it has); returns it."""
        return parse(Lease, await self._http.json("POST", self._base + "/renew", json_body={"ttl": ttl}))

    async def pause(self) -> list[str]:
        """Freeze every running sandbox of the job; returns their ids."""
        return list((await self._http.json("POST", self._base + "/pause"))["sandboxes"])

    async def resume(self) -> list[str]:
        """Thaw every paused sandbox of the job; returns their ids."""
        return list((await self._http.json("POST", self._base + "/resume"))["sandboxes"])

    async def preempt(self, *, grace: float = 30.0) -> Run:
        """Checkpoint every sandbox of the job into a run manifest and free the host; returns the run
        (``sandboxes``: id -> checkpoint).  Commands get ``grace`` seconds to finish."""
        return parse(Run, await self._http.json("POST", self._base + "/preempt", json_body={"timeout": grace}))

    @staticmethod
    async def resume_run(manifest: str, *, url: str, token: str) -> Run:
        """Restore a preempted job (on the service at ``url``); returns the run with ``sandboxes``: old id ->
        new id.  :class:`RunNotFound` for a manifest that does not resolve; quota and capacity are
        checked for the whole job first, so nothing is half-restored."""
        async with AsyncClient(url=url, token=token) as client:
            return parse(Run, await client._http.json("POST", "/v1/runs/resume", json_body={"manifest": manifest}))

    async def close(self) -> None:
        """Close the HTTP session (the job's sandboxes and lease are unaffected)."""
        await self._http.close(f"job {self.job}: this handle was closed (close()); make a new one")


class AsyncClient(_Session):
    """The service itself, for what belongs to no sandbox: its capabilities, its load report, FnCall."""

    def __init__(self, *, url: str, token: str) -> None:
        self.url = url.rstrip("/")
        self._http = _Http(url, token)

    async def capabilities(self) -> Capabilities:
        """What the service provides (isolation kinds, limits, network, checkpoint kinds)."""
        return parse(Capabilities, await self._http.json("GET", "/v1/capabilities"))

    async def load(self) -> EdgeLoad:
        """The edge's load report (what placement chooses by)."""
        return parse(EdgeLoad, await self._http.json("GET", "/v1/load"))

    async def checkpoints(self) -> list[CheckpointInfo]:
        """The project's checkpoints (named ones, forks', preempted jobs'), oldest first."""
        return parse_list(CheckpointInfo, await self._http.json("GET", "/v1/checkpoints"), "checkpoints")

    async def delete_checkpoint(self, name: str) -> None:
        """Delete the checkpoint ``name`` (as :meth:`checkpoints` lists it): its ref goes at once, its
        data with the store's next gc unless something else holds it (a sandbox running on it, a
        run manifest).  :class:`CheckpointNotFound` for one that does not resolve or is not this
        project's."""
        await self._http.request("DELETE", "/v1/checkpoints/" + urllib.parse.quote(name, safe="/:@"))

    async def call(self, image: str, cmd: str | Sequence[str] | None = None, *, function: str | None = None,
                   args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
                   timeout: float = 30.0) -> CallResult:  # noqa: ASYNC109 (the call's limit, enforced there)
        """A short stateless call on a warm container of ``image`` (a fresh writable layer each time).

        Give ``cmd`` (a string goes through ``/bin/sh -c``) or ``function``, Python source whose
        last top-level function is called with ``args`` and ``kwargs`` (JSON values); its return
        value comes back in ``value``, an exception in ``error``.  :class:`ImageNotFound` for an
        image that does not resolve (no warm pool is made for it).
        """
        body = {"image": image, "cmd": cmd if cmd is None or isinstance(cmd, str) else list(cmd),
                "function": function, "args": list(args), "kwargs": dict(kwargs or {}), "timeout": timeout}
        return CallResult.from_json(await self._http.json(
            "POST", "/v1/calls", json_body={k: v for k, v in body.items() if v is not None}))

    async def close(self) -> None:
        """Close the HTTP session."""
        await self._http.close(f"the client of {self.url} was closed (close()); make a new one")


async def capabilities(*, url: str, token: str) -> Capabilities:
    """One-shot :meth:`AsyncClient.capabilities`: what the service at ``url`` provides."""
    async with AsyncClient(url=url, token=token) as client:
        return await client.capabilities()


async def call(image: str, cmd: str | Sequence[str] | None = None, *, url: str, token: str,
               function: str | None = None, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
               timeout: float = 30.0) -> CallResult:  # noqa: ASYNC109 (the call's limit, enforced there)
    """One-shot :meth:`AsyncClient.call`: a short stateless call on a warm container of ``image``."""
    async with AsyncClient(url=url, token=token) as client:
        return await client.call(image, cmd, function=function, args=args, kwargs=kwargs, timeout=timeout)


# -- the blocking twins (sandbox.sdk.blocking: every method is its async twin's, awaited) ----------
class _Handle(Part[H]):
    """What the blocking twins of both handles expose besides their methods."""

    @property
    def id(self) -> str:
        """The command's (or terminal's) id: ``cmd-`` and 12 hex digits."""
        return self._inner.id

    @property
    def info(self) -> CommandInfo:
        """How the service described the command when this handle was made (or last resized it)."""
        return self._inner.info


class CommandHandle(_Handle[AsyncCommandHandle], twin=AsyncCommandHandle):
    """The blocking twin of :class:`AsyncCommandHandle`, on its sandbox's loop: output arrives (and the
    callbacks run, on the calling thread) while a call on that sandbox runs, :meth:`wait` above all."""

    @property
    def stdout(self) -> str:
        """What the command printed to stdout, as far as this handle has received it."""
        return self._inner.stdout

    @property
    def stderr(self) -> str:
        """What the command printed to stderr, as far as this handle has received it."""
        return self._inner.stderr

    @property
    def dropped(self) -> int:
        """Bytes of output the service no longer held when this handle read it."""
        return self._inner.dropped

    wait = blocking(AsyncCommandHandle.wait)
    kill = blocking(AsyncCommandHandle.kill)
    send_stdin = blocking(AsyncCommandHandle.send_stdin)
    close_stdin = blocking(AsyncCommandHandle.close_stdin)
    disconnect = blocking(AsyncCommandHandle.disconnect)


class PtyHandle(_Handle[AsyncPtyHandle], twin=AsyncPtyHandle):
    """The blocking twin of :class:`AsyncPtyHandle`, on its sandbox's loop: output arrives (and
    ``on_data`` runs, on the calling thread) while a call on that sandbox runs."""

    send_stdin = blocking(AsyncPtyHandle.send_stdin)
    resize = blocking(AsyncPtyHandle.resize)
    wait = blocking(AsyncPtyHandle.wait)
    kill = blocking(AsyncPtyHandle.kill)
    disconnect = blocking(AsyncPtyHandle.disconnect)


def _command_handle(loop: Loop, handle: AsyncCommandHandle) -> CommandHandle:
    return CommandHandle._wrap(loop, handle)


def _pty_handle(loop: Loop, handle: AsyncPtyHandle) -> PtyHandle:
    return PtyHandle._wrap(loop, handle)


class Commands(Part[AsyncCommands], twin=AsyncCommands):
    """The blocking twin of :class:`AsyncCommands`; callbacks run on the calling thread."""

    @overload
    def run(self, cmd: str | Sequence[str], *, background: Literal[False] = False,
            **fields: Unpack[RunFields]) -> CommandResult: ...
    @overload
    def run(self, cmd: str | Sequence[str], *, background: Literal[True],
            **fields: Unpack[CommandFields]) -> CommandHandle: ...
    @overload
    def run(self, cmd: str | Sequence[str], *, background: bool,
            **fields: Unpack[RunFields]) -> CommandResult | CommandHandle: ...

    @twin_of(AsyncCommands.run)
    def run(self, cmd: str | Sequence[str], *, background: bool = False,
            **fields: Unpack[RunFields]) -> CommandResult | CommandHandle:
        got = self._loop.run(lambda: self._inner.run(cmd, background=background, **fields))
        return CommandHandle._wrap(self._loop, got) if isinstance(got, AsyncCommandHandle) else got

    list = blocking(AsyncCommands.list)
    connect = handing_out(AsyncCommands.connect, _command_handle)
    kill = blocking(AsyncCommands.kill)
    send_stdin = blocking(AsyncCommands.send_stdin)
    close_stdin = blocking(AsyncCommands.close_stdin)


class Pty(Part[AsyncPty], twin=AsyncPty):
    """The blocking twin of :class:`AsyncPty`."""

    create = handing_out(AsyncPty.create, _pty_handle)
    connect = handing_out(AsyncPty.connect, _pty_handle)
    send_stdin = blocking(AsyncPty.send_stdin)
    resize = blocking(AsyncPty.resize)
    kill = blocking(AsyncPty.kill)


class Files(Part[AsyncFiles], twin=AsyncFiles):
    """The blocking twin of :class:`AsyncFiles`."""

    read = blocking(AsyncFiles.read)
    write = blocking(AsyncFiles.write)
    upload = blocking(AsyncFiles.upload)
    download = blocking(AsyncFiles.download)
    stat = blocking(AsyncFiles.stat)
    exists = blocking(AsyncFiles.exists)
    list = blocking(AsyncFiles.list)
    remove = blocking(AsyncFiles.remove)


def _forks(loop: Loop, forked: ForkResult[AsyncSandbox]) -> ForkResult[Sandbox]:
    """The forks as blocking sandboxes, each on a loop of its own (each is killed or closed apart)."""
    return ForkResult(tuple(Sandbox._wrap(Loop(), s) for s in forked.sandboxes), forked.checkpoint, forked.source)


class Sandbox(Blocking[AsyncSandbox], twin=AsyncSandbox):
    """The blocking twin of :class:`AsyncSandbox`: the same methods, parameters, results and errors."""

    commands: Commands
    files: Files
    pty: Pty

    def _bind(self, loop: Loop, inner: AsyncSandbox) -> None:
        super()._bind(loop, inner)
        self.commands = Commands._wrap(loop, inner.commands)
        self.files = Files._wrap(loop, inner.files)
        self.pty = Pty._wrap(loop, inner.pty)

    @property
    def sandbox_id(self) -> str:
        """The sandbox's id (``lb-`` and 12 hex digits)."""
        return self._inner.sandbox_id

    @property
    def info(self) -> SandboxInfo:
        """What the service last said about the sandbox (:meth:`refresh` asks again)."""
        return self._inner.info

    create = opens(AsyncSandbox.create)
    restore = opens(AsyncSandbox.restore)
    restore_many = opens_each(AsyncSandbox.restore_many)
    connect = opens(AsyncSandbox.connect)
    list = staticmethod(oneshot(AsyncSandbox.list))
    refresh = blocking(AsyncSandbox.refresh)
    pause = blocking(AsyncSandbox.pause)
    resume = blocking(AsyncSandbox.resume)
    checkpoint = blocking(AsyncSandbox.checkpoint)
    fork = handing_out(AsyncSandbox.fork, _forks)
    receipts = blocking(AsyncSandbox.receipts)
    set_network = blocking(AsyncSandbox.set_network)
    set_timeout = blocking(AsyncSandbox.set_timeout)
    get_metrics = blocking(AsyncSandbox.get_metrics)
    port_url = delegated(AsyncSandbox.port_url)
    preview_url = blocking(AsyncSandbox.preview_url)
    kill = blocking(AsyncSandbox.kill, closes=True)
    close = blocking(AsyncSandbox.close, closes=True)


class Job(Blocking[AsyncJob], twin=AsyncJob):
    """The blocking twin of :class:`AsyncJob`."""

    def __init__(self, job: str, *, url: str, token: str) -> None:
        """The job ``job`` of this token's project on the service at ``url`` (no request is sent yet)."""
        inner = AsyncJob(job, url=url, token=token)
        self._bind(Loop(), inner)

    @property
    def job(self) -> str:
        """The job's name."""
        return self._inner.job

    renew = blocking(AsyncJob.renew)
    pause = blocking(AsyncJob.pause)
    resume = blocking(AsyncJob.resume)
    preempt = blocking(AsyncJob.preempt)
    resume_run = staticmethod(oneshot(AsyncJob.resume_run))
    close = blocking(AsyncJob.close, closes=True)


class Client(Blocking[AsyncClient], twin=AsyncClient):
    """The blocking twin of :class:`AsyncClient`."""

    def __init__(self, *, url: str, token: str) -> None:
        """A client of the service at ``url`` (no request is sent yet)."""
        inner = AsyncClient(url=url, token=token)
        self._bind(Loop(), inner)

    @property
    def url(self) -> str:
        """The service's URL."""
        return self._inner.url

    capabilities = blocking(AsyncClient.capabilities)
    load = blocking(AsyncClient.load)
    checkpoints = blocking(AsyncClient.checkpoints)
    delete_checkpoint = blocking(AsyncClient.delete_checkpoint)
    call = blocking(AsyncClient.call)
    close = blocking(AsyncClient.close, closes=True)
