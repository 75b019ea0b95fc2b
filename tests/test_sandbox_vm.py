"""Full-VM sandboxes (``isolation="vm"``): QEMU's q35 machine under TCG, PCI virtio devices, the
same agent, templates, checkpoints and edge as microVMs; and images that bring their own kernel.

Each of the two kernels boots one template on the first host; the second host maps both from
the store, so the module boots twice (~15 and ~20 s under TCG) and restores everything else.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from support.sandboxes import REF, run, store_url  # noqa: F401  (the module's store)

from layerstore.store import Store
from sandbox.backends.vm import assets as vmassets
from sandbox.core.errors import InvalidField, UnsupportedOption
from sandbox.core.model import SandboxOptions
from sandbox.host.manager import SandboxManager
from tests.support.hosts import publish_sync
from tests.support.vmkernel import kernel_tree

pytestmark = [pytest.mark.usefixtures("need_root"), pytest.mark.root("erofs", "overlay", "cmd:qemu-system-x86_64")]

VM = SandboxOptions(isolation="vm", memory=384 << 20, disk=256 << 20)
KERNEL_REF = "img/python-own-kernel"


def qemu_pids() -> set[int]:
    out = subprocess.run(["pgrep", "-f", "qemu-system-x86_64"], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def _publish_tree(url: str, work: Path, tree: Path, name: str, composed: str) -> None:
    publish_sync(url, work, str(tree), name)

    async def compose() -> None:
        async with await Store.open(url, work) as s:
            await s.compose(composed, {"base": REF, "toolkit": name})

    run(compose())


@pytest.fixture(scope="module")
def own_kernel(store_url: str, tmp_path_factory: pytest.TempPathFactory) -> str:  # noqa: F811
    """The fixture image with Debian's newest cloud kernel installed in it; its version."""
    tree, version = kernel_tree()
    _publish_tree(store_url, tmp_path_factory.mktemp("kpub"), tree, "kernels/cloud", KERNEL_REF)
    return version


@pytest.fixture(scope="module")
def hosts(store_url: str, tmp_path_factory: pytest.TempPathFactory) -> Any:  # noqa: F811
    before = qemu_pids()
    made = []
    for name in ("q35-host1", "q35-host2"):
        mgr = SandboxManager(tmp_path_factory.mktemp(name), store_url)
        mgr.host.daemon_options = {"fill_below": 0}  # what is fetched, the guests read
        made.append(mgr)
    try:
        yield made
    finally:
        for mgr in made:
            for st in mgr.list():
                mgr.destroy(st.id)
            mgr.close()
        assert qemu_pids() - before == set(), "a VMM outlived its manager"
        for mgr in made:
            assert not [d for d in mgr.layout.dirs("/" + mgr.cgroup_parent) if d.exists()]
            assert not [line for line in Path("/proc/mounts").read_text().splitlines() if str(mgr.data_dir) in line]


