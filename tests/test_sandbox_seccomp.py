"""The seccomp allowlist (sandbox.backends.container.spec.seccomp_profile) inside real sandboxes: real crun, real kernel.

Each row of ATTACKS is a syscall a hostile agent could issue from inside a sandbox
(through ctypes, so no libc wrapper stands in between) and the answer the profile
gives it; ORDINARY rows are calls every program makes and must reach the kernel.
The arguments are chosen so the kernel's own answer differs from the filter's
where it can (read(-1) is EBADF from the kernel, setns(-1) would be EBADF too but
the filter answers EPERM first).  The second half runs ordinary workloads.
"""

from __future__ import annotations

import ctypes
import errno
import json
import platform
from dataclasses import dataclass
from typing import Any

import pytest
from support.sandboxes import REF, run

from sandbox.backends.container import spec as spec_module
from sandbox.backends.container.spec import ALLOWED_SYSCALLS, DENIED_SYSCALLS, seccomp_profile
from sandbox.host.manager import Sandbox, SandboxManager
from sandbox.isolation import seccomp

pytestmark = [pytest.mark.usefixtures("need_root"), pytest.mark.root("erofs", "overlay", "fuse", "cmd:crun")]

X86_64 = platform.machine() in ("x86_64", "amd64")

AT_FDCWD, SIGCHLD, CLONE_NEWUSER, CLONE_FILES = -100, 17, 0x10000000, 0x400
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK, AF_PACKET, AF_ALG, AF_VSOCK = 1, 2, 10, 16, 17, 38, 40
SOCK_STREAM, SOCK_RAW, SOCK_SEQPACKET = 1, 3, 5
KEY_SPEC_SESSION_KEYRING = -3
ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC = 0x0040000, 0x0400000


def buf(n: int) -> dict[str, int]:
    """An argument that is a pointer to ``n`` zeroed bytes."""
    return {"buf": n}


@dataclass(frozen=True)
class Call:
    what: str  # the request, as the agent would write it
    nr: int  # x86_64 number, or i386 number when abi == "i386"
    args: tuple[int | str | dict[str, int], ...]  # str: a NUL-terminated string's address
    expect: int  # errno the sandbox answers with (0: the call succeeded)
    abi: str = "x86_64"  # "i386": issued through int 0x80, as a 32-bit binary would
    forks: bool = False  # a success returns twice: the new process exits at once


# Calls ordinary programs make: the filter lets them through to the kernel.
ORDINARY = [
    Call("getpid()", 39, (), 0),
    Call('openat(AT_FDCWD, "/etc/hostname", O_RDONLY)', 257, (AT_FDCWD, "/etc/hostname", 0), 0),
    Call("read(-1, buf, 1)", 0, (-1, buf(1), 1), errno.EBADF),
    Call("write(-1, buf, 1)", 1, (-1, buf(1), 1), errno.EBADF),
    Call("mmap(NULL, 4096, PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS)", 9, (0, 4096, 3, 0x22, -1, 0), 0),
    Call("mprotect(NULL, 0, PROT_READ)", 10, (0, 0, 1), 0),
    Call("clone(SIGCHLD) (fork, no namespace flags)", 56, (SIGCHLD, 0, 0, 0, 0), 0, forks=True),
    Call("unshare(CLONE_FILES)", 272, (CLONE_FILES,), 0),
    Call("socket(AF_INET, SOCK_STREAM)", 41, (AF_INET, SOCK_STREAM, 0), 0),
    Call("socket(AF_INET6, SOCK_STREAM)", 41, (AF_INET6, SOCK_STREAM, 0), 0),
    Call("socket(AF_UNIX, SOCK_STREAM)", 41, (AF_UNIX, SOCK_STREAM, 0), 0),
    Call("socket(AF_NETLINK, SOCK_RAW, NETLINK_ROUTE)", 41, (AF_NETLINK, SOCK_RAW, 0), 0),
    Call("socketpair(AF_UNIX, SOCK_STREAM)", 53, (AF_UNIX, SOCK_STREAM, 0, buf(8)), 0),
    Call("epoll_create1(0)", 291, (0,), 0),
    Call("futex(&word, FUTEX_WAKE, 1)", 202, (buf(4), 1, 1, 0, 0, 0), 0),
    Call("eventfd2(0, 0)", 290, (0, 0), 0),
    Call("timerfd_create(CLOCK_MONOTONIC, 0)", 283, (1, 0), 0),
    Call("inotify_init1(0)", 294, (0,), 0),
    Call("getrandom(buf, 16, 0)", 318, (buf(16), 16, 0), 0),
    Call('prctl(PR_SET_NAME, "probe")', 157, (15, "probe"), 0),
    Call('statx(AT_FDCWD, "/", 0, STATX_BASIC_STATS)', 332, (AT_FDCWD, "/", 0, 0x7FF, buf(256)), 0),
    Call('faccessat2(AT_FDCWD, "/", F_OK, 0)', 439, (AT_FDCWD, "/", 0, 0), 0),
    Call("pidfd_open(1, 0)", 434, (1, 0), 0),
    Call('memfd_create("m", 0)', 319, ("m", 0), 0),
    Call("landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION)", 444, (0, 0, 1), 0),
    Call("personality(0xffffffff) (query)", 135, (0xFFFFFFFF,), 0),
    Call("personality(PER_LINUX)", 135, (0,), 0),
    Call("i386 getpid()", 20, (), 0, abi="i386"),
    Call("i386 socket(AF_INET, SOCK_STREAM)", 359, (AF_INET, SOCK_STREAM, 0), 0, abi="i386"),
]

