"""Jobs and runs: a job's lease, pause and resume of its sandboxes, its preemption into a run
manifest, and resuming a run manifest (``/v1/jobs/{job}/...``, ``/v1/runs/resume``).

Jobs are per project (the manager sees ``<project>/<job>``); a run manifest belongs to its
job's project.  A resume takes quota and capacity for every sandbox before the first restore.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from sandbox.core.errors import ApiError
from sandbox.core.model import SandboxOptions, check_number, check_object, check_str
from sandbox.edge.context import EdgeContext
from sandbox.edge.errors import invalid
from sandbox.host.runs import preempt, resume_run


def setup(ctx: EdgeContext, app: web.Application) -> None:
    routes = Jobs(ctx)
    r = app.router
    r.add_post("/v1/jobs/{job}/renew", routes.renew)
    r.add_post("/v1/jobs/{job}/pause", routes.pause)
    r.add_post("/v1/jobs/{job}/resume", routes.resume)
    r.add_post("/v1/jobs/{job}/preempt", routes.preempt)
    r.add_post("/v1/runs/resume", routes.resume_run)


class Jobs:
    def __init__(self, ctx: EdgeContext) -> None:
        self.ctx = ctx

    async def renew(self, request: web.Request) -> web.Response:
        ctx = self.ctx
        job = ctx.job(ctx.project(request), request.match_info["job"])
        body = check_object("", await ctx.body(request), ("ttl",))
        ttl = body.get("ttl")
        if ttl is not None:
            ttl = check_number("ttl", ttl, 0.0, ctx.maxima.lease_ttl, lo_open=True)
        lease = await asyncio.to_thread(ctx.manager.renew, job, ttl)
        return web.json_response({**lease, "job": request.match_info["job"]})

    async def pause(self, request: web.Request) -> web.Response:
        job = self.ctx.job(self.ctx.project(request), request.match_info["job"])
        return web.json_response({"sandboxes": await asyncio.to_thread(self.ctx.manager.pause_job, job)})

    async def resume(self, request: web.Request) -> web.Response:
        job = self.ctx.job(self.ctx.project(request), request.match_info["job"])
        return web.json_response({"sandboxes": await asyncio.to_thread(self.ctx.manager.resume_job, job)})

    async def preempt(self, request: web.Request) -> web.Response:
        ctx = self.ctx
        job = ctx.job(ctx.project(request), request.match_info["job"])
        body = check_object("", await ctx.body(request), ("timeout",))
        grace = check_number("timeout", body.get("timeout", 30.0), 0.0, ctx.maxima.exec_timeout)
        if not await asyncio.to_thread(ctx.manager.list, job=job):
            raise ApiError(None, "not_found", f"job {request.match_info['job']!r} has no sandboxes here")
        run = await preempt(ctx.manager, job, timeout=grace)
        ctx.metrics.preempt_seconds.observe(run.seconds)
        return web.json_response(run.to_json(), status=201)

    async def resume_run(self, request: web.Request) -> web.Response:
        ctx = self.ctx
        project = ctx.project(request)
        body = check_object("", await ctx.body(request), ("manifest",))
        ref = check_str("manifest", body.get("manifest"), max_len=512, what="a run manifest ref or digest")
        resolved = await ctx.resolve(project, ref, field="manifest", kinds=("run",))
        entries = resolved.doc.get("sandboxes") or {}
        if not isinstance(entries, dict):
            raise invalid("manifest", f"{ref} has no sandbox entries")
        # the whole job or nothing: quota and capacity for every sandbox before the first restore
        demands = [SandboxOptions.from_state((e or {}).get("options") or {}) if isinstance(e, dict)
                   else SandboxOptions() for e in entries.values()]

        async def resume() -> dict[str, Any]:
            return (await resume_run(ctx.manager, resolved.digest, lease_ttl=ctx.lease_ttl)).to_json()

        return await ctx.launch(project, demands, resume)
