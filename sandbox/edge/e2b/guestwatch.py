"""envd's directory watch on a microVM: the guest kernel's inotify, read by a child of the guest agent.

The agent's WATCH (docs/FORMAT.md Part 5; protocol 3) forks a child that drops to the
caller's account, watches the directory (and, recursive, each one under it, following those
made later and telling what they held as created, as a container's watch does), and writes
the kernel's events to its stdout as records; the host reads them on a thread of the watch's
own and hands them to the loop.  The child's stdout is a pipe through the agent's connection,
so a watch nobody reads holds the guest's events in the guest (its kernel's queue is bounded:
an overflow ends the watch with RESOURCE_EXHAUSTED, as at most :data:`MAX_EVENTS` unread
events here do).

A poll (``GetWatcherEvents``) first *settles*: a byte to the child's stdin, answered by a
``sync`` record only after every event the guest's kernel queued before it; so a change made
before the poll is in its answer, as with a container's watch.

The child is not one of the sandbox's commands: no ``exec`` receipt, not counted against its
commands, killed when the watch ends (and with its sandbox).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import struct
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.filesystem import filesystem_pb as pb

from sandbox.backends.base import account
from sandbox.backends.vm.agent import AgentError, GuestProcess
from sandbox.backends.vm.files import GuestFiles
from sandbox.core.errors import InvalidField, SandboxStateError

from .guestfs import OP_TIMEOUT, Guest
from .inotify import MAX_EVENTS, kinds, take_events

RECORD = struct.Struct(">II")  # mask (0: the watch's own record), the name's length; then the name
MAX_NAME = 4096 * 2  # a relative path under the watched directory, at most
SETTLE_SECONDS = 30.0  # a poll waits this long for the guest's sync at most, then answers what it has
STDERR_LIMIT = 4096


class GuestWatch:
    """One watch in a microVM, the interface of :class:`.files.Watch`."""

    def __init__(self, sid: str, guest: Guest, path: str, recursive: bool, include_entry: bool,
                 describe: Callable[[str], Awaitable[pb.EntryInfo | None]]) -> None:
        """``describe(path)``: the entry at ``path`` now, or None (for ``include_entry``)."""
        self.sid, self.guest, self.path = sid, guest, path
        self.recursive, self.include_entry, self.describe = recursive, include_entry, describe
        self.events: deque[tuple[str, pb.EventType]] = deque()
        self.failed: ConnectError | None = None
        self.wake = asyncio.Event()
        self.polled = time.monotonic()
        self.closed = False
        self._loop = asyncio.get_running_loop()
        self._proc: GuestProcess | None = None
        self._ready: asyncio.Future[None] = self._loop.create_future()
        self._ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # a start given up on: no warning
        self._syncs: deque[asyncio.Future[None]] = deque()

    async def start(self) -> None:
        """The child runs and watches every directory; its error (the path's) otherwise."""
        g = self.guest
        files = g.box.files
        if not isinstance(files, GuestFiles):
            raise SandboxStateError(f"sandbox {self.sid} is not a VM's: its watch is not the guest's")

        def spawn() -> GuestProcess:
            uid, gid, _ = account(files, g.user)
            return files.watch_dir(self.path, recursive=self.recursive, uid=uid, gid=gid)

        try:
            self._proc = await g.ctx.files(g.project, spawn)
        except AgentError as exc:
            raise SandboxStateError(f"sandbox {self.sid}: its guest agent: {exc}") from None
        threading.Thread(target=self._read, args=(self._proc,), daemon=True,
                         name=f"layerbox-watch-{self.sid}").start()
        try:
            async with asyncio.timeout(OP_TIMEOUT):
                await asyncio.shield(self._ready)
        except BaseException:
            self.close()
            raise

    # -- the reader thread -------------------------------------------------------------------------------
    def _read(self, proc: GuestProcess) -> None:
        try:
            while head := _exactly(proc.stdout.read, RECORD.size):
                mask, length = RECORD.unpack(head)
                if length > MAX_NAME:
                    break  # not the agent's: the guest broke the format (the watch ends)
                name = _exactly(proc.stdout.read, length).decode(errors="surrogateescape")
                self._soon(self._record, mask, name)
        except OSError:
            pass
        try:
            code = proc.wait(10.0)
        except TimeoutError:
            proc.kill()
            code = errno.EPROTO
        message = proc.stderr.read(STDERR_LIMIT).decode(errors="replace").strip()
        proc.stdout.close()
        proc.stderr.close()
        self._soon(self._ended, code, message)

    def _soon(self, fn: Callable[..., None], *args: object) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed (the edge stopped)
            self._loop.call_soon_threadsafe(fn, *args)

    # -- the loop's side ---------------------------------------------------------------------------------
    def _record(self, mask: int, name: str) -> None:
        if mask == 0:
            if name == "ready" and not self._ready.done():
                self._ready.set_result(None)
            elif name == "sync" and self._syncs:
                future = self._syncs.popleft()
                if not future.done():
                    future.set_result(None)
            return
        for kind in kinds(mask):
            if len(self.events) >= MAX_EVENTS:
                self._fail(Code.RESOURCE_EXHAUSTED, f"watcher: more than {MAX_EVENTS} events unread")
                return
            self.events.append((name, kind))
        self.wake.set()

    def _ended(self, code: int, message: str) -> None:
        if not self._ready.done():  # it never watched: the path's error
            self._ready.set_exception(_start_error(self.path, code, message))
        elif code == 0:
            self._fail(Code.NOT_FOUND, f"watcher: {self.path} is gone (removed, or the sandbox ended)")
        elif code in (errno.EOVERFLOW, errno.E2BIG):
            self._fail(Code.RESOURCE_EXHAUSTED, f"watcher: {message or os.strerror(code)}")
        else:
            self._fail(Code.UNAVAILABLE if code == 255 else Code.INTERNAL, f"watcher: {message or f'exit {code}'}")
        for future in self._syncs:
            if not future.done():
                future.set_result(None)
        self._syncs.clear()

    def _fail(self, code: Code, message: str) -> None:
        if self.failed is None and not self.closed:
            self.failed = ConnectError(code, message)
        self.wake.set()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.wake.set()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            # a request to the agent, which waits while the guest does not read: never on the loop
            threading.Thread(target=proc.kill, daemon=True, name=f"layerbox-unwatch-{self.sid}").start()

    async def settle(self) -> None:
        """Every event the guest's kernel queued before now, read (at most SETTLE_SECONDS)."""
        proc = self._proc
        if proc is None or proc.stdin is None or self.failed is not None or self.closed:
            return
        future: asyncio.Future[None] = self._loop.create_future()
        self._syncs.append(future)
        try:
            proc.stdin.write(b"s")  # one byte to a pipe: never blocks (the child reads them all)
        except OSError:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(SETTLE_SECONDS):
                await future

    async def take(self) -> list[pb.FilesystemEvent]:
        """The events so far (with their entries when asked), or the error that ended the watch."""
        taken = take_events(self.events, self.wake, self.failed)
        out = []
        for name, kind in taken:
            entry = None
            if self.include_entry and kind in (pb.EventType.CREATE, pb.EventType.WRITE, pb.EventType.CHMOD):
                entry = await self.describe(f"{self.path.rstrip('/')}/{name}" if name else self.path)
            out.append(pb.FilesystemEvent(name=name, type=kind, entry=entry))
        return out


def _exactly(read: Callable[[int], bytes | None], n: int) -> bytes:
    """``n`` bytes of a pipe, or b"" at its end (a record cut short counts as its end)."""
    out = b""
    while len(out) < n:
        got = read(n - len(out))
        if not got:
            return b""
        out += got
    return out


def _start_error(path: str, code: int, message: str) -> Exception:
    """Why the guest could not watch ``path`` (its exit status is the errno)."""
    if code == errno.ENOTDIR:
        return InvalidField("path", f"path {path} not a directory")
    if code in (errno.EOVERFLOW, errno.E2BIG):
        return ConnectError(Code.RESOURCE_EXHAUSTED, f"watcher: {message}")
    if 0 < code < 200:
        return OSError(code, message or f"{path}: {os.strerror(code)}", path)
    return SandboxStateError(f"sandbox's guest could not watch {path}: {message or f'exit {code}'}")
