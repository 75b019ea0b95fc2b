"""The host side of the guest agent protocol against a guest that lies, floods or stalls.

A scripted guest (:class:`FakeGuest`) plays the agent's end of the socket; the host is the real
:class:`~sandbox.backends.vm.agent.AgentConnection`.  What each test holds the host to: its
memory stays bounded whatever the guest sends (the process's peak RSS, and what the guest
could push before the host stopped reading), a guest that breaks the protocol has its
connection ended and is reported as misbehaved, and an honest guest (an agent from before
HELLO, or one that is merely slow, big or cancelled) is not.

No QEMU here: tests/test_sandbox_microvm.py has the same attacks on a real guest.
"""
from __future__ import annotations

import errno
import os
import queue
import re
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.memory import PeakRss

from sandbox.backends.vm import assets as vmassets
from sandbox.backends.vm.agent import (
    DATA_CHUNK,
    ENTRY_FIXED,
    HEAD,
    HELLO_CHANNEL,
    MAX_STREAMS,
    PROTOCOL,
    T_CONNECT,
    T_DATA,
    T_END,
    T_ENTRY,
    T_EXEC,
    T_HELLO,
    T_LIST,
    T_MORE,
    T_OPENED,
    T_PING,
    T_PONG,
    T_PTY,
    T_READ,
    T_READY,
    T_STARTED,
    T_STAT,
    T_STDOUT,
    T_WATCH,
    TOKEN,
    WINDOW,
    AgentConnection,
    AgentError,
    AgentMisbehaved,
    AgentTooOld,
    GuestFileError,
)

# What a host without bounds would have taken in before a test looks: the guest stops there, so
# a test that fails does so without taking the machine's memory.
MOST = 256 << 20


def frame(kind: int, chan: int, payload: bytes = b"") -> bytes:
    return HEAD.pack(len(payload) + 5, kind, chan) + payload


def end(chan: int, err: int = 0) -> bytes:
    return frame(T_END, chan, struct.pack(">I", err) + (os.strerror(err).encode() if err else b""))


def entry(chan: int, name: bytes) -> bytes:
    return frame(T_ENTRY, chan, ENTRY_FIXED.pack(0o100644, 0, 0, 0, 1, 0, 0, 1, len(name)) + name + bytes(4))


Answer = Callable[["FakeGuest", int, int, bytes], Iterator[bytes]]


