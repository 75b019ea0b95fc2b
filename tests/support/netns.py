"""A server network namespace routed through the host: the "internet" egress tests reach.

    sandbox netns ── veth ── host ── veth ── server netns (<prefix>.2)
                                              TCP echo on PORT_A, PORT_B, UDP echo on PORT_U

The host side of its veth (``<prefix>.1``) is a host address, so sandboxes never reach it;
the server's ``<prefix>.2`` is an ordinary destination.  Everything is removed when the
block ends, however it ends.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PORT_A, PORT_B, PORT_U = 7001, 7002, 7003

ECHO_SERVER = f"""
import socket, sys, threading
def serve(conn):
    with conn:
        while data := conn.recv(4096):
            conn.sendall(data)
def tcp(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(64)
    while True:
        threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("0.0.0.0", {PORT_U}))
for port in ({PORT_A}, {PORT_B}):
    threading.Thread(target=tcp, args=(port,), daemon=True).start()
print("ready", flush=True)
while True:
    data, peer = u.recvfrom(4096); u.sendto(data, peer)
"""


@dataclass
class Server:
    addr: str
    netns: str


def sh(*argv: str, stdin: str | None = None) -> str:
    proc = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, f"{argv}: {proc.stderr}"
    return proc.stdout


@contextlib.contextmanager
def echo_server(ns: Path, prefix: str, host_if: str) -> Iterator[Server]:
    """The echo servers in a new namespace bind-mounted at ``ns``, on ``<prefix>.2/30`` behind the
    host's ``host_if`` (``<prefix>.1``); ``prefix`` is three octets, e.g. ``10.250.7``."""
    ns.touch()
    proc: subprocess.Popen[str] | None = None
    try:
        sh("unshare", f"--net={ns}", "true")  # a netns kept alive by a bind mount on ns
        sh("ip", "-batch", "-", stdin=(
            f"link add {host_if} type veth peer name eth0 netns {ns}\n"
            f"addr add {prefix}.1/30 dev {host_if}\nlink set {host_if} up\n"))
        # replies to sandboxes enter the host here and are routed on
        Path(f"/proc/sys/net/ipv4/conf/{host_if}/forwarding").write_text("1")
        sh("nsenter", f"--net={ns}", "ip", "-batch", "-", stdin=(
            f"link set lo up\naddr add {prefix}.2/30 dev eth0\nlink set eth0 up\n"
            f"route add default via {prefix}.1\n"))
        proc = subprocess.Popen(["nsenter", f"--net={ns}", "python3", "-c", ECHO_SERVER],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        assert proc.stdout.readline() == "ready\n"
        yield Server(f"{prefix}.2", str(ns))
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["umount", str(ns)], capture_output=True)
    assert not Path("/sys/class/net", host_if).exists()


def veth_name(tag: str) -> str:
    """A host interface name of this test process (at most 15 characters)."""
    return f"lb{tag}{os.getpid()}"[:15]
