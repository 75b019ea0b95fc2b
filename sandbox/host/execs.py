"""Running one command in a sandbox: stream its output, enforce its cap and timeout, kill its tree.

``crun exec`` runs the command; :func:`pump` moves its stdin and output while
it runs (output past the cap is still read, so the command never blocks on a
full pipe, and hashed, but dropped: a :class:`Cut` says where and how much, and
with ``keep="tail"`` the last bytes follow it once the command ends);
:func:`kill_tree` ends a command that
timed out or was cancelled together with every descendant and every orphan it
left to the sandbox's init, with the sandbox frozen so nothing forks away.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import os
import selectors
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import blake3

from sandbox.backends.container.runtime import OciRuntime
from sandbox.core.errors import RuntimeFailed

READ_CHUNK = 64 << 10
# Output kept in the receipt of a command with an idempotency key, so a retry gets it back.
KEYED_OUTPUT_CAP = 256 << 10
STREAMS = ("stdout", "stderr")


@dataclass(frozen=True)
class Cut:
    """Where a stream's delivered output skips some of the command's: ``offset`` bytes of the
    stream were delivered before the cut, and ``dropped`` bytes of output are missing there."""

    stream: str  # "stdout" or "stderr"
    offset: int
    dropped: int

    def to_json(self) -> dict[str, Any]:
        return {"stream": self.stream, "offset": self.offset, "dropped_bytes": self.dropped}


@dataclass(frozen=True)
class ExecResult:
    exit_code: int | None  # crun's exit status; 128+N when signal N ended the process
    signal: int | None
    stdout: bytes
    stderr: bytes
    truncated: bool  # output beyond output_cap was read and dropped
    duration: float
    timed_out: bool = False
    oom_killed: bool = False
    interrupted: str | None = None  # "preempt", "disconnect", "shutdown", "killed", "destroy", "restart"
    replayed: bool = False  # answered from the receipt of an earlier run with the same idempotency key
    cuts: tuple[Cut, ...] = ()  # where the streamed output skipped bytes (at most one per stream)


class Cancel(threading.Event):
    """Set it (with a reason) to stop a running exec: its process tree is killed."""

    reason = "cancelled"

    def cancel(self, reason: str) -> None:
        self.reason = reason
        self.set()


class Attach(Protocol):
    """How a command outlives its request: a stdin its owner keeps open, or a terminal.

    ``sandbox.edge.commands`` implements it for background commands and terminal
    sessions; :meth:`Sandbox.exec <sandbox.host.manager.Sandbox.exec>` calls it from the
    exec's thread, in this order: :meth:`started` (for the ``exec_started`` receipt),
    :meth:`spawned`, :meth:`on_terminal` (with a terminal only), :meth:`finished` (for
    the ``exec`` receipt).
    """

    @property
    def terminal(self) -> tuple[int, int] | None:
        """``(cols, rows)``: run on a pty crun makes inside the sandbox; None: on pipes."""

    @property
    def stdin_fd(self) -> int | None:
        """Without a terminal: the descriptor crun's stdin reads (a pipe's read end); None: /dev/null."""

    def started(self) -> Mapping[str, Any]:
        """Fields added to the ``exec_started`` receipt written before the command runs."""

    def spawned(self) -> None:
        """crun exec runs (or failed to start): its stdin is its own now."""

    def on_terminal(self, master: int) -> None:
        """The pty's master, a descriptor of the callee's own to close (the exec reads another one)."""

    def finished(self) -> Mapping[str, Any]:
        """Fields added to the command's ``exec`` receipt (what its input was)."""


def replay(rec: Mapping[str, Any]) -> ExecResult:
    """The result an earlier run under the same idempotency key recorded.

    Its output is what the receipt kept (the first or, with ``keep: "tail"``, the last
    KEYED_OUTPUT_CAP bytes per stream); ``cuts`` say what of the recorded total is missing."""
    if rec["action"] == "exec_started":  # the manager died or the job was preempted mid-command
        return ExecResult(None, None, b"", b"", False, 0.0, interrupted="unknown", replayed=True)
    out = {name: base64.b64decode(rec.get(name, "")) for name in STREAMS}
    cuts = []
    for name in STREAMS:
        total, kept = int(rec.get(f"{name}_bytes", 0) or 0), len(out[name])
        if total > kept:
            cuts.append(Cut(name, 0 if rec.get("keep") == "tail" else kept, total - kept))
    return ExecResult(rec.get("exit_code"), rec.get("signal"), out["stdout"], out["stderr"],
                      bool(rec.get("truncated")) or rec.get("stdout_bytes", 0) > KEYED_OUTPUT_CAP
                      or rec.get("stderr_bytes", 0) > KEYED_OUTPUT_CAP,
                      float(rec.get("duration", 0.0)), bool(rec.get("timed_out")), bool(rec.get("oom_killed")),
                      rec.get("interrupted"), replayed=True, cuts=tuple(cuts))


