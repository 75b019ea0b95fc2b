"""Trust between gateways and edges (docs/SECURITY.md, "The fleet").

An edge in a fleet holds one secret, its *edge key*: HMAC-SHA256 of the fleet key (kept in the
fleet database, which only gateways reach) over the edge's id.  A gateway derives any edge's
key; an edge knows only its own, so a compromised edge can neither speak for a gateway to
another edge nor heartbeat as another edge.

Gateway -> edge: every request carries ``X-Layerbox-Gateway: v1;<time>;<caller>;<mac>`` where
``caller`` is the calling project (base64url JSON: name, quota, rights) or ``-`` for a request
that names a sandbox alone (envd with its own access token, a signed port URL), and ``mac`` is
the edge key's HMAC over version, time, method, path with query, and caller.  The edge accepts
a request only with a valid MAC, a time within :data:`SKEW` of its own clock (the gateway signs
with the edge's clock, learnt from its heartbeats), and a MAC it has not seen before: a copied
header neither works on another route nor twice.  The caller's own token never reaches an edge.

Edge -> gateway (heartbeats): ``X-Layerbox-Edge: v1;<edge id>;<time>;<mac>`` with the MAC over
version, edge id, time and the SHA-256 of the body.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
import secrets
import threading
import time
from dataclasses import dataclass

from sandbox.core.errors import ApiError

GATEWAY_HEADER = "X-Layerbox-Gateway"
EDGE_HEADER = "X-Layerbox-Edge"
VERSION = "v1"
SKEW = 120.0  # seconds a signed request stays valid either side of the receiver's clock
KEY_BYTES = 32
SEEN_PRUNE = 4096  # accepted MACs remembered before the ones out of the window are dropped
EDGE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")  # an edge's name: in keys, headers, the registry


def edge_key(fleet_key: bytes, edge_id: str) -> bytes:
    return hmac.new(fleet_key, f"layerbox edge key {VERSION}\n{edge_id}".encode(), hashlib.sha256).digest()


@dataclass(frozen=True)
class Caller:
    """The project a gateway vouches for: what an edge's tokens file would say of it."""

    name: str
    max_sandboxes: int
    admin: bool = False
    egress_protected: bool = False

    def encode(self) -> str:
        doc = {"name": self.name, "max_sandboxes": self.max_sandboxes, "admin": self.admin,
               "egress_protected": self.egress_protected}
        return base64.urlsafe_b64encode(json.dumps(doc, separators=(",", ":")).encode()).decode().rstrip("=")

    @classmethod
    def decode(cls, text: str) -> Caller:
        try:
            doc = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
            caller = cls(doc["name"], int(doc["max_sandboxes"]), bool(doc["admin"]), bool(doc["egress_protected"]))
        except (ValueError, KeyError, TypeError, binascii.Error):
            raise ApiError(None, "unauthenticated", f"{GATEWAY_HEADER}: malformed caller") from None
        if not isinstance(caller.name, str) or not caller.name:
            raise ApiError(None, "unauthenticated", f"{GATEWAY_HEADER}: malformed caller")
        return caller


def _mac(key: bytes, *parts: str) -> str:
    return hmac.new(key, "\n".join(parts).encode(), hashlib.sha256).hexdigest()


def sign_request(key: bytes, method: str, path_qs: str, caller: Caller | None, now: float) -> str:
    """The header a gateway sends with ``method path_qs`` to the edge whose key is ``key``."""
    who = caller.encode() if caller is not None else "-"
    # 9 random digits after the milliseconds: the same request signed twice in one millisecond (two
    # creates of a project to one edge, from one gateway or two) must not make the same MAC, which
    # the edge would refuse as replayed; the value stays the time to within a millisecond
    # (the milliseconds truncated, not rounded: rounded up, the digits could put it 1.5 ms ahead)
    stamp = f"{int(now * 1000) // 1000}.{int(now * 1000) % 1000:03d}{secrets.randbelow(10**9):09d}"
    return f"{VERSION};{stamp};{who};{_mac(key, VERSION, stamp, method.upper(), path_qs, who)}"


