"""Placement: which edge of the fleet gets a create (the gateway's; there is no other).

Each gateway holds a view of the registry (sandbox.fleet.db ``edges``), refreshed every second,
and over it an overlay of its own creates in flight: an edge's report is a second old, so a
burst of creates would all see the same best edge; the overlay takes each create in flight off
its edge's free slots and memory until the edge's next report includes it.

:meth:`Placement.candidates` filters the view by the create's constraints (the edge is active,
healthy and not ejected by its breaker, in an allowed pool, runs the isolation, has a free
slot), then orders the rest best-of-k: it samples ``k`` at random and takes the best score, then
again among the rest, so that many gateways with the same view do not stampede one edge, while
a better edge still wins most draws.  The score is the edge's own (sandbox.host.admission.score)
plus an image affinity bonus: the share of the image's layers the edge's sandboxes started from
lately (their pages are likely in its cache).  The edge has the last word: a 503 ``capacity``
answer moves the create to the next candidate.

Health is a per-edge circuit breaker: ``fail_threshold`` failures in a row (connection errors,
timeouts, 5xx other than a capacity answer) eject the edge for ``cooldown`` seconds; then one
request may probe it (half-open), and a success closes the breaker.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sandbox.fleet.db import EdgeRow
from sandbox.host.admission import score

AFFINITY = 0.25  # score bonus for an edge holding all of the image's layers (scores lie in 0..1)
STALE = 10.0  # seconds without a heartbeat before an edge takes no creates


@dataclass(frozen=True)
class Demand:
    """What a create needs of its edge."""

    isolation: str = "container"
    count: int = 1
    memory: int = 0
    pools: tuple[str, ...] = ()  # allowed pools, in order of preference; () = any
    image: str | None = None
    layers: frozenset[str] = frozenset()


@dataclass
class Breaker:
    failures: int = 0
    open_until: float = 0.0
    ejected: int = 0
    last_error: str | None = None


@dataclass
class EdgeView:
    row: EdgeRow
    in_flight: int = 0  # this gateway's creates sent and not yet in a report
    memory_in_flight: int = 0
    # creates this gateway placed here that its report may not include yet: (monotonic time done, count, memory)
    recent: list[tuple[float, int, int]] = field(default_factory=list)
    breaker: Breaker = field(default_factory=Breaker)

    @property
    def id(self) -> str:
        return self.row.id

    def pending(self) -> tuple[int, int]:
        """Sandboxes and memory this gateway sent here beyond what the edge's report counts."""
        return (self.in_flight + sum(n for _, n, _ in self.recent),
                self.memory_in_flight + sum(m for _, _, m in self.recent))

    def free_slots(self) -> int:
        return int(self.row.load.get("sandboxes", {}).get("free", 0)) - self.pending()[0]

    def rank(self, demand: Demand) -> tuple[float, int]:
        """The score to 2 decimals, then fewer sandboxes: edges sharing a machine (or alike) score
        within a hair of each other, and a hair is no reason to stack sandboxes on one."""
        boxes = self.row.load.get("sandboxes", {}) if self.row.load else {}
        held = int(boxes.get("live", 0)) + int(boxes.get("in_flight", 0)) + self.pending()[0]
        return round(self.score(demand), 2), -held

    def score(self, demand: Demand) -> float:
        load = self.row.load
        if not load:
            return float("-inf")
        adjusted = _overlaid(load, *self.pending())
        base = score(adjusted)
        layers = set(self.row.images.get("layers", ()))
        if demand.layers:
            base += AFFINITY * len(demand.layers & layers) / len(demand.layers)
        elif demand.image is not None and demand.image in self.row.images.get("refs", ()):
            base += AFFINITY
        return base


def _overlaid(load: dict[str, Any], count: int, memory: int) -> dict[str, Any]:
    boxes, mem = dict(load["sandboxes"]), dict(load["memory"])
    boxes["free"] = max(boxes["free"] - count, 0)
    mem["free"] = max(mem["free"] - memory, 0)
    return {**load, "sandboxes": boxes, "memory": mem, "accepting": load.get("accepting") and boxes["free"] > 0}


