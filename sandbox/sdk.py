"""Client SDK for the sandbox service, shaped like E2B's: an async core and its blocking twin.

::

    async with await AsyncSandbox.create("img/python", url=URL, token=TOKEN, memory=512 << 20) as sb:
        r = await sb.commands.run("python3 -c 'print(1)'", on_stdout=print, check=True)
        await sb.files.write("/root/a.txt", "hi")
        ckpt = await sb.checkpoint(name="step-1")
    copy = await AsyncSandbox.restore(ckpt.name, url=URL, token=TOKEN)

    with Sandbox.create("img/python", url=URL, token=TOKEN) as sb:   # the same API, blocking
        sb.commands.run("echo hi").stdout

Classes: :class:`AsyncSandbox` (with ``commands`` and ``files``), :class:`AsyncJob` (a
job's lease, pause/resume, preemption), :class:`AsyncClient` (capabilities, load report,
FnCall); their blocking twins :class:`Sandbox`, :class:`Job`, :class:`Client` are derived
from them (:mod:`sandbox.sdk_blocking`), with the same methods, parameters and
docstrings.  :func:`call` and :func:`capabilities` are one-shot async shortcuts.
Leaving a sandbox's ``with`` block kills it; :meth:`AsyncSandbox.close` leaves it running.

Options are checked here by the model the service uses (:class:`~sandbox.model.SandboxOptions`):
a mistyped keyword is a type error (mypy) or ``TypeError``, a bad value an
:class:`~sandbox.errors.InvalidField`, before any request.  Results are frozen
dataclasses (:mod:`sandbox.sdk_types`); errors are typed by what happened
(:mod:`sandbox.sdk_errors`): ``ImageNotFound``, ``SandboxKilled``, ``FileNotFound``,
``CapacityExceeded`` with ``retry_after`` and ``resources``, ``ServiceUnavailable`` for a
service that does not answer, ``SandboxClosed`` after ``kill()``...
"""

from __future__ import annotations

import base64
import builtins
import codecs
import contextlib
import json
import os
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, BinaryIO, Literal, Self, Unpack, overload

import aiofiles
import aiohttp

from sandbox.model import EgressRule, SandboxOptions, check_job, check_labels, parse_rules
from sandbox.sdk_blocking import Blocking, Loop, Part, blocking, oneshot, opens
from sandbox.sdk_errors import (
    ApiError,
    AuthError,
    CapacityExceeded,
    CheckpointNotFound,
    CommandExitError,
    Conflict,
    FileAccessDenied,
    FileNotFound,
    ImageNotFound,
    InvalidRequest,
    NotFound,
    QuotaExceeded,
    RunNotFound,
    SandboxClosed,
    SandboxKilled,
    SandboxNotFound,
    ServiceUnavailable,
    UnsupportedIsolation,
    from_answer,
    status_of,
)
from sandbox.sdk_types import (
    CallResult,
    Capabilities,
    Checkpoint,
    CommandResult,
    EdgeLoad,
    FileEntry,
    FileStat,
    Lease,
    Limits,
    NetworkPolicy,
    Paused,
    Receipt,
    Run,
    SandboxFields,
    SandboxInfo,
    SandboxNetwork,
    parse,
)

__all__ = [
    # async
    "AsyncClient", "AsyncCommands", "AsyncFiles", "AsyncJob", "AsyncSandbox", "call", "capabilities",
    # blocking
    "Client", "Commands", "Files", "Job", "Sandbox",
    # results and options
    "CallResult", "Capabilities", "Checkpoint", "CommandResult", "EdgeLoad", "FileEntry", "FileStat", "Lease",
    "Limits", "NetworkPolicy", "Paused", "Receipt", "Run", "SandboxFields", "SandboxInfo", "SandboxNetwork",
    # errors
    "ApiError", "AuthError", "CapacityExceeded", "CheckpointNotFound", "CommandExitError", "Conflict",
    "FileAccessDenied", "FileNotFound", "ImageNotFound", "InvalidRequest", "NotFound", "QuotaExceeded",
    "RunNotFound", "SandboxClosed", "SandboxKilled", "SandboxNotFound", "ServiceUnavailable",
    "UnsupportedIsolation",
]

