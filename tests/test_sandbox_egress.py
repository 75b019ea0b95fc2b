"""Egress rules that would open a protected range, as the attack: through the real edge.

A tenant's allow rule must not open what the design protects: the host side of its veth
(its gateway: a host service listening on 0.0.0.0 answers there), other sandboxes, the host's
own addresses and loopback, link-local and cloud metadata, broadcast, and ranges the operator
adds.  Each such rule is refused at create and as a run-time update with a 400 naming the
field, the rule and the range, and nothing changes (no sandbox, no receipt log; the table in
the sandbox's namespace as it was; the host service still unreachable).  A project the
operator allowed (``egress_protected`` in the tokens file) gets the same rule and the traffic
passes; 0.0.0.0/0 and ::/0 reach other destinations and never a protected one.

Traffic goes only to the host over the sandbox's own veth and to the echo namespace this
module makes (tests/support/netns.py); never to 169.254.169.254 or beyond the host.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.edges import REPO, EdgeProcess, http
from support.env import require, unavailable
from support.netns import PORT_A, Server, echo_server, sh, veth_name
from support.sandboxes import REF, ServerThread, assert_clean, no_sandboxes_left, run, serving

from sandbox.core.errors import InvalidField
from sandbox.core.model import parse_rules
from sandbox.edge.auth import AuthConfig
from sandbox.host.manager import SandboxManager
from sandbox.isolation.network import ProtectedDestination

pytestmark = [pytest.mark.usefixtures("need_root"),
              pytest.mark.root("erofs", "overlay", "fuse", "cmd:crun", "cmd:ip", "cmd:nft", "cmd:nsenter")]

PLAIN, TRUSTED = "plain-egress-token-0123456789", "trusted-egress-token-0123456789"
TOKENS = {"projects": {"plain": {"tokens": [PLAIN], "max_sandboxes": 4},
                       "trusted": {"tokens": [TRUSTED], "max_sandboxes": 4, "egress_protected": True}}}
OPERATOR = "198.18.7.0/24"  # the operator's own range (--protect); never routed anywhere here
OPERATOR6 = "2001:db8:77::/48"
ORDINARY = {"cidr": "203.0.113.0/24", "ports": 443}  # TEST-NET-3: an allowed rule, never contacted
N = os.getpid() % 200 + 20
ECHO_PREFIX = f"10.249.{N}"

PROBE = """
import socket, sys
try:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)
    s.sendall(b"hi")
    print("ok", s.recv(64).decode())
except OSError as e:
    print(e.errno)
"""
BROADCAST = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
try:
    s.sendto(b"from the sandbox", ("255.255.255.255", int(sys.argv[1])))
    print("sent")
except OSError as e:
    print(e.errno)
"""
EHOSTUNREACH, EPERM = "113", "1"


# -- fixtures ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def echo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """An ordinary destination (not protected) behind the host: what 0.0.0.0/0 is for."""
    require("cmd:unshare")
    with echo_server(tmp_path_factory.mktemp("echo") / "netns", ECHO_PREFIX, veth_name("te")) as srv:
        yield srv


@pytest.fixture(scope="module")
def guarded(echo: Server, store_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SandboxManager]:
    """A manager whose operator protects OPERATOR and OPERATOR6 too (made after the echo namespace,
    so the host side of its veth is among the host's addresses)."""
    mgr = SandboxManager(tmp_path_factory.mktemp("egress-host"), store_url, protected=[OPERATOR, OPERATOR6])
    try:
        yield mgr
    finally:
        mgr.close()
        assert_clean(mgr)


@pytest.fixture(scope="module")
def edge(guarded: SandboxManager) -> Iterator[ServerThread]:
    with serving(guarded, TOKENS) as srv:
        yield srv


@pytest.fixture
def url(edge: ServerThread, guarded: SandboxManager) -> Iterator[str]:
    with no_sandboxes_left(guarded):
        yield edge.url


