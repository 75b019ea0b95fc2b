"""The snapshotter's metadata: snapshots, their parents, kinds, labels and usage, in SQLite.

One file, ``<root>/metadata.db`` (docs/FORMAT.md "The containerd snapshotter"),
written in WAL mode with ``synchronous=FULL``: every call that changes it is
one transaction, so after a crash the database holds each snapshot wholly or
not at all.  Directories follow the database: one is made before the row that
names it commits and removed after the row that named it is gone, so a crash
leaves at worst a directory no row names, which :meth:`Metadata.orphans`
finds and ``Cleanup`` (and every start) removes.

Keys and names are containerd's strings (``default/12/extract-... sha256:...``)
and are never used as paths: a snapshot's directory is its integer id.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from layerstore.hoststate import open_private
from snapshots.containerd.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound

SCHEMA_VERSION = 1
KIND_VIEW, KIND_ACTIVE, KIND_COMMITTED = 1, 2, 3
KIND_NAMES = {KIND_VIEW: "view", KIND_ACTIVE: "active", KIND_COMMITTED: "committed"}
MAX_KEY = 4096  # containerd's keys are short; a longer one is a client's mistake or an attack
MAX_LABELS_BYTES = 64 << 10  # containerd's own limit for a snapshot's labels is 4 KiB per label

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS snapshots (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  key TEXT NOT NULL UNIQUE,
  parent INTEGER REFERENCES snapshots(id),
  kind INTEGER NOT NULL,
  created INTEGER NOT NULL,
  updated INTEGER NOT NULL,
  labels TEXT NOT NULL,
  layer TEXT,
  size INTEGER NOT NULL DEFAULT 0,
  inodes INTEGER NOT NULL DEFAULT 0,
  publish TEXT
);
CREATE INDEX IF NOT EXISTS snapshots_parent ON snapshots(parent);
"""


@dataclass
class Snapshot:
    id: int
    key: str
    parent_id: int | None
    parent: str  # the parent's key, "" for none
    kind: int
    created: int  # ns since the epoch
    updated: int
    labels: dict[str, str]
    layer: dict[str, Any] | None  # a store layer (remote): {"doc", "chain", "entry"}
    size: int
    inodes: int
    publish: dict[str, Any] | None = field(default=None)  # {"state": "pending"|"done"|"failed", ...}


def check_key(key: object, what: str = "key") -> str:
    if not isinstance(key, str) or not key:
        raise InvalidArgument(f"{what}: an empty {what} names no snapshot")
    if len(key) > MAX_KEY or "\x00" in key:
        raise InvalidArgument(f"{what}: at most {MAX_KEY} characters, no NUL")
    return key


def check_labels(labels: Mapping[str, str]) -> dict[str, str]:
    out = dict(labels)
    if len(json.dumps(out)) > MAX_LABELS_BYTES:
        raise InvalidArgument(f"labels: at most {MAX_LABELS_BYTES} bytes in all")
    return out


