"""The SDK's errors: one class per condition a caller acts on, every one a :class:`SandboxError`.

The service answers ``{"error": {"code", "message", "retryable"[, "field"][, "resources"]}}``
with an HTTP status and sometimes ``Retry-After``; :func:`from_answer` is the one place
that answer becomes an exception.  The class follows the code (the status where the
code is unknown)::

    ApiError                     the service answered an error: status, code, retryable, retry_after
                                 (sandbox.core.errors.ApiError, the class the edge answers with)
    ├── AuthError                401/403: a missing, unknown or disabled token (PermissionError)
    ├── NotFound                 404 (LookupError)
    │   ├── SandboxNotFound      sandbox_not_found (also sandbox.core.errors.SandboxNotFound)
    │   │   └── SandboxKilled    ... for a session's own sandbox: destroyed while it was in use
    │   ├── FileNotFound         file_not_found (FileNotFoundError)
    │   ├── CommandNotFound      command_not_found: no such background command (or terminal) any more
    │   └── ImageNotFound        image_not_found (also sandbox.core.errors.ImageNotFound)
    │       ├── CheckpointNotFound   checkpoint_not_found
    │       └── RunNotFound          run_not_found
    ├── InvalidRequest           400 naming ``field`` (also sandbox.core.errors.InvalidField)
    ├── FileAccessDenied         403 path_escape / permission_denied (PermissionError)
    ├── Conflict                 409: not now, in this state (paused, a keyed command running...)
    ├── QuotaExceeded            429: the project's sandbox quota (retry_after)
    ├── LimitExceeded            429: a bound of the edge (commands, terminals, readers, connections, jobs)
    └── CapacityExceeded         503 capacity: this edge is full (retry_after, resources)
    ServiceUnavailable           no answer: refused, reset, timed out, cut mid-stream (ConnectionError)
    SandboxClosed                this object was kill()ed or close()d (RuntimeError)
    CommandExitError             commands.run(..., check=True) and the command did not exit 0
    UnsupportedIsolation         isolation this service does not provide, refused before any request

Another project's sandbox, checkpoint or run answers exactly as a missing one does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sandbox.core import errors
from sandbox.core.errors import ERROR_CODES, ApiError, SandboxError

if TYPE_CHECKING:
    from sandbox.sdk.types import CommandResult

__all__ = [
    "ApiError",
    "AuthError",
    "CapacityExceeded",
    "CheckpointNotFound",
    "CommandExitError",
    "CommandNotFound",
    "Conflict",
    "FileAccessDenied",
    "FileNotFound",
    "ImageNotFound",
    "InvalidRequest",
    "LimitExceeded",
    "NotFound",
    "QuotaExceeded",
    "RunNotFound",
    "SandboxClosed",
    "SandboxKilled",
    "SandboxNotFound",
    "ServiceUnavailable",
    "UnsupportedIsolation",
    "from_answer",
    "status_of",
]


class UnsupportedIsolation(SandboxError, ValueError):
    """The requested isolation level is not one this service provides (it never downgrades silently)."""


class AuthError(ApiError, PermissionError):
    """401/403: a missing, unknown or disabled token, or an operator's route without an admin token."""


class NotFound(ApiError, LookupError):
    """404: nothing by that name visible to this token's project (the leaves say what was missing)."""


class SandboxNotFound(NotFound, errors.SandboxNotFound):
    """404 ``sandbox_not_found``: no sandbox with that id in this project (never was, or already gone)."""


class SandboxKilled(SandboxNotFound):
    """The sandbox this session was working on no longer exists: it was destroyed while in use.

    Destroyed by another client's kill, its ttl, idle timeout or lease, or a preempt of its
    job.  Nothing more can run in it; create or restore a new one.
    """


class FileNotFound(NotFound, FileNotFoundError):
    """404 ``file_not_found``: the path does not exist in the sandbox (the sandbox itself does)."""


