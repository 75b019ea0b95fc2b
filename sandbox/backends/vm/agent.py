"""The host side of the guest agent protocol (docs/FORMAT.md Part 5; the guest side is guest/agent.c).

One connection per VM over its virtio-serial port's unix socket.  A reader thread routes
frames to channels; a command's output goes into OS pipes, so :func:`sandbox.host.execs.pump`
streams, caps and times out a VM's commands exactly as it does a container's.  Everything
read here comes from the guest, which runs anything: lengths are bounded and checked before
use, and a malformed frame ends the connection (the VM is then unreachable, never misread).
"""
from __future__ import annotations

import errno
import ipaddress
import itertools
import os
import queue
import socket
import stat as statmod
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from sandbox.backends.base import entry_kind
from sandbox.core.errors import SandboxError

T_PING, T_PONG, T_EXEC, T_STARTED, T_STDIN, T_SIGNAL = 1, 2, 3, 4, 5, 6
T_READ, T_DATA, T_END, T_WRITE, T_LIST, T_STAT, T_REMOVE, T_MKDIR, T_SYNC, T_ENTRY, T_MOUNT, T_NET = range(7, 19)
T_STDOUT, T_STDERR, T_EXIT, T_READY = 20, 21, 22, 100
HEAD = struct.Struct(">IBI")  # length of what follows the length field, type, channel
MAX_FRAME = 1 << 20  # payload bytes, both directions (the agent's MAX_FRAME)
DATA_CHUNK = 256 << 10
ENTRY_FIXED = struct.Struct(">IIIIIIIII")  # mode uid gid size_hi size_lo mtime_hi mtime_lo nlink name_len


class AgentError(SandboxError):
    """The guest agent is unreachable, or said something the protocol does not allow."""


class GuestFileError(SandboxError):
    """A file operation the guest refused; ``errno`` as the guest's kernel reported it."""

    def __init__(self, err: int, message: str) -> None:
        super().__init__(message)
        self.errno = err


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
        raise AgentError(f"agent: short entry frame ({len(p)} bytes)")
    mode, uid, gid, sh, sl, mh, ml, nlink, nl = ENTRY_FIXED.unpack_from(p)
    off = ENTRY_FIXED.size
    name = p[off:off + nl]
    off += nl
    if len(name) != nl or len(p) < off + 4:
        raise AgentError("agent: entry frame's name overruns it")
    (ll,) = struct.unpack_from(">I", p, off)
    target = p[off + 4:off + 4 + ll] if ll else None
    mtime = (mh << 32 | ml)
    if mtime >= 1 << 63:
        mtime -= 1 << 64
    return GuestStat(mode, uid, gid, sh << 32 | sl, mtime, nlink, name.decode(errors="surrogateescape"),
                     target.decode(errors="surrogateescape") if target is not None else None)


class GuestProcess:
    """A command in the guest, shaped like the ``subprocess.Popen`` that ``pump`` drives."""

    def __init__(self, conn: AgentConnection, chan: int, argv: list[str]) -> None:
        self.conn, self.chan, self.args = conn, chan, argv
        self.pid = 0
        self.returncode: int | None = None
        self._exited = threading.Event()
        out_r, self._out_w = os.pipe()
        err_r, self._err_w = os.pipe()
        in_r, in_w = os.pipe()
        self.stdout: BinaryIO = os.fdopen(out_r, "rb", buffering=0)
        self.stderr: BinaryIO = os.fdopen(err_r, "rb", buffering=0)
        self.stdin: BinaryIO | None = os.fdopen(in_w, "wb", buffering=0)
        self._in_r = in_r
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


