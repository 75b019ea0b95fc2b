"""envd's ``process.Process`` service over the edge's background commands.

A process E2B starts is a background command (sandbox.edge.routes.commands): the same exec,
validation, limits, receipts and tree kill as the native API's, listed by both.  Its ``pid`` is
the command's number in its sandbox (from 1; not a pid of the sandbox's kernel, which the edge
does not see for a container's exec) and its ``tag`` the caller's name for it.

- ``Start`` streams the start event, the output (``pty`` for a terminal), keepalives at the
  interval the client asks (``Keepalive-Ping-Interval``) and the end event.  The process does
  not end when the stream does: ``Connect`` attaches to it again (by pid or tag), replaying
  what is still kept, and a finished one answers its kept output and end event.
- The SDK's command ``timeout`` (``Connect-Timeout-Ms``) bounds the process too, as envd's
  does: the exec's timeout is what is left of it when the request arrives, so the process is
  killed (``killed (timed out)``) once its caller's deadline has passed, and the SDK raises
  its TimeoutException when that deadline passes.  ``timeout=0`` (no header): no bound.  A
  ``Connect``'s timeout bounds only that connection.
- ``stdin: false`` closes the process's input at once, as envd gives it none.
- ``SendSignal``: SIGKILL and SIGTERM both kill the process's tree under the freezer (the
  native kill); other signals are refused; a process that has ended is NOT_FOUND, as envd's
  (the SDK's ``kill`` then answers False).
- A sandbox that is not running (paused) answers every call as E2B's proxy does for it: 502
  "The sandbox ... was not found running: it is paused", which the SDK raises as
  SandboxNotRunningException.
- Messages are bounded (:data:`READ_MAX_BYTES`): one stdin write of the edge's largest
  (``CommandLimits.stdin``) and its envelope fit, a larger one is RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import time
from collections.abc import AsyncIterator
from typing import Any

from connectrpc.code import Code
from connectrpc.codec import Codec, proto_binary_codec, proto_json_codec
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.process import process_pb as pb
from e2b.envd.process.process_connect import ProcessASGIApplication
from protobuf import Oneof

from sandbox.backends.base import account
from sandbox.core.errors import ApiError, InvalidField, SandboxNotFound
from sandbox.core.model import SandboxState, check_str
from sandbox.edge.auth import Project
from sandbox.edge.context import EdgeContext
from sandbox.edge.routes.commands import Command, Commands, StartRequest
from sandbox.host.sandbox import Sandbox

from .envd import current, rpc, rpc_stream, run_as

READ_MAX_BYTES = 2 << 20  # one request message: a stdin write of CommandLimits.stdin (1 MiB) with room
DEFAULT_KEEPALIVE = 30.0  # seconds between keepalive events when the client names none
MIN_KEEPALIVE = 1.0
MAX_TAG = 256
SIGKILL, SIGTERM = 9, 15
# why a command ended that is its sandbox's end, not its own (ExecResult.interrupted)
GONE_WAIT = 10.0  # seconds a destroy may take after it ended the sandbox's commands
GONE = {"destroy": "killed", "shutdown": "stopped with its edge", "restart": "restarted with its edge"}


class ProcessService:
    def __init__(self, ctx: EdgeContext, commands: Commands) -> None:
        self.ctx = ctx
        self.commands = commands

    @rpc
    async def list(self, request: pb.ListRequest, ctx: RequestContext[Any, Any], /) -> pb.ListResponse:
        _, box, _ = await running()
        return pb.ListResponse(processes=[info(c) for c in self.commands.of(box.id) if c.running])

    @rpc_stream
    async def start(self, request: pb.StartRequest, ctx: RequestContext[Any, Any], /) -> AsyncIterator[
            pb.StartResponse]:
        call = current()
        project, box, state = await running()
        user = await run_as(box, call.user)
        home = await home_of(box, state, user) if request.process and not posixpath.isabs(request.process.cwd or "/") \
            else None
        req = start_request(request, user, self.ctx, deadline(ctx), home=home)
        tag = check_str("tag", request.tag, max_len=MAX_TAG, what="a tag") if request.tag else None
        cmd = await self.commands.launch(self.ctx, project.name, box, state, req, tag=tag)
        if not request.stdin and req.terminal is None:
            await cmd.close_input()
        yield pb.StartResponse(event=event("start", pb.ProcessEvent.StartEvent(pid=cmd.number)))
        async for each in events(cmd, keepalive(ctx), started=True):
            yield pb.StartResponse(event=each)

    @rpc_stream
    async def connect(self, request: pb.ConnectRequest, ctx: RequestContext[Any, Any], /) -> AsyncIterator[
            pb.ConnectResponse]:
        _, box, _ = await running()
        cmd = self.select(box, request.process)
        yield pb.ConnectResponse(event=event("start", pb.ProcessEvent.StartEvent(pid=cmd.number)))
        async for each in events(cmd, keepalive(ctx)):
            yield pb.ConnectResponse(event=each)

    @rpc
    async def update(self, request: pb.UpdateRequest, ctx: RequestContext[Any, Any], /) -> pb.UpdateResponse:
        _, box, _ = await running()
        cmd = self.select(box, request.process)
        size = request.pty.size if request.pty is not None else None
        if size is None:
            raise InvalidField("pty.size", "is required: the terminal's new cols and rows")
        await cmd.resize(*winsize(size.cols, size.rows))
        return pb.UpdateResponse()

    @rpc
    async def stream_input(self, request: AsyncIterator[pb.StreamInputRequest],
                           ctx: RequestContext[Any, Any], /) -> pb.StreamInputResponse:
        _, box, _ = await running()
        cmd: Command | None = None
        async for message in request:
            match message.event:
                case Oneof(field="start", value=pb.StreamInputRequest.StartEvent() as start):
                    cmd = self.select(box, start.process)
                case Oneof(field="data", value=pb.StreamInputRequest.DataEvent() as data):
                    if cmd is None:
                        raise InvalidField("event", "data before the start event naming the process")
                    await cmd.write(input_bytes(data.input))
        return pb.StreamInputResponse()

    @rpc
    async def send_input(self, request: pb.SendInputRequest, ctx: RequestContext[Any, Any], /) -> \
            pb.SendInputResponse:
        _, box, _ = await running()
        cmd = self.select(box, request.process)
        await cmd.write(input_bytes(request.input))
        return pb.SendInputResponse()

    @rpc
    async def send_signal(self, request: pb.SendSignalRequest, ctx: RequestContext[Any, Any], /) -> \
            pb.SendSignalResponse:
        _, box, _ = await running()
        cmd = self.select(box, request.process)
        signal = int(request.signal or 0)
        if signal not in (SIGKILL, SIGTERM):
            raise InvalidField("signal", f"{signal} is not SIGKILL or SIGTERM")
        if not cmd.running:  # envd keeps no ended process to signal: the SDK's kill() is False
            raise ConnectError(Code.NOT_FOUND, f"process {cmd.number} of sandbox {box.id} has ended")
        cmd.kill()
        return pb.SendSignalResponse()

    @rpc
    async def close_stdin(self, request: pb.CloseStdinRequest, ctx: RequestContext[Any, Any], /) -> \
            pb.CloseStdinResponse:
        _, box, _ = await running()
        cmd = self.select(box, request.process)
        if cmd.terminal is not None:
            raise InvalidField("process", "a terminal has no end of input (send ^D, \\x04)")
        await cmd.close_input()
        return pb.CloseStdinResponse()

    def select(self, box: Sandbox, selector: pb.ProcessSelector | None) -> Command:
        """The sandbox's process a selector names (by pid or tag), running or recently ended."""
        match selector.selector if selector is not None else None:
            case Oneof(field="pid", value=pid):
                found = [c for c in self.commands.of(box.id) if c.number == pid]
                what = f"pid {pid}"
            case Oneof(field="tag", value=tag):
                tagged = [c for c in self.commands.of(box.id) if c.tag == tag]
                found = [c for c in tagged if c.running] or tagged  # the running one, else the last ended
                what = f"tag {str(tag)[:MAX_TAG]!r}"
            case _:
                raise InvalidField("process", "is required: a pid or a tag")
        if not found:
            raise ConnectError(Code.NOT_FOUND, f"process with {what} not found in sandbox {box.id}")
        return found[-1]

    def application(self) -> ProcessASGIApplication:
        return ProcessASGIApplication(self, read_max_bytes=READ_MAX_BYTES,  # type: ignore[arg-type]
                                      codecs=[Checked(proto_binary_codec()), Checked(proto_json_codec())])


