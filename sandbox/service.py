"""The sandbox edge service: an HTTP API over one :class:`SandboxManager`.

Every request carries ``Authorization: Bearer <token>``; a token belongs to one
project.  A sandbox belongs to the project that created it (recorded as the
``layerbox.project`` label in its state, so ownership survives a restart) and
is invisible to every other project: their requests get 404, never 403, so ids
leak nothing.  Each project has a quota on live sandboxes; past it, create
answers 429 with a retryable error body.  Past the quota, the edge admits a
create only if the host really has room (:mod:`sandbox.admission`); otherwise
it answers 503 ``capacity`` (retryable, with Retry-After) naming what is short.
``GET /v1/load`` is the load report placement clients choose edges by.

Errors are ``{"error": {"code", "message", "retryable"}}``.  ``POST .../exec``
answers with a chunked stream of newline-delimited JSON events::

    {"type": "stdout", "data": "<base64>"}
    {"type": "stderr", "data": "<base64>"}
    {"type": "exit", "exit_code": 0, "signal": null, "truncated": false, "duration": 0.01,
     "timed_out": false, "oom_killed": false}
    {"type": "error", "error": {...}}          (instead of "exit" when the exec failed)

The manager's runtime and file calls block, so each goes through
``asyncio.to_thread``.  The service binds 127.0.0.1 only; put a TLS proxy in
front of it for anything remote.

Tokens file (JSON)::

    {"projects": {"alpha": {"tokens": ["..."], "max_sandboxes": 10, "disabled": false}}}
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import contextlib
import io
import json
import logging
import socket
import stat
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from layerstore.errors import LayerboxError
from sandbox.admission import (
    DEFAULT_DISK,
    DEFAULT_MEMORY,
    DEFAULT_PIDS,
    RESOURCES,
    Admission,
    AdmissionConfig,
    CapacityExceeded,
    Demand,
    parse_size,
)
from sandbox.errors import (
    PathEscape,
    ReceiptsBroken,
    RuntimeTimeout,
    SandboxError,
    SandboxNotFound,
    SandboxStateError,
    UnsupportedOption,
)
from sandbox.manager import Cancel, Sandbox, SandboxManager, verify_receipt_chain
from sandbox.runs import preempt, resume_run

log = logging.getLogger("layerbox.sandbox.service")

PROJECT_LABEL = "layerbox.project"
ISOLATION = "container"  # what this service runs: crun containers, never microVMs
DEFAULT_QUOTA = 10
MAX_BODY = 64 << 20  # JSON bodies; file uploads stream and have no limit but the sandbox's disk
DEFAULT_JOB = "default"
DEFAULT_LEASE_TTL = 600.0
REAP_INTERVAL = 5.0
STREAM_QUEUE = 64  # exec events buffered per request: a slow reader slows the command, never the host
CREATE_OPTIONS = frozenset({"cpu", "memory", "pids", "env", "workdir", "ttl", "idle_timeout", "cpu_class", "disk",
                            "network", "userns"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# -- configuration --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Project:
    name: str
    max_sandboxes: int = DEFAULT_QUOTA
    disabled: bool = False


@dataclass
class AuthConfig:
    """Bearer token -> project."""

    tokens: dict[str, Project] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> AuthConfig:
        out: dict[str, Project] = {}
        for name, spec in (doc.get("projects") or {}).items():
            project = Project(name, int(spec.get("max_sandboxes", DEFAULT_QUOTA)), bool(spec.get("disabled", False)))
            for token in spec.get("tokens") or []:
                if not isinstance(token, str) or len(token) < 16:
                    raise ValueError(f"project {name!r}: tokens must be strings of at least 16 characters")
                if token in out:
                    raise ValueError(f"project {name!r}: a token is shared with project {out[token].name!r}")
                out[token] = project
        return cls(out)

    @classmethod
    def load(cls, path: str | Path) -> AuthConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))


# -- errors as responses ----------------------------------------------------------------------------
class ApiError(Exception):
    """An error answered as JSON with ``status``; raised inside handlers only."""

    def __init__(self, status: int, code: str, message: str, *, retryable: bool = False,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.retryable = status, code, message, retryable
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message, "retryable": self.retryable}}


class _CapacityError(ApiError):
    """503 ``capacity``: the body also names the short resources, for clients that act on them."""

    def __init__(self, exc: CapacityExceeded) -> None:
        super().__init__(503, "capacity", str(exc), retryable=True,
                         headers={"Retry-After": str(max(1, round(exc.retry_after)))})
        self.resources = exc.resources

    def body(self) -> dict[str, Any]:
        doc = super().body()
        doc["error"]["resources"] = list(self.resources)
        return doc


def _as_api_error(exc: BaseException) -> ApiError:
    """The one place library exceptions become HTTP statuses."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, CapacityExceeded):
        return _CapacityError(exc)
    if isinstance(exc, SandboxNotFound):
        return ApiError(404, "not_found", str(exc))
    if isinstance(exc, SandboxStateError):
        return ApiError(409, "conflict", str(exc), retryable=bool(getattr(exc, "retryable", False)))
    if isinstance(exc, PathEscape):
        return ApiError(403, "path_escape", str(exc))
    if isinstance(exc, UnsupportedOption):
        return ApiError(400, "unsupported_option", str(exc))
    if isinstance(exc, RuntimeTimeout):
        return ApiError(503, "runtime_timeout", str(exc), retryable=True)
    if isinstance(exc, ReceiptsBroken):  # an integrity fault on this host: not the caller's, not transient
        return ApiError(500, "receipts_broken", str(exc))
    if isinstance(exc, FileNotFoundError):
        return ApiError(404, "file_not_found", f"no such file or directory: {exc.filename or exc}")
    if isinstance(exc, (IsADirectoryError, NotADirectoryError, FileExistsError)):
        return ApiError(409, "file_conflict", f"{exc.strerror}: {exc.filename or exc}")
    if isinstance(exc, PermissionError):
        return ApiError(403, "permission_denied", str(exc))
    if isinstance(exc, OSError):
        return ApiError(400, "os_error", str(exc))
    if isinstance(exc, SandboxError):
        if getattr(exc, "retryable", False):  # e.g. every warm pool busy, a runtime timeout
            return ApiError(503, "busy", str(exc), retryable=True, headers={"Retry-After": "1"})
        return ApiError(500, "sandbox_error", str(exc))
    return ApiError(500, "internal", f"{type(exc).__name__}: {exc}")