@pytest.fixture
def create(url: str, guarded: SandboxManager) -> Iterator[Callable[..., dict[str, Any]]]:
    """POST /v1/sandboxes as a project: the sandbox's view; each destroyed when the test ends."""
    made: list[str] = []

    def make(token: str, **fields: Any) -> dict[str, Any]:
        status, _, info = http("POST", f"{url}/v1/sandboxes", {"image": REF, **fields}, token=token)
        assert status == 201, info
        made.append(info["id"])
        return dict(info)

    yield make
    for sid in made:
        guarded.destroy(sid)


@contextlib.contextmanager
def host_service() -> Iterator[tuple[int, int, list[str], list[str]]]:
    """A TCP and a UDP service of the host on 0.0.0.0, as a real one listens: (tcp port, udp port,
    peers that connected, peers that sent a datagram)."""
    tcp = socket.socket()
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tcp.bind(("0.0.0.0", 0))
    udp.bind(("0.0.0.0", 0))
    tcp.listen(8)
    tcp.settimeout(0.2)
    udp.settimeout(0.2)
    connected: list[str] = []
    received: list[str] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                conn, peer = tcp.accept()
                connected.append(peer[0])
                with conn:
                    conn.sendall(b"host-secret")
            with contextlib.suppress(TimeoutError):
                received.append(udp.recvfrom(64)[1][0])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield tcp.getsockname()[1], udp.getsockname()[1], connected, received
    finally:
        stop.set()
        thread.join(5)
        tcp.close()
        udp.close()


def attacks(mgr: SandboxManager, gateway: str, port: int) -> dict[str, tuple[dict[str, Any], str]]:
    """Each protected rule with the range its refusal must name."""
    host = ipaddress.ip_address(mgr.net.host_addresses[0])
    subnet = str(mgr.net.subnet)
    return {
        "gateway": ({"cidr": f"{gateway}/32", "ports": port, "protocol": "tcp"}, subnet),
        "metadata": ({"cidr": "169.254.169.254/32", "ports": 80}, "169.254.0.0/16"),
        "metadata6": ({"cidr": "fd00:ec2::254/128", "ports": 80}, "fd00:ec2::254/128"),
        "host address": ({"cidr": f"{host}/{host.max_prefixlen}"}, f"{host}/{host.max_prefixlen}"),
        "subnet": ({"cidr": subnet, "protocol": "any"}, subnet),
        "a /8 covering the subnet": ({"cidr": "10.0.0.0/8"}, subnet),
        "half the internet": ({"cidr": "128.0.0.0/1"}, "169.254.0.0/16"),
        "loopback": ({"cidr": "127.0.0.1/32"}, "127.0.0.0/8"),
        "loopback6": ({"cidr": "::1/128"}, "::1/128"),
        "link-local6": ({"cidr": "fe80::1/128", "protocol": "udp"}, "fe80::/10"),
        "broadcast": ({"cidr": "255.255.255.255/32", "protocol": "udp"}, "255.255.255.255/32"),
        "localhost by name": ({"host": "localhost", "ports": 80}, "127.0.0.0/8"),
        "operator": ({"cidr": "198.18.7.9/32"}, OPERATOR),
        "operator6": ({"cidr": "2001:db8::/32"}, OPERATOR6),
    }


ATTACKS = ["gateway", "metadata", "metadata6", "host address", "subnet", "a /8 covering the subnet",
           "half the internet", "loopback", "loopback6", "link-local6", "broadcast", "localhost by name",
           "operator", "operator6"]


def refused(answer: tuple[int, dict[str, str], Any], index: int, rule: dict[str, Any], protected: str) -> None:
    """A 400 naming the field, the rule (as the model writes it) and the protected range."""
    status, _, body = answer
    assert status == 400, body
    error = body["error"]
    assert (error["code"], error["field"]) == ("invalid_field", "network"), error
    shown = parse_rules([rule])[0].to_dict()
    assert f"rule {index} {json.dumps(shown)}: " in error["message"], error["message"]
    assert f"the protected range {protected} (" in error["message"], error["message"]
    if "host" in rule:
        assert f"host {rule['host']!r} resolves to " in error["message"], error["message"]


