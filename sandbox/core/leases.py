"""Leases: every sandbox of a job lives only while its caller keeps the job's lease fresh.

A crashed client stops renewing; the reaper then destroys the job's
sandboxes, so nothing leaks.  A lease also carries the job's admission
state, which preemption flips: ``active`` admits commands, ``draining``
refuses new ones while in-flight commands finish, ``preempted`` means the
job's sandboxes were checkpointed into a run manifest and freed.

The table is one small JSON file per host (``sandbox/leases.json``, a
host-state table of format ``layerbox.leases``), rewritten whole under an flock
so a CLI and the service on the same data dir never lose each other's updates.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from layerstore.hoststate import HostTable
from sandbox.core.errors import SandboxError

DEFAULT_LEASE_TTL = 300.0
STATES = ("active", "draining", "preempted")


@dataclass(frozen=True)
class Lease:
    job: str
    ttl: float  # seconds a renewal buys
    expires: float  # time.time() after which the reaper destroys the job's sandboxes
    state: str = "active"
    manifest: str | None = None  # the run manifest ref once preempted

    def expired(self, now: float | None = None) -> bool:
        # a preempted job has no sandboxes left to reap; its record stays for resume
        return self.state != "preempted" and (time.time() if now is None else now) > self.expires


class Leases:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.table = HostTable(self.path, "layerbox.leases", 1, upgrade=_unversioned_leases,
                               empty=lambda: {"leases": {}},
                               aside="and restart: the reaper then treats every job as unleased")

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        with self.table.locked() as body:
            yield body["leases"]

    def _read(self) -> dict[str, Any]:
        return dict(self.table.read()["leases"])

    def get(self, job: str) -> Lease | None:
        doc = self._read().get(job)
        return Lease(**doc) if doc else None

    def all(self) -> list[Lease]:
        return [Lease(**doc) for doc in self._read().values()]

    def renew(self, job: str, ttl: float | None = None, *, now: float | None = None) -> Lease:
        """Create or extend ``job``'s lease by ``ttl`` (default: the lease's own ttl)."""
        if not job or len(job) > 200:
            raise SandboxError(f"job id {job!r}: must be 1-200 characters")
        now = time.time() if now is None else now
        with self._locked() as table:
            old = Lease(**table[job]) if job in table else None
            span = float(ttl if ttl is not None else (old.ttl if old else DEFAULT_LEASE_TTL))
            if span <= 0:
                raise SandboxError(f"lease ttl for job {job!r} must be positive, not {span}")
            lease = replace(old, ttl=span, expires=now + span) if old else Lease(job, span, now + span)
            table[job] = asdict(lease)
            return lease

    def set_state(self, job: str, state: str, *, manifest: str | None = None) -> Lease:
        if state not in STATES:
            raise ValueError(f"lease state {state!r} is not one of {STATES}")
        with self._locked() as table:
            if job not in table:
                table[job] = asdict(Lease(job, DEFAULT_LEASE_TTL, time.time() + DEFAULT_LEASE_TTL))
            lease = replace(Lease(**table[job]), state=state, manifest=manifest)
            table[job] = asdict(lease)
            return lease

    def drop(self, job: str) -> None:
        with self._locked() as table:
            table.pop(job, None)


def _unversioned_leases(doc: dict[str, Any], version: int | None) -> dict[str, Any]:
    """leases.json before the envelope: job -> lease, the whole object."""
    if not all(isinstance(lease, dict) for lease in doc.values()):
        raise ValueError("not a map of job to lease")
    return {"leases": doc}
