"""The stock ``e2b`` SDK on a microVM: the same calls as on a container (tests/test_e2b_commands.py).

The operator makes the template the E2B way (tests/support/e2b.py ``make_template``), but from a
sandbox started with ``isolation: microvm``: the checkpoint carries that isolation, so an E2B
create of ``base-vm`` boots a microVM without any new field.  One edge and one template for the
module (QEMU under TCG is slow); each sandbox starts from the template's checkpoint.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import re
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import httpx
import pytest
from e2b import (
    AsyncSandbox,
    CommandExitException,
    FilesystemEventType,
    FileType,
    InvalidArgumentException,
    NotFoundException,
    PtySize,
    Sandbox,
    SandboxException,
)
from support.e2b import ALPHA, E2bEdge, e2b_edge, echo_through, envd_headers, ws_echo
from support.edges import http
from support.sandboxes import store_url  # noqa: F401  (a module's store with the fixture image)

pytestmark = [pytest.mark.usefixtures("need_root"),
              pytest.mark.root("erofs", "overlay", "cmd:qemu-system-x86_64")]

VM_TEMPLATE = "base-vm"
DOMAIN = "vms.test"
VM = {"isolation": "microvm", "memory": 384 << 20, "disk": 256 << 20}


@pytest.fixture(scope="module")
def served(store_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2bEdge]:  # noqa: F811
    with e2b_edge(tmp_path_factory.mktemp("e2b-vm"), store_url, "--e2b-domain", DOMAIN, name="e2b-vm",
                  template=VM_TEMPLATE, **VM) as edge:
        yield edge


@pytest.fixture(scope="module")
def vm(served: E2bEdge) -> Iterator[Sandbox]:
    box = Sandbox.create(VM_TEMPLATE, timeout=600)
    try:
        yield box
    finally:
        box.kill()
        assert box.sandbox_id not in served.sandboxes()


def test_an_e2b_create_of_a_microvm_template_boots_a_microvm(served: E2bEdge, vm: Sandbox) -> None:
    status, _, view = http("GET", f"{served.url}/v1/sandboxes/{vm.sandbox_id}", token=ALPHA)
    assert status == 200, view
    assert view["isolation"] == "microvm"
    assert vm.get_info().template_id == VM_TEMPLATE
    # a guest kernel of its own (not the host's), seen from inside
    assert vm.commands.run("uname -r").stdout.strip() != os.uname().release


def test_commands_run_as_user_and_root_with_streams_and_exit_codes(vm: Sandbox) -> None:
    seen: list[str] = []
    errs: list[str] = []
    result = vm.commands.run("echo out; whoami; pwd; echo err >&2", on_stdout=seen.append, on_stderr=errs.append)
    assert (result.stdout, result.stderr) == ("out\nuser\n/home/user\n", "err\n")
    assert "".join(seen) == result.stdout
    assert "".join(errs) == result.stderr
    assert vm.commands.run("whoami; echo $GREETING", user="root", envs={"GREETING": "hej"},
                           cwd="/tmp").stdout == "root\nhej\n"
    with pytest.raises(CommandExitException) as caught:
        vm.commands.run("exit 3")
    assert caught.value.exit_code == 3


def test_stdin_background_connect_and_kill(vm: Sandbox) -> None:
    cat = vm.commands.run("cat", background=True, stdin=True)
    vm.commands.send_stdin(cat.pid, "to the guest\n")
    vm.commands.close_stdin(cat.pid)
    assert cat.wait().stdout == "to the guest\n"
    handle = vm.commands.run("echo begun; sleep 300", background=True, timeout=0)
    assert handle.pid in [p.pid for p in vm.commands.list()]
    again = vm.commands.connect(handle.pid)
    assert vm.commands.kill(handle.pid) is True
    with pytest.raises(CommandExitException) as caught:
        again.wait()
    assert "begun" in caught.value.stdout
    assert vm.commands.kill(handle.pid) is False  # finished: as envd, no such running process


# -- terminals: a pty the guest agent makes (protocol 3) ------------------------------------------------------
def test_a_pty_on_a_microvm_takes_keys_resizes_and_ends_with_its_shell(vm: Sandbox) -> None:
    term = vm.pty.create(PtySize(rows=24, cols=80))
    vm.pty.send_stdin(term.pid, b"stty size; echo T=$TERM; readlink /proc/self/fd/0\n")
    seen: list[bytes] = []
    for _, _, data in term:  # the shell's answer, before the resize
        seen.append(data or b"")
        if re.search(rb"T=xterm-256color\r\n/dev/pts/\d+\r\n", b"".join(seen)):
            break
    vm.pty.resize(term.pid, PtySize(rows=30, cols=100))
    vm.pty.send_stdin(term.pid, b"stty size; whoami; tty; exit 3\n")
    with pytest.raises(CommandExitException) as caught:
        term.wait(on_pty=seen.append)
    screen = b"".join(seen).decode(errors="replace")
    assert caught.value.exit_code == 3
    for line in ("24 80\r\n", "30 100\r\n", "\nuser\r\n", "/dev/pts/"):
        assert line in screen, repr(screen)
    assert "not a tty" not in screen, screen
    assert vm.pty.kill(term.pid) is False  # it ended


# exits 0 once ``test`` finds nothing (within 30 s): what a kill or a close ends is gone a moment later
GONE = "for i in $(seq 300); do {test} >/dev/null 2>&1 || exit 0; sleep 0.1; done; exit 1"


def test_a_pty_on_a_microvm_is_killed_with_what_it_runs(vm: Sandbox) -> None:
    seen: list[bytes] = []
    term = vm.pty.create(PtySize(rows=10, cols=40), user="root")
    vm.pty.send_stdin(term.pid, b"sleep 300 & echo bg=$((40+2)); sleep 301\n")
    for _, _, data in term:  # the job started, the foreground command runs
        seen.append(data or b"")
        if b"bg=42" in b"".join(seen):
            break
    assert vm.pty.kill(term.pid) is True
    with pytest.raises(CommandExitException):
        term.wait()
    # the shell's session, its background job and its foreground command all end with it
    assert vm.commands.run(GONE.format(test="grep -lx sleep /proc/[0-9]*/comm")).exit_code == 0


def test_a_terminal_on_a_microvm_through_the_native_api(served: E2bEdge, vm: Sandbox) -> None:
    trips: list[float] = []

    async def session() -> tuple[bytes, dict[str, Any]]:
        base = f"/v1/sandboxes/{vm.sandbox_id}/commands"
        async with aiohttp.ClientSession(served.url, headers={"Authorization": f"Bearer {ALPHA}"}) as http_:
            async with http_.post(base, json={"pty": {"cols": 80, "rows": 24}, "env": {"PS1": "$ "}}) as resp:
                started = await resp.json()
                assert resp.status == 201, started
            assert started["pty"] == {"cols": 80, "rows": 24}
            screen = b""
            async with http_.ws_connect(f"{base}/{started['id']}/connect") as ws:
                async def until(pattern: bytes) -> dict[str, Any]:
                    nonlocal screen
                    async with asyncio.timeout(60):
                        while True:
                            event = json.loads((await ws.receive()).data)
                            if event["type"] in ("stdout", "stderr"):
                                screen += base64.b64decode(event["data"])
                            if re.search(pattern, screen) or event["type"] in ("exit", "error"):
                                return dict(event)

                await ws.send_bytes(b"echo hi-$((6*7)); stty size\n")
                await until(rb"hi-42\r\n24 80\r\n")
                for i in range(20):  # one key typed, its echo seen: the terminal's round trip
                    started = time.perf_counter()
                    await ws.send_bytes(b"abcdefghijklmnopqrst"[i:i + 1])
                    await until(re.escape(b"abcdefghijklmnopqrst"[:i + 1]) + rb"$")
                    trips.append(time.perf_counter() - started)
                await ws.send_bytes(b"\x15")  # ^U: the typed line erased
                await ws.send_str(json.dumps({"type": "resize", "cols": 132, "rows": 40}))
                await ws.send_bytes(b"stty size; exit 7\n")
                await until(rb"[\r\n]40 132\r\n")
                final = await until(rb"(?!)")  # the exit event
            return screen, final

    screen, final = asyncio.run(session())
    trips.sort()
    print(f"\nmicroVM terminal: a key's echo in {trips[len(trips) // 2] * 1000:.1f} ms (p50), "
          f"{trips[-1] * 1000:.1f} ms (max of {len(trips)})")
    assert b"40 132" in screen
    assert (final["type"], final["exit_code"]) == ("exit", 7), final


# -- files: commands in the guest as the caller's account (sandbox/edge/e2b/guestfs.py) --------------------
def sh(box: Sandbox, cmd: str) -> str:
    return box.commands.run(cmd, user="root").stdout


def test_files_write_read_and_describe_as_the_user(vm: Sandbox) -> None:
    started = time.perf_counter()
    info = vm.files.write("notes/hello.txt", "hej då\n")  # relative: from the user's home, parents made
    wrote = time.perf_counter() - started
    assert (info.name, info.path) == ("hello.txt", "/home/user/notes/hello.txt")
    started = time.perf_counter()
    assert vm.files.read("notes/hello.txt") == "hej då\n"
    print(f"\nmicroVM: write {wrote * 1000:.0f} ms, read {(time.perf_counter() - started) * 1000:.0f} ms")
    assert sh(vm, "stat -c '%U:%G %a' /home/user/notes /home/user/notes/hello.txt") == \
        "user:user 755\nuser:user 644\n"
    entry = vm.files.get_info("~/notes/hello.txt")
    assert (entry.type, entry.size, entry.mode, entry.permissions, entry.owner, entry.group) == (
        FileType.FILE, len("hej då\n".encode()), 0o644, "-rw-r--r--", "user", "user")
    assert abs(entry.modified_time.timestamp() - time.time()) < 3600
    assert vm.files.get_info("/").name == "/"
    vm.commands.run("chmod 600 /home/user/notes/hello.txt")
    vm.files.write("notes/hello.txt", "again", gzip=True)  # written over: the same file, its mode kept
    assert vm.files.read("notes/hello.txt", gzip=True) == "again"
    assert sh(vm, "stat -c '%U %a' /home/user/notes/hello.txt") == "user 600\n"
    blob = os.urandom(3 << 20) + b"\n\0 end"  # several pieces each way, any bytes
    vm.files.write("/home/user/notes/blob.bin", blob)
    assert bytes(vm.files.read("notes/blob.bin", format="bytes")) == blob
    assert sh(vm, "sha256sum < /home/user/notes/blob.bin").split()[0] == hashlib.sha256(blob).hexdigest()


def test_files_several_listed_made_renamed_removed(vm: Sandbox) -> None:
    written = vm.files.write_files([{"path": "tree/a.txt", "data": "a"}, {"path": "tree/sub/b.txt", "data": b"bb"}])
    assert [w.path for w in written] == ["/home/user/tree/a.txt", "/home/user/tree/sub/b.txt"]
    vm.commands.run("touch '/home/user/tree/sub/weird name\nline'")  # any name survives a listing
    assert [(e.name, e.type) for e in vm.files.list("tree")] == [("a.txt", FileType.FILE), ("sub", FileType.DIR)]
    deep = vm.files.list("tree", depth=2)
    assert [e.path.removeprefix("/home/user/tree/") for e in deep] == [
        "a.txt", "sub", "sub/b.txt", "sub/weird name\nline"]
    assert all((e.owner, e.group) == ("user", "user") for e in deep)
    assert next(e for e in deep if e.name == "sub").permissions == "drwxr-xr-x"
    assert vm.files.make_dir("tree/x/y") is True
    assert vm.files.make_dir("tree/x/y") is False
    assert vm.files.exists("tree/x/y")
    assert not vm.files.exists("tree/nope")
    moved = vm.files.rename("tree/a.txt", "tree/z/g.txt")
    assert (moved.name, moved.path, moved.type) == ("g.txt", "/home/user/tree/z/g.txt", FileType.FILE)
    assert vm.files.read("tree/z/g.txt") == "a"
    assert not vm.files.exists("tree/a.txt")
    vm.commands.run("ln -s z/g.txt /home/user/tree/link")
    link = vm.files.get_info("tree/link")
    assert (link.type, link.symlink_target, link.permissions, link.mode) == (
        FileType.SYMLINK, "/home/user/tree/z/g.txt", "Lrwxrwxrwx", 0o644)
    vm.files.remove("tree")
    vm.files.remove("tree")  # envd's remove is rm -rf: nothing there is no error
    assert not vm.files.exists("tree")


def test_files_as_root_and_where_the_user_may_not(vm: Sandbox) -> None:
    vm.files.write("/home/user/roots.txt", "root's", user="root")
    assert sh(vm, "stat -c %U:%G /home/user/roots.txt") == "root:root\n"
    assert vm.files.get_info("/home/user/roots.txt").owner == "root"
    assert vm.files.read("/root/.bashrc", user="root")
    with pytest.raises(SandboxException, match="ermission"):
        vm.files.write("/etc/not-the-users", "x")
    with pytest.raises(SandboxException, match="ermission"):
        vm.files.write("/root/not-the-users", "x")
    with pytest.raises(SandboxException, match="ermission"):
        vm.files.write("/home/user/roots.txt", "overwritten")  # root's 0644 file in the user's home
    with pytest.raises(SandboxException, match="ermission"):
        vm.files.read("/root/.bashrc")  # /root is 0700
    with pytest.raises(SandboxException, match="ermission"):
        vm.files.remove("/etc/hostname")
    with pytest.raises(SandboxException, match="ermission"):
        vm.files.make_dir("/root/not-the-users")
    assert sh(vm, "cat /home/user/roots.txt; ls /etc/not-the-users /root/not-the-users 2>&1 | grep -c 'No such'"
              ) == "root's2\n"
    vm.files.remove("/home/user/roots.txt", user="root")


def test_files_errors_the_sdk_maps(vm: Sandbox) -> None:
    with pytest.raises(NotFoundException):
        vm.files.read("missing.txt")
    with pytest.raises(NotFoundException):
        vm.files.get_info("missing.txt")
    with pytest.raises(NotFoundException):
        vm.files.list("missing")
    vm.files.write("plain", "")
    assert vm.files.read("plain") == ""  # an empty file: a command that printed nothing
    with pytest.raises(InvalidArgumentException, match="not a directory"):
        vm.files.list("plain")
    with pytest.raises(InvalidArgumentException, match="is a directory"):
        vm.files.read("/home/user")
    with pytest.raises(InvalidArgumentException, match="not a directory"):
        vm.files.make_dir("plain/sub")
    vm.files.remove("plain")


# -- watching: the guest kernel's inotify, read by a child of the agent's (protocol 3) ----------------------
# (the watch's child is a fork of the agent: while it runs, two processes are called lb-agent)
WATCHING = "[ $(grep -lx lb-agent /proc/[0-9]*/comm | wc -l) -gt 1 ]"


def test_a_polled_watcher_on_a_microvm_sees_the_guests_changes(vm: Sandbox) -> None:
    vm.files.make_dir("w/nested")
    handle = vm.files.watch_dir("w", include_entry=True)
    try:
        vm.files.write("w/f.txt", "one")
        seen = [(e.type, e.name) for e in handle.get_new_events()]  # settled: all the write's events
        assert seen[0] == (FilesystemEventType.CREATE, "f.txt"), seen
        assert (FilesystemEventType.WRITE, "f.txt") in seen, seen
        vm.commands.run("echo two >> w/f.txt; chmod 600 w/f.txt")
        events = handle.get_new_events()
        assert [(e.type, e.name) for e in events] == [(FilesystemEventType.WRITE, "f.txt"),
                                                      (FilesystemEventType.CHMOD, "f.txt")]
        assert events[1].entry is not None
        assert (events[1].entry.path, events[1].entry.mode) == ("/home/user/w/f.txt", 0o600)
        vm.commands.run("mv w/f.txt w/g.txt; rm w/g.txt; touch w/nested/ignored")
        assert [(e.type, e.name) for e in handle.get_new_events()] == [
            (FilesystemEventType.RENAME, "f.txt"), (FilesystemEventType.CREATE, "g.txt"),
            (FilesystemEventType.REMOVE, "g.txt")]
        assert vm.commands.run(WATCHING).exit_code == 0
    finally:
        handle.stop()
    with pytest.raises(SandboxException):
        handle.get_new_events()
    # the watch's child was killed with it
    assert vm.commands.run(GONE.format(test=WATCHING)).exit_code == 0


def test_a_recursive_watcher_on_a_microvm_follows_new_directories(vm: Sandbox) -> None:
    vm.files.make_dir("r/a")
    handle = vm.files.watch_dir("r", recursive=True)
    try:
        vm.files.write("r/a/f", "x")
        vm.commands.run("mkdir -p r/b/c && echo hi > r/b/c/g")
        vm.files.write("r/b/c/h", "y")
        seen = {(e.type, e.name) for e in handle.get_new_events()}
        for created in ("a/f", "b", "b/c", "b/c/g", "b/c/h"):
            assert (FilesystemEventType.CREATE, created) in seen, seen
        assert (FilesystemEventType.WRITE, "b/c/h") in seen
        vm.commands.run("rm -r r")
        assert (FilesystemEventType.REMOVE, "") in {(e.type, e.name) for e in handle.get_new_events()}
        with pytest.raises(NotFoundException):  # its directory is gone: the watch ended
            handle.get_new_events()
    finally:
        handle.stop()


def test_a_watch_on_a_microvm_runs_as_the_account_and_refuses_what_it_cannot_watch(vm: Sandbox) -> None:
    with pytest.raises(SandboxException, match="ermission"):
        vm.files.watch_dir("/root")  # 0700, root's
    vm.files.write("plain", "")
    with pytest.raises(InvalidArgumentException, match="not a directory"):
        vm.files.watch_dir("plain")
    with pytest.raises(NotFoundException):
        vm.files.watch_dir("missing")
    vm.files.remove("plain")
    vm.files.watch_dir("/root", user="root").stop()


def test_the_async_client_streams_a_microvms_watch_events(served: E2bEdge, vm: Sandbox) -> None:
    async def scenario() -> list[tuple[FilesystemEventType, str]]:
        box = await AsyncSandbox.connect(vm.sandbox_id)
        await box.files.make_dir("aw")
        got: list[tuple[FilesystemEventType, str]] = []
        done = asyncio.Event()

        def on_event(e: Any) -> None:
            got.append((e.type, e.name))
            if (FilesystemEventType.REMOVE, "a.txt") in got:
                done.set()

        handle = await box.files.watch_dir("aw", on_event, timeout=120)
        try:
            await box.files.write("aw/a.txt", b"async bytes")
            await box.files.remove("aw/a.txt")
            await asyncio.wait_for(done.wait(), 120)
        finally:
            await handle.stop()
        return got

    got = asyncio.run(scenario())
    assert got[0] == (FilesystemEventType.CREATE, "a.txt")
    assert got[-1] == (FilesystemEventType.REMOVE, "a.txt")


def test_a_paused_microvm_goes_to_the_store_and_resumes_with_its_processes(served: E2bEdge) -> None:
    box = Sandbox.create(VM_TEMPLATE, timeout=600)
    try:
        box.commands.run("n=0; while true; do n=$((n+1)); echo $n > /tmp/n.new; mv /tmp/n.new /tmp/n; sleep 0.1; done", background=True,
                         timeout=0)
        box.files.write("/home/user/kept.txt", "across the pause")
        time.sleep(0.5)
        before = int(box.commands.run("cat /tmp/n").stdout)
        assert box.pause()
        status, _, view = http("GET", f"{served.url}/v1/sandboxes/{box.sandbox_id}", token=ALPHA)
        assert status == 404, view  # nothing of it on the edge: its disk and RAM are in the store
        assert Sandbox.get_info(box.sandbox_id).state.value == "paused"
        again = Sandbox.connect(box.sandbox_id, timeout=600)  # any edge of the store would do
        assert again.files.read("/home/user/kept.txt") == "across the pause"
        first = int(again.commands.run("cat /tmp/n").stdout)
        assert first >= before  # the same process: its count went on from where it was
        time.sleep(0.5)
        assert int(again.commands.run("cat /tmp/n").stdout) > first
    finally:
        box.kill()


# -- ports: the guest agent relays a connection to the guest's own 127.0.0.1 (protocol 3) -----------------
WEB, WS = 8000, 8001


@pytest.fixture(scope="module")
def web(vm: Sandbox) -> Sandbox:
    """The module's microVM serving HTTP on WEB (a 3 MiB file among others) and a WebSocket echo on WS."""
    vm.commands.run(f"mkdir -p www && echo hello-from-{WEB} > www/index.txt && head -c 3145728 /dev/urandom > "
                    f"www/big.bin && cat > ws.py <<'EOF'{ws_echo(WS)}EOF")
    vm.commands.run(f"cd www && exec python3 -m http.server {WEB} --bind 127.0.0.1", background=True, timeout=0)
    vm.commands.run("exec python3 ws.py", background=True, timeout=0)
    vm.commands.run(f"for port in {WEB} {WS}; do for i in $(seq 600); do "
                    "(exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null && continue 2; sleep 0.1; done; exit 1; done")
    return vm