# What a hostile agent tries, and the refusal it gets.
ATTACKS = [
    Call("io_uring_setup(8, &params)", 425, (8, buf(120)), errno.EPERM),
    Call("io_uring_enter(-1, ...)", 426, (-1, 0, 0, 0, 0, 0), errno.EPERM),
    Call("io_uring_register(-1, ...)", 427, (-1, 0, 0, 0), errno.EPERM),
    Call("i386 io_uring_setup(8, &params)", 425, (8, buf(120)), errno.EPERM, abi="i386"),
    Call("socket(AF_VSOCK, SOCK_STREAM) (the hypervisor's side channel)", 41,
         (AF_VSOCK, SOCK_STREAM, 0), errno.EPERM),
    Call("socket(0x1_0000_0028, ...) (AF_VSOCK with junk in the upper half)", 41,
         (0x1_0000_0000 | AF_VSOCK, SOCK_STREAM, 0), errno.EPERM),
    Call("socketpair(AF_VSOCK, SOCK_STREAM)", 53, (AF_VSOCK, SOCK_STREAM, 0, buf(8)), errno.EPERM),
    Call("i386 socket(AF_VSOCK, SOCK_STREAM)", 359, (AF_VSOCK, SOCK_STREAM, 0), errno.EPERM, abi="i386"),
    Call("i386 socketcall(SYS_SOCKET, [AF_VSOCK, SOCK_STREAM, 0])", 102, (1, "vsock-args"), errno.EPERM,
         abi="i386"),
    Call("socket(AF_PACKET, SOCK_RAW) (unlisted family)", 41, (AF_PACKET, SOCK_RAW, 0), errno.ENOSYS),
    Call("socket(AF_ALG, SOCK_SEQPACKET) (unlisted family)", 41, (AF_ALG, SOCK_SEQPACKET, 0), errno.ENOSYS),
    Call("bpf(BPF_PROG_LOAD, &attr)", 321, (5, buf(128), 128), errno.EPERM),
    Call('mount("none", "/mnt", "tmpfs")', 165, ("none", "/mnt", "tmpfs", 0, 0), errno.EPERM),
    Call('umount2("/proc", 0)', 166, ("/proc", 0), errno.EPERM),
    Call('pivot_root("/", "/")', 155, ("/", "/"), errno.EPERM),
    Call("unshare(CLONE_NEWUSER)", 272, (CLONE_NEWUSER,), errno.EPERM),
    Call("clone(CLONE_NEWUSER|SIGCHLD)", 56, (CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0), errno.EPERM, forks=True),
    Call("clone3(&args) (flags unreadable by seccomp: libc falls back to clone)", 435, (buf(88), 88),
         errno.ENOSYS),
    Call("setns(-1, 0)", 308, (-1, 0), errno.EPERM),
    Call("keyctl(KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING)", 250, (0, KEY_SPEC_SESSION_KEYRING, 0),
         errno.EPERM),
    Call('add_key("user", "k", "v", 1, KEY_SPEC_SESSION_KEYRING)', 248,
         ("user", "k", "v", 1, KEY_SPEC_SESSION_KEYRING), errno.EPERM),
    Call("ptrace(PTRACE_TRACEME)", 101, (0, 0, 0, 0), errno.EPERM),
    Call("process_vm_readv(1, ...)", 310, (1, 0, 0, 0, 0, 0), errno.EPERM),
    Call("perf_event_open(&attr, 0, -1, -1, 0)", 298, (buf(128), 0, -1, -1, 0), errno.EPERM),
    Call("userfaultfd(0)", 323, (0,), errno.EPERM),
    Call("fanotify_init(0, 0)", 300, (0, 0), errno.EPERM),
    Call("kexec_load(0, 0, NULL, 0)", 246, (0, 0, 0, 0), errno.EPERM),
    Call('init_module(image, 0, "")', 175, (buf(16), 0, ""), errno.EPERM),
    Call('finit_module(-1, "", 0)', 313, (-1, "", 0), errno.EPERM),
    Call("open_by_handle_at(-1, &handle, 0)", 304, (-1, buf(128), 0), errno.EPERM),
    Call("personality(ADDR_NO_RANDOMIZE) (turn ASLR off)", 135, (ADDR_NO_RANDOMIZE,), errno.ENOSYS),
    Call("personality(READ_IMPLIES_EXEC)", 135, (READ_IMPLIES_EXEC,), errno.ENOSYS),
    Call("mseal(NULL, 0, 0) (a syscall newer than the list: Linux 6.10)", 462, (0, 0, 0), errno.ENOSYS),
    Call("syscall 1000 (no such syscall)", 1000, (), errno.ENOSYS),
]

