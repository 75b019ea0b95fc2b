"""MicroVMs of every memory size, and a guest whose PID 1 fails: real QEMU (TCG here), the real guest.

Each size is a template of its own (its RAM is part of the shape a restore must match), so the
sizes share one manager and one store: four template boots of ~4-6 s under TCG, one create and
one exec each.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from support.sandboxes import REF, run, store_url, vm_host  # noqa: F401  (the module's store)

from sandbox.backends.vm import backend as microvm
from sandbox.backends.vm import qemu as vm
from sandbox.core.errors import UnsupportedOption
from sandbox.core.model import SandboxOptions
from sandbox.host.manager import SandboxManager

pytestmark = [pytest.mark.usefixtures("need_root"), pytest.mark.root("erofs", "overlay", "cmd:qemu-system-x86_64")]

MiB = 1 << 20


@pytest.fixture(scope="module")
def vm_manager(store_url: str, tmp_path_factory: pytest.TempPathFactory) -> Any:  # noqa: F811
    with vm_host(store_url, tmp_path_factory, "vm-sizes") as mgr:
        yield mgr
    assert not [d for d in mgr.layout.dirs("/" + mgr.cgroup_parent) if d.exists()]


def _host_memory() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


@pytest.mark.parametrize("size", [64 * MiB, 512 * MiB, 1024 * MiB, 4096 * MiB], ids=lambda s: f"{s >> 20}MiB")
def test_a_microvm_of_each_size_creates_and_runs(vm_manager: SandboxManager, size: int) -> None:
    assert size + vm.VMM_OVERHEAD <= _host_memory(), "this host is too small for the sizes the suite tests"
    box = run(vm_manager.create(REF, SandboxOptions(isolation="microvm", memory=size, disk=256 * MiB)))
    try:
        shape = box.state.vm["shape"]
        assert shape["memory"] == max(size, vm.MIN_GUEST_MEMORY)  # below the floor: the floor
        total_kb = int(box.exec("sed -n 's/^MemTotal: *\\([0-9]*\\) kB/\\1/p' /proc/meminfo").stdout)
        # the guest sees its RAM, less what the kernel keeps for itself (its image, struct pages)
        assert shape["memory"] * 0.9 - 48 * MiB < total_kb * 1024 <= shape["memory"]
        assert box.exec("python3 -c 'print(sum(range(10)))'").stdout == b"45\n"
        # its template is the one of its size, and the agent's scrub faulted in a bounded part of
        # it, not all of the guest's free RAM (which the template's memory file would then hold)
        template = vm_manager.backend("microvm").host_template(box.state.vm["template"])
        assert template is not None
        assert json.loads((template.dir / "template.json").read_text())["shape"] == shape
        allocated = template.memory.stat().st_blocks * 512
        assert allocated <= max(shape["memory"] // 2, 512 * MiB), f"{allocated} bytes of the memory file allocated"
    finally:
        box.destroy()
    assert not box.dir.exists()


def test_sizes_below_a_microvm_kernel_or_above_the_host_are_refused_naming_memory(
        vm_manager: SandboxManager) -> None:
    for size in (vm.MIN_MEMORY - MiB, _host_memory() + MiB):
        with pytest.raises(UnsupportedOption, match=r"^memory: "):
            run(vm_manager.create(REF, SandboxOptions(isolation="microvm", memory=size, disk=256 * MiB)))
    assert vm_manager.list() == []


def test_a_guest_whose_pid_1_fails_is_an_error_at_once_quoting_its_console(vm_manager: SandboxManager) -> None:
    """80 MiB of RAM is a shape no request makes (MIN_GUEST_MEMORY): the kernel boots, and its
    PID 1 (the init) runs out of memory in its first forks: the kernel panics, or the OOM killer
    leaves the init to say LB-FAIL.  The boot errors within seconds, not the 120 s boot timeout,
    quoting the console's failure."""
    backend = vm_manager.backend("microvm")
    assert isinstance(backend, microvm.VmBackend)

    async def resolve() -> Any:
        async with await vm_manager.open_store() as store:
            return await store.resolve(REF)

    resolved = run(resolve())
    _, assets = backend.prepare()
    shape = vm.Shape(vcpus=1, memory=80 * MiB, disk=256 * MiB)
    key = backend.template_key(resolved, shape, assets)
    t = time.monotonic()
    with pytest.raises(vm.VmError) as failed:
        backend.boot_template(resolved, shape, assets)
    took = time.monotonic() - t
    assert took < vm.BOOT_TIMEOUT / 3, f"the failed boot took {took:.1f} s"
    message = str(failed.value)
    assert "console.log: " in message
    assert "Kernel panic - not syncing" in message or "LB-FAIL " in message, message
    assert backend.host_template(key) is None  # nothing saved, nothing of the boot left
    assert not [p for p in backend.templates_dir.iterdir() if key in p.name and not p.name.endswith(".lock")]


def test_console_failure_quotes_the_panic_and_the_last_lines_without_the_dump(tmp_path: Path) -> None:
    console = tmp_path / "console.log"
    console.write_text("LB-READY 2.36 0.00\n"
                       "[   12.504005] Kernel panic - not syncing: System is deadlocked on memory\n"
                       "[   12.505233] CPU: 0 PID: 1 Comm: lb-agent Not tainted 6.12.0 #1\n"
                       "[   12.505233] Call Trace:\n"
                       "[   12.505233]  <TASK>\n"
                       "[   12.505233]  panic+0x118/0x2f4\n"
                       "[   12.505233]  out_of_memory.cold+0x2f/0x7e\n"
                       "[   11.815460] RDX: 0000000000000003 RSI: 0000000000800000 RDI: 0000000000000000\n"
                       "[   12.505233]  </TASK>\n"
                       "[   12.516434] Kernel Offset: 0x23e00000 from 0xffffffff81000000\n")
    said = vm.console_failure(console)
    assert said is not None
    assert said.startswith("[   12.504005] Kernel panic - not syncing: System is deadlocked on memory")
    assert "LB-READY" in said
    for dump in ("RDX", "panic+0x", "out_of_memory", "Kernel Offset"):
        assert dump not in said
    console.write_text("LB-READY 2.36 0.00\n")
    assert vm.console_failure(console) is None
    assert vm.console_failure(tmp_path / "absent") is None
