"""Talk to a host's lazyfetch daemon over its unix socket; start it when absent."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Final

from layerstore.hoststate import flocked, make_private_dirs
from lazyfetch.errors import LazyfetchError

START_TIMEOUT = 30.0
SHUTDOWN_RETRY = 0.5  # seconds between stop requests while the daemon's unmount is refused
STARTING = 503  # the daemon's answer to a request that needs it serving the kernel, before it does
EXIT_ALREADY_RUNNING = 3  # lazyfetch.daemon's exit status when another daemon holds the data dir
# Subtrees of a data dir that no other local user may enter (0700): what they hold came from
# images and sandboxes (layer mounts, uppers with whatever an agent wrote, metadata images,
# chunks) or says where it lies (mount state, the store's metadata cache).  The daemon makes its
# FUSE mount point blobs/ 0700 too, but the mounted file system shows its own root (0555).
PRIVATE_DIRS: Final = ("state", "layers", "uppers", "meta", "blobcache", "cache")


class DaemonUnavailable(LazyfetchError):
    """The host's lazyfetch daemon does not answer on its socket, or did not start."""

    fix = "start it with `layerbox daemon start` or run `layerbox mount` again"


class DaemonDropped(DaemonUnavailable):
    """The daemon closed the connection before it answered: it died, or was stopped, mid-request."""


class DaemonNotServing(DaemonUnavailable):
    """No daemon took the request: none listens on the socket, or the one there is still starting
    (503 until it serves the kernel).  Nothing was done, so the request can be sent again."""


def socket_path(data_dir: str | os.PathLike[str], name: str = "lazyfetch") -> Path:
    """The daemon's control socket: in the data dir, unless that path is too long for AF_UNIX."""
    path = Path(data_dir) / f"{name}.sock"
    if len(os.fsencode(path)) < 100:
        return path
    # sun_path holds 108 bytes: deep data dirs (pytest's temp paths) get a short, stable name
    digest = hashlib.sha256(os.fsencode(Path(data_dir).resolve())).hexdigest()[:20]
    return Path("/run/layerbox") / f"{name}-{digest}.sock"


def holder_socket_path(data_dir: str | os.PathLike[str]) -> Path:
    """The socket of the process that holds the daemon's kernel fds across restarts."""
    return socket_path(data_dir, "lazyfetch-holder")


