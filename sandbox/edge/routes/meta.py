"""What the edge says of itself: its OpenAPI document, its capabilities, its load report, and
its Prometheus metrics (an admin project's token: they name every project)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from sandbox.core.errors import ApiError
from sandbox.core.model import ISOLATIONS
from sandbox.edge import openapi
from sandbox.edge.context import EdgeContext

# What the edge does whatever runs a sandbox; what depends on a backend comes from the backends
# (capabilities()).  A request for anything else is refused, never downgraded.
CAPABILITIES: dict[str, Any] = {
    "cpu_classes": ["latency", "best-effort"],
    "limits": ["cpu", "memory", "pids", "disk"],
    "network": {"default": "deny", "egress_rules": ["cidr", "host", "ports", "protocol"], "runtime_changes": True},
    "preemption": True,
    "fncall": True,
    "streaming": "ndjson",
    "output": {"keep": ["head", "tail"], "cut_events": True},
}


def setup(ctx: EdgeContext, app: web.Application) -> None:
    routes = Meta(ctx)
    r = app.router
    r.add_get("/openapi.json", routes.openapi)
    r.add_get("/metrics", routes.metrics)
    r.add_get("/v1/load", routes.load)
    r.add_get("/v1/capabilities", routes.capabilities)


class Meta:
    def __init__(self, ctx: EdgeContext) -> None:
        self.ctx = ctx

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi.DOCUMENT)

    async def load(self, request: web.Request) -> web.Response:
        project = self.ctx.project(request)  # any valid token may read it; it names no sandbox
        usage = self.ctx.usage
        # what the caller's project holds against its caps here (no other project's)
        mine = {"name": project.name, "holds": usage.of(project.name), "caps": dataclasses.asdict(usage.caps)}
        return web.json_response({**self.ctx.admission.report(), "project": mine})

    async def capabilities(self, request: web.Request) -> web.Response:
        self.ctx.project(request)
        backends = {isolation: await self.ctx.capabilities(isolation) for isolation in ISOLATIONS}

        def some(feature: str) -> bool:  # where at least one backend of this edge provides it
            return any(v.has(feature) for v in backends.values())

        return web.json_response({
            **CAPABILITIES,
            "isolation": [k for k, v in backends.items() if v.available],
            # processes are checkpointed where a backend checkpoints memory (a VM's RAM)
            "checkpoint": {"filesystem": some("checkpoint"), "processes": some("memory_checkpoint")},
            "commands": {"background": some("background"), "pty": some("interactive"), "websocket": True},
            "ports": {"http": some("ports"), "websocket": some("ports"), "signed_urls": some("ports")},
            "fork": some("fork"),
            "backends": {k: v.to_json() for k, v in backends.items()}})

    async def metrics(self, request: web.Request) -> web.Response:
        ctx = self.ctx
        if not ctx.project(request).admin:  # it names every project and its sandbox counts
            raise ApiError(None, "forbidden", "metrics need a token of an admin project")

        def render() -> bytes:
            m = ctx.metrics
            counts: dict[tuple[str, str], int] = {}
            for st in ctx.manager.list():
                key = (st.project or "", st.status)
                counts[key] = counts.get(key, 0) + 1
            m.sandboxes.clear()
            for (proj, status), n in counts.items():
                m.sandboxes.labels(proj, status).set(n)
            for resource, free in ctx.admission.free().items():
                m.free.labels(resource).set(free)
            for pool in list(ctx.ready_pools.values()):
                stats = pool.stats()
                m.ready.labels(pool.ref, "ready").set(stats["ready"])
                m.ready.labels(pool.ref, "adopted").set(stats["taken"])
                m.ready.labels(pool.ref, "stale").set(stats["stale"])
            return generate_latest(m.registry)

        body = await asyncio.to_thread(render)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
