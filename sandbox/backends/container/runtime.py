"""``OciRuntime``: the one wrapper around crun, and the host preflight it needs.

Every process crun runs for us starts through :func:`sandbox.core.procs.spawn` (argv lists,
a new session so a timeout can kill the whole process group, stderr captured).  One-shot runtime commands use :meth:`OciRuntime._run`, which adds the timeout
and turns a non-zero exit into :class:`RuntimeFailed` carrying crun's stderr;
``exec`` streams and so gets the ``Popen`` itself.

The runtime's state lives under ``--root`` (the manager's data dir), so two
managers (two tests, two "hosts") never see each other's containers.

crun runs from a sealed copy of its binary (:class:`SealedBinary`), so that it does not copy
itself at every command.
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import itertools
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from layerstore.hoststate import closed_dir
from sandbox.core.errors import RuntimeFailed, RuntimeTimeout
from sandbox.core.procs import descendants, kill_group, process_table, spawn, wait_exit

log = logging.getLogger("layerbox.sandbox")

DEFAULT_TIMEOUT = 30.0


MFD_EXEC = 0x10  # memfd_create: executable, whatever vm.memfd_noexec says (Linux 6.3+; older ones ignore it)
F_ADD_SEALS = 1033
SEALED = 0x1 | 0x2 | 0x4 | 0x8  # F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE: what crun checks for
_links = itertools.count()


class SealedBinary:
    """A copy of ``binary`` in a sealed memfd, run by a symlink ``<copy_dir>/<pid>-<n>/<name>``.

    crun 1.x copies itself and re-executes the copy at every command, its defence against a
    container rewriting the host's binary through ``/proc/<pid>/exe`` (CVE-2019-5736), unless
    it already runs from a memfd sealed against writes (3.0 -> 1.6 ms a command here, measured).
    The symlink keeps the process's name (``comm`` is the last part of the path executed);
    a directory of a process that is gone (a crash) is removed by the next one.
    """

    def __init__(self, binary: str, copy_dir: Path) -> None:
        self.fd = os.memfd_create(os.path.basename(binary), os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | MFD_EXEC)
        try:
            with open(binary, "rb") as src:
                while chunk := src.read(1 << 20):
                    os.write(self.fd, chunk)
            fcntl.fcntl(self.fd, F_ADD_SEALS, SEALED)
            copy_dir.mkdir(mode=0o700, exist_ok=True)
            for old in copy_dir.iterdir():
                pid = old.name.split("-", 1)[0]
                if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                    shutil.rmtree(old, ignore_errors=True)
            self.dir = copy_dir / f"{os.getpid()}-{next(_links)}"
            self.dir.mkdir(mode=0o700)
            self.path = self.dir / os.path.basename(binary)
            self.path.symlink_to(f"/proc/{os.getpid()}/fd/{self.fd}")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if getattr(self, "dir", None) is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
        os.close(self.fd)


def _memory_file(name: str) -> IO[bytes]:
    """An unnamed file in memory (``memfd_create``), for a child's stdout or stderr."""
    return os.fdopen(os.memfd_create(name, os.MFD_CLOEXEC), "w+b")


