"""Sandboxes on one host: create, restore, adopt, list, destroy, reap, reconcile; whatever isolates them.

The manager owns what every sandbox has, whatever runs it: its state record, its receipts,
idempotency, job leases, and the host resources it holds (sandbox.isolation.resources).
What differs between a container and a VM is a backend's (:mod:`sandbox.backends`): the
manager asks :data:`sandbox.backends.TABLE` which one runs an isolation and never tests the
isolation itself.

What lives where (layout in :mod:`sandbox.core.paths`, formats in docs/FORMAT.md)::

    sandbox/boxes/<id>/state.json the SandboxState (sandbox.core.model), written before anything it names exists
    sandbox/boxes/<id>/...        what its backend keeps (a container's bundle and rootfs, a VM's vm/),
                                  and with a disk limit its own ext4 (disk.img, disk/)
    sandbox/receipts/<id>.jsonl   the receipt log's live segment, <id>.<n>.jsonl its sealed ones
                                  (sandbox.core.receipts; kept RETENTION after destroy)
    sandbox/runtime/              crun --root (the container backend's)
    sandbox/userns.json           host uid ranges (sandbox.isolation.idmap RangePool)
    sandbox/leases/<project>/<job>.json  a job's lease: its admission state and its sandboxes here
                                  (sandbox.core.leases; sandbox/leases.json before, split once)
    net/                          network namespaces and address allocations (sandbox.isolation.network)

Every id is checked (:func:`sandbox.core.model.check_sandbox_id`) before it becomes a path,
and the manager never reads a file a sandbox can write as its own state.

Store-facing calls (create, restore, checkpoint) are coroutines; runtime and
file calls are blocking and meant for a thread when the caller is async.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import contextvars
import hashlib
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from layerstore.objects import Resolved
from layerstore.store import Store
from lazyfetch.errors import LazyfetchError
from lazyfetch.mounts import HostMounts, MountError
from sandbox.backends import make_backends
from sandbox.backends.base import Backend, HostContext, process_defaults
from sandbox.core.errors import (
    InvalidField,
    ReceiptsBroken,
    SandboxError,
    SandboxNotFound,
    SandboxStateError,
    StateUnreadable,
    UnsupportedOption,
)
from sandbox.core.leases import Leases
from sandbox.core.model import (
    ON_TTL_LABEL,
    POOL_LABEL,
    SCHEMA_OPTIONS,
    SandboxOptions,
    SandboxState,
    check_sandbox_id,
    new_sandbox_id,
)
from sandbox.core.paths import SandboxPaths
from sandbox.core.receipts import ReceiptLogs, verify_receipt_chain
from sandbox.core.states import States
from sandbox.host.deadlines import Deadlines
from sandbox.host.execs import Cancel, ExecResult, ExecRunner
from sandbox.host.reconcile import reconcile
from sandbox.host.sandbox import ACTIVE_GRAIN, Sandbox
from sandbox.isolation import idmap
from sandbox.isolation.cgroups import CgroupLayout
from sandbox.isolation.network import NetworkManager
from sandbox.isolation.resources import (
    Cgroups,
    Disks,
    HostResources,
    Mounts,
    Networks,
    Uids,
    cgroup_owner,
)
from sandbox.isolation.runfs import RunFs
from sandbox.isolation.sysfs import SharedSysfs
from snapshots.checkpoint import Snapshots

log = logging.getLogger("layerbox.sandbox")

__all__ = ["Cancel", "ExecResult", "Sandbox", "SandboxManager", "become_subreaper"]

PR_SET_CHILD_SUBREAPER = 36
# Host uids of user-namespaced sandboxes and VMMs: 64 regions of USERNS_SLOTS ranges from 2^30, one
# region per data dir (like the subnet), so two managers on one machine rarely share a uid; far above
# the 100000.. ranges /etc/subuid hands to users.  A region's last range is 65536 single uids, one
# per VMM's jail.
USERNS_FIRST = 1 << 30
USERNS_SLOTS = 256


def become_subreaper() -> None:
    """For a long-lived manager service: orphans of crun land here, not on a slow PID 1."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise SandboxError(f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(ctypes.get_errno())}")


