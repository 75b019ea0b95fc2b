"""Client SDK for the sandbox service, shaped like E2B's: an async core and a thin sync wrapper.

::

    async with await AsyncSandbox.create("img/python", url=URL, token=TOKEN) as sb:
        r = await sb.commands.run("python3 -c 'print(1)'", on_stdout=print)
        await sb.files.write("/root/a.txt", "hi")

    with Sandbox.create("img/python", url=URL, token=TOKEN) as sb:   # same API, blocking
        sb.commands.run("echo hi").stdout

:class:`Sandbox` drives an :class:`AsyncSandbox` on its own private event loop,
so there is one implementation; do not use it from inside a running loop.
Leaving either ``with`` block kills the sandbox.

Errors: every failure the service reports is an :class:`ApiError` (a
:class:`SandboxError`) with ``status``, ``code`` and ``retryable``; the leaves
:class:`AuthError`, :class:`NotFound` and :class:`QuotaExceeded` subclass the
builtins callers already catch.  Asking for isolation this service does not
provide raises :class:`UnsupportedIsolation` before any request is sent.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import json
import os
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, BinaryIO, Literal, TypeVar, overload

import aiofiles
import aiohttp

from sandbox.errors import SandboxError
from sandbox.model import SandboxOptions, check_labels

T = TypeVar("T")

SUPPORTED_ISOLATION = ("container",)


# -- errors ---------------------------------------------------------------------------------------------
class UnsupportedIsolation(SandboxError, ValueError):
    """The requested isolation level is not one this service provides (it never downgrades silently)."""


class ApiError(SandboxError):
    """The service answered with an error; ``code`` and ``retryable`` come from its body."""

    def __init__(self, status: int, code: str, message: str, *, retryable: bool = False) -> None:
        super().__init__(f"{message} (HTTP {status}, {code})")
        self.status, self.code, self.retryable = status, code, retryable


class AuthError(ApiError, PermissionError):
    """401/403: a missing, unknown or disabled token."""


class NotFound(ApiError, LookupError):
    """404: no such sandbox (or file) visible to this token's project."""


class QuotaExceeded(ApiError):
    """429: the project's sandbox quota is used up; retry after destroying one or later."""


def _error(status: int, body: bytes) -> ApiError:
    try:
        err = json.loads(body)["error"]
        code, message, retryable = str(err["code"]), str(err["message"]), bool(err.get("retryable"))
    except (ValueError, KeyError, TypeError):
        code, message, retryable = "http", body.decode(errors="replace")[:500] or "no body", status >= 500
    cls = {401: AuthError, 403: AuthError, 404: NotFound, 429: QuotaExceeded}.get(status, ApiError)
    return cls(status, code, message, retryable=retryable)


# -- results ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CommandResult:
    exit_code: int | None
    stdout: str
    stderr: str
    signal: int | None = None
    truncated: bool = False  # output past output_cap was dropped (stdout/stderr hold the first output_cap bytes)
    duration: float = 0.0
    timed_out: bool = False
    oom_killed: bool = False
    interrupted: str | None = None  # "preempt", "disconnect", "shutdown", "restart": stopped early
    replayed: bool = False  # an earlier run under the same idempotency key answered


# -- async core ---------------------------------------------------------------------------------------
class _Client:
    """One HTTP session against one service with one token."""

    def __init__(self, url: str, token: str) -> None:
        self.url = url.rstrip("/")
        self.session = aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"})

    async def request(self, method: str, path: str, *, json_body: Any = None, data: bytes | None = None,
                      params: Mapping[str, str] | None = None) -> bytes:
        async with self.session.request(method, self.url + path, json=json_body, data=data, params=params) as r:
            body = await r.read()
            if r.status >= 400:
                raise _error(r.status, body)
            return body

    async def json(self, method: str, path: str, **kw: Any) -> Any:
        body = await self.request(method, path, **kw)
        return json.loads(body) if body else None

    async def close(self) -> None:
        await self.session.close()


