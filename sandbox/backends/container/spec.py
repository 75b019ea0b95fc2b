"""The OCI runtime config (config.json) of a sandbox, generated here rather than by a tool.

What it enforces is listed in docs/SECURITY.md; the lists below are the
source of truth for that document.
"""

from __future__ import annotations

import errno
import functools
import os
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbox.core.errors import HostUnsupported, SandboxError
from sandbox.core.model import DEFAULT_CPU, DEFAULT_MEMORY, DEFAULT_PIDS
from sandbox.isolation import seccomp

# Every container's PID 1: the host's catatonit (static; Debian's package) in pause mode, which
# waits for signals, exits on TERM and reaps the orphans the kernel reparents to it.  It is
# bound read-only from the host, so an image needs no shell (distroless, scratch) and a sandbox
# holds one process, not a shell and its sleep (two tasks each, which every pivot_root walks).
# In /dev's tmpfs, the bind's file is never in the rootfs's upper, so never in a checkpoint.
INIT_PATH = "/dev/.layerbox-init"
IDLE_INIT = [INIT_PATH, "-P"]
INIT_BINARY = "catatonit"

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Docker's default set minus SETPCAP, MKNOD, NET_RAW, AUDIT_WRITE, SETFCAP, SYS_CHROOT:
# enough for package managers and chown/chmod of the sandbox's own files.
CAPABILITIES = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL",
    "CAP_SETGID", "CAP_SETUID", "CAP_NET_BIND_SERVICE",
)

# seccomp is an allowlist.  A syscall named nowhere below fails with ENOSYS, the answer
# of a kernel that lacks it: libc and language runtimes take ENOSYS as "older kernel, use
# the older call" (glibc does for clone3 and fchmodat2), so programs built for newer
# kernels keep working while whatever a future kernel adds stays closed.  EPERM there
# would read as a refusal and end those programs instead.
SECCOMP_DEFAULT_ERRNO = errno.ENOSYS

