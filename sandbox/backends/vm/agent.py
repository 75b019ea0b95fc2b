"""The host side of the guest agent protocol (docs/FORMAT.md Part 5; the guest side is guest/agent.c).

One connection per VM over its virtio-serial port's unix socket.  A reader thread routes
frames to channels; a command's output goes into OS pipes, so :func:`sandbox.host.execs.pump`
streams, caps and times out a VM's commands exactly as it does a container's.

Everything read here comes from the guest, which runs anything (its root can replace the
agent), so what the host holds for a VM is bounded by what the host asked for, never by
what the guest sends:

* A connection begins with HELLO: the agent forgets what an earlier connection asked for,
  and whatever reaches the host before its answer (found by the connection's random token
  in the bytes, frames or not) is that connection's, dropped.
* Each request has a channel that takes only the frames its kind of request is answered
  with, each under a size bound, at most two of them but for a stream's.
* A file read or a listing is a stream under credit: the guest may send :data:`WINDOW`
  bytes, and more only as the caller takes them (MORE); a read of a small thing asks for
  no more than it keeps.  A caller that stops taking leaves the guest waiting; one that
  leaves cancels the stream.
* A relayed TCP connection (:meth:`AgentConnection.connect_port`, ports) is a stream both ways:
  the guest sends its socket's bytes under credit as a read's, and the host sends no more
  than :data:`PORT_WINDOW` past what the guest said its socket took (the guest's MORE).
* At most :data:`MAX_STREAMS` streams, :data:`MAX_PORTS` connections and :data:`MAX_CALLS` other
  requests wait for answers on one connection, so it holds at most ``MAX_STREAMS * WINDOW +
  MAX_PORTS * PORT_WINDOW + MAX_CALLS * 2 * MAX_SMALL`` bytes (18 MiB) of the guest's, whatever
  the guest does (and one frame being read).
* A guest that breaks any of this (a frame over the limit, on a channel nobody opened or
  after its end, of a type its request cannot have, past its credit) has its connection
  ended and is :attr:`AgentConnection.misbehaved`; the VM backend marks its sandbox.

An agent built before HELLO answers it with an error: it is spoken to as before (no credit:
the reader thread waits while a stream holds :data:`WINDOW` bytes, so the guest waits in
its write; a frame more than that at most), frames on channels nobody has open are dropped,
since an earlier connection's answers look the same, and a guest that breaks the rules is
cut off but not marked.
"""
from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import select
import socket
import stat as statmod
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from sandbox.backends.base import entry_kind
from sandbox.core.errors import SandboxError, SandboxStateError

log = logging.getLogger("layerbox.sandbox")

T_PING, T_PONG, T_EXEC, T_STARTED, T_STDIN, T_SIGNAL = 1, 2, 3, 4, 5, 6
T_READ, T_DATA, T_END, T_WRITE, T_LIST, T_STAT, T_REMOVE, T_MKDIR, T_SYNC, T_ENTRY, T_MOUNT, T_NET = range(7, 19)
T_MORE, T_STDOUT, T_STDERR, T_EXIT, T_HELLO, T_READY = 19, 20, 21, 22, 23, 100
T_PTY, T_RESIZE, T_CONNECT, T_OPENED, T_SHUT, T_CLOSE, T_WATCH = range(24, 31)  # protocol 3
# the agent protocol this host speaks; an agent's HELLO answer says its own ("lb-agent/N")
PROTOCOL = 3
TERMINALS_SINCE = PORTS_SINCE = WATCH_SINCE = 3
HEAD = struct.Struct(">IBI")  # length of what follows the length field, type, channel
MAX_FRAME = 1 << 20  # payload bytes, both directions (the agent's MAX_FRAME)
DATA_CHUNK = 256 << 10
ENTRY_FIXED = struct.Struct(">IIIIIIIII")  # mode uid gid size_hi size_lo mtime_hi mtime_lo nlink name_len
HELLO_CHANNEL = 0xFFFF_FFFF  # no request's: the host numbers them from 1
TOKEN = 16  # random bytes of a HELLO, which its answer starts with
# What one connection holds of the guest's at most (the module's docstring).  A window of 1 MiB
# is four of the agent's 256 KiB pieces in flight: a download runs at the port's speed.
WINDOW = 1 << 20
MAX_STREAMS = 8
MAX_CALLS = 64
# a relayed TCP connection (ports): the guest sends at most this much more than the caller took,
# and the host no more than this more than the guest's socket took; the agent relays 64 at most
PORT_WINDOW = 256 << 10
MAX_PORTS = 32
# every answer frame but a stream's data and a command's output: END (errno + a message of at
# most 4352 bytes), ENTRY (36 + 4 + a path of 4096 + a link of 4096), PONG, HELLO
MAX_SMALL = 16 << 10
MAX_ENTRIES = 100_000  # a listing longer than this is refused, not held
SEND_TIMEOUT = 120  # seconds a send may wait for the guest to take a frame (its longest request: SYNC)


class AgentError(SandboxError):
    """The guest agent is unreachable, or said something the protocol does not allow."""


class AgentMisbehaved(AgentError, SandboxStateError):
    """The guest broke the agent protocol: the host ended its connection and no longer talks to it."""


class AgentTooOld(AgentError):
    """The guest's agent predates what was asked of it (its VM's guest assets are older than this host's)."""


