"""Running one command in a sandbox: admission, idempotency, streaming, caps, timeouts, receipts.

:class:`ExecRunner` is the manager's side of every command, whatever backend runs it: it
admits the command (the sandbox runs, its job admits, its idempotency key is not in use),
answers a keyed command that already ran from its receipt, asks the backend to ``spawn``
it, pumps its output (:class:`Pump`: output past the cap is still read, so the command
never blocks on a full pipe, and hashed, but dropped; a :class:`Cut` says where and how
much, and with ``keep="tail"`` the last bytes follow it once the command ends), kills its
tree on a timeout or a cancel, and writes its ``exec`` receipt with what the sandbox's
cgroup and network saw meanwhile.
"""

from __future__ import annotations

import base64
import errno
import os
import selectors
import signal
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import blake3

from sandbox.backends.base import Attach, Process, account
from sandbox.core.errors import CommandInProgress, JobNotAdmitting, SandboxStateError
from sandbox.core.model import ExecRequest, SandboxState
from sandbox.isolation.network import diff_counters

if TYPE_CHECKING:
    from sandbox.host.sandbox import Sandbox

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


class _Stream:
    """One output stream of a command: what its callback got, what the result keeps, and what
    was cut.  ``cap`` bytes go to the callback as they come; ``keep`` bytes are kept for the
    result (the first ones, or with ``tail`` the last); with ``tail`` the stream's last ``cap``
    bytes past the first ``cap`` are held in a bounded ring and handed over after the cut."""

    def __init__(self, name: str, *, cap: int, keep: int, tail: bool,
                 callback: Callable[[bytes], None] | None) -> None:
        self.name, self.cap, self.keep, self.tail, self.callback = name, cap, keep, tail, callback
        self.head = bytearray()  # the result's bytes without tail
        self.last = Tail(keep if tail else 0)  # the result's bytes with tail
        self.ring = Tail(cap if tail and callback else 0)
        self.hash = blake3.blake3()
        self.size = 0
        self.sent = 0

    def take(self, data: bytes) -> None:
        self.size += len(data)
        self.hash.update(data)
        if self.tail:
            self.last.add(data)
        else:
            room = self.keep - len(self.head)
            if room > 0:
                self.head += data[:room]
        streamable = max(0, self.cap - self.sent)
        if self.callback is not None and streamable > 0:
            self.sent += min(streamable, len(data))
            self.callback(data[:streamable])
        if len(data) > streamable:
            self.ring.add(data[streamable:])

    @property
    def truncated(self) -> bool:
        return self.size > self.cap

    def finish(self, on_cut: Callable[[Cut], None] | None, cancelled: bool) -> Cut | None:
        """Where the delivered stream skipped output (told to ``on_cut``), then the held tail."""
        rest = self.size - min(self.size, self.cap)  # what came after the first cap bytes
        held = min(rest, self.cap) if self.tail else 0
        cut = None
        if rest > held:
            cut = Cut(self.name, min(self.size, self.cap), rest - held)
            if on_cut is not None and not cancelled:
                on_cut(cut)
        if self.callback is not None and self.ring.size:
            for chunk in self.ring.chunks:
                self.callback(chunk)
        return cut

    def result(self) -> bytes:
        return bytes(self.last) if self.tail else bytes(self.head)


