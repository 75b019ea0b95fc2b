"""Fork and lifecycle control on the edge service: fork a sandbox, give a running one another
ttl, read its metrics, list and delete the project's checkpoints.

Routes (registered by :meth:`SandboxService.app` through :func:`add_routes`)::

    POST   /v1/sandboxes/{id}/fork     {"count": n, ...options}  n sandboxes continuing from this one
    POST   /v1/sandboxes/{id}/ttl      {"ttl": seconds}          destroyed that many seconds from now
    GET    /v1/sandboxes/{id}/metrics                             CPU, memory, pids, disk, commands
    GET    /v1/checkpoints                                        the project's checkpoints
    DELETE /v1/checkpoints/{name}                                 drop one's ref (gc does the rest)

Ownership is the service's (docs/SECURITY.md, "Tenancy"): a sandbox through
``SandboxService._box`` (another project's id answers 404), a checkpoint by its
document's ``layerbox.project`` label under the project's ref namespace
``projects/<project>/`` (another project's name answers 404 as a missing one does).
Every field is validated in :mod:`sandbox.core.model` first (400 naming it).

A fork is one checkpoint restored ``count`` times on this edge
(:meth:`sandbox.host.manager.Sandbox.fork`): quota and admission are taken for all of
them before the checkpoint (as a run resume does), and either every fork is
running when the answer comes or none is left.  The forks start with the
source's options (env, workdir, user, limits, labels, network, policy version;
what the request gives goes over them) and its files as they were at the
checkpoint; processes are not carried.  The checkpoint is an ordinary one of the
project: listed by ``GET /v1/checkpoints``, restorable again, deletable.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from layerstore.errors import LayerboxError
from layerstore.objects import BadName, parse_ref
from sandbox.core.errors import InvalidField, SandboxError
from sandbox.core.model import (
    MAX_REF_NAME,
    PROJECT_LABEL,
    RESERVED_LABEL_PREFIX,
    SandboxOptions,
    SandboxState,
    check_object,
    check_str,
    project_namespace,
)
from sandbox.edge.app import ApiError, Project, SandboxService, _view
from sandbox.host.manager import Sandbox, SandboxManager
from sandbox.isolation import disk as sbdisk

MAX_WALK = 200_000  # entries of an upper directory counted for its disk use; past it the figure is partial


def add_routes(service: SandboxService, router: web.UrlDispatcher) -> None:
    routes = Lifecycle(service)
    router.add_post("/v1/sandboxes/{id}/fork", routes.fork)
    router.add_post("/v1/sandboxes/{id}/ttl", routes.set_ttl)
    router.add_get("/v1/sandboxes/{id}/metrics", routes.metrics)
    router.add_get("/v1/checkpoints", routes.checkpoints)
    router.add_delete("/v1/checkpoints/{name:.+}", routes.delete_checkpoint)


class Lifecycle:
    """The handlers, over one service (its auth, ownership checks, quota and admission)."""

    def __init__(self, service: SandboxService) -> None:
        self.service = service

    async def fork(self, request: web.Request) -> web.Response:
        svc = self.service
        project = svc._project(request)
        box, state = await svc._box(request, project)
        extra = ("count",)
        body = check_object("", await svc._json(request), (*SandboxOptions.CLIENT_FIELDS, *extra))
        count = svc.maxima.check_count(1 if body.get("count") is None else body["count"])
        SandboxOptions.from_json(body, extra=extra)  # every field checked before anything is taken
        if not state.live:
            raise ApiError(409, "conflict", f"sandbox {box.id} is {state.status}: only a running or paused "
                                            "sandbox can be forked")
        base = SandboxOptions.from_state(state.options.carried()).replace(policy_version=state.policy_version)
        options = svc._options(project, body, extra=extra, base=base)

        async def start() -> dict[str, Any]:
            ckpt, forks = await box.fork(count, options)
            return {"source": box.id, "checkpoint": ckpt.to_json(), "sandboxes": await views(forks)}

        return await svc._launch(project, [options] * count, start)

    async def set_ttl(self, request: web.Request) -> web.Response:
        svc = self.service
        box, _ = await svc._box(request, svc._project(request))
        body = check_object("", await svc._json(request), ("ttl",))
        if body.get("ttl") is None:
            raise InvalidField("ttl", "is required: the seconds from now after which the sandbox is destroyed")
        seconds = svc.maxima.check_ttl(body["ttl"])
        state = await asyncio.to_thread(box.set_ttl, seconds, max_lifetime=svc.maxima.ttl)
        return web.json_response(_view(state))

    async def metrics(self, request: web.Request) -> web.Response:
        svc = self.service
        box, state = await svc._box(request, svc._project(request))
        return web.json_response(await asyncio.to_thread(usage, svc.manager, box, state))

    async def checkpoints(self, request: web.Request) -> web.Response:
        project = self.service._project(request)
        if request.query:
            key = next(iter(request.query))
            raise InvalidField(key[:64], "unknown query parameter (this listing takes none)")
        prefix = project_namespace(project.name)
        async with await self.service.manager._store() as store:
            refs = [r for r in await store.list_refs(prefix) if r.kind == "checkpoint"]
            docs = await asyncio.gather(*(store.get_doc(r.digest) for r in refs), return_exceptions=True)
        out = [describe(ref.name, ref.digest, doc) for ref, doc in zip(refs, docs, strict=True)
               if isinstance(doc, dict) and owned(project, doc)]
        return web.json_response({"checkpoints": sorted(out, key=lambda c: (str(c["created"]), c["name"]))})

    async def delete_checkpoint(self, request: web.Request) -> web.Response:
        """Drop the ref; gc deletes what nothing else reaches (a sandbox running on it keeps its
        mounted layers; a run manifest naming it keeps it alive in the store)."""
        project = self.service._project(request)
        name = check_str("name", request.match_info["name"], max_len=MAX_REF_NAME + 256,
                         what="a checkpoint's ref name (as GET /v1/checkpoints lists it)")
        try:
            parse_ref(name)
        except BadName as exc:
            raise InvalidField("name", str(exc)) from None
        not_found = ApiError(404, "checkpoint_not_found", f"no checkpoint {name!r} in project {project.name!r}")
        if not name.startswith(project_namespace(project.name)):
            raise not_found
        async with await self.service.manager._store() as store:
            try:
                ref = await store.read_ref(name)
                doc = await store.get_doc(ref.digest)
            except LayerboxError:
                raise not_found from None
            if ref.kind != "checkpoint" or not owned(project, doc):
                raise not_found
            await store.delete_ref(name)
        return web.Response(status=204)


async def views(boxes: list[Sandbox]) -> list[dict[str, Any]]:
    return await asyncio.to_thread(lambda: [_view(b.state) for b in boxes])


def owned(project: Project, doc: dict[str, Any]) -> bool:
    """A checkpoint document of ``project``'s (its sandbox's project label), shared or not."""
    labels = doc.get("labels")
    return isinstance(labels, dict) and labels.get(PROJECT_LABEL) == project.name


def describe(name: str, digest: str, doc: dict[str, Any]) -> dict[str, Any]:
    labels, bound, stats = (_object(doc, k) for k in ("labels", "bound", "stats"))
    return {"name": name, "digest": digest, "created": doc.get("created"), "parent": doc.get("parent"),
            "base": doc.get("base"), "layers": len(doc.get("layers") or []),
            "labels": {k: v for k, v in labels.items() if not str(k).startswith(RESERVED_LABEL_PREFIX)},
            "shared": labels.get("layerbox.shared") == "true", "policy_version": bound.get("policy_version"),
            "bytes_changed": stats.get("bytes_changed")}


def _object(doc: dict[str, Any], key: str) -> dict[str, Any]:
    value = doc.get(key)
    return value if isinstance(value, dict) else {}


# -- metrics ------------------------------------------------------------------------------------------
def usage(manager: SandboxManager, box: Sandbox, st: SandboxState) -> dict[str, Any]:
    """What the sandbox uses now: its cgroup's CPU seconds, memory (now and peak), pids; the bytes
    its writes take (its own disk, or its upper directory on the data dir); and the resources its
    commands' receipts recorded (sandbox.core.receipts)."""
    layout, cg = manager.layout, st.cgroups_path
    commands = [r for r in manager.receipts(box.id) if r.get("action") == "exec" and not r.get("inherited")]
    spent = [float(c) for r in commands if isinstance(r.get("resources"), dict)
             and isinstance(c := r["resources"].get("cpu_seconds"), (int, float))]
    last = commands[-1] if commands else None
    memory: dict[str, Any] = {"current": layout.memory_current(cg), "peak": layout.memory_peak(cg),
                              "limit": st.options.memory}
    if st.options.is_vm:
        memory["guest"] = guest_memory(box, st)  # the VMM's cgroup above is the host's side
    return {
        "sandbox": box.id, "status": st.status, "time": time.time(),
        "cpu_seconds": layout.cpu_seconds(cg),
        "memory": memory,
        "pids": {"current": layout.pids_current(cg), "limit": st.options.pids},
        "disk": disk_usage(manager, box, st),
        "commands": {"count": len(commands), "cpu_seconds": round(sum(spent), 6),
                     "last": None if last is None else {
                         "command": last.get("command"), "exit_code": last.get("exit_code"),
                         "time": last.get("time"), "duration": last.get("duration"),
                         "resources": last.get("resources")}},
    }


