"""envd, E2B's in-sandbox daemon, answered by the edge for the sandbox a request names.

:func:`dispatch` takes every request that names a sandbox (:func:`~.base.target_of`): envd's
port goes to the routes below, any other port to the sandbox's port proxy.  envd's routes::

    GET  /health                      204 while the sandbox runs
    GET  /envs                        the sandbox's environment
    GET  /metrics                     CPU, memory and disk of the sandbox
    *    /files                       file transfer (sandbox.edge.e2b.files)
    POST /process.Process/<Method>    Connect RPC (sandbox.edge.e2b.process)
    POST /filesystem.Filesystem/<M>   Connect RPC (sandbox.edge.e2b.files)

The Connect services are ``connectrpc``'s server (E2B's generated service classes, in the
``e2b`` package) run through :mod:`sandbox.edge.asgi`.  Who may call is decided inside each
RPC (:meth:`EnvdCall.sandbox`), so that a refusal is a Connect error the SDK maps.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextvars
import functools
import math
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web
from connectrpc.code import Code
from connectrpc.errors import ConnectError

from sandbox.backends.base import account
from sandbox.core.errors import ApiError, InvalidField, SandboxError, UnsupportedOption
from sandbox.core.model import SandboxState
from sandbox.edge import asgi
from sandbox.edge.auth import Project
from sandbox.edge.e2b.base import DEFAULT_USER, ENVD_PORT, E2bContext, Target, error_response, gone
from sandbox.edge.errors import as_api_error
from sandbox.host.sandbox import Sandbox

T = TypeVar("T")
MAX_USER = 64
CPU_SAMPLE = 0.2  # seconds between the two CPU readings of a metrics answer

# status -> the Connect code the SDK maps to the same exception as the REST status
CODES = {400: Code.INVALID_ARGUMENT, 401: Code.UNAUTHENTICATED, 403: Code.PERMISSION_DENIED,
         404: Code.NOT_FOUND, 409: Code.FAILED_PRECONDITION, 413: Code.RESOURCE_EXHAUSTED,
         429: Code.RESOURCE_EXHAUSTED, 501: Code.UNIMPLEMENTED, 502: Code.UNAVAILABLE, 503: Code.UNAVAILABLE,
         504: Code.DEADLINE_EXCEEDED}


class EnvdCall:
    """One in-sandbox request: who sent it, for which sandbox, as which user (``Authorization:
    Basic <user:>``, envd's; :func:`run_as` decides for none)."""

    def __init__(self, e2b: E2bContext, request: web.Request, target: Target) -> None:
        self.e2b = e2b
        self.request = request
        self.target = target
        self._found: tuple[Project, Sandbox, SandboxState] | None = None

    async def sandbox(self) -> tuple[Project, Sandbox, SandboxState]:
        if self._found is None:
            self._found = await self.e2b.envd_sandbox(self.request, self.target)
        return self._found

    @functools.cached_property
    def user(self) -> str | None:
        """The account the caller named, None when it named none (E2B's default user then)."""
        scheme, _, value = self.request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "basic":
            return None
        try:
            name = base64.b64decode(value.strip(), validate=True).decode().partition(":")[0]
        except (binascii.Error, ValueError):
            raise InvalidField("Authorization", "Basic credentials are not base64 of 'user:'") from None
        return check_user("Authorization", name) if name else None

    def present(self) -> bool:
        transport = self.request.transport
        return transport is not None and not transport.is_closing()


def check_user(field: str, name: str) -> str:
    """An account name as envd takes it (``user:`` in Basic credentials, ``username`` of /files)."""
    if len(name) > MAX_USER or not name or not all(c.isalnum() or c in "._-" for c in name):
        raise InvalidField(field, f"{name[:MAX_USER]!r} is not a user name")
    return name


async def run_as(box: Sandbox, named: str | None) -> str | None:
    """The account a command or file operation runs as: the one named; else E2B's ``user`` when
    the sandbox has that account, else the sandbox's own user (None: an image without ``user``,
    such as most OCI images, works as it would natively; docs/E2B.md "Users").  Whether it has
    ``user`` is looked up once per sandbox, at its first call that names no account."""
    if named is not None:
        return named
    has = _HAS_DEFAULT_USER.get(box.id)
    if has is None:
        try:
            await asyncio.to_thread(account, box.files, DEFAULT_USER)
            has = True
        except UnsupportedOption:
            has = False
        if len(_HAS_DEFAULT_USER) >= _MAX_REMEMBERED:
            _HAS_DEFAULT_USER.clear()  # ids of sandboxes long gone; a lookup each costs a millisecond
        _HAS_DEFAULT_USER[box.id] = has
    return DEFAULT_USER if has else None


_HAS_DEFAULT_USER: dict[str, bool] = {}  # sandbox id -> whether it has E2B's account (ids are never reused)
_MAX_REMEMBERED = 65536


CALL: contextvars.ContextVar[EnvdCall] = contextvars.ContextVar("envd_call")


def current() -> EnvdCall:
    return CALL.get()


def connect_error(exc: BaseException) -> ConnectError:
    """``exc`` as a Connect error: the status the native API would answer, as its Connect code."""
    if isinstance(exc, ConnectError):
        return exc
    err = as_api_error(exc)
    return ConnectError(CODES.get(err.status, Code.INTERNAL), f"{err.code}: {err.message}")


def rpc(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """A unary method whose errors answer as Connect errors (never an unmapped 500)."""
    @functools.wraps(fn)
    async def wrapped(*args: Any) -> T:
        try:
            return await fn(*args)
        except ConnectError:
            raise
        except Exception as exc:
            raise connect_error(exc) from exc
    return wrapped


def rpc_stream(fn: Callable[..., AsyncIterator[T]]) -> Callable[..., AsyncIterator[T]]:
    """A streaming method whose errors end the stream as Connect errors."""
    @functools.wraps(fn)
    async def wrapped(*args: Any) -> AsyncIterator[T]:
        try:
            async for item in fn(*args):
                yield item
        except ConnectError:
            raise
        except Exception as exc:
            raise connect_error(exc) from exc
    return wrapped


class Envd:
    """The envd routes of every sandbox on one edge."""

    def __init__(self, e2b: E2bContext, services: dict[str, asgi.AsgiApp], files: Any,
                 forward: Callable[[web.Request, Target], Awaitable[web.StreamResponse]]) -> None:
        self.e2b = e2b
        self.services = services  # path prefix ("/process.Process/") -> its Connect application
        self.files = files
        self.forward = forward

    async def dispatch(self, request: web.Request, target: Target) -> web.StreamResponse:
        if target.port != ENVD_PORT:
            return await self.forward(request, target)
        call = EnvdCall(self.e2b, request, target)
        token = CALL.set(call)
        try:
            for prefix, app in self.services.items():
                if request.path.startswith(prefix):
                    return await asgi.serve(app, request)
            return await self._http(request, call)
        finally:
            CALL.reset(token)

    async def _http(self, request: web.Request, call: EnvdCall) -> web.StreamResponse:
        try:
            path, method = request.path, request.method
            if path == "/files" and method in ("GET", "HEAD", "POST"):
                return await self.files.http(request, call)
            if method != "GET" or path not in ("/health", "/envs", "/metrics"):
                raise ApiError(404, "not_found", f"{method} {path[:80]}: envd has no such route")
            _, box, state = await call.sandbox()
            if path == "/health":
                if state.status != "running":
                    raise ApiError(502, "unavailable", f"sandbox {box.id} is {state.status}")
                return web.Response(status=204)
            if path == "/envs":
                return web.json_response(dict(state.env))
            (sampled,) = await metrics([box])
            if sampled is None:
                raise gone(box.id)
            return web.json_response(sampled)
        except Exception as exc:
            return error_response(exc)


async def metrics(boxes: list[Sandbox]) -> list[dict[str, Any] | None]:
    """envd's ``/metrics`` (and the REST metrics' one sample) of each of ``boxes`` (None for one
    that went meanwhile): CPU as a rate, the cgroup's CPU time over CPU_SAMPLE s (two readings) per
    CPU the sandbox may use (E2B's percentage of its vCPUs; a VM's is its VMM's); memory and disk
    from :meth:`Sandbox.usage` (a VM's memory as its guest sees it; disk total is the disk limit,
    or without one what the data dir's file system leaves it: its use plus the free space).  The
    interval is waited on the loop, and each reading is one hop for every sandbox: a request
    naming many holds no thread while it waits."""
    before = await asyncio.to_thread(lambda: [_cpu_reading(b) for b in boxes])
    await asyncio.sleep(CPU_SAMPLE)
    return await asyncio.to_thread(lambda: [_sample(b, r) for b, r in zip(boxes, before, strict=True)])


def _cpu_reading(box: Sandbox) -> tuple[SandboxState, float | None, float] | None:
    try:
        st = box.state
    except (SandboxError, OSError):  # gone meanwhile
        return None
    return st, box.manager.layout.cpu_seconds(st.cgroups_path), time.monotonic()


def _sample(box: Sandbox, first: tuple[SandboxState, float | None, float] | None) -> dict[str, Any] | None:
    if first is None:
        return None
    st, before, t0 = first
    try:
        after, t1 = box.manager.layout.cpu_seconds(st.cgroups_path), time.monotonic()
        usage = box.usage()
    except (SandboxError, OSError):  # gone meanwhile
        return None
    cpus = max(1, math.ceil(st.options.cpu))
    # at most all its CPUs: the two clocks are read a little apart, so a busy sandbox can read a hair over
    pct = 0.0 if before is None or after is None else min(100.0, max(0.0, (after - before) / (t1 - t0) / cpus * 100))
    memory, disk = usage.get("memory") or {}, usage.get("disk") or {}
    guest = memory.get("guest") or {}
    mem_total = int(guest.get("total") or memory.get("limit") or 0)
    mem_used = int((guest.get("used") if guest else memory.get("current")) or 0)
    disk_used = int(disk.get("used") or 0)
    disk_total = int(disk.get("limit") or 0) or disk_used + shutil.disk_usage(box.manager.data_dir).free
    return {"ts": int(time.time()), "cpu_count": cpus, "cpu_used_pct": round(pct, 2),
            "mem_total": mem_total, "mem_used": mem_used, "mem_cache": 0,
            "disk_used": disk_used, "disk_total": disk_total}
