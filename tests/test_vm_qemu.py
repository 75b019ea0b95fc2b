"""The host side of a VMM (sandbox.backends.vm.qemu): a sandbox's own disk, the empty qcow2 overlay
made over its backing, and the start of its process."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from layerstore.objects import Resolved
from sandbox.backends.base import ACCOUNTS_PER_ROOTFS, process_defaults
from sandbox.backends.container.files import RootFiles
from sandbox.backends.vm import qemu
from sandbox.core.model import SandboxOptions

pytestmark = [pytest.mark.usefixtures("need_root"), pytest.mark.root("cmd:qemu-img")]


def _info(path: Path) -> dict[str, object]:
    out = subprocess.run(["qemu-img", "info", "--output=json", "-U", str(path)], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


def test_overlays_made_again_are_the_bytes_qemu_img_makes(tmp_path: Path) -> None:
    """The second overlay over one backing is written from the first one's bytes, not by qemu-img:
    it must be what qemu-img makes, name its backing as the VMM does, and pass qemu-img check."""
    backing = tmp_path / "templates" / "ext4-1.raw"
    backing.parent.mkdir()
    with open(backing, "wb") as f:
        f.truncate(64 << 20)
    owner = (os.getuid(), os.getgid())
    made = []
    for i in range(3):
        vm_dir = tmp_path / f"vm{i}"
        vm_dir.mkdir()
        qemu.sandbox_disk(str(backing), "raw", vm_dir / "disk.qcow2", 256 << 20, owner)
        made.append(vm_dir / "disk.qcow2")
    fresh = tmp_path / "fresh.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-u", "-F", "raw", "-b", str(backing),
                    str(fresh), str(256 << 20)], check=True)
    for path in made:
        assert path.read_bytes() == fresh.read_bytes()
        assert path.stat().st_mode & 0o777 == 0o600
        info = _info(path)
        assert (info["virtual-size"], info["backing-filename"], info["backing-filename-format"]) == \
            (256 << 20, str(backing), "raw")
        subprocess.run(["qemu-img", "check", "-q", str(path)], check=True)
    # another size is another overlay
    other = tmp_path / "vm-other"
    other.mkdir()
    qemu.sandbox_disk(str(backing), "raw", other / "disk.qcow2", 128 << 20, owner)
    assert _info(other / "disk.qcow2")["virtual-size"] == 128 << 20


def test_an_overlay_over_a_file_of_its_own_vm_names_it_relative(tmp_path: Path) -> None:
    """A checkpoint's chain lives in the VM's directory: its overlay names the backing by its
    name alone (the VMM's chroot), each VM's own, never one remembered from another VM."""
    owner = (os.getuid(), os.getgid())
    for i in range(2):
        vm_dir = tmp_path / f"vm{i}"
        vm_dir.mkdir()
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(vm_dir / "disk-0.qcow2"), str(64 << 20)],
                       check=True)
        qemu.sandbox_disk(str(vm_dir / "disk-0.qcow2"), "qcow2", vm_dir / "disk.qcow2", 64 << 20, owner)
        info = _info(vm_dir / "disk.qcow2")
        assert (info["backing-filename"], info["backing-filename-format"]) == ("disk-0.qcow2", "qcow2")


def test_a_vmm_that_cannot_join_its_cgroup_is_an_error_at_once_naming_it(tmp_path: Path) -> None:
    """The VMM's process joins the sandbox's cgroups before it execs QEMU (a shell writes its pid):
    when it cannot, asking for its monitor fails at once, quoting why, not after the 30 s wait."""
    missing = tmp_path / "gone" / "cgroup.procs"
    vmm = qemu.Vmm.spawn(tmp_path, ["sleep", "60"], [missing])
    try:
        t = time.monotonic()
        with pytest.raises(qemu.VmError, match="exited before it listened") as err:
            vmm.qmp(timeout=30.0)
        assert time.monotonic() - t < 10
        assert "cgroup.procs" in str(err.value)  # the shell's own message, from vmm.log
    finally:
        vmm.kill()
    assert not vmm.alive()


def test_a_vmm_joins_the_cgroup_it_is_given_before_its_exec(tmp_path: Path) -> None:
    """The same pid throughout (nsenter, sh, then the program), in the cgroup from its start."""
    procs = tmp_path / "procs"
    procs.write_text("")
    vmm = qemu.Vmm.spawn(tmp_path, ["sleep", "60"], [procs])
    try:
        deadline = time.monotonic() + 10
        while procs.read_text().strip() != str(vmm.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert procs.read_text().strip() == str(vmm.pid)
        while Path(f"/proc/{vmm.pid}/comm").read_text().strip() != "sleep" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert Path(f"/proc/{vmm.pid}/comm").read_text().strip() == "sleep"
        assert vmm.alive()
    finally:
        vmm.kill()


def test_the_users_a_vm_backend_remembers_per_rootfs_are_bounded_and_each_right(tmp_path: Path) -> None:
    """process_defaults remembers users per rootfs for guests fresh from a template; any numeric
    uid is a user a tenant may ask for, so what it remembers is bounded, and past the bound a
    user is read again, still right."""
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "passwd").write_text("root:x:0:0::/root:/bin/sh\nagent:x:1000:1001::/home/agent:/bin/sh\n")
    (root / "etc" / "group").write_text("root:x:0:\n")
    files = RootFiles(root)
    resolved = Resolved("blake3:" + "0" * 64, "image", (), {}, {})
    accounts: dict[str, tuple[int, int, str]] = {}
    for uid in range(5000, 5000 + ACCOUNTS_PER_ROOTFS + 20):
        got = process_defaults(files, resolved, SandboxOptions(user=str(uid)), accounts)
        assert (got.uid, got.gid, got.env["HOME"]) == (uid, uid, "/")
    assert len(accounts) == ACCOUNTS_PER_ROOTFS
    agent = process_defaults(files, resolved, SandboxOptions(user="agent"), accounts)
    assert (agent.uid, agent.gid, agent.env["HOME"]) == (1000, 1001, "/home/agent")
    assert "agent" not in accounts