class Pump:
    """Feed one command's stdin and read both its streams until it and its pipes are done.

    On ``timeout`` or ``cancel`` the process's tree is killed (``kill_tree``, asked again until it
    reports the tree killed: the command's pid is known only once its runner has written it, so
    until then (a cancel right after the start, a loaded host) it keeps trying, and after 5 s
    without one the runner itself is killed).  A terminal's master (``proc.tty``) counts as
    stdout; it ends with EIO once no process holds the terminal.  Nothing is dropped silently.
    """

    KILL_GRACE = 5.0  # seconds kill_tree may keep failing before the runner itself is killed
    LINGER = 1.0  # seconds the pipes are read after the command exited (background processes hold them)

    def __init__(self, proc: Process, stdin: bytes | None, *, cap: int, keep: int, timeout: float | None,
                 on_stdout: Callable[[bytes], None] | None, on_stderr: Callable[[bytes], None] | None,
                 cancel: Cancel, tail: bool = False, on_cut: Callable[[Cut], None] | None = None) -> None:
        self.proc, self.cancel, self.on_cut = proc, cancel, on_cut
        self.streams = (_Stream("stdout", cap=cap, keep=keep, tail=tail, callback=on_stdout),
                        _Stream("stderr", cap=cap, keep=keep, tail=tail, callback=on_stderr))
        self.pending = memoryview(stdin or b"")
        self.deadline = time.monotonic() + timeout if timeout is not None else None
        self.exited_at: float | None = None
        self.kill_since: float | None = None  # when a cancel or the timeout asked for the kill
        self.timed_out = self.killed = False
        self.sel = selectors.DefaultSelector()

    def run(self) -> Pumped:
        self._register()
        try:
            while self.sel.get_map() and self._tick(time.monotonic()):
                for key, _ in self.sel.select(self._wait(time.monotonic())):
                    if key.data == 2:
                        self._feed()
                    else:
                        self._read(key)
        finally:
            self.sel.close()
            for f in (self.proc.stdout, self.proc.stderr, self.proc.stdin):
                if f is not None and not f.closed:
                    f.close()
        cuts = [cut for s in self.streams if (cut := s.finish(self.on_cut, self.cancel.is_set())) is not None]
        out, err = self.streams
        return Pumped(out.result(), err.result(), out.truncated or err.truncated,
                      (out.hash.hexdigest(), err.hash.hexdigest()), (out.size, err.size), self.timed_out, tuple(cuts))

    def _register(self) -> None:
        proc = self.proc
        self.sel.register(proc.stdout, selectors.EVENT_READ, 0)
        self.sel.register(proc.stderr, selectors.EVENT_READ, 1)
        if proc.tty is not None:
            self.sel.register(proc.tty, selectors.EVENT_READ, 0)
        if proc.stdin is not None:
            os.set_blocking(proc.stdin.fileno(), False)
            if self.pending:
                self.sel.register(proc.stdin, selectors.EVENT_WRITE, 2)
            else:
                proc.stdin.close()

    def _tick(self, now: float) -> bool:
        """Ask for the kill when it is due, give up on the runner when it does not go; False: stop reading."""
        if not self.killed and self.kill_since is None:
            if self.cancel.is_set():
                self.kill_since = now
            elif self.deadline is not None and now >= self.deadline:
                self.timed_out, self.kill_since = True, now
        if not self.killed and self.kill_since is not None:
            late = now - self.kill_since > self.KILL_GRACE
            if self.proc.kill_tree() or self.proc.poll() is not None or late:
                if self.proc.poll() is None and late:
                    self.proc.kill()
                self.killed = True
                self.deadline = now + self.KILL_GRACE  # then give up on the runner itself
        elif self.killed and self.deadline is not None and now >= self.deadline:
            return False
        if self.exited_at is None and self.proc.poll() is not None:
            self.exited_at = now
        return self.exited_at is None or now - self.exited_at <= self.LINGER

    def _wait(self, now: float) -> float:
        if self.kill_since is not None and not self.killed:
            return 0.01
        return 0.2 if self.deadline is None else max(0.0, min(0.2, self.deadline - now))

    def _feed(self) -> None:
        stdin = self.proc.stdin
        assert stdin is not None
        try:
            n = os.write(stdin.fileno(), self.pending[:READ_CHUNK])
        except BrokenPipeError:
            n = len(self.pending)
        self.pending = self.pending[n:]
        if not self.pending:
            self.sel.unregister(stdin)
            stdin.close()

    def _read(self, key: selectors.SelectorKey) -> None:
        try:
            data = os.read(key.fd, READ_CHUNK)
        except BlockingIOError:  # a non-blocking pty master with nothing after all
            return
        except OSError as exc:
            if key.fd != self.proc.tty or exc.errno != errno.EIO:
                raise
            data = b""  # the terminal's last holder closed it
        if not data:
            self.sel.unregister(key.fileobj)
            return
        self.streams[key.data].take(data)


# what an exec_started receipt says that the receipt of a command a crash interrupted repeats
CARRIED = ("idempotency_key", "background", "command_id", "tty")
EXEC_PREFIX = "exec-"