SUPPORTED_ISOLATION = ("container",)
CONNECT_TIMEOUT = 30.0  # seconds to reach the service
READ_TIMEOUT = 300.0  # seconds a request may wait for the service's next bytes (not exec streams)
_REQUEST = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT, sock_read=READ_TIMEOUT)
_STREAM = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT, sock_read=None)  # a quiet command is fine


# -- HTTP -----------------------------------------------------------------------------------------
class _Http:
    """One HTTP session against one service with one token: every request of the SDK goes through
    :meth:`open`, so every failure becomes an SDK error in one place.

    The aiohttp session is made on the first request (on the loop that runs it), so an object
    can be constructed outside a running loop.  ``sandbox`` is the sandbox a session works on
    once it exists; ``closed`` says why the session was closed, and then no request is sent.
    """

    def __init__(self, url: str, token: str) -> None:
        self.url = url.rstrip("/")
        self._token = token
        self._session: aiohttp.ClientSession | None = None
        self.sandbox: str | None = None
        self.closed: str | None = None

    def _live(self) -> aiohttp.ClientSession:
        if self.closed is not None:
            raise SandboxClosed(self.closed)
        if self._session is None:
            self._session = aiohttp.ClientSession(headers={"Authorization": f"Bearer {self._token}"},
                                                  timeout=_REQUEST)
        return self._session

    @contextlib.asynccontextmanager
    async def open(self, method: str, path: str, *, json_body: Any = None, data: Any = None,
                   params: Mapping[str, str] | None = None, stream: bool = False
                   ) -> AsyncIterator[aiohttp.ClientResponse]:
        """A successful response (status < 400) to read; an error answer raises its SDK error, no
        answer :class:`ServiceUnavailable`.  ``stream``: no read timeout (an exec stream)."""
        session = self._live()
        try:
            async with session.request(method, self.url + path, json=json_body, data=data, params=params,
                                       timeout=_STREAM if stream else _REQUEST) as r:
                if r.status >= 400:
                    raise from_answer(r.status, await r.read(), retry_after=r.headers.get("Retry-After"),
                                      sandbox=self.sandbox)
                yield r
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
            raise ServiceUnavailable(self.url, f"{method} {path}", exc) from exc

    async def request(self, method: str, path: str, **kw: Any) -> bytes:
        """The body of a successful answer."""
        async with self.open(method, path, **kw) as r:
            return await r.read()

    async def json(self, method: str, path: str, **kw: Any) -> Any:
        """The JSON body of a successful answer (None for an empty one)."""
        body = await self.request(method, path, **kw)
        try:
            return json.loads(body) if body else None
        except ValueError:
            raise ApiError(502, "bad_response", f"{method} {path}: the answer is not JSON: {body[:200]!r}") from None

    async def close(self, why: str) -> None:
        """Close the session (idempotent; the first reason is kept for :class:`SandboxClosed`)."""
        if self.closed is None:
            self.closed = why
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()


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


def _event(line: bytes) -> dict[str, Any]:
    """One event of an exec stream (a JSON object per line)."""
    try:
        event = json.loads(line)
    except ValueError:
        event = None
    if not isinstance(event, dict):
        raise ApiError(502, "bad_response", f"an exec stream line that is not a JSON object: {line[:200]!r}")
    return event


def _chunk(event: Mapping[str, Any]) -> bytes:
    """The output bytes of a ``stdout`` or ``stderr`` event."""
    try:
        return base64.b64decode(event["data"], validate=True)
    except (KeyError, TypeError, ValueError):
        raise ApiError(502, "bad_response", f"a {event.get('type')} event without base64 data") from None


# -- async core -----------------------------------------------------------------------------------
class _Session:
    """An object holding one HTTP session (:class:`_Http`); leaving ``async with`` closes it."""

    _http: _Http

    async def close(self) -> None:
        """Close the HTTP session (subclasses say what that leaves running)."""
        await self._http.close("closed (close())")

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()


