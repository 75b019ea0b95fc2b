"""A second, real S3 for tests: a single-node Ceph cluster with one RADOS Gateway.

Debian 12's Ceph (16.2, Pacific) as in shared/notes/ceph-rgw-recipe.md: one
monitor, one manager, one OSD on ``memstore`` (objects in the OSD's memory)
and one ``radosgw`` (beast), every daemon started in the background without
systemd, bound to 127.0.0.1 and no other address, everything (config, keys,
mon store, logs, sockets) in one scratch directory under :data:`STATE_ROOT`.
Nothing is installed here: ``make deps`` installs the packages
(:data:`PACKAGES`); :func:`missing` says which program is absent.

- :meth:`RgwCluster.create` first reaps what a killed earlier run left (see
  :func:`reap_stale`), then makes a fresh directory with an ``owner.json``;
  :meth:`RgwCluster.boot` starts the daemons, creates an RGW user with fresh
  keys and answers once an authenticated request works; :meth:`RgwCluster.stop`
  kills every daemon and removes the directory.  ``new_bucket()`` makes a
  bucket (one per test).
- Every daemon is its own process group with a pid file ``pids/NAME.json``
  (pid, kernel start time, argv), so a later run kills exactly those
  processes, never a reused pid: a killed ``pytest`` leaves daemons behind,
  the next :meth:`RgwCluster.create` removes them.
- A daemon that exits, or a boot past its deadline, raises
  :class:`RgwStartError` naming the step, with the daemons' log tails.

By hand (from the repository root), for testing anything against it::

    python -m tests.support.rgw start     # boots /tmp/layerbox-rgw/manual, prints the env
                                          # (--port 7480: the gateway on a fixed port)
    eval "$(python -m tests.support.rgw env)"
    python -m tests.support.rgw stop

``start`` replaces an earlier manual cluster; a ``pytest`` run leaves a
manual cluster alone (and uses it only when ``LAYERBOX_TEST_S3_ENDPOINT``
names it, see tests/README.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import string
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.support.proc import CommandFailed, CommandTimedOut, run

STATE_ROOT = Path("/tmp/layerbox-rgw")
MANUAL = "manual"  # the directory name of the cluster `python -m tests.support.rgw start` boots
PACKAGES = ("ceph-mon", "ceph-mgr", "ceph-osd", "radosgw", "ceph-common")
# Each program the boot runs, with the Debian package that ships it.
PROGRAMS = {
    "ceph-mon": "ceph-mon",
    "ceph-mgr": "ceph-mgr",
    "ceph-osd": "ceph-osd",
    "radosgw": "radosgw",
    "radosgw-admin": "radosgw",
    "ceph": "ceph-common",
    "ceph-authtool": "ceph-common",
    "monmaptool": "ceph-base",  # a dependency of ceph-mon
}
BOOT_TIMEOUT = 300.0  # seconds for the whole boot; about 3 s on an idle 2-core host
MEMSTORE_BYTES = 6 << 30  # a ceiling for the OSD's in-memory store, not an allocation
REGION = "us-east-1"
LOG_TAIL_LINES = 25
# Every key the cluster needs, made before the monitor's mkfs, which imports them all
# (so no `ceph auth` round trip is needed later).  The caps are the recipe's.
ENTITIES: dict[str, dict[str, str]] = {
    "mon.": {"mon": "allow *"},
    "client.admin": {"mon": "allow *", "osd": "allow *", "mgr": "allow *", "mds": "allow *"},
    "mgr.x": {"mon": "allow profile mgr", "osd": "allow *", "mds": "allow *"},
    "osd.0": {"mon": "allow profile osd", "mgr": "allow profile osd", "osd": "allow *"},
    "client.rgw.a": {"mon": "allow rw", "osd": "allow rwx", "mgr": "allow rw"},
}

CEPH_CONF = """\
[global]
fsid = {fsid}
mon initial members = a
mon host = [v2:127.0.0.1:{mon_v2},v1:127.0.0.1:{mon_v1}]
public network = 127.0.0.1/32
cluster network = 127.0.0.1/32
public addr = 127.0.0.1
cluster addr = 127.0.0.1
ms bind ipv4 = true
ms bind ipv6 = false
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
auth allow insecure global id reclaim = false
keyring = {dir}/keyring
run dir = {dir}/run
admin socket = {dir}/run/$name.asok
pid file = {dir}/run/$name.pid
crash dir = {dir}/crash
log file = {dir}/log/$name.log
mon data = {dir}/mon/$cluster-$id
mgr data = {dir}/mgr/$cluster-$id
osd data = {dir}/osd/$cluster-$id
osd objectstore = memstore
memstore device bytes = {memstore_bytes}
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon max pg per osd = 1000
# the mon warns below 30 % and stops below 5 % free disk: a test host's disk is not its business
mon data avail warn = 1
mon data avail crit = 1
# a port taken between free_port() and the bind fails the boot in a second, not after 15
ms bind retry count = 1
ms bind retry delay = 1
# no `restful` module: it would listen on every address
mgr initial modules = iostat
# overwritten objects' tails stay in the OSD's memory until gc collects them
rgw gc obj min wait = 60
rgw gc processor period = 60
rgw dynamic resharding = false
# The monitor batches map changes for a second by default; each pool the gateway creates at
# start waits for two rounds of that: 12 s of a 17 s boot, 1.5 s at a tenth of a second.
paxos propose interval = 0.1
paxos min wait = 0.01