# What shells, python, package managers, compilers, git and network clients and servers
# call on x86_64 and aarch64.  The 32-bit names (mmap2, fcntl64, *32, ipc, ...) serve
# i386/arm programs: libseccomp maps each name to every architecture's own number and
# leaves out the ones an architecture does not have.
ALLOWED_SYSCALLS = (
    # processes and threads (clone and unshare: by flags, below)
    "execve", "execveat", "fork", "vfork", "exit", "exit_group", "wait4", "waitid", "waitpid",
    "kill", "tkill", "tgkill", "pidfd_open", "pidfd_send_signal", "getpid", "getppid", "gettid",
    "getpgid", "setpgid", "getpgrp", "getsid", "setsid", "set_tid_address", "set_robust_list",
    "get_robust_list", "rseq", "futex", "futex_time64", "futex_waitv", "futex_wake",
    "futex_wait", "futex_requeue", "membarrier", "restart_syscall", "prctl", "arch_prctl",
    "set_thread_area", "get_thread_area", "set_tls", "capget", "capset", "uname", "sysinfo",
    "getcpu", "getrandom", "seccomp", "landlock_create_ruleset", "landlock_add_rule",
    "landlock_restrict_self",
    # scheduling and limits
    "sched_yield", "sched_getaffinity", "sched_setaffinity", "sched_getparam", "sched_setparam",
    "sched_getscheduler", "sched_setscheduler", "sched_getattr", "sched_setattr",
    "sched_get_priority_max", "sched_get_priority_min", "sched_rr_get_interval",
    "sched_rr_get_interval_time64", "getpriority", "setpriority", "ioprio_get", "ioprio_set",
    "getrlimit", "setrlimit", "ugetrlimit", "prlimit64", "getrusage", "times", "umask",
    # identity (the capability set decides which changes succeed)
    "getuid", "geteuid", "getgid", "getegid", "getresuid", "getresgid", "getgroups", "setuid",
    "setgid", "setreuid", "setregid", "setresuid", "setresgid", "setfsuid", "setfsgid",
    "setgroups", "getuid32", "geteuid32", "getgid32", "getegid32", "getresuid32",
    "getresgid32", "getgroups32", "setuid32", "setgid32", "setreuid32", "setregid32",
    "setresuid32", "setresgid32", "setfsuid32", "setfsgid32", "setgroups32",
    # signals, timers, clocks (reading them; setting them is denied below)
    "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigpending", "rt_sigsuspend",
    "rt_sigtimedwait", "rt_sigtimedwait_time64", "rt_sigqueueinfo", "rt_tgsigqueueinfo",
    "sigaltstack", "sigreturn", "sigprocmask", "signalfd", "signalfd4", "pause", "alarm",
    "getitimer", "setitimer", "timer_create", "timer_delete", "timer_settime",
    "timer_settime64", "timer_gettime", "timer_gettime64", "timer_getoverrun",
    "timerfd_create", "timerfd_settime", "timerfd_settime64", "timerfd_gettime",
    "timerfd_gettime64", "clock_gettime", "clock_gettime64", "clock_getres",
    "clock_getres_time64", "clock_nanosleep", "clock_nanosleep_time64", "nanosleep",
    "gettimeofday", "time",
    # memory
    "brk", "mmap", "mmap2", "munmap", "mprotect", "mremap", "madvise", "mincore", "msync",
    "mlock", "mlock2", "munlock", "mlockall", "munlockall", "remap_file_pages",
    "memfd_create", "pkey_alloc", "pkey_free", "pkey_mprotect", "map_shadow_stack",
    "cacheflush",
    # files and directories
    "read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev", "preadv2",
    "pwritev2", "open", "openat", "openat2", "creat", "close", "close_range", "dup", "dup2",
    "dup3", "lseek", "_llseek", "fcntl", "fcntl64", "ioctl", "flock", "fsync", "fdatasync",
    "sync", "syncfs", "sync_file_range", "sync_file_range2", "arm_sync_file_range",
    "fallocate", "ftruncate", "ftruncate64", "truncate", "truncate64", "fadvise64",
    "fadvise64_64", "arm_fadvise64_64", "readahead", "sendfile", "sendfile64",
    "copy_file_range", "splice", "tee", "stat", "lstat", "fstat", "newfstatat", "stat64",
    "lstat64", "fstat64", "fstatat64", "statx", "statfs", "fstatfs", "statfs64", "fstatfs64",
    "access", "faccessat", "faccessat2", "readlink", "readlinkat", "getdents", "getdents64",
    "getcwd", "chdir", "fchdir", "mkdir", "mkdirat", "rmdir", "rename", "renameat",
    "renameat2", "link", "linkat", "symlink", "symlinkat", "unlink", "unlinkat", "chmod",
    "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat", "chown32",
    "fchown32", "lchown32", "utime", "utimes", "utimensat", "utimensat_time64", "futimesat",
    "mknod", "mknodat", "getxattr", "lgetxattr", "fgetxattr", "setxattr", "lsetxattr",
    "fsetxattr", "listxattr", "llistxattr", "flistxattr", "removexattr", "lremovexattr",
    "fremovexattr", "inotify_init", "inotify_init1", "inotify_add_watch", "inotify_rm_watch",
    # pipes, polling, event fds, Linux AIO (io_uring is denied below)
    "pipe", "pipe2", "poll", "ppoll", "ppoll_time64", "select", "_newselect", "pselect6",
    "pselect6_time64", "epoll_create", "epoll_create1", "epoll_ctl", "epoll_wait",
    "epoll_pwait", "epoll_pwait2", "eventfd", "eventfd2", "io_setup", "io_destroy",
    "io_submit", "io_cancel", "io_getevents", "io_pgetevents", "io_pgetevents_time64",
    # sockets (socket and socketpair: by address family, below)
    "bind", "connect", "listen", "accept", "accept4", "getsockname", "getpeername",
    "getsockopt", "setsockopt", "shutdown", "sendto", "recvfrom", "sendmsg", "recvmsg",
    "sendmmsg", "recvmmsg", "recvmmsg_time64", "send", "recv",
    # System V IPC and POSIX message queues (the sandbox has its own IPC namespace)
    "ipc", "semget", "semop", "semtimedop", "semtimedop_time64", "semctl", "msgget", "msgsnd",
    "msgrcv", "msgctl", "shmget", "shmat", "shmdt", "shmctl", "mq_open", "mq_unlink",
    "mq_timedsend", "mq_timedsend_time64", "mq_timedreceive", "mq_timedreceive_time64",
    "mq_notify", "mq_getsetattr",
)

# Refused with EPERM, so a program reads a refusal rather than a missing feature: kernel,
# module and boot control; mounts and joining namespaces; the widest kernel attack
# surfaces (io_uring, bpf, perf, userfaultfd, keyrings, fanotify); reaching into other
# processes; setting clocks.  socketcall, the i386 multiplexer, carries its arguments in
# memory seccomp cannot read, so allowing it would let a 32-bit program open AF_VSOCK.
DENIED_SYSCALLS = (
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot",
    "swapon", "swapoff", "acct", "syslog", "vhangup", "iopl", "ioperm", "quotactl",
    "quotactl_fd", "lookup_dcookie",
    "mount", "umount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr", "setns", "sethostname", "setdomainname",
    "open_by_handle_at", "name_to_handle_at",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "bpf", "perf_event_open",
    "userfaultfd", "keyctl", "add_key", "request_key", "fanotify_init",
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "kcmp",
    "pidfd_getfd",
    "settimeofday", "clock_settime", "clock_settime64", "clock_adjtime", "clock_adjtime64",
    "adjtimex",
    "socketcall",
)

