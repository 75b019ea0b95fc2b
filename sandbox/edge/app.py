"""The sandbox edge service: an HTTP API over one :class:`SandboxManager`.

Every request carries ``Authorization: Bearer <token>``; a token belongs to one
project.  Everything a caller can name belongs to a project, and a project
reaches only its own (docs/SECURITY.md, "Tenancy"):

* a sandbox belongs to the project that created it (``layerbox.project`` in its
  options' labels, so ownership survives a restart); other projects' ids answer
  404, never 403, so ids leak nothing;
* a checkpoint belongs to the project of the sandbox it was made from (the same
  label, in the checkpoint document); its ref is written under the project's
  namespace ``projects/<project>/``, which only that project writes;
* a run manifest belongs to the project its job belongs to (jobs are scoped as
  ``<project>/<job>``) and lives under ``projects/<project>/runs/``;
* images (refs outside ``projects/``, published by the operator with the CLI or
  through a token of an ``admin`` project) are shared and read-only.

Create, restore, FnCall and run resume resolve the ref once, check its owner, and
hand the manager the checked digest.  Each project has a quota on live sandboxes
(429 past it); past the quota, the edge admits a create only if the host really
has room (:mod:`sandbox.host.admission`; 503 ``capacity`` otherwise).

Every request field is validated once (:mod:`sandbox.core.model`) against the model's
bounds and this edge's :class:`~sandbox.core.model.Maxima`; a bad one answers 400
``invalid_field`` with ``error.field`` naming it.  Errors are
``{"error": {"code", "message", "retryable"[, "field"]}}``.  ``POST .../exec``
answers with a chunked stream of newline-delimited JSON events::

    {"type": "stdout", "data": "<base64>"}
    {"type": "stderr", "data": "<base64>"}
    {"type": "truncated", "stream": "stdout", "offset": 1048576, "dropped_bytes": 5000, "keep": "head"}
                    (the stream skips dropped_bytes of output after its first offset bytes; with
                     "keep": "tail" the stream's last bytes follow, up to output_cap of them)
    {"type": "exit", "exit_code": 0, "signal": null, "truncated": false, "duration": 0.01,
     "timed_out": false, "oom_killed": false, "interrupted": null, "replayed": false}
    {"type": "error", "error": {...}}          (instead of "exit" when the exec failed)

The manager's runtime calls block, so each goes through ``asyncio.to_thread``;
file work runs on its own bounded executor, at most ``FILE_OPS_PER_PROJECT`` at
a time per project, so one project cannot starve the others.  The service binds
127.0.0.1 only; put a TLS proxy in front of it for anything remote.
``/metrics`` needs a token of an admin project.

Tokens file (JSON)::

    {"projects": {"alpha": {"tokens": ["..."], "max_sandboxes": 10, "disabled": false, "admin": false}}}
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import concurrent.futures
import contextlib
import functools
import io
import json
import logging
import secrets
import socket
import stat
import time
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from layerstore.errors import LayerboxError
from layerstore.objects import BadName, Resolved, parse_ref, ref_key
from sandbox.backends.base import Capabilities
from sandbox.core.errors import (
    ImageNotFound,
    InvalidField,
    NotARegularFile,
    PathEscape,
    ReceiptsBroken,
    RuntimeTimeout,
    SandboxError,
    SandboxNotFound,
    SandboxStateError,
    UnsupportedOption,
)
from sandbox.core.model import (
    ISOLATIONS,
    MAX_REF_NAME,
    PROJECT_LABEL,
    ExecRequest,
    Maxima,
    SandboxFilter,
    SandboxOptions,
    SandboxState,
    check_job,
    check_labels,
    check_number,
    check_object,
    check_path,
    check_project,
    check_sandbox_id,
    check_str,
    project_namespace,
)
from sandbox.core.receipts import verify_receipt_chain
from sandbox.edge import openapi
from sandbox.host.admission import (
    RESOURCES,
    Admission,
    AdmissionConfig,
    CapacityExceeded,
    Demand,
    parse_size,
)
from sandbox.host.execs import Cut
from sandbox.host.manager import IN_FLIGHT, Cancel, Sandbox, SandboxManager
from sandbox.host.runs import preempt, resume_run
from snapshots.errors import CheckpointMismatch

if TYPE_CHECKING:
    from sandbox.edge.commands import Limits as CommandLimits

log = logging.getLogger("layerbox.sandbox.service")

T = TypeVar("T")

DEFAULT_QUOTA = 10
MAX_BODY = 64 << 20  # JSON bodies; file uploads stream and have no limit but the sandbox's disk
MAX_JSON_DEPTH = 32
DEFAULT_JOB = "default"
DEFAULT_LEASE_TTL = 600.0
REAP_INTERVAL = 5.0
READY_REFILL_AFTER = 0.5  # seconds after a ready sandbox is adopted that its replacement starts
READY_WARM_UP = ("/bin/true",)  # run once in each ready sandbox (WarmPool's warm): not found is fine too
SHUTDOWN_GRACE = 10.0  # seconds requests in flight get to finish after SIGTERM (aiohttp's default is 60)
STREAM_QUEUE = 64  # exec events buffered per request: a slow reader slows the command, never the host
FILE_OPS_PER_PROJECT = 4  # blocking file work in flight per project
FILE_THREADS = 32
MAX_FUNCTION_SOURCE = 1 << 20
SHARED_LABEL = "layerbox.shared"  # set by an admin project: the checkpoint is readable by every project

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# -- configuration --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Project:
    name: str
    max_sandboxes: int = DEFAULT_QUOTA
    disabled: bool = False
    admin: bool = False  # may publish shared refs and read /metrics (an operator's project)


@dataclass
class AuthConfig:
    """Bearer token -> project."""

    tokens: dict[str, Project] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> AuthConfig:
        out: dict[str, Project] = {}
        for name, spec in (doc.get("projects") or {}).items():
            check_project(name, "projects")
            check_object(f"projects.{name}", spec, ("tokens", "max_sandboxes", "disabled", "admin"))
            quota = spec.get("max_sandboxes", DEFAULT_QUOTA)
            if not isinstance(quota, int) or isinstance(quota, bool) or quota < 0:
                raise ValueError(f"project {name!r}: max_sandboxes must be a non-negative integer")
            project = Project(name, quota, bool(spec.get("disabled", False)), bool(spec.get("admin", False)))
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
                 headers: Mapping[str, str] | None = None, field: str | None = None,
                 resources: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.retryable = status, code, message, retryable
        self.headers = dict(headers or {})
        self.field = field
        self.resources = tuple(resources)  # what a quota or capacity rejection was short of

    def body(self) -> dict[str, Any]:
        err: dict[str, Any] = {"code": self.code, "message": self.message, "retryable": self.retryable}
        if self.field is not None:
            err["field"] = self.field
        if self.resources:
            err["resources"] = list(self.resources)
        return {"error": err}


class _CapacityError(ApiError):
    """503 ``capacity``: the body also names the short resources, for clients that act on them."""

    def __init__(self, exc: CapacityExceeded) -> None:
        super().__init__(503, "capacity", str(exc), retryable=True,
                         headers={"Retry-After": str(max(1, round(exc.retry_after)))}, resources=exc.resources)


def _invalid(field: str, message: str) -> ApiError:
    return ApiError(400, "invalid_field", f"{field}: {message}", field=field)


def _ref_key(name: str) -> str | None:
    """The ref ``name`` names (``img/python`` and ``img/python:latest`` are one), None for a digest."""
    try:
        return ref_key(name)
    except BadName:
        return None


def _as_api_error(exc: BaseException) -> ApiError:
    """The one place library exceptions become HTTP statuses."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, CapacityExceeded):
        return _CapacityError(exc)
    if isinstance(exc, InvalidField):
        return _invalid(exc.field, exc.detail)
    if isinstance(exc, BadName):
        return ApiError(400, "invalid_field", str(exc))
    if isinstance(exc, SandboxNotFound):
        return ApiError(404, "sandbox_not_found", str(exc))
    if isinstance(exc, ImageNotFound):  # e.g. FnCall on a ref that does not resolve
        return ApiError(404, "image_not_found", str(exc))
    if isinstance(exc, SandboxStateError):
        return ApiError(409, "conflict", str(exc), retryable=bool(getattr(exc, "retryable", False)))
    if isinstance(exc, CheckpointMismatch):  # e.g. a restore under another policy_version than it was made
        return ApiError(409, "conflict", str(exc))
    if isinstance(exc, PathEscape):
        return ApiError(403, "path_escape", str(exc))
    if isinstance(exc, NotARegularFile):
        return ApiError(409, "not_a_regular_file", str(exc))
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


