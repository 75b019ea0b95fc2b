"""Fork and lifecycle control on the edge service: fork a sandbox, give a running one another
ttl, read its metrics, list and delete the project's checkpoints.

Routes (:func:`setup`)::

    POST   /v1/sandboxes/{id}/fork     {"count": n, ...options}  n sandboxes continuing from this one
    POST   /v1/sandboxes/{id}/ttl      {"ttl": seconds}          destroyed that many seconds from now
    GET    /v1/sandboxes/{id}/metrics                             CPU, memory, pids, disk, commands
    GET    /v1/checkpoints                                        the project's checkpoints
    DELETE /v1/checkpoints/{name}                                 drop one's ref (gc does the rest)

Ownership is the service's (docs/SECURITY.md, "Tenancy"): a sandbox through
``EdgeContext.sandbox`` (another project's id answers 404), a checkpoint by its
document's ``layerbox.project`` label under the project's ref namespace
``projects/<project>/`` (another project's name answers 404 as a missing one does).
Every field is validated in :mod:`sandbox.core.model` first (400 naming it).

A fork is one checkpoint restored ``count`` times on this edge
(:meth:`sandbox.host.manager.Sandbox.fork`): quota and admission are taken for all of
them before the checkpoint (as a run resume does), and either every fork is
running when the answer comes or none is left.  The forks start with the
source's options (env, workdir, user, limits, labels, network, policy version;
what the request gives goes over them) and its files as they were at the
checkpoint; processes are not carried.  The checkpoint is an ordinary one of the
project: listed by ``GET /v1/checkpoints``, restorable again, deletable.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from layerstore.errors import LayerboxError
from layerstore.objects import BadName, parse_ref
from sandbox.core.errors import ApiError, InvalidField
from sandbox.core.model import (
    MAX_REF_NAME,
    PROJECT_LABEL,
    RESERVED_LABEL_PREFIX,
    SandboxOptions,
    check_object,
    check_str,
    project_namespace,
)
from sandbox.core.views import SandboxInfo
from sandbox.edge.auth import Project
from sandbox.edge.context import EdgeContext

MAX_WALK = 200_000  # entries of an upper directory counted for its disk use; past it the figure is partial


def setup(ctx: EdgeContext, app: web.Application) -> None:
    routes = Lifecycle(ctx)
    router = app.router
    router.add_post("/v1/sandboxes/{id}/fork", routes.fork)
    router.add_post("/v1/sandboxes/{id}/ttl", routes.set_ttl)
    router.add_get("/v1/sandboxes/{id}/metrics", routes.metrics)
    router.add_get("/v1/checkpoints", routes.checkpoints)
    router.add_delete("/v1/checkpoints/{name:.+}", routes.delete_checkpoint)


class Lifecycle:
    """The handlers, over one service (its auth, ownership checks, quota and admission)."""

    def __init__(self, ctx: EdgeContext) -> None:
        self.ctx = ctx

    async def fork(self, request: web.Request) -> web.Response:
        svc = self.ctx
        project = svc.project(request)
        box, state = await svc.sandbox(request, project)
        extra = ("count",)
        body = check_object("", await svc.body(request), (*SandboxOptions.CLIENT_FIELDS, *extra))
        count = svc.maxima.check_count(1 if body.get("count") is None else body["count"])
        SandboxOptions.from_json(body, extra=extra)  # every field checked before anything is taken
        if not state.live:
            raise ApiError(None, "conflict", f"sandbox {box.id} is {state.status}: only a running or paused "
                                            "sandbox can be forked")
        base = SandboxOptions.from_state(state.options.carried()).replace(policy_version=state.policy_version)
        options = svc.options(project, body, extra=extra, base=base)

        async def start() -> dict[str, Any]:
            ckpt, forks = await box.fork(count, options)
            return {"source": box.id, "checkpoint": ckpt.to_json(), "sandboxes": await svc.views(forks)}

        return await svc.launch(project, [options] * count, start)

    async def set_ttl(self, request: web.Request) -> web.Response:
        svc = self.ctx
        box, _ = await svc.sandbox(request, svc.project(request))
        body = check_object("", await svc.body(request), ("ttl",))
        if body.get("ttl") is None:
            raise InvalidField("ttl", "is required: the seconds from now after which the sandbox is destroyed")
        seconds = svc.maxima.check_ttl(body["ttl"])
        state = await asyncio.to_thread(box.set_ttl, seconds, max_lifetime=svc.maxima.ttl)
        return web.json_response(SandboxInfo.of(state).to_json())

    async def metrics(self, request: web.Request) -> web.Response:
        svc = self.ctx
        box, state = await svc.sandbox(request, svc.project(request))
        return web.json_response(await asyncio.to_thread(box.usage))

    async def checkpoints(self, request: web.Request) -> web.Response:
        project = self.ctx.project(request)
        if request.query:
            key = next(iter(request.query))
            raise InvalidField(key[:64], "unknown query parameter (this listing takes none)")
        prefix = project_namespace(project.name)
        async with await self.ctx.manager.open_store() as store:
            refs = [r for r in await store.list_refs(prefix) if r.kind == "checkpoint"]
            docs = await asyncio.gather(*(store.get_doc(r.digest) for r in refs), return_exceptions=True)
        out = [describe(ref.name, ref.digest, doc) for ref, doc in zip(refs, docs, strict=True)
               if isinstance(doc, dict) and owned(project, doc)]
        return web.json_response({"checkpoints": sorted(out, key=lambda c: (str(c["created"]), c["name"]))})

    async def delete_checkpoint(self, request: web.Request) -> web.Response:
        """Drop the ref; gc deletes what nothing else reaches (a sandbox running on it keeps its
        mounted layers; a run manifest naming it keeps it alive in the store)."""
        project = self.ctx.project(request)
        name = check_str("name", request.match_info["name"], max_len=MAX_REF_NAME + 256,
                         what="a checkpoint's ref name (as GET /v1/checkpoints lists it)")
        try:
            parse_ref(name)
        except BadName as exc:
            raise InvalidField("name", str(exc)) from None
        not_found = ApiError(None, "checkpoint_not_found", f"no checkpoint {name!r} in project {project.name!r}")
        await drop_checkpoint(self.ctx, project, name, not_found)
        return web.Response(status=204)


async def drop_checkpoint(ctx: EdgeContext, project: Project, name: str, not_found: ApiError) -> None:
    """Delete the ref ``name`` (checked against the ref grammar) if it is a checkpoint of
    ``project``'s under its namespace; ``not_found`` otherwise, whether missing or another's."""
    if not name.startswith(project_namespace(project.name)):
        raise not_found
    async with await ctx.manager.open_store() as store:
        try:
            ref = await store.read_ref(name)
            doc = await store.get_doc(ref.digest)
        except LayerboxError:
            raise not_found from None
        if ref.kind != "checkpoint" or not owned(project, doc):
            raise not_found
        await store.delete_ref(name)


def owned(project: Project, doc: dict[str, Any]) -> bool:
    """A checkpoint document of ``project``'s (its sandbox's project label), shared or not."""
    labels = doc.get("labels")
    return isinstance(labels, dict) and labels.get(PROJECT_LABEL) == project.name


def describe(name: str, digest: str, doc: dict[str, Any]) -> dict[str, Any]:
    labels, bound, stats = (_object(doc, k) for k in ("labels", "bound", "stats"))
    return {"name": name, "digest": digest, "created": doc.get("created"), "parent": doc.get("parent"),
            "base": doc.get("base"), "layers": len(doc.get("layers") or []),
            "labels": {k: v for k, v in labels.items() if not str(k).startswith(RESERVED_LABEL_PREFIX)},
            "shared": labels.get("layerbox.shared") == "true", "policy_version": bound.get("policy_version"),
            "bytes_changed": stats.get("bytes_changed")}


def _object(doc: dict[str, Any], key: str) -> dict[str, Any]:
    value = doc.get(key)
    return value if isinstance(value, dict) else {}


