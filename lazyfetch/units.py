"""Pack bytes in whole fetch units, kept in memory a short while: fewer, larger GETs for a streaming reader.

A layer whose readers miss often (a cold sequential read: a new file every few
milliseconds, each a GET of a few hundred KiB) pays the store's latency once
per miss.  So while a layer streams (lazyfetch/fetcher.py decides), its GETs
ask for whole ``UNIT``-aligned units of the pack (consecutive units in one
GET, at most ``MAX_SPAN`` of them), and the ``AHEAD_UNITS`` units after them
are fetched in the background; the next misses find their frames in memory
and only decode.  A unit asked for while it is in flight joins that GET: a
range is never fetched twice at once.  As nydus v3 and SOCI do: fetch units
of 1-4 MiB with several requests in flight.

The bytes here are compressed frames as the store sent them, unverified: every
chunk cut from them is still decompressed and checked against its digest
before it is written to a blob (and a unit a corrupt chunk came from is
dropped, so the refetch asks the store again).  Memory is bounded by
``capacity`` (least recently used units go first); no unit goes past the end
of the pack as far as this host knows it (:attr:`PackUnits.pack_end`).
Runs on the daemon's event loop only.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

UNIT = 1 << 20  # bytes of a pack per fetch unit (aligned)
MAX_SPAN = 4  # units per GET
AHEAD_UNITS = 2  # units after a streaming reader's GET fetched in the background
CAPACITY = 64 << 20  # bytes of units kept in memory

# (pack, start, end, layer, background) -> the bytes: one GET, counted by the fetcher
Getter = Callable[[bytes, int, int, Any, bool], Awaitable[bytes]]


class PackUnits:
    def __init__(self, get: Getter, capacity: int = CAPACITY) -> None:
        self._get = get
        self.capacity = capacity
        self._units: OrderedDict[tuple[bytes, int], bytes] = OrderedDict()
        self._bytes = 0
        self._inflight: dict[tuple[bytes, int], asyncio.Future[bytes]] = {}
        # pack -> the end of its last frame this host knows of (from the layers' chunk locations)
        self.pack_end: dict[bytes, int] = {}
        self.served = 0  # ranges cut from units in memory

    def note_end(self, pack: bytes, end: int) -> None:
        if end > self.pack_end.get(pack, 0):
            self.pack_end[pack] = end

    def cached(self, pack: bytes, start: int, end: int) -> bytes | None:
        """``[start, end)`` of the pack from units in memory; None unless all of it is there."""
        first, last = start // UNIT, (end - 1) // UNIT
        parts = []
        for u in range(first, last + 1):
            data = self._units.get((pack, u))
            if data is None:
                return None
            self._units.move_to_end((pack, u))
            parts.append(data)
        self.served += 1
        return _cut(parts, first, start, end)

    async def read(self, pack: bytes, start: int, end: int, layer: Any) -> bytes:
        """``[start, end)`` through whole units (the pack's end must be known): the units neither in
        memory nor in flight are fetched, and the ``AHEAD_UNITS`` after them in the background."""
        top = (self.pack_end[pack] - 1) // UNIT
        first, last = start // UNIT, min((end - 1) // UNIT, top)
        self._start(pack, range(first, last + 1), layer, background=False)
        self._start(pack, range(last + 1, min(last + AHEAD_UNITS, top) + 1), layer, background=True)
        # taken before the first await: a unit settled meanwhile may be evicted before we look again
        pending: list[bytes | asyncio.Future[bytes]] = []
        for u in range(first, last + 1):
            data = self._units.get((pack, u))
            pending.append(data if data is not None else self._inflight[(pack, u)])
        parts = [p if isinstance(p, bytes) else await asyncio.shield(p) for p in pending]
        return _cut(parts, first, start, end)

    def drop(self, pack: bytes, start: int, end: int) -> None:
        """Forget the units holding ``[start, end)`` (a chunk in it was corrupt): asked of the store again."""
        for u in range(start // UNIT, (max(end, start + 1) - 1) // UNIT + 1):
            data = self._units.pop((pack, u), None)
            if data is not None:
                self._bytes -= len(data)

    def _start(self, pack: bytes, units: range, layer: Any, *, background: bool) -> None:
        todo = [u for u in units if (pack, u) not in self._units and (pack, u) not in self._inflight]
        for span in _spans(todo):
            loop = asyncio.get_running_loop()
            for u in span:
                self._inflight[(pack, u)] = loop.create_future()
            asyncio.ensure_future(self._fetch(pack, span, layer, background))  # noqa: RUF006 (it resolves futures)

    async def _fetch(self, pack: bytes, span: Sequence[int], layer: Any, background: bool) -> None:
        lo = span[0] * UNIT
        hi = min((span[-1] + 1) * UNIT, self.pack_end[pack])
        try:
            data = await self._get(pack, lo, hi, layer, background)
        except BaseException as exc:
            failure = exc if isinstance(exc, Exception) else RuntimeError(f"fetch of {pack.hex()} stopped: {exc!r}")
            for u in span:
                fut = self._inflight.pop((pack, u))
                if not fut.done():
                    fut.set_exception(failure)
                    fut.exception()  # retrieved: nobody may be waiting for a read-ahead
            if not isinstance(exc, Exception):
                raise
            return
        for u in span:
            piece = data[u * UNIT - lo : (u + 1) * UNIT - lo]
            if len(piece) == min((u + 1) * UNIT, hi) - u * UNIT:  # (short: only the readers waiting get it,
                self._keep((pack, u), piece)                       # and their length check fails)
            fut = self._inflight.pop((pack, u))
            if not fut.done():
                fut.set_result(piece)

    def _keep(self, key: tuple[bytes, int], data: bytes) -> None:
        old = self._units.pop(key, None)
        if old is not None:
            self._bytes -= len(old)
        self._units[key] = data
        self._bytes += len(data)
        while self._bytes > self.capacity and self._units:
            _, gone = self._units.popitem(last=False)
            self._bytes -= len(gone)

    def stats(self) -> dict[str, int]:
        return {"units": len(self._units), "bytes": self._bytes, "served": self.served,
                "in_flight": len(self._inflight)}


def _spans(units: list[int]) -> list[list[int]]:
    """Consecutive units in groups of at most ``MAX_SPAN``: one GET each."""
    spans: list[list[int]] = []
    for u in units:
        if spans and spans[-1][-1] == u - 1 and len(spans[-1]) < MAX_SPAN:
            spans[-1].append(u)
        else:
            spans.append([u])
    return spans


def _cut(parts: list[bytes], first: int, start: int, end: int) -> bytes:
    base = first * UNIT
    if len(parts) == 1:
        return parts[0][start - base : end - base]
    return b"".join(parts)[start - base : end - base]