def ruleset(mgr: SandboxManager, sid: str) -> str:
    """The sandbox's table as the kernel has it (no counters), read inside its namespace."""
    return sh("nsenter", f"--net={mgr.net.netns_path(sid)}", "nft", "-s", "list", "table", "inet", "layerbox")




def probe(mgr: SandboxManager, sid: str, addr: str, port: int) -> str:
    """What a program in the sandbox gets connecting to addr:port: "ok <greeting>" or the errno."""
    return mgr.get(sid).exec(["python3", "-c", PROBE, addr, str(port)], timeout=30).stdout.decode().strip()


def host_state(mgr: SandboxManager) -> list[str]:
    """What a create leaves on the host: sandboxes, their directories, namespaces, receipt logs."""
    found = [f"sandbox {st.id}" for st in mgr.list()]
    for where in (mgr.boxes, mgr.data_dir / "net" / "netns", mgr.receipts_dir):
        if where.is_dir():
            found += [str(where / name) for name in os.listdir(where)]
    return sorted(found)


# -- the attack at create -----------------------------------------------------------------------------
@pytest.mark.parametrize("attack", ATTACKS)
def test_a_protected_rule_is_refused_at_create(url: str, guarded: SandboxManager, attack: str) -> None:
    # the first sandbox's gateway: the first /30 of the subnet, host side
    gateway = str(guarded.net.subnet.network_address + 1)
    rule, protected = attacks(guarded, gateway, 18999)[attack]
    before = host_state(guarded)
    refused(http("POST", f"{url}/v1/sandboxes", {"image": REF, "network": [ORDINARY, rule]}, token=PLAIN),
            1, rule, protected)
    assert host_state(guarded) == before  # no sandbox, directory, namespace or receipt log


def test_a_refused_create_through_the_library_leaves_nothing(guarded: SandboxManager) -> None:
    """The manager refuses before it writes a state (the network step would refuse too)."""
    before = host_state(guarded)
    with pytest.raises(ProtectedDestination, match="resolves to 127.0.0.1"):
        run(guarded.create(REF, network=[{"host": "localhost"}]))
    with acquiring(guarded) as acquire, pytest.raises(
            ProtectedDestination, match="lies in the protected range 169.254.0.0/16"):
        acquire([{"cidr": "169.254.169.254/32"}])
    assert host_state(guarded) == before


@contextlib.contextmanager
def acquiring(mgr: SandboxManager) -> Iterator[Callable[..., Any]]:
    """The network step's acquire for a sandbox id of the test's, released whatever it made."""
    sid = "lb-0e9e55000000"
    try:
        yield lambda rules, **kw: mgr.resources.networks.acquire(sid, parse_rules(rules), **kw)
    finally:
        mgr.resources.networks.release(sid)


# -- the attack at run time, with traffic ---------------------------------------------------------------
def test_a_protected_rule_is_refused_at_run_time_and_the_host_stays_unreachable(
        url: str, guarded: SandboxManager, create: Any) -> None:
    sid = create(PLAIN, network=[ORDINARY])["id"]
    box = guarded.get(sid)
    gateway = box.state.network["host_address"]
    with host_service() as (tcp_port, _, connected, _):
        assert probe(guarded, sid, gateway, tcp_port) == EHOSTUNREACH
        table, policy = ruleset(guarded, sid), box.state.network["policy"]
        receipts = len(box.receipts())
        every = attacks(guarded, gateway, tcp_port)
        assert list(every) == ATTACKS  # the same attacks as at create
        for attack, (rule, protected) in every.items():
            answer = http("PUT", f"{url}/v1/sandboxes/{sid}/network", {"rules": [ORDINARY, rule]}, token=PLAIN)
            refused(answer, 1, rule, protected)
            assert ruleset(guarded, sid) == table, attack
        assert box.state.network["policy"] == policy
        assert box.state.options.network == parse_rules([ORDINARY])
        assert len(box.receipts()) == receipts  # no "network" receipt: nothing was set
        # the attack the rule was for: the host's service on the gateway is still out of reach
        assert probe(guarded, sid, gateway, tcp_port) == EHOSTUNREACH
        assert connected == []


