"""Sandboxes with real crun, a real kernel and a real store (the Debian fixture image with python3)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from support.sandboxes import PROCESS_ARGS, REF, assert_clean, run

from lazyfetch import kmount
from sandbox.backends.container.files import RootFiles
from sandbox.backends.container.runtime import SEALED, OciRuntime
from sandbox.backends.container.spec import CAPABILITIES, Masks
from sandbox.core.errors import InvalidField, PathEscape, SandboxError
from sandbox.core.procs import kill_exited, proc_stat
from sandbox.host.manager import Sandbox, SandboxManager
from sandbox.isolation import landlock
from sandbox.isolation.cgroups import preflight_cgroups
from sandbox.isolation.resources import Cgroups, _owner_tag

F_GET_SEALS = 1034

pytestmark = [pytest.mark.usefixtures("need_root"), pytest.mark.root("erofs", "overlay", "fuse", "cmd:crun")]


def test_lifecycle_checkpoint_and_restore_on_second_host(
        boxes: Any, manager: SandboxManager, store_url: str, tmp_path: Path) -> None:
    started = time.perf_counter()
    box = boxes(labels={"task": "t1"}, env={"GREETING": "hi"})
    first = box.exec(["python3", "-c", "print(1+1)"])
    latency = time.perf_counter() - started
    assert (first.exit_code, first.stdout, first.truncated) == (0, b"2\n", False)
    assert latency < 10
    assert box.exec("echo $GREETING; pwd; id -u").stdout == b"hi\n/\n0\n"
    assert box.exec("cat", stdin=b"piped in").stdout == b"piped in"
    assert box.exec("echo err >&2; exit 3").stderr == b"err\n"

    box.write("/root/notes.txt", b"hello sandbox\n", mode=0o600)
    assert box.read("/root/notes.txt") == b"hello sandbox\n"
    assert box.exec("cat /root/notes.txt").stdout == b"hello sandbox\n"  # same view inside
    box.exec("mkdir -p /work && echo made-inside > /work/in.txt")
    assert box.read("/work/in.txt") == b"made-inside\n"
    names = {e["name"]: e for e in box.list("/root")}
    assert names["notes.txt"]["type"] == "file"
    assert box.stat("/root/notes.txt").st_mode & 0o777 == 0o600
    box.write("/root/gone", b"x")
    box.remove("/root/gone")
    assert "gone" not in {e["name"] for e in box.list("/root")}

    streamed: list[bytes] = []
    res = box.exec("for i in 1 2 3; do echo $i; done", on_stdout=streamed.append)
    assert b"".join(streamed) == res.stdout == b"1\n2\n3\n"

    paused = box.pause()
    assert box.state.status == "paused"
    assert paused["reclaim"]["after"] <= paused["reclaim"]["before"]
    box.resume()
    assert box.exec("echo back").stdout == b"back\n"

    ckpt = run(box.checkpoint(labels={"step": "1"}))
    assert ckpt.layers >= 2
    box.destroy()
    box.destroy()  # idempotent

    receipts = box.receipts()
    actions = [r["action"] for r in receipts]
    assert actions[0] == "create"
    assert actions.count("exec") == 8
    assert {"pause", "resume", "checkpoint", "write", "remove", "destroy"} <= set(actions)
    first_exec = next(r for r in receipts if r["action"] == "exec")
    assert first_exec["command"] == ["python3", "-c", "print(1+1)"]
    assert first_exec["exit_code"] == 0
    assert first_exec["stdout_bytes"] == 2
    assert first_exec["image"] == receipts[0]["image"]
    assert first_exec["labels"] == {"task": "t1"}
    import blake3
    assert first_exec["stdout_blake3"] == blake3.blake3(b"2\n").hexdigest()

    second = SandboxManager(tmp_path / "host2", store_url)
    try:
        restored = run(second.restore(ckpt.name))
        assert restored.read("/root/notes.txt") == b"hello sandbox\n"
        assert restored.exec("cat /work/in.txt; python3 -c 'print(6*7)'").stdout == b"made-inside\n42\n"
        restored.destroy()
    finally:
        second.close()
    assert_clean(second)


def test_confinement(boxes: Any) -> None:
    box = boxes()
    status = dict(line.split(":\t", 1) for line in
                  box.exec("cat /proc/self/status").stdout.decode().splitlines() if ":\t" in line)
    assert status["Seccomp"].strip() == "2"
    assert status["NoNewPrivs"].strip() == "1"
    cap_bits = {"CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_FOWNER": 3, "CAP_FSETID": 4, "CAP_KILL": 5,
                "CAP_SETGID": 6, "CAP_SETUID": 7, "CAP_NET_BIND_SERVICE": 10}
    assert int(status["CapBnd"], 16) == sum(1 << cap_bits[c] for c in CAPABILITIES)
    denied = box.exec("unshare -U true; echo 1 > /proc/sys/kernel/hostname; mount -t tmpfs x /mnt;"
                      "python3 -c 'import ctypes; l=ctypes.CDLL(None, use_errno=True); "
                      "print(l.syscall(321, 0, 0, 0), ctypes.get_errno())'")  # bpf(2)
    err = denied.stderr.decode()
    assert "unshare failed: Operation not permitted" in err
    assert "Read-only file system" in err
    assert "permission denied" in err.lower()
    assert denied.stdout.strip() == b"-1 1"
    assert box.exec("ls /dev | sort").stdout.split() == sorted(
        b"core fd full mqueue null ptmx pts random shm stderr stdin stdout tty urandom zero".split())
    with pytest.raises(InvalidField, match="cpu_class") as bad:
        run(box.manager.create(REF, cpu_class="realtime"))
    assert bad.value.field == "cpu_class"


def test_home_is_the_accounts_own_unless_the_image_or_the_caller_sets_it(boxes: Any) -> None:
    """As runc and crun do: a sandbox run as an account gets HOME from its passwd entry."""
    assert boxes().exec("id -un; echo $HOME").stdout == b"root\n/root\n"
    assert boxes(user="www-data").exec("id -un; echo $HOME").stdout == b"www-data\n/var/www\n"
    assert boxes(user="12345").exec("id -u; echo $HOME").stdout == b"12345\n/\n"  # not in passwd
    assert boxes(user="www-data", env={"HOME": "/tmp"}).exec("echo $HOME").stdout == b"/tmp\n"


def test_users_are_looked_up_once_per_document_and_never_from_another(
        boxes: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new sandbox's rootfs is its document's alone until it starts, so its users are read from
    the document once (a fork of 100 read /etc/passwd 100 times, on a thread each); a sandbox that
    rewrites its passwd changes its own checkpoint's users, never another sandbox's of the image."""
    reads: list[str] = []
    real = RootFiles.read

    def counted(self: RootFiles, path: str, limit: int | None = None) -> bytes:
        reads.append(path)
        return real(self, path, limit)

    monkeypatch.setattr(RootFiles, "read", counted)
    assert boxes(user="www-data").exec("id -u; id -g").stdout == b"33\n33\n"
    assert boxes(user="www-data").exec("id -u").stdout == b"33\n"
    assert reads.count("/etc/passwd") <= 1  # (none when an earlier test looked www-data up in this image)
    agent = boxes()  # root in its sandbox: it may rewrite its own passwd
    agent.exec("sed -i 's/^www-data:x:33:33:/www-data:x:4242:4343:/' /etc/passwd")
    assert agent.exec("id -u www-data").stdout == b"4242\n"
    moved = run(agent.checkpoint())
    restored = run(agent.manager.restore(moved.digest, user="www-data"))
    try:
        assert restored.exec("id -u; id -g").stdout == b"4242\n4343\n"  # its own document's passwd
    finally:
        restored.destroy()
    assert boxes(user="www-data").exec("id -u; id -g").stdout == b"33\n33\n"  # the image's, as before


