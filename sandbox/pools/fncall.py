"""FnCall: short stateless calls on a warm pool of pre-created sandboxes of one image.

A pool entry is a whole sandbox from :meth:`SandboxManager.create`, with its
own fresh overlay upper.  A call takes a ready entry, runs exactly one exec
in it, and the entry is then destroyed in the background while a replacement
is created, so nothing one call writes (files, processes, /tmp) can reach the
next call.  The pool keeps ``size`` entries ready (or being created) beyond
the callers already waiting; a call that finds none ready queues for the next
one to finish creating, and a failed creation is handed to the oldest waiting
caller as :class:`PoolCreateFailed` rather than leaving it hanging.

Why not reuse a container and swap its upper: a running container's root is
pinned to the overlay mount it was started on (pivot_root), so a new upper
means a new mount namespace root, i.e. a new container; doing it inside the
container would need CAP_SYS_ADMIN there, which sandboxes do not get.

Function calls (``function=`` Python source) run a small runner with
``python3 -c`` inside the sandbox.  The request (source, entry name, args,
kwargs) goes in as JSON on stdin; the runner writes its JSON answer as the
last thing on stdout behind a per-call random marker followed by the
payload length, so the function's own prints stay in ``stdout``.

Every pool sandbox is labelled ``layerbox.pool=<ref>`` and
``layerbox.pool.id=<pool id>`` so listings and reconcile can tell them apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from layerstore.backend import ObjectNotFound
from layerstore.store import RefNotFound
from sandbox.core.errors import ImageNotFound, SandboxError
from sandbox.core.model import POOL_ID_LABEL, POOL_LABEL, POOL_PROJECT_LABEL, SandboxOptions
from sandbox.core.sync import own_thread
from sandbox.host.execs import Cancel
from sandbox.host.manager import ExecResult, Sandbox, SandboxManager

log = logging.getLogger("layerbox.sandbox.fncall")

__all__ = ["POOL_ID_LABEL", "POOL_LABEL", "CallResult", "FnCalls", "WarmPool"]
MARKER_PREFIX = b"\x1eLBFN:"

# Runs inside the sandbox; imports beyond json are lazy because interpreter start-up is
# most of a function call's latency.  It keeps a private duplicate of fd 1 so the answer
# still reaches the pipe if the function closes or redirects stdout, and ends
# with os._exit so no atexit hook or stray thread can print after the answer.
RUNNER = r"""
import json, os, sys
out = os.dup(1)
req = json.loads(sys.stdin.buffer.read())
sys.stdin = open(os.devnull)
def finish(doc, code):
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except Exception:
            pass
    data = json.dumps(doc).encode()
    frame = req["marker"].encode() + b"%d\n" % len(data) + data
    while frame:
        frame = frame[os.write(out, frame):]
    os._exit(code)
def failed(e, tb):
    import traceback
    text = "".join(traceback.format_exception(type(e), e, tb))
    finish({"error": "%s: %s\n%s" % (type(e).__name__, e, text)}, 1)