def _view(state: SandboxState) -> dict[str, Any]:
    labels = {k: v for k, v in state.labels.items() if k != PROJECT_LABEL}
    o = state.options
    return {"id": state.id, "status": state.status, "image": state.ref, "image_digest": state.image_digest,
            "labels": labels, "limits": {"cpu": o.cpu, "memory": o.memory, "pids": o.pids,
                                         "best_effort": o.cpu_class == "best-effort"},
            "created": state.created, "last_active": state.last_active, "isolation": o.isolation,
            "job": state.job.partition("/")[2] if state.job else None, "cpu_class": o.cpu_class,
            "disk": o.disk, "admitting": state.admitting, "network": state.network, "userns": o.userns,
            "ttl": o.ttl, "idle_timeout": o.idle_timeout,
            "expires": round(state.created + o.ttl, 3) if o.ttl is not None else None}


def _json_depth(doc: Any, limit: int) -> bool:
    """Whether ``doc`` nests deeper than ``limit`` (iterative: the check itself cannot overflow)."""
    stack = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > limit:
                return True
            items = value.values() if isinstance(value, dict) else value
            stack.extend((v, depth + 1) for v in items if isinstance(v, (dict, list)))
    return False


# -- the service ----------------------------------------------------------------------------------------
class SandboxService:
    """Routes, auth, ownership, quotas and metrics over one manager; build the app with :meth:`app`.

    ``shutdown_manager``: when the app stops (SIGTERM), destroy every sandbox, unmount
    every layer and stop the host's lazyfetch daemon; a crash (SIGKILL) instead leaves
    them for the next start's reconcile.
    """

    def __init__(self, manager: SandboxManager, auth: AuthConfig, admission: Admission | None = None, *,
                 lease_ttl: float = DEFAULT_LEASE_TTL, reap_interval: float = REAP_INTERVAL,
                 fncall_pool: int = 2, maxima: Maxima | None = None, shutdown_manager: bool = False,
                 url_secret: bytes | None = None,
                 command_limits: CommandLimits | None = None, ready: Mapping[str, int] | None = None,
                 isolations: Sequence[str] = ISOLATIONS) -> None:
        self.manager = manager
        # what this edge runs when its host can (an operator may keep microVMs off an edge)
        self.isolations = tuple(isolations)
        # ref -> how many sandboxes of it to keep started ahead of need (sandbox.pools.fncall.WarmPool):
        # a create of that image with options a ready sandbox can take is an adopt, not a start
        self.ready = dict(ready or {})
        self._ready_pools: dict[str, Any] = {}  # ref key -> sandbox.pools.fncall.WarmPool
        # signs port URLs (sandbox.edge.ports); unless given, a random key per start (URLs die with the process)
        self.url_secret = url_secret or secrets.token_bytes(32)
        self.auth = auth
        self.maxima = maxima or Maxima()
        self.lease_ttl = min(lease_ttl, self.maxima.lease_ttl)
        self.reap_interval = reap_interval
        self.fncall_pool = fncall_pool
        self.shutdown_manager = shutdown_manager
        self.command_limits = command_limits  # background commands and terminals (sandbox.edge.commands)
        self._calls: Any = None  # sandbox.pools.fncall.FnCalls, made on the first call
        self._reaper: asyncio.Task[None] | None = None
        self._warm: asyncio.Task[Any] | None = None
        self.admission = admission or Admission(AdmissionConfig(), disk_path=manager.data_dir,
                                                boxes=manager.boxes)
        self._pending: dict[str, int] = {}  # creates in flight per project (they count against the quota)
        self._flying: dict[str, list[set[str]]] = {}  # per project, per create in flight: the ids it made
        self._ended = 0  # creates ended (made or failed) since the start: _live's consistency check
        self._quota_lock = asyncio.Lock()
        self._file_pool = concurrent.futures.ThreadPoolExecutor(FILE_THREADS, thread_name_prefix="files")
        self._file_slots: dict[str, asyncio.Semaphore] = {}
        self._streams: set[Cancel] = set()  # commands streaming now: a stop interrupts them
        self._stopping = False
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
        self.m_ready = Gauge("layerbox_ready_sandboxes", "Ready pools (--ready): sandboxes ready now, adopted "
                             "and found stale (their image's ref had moved) since the start", ["image", "what"],
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
        from sandbox.edge import lifecycle  # (it builds on this module)
        lifecycle.add_routes(self, r)
        from sandbox.edge import ports  # (it imports this module)
        ports.add_routes(self, r)
        app.on_startup.append(self._start_background)
        app.on_shutdown.append(self._interrupt_streams)
        app.on_cleanup.append(self._stop_background)
        from sandbox.edge import commands  # (it imports this module) background commands, terminals
        commands.add_routes(self, app)
        return app

    # -- background: the reaper ------------------------------------------------------------------------
    async def _start_background(self, app: web.Application) -> None:
        self._reaper = asyncio.create_task(self._reap_forever())
        if self.ready:
            from sandbox.pools.fncall import (
                WarmPool,  # (it builds on the manager, as this module does)
            )
            for ref, size in self.ready.items():
                pool = WarmPool(self.manager, ref, size=size, warm=READY_WARM_UP)
                self._ready_pools[ref_key(ref)] = pool
                pool.fill()
        if self.manager.store_url:
            # the first create should not pay for the lazyfetch daemon's start-up
            self._warm = asyncio.create_task(asyncio.to_thread(self.manager.host.start_daemon))

    async def _interrupt_streams(self, app: web.Application) -> None:
        """On stop, before the server waits for the requests in flight: every streaming command is
        killed now and its caller gets its exit event (``interrupted: "shutdown"``, also in the
        receipt), rather than the stop waiting out the server's grace time for a long command."""
        self._stopping = True
        for cancel in list(self._streams):
            cancel.cancel("shutdown")

    async def _stop_background(self, app: web.Application) -> None:
        try:
            if self._warm is not None:
                with contextlib.suppress(Exception):
                    await self._warm
            if self._reaper is not None:
                self._reaper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._reaper
            for pool in self._ready_pools.values():
                try:
                    await pool.close()
                except Exception:
                    log.exception("closing the ready pool of %s", pool.ref)
            if self._calls is not None:
                await self._calls.close()
        finally:  # a pool that failed to close must not leave every other sandbox and mount behind
            # off the loop: an upload's thread may be waiting for the loop to hand it the next chunk
            await asyncio.to_thread(self._file_pool.shutdown, wait=True, cancel_futures=True)
            if self.shutdown_manager:
                await asyncio.to_thread(self.manager.close)

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
        except web.HTTPException as exc:  # aiohttp's own 404/405/413 for unknown routes and big bodies
            resp = self._error_response(ApiError(exc.status, "http", exc.reason))
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
        return f"{project.name}/{check_job(DEFAULT_JOB if name is None else name)}"

    def _touch_lease(self, state: SandboxState) -> None:
        """Any request on a job's sandbox renews its lease (rate-limited to a quarter of the ttl)."""
        if not state.job:
            return
        lease = self.manager.leases.get(state.job)
        if lease is None or lease.state != "active":
            return
        if lease.expires - time.time() < 0.75 * lease.ttl:
            self.manager.leases.renew(state.job)

    async def _box(self, request: web.Request, project: Project) -> tuple[Sandbox, SandboxState]:
        sid = check_sandbox_id(request.match_info["id"])  # before it is anything else: a 400 naming 'id'
        not_found = ApiError(404, "sandbox_not_found", f"no sandbox {sid!r} in project {project.name!r}")
        try:
            box = await asyncio.to_thread(self.manager.get, sid)
            state = await asyncio.to_thread(lambda: box.state)
        except SandboxNotFound:
            raise not_found from None
        if state.project != project.name:
            raise not_found
        await asyncio.to_thread(self._touch_lease, state)
        return box, state

    async def _resolve(self, project: Project, ref: str, *, field: str, kinds: tuple[str, ...]) -> Resolved:
        """Resolve ``ref`` once and check that ``project`` may use what it names.

        Images and compositions are shared; a checkpoint is the project's own (its
        document's project label), or shared by an admin project; a run manifest is the
        project's own job's.  Anything else answers 404, as a missing ref does.
        """
        # one code per field (what the caller named), the same for missing and for another project's
        code = {"checkpoint": "checkpoint_not_found", "manifest": "run_not_found"}.get(field, "image_not_found")
        not_found = ApiError(404, code, f"{field} {ref!r}: no such {' or '.join(kinds)} visible to "
                                               f"project {project.name!r}")
        async with await self.manager.open_store() as store:
            try:
                # an image through the host's ref cache (30 s, as the manager always did); a
                # checkpoint or run manifest a project just moved must not be answered stale
                resolved = await store.resolve(ref)
                if resolved.kind in ("checkpoint", "run"):
                    resolved = await store.resolve(ref, refresh=True)
            except BadName as exc:
                raise _invalid(field, str(exc)) from None
            except LayerboxError:  # missing, unreadable or not a document: the same answer as another's
                raise not_found from None
        if resolved.kind not in kinds or not self._may_read(project, resolved):
            raise not_found
        return resolved

    @staticmethod
    def _may_read(project: Project, resolved: Resolved) -> bool:
        if project.admin or resolved.kind in ("image", "composition"):
            return True
        if resolved.kind == "checkpoint":
            labels = resolved.doc.get("labels") or {}
            return isinstance(labels, dict) and (labels.get(PROJECT_LABEL) == project.name
                                                 or labels.get(SHARED_LABEL) == "true")
        if resolved.kind == "run":
            return str(resolved.doc.get("job", "")).startswith(project.name + "/")
        return False

    @staticmethod
    async def _json(request: web.Request) -> dict[str, Any]:
        if not request.can_read_body:
            return {}
        raw = await request.read()
        if not raw.strip():
            return {}
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, "bad_request", f"body is not JSON: {exc}") from None
        except RecursionError:
            raise ApiError(400, "bad_request", f"body nests deeper than {MAX_JSON_DEPTH} levels") from None
        if not isinstance(doc, dict):
            raise ApiError(400, "bad_request", "body must be a JSON object")
        if _json_depth(doc, MAX_JSON_DEPTH):
            raise ApiError(400, "bad_request", f"body nests deeper than {MAX_JSON_DEPTH} levels")
        return doc

    @staticmethod
    def _query_path(request: web.Request) -> str:
        path = request.query.get("path")
        if path is None:
            raise _invalid("path", "query parameter 'path' is required (an absolute path in the sandbox)")
        return check_path("path", path)

    def _owned(self, project: Project) -> list[SandboxState]:
        return [st for st in self.manager.list() if st.project == project.name]

    def _options(self, project: Project, body: Mapping[str, Any], *, extra: tuple[str, ...],
                 base: SandboxOptions | None = None) -> SandboxOptions:
        """The request's options (over ``base``, what a checkpoint's sandbox had), checked against
        this edge's maxima, in this project and job."""
        given = SandboxOptions.from_json(body, extra=extra)
        options = given if base is None else base.overlay(
            given, [k for k in SandboxOptions.CLIENT_FIELDS if body.get(k) is not None])
        options = self.maxima.check(options)
        return options.replace(labels={**options.labels, PROJECT_LABEL: project.name},
                               job=self._job(project, body.get("job")),
                               lease_ttl=given.lease_ttl or self.lease_ttl)

    async def _carried(self, resolved: Resolved) -> SandboxOptions | None:
        return await self.manager.carried_options(resolved) if resolved.kind == "checkpoint" else None

    async def _files(self, project: Project, fn: Callable[[], T]) -> T:
        """Blocking file work: on the file executor, at most FILE_OPS_PER_PROJECT per project at once."""
        slots = self._file_slots.setdefault(project.name, asyncio.Semaphore(FILE_OPS_PER_PROJECT))
        async with slots:
            return await asyncio.get_running_loop().run_in_executor(self._file_pool, fn)

    # -- sandboxes -----------------------------------------------------------------------------------
    async def create(self, request: web.Request) -> web.Response:
        project = self._project(request)
        body = await self._json(request)
        image = check_str("image", body.get("image"), max_len=512, what="an image or checkpoint ref")
        SandboxOptions.from_json(body, extra=("image",))  # every field checked before any lookup
        isolation = body.get("isolation") or "container"
        if isolation in ISOLATIONS:
            caps = await self._backend(isolation)
            if not caps.available:
                raise ApiError(400, "unsupported_isolation", f"isolation {isolation!r} is not available on this edge: "
                               f"{caps.reason}", field="isolation")
        resolved = await self._resolve(project, image, field="image", kinds=("image", "composition", "checkpoint"))
        options = self._options(project, body, extra=("image",), base=await self._carried(resolved))
        return await self._launch(project, [options], lambda: self._create(resolved, options, image))

    async def _create(self, resolved: Resolved, options: SandboxOptions, name: str) -> Sandbox:
        """A ready sandbox adopted when the pool of the ref ``name`` (as the caller wrote it) holds
        one of ``resolved`` (what the ref names now) and ``options`` fit; else a new one."""
        key = _ref_key(name) if resolved.kind != "checkpoint" else None
        pool = self._ready_pools.get(key) if key is not None else None
        if pool is not None and options.fits_ready_sandbox():
            started = time.perf_counter()
            box = pool.take(resolved.digest, refill_after=READY_REFILL_AFTER)
            if box is not None:
                try:
                    return await asyncio.to_thread(self.manager.adopt, box.id, resolved, options, name=name,
                                                   waited=time.perf_counter() - started)
                except BaseException as exc:
                    await asyncio.to_thread(self.manager.destroy, box.id)  # never handed out half-adopted
                    if not isinstance(exc, SandboxStateError):
                        raise
                    log.warning("ready sandbox %s not adopted, starting a new one: %s", box.id, exc)
        return await self.manager.create(resolved.digest, options, name=name)

    async def restore(self, request: web.Request) -> web.Response:
        """A new sandbox from a checkpoint this project made (on any edge of the store)."""
        project = self._project(request)
        body = await self._json(request)
        ref = check_str("checkpoint", body.get("checkpoint"), max_len=512, what="a checkpoint ref or digest")
        SandboxOptions.from_json(body, extra=("checkpoint", "count"))  # every field checked before any lookup
        count = None if body.get("count") is None else self.maxima.check_count(body["count"])
        resolved = await self._resolve(project, ref, field="checkpoint", kinds=("checkpoint",))
        options = self._options(project, body, extra=("checkpoint", "count"), base=await self._carried(resolved))
        if count is not None:  # {"sandboxes": [...]}: all of them or none, quota and capacity for all first
            async def restored() -> dict[str, Any]:
                boxes = await self.manager.restore_many(resolved.digest, count, options, name=ref)
                return {"sandboxes": await asyncio.to_thread(lambda: [_view(b.state) for b in boxes])}
            return await self._launch(project, [options] * count, restored)
        return await self._launch(project, [options],
                                  lambda: self.manager.restore(resolved.digest, options, name=ref))

    async def _admit(self, project: Project, demands: list[SandboxOptions]) -> None:
        """Count ``demands`` against the project's quota, or refuse with 429 (creates in flight count)."""
        async with self._quota_lock:
            live = await self._live(project)
            if live + len(demands) > project.max_sandboxes:
                more = f"; this needs {len(demands)} more" if len(demands) > 1 else ""
                raise ApiError(429, "quota_exceeded",
                               f"project {project.name!r} has {live} of {project.max_sandboxes} sandboxes{more}; "
                               "destroy one or retry later", retryable=True, headers={"Retry-After": "5"},
                               resources=("sandboxes",))
            self._pending[project.name] = self._pending.get(project.name, 0) + len(demands)

    async def _live(self, project: Project, attempts: int = 5) -> int:
        """The project's sandboxes, a create in flight counted once (as pending; the sandboxes it has
        made so far, whose states may already say running, are left out of the states).  The states
        are read off the loop: if a create ended meanwhile the count may be off, so it is read
        again; after ``attempts`` such reads every state counts as well as every pending create
        (too many, never too few)."""
        for _ in range(attempts):
            ended = self._ended
            states = await asyncio.to_thread(self._owned, project)
            if self._ended == ended:
                flying = set().union(*self._flying.get(project.name, []))
                return len([st for st in states if st.id not in flying]) + self._pending.get(project.name, 0)
        return len(states) + self._pending.get(project.name, 0)

    async def _launch(self, project: Project, demands: list[SandboxOptions],
                      start: Callable[[], Awaitable[T]]) -> web.Response:
        """Quota, then admission for every demand, then ``start``; both checks count creates in flight."""
        await self._admit(project, demands)
        made: set[str] = set()  # the ids start makes, as the manager picks them (IN_FLIGHT)
        flying = self._flying.setdefault(project.name, [])
        flying.append(made)
        token = IN_FLIGHT.set(made)
        try:
            with contextlib.ExitStack() as held:
                for options in demands:
                    held.enter_context(self.admission.reserve(Demand.of(options)))
                result = await start()
        except CapacityExceeded as exc:
            self.m_rejected.labels(exc.resources[0]).inc()
            log.info("create refused: %s", exc)
            raise
        finally:
            IN_FLIGHT.reset(token)
            self._ended += 1
            flying.remove(made)
            self._pending[project.name] -= len(demands)
        if isinstance(result, Sandbox):
            return web.json_response(_view(await asyncio.to_thread(lambda: result.state)), status=201)
        return web.json_response(result, status=201)

    async def list(self, request: web.Request) -> web.Response:
        project = self._project(request)
        wanted = SandboxFilter.from_query(list(request.query.items()))  # ?label=k=v&state=running
        owned = await asyncio.to_thread(self._owned, project)
        return web.json_response({"sandboxes": [_view(st) for st in owned if wanted.matches(st)]})

    async def get(self, request: web.Request) -> web.Response:
        _, state = await self._box(request, self._project(request))
        return web.json_response(_view(state))

    async def delete(self, request: web.Request) -> web.Response:
        box, _ = await self._box(request, self._project(request))
        await asyncio.to_thread(self.manager.destroy, box.id)
        return web.Response(status=204)

    async def pause(self, request: web.Request) -> web.Response:
        box, _ = await self._box(request, self._project(request))
        return web.json_response(await asyncio.to_thread(box.pause))

    async def resume(self, request: web.Request) -> web.Response:
        box, _ = await self._box(request, self._project(request))
        await asyncio.to_thread(box.resume)
        return web.json_response(_view(await asyncio.to_thread(lambda: box.state)))

    async def checkpoint(self, request: web.Request) -> web.Response:
        project = self._project(request)
        box, _ = await self._box(request, project)
        body = check_object("", await self._json(request), ("name", "labels", "memory"))
        memory = body.get("memory", False)
        if not isinstance(memory, bool):
            raise _invalid("memory", f"expected true or false, got {type(memory).__name__}")
        labels = check_labels("labels", body.get("labels") or {}, reserved_ok=project.admin)
        if project.admin and set(labels) & {PROJECT_LABEL}:  # sharing is a label; ownership stays the sandbox's
            raise _invalid(f"labels.{PROJECT_LABEL}", "a checkpoint's project is its sandbox's")
        name = None
        if body.get("name") is not None:
            given = check_str("name", body["name"], max_len=MAX_REF_NAME, what="a ref name (repo[:tag])")
            # a project names refs only inside its namespace; an admin project may publish anywhere
            name = given if project.admin else project_namespace(project.name) + given
            try:
                parse_ref(name)
            except BadName as exc:
                raise _invalid("name", str(exc)) from None
        try:
            ckpt = await box.checkpoint(name=name, labels=labels, memory=memory)
        except UnsupportedOption as exc:
            raise _invalid("memory", str(exc)) from None
        return web.json_response(ckpt.to_json(), status=201)

    async def receipts(self, request: web.Request) -> web.Response:
        """Receipts, oldest first; ``action``, ``since`` (Unix time) and ``idempotency_key`` filter them."""
        box, _ = await self._box(request, self._project(request))
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
                since = check_number("since", float(q["since"]), 0.0, 1e12)
            except ValueError:
                raise _invalid("since", "must be a Unix time in seconds") from None
            rows = [r for r in rows if float(r.get("time", 0)) >= since]
        return web.json_response({"sandbox": box.id, "head": head, "receipts": rows})

    async def network(self, request: web.Request) -> web.Response:
        box, _ = await self._box(request, self._project(request))
        body = check_object("", await self._json(request), ("rules",))
        rules = SandboxOptions(network=body.get("rules")).network  # the one validation of rules
        if rules is None:
            raise _invalid("rules", "is required: a list of egress allow rules ([] denies everything)")
        self.maxima.check(SandboxOptions(network=rules))
        return web.json_response(await asyncio.to_thread(box.set_network, list(rules)))

    # -- jobs and runs ---------------------------------------------------------------------------------
    async def job_renew(self, request: web.Request) -> web.Response:
        project = self._project(request)
        job = self._job(project, request.match_info["job"])
        body = check_object("", await self._json(request), ("ttl",))
        ttl = body.get("ttl")
        if ttl is not None:
            ttl = check_number("ttl", ttl, 0.0, self.maxima.lease_ttl, lo_open=True)
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
        body = check_object("", await self._json(request), ("timeout",))
        grace = check_number("timeout", body.get("timeout", 30.0), 0.0, self.maxima.exec_timeout)
        if not await asyncio.to_thread(self.manager.list, job=job):
            raise ApiError(404, "not_found", f"job {request.match_info['job']!r} has no sandboxes here")
        run = await preempt(self.manager, job, timeout=grace)
        self.m_preempt_seconds.observe(run.seconds)
        return web.json_response(run.to_json(), status=201)

    async def run_resume(self, request: web.Request) -> web.Response:
        project = self._project(request)
        body = check_object("", await self._json(request), ("manifest",))
        ref = check_str("manifest", body.get("manifest"), max_len=512, what="a run manifest ref or digest")
        resolved = await self._resolve(project, ref, field="manifest", kinds=("run",))
        entries = resolved.doc.get("sandboxes") or {}
        if not isinstance(entries, dict):
            raise _invalid("manifest", f"{ref} has no sandbox entries")
        # the whole job or nothing: quota and capacity for every sandbox before the first restore
        demands = [SandboxOptions.from_state((e or {}).get("options") or {}) if isinstance(e, dict)
                   else SandboxOptions() for e in entries.values()]
        return await self._launch(project, demands, lambda: self._resume(resolved))

    async def _resume(self, resolved: Resolved) -> dict[str, Any]:
        run = await resume_run(self.manager, resolved.digest, lease_ttl=self.lease_ttl)
        return run.to_json()

    # -- FnCall --------------------------------------------------------------------------------------------
    async def call(self, request: web.Request) -> web.Response:
        project = self._project(request)
        body = check_object("", await self._json(request),
                            ("image", "cmd", "function", "args", "kwargs", "timeout"))
        image = check_str("image", body.get("image"), max_len=512, what="an image ref")
        cmd, function = body.get("cmd"), body.get("function")
        if (cmd is None) == (function is None):
            raise _invalid("cmd", "give exactly one of 'cmd' and 'function'")
        timeout = check_number("timeout", body.get("timeout", 30.0), 0.0, self.maxima.exec_timeout, lo_open=True)
        if cmd is not None:
            cmd = ExecRequest(cmd=cmd).cmd  # the one validation of a command
        else:
            function = check_str("function", function, max_len=MAX_FUNCTION_SOURCE, what="Python source")
        args, kwargs = body.get("args") or [], body.get("kwargs") or {}
        if not isinstance(args, list):
            raise _invalid("args", "must be a list of JSON values")
        if not isinstance(kwargs, dict):
            raise _invalid("kwargs", "must be an object of JSON values")
        if cmd is not None and (args or kwargs):  # a command's arguments are its argv
            raise _invalid("args" if args else "kwargs", "goes with 'function', not with 'cmd'")
        # the pool runs exactly what was checked: its key is the resolved digest
        resolved = await self._resolve(project, image, field="image", kinds=("image", "composition", "checkpoint"))
        if self._calls is None:
            from sandbox.pools.fncall import FnCalls

            self._calls = FnCalls(self.manager, size=self.fncall_pool)
        self.m_execs.labels(project.name).inc()
        result = await self._calls.call(resolved.digest, cmd, function=function, args=args,
                                        kwargs=kwargs or None, timeout=timeout)
        self.m_call_seconds.observe(result.duration)
        return web.json_response({
            "exit_code": result.exit_code, "stdout": base64.b64encode(result.stdout).decode(),
            "stderr": base64.b64encode(result.stderr).decode(), "value": result.value, "error": result.error,
            "timed_out": result.timed_out, "truncated": result.truncated, "duration": result.duration,
            "wait_seconds": result.wait_seconds})

    # -- exec ----------------------------------------------------------------------------------------
    async def exec(self, request: web.Request) -> web.StreamResponse:
        project = self._project(request)
        box, state = await self._box(request, project)
        req = self.maxima.check_exec(ExecRequest.from_json(await self._json(request)))
        if state.status != "running":
            raise ApiError(409, "conflict", f"sandbox {box.id} is {state.status}, not running")
        if self._stopping:
            raise ApiError(503, "stopping", "this edge is stopping; retry on another one", retryable=True)

        loop = asyncio.get_running_loop()
        # bounded: the exec thread blocks when the client reads slowly, and the pipe then stops the command
        # (kind, output bytes), or ("truncated", where a stream was cut: sandbox.host.execs.Cut)
        events: asyncio.Queue[tuple[str, Any] | None] = asyncio.Queue(STREAM_QUEUE)
        cancel = Cancel()

        def forward(kind: str) -> Callable[[Any], None]:
            def push(data: Any) -> None:  # the manager hands over at most output_cap bytes per stream
                if cancel.is_set():
                    return
                fut = asyncio.run_coroutine_threadsafe(events.put((kind, data)), loop)
                while not cancel.is_set():
                    try:
                        fut.result(timeout=0.5)
                        return
                    except TimeoutError:
                        continue
                fut.cancel()
            return push

        cut_at = forward("truncated")

        def on_cut(cut: Cut) -> None:
            cut_at({**cut.to_json(), "keep": req.keep})

        # streamed, not kept: the service never buffers a command's output beyond the queue
        self._streams.add(cancel)
        run = asyncio.ensure_future(asyncio.to_thread(
            box.exec, req, on_stdout=forward("stdout"), on_stderr=forward("stderr"), cancel=cancel,
            keep_output=False, on_cut=on_cut))
        run.add_done_callback(lambda _: self._streams.discard(cancel))
        self.m_execs.labels(project.name).inc()

        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        async def send(event: tuple[str, Any] | None) -> None:
            assert event is not None
            kind, data = event
            doc = {"type": kind, **data} if isinstance(data, dict) else {"type": kind,
                                                                        "data": base64.b64encode(data).decode()}
            await resp.write(json.dumps(doc).encode() + b"\n")

        getter: asyncio.Future[tuple[str, Any] | None] | None = None
        try:
            # woken by the next chunk or by the command's end, whichever comes first: the exit
            # goes out the moment the exec returns, never after a poll interval
            while True:
                if request.transport is None or request.transport.is_closing():
                    raise ConnectionResetError("client went away")
                if getter is None:
                    getter = asyncio.ensure_future(events.get())
                waiting: set[asyncio.Future[Any]] = {getter, run}
                done, _ = await asyncio.wait(waiting, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    await send(getter.result())
                    getter = None
                elif run.done():
                    break
            # the exec thread hands every chunk over before it returns: what is left is queued
            if getter is not None:
                getter.cancel()
                if getter.done() and not getter.cancelled():
                    await send(getter.result())
            while not events.empty():
                await send(events.get_nowait())
        except (ConnectionResetError, asyncio.CancelledError):
            if getter is not None:
                getter.cancel()
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
        project = self._project(request)
        box, _ = await self._box(request, project)
        path = self._query_path(request)
        if _flag(request, "list"):
            return web.json_response({"path": path, "entries": await self._files(project, lambda: box.list(path))})
        if _flag(request, "stat"):
            st = await self._files(project, lambda: box.stat(path))
            kinds = {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "symlink"}
            return web.json_response({"path": path, "type": kinds.get(stat.S_IFMT(st.st_mode), "other"),
                                      "size": st.st_size, "mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid,
                                      "gid": st.st_gid, "mtime": st.st_mtime})
        # opened (and checked to be a regular file) before the response starts, so errors are statuses
        reader = cast("Generator[bytes, None, None]",  # (a generator: close() releases its descriptor)
                      await self._files(project, lambda: box.files.iter_read(path)))
        first = await self._files(project, functools.partial(next, reader, b""))
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        total = len(first)
        try:
            if first:
                await resp.write(first)
            while chunk := await self._files(project, functools.partial(next, reader, b"")):
                total += len(chunk)
                await resp.write(chunk)
        finally:
            reader.close()
        await asyncio.to_thread(box.receipt, "download", path=path, bytes=total)
        await resp.write_eof()
        return resp

    async def files_put(self, request: web.Request) -> web.Response:
        project = self._project(request)
        box, _ = await self._box(request, project)
        path = self._query_path(request)
        text = request.query.get("mode", "644")
        try:
            mode = int(text, 8)
        except ValueError:
            raise _invalid("mode", f"{text[:20]!r} is not octal, e.g. 644") from None
        if not 0 <= mode <= 0o777:  # no setuid, setgid or sticky bits through the API
            raise _invalid("mode", f"{text[:20]!r}: permission bits only (0-777)")
        loop = asyncio.get_running_loop()
        content = request.content

        class Source(io.RawIOBase):  # the request body, read by the upload thread as it arrives
            def read(self, size: int = -1) -> bytes:
                n = size if size > 0 else 1 << 20
                return asyncio.run_coroutine_threadsafe(content.read(n), loop).result()

        written = await self._files(project, lambda: box.upload(path, Source(), mode))
        return web.json_response({"path": path, "bytes": written}, status=201)

    async def files_delete(self, request: web.Request) -> web.Response:
        project = self._project(request)
        box, _ = await self._box(request, project)
        path = self._query_path(request)
        await self._files(project, lambda: box.remove(path, recursive=_flag(request, "recursive")))
        return web.Response(status=204)

    # -- description and metrics -----------------------------------------------------------------------
    async def load(self, request: web.Request) -> web.Response:
        self._project(request)  # any valid token may read it; it names no sandbox
        return web.json_response(self.admission.report())

    async def capabilities(self, request: web.Request) -> web.Response:
        self._project(request)
        backends = {isolation: await self._backend(isolation) for isolation in ISOLATIONS}
        return web.json_response({**CAPABILITIES,
                                  "isolation": [k for k, v in backends.items() if v.available],
                                  "checkpoint": {"filesystem": True, "processes": any(
                                      v.has("memory_checkpoint") for v in backends.values())},
                                  "backends": {k: v.to_json() for k, v in backends.items()}})

    async def _backend(self, isolation: str) -> Capabilities:
        if isolation not in self.isolations:
            return Capabilities(isolation, False, reason=f"this edge is configured without isolation={isolation} "
                                                         "(--isolation)")
        return await asyncio.to_thread(self.manager.backend(isolation).capabilities, isolation)

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi.DOCUMENT)

    async def metrics(self, request: web.Request) -> web.Response:
        project = self._project(request)
        if not project.admin:  # it names every project and its sandbox counts
            raise ApiError(403, "forbidden", "metrics need a token of an admin project")

        def render() -> bytes:
            counts: dict[tuple[str, str], int] = {}
            for st in self.manager.list():
                key = (st.project or "", st.status)
                counts[key] = counts.get(key, 0) + 1
            self.m_sandboxes.clear()
            for (proj, status), n in counts.items():
                self.m_sandboxes.labels(proj, status).set(n)
            for resource, free in self.admission.free().items():
                self.m_free.labels(resource).set(free)
            for pool in list(self._ready_pools.values()):
                stats = pool.stats()
                self.m_ready.labels(pool.ref, "ready").set(stats["ready"])
                self.m_ready.labels(pool.ref, "adopted").set(stats["taken"])
                self.m_ready.labels(pool.ref, "stale").set(stats["stale"])
            return generate_latest(self.registry)

        body = await asyncio.to_thread(render)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _flag(request: web.Request, name: str) -> bool:
    value = request.query.get(name)
    if value is None:
        return False
    if value not in ("0", "1", "true", "false"):
        raise _invalid(name, f"{value[:20]!r} is not one of 0, 1, true, false")
    return value in ("1", "true")