# The caller's set of sandbox ids being made for it: every id a create, restore or adopt in this
# context picks is added before its state is first written, so a quota counting states can tell
# the sandboxes of creates still in flight (counted apart) from finished ones.
IN_FLIGHT: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar("layerbox_in_flight", default=None)


def _in_flight(sid: str) -> None:
    made = IN_FLIGHT.get()
    if made is not None:
        made.add(sid)


class SandboxManager:
    """Sandboxes of one host (one data dir) against one store."""

    def __init__(self, data_dir: str | os.PathLike[str], store_url: str | None = None, *,
                 runtime: str = "crun", subnet: str | None = None,
                 userns_range: tuple[int, int] | None = None, protected: Sequence[str] = ()) -> None:
        """``userns_range``: ``(first host uid, number of 65536-uid ranges)``, at least 2: all but the
        last for sandboxes created with ``userns=True``, the last as one uid per VMM's jail; by
        default a region from 2^30 chosen by the data dir.
        ``runtime``: the OCI runtime the container backend runs (crun).  ``protected``: CIDRs no
        egress rule may open, on top of the host's, the subnet's and link-local ones (docs/SECURITY.md,
        "Protected destinations"); a sandbox whose options carry ``PROTECTED_EGRESS_LABEL`` may."""
        self.data_dir = Path(data_dir).resolve()
        self.store_url = store_url
        self.paths = SandboxPaths(self.data_dir)
        self.root = self.paths.root
        self.boxes = self.paths.boxes
        self.receipts_dir = self.paths.receipts
        self.receipt_logs = ReceiptLogs(self.receipts_dir)
        self.states = States(self.boxes)
        self.deadlines = Deadlines()
        self.states.on_write = self.deadlines.note
        self.host = HostMounts(self.data_dir, store_url)
        self.leases = Leases(self.root / "leases", legacy=self.root / "leases.json")
        digest = hashlib.sha256(str(self.data_dir).encode()).hexdigest()
        # one cgroup parent per data dir: two managers on one machine never share cgroups
        self.cgroup_parent = "layerbox-" + digest[:10]
        # a /16 per data dir, so two managers (two tests, two "hosts" on one machine) never overlap
        self.subnet = subnet or f"10.{64 + int(digest, 16) % 64}.0.0/16"
        if userns_range is None:
            region = int(digest, 16) % 64
            userns_range = (USERNS_FIRST + region * USERNS_SLOTS * idmap.RANGE_SIZE, USERNS_SLOTS)
        first, slots = userns_range
        self.uid_ranges = idmap.RangePool(self.root / "userns.json", first, slots - 1)
        self.uid_jails = idmap.RangePool(self.root / "jails.json", first + (slots - 1) * idmap.RANGE_SIZE,
                                         idmap.RANGE_SIZE, 1)
        self.resources = HostResources(
            mounts=Mounts(self.host, self.paths), disks=Disks(self.paths),
            networks=Networks(self.data_dir / "net", self.subnet, protected),
            cgroups=Cgroups(self.cgroup_parent, self.paths.cgroups_lock,
                            sysfs=SharedSysfs(self.paths.sysfs, self.paths.sysfs_lock),
                            runfs=RunFs(self.paths.run, self.paths.run_lock)),
            uids=Uids(self.uid_ranges, self.uid_jails))
        self.execs = ExecRunner(self.states.lock)
        ctx = HostContext(self.data_dir, self.paths, self.host, self.resources, self.open_store,
                          lambda sid: Sandbox(self, sid))
        self.backends = make_backends(ctx, {"container": {"runtime": runtime}})
        # called with a sandbox's id before destroy kills it (sandbox.edge.commands ends its background
        # commands there, so their receipts come before the destroy record)
        self.on_destroy: builtins.list[Callable[[str], None]] = []
        self.leases.migrate(self._job_members)  # an older layerbox's leases.json, split once

    def _job_members(self) -> dict[str, builtins.list[str]]:
        """Each job's sandboxes on this host, from their states."""
        members: dict[str, builtins.list[str]] = {}
        for st in self.list():
            if st.job is not None:
                members.setdefault(st.job, []).append(st.id)
        return members

    def backend(self, isolation: str) -> Backend:
        """The backend that runs ``isolation`` (sandbox.backends.TABLE)."""
        try:
            return self.backends[isolation]
        except KeyError:
            raise UnsupportedOption(f"isolation: {isolation!r} has no backend on this host "
                                    f"(known: {', '.join(self.backends)})") from None

    def all_backends(self) -> builtins.list[Backend]:
        """Each backend once (microvm and vm share one)."""
        return builtins.list({id(b): b for b in self.backends.values()}.values())

    @property
    def net(self) -> NetworkManager:
        """Network namespaces for sandboxes with egress rules (made on first use: it reads host routes)."""
        return self.resources.networks.manager

    @property
    def layout(self) -> CgroupLayout:
        return self.resources.cgroups.layout

    async def open_store(self) -> Store:
        return await Store.open(self.store_url, self.data_dir)

    # -- sandboxes ------------------------------------------------------------------------------------
    def exists(self, sid: str) -> bool:
        return self.states.exists(sid)

    def get(self, sid: str) -> Sandbox:
        """The sandbox ``sid`` (checked against the id grammar first); :class:`SandboxNotFound` if none."""
        box = Sandbox(self, sid)
        box.state  # noqa: B018  (raises SandboxNotFound)
        return box

    def holds_any(self) -> bool:
        """Whether a sandbox has a directory here, found at the first: each destroy asks, and
        :meth:`ids` (all names, sorted, each checked) was 7% of the manager's samples at 3,200 held."""
        try:
            with os.scandir(self.boxes) as entries:
                for entry in entries:
                    with contextlib.suppress(SandboxError):
                        check_sandbox_id(entry.name)
                        return True
        except FileNotFoundError:
            pass
        return False

    def ids(self, *, strays: builtins.list[str] | None = None) -> builtins.list[str]:
        """Sandbox ids with a directory here; names that are not ids go to ``strays`` (never used as ids)."""
        try:
            names = os.listdir(self.boxes)
        except FileNotFoundError:
            return []
        out = []
        for name in sorted(names):
            try:
                out.append(check_sandbox_id(name))
            except SandboxError:
                if strays is not None:
                    strays.append(name)
        return out

    def list(self, *, job: str | None = None) -> builtins.list[SandboxState]:
        out = []
        for sid in self.ids():
            try:
                st = self.states.read(sid)
            except SandboxNotFound:
                continue  # being created (no state yet) or destroyed meanwhile
            except StateUnreadable as exc:
                log.warning("%s", exc)
                continue
            if job is None or st.job == job:
                out.append(st)
        return out

    def inflight(self, sid: str) -> int:
        return self.execs.inflight(sid)

    def receipts(self, sid: str) -> builtins.list[dict[str, Any]]:
        """The sandbox's receipts in the segments its log keeps, oldest first."""
        return self.receipt_logs.read(sid)

    def verify_receipts(self, sid: str) -> dict[str, Any]:
        """Check the sandbox's receipt log end to end (the segments kept): ``{"records": n since it
        began, "head": hash of the last, "last": its id, ...}`` (ReceiptLogs.verify)."""
        return self.receipt_logs.verify(sid)

    def started_of(self, sid: str, tag: str) -> dict[str, Any] | None:
        """The ``exec_started`` receipt of the exec ``tag`` (a keyed or background one names its tag)."""
        return next((r for r in reversed(self.receipt_logs.find(sid, "tag", tag))
                     if r.get("action") == "exec_started"), None)

    # -- create / restore -----------------------------------------------------------------------------
    async def create(self, ref: str, options: SandboxOptions | None = None, *, admitting: bool = True,
                     name: str | None = None, **fields: Any) -> Sandbox:
        """Start a sandbox on a writable overlay of ``ref``; returns once ``exec`` works.

        ``options`` is a :class:`SandboxOptions`, or its fields are given as keywords
        (validated the same way).  A checkpoint ref goes through :meth:`restore`, so
        its bound digests and policy are checked first.  ``name`` is what the sandbox
        says it runs (default ``ref``): a caller that resolved and checked a ref passes
        its digest as ``ref``, so nothing can move it in between.
        """
        async with await self.open_store() as store:
            resolved = await store.resolve(ref)
        if resolved.kind == "checkpoint":
            return await self.restore(ref, options, admitting=admitting, name=name, **fields)
        if resolved.kind not in ("image", "composition"):  # a VM template, a run manifest, receipts
            raise UnsupportedOption(f"{ref} is a {resolved.kind} document ({resolved.digest}), not an image, "
                                    "composition or checkpoint: nothing to run")
        return await self._launch(resolved, ref, _options(options, fields), admitting=admitting, name=name)

    async def restore(self, checkpoint_ref: str, options: SandboxOptions | None = None, *, admitting: bool = True,
                      name: str | None = None, sid: str | None = None, **fields: Any) -> Sandbox:
        """A new sandbox whose rootfs is ``checkpoint_ref`` (made on this host or any other).

        ``sid``: the id it gets (checked; :class:`SandboxStateError` if this host has a sandbox of
        that id), for a sandbox that moves between hosts through the store and keeps its id (the
        caller makes sure no other host runs it); a new id by default.

        Without ``options``, the sandbox gets the options its source sandbox had (env,
        workdir, user, limits, labels...: :meth:`SandboxOptions.carried`, kept with the
        checkpoint), with ``fields`` over them; ``options`` replaces them all.
        ``policy_version``, when set, must be the policy the checkpoint was made under.
        """
        resolved, options, receipts = await self._restore_plan(checkpoint_ref, options, fields)
        return await self._launch(resolved, checkpoint_ref, options, admitting=admitting, inherited=receipts,
                                  name=name, sid=sid)

    async def restore_many(self, checkpoint_ref: str, count: int, options: SandboxOptions | None = None, *,
                           name: str | None = None, **fields: Any) -> builtins.list[Sandbox]:
        """``count`` sandboxes on one checkpoint, as :meth:`restore` makes one: the checkpoint is read
        and verified once, the sandboxes start together, and either all of them are running when
        this returns or none is left (those made are destroyed, the first failure is raised)."""
        resolved, options, receipts = await self._restore_plan(checkpoint_ref, options, fields)
        launches = asyncio.gather(*(self._launch(resolved, checkpoint_ref, options, admitting=True,
                                                 inherited=receipts, name=name) for _ in range(count)),
                                  return_exceptions=True)
        try:
            results = await asyncio.shield(launches)
        except asyncio.CancelledError:  # the caller left: finish, then take back what was made
            results = await launches
            await asyncio.to_thread(self.destroy_all, [r for r in results if isinstance(r, Sandbox)])
            raise
        made = [r for r in results if isinstance(r, Sandbox)]
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await asyncio.to_thread(self.destroy_all, made)
            raise failed[0]
        return made

    def destroy_all(self, boxes: Sequence[Sandbox]) -> None:
        """Destroy each of ``boxes`` (one already gone is skipped)."""
        for box in boxes:
            with contextlib.suppress(SandboxNotFound):
                self.destroy(box.id)

    async def _restore_plan(self, checkpoint_ref: str, options: SandboxOptions | None, fields: Mapping[str, Any]
                            ) -> tuple[Resolved, SandboxOptions, builtins.list[dict[str, Any]]]:
        """A checkpoint verified against its bound digests and policy, the options to restore it with,
        and the receipts it carries (their chain and head checked)."""
        policy = options.policy_version if options is not None else fields.get("policy_version")
        async with await self.open_store() as store:
            resolved = await Snapshots(store, self.host).verify_bound(checkpoint_ref, policy_version=policy)
            if options is None:
                options = (await self.carried_options(resolved, store)).overlay(SandboxOptions(**fields), fields)
            receipts: builtins.list[dict[str, Any]] = []
            attached = (resolved.doc.get("attachments") or {}).get("receipts")
            if attached:
                doc = await store.get_doc(attached)
                receipts = list(doc.get("receipts", []))
                head = verify_receipt_chain(receipts, what=f"the receipts of checkpoint {checkpoint_ref}")
                if "head" in doc and doc["head"] != head:
                    raise ReceiptsBroken(f"the receipts of checkpoint {checkpoint_ref} end at {head}, but the "
                                         f"document names {doc['head']} as their last: records were cut off")
        return resolved, options, receipts

    async def carried_options(self, resolved: Resolved, store: Store | None = None) -> SandboxOptions:
        """The options a checkpoint's sandbox had (defaults for a checkpoint made before they were kept)."""
        digest = (resolved.doc.get("attachments") or {}).get("options")
        if not digest:
            return SandboxOptions()
        if store is None:
            async with await self.open_store() as opened:
                return await self.carried_options(resolved, opened)
        doc = await store.get_doc(digest)
        if doc.get("schema") != SCHEMA_OPTIONS:
            raise StateUnreadable(f"checkpoint {resolved.digest}: its options document is {doc.get('schema')!r}, "
                                  f"not {SCHEMA_OPTIONS}")
        try:
            return SandboxOptions.from_state(doc.get("options") or {})
        except InvalidField as exc:
            raise InvalidField(f"checkpoint.{exc.field}", exc.detail) from None

    @contextlib.contextmanager
    def _joined(self, options: SandboxOptions, admitting: bool, box: Sandbox) -> Iterator[None]:
        """``box`` (its directory made: the reaper drops from a lease only sandboxes without one) joins
        its job's lease; an exception in the block makes it leave again, and its directory go."""
        try:
            if options.job is not None:
                self.leases.join(options.job, box.id, options.lease_ttl, admitting=admitting)
            yield
        except BaseException:
            with contextlib.suppress(Exception):
                if options.job is not None:
                    self.leases.leave(options.job, box.id)
                if not (box.dir / "state.json").exists():
                    shutil.rmtree(box.dir, ignore_errors=True)
            raise

    def adopt(self, sid: str, resolved: Resolved, options: SandboxOptions, *, name: str,
              admitting: bool = True, waited: float | None = None) -> Sandbox:
        """Sandbox ``sid``, started ahead of need for a ready pool (``layerbox.pool`` label, default
        options, no command run by anyone but the pool), becomes the sandbox a create of
        ``resolved`` with ``options`` would have made: its limits are set, env, workdir, user,
        labels and lifetimes are recorded, and its clock starts now.  A sandbox that is not such a
        pool sandbox of this very image, or options it cannot take, raise
        :class:`SandboxStateError` (the caller makes a new sandbox instead)."""
        _in_flight(sid)
        box = Sandbox(self, sid)
        st = box.state
        if POOL_LABEL not in st.labels or st.status != "running" or st.image_digest != resolved.digest:
            raise SandboxStateError(f"sandbox {sid} is not a ready sandbox of {resolved.digest} "
                                    f"(status {st.status}, image {st.image_digest})")
        if not options.fits_ready_sandbox():
            raise SandboxStateError(f"sandbox {sid}: these options need a sandbox of their own")
        if st.options.userns or st.network is not None or not st.options.fits_ready_sandbox():
            raise SandboxStateError(f"sandbox {sid} was not started with default options")
        with self._joined(options, admitting, box):
            box.backend.update_limits(box, st, options)
            defaults = process_defaults(box.files, resolved, options)
            now = time.time()
            with self.states.lock:
                st = box.state
                if st.status != "running":  # the reaper or a heal got to it meanwhile
                    raise SandboxStateError(f"sandbox {sid} is {st.status}, not running")
                st = st.replace(ref=name, options=options, admitting=admitting, created=now, last_active=now,
                                env=defaults.env, cwd=defaults.cwd, uid=defaults.uid, gid=defaults.gid)
                self.states.write(st)
        box.receipt("create", ref=name, cpu=options.cpu, memory=options.memory, pids=options.pids,
                    disk=None, cpu_class=options.cpu_class, job=options.job, policy_version=None,
                    layer_digests=list(st.layer_digests), ready=True,
                    **({"waited_seconds": round(waited, 6)} if waited is not None else {}))
        return box

    async def _launch(self, resolved: Resolved, ref: str, options: SandboxOptions, *, admitting: bool,
                      inherited: Sequence[Mapping[str, Any]] = (), name: str | None = None,
                      sid: str | None = None) -> Sandbox:
        backend = self.backend(options.isolation)
        await backend.check(options, resolved, ref)
        self.layout  # noqa: B018  (the host's cgroups checked before anything is made)
        if options.network is not None:  # a refused rule leaves nothing behind, not even a receipt log
            await asyncio.to_thread(self.resources.networks.check, options.network,
                                    allow_protected=options.protected_egress)
        box = self._new_box(options, sid)
        with self._joined(options, admitting, box):
            now = time.time()
            state = SandboxState(
                id=box.id, status="creating", ref=name or ref, image_digest=resolved.digest, kind=resolved.kind,
                options=options, layer_digests=tuple(layer.digest for layer in resolved.layers), created=now,
                last_active=now, admitting=admitting,
                cgroups_path=self.resources.cgroups.acquire(box.id, cgroup_owner(options), options.memory),
                userns=self._user_range(box) if options.userns else None)
            self.states.write(state)  # first: a crash from here on is reconciled
        for rec in inherited:  # the history of the checkpoint this sandbox continues
            self.receipt_logs.append(box.id, {**rec, "inherited": True})
        try:
            fields = await backend.launch(box, resolved, ref)
        except BaseException:
            with contextlib.suppress(Exception):
                self.destroy(box.id)
            raise
        box.receipt("create" if resolved.kind != "checkpoint" else "restore", ref=name or ref, cpu=options.cpu,
                    memory=options.memory, pids=options.pids, disk=options.disk, cpu_class=options.cpu_class,
                    job=options.job, policy_version=options.policy_version,
                    layer_digests=builtins.list(state.layer_digests), **fields)
        return box

    def _new_box(self, options: SandboxOptions, sid: str | None = None) -> Sandbox:
        sid = new_sandbox_id() if sid is None else check_sandbox_id(sid)
        box = Sandbox(self, sid)
        self.paths.ensure()
        try:
            box.dir.mkdir(mode=0o700)  # the claim on the id: exclusive on this host
        except FileExistsError:
            raise SandboxStateError(f"sandbox {sid} already exists on this host") from None
        _in_flight(sid)
        return box

    def _user_range(self, box: Sandbox) -> tuple[int, int]:
        """The sandbox's own host uid range; every directory down to it made traversable for it."""
        try:
            mapping = self.resources.uids.acquire(box.id)
            # crun enters the user namespace before it mounts the rootfs: the sandbox's root
            # (an unprivileged host uid) must be able to traverse every directory to it
            for d in (self.data_dir, self.root, self.boxes, box.dir):
                d.chmod(d.stat().st_mode & 0o7777 | 0o001)
            return mapping
        except BaseException:
            self.resources.uids.release(box.id)
            shutil.rmtree(box.dir, ignore_errors=True)
            raise

    # -- the lazyfetch daemon died: restart what ran on it --------------------------------------------
    def heal(self) -> int:
        """Make sure a lazyfetch daemon serves running sandboxes; how many layers had to be re-stacked.

        A daemon that died is replaced and takes its kernel state over from the holder: the
        sandboxes' reads waited and go on, nothing is restarted (0).  Only when that state is
        lost too (the holder died, a new generation) are rootfs re-stacked and containers
        restarted (the container backend's remount hook).
        """
        if not any(st.live for st in self.list()):
            return 0
        health = self.host.client.health()
        if health is not None and not self.host.has_stale_layers(health["generation"]):
            return 0
        return self.host.remount()

    # -- jobs ---------------------------------------------------------------------------------------------
    def renew(self, job: str, ttl: float | None = None) -> dict[str, Any]:
        """Extend the lease of ``job``, which must have a sandbox here or be preempted
        (:class:`~sandbox.core.errors.JobNotFound` otherwise: there is nothing to keep alive)."""
        return self.leases.renew(job, ttl).view()

    def pause_job(self, job: str) -> builtins.list[str]:
        """Freeze every running sandbox of ``job`` (and reclaim their page cache)."""
        done = []
        for st in self.list(job=job):
            if st.status == "running":
                Sandbox(self, st.id).pause()
                done.append(st.id)
        return done

    def resume_job(self, job: str) -> builtins.list[str]:
        done = []
        for st in self.list(job=job):
            if st.status == "paused":
                Sandbox(self, st.id).resume()
                done.append(st.id)
        return done

    def reap(self, now: float | None = None, *, max_lifetime: float | None = None,
             only: Sequence[str] | None = None) -> dict[str, builtins.list[str]]:
        """Destroy sandboxes past their TTL or lease; pause those idle past their idle timeout.

        A running sandbox labelled ``ON_TTL_LABEL: pause`` is paused at its TTL instead, and its
        TTL moved to ``max_lifetime`` (the edge's; without one it is destroyed as any other): it
        waits paused for a resume until then.  ``only``: those sandboxes' TTL and idle timeout
        alone (the ones :attr:`deadlines` says are due), leases left to the next full round."""
        now = time.time() if now is None else now
        report: dict[str, builtins.list[str]] = {"destroyed": [], "paused": []}
        if only is not None:
            states = []
            for sid in only:
                with contextlib.suppress(SandboxNotFound, StateUnreadable):
                    states.append(self.states.read(sid))
            self._reap_states(states, now, set(), max_lifetime, report)
            acted = set(report["destroyed"]) | set(report["paused"])
            for st in states:  # not acted on (busy, or its ttl moved): its deadline again, not at once
                if st.id not in acted:
                    with contextlib.suppress(SandboxNotFound, StateUnreadable):
                        self.deadlines.note(self.states.read(st.id), if_past=now + ACTIVE_GRAIN)
            return report
        leases = self.leases.all()  # each lease read once; the sweep below rewrites only what changes
        expired_jobs = {lease.job for lease in leases if lease.expired(now)}
        states = self.list()
        self._reap_states(states, now, expired_jobs, max_lifetime, report)
        acted = set(report["destroyed"]) | set(report["paused"])
        for st in states:  # those due before the next round wake the reaper then
            if st.id not in acted:
                self.deadlines.note(st, if_past=now + ACTIVE_GRAIN)
        # sandboxes destroyed above (or by anyone) leave their leases; a lapsed lease with none goes
        def alive(sid: str) -> bool:
            return (self.boxes / sid).is_dir()

        self.leases.sweep(leases, now, alive=alive)
        expired = self.receipt_logs.expire(now, alive)  # logs of sandboxes gone for RETENTION
        if expired:
            log.info("reaper: removed the receipt logs of %d sandboxes destroyed long ago", len(expired))
        return report

    def _reap_states(self, states: Sequence[SandboxState], now: float, expired_jobs: set[str],
                     max_lifetime: float | None, report: dict[str, builtins.list[str]]) -> None:
        for st in states:
            opts = st.options
            try:
                if st.status in ("creating", "starting"):
                    continue
                if (opts.ttl is not None and now - st.created > opts.ttl) or st.job in expired_jobs:
                    if (st.job not in expired_jobs and st.status == "running" and max_lifetime is not None
                            and st.labels.get(ON_TTL_LABEL) == "pause" and now - st.created < max_lifetime):
                        # with the wait for a resume as its ttl (a second short of the maximum: the
                        # pause reads the clock again, later), in the write that says paused
                        Sandbox(self, st.id).pause(ttl=max(0.0, max_lifetime - (time.time() - st.created) - 1),
                                                   max_lifetime=max_lifetime)
                        report["paused"].append(st.id)
                        continue
                    self.destroy(st.id)
                    report["destroyed"].append(st.id)
                elif (opts.idle_timeout is not None and st.status == "running"
                      and now - st.last_active > opts.idle_timeout + ACTIVE_GRAIN and not self.inflight(st.id)):
                    Sandbox(self, st.id).pause()
                    report["paused"].append(st.id)
            except (SandboxError, MountError, OSError) as exc:  # one bad sandbox must not stop the reaper
                log.warning("reaper: sandbox %s: %s", st.id, exc)

    # -- destroy / reconcile ----------------------------------------------------------------------------
    def destroy(self, sid: str) -> None:
        """Stop the sandbox's processes and release everything it holds on this host; its state goes,
        its receipts stay (with a ``destroy`` record) for ``RETENTION``.  Idempotent."""
        box = Sandbox(self, sid)
        known = (box.dir / "state.json").exists()
        for hook in builtins.list(self.on_destroy):
            try:
                hook(sid)
            except Exception:  # a hook must not keep a sandbox alive
                log.exception("sandbox %s: a destroy hook failed; destroying it anyway", sid)
        self.execs.cancel(sid, "destroy")  # its running commands end with it, and their callers learn why
        try:
            st: SandboxState | None = box.state
        except (SandboxNotFound, StateUnreadable):
            st = None
        # its own backend; when the state is unknown, every backend takes back what it may have made
        for backend in [self.backend(st.options.isolation)] if st is not None else self.all_backends():
            backend.destroy(sid, st)
        self.resources.release(sid)
        if known:
            self.receipt_logs.append(sid, {"id": uuid.uuid4().hex[:16], "sandbox": sid, "action": "destroy",
                                           "time": time.time()})
        self.receipt_logs.forget(sid)  # the log is complete: nothing more is appended to it here
        self.states.remove(sid)
        shutil.rmtree(box.dir, ignore_errors=True)
        if st is not None and st.job is not None:  # after the directory: a lease never lists less than exists
            self.leases.leave(st.job, sid)
        if not self.holds_any():
            self.resources.cgroups.release_parent(lambda: not self.holds_any())

    def reconcile(self) -> dict[str, builtins.list[str]]:
        """After a crash: adopt sandboxes that still run, clean up everything else we own
        (:func:`sandbox.host.reconcile.reconcile`)."""
        return reconcile(self)

    def close(self, *, stop_daemon: bool = True) -> None:
        """Destroy every sandbox and release this host's layer mounts, the daemon too.

        A sandbox that cannot be destroyed does not stop the others or the release: the
        first such error is raised once everything else is done."""
        failed: builtins.list[Exception] = []
        for sid in self.ids():
            try:
                self.destroy(sid)
            except (SandboxError, LazyfetchError, OSError) as exc:
                log.error("close: destroying sandbox %s failed: %s", sid, exc)
                failed.append(exc)
        try:
            try:  # (a destroy releases them with the last sandbox; one that died before that left them)
                self.resources.cgroups.release_parent(lambda: not self.holds_any())
            except (SandboxError, OSError) as exc:
                log.warning("close: the cgroup parent and shared sysfs stay for the next reconcile: %s", exc)
            self.host.umount_all(stop_daemon=stop_daemon)
        finally:
            for backend in self.all_backends():
                backend.close()
        if failed:
            raise failed[0]


def _options(options: SandboxOptions | None, fields: Mapping[str, Any]) -> SandboxOptions:
    if options is not None and fields:
        raise TypeError(f"give a SandboxOptions or its fields, not both (got {sorted(fields)} too)")
    return options if options is not None else SandboxOptions(**fields)
