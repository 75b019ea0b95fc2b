"""The one bridge from blocking code into a coroutine (a request's worker thread, the CLI, the reaper).

Library code is async where it does store I/O and blocking where it drives processes; a
blocking caller that needs a store coroutine runs it here, on a loop of its own.  Called
from a thread that runs an event loop, it refuses: that caller awaits the coroutine instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_blocking(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to its end from blocking code and return its result."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise RuntimeError("a blocking sandbox call from inside an event loop: await its async form")
