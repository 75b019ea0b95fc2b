"""envd's filesystem on a microVM: each operation a command in the guest, run as the caller's account.

**Why commands, not the guest agent's file calls.**  The agent's file calls
(sandbox/backends/vm/files.py) act as root: what they write is root's, and they read and write
where the caller's account may not.  Making them pass for the account's would take a chown after
each write (the agent has none: a command anyway) and a permission check of ours before each
call, which the account can race (swap a checked directory for a symlink to /etc/shadow between
our check and root's read).  A command run as the account (``ExecRequest(user=...)``: the agent's
exec drops to its uid and gid) has the guest's kernel check every lookup, read and write as it
would for any process of that account, and what it creates is the account's: the container
path's semantics (sandbox/edge/e2b/files.py), with no check of ours to get wrong.

Each operation is one command: a fixed ``sh -c`` script whose paths are its arguments, never
part of its text, under the C locale (the errno is recognised by its ``strerror`` text on
stderr).  Entries are described by ``find -printf`` (NUL-separated, so any name survives) and,
for symlinks, ``realpath -e`` and ``stat -L`` (envd's fully resolved target and its mode).

**Bounded.**  An upload streams: the body goes to ``cat > path``'s stdin through a pipe as it
arrives, one piece at a time.  A download is ``cat path``, its output handed to the response as
it comes, at most :data:`QUEUED` pieces waiting; while the client does not read, the command's
output pipe fills, and with it the agent's connection (the VM's other commands' output waits
too), so a client that reads nothing for :data:`STALL` seconds has its download cut.  A
description is at most :data:`DESCRIBE_OUTPUT` bytes.

**Needs** GNU coreutils and findutils in the guest (``find -printf``, ``realpath -z``,
``stat --printf``), as Debian's and Ubuntu's images (E2B's templates) have; busybox has no
``find -printf``, and an operation there fails naming the missing tool's error.

**Differs from containers**: no ``user.e2b.*`` metadata (an upload's ``X-Metadata-*`` are not
kept, as on a filesystem without user attributes); the account's supplementary groups are not
set (the agent's exec drops them, as for every command on a VM); each operation is a command, so
it takes a command's latency and is in the sandbox's receipts as an ``exec`` too; lookups may
cross into the guest's other mounts (/proc, /sys).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import posixpath
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sandbox.backends.base import account
from sandbox.core.errors import ApiError, InvalidField, NotARegularFile, UnsupportedOption
from sandbox.core.model import UNCAPPED, ExecRequest
from sandbox.core.sync import own_thread
from sandbox.edge.auth import Project
from sandbox.edge.context import EdgeContext
from sandbox.host.execs import Cancel, ExecResult
from sandbox.host.sandbox import Sandbox

from .base import DEFAULT_USER

OP_TIMEOUT = 300.0  # seconds one operation but a transfer may take (a deep listing under TCG)
DESCRIBE_OUTPUT = 64 << 20
MAX_ENTRIES = 100_000
QUEUED = 8  # a download's pieces (at most 64 KiB each: the guest's pipe) waiting for the client
STDERR_KEPT = 4096  # of a download's stderr, for its error
STALL = 60.0  # seconds a download waits for a client that reads nothing
# the scripts' own exit codes (a shell's are at most 127, then 128 + a signal)
IS_DIR, SPECIAL, EXISTS = 101, 102, 103
ERRNOS = (errno.ENOENT, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENOTEMPTY,
          errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EXDEV, errno.ELOOP, errno.ENAMETOOLONG, errno.EBUSY,
          errno.ETXTBSY, errno.EINVAL)
KINDS = {"f": 0o100000, "d": 0o040000, "l": 0o120000, "p": 0o010000, "s": 0o140000, "c": 0o020000, "b": 0o060000}
FIELDS = 9  # of each entry find prints: type, target's type, mode, size, owner, group, mtime, name, relative path
LINKS = "/"  # after the entries (a field no type is): each symlink's path, resolved target, target's raw mode

# describe OPT PATH DEPTH: the entries (find -printf), then each symlink's resolution
DESCRIBE = r"""describe() {
  find "$1" "$2" -maxdepth "$3" -printf '%y\0%Y\0%m\0%s\0%u\0%g\0%T@\0%f\0%P\0' || return
  printf '/\0'
  find "$1" "$2" -maxdepth "$3" -type l -exec sh -c 'for p; do printf "%s\0" "$p"
    realpath -ezq -- "$p" || printf "\0"
    stat -L --printf "%f\0" -- "$p" 2>/dev/null || printf "\0"; done' sh {} +
}
"""
REGULAR = f"""if [ -d "$1" ]; then exit {IS_DIR}; fi
if [ -e "$1" ] && [ ! -f "$1" ]; then exit {SPECIAL}; fi
"""
STAT = DESCRIBE + 'describe -P "$1" 0\n'
LIST = DESCRIBE + 'describe -H "$1" "$2"\n'
MAKE_DIR = DESCRIBE + f"""if [ -d "$1" ]; then exit {EXISTS}; fi
umask 022
mkdir -p -- "$1" || exit
describe -P "$1" 0
"""
MOVE = DESCRIBE + """umask 022
mkdir -p -- "$3" || exit
mv -T -- "$1" "$2" || exit
describe -P "$2" 0
"""
REMOVE = 'exec rm -rf -- "$1"\n'
READ = REGULAR + 'exec cat -- "$1"\n'
WRITE = "umask 022\n" + REGULAR + """mkdir -p -- "$2" || exit
exec cat > "$1"
"""


@dataclass(frozen=True)
class Found:
    """One entry as the guest described it: ``mode`` its own (type bits and permissions), for a
    symlink ``target`` (None: dangling or a loop) and ``target_mode`` (0 when unknown)."""

    path: str
    mode: int
    size: int
    owner: str
    group: str
    mtime_ns: int
    target: str | None = None
    target_mode: int = 0


@dataclass(frozen=True)
class Guest:
    """One call's microVM sandbox and the account its commands run as."""

    ctx: EdgeContext
    project: Project
    box: Sandbox
    user: str
    home: str


