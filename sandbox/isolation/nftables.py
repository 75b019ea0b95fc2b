"""nftables in-process through libnftables, the library the ``nft`` command is built on.

A policed exec reads its sandbox's counters before and after the command, and a
create loads a table: forking ``nft`` from the manager for each costs 3-10 ms (more
the larger the manager process is), the library call about 0.2 ms. The script and
JSON syntax are exactly ``nft -f`` and ``nft -j``'s, since it is the same code.

A call acts on the network namespace of the calling thread: the netlink socket is
opened by the context made inside the call. libnftables is not documented as
thread-safe, so calls are serialised; each is far shorter than any caller's work.
"""

from __future__ import annotations

import ctypes
import threading

from sandbox.core.errors import HostUnsupported, SandboxError

# from <nftables/libnftables.h>
_OUTPUT_JSON = 1 << 4
_LIBRARY = "libnftables.so.1"

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


class NftError(SandboxError):
    """libnftables refused a script; the message is nft's own (with the offending line)."""


class NftUnavailable(NftError, HostUnsupported):
    """libnftables cannot be loaded on this host."""

    fix = "apt-get install libnftables1 (part of nftables)"


def _load() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        try:
            lib = ctypes.CDLL(_LIBRARY, use_errno=True)
        except OSError as exc:
            raise NftUnavailable(f"{_LIBRARY}: {exc} (apt-get install libnftables1, part of nftables)") from None
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_free.restype = None
        lib.nft_ctx_output_get_flags.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_output_get_flags.restype = ctypes.c_uint
        lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        lib.nft_ctx_output_set_flags.restype = None
        for name in ("nft_ctx_buffer_output", "nft_ctx_buffer_error"):
            getattr(lib, name).argtypes = [ctypes.c_void_p]
            getattr(lib, name).restype = ctypes.c_int
        for name in ("nft_ctx_get_output_buffer", "nft_ctx_get_error_buffer"):
            getattr(lib, name).argtypes = [ctypes.c_void_p]
            getattr(lib, name).restype = ctypes.c_char_p
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
        _lib = lib
    return _lib


def available() -> None:
    """Raise :class:`NftUnavailable` when the library cannot be loaded."""
    _load()


def run(script: str, *, json_output: bool = False) -> str:
    """Run an ``nft -f`` script (one transaction) in the calling thread's netns; return its output."""
    lib = _load()
    with _lock:
        ctx = lib.nft_ctx_new(0)
        if not ctx:
            raise NftError("nft_ctx_new failed (out of memory?)")
        try:
            if json_output:
                lib.nft_ctx_output_set_flags(ctx, lib.nft_ctx_output_get_flags(ctx) | _OUTPUT_JSON)
            if lib.nft_ctx_buffer_output(ctx) != 0 or lib.nft_ctx_buffer_error(ctx) != 0:
                raise NftError("libnftables could not buffer its output")
            rc = lib.nft_run_cmd_from_buffer(ctx, script.encode())
            out = (lib.nft_ctx_get_output_buffer(ctx) or b"").decode(errors="replace")
            err = (lib.nft_ctx_get_error_buffer(ctx) or b"").decode(errors="replace")
        finally:
            lib.nft_ctx_free(ctx)
    if rc != 0:
        raise NftError(err.strip() or f"nft script failed (status {rc}) with no message")
    return out
