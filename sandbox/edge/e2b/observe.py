"""What E2B's control plane tells of a sandbox: its metrics and its logs.

**Metrics** (``GET /sandboxes/{id}/metrics``, ``GET /sandboxes/metrics?sandbox_ids=a,b``): one
sample, taken now (:func:`sandbox.edge.e2b.envd.metrics`: CPU as a rate over two readings of
the sandbox's cgroup, memory and disk from its usage).  layerbox keeps no history of them, so
``start``/``end`` only decide whether that sample is in the window the caller asked about:
none when the window ends before the sandbox started or begins after now.

**Logs** (``GET /sandboxes/{id}/logs``, ``GET /v2/sandboxes/{id}/logs``): the sandbox's
receipts (every action on it, its commands with their exit codes among them; the ones its
log keeps), one entry each: the action and its scalar fields as the message, ``warn`` for a
command that exited non-zero, ``info`` otherwise.  Not what its processes printed: that is
each command's own output (``commands.connect``), which the edge keeps per command.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from sandbox.core.errors import InvalidField, SandboxNotFound
from sandbox.core.model import check_int, check_sandbox_id, check_str
from sandbox.edge.e2b.base import E2bContext
from sandbox.edge.e2b.envd import metrics as envd_metrics
from sandbox.edge.e2b.templates import check_query
from sandbox.host.sandbox import Sandbox

MAX_LOGS = 1000  # E2B's bound on a page of logs
MAX_IDS = 100  # E2B's bound on sandbox_ids
MAX_FIELD = 200  # characters of one field shown in a log message
LEVELS = ("debug", "info", "warn", "error")
HIDDEN = frozenset({"id", "sandbox", "time", "action", "prev", "image", "labels", "layer_digests"})


def setup(e2b: E2bContext, app: web.Application) -> None:
    routes = Observe(e2b)
    r = app.router
    # before /sandboxes/{id}: aiohttp tries resources in the order they were added
    r.add_get("/sandboxes/metrics", routes.many_metrics, name="e2b:metrics-many")
    r.add_get("/sandboxes/{id}/metrics", routes.metrics, name="e2b:metrics")
    r.add_get("/sandboxes/{id}/logs", routes.logs_v1, name="e2b:logs")
    r.add_get("/v2/sandboxes/{id}/logs", routes.logs_v2, name="e2b:logs2")


class Observe:
    def __init__(self, e2b: E2bContext) -> None:
        self.e2b = e2b

    async def _box(self, request: web.Request) -> tuple[Sandbox, Any]:
        project = self.e2b.project(request)
        return await self.e2b.sandbox(request, project, request.match_info["id"])

    async def metrics(self, request: web.Request) -> web.Response:
        q = request.query
        check_query(q, ("start", "end"))
        start, end = _unix(q, "start"), _unix(q, "end")
        if start is not None and end is not None and end < start:
            raise InvalidField("end", f"{end} is before start ({start})")
        box, state = await self._box(request)
        if (end is not None and end < int(state.created)) or (start is not None and start > time.time()):
            return web.json_response([])
        (taken,) = await envd_metrics([box])
        if taken is None:
            raise SandboxNotFound(f"sandbox {box.id} was destroyed while it was measured")
        return web.json_response([sample(taken)])

    async def many_metrics(self, request: web.Request) -> web.Response:
        project = self.e2b.project(request)
        check_query(request.query, ("sandbox_ids",))
        raw = request.query.get("sandbox_ids")
        if not raw:
            raise InvalidField("sandbox_ids", "is required: a comma-separated list of sandbox ids")
        ids = raw.split(",")
        if len(ids) > MAX_IDS or len(set(ids)) != len(ids):
            raise InvalidField("sandbox_ids", f"at most {MAX_IDS} sandbox ids, each once")
        ids = [check_sandbox_id(sid, "sandbox_ids") for sid in ids]
        owned = {st.id for st in await asyncio.to_thread(self.e2b.ctx.owned, project)}
        boxes = [Sandbox(self.e2b.ctx.manager, sid) for sid in ids if sid in owned]  # another's: left out
        found = await envd_metrics(boxes)
        return web.json_response({"sandboxes": {b.id: sample(m) for b, m in zip(boxes, found, strict=True)
                                                if m is not None}})

    async def logs_v1(self, request: web.Request) -> web.Response:
        q = request.query
        check_query(q, ("start", "limit"))
        start = _unix(q, "start")
        limit = _count(q, "limit", MAX_LOGS, hi=1 << 31)
        box, _ = await self._box(request)
        entries = [e for e in await self._entries(box) if start is None or e["ms"] >= start][:limit]
        return web.json_response({"logs": [{"timestamp": e["timestamp"], "line": e["message"]} for e in entries],
                                  "logEntries": [_public(e) for e in entries]})

    async def logs_v2(self, request: web.Request) -> web.Response:
        q = request.query
        check_query(q, ("cursor", "limit", "direction", "level", "search"))
        cursor = _unix(q, "cursor")
        limit = _count(q, "limit", MAX_LOGS, hi=MAX_LOGS)
        direction = q.get("direction", "forward")
        if direction not in ("forward", "backward"):
            raise InvalidField("direction", f"{direction[:20]!r} is not forward or backward")
        level = q.get("level", "debug")
        if level not in LEVELS:
            raise InvalidField("level", f"{level[:20]!r} is not one of {', '.join(LEVELS)}")
        search = check_str("search", q["search"], max_len=256) if "search" in q else None
        box, _ = await self._box(request)
        entries = [e for e in await self._entries(box) if LEVELS.index(e["level"]) >= LEVELS.index(level)
                   and (search is None or search in e["message"])]
        if direction == "forward":
            entries = [e for e in entries if cursor is None or e["ms"] >= cursor]
        else:
            entries = [e for e in reversed(entries) if cursor is None or e["ms"] <= cursor]
        return web.json_response({"logs": [_public(e) for e in entries[:limit]]})

    @staticmethod
    async def _entries(box: Sandbox) -> list[dict[str, Any]]:
        rows, _ = await asyncio.to_thread(box.receipt_history)
        return [log_entry(r) for r in rows if not r.get("inherited") and r.get("action") != "segment"]


def sample(m: Mapping[str, Any]) -> dict[str, Any]:
    """E2B's ``SandboxMetric`` from envd's ``/metrics`` figures."""
    ts = int(m["ts"])
    return {"timestamp": _iso(ts), "timestampUnix": ts, "cpuCount": m["cpu_count"], "cpuUsedPct": m["cpu_used_pct"],
            "memUsed": m["mem_used"], "memTotal": m["mem_total"], "memCache": m.get("mem_cache", 0),
            "diskUsed": m["disk_used"], "diskTotal": m["disk_total"]}


def log_entry(rec: Mapping[str, Any]) -> dict[str, Any]:
    """A receipt as E2B's ``SandboxLogEntry`` (with ``ms``, its time in milliseconds, for filtering)."""
    shown = {k: _scalar(v) for k, v in sorted(rec.items()) if k not in HIDDEN and _scalar(v) is not None}
    action = str(rec.get("action"))
    failed = action == "exec" and rec.get("exit_code") not in (None, 0)
    when = float(rec.get("time") or 0)
    message = " ".join([action, *(f"{k}={v}" for k, v in shown.items())])
    return {"timestamp": _iso(when), "ms": int(when * 1000), "message": message,
            "level": "warn" if failed else "info",
            "fields": {"action": action, "receipt": str(rec.get("id")), **shown}}


def _public(entry: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in entry.items() if k != "ms"}


def _scalar(value: object) -> str | None:
    if isinstance(value, bool) or isinstance(value, (int, float, str)):
        return str(value)[:MAX_FIELD]
    return None


def _count(query: Mapping[str, str], name: str, default: int, *, hi: int) -> int:
    if name not in query:
        return default
    text = query[name]
    if not (text.isascii() and text.isdigit()):
        raise InvalidField(name, f"{text[:20]!r} is not a number from 0 to {hi}")
    return check_int(name, int(text), 0, hi)


def _unix(query: Mapping[str, str], name: str) -> int | None:
    """A Unix time (seconds for metrics, milliseconds for logs' start and cursor), as E2B sends it."""
    return None if name not in query else _count(query, name, 0, hi=1 << 62)


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"