def test_sandbox_cpusets_are_cloned_from_their_parent(boxes: Any) -> None:
    """On cgroup v1, crun would fill each new cpuset from its parent with a write the kernel checks
    against every sibling (a create slower the more sandboxes are held): the parent clones them."""
    box = boxes()
    layout = box.manager.layout
    if layout.version == 2:
        pytest.skip("cgroup v2: no cpuset to clone (this host runs v1, where the test means something)")
    cpuset = layout.controller_dir("cpuset", box.state.cgroups_path)
    assert cpuset is not None
    assert (cpuset.parent / "cgroup.clone_children").read_text().strip() == "1"
    root = layout.v1["cpuset"]
    assert (cpuset / "cpuset.cpus").read_text() == (root / "cpuset.cpus").read_text() != "\n"
    assert box.exec("grep Cpus_allowed_list /proc/self/status").stdout.split()[-1].decode() == \
        (root / "cpuset.cpus").read_text().strip()


class _SpawnProbe:
    """A background command's owner, as the exec API sees one: records what exists when the
    backend says the command is spawned."""

    terminal = None
    stdin_fd = None

    def __init__(self, box: Sandbox) -> None:
        self.box = box
        self.pid_files: list[str] | None = None

    def started(self) -> dict[str, Any]:
        return {}

    def spawned(self) -> None:
        self.pid_files = sorted(p.name for p in self.box.bundle.glob("exec-*.pid"))

    def on_terminal(self, master: int, resize: Any = None) -> None:
        os.close(master)

    def finished(self) -> dict[str, Any]:
        return {}


def test_a_background_command_is_spawned_once_its_process_exists(boxes: Any) -> None:
    """crun exec refuses a paused container: a start answered before crun made the process let a
    pause that came at once fail the command.  Its pid file is written once the process exists."""
    box = boxes()
    for _ in range(3):
        probe = _SpawnProbe(box)
        assert box.exec("true", attach=probe).exit_code == 0
        assert probe.pid_files is not None
        assert len(probe.pid_files) == 1, probe.pid_files


def test_the_shared_masks_are_read_only_and_refuse_what_is_put_in_them(tmp_path: Path) -> None:
    """Every container's masked directories are binds of ``masks/empty``: an entry there would
    show in all of them, so the manager refuses to use it rather than show it."""
    masks = Masks(tmp_path / "masks" / "empty", tmp_path / "masks" / "cgroup")
    masks.ensure(["memory", "cpu"])
    masks.ensure(["memory", "cpu"])  # (again, as a manager's restart does)
    modes = {p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in tmp_path.rglob("*")}
    assert modes == {"masks": 0o711, "masks/empty": 0o555, "masks/cgroup": 0o555, "masks/cgroup/memory": 0o555,
                     "masks/cgroup/cpu": 0o555}
    (masks.empty / "planted").write_bytes(b"x")
    with pytest.raises(SandboxError, match="holds 'planted': remove what it holds"):
        masks.ensure(["memory", "cpu"])


