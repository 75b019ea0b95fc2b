"""Errors raised while fetching layers and mounting them on the host."""

from __future__ import annotations

import os

from layerstore.errors import LayerboxError


class LazyfetchError(LayerboxError):
    """Root of every error the lazyfetch package raises on purpose."""


class MountArgumentError(LazyfetchError, ValueError):
    """A mount request cannot be expressed to the kernel at all.

    Raised before any system call, e.g. for a comma in a path that must go
    into a comma-separated option string, or an option string longer than the
    one page ``mount(2)`` copies.  The message names the path and the fix.
    """


class KernelMountError(LazyfetchError, OSError):
    """The kernel refused a mount or unmount.

    ``errno`` is the kernel's error number (so ``except OSError`` callers and
    errno checks keep working) and ``filename`` the mount point.  ``source``,
    ``fstype`` and ``options`` describe the request; ``kernel_log`` holds the
    messages the kernel attached to the filesystem context (new mount API
    only; ``mount(2)`` sends its reasons to dmesg instead).
    """

    def __init__(
        self,
        err: int,
        *,
        operation: str,
        source: str | None,
        mountpoint: str,
        fstype: str | None,
        options: str = "",
        hint: str = "",
        kernel_log: tuple[str, ...] = (),
    ) -> None:
        OSError.__init__(self, err, os.strerror(err), mountpoint)
        self.operation = operation
        self.source = source
        self.mountpoint = mountpoint
        self.fstype = fstype
        self.options = options
        self.hint = hint
        self.fix = hint or None
        self.kernel_log = kernel_log

    def __str__(self) -> str:
        what = f"{self.operation} failed: "
        if self.source is not None:
            what += f"{self.source!r} on "
        what += repr(self.mountpoint)
        if self.fstype:
            what += f" (type {self.fstype}"
            what += f", options {self.options!r})" if self.options else ")"
        msg = f"{what}: [Errno {self.errno}] {self.strerror}"
        if self.kernel_log:
            msg += "; kernel says: " + " | ".join(self.kernel_log)
        if self.hint:
            msg += f" ({self.hint})"
        return msg


class FanotifyError(LazyfetchError, OSError):
    """The kernel refused a fanotify call (lazyfetch/fanotify.py).

    ``errno`` is the kernel's error number and ``filename`` the marked path
    when there is one; the message names the call and, where known, the fix.
    """

    def __init__(self, err: int, operation: str, *, path: str | None = None, hint: str = "") -> None:
        OSError.__init__(self, err, os.strerror(err), path)
        self.operation = operation
        self.hint = hint
        self.fix = hint or None

    def __str__(self) -> str:
        msg = f"{self.operation}: [Errno {self.errno}] {self.strerror}"
        return f"{msg} ({self.hint})" if self.hint else msg


class JournalError(LazyfetchError):
    """The in-flight journal (lazyfetch/inflight.py) holds bytes that are not fanotify events."""


class HolderError(LazyfetchError):
    """The fd holder (lazyfetch/holder.py) could not be started, reached or understood."""


class FuseServerError(LazyfetchError):
    """The FUSE server cannot serve this connection (lazyfetch/fuseserver.py).

    Raised by ``FuseServer.serve`` when the kernel speaks a protocol version the
    server does not (the message names both) or the device fails in a way that
    no request explains; the caller should unmount and mount afresh.
    """

    fix = "unmount the layer and mount it afresh"