def _view(state: Mapping[str, Any]) -> dict[str, Any]:
    labels = {k: v for k, v in (state.get("labels") or {}).items() if k != PROJECT_LABEL}
    job = state.get("job")
    return {"id": state.get("id"), "status": state.get("status"), "image": state.get("ref"),
            "image_digest": state.get("image_digest"), "labels": labels, "limits": state.get("limits"),
            "created": state.get("created"), "last_active": state.get("last_active"), "isolation": ISOLATION,
            "job": job.partition("/")[2] if isinstance(job, str) else None, "cpu_class": state.get("cpu_class"),
            "disk": state.get("disk"), "admitting": state.get("admitting", True),
            "network": state.get("network")}


def _number(value: Any, default: int) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else default


def _project_of(state: Mapping[str, Any]) -> str | None:
    labels = state.get("labels") or {}
    return labels.get(PROJECT_LABEL) if isinstance(labels, dict) else None


# -- the service ----------------------------------------------------------------------------------------
class SandboxService:
    """Routes, auth, quotas and metrics over one manager; build the app with :meth:`app`."""

    def __init__(self, manager: SandboxManager, auth: AuthConfig, admission: Admission | None = None, *,
                 lease_ttl: float = DEFAULT_LEASE_TTL, reap_interval: float = REAP_INTERVAL,
                 fncall_pool: int = 2) -> None:
        self.manager = manager
        self.auth = auth
        self.lease_ttl = lease_ttl
        self.reap_interval = reap_interval
        self.fncall_pool = fncall_pool
        self._calls: Any = None  # sandbox.fncall.FnCalls, made on the first call
        self._reaper: asyncio.Task[None] | None = None
        self._warm: asyncio.Task[Any] | None = None
        self.admission = admission or Admission(AdmissionConfig(), disk_path=manager.data_dir,
                                                boxes=manager.boxes)
        self._pending: dict[str, int] = {}  # creates in flight per project (they count against the quota)
        self._quota_lock = asyncio.Lock()
        self.registry = CollectorRegistry()  # per service: two services in one process never collide
        self.m_sandboxes = Gauge("layerbox_sandboxes", "Live sandboxes", ["project", "status"],
                                 registry=self.registry)
        self.m_execs = Counter("layerbox_execs", "Commands run", ["project"], registry=self.registry)
        self.m_exec_seconds = Histogram("layerbox_exec_duration_seconds", "Command duration",
                                        registry=self.registry)
        self.m_errors = Counter("layerbox_api_errors", "Error responses", ["code"], registry=self.registry)
        self.m_requests = Counter("layerbox_api_requests", "Requests", ["route", "status"],
                                  registry=self.registry)
        self.m_free = Gauge("layerbox_admission_free", "Free capacity after reserves and creates in flight "
                            "(bytes for memory and disk)", ["resource"], registry=self.registry)
        self.m_rejected = Counter("layerbox_admission_rejections", "Creates refused for capacity, by the "
                                  "first short resource", ["resource"], registry=self.registry)
        self.m_reaped = Counter("layerbox_reaped", "Sandboxes the reaper acted on", ["action"],
                                registry=self.registry)
        self.m_preempt_seconds = Histogram("layerbox_preempt_duration_seconds", "Preempting a job, drain to "
                                           "manifest", registry=self.registry)
        self.m_call_seconds = Histogram("layerbox_fncall_duration_seconds", "FnCall latency (queueing included)",
                                        buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30),
                                        registry=self.registry)
        for action in ("destroyed", "paused"):
            self.m_reaped.labels(action)
        for resource in RESOURCES:  # every series exists from the start, at zero
            self.m_rejected.labels(resource)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=MAX_BODY)
        r = app.router
        r.add_get("/openapi.json", self.openapi)
        r.add_get("/metrics", self.metrics)
        r.add_post("/v1/sandboxes", self.create)
        r.add_get("/v1/sandboxes", self.list)
        r.add_get("/v1/sandboxes/{id}", self.get)
        r.add_delete("/v1/sandboxes/{id}", self.delete)
        r.add_post("/v1/sandboxes/{id}/exec", self.exec)
        r.add_get("/v1/sandboxes/{id}/files", self.files_get)
        r.add_put("/v1/sandboxes/{id}/files", self.files_put)
        r.add_delete("/v1/sandboxes/{id}/files", self.files_delete)
        r.add_post("/v1/sandboxes/{id}/pause", self.pause)
        r.add_post("/v1/sandboxes/{id}/resume", self.resume)
        r.add_post("/v1/sandboxes/{id}/checkpoint", self.checkpoint)
        r.add_get("/v1/load", self.load)
        r.add_post("/v1/sandboxes/restore", self.restore)
        r.add_get("/v1/sandboxes/{id}/receipts", self.receipts)
        r.add_put("/v1/sandboxes/{id}/network", self.network)
        r.add_post("/v1/jobs/{job}/renew", self.job_renew)
        r.add_post("/v1/jobs/{job}/pause", self.job_pause)
        r.add_post("/v1/jobs/{job}/resume", self.job_resume)
        r.add_post("/v1/jobs/{job}/preempt", self.job_preempt)
        r.add_post("/v1/runs/resume", self.run_resume)
        r.add_post("/v1/calls", self.call)
        r.add_get("/v1/capabilities", self.capabilities)
        app.on_startup.append(self._start_background)
        app.on_cleanup.append(self._stop_background)
        return app

    # -- background: the reaper ------------------------------------------------------------------------
    async def _start_background(self, app: web.Application) -> None:
        self._reaper = asyncio.create_task(self._reap_forever())
        if self.manager.store_url:
            # the first create should not pay for the lazyfetch daemon's start-up
            self._warm = asyncio.create_task(asyncio.to_thread(self.manager.host.start_daemon))

    async def _stop_background(self, app: web.Application) -> None:
        if self._warm is not None:
            with contextlib.suppress(Exception):
                await self._warm
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        if self._calls is not None:
            await self._calls.close()

    async def _reap_forever(self) -> None:
        """Destroy sandboxes past their TTL or lease, pause idle ones; a failure waits for the next round."""
        while True:
            await asyncio.sleep(self.reap_interval)
            try:
                await asyncio.to_thread(self.manager.heal)  # a dead lazyfetch daemon: restart its sandboxes
                report = await asyncio.to_thread(self.manager.reap)
                if report["destroyed"] or report["paused"]:
                    log.info("reaper: %s", report)
                for action, ids in report.items():
                    self.m_reaped.labels(action).inc(len(ids))
            except Exception:
                log.exception("reaper round failed")

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "?"
        try:
            resp = await handler(request)
        except web.HTTPException as exc:  # aiohttp's own 404/405 for unknown routes
            err = ApiError(exc.status, "http", exc.reason)
            resp = self._error_response(err)
        except Exception as exc:
            err = _as_api_error(exc)
            if err.status >= 500 and not isinstance(err, _CapacityError):  # a rejection is a normal answer
                log.exception("%s %s failed", request.method, request.path)
            resp = self._error_response(err)
        self.m_requests.labels(route, str(resp.status)).inc()
        return resp

    def _error_response(self, err: ApiError) -> web.Response:
        self.m_errors.labels(err.code).inc()
        return web.json_response(err.body(), status=err.status, headers=err.headers)

    # -- auth and ownership --------------------------------------------------------------------------
    def _project(self, request: web.Request) -> Project:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise ApiError(401, "unauthenticated", "missing 'Authorization: Bearer <token>' header",
                           headers={"WWW-Authenticate": "Bearer"})
        project = self.auth.tokens.get(token.strip())
        if project is None:
            raise ApiError(401, "unauthenticated", "unknown token", headers={"WWW-Authenticate": "Bearer"})
        if project.disabled:
            raise ApiError(403, "forbidden", f"project {project.name!r} is disabled")
        return project

    @staticmethod
    def _job(project: Project, name: Any) -> str:
        """Jobs are per project: the manager sees ``<project>/<job>``."""
        if name is None:
            name = DEFAULT_JOB
        if not isinstance(name, str) or not name or len(name) > 128 or "/" in name:
            raise ApiError(400, "bad_request", "'job' must be 1-128 characters without '/'")
        return f"{project.name}/{name}"

    def _touch_lease(self, state: Mapping[str, Any]) -> None:
        """Any request on a job's sandbox renews its lease (rate-limited to a quarter of the ttl)."""
        job = state.get("job")
        if not job:
            return
        lease = self.manager.leases.get(job)
        if lease is None or lease.state != "active":
            return
        if lease.expires - time.time() < 0.75 * lease.ttl:
            self.manager.leases.renew(job)

    async def _box(self, request: web.Request, project: Project) -> Sandbox:
        sid = request.match_info["id"]
        not_found = ApiError(404, "not_found", f"no sandbox {sid!r} in project {project.name!r}")
        try:
            box = await asyncio.to_thread(self.manager.get, sid)
            state = await asyncio.to_thread(lambda: box.state)
        except SandboxNotFound:
            raise not_found from None
        if _project_of(state) != project.name:
            raise not_found
        await asyncio.to_thread(self._touch_lease, state)
        return box

    @staticmethod
    async def _json(request: web.Request) -> dict[str, Any]:
        if not request.can_read_body:
            return {}
        try:
            doc = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, "bad_request", f"body is not JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise ApiError(400, "bad_request", "body must be a JSON object")
        return doc

    @staticmethod
    def _path(request: web.Request) -> str:
        path = request.query.get("path")
        if not path:
            raise ApiError(400, "bad_request", "query parameter 'path' is required")
        return path

    def _owned(self, project: Project) -> list[dict[str, Any]]:
        return [st for st in self.manager.list() if _project_of(st) == project.name]

    # -- sandboxes -----------------------------------------------------------------------------------
    async def create(self, request: web.Request) -> web.Response:
        project = self._project(request)
        body = await self._json(request)
        image = body.get("image")
        if not isinstance(image, str) or not image:
            raise ApiError(400, "bad_request", "'image' (an image or checkpoint ref) is required")
        isolation = body.get("isolation", ISOLATION)
        if isolation != ISOLATION:
            raise ApiError(400, "unsupported_isolation",
                           f"isolation {isolation!r} is not available: this service runs {ISOLATION!r} only")
        options = self._options(project, body, extra={"image", "isolation"})
        return await self._launch(project, options, lambda: self.manager.create(image, **options))

    async def restore(self, request: web.Request) -> web.Response:
        """A new sandbox from a checkpoint this project made (on any edge of the store)."""
        project = self._project(request)
        body = await self._json(request)
        ref = body.get("checkpoint")
        if not isinstance(ref, str) or not ref:
            raise ApiError(400, "bad_request", "'checkpoint' (a checkpoint ref or digest) is required")
        policy = body.get("policy_version")
        options = self._options(project, body, extra={"checkpoint", "policy_version"})
        await self._own_checkpoint(project, ref)
        return await self._launch(project, options,
                                  lambda: self.manager.restore(ref, policy_version=policy, **options))

    async def _own_checkpoint(self, project: Project, ref: str) -> None:
        not_found = ApiError(404, "not_found", f"no checkpoint {ref!r} in project {project.name!r}")
        async with await self.manager._store() as store:
            try:
                resolved = await store.resolve(ref, refresh=True)
            except LayerboxError:
                raise not_found from None
        if resolved.kind != "checkpoint" or (resolved.doc.get("labels") or {}).get(PROJECT_LABEL) != project.name:
            raise not_found

    async def _launch(self, project: Project, options: Mapping[str, Any],
                      start: Callable[[], Awaitable[Sandbox]]) -> web.Response:
        """Quota, then admission, then ``start``; both checks count creates still in flight."""
        async with self._quota_lock:
            live = len(await asyncio.to_thread(self._owned, project)) + self._pending.get(project.name, 0)
            if live >= project.max_sandboxes:
                raise ApiError(429, "quota_exceeded",
                               f"project {project.name!r} has {live} of {project.max_sandboxes} sandboxes; "
                               "destroy one or retry later", retryable=True, headers={"Retry-After": "5"})
            self._pending[project.name] = self._pending.get(project.name, 0) + 1
        # a malformed limit is charged the default here; the manager refuses it with a proper error
        demand = Demand(memory=_number(options.get("memory"), DEFAULT_MEMORY),
                        pids=_number(options.get("pids"), DEFAULT_PIDS),
                        disk=_number(options.get("disk"), DEFAULT_DISK))
        try:
            with self.admission.reserve(demand):
                box = await start()
        except CapacityExceeded as exc:
            self.m_rejected.labels(exc.resources[0]).inc()
            log.info("create refused: %s", exc)
            raise
        finally:
            self._pending[project.name] -= 1
        return web.json_response(_view(await asyncio.to_thread(lambda: box.state)), status=201)

    def _options(self, project: Project, body: Mapping[str, Any], *, extra: set[str]) -> dict[str, Any]:
        labels = body.get("labels") or {}
        if not isinstance(labels, dict) or any(not isinstance(k, str) or k.startswith("layerbox.") for k in labels):
            raise ApiError(400, "bad_request", "labels must be a string map without 'layerbox.' keys")
        unknown = set(body) - CREATE_OPTIONS - extra - {"labels", "job", "lease_ttl"}
        if unknown:
            raise ApiError(400, "bad_request", f"unknown fields: {sorted(unknown)}")
        options = {k: body[k] for k in CREATE_OPTIONS if body.get(k) is not None}
        options["labels"] = {**labels, PROJECT_LABEL: project.name}
        options["job"] = self._job(project, body.get("job"))
        options["lease_ttl"] = body.get("lease_ttl") or self.lease_ttl
        return options

    async def list(self, request: web.Request) -> web.Response:
        project = self._project(request)
        owned = await asyncio.to_thread(self._owned, project)
        return web.json_response({"sandboxes": [_view(st) for st in owned]})

    async def get(self, request: web.Request) -> web.Response:
        box = await self._box(request, self._project(request))
        return web.json_response(_view(await asyncio.to_thread(lambda: box.state)))

    async def delete(self, request: web.Request) -> web.Response:
        box = await self._box(request, self._project(request))
        await asyncio.to_thread(self.manager.destroy, box.id)
        return web.Response(status=204)

    async def pause(self, request: web.Request) -> web.Response:
        box = await self._box(request, self._project(request))
        out = await asyncio.to_thread(box.pause)
        return web.json_response(out)

    async def resume(self, request: web.Request) -> web.Response:
        box = await self._box(request, self._project(request))
        await asyncio.to_thread(box.resume)
        return web.json_response(_view(await asyncio.to_thread(lambda: box.state)))

    async def checkpoint(self, request: web.Request) -> web.Response:
        box = await self._box(request, self._project(request))
        body = await self._json(request)
        labels = body.get("labels") or {}
        if not isinstance(labels, dict) or any(str(k).startswith("layerbox.") for k in labels):
            raise ApiError(400, "bad_request", "labels must be a string map without 'layerbox.' keys")
        ckpt = await box.checkpoint(name=body.get("name"), labels=labels)
        return web.json_response(ckpt.to_json(), status=201)

    async def receipts(self, request: web.Request) -> web.Response:
        """Receipts, oldest first; ``action``, ``since`` (Unix time) and ``idempotency_key`` filter them."""
        box = await self._box(request, self._project(request))
        rows = await asyncio.to_thread(box.receipts)
        # checked whole before any filter: the head lets a caller notice a log cut at its end
        head = verify_receipt_chain(rows, what=f"sandbox {box.id}'s receipts")
        q = request.query
        if "action" in q:
            rows = [r for r in rows if r.get("action") == q["action"]]
        if "idempotency_key" in q:
            rows = [r for r in rows if r.get("idempotency_key") == q["idempotency_key"]]
        if "since" in q:
            try:
                since = float(q["since"])
            except ValueError:
                raise ApiError(400, "bad_request", "'since' must be a Unix time in seconds") from None
            rows = [r for r in rows if float(r.get("time", 0)) >= since]
        return web.json_response({"sandbox": box.id, "head": head, "receipts": rows})

    async def network(self, request: web.Request) -> web.Response:
        box = await self._box(request, self._project(request))
        body = await self._json(request)
        rules = body.get("rules")
        if not isinstance(rules, list):
            raise ApiError(400, "bad_request", "'rules' must be a list of egress allow rules")
        return web.json_response(await asyncio.to_thread(box.set_network, rules))

    # -- jobs and runs ---------------------------------------------------------------------------------
    async def job_renew(self, request: web.Request) -> web.Response:
        project = self._project(request)
        job = self._job(project, request.match_info["job"])
        ttl = (await self._json(request)).get("ttl") if request.can_read_body else None
        if ttl is not None and not (isinstance(ttl, (int, float)) and ttl > 0):
            raise ApiError(400, "bad_request", "'ttl' must be a positive number of seconds")
        lease = await asyncio.to_thread(self.manager.renew, job, ttl)
        return web.json_response({**lease, "job": request.match_info["job"]})

    async def job_pause(self, request: web.Request) -> web.Response:
        job = self._job(self._project(request), request.match_info["job"])
        return web.json_response({"sandboxes": await asyncio.to_thread(self.manager.pause_job, job)})

    async def job_resume(self, request: web.Request) -> web.Response:
        job = self._job(self._project(request), request.match_info["job"])
        return web.json_response({"sandboxes": await asyncio.to_thread(self.manager.resume_job, job)})

    async def job_preempt(self, request: web.Request) -> web.Response:
        job = self._job(self._project(request), request.match_info["job"])
        body = await self._json(request) if request.can_read_body else {}
        grace = body.get("timeout", 30.0)
        if not isinstance(grace, (int, float)) or grace < 0:
            raise ApiError(400, "bad_request", "'timeout' must be a number of seconds >= 0")
        if not await asyncio.to_thread(self.manager.list, job=job):
            raise ApiError(404, "not_found", f"job {request.match_info['job']!r} has no sandboxes here")
        run = await preempt(self.manager, job, timeout=float(grace))
        self.m_preempt_seconds.observe(run.seconds)
        return web.json_response(run.to_json(), status=201)

    async def run_resume(self, request: web.Request) -> web.Response:
        project = self._project(request)
        ref = (await self._json(request)).get("manifest")
        if not isinstance(ref, str) or not ref:
            raise ApiError(400, "bad_request", "'manifest' (a run manifest ref or digest) is required")
        async with await self.manager._store() as store:
            try:
                doc = (await store.resolve(ref, refresh=True)).doc
            except LayerboxError:
                doc = {}
        if not str(doc.get("job", "")).startswith(project.name + "/"):
            raise ApiError(404, "not_found", f"no run manifest {ref!r} in project {project.name!r}")
        entries = list((doc.get("sandboxes") or {}).values())
        # the whole job or nothing: quota and capacity for every sandbox before the first restore
        async with self._quota_lock:
            live = len(await asyncio.to_thread(self._owned, project)) + self._pending.get(project.name, 0)
            if live + len(entries) > project.max_sandboxes:
                raise ApiError(429, "quota_exceeded",
                               f"project {project.name!r} has {live} of {project.max_sandboxes} sandboxes; "
                               f"resuming this run needs {len(entries)} more", retryable=True,
                               headers={"Retry-After": "5"})
            self._pending[project.name] = self._pending.get(project.name, 0) + len(entries)
        try:
            with contextlib.ExitStack() as held:
                for entry in entries:
                    opts = entry.get("options") or {}
                    held.enter_context(self.admission.reserve(Demand(
                        memory=_number(opts.get("memory"), DEFAULT_MEMORY), pids=_number(opts.get("pids"), DEFAULT_PIDS),
                        disk=_number(opts.get("disk"), DEFAULT_DISK))))
                run = await resume_run(self.manager, ref, lease_ttl=self.lease_ttl)
        except CapacityExceeded as exc:
            self.m_rejected.labels(exc.resources[0]).inc()
            raise
        finally:
            self._pending[project.name] -= len(entries)
        return web.json_response(run.to_json(), status=201)

    # -- FnCall --------------------------------------------------------------------------------------------
    async def call(self, request: web.Request) -> web.Response:
        project = self._project(request)
        body = await self._json(request)
        image, cmd, function = body.get("image"), body.get("cmd"), body.get("function")
        if not isinstance(image, str) or not image:
            raise ApiError(400, "bad_request", "'image' is required")
        if (cmd is None) == (function is None):
            raise ApiError(400, "bad_request", "give exactly one of 'cmd' and 'function'")
        timeout = body.get("timeout", 30.0)
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ApiError(400, "bad_request", "'timeout' must be a positive number of seconds")
        if self._calls is None:
            from sandbox.fncall import FnCalls

            self._calls = FnCalls(self.manager, size=self.fncall_pool)
        self.m_execs.labels(project.name).inc()
        result = await self._calls.call(image, cmd, function=function, args=body.get("args") or (),
                                        kwargs=body.get("kwargs") or None, timeout=float(timeout))
        self.m_call_seconds.observe(result.duration)
        return web.json_response({
            "exit_code": result.exit_code, "stdout": base64.b64encode(result.stdout).decode(),
            "stderr": base64.b64encode(result.stderr).decode(), "value": result.value, "error": result.error,
            "timed_out": result.timed_out, "truncated": result.truncated, "duration": result.duration,
            "wait_seconds": result.wait_seconds})

    # -- exec ----------------------------------------------------------------------------------------
    async def exec(self, request: web.Request) -> web.StreamResponse:
        project = self._project(request)
        box = await self._box(request, project)
        body = await self._json(request)
        cmd = body.get("cmd")
        if not (isinstance(cmd, str) and cmd) and not (
                isinstance(cmd, list) and cmd and all(isinstance(c, str) for c in cmd)):
            raise ApiError(400, "bad_request", "'cmd' must be a shell string or a non-empty list of strings")
        stdin: bytes | None = None
        if body.get("stdin") is not None:
            try:
                stdin = base64.b64decode(body["stdin"], validate=True)
            except (binascii.Error, TypeError):
                raise ApiError(400, "bad_request", "'stdin' must be base64") from None
        key = body.get("idempotency_key")
        if key is not None and (not isinstance(key, str) or not key or len(key) > 200):
            raise ApiError(400, "bad_request", "'idempotency_key' must be a string of 1-200 characters")
        state = await asyncio.to_thread(lambda: box.state)
        if state.get("status") != "running":
            raise ApiError(409, "conflict", f"sandbox {box.id} is {state.get('status')}, not running")
        cap = _number(body.get("output_cap"), 1 << 20)

        loop = asyncio.get_running_loop()
        # bounded: the exec thread blocks when the client reads slowly, and the pipe then stops the command
        events: asyncio.Queue[tuple[str, bytes] | None] = asyncio.Queue(STREAM_QUEUE)
        cancel = Cancel()

        def forward(kind: str) -> Callable[[bytes], None]:
            sent = 0

            def push(data: bytes) -> None:
                nonlocal sent
                room = cap - sent  # past the cap nothing more is streamed (the result says truncated)
                if room <= 0 or cancel.is_set():
                    return
                sent += min(room, len(data))
                fut = asyncio.run_coroutine_threadsafe(events.put((kind, data[:room])), loop)
                while not cancel.is_set():
                    try:
                        fut.result(timeout=0.5)
                        return
                    except TimeoutError:
                        continue
                fut.cancel()
            return push

        run = asyncio.ensure_future(asyncio.to_thread(
            box.exec, cmd, env=body.get("env"), cwd=body.get("cwd"), timeout=body.get("timeout"), stdin=stdin,
            output_cap=cap, on_stdout=forward("stdout"), on_stderr=forward("stderr"), idempotency_key=key,
            cancel=cancel))
        self.m_execs.labels(project.name).inc()

        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        try:
            while not (run.done() and events.empty()):
                if request.transport is None or request.transport.is_closing():
                    raise ConnectionResetError("client went away")
                try:
                    kind, data = await asyncio.wait_for(events.get(), 0.5)  # type: ignore[misc]
                except TimeoutError:
                    continue
                await resp.write(json.dumps({"type": kind, "data": base64.b64encode(data).decode()}).encode()
                                 + b"\n")
        except (ConnectionResetError, asyncio.CancelledError):
            # the client left: kill the command (its receipt says so) instead of running it unobserved
            cancel.cancel("disconnect")
            await asyncio.wait([run])
            raise
        try:
            result = run.result()
        except Exception as exc:
            err = _as_api_error(exc)
            self.m_errors.labels(err.code).inc()
            final: dict[str, Any] = {"type": "error", **err.body()}
        else:
            self.m_exec_seconds.observe(result.duration)
            final = {"type": "exit", "exit_code": result.exit_code, "signal": result.signal,
                     "truncated": result.truncated, "duration": result.duration,
                     "timed_out": result.timed_out, "oom_killed": result.oom_killed,
                     "interrupted": result.interrupted, "replayed": result.replayed}
        await resp.write(json.dumps(final).encode() + b"\n")
        await resp.write_eof()
        return resp

    # -- files ---------------------------------------------------------------------------------------
    async def files_get(self, request: web.Request) -> web.StreamResponse:
        box = await self._box(request, self._project(request))
        path = self._path(request)
        if request.query.get("list") in ("1", "true"):
            return web.json_response({"path": path, "entries": await asyncio.to_thread(box.list, path)})
        st = await asyncio.to_thread(box.stat, path)  # errors (404, 403, 409) before the body starts
        if request.query.get("stat") in ("1", "true"):
            kinds = {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "symlink"}
            return web.json_response({"path": path, "type": kinds.get(stat.S_IFMT(st.st_mode), "other"),
                                      "size": st.st_size, "mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid,
                                      "gid": st.st_gid, "mtime": st.st_mtime})
        if not stat.S_ISREG(st.st_mode):
            raise ApiError(409, "file_conflict", f"{path} is not a regular file (list a directory with list=1)")
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        loop = asyncio.get_running_loop()

        class Sink(io.RawIOBase):  # the thread's file writes become response chunks, one at a time
            def write(self, data: Any) -> int:
                asyncio.run_coroutine_threadsafe(resp.write(bytes(data)), loop).result()
                return len(data)

        await asyncio.to_thread(box.download, path, Sink())
        await resp.write_eof()
        return resp

    async def files_put(self, request: web.Request) -> web.Response:
        box = await self._box(request, self._project(request))
        path = self._path(request)
        try:
            mode = int(request.query.get("mode", "644"), 8)
        except ValueError:
            raise ApiError(400, "bad_request", "'mode' must be octal, e.g. 644") from None
        loop = asyncio.get_running_loop()
        content = request.content

        class Source(io.RawIOBase):  # the request body, read by the upload thread as it arrives
            def read(self, size: int = -1) -> bytes:
                n = size if size > 0 else 1 << 20
                return asyncio.run_coroutine_threadsafe(content.read(n), loop).result()

        written = await asyncio.to_thread(box.upload, path, Source(), mode)
        return web.json_response({"path": path, "bytes": written}, status=201)

    async def files_delete(self, request: web.Request) -> web.Response:
        box = await self._box(request, self._project(request))
        path = self._path(request)
        await asyncio.to_thread(box.remove, path, recursive=request.query.get("recursive") in ("1", "true"))
        return web.Response(status=204)

    # -- description and metrics -----------------------------------------------------------------------
    async def load(self, request: web.Request) -> web.Response:
        self._project(request)  # any valid token may read it; it names no sandbox
        return web.json_response(self.admission.report())

    async def capabilities(self, request: web.Request) -> web.Response:
        self._project(request)
        return web.json_response(CAPABILITIES)

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(OPENAPI)

    async def metrics(self, request: web.Request) -> web.Response:
        def render() -> bytes:
            counts: dict[tuple[str, str], int] = {}
            for st in self.manager.list():
                key = (_project_of(st) or "", str(st.get("status")))
                counts[key] = counts.get(key, 0) + 1
            self.m_sandboxes.clear()
            for (proj, status), n in counts.items():
                self.m_sandboxes.labels(proj, status).set(n)
            for resource, free in self.admission.free().items():
                self.m_free.labels(resource).set(free)
            return generate_latest(self.registry)

        body = await asyncio.to_thread(render)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


