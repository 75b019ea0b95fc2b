"""Host mounts: one kernel EROFS mount per layer, shared and reference-counted,
and one overlayfs per user mount point.

State lives in ``<data-dir>/state/mounts.json``, a host-state table
(:class:`layerstore.hoststate.HostTable`, format ``layerbox.mounts`` version 2: ``layers``,
``holds``, and each layer's entry once in ``entries``), and one record per user mount in
``<data-dir>/state/mounts/`` (:class:`layerstore.hoststate.HostRecords`, ``layerbox.mount``),
all changed only under an exclusive ``flock`` on ``<data-dir>/state/lock``, so concurrent
``layerbox mount`` calls on one host serialise.  A mount, detach or umount touches the
small table and its own record only: as one table with every sandbox's record, each of them
decoded and rewritten it whole (~20 ms per create + destroy with 800 sandboxes held).  Each
layer counts the user mounts on it (``mounts``); a full reconcile (:meth:`HostMounts.status`,
:meth:`HostMounts.remount`) recounts them from the records.  The state is a cache of what the
kernel knows: every operation first reconciles its layers with /proc/self/mountinfo and the
daemon's *generation*: the kernel state (fanotify group or FUSE connection)
its layer mounts read through, which a holder process keeps while daemons
come and go (lazyfetch/daemon.py).  A restarted daemon serves the same
generation, so nothing here changes and no sandbox notices.  A layer mounted
under another generation (the holder died too, or the host rebooted) is
stale: its reads fail.  Such layers are remounted on the new daemon's blob
files, and every user mount stacked on them is detached and mounted again
with the same upper and work directories, which brings the sandboxes' views
back (their processes restart: see ``on_remount``).

A writable mount can be *detached* (:meth:`HostMounts.detach`) once a process
with its own mount namespace (a container, whose root it is) holds it: it
leaves the host's mount table but keeps its record, its upper and its layers
until :meth:`HostMounts.umount`.  Every new mount namespace copies the host's
table, so with 1,000 sandboxes' overlays in it each container create cost ~2x.

Everything here is mounted ``nosuid,nodev`` (layers also ``noexec``: see
:attr:`HostMounts.LAYER_FLAGS`), and the data dir's private subtrees
(:data:`lazyfetch.client.PRIVATE_DIRS`, with one more 0700 directory per upper)
keep other local users out, so a setuid file or device node that an image ships
or a sandbox writes gives nothing to them (docs/SECURITY.md, "Host mounts and
the data dir").
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import blake3

from layerstore.hoststate import HostRecords, HostTable
from layerstore.objects import Resolved, hex_digest
from lazyfetch import kmount
from lazyfetch.client import DaemonClient, DaemonDropped, DaemonNotServing, private_dirs
from lazyfetch.errors import LazyfetchError

log = logging.getLogger("layerbox.lazyfetch")


class MountError(LazyfetchError):
    pass


@dataclass(frozen=True)
class MountResult:
    mountpoint: str
    digest: str
    layers: int
    writable: bool
    upper: str | None
    seconds: float
    layer_mounts_created: int
    trace: str | None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _whiteout_dirs(root: str) -> Iterator[str]:
    """Directories under ``root`` (relative, the root itself left out) holding an overlayfs
    whiteout (a 0/0 character device); symlinks are not followed, and read errors raise."""
    pending = [""]
    while pending:
        rel = pending.pop()
        found = False
        with os.scandir(os.path.join(root, rel)) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    pending.append(os.path.join(rel, entry.name))
                elif not entry.is_file(follow_symlinks=False) and not entry.is_symlink():
                    st = entry.stat(follow_symlinks=False)  # only devices, fifos and sockets get here
                    found = found or (stat.S_ISCHR(st.st_mode) and st.st_rdev == 0)
        if found and rel:
            yield rel


def _start_time(pid: int) -> int:
    """The process's start time in clock ticks (tells a reused pid apart)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text[text.rindex(")") + 2:].split()[19])


