"""E2B's control plane (its OpenAPI ``spec/openapi.yml``) over the edge's context.

Each route reads E2B's body, turns it into the native model once (:func:`create_options`: a
bad field is a 400 naming it, in E2B's names), and calls what the native routes call: the
same quota, admission, ownership, receipts.  docs/E2B.md maps every field.

- A template is a ref the operator published (``layerbox publish ... --name``) or a snapshot
  of the project's (:mod:`.templates`); its label ``layerbox.isolation`` picks container,
  microvm or vm, and a checkpoint of a microVM sandbox is a microVM template.
- ``timeout`` is the sandbox's ttl, counted from now on each ``/timeout``; ``metadata`` its
  labels; ``envVars`` its environment.  Past its timeout the edge's reaper destroys it (E2B's
  default, kill), or with ``autoPause`` pauses it in place (label ``layerbox.on-ttl``; its
  timeout then runs to the edge's maximum lifetime, and ``connect`` resumes it); with
  ``autoResume`` too, its own traffic resumes it (:meth:`E2bContext.awake`).
- Pause (E2B's default, ``memory`` true) freezes a container in place with its processes, on
  the edge that runs it (a VM's RAM goes to the store instead, see below); while it is paused its timeout is lifted to the edge's maximum
  lifetime (E2B keeps a paused sandbox until it is resumed), and resume or connect sets it
  again (``timeout``, else 15 s for resume, 300 s for connect, E2B's defaults).  With
  ``memory: false`` (the SDK's ``mode="filesystem"``) it goes to the store instead, its files
  without its processes, and any edge of the store resumes it with its id (:mod:`.paused`); a
  microVM's pause goes there with its RAM and devices, so it resumes anywhere with its processes.
- Fork: one checkpoint, ``count`` sandboxes from it (:meth:`~sandbox.host.sandbox.Sandbox.fork`):
  quota and admission for all of them first, and all of them start or none (E2B reports each
  fork's outcome; here a failure fails the request, which the SDK raises).
- Network: internet access (the default, as E2B's) is one allow rule for every address but the
  protected ranges; ``allowOut`` CIDRs are allow rules under a default deny; ``denyOut``
  is taken only as "everything" (``0.0.0.0/0``), the default of layerbox's policy.
"""

from __future__ import annotations

import asyncio
import datetime
import math
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any, cast

from aiohttp import web

from sandbox.core.errors import ApiError, InvalidField
from sandbox.core.model import (
    MAX_LABELS,
    ON_TTL_LABEL,
    PROJECT_LABEL,
    SandboxOptions,
    SandboxState,
    check_env,
    check_int,
    check_labels,
    check_object,
    check_str,
)
from sandbox.edge.auth import Project
from sandbox.edge.context import EdgeContext
from sandbox.edge.e2b import observe, templates
from sandbox.edge.e2b.base import (
    AUTO_RESUME_LABEL,
    AUTO_RESUME_MIN,
    ENVD_VERSION,
    E2bContext,
    sandbox_id_of,
)
from sandbox.edge.e2b.paused import Parked
from sandbox.edge.e2b.templates import ISOLATION_LABEL, check_query, page_query, paginate

__all__ = ["ISOLATION_LABEL", "Rest", "create_options", "network_rules", "setup"]
TEMPLATE_LABEL = "layerbox.e2b.template"  # on a sandbox: the templateID it was created from, as given
DEFAULT_TIMEOUT = 15  # seconds, E2B's default when a create, fork or resume names none
CONNECT_TIMEOUT = 300  # seconds, E2B's default when a connect that resumes names none
MAX_FORKS = 100  # E2B's bound on a fork's count
# room for the service's own labels beside a create's metadata: its project, template, on-ttl,
# auto-resume, and the operator's protected egress
MAX_METADATA = MAX_LABELS - 5
MiB = 1 << 20
CREATE_FIELDS = ("templateID", "timeout", "autoPause", "autoPauseMemory", "autoResume", "secure",
                 "allow_internet_access", "network", "metadata", "envVars", "mcp", "iam", "volumeMounts")
