"""The fleet database alone (sandbox.fleet.db on a PostgreSQL cluster of its own): what the
fleet's tests cannot make happen on purpose, many reservations of one project at once."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from sandbox.core.errors import ApiError
from sandbox.fleet.db import SCHEMA, FleetDb
from sandbox.fleet.pg import LocalPostgres
from tests.support.env import require

WORKERS = 16
EACH = 25


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalPostgres]:
    require("root")
    pg = LocalPostgres(Path(tempfile.mkdtemp(prefix="layerbox-pg-", dir="/var/tmp")))
    try:
        yield pg.start()
    finally:
        pg.stop()


@pytest.fixture
def db_url(cluster: LocalPostgres) -> str:
    return cluster.url


async def _race(url: str, project: str, rate: float, burst: int) -> tuple[Counter[str], float]:
    """WORKERS reserving (and releasing) EACH times at once: answers by code, and the seconds it took."""
    db = await FleetDb.open(url, max_size=WORKERS)
    try:
        await db.add_project(project, max_sandboxes=10_000, creates_per_second=rate, burst=burst)
        seen: Counter[str] = Counter()

        async def worker() -> None:
            for _ in range(EACH):
                try:
                    await db.release(await db.reserve(project, 1))
                    seen["ok"] += 1
                except ApiError as exc:
                    seen[exc.code] += 1

        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(WORKERS)))
        return seen, time.monotonic() - t0
    finally:
        await db.close()


def test_reservations_that_wait_for_the_row_lock_are_not_rate_limited(db_url: str) -> None:
    """A rate no burst can reach: every reservation passes.  (Reading the bucket's clock with now(),
    the transaction's start, one that waited for the row lock saw time run backwards: most of
    these were refused ``rate_limited``.)"""
    seen, _ = asyncio.run(_race(db_url, "unlimited", 1e9, 100))
    assert seen == Counter(ok=WORKERS * EACH)


def test_the_rate_limit_admits_no_more_than_burst_plus_rate_under_racing_reservations(db_url: str) -> None:
    seen, seconds = asyncio.run(_race(db_url, "limited", 100.0, 10))
    assert seen["ok"] + seen["rate_limited"] == WORKERS * EACH
    assert 10 <= seen["ok"] <= 10 + 100.0 * seconds + 1



async def _logged(cluster: LocalPostgres, db: FleetDb, calls: Callable[[], Awaitable[Any]]) -> str:
    """What the server logs of the statements ``calls`` sends (``log_statement = 'all'`` meanwhile),
    from a marker read before them to the one read after."""
    marker = f"marker-{time.time_ns()}"
    try:
        await db.pool.execute("ALTER SYSTEM SET log_statement = 'all'")
        await db.pool.execute("SELECT pg_reload_conf()")
        await asyncio.sleep(1.0)  # the server reads its configuration again
        await db.setting(marker)
        await calls()
        await db.setting(marker + "-end")
    finally:
        await db.pool.execute("ALTER SYSTEM RESET log_statement")
        await db.pool.execute("SELECT pg_reload_conf()")
    text = (cluster.root / "server.log").read_text(errors="replace")
    return text[text.index(marker):text.index(marker + "-end")]


def test_a_statement_is_one_round_trip(cluster: LocalPostgres) -> None:
    """The pool takes a connection back without resetting its session: asyncpg's default reset
    (``RESET ALL`` and more) doubled the transactions and round trips of every call."""
    async def run() -> str:
        db = await FleetDb.open(cluster.url)
        try:
            async def routes() -> None:
                for _ in range(10):
                    await db.route("lb-000000000000")
            return await _logged(cluster, db, routes)
        finally:
            await db.close()

    between = asyncio.run(run())
    assert between.count("FROM sandboxes WHERE id") == 10, between[-2000:]
    assert "RESET ALL" not in between


def test_a_reservation_is_one_round_trip(cluster: LocalPostgres) -> None:
    """It was six (BEGIN, the row lock, the count, the bucket, the insert, COMMIT), each a wait for
    a core on a busy gateway host; layerbox_reserve() runs them in the server."""
    async def run() -> str:
        db = await FleetDb.open(await _fresh_database(cluster, "one_trip"))
        try:
            await db.add_project("trips", max_sandboxes=100)

            async def reservations() -> None:
                for _ in range(5):
                    await db.reserve("trips", 1)
            return await _logged(cluster, db, reservations)
        finally:
            await db.close()

    between = asyncio.run(run())
    statements = [line for line in between.splitlines() if "statement:" in line or "execute " in line]
    assert len([s for s in statements if "layerbox_reserve" in s]) == 5, statements
    assert len(statements) == 5 + 1, statements  # and the end marker's read
    assert "BEGIN" not in between


def test_the_quota_holds_under_reservations_racing_through_several_gateways(cluster: LocalPostgres) -> None:
    """Each reservation counts, after the row lock, every one committed while it waited: of 48
    racing for 10 places through three gateways' pools, exactly 10 pass."""
    async def run() -> Counter[str]:
        url = await _fresh_database(cluster, "quota_race")
        dbs = [await FleetDb.open(url, max_size=WORKERS) for _ in range(3)]
        try:
            await dbs[0].add_project("tight", max_sandboxes=10, creates_per_second=1e9, burst=1000)
            seen: Counter[str] = Counter()

            async def one(db: FleetDb) -> None:
                try:
                    await db.reserve("tight", 1)
                    seen["ok"] += 1
                except ApiError as exc:
                    seen[exc.code] += 1

            await asyncio.gather(*(one(dbs[i % 3]) for i in range(48)))
            return seen
        finally:
            for db in dbs:
                await db.close()

    assert asyncio.run(run()) == Counter(ok=10, quota_exceeded=38)


