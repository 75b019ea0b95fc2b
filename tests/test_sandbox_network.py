"""Per-sandbox network namespaces and egress policy, against the real kernel and nftables.

Topology (all made here, all removed in teardown)::

    sandbox netns (eth0 10.251.N.x) ── veth ── host ── veth ── server netns (10.250.N.2)
                                                                TCP echo on PORT_A, PORT_B
                                                                UDP echo on PORT_U

"Inside the sandbox" means a socket created by a thread that has setns'd into
the sandbox's netns (a socket keeps its namespace), or a process started with
``nsenter --net``; crun is not needed for the policy itself.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from support.env import require
from support.netns import PORT_A, PORT_B, PORT_U, Server, echo_server, sh, veth_name

from sandbox.backends.container.spec import CAPABILITIES
from sandbox.core.errors import SandboxNotFound
from sandbox.core.model import EgressRule, InvalidEgressRule
from sandbox.isolation.network import (
    NetworkConflict,
    NetworkManager,
    ProtectedDestination,
    diff_counters,
)

pytestmark = [pytest.mark.usefixtures("need_root"), pytest.mark.root("cmd:ip", "cmd:nft", "cmd:nsenter")]

N = os.getpid() % 200 + 20  # keeps two concurrent runs of this file apart
SERVER_SUBNET = f"10.250.{N}"
SANDBOX_SUBNET = f"10.251.{N}.0/24"
T = TypeVar("T")

_libc = ctypes.CDLL(None, use_errno=True)


def in_netns(path: str, fn: Callable[[], T]) -> T:
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                assert _libc.setns(fd, 0x40000000) == 0, os.strerror(ctypes.get_errno())
            finally:
                os.close(fd)
            box["v"] = fn()
        except BaseException as exc:
            box["e"] = exc

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "e" in box:
        raise box["e"]
    return box["v"]  # type: ignore[no-any-return]


def connect(ns: str, addr: str, port: int) -> socket.socket:
    return in_netns(ns, lambda: socket.create_connection((addr, port), timeout=1))


def tcp_echo(ns: str, addr: str, port: int) -> str:
    """'ok' when the echo came back, else the name of the error the program saw."""
    try:
        with connect(ns, addr, port) as s:
            s.sendall(b"ping")
            return "ok" if s.recv(4) == b"ping" else "bad echo"
    except OSError as exc:
        return type(exc).__name__ if not isinstance(exc, socket.timeout) else "timeout"


def udp_echo(ns: str, addr: str, port: int) -> str:
    s = in_netns(ns, lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
    with s:
        s.settimeout(1)
        try:
            s.sendto(b"ping", (addr, port))
            return "ok" if s.recvfrom(16)[0] == b"ping" else "bad echo"
        except OSError as exc:
            return type(exc).__name__ if not isinstance(exc, socket.timeout) else "timeout"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    require("root")
    require("cmd:unshare")
    with echo_server(tmp_path_factory.mktemp("srv") / "netns", SERVER_SUBNET, veth_name("ts")) as srv:
        yield srv


@pytest.fixture(scope="module")
def net(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetworkManager]:
    mgr = NetworkManager(tmp_path_factory.mktemp("net"), subnet=SANDBOX_SUBNET)
    try:
        yield mgr
    finally:
        for sid in mgr.list():
            mgr.destroy(sid)
    assert mgr.list() == []
    assert not [i for i in os.listdir("/sys/class/net") if i.startswith(mgr.if_prefix)]


@pytest.fixture
def boxes(net: NetworkManager) -> Iterator[Callable[..., Any]]:
    made: list[str] = []

    def make(sid: str, rules: Any = ()) -> Any:
        made.append(sid)
        return net.create(sid, rules)

    yield make
    for sid in made:
        net.destroy(sid)


def allow(server: Server, ports: str | None = None, protocol: str = "tcp") -> dict[str, Any]:
    rule: dict[str, Any] = {"cidr": f"{server.addr}/32", "protocol": protocol}
    if ports:
        rule["ports"] = ports
    return rule


# -- tests ----------------------------------------------------------------------------------------

def test_default_deny_loopback_and_counters(boxes: Any, net: NetworkManager, server: Server) -> None:
    info = boxes("deny")
    links = {line.split()[0].split("@")[0]: line.split()[1:] for line in
             sh("nsenter", f"--net={info.path}", "ip", "-br", "-4", "addr").splitlines()}
    assert links == {"lo": ["UNKNOWN", "127.0.0.1/8"], "eth0": ["UP", f"{info.address}/30"]}
    before = net.counters("deny")
    # denied connections fail at once with an error, not after SYN retries
    assert tcp_echo(info.path, server.addr, PORT_A) == "OSError"  # EHOSTUNREACH (admin-prohibited)
    assert udp_echo(info.path, server.addr, PORT_U) in ("PermissionError", "OSError", "timeout")

    def loopback() -> bytes:
        with socket.socket() as srv:
            srv.bind(("127.0.0.1", 0))
            srv.listen()
            with socket.create_connection(srv.getsockname(), timeout=1) as c:
                conn, _ = srv.accept()
                with conn:
                    c.sendall(b"lo")
                    return conn.recv(2)

    assert in_netns(info.path, loopback) == b"lo"
    after = net.counters("deny")
    verdicts = diff_counters(before, after)
    assert verdicts["accepted"]["packets"] == 0
    assert verdicts["denied"]["packets"] >= 2
    seen = {(d["address"], d["protocol"], d["port"]) for d in verdicts["denied_destinations"]}
    assert {(server.addr, "tcp", PORT_A), (server.addr, "udp", PORT_U)} <= seen
    assert after["version"] == net.policy("deny")["version"]


def test_counter_readings_match_the_kernel_and_follow_a_policy_set_again(boxes: Any, net: NetworkManager,
                                                                         server: Server) -> None:
    """counters() answers a quiet sandbox from its last full reading: every reading must still be
    what `nft -j list table` says, after traffic, and after the same rules are set again (which
    resets the per-rule counters but not the named ones)."""
    info = boxes("cheap", [allow(server, str(PORT_A))])

    def kernel() -> tuple[int, list[int], int]:
        doc = json.loads(sh("nsenter", f"--net={info.path}", "nft", "-j", "list", "table", "inet", "layerbox"))
        items = doc["nftables"]
        accepted = next(i["counter"]["packets"] for i in items if i.get("counter", {}).get("name") == "accepted")
        rules = [next(e["counter"]["packets"] for e in i["rule"]["expr"] if isinstance(e.get("counter"), dict))
                 for i in items if str(i.get("rule", {}).get("comment", "")).startswith("rule:")]
        denied = sum(e["elem"]["counter"]["packets"] for i in items if i.get("set", {}).get("name", "") == "denied4"
                     for e in i["set"].get("elem", []))
        return accepted, rules, denied

    def ours() -> tuple[int, list[int], int]:
        c = net.counters("cheap")
        return (c["accepted"]["packets"], [r["packets"] for r in c["rules"]],
                sum(d["packets"] for d in c["denied_destinations"] if "." in d["address"]))

    assert ours() == kernel() == ours()  # a first (full) reading, then a remembered one
    assert tcp_echo(info.path, server.addr, PORT_A) == "ok"
    assert tcp_echo(info.path, server.addr, PORT_B) == "OSError"
    after = ours()
    assert after == kernel()
    assert (after[0] > 0, after[1][0] > 0, after[2] > 0) == (True, True, True)
    net.set_policy("cheap", [allow(server, str(PORT_A))])  # the same rules: the same version
    again = ours()
    assert again == kernel()
    assert (again[1], again[0]) == ([0], after[0])


def test_allow_port_range_udp_and_runtime_changes(boxes: Any, net: NetworkManager, server: Server) -> None:
    info = boxes("live", [allow(server, str(PORT_A))])
    assert tcp_echo(info.path, server.addr, PORT_A) == "ok"
    assert tcp_echo(info.path, server.addr, PORT_B) == "OSError"
    assert udp_echo(info.path, server.addr, PORT_U) != "ok"

    ranged = net.set_policy("live", [allow(server, f"{PORT_A}-{PORT_B}"), allow(server, str(PORT_U), "udp")])
    assert ranged["rules"][0]["ports"] == f"{PORT_A}-{PORT_B}"
    assert tcp_echo(info.path, server.addr, PORT_B) == "ok"
    assert udp_echo(info.path, server.addr, PORT_U) == "ok"
    counters = net.counters("live")
    assert counters["accepted"]["packets"] > 0
    assert [r["packets"] > 0 for r in counters["rules"]] == [True, True]

    # a live connection to a destination the new policy removes is reset, not left open
    live = connect(info.path, server.addr, PORT_A)
    with live:
        live.sendall(b"one")
        assert live.recv(3) == b"one"
        denied = net.set_policy("live", [])
        assert denied["version"] != ranged["version"]
        live.settimeout(2)
        live.sendall(b"two")
        with pytest.raises(ConnectionResetError):
            live.recv(3)
    assert tcp_echo(info.path, server.addr, PORT_A) == "OSError"
    assert udp_echo(info.path, server.addr, PORT_U) != "ok"

    again = net.set_policy("live", [EgressRule(f"{server.addr}/32", (PORT_A, PORT_A))])
    assert again["version"] == net.policy("live")["version"]
    assert tcp_echo(info.path, server.addr, PORT_A) == "ok"
    assert tcp_echo(info.path, server.addr, PORT_B) == "OSError"


def test_host_and_other_sandboxes_are_protected(boxes: Any, net: NetworkManager, server: Server) -> None:
    info = boxes("prot", [{"cidr": "0.0.0.0/0", "protocol": "any"}])
    other = boxes("other")
    assert tcp_echo(info.path, server.addr, PORT_B) == "ok"  # the broad rule opens the world...
    # ...but not the host side of the veth, other sandboxes or link-local
    for addr in (info.host_address, other.address, "169.254.169.254"):
        assert tcp_echo(info.path, addr, 9) == "OSError", addr
    denied = {d["address"] for d in net.counters("prot")["denied_destinations"]}
    assert {info.host_address, other.address, "169.254.169.254"} <= denied

    # a service on the host's loopback is not the sandbox's loopback
    with socket.socket() as host_srv:
        host_srv.bind(("127.0.0.1", 0))
        host_srv.listen()
        host_srv.setblocking(False)
        assert tcp_echo(info.path, "127.0.0.1", host_srv.getsockname()[1]) == "ConnectionRefusedError"
        with pytest.raises(BlockingIOError):
            host_srv.accept()

    # a rule naming a protected address is refused, and opens it only where the operator allows:
    # then the host answers itself (RST, nothing listens)
    with pytest.raises(ProtectedDestination, match=f"{info.host_address}/32 lies in the protected range"):
        net.set_policy("prot", [{"cidr": info.host_address, "ports": "9"}])
    net.set_policy("prot", [{"cidr": info.host_address, "ports": "9"}], allow_protected=True)
    assert tcp_echo(info.path, info.host_address, 9) == "ConnectionRefusedError"


def test_sandbox_cannot_change_its_rules(boxes: Any, net: NetworkManager, server: Server) -> None:
    require("cmd:setpriv")
    info = boxes("caps")
    bounding = ",".join(["-all"] + ["+" + c.removeprefix("CAP_").lower() for c in CAPABILITIES])
    proc = subprocess.run(["nsenter", f"--net={info.path}", "setpriv", f"--bounding-set={bounding}",
                           "nft", "flush", "ruleset"], capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0
    assert "Operation not permitted" in proc.stderr
    assert tcp_echo(info.path, server.addr, PORT_A) == "OSError"
    assert net.counters("caps")["denied"]["packets"] >= 1


@pytest.mark.parametrize(("rule", "fragment"), [
    ({"cidr": "10.0.0.0/33"}, "10.0.0.0/33"),
    ({"cidr": "10.0.0.1/8"}, "host bits"),
    ({"cidr": "example"}, "example"),
    ({"cidr": "10.0.0.0/8", "ports": "0"}, "1-65535"),
    ({"cidr": "10.0.0.0/8", "ports": "70000"}, "1-65535"),
    ({"cidr": "10.0.0.0/8", "ports": "90-80"}, "low-high"),
    ({"cidr": "10.0.0.0/8", "ports": "http"}, "'8000-8100'"),
    ({"cidr": "10.0.0.0/8", "ports": [80, 443]}, "one rule per port"),
    ({"cidr": "10.0.0.0/8", "ports": True}, "not a port"),
    ({"cidr": "10.0.0.0/8", "protocol": "sctp"}, "tcp, udp, icmp, any"),
    ({"cidr": "10.0.0.0/8", "protocol": "icmp", "ports": "1"}, "only apply to tcp or udp"),
    ({"cidr": "10.0.0.0/8", "host": "localhost"}, "exactly one"),
    ({}, "exactly one"),
    ({"host": "bad host!"}, "not a host name"),
    ({"cidr": "10.0.0.0/8", "colour": "red"}, "unknown keys ['colour']"),
    ("10.0.0.0/8", "expected a mapping"),
])
def test_bad_rules_are_rejected(boxes: Any, net: NetworkManager, rule: Any, fragment: str) -> None:
    with pytest.raises(InvalidEgressRule) as err:  # noqa: PT011  (message checked below)
        EgressRule.parse(rule)
    assert fragment in str(err.value)


def test_bad_rule_leaves_policy_unchanged_and_host_rules_resolve(
        boxes: Any, net: NetworkManager, server: Server) -> None:
    boxes("names", [allow(server, str(PORT_A))])
    version = net.policy("names")["version"]
    with pytest.raises(InvalidEgressRule, match="ports"):
        net.set_policy("names", [allow(server, str(PORT_B)), {"cidr": "10.0.0.0/8", "ports": "99999"}])
    assert net.policy("names")["version"] == version
    with pytest.raises(SandboxNotFound, match="nosuch"):
        net.set_policy("nosuch", [])

    # a name is checked on what it resolves to: localhost is the host's loopback
    with pytest.raises(ProtectedDestination, match="host 'localhost' resolves to (127.0.0.1|::1), in"):
        net.set_policy("names", [{"host": "localhost", "ports": [8080]}])
    assert net.policy("names")["version"] == version
    policy = net.set_policy("names", [{"host": "localhost", "ports": [8080]}], allow_protected=True)
    rule = policy["rules"][0]
    assert rule["host"] == "localhost"
    assert "cidr" not in rule
    assert "127.0.0.1/32" in rule["addresses"]
    assert set(rule["addresses"]) <= {"127.0.0.1/32", "::1/128"}
    listed = sh("nsenter", f"--net={net.netns_path('names')}", "nft", "list", "chain", "inet", "layerbox",
                "allow_protected")
    assert "ip daddr 127.0.0.1 tcp dport 8080" in listed


def test_destroy_and_reconcile_after_crash(net: NetworkManager, server: Server) -> None:
    info = net.create("crashy", [allow(server, str(PORT_A))])
    try:
        # a second manager on another data dir must not hand out the same addresses
        with pytest.raises(NetworkConflict, match=str(net.subnet)):
            NetworkManager(net.state_dir.parent / "elsewhere", subnet=SANDBOX_SUBNET)

        fresh = NetworkManager(net.state_dir, subnet=SANDBOX_SUBNET)  # the manager restarted
        assert "crashy" in fresh.list()
        assert fresh.info("crashy") == info
        assert tcp_echo(info.path, server.addr, PORT_A) == "ok"
        fresh.destroy("crashy")
        fresh.destroy("crashy")  # idempotent
    finally:
        net.destroy("crashy")
    assert "crashy" not in net.list()
    assert not Path(info.path).exists()
    assert not Path("/sys/class/net", info.host_if).exists()
    assert info.path not in Path("/proc/self/mountinfo").read_text()
    assert "crashy" not in json.loads((net.state_dir / "net.json").read_text())["sandboxes"]
    with pytest.raises(SandboxNotFound):
        net.counters("crashy")
    again = net.create("crashy")  # the address block is free again
    try:
        assert again.address == info.address
    finally:
        net.destroy("crashy")


def test_crun_container_joins_the_policed_netns(boxes: Any, net: NetworkManager, server: Server,
                                                 tmp_path: Path) -> None:
    """End to end: crun joins the namespace via spec.build_spec(netns_path=...), with the spec's caps."""
    require("cmd:crun")
    from sandbox.backends.container.runtime import OciRuntime
    from sandbox.backends.container.spec import OciLimits, build_process, build_spec
    from sandbox.isolation.cgroups import preflight_cgroups

    layout = preflight_cgroups()
    info = boxes("crun", [allow(server, str(PORT_A))])
    # host /usr read-only is the whole image: enough for python3 and nft
    root = tmp_path / "rootfs"
    for name in ("usr", "proc", "dev", "sys", "tmp", "etc"):
        (root / name).mkdir(parents=True)
    for name in ("bin", "sbin", "lib", "lib64"):
        if os.path.islink(f"/{name}"):
            (root / name).symlink_to(os.readlink(f"/{name}"))
    probe = (f"import socket\nfor port in ({PORT_A}, {PORT_B}):\n    try:\n"
             f"        s = socket.create_connection(('{server.addr}', port), timeout=1); s.sendall(b'hi')\n"
             f"        print(port, s.recv(2).decode())\n    except OSError as e:\n        print(port, e.errno)\n")
    script = f"python3 -c \"{probe}\"; nft flush ruleset 2>&1 | grep -c 'Operation not permitted'"
    process = build_process(["/bin/sh", "-c", script], env={"PATH": "/usr/sbin:/usr/bin"}, cwd="/", uid=0, gid=0)
    cgroups_path = f"/lbnet-test-{os.getpid()}"
    spec = build_spec(str(root), process, hostname="crun", cgroups_path=cgroups_path, limits=OciLimits(),
                      cgroup_version=layout.version, netns_path=info.path)
    assert {"type": "network", "path": info.path} in spec["linux"]["namespaces"]
    spec["root"]["readonly"] = True
    spec["mounts"].append({"destination": "/usr", "type": "bind", "source": "/usr",
                           "options": ["rbind", "ro", "nosuid", "nodev"]})
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps(spec))
    runtime = OciRuntime(tmp_path / "crun")
    try:
        out = subprocess.run(runtime.argv("run", "--bundle", str(bundle), "lbnet-crun"), capture_output=True,
                             text=True, timeout=60)
    finally:
        subprocess.run(runtime.argv("delete", "--force", "lbnet-crun"), capture_output=True, timeout=30)
    assert out.stdout.split("\n") == [f"{PORT_A} hi", f"{PORT_B} 113", "1", ""], out.stderr
    assert (server.addr, "tcp", PORT_B) in {(d["address"], d["protocol"], d["port"])
                                             for d in net.counters("crun")["denied_destinations"]}
    assert runtime.list() == []
    assert not [d for d in layout.dirs(cgroups_path) if d.exists()]


