"""Leases: every sandbox of a job lives only while its caller keeps the job's lease fresh.

A crashed client stops renewing; the reaper then destroys the job's
sandboxes, so nothing leaks.  A lease also carries the job's admission
state, which preemption flips: ``active`` admits commands, ``draining``
refuses new ones while in-flight commands finish, ``preempted`` means the
job's sandboxes were checkpointed into a run manifest and freed.

A lease exists only for a job that exists on this host: one with a sandbox here (the lease
lists them: a create joins its sandbox, a destroy makes it leave), one being preempted, or
one preempted into a run manifest.  Renewing any other name is refused
(:class:`~sandbox.core.errors.JobNotFound`), and a project holds at most :data:`MAX_JOBS`
leases on one host (:class:`~sandbox.core.errors.TooManyJobs`).

One small file per job, ``sandbox/leases/<project>/<job>.json`` (``_host/<job>.json`` for a
job without a project: the CLI's), a host-state table of format ``layerbox.lease`` changed
under its project's lock ``leases/<project>/lock``: a renew reads and writes one small file,
whatever the number of jobs, and the reaper reads each lease once.  The one table of older
layerboxes (``sandbox/leases.json``) is read once and split (:meth:`Leases.migrate`).
docs/FORMAT.md, "Job leases".
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from layerstore.hoststate import HostStateError, HostTable, closed_dir, flocked
from sandbox.core.errors import InvalidField, JobNotAdmitting, JobNotFound, TooManyJobs
from sandbox.core.model import check_job, check_project

log = logging.getLogger("layerbox.sandbox")

DEFAULT_LEASE_TTL = 300.0
STATES = ("active", "draining", "preempted")
# Leases one project may hold on one host: a bound on what a renew, a create and the reaper read
# and write for it, far above what a real project runs on one host (a few hundred sandboxes).
MAX_JOBS = 1000
HOST_GROUP = "_host"  # the directory of jobs without a project ('_' is in no project name)
FORMAT, VERSION = "layerbox.lease", 1
SUFFIX = ".json"


@dataclass(frozen=True)
class Lease:
    job: str
    ttl: float  # seconds a renewal buys
    expires: float  # time.time() after which the reaper destroys the job's sandboxes
    state: str = "active"
    manifest: str | None = None  # the run manifest ref once preempted
    sandboxes: tuple[str, ...] = ()  # the job's sandboxes on this host

    def expired(self, now: float | None = None) -> bool:
        # a preempted job has no sandboxes left to reap; its record stays for resume
        return self.state != "preempted" and (time.time() if now is None else now) > self.expires

    @property
    def live(self) -> bool:
        """Whether its job exists here: it has a sandbox, is being preempted, or was preempted into
        a run manifest."""
        return bool(self.sandboxes) or self.state == "draining" or (
            self.state == "preempted" and self.manifest is not None)

    def view(self) -> dict[str, Any]:
        """What the API answers about it (its sandboxes are the host's bookkeeping)."""
        return {"job": self.job, "ttl": self.ttl, "expires": self.expires, "state": self.state,
                "manifest": self.manifest}

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "sandboxes": list(self.sandboxes)}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Lease:
        return cls(**{**doc, "sandboxes": tuple(doc.get("sandboxes") or ())})


def split_job(job: str) -> tuple[str, str]:
    """``(group, name)`` of a job as the manager keeps it (``<project>/<job>`` or ``<job>``),
    each checked against its grammar before it becomes a path."""
    project, _, name = job.rpartition("/")
    try:
        return (check_project(project, "job") if project else HOST_GROUP), check_job(name)
    except InvalidField:
        raise InvalidField("job", f"{job[:200]!r}: a job is <job> or <project>/<job>, each in its grammar "
                                  "(lowercase letters and digits, '.', '_' or '-' between them)") from None


