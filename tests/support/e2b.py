"""An edge as a real process serving the E2B protocol, the template ``base`` made the way an
operator would make an E2B-style one, and the settings the stock ``e2b`` SDK needs.

The template: an admin project starts the fixture's python image through the native API, adds
E2B's account ``user`` (uid 1000, home ``/home/user``) with ``useradd``, and checkpoints it as
``base``, shared with every project.  The SDK then needs only ``E2B_API_KEY``, ``E2B_API_URL``
and ``E2B_SANDBOX_URL`` (:func:`sdk_env`), as a user's would.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from .edges import EdgeProcess, running

ADMIN = "ops-token-0123456789"
ALPHA = "alpha-token-0123456789"
BETA = "beta-token-0123456789"
TOKENS = {"projects": {"ops": {"tokens": [ADMIN], "admin": True},
                       "alpha": {"tokens": [ALPHA], "max_sandboxes": 12},
                       "beta": {"tokens": [BETA], "max_sandboxes": 4}}}
TEMPLATE = "base"
SOURCE_IMAGE = "img/python"
ENVD = 49983  # envd's port: the SDK's E2b-Sandbox-Port for its in-sandbox calls


@dataclass
class E2bEdge:
    edge: EdgeProcess

    @property
    def url(self) -> str:
        return self.edge.url

    def env(self, key: str = ALPHA) -> dict[str, str]:
        return {"E2B_API_KEY": key, "E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url}

    def sandboxes(self) -> list[str]:
        return self.edge.sandboxes()


def make_template(edge: EdgeProcess, name: str = TEMPLATE, image: str = SOURCE_IMAGE, **options: Any) -> str:
    """An E2B-style template from ``image``: the account ``user``, checkpointed as ``name`` and
    shared (the admin project's native API, as an operator would)."""
    status, _, box = edge.http("POST", "/v1/sandboxes", {"image": image, **options})
    assert status == 201, box
    try:
        status, _, out = edge.http("POST", f"/v1/sandboxes/{box['id']}/exec",
                                   {"cmd": "useradd -m -u 1000 -s /bin/bash user && id -u user"}, timeout=300)
        assert status == 200, out
        assert '"exit_code": 0' in str(out), out
        status, _, ckpt = edge.http("POST", f"/v1/sandboxes/{box['id']}/checkpoint",
                                    {"name": name, "labels": {"layerbox.shared": "true"}}, timeout=300)
        assert status == 201, ckpt
    finally:
        edge.http("DELETE", f"/v1/sandboxes/{box['id']}")
    return str(ckpt["digest"])


@contextlib.contextmanager
def e2b_edge(root: Path, store_url: str, *extra: str, name: str = "e2b", template: str = TEMPLATE,
             **options: Any) -> Iterator[E2bEdge]:
    """An edge with the template (its sandbox made with ``options``, e.g. ``isolation``), and the
    SDK's settings in the environment for the block."""
    with running(name, root, store_url, TOKENS, *extra, token=ADMIN) as edge:
        make_template(edge, template, **options)
        served = E2bEdge(edge)
        with pytest.MonkeyPatch.context() as mp:
            for key, value in served.env().items():
                mp.setenv(key, value)
            yield served


def envd_headers(sid: str, port: int = ENVD, **more: str) -> dict[str, str]:
    """The headers the SDK sends with ``E2B_SANDBOX_URL``: which sandbox, which port."""
    return {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(port), **more}


def echo_through(edge_url: str, sandbox: Any, port: int, timeout: float) -> list[str]:
    """Two words through the E2B port proxy to the :func:`ws_echo` server on ``port`` of ``sandbox``
    (an ``e2b`` Sandbox), as a browser of its preview URL sends them: what came back."""
    async def echo() -> list[str]:
        async with aiohttp.ClientSession() as session, session.ws_connect(
                f"{edge_url}/socket", headers=envd_headers(sandbox.sandbox_id, port, **{
                    "e2b-traffic-access-token": str(sandbox.traffic_access_token)})) as ws:
            got = []
            for word in ("one", "two"):
                await ws.send_str(word)
                got.append((await ws.receive(timeout=timeout)).data)
            return got

    return asyncio.run(echo())


# a WebSocket echo on the standard library (RFC 6455's handshake and short frames by hand)
_WS_ECHO = r'''
import base64, hashlib, socket, struct, threading
GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
def serve(conn):
    f, key = conn.makefile("rb"), b""
    while (line := f.readline()) not in (b"\r\n", b""):
        if line.lower().startswith(b"sec-websocket-key:"):
            key = line.split(b":", 1)[1].strip()
    accept = base64.b64encode(hashlib.sha1(key + GUID).digest())
    conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n")
    while len(head := f.read(2)) == 2:
        op, n = head[0] & 15, head[1] & 127
        if n == 126:
            n = struct.unpack("!H", f.read(2))[0]
        mask = f.read(4) if head[1] & 128 else b"\0\0\0\0"
        data = bytes(b ^ mask[i % 4] for i, b in enumerate(f.read(n)))
        if op == 8:
            conn.sendall(b"\x88\x00")
            return
        out = b"echo:" + data[:100]
        conn.sendall(bytes([0x80 | op, len(out)]) + out)
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", PORT))
s.listen(8)
while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
'''


def ws_echo(port: int) -> str:
    """A python script serving a WebSocket echo (each message back as ``echo:<message>``) on ``127.0.0.1:port``."""
    return f"\nPORT = {port}" + _WS_ECHO  # starts and ends with a newline: a heredoc's body