NETWORK_FIELDS = ("allowOut", "denyOut", "allowPublicTraffic", "maskRequestHost", "rules", "dnsServers",
                  "egressProxy", "httpsPorts")
NETWORK_UPDATE_FIELDS = ("allowOut", "denyOut", "dnsServers", "egressProxy", "rules", "allow_internet_access")
UNSUPPORTED_NETWORK = ("maskRequestHost", "rules", "dnsServers", "egressProxy", "httpsPorts")
EVERYTHING = ("0.0.0.0/0",)


def setup(e2b: E2bContext, app: web.Application) -> None:
    routes = Rest(e2b, templates.setup(e2b, app))
    observe.setup(e2b, app)
    r = app.router
    for path in ("/sandboxes", "/v2/sandboxes"):
        r.add_post(path, routes.create, name=f"e2b:create{path.count('/')}")
    r.add_get("/sandboxes", routes.list_v1, name="e2b:list")
    r.add_get("/v2/sandboxes", routes.list_v2, name="e2b:list2")
    r.add_get("/sandboxes/{id}", routes.get, name="e2b:get")
    r.add_delete("/sandboxes/{id}", routes.kill, name="e2b:kill")
    r.add_post("/sandboxes/{id}/timeout", routes.timeout, name="e2b:timeout")
    r.add_post("/sandboxes/{id}/refreshes", routes.refresh, name="e2b:refreshes")
    r.add_post("/sandboxes/{id}/pause", routes.pause, name="e2b:pause")
    r.add_post("/sandboxes/{id}/resume", routes.resume, name="e2b:resume")
    r.add_post("/sandboxes/{id}/connect", routes.connect, name="e2b:connect")
    r.add_post("/v2/sandboxes/{id}/connect", routes.connect, name="e2b:connect2")
    r.add_post("/sandboxes/{id}/fork", routes.fork, name="e2b:fork")
    r.add_put("/sandboxes/{id}/network", routes.network, name="e2b:network")