# What this backend can do; a request for anything else is refused, never downgraded.
CAPABILITIES: dict[str, Any] = {
    "isolation": ["container"],  # and "microvm", "vm" where this edge can run them (capabilities())
    "cpu_classes": ["latency", "best-effort"],
    "limits": ["cpu", "memory", "pids", "disk"],
    "network": {"default": "deny", "egress_rules": ["cidr", "host", "ports", "protocol"], "runtime_changes": True},
    "checkpoint": {"filesystem": True, "processes": False},  # processes: where a backend checkpoints memory
    "preemption": True,
    "fncall": True,
    "streaming": "ndjson",
    "commands": {"background": True, "pty": True, "websocket": True},
    "ports": {"http": True, "websocket": True, "signed_urls": True},
    "fork": True,
    "output": {"keep": ["head", "tail"], "cut_events": True},
}


# -- entry point --------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sandbox.edge", description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--store", required=True, help="store URL (file://... or s3://...)")
    parser.add_argument("--port", type=int, default=8470)
    parser.add_argument("--tokens", required=True, help="JSON file: projects, their tokens and quotas")
    defaults, maxima = AdmissionConfig(), Maxima()
    parser.add_argument("--edge-id", help="name in load reports and errors (default: HOSTNAME:PORT)")
    parser.add_argument("--max-sandboxes", type=int, default=defaults.max_sandboxes,
                        help="live sandboxes this edge admits (default %(default)s)")
    parser.add_argument("--memory-reserve", type=parse_size, default=defaults.memory_reserve,
                        help="memory kept for the host, e.g. 2G (default %(default)s bytes)")
    parser.add_argument("--disk-reserve", type=parse_size, default=defaults.disk_reserve,
                        help="disk kept free in --data-dir, e.g. 1G (default %(default)s bytes)")
    parser.add_argument("--pids-reserve", type=int, default=defaults.pids_reserve,
                        help="tasks kept for the host (default %(default)s)")
    parser.add_argument("--max-memory", type=parse_size, default=maxima.memory,
                        help="largest memory limit one sandbox may ask for (default %(default)s bytes)")
    parser.add_argument("--max-pids", type=int, default=maxima.pids,
                        help="largest pids limit one sandbox may ask for (default %(default)s)")
    parser.add_argument("--max-output-cap", type=parse_size, default=maxima.output_cap,
                        help="largest output_cap of one command, per stream (default %(default)s bytes)")
    parser.add_argument("--max-ttl", type=float, default=maxima.ttl, help="seconds (default %(default)s)")
    parser.add_argument("--max-lease-ttl", type=float, default=maxima.lease_ttl,
                        help="seconds (default %(default)s)")
    parser.add_argument("--isolation", action="append", choices=ISOLATIONS, default=[],
                        help="what this edge runs (repeatable; default every kind its host can run)")
    parser.add_argument("--ready", action="append", default=[], metavar="IMAGE=N",
                        help="keep N sandboxes of IMAGE (a ref) started ahead of need; a create of it with "
                        "default disk, network, userns and cpu_class adopts one (repeatable)")
    parser.add_argument("--url-secret-file", type=Path, help="at least 32 bytes that sign port URLs, the same "
                        "on every edge that should honour them (default: random per start)")
    args = parser.parse_args(argv)
    try:
        url_secret = args.url_secret_file.read_bytes() if args.url_secret_file else None
    except OSError as exc:
        parser.error(f"--url-secret-file: {exc}")
    if url_secret is not None and len(url_secret) < 32:
        parser.error(f"--url-secret-file {args.url_secret_file}: {len(url_secret)} bytes, at least 32")
    ready: dict[str, int] = {}
    for item in args.ready:
        ref, _, count = item.rpartition("=")
        if not ref or not count.isdigit() or not 1 <= int(count) <= 64:
            parser.error(f"--ready {item!r}: IMAGE=N with N from 1 to 64")
        ready[ref] = int(count)
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
    limits = Maxima(memory=args.max_memory, pids=args.max_pids, output_cap=args.max_output_cap, ttl=args.max_ttl,
                    idle_timeout=args.max_ttl, lease_ttl=args.max_lease_ttl)
    service = SandboxService(manager, auth, admission, maxima=limits, shutdown_manager=True, url_secret=url_secret,
                             ready=ready, isolations=args.isolation or ISOLATIONS)
    # SIGTERM: commands streaming are interrupted at once (_interrupt_streams); other requests in flight
    # (a file transfer to a slow client) get SHUTDOWN_GRACE s to finish, then as long again once cancelled
    web.run_app(service.app(), host="127.0.0.1", port=args.port, shutdown_timeout=SHUTDOWN_GRACE)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
