"""The stock ``e2b`` SDK on a microVM: the same calls as on a container (tests/test_e2b_commands.py).

The operator makes the template the E2B way (tests/support/e2b.py ``make_template``), but from a
sandbox started with ``isolation: microvm``: the checkpoint carries that isolation, so an E2B
create of ``base-vm`` boots a microVM without any new field.  One edge and one template for the
module (QEMU under TCG is slow); each sandbox starts from the template's checkpoint.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator

import pytest
from e2b import (
    CommandExitException,
    FileType,
    InvalidArgumentException,
    NotFoundException,
    PtySize,
    Sandbox,
    SandboxException,
)
from support.e2b import ALPHA, E2bEdge, e2b_edge
from support.edges import http
from support.sandboxes import store_url  # noqa: F401  (a module's store with the fixture image)

pytestmark = [pytest.mark.usefixtures("need_root"),
              pytest.mark.root("erofs", "overlay", "cmd:qemu-system-x86_64")]

VM_TEMPLATE = "base-vm"
VM = {"isolation": "microvm", "memory": 384 << 20, "disk": 256 << 20}


@pytest.fixture(scope="module")
def served(store_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2bEdge]:  # noqa: F811
    with e2b_edge(tmp_path_factory.mktemp("e2b-vm"), store_url, name="e2b-vm", template=VM_TEMPLATE, **VM) as edge:
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


def test_a_terminal_on_a_microvm_is_refused_naming_what_is_missing(vm: Sandbox) -> None:
    with pytest.raises(InvalidArgumentException, match="terminal"):
        vm.pty.create(PtySize(rows=24, cols=80))


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


def test_files_errors_the_sdk_maps_and_watching_refused(vm: Sandbox) -> None:
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
    with pytest.raises(SandboxException, match="no watch"):
        vm.files.watch_dir("/home/user")
    vm.files.remove("plain")


def test_a_paused_microvm_goes_to_the_store_and_resumes_with_its_processes(served: E2bEdge) -> None:
    box = Sandbox.create(VM_TEMPLATE, timeout=600)
    try:
        box.commands.run("n=0; while true; do n=$((n+1)); echo $n > /tmp/n; sleep 0.1; done", background=True,
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
