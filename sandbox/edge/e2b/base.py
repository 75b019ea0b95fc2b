"""What both E2B surfaces stand on: who calls, which sandbox a request is for, E2B's error body.

**Callers.**  The control plane takes ``X-API-Key: <project token>`` (the native API's tokens:
one registry of projects).  envd requests carry no API key in the SDK, so every sandbox gets an
envd access token in its create and connect answers (``envdAccessToken``; the SDK then sends it
as ``X-Access-Token`` on every in-sandbox call, ``secure`` or not): an HMAC of the sandbox id
under the edge's secret, so it opens that sandbox only, needs no storage, and a restarted edge
with the same secret honours it.  A project token in ``X-API-Key`` also opens its own
sandboxes' envd.  ``trafficAccessToken`` is the same for the port proxy.  An in-sandbox request
for a sandbox that is gone, or not the caller's, answers as E2B's proxy does (:func:`gone`).

**Which sandbox.**  ``E2b-Sandbox-Id`` and ``E2b-Sandbox-Port`` headers (``E2B_SANDBOX_URL``),
or, with ``--e2b-domain D``, a host name ``<port>-<id>.D`` (``E2B_DOMAIN=D`` behind a TLS
proxy).  The id's grammar is checked before it is used for anything; another project's
sandbox answers 404 as a missing one does.

**Errors** are E2B's body, ``{"code": <status>, "message": ...}``, with the statuses the SDK
maps to its exceptions (400 InvalidArgument, 401/403 Authentication, 404 NotFound, 429
RateLimit); the message keeps the native error's code and field.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import math
import re
import time
from dataclasses import dataclass

from aiohttp import web

from sandbox.core.errors import ApiError, InvalidField
from sandbox.core.model import SandboxState, check_sandbox_id
from sandbox.edge.auth import Project
from sandbox.edge.context import EdgeContext
from sandbox.edge.errors import as_api_error
from sandbox.host.sandbox import Sandbox

ENVD_PORT = 49983
# what the SDK's feature gates see (e2b/envd/versions.py): stdin (0.3.0), the default user
# (0.4.0), close stdin (0.5.2), octet-stream uploads (0.5.7), metrics (0.2.4), file metadata (0.6.2),
# entry info in watch events (0.6.3), network mounts (0.6.4: accepted; lookups never leave the root mount)
ENVD_VERSION = "0.6.4"
DEFAULT_USER = "user"  # E2B templates run commands as this account unless told root
# on a sandbox created with autoResume: the timeout (seconds) each resume on traffic gives it
AUTO_RESUME_LABEL = "layerbox.e2b.auto-resume"
AUTO_RESUME_MIN = 300  # E2B's: a sandbox resumed by traffic gets at least five minutes
HOST_LABEL = re.compile(r"(?P<port>[0-9]{1,5})-(?P<id>[^.]{1,64})")
MAX_DOMAIN = 253
E2B_CLIENT_HEADERS = ("X-API-Key", "E2b-Sandbox-Id", "E2b-Sandbox-Port", "X-Access-Token",
                      "E2b-Traffic-Access-Token")


@dataclass(frozen=True)
class Target:
    """An in-sandbox request: the sandbox and the port inside it."""

    sid: str
    port: int


def target_of(request: web.Request, domain: str | None) -> Target | None:
    """The sandbox and port an in-sandbox request names, None for any other request; a malformed
    id or port is 400 before anything looks it up."""
    sid, port = request.headers.get("E2b-Sandbox-Id"), request.headers.get("E2b-Sandbox-Port")
    id_field, port_field = "E2b-Sandbox-Id", "E2b-Sandbox-Port"
    if sid is None and port is None and domain:
        host = request.headers.get("Host", "").rpartition(":")[0] or request.headers.get("Host", "")
        label, dot, rest = host.lower().partition(".")
        if dot and rest == domain and (m := HOST_LABEL.fullmatch(label)):
            sid, port = m["id"], m["port"]
            id_field = port_field = "Host"  # a 400 names what the caller sent
    if sid is None and port is None:
        return None
    if sid is None:
        raise InvalidField("E2b-Sandbox-Id", "header is required with E2b-Sandbox-Port")
    check_sandbox_id(sid, id_field)
    if port is None:
        port = str(ENVD_PORT)
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise InvalidField(port_field, f"{port[:20]!r} is not a port (1-65535)")
    return Target(sid, int(port))


def from_e2b_client(request: web.Request) -> bool:
    """Whether a request carries what only E2B's SDK sends (its API key, a sandbox's headers or
    tokens): its errors then answer in E2B's shape, even before a route is matched (an id with a
    bad grammar in E2b-Sandbox-Id, a route this edge does not serve)."""
    return any(name in request.headers for name in E2B_CLIENT_HEADERS)


def check_domain(domain: str) -> str:
    """``--e2b-domain``: a DNS name the sandboxes' host names end in."""
    labels = domain.lower().split(".")
    if len(domain) > MAX_DOMAIN or len(labels) < 2 or not all(
            re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?", label) for label in labels):
        raise ValueError(f"{domain!r} is not a domain name like sandboxes.example.com")
    return domain.lower()


def error_response(exc: BaseException) -> web.Response:
    """E2B's error body for ``exc`` (its status, and the native code and field in the message)."""
    err = as_api_error(exc)
    message = err.message if err.code in err.message else f"{err.code}: {err.message}"
    return web.json_response({"code": err.status, "message": message}, status=err.status, headers=err.headers())


def sandbox_id_of(raw: str, project: str) -> str:
    """A path's ``sandboxID``, its grammar checked before any use; one that cannot be an id names
    no sandbox, so it is E2B's 404 naming the field (the SDK's ``kill`` of an unknown id then
    returns False, as against E2B), the answer for an id nobody holds, never a lookup."""
    try:
        return check_sandbox_id(raw, "sandboxID")
    except InvalidField:
        raise ApiError(None, "sandbox_not_found", f"sandboxID: {raw[:80]!r} names no sandbox of project "
                                                  f"{project!r} (ids look like lb-0123456789ab)") from None


MAX_REMEMBERED = 65536  # envd tokens Keys keeps (more than an edge holds sandboxes)


class Keys:
    """The per-sandbox tokens envd and the port proxy take (see the module's docstring)."""

    def __init__(self, secret: bytes) -> None:
        self._key = hashlib.blake2b(secret, person=b"layerbox-e2b", digest_size=32).digest()
        self._access: dict[str, bytes] = {}  # sid -> its envd token, for the signed-URL search

    def _token(self, kind: bytes, sid: str) -> str:
        mac = hmac.new(self._key, kind + b"\0" + sid.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()

    def access_token(self, sid: str) -> str:
        return self._token(b"envd", sid)

    def access_token_bytes(self, sid: str) -> bytes:
        """:meth:`access_token` encoded, remembered: the signed-URL search asks it of every sandbox
        (a token depends on the id alone, so a remembered one never goes stale; the memory is
        dropped whole past ``MAX_REMEMBERED`` ids, ~100 bytes each)."""
        token = self._access.get(sid)
        if token is None:
            if len(self._access) >= MAX_REMEMBERED:
                self._access.clear()
            token = self._access[sid] = self.access_token(sid).encode()
        return token

    def traffic_token(self, sid: str) -> str:
        return self._token(b"traffic", sid)

    def opens(self, token: str, sid: str, *, traffic: bool = False) -> bool:
        want = self.traffic_token(sid) if traffic else self.access_token(sid)
        return hmac.compare_digest(token.encode(), want.encode())


class E2bContext:
    """The edge's context seen from the E2B surfaces: its callers and its sandboxes."""

    def __init__(self, ctx: EdgeContext, secret: bytes, domain: str | None = None) -> None:
        self.ctx = ctx
        self.keys = Keys(secret)
        self.domain = domain
        self._waking: dict[str, asyncio.Future[SandboxState]] = {}

    def project(self, request: web.Request) -> Project:
        """The project of ``X-API-Key`` (the SDK's), or of a native bearer token."""
        key = request.headers.get("X-API-Key")
        if key is None:
            return self.ctx.project(request)
        return self.ctx.auth.project_of(key.strip())

    async def sandbox(self, request: web.Request, project: Project, sid: str) -> tuple[Sandbox, SandboxState]:
        return await self.ctx.sandbox_of(sandbox_id_of(sid, project.name), project)

    async def envd_sandbox(self, request: web.Request, target: Target) -> tuple[Project, Sandbox, SandboxState]:
        """The sandbox an in-sandbox request is for, if its ``X-Access-Token`` (or a project's
        ``X-API-Key``) opens it: 401 without either, 404 for a token of another sandbox."""
        bearer = request.headers.get("Authorization", "").lower().startswith("bearer ")
        vouched = self.ctx.auth.has_caller(request)  # a gateway checked the caller's key
        if "X-API-Key" in request.headers or bearer or vouched:  # (envd's own Authorization is Basic: the user)
            project = self.project(request)
        else:
            token = request.headers.get("X-Access-Token")
            if token is None:
                raise ApiError(None, "unauthenticated", "missing X-Access-Token (the envdAccessToken of the "
                                                        "sandbox's create or connect answer) or X-API-Key")
            if not self.keys.opens(token.strip(), target.sid):
                raise gone(target.sid)
            return await self.for_owner(target.sid)
        box, state = await self._found(target.sid, project)
        return project, box, await self.awake(box, state)

    async def for_owner(self, sid: str) -> tuple[Project, Sandbox, SandboxState]:
        """The sandbox ``sid`` as its own project sees it: for a caller the edge has already let in
        for that sandbox alone (its envd token, a URL signed with it)."""
        found = await asyncio.to_thread(self.ctx.look_up, sid)  # one hop: this is every envd call's path
        if found is None:
            raise gone(sid)
        box, state = found
        project = self.ctx.auth.project_named(state.project or "")
        return project, box, await self.awake(box, state)

    async def awake(self, box: Sandbox, state: SandboxState) -> SandboxState:
        """``state``, or, for a sandbox paused in place that was created with ``autoResume``, its
        state once the traffic that reached it has resumed it (E2B's auto-resume: the timeout
        of its label from now).  Requests racing to wake it share one resume."""
        label = state.options.labels.get(AUTO_RESUME_LABEL)
        if state.status != "paused" or label is None:
            return state
        seconds = int(label) if label.isascii() and label.isdigit() else AUTO_RESUME_MIN
        waking = self._waking.get(box.id)
        if waking is None:
            waking = asyncio.ensure_future(asyncio.to_thread(self._auto_resume, box, seconds))
            self._waking[box.id] = waking
            waking.add_done_callback(lambda _: self._waking.pop(box.id, None))
        return await asyncio.shield(waking)

    def _auto_resume(self, box: Sandbox, seconds: int) -> SandboxState:
        state = box.state  # again: a resume or kill may have come first
        return self.wake(box, state, seconds) if state.status == "paused" else state

    def wake(self, box: Sandbox, state: SandboxState, seconds: int) -> SandboxState:
        """Resume ``box`` with its timeout ``seconds`` from now (within its maximum lifetime);
        its state after (blocking)."""
        box.resume(ttl=min(seconds, self.left(state)), max_lifetime=self.ctx.maxima.ttl)
        return box.state

    def left(self, state: SandboxState) -> int:
        """Whole seconds from now to the edge's maximum lifetime of ``state``'s sandbox, one short
        (the clock moves on before set_ttl reads it: the sum must stay within the maximum)."""
        return max(0, math.floor(state.created + self.ctx.maxima.ttl - time.time()) - 1)

    async def _found(self, sid: str, project: Project) -> tuple[Sandbox, SandboxState]:
        try:
            return await self.ctx.sandbox_of(sid, project)
        except ApiError as exc:
            if exc.code == "sandbox_not_found":
                raise gone(sid) from None
            raise


def gone(sid: str) -> ApiError:
    """What an in-sandbox request for a sandbox that is not there (or not the caller's) answers:
    E2B's proxy's 502 "... was not found", which the SDK reads as a sandbox no longer running
    (``is_running()`` is False, a command raises SandboxNotRunningException)."""
    return ApiError(502, "sandbox_not_found", f"The sandbox {sid} was not found")
