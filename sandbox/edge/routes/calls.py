"""FnCall: ``POST /v1/calls`` runs one command or Python function on a fresh warm-pool sandbox of
an image (sandbox.pools.fncall) and answers its result whole."""

from __future__ import annotations

import base64

from aiohttp import web

from sandbox.core.model import ExecRequest, check_number, check_object, check_str
from sandbox.edge.context import EdgeContext, while_caller_waits
from sandbox.edge.errors import invalid
from sandbox.pools.fncall import FnCalls

MAX_FUNCTION_SOURCE = 1 << 20
MAX_POOLS_PER_PROJECT = 4  # warm pools (images) one project keeps at once: its FnCalls never take another's


def setup(ctx: EdgeContext, app: web.Application, *, pool_size: int = 2) -> None:
    routes = Calls(ctx, pool_size)
    app.router.add_post("/v1/calls", routes.call)  # (the app closes ctx.fncalls when it stops)


class Calls:
    def __init__(self, ctx: EdgeContext, pool_size: int) -> None:
        self.ctx = ctx
        self.pool_size = pool_size

    async def call(self, request: web.Request) -> web.Response:
        ctx = self.ctx
        project = ctx.project(request)
        body = check_object("", await ctx.body(request), ("image", "cmd", "function", "args", "kwargs", "timeout"))
        image = check_str("image", body.get("image"), max_len=512, what="an image ref")
        cmd, function = body.get("cmd"), body.get("function")
        if (cmd is None) == (function is None):
            raise invalid("cmd", "give exactly one of 'cmd' and 'function'")
        timeout = check_number("timeout", body.get("timeout", 30.0), 0.0, ctx.maxima.exec_timeout, lo_open=True)
        if cmd is not None:
            cmd = ExecRequest(cmd=cmd).cmd  # the one validation of a command
        else:
            function = check_str("function", function, max_len=MAX_FUNCTION_SOURCE, what="Python source")
        args, kwargs = body.get("args") or [], body.get("kwargs") or {}
        if not isinstance(args, list):
            raise invalid("args", "must be a list of JSON values")
        if not isinstance(kwargs, dict):
            raise invalid("kwargs", "must be an object of JSON values")
        if cmd is not None and (args or kwargs):  # a command's arguments are its argv
            raise invalid("args" if args else "kwargs", "goes with 'function', not with 'cmd'")
        # the pool runs exactly what was checked: its key is the resolved digest
        resolved = await ctx.resolve(project, image, field="image", kinds=("image", "composition", "checkpoint"))
        if ctx.fncalls is None:
            # each project's pools, the operator's sandboxes within the host's capacity until lent
            ctx.fncalls = FnCalls(ctx.manager, size=self.pool_size, max_pools=MAX_POOLS_PER_PROJECT,
                                  admit=lambda owner: lambda options: ctx.capacity([options]))
        ctx.metrics.execs.labels(project.name).inc()
        # a call in flight is a command and a sandbox of the project; a caller who leaves cancels it
        with ctx.usage.take(project.name, "commands"):
            async with ctx.lent(project.name, project.max_sandboxes):
                result = await while_caller_waits(request, ctx.fncalls.call(
                    resolved.digest, cmd, function=function, args=args, kwargs=kwargs or None, timeout=timeout,
                    owner=project.name))
        ctx.metrics.call_seconds.observe(result.duration)
        return web.json_response({
            "exit_code": result.exit_code, "stdout": base64.b64encode(result.stdout).decode(),
            "stderr": base64.b64encode(result.stderr).decode(), "value": result.value, "error": result.error,
            "timed_out": result.timed_out, "truncated": result.truncated, "duration": result.duration,
            "wait_seconds": result.wait_seconds})
