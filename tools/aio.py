"""The one place ``tools/`` (the CLI and the demo) crosses from synchronous code into a coroutine.

The libraries are async and never start a loop themselves (STYLE practice 9); a command line
is synchronous.  Every crossing goes through :func:`run` so that the policy is one line: each
call gets a new event loop, closed when the coroutine returns.  Nothing bound to a loop (an
open store, its S3 client) may therefore outlive the call that made it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on a fresh event loop and return its result."""
    return asyncio.run(coro)
