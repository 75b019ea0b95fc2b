"""Store locks that keep garbage collection and publishing apart.

A publisher dedups against chunks already in the store; if a concurrent gc
swept one of those packs, the publisher's image would name a missing chunk.
So (like restic) writers hold a shared lock object and gc holds an exclusive
one.  Locks are ordinary objects ``locks/<kind>-<id>``; one whose object is
older than ``LOCK_TTL`` is stale (its holder died) and is ignored.  Holders
refresh theirs every ``LOCK_TTL / 3`` while they run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator

from layerstore.backend import Backend, ObjectInfo
from layerstore.errors import LayerstoreError

LOCK_TTL = 15 * 60.0


class StoreLocked(LayerstoreError):
    """Another writer or a gc holds a conflicting lock on the store; the message names the locks."""

    retryable = True


async def _live_locks(backend: Backend, kind: str | None, now: float) -> list[ObjectInfo]:
    prefix = "locks/" + (f"{kind}-" if kind else "")
    return [info async for info in backend.list(prefix) if now - info.mtime < LOCK_TTL]


def _describe(locks: list[ObjectInfo]) -> str:
    return ", ".join(info.key for info in locks[:5])


async def prune_stale_locks(backend: Backend, older_than: float, *, keep: str = "",
                            dry_run: bool = False) -> list[str]:
    """Delete lock objects not refreshed for ``older_than`` seconds; returns their keys.

    Only for a gc holding its exclusive lock (``keep``, never deleted).  A
    holder refreshes its lock every ``LOCK_TTL / 3``, so a lock older than
    ``LOCK_TTL`` is already ignored by everyone: deleting it changes nothing
    for a live holder, whose next refresh simply writes it again.  Values
    below ``LOCK_TTL`` are refused.
    """
    if older_than < LOCK_TTL:
        raise ValueError(f"stale locks are those older than {LOCK_TTL:g} s at least, not {older_than:g}")
    now = time.time()
    doomed = [info.key async for info in backend.list("locks/")
              if info.key != keep and now - info.mtime >= older_than]
    if not dry_run:
        for key in doomed:
            await backend.delete(key)
    return doomed


@contextlib.asynccontextmanager
async def store_lock(backend: Backend, kind: str, *, ttl: float = LOCK_TTL,
                     op: str | None = None) -> AsyncIterator[str]:
    """Hold a ``publish`` (shared) or ``gc`` (exclusive) lock for the block's duration.

    ``op`` names what the holder does (``compose``, ``tag``; default ``kind``),
    for people reading the lock's body.
    """
    exclusive = kind == "gc"
    key = f"locks/{kind}-{uuid.uuid4().hex}"
    body = json.dumps({"kind": kind, "op": op or kind, "host": socket.gethostname(),
                       "pid": os.getpid(), "time": time.time()}).encode()

    async def conflicting() -> list[ObjectInfo]:
        live = await _live_locks(backend, None if exclusive else "gc", time.time())
        return [info for info in live if info.key != key]

    before = await conflicting()
    if before:
        raise StoreLocked(f"{backend.url}: store is locked by {_describe(before)}; retry later "
                          f"(locks expire {int(ttl)} s after their holder stops refreshing them)")
    await backend.put(key, body)
    after = await conflicting()
    if after:  # somebody raced us between the check and our write: back off
        await backend.delete(key)
        raise StoreLocked(f"{backend.url}: store became locked by {_describe(after)}; retry later")

    async def refresh() -> None:
        while True:
            await asyncio.sleep(ttl / 3)
            await backend.put(key, body)

    task = asyncio.create_task(refresh())
    try:
        yield key
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await backend.delete(key)