[client.rgw.a]
rgw data = {dir}/rgw/$cluster-$id
rgw frontends = beast endpoint=127.0.0.1:{rgw_port}
"""


class RgwStartError(RuntimeError):
    """The cluster did not come up; the message names the step and shows the daemons' logs."""


def missing() -> list[str]:
    """The programs the boot needs that are not installed, each with its package."""
    return [f"{program} (package {package})" for program, package in PROGRAMS.items()
            if shutil.which(program) is None]


def install_hint() -> str:
    return f"apt-get install --no-install-recommends {' '.join(PACKAGES)} (or `make deps`)"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def s3_client(endpoint: str, access_key: str, secret_key: str, region: str = REGION,
              attempts: int = 1, **config: Any) -> Any:
    """A plain boto3 S3 client for these keys only (no profile, no environment)."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3", endpoint_url=endpoint, region_name=region,
        aws_access_key_id=access_key, aws_secret_access_key=secret_key,
        config=Config(retries={"total_max_attempts": attempts}, **config),
    )


# -- processes: identified by pid *and* kernel start time ------------------------------------


def _start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    if fields[0] == b"Z":  # a zombie waiting for a slow init: as good as gone
        return None
    return int(fields[19])


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except (FileNotFoundError, ProcessLookupError):
        return ""


def _alive(record: dict[str, Any]) -> bool:
    pid, start = record.get("pid"), record.get("start")
    return isinstance(pid, int) and pid > 0 and _start_time(pid) == start


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def _wait_gone(pids: Sequence[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    for pid in pids:
        while _start_time(pid) is not None and time.monotonic() < deadline:
            time.sleep(0.02)


def _processes_in(directory: Path) -> list[int]:
    """Processes whose command line names ``directory`` (every daemon gets ``-c DIR/ceph.conf``)."""
    needle = f"{directory}/"
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid() and needle in _cmdline(int(entry)):
            found.append(int(entry))
    return found


def _kill_cluster_processes(directory: Path) -> list[int]:
    """SIGKILL every daemon of the cluster in ``directory``; returns the pids killed.

    SIGKILL, not SIGTERM: the data is thrown away, and a memstore OSD asked to stop
    politely first writes all its objects to disk.
    """
    killed = []
    for pid_file in sorted((directory / "pids").glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(pid_file.read_text())
            if _alive(record) and f"{directory}/" in _cmdline(record["pid"]):
                _kill_group(record["pid"])
                killed.append(record["pid"])
    for pid in _processes_in(directory):  # one whose pid file was never written
        _kill_group(pid)
        killed.append(pid)
    _wait_gone(killed)
    return killed


def _owner_alive(directory: Path) -> bool:
    """Whether the cluster in ``directory`` still belongs to someone.

    A test run's cluster belongs to that run's process while it lives; a manual one
    to its daemons while any of them lives.  A directory without an owner file is
    being created (young) or was abandoned mid-creation (older than a minute).
    """
    try:
        owner = json.loads((directory / "owner.json").read_text())
    except (OSError, ValueError):
        with contextlib.suppress(OSError):
            return time.time() - directory.stat().st_mtime < 60
        return False
    if owner.get("kind") == MANUAL:
        records = []
        for pid_file in (directory / "pids").glob("*.json"):
            with contextlib.suppress(OSError, ValueError):
                records.append(json.loads(pid_file.read_text()))
        return any(_alive(r) for r in records)
    return _alive(owner)


def reap_stale(root: Path = STATE_ROOT, *, also: Sequence[str] = ()) -> list[Path]:
    """Kill the daemons of, and remove, every cluster under ``root`` nobody owns any more.

    Clusters whose owner lives (another test run going on, a manual cluster) are left
    alone, except those named in ``also``.  Returns the directories removed.
    """
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for directory in sorted(root.iterdir()):
        if not directory.is_dir() or (directory.name not in also and _owner_alive(directory)):
            continue
        _kill_cluster_processes(directory)
        shutil.rmtree(directory, ignore_errors=True)
        removed.append(directory)
    return removed


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return "(no log yet)"
    kept = [line for line in text.splitlines() if line.strip()]
    return "\n".join(kept[-lines:]) or "(empty)"


class RgwCluster:
    """One single-node Ceph cluster with an RGW, in its own directory; see the module docstring.

    ``endpoint``, ``access_key`` and ``secret_key`` are set once :meth:`boot` returned.
    """

    name = "rgw"
    region = REGION
    atomic_conditional_writes = True  # RGW serialises conditional writes (the recipe: one winner of 16)

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.conf = directory / "ceph.conf"
        self.endpoint = ""
        self.access_key = ""
        self.secret_key = ""
        self.timings: dict[str, float] = {}  # seconds since the boot began, per step
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._lock = threading.Lock()
        self._stopping = False

    def __repr__(self) -> str:
        return f"RgwCluster({str(self.dir)!r}, endpoint={self.endpoint or 'not booted'})"

    @classmethod
    def create(cls, kind: str = "pytest", root: Path = STATE_ROOT) -> RgwCluster:
        """Reap stale clusters, then make a fresh directory owned by this process (``kind``
        ``"pytest"``) or by its daemons (:data:`MANUAL`, which replaces an earlier manual one)."""
        root.mkdir(parents=True, exist_ok=True)
        reap_stale(root, also=(MANUAL,) if kind == MANUAL else ())
        name = MANUAL if kind == MANUAL else f"pytest-{os.getpid()}-{secrets.token_hex(3)}"
        directory = root / name
        directory.mkdir(mode=0o700)
        owner = {"kind": kind, "pid": os.getpid(), "start": _start_time(os.getpid()),
                 "argv": sys.argv}
        (directory / "owner.json").write_text(json.dumps(owner) + "\n")
        return cls(directory)

    # -- booting -------------------------------------------------------------------------------
    def boot(self, timeout: float = BOOT_TIMEOUT, *, ports: Mapping[str, int] | None = None) -> RgwCluster:
        """Start mon, mgr, OSD and RGW, make a user; raises :class:`RgwStartError`.

        ``ports`` fixes some of ``mon_v2``, ``mon_v1`` and ``rgw`` (the gateway's); the
        others are free ports of 127.0.0.1.  The mgr and OSD pick theirs from 6800-7300.
        """
        absent = missing()
        if absent:
            raise RgwStartError(f"Ceph is not installed: {', '.join(absent)} missing; {install_hint()}")
        began = time.monotonic()
        deadline = began + timeout
        step = "writing the configuration"
        try:
            fixed = dict(ports or {})
            unknown = set(fixed) - {"mon_v2", "mon_v1", "rgw"}
            if unknown:
                raise ValueError(f"unknown port names {sorted(unknown)}")
            chosen = {name: fixed.get(name) or free_port() for name in ("mon_v2", "mon_v1", "rgw")}
            rgw_port = chosen.pop("rgw")
            for sub in ("run", "log", "pids", "crash", "mon/ceph-a", "mgr/ceph-x", "osd/ceph-0",
                        "rgw/ceph-rgw.a"):
                (self.dir / sub).mkdir(parents=True, exist_ok=True)
            fsid = str(uuid.uuid4())
            self.conf.write_text(CEPH_CONF.format(dir=self.dir, fsid=fsid, memstore_bytes=MEMSTORE_BYTES,
                                                  rgw_port=rgw_port, **chosen))
            step = "making the keys (ceph-authtool)"
            self._make_keyring()
            step = "creating the monitor (monmaptool, ceph-mon --mkfs)"
            mon_addrs = f"[v2:127.0.0.1:{chosen['mon_v2']},v1:127.0.0.1:{chosen['mon_v1']}]"
            self._run(["monmaptool", "--create", "--addv", "a", mon_addrs, "--fsid", fsid,
                       self.dir / "monmap"], deadline)
            self._run(["ceph-mon", "-c", self.conf, "--mkfs", "-i", "a", "--monmap",
                       self.dir / "monmap", "--keyring", self.dir / "keyring"], deadline)
            step = "formatting the OSD (ceph-osd --mkfs)"
            osd_uuid = str(uuid.uuid4())
            # --no-mon-config: the monitor is not up yet, and memstore needs nothing from it
            self._run(["ceph-osd", "-c", self.conf, "-i", "0", "--mkfs", "--osd-uuid", osd_uuid,
                       "--no-mon-config"], deadline)
            self._mark("configured", began)

            step = "starting the monitor"
            self._spawn("mon.a", ["ceph-mon", "-c", self.conf, "-i", "a", "-f"])
            self._wait_port(chosen["mon_v1"], "mon.a", deadline)
            self._mark("mon", began)
            step = "starting the manager"
            self._spawn("mgr.x", ["ceph-mgr", "-c", self.conf, "-i", "x", "-f"])
            step = "registering the OSD (ceph osd new)"
            self._run(["ceph", "-c", self.conf, "--connect-timeout", "60", "osd", "new", osd_uuid, "0"],
                      deadline)
            step = "starting the OSD"
            self._spawn("osd.0", ["ceph-osd", "-c", self.conf, "-i", "0", "-f"])
            step = "starting the gateway (radosgw creates its pools once the OSD is up)"
            self._spawn("client.rgw.a", ["radosgw", "-c", self.conf, "-n", "client.rgw.a", "-f"])
            self.endpoint = f"http://127.0.0.1:{rgw_port}"
            self._wait_http(deadline)
            self._mark("rgw", began)

            step = "creating the RGW user (radosgw-admin user create)"
            self._create_user(deadline)
            step = "a first bucket and object (the bucket pools are made on first use)"
            self._probe()
            self._mark("bucket", began)
            step = "waiting for the manager to be active (ceph mgr stat)"
            self._wait_mgr(deadline)
            self._mark("ready", began)
        except RgwStartError:
            raise
        except (CommandFailed, CommandTimedOut, OSError, RuntimeError, ValueError) as exc:
            raise self._failure(step, str(exc)) from exc
        self._write_state()
        return self

    def _mark(self, what: str, began: float) -> None:
        self.timings[what] = round(time.monotonic() - began, 2)

    def _make_keyring(self) -> None:
        keyring = self.dir / "keyring"
        for i, (entity, caps) in enumerate(ENTITIES.items()):
            argv: list[str | Path] = ["ceph-authtool", keyring, "--gen-key", "-n", entity]
            if i == 0:
                argv.insert(1, "--create-keyring")
            for service, cap in caps.items():
                argv += ["--cap", service, cap]
            run(argv, timeout=30)
        keyring.chmod(0o600)

    def _run(self, argv: Sequence[str | os.PathLike[str]], deadline: float) -> bytes:
        self._check_not_stopping()
        result = run(argv, timeout=max(1.0, deadline - time.monotonic()))
        return result.stdout

    def _check_not_stopping(self) -> None:
        if self._stopping:
            raise RgwStartError(f"the cluster in {self.dir} was stopped while it booted")

    def _spawn(self, name: str, argv: Sequence[str | os.PathLike[str]]) -> None:
        args = [os.fspath(a) for a in argv]
        with self._lock:
            self._check_not_stopping()
            with open(self.dir / "log" / f"{name}.stderr", "ab") as out:
                proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                        start_new_session=True, cwd=self.dir)
            self._procs[name] = proc
            record = {"pid": proc.pid, "start": _start_time(proc.pid), "argv": args}
            (self.dir / "pids" / f"{name}.json").write_text(json.dumps(record) + "\n")

    def _check_daemons(self) -> None:
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                raise self._failure(f"{name} exited with status {proc.returncode}", "", only=name)

    def _wait_port(self, port: int, name: str, deadline: float) -> None:
        while True:
            self._check_not_stopping()
            self._check_daemons()
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.settimeout(1)
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            if time.monotonic() > deadline:
                raise self._failure(f"{name} did not listen on 127.0.0.1:{port} in time", "", only=name)
            time.sleep(0.05)

    def _wait_http(self, deadline: float) -> None:
        while True:
            self._check_not_stopping()
            self._check_daemons()
            try:
                with urllib.request.urlopen(self.endpoint, timeout=2) as response:
                    if response.status == 200:
                        return
            except urllib.error.HTTPError:
                return  # it answers S3 (an anonymous error is an answer)
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise self._failure(f"radosgw did not answer {self.endpoint} in time", "")
            time.sleep(0.1)

    def _wait_mgr(self, deadline: float) -> None:
        while True:
            self._check_daemons()
            out = self._run(["ceph", "-c", self.conf, "--connect-timeout", "30", "mgr", "stat",
                             "--format", "json"], deadline)
            if json.loads(out).get("available") is True:
                return
            if time.monotonic() > deadline:
                raise self._failure("mgr.x did not become active in time", "", only="mgr.x")
            time.sleep(0.2)

    def _create_user(self, deadline: float) -> None:
        alphabet = string.ascii_uppercase + string.digits
        access = "".join(secrets.choice(alphabet) for _ in range(20))
        secret = secrets.token_urlsafe(30)[:40]
        out = self._run(["radosgw-admin", "-c", self.conf, "user", "create", "--uid=layerbox-test",
                         "--display-name=layerbox tests", f"--access-key={access}",
                         f"--secret-key={secret}"], deadline)
        keys = json.loads(out).get("keys", [])
        if {"access_key": access, "secret_key": secret, "user": "layerbox-test"} not in keys:
            raise RgwStartError(f"radosgw-admin created a user without the keys asked for: {keys}")
        self.access_key, self.secret_key = access, secret

    def _probe(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        client = self.client()
        try:
            bucket = self.new_bucket("layerbox-probe")
            client.put_object(Bucket=bucket, Key="probe", Body=b"probe")
            if client.get_object(Bucket=bucket, Key="probe")["Body"].read() != b"probe":
                raise RgwStartError(f"{self.endpoint} returned other bytes than were put")
            client.delete_object(Bucket=bucket, Key="probe")
            client.delete_bucket(Bucket=bucket)
        except (BotoCoreError, ClientError) as exc:
            raise RuntimeError(f"{type(exc).__name__}: {exc}") from exc
        finally:
            client.close()

    def _failure(self, step: str, detail: str, *, only: str | None = None) -> RgwStartError:
        names = [only] if only else list(self._procs) or ["mon.a"]
        logs = []
        for name in names:
            for suffix in (".log", ".stderr"):
                path = self.dir / "log" / f"{name}{suffix}"
                if path.exists() and path.stat().st_size:
                    logs.append(f"--- {path} (last {LOG_TAIL_LINES} lines) ---\n{_tail(path)}")
        status = {n: ("running" if p.poll() is None else f"exited {p.returncode}")
                  for n, p in self._procs.items()}
        return RgwStartError(
            f"Ceph RGW did not start ({self.dir}): {step}{': ' + detail if detail else ''}\n"
            f"daemons: {status or 'none started'}\n" + "\n".join(logs))

    def _write_state(self) -> None:
        state = {"endpoint": self.endpoint, "access_key": self.access_key, "secret_key": self.secret_key,
                 "region": self.region, "timings": self.timings}
        path = self.dir / "cluster.json"
        path.write_text(json.dumps(state, indent=1) + "\n")
        path.chmod(0o600)

    @classmethod
    def attach(cls, directory: Path) -> RgwCluster:
        """The booted cluster in ``directory`` (from its ``cluster.json``)."""
        state = json.loads((directory / "cluster.json").read_text())
        cluster = cls(directory)
        cluster.endpoint, cluster.access_key = state["endpoint"], state["access_key"]
        cluster.secret_key, cluster.timings = state["secret_key"], state.get("timings", {})
        return cluster

    # -- using it ---------------------------------------------------------------------------------
    def client(self, **config: Any) -> Any:
        """A plain boto3 S3 client with this cluster's keys (botocore's retries off)."""
        return s3_client(self.endpoint, self.access_key, self.secret_key, self.region, **config)

    def new_bucket(self, name: str | None = None) -> str:
        bucket = name or f"test-{uuid.uuid4().hex[:20]}"
        client = self.client()
        try:
            client.create_bucket(Bucket=bucket)
        finally:
            client.close()
        return bucket

    def env(self) -> dict[str, str]:
        """The variables that point the test suites (LAYERBOX_TEST_S3_*) and boto3 (AWS_*) here."""
        return {
            "LAYERBOX_TEST_S3_ENDPOINT": self.endpoint,
            "LAYERBOX_TEST_S3_ACCESS_KEY": self.access_key,
            "LAYERBOX_TEST_S3_SECRET_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    def pids(self) -> dict[str, int]:
        """The daemons' pids by name (from the pid files: also for an attached cluster)."""
        out = {}
        for pid_file in sorted((self.dir / "pids").glob("*.json")):
            with contextlib.suppress(OSError, ValueError):
                out[pid_file.stem] = int(json.loads(pid_file.read_text())["pid"])
        return out

    # -- stopping ---------------------------------------------------------------------------------
    def stop(self) -> None:
        """Kill every daemon and remove the directory (also while :meth:`boot` runs elsewhere)."""
        with self._lock:
            self._stopping = True
        _kill_cluster_processes(self.dir)
        for proc in self._procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def cluster(kind: str = "pytest", timeout: float = BOOT_TIMEOUT) -> Iterator[RgwCluster]:
    """A booted cluster, stopped and removed when the block ends however it ends."""
    rgw = RgwCluster.create(kind)
    try:
        yield rgw.boot(timeout)
    finally:
        rgw.stop()


