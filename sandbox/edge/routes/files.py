"""A sandbox's files: ``GET|PUT|DELETE /v1/sandboxes/{id}/files?path=...`` (``&list=1``, ``&stat=1``,
``&mode=644``, ``&recursive=1``).

Reads and uploads stream (an upload has no limit but the sandbox's disk); the blocking work
runs on the edge's file executor, at most a few operations per project at once, so one
project cannot starve the others.  Paths resolve inside the sandbox (the backend's files API).
"""

from __future__ import annotations

import asyncio
import functools
import io
import stat
from collections.abc import Generator
from typing import cast

from aiohttp import web

from sandbox.core.sync import own_thread, wait_in_loop
from sandbox.edge.auth import Project
from sandbox.edge.context import EdgeContext, flag
from sandbox.edge.errors import invalid
from sandbox.host.sandbox import Sandbox


def setup(ctx: EdgeContext, app: web.Application) -> None:
    routes = Files(ctx)
    r = app.router
    r.add_get("/v1/sandboxes/{id}/files", routes.get)
    r.add_put("/v1/sandboxes/{id}/files", routes.put)
    r.add_delete("/v1/sandboxes/{id}/files", routes.delete)


class Files:
    def __init__(self, ctx: EdgeContext) -> None:
        self.ctx = ctx

    async def get(self, request: web.Request) -> web.StreamResponse:
        ctx = self.ctx
        project = ctx.project(request)
        box, _ = await ctx.sandbox(request, project)
        path = ctx.query_path(request)
        if flag(request, "list"):
            return web.json_response({"path": path, "entries": await ctx.files(project, lambda: box.list(path))})
        if flag(request, "stat"):
            st = await ctx.files(project, lambda: box.stat(path))
            kinds = {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "symlink"}
            return web.json_response({"path": path, "type": kinds.get(stat.S_IFMT(st.st_mode), "other"),
                                      "size": st.st_size, "mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid,
                                      "gid": st.st_gid, "mtime": st.st_mtime})
        with ctx.usage.take(project.name, "transfers"):  # for as long as the client reads
            return await self._download(request, project, box, path)

    async def _download(self, request: web.Request, project: Project, box: Sandbox, path: str) -> web.StreamResponse:
        ctx = self.ctx
        # opened (and checked to be a regular file) before the response starts, so errors are statuses
        reader = cast("Generator[bytes, None, None]",  # (a generator: close() releases its descriptor)
                      await ctx.files(project, lambda: box.files.iter_read(path)))
        first = await ctx.files(project, functools.partial(next, reader, b""))
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        total = len(first)
        try:
            if first:
                await resp.write(first)
            while chunk := await ctx.files(project, functools.partial(next, reader, b"")):
                total += len(chunk)
                await resp.write(chunk)
        finally:
            reader.close()
        await asyncio.to_thread(box.receipt, "download", path=path, bytes=total)
        await resp.write_eof()
        return resp

    async def put(self, request: web.Request) -> web.Response:
        ctx = self.ctx
        project = ctx.project(request)
        box, _ = await ctx.sandbox(request, project)
        path = ctx.query_path(request)
        text = request.query.get("mode", "644")
        try:
            mode = int(text, 8)
        except ValueError:
            raise invalid("mode", f"{text[:20]!r} is not octal, e.g. 644") from None
        if not 0 <= mode <= 0o777:  # no setuid, setgid or sticky bits through the API
            raise invalid("mode", f"{text[:20]!r}: permission bits only (0-777)")
        loop = asyncio.get_running_loop()
        content = request.content

        class Source(io.RawIOBase):  # the request body, read by the upload thread as it arrives
            def read(self, size: int = -1) -> bytes:
                n = size if size > 0 else 1 << 20
                return wait_in_loop(loop, content.read(n)) or b""

        # paced by its client: on a thread of its own, counted against the project's transfers
        with ctx.usage.take(project.name, "transfers"):
            written = await own_thread(lambda: box.upload(path, Source(), mode), name="layerbox-upload")
        return web.json_response({"path": path, "bytes": written}, status=201)

    async def delete(self, request: web.Request) -> web.Response:
        ctx = self.ctx
        project = ctx.project(request)
        box, _ = await ctx.sandbox(request, project)
        path = ctx.query_path(request)
        await ctx.files(project, lambda: box.remove(path, recursive=flag(request, "recursive")))
        return web.Response(status=204)