class GuestFileError(SandboxError):
    """A file operation the guest refused; ``errno`` as the guest's kernel reported it."""

    def __init__(self, err: int, message: str) -> None:
        super().__init__(message)
        self.errno = err


class _Broken(Exception):
    """What the reader found the guest doing wrong."""


def _str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack(">I", len(b)) + b


@dataclass(frozen=True)
class GuestStat:
    mode: int
    uid: int
    gid: int
    size: int
    mtime_ns: int
    nlink: int
    name: str
    target: str | None

    def to_stat_result(self) -> os.stat_result:
        t = self.mtime_ns / 1e9
        return os.stat_result((self.mode, 0, 0, self.nlink, self.uid, self.gid, self.size, t, t, t))


def _parse_entry(p: bytes) -> GuestStat:
    if len(p) < ENTRY_FIXED.size + 4:
        raise AgentError(f"agent: it has {len(p)} bytes, too few for an entry")
    mode, uid, gid, sh, sl, mh, ml, nlink, nl = ENTRY_FIXED.unpack_from(p)
    off = ENTRY_FIXED.size
    name = p[off:off + nl]
    off += nl
    if len(name) != nl or len(p) < off + 4:
        raise AgentError("agent: its name overruns it")
    (ll,) = struct.unpack_from(">I", p, off)
    if len(p) != off + 4 + ll:
        raise AgentError("agent: its link target does not fill it")
    target = p[off + 4:] if ll else None
    mtime = (mh << 32 | ml)
    if mtime >= 1 << 63:
        mtime -= 1 << 64
    return GuestStat(mode, uid, gid, sh << 32 | sl, mtime, nlink, name.decode(errors="surrogateescape"),
                     target.decode(errors="surrogateescape") if target is not None else None)


@dataclass(frozen=True)
class _Answers:
    """The frames one kind of request may be answered with (docs/FORMAT.md Part 5)."""

    ends: frozenset[int] = frozenset({T_END})
    once: int | None = None  # a frame that may come once before the end (a STAT's ENTRY)
    stream: int | None = None  # what a stream carries under credit (a READ's DATA, a LIST's ENTRY)


ANSWERS = {T_PING: _Answers(frozenset({T_PONG})), T_STAT: _Answers(once=T_ENTRY),
           T_READ: _Answers(stream=T_DATA), T_LIST: _Answers(stream=T_ENTRY)}


class _Channel:
    """One request's answers on their way from the reader thread to the caller: checked frame
    by frame against what the request may be answered with, and bounded (a stream by its
    credit, or for an agent without credit by the reader's wait; anything else by its two frames)."""

    def __init__(self, chan: int, request: int, credit: int | None, budget: int | None) -> None:
        self.chan, self.request = chan, request
        self.answers = ANSWERS.get(request, _Answers())
        self.frames: deque[tuple[int, bytes]] = deque()
        self.queued = 0  # payload bytes in frames
        self.credit = credit  # what the guest may still send on a stream (None: an agent without credit)
        self.budget = budget  # what the caller takes of a stream in all (None: what it has)
        self.granted = credit or 0
        self.once_seen = self.ended = self.abandoned = False

    @property
    def stream(self) -> bool:
        return self.answers.stream is not None

    def check(self, kind: int, payload: bytes) -> None:
        """``payload`` of type ``kind`` as the next answer, taken off the credit; _Broken if it cannot be."""
        a, n = self.answers, len(payload)
        if kind != T_DATA and n > MAX_SMALL:
            raise _Broken(f"sent a frame of type {kind} of {n} bytes (at most {MAX_SMALL})")
        if kind == a.stream:
            if self.credit is not None:
                if self.credit <= 0 or (kind == T_DATA and n > self.credit):
                    raise _Broken(f"sent {n} bytes on stream {self.chan} with {max(self.credit, 0)} asked for")
                self.credit -= n
        elif kind == a.once and not self.once_seen:
            self.once_seen = True
        elif kind in a.ends:
            self.ended = True
        else:
            raise _Broken(f"answered a request of type {self.request} (channel {self.chan}) with a frame of "
                          f"type {kind}")
        if kind == T_END and n < 4:
            raise _Broken(f"sent an end frame of {n} bytes on channel {self.chan}")
        if kind == T_ENTRY:
            try:
                _parse_entry(payload)
            except AgentError as exc:
                raise _Broken(f"sent a bad entry frame: {str(exc).removeprefix('agent: ')}") from None

    def grant(self, taken: int) -> int:
        """Credit for the ``taken`` bytes the caller just took, within its budget (given before it
        is sent: the guest may use it at once)."""
        if self.credit is None or self.ended:
            return 0
        more = taken if self.budget is None else max(0, min(taken, self.budget - self.granted))
        self.credit += more
        self.granted += more
        return more