class FakeGuest:
    """The guest's end of an agent socket, as a test scripts it.

    A reader thread takes what the host sends (``received``; a READ's or LIST's credit and every
    MORE go to ``credit``, an END on a stream to ``cancelled``); a writer thread answers each
    request with the frames ``answer(guest, kind, chan, payload)`` yields, an iterator that may
    never end, blocking as the agent's write does when the host stops reading, and stopping for
    good at ``most`` bytes.  ``hello``: HELLO is answered as an agent with credit does, else as
    one from before it (ENOSYS).  ``before``: sent first, as an earlier connection's leftovers.
    """

    def __init__(self, tmp_path: Path, answer: Answer, *, hello: bool = True, before: bytes = b"",
                 most: int = MOST, version: bytes = b"fake/2") -> None:
        self.path = tmp_path / "agent.sock"
        self.answer, self.hello, self.most, self.version = answer, hello, most, version
        self.received: list[tuple[int, int, bytes]] = []
        self.credit: dict[int, int] = {}
        self.cancelled: set[int] = set()
        self.sent = 0
        self.closed = False  # the host ended the connection
        self.cond = threading.Condition()
        self._requests: queue.Queue[tuple[int, int, bytes] | None] = queue.Queue()
        self._srv = socket.socket(socket.AF_UNIX)
        self._srv.bind(str(self.path))
        self._srv.listen(1)
        self._conn: socket.socket | None = None
        self._before = before
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._write, daemon=True).start()

    def _read(self) -> None:
        conn, _ = self._srv.accept()
        self._conn = conn
        with self.cond:
            self.cond.notify_all()
        buf = b""
        try:
            while got := conn.recv(1 << 16):
                buf += got
                while len(buf) >= HEAD.size and len(buf) >= 4 + HEAD.unpack_from(buf)[0]:
                    length, kind, chan = HEAD.unpack_from(buf)
                    payload, buf = buf[HEAD.size:4 + length], buf[4 + length:]
                    self._take(kind, chan, payload)
        except OSError:
            pass
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self._requests.put(None)

    def _take(self, kind: int, chan: int, payload: bytes) -> None:
        with self.cond:
            self.received.append((kind, chan, payload))
            if kind in (T_READ, T_LIST):
                (n,) = struct.unpack(">I", payload[:4])
                if len(payload) == 4 + n + 4:  # the host's credit follows the path
                    self.credit[chan] = struct.unpack(">I", payload[-4:])[0]
            elif kind == T_MORE:
                self.credit[chan] = self.credit.get(chan, 0) + struct.unpack(">I", payload)[0]
            elif kind == T_END and chan in self.credit:
                self.cancelled.add(chan)
            self.cond.notify_all()
        if kind not in (T_MORE, T_END, T_DATA):
            self._requests.put((kind, chan, payload))

    def _write(self) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self._conn is not None)
        conn = self._conn
        assert conn is not None
        try:
            conn.sendall(self._before)
            while (request := self._requests.get()) is not None:
                kind, chan, payload = request
                if kind == T_HELLO:
                    reply = [frame(T_HELLO, chan, payload[:TOKEN] + self.version)] if self.hello else [end(chan, errno.ENOSYS)]
                else:
                    reply = self.answer(self, kind, chan, payload)
                for f in reply:
                    if self.sent >= self.most:
                        break
                    conn.sendall(f)
                    self.sent += len(f)
        except OSError:
            pass  # the host ended the connection

    def stream(self, chan: int, data: Iterator[bytes], kind: int = T_DATA) -> Iterator[bytes]:
        """Frames of ``data`` (DATA payloads, or whole ENTRY frames) as an honest agent sends them:
        while the host's credit lasts (a DATA frame within it, an ENTRY past it by one), until a cancel."""
        for piece in data:
            while piece:
                with self.cond:
                    self.cond.wait_for(lambda: self.credit.get(chan, 0) > 0 or chan in self.cancelled or self.closed)
                    if chan in self.cancelled or self.closed:
                        yield end(chan, errno.ECANCELED)
                        return
                    if kind == T_DATA:
                        out, piece = frame(T_DATA, chan, piece[:self.credit[chan]]), piece[self.credit[chan]:]
                    else:
                        out, piece = piece, b""
                    self.credit[chan] -= len(out) - HEAD.size
                yield out
        yield end(chan)

    def sent_settles(self, seconds: float = 1.0) -> int:
        """What the guest has sent once it stopped sending for a while (it waits for the host)."""
        last, since = -1, time.monotonic()
        while time.monotonic() - since < seconds:
            if self.sent != last:
                last, since = self.sent, time.monotonic()
            time.sleep(0.05)
        return last


Connect = Callable[[FakeGuest], tuple[AgentConnection, list[str]]]


@pytest.fixture
def connect() -> Iterator[Connect]:
    """The host's connection to a guest, and the reasons its watcher was told of (what marks a sandbox)."""
    made: list[AgentConnection] = []

    def open_conn(guest: FakeGuest) -> tuple[AgentConnection, list[str]]:
        conn = AgentConnection(guest.path, timeout=5)
        made.append(conn)
        marked: list[str] = []
        conn.watch(marked.append)
        return conn, marked

    yield open_conn
    for conn in made:
        conn.close()


def endless(chan: int) -> Iterator[bytes]:
    while True:
        yield frame(T_DATA, chan, b"x" * DATA_CHUNK)


