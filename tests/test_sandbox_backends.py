"""One conformance suite for every sandbox backend (sandbox.backends.TABLE): the same tests, through
the manager's API, on crun containers and on QEMU microVMs (TCG here).

What a backend does not provide (its capabilities' ``lacks``) is checked too: refused with
UnsupportedOption before anything runs, never half done.  Each backend gets two hosts on one
store (a restore goes to the second, its cache empty); the VM hosts boot their template once.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import io
import os
import shlex
import signal
import socket
import struct
import termios
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from support.sandboxes import PROCESS_ARGS, REF, run, store_url  # noqa: F401  (the module's store)

from lazyfetch import kmount
from sandbox.backends.base import Capabilities
from sandbox.core.errors import (
    NotARegularFile,
    SandboxNotFound,
    SandboxStateError,
    UnsupportedOption,
)
from sandbox.core.model import ExecRequest, SandboxOptions
from sandbox.core.procs import proc_stat
from sandbox.host.manager import Sandbox, SandboxManager

pytestmark = [pytest.mark.usefixtures("need_root"),
              pytest.mark.root("erofs", "overlay", "cmd:crun", "cmd:qemu-system-x86_64")]

MiB = 1 << 20
OPTIONS = {
    "container": SandboxOptions(memory=256 * MiB, disk=128 * MiB),
    "microvm": SandboxOptions(isolation="microvm", memory=384 * MiB, disk=256 * MiB),
}


class Hosts:
    """Two hosts of one backend on one store, and every sandbox a test made on them."""

    def __init__(self, kind: str, first: SandboxManager, second: SandboxManager) -> None:
        self.kind, self.first, self.second = kind, first, second
        self.options = OPTIONS[kind]
        self.made: list[Sandbox] = []

    @property
    def caps(self) -> Capabilities:
        return self.first.backend(self.kind).capabilities(self.kind)

    def create(self, options: SandboxOptions | None = None, *, on: SandboxManager | None = None) -> Sandbox:
        box = run((on or self.first).create(REF, options or self.options))
        self.made.append(box)
        return box

    def cleanup(self) -> None:
        for box in self.made:
            box.manager.destroy(box.id)
            assert not box.dir.exists()
        self.made.clear()


@pytest.fixture(scope="module", params=sorted(OPTIONS))
def hosts(request: pytest.FixtureRequest, store_url: str,  # noqa: F811
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    kind = request.param
    first = SandboxManager(tmp_path_factory.mktemp(f"{kind}-host1"), store_url)
    second = SandboxManager(tmp_path_factory.mktemp(f"{kind}-host2"), store_url)
    for mgr in (first, second):
        mgr.host.daemon_options = {"fill_below": 0}  # what is fetched, the sandboxes read
    try:
        caps = first.backend(kind).capabilities(kind)
        if not caps.available:
            pytest.fail(f"isolation={kind} is not available on this host: {caps.reason}")
        yield Hosts(kind, first, second)
    finally:
        try:
            first.close()
        finally:
            second.close()  # (also when the first's close fails: no daemon of it outlives the test)
        for mgr in (first, second):
            assert kmount.mounts_under(mgr.data_dir) == []
            assert not [d for d in mgr.layout.dirs("/" + mgr.cgroup_parent) if d.exists()]


@pytest.fixture
def sb(hosts: Hosts) -> Iterator[Hosts]:
    try:
        yield hosts
    finally:
        hosts.cleanup()


def _kill(pid: int) -> None:
    """SIGKILL ``pid`` and wait until it has exited (a VMM stays this process's zombie: the manager
    must see it as dead all the same)."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while proc_stat(pid) is not None and time.monotonic() < deadline:  # (a zombie is gone)
        time.sleep(0.05)


def _processes(box: Sandbox, pattern: str) -> int:
    out = box.exec(f"{PROCESS_ARGS} | grep -c '^{pattern} ' || true").stdout
    return int(out.strip() or 0)