class GatewayTrust:
    """An edge's check of gateways' requests; remembers the MACs it accepted within :data:`SKEW`."""

    def __init__(self, key: bytes, *, clock: float = 0.0) -> None:
        if len(key) < KEY_BYTES:
            raise ValueError(f"an edge key has at least {KEY_BYTES} bytes, not {len(key)}")
        self.key = key
        self.clock = clock  # seconds added to time.time(): a test's skewed host
        self._seen: dict[str, float] = {}
        self._prune_at = SEEN_PRUNE
        self._lock = threading.Lock()

    def now(self) -> float:
        return time.time() + self.clock

    def verify(self, header: str | None, method: str, path_qs: str) -> Caller | None:
        """The caller a valid header vouches for (None: a request for a sandbox alone); 401 otherwise."""
        if not header:
            raise ApiError(None, "unauthenticated", f"this edge serves a fleet: only gateways reach it "
                                                    f"(missing {GATEWAY_HEADER})")
        parts = header.split(";")
        if len(parts) != 4 or parts[0] != VERSION:
            raise ApiError(None, "unauthenticated", f"{GATEWAY_HEADER}: not {VERSION};time;caller;mac")
        _, stamp, who, mac = parts
        try:
            at = float(stamp)
        except ValueError:
            raise ApiError(None, "unauthenticated", f"{GATEWAY_HEADER}: bad time {stamp[:32]!r}") from None
        if not hmac.compare_digest(mac, _mac(self.key, VERSION, stamp, method.upper(), path_qs, who)):
            raise ApiError(None, "unauthenticated", f"{GATEWAY_HEADER}: bad signature")
        now = self.now()
        if not now - SKEW <= at <= now + SKEW:  # (nan fails both)
            raise ApiError(None, "unauthenticated", f"{GATEWAY_HEADER}: signed at {at:.0f}, {now - at:+.0f} s "
                                                    f"from this edge's clock (more than {SKEW:.0f} s)")
        with self._lock:
            if mac in self._seen:
                raise ApiError(None, "unauthenticated", f"{GATEWAY_HEADER}: replayed")
            self._seen[mac] = at
            if len(self._seen) > self._prune_at:
                self._seen = {m: t for m, t in self._seen.items() if t >= now - SKEW}
                # next time at twice what is still in the window: past SEEN_PRUNE requests per window
                # a fixed bound would rebuild the whole map on every request
                self._prune_at = max(SEEN_PRUNE, 2 * len(self._seen))
        return None if who == "-" else Caller.decode(who)


def sign_report(key: bytes, edge_id: str, body: bytes, now: float) -> str:
    stamp = f"{now:.3f}"
    return f"{VERSION};{edge_id};{stamp};{_mac(key, VERSION, edge_id, stamp, hashlib.sha256(body).hexdigest())}"


def report_signer(header: str | None) -> tuple[str, str, str]:
    """(edge id, time, mac) of an edge's header, before its key is looked up; 401 when malformed."""
    parts = (header or "").split(";")
    if len(parts) != 4 or parts[0] != VERSION:
        raise ApiError(None, "unauthenticated", f"missing or malformed {EDGE_HEADER}")
    return parts[1], parts[2], parts[3]


def verify_report(key: bytes, edge_id: str, stamp: str, mac: str, body: bytes, now: float) -> float:
    """The report's time if ``mac`` is the edge key's over it and it is recent; 401 otherwise."""
    if not hmac.compare_digest(mac, _mac(key, VERSION, edge_id, stamp, hashlib.sha256(body).hexdigest())):
        raise ApiError(None, "unauthenticated", f"{EDGE_HEADER}: bad signature for edge {edge_id!r}")
    try:
        at = float(stamp)
    except ValueError:
        raise ApiError(None, "unauthenticated", f"{EDGE_HEADER}: bad time") from None
    if not now - SKEW <= at <= now + SKEW:
        raise ApiError(None, "unauthenticated", f"{EDGE_HEADER}: signed {now - at:+.0f} s from the gateway's clock")
    return at
