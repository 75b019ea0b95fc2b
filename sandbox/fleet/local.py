"""A fleet on this machine in one command (``layerbox fleet up`` / ``down``): what ``kind`` or
``docker compose up`` are to their users, for development, the tests and the demo.

:func:`up` starts, in a directory of its own: PostgreSQL (unless a database URL is given), the
gateways, and the edges, each edge with its own data dir and key, in its pool, reading its
pool's store; it makes an admin project and a project to use, waits until every edge has
registered, and writes ``fleet.json`` there (docs/FORMAT.md, "fleet.json"): the database URL,
the gateways' URLs, the tokens, and each process with its pid.  :func:`down` stops what that
file names (edges first, with SIGTERM: they destroy their sandboxes and unmount their layers)
and removes the directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandbox.core.errors import SandboxError
from sandbox.core.sync import run_blocking
from sandbox.edge.trust import edge_key
from sandbox.fleet.db import FleetDb
from sandbox.fleet.pg import LocalPostgres, free_port

STATE = "fleet.json"
PG_PARENT = "/var/tmp"
STATE_SCHEMA = "layerbox.fleet.local.v1"
READY_TIMEOUT = 120.0
STOP_TIMEOUT = 60.0
REPO = Path(__file__).resolve().parents[2]


class FleetUpError(SandboxError):
    """The local fleet did not come up (what did not start, and its log's tail)."""


@dataclass
class Spec:
    root: Path
    store: str
    pools: dict[str, int]  # pool -> edges, in order (the first is on-premises)
    gateways: int = 1
    db: str | None = None
    pool_stores: dict[str, str] = field(default_factory=dict)
    edge_args: Sequence[str] = ()
    gateway_args: Sequence[str] = ()
    project: str = "demo"
    max_sandboxes: int = 20
    e2b_domain: str | None = None


def _spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               "PYTHONUNBUFFERED": "1"}
        return subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else "(no log)"


def _healthy(url: str) -> list[str] | None:
    """The edges a gateway would place on now; None when it does not answer."""
    try:
        with urllib.request.urlopen(url + "/fleet/v1/health", timeout=2) as r:
            return sorted(json.loads(r.read())["healthy"])
    except (OSError, ValueError, KeyError):
        return None


async def _projects(db_url: str, spec: Spec) -> tuple[bytes, str, str]:
    db = await FleetDb.open(db_url)
    try:
        admin = await db.add_project("ops", max_sandboxes=100_000, admin=True, egress_protected=True)
        token = await db.add_project(spec.project, max_sandboxes=spec.max_sandboxes)
        return await db.fleet_key(), admin, token
    finally:
        await db.close()


async def _registered(db_url: str, ids: Sequence[str]) -> list[str]:
    db = await FleetDb.open(db_url)
    try:
        return [e.id for e in await db.edges() if e.id in ids and e.age < 5 and e.load]
    finally:
        await db.close()


def up(spec: Spec) -> dict[str, Any]:
    """Start the fleet ``spec`` describes; its ``fleet.json`` (see the module's docstring)."""
    root = spec.root
    if (root / STATE).exists():
        raise FleetUpError(f"{root / STATE} exists: a fleet is up there ('layerbox fleet down --dir {root}' first)")
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o700)
    state: dict[str, Any] = {"schema": STATE_SCHEMA, "root": str(root), "postgres": None, "gateways": [],
                             "edges": []}
    try:
        if spec.db is None:
            # its own directory outside root: every directory above a cluster must be open to the
            # postgres account, and root (with the edges' keys) is not
            pg = LocalPostgres(Path(tempfile.mkdtemp(prefix="layerbox-pg-", dir=PG_PARENT))).start()
            state["postgres"] = {"root": str(pg.root), "port": pg.port}
            spec.db = pg.url
        state["db"] = spec.db
        fleet_key, admin, token = run_blocking(_projects(spec.db, spec))
        state.update(admin_token=admin, project={"name": spec.project, "token": token})
        secret = root / "url.secret"
        secret.write_bytes(secrets.token_bytes(32))
        secret.chmod(0o600)
        _start_gateways(spec, state)
        _start_edges(spec, state, fleet_key, secret)
        _wait_ready(spec, state)
    except BaseException:
        _write(root, state)
        down(root)
        raise
    _write(root, state)
    return state


