"""The E2B surfaces on one edge app: :func:`setup` adds the control plane's routes and returns
the :class:`E2bRoutes` whose :meth:`~E2bRoutes.dispatch` the service's middleware hands every
request that names a sandbox (headers or host name), before aiohttp's router sees it."""

from __future__ import annotations

import re

from aiohttp import web

from sandbox.edge.asgi import AsgiApp
from sandbox.edge.context import EdgeContext
from sandbox.edge.e2b import rest
from sandbox.edge.e2b.base import ENVD_PORT, E2bContext, Target, gone, target_of
from sandbox.edge.e2b.envd import Envd
from sandbox.edge.e2b.files import Files
from sandbox.edge.e2b.process import ProcessService
from sandbox.edge.routes.commands import Commands
from sandbox.edge.routes.ports import PortProxy

CLAIMED_LABEL = re.compile(r"[0-9]{1,5}-")  # a host label naming a sandbox's port, its id not yet checked
# what only the edge reads: never relayed to a sandbox's server
E2B_HEADERS = frozenset({"e2b-sandbox-id", "e2b-sandbox-port", "x-access-token", "x-api-key",
                         "e2b-traffic-access-token"})


class E2bRoutes:
    def __init__(self, e2b: E2bContext, commands: Commands, proxy: PortProxy) -> None:
        self.e2b = e2b
        self.proxy = proxy
        self.files = Files(e2b)
        services: dict[str, AsgiApp] = {"/process.Process/": ProcessService(e2b.ctx, commands).application(),
                                        "/filesystem.Filesystem/": self.files.service.application()}
        self.envd = Envd(e2b, services, files=self.files, forward=self.forward)

    def target(self, request: web.Request) -> Target | None:
        return target_of(request, self.e2b.domain)

    def claims(self, request: web.Request) -> bool:
        """Whether ``request`` is meant for a sandbox (E2B's headers, or a ``<port>-...`` host name
        in the E2B domain), well formed or not: its errors then answer in E2B's shape.  (Another
        name in the domain, such as ``api.<domain>``, is the edge's own API.)"""
        if "E2b-Sandbox-Id" in request.headers or "E2b-Sandbox-Port" in request.headers:
            return True
        label, _, rest = request.headers.get("Host", "").lower().partition(":")[0].partition(".")
        return bool(self.e2b.domain) and rest == self.e2b.domain and CLAIMED_LABEL.match(label) is not None

    async def dispatch(self, request: web.Request, target: Target) -> web.StreamResponse:
        return await self.envd.dispatch(request, target)

    async def signed_files(self, request: web.Request) -> web.StreamResponse:
        """``/files`` naming no sandbox: a signed URL, for the sandbox whose token signed it."""
        return await self.dispatch(request, Target(await self.files.signer(request), ENVD_PORT))

    async def forward(self, request: web.Request, target: Target) -> web.StreamResponse:
        """Another port than envd's: the sandbox's port proxy, for a caller holding the sandbox's
        traffic or envd token, or its project's key."""
        token = request.headers.get("e2b-traffic-access-token")
        if token is not None:
            if not self.e2b.keys.opens(token.strip(), target.sid, traffic=True):
                raise gone(target.sid)
            _, box, state = await self.e2b.for_owner(target.sid)
        else:
            _, box, state = await self.e2b.envd_sandbox(request, target)
        return await self.proxy.forward(request, box, state, target.port, request.rel_url.raw_path_qs,
                                        keep_authorization=True, drop=E2B_HEADERS)


def setup(ctx: EdgeContext, app: web.Application, *, secret: bytes, domain: str | None, commands: Commands,
          proxy: PortProxy) -> E2bRoutes:
    e2b = E2bContext(ctx, secret, domain)
    rest.setup(e2b, app)
    routes = E2bRoutes(e2b, commands, proxy)
    app.router.add_get("/files", routes.signed_files, name="e2b:signed-download")
    app.router.add_post("/files", routes.signed_files, name="e2b:signed-upload")
    return routes