def _cgroup_procs(box: Sandbox) -> set[int]:
    d = box.manager.layout.controller_dir("pids", box.state.cgroups_path)
    assert d is not None
    return {int(x) for x in (d / "cgroup.procs").read_text().split()}


def test_exec_timeout_kills_the_tree_and_orphans(boxes: Any) -> None:
    box = boxes()
    baseline = _cgroup_procs(box)
    t0 = time.perf_counter()
    res = box.exec("sleep 901 & (setsid sh -c 'sleep 902 & sleep 903' &) ; echo started; sleep 904", timeout=1.5)
    assert time.perf_counter() - t0 < 8
    assert res.timed_out
    assert res.signal == 9
    assert res.stdout == b"started\n"
    def leftovers() -> list[bytes]:
        out = []
        for pid in _cgroup_procs(box) - baseline:
            try:
                out.append(Path(f"/proc/{pid}/cmdline").read_bytes())
            except OSError:
                continue  # reaped meanwhile
        # the idle init may have restarted its own `sleep 3600`; nothing else may remain
        return [c for c in out if c != b"sleep\x003600\x00"]

    deadline = time.monotonic() + 5
    while leftovers() and time.monotonic() < deadline:
        time.sleep(0.05)  # killed tasks leave the cgroup once reaped by the sandbox's init
    assert leftovers() == []
    assert b"\nsleep 90 " not in b"\n" + box.exec(PROCESS_ARGS).stdout
    assert box.exec("echo alive").stdout == b"alive\n"


def test_output_cap_drops_50mb_without_buffering(boxes: Any) -> None:
    box = boxes()
    tracemalloc.start()
    try:
        res = box.exec("head -c 50000000 /dev/zero; echo tail >&2", output_cap=1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert res.exit_code == 0
    assert res.truncated
    assert len(res.stdout) == 1 << 20
    assert res.stderr == b"tail\n"
    assert peak < 8 << 20, peak
    receipt = box.receipts()[-1]
    assert (receipt["stdout_bytes"], receipt["truncated"]) == (50_000_000, True)


def test_fork_bomb_hits_pids_limit(boxes: Any) -> None:
    box = boxes(pids=64)
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    res = box.exec(["python3", "-c", bomb], timeout=3)
    assert res.timed_out
    d = box.manager.layout.controller_dir("pids", box.state.cgroups_path)
    assert d is not None
    events = dict(line.split() for line in (d / "pids.events").read_text().splitlines())
    assert int(events["max"]) > 0
    t0 = time.perf_counter()
    subprocess.run(["true"], check=True)
    assert time.perf_counter() - t0 < 2
    assert box.exec("echo survived", timeout=10).stdout == b"survived\n"


def test_memory_hog_is_oom_killed_and_sandbox_survives(boxes: Any) -> None:
    box = boxes(memory=64 << 20)
    res = box.exec(["python3", "-c", "b = bytearray(400 << 20); print('allocated')"], timeout=30)
    assert res.oom_killed
    assert (res.exit_code, res.signal) == (137, 9)
    assert b"allocated" not in res.stdout
    assert box.exec("echo still here").stdout == b"still here\n"
    assert box.receipts()[-2]["oom_killed"] is True


def test_symlinks_cannot_leave_the_root(boxes: Any, tmp_path: Path) -> None:
    box = boxes()
    victim = tmp_path / "victim"
    victim.write_text("host file\n")
    box.exec(f"ln -s /etc/shadow /root/abs; ln -s ../../../../../../../etc/shadow /root/rel; "
             f"ln -s {victim} /root/out; ln -s /proc/self/root/etc/hostname /root/magic")
    own = box.exec("cat /etc/shadow").stdout
    host_shadow = Path("/etc/shadow").read_bytes()
    assert box.read("/root/abs") == own
    assert box.read("/root/rel") == own
    assert box.read("../../../../etc/shadow") == own
    if own != host_shadow:
        assert box.read("/root/abs") != host_shadow
    with pytest.raises(FileNotFoundError):
        box.write("/root/out", b"pwned")  # resolves to <root>/<tmp_path>/victim: no such directory
    assert victim.read_text() == "host file\n"
    with pytest.raises(OSError):  # noqa: PT011  (ELOOP/PathEscape: magic links refused)
        box.read("/root/magic")
    assert box.stat("/root/abs").st_size == len("/etc/shadow")  # the link itself


def test_files_api_threads_are_fenced_by_landlock(tmp_path: Path) -> None:
    # the second fence behind openat2: whatever path the files API's code produced, the
    # thread doing the work cannot touch anything outside the sandbox's root
    assert landlock.abi() >= 1, "Landlock is unavailable: boot with lsm=...,landlock"
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "etc").mkdir(parents=True)
    outside.mkdir()
    secret = outside / "secret"
    secret.write_text("host\n")
    files = RootFiles(root)
    files.write("/etc/a", b"inside")
    files.mkdir("/d")
    assert files.read("/etc/a") == b"inside"
    assert [e["name"] for e in files.list("/")] == ["d", "etc"]
    # a bug that opened a host path directly, inside the fenced thread
    with pytest.raises(PermissionError):
        landlock.run_confined(root, lambda: secret.read_text())
    with pytest.raises(PermissionError):
        landlock.run_confined(root, lambda: secret.unlink())
    with pytest.raises(PermissionError):
        landlock.run_confined(root, lambda: (outside / "new").write_text("x"))
    with pytest.raises(PermissionError):  # a rename out of the root is a write outside it
        landlock.run_confined(root, lambda: os.rename(root / "etc" / "a", outside / "moved"))
    assert landlock.run_confined(root, lambda: (root / "etc" / "a").read_bytes()) == b"inside"
    assert sorted(p.name for p in outside.iterdir()) == ["secret"]
    assert secret.read_text() == "host\n"
    # only the operation's own thread was fenced: the caller (a pool thread) is not
    assert secret.read_text() == "host\n"
    (outside / "still-writable").write_text("y")
    files.remove("/d")
    assert not (root / "d").exists()