# What this backend can do; a request for anything else is refused, never downgraded.
CAPABILITIES: dict[str, Any] = {
    "isolation": [ISOLATION],
    "cpu_classes": ["latency", "best-effort"],
    "limits": ["cpu", "memory", "pids", "disk"],
    "network": {"default": "deny", "egress_rules": ["cidr", "host", "ports", "protocol"], "runtime_changes": True},
    "checkpoint": {"filesystem": True, "processes": False},
    "preemption": True,
    "fncall": True,
    "streaming": "ndjson",
}


# -- OpenAPI (hand-written: exactly the routes above) ------------------------------------------------
def _op(summary: str, responses: dict[str, str], *, body: str | None = None, query: tuple[str, ...] = (),
        path_id: bool = True) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "security": [{"bearer": []}],
                          "responses": {code: {"description": d} for code, d in
                                        {**responses, "401": "missing or unknown token",
                                         "403": "project disabled"}.items()}}
    params = [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}] if path_id else []
    params += [{"name": q, "in": "query", "required": q == "path", "schema": {"type": "string"}} for q in query]
    if params:
        op["parameters"] = params
    if body == "json":
        op["requestBody"] = {"content": {"application/json": {"schema": {"type": "object"}}}}
    elif body == "bytes":
        op["requestBody"] = {"content": {"application/octet-stream": {"schema": {"type": "string",
                                                                                  "format": "binary"}}}}
    if path_id:
        op["responses"].setdefault("404", {"description": "no such sandbox in this project"})
    return op


