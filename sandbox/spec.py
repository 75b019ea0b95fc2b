"""The OCI runtime config (config.json) of a sandbox, generated here rather than by a tool.

What it enforces is listed in docs/SECURITY.md; the lists below are the
source of truth for that document.
"""

from __future__ import annotations

import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# An idle init present in every Debian image (dash): it exits on TERM and,
# blocked in `wait`, reaps the orphans the kernel reparents to it.
IDLE_INIT = ["/bin/sh", "-c", 'trap "exit 0" TERM; while :; do sleep 3600 & wait; done']

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Docker's default set minus SETPCAP, MKNOD, NET_RAW, AUDIT_WRITE, SETFCAP, SYS_CHROOT:
# enough for package managers and chown/chmod of the sandbox's own files.
CAPABILITIES = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL",
    "CAP_SETGID", "CAP_SETUID", "CAP_NET_BIND_SERVICE",
)

# Syscalls refused with EPERM (default allow): kernel/module/boot control, mounts and
# namespace escapes, kernel attack surface (bpf, perf, userfaultfd, keyrings), tracing.
DENIED_SYSCALLS = (
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "mount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount",
    "fspick", "mount_setattr", "swapon", "swapoff", "reboot", "bpf", "perf_event_open",
    "userfaultfd", "keyctl", "add_key", "request_key", "ptrace", "process_vm_readv",
    "process_vm_writev", "setns", "open_by_handle_at", "name_to_handle_at", "acct",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "iopl", "ioperm",
    "quotactl", "lookup_dcookie", "syslog", "vhangup",
)
# Without CAP_SYS_ADMIN only a user namespace can be created; it would hand its creator
# every capability inside it (and with them the mount/netfilter attack surface).
CLONE_NEWUSER = 0x10000000

MASKED_PATHS = (
    "/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
    "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi",
    "/sys/firmware", "/sys/devices/virtual/powercap",
)
READONLY_PATHS = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")

# (path, major, minor): the only device nodes a sandbox gets (plus devpts' ptmx).
DEVICES = (
    ("/dev/null", 1, 3), ("/dev/zero", 1, 5), ("/dev/full", 1, 7),
    ("/dev/random", 1, 8), ("/dev/urandom", 1, 9), ("/dev/tty", 5, 0),
)


@dataclass(frozen=True)
class Limits:
    cpu: float = 1.0  # CPUs' worth of quota
    memory: int = 512 << 20  # bytes, no swap
    pids: int = 256
    best_effort: bool = False  # the lowest CPU weight: it yields to every latency-sensitive sandbox

    def resources(self) -> dict[str, Any]:
        period = 100_000
        shares = 2 if self.best_effort else max(2, int(1024 * self.cpu))
        return {
            "memory": {"limit": self.memory, "swap": self.memory},
            "pids": {"limit": self.pids},
            "cpu": {"quota": max(1000, int(self.cpu * period)), "period": period,
                    "shares": shares},
            "devices": [{"allow": False, "access": "rwm"}]
            + [{"allow": True, "type": "c", "major": ma, "minor": mi, "access": "rwm"} for _, ma, mi in DEVICES]
            + [{"allow": True, "type": "c", "major": 136, "access": "rwm"},  # /dev/pts/*
               {"allow": True, "type": "c", "major": 5, "minor": 2, "access": "rwm"}],  # ptmx
        }


def _seccomp_arches() -> list[str]:
    machine = platform.machine()
    if machine in ("x86_64", "amd64"):
        return ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]
    if machine in ("aarch64", "arm64"):
        return ["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"]
    return []


def seccomp_profile() -> dict[str, Any]:
    """Default allow; DENIED_SYSCALLS, and unshare/clone with CLONE_NEWUSER, fail with EPERM."""
    eperm = {"action": "SCMP_ACT_ERRNO", "errnoRet": 1}
    newuser = [{"index": 0, "value": CLONE_NEWUSER, "valueTwo": CLONE_NEWUSER, "op": "SCMP_CMP_MASKED_EQ"}]
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": _seccomp_arches(),
        "syscalls": [
            {"names": list(DENIED_SYSCALLS), **eperm},
            {"names": ["unshare"], **eperm, "args": newuser},
            {"names": ["clone"], **eperm, "args": newuser},
            # clone3 passes its flags in memory seccomp cannot read: ENOSYS makes libc fall back to clone
            {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38},
        ],
    }


def build_process(args: Sequence[str], *, env: Mapping[str, str], cwd: str, uid: int, gid: int,
                  additional_gids: Sequence[int] = ()) -> dict[str, Any]:
    caps = list(CAPABILITIES)
    granted = caps if uid == 0 else []
    return {
        "terminal": False,
        "user": {"uid": uid, "gid": gid, "additionalGids": list(additional_gids)},
        "args": list(args),
        "env": [f"{k}={v}" for k, v in env.items()],
        "cwd": cwd or "/",
        "capabilities": {"bounding": caps, "effective": granted, "permitted": granted,
                         "inheritable": [], "ambient": []},
        "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
        "noNewPrivileges": True,
    }


def build_spec(rootfs: str, process: Mapping[str, Any], *, hostname: str, cgroups_path: str,
               limits: Limits, cgroup_version: int, netns_path: str | None = None,
               userns: tuple[int, int] | None = None, userns_path: str | None = None) -> dict[str, Any]:
    """``netns_path``: join that network namespace (sandbox.network) instead of a new empty one.

    ``userns``: ``(host_base, size)`` runs the sandbox in a new user namespace
    mapping its uids and gids 0..size-1 to host_base.. (root inside is an
    unprivileged host uid); the rootfs must then be an idmapped overlay
    (sandbox.idmap) or its root-owned files show up as ``nobody``.  With
    ``userns_path`` the sandbox joins that user namespace (which must have this
    mapping) instead: a network namespace made inside it is then the sandbox's
    own, so the runtime can mount a sysfs for it.
    """
    resources = limits.resources()
    if cgroup_version == 1:
        resources["memory"].pop("swap")  # memsw exists only with swap accounting on
    profile = seccomp_profile()
    ro = ["nosuid", "noexec", "nodev", "ro"]
    spec: dict[str, Any] = {
        "ociVersion": "1.0.2",
        "process": dict(process),
        "root": {"path": rootfs, "readonly": False},
        "hostname": hostname,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
            {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
             "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ro},
            {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
             "options": ["nosuid", "noexec", "nodev", "relatime", "ro"]},
        ],
        "linux": {
            "namespaces": [{"type": t, "path": netns_path} if t == "network" and netns_path else {"type": t}
                           for t in ("pid", "network", "ipc", "uts", "mount", "cgroup")],
            "cgroupsPath": cgroups_path,
            "resources": resources,
            "devices": [{"path": p, "type": "c", "major": ma, "minor": mi, "fileMode": 0o666, "uid": 0, "gid": 0}
                        for p, ma, mi in DEVICES],
            "maskedPaths": list(MASKED_PATHS),
            "readonlyPaths": list(READONLY_PATHS),
            "seccomp": profile,
        },
    }
    if userns is not None:
        host_base, size = userns
        mapping = [{"containerID": 0, "hostID": host_base, "size": size}]
        if userns_path is not None:
            spec["linux"]["namespaces"].append({"type": "user", "path": userns_path})
        else:
            spec["linux"]["namespaces"].append({"type": "user"})
            spec["linux"]["uidMappings"] = mapping
            spec["linux"]["gidMappings"] = mapping
    return spec