def was_interrupted(rec: Mapping[str, Any]) -> bool:
    """Whether a keyed command's record is of a run cut short (preemption, restart, shutdown,
    disconnect, or a start with no end), not of one that completed (whatever its exit)."""
    return rec["action"] == "exec_started" or rec.get("interrupted") is not None


# -- /proc -------------------------------------------------------------------------------------------
def proc_stat(pid: int) -> tuple[int, int] | None:
    """(ppid, starttime ticks) of ``pid``, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), int(fields[19])


def process_table() -> dict[int, tuple[int, int]]:
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = proc_stat(int(name))
            if st is not None:
                table[int(name)] = st
    return table


def descendants(roots: set[int], table: Mapping[int, tuple[int, int]]) -> set[int]:
    found = set(r for r in roots if r in table)
    grew = True
    while grew:
        more = {pid for pid, (ppid, _) in table.items() if ppid in found and pid not in found}
        found |= more
        grew = bool(more)
    return found


# -- killing -----------------------------------------------------------------------------------------
def kill_tree(runtime: OciRuntime, sid: str, init: int, root: int, since: int) -> None:
    """SIGKILL ``root``'s process tree and the orphans started since ``since`` (clock ticks) that
    were reparented to ``init``, with the sandbox frozen (killed tasks only die once thawed).

    The container may be deleted under it (a destroy cancels its commands and then deletes
    the container): a thaw that finds no container has nothing left to thaw.
    """
    frozen = False
    try:
        with contextlib.suppress(RuntimeFailed):
            runtime.pause(sid)
            frozen = True
        for _ in range(5):
            table = process_table()
            orphans = {pid for pid, (ppid, start) in table.items() if ppid == init and start >= since}
            victims = descendants({root} | orphans, table) - {init}
            if not victims:
                break
            for pid in victims:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if frozen:
                _thaw(runtime, sid)
                frozen = False
            time.sleep(0.05)
            with contextlib.suppress(RuntimeFailed):
                runtime.pause(sid)
                frozen = True
    finally:
        if frozen:
            _thaw(runtime, sid)


def _thaw(runtime: OciRuntime, sid: str) -> None:
    try:
        runtime.resume(sid)
    except RuntimeFailed:
        if (runtime.state(sid) or {}).get("status") == "paused":  # still there, still frozen: a fault
            raise


# -- streaming ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pumped:
    stdout: bytes
    stderr: bytes
    truncated: bool
    digests: tuple[str, str]  # blake3 of everything each stream carried
    sizes: tuple[int, int]
    timed_out: bool
    cuts: tuple[Cut, ...] = ()


class Tail:
    """The last ``limit`` bytes of a stream, as chunks: memory stays at ``limit`` however much comes."""

    def __init__(self, limit: int) -> None:
        self.limit = max(0, limit)
        self.chunks: deque[bytes] = deque()
        self.size = 0

    def add(self, data: bytes) -> None:
        if not self.limit or not data:
            return
        data = data[-self.limit:]
        self.chunks.append(data)
        self.size += len(data)
        while self.size > self.limit:
            extra = self.size - self.limit
            if len(self.chunks[0]) <= extra:
                self.size -= len(self.chunks.popleft())
            else:
                self.chunks[0] = self.chunks[0][extra:]
                self.size -= extra

    def __bytes__(self) -> bytes:
        return b"".join(self.chunks)


def pump(proc: subprocess.Popen[bytes], stdin: bytes | None, *, cap: int, keep: int, timeout: float | None,
         on_stdout: Callable[[bytes], None] | None, on_stderr: Callable[[bytes], None] | None,
         cancel: Cancel, kill: Callable[[], bool], tail: bool = False,
         on_cut: Callable[[Cut], None] | None = None,
         tty: int | None = None) -> Pumped:
    """Feed ``stdin``, read both streams until the command and its pipes are done.

    Callbacks get the first ``cap`` bytes per stream as they come; ``keep`` bytes per
    stream are kept for the result (the first ones, or the last with ``tail``; a caller
    that streams keeps only what a receipt needs).  When a stream had more than its
    callback got, ``on_cut`` hears where and how much once the command has ended; with
    ``tail`` the stream's last ``cap`` bytes (after the first ``cap``) are held in a
    bounded ring meanwhile and handed to the callback after that cut, so the stream
    ends with the command's last output.  Nothing is ever dropped silently.
    On ``timeout`` or ``cancel``, ``kill()`` is called until it reports the
    command's tree killed: the command's pid is known only once crun has written
    it, so until then (a cancel right after the start, a loaded host) it keeps
    trying, and after 5 s without one crun exec itself is killed.

    ``tty``: a pty master (the caller closes it) whose output counts as stdout; it
    ends with EIO once no process holds the terminal.  The descriptor may be
    non-blocking (its owner also writes the terminal's input to it).
    """
    assert proc.stdout is not None
    assert proc.stderr is not None
    bufs = [bytearray(), bytearray()]
    last = [Tail(keep if tail else 0), Tail(keep if tail else 0)]  # the result's bytes with tail
    rings = [Tail(cap if tail and on_stdout else 0), Tail(cap if tail and on_stderr else 0)]
    hashes = [blake3.blake3(), blake3.blake3()]
    sizes = [0, 0]
    sent = [0, 0]
    callbacks = [on_stdout, on_stderr]
    truncated = False
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, 0)
    sel.register(proc.stderr, selectors.EVENT_READ, 1)
    if tty is not None:
        sel.register(tty, selectors.EVENT_READ, 0)
    pending = memoryview(stdin or b"")
    if proc.stdin is not None:
        os.set_blocking(proc.stdin.fileno(), False)
        if pending:
            sel.register(proc.stdin, selectors.EVENT_WRITE, 2)
        else:
            proc.stdin.close()
    deadline = time.monotonic() + timeout if timeout is not None else None
    exited_at: float | None = None
    kill_since: float | None = None  # when a cancel or the timeout asked for the kill
    timed_out = killed = False
    try:
        while sel.get_map():
            now = time.monotonic()
            if not killed and kill_since is None:
                if cancel.is_set():
                    kill_since = now
                elif deadline is not None and now >= deadline:
                    timed_out, kill_since = True, now
            if not killed and kill_since is not None:
                if kill() or proc.poll() is not None or now - kill_since > 5.0:
                    if proc.poll() is None and now - kill_since > 5.0:
                        proc.kill()
                    killed = True
                    deadline = now + 5.0  # then give up on crun exec itself
            elif killed and deadline is not None and now >= deadline:
                break
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > 1.0:
                break  # background processes still hold the pipes: stop reading them
            wait = 0.2 if deadline is None else max(0.0, min(0.2, deadline - now))
            if kill_since is not None and not killed:
                wait = 0.01
            for key, _ in sel.select(wait):
                idx = key.data
                if idx == 2:
                    assert proc.stdin is not None
                    try:
                        n = os.write(proc.stdin.fileno(), pending[:READ_CHUNK])
                    except BrokenPipeError:
                        n = len(pending)
                    pending = pending[n:]
                    if not pending:
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                try:
                    data = os.read(key.fd, READ_CHUNK)
                except BlockingIOError:  # a non-blocking pty master with nothing after all
                    continue
                except OSError as exc:
                    if key.fd != tty or exc.errno != errno.EIO:
                        raise
                    data = b""  # the terminal's last holder closed it
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                sizes[idx] += len(data)
                hashes[idx].update(data)
                if sizes[idx] > cap:
                    truncated = True
                if tail:
                    last[idx].add(data)
                else:
                    room = keep - len(bufs[idx])
                    if room > 0:
                        bufs[idx] += data[:room]
                cb = callbacks[idx]
                streamable = max(0, cap - sent[idx])
                if cb is not None and streamable > 0:
                    sent[idx] += min(streamable, len(data))
                    cb(data[:streamable])
                if len(data) > streamable:
                    rings[idx].add(data[streamable:])
    finally:
        sel.close()
        for f in (proc.stdout, proc.stderr, proc.stdin):
            if f is not None and not f.closed:
                f.close()
    cuts = []
    for idx, name in enumerate(STREAMS):
        rest = sizes[idx] - min(sizes[idx], cap)  # what came after the first cap bytes
        held = min(rest, cap) if tail else 0
        if rest > held:
            cuts.append(Cut(name, min(sizes[idx], cap), rest - held))
            if on_cut is not None and not cancel.is_set():
                on_cut(cuts[-1])
        cb = callbacks[idx]
        if cb is not None and rings[idx].size:
            for chunk in rings[idx].chunks:
                cb(chunk)
    if tail:
        bufs = [bytearray(bytes(last[0])), bytearray(bytes(last[1]))]
    return Pumped(bytes(bufs[0]), bytes(bufs[1]), truncated, (hashes[0].hexdigest(), hashes[1].hexdigest()),
                  (sizes[0], sizes[1]), timed_out, tuple(cuts))
