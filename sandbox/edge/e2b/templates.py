"""E2B's templates and snapshots over the store's refs.

**Templates** are what a project may start: the images and compositions the operator published
(any ref outside ``projects/``), the checkpoints an admin project shared (``layerbox.shared``),
and the project's own snapshots.  A template's name is its ref name (``img/python``,
``img/python:3.12``); ``templateID`` and its one alias are that name without ``:latest``.
Its isolation is the label ``layerbox.isolation`` (container, microvm, vm): on a checkpoint's
document, in an image's config ``Labels``, or what a VM checkpoint is bound to (a checkpoint
of a microVM sandbox is a microVM template); container otherwise.

**Snapshots** (``POST /sandboxes/{id}/snapshots``) are checkpoints of the sandbox, named
``projects/<project>/snapshots/<name>`` (``<name>`` as given, else ``<sandbox id>:<random>``).
The full ref name is the ``snapshotID``: ``Sandbox.create(<snapshotID>)`` starts from it as
from any template (the short ``<name>`` works too when no published ref has that name).
``GET /snapshots`` lists them (by creation, paginated as the SDK reads: ``limit``,
``nextToken`` and the ``x-next-token`` header); ``DELETE /templates/{id}`` drops a snapshot's
ref (the SDK's ``delete_snapshot``), as ``DELETE /v1/checkpoints/{name}`` does.

Building templates through E2B's build API (``/v2/templates``, ``/v3/templates``, builds,
tags, files) is not part of layerbox's E2B surface: those routes answer 501 naming
``layerbox publish`` instead.
"""

from __future__ import annotations

import asyncio
import datetime
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from aiohttp import web

from layerstore.objects import BadName, Resolved, parse_ref
from sandbox.core.errors import ApiError, InvalidField
from sandbox.core.model import (
    MAX_REF_NAME,
    SandboxOptions,
    check_int,
    check_object,
    check_sandbox_id,
    check_str,
    project_namespace,
)
from sandbox.edge.auth import Project
from sandbox.edge.context import SHARED_LABEL, EdgeContext
from sandbox.edge.e2b.base import ENVD_VERSION, E2bContext, sandbox_id_of
from sandbox.edge.routes.lifecycle import drop_checkpoint, owned

T = TypeVar("T")
ISOLATION_LABEL = "layerbox.isolation"  # on a template's document: container (default), microvm, vm
SOURCE_LABEL = "layerbox.e2b.sandbox"  # on a snapshot's document: the sandbox it was taken of
SNAPSHOTS = "snapshots/"  # under the project's namespace
KINDS = ("image", "composition", "checkpoint")
MAX_PAGE = 100
MiB = 1 << 20
EPOCH = "1970-01-01T00:00:00Z"
BUILD_API = ("building templates through E2B's build API is not supported by layerbox: publish an image "
             "with `layerbox publish <image> --name <template>` (or checkpoint a sandbox and share it); "
             "see docs/E2B.md")


def setup(e2b: E2bContext, app: web.Application) -> Templates:
    routes = Templates(e2b)
    r = app.router
    r.add_post("/sandboxes/{id}/snapshots", routes.create_snapshot, name="e2b:snapshot")
    r.add_get("/snapshots", routes.list_snapshots, name="e2b:snapshots")
    r.add_get("/templates", routes.list_templates, name="e2b:templates")
    r.add_get("/templates/aliases/{alias:.+}", routes.alias, name="e2b:alias")
    r.add_delete("/templates/{id:.+}", routes.delete, name="e2b:delete-template")
    # what is left under the template routes is the build API (after the routes above: aiohttp
    # tries resources in the order they were added)
    for i, path in enumerate(("/templates", "/templates/{tail:.+}", "/v2/templates", "/v2/templates/{tail:.+}",
                              "/v3/templates", "/v3/templates/{tail:.+}")):
        r.add_route("*", path, build_api, name=f"e2b:build{i}")
    return routes


async def build_api(request: web.Request) -> web.Response:
    raise ApiError(501, "not_implemented", BUILD_API)