class OciRuntime:
    """crun with a private ``--root``; every method is one crun command.

    ``copy_dir``: where crun runs from a sealed copy of itself (:class:`SealedBinary`), made
    before its first command; after :meth:`close` commands run the installed binary.
    """

    def __init__(self, root: str | os.PathLike[str], *, binary: str = "crun",
                 timeout: float = DEFAULT_TIMEOUT, copy_dir: Path | None = None,
                 legacy_root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root)
        # where an older layerbox kept crun's state (the data dir's disk): its containers stay
        # there for their whole life, found by their directory (root_of), and new ones go to root
        self.legacy_root = Path(legacy_root) if legacy_root is not None else None
        self.installed = shutil.which(binary) or binary
        self.timeout = timeout
        self._copy_dir = copy_dir
        self._path: str | None = None
        self._sealed: SealedBinary | None = None
        self._closed = False
        self._copy_lock = threading.Lock()

    @property
    def binary(self) -> str:
        """The path crun runs by: its sealed copy once made."""
        if self._copy_dir is None or self._closed:
            return self.installed
        bound = self._path
        if bound is None:
            with self._copy_lock:
                if self._closed:
                    return self.installed
                if self._path is None:
                    self._path = self._seal(self._copy_dir)
                bound = self._path
        return bound

    def _seal(self, copy_dir: Path) -> str:
        """The sealed copy's path, or the installed binary where it cannot run (logged)."""
        try:
            sealed = SealedBinary(self.installed, copy_dir)
        except OSError as exc:
            log.warning("crun runs from %s, not from a sealed copy (%s): each command copies itself", self.installed, exc)
            return self.installed
        try:
            probe = subprocess.run([str(sealed.path), "--version"], capture_output=True, check=False, timeout=10)
        except subprocess.TimeoutExpired:
            probe = subprocess.CompletedProcess([], -1, b"", b"no answer to --version in 10 s")
        if probe.returncode != 0:  # e.g. vm.memfd_noexec=2
            sealed.close()
            log.warning("crun runs from %s: its sealed copy does not run (%s)", self.installed,
                        probe.stderr.decode(errors="replace").strip() or f"exit {probe.returncode}")
            return self.installed
        self._sealed = sealed
        return str(sealed.path)

    def close(self) -> None:
        with self._copy_lock:
            self._closed = True
            if self._sealed is not None:
                self._sealed.close()
                self._sealed = None

    def root_of(self, cid: str) -> Path:
        """The ``--root`` that holds container ``cid``'s state (or will: a new one's is root)."""
        if self.legacy_root is not None and (self.legacy_root / cid).is_dir():
            return self.legacy_root
        return self.root

    def argv(self, *args: str, root: Path | None = None) -> list[str]:
        return [self.binary, "--root", str(root or self.root), *args]

    def _run(self, *args: str, on: str | None = None, root: Path | None = None, timeout: float | None = None,
             check: bool = True, sched_idle: bool = False) -> subprocess.CompletedProcess[bytes]:
        """One crun command; ``on``: the container it is about, whose ``--root`` it gets."""
        # Files, not pipes: `crun create` hands its stdio to the container's init, which would
        # hold a pipe open (and a communicate() waiting) for its whole life.  Memory files, not
        # temp files of /tmp: on ext4 without a journal each new inode skips every one freed in
        # the last minute (``recently_deleted``), 0.4-0.9 ms a file on a busy host (measured).
        # crun's state (each container's pid, bundle, locks) is for root alone, like the manager's
        root = root or (self.root_of(on) if on is not None else self.root)
        closed_dir(root)
        argv = self.argv(*args, root=root)
        limit = timeout or self.timeout
        with _memory_file("crun-out") as out, _memory_file("crun-err") as err:
            proc = spawn(argv, stdout=out, stderr=err, sched_idle=sched_idle)
            try:
                wait_exit(proc, limit)
            except subprocess.TimeoutExpired:
                kill_group(proc)
                err.seek(0)
                raise RuntimeTimeout(f"{' '.join(argv)}: no answer in {limit}s (process group killed): "
                                     f"{err.read(4096).decode(errors='replace').strip()}", argv=argv) from None
            finally:
                if proc.poll() is None:
                    kill_group(proc)
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
        if check and proc.returncode != 0:
            text = stderr.decode(errors="replace").strip()
            raise RuntimeFailed(f"{' '.join(argv)} exited {proc.returncode}: {text}", argv=argv,
                                returncode=proc.returncode, stderr=text)
        return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)

    # -- lifecycle ---------------------------------------------------------------------------
    def create(self, cid: str, bundle: str | os.PathLike[str], *, pid_file: str | os.PathLike[str],
               sched_idle: bool = False) -> None:
        self._run("create", "--bundle", str(bundle), "--pid-file", str(pid_file), cid, on=cid, sched_idle=sched_idle)

    def start(self, cid: str) -> None:
        self._run("start", cid, on=cid)

    def run(self, cid: str, bundle: str | os.PathLike[str], *, pid_file: str | os.PathLike[str],
            sched_idle: bool = False) -> None:
        """:meth:`create` and :meth:`start` in one crun process (``run --detach``): each crun
        process costs a few ms of dynamic loading and state reading (a create's start took 4.5 ms
        of 37 ms with none held, 5.7 ms with 3,200)."""
        self._run("run", "--detach", "--bundle", str(bundle), "--pid-file", str(pid_file), cid, on=cid,
                  sched_idle=sched_idle)

    def update(self, cid: str, resources: Mapping[str, Any], scratch: str | os.PathLike[str]) -> None:
        """Set a running container's cgroup limits to ``resources`` (an OCI ``linux.resources``),
        passed through the file ``scratch`` (in a directory of the caller's own; removed after)."""
        path = Path(scratch)
        path.write_text(json.dumps(resources))
        try:
            self._run("update", "--resources", str(path), cid, on=cid)
        finally:
            path.unlink(missing_ok=True)

    def state(self, cid: str) -> dict[str, Any] | None:
        """crun's JSON state, or None when crun does not know ``cid``."""
        proc = self._run("state", cid, on=cid, check=False)
        if proc.returncode != 0:
            return None
        return dict(json.loads(proc.stdout))

    def list(self) -> list[dict[str, Any]]:
        """Every container under ``--root`` (and under the legacy root), as ``crun list`` reports them.

        ``crun list`` fails as a whole when one container's state file vanishes between
        its directory scan and its read (a delete running beside it: seen under
        sustained create/delete) or cannot be read at all.  Then each container is
        asked alone; one that is gone is left out, one that cannot be read is logged.
        """
        older = [self.legacy_root] if self.legacy_root is not None and self.legacy_root.is_dir() else []
        return [c for root in [*older, self.root] for c in self._list_in(root)]

    def _list_in(self, root: Path) -> builtins.list[dict[str, Any]]:
        proc = self._run("list", "--format", "json", root=root, check=False)
        if proc.returncode == 0:
            text = proc.stdout.decode().strip()
            return list(json.loads(text)) if text else []
        out = []
        for entry in sorted(root.iterdir()):
            if not entry.is_dir():
                continue
            st = self.state(entry.name)
            if st is not None:
                out.append({key: st.get(key) for key in ("id", "pid", "status", "bundle", "created", "owner")})
            else:
                with contextlib.suppress(OSError):  # (gone meanwhile: nothing to say)
                    if any(entry.iterdir()):
                        log.warning("crun --root %s: container %s has an unreadable state; left out of the "
                                    "list", root, entry.name)
        return out

    def kill(self, cid: str, sig: str = "KILL", *, all_processes: bool = True) -> None:
        self._run("kill", *(["--all"] if all_processes else []), cid, sig, on=cid)

    def pause(self, cid: str) -> None:
        self._run("pause", cid, on=cid)

    def resume(self, cid: str) -> None:
        self._run("resume", cid, on=cid)

    def delete(self, cid: str, *, force: bool = True) -> None:
        self._run("delete", *(["--force"] if force else []), cid, on=cid)

    def exec(self, cid: str, process_json: str | os.PathLike[str], *, pid_file: str | os.PathLike[str],
             stdin: int | IO[Any] | None, sched_idle: bool = False,
             console_socket: str | None = None) -> subprocess.Popen[bytes]:
        """Start ``crun exec`` with a full OCI process document; the caller streams and reaps it.

        ``console_socket``: the process document asks for a terminal, and crun sends the
        master of the pty it made inside the container to this socket (:class:`ConsoleSocket`).
        """
        root = closed_dir(self.root_of(cid))
        console = ["--console-socket", console_socket] if console_socket is not None else []
        return spawn(self.argv("exec", *console, "--process", str(process_json), "--pid-file", str(pid_file), cid,
                               root=root), stdin=stdin, sched_idle=sched_idle)


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