class CommandNotFound(NotFound):
    """404 ``command_not_found``: the sandbox has no background command or terminal by that id (never
    had, or it ended long enough ago that the service forgot it: it keeps the most recent ones)."""


class ImageNotFound(NotFound, errors.ImageNotFound):
    """404 ``image_not_found``: the image, composition or checkpoint ref named as ``image`` does not
    resolve, or is another project's; nothing was created."""


class CheckpointNotFound(ImageNotFound):
    """404 ``checkpoint_not_found``: the checkpoint to restore does not resolve (or is another project's)."""


class RunNotFound(ImageNotFound):
    """404 ``run_not_found``: the run manifest to resume does not resolve (or is another project's job's)."""


class InvalidRequest(ApiError, errors.InvalidField):  # type: ignore[misc]  # field: str, not str | None
    """400: a malformed or out-of-range request; ``field`` names it where the service said which.

    Also a :class:`sandbox.core.errors.InvalidField`, which is what the SDK raises for the same
    mistake when it can see it before sending (``except InvalidField`` catches both).
    """

    def __init__(self, status: int, code: str, message: str, *, retryable: bool = False,
                 retry_after: float | None = None, field: str | None = None,
                 resources: tuple[str, ...] = ()) -> None:
        super().__init__(status, code, message, retryable=retryable, retry_after=retry_after, field=field,
                         resources=resources)
        self.field = field or ""
        self.detail = message


class FileAccessDenied(ApiError, PermissionError):
    """403 ``path_escape`` or ``permission_denied``: the files API refused a path (one that leaves the
    sandbox through /proc or a magic link, or one the sandbox's own permissions deny)."""


class Conflict(ApiError):
    """409: the request does not fit the sandbox's state now (paused, not running, a keyed command
    still running, a directory where a file was expected...)."""


class QuotaExceeded(ApiError):
    """429: the project's sandbox quota is used up (``resources`` is ``("sandboxes",)``); destroy one, or
    retry after ``retry_after`` seconds."""


class LimitExceeded(ApiError):
    """429 ``command_limit``, ``too_many_readers``, ``too_many_connections``, ``job_limit`` or
    ``project_limit``: a bound this edge sets per sandbox (running background commands, terminals,
    clients attached to one command, proxied connections) or per project (its jobs on the edge;
    commands, transfers, connections: ``resources`` names it) is reached; end one, or retry after
    ``retry_after`` seconds."""


class CapacityExceeded(ApiError):
    """503 ``capacity``: this edge has no room now; ``resources`` names what is short (``memory``,
    ``pids``, ``disk``, ``sandboxes``), ``retry_after`` when to retry, or try another edge."""


class ServiceUnavailable(SandboxError, ConnectionError):
    """The service gave no answer: connection refused or reset, a timeout, a response cut short.

    ``url`` is the service's; the aiohttp error is chained.  Retryable; a command or upload
    cut short may have run or partly happened (give commands an ``idempotency_key``).
    """

    retryable = True

    def __init__(self, url: str, what: str, cause: BaseException | None = None) -> None:
        detail = "" if cause is None else f": {type(cause).__name__}: {cause or 'no detail'}"
        super().__init__(f"{url}: {what}{detail} (is the service running and reachable?)")
        self.url = url


class SandboxClosed(SandboxError, RuntimeError):
    """This object was closed (``kill()``, ``close()`` or the end of its ``with`` block): no request is sent.

    The message says which; a sandbox left running by ``close()`` can be attached again with
    ``connect(sandbox_id)``.
    """


