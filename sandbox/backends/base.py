"""The Backend protocol: what isolates a sandbox, behind one interface the manager drives.

The manager (:mod:`sandbox.host`) owns a sandbox's state record, its receipts, idempotency,
leases, admission and the host resources every kind shares (network namespace, uid range,
cgroup, disk, mounts: :mod:`sandbox.isolation.resources`).  A :class:`Backend` owns what
differs between kinds of isolation: starting the sandbox on its image, running its
processes, reaching its files, pausing and resuming it, capturing a checkpoint, tearing it
down, and finding it again after the manager crashed.  It reports what it can do
(:class:`Capabilities`), so nobody above it tests the isolation to know.

Two backends implement it: :class:`~sandbox.backends.container.ContainerBackend` (crun on a
lazily mounted overlay) and :class:`~sandbox.backends.vm.VmBackend` (QEMU microvm and q35
guests restored from templates).  The table that maps an isolation to its backend is
:func:`sandbox.backends.make_backends`; docs/ARCHITECTURE.md says what a third one takes.

What a backend is handed for one sandbox is a :class:`Box`: its id, its directory, its
state, and the manager's ways to change that state and record receipts.  A backend never
writes ``state.json`` or a receipt log itself, and never reads a file a sandbox can write
as host state.

Contracts every implementation keeps (the conformance suite, tests/test_sandbox_backends.py,
runs each backend through them):

* ``launch`` returns only once a command can run; on any failure it raises and leaves what
  it made for the manager's destroy (the state was written before it was called).
* ``destroy`` is idempotent and works from a state of ``None`` (a crash before the state
  was written, or a state this version cannot read): it finds what it made by the
  sandbox's id and cgroup.
* ``spawn`` starts exactly one command and returns a :class:`Process` whose output the
  manager pumps; killing the process (``kill_tree``) ends every process it started.
* Errors are :class:`~sandbox.core.errors.SandboxError` subclasses: what the backend cannot
  do is :class:`~sandbox.core.errors.UnsupportedOption` naming the field or feature, a
  sandbox in the wrong state :class:`~sandbox.core.errors.SandboxStateError`, a host that
  lacks a part :class:`~sandbox.core.errors.HostUnsupported`.
"""

from __future__ import annotations

import collections
import os
import socket
import stat
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, BinaryIO, Protocol

from layerstore.objects import Resolved
from layerstore.store import Store
from lazyfetch.mounts import HostMounts
from sandbox.core.errors import SandboxStateError, UnsupportedOption
from sandbox.core.model import SandboxOptions, SandboxState
from sandbox.core.paths import SandboxPaths
from sandbox.core.procs import proc_stat
from sandbox.isolation.cgroups import CgroupLayout
from sandbox.isolation.resources import HostResources
from snapshots.checkpoint import Checkpoint

# The PATH a command gets when the image's config has none (the OCI runtime spec's usual one).
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# the image's /etc/passwd and /etc/group are read whole to find a user: the sandbox may have written them
ID_FILE_LIMIT = 16 << 20

# What a backend may provide; Capabilities.provides and .lacks list these names.  "background":
# commands that outlive their request, input kept open on a pipe (an Attach without a terminal);
# "interactive": terminals (an Attach with one).
FEATURES = (
    "exec", "files", "pause", "resume", "limits", "ttl", "leases", "checkpoint", "restore", "fork", "network",
    "background", "interactive", "ports", "userns", "disk", "memory_checkpoint", "templates", "templates_in_store", "image_kernel",
    "bootloader", "pmem_dax",
)


@dataclass(frozen=True)
class Capabilities:
    """What one isolation provides on this host.  ``details`` are the backend's own facts
    (its runtime, the machine, QEMU's version and accelerator, the guest assets...)."""

    isolation: str
    available: bool
    provides: tuple[str, ...] = ()
    lacks: tuple[str, ...] = ()
    reason: str | None = None  # why it is not available
    details: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = sorted((set(self.provides) | set(self.lacks)) - set(FEATURES))
        if unknown:
            raise ValueError(f"capabilities of {self.isolation}: unknown features {unknown} (see FEATURES)")

    def has(self, feature: str) -> bool:
        return self.available and feature in self.provides

    def to_json(self) -> dict[str, Any]:
        if not self.available:
            return {"available": False, "reason": self.reason}
        return {"available": True, **self.details, "provides": list(self.provides), "lacks": list(self.lacks)}