class GuestProcess:
    """A command in the guest, shaped like the ``subprocess.Popen`` that ``pump`` drives."""

    def __init__(self, conn: AgentConnection, chan: int, argv: list[str], stdin_fd: int | None = None) -> None:
        """``stdin_fd``: a descriptor of the caller's (a pipe's read end, taken over and closed
        here) whose bytes are the command's input, for an owner that writes it later
        (``Attach``); without one, :attr:`stdin` is the pipe to write."""
        self.conn, self.chan, self.args = conn, chan, argv
        self.pid = 0
        self.returncode: int | None = None
        self._exited = threading.Event()
        out_r, self._out_w = os.pipe()
        err_r, self._err_w = os.pipe()
        self.stdout: BinaryIO = os.fdopen(out_r, "rb", buffering=0)
        self.stderr: BinaryIO = os.fdopen(err_r, "rb", buffering=0)
        self.stdin: BinaryIO | None = None
        if stdin_fd is None:
            stdin_fd, in_w = os.pipe()
            self.stdin = os.fdopen(in_w, "wb", buffering=0)
        self._in_r = stdin_fd
        self._forwarder = threading.Thread(target=self._forward_stdin, daemon=True, name=f"agent-stdin-{chan}")

    def _forward_stdin(self) -> None:
        try:
            while data := os.read(self._in_r, DATA_CHUNK):
                self.conn.send(T_STDIN, self.chan, data)
            self.conn.send(T_STDIN, self.chan, b"")
        except (OSError, AgentError):
            pass
        finally:
            os.close(self._in_r)

    def _output(self, stream: int, data: bytes) -> None:
        fd = self._out_w if stream == T_STDOUT else self._err_w
        if fd >= 0:
            try:
                os.write(fd, data)  # blocks while the reader is behind: the guest then waits too
            except OSError:
                pass

    def _finish(self, code: int, message: bytes = b"") -> None:
        if message and self._err_w >= 0:
            self._output(T_STDERR, message)
        for name in ("_out_w", "_err_w"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)
        self.returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise TimeoutError(f"guest command {self.args[0]!r} still running")
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        self.signal(9)

    def signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                self.conn.send(T_SIGNAL, self.chan, struct.pack(">I", sig))
            except AgentError:
                pass

    def resize(self, cols: int, rows: int) -> None:
        """A command on a terminal: its new size (the guest's kernel tells its foreground with SIGWINCH)."""
        if self.returncode is None:
            self.conn.send(T_RESIZE, self.chan, struct.pack(">II", cols, rows))


class GuestPort:
    """A TCP connection to ``127.0.0.1:<port>`` in the guest, relayed by the agent: the caller holds
    :attr:`outer`, one end of a socket pair; two threads move the bytes of the other end.

    Guest to caller: DATA frames under credit, written to the pair as the caller reads, each
    given back (MORE) once written; SHUT, the guest socket's end of input, shuts the pair's
    writing side.  Caller to guest: what the pair reads, while the guest's window allows; at
    its end, END (a half close) or, when the caller closed its end whole, CLOSE (the guest
    drops its socket).  The guest's END is the connection's last frame."""

    def __init__(self, conn: AgentConnection, chan: int, port: int) -> None:
        self.conn, self.chan, self.port = conn, chan, port
        self.outer, self._inner = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.opened = self.shut = self.ended = self.abandoned = False
        self.error = 0  # the guest's errno with its END
        self.message = ""
        self.frames: deque[bytes] = deque()
        self.credit = PORT_WINDOW  # what the guest may still send
        self.window = PORT_WINDOW  # what the host may still send
        self.unacked = 0  # sent, not yet said taken by the guest's socket
        self._down = threading.Thread(target=self._to_caller, daemon=True, name=f"agent-port-{chan}-down")
        self._up = threading.Thread(target=self._to_guest, daemon=True, name=f"agent-port-{chan}-up")

    def start(self) -> None:
        self._down.start()
        self._up.start()

    def check(self, kind: int, payload: bytes) -> None:
        """The guest's frame ``kind`` on this connection (under the connection's lock); _Broken if it cannot be."""
        n = len(payload)
        if kind == T_OPENED and not self.opened and not n:
            self.opened = True
        elif kind == T_DATA and self.opened and not self.shut and 0 < n <= self.credit:
            self.credit -= n
            if not self.abandoned:
                self.frames.append(payload)
        elif kind == T_SHUT and self.opened and not self.shut and not n:
            self.shut = True
        elif kind == T_MORE and n == 4 and struct.unpack(">I", payload)[0] <= self.unacked:
            taken = struct.unpack(">I", payload)[0]
            self.unacked -= taken
            self.window += taken
        elif kind == T_END and 4 <= n <= MAX_SMALL:
            self.ended = True
            self.error = struct.unpack(">I", payload[:4])[0]
            self.message = payload[4:4096].decode(errors="replace")
        else:
            raise _Broken(f"answered a connection to port {self.port} (channel {self.chan}) with a frame of "
                          f"type {kind} of {n} bytes")

    def cut(self) -> None:
        """The connection is over (the guest's END with an error, or the agent's connection ended):
        the caller's end sees its end, both threads stop."""
        with contextlib.suppress(OSError):
            self._inner.shutdown(socket.SHUT_RDWR)

    def _to_caller(self) -> None:
        cond = self.conn._cond
        while True:
            with cond:
                cond.wait_for(lambda: self.frames or self.shut or self.ended or self.abandoned)
                data = self.frames.popleft() if self.frames and not self.abandoned else None
                if data is None:
                    break
            try:
                self._inner.sendall(data)
            except OSError:
                self._abandon()
                return
            with cond:
                self.credit += len(data)  # before the guest hears of it: it may send at once
            self._send(T_MORE, struct.pack(">I", len(data)))
        with contextlib.suppress(OSError):
            self._inner.shutdown(socket.SHUT_WR)

    def _to_guest(self) -> None:
        cond = self.conn._cond
        try:
            while True:
                with cond:
                    cond.wait_for(lambda: self.window > 0 or self.ended or self.abandoned)
                    if self.ended or self.abandoned:
                        return
                    want = min(self.window, DATA_CHUNK)
                try:
                    data = self._inner.recv(want)
                except OSError:
                    data = b""
                if not data:
                    # the caller's whole close (the pair hung up) or only its end of output
                    if select_poll(self._inner) & select.POLLHUP:
                        self._abandon()
                    else:
                        self._send(T_END)
                    return
                with cond:
                    self.window -= len(data)
                    self.unacked += len(data)
                self._send(T_DATA, data)
        finally:
            self._down.join()
            self._inner.close()

    def _send(self, kind: int, payload: bytes = b"") -> None:
        with self.conn._cond:
            if self.ended or self.abandoned:
                return
        with contextlib.suppress(AgentError):
            self.conn.send(kind, self.chan, payload)

    def _abandon(self) -> None:
        """The caller is gone: the guest drops its socket (its END still ends the channel)."""
        self._send(T_CLOSE)
        with self.conn._cond:
            self.abandoned = True
            self.frames.clear()
            self.conn._cond.notify_all()
        self.cut()


