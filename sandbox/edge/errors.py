"""The one place library exceptions become API answers (status, code, retryable).

Every :class:`~layerstore.errors.LayerboxError` keeps its own ``retryable`` flag, and its
status comes from its own class (the first row of :data:`STATUS` it is an instance of), never
from a builtin base it also has: ``RangesExhausted`` (a full uid pool) is a retryable
SandboxError and answers 503, however it is built.  A LayerboxError no row names answers 503
``busy`` when retryable, else 500 with its package's code.  Only exceptions outside the tree
fall to the builtin rows: the kernel's own errors of the files API (ENOENT, EISDIR, EACCES...).
"""

from __future__ import annotations

from collections.abc import Sequence

from converters.errors import ConvertError
from layerstore.errors import LayerboxError, LayerstoreError
from layerstore.objects import BadName
from lazyfetch.errors import LazyfetchError
from sandbox.core.errors import (
    ApiError,
    HostUnsupported,
    ImageNotFound,
    InvalidField,
    JobNotFound,
    NotARegularFile,
    PathEscape,
    ReceiptsBroken,
    RuntimeTimeout,
    SandboxError,
    SandboxNotFound,
    SandboxStateError,
    TooManyJobs,
    UnsupportedOption,
)
from sandbox.host.admission import CapacityExceeded
from snapshots.errors import CheckpointMismatch, SnapshotError

# (class, code): the first row an error is an instance of decides its code, and the code its status
# (sandbox.core.errors.ERROR_CODES); more specific classes first
STATUS: Sequence[tuple[type[BaseException], str]] = (
    (CapacityExceeded, "capacity"),
    (InvalidField, "invalid_field"),
    (BadName, "invalid_field"),
    (SandboxNotFound, "sandbox_not_found"),
    (JobNotFound, "not_found"),  # a renew of a job with no sandbox here
    (TooManyJobs, "job_limit"),  # a project's job leases on this host (retryable)
    (ImageNotFound, "image_not_found"),  # e.g. FnCall on a ref that does not resolve
    (PathEscape, "path_escape"),
    (NotARegularFile, "not_a_regular_file"),
    (SandboxStateError, "conflict"),
    (CheckpointMismatch, "conflict"),  # e.g. a restore under another policy_version than it was made
    (UnsupportedOption, "unsupported_option"),
    (RuntimeTimeout, "runtime_timeout"),
    (ReceiptsBroken, "receipts_broken"),  # an integrity fault on this host: not the caller's, not transient
    (HostUnsupported, "host_unsupported"),  # this edge lacks a part (QEMU, guest assets...): another may not
)
# the package of a LayerboxError no row names, when it is not retryable
PACKAGES: Sequence[tuple[type[LayerboxError], str]] = (
    (SandboxError, "sandbox_error"), (LayerstoreError, "store_error"), (LazyfetchError, "lazyfetch_error"),
    (SnapshotError, "snapshot_error"), (ConvertError, "convert_error"),
)
# exceptions from outside the tree: the kernel's answers to the files API
BUILTINS: Sequence[tuple[type[BaseException], str]] = (
    (FileNotFoundError, "file_not_found"),
    (IsADirectoryError, "file_conflict"), (NotADirectoryError, "file_conflict"), (FileExistsError, "file_conflict"),
    (PermissionError, "permission_denied"),
    (OSError, "os_error"),
)
BUSY_RETRY_AFTER = 1.0


def code_of(cls: type[BaseException], *, retryable: bool) -> str:
    """The API code of an exception of class ``cls`` (its status is ``ERROR_CODES[code]``)."""
    for klass, code in STATUS:
        if issubclass(cls, klass):
            return code
    if issubclass(cls, LayerboxError):
        if retryable:
            return "busy"
        return next((code for klass, code in PACKAGES if issubclass(cls, klass)), "internal")
    return next((code for klass, code in BUILTINS if issubclass(cls, klass)), "internal")


def as_api_error(exc: BaseException) -> ApiError:
    """The answer for ``exc`` (an :class:`ApiError` is its own)."""
    if isinstance(exc, ApiError):
        return exc
    retryable = bool(getattr(exc, "retryable", False)) if isinstance(exc, LayerboxError) else False
    code = code_of(type(exc), retryable=retryable)
    if isinstance(exc, CapacityExceeded):
        return ApiError(None, code, str(exc), retryable=True, retry_after=exc.retry_after, resources=exc.resources)
    if isinstance(exc, InvalidField):
        return invalid(exc.field, exc.detail)
    if code == "file_not_found":
        return ApiError(None, code, f"no such file or directory: {getattr(exc, 'filename', None) or exc}")
    if code == "file_conflict":
        return ApiError(None, code, f"{getattr(exc, 'strerror', None)}: {getattr(exc, 'filename', None) or exc}")
    if code == "internal":
        return ApiError(None, code, f"{type(exc).__name__}: {exc}")
    return ApiError(None, code, str(exc), retryable=retryable,
                    retry_after=BUSY_RETRY_AFTER if code == "busy" else None)


def invalid(field: str, message: str) -> ApiError:
    """400 ``invalid_field`` naming ``field``."""
    return ApiError(None, "invalid_field", f"{field}: {message}", field=field)
