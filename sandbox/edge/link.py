"""An edge's link to its fleet: registration and heartbeats through the gateways.

Every :data:`HEARTBEAT` seconds the edge posts ``/fleet/v1/heartbeat`` to one of its gateways
(the next one when that fails), signed with its edge key (sandbox.edge.trust): its id, pool,
the URL gateways reach it at, a boot id (new at each start: a restarted edge is told apart from
one that kept running), what its backends can run, its load report (the admission's), the
images its sandboxes were started from lately (placement's affinity), and every
:data:`FULL_EVERY`-th beat the sandboxes it runs, (id, project) each, which the gateway
reconciles the routing table against.  The answer carries the operator's state of the edge
(``active`` or ``draining``) and the fleet's clock, which the edge then signs and checks by.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import math
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import aiohttp

from sandbox.core.model import ISOLATIONS, POOL_LABEL
from sandbox.edge.context import EdgeContext
from sandbox.edge.trust import EDGE_HEADER, GatewayTrust, sign_report

log = logging.getLogger("layerbox.sandbox.link")
T = TypeVar("T")

HEARTBEAT = 1.0  # seconds between beats
FULL_EVERY = 5  # beats between reports of every sandbox
RECENT_IMAGES = 64
RECENT_LAYERS = 512
TIMEOUT = 5.0


def _finite(doc: dict[str, Any]) -> dict[str, Any]:
    """JSON has no infinities (a full edge's score is -inf): they go as null."""
    return {k: _finite(v) if isinstance(v, dict) else None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in doc.items()}


class FleetLink:
    """The heartbeat task of one edge (start with :meth:`run`)."""

    def __init__(self, ctx: EdgeContext, trust: GatewayTrust, *, edge_id: str, pool: str, url: str,
                 gateways: Sequence[str], interval: float = HEARTBEAT) -> None:
        self.ctx, self.trust = ctx, trust
        self.edge_id, self.pool, self.url = edge_id, pool, url
        self.gateways = [g.rstrip("/") for g in gateways]
        self.interval = interval
        self.boot = secrets.token_hex(8)
        self.state = "active"
        self.beats = 0
        # its own thread: a heartbeat must not queue behind the creates that fill the shared executor
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="heartbeat")
        # refs and layer digests its sandboxes started from lately, newest last (placement's affinity)
        self.images: OrderedDict[str, None] = OrderedDict()
        self.layers: OrderedDict[str, None] = OrderedDict()

    @staticmethod
    def _note(recent: OrderedDict[str, None], items: Sequence[str], keep: int) -> None:
        for item in items:
            recent.pop(item, None)
            recent[item] = None
        while len(recent) > keep:
            recent.popitem(last=False)

    async def _report(self, full: bool) -> dict[str, Any]:
        ctx = self.ctx
        caps = {iso: (await ctx.capabilities(iso)).available for iso in ISOLATIONS}
        doc: dict[str, Any] = {
            "edge": self.edge_id, "pool": self.pool, "url": self.url, "boot": self.boot,
            "capabilities": {"isolation": [k for k, ok in caps.items() if ok], "cpus": os.cpu_count() or 1},
            "load": _finite(await self._off_loop(ctx.admission.report)),
            "images": [], "layers": [], "sandboxes": None}
        if full:
            states = await self._off_loop(ctx.manager.list)
            # pooled sandboxes (FnCall, ready) are the edge's own until a create adopts one: no route, no quota
            doc["sandboxes"] = [[st.id, st.project or ""] for st in states if POOL_LABEL not in st.labels]
            self._note(self.images, [st.ref for st in states], RECENT_IMAGES)
            self._note(self.layers, [d for st in states for d in st.layer_digests], RECENT_LAYERS)
        doc["images"], doc["layers"] = [*self.images], [*self.layers]
        return doc

    async def _off_loop(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def beat(self, session: aiohttp.ClientSession) -> bool:
        """One heartbeat through the first gateway that takes it; False when none did."""
        full = self.beats % FULL_EVERY == 0
        body = json.dumps(await self._report(full)).encode()
        for url in self.gateways:
            sent = time.time()
            header = sign_report(self.trust.key, self.edge_id, body, sent + self.trust.clock)
            try:
                async with session.post(f"{url}/fleet/v1/heartbeat", data=body, headers={
                        EDGE_HEADER: header, "Content-Type": "application/json"}) as resp:
                    answer = await resp.json(content_type=None)
                    fleet_time = float(resp.headers.get("X-Layerbox-Time", "nan"))
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                log.warning("heartbeat to %s: %s", url, exc)
                continue
            if fleet_time == fleet_time:  # the fleet's clock, whatever this host's says
                self.trust.clock = fleet_time - (sent + time.time()) / 2
            if resp.status == 200 and isinstance(answer, dict):
                self.state = str(answer.get("state", self.state))
                self.beats += 1
                return True
            log.warning("heartbeat to %s: HTTP %s %s", url, resp.status, str(answer)[:300])
        return False

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=TIMEOUT)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                try:
                    await self.beat(session)
                except Exception:
                    log.exception("heartbeat failed")
                await asyncio.sleep(self.interval)

    async def stop(self, task: asyncio.Task[None]) -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        self._pool.shutdown(wait=False)
