"""What the API says about a sandbox, made from the model: the edge writes these, the SDK reads them.

:meth:`SandboxInfo.of` turns the manager's :class:`~sandbox.core.model.SandboxState` into the
answer (:meth:`SandboxInfo.to_json`); the SDK parses the same answer back with
:func:`from_json` into the same class.  Parsing is lenient the way clients need: keys the
class does not have are ignored (a newer edge may add some), ``null`` stays ``None``; a
field's ``metadata["json"]`` converts its value (nested objects, lists to tuples).  A missing
required field is :class:`ViewError`.

Host details never appear: a sandbox's network is its address, its gateway's and its policy,
not the host's interface or namespace path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from sandbox.core.errors import SandboxError
from sandbox.core.model import PROJECT_LABEL, SandboxState

T = TypeVar("T")


class ViewError(SandboxError, ValueError):
    """An answer that is not the view it should be (a missing required field, not an object)."""


def converted(fn: Callable[[Any], Any]) -> dict[str, Any]:
    """A field's metadata: ``fn`` converts its JSON value (not ``null``) when parsing."""
    return {"json": fn}


def as_tuple(value: Any) -> tuple[Any, ...]:
    return tuple(value)


def nested(cls: type[Any]) -> Callable[[Any], Any]:
    """The converter of a field holding a ``cls`` object."""
    return lambda value: from_json(cls, value)


def from_json(cls: type[T], doc: Any) -> T:
    """``cls`` (a view dataclass) from the JSON object ``doc``."""
    if not isinstance(doc, Mapping):
        raise ViewError(f"{cls.__name__}: expected a JSON object, got {str(doc)[:200]}")
    given: dict[str, Any] = {}
    for f in dataclasses.fields(cast(Any, cls)):  # (a dataclass)
        if f.name in doc:
            value, convert = doc[f.name], f.metadata.get("json")
            given[f.name] = convert(value) if convert is not None and value is not None else value
    try:
        return cls(**given)
    except TypeError as exc:  # a required field is missing
        raise ViewError(f"{cls.__name__}: {exc}; got {sorted(doc)}") from None


def to_json(view: Any) -> dict[str, Any]:
    """A view dataclass as the JSON object :func:`from_json` reads back (tuples become lists)."""
    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, Mapping):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    return cast("dict[str, Any]", plain(view))


@dataclass(frozen=True)
class Limits:
    """A sandbox's resource limits: CPUs, memory bytes, pids, and whether it runs best-effort."""

    cpu: float
    memory: int
    pids: int
    best_effort: bool = False


@dataclass(frozen=True)
class NetworkPolicy:
    """A sandbox's egress allow rules as enforced (``rules`` with their resolved ``addresses``);
    ``version`` changes with every change, ``set_at`` is when (Unix time)."""

    version: str
    rules: tuple[Mapping[str, Any], ...] = field(default=(), metadata=converted(as_tuple))
    set_at: float | None = None


@dataclass(frozen=True)
class SandboxNetwork:
    """A sandbox's own network namespace: its address and prefix, the host side's, and the policy."""

    address: str
    host_address: str | None = None
    prefixlen: int | None = None
    policy: NetworkPolicy | None = field(default=None, metadata=converted(nested(NetworkPolicy)))


@dataclass(frozen=True)
class SandboxInfo:
    """One sandbox as the service describes it.

    ``status`` is ``creating``, ``starting``, ``running`` or ``paused``; ``image`` the ref it was
    created from and ``image_digest`` what that ref resolved to; ``labels`` the caller's labels;
    ``job`` the job (lease) it belongs to; ``network`` None for loopback only; ``created``,
    ``last_active`` and ``expires`` (its ttl's end) are Unix times.
    """

    id: str
    status: str
    image: str | None = None
    image_digest: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    limits: Limits | None = field(default=None, metadata=converted(nested(Limits)))
    created: float | None = None
    last_active: float | None = None
    isolation: str = "container"
    job: str | None = None
    cpu_class: str = "latency"
    disk: int | None = None
    admitting: bool = True
    network: SandboxNetwork | None = field(default=None, metadata=converted(nested(SandboxNetwork)))
    userns: bool = False
    ttl: float | None = None
    idle_timeout: float | None = None
    expires: float | None = None

    @classmethod
    def of(cls, state: SandboxState) -> SandboxInfo:
        """The view of the manager's record (a project's own label and job scope left out)."""
        o = state.options
        return cls(
            id=state.id, status=state.status, image=state.ref, image_digest=state.image_digest,
            labels={k: v for k, v in state.labels.items() if k != PROJECT_LABEL},
            limits=Limits(o.cpu, o.memory, o.pids, o.cpu_class == "best-effort"), created=state.created,
            last_active=state.last_active, isolation=o.isolation,
            job=state.job.partition("/")[2] if state.job else None, cpu_class=o.cpu_class, disk=o.disk,
            admitting=state.admitting, network=_network(state.network), userns=o.userns, ttl=o.ttl,
            idle_timeout=o.idle_timeout, expires=round(state.created + o.ttl, 3) if o.ttl is not None else None)

    def to_json(self) -> dict[str, Any]:
        return to_json(self)


def _network(recorded: Mapping[str, Any] | None) -> SandboxNetwork | None:
    """The sandbox's side of its network record (sandbox.isolation.network NetnsInfo and policy)."""
    if recorded is None:
        return None
    policy = recorded.get("policy")
    return SandboxNetwork(
        address=str(recorded.get("address")), host_address=recorded.get("host_address"),
        prefixlen=recorded.get("prefixlen"),
        policy=from_json(NetworkPolicy, policy) if isinstance(policy, Mapping) else None)