def private_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` as a directory only its owner can enter: made 0700, or tightened to it when looser.

    Raises :class:`LazyfetchError` when it belongs to another user (who could open it again).
    """
    path = Path(path)
    try:
        st = os.stat(path)  # made already: every locked operation of the host's mounts asks (one stat)
    except FileNotFoundError:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise LazyfetchError(f"{path} is not a directory: a data dir's {path.name!r} must be one; move it aside")
    if st.st_uid != os.geteuid():
        raise LazyfetchError(f"{path} belongs to uid {st.st_uid}, not to this process's uid {os.geteuid()}: "
                             f"a data dir must be its owner's alone; remove it or `chown {os.geteuid()} {path}`")
    if st.st_mode & 0o077:
        os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)
    return path


def private_dirs(data_dir: str | os.PathLike[str]) -> None:
    """Make or tighten every one of the data dir's :data:`PRIVATE_DIRS`."""
    for name in PRIVATE_DIRS:
        private_dir(os.path.join(data_dir, name))


def _alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        os.waitpid(pid, os.WNOHANG)  # reap it if it is our child
    except ChildProcessError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


class DaemonClient:
    def __init__(self, data_dir: str | os.PathLike[str], *, timeout: float = 600.0) -> None:
        self.data_dir = Path(data_dir)
        self.socket = socket_path(self.data_dir)
        self.timeout = timeout

    def request(self, method: str, path: str, body: Any = None, *, timeout: float | None = None) -> Any:
        """The daemon's JSON answer; :class:`DaemonNotServing` when no daemon took the request,
        :class:`DaemonDropped` when the one that took it closed the connection without an answer,
        :class:`DaemonUnavailable` when it gave none in time."""
        conn = _UnixConnection(str(self.socket), timeout or self.timeout)
        try:
            conn.connect()
        except OSError as exc:
            conn.close()
            raise DaemonNotServing(f"lazyfetch daemon at {self.socket} is not running ({exc}); start it with "
                                   "`layerbox daemon start` or run `layerbox mount` again") from None
        try:
            payload = json.dumps(body).encode() if body is not None else None
            conn.request(method, path, body=payload, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
        except TimeoutError:
            raise DaemonUnavailable(f"lazyfetch daemon at {self.socket} did not answer {method} {path} within "
                                    f"{conn.timeout} s; see `layerbox daemon status`") from None
        except (OSError, http.client.HTTPException) as exc:
            raise DaemonDropped(f"lazyfetch daemon at {self.socket} is not answering ({exc}); "
                                "start it with `layerbox daemon start` or run `layerbox mount` again") from None
        finally:
            conn.close()
        if resp.status == STARTING:
            raise DaemonNotServing(f"lazyfetch daemon: {method} {path}: {data.decode(errors='replace')[:500]}")
        if resp.status >= 400:
            raise LazyfetchError(f"lazyfetch daemon: {method} {path} failed ({resp.status}): "
                                 f"{data.decode(errors='replace')[:500]}")
        if path == "/metrics":
            return data.decode()
        return json.loads(data)

    def health(self) -> dict[str, Any] | None:
        try:
            return dict(self.request("GET", "/health", timeout=2.0))
        except LazyfetchError:
            return None

    def ensure_running(self, store_url: str | None, *, s3_endpoint: str | None = None,
                       **options: object) -> dict[str, Any]:
        """The daemon's health, started first when none runs.

        ``options`` are the daemon's flags (lazyfetch.daemon.parse_args) by their
        Python names: ``cache_size``, ``fetch_timeout``, ``trace_seconds``,
        ``data_path``, ``fill_below``, ``fill_bandwidth``, ``fill_after_uses``, ``fill_after_seconds``,
        ``fill_max_busy``, ``fill_miss_bytes``, ``holder_grace``, ``blob_io``.
        """
        h = self.health()
        if h and h.get("ready"):
            return h
        # one starter at a time (threads of one process, or several processes): two daemons on
        # one data dir would fight over the holder's fds and the socket
        make_private_dirs(self.data_dir)
        with flocked(self.data_dir / "lazyfetch.start.lock"):  # 0600: nobody else can hold it
            return self._start_locked(store_url, s3_endpoint=s3_endpoint, options=options)

    def _start_locked(self, store_url: str | None, *, s3_endpoint: str | None,
                      options: dict[str, object]) -> dict[str, Any]:
        h = self.health()
        if h and h.get("ready"):
            return h
        if h is None:
            argv = [sys.executable, "-m", "lazyfetch.daemon", "--data-dir", str(self.data_dir)]
            if store_url:
                argv += ["--store", store_url]
            if s3_endpoint:
                argv += ["--s3-endpoint", s3_endpoint]
            for name, value in options.items():
                if value is not None:
                    argv += ["--" + name.replace("_", "-"), str(value)]
            make_private_dirs(self.data_dir)
            # (0600: it names layers and paths of this host; the data dir itself may be o+x)
            log = os.fdopen(os.open(self.data_dir / "lazyfetch.out", os.O_WRONLY | os.O_CREAT | os.O_APPEND
                                    | os.O_CLOEXEC, 0o600), "ab")
            os.fchmod(log.fileno(), 0o600)
            repo = Path(__file__).resolve().parents[1]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    start_new_session=True, close_fds=True, env=env)
            log.close()
        else:
            proc = None
        deadline = time.monotonic() + START_TIMEOUT
        try:
            while time.monotonic() < deadline:
                h = self.health()
                if h and h.get("ready"):
                    return h
                if proc is not None and proc.poll() is not None:
                    if proc.returncode == EXIT_ALREADY_RUNNING:  # one started outside this client: wait for it
                        proc = None
                        continue
                    tail = (self.data_dir / "lazyfetch.out").read_text(errors="replace")[-2000:]
                    raise DaemonUnavailable(f"lazyfetch daemon exited with {proc.returncode}:\n{tail}",
                                            fix=f"see {self.data_dir / 'lazyfetch.out'} for why it exited")
                time.sleep(0.02)
            raise DaemonUnavailable(
                f"lazyfetch daemon for {self.data_dir} did not become ready in {START_TIMEOUT:.0f} s",
                fix=f"see {self.data_dir / 'lazyfetch.out'} for what it is doing")
        except BaseException:
            # interrupted or failed while it starts: a daemon nobody can reach must not live on
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            raise

    def stop(self, timeout: float = 30.0, *, release: bool = False) -> bool:
        """Stop the daemon: True once it has exited, False when none was running.

        ``release``: nothing is mounted on its blobs any more (the caller unmounted
        every layer), so the holder lets the kernel state go too.  Without it the
        holder keeps the fds and the mounts' reads wait for the next daemon.
        """
        h = self.health()
        if h is None:
            if release:
                self._release_orphan_holder()
            return False
        pid = int(h["pid"])
        deadline = time.monotonic() + timeout
        ask_at = 0.0
        while time.monotonic() < deadline:
            if not _alive(pid):
                return True
            if time.monotonic() >= ask_at:
                try:
                    self.request("POST", "/shutdown", {"release": release}, timeout=2.0)
                except LazyfetchError:  # already closing its socket, or busy exiting
                    pass
                ask_at = time.monotonic() + SHUTDOWN_RETRY
            time.sleep(0.02)
        raise LazyfetchError(f"lazyfetch daemon {pid} did not stop within {timeout:.0f} s "
                             f"(`kill {pid}`; its log is {self.data_dir / 'lazyfetch.log'})")

    def _release_orphan_holder(self) -> None:
        """A holder whose daemon died, with nothing mounted any more: let it go."""
        from lazyfetch.holder import Holder

        holder = Holder.connect(str(holder_socket_path(self.data_dir)))
        if holder is not None:
            holder.exit()