class Templates:
    def __init__(self, e2b: E2bContext) -> None:
        self.e2b = e2b
        self.ctx: EdgeContext = e2b.ctx

    async def resolve(self, project: Project, name: str) -> Resolved:
        """The template ``name`` (``templateID``): a published ref, a shared checkpoint, a snapshot
        by its id, or, when nothing published has that name, the project's snapshot ``name``."""
        try:
            return await self.ctx.resolve(project, name, field="templateID", kinds=KINDS)
        except ApiError as exc:
            if exc.code != "image_not_found" or name.startswith("projects/"):
                raise
            try:
                return await self.ctx.resolve(project, snapshot_ref(project, name), field="templateID",
                                              kinds=("checkpoint",))
            except (ApiError, InvalidField):
                raise exc from None

    # -- snapshots -----------------------------------------------------------------------------------
    async def create_snapshot(self, request: web.Request) -> web.Response:
        project = self.e2b.project(request)
        body = check_object("", await self.ctx.body(request), ("name", "memory"))
        name = body.get("name")
        sid = sandbox_id_of(request.match_info["id"], project.name)
        ref = snapshot_ref(project, f"{sid}:{uuid.uuid4().hex[:12]}" if name is None else
                           check_str("name", name, max_len=MAX_REF_NAME, what="a snapshot name like my-snapshot"),
                           field="name")
        memory = body.get("memory")
        if memory is not None and not isinstance(memory, bool):
            raise InvalidField("memory", "must be true or false")
        box, state = await self.e2b.sandbox(request, project, sid)
        isolation = state.options.isolation
        caps = await asyncio.to_thread(box.backend.capabilities, isolation)
        if memory and not caps.has("memory_checkpoint"):
            raise InvalidField("memory", f"sandbox {sid} is a {isolation}: its snapshots hold its files, not its "
                                         "memory (mode='filesystem'; microVMs snapshot memory too)")
        ckpt = await box.checkpoint(name=ref, labels={SOURCE_LABEL: sid},
                                    memory=caps.has("memory_checkpoint") if memory is None else memory)
        return web.json_response({"snapshotID": ckpt.name, "names": [ckpt.name]}, status=201)

    async def list_snapshots(self, request: web.Request) -> web.Response:
        project = self.e2b.project(request)
        q = request.query
        check_query(q, ("sandboxID", "name", "limit", "nextToken"))
        sid = check_sandbox_id(q["sandboxID"], "sandboxID") if "sandboxID" in q else None
        name = check_str("name", q["name"], max_len=MAX_REF_NAME + 64, what="a snapshot name") if "name" in q \
            else None
        limit, after = page_query(q)
        prefix = project_namespace(project.name) + SNAPSHOTS
        found = await self._documents(prefix, kinds=("checkpoint",))
        rows = [(ref, doc) for ref, _, _, doc in found if owned(project, doc)
                and (sid is None or _labels(doc).get(SOURCE_LABEL) == sid)
                and (name is None or name in _names(ref, prefix))]
        rows.sort(key=lambda row: (str(row[1].get("created")), row[0]))
        page, next_token = paginate(rows, lambda row: row[0], after, limit)
        headers = {"x-next-token": next_token} if next_token else {}
        return web.json_response([{"snapshotID": ref, "names": [ref]} for ref, _ in page], headers=headers)

    async def delete(self, request: web.Request) -> web.Response:
        """The SDK's ``delete_snapshot``: a snapshot (or another checkpoint) of the project's."""
        project = self.e2b.project(request)
        given = check_str("templateID", request.match_info["id"], max_len=MAX_REF_NAME + 64,
                          what="a snapshot id (as create_snapshot answered it)")
        name = given if given.startswith("projects/") else snapshot_ref(project, given, field="templateID")
        if ":" not in name.rpartition("/")[2]:
            name += ":latest"
        not_found = ApiError(None, "checkpoint_not_found", f"no snapshot {given!r} in project {project.name!r} "
                                                           "(templates the operator published are not deleted here)")
        await drop_checkpoint(self.ctx, project, name, not_found)
        return web.Response(status=204)

    # -- templates ------------------------------------------------------------------------------------
    async def list_templates(self, request: web.Request) -> web.Response:
        project = self.e2b.project(request)
        check_query(request.query, ("teamID",))
        if "teamID" in request.query:
            raise InvalidField("teamID", "layerbox has no teams: the X-API-Key names the project")
        namespace = project_namespace(project.name)
        found = await self._documents("", kinds=KINDS, keep=lambda n: n.startswith(namespace)
                                      or not n.startswith("projects/"))
        out = [template_view(name, digest, kind, doc) for name, digest, kind, doc in found
               if kind != "checkpoint" or owned(project, doc) or _labels(doc).get(SHARED_LABEL) == "true"]
        return web.json_response(sorted(out, key=lambda t: t["templateID"]))

    async def alias(self, request: web.Request) -> web.Response:
        """``Template.exists(name)``: 200 when the project may start ``name``, 404 when not."""
        project = self.e2b.project(request)
        name = check_str("alias", request.match_info["alias"], max_len=MAX_REF_NAME + 64, what="a template name")
        resolved = await self.resolve(project, name)
        return web.json_response({"templateID": alias_of(name), "public": public(resolved.kind, resolved.doc)})

    async def _documents(self, prefix: str, *, kinds: Sequence[str], keep: Callable[[str], bool] = lambda n: True,
                         ) -> list[tuple[str, str, str, dict[str, Any]]]:
        """(name, digest, kind, document) of every readable ref under ``prefix`` of ``kinds``."""
        async with await self.ctx.manager.open_store() as store:
            refs = [r for r in await store.list_refs(prefix) if r.kind in kinds and keep(r.name)]
            docs = await asyncio.gather(*(store.get_doc(r.digest) for r in refs), return_exceptions=True)
        return [(r.name, r.digest, r.kind, doc) for r, doc in zip(refs, docs, strict=True) if isinstance(doc, dict)]


