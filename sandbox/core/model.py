"""The sandbox model: what a caller asks for, what the manager keeps, and the grammar of every name.

One definition per concept, validated once where it enters, then passed on typed:

* :class:`SandboxOptions` -- the properties of a sandbox (limits, environment, TTLs,
  job and lease, egress rules, user namespace).  The service builds it from a
  request body (:meth:`SandboxOptions.from_json`), the SDK and the CLI from their
  arguments, the manager takes nothing else.  Every field is checked in
  ``__post_init__``: a bad one raises :class:`~sandbox.core.errors.InvalidField`
  naming it, which the service answers with 400.
* :class:`ExecRequest` -- one command (argv or shell string, env, cwd, timeout,
  stdin, output cap and which end of the output it keeps, idempotency key).
* :class:`SandboxFilter` -- which sandboxes a listing returns (labels, status).
* :class:`Maxima` -- an edge's ceilings on both (memory, ttl, output cap...),
  checked by the service on top of the model's own bounds.
* :class:`SandboxState` -- the versioned record of one sandbox the manager
  keeps in ``boxes/<id>/state.json`` (docs/FORMAT.md, "Sandbox state").
* :class:`EgressRule` -- one allow rule of a sandbox's network policy.

Ids and names have one grammar each (:func:`check_sandbox_id`,
:func:`check_project`, :func:`check_job`), checked before they touch a path.

This module has no dependencies beyond the standard library and
:mod:`sandbox.core.errors`, so the SDK imports it on any client.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import ipaddress
import math
import re
import socket
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast, get_args

from sandbox.core.errors import InvalidField, StateUnreadable

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
DAY = 86400.0

# -- names ------------------------------------------------------------------------------------------
SANDBOX_ID = re.compile(r"lb-[0-9a-f]{12}")
PROJECT_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
# a job name is also a ref path component (runs/<job>), so it has the store's repo grammar
JOB_NAME = re.compile(r"(?=.{1,128}$)[a-z0-9]+(?:[._-][a-z0-9]+)*")
# a ref's last component and its tag are one file name in a POSIX store (refs/<repo>:<tag>), which
# NAME_MAX (255 bytes) bounds: a ref name a caller gives (a checkpoint's) is at most this long
MAX_REF_NAME = 200
LABEL_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")
ENV_KEY = re.compile(r"[^=\x00]{1,256}")
USER_SPEC = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,31})?")
PRINTABLE = re.compile(r"[\x20-\x7e]+")

# Labels under this prefix are the service's own (project, pool); a caller never sets them.
RESERVED_LABEL_PREFIX = "layerbox."
PROJECT_LABEL = "layerbox.project"
POOL_LABEL = "layerbox.pool"  # a warm-pool sandbox (sandbox.pools.fncall): never adopted after a restart
POOL_ID_LABEL = "layerbox.pool.id"
# the project a FnCall pool's sandbox is made for: it counts against that project's quota, and is
# not a sandbox the project can name (its PROJECT_LABEL is unset)
POOL_PROJECT_LABEL = "layerbox.pool.project"
# "true": the sandbox's egress rules may open protected ranges (the host, the sandbox subnet,
# metadata: sandbox.isolation.network).  An operator's decision: the edge sets it for a project
# its tokens file allows ("egress_protected"), a library caller in the options it passes.
PROTECTED_EGRESS_LABEL = "layerbox.egress.protected"
# "pause": at its ttl the reaper pauses the sandbox in place (its processes kept) instead of
# destroying it, and lets it live on paused to the edge's maximum lifetime (E2B's autoPause)
ON_TTL_LABEL = "layerbox.on-ttl"
SCHEMA_OPTIONS = "layerbox.sandbox-options.v1"  # a checkpoint's attachment: its sandbox's carried options

CpuClass = Literal["latency", "best-effort"]
CPU_CLASSES: tuple[str, ...] = get_args(CpuClass)
Status = Literal["creating", "starting", "running", "paused"]
# what isolates a sandbox: a crun container, or a QEMU VM with its own guest kernel: a
# microvm (QEMU's virtio-mmio "microvm" machine) or a full VM (q35: PCI, ACPI, a BIOS)
Isolation = Literal["container", "microvm", "vm"]
ISOLATIONS: tuple[str, ...] = get_args(Isolation)
VM_ISOLATIONS = ("microvm", "vm")
# which kernel a VM boots: layerbox's guest kernel, or the image's own (/vmlinuz, isolation=vm)
Kernel = Literal["layerbox", "image"]
KERNELS: tuple[str, ...] = get_args(Kernel)
STATUSES: tuple[str, ...] = get_args(Status)
Protocol = Literal["tcp", "udp", "icmp", "any"]
PROTOCOLS: tuple[str, ...] = get_args(Protocol)
Keep = Literal["head", "tail"]  # which end of a command's output survives its output_cap
KEEPS: tuple[str, ...] = get_args(Keep)

# The model's own bounds (what a sandbox can be at all); an edge's Maxima are usually lower.
MIN_MEMORY = 16 * MiB  # crun, the idle init and one shell need a few MiB
MIN_PIDS = 4  # the init, its sleep, crun exec and the command
MIN_DISK = 16 * MiB  # ext4 metadata alone needs a few MiB (sandbox.isolation.disk)
MAX_ENV_ENTRIES = 512
MAX_ENV_BYTES = 256 * KiB
MAX_LABELS = 64
MAX_RULES = 256
MAX_PATH = 4096
NAME_MAX = 255  # bytes of one path component (Linux): a longer one is refused before it reaches a file system
MAX_COMMAND_BYTES = 1 * MiB
MAX_ARGS = 4096
MAX_ID = (1 << 32) - 1  # (uid_t)-1 means "no change" to the kernel: never an id
UNCAPPED = 1 << 62  # an output_cap that is no cap (a terminal that prints everything)
MAX_FORK = 256  # sandboxes one fork or restore makes at most (an edge's Maxima.fork is lower)

DEFAULT_CPU = 1.0
DEFAULT_MEMORY = 512 * MiB
DEFAULT_PIDS = 256
DEFAULT_OUTPUT_CAP = 1 * MiB

_HOSTNAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,62}[A-Za-z0-9_])?"
                       r"(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,62}[A-Za-z0-9_])?)*\.?")


def new_sandbox_id() -> str:
    return "lb-" + uuid.uuid4().hex[:12]


def check_sandbox_id(value: object, field: str = "id") -> str:
    """``lb-`` and 12 lowercase hex digits, or :class:`InvalidField`: the only ids that become paths."""
    if not isinstance(value, str) or not SANDBOX_ID.fullmatch(value):
        shown = repr(value)[:80]
        raise InvalidField(field, f"{shown} is not a sandbox id (ids look like lb-0123456789ab)")
    return value


def check_project(value: object, field: str = "project") -> str:
    if not isinstance(value, str) or not PROJECT_NAME.fullmatch(value):
        raise InvalidField(field, f"{repr(value)[:80]}: project names are 1-63 lowercase letters, digits "
                                  "and '-', starting with a letter or digit")
    return value


def project_namespace(project: str) -> str:
    """The ref prefix a project writes under (``projects/<project>/``); everything else is shared
    and read-only to projects (images the operator published)."""
    return f"projects/{check_project(project)}/"


def check_job(value: object, field: str = "job") -> str:
    """A job as a caller names it (the service scopes it as ``<project>/<job>``)."""
    if not isinstance(value, str) or not JOB_NAME.fullmatch(value):
        raise InvalidField(field, f"{repr(value)[:80]}: job names are 1-128 lowercase letters and digits, "
                                  "single '.', '_' or '-' between them")
    return value


def _scoped_job(value: object, field: str = "job") -> str:
    """A job as the manager keeps it: ``<job>`` or ``<project>/<job>``."""
    if isinstance(value, str) and "/" in value:
        project, _, job = value.partition("/")
        check_project(project, field)
        check_job(job, field)
        return value
    return check_job(value, field)


# -- field checks -------------------------------------------------------------------------------------
def _shown(value: object) -> str:
    return repr(value)[:80]


def check_int(field: str, value: object, lo: int, hi: int) -> int:
    """A JSON integer (an integral float such as 5e8 counts) within [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidField(field, f"{_shown(value)} is not an integer")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise InvalidField(field, f"{_shown(value)} is not an integer")
        value = int(value)
    if not lo <= value <= hi:
        raise InvalidField(field, f"{value} is outside {lo}..{hi}")
    return value


def check_number(field: str, value: object, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """A finite JSON number within [lo, hi] (or (lo, hi] with ``lo_open``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidField(field, f"{_shown(value)} is not a number")
    number = float(value)
    if not math.isfinite(number) or number > hi or number < lo or (lo_open and number == lo):
        bound = f"more than {lo:g}" if lo_open else f"at least {lo:g}"
        raise InvalidField(field, f"{_shown(value)} must be {bound} and at most {hi:g}")
    return number


def check_str(field: str, value: object, *, max_len: int, pattern: re.Pattern[str] | None = None,
              what: str = "a string") -> str:
    if not isinstance(value, str):
        raise InvalidField(field, f"{_shown(value)} is not {what}")
    if not value or len(value) > max_len or "\x00" in value:
        raise InvalidField(field, f"{_shown(value)} must be 1-{max_len} characters without NUL")
    if pattern is not None and not pattern.fullmatch(value):
        raise InvalidField(field, f"{_shown(value)} is not {what}")
    return value


def check_path(field: str, value: object) -> str:
    """An absolute path inside the sandbox (resolved there, never on the host)."""
    path = check_str(field, value, max_len=MAX_PATH, what="an absolute path")
    if not path.startswith("/"):
        raise InvalidField(field, f"{_shown(path)} is not an absolute path")
    if any(len(part.encode("utf-8", "surrogatepass")) > NAME_MAX for part in path.split("/")):
        raise InvalidField(field, f"{_shown(path)}: a component is longer than {NAME_MAX} bytes")
    return path


def check_env(field: str, value: object) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise InvalidField(field, f"{_shown(value)} is not a map of names to strings")
    if len(value) > MAX_ENV_ENTRIES:
        raise InvalidField(field, f"{len(value)} variables, at most {MAX_ENV_ENTRIES}")
    out: dict[str, str] = {}
    total = 0
    for key, val in value.items():
        if not isinstance(key, str) or not ENV_KEY.fullmatch(key):
            raise InvalidField(field, f"variable name {_shown(key)}: 1-256 characters without '=' or NUL")
        if not isinstance(val, str) or "\x00" in val:
            raise InvalidField(f"{field}.{key}", f"{_shown(val)} is not a string without NUL")
        total += len(key) + len(val) + 2
        out[key] = val
    if total > MAX_ENV_BYTES:
        raise InvalidField(field, f"{total} bytes of variables, at most {MAX_ENV_BYTES}")
    return out


def check_user(field: str, value: object) -> str:
    """An account of the sandbox: name, uid, uid:gid or name:group (ids below MAX_ID)."""
    user = check_str(field, value, max_len=65, pattern=USER_SPEC, what="a user: name, uid, uid:gid or name:group")
    if any(part.isdigit() and int(part) >= MAX_ID for part in user.split(":")):
        raise InvalidField(field, f"{_shown(user)}: uids and gids are below {MAX_ID}")
    return user


def check_labels(field: str, value: object, *, reserved_ok: bool) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise InvalidField(field, f"{_shown(value)} is not a map of strings to strings")
    if len(value) > MAX_LABELS:
        raise InvalidField(field, f"{len(value)} labels, at most {MAX_LABELS}")
    out: dict[str, str] = {}
    for key, val in value.items():
        if not isinstance(key, str) or not LABEL_KEY.fullmatch(key):
            raise InvalidField(field, f"label key {_shown(key)}: 1-128 letters, digits, '.', '_', '/', '-'")
        if not reserved_ok and key.startswith(RESERVED_LABEL_PREFIX):
            raise InvalidField(f"{field}.{key}", f"keys under {RESERVED_LABEL_PREFIX!r} are the service's own")
        if not isinstance(val, str) or len(val) > 1024 or "\x00" in val:
            raise InvalidField(f"{field}.{key}", f"{_shown(val)} is not a string of at most 1024 characters")
        out[key] = val
    return out


def check_object(field: str, value: object, known: Sequence[str]) -> Mapping[str, Any]:
    """A JSON object whose keys are all in ``known`` (an unknown key is a typo, never ignored)."""
    if not isinstance(value, Mapping):
        raise InvalidField(field, f"{_shown(value)} is not a JSON object")
    unknown = sorted(str(k) for k in value if k not in known)
    if unknown:
        raise InvalidField(f"{field}.{unknown[0]}" if field else unknown[0],
                           f"unknown field (known: {', '.join(known)})")
    where = _not_text(value)
    if where is not None:
        raise InvalidField(f"{field}.{where}" if field else where,
                           "is not Unicode text (a lone surrogate escape such as \\ud800)")
    return value


def _is_text(value: str) -> bool:
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _not_text(doc: Mapping[str, Any]) -> str | None:
    """Where in a JSON object a string or key is no Unicode text: JSON's ``\\ud800`` escape decodes to a
    str that no UTF-8 file, argv or store document can hold (iterative: nesting cannot overflow it)."""
    stack: list[tuple[object, str]] = [(doc, "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str) and not _is_text(value):
            return where
        if isinstance(value, Mapping):
            for key, item in value.items():
                if isinstance(key, str) and not _is_text(key):
                    return where
                stack.append((item, f"{where}.{key}" if where else str(key)))
        elif isinstance(value, list | tuple):
            stack.extend((item, f"{where}[{i}]") for i, item in enumerate(value))
    return None


# -- egress rules -------------------------------------------------------------------------------------
class InvalidEgressRule(InvalidField):
    """An egress rule is malformed (CIDR, port, protocol, host name); nothing was changed."""

    def __init__(self, message: str) -> None:
        super().__init__("network", message)


def _parse_ports(value: Any, where: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if isinstance(value, list | tuple):
        if len(value) != 1:
            raise InvalidEgressRule(f"{where}: ports {value!r}: give one port or a 'lo-hi' range "
                                    f"(one rule per port otherwise)")
        value = value[0]
    if isinstance(value, bool):
        raise InvalidEgressRule(f"{where}: ports {value!r} is not a port number")
    if isinstance(value, int):
        lo = hi = value
    elif isinstance(value, str) and re.fullmatch(r"\s*\d{1,5}\s*(-\s*\d{1,5}\s*)?", value):
        left, _, right = value.partition("-")
        lo, hi = int(left), int(right or left)
    else:
        raise InvalidEgressRule(f"{where}: ports {value!r}: expected 443, '443' or '8000-8100'")
    if not (1 <= lo <= hi <= 65535):
        raise InvalidEgressRule(f"{where}: ports {value!r}: ports are 1-65535 and a range runs low-high")
    return lo, hi


IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class EgressRule:
    """Allow new and ongoing traffic to ``cidr`` (or the addresses ``host`` resolves to).

    ``ports`` is an inclusive range and only applies to tcp/udp; ``None`` means
    every port. A host name is resolved (both families) each time a policy
    containing it is set, and the effective policy lists what it resolved to.
    """

    cidr: str | None = None
    ports: tuple[int, int] | None = None
    protocol: Protocol = "tcp"
    host: str | None = None

    def __post_init__(self) -> None:
        where = (f"egress rule {{{'host' if self.host is not None else 'cidr'}: "
                 f"{self.host if self.host is not None else self.cidr!r}, protocol: {self.protocol!r}}}")
        if (self.cidr is None) == (self.host is None):
            raise InvalidEgressRule(f"{where}: give exactly one of 'cidr' or 'host'")
        if self.protocol not in PROTOCOLS:
            raise InvalidEgressRule(f"{where}: protocol {self.protocol!r} is not one of {', '.join(PROTOCOLS)}")
        if self.ports is not None:
            if self.protocol not in ("tcp", "udp"):
                raise InvalidEgressRule(f"{where}: ports only apply to tcp or udp, not {self.protocol}")
            if not (isinstance(self.ports, tuple) and len(self.ports) == 2
                    and all(isinstance(p, int) and not isinstance(p, bool) for p in self.ports)):
                raise InvalidEgressRule(f"{where}: ports {self.ports!r}: expected (low, high)")
            object.__setattr__(self, "ports", _parse_ports(f"{self.ports[0]}-{self.ports[1]}", where))
        if self.cidr is not None:
            try:
                net = ipaddress.ip_network(self.cidr, strict=True)
            except ValueError as exc:
                raise InvalidEgressRule(f"{where}: {exc} (e.g. '10.0.0.0/8', '2001:db8::/32', '1.2.3.4')") from None
            object.__setattr__(self, "cidr", str(net))
        if self.host is not None and not _HOSTNAME.fullmatch(self.host):
            raise InvalidEgressRule(f"{where}: {self.host!r} is not a host name")

    @classmethod
    def parse(cls, obj: EgressRule | Mapping[str, Any]) -> EgressRule:
        """``{"cidr" | "host": ..., "ports": 443 | "443" | "8000-8100" | [443], "protocol": "tcp"}``."""
        if isinstance(obj, EgressRule):
            return obj
        if not isinstance(obj, Mapping):
            raise InvalidEgressRule(f"egress rule {_shown(obj)}: expected a mapping like "
                                    "{'cidr': '10.0.0.0/8', 'ports': '443', 'protocol': 'tcp'}")
        # "addresses" lets an effective policy's rules round-trip (restore); they are re-resolved
        unknown = set(obj) - {"cidr", "host", "ports", "protocol", "addresses"}
        if unknown:
            raise InvalidEgressRule(f"egress rule {_shown(dict(obj))}: unknown keys {sorted(map(str, unknown))}")
        for key in ("cidr", "host", "protocol"):
            if key in obj and not isinstance(obj[key], str):
                raise InvalidEgressRule(f"egress rule {_shown(dict(obj))}: {key} must be a string")
        protocol = obj.get("protocol", "tcp")
        return cls(cidr=obj.get("cidr"), host=obj.get("host"), protocol=protocol,
                   ports=_parse_ports(obj.get("ports"), f"egress rule {_shown(dict(obj))}"))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"host": self.host} if self.host is not None else {"cidr": self.cidr}
        if self.ports is not None:
            lo, hi = self.ports
            out["ports"] = str(lo) if lo == hi else f"{lo}-{hi}"
        out["protocol"] = self.protocol
        return out

    def resolve(self) -> tuple[IPNetwork, ...]:
        if self.cidr is not None:
            return (ipaddress.ip_network(self.cidr),)
        assert self.host is not None
        try:
            infos = socket.getaddrinfo(self.host, None, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise InvalidEgressRule(f"egress rule {self.to_dict()}: host {self.host!r} does not resolve "
                                    f"on the sandbox host: {exc.strerror}") from None
        addrs = {ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos}
        return tuple(ipaddress.ip_network(a) for a in sorted(addrs, key=lambda a: (a.version, int(a))))


def parse_rules(rules: object, field: str = "network") -> tuple[EgressRule, ...]:
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
        raise InvalidField(field, f"{_shown(rules)} is not a list of egress allow rules")
    if len(rules) > MAX_RULES:
        raise InvalidField(field, f"{len(rules)} rules, at most {MAX_RULES}")
    return tuple(EgressRule.parse(r) for r in rules)


# -- sandbox options -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SandboxOptions:
    """Everything a caller may ask of a sandbox; validated on construction.

    ``memory`` and ``disk`` are bytes; ``cpu`` CPUs' worth of quota; ``ttl``,
    ``idle_timeout`` and ``lease_ttl`` seconds.  ``disk=None`` keeps the upper on
    the data dir's file system; ``network=None`` gives loopback only, a tuple of
    rules a policed namespace (default deny).  ``userns`` runs the sandbox on its
    own host uid range.  ``job`` is ``<job>`` or, from the service, ``<project>/<job>``.
    """

    cpu: float = DEFAULT_CPU
    memory: int = DEFAULT_MEMORY
    pids: int = DEFAULT_PIDS
    disk: int | None = None
    cpu_class: CpuClass = "latency"
    env: Mapping[str, str] = field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    ttl: float | None = None
    idle_timeout: float | None = None
    job: str | None = None
    lease_ttl: float | None = None
    network: tuple[EgressRule, ...] | None = None
    userns: bool = False
    policy_version: str | None = None
    isolation: Isolation = "container"
    kernel: Kernel = "layerbox"

    # the fields a client may send (the rest are set by whoever serves it)
    CLIENT_FIELDS = ("cpu", "memory", "pids", "disk", "cpu_class", "env", "workdir", "user", "labels", "ttl",
                     "idle_timeout", "job", "lease_ttl", "network", "userns", "policy_version", "isolation",
                     "kernel")

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("cpu", check_number("cpu", self.cpu, 0.0, 1024.0, lo_open=True))
        put("memory", check_int("memory", self.memory, MIN_MEMORY, 64 * TiB))
        put("pids", check_int("pids", self.pids, MIN_PIDS, 1 << 22))
        if self.disk is not None:
            put("disk", check_int("disk", self.disk, MIN_DISK, 1024 * TiB))
        if self.cpu_class not in CPU_CLASSES:
            raise InvalidField("cpu_class", f"{_shown(self.cpu_class)} is not one of {', '.join(CPU_CLASSES)}")
        put("env", check_env("env", self.env))
        if self.workdir is not None:
            put("workdir", check_path("workdir", self.workdir))
        if self.user is not None:
            put("user", check_user("user", self.user))
        put("labels", check_labels("labels", self.labels, reserved_ok=True))
        for name in ("ttl", "idle_timeout", "lease_ttl"):
            value = getattr(self, name)
            if value is not None:
                put(name, check_number(name, value, 0.0, 365 * DAY, lo_open=True))
        if self.job is not None:
            put("job", _scoped_job(self.job))
        if self.network is not None:
            put("network", parse_rules(self.network))
        if not isinstance(self.userns, bool):
            raise InvalidField("userns", f"{_shown(self.userns)} is not true or false")
        if self.policy_version is not None:
            put("policy_version", check_str("policy_version", self.policy_version, max_len=128,
                                            pattern=PRINTABLE, what="printable ASCII"))
        if self.isolation not in ISOLATIONS:
            raise InvalidField("isolation", f"{_shown(self.isolation)} is not one of {', '.join(ISOLATIONS)}")
        if self.isolation in VM_ISOLATIONS and self.userns:
            raise InvalidField("userns", f"a {self.isolation} has its own kernel: userns=true applies to containers "
                               "only")
        if self.kernel not in KERNELS:
            raise InvalidField("kernel", f"{_shown(self.kernel)} is not one of {', '.join(KERNELS)}")
        if self.kernel == "image" and self.isolation != "vm":
            raise InvalidField("kernel", "kernel=image (the image's own /vmlinuz) needs isolation=vm")

    @classmethod
    def from_json(cls, doc: object, *, field_prefix: str = "", extra: Sequence[str] = ()) -> SandboxOptions:
        """From a client's JSON object: unknown fields and reserved labels are refused.

        ``extra`` names fields of the surrounding request (``image``...) that are
        allowed in ``doc`` and ignored here.  A ``null`` field takes the default.
        """
        body = check_object(field_prefix, doc, (*cls.CLIENT_FIELDS, *extra))
        kwargs = {k: body[k] for k in cls.CLIENT_FIELDS if body.get(k) is not None}
        if "labels" in kwargs:
            kwargs["labels"] = check_labels("labels", kwargs["labels"], reserved_ok=False)
        return cls(**kwargs)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "network" and value is not None:
                value = [rule.to_dict() for rule in value]
            elif isinstance(value, Mapping):
                value = dict(value)
            out[f.name] = value
        return out

    @classmethod
    def from_state(cls, doc: Mapping[str, Any]) -> SandboxOptions:
        """From :meth:`to_json` output kept by the manager (reserved labels allowed)."""
        return cls(**{k: v for k, v in check_object("options", doc, cls.CLIENT_FIELDS).items()})

    def replace(self, **changes: Any) -> SandboxOptions:
        return dataclasses.replace(self, **changes)

    # what a checkpoint keeps of its sandbox's options, for a restore to start from: the
    # sandbox itself (environment, limits, labels), not its place in a job or its lifetime
    CARRIED = ("cpu", "memory", "pids", "disk", "cpu_class", "env", "workdir", "user", "labels", "network",
               "userns", "isolation", "kernel")

    def carried(self) -> dict[str, Any]:
        """The JSON a checkpoint keeps (``layerbox.sandbox-options.v1``): :attr:`CARRIED`, without
        the service's own labels (a restore gets its own project's)."""
        doc = {k: v for k, v in self.to_json().items() if k in self.CARRIED}
        doc["labels"] = {k: v for k, v in self.labels.items() if not k.startswith(RESERVED_LABEL_PREFIX)}
        return doc

    def overlay(self, given: SandboxOptions, fields: Sequence[str] | Mapping[str, Any]) -> SandboxOptions:
        """These options with the ``fields`` of ``given`` over them (labels merged, given's winning)."""
        changes = {k: getattr(given, k) for k in fields}
        if "labels" in changes:
            changes["labels"] = {**self.labels, **given.labels}
        return self.replace(**changes)

    @property
    def project(self) -> str | None:
        return self.labels.get(PROJECT_LABEL)

    @property
    def protected_egress(self) -> bool:
        """Whether the operator allowed this sandbox's rules to open protected ranges."""
        return self.labels.get(PROTECTED_EGRESS_LABEL) == "true"

    def fits_ready_sandbox(self) -> bool:
        """Whether a sandbox started ahead with default options can become one with these
        (:meth:`SandboxManager.adopt`): what is fixed when a container starts (its disk, network
        namespace, user namespace, CPU scheduling class, policy) must be the defaults; env, workdir,
        user, labels and lifetimes are the manager's own state, and limits a cgroup write."""
        return (self.disk is None and self.network is None and not self.userns
                and self.cpu_class == "latency" and self.policy_version is None and self.isolation == "container")


# -- exec requests -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExecRequest:
    """One command: ``cmd`` as argv (a list) or a shell string (run by ``/bin/sh -c``)."""

    cmd: str | tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    timeout: float | None = None
    stdin: bytes | None = None
    output_cap: int = DEFAULT_OUTPUT_CAP
    idempotency_key: str | None = None
    # "head": the first output_cap bytes per stream; "tail": also the last output_cap bytes, sent when
    # the command ends (what lies between is dropped, and the stream says how much: sandbox.host.execs.pump)
    keep: Keep = "head"
    # a keyed command a preemption, restart or shutdown cut short runs again instead of replaying that
    rerun_if_interrupted: bool = False
    # run as this account of the sandbox's /etc/passwd (name, uid, uid:gid or name:group) instead of
    # the sandbox's user; HOME and USER follow it unless env sets them
    user: str | None = None

    FIELDS = ("cmd", "env", "cwd", "timeout", "stdin", "output_cap", "idempotency_key", "keep",
              "rerun_if_interrupted", "user")

    def __post_init__(self) -> None:
        cmd = self.cmd
        if isinstance(cmd, str):
            check_str("cmd", cmd, max_len=MAX_COMMAND_BYTES, what="a shell command")
        elif isinstance(cmd, Sequence) and not isinstance(cmd, bytes):
            if not cmd or len(cmd) > MAX_ARGS:
                raise InvalidField("cmd", f"an argv list needs 1-{MAX_ARGS} strings")
            for i, arg in enumerate(cmd):
                if not isinstance(arg, str) or "\x00" in arg:
                    raise InvalidField(f"cmd[{i}]", f"{_shown(arg)} is not a string without NUL")
            if not cmd[0] or sum(len(a) + 1 for a in cmd) > MAX_COMMAND_BYTES:
                raise InvalidField("cmd", f"the program name is empty or the argv exceeds {MAX_COMMAND_BYTES} bytes")
            object.__setattr__(self, "cmd", tuple(cmd))
        else:
            raise InvalidField("cmd", f"{_shown(cmd)} is neither a shell string nor a list of strings")
        object.__setattr__(self, "env", check_env("env", self.env))
        if self.cwd is not None:
            object.__setattr__(self, "cwd", check_path("cwd", self.cwd))
        if self.timeout is not None:
            object.__setattr__(self, "timeout", check_number("timeout", self.timeout, 0.0, 30 * DAY, lo_open=True))
        if self.stdin is not None and not isinstance(self.stdin, bytes):
            raise InvalidField("stdin", "must be bytes")
        object.__setattr__(self, "output_cap", check_int("output_cap", self.output_cap, 0, UNCAPPED))
        if self.idempotency_key is not None:
            object.__setattr__(self, "idempotency_key", check_str(
                "idempotency_key", self.idempotency_key, max_len=200, pattern=PRINTABLE, what="printable ASCII"))
        if self.keep not in KEEPS:
            raise InvalidField("keep", f"{_shown(self.keep)} is not one of {', '.join(KEEPS)}")
        if not isinstance(self.rerun_if_interrupted, bool):
            raise InvalidField("rerun_if_interrupted", f"{_shown(self.rerun_if_interrupted)} is not true or false")
        if self.user is not None:
            object.__setattr__(self, "user", check_user("user", self.user))
        if self.rerun_if_interrupted and self.idempotency_key is None:
            raise InvalidField("rerun_if_interrupted", "goes with an idempotency_key (only a keyed command is "
                                                       "ever replayed)")

    @property
    def argv(self) -> list[str]:
        return ["/bin/sh", "-c", self.cmd] if isinstance(self.cmd, str) else list(self.cmd)

    @classmethod
    def from_json(cls, doc: object) -> ExecRequest:
        """From the service's JSON body: ``stdin`` is base64; ``null`` takes the default."""
        body = check_object("", doc, cls.FIELDS)
        if body.get("cmd") is None:  # null is no command either (it has no default to take)
            raise InvalidField("cmd", "is required: a shell string or a list of strings")
        kwargs = {k: body[k] for k in cls.FIELDS if body.get(k) is not None}
        if "stdin" in kwargs:
            if not isinstance(kwargs["stdin"], str):
                raise InvalidField("stdin", "must be a base64 string")
            try:
                kwargs["stdin"] = base64.b64decode(kwargs["stdin"], validate=True)
            except (binascii.Error, ValueError):
                raise InvalidField("stdin", "is not valid base64") from None
        return cls(**kwargs)


# -- an edge's ceilings ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Maxima:
    """What one edge admits at most per sandbox and per command (the service checks these)."""

    cpu: float = 64.0
    memory: int = 64 * GiB
    pids: int = 32768
    disk: int = 1 * TiB
    ttl: float = 7 * DAY
    idle_timeout: float = 7 * DAY
    lease_ttl: float = 1 * DAY
    exec_timeout: float = 1 * DAY
    output_cap: int = 64 * MiB  # what the service streams per stream; the rest is counted, not kept
    # keep=tail holds a command's last output_cap bytes per stream in memory until it ends: a lower cap
    output_tail: int = 4 * MiB
    network_rules: int = MAX_RULES
    fork: int = 16  # sandboxes one fork or restore request makes at most

    def check(self, options: SandboxOptions) -> SandboxOptions:
        for name in ("cpu", "memory", "pids", "disk", "ttl", "idle_timeout", "lease_ttl"):
            value, limit = getattr(options, name), getattr(self, name)
            if value is not None and value > limit:
                raise InvalidField(name, f"{value:g} is above this edge's maximum of {limit:g}")
        if options.network is not None and len(options.network) > self.network_rules:
            raise InvalidField("network", f"{len(options.network)} rules, this edge takes at most {self.network_rules}")
        return options

    def check_exec(self, req: ExecRequest) -> ExecRequest:
        if req.timeout is not None and req.timeout > self.exec_timeout:
            raise InvalidField("timeout", f"{req.timeout:g} is above this edge's maximum of {self.exec_timeout:g}")
        if req.output_cap > self.output_cap:
            raise InvalidField("output_cap", f"{req.output_cap} is above this edge's maximum of {self.output_cap}")
        if req.keep == "tail" and req.output_cap > self.output_tail:
            raise InvalidField("output_cap", f"{req.output_cap} with keep=tail is above this edge's maximum of "
                                             f"{self.output_tail} (the tail is held in memory until the command ends)")
        return req

    def check_count(self, value: object, field: str = "count") -> int:
        """How many sandboxes one fork or restore makes: 1 to this edge's ``fork``."""
        return check_int(field, value, 1, min(self.fork, MAX_FORK))

    def check_ttl(self, value: object, field: str = "ttl") -> float:
        """Seconds a running sandbox is given from now (its age plus these is checked against ``ttl``)."""
        return check_number(field, value, 0.0, self.ttl, lo_open=True)


# -- listing ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SandboxFilter:
    """Which sandboxes a listing returns: those with every one of ``labels`` and, if given, ``status``.

    From a query string (:meth:`from_query`): ``label=<key>=<value>`` (repeatable, all must match)
    and ``state=<status>``; any other parameter is refused, as an unknown field is.
    """

    labels: Mapping[str, str] = field(default_factory=dict)
    status: Status | None = None

    QUERY = ("label", "state")

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", check_labels("label", self.labels, reserved_ok=False))
        if self.status is not None and self.status not in STATUSES:
            raise InvalidField("state", f"{_shown(self.status)} is not one of {', '.join(STATUSES)}")

    @classmethod
    def from_query(cls, pairs: Sequence[tuple[str, str]]) -> SandboxFilter:
        labels: dict[str, str] = {}
        status: str | None = None
        for key, value in pairs:
            if key == "label":
                name, sep, wanted = value.partition("=")
                if not sep:
                    raise InvalidField("label", f"{_shown(value)}: expected key=value")
                if labels.get(name, wanted) != wanted:
                    raise InvalidField("label", f"{_shown(name)} is given two values: nothing can match")
                labels[name] = wanted
            elif key == "state":
                if status is not None and value != status:
                    raise InvalidField("state", "is given twice with different values: nothing can match")
                status = value
            else:
                raise InvalidField(key[:64], f"unknown query parameter (known: {', '.join(cls.QUERY)})")
        return cls(labels, cast("Status | None", status))  # checked in __post_init__

    def to_query(self) -> list[tuple[str, str]]:
        """The query string pairs that make this filter (for a client)."""
        pairs = [("label", f"{k}={v}") for k, v in self.labels.items()]
        return pairs + ([("state", self.status)] if self.status is not None else [])

    def matches(self, state: SandboxState) -> bool:
        return ((self.status is None or state.status == self.status)
                and all(state.labels.get(k) == v for k, v in self.labels.items()))


# -- the manager's record of one sandbox ------------------------------------------------------------------
# 2 added ``vm``; a version 1 state (a container's, written before) reads as one with vm=None
STATE_VERSION = 2
READABLE_STATE_VERSIONS = (1, 2)


@dataclass(frozen=True)
class SandboxState:
    """What the manager knows of one sandbox (``boxes/<id>/state.json``, format in docs/FORMAT.md).

    Written before anything it names exists, and only by the manager; never
    read from anywhere a sandbox can write.  ``pid`` and ``init_start`` (the
    init's start time in clock ticks) name the container's init once it runs;
    ``env``, ``cwd``, ``uid`` and ``gid`` are what every exec gets unless it says
    otherwise (the image's config merged with the options).
    """

    id: str
    status: Status
    ref: str
    image_digest: str
    kind: str
    options: SandboxOptions
    layer_digests: tuple[str, ...]
    created: float
    last_active: float
    cgroups_path: str
    pid: int | None = None
    init_start: int | None = None
    admitting: bool = True
    userns: tuple[int, int] | None = None
    network: Mapping[str, Any] | None = None  # sandbox.isolation.network NetnsInfo + its effective "policy"
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str = "/"
    uid: int = 0
    gid: int = 0
    # a microvm's: its guest assets, template, VMM accel (sandbox.backends.vm.qemu); None for a container
    vm: Mapping[str, Any] | None = None
    version: int = STATE_VERSION

    def __post_init__(self) -> None:
        check_sandbox_id(self.id)
        if self.status not in STATUSES:
            raise StateUnreadable(f"sandbox {self.id}: status {self.status!r} is not one of {STATUSES}")

    # the options' fields the manager reads most
    @property
    def labels(self) -> Mapping[str, str]:
        return self.options.labels

    @property
    def job(self) -> str | None:
        return self.options.job

    @property
    def project(self) -> str | None:
        return self.options.project

    @property
    def policy_version(self) -> str | None:
        return self.options.policy_version

    @property
    def live(self) -> bool:
        return self.status in ("running", "paused")

    def replace(self, **changes: Any) -> SandboxState:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version, "id": self.id, "status": self.status, "ref": self.ref,
            "image_digest": self.image_digest, "kind": self.kind, "options": self.options.to_json(),
            "layer_digests": list(self.layer_digests), "created": self.created, "last_active": self.last_active,
            "cgroups_path": self.cgroups_path, "pid": self.pid, "init_start": self.init_start,
            "admitting": self.admitting, "userns": list(self.userns) if self.userns is not None else None,
            "network": dict(self.network) if self.network is not None else None, "env": dict(self.env),
            "cwd": self.cwd, "uid": self.uid, "gid": self.gid,
            "vm": dict(self.vm) if self.vm is not None else None,
        }

    @classmethod
    def from_json(cls, doc: object, *, where: str) -> SandboxState:
        """Strict: a state of another version, a missing or mistyped field is :class:`StateUnreadable`."""
        if not isinstance(doc, Mapping):
            raise StateUnreadable(f"{where}: not a JSON object")
        if doc.get("version") not in READABLE_STATE_VERSIONS:
            raise StateUnreadable(f"{where}: state version {doc.get('version')!r}, this layerbox reads "
                                  f"{' or '.join(map(str, READABLE_STATE_VERSIONS))} (a sandbox left by another "
                                  "version: destroy it)")
        try:
            userns = doc.get("userns")
            state = cls(
                id=doc["id"], status=doc["status"], ref=_typed(doc, "ref", str), image_digest=_typed(doc, "image_digest", str),
                kind=_typed(doc, "kind", str), options=SandboxOptions.from_state(doc["options"]),
                layer_digests=tuple(_typed(doc, "layer_digests", list)), created=float(doc["created"]),
                last_active=float(doc["last_active"]), cgroups_path=_typed(doc, "cgroups_path", str),
                pid=_opt_int(doc, "pid"), init_start=_opt_int(doc, "init_start"),
                admitting=_typed(doc, "admitting", bool),
                userns=(int(userns[0]), int(userns[1])) if userns is not None else None,
                network=doc.get("network"), env=_typed(doc, "env", dict), cwd=_typed(doc, "cwd", str),
                uid=_typed(doc, "uid", int), gid=_typed(doc, "gid", int),
                vm=_typed(doc, "vm", dict) if doc.get("vm") is not None else None)
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise StateUnreadable(f"{where}: {type(exc).__name__}: {exc}") from None
        return state


def _typed(doc: Mapping[str, Any], key: str, kind: type) -> Any:
    value = doc[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"{key} is {type(value).__name__}, not {kind.__name__}")
    return value


def _opt_int(doc: Mapping[str, Any], key: str) -> int | None:
    value = doc.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{key} is {type(value).__name__}, not an integer")
    return value