def test_an_allowed_project_opens_what_it_names(url: str, guarded: SandboxManager, create: Any) -> None:
    allowed = create(TRUSTED, network=[{"cidr": "169.254.169.254/32", "ports": 80},
                                       {"cidr": "10.0.0.0/8", "protocol": "any"}])
    sid = allowed["id"]
    assert allowed["labels"]["layerbox.egress.protected"] == "true"  # the edge's, from the tokens file
    gateway = allowed["network"]["host_address"]
    table = ruleset(guarded, sid)
    # a rule inside a protected range opens it alone; one containing a protected range opens all of it
    assert _chain(table, "allow") == ["ip daddr 10.0.0.0/8"]
    assert _chain(table, "allow_protected") == ["ip daddr 169.254.169.254 tcp dport 80", "ip daddr 10.0.0.0/8"]
    with host_service() as (tcp_port, _, connected, _):
        # the catch-all never reaches a protected range, even for a project allowed them
        status, _, body = http("PUT", f"{url}/v1/sandboxes/{sid}/network",
                               {"rules": [{"cidr": "0.0.0.0/0", "protocol": "any"}]}, token=TRUSTED)
        assert status == 200, body
        assert probe(guarded, sid, gateway, tcp_port) == EHOSTUNREACH
        # the very rule a plain project is refused
        rule = {"cidr": f"{gateway}/32", "ports": tcp_port, "protocol": "tcp"}
        status, _, body = http("PUT", f"{url}/v1/sandboxes/{sid}/network", {"rules": [rule]}, token=TRUSTED)
        assert status == 200, body
        assert probe(guarded, sid, gateway, tcp_port) == "ok host-secret"
        assert connected == [allowed["network"]["address"]]


def test_broad_rules_reach_the_world_and_never_a_protected_range(
        url: str, guarded: SandboxManager, echo: Server, create: Any) -> None:
    broad = [{"cidr": "0.0.0.0/0", "protocol": "any"}, {"cidr": "::/0", "protocol": "any"}]
    info = create(PLAIN, network=broad)
    sid, gateway = info["id"], info["network"]["host_address"]
    other = create(PLAIN, network=[])
    table = ruleset(guarded, sid)
    assert _chain(table, "allow") == ["ip daddr 0.0.0.0/0", "ip6 daddr ::/0"]
    assert _chain(table, "allow_protected") == []
    with host_service() as (tcp_port, udp_port, connected, received):
        assert probe(guarded, sid, echo.addr, PORT_A) == "ok hi"
        assert probe(guarded, sid, gateway, tcp_port) == EHOSTUNREACH
        assert probe(guarded, sid, other["network"]["address"], 22) == EHOSTUNREACH
        # a limited broadcast is delivered to the host's own UDP services: protected too
        sent = guarded.get(sid).exec(["python3", "-c", BROADCAST, str(udp_port)], timeout=30)
        assert sent.stdout.decode().strip() == EPERM
        assert connected == received == []
    denied = {d["address"] for d in guarded.net.counters(sid)["denied_destinations"]}
    assert {gateway, other["network"]["address"], "255.255.255.255"} <= denied


def _chain(table: str, name: str) -> list[str]:
    """The matches of a chain's rules in an `nft -s list table` text, in order."""
    lines = table.split(f"chain {name} {{\n", 1)[1].split("}", 1)[0].strip().splitlines()
    return [line.strip().split(" counter ", 1)[0] for line in lines]