# layer hex digest -> its mount (with ``mounts``, how many user mounts stack on it, and
# ``users``, the hold owners using it); layer hex digest -> its layer entry, once per layer; owner
# -> the layers it holds mounted without a stack (hold).  User mounts: a record file each.
_STATE_FIELDS: Final = ("layers", "entries", "holds")
_V1_FIELDS: Final = ("layers", "mounts", "entries", "holds")


def _empty_state() -> dict[str, Any]:
    return {field: {} for field in _STATE_FIELDS}


def _upgrade_state(doc: dict[str, Any], version: int | None) -> dict[str, Any]:
    """mounts.json of version 1 (and before the envelope: the same fields, ``entries`` and
    ``holds`` absent in the oldest, whose mounts each carried their own ``entries``: see
    _remount_stale) as version 2: its ``mounts`` go to a record file each (written by the next
    locked operation, from ``legacy_mounts``), and each layer counts the mounts on it."""
    old = {field: {} for field in _V1_FIELDS} | doc
    if not all(isinstance(old[field], dict) for field in _V1_FIELDS):
        raise ValueError(f"not a mount table of fields {', '.join(_V1_FIELDS)}")
    for info in old["layers"].values():
        users = info.get("users") or []
        info["users"] = [u for u in users if u in old["holds"]]
        info["mounts"] = sum(1 for u in users if u in old["mounts"])
    return {"layers": old["layers"], "entries": old["entries"], "holds": old["holds"], "legacy_mounts": old["mounts"]}


def _record_key(mountpoint: str) -> str:
    return blake3.blake3(os.fsencode(mountpoint)).hexdigest()[:32]