class Leases:
    """The leases under ``directory`` (``sandbox/leases``); ``legacy`` is the one table older
    layerboxes kept (``sandbox/leases.json``), read once by :meth:`migrate`."""

    def __init__(self, directory: str | os.PathLike[str], *, legacy: str | os.PathLike[str] | None = None) -> None:
        self.dir = Path(directory)
        self.legacy = Path(legacy) if legacy is not None else None

    # -- files --------------------------------------------------------------------------------
    def _table(self, job: str) -> HostTable:
        group, name = split_job(job)
        project = self.dir / group
        return HostTable(project / (name + SUFFIX), FORMAT, VERSION, lock=project / "lock", drop_empty=True,
                         aside="and restart: the reaper then treats the job as unleased")

    @contextlib.contextmanager
    def _locked(self, job: str) -> Iterator[dict[str, Any]]:
        """The job's lease as a dict (empty: none; cleared: dropped) under its project's lock."""
        closed_dir(self.dir)
        with self._table(job).locked() as body:
            yield body

    def get(self, job: str) -> Lease | None:
        body = self._table(job).read()
        return Lease.from_json(body) if body else None

    def all(self) -> list[Lease]:
        """Every lease, each file read once; one that cannot be read is logged and skipped (it
        stops only its own job's reaping)."""
        out = []
        for group in self._groups():
            for name in self._names(group):
                table = HostTable(group / name, FORMAT, VERSION)
                try:
                    body = table.read()
                except HostStateError as exc:
                    log.warning("%s", exc)
                    continue
                if body:
                    out.append(Lease.from_json(body))
        return out

    def _groups(self) -> list[Path]:
        try:
            return [p for p in self.dir.iterdir() if p.is_dir()]
        except FileNotFoundError:
            return []

    @staticmethod
    def _names(group: Path) -> list[str]:
        return [n for n in os.listdir(group) if n.endswith(SUFFIX)]

    # -- changes ------------------------------------------------------------------------------
    def renew(self, job: str, ttl: float | None = None, *, now: float | None = None) -> Lease:
        """Extend ``job``'s lease by ``ttl`` (default: the lease's own ttl); a job with no lease, or
        none of whose sandboxes is left, has nothing to renew (:class:`JobNotFound`)."""
        now = time.time() if now is None else now
        with self._locked(job) as body:
            old = Lease.from_json(body) if body else None
            if old is None or not old.live:
                raise JobNotFound(f"job {job!r} has no sandbox on this host and is not preempted: there is no "
                                  "lease to renew (a create or restore with this job makes one)")
            span = _span(job, ttl, old)
            lease = replace(old, ttl=span, expires=now + span)
            body.update(lease.to_json())
            return lease

    def join(self, job: str, sid: str, ttl: float | None = None, *, admitting: bool = True,
             now: float | None = None) -> Lease:
        """``sid`` becomes one of ``job``'s sandboxes here and the lease is renewed; the first one
        makes the lease, within :data:`MAX_JOBS` of its project.  A job being preempted or preempted
        admits no sandbox that would take commands (``admitting``): :class:`JobNotAdmitting`."""
        now = time.time() if now is None else now
        with self._locked(job) as body:
            old = Lease.from_json(body) if body else None
            if old is None:
                self._check_room(job)
            elif old.state != "active" and admitting:
                raise JobNotAdmitting(f"job {job!r} is {old.state}; resume its run manifest first")
            span = _span(job, ttl, old)
            base = old or Lease(job, span, now + span)
            lease = replace(base, ttl=span, expires=now + span,
                            sandboxes=(*base.sandboxes, sid) if sid not in base.sandboxes else base.sandboxes)
            body.update(lease.to_json())
            return lease

    def _check_room(self, job: str) -> None:
        group = self._table(job).path.parent
        held = len(self._names(group)) if group.is_dir() else 0
        if held >= MAX_JOBS:
            project = group.name if group.name != HOST_GROUP else "this host's own jobs"
            raise TooManyJobs(f"job {job!r}: project {project} holds {held} job leases on this host, the most "
                              f"it may (MAX_JOBS = {MAX_JOBS}); {TooManyJobs.fix}")

    def leave(self, job: str, sid: str) -> None:
        """``sid`` is gone; the lease stays until the reaper finds it lapsed."""
        with self._locked(job) as body:
            if body and sid in body.get("sandboxes", ()):
                body["sandboxes"] = [s for s in body["sandboxes"] if s != sid]

    def set_state(self, job: str, state: str, *, manifest: str | None = None) -> Lease:
        if state not in STATES:
            raise ValueError(f"lease state {state!r} is not one of {STATES}")
        with self._locked(job) as body:
            old = Lease.from_json(body) if body else Lease(job, DEFAULT_LEASE_TTL, time.time() + DEFAULT_LEASE_TTL)
            lease = replace(old, state=state, manifest=manifest)
            body.update(lease.to_json())
            return lease

    def drop(self, job: str) -> None:
        with self._locked(job) as body:
            body.clear()

    def sweep(self, leases: Sequence[Lease], now: float, alive: Callable[[str], bool]) -> list[str]:
        """What the reaper does once per round, one file per lease of ``leases`` (read by
        :meth:`all`): sandboxes ``alive`` says are gone leave, and a lapsed lease left with none
        (and not preempted) is dropped.  Each change is decided again under the lock (a create may
        have joined meanwhile).  Returns the jobs dropped."""
        dropped = []
        for seen in leases:
            gone = [sid for sid in seen.sandboxes if not alive(sid)]
            if not gone and not (seen.expired(now) and not seen.sandboxes):
                continue
            with self._locked(seen.job) as body:
                if not body:
                    continue
                body["sandboxes"] = [s for s in body.get("sandboxes", ()) if s not in gone]
                lease = Lease.from_json(body)
                if lease.expired(now) and not lease.sandboxes:
                    body.clear()
                    dropped.append(seen.job)
        return dropped

    # -- the table of older layerboxes ------------------------------------------------------------
    def migrate(self, members: Callable[[], Mapping[str, Sequence[str]]]) -> int:
        """Split ``leases.json`` into one file per job, once: the jobs that exist (``members``: each
        job's sandboxes on this host, asked only when there is a table to split) or are being or
        were preempted; a lease of any other name is not carried over.  A job that has a file
        already keeps it (a split a crash cut short is done again).  Returns the leases written."""
        if self.legacy is None:
            return 0
        lock, tmp = (self.legacy.with_name(self.legacy.name + end) for end in (".lock", ".tmp"))
        if not self.legacy.exists():
            _remove(lock, tmp)  # an older layerbox's, left behind: nothing takes them any more
            return 0
        with flocked(lock):
            if not self.legacy.exists():  # another process split it while this one waited
                return 0
            table = HostTable(self.legacy, "layerbox.leases", 1, upgrade=_unversioned_leases,
                              empty=lambda: {"leases": {}})
            written = self._split(table.read()["leases"], members())
            self.legacy.unlink()  # last: until here a crash leaves the table, and the split is redone
            # (a waiter on the lock finds the table gone; a new opener makes a lock of its own)
            _remove(lock, tmp)
        return written

    def _split(self, old: Mapping[str, Any], members: Mapping[str, Sequence[str]]) -> int:
        written = 0
        for job, doc in old.items():
            try:
                lease = replace(Lease.from_json(doc), job=job, sandboxes=tuple(members.get(job, ())))
                with self._locked(job) as body:
                    if body or not lease.live:
                        continue
                    body.update(lease.to_json())
                    written += 1
            except (InvalidField, TypeError, ValueError) as exc:
                log.warning("leases.json: the lease of job %r is not carried over (%s)", job[:200], exc)
        return written


def _remove(*paths: Path) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _span(job: str, ttl: float | None, old: Lease | None) -> float:
    span = float(ttl if ttl is not None else (old.ttl if old else DEFAULT_LEASE_TTL))
    if span <= 0:
        raise InvalidField("ttl", f"lease ttl for job {job!r} must be positive, not {span}")
    return span


def _unversioned_leases(doc: dict[str, Any], version: int | None) -> dict[str, Any]:
    """leases.json before the envelope: job -> lease, the whole object."""
    if not all(isinstance(lease, dict) for lease in doc.values()):
        raise ValueError("not a map of job to lease")
    return {"leases": doc}