@dataclass(frozen=True)
class CheckpointRequest:
    """What the manager hands a backend for one checkpoint: the ref to move (None: the backend's
    default under ``prefix``), labels, the resume-point fields, and the documents that travel
    with it (receipts, carried options)."""

    name: str | None
    labels: Mapping[str, str]
    trajectory_offset: int
    receipt_id: str | None
    policy_version: str | None
    attach_docs: Mapping[str, Any]
    prefix: str  # the project's ref namespace ("" for the host's own sandboxes)
    memory: bool = False


@dataclass(frozen=True)
class Checkpointed:
    """A backend's checkpoint: the checkpoint itself and what its receipt adds."""

    checkpoint: Checkpoint
    receipt: Mapping[str, Any] = field(default_factory=dict)

    def receipt_fields(self) -> dict[str, Any]:
        """The ``checkpoint`` receipt's fields."""
        ckpt = self.checkpoint
        return {"checkpoint": ckpt.name, "digest": ckpt.digest, "freeze_seconds": ckpt.freeze_seconds,
                "bytes_changed": ckpt.bytes_changed, **self.receipt}


@dataclass(frozen=True)
class LeftOver:
    """A command a dead manager left running, killed by the backend's adopt (its receipt says so)."""

    tag: str
    command: Any


class Attach(Protocol):
    """How a command outlives its request: a stdin its owner keeps open, or a terminal.

    ``sandbox.edge.commands`` implements it for background commands and terminal sessions.
    The manager calls :meth:`started` (for the ``exec_started`` receipt) and :meth:`finished`
    (for the ``exec`` receipt); the backend's ``spawn`` calls :meth:`spawned` once the runner
    holds its stdin and, without a terminal, the command's process exists (also when it failed
    to start) and, with a terminal, :meth:`on_terminal`.
    """

    @property
    def terminal(self) -> tuple[int, int] | None:
        """``(cols, rows)``: run on a pty made inside the sandbox; None: on pipes."""

    @property
    def stdin_fd(self) -> int | None:
        """Without a terminal: the descriptor the command's stdin reads (a pipe's read end); None: /dev/null."""

    def started(self) -> Mapping[str, Any]:
        """Fields added to the ``exec_started`` receipt written before the command runs."""

    def spawned(self) -> None:
        """The command's runner holds its stdin, and its process exists (or it failed to start)."""

    def on_terminal(self, master: int, resize: Callable[[int, int], None] | None = None) -> None:
        """The pty's master, a descriptor of the callee's own to close (the pump reads another one).
        ``resize(cols, rows)``, when given, is how the terminal is resized (blocking): the pty is
        not the host's (a VM's is the guest's; ``master`` is then a pipe to its input), so
        ``TIOCSWINSZ`` on ``master`` would not reach it."""

    def finished(self) -> Mapping[str, Any]:
        """Fields added to the command's ``exec`` receipt (what its input was)."""


@dataclass(frozen=True)
class HostContext:
    """What every backend of one manager shares: the data dir and its paths, this host's layer
    mounts, the host resources (sandbox.isolation.resources), the store, and the manager's
    handle of a sandbox id (a :class:`Box`)."""

    data_dir: Path
    paths: SandboxPaths
    mounts: HostMounts
    resources: HostResources
    open_store: Callable[[], Awaitable[Store]]
    box: Callable[[str], Box]

    @property
    def cgroups(self) -> CgroupLayout:
        return self.resources.cgroups.layout


# What an update of a state record changes, derived from the record as it is under the lock.
StateChanges = Callable[[SandboxState], Mapping[str, Any]]


def with_status(status: str, also: StateChanges | None, **fields: Any) -> StateChanges:
    """The update that says ``status`` (with a backend's own ``fields``) and what ``also`` adds."""
    return lambda fresh: {**(also(fresh) if also is not None else {}), **fields, "status": status}


class Box(Protocol):
    """One sandbox as the manager hands it to its backend (the manager's ``Sandbox`` handle)."""

    @property
    def id(self) -> str: ...

    @property
    def dir(self) -> Path:
        """``boxes/<id>/``: the sandbox's own directory on the host (made 0700 by the manager)."""

    @property
    def state(self) -> SandboxState: ...

    def update(self, **changes: Any) -> SandboxState:
        """Change the state record (read-modify-write under the manager's lock); the new record."""

    def update_from(self, changes: Callable[[SandboxState], Mapping[str, Any]]) -> SandboxState:
        """Change the state record by what ``changes`` derives from the current one, under the
        manager's lock (so no other writer's change in between is lost)."""

    def receipt(self, action: str, **fields: Any) -> dict[str, Any]:
        """Append a receipt (and mark the sandbox active)."""

    def checkpoint_request(self, *, name: str | None = None, labels: Mapping[str, str] | None = None,
                           trajectory_offset: int | None = None, policy_version: str | None = None,
                           memory: bool = False) -> CheckpointRequest:
        """The request for a checkpoint of this sandbox now (its receipts read and verified)."""


