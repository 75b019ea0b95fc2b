"""Per-sandbox network namespaces with default-deny egress and runtime-changeable allow rules.

Layout under ``state_dir`` (one :class:`NetworkManager` per host data dir)::

    state_dir/netns/<sid>   nsfs bind mount of the sandbox's network namespace (crun joins it)
    state_dir/net.json      allocations and policies: {sid: {index, host_if, policy}} in a
                            host-state table of format layerbox.net
    state_dir/net.lock      flock serialising every read-modify-write of net.json

Each sandbox gets a veth pair: ``eth0`` inside, ``lb<tag><hash>`` on the host
(``tag`` names the manager, so two managers on one host never collide and each
recognises its own links), a /30 out of ``subnet`` (host side ``.1``, sandbox
``.2``, default route via ``.1``) and an nftables table ``inet layerbox`` *inside*
the namespace:

* output: policy drop. Loopback is accepted; every other packet, including the
  packets of established connections, must match an allow rule. Denied packets
  are counted, their destination is recorded in a dynamic set, and they are
  rejected (TCP of a live connection with a RST, everything else with ICMP
  admin-prohibited) so that programs fail at once instead of hanging in SYN
  retries for minutes.
* input: only loopback and established/related; the rest is counted and dropped.
* protected destinations (:data:`ALWAYS_PROTECTED`: loopback, link-local and cloud
  metadata, broadcast and multicast; the sandbox subnet, i.e. the host side of every
  veth and every other sandbox; the host's own addresses; the operator's own ranges)
  are never reached through ``0.0.0.0/0`` or ``::/0``, and any other rule that
  overlaps one is refused (:class:`ProtectedDestination`) unless the sandbox is
  allowed them (``allow_protected``, an operator's decision): a rule is checked on
  the addresses it resolves to, before anything changes (docs/SECURITY.md,
  "Protected destinations").

Because every packet is checked against the current rules, :meth:`set_policy`
cuts live connections to destinations it removes; no conntrack flush is needed
and none can be missed.

The sandbox's processes lack CAP_NET_ADMIN and seccomp denies setns and user
namespaces, so nothing inside can change the table (see docs/SECURITY.md).

Every method is blocking (``ip`` runs as a command, a few ms; nftables goes
through libnftables in-process, a fraction of a ms); async callers use
``asyncio.to_thread``. Work inside a namespace runs on a short-lived thread that
has ``setns``'d into it: a network namespace is per thread, the children that
thread spawns inherit it, and so does the netlink socket libnftables opens on
it, so no ``nsenter`` exec is needed.
"""

from __future__ import annotations

import builtins
import contextlib
import copy
import ctypes
import ctypes.util
import errno
import ipaddress
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import blake3

from layerstore.hoststate import HostTable, closed_dir
from sandbox.core.errors import HostUnsupported, InvalidField, SandboxError, SandboxNotFound
from sandbox.core.model import EgressRule, InvalidEgressRule, IPNetwork, parse_rules
from sandbox.core.procs import kill_group, spawn
from sandbox.isolation import nftables

log = logging.getLogger("layerbox.sandbox.network")


CLONE_NEWNET = 0x40000000
MS_BIND = 4096
MNT_DETACH = 2
TABLE = "layerbox"
DENIED_SET_SIZE = 4096
TOOL_TIMEOUT = 10.0
# Where a packet from a sandbox reaches the host itself, the cloud's metadata service or the
# local link, on every host; each manager adds its sandbox subnet, the host's own addresses and
# the operator's ranges (NetworkManager(protected=...)).  The value says what a refusal names.
ALWAYS_PROTECTED: dict[str, str] = {
    "127.0.0.0/8": "loopback", "::1/128": "loopback",
    "169.254.0.0/16": "link-local, where cloud metadata answers (169.254.169.254)",
    "fe80::/10": "link-local", "fd00:ec2::254/128": "the cloud metadata address (IPv6)",
    # delivered to the host's own sockets on 0.0.0.0 (a UDP service) by the veth's host side
    "255.255.255.255/32": "the limited broadcast, which the host receives itself",
    "224.0.0.0/4": "multicast, which the host's own services receive", "ff00::/8": "multicast",
}

_SID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")

T = TypeVar("T")


class NetworkError(SandboxError):
    """Setting up, policing or removing a sandbox's network failed; the message names the sandbox."""


class NetworkConflict(NetworkError):
    """The sandbox subnet overlaps a route this manager does not own, or is exhausted."""


