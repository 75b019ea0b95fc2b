"""Receipt logs: one append-only, hash-chained log per sandbox, in bounded segments.

Every action on a sandbox appends one record (format in docs/FORMAT.md, "Receipts");
each record carries ``prev``, the blake3 of the previous record's line exactly as
stored, so an edited, removed or reordered record breaks the chain at the record after it.

A log is a run of segments, ``receipts/<id>.jsonl`` the live one.  A segment holds at most
:data:`SEGMENT_RECORDS` records or about :data:`SEGMENT_BYTES`; then it is sealed as
``receipts/<id>.<n>.jsonl`` and the next one opens with a ``segment`` record that names the
sealed one's head (its ``prev``) and how many records came before, so the chain runs on
across segments.  A sandbox keeps its :data:`KEEP_SEGMENTS` newest segments (the live one
included): what a flood of actions can take on disk, what a read parses and what a keyed
command's replay searches are bounded, and the oldest segment kept anchors the chain.
Logs outlive their sandbox by :data:`RETENTION` (:meth:`ReceiptLogs.expire`, the reaper's).

Appends to one log serialise on a thread lock and an ``flock`` of the live segment (a CLI and
the service may share a data dir); an appender that waited on a segment sealed meanwhile opens
the new one.  Verification is kept per segment and content (:meth:`ReceiptLogs.verify`): a
sealed segment is hashed, not parsed, again; the live one is checked from where the last check
ended.  Paths come only from checked sandbox ids and are opened beneath the log directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import blake3

from layerstore.hoststate import closed_dir, private_fd
from sandbox.core.errors import ReceiptsBroken
from sandbox.core.model import SANDBOX_ID, check_sandbox_id
from sandbox.core.paths import STRICT, openat2

# A segment is sealed once it holds this many records, or once the next record would take it
# past this many bytes (a larger record still goes in, alone after the segment's opening).
SEGMENT_RECORDS = 2048
SEGMENT_BYTES = 1 << 20
KEEP_SEGMENTS = 4  # per sandbox, the live one included: at most ~4 MiB and 8,192 records
RETENTION = 7 * 86400.0  # seconds a destroyed sandbox's log is kept (from its last record)
EXPIRE_INTERVAL = 600.0  # the reaper looks for logs past their retention at most this often
SEGMENT = "segment"  # the action of a segment's opening record


def receipt_line(rec: Mapping[str, Any]) -> bytes:
    """A receipt as its log stores it: canonical JSON (sorted keys, ASCII), no newline."""
    return json.dumps(rec, sort_keys=True).encode()


def opens_segment(rec: Mapping[str, Any]) -> bool:
    """Whether ``rec`` is a segment's opening record (one a restored sandbox inherited is not)."""
    return rec.get("action") == SEGMENT and not rec.get("inherited") and "prev" in rec


def records_before(records: Sequence[Mapping[str, Any]]) -> int:
    """How many records of the log came before ``records`` (a segment's, or a checkpoint's)."""
    first = records[0] if records else {}
    return int(first.get("records_before", 0)) if opens_segment(first) else 0


def _opening(data: bytes) -> dict[str, Any] | None:
    """The opening record of the segment whose bytes are ``data``, None for one without (the first)."""
    try:
        first = json.loads(data[:data.find(b"\n")]) if b"\n" in data else None
    except ValueError:
        return None  # the chain check says what is wrong with it
    return first if isinstance(first, dict) and opens_segment(first) else None


@dataclass(frozen=True)
class Chain:
    """Where a walk along a chain stands: the last record's hash, how many records it took, whether
    it met a chained one; ``base`` records came before (for the messages' record numbers)."""

    head: str | None = None
    count: int = 0
    chained: bool = False
    base: int = 0

    def step(self, rec: Mapping[str, Any], digest: str, what: str) -> Chain:
        """The walk one record on, ``digest`` being the hash of its line; :class:`ReceiptsBroken` if
        it does not follow.  Records without ``prev`` are accepted only before the first chained
        one (logs written before the chain existed); a segment's opening record may come first
        with a ``prev`` of its own: what it follows may be gone (an older segment dropped)."""
        i = self.base + self.count
        if "prev" in rec:
            anchor = self.count == 0 and opens_segment(rec)
            if rec["prev"] != self.head and not anchor:
                raise ReceiptsBroken(
                    f"{what}: record {i} (id {rec.get('id')}, {rec.get('action')}) follows a record hashing to "
                    f"{self.head}, not {rec['prev']}: a record before it was edited, removed or reordered")
        elif self.chained:
            raise ReceiptsBroken(f"{what}: record {i} (id {rec.get('id')}) has no 'prev' after chained records")
        return Chain(digest, self.count + 1, self.chained or "prev" in rec, self.base)


