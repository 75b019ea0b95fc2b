"""Receipt logs: one append-only, hash-chained JSONL file per sandbox (``receipts/<id>.jsonl``).

Every action on a sandbox appends one record (format in docs/FORMAT.md,
"Receipts"); each record carries ``prev``, the blake3 of the previous record's
line exactly as stored, so an edited, removed or reordered record breaks the
chain at the record after it.  Logs are kept after the sandbox is destroyed and
travel with its checkpoints (``layerbox.receipts.v1``).

Appends to one log serialise on a thread lock and an ``flock`` (a CLI and the
service may share a data dir); the head's hash is kept per log and re-read
from the file when another process appended meanwhile.  Paths come only from
checked sandbox ids and are opened beneath the log directory.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import blake3

from sandbox.core.errors import ReceiptsBroken
from sandbox.core.model import check_sandbox_id
from sandbox.core.paths import open_beneath


def receipt_line(rec: Mapping[str, Any]) -> bytes:
    """A receipt as its log stores it: canonical JSON (sorted keys, ASCII), no newline."""
    return json.dumps(rec, sort_keys=True).encode()


def verify_receipt_chain(records: Sequence[Mapping[str, Any]], *, what: str) -> str | None:
    """Check that each record's ``prev`` is the blake3 of the record before it (null for the
    first); return the hash of the last record (the log's head), None for no records.

    Records without ``prev`` are accepted only before the first chained one (logs written
    before the chain existed).  An edited, removed or reordered record breaks the chain at
    the record after it; a log cut at its end is caught only against a head kept elsewhere.
    """
    prev: str | None = None
    chained = False
    for i, rec in enumerate(records):
        if "prev" in rec:
            if rec["prev"] != prev:
                raise ReceiptsBroken(
                    f"{what}: record {i} (id {rec.get('id')}, {rec.get('action')}) follows a record hashing to "
                    f"{prev}, not {rec['prev']}: a record before it was edited, removed or reordered")
            chained = True
        elif chained:
            raise ReceiptsBroken(f"{what}: record {i} (id {rec.get('id')}) has no 'prev' after chained records")
        prev = blake3.blake3(receipt_line(rec)).hexdigest()
    return prev


def _last_line_hash(fd: int, size: int) -> str | None:
    """blake3 of the file's last line (read backwards; a line may hold 256 KiB of output)."""
    if size == 0:
        return None
    buf, pos = b"", size
    while pos > 0:
        step = min(1 << 16, pos)
        pos -= step
        buf = os.pread(fd, step, pos) + buf
        cut = buf.rfind(b"\n", 0, len(buf) - 1)
        if cut >= 0:
            return blake3.blake3(buf[cut + 1:].rstrip(b"\n")).hexdigest()
    return blake3.blake3(buf.rstrip(b"\n")).hexdigest()


class ReceiptLogs:
    """The receipt logs of one manager (one data dir)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self._lock = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self._heads: dict[str, tuple[int, str]] = {}  # log size -> hash of its last line

    def _open(self, sid: str, flags: int) -> int:
        return open_beneath(self.dir, f"{check_sandbox_id(sid)}.jsonl", flags, 0o600)

    def append(self, sid: str, rec: Mapping[str, Any]) -> dict[str, Any]:
        """Append one record, chained to the one before it; returns it as stored (with ``prev``)."""
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        with self._lock:
            lock = self._locks.setdefault(sid, threading.Lock())
        with lock:
            fd = self._open(sid, os.O_RDWR | os.O_CREAT | os.O_APPEND)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                size = os.fstat(fd).st_size
                head = self._heads.get(sid)
                prev = head[1] if head is not None and head[0] == size else _last_line_hash(fd, size)
                stored = {**rec, "prev": prev}
                line = receipt_line(stored)
                os.write(fd, line + b"\n")
                self._heads[sid] = (size + len(line) + 1, blake3.blake3(line).hexdigest())
            finally:
                os.close(fd)
        return stored

    def read(self, sid: str) -> list[dict[str, Any]]:
        try:
            fd = self._open(sid, os.O_RDONLY)
        except FileNotFoundError:
            return []
        with os.fdopen(fd, "rb") as f:
            return [json.loads(line) for line in f.read().splitlines() if line.strip()]

    def verify(self, sid: str) -> dict[str, Any]:
        """Check one log end to end: ``{"records": n, "head": hash of the last}``."""
        records = self.read(sid)
        return {"records": len(records), "head": verify_receipt_chain(records, what=f"sandbox {sid}'s receipts")}

    def keyed(self, sid: str, key: str) -> dict[str, Any] | None:
        """The record of the command that ran (or started) under idempotency ``key``: a finished
        ``exec`` wins over an ``exec_started`` left by a crash or a preemption."""
        found = None
        for rec in self.read(sid):
            if rec.get("idempotency_key") == key and rec.get("action") in ("exec", "exec_started"):
                if found is None or rec["action"] == "exec":
                    found = rec
        return found

    def forget(self, sid: str) -> None:
        """The log is complete (its sandbox is gone): drop what is cached of it."""
        with self._lock:
            self._heads.pop(sid, None)
            self._locks.pop(sid, None)
