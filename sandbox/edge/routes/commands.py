"""Background commands and terminal sessions of a sandbox, and their routes on the edge service.

A background command is an exec like any other (:meth:`Sandbox.exec
<sandbox.host.manager.Sandbox.exec>`: the same exec files, validation, timeout, tree kill and
``exec`` receipt) that outlives the request that started it: its stdin stays open, its
output goes into a bounded buffer that clients attach to at any time (what is still kept
is replayed, then the output follows live), and a client that leaves changes nothing for
it.  It ends when it exits, when it is killed (``interrupted: "killed"``), at its timeout,
when its sandbox is destroyed (``"destroy"``), when the service stops (``"shutdown"``) or,
after a crash, when reconcile finds its exec files (``"restart"``).  Its receipts say
``background: true`` and its ``command_id``; an ``exec_started`` receipt is written when it
starts.

A terminal session is a background command on a pty that crun makes inside the
sandbox's own devpts (``crun exec --console-socket`` hands us the master: the sandbox
never gets a host pty), or in a microVM the guest agent makes inside the guest (the
edge writes the keys to a pipe the agent relays).  Its output is the terminal's, its
input the keys; it can be resized (``TIOCSWINSZ`` on the master, or the VM backend's
resize request to its agent).

Everything is bounded (:class:`CommandLimits`): running commands and terminals per sandbox,
finished commands kept per sandbox, output kept per command, readers attached to one
command, one write to its input and how long that write may wait.

Routes (:func:`add_routes`), each owner-checked as every sandbox route is::

    POST .../commands                       start: an exec body (no idempotency key), and
                                            "pty": {"cols", "rows"} for a terminal
    GET  .../commands                       list (running and recently finished)
    GET  .../commands/{command}             describe; ?wait=<s>: until it exits, at most s
    GET  .../commands/{command}/output      ndjson events from ?since=<offset>, until the exit
    GET  .../commands/{command}/connect     the same events over a WebSocket, which also
                                            carries input, resize and kill
    POST .../commands/{command}/stdin       {"data": "<base64>", "eof": false}
    POST .../commands/{command}/resize      {"cols", "rows"} (a terminal)
    POST .../commands/{command}/kill        SIGKILL its tree under the freezer, then describe

Events, in order: ``{"type": "stdout" | "stderr", "data": "<base64>", "offset": n}`` (``offset``
counts the bytes of both streams before these), ``{"type": "dropped", "offset": n, "bytes": m}``
(the buffer no longer holds those), and last the exec's ``exit`` (or ``error``) event.
WebSocket messages from the client: binary frames are input; text frames are JSON
``{"type": "stdin", "data": "<base64>"}``, ``{"type": "eof"}``, ``{"type": "resize", "cols",
"rows"}``, ``{"type": "kill"}``; one that cannot be done answers ``{"type": "rejected",
"error": {...}}`` and the socket stays open.  The socket closes after the exit event.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import re
import secrets
import struct
import termios
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import blake3
from aiohttp import WSMsgType, web

from sandbox.core.errors import ApiError, InvalidField, SandboxStateError
from sandbox.core.model import (
    ExecRequest,
    Maxima,
    SandboxState,
    check_int,
    check_number,
    check_object,
    check_str,
)
from sandbox.core.sync import own_thread
from sandbox.edge import openapi
from sandbox.edge.context import SHUTDOWN_GRACE, EdgeContext
from sandbox.edge.errors import as_api_error
from sandbox.host.execs import Cancel, ExecResult
from sandbox.host.sandbox import Sandbox

log = logging.getLogger("layerbox.sandbox.interactive")

KiB, MiB = 1 << 10, 1 << 20
COMMAND_ID = re.compile(r"cmd-[0-9a-f]{12}")
# a terminal without a command: the image's bash if it has one, else its sh (both as login shells)
DEFAULT_SHELL = "if command -v bash >/dev/null 2>&1; then exec bash -l; fi; exec sh -l"
DEFAULT_TERM = "xterm-256color"
MAX_WINSIZE = 1000  # columns or rows of a terminal
# the service's description says the same (it cannot import this module: this one imports the service)
assert openapi.COMMAND_PATTERN == f"^{COMMAND_ID.pattern}$"
assert openapi.SCHEMAS["resize"]["content"]["application/json"]["schema"]["properties"]["cols"]["maximum"] == MAX_WINSIZE
CHUNK_OVERHEAD = 64  # what one kept chunk costs beyond its bytes: counted against CommandLimits.buffer
MERGE = 16 * KiB  # consecutive output of one stream is kept in chunks of up to this much
EVENT_BYTES = 64 * KiB  # data of one output event at most
KILL_WAIT = 30.0  # seconds a kill (under the freezer) may take before the route answers anyway
LIVENESS = 1.0  # seconds between checks that an idle reader's client is still there


@dataclass(frozen=True)
class CommandLimits:
    """What the edge holds for background commands (the service's ``command_limits``)."""

    commands: int = 16  # running per sandbox, terminals included
    terminals: int = 4  # running terminals per sandbox
    finished: int = 16  # finished ones kept per sandbox (exit and kept output), the oldest dropped first
    buffer: int = 1 * MiB  # output kept per command for readers that attach later (both streams)
    readers: int = 8  # clients attached to one command at once
    stdin: int = 1 * MiB  # one write to a command's input
    stdin_timeout: float = 10.0  # seconds a write waits for the command to read its input
    max_wait: float = 300.0  # seconds a describe may wait for an exit


def check_command_id(value: object, field: str = "command") -> str:
    return check_str(field, value, max_len=16, pattern=COMMAND_ID, what="a command id (cmd- and 12 hex digits)")


def _winsize(field: str, doc: Mapping[str, Any]) -> tuple[int, int]:
    """``(cols, rows)`` of a body with ``cols`` and ``rows`` (both required)."""
    body = check_object(field, doc, ("cols", "rows"))
    prefix = f"{field}." if field else ""
    for name in ("cols", "rows"):
        if body.get(name) is None:
            raise InvalidField(prefix + name, "is required (1-1000)")
    return (check_int(prefix + "cols", body["cols"], 1, MAX_WINSIZE),
            check_int(prefix + "rows", body["rows"], 1, MAX_WINSIZE))


@dataclass(frozen=True)
class StartRequest:
    """A background command: an :class:`ExecRequest` (validated as any exec is, then against the
    edge's maxima) and, for a terminal, its size.  ``exec.stdin`` is written once it runs."""

    exec: ExecRequest
    terminal: tuple[int, int] | None = None

    @classmethod
    def from_json(cls, doc: object, maxima: Maxima) -> StartRequest:
        body = dict(check_object("", doc, (*ExecRequest.FIELDS, "pty")))
        pty = body.pop("pty", None)
        terminal = _winsize("pty", pty) if pty is not None else None
        if "idempotency_key" in body:  # nothing would replay it: it runs once, found by its id
            raise InvalidField("idempotency_key", "a background command has none (it is found again by its id)")
        if terminal is not None:
            body.setdefault("cmd", DEFAULT_SHELL)
            if body.get("output_cap") is None:  # a terminal prints what it prints: up to the edge's cap
                body["output_cap"] = maxima.output_cap
        req = maxima.check_exec(ExecRequest.from_json(body))
        if terminal is not None and "TERM" not in req.env:
            req = dataclasses.replace(req, env={"TERM": DEFAULT_TERM, **req.env})
        return cls(req, terminal)


# -- one command's output ------------------------------------------------------------------------------
class Output:
    """What a command printed, for readers attaching at any time: the most recent output of both
    streams in order, at most ``limit`` bytes (each chunk also costs CHUNK_OVERHEAD), the oldest
    dropped first.  Offsets count the bytes of both streams from the command's start.

    Appended from the exec's thread, read from the event loop: every method holds the lock.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._chunks: deque[tuple[int, str, bytearray]] = deque()
        self._cost = 0
        self.start = 0  # offset of the first byte still kept
        self.end = 0  # offset after the last byte
        self._lock = threading.Lock()

    def append(self, stream: str, data: bytes) -> None:
        with self._lock:
            last = self._chunks[-1] if self._chunks else None
            if last is not None and last[1] == stream and len(last[2]) + len(data) <= MERGE:
                last[2].extend(data)
                self._cost += len(data)
            else:
                self._chunks.append((self.end, stream, bytearray(data)))
                self._cost += len(data) + CHUNK_OVERHEAD
            self.end += len(data)
            while self._cost > self.limit and self._chunks:
                offset, name, first = self._chunks[0]
                excess = self._cost - self.limit
                if excess >= len(first):  # the whole chunk goes (its overhead with it)
                    self._chunks.popleft()
                    self._cost -= len(first) + CHUNK_OVERHEAD
                    self.start = offset + len(first)
                else:
                    self._chunks[0] = (offset + excess, name, first[excess:])
                    self._cost -= excess
                    self.start = offset + excess
            if not self._chunks:
                self.start = self.end

    def since(self, offset: int) -> tuple[int, list[tuple[int, str, bytes]]]:
        """``(bytes after offset no longer kept, [(offset, stream, data)] from offset on)``."""
        with self._lock:
            found: list[tuple[int, str, bytes]] = []
            for at, stream, data in reversed(self._chunks):  # readers mostly want the newest
                if at + len(data) <= offset:
                    break
                skip = max(0, offset - at)
                found.append((at + skip, stream, bytes(data[skip:])))
            found.reverse()
            return max(0, self.start - offset), found


# -- one command -------------------------------------------------------------------------------------------
class Command:
    """One background command or terminal session of a sandbox (the :class:`~sandbox.host.execs.Attach`
    its exec is given).  Made by :meth:`Commands.start`; its exec runs on a thread of its own
    (it may run for days: never on the loop's default executor)."""

    def __init__(self, box: Sandbox, req: ExecRequest, terminal: tuple[int, int] | None, limits: CommandLimits,
                 loop: asyncio.AbstractEventLoop, project: str = "") -> None:
        self.id = "cmd-" + secrets.token_hex(6)
        self.number = 0  # per sandbox, from 1 (Commands.start): what E2B's envd calls its pid
        self.tag: str | None = None  # E2B's tag, a caller's name for it
        self.box = box
        self.project = project  # whose caps it counts against
        self.request = dataclasses.replace(req, stdin=None)  # the initial stdin goes through write()
        self.terminal = terminal
        self.size = terminal
        self.limits = limits
        self.loop = loop
        self.cancel = Cancel()
        self.output = Output(limits.buffer)
        self.started_at = time.time()
        self.result: ExecResult | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()  # the exec returned (its receipt is written)
        self.exited = asyncio.Event()  # the same, seen on the loop
        self.exited_callbacks: list[Callable[[], None]] = []  # called on the loop once it exited
        self.ready: asyncio.Future[None] = loop.create_future()  # running (its terminal received), or failed
        self._readers: set[asyncio.Event] = set()
        self._input_lock = asyncio.Lock()  # one write at a time; the descriptor closes only under it
        self._fd_lock = threading.Lock()
        self._stdin_hash = blake3.blake3()
        self._stdin_bytes = 0
        self._input: int | None = None  # the pipe's write end, or our copy of the pty master
        self._resize: Callable[[int, int], None] | None = None  # a terminal that is not the host's (a VM's)
        self._pipe_read: int | None = None  # crun's stdin until crun has it
        if terminal is None:
            self._pipe_read, self._input = os.pipe2(os.O_CLOEXEC)
            os.set_blocking(self._input, False)
        self.stdin_open = True
        self._closing: asyncio.Future[None] | None = None
        self._thread = threading.Thread(target=self._run, name=f"layerbox-{self.id}", daemon=True)

    # -- the exec's side (its thread) --------------------------------------------------------------------
    @property
    def stdin_fd(self) -> int | None:
        return self._pipe_read

    def started(self) -> Mapping[str, Any]:
        return {"background": True, "command_id": self.id, "tty": self.terminal is not None}

    def spawned(self) -> None:
        with self._fd_lock:
            if self._pipe_read is not None:
                os.close(self._pipe_read)  # crun's stdin is its own now: the command's exit ends the pipe
                self._pipe_read = None
        if self.terminal is None:
            self._soon(self._set_ready)

    def on_terminal(self, master: int, resize: Callable[[int, int], None] | None = None) -> None:
        os.set_blocking(master, False)
        with self._fd_lock:
            self._input = master
            self._resize = resize
        self._soon(self._set_ready)

    def finished(self) -> Mapping[str, Any]:
        with self._fd_lock:
            return {**self.started(), "stdin_bytes": self._stdin_bytes, "stdin_blake3": self._stdin_hash.hexdigest()}

    def _run(self) -> None:
        try:
            self.result = self.box.exec(self.request, on_stdout=self._printer("stdout"),
                                        on_stderr=self._printer("stderr"), cancel=self.cancel, keep_output=False,
                                        attach=self)
        except Exception as exc:  # the command's failure is its final event (and the start's answer)
            self.error = exc
        finally:
            with self._fd_lock:
                if self._pipe_read is not None:  # it never started
                    os.close(self._pipe_read)
                    self._pipe_read = None
            self.done.set()
            if not self._soon(self._on_exit):
                self._close_input_now()  # the loop is gone: nobody writes any more

    def _printer(self, stream: str) -> Callable[[bytes], None]:
        def printed(data: bytes) -> None:
            self.output.append(stream, data)
            self._soon(self._wake)
        return printed

    def _soon(self, fn: Callable[[], None]) -> bool:
        try:
            self.loop.call_soon_threadsafe(fn)
            return True
        except RuntimeError:  # the loop was closed (the service stopped without waiting for this)
            return False

    # -- the loop's side -----------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return self.done.is_set()

    def _set_ready(self) -> None:
        if not self.ready.done():
            self.ready.set_result(None)

    def _wake(self) -> None:
        for reader in self._readers:
            reader.set()

    def _on_exit(self) -> None:
        if not self.ready.done():
            self.ready.set_exception(self.error or SandboxStateError(f"command {self.id} ended before it ran"))
        self.exited.set()
        for callback in self.exited_callbacks:
            callback()
        self._wake()
        self._closing = asyncio.ensure_future(self.close_input())  # after a write in progress

    def _close_input_now(self) -> None:
        with self._fd_lock:
            if self._input is not None:
                os.close(self._input)
                self._input = None
        self.stdin_open = False

    @property
    def running(self) -> bool:
        return not self.done.is_set()

    def final_event(self) -> dict[str, Any] | None:
        if self.running:
            return None
        if self.result is not None:
            return exit_event(self.result)
        assert self.error is not None
        return {"type": "error", **as_api_error(self.error).body()}

    def view(self) -> dict[str, Any]:
        return {"id": self.id, "command": self.request.argv, "started": self.started_at,
                "status": "running" if self.running else "exited",
                "pty": {"cols": self.size[0], "rows": self.size[1]} if self.size else None,
                "stdin_open": self.stdin_open and self.running, "readers": len(self._readers),
                "output": {"start": self.output.start, "end": self.output.end}, "exit": self.final_event()}

    def kill(self) -> None:
        if not self.cancel.is_set():
            self.cancel.cancel("killed")

    # -- input ------------------------------------------------------------------------------------------
    async def write(self, data: bytes) -> None:
        """Write all of ``data`` to the command's input, waiting at most ``stdin_timeout`` for it to
        read; a stalled or finished command is a 409 (retryable when it is only slow)."""
        if len(data) > self.limits.stdin:
            raise InvalidField("data", f"{len(data)} bytes; one write takes at most {self.limits.stdin}")
        async with self._input_lock:
            deadline = self.loop.time() + self.limits.stdin_timeout
            view = memoryview(data)
            while view:
                fd = self._open_input()
                try:
                    n = os.write(fd, view)
                except BlockingIOError:
                    n = 0
                except OSError as exc:
                    if exc.errno not in (errno.EPIPE, errno.EIO):
                        raise
                    raise SandboxStateError(f"command {self.id} no longer reads its input "
                                            f"({os.strerror(exc.errno)})") from None
                if n:
                    with self._fd_lock:
                        self._stdin_hash.update(view[:n])
                        self._stdin_bytes += n
                    view = view[n:]
                elif not await self._writable(fd, deadline):
                    raise InputStalled(f"command {self.id} did not read its input for "
                                       f"{self.limits.stdin_timeout:g} s ({len(view)} of {len(data)} bytes not "
                                       "written); retry later")

    async def close_input(self) -> None:
        """End the command's input (EOF on its stdin); for a terminal the session ends instead with
        its exit (a terminal has no end of input: send ^D)."""
        async with self._input_lock:
            self._close_input_now()

    async def resize(self, cols: int, rows: int) -> None:
        if self.terminal is None:
            raise SandboxStateError(f"command {self.id} runs on pipes, not on a terminal: nothing to resize")
        async with self._input_lock:
            fd = self._open_input()
            if self._resize is not None:  # a guest's terminal: a request to its agent, which a guest
                resize = self._resize      # that stops reading stalls (SEND_TIMEOUT): not the shared executor
                await own_thread(lambda: resize(cols, rows), name=f"layerbox-resize-{self.id}")
            else:
                fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
            self.size = (cols, rows)

    def _open_input(self) -> int:
        if not self.running:
            raise SandboxStateError(f"command {self.id} has exited")
        if self._input is None:
            raise SandboxStateError(f"command {self.id}: its input was closed")
        return self._input

    async def _writable(self, fd: int, deadline: float) -> bool:
        """Whether ``fd`` takes more before ``deadline`` (the caller holds the input lock, so it
        stays open meanwhile)."""
        ready: asyncio.Future[None] = self.loop.create_future()

        def woken() -> None:
            if not ready.done():
                ready.set_result(None)

        self.loop.add_writer(fd, woken)
        try:
            await asyncio.wait_for(ready, max(0.0, deadline - self.loop.time()))
            return True
        except TimeoutError:
            return False
        finally:
            self.loop.remove_writer(fd)

    # -- output -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def reader(self) -> Iterator[asyncio.Event]:
        """A reader's slot (at most ``CommandLimits.readers`` at once): 429 when none is free."""
        if len(self._readers) >= self.limits.readers:
            raise ApiError(None, "too_many_readers", f"command {self.id} has {len(self._readers)} readers "
                           "attached, the most it takes; detach one or retry later", retryable=True,
                           retry_after=1)
        wake = asyncio.Event()
        self._readers.add(wake)
        try:
            yield wake
        finally:
            self._readers.discard(wake)

    async def events(self, wake: asyncio.Event, since: int,
                     present: Callable[[], bool]) -> AsyncIterator[dict[str, Any]]:
        """Output from ``since`` on (what is no longer kept as one ``dropped`` event), then live, then
        the final event; stops early once ``present()`` says the client left."""
        async for at, stream, data in self.pieces(wake, since, present):
            if stream == "dropped":
                yield {"type": "dropped", "offset": at, "bytes": int(data)}
            elif stream == "idle":
                continue
            elif stream == "end":
                final = self.final_event()
                assert final is not None
                yield final
            else:
                yield {"type": stream, "data": base64.b64encode(data).decode(), "offset": at}

    async def pieces(self, wake: asyncio.Event, since: int, present: Callable[[], bool], *,
                     idle: float = LIVENESS) -> AsyncIterator[tuple[int, str, bytes]]:
        """``(offset, stream, bytes)`` from ``since`` on: ``stdout``/``stderr`` output, ``dropped``
        (the bytes are the count no longer kept, in decimal), ``idle`` (nothing for ``idle``
        seconds) and last ``end`` (:meth:`final_event` is then set); stops early once ``present()``
        says the client left."""
        offset = since
        while True:
            wake.clear()
            ended = not self.running  # read before the output: once ended, nothing more is appended
            dropped, chunks = self.output.since(offset)
            if dropped:
                yield offset, "dropped", str(dropped).encode()
                offset += dropped
            for at, stream, data in _merged(chunks):
                yield at, stream, data
                offset = at + len(data)
            if dropped or chunks:
                continue
            if ended:
                yield offset, "end", b""
                return
            try:
                await asyncio.wait_for(wake.wait(), idle)
            except TimeoutError:
                yield offset, "idle", b""
            if not present():
                return


class InputStalled(SandboxStateError):
    """The command did not read its input in time; retry later."""

    retryable = True


def exit_event(result: ExecResult) -> dict[str, Any]:
    """The exit event of a finished command (the one the exec stream ends with)."""
    return {"type": "exit", "exit_code": result.exit_code, "signal": result.signal, "truncated": result.truncated,
            "duration": result.duration, "timed_out": result.timed_out, "oom_killed": result.oom_killed,
            "interrupted": result.interrupted, "replayed": result.replayed}


def _merged(chunks: list[tuple[int, str, bytes]]) -> Iterator[tuple[int, str, bytes]]:
    """Adjacent chunks of one stream joined into events of up to EVENT_BYTES (and long ones split)."""
    pending: tuple[int, str, bytearray] | None = None
    for at, stream, data in chunks:
        if pending is not None and (pending[1] != stream or len(pending[2]) + len(data) > EVENT_BYTES):
            yield pending[0], pending[1], bytes(pending[2])
            pending = None
        if len(data) > EVENT_BYTES:
            for i in range(0, len(data), EVENT_BYTES):
                yield at + i, stream, data[i:i + EVENT_BYTES]
            continue
        if pending is None:
            pending = (at, stream, bytearray(data))
        else:
            pending[2].extend(data)
    if pending is not None:
        yield pending[0], pending[1], bytes(pending[2])


# -- the commands of every sandbox -------------------------------------------------------------------------
class Commands:
    """Background commands per sandbox, bounded by :class:`CommandLimits`.  Ended by :meth:`end` (the
    sandbox's destroy, through ``SandboxManager.on_destroy``; the service's stop)."""

    def __init__(self, limits: CommandLimits) -> None:
        self.limits = limits
        self._boxes: dict[str, dict[str, Command]] = {}
        self._numbers: dict[str, int] = {}  # sandbox -> the last Command.number given
        self._lock = threading.Lock()  # destroy hooks run on the manager's threads
        self.stopping = False

    def start(self, box: Sandbox, req: StartRequest, project: str = "", tag: str | None = None) -> Command:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self.stopping:
                raise ApiError(None, "stopping", "this edge is stopping; retry on another one", retryable=True)
            mine = self._boxes.setdefault(box.id, {})
            running = [c for c in mine.values() if c.running]
            if len(running) >= self.limits.commands:
                raise ApiError(None, "command_limit", f"sandbox {box.id} runs {len(running)} background commands, "
                               "the most this edge takes; kill one or wait for one to end", retryable=True)
            terminals = sum(c.terminal is not None for c in running)
            if req.terminal is not None and terminals >= self.limits.terminals:
                raise ApiError(None, "command_limit", f"sandbox {box.id} has {terminals} terminals open, the most "
                               "this edge takes; end one first", retryable=True)
            cmd = Command(box, req.exec, req.terminal, self.limits, loop, project)
            self._numbers[box.id] = cmd.number = self._numbers.get(box.id, 0) + 1
            cmd.tag = tag
            mine[cmd.id] = cmd
            self._trim(mine, room=1)
        cmd.start()
        return cmd

    async def launch(self, ctx: EdgeContext, project: str, box: Sandbox, state: SandboxState, req: StartRequest,
                     tag: str | None = None) -> Command:
        """Start ``req`` in a running sandbox for ``project``: it holds one of the project's commands
        until it ends, whoever watches it; returns once it runs (its failure to start is raised)."""
        if state.status != "running":
            raise ApiError(None, "conflict", f"sandbox {box.id} is {state.status}, not running")
        ctx.refuse_when_stopping()
        held = ctx.usage.take(project, "commands")
        try:
            cmd = self.start(box, req, project, tag)
        except BaseException:
            held.release()
            raise
        cmd.exited_callbacks.append(held.release)
        try:
            await asyncio.shield(cmd.ready)
        except Exception:
            self.forget(cmd)  # it never ran: its error is the caller's answer
            raise
        ctx.metrics.execs.labels(project).inc()
        return cmd

    def _trim(self, mine: dict[str, Command], room: int = 0) -> None:
        """Forget the oldest finished commands past ``CommandLimits.finished`` (with room for more)."""
        finished = sorted((c for c in mine.values() if not c.running), key=lambda c: c.started_at)
        for cmd in finished[:max(0, len(finished) + room - self.limits.finished)]:
            del mine[cmd.id]

    def get(self, sid: str, cid: str) -> Command:
        with self._lock:
            cmd = self._boxes.get(sid, {}).get(cid)
            if cmd is None:
                raise ApiError(None, "command_not_found", f"no background command {cid!r} in sandbox {sid!r}")
            return cmd

    def of(self, sid: str) -> list[Command]:
        with self._lock:
            mine = self._boxes.get(sid, {})
            self._trim(mine)
            return sorted(mine.values(), key=lambda c: c.started_at)

    def forget(self, cmd: Command) -> None:
        with self._lock:
            self._boxes.get(cmd.box.id, {}).pop(cmd.id, None)

    def end(self, sid: str | None, reason: str, timeout: float) -> list[Command]:
        """Kill the running commands of ``sid`` (of every sandbox: None) with ``reason`` and wait up to
        ``timeout`` s for their receipts; the ones still running then are returned (blocking)."""
        with self._lock:
            boxes = [self._boxes.get(sid, {})] if sid is not None else list(self._boxes.values())
            running = [c for mine in boxes for c in mine.values() if c.running]
        for cmd in running:
            if not cmd.cancel.is_set():
                cmd.cancel.cancel(reason)
        deadline = time.monotonic() + timeout
        return [c for c in running if not c.join(max(0.0, deadline - time.monotonic()))]

    def on_destroy(self, sid: str) -> None:
        """``SandboxManager.on_destroy``: the commands end before their sandbox (receipts first)."""
        left = self.end(sid, "destroy", KILL_WAIT)
        if left:
            log.warning("sandbox %s: commands %s still running after %g s; destroying it under them", sid,
                        [c.id for c in left], KILL_WAIT)
        with self._lock:
            self._boxes.pop(sid, None)
            self._numbers.pop(sid, None)


# -- routes ---------------------------------------------------------------------------------------------
class Routes:
    """The HTTP and WebSocket side of :class:`Commands` on one service."""

    def __init__(self, ctx: EdgeContext, limits: CommandLimits) -> None:
        self.ctx = ctx
        self.commands = Commands(limits)
        self.limits = limits

    async def _command(self, request: web.Request) -> Command:
        project = self.ctx.project(request)
        box, _ = await self.ctx.sandbox(request, project)
        cid = check_command_id(request.match_info["command"])
        return self.commands.get(box.id, cid)

    @staticmethod
    def _since(request: web.Request) -> int:
        text = request.query.get("since", "0")
        if not (text.isascii() and text.isdigit()):
            raise InvalidField("since", f"{text[:20]!r} is not an output offset (a non-negative integer)")
        return check_int("since", int(text), 0, 1 << 62)

    async def start(self, request: web.Request) -> web.Response:
        svc = self.ctx
        project = svc.project(request)
        box, state = await svc.sandbox(request, project)
        req = StartRequest.from_json(await svc.body(request), svc.maxima)
        cmd = await self.commands.launch(svc, project.name, box, state, req)
        if req.exec.stdin:
            await cmd.write(req.exec.stdin)
        return web.json_response(cmd.view(), status=201)

    async def list(self, request: web.Request) -> web.Response:
        box, _ = await self.ctx.sandbox(request, self.ctx.project(request))
        return web.json_response({"sandbox": box.id, "commands": [c.view() for c in self.commands.of(box.id)]})

    async def describe(self, request: web.Request) -> web.Response:
        cmd = await self._command(request)  # the owner first, as on every route naming a sandbox
        wait = None
        if "wait" in request.query:
            try:
                wait = check_number("wait", float(request.query["wait"]), 0.0, self.limits.max_wait)
            except ValueError:
                raise InvalidField("wait", "must be seconds (a number)") from None
        if wait:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(cmd.exited.wait(), wait)
        return web.json_response(cmd.view())

    async def output(self, request: web.Request) -> web.StreamResponse:
        cmd = await self._command(request)  # the owner first, as on every route naming a sandbox
        since = self._since(request)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        resp.enable_chunked_encoding()

        def present() -> bool:
            return request.transport is not None and not request.transport.is_closing()

        with cmd.reader() as wake:  # before the response starts: a 429 is an answer
            await resp.prepare(request)
            try:
                async for event in cmd.events(wake, since, present):
                    await resp.write(json.dumps(event).encode() + b"\n")
                await resp.write_eof()
            except ConnectionResetError:
                pass  # the client left: the command runs on
        return resp

    async def stdin(self, request: web.Request) -> web.Response:
        cmd = await self._command(request)
        body = check_object("", await self.ctx.body(request), ("data", "eof"))
        eof = body.get("eof", False)
        if not isinstance(eof, bool):
            raise InvalidField("eof", "must be true or false")
        data = _decode("data", body.get("data"))
        if data:
            await cmd.write(data)
        if eof:
            if cmd.terminal is not None:
                raise InvalidField("eof", "a terminal has no end of input (send ^D, \\u0004, to end its shell)")
            await cmd.close_input()
        return web.json_response(cmd.view())

    async def resize(self, request: web.Request) -> web.Response:
        cmd = await self._command(request)
        cols, rows = _winsize("", await self.ctx.body(request))
        await cmd.resize(cols, rows)
        return web.json_response(cmd.view())

    async def kill(self, request: web.Request) -> web.Response:
        cmd = await self._command(request)
        was_running = cmd.running
        cmd.kill()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(cmd.exited.wait(), KILL_WAIT)
        return web.json_response({"killed": was_running, "command": cmd.view()})

    async def connect(self, request: web.Request) -> web.WebSocketResponse:
        cmd = await self._command(request)  # the owner first, as on every route naming a sandbox
        with self.ctx.usage.take(cmd.project, "connections"):
            return await self._connect(request, cmd)

    async def _connect(self, request: web.Request, cmd: Command) -> web.WebSocketResponse:
        since = self._since(request)
        ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=2 * self.limits.stdin + 4 * KiB)
        if not ws.can_prepare(request).ok:
            raise ApiError(None, "bad_request", "connect is a WebSocket: a GET with 'Upgrade: websocket'")
        with cmd.reader() as wake:
            await ws.prepare(request)
            pusher = asyncio.ensure_future(self._push(ws, cmd, wake, since))
            try:
                async for msg in ws:
                    if msg.type == WSMsgType.BINARY:
                        await self._act(ws, cmd, {"type": "stdin"}, msg.data)
                    elif msg.type == WSMsgType.TEXT:
                        try:
                            doc = json.loads(msg.data)
                        except ValueError as exc:
                            await ws.send_json({"type": "rejected", "error": {
                                "code": "bad_request", "message": f"not JSON: {exc}", "retryable": False}})
                            continue
                        await self._act(ws, cmd, doc, None)
            finally:
                pusher.cancel()
                with contextlib.suppress(asyncio.CancelledError, ConnectionResetError):
                    await pusher
                await ws.close()
        return ws

    @staticmethod
    async def _push(ws: web.WebSocketResponse, cmd: Command, wake: asyncio.Event, since: int) -> None:
        async for event in cmd.events(wake, since, lambda: not ws.closed):
            await ws.send_json(event)
        await ws.close()  # after the exit event: the session is over

    async def _act(self, ws: web.WebSocketResponse, cmd: Command, doc: Any, raw: bytes | None) -> None:
        """One message of a client: input, eof, resize or kill; what cannot be done is answered."""
        try:
            if raw is not None:
                await cmd.write(raw)
                return
            msg = check_object("", doc, ("type", "data", "cols", "rows"))
            kind = msg.get("type")
            if kind == "stdin":
                await cmd.write(_decode("data", msg.get("data")))
            elif kind == "eof":
                if cmd.terminal is not None:
                    raise InvalidField("type", "a terminal has no end of input (send ^D to end its shell)")
                await cmd.close_input()
            elif kind == "resize":
                await cmd.resize(*_winsize("", {k: v for k, v in msg.items() if k != "type"}))
            elif kind == "kill":
                cmd.kill()
            else:
                raise InvalidField("type", f"{str(kind)[:20]!r} is not one of stdin, eof, resize, kill")
        except (InvalidField, SandboxStateError, ApiError, OSError) as exc:
            await ws.send_json({"type": "rejected", **as_api_error(exc).body()})

    # -- the service's life ------------------------------------------------------------------------------
    async def _on_startup(self, app: web.Application) -> None:
        self.ctx.manager.on_destroy.append(self.commands.on_destroy)

    async def _on_shutdown(self, app: web.Application) -> None:
        """Every command ends now (``interrupted: "shutdown"``, in its receipt too), before the server
        waits for its requests: readers get the exit event and their sockets close."""
        with self.commands._lock:
            self.commands.stopping = True
        left = await asyncio.to_thread(self.commands.end, None, "shutdown", SHUTDOWN_GRACE)
        if left:
            log.warning("commands %s still running %g s after the stop; the manager's close ends them",
                        [c.id for c in left], SHUTDOWN_GRACE)

    async def _on_cleanup(self, app: web.Application) -> None:
        with contextlib.suppress(ValueError):
            self.ctx.manager.on_destroy.remove(self.commands.on_destroy)


def _decode(field: str, value: object) -> bytes:
    if value is None:
        return b""
    if not isinstance(value, str):
        raise InvalidField(field, "must be a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidField(field, "is not valid base64") from None


def setup(ctx: EdgeContext, app: web.Application, limits: CommandLimits | None = None) -> Routes:
    """The routes of background commands and terminals on ``app``, and their hooks: ended with their
    sandbox's destroy and before the service stops."""
    routes = Routes(ctx, limits or CommandLimits())
    r = app.router
    base = "/v1/sandboxes/{id}/commands"
    r.add_post(base, routes.start)
    r.add_get(base, routes.list)
    r.add_get(base + "/{command}", routes.describe)
    r.add_get(base + "/{command}/output", routes.output)
    r.add_get(base + "/{command}/connect", routes.connect)
    r.add_post(base + "/{command}/stdin", routes.stdin)
    r.add_post(base + "/{command}/resize", routes.resize)
    r.add_post(base + "/{command}/kill", routes.kill)
    app.on_startup.append(routes._on_startup)
    app.on_shutdown.append(routes._on_shutdown)
    app.on_cleanup.append(routes._on_cleanup)
    return routes