# -- create and exec --------------------------------------------------------------------------------
def test_create_runs_and_says_what_runs_it(sb: Hosts) -> None:
    box = sb.create()
    st = box.state
    assert (st.status, st.options.isolation) == ("running", sb.kind)
    assert box.init_pid() == st.pid  # its main process, in its own cgroup
    assert sb.first.layout.holds(st.pid, st.cgroups_path)
    create = box.receipts()[0]
    assert (create["action"], create["ref"], create["memory"]) == ("create", REF, sb.options.memory)
    assert b"Debian GNU/Linux 12" in box.exec("cat /etc/os-release").stdout


def test_exec_streams_stdin_stdout_stderr_and_exit_codes(sb: Hosts) -> None:
    box = sb.create()
    chunks: list[bytes] = []
    res = box.exec("for i in 1 2 3; do echo line$i; done; echo oops >&2; exit 7", on_stdout=chunks.append)
    assert (res.exit_code, res.stdout, res.stderr) == (7, b"line1\nline2\nline3\n", b"oops\n")
    assert b"".join(chunks) == res.stdout
    assert box.exec(["cat"], stdin=b"from the host\n" * 5000).stdout == b"from the host\n" * 5000
    assert box.exec(["sh", "-c", "kill -TERM $$"]).signal == signal.SIGTERM
    missing = box.exec(["/no/such/program"])
    assert missing.exit_code not in (0, None)  # 127 from a guest's agent, crun's own 255 for a container
    assert b"/no/such/program" in missing.stderr
    assert box.exec("pwd", cwd="/tmp").stdout == b"/tmp\n"
    assert box.exec("echo $ANSWER", env={"ANSWER": "42"}).stdout == b"42\n"
    last = box.receipts()[-1]
    assert (last["action"], last["exit_code"], last["stdout_bytes"]) == ("exec", 0, 3)


def test_a_timeout_kills_the_command_and_everything_it_started(sb: Hosts) -> None:
    box = sb.create()
    started = time.monotonic()
    res = box.exec("sleep 61 & sleep 62; echo never", timeout=1.0)
    assert res.timed_out
    assert res.signal == signal.SIGKILL
    assert b"never" not in res.stdout
    assert time.monotonic() - started < 30
    assert _processes(box, "sleep 61") == 0
    assert _processes(box, "sleep 62") == 0


def test_output_is_capped_at_the_head_or_the_tail(sb: Hosts) -> None:
    box = sb.create()
    head = box.exec("seq 1 100000", output_cap=1000)
    assert head.truncated
    assert head.stdout == b"".join(b"%d\n" % i for i in range(1, 100001))[:1000]
    assert head.cuts[0].offset == 1000
    tail = box.exec(ExecRequest(cmd="seq 1 100000", output_cap=1000, keep="tail"))
    assert tail.stdout.endswith(b"99999\n100000\n")
    assert len(tail.stdout) == 1000


def test_a_cancel_ends_a_running_command(sb: Hosts) -> None:
    from sandbox.host.execs import Cancel

    box = sb.create()
    cancel = Cancel()
    threading.Timer(0.5, cancel.cancel, args=("killed",)).start()
    res = box.exec("sleep 60", cancel=cancel)
    assert (res.interrupted, res.signal) == ("killed", signal.SIGKILL)
    assert box.exec("echo still").stdout == b"still\n"


# -- files -------------------------------------------------------------------------------------------
def test_files_regular_ones_round_trip(sb: Hosts) -> None:
    box = sb.create()
    payload = os.urandom(3 * MiB + 17)
    assert box.upload("/root/blob", io.BytesIO(payload)) == len(payload)
    out = io.BytesIO()
    assert box.download("/root/blob", out) == len(payload)
    assert out.getvalue() == payload
    assert box.exec("sha256sum /root/blob").stdout.split()[0].decode() == hashlib.sha256(payload).hexdigest()
    box.write("/root/note.txt", b"hi", 0o600)
    entries = {e["name"]: e for e in box.list("/root")}
    assert (entries["note.txt"]["size"], entries["note.txt"]["mode"], entries["blob"]["type"]) == (2, 0o600, "file")
    assert box.stat("/root/blob").st_size == len(payload)
    box.files.mkdir("/root/dir")
    assert box.stat("/root/dir").st_mode & 0o40000
    box.remove("/root/blob")
    with pytest.raises(FileNotFoundError):
        box.read("/root/blob")
    with pytest.raises(IsADirectoryError):
        box.read("/root/dir")
    box.remove("/root/dir", recursive=True)
    actions = [r["action"] for r in box.receipts()]
    assert {"upload", "download", "write", "remove"} <= set(actions)


