"""What the SDK takes and returns: the create options as typed keywords, and frozen results.

Every result is parsed from the service's JSON here, by :func:`parse` (fields the service
adds later are ignored, so an older SDK keeps working against a newer service; a missing
required field is an :class:`~sandbox.sdk.errors.ApiError` ``bad_response``).  Lists
become tuples; mappings stay mappings and are not to be modified.
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypedDict, TypeVar

from sandbox.core.model import EgressRule, Keep
from sandbox.core.views import (
    Limits,
    NetworkPolicy,
    SandboxInfo,
    SandboxNetwork,
    ViewError,
    as_tuple,
    converted,
    from_json,
    nested,
)
from sandbox.sdk.errors import ApiError

T = TypeVar("T")
S = TypeVar("S")  # the sandbox class a fork hands out (async or blocking)

__all__ = [
    "CallResult",
    "Capabilities",
    "Checkpoint",
    "CheckpointInfo",
    "CommandExit",
    "CommandFields",
    "CommandInfo",
    "CommandResult",
    "CommandsUsage",
    "Cut",
    "DiskUsage",
    "EdgeLoad",
    "FileEntry",
    "FileStat",
    "ForkResult",
    "Lease",
    "Limits",
    "MemoryUsage",
    "NetworkPolicy",
    "OutputSpan",
    "Paused",
    "PidsUsage",
    "PreviewUrl",
    "PtySize",
    "Receipt",
    "Run",
    "RunFields",
    "SandboxFields",
    "SandboxInfo",
    "SandboxMetrics",
    "SandboxNetwork",
    "parse",
    "parse_list",
]


class SandboxFields(TypedDict, total=False):
    """The options of a create or restore as keywords: exactly :attr:`SandboxOptions.CLIENT_FIELDS
    <sandbox.core.model.SandboxOptions.CLIENT_FIELDS>` (a test holds them equal), checked by
    :class:`~sandbox.core.model.SandboxOptions` before any request.

    ``memory`` and ``disk`` are bytes, ``cpu`` CPUs, ``ttl``, ``idle_timeout`` and ``lease_ttl``
    seconds; ``network`` a list of egress allow rules (``[]`` denies everything; leaving it out
    gives loopback only); ``job`` names the lease the sandbox lives under.
    """

    cpu: float
    memory: int
    pids: int
    disk: int | None
    cpu_class: Literal["latency", "best-effort"]
    env: Mapping[str, str]
    workdir: str | None
    user: str | None
    labels: Mapping[str, str]
    ttl: float | None
    idle_timeout: float | None
    job: str | None
    lease_ttl: float | None
    network: Sequence[EgressRule | Mapping[str, Any]] | None
    userns: bool
    policy_version: str | None
    kernel: str


class CommandFields(TypedDict, total=False):
    """The keywords of a command, foreground or background (``commands.run``).

    ``on_stdout`` and ``on_stderr`` get output decoded as it arrives; ``timeout`` (seconds) is the
    command's limit, enforced by the service (it kills the command tree); ``env`` and ``cwd``
    apply to it alone; ``stdin`` is written to it first; ``output_cap`` bytes per stream are
    delivered at most, the first ones or, with ``keep="tail"``, also the last ones once it ends;
    ``check``: anything but exit 0 raises :class:`~sandbox.sdk.errors.CommandExitError`.
    """

    on_stdout: Callable[[str], Any] | None
    on_stderr: Callable[[str], Any] | None
    timeout: float | None
    env: Mapping[str, str] | None
    cwd: str | None
    stdin: bytes | str | None
    output_cap: int | None
    keep: Keep
    check: bool


class RunFields(CommandFields, total=False):
    """The keywords of a foreground command: :class:`CommandFields` and what only a command whose
    stream is read to its end has.

    ``idempotency_key``: a retry returns the first run's result instead of running again;
    ``rerun_if_interrupted`` (with a key): a first run that a preemption, restart, shutdown or
    disconnect cut short runs again instead of being replayed; ``on_cut`` hears each
    :class:`Cut` as the stream reports it.
    """

    idempotency_key: str | None
    rerun_if_interrupted: bool
    on_cut: Callable[[Cut], Any] | None


# -- parsing ---------------------------------------------------------------------------------------
_conv, _tuple, _of = converted, as_tuple, nested


def parse(cls: type[T], doc: Any) -> T:
    """``cls`` (one of the result dataclasses) from the service's JSON object ``doc``
    (:func:`sandbox.core.views.from_json`); an answer that is not one is ``bad_response``."""
    try:
        return from_json(cls, doc)
    except ViewError as exc:
        raise ApiError(502, "bad_response", str(exc)) from None


def parse_list(cls: type[T], doc: Any, key: str) -> list[T]:
    """The ``cls`` of each item of the list ``doc[key]`` (an answer such as ``{"sandboxes": [...]}``)."""
    items = doc.get(key) if isinstance(doc, Mapping) else None
    if not isinstance(items, list):
        raise ApiError(502, "bad_response", f"expected a JSON object with a list {key!r}, got {str(doc)[:200]}")
    from_json = getattr(cls, "from_json", None)  # the results whose JSON needs more than field conversions
    return [from_json(item) if from_json is not None else parse(cls, item) for item in items]


# -- sandboxes ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryUsage:
    """A sandbox's memory in bytes: charged now (page cache included), the peak, and its limit
    (None where the host's cgroups do not say)."""

    current: int | None = None
    peak: int | None = None
    limit: int | None = None
    # a running microVM's own view: {"total", "available", "used"} (the fields above are its VMM's)
    guest: Mapping[str, int] | None = None


@dataclass(frozen=True)
class PidsUsage:
    """A sandbox's processes and threads now, and its limit."""

    current: int | None = None
    limit: int | None = None


@dataclass(frozen=True)
class DiskUsage:
    """The bytes a sandbox's writes take: ``where`` is ``disk`` (its own filesystem, with ``free`` and
    ``limit``) or ``upper`` (its overlay's upper directory on the host; ``partial`` when the count
    stopped early at a very large tree)."""

    where: str
    used: int | None = None
    free: int | None = None
    limit: int | None = None
    partial: bool = False


@dataclass(frozen=True)
class CommandsUsage:
    """The commands a sandbox ran (from its receipts): how many, their CPU seconds, and the last one
    (its ``command``, ``exit_code``, ``time``, ``duration`` and ``resources``)."""

    count: int = 0
    cpu_seconds: float = 0.0
    last: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class SandboxMetrics:
    """What a sandbox uses now (``time``, Unix time): CPU seconds of its cgroup, memory, pids, disk,
    and its commands' totals."""

    sandbox: str
    status: str
    time: float
    cpu_seconds: float | None = None
    memory: MemoryUsage = field(default_factory=MemoryUsage, metadata=_conv(_of(MemoryUsage)))
    pids: PidsUsage = field(default_factory=PidsUsage, metadata=_conv(_of(PidsUsage)))
    disk: DiskUsage | None = field(default=None, metadata=_conv(_of(DiskUsage)))
    commands: CommandsUsage = field(default_factory=CommandsUsage, metadata=_conv(_of(CommandsUsage)))


@dataclass(frozen=True)
class PreviewUrl:
    """A signed URL to ``port`` of a sandbox: anyone holding it reaches the sandbox's server, without a
    token, until ``expires`` (Unix time).  ``path`` is the URL's path on the service."""

    url: str
    path: str
    port: int
    expires: int
    sandbox: str | None = None


@dataclass(frozen=True)
class Paused:
    """What a pause did: its receipt id, and the sandbox's memory (bytes) before and after the page
    cache was pushed out (None when nothing was reclaimed)."""

    receipt: str
    memory_before: int | None = None
    memory_after: int | None = None

    @classmethod
    def from_json(cls, doc: Any) -> Paused:
        """From the pause answer ``{"receipt", "reclaim": {"before", "after"} | null}``."""
        if not isinstance(doc, Mapping):
            return parse(cls, doc)  # (raises bad_response)
        given = doc.get("reclaim")
        reclaim: Mapping[str, Any] = given if isinstance(given, Mapping) else {}
        return parse(cls, {"receipt": doc.get("receipt"), "memory_before": reclaim.get("before"),
                           "memory_after": reclaim.get("after")})


@dataclass(frozen=True)
class Cut:
    """Where a command's streamed output skips some of what it printed (an exec stream's ``truncated``
    event): ``offset`` bytes of ``stream`` (``stdout`` or ``stderr``) came before the cut, and
    ``dropped_bytes`` are missing there.  ``keep`` is the command's: with ``"head"`` nothing follows
    the cut, with ``"tail"`` the stream's last bytes do (at most one cut per stream)."""

    stream: str
    offset: int
    dropped_bytes: int
    keep: str = "head"


@dataclass(frozen=True, kw_only=True)
class CommandExit:
    """How a command ended.

    ``exit_code`` is the exit status, 128 + N when signal N (``signal``) ended the command
    (None when the service never learned it: a command cut short by a restart).  ``truncated``:
    output past ``output_cap`` was dropped.  ``timed_out``: its ``timeout`` killed it.
    ``interrupted``: ``"preempt"``, ``"disconnect"``, ``"shutdown"``, ``"restart"``, ``"killed"``
    (a kill of a background command) or ``"destroy"`` (its sandbox's) stopped it early.
    ``replayed``: an earlier run under the same idempotency key answered.  ``duration`` is seconds.
    """

    exit_code: int | None
    signal: int | None = None
    truncated: bool = False
    duration: float = 0.0
    timed_out: bool = False
    oom_killed: bool = False
    interrupted: str | None = None
    replayed: bool = False


@dataclass(frozen=True, kw_only=True)
class CommandResult(CommandExit):
    """How a command ended (:class:`CommandExit`) and its output, decoded as UTF-8 (invalid bytes
    replaced; each span between cuts decoded on its own).

    ``cuts`` say where the output skips bytes (``output_cap``, with ``keep``); ``dropped`` counts
    the bytes of a background command's output the service no longer held when this client
    read it (its buffer keeps the most recent output), missing from both streams.
    """

    stdout: str
    stderr: str
    cuts: tuple[Cut, ...] = ()
    dropped: int = 0

    @classmethod
    def from_exit(cls, event: Mapping[str, Any], stdout: str, stderr: str, *, cuts: Sequence[Cut] = (),
                  dropped: int = 0) -> CommandResult:
        """From an exec stream's ``exit`` event and the output (and cuts) the stream carried."""
        if "exit_code" not in event:
            raise ApiError(502, "bad_response", f"an exit event without exit_code: {sorted(event)}")
        return parse(cls, {**event, "stdout": stdout, "stderr": stderr, "cuts": tuple(cuts), "dropped": dropped})


@dataclass(frozen=True)
class PtySize:
    """A terminal's size in character cells."""

    cols: int
    rows: int


@dataclass(frozen=True)
class OutputSpan:
    """The output of a background command the service still holds: offsets ``start`` to ``end``
    (both streams counted together from the command's start; ``end`` is all it printed)."""

    start: int = 0
    end: int = 0


def _ending(event: Any) -> CommandExit | None:
    return parse(CommandExit, event) if isinstance(event, Mapping) and event.get("type") == "exit" else None


@dataclass(frozen=True)
class CommandInfo:
    """A background command or terminal as the service describes it.

    ``command`` is its argv (a shell string runs as ``/bin/sh -c``); ``status`` ``running`` or
    ``exited``; ``started`` Unix time; ``pty`` its terminal's size (None: it runs on pipes);
    ``stdin_open`` whether it still takes input; ``readers`` the clients attached now;
    ``output`` what the service still holds of its output; ``exit`` how it ended, or
    ``error`` (the service's error object) when it could not run to an end.
    """

    id: str
    status: str
    command: tuple[str, ...] = field(default=(), metadata=_conv(_tuple))
    started: float = 0.0
    pty: PtySize | None = field(default=None, metadata=_conv(_of(PtySize)))
    stdin_open: bool = False
    readers: int = 0
    output: OutputSpan = field(default_factory=OutputSpan, metadata=_conv(_of(OutputSpan)))
    exit: CommandExit | None = field(default=None, metadata=_conv(_ending))
    error: Mapping[str, Any] | None = None

    @classmethod
    def from_json(cls, doc: Any) -> CommandInfo:
        """From a command's view, whose ``exit`` is its final event: an exit, or an error."""
        if not isinstance(doc, Mapping):
            return parse(cls, doc)  # (raises bad_response)
        final = doc.get("exit")
        error = final.get("error") if isinstance(final, Mapping) and final.get("type") == "error" else None
        return parse(cls, {**doc, "error": error})


# -- files ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FileEntry:
    """One entry of a directory listing (symlinks are listed, not followed).

    ``type`` is ``file``, ``dir``, ``symlink`` or ``other``; ``mode`` the permission bits;
    ``mtime`` Unix time.
    """

    name: str
    type: str
    size: int = 0
    mode: int = 0
    mtime: float = 0.0


@dataclass(frozen=True)
class FileStat:
    """One entry's metadata (a symlink is reported, not followed); ``type`` as for :class:`FileEntry`."""

    path: str
    type: str
    size: int = 0
    mode: int = 0
    uid: int = 0
    gid: int = 0
    mtime: float = 0.0


# -- checkpoints, receipts, jobs ------------------------------------------------------------------
@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint just made: ``name`` is the ref to restore it by (under the project's namespace),
    ``digest`` its document, ``parent`` what it was made on, ``layer`` the new layer's digest,
    ``layers`` how many it has in all; sizes in bytes, times in seconds."""

    name: str
    digest: str
    parent: str | None = None
    layer: str | None = None
    layers: int = 0
    entries: int = 0
    bytes_changed: int = 0
    bytes_uploaded: int = 0
    freeze_seconds: float = 0.0
    seconds: float = 0.0


@dataclass(frozen=True)
class CheckpointInfo:
    """One of the project's checkpoints as listed: ``name`` (the ref to restore or delete it by),
    ``digest``, when it was ``created`` (as the document says), what it was made on (``parent``,
    ``base``), its ``layers``, its sandbox's ``labels`` and the checkpoint's own, whether it is
    ``shared``, the network ``policy_version`` it is bound to and the ``bytes_changed`` it captured."""

    name: str
    digest: str
    created: str | None = None  # ISO 8601, UTC
    parent: str | None = None
    base: str | None = None
    layers: int = 0
    labels: Mapping[str, str] = field(default_factory=dict)
    shared: bool = False
    policy_version: str | None = None
    bytes_changed: int | None = None


@dataclass(frozen=True)
class ForkResult(Generic[S]):
    """What a fork made: ``sandboxes``, each continuing from the source's files as they were at
    ``checkpoint`` (an ordinary checkpoint of the project, restorable again); ``source`` the id
    of the sandbox forked.  The sandboxes are the caller's to kill."""

    sandboxes: tuple[S, ...]
    checkpoint: Checkpoint
    source: str


@dataclass(frozen=True)
class Receipt:
    """One record of a sandbox's receipt log (a hash chain: ``prev`` is the previous record's hash).

    ``action`` is ``create``, ``exec``, ``pause``, ``checkpoint``...; ``time`` Unix time;
    ``inherited`` marks records of the checkpoint a sandbox was restored from.  What else an
    action records (an exec's command, exit code, resources...) is in ``details``.
    """

    id: str
    sandbox: str
    action: str
    time: float
    image: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    prev: str | None = None
    inherited: bool = False
    details: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, doc: Any) -> Receipt:
        """From one record: the common fields, and every other key in ``details``."""
        if not isinstance(doc, Mapping):
            return parse(cls, doc)  # (raises bad_response)
        common = {f.name for f in dataclasses.fields(cls)}
        return parse(cls, {**doc, "details": {k: v for k, v in doc.items() if k not in common}})


@dataclass(frozen=True)
class Lease:
    """A job's lease: ``ttl`` seconds a renewal buys, ``expires`` (Unix time) when the service destroys
    the job's sandboxes unless renewed, ``state`` ``active``, ``draining`` or ``preempted``."""

    job: str
    ttl: float
    expires: float
    state: str = "active"
    manifest: str | None = None


@dataclass(frozen=True)
class Run:
    """A run manifest: ``ref`` to resume it by, ``digest``, ``seconds`` the operation took.

    From a preempt, ``sandboxes`` maps each sandbox id to its checkpoint; from a resume, each
    old id to the new sandbox's id.  ``manifest`` is the document itself.
    """

    ref: str
    digest: str
    sandboxes: Mapping[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    manifest: Mapping[str, Any] = field(default_factory=dict)


# -- the service ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class CallResult:
    """A FnCall's answer: ``value`` is a function's JSON-decoded return value, ``error`` its exception
    ("Type: message" and traceback) or why no answer came; output decoded as UTF-8; ``duration``
    seconds from request to answer, ``wait_seconds`` of it waiting for a warm sandbox."""

    exit_code: int | None
    stdout: str = ""
    stderr: str = ""
    value: Any = None
    error: str | None = None
    timed_out: bool = False
    truncated: bool = False
    duration: float = 0.0
    wait_seconds: float = 0.0

    @classmethod
    def from_json(cls, doc: Any) -> CallResult:
        """From the call answer, whose ``stdout`` and ``stderr`` are base64."""
        if not isinstance(doc, Mapping):
            return parse(cls, doc)  # (raises bad_response)
        try:
            out = {k: base64.b64decode(doc.get(k) or "").decode(errors="replace") for k in ("stdout", "stderr")}
        except (ValueError, TypeError) as exc:
            raise ApiError(502, "bad_response", f"CallResult: output is not base64: {exc}") from None
        return parse(cls, {**doc, **out})


@dataclass(frozen=True)
class Capabilities:
    """What a service provides; a request for anything else is refused, never downgraded.

    ``isolation`` kinds, ``cpu_classes``, enforced ``limits``; ``network`` and ``checkpoint``
    describe those features (``checkpoint["processes"]`` False: filesystem checkpoints only).
    """

    isolation: tuple[str, ...] = field(default=(), metadata=_conv(_tuple))
    cpu_classes: tuple[str, ...] = field(default=(), metadata=_conv(_tuple))
    limits: tuple[str, ...] = field(default=(), metadata=_conv(_tuple))
    network: Mapping[str, Any] = field(default_factory=dict)
    checkpoint: Mapping[str, Any] = field(default_factory=dict)
    preemption: bool = False
    fncall: bool = False
    streaming: str | None = None
    # per isolation kind: {"available": bool, "reason"...; "provides": [...], "lacks": [...]}
    backends: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EdgeLoad:
    """One edge's load report, what placement scores: ``accepting`` whether it admits a default create
    now, ``short`` what it lacks; per resource (``sandboxes``, ``memory``, ``pids``, ``disk``) its
    ``free``, ``in_flight``, ``reserve``... (bytes for memory and disk); ``load`` the load averages
    and ``cpus``; ``score`` higher is emptier; ``time`` Unix time of the report."""

    edge: str
    time: float
    accepting: bool
    score: float
    short: tuple[str, ...] = field(default=(), metadata=_conv(_tuple))
    sandboxes: Mapping[str, int] = field(default_factory=dict)
    memory: Mapping[str, int] = field(default_factory=dict)
    pids: Mapping[str, int] = field(default_factory=dict)
    disk: Mapping[str, int] = field(default_factory=dict)
    load: Mapping[str, float] = field(default_factory=dict)
