"""containerd snapshots on layerbox layers: what the gRPC service (service.py) serves.

containerd calls layers and writable layers *snapshots* and keeps its own
names for them (``<namespace>/<n>/<key>``); this keeps one row per snapshot in
:mod:`snapshots.containerd.metadata` and one directory per local snapshot,
``<root>/snapshots/<id>/{fs,work}``, as containerd's overlayfs snapshotter
does.  Two kinds of committed snapshots:

* **remote**: when containerd prepares the extraction snapshot of a layer
  (its target label ``containerd.io/snapshot.ref`` is the layer's chain id)
  and the store's OCI index has that chain, the snapshot is committed at once,
  backed by the layer's lazy EROFS mount (lazyfetch's :meth:`HostMounts.hold`),
  and containerd is answered ALREADY_EXISTS: it neither downloads nor unpacks
  the layer.  From the CRI plugin, a layer found by its blob digest label
  (``containerd.io/snapshot/cri.layer-digest``) counts only if its diff id
  gives the target chain id over the parent's.
* **local**: anything else is containerd's ordinary path (it applies the tar
  into the active snapshot's directory); on Commit of such an unpack the tree
  is converted into an EROFS layer and published into the store's OCI index
  in the background, so the next host gets it lazily.

Mounts of an active snapshot are an overlay of its parents' layers (remote
layers' mount points, local snapshots' ``fs``) with a fresh upper; a view is
the layers alone (a bind for one layer).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import re
import shutil
import threading
import uuid
from collections.abc import Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import Any, TypeVar

from converters.layer import convert_directory
from converters.ocispec import ImageRefError, parse_reference
from converters.publish import (
    LocalLayer,
    chain_ref,
    layer_ref,
    oci_ids,
    publish,
    publish_oci_index,
    upload_layers,
)
from layerstore.errors import LayerboxError
from layerstore.hoststate import make_private_dirs
from layerstore.objects import LayerEntry, Resolved, hex_digest
from layerstore.store import RefNotFound, Store, UploadStats
from lazyfetch import kmount
from lazyfetch.mounts import HostMounts
from snapshots.containerd.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from snapshots.containerd.filters import matches, parse_filters
from snapshots.containerd.metadata import (
    KIND_ACTIVE,
    KIND_COMMITTED,
    KIND_VIEW,
    Metadata,
    Snapshot,
    check_key,
)

log = logging.getLogger("layerbox.snapshotter")
T = TypeVar("T")

TARGET_LABEL = "containerd.io/snapshot.ref"
CRI_LAYER_DIGEST = "containerd.io/snapshot/cri.layer-digest"
CRI_IMAGE_REF = "containerd.io/snapshot/cri.image-ref"
LAYER_LABEL = "containerd.io/snapshot/layerbox.layer"  # set on remote snapshots: the EROFS layer
# containerd's unpack keys are "extract-<unique> <chain id>" (snapshots.UnpackKeyFormat), under
# the metadata store's "<namespace>/<n>/" prefix
_UNPACK_KEY = re.compile(r"(?:^|/)extract-\S+ (sha256:[0-9a-f]{64})$")
_CHAIN = re.compile(r"^sha256:[0-9a-f]{64}$")
_ROOT_SAFE = re.compile(r"^/[A-Za-z0-9._/+@-]*$")  # goes into overlay options: no ',' ':' or '='
STORE_TIMEOUT = 300.0


@dataclass(frozen=True)
class Mount:
    type: str
    source: str
    options: tuple[str, ...]


def chain_over(parent_chain: str | None, diff_id: str) -> str:
    """The OCI chain id of a layer with ``diff_id`` over a stack with ``parent_chain``."""
    if parent_chain is None:
        return diff_id
    return "sha256:" + sha256(f"{parent_chain} {diff_id}".encode()).hexdigest()


class Snapshotter:
    def __init__(self, root: str | os.PathLike[str], mounts: HostMounts, *,
                 store_url: str | None = None, data_dir: str | os.PathLike[str] | None = None,
                 publish: bool = True, from_registry: bool = False) -> None:
        self.root = Path(root).resolve()
        if not _ROOT_SAFE.match(str(self.root)):
            raise InvalidArgument(f"root {self.root}: use a path of letters, digits and . _ / + @ -"
                                  " (it goes into overlayfs mount options)")
        self.mounts = mounts
        self.store_url = store_url
        self.data_dir = data_dir
        self.publish_enabled = publish
        # convert a layer the store lacks straight from the registry stream (CRI pulls only:
        # containerd's CRI plugin names the image in cri.image-ref), instead of letting containerd
        # download and unpack it
        self.from_registry = from_registry
        self._converted: set[str] = set()  # image refs converted by this process (once each)
        # made 0700 when missing; an existing root is not changed (a directory it did not make may
        # be another's): what is in it is private on its own (0700 directories, a 0600 database)
        make_private_dirs(self.root / "snapshots")
        self.meta = Metadata(self.root / "metadata.db")
        self._owner_prefix = f"containerd:{self.root}:"
        self._lock = threading.RLock()
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="store", daemon=True)
        self._loop_thread.start()
        self._store: Store | None = None
        self._queue: queue.Queue[int | None] = queue.Queue()
        self._publisher = threading.Thread(target=self._publish_loop, name="publish", daemon=True)
        self._publisher.start()
        self.on_published: Callable[[int, str], None] | None = None  # tests: (id, chain ref)

    # -- plumbing ------------------------------------------------------------------------
    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(STORE_TIMEOUT)

    async def _open_store(self) -> Store:
        if self._store is None:
            self._store = await Store.open(self.store_url, self.data_dir)
        return self._store

    def close(self) -> None:
        self._queue.put(None)
        self._publisher.join(timeout=60)
        if self._store is not None:
            self._call(self._store.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(timeout=10)
        self.meta.close()

    def _dir(self, snap: Snapshot) -> Path:
        return self.root / "snapshots" / str(snap.id)

    def _owner(self, snap: Snapshot) -> str:
        return f"{self._owner_prefix}{snap.id}"

    def start(self) -> dict[str, int]:
        """Make the host match the database (every start, and so after a crash): remove
        directories and holds no snapshot names, hold every remote snapshot's layer, and go on
        with publishes that did not finish."""
        removed = self.cleanup()
        held = 0
        for snap in self.meta.all():
            if snap.layer is not None:
                self._hold(snap)
                held += 1
            elif snap.publish and snap.publish.get("state") == "pending":
                self._queue.put(snap.id)
        return {"removed": removed, "held": held}

    # -- the store's OCI index -------------------------------------------------------------
    async def _lookup(self, name: str) -> Resolved | None:
        store = await self._open_store()
        try:
            return await store.resolve(name, refresh=True)
        except RefNotFound:
            return None

    def _chain_of(self, snap: Snapshot) -> str | None:
        chain = snap.labels.get(TARGET_LABEL) or (snap.layer or {}).get("chain")
        return chain if isinstance(chain, str) and _CHAIN.match(chain) else None

    def _find_remote(self, target: str, parent: Snapshot | None, labels: Mapping[str, str]
                     ) -> Resolved | None:
        parent_chain = self._chain_of(parent) if parent is not None else None
        if parent is not None and parent_chain is None:
            return None  # a parent we cannot place in a chain: containerd's own path
        found = self._call(self._lookup(chain_ref(target)))
        if found is not None and found.layers:
            # indexed by this chain id: its top's chain is the target, the one below the parent's
            below = oci_ids(found.layers[-2]).get("chain_id") if len(found.layers) > 1 else None
            if oci_ids(found.layers[-1]).get("chain_id") == target and below == parent_chain:
                return found
            log.warning("store chain %s does not sit on parent %s: unpacking it", target, parent_chain)
            return None
        digest = labels.get(CRI_LAYER_DIGEST, "")
        if not _CHAIN.match(digest):
            return None
        found = self._call(self._lookup(layer_ref(digest)))
        if found is None or not found.layers:
            return None
        # the same layer blob in another stack: the proof that it is this chain's top is that its
        # diff id over the parent's chain gives the target
        diff_id = oci_ids(found.layers[-1]).get("diff_id")
        if diff_id is None or chain_over(parent_chain, diff_id) != target:
            return None
        return found

    # -- operations ------------------------------------------------------------------------
    def prepare(self, key: str, parent: str, labels: Mapping[str, str]) -> list[Mount]:
        return self._create(key, parent, labels, KIND_ACTIVE)

    def view(self, key: str, parent: str, labels: Mapping[str, str]) -> list[Mount]:
        return self._create(key, parent, labels, KIND_VIEW)

    def _create(self, key: str, parent: str, labels: Mapping[str, str], kind: int) -> list[Mount]:
        check_key(key)
        with self._lock:
            if self.meta.find(key) is not None:
                raise AlreadyExists(f"snapshot {key!r} already exists")
            parent_snap = self.meta.get(parent) if parent else None
            if parent_snap is not None and parent_snap.kind != KIND_COMMITTED:
                raise InvalidArgument(f"parent {parent!r} is not a committed snapshot")
            target = labels.get(TARGET_LABEL, "")
            if kind == KIND_ACTIVE and _CHAIN.match(target):
                self._remote(target, parent, parent_snap, labels)  # raises AlreadyExists if found
            with self.meta.transaction() as db:
                snap = self.meta.create(db, key, parent, kind, labels)
                base = self._dir(snap)
                shutil.rmtree(base, ignore_errors=True)  # an orphan of a crashed earlier id
                base.mkdir(mode=0o700)
                (base / "fs").mkdir(mode=0o755)
                if kind == KIND_ACTIVE:
                    (base / "work").mkdir(mode=0o700)
            return self._mounts(snap)

    def _remote(self, target: str, parent: str, parent_snap: Snapshot | None,
                labels: Mapping[str, str]) -> None:
        existing = self.meta.find(target)
        if existing is not None and existing.kind == KIND_COMMITTED and existing.parent == parent:
            raise AlreadyExists(f"target snapshot {target!r} already exists")
        if existing is not None:
            return  # the name is taken by something else: containerd's own path
        found = self._find_remote(target, parent_snap, labels)
        if found is None and self.from_registry and self._convert_image(labels):
            found = self._find_remote(target, parent_snap, labels)
        if found is None:
            return
        top = found.layers[-1]
        layer = {"doc": found.digest, "chain": target, "entry": top.to_json()}
        remote_labels = {**labels, TARGET_LABEL: target, LAYER_LABEL: top.digest}
        snap: Snapshot | None = None
        try:
            with self.meta.transaction() as db:
                snap = self.meta.create(db, target, parent, KIND_COMMITTED, remote_labels, layer=layer)
                # held before the row commits: a crash between leaves a hold the next start releases
                self._hold(snap)
        except (OSError, LayerboxError) as exc:
            # the store has the layer but this host cannot mount it now: unpack it as containerd
            # would (slower, never wrong)
            log.warning("layer %s for %s: not mounted (%s); unpacking it", top.digest, target, exc)
            if snap is not None:
                with contextlib.suppress(OSError, LayerboxError):
                    self.mounts.release(self._owner(snap))
            return
        self.meta.set_usage(snap.id, top.bytes, top.files)
        log.info("layer %s from the store as %s (%s)", top.digest, target, found.digest)
        raise AlreadyExists(f"target snapshot {target!r}: layer {top.digest} from the store")

    def _convert_image(self, labels: Mapping[str, str]) -> bool:
        """Publish the image CRI names (``cri.image-ref``) from its registry into the store: every
        layer streams from the registry into the converter, none is unpacked on disk, and the
        store's OCI index then has its chains.  False when there is no such label, or it failed
        (the caller goes containerd's own way: slower, never wrong)."""
        ref = labels.get(CRI_IMAGE_REF, "")
        try:
            parse_reference(ref)  # the one grammar of image references (converters/ocispec.py)
        except ImageRefError as exc:
            log.warning("label %s: %s; containerd unpacks the layer", CRI_IMAGE_REF, exc)
            return False
        if ref in self._converted:
            return False
        self._converted.add(ref)  # one attempt per image per process, whatever its outcome
        name = f"oci/pulled/{sha256(ref.encode()).hexdigest()[:32]}"
        try:
            self._call(self._publish_image(f"docker://{ref}", name))
        except (OSError, LayerboxError) as exc:
            log.warning("converting %s from its registry failed: %s; containerd unpacks it", ref, exc)
            return False
        log.info("converted %s from its registry into the store as %s", ref, name)
        return True

    async def _publish_image(self, source: str, name: str) -> None:
        store = await self._open_store()
        work = self.root / "publish"
        work.mkdir(mode=0o700, exist_ok=True)
        await publish(store, source, name, work_dir=work)

    def _hold(self, snap: Snapshot) -> list[str]:
        assert snap.layer is not None
        entry = LayerEntry.from_json(snap.layer["entry"], f"snapshot {snap.key}")
        resolved = Resolved(snap.layer["doc"], "image", (entry,), {}, {})
        return self.mounts.hold(self._owner(snap), resolved)

    def _lower(self, snap: Snapshot) -> str:
        if snap.layer is None:
            return str(self._dir(snap) / "fs")
        hexd = hex_digest(snap.layer["entry"]["digest"])
        mp = self.mounts.layer_root / hexd
        if not kmount.is_mountpoint(mp):  # after a reboot, or a daemon that lost its generation
            return self._hold(snap)[0]
        return str(mp)

    def _mounts(self, snap: Snapshot) -> list[Mount]:
        lowers = [self._lower(a) for a in self.meta.chain(snap)]  # nearest first: overlay's order
        base = self._dir(snap)
        if snap.kind == KIND_ACTIVE:
            if not lowers:
                return [Mount("bind", str(base / "fs"), ("rbind", "rw"))]
            return [Mount("overlay", "overlay", (f"workdir={base / 'work'}", f"upperdir={base / 'fs'}",
                                                 f"lowerdir={':'.join(lowers)}", "index=off"))]
        if snap.kind == KIND_VIEW:
            if not lowers:
                return [Mount("bind", str(base / "fs"), ("rbind", "ro"))]
            if len(lowers) == 1:
                return [Mount("bind", lowers[0], ("rbind", "ro"))]
            return [Mount("overlay", "overlay", (f"lowerdir={':'.join(lowers)}", "index=off"))]
        raise FailedPrecondition(f"snapshot {snap.key!r} is committed: mount a view or an active "
                                 "snapshot on it")

    def mounts_of(self, key: str) -> list[Mount]:
        with self._lock:
            return self._mounts(self.meta.get(check_key(key)))

    def commit(self, name: str, key: str, labels: Mapping[str, str]) -> None:
        check_key(name, "name")
        with self._lock:
            snap = self.meta.get(check_key(key))
            if snap.kind != KIND_ACTIVE:
                raise FailedPrecondition(f"snapshot {key!r} is not active: only an active snapshot "
                                         "is committed")
            size, inodes = disk_usage(self._dir(snap) / "fs")
            merged = {**snap.labels, **labels}
            publish = None
            unpacked = _UNPACK_KEY.search(key)
            # only an unpack's commit is a layer with a chain id (containerd checked its diff id
            # before committing it under that chain id); a container's writes committed later are
            # nobody else's business.  containerd 1.6's ctr unpacks without the target label.
            if (self.publish_enabled and unpacked and name.endswith("/" + unpacked.group(1))
                    and merged.get(TARGET_LABEL, unpacked.group(1)) == unpacked.group(1)):
                publish = {"state": "pending", "chain": unpacked.group(1)}
                merged.setdefault(TARGET_LABEL, unpacked.group(1))
                labels = {**labels, TARGET_LABEL: unpacked.group(1)}
            with self.meta.transaction() as db:
                self.meta.commit(db, key, name, labels, size, inodes, publish)
            shutil.rmtree(self._dir(snap) / "work", ignore_errors=True)
            (self._dir(snap) / "work").mkdir(mode=0o700, exist_ok=True)
        if publish:
            self._queue.put(snap.id)

    def remove(self, key: str) -> None:
        with self._lock:
            with self.meta.transaction() as db:
                snap = self.meta.remove(db, check_key(key))
            # after the row is gone: a crash in between leaves an orphan that cleanup removes
            if snap.layer is not None:
                self.mounts.release(self._owner(snap))
            self._discard(self._dir(snap))

    def _discard(self, path: Path) -> None:
        if not path.exists():
            return
        trash = self.root / "removed"
        trash.mkdir(exist_ok=True, mode=0o700)
        dest = trash / f"{path.name}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(path, dest)
        except OSError:
            dest = path
        shutil.rmtree(dest, ignore_errors=True)

    def stat(self, key: str) -> Snapshot:
        return self.meta.get(check_key(key))

    def update(self, name: str, labels: Mapping[str, str], paths: list[str]) -> Snapshot:
        """containerd's rules: only labels change; ``labels`` replaces them all, ``labels.K``
        one (removed when ``labels`` has no K); no paths replaces all."""
        with self._lock:
            snap = self.meta.get(check_key(name))
            new = dict(snap.labels)
            if not paths:
                new = dict(labels)
            for path in paths:
                if path == "labels":
                    new = dict(labels)
                elif path.startswith("labels."):
                    k = path[len("labels."):]
                    if k in labels:
                        new[k] = labels[k]
                    else:
                        new.pop(k, None)
                else:
                    raise InvalidArgument(f"update_mask: cannot update {path!r} of a snapshot "
                                          "(only labels and labels.<key>)")
            if snap.layer is not None:  # what makes it a remote layer stays
                new.setdefault(LAYER_LABEL, snap.layer["entry"]["digest"])
            return self.meta.set_labels(snap.key, new)

    def walk(self, filters: list[str]) -> Iterator[Snapshot]:
        parsed = parse_filters(filters)
        for snap in self.meta.all():
            if matches(parsed, snap):
                yield snap

    def usage(self, key: str) -> tuple[int, int]:
        snap = self.meta.get(check_key(key))
        if snap.kind == KIND_ACTIVE:
            return disk_usage(self._dir(snap) / "fs")
        return snap.size, snap.inodes

    def cleanup(self) -> int:
        """Remove what no snapshot names: directories, the trash, layer holds."""
        with self._lock:
            ids = self.meta.ids()
            removed = 0
            for path in (self.root / "snapshots").iterdir():
                if not (path.name.isdigit() and int(path.name) in ids):
                    self._discard(path)
                    removed += 1
            shutil.rmtree(self.root / "removed", ignore_errors=True)
            for owner in self.mounts.holds():
                if owner.startswith(self._owner_prefix):
                    rest = owner[len(self._owner_prefix):]
                    if not (rest.isdigit() and int(rest) in ids):
                        self.mounts.release(owner)
                        removed += 1
            return removed

    # -- publishing committed layers -------------------------------------------------------
    def _publish_loop(self) -> None:
        while True:
            id_ = self._queue.get()
            if id_ is None:
                return
            try:
                snap = self.meta.by_id(id_)
            except NotFound:
                continue  # removed meanwhile
            try:
                ref = self._publish(snap)
            except Exception as exc:  # noqa: BLE001 - recorded on the snapshot, retried next start
                log.warning("publishing snapshot %s failed: %s", snap.key, exc)
                self.meta.set_publish(id_, {"state": "failed", "chain": snap.publish and snap.publish.get("chain"),
                                            "error": str(exc)[:500]})
                continue
            self.meta.set_publish(id_, {"state": "done", "chain": snap.publish and snap.publish.get("chain"),
                                        "ref": ref})
            if self.on_published is not None:
                self.on_published(id_, ref)

    def _publish(self, snap: Snapshot) -> str:
        chain = (snap.publish or {}).get("chain")
        if not isinstance(chain, str) or not _CHAIN.match(chain):
            raise FailedPrecondition(f"snapshot {snap.key}: no chain id to publish under")
        parents = self.meta.chain(snap)
        parent_chain = self._chain_of(parents[0]) if parents else None
        if parents and parent_chain is None:
            raise FailedPrecondition(f"snapshot {snap.key}: its parent has no chain id")
        work = self.root / "publish" / str(snap.id)
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True, mode=0o700)
        try:
            convert_directory(self._dir(snap) / "fs", work / "layer.erofs", work / "layer.blob")
            return self._call(self._upload(snap, chain, parent_chain, work))
        finally:
            shutil.rmtree(work, ignore_errors=True)

    async def _upload(self, snap: Snapshot, chain: str, parent_chain: str | None, work: Path) -> str:
        store = await self._open_store()
        below: tuple[LayerEntry, ...] = ()
        if parent_chain is not None:
            found = await self._lookup(chain_ref(parent_chain))
            if found is None:
                raise FailedPrecondition(f"parent chain {parent_chain} is not in the store: its "
                                         "publish has not finished or failed")
            below = found.layers
        source = {"type": "containerd-commit", "chain_id": chain}
        async with store.writer_lock("publish"):
            await store.sync_index()
            stats = UploadStats()
            [entry] = await upload_layers(store, [LocalLayer(work / "layer.erofs", work / "layer.blob", source)],
                                          stats)
            # the diff id is unknown here (containerd checked it): the chain ref is what finds it
            await publish_oci_index(store, [*below, entry], stats)
        return chain_ref(chain)


def disk_usage(path: Path) -> tuple[int, int]:
    """Bytes allocated and inodes under ``path``, hard links once (what ``du`` reports)."""
    size = inodes = 0
    seen: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(path):
        for name in (*dirnames, *filenames):
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            inodes += 1
            size += st.st_blocks * 512
    return size, inodes