def verify_receipt_chain(records: Sequence[Mapping[str, Any]], *, what: str) -> str | None:
    """Check that each record's ``prev`` is the blake3 of the record before it (null for the
    first, or the head a first ``segment`` record names); return the hash of the last record
    (the log's head), None for no records.  A log cut at its end is caught only against a
    head kept elsewhere.
    """
    chain = Chain()
    for rec in records:
        chain = chain.step(rec, blake3.blake3(receipt_line(rec)).hexdigest(), what)
    return chain.head


@dataclass(frozen=True)
class _Checked:
    """What checking the first ``length`` bytes (whole lines) of one segment file found."""

    ino: int
    length: int = 0
    digest: bytes = blake3.blake3(b"").digest()  # of those bytes: the content this holds for
    chain: Chain = Chain()
    opening: Mapping[str, Any] | None = None  # its opening record

    def extend(self, data: bytes, what: str) -> _Checked:
        """Checked on to the end of ``data``'s last whole line."""
        end = data.rfind(b"\n") + 1
        if end <= self.length:
            return self
        chain, opening = self.chain, self.opening
        for line in data[self.length:end].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                raise ReceiptsBroken(f"{what}: record {chain.base + chain.count} is not JSON") from None
            if chain.count == 0 and opens_segment(rec):
                opening = rec
            chain = chain.step(rec, blake3.blake3(line).hexdigest(), what)
        return replace(self, length=end, digest=blake3.blake3(data[:end]).digest(), chain=chain, opening=opening)

    @property
    def number(self) -> int:
        return int(self.opening["segment"]) if self.opening else 0

    @property
    def before(self) -> int:
        return int(self.opening.get("records_before", 0)) if self.opening else 0


@dataclass(frozen=True)
class _Tail:
    """The live segment as the last append left it: its inode and size, and what the next record needs."""

    ino: int
    size: int
    head: str | None
    count: int
    number: int
    before: int


@dataclass(frozen=True)
class _Segment:
    number: int
    ino: int
    data: bytes  # its whole lines


