"""A tiny process that holds the fds the kernel's lazy-fetch state depends on.

When the last fd of a fanotify group closes, reads of holes return zeros with
no error; when the last /dev/fuse fd closes, the FUSE connection dies; a
blob's event-free write fd cannot be opened again once the blob is marked.
So the daemon gives dups of them to this holder, which outlives it and hands
them back to the next daemon.

Run as ``python -I -S lazyfetch/holder.py SOCKET [--grace S] [--ready-fd N]``
(stdlib only).  Protocol: one SOCK_SEQPACKET message per request and reply, a
JSON object plus SCM_RIGHTS fds::

  {"op": "put", "name": N, "meta": {...}} + 1 fd  -> {"ok": true}   (replaces N)
  {"op": "get_all"}  -> {"items": [[name, meta], ...], "more": bool} + their fds, <= 250 a message
  {"op": "drop", "name": N}  -> {"ok": true, "found": bool}
  {"op": "ping"}  -> {"pid": P, "generation": UUID, "names": count}
  {"op": "exit"}  -> {"ok": true}, then every fd is closed and the holder exits

Names and meta (a JSON object) are the client's; the holder tells a fanotify
group and a /dev/fuse fd by what the fd is, and reads ``{"dev": st_dev}`` (the
FUSE mount's st_dev) from a FUSE fd's meta.  Watchdog (fail closed): once no
client has been connected for ``--grace`` seconds, the holder answers every
event of its groups with FAN_DENY_ERRNO(EIO): first those a dead daemon had
read (they wait on the group's access list; :func:`sweep` answers them by fd
number), then those still queued and every later one; and it aborts its FUSE connections,
so readers get EIO instead of hanging; a connecting client stops the denying
before its first request is read.  Only peers with the holder's uid are served.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import json
import os
import resource
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

MAX_FDS = 250  # per message: the kernel's SCM_MAX_FD is 253
_MSG = 1 << 20
_RESPONSE = struct.Struct("=iI")
_DENY_EIO = 0x2 | (errno.EIO << 24)
_EVENT_LEN = struct.Struct("=I")  # event_len leads every fanotify event; fd at byte 16
# Event fds of a daemon are below this (it keeps its RLIMIT_NOFILE there), so a sweep of the
# numbers below it answers every event a dead daemon read (0.07 s)
SWEEP_FDS = 65536


@contextlib.contextmanager
def _address(path: str) -> Iterator[str]:
    """``path``, or a short alias through /proc/self/fd when it exceeds sun_path's 108 bytes."""
    if len(os.fsencode(path)) < 100:
        yield path
        return
    dfd = os.open(os.path.dirname(path) or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{dfd}/{os.path.basename(path)}"
    finally:
        os.close(dfd)


def _recv(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    fds = array.array("i")
    data, anc, flags, _ = sock.recvmsg(_MSG, socket.CMSG_SPACE(MAX_FDS * fds.itemsize),
                                       socket.MSG_CMSG_CLOEXEC)
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    try:
        if not data:
            raise EOFError
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise ValueError("message or its fds truncated")
        obj = json.loads(data)
        if not isinstance(obj, dict):
            raise ValueError("not a JSON object")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return obj, list(fds)


def _send(sock: socket.socket, obj: dict[str, Any], fds: list[int] | None = None) -> None:
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    sock.sendmsg([json.dumps(obj).encode()], anc)


def sweep(fd: int, upto: int = SWEEP_FDS) -> int:
    """Deny (EIO) every event of group ``fd`` that some process read and did not answer; how many.

    The kernel matches a response to an event by the fd number read() gave
    it, in whatever process, so every number below ``upto`` is tried (again
    after each hit: two dead handlers may have left one number twice).  Only
    safe while nobody else reads the group: it would deny their events too.
    """
    denied = 0
    for number in range(upto):
        while True:
            try:
                os.write(fd, _RESPONSE.pack(number, _DENY_EIO))
            except OSError as exc:
                if exc.errno == errno.ENOENT:
                    break  # no unanswered event has this number (any more)
                raise
            denied += 1
    return denied


def _deny_all(fd: int) -> None:
    """Answer every queued event of group ``fd`` with EIO (its fd is non-blocking now)."""
    while True:
        try:
            buf = os.read(fd, 65536)
        except BlockingIOError:
            return
        pos = 0
        while pos + 24 <= len(buf):
            (length,) = _EVENT_LEN.unpack_from(buf, pos)
            event_fd = struct.unpack_from("=i", buf, pos + 16)[0]
            if event_fd >= 0:
                try:
                    os.write(fd, _RESPONSE.pack(event_fd, _DENY_EIO))
                except OSError as exc:
                    log(f"deny of event fd {event_fd}: {exc}")
                os.close(event_fd)
            pos += max(length, 24)


_FUSECTL = "/sys/fs/fuse/connections"


def _abort_fuse(conn: int) -> None:
    """Abort FUSE connection ``conn``: its requests and later ones fail with ENOTCONN."""
    abort = f"{_FUSECTL}/{conn}/abort"
    mounted = False
    if not os.path.exists(abort) and not os.listdir(_FUSECTL):
        # fusectl is not mounted (systemd mounts it; containers often do not): mount it for
        # this one write, and take it away again, so the host is left as it was
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mount(b"fusectl", _FUSECTL.encode(), b"fusectl", ctypes.c_ulong(0), None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mounting fusectl on {_FUSECTL}: {os.strerror(err)}")
        mounted = True
    try:
        with open(abort, "w") as f:
            f.write("1")
    finally:
        if mounted:
            import ctypes

            ctypes.CDLL(None, use_errno=True).umount2(_FUSECTL.encode(), 2)  # MNT_DETACH


class _Server:
    def __init__(self, path: str, grace: float) -> None:
        self.path = path
        self.held: dict[str, tuple[int, dict[str, Any]]] = {}
        self.generation = uuid.uuid4().hex
        self.grace = grace
        self.clients: set[socket.socket] = set()
        self.alone_since = time.monotonic()
        self.kinds: dict[int, str] = {}  # held fd -> "fanotify", "fuse" or ""
        self.denying: set[int] = set()
        self.aborted: set[int] = set()
        self.sel = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        old = os.umask(0o177)
        try:
            with _address(path) as address:
                self.listener.bind(address)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        self.listener.listen(16)
        self.sel.register(self.listener, selectors.EVENT_READ)

    def _kind(self, fd: int) -> str:
        # by what the fd is, not by what the client called it
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return ""
        return {"anon_inode:[fanotify]": "fanotify", "/dev/fuse": "fuse"}.get(target, "")

    def _stop_denying(self) -> None:
        for fd in self.denying:
            self.sel.unregister(fd)
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
        self.denying.clear()

    def _watchdog(self) -> None:
        if self.clients or time.monotonic() - self.alone_since < self.grace:
            return
        for fd, _ in self.held.values():
            if fd not in self.denying and self.kinds[fd] == "fanotify":
                log(f"no client for {self.grace:g} s: denying the events of group fd {fd}")
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
                self.denying.add(fd)
                self.sel.register(fd, selectors.EVENT_READ)
                self._sweep(fd)
                _deny_all(fd)
        for name, (fd, meta) in self.held.items():
            if fd not in self.aborted and self.kinds[fd] == "fuse":
                self.aborted.add(fd)
                if not isinstance(meta.get("dev"), int):
                    log(f"cannot abort FUSE connection {name}: its meta has no dev (the mount's st_dev)")
                    continue
                dev = meta["dev"]
                conn = (os.major(dev) << 20) | os.minor(dev)  # the connection is named by s_dev
                try:
                    _abort_fuse(conn)
                    meta["aborted"] = True  # the next daemon must not adopt a dead connection
                    log(f"no client for {self.grace:g} s: aborted FUSE connection {conn} ({name})")
                except OSError as exc:
                    log(f"cannot abort FUSE connection {conn} ({name}): {exc}")

    def _sweep(self, fd: int) -> None:
        # the events the dead daemon had read: they wait on the access list, not in the queue
        try:
            denied = sweep(fd)
        except OSError as exc:
            log(f"sweep of group fd {fd}: {exc}")
            return
        if denied:
            log(f"denied {denied} event(s) of group fd {fd} that the dead daemon had read")

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != os.getuid():
            log(f"refused a client of uid {uid} (pid {pid})")
            conn.close()
            return
        self._stop_denying()  # before anything the client asks: it may adopt the group now
        conn.settimeout(10.0)  # a client that stops reading its replies cannot block the holder
        self.clients.add(conn)
        self.sel.register(conn, selectors.EVENT_READ)

    def _disconnect(self, conn: socket.socket) -> None:
        self.sel.unregister(conn)
        self.clients.discard(conn)
        conn.close()
        if not self.clients:
            self.alone_since = time.monotonic()

    def _close(self, name: str) -> bool:
        entry = self.held.pop(name, None)
        if entry is None:
            return False
        if entry[0] in self.denying:
            self.sel.unregister(entry[0])
            self.denying.discard(entry[0])
        self.aborted.discard(entry[0])
        del self.kinds[entry[0]]
        os.close(entry[0])
        return True

    def _request(self, conn: socket.socket) -> bool:
        """Serve one request; False when the holder must exit."""
        try:
            req, fds = _recv(conn)
        except (EOFError, ConnectionError):
            self._disconnect(conn)
            return True
        except ValueError as exc:
            _send(conn, {"error": f"bad request: {exc}"})
            return True
        op = req.get("op")
        if op == "put" and len(fds) == 1 and isinstance(req.get("name"), str):
            self._close(req["name"])
            fd = fds.pop()
            self.kinds[fd] = self._kind(fd)
            self.held[req["name"]] = (fd, dict(req.get("meta") or {}))
            _send(conn, {"ok": True})
        elif op == "get_all":
            items = sorted(self.held.items())
            for start in range(0, max(len(items), 1), MAX_FDS):
                batch = items[start : start + MAX_FDS]
                _send(conn, {"items": [[n, meta] for n, (_, meta) in batch],
                             "more": start + MAX_FDS < len(items)}, [fd for _, (fd, _) in batch])
        elif op == "drop" and isinstance(req.get("name"), str):
            _send(conn, {"ok": True, "found": self._close(req["name"])})
        elif op == "ping":
            _send(conn, {"pid": os.getpid(), "generation": self.generation, "names": len(self.held)})
        elif op == "exit":
            self.shutdown()  # before the reply: no client may connect to a holder that is going
            _send(conn, {"ok": True})
            return False
        else:
            _send(conn, {"error": f"unknown or malformed request {op!r} with {len(fds)} fd(s)"})
        for fd in fds:
            os.close(fd)
        return True

    def shutdown(self) -> None:
        self.sel.unregister(self.listener)
        self.listener.close()
        os.unlink(self.path)
        for name in list(self.held):
            self._close(name)
        log("exit requested: every fd closed")

    def serve(self) -> None:
        while True:
            for key, _ in self.sel.select(timeout=min(self.grace, 1.0) / 2):
                if key.fileobj is self.listener:
                    self._accept()
                elif isinstance(key.fileobj, socket.socket):
                    try:
                        if not self._request(key.fileobj):
                            return
                    except OSError as exc:  # a send timed out or the client went away
                        log(f"dropping a client: {exc!r}")
                        self._disconnect(key.fileobj)
                elif key.fd in self.denying:  # not if an accept in this batch stopped it
                    _deny_all(key.fd)
            self._watchdog()


def log(message: str) -> None:
    print(time.strftime("%Y-%m-%dT%H:%M:%S"), f"holder[{os.getpid()}]", message, flush=True)


def _harden() -> None:
    """Survive whatever the daemon does: own session, no terminal signals, no OOM kill."""
    try:
        os.setsid()
    except PermissionError:
        pass  # already a session leader
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("-1000")
    except OSError as exc:  # needs CAP_SYS_RESOURCE
        log(f"cannot set oom_score_adj to -1000: {exc}")
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main(argv: list[str]) -> int:
    path, grace, ready = argv[0], 60.0, -1
    for i, arg in enumerate(argv[1:], 1):
        if arg == "--grace":
            grace = float(argv[i + 1])
        elif arg == "--ready-fd":
            ready = int(argv[i + 1])
    _harden()
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    probe.settimeout(5.0)
    try:
        with _address(path) as address:
            probe.connect(address)
        log(f"another holder already serves {path}")
        return 3
    except TimeoutError:
        log(f"another holder listens on {path} but does not accept: leaving it alone")
        return 3
    except (FileNotFoundError, ConnectionRefusedError):
        if os.path.exists(path):
            os.unlink(path)  # a dead holder's socket
    finally:
        probe.close()
    server = _Server(path, grace)
    log(f"serving {path}, generation {server.generation}, grace {grace:g} s")
    if ready >= 0:
        os.write(ready, b"ready\n")
        os.close(ready)
    server.serve()
    return 0


# --------------------------------------------------------------------------
# client side (imported by the daemon and the CLI)


def _error(message: str) -> Exception:
    from lazyfetch.errors import HolderError  # not at the top: the holder runs with -I -S

    return HolderError(message)


class Holder:
    """A connection to the holder process; keep it open for the daemon's whole life
    (the watchdog starts ``--grace`` seconds after the last connection closes)."""

    def __init__(self, sock: socket.socket, path: str) -> None:
        self._sock = sock
        self.path = path

    @classmethod
    def spawn(cls, socket_path: str, *, grace: float = 60.0, timeout: float = 10.0) -> Holder:
        """Start a detached holder on ``socket_path`` (log: ``socket_path + ".log"``) and connect."""
        rfd, wfd = os.pipe()
        try:
            # 0600 (an older one was 0644): it names the layers this host serves
            logfd = os.open(socket_path + ".log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
            os.fchmod(logfd, 0o600)
            with os.fdopen(logfd, "ab") as logf:
                subprocess.Popen(
                    [sys.executable, "-I", "-S", os.path.abspath(__file__), socket_path,
                     "--grace", str(grace), "--ready-fd", str(wfd)],
                    stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                    start_new_session=True, close_fds=True, pass_fds=(wfd,))
            os.close(wfd)
            wfd = -1
            import select

            ready, _, _ = select.select([rfd], [], [], timeout)
            said = os.read(rfd, 16) if ready else b""
        finally:
            os.close(rfd)
            if wfd >= 0:
                os.close(wfd)
        holder = cls.connect(socket_path) if said == b"ready\n" else None
        if holder is None:
            try:
                with open(socket_path + ".log", "rb") as f:
                    tail = f.read()[-2000:].decode("utf-8", "replace").strip()
            except OSError:
                tail = ""
            raise _error(f"the fd holder on {socket_path!r} did not start within {timeout:g} s; "
                         f"its log says: {tail or '(nothing)'}")
        return holder

    @classmethod
    def connect(cls, socket_path: str, *, timeout: float = 30.0) -> Holder | None:
        """Connect to the holder serving ``socket_path``; None if none runs.

        Each later call raises :class:`HolderError` if the holder does not
        answer within ``timeout`` seconds.
        """
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        sock.settimeout(timeout)  # a hung holder fails the call instead of hanging the daemon
        try:
            with _address(socket_path) as address:
                sock.connect(address)
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            return None
        return cls(sock, socket_path)

    def _call(self, req: dict[str, Any], fds: list[int] | None = None) -> tuple[dict[str, Any], list[int]]:
        try:
            _send(self._sock, req, fds)
            reply, got = _recv(self._sock)
        except (OSError, EOFError, ValueError) as exc:
            raise _error(f"fd holder on {self.path!r}: {req['op']} failed: {exc!r}") from None
        if "error" in reply:
            raise _error(f"fd holder on {self.path!r}: {reply['error']}")
        return reply, got

    def put(self, name: str, fd: int, meta: dict[str, Any] | None = None) -> None:
        """Give the holder a dup of ``fd`` under ``name`` (replacing any fd of that name)."""
        self._call({"op": "put", "name": name, "meta": meta or {}}, [fd])

    def get_all(self) -> dict[str, tuple[int, dict[str, Any]]]:
        """Every held fd, as new fds of this process (close them when done)."""
        out: dict[str, tuple[int, dict[str, Any]]] = {}
        reply, fds = self._call({"op": "get_all"})
        while True:
            if len(fds) != len(reply["items"]):
                raise _error(f"fd holder sent {len(fds)} fds for {len(reply['items'])} names")
            for (name, meta), fd in zip(reply["items"], fds, strict=True):
                out[name] = (fd, meta)
            if not reply["more"]:
                return out
            try:
                reply, fds = _recv(self._sock)
            except (OSError, EOFError, ValueError) as exc:
                raise _error(f"fd holder on {self.path!r}: get_all failed: {exc!r}") from None

    def drop(self, name: str) -> bool:
        """Close the held fd ``name``; whether there was one."""
        return bool(self._call({"op": "drop", "name": name})[0]["found"])

    def ping(self) -> dict[str, Any]:
        """``{"pid", "generation", "names"}``: the generation is new with every holder process."""
        return self._call({"op": "ping"})[0]

    def exit(self) -> None:
        """Make the holder close every fd and exit (only when nothing is mounted)."""
        self._call({"op": "exit"})
        self.close()

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> Holder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
