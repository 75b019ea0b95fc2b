"""The fleet's shared state in PostgreSQL: what every gateway reads and writes (docs/FORMAT.md,
"The fleet database").

What lives here and why:

- ``projects`` and ``keys``: who may call, with the quota each project has across the whole fleet.
  A key is stored as the SHA-256 of the token: a copy of the database lets nobody in.
- ``edges``: the registry.  Each edge's heartbeat (through any gateway) upserts its row with its
  load, capabilities and the images it has run lately; ``state`` is the operator's word
  (``active`` or ``draining``), health is ``last_seen``'s age, read against the database's clock
  (``now()``) so that skewed gateway clocks never eject a healthy edge.
- ``sandboxes``: the routing table, sandbox id -> edge, with the owning project.  The edge is
  not encoded in the id: a paused sandbox resumes on whichever edge placement picks, and a
  checkpoint's sandboxes start anywhere, so an id outlives its first edge.  Edges stay the
  truth about what runs on them: their reports reconcile this table.
- ``reservations``: creates in flight.  A create counts against its project's quota from the
  moment its reservation commits until the edge's answer replaces it with sandbox rows (or it is
  released; one whose gateway died expires).  Reservation and count happen in one transaction
  that holds the project's row lock, so creates racing through several gateways stay exact.
- ``settings``: the fleet key (edges' secrets derive from it) and the burst policy.

Every statement runs through :class:`FleetDb`, which counts transactions (the benchmark's
"transactions per create").
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg

from sandbox.core.errors import ApiError, SandboxError

# 2: projects.live, kept by triggers on sandboxes; 3: layerbox_reserve() (docs/FORMAT.md "The fleet database")
SCHEMA_VERSION = 3
RESERVATION_TTL = 180.0  # seconds: past the longest create an edge admits, then the reservation lapses
DEFAULT_RATE = 50.0  # creates per second per project
DEFAULT_BURST = 100

SCHEMA = """
CREATE TABLE IF NOT EXISTS fleet_schema (version integer PRIMARY KEY,
                                         applied_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE IF NOT EXISTS projects (
    name text PRIMARY KEY,
    max_sandboxes integer NOT NULL CHECK (max_sandboxes >= 0),
    creates_per_second double precision NOT NULL CHECK (creates_per_second > 0),
    burst integer NOT NULL CHECK (burst >= 1),
    bucket double precision NOT NULL,
    bucket_at timestamptz NOT NULL DEFAULT now(),
    admin boolean NOT NULL DEFAULT false,
    egress_protected boolean NOT NULL DEFAULT false,
    disabled boolean NOT NULL DEFAULT false,
    created_at timestamptz NOT NULL DEFAULT now(),
    live integer NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS keys (
    hash bytea PRIMARY KEY,
    project text NOT NULL REFERENCES projects(name) ON DELETE CASCADE,
    created_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE IF NOT EXISTS edges (
    id text PRIMARY KEY,
    pool text NOT NULL,
    url text NOT NULL,
    state text NOT NULL DEFAULT 'active' CHECK (state IN ('active', 'draining')),
    boot text NOT NULL,
    capabilities jsonb NOT NULL,
    load jsonb NOT NULL,
    images jsonb NOT NULL,
    registered_at timestamptz NOT NULL DEFAULT now(),
    last_seen timestamptz NOT NULL DEFAULT now());
CREATE TABLE IF NOT EXISTS sandboxes (
    id text PRIMARY KEY,
    project text NOT NULL,
    edge text NOT NULL,
    state text NOT NULL CHECK (state IN ('placed', 'lost')),
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now());
CREATE INDEX IF NOT EXISTS sandboxes_project ON sandboxes (project);
CREATE INDEX IF NOT EXISTS sandboxes_edge ON sandboxes (edge);
CREATE TABLE IF NOT EXISTS reservations (
    id bigserial PRIMARY KEY,
    project text NOT NULL,
    count integer NOT NULL CHECK (count >= 1),
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL);
CREATE INDEX IF NOT EXISTS reservations_project ON reservations (project);
CREATE TABLE IF NOT EXISTS settings (key text PRIMARY KEY, value jsonb NOT NULL);
"""

# Version 2: each project's count of `placed` sandboxes, kept on its row by the statements that
# change `sandboxes` (a trigger per kind of statement: transition tables take one event each), so a
# reservation reads one row where it counted the project's rows under the row lock (docs/SCALE.md:
# 59 reservations/s at 100,000 live).  The rows of the projects whose count a statement changes are
# locked in name order first: two edges' reports touching the same projects never lock them in
# opposite orders, and a report that only moves rows between edges locks none.
LIVE = """
CREATE OR REPLACE FUNCTION layerbox_live_apply(delta jsonb) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    delta := (SELECT coalesce(jsonb_object_agg(key, value), '{}') FROM jsonb_each(delta) WHERE value::integer <> 0);
    PERFORM 1 FROM projects WHERE name IN (SELECT jsonb_object_keys(delta)) ORDER BY name FOR UPDATE;
    UPDATE projects p SET live = p.live + (d.value)::integer FROM jsonb_each_text(delta) d WHERE p.name = d.key;
END $$;
CREATE OR REPLACE FUNCTION layerbox_live_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM layerbox_live_apply((SELECT coalesce(jsonb_object_agg(project, n), '{}') FROM
        (SELECT project, count(*) AS n FROM new_rows WHERE state = 'placed' GROUP BY project) c));
    RETURN NULL;
END $$;
CREATE OR REPLACE FUNCTION layerbox_live_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM layerbox_live_apply((SELECT coalesce(jsonb_object_agg(project, -n), '{}') FROM
        (SELECT project, count(*) AS n FROM old_rows WHERE state = 'placed' GROUP BY project) c));
    RETURN NULL;
END $$;
CREATE OR REPLACE FUNCTION layerbox_live_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM layerbox_live_apply((SELECT coalesce(jsonb_object_agg(project, n), '{}') FROM
        (SELECT project, sum(n) AS n FROM (
            SELECT project, 1 AS n FROM new_rows WHERE state = 'placed'
            UNION ALL SELECT project, -1 FROM old_rows WHERE state = 'placed') u GROUP BY project) c));
    RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER sandboxes_live_insert AFTER INSERT ON sandboxes
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION layerbox_live_insert();
CREATE OR REPLACE TRIGGER sandboxes_live_delete AFTER DELETE ON sandboxes
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION layerbox_live_delete();
CREATE OR REPLACE TRIGGER sandboxes_live_update AFTER UPDATE ON sandboxes
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION layerbox_live_update();
"""

# Version 3: a reservation in one round trip.  It was BEGIN, the project's row FOR UPDATE, the
# count, the bucket's UPDATE, the INSERT and COMMIT: six round trips per create, each a wait for
# a core on a busy gateway host.  The function runs the same statements in the same order, and
# in READ COMMITTED each statement of a VOLATILE function takes a new snapshot, so the count
# after the row lock sees every reservation committed while it waited, as before.  It answers
# the figures a refusal names, and the reservation's id only when it inserted one.
RESERVE = """
CREATE OR REPLACE FUNCTION layerbox_reserve(p_project text, p_count integer, p_ttl double precision,
    OUT known boolean, OUT held integer, OUT max_sandboxes integer, OUT bucket double precision,
    OUT creates_per_second double precision, OUT burst integer, OUT reservation bigint)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    r record;
    t timestamptz;
    idle double precision;
BEGIN
    SELECT p.max_sandboxes, p.creates_per_second, p.burst, p.bucket, p.live INTO r
        FROM projects p WHERE p.name = p_project FOR UPDATE;
    known := FOUND;
    IF NOT known THEN
        RETURN;
    END IF;
    max_sandboxes := r.max_sandboxes;
    creates_per_second := r.creates_per_second;
    burst := r.burst;
    -- the bucket's clock is read with the row lock held, not now() (the statement's start): one
    -- that waited for the lock would see time run backwards and move bucket_at back for the next
    SELECT r.live + (SELECT coalesce(sum(v.count), 0) FROM reservations v
                     WHERE v.project = p_project AND v.expires_at > now()),
           c, extract(epoch FROM c - (SELECT p.bucket_at FROM projects p WHERE p.name = p_project))
        INTO held, t, idle FROM clock_timestamp() AS c;
    bucket := least(r.burst::double precision, r.bucket + greatest(0.0, idle) * r.creates_per_second);
    IF held + p_count > r.max_sandboxes OR bucket < p_count THEN
        RETURN;
    END IF;
    UPDATE projects p SET bucket = layerbox_reserve.bucket - p_count, bucket_at = t WHERE p.name = p_project;
    INSERT INTO reservations (project, count, expires_at)
        VALUES (p_project, p_count, now() + make_interval(secs => p_ttl)) RETURNING id INTO reservation;
END $$;
"""


class FleetDbError(SandboxError):
    """The fleet database is out of reach or holds what this code cannot read."""

    retryable = True


def key_hash(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def new_token() -> str:
    return "lbk_" + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class ProjectRow:
    name: str
    max_sandboxes: int
    creates_per_second: float
    burst: int
    admin: bool
    egress_protected: bool
    disabled: bool

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "max_sandboxes": self.max_sandboxes,
                "creates_per_second": self.creates_per_second, "burst": self.burst, "admin": self.admin,
                "egress_protected": self.egress_protected, "disabled": self.disabled}


@dataclass(frozen=True)
class EdgeRow:
    id: str
    pool: str
    url: str
    state: str  # the operator's: active or draining
    boot: str
    capabilities: dict[str, Any]
    load: dict[str, Any]
    images: dict[str, Any]  # {"refs": [...], "layers": [...]}: what its sandboxes started from lately
    age: float  # seconds since its last heartbeat, by the database's clock

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "pool": self.pool, "url": self.url, "state": self.state, "boot": self.boot,
                "capabilities": self.capabilities, "load": self.load, "images": self.images,
                "last_seen_age": round(self.age, 3)}


@dataclass(frozen=True)
class Route:
    sandbox: str
    project: str
    edge: str
    state: str


def _project(row: Mapping[str, Any]) -> ProjectRow:
    return ProjectRow(row["name"], row["max_sandboxes"], row["creates_per_second"], row["burst"], row["admin"],
                      row["egress_protected"], row["disabled"])


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


async def _keep_session(conn: asyncpg.Connection) -> None:
    """The pool's reset of a connection it takes back: nothing.  asyncpg's default sends ``RESET ALL``
    and more, a round trip and a transaction of its own after every statement, for session state
    this code never sets (an open transaction is still rolled back before this is called)."""


class FleetDb:
    """A pool of connections to the fleet database; :meth:`open` migrates it to this schema."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self.transactions = 0

    @classmethod
    async def open(cls, url: str, *, min_size: int = 1, max_size: int = 10, wait: float = 5.0) -> FleetDb:
        try:
            pool = await asyncpg.create_pool(url, min_size=min_size, max_size=max_size, timeout=wait,
                                             command_timeout=wait, reset=_keep_session)
        except (OSError, asyncpg.PostgresError) as exc:
            raise FleetDbError(f"fleet database {redact(url)}: {exc}") from None
        db = cls(pool)
        await db.migrate()
        return db

    async def close(self) -> None:
        await self.pool.close()

    async def migrate(self) -> None:
        """Create the schema, or check that the one there is this version (a newer one is refused)."""
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(7270)")  # one migrator at a time
            await conn.execute(SCHEMA)
            found = await conn.fetchval("SELECT max(version) FROM fleet_schema")
            if found is not None and found > SCHEMA_VERSION:
                raise FleetDbError(f"the fleet database has schema version {found}; this layerbox reads "
                                   f"{SCHEMA_VERSION}: upgrade layerbox")
            if found is None or found < 2:
                # no write to sandboxes between the count and the triggers (gateways of version 1 may run)
                await conn.execute("LOCK TABLE sandboxes IN SHARE ROW EXCLUSIVE MODE")
                await conn.execute("ALTER TABLE projects ADD COLUMN IF NOT EXISTS live integer NOT NULL DEFAULT 0")
                await conn.execute(LIVE)
                await conn.execute("UPDATE projects p SET live = (SELECT count(*) FROM sandboxes s "
                                   "WHERE s.project = p.name AND s.state = 'placed')")
                await conn.execute("INSERT INTO fleet_schema (version) VALUES (2)")
            if found is None or found < 3:
                await conn.execute(RESERVE)
                await conn.execute("INSERT INTO fleet_schema (version) VALUES (3)")

    async def _fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        self.transactions += 1
        try:
            return list(await self.pool.fetch(query, *args))
        except (OSError, asyncpg.PostgresConnectionError, asyncpg.InterfaceError) as exc:
            raise FleetDbError(f"fleet database: {exc}") from None

    async def now(self) -> float:
        """The database's clock: the fleet's time (gateways sign and edges check by it)."""
        rows = await self._fetch("SELECT extract(epoch FROM clock_timestamp())::float8 AS t")
        return float(rows[0]["t"])

    @contextlib.asynccontextmanager
    async def leader(self, name: str) -> AsyncIterator[bool]:
        """Whether this process leads ``name`` for the block (one at a time across every gateway;
        a transaction-scoped advisory lock, so a gateway that dies lets go at once)."""
        key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)
        self.transactions += 1
        async with self.pool.acquire() as conn, conn.transaction():
            yield bool(await conn.fetchval("SELECT pg_try_advisory_xact_lock($1)", key))

    # -- settings ------------------------------------------------------------------------------------
    async def fleet_key(self) -> bytes:
        """The fleet's secret (made on first use): edges' keys derive from it (sandbox.edge.trust)."""
        rows = await self._fetch(
            "INSERT INTO settings (key, value) VALUES ('fleet_key', to_jsonb($1::text)) "
            "ON CONFLICT (key) DO UPDATE SET key = settings.key RETURNING value #>> '{}' AS v",
            secrets.token_hex(32))
        return bytes.fromhex(rows[0]["v"])

    async def setting(self, key: str) -> Any:
        rows = await self._fetch("SELECT value FROM settings WHERE key = $1", key)
        return _json(rows[0]["value"]) if rows else None

    async def set_setting(self, key: str, value: Any) -> None:
        await self._fetch("INSERT INTO settings (key, value) VALUES ($1, $2::jsonb) "
                          "ON CONFLICT (key) DO UPDATE SET value = excluded.value", key, json.dumps(value))

    # -- projects and keys -----------------------------------------------------------------------------
    async def add_project(self, name: str, *, max_sandboxes: int, creates_per_second: float = DEFAULT_RATE,
                          burst: int = DEFAULT_BURST, admin: bool = False, egress_protected: bool = False) -> str:
        """A new project and its first token (returned once; only its hash is kept)."""
        token = new_token()
        self.transactions += 1
        try:
            async with self.pool.acquire() as conn, conn.transaction():
                await conn.execute(
                    # (an edge may have reported sandboxes of the name before: they count from the start)
                    "INSERT INTO projects (name, max_sandboxes, creates_per_second, burst, bucket, admin, "
                    "egress_protected, live) VALUES ($1, $2, $3, $4, $7, $5, $6, (SELECT count(*) FROM sandboxes "
                    "WHERE project = $1 AND state = 'placed'))",
                    name, max_sandboxes, creates_per_second, burst, admin, egress_protected, float(burst))
                await conn.execute("INSERT INTO keys (hash, project) VALUES ($1, $2)", key_hash(token), name)
        except asyncpg.UniqueViolationError:
            raise ApiError(409, "conflict", f"project {name!r} exists already", field="name") from None
        return token

    async def add_key(self, name: str) -> str:
        token = new_token()
        rows = await self._fetch("INSERT INTO keys (hash, project) SELECT $1, name FROM projects WHERE name = $2 "
                                 "RETURNING project", key_hash(token), name)
        if not rows:
            raise ApiError(404, "not_found", f"no project {name!r}")
        return token

    async def set_quota(self, name: str, *, max_sandboxes: int | None = None,
                        creates_per_second: float | None = None, disabled: bool | None = None) -> ProjectRow:
        rows = await self._fetch(
            "UPDATE projects SET max_sandboxes = coalesce($2, max_sandboxes), "
            "creates_per_second = coalesce($3, creates_per_second), disabled = coalesce($4, disabled) "
            "WHERE name = $1 RETURNING *", name, max_sandboxes, creates_per_second, disabled)
        if not rows:
            raise ApiError(404, "not_found", f"no project {name!r}")
        return _project(rows[0])

    async def project_of_key(self, token: str) -> ProjectRow | None:
        rows = await self._fetch("SELECT p.* FROM keys k JOIN projects p ON p.name = k.project WHERE k.hash = $1",
                                 key_hash(token))
        return _project(rows[0]) if rows else None

    async def projects(self) -> list[tuple[ProjectRow, int, int]]:
        """Every project with its live sandboxes and reserved creates."""
        rows = await self._fetch(
            "SELECT p.*, (SELECT coalesce(sum(count), 0) FROM reservations r WHERE r.project = p.name "
            "AND r.expires_at > now()) AS reserved FROM projects p ORDER BY p.name")
        return [(_project(r), int(r["live"]), int(r["reserved"])) for r in rows]

    # -- quotas: reservations --------------------------------------------------------------------------
    async def reserve(self, project: str, count: int, *, ttl: float = RESERVATION_TTL) -> int:
        """A reservation for ``count`` creates, or 429: past the project's live-sandbox quota
        (``quota_exceeded``) or its creates per second (``rate_limited``, with Retry-After).

        One statement, ``layerbox_reserve()``, holding the project's row: concurrent reservations
        of one project, from any gateway, serialize on it and each sees the others' committed rows."""
        rows = await self._fetch("SELECT * FROM layerbox_reserve($1, $2, $3)", project, count, ttl)
        row = rows[0]
        if not row["known"]:
            raise ApiError(None, "forbidden", f"project {project!r} is not in the fleet")
        if row["reservation"] is not None:
            return int(row["reservation"])
        held, most = row["held"], row["max_sandboxes"]
        if held + count > most:
            raise ApiError(None, "quota_exceeded", (
                f"project {project!r} holds {held} of its {most} sandboxes across the fleet; "
                f"{count} more do not fit"), retryable=True, resources=("sandboxes",))
        rate = row["creates_per_second"]
        wait = (count - row["bucket"]) / rate
        raise ApiError(429, "rate_limited", (
            f"project {project!r} may create {rate:g} sandboxes a second "
            f"(burst {row['burst']}); retry in {wait:.2f} s"), retryable=True, retry_after=wait)

    async def commit(self, reservation: int, project: str, made: Sequence[tuple[str, str]]) -> None:
        """The reservation becomes the sandboxes made, (id, edge) each, in one statement."""
        await self._fetch(
            "WITH gone AS (DELETE FROM reservations WHERE id = $1) "
            "INSERT INTO sandboxes (id, project, edge, state) SELECT i, $2, e, 'placed' "
            "FROM unnest($3::text[], $4::text[]) AS t(i, e) "
            "ON CONFLICT (id) DO UPDATE SET edge = excluded.edge, state = 'placed', updated_at = now()",
            reservation, project, [sid for sid, _ in made], [edge for _, edge in made])

    async def release(self, reservation: int) -> None:
        await self._fetch("DELETE FROM reservations WHERE id = $1", reservation)

    # -- routing ---------------------------------------------------------------------------------------
    async def route(self, sid: str) -> Route | None:
        rows = await self._fetch("SELECT id, project, edge, state FROM sandboxes WHERE id = $1", sid)
        return Route(*rows[0].values()) if rows else None

    async def routes(self, project: str) -> list[Route]:
        rows = await self._fetch("SELECT id, project, edge, state FROM sandboxes WHERE project = $1 ORDER BY id",
                                 project)
        return [Route(*r.values()) for r in rows]

    async def routes_on(self, edge: str) -> list[Route]:
        rows = await self._fetch("SELECT id, project, edge, state FROM sandboxes WHERE edge = $1 ORDER BY id", edge)
        return [Route(*r.values()) for r in rows]

    async def set_route(self, sid: str, project: str, edge: str, state: str) -> None:
        await self._fetch(
            "INSERT INTO sandboxes (id, project, edge, state) VALUES ($1, $2, $3, $4) "
            "ON CONFLICT (id) DO UPDATE SET edge = excluded.edge, state = excluded.state, updated_at = now() "
            "WHERE sandboxes.project = excluded.project", sid, project, edge, state)

    async def drop_route(self, sid: str) -> None:
        await self._fetch("DELETE FROM sandboxes WHERE id = $1", sid)

    # -- the edge registry -----------------------------------------------------------------------------
    async def heartbeat(self, edge: str, *, pool: str, url: str, boot: str, capabilities: Mapping[str, Any],
                        load: Mapping[str, Any], images: Mapping[str, Any]) -> str:
        """Upsert an edge's row; returns its state (the operator's ``active`` or ``draining``)."""
        rows = await self._fetch(
            "INSERT INTO edges (id, pool, url, boot, capabilities, load, images) "
            "VALUES ($1, $2, $3, $4, $5::jsonb, $6::jsonb, $7::jsonb) ON CONFLICT (id) DO UPDATE SET "
            "pool = excluded.pool, url = excluded.url, boot = excluded.boot, capabilities = excluded.capabilities, "
            "load = excluded.load, images = excluded.images, last_seen = now() RETURNING state",
            edge, pool, url, boot, json.dumps(capabilities), json.dumps(load), json.dumps(images))
        return str(rows[0]["state"])

    async def edges(self) -> list[EdgeRow]:
        rows = await self._fetch("SELECT *, extract(epoch FROM now() - last_seen) AS age FROM edges ORDER BY id")
        return [EdgeRow(r["id"], r["pool"], r["url"], r["state"], r["boot"], _json(r["capabilities"]),
                        _json(r["load"]), dict(_json(r["images"])), float(r["age"])) for r in rows]

    async def set_edge_state(self, edge: str, state: str) -> None:
        rows = await self._fetch("UPDATE edges SET state = $2 WHERE id = $1 RETURNING id", edge, state)
        if not rows:
            raise ApiError(404, "not_found", f"no edge {edge!r} in the registry")

    async def forget_edge(self, edge: str) -> None:
        await self._fetch("DELETE FROM edges WHERE id = $1", edge)

    async def reconcile(self, edge: str, reported: Iterable[tuple[str, str]], *, grace: float) -> list[str]:
        """Make the table agree with what ``edge`` says it runs, (id, project) each: rows it does not
        report (and older than ``grace`` s: a create may not be in the report yet) go (one paused
        into the store lives on no edge: any edge finds it there); ones it reports come back as placed
        there (a create whose gateway died before recording it, a lost edge back).  Returns the ids
        whose rows changed (a gateway drops their cached routes)."""
        ids, projects = zip(*reported, strict=True) if reported else ((), ())
        rows = await self._fetch(
            "WITH gone AS (DELETE FROM sandboxes WHERE edge = $1 AND NOT (id = ANY($2::text[])) "
            "AND updated_at < now() - make_interval(secs => $4) RETURNING id), "
            "came AS (INSERT INTO sandboxes (id, project, edge, state) SELECT i, p, $1, 'placed' "
            "FROM unnest($2::text[], $3::text[]) AS t(i, p) ON CONFLICT (id) DO UPDATE SET edge = excluded.edge, "
            "state = 'placed', updated_at = now() WHERE sandboxes.edge <> excluded.edge "
            "OR sandboxes.state <> 'placed' RETURNING id) "
            "SELECT id FROM gone UNION ALL SELECT id FROM came",
            edge, list(ids), list(projects), grace)
        return [str(r["id"]) for r in rows]

    async def mark_lost(self, *, after: float) -> int:
        """Sandboxes of edges silent for ``after`` s are lost: they leave their project's quota (and
        come back if their edge does)."""
        rows = await self._fetch(
            "UPDATE sandboxes SET state = 'lost', updated_at = now() WHERE state = 'placed' AND edge IN "
            "(SELECT id FROM edges WHERE last_seen < now() - make_interval(secs => $1)) RETURNING id", after)
        return len(rows)

    async def expire(self) -> int:
        rows = await self._fetch("DELETE FROM reservations WHERE expires_at <= now() RETURNING id")
        return len(rows)


def redact(url: str) -> str:
    """A database URL without its password (for errors and logs)."""
    head, sep, tail = url.rpartition("@")
    if not sep:
        return url
    scheme, _, creds = head.partition("://")
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}:***@{tail}"
