"""A private PostgreSQL cluster on this machine: what ``layerbox fleet up`` and the tests run.

Debian's server binaries (``/usr/lib/postgresql/<major>/bin``), a cluster of its own in a
directory (``initdb``), owned by the ``postgres`` account because the server refuses to run as
root, listening on 127.0.0.1 at a free port and on a socket inside that directory only.  The
database role has a random password (scram-sha-256): a cluster on a shared machine must not be
open to every local user.  :meth:`LocalPostgres.stop` stops the server and removes the directory;
a cluster whose owner died is found by its ``postmaster.pid`` and stopped by :func:`stop_leftover`.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from sandbox.core.errors import SandboxError

PG_ROOT = Path("/usr/lib/postgresql")
ACCOUNT = "postgres"
DATABASE = "layerbox"
ROLE = "layerbox"
START_TIMEOUT = 60.0


class PostgresUnavailable(SandboxError):
    """No PostgreSQL server binaries, or the cluster did not start."""


def bin_dir() -> Path:
    """The newest installed major's binaries (``apt-get install postgresql``; make deps does)."""
    majors = sorted((p for p in PG_ROOT.glob("*/bin") if (p / "initdb").exists()),
                    key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)
    if not majors:
        raise PostgresUnavailable(f"no PostgreSQL server under {PG_ROOT}: install Debian's 'postgresql' "
                                  "package (make deps does)")
    return majors[-1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LocalPostgres:
    """One cluster in ``root`` (made if absent); :attr:`url` once started."""

    root: Path
    port: int = 0
    password: str = ""

    @property
    def url(self) -> str:
        return f"postgresql://{ROLE}:{self.password}@127.0.0.1:{self.port}/{DATABASE}"

    def _run(self, *argv: str, timeout: float = START_TIMEOUT) -> None:
        account = pwd.getpwnam(ACCOUNT)
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, cwd="/",
                              user=account.pw_uid if os.geteuid() == 0 else None,
                              group=account.pw_gid if os.geteuid() == 0 else None)
        if done.returncode != 0:
            raise PostgresUnavailable(f"{Path(argv[0]).name} failed ({done.returncode}): "
                                      f"{(done.stderr or done.stdout).strip()[-2000:]}")

    def start(self) -> LocalPostgres:
        """initdb (a fresh directory), then start the server and make the database."""
        pg = bin_dir()
        self.root.mkdir(parents=True, exist_ok=True)
        data = self.root / "data"
        account = pwd.getpwnam(ACCOUNT)
        if os.geteuid() == 0:
            os.chown(self.root, account.pw_uid, account.pw_gid)
        self.root.chmod(0o700)
        self.password = self.password or secrets.token_hex(16)
        self.port = self.port or free_port()
        if not (data / "PG_VERSION").exists():
            pwfile = self.root / "pw"
            pwfile.write_text(self.password)
            if os.geteuid() == 0:
                os.chown(pwfile, account.pw_uid, account.pw_gid)
            try:
                self._run(str(pg / "initdb"), "-D", str(data), "-U", ROLE, "--pwfile", str(pwfile),
                          "--auth=scram-sha-256", "-E", "UTF8", "--no-sync")
            finally:
                pwfile.unlink()
        options = (f"-c listen_addresses=127.0.0.1 -c port={self.port} -c unix_socket_directories={self.root} "
                   "-c fsync=on -c max_connections=400 -c shared_buffers=64MB")
        self._run(str(pg / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(self.root / "server.log"),
                  "-w", "-t", str(int(START_TIMEOUT)), "start")
        self._create_database(pg)
        return self

    def _create_database(self, pg: Path) -> None:
        env = {"PGPASSWORD": self.password, "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            done = subprocess.run([str(pg / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", ROLE,
                                   "-d", "postgres", "-tAc",
                                   f"SELECT 1 FROM pg_database WHERE datname = '{DATABASE}'"],
                                  capture_output=True, text=True, env=env, timeout=30)
            if done.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise PostgresUnavailable(f"the cluster in {self.root} answers nothing: {done.stderr.strip()}")
            time.sleep(0.1)
        if done.stdout.strip() != "1":
            subprocess.run([str(pg / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", ROLE, DATABASE],
                           check=True, capture_output=True, env=env, timeout=30)

    def stop(self, *, remove: bool = True) -> None:
        """Stop the server (fast shutdown: sessions are cut) and, unless told not to, remove it."""
        data = self.root / "data"
        if (data / "postmaster.pid").exists():
            with contextlib.suppress(PostgresUnavailable, subprocess.TimeoutExpired):
                self._run(str(bin_dir() / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "-t", "30", "stop")
        if remove:
            shutil.rmtree(self.root, ignore_errors=True)

    def restart(self) -> None:
        """Stop and start on the same port and data (a fault the tests inject)."""
        self.stop(remove=False)
        self.start()


def stop_leftover(root: Path) -> bool:
    """Stop a cluster left in ``root`` by an owner that died; True when one was running."""
    if not (root / "data" / "postmaster.pid").exists():
        return False
    LocalPostgres(root).stop(remove=False)
    return True