class AsyncCommands:
    def __init__(self, sb: AsyncSandbox) -> None:
        self._sb = sb

    # timeout is the command's limit, enforced by the service (not a client-side wait)
    async def run(self, cmd: str | Sequence[str], *, on_stdout: Callable[[str], Any] | None = None,
                  on_stderr: Callable[[str], Any] | None = None,
                  timeout: float | None = None,  # noqa: ASYNC109
                  env: Mapping[str, str] | None = None, cwd: str | None = None, stdin: bytes | str | None = None,
                  output_cap: int | None = None, idempotency_key: str | None = None) -> CommandResult:
        """Run ``cmd`` (a string goes through ``/bin/sh -c``); callbacks get decoded output as it arrives.

        A non-zero exit is reported in ``exit_code``, not raised; a ``timeout``
        kills the command tree and sets ``timed_out``.  With an
        ``idempotency_key``, retrying (also after a preempted job was resumed
        elsewhere) returns the first run's result instead of running again.
        Leaving the stream early (cancelling this coroutine) kills the command.
        """
        body: dict[str, Any] = {"cmd": cmd if isinstance(cmd, str) else list(cmd), "timeout": timeout,
                                "env": dict(env) if env else None, "cwd": cwd, "output_cap": output_cap,
                                "idempotency_key": idempotency_key}
        if stdin is not None:
            raw = stdin.encode() if isinstance(stdin, str) else stdin
            body["stdin"] = base64.b64encode(raw).decode()
        client = self._sb._client
        out = {"stdout": bytearray(), "stderr": bytearray()}
        decoders = {k: codecs.getincrementaldecoder("utf-8")(errors="replace") for k in out}
        callbacks = {"stdout": on_stdout, "stderr": on_stderr}
        final: dict[str, Any] | None = None
        async with client.session.post(f"{client.url}/v1/sandboxes/{self._sb.sandbox_id}/exec", json=body,
                                       timeout=aiohttp.ClientTimeout(total=None)) as r:
            if r.status >= 400:
                raise _error(r.status, await r.read())
            async for line in r.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                kind = event.get("type")
                if kind in out:
                    data = base64.b64decode(event["data"])
                    out[kind] += data
                    cb = callbacks[kind]
                    if cb is not None:
                        text = decoders[kind].decode(data)
                        if text:
                            cb(text)
                else:
                    final = event
        if final is None:
            raise ApiError(502, "stream_ended", "exec stream ended without an exit event", retryable=True)
        if final.get("type") == "error":
            err = final.get("error") or {}
            raise ApiError(500, str(err.get("code", "exec_failed")), str(err.get("message", "exec failed")),
                           retryable=bool(err.get("retryable")))
        for kind, cb in callbacks.items():
            tail = decoders[kind].decode(b"", final=True)
            if cb is not None and tail:
                cb(tail)
        # server-side truncation applies to the result; the stream already carried everything
        return CommandResult(final["exit_code"], out["stdout"].decode(errors="replace"),
                             out["stderr"].decode(errors="replace"), final.get("signal"),
                             bool(final.get("truncated")), float(final.get("duration") or 0.0),
                             bool(final.get("timed_out")), bool(final.get("oom_killed")), final.get("interrupted"),
                             bool(final.get("replayed")))


