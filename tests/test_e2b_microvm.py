"""The stock ``e2b`` SDK on a microVM: the same calls as on a container (tests/test_e2b_commands.py).

The operator makes the template the E2B way (tests/support/e2b.py ``make_template``), but from a
sandbox started with ``isolation: microvm``: the checkpoint carries that isolation, so an E2B
create of ``base-vm`` boots a microVM without any new field.  One edge and one template for the
module (QEMU under TCG is slow); each sandbox starts from the template's checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from e2b import CommandExitException, InvalidArgumentException, PtySize, Sandbox
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