try:
    name = req["entry"]
    if name is None:
        import ast
        defs = [n.name for n in ast.parse(req["source"]).body
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        if not defs:
            raise ValueError("the function source defines no top-level function (def ...)")
        name = defs[-1]
    ns = {"__name__": "__fncall__"}
    exec(compile(req["source"], "<function>", "exec"), ns)
    if not callable(ns.get(name)):
        raise NameError("the function source defines no function named %r" % name)
    value = ns[name](*req["args"], **req["kwargs"])
    if type(value).__name__ == "coroutine":
        import asyncio
        value = asyncio.run(value)
except BaseException as e:
    failed(e, e.__traceback__.tb_next)
try:
    json.dumps(value)
except (TypeError, ValueError) as e:
    finish({"error": "TypeError: the return value of %s() is not JSON-serializable (%s); "
            "return lists, dicts, str, int, float, bool or None" % (name, e)}, 1)
finish({"value": value}, 0)
"""


class FnCallError(SandboxError):
    """Root of warm-pool failures."""


class PoolsBusy(FnCallError):
    """Every warm pool has calls running and no new one may be made: retry shortly."""

    retryable = True


class PoolClosed(FnCallError):
    """The pool was closed before (or while) the call waited for a sandbox."""


class PoolCreateFailed(FnCallError):
    """Creating a pool sandbox failed; the cause is chained.  Retrying may help."""

    retryable = True


class CallArgumentError(FnCallError, TypeError):
    """The call's arguments cannot be sent (not JSON-serializable, or cmd and function mixed)."""


# counts a pool's new sandbox against a quota and a host's capacity while it is made
Admit = Callable[[SandboxOptions], AbstractAsyncContextManager[None]]


@dataclass(frozen=True)
class CallResult:
    exit_code: int | None
    stdout: bytes
    stderr: bytes
    value: Any  # the function's JSON-decoded return value (function calls), else None
    error: str | None  # function calls: "Type: message" + traceback, or why no answer came back
    timed_out: bool
    truncated: bool
    duration: float  # seconds from call() to result
    wait_seconds: float  # part of duration spent waiting for a warm container
    sandbox: str  # id of the sandbox that ran it


@dataclass(frozen=True)
class _Request:
    cmd: str | list[str]
    stdin: bytes | None
    marker: bytes | None  # function calls only


def _request(cmd: str | Sequence[str] | None, function: str | None, entry: str | None, args: Sequence[Any],
             kwargs: Mapping[str, Any] | None, stdin: bytes | None) -> _Request:
    if (cmd is None) == (function is None):
        raise CallArgumentError("pass exactly one of cmd (a command) or function= (Python source)")
    if function is None:
        assert cmd is not None
        if args or kwargs or entry is not None:
            raise CallArgumentError("args, kwargs and entry go with function=, not with cmd")
        return _Request(cmd if isinstance(cmd, str) else list(cmd), stdin, None)
    if stdin is not None:
        raise CallArgumentError("stdin carries the function request; pass data to a function as args")
    marker = MARKER_PREFIX + uuid.uuid4().hex.encode() + b":"
    try:
        body = json.dumps({"marker": marker.decode(), "source": function, "entry": entry,
                           "args": list(args), "kwargs": dict(kwargs or {})})
    except (TypeError, ValueError) as exc:
        raise CallArgumentError(f"function arguments must be JSON-serializable: {exc}") from exc
    return _Request(["python3", "-c", RUNNER], body.encode(), marker)


def _answer(res: ExecResult, marker: bytes, timeout: float) -> tuple[bytes, Any, str | None]:
    """Split the runner's answer off stdout: (user stdout, value, error)."""
    at = res.stdout.rfind(marker)
    if at >= 0:
        head, _, rest = res.stdout[at + len(marker):].partition(b"\n")
        if head.isdigit() and int(head) <= len(rest):
            # anything after the answer came from processes the function left running
            payload, trailing = rest[:int(head)], rest[int(head):]
            try:
                doc = json.loads(payload)
            except ValueError:
                doc = None
            if isinstance(doc, dict):
                return res.stdout[:at] + trailing, doc.get("value"), doc.get("error")
    if res.timed_out:
        why = f"TimeoutError: the call ran longer than {timeout:g} s and was killed"
    elif res.truncated:
        why = ("OutputTruncated: the function printed more than output_cap bytes, so its result was "
               "dropped with the excess; raise output_cap or print less")
    elif res.exit_code == 127:
        why = "RunnerMissing: python3 was not found in the image (exit code 127)"
    else:
        tail = res.stderr[-2000:].decode(errors="replace")
        why = f"RunnerFailed: no result from the function runner (exit code {res.exit_code})\n{tail}"
    return res.stdout, None, why


class WarmPool:
    """``size`` ready sandboxes of ``ref``; every call runs on a fresh one.

    ``options`` (a :class:`SandboxOptions`, or its fields as keywords) go to
    :meth:`SandboxManager.create` for every pool sandbox, with the pool's labels
    added.  Use as ``async with WarmPool(...) as pool`` or call :meth:`start` and
    :meth:`close`.  All methods must be called from one event loop.
    """

    def __init__(self, manager: SandboxManager, ref: str, options: SandboxOptions | None = None, *,
                 size: int = 2, warm: Sequence[str] | None = None, admit: Admit | None = None,
                 **fields: Any) -> None:
        """``admit``: what every sandbox the pool makes is admitted against (the edge's capacity);
        by default nothing."""
        if size < 1:
            raise ValueError(f"pool size must be at least 1, not {size}")
        self.manager = manager
        self.ref = ref
        self.size = size
        self.id = "pool-" + uuid.uuid4().hex[:10]
        base = options if options is not None else SandboxOptions(**fields)
        self._options = base.replace(labels={**base.labels, POOL_LABEL: ref, POOL_ID_LABEL: self.id})
        self._ready: deque[Sandbox] = deque()
        self._waiters: deque[asyncio.Future[Sandbox]] = deque()
        self._tasks: set[asyncio.Task[None]] = set()
        self._creating = 0
        self._busy = 0
        self._closed = False
        # run once in every new sandbox before it is ready: the first command into a container
        # costs crun ~2x what later ones do (29 vs 16 ms here), and this moves that off the caller
        self._warm = list(warm) if warm is not None else None
        self._target: str | None = None  # what to create instead of ``ref`` (see take)
        self._admit = admit
        self._changed = asyncio.Event()  # a sandbox became ready, a creation failed, or the pool closed
        self._counts = {"created": 0, "destroyed": 0, "calls": 0, "misses": 0, "failures": 0, "taken": 0,
                        "stale": 0}
        self._wait_total = 0.0
        self._last_error: str | None = None
        self._destroy_errors: list[str] = []

    async def __aenter__(self) -> WarmPool:
        await self.start()
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def start(self) -> None:
        """Return once ``size`` sandboxes are ready; on a creation failure, close the pool and raise it."""
        self._refill()
        await self.settle()
        if len(self._ready) < self.size:
            error = self._last_error
            await self.close()
            raise PoolCreateFailed(f"warm pool for {self.ref}: only {len(self._ready)} of {self.size} "
                                   f"sandboxes could be created: {error}")

    def fill(self) -> None:
        """Start making the pool's sandboxes and return (:meth:`start` waits for them)."""
        self._refill()

    async def full(self) -> None:
        """Until ``size`` sandboxes are ready (refilling now if nothing is under way), or the pool closes."""
        while len(self._ready) < self.size and not self._closed:
            self._changed.clear()
            if not self._creating:
                self._refill()
            await self._changed.wait()

    async def settle(self) -> None:
        """Wait until calls in flight, creation and destruction are done (the pool is refilled)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def call(self, cmd: str | Sequence[str] | None = None, *, function: str | None = None,
                   entry: str | None = None, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
                   timeout: float = 30.0,  # noqa: ASYNC109  (bounds the exec inside the sandbox)
                   stdin: bytes | None = None, output_cap: int = 1 << 20) -> CallResult:
        """Run ``cmd`` (a string goes through ``/bin/sh -c``) or ``function`` on a fresh sandbox.

        ``function`` is Python source; its last top-level ``def`` (or ``entry``)
        is called with ``args``/``kwargs`` (JSON values) and its return value
        comes back JSON-decoded in ``value``; an exception comes back in
        ``error`` instead.  ``timeout`` bounds the exec, not the wait for a
        sandbox; a failed creation while waiting raises :class:`PoolCreateFailed`.
        """
        started = time.perf_counter()
        req = _request(cmd, function, entry, args, kwargs, stdin)
        if self._closed:
            raise PoolClosed(f"warm pool {self.id} for {self.ref} is closed")
        self._counts["calls"] += 1
        box = await self._acquire()
        waited = time.perf_counter() - started
        self._wait_total += waited
        self._busy += 1
        cancel = Cancel()
        # on a thread of its own for the command's whole life (never the control plane's executor)
        run = own_thread(lambda: box.exec(req.cmd, timeout=timeout, stdin=req.stdin, output_cap=output_cap,
                                          cancel=cancel), name="layerbox-fncall")
        # before the caller resumes (callbacks run in order): a finished call is not "busy"
        run.add_done_callback(self._not_busy)
        # the sandbox is destroyed only after its exec ends, however the call ends
        self._spawn(self._discard(box, run))
        try:
            res = await asyncio.shield(run)
        except asyncio.CancelledError:
            cancel.cancel("disconnect")  # its caller left: nobody would read the answer
            raise
        stdout, value, error = res.stdout, None, None
        if req.marker is not None:
            stdout, value, error = _answer(res, req.marker, timeout)
        return CallResult(exit_code=res.exit_code, stdout=stdout, stderr=res.stderr, value=value, error=error,
                          timed_out=res.timed_out, truncated=res.truncated,
                          duration=time.perf_counter() - started, wait_seconds=waited, sandbox=box.id)

    def take(self, digest: str, *, refill_after: float = 0.0) -> Sandbox | None:
        """A ready sandbox of image ``digest`` that is the caller's from now on, or None when none is
        ready.  The pool makes a new one ``refill_after`` seconds later: on a small host a start
        beside the caller's first command slows that command (create to first exit 76 ms p50
        with an immediate refill, 49 ms half a second later: bench/sandbox.py --sections sdk).  Ready sandboxes
        of another digest (the pool's ref has moved since they started) are destroyed, never
        handed out; the pool makes sandboxes of ``digest`` from then on (the ref has moved: the
        caller resolved it just now, the pool's creates may still see a cached resolve)."""
        while self._ready and not self._closed:
            box = self._ready.popleft()
            if refill_after > 0:
                asyncio.get_running_loop().call_later(refill_after, self._refill)
            else:
                self._refill()
            try:
                current = box.state.image_digest
            except SandboxError:
                current = None
            if current == digest:
                self._counts["taken"] += 1
                return box
            self._counts["stale"] += 1
            self._target = digest
            self._spawn(self._destroy(box))
        return None

    def stats(self) -> dict[str, Any]:
        return {"id": self.id, "ref": self.ref, "size": self.size, "ready": len(self._ready),
                "creating": self._creating, "busy": self._busy, "waiting": self._live_waiters(),
                **self._counts, "wait_seconds_total": round(self._wait_total, 6),
                "last_error": self._last_error, "closed": self._closed}

    async def close(self) -> None:
        """Fail waiting callers, destroy every sandbox this pool made and wait for background work.

        Raises :class:`FnCallError` naming the sandboxes that could not be destroyed.
        """
        self._closed = True
        self._changed.set()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(PoolClosed(f"warm pool {self.id} for {self.ref} closed while waiting"))
        while self._ready:
            self._spawn(self._destroy(self._ready.popleft()))
        await self.settle()
        if self._destroy_errors:
            errors, self._destroy_errors = self._destroy_errors, []
            raise FnCallError(f"warm pool {self.id}: could not destroy {len(errors)} sandbox(es): "
                              + "; ".join(errors) + " (manager.reconcile() cleans them up)")

    # -- internals ----------------------------------------------------------------------------------
    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _live_waiters(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    def _next_waiter(self) -> asyncio.Future[Sandbox] | None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                return waiter
        return None

    def _refill(self) -> None:
        # ready + in flight covers the waiting callers plus `size` spare
        if self._closed:
            return
        for _ in range(self.size + self._live_waiters() - len(self._ready) - self._creating):
            self._creating += 1
            self._spawn(self._create_one())

    def _hand_over(self, box: Sandbox) -> None:
        waiter = self._next_waiter()
        if waiter is not None:
            waiter.set_result(box)
        elif self._closed or len(self._ready) >= self.size:
            # surplus from a waiter that was cancelled: a pool holds at most `size` idle sandboxes
            self._spawn(self._destroy(box))
        else:
            self._ready.append(box)
            self._changed.set()

    async def _acquire(self) -> Sandbox:
        if self._ready:
            box = self._ready.popleft()
            # a replacement normally starts once this call's exec is over (_discard): a
            # creation running beside the exec competes with it for the event loop and
            # the CPU.  Taking the last ready one means the next caller would wait, so
            # refilling starts now.
            if not self._ready:
                self._refill()
            return box
        self._counts["misses"] += 1
        waiter: asyncio.Future[Sandbox] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._refill()
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._hand_over(waiter.result())  # it arrived as we were cancelled: keep it
            raise

    async def _create_one(self) -> None:
        try:
            async with self._admit(self._options) if self._admit is not None else contextlib.nullcontext():
                box = await self.manager.create(self._target or self.ref, self._options, name=self.ref)
            if self._warm is not None:
                try:
                    await asyncio.to_thread(box.exec, self._warm, timeout=30.0, keep_output=False)
                except Exception as exc:  # the sandbox is as good as it was: warm-up is only speed
                    log.info("warm pool %s: warm-up command in %s failed: %s", self.id, box.id, exc)
        except Exception as exc:
            self._creating -= 1
            self._counts["failures"] += 1
            self._last_error = f"{type(exc).__name__}: {exc}"
            self._changed.set()
            log.warning("warm pool %s: creating a sandbox of %s failed: %s", self.id, self.ref, exc)
            waiter = self._next_waiter()
            if waiter is not None:
                err = PoolCreateFailed(f"warm pool for {self.ref}: creating a sandbox failed: {self._last_error}")
                err.__cause__ = exc
                waiter.set_exception(err)
            return
        self._creating -= 1
        self._counts["created"] += 1
        self._hand_over(box)

    async def _discard(self, box: Sandbox, run: asyncio.Future[ExecResult]) -> None:
        try:
            await asyncio.wait([run])
            if not run.cancelled() and run.exception() is not None:
                log.info("warm pool %s: exec in %s failed: %s", self.id, box.id, run.exception())
        finally:
            self._refill()
        await self._destroy(box)

    def _not_busy(self, _: object) -> None:
        self._busy -= 1

    async def _destroy(self, box: Sandbox) -> None:
        try:
            await asyncio.to_thread(self.manager.destroy, box.id)
        except Exception as exc:
            log.warning("warm pool %s: destroying %s failed: %s", self.id, box.id, exc)
            self._destroy_errors.append(f"{box.id}: {type(exc).__name__}: {exc}")
            return
        self._counts["destroyed"] += 1


class FnCalls:
    """Warm pools keyed by owner and image ref, each created on first use with the same size and options.

    An owner (a project of the edge; ``""`` for the host's own callers) has at most ``max_pools``
    pools, so one owner keeping its pools busy never takes another's slots.  With ``admit``, every
    sandbox an owner's pool makes is admitted against the host's capacity (``admit(owner)``).  Its
    sandboxes carry the owner in ``layerbox.pool.project`` (whose pool made them) but are no
    sandboxes the owner can name: ready ones are the operator's, and the edge counts a call in
    flight, not a ready sandbox, against the owner's quota (so a pool's ready sandboxes never
    take a project's room to create).
    """

    def __init__(self, manager: SandboxManager, options: SandboxOptions | None = None, *, size: int = 2,
                 max_pools: int = 8, admit: Callable[[str], Admit] | None = None, **fields: Any) -> None:
        self.manager = manager
        self.size = size
        # every pool holds `size` sandboxes: callers naming ever new images must not grow the
        # host's sandbox count without bound
        self.max_pools = max_pools
        self._admit = admit
        self._options = options if options is not None else SandboxOptions(**fields)
        self._pools: dict[tuple[str, str], WarmPool] = {}  # least recently used first
        self._closed = False

    async def __aenter__(self) -> FnCalls:
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    def pool(self, image: str, owner: str = "") -> WarmPool:
        if self._closed:
            raise PoolClosed("FnCalls is closed")
        pool = self._pools.get((owner, image))
        if pool is None:
            options = self._options
            if owner:
                options = options.replace(labels={**options.labels, POOL_PROJECT_LABEL: owner})
            pool = self._pools[(owner, image)] = WarmPool(
                self.manager, image, options, size=self.size,
                admit=self._admit(owner) if self._admit is not None else None)
        return pool

    async def call(self, image: str, cmd: str | Sequence[str] | None = None, *, function: str | None = None,
                   entry: str | None = None, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
                   timeout: float = 30.0,  # noqa: ASYNC109  (bounds the exec inside the sandbox)
                   stdin: bytes | None = None, output_cap: int = 1 << 20, owner: str = "") -> CallResult:
        """:meth:`WarmPool.call` on ``owner``'s pool of ``image`` (the first call waits for its first
        sandbox).

        An ``image`` that does not resolve raises :class:`~sandbox.core.errors.ImageNotFound` at once,
        and no pool is made for it.
        """
        key = (owner, image)
        pool = self._pools.pop(key, None)
        if pool is not None:
            self._pools[key] = pool  # most recently used last
        else:
            await self._check_image(image)
            await self._make_room(owner)
            pool = self.pool(image, owner)
        return await pool.call(cmd, function=function, entry=entry, args=args, kwargs=kwargs,
                               timeout=timeout, stdin=stdin, output_cap=output_cap)

    async def _check_image(self, image: str) -> None:
        """Raise :class:`ImageNotFound` unless ``image`` resolves: a pool of a missing image would
        fail every creation, answer each call with a retryable error and hold a pool slot."""
        try:
            async with await self.manager.open_store() as store:
                await store.resolve(image)
        except (RefNotFound, ObjectNotFound) as exc:
            raise ImageNotFound(f"FnCall image {image!r} does not resolve: {exc}") from exc

    async def _make_room(self, owner: str) -> None:
        """Close ``owner``'s least recently used idle pools until a new one fits under ``max_pools``."""
        while len(mine := [key for key in self._pools if key[0] == owner]) >= self.max_pools:
            idle = next((key for key in mine
                         if not self._pools[key].stats()["busy"] and not self._pools[key].stats()["waiting"]), None)
            if idle is None:
                raise PoolsBusy(f"all {self.max_pools} warm pools{f' of {owner}' if owner else ''} have calls "
                                "running; retry shortly or raise max_pools")
            await self._pools.pop(idle).close()

    def stats(self) -> dict[str, dict[str, Any]]:
        return {f"{owner}/{ref}" if owner else ref: pool.stats() for (owner, ref), pool in self._pools.items()}

    async def close(self) -> None:
        self._closed = True
        results = await asyncio.gather(*(p.close() for p in self._pools.values()), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise FnCallError("closing warm pools: " + "; ".join(str(e) for e in errors)) from errors[0]


# -- latency measurement (shared with bench/) ----------------------------------------------------------
def _percentile(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _summary(samples: Sequence[float]) -> dict[str, float]:
    return {"n": len(samples), "p50": _percentile(samples, 0.50), "p99": _percentile(samples, 0.99),
            "min": min(samples), "max": max(samples)}


TRIVIAL_FUNCTION = "def f(x):\n    return x + 1\n"


async def measure(manager: SandboxManager, ref: str, *, calls: int = 30, size: int = 2,
                  **fields: Any) -> dict[str, Any]:
    """Call latency in seconds of ``true`` and of a trivial function on a warm pool of ``ref``.

    ``warm``: the pool is refilled before each call (the latency a caller sees
    when calls are spaced out).  ``back_to_back``: calls follow each other at
    once, so refills compete with calls and the pool can run dry (sustained rate).
    ``create``: cold ``manager.create`` times of the pool's first sandboxes.
    """
    out: dict[str, Any] = {"ref": ref, "size": size, "calls": calls}
    started = time.perf_counter()
    async with WarmPool(manager, ref, size=size, **fields) as pool:
        out["start_seconds"] = time.perf_counter() - started
        kinds: dict[str, dict[str, Any]] = {"true": {"cmd": ["true"]},
                                            "function": {"function": TRIVIAL_FUNCTION, "args": [41]}}
        for name, kw in kinds.items():
            for mode in ("warm", "back_to_back"):
                durations, waits = [], []
                for _ in range(calls):
                    if mode == "warm":
                        await pool.settle()
                    res = await pool.call(**kw)
                    if res.exit_code != 0 or res.error is not None:
                        raise FnCallError(f"measure: {name} call failed: exit {res.exit_code}, {res.error}, "
                                          f"{res.stderr[-500:]!r}")
                    durations.append(res.duration)
                    waits.append(res.wait_seconds)
                out[f"{name}_{mode}"] = {**_summary(durations), "wait_p50": _percentile(waits, 0.5)}
        out["stats"] = pool.stats()
    return out
