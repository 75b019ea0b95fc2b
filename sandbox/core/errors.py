"""Errors of the sandbox manager (one root, a few leaves callers catch by builtin type)."""

from __future__ import annotations

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