class ProtectedDestination(InvalidEgressRule):
    """An egress rule would open a protected range to a sandbox not allowed it; nothing was changed.

    The message names the rule, the address it covers or resolves to, and the protected range
    with what it is.  ``rule`` is the rule's index in the list it came in.
    """

    def __init__(self, index: int, rule: EgressRule, address: IPNetwork, protected: IPNetwork, why: str) -> None:
        if rule.host is not None:
            what = f"host {rule.host!r} resolves to {address.network_address}, in"
        elif _within(address, protected):
            what = f"{address} lies in"
        else:
            what = f"{address} contains"
        super().__init__(f"rule {index} {json.dumps(rule.to_dict())}: {what} the protected range {protected} "
                         f"({why}). Rules may not open protected ranges unless the operator allows it for the "
                         "project; 0.0.0.0/0 and ::/0 reach every other address (docs/SECURITY.md, \"Protected "
                         "destinations\")")
        self.rule = index
        self.address = address
        self.protected = protected


# -- namespaces and tools -----------------------------------------------------------------------

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        # a host fault while building the sandbox's network: a bare OSError would read (to the
        # edge, say) as a fault in the request's files
        err = ctypes.get_errno()
        raise NetworkError(f"{what}: [Errno {err}] {os.strerror(err)}")


def _on_thread(fn: Callable[[], T], *, netns: Path | None = None, new: Path | None = None) -> T:
    """Run ``fn`` on a fresh thread inside ``netns``, or inside a new netns bind-mounted at ``new``.

    The thread ends with ``fn``, so no pooled thread is ever left in a foreign namespace.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            if new is not None:
                _check(_libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
                # New links in this namespace (eth0) start without IPv6: no link-local route to
                # the host's fe80:: addresses. lo keeps ::1.
                v6 = Path("/proc/sys/net/ipv6/conf/default/disable_ipv6")
                if v6.exists():  # absent when the kernel runs with ipv6.disable=1
                    v6.write_text("1")
                _check(_libc.mount(b"/proc/thread-self/ns/net", os.fsencode(new), None, MS_BIND, None),
                       f"bind mount of a new network namespace at {new}")
            elif netns is not None:
                fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    if _libc.setns(fd, CLONE_NEWNET) != 0:
                        raise NetworkError(f"{netns} is not a network namespace "
                                           f"({os.strerror(ctypes.get_errno())}): destroy the sandbox's network "
                                           "and create it again")
                finally:
                    os.close(fd)
            box["value"] = fn()
        except BaseException as exc:  # handed to the calling thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="layerbox-netns", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return cast(T, box["value"])


def new_netns(path: Path) -> None:
    """A new network namespace (only ``lo``, down), kept by a bind mount of it at ``path`` (a file)."""
    _on_thread(lambda: None, new=path)


def run_in(netns: Path, fn: Callable[[], T]) -> T:
    """``fn()`` on a thread of its own inside the network namespace bound at ``netns``."""
    return _on_thread(fn, netns=netns)


def socket_in(netns: Path) -> socket.socket:
    """A non-blocking TCP socket made inside the network namespace ``netns`` (a socket keeps the
    namespace it was made in: its connect and everything after run anywhere)."""
    sock = _on_thread(lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC), netns=netns)
    sock.setblocking(False)
    return sock


def _netns_in_userns(path: Path, userns_fd: int) -> None:
    """A new network namespace owned by the user namespace ``userns_fd``, bind-mounted at ``path``.

    A threaded process cannot enter a user namespace, so a child does (nsenter, which gets
    every capability in it) and unshares the network there; host root then bind-mounts the
    child's namespace, which outlives the child.
    """
    argv = ["nsenter", f"--user=/proc/self/fd/{userns_fd}", "--",
            "unshare", "--net", "--", "sh", "-c", "echo ready; read _"]
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=(userns_fd,), start_new_session=True)
    except FileNotFoundError:
        raise HostUnsupported("nsenter/unshare are missing (apt-get install util-linux)") from None
    try:
        assert proc.stdout is not None
        if proc.stdout.readline() != b"ready\n":
            err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
            raise NetworkError(f"a network namespace in the sandbox's user namespace: {' '.join(argv)} "
                               f"failed: {err}")
        _check(_libc.mount(os.fsencode(f"/proc/{proc.pid}/ns/net"), os.fsencode(path), None, MS_BIND, None),
               f"bind mount of a new network namespace at {path}")
    finally:
        kill_group(proc)


def _run(argv: Sequence[str], stdin: str = "", *, what: str) -> str:
    """Run one ip/nft command (argv list, own process group, timeout kills the group)."""
    proc = spawn(argv, stdin=subprocess.PIPE)
    try:
        out, err = proc.communicate(stdin.encode(), timeout=TOOL_TIMEOUT)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        raise NetworkError(f"{what}: {' '.join(argv)} gave no answer in {TOOL_TIMEOUT}s "
                           "(process group killed)") from None
    if proc.returncode != 0:
        raise NetworkError(f"{what}: {' '.join(argv)} exited {proc.returncode}: "
                           f"{err.decode(errors='replace').strip()}")
    return out.decode()


def _nft(script: str, *, what: str, json_output: bool = False) -> str:
    """Run an nft script in the calling thread's netns (in-process: see sandbox/isolation/nftables.py)."""
    try:
        return nftables.run(script, json_output=json_output)
    except nftables.NftError as exc:
        raise NetworkError(f"{what}: nft refused the script: {exc}") from None