# Without CAP_SYS_ADMIN only a user namespace can be created; it would hand its creator
# every capability inside it (and with them the mount/netfilter attack surface).
CLONE_NEWUSER = 0x10000000

# socket/socketpair families a sandbox may open (netlink is getaddrinfo's and ip's); any
# other family fails like an unlisted syscall (the rarely used families are where socket
# bugs have been, and AF_PACKET would need CAP_NET_RAW anyway).
SOCKET_FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10, "AF_NETLINK": 16}
# AF_VSOCK talks to the hypervisor and its agents past the network namespace: EPERM.
AF_VSOCK = 40

# personality(2) values Docker allows: Linux, 32-bit uname (PER_LINUX32), UNAME26, both,
# and 0xffffffff (query only).  The rest (ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC,
# MMAP_PAGE_ZERO, ...) turn address-space defences off and fail like an unlisted syscall.
PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)

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


CFS_PERIOD = 100_000  # microseconds: the kernel's default period, so a new cgroup has it already


@dataclass(frozen=True)
class OciLimits:
    """The OCI ``linux.resources`` of a sandbox (defaults: the model's)."""

    cpu: float = DEFAULT_CPU  # CPUs' worth of quota
    memory: int = DEFAULT_MEMORY  # bytes, no swap
    pids: int = DEFAULT_PIDS
    best_effort: bool = False  # the lowest CPU weight: it yields to every latency-sensitive sandbox

    def cpu_bandwidth(self) -> tuple[int, int]:
        """CFS quota and period, in microseconds."""
        return max(1000, int(self.cpu * CFS_PERIOD)), CFS_PERIOD

    def resources(self, *, bandwidth_set: bool = False) -> dict[str, Any]:
        """``bandwidth_set``: the cgroup has :meth:`cpu_bandwidth` already (a kept one, reused), so
        crun is not asked to write it again: each write of the quota or the period walks every CPU
        cgroup of the host under one mutex (``tg_set_cfs_bandwidth``), 2.3 ms of a create's kernel
        time with 3,200 sandboxes held (bench/README.md, "Where the growth ... goes")."""
        quota, period = self.cpu_bandwidth()
        shares = 2 if self.best_effort else max(2, int(1024 * self.cpu))
        return {
            "memory": {"limit": self.memory, "swap": self.memory},
            "pids": {"limit": self.pids},
            "cpu": {"shares": shares} if bandwidth_set else {"quota": quota, "period": period, "shares": shares},
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


def _low32_is(index: int, value: int) -> dict[str, Any]:
    # The filter sees the whole 64-bit register, the kernel only the low half of an int
    # argument: 0x1_0000_0028 is socket(AF_VSOCK) too, so compare what the kernel reads.
    return {"index": index, "value": 0xFFFFFFFF, "valueTwo": value, "op": "SCMP_CMP_MASKED_EQ"}


def seccomp_profile() -> dict[str, Any]:
    """ALLOWED_SYSCALLS run, DENIED_SYSCALLS fail with EPERM, everything else with ENOSYS.

    By argument: clone/unshare run without CLONE_NEWUSER (with it: EPERM), socket and
    socketpair for SOCKET_FAMILIES (AF_VSOCK: EPERM), personality for PERSONALITIES;
    other arguments get the default, ENOSYS.  clone3 fails with ENOSYS.
    """
    allow = {"action": "SCMP_ACT_ALLOW"}

    def refuse(err: int) -> dict[str, Any]:
        return {"action": "SCMP_ACT_ERRNO", "errnoRet": err}

    def newuser(value: int) -> list[dict[str, Any]]:
        return [{"index": 0, "value": CLONE_NEWUSER, "valueTwo": value, "op": "SCMP_CMP_MASKED_EQ"}]

    sockets = ["socket", "socketpair"]
    return {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": SECCOMP_DEFAULT_ERRNO,
        "architectures": _seccomp_arches(),
        # Order matters to libseccomp: on i386 it also maps socket rules onto socketcall, and
        # refuses them (crun create fails) unless socketcall (DENIED_SYSCALLS) was decided
        # first.  An argument rule cannot have an errno of its own for "any other value":
        # a rule without arguments for the same call overrides it, so that is the default.
        "syscalls": [
            {"names": list(ALLOWED_SYSCALLS), **allow},
            {"names": list(DENIED_SYSCALLS), **refuse(errno.EPERM)},
            {"names": ["clone", "unshare"], **allow, "args": newuser(0)},
            {"names": ["clone", "unshare"], **refuse(errno.EPERM), "args": newuser(CLONE_NEWUSER)},
            # clone3 passes its flags in memory seccomp cannot read: ENOSYS makes libc fall back
            # to clone (named although it is the default, so a change of default cannot break it)
            {"names": ["clone3"], **refuse(errno.ENOSYS)},
            *({"names": sockets, **allow, "args": [_low32_is(0, family)]}
              for family in SOCKET_FAMILIES.values()),
            {"names": sockets, **refuse(errno.EPERM), "args": [_low32_is(0, AF_VSOCK)]},
            *({"names": ["personality"], **allow, "args": [_low32_is(0, value)]}
              for value in PERSONALITIES),
        ],
    }


def _cgroup_mounts(binds: Sequence[tuple[str, Path]], ro: list[str], masks: Masks | None) -> list[dict[str, Any]]:
    if not binds:
        return [{"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
                 "options": ["nosuid", "noexec", "nodev", "relatime", "ro"]}]
    if masks is not None:  # the shared skeleton, read-only: no file system of its own
        base: dict[str, Any] = {"destination": "/sys/fs/cgroup", "type": "bind", "source": str(masks.cgroup),
                                "options": ["bind", *ro]}
    else:
        # (not read-only itself, like the tmpfs crun mounts there: readonlyPaths on it would copy the
        # binds under it read-write; a sandbox may write 64 KiB of its own memory there, nothing else)
        base = {"destination": "/sys/fs/cgroup", "type": "tmpfs", "source": "tmpfs",
                "options": ["nosuid", "noexec", "nodev", "mode=755", "size=64k"]}
    return [base, *({"destination": f"/sys/fs/cgroup/{name}", "type": "bind", "source": str(source),
                     "options": ["bind", *ro]} for name, source in binds)]


@dataclass(frozen=True)
class Masks:
    """Host directories every container's masks are bound from, read-only, instead of a tmpfs of
    its own for each (what crun mounts for a masked directory, and for ``/sys/fs/cgroup``).

    Every file system a container mounts is a superblock with two memcg-aware list_lrus, and the
    kernel walks every list_lru on the host, under one mutex, each time a memory cgroup goes
    offline (``memcg_reparent_list_lrus``) and takes that mutex to mount or unmount one: at 3,200
    held, a tenth of the host's CPU went there and creates queued on the mutex (bench/README.md,
    "Dense hosts").  ``empty``: an empty directory (0555); ``cgroup``: one directory per cgroup v1
    hierarchy a container sees (the mount points of its own cgroup's binds)."""

    empty: Path
    cgroup: Path

    def ensure(self, hierarchies: Sequence[str]) -> None:
        """Made (root's, read and search for all, written by none) with these hierarchies' mount points."""
        for d in (self.empty.parent, self.empty, self.cgroup, *(self.cgroup / name for name in hierarchies)):
            d.mkdir(mode=0o755, exist_ok=True)
        for d in (self.cgroup, *(self.cgroup / name for name in hierarchies), self.empty):
            os.chmod(d, 0o555)
        os.chmod(self.empty.parent, 0o711)  # (traversed by a user namespace's crun, never listed)
        for stray in self.empty.iterdir():  # (nothing writes here; a stray entry would show in every mask)
            raise SandboxError(f"{self.empty} masks directories in every container, so it must be empty, but it "
                               f"holds {stray.name!r}: remove what it holds")


def _masked(masks: Masks | None, ro: list[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """The masked directories as read-only binds of ``masks.empty`` and the paths crun still masks
    (files, with /dev/null; all of them without ``masks``).  A directory the host's kernel does not
    have is not in the container's /proc or /sys either: crun would skip it, and so does this."""
    if masks is None:
        return [], list(MASKED_PATHS)
    binds, left = [], []
    for path in MASKED_PATHS:
        if os.path.isdir(path):
            binds.append({"destination": path, "type": "bind", "source": str(masks.empty), "options": ["bind", *ro]})
        elif os.path.lexists(path):
            left.append(path)
    return binds, left


@functools.cache
def init_binary() -> str:
    """The host's static init (:data:`IDLE_INIT`), bound into every container."""
    for d in ("/usr/bin", "/usr/libexec/podman", "/usr/local/bin"):
        path = os.path.join(d, INIT_BINARY)
        if os.access(path, os.X_OK):
            return path
    raise HostUnsupported(f"{INIT_BINARY}: not installed (apt-get install catatonit, or `make deps`): it is every "
                       "container's init")


@functools.cache
def _precompiled_seccomp() -> dict[str, str]:
    return seccomp.annotation(seccomp_profile())


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


def _system_mounts(ro: list[str], sysfs: str | None) -> list[dict[str, Any]]:
    """/proc, /dev (with the init and the pseudo-terminals) and /sys (``sysfs``: build_spec)."""
    return [
        {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": INIT_PATH, "type": "bind", "source": init_binary(), "options": ["bind", "ro", "nosuid", "nodev"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ro} if sysfs is None
        else {"destination": "/sys", "type": "bind", "source": sysfs, "options": ["bind", *ro]},
    ]


def build_spec(rootfs: str, process: Mapping[str, Any], *, hostname: str, cgroups_path: str,
               limits: OciLimits, cgroup_version: int, netns_path: str | None = None,
               userns: tuple[int, int] | None = None, userns_path: str | None = None,
               cgroup_binds: Sequence[tuple[str, Path]] = (), masks: Masks | None = None,
               bandwidth_set: bool = False, period_set: bool = False, sysfs: str | None = None) -> dict[str, Any]:
    """``netns_path``: join that network namespace (sandbox.isolation.network) instead of a new empty one.

    ``userns``: ``(host_base, size)`` runs the sandbox in a new user namespace
    mapping its uids and gids 0..size-1 to host_base.. (root inside is an
    unprivileged host uid); the rootfs must then be an idmapped overlay
    (sandbox.isolation.idmap) or its root-owned files show up as ``nobody``.  With
    ``userns_path`` the sandbox joins that user namespace (which must have this
    mapping) instead: a network namespace made inside it is then the sandbox's
    own, so the runtime can mount a sysfs for it.

    ``sysfs``: a sysfs mounted from an empty network namespace (sandbox.isolation.sysfs), bound
    read-only as ``/sys`` instead of a sysfs of the container's own; for a container whose network
    namespace is new and so holds only ``lo``.

    ``bandwidth_set``: the cgroup at ``cgroups_path`` has the limits' CPU bandwidth already
    (:meth:`OciLimits.resources`); ``period_set``: it has at least their CFS period (a new
    cgroup has the kernel's default, :data:`CFS_PERIOD`), so a v1 container writes the quota
    alone: the period's write was a second walk of every CPU cgroup on the host.

    ``cgroup_binds`` (cgroup v1: ``CgroupLayout.binds``): each hierarchy's directory of this
    container bound read-only under ``/sys/fs/cgroup`` (on ``masks.cgroup``: :class:`Masks`), as
    runc gives a v1 container without a cgroup namespace.  crun mounting each hierarchy afresh
    took the cgroup mutex and drained every offline cgroup on the host first: with 3,200 held,
    each create waited, and the other creator's exec behind it (bench/README.md, "Dense hosts").
    """
    resources = limits.resources(bandwidth_set=bandwidth_set)
    if cgroup_version == 1:
        resources["memory"].pop("swap")  # memsw exists only with swap accounting on
        if period_set:  # (v2's quota and period are one file, cpu.max: one write, one walk)
            resources["cpu"].pop("period", None)
    profile = seccomp_profile()
    ro = ["nosuid", "noexec", "nodev", "ro"]
    mask_binds, masked = _masked(masks, ro)
    spec: dict[str, Any] = {
        "ociVersion": "1.0.2",
        "process": dict(process),
        "root": {"path": rootfs, "readonly": False},
        "hostname": hostname,
        "mounts": [*_system_mounts(ro, sysfs), *_cgroup_mounts(cgroup_binds, ro, masks), *mask_binds],
        "linux": {
            "namespaces": [{"type": t, "path": netns_path} if t == "network" and netns_path else {"type": t}
                           for t in ("pid", "network", "ipc", "uts", "mount", "cgroup")],
            "cgroupsPath": cgroups_path,
            "resources": resources,
            "devices": [{"path": p, "type": "c", "major": ma, "minor": mi, "fileMode": 0o666, "uid": 0, "gid": 0}
                        for p, ma, mi in DEVICES],
            "maskedPaths": masked,
            "readonlyPaths": list(READONLY_PATHS),
            "seccomp": profile,
        },
        # the same profile, compiled once per process: crun loads it instead of compiling it (~20 ms)
        "annotations": dict(_precompiled_seccomp()),
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