def wait_closed(conn: AgentConnection) -> str:
    deadline = time.monotonic() + 10
    while conn.closed is None:
        assert time.monotonic() < deadline, "the host never ended the connection"
        time.sleep(0.01)
    return conn.closed


# What the process's peak may rise by without the host having buffered a stream: the fake guest
# runs in this process, its threads and their malloc arenas add some MiB (9-10 measured in CI). A
# host that buffered would rise by the whole stream, four times this, or without bound.
NOISE = 32 << 20


# -- floods ------------------------------------------------------------------------------------------
def test_a_guest_that_answers_a_read_with_endless_data_is_cut_off(tmp_path: Path, connect: Connect) -> None:
    guest = FakeGuest(tmp_path, lambda g, kind, chan, p: endless(chan) if kind == T_READ else iter(()))
    conn, marked = connect(guest)
    peak = PeakRss()
    got = 0

    def take_slowly() -> None:  # a slow caller: the guest may not fill the host meanwhile
        nonlocal got
        for piece in conn.iter_read("/big", timeout=5):
            got += len(piece)
            time.sleep(0.01)

    with pytest.raises(AgentMisbehaved, match="asked for"):
        take_slowly()
    print(f"endless read: the host took {got} bytes, the guest pushed {guest.sent_settles()}, peak RSS +{peak.mib()}")
    assert got <= WINDOW
    assert guest.sent_settles() < WINDOW + (4 << 20)  # its window, a frame and the socket's buffers
    assert peak.grew < NOISE
    assert conn.misbehaved is not None
    assert "with 0 asked for" in conn.misbehaved
    assert marked == [conn.misbehaved]  # the backend marks its sandbox from this
    with pytest.raises(AgentMisbehaved, match="no longer talks to it"):
        conn.stat("/x")