def test_rootfs_leaves_the_host_mount_table_once_the_container_holds_it(boxes: Any) -> None:
    # every container create copies the host's mount table: sandboxes' overlays must not pile up in it
    first = boxes()
    data_dir = first.manager.data_dir  # (only ours: other managers on this machine mount things too)
    mounts_with_one = len(kmount.mounts_under(data_dir))
    others = [boxes() for _ in range(3)]
    assert len(kmount.mounts_under(data_dir)) == mounts_with_one  # the layers are shared; no overlay is added
    for box in (first, *others):
        assert not kmount.is_mountpoint(box.rootfs)
        assert box.manager.host.status()["mounts"][str(box.rootfs)]["detached"]["pid"] == box.pid
    # the files API reaches the running container's root, and only its own mount of it
    first.write("/root/note", b"through /proc/<init>/root")
    assert first.exec("cat /root/note").stdout == b"through /proc/<init>/root"
    assert "root" in {e["name"] for e in first.list("/")}
    assert first.exec("test -r /proc/1/environ && echo yes").stdout == b"yes\n"
    with pytest.raises(PathEscape):  # the sandbox's /proc is another mount: not through the files API
        first.read("/proc/1/environ")
    with pytest.raises(OSError):  # noqa: PT011  (EXDEV: the walk does not enter /dev's tmpfs)
        first.remove("/dev", recursive=True)
    assert first.exec("test -c /dev/null && echo ok").stdout == b"ok\n"
    with pytest.raises(FileNotFoundError):  # another sandbox's root is another tree
        others[0].read("/root/note")


