"""The fleet database alone (sandbox.fleet.db on a PostgreSQL cluster of its own): what the
fleet's tests cannot make happen on purpose, many reservations of one project at once."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox.core.errors import ApiError
from sandbox.fleet.db import FleetDb
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



def test_a_statement_is_one_round_trip(cluster: LocalPostgres) -> None:
    """The pool takes a connection back without resetting its session: asyncpg's default reset
    (``RESET ALL`` and more) doubled the transactions and round trips of every call."""
    marker = f"marker-{time.time_ns()}"

    async def run() -> None:
        db = await FleetDb.open(cluster.url)
        try:
            await db.pool.execute("ALTER SYSTEM SET log_statement = 'all'")
            await db.pool.execute("SELECT pg_reload_conf()")
            await asyncio.sleep(1.0)  # the server reads its configuration again
            await db.setting(marker)
            for _ in range(10):
                await db.route("lb-000000000000")
            await db.setting(marker + "-end")
        finally:
            await db.pool.execute("ALTER SYSTEM RESET log_statement")
            await db.pool.execute("SELECT pg_reload_conf()")
            await db.close()

    asyncio.run(run())
    text = (cluster.root / "server.log").read_text(errors="replace")
    between = text[text.index(marker):text.index(marker + "-end")]
    assert between.count("FROM sandboxes WHERE id") == 10, between[-2000:]
    assert "RESET ALL" not in between