class Files(Protocol):
    """A sandbox's files as the host reaches them (a container's root, a VM's agent): every path
    is absolute and resolved inside the sandbox; what cannot be read or written answers with the
    ``OSError`` subclass the host's kernel would (FileNotFoundError, IsADirectoryError...),
    :class:`~sandbox.core.errors.NotARegularFile` for FIFOs, sockets and devices,
    :class:`~sandbox.core.errors.PathEscape` for a path that leaves the root."""

    def iter_read(self, path: str, chunk: int = ...) -> Iterator[bytes]:
        """The file's bytes, read as the caller takes them."""

    def read(self, path: str, limit: int | None = None) -> bytes:
        """The whole file; ``OSError(EFBIG)`` when it has more than ``limit`` bytes.  None: as much as
        the backend holds in memory for a caller (a container's file is the host's to size; a VM's
        guest says what its file holds, so its backend keeps a ceiling of its own)."""

    def download(self, path: str, dst: BinaryIO, chunk: int = ...) -> int: ...

    def upload(self, path: str, src: BinaryIO, mode: int = 0o644, chunk: int = ...) -> int: ...

    def write(self, path: str, data: bytes, mode: int = 0o644) -> int: ...

    def mkdir(self, path: str, mode: int = 0o755) -> None: ...

    def stat(self, path: str) -> os.stat_result: ...

    def list(self, path: str = "/") -> list[dict[str, Any]]:
        """Entries sorted by name: ``{"name", "type" (entry_kind), "size", "mode", "mtime"}``."""

    def remove(self, path: str, *, recursive: bool = False) -> None: ...


class Process(Protocol):
    """One command a backend started (``spawn``), shaped for the manager's pump: its output as
    two readable pipes, its input as a writable one (or None: /dev/null)."""

    @property
    def stdout(self) -> IO[bytes]: ...

    @property
    def stderr(self) -> IO[bytes]: ...

    @property
    def stdin(self) -> IO[bytes] | None: ...

    @property
    def tty(self) -> int | None:
        """A terminal's master (output counts as stdout), owned by the process; None on pipes."""

    def poll(self) -> int | None:
        """The exit status once the command ended, else None (never blocks)."""

    def kill_tree(self) -> bool:
        """SIGKILL the command and everything it started; False while that is not possible yet
        (the pump asks again)."""

    def kill(self) -> None:
        """Kill only what runs the command on the host's side (its runner), when kill_tree never succeeds."""

    def finish(self) -> int | None:
        """After the pump: reap what is left and release the process's host files; its exit status."""

    def oom_killed(self) -> bool:
        """Whether the kernel's OOM killer struck the sandbox while the command ran."""

    def receipt(self) -> Mapping[str, Any]:
        """What the command's ``exec`` receipt adds."""