def test_a_crash_between_a_detach_and_its_unmount_leaves_the_copy_to_destroy(
        boxes: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # the detach's record is written under the host's lock and the host's copy unmounted after
    # it: a manager that dies between the two leaves that copy, which the sandbox's end removes
    import lazyfetch.mounts
    monkeypatch.setattr(lazyfetch.mounts.kmount, "umount_mount", lambda target, mount: False)
    box = boxes()
    monkeypatch.undo()
    assert kmount.is_mountpoint(box.rootfs)
    assert box.manager.host.status()["mounts"][str(box.rootfs)]["detached"]["pid"] == box.pid
    box.write("/root/kept", b"x")
    assert box.exec("cat /root/kept").stdout == b"x"
    box.manager.destroy(box.id)
    assert not kmount.is_mountpoint(box.rootfs)
    assert not [mp for mp in kmount.mounts_under(box.manager.data_dir) if mp.endswith("/rootfs")]


def test_runtime_list_survives_a_container_whose_state_cannot_be_read(boxes: Any) -> None:
    # `crun list` fails as a whole when one container's status cannot be read: a status
    # file that vanished under it (a delete beside it, seen under sustained create/delete,
    # not reproducible at will) or one without a pid, as here.  reconcile() lists the
    # containers, so it must not fail with it.
    box = boxes()
    runtime = box.manager.backend("container").runtime
    ghost = runtime.root / "lb-unreadable"
    ghost.mkdir()
    (ghost / "status").write_text("{}")
    try:
        assert subprocess.run([runtime.binary, "--root", str(runtime.root), "list", "--format", "json"],
                              capture_output=True).returncode != 0  # crun itself gives up
        listed = {c["id"]: c for c in runtime.list()}
        assert set(listed) == {box.id}
        assert listed[box.id]["status"] == "running"
        assert listed[box.id]["pid"] == box.pid
        assert box.manager.reconcile()["adopted"] == [box.id]
    finally:
        shutil.rmtree(ghost)


def _crun_exe(sid: str) -> str | None:
    """Where the running `crun exec` into ``sid`` was executed from, if one runs."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"exec" in argv and sid.encode() in argv:
                return os.readlink(f"/proc/{pid}/exe")
    return None


def test_crun_runs_from_a_sealed_copy_of_itself_that_no_write_reaches(boxes: Any) -> None:
    # crun skips copying itself at each command only when it runs from a memfd sealed against
    # writes: a container must not be able to rewrite the host's runtime (CVE-2019-5736)
    box = boxes()
    runtime = box.manager.backend("container").runtime
    path = Path(runtime.binary)
    assert path.is_relative_to(box.manager.data_dir)
    assert path.name == "crun"
    fd = os.open(path, os.O_RDONLY)
    try:
        assert fcntl.fcntl(fd, F_GET_SEALS) & SEALED == SEALED
        assert os.fstat(fd).st_size == os.stat(runtime.installed).st_size
    finally:
        os.close(fd)
    refused = None
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError as exc:  # the new init may still run crun's code for a moment: refused as well
        refused = exc.errno
    if refused is not None:
        assert refused == errno.ETXTBSY
    else:
        try:
            with pytest.raises(PermissionError):
                os.write(fd, b"#!/bin/sh\n")
        finally:
            os.close(fd)
    seen: list[str | None] = []
    running = threading.Thread(target=box.exec, args=(["sleep", "1"],))
    running.start()
    deadline = time.monotonic() + 10
    while not any(seen) and time.monotonic() < deadline:
        seen.append(_crun_exe(box.id))
        time.sleep(0.01)
    running.join()
    assert next(filter(None, seen)).startswith("/memfd:crun")  # itself, not a copy of its own
    assert box.exec(["echo", "ran"]).stdout == b"ran\n"


def test_crun_sealed_copies_of_processes_gone_are_removed_and_close_removes_its_own(tmp_path: Path) -> None:
    crun = shutil.which("crun")
    assert crun is not None
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (bin_dir / f"{dead.pid}-0").mkdir()  # what a manager that crashed left
    (bin_dir / f"{dead.pid}-0" / "crun").symlink_to(f"/proc/{dead.pid}/fd/3")
    first = OciRuntime(tmp_path / "runtime", copy_dir=bin_dir)
    second = OciRuntime(tmp_path / "runtime", copy_dir=bin_dir)
    try:
        assert first.list() == []
        assert second.list() == []
        assert sorted(p.name for p in bin_dir.iterdir()) == sorted(
            Path(r.binary).parent.name for r in (first, second))
        assert first.binary != second.binary  # one each: closing one leaves the other working
        first.close()
        assert first.binary == crun
        assert second.list() == []
        assert [p.name for p in bin_dir.iterdir()] == [Path(second.binary).parent.name]
    finally:
        first.close()
        second.close()
    assert list(bin_dir.iterdir()) == []


def test_the_sandboxes_cgroup_parent_goes_with_the_last_sandbox_whatever_else_lies_beside_them(boxes: Any) -> None:
    first, second = boxes(), boxes()
    manager = first.manager
    parents = manager.layout.dirs("/" + manager.cgroup_parent)
    stray = manager.boxes / "not-a-sandbox"
    stray.mkdir()
    try:
        first.destroy()
        assert [d for d in parents if d.exists()] == parents  # one left: it keeps the parent
        second.destroy()
        assert [d for d in parents if d.exists()] == []  # a name that is no id keeps nothing
    finally:
        stray.rmdir()


def test_a_state_update_in_flight_when_its_sandbox_is_destroyed_never_brings_it_back(boxes: Any) -> None:
    """A command's last receipt moves ``last_active`` (read, then write, under the states' lock)
    while its sandbox's destroy removes the directory.  The destroy removed the directory without
    that lock: the update's new file could land after ``rmtree`` listed it, the directory stayed,
    and the sandbox was listed as running after a DELETE that answered 204 (seen in the suite,
    tests/test_edge_hostile.py).  The destroy now waits for the update, and the update after it
    finds no sandbox."""
    box, other = boxes(), boxes()
    manager = box.manager
    read, errors = threading.Event(), []

    def update_in_flight() -> None:
        try:
            with manager.states.lock:
                st = manager.states.read(box.id)
                read.set()
                time.sleep(0.5)  # the destroy goes on meanwhile
                manager.states.write(st.replace(last_active=time.time()))
        except Exception as exc:
            errors.append(exc)

    updater = threading.Thread(target=update_in_flight)
    forget = manager.receipt_logs.forget

    def forget_then_update(sid: str) -> None:  # the destroy's last step before the directory goes
        forget(sid)
        updater.start()
        assert read.wait(10)

    manager.receipt_logs.forget = forget_then_update
    try:
        box.destroy()
    finally:
        manager.receipt_logs.forget = forget
        if updater.is_alive():
            updater.join(10)
    assert errors == []  # it wrote before the destroy went on: nothing raced it
    assert not box.dir.exists()
    assert box.id not in manager.ids()
    assert [st.id for st in manager.list()] == [other.id]
    with pytest.raises(SandboxError):
        manager.states.update(box.id, last_active=time.time())  # after it: no sandbox
    assert not box.dir.exists()
    box.receipt("exec", command="late")  # a command's receipt after the destroy brings nothing back
    assert not box.dir.exists()


def test_a_create_while_the_last_sandbox_goes_waits_for_the_parent_cgroup_and_makes_it_again(tmp_path: Path) -> None:
    """The parent cgroup goes with the data dir's last sandbox.  A create that starts meanwhile
    (its directory made after the destroy looked for one) once had the parent removed between
    making it ready and crun's mkdir of its own cgroup: "creating cgroup directory ...: No such
    file or directory" (seen in bench/profile_create.py, 2 workers).  Here the create comes while
    the removal runs, as crun would make its cgroup: it must wait for the removal, then make the
    parent again."""
    layout = preflight_cgroups()
    parent = f"lbtest-{os.getpid()}-{time.monotonic_ns()}"
    boxes_dir = tmp_path / "boxes"
    boxes_dir.mkdir()
    limits = {"memory": 64 << 20, "pids": 64, "cpu_quota": 100_000, "cpu_shares": 1024}

    def empty() -> bool:
        return not any(boxes_dir.iterdir())

    class Removing:
        """The layout, with a create started in the middle of the parent's removal."""

        def __getattr__(self, name: str) -> Any:
            return getattr(layout, name)

        def drop_kept(self, parent_path: str) -> None:
            creator.start()
            done_inside.append(made.wait(0.5))
            layout.drop_kept(parent_path)

    pool = Cgroups(parent, tmp_path / "cgroups.lock", layout=lambda: Removing())  # type: ignore[arg-type,return-value]
    second = pool.path("lb-000000000002")
    made, done_inside, errors = threading.Event(), [], []

    def create() -> None:
        try:
            (boxes_dir / "lb-000000000002").mkdir()
            layout.make(pool.acquire("lb-000000000002"), limits)  # as crun makes a container's
            made.set()
        except Exception as exc:
            errors.append(exc)

    creator = threading.Thread(target=create)
    try:
        first = pool.acquire("lb-000000000001")
        layout.make(first, limits)
        layout.remove(first)  # the last sandbox goes
        assert pool.release_parent(empty)
        creator.join(10)
        assert errors == []
        assert done_inside == [False]  # it waited for the removal to end
        assert made.is_set()
        assert [d for d in layout.dirs(second) if not d.is_dir()] == []
        # a sandbox's directory keeps the parent: release_parent looks again under the lock
        assert not pool.release_parent(empty)
        assert [d for d in layout.dirs(second) if not d.is_dir()] == []
    finally:
        creator.join(10)
        layout.remove(second, wait=1.0)
        layout.remove(f"/{parent}", wait=1.0)
    assert [d for d in layout.dirs(f"/{parent}") if d.exists()] == []


