"""A real containerd (Debian's) for tests, with its own root, state and socket, and the layerbox
snapshotter (``layerbox snapshotter``) it reaches as a proxy plugin; both torn down even on failure.

Never the host's containerd: everything lives in one short temp directory (unix socket paths are
at most 107 bytes), and the CRI plugin is disabled (no kubelet here; it would look for CNI).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from lazyfetch import kmount

from .env import require, unavailable

NAMESPACE = "layerbox-test"
READY_TIMEOUT = 30.0
# Debian 12's containerd 1.6 is the system's; 2.x is Debian's sid build that `make deps` unpacks here
CONTAINERD2 = Path("/opt/layerbox/containerd-2/usr/bin")


def require_containerd2() -> None:
    if not (CONTAINERD2 / "containerd").exists():
        unavailable(f"no containerd 2.x at {CONTAINERD2} (`make deps` unpacks Debian's)")


def require_containerd() -> None:
    for program in ("containerd", "ctr", "runc", "containerd-shim-runc-v2"):
        require(f"cmd:{program}")  # Debian packages containerd, runc: `make deps`


class Snapshotter:
    """``layerbox snapshotter`` as its own process (so a test can kill -9 it)."""

    def __init__(self, base: Path, store: str, data_dir: Path, *, extra: tuple[str, ...] = ()) -> None:
        self.socket = base / "sn.sock"
        self.root = base / "sn-root"
        self.store = store
        self.data_dir = data_dir
        self.extra = extra
        self.log = base / "snapshotter.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = [sys.executable, "-m", "tools.cli", "snapshotter", "--socket", str(self.socket),
                "--root", str(self.root), "--store", self.store, "--data-dir", str(self.data_dir),
                "--fill-below", "0", *self.extra]
        mark = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         cwd=Path(__file__).resolve().parents[2])
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"snapshotter exited {self.proc.returncode}:\n{self.log_tail()}")
            # its own line: a killed one leaves its socket file, and the lazyfetch daemon it starts
            # logs "serving" too, before the snapshotter listens
            if self.socket.is_socket() and f"serving {self.socket}\n".encode() in self.log.read_bytes()[mark:]:
                return
            time.sleep(0.05)
        raise RuntimeError(f"snapshotter not ready in {READY_TIMEOUT} s:\n{self.log_tail()}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class Containerd:
    def __init__(self, base: Path, snapshotter_socket: Path, *, bin_dir: Path | None = None,
                 proxies: dict[str, Path] | None = None) -> None:
        """``proxies``: more proxy snapshotters by name (2.x only; e.g. bench/containerd.py's stargz)."""
        self.base = base
        self.bin_dir = bin_dir
        # its own shim and ctr first (2.x); runc from the system
        self.env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"} if bin_dir else dict(os.environ)
        self.socket = base / "c.sock"
        self.root = base / "c-root"
        self.state = base / "c-state"
        self.config = base / "config.toml"
        self.log = base / "containerd.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.config.write_text(self._config_2x(snapshotter_socket, proxies or {}) if bin_dir else f"""version = 2
root = "{self.root}"
state = "{self.state}"
disabled_plugins = ["io.containerd.grpc.v1.cri"]

[grpc]
  address = "{self.socket}"

[ttrpc]
  address = "{self.socket}.ttrpc"

[debug]
  address = "{base / 'debug.sock'}"
  level = "info"

[proxy_plugins.layerbox]
  type = "snapshot"
  address = "{snapshotter_socket}"
""")

    def _config_2x(self, snapshotter_socket: Path, proxies: dict[str, Path]) -> str:
        # 2.x pulls through its transfer service, which unpacks (and so fetches layers lazily:
        # only those a snapshotter does not already have) for the snapshotters listed here only;
        # listing any replaces its default (overlayfs), which bench/containerd.py pulls with too
        more = "".join(f"""
[proxy_plugins.{name}]
  type = "snapshot"
  address = "{socket}"
""" for name, socket in proxies.items())
        return f"""version = 3
root = "{self.root}"
state = "{self.state}"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.cri.v1.images", "io.containerd.cri.v1.runtime",
                    "io.containerd.podsandbox.controller.v1.podsandbox"]

