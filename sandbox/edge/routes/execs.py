"""``POST /v1/sandboxes/{id}/exec``: one command, its output streamed as newline-delimited JSON::

    {"type": "stdout", "data": "<base64>"}
    {"type": "stderr", "data": "<base64>"}
    {"type": "truncated", "stream": "stdout", "offset": 1048576, "dropped_bytes": 5000, "keep": "head"}
                    (the stream skips dropped_bytes of output after its first offset bytes; with
                     "keep": "tail" the stream's last bytes follow, up to output_cap of them)
    {"type": "exit", "exit_code": 0, "signal": null, "truncated": false, "duration": 0.01,
     "timed_out": false, "oom_killed": false, "interrupted": null, "replayed": false}
    {"type": "error", "error": {...}}          (instead of "exit" when the exec failed)

The command runs on a worker thread; its output reaches the response through a bounded queue
(a slow reader slows the command, never the host).  A client that leaves gets its command
killed (``interrupted: "disconnect"`` in the receipt), never run on unobserved.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

from sandbox.core.errors import ApiError
from sandbox.core.model import ExecRequest
from sandbox.core.sync import own_thread, wait_in_loop
from sandbox.edge.context import EdgeContext
from sandbox.edge.errors import as_api_error
from sandbox.host.execs import Cancel, Cut, ExecResult
from sandbox.host.sandbox import Sandbox

STREAM_QUEUE = 64  # exec events buffered per request: a slow reader slows the command, never the host
Event = tuple[str, Any]


def setup(ctx: EdgeContext, app: web.Application) -> None:
    app.router.add_post("/v1/sandboxes/{id}/exec", Execs(ctx).exec)


class Execs:
    def __init__(self, ctx: EdgeContext) -> None:
        self.ctx = ctx

    async def exec(self, request: web.Request) -> web.StreamResponse:
        ctx = self.ctx
        project = ctx.project(request)
        box, state = await ctx.sandbox(request, project)
        req = ctx.maxima.check_exec(ExecRequest.from_json(await ctx.body(request)))
        if state.status != "running":
            raise ApiError(None, "conflict", f"sandbox {box.id} is {state.status}, not running")
        ctx.refuse_when_stopping()
        with ctx.usage.take(project.name, "commands"):
            return await self._stream(request, box, req, project.name)

    async def _stream(self, request: web.Request, box: Sandbox, req: ExecRequest,
                      project: str) -> web.StreamResponse:
        ctx = self.ctx
        events: asyncio.Queue[Event] = asyncio.Queue(STREAM_QUEUE)
        cancel = Cancel()
        forward = _forwarder(events, cancel, asyncio.get_running_loop())
        cut_at = forward("truncated")

        def on_cut(cut: Cut) -> None:
            cut_at({**cut.to_json(), "keep": req.keep})

        # streamed, not kept: the service never buffers a command's output beyond the queue; on a
        # thread of its own, for as long as the command runs (never the control plane's executor)
        ctx.streams.add(cancel)
        run = own_thread(lambda: box.exec(req, on_stdout=forward("stdout"), on_stderr=forward("stderr"),
                                          cancel=cancel, keep_output=False, on_cut=on_cut), name="layerbox-exec")
        run.add_done_callback(lambda _: ctx.streams.discard(cancel))
        ctx.metrics.execs.labels(project).inc()
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        await _relay(request, resp, events, run, cancel)
        await _write(resp, self._final(run))
        await resp.write_eof()
        return resp

    def _final(self, run: asyncio.Future[ExecResult]) -> dict[str, Any]:
        try:
            result = run.result()
        except Exception as exc:
            err = as_api_error(exc)
            self.ctx.metrics.errors.labels(err.code).inc()
            return {"type": "error", **err.body()}
        self.ctx.metrics.exec_seconds.observe(result.duration)
        return {"type": "exit", "exit_code": result.exit_code, "signal": result.signal,
                "truncated": result.truncated, "duration": result.duration, "timed_out": result.timed_out,
                "oom_killed": result.oom_killed, "interrupted": result.interrupted, "replayed": result.replayed}


def _forwarder(events: asyncio.Queue[Event], cancel: Cancel,
               loop: asyncio.AbstractEventLoop) -> Callable[[str], Callable[[Any], None]]:
    """Callbacks for the exec's thread: each hands its event to the loop's queue, waiting while the
    queue is full (the pipe then stops the command), until the command is cancelled."""
    def forward(kind: str) -> Callable[[Any], None]:
        def push(data: Any) -> None:  # the manager hands over at most output_cap bytes per stream
            if not cancel.is_set():
                wait_in_loop(loop, events.put((kind, data)), stop=cancel)
        return push
    return forward


async def _relay(request: web.Request, resp: web.StreamResponse, events: asyncio.Queue[Event],
                 run: asyncio.Future[ExecResult], cancel: Cancel) -> None:
    """Send events as they come until the command ends, woken by the next one or by the end,
    whichever comes first (the exit goes out the moment the exec returns, never after a poll)."""
    getter: asyncio.Future[Event] | None = None
    try:
        while True:
            if request.transport is None or request.transport.is_closing():
                raise ConnectionResetError("client went away")
            if getter is None:
                getter = asyncio.ensure_future(events.get())
            waiting: set[asyncio.Future[Any]] = {getter, run}
            done, _ = await asyncio.wait(waiting, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            if getter in done:
                await _write(resp, _event(getter.result()))
                getter = None
            elif run.done():
                break
        # the exec thread hands every chunk over before it returns: what is left is queued
        if getter is not None:
            getter.cancel()
            if getter.done() and not getter.cancelled():
                await _write(resp, _event(getter.result()))
        while not events.empty():
            await _write(resp, _event(events.get_nowait()))
    except (ConnectionResetError, asyncio.CancelledError):
        if getter is not None:
            getter.cancel()
        # the client left: kill the command (its receipt says so) instead of running it unobserved
        cancel.cancel("disconnect")
        await asyncio.wait([run])
        raise


def _event(event: Event) -> dict[str, Any]:
    kind, data = event
    return {"type": kind, **data} if isinstance(data, dict) else {"type": kind,
                                                                  "data": base64.b64encode(data).decode()}


async def _write(resp: web.StreamResponse, doc: dict[str, Any]) -> None:
    await resp.write(json.dumps(doc).encode() + b"\n")