class AgentConnection:
    """One connection to a VM's agent.  Thread-safe: any thread sends; one thread reads."""

    def __init__(self, path: Path, *, timeout: float = 30.0) -> None:
        self.path = path
        self._sock = connect_unix(path, timeout)
        self._send_lock = threading.Lock()
        self._chans = itertools.count(1)
        self._procs: dict[int, GuestProcess] = {}
        self._calls: dict[int, queue.Queue[tuple[int, bytes]]] = {}
        self._lock = threading.Lock()
        self.closed: str | None = None
        self.version: str | None = None
        self._reader = threading.Thread(target=self._read_loop, daemon=True, name=f"agent-{path.parent.name}")
        self._reader.start()

    # -- wire ----------------------------------------------------------------------------
    def send(self, kind: int, chan: int, payload: bytes = b"") -> None:
        if len(payload) > MAX_FRAME:
            raise AgentError(f"agent: frame of {len(payload)} bytes is over {MAX_FRAME}")
        if self.closed:
            raise AgentError(f"agent connection {self.path}: {self.closed}")
        with self._send_lock:
            try:
                self._sock.sendall(HEAD.pack(len(payload) + 5, kind, chan) + payload)
            except OSError as exc:
                raise AgentError(f"agent connection {self.path}: {exc}") from None

    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            got = self._sock.recv(n - len(buf))
            if not got:
                raise EOFError
            buf += got
        return bytes(buf)

    def _read_loop(self) -> None:
        why = "closed by the guest"
        try:
            while True:
                length, kind, chan = HEAD.unpack(self._recv_exact(HEAD.size))
                if not 5 <= length <= MAX_FRAME + 5:
                    why = f"the guest sent a frame of {length} bytes (at most {MAX_FRAME + 5})"
                    break
                self._dispatch(kind, chan, self._recv_exact(length - 5))
        except EOFError:
            pass
        except OSError as exc:
            why = str(exc)
        except AgentError as exc:
            why = str(exc)
        self._fail(why)

    def _dispatch(self, kind: int, chan: int, payload: bytes) -> None:
        if kind == T_READY:
            self.version = payload.decode(errors="replace")[:64]
            return
        with self._lock:
            proc = self._procs.get(chan)
            call = self._calls.get(chan)
        if proc is not None:
            if kind in (T_STDOUT, T_STDERR):
                proc._output(kind, payload)
            elif kind == T_STARTED and len(payload) == 4:
                proc.pid = struct.unpack(">I", payload)[0]
            elif kind == T_EXIT and len(payload) == 4:
                (code,) = struct.unpack(">i", payload)
                with self._lock:
                    self._procs.pop(chan, None)
                proc._finish(code if code >= 0 else 128 - code)
            elif kind == T_END and len(payload) >= 4:  # the command never started
                err = struct.unpack(">I", payload[:4])[0]
                with self._lock:
                    self._procs.pop(chan, None)
                proc._finish(127 if err == errno.ENOENT else 126, payload[4:4096] + b"\n")
            else:
                raise AgentError(f"agent: frame type {kind} is not an answer to a command")
        elif call is not None:
            call.put((kind, payload))
        # else: an answer to a request that gave up (a timeout): dropped

    def _fail(self, why: str) -> None:
        self.closed = why
        with self._lock:
            procs, self._procs = self._procs, {}
            calls = list(self._calls.values())
        for proc in procs.values():
            proc._finish(255, f"layerbox: the guest agent went away ({why})\n".encode())
        for q in calls:
            q.put((-1, why.encode()))
        try:
            self._sock.close()
        except OSError:
            pass

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._reader.join(5)

    # -- requests ------------------------------------------------------------------------
    def _call(self, kind: int, payload: bytes, *, timeout: float = 60.0,
              data: Iterator[bytes] | None = None) -> Iterator[tuple[int, bytes]]:
        """Send one request; yield its answer frames up to and including its T_END."""
        chan = next(self._chans)
        q: queue.Queue[tuple[int, bytes]] = queue.Queue()
        with self._lock:
            self._calls[chan] = q
        try:
            self.send(kind, chan, payload)
            if data is not None:
                for piece in data:
                    self.send(T_DATA, chan, piece)
                self.send(T_END, chan)
            while True:
                try:
                    frame = q.get(timeout=timeout)
                except queue.Empty:
                    raise AgentError(f"agent: no answer in {timeout:g} s") from None
                if frame[0] == -1:
                    raise AgentError(f"agent connection {self.path}: {frame[1].decode()}")
                yield frame
                if frame[0] == T_END:
                    return
        finally:
            with self._lock:
                self._calls.pop(chan, None)

    @staticmethod
    def _check_end(payload: bytes) -> None:
        if len(payload) < 4:
            raise AgentError("agent: short end frame")
        err = struct.unpack(">I", payload[:4])[0]
        if err:
            raise GuestFileError(err, payload[4:4096].decode(errors="replace"))

    def ping(self, timeout: float = 5.0) -> float:
        t = time.perf_counter()
        for kind, _payload in self._call(T_PING, b"lb", timeout=timeout):
            if kind == T_PONG:
                return time.perf_counter() - t
            raise AgentError(f"agent: frame type {kind} in answer to a ping")
        raise AgentError("agent: no pong")

    def exec(self, argv: list[str], *, env: dict[str, str], cwd: str, uid: int, gid: int) -> GuestProcess:
        chan = next(self._chans)
        proc = GuestProcess(self, chan, argv)
        with self._lock:
            self._procs[chan] = proc
        payload = (struct.pack(">II", uid, gid) + _str(cwd) + struct.pack(">I", len(argv))
                   + b"".join(_str(a) for a in argv) + struct.pack(">I", len(env))
                   + b"".join(_str(f"{k}={v}") for k, v in env.items()))
        if len(payload) > MAX_FRAME:
            with self._lock:
                self._procs.pop(chan, None)
            raise AgentError(f"command and environment take {len(payload)} bytes, over the agent's {MAX_FRAME}")
        self.send(T_EXEC, chan, payload)
        proc._forwarder.start()
        return proc

    def iter_read(self, path: str) -> Iterator[bytes]:
        for kind, payload in self._call(T_READ, _str(path)):
            if kind == T_DATA:
                yield payload
            elif kind == T_END:
                self._check_end(payload)

    def write(self, path: str, chunks: Iterator[bytes], mode: int = 0o644) -> int:
        total = 0

        def counted() -> Iterator[bytes]:
            nonlocal total
            for c in chunks:
                for i in range(0, len(c), DATA_CHUNK):
                    piece = c[i:i + DATA_CHUNK]
                    total += len(piece)
                    yield piece

        for kind, payload in self._call(T_WRITE, struct.pack(">I", mode) + _str(path), data=counted()):
            if kind == T_END:
                self._check_end(payload)
        return total

    def _entries(self, kind: int, payload: bytes) -> list[GuestStat]:
        out = []
        for k, p in self._call(kind, payload):
            if k == T_ENTRY:
                out.append(_parse_entry(p))
            elif k == T_END:
                self._check_end(p)
        return out

    def list(self, path: str) -> list[GuestStat]:
        return self._entries(T_LIST, _str(path))

    def stat(self, path: str) -> GuestStat:
        (st,) = self._entries(T_STAT, _str(path))
        return st

    def remove(self, path: str, *, recursive: bool = False) -> None:
        for kind, payload in self._call(T_REMOVE, struct.pack(">I", int(recursive)) + _str(path)):
            if kind == T_END:
                self._check_end(payload)

    def mkdir(self, path: str, mode: int = 0o755) -> None:
        for kind, payload in self._call(T_MKDIR, struct.pack(">I", mode) + _str(path)):
            if kind == T_END:
                self._check_end(payload)

    def mount(self, timeout: float = 60.0) -> None:
        """Reseed the guest's kernel RNG with 64 fresh bytes, then mount the sandbox's disk and
        root (once; again only reseeds).  Every VM of a template shares its RNG state until then."""
        for kind, payload in self._call(T_MOUNT, os.urandom(64), timeout=timeout):
            if kind == T_END:
                try:
                    self._check_end(payload)
                except GuestFileError as exc:
                    raise AgentError(f"the guest could not mount the sandbox's disk: {exc}") from None

    def net(self, address: str, prefixlen: int, gateway: str) -> None:
        """The guest's eth0 address and default route."""
        payload = struct.pack(">III", int(ipaddress.IPv4Address(address)), prefixlen,
                              int(ipaddress.IPv4Address(gateway)))
        for kind, p in self._call(T_NET, payload):
            if kind == T_END:
                try:
                    self._check_end(p)
                except GuestFileError as exc:
                    raise AgentError(f"the guest could not configure its network: {exc}") from None

    def sync(self) -> None:
        for kind, payload in self._call(T_SYNC, b"", timeout=120.0):
            if kind == T_END:
                self._check_end(payload)


def connect_unix(path: Path, timeout: float) -> socket.socket:
    """Connect through an O_PATH fd of the directory: a unix socket's path is at most 107 bytes,
    a data dir's sandbox directory can be longer."""
    dfd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        deadline = time.monotonic() + timeout
        while True:
            try:
                sock.connect(f"/proc/self/fd/{dfd}/{path.name}")
                return sock
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    sock.close()
                    raise AgentError(f"{path}: nothing listens there after {timeout:g} s") from None
                time.sleep(0.01)
    finally:
        os.close(dfd)


def entry_json(st: GuestStat) -> dict[str, Any]:
    """A guest directory entry in the shape ``RootFiles.list`` gives for a container."""
    return {"name": st.name, "type": entry_kind(st.mode), "size": st.size, "mode": statmod.S_IMODE(st.mode),
            "mtime": st.mtime_ns / 1e9}