class Rest:
    def __init__(self, e2b: E2bContext, catalog: templates.Templates) -> None:
        self.e2b = e2b
        self.ctx: EdgeContext = e2b.ctx
        self.templates = catalog
        self.parked = Parked(e2b.ctx)

    async def _owned(self, request: web.Request) -> tuple[Project, Any, SandboxState]:
        """The sandbox the path names, on this edge; 409 for one paused into the store (resume it
        first), 404 for none."""
        project, sid, found = await self._found(request)
        if found is None:
            if await self.parked.find(project, sid) is not None:
                raise ApiError(None, "conflict", f"sandbox {sid} is paused in the store: resume or connect first")
            raise missing(project, sid)
        return project, *found

    async def _found(self, request: web.Request) -> tuple[Project, str, tuple[Any, SandboxState] | None]:
        """The sandbox the path names if it runs (or is paused) on this edge; None when it does
        not (it may be paused into the store: :mod:`.paused`)."""
        project = self.e2b.project(request)
        sid = sandbox_id_of(request.match_info["id"], project.name)
        try:
            return project, sid, await self.e2b.sandbox(request, project, sid)
        except ApiError as exc:
            if exc.code != "sandbox_not_found":
                raise
            return project, sid, None

    # -- create ------------------------------------------------------------------------------------------
    async def create(self, request: web.Request) -> web.Response:
        ctx = self.ctx
        project = self.e2b.project(request)
        body = check_object("", await ctx.body(request), CREATE_FIELDS)
        template = check_str("templateID", body.get("templateID"), max_len=512, what="a template (a ref name)")
        given = create_options(body)  # every field checked before any lookup
        resolved = await self.templates.resolve(project, template)
        carried = await ctx.carried(resolved)
        isolation = templates.isolation_of(resolved.doc, carried.isolation if carried is not None else None)
        if isolation != "container":
            caps = await ctx.capabilities(isolation)
            if not caps.available:
                raise ApiError(None, "unsupported_isolation", f"template {template!r} runs as {isolation}, which "
                               f"this edge does not run: {caps.reason}", field="templateID")
        options = ctx.options(project, {**given, "isolation": isolation}, extra=(), base=carried)
        options = options.replace(labels={**options.labels, TEMPLATE_LABEL: template, **lifecycle_labels(body)})
        async with ctx.admitted(project.name, project.max_sandboxes, [options]):
            box = await ctx.create(resolved, options, template)
        return web.json_response(self.created(await asyncio.to_thread(lambda: box.state)), status=201)

    def created(self, state: SandboxState) -> dict[str, Any]:
        """E2B's ``Sandbox``: what create, connect and resume answer."""
        return {"templateID": template_of(state), "sandboxID": state.id, "clientID": self.client_id,
                "envdVersion": ENVD_VERSION, "envdAccessToken": self.e2b.keys.access_token(state.id),
                "trafficAccessToken": self.e2b.keys.traffic_token(state.id), "domain": self.e2b.domain}

    @property
    def client_id(self) -> str:
        return self.ctx.admission.config.edge_id

    # -- read ---------------------------------------------------------------------------------------------
    async def get(self, request: web.Request) -> web.Response:
        project, sid, found = await self._found(request)
        view = self.detail(found[1]) if found is not None else await self.parked.view(project, sid)
        if view is None:
            raise missing(project, sid)
        return web.json_response({**view, "envdAccessToken": self.e2b.keys.access_token(sid),
                                  "domain": self.e2b.domain})

    def detail(self, state: SandboxState) -> dict[str, Any]:
        """E2B's ``SandboxDetail`` but its tokens (what a sandbox paused into the store keeps)."""
        labels = state.options.labels
        lifecycle = {"onTimeout": "pause" if labels.get(ON_TTL_LABEL) == "pause" else "kill",
                     "autoResume": AUTO_RESUME_LABEL in labels}
        return {**self.listed(state), "allowInternetAccess": internet_access(state), "lifecycle": lifecycle}

    def listed(self, state: SandboxState) -> dict[str, Any]:
        """E2B's ``ListedSandbox``."""
        o = state.options
        end = state.created + o.ttl if o.ttl is not None else state.created + self.ctx.maxima.ttl
        return {"templateID": template_of(state), "sandboxID": state.id, "clientID": self.client_id,
                "startedAt": iso(state.created), "endAt": iso(end), "cpuCount": max(1, math.ceil(o.cpu)),
                "memoryMB": o.memory // MiB, "diskSizeMB": (o.disk or 0) // MiB, "state": e2b_state(state),
                "envdVersion": ENVD_VERSION, "metadata": metadata_of(state)}

    async def list_v1(self, request: web.Request) -> web.Response:
        project = self.e2b.project(request)
        wanted = ListFilter.parse(request.query, v2=False)
        return web.json_response(wanted.apply(await self._views(project)))

    async def list_v2(self, request: web.Request) -> web.Response:
        project = self.e2b.project(request)
        wanted = ListFilter.parse(request.query, v2=True)
        page, next_token = wanted.page(wanted.apply(await self._views(project)))
        headers = {"x-next-token": next_token} if next_token else {}
        return web.json_response(page, headers=headers)

    async def _views(self, project: Project) -> list[dict[str, Any]]:
        """E2B's ``ListedSandbox`` of each of the project's sandboxes: on this edge, and paused into the store."""
        local = [self.listed(st) for st in await asyncio.to_thread(self.ctx.owned, project)]
        here = {v["sandboxID"] for v in local}
        parked = [{k: v for k, v in view.items() if k != "allowInternetAccess"}
                  for view in await self.parked.views(project)]
        return local + [v for v in parked if v.get("sandboxID") not in here]

    # -- change ---------------------------------------------------------------------------------------------
    async def kill(self, request: web.Request) -> web.Response:
        project, sid, found = await self._found(request)
        if found is not None:
            await asyncio.to_thread(self.ctx.manager.destroy, sid)
        elif not await self.parked.drop(project, sid):
            raise missing(project, sid)
        return web.Response(status=204)

    async def timeout(self, request: web.Request) -> web.Response:
        _, box, _ = await self._owned(request)
        body = check_object("", await self.ctx.body(request), ("timeout",))
        given = check_int("timeout", body.get("timeout"), 0, 1 << 31)
        # 0: its timeout is now (E2B's way to end it, or pause it with autoPause, at once)
        seconds = 0.0 if given == 0 else self.ctx.maxima.check_ttl(given, "timeout")
        await asyncio.to_thread(box.set_ttl, seconds, max_lifetime=self.ctx.maxima.ttl)
        return web.Response(status=204)

    async def refresh(self, request: web.Request) -> web.Response:
        """Keep it alive ``duration`` more seconds (E2B: at most 3600; never shortens its life)."""
        _, box, state = await self._owned(request)
        body = check_object("", await self.ctx.body(request), ("duration",))
        duration = check_int("duration", body.get("duration", DEFAULT_TIMEOUT), 0, 3600)
        left = state.created + (state.options.ttl or 0) - time.time()
        if duration > left:
            await asyncio.to_thread(box.set_ttl, self.ctx.maxima.check_ttl(duration),
                                    max_lifetime=self.ctx.maxima.ttl)
        return web.Response(status=204)

    async def pause(self, request: web.Request) -> web.Response:
        """Freeze it in place (409 when it already is: the SDK's False); its timeout is lifted to
        the edge's maximum lifetime while it is paused (see the module's docstring)."""
        body = check_object("", await self.ctx.body(request), ("memory", "requireHealthyGuest"))
        for name in ("memory", "requireHealthyGuest"):
            if body.get(name) is not None and not isinstance(body[name], bool):
                raise InvalidField(name, "must be true or false")
        project, sid, found = await self._found(request)
        if found is None:
            if await self.parked.find(project, sid) is not None:
                raise ApiError(None, "conflict", f"sandbox {sid} is already paused")
            raise missing(project, sid)
        box, state = found
        if body.get("memory") is False:  # mode="filesystem": into the store, resumable on any edge
            await self.parked.park(box, project, self.detail(state))
            return web.Response(status=204)
        if state.options.isolation != "container" and state.status == "running":
            # a VM's memory goes through the store as its disk does: resumable on any edge, processes and all
            await self.parked.park(box, project, self.detail(state), memory=True)
            return web.Response(status=204)
        if state.status == "paused":
            raise ApiError(None, "conflict", f"sandbox {box.id} is already paused")
        await asyncio.to_thread(box.pause, ttl=self.e2b.left(state), max_lifetime=self.ctx.maxima.ttl)
        return web.Response(status=204)

    async def resume(self, request: web.Request) -> web.Response:
        body = check_object("", await self.ctx.body(request), ("timeout", "autoPause", "memory"))
        timeout = self._timeout(body.get("timeout"))
        if body.get("autoPause") is not None and not isinstance(body["autoPause"], bool):
            raise InvalidField("autoPause", "must be true or false")
        if body.get("memory") not in (None, True):
            raise InvalidField("memory", "false (a cold boot) is not supported: a sandbox resumes with its memory")
        project, sid, found = await self._found(request)
        seconds = DEFAULT_TIMEOUT if timeout is None else timeout
        if found is None:
            return await self._unpark(project, sid, seconds)
        box, state = found
        if state.status != "paused":
            raise ApiError(None, "conflict", f"sandbox {box.id} is {state.status}, not paused")
        if body.get("autoPause") is not None:  # what its next timeout does
            await asyncio.to_thread(box.set_label, ON_TTL_LABEL, "pause" if body["autoPause"] else None)
        return web.json_response(self.created(await self._wake(box, state, seconds)), status=201)

    async def connect(self, request: web.Request) -> web.Response:
        """A running sandbox answers 200, a paused one is resumed first and answers 201; ``timeout``
        (seconds from now) is applied either way."""
        body = check_object("", await self.ctx.body(request), ("timeout", "memory"))
        timeout = self._timeout(body.get("timeout"))
        if body.get("memory") not in (None, True):
            raise InvalidField("memory", "false (resume from disk alone) is not supported: layerbox resumes "
                               "a paused sandbox with its memory")
        project, sid, found = await self._found(request)
        if found is None:
            return await self._unpark(project, sid, CONNECT_TIMEOUT if timeout is None else timeout)
        box, state = found
        if state.status == "paused":
            woken = await self._wake(box, state, CONNECT_TIMEOUT if timeout is None else timeout)
            return web.json_response(self.created(woken), status=201)
        remaining = state.created + state.options.ttl - time.time() if state.options.ttl is not None else math.inf
        if timeout is not None and timeout > remaining:  # E2B's connect never shortens a life
            await asyncio.to_thread(box.set_ttl, timeout, max_lifetime=self.ctx.maxima.ttl)
        return web.json_response(self.created(state), status=200)

    async def _unpark(self, project: Project, sid: str, seconds: int) -> web.Response:
        """Resume a sandbox paused into the store, here, with its id (201), or 404."""
        view = await self.parked.view(project, sid)
        if view is None:
            raise missing(project, sid)
        seconds = min(seconds, int(self.ctx.maxima.ttl))
        box = await self.parked.wake(project, sid, seconds, {TEMPLATE_LABEL: str(view.get("templateID"))})
        if box is None:
            raise missing(project, sid)
        return web.json_response(self.created(await asyncio.to_thread(lambda: box.state)), status=201)

    async def _wake(self, box: Any, state: SandboxState, seconds: int) -> SandboxState:
        return await asyncio.to_thread(self.e2b.wake, box, state, seconds)  # (one thread hop)

    def _timeout(self, value: object) -> int | None:
        if value is None:
            return None
        return int(self.ctx.maxima.check_ttl(check_int("timeout", value, 0, 1 << 31)))

    async def fork(self, request: web.Request) -> web.Response:
        """``count`` new sandboxes continuing from this one's files (E2B's ``SandboxForkResult`` each)."""
        ctx = self.ctx
        project = self.e2b.project(request)
        body = check_object("", await ctx.body(request), ("timeout", "count"))
        count = check_int("count", 1 if body.get("count") is None else body["count"], 1, MAX_FORKS)
        ttl = self._timeout(DEFAULT_TIMEOUT if body.get("timeout") is None else body["timeout"])
        _, box, state = await self._owned(request)
        if not state.live:
            raise ApiError(None, "conflict", f"sandbox {box.id} is {state.status}: only a running or paused "
                                            "sandbox can be forked")
        base = SandboxOptions.from_state(state.options.carried()).replace(policy_version=state.policy_version)
        options = ctx.options(project, {"ttl": ttl}, extra=(), base=base)
        options = options.replace(labels={**options.labels, TEMPLATE_LABEL: template_of(state)})
        async with ctx.admitted(project.name, project.max_sandboxes, [options] * count):
            _, forks = await box.fork(count, options)
        states = await asyncio.to_thread(lambda: [f.state for f in forks])
        return web.json_response([{"sandbox": self.created(st)} for st in states], status=201)

    async def network(self, request: web.Request) -> web.Response:
        """Replace its egress rules (E2B: what the body omits is cleared)."""
        body = check_object("", await self.ctx.body(request), NETWORK_UPDATE_FIELDS)
        internet = body.get("allow_internet_access")
        if internet is not None and not isinstance(internet, bool):
            raise InvalidField("allow_internet_access", "must be true or false")
        given = {k: v for k, v in body.items() if k != "allow_internet_access"}
        # the one validation of rules is the model's (as the native route's)
        rules = SandboxOptions(network=cast(Any, network_rules(given, internet, field=""))).network
        assert rules is not None  # network_rules gives a list, [] for deny everything
        self.ctx.maxima.check(SandboxOptions(network=rules))
        _, box, _ = await self._owned(request)
        await asyncio.to_thread(box.set_network, list(rules))
        return web.Response(status=204)