def test_a_destroyed_sandboxs_cgroup_is_kept_reset_and_becomes_the_next_ones_with_its_own_limits(
        boxes: Any) -> None:
    """A destroy keeps the emptied cgroup (renamed, counters reset) and the next create of the same
    project takes it, another project's never: crun writes the new sandbox's limits and device
    list into it, and nothing of the first sandbox's shows."""
    keeper = boxes()  # keeps the parent (it goes with the last sandbox)
    manager = keeper.manager
    layout = manager.layout
    if layout.version != 1:
        pytest.skip("cgroup v2 renames no cgroup: each sandbox's is made and removed")
    first = boxes(memory=96 << 20, labels={"layerbox.project": "alpha"})
    first.exec("i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done; head -c 50000000 /dev/zero | tail -c 1 >/dev/null")
    mem = layout.controller_dir("memory", first.state.cgroups_path)
    cpu = layout.controller_dir("cpuacct", first.state.cgroups_path)
    assert mem is not None
    assert cpu is not None
    assert int((cpu / "cpuacct.usage").read_text()) > 0
    inode, path = mem.stat().st_ino, first.state.cgroups_path
    first.destroy()
    (kept,) = mem.parent.glob(f"kept-*-{first.id}")
    assert not mem.exists()
    assert kept.is_dir()
    for d in layout.dirs(path):
        assert not d.exists()
        assert (d.parent / kept.name).is_dir() == (d.parent.parent not in layout.unified)
    assert int((cpu.parent / kept.name / "cpuacct.usage").read_text()) == 0
    assert (kept / "cgroup.procs").read_text() == ""
    devices = layout.controller_dir("devices", path)
    assert devices is not None
    fresh = (layout.controller_dir("devices", keeper.state.cgroups_path) / "devices.list").read_text()
    assert fresh.splitlines()
    assert "a *:* rwm" not in fresh
    (devices.parent / kept.name / "devices.allow").write_text("a")  # as a VMM's kept cgroup allows

    other = boxes(labels={"layerbox.project": "beta"})  # another project's sandbox: a cgroup of its own
    other_mem = layout.controller_dir("memory", other.state.cgroups_path)
    assert other_mem is not None
    assert other_mem.stat().st_ino != inode
    assert kept.is_dir()

    second = boxes(labels={"layerbox.project": "alpha"})
    mem2 = layout.controller_dir("memory", second.state.cgroups_path)
    assert mem2 is not None
    assert mem2.stat().st_ino == inode
    assert not kept.exists()
    assert int((mem2 / "memory.limit_in_bytes").read_text()) == second.state.options.memory != 96 << 20
    # crun wrote the device list again: a container never inherits a VMM's every device
    assert (layout.controller_dir("devices", second.state.cgroups_path) / "devices.list").read_text() == fresh
    pid = second.state.pid
    assert pid is not None
    assert layout.holds(pid, second.state.cgroups_path)
    assert second.exec("echo ok").stdout == b"ok\n"