async def guest_for(ctx: EdgeContext, project: Project, box: Sandbox, named: str | None) -> Guest:
    """The account a call runs as: the one named, else E2B's ``user`` when the sandbox has it,
    else root (files.py's choice for containers)."""
    def load() -> Guest:
        name = named or DEFAULT_USER
        try:
            _, _, home = account(box.files, name)
        except UnsupportedOption:
            if named is not None:
                raise
            name, home = "root", account(box.files, "root")[2]
        return Guest(ctx, project, box, name, home)
    return await ctx.files(project, load)


# -- running ----------------------------------------------------------------------------------------------
def request(g: Guest, script: str, *args: str, timeout: float | None = OP_TIMEOUT,
            cap: int = DESCRIBE_OUTPUT) -> ExecRequest:
    return ExecRequest(cmd=("/bin/sh", "-c", script, "sh", *args), env={"LC_ALL": "C"}, cwd="/", user=g.user,
                       timeout=timeout, output_cap=cap)


def check(result: ExecResult, path: str, stderr: bytes | None = None) -> None:
    """An error for a command that failed: its script's own exit codes, else the errno its stderr
    (``stderr``, else the result's) names."""
    if result.exit_code == 0:
        return
    if result.exit_code == IS_DIR:
        raise InvalidField("path", f"path '{path}' is a directory")
    if result.exit_code == SPECIAL:
        raise NotARegularFile(errno.EINVAL, path, "special file")
    if result.timed_out or result.interrupted:
        raise ApiError(None, "conflict", f"{path}: the guest's command was cut short "
                                         f"({result.interrupted or 'timed out'})")
    text = (result.stderr if stderr is None else stderr).decode(errors="replace").strip()
    for err in ERRNOS:
        if os.strerror(err) in text:
            if err in (errno.ENOSPC, errno.EDQUOT):
                raise ApiError(507, "no_space", f"not enough disk space in the sandbox: {os.strerror(err)}")
            raise OSError(err, f"{path}: {os.strerror(err)}", path)
    raise OSError(errno.EIO, f"{path}: the guest's command failed (exit {result.exit_code}): {text[-300:]}", path)