OPENAPI: dict[str, Any] = {
    "openapi": "3.0.3",
    "info": {"title": "layerbox sandbox service", "version": "1"},
    "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
                   "schemas": {"Error": {"type": "object", "properties": {"error": {
                       "type": "object", "properties": {"code": {"type": "string"}, "message": {"type": "string"},
                                                        "retryable": {"type": "boolean"}}}}}}},
    "paths": {
        "/v1/sandboxes": {
            "post": _op("Create a sandbox from an image or checkpoint ref (image, cpu, memory, pids, disk, "
                        "cpu_class latency|best-effort, env, workdir, labels, ttl, idle_timeout, job, lease_ttl, "
                        "network: egress allow rules, isolation)",
                        {"201": "the sandbox", "400": "bad request or unsupported isolation",
                         "429": "project quota reached (retryable)",
                         "503": "edge out of capacity (code 'capacity', retryable, Retry-After; "
                                "error.resources names what is short)"}, body="json", path_id=False),
            "get": _op("List this project's sandboxes", {"200": "sandboxes"}, path_id=False),
        },
        "/v1/sandboxes/{id}": {
            "get": _op("Describe a sandbox", {"200": "the sandbox"}),
            "delete": _op("Destroy a sandbox", {"204": "destroyed"}),
        },
        "/v1/sandboxes/{id}/exec": {
            "post": _op("Run a command (cmd, env, cwd, timeout, stdin as base64, output_cap, idempotency_key); "
                        "the response streams newline-delimited JSON events: stdout/stderr (base64 data, at most "
                        "output_cap bytes each), then exit (with interrupted, replayed) or error. Closing the "
                        "connection kills the command.",
                        {"200": "application/x-ndjson event stream",
                         "409": "sandbox not running, job preempted or key still running (retryable)"},
                        body="json"),
        },
        "/v1/sandboxes/{id}/files": {
            "get": _op("Read a file (streamed), list a directory with list=1, or stat=1 for one entry's "
                       "type, size, mode, owner and mtime (a symlink itself)", {"200": "bytes or JSON"},
                       query=("path", "list", "stat")),
            "put": _op("Write a file (mode in octal)", {"201": "written"}, body="bytes", query=("path", "mode")),
            "delete": _op("Remove a file or (recursive=1) a directory", {"204": "removed"},
                          query=("path", "recursive")),
        },
        "/v1/sandboxes/{id}/pause": {"post": _op("Freeze the sandbox and reclaim its memory",
                                                 {"200": "reclaim report", "409": "not running"})},
        "/v1/sandboxes/{id}/resume": {"post": _op("Thaw a paused sandbox", {"200": "the sandbox",
                                                                            "409": "not paused"})},
        "/v1/sandboxes/{id}/checkpoint": {"post": _op("Checkpoint the rootfs into the store (name, labels)",
                                                      {"201": "the checkpoint"}, body="json")},
        "/v1/sandboxes/restore": {"post": _op(
            "Start a sandbox on a checkpoint of this project (checkpoint, policy_version, and create's options)",
            {"201": "the sandbox", "404": "no such checkpoint in this project", "409": "policy or digests differ",
             "429": "project quota reached (retryable)", "503": "edge out of capacity (retryable)"},
            body="json", path_id=False)},
        "/v1/sandboxes/{id}/receipts": {"get": _op("The sandbox's receipts, oldest first (filters: action, "
                                                   "since, idempotency_key)", {"200": "receipts"},
                                                   query=("action", "since", "idempotency_key"))},
        "/v1/sandboxes/{id}/network": {"put": _op("Replace the egress allow rules (rules: [{cidr|host, ports, "
                                                  "protocol}]) while the sandbox runs",
                                                  {"200": "the effective policy", "400": "bad rule",
                                                   "409": "created without a network"}, body="json")},
        "/v1/jobs/{job}/renew": {"post": _op("Renew the job's lease (ttl)", {"200": "the lease"}, body="json",
                                             path_id=False)},
        "/v1/jobs/{job}/pause": {"post": _op("Pause every sandbox of the job", {"200": "paused ids"},
                                             path_id=False)},
        "/v1/jobs/{job}/resume": {"post": _op("Resume every paused sandbox of the job", {"200": "resumed ids"},
                                              path_id=False)},
        "/v1/jobs/{job}/preempt": {"post": _op("Drain the job (in-flight commands get timeout seconds), "
                                               "checkpoint every sandbox, write a run manifest, free the host",
                                               {"201": "the run", "404": "no sandboxes of that job here"},
                                               body="json", path_id=False)},
        "/v1/runs/resume": {"post": _op("Restore a preempted job from its run manifest (manifest); commands "
                                        "are admitted once every sandbox is up",
                                        {"201": "old -> new sandbox ids", "404": "no such run in this project",
                                         "409": "digests or policy differ"}, body="json", path_id=False)},
        "/v1/calls": {"post": _op("FnCall: run cmd, or a Python function (function source, args, kwargs), on a "
                                  "warm container of image, in a fresh writable layer",
                                  {"200": "exit code, output (base64), value, error, timings"}, body="json",
                                  path_id=False)},
        "/v1/capabilities": {"get": _op("What this backend provides (isolation kinds, limits, network, "
                                        "checkpoint kinds); ask for nothing else", {"200": "capabilities"},
                                        path_id=False)},
        "/v1/load": {"get": _op("Load report: sandboxes live/in flight/max, free memory/pids/disk, load "
                                "average, score, accepting", {"200": "the load report"}, path_id=False)},
        "/openapi.json": {"get": {"summary": "This document", "responses": {"200": {"description": "OpenAPI"}}}},
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "text"}}}},
    },
}


