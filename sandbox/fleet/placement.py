"""Placement across several edge services: best of k by load, retry on rejection, eject failing edges.

::

    edges = [Edge("http://10.0.0.1:8470", TOKEN), Edge("http://10.0.0.2:8470", TOKEN)]
    async with Placement(edges, k=2) as placement:
        async with await placement.create("img/python", memory=256 << 20) as sb:
            await sb.commands.run("echo hi")

A background task fetches every edge's ``GET /v1/load`` each
``refresh_interval`` seconds.  :meth:`Placement.choose` samples ``k`` healthy
edges at random and takes the one whose report scores best
(:func:`sandbox.host.admission.score`): sampling rather than always taking the
global best keeps many clients with the same stale view from stampeding one
edge.  The edge has the final word: a 503 ``capacity`` or 429 ``quota`` answer
is a normal rejection, and :meth:`Placement.create` moves on to the next best
edge it has not tried, at most ``max_attempts`` edges per create.

Health is a per-edge circuit breaker.  Connection errors, timeouts, 5xx
answers other than a capacity rejection, and failed load refreshes count as
failures; ``fail_threshold`` in a row eject the edge for ``cooldown`` seconds.
After that it is half-open: the next load refresh probes it, a success puts it
back, a failure ejects it again for another cooldown.

A create that times out may still finish on the edge; that sandbox is left to
the edge's TTL or idle timeout (pass one) since this client never learns its id.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Unpack

import aiohttp

from sandbox.core.errors import SandboxError
from sandbox.host.admission import score
from sandbox.sdk import (
    ApiError,
    AsyncSandbox,
    CapacityExceeded,
    QuotaExceeded,
    SandboxFields,
    ServiceUnavailable,
)

# Rejections: the edge is healthy but cannot take this create now (quota is per edge, so another may).
REJECTIONS = (QuotaExceeded, CapacityExceeded)


class PlacementError(SandboxError):
    """No edge took the create; ``answers`` holds (edge url, what it answered) per attempt."""

    def __init__(self, message: str, answers: Sequence[tuple[str, str]], *, retryable: bool) -> None:
        lines = "".join(f"\n  {url}: {answer}" for url, answer in answers) or "\n  (no edge was tried)"
        super().__init__(message + lines, retryable=retryable)
        self.answers = list(answers)


@dataclass(frozen=True)
class Edge:
    url: str
    token: str


@dataclass
class EdgeStats:
    """What this client knows and did with one edge (see :meth:`Placement.stats`)."""

    chosen: int = 0  # creates sent to it
    created: int = 0
    rejected: int = 0  # 429/503 capacity or quota answers
    failed: int = 0  # connection errors, timeouts, 5xx, failed refreshes
    ejected: int = 0  # times the breaker opened
    refreshed: int = 0  # load reports received
    consecutive_failures: int = 0
    ejected_until: float | None = None  # monotonic time; None when closed
    last_error: str | None = None
    report: dict[str, Any] | None = field(default=None, repr=False)
    report_at: float | None = None  # monotonic time the report arrived

    def to_json(self, now: float) -> dict[str, Any]:
        state = ("closed" if self.ejected_until is None else "ejected" if now < self.ejected_until
                 else "half-open")
        return {"chosen": self.chosen, "created": self.created, "rejected": self.rejected, "failed": self.failed,
                "ejected": self.ejected, "refreshed": self.refreshed, "consecutive_failures": self.consecutive_failures, "state": state,
                "last_error": self.last_error,
                "report_age": None if self.report_at is None else round(now - self.report_at, 3),
                "score": None if self.report is None else score(self.report)}


class Placement:
    """Places sandboxes on a set of edges; use as ``async with`` (it runs the refresh task)."""

    def __init__(self, edges: Sequence[Edge], *, k: int = 2, refresh_interval: float = 1.0, fail_threshold: int = 3,
                 cooldown: float = 10.0, max_attempts: int | None = None, refresh_timeout: float = 2.0,
                 create_timeout: float = 120.0, rng: random.Random | None = None) -> None:
        if not edges:
            raise ValueError("Placement needs at least one edge")
        urls = [e.url.rstrip("/") for e in edges]
        if len(set(urls)) != len(urls):
            raise ValueError(f"edges must have distinct urls: {urls}")
        if k < 1 or fail_threshold < 1:
            raise ValueError("k and fail_threshold must be at least 1")
        self.edges = [Edge(url, e.token) for url, e in zip(urls, edges, strict=True)]
        self.k, self.refresh_interval = k, refresh_interval
        self.fail_threshold, self.cooldown = fail_threshold, cooldown
        self.max_attempts = max_attempts or len(self.edges)
        self.refresh_timeout, self.create_timeout = refresh_timeout, create_timeout
        self._rng = rng or random.Random()
        self._stats = {e.url: EdgeStats() for e in self.edges}
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._round = asyncio.Event()  # set when a background refresh round ends, then replaced

    # -- lifecycle ----------------------------------------------------------------------------------
    async def __aenter__(self) -> Placement:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.refresh_timeout))
        await self.refresh()  # choose() has reports from the first call on
        self._task = asyncio.create_task(self._refresh_loop(), name="placement-refresh")
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_interval)
            await self.refresh()
            done, self._round = self._round, asyncio.Event()
            done.set()

    async def next_refresh(self) -> None:
        """Return once the background task has finished its next round of load reports."""
        if self._task is None:
            raise SandboxError("Placement is not open: use 'async with Placement(...)'")
        await self._round.wait()

    # -- health -------------------------------------------------------------------------------------
    def _healthy(self, url: str) -> bool:
        return self._stats[url].consecutive_failures < self.fail_threshold

    def _probe_due(self, url: str, now: float) -> bool:
        until = self._stats[url].ejected_until
        return until is None or now >= until

    def _success(self, url: str) -> None:
        st = self._stats[url]
        st.consecutive_failures, st.ejected_until = 0, None

    def _failure(self, url: str, error: str) -> None:
        st = self._stats[url]
        st.failed += 1
        st.consecutive_failures += 1
        st.last_error = error
        # half-open edges are already past the threshold, so one failed probe ejects them again
        if st.consecutive_failures >= self.fail_threshold:
            st.ejected_until = time.monotonic() + self.cooldown
            st.ejected += 1

    # -- load reports -------------------------------------------------------------------------------
    async def refresh(self) -> None:
        """Fetch every edge's load report once (ejected edges only after their cooldown)."""
        now = time.monotonic()
        await asyncio.gather(*(self._refresh_one(e) for e in self.edges if self._probe_due(e.url, now)))

    async def _refresh_one(self, edge: Edge) -> None:
        if self._session is None:
            raise SandboxError("Placement is not open: use 'async with Placement(...)'")
        try:
            async with self._session.get(f"{edge.url}/v1/load",
                                         headers={"Authorization": f"Bearer {edge.token}"}) as r:
                body = await r.read()
                if r.status != 200:
                    raise SandboxError(f"load report answered HTTP {r.status}: {body[:200]!r}")
                report = json.loads(body)
                score(report)  # a report we cannot score is a failed refresh, not a crash in choose()
        except (aiohttp.ClientError, TimeoutError, OSError, SandboxError, ValueError, KeyError,
                TypeError) as exc:
            self._failure(edge.url, f"load refresh: {_describe(exc)}")
            return
        st = self._stats[edge.url]
        st.refreshed += 1
        # two refreshes can overlap (the loop and an explicit call): never let the older answer win
        if st.report is None or report.get("time", 0) >= st.report.get("time", 0):
            st.report, st.report_at = report, time.monotonic()
        self._success(edge.url)

    # -- choosing -----------------------------------------------------------------------------------
    def choose(self, exclude: Sequence[str] = ()) -> Edge | None:
        """Best of ``k`` random healthy edges not in ``exclude``, by their last load report.

        Edges whose report says they are accepting come first; only when none
        is left are the others (possibly stale reports) offered, since the
        edge decides admission and a rejection costs one round trip.
        """
        healthy = [e for e in self.edges if e.url not in exclude and self._healthy(e.url)]
        accepting = [e for e in healthy if self._score(e) > -math.inf]
        pool = accepting or healthy
        if not pool:
            return None
        sample = self._rng.sample(pool, min(self.k, len(pool)))
        return max(sample, key=self._score)

    def _score(self, edge: Edge) -> float:
        report = self._stats[edge.url].report
        return -math.inf if report is None else score(report)

    # -- placing ------------------------------------------------------------------------------------
    async def create(self, image: str, **options: Unpack[SandboxFields]) -> AsyncSandbox:
        """Create a sandbox on the best edge that admits it; options as for :meth:`AsyncSandbox.create`.

        Raises :class:`PlacementError` listing every edge's answer when all
        attempts were rejected or failed, and re-raises a non-retryable error
        (bad request, auth, unknown image) from the first edge that gave it.
        """
        answers: list[tuple[str, str]] = []
        tried: list[str] = []
        while len(tried) < self.max_attempts:
            edge = self.choose(exclude=tried)
            if edge is None:
                break
            tried.append(edge.url)
            st = self._stats[edge.url]
            st.chosen += 1
            try:
                async with asyncio.timeout(self.create_timeout):
                    sb = await AsyncSandbox.create(image, url=edge.url, token=edge.token, **options)
            except ApiError as exc:
                if isinstance(exc, REJECTIONS):
                    st.rejected += 1
                    if st.report is not None:  # until the next refresh says otherwise
                        st.report = {**st.report, "accepting": False}
                    self._success(edge.url)  # it answered: alive, just full
                    answers.append((edge.url, f"rejected: {exc}"))
                    continue
                if exc.status >= 500:
                    self._failure(edge.url, str(exc))
                    answers.append((edge.url, f"failed: {exc}"))
                    continue
                raise
            except (ServiceUnavailable, TimeoutError) as exc:  # no answer (TimeoutError: create_timeout)
                self._failure(edge.url, _describe(exc))
                answers.append((edge.url, f"failed: {_describe(exc)}"))
                continue
            st.created += 1
            self._success(edge.url)
            return sb
        for e in self.edges:
            if e.url not in tried:
                st = self._stats[e.url]
                why = ("ejected after repeated failures: " + (st.last_error or "?")
                       if not self._healthy(e.url) else "not tried (attempt limit reached)")
                answers.append((e.url, why))
        raise PlacementError(f"no edge accepted {image!r} after {len(tried)} attempts", answers, retryable=True)

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per edge url: chosen, created, rejected, failed, ejected, state (closed/ejected/half-open)..."""
        now = time.monotonic()
        return {url: st.to_json(now) for url, st in self._stats.items()}


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