class Checked:
    """A codec whose undecodable request is the caller's error (INVALID_ARGUMENT naming the
    message), not connectrpc's UNKNOWN."""

    def __init__(self, inner: Codec[Any, Any]) -> None:
        self.inner = inner

    def name(self) -> str:
        return self.inner.name()

    def encode(self, message: Any) -> bytes:
        return self.inner.encode(message)

    def decode(self, data: bytes | bytearray, message_class: type[Any]) -> Any:
        try:
            return self.inner.decode(data, message_class)
        except Exception as exc:
            raise ConnectError(Code.INVALID_ARGUMENT, f"the request is not a {message_class.__name__} in "
                                                      f"{self.inner.name()}: {str(exc)[:200]}") from None


async def home_of(box: Sandbox, state: SandboxState, user: str | None) -> str:
    """Where a relative ``cwd`` starts, as envd's does: the account's home (the sandbox's HOME
    for its own user)."""
    if user is None:
        return state.env.get("HOME") or "/"
    return (await asyncio.to_thread(account, box.files, user))[2]


def start_request(request: pb.StartRequest, user: str | None, ctx: EdgeContext,
                  timeout: float | None = None, *, home: str | None = None) -> StartRequest:
    """The background command a Start asks for, validated as a native one is; ``timeout``
    (seconds, from :func:`deadline`) bounds the process; a relative ``cwd`` starts at ``home``."""
    config = request.process
    if config is None or not config.cmd:
        raise InvalidField("process.cmd", "is required")
    terminal = None
    if request.pty is not None:
        size = request.pty.size
        terminal = winsize(size.cols, size.rows) if size is not None else (80, 24)
    body: dict[str, Any] = {"cmd": [config.cmd, *list(config.args or [])], "env": dict(config.envs or {})}
    if config.cwd:
        body["cwd"] = posixpath.normpath(posixpath.join(home or "/", config.cwd))
    if timeout is not None:
        body["timeout"] = timeout
    body["output_cap"] = ctx.maxima.output_cap  # envd streams what a process prints: the edge's most
    if user is not None:
        body["user"] = user
    if terminal is not None:
        body["pty"] = {"cols": terminal[0], "rows": terminal[1]}
    return StartRequest.from_json(body, ctx.maxima)  # as a native background command is made