# -- a VM -------------------------------------------------------------------------------------------------
@pytest.mark.root("cmd:qemu-system-x86_64")
def test_a_microvm_refuses_a_protected_rule_at_create(url: str, guarded: SandboxManager) -> None:
    capabilities = guarded.backend("microvm").capabilities("microvm")
    if not capabilities.available:
        unavailable(capabilities.reason or "no microvm here")  # skips, or fails under CI
    vm = {"isolation": "microvm", "memory": 384 << 20, "disk": 256 << 20}
    gateway = str(guarded.net.subnet.network_address + 1)
    before = host_state(guarded)
    for attack in ("gateway", "metadata", "a /8 covering the subnet"):
        rule, protected = attacks(guarded, gateway, 18999)[attack]
        refused(http("POST", f"{url}/v1/sandboxes", {"image": REF, "network": [ORDINARY, rule], **vm},
                     token=PLAIN), 1, rule, protected)
    # the VM's network step refuses on its own (a tap, a forward chain: the same check)
    with acquiring(guarded) as acquire, pytest.raises(
            ProtectedDestination, match=f"contains the protected range {guarded.net.subnet}"):
        acquire([{"cidr": "10.0.0.0/8"}], vm=True)
    assert host_state(guarded) == before
    # no VMM of this manager ever started (its command line names the data dir)
    assert subprocess.run(["pgrep", "-f", f"qemu-system.*{guarded.data_dir}"]).returncode == 1


# -- the operator's side ---------------------------------------------------------------------------------
def test_the_tokens_file_allowance_is_a_boolean() -> None:
    projects = {"p": {"tokens": ["p" * 16]}, "q": {"tokens": ["q" * 16], "egress_protected": True}}
    auth = AuthConfig.from_dict({"projects": projects})
    assert [auth.tokens[t].egress_protected for t in ("p" * 16, "q" * 16)] == [False, True]
    for key, value in (("egress_protected", "yes"), ("egress_protected", 1), ("admin", "false"),
                       ("disabled", "no")):
        with pytest.raises(InvalidField) as err:  # noqa: PT011  (the field is checked)
            AuthConfig.from_dict({"projects": {"p": {"tokens": ["p" * 16], key: value}}})
        assert err.value.field == f"projects.p.{key}"


def test_a_real_edge_protects_the_operators_ranges(store_url: str, tmp_path: Path) -> None:
    """``python -m sandbox.edge --protect CIDR`` and ``egress_protected`` in its tokens file."""
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    bad = subprocess.run([sys.executable, "-m", "sandbox.edge", "--data-dir", str(tmp_path / "x"), "--store",
                          store_url, "--tokens", str(tokens), "--protect", "198.18.7.1/24"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert "--protect" in bad.stderr
    edge = EdgeProcess("protecting", tmp_path, store_url, tokens, "--protect", OPERATOR, "--protect", OPERATOR6,
                       token=PLAIN)
    try:
        edge.start()
        for rule, protected in (({"cidr": "198.18.7.9/32"}, OPERATOR), ({"cidr": "2001:db8:77::1/128"}, OPERATOR6),
                                ({"cidr": "169.254.169.254/32"}, "169.254.0.0/16")):
            refused(edge.http("POST", "/v1/sandboxes", {"image": REF, "network": [ORDINARY, rule]}), 1, rule,
                    protected)
        status, _, info = http("POST", f"{edge.url}/v1/sandboxes",
                               {"image": REF, "network": [{"cidr": "198.18.7.9/32"}]}, token=TRUSTED)
        assert status == 201, info
        assert info["network"]["policy"]["rules"][0]["addresses"] == ["198.18.7.9/32"]
        assert http("DELETE", f"{edge.url}/v1/sandboxes/{info['id']}", token=TRUSTED)[0] in (200, 204)
    finally:
        edge.stop()
        assert edge.clean_up() == []