def test_a_kept_cgroup_keeps_a_cpu_limit_asked_again_and_gets_another_written(boxes: Any) -> None:
    """crun is not asked to write the CPU bandwidth a reused cgroup has already (each write walks
    every CPU cgroup of the host): the next sandbox of another limit gets its own quota written
    (not the period, the kernel's default in every cgroup here), and one of the same limit runs
    under the one kept, as the kernel shows it."""
    keeper = boxes()
    manager = keeper.manager
    layout = manager.layout
    if layout.version != 1:
        pytest.skip("cgroup v2 renames no cgroup: each sandbox's is made and removed")

    def asked(box: Any) -> dict[str, Any]:
        spec = json.loads((box.bundle / "config.json").read_text())
        return dict(spec["linux"]["resources"]["cpu"])

    def inode(box: Any) -> int:
        mem = layout.controller_dir("memory", box.state.cgroups_path)
        assert mem is not None
        return mem.stat().st_ino

    alpha = {"layerbox.project": "alpha-cpu"}
    first = boxes(cpu=0.5, labels=alpha)
    assert layout.cpu_bandwidth(first.state.cgroups_path) == (50_000, 100_000)
    assert asked(first)["quota"] == 50_000  # a new cgroup: written
    assert "period" not in asked(first)  # the kernel's default already: its write walked every CPU cgroup
    kept = inode(first)
    first.destroy()
    second = boxes(cpu=1.0, labels=alpha)
    assert inode(second) == kept  # the first one's cgroup, renamed
    assert asked(second)["quota"] == 100_000
    assert "period" not in asked(second)
    assert layout.cpu_bandwidth(second.state.cgroups_path) == (100_000, 100_000)
    second.destroy()
    third = boxes(cpu=1.0, labels=alpha)
    assert inode(third) == kept
    assert {"quota", "period"}.isdisjoint(asked(third)), asked(third)
    assert asked(third)["shares"] == 1024
    assert layout.cpu_bandwidth(third.state.cgroups_path) == (100_000, 100_000)
    assert third.exec("echo ok").stdout == b"ok\n"


def test_sandboxes_without_a_network_share_one_read_only_sysfs_that_goes_with_the_last(
        boxes: Any, manager: SandboxManager) -> None:
    """A sandbox with no network binds the data dir's one sysfs (mounted from an empty network
    namespace) instead of mounting a sysfs of its own, each of which the kernel compared with every
    other on the host: the same superblock in every such sandbox, showing only ``lo``, read-only,
    and unmounted with the last sandbox."""
    first, second = boxes(), boxes()
    shared = manager.paths.sysfs
    assert kmount.is_mountpoint(shared)
    dev = os.stat(shared).st_dev
    probe = "stat -c %d /sys; ls /sys/class/net; (: > /sys/x) 2>/dev/null && echo written; echo end"
    for box in (first, second):
        lines = box.exec(probe).stdout.decode().split()
        assert lines == [str(dev), "lo", "end"], lines
    assert os.stat(f"/proc/{first.state.pid}/root/sys").st_dev == dev
    first.destroy()
    assert kmount.is_mountpoint(shared)  # the second one's still
    second.destroy()
    assert not kmount.is_mountpoint(shared)
    third = boxes()  # made again by the next create
    assert third.exec(probe).stdout.decode().split() == [str(os.stat(shared).st_dev), "lo", "end"]


def test_a_cgroup_that_saw_an_oom_kill_or_a_frozen_one_is_removed_not_kept(boxes: Any) -> None:
    keeper = boxes()
    layout = keeper.manager.layout
    if layout.version != 1:
        pytest.skip("cgroup v2 renames no cgroup")
    hog = boxes(memory=64 << 20)
    assert hog.exec(["python3", "-c", "b = bytearray(200 << 20)"], timeout=30).oom_killed
    paused = boxes()
    paused.pause()
    for box in (hog, paused):
        mem = layout.controller_dir("memory", box.state.cgroups_path)
        assert mem is not None
        box.destroy()
        assert not mem.exists()
        assert list(mem.parent.glob(f"kept-*-{box.id}")) == []


def test_a_kept_cgroup_still_charged_past_half_a_new_sandboxs_memory_is_not_reused() -> None:
    """Its charge must be reclaimed before a lower limit takes: where it cannot be (shmem a file
    still holds), crun's create would fail, so a kept cgroup charged past half of the new limit
    is passed over, and one that fits is taken."""
    layout = preflight_cgroups()
    if layout.version != 1:
        pytest.skip("cgroup v2 renames no cgroup: nothing is kept")
    parent = f"/lbtest-{os.getpid()}-{time.monotonic_ns()}"
    kept, new = f"{parent}/kept-0-lb-000000000001", f"{parent}/lb-000000000002"
    shm = Path("/dev/shm") / f"lbtest-{os.getpid()}-charge"
    shm2 = shm.with_name(shm.name + "-2")
    try:
        procs = layout.make(kept, {"memory": 256 << 20, "pids": 64, "cpu_quota": 100_000, "cpu_shares": 1024})
        memory = layout.controller_dir("memory", kept)
        assert memory is not None
        subprocess.run(["sh", "-c", f'echo $$ > {memory}/cgroup.procs && head -c {16 << 20} /dev/zero > {shm}'],
                       check=True)
        assert procs
        assert int((memory / "memory.usage_in_bytes").read_text()) >= 16 << 20  # the file's pages, still charged
        assert not layout.reuse(kept, new, 16 << 20)
        assert memory.is_dir()
        assert [d for d in layout.dirs(new) if d.exists()] == []
        assert layout.reuse(kept, new, 256 << 20)
        assert not memory.exists()
        # a second claim of the same kept cgroup (another manager's, a moment later) loses, and
        # moves nothing: the rename in the memory hierarchy decides
        assert not layout.reuse(kept, f"{parent}/lb-000000000003", 256 << 20)
        assert [d for d in layout.dirs(f"{parent}/lb-000000000003") if d.exists()] == []

        # the manager's pool removes a kept cgroup it passes over: forgotten, it would stay until
        # the host empties
        passed = f"{parent}/kept-{_owner_tag('')}-lb-000000000005"
        layout.make(passed, {"memory": 256 << 20, "pids": 64, "cpu_quota": 100_000, "cpu_shares": 1024})
        passed_memory = layout.controller_dir("memory", passed)
        assert passed_memory is not None
        subprocess.run(["sh", "-c", f'echo $$ > {passed_memory}/cgroup.procs && head -c {16 << 20} /dev/zero > {shm2}'],
                       check=True)
        pool = Cgroups(parent.strip("/"), shm.with_name(shm.name + ".lock"), layout=lambda: layout)
        assert pool.acquire("lb-000000000004", "", 16 << 20) == f"{parent}/lb-000000000004"
        assert [d for d in layout.dirs(passed) if d.exists()] == []
        assert [d for d in layout.dirs(f"{parent}/lb-000000000004") if d.exists()] == []
        for d in layout.dirs(new):
            assert d.is_dir() or d.parent.parent in layout.unified
    finally:
        shm.unlink(missing_ok=True)
        shm2.unlink(missing_ok=True)
        shm.with_name(shm.name + ".lock").unlink(missing_ok=True)
        for path in (new, kept, f"{parent}/kept-{_owner_tag('')}-lb-000000000005", parent):
            layout.remove(path, wait=1.0)