async def _fresh_database(cluster: LocalPostgres, name: str) -> str:
    """A database of its own on the cluster (dropped first if a run before left it)."""
    admin = await asyncpg.connect(cluster.url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    return cluster.url.rsplit("/", 1)[0] + "/" + name


async def _counted(db: FleetDb) -> tuple[dict[str, int], dict[str, int]]:
    """Each project's ``live`` as the database keeps it, and its placed rows counted here."""
    kept = {r["name"]: int(r["live"]) for r in await db.pool.fetch("SELECT name, live FROM projects")}
    assert kept == {row.name: live for row, live, _ in await db.projects()}
    rows = await db.pool.fetch("SELECT project, count(*) AS n FROM sandboxes WHERE state = 'placed' GROUP BY project")
    counted = {name: 0 for name in kept} | {r["project"]: int(r["n"]) for r in rows if r["project"] in kept}
    return kept, counted


def test_each_projects_live_count_follows_every_statement_that_changes_its_sandboxes(cluster: LocalPostgres) -> None:
    """Creates, edges' reports (deleting, adding, moving rows), lost edges and their return, routes
    set and dropped, and two edges' reports racing over the same projects: the kept count is the
    count of placed rows after each, and no report deadlocks another."""
    async def run() -> None:
        db = await FleetDb.open(await _fresh_database(cluster, "live_counts"), max_size=8)
        try:
            for name in ("p-a", "p-b", "p-c"):
                await db.add_project(name, max_sandboxes=1000)
            steps: list[str] = []

            async def check(step: str) -> None:
                kept, counted = await _counted(db)
                steps.append(step)
                assert kept == counted, (steps, kept, counted)

            await db.commit(await db.reserve("p-a", 3), "p-a", [(f"a{i}", "e1") for i in range(3)])
            await check("commit")
            await db.reconcile("e1", [("a0", "p-a"), ("b0", "p-b"), ("b1", "p-b")], grace=0)
            await check("report: a1 and a2 go, b0 and b1 come")
            await db.reconcile("e2", [("b1", "p-b"), ("c0", "p-c")], grace=0)
            await check("report of another edge: b1 moves, c0 comes")
            await db.pool.execute("INSERT INTO edges (id, pool, url, boot, capabilities, load, images, last_seen) "
                                  "VALUES ('e1', 'p', 'http://x', 'b', '{}', '{}', '{}', now() - interval '1 hour')")
            assert await db.mark_lost(after=60) == 2
            await check("e1 lost")
            await db.reconcile("e1", [("a0", "p-a"), ("b0", "p-b")], grace=0)
            await check("e1 back")
            await db.set_route("c1", "p-c", "e2", "placed")
            await db.set_route("c1", "p-c", "e2", "lost")
            await check("a route set, then lost")
            await db.drop_route("c0")
            await check("a route dropped")

            many = [(f"r{i}", ("p-a", "p-b", "p-c")[i % 3]) for i in range(300)]
            reserved = [await db.reserve("p-c", 1) for _ in range(5)]
            await asyncio.gather(*(db.reconcile(f"e{k}", many[k - 3::4], grace=0) for k in range(3, 7)),
                                 *(db.commit(r, "p-c", [(f"x{i}", "e9")]) for i, r in enumerate(reserved)))
            await check("four reports and five creates at once")
            await asyncio.gather(*(db.reconcile(f"e{k}", [], grace=0) for k in range(3, 7)))
            await check("the four edges report nothing")
        finally:
            await db.close()

    asyncio.run(run())


def test_a_version_1_database_is_migrated_with_the_counts_it_had(cluster: LocalPostgres) -> None:
    """A database a version-1 gateway made (no ``live``, no triggers), holding sandboxes: opened by
    this version, each project's count is what its rows say, and later changes keep it."""
    async def run() -> None:
        url = await _fresh_database(cluster, "from_v1")
        conn = await asyncpg.connect(url)
        try:  # version 1 as it was: this schema without the column, the triggers and version 2
            await conn.execute(SCHEMA.replace(",\n    live integer NOT NULL DEFAULT 0);", ");"))
            assert "live" not in {r["column_name"] for r in await conn.fetch(
                "SELECT column_name FROM information_schema.columns WHERE table_name = 'projects'")}
            await conn.execute("INSERT INTO fleet_schema (version) VALUES (1)")
            await conn.execute("INSERT INTO projects (name, max_sandboxes, creates_per_second, burst, bucket) "
                               "VALUES ('old', 10, 50, 100, 100), ('idle', 10, 50, 100, 100)")
            await conn.execute("INSERT INTO sandboxes (id, project, edge, state) VALUES ('o1', 'old', 'e', 'placed'), "
                               "('o2', 'old', 'e', 'placed'), ('o3', 'old', 'e', 'lost')")
        finally:
            await conn.close()
        db = await FleetDb.open(url)
        try:
            assert await db.pool.fetchval("SELECT max(version) FROM fleet_schema") == 3
            kept, counted = await _counted(db)
            assert kept == counted == {"old": 2, "idle": 0}
            await db.drop_route("o1")
            await db.commit(await db.reserve("idle", 1), "idle", [("i1", "e")])
            kept, counted = await _counted(db)
            assert kept == counted == {"old": 1, "idle": 1}
        finally:
            await db.close()
        again = await FleetDb.open(url)  # opening a version-3 database changes nothing
        try:
            assert await again.pool.fetchval("SELECT count(*) FROM fleet_schema") == 3
            assert (await _counted(again))[0] == {"old": 1, "idle": 1}
        finally:
            await again.close()

    asyncio.run(run())


def test_a_project_at_its_quota_is_refused_by_the_kept_count(cluster: LocalPostgres) -> None:
    async def run() -> None:
        db = await FleetDb.open(await _fresh_database(cluster, "quota_kept"))
        try:
            await db.add_project("q", max_sandboxes=2)
            await db.reconcile("e", [("q1", "q"), ("q2", "q")], grace=0)  # reported, never reserved
            with pytest.raises(ApiError) as refused:
                await db.reserve("q", 1)
            assert refused.value.code == "quota_exceeded"
            await db.reconcile("e", [("q1", "q")], grace=0)
            await db.commit(await db.reserve("q", 1), "q", [("q3", "e")])
        finally:
            await db.close()

    asyncio.run(run())
