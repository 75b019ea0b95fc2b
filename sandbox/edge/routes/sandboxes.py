"""Sandboxes: create, restore, list, get, delete, pause, resume, checkpoint, receipts, network.

Create and restore resolve the ref once, check its owner, and hand the manager the checked
digest.  Every field is validated once (:mod:`sandbox.core.model`) against the model's bounds
and this edge's :class:`~sandbox.core.model.Maxima`: a bad one answers 400 ``invalid_field``
with ``error.field`` naming it, before anything is looked up or taken.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from layerstore.objects import BadName, parse_ref
from sandbox.core.errors import ApiError, UnsupportedOption
from sandbox.core.model import (
    ISOLATIONS,
    MAX_REF_NAME,
    PROJECT_LABEL,
    SandboxFilter,
    SandboxOptions,
    check_labels,
    check_number,
    check_object,
    check_str,
    project_namespace,
)
from sandbox.core.views import SandboxInfo
from sandbox.edge.context import EdgeContext
from sandbox.edge.errors import invalid


def setup(ctx: EdgeContext, app: web.Application) -> None:
    routes = Sandboxes(ctx)
    r = app.router
    r.add_post("/v1/sandboxes", routes.create)
    r.add_get("/v1/sandboxes", routes.list)
    r.add_get("/v1/sandboxes/{id}", routes.get)
    r.add_delete("/v1/sandboxes/{id}", routes.delete)
    r.add_post("/v1/sandboxes/{id}/pause", routes.pause)
    r.add_post("/v1/sandboxes/{id}/resume", routes.resume)
    r.add_post("/v1/sandboxes/{id}/checkpoint", routes.checkpoint)
    r.add_post("/v1/sandboxes/restore", routes.restore)
    r.add_get("/v1/sandboxes/{id}/receipts", routes.receipts)
    r.add_put("/v1/sandboxes/{id}/network", routes.network)


class Sandboxes:
    def __init__(self, ctx: EdgeContext) -> None:
        self.ctx = ctx

    async def create(self, request: web.Request) -> web.Response:
        ctx = self.ctx
        project = ctx.project(request)
        body = await ctx.body(request)
        image = check_str("image", body.get("image"), max_len=512, what="an image or checkpoint ref")
        SandboxOptions.from_json(body, extra=("image",))  # every field checked before any lookup
        isolation = body.get("isolation") or "container"
        if isolation in ISOLATIONS:
            caps = await ctx.capabilities(isolation)
            if not caps.available:
                raise ApiError(None, "unsupported_isolation", f"isolation {isolation!r} is not available on this "
                               f"edge: {caps.reason}", field="isolation")
        resolved = await ctx.resolve(project, image, field="image", kinds=("image", "composition", "checkpoint"))
        options = ctx.options(project, body, extra=("image",), base=await ctx.carried(resolved))
        return await ctx.launch(project, [options], lambda: ctx.create(resolved, options, image))

    async def restore(self, request: web.Request) -> web.Response:
        """A new sandbox from a checkpoint this project made (on any edge of the store)."""
        ctx = self.ctx
        project = ctx.project(request)
        body = await ctx.body(request)
        ref = check_str("checkpoint", body.get("checkpoint"), max_len=512, what="a checkpoint ref or digest")
        SandboxOptions.from_json(body, extra=("checkpoint", "count"))  # every field checked before any lookup
        count = None if body.get("count") is None else ctx.maxima.check_count(body["count"])
        resolved = await ctx.resolve(project, ref, field="checkpoint", kinds=("checkpoint",))
        options = ctx.options(project, body, extra=("checkpoint", "count"), base=await ctx.carried(resolved))
        if count is not None:  # {"sandboxes": [...]}: all of them or none, quota and capacity for all first
            async def restored() -> dict[str, Any]:
                boxes = await ctx.manager.restore_many(resolved.digest, count, options, name=ref)
                return {"sandboxes": await ctx.views(boxes)}
            return await ctx.launch(project, [options] * count, restored)
        return await ctx.launch(project, [options], lambda: ctx.manager.restore(resolved.digest, options, name=ref))

    async def list(self, request: web.Request) -> web.Response:
        project = self.ctx.project(request)
        wanted = SandboxFilter.from_query(list(request.query.items()))  # ?label=k=v&state=running
        owned = await asyncio.to_thread(self.ctx.owned, project)
        return web.json_response({"sandboxes": [SandboxInfo.of(st).to_json() for st in owned if wanted.matches(st)]})

    async def get(self, request: web.Request) -> web.Response:
        _, state = await self.ctx.sandbox(request, self.ctx.project(request))
        return web.json_response(SandboxInfo.of(state).to_json())

    async def delete(self, request: web.Request) -> web.Response:
        box, _ = await self.ctx.sandbox(request, self.ctx.project(request))
        await asyncio.to_thread(self.ctx.manager.destroy, box.id)
        return web.Response(status=204)

    async def pause(self, request: web.Request) -> web.Response:
        box, _ = await self.ctx.sandbox(request, self.ctx.project(request))
        return web.json_response(await asyncio.to_thread(box.pause))

    async def resume(self, request: web.Request) -> web.Response:
        box, _ = await self.ctx.sandbox(request, self.ctx.project(request))
        await asyncio.to_thread(box.resume)
        return web.json_response((await self.ctx.views([box]))[0])

    async def checkpoint(self, request: web.Request) -> web.Response:
        ctx = self.ctx
        project = ctx.project(request)
        box, _ = await ctx.sandbox(request, project)
        body = check_object("", await ctx.body(request), ("name", "labels", "memory"))
        memory = body.get("memory", False)
        if not isinstance(memory, bool):
            raise invalid("memory", f"expected true or false, got {type(memory).__name__}")
        labels = check_labels("labels", body.get("labels") or {}, reserved_ok=project.admin)
        if project.admin and set(labels) & {PROJECT_LABEL}:  # sharing is a label; ownership stays the sandbox's
            raise invalid(f"labels.{PROJECT_LABEL}", "a checkpoint's project is its sandbox's")
        name = None
        if body.get("name") is not None:
            given = check_str("name", body["name"], max_len=MAX_REF_NAME, what="a ref name (repo[:tag])")
            # a project names refs only inside its namespace; an admin project may publish anywhere
            name = given if project.admin else project_namespace(project.name) + given
            try:
                parse_ref(name)
            except BadName as exc:
                raise invalid("name", str(exc)) from None
        try:
            ckpt = await box.checkpoint(name=name, labels=labels, memory=memory)
        except UnsupportedOption as exc:
            raise invalid("memory", str(exc)) from None
        return web.json_response(ckpt.to_json(), status=201)

    async def receipts(self, request: web.Request) -> web.Response:
        """Receipts, oldest first; ``action``, ``since`` (Unix time) and ``idempotency_key`` filter them."""
        box, _ = await self.ctx.sandbox(request, self.ctx.project(request))
        # checked whole before any filter (once per content): the head lets a caller notice a log cut at its end
        rows, checked = await asyncio.to_thread(box.receipt_history)
        head = checked["head"]
        q = request.query
        if "action" in q:
            rows = [r for r in rows if r.get("action") == q["action"]]
        if "idempotency_key" in q:
            rows = [r for r in rows if r.get("idempotency_key") == q["idempotency_key"]]
        if "since" in q:
            try:
                since = check_number("since", float(q["since"]), 0.0, 1e12)
            except ValueError:
                raise invalid("since", "must be a Unix time in seconds") from None
            rows = [r for r in rows if float(r.get("time", 0)) >= since]
        return web.json_response({"sandbox": box.id, "head": head, "receipts": rows})

    async def network(self, request: web.Request) -> web.Response:
        box, _ = await self.ctx.sandbox(request, self.ctx.project(request))
        body = check_object("", await self.ctx.body(request), ("rules",))
        rules = SandboxOptions(network=body.get("rules")).network  # the one validation of rules
        if rules is None:
            raise invalid("rules", "is required: a list of egress allow rules ([] denies everything)")
        self.ctx.maxima.check(SandboxOptions(network=rules))
        return web.json_response(await asyncio.to_thread(box.set_network, list(rules)))