def test_a_killed_init_is_waited_for_and_a_reused_pid_is_left_alone() -> None:
    proc = subprocess.Popen(["sleep", "60"])
    try:
        stat = proc_stat(proc.pid)
        assert stat is not None
        assert kill_exited(proc.pid, stat[1] + 1, 1.0)  # another process's start time: not ours
        assert not kill_exited(proc.pid, None, 1.0)  # no start time: it may be anyone's
        assert proc.poll() is None
        assert kill_exited(proc.pid, stat[1], 5.0)
        assert proc.wait(1) == -signal.SIGKILL
        assert kill_exited(proc.pid, stat[1], 1.0)  # reaped: gone
    finally:
        proc.kill()
        proc.wait()


def test_network_is_loopback_only(boxes: Any) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    accepted: list[Any] = []
    server.settimeout(5)

    def accept() -> None:
        try:
            accepted.append(server.accept())
        except OSError:
            pass

    thread = threading.Thread(target=accept)
    thread.start()
    try:
        box = boxes()
        assert box.exec("ls /sys/class/net").stdout.split() == [b"lo"]
        probe = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                 f"    print('connected')\nexcept OSError as e:\n    print(type(e).__name__)\n")
        assert box.exec(["python3", "-c", probe]).stdout == b"ConnectionRefusedError\n"
        loop = ("import socket\ns=socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
                "c=socket.create_connection(s.getsockname()); print('lo works')\n")
        assert box.exec(["python3", "-c", loop]).stdout == b"lo works\n"
    finally:
        server.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        server.close()
        thread.join()
    assert accepted == []


def test_reconcile_after_manager_crash(manager: SandboxManager, store_url: str) -> None:
    survivor = run(manager.create(REF))
    dead = run(manager.create(REF))
    try:
        dead_pid = dead.pid
        manager.backend("container").runtime.kill(dead.id)  # its init dies while "the manager is down"
        deadline = time.monotonic() + 5
        while (manager.backend("container").runtime.state(dead.id) or {}).get("status") != "stopped" and time.monotonic() < deadline:
            time.sleep(0.05)
        half = manager.boxes / "lb-0000000000aa"  # a crash mid-create: a state this version cannot read
        half.mkdir(parents=True)
        (half / "state.json").write_text('{"id": "lb-0000000000aa", "status": "creating"}')
        stray = manager.boxes / "lb-halfcreated"  # not a sandbox id: never used as one, but cleaned up
        stray.mkdir()
        (stray / "state.json").write_text('{"id": "lb-halfcreated", "status": "creating"}')

        fresh = SandboxManager(manager.data_dir, store_url)  # same data dir, new process state
        report = fresh.reconcile()
        assert report["adopted"] == [survivor.id]
        assert sorted(report["destroyed"]) == sorted([dead.id, "lb-0000000000aa"])
        assert f"stray:{stray.name}" in report["orphans"]
        assert not half.exists()
        assert not stray.exists()
        assert fresh.get(survivor.id).exec("echo adopted").stdout == b"adopted\n"
        assert [c["id"] for c in fresh.backend("container").runtime.list()] == [survivor.id]
        assert not Path(f"/proc/{dead_pid}/cmdline").exists() or not Path(f"/proc/{dead_pid}/cmdline").read_bytes()
    finally:
        manager.destroy(survivor.id)
        manager.destroy(dead.id)
    assert manager.backend("container").runtime.list() == []


def test_a_sandbox_destroyed_under_a_request_is_not_found_not_a_fault(manager: SandboxManager) -> None:
    # the reaper destroys a sandbox between a request's state read and its crun command
    from sandbox.core.errors import SandboxNotFound

    box = run(manager.create(REF))
    assert box.state.status == "running"
    manager.destroy(box.id)
    containers = manager.backend("container")
    with pytest.raises(SandboxNotFound, match="destroyed meanwhile"):
        containers._runtime(box, containers.runtime.pause)