CONSOLE_TIMEOUT = 10.0  # crun sends the master before it starts the process: this is only a stuck crun


class ConsoleSocket:
    """Where ``crun exec --console-socket`` sends the master of the pty it made in the container.

    crun opens the pty on the container's own devpts (so the sandbox never gets a host
    pty), connects to this unix socket and sends the master as SCM_RIGHTS.  The socket
    lives in a fresh 0700 directory of root's (a unix socket path has 108 bytes: a data
    dir's bundle may be too deep); :meth:`close` removes both, and a context exit too.
    """

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="lb-console-")
        self.path = os.path.join(self._dir, "sock")
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._sock.bind(self.path)
            self._sock.listen(1)
        except BaseException:
            self.close()
            raise

    def receive(self, proc: subprocess.Popen[bytes], timeout: float = CONSOLE_TIMEOUT) -> int:
        """The master crun sent (the caller closes it); :class:`RuntimeFailed` with crun's stderr
        when crun exits without sending one, :class:`RuntimeTimeout` when it sends none in time."""
        assert self._sock is not None
        deadline = time.monotonic() + timeout
        while not select.select([self._sock], [], [], 0.05)[0]:
            if proc.poll() is not None:
                err = proc.stderr.read(4096).decode(errors="replace").strip() if proc.stderr else ""
                raise RuntimeFailed(f"crun exec exited {proc.returncode} before sending its terminal: {err}",
                                    returncode=proc.returncode, stderr=err)
            if time.monotonic() > deadline:
                raise RuntimeTimeout(f"crun sent no terminal to {self.path} within {timeout} s")
        conn, _ = self._sock.accept()
        with conn:
            conn.settimeout(max(0.1, deadline - time.monotonic()))
            _, fds, _, _ = socket.recv_fds(conn, 4096, 4)
        if not fds:
            raise RuntimeFailed(f"crun connected to {self.path} but sent no terminal")
        for extra in fds[1:]:
            os.close(extra)
        return fds[0]

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> ConsoleSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
