"""Preemption as one call per job, and resuming the job anywhere from its run manifest.

``preempt(job)`` stops admitting commands for the job's sandboxes, lets
in-flight commands finish within ``timeout`` (then kills them; their receipts
say ``interrupted: "preempt"``), checkpoints every sandbox, writes a run
manifest (schema ``layerbox.run.v1``, docs/FORMAT.md) to the store under
``runs/<job>``, and only then frees the host.  Until the manifest's ref has
moved nothing is destroyed, so a failure mid-way leaves the sandboxes
frozen out of admission but intact: call ``preempt`` again.

``resume_run(manifest)`` restores every sandbox on this host, checks that
each restored rootfs has exactly the layer digests and policy version the
manifest recorded, and only when all are up opens admission again.  A
failure destroys what it restored and leaves the manifest untouched.
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from layerstore.objects import SCHEMA_RUN
from sandbox.core.errors import InvalidField, SandboxError, SandboxStateError
from sandbox.core.model import SandboxOptions, check_job, project_namespace
from sandbox.host.manager import Sandbox, SandboxManager


class RunMismatch(SandboxError):
    """A restored sandbox does not match what its run manifest recorded."""


@dataclass
class Run:
    ref: str
    digest: str
    manifest: dict[str, Any]
    sandboxes: dict[str, str] = field(default_factory=dict)  # old id -> new id (resume) or checkpoint (preempt)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"ref": self.ref, "digest": self.digest, "sandboxes": self.sandboxes, "seconds": self.seconds,
                "manifest": self.manifest}


def run_ref(job: str) -> str:
    """Where a job's run manifest goes: ``projects/<project>/runs/<job>:latest`` for a job of the
    service (``<project>/<job>``), so one project can never move another's; ``runs/<job>:latest``
    for a host's own (CLI) jobs.  Job and project names have the ref grammar already."""
    project, _, name = job.rpartition("/")
    if project:
        return f"{project_namespace(project)}runs/{check_job(name)}:latest"
    return f"runs/{check_job(name)}:latest"


async def preempt(manager: SandboxManager, job: str, *, timeout: float = 30.0,  # noqa: ASYNC109 (grace for commands)
                  name: str | None = None) -> Run:
    started = time.perf_counter()
    boxes = [Sandbox(manager, st.id) for st in manager.list(job=job) if st.live]
    manager.leases.set_state(job, "draining")
    for box in boxes:
        box.update(admitting=False)
        box.receipt("preempt_requested", job=job, timeout=timeout)
    await _drain(manager, [b.id for b in boxes], timeout)

    entries: dict[str, Any] = {}
    for box in boxes:
        st = box.state
        # a microVM's memory too: its processes go on wherever the job resumes (a host of the
        # same QEMU and guest assets; elsewhere only its disk comes back)
        memory = box.backend.capabilities(st.options.isolation).has("memory_checkpoint")
        ckpt = await box.checkpoint(labels={"layerbox.job": job}, memory=memory)
        receipts = manager.verify_receipts(box.id)
        resolved_layers = await _layers_of(manager, ckpt.digest)
        entries[box.id] = {
            "checkpoint": ckpt.name, "checkpoint_digest": ckpt.digest,
            "image": st.ref, "image_digest": st.image_digest,
            "layer_digests": resolved_layers, "policy_version": st.policy_version,
            "trajectory_offset": receipts["records"], "last_receipt": receipts["last"],
            "labels": dict(st.labels), "options": st.options.to_json(), "was": st.status,
        }
    manifest = {"schema": SCHEMA_RUN, "job": job, "host": socket.gethostname(),
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "sandboxes": entries}
    ref = name or run_ref(job)
    async with await manager.open_store() as store, store.writer_lock("preempt"):
        digest = await store.put_doc(manifest)
        await store.set_ref(ref, digest, "run")
    # the manifest is durable: now the host can let go
    for box in boxes:
        await asyncio.to_thread(manager.destroy, box.id)
    manager.leases.set_state(job, "preempted", manifest=ref)
    return Run(ref, digest, manifest, {sid: e["checkpoint"] for sid, e in entries.items()},
               round(time.perf_counter() - started, 6))