class Backend(Protocol):
    """One kind of isolation (or a family: microvm and vm share QEMU).  All methods but the
    coroutines block and are called on a worker thread by async callers."""

    isolations: tuple[str, ...]

    def capabilities(self, isolation: str) -> Capabilities: ...

    async def check(self, options: SandboxOptions, resolved: Resolved, ref: str) -> None:
        """Refuse, before anything is made, what this backend cannot start (UnsupportedOption or
        InvalidField naming the field; HostUnsupported when the host lacks a part)."""

    async def launch(self, box: Box, resolved: Resolved, ref: str) -> dict[str, Any]:
        """Start the sandbox ``box`` (its state says ``creating``) on ``resolved``; returns what its
        create or restore receipt adds.  The state says ``running`` when it returns."""

    def files(self, box: Box, st: SandboxState) -> Files: ...

    def spawn(self, box: Box, st: SandboxState, argv: Sequence[str], *, env: Mapping[str, str], cwd: str,
              uid: int, gid: int, tag: str, input_pipe: bool, attach: Attach | None = None) -> Process:
        """Start ``argv`` in the running sandbox.  ``input_pipe``: its stdin is a pipe the pump
        writes (else /dev/null, or what ``attach`` gives: a pipe its owner feeds, or a terminal;
        a backend without ``interactive`` refuses an ``attach``).  ``tag`` names the command's
        host files, which reconcile finds if the manager dies meanwhile."""

    def pause(self, box: Box, st: SandboxState, *, reclaim: bool, also: StateChanges | None = None) -> dict[str, Any]:
        """Stop every process (and with ``reclaim`` give memory back); what the receipt adds.
        The state says ``paused`` when it returns, and what ``also`` derives from the record
        (the manager's: a new lifetime), written in the same update as ``paused``."""

    def resume(self, box: Box, st: SandboxState, *, also: StateChanges | None = None) -> dict[str, Any]:
        """Run a paused sandbox on; what the receipt adds.  The state says ``running`` after, and
        what ``also`` derives from the record, written in the same update."""

    async def checkpoint(self, box: Box, st: SandboxState, request: CheckpointRequest) -> Checkpointed:
        """Capture the sandbox's writes (with ``request.memory`` its memory too, where the
        backend provides ``memory_checkpoint``) into the store; the sandbox runs on after."""

    def paused_capture(self, st: SandboxState) -> bool | None:
        """None when the paused sandbox ``st`` is captured as it is; else it runs for the capture
        (the manager resumes it) and is paused again after, with this ``reclaim``."""

    def update_limits(self, box: Box, st: SandboxState, options: SandboxOptions) -> None:
        """Apply ``options``' CPU, memory and pids limits to the running sandbox."""

    def connect_port(self, box: Box, st: SandboxState, port: int, timeout: float) -> socket.socket:
        """A non-blocking stream socket connected to ``127.0.0.1:<port>`` as the sandbox sees it
        (ports): ConnectionRefusedError when nothing listens there, TimeoutError when the connect
        takes longer than ``timeout``.  A container's is a TCP socket made in its network
        namespace; a VM's a socket pair whose other end the guest agent relays."""

    def usage(self, box: Box, st: SandboxState) -> dict[str, Any]:
        """What the sandbox's writes and its own view of memory take: ``{"disk": {...}, "guest_memory": ...}``."""

    def destroy(self, sid: str, st: SandboxState | None) -> None:
        """Stop every process of the sandbox and remove what the backend made for it (idempotent)."""

    def survivors(self) -> Mapping[str, Any]:
        """What runs on this host per sandbox id, whatever the states say (read once per reconcile)."""

    def adopt(self, box: Box, st: SandboxState, survivors: Mapping[str, Any]) -> list[LeftOver] | None:
        """After a manager crash: bring ``st`` up to date with what still runs and kill the commands
        the dead manager left (returned, for their receipts); None when the sandbox cannot go on."""

    def close(self) -> None: ...


def main_pid(st: SandboxState, cgroups: CgroupLayout) -> int:
    """The sandbox's main process (a container's init, a VM's VMM), checked: the start time it
    was recorded with, and a task of the sandbox's own cgroup (a reused pid is refused)."""
    if st.pid is None or st.init_start is None or not st.live:
        raise SandboxStateError(f"sandbox {st.id} is {st.status}: it has no running init")
    stat = proc_stat(st.pid)
    if stat is None or stat[1] != st.init_start or not cgroups.holds(st.pid, st.cgroups_path):
        raise SandboxStateError(f"sandbox {st.id}: its init ({st.pid}) is gone; destroy it or restore "
                                "its last checkpoint")
    return st.pid


def refuse(feature: str, caps: Capabilities, what: str) -> None:
    """UnsupportedOption naming ``feature`` unless ``caps`` provides it."""
    if not caps.has(feature):
        raise UnsupportedOption(f"{what} is not available for isolation={caps.isolation}"
                                + (f": {caps.reason}" if caps.reason else ""))


def entry_kind(mode: int) -> str:
    """The ``type`` of a directory entry in the files API: dir, file, symlink or other."""
    for test, name in ((stat.S_ISDIR, "dir"), (stat.S_ISREG, "file"), (stat.S_ISLNK, "symlink")):
        if test(mode):
            return name
    return "other"


SPECIAL_KINDS = {stat.S_IFIFO: "FIFO (named pipe)", stat.S_IFSOCK: "socket", stat.S_IFCHR: "character device",
                 stat.S_IFBLK: "block device"}


def special_kind(mode: int) -> str | None:
    """What a file that is neither regular nor a directory nor a link is (the files API reads and
    writes only regular files); None for those."""
    fmt = stat.S_IFMT(mode)
    return None if fmt in (stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK) else SPECIAL_KINDS.get(fmt, "special file")


ACCOUNTS_PER_ROOTFS = 64  # users process_defaults remembers per rootfs; past them each is read again
ACCOUNTS_KEPT = 256  # documents whose users are remembered: a few bytes each


