"""What every route of the edge stands on: :class:`EdgeContext`, one per service.

A route module (sandbox.edge.routes) gets the context and nothing else of the service: the
caller's project (:meth:`EdgeContext.project`), the sandbox a request names, checked against
that project (:meth:`~EdgeContext.sandbox`: another project's id answers 404, never 403), the
parsed body (:meth:`~EdgeContext.body`: bounded, an object, not too deep), refs resolved and
ownership-checked once (:meth:`~EdgeContext.resolve`), request options over this edge's
maxima (:meth:`~EdgeContext.options`), quota and admission around a start
(:meth:`~EdgeContext.launch`), lease renewal, and whether the edge is stopping.

Tenancy (docs/SECURITY.md): a sandbox belongs to the project that created it (the
``layerbox.project`` label); a checkpoint to its sandbox's project (the same label in its
document), written under ``projects/<project>/``; a run manifest to its job's project;
images are shared and read-only.  Each project has a quota on live sandboxes (429 past it);
within it, the edge admits a create only if the host has room (503 ``capacity``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from aiohttp import web

from layerstore.errors import LayerboxError
from layerstore.objects import BadName, Resolved, ref_key
from sandbox.backends.base import Capabilities
from sandbox.core.errors import ApiError, SandboxNotFound, SandboxStateError
from sandbox.core.model import (
    PROJECT_LABEL,
    PROTECTED_EGRESS_LABEL,
    Maxima,
    SandboxOptions,
    SandboxState,
    check_job,
    check_path,
    check_sandbox_id,
)
from sandbox.core.views import SandboxInfo
from sandbox.edge.auth import AuthConfig, Project
from sandbox.edge.caps import ProjectCaps, Usage
from sandbox.edge.errors import invalid
from sandbox.edge.metrics import Metrics
from sandbox.host.admission import Admission, CapacityExceeded, Demand
from sandbox.host.manager import IN_FLIGHT, SandboxManager
from sandbox.host.sandbox import Sandbox
from sandbox.pools.fncall import FnCalls, WarmPool

log = logging.getLogger("layerbox.sandbox.service")
T = TypeVar("T")

# JSON bodies: the largest request is a 1 MiB command or function with its arguments; big payloads
# go through the upload and stdin routes, which stream.  Parsing is off the loop and bounded in
# elements (a body of tiny nested objects costs far more to walk than to read).
MAX_BODY = 4 << 20
MAX_JSON_DEPTH = 32
MAX_JSON_ELEMENTS = 100_000  # objects and arrays in one body
CALLER_POLL = 1.0  # seconds between looks at a waiting caller's connection
DEFAULT_JOB = "default"
FILE_OPS_PER_PROJECT = 4  # blocking file work in flight per project
FILE_THREADS = 32
READY_REFILL_AFTER = 0.5  # seconds after a ready sandbox is adopted that its replacement starts
SHUTDOWN_GRACE = 10.0  # seconds requests in flight get to finish after SIGTERM (aiohttp's default is 60)
SHARED_LABEL = "layerbox.shared"  # set by an admin project: the checkpoint is readable by every project


class EdgeContext:
    """The service's state and the checks every route makes (see the module's docstring)."""

    def __init__(self, manager: SandboxManager, auth: AuthConfig, admission: Admission, maxima: Maxima, *,
                 lease_ttl: float, isolations: Sequence[str], metrics: Metrics,
                 caps: ProjectCaps | None = None) -> None:
        self.manager = manager
        self.auth = auth
        self.admission = admission
        self.maxima = maxima
        self.lease_ttl = lease_ttl
        self.isolations = tuple(isolations)  # what this edge runs when its host can
        self.metrics = metrics
        caps = caps or ProjectCaps()
        # what each project holds at once, and the edge in all (sandbox.edge.caps)
        self.usage = Usage(caps, caps.total(len({p.name for p in auth.tokens.values()})))
        self.stopping = False
        self.streams: set[Any] = set()  # the cancels of commands streaming now: a stop interrupts them
        self.ready_pools: dict[str, WarmPool] = {}  # ref key -> its ready sandboxes (--ready)
        self.fncalls: FnCalls | None = None  # the FnCall pools, made on the first call
        self._quota_lock = asyncio.Lock()
        self._pending: dict[str, int] = {}  # creates in flight per project (they count against the quota)
        self._flying: dict[str, list[set[str]]] = {}  # per project, per create in flight: the ids it made
        self._ended = 0  # creates ended (made or failed) since the start: _live's consistency check
        self._file_pool = concurrent.futures.ThreadPoolExecutor(FILE_THREADS, thread_name_prefix="files")
        self._file_slots: dict[str, asyncio.Semaphore] = {}

    # -- who asks, and for what ------------------------------------------------------------------------
    def project(self, request: web.Request) -> Project:
        return self.auth.authenticate(request)

    @staticmethod
    def job(project: Project, name: Any) -> str:
        """Jobs are per project: the manager sees ``<project>/<job>``."""
        return f"{project.name}/{check_job(DEFAULT_JOB if name is None else name)}"

    async def sandbox(self, request: web.Request, project: Project) -> tuple[Sandbox, SandboxState]:
        """The sandbox the route's ``{id}`` names, if ``project`` owns it (404 otherwise, as for none);
        a request on it renews its job's lease."""
        sid = check_sandbox_id(request.match_info["id"])  # before it is anything else: a 400 naming 'id'
        return await self.sandbox_of(sid, project)

    async def sandbox_of(self, sid: str, project: Project) -> tuple[Sandbox, SandboxState]:
        """The sandbox ``sid`` (its grammar checked) if ``project`` owns it, as :meth:`sandbox`."""
        found = await asyncio.to_thread(self.look_up, sid, project.name)
        if found is None:
            raise ApiError(None, "sandbox_not_found", f"no sandbox {sid!r} in project {project.name!r}")
        return found

    def look_up(self, sid: str, owner: str | None = None) -> tuple[Sandbox, SandboxState] | None:
        """Sandbox ``sid`` and its state if ``owner`` owns it (any owner: None, for a caller already
        let in for that sandbox alone), its job's lease renewed; None when there is no such one
        (blocking: one hop off the loop for what every request on a sandbox reads)."""
        try:
            box = self.manager.get(sid)
            state = box.state
        except SandboxNotFound:
            return None
        if owner is not None and state.project != owner:
            return None  # before the lease: another project's request renews nothing
        self.touch_lease(state)
        return box, state

    def touch_lease(self, state: SandboxState) -> None:
        """Any request on a job's sandbox renews its lease (rate-limited to a quarter of the ttl)."""
        if not state.job:
            return
        lease = self.manager.leases.get(state.job)
        if lease is None or lease.state != "active":
            return
        if lease.expires - time.time() < 0.75 * lease.ttl:
            self.manager.leases.renew(state.job)

    def owned(self, project: Project) -> list[SandboxState]:
        return self.owned_by(project.name)

    def owned_by(self, project: str) -> list[SandboxState]:
        return [st for st in self.manager.list() if st.project == project]

    async def resolve(self, project: Project, ref: str, *, field: str, kinds: tuple[str, ...]) -> Resolved:
        """Resolve ``ref`` once and check that ``project`` may use what it names.

        Images and compositions are shared; a checkpoint is the project's own (its
        document's project label), or shared by an admin project; a run manifest is the
        project's own job's.  Anything else answers 404, as a missing ref does.
        """
        # one code per field (what the caller named), the same for missing and for another project's
        code = {"checkpoint": "checkpoint_not_found", "manifest": "run_not_found"}.get(field, "image_not_found")
        not_found = ApiError(None, code, f"{field} {ref!r}: no such {' or '.join(kinds)} visible to "
                                         f"project {project.name!r}")
        async with await self.manager.open_store() as store:
            try:
                # an image through the host's ref cache (30 s, as the manager always did); a
                # checkpoint or run manifest a project just moved must not be answered stale
                resolved = await store.resolve(ref)
                if resolved.kind in ("checkpoint", "run"):
                    resolved = await store.resolve(ref, refresh=True)
            except BadName as exc:
                raise invalid(field, str(exc)) from None
            except LayerboxError:  # missing, unreadable or not a document: the same answer as another's
                raise not_found from None
        if resolved.kind not in kinds or not self.may_read(project, resolved):
            raise not_found
        return resolved

    @staticmethod
    def may_read(project: Project, resolved: Resolved) -> bool:
        if project.admin or resolved.kind in ("image", "composition"):
            return True
        if resolved.kind == "checkpoint":
            labels = resolved.doc.get("labels") or {}
            return isinstance(labels, dict) and (labels.get(PROJECT_LABEL) == project.name
                                                 or labels.get(SHARED_LABEL) == "true")
        if resolved.kind == "run":
            return str(resolved.doc.get("job", "")).startswith(project.name + "/")
        return False

    # -- what it sends -----------------------------------------------------------------------------------
    @staticmethod
    async def body(request: web.Request) -> dict[str, Any]:
        """The request's JSON object ({} for none); 400 for anything else, more than MAX_JSON_ELEMENTS
        objects and arrays, or nesting past MAX_JSON_DEPTH; 413 past MAX_BODY (aiohttp's)."""
        if not request.can_read_body:
            return {}
        raw = await request.read()
        if not raw.strip():
            return {}
        # brackets inside strings count too: an over-count refuses a few odd bodies, never admits a big one
        if raw.count(b"{") + raw.count(b"[") > MAX_JSON_ELEMENTS:
            raise ApiError(None, "bad_request", f"body has more than {MAX_JSON_ELEMENTS} objects and arrays; "
                                                "send data through the upload or stdin routes")
        return await asyncio.to_thread(_parse_object, raw)

    @staticmethod
    def query_path(request: web.Request) -> str:
        path = request.query.get("path")
        if path is None:
            raise invalid("path", "query parameter 'path' is required (an absolute path in the sandbox)")
        return check_path("path", path)

    def options(self, project: Project, body: Mapping[str, Any], *, extra: tuple[str, ...],
                base: SandboxOptions | None = None) -> SandboxOptions:
        """The request's options (over ``base``, what a checkpoint's sandbox had), checked against
        this edge's maxima, in this project and job."""
        given = SandboxOptions.from_json(body, extra=extra)
        options = given if base is None else base.overlay(
            given, [k for k in SandboxOptions.CLIENT_FIELDS if body.get(k) is not None])
        options = self.maxima.check(options)
        allowed = {PROTECTED_EGRESS_LABEL: "true"} if project.egress_protected else {}  # the operator's, per project
        return options.replace(labels={**options.labels, PROJECT_LABEL: project.name, **allowed},
                               job=self.job(project, body.get("job")),
                               lease_ttl=given.lease_ttl or self.lease_ttl)

    async def carried(self, resolved: Resolved) -> SandboxOptions | None:
        return await self.manager.carried_options(resolved) if resolved.kind == "checkpoint" else None

    async def capabilities(self, isolation: str) -> Capabilities:
        """What ``isolation`` provides on this edge (what its backend reports, unless configured off)."""
        if isolation not in self.isolations:
            return Capabilities(isolation, False, reason=f"this edge is configured without isolation={isolation} "
                                                         "(--isolation)")
        return await asyncio.to_thread(self.manager.backend(isolation).capabilities, isolation)

    @staticmethod
    async def views(boxes: Sequence[Sandbox]) -> list[dict[str, Any]]:
        return await asyncio.to_thread(lambda: [SandboxInfo.of(b.state).to_json() for b in boxes])

    # -- work it starts ------------------------------------------------------------------------------------
    async def files(self, project: Project, fn: Callable[[], T]) -> T:
        """Blocking file work: on the file executor, at most FILE_OPS_PER_PROJECT per project at once."""
        slots = self._file_slots.setdefault(project.name, asyncio.Semaphore(FILE_OPS_PER_PROJECT))
        async with slots:
            return await asyncio.get_running_loop().run_in_executor(self._file_pool, fn)

    async def close_files(self) -> None:
        # off the loop: an upload's thread may be waiting for the loop to hand it the next chunk
        await asyncio.to_thread(self._file_pool.shutdown, wait=True, cancel_futures=True)

    async def launch(self, project: Project, demands: list[SandboxOptions],
                     start: Callable[[], Awaitable[T]]) -> web.Response:
        """Quota, then admission for every demand, then ``start``; both checks count creates in flight.
        The answer is 201 with the sandbox's view (``start`` made one) or ``start``'s document."""
        async with self.admitted(project.name, project.max_sandboxes, demands):
            result = await start()
        if isinstance(result, Sandbox):
            return web.json_response((await self.views([result]))[0], status=201)
        return web.json_response(result, status=201)

    @contextlib.asynccontextmanager
    async def admitted(self, project: str, quota: int, demands: list[SandboxOptions]) -> AsyncIterator[None]:
        """Within the block, ``demands`` count against ``project``'s quota (429 past it) and this
        host's capacity (503); the sandboxes the block makes are told apart from those it counts."""
        await self._admit(project, quota, len(demands))
        made: set[str] = set()  # the ids the block makes, as the manager picks them (IN_FLIGHT)
        flying = self._flying.setdefault(project, [])
        flying.append(made)
        token = IN_FLIGHT.set(made)
        try:
            async with self.capacity(demands):
                yield
        except CapacityExceeded as exc:
            log.info("create refused: %s", exc)
            raise
        finally:
            IN_FLIGHT.reset(token)
            self._ended += 1
            flying.remove(made)
            self._pending[project] -= len(demands)

    @contextlib.asynccontextmanager
    async def lent(self, project: str, quota: int) -> AsyncIterator[None]:
        """Within the block, one sandbox lent to ``project`` (an FnCall's, from its warm pool)
        counts against its quota: a call in flight is a sandbox the project uses."""
        await self._admit(project, quota, 1)
        try:
            yield
        finally:
            self._pending[project] -= 1

    @contextlib.asynccontextmanager
    async def capacity(self, demands: list[SandboxOptions]) -> AsyncIterator[None]:
        """Within the block, ``demands`` hold room in this host's capacity (503 past it): the
        operator's own sandboxes (warm pools), which no project's quota counts until lent."""
        try:
            with contextlib.ExitStack() as held:
                for options in demands:
                    held.enter_context(self.admission.reserve(Demand.of(options)))
                yield
        except CapacityExceeded as exc:
            self.metrics.rejected.labels(exc.resources[0]).inc()
            raise

    async def _admit(self, project: str, quota: int, n: int) -> None:
        """Count ``n`` more sandboxes against the project's quota, or refuse with 429 (creates in
        flight and FnCalls running count)."""
        async with self._quota_lock:
            live = await self._live(project)
            if live + n > quota:
                more = f"; this needs {n} more" if n > 1 else ""
                raise ApiError(None, "quota_exceeded",
                               f"project {project!r} has {live} of {quota} sandboxes{more}; "
                               "destroy one or retry later", retryable=True, retry_after=5,
                               resources=("sandboxes",))
            self._pending[project] = self._pending.get(project, 0) + n

    async def _live(self, project: str, attempts: int = 5) -> int:
        """The project's sandboxes, a create in flight counted once (as pending; the sandboxes it has
        made so far, whose states may already say running, are left out of the states).  The states
        are read off the loop: if a create ended meanwhile the count may be off, so it is read
        again; after ``attempts`` such reads every state counts as well as every pending create
        (too many, never too few)."""
        for _ in range(attempts):
            ended = self._ended
            states = await asyncio.to_thread(self.owned_by, project)
            if self._ended == ended:
                flying = set().union(*self._flying.get(project, []))
                return len([st for st in states if st.id not in flying]) + self._pending.get(project, 0)
        return len(states) + self._pending.get(project, 0)

    async def create(self, resolved: Resolved, options: SandboxOptions, name: str) -> Sandbox:
        """A ready sandbox adopted when the pool of the ref ``name`` (as the caller wrote it) holds
        one of ``resolved`` (what the ref names now) and ``options`` fit; else a new one."""
        key = _ref_key(name) if resolved.kind != "checkpoint" else None
        pool = self.ready_pools.get(key) if key is not None else None
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

    def refuse_when_stopping(self) -> None:
        if self.stopping:
            raise ApiError(None, "stopping", "this edge is stopping; retry on another one", retryable=True)