def select_poll(sock: socket.socket) -> int:
    """The poll events of ``sock`` now (without waiting)."""
    p = select.poll()
    p.register(sock, select.POLLIN)
    found = p.poll(0)
    return found[0][1] if found else 0


class AgentConnection:
    """One connection to a VM's agent.  Thread-safe: any thread sends; one thread reads."""

    def __init__(self, path: Path, *, timeout: float = 30.0) -> None:
        self.path = path
        self._sock = connect_unix(path, timeout)
        # a guest that stops reading its port holds a sender (and the lock behind it) this long at most
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", SEND_TIMEOUT, 0))
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()  # over everything below but the socket
        self._last_chan = 0
        self._procs: dict[int, GuestProcess] = {}
        self._calls: dict[int, _Channel] = {}
        self._ports: dict[int, GuestPort] = {}
        self._token = os.urandom(TOKEN)
        self._synced = False  # the agent answered this connection's HELLO
        self._pending = bytearray()  # read after HELLO's answer, before the reader parsed frames
        self._hellos = [0, 0]  # sent, answered
        self._closing = False
        self._failing = False  # one _fail at a time: `closed` is set once its callback has run
        self._on_misbehaved: Callable[[str], None] | None = None
        self.closed: str | None = None
        self.misbehaved: str | None = None  # why the guest was found breaking the protocol
        self.speaks_hello = False  # an agent with HELLO (streams under credit), not one from before
        self.version: str | None = None  # "lb-agent/N", its answer to HELLO says
        self._reader = threading.Thread(target=self._read_loop, daemon=True, name=f"agent-{path.parent.name}")
        self._reader.start()

    @property
    def protocol(self) -> int:
        """The agent's protocol version (:data:`PROTOCOL`; 0 for one that does not say), once HELLO was answered."""
        name, _, number = (self.version or "").partition("/")
        return int(number) if name == "lb-agent" and number.isdigit() and self.speaks_hello else 0

    def watch(self, on_misbehaved: Callable[[str], None]) -> None:
        """Call ``on_misbehaved(why)`` once the guest is found breaking the protocol (now, if it was)."""
        with self._cond:
            self._on_misbehaved, why = on_misbehaved, self.misbehaved
        if why is not None:
            on_misbehaved(why)

    # -- wire ----------------------------------------------------------------------------
    def send(self, kind: int, chan: int, payload: bytes = b"") -> None:
        if len(payload) > MAX_FRAME:
            raise AgentError(f"agent: frame of {len(payload)} bytes is over {MAX_FRAME}")
        if self.closed:
            raise self._closed_error()
        with self._send_lock:
            try:
                self._sock.sendall(HEAD.pack(len(payload) + 5, kind, chan) + payload)
            except OSError as exc:
                why = (f"the guest took no frame for {SEND_TIMEOUT} s" if isinstance(exc, BlockingIOError)
                       else f"sending to the guest: {exc}")
                self._fail(why, mark=False)  # part of a frame may be out: nothing after it would parse
                raise AgentError(f"agent connection {self.path}: {why}") from None

    def _send_quietly(self, kind: int, chan: int) -> None:
        with contextlib.suppress(AgentError):
            self.send(kind, chan)

    def _recv_exact(self, n: int) -> bytes:
        buf = self._pending[:n]
        del self._pending[:n]
        while len(buf) < n:
            got = self._sock.recv(n - len(buf))
            if not got:
                raise EOFError
            buf += got
        return bytes(buf)

    def _read_loop(self) -> None:
        why, mark = "closed by the guest", False
        try:
            self._await_hello_answer()
            while True:
                length, kind, chan = HEAD.unpack(self._recv_exact(HEAD.size))
                if not 5 <= length <= MAX_FRAME + 5:
                    raise _Broken(f"sent a frame of {length} bytes (at most {MAX_FRAME + 5})")
                self._dispatch(kind, chan, self._recv_exact(length - 5))
        except EOFError:
            pass
        except OSError as exc:
            why = str(exc)
        except _Broken as exc:
            # an agent from before HELLO is cut off, never marked: after a restore the host cannot
            # tell its lies from what it still sends for an earlier connection
            why, mark = f"the guest {exc}", self.speaks_hello
        if self._closing:
            why, mark = "closed by the host", False
        self._fail(why, mark=mark)
        self._sock.close()

    def _await_hello_answer(self) -> None:
        """Read up to the answer to this connection's HELLO, as bytes: what comes before it is an
        earlier connection's, perhaps the torn end of a frame a guest was writing when its memory
        was saved (a template, a checkpoint), so it is dropped unparsed."""
        chan = HELLO_CHANNEL.to_bytes(4, "big")
        heads = (bytes([T_HELLO]) + chan + self._token, bytes([T_END]) + chan)  # after its length
        buf = bytearray()
        while not self._synced:
            got = self._sock.recv(1 << 16)
            if not got:
                raise EOFError
            buf = self._find_hello_answer(buf + got, heads)
        self._pending = buf

    def _find_hello_answer(self, buf: bytearray, heads: tuple[bytes, bytes]) -> bytearray:
        """The bytes of ``buf`` still to be looked at: after the answer, once found (the frames
        that follow it), else those a head may still begin in (bounded by a frame of MAX_SMALL)."""
        pos = 4
        while hits := [i for h in heads if (i := buf.find(h, pos)) != -1]:
            i = min(hits)
            length = int.from_bytes(buf[i - 4:i], "big")
            if not 9 <= length <= MAX_SMALL + 5:
                pos = i + 1  # those bytes only look like a head
                continue
            if len(buf) < i + length:
                return buf[i - 4:]  # its payload is still to come
            self._hello_answer(buf[i], bytes(buf[i + 5:i + length]))
            if self._synced:
                return buf[i + length:]
            pos = i + 1
        return buf[max(0, len(buf) - len(heads[0]) - 3):]

    def _dispatch(self, kind: int, chan: int, payload: bytes) -> None:
        if kind == T_READY and chan == 0:
            self.version = payload.decode(errors="replace")[:64]
            return
        if chan == HELLO_CHANNEL:
            self._hello_answer(kind, payload)
            return
        with self._cond:
            proc, ch, port = self._procs.get(chan), self._calls.get(chan), self._ports.get(chan)
            opened = 0 < chan <= self._last_chan
        if port is not None:
            self._to_port(port, kind, payload)
        elif proc is not None:
            self._to_process(proc, kind, chan, payload)
        elif ch is not None:
            self._deliver(ch, kind, payload)
        elif self.speaks_hello:
            raise _Broken(f"sent a frame of type {kind} on channel {chan}, "
                          + ("after that request's end" if opened else "which the host never opened"))
        # else: an agent from before HELLO; an earlier connection's answers look like this: dropped

    def _to_process(self, proc: GuestProcess, kind: int, chan: int, payload: bytes) -> None:
        if kind in (T_STDOUT, T_STDERR):
            proc._output(kind, payload)  # blocks while the pump is behind: the guest then waits too
        elif kind == T_STARTED and len(payload) == 4:
            proc.pid = struct.unpack(">I", payload)[0]
        elif kind == T_EXIT and len(payload) == 4:
            (code,) = struct.unpack(">i", payload)
            with self._cond:
                self._procs.pop(chan, None)
            proc._finish(code if code >= 0 else 128 - code)
        elif kind == T_END and 4 <= len(payload) <= MAX_SMALL:  # the command never started
            err = struct.unpack(">I", payload[:4])[0]
            with self._cond:
                self._procs.pop(chan, None)
            proc._finish(127 if err == errno.ENOENT else 126, payload[4:4096] + b"\n")
        else:
            raise _Broken(f"answered a command (channel {chan}) with a frame of type {kind} of "
                          f"{len(payload)} bytes")

    def _to_port(self, port: GuestPort, kind: int, payload: bytes) -> None:
        with self._cond:
            port.check(kind, payload)
            if port.ended:
                self._ports.pop(port.chan, None)
            self._cond.notify_all()
        if port.ended and port.error:
            port.cut()

    def _deliver(self, ch: _Channel, kind: int, payload: bytes) -> None:
        with self._cond:
            ch.check(kind, payload)
            if ch.ended:
                self._calls.pop(ch.chan, None)
                self._cond.notify_all()  # a slot for a request waiting for one
            if ch.stream and ch.credit is None:  # an agent without credit: it waits while we do
                self._cond.wait_for(lambda: ch.queued + len(payload) <= WINDOW or not ch.frames
                                    or ch.abandoned or self._closing or self.closed is not None)
            if ch.abandoned or self.closed is not None:
                return
            ch.frames.append((kind, payload))
            ch.queued += len(payload)
            self._cond.notify_all()

    def _hello_answer(self, kind: int, payload: bytes) -> None:
        with self._cond:
            if self._synced:
                # an agent from before HELLO answers without our token: one sent by an earlier
                # connection (a template's boot sends it until answered, and a restored guest
                # may still hold some) looks the same; after an agent's with HELLO answered
                # ours, only our own may come: HELLOs sent again while the first was on its way
                if not self.speaks_hello:
                    return
                if kind != T_HELLO or payload[:TOKEN] != self._token or self._hellos[1] >= self._hellos[0]:
                    raise _Broken("answered a HELLO the host did not send")
                self._hellos[1] += 1
                return
            if kind == T_HELLO and TOKEN <= len(payload) <= MAX_SMALL and payload[:TOKEN] == self._token:
                self.speaks_hello = True
                self.version = payload[TOKEN:TOKEN + 64].decode(errors="replace")
            elif not (kind == T_END and 4 <= len(payload) <= MAX_SMALL and payload[:4] != bytes(4)):
                return  # an answer to an earlier connection's HELLO: dropped
            # (else an agent from before HELLO: ENOSYS, or EAGAIN before its MOUNT)
            self._synced = True
            self._hellos[1] += 1
            self._cond.notify_all()

    def _fail(self, why: str, *, mark: bool) -> None:
        with self._cond:
            if self.closed is not None or self._failing:
                return
            self._failing = True
            callback = self._on_misbehaved if mark else None
            if mark:
                self.misbehaved = why
        if callback is not None:
            # before the connection is seen closed: whoever learns of the broken protocol (a call
            # that fails, a look at `closed`) finds its sandbox marked already
            callback(why)
        with self._cond:
            self.closed = why
            if mark:
                for ch in self._calls.values():  # nothing more of a guest that broke the protocol
                    ch.frames.clear()
            procs, self._procs = self._procs, {}
            ports, self._ports = self._ports, {}
            for port in ports.values():
                port.ended, port.error = True, port.error or errno.ECONNABORTED
            self._calls.clear()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        for proc in procs.values():
            proc._finish(255, f"layerbox: the guest agent went away ({why})\n".encode())
        for port in ports.values():
            port.cut()
        with self._cond:
            self._cond.notify_all()

    def _closed_error(self) -> AgentError:
        if self.misbehaved is not None:
            return AgentMisbehaved(f"agent connection {self.path}: the guest broke the agent protocol "
                                   f"({self.misbehaved}); the host no longer talks to it")
        return AgentError(f"agent connection {self.path}: {self.closed}")

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._reader.join(5)

    # -- requests ------------------------------------------------------------------------
    def hello(self, timeout: float = 10.0) -> None:
        """Begin the connection, once (every request does it first): the agent forgets what an
        earlier connection asked for and says whether it streams under credit."""
        with self._cond:
            if self._synced:
                return
            self._hellos[0] += 1
        self.send(T_HELLO, HELLO_CHANNEL, self._token)
        with self._cond:
            self._cond.wait_for(lambda: self._synced or self.closed is not None, timeout)
            if self.closed is not None:
                raise self._closed_error()
            if not self._synced:
                raise AgentError(f"agent: no answer to HELLO in {timeout:g} s")

    def _open(self, request: int, timeout: float, budget: int | None) -> _Channel:
        """A channel for one request, once there is room for it on this connection."""
        self.hello(timeout)
        stream = ANSWERS.get(request, _Answers()).stream is not None
        most = MAX_STREAMS if stream else MAX_CALLS

        def room() -> bool:
            return sum(c.stream == stream for c in self._calls.values()) < most

        with self._cond:
            if not self._cond.wait_for(lambda: self.closed is not None or room(), timeout):
                raise AgentError(f"agent: {most} {'reads' if stream else 'requests'} are waiting for its answers "
                                 f"already, for {timeout:g} s")
            if self.closed is not None:
                raise self._closed_error()
            credit = (WINDOW if budget is None else min(WINDOW, budget)) if stream and self.speaks_hello else None
            self._last_chan += 1
            ch = self._calls[self._last_chan] = _Channel(self._last_chan, request, credit, budget)
            return ch

    def _next(self, ch: _Channel, timeout: float, deadline: float | None) -> tuple[int, bytes]:
        with self._cond:
            wait = timeout if deadline is None else max(0.0, min(timeout, deadline - time.monotonic()))
            if not self._cond.wait_for(lambda: ch.frames or self.closed is not None, wait):
                raise AgentError("agent: no answer " + (f"in {timeout:g} s" if wait == timeout else "by its deadline"))
            if not ch.frames:
                raise self._closed_error()
            kind, payload = ch.frames.popleft()
            ch.queued -= len(payload)
            self._cond.notify_all()  # the reader, when it waits on an agent without credit
            more = ch.grant(len(payload)) if kind == ch.answers.stream else 0
        if more:
            self.send(T_MORE, ch.chan, struct.pack(">I", more))
        return kind, payload

    def _release(self, ch: _Channel) -> None:
        """The caller is done with ``ch``: anything more on it is dropped, a stream cancelled."""
        with self._cond:
            if ch.ended or self.closed is not None:
                return
            ch.abandoned = True  # kept until its end comes: it still counts against the limits
            ch.frames.clear()
            ch.queued = 0
            self._cond.notify_all()
        if ch.credit is not None:
            # the agent ends a stream on our END; sent aside, since a generator's close runs where it
            # is dropped (e.g. the edge's event loop), and a guest that stops reading holds a send
            threading.Thread(target=self._send_quietly, args=(T_END, ch.chan), daemon=True,
                             name=f"agent-cancel-{ch.chan}").start()

    def _call(self, kind: int, payload: bytes, *, timeout: float = 60.0, deadline: float | None = None,
              data: Iterator[bytes] | None = None, budget: int | None = None
              ) -> Generator[tuple[int, bytes], None, None]:
        """Send one request; yield its answer frames up to and including its last.  ``timeout``:
        seconds for each answer frame; ``deadline``: a monotonic time for all of them; ``budget``:
        a stream's bytes the caller takes at most."""
        ch = self._open(kind, timeout, budget)
        try:
            self.send(kind, ch.chan, payload + (struct.pack(">I", ch.credit) if ch.credit is not None else b""))
            if data is not None:
                for piece in data:
                    self.send(T_DATA, ch.chan, piece)
                self.send(T_END, ch.chan)
            while True:
                frame = self._next(ch, timeout, deadline)
                yield frame
                if frame[0] in ch.answers.ends:
                    return
        finally:
            self._release(ch)

    @staticmethod
    def _check_end(payload: bytes) -> None:
        err = struct.unpack(">I", payload[:4])[0]
        if err:
            raise GuestFileError(err, payload[4:4096].decode(errors="replace"))

    def _done(self, kind: int, payload: bytes, *, timeout: float = 60.0) -> None:
        """A request answered by one END: GuestFileError with the guest's errno unless it is 0."""
        for _, end in self._call(kind, payload, timeout=timeout):
            self._check_end(end)

    def ping(self, timeout: float = 5.0) -> float:
        t = time.perf_counter()
        for _kind, _payload in self._call(T_PING, b"lb", timeout=timeout):
            pass
        return time.perf_counter() - t

    def exec(self, argv: list[str], *, env: dict[str, str], cwd: str, uid: int, gid: int,
             stdin_fd: int | None = None, terminal: tuple[int, int] | None = None) -> GuestProcess:
        """A command in the guest; its input from ``stdin_fd`` when given (see :class:`GuestProcess`,
        which closes it: so does a failure here).  ``terminal``: ``(cols, rows)`` of a pty the agent
        makes the command's controlling terminal (protocol 3); its output is all stdout."""
        try:
            if terminal is not None:
                self.require(TERMINALS_SINCE, "a terminal (pty)")
            kind, head = (T_EXEC, b"") if terminal is None else (T_PTY, struct.pack(">II", *terminal))
            return self._exec(kind, head, argv, env=env, cwd=cwd, uid=uid, gid=gid, stdin_fd=stdin_fd)
        except BaseException:
            if stdin_fd is not None:
                with contextlib.suppress(OSError):
                    os.close(stdin_fd)
            raise

    def watch_dir(self, path: str, *, recursive: bool, uid: int, gid: int) -> GuestProcess:
        """A watch of the directory ``path`` as ``uid``:``gid``: a child of the agent's reporting the
        guest kernel's inotify events on its stdout (docs/FORMAT.md Part 5, WATCH); a byte on its
        stdin is answered after every event queued before it.  Killed to end it."""
        self.require(WATCH_SINCE, "a directory watch")
        return self._exec(T_WATCH, b"", [path, "recursive" if recursive else "flat"], env={}, cwd="/", uid=uid,
                          gid=gid, stdin_fd=None)

    def _exec(self, kind: int, head: bytes, argv: list[str], *, env: dict[str, str], cwd: str, uid: int, gid: int,
              stdin_fd: int | None) -> GuestProcess:
        payload = (head + struct.pack(">II", uid, gid) + _str(cwd) + struct.pack(">I", len(argv))
                   + b"".join(_str(a) for a in argv) + struct.pack(">I", len(env))
                   + b"".join(_str(f"{k}={v}") for k, v in env.items()))
        if len(payload) > MAX_FRAME:
            raise AgentError(f"command and environment take {len(payload)} bytes, over the agent's {MAX_FRAME}")
        self.hello()
        with self._cond:
            if self.closed is not None:
                raise self._closed_error()
            self._last_chan += 1
            proc = self._procs[self._last_chan] = GuestProcess(self, self._last_chan, argv, stdin_fd)
        self.send(kind, proc.chan, payload)
        proc._forwarder.start()
        return proc

    def require(self, since: int, what: str) -> None:
        """AgentTooOld unless the agent speaks protocol ``since`` or later (HELLO answered first)."""
        self.hello()
        if self.protocol < since:
            raise AgentTooOld(f"{what} needs a guest agent of protocol {since} or later; this guest's is "
                              f"{self.version or 'older'!r}: its VM was made from guest assets built before "
                              "(`layerbox vm assets` builds new ones; sandboxes made after that have it)")

    def connect_port(self, port: int, timeout: float) -> socket.socket:
        """A connected stream socket whose peer is ``127.0.0.1:<port>`` inside the guest (relayed by
        the agent, :class:`GuestPort`); ConnectionRefusedError when nothing listens there,
        TimeoutError when the guest's connect takes longer than ``timeout``, another OSError with
        the guest's errno when its connect failed otherwise."""
        self.require(PORTS_SINCE, "a port connection")
        with self._cond:
            if not self._cond.wait_for(lambda: self.closed is not None or len(self._ports) < MAX_PORTS, timeout):
                raise AgentError(f"agent: {MAX_PORTS} port connections are open already, for {timeout:g} s")
            if self.closed is not None:
                raise self._closed_error()
            self._last_chan += 1
            relay = self._ports[self._last_chan] = GuestPort(self, self._last_chan, port)
        try:
            self.send(T_CONNECT, relay.chan, struct.pack(">II", port, PORT_WINDOW))
            with self._cond:
                self._cond.wait_for(lambda: relay.opened or relay.ended, timeout)
                opened, ended, err, message = relay.opened, relay.ended, relay.error, relay.message
        except BaseException:
            relay.outer.close()
            raise
        if opened and not ended:
            relay.start()
            return relay.outer
        relay.outer.close()
        if not ended:
            relay._abandon()  # the guest's END, when it comes, ends the channel
            relay._inner.close()
            raise TimeoutError(f"port {port} of the guest did not accept within {timeout:g} s")
        relay._inner.close()
        if self.closed is not None:  # the connection ended meanwhile (the guest broke the protocol)
            raise self._closed_error()
        if err == errno.ECONNREFUSED:
            raise ConnectionRefusedError(err, f"nothing listens on 127.0.0.1:{port} in the guest")
        raise OSError(err or errno.ECONNRESET, message or f"connect to 127.0.0.1:{port} in the guest failed")

    def iter_read(self, path: str, *, budget: int | None = None, timeout: float = 60.0,
                  deadline: float | None = None) -> Generator[bytes, None, None]:
        """The file's bytes as the caller takes them; the guest sends no more than ``budget`` in all."""
        with contextlib.closing(self._call(T_READ, _str(path), timeout=timeout, deadline=deadline,
                                           budget=budget)) as answers:
            for kind, payload in answers:
                if kind == T_DATA:
                    yield payload
                else:
                    self._check_end(payload)

    def read(self, path: str, *, limit: int, timeout: float = 60.0, deadline: float | None = None) -> bytes:
        """A small file whole: GuestFileError EFBIG when it has more than ``limit`` bytes (the guest
        is asked for one more, and not one more is kept)."""
        out = bytearray()
        with contextlib.closing(self.iter_read(path, budget=limit + 1, timeout=timeout, deadline=deadline)) as data:
            for piece in data:
                out += piece
                if len(out) > limit:
                    raise GuestFileError(errno.EFBIG, f"read {path}: more than {limit} bytes")
        return bytes(out)

    def write(self, path: str, chunks: Iterator[bytes], mode: int = 0o644) -> int:
        total = 0

        def counted() -> Iterator[bytes]:
            nonlocal total
            for c in chunks:
                for i in range(0, len(c), DATA_CHUNK):
                    piece = c[i:i + DATA_CHUNK]
                    total += len(piece)
                    yield piece

        for _, end in self._call(T_WRITE, struct.pack(">I", mode) + _str(path), data=counted()):
            self._check_end(end)
        return total

    def list(self, path: str, *, limit: int = MAX_ENTRIES) -> list[GuestStat]:
        """A directory's entries; GuestFileError EOVERFLOW past ``limit`` of them."""
        out: list[GuestStat] = []
        with contextlib.closing(self._call(T_LIST, _str(path))) as answers:
            for kind, p in answers:
                if kind != T_ENTRY:
                    self._check_end(p)
                elif len(out) == limit:
                    raise GuestFileError(errno.EOVERFLOW, f"list {path}: more than {limit} entries")
                else:
                    out.append(_parse_entry(p))
        return out

    def stat(self, path: str) -> GuestStat:
        found = None
        for kind, p in self._call(T_STAT, _str(path)):
            if kind == T_ENTRY:
                found = _parse_entry(p)
            else:
                self._check_end(p)
        if found is None:
            raise AgentError(f"agent: stat {path} answered without an entry")
        return found

    def remove(self, path: str, *, recursive: bool = False) -> None:
        self._done(T_REMOVE, struct.pack(">I", int(recursive)) + _str(path))

    def mkdir(self, path: str, mode: int = 0o755) -> None:
        self._done(T_MKDIR, struct.pack(">I", mode) + _str(path))

    def mount(self, timeout: float = 60.0) -> None:
        """Reseed the guest's kernel RNG with 64 fresh bytes, then mount the sandbox's disk and
        root (once; again only reseeds).  Every VM of a template shares its RNG state until then."""
        try:
            self._done(T_MOUNT, os.urandom(64), timeout=timeout)
        except GuestFileError as exc:
            raise AgentError(f"the guest could not mount the sandbox's disk: {exc}") from None

    def net(self, address: str, prefixlen: int, gateway: str) -> None:
        """The guest's eth0 address and default route."""
        payload = struct.pack(">III", int(ipaddress.IPv4Address(address)), prefixlen,
                              int(ipaddress.IPv4Address(gateway)))
        try:
            self._done(T_NET, payload)
        except GuestFileError as exc:
            raise AgentError(f"the guest could not configure its network: {exc}") from None

    def sync(self) -> None:
        self._done(T_SYNC, b"", timeout=120.0)


