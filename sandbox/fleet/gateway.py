"""The gateway: the fleet's API, stateless, as many replicas as needed behind any load balancer.

It speaks what an edge speaks (the native API and the E2B protocol, the same routes and answers)
and adds what one edge cannot know:

- **who calls**: project tokens and E2B API keys, checked against their hashes in the fleet
  database (sandbox.fleet.db) and cached for :data:`KEY_CACHE` seconds;
- **fleet-wide quotas**: a create reserves its sandboxes in the database first (live sandboxes
  and creates per second, exact under creates racing through any number of gateways) and the
  reservation becomes routing rows when the edge answers, or is released;
- **placement** (sandbox.fleet.placement) and, past the on-premises pool's threshold, bursting
  into another pool (sandbox.fleet.burst);
- **routing by sandbox id**: every request that names a sandbox (REST, exec streams, Connect
  streams, files, PTY and port WebSockets, E2B's ``E2b-Sandbox-Id`` headers and
  ``<port>-<id>.<domain>`` host names) goes to the edge the routing table names, streamed
  through (sandbox.fleet.proxy).  Another project's sandbox answers 404, as a missing one does.

Routing survives the database being down for what the gateway has cached; creates then answer
503 retryable.  The edges stay the truth about what runs on them: their heartbeats come through
the gateways (``POST /fleet/v1/heartbeat``) and reconcile the routing table.

Runs as ``layerbox gateway --db URL [--port 8480]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import tempfile
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import uvloop
from aiohttp import web

from sandbox.core.errors import ApiError, InvalidField
from sandbox.core.model import SANDBOX_ID, SandboxOptions, check_object, check_sandbox_id, check_str
from sandbox.edge.context import MAX_BODY
from sandbox.edge.e2b.base import check_domain, sandbox_id_of, target_of
from sandbox.edge.e2b.base import error_response as e2b_error
from sandbox.edge.e2b.rest import CREATE_FIELDS, ListFilter, create_options
from sandbox.edge.e2b.templates import MAX_PAGE
from sandbox.edge.errors import as_api_error
from sandbox.edge.trust import (
    EDGE_HEADER,
    EDGE_ID,
    GATEWAY_HEADER,
    Caller,
    edge_key,
    report_signer,
    sign_request,
    verify_report,
)
from sandbox.fleet.burst import BurstPolicy, Verdicts
from sandbox.fleet.db import FleetDb, FleetDbError, ProjectRow, Route
from sandbox.fleet.placement import Demand, EdgeView, Placement
from sandbox.fleet.proxy import (
    EdgeUnreachable,
    NotThere,
    fetch_json,
    is_websocket,
    outbound_headers,
    relay,
)

log = logging.getLogger("layerbox.fleet.gateway")

KEY_CACHE = 30.0  # seconds a checked key is trusted without asking the database again
ROUTE_CACHE = 200_000  # sandbox routes kept per gateway (a few tens of MB)
REFRESH = 1.0  # seconds between reads of the registry
HOUSEKEEPING = 5.0  # seconds between expiring reservations and marking silent edges' sandboxes lost
LOST_AFTER = 30.0  # seconds of silence before an edge's sandboxes leave their quotas
RECONCILE_GRACE = 10.0  # seconds a fresh route may be missing from its edge's report
MAX_REPORT = 16 << 20
NATIVE_SANDBOX = re.compile(r"/v1/sandboxes/([^/]+)(/.*)?")
E2B_SANDBOX = re.compile(r"/(?:v2/)?sandboxes/([^/]+)(/.*)?")
NOT_IDS = frozenset({"restore", "metrics"})  # /v1/sandboxes/restore, /sandboxes/metrics
E2B_PREFIXES = ("/sandboxes", "/v2/", "/templates", "/snapshots")
CREATE_TIMEOUT = 150.0
SYNC_BACK = 60.0  # seconds between copies of the overflow pool's checkpoints home
CACHE_PARENT = "/var/tmp"
REPLAYABLE = 1 << 16  # bytes of a request body the gateway holds so that it can resend it
CACHE_PREFIX = "layerbox-gateway-"


def made_ids(doc: object) -> list[str]:
    """The sandbox ids a create-like answer names (native, E2B, one or many)."""
    if isinstance(doc, list):
        return [sid for item in doc for sid in made_ids(item)]
    if not isinstance(doc, dict):
        return []
    for key in ("sandboxID", "id"):
        if isinstance(doc.get(key), str):
            return [doc[key]]
    if "sandbox" in doc:
        return made_ids(doc["sandbox"])
    return made_ids(doc.get("sandboxes", []))


@dataclass
class Call:
    """One request as the gateway sees it: whose, which API, which sandbox."""

    request: web.Request
    e2b: bool
    project: ProjectRow | None = None

    @property
    def caller(self) -> Caller | None:
        p = self.project
        return None if p is None else Caller(p.name, p.max_sandboxes, p.admin, p.egress_protected)


class Gateway:
    """One gateway replica: its caches and its handlers (see the module's docstring)."""

    def __init__(self, db: FleetDb, fleet_key: bytes, *, domain: str | None = None, k: int = 2,
                 placement: Placement | None = None, lost_after: float = LOST_AFTER,
                 verdicts: Verdicts | None = None, sync_back: float = SYNC_BACK) -> None:
        self.lost_after = lost_after
        self.sync_back_every = sync_back
        self.verdicts = verdicts  # the stores of pools creates may overflow to
        self.burst: BurstPolicy | None = None
        self.db = db
        self.fleet_key = fleet_key
        self.domain = domain
        self.placement = placement or Placement(k=k)
        self.clock = 0.0  # the database's clock minus this host's: the fleet's time
        self.keys: dict[str, tuple[ProjectRow, float]] = {}
        self.routes: OrderedDict[str, Route] = OrderedDict()
        self.session: aiohttp.ClientSession | None = None
        self.stats = {"creates": 0, "placed_retries": 0, "db_down": 0}
        self._tasks: list[asyncio.Task[None]] = []
        self._edge_keys: dict[str, bytes] = {}

    # -- the app ---------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=MAX_BODY)
        app.router.add_post("/fleet/v1/heartbeat", self.heartbeat)
        app.router.add_get("/fleet/v1/health", self.health)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        # no total timeout: exec streams and WebSockets last as long as the caller's command
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
                                             auto_decompress=False, connector=aiohttp.TCPConnector(limit=0))
        await self.refresh()
        self._tasks = [asyncio.create_task(self._every(REFRESH, self.refresh)),
                       asyncio.create_task(self._every(HOUSEKEEPING, self.housekeeping)),
                       asyncio.create_task(self._every(self.sync_back_every, self.sync_back))]

    async def _stop(self, app: web.Application) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.session is not None:
            await self.session.close()
        if self.verdicts is not None:
            await self.verdicts.close()
        await self.db.close()

    async def _every(self, interval: float, work: Callable[[], Awaitable[Any]]) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await work()
            except FleetDbError as exc:
                self.stats["db_down"] += 1
                log.warning("%s: %s", work.__name__, exc)
            except Exception:
                log.exception("%s failed", work.__name__)

    async def refresh(self) -> None:
        """The registry and the fleet's clock, from the database."""
        before = time.time()
        rows = await self.db.edges()
        now = await self.db.now()
        self.clock = now - (before + time.time()) / 2
        self.placement.update(rows)
        policy = await self.db.setting("burst")
        try:
            self.burst = None if policy is None else BurstPolicy.from_json(policy)
        except ValueError as exc:  # a bad policy places as if there were none, and says so
            log.error("the burst policy in the database is unreadable: %s", exc)
            self.burst = None

    async def housekeeping(self) -> None:
        await self.db.expire()
        await self.db.mark_lost(after=self.lost_after)

    async def sync_back(self) -> None:
        """The overflow pool's checkpoints to the home store (sandbox.fleet.burst), by one gateway."""
        policy, verdicts = self.burst, self.verdicts
        if policy is None or verdicts is None:
            return
        async with self.db.leader("sync-back") as leading:
            if leading:
                report = await verdicts.sync_back(policy)
                if report is not None and report.bytes_moved:
                    log.info("synced back from pool %s: %s bytes", policy.overflow, report.bytes_moved)

    def now(self) -> float:
        return time.time() + self.clock

    # -- errors ----------------------------------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                      ) -> web.StreamResponse:
        e2b = request.path.startswith(E2B_PREFIXES) or "X-API-Key" in request.headers or \
            "E2b-Sandbox-Id" in request.headers or self._host_target(request)
        try:
            return await handler(request)
        except web.HTTPException as exc:
            err = ApiError(exc.status, "http", exc.reason)
        except FleetDbError as exc:
            err = ApiError(503, "unavailable", f"the fleet database is out of reach ({exc}); retry", retryable=True,
                           retry_after=1.0)
        except Exception as exc:
            err = as_api_error(exc)
            if err.status == 500:
                log.exception("%s %s failed", request.method, request.path)
        if e2b:
            return e2b_error(err)
        return web.json_response(err.body(), status=err.status, headers=err.headers())

    def _host_target(self, request: web.Request) -> bool:
        return bool(self.domain) and request.host.lower().split(":")[0].endswith("." + (self.domain or ""))

    # -- who calls ---------------------------------------------------------------------------------------
    async def project(self, request: web.Request) -> ProjectRow:
        """The caller's project: ``Authorization: Bearer`` or E2B's ``X-API-Key`` (401, 403)."""
        token = request.headers.get("X-API-Key", "").strip()
        if not token:
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise ApiError(None, "unauthenticated", "missing 'Authorization: Bearer <token>' (or X-API-Key)")
            token = token.strip()
        cached = self.keys.get(token)
        if cached is not None and cached[1] > time.monotonic():
            project = cached[0]
        else:
            try:
                found = await self.db.project_of_key(token)
            except FleetDbError:
                if cached is None:
                    raise
                found = cached[0]  # the database is down: what was true a moment ago still is
            if found is None:
                self.keys.pop(token, None)
                raise ApiError(None, "unauthenticated", "unknown token")
            project = found
            self.keys[token] = (project, time.monotonic() + KEY_CACHE)
        if project.disabled:
            raise ApiError(None, "forbidden", f"project {project.name!r} is disabled")
        return project

    # -- routes ------------------------------------------------------------------------------------------
    async def route(self, sid: str, *, fresh: bool = False) -> Route | None:
        cached = self.routes.get(sid)
        if cached is not None and not fresh:
            self.routes.move_to_end(sid)
            return cached
        try:
            found = await self.db.route(sid)
        except FleetDbError:
            if cached is None:
                raise
            return cached
        if found is None:
            self.routes.pop(sid, None)
            return None
        self._remember(found)
        return found

    async def current_route(self, sid: str) -> Route | None:
        """The route to use now: the cached one while its edge is reachable and it is placed; read
        again when its edge is not (lost with it, or moved since it was cached) and when it was
        cached lost (its edge came back and reported it to another gateway: a lost route kept in
        this cache would answer "lost" for ever)."""
        route = await self.route(sid)
        if route is not None and (route.state == "lost" or not self._reachable(route.edge)):
            route = await self.route(sid, fresh=True)
        return route

    def _remember(self, route: Route) -> None:
        self.routes[route.sandbox] = route
        self.routes.move_to_end(route.sandbox)
        while len(self.routes) > ROUTE_CACHE:
            self.routes.popitem(last=False)

    def _reachable(self, edge_id: str) -> bool:
        view = self.placement.edges.get(edge_id)
        return view is not None and self.placement.healthy(view, time.monotonic())

    def edge(self, edge_id: str) -> EdgeView:
        view = self.placement.edges.get(edge_id)
        if view is None:
            raise ApiError(502, "bad_gateway", f"the sandbox's edge {edge_id} is not in the registry", retryable=True)
        return view

    def headers(self, call: Call, edge_id: str, *, caller: bool = True, path_qs: str | None = None,
                method: str | None = None) -> dict[str, str]:
        key = self._edge_keys.get(edge_id)
        if key is None:
            key = self._edge_keys[edge_id] = edge_key(self.fleet_key, edge_id)
        r = call.request
        signed = sign_request(key, method or r.method, path_qs or r.rel_url.raw_path_qs,
                              call.caller if caller else None, self.now())
        return outbound_headers(r, {GATEWAY_HEADER: signed})

    async def _send(self, call: Call, view: EdgeView, *, body: bytes | None = None,
                    caller: bool = True, unless: frozenset[int] = frozenset(),
                    extra: Mapping[str, str] | None = None) -> web.StreamResponse:
        assert self.session is not None
        try:
            headers = {**self.headers(call, view.id, caller=caller), **(extra or {})}
            resp = await relay(self.session, call.request, view.id, view.row.url, headers, body, unless=unless)
        except EdgeUnreachable as exc:
            self.placement.failed(view.id, exc.message)
            raise
        (self.placement.failed(view.id, f"HTTP {resp.status}") if resp.status >= 500 and resp.status != 503
         else self.placement.succeeded(view.id))
        return resp

    # -- every request -----------------------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.StreamResponse:
        target = target_of(request, self.domain)  # E2B's in-sandbox traffic: envd or a port
        if target is not None:
            return await self._in_sandbox(request, target.sid, target.port)
        path, method = request.path, request.method
        e2b = path.startswith(E2B_PREFIXES)
        signed_port = re.fullmatch(r"/v1/sandboxes/[^/]+/ports/\d+/signed/.*", path) is not None
        call = Call(request, e2b, None if signed_port else await self.project(request))
        if method == "POST" and path in ("/v1/sandboxes", "/v1/sandboxes/restore", "/sandboxes", "/v2/sandboxes"):
            return await self.create(call)
        if method == "GET" and path in ("/v1/sandboxes", "/sandboxes", "/v2/sandboxes"):
            return await self.listing(call)
        found = (NATIVE_SANDBOX if path.startswith("/v1/") else E2B_SANDBOX).fullmatch(path)
        if found is not None and found.group(1) not in NOT_IDS:
            return await self.per_sandbox(call, found.group(1), found.group(2) or "")
        if path.startswith("/v1/jobs/") or path == "/sandboxes/metrics":
            return await self.everywhere(call)
        if method == "POST" and path == "/v1/calls":  # a FnCall takes a slot of its edge's pool: placed
            status, headers, doc = await self._place(call, Demand(), await request.read(), None)
            return _answer(status, headers, doc)
        return await self.anywhere(call)

    async def _in_sandbox(self, request: web.Request, sid: str, port: int) -> web.StreamResponse:
        """envd or a port of a sandbox: the edge checks the sandbox's own tokens; a project's key,
        when one is sent instead, is checked here and vouched for."""
        check_sandbox_id(sid, "E2b-Sandbox-Id")
        call = Call(request, True)
        if "X-API-Key" in request.headers or request.headers.get("Authorization", "").lower().startswith("bearer "):
            call.project = await self.project(request)
        cached = sid in self.routes
        route = await self.current_route(sid)
        if route is None or route.state != "placed" or (call.project is not None and route.project != call.project.name):
            raise ApiError(502, "sandbox_not_found", f"The sandbox {sid} was not found")  # (E2B's proxy's answer)
        # the edge's "not found" for a sandbox is E2B's proxy's 502
        return await self._routed(call, sid, route, cached=cached, missing=frozenset({404, 502}),
                                  extra={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(port)})

    async def per_sandbox(self, call: Call, raw_id: str, rest: str) -> web.StreamResponse:
        # before it routes anything; an E2B path's id that cannot be one is E2B's 404, as at an edge
        sid = (sandbox_id_of(raw_id, call.project.name if call.project is not None else "")
               if call.e2b else check_sandbox_id(raw_id, "id"))
        cached = sid in self.routes
        route = await self.current_route(sid)
        if route is not None and call.project is not None and route.project != call.project.name:
            route = None  # another project's: as missing, from every gateway
        method = call.request.method
        wakes = call.e2b and method == "POST" and rest in ("/resume", "/connect")
        if route is None or route.state == "lost":
            if wakes:  # paused into the store (it left its edge): it resumes where placement says
                return await self.create(call, resume=sid)
            if call.e2b and route is None:  # any edge answers for one paused into the store, or 404
                return await self.anywhere(call)
            what = "was lost with its edge" if route is not None else "does not exist"
            raise ApiError(None, "sandbox_not_found", f"no sandbox {sid!r} in this project: it {what}")
        if method == "POST" and rest == "/fork":
            return await self.create(call, parent=route)
        if wakes:  # read the answer: a 404 means it was paused into the store since
            return await self.create(call, resume=sid, parent=route)
        resp = await self._routed(call, sid, route, cached=cached)
        if method == "DELETE" and rest == "" and resp.status in (204, 404):
            await self.db.drop_route(sid)
            self.routes.pop(sid, None)
        return resp

    async def _routed(self, call: Call, sid: str, route: Route, *, cached: bool,
                      missing: frozenset[int] = frozenset({404}),
                      extra: Mapping[str, str] | None = None) -> web.StreamResponse:
        """Send to the route's edge.  A cached route may be stale (another gateway moved the
        sandbox: a resume elsewhere, a drain): the edge's 404 then drops it, and a request whose
        body can be sent again is resent along the route read afresh."""
        caller = call.project is not None
        request = call.request
        replayable = not is_websocket(request) and (
            not request.body_exists or (request.content_length or REPLAYABLE + 1) <= REPLAYABLE)
        if not (cached and replayable):
            resp = await self._send(call, self.edge(route.edge), caller=caller, extra=extra)
            if resp.status in missing:
                self.routes.pop(sid, None)  # the client's retry reads the route afresh
            return resp
        body = await request.read() if request.body_exists else None
        try:
            return await self._send(call, self.edge(route.edge), body=body, caller=caller, unless=missing, extra=extra)
        except NotThere:
            self.routes.pop(sid, None)
            fresh = await self.route(sid, fresh=True)
            if fresh is None or fresh.state != "placed" or fresh.project != route.project:
                fresh = route  # gone, or never moved: the edge's own answer is the answer
            return await self._send(call, self.edge(fresh.edge), body=body, caller=caller, extra=extra)

    async def anywhere(self, call: Call) -> web.StreamResponse:
        """Requests that name no sandbox (templates, checkpoints, capabilities, FnCalls): any healthy
        edge answers them alike, each reading the shared store."""
        views = self.placement.any_healthy()
        if not views:
            raise ApiError(503, "unavailable", "no edge is reachable", retryable=True, retry_after=1.0)
        return await self._send(call, views[0])

    async def everywhere(self, call: Call) -> web.StreamResponse:
        """Jobs and many sandboxes' metrics span every edge holding the project's sandboxes: each
        is asked; the answers' sandboxes merge (the first success answers for a job)."""
        assert call.project is not None
        body = await call.request.read() if call.request.body_exists else None
        answers = await self._fan_out(call, body)
        ok = [doc for status, doc in answers if status < 300]
        if not ok:
            status, doc = answers[0] if answers else (404, None)
            raise ApiError(status, "not_found", f"no edge holds what {call.request.path} names ({doc})")
        merged = ok[0]
        if isinstance(merged, dict) and isinstance(merged.get("sandboxes"), dict):
            merged = {**merged, "sandboxes": {k: v for doc in ok for k, v in doc.get("sandboxes", {}).items()}}
        return web.json_response(merged)

    async def _fan_out(self, call: Call, body: bytes | None, path_qs: str | None = None) -> list[tuple[int, Any]]:
        assert self.session is not None
        assert call.project is not None
        edges = {r.edge for r in await self.db.routes(call.project.name) if r.state == "placed"}
        some = self.placement.any_healthy()
        if some:
            edges.add(some[0].id)  # sandboxes paused into the store: any edge lists them
        request, session = call.request, self.session
        path_qs = path_qs or request.rel_url.raw_path_qs

        async def ask(edge_id: str) -> tuple[int, Any]:
            view = self.edge(edge_id)
            status, _, doc = await fetch_json(session, request.method, edge_id, view.row.url + path_qs,
                                              self.headers(call, edge_id, path_qs=path_qs), body)
            return status, doc

        found = await asyncio.gather(*(ask(e) for e in sorted(edges) if e in self.placement.edges),
                                     return_exceptions=True)
        out: list[tuple[int, Any]] = []
        for item in found:
            if isinstance(item, BaseException):
                if not isinstance(item, ApiError):
                    raise item
                log.warning("fan-out: %s", item)
                continue
            out.append(item)
        return out

    async def listing(self, call: Call) -> web.StreamResponse:
        """The project's sandboxes on every edge that holds some (and those paused into the store)."""
        request = call.request
        if not call.e2b:
            docs = await self._fan_out(call, None)
            boxes = {b["id"]: b for _, doc in docs if isinstance(doc, dict) for b in doc.get("sandboxes", [])}
            return web.json_response({"sandboxes": sorted(boxes.values(), key=lambda b: b["id"])})
        v2 = request.path.startswith("/v2/")
        wanted = ListFilter.parse(request.query, v2=v2)  # the edge's own checks, once, here
        views: dict[str, dict[str, Any]] = {}
        after: str | None = None
        while True:  # every page of every edge: the order and the page are the gateway's to make
            query = f"/v2/sandboxes?state=running,paused&limit={MAX_PAGE}" + (f"&nextToken={after}" if after else "")
            docs = await self._fan_out(call, None, path_qs=query)
            page = [v for _, doc in docs if isinstance(doc, list) for v in doc]
            views.update({str(v.get("sandboxID")): v for v in page})
            if len(page) < MAX_PAGE * max(len(docs), 1):
                break
            after = str(page[-1].get("sandboxID"))
        picked = wanted.apply(list(views.values()))
        if not v2:
            return web.json_response(picked)
        page_of, token = wanted.page(picked)
        return web.json_response(page_of, headers={"x-next-token": token} if token else {})

    # -- creates ---------------------------------------------------------------------------------------
    async def _demand(self, call: Call, body: dict[str, Any], parent: Route | None) -> Demand:
        """The create's demand, its body checked by the edge's own model first (a 400 naming the field)."""
        path = call.request.path
        if parent is not None:
            count = body.get("count", 1)
            count = count if isinstance(count, int) and not isinstance(count, bool) and count >= 1 else 1
            return Demand(count=count)
        if call.e2b:  # what the edge's E2B create checks, in its order
            check_object("", body, CREATE_FIELDS)
            check_str("templateID", body.get("templateID"), max_len=512, what="a template (a ref name)")
            create_options(body)
            return Demand(image=body["templateID"])
        if path.endswith("/restore"):
            ref = check_str("checkpoint", body.get("checkpoint"), max_len=512, what="a checkpoint ref or digest")
            options = SandboxOptions.from_json(body, extra=("checkpoint", "count"))
            count = body.get("count") or 1
            return Demand(options.isolation, count if isinstance(count, int) else 1, options.memory or 0, image=ref)
        image = check_str("image", body.get("image"), max_len=512, what="an image or checkpoint ref")
        options = SandboxOptions.from_json(body, extra=("image",))
        return Demand(options.isolation, 1, options.memory or 0, image=image)

    async def create(self, call: Call, *, parent: Route | None = None, resume: str | None = None) -> web.StreamResponse:
        """Reserve, place, send, record: see the module's docstring."""
        assert call.project is not None
        assert self.session is not None
        raw = await call.request.read()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            raise ApiError(400, "bad_request", "the body is not JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "bad_request", "the body is not a JSON object")
        demand = Demand(count=1) if resume else await self._demand(call, body, parent)
        if resume and parent is not None and await self._holds(call, self.edge(parent.edge), resume):
            # running or paused in place on its edge: no new sandbox
            status, headers, doc = await self._to_edge(call, self.edge(parent.edge), raw)
            if status != 404:
                return _answer(status, headers, doc)
        reservation = await self.db.reserve(call.project.name, demand.count)
        made: list[tuple[str, str]] = []
        try:
            answer = await self._burst_place(call, demand, raw, parent, resume=resume is not None)
            status, headers, doc = answer
            made = [(sid, headers["X-Layerbox-Edge-Id"]) for sid in made_ids(doc)] if status < 300 else []
            if made:
                await self.db.commit(reservation, call.project.name, made)
                for sid, edge in made:
                    self._remember(Route(sid, call.project.name, edge, "placed"))
            self.stats["creates"] += 1
            return _answer(status, headers, doc)
        finally:
            if not made:
                with contextlib.suppress(FleetDbError):
                    await self.db.release(reservation)

    async def pools(self, demand: Demand) -> tuple[tuple[str, ...], str | None]:
        """The pools a create may use, in order, and why it may not overflow (sandbox.fleet.burst)."""
        policy = self.burst
        if policy is None:
            return (), None
        if self.placement.utilization(policy.home) < policy.threshold:
            return (policy.home,), None
        reason = (await self.verdicts.why_not(policy, demand.image) if self.verdicts is not None
                  else f"this gateway has no store for pool {policy.overflow!r} (--pool-store)")
        return ((policy.overflow, policy.home), None) if reason is None else ((policy.home,), reason)

    async def _burst_place(self, call: Call, demand: Demand, body: bytes, parent: Route | None, *,
                           resume: bool) -> tuple[int, dict[str, str], Any]:
        """:meth:`_place` in the pools the burst policy allows; a create that may not overflow
        waits (bounded) for room at home, then is refused with the policy's reason."""
        if parent is not None and not resume:
            return await self._place(call, demand, body, parent)
        pools, reason = await self.pools(demand)
        demand = dataclasses.replace(demand, pools=pools)
        deadline = time.monotonic() + (self.burst.wait if reason is not None and self.burst else 0.0)
        while True:
            try:
                return await self._place(call, demand, body, parent, resume=resume)
            except ApiError as exc:
                if exc.code != "capacity" or reason is None:
                    raise
                if time.monotonic() >= deadline:
                    raise ApiError(503, "capacity", f"pool {pools[0]!r} has no room and this create may not "
                                   f"overflow: {reason}", retryable=True, retry_after=1.0) from None
            await asyncio.sleep(0.5)

    async def _holds(self, call: Call, view: EdgeView, sid: str) -> bool:
        """Whether the edge runs ``sid`` itself (else it is paused into the store, and a resume is
        placed: the edge it left may be draining)."""
        assert self.session is not None
        path = f"/v1/sandboxes/{sid}"
        try:
            status, _, _ = await fetch_json(self.session, "GET", view.id, view.row.url + path,
                                            self.headers(call, view.id, path_qs=path, method="GET"))
        except EdgeUnreachable:
            return False
        return status == 200

    async def _to_edge(self, call: Call, view: EdgeView, body: bytes) -> tuple[int, dict[str, str], Any]:
        assert self.session is not None
        try:
            return await asyncio.wait_for(fetch_json(self.session, "POST", view.id,
                                                     view.row.url + call.request.rel_url.raw_path_qs,
                                                     self.headers(call, view.id), body), CREATE_TIMEOUT)
        except (EdgeUnreachable, TimeoutError) as exc:
            self.placement.failed(view.id, str(exc))
            raise

    async def _place(self, call: Call, demand: Demand, body: bytes, parent: Route | None, *, resume: bool = False
                     ) -> tuple[int, dict[str, str], Any]:
        """Send the create to the parent's edge, or to the candidates in turn until one takes it."""
        views = [self.edge(parent.edge)] if parent is not None and not resume else self.placement.candidates(demand)
        if not views:
            raise ApiError(503, "capacity", "no edge of the fleet has room for this create now "
                                            f"({len(self.placement.edges)} registered)", retryable=True, retry_after=1.0)
        refusals: list[str] = []
        for view in views:
            self.placement.sent(view, demand)
            status = 0
            try:
                status, headers, doc = await self._to_edge(call, view, body)
            except (TimeoutError, EdgeUnreachable) as exc:
                refusals.append(f"{view.id}: {exc}")
                continue
            finally:
                self.placement.done(view, demand, made=200 <= status < 300)
            refused = status == 503 or (status == 400 and isinstance(doc, dict) and "unsupported_isolation" in str(doc))
            if refused and (parent is None or resume):
                self.stats["placed_retries"] += 1
                refusals.append(f"{view.id}: HTTP {status} {_reason(doc)}".rstrip())
                continue
            if status >= 500 and status != 503:
                self.placement.failed(view.id, f"HTTP {status}")
            else:
                self.placement.succeeded(view.id)
            return status, {**headers, "X-Layerbox-Edge-Id": view.id}, doc
        raise ApiError(503, "capacity", "every edge tried refused or failed: " + "; ".join(refusals), retryable=True,
                       retry_after=1.0)

    # -- the edges' side -----------------------------------------------------------------------------------
    async def heartbeat(self, request: web.Request) -> web.Response:
        edge_id, stamp, mac = report_signer(request.headers.get(EDGE_HEADER))
        if not EDGE_ID.fullmatch(edge_id):
            raise InvalidField("edge", f"{edge_id[:80]!r} is not an edge id")
        body = await request.content.read(MAX_REPORT + 1)
        if len(body) > MAX_REPORT:
            raise ApiError(413, "body_too_large", f"a heartbeat is at most {MAX_REPORT} bytes")
        try:
            verify_report(edge_key(self.fleet_key, edge_id), edge_id, stamp, mac, body, self.now())
        except ApiError as exc:  # the edge learns the fleet's clock from the refusal too
            return web.json_response(exc.body(), status=exc.status, headers={"X-Layerbox-Time": f"{self.now():.3f}"})
        doc = _report(body)
        if doc.get("edge") != edge_id:
            raise InvalidField("edge", "the report names another edge than its signature")
        state = await self.db.heartbeat(edge_id, pool=doc["pool"], url=doc["url"], boot=doc["boot"],
                                        capabilities=doc["capabilities"], load=doc["load"],
                                        images={"refs": doc.get("images", []), "layers": doc.get("layers", [])})
        if doc.get("sandboxes") is not None:
            pairs = [(sid, project) for sid, project in doc["sandboxes"] if SANDBOX_ID.fullmatch(sid)]
            changed = await self.db.reconcile(edge_id, pairs, grace=RECONCILE_GRACE)
            if changed:
                log.info("edge %s reconciled: %d routes changed", edge_id, len(changed))
                for sid in changed:  # this gateway's cache; the others' follow the edge's "no such sandbox"
                    self.routes.pop(sid, None)
        return web.json_response({"state": state}, headers={"X-Layerbox-Time": f"{self.now():.3f}"})

    async def health(self, request: web.Request) -> web.Response:
        """This replica's view: edges it would place on, and what it did."""
        now = time.monotonic()
        return web.json_response({"edges": len(self.placement.edges),
                                  "healthy": sorted(v.id for v in self.placement.edges.values()
                                                    if self.placement.healthy(v, now)), **self.stats,
                                  "db_transactions": self.db.transactions})


def _report(body: bytes) -> dict[str, Any]:
    """A heartbeat's body: a JSON object with the fields a gateway reads (400 naming a bad one)."""
    def no_constant(name: str) -> Any:
        raise InvalidField("load", f"{name} is not a JSON number")

    try:
        doc = json.loads(body, parse_constant=no_constant)
    except ValueError:
        raise ApiError(400, "bad_request", "a heartbeat is a JSON object") from None
    if not isinstance(doc, dict):
        raise ApiError(400, "bad_request", "a heartbeat is a JSON object")
    for name, kind in (("pool", str), ("url", str), ("boot", str), ("capabilities", dict), ("load", dict)):
        if not isinstance(doc.get(name), kind):
            raise InvalidField(name, f"must be a {kind.__name__}")
    if not re.fullmatch(r"https?://[^/\s]+", doc["url"]):
        raise InvalidField("url", f"{doc['url'][:100]!r} is not http(s)://host:port")
    sandboxes = doc.get("sandboxes")
    if sandboxes is not None and not (isinstance(sandboxes, list) and all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in sandboxes)):
        raise InvalidField("sandboxes", "must be a list of [id, project] pairs")
    return doc