def _ref_key(name: str) -> str | None:
    """The ref ``name`` names (``img/python`` and ``img/python:latest`` are one), None for a digest."""
    try:
        return ref_key(name)
    except BadName:
        return None


def _parse_object(raw: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(None, "bad_request", f"body is not JSON: {exc}") from None
    except RecursionError:
        raise ApiError(None, "bad_request", f"body nests deeper than {MAX_JSON_DEPTH} levels") from None
    if not isinstance(doc, dict):
        raise ApiError(None, "bad_request", "body must be a JSON object")
    if _json_depth(doc, MAX_JSON_DEPTH):
        raise ApiError(None, "bad_request", f"body nests deeper than {MAX_JSON_DEPTH} levels")
    return doc


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


async def while_caller_waits(request: web.Request, work: Awaitable[T]) -> T:
    """``work``'s result, or ConnectionResetError once the caller's connection closes, ``work``
    cancelled first (aiohttp does not cancel a handler whose client left: nobody would read the
    answer, and the work would hold its slot for its whole timeout)."""
    task = asyncio.ensure_future(work)
    try:
        while not (await asyncio.wait([task], timeout=CALLER_POLL))[0]:
            if request.transport is None or request.transport.is_closing():
                raise ConnectionResetError("the caller left")
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait([task])


def flag(request: web.Request, name: str) -> bool:
    """A query flag: absent, 0, 1, true or false (anything else is a 400 naming it)."""
    value = request.query.get(name)
    if value is None:
        return False
    if value not in ("0", "1", "true", "false"):
        raise invalid(name, f"{value[:20]!r} is not one of 0, 1, true, false")
    return value in ("1", "true")
