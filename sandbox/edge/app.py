"""The sandbox edge service: the HTTP API of one host's :class:`SandboxManager`.

Every request carries ``Authorization: Bearer <token>``; a token belongs to one project, and a
project reaches only its own sandboxes, checkpoints and runs (sandbox.edge.context,
docs/SECURITY.md "Tenancy").  Errors are ``{"error": {"code", "message", "retryable"[, "field"]}}``
(sandbox.edge.errors).  The routes live in :mod:`sandbox.edge.routes`, one module per concern,
each standing on the service's :class:`~sandbox.edge.context.EdgeContext`; this module is the
only one that imports them.  The service binds 127.0.0.1 only; put a TLS proxy in front of it
for anything remote.

Runs as ``python -m sandbox.edge --data-dir D --store URL --tokens FILE``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import functools
import ipaddress
import logging
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path

from aiohttp import web

from layerstore.objects import ref_key
from sandbox.core.errors import ApiError
from sandbox.core.model import ISOLATIONS, Maxima
from sandbox.core.paths import edge_key
from sandbox.edge.auth import CALLER, AuthConfig, Project
from sandbox.edge.caps import ProjectCaps
from sandbox.edge.context import MAX_BODY, SHUTDOWN_GRACE, EdgeContext
from sandbox.edge.e2b import routes as e2b_routes
from sandbox.edge.e2b.base import check_domain, from_e2b_client
from sandbox.edge.e2b.base import error_response as e2b_error
from sandbox.edge.errors import as_api_error
from sandbox.edge.link import FleetLink
from sandbox.edge.metrics import Metrics
from sandbox.edge.routes import (
    calls,
    commands,
    execs,
    files,
    jobs,
    lifecycle,
    meta,
    ports,
    sandboxes,
)
from sandbox.edge.routes.commands import CommandLimits
from sandbox.edge.trust import EDGE_ID, GATEWAY_HEADER, GatewayTrust
from sandbox.host.admission import Admission, AdmissionConfig, parse_size
from sandbox.host.manager import SandboxManager
from sandbox.pools.fncall import WarmPool

log = logging.getLogger("layerbox.sandbox.service")

DEFAULT_LEASE_TTL = 600.0
# seconds a connection may take to send a request's headers (and stay idle between requests):
# aiohttp closes a connection whose request never completes at its keep-alive deadline
HEADER_TIMEOUT = 15.0
REAP_INTERVAL = 5.0
DUE_SLACK = 0.02  # seconds past a deadline the reaper wakes (a TTL ends strictly after it)
READY_WARM_UP = ("/bin/true",)  # run once in each ready sandbox (WarmPool's warm): not found is fine too

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

__all__ = ["SHUTDOWN_GRACE", "AuthConfig", "Project", "SandboxService", "main"]


class SandboxService:
    """One edge: its context, the app that serves it (:meth:`app`), and its background work (the
    reaper, ready pools).

    ``shutdown_manager``: when the app stops (SIGTERM), destroy every sandbox, unmount every
    layer and stop the host's lazyfetch daemon; a crash (SIGKILL) instead leaves them for the
    next start's reconcile.  ``ready``: ref -> how many sandboxes of it to keep started ahead of
    need (a create of that image with options a ready sandbox can take is an adopt, not a start).
    """

    def __init__(self, manager: SandboxManager, auth: AuthConfig, admission: Admission | None = None, *,
                 lease_ttl: float = DEFAULT_LEASE_TTL, reap_interval: float = REAP_INTERVAL,
                 fncall_pool: int = 2, maxima: Maxima | None = None, shutdown_manager: bool = False,
                 url_secret: bytes | None = None, command_limits: CommandLimits | None = None,
                 ready: Mapping[str, int] | None = None, isolations: Sequence[str] = ISOLATIONS,
                 caps: ProjectCaps | None = None, e2b_domain: str | None = None) -> None:
        maxima = maxima or Maxima()
        self.manager = manager
        self.context = EdgeContext(
            manager, auth, admission or Admission(AdmissionConfig(), disk_path=manager.data_dir, boxes=manager.boxes),
            maxima, lease_ttl=min(lease_ttl, maxima.lease_ttl), isolations=isolations, metrics=Metrics(), caps=caps)
        self.ready = dict(ready or {})
        # signs port URLs (sandbox.edge.routes.ports); unless given, a random key per start (URLs die with it)
        self.url_secret = url_secret or secrets.token_bytes(32)
        # E2B's per-sandbox tokens must outlive a restart as the sandboxes do: the operator's secret, or the
        # edge's own key in its data dir
        self.e2b_secret = url_secret or edge_key(manager.paths.root)
        self.reap_interval = reap_interval
        self.fncall_pool = fncall_pool
        self.shutdown_manager = shutdown_manager
        self.command_limits = command_limits  # background commands and terminals (sandbox.edge.routes.commands)
        self.e2b_domain = e2b_domain  # <port>-<id>.<domain> host names name a sandbox (sandbox.edge.e2b)
        self.e2b: e2b_routes.E2bRoutes | None = None
        self._reaper: asyncio.Task[None] | None = None
        # the reaper's own thread: TTLs, leases and a dead daemon are handled whatever tenants run
        self._reaper_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="reaper")
        self._warm: asyncio.Task[object] | None = None
        self.link: FleetLink | None = None  # an edge of a fleet: its heartbeats (join_fleet)
        self._beating: asyncio.Task[None] | None = None

    def join_fleet(self, *, edge_id: str, pool: str, url: str, gateways: Sequence[str]) -> FleetLink:
        """Serve a fleet: gateways vouch for every request (``auth.trust``, set already) and this
        edge heartbeats to them while it runs."""
        assert self.context.auth.trust is not None, "an edge of a fleet checks its gateways' signatures"
        self.link = FleetLink(self.context, self.context.auth.trust, edge_id=edge_id, pool=pool, url=url,
                              gateways=gateways)
        return self.link

    def app(self) -> web.Application:
        ctx = self.context
        app = web.Application(middlewares=[self._middleware], client_max_size=MAX_BODY)
        app.on_startup.append(self._start_background)
        app.on_shutdown.append(self._interrupt_streams)
        app.on_cleanup.append(self._stop_background)
        meta.setup(ctx, app)
        sandboxes.setup(ctx, app)
        execs.setup(ctx, app)
        files.setup(ctx, app)
        jobs.setup(ctx, app)
        calls.setup(ctx, app, pool_size=self.fncall_pool)
        lifecycle.setup(ctx, app)
        proxy = ports.setup(ctx, app, self.url_secret)
        background = commands.setup(ctx, app, self.command_limits)
        self.e2b = e2b_routes.setup(ctx, app, secret=self.e2b_secret, domain=self.e2b_domain,
                                    commands=background.commands, proxy=proxy)
        return app

    # -- background work ---------------------------------------------------------------------------
    async def _start_background(self, app: web.Application) -> None:
        self._reaper = asyncio.create_task(self._reap_forever())
        if self.link is not None:
            self._beating = asyncio.create_task(self.link.run())
        for ref, size in self.ready.items():
            pool = WarmPool(self.manager, ref, size=size, warm=READY_WARM_UP)
            self.context.ready_pools[ref_key(ref)] = pool
            pool.fill()
        if self.manager.store_url:
            # the first create should not pay for the lazyfetch daemon's start-up
            self._warm = asyncio.create_task(asyncio.to_thread(self.manager.host.start_daemon))

    async def _interrupt_streams(self, app: web.Application) -> None:
        """On stop, before the server waits for the requests in flight: every streaming command is
        killed now and its caller gets its exit event (``interrupted: "shutdown"``, also in the
        receipt), rather than the stop waiting out the server's grace time for a long command."""
        self.context.stopping = True
        for cancel in list(self.context.streams):
            cancel.cancel("shutdown")

    async def _stop_background(self, app: web.Application) -> None:
        ctx = self.context
        try:
            if self.link is not None and self._beating is not None:
                await self.link.stop(self._beating)
            if self._warm is not None:
                with contextlib.suppress(Exception):
                    await self._warm
            if self._reaper is not None:
                self._reaper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._reaper
            for pool in ctx.ready_pools.values():
                try:
                    await pool.close()
                except Exception:
                    log.exception("closing the ready pool of %s", pool.ref)
            if ctx.fncalls is not None:
                await ctx.fncalls.close()
        finally:  # a pool that failed to close must not leave every other sandbox and mount behind
            await ctx.close_files()
            self._reaper_pool.shutdown(wait=False)
            if self.shutdown_manager:
                await asyncio.to_thread(self.manager.close)

    async def _reap_forever(self) -> None:
        """Destroy sandboxes past their TTL or lease, pause idle ones; a failure waits for the next round.

        A full round every ``reap_interval``; between them, the sandboxes whose deadline comes
        first (``manager.deadlines``) as it comes, so a TTL ends within a fraction of a second."""
        loop = asyncio.get_running_loop()
        deadlines = self.manager.deadlines
        deadlines.horizon = 2 * self.reap_interval
        sooner = asyncio.Event()

        def wake() -> None:  # (any thread: a state written by a request's worker)
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nothing to wake
                loop.call_soon_threadsafe(sooner.set)

        deadlines.on_sooner = wake
        full_at = time.monotonic() + self.reap_interval
        try:
            while True:
                sooner.clear()  # (before the look: a deadline noted after it wakes the wait below)
                soonest = deadlines.soonest()
                wait = full_at - time.monotonic()
                if soonest is not None:
                    wait = min(wait, soonest - time.time() + DUE_SLACK)
                if wait > 0:
                    try:
                        await asyncio.wait_for(sooner.wait(), wait)
                        continue  # a sooner deadline: wait again, until it
                    except TimeoutError:
                        pass
                full = time.monotonic() >= full_at
                await self._reap_round(loop, full=full)
                if full:
                    full_at = time.monotonic() + self.reap_interval
        finally:
            deadlines.on_sooner = None

    async def _reap_round(self, loop: asyncio.AbstractEventLoop, *, full: bool) -> None:
        try:
            if full:  # a dead lazyfetch daemon: restart its sandboxes
                await loop.run_in_executor(self._reaper_pool, self.manager.heal)
            due = None if full else self.manager.deadlines.due(time.time())
            if due == []:
                return
            report = await loop.run_in_executor(self._reaper_pool, functools.partial(
                self.manager.reap, max_lifetime=self.context.maxima.ttl, only=due))
            if report["destroyed"] or report["paused"]:
                log.info("reaper: %s", report)
            for action, ids in report.items():
                self.context.metrics.reaped.labels(action).inc(len(ids))
        except Exception:
            log.exception("reaper round failed")

    # -- every request ---------------------------------------------------------------------------------
    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "?"
        e2b = (request.match_info.route.name or "").startswith("e2b:") or from_e2b_client(request) or (
            self.e2b is not None and self.e2b.claims(request))  # (a malformed sandbox id too)
        try:
            trust = self.context.auth.trust
            if trust is not None:  # an edge of a fleet: only its gateways reach it, and each says for whom
                request[CALLER] = trust.verify(request.headers.get(GATEWAY_HEADER), request.method, request.raw_path)
            target = self.e2b.target(request) if self.e2b is not None else None
            if target is not None and self.e2b is not None:  # a sandbox's envd or port: not the router's match
                route, e2b = "e2b:sandbox", True
                resp = await self.e2b.dispatch(request, target)
            else:
                resp = await handler(request)
        except web.HTTPRequestEntityTooLarge:
            resp = self._error_response(ApiError(413, "body_too_large", (
                f"request body over {MAX_BODY} bytes; send files through /files and big input as exec stdin "
                "or a command's stdin stream")), e2b=e2b)
        except web.HTTPException as exc:  # aiohttp's own 404/405 for unknown routes
            resp = self._error_response(ApiError(exc.status, "http", exc.reason), e2b=e2b)
        except Exception as exc:
            err = as_api_error(exc)
            if err.status == 500:  # the edge's own failure; 502-504 answer what a sandbox or the host is doing
                log.exception("%s %s failed", request.method, request.path)
            resp = self._error_response(err, e2b=e2b)
        self.context.metrics.requests.labels(route, str(resp.status)).inc()
        return resp

    def _error_response(self, err: ApiError, *, e2b: bool = False) -> web.Response:
        self.context.metrics.errors.labels(err.code).inc()
        if e2b:
            return e2b_error(err)
        return web.json_response(err.body(), status=err.status, headers=err.headers())