def connect_unix(path: Path, timeout: float, alive: Callable[[], bool] | None = None) -> socket.socket:
    """Connect through an O_PATH fd of the directory: a unix socket's path is at most 107 bytes,
    a data dir's sandbox directory can be longer.  ``alive``: whether whoever will listen there
    still can (a VMM that exited before its socket is an error at once, not after ``timeout``)."""
    dfd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        deadline = time.monotonic() + timeout
        while True:
            try:
                sock.connect(f"/proc/self/fd/{dfd}/{path.name}")
                return sock
            except (FileNotFoundError, ConnectionRefusedError):
                if alive is not None and not alive():
                    sock.close()
                    raise AgentError(f"{path}: its process exited before it listened") from None
                if time.monotonic() > deadline:
                    sock.close()
                    raise AgentError(f"{path}: nothing listens there after {timeout:g} s") from None
                time.sleep(0.002)  # a VMM starting: its socket comes ~30 ms after the exec; each 10 ms slept cost a create 5
    finally:
        os.close(dfd)


def entry_json(st: GuestStat) -> dict[str, Any]:
    """A guest directory entry in the shape ``RootFiles.list`` gives for a container."""
    return {"name": st.name, "type": entry_kind(st.mode), "size": st.size, "mode": statmod.S_IMODE(st.mode),
            "mtime": st.mtime_ns / 1e9}