[grpc]
  address = "{self.socket}"

[ttrpc]
  address = "{self.socket}.ttrpc"

[debug]
  address = "{self.base / 'debug.sock'}"
  level = "info"

[proxy_plugins.layerbox]
  type = "snapshot"
  address = "{snapshotter_socket}"
{more}
[[plugins."io.containerd.transfer.v1.local".unpack_config]]
  platform = "linux/amd64"
  snapshotter = "layerbox"

[[plugins."io.containerd.transfer.v1.local".unpack_config]]
  platform = "linux/amd64"
  snapshotter = "overlayfs"
"""

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([self._bin("containerd"), "--config", str(self.config)], stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True, env=self.env)
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"containerd exited {self.proc.returncode}:\n{self.log_tail()}")
            if self.socket.is_socket() and self.ctr("version", check=False).returncode == 0:
                return
            time.sleep(0.1)
        raise RuntimeError(f"containerd not ready in {READY_TIMEOUT} s:\n{self.log_tail()}")

    def ctr(self, *args: str, check: bool = True, timeout: float = 300, input: bytes | None = None
            ) -> subprocess.CompletedProcess[str]:
        argv = self.ctr_argv(*args)
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False,
                             input=input.decode() if input is not None else None, env=self.env)
        if check and res.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {res.returncode}:\n{res.stdout}\n{res.stderr}\n"
                                 f"containerd log:\n{self.log_tail()}")
        return res

    def wait_snapshotter(self, name: str = "layerbox") -> None:
        """Wait until containerd talks to a restarted proxy snapshotter again.

        While the snapshotter was down a call (its garbage collection, say) put containerd's gRPC
        connection into backoff; until the next attempt (at most a few seconds) calls fail fast
        with the old "connection refused", although the new process already listens.
        """
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            res = self.ctr("snapshots", "--snapshotter", name, "ls", check=False)
            if res.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"containerd does not reach snapshotter {name} again in {READY_TIMEOUT} s:\n"
                                     f"{res.stderr}\ncontainerd log:\n{self.log_tail()}")
            time.sleep(0.2)

    def ctr_argv(self, *args: str) -> list[str]:
        """``ctr`` on this containerd's socket and namespace (run it with ``env=self.env``)."""
        return [self._bin("ctr"), "--address", str(self.socket), "--namespace", NAMESPACE, *args]

    def _bin(self, name: str) -> str:
        return str(self.bin_dir / name) if self.bin_dir else name

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def teardown(self) -> list[str]:
        """Kill every task and container, stop containerd, unmount what it left: problems found."""
        problems = []
        if self.proc is not None and self.proc.poll() is None:
            for line in self.ctr("tasks", "ls", "-q", check=False).stdout.split():
                self.ctr("tasks", "kill", "-s", "SIGKILL", line, check=False)
                self.ctr("tasks", "rm", "-f", line, check=False)
            for line in self.ctr("containers", "ls", "-q", check=False).stdout.split():
                self.ctr("containers", "rm", line, check=False)
        self.stop()
        # shims outlive containerd by design; ours run with our socket on their command line
        out = subprocess.run(["pgrep", "-f", f"-address {self.socket}"], capture_output=True, text=True).stdout
        for pid in out.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
                problems.append(f"shim {pid} left running")
        for mp in kmount.mounts_under(self.base):
            kmount.umount(mp, lazy=True, missing_ok=True)
        # runc leaves the namespace's parent cgroup (/<namespace>, in every v1 hierarchy or the
        # v2 tree) once its containers are gone: empty, and removed here (best effort: one
        # still holding a container stays)
        for parent in [*Path("/sys/fs/cgroup").glob(f"*/{NAMESPACE}"), Path("/sys/fs/cgroup", NAMESPACE)]:
            with contextlib.suppress(OSError):
                parent.rmdir()
        return problems

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@contextlib.contextmanager
def short_dir(prefix: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield path
    finally:
        for mp in kmount.mounts_under(path):
            kmount.umount(mp, lazy=True, missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
