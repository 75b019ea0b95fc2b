"""The content-addressed store: documents, metadata images, packed chunks and refs.

``Store`` sits on a :class:`~layerstore.backend.Backend` (the bytes) and a
:class:`~layerstore.cache.MetadataCache` (this host's derived copy of the
small things).  Every immutable object read from the backend is checked
against its name before it is returned or cached; a mismatch raises
:class:`~layerstore.objects.DigestMismatch` naming the key and the store.

Write order (what makes a crash harmless, docs/FORMAT.md "Publishing"):
packs, then their index copies, then metadata images, then documents, then
the ref.  Each step only adds content-addressed objects that nothing points
at yet; the ref update is the single commit point.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import blake3

from layerstore.backend import Backend, ObjectNotFound, PreconditionFailed
from layerstore.cache import MetadataCache
from layerstore.errors import FormatError, LayerstoreError
from layerstore.locks import store_lock
from layerstore.objects import (
    CONFIG_KEY,
    PART_ORDER,
    REF_HISTORY,
    SCHEMA_REF,
    CompositionDoc,
    DigestMismatch,
    LayerEntry,
    Part,
    Resolved,
    canonical,
    digest_of,
    doc_key,
    hex_digest,
    index_key,
    load_json,
    meta_key,
    new_store_config,
    pack_key,
    parse_ref_doc,
    parse_store_config,
    parse_trace,
    ref_key,
    ref_name_from_key,
    resolve_document,
    trace_key,
)
from layerstore.packs import (
    ChunkLocation,
    PackBuilder,
    compress,
    decompress,
    parse_index,
)

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from layerstore.backends.s3 import ConditionalSupport

DEFAULT_REF_MAX_AGE = 30.0
UPLOAD_CONCURRENCY = 4
Progress = Callable[[str, int], None]


class RefNotFound(LayerstoreError, LookupError):
    pass


class ChunkMissing(LayerstoreError, FileNotFoundError):
    pass


def default_data_dir() -> Path:
    env = os.environ.get("LAYERBOX_DATA_DIR")
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/lib/layerbox")
    return Path.home() / ".local/share/layerbox"


def default_store_url() -> str:
    env = os.environ.get("LAYERBOX_STORE")
    if env:
        return env
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local/share")
    return f"file://{base / 'layerbox' / 'store'}"


@dataclass(frozen=True)
class RefState:
    name: str
    digest: str
    kind: str
    etag: str
    history: tuple[Mapping[str, Any], ...]


@dataclass(frozen=True)
class ConditionalWrites:
    """What :meth:`Store.check_conditional_writes` found out about the store's server."""

    kind: str  # "posix" (lock files and renames: nothing to probe) or "s3"
    endpoint: str | None  # the S3 endpoint, without credentials; None for POSIX
    support: ConditionalSupport | None  # the S3 probe's findings; None for POSIX


@dataclass
class UploadStats:
    chunks_new: int = 0
    chunks_present: int = 0
    bytes_new_raw: int = 0  # uncompressed bytes of chunks this publish added
    bytes_uploaded: int = 0  # compressed bytes sent (packs, indexes, metadata, documents)
    bytes_present: int = 0  # uncompressed bytes of chunks the store already had
    packs: int = 0
    requests: int = 0