# -- by hand ------------------------------------------------------------------------------------


def _print_env(rgw: RgwCluster) -> None:
    for name, value in rgw.env().items():
        print(f"export {name}={shlex.quote(value)}")


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m tests.support.rgw",
        description="A single-node Ceph RGW on 127.0.0.1 for testing against a real S3.")
    parser.add_argument("command", choices=["start", "stop", "env"],
                        help="start: boot (replacing an earlier manual cluster) and print the env; "
                             "env: print the running one's env as shell exports; "
                             "stop: kill its daemons and remove its directory")
    parser.add_argument("--port", type=int, default=0,
                        help="start: the gateway's port on 127.0.0.1 (default: a free one)")
    args = parser.parse_args(argv)
    directory = STATE_ROOT / MANUAL
    if args.command == "start":
        began = time.monotonic()
        rgw = RgwCluster.create(MANUAL)
        try:
            rgw.boot(ports={"rgw": args.port})
        except BaseException:
            rgw.stop()
            raise
        print(f"# Ceph RGW up in {time.monotonic() - began:.0f} s at {rgw.endpoint} ({rgw.dir}); "
              f"stop it with: python -m tests.support.rgw stop", file=sys.stderr)
        _print_env(rgw)
        return 0
    if args.command == "env":
        if not (directory / "cluster.json").is_file() or not _owner_alive(directory):
            print("no manual cluster is running: python -m tests.support.rgw start", file=sys.stderr)
            return 1
        _print_env(RgwCluster.attach(directory))
        return 0
    removed = reap_stale(STATE_ROOT, also=(MANUAL,))
    print(f"removed {', '.join(map(str, removed)) or 'nothing'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RgwStartError as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)