# -- the model ----------------------------------------------------------------------------------------------
def snapshot_ref(project: Project, name: str, *, field: str = "templateID") -> str:
    """The ref of the project's snapshot ``name`` (``my-snapshot`` or ``my-snapshot:v1``), with its
    tag (``:latest`` when it names none), as the store lists it."""
    try:
        repo, tag = parse_ref(project_namespace(project.name) + SNAPSHOTS + name)
    except BadName as exc:
        raise InvalidField(field, str(exc)) from None
    return f"{repo}:{tag}"


def isolation_of(doc: Mapping[str, Any], carried: str | None = None) -> str:
    """A template's isolation (see the module's docstring); ``carried``: what a checkpoint's
    sandbox ran as (its carried options: a microVM's disk restores only as a microVM)."""
    config = doc.get("config") if isinstance(doc.get("config"), Mapping) else {}
    inner = config.get("config", config) if isinstance(config, Mapping) else {}
    image_labels = inner.get("Labels") if isinstance(inner, Mapping) else None
    bound = doc.get("bound") if isinstance(doc.get("bound"), Mapping) else {}
    for value in (_labels(doc).get(ISOLATION_LABEL),
                  image_labels.get(ISOLATION_LABEL) if isinstance(image_labels, Mapping) else None,
                  bound.get("isolation") if isinstance(bound, Mapping) else None, carried):
        if value in ("container", "microvm", "vm"):
            return str(value)
    return "container"


def alias_of(name: str) -> str:
    return name.removesuffix(":latest")


def public(kind: str, doc: Mapping[str, Any]) -> bool:
    return kind != "checkpoint" or _labels(doc).get(SHARED_LABEL) == "true"


def template_view(name: str, digest: str, kind: str, doc: Mapping[str, Any]) -> dict[str, Any]:
    """E2B's ``Template`` for a ref (sizes are a sandbox's defaults: a template does not fix them)."""
    defaults = SandboxOptions()
    config = doc.get("config") if isinstance(doc.get("config"), Mapping) else {}
    created = doc.get("created") or (config.get("created") if isinstance(config, Mapping) else None) or EPOCH
    created = _iso(created)
    return {"templateID": alias_of(name), "buildID": digest, "cpuCount": max(1, int(defaults.cpu)),
            "memoryMB": defaults.memory // MiB, "diskSizeMB": (defaults.disk or 0) // MiB,
            "public": public(kind, doc), "aliases": [alias_of(name)], "names": [name], "createdAt": created,
            "updatedAt": created, "createdBy": None, "lastSpawnedAt": None, "spawnCount": 0, "buildCount": 1,
            "envdVersion": ENVD_VERSION, "buildStatus": "ready",
            "description": f"a {kind}; isolation {isolation_of(doc)}"}


def page_query(query: Mapping[str, str]) -> tuple[int, str | None]:
    """``limit`` (1..MAX_PAGE, default MAX_PAGE) and ``nextToken`` of a paginated listing."""
    limit = MAX_PAGE
    if "limit" in query:
        text = query["limit"]
        if not (text.isascii() and text.isdigit()):
            raise InvalidField("limit", f"{text[:20]!r} is not a number from 1 to {MAX_PAGE}")
        limit = check_int("limit", int(text), 1, MAX_PAGE)
    after = query.get("nextToken") or None
    if after is not None:
        check_str("nextToken", after, max_len=MAX_REF_NAME + 64, what="the x-next-token of the page before")
    return limit, after


def paginate(items: list[T], key: Callable[[T], str], after: str | None, limit: int) -> tuple[list[T], str | None]:
    """The page after the item whose key is ``after`` (none: the first), and the next page's token."""
    if after is not None:
        keys = [key(item) for item in items]
        items = items[keys.index(after) + 1:] if after in keys else []
    page = items[:limit]
    return page, key(page[-1]) if len(items) > limit else None


def check_query(query: Mapping[str, str], known: Sequence[str]) -> None:
    """Every parameter of ``query`` is one of ``known`` (an unknown one is a typo, never ignored)."""
    for key in query:
        if key not in known:
            raise InvalidField(key[:64], f"unknown query parameter (known: {', '.join(known)})")


def _labels(doc: Mapping[str, Any]) -> Mapping[str, Any]:
    labels = doc.get("labels")
    return labels if isinstance(labels, Mapping) else {}


def _names(ref: str, prefix: str) -> set[str]:
    """What a ``name`` filter may say of snapshot ``ref``: its id, its name with or without its tag."""
    short = ref.removeprefix(prefix)
    return {ref, short, short.rpartition(":")[0] or short}


def _iso(value: object) -> str:
    if not isinstance(value, str):
        return EPOCH
    try:
        when = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return EPOCH
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return when.astimezone(datetime.UTC).isoformat().replace("+00:00", "Z")