class ExecRunner:
    """The commands running in one manager's sandboxes: their admission against preemption, their
    idempotency keys, and a cancel for each (a destroy, a preemption, a stop end them)."""

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock  # the manager's state lock: admission and registration are one step
        self._running: dict[str, dict[str, Cancel]] = {}  # sandbox -> tag -> its cancel
        self._keys: set[tuple[str, str]] = set()  # (sandbox, idempotency key) of commands running
        self._seq = 0

    def inflight(self, sid: str) -> int:
        with self._lock:
            return len(self._running.get(sid, {}))

    def cancel(self, sid: str, reason: str) -> None:
        """Stop every running command of ``sid``; each caller learns ``reason`` (``interrupted``)."""
        with self._lock:
            for cancel in self._running.get(sid, {}).values():
                cancel.cancel(reason)

    def run(self, box: Sandbox, req: ExecRequest, *, on_stdout: Callable[[bytes], None] | None = None,
            on_stderr: Callable[[bytes], None] | None = None, cancel: Cancel | None = None,
            keep_output: bool = True, on_cut: Callable[[Cut], None] | None = None,
            attach: Attach | None = None) -> ExecResult:
        """:meth:`Sandbox.exec <sandbox.host.sandbox.Sandbox.exec>`: admit, replay or run, record."""
        cancel = cancel or Cancel()
        tag = self._tag()
        st, earlier = self._admit(box, req, tag, cancel)
        if earlier is not None:
            _replay_to(earlier, on_stdout, on_stderr, on_cut)
            return earlier
        try:
            if req.idempotency_key is not None or attach is not None:
                # a crash during the command leaves this behind: a retry then learns it was interrupted,
                # and reconcile finds the key of the exec files named ``tag`` (not by the command's text:
                # the same command may run with and without a key), or that it ran in the background
                box.receipt("exec_started", command=req.argv,
                            **({"idempotency_key": req.idempotency_key} if req.idempotency_key else {}),
                            tag=tag, **(attach.started() if attach is not None else {}))
            return self._execute(box, st, req, tag, on_stdout, on_stderr, cancel, keep_output, on_cut, attach)
        finally:
            with self._lock:
                running = self._running.get(box.id, {})
                running.pop(tag, None)
                if not running:
                    self._running.pop(box.id, None)
                if req.idempotency_key is not None:
                    self._keys.discard((box.id, req.idempotency_key))

    def _tag(self) -> str:
        with self._lock:
            self._seq += 1
            return f"{EXEC_PREFIX}{os.getpid()}-{self._seq}-{uuid.uuid4().hex[:6]}"

    def _admit(self, box: Sandbox, req: ExecRequest, tag: str, cancel: Cancel
               ) -> tuple[SandboxState, ExecResult | None]:
        """Under one lock: preemption either sees this command or refuses it."""
        key = req.idempotency_key
        with self._lock:
            st = box.state
            if st.status != "running":
                raise SandboxStateError(f"sandbox {box.id} is {st.status}, not running")
            if not st.admitting:
                raise JobNotAdmitting(f"sandbox {box.id}: job {st.job!r} is being preempted; "
                                      "retry after it is resumed")
            if key is not None:
                if (box.id, key) in self._keys:
                    raise CommandInProgress(f"sandbox {box.id}: a command with idempotency key "
                                            f"{key!r} is still running")
                rec = box.manager.receipt_logs.keyed(box.id, key)
                if rec is not None and not (req.rerun_if_interrupted and was_interrupted(rec)):
                    return st, replay(rec)
                self._keys.add((box.id, key))
            self._running.setdefault(box.id, {})[tag] = cancel
        return st, None

    def _execute(self, box: Sandbox, st: SandboxState, req: ExecRequest, tag: str,
                 on_stdout: Callable[[bytes], None] | None, on_stderr: Callable[[bytes], None] | None,
                 cancel: Cancel, keep_output: bool, on_cut: Callable[[Cut], None] | None,
                 attach: Attach | None) -> ExecResult:
        workdir = req.cwd or st.cwd
        span = _Span.begin(box, st)
        started = time.perf_counter()
        uid, gid, env = st.uid, st.gid, {**st.env, **req.env}
        if req.user is not None:
            uid, gid, home = account(box.files, req.user)
            env = {**st.env, "HOME": home, "USER": req.user.partition(":")[0], **req.env}
            workdir = req.cwd or (home if st.cwd == "/" else st.cwd)
        proc = box.backend.spawn(box, st, req.argv, env=env, cwd=workdir, uid=uid,
                                 gid=gid, tag=tag, input_pipe=req.stdin is not None and attach is None,
                                 attach=attach)
        keep = req.output_cap if keep_output else (KEYED_OUTPUT_CAP if req.idempotency_key else 0)
        try:
            out = Pump(proc, req.stdin if attach is None else None, cap=req.output_cap,
                       keep=min(keep, req.output_cap), timeout=req.timeout, on_stdout=on_stdout,
                       on_stderr=on_stderr, cancel=cancel, tail=req.keep == "tail", on_cut=on_cut).run()
        finally:
            rc = proc.finish()
        more = {**proc.receipt(), **(attach.finished() if attach is not None else {})}
        return _record(box, st, req, workdir, out, rc, time.perf_counter() - started, cancel,
                       proc.oom_killed(), span, more)


