"""Incremental checkpoints of a writable mount, restorable on any host.

A checkpoint turns what changed in a mount's overlayfs upper directory since
the mount's parent (its image, or its previous checkpoint) into one more
EROFS layer, made by the same converter as image layers.  The upper directory
already speaks overlayfs: deletions are character devices 0/0 and replaced
directories carry ``trusted.overlay.opaque``; both pass into the layer as
they are and keep working when the layer is a lower layer.

Incremental: after each checkpoint the upper directory's entries are
remembered by their stat signature (inode, size, mtime, ctime, mode, owner).
The next checkpoint includes only entries whose signature changed, their
ancestor directories (with their real attributes: overlayfs takes a merged
directory's attributes from its topmost layer), whole subtrees of opaque
directories, and whiteouts for entries that disappeared from the upper
directory since.  Unchanged files are neither read nor uploaded, and chunks
of changed files still dedup against everything in the store.

Write order: the layer's chunks and metadata image, then the checkpoint
document, then its ref, then the local record of what was captured.  A crash
at any point leaves the mount usable and no document naming missing data;
running the checkpoint again redoes the work.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import platform
import socket
import stat
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from converters.dirsource import walk_directory
from converters.layer import DEFAULT_CHUNK_SIZE, convert_entries
from converters.publish import LocalLayer, upload_layers
from converters.tarstream import KIND_CHR, Entry
from layerstore.objects import Resolved
from layerstore.store import Store, UploadStats
from lazyfetch.mounts import HostMounts, MountResult
from snapshots.errors import CheckpointMismatch, SnapshotError

SCHEMA = "layerbox.checkpoint.v1"
FORMAT_VERSION = 1
RUNTIME = "layerbox-0.1"

Signature = list[int]


@dataclass(frozen=True)
class Checkpoint:
    name: str
    digest: str
    parent: str
    layer: str  # the new layer's digest
    layers: int
    entries: int  # entries captured in the new layer
    bytes_changed: int  # regular-file data captured; holes of sparse files are not counted
    bytes_uploaded: int
    freeze_seconds: float
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def scan(upper: Path) -> dict[str, Signature]:
    """Every entry of the upper directory by relative path (surrogate-escaped str keys).

    This stat() of every entry is the one cost of a checkpoint that grows with
    the upper directory rather than with the change (about 5-8 us per entry).
    """
    out: dict[str, Signature] = {}
    base = os.fsencode(upper)
    skip = len(base) + 1
    stack = [base]
    while stack:
        with os.scandir(stack.pop()) as it:
            for d in it:
                st = d.stat(follow_symlinks=False)
                out[os.fsdecode(d.path[skip:])] = [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                                                   st.st_mode, st.st_uid, st.st_gid]
                if d.is_dir(follow_symlinks=False):
                    stack.append(d.path)
    return out


def _is_opaque(path: bytes) -> bool:
    try:
        return os.getxattr(path, "trusted.overlay.opaque", follow_symlinks=False) == b"y"
    except OSError:
        return False


def plan(upper: Path, now: dict[str, Signature], before: Mapping[str, Signature]
         ) -> tuple[set[str], list[str]]:
    """(paths to include, paths that need a whiteout) for an incremental layer."""
    include: set[str] = set()
    for path, sig in now.items():
        if before.get(path) != sig:
            include.add(path)
    base = os.fsencode(upper)
    for path, sig in now.items():
        if stat.S_ISDIR(sig[4]) and _is_opaque(os.path.join(base, os.fsencode(path))):
            prefix = path + "/"
            include.add(path)
            include.update(p for p in now if p.startswith(prefix))
    gone = sorted(p for p in before if p not in now)
    # one whiteout for the topmost vanished path of a subtree is enough
    whiteouts = [p for p in gone if not any(p.startswith(q + "/") for q in gone if q != p)]
    for path in list(include) + whiteouts:
        parts = path.split("/")
        for i in range(1, len(parts)):
            include.add("/".join(parts[:i]))
    return include, whiteouts


def _entries(upper: Path, include: set[str], whiteouts: list[str]) -> Iterator[tuple[Entry, Any]]:
    def wanted(rel: tuple[bytes, ...], is_dir: bool) -> bool:
        return os.fsdecode(b"/".join(rel)) in include

    for entry, data in walk_directory(upper, include=wanted):
        # overlayfs bookkeeping of this upper dir (origin, impure, redirect...) must
        # not travel into a lower layer; only the opaque marker means something there
        entry.xattrs = {k: v for k, v in entry.xattrs.items()
                        if not k.startswith(b"trusted.overlay.") or k == b"trusted.overlay.opaque"}
        yield entry, data
    now = time.time_ns()
    for path in whiteouts:
        rel = tuple(os.fsencode(path).split(b"/"))
        yield Entry(path=rel, kind=KIND_CHR, mode=stat.S_IFCHR, uid=0, gid=0, mtime=now // 10**9,
                    mtime_nsec=now % 10**9, rdev=(0, 0), name=path), None


class Snapshots:
    """Checkpoint and restore mounts of one host (data dir) against one store."""

    def __init__(self, store: Store, host: HostMounts) -> None:
        self.store = store
        self.host = host

    # -- local record of what each mount has captured ---------------------------------------
    def _record_path(self, mountpoint: str) -> Path:
        return record_path(self.host, mountpoint)

    def _load_record(self, mountpoint: str, default_parent: str) -> dict[str, Any]:
        path = self._record_path(mountpoint)
        if path.exists():
            rec = json.loads(path.read_text())
            if rec.get("upper") == self._mount(mountpoint).get("upper"):
                return dict(rec)
        return {"parent": default_parent, "manifest": {}, "seq": 0, "id": uuid.uuid4().hex[:12]}

    def _save_record(self, mountpoint: str, rec: dict[str, Any]) -> None:
        path = self._record_path(mountpoint)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec))
        os.replace(tmp, path)

    def _locate(self, mountpoint: str) -> tuple[str, dict[str, Any]]:
        target = os.path.realpath(mountpoint)
        return target, self._mount(target)

    def _mount(self, mountpoint: str) -> dict[str, Any]:
        rec = self.host.record(mountpoint)
        if rec is None:
            raise SnapshotError(f"{mountpoint} is not a layerbox mount on this host ({self.host.data_dir})")
        return dict(rec)

    # -- checkpoint -------------------------------------------------------------------------------
    async def checkpoint(
        self, mountpoint: str, *, name: str | None = None, labels: Mapping[str, str] | None = None,
        trajectory_offset: int | None = None, receipt_id: str | None = None, caller: str | None = None,
        policy_version: str | None = None, freeze: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE, before_ref: Callable[[], None] | None = None,
        attachments: Mapping[str, str] | None = None, attach_docs: Mapping[str, Mapping[str, Any]] | None = None,
        name_prefix: str = "",
    ) -> Checkpoint:
        """Capture the mount's writes since its parent as a new checkpoint.

        ``freeze`` (a context manager factory, e.g. a cgroup freezer) keeps
        writers still while the upper directory is scanned and the changed
        files are converted; uploading happens after it is released.
        Without it the caller guarantees quiescence.  ``attachments`` names
        documents already in the store that the checkpoint keeps alive;
        ``attach_docs`` are documents to store with it (e.g. the sandbox's
        receipts), under the same lock as the checkpoint itself.  Without ``name`` the ref is
        ``<name_prefix>checkpoints/<id>:<n>`` (a project's sandboxes use its namespace,
        ``projects/<project>/``).  ``before_ref`` is a
        test hook run once every object is stored, before the ref moves.
        """
        started = time.perf_counter()
        target, mount = await asyncio.to_thread(self._locate, mountpoint)
        if not mount.get("writable") or not mount.get("upper"):
            raise SnapshotError(f"{target} is read-only: only writable mounts have writes to checkpoint")
        rec = self._load_record(target, mount["digest"])
        parent = await self.store.resolve(rec["parent"])
        upper = Path(mount["upper"])
        # shared with publishes, exclusive with gc: nothing this checkpoint dedups against or
        # references can be collected between its upload and its ref
        async with self.store.writer_lock("checkpoint"):
            with tempfile.TemporaryDirectory(prefix="checkpoint-", dir=self.host.data_dir) as tmp:
                meta, blob = Path(tmp) / "layer.erofs", Path(tmp) / "layer.blob"
                def capture() -> tuple[dict[str, Signature], set[str], list[str], Any, float]:
                    frozen = time.perf_counter()
                    with freeze() if freeze else contextlib.nullcontext():
                        now = scan(upper)
                        include, whiteouts = plan(upper, now, rec["manifest"])
                        result = convert_entries(_entries(upper, include, whiteouts), meta, blob,
                                                 chunk_size=chunk_size, oci_whiteouts=False)
                    return now, include, whiteouts, result, time.perf_counter() - frozen

                now, include, whiteouts, result, freeze_seconds = await asyncio.to_thread(capture)
                stats = UploadStats()
                entries = await upload_layers(self.store, [LocalLayer(meta, blob, {"checkpoint_of": target})],
                                              stats, chunk_size=chunk_size)
            new_layer = entries[0]
            layers = [*parent.layers, new_layer]
            seq = rec["seq"] + 1
            ref_name = name or f"{name_prefix}checkpoints/{rec['id']}:{seq}"
            digest = await self._commit(
                parent, layers, ref_name, stats, extra={},
                bound={"policy_version": policy_version},
                fields={"trajectory_offset": trajectory_offset, "receipt_id": receipt_id,
                        "caller": caller, "labels": labels,
                        "stats": {"entries": len(include) + len(whiteouts), "bytes_changed": result.data_bytes}},
                attachments=attachments, attach_docs=attach_docs, before_ref=before_ref)
        rec.update(parent=digest, manifest=now, seq=seq, upper=mount["upper"])
        self._save_record(target, rec)
        return Checkpoint(
            name=ref_name, digest=digest, parent=parent.digest, layer=new_layer.digest, layers=len(layers),
            entries=len(include) + len(whiteouts), bytes_changed=result.data_bytes,
            bytes_uploaded=stats.bytes_uploaded, freeze_seconds=round(freeze_seconds, 6),
            seconds=round(time.perf_counter() - started, 6),
        )

    async def _commit(self, parent: Resolved, layers: list[Any], ref_name: str, stats: UploadStats, *,
                      extra: Mapping[str, Any], bound: Mapping[str, Any], fields: Mapping[str, Any],
                      attachments: Mapping[str, str] | None, attach_docs: Mapping[str, Mapping[str, Any]] | None,
                      before_ref: Callable[[], None] | None) -> str:
        """Store the attached documents and the checkpoint document, then move ``ref_name``
        (under the caller's writer lock): the checkpoint exists once its ref does."""
        attached = dict(attachments or {})
        for key, attach in (attach_docs or {}).items():
            attached[key] = await self.store.put_doc(attach, stats)
        base = parent.doc.get("base", parent.digest) if parent.kind == "checkpoint" else parent.digest
        doc = {
            "schema": SCHEMA,
            "parent": parent.digest,
            "parent_kind": parent.kind,
            "base": base,
            "layers": [layer.to_json() for layer in layers],
            **extra,
            "config": dict(parent.config),
            "bound": {
                "layer_digests": [layer.digest for layer in layers],
                "format_version": FORMAT_VERSION,
                "runtime": RUNTIME,
                "kernel": platform.release(),
                **bound,
            },
            "trajectory_offset": fields.get("trajectory_offset"),
            "receipt_id": fields.get("receipt_id"),
            "caller": fields.get("caller") or f"uid:{os.getuid()}@{socket.gethostname()}",
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "labels": dict(fields.get("labels") or {}),
            "attachments": attached,
            "stats": fields.get("stats") or {},
        }
        digest = await self.store.put_doc(doc, stats)
        if before_ref is not None:
            before_ref()
        await self.store.set_ref(ref_name, digest, "checkpoint", stats=stats)
        return digest

    async def checkpoint_disk(
        self, parent_ref: str, capture: Callable[[Path], tuple[float, str]], *, ref_name: str,
        vm: Mapping[str, Any], base: Sequence[Mapping[str, Any]] = (),
        labels: Mapping[str, str] | None = None, trajectory_offset: int | None = None,
        receipt_id: str | None = None, policy_version: str | None = None,
        attach_docs: Mapping[str, Mapping[str, Any]] | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE,
        memory: bool = False, isolation: str = "microvm",
    ) -> Checkpoint:
        """A VM's checkpoint (``isolation`` microvm or vm, bound so that it restores as one): its disk in a layer of its own (the document's ``disk``): the
        whole disk as one sparse ``disk.img``, or ``delta.qcow2``, the clusters written since
        the disk chain ``base`` (layer entries, base first: the document's ``disk_base``),
        which the restore stacks under it.  Its layers stay the image's.  With ``memory``, the
        same layer holds ``vmstate.bin``, the VM's RAM image and device state of the same
        instant (bound as ``"memory": "mapped-ram"``).

        ``capture(dir)`` writes them there and returns the seconds the VM was stopped and the
        disk file it wrote; ``base`` applies to a ``delta.qcow2`` only.  Chunks dedup against
        everything in the store (docs/FORMAT.md Part 5)."""
        started = time.perf_counter()
        parent = await self.store.resolve(parent_ref)
        async with self.store.writer_lock("checkpoint"):
            with tempfile.TemporaryDirectory(prefix="checkpoint-disk-", dir=self.host.data_dir) as tmp:
                src = Path(tmp) / "disk"
                src.mkdir()
                meta, blob = Path(tmp) / "layer.erofs", Path(tmp) / "layer.blob"

                def run() -> tuple[float, str, Any]:
                    frozen, made = capture(src)
                    return frozen, made, convert_entries(walk_directory(src), meta, blob, chunk_size=chunk_size,
                                                         oci_whiteouts=False)

                freeze_seconds, made, result = await asyncio.to_thread(run)
                chain_base = [dict(x) for x in base] if made == "delta.qcow2" else []
                stats = UploadStats()
                (disk,) = await upload_layers(self.store, [LocalLayer(meta, blob, {"disk_of": parent.digest})],
                                              stats, chunk_size=chunk_size)
            digest = await self._commit(
                parent, list(parent.layers), ref_name, stats,
                extra={"disk": disk.to_json(), **({"disk_base": chain_base} if chain_base else {})},
                bound={"policy_version": policy_version, "disk": "block", "disk_digest": disk.digest,
                       "disk_chain": [*(x["digest"] for x in chain_base), disk.digest],
                       "isolation": isolation, "vm": dict(vm), **({"memory": "mapped-ram"} if memory else {})},
                fields={"trajectory_offset": trajectory_offset, "receipt_id": receipt_id, "labels": labels,
                        "stats": {"entries": 2 if memory else 1, "bytes_changed": result.data_bytes}},
                attachments=None, attach_docs=attach_docs, before_ref=None)
        return Checkpoint(
            name=ref_name, digest=digest, parent=parent.digest, layer=disk.digest, layers=len(parent.layers),
            entries=2 if memory else 1, bytes_changed=result.data_bytes, bytes_uploaded=stats.bytes_uploaded,
            freeze_seconds=round(freeze_seconds, 6), seconds=round(time.perf_counter() - started, 6))

    # -- restore ------------------------------------------------------------------------------------
    async def verify_bound(self, ref: str, *, policy_version: str | None = None) -> Any:
        """Resolve a checkpoint and check every object it binds, before anything is mounted."""
        resolved = await self.store.resolve(ref, refresh=True)
        if resolved.kind != "checkpoint":
            raise SnapshotError(f"{ref} is a {resolved.kind}, not a checkpoint")
        bound = resolved.doc.get("bound") or {}
        if bound.get("format_version") != FORMAT_VERSION:
            raise CheckpointMismatch(f"{ref}: checkpoint format {bound.get('format_version')} is not "
                                     f"{FORMAT_VERSION}; this layerbox cannot restore it")
        if [layer.digest for layer in resolved.layers] != bound.get("layer_digests"):
            raise CheckpointMismatch(f"{ref}: its layer list does not match the digests it is bound to")
        disk = resolved.disk
        if (disk.digest if disk is not None else None) != bound.get("disk_digest"):
            raise CheckpointMismatch(f"{ref}: its disk does not match the digest it is bound to")
        chain = [x.digest for x in resolved.disk_chain]
        if disk is not None and chain != bound.get("disk_chain", [disk.digest]):  # one disk.img before chains
            raise CheckpointMismatch(f"{ref}: its disk chain does not match the digests it is bound to")
        if policy_version is not None and bound.get("policy_version") != policy_version:
            raise CheckpointMismatch(f"{ref}: made under policy {bound.get('policy_version')!r}, "
                                     f"refusing to resume under {policy_version!r}")
        missing = await self.store.missing_objects(resolved.stored_layers)
        if missing:
            raise SnapshotError(f"{ref}: the store {self.store.url} lacks {len(missing)} object(s) this "
                                f"checkpoint needs, e.g. {missing[0]}; nothing was mounted")
        return resolved

    async def restore(self, ref: str, mountpoint: str, *, upper: str | None = None,
                      policy_version: str | None = None, verified: Resolved | None = None) -> MountResult:
        """Mount ``ref`` writable at ``mountpoint``; ``verified`` is the checkpoint as
        :meth:`verify_bound` returned it to the caller already (many restores, one read)."""
        resolved = verified or await self.verify_bound(ref, policy_version=policy_version)
        # No record yet: the first checkpoint of a mount without one starts from the mount's own
        # digest (this checkpoint), as a record written here would say; a fork of 100 wrote 100.
        return await asyncio.to_thread(self.host.mount, resolved, mountpoint, writable=True, upper=upper)

    # -- catalogue ----------------------------------------------------------------------------------
    async def list(self, prefix: str = "checkpoints/") -> list[dict[str, Any]]:
        out = []
        for ref in await self.store.list_refs(prefix):
            if ref.kind != "checkpoint":
                continue
            doc = await self.store.get_doc(ref.digest)
            out.append({"name": ref.name, "digest": ref.digest, "parent": doc.get("parent"),
                        "created": doc.get("created"), "labels": doc.get("labels"),
                        "trajectory_offset": doc.get("trajectory_offset"), "receipt_id": doc.get("receipt_id"),
                        "layers": len(doc.get("layers", []))})
        return out

    async def show(self, ref: str) -> dict[str, Any]:
        resolved = await self.store.resolve(ref, refresh=True)
        return {"digest": resolved.digest, **resolved.doc}

    async def delete(self, ref: str) -> None:
        """Drop the ref; the data goes at the next gc unless another ref reaches it."""
        resolved = await self.store.resolve(ref, refresh=True)
        if resolved.kind != "checkpoint":
            raise SnapshotError(f"{ref} is a {resolved.kind}, not a checkpoint")
        await self.store.delete_ref(ref)


def forget_record(host: HostMounts, mountpoint: str | os.PathLike[str]) -> None:
    """Drop what :class:`Snapshots` recorded of the mount at ``mountpoint`` (its last
    checkpoint and the manifest of its upper), once the mount is gone; a next mount there starts
    a chain of its own."""
    record_path(host, os.path.realpath(mountpoint)).unlink(missing_ok=True)


def record_path(host: HostMounts, mountpoint: str) -> Path:
    """The file of :class:`Snapshots`' record of the mount at ``mountpoint`` (a real path)."""
    return host.data_dir / "state" / "snapshots" / (hex_digest_of_path(mountpoint) + ".json")


def hex_digest_of_path(path: str) -> str:
    return hashlib.sha256(path.encode("utf-8", "surrogateescape")).hexdigest()[:24]
