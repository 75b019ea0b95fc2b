"""The daemon's control API (lazyfetch/control.py) on a real unix socket, spoken to in raw bytes.

The socket is root's alone, but whatever reaches it must get a status naming what
was wrong and leave the server answering the next request.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from lazyfetch.control import (
    MAX_BODY,
    MAX_HEAD,
    ControlServer,
    HTTPError,
    Request,
    Response,
    json_response,
)


async def _echo(req: Request) -> Response:
    return json_response({"got": req.json()})


async def _boom(_: Request) -> Response:
    raise RuntimeError("the disk went away")


async def _missing(req: Request) -> Response:
    return json_response({"layers": req.json()["layers"]})


async def _teapot(_: Request) -> Response:
    raise HTTPError(409, "layer abc is busy; try again")


@pytest_asyncio.fixture
async def server(tmp_path: Path) -> AsyncIterator[str]:
    srv = ControlServer({("POST", "/echo"): _echo, ("GET", "/boom"): _boom, ("POST", "/need"): _missing,
                         ("GET", "/busy"): _teapot})
    path = str(tmp_path / "c.sock")
    await srv.start(path)
    try:
        yield path
    finally:
        await srv.close()


async def _raw(path: str, data: bytes, *, half_close: bool = True) -> tuple[int, str]:
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(data)
    await writer.drain()
    if half_close:
        writer.write_eof()
    out = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = out.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1]) if head else 0
    return status, body.decode()


def _post(path: str, body: bytes, extra: str = "") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


@pytest.mark.asyncio
async def test_a_request_gets_its_answer_and_each_fault_a_status_naming_it(server: str) -> None:
    status, body = await _raw(server, _post("/echo", b'{"a": [1, 2]}'))
    assert (status, json.loads(body)) == (200, {"got": {"a": [1, 2]}})
    cases = [
        (_post("/nope", b"{}"), 404, "no route /nope"),
        (b"GET /echo HTTP/1.1\r\n\r\n", 405, "GET is not allowed on /echo"),
        (_post("/echo", b"{not json"), 400, "not JSON"),
        (_post("/echo", b"[1]"), 400, "must be a JSON object, not list"),
        (_post("/echo", b'"\xff"'), 400, "not JSON"),
        (_post("/need", b"{}"), 400, "KeyError: 'layers'"),
        (b"GET /boom HTTP/1.1\r\n\r\n", 500, "RuntimeError: the disk went away"),
        (b"GET /busy HTTP/1.1\r\n\r\n", 409, "layer abc is busy"),
        (b"BREW /echo\r\n\r\n", 400, "not an HTTP/1.x request line"),
        (b"POST /echo HTTP/1.1\r\nno colon here\r\n\r\n", 400, "malformed header line"),
        (b"POST /echo HTTP/1.1\r\nContent-Length: ten\r\n\r\n", 400, "is not a number"),
        (b"POST /echo HTTP/1.1\r\nContent-Length: -5\r\n\r\n", 400, "negative"),
        (f"POST /echo HTTP/1.1\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n".encode(), 413, "over the"),
        (b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", 411,
         "Content-Length"),
        (b"GET /echo HTTP/1.1\r\nX: " + b"a" * (MAX_HEAD + 10) + b"\r\n\r\n", 431, "headers over"),
    ]
    for raw, want_status, want_text in cases:
        status, body = await _raw(server, raw)
        assert (status, want_text in body) == (want_status, True), (raw[:60], body)
    # and after all that it still answers
    assert (await _raw(server, _post("/echo", b"{}")))[0] == 200


@pytest.mark.asyncio
async def test_a_client_that_hangs_up_mid_body_or_before_a_request_harms_nothing(server: str) -> None:
    for partial in (_post("/echo", b'{"a": 1}')[:-3], b"POST /ec", b""):
        reader, writer = await asyncio.open_unix_connection(server)
        writer.write(partial)
        await writer.drain()
        writer.close()
        await writer.wait_closed()
    # many at once, some hanging up: each whole request is still answered
    good = [_raw(server, _post("/echo", json.dumps({"i": i}).encode())) for i in range(20)]
    results = await asyncio.gather(*good)
    assert [json.loads(b)["got"]["i"] for _, b in results] == list(range(20))


def test_the_daemon_imports_no_http_framework() -> None:
    """The reason control.py exists: the daemon's start (on a fresh host's first mount and on
    every restart readers wait through) does not pay for aiohttp."""
    probe = "import sys, lazyfetch.daemon; print(sorted(m for m in ('aiohttp', 'yarl', 'multidict') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.usefixtures("need_root")
@pytest.mark.root("fuse")
def test_the_real_daemon_answers_its_client_and_refuses_what_is_wrong(tmp_path: Path) -> None:
    from lazyfetch.client import DaemonClient, LazyfetchError

    client = DaemonClient(tmp_path / "host")
    store = tmp_path / "store"
    store.mkdir()
    client.ensure_running(f"file://{store}", data_path="fuse", fill_below=0)
    try:
        assert client.health()["ready"] is True  # type: ignore[index]
        with pytest.raises(LazyfetchError, match=r"\(404\): layer 00ff is not served"):
            client.request("POST", "/check", {"layers": ["00ff"]})
        with pytest.raises(LazyfetchError, match=r"\(400\).*KeyError: 'layers'"):
            client.request("POST", "/layers", {"image": "x"})
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(str(client.socket))
        sock.sendall(b"GET /health HTTP/1.0\r\n")  # and never the rest: the daemon is not held up
        assert client.request("GET", "/stats")["misses"] == 0
        sock.close()
    finally:
        assert client.stop(release=True)


def test_a_starting_daemon_refuses_layers_and_a_serving_one_names_its_generation(tmp_path: Path) -> None:
    """Between its socket and serving the kernel (the reads a dead daemon left are answered then),
    the daemon takes no layer: a mount on such a layer would wait on nobody.  The client sees
    that as "not serving", which a mount answers by waiting for it; once it serves, its answer
    says whose layers they are, so a mount needs no /health of its own."""
    from layerstore.store import Store
    from lazyfetch.client import STARTING, DaemonClient, DaemonNotServing, holder_socket_path
    from lazyfetch.daemon import Daemon, DaemonConfig
    from lazyfetch.holder import Holder

    (tmp_path / "store").mkdir()
    cfg = DaemonConfig(data_dir=tmp_path / "host", store_url=f"file://{tmp_path / 'store'}")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def on_loop(coro):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, loop).result(30)

    store = on_loop(Store.open(cfg.store_url, cfg.data_dir))
    holder = Holder.spawn(str(holder_socket_path(cfg.data_dir)))
    daemon = Daemon(cfg, loop, store, holder, "fuse", "gen-1", None)
    control = daemon.control()
    client = DaemonClient(cfg.data_dir)
    on_loop(control.start(str(client.socket)))
    try:
        with pytest.raises(DaemonNotServing, match=r"starting: it does not serve the kernel yet"):
            client.request("POST", "/layers", {"image": None, "layers": []})
        status, body = asyncio.run(_raw(str(client.socket), _post("/layers", b'{"layers": []}')))
        assert (status, "starting" in body) == (STARTING, True)
        daemon.ready.set()
        reply = client.request("POST", "/layers", {"image": None, "layers": []})
        assert (reply["layers"], reply["generation"]) == ([], "gen-1")
    finally:
        holder.exit()
        on_loop(control.close())
        on_loop(store.close())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_a_client_tells_no_daemon_from_one_that_dropped_or_did_not_answer(tmp_path: Path) -> None:
    """Nothing listening: nothing was done (a mount starts a daemon and asks).  A daemon that takes
    the request and closes without an answer died mid-request (a mount asks its successor).  One
    that keeps it past the timeout is neither: the request may still be running there."""
    from lazyfetch.client import DaemonClient, DaemonDropped, DaemonNotServing, DaemonUnavailable

    client = DaemonClient(tmp_path / "host")
    with pytest.raises(DaemonNotServing, match="is not running"):
        client.request("POST", "/layers", {"layers": []})
    client.socket.parent.mkdir(parents=True, exist_ok=True)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(client.socket))
    listener.listen(4)
    try:
        with pytest.raises(DaemonUnavailable, match=r"did not answer GET /health within 0.5 s") as caught:
            client.request("GET", "/health", timeout=0.5)  # taken into the backlog, never answered
        assert not isinstance(caught.value, (DaemonNotServing, DaemonDropped))

        def drop() -> None:  # reads the request, then closes: what a daemon killed mid-request does
            while True:
                conn, _ = listener.accept()
                got = conn.recv(65536)
                conn.close()
                if got.startswith(b"POST"):  # (the GET above is still in the backlog)
                    return

        dropper = threading.Thread(target=drop)
        dropper.start()
        with pytest.raises(DaemonDropped, match="is not answering"):
            client.request("POST", "/layers", {"layers": []}, timeout=10)
        dropper.join(10)
    finally:
        listener.close()