@dataclass(frozen=True)
class _Span:
    """What the sandbox's cgroup and network said when a command started."""

    cpu: float | None
    egress: Mapping[str, Any] | None

    @classmethod
    def begin(cls, box: Sandbox, st: SandboxState) -> _Span:
        mgr = box.manager
        egress = mgr.resources.networks.manager.counters(box.id) if st.network is not None else None
        return cls(mgr.layout.cpu_seconds(st.cgroups_path), egress)


def _record(box: Sandbox, st: SandboxState, req: ExecRequest, workdir: str, out: Pumped, rc: int | None,
            duration: float, cancel: Cancel, oom: bool, span: _Span, more: Mapping[str, Any]) -> ExecResult:
    """The result of a finished command and its ``exec`` receipt, for every backend: the sandbox's
    cgroup over the command's span (background processes included; a VM's is its VMM's), the
    network verdicts, and what a keyed command's replay needs."""
    mgr, cg = box.manager, st.cgroups_path
    interrupted = cancel.reason if cancel.is_set() else None
    killed = out.timed_out or interrupted is not None
    sig = int(signal.SIGKILL) if killed else (rc - 128 if rc is not None and 128 < rc <= 128 + 64 else None)
    result = ExecResult(rc, sig, out.stdout, out.stderr, out.truncated, round(duration, 6), out.timed_out,
                        oom, interrupted, cuts=out.cuts)
    cpu_after = mgr.layout.cpu_seconds(cg)
    extra: dict[str, Any] = {
        "resources": {"cpu_seconds": round(cpu_after - span.cpu, 6)
                      if span.cpu is not None and cpu_after is not None else None,
                      "memory_peak": mgr.layout.memory_peak(cg), "pids": mgr.layout.pids_current(cg)}}
    if span.egress is not None:  # what the network policy allowed and denied during the command
        extra["egress"] = diff_counters(span.egress, mgr.resources.networks.manager.counters(box.id))
    extra.update(more)
    if req.keep != "head":
        extra["keep"] = req.keep
    if req.idempotency_key is not None:
        kept = slice(-KEYED_OUTPUT_CAP, None) if req.keep == "tail" else slice(KEYED_OUTPUT_CAP)
        extra.update(idempotency_key=req.idempotency_key,
                     stdout=base64.b64encode(out.stdout[kept]).decode(),
                     stderr=base64.b64encode(out.stderr[kept]).decode())
    box.receipt("exec", command=list(req.argv), cwd=workdir, exit_code=rc, signal=sig, timed_out=out.timed_out,
                oom_killed=oom, interrupted=interrupted, stdout_bytes=out.sizes[0], stderr_bytes=out.sizes[1],
                stdout_blake3=out.digests[0], stderr_blake3=out.digests[1], truncated=out.truncated,
                duration=result.duration, cpu_class=st.options.cpu_class,
                policy_version=st.policy_version, **extra)
    return result


def _replay_to(earlier: ExecResult, on_stdout: Callable[[bytes], None] | None,
               on_stderr: Callable[[bytes], None] | None, on_cut: Callable[[Cut], None] | None) -> None:
    """A streaming caller sees a replayed answer the way it saw the run, its cut where the receipt's bytes end."""
    for name, data, cb in (("stdout", earlier.stdout, on_stdout), ("stderr", earlier.stderr, on_stderr)):
        cut = next((c for c in earlier.cuts if c.stream == name), None)
        if cut is not None and cut.offset == 0 and on_cut is not None:
            on_cut(cut)
        if data and cb is not None:
            cb(data)
        if cut is not None and cut.offset > 0 and on_cut is not None:
            on_cut(cut)


def interrupted_receipt(started: Mapping[str, Any] | None, command: Any) -> dict[str, Any]:
    """The ``exec`` receipt of a command a dead manager left running (reconcile killed it)."""
    started = started or {}
    return {"command": command, "exit_code": None, "signal": int(signal.SIGKILL), "interrupted": "restart",
            "timed_out": False, "oom_killed": False,
            **{k: started[k] for k in CARRIED if started.get(k) is not None}}


def as_request(cmd: Sequence[str] | str | ExecRequest, **fields: Any) -> ExecRequest:
    """An :class:`ExecRequest`, or the fields to make one (validated the same way)."""
    if isinstance(cmd, ExecRequest):
        return cmd
    return ExecRequest(cmd=cmd if isinstance(cmd, str) else tuple(cmd), **fields)