def _write(root: Path, state: Mapping[str, Any]) -> None:
    tmp = root / (STATE + ".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.chmod(0o600)
    os.replace(tmp, root / STATE)


def _start_gateways(spec: Spec, state: dict[str, Any]) -> None:
    for i in range(spec.gateways):
        port = free_port()
        argv = [sys.executable, "-m", "sandbox.fleet.gateway", "--db", str(spec.db), "--port", str(port),
                "--cache-dir", str(spec.root / f"gateway-{i}.cache")]
        if spec.e2b_domain:
            argv += ["--e2b-domain", spec.e2b_domain]
        for pool in spec.pools:  # every pool's store: the overflow's to judge, the home's to sync back to
            argv += ["--pool-store", f"{pool}={spec.pool_stores.get(pool, spec.store)}"]
        argv += spec.gateway_args
        log = spec.root / f"gateway-{i}.log"
        proc = _spawn(argv, log)
        state["gateways"].append({"url": f"http://127.0.0.1:{port}", "pid": proc.pid, "log": str(log), "argv": argv})


def _start_edges(spec: Spec, state: dict[str, Any], fleet_key: bytes, secret: Path) -> None:
    n = 0
    for pool, count in spec.pools.items():
        for _ in range(count):
            edge_id = f"edge-{n}"
            n += 1
            key = spec.root / f"{edge_id}.key"
            key.write_text(edge_key(fleet_key, edge_id).hex())
            key.chmod(0o600)
            port = free_port()
            argv = [sys.executable, "-m", "sandbox.edge", "--data-dir", str(spec.root / "edges" / edge_id),
                    "--store", spec.pool_stores.get(pool, spec.store), "--port", str(port), "--edge-id", edge_id,
                    "--pool", pool, "--fleet-key-file", str(key), "--url-secret-file", str(secret),
                    *[a for g in state["gateways"] for a in ("--fleet-gateway", g["url"])], *spec.edge_args]
            if spec.e2b_domain:
                argv += ["--e2b-domain", spec.e2b_domain]
            log = spec.root / f"{edge_id}.log"
            proc = _spawn(argv, log)
            state["edges"].append({"id": edge_id, "url": f"http://127.0.0.1:{port}", "pool": pool, "pid": proc.pid,
                                   "data_dir": str(spec.root / "edges" / edge_id), "log": str(log), "argv": argv})


def _wait_ready(spec: Spec, state: dict[str, Any]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    ids = [e["id"] for e in state["edges"]]
    while time.monotonic() < deadline:
        for proc in [*state["gateways"], *state["edges"]]:
            if not _alive(proc["pid"]):
                raise FleetUpError(f"{proc.get('id', proc['url'])} exited:\n{_tail(Path(proc['log']))}")
        if all(_healthy(g["url"]) == sorted(ids) for g in state["gateways"]):
            return  # every gateway places on every edge
        time.sleep(0.2)
    raise FleetUpError(f"the fleet was not ready after {READY_TIMEOUT:.0f} s: edges registered: "
                       f"{run_blocking(_registered(str(spec.db), ids))} of {ids}")


def _alive(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"


def _stop(pids: Sequence[int], timeout: float) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def restart(root: Path, name: str) -> dict[str, Any]:
    """Start again an edge (by id) or a gateway (by URL) of the fleet in ``root`` that is not
    running (killed, crashed), with its arguments: an edge adopts its sandboxes and re-registers."""
    state = json.loads((root / STATE).read_text())
    for proc in [*state["edges"], *state["gateways"]]:
        if name in (proc.get("id"), proc["url"]):
            if _alive(proc["pid"]):
                raise FleetUpError(f"{name} runs already (pid {proc['pid']})")
            proc["pid"] = _spawn(proc["argv"], Path(proc["log"])).pid
            _write(root, state)
            return proc
    raise FleetUpError(f"no edge or gateway {name!r} in {root / STATE}")


def down(root: Path) -> dict[str, Any]:
    """Stop and remove the fleet in ``root``; what was stopped."""
    path = root / STATE
    if not path.exists():
        return {"stopped": [], "postgres": False}
    state = json.loads(path.read_text())
    edges = [e["pid"] for e in state.get("edges", [])]
    _stop(edges, STOP_TIMEOUT)  # SIGTERM: each edge destroys its sandboxes and unmounts its layers
    _clean_edges(state)
    _stop([g["pid"] for g in state.get("gateways", [])], 10.0)
    if state.get("postgres"):
        LocalPostgres(Path(state["postgres"]["root"])).stop()
    shutil.rmtree(root, ignore_errors=True)
    return {"stopped": [e["id"] for e in state.get("edges", [])] + [g["url"] for g in state.get("gateways", [])],
            "postgres": bool(state.get("postgres"))}


def _clean_edges(state: Mapping[str, Any]) -> None:
    """What an edge killed by force left (sandboxes, mounts, its lazyfetch daemon): its next start's
    reconcile, run here since it will not start again."""
    from sandbox.host.manager import SandboxManager

    for edge in state.get("edges", []):
        data = Path(edge["data_dir"])
        if not data.exists():
            continue
        try:
            mgr = SandboxManager(data)
            mgr.reconcile()
            for st in mgr.list():
                mgr.destroy(st.id)
            mgr.close()
        except Exception as exc:  # the rest still goes
            print(f"fleet down: {edge['id']}: {exc}", file=sys.stderr)