def test_a_port_of_a_microvm_through_the_native_proxy_e2b_headers_and_host_names(served: E2bEdge,
                                                                                  web: Sandbox) -> None:
    sid = web.sandbox_id
    native = httpx.get(f"{served.url}/v1/sandboxes/{sid}/ports/{WEB}/proxy/index.txt",
                       headers={"Authorization": f"Bearer {ALPHA}"}, timeout=60)
    assert (native.status_code, native.text) == (200, f"hello-from-{WEB}\n")
    by_header = httpx.get(f"{served.url}/index.txt", headers=envd_headers(sid, WEB, **{"X-API-Key": ALPHA}),
                          timeout=60)
    assert (by_header.status_code, by_header.text) == (200, f"hello-from-{WEB}\n")
    assert web.get_host(WEB) == f"{WEB}-{sid}.{DOMAIN}"
    by_host = httpx.get(f"{served.url}/index.txt", timeout=60, headers={
        "Host": web.get_host(WEB), "e2b-traffic-access-token": str(web.traffic_access_token)})
    assert (by_host.status_code, by_host.text) == (200, f"hello-from-{WEB}\n")
    started = time.perf_counter()
    big = httpx.get(f"{served.url}/big.bin", headers=envd_headers(sid, WEB, **{"X-API-Key": ALPHA}), timeout=120)
    took = time.perf_counter() - started
    assert big.status_code == 200
    assert hashlib.sha256(big.content).hexdigest() == \
        web.commands.run("sha256sum www/big.bin").stdout.split()[0]  # every byte, through several windows
    print(f"\nmicroVM port: 3 MiB over HTTP in {took * 1000:.0f} ms")
    small = []
    with httpx.Client(timeout=60) as client:
        for _ in range(20):
            started = time.perf_counter()
            assert client.get(f"{served.url}/index.txt", headers=envd_headers(sid, WEB, **{"X-API-Key": ALPHA})
                              ).status_code == 200
            small.append(time.perf_counter() - started)
    small.sort()
    print(f"microVM port: a small GET in {small[len(small) // 2] * 1000:.1f} ms (p50 of {len(small)})")
    closed = httpx.get(f"{served.url}/index.txt", headers=envd_headers(sid, 8999, **{"X-API-Key": ALPHA}),
                       timeout=60)
    assert closed.status_code == 502
    assert "8999" in closed.json()["message"]


def test_a_websocket_into_a_microvm_is_proxied(served: E2bEdge, web: Sandbox) -> None:
    assert echo_through(served.url, web, WS, timeout=60) == ["echo:one", "echo:two"]
    # every relayed connection ended with its client: none is established in the guest any more
    ports = "|".join(f"{p:04X}" for p in (WEB, WS))
    established = f"awk '$4 == \"01\" && ($2 ~ /:({ports})$/ || $3 ~ /:({ports})$/)' /proc/net/tcp | grep ."
    assert web.commands.run(GONE.format(test=established)).exit_code == 0