class AsyncFiles:
    def __init__(self, sb: AsyncSandbox) -> None:
        self._sb = sb

    @property
    def _base(self) -> str:
        return f"/v1/sandboxes/{self._sb.sandbox_id}/files"

    @overload
    async def read(self, path: str, *, format: Literal["text"] = "text") -> str: ...
    @overload
    async def read(self, path: str, *, format: Literal["bytes"]) -> bytes: ...

    async def read(self, path: str, *, format: Literal["text", "bytes"] = "text") -> str | bytes:
        data = await self._sb._client.request("GET", self._base, params={"path": path})
        return data if format == "bytes" else data.decode()

    async def write(self, path: str, data: str | bytes, *, mode: int = 0o644) -> None:
        raw = data.encode() if isinstance(data, str) else data
        await self._sb._client.request("PUT", self._base, data=raw, params={"path": path, "mode": f"{mode:o}"})

    async def upload(self, path: str, src: str | os.PathLike[str] | BinaryIO, *, mode: int = 0o644) -> int:
        """Stream a local file (a path or a binary file object) of any size into the sandbox."""
        params = {"path": path, "mode": f"{mode:o}"}
        if isinstance(src, (str, os.PathLike)):
            async with aiofiles.open(src, "rb") as f:
                async def chunks() -> AsyncIterator[bytes]:
                    while data := await f.read(1 << 20):
                        yield data
                doc = await self._sb._client.json("PUT", self._base, data=chunks(), params=params)
        else:
            doc = await self._sb._client.json("PUT", self._base, data=src, params=params)  # aiohttp streams it
        return int(doc["bytes"])

    async def download(self, path: str, dst: str | os.PathLike[str] | BinaryIO) -> int:
        """Stream a sandbox file of any size to a local path or binary file object."""
        client = self._sb._client
        total = 0
        async with client.session.get(client.url + self._base, params={"path": path},
                                      timeout=aiohttp.ClientTimeout(total=None)) as r:
            if r.status >= 400:
                raise _error(r.status, await r.read())
            if isinstance(dst, (str, os.PathLike)):
                async with aiofiles.open(dst, "wb") as f:
                    async for chunk in r.content.iter_chunked(1 << 20):
                        await f.write(chunk)
                        total += len(chunk)
            else:
                async for chunk in r.content.iter_chunked(1 << 20):
                    dst.write(chunk)
                    total += len(chunk)
        return total

    async def stat(self, path: str) -> dict[str, Any]:
        """type, size, mode, uid, gid, mtime of one entry (a symlink is reported, not followed)."""
        return dict(await self._sb._client.json("GET", self._base, params={"path": path, "stat": "1"}))

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
        except NotFound:
            return False
        return True

    async def list(self, path: str = "/") -> list[dict[str, Any]]:
        doc = await self._sb._client.json("GET", self._base, params={"path": path, "list": "1"})
        return list(doc["entries"])

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self._sb._client.request("DELETE", self._base,
                                       params={"path": path, "recursive": "1" if recursive else "0"})


