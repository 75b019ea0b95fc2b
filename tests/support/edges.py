"""Edge services as real processes: ``python -m sandbox.edge`` started, waited for, killed or stopped.

An :class:`EdgeProcess` owns one data dir and one port.  Readiness is the service
answering its own API; :meth:`EdgeProcess.kill` is the crash an operator sees
(SIGKILL: the lazyfetch daemon, a separate process, lives on), :meth:`EdgeProcess.terminate`
the orderly stop (SIGTERM through aiohttp's ``run_app``).  :func:`leftovers` lists what a
data dir still holds on the host (containers, mounts, cgroups in every hierarchy, network
namespaces, a daemon); :meth:`EdgeProcess.clean_up` removes it after the process is gone
and reports what it had to remove or could not.  :func:`running` is an edge for the length of
a block (a module's fixture), stopped and checked clean however the block ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from lazyfetch import kmount
from lazyfetch.errors import KernelMountError
from lazyfetch.mounts import HostMounts
from sandbox.core.errors import SandboxError
from sandbox.host.manager import SandboxManager

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(method: str, url: str, body: Any = None, *, token: str,
         timeout: float = 30) -> tuple[int, dict[str, str], Any]:
    """One JSON request: (status, headers, decoded body); HTTP errors are answers, not exceptions."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={
        "Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status, headers = r.read(), r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        raw, status, headers = e.read(), e.code, dict(e.headers)
    try:
        return status, headers, json.loads(raw) if raw else None
    except ValueError:
        return status, headers, raw.decode(errors="replace")