class Store:
    def __init__(self, backend: Backend, cache: MetadataCache, *, ref_max_age: float = DEFAULT_REF_MAX_AGE) -> None:
        self.backend = backend
        self.cache = cache
        self.url = backend.url
        self.ref_max_age = ref_max_age
        self._index_synced = 0.0
        self._layout_checked = False  # the config object was read (or found absent) and accepted
        self._config_stored = False  # ... and it exists in the store

    @classmethod
    async def open(
        cls, url: str | None = None, data_dir: str | os.PathLike[str] | None = None, **backend_options: Any
    ) -> Store:
        from layerstore.backends import open_backend

        backend = open_backend(url or default_store_url(), **backend_options)
        cache = MetadataCache(Path(data_dir) if data_dir else default_data_dir(), backend.url)
        return cls(backend, cache)

    async def close(self) -> None:
        await self.backend.close()
        self.cache.close()

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def cache_path(self) -> Path:
        """This host's metadata cache directory for the store (derived data: may be deleted
        while no process has the store open; docs/FORMAT.md "The host cache")."""
        return self.cache.path

    def writer_lock(self, op: str = "publish") -> AbstractAsyncContextManager[str]:
        """The shared writer lock, for ``async with``: many writers at once, never with a gc.

        Hold it from the first upload a write dedups against (or references) to
        its ref, so that no gc can delete what the new objects name in between.
        ``op`` says what the holder does (``publish``, ``checkpoint``...), for
        people reading the lock object.  Raises :class:`~layerstore.locks.StoreLocked`
        while a gc runs (docs/FORMAT.md "Locks").
        """
        return store_lock(self.backend, "publish", op=op)

    async def check_conditional_writes(self) -> ConditionalWrites:
        """Probe what the store's server does with conditional writes (on scratch objects).

        Only S3 servers differ (``S3Backend.probe_conditional_writes``); a POSIX
        store's conditional writes are lock files and renames, and nothing is probed.
        """
        from layerstore.backends.s3 import S3Backend

        backend = self.backend
        while not isinstance(backend, S3Backend) and hasattr(backend, "inner"):
            backend = backend.inner  # under the wrappers open_backend stacked
        if not isinstance(backend, S3Backend):
            return ConditionalWrites("posix", None, None)
        return ConditionalWrites("s3", backend.endpoint, await backend.probe_conditional_writes())

    # -- the store config -----------------------------------------------------------------
    async def check_layout(self, *, create: bool = False) -> None:
        """Refuse a store whose ``config`` names a newer layout; with ``create``, store one.

        Checked once per ``Store`` before the first read or write that reaches
        the backend (reads served from the host cache need no check).  A store
        without ``config`` (empty, or older than the object) is layout 1; the
        first write stores the object with put-if-absent, so of two racing
        first writers one wins and both then read the winner's.
        """
        if self._layout_checked and (self._config_stored or not create):
            return
        what = f"{self.url}: {CONFIG_KEY}"
        try:
            data: bytes | None = await self.backend.get(CONFIG_KEY)
        except ObjectNotFound:
            data = None
        if data is None and create:
            fresh = canonical(new_store_config(uuid.uuid4().hex, _now()))
            if not await self.backend.put_if_absent(CONFIG_KEY, fresh):
                data = await self.backend.get(CONFIG_KEY)  # another writer's, or our retried one
            else:
                data = fresh
        if data is not None:
            parse_store_config(data, what)
            self._config_stored = True
        self._layout_checked = True

    # -- documents ----------------------------------------------------------------------
    async def put_doc(self, doc: Mapping[str, Any], stats: UploadStats | None = None) -> str:
        data = canonical(doc)
        digest = digest_of(data)
        await self.check_layout(create=True)
        # always ask the store: this host's cache may remember objects a gc
        # elsewhere has since deleted, and a document is small
        wrote = await self.backend.put_if_absent(doc_key(digest), data)
        if stats is not None:
            stats.requests += 1
            stats.bytes_uploaded += len(data) if wrote else 0
        self.cache.put_doc(digest, data)
        return digest

    async def get_doc(self, digest: str) -> dict[str, Any]:
        digest = "blake3:" + hex_digest(digest)
        data = self.cache.get_doc(digest)
        if data is None:
            key = doc_key(digest)
            await self.check_layout()
            data = await self.backend.get(key)
            actual = digest_of(data)
            if actual != digest:
                raise DigestMismatch(key, self.url, actual)
            self.cache.put_doc(digest, data)
        return load_json(data, f"{self.url}: document {digest}")

    # -- access traces --------------------------------------------------------------------
    async def get_trace(self, image_digest: str) -> dict[str, Any] | None:
        """The stored access trace of document (or layer) ``image_digest``, checked (``objects.parse_trace``).

        None when there is none, and also when the stored object is malformed
        (logged as a warning): a trace only costs speed.  Backend failures
        (unreachable store, credentials) raise as for any read, and an
        ``image_digest`` that is not a blake3 digest raises ``BadName``.
        """
        key = trace_key(image_digest)
        await self.check_layout()
        try:
            data = await self.backend.get(key)
        except ObjectNotFound:
            return None
        what = f"{self.url}: {key}"
        try:
            return parse_trace(load_json(data, what), image_digest, what)
        except FormatError as exc:
            log.warning("ignoring an unreadable access trace: %s", exc)
            return None

    async def put_trace(self, image_digest: str, doc: Mapping[str, Any]) -> None:
        """Store ``doc`` as the access trace of ``image_digest``, replacing any earlier one.

        ``doc`` must be ``{"schema": "layerbox.trace.v1", "image": image_digest,
        "layers": {layer digest: [chunk hex, ...]}}``; anything else raises
        :class:`FormatError` (``BadName`` for a bad ``image_digest``) before the
        store is touched.  ``image_digest`` may also be a layer's digest, with ``layers`` naming
        that layer alone: what mounts of any document read of it.  Stored as canonical JSON;
        gc removes it once no ref reaches ``image_digest``.  Takes no lock.
        """
        key = trace_key(image_digest)
        checked = parse_trace(doc, image_digest, f"{self.url}: refusing to store {key}")
        await self.check_layout(create=True)
        await self.backend.put(key, canonical(checked))

    # -- metadata images ----------------------------------------------------------------
    async def has_meta(self, layer: str) -> bool:
        if self.cache.get_meta(layer) is not None:
            return True
        await self.check_layout()
        return await self.backend.head(meta_key(layer)) is not None

    async def put_meta(self, image: bytes, stats: UploadStats | None = None) -> str:
        digest = digest_of(image)
        await self.check_layout(create=True)
        # a HEAD, not the local cache, decides: the cache may outlive a gc elsewhere
        if await self.backend.head(meta_key(digest)) is None:
            frame = await asyncio.to_thread(compress, image)
            wrote = await self.backend.put_if_absent(meta_key(digest), frame)
            if stats is not None:
                stats.requests += 1
                stats.bytes_uploaded += len(frame) if wrote else 0
        if stats is not None:
            stats.requests += 1
        self.cache.put_meta(digest, image)
        return digest

    async def get_meta(self, layer: str) -> bytes:
        layer = "blake3:" + hex_digest(layer)
        image = self.cache.get_meta(layer)
        if image is None:
            key = meta_key(layer)
            await self.check_layout()
            frame = await self.backend.get(key)
            try:
                image = await asyncio.to_thread(decompress, frame, 1 << 31)
            except Exception as exc:  # zstd raises its own error type for garbage
                raise DigestMismatch(key, self.url, f"undecodable zstd data ({exc})") from None
            actual = digest_of(image)
            if actual != layer:
                raise DigestMismatch(key, self.url, actual)
            self.cache.put_meta(layer, image)
        return image

    # -- chunk index ----------------------------------------------------------------------
    async def sync_index(self, *, force: bool = False) -> int:
        """Load every pack index not yet in the cache; returns how many were new."""
        await self.check_layout()
        known = self.cache.known_packs()
        new: list[str] = []
        present: set[bytes] = set()
        async for info in self.backend.list("index/"):
            pack_hex = info.key.rsplit("/", 1)[-1]
            present.add(bytes.fromhex(pack_hex))
            if bytes.fromhex(pack_hex) not in known:
                new.append(pack_hex)
        # packs a gc (maybe on another host) deleted: never dedup against them again
        self.cache.forget_packs(known - present)
        await _bounded(UPLOAD_CONCURRENCY * 2, [self.load_pack_index(p) for p in new])
        self._index_synced = time.monotonic()
        return len(new)

    async def load_pack_index(self, pack_hex: str) -> None:
        pack_id = bytes.fromhex(pack_hex)
        if self.cache.has_pack(pack_id):
            return
        key = index_key(pack_hex)
        index = await self.backend.get(key)
        records = parse_index(index, pack_id, f"{self.url}: {key}")
        await asyncio.to_thread(self.cache.add_pack, pack_id, records)

    async def load_layer_locations(self, layer: LayerEntry) -> None:
        await _bounded(UPLOAD_CONCURRENCY * 2, [self.load_pack_index(p) for p in layer.packs])

    def locate(self, digest: bytes) -> ChunkLocation | None:
        """Where chunk ``digest`` is, per this host's cache (after ``load_layer_locations``),
        or None.  A location is a hint: the chunk's digest check decides."""
        return self.cache.locate(digest)

    async def read_pack_range(self, pack: bytes, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of pack ``pack`` (one ranged GET), unverified.

        For readers that fetch a run of adjacent frames at once; each chunk in
        it MUST still be checked against its digest before use, and a result
        shorter than ``end - start`` (a range past the pack's end is clipped)
        treated as an error.  A missing pack raises :class:`ObjectNotFound`.
        """
        if not self._layout_checked:
            await self.check_layout()
        return await self.backend.get(pack_key(pack), start, end)

    async def read_chunk(self, digest: bytes, loc: ChunkLocation | None = None) -> bytes:
        """One chunk's bytes, fetched with a ranged GET and verified."""
        loc = loc or self.cache.locate(digest)
        if loc is None:
            raise ChunkMissing(
                f"{self.url}: chunk {digest.hex()} is not in any known pack; "
                "the image may have been garbage-collected or published incompletely"
            )
        key = pack_key(loc.pack)
        if not self._layout_checked:
            await self.check_layout()
        frame = await self.backend.get(key, loc.offset, loc.offset + loc.length)
        return await asyncio.to_thread(self._check_chunk, key, frame, digest, loc)

    def _check_chunk(self, key: str, frame: bytes, digest: bytes, loc: ChunkLocation) -> bytes:
        where = f"{key}@{loc.offset}+{loc.length} (chunk {digest.hex()})"
        try:
            data = decompress(frame, loc.raw_length)
        except Exception as exc:
            raise DigestMismatch(where, self.url, f"undecodable zstd data ({exc})") from None
        if blake3.blake3(data).digest() != digest:
            raise DigestMismatch(where, self.url, "blake3:" + blake3.blake3(data).hexdigest())
        return data

    async def missing_objects(self, layers: Iterable[LayerEntry]) -> list[str]:
        """Keys of the metadata objects and packs ``layers`` need that the store lacks.

        Asks the store (one ``head`` per distinct object), never this host's
        cache, which may remember objects a gc elsewhere has deleted.
        """
        layers = tuple(layers)
        keys = [meta_key(layer.digest) for layer in layers]
        keys += [pack_key(p) for layer in layers for p in layer.packs]
        await self.check_layout()
        return [key for key in dict.fromkeys(keys) if await self.backend.head(key) is None]

    # -- refs -------------------------------------------------------------------------------
    async def _get_ref_object(self, key: str) -> tuple[str, bytes] | None:
        """(etag, bytes) of the ref object, or None; the etag is taken before the bytes."""
        await self.check_layout()
        try:
            info = await self.backend.head(key)
            if info is None:
                return None
            return info.etag, await self.backend.get(key)
        except ObjectNotFound:
            return None

    async def read_ref(self, name: str) -> RefState:
        key = ref_key(name)
        found = await self._get_ref_object(key)
        if found is None:
            raise RefNotFound(f"{self.url}: no ref {name!r}; `layerbox ls` lists the refs")
        etag, data = found
        doc = parse_ref_doc(data, key, f"{self.url}: {key}")
        state = RefState(ref_name_from_key(key), doc["digest"], doc.get("kind", "image"), etag,
                         tuple(doc.get("history", ())))
        self.cache.put_ref(state.name, state.digest, etag)
        return state

    async def set_ref(self, name: str, digest: str, kind: str, *, expect: str | None = None,
                      create_only: bool = False, stats: UploadStats | None = None) -> RefState:
        """Point ``name`` at ``digest``, keeping history.

        Compare-and-swap against the ref's current version: concurrent writers
        each land (the later one wins and the earlier stays in the history);
        with ``expect`` set, fail instead if the ref no longer points there, and
        with ``create_only`` if the ref points elsewhere (:class:`PreconditionFailed`
        both; a ref that already names ``digest`` is left as it is).
        """
        key = ref_key(name)
        canonical_name = ref_name_from_key(key)
        digest = "blake3:" + hex_digest(digest)
        await self.check_layout(create=True)
        for _ in range(20):
            try:
                current = await self.read_ref(name)
            except RefNotFound:
                current = None
            if expect is not None and (current.digest if current else None) != expect:
                raise PreconditionFailed(key, self.url, f"expected {expect}, found {current.digest if current else 'no ref'}")
            if create_only and current is not None:
                if current.digest == digest:
                    return current  # made by another writer, or by our own attempt whose reply was lost
                raise PreconditionFailed(key, self.url, f"expected no ref, found {current.digest}")
            history = list(current.history) if current else []
            if current:
                history.insert(0, {"digest": current.digest, "kind": current.kind,
                                   "replaced": _now()})
            history = history[:REF_HISTORY]
            doc = {"schema": SCHEMA_REF, "name": canonical_name, "digest": digest, "kind": kind,
                   "updated": _now(), "host": socket.gethostname(), "history": history}
            data = canonical(doc)
            try:
                etag = await self.backend.put_conditional(key, data, current.etag if current else None)
            except PreconditionFailed:
                # A retried attempt whose first try landed reports PreconditionFailed
                # too: if the ref now holds exactly our bytes, the write is done (going
                # round again would add our own value to the history a second time).
                found = await self._get_ref_object(key)
                if found is None or found[1] != data:
                    await asyncio.sleep(0.01)
                    continue
                etag = found[0]
            if stats is not None:
                stats.requests += 2
            self.cache.put_ref(canonical_name, digest, etag)
            return RefState(canonical_name, digest, kind, etag, tuple(history))
        raise PreconditionFailed(key, self.url, "too much contention; try again")

    async def list_refs(self, prefix: str = "") -> list[RefState]:
        await self.check_layout()
        out = []
        async for info in self.backend.list("refs/" + prefix):
            name = ref_name_from_key(info.key)
            try:
                out.append(await self.read_ref(name))
            except RefNotFound:
                continue  # deleted while listing
        return out

    async def delete_ref(self, name: str) -> None:
        await self.backend.delete(ref_key(name))
        self.cache.drop_ref(ref_name_from_key(ref_key(name)))

    async def resolve(self, ref: str, *, refresh: bool = False) -> Resolved:
        """A ref name or a document digest -> its ordered layers and config."""
        if ref.startswith("blake3:") or (len(ref) == 64 and all(c in "0123456789abcdef" for c in ref)):
            digest = "blake3:" + hex_digest(ref)
        else:
            cached = None if refresh else self.cache.get_ref(ref_name_from_key(ref_key(ref)), self.ref_max_age)
            digest = cached[0] if cached else (await self.read_ref(ref)).digest
        return resolve_document(digest, await self.get_doc(digest))

    async def tag(self, source: str, name: str) -> RefState:
        """Point ``name`` at what ``source`` resolves to.

        Holds the shared writer lock (as a publish does) from resolving to
        moving the ref, so that no gc can delete the target in between.
        """
        async with self.writer_lock("tag"):
            resolved = await self.resolve(source, refresh=True)
            return await self.set_ref(name, resolved.digest, resolved.kind)

    async def compose(self, name: str, parts: Mapping[str, str]) -> RefState:
        """Resolve base/workspace/toolkit refs into one composition document and ref it."""
        unknown = set(parts) - set(PART_ORDER)
        if unknown or "base" not in parts:
            raise LayerstoreError(f"compose needs a base and only {', '.join(PART_ORDER)} parts (got {sorted(parts)})")
        # the shared writer lock, as in tag: no gc between resolving the parts and the ref
        async with self.writer_lock("compose"):
            return await self._compose(name, parts)

    async def _compose(self, name: str, parts: Mapping[str, str]) -> RefState:
        resolved_parts: list[Part] = []
        layers: list[LayerEntry] = []
        config: dict[str, Any] = {}
        for role in PART_ORDER:
            if role not in parts:
                continue
            src = parts[role]
            res = await self.resolve(src, refresh=True)
            if res.kind not in ("image", "composition"):
                raise LayerstoreError(f"{role} {src!r} is a {res.kind}, not an image")
            resolved_parts.append(Part(role, "" if src.startswith("blake3:") else src, res.digest))
            layers.extend(res.layers)
            config = _merge_config(config, res.config) if resolved_parts[:-1] else dict(res.config)
        doc = CompositionDoc(tuple(resolved_parts), tuple(layers), config)
        digest = await self.put_doc(doc.to_json())
        return await self.set_ref(name, digest, "composition")


def _merge_config(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Upper parts add environment (PATH entries prepend); the base keeps the rest."""
    out = json.loads(json.dumps(base))
    inner = out.setdefault("config", {})
    env = {e.split("=", 1)[0]: e for e in inner.get("Env") or []}
    for entry in (over.get("config") or {}).get("Env") or []:
        key, _, value = entry.partition("=")
        if key == "PATH" and key in env:
            old = env[key].split("=", 1)[1]
            parts = [p for p in value.split(":") if p and p not in old.split(":")]
            env[key] = "PATH=" + ":".join(parts + [old])
        else:
            env[key] = entry
    if env:
        inner["Env"] = sorted(env.values())
    return out


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


async def _bounded(limit: int, coros: Sequence[Awaitable[Any]]) -> list[Any]:
    sem = asyncio.Semaphore(limit)

    async def run(c: Awaitable[Any]) -> Any:
        async with sem:
            return await c

    return await asyncio.gather(*(run(c) for c in coros))


class ChunkUploader:
    """Packs new chunks and uploads packs with bounded concurrency.

    ``add`` skips chunks the store already has (per the cache's index, which
    ``Store.sync_index`` refreshes first).  A pack is uploaded before its index
    copy, so an index never names a missing pack.
    """

    def __init__(self, store: Store, stats: UploadStats, *, concurrency: int = UPLOAD_CONCURRENCY,
                 progress: Progress | None = None) -> None:
        self.store = store
        self.stats = stats
        self._pack = PackBuilder()
        self._sem = asyncio.Semaphore(concurrency)
        self._tasks: set[asyncio.Task[None]] = set()
        self._progress = progress
        self._confirmed: dict[bytes, bool] = {}  # pack id -> exists in the store (HEAD this run)
        self.locations: dict[bytes, ChunkLocation] = {}

    async def add_many(self, chunks: Iterable[tuple[bytes, Callable[[], bytes]]]) -> None:
        """(digest, read function) pairs; compression runs on worker threads in batches."""
        batch: list[tuple[bytes, Callable[[], bytes]]] = []
        for digest, read in chunks:
            loc = self.locations.get(digest)
            if loc is None:
                loc = self.store.cache.locate(digest)
                if loc is not None and not await self._pack_exists(loc.pack):
                    loc = None  # the cache outlived a gc: store the chunk again
            if loc is not None or digest in self._pack:
                if loc is not None:
                    self.locations[digest] = loc
                self.stats.chunks_present += 1
                self.stats.bytes_present += loc.raw_length if loc else 0
                continue
            batch.append((digest, read))
            if len(batch) >= 16:
                await self._compress_batch(batch)
                batch = []
        if batch:
            await self._compress_batch(batch)

    async def _pack_exists(self, pack_id: bytes) -> bool:
        """Whether a pack the host cache names is still in the store (one HEAD per pack per run).

        The cache only accumulates locations; a gc on any host may have deleted
        the pack since (``sync_index`` forgets such packs, but not every writer
        syncs first, e.g. a checkpoint).  Deduplicating against a deleted pack
        would make the new document name a chunk that does not exist.
        """
        known = self._confirmed.get(pack_id)
        if known is None:
            known = await self.store.backend.head(pack_key(pack_id)) is not None
            self.stats.requests += 1
            if not known:
                self.store.cache.forget_packs([pack_id])
            self._confirmed[pack_id] = known
        return known

    async def _compress_batch(self, batch: list[tuple[bytes, Callable[[], bytes]]]) -> None:
        def work(item: tuple[bytes, Callable[[], bytes]]) -> tuple[bytes, bytes, int]:
            digest, read = item
            data = read()
            return digest, compress(data), len(data)

        results = await asyncio.gather(*(asyncio.to_thread(work, item) for item in batch))
        for digest, frame, raw in results:  # in input order: packs are deterministic
            if digest in self._pack:
                continue
            self._pack.add(digest, frame, raw)
            self.stats.chunks_new += 1
            self.stats.bytes_new_raw += raw
            if self._progress:
                self._progress("chunk", raw)
            if self._pack.full:
                await self._flush()

    async def _flush(self) -> None:
        if not len(self._pack):
            return
        pack, self._pack = self._pack, PackBuilder()
        pack_id, data, index, records = pack.finish()
        for digest, loc in records:
            self.locations[digest] = loc
        await self._sem.acquire()
        task = asyncio.create_task(self._upload(pack_id, data, index, records))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _upload(self, pack_id: bytes, data: bytes, index: bytes,
                      records: list[tuple[bytes, ChunkLocation]]) -> None:
        try:
            await self.store.check_layout(create=True)
            if await self.store.backend.put_if_absent(pack_key(pack_id), data):
                self.stats.bytes_uploaded += len(data)
            await self.store.backend.put_if_absent(index_key(pack_id), index)
            self.stats.bytes_uploaded += len(index)
            self.stats.requests += 2
            self.stats.packs += 1
            await asyncio.to_thread(self.store.cache.add_pack, pack_id, records)
        finally:
            self._sem.release()

    async def finish(self) -> None:
        await self._flush()
        while self._tasks:
            done = list(self._tasks)
            results = await asyncio.gather(*done, return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException):
                    raise r

    def packs_for(self, digests: Iterable[bytes]) -> tuple[str, ...]:
        packs = set()
        for d in digests:
            loc = self.locations.get(d) or self.store.cache.locate(d)
            if loc is None:
                raise ChunkMissing(f"internal: chunk {d.hex()} has no location after upload")
            packs.add(loc.pack.hex())
        return tuple(sorted(packs))
