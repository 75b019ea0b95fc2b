"""The sandbox's seccomp profile compiled once, so crun does not compile it at every create.

crun turns the OCI profile into a BPF program with libseccomp on each ``crun
create``; for the allowlist (about 330 calls on three x86 ABIs) that is ~20 ms
of a ~40 ms create on this host (measured: 18.7 ms with the old denylist,
38.6 ms with the allowlist, 17.1 ms with only the native ABI).  The profile is
the same for every sandbox, so it is compiled here once per process, with the
same libseccomp and the same translation crun uses (default action, each
architecture, then each rule in order: without arguments ``seccomp_rule_add``,
with arguments ``seccomp_rule_add_array``, one rule per argument when an index
repeats), and handed to crun as the ``run.oci.seccomp_bpf_data`` annotation
(base64), which crun loads instead of compiling.  The OCI ``seccomp`` section
stays in the config for any other runtime.  Without libseccomp the annotation
is left out and crun compiles as before.
"""

from __future__ import annotations

import base64
import ctypes
import ctypes.util
import errno
import functools
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from sandbox.core.errors import SandboxError

log = logging.getLogger("layerbox.sandbox")

ANNOTATION = "run.oci.seccomp_bpf_data"

# <seccomp.h>
_ACT_KILL, _ACT_TRAP, _ACT_ALLOW, _ACT_LOG = 0x00000000, 0x00030000, 0x7FFF0000, 0x7FFC0000
_ERRNO_BASE = 0x00050000
_OPS = {"SCMP_CMP_NE": 1, "SCMP_CMP_LT": 2, "SCMP_CMP_LE": 3, "SCMP_CMP_EQ": 4, "SCMP_CMP_GE": 5,
        "SCMP_CMP_GT": 6, "SCMP_CMP_MASKED_EQ": 7}
_NR_SCMP_ERROR = -1


class SeccompCompileError(SandboxError):
    """libseccomp refused the profile, or is missing; the message names the call and the rule.

    Not an ``OSError``: no caller catches it as one; :func:`annotation` catches it by
    name and lets crun compile the profile instead.
    """


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


@functools.cache
def _lib() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("seccomp")
    if name is None:
        return None
    lib = ctypes.CDLL(name, use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_arch_resolve_name.restype = ctypes.c_uint32
    lib.seccomp_arch_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_arch_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


def _action(name: str, errno_ret: int | None, default_errno: int = errno.EPERM) -> int:
    if name == "SCMP_ACT_ALLOW":
        return _ACT_ALLOW
    if name == "SCMP_ACT_ERRNO":
        return _ERRNO_BASE | ((errno_ret if errno_ret is not None else default_errno) & 0xFFFF)
    if name in ("SCMP_ACT_KILL", "SCMP_ACT_KILL_THREAD"):
        return _ACT_KILL
    if name == "SCMP_ACT_TRAP":
        return _ACT_TRAP
    if name == "SCMP_ACT_LOG":
        return _ACT_LOG
    raise SeccompCompileError(f"seccomp action {name!r} is not one layerbox compiles (it compiles "
                              "ALLOW, ERRNO, KILL, KILL_THREAD, TRAP and LOG)")


def compile_bpf(profile: Mapping[str, Any]) -> bytes:
    """The BPF program of an OCI seccomp ``profile``, as crun would build it; raises
    :class:`SeccompCompileError` (or returns nothing usable: see :func:`annotation`)."""
    lib = _lib()
    if lib is None:
        raise SeccompCompileError("libseccomp is not installed", fix="apt-get install libseccomp2")
    default = _action(profile["defaultAction"], profile.get("defaultErrnoRet"))
    ctx = lib.seccomp_init(default)
    if not ctx:
        raise SeccompCompileError(f"seccomp_init refused the default action {profile['defaultAction']!r}")

    def check(ret: int, what: str) -> None:
        if ret < 0 and ret != -errno.EEXIST:
            raise SeccompCompileError(f"{what}: [Errno {-ret}] {os.strerror(-ret)}")

    try:
        for arch in profile.get("architectures") or []:
            token = lib.seccomp_arch_resolve_name(arch.removeprefix("SCMP_ARCH_").lower().encode())
            if token == 0:
                raise SeccompCompileError(f"unknown seccomp architecture {arch!r}: libseccomp has no such name")
            check(lib.seccomp_arch_add(ctx, token), f"seccomp_arch_add({arch})")
        for rule in profile.get("syscalls") or []:
            action = _action(rule["action"], rule.get("errnoRet"))
            if action == default:
                continue
            args = rule.get("args") or []
            cmps = [_ArgCmp(a["index"], _OPS[a["op"]], a.get("value", 0), a.get("valueTwo", 0)) for a in args]
            # one index twice cannot be one conjunction: one rule per comparison (as crun does)
            groups = [cmps] if len({a["index"] for a in args}) == len(args) else [[c] for c in cmps]
            for name in rule["names"]:
                nr = lib.seccomp_syscall_resolve_name(name.encode())
                if nr == _NR_SCMP_ERROR:
                    log.warning("seccomp: syscall %s is unknown to libseccomp; skipped, as crun does", name)
                    continue
                for group in groups:
                    array = (_ArgCmp * max(1, len(group)))(*group)
                    check(lib.seccomp_rule_add_array(ctx, action, nr, len(group), array),
                          f"seccomp_rule_add_array({name}, {rule['action']})")
        fd = os.memfd_create("layerbox-seccomp", os.MFD_CLOEXEC)
        try:
            check(lib.seccomp_export_bpf(ctx, fd), "seccomp_export_bpf")
            size = os.lseek(fd, 0, os.SEEK_CUR)
            return os.pread(fd, size, 0)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)


@functools.cache
def _annotation_of(profile_json: str) -> str | None:
    try:
        bpf = compile_bpf(json.loads(profile_json))
    except (SeccompCompileError, KeyError) as exc:
        log.warning("seccomp profile not precompiled (crun compiles it at each create): %s", exc)
        return None
    return base64.b64encode(bpf).decode()


def annotation(profile: Mapping[str, Any]) -> dict[str, str]:
    """``{ANNOTATION: base64 BPF}`` for an OCI config, compiled once per profile; empty without libseccomp."""
    data = _annotation_of(json.dumps(profile, sort_keys=True))
    return {ANNOTATION: data} if data is not None else {}