def winsize(cols: int, rows: int) -> tuple[int, int]:
    for name, value in (("cols", cols), ("rows", rows)):
        if not 1 <= value <= 1000:
            raise InvalidField(f"pty.size.{name}", f"{value} is not from 1 to 1000")
    return cols, rows


def input_bytes(given: pb.ProcessInput | None) -> bytes:
    match given.input if given is not None else None:
        case Oneof(field="stdin", value=data) | Oneof(field="pty", value=data):
            return bytes(data)
    raise InvalidField("input", "is required: stdin or pty bytes")


async def running() -> tuple[Project, Sandbox, SandboxState]:
    """The call's sandbox, running: a paused one has no processes, and answers as E2B's proxy
    does for a sandbox that is not running (the SDK's SandboxNotRunningException)."""
    project, box, state = await current().sandbox()
    if state.status != "running":
        hint = " (resume it: Sandbox.connect)" if state.status == "paused" else ""
        raise ApiError(502, "sandbox_not_running", f"The sandbox {box.id} was not found running: it is "
                                                   f"{state.status}{hint}")
    return project, box, state


def deadline(ctx: RequestContext[Any, Any]) -> float | None:
    """Seconds left of the caller's ``Connect-Timeout-Ms`` (None: no deadline), at least 1 ms."""
    left = ctx.timeout_ms
    return None if left is None else max(0.001, left / 1000.0)