class AsyncCommands:
    """Commands in one sandbox (``sandbox.commands``)."""

    def __init__(self, sb: AsyncSandbox) -> None:
        self._sb = sb

    # timeout is the command's limit, enforced by the service (not a client-side wait)
    async def run(self, cmd: str | Sequence[str], *, on_stdout: Callable[[str], Any] | None = None,
                  on_stderr: Callable[[str], Any] | None = None,
                  timeout: float | None = None,  # noqa: ASYNC109
                  env: Mapping[str, str] | None = None, cwd: str | None = None, stdin: bytes | str | None = None,
                  output_cap: int | None = None, idempotency_key: str | None = None,
                  check: bool = False) -> CommandResult:
        """Run ``cmd`` (a string goes through ``/bin/sh -c``); callbacks get decoded output as it arrives.

        A non-zero exit is reported in ``exit_code``, not raised, unless ``check``: then
        anything but exit 0 raises :class:`CommandExitError` carrying the result.  A
        ``timeout`` kills the command tree and sets ``timed_out``.  With an
        ``idempotency_key``, retrying (also after a preempted job was resumed elsewhere)
        returns the first run's result instead of running again.  Leaving the stream early
        (cancelling this coroutine) kills the command.  A sandbox destroyed meanwhile ends the
        command by SIGKILL (``signal`` 9) and its next request raises :class:`SandboxKilled`;
        a service that goes away mid-command raises :class:`ServiceUnavailable`.
        """
        body: dict[str, Any] = {"cmd": cmd if isinstance(cmd, str) else list(cmd), "timeout": timeout,
                                "env": dict(env) if env else None, "cwd": cwd, "output_cap": output_cap,
                                "idempotency_key": idempotency_key}
        if stdin is not None:
            raw = stdin.encode() if isinstance(stdin, str) else stdin
            body["stdin"] = base64.b64encode(raw).decode()
        http = self._sb._http
        out = {"stdout": bytearray(), "stderr": bytearray()}
        decoders = {k: codecs.getincrementaldecoder("utf-8")(errors="replace") for k in out}
        callbacks = {"stdout": on_stdout, "stderr": on_stderr}
        final: dict[str, Any] | None = None
        path = f"/v1/sandboxes/{self._sb.sandbox_id}/exec"
        async with http.open("POST", path, json_body={k: v for k, v in body.items() if v is not None},
                             stream=True) as r:
            async for line in r.content:
                if not line.strip():
                    continue
                event = _event(line)
                kind = event.get("type")
                if kind in out:
                    data = _chunk(event)
                    out[kind] += data
                    cb = callbacks[kind]
                    if cb is not None:
                        text = decoders[kind].decode(data)
                        if text:
                            cb(text)
                elif kind in ("exit", "error"):
                    final = event
                # other events (a newer service's) carry nothing this SDK uses: skipped
        if final is None:
            raise ServiceUnavailable(http.url, f"POST {path}: the stream ended before the command's exit event "
                                     "(the command may have run; an idempotency_key makes a retry safe)")
        if final["type"] == "error":
            err = final.get("error") or {}
            raise from_answer(status_of(str(err.get("code"))), err, sandbox=http.sandbox)
        for kind, cb in callbacks.items():
            tail = decoders[kind].decode(b"", final=True)
            if cb is not None and tail:
                cb(tail)
        # server-side truncation applies to the result; the stream already carried everything
        result = CommandResult.from_exit(final, out["stdout"].decode(errors="replace"),
                                         out["stderr"].decode(errors="replace"))
        if check and result.exit_code != 0:
            raise CommandExitError(cmd if isinstance(cmd, str) else " ".join(cmd), result)
        return result


