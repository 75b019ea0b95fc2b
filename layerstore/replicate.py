"""Copy refs from one store to another, moving only the objects the destination lacks.

``replicate(src, dst, prefixes)`` copies the refs whose names start with one of
``prefixes`` (every ref when none): images, compositions, checkpoints with their chains,
and whatever else a ref names.  What a ref reaches is found by the walk gc and verify
use (layerstore/reach.py); each object it finds is then asked for in the destination
(one ``head``), and only missing ones are read, checked and written.  Documents keep
their digests, so a ref names the same document in both stores.

The unit of transfer is the store's object: a pack (with its index copy), a metadata
object, a document, an access trace.  A document's layer entries name the packs that
hold its chunks, so a pack moves whole; a chunk shared by two images lives in one pack
of the source and moves once, and a pack the destination has is never read.  A chunk the
destination holds in another pack of its own (published there independently) moves
again inside the source's pack: see docs/FORMAT.md "Syncing stores".

Write order (docs/FORMAT.md "Syncing stores"), under the destination's shared writer
lock so that no gc there removes what the refs will name: packs then their index
copies, and metadata objects; then documents; then access traces; then each ref, by
compare-and-swap.  An interruption anywhere leaves objects nothing names yet, and a
rerun finds and skips them.  Every object read from the source is checked against its
name before it is written (a pack's hash and every chunk in it), so the destination
never holds bytes that do not match their name.

A destination ref that already names the source's document is left alone; one that
names another document is refused (reported as a ``conflict`` naming both digests)
unless ``force``, which moves it (compare-and-swap against what was read: a concurrent
writer wins and the ref is reported as a conflict).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from layerstore.backend import ObjectNotFound, PreconditionFailed
from layerstore.eligibility import Eligibility, judge_store
from layerstore.errors import FormatError, LayerstoreError
from layerstore.objects import (
    DigestMismatch,
    digest_of,
    doc_key,
    index_key,
    load_json,
    meta_key,
    pack_key,
    parse_trace,
    trace_key,
)
from layerstore.packs import PACK_RECORD, ChunkLocation, decompress, split_pack
from layerstore.reach import Reached, reach
from layerstore.store import RefNotFound, RefState, Store
from layerstore.verify import check_pack

log = logging.getLogger(__name__)

DEFAULT_JOBS = 8
KINDS = ("packs", "indexes", "meta", "docs", "traces")  # report keys, in write order
Progress = Callable[[str, int], None]  # (object kind, bytes written) after each object moved


class SyncError(LayerstoreError):
    """A sync could not copy something it needed; the message names the key and the store."""


@dataclass
class RefSync:
    """What happened to one source ref.

    ``status``: ``copied`` (new in the destination), ``moved`` (``force`` moved a
    destination ref that named another document), ``unchanged`` (already there),
    ``ineligible`` (the policy says no), ``conflict`` (the destination ref names another
    document), ``failed`` (the source ref reaches something unreadable).
    """

    name: str
    digest: str
    kind: str
    status: str = "pending"
    reason: str = ""

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "digest": self.digest, "kind": self.kind, "status": self.status,
                "reason": self.reason}


@dataclass
class SyncReport:
    source: str
    destination: str
    refs: list[RefSync] = field(default_factory=list)
    moved: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    chunks_moved: int = 0  # chunks in the packs written
    chunks_skipped: int = 0  # chunks in the packs the destination already had
    chunk_bytes_moved: int = 0  # compressed bytes of the chunks moved
    # chunks moved although the destination held them in other packs (or another pack of this
    # sync brought them): the price of moving whole packs, docs/FORMAT.md "Store known gaps"
    chunks_redundant: int = 0
    chunk_bytes_redundant: int = 0
    bytes_moved: int = 0  # every object written (what crossed the wire to the destination)
    bytes_total: int = 0  # every object the synced refs reach, as stored (what a copy into an empty store moves)
    logical_bytes: int = 0  # file data of the distinct layers they reach, uncompressed
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """No ref refused or failed (ineligible ones were left out on purpose)."""
        return not any(r.status in ("conflict", "failed") for r in self.refs)

    def with_status(self, *statuses: str) -> list[RefSync]:
        return [r for r in self.refs if r.status in statuses]

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source, "destination": self.destination,
            "refs": [r.to_json() for r in self.refs], "moved": dict(self.moved), "skipped": dict(self.skipped),
            "objects_moved": sum(self.moved.values()), "objects_skipped": sum(self.skipped.values()),
            "chunks_moved": self.chunks_moved, "chunks_skipped": self.chunks_skipped,
            "chunk_bytes_moved": self.chunk_bytes_moved, "chunks_redundant": self.chunks_redundant,
            "chunk_bytes_redundant": self.chunk_bytes_redundant, "bytes_moved": self.bytes_moved,
            "bytes_total": self.bytes_total, "logical_bytes": self.logical_bytes,
            "seconds": round(self.seconds, 3), "ok": self.ok,
        }


async def replicate(src: Store, dst: Store, prefixes: Sequence[str] = (), *, names: Sequence[str] = (),
                    policy: Eligibility | None = None, force: bool = False, jobs: int = DEFAULT_JOBS,
                    progress: Progress | None = None) -> SyncReport:
    """Copy the refs of ``src`` under ``prefixes`` and the refs ``names`` (exact names, each
    of which must exist: ``RefNotFound``) to ``dst``, every ref when both are empty; see the
    module docstring.

    With ``policy`` only eligible refs are copied (layerstore/eligibility.py); the others are
    reported ``ineligible`` with the reason.  ``jobs`` bounds the objects in transfer at once.
    Raises :class:`SyncError` (or the backend's error) when an object cannot be read or
    written; refs not yet written then stay as they were, and a rerun continues.
    """
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, not {jobs}")
    started = time.monotonic()
    report = SyncReport(src.url, dst.url)
    await src.check_layout()
    states = await _source_refs(src, prefixes, names)
    report.refs = [RefSync(s.name, s.digest, s.kind) for s in states]
    if policy is not None:
        await _judge(src, policy, report.refs)
    walks = await _walk(src, report.refs)
    async with dst.writer_lock("sync"):
        await dst.check_layout(create=True)
        current = await _destination_refs(dst, report.refs, force)
        reached = Reached()
        for ref in report.refs:
            if ref.name in walks and ref.status in ("pending", "unchanged"):
                reached.merge(walks[ref.name])
        await _Copier(src, dst, report, jobs, progress).copy(reached)
        await _write_refs(dst, report.refs, current)
    report.seconds = time.monotonic() - started
    return report


async def _source_refs(src: Store, prefixes: Sequence[str], names: Sequence[str]) -> list[RefState]:
    found: dict[str, RefState] = {}
    for prefix in prefixes or ([] if names else [""]):
        for state in await src.list_refs(prefix):
            found[state.name] = state
    for name in names:
        state = await src.read_ref(name)
        found[state.name] = state
    return [found[name] for name in sorted(found)]


async def _judge(src: Store, policy: Eligibility, refs: list[RefSync]) -> None:
    judge = await judge_store(src, policy)  # every ref naming a document counts, not only the selected
    for ref in refs:
        why = await judge.why_not(ref.digest, [ref.name])
        if why is not None:
            ref.status, ref.reason = "ineligible", why


async def _walk(src: Store, refs: list[RefSync]) -> dict[str, Reached]:
    """What each pending ref reaches; a ref whose walk fails is marked ``failed``."""
    out: dict[str, Reached] = {}
    for ref in refs:
        if ref.status != "pending":
            continue
        try:
            out[ref.name] = await reach([ref.digest], src.get_doc)
        except (LayerstoreError, KeyError, TypeError) as exc:
            ref.status = "failed"
            ref.reason = (f"{src.url}: ref {ref.name} reaches an unreadable document ({exc!r}); "
                          f"run `layerbox verify {ref.name}` on the source")
    return out


async def _destination_refs(dst: Store, refs: list[RefSync], force: bool) -> dict[str, RefState | None]:
    """Read each pending ref in ``dst``: mark ``unchanged`` and ``conflict`` ones; the states read."""
    current: dict[str, RefState | None] = {}
    for ref in refs:
        if ref.status != "pending":
            continue
        try:
            state: RefState | None = await dst.read_ref(ref.name)
        except RefNotFound:
            state = None
        current[ref.name] = state
        if state is not None and state.digest == ref.digest:
            ref.status = "unchanged"  # its objects are still checked: a damaged copy is repaired
        elif state is not None and not force:
            ref.status, ref.reason = "conflict", _conflict(dst, ref, state.digest)
    return current


def _conflict(dst: Store, ref: RefSync, theirs: str) -> str:
    return (f"{dst.url}: ref {ref.name} names {theirs}, not the source's {ref.digest}; "
            f"left as it is (sync with --force to move it)")


async def _write_refs(dst: Store, refs: list[RefSync], current: dict[str, RefState | None]) -> None:
    """The commit points, one per ref, each a compare-and-swap against what was read."""
    for ref in refs:
        if ref.status != "pending":
            continue
        before = current[ref.name]
        try:
            if before is None:
                await dst.set_ref(ref.name, ref.digest, ref.kind, create_only=True)
            else:
                await dst.set_ref(ref.name, ref.digest, ref.kind, expect=before.digest)
        except PreconditionFailed:
            try:
                theirs = (await dst.read_ref(ref.name)).digest
            except RefNotFound:
                theirs = "no document (deleted meanwhile)"
            ref.status, ref.reason = "conflict", _conflict(dst, ref, theirs) + " (written meanwhile)"
            continue
        ref.status = "copied" if before is None else "moved"
        if before is not None:
            ref.reason = f"was {before.digest}"


@dataclass
class _Object:
    kind: str  # one of KINDS
    key: str
    size: int = 0  # as stored in the source
    present: bool = False  # in the destination


class _Copier:
    """Plans and moves the objects of one sync: bounded parallel, in write order."""

    def __init__(self, src: Store, dst: Store, report: SyncReport, jobs: int, progress: Progress | None) -> None:
        self.src, self.dst, self.report = src, dst, report
        self.jobs = jobs
        self.progress = progress
        self.moved_chunks: set[bytes] = set()

    async def copy(self, reached: Reached) -> None:
        self.report.logical_bytes = sum(layer.bytes for layer in reached.layers.values())
        packs = sorted({p for layer in reached.layers.values() for p in layer.packs})
        pack_objs = [(_Object("packs", pack_key(p)), _Object("indexes", index_key(p))) for p in packs]
        metas = [_Object("meta", meta_key(d)) for d in reached.layers]
        docs = [_Object("docs", doc_key(d)) for d in reached.docs]
        traces = [_Object("traces", trace_key(d)) for d in (*reached.docs, *reached.layers)]
        await self._bounded([self._look(o) for pair in pack_objs for o in pair])
        await self._bounded([self._look(o) for o in (*metas, *docs)])
        await self._bounded([self._look(o, optional=True) for o in traces])
        if any(not pack.present for pack, _ in pack_objs):
            await self.dst.sync_index()  # which chunks the destination has in its own packs: for the report
        # content first; documents once all of it is in; traces, which name documents and layers, last
        await self._bounded([*(self._pack(pack, index) for pack, index in pack_objs),
                             *(self._meta(o) for o in metas)])
        await self._bounded([self._doc(o) for o in docs])
        await self._bounded([self._trace(o) for o in traces if o.size >= 0])

    async def _bounded(self, coros: Iterable[Coroutine[Any, Any, None]]) -> None:
        """Run with at most ``jobs`` at once; the first failure cancels the rest and is raised."""
        sem = asyncio.Semaphore(self.jobs)

        async def one(coro: Coroutine[Any, Any, None]) -> None:
            try:
                async with sem:
                    await coro
            finally:
                coro.close()  # one cancelled while it waited for its turn never started

        tasks = [asyncio.ensure_future(one(c)) for c in coros]
        if not tasks:
            return
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                exc = task.exception()
                if exc is not None:
                    raise exc
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _look(self, obj: _Object, *, optional: bool = False) -> None:
        """Its size in the source and whether the destination has it (a missing optional one: size -1)."""
        info = await self.src.backend.head(obj.key)
        if info is None:
            if optional:
                obj.size = -1
                return
            raise SyncError(f"{self.src.url}: {obj.key} is missing, but a ref being synced needs it; "
                            "run `layerbox verify` on the source")
        obj.size = info.size
        obj.present = await self.dst.backend.head(obj.key) is not None
        self.report.bytes_total += info.size

    async def _get(self, key: str) -> bytes:
        try:
            return await self.src.backend.get(key)
        except ObjectNotFound:
            raise SyncError(f"{self.src.url}: {key} vanished during the sync (a gc there?); "
                            "sync again") from None

    async def _put(self, obj: _Object, data: bytes) -> None:
        # put_if_absent: a concurrent sync or publish may have written the same content meanwhile
        if not await self.dst.backend.put_if_absent(obj.key, data):
            return self._skip(obj)
        self.report.moved[obj.kind] += 1
        self.report.bytes_moved += len(data)
        if self.progress is not None:
            self.progress(obj.kind, len(data))

    def _skip(self, obj: _Object) -> None:
        self.report.skipped[obj.kind] += 1

    async def _pack(self, pack: _Object, index: _Object) -> None:
        """A pack and then its index copy; a pack the destination has is never read."""
        if pack.present and index.present:
            self._skip(pack)
            self._skip(index)
            self.report.chunks_skipped += index.size // PACK_RECORD.size
            return
        data = await self._get(pack.key)
        problems, _, _ = await asyncio.to_thread(check_pack, pack.key, data, None)
        if problems:
            raise DigestMismatch(pack.key, self.src.url, f"something else ({'; '.join(problems[:3])})")
        own_index, records = split_pack(data, pack.key)
        if pack.present:  # an earlier sync stopped between the two
            self._skip(pack)
            self.report.chunks_skipped += len(records)
        else:
            await self._put(pack, data)
            self._count_moved(records)
        # the copy is derived from the checked pack, not read from the source's copy
        await self._put(index, own_index)

    def _count_moved(self, records: list[tuple[bytes, ChunkLocation]]) -> None:
        for digest, loc in records:
            self.report.chunks_moved += 1
            self.report.chunk_bytes_moved += loc.length
            if digest in self.moved_chunks or self.dst.locate(digest) is not None:
                self.report.chunks_redundant += 1
                self.report.chunk_bytes_redundant += loc.length
            self.moved_chunks.add(digest)

    async def _meta(self, obj: _Object) -> None:
        if obj.present:
            return self._skip(obj)
        frame = await self._get(obj.key)
        want = "blake3:" + obj.key.rsplit("/", 1)[-1]

        def check() -> None:
            try:
                image = decompress(frame, 1 << 31)
            except Exception as exc:  # zstd raises its own error type for garbage
                raise DigestMismatch(obj.key, self.src.url, f"undecodable zstd data ({exc})") from None
            if digest_of(image) != want:
                raise DigestMismatch(obj.key, self.src.url, digest_of(image))

        await asyncio.to_thread(check)
        await self._put(obj, frame)

    async def _doc(self, obj: _Object) -> None:
        if obj.present:
            return self._skip(obj)
        data = await self._get(obj.key)
        actual = digest_of(data)
        if actual != "blake3:" + obj.key.rsplit("/", 1)[-1]:
            raise DigestMismatch(obj.key, self.src.url, actual)
        await self._put(obj, data)

    async def _trace(self, obj: _Object) -> None:
        """A trace only speeds up mounts: one the destination has (maybe newer) is kept."""
        if obj.present:
            return self._skip(obj)
        what = f"{self.src.url}: {obj.key}"
        try:
            data = await self.src.backend.get(obj.key)
            parse_trace(load_json(data, what), obj.key.rsplit("/", 1)[-1], what)
        except (ObjectNotFound, FormatError) as exc:
            log.warning("not copying an access trace: %s", exc)
            return None
        await self._put(obj, data)