class Placement:
    """The gateway's view of the edges and its choice among them."""

    def __init__(self, *, k: int = 2, fail_threshold: int = 3, cooldown: float = 10.0,
                 rng: random.Random | None = None) -> None:
        if k < 1 or fail_threshold < 1:
            raise ValueError("k and fail_threshold must be at least 1")
        self.k, self.fail_threshold, self.cooldown = k, fail_threshold, cooldown
        self.rng = rng or random.Random()
        self.edges: dict[str, EdgeView] = {}

    def update(self, rows: Iterable[EdgeRow]) -> None:
        """A fresh registry: a report made after a create ended includes it, so the overlay drops it."""
        now = time.monotonic()
        fresh: dict[str, EdgeView] = {}
        for row in rows:
            view = self.edges.get(row.id) or EdgeView(row)
            view.row = row
            reported_at = now - row.age
            view.recent = [r for r in view.recent if r[0] >= reported_at]
            fresh[row.id] = view
        self.edges = fresh

    def healthy(self, view: EdgeView, now: float) -> bool:
        return view.row.age < STALE and view.breaker.open_until <= now

    def eligible(self, view: EdgeView, demand: Demand, now: float) -> bool:
        """Whether ``view`` may take ``demand`` at all (its room aside)."""
        row = view.row
        return (row.state == "active" and self.healthy(view, now) and (not demand.pools or row.pool in demand.pools)
                and demand.isolation in row.capabilities.get("isolation", ()))

    def candidates(self, demand: Demand) -> list[EdgeView]:
        """The edges that may take ``demand``, pools in the order given; in each, those with room by
        the view first, best-of-k, then those the view thinks full, best first: the view is an
        estimate, the edge's admission the answer."""
        now = time.monotonic()
        out: list[EdgeView] = []
        for pool in demand.pools or (None,):
            views = [v for v in self.edges.values() if self.eligible(v, demand, now) and (pool is None or v.row.pool == pool)]
            rest = [v for v in views if v.free_slots() >= demand.count]
            while rest:
                drawn = self.rng.sample(rest, min(self.k, len(rest)))
                best = max(drawn, key=lambda v: v.rank(demand))
                out.append(best)
                rest.remove(best)
            out += sorted((v for v in views if v not in out), key=lambda v: v.rank(demand), reverse=True)
        return out

    def any_healthy(self, pools: Sequence[str] = ()) -> list[EdgeView]:
        now = time.monotonic()
        views = [v for v in self.edges.values() if self.healthy(v, now) and (not pools or v.row.pool in pools)]
        self.rng.shuffle(views)
        return views

    def utilization(self, pool: str) -> float:
        """Live and in-flight sandboxes over the slots of the pool's active edges (1.0 when it has none)."""
        used = total = 0
        for v in self.edges.values():
            if v.row.pool != pool or v.row.state != "active" or not v.row.load:
                continue
            boxes = v.row.load["sandboxes"]
            total += int(boxes.get("max", 0))
            used += int(boxes.get("live", 0)) + int(boxes.get("in_flight", 0)) + v.pending()[0]
        return used / total if total else 1.0

    # -- what happened --------------------------------------------------------------------------------
    def sent(self, view: EdgeView, demand: Demand) -> None:
        view.in_flight += demand.count
        view.memory_in_flight += demand.memory * demand.count

    def done(self, view: EdgeView, demand: Demand, *, made: bool) -> None:
        view.in_flight = max(view.in_flight - demand.count, 0)
        view.memory_in_flight = max(view.memory_in_flight - demand.memory * demand.count, 0)
        if made:  # until a report made after now includes it
            view.recent.append((time.monotonic(), demand.count, demand.memory * demand.count))

    def succeeded(self, edge: str) -> None:
        view = self.edges.get(edge)
        if view is not None:
            view.breaker.failures = 0

    def failed(self, edge: str, why: str) -> None:
        view = self.edges.get(edge)
        if view is None:
            return
        b = view.breaker
        b.failures += 1
        b.last_error = why
        if b.failures >= self.fail_threshold:
            b.open_until = time.monotonic() + self.cooldown
            b.ejected += 1
            b.failures = self.fail_threshold - 1  # half-open after the cooldown: one more failure re-opens it