def test_special_files_are_listed_never_opened(sb: Hosts) -> None:
    """A FIFO the sandbox made would block a reader, a device node would reach the device: the files
    API refuses to open them, at once, with the same error on every backend."""
    box = sb.create()
    made = box.exec("mkfifo /tmp/fifo && python3 -c \"import socket; socket.socket(socket.AF_UNIX)"
                    ".bind('/tmp/sock')\" && echo ok")
    assert made.stdout == b"ok\n", made.stderr
    started = time.monotonic()
    for path in ("/tmp/fifo", "/tmp/sock"):
        with pytest.raises(NotARegularFile) as refused:
            box.read(path)
        assert refused.value.errno == errno.EINVAL
        with pytest.raises(NotARegularFile):
            box.write(path, b"x")
    assert time.monotonic() - started < 20  # nothing waited on the FIFO
    assert {e["name"]: e["type"] for e in box.list("/tmp")}["fifo"] == "other"
    box.remove("/tmp/fifo")


def test_paths_resolve_inside_the_sandbox(sb: Hosts) -> None:
    """An agent's symlinks and dot-dots name the sandbox's own files, never the host's."""
    box = sb.create()
    probe = "/etc/layerbox-conformance-probe"
    assert not os.path.exists(probe)  # the host has none: a read that left the sandbox would fail
    box.exec(f"echo inside > {probe} && ln -s {probe} /root/link && ln -s ../../../..{probe} /tmp/up")
    assert box.read(f"/../../..{probe}") == b"inside\n"
    assert box.read("/tmp/up") == b"inside\n"
    assert box.read("/root/link") == b"inside\n"
    box.exec("ln -s /etc/shadow /root/shadow")
    assert box.read("/root/shadow") == box.exec("cat /etc/shadow").stdout  # the sandbox's own shadow
    with pytest.raises(OSError):  # noqa: PT011  (a relative path is refused before it resolves anywhere)
        box.read("relative/path")


# -- interactive: what a backend without it refuses --------------------------------------------------
class Pipe:
    """An :class:`~sandbox.backends.base.Attach` of the test's own: the command's stdin is a pipe the
    test feeds (how sandbox.edge.routes.commands keeps a background command's stdin open)."""

    def __init__(self, terminal: tuple[int, int] | None = None) -> None:
        self.terminal = terminal
        read, self.writer = os.pipe2(os.O_CLOEXEC)
        self.stdin_fd: int | None = read if terminal is None else None
        self._read = read
        self.master: int | None = None

    def started(self) -> Mapping[str, Any]:
        return {"background": True}

    def spawned(self) -> None:
        os.close(self._read)

    def on_terminal(self, master: int, resize: Any = None) -> None:
        self.master = master
        if resize is not None:  # a terminal that is not the host's (a VM's): resized by the backend
            resize(100, 30)
        else:
            fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
        os.write(master, b"stty size; echo typed-$((6*7)); exit 5\n")

    def finished(self) -> Mapping[str, Any]:
        return {"stdin_bytes": 0}


