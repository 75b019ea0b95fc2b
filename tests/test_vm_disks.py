"""A microVM sandbox's own disk: the empty qcow2 overlay made over its backing (sandbox.backends.vm.qemu)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from sandbox.backends.vm import qemu

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
