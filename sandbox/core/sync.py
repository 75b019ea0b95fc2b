"""The bridges from blocking code into coroutines, both here.

Library code is async where it does store I/O and blocking where it drives processes.  A
blocking caller with no loop (a request's worker thread, the CLI, the reaper) that needs a
store coroutine runs it on a loop of its own (:func:`run_blocking`; called from a thread that
runs an event loop, it refuses: that caller awaits the coroutine instead).  A worker thread
that serves a loop running in another thread (a command's output into a response, an upload's
body into a file) hands it coroutines with :func:`wait_in_loop`.  (The blocking SDK keeps a
loop of its own across calls: sandbox.sdk.blocking.)
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine
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


def wait_in_loop(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T], *,
                 stop: threading.Event | None = None, poll: float = 0.5) -> T | None:
    """Run ``coro`` on ``loop`` (running in another thread) and wait here for its result.  With
    ``stop``, give up once it is set (looked at every ``poll`` seconds): the coroutine is
    cancelled and None returned."""
    fut = asyncio.run_coroutine_threadsafe(coro, loop)
    if stop is None:
        return fut.result()
    while not stop.is_set():
        try:
            return fut.result(timeout=poll)
        except TimeoutError:
            continue
    fut.cancel()
    return None


def own_thread(fn: Callable[[], T], *, name: str = "layerbox-work") -> asyncio.Future[T]:
    """``fn()`` started on a thread of its own; the future of its result, on the running loop.

    For work that lasts as long as a tenant wants (a command, an upload paced by its client),
    which must never hold a thread of the executor the control plane's short calls share.
    Cancelling an await of the future does not stop ``fn``: the caller stops it its own way (a
    command's Cancel) and awaits the future again for the end."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()
    done.add_done_callback(lambda f: f.cancelled() or f.exception())  # an error nobody awaits is no warning

    def settle(ok: bool, value: Any) -> None:
        if not done.done():
            (done.set_result if ok else done.set_exception)(value)

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:  # handed to whoever awaits the future
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody awaits any more
                loop.call_soon_threadsafe(settle, False, exc)
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, True, result)

    threading.Thread(target=run, name=name, daemon=True).start()
    return done
