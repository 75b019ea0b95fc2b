"""MicroVM sandboxes: real QEMU (TCG here), the real guest kernel and agent, lazily fetched layers.

One manager per module, so one template boot (~6 s under TCG) serves every test: each
sandbox after the first starts by restoring it.
"""
from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from support.memory import PeakRss
from support.sandboxes import REF, run, store_url, vm_host  # noqa: F401  (the module's store)

from sandbox.backends.vm import backend as microvm
from sandbox.backends.vm.agent import AgentMisbehaved
from sandbox.core.errors import SandboxStateError, UnsupportedOption
from sandbox.core.model import SandboxOptions
from sandbox.core.procs import proc_stat
from sandbox.host.manager import Sandbox, SandboxManager

pytestmark = [pytest.mark.usefixtures("need_root"), pytest.mark.root("erofs", "overlay", "cmd:qemu-system-x86_64")]

VM = SandboxOptions(isolation="microvm", memory=384 << 20, disk=256 << 20)


def qemu_pids() -> set[int]:
    out = subprocess.run(["pgrep", "-f", "qemu-system-x86_64"], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


@pytest.fixture(scope="module")
def vm_manager(store_url: str, tmp_path_factory: pytest.TempPathFactory) -> Any:  # noqa: F811
    before = qemu_pids()
    mgr = SandboxManager(tmp_path_factory.mktemp("vm-host1"), store_url)
    mgr.host.daemon_options = {"fill_below": 0}  # no background fill: what is fetched, the guests read
    try:
        yield mgr
    finally:
        mgr.close()
        assert qemu_pids() - before == set(), "a VMM outlived the manager"
        assert not [d for d in mgr.layout.dirs("/" + mgr.cgroup_parent) if d.exists()]


@pytest.fixture(scope="module")
def vm_host2(store_url: str, tmp_path_factory: pytest.TempPathFactory) -> Any:  # noqa: F811
    """A second host on the same store, its cache empty at first (one template boot for the module)."""
    with vm_host(store_url, tmp_path_factory, "vm-host2") as mgr:
        yield mgr


@pytest.fixture
def vms(vm_manager: SandboxManager) -> Any:
    made: list[Sandbox] = []

    def make(options: SandboxOptions = VM) -> Sandbox:
        box = run(vm_manager.create(REF, options))
        made.append(box)
        return box

    yield make
    for box in made:
        box.destroy()
        assert not box.dir.exists()


def test_create_exec_streams_and_files(vms: Any, vm_manager: SandboxManager) -> None:
    box = vms()
    st = box.state
    assert st.status == "running"
    assert st.vm is not None
    assert st.vm["accel"] in ("tcg", "kvm")
    vmm = st.vm["vmm_pid"]
    assert proc_stat(vmm) is not None
    assert vm_manager.layout.holds(vmm, st.cgroups_path)
    # QEMU's seccomp filter is on (-sandbox: no exec, no setuid) for a VMM a guest may take over
    assert "Seccomp:\t2" in Path(f"/proc/{vmm}/status").read_text()
    # a guest of its own: its kernel, not the host's
    uname = box.exec(["uname", "-r"])
    assert uname.exit_code == 0
    assert uname.stdout.decode().strip() != os.uname().release
    assert b"Debian GNU/Linux 12" in box.exec("cat /etc/os-release").stdout
    chunks: list[bytes] = []
    res = box.exec("for i in 1 2 3; do echo line$i; done; echo oops >&2; exit 7", on_stdout=chunks.append)
    assert (res.exit_code, res.stdout, res.stderr) == (7, b"line1\nline2\nline3\n", b"oops\n")
    assert b"".join(chunks) == res.stdout
    assert box.exec(["cat"], stdin=b"from the host\n" * 1000).stdout == b"from the host\n" * 1000
    missing = box.exec(["/no/such/program"])
    assert missing.exit_code == 127
    assert b"No such file" in missing.stderr
    # files: through the agent, the same API as a container's
    payload = os.urandom(3 << 20)
    assert box.upload("/root/blob", io.BytesIO(payload)) == len(payload)
    out = io.BytesIO()
    assert box.download("/root/blob", out) == len(payload)
    assert out.getvalue() == payload
    assert box.exec("sha256sum /root/blob").stdout.split()[0].decode() == __import__("hashlib").sha256(payload).hexdigest()
    box.write("/root/note.txt", b"hi", 0o600)
    names = {e["name"]: e for e in box.list("/root")}
    assert names["note.txt"]["size"] == 2
    assert names["note.txt"]["mode"] == 0o600
    assert names["blob"]["type"] == "file"
    assert box.stat("/root/blob").st_size == len(payload)
    box.remove("/root/blob")
    with pytest.raises(FileNotFoundError):
        box.read("/root/blob")
    with pytest.raises(OSError, match="absolute"):
        box.read("relative/path")
    actions = [r["action"] for r in box.receipts()]
    assert actions[0] == "create"
    assert "exec" in actions
    assert "upload" in actions
    create = box.receipts()[0]
    assert create["isolation"] == "microvm"
    assert create["vm"]["assets"] == st.vm["assets"]


def test_each_guest_from_a_template_runs_commands_as_the_user_its_own_rootfs_names(
        vms: Any, vm_manager: SandboxManager) -> None:
    """A guest restored from a template looks its users up once per document (the manager
    remembers them): sandboxes of one template with other users, and a checkpoint that
    added a user, each get their own user's ids, never another document's."""
    nobody = vms(VM.replace(user="nobody"))
    assert nobody.exec(["id", "-u"]).stdout == b"65534\n"
    root = vms()
    assert root.exec(["id", "-u"]).stdout == b"0\n"
    # the agent ignores SIGPIPE; a command starts with every signal at its default, as under crun
    assert root.exec(["grep", "SigIgn", "/proc/self/status"]).stdout == b"SigIgn:\t0000000000000000\n"
    assert root.exec("yes | head -n 1").stderr == b""
    root.exec("echo 'agentx:x:4242:4343::/home/agentx:/bin/sh' >> /etc/passwd")
    added = run(root.checkpoint())
    with pytest.raises(UnsupportedOption, match="agentx"):
        vms(VM.replace(user="agentx"))  # the image has no such user
    agent = run(vm_manager.restore(added.digest, user="agentx"))
    try:
        assert agent.exec(["id", "-u"]).stdout == b"4242\n"
        assert agent.exec(["id", "-g"]).stdout == b"4343\n"
        made = next(r for r in agent.receipts() if r["action"] == "restore" and not r.get("inherited"))
        assert made["template_source"] == "host"  # a template restore: the path that remembers users
    finally:
        agent.destroy()
    assert vms(VM.replace(user="nobody")).exec(["id", "-u"]).stdout == b"65534\n"
    # the VMM is in the sandbox's network namespace and cgroup (joined before QEMU's exec)
    vmm = root.state.vm["vmm_pid"]
    netns = vm_manager.resources.networks.manager.netns_path(root.id)
    assert os.stat(f"/proc/{vmm}/ns/net").st_ino == os.stat(netns).st_ino
    assert vm_manager.layout.holds(vmm, root.state.cgroups_path)


def _ids(pid: int) -> tuple[set[int], int]:
    """The uids and gids of process ``pid`` (real, effective, saved, fs) and its effective capabilities."""
    status = Path(f"/proc/{pid}/status").read_text()
    ids = {int(x) for key in ("Uid", "Gid") for x in re.search(rf"^{key}:(.*)$", status, re.M)[1].split()}  # type: ignore[index]
    return ids, int(re.search(r"^CapEff:\s*([0-9a-f]+)", status, re.M)[1], 16)  # type: ignore[index]


def test_each_vmm_is_jailed_as_a_uid_of_its_own(vms: Any, vm_manager: SandboxManager) -> None:
    a, b = vms(), vms()
    # from a pool of single uids (65,536 VMs, not one per user namespace range), which no
    # user-namespaced sandbox's range overlaps: a container's root is never a VMM's owner
    jails = vm_manager.uid_jails.owners()
    assert (vm_manager.uid_jails.size, vm_manager.uid_jails.slots) == (1, 65536)
    ranges = vm_manager.uid_ranges
    assert ranges.base(ranges.slots) <= min(jails.values())
    uids = []
    for box in (a, b):
        pid = box.state.vm["vmm_pid"]
        ids, caps = _ids(pid)
        assert len(ids) == 1, ids  # uid == gid, real == effective == saved: no way back to root
        (uid,) = ids
        assert uid != 0
        assert uid == jails[box.id]
        assert caps == 0
        assert os.readlink(f"/proc/{pid}/root") == str(box.dir / "vm")  # chrooted to its own directory
        vm_dir = box.dir / "vm"
        assert vm_dir.stat().st_uid == 0
        assert vm_dir.stat().st_mode & 0o777 == 0o711  # it cannot add, remove or swap a file there
        assert sorted(p.name for p in vm_dir.iterdir() if p.lstat().st_uid == uid) == ["disk.qcow2"]
        uids.append(uid)
    assert uids[0] != uids[1]
    # as the first VMM's uid (what a guest that took its QEMU over would be): the other VM's
    # disk, its process and the host's files are out of reach
    pid_b = b.state.vm["vmm_pid"]
    as_a = ["setpriv", f"--reuid={uids[0]}", f"--regid={uids[0]}", "--clear-groups", "--"]
    for target in (f"/proc/{pid_b}/root/disk.qcow2", str(b.dir / "vm" / "disk.qcow2"), "/etc/shadow"):
        got = subprocess.run([*as_a, "cat", target], capture_output=True, text=True)
        assert got.returncode != 0, target
        assert "Permission denied" in got.stderr, got.stderr
    assert subprocess.run([*as_a, "kill", "-0", str(pid_b)], capture_output=True).returncode != 0
    assert a.exec("echo still here").stdout == b"still here\n"


def test_timeout_output_cap_and_a_real_test_suite(vms: Any) -> None:
    box = vms()
    t = time.monotonic()
    slow = box.exec("echo started; sleep 60", timeout=2)
    assert slow.timed_out
    assert slow.signal == signal.SIGKILL
    assert slow.stdout == b"started\n"
    assert time.monotonic() - t < 30
    assert b"sleep 60" not in box.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").stdout
    big = box.exec("head -c 5000000 /dev/zero", output_cap=1000)
    assert big.truncated
    assert len(big.stdout) == 1000
    box.write("/root/test_demo.py", b"import unittest\n"
              b"class T(unittest.TestCase):\n"
              b"    def test_math(self):\n        self.assertEqual(sum(range(10)), 45)\n"
              b"    def test_fs(self):\n        open('/tmp/x', 'w').write('y'); self.assertEqual(open('/tmp/x').read(), 'y')\n")
    suite = box.exec(["python3", "-m", "unittest", "-v", "test_demo"], cwd="/root", timeout=120)
    assert suite.exit_code == 0, suite.stderr
    assert b"Ran 2 tests" in suite.stderr
    assert b"OK" in suite.stderr


def test_sandboxes_of_one_template_are_apart_and_fetch_lazily(vms: Any, vm_manager: SandboxManager) -> None:
    a, b = vms(), vms()
    assert a.state.vm["template"] == b.state.vm["template"]
    assert b.receipts()[0]["template_made"] is False  # the second restores the template
    # a new sandbox's template had its disk mounted before the save, and each sandbox's disk
    # stands on that very file; the same boot saved the kind a checkpoint's restore takes
    backend = vm_manager.backend("microvm")
    template = backend.host_template(a.state.vm["template"])
    assert template is not None
    assert template.mounted
    assert [tuple(x) for x in a.state.vm["disk_nodes"]][0] == (str(template.disk), "raw")
    kinds = [json.loads(p.read_text())["disk"] for p in backend.templates_dir.glob("*/template.json")]
    assert sorted(kinds) == ["mounted", "placeholder"], kinds
    # both start from the template's memory, kernel RNG included: the agent reseeds it on MOUNT
    # (without that, these were the same 16 bytes in every sandbox of a template, and so was
    # every seed a program took from them)
    draws = [box.exec("head -c 16 /dev/urandom | od -An -tx1").stdout for box in (a, b)]
    assert len(draws[0].split()) == 16
    assert draws[0] != draws[1], "two sandboxes of one template drew the same random bytes"
    a.write("/root/mine", b"a")
    assert b.exec("test -e /root/mine").exit_code == 1
    assert a.exec("cat /root/mine").stdout == b"a"
    stats = vm_manager.host.client.request("GET", "/stats")
    fetched = stats["bytes_fetched_uncompressed"]
    sizes = [os.stat(m).st_size for m, _ in (tuple(x) for x in a.state.vm["layers"])]
    blobs = sum(os.stat(bl).st_size for _, bl in (tuple(x) for x in a.state.vm["layers"]))
    assert sizes
    assert fetched < blobs / 2, f"fetched {fetched} of {blobs} blob bytes: not lazy"


def test_pause_with_reclaim_goes_to_the_store_and_resumes_here_or_elsewhere(
        vms: Any, store_url: str, tmp_path: Path) -> None:  # noqa: F811
    box = vms()
    box.exec("nohup sh -c 'i=0; while true; do i=$((i+1)); echo $i > /root/c.tmp; mv /root/c.tmp /root/count; sleep 0.2; done' "
             ">/dev/null 2>&1 &")
    time.sleep(1)
    box.write("/root/before", b"kept")
    vmm = box.state.vm["vmm_pid"]
    light = box.pause(reclaim=False)
    assert light["reclaim"] is None
    assert proc_stat(vmm) is not None
    box.resume()
    box.exec("echo in-ram > /dev/shm/mark")
    info = box.pause(reclaim=True)
    # the host keeps nothing of the VM: no VMM, no disk file, no mount; the store has all of it
    assert proc_stat(vmm) is None or proc_stat(vmm)[1] != box.state.vm.get("vmm_start")
    assert box.state.status == "paused"
    assert box.state.vm["saved"] == "store"
    assert box.state.vm["paused_checkpoint"] == info["reclaim"]["digest"]
    assert not list((box.dir / "vm").glob("disk*"))
    assert not [line for line in Path("/proc/mounts").read_text().splitlines() if str(box.dir) in line]
    with pytest.raises(Exception, match="paused"):
        box.exec("true")
    # another host goes on from the pause: the same processes, the same RAM-only file
    other = SandboxManager(tmp_path / "elsewhere", store_url)
    try:
        elsewhere = run(other.restore(info["reclaim"]["digest"]))
        try:
            assert elsewhere.read("/dev/shm/mark") == b"in-ram\n"
            first = int(elsewhere.read("/root/count"))
            time.sleep(1.5)
            assert int(elsewhere.read("/root/count")) > first, "the guest's loop did not go on on the other host"
        finally:
            elsewhere.destroy()
    finally:
        other.close()
    box.resume()
    assert box.state.status == "running"
    assert box.state.vm["saved"] is False
    assert box.read("/root/before") == b"kept"
    assert box.read("/dev/shm/mark") == b"in-ram\n"
    first = int(box.read("/root/count"))
    time.sleep(1.5)
    assert int(box.read("/root/count")) > first, "the guest's loop did not go on after the resume"
    resumed = [r for r in box.receipts() if r["action"] == "resume"]
    assert resumed[-1]["checkpoint"] == info["reclaim"]["digest"]
    # and it pauses again, as a delta over the chain it was resumed on
    again = box.pause(reclaim=True)
    assert again["reclaim"]["bytes_uploaded"] < info["reclaim"]["bytes_uploaded"]
    box.resume()
    assert box.read("/root/before") == b"kept"


def test_guest_that_exhausts_memory_forks_and_fills_its_disk_stays_inside(vms: Any, vm_manager: SandboxManager) -> None:
    box = vms()
    st = box.state
    # 8 GiB of a 384 MiB guest: refused by the guest's own kernel (its overcommit heuristic), so
    # the host never sees it.  (Touching pages until the guest's OOM killer acts takes minutes
    # of reclaim under TCG: bench/vm.py territory.)
    hog = box.exec(["python3", "-c", "bytearray(8 << 30)"], timeout=120)
    assert hog.exit_code == 1
    assert b"MemoryError" in hog.stderr
    # the file system's every free block, reserved at once (no 256 MB written under TCG)
    fill = box.exec("fallocate -l 400M /root/fill 2>&1; fallocate -l 250M /root/fill 2>&1; "
                    "head -c 20000000 /dev/zero > /root/more 2>&1; sync", timeout=180)
    assert b"No space left on device" in fill.stdout
    disk = box.dir / "vm" / "disk.qcow2"
    assert disk.stat().st_blocks * 512 < (256 << 20) + (64 << 20)
    bomb = box.exec("for i in $(seq 1 120); do sleep 5 & done 2>/dev/null; echo forked", timeout=120)
    assert bomb.exit_code in (0, 1, 2)
    host_pids = vm_manager.layout.pids_current(st.cgroups_path)
    assert host_pids is not None
    assert host_pids <= 64, f"the VMM's cgroup has {host_pids} tasks"
    peak = vm_manager.layout.memory_peak(st.cgroups_path)
    assert peak is None or peak <= st.vm["shape"]["memory"] + (256 << 20)
    box.exec("rm -f /root/fill")
    assert box.exec("echo alive").stdout == b"alive\n"


def test_without_a_network_the_nic_leads_nowhere_and_shapes_past_the_host_are_refused(
        vms: Any, vm_manager: SandboxManager) -> None:
    box = vms()
    devs = box.exec("cat /proc/net/dev").stdout.decode()
    assert sorted(ln.split(":")[0].strip() for ln in devs.splitlines()[2:]) == ["eth0", "lo"]
    routes = box.read("/proc/net/route").decode().splitlines()[1:]
    assert routes == []  # no address, no route: nothing to send to
    st = box.state
    assert st.network is None
    # the VMM runs in a namespace of its own with nothing but the tap (and lo)
    links = subprocess.run(["nsenter", f"--net={vm_manager.net.netns_path(box.id)}", "ip", "-o", "link"],
                           capture_output=True, text=True, check=True).stdout
    assert sorted(ln.split(":")[1].strip().split("@")[0] for ln in links.splitlines()) == ["lo", "tap0"]
    with pytest.raises(UnsupportedOption, match="cpu"):
        run(vm_manager.create(REF, VM.replace(cpu=float((os.cpu_count() or 1) + 1))))


def test_block_checkpoint_restores_on_a_second_host_with_an_empty_cache(
        vms: Any, vm_host2: SandboxManager, store_url: str, tmp_path: Path,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    box = vms()
    payload = os.urandom(5 << 20)
    box.upload("/root/work.bin", io.BytesIO(payload))
    box.exec("mkdir -p /opt/tool && echo v1 > /opt/tool/version && rm -f /etc/motd")
    first = run(box.checkpoint())
    assert first.bytes_changed >= len(payload)
    doc = run(_doc(store_url, tmp_path, first.digest))
    assert doc["bound"]["disk"] == "block"
    assert doc["bound"]["isolation"] == "microvm"
    assert doc["disk"]["digest"] == first.layer
    assert [x["digest"] for x in doc["layers"]] == list(box.state.layer_digests)  # the image's, bound
    # a second checkpoint is the clusters written since the first (a qcow2 delta over its disk)
    box.write("/root/small", b"x" * 1000)
    second = run(box.checkpoint())
    assert second.bytes_uploaded < len(payload) / 2, second
    assert second.bytes_changed < len(payload) / 2, second  # what was read: the delta, not the disk
    doc2 = run(_doc(store_url, tmp_path, second.digest))
    assert [x["digest"] for x in doc2["disk_base"]] == [first.layer]
    assert doc2["bound"]["disk_chain"] == [first.layer, second.layer]
    assert box.exec("cat /root/small").stdout == b"x" * 1000  # the guest went on after the freeze
    # the overlay the second checkpoint froze was merged into the one under it: this VM's own
    # files stay two (its first overlay and the one it writes), over its template's disk
    nodes = box.state.vm["disk_nodes"]
    assert len(nodes) == 3, nodes
    assert sum(1 for p, _ in nodes if Path(p).parent == box.dir / "vm") == 2
    assert len(list((box.dir / "vm").glob("disk*.qcow2"))) == 2
    assert box.read("/root/work.bin") == payload
    host2 = vm_host2
    assert host2.host.client.health() is None  # nothing ran there yet: every byte comes from the store
    restored = run(host2.restore(second.digest))
    try:
        assert restored.state.options.isolation == "microvm"
        assert restored.read("/root/work.bin") == payload
        assert restored.read("/opt/tool/version") == b"v1\n"
        assert restored.exec("test -e /etc/motd").exit_code == 1  # the delete is kept too
        assert restored.read("/root/small") == b"x" * 1000
        restored.write("/root/after", b"own")  # its own writes, not the checkpoint's
        assert restored.exec("cat /root/after").stdout == b"own"
        restored.exec("sync")  # the writes' copy-on-write reads of the chain are done before the counts
        per_layer = host2.host.client.request("GET", "/stats")["bytes_fetched_uncompressed_per_layer"]
        fetched = per_layer[first.layer] + per_layer[second.layer]
        disk = restored.state.vm["shape"]["disk"]
        assert 0 < fetched < disk / 4, f"fetched {fetched} bytes for a {disk}-byte disk: not lazy"
        # a checkpoint of the restored VM is a delta over the chain: it reads none of the chain,
        # so it fetches nothing more of the first host's disk
        third = run(restored.checkpoint())
        after = host2.host.client.request("GET", "/stats")["bytes_fetched_uncompressed_per_layer"]
        assert after[first.layer] == per_layer[first.layer]
        assert third.bytes_changed < len(payload) / 2, third
        doc3 = run(_doc(store_url, tmp_path, third.digest))
        assert doc3["bound"]["disk_chain"] == [first.layer, second.layer, third.layer]
        # a chain at its longest: the next checkpoint is a whole disk again, and restores
        monkeypatch.setattr(microvm, "MAX_DISK_CHAIN", 3)
        restored.write("/root/fourth", b"4")
        fourth = run(restored.checkpoint())
        doc4 = run(_doc(store_url, tmp_path, fourth.digest))
        assert doc4["bound"]["disk_chain"] == [fourth.layer]
        assert "disk_base" not in doc4
        again = run(vm_host2.restore(fourth.digest))
        try:
            assert again.read("/root/fourth") == b"4"
            assert again.read("/root/work.bin") == payload
        finally:
            again.destroy()
        # host 1 published its template: host 2 mapped it from the store instead of booting one
        create = next(r for r in restored.receipts() if r["action"] == "restore" and not r.get("inherited"))
        assert create["template_source"] == "store", create
        assert create["template_made"] is False
        # its template: the kind saved before any disk was mounted (the guest mounts the checkpoint's)
        unmounted = host2.backend("microvm").host_template(restored.state.vm["template"])
        assert unmounted is not None
        assert not unmounted.mounted
        assert restored.state.vm["template"] != box.state.vm["template"]
        # the template's document is in the store beside the images, but nothing runs from it
        with pytest.raises(UnsupportedOption, match="vm-template document"):
            run(host2.create(f"vm-templates/{restored.state.vm['template']}"))
        inherited = [r for r in restored.receipts() if r.get("inherited")]
        assert any(r["action"] == "checkpoint" and r["digest"] == first.digest for r in inherited)
    finally:
        restored.destroy()
    assert box.exec("test -e /root/after").exit_code == 1


def test_memory_checkpoint_goes_on_on_a_second_host_and_dedups_against_the_template(
        vms: Any, vm_host2: SandboxManager, vm_manager: SandboxManager, store_url: str,  # noqa: F811
        tmp_path: Path) -> None:
    box = vms()
    box.exec("nohup sh -c 'i=0; while true; do i=$((i+1)); echo $i > /root/c.tmp; mv /root/c.tmp /root/count; "
             "sleep 0.2; done' >/dev/null 2>&1 &")
    secret = os.urandom(8).hex().encode()
    box.exec(["sh", "-c", f"echo {secret.decode()} > /dev/shm/note"])
    # 8 MB only the guest's RAM holds, checked by digest after the restore: the mapped image
    # must be the RAM exactly, pages of every pass of the live save included
    box.exec("head -c 8000000 /dev/urandom > /dev/shm/big")
    big = box.exec("sha256sum /dev/shm/big").stdout.split()[0]
    _counting(box)
    ckpt = run(box.checkpoint(memory=True))
    doc = run(_doc(store_url, tmp_path, ckpt.digest))
    assert doc["bound"]["memory"] == "mapped-ram"
    assert doc["bound"]["vm"]["ram_image"] == "exact"
    assert doc["bound"]["vm"]["qemu"]
    assert doc["bound"]["vm"]["assets"] == box.state.vm["assets"]
    # the RAM image's unchanged 256 KiB runs are its template's chunks, already in the store
    assert ckpt.bytes_uploaded < ckpt.bytes_changed / 4, ckpt
    assert box.exec("cat /dev/shm/note").stdout.strip() == secret  # the source went on
    vm_host2.host.start_daemon()  # (running already when the block checkpoint's test ran first)
    before = vm_host2.host.client.request("GET", "/stats")["bytes_fetched_uncompressed_per_layer"].get(ckpt.layer, 0)
    restored = run(vm_host2.restore(ckpt.digest))
    try:
        rec = next(r for r in restored.receipts() if r["action"] == "restore" and not r.get("inherited"))
        assert rec["memory_restored"] is True
        assert rec["memory_lazy"] is True, rec
        assert restored.read("/dev/shm/note").strip() == secret
        first = int(restored.read("/root/count"))
        time.sleep(1)
        assert int(restored.read("/root/count")) > first
        # lazily: what the guest touched so far of its RAM image (its page cache of the layers,
        # most of its kernel's memory, are not), against all of it that is not zero
        per_layer = vm_host2.host.client.request("GET", "/stats")["bytes_fetched_uncompressed_per_layer"]
        touched = per_layer.get(ckpt.layer, 0) - before
        assert 0 < touched < 0.6 * ckpt.bytes_changed, (touched, ckpt.bytes_changed)
        assert restored.exec("sha256sum /dev/shm/big").stdout.split()[0] == big
        # its own RNG from here on: the MOUNT after the load reseeds a restored memory too
        draws = [b.exec("head -c 16 /dev/urandom | od -An -tx1").stdout for b in (box, restored)]
        assert draws[0] != draws[1]
        # its own writes, and a checkpoint of it (no template under it) restores again
        restored.write("/root/second", b"2")
        again = run(restored.checkpoint(memory=True))
        third = run(vm_manager.restore(again.digest))
        try:
            assert third.read("/root/second") == b"2"
            assert third.read("/dev/shm/note").strip() == secret
        finally:
            third.destroy()
    finally:
        restored.destroy()
    container = run(vm_manager.create(REF))
    try:
        with pytest.raises(UnsupportedOption, match="memory"):
            run(container.checkpoint(memory=True))
    finally:
        container.destroy()


def _counting(box: Sandbox) -> None:
    """Wait until the guest's counting loop has written its file once."""
    deadline = time.monotonic() + 30
    while box.exec("test -s /root/count").exit_code != 0:
        assert time.monotonic() < deadline, "the guest's loop never wrote /root/count"
        time.sleep(0.1)


async def _doc(url: str, tmp: Path, digest: str) -> dict[str, Any]:
    from layerstore.store import Store
    async with await Store.open(url, tmp / "reader") as s:
        return dict(await s.get_doc(digest))


def test_an_idle_guest_with_no_host_connected_sleeps(vms: Any, vm_manager: SandboxManager) -> None:
    """With no host connected to its port (a manager that restarted, a CLI that exited), the agent
    waits for the host's connect (SIGIO) instead of waking every 5 ms: an idle guest then cost
    7-8% of a core under TCG.  Counted as the agent's (PID 1's) own context switches: 3 s of the
    old loop were ~500 of them."""
    box = vms()

    def switches() -> int:
        status = box.exec("cat /proc/1/status").stdout.decode()
        return sum(int(ln.split()[1]) for ln in status.splitlines() if "ctxt_switches:" in ln)

    before = switches()
    vm_manager.backend("microvm").close()  # every connection to its guests' agents: none is connected
    time.sleep(3)
    woke = switches() - before  # the exec connects again: its HELLO and the command are in it
    assert woke < 150, f"the agent switched {woke} times in 3 s without a host"
    assert box.exec("echo alive").stdout == b"alive\n"


def test_vmm_killed_reconcile_cleans_up(vm_manager: SandboxManager) -> None:
    box = run(vm_manager.create(REF, VM))
    vmm = box.state.vm["vmm_pid"]
    os.kill(vmm, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while proc_stat(vmm) is not None and proc_stat(vmm)[0] != 0 and time.monotonic() < deadline:
        try:
            if os.waitpid(vmm, os.WNOHANG)[0]:
                break
        except ChildProcessError:
            break
        time.sleep(0.05)
    report = vm_manager.reconcile()
    assert box.id in report["destroyed"]
    assert not box.dir.exists()
    assert not [d for d in vm_manager.layout.dirs(f"/{vm_manager.cgroup_parent}/{box.id}") if d.exists()]


# -- through the edge service and the SDK ------------------------------------------------------------
def test_microvm_through_the_service_and_a_job_of_both_kinds(vm_manager: SandboxManager) -> None:
    from sandbox.sdk import AsyncClient, AsyncJob, AsyncSandbox, InvalidRequest
    from tests.support.sandboxes import no_sandboxes_left, serving

    token = "vm-token-0123456789abcdef"
    tokens = {"projects": {"vmp": {"tokens": [token], "max_sandboxes": 4}}}

    async def scenario(url: str) -> None:
        async with AsyncClient(url=url, token=token) as client:
            caps = await client.capabilities()
            assert "microvm" in caps.isolation
            assert caps.backends["microvm"]["available"] is True
        vm_sb = await AsyncSandbox.create(REF, url=url, token=token, isolation="microvm", memory=384 << 20,
                                          disk=256 << 20, job="mixed")
        ct_sb = await AsyncSandbox.create(REF, url=url, token=token, job="mixed")
        try:
            info = await vm_sb.refresh()
            assert info.isolation == "microvm"
            assert (await ct_sb.refresh()).isolation == "container"
            seen: list[str] = []
            res = await vm_sb.commands.run("echo one; echo two >&2; uname -r", on_stdout=seen.append)
            assert res.exit_code == 0
            assert "one" in "".join(seen)
            assert res.stdout.splitlines()[-1] != os.uname().release  # the guest's kernel
            await vm_sb.files.write("/root/f.txt", b"through the edge")
            assert await vm_sb.files.read("/root/f.txt") == "through the edge"
            with pytest.raises(InvalidRequest, match="cpu"):  # more vCPUs than the host: a 400 naming it
                await AsyncSandbox.create(REF, url=url, token=token, isolation="microvm",
                                          cpu=float((os.cpu_count() or 1) + 1))
            policed = await AsyncSandbox.create(REF, url=url, token=token, isolation="microvm", memory=384 << 20,
                                                disk=256 << 20, network=[{"cidr": "10.1.2.3/32"}])
            try:
                got = await policed.refresh()
                assert got.network is not None
                assert got.network.policy is not None
                assert got.network.policy.rules[0]["addresses"] == ["10.1.2.3/32"]
            finally:
                await policed.kill()
            async with AsyncJob("mixed", url=url, token=token) as job:
                paused = await job.pause()
                assert sorted(paused) == sorted([vm_sb.sandbox_id, ct_sb.sandbox_id])
                assert (await vm_sb.refresh()).status == "paused"
                await job.resume()
            assert (await vm_sb.commands.run("cat /root/f.txt")).stdout == "through the edge"
            # memory is a microVM's: a container's checkpoint with it, or a memory that is not a
            # boolean, is a 400 naming the field
            with pytest.raises(InvalidRequest, match="memory"):
                await ct_sb.checkpoint(memory=True)
            http = vm_sb._http  # the raw request: the SDK sends only booleans
            with pytest.raises(InvalidRequest, match="memory"):
                await http.json("POST", vm_sb._path + "/checkpoint", json_body={"memory": "yes"})
            ckpt = await vm_sb.checkpoint(memory=True)
            moved = await AsyncSandbox.restore(ckpt.name, url=url, token=token)
            try:
                assert (await moved.commands.run("cat /root/f.txt")).stdout == "through the edge"
            finally:
                await moved.kill()
        finally:
            await vm_sb.kill()
            await ct_sb.kill()

    with no_sandboxes_left(vm_manager), serving(vm_manager, tokens) as srv:
        run(scenario(srv.url))


def test_fork_and_a_checkpoint_of_a_paused_vm(vms: Any, vm_manager: SandboxManager) -> None:
    box = vms()
    box.exec("echo base > /root/state")
    ckpt, children = run(box.fork(2))
    try:
        assert len(children) == 2
        for i, child in enumerate(children):
            assert child.state.options.isolation == "microvm"
            assert child.read("/root/state") == b"base\n"
            child.write("/root/state", f"child{i}".encode())
        assert [c.read("/root/state") for c in children] == [b"child0", b"child1"]
        assert box.read("/root/state") == b"base\n"
    finally:
        for child in children:
            child.destroy()
    # written, not yet on the guest's disk, then paused with reclaim: the checkpoint still has it
    box.exec("echo unsynced > /root/late")
    box.pause(reclaim=True)
    late = run(box.checkpoint())
    assert box.state.status == "paused"
    assert box.state.vm["saved"] == "store"
    again = run(vm_manager.restore(late.digest))
    try:
        assert again.read("/root/late") == b"unsynced\n"
    finally:
        again.destroy()
    box.resume()


def test_preempting_a_job_of_a_container_and_a_microvm(vm_manager: SandboxManager,
                                                        vm_host2: SandboxManager) -> None:
    from sandbox.host.runs import preempt, resume_run

    vm_box = run(vm_manager.create(REF, VM.replace(job="both")))
    ct_box = run(vm_manager.create(REF, SandboxOptions(job="both")))
    vm_box.write("/root/who", b"vm")
    ct_box.write("/root/who", b"container")
    # a process of the VM's and what only its RAM holds: a microVM is preempted with its memory
    vm_box.exec("nohup sh -c 'i=0; while true; do i=$((i+1)); echo $i > /root/c.tmp; mv /root/c.tmp /root/count; "
                "sleep 0.2; done' >/dev/null 2>&1 &")
    vm_box.exec("echo in-ram > /dev/shm/note")
    _counting(vm_box)
    done = run(preempt(vm_manager, "both", timeout=5))
    assert not vm_box.dir.exists()
    assert not ct_box.dir.exists()
    back = run(resume_run(vm_host2, done.ref))
    kinds = {}
    try:
        for new in back.sandboxes.values():
            box = vm_host2.get(new)
            kinds[box.state.options.isolation] = box.read("/root/who")
            if box.state.options.isolation == "microvm":
                assert box.read("/dev/shm/note") == b"in-ram\n"  # a tmpfs: not on the disk
                first = int(box.read("/root/count"))
                time.sleep(1)
                assert int(box.read("/root/count")) > first, "the VM's loop did not go on on the second host"
                restore = next(r for r in box.receipts() if r["action"] == "restore" and not r.get("inherited"))
                assert restore["memory_restored"] is True
                assert restore["template_source"] == "checkpoint"
    finally:
        for new in back.sandboxes.values():
            vm_host2.destroy(new)
    assert kinds == {"microvm": b"vm", "container": b"container"}


def test_a_crash_in_a_pause_to_the_store_leaves_a_vm_that_runs_or_resumes(vms: Any,
                                                                          vm_manager: SandboxManager) -> None:
    box = vms()
    box.write("/root/kept", b"across the crash")
    st = box.state
    # a manager that died after the pause's capture stopped the guest, before the state said
    # paused: the state says running, the VMM lives with its vCPUs stopped
    vms = vm_manager.backend("microvm")
    ckpt = run(vms._checkpoint(box, st, box.checkpoint_request(memory=True), keep_stopped=True)).checkpoint
    qmp = vm_manager.backend("microvm").vmm_of(box.dir, box.state).qmp()
    try:
        assert qmp.execute("query-status")["status"] in ("paused", "postmigrate")
    finally:
        qmp.close()
    report = vm_manager.reconcile()
    assert box.id in report["adopted"]
    assert box.exec("cat /root/kept").stdout == b"across the crash"  # it runs on
    # one that died after the state said paused, before its VMM was stopped: resumed from the store
    box.write("/root/kept", b"second")
    ckpt = run(vms._checkpoint(box, box.state, box.checkpoint_request(memory=True), keep_stopped=True)).checkpoint
    box.update(status="paused", vm={**box.state.vm, "saved": "store", "paused_checkpoint": ckpt.digest})
    vmm = box.state.vm["vmm_pid"]
    report = vm_manager.reconcile()
    assert box.id in report["adopted"]
    box.resume()
    assert proc_stat(vmm) is None  # the stale VMM was stopped, not left beside the new one
    assert box.read("/root/kept") == b"second"


def test_a_crash_between_a_disk_switch_and_its_state_write_keeps_the_writes(vms: Any) -> None:
    box = vms()
    run(box.checkpoint())
    box.write("/root/after-switch", b"kept")
    box.exec("sync")
    st = box.state
    assert st.vm is not None
    top = st.vm["disk_nodes"][-1][0]
    assert Path(top).parent == box.dir / "vm"
    assert Path(top).name.startswith("disk-"), st.vm["disk_nodes"]  # the checkpoint's new overlay
    # the state as a manager killed between QEMU's switch and the state write leaves it: the
    # overlay the guest writes since then is not in it
    box.update(vm={**st.vm, "disk_nodes": st.vm["disk_nodes"][:-1]})
    # a pause (a checkpoint, then the VMM stopped) must take the unrecorded overlay: the guest's
    # writes since the switch are only there
    box.pause(reclaim=True)
    box.resume()
    box.exec("echo 3 > /proc/sys/vm/drop_caches")  # read from the disk, not the restored page cache
    assert box.read("/root/after-switch") == b"kept"
    # what was written since the store's chain spans two files then: the pause was a whole disk
    assert len(box.state.vm["disk_chain"]) == 1, box.state.vm["disk_chain"]


def test_metrics_report_guest_and_host_memory(vms: Any, vm_manager: SandboxManager) -> None:
    box = vms()
    before = box.usage()
    guest = before["memory"]["guest"]
    assert 0 < guest["used"] < guest["total"] <= box.state.vm["shape"]["memory"]
    assert before["memory"]["current"] > 0  # the VMM's cgroup: what the host pays
    assert before["disk"]["where"] == "vm-disk"
    assert before["disk"]["limit"] == box.state.vm["shape"]["disk"]
    cg = box.state.cgroups_path
    base = vm_manager.layout.memory_current(cg) or 0
    box.exec(["python3", "-c", "b = b'x' * (150 << 20); import time; time.sleep(0.1)"], timeout=120)
    # the guest's touched pages are the host's (charged to the VMM), its view says what it uses now
    assert (vm_manager.layout.memory_peak(cg) or 0) >= base + (100 << 20)
    after = box.usage()
    assert after["memory"]["guest"]["used"] < guest["used"] + (40 << 20)
    box.pause(reclaim=True)
    paused = box.usage()
    assert paused["memory"]["guest"] is None
    assert (paused["memory"]["current"] or 0) < base  # a saved VM's RAM is off the host
    box.resume()


# -- a hostile guest against the host's memory ---------------------------------------------------------
def test_a_guest_that_lies_in_its_meminfo_costs_the_host_no_memory(vms: Any) -> None:
    box = vms()
    assert box.usage()["memory"]["guest"] is not None
    # guest root makes its /proc/meminfo a 1 GiB file: the host reads what it asked for, no more
    lie = box.exec("truncate -s 1G /root/big && mount --bind /root/big /proc/meminfo && stat -c %s /proc/meminfo")
    assert (lie.exit_code, lie.stdout) == (0, b"1073741824\n"), lie.stderr
    peak = PeakRss()
    t = time.monotonic()
    usage = box.usage()
    took, grew = time.monotonic() - t, peak.grew
    print(f"usage() over a 1 GiB /proc/meminfo: {took:.2f} s, peak RSS +{peak.mib()}")
    assert usage["memory"]["guest"] is None  # more than a meminfo holds is no figure
    assert grew < 4 << 20, f"the host's memory grew by {grew} bytes"
    assert took < 10, took  # the guest stopped sending at the cap: nothing was drained
    # a big file is the guest's business, not a broken protocol: its agent still answers
    assert box.exec("umount /proc/meminfo && echo ok").stdout == b"ok\n"
    assert box.usage()["memory"]["guest"] is not None


def test_a_slow_download_of_a_big_guest_file_keeps_the_host_memory_bounded(vms: Any, tmp_path: Path) -> None:
    box = vms(SandboxOptions(isolation="microvm", memory=384 << 20, disk=512 << 20))
    size = 200 << 20
    made = box.exec(f"head -c {size} /dev/urandom > /root/big && sha256sum /root/big", timeout=300)
    assert made.exit_code == 0, made.stderr
    want = made.stdout.split()[0].decode()
    peak = PeakRss()
    digest, total = hashlib.sha256(), 0
    t = time.monotonic()
    pieces = box.files.iter_read("/root/big")
    first = next(pieces)
    time.sleep(5)  # a client that does not read: the guest must wait, not the host buffer
    stalled = peak.mib()
    for piece in itertools.chain([first], pieces):
        digest.update(piece)
        total += len(piece)
        if total % (32 << 20) < len(piece):
            time.sleep(0.2)  # and one that reads slowly
    took, grew = time.monotonic() - t, peak.grew
    print(f"download of {size >> 20} MiB: {took:.1f} s, peak RSS +{stalled} while stalled, +{peak.mib()} over all")
    assert (total, digest.hexdigest()) == (size, want)
    assert grew < 32 << 20, f"the host's memory grew by {grew} bytes"


# Guest root impersonates its agent: a dup of the agent's own port (pidfd_getfd on PID 1, the
# agent), and on it an END for a request the host never made.
FORGE_A_FRAME = r"""
import ctypes, os, struct
port = next(int(fd) for fd in os.listdir("/proc/1/fd") if "vport" in os.readlink(f"/proc/1/fd/{fd}"))
fd = ctypes.CDLL(None, use_errno=True).syscall(438, os.pidfd_open(1), port, 0)  # pidfd_getfd
if fd < 0:
    raise OSError(ctypes.get_errno(), "pidfd_getfd")
os.write(fd, struct.pack(">IBI", 9, 9, 0x7FFF0000) + bytes(4))
"""


def test_a_guest_that_forges_agent_frames_gets_its_sandbox_marked(vms: Any, vm_manager: SandboxManager) -> None:
    box = vms()
    forged = box.exec(["python3", "-c", FORGE_A_FRAME])
    assert forged.exit_code == 255  # its own command went with the connection
    assert b"which the host never opened" in forged.stderr
    why = box.state.vm["agent_misbehaved"]
    assert "a frame of type 9 on channel 2147418112, which the host never opened" in why
    assert [r["reason"] for r in box.receipts() if r["action"] == "agent_misbehaved"] == [why]
    # from then on the host does not talk to it: a clear refusal (409), never a reconnect
    with pytest.raises(AgentMisbehaved, match="broke the agent protocol .*destroy it"):
        box.read("/etc/hostname")
    with pytest.raises(SandboxStateError, match="broke the agent protocol"):
        box.exec("true")
    usage = box.usage()  # what the host measures still answers; the guest's own figure does not
    assert usage["memory"]["guest"] is None
    assert usage["memory"]["current"] > 0
    assert box.state.status == "running"  # destroyed by the fixture, as any other


def test_vm_templates_lists_and_prunes_only_what_no_sandbox_uses(vm_manager: SandboxManager, store_url: str,  # noqa: F811
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Last in the module: it removes the module's template from this host."""
    import json

    from tools.cli import main as cli

    box = run(vm_manager.create(REF, VM))
    key = box.state.vm["template"]
    argv = ["vm", "templates", "--data-dir", str(vm_manager.data_dir), "--store", store_url, "--json"]
    try:
        assert cli([*argv, "--prune"]) == 0
        doc = json.loads(capsys.readouterr().out)
        mine = next(t for t in doc["host"] if t["key"] == key)
        assert mine["sandboxes"] == [box.id]
        assert mine["memory_allocated"] > 0
        assert key not in [p.removesuffix(".store") for p in doc["pruned"]]  # in use: kept
        assert f"vm-templates/{key}:latest" in [r["ref"] for r in doc["store"]]
        assert box.exec("true").exit_code == 0
    finally:
        box.destroy()
    assert cli([*argv, "--prune"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert key in [p.removesuffix(".store") for p in doc["pruned"]]
    assert vm_manager.backend("microvm").host_template(key) is None
    assert cli(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert key not in [t["key"] for t in doc["host"]]
    assert f"vm-templates/{key}:latest" in [r["ref"] for r in doc["store"]]  # other hosts still map it