async def run(g: Guest, path: str, script: str, *args: str) -> bytes:
    """``script`` with ``args`` as the account (on the file executor); its output."""
    req = request(g, script, *args)
    result = await g.ctx.files(g.project, lambda: g.box.exec(req))
    check(result, path)
    if result.truncated:
        raise ApiError(413, "body_too_large", f"{path}: more than {DESCRIBE_OUTPUT} bytes of entries; list less deep")
    return result.stdout


# -- describing -------------------------------------------------------------------------------------------
def _mtime_ns(text: str) -> int:
    seconds, _, fraction = text.partition(".")
    return int(seconds) * 10**9 + int((fraction + "000000000")[:9])


def parse(out: bytes, start: str) -> list[tuple[str, str, Found]]:
    """``(relative path, target's type letter, entry)`` of each entry :data:`DESCRIBE` printed
    under ``start``, symlinks resolved."""
    fields = [f.decode(errors="surrogateescape") for f in out.split(b"\0")]
    try:
        split = next(i for i in range(0, len(fields), FIELDS) if fields[i] == LINKS)
    except StopIteration:
        raise OSError(errno.EIO, f"{start}: the guest's description ends early", start) from None
    links: dict[str, tuple[str, int]] = {}
    rest = fields[split + 1:-1]
    for i in range(0, len(rest) - 2, 3):
        links[rest[i][len(start):].lstrip("/")] = rest[i + 1], int(rest[i + 2] or "0", 16)
    found = []
    for i in range(0, split, FIELDS):
        kind, target_kind, mode, size, owner, group, mtime, _, rel = fields[i:i + FIELDS]
        path = posixpath.join(start, rel) if rel else start
        target, target_mode = links.get(rel, ("", 0)) if kind == "l" else ("", 0)
        found.append((rel, target_kind, Found(path, KINDS.get(kind, 0) | int(mode, 8), int(size), owner, group,
                                              _mtime_ns(mtime), target or None, target_mode)))
    return found


async def stat(g: Guest, path: str) -> Found:
    return parse(await run(g, path, STAT, path), path)[0][2]


async def list_dir(g: Guest, path: str, depth: int) -> list[Found]:
    """envd's ListDir: depth first in name order, the directory itself (symlinks to it followed) not listed."""
    found = parse(await run(g, path, LIST, path, str(depth)), path)
    if not found or found[0][0] or found[0][1] != "d":
        raise InvalidField("path", f"{path} is not a directory")
    if len(found) > MAX_ENTRIES + 1:
        raise ApiError(413, "body_too_large", f"{path}: more than {MAX_ENTRIES} entries; list less deep")
    return [f for _, _, f in sorted(found[1:], key=lambda each: each[0].split("/"))]


async def make_dir(g: Guest, path: str) -> Found | None:
    """``mkdir -p``; None when ``path`` is a directory already."""
    req = request(g, MAKE_DIR, path)
    result = await g.ctx.files(g.project, lambda: g.box.exec(req))
    if result.exit_code == EXISTS:
        return None
    try:
        check(result, path)
    except (FileExistsError, NotADirectoryError):
        raise InvalidField("path", f"{path}: it, or a directory on the way, exists and is not a directory") from None
    return parse(result.stdout, path)[0][2]


async def move(g: Guest, source: str, destination: str) -> Found:
    out = await run(g, source, MOVE, source, destination, posixpath.dirname(destination) or "/")
    return parse(out, destination)[0][2]


