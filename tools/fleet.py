"""``layerbox fleet``: a local fleet up and down, projects and keys, the edges and their load.

Every verb prints JSON with ``--json`` (docs/FLEET.md names the fields scripts rely on).  The
database is ``--db URL``, else ``$LAYERBOX_FLEET_DB``, else that of the fleet ``fleet up`` started
in ``--dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from layerstore.eligibility import Eligibility
from sandbox.core.sync import run_blocking
from sandbox.edge.trust import edge_key
from sandbox.fleet import local
from sandbox.fleet.burst import BurstPolicy
from sandbox.fleet.db import FleetDb
from sandbox.fleet.drain import DrainError, drain

DEFAULT_DIR = Path("/var/tmp/layerbox-fleet")


def _pools(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in text.split(","):
        name, _, count = item.partition("=")
        if not name or not count.isdigit() or int(count) < 1:
            raise argparse.ArgumentTypeError(f"{item!r}: POOL=N with N at least 1 (e.g. onprem=3,cloud=1)")
        out[name] = int(count)
    return out


def _pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"{text!r}: POOL=URL")
    return name, value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="layerbox fleet", description=__doc__.split("\n")[0])
    p.add_argument("--db", help="the fleet database URL (default: $LAYERBOX_FLEET_DB, or --dir's fleet)")
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="where fleet up keeps its fleet (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON")
    # --json after the verb too (`fleet up ... --json`): SUPPRESS keeps the top level's value otherwise
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")
    sub = p.add_subparsers(dest="verb", required=True)
    add_parser = sub.add_parser

    def verb_parser(name: str, **kw: Any) -> argparse.ArgumentParser:
        return add_parser(name, parents=[common], **kw)

    sub.add_parser = verb_parser  # type: ignore[method-assign]
    u = sub.add_parser("up", help="start PostgreSQL (unless --db), gateways and edges on this machine")
    u.add_argument("--store", required=True, help="the store every pool reads unless --pool-store says otherwise")
    u.add_argument("--edges", type=int, default=2, help="edges in the pool 'default' (default %(default)s)")
    u.add_argument("--gateways", type=int, default=1)
    u.add_argument("--pools", type=_pools, help="POOL=N,...: edges per pool instead of --edges (the first pool "
                   "is the on-premises one)")
    u.add_argument("--pool-store", type=_pair, action="append", default=[], metavar="POOL=URL")
    u.add_argument("--max-sandboxes", type=int, default=20, help="the project's fleet-wide quota")
    u.add_argument("--e2b-domain")
    u.add_argument("--edge-arg", action="append", default=[], help="an argument for every edge (repeatable)")
    u.add_argument("--gateway-arg", action="append", default=[], help="an argument for every gateway (repeatable)")
    sub.add_parser("down", help="stop and remove the fleet in --dir")
    r = sub.add_parser("restart", help="start again a stopped edge (ID) or gateway (URL) of the fleet in --dir")
    r.add_argument("name")
    pr = sub.add_parser("project", help="add a project or a key")
    prs = pr.add_subparsers(dest="action", required=True)
    add = prs.add_parser("add", parents=[common])
    add.add_argument("name")
    add.add_argument("--max-sandboxes", type=int, default=10)
    add.add_argument("--creates-per-second", type=float, default=50.0)
    add.add_argument("--admin", action="store_true")
    key = prs.add_parser("key", parents=[common], help="another token for a project")
    key.add_argument("name")
    quota = prs.add_parser("quota", parents=[common], help="change a project's quota")
    quota.add_argument("name")
    quota.add_argument("--max-sandboxes", type=int)
    quota.add_argument("--creates-per-second", type=float)
    sub.add_parser("projects", help="projects with their quotas, live sandboxes and reservations")
    sub.add_parser("edges", help="the registry: each edge's pool, state, age and load")
    for verb in ("drain", "undrain", "forget"):
        d = sub.add_parser(verb, help={"drain": "place no more creates on an edge", "undrain": "place again",
                                       "forget": "remove an edge from the registry"}[verb])
        d.add_argument("edge")
        if verb == "drain":
            d.add_argument("--move", action="store_true", help="and move its sandboxes (with their ids) to other "
                           "edges of its pool: files, env and workdir; a VM's processes too")
    pol = sub.add_parser("policy", help="the burst policy: when creates overflow to another pool")
    pols = pol.add_subparsers(dest="action", required=True)
    pset = pols.add_parser("set", parents=[common], help="set it (docs/FLEET.md, 'Bursting')")
    pset.add_argument("--home", required=True, help="the pool creates go to first (on premises)")
    pset.add_argument("--overflow", required=True, help="the pool eligible creates overflow to")
    pset.add_argument("--threshold", type=float, default=0.8, help="home's utilization past which (default 0.8)")
    pset.add_argument("--wait", type=float, default=10.0, help="seconds an ineligible create waits for room")
    pset.add_argument("--eligible-prefix", action="append", default=[], metavar="PREFIX")
    pset.add_argument("--eligible-label", action="append", default=[], metavar="KEY=VALUE")
    pols.add_parser("show", parents=[common])
    pols.add_parser("clear", parents=[common])
    k = sub.add_parser("edge-key", help="the key an edge with this id needs (--fleet-key-file)")
    k.add_argument("edge")
    return p


def _db_url(args: argparse.Namespace) -> str:
    url = args.db or os.environ.get("LAYERBOX_FLEET_DB")
    if url:
        return str(url)
    path = args.dir / local.STATE
    if path.exists():
        return str(json.loads(path.read_text())["db"])
    raise SystemExit(f"layerbox fleet: no database: pass --db URL, set LAYERBOX_FLEET_DB, or 'fleet up' in {args.dir}")


async def _with_db(args: argparse.Namespace, work: Callable[[FleetDb], Awaitable[Any]]) -> Any:
    db = await FleetDb.open(_db_url(args))
    try:
        return await work(db)
    finally:
        await db.close()


async def _db_verb(args: argparse.Namespace, db: FleetDb) -> Any:
    if args.verb == "project":
        if args.action == "add":
            token = await db.add_project(args.name, max_sandboxes=args.max_sandboxes,
                                         creates_per_second=args.creates_per_second, admin=args.admin)
            return {"name": args.name, "token": token}
        if args.action == "key":
            return {"name": args.name, "token": await db.add_key(args.name)}
        row = await db.set_quota(args.name, max_sandboxes=args.max_sandboxes,
                                 creates_per_second=args.creates_per_second)
        return row.to_json()
    if args.verb == "projects":
        return [{**p.to_json(), "live": live, "reserved": reserved} for p, live, reserved in await db.projects()]
    if args.verb == "edges":
        return [e.to_json() for e in await db.edges()]
    if args.verb == "drain":
        try:
            return await drain(db, args.edge, move=args.move)
        except DrainError as exc:
            raise SystemExit(f"layerbox fleet drain: {exc}") from None
    if args.verb == "undrain":
        await db.set_edge_state(args.edge, "active")
        return {"edge": args.edge, "state": "active"}
    if args.verb == "forget":
        await db.forget_edge(args.edge)
        return {"edge": args.edge, "forgotten": True}
    if args.verb == "policy":
        return await _policy(args, db)
    assert args.verb == "edge-key"
    return {"edge": args.edge, "key": edge_key(await db.fleet_key(), args.edge).hex()}


async def _policy(args: argparse.Namespace, db: FleetDb) -> Any:
    if args.action == "show":
        return await db.setting("burst")
    if args.action == "clear":
        await db.set_setting("burst", None)
        return None
    try:
        policy = BurstPolicy(args.home, args.overflow, args.threshold, args.wait, Eligibility.from_flags(
            args.eligible_prefix, args.eligible_label, "layerbox fleet policy set"))
    except ValueError as exc:
        raise SystemExit(f"layerbox fleet policy set: {exc}") from None
    await db.set_setting("burst", policy.to_json())
    return policy.to_json()


def _print(args: argparse.Namespace, out: Any) -> None:
    if args.json:
        print(json.dumps(out, indent=1))
    elif args.verb == "edges":
        for e in out:
            boxes = e["load"].get("sandboxes", {})
            print(f"{e['id']:<16} {e['pool']:<10} {e['state']:<9} seen {e['last_seen_age']:6.1f}s ago  "
                  f"live {boxes.get('live', '?')}/{boxes.get('max', '?')}  {e['url']}")
    elif args.verb == "projects":
        for p in out:
            print(f"{p['name']:<20} live {p['live']}/{p['max_sandboxes']} reserved {p['reserved']} "
                  f"{p['creates_per_second']:g}/s")
    else:
        print(json.dumps(out, indent=1))


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(list(argv))
    args.dir = args.dir.absolute()
    if args.verb == "up":
        pools = args.pools or {"default": args.edges}
        spec = local.Spec(args.dir, args.store, pools, gateways=args.gateways, db=args.db,
                          pool_stores=dict(args.pool_store), edge_args=args.edge_arg, gateway_args=args.gateway_arg,
                          max_sandboxes=args.max_sandboxes, e2b_domain=args.e2b_domain)
        try:
            out = local.up(spec)
        except local.FleetUpError as exc:
            print(f"layerbox fleet up: {exc}", file=sys.stderr)
            return 1
    elif args.verb == "down":
        out = local.down(args.dir)
    elif args.verb == "restart":
        try:
            out = local.restart(args.dir, args.name)
        except local.FleetUpError as exc:
            print(f"layerbox fleet restart: {exc}", file=sys.stderr)
            return 1
    else:
        out = run_blocking(_with_db(args, lambda db: _db_verb(args, db)))
    _print(args, out)
    return 0
