"""Draining an edge and moving what runs on it (``layerbox fleet drain ID --move``).

A drained edge takes no new creates; its sandboxes keep running there until they end. With
``--move`` each one is also moved, with its id, to another active edge of the same pool: paused
into the store (a container's files; a VM's disk and memory, so its processes go on), resumed on
the target (the E2B protocol's pause and connect, which every edge serves for any sandbox), and
its route updated. A container's processes do not survive the move (no process checkpoint for
containers); its files, env and workdir do. A moved sandbox's lifetime ends when it would have,
capped at the target edge's maximum.

The operator's tool speaks to the edges directly, signed as a gateway (it holds the database and
so the fleet key), with the sandbox's own project as the caller.
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp
from yarl import URL

from sandbox.core.errors import SandboxError
from sandbox.edge.trust import GATEWAY_HEADER, Caller, edge_key, sign_request
from sandbox.fleet.db import EdgeRow, FleetDb
from sandbox.fleet.placement import STALE

FOREVER = 7 * 86400  # a sandbox without a ttl: the most a resume asks (the target edge caps it at its maximum)


class DrainError(SandboxError):
    """A sandbox could not be moved (it stays where it was, or paused in the store: its message says)."""


class Mover:
    def __init__(self, db: FleetDb, session: aiohttp.ClientSession, fleet_key: bytes, clock: float) -> None:
        self.db, self.session, self.fleet_key, self.clock = db, session, fleet_key, clock

    async def call(self, edge: EdgeRow, method: str, path: str, project: str, body: Any = None) -> tuple[int, Any]:
        signed = sign_request(edge_key(self.fleet_key, edge.id), method, path, Caller(project, 1 << 30),
                              time.time() + self.clock)
        data = None if body is None else json.dumps(body).encode()
        async with self.session.request(method, URL(edge.url + path, encoded=True), data=data, headers={
                GATEWAY_HEADER: signed, "Content-Type": "application/json"}) as resp:
            raw = await resp.read()
            return resp.status, json.loads(raw) if raw else None

    async def move(self, sid: str, project: str, source: EdgeRow, target: EdgeRow) -> dict[str, Any]:
        status, view = await self.call(source, "GET", f"/v1/sandboxes/{sid}", project)
        if status != 200:
            raise DrainError(f"{sid}: its edge {source.id} answered {status} to a look: {view}")
        left = FOREVER if view.get("expires") is None else max(1, int(view["expires"] - time.time()))
        # a container's files go through the store; a VM parks its memory too, processes and all
        pause = {"memory": False} if view.get("isolation") == "container" else {}
        status, answer = await self.call(source, "POST", f"/sandboxes/{sid}/pause", project, pause)
        if status != 204:
            raise DrainError(f"{sid}: pausing it on {source.id} answered {status}: {answer}; it stays there")
        status, answer = await self.call(target, "POST", f"/sandboxes/{sid}/connect", project, {"timeout": left})
        if status not in (200, 201):
            raise DrainError(f"{sid}: resuming it on {target.id} answered {status}: {answer}; it is paused in the "
                             "store: connect to it (E2B) to resume it on any edge")
        await self.db.set_route(sid, project, target.id, "placed")
        return {"sandbox": sid, "from": source.id, "to": target.id}


async def drain(db: FleetDb, edge_id: str, *, move: bool) -> dict[str, Any]:
    """Mark ``edge_id`` draining and, with ``move``, move its sandboxes (see the module's docstring)."""
    await db.set_edge_state(edge_id, "draining")
    out: dict[str, Any] = {"edge": edge_id, "state": "draining", "moved": [], "failed": []}
    if not move:
        return out
    edges = {e.id: e for e in await db.edges()}
    source = edges[edge_id]
    targets = [e for e in edges.values() if e.id != edge_id and e.state == "active" and e.age < STALE
               and e.pool == source.pool]
    if not targets:
        raise DrainError(f"no other active edge in pool {source.pool!r} to move {edge_id}'s sandboxes to")
    clock = await db.now() - time.time()
    routes = [r for r in await db.routes_on(edge_id) if r.state == "placed"]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        mover = Mover(db, session, await db.fleet_key(), clock)
        for i, route in enumerate(routes):
            target = targets[i % len(targets)]
            try:
                out["moved"].append(await mover.move(route.sandbox, route.project, source, target))
            except (DrainError, aiohttp.ClientError, TimeoutError) as exc:
                out["failed"].append({"sandbox": route.sandbox, "error": str(exc)})
    return out