def _write_sysctl(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _umount_all(path: Path) -> None:
    while True:
        if _libc.umount2(os.fsencode(path), MNT_DETACH) != 0:
            err = ctypes.get_errno()
            if err in (errno.EINVAL, errno.ENOENT):
                return  # not (or no longer) a mount point
            raise NetworkError(f"umount of the network namespace {path}: [Errno {err}] {os.strerror(err)}")


def _json_docs(text: str) -> Iterator[Any]:
    decoder = json.JSONDecoder()
    pos = 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            return
        doc, pos = decoder.raw_decode(text, pos)
        yield doc


def _unversioned_net(doc: dict[str, Any], version: int | None) -> dict[str, Any]:
    """net.json before the envelope: ``{"sandboxes", "subnet", "version": 1}``."""
    if doc.pop("version", None) != 1 or not isinstance(doc["sandboxes"], dict):
        raise ValueError("not a version 1 network table")
    return doc


@dataclass(frozen=True)
class NetnsInfo:
    """What crun and the manager need about a sandbox's network."""

    sid: str
    path: str  # the nsfs bind mount: spec.build_spec(netns_path=...)
    host_if: str
    host_address: str  # gateway, host side of the veth
    address: str  # eth0 inside
    prefixlen: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


# -- the manager ---------------------------------------------------------------------------------

class NetworkManager:
    """Network namespaces, addresses and egress policies of the sandboxes of one data dir.

    ``masquerade=True`` adds a host nftables table that NATs the subnet to the
    host's uplinks and turns on ``net.ipv4.ip_forward`` (a host-wide change,
    logged); without it the only host settings touched are per-interface
    sysctls on this manager's own veths.  ``protected``: the operator's own
    ranges (CIDRs), protected as the host's addresses are (:func:`protected_ranges`).
    """

    BLOCK = 4  # a /30 per sandbox: network, host side, sandbox, broadcast

    def __init__(self, state_dir: str | os.PathLike[str], *, subnet: str = "10.213.0.0/16",
                 masquerade: bool = False, protected: Sequence[str | IPNetwork] = ()) -> None:
        extra = protected_ranges(protected)
        if shutil.which("ip") is None:
            raise HostUnsupported("ip: not installed (apt-get install iproute2)")
        nftables.available()  # NftUnavailable is a HostUnsupported, with the package to install
        self.state_dir = Path(state_dir)
        self.netns_dir = self.state_dir / "netns"
        # closed to others: net.json names every sandbox and its addresses, and net.lock held by
        # another user would stall every create with a network (the namespaces are opened as root)
        closed_dir(self.state_dir)
        closed_dir(self.netns_dir)
        try:
            net = ipaddress.ip_network(subnet, strict=True)
        except ValueError as exc:
            raise NetworkConflict(f"sandbox subnet {subnet!r}: {exc}") from None
        if not isinstance(net, ipaddress.IPv4Network) or net.prefixlen > 30:
            raise NetworkConflict(f"sandbox subnet {subnet!r}: needs an IPv4 network of /30 or larger")
        self.subnet = net
        self._allocations = HostTable(self.state_dir / "net.json", "layerbox.net", 1, upgrade=_unversioned_net,
                                      empty=lambda: {"subnet": str(net), "sandboxes": {}},
                                      lock=self.state_dir / "net.lock", aside=(
                                          "only with its sandboxes destroyed: their addresses would be "
                                          "handed out again"))
        self.tag = blake3.blake3(os.fsencode(self.state_dir.resolve())).hexdigest()[:4]
        self.if_prefix = f"lb{self.tag}"
        self.masquerade = masquerade
        self.host_addresses = self._inspect_host()
        self.protected: tuple[tuple[IPNetwork, str], ...] = (
            (net, "the sandbox subnet: every sandbox and the host side of its veth"),
            *((ipaddress.ip_network(n), why) for n, why in ALWAYS_PROTECTED.items()),
            *((ipaddress.ip_network(a), "an address of this host") for a in self.host_addresses),
            *((n, "protected by the operator") for n in extra))
        # sandbox -> (what its last full counter reading was taken under, that reading): counters()
        self._last_counters: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        if masquerade:
            self._ensure_host_nat()

    # -- public API -----------------------------------------------------------------------------
    def netns_path(self, sid: str) -> Path:
        return self.netns_dir / _valid_sid(sid)

    def host_if(self, sid: str) -> str:
        return self.if_prefix + blake3.blake3(_valid_sid(sid).encode()).hexdigest()[:9]

    def create(self, sid: str, rules: Sequence[EgressRule | Mapping[str, Any]] = (), *,
               userns_fd: int | None = None, vm: bool = False, allow_protected: bool = False) -> NetnsInfo:
        """Make the sandbox's netns, veth, addresses and (default-deny) table; ``rules`` start allowed.

        A rule that would open a protected range raises :class:`ProtectedDestination` before
        anything is made, unless ``allow_protected`` (the operator's decision for this sandbox).

        With ``userns_fd`` the namespace is owned by that user namespace (the sandbox's), so
        the runtime can mount a sysfs of its own for it; host root still configures it.
        ``vm``: also a tap device (:data:`VM_TAP`) for a microVM's NIC, routed to eth0 and
        masqueraded as the sandbox's address, its forwarded packets policed by the same rules
        (:meth:`_vm_commands`).  On any failure everything made so far is removed again.
        """
        parsed = parse_rules(rules)
        path = self.netns_path(sid)
        host_if = self.host_if(sid)
        policy = self._effective(sid, parsed, allow_protected)  # resolve and check before touching the host
        with self._locked() as state:
            if sid in state or path.exists():
                raise NetworkError(f"sandbox {sid}: a network already exists under {self.state_dir} "
                                   "(destroy it first)")
            used = {entry["index"] for entry in state.values()}
            index = next((i for i in range(self.subnet.num_addresses // self.BLOCK) if i not in used), None)
            if index is None:
                raise NetworkConflict(f"sandbox {sid}: subnet {self.subnet} is full ({len(used)} sandboxes); "
                                      "destroy some or use a larger subnet", retryable=True)
            state[sid] = {"index": index, "host_if": host_if, "policy": policy}
        info = self._info(sid, index)
        try:
            path.touch(exist_ok=False)
            if userns_fd is None:
                _on_thread(lambda: None, new=path)
            else:
                _netns_in_userns(path, userns_fd)
            _run(["ip", "-batch", "-"], what=f"sandbox {sid}: host side of veth {host_if}", stdin=(
                f"link add {host_if} type veth peer name eth0 netns {path}\n"
                f"addr add {info.host_address}/{info.prefixlen} dev {host_if}\n"
                f"link set {host_if} up\n"))
            self._host_sysctls(host_if)
            ruleset = self._table(policy)
            inside = (f"link set lo up\naddr add {info.address}/{info.prefixlen} dev eth0\n"
                      f"link set eth0 up\nroute add default via {info.host_address} dev eth0\n")

            if vm:
                ruleset += self._vm_commands()

            def configure() -> None:
                # (a namespace made in a user namespace did not get the "no IPv6 on new links" default)
                v6 = Path("/proc/sys/net/ipv6/conf/eth0/disable_ipv6")
                if v6.exists():
                    v6.write_text("1")
                # the table first: eth0 comes up already policed
                _nft(ruleset, what=f"sandbox {sid}: egress table")
                _run(["ip", "-batch", "-"], inside, what=f"sandbox {sid}: addresses inside")
                if vm:
                    _vm_tap(sid)
                    Path("/proc/sys/net/ipv4/ip_forward").write_text("1")  # this namespace's own

            _on_thread(configure, netns=path)
        except BaseException:
            self.destroy(sid)
            raise
        return info

    def create_isolated(self, sid: str) -> Path:
        """A network namespace with loopback and a microVM's tap only: no route anywhere (a
        microVM without a network, and a template's boot).  Removed by :meth:`destroy`."""
        path = self.netns_path(sid)
        if path.exists():
            raise NetworkError(f"sandbox {sid}: a network already exists under {self.state_dir} (destroy it first)")
        try:
            path.touch(exist_ok=False)
            _on_thread(lambda: None, new=path)
            def configure() -> None:
                _run(["ip", "link", "set", "lo", "up"], what=f"sandbox {sid}: lo")
                _vm_tap(sid)

            _on_thread(configure, netns=path)
        except BaseException:
            self.destroy(sid)
            raise
        return path

    def _vm_commands(self) -> str:
        """The forward chain (the tap's packets: the output chain sees only the namespace's own) and
        the masquerade, for :meth:`create` with ``vm``: every new packet from the guest goes
        through the same allow/deny chains, replies to what they allowed come back."""
        # the output rule: what the namespace itself sends the guest (the deny chain's rejects, so
        # the guest's programs fail at once as a container's do); nothing else runs there to send
        return f"""insert rule inet {TABLE} output oifname "{VM_TAP}" accept
add chain inet {TABLE} forward {{ type filter hook forward priority filter; policy drop; }}
add rule inet {TABLE} forward iifname "eth0" oifname "{VM_TAP}" ct state established,related accept
add rule inet {TABLE} forward iifname "{VM_TAP}" oifname "eth0" ip daddr @protected4 jump allow_protected
add rule inet {TABLE} forward iifname "{VM_TAP}" oifname "eth0" ip6 daddr @protected6 jump allow_protected
add rule inet {TABLE} forward iifname "{VM_TAP}" oifname "eth0" ip daddr @protected4 goto deny
add rule inet {TABLE} forward iifname "{VM_TAP}" oifname "eth0" ip6 daddr @protected6 goto deny
add rule inet {TABLE} forward iifname "{VM_TAP}" oifname "eth0" jump allow
add rule inet {TABLE} forward iifname "{VM_TAP}" goto deny
add rule inet {TABLE} forward counter name "ingress_dropped" drop
add table ip {TABLE}_vm
add chain ip {TABLE}_vm post {{ type nat hook postrouting priority srcnat; }}
add rule ip {TABLE}_vm post oifname "eth0" ip saddr {VM_GUEST_NET} masquerade
"""

    def info(self, sid: str) -> NetnsInfo:
        entry = self._entry(sid)
        return self._info(sid, entry["index"])

    def policy(self, sid: str) -> dict[str, Any]:
        return dict(self._entry(sid)["policy"])

    def set_policy(self, sid: str, rules: Sequence[EgressRule | Mapping[str, Any]], *,
                   allow_protected: bool = False) -> dict[str, Any]:
        """Replace the allow set in one nft transaction; return the effective policy.

        New and established connections follow the new rules from the next
        packet on: a removed destination's live TCP connections are reset.
        Host names are resolved now, on the host.  A rule that would open a
        protected range raises :class:`ProtectedDestination` and the old policy
        stays, unless ``allow_protected``.
        """
        parsed = parse_rules(rules)
        path = self.netns_path(sid)
        self._entry(sid)
        policy = self._effective(sid, parsed, allow_protected)
        commands = self._allow_commands(policy, flush=True)
        _on_thread(lambda: _nft(commands, what=f"sandbox {sid}: set egress policy"), netns=self._live(sid, path))
        with self._locked() as state:
            if sid not in state:
                raise SandboxNotFound(f"sandbox {sid}: its network was destroyed while setting the policy")
            state[sid]["policy"] = policy
        return policy

    def check(self, rules: Sequence[EgressRule | Mapping[str, Any]], *, allow_protected: bool = False) -> None:
        """What :meth:`create` refuses, refused without a sandbox: malformed rules, and rules that
        would open a protected range (:class:`ProtectedDestination`) unless ``allow_protected``."""
        self._effective("check", parse_rules(rules), allow_protected)

    def counters(self, sid: str) -> dict[str, Any]:
        """Egress verdict counters since create (``rules`` only since the last set_policy).

        ``denied_destinations`` lists (address, protocol, port) with packet and
        byte counts; at most 4096 distinct entries are kept, later ones are
        only counted in ``denied``.

        Read before and after every policed command, so the common case is cheap: the named
        ``accepted`` and ``denied`` counters are read first (one netlink dump, ~0.05 ms), and
        while they and the policy are what they were at the last full reading, so is every
        per-rule and per-destination counter (each accepting rule and each denied-set update
        goes with one of the two): that reading is answered again, with ``ingress_dropped``
        fresh.  Otherwise the whole table is listed (~1.5 ms) and remembered.
        """
        path = self._live(sid, self.netns_path(sid))
        policy = self._entry(sid)["policy"]
        named = _on_thread(lambda: nftables.named_counters(TABLE), netns=path)
        key = (policy["version"], policy.get("set_at"), named.get("accepted"), named.get("denied"))
        known = self._last_counters.get(sid)
        if known is not None and known[0] == key:
            out = copy.deepcopy(known[1])
            packets, size = named.get("ingress_dropped", (0, 0))
            out["ingress_dropped"] = {"packets": packets, "bytes": size}
            return out
        text = _on_thread(lambda: _nft(f"list table inet {TABLE}", what=f"sandbox {sid}: counters", json_output=True),
                          netns=path)
        out = _parse_counters(policy["version"], text)
        # (the listing is later than `named`: remembered under the listing's own figures)
        listed = (out["accepted"]["packets"], out["accepted"]["bytes"])
        denied = (out["denied"]["packets"], out["denied"]["bytes"])
        self._last_counters[sid] = ((policy["version"], policy.get("set_at"), listed, denied), copy.deepcopy(out))
        return out

    def destroy(self, sid: str) -> None:
        """Remove the veth, the netns mount and the allocation; a no-op for what is already gone."""
        path = self.netns_path(sid)
        host_if = self.host_if(sid)
        if Path("/sys/class/net", host_if).exists():
            try:
                _run(["ip", "link", "del", host_if], what=f"sandbox {sid}: delete veth {host_if}")
            except NetworkError:
                if Path("/sys/class/net", host_if).exists():
                    raise
        _umount_all(path)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        with self._locked() as state:
            state.pop(sid, None)
        self._last_counters.pop(sid, None)

    def list(self) -> builtins.list[str]:
        """Sandboxes with any network resource under this state dir (allocation or netns file)."""
        with self._locked() as state:
            sids = set(state)
        sids |= {p.name for p in self.netns_dir.iterdir() if _SID.match(p.name)}
        return sorted(sids)

    def teardown_host(self) -> None:
        """Remove the host NAT table (``masquerade=True``); sandboxes keep running without NAT."""
        # add-then-delete: idempotent without nft >= 1.0.8's `destroy`
        _nft(f"add table ip {self._nat_table}\ndelete table ip {self._nat_table}\n", what="remove host NAT table")

    # -- helpers --------------------------------------------------------------------------------
    @property
    def _nat_table(self) -> str:
        return f"layerbox_nat_{self.tag}"

    def _info(self, sid: str, index: int) -> NetnsInfo:
        base = int(self.subnet.network_address) + index * self.BLOCK
        return NetnsInfo(sid=sid, path=str(self.netns_path(sid)), host_if=self.host_if(sid),
                         host_address=str(ipaddress.IPv4Address(base + 1)),
                         address=str(ipaddress.IPv4Address(base + 2)), prefixlen=30)

    def _entry(self, sid: str) -> dict[str, Any]:
        with self._locked() as state:
            entry = state.get(_valid_sid(sid))
        if entry is None:
            raise SandboxNotFound(f"sandbox {sid}: no network under {self.state_dir} (create it first)")
        return dict(entry)

    def _live(self, sid: str, path: Path) -> Path:
        if not path.exists():
            raise SandboxNotFound(f"sandbox {sid}: network namespace {path} is gone (destroy and recreate)")
        return path

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        """net.json under an exclusive flock; written back when the block succeeds and changed it."""
        with self._allocations.locked() as body:
            yield body["sandboxes"]
            body["subnet"] = str(self.subnet)  # the subnet the indexes count in

    def _inspect_host(self) -> builtins.list[str]:
        """The host's own addresses, and a check that no foreign route overlaps the subnet."""
        text = _run(["ip", "-j", "-batch", "-"], "addr show\nroute show table all\n", what="inspect host network")
        docs = list(_json_docs(text))
        addrs, routes = (docs + [[], []])[:2]
        own: builtins.list[str] = []
        for link in addrs:
            for a in link.get("addr_info", []):
                ip = ipaddress.ip_address(a["local"].split("%")[0])
                if not ip.is_loopback and ip not in self.subnet:
                    own.append(str(ip))
        for route in routes:
            dst, dev = route.get("dst", ""), route.get("dev", "")
            if dst in ("", "default") or dev.startswith(self.if_prefix) or route.get("type") in ("broadcast",):
                continue
            try:
                net = ipaddress.ip_network(dst, strict=False)
            except ValueError:
                continue
            if net.version == 4 and net.overlaps(self.subnet) and route.get("type", "unicast") == "unicast":
                raise NetworkConflict(f"sandbox subnet {self.subnet} overlaps the host route {dst} dev {dev}: "
                                      "pick another subnet (NetworkManager(subnet=...))")
        return sorted(set(own), key=lambda s: (ipaddress.ip_address(s).version, int(ipaddress.ip_address(s))))

    def _host_sysctls(self, host_if: str) -> None:
        conf = f"/proc/sys/net/ipv4/conf/{host_if}"
        _write_sysctl(f"{conf}/forwarding", "1")  # routing from this veth only; no host-wide switch
        _write_sysctl(f"{conf}/rp_filter", "1")  # a sandbox cannot send with another source address
        v6 = f"/proc/sys/net/ipv6/conf/{host_if}/disable_ipv6"
        if os.path.exists(v6):
            _write_sysctl(v6, "1")  # no fe80:: on the host side for the sandbox to talk to

    def _ensure_host_nat(self) -> None:
        log.warning("masquerade on: setting net.ipv4.ip_forward=1 and NAT table ip %s for %s",
                    self._nat_table, self.subnet)
        _nft(what="host NAT table", script=(
            f"add table ip {self._nat_table}\nflush table ip {self._nat_table}\n"
            f"table ip {self._nat_table} {{\n  chain postrouting {{\n"
            "    type nat hook postrouting priority srcnat; policy accept;\n"
            f"    ip saddr {self.subnet} oifname != \"{self.if_prefix}*\" masquerade\n  }}\n}}\n"))
        _write_sysctl("/proc/sys/net/ipv4/ip_forward", "1")

    def _protected(self) -> builtins.list[IPNetwork]:
        nets = [n for n, _ in self.protected]
        v4 = [n for n in nets if isinstance(n, ipaddress.IPv4Network)]
        v6 = [n for n in nets if isinstance(n, ipaddress.IPv6Network)]
        return [*ipaddress.collapse_addresses(v4), *ipaddress.collapse_addresses(v6)]

    def _effective(self, sid: str, rules: Sequence[EgressRule], allow_protected: bool) -> dict[str, Any]:
        listed = []
        for index, rule in enumerate(rules):
            entry = rule.to_dict()
            addresses = rule.resolve()
            for address in addresses if not allow_protected else ():
                touched = _touching(address, self.protected)
                if touched is not None:
                    raise ProtectedDestination(index, rule, address, *touched)
            entry["addresses"] = [str(n) for n in addresses]
            listed.append(entry)
        canonical = json.dumps(listed, sort_keys=True, separators=(",", ":"))
        return {"sandbox": sid, "version": blake3.blake3(canonical.encode()).hexdigest()[:32],
                "rules": listed, "set_at": time.time()}

    def _allow_commands(self, policy: Mapping[str, Any], *, flush: bool) -> str:
        lines = []
        if flush:
            lines += [f"flush chain inet {TABLE} allow", f"flush chain inet {TABLE} allow_protected",
                      f"flush set inet {TABLE} protected4", f"flush set inet {TABLE} protected6"]
        protected = self._protected()
        for version in (4, 6):
            elems = ", ".join(str(n) for n in protected if n.version == version)
            if elems:
                lines.append(f"add element inet {TABLE} protected{version} {{ {elems} }}")
        for index, rule in enumerate(policy["rules"]):
            for addr in rule["addresses"]:
                net = ipaddress.ip_network(addr)
                fam = "ip" if net.version == 4 else "ip6"
                match = [f"{fam} daddr {net}"]
                proto = rule["protocol"]
                if proto in ("tcp", "udp"):
                    ports = rule.get("ports")
                    match.append(f"{proto} dport {ports}" if ports else f"meta l4proto {proto}")
                elif proto == "icmp":
                    match.append("meta l4proto icmp" if net.version == 4 else "meta l4proto ipv6-icmp")
                lines += [f"add rule inet {TABLE} {chain} {' '.join(match)} "
                          f"counter counter name \"accepted\" accept comment \"rule:{index}\""
                          for chain in _chains(net, protected)]
        return "\n".join(lines) + "\n"

    def _table(self, policy: Mapping[str, Any]) -> str:
        sets = []
        for v, addr in ((4, "ipv4_addr"), (6, "ipv6_addr")):
            sets.append(f"  set denied{v} {{\n    type {addr} . inet_proto . inet_service; size {DENIED_SET_SIZE}; "
                        "flags dynamic; counter;\n  }")
            sets.append(f"  set denied{v}_proto {{\n    type {addr} . inet_proto; size {DENIED_SET_SIZE}; "
                        "flags dynamic; counter;\n  }")
            sets.append(f"  set protected{v} {{\n    type {addr}; flags interval;\n  }}")
        body = "\n".join(sets)
        return f"""table inet {TABLE} {{
  counter accepted {{
  }}
  counter denied {{
  }}
  counter ingress_dropped {{
  }}
{body}
  chain allow {{
  }}
  chain allow_protected {{
  }}
  chain deny {{
    meta nfproto ipv4 meta l4proto {{ tcp, udp, sctp }} add @denied4 {{ ip daddr . meta l4proto . th dport }}
    meta nfproto ipv4 meta l4proto != {{ tcp, udp, sctp }} add @denied4_proto {{ ip daddr . meta l4proto }}
    meta nfproto ipv6 meta l4proto {{ tcp, udp, sctp }} add @denied6 {{ ip6 daddr . meta l4proto . th dport }}
    meta nfproto ipv6 meta l4proto != {{ tcp, udp, sctp }} add @denied6_proto {{ ip6 daddr . meta l4proto }}
    meta l4proto tcp ct state established counter name "denied" reject with tcp reset
    counter name "denied" reject with icmpx admin-prohibited
  }}
  chain output {{
    type filter hook output priority filter; policy drop;
    oif lo accept
    ip daddr @protected4 jump allow_protected
    ip6 daddr @protected6 jump allow_protected
    ip daddr @protected4 goto deny
    ip6 daddr @protected6 goto deny
    jump allow
    goto deny
  }}
  chain input {{
    type filter hook input priority filter; policy drop;
    iif lo accept
    ct state established,related accept
    counter name "ingress_dropped" drop
  }}
}}
""" + self._allow_commands(policy, flush=False)


# A microVM's side of its namespace: the tap its VMM attaches to, a /30 of its own (the
# namespace .1, the guest .2), masqueraded to the sandbox's address on eth0.
VM_TAP = "tap0"
VM_GUEST_NET = "169.254.100.0/30"
VM_TAP_ADDRESS = "169.254.100.1"
VM_GUEST_ADDRESS = "169.254.100.2"


def _vm_tap(sid: str) -> None:
    """In the calling thread's namespace: the tap a microVM's VMM attaches to (by name)."""
    _run(["ip", "-batch", "-"], what=f"sandbox {sid}: the VM's tap", stdin=(
        f"tuntap add dev {VM_TAP} mode tap vnet_hdr\n"
        f"addr add {VM_TAP_ADDRESS}/30 dev {VM_TAP}\n"
        f"link set {VM_TAP} up\n"))


def protected_ranges(ranges: Sequence[str | IPNetwork], field: str = "protected") -> tuple[IPNetwork, ...]:
    """An operator's protected ranges as networks: CIDRs without host bits, else :class:`InvalidField`."""
    if isinstance(ranges, str):
        raise InvalidField(field, f"{ranges!r}: expected a list of CIDRs")
    out = []
    for item in ranges:
        try:
            out.append(ipaddress.ip_network(item, strict=True))
        except (TypeError, ValueError) as exc:
            raise InvalidField(field, f"{item!r} is not a CIDR ({exc}), e.g. '10.0.0.0/8' or 'fd00::/8'") from None
    return tuple(out)


def _touching(net: IPNetwork, protected: Sequence[tuple[IPNetwork, str]]) -> tuple[IPNetwork, str] | None:
    """The first protected range (and what it is) that ``net`` would open, if any.

    CIDRs are nested or apart, so overlapping is lying in one or containing one.  A whole
    family (0.0.0.0/0, ::/0) opens none: the output chain never lets a protected
    destination reach the ``allow`` chain (:meth:`NetworkManager._table`)."""
    if net.prefixlen == 0:
        return None
    return next(((p, why) for p, why in protected if _within(net, p) or _within(p, net)), None)


def _chains(net: IPNetwork, protected: Sequence[IPNetwork]) -> tuple[str, ...]:
    """The allow chains a rule's range is written to.  The output chain sends a protected
    destination to ``allow_protected`` (then to deny) and every other one to ``allow``, so a
    range inside a protected one belongs in ``allow_protected`` alone, a range containing one
    (a sandbox allowed protected ranges asked for all of it) in both, and a whole family
    (0.0.0.0/0, ::/0: the public internet) in ``allow`` alone."""
    if any(_within(net, p) for p in protected):
        return ("allow_protected",)
    if net.prefixlen and any(_within(p, net) for p in protected):
        return ("allow", "allow_protected")
    return ("allow",)


def _within(net: IPNetwork, outer: IPNetwork) -> bool:
    if isinstance(net, ipaddress.IPv4Network) and isinstance(outer, ipaddress.IPv4Network):
        return net.subnet_of(outer)
    if isinstance(net, ipaddress.IPv6Network) and isinstance(outer, ipaddress.IPv6Network):
        return net.subnet_of(outer)
    return False


def _valid_sid(sid: str) -> str:
    if not isinstance(sid, str) or not _SID.match(sid):
        raise NetworkError(f"sandbox id {sid!r}: expected letters, digits, '_', '.', '-' (max 128)")
    return sid


def _parse_counters(version: str, text: str) -> dict[str, Any]:
    """:meth:`NetworkManager.counters` from ``nft -j list table`` of a sandbox's table."""
    out: dict[str, Any] = {"version": version,
                           "accepted": {"packets": 0, "bytes": 0}, "denied": {"packets": 0, "bytes": 0},
                           "ingress_dropped": {"packets": 0, "bytes": 0}, "denied_destinations": [],
                           "rules": {}}
    for item in json.loads(text).get("nftables", []):
        if "counter" in item and item["counter"].get("name") in ("accepted", "denied", "ingress_dropped"):
            c = item["counter"]
            out[c["name"]] = {"packets": c["packets"], "bytes": c["bytes"]}
        elif "set" in item and item["set"]["name"].startswith("denied"):
            for elem in item["set"].get("elem", []):
                val = elem["elem"]["val"]["concat"]
                counter = elem["elem"].get("counter") or {"packets": 0, "bytes": 0}
                out["denied_destinations"].append({
                    "address": val[0], "protocol": val[1], "port": val[2] if len(val) > 2 else None,
                    "packets": counter["packets"], "bytes": counter["bytes"]})
        elif "rule" in item and str(item["rule"].get("comment", "")).startswith("rule:"):
            idx = int(item["rule"]["comment"].split(":")[1])
            counter = next((e["counter"] for e in item["rule"]["expr"]
                            if isinstance(e.get("counter"), dict)), {"packets": 0, "bytes": 0})
            slot = out["rules"].setdefault(idx, {"packets": 0, "bytes": 0})
            slot["packets"] += counter["packets"]
            slot["bytes"] += counter["bytes"]
    out["rules"] = [{"rule": i, **c} for i, c in sorted(out["rules"].items())]
    out["denied_destinations"].sort(key=lambda d: (d["address"], str(d["protocol"]), d["port"] or 0))
    return out


def diff_counters(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """Egress verdicts between two :meth:`NetworkManager.counters` readings (for a receipt)."""
    def delta(key: str) -> dict[str, int]:
        return {k: after[key][k] - before[key][k] for k in ("packets", "bytes")}

    old = {(d["address"], d["protocol"], d["port"]): d for d in before.get("denied_destinations", [])}
    denied = []
    for d in after.get("denied_destinations", []):
        prev = old.get((d["address"], d["protocol"], d["port"]), {"packets": 0, "bytes": 0})
        if d["packets"] > prev["packets"]:
            denied.append({"address": d["address"], "protocol": d["protocol"], "port": d["port"],
                           "packets": d["packets"] - prev["packets"]})
    return {"policy_version": after.get("version"), "accepted": delta("accepted"), "denied": delta("denied"),
            "denied_destinations": denied}