def test_commands_with_open_stdin_and_terminals_or_a_clear_refusal(sb: Hosts) -> None:
    box = sb.create()
    pipe = Pipe()
    if not sb.caps.has("background"):
        with pytest.raises(UnsupportedOption, match="interactive"):
            box.exec(["cat"], attach=pipe)
        assert box.exec("echo fine").stdout == b"fine\n"  # nothing was left half done
        return
    # bounded: a backend that never hands the command its input must fail here, never hang
    threading.Timer(0.3, lambda: (os.write(pipe.writer, b"kept open\n"), os.close(pipe.writer))).start()
    res = box.exec(ExecRequest(["cat"], timeout=60), attach=pipe)
    assert (res.exit_code, res.stdout) == (0, b"kept open\n")
    term = Pipe(terminal=(80, 24))
    if not sb.caps.has("interactive"):
        with pytest.raises(UnsupportedOption, match="terminal"):
            box.exec(["sh"], attach=term)
        os.close(term.writer)
        assert box.exec("echo fine").stdout == b"fine\n"
        return
    res = box.exec(ExecRequest(["sh"], timeout=60), attach=term)
    assert b"30 100\r\ntyped-42\r\n" in res.stdout, res.stdout  # resized, and its output a terminal's
    assert res.exit_code == 5
    assert term.master is not None
    os.close(term.master)
    os.close(term.writer)


def test_ports_or_a_clear_refusal(sb: Hosts) -> None:
    box = sb.create()
    if not sb.caps.has("ports"):
        with pytest.raises(UnsupportedOption, match="ports"):
            box.connect_port(9, 5.0)
        return
    with pytest.raises(ConnectionRefusedError):  # the sandbox's own loopback: nothing listens on 9
        box.connect_port(9, 5.0)
    box.exec(f"nohup python3 -c {shlex.quote(ECHO_SERVER)} >/dev/null 2>&1 &")
    sock = _connect_when_listening(box, 7007)
    try:
        sock.setblocking(True)
        sock.settimeout(60)
        blob = os.urandom(1 << 20)  # several windows of the VM's relay each way
        sender = threading.Thread(target=lambda: (sock.sendall(blob), sock.shutdown(socket.SHUT_WR)))
        sender.start()
        got = bytearray()
        while chunk := sock.recv(1 << 16):  # the server's end of output follows ours (a half close)
            got += chunk
        sender.join(60)
        assert hashlib.sha256(got).hexdigest() == hashlib.sha256(b"echo:" + blob).hexdigest()
    finally:
        sock.close()


# answers "echo:" and then what it reads, until its end of input; one connection
ECHO_SERVER = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 7007)); s.listen(1)
c, _ = s.accept(); c.sendall(b"echo:")
while data := c.recv(65536):
    c.sendall(data)
c.shutdown(socket.SHUT_WR); c.close()
"""


def _connect_when_listening(box: Sandbox, port: int) -> socket.socket:
    """The server was started in the background: refused until it listens (within 60 s)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return box.connect_port(port, 5.0)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


# -- pause and resume ---------------------------------------------------------------------------------
@pytest.mark.parametrize("reclaim", [False, True])
def test_pause_stops_every_process_and_resume_goes_on(sb: Hosts, reclaim: bool) -> None:
    box = sb.create()
    box.exec("nohup sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/c.new; mv /tmp/c.new /tmp/count; "
             "sleep 0.1; done' >/dev/null 2>&1 &")
    time.sleep(0.5)
    paused = box.pause(reclaim=reclaim)
    assert box.state.status == "paused"
    assert "receipt" in paused
    with pytest.raises(SandboxStateError):
        box.exec("true")
    box.resume()
    assert box.state.status == "running"
    first = int(box.read("/tmp/count"))
    time.sleep(1.0)
    assert int(box.read("/tmp/count")) > first, "the sandbox's processes did not go on after the resume"
    actions = [r["action"] for r in box.receipts()]
    assert actions[-4:].count("pause") == 1
    assert "resume" in actions


