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
import errno
import os
import socket
import struct
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


# -- named counters over raw netlink -----------------------------------------------------------------------
# from <linux/netlink.h>, <linux/netfilter/nfnetlink.h> and <linux/netfilter/nf_tables.h>
_NETLINK_NETFILTER = 12
_NLM_F_REQUEST, _NLM_F_ACK, _NLM_F_DUMP = 0x1, 0x4, 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_NFNL_SUBSYS_NFTABLES = 10
_NFT_MSG_NEWOBJ, _NFT_MSG_GETOBJ = 18, 19
_NFPROTO_INET = 1
_NFTA_OBJ_TABLE, _NFTA_OBJ_NAME, _NFTA_OBJ_TYPE, _NFTA_OBJ_DATA = 1, 2, 3, 4
_NFT_OBJECT_COUNTER = 1
_NFTA_COUNTER_BYTES, _NFTA_COUNTER_PACKETS = 1, 2
_NLA_TYPE_MASK = 0x3FFF
_RECV_BYTES = 1 << 16


def _attrs(buf: bytes, start: int, end: int) -> dict[int, bytes]:
    """The netlink attributes in ``buf[start:end]`` by type (nesting and byte-order flags cleared)."""
    out: dict[int, bytes] = {}
    while start + 4 <= end:
        length, kind = struct.unpack_from("=HH", buf, start)
        if length < 4:
            break
        out[kind & _NLA_TYPE_MASK] = buf[start + 4:start + length]
        start += (length + 3) & ~3
    return out


def _attr(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def named_counters(table: str) -> dict[str, tuple[int, int]]:
    """The named counter objects of the ``inet`` table ``table`` in the calling thread's netns, as
    ``{name: (packets, bytes)}``: one netlink dump, no libnftables context (which costs ~0.7 ms
    to make and fills a cache of the whole ruleset).  A missing table is an empty answer."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, _NETLINK_NETFILTER)
    try:
        body = struct.pack("=BBH", _NFPROTO_INET, 0, 0) + _attr(_NFTA_OBJ_TABLE, table.encode() + b"\0") + \
            _attr(_NFTA_OBJ_TYPE, struct.pack(">I", _NFT_OBJECT_COUNTER))
        kind = (_NFNL_SUBSYS_NFTABLES << 8) | _NFT_MSG_GETOBJ
        sock.send(struct.pack("=IHHII", 16 + len(body), kind, _NLM_F_REQUEST | _NLM_F_ACK | _NLM_F_DUMP, 1, 0) + body)
        return _collect(sock)
    finally:
        sock.close()


def _collect(sock: socket.socket) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    while True:
        buf = sock.recv(_RECV_BYTES)
        if not buf:
            raise NftError("netlink closed before the end of the counter dump")
        at = 0
        while at + 16 <= len(buf):
            length, kind = struct.unpack_from("=IH", buf, at)
            if length < 16:
                raise NftError(f"malformed netlink message of {length} bytes in the counter dump")
            if kind == _NLMSG_DONE:
                return out
            if kind == _NLMSG_ERROR:
                (err,) = struct.unpack_from("=i", buf, at + 16)
                if err == 0:
                    at += (length + 3) & ~3
                    continue
                if -err == errno.ENOENT:
                    return out
                raise NftError(f"netlink counter dump: {os.strerror(-err)}")
            if kind & 0xFF == _NFT_MSG_NEWOBJ:
                attrs = _attrs(buf, at + 20, at + length)  # after nlmsghdr (16) and nfgenmsg (4)
                data = _attrs(attrs.get(_NFTA_OBJ_DATA, b""), 0, len(attrs.get(_NFTA_OBJ_DATA, b"")))
                name = attrs.get(_NFTA_OBJ_NAME, b"").rstrip(b"\0").decode(errors="replace")
                if name and _NFTA_COUNTER_PACKETS in data and _NFTA_COUNTER_BYTES in data:
                    out[name] = (struct.unpack(">Q", data[_NFTA_COUNTER_PACKETS])[0],
                                 struct.unpack(">Q", data[_NFTA_COUNTER_BYTES])[0])
            at += (length + 3) & ~3