# -- entry point --------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sandbox.edge", description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--store", required=True, help="store URL (file://... or s3://...)")
    parser.add_argument("--port", type=int, default=8470)
    parser.add_argument("--tokens", help="JSON file: projects, their tokens and quotas (required unless "
                        "--fleet-gateway: a fleet's gateways check tokens)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on; other than loopback only with --fleet-gateway (default %(default)s)")
    fleet = parser.add_argument_group("fleet", "serve gateways (layerbox gateway; docs/FLEET.md)")
    fleet.add_argument("--fleet-gateway", action="append", default=[], metavar="URL",
                       help="a gateway to register and heartbeat with (repeatable: the next when one fails)")
    fleet.add_argument("--fleet-key-file", type=Path, help="this edge's key (layerbox fleet edge-key ID prints it)")
    fleet.add_argument("--pool", default="default", help="the pool this edge serves (default %(default)s)")
    fleet.add_argument("--advertise", metavar="URL", help="where gateways reach this edge (default "
                       "http://HOST:PORT)")
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
    parser.add_argument("--reap-interval", type=_seconds, default=REAP_INTERVAL, metavar="SECONDS",
                        help="how often the reaper destroys sandboxes past their TTL or lease and pauses "
                        "idle ones, more than 0 (default %(default)s)")
    parser.add_argument("--isolation", action="append", choices=ISOLATIONS, default=[],
                        help="what this edge runs (repeatable; default every kind its host can run)")
    parser.add_argument("--ready", action="append", default=[], metavar="IMAGE=N",
                        help="keep N sandboxes of IMAGE (a ref) started ahead of need; a create of it with "
                        "default disk, network, userns and cpu_class adopts one (repeatable)")
    caps = ProjectCaps()
    for kind, what in (("commands", "commands running (exec streams, FnCalls, background commands, terminals)"),
                       ("transfers", "file uploads and downloads"),
                       ("connections", "proxied port connections and command sockets")):
        parser.add_argument(f"--max-{kind}-per-project", type=int, default=getattr(caps, kind), metavar="N",
                            help=f"{what} one project may have at once (default %(default)s)")
    parser.add_argument("--url-secret-file", type=Path, help="at least 32 bytes that sign port URLs, the same "
                        "on every edge that should honour them (default: random per start)")
    parser.add_argument("--e2b-domain", type=_domain, metavar="DOMAIN",
                        help="serve E2B's in-sandbox requests for host names <port>-<sandbox id>.DOMAIN too "
                        "(E2B_DOMAIN behind a TLS proxy; docs/E2B.md)")
    parser.add_argument("--protect", action="append", type=ipaddress.ip_network, default=[], metavar="CIDR",
                        help="a range no egress rule may open, like the host's own addresses (repeatable)")
    return parser


