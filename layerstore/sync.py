"""A thin synchronous wrapper over :class:`~layerstore.store.Store`.

For callers without an event loop (scripts, notebooks, training frameworks):
one private loop runs every call to completion.  Do not use it from inside a
running event loop; await the async API there.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

from layerstore.gc import GcReport, collect
from layerstore.objects import Resolved
from layerstore.store import RefState, Store
from layerstore.verify import VerifyReport, verify

T = TypeVar("T")


class SyncStore:
    def __init__(self, url: str | None = None, data_dir: str | os.PathLike[str] | None = None,
                 **backend_options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self.store: Store = self.run(Store.open(url, data_dir, **backend_options))

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.run_until_complete(coro)

    def close(self) -> None:
        try:
            self.run(self.store.close())
        finally:
            self._loop.close()

    def __enter__(self) -> SyncStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def resolve(self, ref: str, *, refresh: bool = False) -> Resolved:
        return self.run(self.store.resolve(ref, refresh=refresh))

    def read_ref(self, name: str) -> RefState:
        return self.run(self.store.read_ref(name))

    def list_refs(self, prefix: str = "") -> list[RefState]:
        return self.run(self.store.list_refs(prefix))

    def tag(self, source: str, name: str) -> RefState:
        return self.run(self.store.tag(source, name))

    def compose(self, name: str, parts: Mapping[str, str]) -> RefState:
        return self.run(self.store.compose(name, parts))

    def verify(self, ref: str | None = None) -> VerifyReport:
        return self.run(verify(self.store, ref))

    def gc(self, *, grace: float = 3600.0, dry_run: bool = False) -> GcReport:
        return self.run(collect(self.store, grace=grace, dry_run=dry_run))