class Metadata:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.RLock()
        # made 0600 before SQLite opens it (its -wal and -shm files take the database's mode): it
        # names every image and container of this host, and its directory may be open to others
        os.close(open_private(path))
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(_SCHEMA)
        row = self._db.execute("SELECT v FROM meta WHERE k='schema'").fetchone()
        if row is None:
            self._db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
        elif int(row[0]) > SCHEMA_VERSION:
            raise FailedPrecondition(f"{path}: schema {row[0]} is newer than this layerbox's "
                                     f"{SCHEMA_VERSION}; run the newer layerbox")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (BEGIN IMMEDIATE): all of it commits, or none (also on a crash)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # -- reads --------------------------------------------------------------------------
    def _row(self, row: tuple[Any, ...]) -> Snapshot:
        (id_, key, parent_id, parent_key, kind, created, updated, labels, layer, size, inodes,
         publish) = row
        return Snapshot(id_, key, parent_id, parent_key or "", kind, created, updated, json.loads(labels),
                        json.loads(layer) if layer else None, size, inodes,
                        json.loads(publish) if publish else None)

    _SELECT = ("SELECT s.id, s.key, s.parent, p.key, s.kind, s.created, s.updated, s.labels, s.layer, "
               "s.size, s.inodes, s.publish FROM snapshots s LEFT JOIN snapshots p ON s.parent = p.id")

    def find(self, key: str) -> Snapshot | None:
        with self._lock:
            row = self._db.execute(self._SELECT + " WHERE s.key = ?", (key,)).fetchone()
        return self._row(row) if row else None

    def get(self, key: str) -> Snapshot:
        snap = self.find(key)
        if snap is None:
            raise NotFound(f"snapshot {key!r} does not exist")
        return snap

    def by_id(self, id_: int) -> Snapshot:
        with self._lock:
            row = self._db.execute(self._SELECT + " WHERE s.id = ?", (id_,)).fetchone()
        if row is None:
            raise NotFound(f"snapshot #{id_} does not exist")
        return self._row(row)

    def all(self) -> list[Snapshot]:
        with self._lock:
            return [self._row(r) for r in self._db.execute(self._SELECT + " ORDER BY s.id")]

    def chain(self, snap: Snapshot) -> list[Snapshot]:
        """``snap``'s ancestors, nearest first (``snap`` not included)."""
        out = []
        while snap.parent_id is not None:
            snap = self.by_id(snap.parent_id)
            out.append(snap)
        return out

    def has_children(self, id_: int) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM snapshots WHERE parent = ? LIMIT 1", (id_,)).fetchone() is not None

    def ids(self) -> set[int]:
        with self._lock:
            return {r[0] for r in self._db.execute("SELECT id FROM snapshots")}

    # -- writes (each one transaction) ---------------------------------------------------
    def create(self, db: sqlite3.Connection, key: str, parent: str, kind: int, labels: Mapping[str, str], *,
               layer: Mapping[str, Any] | None = None) -> Snapshot:
        """Insert a snapshot inside the caller's transaction (which makes its directory)."""
        check_key(key)
        if db.execute("SELECT 1 FROM snapshots WHERE key = ?", (key,)).fetchone():
            raise AlreadyExists(f"snapshot {key!r} already exists")
        parent_id = None
        if parent:
            row = db.execute("SELECT id, kind FROM snapshots WHERE key = ?", (parent,)).fetchone()
            if row is None:
                raise NotFound(f"parent snapshot {parent!r} does not exist")
            if row[1] != KIND_COMMITTED:
                raise InvalidArgument(f"parent {parent!r} is not a committed snapshot")
            parent_id = row[0]
        now = time.time_ns()
        cur = db.execute(
            "INSERT INTO snapshots (key, parent, kind, created, updated, labels, layer) VALUES (?,?,?,?,?,?,?)",
            (key, parent_id, kind, now, now, json.dumps(check_labels(labels), sort_keys=True),
             json.dumps(dict(layer), sort_keys=True) if layer else None))
        assert cur.lastrowid is not None
        return Snapshot(cur.lastrowid, key, parent_id, parent, kind, now, now, dict(labels),
                        dict(layer) if layer else None, 0, 0)

    def commit(self, db: sqlite3.Connection, key: str, name: str, labels: Mapping[str, str],
               size: int, inodes: int, publish: Mapping[str, Any] | None) -> None:
        check_key(name, "name")
        row = db.execute("SELECT kind, labels FROM snapshots WHERE key = ?", (key,)).fetchone()
        if row is None:
            raise NotFound(f"snapshot {key!r} does not exist")
        if row[0] != KIND_ACTIVE:
            raise FailedPrecondition(f"snapshot {key!r} is {KIND_NAMES[row[0]]}, not active: only an "
                                     "active snapshot is committed")
        if db.execute("SELECT 1 FROM snapshots WHERE key = ?", (name,)).fetchone():
            raise AlreadyExists(f"snapshot {name!r} already exists")
        merged = {**json.loads(row[1]), **labels}
        db.execute("UPDATE snapshots SET key=?, kind=?, labels=?, updated=?, size=?, inodes=?, publish=? "
                   "WHERE key=?", (name, KIND_COMMITTED, json.dumps(check_labels(merged), sort_keys=True),
                                   time.time_ns(), size, inodes,
                                   json.dumps(dict(publish)) if publish else None, key))

    def remove(self, db: sqlite3.Connection, key: str) -> Snapshot:
        row = db.execute(self._SELECT + " WHERE s.key = ?", (key,)).fetchone()
        if row is None:
            raise NotFound(f"snapshot {key!r} does not exist")
        snap = self._row(row)
        if db.execute("SELECT 1 FROM snapshots WHERE parent = ? LIMIT 1", (snap.id,)).fetchone():
            raise FailedPrecondition(f"snapshot {key!r} has children: remove them first")
        db.execute("DELETE FROM snapshots WHERE id = ?", (snap.id,))
        return snap

    def set_labels(self, key: str, labels: Mapping[str, str]) -> Snapshot:
        with self.transaction() as db:
            if db.execute("SELECT 1 FROM snapshots WHERE key = ?", (key,)).fetchone() is None:
                raise NotFound(f"snapshot {key!r} does not exist")
            db.execute("UPDATE snapshots SET labels=?, updated=? WHERE key=?",
                       (json.dumps(check_labels(labels), sort_keys=True), time.time_ns(), key))
        return self.get(key)

    def set_publish(self, id_: int, publish: Mapping[str, Any]) -> None:
        with self.transaction() as db:
            db.execute("UPDATE snapshots SET publish=? WHERE id=?", (json.dumps(dict(publish)), id_))

    def set_usage(self, id_: int, size: int, inodes: int) -> None:
        with self.transaction() as db:
            db.execute("UPDATE snapshots SET size=?, inodes=? WHERE id=?", (size, inodes, id_))