class HostMounts:
    # The flags of every mount made here.  nosuid and nodev on all of them: a setuid-root file an
    # image ships or an agent writes, or a device node with the host disk's numbers, must mean
    # nothing to a host process that reaches the mount.  Layers are noexec as well, since nothing
    # on the host runs from them: overlayfs checks noexec on its own mount only, so a container
    # (or a view) still executes the layers' files through the overlay (tried on Linux 6.18, with
    # noexec lowers and a noexec upper).  Views, the caller's mount of an image, stay exec.
    LAYER_FLAGS: Final = kmount.MS_RDONLY | kmount.MS_NOSUID | kmount.MS_NODEV | kmount.MS_NOEXEC
    VIEW_FLAGS: Final = kmount.MS_NOSUID | kmount.MS_NODEV

    def __init__(self, data_dir: str | os.PathLike[str], store_url: str | None = None, *,
                 s3_endpoint: str | None = None, daemon_options: dict[str, Any] | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.store_url = store_url
        self.s3_endpoint = s3_endpoint
        self.daemon_options = daemon_options or {}
        self.client = DaemonClient(self.data_dir)
        self.state_dir = self.data_dir / "state"
        self.layer_root = self.data_dir / "layers"
        forget = ("layerbox then forgets this host's mounts: unmount them by hand, and `layerbox umount --all` "
                  "the layers they leave")
        self.table = HostTable(self.state_dir / "mounts.json", "layerbox.mounts", 2, reads=(1,),
                               upgrade=_upgrade_state, empty=_empty_state, lock=self.state_dir / "lock", aside=forget,
                               durable=False)
        self.records = HostRecords(self.state_dir / "mounts", "layerbox.mount", 1, aside=forget, durable=False)
        # Called as (mountpoint, "detached") before a user mount on stale layers is taken down
        # and (mountpoint, "restacked") once it is back on the new daemon: whoever runs
        # processes on the mount (a container holds its own copy of the overlay, still on the
        # dead daemon) restarts them.  Runs under the state lock: it must not call back here.
        # A pid returned from "restacked" holds the new mount: it is detached (see detach).
        self.on_remount: Callable[[str, str], int | None] | None = None

    # -- state --------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        private_dirs(self.data_dir)  # every operation: a looser mode set meanwhile is tightened again
        # Compact, and written only when changed (the table does both): a host with 1,000
        # sandboxes rewrote ~3 MB of indented JSON on each mount.
        with self.table.locked() as state:
            for target, rec in (state.pop("legacy_mounts", None) or {}).items():  # (a version 1 table's)
                self._put(target, rec)
            yield state

    # -- user mount records ----------------------------------------------------------------
    def record(self, mountpoint: str | os.PathLike[str]) -> dict[str, Any] | None:
        """The record of the user mount at ``mountpoint`` as last written (its upper, layers,
        whether detached), None when there is none; one file read, no reconcile."""
        return self._record_at(os.path.realpath(mountpoint))

    def _record_at(self, target: str) -> dict[str, Any] | None:
        """:meth:`record` of a mount point already resolved (``os.path.realpath``)."""
        rec = self.records.get(_record_key(target))
        if rec is None or rec.pop("mountpoint", None) != target:
            return None
        return rec

    def _put(self, target: str, rec: dict[str, Any]) -> None:
        self.records.put(_record_key(target), {**rec, "mountpoint": target})

    def _forget(self, target: str) -> None:
        self.records.drop(_record_key(target))

    def _all_records(self) -> dict[str, dict[str, Any]]:
        return {rec["mountpoint"]: rec for rec in self.records.all().values() if isinstance(rec.get("mountpoint"), str)}

    def has_stale_layers(self, generation: str) -> bool:
        """Whether a layer is mounted under another daemon generation than ``generation`` (its
        reads fail until :meth:`remount`).  Reads the table as it is, without the lock; an
        unreadable one raises :class:`layerstore.hoststate.HostStateError`."""
        return any(info.get("generation") != generation for info in self.table.read()["layers"].values())

    def _reconcile(self, state: dict[str, Any], generation: str | None) -> tuple[set[str], set[str]]:
        """Drop the layers the kernel no longer has; return the layers mounted under another
        generation, and the host's mount points.  Only the table: records are :meth:`_reconcile_all`'s."""
        mounted = set(kmount.mountpoints())
        stale = set()
        for hexd, info in list(state["layers"].items()):
            if info["mountpoint"] not in mounted:
                del state["layers"][hexd]
            elif info.get("generation") != generation:
                stale.add(hexd)
        holds = state["holds"]
        for info in state["layers"].values():
            info["users"] = [u for u in info["users"] if u in holds]
        return stale, mounted

    def _reconcile_for(self, state: dict[str, Any], generation: str, layers: list[str]) -> None:
        """:meth:`_reconcile` as a mount of ``layers`` needs it: the whole of it (and the stale
        layers re-stacked) after the daemon changed, else only those layers checked, one statx
        each; reading the host's mount table at every mount made a fork of 100 read it 100 times,
        with up to 100 overlays in it."""
        if any(info.get("generation") != generation for info in state["layers"].values()):
            stale, _ = self._reconcile(state, generation)
            if stale:
                self._remount_stale(state, stale, generation)
            return
        for hexd in layers:
            info = state["layers"].get(hexd)
            if info is not None and not kmount.is_mountpoint(info["mountpoint"]):
                del state["layers"][hexd]  # (lost by the kernel: mounted again below)
        holds = state["holds"]
        for info in state["layers"].values():
            info["users"] = [u for u in info["users"] if u in holds]

    def _reconcile_all(self, state: dict[str, Any], generation: str | None
                       ) -> tuple[set[str], dict[str, dict[str, Any]]]:
        """:meth:`_reconcile`, and the records: those the kernel no longer has are forgotten (a
        detached one is in its holder's namespace, not ours: it stays until umount), each layer's
        count of mounts is recounted, and entries no mount or hold uses are dropped.  Returns
        the stale layers and the records kept, by mount point."""
        stale, mounted = self._reconcile(state, generation)
        records = self._all_records()
        for mp in [mp for mp, rec in records.items() if mp not in mounted and not rec.get("detached")]:
            log.info("forgetting %s: no longer mounted", mp)
            self._forget(mp)
            del records[mp]
        counts = collections.Counter(h for rec in records.values() for h in rec["layers"])
        for hexd, info in state["layers"].items():
            info["mounts"] = counts.get(hexd, 0)
        used = set(counts) | {h for rec in state["holds"].values() for h in rec["layers"]}
        for hexd in [h for h in state["entries"] if h not in used]:
            del state["entries"][hexd]
        return stale, records

    # -- operations ------------------------------------------------------------------------
    def _daemon(self) -> dict[str, Any]:
        return self.client.ensure_running(self.store_url, s3_endpoint=self.s3_endpoint, **self.daemon_options)

    def _layers(self, resolved: Resolved, *, trace: bool, fill: bool) -> tuple[dict[str, Any], str]:
        """The daemon's ``/layers`` answer for ``resolved`` and the generation of the daemon that
        gave it, the daemon started (or waited for) only when none serves.  A ``/health`` round
        trip before every mount was half the daemon's requests when 100 sandboxes start."""
        body = {"image": resolved.digest, "trace": trace, "fill": fill,
                "layers": [layer.to_json() for layer in resolved.layers]}
        try:
            reply = self.client.request("POST", "/layers", body)
        except (DaemonNotServing, DaemonDropped):
            # None runs or it still starts (nothing was done), or it died mid-request: its successor,
            # started here if need be, has none of its state, and /layers only registers layers and
            # counts a use, so asking once more is safe.
            self._daemon()
            reply = self.client.request("POST", "/layers", body)
        generation = reply.get("generation")
        if not isinstance(generation, str):  # a daemon from before its answer said (and a ready check)
            generation = self._daemon()["generation"]
            reply = self.client.request("POST", "/layers", body)
        return reply, generation

    def start_daemon(self) -> dict[str, Any]:
        """Start this host's daemon now (its ~0.3-0.5 s Python start-up) rather than in the first mount."""
        return self._daemon()

    def mount(self, resolved: Resolved, mountpoint: str | os.PathLike[str], *, writable: bool = False,
              upper: str | os.PathLike[str] | None = None, trace: bool = True, fill: bool = True
              ) -> MountResult:
        """Mount ``resolved`` at ``mountpoint``; ``fill``: let the daemon fill the image's layers in
        the background (when it is small enough for its ``--fill-below``)."""
        start = time.perf_counter()
        target = os.path.realpath(mountpoint)
        if not os.path.isdir(target):
            raise MountError(f"{mountpoint}: mount point must be an existing directory")
        # Before the host's lock, as layer_files does: the daemon serves it to any number of
        # callers at once, and under the lock it was a third of what 100 sandboxes starting
        # together waited for one after another.  Its paths are the data dir's, whatever daemon
        # answers; a layer of a lost generation is re-stacked below as before.
        reply, generation = self._layers(resolved, trace=trace, fill=fill)
        with self._locked() as state:
            self._reconcile_for(state, generation, [hex_digest(x.digest) for x in resolved.layers])
            known = self._record_at(target)
            if known is not None:
                if known.get("detached") or kmount.is_mountpoint(target):
                    raise MountError(f"{target} is already a layerbox mount ({known['digest']}); "
                                     "`layerbox umount` it first")
                log.info("forgetting %s: no longer mounted", target)
                self._forget(target)
                self._unuse(state, known["layers"])
            created = 0
            lowers = []
            for layer, paths in zip(resolved.layers, reply["layers"], strict=True):
                hexd = hex_digest(layer.digest)
                info = state["layers"].get(hexd)
                if info is None:
                    info = self._mount_layer(hexd, paths, generation)
                    state["layers"][hexd] = info
                    created += 1
                lowers.append(info["mountpoint"])
            record = self._mount_user(target, lowers, writable, upper)
            record.update(digest=resolved.digest, layers=[hex_digest(x.digest) for x in resolved.layers],
                          kind=resolved.kind)
            for layer in resolved.layers:
                state["entries"].setdefault(hex_digest(layer.digest), layer.to_json())
            for hexd in record["layers"]:
                info = state["layers"][hexd]
                info["mounts"] = info.get("mounts", 0) + 1
            # (the table is written as the block ends, after the record: a crash between leaves
            # its layers' counts one too low, which the next full reconcile corrects: docs/FORMAT.md)
            self._put(target, record)
        return MountResult(target, resolved.digest, len(lowers), writable, record.get("upper"),
                           round(time.perf_counter() - start, 6), created, reply.get("trace"))

    def layer_files(self, resolved: Resolved, *, trace: bool = True, fill: bool = True) -> list[dict[str, str]]:
        """The daemon's metadata image and blob file of each layer of ``resolved``, base first, with
        no mount: what a VM attaches as block devices (its reads of a blob's holes are fetches).

        The daemon's fd holder keeps each blob (and, on the fanotify path, its mark) across
        daemon restarts, as it does for mounted layers."""
        return list(self._layers(resolved, trace=trace, fill=fill)[0]["layers"])

    def hold(self, owner: str, resolved: Resolved) -> list[str]:
        """Mount the layers of ``resolved`` for ``owner``, with no overlay: their mount points,
        base first, each the layer as overlayfs takes it as a lower directory (whiteouts as
        0/0 devices, opaque directories marked).  The containerd snapshotter hands them to
        containerd, which stacks them itself.

        A layer stays mounted while a hold or a mount uses it; ``owner`` (any string, never a
        path) holds these layers until :meth:`release`.  Holding again replaces its layers."""
        reply, generation = self._layers(resolved, trace=False, fill=False)  # (before the lock: as mount)
        with self._locked() as state:
            self._reconcile_for(state, generation, [hex_digest(x.digest) for x in resolved.layers])
            previous = state["holds"].pop(owner, None)
            out = []
            for layer, paths in zip(resolved.layers, reply["layers"], strict=True):
                hexd = hex_digest(layer.digest)
                info = state["layers"].get(hexd)
                if info is None:
                    info = state["layers"][hexd] = self._mount_layer(hexd, paths, generation)
                if owner not in info["users"]:
                    info["users"].append(owner)
                state["entries"].setdefault(hexd, layer.to_json())
                out.append(info["mountpoint"])
            state["holds"][owner] = {"digest": resolved.digest,
                                     "layers": [hex_digest(x.digest) for x in resolved.layers]}
            if previous is not None:
                self._unuse(state, [h for h in previous["layers"] if h not in state["holds"][owner]["layers"]],
                            owner=owner)
        return out

    def release(self, owner: str) -> bool:
        """End ``owner``'s hold: its layers no other hold or mount uses are unmounted (lazily:
        a container that still has them open keeps reading).  False if it held nothing."""
        with self._locked() as state:
            self._reconcile(state, None)  # (layers the kernel lost; the generation matters to mounts only)
            rec = state["holds"].pop(owner, None)
            if rec is None:
                return False
            self._unuse(state, rec["layers"], owner=owner)
            return True

    def holds(self) -> dict[str, dict[str, Any]]:
        with self._locked() as state:
            return dict(state["holds"])

    def _unuse(self, state: dict[str, Any], layers: list[str], *, owner: str | None = None,
               lazy: bool = True) -> None:
        """One user of each of ``layers`` is gone (the hold ``owner``'s, else a user mount); a layer
        nothing uses any more is unmounted."""
        for hexd in layers:
            info = state["layers"].get(hexd)
            if info is None:
                continue
            if owner is not None:
                info["users"] = [u for u in info["users"] if u != owner]
            else:
                info["mounts"] = max(0, info.get("mounts", 0) - 1)
            if not info["users"] and not info.get("mounts"):
                kmount.umount(info["mountpoint"], lazy=lazy, missing_ok=True)
                del state["layers"][hexd]

    def _mount_layer(self, hexd: str, paths: dict[str, str], generation: str) -> dict[str, Any]:
        mp = self.layer_root / hexd
        mp.mkdir(exist_ok=True)
        if kmount.is_mountpoint(mp):  # left by a crash before the state was written
            kmount.umount(mp, lazy=True, missing_ok=True)
        kmount.mount_erofs(paths["meta"], mp, paths["blob"], flags=self.LAYER_FLAGS,
                           direct=paths.get("blob_io") == "direct")
        try:
            # the canary after the mount: its reads must still reach the daemon (fanotify: the
            # blob's mark is there; one added later would never be seen and holes read as zeros)
            self.client.request("POST", "/check", {"layers": [hexd]})
        except LazyfetchError as exc:
            kmount.umount(mp, lazy=True, missing_ok=True)
            raise MountError(f"layer {hexd}: not mounted: {exc}") from None
        return {"mountpoint": str(mp), "generation": generation, "path": paths.get("path"), "users": [],
                "mounts": 0, "meta": paths["meta"], "blob_io": paths.get("blob_io", "buffered")}

    def _mount_user(self, target: str, lowers: list[str], writable: bool,
                    upper: str | os.PathLike[str] | None) -> dict[str, Any]:
        record: dict[str, Any] = {"writable": writable, "upper": None, "work": None, "owned_upper": False}
        if writable:
            if upper is None:
                base = self.data_dir / "uppers" / uuid.uuid4().hex
                # 0700 here as well, as the upper itself cannot be: its mode is the sandbox's "/" (0755)
                base.mkdir(mode=0o700)
                up, work = base / "upper", base / "work"
                record["owned_upper"] = True
            else:  # the caller's directory: who may reach it is the caller's choice (sandbox/isolation/disk.py)
                up = Path(upper).resolve()
                work = up.parent / f".{up.name}.work"
            up.mkdir(parents=True, exist_ok=True)
            work.mkdir(parents=True, exist_ok=True)
            record.update(upper=str(up), work=str(work))
        self._stack(target, lowers, record)
        return record

    def _stack(self, target: str, lowers: list[str], record: dict[str, Any]) -> None:
        """Mount the caller's view of ``lowers`` (a mount record's) at ``target``.

        A layer named twice in one stack (a checkpoint that captured no change has the empty
        layer, and so does the next one) is stacked once, at its upper place: overlayfs refuses
        a lower directory twice (ELOOP, overlapping layers), and the lower copy is shadowed by
        the upper one for every path it holds, so the view is the same."""
        lowers = list(reversed(dict.fromkeys(reversed(lowers))))
        if len(lowers) == 1:  # a layer alone goes on its skeleton (read-only: overlayfs wants two lowers)
            lowers = [self._skeleton(lowers[0]), *lowers]
        if record["writable"]:
            kmount.mount_overlay(lowers, target, upper=record["upper"], work=record["work"], flags=self.VIEW_FLAGS)
        else:
            kmount.mount_overlay(lowers, target, flags=self.VIEW_FLAGS)

    def _skeleton(self, layer: str) -> str:
        """The lowest layer under a single-layer stack: an empty directory for each directory of
        ``layer`` (a layer mount point) that holds a whiteout, made once per layer beside it.

        A bind of the layer would show its whiteouts as 0/0 devices and its opaque markers raw,
        and over an empty lower overlayfs still lists the whiteouts of a directory found in one
        layer only (it filters them in merged directories alone: Linux 6.18); the skeleton makes
        each such directory a merged one.  (A whiteout inside an opaque directory of the same
        layer stays listed: the marker stops the merge.  It hides nothing the marker does not.)
        """
        skeleton = Path(f"{layer}.skeleton")
        if skeleton.is_dir() and not skeleton.is_symlink():
            return str(skeleton)  # layers are immutable
        tmp = Path(f"{layer}.skeleton-tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir()
            for rel in _whiteout_dirs(layer):
                (tmp / rel).mkdir(parents=True, exist_ok=True)
            os.replace(tmp, skeleton)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise MountError(f"{layer}: cannot make the skeleton of its directories ({exc}); not mounted") from None
        return str(skeleton)

    def _remount_stale(self, state: dict[str, Any], stale: set[str], generation: str) -> None:
        _, records = self._reconcile_all(state, generation)
        users = sorted(mp for mp, rec in records.items() if stale & set(rec["layers"]))
        log.warning("daemon restarted: remounting %d layer(s) and %d mount(s)", len(stale), len(users))
        for mp in users:
            self._notify(mp, "detached")
            kmount.umount(mp, lazy=True, missing_ok=True)
        for hexd in stale:
            kmount.umount(state["layers"][hexd]["mountpoint"], lazy=True, missing_ok=True)
            del state["layers"][hexd]
        for mp in users:
            rec = records[mp]
            entries = rec.get("entries") or [state["entries"][h] for h in rec["layers"]]  # older state: per mount
            reply = self.client.request("POST", "/layers", {"image": rec["digest"], "trace": False,
                                                             "layers": entries})
            lowers = []
            for hexd, paths in zip(rec["layers"], reply["layers"], strict=True):
                if hexd not in state["layers"]:
                    state["layers"][hexd] = self._mount_layer(hexd, paths, generation)
                lowers.append(state["layers"][hexd]["mountpoint"])
            self._stack(mp, lowers, rec)
            rec.pop("detached", None)
            holder = self._notify(mp, "restacked")
            if isinstance(holder, int):
                try:
                    self._detach(rec, mp, holder)
                except MountError as exc:  # still mounted here: correct, only slower for others
                    log.warning("%s", exc)
            self._put(mp, rec)
        counts = collections.Counter(h for rec in records.values() for h in rec["layers"])
        for hexd, info in state["layers"].items():
            info["mounts"] = counts.get(hexd, 0)
        for owner, hold in state["holds"].items():
            missing = [h for h in hold["layers"] if h not in state["layers"]]
            if not missing:
                continue
            # a holder's users (containerd's containers) keep their overlays on the old mounts,
            # whose reads now fail: new ones get these (docs/SECURITY.md: fail closed)
            entries = [state["entries"][h] for h in hold["layers"]]
            reply = self.client.request("POST", "/layers", {"image": hold["digest"], "trace": False,
                                                             "layers": entries})
            for hexd, paths in zip(hold["layers"], reply["layers"], strict=True):
                if hexd not in state["layers"]:
                    state["layers"][hexd] = self._mount_layer(hexd, paths, generation)
                if owner not in state["layers"][hexd]["users"]:
                    state["layers"][hexd]["users"].append(owner)

    def _notify(self, mountpoint: str, phase: str) -> int | None:
        if self.on_remount is None:
            return None
        try:
            return self.on_remount(mountpoint, phase)
        except Exception:  # the mount itself is fine; its user is told in the log
            log.exception("remount hook for %s (%s) failed", mountpoint, phase)
            return None

    def detach(self, mountpoint: str | os.PathLike[str], holder_pid: int) -> None:
        """Take the writable mount at ``mountpoint`` out of this host's mount table.

        ``holder_pid`` is a process whose own mount namespace holds the mount (a
        container whose root it is): the overlay lives on there.  The record, its
        upper and its layers stay until :meth:`umount`; checkpoints read the upper
        from the record.
        """
        target = os.path.realpath(mountpoint)
        with self._locked():
            rec = self._record_at(target)
            if rec is None:
                raise MountError(f"{target} is not a layerbox mount on this host ({self.data_dir})")
            ours = self._detach(rec, target, holder_pid, now=False)
            self._put(target, rec)
        # After the lock: a lazy unmount waits for an RCU grace period (~1.3-1.8 ms here), and
        # under the lock it was half of what 100 sandboxes starting together waited for.  The
        # record already says detached, so a crash before this leaves the mount to umount,
        # which takes it off this table as it does for any record; one stacked there since
        # (a re-stack after a daemon restart) is another mount and stays.
        if ours is not None:
            kmount.umount_mount(target, ours)

    def _detach(self, rec: dict[str, Any], target: str, pid: int, *, now: bool = True) -> int | None:
        """Mark ``rec`` detached to holder ``pid``; unmount it here ``now``, or return the id
        of the mount the caller is to take off (:func:`kmount.umount_mount`), None for none."""
        if not rec.get("writable"):
            raise MountError(f"{target}: only writable mounts are detached")
        try:
            theirs = os.readlink(f"/proc/{pid}/ns/mnt")
            start = _start_time(pid)
        except OSError as exc:
            raise MountError(f"{target}: holder process {pid} is gone ({exc.strerror}); not detached") from None
        if theirs == os.readlink("/proc/self/ns/mnt"):
            # detaching here would take the mount from the holder too
            raise MountError(f"{target}: process {pid} shares this mount namespace; not detached")
        rec["detached"] = {"pid": pid, "start": start}
        if now:
            kmount.umount(target, lazy=True, missing_ok=True)
            return None
        return kmount.mount_id(target)

    def remount(self) -> int:
        """Make sure a daemon serves this host's mounts; re-stack those of a lost generation.

        Returns how many layers had to be mounted again (0 after a daemon restart
        that took its generation over: the mounts never stopped being valid).
        """
        health = self._daemon()
        with self._locked() as state:
            stale, _ = self._reconcile_all(state, health["generation"])  # (and the counts, after a crash)
            if stale:
                self._remount_stale(state, stale, health["generation"])
            return len(stale)

    def umount(self, mountpoint: str | os.PathLike[str], *, discard: bool = False, lazy: bool = False) -> None:
        target = os.path.realpath(mountpoint)
        with self._locked() as state:
            self._reconcile(state, None)  # (layers the kernel lost; the generation matters to mounts only)
            rec = self._record_at(target)
            if rec is None:
                raise MountError(f"{target} is not a layerbox mount on this host ({self.data_dir})")
            kmount.umount(target, lazy=lazy, missing_ok=True)
            self._unuse(state, rec["layers"], lazy=lazy)  # (EBUSY raises: the record stays, for a lazy retry)
            self._forget(target)  # before the table: a crash between leaves a count too high
            if discard and rec.get("owned_upper") and rec.get("upper"):
                shutil.rmtree(Path(rec["upper"]).parent, ignore_errors=True)

    def umount_all(self, *, stop_daemon: bool = True) -> int:
        with self._locked() as state:
            count = 0
            for mp in self._all_records():
                kmount.umount(mp, lazy=True, missing_ok=True)
                self._forget(mp)
                count += 1
            for hexd, info in list(state["layers"].items()):
                kmount.umount(info["mountpoint"], lazy=True, missing_ok=True)
                del state["layers"][hexd]
            count += len(state["holds"])
            state["holds"].clear()
        # layer mount points left by crashes (state lost) are ours too
        for mp in kmount.mounts_under(self.layer_root):
            kmount.umount(mp, lazy=True, missing_ok=True)
        if stop_daemon:
            self.client.stop(release=True)  # nothing is mounted on its blobs: the holder may go too
            fuse_dir = self.data_dir / "blobs"
            if kmount.is_mountpoint(fuse_dir):
                kmount.umount(fuse_dir, lazy=True, missing_ok=True)
        return count

    def stop_daemon(self) -> bool:
        """Stop the daemon; with no layer mounted, its holder lets the kernel state go as well.

        While layers are mounted the holder keeps their fds: their reads wait for the next
        daemon (``layerbox mount`` or ``layerbox daemon start`` starts one), and fail with EIO
        after the holder's grace.
        """
        with self._locked() as state:
            self._reconcile(state, None)
            return self.client.stop(release=not state["layers"])

    def status(self) -> dict[str, Any]:
        """The daemon's health, this host's mounts, layers and holds, and (``served``) per layer the
        daemon serves: its data path, bytes present, kernel reads served, time they waited on the
        store and what the background fill does about it."""
        with self._locked() as state:
            health = self.client.health()
            _, records = self._reconcile_all(state, health["generation"] if health else None)
            mounts = {mp: {k: v for k, v in rec.items() if k != "mountpoint"} for mp, rec in records.items()}
            # each layer's users as version 1 listed them: the mount points on it, then its hold owners
            layers = {hexd: {**info, "users": [mp for mp, rec in mounts.items() if hexd in rec["layers"]]
                             + info["users"]} for hexd, info in state["layers"].items()}
            out = {"daemon": health, "mounts": mounts, "layers": layers, "holds": state["holds"]}
        out["served"] = self._served_layers() if health else {}
        return out

    def _served_layers(self) -> dict[str, dict[str, Any]]:
        st = self.client.request("GET", "/stats")
        return {layer: {"data_path": st["data_path"], "blob_bytes": st["blob_bytes_per_layer"][layer],
                        "bytes_present": present, "events_served": st["events_served_per_layer"][layer],
                        "store_wait_seconds": st["store_wait_seconds_per_layer"][layer],
                        "fill": st["fill_per_layer"][layer]}
                for layer, present in st["bytes_present_per_layer"].items()}