# -- checkpoint and restore ----------------------------------------------------------------------------
def test_checkpoint_restores_on_a_second_host_with_its_options(sb: Hosts) -> None:
    box = sb.create(sb.options.replace(env={"WHO": "kept"}, labels={"team": "a"}))
    box.write("/root/state.txt", b"before the checkpoint\n")
    box.exec("rm -f /etc/motd")
    ckpt = run(box.checkpoint())
    assert ckpt.digest
    box.write("/root/state.txt", b"after\n")
    copy = run(sb.second.restore(ckpt.digest))
    sb.made.append(copy)
    assert copy.state.options.isolation == sb.kind
    assert copy.read("/root/state.txt") == b"before the checkpoint\n"
    assert copy.exec("test -e /etc/motd; echo $?").stdout == b"1\n"  # a deletion is carried too
    assert copy.exec("echo $WHO").stdout == b"kept\n"
    assert copy.state.labels["team"] == "a"
    assert any(r.get("inherited") for r in copy.receipts())  # its history travels with it
    restore = next(r for r in copy.receipts() if r["action"] == "restore")
    assert restore["ref"] == ckpt.digest


def test_memory_checkpoints_or_a_clear_refusal(sb: Hosts) -> None:
    box = sb.create()
    if not sb.caps.has("memory_checkpoint"):
        with pytest.raises(UnsupportedOption, match="memory"):
            run(box.checkpoint(memory=True))
        assert "checkpoint" not in [r["action"] for r in box.receipts()]
        return
    box.exec("nohup sh -c 'echo $$ > /dev/shm/pid; sleep 600' >/dev/null 2>&1 &")
    time.sleep(0.3)
    pid = box.read("/dev/shm/pid")
    ckpt = run(box.checkpoint(memory=True))
    copy = run(sb.second.restore(ckpt.digest))
    sb.made.append(copy)
    assert copy.read("/dev/shm/pid") == pid  # RAM came back: a tmpfs is not on the disk
    assert copy.exec(f"kill -0 {int(pid)} && echo alive").stdout == b"alive\n"


# -- limits ---------------------------------------------------------------------------------------------
def test_memory_and_disk_limits_hold(sb: Hosts) -> None:
    box = sb.create()
    hog = box.exec(["python3", "-c", "b = bytearray(600 << 20); print('allocated')"], timeout=120)
    assert hog.exit_code != 0
    assert b"allocated" not in hog.stdout
    fill = box.exec("dd if=/dev/zero of=/root/fill bs=1M count=400 2>&1; echo rc=$?", timeout=120)
    assert b"No space left on device" in fill.stdout
    assert box.exec("rm -f /root/fill && echo still").stdout == b"still\n"


# -- crash recovery ---------------------------------------------------------------------------------------
def test_a_new_manager_adopts_what_runs_and_takes_back_what_died(sb: Hosts) -> None:
    alive, dead = sb.create(), sb.create()
    alive.write("/root/kept", b"across the restart")
    _kill(dead.state.pid)  # its main process dies while "the manager is down"
    for backend in sb.first.all_backends():  # the old manager's process is gone: so are its connections
        backend.close()
    restarted = SandboxManager(sb.first.data_dir, sb.first.store_url)
    report = restarted.reconcile()
    assert alive.id in report["adopted"], report
    assert dead.id in report["destroyed"], report
    again = restarted.get(alive.id)
    assert again.read("/root/kept") == b"across the restart"
    assert again.exec("echo adopted").stdout == b"adopted\n"
    with pytest.raises(SandboxNotFound):
        restarted.get(dead.id)
    assert not dead.dir.exists()
    restarted.destroy(alive.id)
    sb.made = [b for b in sb.made if b.id not in (alive.id, dead.id)]


def test_destroy_takes_everything_back(sb: Hosts) -> None:
    box = sb.create(sb.options.replace(network=[]))
    st = box.state
    assert st.network is not None
    box.destroy()
    sb.made.remove(box)
    assert not box.dir.exists()
    assert kmount.mounts_under(box.dir) == []
    assert not [d for d in sb.first.layout.dirs(st.cgroups_path) if d.exists()]
    assert box.id not in sb.first.net.list()
    assert box.id not in sb.first.uid_ranges.owners()
    assert box.id not in sb.first.uid_jails.owners()
    assert box.receipts()[-1]["action"] == "destroy"
    box.destroy()  # again: nothing left, nothing raised