# -- the model, both ways ---------------------------------------------------------------------------------
def create_options(body: Mapping[str, Any]) -> dict[str, Any]:
    """The native options (JSON) an E2B create asks for; a field layerbox cannot honour is a 400
    naming it, never ignored."""
    out: dict[str, Any] = {}
    timeout = body.get("timeout")
    out["ttl"] = check_int("timeout", DEFAULT_TIMEOUT if timeout is None else timeout, 1, 1 << 31)
    if body.get("metadata"):
        labels = check_labels("metadata", body["metadata"], reserved_ok=False)
        if len(labels) > MAX_METADATA:
            raise InvalidField("metadata", f"{len(labels)} keys, at most {MAX_METADATA}")
        out["labels"] = labels
    if body.get("envVars"):
        out["env"] = check_env("envVars", body["envVars"])
    for name in ("autoPause", "secure", "allow_internet_access", "autoPauseMemory"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise InvalidField(name, "must be true or false")
    if body.get("autoPause") and body.get("autoPauseMemory") is False:
        raise InvalidField("autoPauseMemory", "false (a filesystem pause at the timeout) is not supported: an "
                                              "automatic pause keeps the sandbox in place, with its memory")
    auto_resume(body)
    for name in ("mcp", "iam"):
        if body.get(name) is not None:
            raise InvalidField(name, "is not supported by layerbox (see docs/E2B.md)")
    if body.get("volumeMounts"):
        raise InvalidField("volumeMounts", "volumes are not supported by layerbox (see docs/E2B.md)")
    out["network"] = network_rules(body.get("network"), body.get("allow_internet_access"))
    return out


def auto_resume(body: Mapping[str, Any]) -> bool:
    """Whether a create's ``autoResume`` (``{"enabled": bool}``) asks for a resume on traffic:
    only with ``autoPause``, as E2B's (the SDK's ``lifecycle`` checks the same)."""
    if body.get("autoResume") is None:
        return False
    enabled = check_object("autoResume", body["autoResume"], ("enabled",)).get("enabled")
    if not isinstance(enabled, bool):
        raise InvalidField("autoResume.enabled", "must be true or false")
    if enabled and body.get("autoPause") is not True:
        raise InvalidField("autoResume", "needs autoPause: true (a sandbox resumes on traffic after its "
                                         "timeout paused it)")
    return enabled


def lifecycle_labels(body: Mapping[str, Any]) -> dict[str, str]:
    """What a create's lifecycle leaves on the sandbox (``body`` checked by :func:`create_options`):
    a pause at its timeout, and the timeout a resume on traffic gives it (its own, at least E2B's
    five minutes)."""
    labels = {ON_TTL_LABEL: "pause"} if body.get("autoPause") else {}
    if (body.get("autoResume") or {}).get("enabled") is True:
        timeout = body.get("timeout")
        labels[AUTO_RESUME_LABEL] = str(max(AUTO_RESUME_MIN, DEFAULT_TIMEOUT if timeout is None else int(timeout)))
    return labels


def network_rules(network: object, internet: object, *, field: str = "network") -> list[dict[str, Any]]:
    """Egress rules for E2B's network settings (see the module's docstring); ``field`` is where
    they are in the request ("" for the body of ``PUT /sandboxes/{id}/network``)."""
    at = f"{field}." if field else ""
    spec = check_object(field, network or {}, NETWORK_FIELDS)
    if spec.get("allowPublicTraffic") is not None and not isinstance(spec["allowPublicTraffic"], bool):
        raise InvalidField(f"{at}allowPublicTraffic", "must be true or false")
    for key in UNSUPPORTED_NETWORK:
        if spec.get(key) is not None:
            raise InvalidField(f"{at}{key}", "is not supported by layerbox (see docs/E2B.md)")
    allow = _cidrs(f"{at}allowOut", spec.get("allowOut"))
    deny = _cidrs(f"{at}denyOut", spec.get("denyOut"))
    if deny and tuple(deny) != EVERYTHING:
        raise InvalidField(f"{at}denyOut", "only ['0.0.0.0/0'] (deny everything but allowOut) is supported: "
                                           "layerbox's egress policy is default deny plus allow rules")
    if internet is False or deny:
        return [{"cidr": c} for c in allow]
    if allow:
        return [{"cidr": c} for c in allow]
    return [{"cidr": "0.0.0.0/0"}]


def _cidrs(field: str, value: object) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > 64:
        raise InvalidField(field, "must be a list of at most 64 CIDRs")
    out = []
    for i, item in enumerate(value):
        text = check_str(f"{field}[{i}]", item, max_len=64, what="a CIDR like 10.0.0.0/8")
        if not any(ch.isdigit() for ch in text) or any(ch.isalpha() and ch not in "abcdef:" for ch in text.lower()):
            raise InvalidField(f"{field}[{i}]", f"{text!r}: domain names are not supported, give an IP or CIDR")
        out.append(text if "/" in text else f"{text}/{128 if ':' in text else 32}")
    return out


def missing(project: Project, sid: str) -> ApiError:
    return ApiError(None, "sandbox_not_found", f"no sandbox {sid!r} in project {project.name!r}")


def template_of(state: SandboxState) -> str:
    return state.labels.get(TEMPLATE_LABEL) or state.ref or state.image_digest


def metadata_of(state: SandboxState) -> dict[str, str]:
    return {k: v for k, v in state.labels.items() if k != PROJECT_LABEL and not k.startswith("layerbox.")}


def e2b_state(state: SandboxState) -> str:
    return "paused" if state.status == "paused" else "running"


def internet_access(state: SandboxState) -> bool:
    rules = state.options.network or ()
    return any(str(getattr(r, "cidr", "")) in ("0.0.0.0/0", "::/0") for r in rules)


def iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat().replace("+00:00", "Z")



class ListFilter:
    """``GET /sandboxes`` and ``/v2/sandboxes`` query: ``metadata`` (``k=v&k2=v2``, URL-encoded),
    ``state`` (``running,paused``); v2 also ``template`` (its templateID), ``startedAfter`` (an
    ISO time: started then or later, as E2B's), ``order`` (by start time then id: ``desc``, newest first,
    E2B's default, or ``asc``), ``limit`` and ``nextToken`` (the last id of the page before)."""

    def __init__(self, metadata: dict[str, str], states: set[str], limit: int, after: str | None, *,
                 newest_first: bool = True, template: str | None = None, since: float | None = None) -> None:
        self.metadata, self.states, self.limit, self.after = metadata, states, limit, after
        self.newest_first, self.template, self.since = newest_first, template, since

    @classmethod
    def parse(cls, query: Mapping[str, str], *, v2: bool) -> ListFilter:
        known = ("metadata", "state", "limit", "nextToken", "order", "startedAfter", "template") if v2 else \
            ("metadata", "query")
        check_query(query, known)
        raw = query.get("metadata") or query.get("query") or ""
        pairs = urllib.parse.parse_qsl(raw, keep_blank_values=True, strict_parsing=bool(raw)) if raw else []
        metadata = check_labels("metadata", dict(pairs), reserved_ok=False) if pairs else {}
        states = {"running"} if not v2 else {"running", "paused"}
        if v2 and query.get("state"):
            states = set(query["state"].split(","))
            bad = sorted(states - {"running", "paused"})
            if bad:
                raise InvalidField("state", f"{bad[0][:20]!r} is not running or paused")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidField("order", f"{order[:20]!r} is not asc or desc")
        template = None
        if query.get("template") is not None:
            template = check_str("template", query["template"], max_len=512, what="a templateID")
        since = None
        if query.get("startedAfter") is not None:
            text = query["startedAfter"]
            try:
                when = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
            except ValueError:
                raise InvalidField("startedAfter", f"{text[:40]!r} is not an ISO 8601 time") from None
            since = (when if when.tzinfo else when.replace(tzinfo=datetime.UTC)).timestamp()
        limit, after = page_query(query)
        return cls(metadata, states, limit, after, newest_first=order == "desc", template=template, since=since)

    def apply(self, views: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The ``ListedSandbox`` views that pass, in the asked order of start time then id."""
        picked = [v for v in views if v.get("state") in self.states
                  and all((v.get("metadata") or {}).get(k) == val for k, val in self.metadata.items())
                  and (self.template is None or v.get("templateID") == self.template)
                  and (self.since is None or _started(v) >= self.since)]
        return sorted(picked, key=lambda v: (_started(v), str(v.get("sandboxID"))), reverse=self.newest_first)

    def page(self, views: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str | None]:
        return paginate(views, lambda v: str(v.get("sandboxID")), self.after, self.limit)


def _started(view: Mapping[str, Any]) -> float:
    return datetime.datetime.fromisoformat(str(view.get("startedAt")).replace("Z", "+00:00")).timestamp()