def keepalive(ctx: RequestContext[Any, Any]) -> float:
    text = ctx.request_headers.get("keepalive-ping-interval")
    with contextlib.suppress(TypeError, ValueError):
        return max(MIN_KEEPALIVE, float(text or ""))
    return DEFAULT_KEEPALIVE


async def events(cmd: Command, every: float, *, started: bool = False) -> AsyncIterator[pb.ProcessEvent]:
    """The command's output from what is still kept, keepalives, and its end."""
    call = current()
    with cmd.reader() as wake:
        async for _, stream, data in cmd.pieces(wake, 0, call.present, idle=every):
            if stream in ("stdout", "stderr"):
                kind = "pty" if cmd.terminal is not None else stream
                yield event("data", pb.ProcessEvent.DataEvent(output=Oneof(kind, data)))  # type: ignore[arg-type]
            elif stream == "idle":
                yield event("keepalive", pb.ProcessEvent.KeepAlive())
            elif stream == "end":
                final = cmd.final_event() or {}
                if final.get("interrupted") in GONE:
                    # as a stream whose sandbox goes ends at E2B's proxy: UNAVAILABLE, which the SDK answers
                    # with a health check, and once that finds the sandbox gone (so: after it is), raises
                    # "killed or reached its end of life"; not an exit of the command's own
                    await gone_by(cmd.box, GONE_WAIT)
                    raise ConnectError(Code.UNAVAILABLE, f"sandbox {cmd.box.id} was {GONE[final['interrupted']]} "
                                                         f"while process {cmd.number} ran")
                if final.get("timed_out") and started:  # its deadline (Connect-Timeout-Ms): this call's, as envd's
                    raise ConnectError(Code.DEADLINE_EXCEEDED, f"process {cmd.number} ran past its timeout and "
                                                               "was killed")
                yield event("end", end_event(final))


async def gone_by(box: Sandbox, bound: float) -> None:
    """Wait until ``box``'s state is gone (its destroy ends its commands first), at most ``bound`` s."""
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        try:
            await asyncio.to_thread(lambda: box.state)
        except SandboxNotFound:
            return
        await asyncio.sleep(0.05)


def event(kind: str, value: Any) -> pb.ProcessEvent:
    """A process event of one ``kind`` (the oneof's field name)."""
    return pb.ProcessEvent(event=Oneof(kind, value))  # type: ignore[arg-type]


def end_event(final: dict[str, Any]) -> pb.ProcessEvent.EndEvent:
    if final.get("type") == "error":
        err = final.get("error") or {}
        return pb.ProcessEvent.EndEvent(exit_code=-1, exited=False, status="error",
                                        error=str(err.get("message", "failed")))
    code, signal = final.get("exit_code"), final.get("signal")
    if code is not None:
        return pb.ProcessEvent.EndEvent(exit_code=int(code), exited=True, status=f"exit status {code}")
    why = final.get("interrupted") or ("timed out" if final.get("timed_out") else None)
    status = f"signal: {signal}" if signal else "killed"
    return pb.ProcessEvent.EndEvent(exit_code=-1, exited=False, status=status,
                                    error=f"killed ({why})" if why else None)


def info(cmd: Command) -> pb.ProcessInfo:
    argv = list(cmd.request.argv)
    return pb.ProcessInfo(config=pb.ProcessConfig(cmd=argv[0], args=argv[1:], envs=dict(cmd.request.env),
                                                  cwd=cmd.request.cwd), pid=cmd.number, tag=cmd.tag)
