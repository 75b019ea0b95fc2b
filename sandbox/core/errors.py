"""Errors of the sandbox manager (one root, a few leaves callers catch by builtin type)."""

from __future__ import annotations

from typing import Any

from layerstore.errors import LayerboxError


class SandboxError(LayerboxError):
    """Root of every sandbox failure."""


class RuntimeFailed(SandboxError):
    """The OCI runtime (crun) exited non-zero; the message carries argv and its stderr."""

    def __init__(self, message: str, *, argv: list[str] | None = None, returncode: int | None = None,
                 stderr: str = "") -> None:
        super().__init__(message)
        self.argv = argv or []
        self.returncode = returncode
        self.stderr = stderr


class RuntimeTimeout(RuntimeFailed, TimeoutError):
    """The runtime did not finish in time; its whole process group was killed."""

    retryable = True


class HostUnsupported(SandboxError):
    """The host lacks something the sandbox needs (cgroup layout, openat2, crun)."""


class SandboxNotFound(SandboxError, LookupError):
    """No sandbox with that id under this manager's data dir."""


class SandboxStateError(SandboxError):
    """The operation does not fit the sandbox's state (destroyed, paused...)."""


class PathEscape(SandboxError, PermissionError):
    """A files-API path tried to leave the sandbox root (refused by openat2 RESOLVE_IN_ROOT)."""


class UnsupportedOption(SandboxError, ValueError):
    """A requested property this slice does not enforce yet (e.g. disk limits)."""


class InvalidField(SandboxError, ValueError):
    """A request field or sandbox option is malformed or out of range; ``field`` names it.

    Raised where input enters (:mod:`sandbox.core.model`), before anything uses it; the
    service answers 400 with the field in the body.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.detail = message


class StateUnreadable(SandboxError):
    """A host-state file (a sandbox's state.json) is not what this version writes; the message names it."""


class JobNotAdmitting(SandboxStateError):
    """The sandbox's job is being preempted or was preempted: retry after ``resume``."""

    retryable = True
    fix = "retry once the job is resumed"


class JobNotFound(SandboxError, LookupError):
    """The job has no sandbox on this host and is not preempted: it has no lease to renew."""


class TooManyJobs(SandboxError):
    """A project holds as many job leases on this host as it may (``sandbox.core.leases.MAX_JOBS``);
    a new job waits until one of them ends."""

    retryable = True
    fix = ("end a job first (destroy its sandboxes; its lease goes once it lapses) or retry later; "
           "jobs of the same name share one lease")


class CommandInProgress(SandboxStateError):
    """A command with this idempotency key is still running; retry to get its result."""

    retryable = True
    fix = "retry with the same idempotency key to get its result"


class ReceiptsBroken(SandboxError):
    """A receipt log's hash chain does not hold: a record was edited, removed, reordered or cut."""


class NotARegularFile(SandboxError, OSError):
    """A files-API read or write reached a FIFO, a socket or a device node, and refused it before opening it.

    Such an entry answers reads and writes with the host's pipe, socket or device
    behind it (as host root, outside the sandbox's device cgroup), so the files API
    only lists, stats and removes it.  ``kind`` names what the entry is ("FIFO",
    "socket", "character device", "block device"), ``filename`` the path as given,
    ``errno`` is EINVAL (what truncate(2) answers for a file that is not regular).
    """

    def __init__(self, err: int, path: str, kind: str) -> None:
        super().__init__(err, f"{path} is a {kind}: the files API reads and writes only regular files "
                              "(such an entry can be stat'ed, listed or removed)", path)
        self.kind = kind

    def __str__(self) -> str:
        return str(self.strerror)


class ImageNotFound(SandboxError, LookupError):
    """No image, composition, checkpoint or run manifest by that ref that the caller may use.

    Not retryable: the ref does not resolve.  The service answers another project's
    checkpoint or run the same way (404), so refs leak nothing; the message names the ref.
    """


# -- errors on the wire ---------------------------------------------------------------------------------
# Every error code the API answers, and its HTTP status: the edge picks the status of a code it
# raises here, and a client reads the status of a code that arrives without one (an exec stream's
# error event, a terminal's rejected input: the stream had begun with 200).
ERROR_CODES: dict[str, int] = {
    "bad_request": 400, "invalid_field": 400, "unsupported_option": 400, "unsupported_isolation": 400,
    "os_error": 400,
    "unauthenticated": 401,
    "forbidden": 403, "path_escape": 403, "permission_denied": 403, "bad_signature": 403, "expired": 403,
    "not_found": 404, "sandbox_not_found": 404, "image_not_found": 404, "checkpoint_not_found": 404,
    "run_not_found": 404, "file_not_found": 404, "command_not_found": 404,
    "conflict": 409, "not_a_regular_file": 409, "file_conflict": 409,
    "body_too_large": 413,
    "quota_exceeded": 429, "command_limit": 429, "job_limit": 429, "too_many_readers": 429,
    "too_many_connections": 429, "project_limit": 429,
    "internal": 500, "sandbox_error": 500, "store_error": 500, "lazyfetch_error": 500, "snapshot_error": 500,
    "convert_error": 500, "receipts_broken": 500,
    "host_unsupported": 501,
    "port_closed": 502, "bad_gateway": 502,
    "busy": 503, "capacity": 503, "runtime_timeout": 503, "stopping": 503, "unavailable": 503,
    "port_timeout": 504,
}


class ApiError(SandboxError):
    """An error as the API answers it: ``{"error": {"code", "message", "retryable"[, "field"][, "resources"]}}``
    with an HTTP ``status`` and, where the caller should wait, ``Retry-After``.

    The edge raises it (or maps a library error to it, sandbox.edge.errors); the SDK raises its
    subclasses for the answers it gets (sandbox.sdk.errors).  ``status`` defaults to the code's
    (:data:`ERROR_CODES`); ``retry_after`` is seconds; ``field`` names the request field a 400 is
    about, ``resources`` what a quota or capacity rejection was short of.
    """

    def __init__(self, status: int | None, code: str, message: str, *, retryable: bool = False,
                 retry_after: float | None = None, field: str | None = None,
                 resources: tuple[str, ...] = ()) -> None:
        status = status if status is not None else ERROR_CODES.get(code, 500)
        # not super().__init__: the builtin bases of some client-side leaves take other arguments
        SandboxError.__init__(self, f"{message} (HTTP {status}, {code})")
        self.status, self.code, self.message, self.retryable = status, code, message, retryable
        self.retry_after = retry_after
        self.field = field
        self.resources = tuple(resources)

    def body(self) -> dict[str, Any]:
        err: dict[str, Any] = {"code": self.code, "message": self.message, "retryable": self.retryable}
        if self.field is not None:
            err["field"] = self.field
        if self.resources:
            err["resources"] = list(self.resources)
        return {"error": err}

    def headers(self) -> dict[str, str]:
        out = {}
        if self.retry_after is not None:
            out["Retry-After"] = str(max(1, round(self.retry_after)))
        if self.status == 401:
            out["WWW-Authenticate"] = "Bearer"
        return out