def _options_body(options: SandboxOptions | None, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON fields of a create: validated by the same model the service uses; unset ones left
    out so the service's defaults apply (its lease ttl, for one)."""
    if options is not None and fields:
        raise TypeError(f"give options or its fields, not both (got {sorted(fields)} too)")
    opts = options if options is not None else SandboxOptions(**fields)
    check_labels("labels", opts.labels, reserved_ok=False)
    given = set(fields) if options is None else {k for k, v in opts.to_json().items() if v is not None}
    return {k: v for k, v in opts.to_json().items() if k in given and v is not None}


def _check_isolation(isolation: str) -> None:
    if isolation not in SUPPORTED_ISOLATION:
        raise UnsupportedIsolation(
            f"isolation={isolation!r} is not available: layerbox runs sandboxes as crun containers "
            f"(supported: {', '.join(SUPPORTED_ISOLATION)}); it never falls back silently, so pass "
            f"isolation='container' if container isolation is acceptable")


class AsyncSandbox:
    """A sandbox on a layerbox service; get one with :meth:`create` or :meth:`connect`."""

    def __init__(self, client: _Client, info: dict[str, Any]) -> None:
        self._client = client
        self.info = info
        self.sandbox_id: str = info["id"]
        self.commands = AsyncCommands(self)
        self.files = AsyncFiles(self)

    @classmethod
    async def create(cls, image: str, *, url: str, token: str, isolation: str = "container",
                     options: SandboxOptions | None = None, **fields: Any) -> AsyncSandbox:
        """Start a sandbox on ``image`` (an image, composition or checkpoint of your project).

        ``options`` is a :class:`~sandbox.model.SandboxOptions`, or give its fields as
        keywords (``cpu``, ``memory``, ``pids``, ``disk``, ``cpu_class``, ``env``,
        ``workdir``, ``user``, ``labels``, ``ttl``, ``idle_timeout``, ``job``,
        ``lease_ttl``, ``network``, ``userns``, ``policy_version``): they are checked
        here as the service checks them, so a typo is a ``TypeError`` and a bad value an
        :class:`~sandbox.errors.InvalidField` before any request.  ``job`` names the
        caller's lease (renewed by every request on the job's sandboxes and by
        :meth:`AsyncJob.renew`); when it lapses for ``lease_ttl`` seconds the service
        destroys the job's sandboxes.  ``network`` is a list of egress allow rules.
        """
        _check_isolation(isolation)  # before any request
        body = {"image": image, "isolation": isolation, **_options_body(options, fields)}
        return await cls._post(url, token, "/v1/sandboxes", body)

    @classmethod
    async def restore(cls, checkpoint: str, *, url: str, token: str, options: SandboxOptions | None = None,
                      **fields: Any) -> AsyncSandbox:
        """A new sandbox from ``checkpoint`` (made on any host of the same store); options as for
        :meth:`create` (``policy_version`` must match the checkpoint's when given)."""
        body = {"checkpoint": checkpoint, **_options_body(options, fields)}
        return await cls._post(url, token, "/v1/sandboxes/restore", body)

    @classmethod
    async def _post(cls, url: str, token: str, path: str, body: Mapping[str, Any]) -> AsyncSandbox:
        client = _Client(url, token)
        try:
            info = await client.json("POST", path, json_body={k: v for k, v in body.items() if v is not None})
        except BaseException:
            await client.close()
            raise
        return cls(client, info)

    @classmethod
    async def connect(cls, sandbox_id: str, *, url: str, token: str) -> AsyncSandbox:
        """Attach to an existing sandbox of this token's project, resuming it when paused."""
        client = _Client(url, token)
        try:
            info = await client.json("GET", f"/v1/sandboxes/{sandbox_id}")
            if info["status"] == "paused":
                info = await client.json("POST", f"/v1/sandboxes/{sandbox_id}/resume")
        except BaseException:
            await client.close()
            raise
        return cls(client, info)

    async def refresh(self) -> dict[str, Any]:
        self.info = await self._client.json("GET", f"/v1/sandboxes/{self.sandbox_id}")
        return self.info

    async def pause(self) -> dict[str, Any]:
        """Freeze the sandbox (reclaiming its memory); :meth:`connect` or :meth:`resume` thaws it."""
        return dict(await self._client.json("POST", f"/v1/sandboxes/{self.sandbox_id}/pause"))

    async def resume(self) -> None:
        self.info = await self._client.json("POST", f"/v1/sandboxes/{self.sandbox_id}/resume")

    async def checkpoint(self, *, name: str | None = None, labels: Mapping[str, str] | None = None
                         ) -> dict[str, Any]:
        body = {"name": name, "labels": dict(labels or {})}
        return dict(await self._client.json("POST", f"/v1/sandboxes/{self.sandbox_id}/checkpoint",
                                            json_body=body))

    async def receipts(self, *, action: str | None = None, since: float | None = None,
                       idempotency_key: str | None = None) -> list[dict[str, Any]]:
        """Actions recorded for this sandbox (and the checkpoint it was restored from), oldest first."""
        params = {k: str(v) for k, v in {"action": action, "since": since,
                                         "idempotency_key": idempotency_key}.items() if v is not None}
        doc = await self._client.json("GET", f"/v1/sandboxes/{self.sandbox_id}/receipts", params=params)
        return list(doc["receipts"])

    async def set_network(self, rules: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Replace the egress allow rules (default deny) while the sandbox runs."""
        return dict(await self._client.json("PUT", f"/v1/sandboxes/{self.sandbox_id}/network",
                                            json_body={"rules": list(rules)}))

    async def kill(self) -> None:
        """Destroy the sandbox (idempotent: an already gone one is fine) and close the session."""
        try:
            await self._client.request("DELETE", f"/v1/sandboxes/{self.sandbox_id}")
        except NotFound:
            pass
        finally:
            await self.close()

    async def close(self) -> None:
        """Close the HTTP session; the sandbox keeps running."""
        await self._client.close()

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.kill()


async def capabilities(*, url: str, token: str) -> dict[str, Any]:
    """What the service at ``url`` provides (isolation kinds, limits, network, checkpoint kinds)."""
    client = _Client(url, token)
    try:
        return dict(await client.json("GET", "/v1/capabilities"))
    finally:
        await client.close()


class AsyncJob:
    """All sandboxes of one job at once: the lease, pause/resume, and preemption."""

    def __init__(self, job: str, *, url: str, token: str) -> None:
        self.job = job
        self._client = _Client(url, token)
        self._base = f"/v1/jobs/{job}"

    async def renew(self, ttl: float | None = None) -> dict[str, Any]:
        return dict(await self._client.json("POST", self._base + "/renew", json_body={"ttl": ttl}))

    async def pause(self) -> list[str]:
        return list((await self._client.json("POST", self._base + "/pause"))["sandboxes"])

    async def resume(self) -> list[str]:
        return list((await self._client.json("POST", self._base + "/resume"))["sandboxes"])

    async def preempt(self, *, grace: float = 30.0) -> dict[str, Any]:
        """Checkpoint every sandbox of the job into a run manifest and free the host; returns the run."""
        return dict(await self._client.json("POST", self._base + "/preempt", json_body={"timeout": grace}))

    @staticmethod
    async def resume_run(manifest: str, *, url: str, token: str) -> dict[str, Any]:
        """Restore a preempted job (on the service at ``url``); returns old -> new sandbox ids."""
        client = _Client(url, token)
        try:
            return dict(await client.json("POST", "/v1/runs/resume", json_body={"manifest": manifest}))
        finally:
            await client.close()

    async def close(self) -> None:
        await self._client.close()

    async def __aenter__(self) -> AsyncJob:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def call(image: str, cmd: str | Sequence[str] | None = None, *, url: str, token: str,
               function: str | None = None, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
               timeout: float = 30.0) -> dict[str, Any]:  # noqa: ASYNC109 (the call's limit, enforced there)
    """A short stateless call on a warm container of ``image`` (a fresh writable layer each time)."""
    client = _Client(url, token)
    try:
        body = {"image": image, "cmd": cmd if cmd is None or isinstance(cmd, str) else list(cmd),
                "function": function, "args": list(args), "kwargs": dict(kwargs or {}), "timeout": timeout}
        out = dict(await client.json("POST", "/v1/calls", json_body={k: v for k, v in body.items() if v is not None}))
    finally:
        await client.close()
    for stream in ("stdout", "stderr"):
        out[stream] = base64.b64decode(out.get(stream) or "").decode(errors="replace")
    return out


# -- sync wrapper ---------------------------------------------------------------------------------------
class _Loop:
    """A private event loop that runs one AsyncSandbox's coroutines to completion."""

    def __init__(self) -> None:
        self._runner = asyncio.Runner()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._runner.run(coro)

    def close(self) -> None:
        self._runner.close()


class Commands:
    def __init__(self, loop: _Loop, inner: AsyncCommands) -> None:
        self._loop, self._inner = loop, inner

    def run(self, cmd: str | Sequence[str], **kw: Any) -> CommandResult:
        """See :meth:`AsyncCommands.run`; callbacks run on the calling thread."""
        return self._loop.run(self._inner.run(cmd, **kw))


class Files:
    def __init__(self, loop: _Loop, inner: AsyncFiles) -> None:
        self._loop, self._inner = loop, inner

    @overload
    def read(self, path: str, *, format: Literal["text"] = "text") -> str: ...
    @overload
    def read(self, path: str, *, format: Literal["bytes"]) -> bytes: ...

    def read(self, path: str, *, format: Literal["text", "bytes"] = "text") -> str | bytes:
        if format == "bytes":
            return self._loop.run(self._inner.read(path, format="bytes"))
        return self._loop.run(self._inner.read(path))

    def write(self, path: str, data: str | bytes, *, mode: int = 0o644) -> None:
        self._loop.run(self._inner.write(path, data, mode=mode))

    def list(self, path: str = "/") -> list[dict[str, Any]]:
        return self._loop.run(self._inner.list(path))

    def remove(self, path: str, *, recursive: bool = False) -> None:
        self._loop.run(self._inner.remove(path, recursive=recursive))

    def upload(self, path: str, src: str | os.PathLike[str] | BinaryIO, *, mode: int = 0o644) -> int:
        return self._loop.run(self._inner.upload(path, src, mode=mode))

    def stat(self, path: str) -> dict[str, Any]:
        return self._loop.run(self._inner.stat(path))

    def exists(self, path: str) -> bool:
        return self._loop.run(self._inner.exists(path))

    def download(self, path: str, dst: str | os.PathLike[str] | BinaryIO) -> int:
        return self._loop.run(self._inner.download(path, dst))


class Sandbox:
    """The blocking twin of :class:`AsyncSandbox` (same methods, same errors)."""

    def __init__(self, loop: _Loop, inner: AsyncSandbox) -> None:
        self._loop, self._inner = loop, inner
        self.commands = Commands(loop, inner.commands)
        self.files = Files(loop, inner.files)

    @property
    def sandbox_id(self) -> str:
        return self._inner.sandbox_id

    @property
    def info(self) -> dict[str, Any]:
        return self._inner.info

    @classmethod
    def _open(cls, coro: Callable[[], Coroutine[Any, Any, AsyncSandbox]]) -> Sandbox:
        loop = _Loop()
        try:
            return cls(loop, loop.run(coro()))
        except BaseException:
            loop.close()
            raise

    @classmethod
    def create(cls, image: str, *, url: str, token: str, isolation: str = "container", **options: Any) -> Sandbox:
        _check_isolation(isolation)
        return cls._open(lambda: AsyncSandbox.create(image, url=url, token=token, isolation=isolation, **options))

    @classmethod
    def connect(cls, sandbox_id: str, *, url: str, token: str) -> Sandbox:
        return cls._open(lambda: AsyncSandbox.connect(sandbox_id, url=url, token=token))

    @classmethod
    def restore(cls, checkpoint: str, *, url: str, token: str, **options: Any) -> Sandbox:
        return cls._open(lambda: AsyncSandbox.restore(checkpoint, url=url, token=token, **options))

    def receipts(self, **filters: Any) -> list[dict[str, Any]]:
        return self._loop.run(self._inner.receipts(**filters))

    def set_network(self, rules: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return self._loop.run(self._inner.set_network(rules))

    def refresh(self) -> dict[str, Any]:
        return self._loop.run(self._inner.refresh())

    def pause(self) -> dict[str, Any]:
        return self._loop.run(self._inner.pause())

    def resume(self) -> None:
        self._loop.run(self._inner.resume())

    def checkpoint(self, *, name: str | None = None, labels: Mapping[str, str] | None = None) -> dict[str, Any]:
        return self._loop.run(self._inner.checkpoint(name=name, labels=labels))

    def kill(self) -> None:
        try:
            self._loop.run(self._inner.kill())
        finally:
            self._loop.close()

    def close(self) -> None:
        try:
            self._loop.run(self._inner.close())
        finally:
            self._loop.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.kill()