class ReceiptLogs:
    """The receipt logs of one manager (one data dir)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self._lock = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self._tails: dict[str, _Tail] = {}
        self._checked: dict[str, dict[int, _Checked]] = {}  # sandbox -> segment -> its last check
        self._expired_at = 0.0

    # -- paths --------------------------------------------------------------------------------------
    @staticmethod
    def _live_name(sid: str) -> str:
        return f"{check_sandbox_id(sid)}.jsonl"

    @staticmethod
    def _sealed_name(sid: str, number: int) -> str:
        return f"{check_sandbox_id(sid)}.{number}.jsonl"

    @contextlib.contextmanager
    def _dirfd(self) -> Iterator[int]:
        fd = os.open(self.dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            yield fd
        finally:
            os.close(fd)

    # -- appending ------------------------------------------------------------------------------------
    def append(self, sid: str, rec: Mapping[str, Any]) -> dict[str, Any]:
        """Append one record, chained to the one before it; returns it as stored (with ``prev``)."""
        closed_dir(self.dir)
        with self._lock:
            lock = self._locks.setdefault(sid, threading.Lock())
        with lock, self._dirfd() as dfd:
            fd = self._open_live(sid, dfd)
            try:
                tail = self._tail(sid, fd)
                stored = {**rec, "prev": tail.head}
                line = receipt_line(stored)
                if tail.count >= SEGMENT_RECORDS or (tail.count > 1 and tail.size + len(line) >= SEGMENT_BYTES):
                    new, tail = self._rotate(sid, dfd, tail)
                    os.close(fd)  # the sealed segment's lock: whoever waited on it finds the new live file
                    fd = new
                    self._drop(sid, dfd, tail.number - KEEP_SEGMENTS)
                    stored = {**rec, "prev": tail.head}
                    line = receipt_line(stored)
                os.write(fd, line + b"\n")
                self._tails[sid] = _Tail(tail.ino, tail.size + len(line) + 1, blake3.blake3(line).hexdigest(),
                                         tail.count + 1, tail.number, tail.before)
            finally:
                os.close(fd)
        return stored

    def _open_live(self, sid: str, dfd: int) -> int:
        """The live segment, open for appending and flocked: the file that is live once the lock is
        held (a rotation may have sealed the one this opened while it waited)."""
        name = self._live_name(sid)
        while True:
            fd = openat2(dfd, name, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600, STRICT)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                st = os.fstat(fd)
                with contextlib.suppress(FileNotFoundError):
                    if os.stat(name, dir_fd=dfd, follow_symlinks=False).st_ino == st.st_ino:
                        private_fd(fd)  # (an older layerbox's log was 0644)
                        return fd
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)

    def _tail(self, sid: str, fd: int) -> _Tail:
        st = os.fstat(fd)
        tail = self._tails.get(sid)
        if tail is not None and (tail.ino, tail.size) == (st.st_ino, st.st_size):
            return tail
        # another process appended, or this one never did: read the segment back (it is bounded)
        data = os.pread(fd, st.st_size, 0)
        last = data.rstrip(b"\n").rsplit(b"\n", 1)[-1]
        opening = _opening(data)
        return _Tail(st.st_ino, st.st_size, blake3.blake3(last).hexdigest() if data else None, data.count(b"\n"),
                     int(opening["segment"]) if opening else 0,
                     int(opening.get("records_before", 0)) if opening else 0)

    def _rotate(self, sid: str, dfd: int, tail: _Tail) -> tuple[int, _Tail]:
        """Seal the live segment (the caller holds its lock) and open the next, flocked, in its
        place; returns it and its tail.

        Order: (1) link the live file as ``<id>.<n>.jsonl``, (2) write the next segment's opening
        record to ``<id>.jsonl.tmp``, (3) rename it over the live name, (4) drop segments past the
        bound.  A crash after (1) leaves the live segment under two names, which the next rotation
        finds and goes on from; after (2), a temp file the next one truncates; after (3), segments
        (4) drops the next time.  An appender never sees the live name missing."""
        live, sealed = self._live_name(sid), self._sealed_name(sid, tail.number)
        try:
            os.link(live, sealed, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
        except FileExistsError:
            if os.stat(sealed, dir_fd=dfd, follow_symlinks=False).st_ino != tail.ino:
                os.unlink(sealed, dir_fd=dfd)  # not this segment: no log's number is ever reused
                os.link(live, sealed, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
        opening = {"id": uuid.uuid4().hex[:16], "sandbox": sid, "action": SEGMENT, "time": time.time(),
                   "segment": tail.number + 1, "records_before": tail.before + tail.count, "prev": tail.head}
        line = receipt_line(opening) + b"\n"
        tmp = live + ".tmp"
        new = openat2(dfd, tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600, STRICT)
        try:
            fcntl.flock(new, fcntl.LOCK_EX)  # taken before the name is live: the next appender waits
            os.write(new, line)
            os.rename(tmp, live, src_dir_fd=dfd, dst_dir_fd=dfd)
            ino = os.fstat(new).st_ino
        except BaseException:
            os.close(new)
            raise
        return new, _Tail(ino, len(line), blake3.blake3(line[:-1]).hexdigest(), 1, tail.number + 1,
                          tail.before + tail.count)

    def _drop(self, sid: str, dfd: int, number: int) -> None:
        """Remove the sealed segment ``number`` and every older one still there."""
        while number >= 0:
            try:
                os.unlink(self._sealed_name(sid, number), dir_fd=dfd)
            except FileNotFoundError:
                return
            self._checked.get(sid, {}).pop(number, None)
            number -= 1

    # -- reading --------------------------------------------------------------------------------------
    def _segments(self, sid: str) -> list[_Segment]:
        """The segments kept, oldest first, as one consistent view: the live one is read first, and a
        sealed segment never changes (a rotation meanwhile only adds a segment this view lacks)."""
        try:
            with self._dirfd() as dfd:
                fd = openat2(dfd, self._live_name(sid), os.O_RDONLY, 0, STRICT)
                try:
                    live = _Segment(0, os.fstat(fd).st_ino, _whole_lines(fd))
                finally:
                    os.close(fd)
                opening = _opening(live.data)
                live = replace(live, number=int(opening["segment"]) if opening else 0)
                out = [live]
                for number in range(live.number - 1, max(-1, live.number - KEEP_SEGMENTS), -1):
                    try:
                        fd = openat2(dfd, self._sealed_name(sid, number), os.O_RDONLY, 0, STRICT)
                    except FileNotFoundError:
                        break
                    try:
                        out.append(_Segment(number, os.fstat(fd).st_ino, _whole_lines(fd)))
                    finally:
                        os.close(fd)
        except FileNotFoundError:
            return []
        return out[::-1]

    def read(self, sid: str) -> list[dict[str, Any]]:
        """The records of the segments kept, oldest first (not checked: :meth:`history` is)."""
        return [json.loads(line) for seg in self._segments(sid) for line in seg.data.splitlines()]

    def history(self, sid: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The records of the segments kept, and :meth:`verify`'s answer for those very bytes."""
        segments = self._segments(sid)
        return ([json.loads(line) for seg in segments for line in seg.data.splitlines()],
                self._verify(sid, segments))

    def live(self, sid: str) -> list[dict[str, Any]]:
        """The live segment's records: what a checkpoint carries (its first names what came before)."""
        segments = self._segments(sid)
        return [json.loads(line) for line in segments[-1].data.splitlines()] if segments else []

    def verify(self, sid: str) -> dict[str, Any]:
        """Check the segments kept end to end: ``{"records": records in the log since it began,
        "head": hash of the last, "last": its id, "segments": segments kept, "kept": their records}``.

        Each segment is checked once per content: a sealed one is hashed, not parsed, again, and
        the live one is checked on from where the last check ended (its bytes up to there hashed
        again, so an edit anywhere is seen).  Across segments, each opening record must name the
        head and the record count of the segment before it; the oldest kept is taken at its word.
        """
        return self._verify(sid, self._segments(sid))

    def _verify(self, sid: str, segments: Sequence[_Segment]) -> dict[str, Any]:
        what = f"sandbox {sid}'s receipts"
        before: _Checked | None = None
        for i, seg in enumerate(segments):
            checked = self._check(sid, seg, what)
            if i == 0 and seg.number and checked.number != seg.number:
                raise ReceiptsBroken(f"{what}: segment {seg.number} does not open with its segment record")
            if before is not None:
                end = before.before + before.chain.count
                if (checked.number, checked.before, checked.opening and checked.opening["prev"]) != (
                        seg.number, end, before.chain.head):
                    raise ReceiptsBroken(
                        f"{what}: segment {seg.number} does not follow segment {seg.number - 1} (which ends at "
                        f"record {end}, hashing to {before.chain.head}): a segment was edited, removed or replaced")
            before = checked
        if before is None:
            return {"records": 0, "head": None, "last": None, "segments": 0, "kept": 0}
        last = segments[-1].data.rstrip(b"\n").rsplit(b"\n", 1)[-1]
        return {"records": before.before + before.chain.count, "head": before.chain.head,
                "last": json.loads(last).get("id") if last else None, "segments": len(segments),
                "kept": sum(seg.data.count(b"\n") for seg in segments)}

    def _check(self, sid: str, seg: _Segment, what: str) -> _Checked:
        checked = self._checked.get(sid, {}).get(seg.number)
        if checked is None or checked.ino != seg.ino or len(seg.data) < checked.length or \
                blake3.blake3(seg.data[:checked.length]).digest() != checked.digest:
            opening = _opening(seg.data)  # its records are numbered from where the log stood
            checked = _Checked(seg.ino, chain=Chain(base=int(opening.get("records_before", 0)) if opening else 0))
        checked = checked.extend(seg.data, what)
        self._checked.setdefault(sid, {})[seg.number] = checked
        return checked

    def find(self, sid: str, field: str, value: str) -> list[dict[str, Any]]:
        """The records of the segments kept whose ``field`` is ``value``, oldest first; only lines
        holding ``"field": "value"`` as stored are parsed."""
        needle = json.dumps({field: value})[1:-1].encode()
        return [rec for seg in self._segments(sid) for line in seg.data.splitlines() if needle in line
                and (rec := json.loads(line)).get(field) == value]

    def keyed(self, sid: str, key: str) -> dict[str, Any] | None:
        """The record of the command that ran (or started) under idempotency ``key``: a finished
        ``exec`` wins over an ``exec_started`` left by a crash or a preemption.  Searched in the
        segments kept: a key older than those has run out of the log."""
        found = None
        for rec in self.find(sid, "idempotency_key", key):
            if rec.get("action") in ("exec", "exec_started") and (found is None or rec["action"] == "exec"):
                found = rec
        return found

    def forget(self, sid: str) -> None:
        """The log is complete (its sandbox is gone): drop what is cached of it."""
        with self._lock:
            self._tails.pop(sid, None)
            self._locks.pop(sid, None)
            self._checked.pop(sid, None)

    # -- retention ------------------------------------------------------------------------------------
    def expire(self, now: float, alive: Callable[[str], bool]) -> list[str]:
        """Remove the logs of sandboxes gone (``alive`` says no) whose last record is older than
        :data:`RETENTION`; at most once per :data:`EXPIRE_INTERVAL`.  Returns their ids."""
        if now - self._expired_at < EXPIRE_INTERVAL:
            return []
        self._expired_at = now
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        logs: dict[str, list[str]] = {}
        for name in names:
            logs.setdefault(name.split(".", 1)[0], []).append(name)
        removed = []
        with self._dirfd() as dfd:
            for sid, files in logs.items():
                if not SANDBOX_ID.fullmatch(sid) or alive(sid) or now - _newest(dfd, files) < RETENTION:
                    continue
                for name in sorted(files, key=lambda n: n == self._live_name(sid)):  # the live one last
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=dfd)
                self.forget(sid)
                removed.append(sid)
        return removed


def _whole_lines(fd: int) -> bytes:
    """The file's bytes up to its last newline (an append may be under way past it)."""
    with os.fdopen(fd, "rb", closefd=False) as f:
        data = f.read()
    return data[:data.rfind(b"\n") + 1]


def _newest(dfd: int, names: Sequence[str]) -> float:
    mtimes = []
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            mtimes.append(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mtime)
    return max(mtimes, default=0.0)