def cgroup_hierarchies() -> list[Path]:
    """Every mounted cgroup hierarchy (each v1 controller, named ones like name=systemd, cgroup2),
    read from the kernel's mount table rather than from the code under test."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if right.split()[0] in ("cgroup", "cgroup2"):
                out.append(Path(left.split()[4].replace("\\040", " ")))
    return sorted(set(out))


def cgroup_dirs(parent: str) -> list[Path]:
    """The directories named ``parent`` (a manager's cgroup parent) and below, in every hierarchy.

    A running service removes a finished sandbox's cgroup while this walks: os.walk skips a
    directory gone between listing and descending (rglob raised FileNotFoundError there)."""
    found = []
    for root in cgroup_hierarchies():
        top = root / parent
        for dirpath, _dirs, _files in os.walk(top):
            found.append(Path(dirpath))
    return sorted(found)


def leftovers(mgr: SandboxManager) -> list[str]:
    """What the data dir of ``mgr`` still holds on this host; [] when nothing."""
    problems = []
    runtime = mgr.backend("container").runtime
    if runtime.root.exists() and runtime.list():
        problems.append(f"crun containers: {[c['id'] for c in runtime.list()]}")
    if kmount.mounts_under(mgr.data_dir):
        problems.append(f"mounts: {kmount.mounts_under(mgr.data_dir)}")
    if cgroups := cgroup_dirs(mgr.cgroup_parent):
        problems.append(f"cgroups: {[str(d) for d in cgroups]}")
    netns = mgr.data_dir / "net" / "netns"
    if netns.is_dir() and os.listdir(netns):
        problems.append(f"network namespaces: {os.listdir(netns)}")
    if mgr.host.client.health() is not None:
        problems.append("the lazyfetch daemon still answers")
    return problems


class EdgeProcess:
    """One edge service as a child process with its own data dir and port.

    ``pythonpath``: directories put before the repository on the child's ``PYTHONPATH`` (a
    ``sitecustomize.py`` in one changes the child without a hook in the service's code).
    ``entry``: how the service is started (``layerbox edge`` is ``-m tools.cli edge``).
    """

    def __init__(self, name: str, root: Path, store_url: str, tokens: Path, *extra: str, token: str,
                 pythonpath: Sequence[Path] = (), entry: tuple[str, ...] = ("-m", "sandbox.edge")) -> None:
        self.name, self.store_url, self.token = name, store_url, token
        self.pythonpath = os.pathsep.join([*map(str, pythonpath), str(REPO)])
        self.data_dir = root / name
        self.log = root / f"{name}.log"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, *entry, "--data-dir", str(self.data_dir),
                     "--store", store_url, "--port", str(self.port), "--tokens", str(tokens),
                     "--edge-id", name, *extra]
        self.proc: subprocess.Popen[bytes] | None = None

    def http(self, method: str, path: str, body: Any = None, **kw: Any) -> tuple[int, dict[str, str], Any]:
        return http(method, self.url + path, body, token=self.token, **kw)

    def start(self) -> None:
        with open(self.log, "ab") as log:
            env = {**os.environ, "PYTHONPATH": self.pythonpath, "PYTHONUNBUFFERED": "1"}
            self.proc = subprocess.Popen(self.argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=env, start_new_session=True)
        # readiness is the service answering its own API, not a fixed delay
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"edge {self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if self.http("GET", "/v1/load")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"edge {self.name} not ready after {READY_TIMEOUT} s:\n{self.tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no cleanup runs; what the service held stays for the next start's reconcile."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)  # the port is closed once it is reaped

    def terminate(self, timeout: float) -> int | None:
        """SIGTERM and wait up to ``timeout`` s: the exit status, or None if it still runs."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        if not self.alive():
            return
        assert self.proc is not None
        if self.terminate(30) is None:
            self.proc.kill()
            self.proc.wait(10)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else "(no log)"

    def sandboxes(self) -> list[str]:
        status, _, body = self.http("GET", "/v1/sandboxes")
        assert status == 200, body
        return [sb["id"] for sb in body["sandboxes"]]

    def manager(self) -> SandboxManager:
        """A manager on this edge's data dir, for looking at (or, once the edge is gone, cleaning) it."""
        return SandboxManager(self.data_dir, self.store_url)

    def clean_up(self) -> list[str]:
        """After the process is gone: destroy what it left, unmount, stop its lazyfetch daemon.

        Returns what was left behind (the caller fails on it); removes it whatever happens, down
        to killing the daemon and detaching mounts, so one failed test leaves the host usable.
        """
        mgr = self.manager()
        problems = []
        try:
            mgr.reconcile()
            left = [st.id for st in mgr.list()]
            if left:
                problems.append(f"{self.name}: sandboxes left behind: {left}")
            mgr.close()
        except Exception as exc:  # keep cleaning; reported at the end
            problems.append(f"{self.name}: cleanup failed: {exc!r}")
        problems += [f"{self.name}: {p}" for p in leftovers(mgr)]
        if problems:
            _force_clean(mgr)
        return problems


@contextlib.contextmanager
def running(name: str, root: Path, store_url: str, tokens: dict[str, Any], *extra: str, token: str,
            pythonpath: Sequence[Path] = (), entry: tuple[str, ...] = ("-m", "sandbox.edge")) -> Iterator[EdgeProcess]:
    """An :class:`EdgeProcess` on a tokens file of ``tokens``, started; when the block ends, stopped
    and cleaned up, failing on anything it left behind."""
    path = root / f"{name}-tokens.json"
    path.write_text(json.dumps(tokens))
    edge = EdgeProcess(name, root, store_url, path, *extra, token=token, pythonpath=pythonpath, entry=entry)
    try:
        edge.start()
        yield edge
    finally:
        edge.stop()
        assert edge.clean_up() == []


def _force_clean(mgr: SandboxManager) -> None:
    """The last resort after a failed cleanup: kill the daemon, detach every mount, drop cgroups."""
    health = HostMounts(mgr.data_dir).client.health()
    if health is not None:
        try:
            os.kill(int(health["pid"]), signal.SIGKILL)
        except ProcessLookupError:
            pass
    if mgr.backend("container").runtime.root.exists():
        for c in mgr.backend("container").runtime.list():
            try:
                mgr.backend("container").runtime.delete(c["id"], force=True)
            except SandboxError:  # leftovers() reported it already; the next steps still run
                pass
    for mp in kmount.mounts_under(mgr.data_dir):  # deepest first
        try:
            kmount.umount(mp, lazy=True, missing_ok=True)
        except KernelMountError:
            pass
    for d in reversed(cgroup_dirs(mgr.cgroup_parent)):
        try:
            d.rmdir()
        except OSError:
            pass
