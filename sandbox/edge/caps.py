"""What one project may hold on an edge at once, so no tenant can slow, starve or grow it for the others.

Every kind of lasting work a request starts is counted against its project while it lasts:
commands (exec streams, FnCalls from the moment they wait for a sandbox, background commands and
terminals), file transfers, and proxied port connections and command sockets.  Past a cap the edge
answers 429 ``project_limit`` naming the cap and what the project holds, retryable once one
ends; nothing waits for a slot (a queue would be memory and threads a tenant grows for free).
The edge's own totals (``edge`` caps) bound the sum over all projects, answered 503 ``busy``.

Everything here runs on the event loop's thread: no locks.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Literal

from sandbox.core.errors import ApiError

Kind = Literal["commands", "transfers", "connections"]
KINDS: tuple[Kind, ...] = ("commands", "transfers", "connections")
WHAT = {"commands": "commands running (exec streams, FnCalls, background commands, terminals)",
        "transfers": "file transfers", "connections": "proxied connections and command sockets"}


@dataclass(frozen=True)
class ProjectCaps:
    """Per project, at once (an edge's flags set them)."""

    commands: int = 16
    transfers: int = 8
    connections: int = 32

    def total(self, projects: int) -> ProjectCaps:
        """The edge's own bound for ``projects`` projects: room for several busy ones, not for all
        of them at their caps (then the host is full, and a 503 sends the caller elsewhere)."""
        factor = max(4, min(projects, 16))
        return ProjectCaps(**{k: v * factor for k, v in dataclasses.asdict(self).items()})


class Held:
    """One unit of a project's cap, returned by :meth:`release` (at most once)."""

    def __init__(self, usage: Usage, project: str, kind: Kind) -> None:
        self._usage, self.project, self.kind = usage, project, kind
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._usage.give_back(self.project, self.kind)

    def __enter__(self) -> Held:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Usage:
    """What every project holds now, against ``caps`` each and ``total`` for the edge."""

    def __init__(self, caps: ProjectCaps, total: ProjectCaps) -> None:
        self.caps, self.total = caps, total
        self._held: dict[str, Counter[str]] = {}
        self._sum: Counter[str] = Counter()

    def take(self, project: str, kind: Kind) -> Held:
        """One unit of ``kind`` for ``project``, or 429 (its cap) / 503 (the edge's)."""
        mine = self._held.setdefault(project, Counter())
        cap = getattr(self.caps, kind)
        if mine[kind] >= cap:
            raise ApiError(None, "project_limit",
                           f"project {project!r} has {mine[kind]} {WHAT[kind]} on this edge, the most it may "
                           f"({kind}: {cap}); retry when one ends", retryable=True, retry_after=1,
                           resources=(kind,))
        if self._sum[kind] >= getattr(self.total, kind):
            raise ApiError(None, "busy", f"this edge has {self._sum[kind]} {WHAT[kind]}, the most it takes; "
                                         "retry shortly or on another edge", retryable=True, retry_after=1,
                           resources=(kind,))
        mine[kind] += 1
        self._sum[kind] += 1
        return Held(self, project, kind)

    def give_back(self, project: str, kind: Kind) -> None:
        mine = self._held.get(project)
        if mine is None or mine[kind] <= 0:
            return
        mine[kind] -= 1
        self._sum[kind] -= 1
        if not +mine:
            del self._held[project]

    def of(self, project: str) -> dict[str, int]:
        mine = self._held.get(project, Counter())
        return {k: mine[k] for k in KINDS}
