"""The host's LMDB metadata cache for one store.

Everything here is derived from the store and may be deleted at any time
(``layerbox cache drop`` or ``rm -r``); it is rebuilt on demand.  It holds:

    docs     document digest -> document bytes (immutable, verified when fetched)
    meta     layer digest -> metadata image bytes (immutable, verified)
    chunks   chunk digest (32 bytes) -> ChunkLocation (pack, offset, lengths)
    packs    pack id (32 bytes) -> b"" once the pack's index is in ``chunks``
    refs     ref name -> JSON {digest, etag, fetched}

so that resolving a ref (within its freshness window), listing a tree or
locating a chunk never waits on the store.  LMDB calls are short and
synchronous; callers on an event loop hop through ``asyncio.to_thread`` only
for bulk writes (index loading).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lmdb

from layerstore.hoststate import closed_dir
from layerstore.packs import ChunkLocation

MAP_SIZE = 8 << 30  # address space only; the file grows with use

# LMDB allows one open environment per file per process: every MetadataCache on the
# same path shares it (a service creating sandboxes concurrently opens many Stores), and its
# databases, opened once with the environment.
DBS = (b"docs", b"meta", b"chunks", b"packs", b"refs")
_ENVS: dict[str, tuple[lmdb.Environment, dict[bytes, Any], int]] = {}
_ENVS_LOCK = threading.Lock()


def _acquire(path: Path) -> tuple[lmdb.Environment, dict[bytes, Any]]:
    key = os.path.realpath(path)
    with _ENVS_LOCK:
        env, dbs, users = _ENVS.get(key, (None, {}, 0))
        if env is None:
            env = lmdb.open(key, map_size=MAP_SIZE, max_dbs=8, subdir=True,
                            lock=True, readahead=False, metasync=False, sync=False)
            # In one write transaction begun by begin(), which waits for LMDB's writer lock with
            # the GIL released.  open_db without a transaction begins its own write transaction
            # holding the GIL: while another thread's write transaction was open (add_pack), the
            # two waited for each other for ever (200 concurrent checkpoints, this suite).
            with env.begin(write=True) as txn:
                dbs = {name: env.open_db(name, txn=txn) for name in DBS}
        _ENVS[key] = (env, dbs, users + 1)
        return env, dbs


def _release(path: Path) -> None:
    key = os.path.realpath(path)
    with _ENVS_LOCK:
        env, dbs, users = _ENVS[key]
        if users > 1:
            _ENVS[key] = (env, dbs, users - 1)
        else:
            del _ENVS[key]
            env.close()


class MetadataCache:
    def __init__(self, data_dir: str | os.PathLike[str], store_url: str) -> None:
        # one environment per store, so one data dir can serve several stores
        tag = hashlib.sha256(store_url.encode()).hexdigest()[:16]
        self.path = Path(data_dir) / "cache" / tag
        # host state: which images this host used and where their chunks lie, for root alone
        closed_dir(self.path.parent)
        closed_dir(self.path)
        (self.path / "STORE").write_text(store_url + "\n")
        self.env, dbs = _acquire(self.path)
        self._closed = False
        self._docs, self._meta, self._chunks, self._packs, self._refs = (dbs[name] for name in DBS)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            _release(self.path)

    # -- immutable blobs ------------------------------------------------------------
    def get_doc(self, digest: str) -> bytes | None:
        with self.env.begin(db=self._docs) as txn:
            value = txn.get(digest.encode())
            return bytes(value) if value is not None else None

    def put_doc(self, digest: str, data: bytes) -> None:
        with self.env.begin(db=self._docs, write=True) as txn:
            txn.put(digest.encode(), data)

    def get_meta(self, layer: str) -> bytes | None:
        with self.env.begin(db=self._meta) as txn:
            value = txn.get(layer.encode())
            return bytes(value) if value is not None else None

    def put_meta(self, layer: str, data: bytes) -> None:
        with self.env.begin(db=self._meta, write=True) as txn:
            txn.put(layer.encode(), data)

    # -- chunk locations --------------------------------------------------------------
    def locate(self, digest: bytes) -> ChunkLocation | None:
        with self.env.begin(db=self._chunks) as txn:
            value = txn.get(digest)
            return ChunkLocation.decode(bytes(value)) if value is not None else None

    def locate_many(self, digests: Iterable[bytes]) -> dict[bytes, ChunkLocation]:
        out = {}
        with self.env.begin(db=self._chunks) as txn:
            for d in digests:
                value = txn.get(d)
                if value is not None:
                    out[d] = ChunkLocation.decode(bytes(value))
        return out

    def has_pack(self, pack_id: bytes) -> bool:
        with self.env.begin(db=self._packs) as txn:
            return txn.get(pack_id) is not None

    def known_packs(self) -> set[bytes]:
        with self.env.begin(db=self._packs) as txn:
            return {bytes(k) for k, _ in txn.cursor()}

    def add_pack(self, pack_id: bytes, locations: Iterable[tuple[bytes, ChunkLocation]]) -> None:
        with self.env.begin(write=True) as txn:
            for digest, loc in locations:
                # first location wins: any copy is as good, and a stable answer keeps
                # the packs an image names stable
                txn.put(digest, loc.encode(), db=self._chunks, overwrite=False)
            txn.put(pack_id, b"", db=self._packs)

    def forget_packs(self, pack_ids: Iterable[bytes]) -> None:
        """Drop packs (deleted by gc) and every location pointing into them."""
        doomed = set(pack_ids)
        if not doomed:
            return
        with self.env.begin(write=True) as txn:
            cur = txn.cursor(db=self._chunks)
            for key, value in list(cur):
                if bytes(value[:32]) in doomed:
                    txn.delete(key, db=self._chunks)
            for p in doomed:
                txn.delete(p, db=self._packs)

    # -- refs ---------------------------------------------------------------------------
    def get_ref(self, name: str, max_age: float) -> tuple[str, str] | None:
        with self.env.begin(db=self._refs) as txn:
            value = txn.get(name.encode())
        if value is None:
            return None
        entry = json.loads(bytes(value))
        if time.time() - entry["fetched"] > max_age:
            return None
        return entry["digest"], entry["etag"]

    def put_ref(self, name: str, digest: str, etag: str) -> None:
        entry = {"digest": digest, "etag": etag, "fetched": time.time()}
        with self.env.begin(db=self._refs, write=True) as txn:
            txn.put(name.encode(), json.dumps(entry).encode())

    def drop_ref(self, name: str) -> None:
        with self.env.begin(db=self._refs, write=True) as txn:
            txn.delete(name.encode())