def test_full_vm_through_the_edge_checkpoints_with_memory_and_goes_on_on_a_second_host(hosts: Any) -> None:
    from sandbox.sdk import AsyncClient, AsyncSandbox, InvalidRequest
    from tests.support.sandboxes import no_sandboxes_left, serving

    host1, host2 = hosts
    token = "q35-token-0123456789abcdef"
    tokens = {"projects": {"q35": {"tokens": [token], "max_sandboxes": 4}}}
    result: dict[str, Any] = {}

    async def scenario(url: str) -> None:
        async with AsyncClient(url=url, token=token) as client:
            caps = await client.capabilities()
            assert {"microvm", "vm"} <= set(caps.isolation)
            assert caps.backends["vm"]["machine"] == "q35"
            assert caps.backends["microvm"]["machine"] == "microvm"
            assert "image_kernel" in caps.backends["vm"]["provides"]
            assert "image_kernel" not in caps.backends["microvm"]["provides"]
            # the image's kernel is a full VM's only: the SDK refuses it, and so does the edge (a
            # raw request), naming the field
            with pytest.raises(InvalidField, match="kernel"):
                await AsyncSandbox.create(REF, url=url, token=token, isolation="microvm", kernel="image")
            for body in ({"isolation": "microvm", "kernel": "image"}, {"isolation": "vm", "kernel": "/boot/x"}):
                with pytest.raises(InvalidRequest, match="kernel"):
                    await client._http.json("POST", "/v1/sandboxes", json_body={"image": REF, **body})
        sb = await AsyncSandbox.create(REF, url=url, token=token, isolation="vm", memory=384 << 20,
                                       disk=256 << 20)
        try:
            assert (await sb.refresh()).isolation == "vm"
            seen: list[str] = []
            # a PC: PCI devices (the virtio disks, NIC, console, balloon) where a microvm has none
            res = await sb.commands.run("ls /sys/bus/pci/devices | wc -l; echo streamed", on_stdout=seen.append)
            assert res.exit_code == 0
            assert int(res.stdout.split()[0]) >= 8, res.stdout
            assert "streamed" in "".join(seen)
            await sb.files.write("/root/f.txt", b"on a q35")
            # a terminal and a port, as on a container: the guest agent's pty and relayed connection
            screen: list[bytes] = []
            term = await sb.pty.create(80, 24, on_data=screen.append)
            await term.resize(100, 30)
            await term.send_stdin(b"stty size; exit 4\n")
            assert (await term.wait()).exit_code == 4
            assert b"30 100\r\n" in b"".join(screen), b"".join(screen)
            await sb.commands.run(["bash", "-c", "echo q35-served > /tmp/i.txt; nohup python3 -m http.server 8000 "
                                   "--directory /tmp --bind 127.0.0.1 >/dev/null 2>&1 & for i in $(seq 600); do "
                                   "(exec 3<>/dev/tcp/127.0.0.1/8000) 2>/dev/null && exit 0; sleep 0.1; done; exit 1"],
                                  check=True)
            async with aiohttp.ClientSession() as web, web.get(
                    sb.port_url(8000, "/i.txt"), headers={"Authorization": f"Bearer {token}"}) as resp:
                assert (resp.status, await resp.text()) == (200, "q35-served\n")
            # RAM only: it comes back on another host only if the memory does
            assert (await sb.commands.run("echo in-ram > /dev/shm/mark")).exit_code == 0
            await sb.pause()
            assert (await sb.refresh()).status == "paused"
            await sb.resume()
            assert (await sb.commands.run("cat /root/f.txt /dev/shm/mark")).stdout == "on a q35in-ram\n"
            ckpt = await sb.checkpoint(memory=True)
            result["checkpoint"] = ckpt.digest
        finally:
            await sb.kill()

    with no_sandboxes_left(host1), serving(host1, tokens) as srv:
        run(scenario(srv.url))
    assert host2.host.client.health() is None  # nothing ran there yet: every byte comes from the store
    with pytest.raises(UnsupportedOption, match="isolation=vm"):  # a q35's state never loads into a microvm
        run(host2.restore(result["checkpoint"], SandboxOptions(isolation="microvm")))
    moved = run(host2.restore(result["checkpoint"]))
    try:
        assert moved.state.options.isolation == "vm"
        assert moved.state.vm["machine"] == "q35"
        assert moved.exec("cat /root/f.txt /dev/shm/mark").stdout == b"on a q35in-ram\n"
        rec = next(r for r in moved.receipts() if r["action"] == "restore" and not r.get("inherited"))
        assert rec["memory_restored"] is True, rec
        assert rec["isolation"] == "vm"
    finally:
        moved.destroy()
    # a new sandbox on the second host maps host 1's q35 template from the store: no boot there
    box = run(host2.create(REF, VM))
    try:
        rec = next(r for r in box.receipts() if r["action"] == "create")
        assert rec["template_source"] == "store", rec
        assert rec["vm"]["machine"] == "q35"
        assert box.exec("cat /root/f.txt").exit_code != 0  # a fresh disk
    finally:
        box.destroy()