def guest_memory(box: Sandbox, st: SandboxState) -> dict[str, int] | None:
    """A running microVM's own view (its /proc/meminfo: total, available, and used = the difference;
    with free-page reporting, what it frees goes back to the host); None when it does not run."""
    if st.status != "running":
        return None
    try:
        text = box.files.read("/proc/meminfo").decode(errors="replace")
    except (OSError, SandboxError):
        return None
    kb = {k: int(v.split()[0]) * 1024 for k, _, v in (ln.partition(":") for ln in text.splitlines())
          if v.strip() and v.split()[0].isdigit()}
    if "MemTotal" not in kb or "MemAvailable" not in kb:
        return None
    return {"total": kb["MemTotal"], "available": kb["MemAvailable"], "used": kb["MemTotal"] - kb["MemAvailable"]}


def disk_usage(manager: SandboxManager, box: Sandbox, st: SandboxState) -> dict[str, Any]:
    """``used`` bytes of the sandbox's writes: its ext4's used blocks with a disk limit, else the
    blocks its upper directory's entries hold (``partial`` past MAX_WALK entries); a microVM's,
    what its qcow2 holds on the host."""
    if st.options.is_vm and st.vm is not None:
        try:
            held = sum(f.stat().st_blocks * 512 for f in (box.dir / "vm").glob("disk*.qcow2"))
        except OSError:
            held = None
        return {"where": "vm-disk", "used": held, "free": None, "limit": int(st.vm["shape"]["disk"]),
                "partial": False}
    if st.options.disk is not None:
        got = sbdisk.usage(box.dir / "disk")
        if got is not None:
            return {"where": "disk", "used": got["size"] - got["free"], "free": got["free"],
                    "limit": st.options.disk, "partial": False}
    record = manager.host.status()["mounts"].get(str(box.rootfs)) or {}
    upper = record.get("upper")
    if not upper:
        return {"where": "upper", "used": None, "free": None, "limit": None, "partial": False}
    used, partial = tree_bytes(Path(upper))
    return {"where": "upper", "used": used, "free": None, "limit": None, "partial": partial}


def tree_bytes(root: Path, limit: int = MAX_WALK) -> tuple[int, bool]:
    """Bytes allocated to the entries below ``root`` (hard links once, symlinks never followed),
    and whether the walk stopped at ``limit`` entries."""
    total, seen, entries = 0, set(), 0
    stack = [os.fsencode(root)]
    while stack:
        try:
            it = os.scandir(stack.pop())
        except OSError:  # removed meanwhile, or not a directory any more: the sandbox writes it
            continue
        with it:
            for entry in it:
                entries += 1
                if entries > limit:
                    return total, True
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if st.st_nlink > 1 and not entry.is_dir(follow_symlinks=False):
                    if st.st_ino in seen:
                        continue
                    seen.add(st.st_ino)
                total += st.st_blocks * 512
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
    return total, False