async def remove(g: Guest, path: str) -> None:
    """envd's Remove (``rm -rf``): a missing entry is no error."""
    if path == "/":
        raise InvalidField("path", "'/' is the sandbox's root: name an entry inside it")
    await run(g, path, REMOVE, path)


# -- transfers --------------------------------------------------------------------------------------------
class _Stdin:
    """The ``Attach`` of an upload's command: its stdin is a pipe the edge writes as the body arrives."""

    terminal = None

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd
        self._lock = threading.Lock()

    @property
    def stdin_fd(self) -> int | None:
        return self._fd

    def started(self) -> Mapping[str, Any]:
        return {"stdin": "upload"}

    def spawned(self) -> None:
        self.close()  # the runner holds a copy of its own now

    def on_terminal(self, master: int, resize: Callable[[int, int], None] | None = None) -> None:
        os.close(master)

    def finished(self) -> Mapping[str, Any]:
        return {}

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


async def upload(g: Guest, path: str, pieces: AsyncIterator[bytes]) -> int:
    """``pieces`` written to ``path`` by the account (parents made, 0644/0755 under umask 022, an
    existing file truncated and kept its owner's); the bytes written."""
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    stdin = _Stdin(read_end)
    req = request(g, WRITE, path, posixpath.dirname(path) or "/", timeout=None, cap=64 << 10)
    try:
        running = own_thread(lambda: g.box.exec(req, attach=stdin), name="layerbox-upload")
    except BaseException:
        stdin.close()
        os.close(write_end)
        raise
    total = 0
    try:
        async for data in pieces:
            if running.done():  # refused before it read everything: its answer says why
                break
            try:
                await asyncio.to_thread(_write_all, write_end, data)
            except BrokenPipeError:
                break
            total += len(data)
    finally:
        os.close(write_end)
        try:
            result = await running
        finally:
            stdin.close()
    check(result, path)
    return total


class Download:
    """``cat path`` as the account, its output handed over as it comes (see the module's docstring)."""

    def __init__(self, g: Guest, path: str) -> None:
        self.g, self.path = g, path
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[bytes] = asyncio.Queue(QUEUED)
        self.cancel = Cancel()
        self.total = 0
        self.stderr = bytearray()  # what check() reads: the output itself is not kept
        req = request(g, READ, path, timeout=None, cap=UNCAPPED)
        self.running = own_thread(lambda: g.box.exec(req, on_stdout=self._push, on_stderr=self._error,
                                                     cancel=self.cancel, keep_output=False), name="layerbox-download")

    def _error(self, data: bytes) -> None:  # the exec's thread
        self.stderr += data[:STDERR_KEPT - len(self.stderr)]

    def _push(self, data: bytes) -> None:  # the exec's thread
        if self.cancel.is_set():
            return
        fut = asyncio.run_coroutine_threadsafe(self.queue.put(data), self.loop)
        try:
            fut.result(timeout=STALL)
        except TimeoutError:
            fut.cancel()
            self.cancel.cancel("stalled")

    async def next(self) -> bytes:
        """The next piece; b"" at the end (an error when the command failed)."""
        getter = asyncio.ensure_future(self.queue.get())
        waiting: set[asyncio.Future[Any]] = {getter, self.running}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if not getter.done():
            getter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await getter
            if self.queue.empty():  # the exec hands every piece over before it returns
                check(self.running.result(), self.path, bytes(self.stderr))
                return b""
            getter = asyncio.ensure_future(self.queue.get())
        data = await getter
        self.total += len(data)
        return data

    async def close(self) -> None:
        """Stop the command (the client left early) and wait for its end."""
        if not self.running.done():
            self.cancel.cancel("disconnect")
            while not self.running.done():
                with contextlib.suppress(asyncio.QueueEmpty):
                    self.queue.get_nowait()
                await asyncio.wait({self.running}, timeout=0.1)
        with contextlib.suppress(Exception):
            self.running.result()