def _answer(status: int, headers: dict[str, str], doc: Any) -> web.Response:
    clean = {k: v for k, v in headers.items() if k.lower() not in (
        "content-length", "transfer-encoding", "content-type", "content-encoding", "x-layerbox-edge-id")}
    return web.json_response(doc, status=status, headers=clean)


# -- entry point ----------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="layerbox gateway", description=__doc__.split("\n")[0])
    p.add_argument("--db", required=True, help="the fleet database (postgresql://...)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=8480)
    p.add_argument("--k", type=int, default=2, help="edges sampled per placement choice (default %(default)s)")
    p.add_argument("--e2b-domain", help="route <port>-<sandbox id>.DOMAIN host names (docs/E2B.md)")
    p.add_argument("--pool-store", action="append", default=[], metavar="POOL=URL",
                   help="the store a pool's edges read: creates overflow there only for images present in it")
    p.add_argument("--cache-dir", type=Path, help="where store metadata is cached (default: a directory of its own "
                   "under /var/tmp, removed at exit)")
    p.add_argument("--sync-back", type=float, default=SYNC_BACK, metavar="SECONDS",
                   help="how often the overflow pool's checkpoints are copied home (default %(default)s)")
    p.add_argument("--lost-after", type=float, default=LOST_AFTER, metavar="SECONDS",
                   help="silence after which an edge's sandboxes are lost and leave their quotas (default %(default)s)")
    return p


def _sweep_caches() -> None:
    """Remove the metadata caches of gateways that died without removing theirs (their pid is gone)."""
    for path in Path(CACHE_PARENT).glob(CACHE_PREFIX + "*"):
        pid = path.name[len(CACHE_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)

def _reason(doc: Any) -> str:
    """The message of an edge's error body, native (``error.message``) or E2B (``message``), cut
    short: a refusal's reason reaches the caller, not the edge's whole answer."""
    if not isinstance(doc, dict):
        return ""
    err = doc.get("error")
    msg = err.get("message") if isinstance(err, dict) else doc.get("message")
    return f"({msg[:300]})" if isinstance(msg, str) and msg else ""


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    domain = None
    if args.e2b_domain:
        try:
            domain = check_domain(args.e2b_domain)
        except ValueError as exc:
            parser.error(f"--e2b-domain: {exc}")

    stores: dict[str, str] = {}
    for item in args.pool_store:
        pool, sep, url = item.partition("=")
        if not (sep and pool and url):
            parser.error(f"--pool-store {item!r}: POOL=URL")
        stores[pool] = url
    own_cache = args.cache_dir is None
    if own_cache:
        _sweep_caches()
    cache = args.cache_dir or Path(tempfile.mkdtemp(prefix=f"{CACHE_PREFIX}{os.getpid()}-", dir=CACHE_PARENT))

    async def serve() -> None:
        db = await FleetDb.open(args.db)
        verdicts = Verdicts(stores, cache) if stores else None
        gateway = Gateway(db, await db.fleet_key(), domain=domain, k=args.k, lost_after=args.lost_after,
                          verdicts=verdicts, sync_back=args.sync_back)
        # no access log: a line per relayed request is CPU every request pays (errors still log)
        runner = web.AppRunner(gateway.app(), keepalive_timeout=15.0, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, args.host, args.port).start()
        log.info("gateway on %s:%s", args.host, args.port)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    # SIGTERM (fleet down, systemd) ends serve() through its finally, as ^C does
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        with contextlib.suppress(KeyboardInterrupt):
            uvloop.run(serve())
    finally:
        if own_cache:
            shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