CALLS = ORDINARY + ATTACKS

# Runs inside the sandbox: one forked child per call (a call that worked, such as
# unshare, must not change the next), its exit status the errno.  Prints a JSON map
# what -> errno, or "signal N" when the call killed the child.
PROBE = r"""
import ctypes, json, mmap, os, struct, sys

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
# below 4 GiB (MAP_32BIT), so an i386 call can take the same pointers
arena = mmap.mmap(-1, 1 << 16, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x40)
base = ctypes.addressof(ctypes.c_char.from_buffer(arena))
used = 0

def place(data):
    global used
    at = used
    arena[at:at + len(data)] = data
    used = (at + len(data) + 15) & ~15
    return base + at

# socketcall(SYS_SOCKET)'s arguments live in memory: AF_VSOCK, SOCK_STREAM, 0
named = {"vsock-args": place(struct.pack("<3I", 40, 1, 0))}

def arg(a):
    if isinstance(a, dict):
        return place(bytes(a["buf"]))
    if isinstance(a, str):
        return named.get(a) or place(a.encode() + b"\0")
    return a

# long int80(nr, a, b, c): push rbx; mov rax,rdi; mov rbx,rsi; xchg rcx,rdx; int 0x80;
# movsxd rax,eax; pop rbx; ret
code = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
code.write(bytes.fromhex("53 4889f8 4889f3 4887d1 cd80 4863c0 5b c3"))
int80 = ctypes.CFUNCTYPE(ctypes.c_long, *[ctypes.c_long] * 4)(
    ctypes.addressof(ctypes.c_char.from_buffer(code)))

def call(nr, args, abi):
    if abi == "i386":
        ret = int80(nr, *(list(args) + [0, 0, 0])[:3])
        return -ret if -4096 < ret < 0 else 0, ret
    ret = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    return (ctypes.get_errno() if ret == -1 else 0), ret

verdicts = {}
for what, nr, args, abi, forks in json.load(sys.stdin):
    args = [arg(a) for a in args]
    pid = os.fork()
    if pid == 0:
        err, ret = call(nr, args, abi)
        if forks and err == 0:
            if ret == 0:
                os._exit(0)
            os.waitpid(ret, 0)
        os._exit(err)
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    verdicts[what] = status if status >= 0 else f"signal {-status}"
print(json.dumps(verdicts))
"""