class AsyncFiles:
    """Files in one sandbox (``sandbox.files``): paths are absolute and resolved inside its root."""

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
        """The whole file at ``path``, decoded as UTF-8 (``format="bytes"``: as bytes).

        :class:`FileNotFound` if it does not exist, :class:`FileAccessDenied` if the path
        leaves the sandbox (through /proc or a magic link).
        """
        data = await self._sb._http.request("GET", self._base, params={"path": path})
        return data if format == "bytes" else data.decode()

    async def write(self, path: str, data: str | bytes, *, mode: int = 0o644) -> None:
        """Create or replace the file at ``path`` with ``data`` (a str is written as UTF-8)."""
        raw = data.encode() if isinstance(data, str) else data
        await self._sb._http.request("PUT", self._base, data=raw, params={"path": path, "mode": f"{mode:o}"})

    async def upload(self, path: str, src: str | os.PathLike[str] | BinaryIO, *, mode: int = 0o644) -> int:
        """Stream a local file (a path or a binary file object) of any size into the sandbox; returns its size."""
        params = {"path": path, "mode": f"{mode:o}"}
        http = self._sb._http
        if isinstance(src, (str, os.PathLike)):
            async with aiofiles.open(src, "rb") as f:
                async def chunks() -> AsyncIterator[bytes]:
                    while data := await f.read(1 << 20):
                        yield data
                doc = await http.json("PUT", self._base, data=chunks(), params=params)
        else:
            doc = await http.json("PUT", self._base, data=src, params=params)  # aiohttp streams it
        return int(doc["bytes"])

    async def download(self, path: str, dst: str | os.PathLike[str] | BinaryIO) -> int:
        """Stream a sandbox file of any size to a local path or binary file object; returns its size."""
        total = 0
        async with self._sb._http.open("GET", self._base, params={"path": path}, stream=True) as r:
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

    async def stat(self, path: str) -> FileStat:
        """Type, size, mode, owner and mtime of one entry (a symlink is reported, not followed)."""
        return parse(FileStat, await self._sb._http.json("GET", self._base, params={"path": path, "stat": "1"}))

    async def exists(self, path: str) -> bool:
        """Whether ``path`` exists in the sandbox (a sandbox that is gone still raises)."""
        try:
            await self.stat(path)
        except FileNotFound:
            return False
        return True

    async def list(self, path: str = "/") -> builtins.list[FileEntry]:
        """The entries of the directory ``path``, sorted by name."""
        doc = await self._sb._http.json("GET", self._base, params={"path": path, "list": "1"})
        return [parse(FileEntry, e) for e in doc["entries"]]

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove a file, a symlink or an empty directory (``recursive``: a whole tree)."""
        await self._sb._http.request("DELETE", self._base,
                                     params={"path": path, "recursive": "1" if recursive else "0"})


class AsyncSandbox(_Session):
    """A sandbox on a layerbox service; get one with :meth:`create`, :meth:`restore` or :meth:`connect`.

    ``info`` is what the service last said about it (:meth:`refresh` asks again),
    ``commands`` runs commands, ``files`` reads and writes files.  Leaving ``async with``
    kills the sandbox; after :meth:`kill` or :meth:`close` every method raises
    :class:`SandboxClosed`.  A sandbox destroyed by someone else (its ttl, lease, another
    client) answers every request with :class:`SandboxKilled`.
    """

    def __init__(self, http: _Http, info: SandboxInfo) -> None:
        self._http = http
        http.sandbox = info.id
        self._killed = False
        self.info = info
        self.sandbox_id: str = info.id
        self.commands = AsyncCommands(self)
        self.files = AsyncFiles(self)

    @classmethod
    async def create(cls, image: str, *, url: str, token: str, isolation: str = "container",
                     options: SandboxOptions | None = None, **fields: Unpack[SandboxFields]) -> AsyncSandbox:
        """Start a sandbox on ``image`` (an image, composition or checkpoint of your project).

        ``options`` is a :class:`~sandbox.model.SandboxOptions`, or give its fields as
        keywords (:class:`~sandbox.sdk_types.SandboxFields`: ``cpu``, ``memory``, ``pids``,
        ``disk``, ``cpu_class``, ``env``, ``workdir``, ``user``, ``labels``, ``ttl``,
        ``idle_timeout``, ``job``, ``lease_ttl``, ``network``, ``userns``,
        ``policy_version``): they are checked here as the service checks them, so a typo is
        a ``TypeError`` and a bad value an :class:`~sandbox.errors.InvalidField` before any
        request.  ``job`` names the caller's lease (renewed by every request on the job's
        sandboxes and by :meth:`AsyncJob.renew`); when it lapses for ``lease_ttl`` seconds
        the service destroys the job's sandboxes.  ``network`` is a list of egress allow rules.

        Raises :class:`ImageNotFound` for a ref that does not resolve, :class:`QuotaExceeded`
        or :class:`CapacityExceeded` (with ``retry_after``) when it cannot be admitted now,
        :class:`InvalidRequest` for a value past this service's limits; nothing is created then.
        """
        _check_isolation(isolation)  # before any request
        body = {"image": image, "isolation": isolation, **_options_body(options, fields)}
        return await cls._post(url, token, "/v1/sandboxes", body)

    @classmethod
    async def restore(cls, checkpoint: str, *, url: str, token: str, options: SandboxOptions | None = None,
                      **fields: Unpack[SandboxFields]) -> AsyncSandbox:
        """A new sandbox from ``checkpoint`` (made on any host of the same store), with the options its
        sandbox had and the ones given here over them (``policy_version`` must match the checkpoint's
        when given).  :class:`CheckpointNotFound` for a checkpoint that does not resolve."""
        body = {"checkpoint": checkpoint, **_options_body(options, fields)}
        return await cls._post(url, token, "/v1/sandboxes/restore", body)

    @classmethod
    async def _post(cls, url: str, token: str, path: str, body: Mapping[str, Any]) -> AsyncSandbox:
        http = _Http(url, token)
        try:
            info = parse(SandboxInfo, await http.json("POST", path, json_body=body))
        except BaseException:
            await http.close("the create failed")
            raise
        return cls(http, info)

    @classmethod
    async def connect(cls, sandbox_id: str, *, url: str, token: str) -> AsyncSandbox:
        """Attach to an existing sandbox of this token's project, resuming it when paused.

        :class:`SandboxNotFound` if there is none by that id in the project.
        """
        http = _Http(url, token)
        try:
            info = parse(SandboxInfo, await http.json("GET", f"/v1/sandboxes/{sandbox_id}"))
            if info.status == "paused":
                info = parse(SandboxInfo, await http.json("POST", f"/v1/sandboxes/{sandbox_id}/resume"))
        except BaseException:
            await http.close("the connect failed")
            raise
        return cls(http, info)

    @property
    def _path(self) -> str:
        return f"/v1/sandboxes/{self.sandbox_id}"

    async def refresh(self) -> SandboxInfo:
        """Ask the service about the sandbox again; updates and returns ``info``."""
        self.info = parse(SandboxInfo, await self._http.json("GET", self._path))
        return self.info

    async def pause(self) -> Paused:
        """Freeze the sandbox (reclaiming its memory); :meth:`connect` or :meth:`resume` thaws it."""
        return Paused.from_json(await self._http.json("POST", self._path + "/pause"))

    async def resume(self) -> SandboxInfo:
        """Thaw a paused sandbox; updates and returns ``info``."""
        self.info = parse(SandboxInfo, await self._http.json("POST", self._path + "/resume"))
        return self.info

    async def checkpoint(self, *, name: str | None = None, labels: Mapping[str, str] | None = None
                         ) -> Checkpoint:
        """Snapshot the sandbox's filesystem (not its processes) to the store; restore it anywhere with
        :meth:`restore` by the returned ``name`` (``name`` given: a ref in your project's namespace)."""
        body = {"name": name, "labels": dict(labels or {})}
        return parse(Checkpoint, await self._http.json("POST", self._path + "/checkpoint", json_body=body))

    async def receipts(self, *, action: str | None = None, since: float | None = None,
                       idempotency_key: str | None = None) -> builtins.list[Receipt]:
        """Actions recorded for this sandbox (and the checkpoint it was restored from), oldest first,
        filtered by ``action``, ``since`` (Unix time) and ``idempotency_key``."""
        params = {k: str(v) for k, v in {"action": action, "since": since,
                                         "idempotency_key": idempotency_key}.items() if v is not None}
        doc = await self._http.json("GET", self._path + "/receipts", params=params)
        return [Receipt.from_json(r) for r in doc["receipts"]]

    async def set_network(self, rules: Sequence[EgressRule | Mapping[str, Any]]) -> NetworkPolicy:
        """Replace the egress allow rules (default deny) while the sandbox runs; returns the policy in force."""
        checked = parse_rules(rules, "rules")  # the model's check, before any request
        return parse(NetworkPolicy, await self._http.json(
            "PUT", self._path + "/network", json_body={"rules": [r.to_dict() for r in checked]}))

    async def kill(self) -> None:
        """Destroy the sandbox and close this session (a sandbox already gone is fine; a second kill
        does nothing).  If the service cannot be reached the session is closed all the same and the
        sandbox may still run: :meth:`connect` to it later and kill it again."""
        if self._killed:
            return
        was_open = self._http.closed is None
        why = (f"sandbox {self.sandbox_id} was killed by this session (kill() or the end of its with block); "
               "create, restore or connect to another one")
        try:
            await self._http.request("DELETE", self._path)
        except SandboxNotFound:
            pass
        except BaseException as exc:
            why = (f"kill() of sandbox {self.sandbox_id} failed ({type(exc).__name__}) and closed this session; "
                   f"the sandbox may still run: connect({self.sandbox_id!r}) and kill it again")
            raise
        finally:
            self._killed = was_open
            await self._http.close(why)

    async def close(self) -> None:
        """Close the HTTP session; the sandbox keeps running (until its ttl or lease) and :meth:`connect`
        attaches to it again."""
        await self._http.close(f"sandbox {self.sandbox_id}: this session was closed (close()); the sandbox "
                               f"keeps running and connect({self.sandbox_id!r}) attaches to it again")

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._http.closed is None:  # close() inside the block: the caller keeps the sandbox
            await self.kill()


class AsyncJob(_Session):
    """All sandboxes of one job at once: the lease, pause/resume, and preemption."""

    def __init__(self, job: str, *, url: str, token: str) -> None:
        self.job = check_job(job)
        self._http = _Http(url, token)
        self._base = f"/v1/jobs/{job}"

    async def renew(self, ttl: float | None = None) -> Lease:
        """Renew the job's lease (for ``ttl`` seconds, default the one it has); returns it."""
        return parse(Lease, await self._http.json("POST", self._base + "/renew", json_body={"ttl": ttl}))

    async def pause(self) -> list[str]:
        """Freeze every running sandbox of the job; returns their ids."""
        return list((await self._http.json("POST", self._base + "/pause"))["sandboxes"])

    async def resume(self) -> list[str]:
        """Thaw every paused sandbox of the job; returns their ids."""
        return list((await self._http.json("POST", self._base + "/resume"))["sandboxes"])

    async def preempt(self, *, grace: float = 30.0) -> Run:
        """Checkpoint every sandbox of the job into a run manifest and free the host; returns the run
        (``sandboxes``: id -> checkpoint).  Commands get ``grace`` seconds to finish."""
        return parse(Run, await self._http.json("POST", self._base + "/preempt", json_body={"timeout": grace}))

    @staticmethod
    async def resume_run(manifest: str, *, url: str, token: str) -> Run:
        """Restore a preempted job (on the service at ``url``); returns the run with ``sandboxes``: old id ->
        new id.  :class:`RunNotFound` for a manifest that does not resolve; quota and capacity are
        checked for the whole job first, so nothing is half-restored."""
        async with AsyncClient(url=url, token=token) as client:
            return parse(Run, await client._http.json("POST", "/v1/runs/resume", json_body={"manifest": manifest}))

    async def close(self) -> None:
        """Close the HTTP session (the job's sandboxes and lease are unaffected)."""
        await self._http.close(f"job {self.job}: this handle was closed (close()); make a new one")


class AsyncClient(_Session):
    """The service itself, for what belongs to no sandbox: its capabilities, its load report, FnCall."""

    def __init__(self, *, url: str, token: str) -> None:
        self.url = url.rstrip("/")
        self._http = _Http(url, token)

    async def capabilities(self) -> Capabilities:
        """What the service provides (isolation kinds, limits, network, checkpoint kinds)."""
        return parse(Capabilities, await self._http.json("GET", "/v1/capabilities"))

    async def load(self) -> EdgeLoad:
        """The edge's load report (what placement chooses by)."""
        return parse(EdgeLoad, await self._http.json("GET", "/v1/load"))

    async def call(self, image: str, cmd: str | Sequence[str] | None = None, *, function: str | None = None,
                   args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
                   timeout: float = 30.0) -> CallResult:  # noqa: ASYNC109 (the call's limit, enforced there)
        """A short stateless call on a warm container of ``image`` (a fresh writable layer each time).

        Give ``cmd`` (a string goes through ``/bin/sh -c``) or ``function``, Python source whose
        last top-level function is called with ``args`` and ``kwargs`` (JSON values); its return
        value comes back in ``value``, an exception in ``error``.  :class:`ImageNotFound` for an
        image that does not resolve (no warm pool is made for it).
        """
        body = {"image": image, "cmd": cmd if cmd is None or isinstance(cmd, str) else list(cmd),
                "function": function, "args": list(args), "kwargs": dict(kwargs or {}), "timeout": timeout}
        return CallResult.from_json(await self._http.json(
            "POST", "/v1/calls", json_body={k: v for k, v in body.items() if v is not None}))

    async def close(self) -> None:
        """Close the HTTP session."""
        await self._http.close(f"the client of {self.url} was closed (close()); make a new one")


async def capabilities(*, url: str, token: str) -> Capabilities:
    """One-shot :meth:`AsyncClient.capabilities`: what the service at ``url`` provides."""
    async with AsyncClient(url=url, token=token) as client:
        return await client.capabilities()


async def call(image: str, cmd: str | Sequence[str] | None = None, *, url: str, token: str,
               function: str | None = None, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
               timeout: float = 30.0) -> CallResult:  # noqa: ASYNC109 (the call's limit, enforced there)
    """One-shot :meth:`AsyncClient.call`: a short stateless call on a warm container of ``image``."""
    async with AsyncClient(url=url, token=token) as client:
        return await client.call(image, cmd, function=function, args=args, kwargs=kwargs, timeout=timeout)


# -- the blocking twins (sandbox.sdk_blocking: every method is its async twin's, awaited) ----------
class Commands(Part[AsyncCommands], twin=AsyncCommands):
    """The blocking twin of :class:`AsyncCommands`; callbacks run on the calling thread."""

    run = blocking(AsyncCommands.run)


class Files(Part[AsyncFiles], twin=AsyncFiles):
    """The blocking twin of :class:`AsyncFiles`."""

    read = blocking(AsyncFiles.read)
    write = blocking(AsyncFiles.write)
    upload = blocking(AsyncFiles.upload)
    download = blocking(AsyncFiles.download)
    stat = blocking(AsyncFiles.stat)
    exists = blocking(AsyncFiles.exists)
    list = blocking(AsyncFiles.list)
    remove = blocking(AsyncFiles.remove)


class Sandbox(Blocking[AsyncSandbox], twin=AsyncSandbox):
    """The blocking twin of :class:`AsyncSandbox`: the same methods, parameters, results and errors."""

    commands: Commands
    files: Files

    def _bind(self, loop: Loop, inner: AsyncSandbox) -> None:
        super()._bind(loop, inner)
        self.commands = Commands._wrap(loop, inner.commands)
        self.files = Files._wrap(loop, inner.files)

    @property
    def sandbox_id(self) -> str:
        """The sandbox's id (``lb-`` and 12 hex digits)."""
        return self._inner.sandbox_id

    @property
    def info(self) -> SandboxInfo:
        """What the service last said about the sandbox (:meth:`refresh` asks again)."""
        return self._inner.info

    create = opens(AsyncSandbox.create)
    restore = opens(AsyncSandbox.restore)
    connect = opens(AsyncSandbox.connect)
    refresh = blocking(AsyncSandbox.refresh)
    pause = blocking(AsyncSandbox.pause)
    resume = blocking(AsyncSandbox.resume)
    checkpoint = blocking(AsyncSandbox.checkpoint)
    receipts = blocking(AsyncSandbox.receipts)
    set_network = blocking(AsyncSandbox.set_network)
    kill = blocking(AsyncSandbox.kill, closes=True)
    close = blocking(AsyncSandbox.close, closes=True)


class Job(Blocking[AsyncJob], twin=AsyncJob):
    """The blocking twin of :class:`AsyncJob`."""

    def __init__(self, job: str, *, url: str, token: str) -> None:
        """The job ``job`` of this token's project on the service at ``url`` (no request is sent yet)."""
        inner = AsyncJob(job, url=url, token=token)
        self._bind(Loop(), inner)

    @property
    def job(self) -> str:
        """The job's name."""
        return self._inner.job

    renew = blocking(AsyncJob.renew)
    pause = blocking(AsyncJob.pause)
    resume = blocking(AsyncJob.resume)
    preempt = blocking(AsyncJob.preempt)
    resume_run = staticmethod(oneshot(AsyncJob.resume_run))
    close = blocking(AsyncJob.close, closes=True)


class Client(Blocking[AsyncClient], twin=AsyncClient):
    """The blocking twin of :class:`AsyncClient`."""

    def __init__(self, *, url: str, token: str) -> None:
        """A client of the service at ``url`` (no request is sent yet)."""
        inner = AsyncClient(url=url, token=token)
        self._bind(Loop(), inner)

    @property
    def url(self) -> str:
        """The service's URL."""
        return self._inner.url

    capabilities = blocking(AsyncClient.capabilities)
    load = blocking(AsyncClient.load)
    call = blocking(AsyncClient.call)
    close = blocking(AsyncClient.close, closes=True)