class Accounts:
    """The users :func:`process_defaults` looked up, per document (an image, composition or
    checkpoint digest), for a backend whose new sandbox's rootfs is that document's alone until
    it starts (nothing of the sandbox's has run in it); the least recently used document goes
    first past ``kept``.  Safe across threads."""

    def __init__(self, kept: int = ACCOUNTS_KEPT) -> None:
        self._kept = kept
        self._lock = threading.Lock()
        self._by_digest: collections.OrderedDict[str, dict[str, tuple[int, int, str]]] = collections.OrderedDict()

    def of(self, digest: str) -> dict[str, tuple[int, int, str]]:
        with self._lock:
            known = self._by_digest.pop(digest, None)
            self._by_digest[digest] = known = known if known is not None else {}
            while len(self._by_digest) > self._kept:
                self._by_digest.popitem(last=False)
            return known


@dataclass(frozen=True)
class ProcessDefaults:
    """What every command of a sandbox gets unless it says otherwise: the image's config under the options."""

    env: dict[str, str]
    cwd: str
    uid: int
    gid: int


def process_defaults(files: Files, resolved: Resolved, options: SandboxOptions,
                     accounts: MutableMapping[str, tuple[int, int, str]] | None = None) -> ProcessDefaults:
    """The env, workdir, uid and gid of the sandbox's commands: the image's config under its options,
    the user looked up in the image's own passwd and group files.  ``accounts``: the users
    already looked up in a rootfs that is ``resolved``'s alone (a content-addressed document
    on a disk nothing has written yet), filled in here: a VM's files are a round trip each
    into a guest whose code is not yet translated."""
    cfg = resolved.config.get("config", resolved.config) or {}
    image_env = dict(e.split("=", 1) for e in cfg.get("Env") or [] if isinstance(e, str) and "=" in e)
    image_env.setdefault("PATH", DEFAULT_PATH)
    user = options.user if options.user is not None else cfg.get("User") or ""
    known = accounts.get(user) if accounts is not None else None
    uid, gid, home = known if known is not None else _identity(files, user)
    if accounts is not None and known is None and len(accounts) < ACCOUNTS_PER_ROOTFS:
        accounts[user] = (uid, gid, home)  # (bounded: any numeric uid is a user a tenant may ask for)
    # as runc and crun do: HOME from the account's passwd entry unless the image sets it
    env = {**image_env, "HOME": image_env.get("HOME", home), **options.env}
    return ProcessDefaults(env, options.workdir or cfg.get("WorkingDir") or "/", uid, gid)


def account(files: Files, user: str) -> tuple[int, int, str]:
    """``(uid, gid, home)`` of ``user`` (an OCI ``User``: "name", "uid", "uid:gid", "name:group")
    in the sandbox's own passwd and group files, each read once; its home is ``/`` when passwd
    has none (a numeric uid not listed).

    The rootfs may hold an earlier agent's writes (a restored checkpoint): its passwd is
    the sandbox's own business, but a malformed line must not become our error.
    """
    name, _, group = user.partition(":")
    entry = next((p for p in _table(files, "/etc/passwd")
                  if len(p) > 3 and (p[0] == name or (name.isdigit() and p[2] == name))), None)
    if name.isdigit():
        uid = int(name)
    elif entry is not None and entry[2].isdigit():
        uid = int(entry[2])
    else:
        raise UnsupportedOption(f"user {name!r} is not in the image's /etc/passwd")
    home = entry[5] if entry is not None and len(entry) > 5 and entry[5] else "/"
    if group:
        if group.isdigit():
            return uid, int(group), home
        row = next((p for p in _table(files, "/etc/group") if len(p) > 2 and p[0] == group and p[2].isdigit()), None)
        if row is None:
            raise UnsupportedOption(f"group {group!r} is not in the image's /etc/group")
        return uid, int(row[2]), home
    if name.isdigit() or entry is None or not entry[3].isdigit():
        return uid, uid, home
    return uid, int(entry[3]), home


def _table(files: Files, path: str) -> list[list[str]]:
    """The colon-separated rows of ``path`` in the sandbox (none when it cannot be read)."""
    try:
        text = files.read(path, ID_FILE_LIMIT).decode(errors="replace")
    except OSError:
        return []
    return [line.split(":") for line in text.splitlines()]


def _identity(files: Files, user: str) -> tuple[int, int, str]:
    """``(uid, gid, home)`` of an OCI ``User`` in the rootfs (root for none; its home ``/root``
    unless passwd names another)."""
    if not user:
        home = account(files, "0")[2]  # (a numeric uid is never refused: its home is "/" when not listed)
        return 0, 0, home if home != "/" else "/root"
    return account(files, user)