@pytest.fixture(scope="module", params=["precompiled", "compiled-by-crun"])
def verdicts(manager: SandboxManager, request: pytest.FixtureRequest) -> dict[str, Any]:
    """Every call of CALLS issued once inside one sandbox (destroyed before the rows are checked):
    with the filter the manager compiles once and hands crun as an annotation, and with crun
    compiling the OCI section itself (what any other runtime gets): both must give every verdict."""
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "compiled-by-crun":
            patch.setattr(spec_module, "_precompiled_seccomp", lambda: {})
        box: Sandbox = run(manager.create(REF))
    config = json.loads((box.bundle / "config.json").read_text())
    assert (seccomp.ANNOTATION in config.get("annotations", {})) is (request.param == "precompiled")
    try:
        calls = [[c.what, c.nr, list(c.args), c.abi, c.forks] for c in CALLS]
        res = box.exec(["python3", "-c", PROBE], stdin=json.dumps(calls).encode(), timeout=60)
    finally:
        box.destroy()
    assert res.exit_code == 0, res.stderr.decode()
    return dict(json.loads(res.stdout))


def _errname(code: Any) -> str:
    return errno.errorcode.get(code, str(code)) if isinstance(code, int) and code else str(code)


@pytest.mark.skipif(not X86_64, reason="the call table holds x86_64 (and i386) syscall numbers; "
                    "aarch64 numbers differ and are not tabled")
@pytest.mark.parametrize("call", CALLS, ids=[c.what for c in CALLS])
def test_syscall_verdict(verdicts: dict[str, Any], call: Call) -> None:
    got = verdicts[call.what]
    if call.abi == "i386" and verdicts["i386 getpid()"] != 0:
        pytest.skip(f"this kernel runs no i386 calls (i386 getpid: {verdicts['i386 getpid()']})")
    assert got == call.expect, f"{call.what}: got {_errname(got)}, the profile answers {_errname(call.expect)}"


def test_profile_names_are_all_known_to_libseccomp() -> None:
    # crun skips a name libseccomp cannot resolve with only a warning on create: a typo in the
    # allowlist would silently break every program that needs the call
    try:
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError:
        pytest.skip("libseccomp.so.2 is not installed (crun links it; this host's crun may be static)")
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    names = {n for rule in seccomp_profile()["syscalls"] for n in rule["names"]}
    unknown = sorted(n for n in names if lib.seccomp_syscall_resolve_name(n.encode()) == -1)
    assert unknown == []
    assert set(ALLOWED_SYSCALLS).isdisjoint(DENIED_SYSCALLS)
    assert len(set(ALLOWED_SYSCALLS)) == len(ALLOWED_SYSCALLS)


THREADS_AND_SUBPROCESS = r"""
import concurrent.futures, multiprocessing, subprocess
with concurrent.futures.ThreadPoolExecutor(4) as pool:
    print(sum(pool.map(lambda n: n * n, range(10))))
print(subprocess.run(["sh", "-c", "echo from-child"], capture_output=True, text=True).stdout.strip())
with multiprocessing.Pool(2) as procs:
    print(procs.map(abs, [-1, -2]))
"""

TCP_ON_LOOPBACK = r"""
import asyncio, socket, threading
srv = socket.create_server(("127.0.0.1", 0))
def serve():
    conn, _ = srv.accept()
    conn.sendall(conn.recv(64).upper())
    conn.close()
t = threading.Thread(target=serve)
t.start()
with socket.create_connection(srv.getsockname(), timeout=10) as c:
    c.sendall(b"threaded")
    print(c.recv(64).decode())
t.join()

async def main():
    async def echo(reader, writer):
        writer.write((await reader.readline()).upper())
        await writer.drain()
        writer.close()
    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    reader, writer = await asyncio.open_connection(*server.sockets[0].getsockname())
    writer.write(b"asyncio\n")
    print((await reader.readline()).decode().strip())
    writer.close()
    server.close()
asyncio.run(main())
"""


def test_ordinary_workloads_still_run(boxes: Any) -> None:
    box = boxes()

    def ok(cmd: list[str] | str) -> str:
        res = box.exec(cmd, timeout=60)
        assert res.exit_code == 0, (cmd, res.stderr.decode())
        return res.stdout.decode()

    assert ok(["python3", "-c", THREADS_AND_SUBPROCESS]).split("\n") == ["285", "from-child", "[1, 2]", ""]
    assert ok("seq 1 1000 | sort -rn | head -3 | tr '\\n' ' '; echo x | sed s/x/y/ | wc -c") == "1000 999 998 2\n"
    assert ok("apt-get --version").startswith("apt ")
    assert ok("dpkg -l | head -6 | tail -1").startswith("ii ")
    assert ok("getent passwd root").startswith("root:x:0:0:")
    assert ok(["python3", "-c", TCP_ON_LOOPBACK]) == "THREADED\nASYNCIO\n"