# -- entry point --------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sandbox.service", description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--store", required=True, help="store URL (file://... or s3://...)")
    parser.add_argument("--port", type=int, default=8470)
    parser.add_argument("--tokens", required=True, help="JSON file: projects, their tokens and quotas")
    defaults = AdmissionConfig()
    parser.add_argument("--edge-id", help="name in load reports and errors (default: HOSTNAME:PORT)")
    parser.add_argument("--max-sandboxes", type=int, default=defaults.max_sandboxes,
                        help="live sandboxes this edge admits (default %(default)s)")
    parser.add_argument("--memory-reserve", type=parse_size, default=defaults.memory_reserve,
                        help="memory kept for the host, e.g. 2G (default %(default)s bytes)")
    parser.add_argument("--disk-reserve", type=parse_size, default=defaults.disk_reserve,
                        help="disk kept free in --data-dir, e.g. 1G (default %(default)s bytes)")
    parser.add_argument("--pids-reserve", type=int, default=defaults.pids_reserve,
                        help="tasks kept for the host (default %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    try:
        auth = AuthConfig.load(args.tokens)
    except (OSError, ValueError) as exc:
        parser.error(f"--tokens {args.tokens}: {exc}")
    manager = SandboxManager(args.data_dir, args.store)
    report = manager.reconcile()  # adopt what survived a previous run, clean up the rest
    log.info("reconciled: %s", report)
    admission = Admission(AdmissionConfig(edge_id=args.edge_id or f"{socket.gethostname()}:{args.port}",
                                          max_sandboxes=args.max_sandboxes, memory_reserve=args.memory_reserve,
                                          disk_reserve=args.disk_reserve, pids_reserve=args.pids_reserve),
                          disk_path=manager.data_dir, boxes=manager.boxes)
    web.run_app(SandboxService(manager, auth, admission).app(), host="127.0.0.1", port=args.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