def test_an_image_that_brings_its_own_kernel_boots_it(hosts: Any, own_kernel: str) -> None:
    host1, host2 = hosts
    _, layerbox_assets = host1.backend("microvm").prepare()
    assert own_kernel != layerbox_assets.manifest["kernel_version"], "pick an image kernel other than layerbox's"
    box = run(host1.create(KERNEL_REF, VM.replace(kernel="image")))
    try:
        assert box.exec("uname -r").stdout.decode().strip() == own_kernel
        rec = next(r for r in box.receipts() if r["action"] == "create")
        assert rec["vm"]["kernel_from"] == "image", rec
        assert rec["vm"]["kernel"] == own_kernel
        assert rec["vm"]["assets"] != layerbox_assets.key
        # its modules came from the image (Debian 6.12's are xz-compressed: decompressed on the host)
        assert box.exec("lsmod | grep -q '^erofs'; test -d /sys/module/overlay").exit_code == 0
        box.write("/root/kept", b"own kernel")
        ckpt = run(box.checkpoint())
    finally:
        box.destroy()
    # the checkpoint carries kernel=image: the second host builds the same set from its lazy
    # mount of the image and maps the template host 1 published
    moved = run(host2.restore(ckpt.digest))
    try:
        assert moved.state.options.kernel == "image"
        assert moved.exec("uname -r").stdout.decode().strip() == own_kernel
        assert moved.read("/root/kept") == b"own kernel"
        rec = next(r for r in moved.receipts() if r["action"] == "restore" and not r.get("inherited"))
        assert rec["template_source"] == "store", rec
    finally:
        moved.destroy()


def _fake_kernel_image(root: Path, version: str, *, module: str | None = None, boot_link: bool = False) -> Path:
    """A tree with a kernel file and a modules dir: ``module`` a symlink target for erofs.ko."""
    tree = root / "tree"
    moddir = tree / "usr/lib/modules" / version
    (moddir / "kernel/fs/erofs").mkdir(parents=True)
    if boot_link:
        os.symlink("/boot", tree / "boot")  # the host's /boot, were it followed
    else:
        (tree / "boot").mkdir()
        (tree / "boot" / f"vmlinuz-{version}").write_bytes(b"\x00" * 4096)
    (moddir / "modules.dep").write_text("kernel/fs/erofs/erofs.ko:\nkernel/fs/overlayfs/overlay.ko:\n")
    (moddir / "modules.builtin").write_text("kernel/drivers/virtio/virtio_pci.ko\nkernel/drivers/block/virtio_blk.ko\n"
                                            "kernel/drivers/char/virtio_console.ko\n")
    if module is not None:
        os.symlink(module, moddir / "kernel/fs/erofs/erofs.ko")
    return tree


@pytest.mark.parametrize("case", ["module-links-to-host", "boot-links-to-host", "no-kernel"])
def test_an_image_kernel_never_reads_host_files(hosts: Any, store_url: str, tmp_path: Path,  # noqa: F811
                                                case: str) -> None:
    host1, _ = hosts
    version = f"9.9.9-{case}"
    if case == "no-kernel":
        ref, want = REF, "no /vmlinuz"
    else:
        secret = tmp_path / "host-secret"
        secret.write_bytes(b"host only\n")
        tree = _fake_kernel_image(tmp_path, version, module=str(secret) if case == "module-links-to-host" else None,
                                  boot_link=case == "boot-links-to-host")
        ref = f"img/bad-kernel-{case}"
        _publish_tree(store_url, tmp_path / "pub", tree, f"kernels/{case}", ref)
        want = "symbolic links" if case == "module-links-to-host" else "vmlinuz"
    before = set((vmassets.DEFAULT_ROOT / vmassets.IMAGE_KERNELS).glob("*"))
    with pytest.raises(UnsupportedOption, match=want) as err:
        run(host1.create(ref, VM.replace(kernel="image")))
    assert str(err.value).startswith("kernel: ")  # the field, for the edge's 400
    assert set((vmassets.DEFAULT_ROOT / vmassets.IMAGE_KERNELS).glob("*")) == before  # no set was made
    assert host1.list() == []
    assert not [line for line in Path("/proc/mounts").read_text().splitlines() if ".kernel-" in line]


def test_kernel_field_grammar() -> None:
    with pytest.raises(InvalidField, match="kernel"):
        SandboxOptions(isolation="vm", kernel="vmlinuz")
    with pytest.raises(InvalidField, match="isolation=vm"):
        SandboxOptions(isolation="container", kernel="image")
    assert SandboxOptions.from_json({"isolation": "vm", "kernel": "image"}).kernel == "image"
    assert SandboxOptions(isolation="vm", kernel="image").carried()["kernel"] == "image"