def test_a_stalled_reader_leaves_the_guest_waiting_not_the_host_buffering(tmp_path: Path, connect: Connect) -> None:
    size = 4 * NOISE

    def answer(g: FakeGuest, kind: int, chan: int, p: bytes) -> Iterator[bytes]:
        if kind == T_PING:
            return iter([frame(T_PONG, chan, p)])
        return g.stream(chan, (bytes([i % 251]) * DATA_CHUNK for i in range(size // DATA_CHUNK)))

    guest = FakeGuest(tmp_path, answer)
    conn, marked = connect(guest)
    peak = PeakRss()
    pieces = conn.iter_read("/big")
    first = next(pieces)
    stalled = guest.sent_settles()
    assert stalled <= len(first) + WINDOW + (64 << 10), stalled  # its credit, and not a byte more
    total = len(first) + sum(len(p) for p in pieces)
    assert total == size
    assert peak.grew < NOISE
    # credit for what the caller took, but for the last frames, taken after the stream's end
    assert size - WINDOW <= sum(struct.unpack(">I", p)[0] for k, _, p in guest.received if k == T_MORE) <= size
    assert conn.ping() > 0
    assert marked == []


def test_an_agent_without_credit_waits_in_its_write_while_the_caller_does(tmp_path: Path, connect: Connect) -> None:
    guest = FakeGuest(tmp_path, lambda g, kind, chan, p: endless(chan) if kind == T_READ else iter(()),
                      hello=False)
    conn, marked = connect(guest)
    peak = PeakRss()
    pieces = conn.iter_read("/big")
    next(pieces)
    stalled = guest.sent_settles()
    assert stalled < WINDOW + (4 << 20), stalled  # the reader stopped reading: the guest blocks
    pieces.close()  # the caller leaves: what the old agent sends on is read and dropped
    deadline = time.monotonic() + 30
    while guest.sent < MOST:
        assert time.monotonic() < deadline, f"the host stopped reading at {guest.sent} bytes"
        time.sleep(0.05)
    print(f"old agent: {stalled} bytes sent while the caller stalled, {MOST} dropped after, peak RSS +{peak.mib()}")
    assert peak.grew < 8 << 20
    assert (conn.closed, conn.misbehaved, marked) == (None, None, [])  # a big file is no lie


def test_a_small_read_asks_for_no_more_than_it_keeps(tmp_path: Path, connect: Connect) -> None:
    def answer(g: FakeGuest, kind: int, chan: int, p: bytes) -> Iterator[bytes]:
        if kind == T_PING:
            return iter([frame(T_PONG, chan, p)])
        return g.stream(chan, iter([b"\0" * DATA_CHUNK] * 4096))  # a 1 GiB /proc/meminfo

    guest = FakeGuest(tmp_path, answer)
    conn, marked = connect(guest)
    with pytest.raises(GuestFileError, match="more than 65536 bytes") as exc:
        conn.read("/proc/meminfo", limit=64 << 10)
    assert exc.value.errno == errno.EFBIG
    assert guest.sent_settles() <= (64 << 10) + 1 + 128  # what was asked for, HELLO's answer, END, headers
    (chan,) = [c for k, c, _ in guest.received if k == T_READ]
    assert chan in guest.cancelled  # the host ended the read: the agent closes the file
    assert conn.ping() > 0
    assert marked == []


def test_a_listing_that_never_ends_is_refused_past_its_limit(tmp_path: Path, connect: Connect) -> None:
    def answer(g: FakeGuest, kind: int, chan: int, p: bytes) -> Iterator[bytes]:
        if kind == T_PING:
            return iter([frame(T_PONG, chan, p)])
        names = (entry(chan, b"f%09d" % i) for i in range(10**9))
        return g.stream(chan, names, T_ENTRY)

    guest = FakeGuest(tmp_path, answer)
    conn, marked = connect(guest)
    peak = PeakRss()
    with pytest.raises(GuestFileError, match="more than 5000 entries") as exc:
        conn.list("/", limit=5000)
    assert exc.value.errno == errno.EOVERFLOW
    assert peak.grew < 8 << 20
    assert guest.sent_settles() < (5000 + 1) * 70 + WINDOW
    assert conn.ping() > 0
    assert marked == []


def test_a_command_that_floods_its_output_waits_on_the_pipe(tmp_path: Path, connect: Connect) -> None:
    def answer(g: FakeGuest, kind: int, chan: int, p: bytes) -> Iterator[bytes]:
        if kind == T_EXEC:
            yield frame(T_STARTED, chan, struct.pack(">I", 42))
            while True:
                yield frame(T_STDOUT, chan, b"y\n" * (DATA_CHUNK // 2))

    guest = FakeGuest(tmp_path, answer)
    conn, marked = connect(guest)
    peak = PeakRss()
    proc = conn.exec(["yes"], env={}, cwd="/", uid=0, gid=0)
    assert guest.sent_settles() < 4 << 20  # the pipe is full and nobody reads it: the guest waits
    assert len(proc.stdout.read(1 << 16)) > 0
    assert peak.grew < 8 << 20
    assert (conn.closed, marked) == (None, [])
    proc.stdout.close()  # the pump gone: what the guest sends on goes nowhere


def test_streams_and_requests_per_connection_are_bounded(tmp_path: Path, connect: Connect) -> None:
    def answer(g: FakeGuest, kind: int, chan: int, p: bytes) -> Iterator[bytes]:
        return iter(())  # it never answers, never ends a stream

    guest = FakeGuest(tmp_path, answer)
    conn, marked = connect(guest)
    for _ in range(MAX_STREAMS):
        with pytest.raises(AgentError, match="no answer in 0.2 s"):
            next(conn.iter_read("/x", timeout=0.2))  # given up: its slot is held until its end comes
    with pytest.raises(AgentError, match=f"{MAX_STREAMS} reads are waiting for its answers already"):
        next(conn.iter_read("/x", timeout=0.2))
    deadline = time.monotonic() + 5
    while len(guest.cancelled) < MAX_STREAMS:  # each one cancelled (from a thread of its own)
        assert time.monotonic() < deadline, guest.cancelled
        time.sleep(0.01)
    assert marked == []


# -- lies --------------------------------------------------------------------------------------------
def test_an_answer_to_a_request_nobody_made_ends_the_connection(tmp_path: Path, connect: Connect) -> None:
    guest = FakeGuest(tmp_path, lambda g, kind, chan, p: iter([end(chan + 1000)]))
    conn, marked = connect(guest)
    with pytest.raises(AgentMisbehaved, match="which the host never opened"):
        conn.stat("/x")
    assert marked == [conn.misbehaved]


def test_an_answer_after_its_end_ends_the_connection(tmp_path: Path, connect: Connect) -> None:
    guest = FakeGuest(tmp_path, lambda g, kind, chan, p: iter([entry(chan, b"x"), end(chan), end(chan)]))
    conn, marked = connect(guest)
    assert conn.stat("/x").name == "x"
    assert "after that request's end" in wait_closed(conn)
    assert marked == [conn.misbehaved]
    with pytest.raises(AgentMisbehaved):
        conn.stat("/x")


def test_an_answer_of_the_wrong_type_ends_the_connection(tmp_path: Path, connect: Connect) -> None:
    guest = FakeGuest(tmp_path, lambda g, kind, chan, p: iter([frame(T_DATA, chan, b"no")]))
    conn, marked = connect(guest)
    with pytest.raises(AgentMisbehaved, match=f"request of type {T_STAT} .* with a frame of type {T_DATA}"):
        conn.stat("/x")
    assert marked == [conn.misbehaved]


def test_a_frame_over_the_limit_ends_the_connection(tmp_path: Path, connect: Connect) -> None:
    # a guest claiming a 4 GiB frame: the host must not try to read (or allocate) it
    guest = FakeGuest(tmp_path, lambda g, kind, chan, p: iter([HEAD.pack(0xFFFFFFF0, T_PONG, chan)]))
    conn, marked = connect(guest)
    with pytest.raises(AgentMisbehaved, match="frame of 4294967280 bytes"):
        conn.ping(timeout=5)
    assert conn.closed is not None
    assert "at most" in conn.closed
    assert marked == [conn.misbehaved]


def test_an_entry_frame_with_a_lying_name_length_ends_the_connection(tmp_path: Path, connect: Connect) -> None:
    bad = ENTRY_FIXED.pack(0o100644, 0, 0, 0, 1, 0, 0, 1, 1 << 30) + b"x" * 8
    guest = FakeGuest(tmp_path, lambda g, kind, chan, p: iter([frame(T_ENTRY, chan, bad)]))
    conn, marked = connect(guest)
    with pytest.raises(AgentMisbehaved, match="sent a bad entry frame: its name overruns it"):
        conn.stat("/x")
    assert marked == [conn.misbehaved]


def test_an_unasked_hello_answer_ends_the_connection(tmp_path: Path, connect: Connect) -> None:
    def answer(g: FakeGuest, kind: int, chan: int, p: bytes) -> Iterator[bytes]:
        yield frame(T_HELLO, 0xFFFF_FFFF, b"\0" * TOKEN + b"again")

    guest = FakeGuest(tmp_path, answer)
    conn, marked = connect(guest)
    with pytest.raises(AgentMisbehaved, match="HELLO the host did not send"):
        conn.ping(timeout=5)


# -- honest guests are not marked ----------------------------------------------------------------------
def test_an_earlier_connections_leftovers_before_the_hello_answer_are_dropped(tmp_path: Path, connect: Connect) -> None:
    # the torn end of a frame the guest was writing when its memory was saved, an earlier
    # connection's frames, and a restored guest's answer to a HELLO of its template's boot
    torn = frame(T_DATA, 7, b"\xff" * 1000)[100:]
    stale_hello = frame(T_HELLO, HELLO_CHANNEL, b"\1" * TOKEN + b"lb-agent/2")
    leftovers = torn + frame(T_STDOUT, 3, b"old output") + end(1) + stale_hello
    guest = FakeGuest(tmp_path, lambda g, kind, chan, p: iter([frame(T_PONG, chan, p)]), before=leftovers)
    conn, marked = connect(guest)
    assert conn.ping() > 0
    assert conn.speaks_hello
    assert conn.version == "fake/2"
    assert (conn.closed, marked) == (None, [])


def test_an_agent_from_before_hello_is_spoken_to_as_before(tmp_path: Path, connect: Connect) -> None:
    def answer(g: FakeGuest, kind: int, chan: int, p: bytes) -> Iterator[bytes]:
        yield frame(T_STDOUT, 999, b"an earlier connection's command")  # dropped, as ever
        yield frame(T_PONG, chan, p) if kind == T_PING else frame(T_DATA, chan, b"hi") + end(chan)

    # and, before our HELLO's answer and after it, answers to HELLOs of its template's boot
    stale = end(HELLO_CHANNEL, errno.EAGAIN)
    guest = FakeGuest(tmp_path, lambda g, kind, chan, p: iter([stale, *answer(g, kind, chan, p)]), hello=False,
                      before=frame(T_READY, 0, b"lb-agent/1") + stale)
    conn, marked = connect(guest)
    assert conn.ping() > 0
    assert not conn.speaks_hello
    assert conn.read("/f", limit=10) == b"hi"
    assert [p for k, _, p in guest.received if k == T_READ] == [struct.pack(">I", 2) + b"/f"]  # no credit
    assert (conn.closed, marked) == (None, [])
    conn.close()
    assert conn.closed == "closed by the host"


def test_a_read_through_the_files_api_maps_the_guests_answers(tmp_path: Path, connect: Connect) -> None:
    from sandbox.backends.vm.files import GuestFiles

    def answer(g: FakeGuest, kind: int, chan: int, p: bytes) -> Iterator[bytes]:
        if kind == T_READ:
            return g.stream(chan, iter([b"a" * 100, b"b" * 100]))
        return iter([end(chan, errno.ENOENT)])

    guest = FakeGuest(tmp_path, answer)
    conn, _ = connect(guest)
    files = GuestFiles(lambda: conn)
    assert files.read("/f") == b"a" * 100 + b"b" * 100
    with pytest.raises(OSError, match="more than 150 bytes") as exc:
        files.read("/f", limit=150)
    assert exc.value.errno == errno.EFBIG
    with pytest.raises(FileNotFoundError):
        files.stat("/missing")


# -- protocol 3: terminals, ports, watches -----------------------------------------------------------
def wait_marked(marked: list[str]) -> None:
    deadline = time.monotonic() + 10
    while not marked:
        assert time.monotonic() < deadline, "the host never marked the guest"
        time.sleep(0.01)


def connect_port_or_cut(conn: AgentConnection) -> socket.socket | None:
    """Port 8000 of a guest that lies right after it said the connection is open: the caller's
    end, or None when the lie came before the connect's answer was taken (AgentMisbehaved)."""
    try:
        return conn.connect_port(8000, 5.0)
    except AgentMisbehaved:
        return None


@pytest.mark.parametrize("version", [b"lb-agent/2", b"fake/3", b""])
def test_an_older_agent_is_never_asked_for_a_terminal_a_port_or_a_watch(tmp_path: Path, connect: Connect,
                                                                         version: bytes) -> None:
    guest = FakeGuest(tmp_path, lambda g, kind, chan, p: iter([end(chan, errno.ENOSYS)]), version=version)
    conn, marked = connect(guest)
    with pytest.raises(AgentTooOld, match=r"a terminal \(pty\) needs a guest agent of protocol 3.*layerbox vm assets"):
        conn.exec(["sh"], env={}, cwd="/", uid=0, gid=0, stdin_fd=os.open(os.devnull, os.O_RDONLY), terminal=(80, 24))
    with pytest.raises(AgentTooOld, match="a port connection needs"):
        conn.connect_port(8000, 5.0)
    with pytest.raises(AgentTooOld, match="a directory watch needs"):
        conn.watch_dir("/tmp", recursive=False, uid=0, gid=0)
    assert not [k for k, _, _ in guest.received if k in (T_PTY, T_CONNECT, T_WATCH)]  # refused, never sent
    assert (conn.closed, marked) == (None, [])


def test_a_port_the_guest_floods_past_its_window_is_cut_off(tmp_path: Path, connect: Connect) -> None:
    def answer(g: FakeGuest, kind: int, chan: int, p: bytes) -> Iterator[bytes]:
        if kind == T_CONNECT:
            yield frame(T_OPENED, chan)
            yield from endless(chan)  # whatever the host's credit says

    guest = FakeGuest(tmp_path, answer, version=b"lb-agent/3")
    conn, marked = connect(guest)
    peak = PeakRss()
    sock = connect_port_or_cut(conn)  # nobody reads it
    try:
        assert "connection to port 8000" in wait_closed(conn)
        wait_marked(marked)  # (told after the connection was closed)
        assert marked == [conn.misbehaved]
        assert guest.sent < 4 << 20
        assert peak.grew < NOISE
    finally:
        if sock is not None:
            sock.close()


def test_a_guest_that_gives_back_more_than_the_host_sent_is_cut_off(tmp_path: Path, connect: Connect) -> None:
    def answer(g: FakeGuest, kind: int, chan: int, p: bytes) -> Iterator[bytes]:
        if kind == T_CONNECT:
            yield frame(T_OPENED, chan)
            yield frame(T_MORE, chan, struct.pack(">I", 1 << 30))  # "my socket took 1 GiB of yours"

    guest = FakeGuest(tmp_path, answer, version=b"lb-agent/3")
    conn, marked = connect(guest)
    sock = connect_port_or_cut(conn)
    try:
        assert "connection to port 8000" in wait_closed(conn)
        wait_marked(marked)  # (told after the connection was closed)
        assert marked == [conn.misbehaved]
        if sock is not None:
            sock.settimeout(10)
            assert sock.recv(10) == b""  # the caller's end sees the connection end
    finally:
        if sock is not None:
            sock.close()


def test_a_refused_port_is_the_callers_connection_refused(tmp_path: Path, connect: Connect) -> None:
    guest = FakeGuest(tmp_path, lambda g, kind, chan, p: iter([end(chan, errno.ECONNREFUSED)]),
                      version=b"lb-agent/3")
    conn, marked = connect(guest)
    with pytest.raises(ConnectionRefusedError, match="127.0.0.1:8000"):
        conn.connect_port(8000, 5.0)
    assert conn.stat  # the connection goes on
    assert (conn.closed, marked) == (None, [])


def test_the_guest_agent_speaks_the_hosts_protocol() -> None:
    """agent.c's version is the host's PROTOCOL: built assets record it (capabilities), the host asks by it."""
    source = (Path(vmassets.GUEST_DIR) / "agent.c").read_text()
    (version,) = re.findall(r'#define AGENT_VERSION "lb-agent/(\d+)"', source)
    assert int(version) == PROTOCOL


def test_assets_built_before_protocol_3_say_so() -> None:
    """A set's manifest records its agent's protocol; one from before the field is protocol 2
    (capabilities then lack terminals and ports: sandbox/backends/vm/backend.py)."""
    def made(manifest: dict[str, object]) -> vmassets.Assets:
        return vmassets.Assets("k", Path("/nowhere"), Path("/k"), Path("/i"), Path("/f"), manifest)

    assert made({}).agent_protocol == 2
    assert made({"agent_protocol": 3}).agent_protocol == 3
    assert made({"agent_protocol": "3"}).agent_protocol == 2  # not the builder's: the oldest it can be
