"""Sandboxes paused into the store (E2B's ``pause`` with ``memory: false``, the SDK's
``mode="filesystem"``; and a VM's every pause): resumed by ``connect`` or ``resume`` on any
edge of the same store.

**Park.**  The sandbox is checkpointed (its files; a VM's RAM and devices too, so it goes on
with its processes; a container's processes are not carried) under
``projects/<project>/paused/<sandbox id>:latest``, with what E2B's get and list answer for it
(label ``layerbox.e2b.listed``, JSON), and destroyed here.  From then on it exists only in the
store: it holds nothing on any host, counts against no quota, and has no timeout (E2B keeps a
paused sandbox until it is resumed or killed).  Get and list on any edge read it from there;
kill deletes its ref.

**Wake.**  An edge that resumes it first claims it: it moves the ref, by compare-and-swap
from the checkpoint it read, to a copy of that checkpoint document marked
``layerbox.e2b.claim`` (the same layers, parent and attachments, so nothing the restore needs
becomes garbage).  Of edges racing, exactly one moves it; the others answer 409.  The winner
restores the copy with the sandbox's own id (:meth:`SandboxManager.restore` ``sid``), under
its project's quota and this host's admission, then deletes the ref; if the restore fails
the ref is moved back, so the sandbox stays paused.

Known gap: an edge that dies between its claim and the ref's deletion leaves the sandbox
claimed (409 on every resume) until the ref is deleted (kill, or ``DELETE
/v1/checkpoints/<ref>``): taking a claim over would need to know that its edge is gone.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from typing import Any

from layerstore.backend import PreconditionFailed
from layerstore.errors import LayerboxError
from layerstore.objects import resolve_document
from layerstore.store import RefState
from sandbox.core.errors import ApiError
from sandbox.core.model import project_namespace
from sandbox.edge.auth import Project
from sandbox.edge.context import EdgeContext
from sandbox.edge.routes.lifecycle import owned
from sandbox.host.sandbox import Sandbox

PAUSED = "paused/"  # under the project's namespace
LISTED_LABEL = "layerbox.e2b.listed"  # on the checkpoint: E2B's view of the sandbox when it was paused
CLAIM_LABEL = "layerbox.e2b.claim"  # on the claim's copy: which edge resumes it, since when


def paused_ref(project: Project, sid: str) -> str:
    return f"{project_namespace(project.name)}{PAUSED}{sid}:latest"


class Parked:
    """The sandboxes paused into the store, as one edge sees them (see the module's docstring)."""

    def __init__(self, ctx: EdgeContext) -> None:
        self.ctx = ctx

    async def park(self, box: Sandbox, project: Project, view: Mapping[str, Any], *, memory: bool = False) -> None:
        """Checkpoint ``box`` as paused (``view``: what get and list answer for it; ``memory``: a
        VM's RAM and devices too, so it resumes with its processes), then destroy it."""
        labels = {LISTED_LABEL: json.dumps({**view, "state": "paused"}, sort_keys=True)}
        await box.checkpoint(name=paused_ref(project, box.id), labels=labels, memory=memory)
        await asyncio.to_thread(self.ctx.manager.destroy, box.id)

    async def find(self, project: Project, sid: str) -> tuple[RefState, dict[str, Any]] | None:
        """The paused sandbox ``sid`` of ``project``'s (its ref and document), None when there is none."""
        async with await self.ctx.manager.open_store() as store:
            try:
                ref = await store.read_ref(paused_ref(project, sid))
                doc = await store.get_doc(ref.digest)
            except LayerboxError:
                return None
        return (ref, doc) if ref.kind == "checkpoint" and owned(project, doc) else None

    async def view(self, project: Project, sid: str) -> dict[str, Any] | None:
        found = await self.find(project, sid)
        return None if found is None else _view(found[1])

    async def views(self, project: Project) -> list[dict[str, Any]]:
        """What list answers for each of ``project``'s paused sandboxes."""
        async with await self.ctx.manager.open_store() as store:
            refs = [r for r in await store.list_refs(project_namespace(project.name) + PAUSED)
                    if r.kind == "checkpoint"]
            docs = await asyncio.gather(*(store.get_doc(r.digest) for r in refs), return_exceptions=True)
        out = [_view(doc) for doc in docs if isinstance(doc, dict) and owned(project, doc)]
        return [v for v in out if v is not None]

    async def drop(self, project: Project, sid: str) -> bool:
        """Kill a paused sandbox: delete its ref (False when there is none)."""
        if await self.find(project, sid) is None:
            return False
        async with await self.ctx.manager.open_store() as store:
            await store.delete_ref(paused_ref(project, sid))
        return True

    async def wake(self, project: Project, sid: str, ttl: float, labels: Mapping[str, str]) -> Sandbox | None:
        """Restore the paused sandbox ``sid`` here with its id (None when there is none): claimed
        first, quota and admission taken, ``ttl`` its lifetime, ``labels`` added to its own."""
        found = await self.find(project, sid)
        if found is None:
            return None
        ref, doc = found
        claim, copy = await self._claim(ref, doc, sid)
        try:
            resolved = resolve_document(claim, copy)
            base = await self.ctx.carried(resolved)
            options = self.ctx.options(project, {"ttl": ttl}, extra=(), base=base)
            options = options.replace(labels={**options.labels, **labels})
            async with self.ctx.admitted(project.name, project.max_sandboxes, [options]):
                box = await self.ctx.manager.restore(claim, options, name=ref.name, sid=sid)
        except BaseException:
            async with await self.ctx.manager.open_store() as store:  # still paused: give the claim back
                await store.set_ref(ref.name, ref.digest, "checkpoint", expect=claim)
            raise
        async with await self.ctx.manager.open_store() as store:
            await store.delete_ref(ref.name)
        return box

    async def _claim(self, ref: RefState, doc: Mapping[str, Any], sid: str) -> tuple[str, dict[str, Any]]:
        """Move the paused ref to a claimed copy of its checkpoint (the copy and its digest), or 409."""
        busy = ApiError(None, "conflict", f"sandbox {sid} is being resumed on another edge; retry shortly")
        labels = _labels(doc)
        if CLAIM_LABEL in labels:
            raise busy
        edge = self.ctx.admission.config.edge_id
        copy = {**doc, "labels": {**labels, CLAIM_LABEL: f"{edge} {time.time():.3f}"}}
        async with await self.ctx.manager.open_store() as store:
            digest = await store.put_doc(copy)
            try:
                await store.set_ref(ref.name, digest, "checkpoint", expect=ref.digest)
            except PreconditionFailed:
                raise busy from None
        return digest, copy


def _labels(doc: Mapping[str, Any]) -> Mapping[str, Any]:
    labels = doc.get("labels")
    return labels if isinstance(labels, Mapping) else {}


def _view(doc: Mapping[str, Any]) -> dict[str, Any] | None:
    try:
        view = json.loads(_labels(doc).get(LISTED_LABEL) or "null")
    except (ValueError, TypeError):
        return None
    if not isinstance(view, dict):
        return None
    return {**view, "state": "paused"}

