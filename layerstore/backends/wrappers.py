"""Cross-cutting behaviour as Backends that wrap a Backend.

``open_backend`` stacks them in one place (retry outside, concurrency limit
inside, so that a retry's back-off does not hold a slot)::

    RetryingBackend(LimitedBackend(S3Backend(...) or PosixBackend(...)))

:class:`FaultyBackend` is for tests only, where a real service cannot be
made to fail on cue (a listing that breaks after N objects, a stall of one
call); the S3 tests inject network faults with a real proxy instead.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from layerstore.backend import (
    Backend,
    BackendError,
    Leftovers,
    ObjectInfo,
    PreconditionFailed,
    TransientError,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


async def _aclose(iterator: AsyncIterator[ObjectInfo]) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()


class RetriesExhausted(TransientError):
    """A retryable failure that persisted through every attempt.

    Still a :class:`TransientError` (a caller may try again later); the last
    failure is ``last`` (and ``__cause__``), the count is ``attempts``.
    """

    def __init__(self, last: BackendError, attempts: int, elapsed: float) -> None:
        super().__init__(f"{last} (gave up after {attempts} attempts in {elapsed:.1f} s)")
        self.last = last
        self.attempts = attempts


class _Wrapper(Backend):
    """A backend around ``inner``: every keyed call goes through :meth:`_through`."""

    inner: Backend

    async def _through(self, op: str, key: str, call: Callable[[], Awaitable[T]]) -> T:
        raise NotImplementedError

    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        return await self._through("get", key, lambda: self.inner.get(key, start, end))

    async def head(self, key: str) -> ObjectInfo | None:
        return await self._through("head", key, lambda: self.inner.head(key))

    async def put(self, key: str, data: bytes) -> None:
        await self._through("put", key, lambda: self.inner.put(key, data))

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        return await self._through("put_if_absent", key, lambda: self.inner.put_if_absent(key, data))

    async def put_conditional(self, key: str, data: bytes, if_match: str | None) -> str:
        return await self._through("put_conditional", key,
                                   lambda: self.inner.put_conditional(key, data, if_match))

    async def delete(self, key: str) -> None:
        await self._through("delete", key, lambda: self.inner.delete(key))

    async def sweep_leftovers(self, older_than: float, *, dry_run: bool = False) -> Leftovers:
        return await self.inner.sweep_leftovers(older_than, dry_run=dry_run)

    async def close(self) -> None:
        await self.inner.close()


class RetryingBackend(_Wrapper):
    """Retries ``retryable`` errors with exponential back-off and full jitter.

    Attempt ``n`` (from 1) that fails waits a random time in
    ``[0, min(max_delay, base_delay * 2**(n-1))]`` before the next one.  Each
    retry is logged (warning) with the operation, key and attempt.  A
    listing that fails midway is restarted and resumes after the last key it
    yielded (listings are sorted), so no object is yielded twice.
    """

    def __init__(self, inner: Backend, *, attempts: int = 6, base_delay: float = 0.1,
                 max_delay: float = 5.0) -> None:
        if attempts < 1:
            raise ValueError(f"attempts must be at least 1, not {attempts}")
        self.inner = inner
        self.url = inner.url
        self.attempts = attempts
        self.base_delay = base_delay
        self.max_delay = max_delay

    def __repr__(self) -> str:
        return f"RetryingBackend({self.inner!r}, attempts={self.attempts})"

    def _delay(self, attempt: int) -> float:
        return random.uniform(0, min(self.max_delay, self.base_delay * 2 ** (attempt - 1)))

    async def _backoff(self, op: str, key: str, attempt: int, exc: BackendError) -> None:
        delay = self._delay(attempt)
        log.warning("%s: %s %r failed (attempt %d of %d), retrying in %.2f s: %s",
                    self.url, op, key, attempt, self.attempts, delay, exc)
        await asyncio.sleep(delay)

    async def _through(self, op: str, key: str, call: Callable[[], Awaitable[T]]) -> T:
        started = time.monotonic()
        attempt = 1
        while True:
            try:
                return await call()
            except PreconditionFailed as exc:
                if attempt == 1:
                    raise
                raise PreconditionFailed(
                    key, self.url, "an earlier attempt of this call failed with an unknown "
                    "outcome, so the change may be its own write: re-read to check") from exc
            except BackendError as exc:
                if not exc.retryable:
                    raise
                if attempt >= self.attempts:
                    raise RetriesExhausted(exc, attempt, time.monotonic() - started) from exc
                await self._backoff(op, key, attempt, exc)
                attempt += 1

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        started = time.monotonic()
        attempt = 1
        last: str | None = None
        iterator: AsyncIterator[ObjectInfo] | None = None
        try:
            while True:
                if iterator is None:
                    iterator = aiter(self.inner.list(prefix))
                try:
                    info = await anext(iterator)
                except StopAsyncIteration:
                    return
                except BackendError as exc:
                    await _aclose(iterator)
                    iterator = None
                    if not exc.retryable:
                        raise
                    if attempt >= self.attempts:
                        raise RetriesExhausted(exc, attempt, time.monotonic() - started) from exc
                    await self._backoff("list", prefix, attempt, exc)
                    attempt += 1
                    continue
                if last is not None and info.key <= last:
                    continue  # already yielded before the listing was restarted
                last = info.key
                attempt = 1  # progress: count the attempts of the next failure afresh
                yield info
        finally:
            if iterator is not None:
                await _aclose(iterator)


class LimitedBackend(_Wrapper):
    """At most ``max_concurrency`` calls in flight on ``inner`` (an asyncio.Semaphore).

    A listing holds a slot only while it fetches its next object (a page or a
    directory for the real backends), never while its consumer works.
    """

    def __init__(self, inner: Backend, max_concurrency: int) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, not {max_concurrency}")
        self.inner = inner
        self.url = inner.url
        self.max_concurrency = max_concurrency
        self._slots = asyncio.Semaphore(max_concurrency)

    def __repr__(self) -> str:
        return f"LimitedBackend({self.inner!r}, {self.max_concurrency})"

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        iterator = aiter(self.inner.list(prefix))
        try:
            while True:
                async with self._slots:
                    try:
                        info = await anext(iterator)
                    except StopAsyncIteration:
                        return
                yield info
        finally:
            await _aclose(iterator)

    async def _through(self, op: str, key: str, call: Callable[[], Awaitable[T]]) -> T:
        async with self._slots:
            return await call()


@dataclass
class _Fault:
    error: Callable[[str, str], BackendError] | None = None  # (op, key) -> the error to raise
    stall: float = 0.0  # seconds to wait before the call (or the error)
    after_items: int = 0  # list only: fail after yielding this many objects
    lose_reply: bool = False  # let the call reach inner, then raise a TransientError


class FaultyBackend(_Wrapper):
    """Test-only: injects failures and stalls a real service cannot produce on cue.

    Operations are named like the methods (``"get"``, ``"put"``, ``"list"``,
    ...).  ``fail_next("put", 2)`` makes the next two puts raise a
    :class:`TransientError` before reaching ``inner``; ``stall_next("get",
    1, 5.0)`` makes the next get wait 5 s first; ``lose_reply_next("put")`` lets
    the next put happen, then raises as if its reply was lost.  ``fail_everything = True``
    makes every call fail (a store that is gone).  ``calls`` counts calls per
    operation; ``max_in_flight`` is the most calls seen at once.
    """

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.url = inner.url
        self.fail_everything = False
        self.calls: Counter[str] = Counter()
        self.in_flight = 0
        self.max_in_flight = 0
        self._faults: dict[str, list[_Fault]] = {}

    def _transient(self, op: str, key: str) -> BackendError:
        return TransientError(f"{self.url}: {op} {key!r}: injected fault (FaultyBackend)")

    def fail_next(self, op: str, times: int = 1, *,
                  error: Callable[[str, str], BackendError] | None = None,
                  after_items: int = 0) -> None:
        """The next ``times`` calls of ``op`` raise ``error(op, key)`` (a TransientError).

        For ``"list"``, ``after_items`` lets a listing yield that many objects first.
        """
        self._faults.setdefault(op, []).extend(
            _Fault(error=error or self._transient, after_items=after_items) for _ in range(times))

    def lose_reply_next(self, op: str, times: int = 1) -> None:
        """The next ``times`` calls of ``op`` happen, then raise a TransientError (a lost reply)."""
        self._faults.setdefault(op, []).extend(_Fault(lose_reply=True) for _ in range(times))

    def stall_next(self, op: str, times: int = 1, seconds: float = 3600.0) -> None:
        """The next ``times`` calls of ``op`` wait ``seconds`` before going on."""
        self._faults.setdefault(op, []).extend(_Fault(stall=seconds) for _ in range(times))

    async def _enter(self, op: str, key: str) -> _Fault | None:
        self.calls[op] += 1
        if self.fail_everything:
            raise self._transient(op, key)
        pending = self._faults.get(op)
        fault = pending.pop(0) if pending else None
        if fault is not None:
            if fault.stall:
                await asyncio.sleep(fault.stall)
            if fault.error is not None and fault.after_items == 0:
                raise fault.error(op, key)
        return fault

    async def _through(self, op: str, key: str, call: Callable[[], Awaitable[T]]) -> T:
        self.in_flight += 1  # a stalled call is in flight too
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            fault = await self._enter(op, key)
            result = await call()
            if fault is not None and fault.lose_reply:
                raise self._transient(op, key)
            return result
        finally:
            self.in_flight -= 1

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            fault = await self._enter("list", prefix)
        finally:
            self.in_flight -= 1
        yielded = 0
        iterator = aiter(self.inner.list(prefix))
        try:
            async for info in iterator:
                if fault is not None and fault.error is not None and yielded == fault.after_items:
                    raise fault.error("list", prefix)
                yield info
                yielded += 1
        finally:
            await _aclose(iterator)