async def _drain(manager: SandboxManager, sids: list[str], grace: float) -> None:
    deadline = time.monotonic() + grace
    # execs run in threads (and their state is the manager's): poll rather than wire events through
    while any(manager.inflight(s) for s in sids) and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.02)
    for sid in sids:
        manager.execs.cancel(sid, "preempt")
    # a cancelled exec is killed under the freezer and records its receipt within seconds
    kill_deadline = time.monotonic() + 30.0
    while any(manager.inflight(s) for s in sids):
        if time.monotonic() > kill_deadline:
            raise SandboxStateError(f"commands in {sids} did not stop within 30 s of being killed; "
                                    "the job stays drained: call preempt again")
        await asyncio.sleep(0.02)


async def _layers_of(manager: SandboxManager, digest: str) -> list[str]:
    async with await manager.open_store() as store:
        resolved = await store.resolve(digest)
    return [layer.digest for layer in resolved.layers]


async def resume_run(manager: SandboxManager, ref: str, *, job: str | None = None,
                     lease_ttl: float | None = None) -> Run:
    """Restore every sandbox of the run manifest ``ref`` on this host; admit commands once all are up."""
    started = time.perf_counter()
    async with await manager.open_store() as store:
        resolved = await store.resolve(ref, refresh=True)
    if resolved.kind != "run":
        raise SandboxError(f"{ref} is a {resolved.kind}, not a run manifest")
    manifest = dict(resolved.doc)
    job = job or manifest["job"]
    lease = manager.leases.get(job)
    if lease is not None and lease.state == "draining":
        raise SandboxStateError(f"job {job!r} is being preempted on this host; resume once that finished")
    for st in manager.list(job=job):  # left by a resume that died half-way: never admitted anything
        if not st.admitting:
            await asyncio.to_thread(manager.destroy, st.id)
    restored: list[Sandbox] = []
    mapping: dict[str, str] = {}
    try:
        for old, entry in sorted(manifest["sandboxes"].items()):
            options = _restore_options(entry, job, lease_ttl)
            box = await manager.restore(entry["checkpoint_digest"], options, admitting=False)
            restored.append(box)
            mapping[old] = box.id
            got = list(box.state.layer_digests)
            if got != entry["layer_digests"]:
                raise RunMismatch(f"{ref}: sandbox {old} restored with layers {got}, but the manifest "
                                  f"binds {entry['layer_digests']}")
            if entry.get("was") == "paused":
                await asyncio.to_thread(box.pause)
    except BaseException:
        for box in restored:
            await asyncio.to_thread(manager.destroy, box.id)
        raise
    manager.leases.set_state(job, "active")
    if restored:  # (each joined the lease already; a run of no sandboxes leaves none to renew)
        manager.leases.renew(job, lease_ttl)
    for box in restored:
        box.update(admitting=True)
        box.receipt("resumed", run=ref, run_digest=resolved.digest, job=job)
    return Run(ref, resolved.digest, manifest, mapping, round(time.perf_counter() - started, 6))


def _restore_options(entry: Any, job: str, lease_ttl: float | None) -> SandboxOptions:
    """A manifest entry's options, checked like a request (a manifest is input from the store)."""
    if not isinstance(entry, dict):
        raise InvalidField("manifest", f"a sandbox entry is {type(entry).__name__}, not an object")
    try:
        saved = SandboxOptions.from_state(entry.get("options") or {})
        return saved.replace(job=job, lease_ttl=lease_ttl if lease_ttl is not None else saved.lease_ttl,
                             labels=entry.get("labels") or saved.labels,
                             policy_version=entry.get("policy_version"))
    except InvalidField as exc:
        raise InvalidField(f"manifest.{exc.field}", exc.detail) from None