def test_manager_sandbox_with_egress_rules_changed_at_runtime(
        server: Server, manager: Any, store_url: str) -> None:
    """Through SandboxManager: a policed sandbox on the fixture image, receipts with egress verdicts."""
    from support.sandboxes import REF, run

    probe = (f"import socket\nfor port in ({PORT_A}, {PORT_B}):\n    try:\n"
             f"        s = socket.create_connection(('{server.addr}', port), timeout=2); s.sendall(b'hi')\n"
             f"        print(port, s.recv(2).decode())\n    except OSError as e:\n        print(port, e.errno)\n")
    box = run(manager.create(REF, network=[allow(server, str(PORT_A))]))
    try:
        netns = box.state.network["path"]
        assert Path(netns).exists()
        first = box.exec(["python3", "-c", probe])
        assert first.stdout.decode().split("\n") == [f"{PORT_A} hi", f"{PORT_B} 113", ""]
        receipt = [r for r in box.receipts() if r["action"] == "exec"][-1]
        assert receipt["egress"]["denied"]["packets"] >= 1
        assert receipt["egress"]["accepted"]["packets"] >= 1
        assert (server.addr, PORT_B) in {(d["address"], d["port"]) for d in receipt["egress"]["denied_destinations"]}
        # a keyed command's receipt keeps its verdicts and resources too (it used to drop both)
        box.exec(["python3", "-c", probe], idempotency_key="probe-1")
        keyed = [r for r in box.receipts() if r.get("idempotency_key") == "probe-1" and r["action"] == "exec"][-1]
        assert keyed["egress"]["denied"]["packets"] >= 1
        assert keyed["resources"]["cpu_seconds"] is not None
        assert base64.b64decode(keyed["stdout"]).decode().startswith(f"{PORT_A} hi")
        policy = box.set_network([allow(server, f"{PORT_A}-{PORT_B}")])
        assert box.state.network["policy"]["version"] == policy["version"]
        second = box.exec(["python3", "-c", probe])
        assert second.stdout.decode().split("\n") == [f"{PORT_A} hi", f"{PORT_B} hi", ""]
        assert box.exec("python3 -c \"import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); s.listen();"
                        " c=socket.create_connection(s.getsockname()); print('lo ok')\"").stdout == b"lo ok\n"
        assert "network" in [r["action"] for r in box.receipts()]
        plain = run(manager.create(REF))  # no network: loopback only, and no policy to change
        try:
            with pytest.raises(Exception, match="without a network"):
                plain.set_network([allow(server)])
        finally:
            plain.destroy()
    finally:
        box.destroy()
    assert not Path(netns).exists()
    assert manager.net.list() == []