def _seconds(text: str) -> float:
    """A number of seconds more than 0 (argparse's type: its error names the flag)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):  # nan too
        raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0 seconds")
    return value


def _domain(text: str) -> str:
    try:
        return check_domain(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[bytes | None, dict[str, int]]:
    """The URL secret and ready pools the arguments name (a bad one is the parser's error)."""
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
    return url_secret, ready


def _auth(parser: argparse.ArgumentParser, args: argparse.Namespace) -> AuthConfig:
    """Tokens from --tokens, or an edge of a fleet: its key, its gateways vouching for callers."""
    if not args.fleet_gateway:
        if args.tokens is None:
            parser.error("--tokens is required (or --fleet-gateway)")
        if args.host not in ("127.0.0.1", "::1", "localhost"):
            parser.error(f"--host {args.host}: an edge that checks tokens itself listens on loopback only; put a "
                         "TLS proxy in front, or serve a fleet (--fleet-gateway)")
        try:
            return AuthConfig.load(args.tokens)
        except (OSError, ValueError) as exc:
            parser.error(f"--tokens {args.tokens}: {exc}")
    if args.fleet_key_file is None:
        parser.error("--fleet-gateway needs --fleet-key-file (layerbox fleet edge-key ID prints the key)")
    if args.edge_id is None or not EDGE_ID.fullmatch(args.edge_id):
        parser.error("--fleet-gateway needs --edge-id: 1-64 of [A-Za-z0-9._:-], starting with a letter or digit "
                     "(the key is the edge id's)")
    try:
        key = bytes.fromhex(args.fleet_key_file.read_text().strip())
        return AuthConfig(trust=GatewayTrust(key))
    except (OSError, ValueError) as exc:
        parser.error(f"--fleet-key-file {args.fleet_key_file}: {exc}")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    url_secret, ready = _settings(parser, args)
    logging.basicConfig(level=logging.INFO)
    auth = _auth(parser, args)
    manager = SandboxManager(args.data_dir, args.store, protected=[str(n) for n in args.protect])
    report = manager.reconcile()  # adopt what survived a previous run, clean up the rest
    log.info("reconciled: %s", report)
    admission = Admission(AdmissionConfig(edge_id=args.edge_id or f"{socket.gethostname()}:{args.port}",
                                          max_sandboxes=args.max_sandboxes, memory_reserve=args.memory_reserve,
                                          disk_reserve=args.disk_reserve, pids_reserve=args.pids_reserve),
                          disk_path=manager.data_dir, boxes=manager.boxes)
    limits = Maxima(memory=args.max_memory, pids=args.max_pids, output_cap=args.max_output_cap, ttl=args.max_ttl,
                    idle_timeout=args.max_ttl, lease_ttl=args.max_lease_ttl)
    caps = ProjectCaps(commands=args.max_commands_per_project, transfers=args.max_transfers_per_project,
                       connections=args.max_connections_per_project)
    service = SandboxService(manager, auth, admission, maxima=limits, shutdown_manager=True, url_secret=url_secret,
                             ready=ready, isolations=args.isolation or ISOLATIONS, caps=caps,
                             reap_interval=args.reap_interval, e2b_domain=args.e2b_domain)
    if args.fleet_gateway:
        service.join_fleet(edge_id=admission.config.edge_id, pool=args.pool, gateways=args.fleet_gateway,
                           url=args.advertise or f"http://{args.host}:{args.port}")
    # SIGTERM: commands streaming are interrupted at once (_interrupt_streams); other requests in flight
    # (a file transfer to a slow client) get SHUTDOWN_GRACE s to finish, then as long again once cancelled
    web.run_app(service.app(), host=args.host, port=args.port, shutdown_timeout=SHUTDOWN_GRACE,
                keepalive_timeout=HEADER_TIMEOUT)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