class CommandExitError(SandboxError):
    """``commands.run(..., check=True)`` (for a background command, its ``wait()``): the command did
    not exit 0 (non-zero, killed, timed out).

    ``result`` is the whole :class:`~sandbox.sdk.types.CommandResult`; ``stdout`` and
    ``stderr`` are its output, ``exit_code`` its exit status (128 + N for signal N; where
    the service never learned it, 128 + the signal it recorded), so it is always an int.
    """

    def __init__(self, command: str, result: CommandResult) -> None:
        how = (f"was killed by signal {result.signal}" if result.signal is not None
               else f"exited with {result.exit_code}")
        why = ("timed out" if result.timed_out else "ran out of memory" if result.oom_killed
               else f"interrupted ({result.interrupted})" if result.interrupted else "")
        tail = result.stderr[-500:].strip()
        super().__init__(f"{command!r} {how}{f', {why}' if why else ''}" + (f": {tail}" if tail else ""))
        self.result = result
        self.exit_code = result.exit_code if result.exit_code is not None else 128 + (result.signal or 0)
        self.stdout, self.stderr = result.stdout, result.stderr


# by the service's error code; the status decides where the code is one this SDK does not know
_BY_CODE: dict[str, type[ApiError]] = {
    "unauthenticated": AuthError, "forbidden": AuthError,
    "sandbox_not_found": SandboxNotFound, "file_not_found": FileNotFound, "image_not_found": ImageNotFound,
    "checkpoint_not_found": CheckpointNotFound, "run_not_found": RunNotFound,
    "invalid_field": InvalidRequest, "bad_request": InvalidRequest, "unsupported_option": InvalidRequest,
    "unsupported_isolation": InvalidRequest,
    "path_escape": FileAccessDenied, "permission_denied": FileAccessDenied,
    "quota_exceeded": QuotaExceeded, "capacity": CapacityExceeded,
    "command_not_found": CommandNotFound, "command_limit": LimitExceeded, "too_many_readers": LimitExceeded,
    "too_many_connections": LimitExceeded, "job_limit": LimitExceeded, "project_limit": LimitExceeded,
}
_BY_STATUS: dict[int, type[ApiError]] = {400: InvalidRequest, 401: AuthError, 403: AuthError, 404: NotFound,
                                         409: Conflict, 413: InvalidRequest, 429: QuotaExceeded}


def status_of(code: str) -> int:
    """The HTTP status the service answers ``code`` with (500 for one this SDK does not know):
    an exec stream's error event, or a terminal's rejected input, carries no HTTP status (the
    stream had begun with 200)."""
    return ERROR_CODES.get(code, 500)


def _retry_after(value: str | None) -> float | None:
    try:
        seconds = float(value) if value is not None else None
    except ValueError:  # an HTTP date: this service never sends one
        return None
    return seconds if seconds is not None and seconds >= 0 else None


def from_answer(status: int, body: bytes | Mapping[str, Any], *, retry_after: str | None = None,
                sandbox: str | None = None) -> ApiError:
    """The exception for an error answer: ``body`` is the response body (or an exec stream's
    ``error`` object), ``retry_after`` the ``Retry-After`` header; ``sandbox`` is set for a
    session's own requests, whose ``sandbox_not_found`` means :class:`SandboxKilled`."""
    doc: Any = body
    if isinstance(body, bytes):
        try:
            doc = json.loads(body)["error"]
        except (ValueError, KeyError, TypeError):
            text = body.decode(errors="replace")[:500] or "no body"
            cls = _BY_STATUS.get(status, ApiError)
            return cls(status, "http", text, retryable=status >= 500, retry_after=_retry_after(retry_after))
    if not isinstance(doc, Mapping):
        return ApiError(status, "bad_response", f"an error answer that is not an object: {str(doc)[:200]}")
    code, message = str(doc.get("code", "http")), str(doc.get("message", "no message"))
    cls = _BY_CODE.get(code) or _BY_STATUS.get(status, ApiError)
    if cls is SandboxNotFound and sandbox is not None:
        cls = SandboxKilled
        message = (f"sandbox {sandbox} was destroyed while this session used it (another client's kill, its "
                   f"ttl, idle timeout or lease, or a preempt): {message}")
    resources = doc.get("resources")
    field = doc.get("field")
    return cls(status, code, message, retryable=bool(doc.get("retryable")), retry_after=_retry_after(retry_after),
               field=str(field) if field is not None else None,
               resources=tuple(str(r) for r in resources) if isinstance(resources, list) else ())