def test_microvm_egress_goes_through_the_same_policy(server: Server, manager: Any) -> None:
    """A microVM's NIC is a tap in the sandbox's namespace: its packets are routed out through the
    same allow/deny chains as a container's (forwarded, not output), changed at runtime the same
    way; a microVM without a network has a NIC on a link that leads nowhere."""
    from support.sandboxes import REF, run

    from sandbox.core.model import SandboxOptions

    probe = (f"import socket\nfor port in ({PORT_A}, {PORT_B}):\n    try:\n"
             f"        s = socket.create_connection(('{server.addr}', port), timeout=3); s.sendall(b'hi')\n"
             f"        print(port, s.recv(2).decode())\n    except OSError as e:\n        print(port, e.errno)\n")
    vm = SandboxOptions(isolation="microvm", memory=384 << 20, disk=256 << 20)
    box = run(manager.create(REF, vm.replace(network=(allow(server, str(PORT_A)),))))
    try:
        first = box.exec(["python3", "-c", probe], timeout=60)
        assert first.stdout.decode().split("\n") == [f"{PORT_A} hi", f"{PORT_B} 113", ""]
        receipt = [r for r in box.receipts() if r["action"] == "exec"][-1]
        assert receipt["egress"]["accepted"]["packets"] >= 1
        assert (server.addr, PORT_B) in {(d["address"], d["port"]) for d in receipt["egress"]["denied_destinations"]}
        # the host side of its veth and the metadata address are protected for VMs too
        host = box.state.network["host_address"]
        blocked = box.exec(["python3", "-c", f"import socket\nfor a in ('{host}', '169.254.169.254'):\n    try:\n"
                            "        socket.create_connection((a, 80), timeout=3)\n    except OSError as e:\n"
                            "        print(e.errno)\n"], timeout=60)
        assert blocked.stdout.decode().split() == ["113", "113"]
        box.set_network([allow(server, f"{PORT_A}-{PORT_B}")])
        second = box.exec(["python3", "-c", probe], timeout=60)
        assert second.stdout.decode().split("\n") == [f"{PORT_A} hi", f"{PORT_B} hi", ""]
    finally:
        box.destroy()
    alone = run(manager.create(REF, vm))
    try:
        cut = alone.exec(["python3", "-c", probe], timeout=60)
        assert all(line.split()[1] != "hi" for line in cut.stdout.decode().splitlines()), cut.stdout
        assert alone.state.network is None
    finally:
        alone.destroy()
