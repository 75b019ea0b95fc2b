"""Synchronous wrappers for callers without an event loop (training loops, scripts)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from layerstore.store import Store
from lazyfetch.mounts import HostMounts, MountResult
from snapshots.checkpoint import Checkpoint, Snapshots

T = TypeVar("T")


class SyncSnapshots:
    """``Snapshots`` with blocking methods; each call opens the store, does its work and closes it."""

    def __init__(self, data_dir: str | os.PathLike[str], store_url: str | None = None) -> None:
        self.data_dir = data_dir
        self.store_url = store_url
        self.host = HostMounts(data_dir, store_url)

    def _run(self, fn: Callable[[Snapshots], Awaitable[T]]) -> T:
        async def go() -> T:
            async with await Store.open(self.store_url, self.data_dir) as store:
                return await fn(Snapshots(store, self.host))

        return asyncio.run(go())

    def checkpoint(self, mountpoint: str, **kw: Any) -> Checkpoint:
        return self._run(lambda s: s.checkpoint(mountpoint, **kw))

    def restore(self, ref: str, mountpoint: str, **kw: Any) -> MountResult:
        return self._run(lambda s: s.restore(ref, mountpoint, **kw))

    def list(self, prefix: str = "checkpoints/") -> list[dict[str, Any]]:
        return self._run(lambda s: s.list(prefix))

    def show(self, ref: str) -> dict[str, Any]:
        return self._run(lambda s: s.show(ref))

    def delete(self, ref: str) -> None:
        self._run(lambda s: s.delete(ref))

    def squash(self, ref: str, *, name: str | None = None) -> dict[str, Any]:
        from snapshots.squash import squash

        return self._run(lambda s: squash(s.store, ref, name=name))
