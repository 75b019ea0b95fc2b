"""Sandboxes on one host: an image's writable overlay run by crun, with exec, files,
pause/resume, checkpoint/restore, receipts, and cleanup that survives a crash.

What lives where (layout in :mod:`sandbox.core.paths`, formats in docs/FORMAT.md)::

    sandbox/runtime/              crun --root (its own container state)
    sandbox/boxes/<id>/state.json the SandboxState (sandbox.core.model), written before anything it names exists
    sandbox/boxes/<id>/bundle/    config.json and each running exec's process document and pid file
    sandbox/boxes/<id>/rootfs/    the writable overlay (a HostMounts mount), mounted here only until the
                                  container is created: then its init's mount namespace holds it and it
                                  leaves the host's mount table (files go through /proc/<init>/root)
    sandbox/boxes/<id>/disk.img, disk/  the sandbox's own ext4 (only with a disk limit; holds the upper)
    sandbox/receipts/<id>.jsonl   the receipt log (sandbox.core.receipts; kept after destroy)
    sandbox/userns.json           host uid ranges of user-namespaced sandboxes (sandbox.isolation.idmap RangePool)
    sandbox/leases.json           job leases and their admission state (sandbox.core.leases)
    net/                          network namespaces and address allocations (sandbox.isolation.network)

Every id is checked (:func:`sandbox.core.model.check_sandbox_id`) before it becomes a path,
and the manager never reads a file a sandbox can write as its own state: the init's
pid comes from crun and is trusted only while the kernel puts it in the sandbox's cgroup.

Store-facing calls (create, restore, checkpoint) are coroutines; runtime and
file calls are blocking and meant for a thread when the caller is async.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import contextlib
import contextvars
import functools
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import blake3

from layerstore.errors import LayerstoreError
from layerstore.objects import SCHEMA_RECEIPTS, Resolved
from layerstore.store import Store
from lazyfetch import kmount
from lazyfetch.errors import KernelMountError, LazyfetchError
from lazyfetch.mounts import HostMounts, MountError
from sandbox.backends.container.files import RootFiles
from sandbox.backends.container.runtime import ConsoleSocket, OciRuntime, kill_group
from sandbox.backends.container.spec import (
    DEFAULT_PATH,
    IDLE_INIT,
    Limits,
    build_process,
    build_spec,
)
from sandbox.backends.vm import assets as vmassets
from sandbox.backends.vm import qemu as vm
from sandbox.backends.vm.agent import AgentError
from sandbox.backends.vm.backend import GuestFiles, Vms
from sandbox.core.errors import (
    CommandInProgress,
    InvalidField,
    JobNotAdmitting,
    ReceiptsBroken,
    RuntimeFailed,
    SandboxError,
    SandboxNotFound,
    SandboxStateError,
    StateUnreadable,
    UnsupportedOption,
)
from sandbox.core.leases import Leases
from sandbox.core.model import (
    DEFAULT_OUTPUT_CAP,
    POOL_LABEL,
    SCHEMA_OPTIONS,
    EgressRule,
    ExecRequest,
    SandboxOptions,
    SandboxState,
    check_sandbox_id,
    new_sandbox_id,
    project_namespace,
)
from sandbox.core.paths import SandboxPaths, read_beneath, replace_beneath
from sandbox.core.receipts import ReceiptLogs, verify_receipt_chain
from sandbox.host.execs import (
    KEYED_OUTPUT_CAP,
    Attach,
    Cancel,
    Cut,
    ExecResult,
    Pumped,
    kill_tree,
    proc_stat,
    pump,
    replay,
    was_interrupted,
)
from sandbox.isolation import disk as sbdisk
from sandbox.isolation import idmap
from sandbox.isolation.cgroups import CgroupLayout, preflight_cgroups
from sandbox.isolation.network import NetworkManager, diff_counters
from snapshots import vmstate
from snapshots.checkpoint import Checkpoint, Snapshots
from snapshots.errors import SnapshotError

log = logging.getLogger("layerbox.sandbox")
T = TypeVar("T")

__all__ = ["Cancel", "ExecResult", "Sandbox", "SandboxManager", "become_subreaper"]

PR_SET_CHILD_SUBREAPER = 36
# Host uids of user-namespaced sandboxes: 64 regions of USERNS_SLOTS ranges from 2^30, one region per
# data dir (like the subnet), so two managers on one machine rarely share a uid; far above the
# 100000.. ranges /etc/subuid hands to users.
USERNS_FIRST = 1 << 30
USERNS_SLOTS = 256
EXEC_PREFIX = "exec-"
# what an exec_started receipt says that the receipt of a command a crash interrupted repeats
CARRIED = ("idempotency_key", "background", "command_id", "tty")


def become_subreaper() -> None:
    """For a long-lived manager service: orphans of crun land here, not on a slow PID 1."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise SandboxError(f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(ctypes.get_errno())}")


# The caller's set of sandbox ids being made for it: every id a create, restore or adopt in this
# context picks is added before its state is first written, so a quota counting states can tell
# the sandboxes of creates still in flight (counted apart) from finished ones.
IN_FLIGHT: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar("layerbox_in_flight", default=None)


def _in_flight(sid: str) -> None:
    made = IN_FLIGHT.get()
    if made is not None:
        made.add(sid)


def limits_of(options: SandboxOptions) -> Limits:
    return Limits(cpu=options.cpu, memory=options.memory, pids=options.pids,
                  best_effort=options.cpu_class == "best-effort")


def _uid_gid(files: RootFiles | GuestFiles, user: str) -> tuple[int, int]:
    """An OCI ``User`` ("", "name", "uid", "uid:gid", "name:group") looked up in the rootfs.

    The rootfs may hold an earlier agent's writes (a restored checkpoint): its passwd is
    the sandbox's own business, but a malformed line must not become our error.
    """
    if not user:
        return 0, 0
    name, _, group = user.partition(":")

    def lookup(path: str, key: str, field: int) -> int | None:
        if key.isdigit():
            return int(key)
        try:
            text = files.read(path).decode(errors="replace")
        except OSError:
            return None
        for line in text.splitlines():
            parts = line.split(":")
            if len(parts) > field and parts[0] == key and parts[field].isdigit():
                return int(parts[field])
        return None

    uid = lookup("/etc/passwd", name, 2)
    if uid is None:
        raise UnsupportedOption(f"user {name!r} is not in the image's /etc/passwd")
    if group:
        gid = lookup("/etc/group", group, 2)
        if gid is None:
            raise UnsupportedOption(f"group {group!r} is not in the image's /etc/group")
        return uid, gid
    if name.isdigit():
        return uid, uid
    gid = lookup("/etc/passwd", name, 3)
    return uid, gid if gid is not None else uid


class Sandbox:
    """One sandbox; get it from :class:`SandboxManager` (``get``, ``create``), not by constructing it."""

    def __init__(self, manager: SandboxManager, sid: str) -> None:
        self.manager = manager
        self.id = check_sandbox_id(sid)
        self.dir = manager.paths.box(sid)
        self.rootfs = self.dir / "rootfs"
        self.bundle = self.dir / "bundle"
        self._exec_seq = 0

    @functools.cached_property
    def files(self) -> RootFiles | GuestFiles:
        """The host file API of this rootfs (idmap-aware when the sandbox has a user namespace);
        a microVM's files, through its guest agent."""
        try:
            st: SandboxState | None = self.state
        except SandboxNotFound:
            st = None
        if st is not None and st.options.is_vm:
            return GuestFiles(lambda: self.manager.vms.conn(self.id, self.dir, self.state))
        return RootFiles(self.rootfs, idmap=st.userns if st else None, open_root=self._open_root, no_xdev=True)

    @property
    def is_vm(self) -> bool:
        return self.state.options.is_vm

    def init_pid(self, st: SandboxState | None = None) -> int:
        """The container's init, checked: same start time as recorded and a task of this
        sandbox's own cgroup (a reused pid, or any other process, is refused)."""
        st = st or self.state
        if st.pid is None or st.init_start is None or not st.live:
            raise SandboxStateError(f"sandbox {self.id} is {st.status}: it has no running init")
        stat = proc_stat(st.pid)
        if stat is None or stat[1] != st.init_start or not self.manager.layout.holds(st.pid, st.cgroups_path):
            raise SandboxStateError(f"sandbox {self.id}: its init ({st.pid}) is gone; destroy it or restore "
                                    "its last checkpoint")
        return st.pid

    def _open_root(self) -> int:
        """The rootfs on the host while it is mounted there (creating), else the container's root."""
        flags = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
        if kmount.is_mountpoint(self.rootfs):
            return os.open(self.rootfs, flags)
        st = self.state
        if not st.live:
            raise SandboxStateError(f"sandbox {self.id} is {st.status}: its files are reachable only "
                                    "while it runs (or is paused)")
        pid = self.init_pid(st)
        fd = os.open(f"/proc/{pid}/root", flags)
        try:  # opened first, checked again after: a pid reused in between shows another start time
            self.init_pid(st)
        except BaseException:
            os.close(fd)
            raise
        return fd

    # -- state ------------------------------------------------------------------------------------
    @property
    def state(self) -> SandboxState:
        return self.manager._read_state(self.id)

    def _update(self, **changes: Any) -> SandboxState:
        with self.manager._lock:  # read-modify-write: exec threads and preemption both write here
            st = self.state.replace(**changes)
            self.manager._write_state(st)
            return st

    @property
    def pid(self) -> int:
        return self.init_pid()

    def _receipt(self, action: str, **fields: Any) -> dict[str, Any]:
        try:
            st: SandboxState | None = self.state
        except SandboxNotFound:
            st = None
        rec = {"id": uuid.uuid4().hex[:16], "sandbox": self.id, "action": action, "time": time.time(),
               "image": st.image_digest if st else None, "labels": dict(st.labels) if st else {}, **fields}
        self.manager.receipt_logs.append(self.id, rec)
        if st is not None:
            self._update(last_active=time.time())
        return rec

    def receipts(self) -> builtins.list[dict[str, Any]]:
        return self.manager.receipts(self.id)

    def _require_running(self, st: SandboxState) -> None:
        if st.status != "running":
            raise SandboxStateError(f"sandbox {self.id} is {st.status}, not running")

    # -- exec ---------------------------------------------------------------------------------------
    def exec(self, cmd: Sequence[str] | str | ExecRequest, *, env: Mapping[str, str] | None = None,
             cwd: str | None = None, timeout: float | None = None, stdin: bytes | None = None,
             output_cap: int = DEFAULT_OUTPUT_CAP,
             on_stdout: Callable[[bytes], None] | None = None,
             on_stderr: Callable[[bytes], None] | None = None,
             idempotency_key: str | None = None, cancel: Cancel | None = None,
             keep_output: bool = True, on_cut: Callable[[Cut], None] | None = None,
             attach: Attach | None = None) -> ExecResult:
        """Run ``cmd`` (a string goes through ``/bin/sh -c``) and collect at most ``output_cap`` bytes per stream.

        ``cmd`` is an :class:`ExecRequest` or the fields to make one (validated the
        same way).  Output past the cap is still read (so the command never blocks on
        a full pipe) but dropped, and ``truncated`` is set; callbacks see at most the
        cap too, and ``on_cut`` hears where a stream was cut (with ``keep="tail"`` the
        stream's last bytes follow the cut).  ``keep_output=False`` keeps no output in
        the result (a caller that streams it); a keyed command still keeps what its
        receipt needs.  On
        ``timeout`` or when ``cancel`` is set, the process, every descendant and every
        orphan it left to the sandbox's init are SIGKILLed under the freezer.

        ``attach`` (:mod:`sandbox.edge.commands`): the command's stdin stays open, or it
        runs on a terminal; an ``exec_started`` receipt is written before it runs, with
        the fields ``attach.started()`` gives (reconcile carries them into the receipt
        of a command a crash interrupted), and its ``exec`` receipt has ``attach.finished()``'s.

        With ``idempotency_key``, a command that already ran under that key in
        this sandbox (or in the checkpoint it was restored from) is not run
        again: its recorded result comes back with ``replayed`` set; with
        ``rerun_if_interrupted``, one whose run was cut short (``interrupted``) runs again.
        """
        req = cmd if isinstance(cmd, ExecRequest) else ExecRequest(
            cmd=cmd if isinstance(cmd, str) else tuple(cmd), env=env or {}, cwd=cwd, timeout=timeout, stdin=stdin,
            output_cap=output_cap, idempotency_key=idempotency_key)
        cancel = cancel or Cancel()
        key = req.idempotency_key
        earlier: ExecResult | None = None
        self._exec_seq += 1
        tag = f"{EXEC_PREFIX}{os.getpid()}-{self._exec_seq}-{uuid.uuid4().hex[:6]}"
        mgr = self.manager
        with mgr._lock:
            # admission and registration under one lock: preemption either sees this exec or refuses it
            st = self.state
            self._require_running(st)
            if not st.admitting:
                raise JobNotAdmitting(f"sandbox {self.id}: job {st.job!r} is being preempted; "
                                      "retry after it is resumed")
            if key is not None:
                if (self.id, key) in mgr._keys_running:
                    raise CommandInProgress(f"sandbox {self.id}: a command with idempotency key "
                                            f"{key!r} is still running")
                rec = mgr.receipt_logs.keyed(self.id, key)
                if rec is not None and not (req.rerun_if_interrupted and was_interrupted(rec)):
                    earlier = replay(rec)
                if earlier is None:
                    mgr._keys_running.add((self.id, key))
            if earlier is None:
                mgr._inflight.setdefault(self.id, {})[tag] = cancel
        if earlier is not None:
            for name, data, cb in (("stdout", earlier.stdout, on_stdout), ("stderr", earlier.stderr, on_stderr)):
                # a streaming caller sees the answer the same way, its cut where the receipt's bytes end
                cut = next((c for c in earlier.cuts if c.stream == name), None)
                if cut is not None and cut.offset == 0 and on_cut is not None:
                    on_cut(cut)
                if data and cb is not None:
                    cb(data)
                if cut is not None and cut.offset > 0 and on_cut is not None:
                    on_cut(cut)
            return earlier
        try:
            if key is not None or attach is not None:
                # a crash during the command leaves this behind: a retry then learns it was interrupted,
                # and reconcile finds the key of the exec files named ``tag`` (not by the command's text:
                # the same command may run with and without a key), or that it ran in the background
                self._receipt("exec_started", command=req.argv, **({"idempotency_key": key} if key else {}),
                              tag=tag, **(attach.started() if attach is not None else {}))
            if st.options.is_vm:
                if attach is not None:
                    raise UnsupportedOption(f"sandbox {self.id} is a {st.options.isolation}: interactive commands "
                                            "(stdin left open, a terminal) are not available for VMs yet")
                return self._exec_vm(st, req, on_stdout, on_stderr, cancel, keep_output, on_cut)
            return self._exec(tag, st, req, on_stdout, on_stderr, cancel, keep_output, on_cut,
                              attach=attach)
        finally:
            with mgr._lock:
                running = mgr._inflight.get(self.id, {})
                running.pop(tag, None)
                if not running:
                    mgr._inflight.pop(self.id, None)
                if key is not None:
                    mgr._keys_running.discard((self.id, key))

    def _exec(self, tag: str, st: SandboxState, req: ExecRequest, on_stdout: Callable[[bytes], None] | None,
              on_stderr: Callable[[bytes], None] | None, cancel: Cancel, keep_output: bool,
              on_cut: Callable[[Cut], None] | None = None,
              attach: Attach | None = None) -> ExecResult:
        mgr, cg = self.manager, st.cgroups_path
        args = req.argv
        workdir = req.cwd or st.cwd
        process_file, pid_file = self.bundle / f"{tag}.json", self.bundle / f"{tag}.pid"
        process = build_process(args, env={**st.env, **req.env}, cwd=workdir, uid=st.uid, gid=st.gid)
        terminal = attach.terminal if attach is not None else None
        if terminal is not None:  # crun makes the pty in the sandbox's own devpts and sends us its master
            process.update(terminal=True, consoleSize={"width": terminal[0], "height": terminal[1]})
        replace_beneath(mgr.paths.boxes, f"{self.id}/bundle/{tag}.json", json.dumps(process).encode())
        oom_before = mgr.layout.oom_kills(cg)
        policed = st.network is not None
        egress_before = mgr.net.counters(self.id) if policed else None
        cpu_before = mgr.layout.cpu_seconds(cg)
        started = time.perf_counter()
        stdin: Any = subprocess.PIPE if req.stdin is not None else subprocess.DEVNULL
        if attach is not None:  # its owner writes the input (never req.stdin: pump would close it)
            assert req.stdin is None
            stdin = attach.stdin_fd if attach.stdin_fd is not None and terminal is None else subprocess.DEVNULL
        console = ConsoleSocket() if terminal is not None else None
        try:
            proc = mgr.runtime.exec(self.id, process_file, pid_file=pid_file, stdin=stdin,
                                    sched_idle=st.options.cpu_class == "best-effort",
                                    console_socket=console.path if console is not None else None)
        except BaseException:
            if console is not None:
                console.close()
            raise
        finally:
            if attach is not None:
                attach.spawned()
        master: int | None = None
        if console is not None:
            assert attach is not None
            try:  # crun sends the master before it starts the command
                master = console.receive(proc)
                attach.on_terminal(os.dup(master))
            except BaseException as exc:
                kill_group(proc)
                if master is not None:
                    os.close(master)
                process_file.unlink(missing_ok=True)
                pid_file.unlink(missing_ok=True)
                if isinstance(exc, RuntimeFailed) and (
                        "is paused" in str(exc) or (mgr.runtime.state(self.id) or {}).get("status") == "paused"):
                    # a pause (a request, the reaper's idle pause) landed between our check and crun's,
                    # found by the API fuzzer; crun says so ("the container `...` is paused"), and its
                    # state may say running again by the time we ask: a 409 either way
                    raise SandboxStateError(f"sandbox {self.id} was paused meanwhile; resume it first") from None
                raise
            finally:
                console.close()
        exec_start = proc_stat(proc.pid)
        since = exec_start[1] if exec_start else 0
        keep = req.output_cap if keep_output else (KEYED_OUTPUT_CAP if req.idempotency_key else 0)
        try:
            out = pump(proc, req.stdin, cap=req.output_cap, keep=min(keep, req.output_cap), timeout=req.timeout,
                       on_stdout=on_stdout, on_stderr=on_stderr, cancel=cancel,
                       kill=lambda: self._kill_exec(pid_file, since, st), tail=req.keep == "tail", on_cut=on_cut,
                       tty=master)
        finally:
            if proc.poll() is None:
                kill_group(proc)
            proc.wait()
            if master is not None:
                os.close(master)
            process_file.unlink(missing_ok=True)
            pid_file.unlink(missing_ok=True)
        oom = mgr.layout.oom_kills(cg) > oom_before
        return self._record_exec(st, req, args, workdir, out, proc.returncode, time.perf_counter() - started,
                                 cancel, oom, cpu_before, egress_before,
                                 attach.finished() if attach is not None else {})

    def _exec_vm(self, st: SandboxState, req: ExecRequest, on_stdout: Callable[[bytes], None] | None,
                 on_stderr: Callable[[bytes], None] | None, cancel: Cancel, keep_output: bool,
                 on_cut: Callable[[Cut], None] | None) -> ExecResult:
        """A command in the guest through its agent, streamed, capped and timed out by the same
        ``pump`` as a container's (the agent's output arrives in OS pipes)."""
        mgr, cg = self.manager, st.cgroups_path
        args, workdir = req.argv, req.cwd or st.cwd
        conn = mgr.vms.conn(self.id, self.dir, st)
        egress_before = mgr.net.counters(self.id) if st.network is not None else None
        cpu_before = mgr.layout.cpu_seconds(cg)
        started = time.perf_counter()
        try:
            proc = conn.exec(list(args), env={**st.env, **req.env}, cwd=workdir, uid=st.uid, gid=st.gid)
        except AgentError as exc:
            raise SandboxStateError(f"sandbox {self.id}: its guest agent: {exc}") from None
        keep = req.output_cap if keep_output else (KEYED_OUTPUT_CAP if req.idempotency_key else 0)

        def kill() -> bool:
            proc.kill()
            return True

        try:
            out = pump(proc, req.stdin, cap=req.output_cap, keep=min(keep, req.output_cap),  # type: ignore[arg-type]
                       timeout=req.timeout, on_stdout=on_stdout, on_stderr=on_stderr, cancel=cancel, kill=kill,
                       tail=req.keep == "tail", on_cut=on_cut)
        finally:
            if proc.poll() is None:
                proc.kill()
        try:
            rc: int | None = proc.wait(5.0)
        except TimeoutError:
            rc = None
        return self._record_exec(st, req, args, workdir, out, rc, time.perf_counter() - started, cancel, False,
                                 cpu_before, egress_before, {"isolation": st.options.isolation})

    def _record_exec(self, st: SandboxState, req: ExecRequest, args: Sequence[str], workdir: str, out: Pumped,
                     rc: int | None, duration: float, cancel: Cancel, oom: bool, cpu_before: float | None,
                     egress_before: Mapping[str, Any] | None, more: Mapping[str, Any]) -> ExecResult:
        """The result of a finished command and its ``exec`` receipt, for every backend: the
        sandbox's cgroup over the command's span (background processes included; a microVM's is
        its VMM's), the network verdicts, and what a keyed command's replay needs."""
        mgr, cg = self.manager, st.cgroups_path
        interrupted = cancel.reason if cancel.is_set() else None
        killed = out.timed_out or interrupted is not None
        sig = int(signal.SIGKILL) if killed else (rc - 128 if rc is not None and 128 < rc <= 128 + 64 else None)
        result = ExecResult(rc, sig, out.stdout, out.stderr, out.truncated, round(duration, 6), out.timed_out,
                            oom, interrupted, cuts=out.cuts)
        cpu_after = mgr.layout.cpu_seconds(cg)
        extra: dict[str, Any] = {
            "resources": {"cpu_seconds": round(cpu_after - cpu_before, 6)
                          if cpu_before is not None and cpu_after is not None else None,
                          "memory_peak": mgr.layout.memory_peak(cg), "pids": mgr.layout.pids_current(cg)}}
        if egress_before is not None:  # what the network policy allowed and denied during the command
            extra["egress"] = diff_counters(egress_before, mgr.net.counters(self.id))
        extra.update(more)
        if req.keep != "head":
            extra["keep"] = req.keep
        if req.idempotency_key is not None:
            kept = slice(-KEYED_OUTPUT_CAP, None) if req.keep == "tail" else slice(KEYED_OUTPUT_CAP)
            extra.update(idempotency_key=req.idempotency_key,
                         stdout=base64.b64encode(out.stdout[kept]).decode(),
                         stderr=base64.b64encode(out.stderr[kept]).decode())
        self._receipt("exec", command=list(args), cwd=workdir, exit_code=rc, signal=sig, timed_out=out.timed_out,
                      oom_killed=oom, interrupted=interrupted, stdout_bytes=out.sizes[0], stderr_bytes=out.sizes[1],
                      stdout_blake3=out.digests[0], stderr_blake3=out.digests[1], truncated=out.truncated,
                      duration=result.duration, cpu_class=st.options.cpu_class,
                      policy_version=st.policy_version, **extra)
        return result

    def _kill_exec(self, pid_file: Path, since: int, st: SandboxState) -> bool:
        """Kill an exec's tree; False while crun has not yet written the command's pid."""
        try:
            root = int(read_beneath(self.manager.paths.boxes, f"{self.id}/bundle/{pid_file.name}").strip())
        except (OSError, ValueError):
            return False
        if not self.manager.layout.holds(root, st.cgroups_path):
            # gone already (nothing left to kill), or not (yet) in the sandbox's cgroup: a pid
            # that is not the sandbox's own is never signalled, the caller tries again
            return proc_stat(root) is None
        kill_tree(self.manager.runtime, self.id, self.init_pid(st), root, since)
        return True

    # -- files --------------------------------------------------------------------------------------
    def read(self, path: str) -> bytes:
        data = self.files.read(path)
        self._receipt("read", path=path, bytes=len(data))
        return data

    def write(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self.files.write(path, data, mode)
        self._receipt("write", path=path, bytes=len(data), blake3=blake3.blake3(data).hexdigest())

    def upload(self, path: str, src: Any, mode: int = 0o644) -> int:
        n = self.files.upload(path, src, mode)
        self._receipt("upload", path=path, bytes=n)
        return n

    def download(self, path: str, dst: Any) -> int:
        n = self.files.download(path, dst)
        self._receipt("download", path=path, bytes=n)
        return n

    def list(self, path: str = "/") -> list[dict[str, Any]]:
        return self.files.list(path)

    def stat(self, path: str) -> os.stat_result:
        return self.files.stat(path)

    def remove(self, path: str, *, recursive: bool = False) -> None:
        self.files.remove(path, recursive=recursive)
        self._receipt("remove", path=path)

    # -- network ------------------------------------------------------------------------------------
    def set_network(self, rules: Sequence[EgressRule | Mapping[str, Any]]) -> dict[str, Any]:
        """Replace the egress allow rules while the sandbox runs (it must have been created with a network)."""
        st = self.state
        if st.network is None:
            raise SandboxStateError(f"sandbox {self.id} was created without a network (loopback only); "
                                    "create it with network=[...] to police egress")
        options = st.options.replace(network=tuple(EgressRule.parse(r) for r in rules))
        assert options.network is not None
        policy = self.manager.net.set_policy(self.id, list(options.network))
        self._update(network={**st.network, "policy": policy}, options=options)
        self._receipt("network", version=policy.get("version"), rules=policy.get("rules"))
        return policy

    # -- lifetime -------------------------------------------------------------------------------------
    def set_ttl(self, seconds: float, *, max_lifetime: float | None = None) -> SandboxState:
        """Destroy the sandbox ``seconds`` from now rather than when its ttl said (longer or shorter).

        Kept as its options' ``ttl`` (its age at destruction, which the reaper compares), so the
        state's format is unchanged; ``max_lifetime`` bounds that age (an edge's ``Maxima.ttl``).
        """
        with self.manager._lock:  # read-modify-write of the options
            st = self.state
            if not st.live:
                raise SandboxStateError(f"sandbox {self.id} is {st.status}")
            age = max(0.0, time.time() - st.created)
            ttl = round(age + seconds, 3)
            if max_lifetime is not None and ttl > max_lifetime:
                raise InvalidField("ttl", f"{seconds:g} s from now would make sandbox {self.id} {ttl:.0f} s old, "
                                          f"above this edge's maximum lifetime of {max_lifetime:g} s (at most "
                                          f"{max(0.0, max_lifetime - age):.0f} s more)")
            was = st.options.ttl
            st = self._update(options=st.options.replace(ttl=ttl))
        self._receipt("ttl", ttl=ttl, was=was, expires=round(st.created + ttl, 3))
        return st

    # -- pause / resume -----------------------------------------------------------------------------
    def pause(self, *, reclaim: bool = True) -> dict[str, Any]:
        """Freeze every process, then push the sandbox's page cache out of memory."""
        st = self.state
        self._require_running(st)
        if st.options.is_vm:
            if reclaim:
                return _sync(self._pause_vm_to_store())
            self.manager.vms.pause(self.id, self.dir, st)
            self._update(status="paused")
            rec = self._receipt("pause", reclaim=None, isolation=st.options.isolation)
            return {"reclaim": None, "receipt": rec["id"]}
        self._runtime(self.manager.runtime.pause)
        self._update(status="paused")
        freed = self.manager.layout.reclaim(st.cgroups_path) if reclaim else None
        rec = self._receipt("pause", reclaim=freed)
        return {"reclaim": freed, "receipt": rec["id"]}

    def resume(self) -> None:
        st = self.state
        if st.status != "paused":
            raise SandboxStateError(f"sandbox {self.id} is {st.status}, not paused")
        if st.options.is_vm:
            if (st.vm or {}).get("saved") == "store":
                _sync(self._resume_vm_from_store())
                return
            record, seconds = self.manager.vms.resume(self.id, self.dir, st, st.cgroups_path)
            self._update(status="running", vm=record, pid=record["vmm_pid"], init_start=record["vmm_start"])
            self._receipt("resume", isolation=st.options.isolation, resume_seconds=round(seconds, 6))
            return
        self._runtime(self.manager.runtime.resume)
        self._update(status="running")
        self._receipt("resume")

    async def _pause_vm_to_store(self) -> dict[str, Any]:
        """A VM's pause with reclaim, which frees the host: a checkpoint with memory of it
        (disk, RAM, device state of one instant) into the store, its guest left stopped after
        the capture; then its VMM stopped and its disk files and mounts here removed.  Its
        state keeps the checkpoint (``vm.paused_checkpoint``): a resume here, or a restore of
        it on any host, goes on from there."""
        st = self.state
        started = time.perf_counter()
        last = self.manager.receipts(self.id)
        head = verify_receipt_chain(last, what=f"sandbox {self.id}'s receipts")
        ckpt = await self._checkpoint_vm(st, last, head, name=None, labels=None, trajectory_offset=None,
                                         policy_version=None, memory=True, keep_stopped=True)
        # the state says paused first: a crash from here on leaves a sandbox to resume from the store
        self._update(status="paused", vm={**(self.state.vm or {}), "saved": "store", "paused_checkpoint": ckpt.digest})
        record = await asyncio.to_thread(self.manager.vms.release, self.id, self.dir, self.state)
        self._update(vm=record, pid=None, init_start=None)
        reclaim = {"checkpoint": ckpt.name, "digest": ckpt.digest, "stopped_seconds": ckpt.freeze_seconds,
                   "bytes_uploaded": ckpt.bytes_uploaded, "save_seconds": round(time.perf_counter() - started, 6),
                   "page_cache": self.manager.layout.reclaim(st.cgroups_path)}
        rec = self._receipt("pause", reclaim=reclaim, isolation=st.options.isolation)
        return {"reclaim": reclaim, "receipt": rec["id"]}

    async def _resume_vm_from_store(self) -> None:
        """Resume a VM paused to the store: its checkpoint restored in place (the same sandbox,
        network and limits), the guest going on where the pause stopped it."""
        st = self.state
        assert st.vm is not None
        mgr = self.manager
        started = time.perf_counter()
        async with await mgr._store() as store:
            resolved = await store.resolve(st.vm["paused_checkpoint"], refresh=True)
        await asyncio.to_thread(mgr.vms.release, self.id, self.dir, st)  # what a crash in the pause left
        assets = await asyncio.to_thread(mgr.vms.assets_by_key, st.vm["assets"])
        why = mgr.vms.memory_mismatch(resolved, assets)
        if why is not None:
            raise SandboxStateError(f"sandbox {self.id}: its paused memory does not load on this host ({why}); "
                                    f"restore {resolved.digest} on a host where it does")
        record, _, _ = await asyncio.to_thread(mgr.vms.launch, self.id, self.dir, resolved, st.options,
                                               st.cgroups_path, None, assets, st.vm)
        record.update(parent=resolved.digest, checkpoints=st.vm.get("checkpoints", 0))
        self._update(status="running", vm=record, pid=record["vmm_pid"], init_start=record["vmm_start"])
        self._receipt("resume", isolation=st.options.isolation, checkpoint=resolved.digest,
                      resume_seconds=round(time.perf_counter() - started, 6))

    @contextlib.contextmanager
    def _frozen(self) -> Iterator[None]:
        if self.state.status == "paused":
            yield
            return
        self._runtime(self.manager.runtime.pause)
        try:
            yield
        finally:
            self._runtime(self.manager.runtime.resume)

    def _runtime(self, op: Callable[[str], None]) -> None:
        """One crun command on this sandbox; when it fails because the sandbox was destroyed
        meanwhile (the reaper, another request), that is :class:`SandboxNotFound`, not a fault."""
        try:
            op(self.id)
        except RuntimeFailed:
            if not self.manager.exists(self.id):
                raise SandboxNotFound(f"sandbox {self.id} was destroyed meanwhile") from None
            raise

    # -- checkpoint ---------------------------------------------------------------------------------
    async def checkpoint(self, *, name: str | None = None, labels: Mapping[str, str] | None = None,
                         trajectory_offset: int | None = None, policy_version: str | None = None,
                         memory: bool = False) -> Checkpoint:
        """Capture the rootfs' writes (processes frozen meanwhile) as a checkpoint in the store.

        ``name`` is the ref to move (default ``checkpoints/<record id>:<n>``, under its
        project's namespace for a project's sandbox); the checkpoint carries the sandbox's
        labels (its project among them) and receipts.  ``memory`` (microVMs only): the VM's
        RAM and device state too, so a restore on a host of the same QEMU and guest assets
        goes on with the same processes.
        """
        st = self.state
        if not st.live:
            raise SandboxStateError(f"sandbox {self.id} is {st.status}")
        if memory and not st.options.is_vm:
            raise UnsupportedOption(f"memory: sandbox {self.id} is a container: its checkpoints hold files, "
                                    "not processes (isolation=microvm or vm checkpoints memory too)")
        last = self.manager.receipts(self.id)
        head = verify_receipt_chain(last, what=f"sandbox {self.id}'s receipts")  # never carry a broken log on
        if st.options.is_vm:
            return await self._checkpoint_vm(st, last, head, name=name, labels=labels, memory=memory,
                                             trajectory_offset=trajectory_offset, policy_version=policy_version)
        async with await self.manager._store() as store:
            # receipts travel with the checkpoint: a restored sandbox knows its history and idempotency keys
            receipts = {"schema": SCHEMA_RECEIPTS, "sandbox": self.id, "receipts": last, "head": head}
            ckpt = await Snapshots(store, self.manager.host).checkpoint(
                str(self.rootfs), name=name, labels={**st.labels, **(labels or {})},
                trajectory_offset=trajectory_offset if trajectory_offset is not None else len(last),
                receipt_id=last[-1]["id"] if last else None,
                policy_version=policy_version if policy_version is not None else st.policy_version,
                freeze=self._frozen,
                attach_docs={"receipts": receipts,
                             "options": {"schema": SCHEMA_OPTIONS, "options": st.options.carried()}},
                name_prefix=project_namespace(st.project) if st.project else "")
        self._receipt("checkpoint", checkpoint=ckpt.name, digest=ckpt.digest, freeze_seconds=ckpt.freeze_seconds,
                      bytes_changed=ckpt.bytes_changed)
        return ckpt

    async def _checkpoint_vm(self, st: SandboxState, last: builtins.list[dict[str, Any]], head: str | None, *,
                             name: str | None, labels: Mapping[str, str] | None, trajectory_offset: int | None,
                             policy_version: str | None, memory: bool, keep_stopped: bool = False) -> Checkpoint:
        """A microVM's checkpoint: its whole disk, stopped and flushed, as the checkpoint's disk
        layer (chunks dedup against its parent's), and with ``memory`` its RAM image beside it;
        the chain is kept in its VM record."""
        assert st.vm is not None
        if st.status == "paused":
            # the guest's own page cache may hold writes its disk does not have yet: it runs for the
            # capture (a sync, then stopped again for the copy) and is paused again after
            saved = bool(st.vm.get("saved"))
            if st.vm.get("saved") == "store":
                await self._resume_vm_from_store()
            else:
                await asyncio.to_thread(self.resume)
            try:
                last = self.manager.receipts(self.id)  # the resume's record is the history's last now
                head = verify_receipt_chain(last, what=f"sandbox {self.id}'s receipts")
                return await self._checkpoint_vm(self.state, last, head, name=name, labels=labels, memory=memory,
                                                 trajectory_offset=trajectory_offset, policy_version=policy_version)
            finally:
                if saved:
                    await self._pause_vm_to_store()
                else:
                    await asyncio.to_thread(self.pause, reclaim=False)
        mgr = self.manager
        record = dict(st.vm)
        seq = int(record.get("checkpoints", 0)) + 1
        parent = record.get("parent") or st.image_digest
        prefix = project_namespace(st.project) if st.project else ""
        async with await mgr._store() as store:
            receipts = {"schema": SCHEMA_RECEIPTS, "sandbox": self.id, "receipts": last, "head": head}
            def on_snapshot(rec: dict[str, Any]) -> None:  # the VM's disk chain changed: state says so at once
                with mgr._lock:
                    self._update(vm={**(self.state.vm or {}), "disk_nodes": rec["disk_nodes"], "disk_chain": None,
                                     "disk_top_node": rec["disk_top_node"]})

            ckpt = await Snapshots(store, mgr.host).checkpoint_disk(
                parent, lambda out: mgr.vms.capture(self.id, self.dir, self.state, out, memory=memory,
                                                    on_snapshot=on_snapshot, keep_stopped=keep_stopped),
                ref_name=name or f"{prefix}checkpoints/{self.id}:{seq}", memory=memory, isolation=st.options.isolation,
                base=record.get("disk_chain") or (),
                chunk_size=vmstate.VM_CHUNK_SIZE,
                vm={**{k: record[k] for k in ("machine", "shape")}, **mgr.vms.vm_identity(record["assets"]),
                    # its vmstate.bin's page region is the RAM itself (vm.exact_ram_image): mappable
                    **({"ram_image": "exact"} if memory else {})},
                labels={**st.labels, **(labels or {})},
                trajectory_offset=trajectory_offset if trajectory_offset is not None else len(last),
                receipt_id=last[-1]["id"] if last else None,
                policy_version=policy_version if policy_version is not None else st.policy_version,
                attach_docs={"receipts": receipts,
                             "options": {"schema": SCHEMA_OPTIONS, "options": st.options.carried()}})
        async with await mgr._store() as store:
            chain = (await store.resolve(ckpt.digest)).disk_chain
        with mgr._lock:
            fresh = self.state
            assert fresh.vm is not None
            self._update(vm={**fresh.vm, "parent": ckpt.digest, "checkpoints": seq,
                             "disk_chain": [x.to_json() for x in chain]})
        self._receipt("checkpoint", checkpoint=ckpt.name, digest=ckpt.digest, freeze_seconds=ckpt.freeze_seconds,
                      bytes_changed=ckpt.bytes_changed, isolation=st.options.isolation, disk_layer=ckpt.layer,
                      memory=memory)
        return ckpt

    async def fork(self, count: int, options: SandboxOptions | None = None, *, name: str | None = None,
                   labels: Mapping[str, str] | None = None) -> tuple[Checkpoint, builtins.list[Sandbox]]:
        """``count`` new sandboxes on this host that continue from this one's files: one checkpoint,
        restored ``count`` times (:meth:`SandboxManager.restore_many`: all of them or none).

        They start with this sandbox's options (:meth:`SandboxOptions.carried`, and its policy
        version) unless ``options`` are given, and are independent of it and of each other from
        then on.  Processes are not carried (a checkpoint holds files).  The checkpoint stays in
        the store under ``name`` (default ``checkpoints/<id>:<n>``), as any other does.
        """
        ckpt = await self.checkpoint(name=name, labels=labels)
        if options is None:
            st = self.state
            options = SandboxOptions.from_state(st.options.carried()).replace(policy_version=st.policy_version)
        return ckpt, await self.manager.restore_many(ckpt.digest, count, options, name=ckpt.name)

    def destroy(self) -> None:
        self.manager.destroy(self.id)


class SandboxManager:
    """Sandboxes of one host (one data dir) against one store."""

    def __init__(self, data_dir: str | os.PathLike[str], store_url: str | None = None, *,
                 runtime: str = "crun", subnet: str | None = None,
                 userns_range: tuple[int, int] | None = None) -> None:
        """``userns_range``: ``(first host uid, number of 65536-uid ranges)`` for sandboxes created
        with ``userns=True``; by default a region from 2^30 chosen by the data dir."""
        self.data_dir = Path(data_dir).resolve()
        self.store_url = store_url
        self.paths = SandboxPaths(self.data_dir)
        self.root = self.paths.root
        self.boxes = self.paths.boxes
        self.receipts_dir = self.paths.receipts
        self.receipt_logs = ReceiptLogs(self.receipts_dir)
        self.runtime = OciRuntime(self.paths.runtime, binary=runtime)
        self.host = HostMounts(self.data_dir, store_url)
        self.host.on_remount = self._on_remount
        self.vms = Vms(self.data_dir, self.host, lambda: self.layout, lambda: self.net, lambda: self.uid_ranges)
        self.leases = Leases(self.root / "leases.json")
        digest = hashlib.sha256(str(self.data_dir).encode()).hexdigest()
        # one cgroup parent per data dir: two managers on one machine never share cgroups
        self.cgroup_parent = "layerbox-" + digest[:10]
        self._layout: CgroupLayout | None = None
        self._lock = threading.RLock()
        self._inflight: dict[str, dict[str, Cancel]] = {}  # sandbox -> running execs (this process)
        self._states: dict[str, tuple[bytes, SandboxState]] = {}  # the last parse of each state file
        self._keys_running: set[tuple[str, str]] = set()
        self._net: NetworkManager | None = None
        # a /16 per data dir, so two managers (two tests, two "hosts" on one machine) never overlap
        self.subnet = subnet or f"10.{64 + int(digest, 16) % 64}.0.0/16"
        if userns_range is None:
            region = int(digest, 16) % 64
            userns_range = (USERNS_FIRST + region * USERNS_SLOTS * idmap.RANGE_SIZE, USERNS_SLOTS)
        self.uid_ranges = idmap.RangePool(self.root / "userns.json", *userns_range)
        self._userns_fds: dict[int, int] = {}  # host_base -> user namespace fd with that mapping (kept)
        # called with a sandbox's id before destroy kills it (sandbox.edge.commands ends its background
        # commands there, so their receipts come before the destroy record)
        self.on_destroy: builtins.list[Callable[[str], None]] = []

    @property
    def net(self) -> NetworkManager:
        """Network namespaces for sandboxes with egress rules (made on first use: it reads host routes)."""
        if self._net is None:
            self._net = NetworkManager(self.data_dir / "net", subnet=self.subnet)
        return self._net

    @property
    def layout(self) -> CgroupLayout:
        if self._layout is None:
            self._layout = preflight_cgroups()
        return self._layout

    async def _store(self) -> Store:
        return await Store.open(self.store_url, self.data_dir)

    # -- state files ---------------------------------------------------------------------------------
    def _read_state(self, sid: str) -> SandboxState:
        """The sandbox's state, parsed and checked once per content of its file.

        The bytes are read every time and compared with those of the last parse (exact: no
        clock or inode number can make a stale parse pass), so listing 1,000 sandboxes is
        1,000 small reads, not 1,000 validations (~0.1 ms each).
        """
        sid = check_sandbox_id(sid)
        try:
            raw = read_beneath(self.boxes, f"{sid}/state.json")
        except FileNotFoundError:
            self._states.pop(sid, None)
            raise SandboxNotFound(f"sandbox {sid}: no such sandbox on this host ({self.boxes})") from None
        cached = self._states.get(sid)
        if cached is not None and cached[0] == raw:
            return cached[1]
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            raise StateUnreadable(f"{self.boxes}/{sid}/state.json: not JSON ({exc})") from None
        st = SandboxState.from_json(doc, where=f"{self.boxes}/{sid}/state.json")
        self._states[sid] = (raw, st)
        return st

    def _write_state(self, st: SandboxState) -> None:
        replace_beneath(self.boxes, f"{st.id}/state.json", json.dumps(st.to_json(), sort_keys=True).encode())

    def exists(self, sid: str) -> bool:
        return (self.paths.box(sid) / "state.json").exists()

    def get(self, sid: str) -> Sandbox:
        """The sandbox ``sid`` (checked against the id grammar first); :class:`SandboxNotFound` if none."""
        box = Sandbox(self, sid)
        box.state  # noqa: B018  (raises SandboxNotFound)
        return box

    def _ids(self, *, strays: builtins.list[str] | None = None) -> builtins.list[str]:
        """Sandbox ids with a directory here; names that are not ids go to ``strays`` (never used as ids)."""
        try:
            names = os.listdir(self.boxes)
        except FileNotFoundError:
            return []
        out = []
        for name in sorted(names):
            try:
                out.append(check_sandbox_id(name))
            except SandboxError:
                if strays is not None:
                    strays.append(name)
        return out

    def list(self, *, job: str | None = None) -> builtins.list[SandboxState]:
        out = []
        for sid in self._ids():
            try:
                st = self._read_state(sid)
            except SandboxNotFound:
                continue  # being created (no state yet) or destroyed meanwhile
            except StateUnreadable as exc:
                log.warning("%s", exc)
                continue
            if job is None or st.job == job:
                out.append(st)
        return out

    def inflight(self, sid: str) -> int:
        with self._lock:
            return len(self._inflight.get(sid, {}))

    def receipts(self, sid: str) -> builtins.list[dict[str, Any]]:
        return self.receipt_logs.read(sid)

    def verify_receipts(self, sid: str) -> dict[str, Any]:
        """Check the sandbox's receipt log end to end: ``{"records": n, "head": hash of the last}``."""
        return self.receipt_logs.verify(sid)

    # -- create / restore -----------------------------------------------------------------------------
    async def create(self, ref: str, options: SandboxOptions | None = None, *, admitting: bool = True,
                     name: str | None = None, **fields: Any) -> Sandbox:
        """Start a sandbox on a writable overlay of ``ref``; returns once ``exec`` works.

        ``options`` is a :class:`SandboxOptions`, or its fields are given as keywords
        (validated the same way).  A checkpoint ref goes through :meth:`restore`, so
        its bound digests and policy are checked first.  ``name`` is what the sandbox
        says it runs (default ``ref``): a caller that resolved and checked a ref passes
        its digest as ``ref``, so nothing can move it in between.
        """
        async with await self._store() as store:
            resolved = await store.resolve(ref)
        if resolved.kind == "checkpoint":
            return await self.restore(ref, options, admitting=admitting, name=name, **fields)
        if resolved.kind not in ("image", "composition"):  # a VM template, a run manifest, receipts
            raise UnsupportedOption(f"{ref} is a {resolved.kind} document ({resolved.digest}), not an image, "
                                    "composition or checkpoint: nothing to run")
        return await self._launch(resolved, ref, _options(options, fields), admitting=admitting, name=name)

    async def restore(self, checkpoint_ref: str, options: SandboxOptions | None = None, *, admitting: bool = True,
                      name: str | None = None, **fields: Any) -> Sandbox:
        """A new sandbox whose rootfs is ``checkpoint_ref`` (made on this host or any other).

        Without ``options``, the sandbox gets the options its source sandbox had (env,
        workdir, user, limits, labels...: :meth:`SandboxOptions.carried`, kept with the
        checkpoint), with ``fields`` over them; ``options`` replaces them all.
        ``policy_version``, when set, must be the policy the checkpoint was made under.
        """
        resolved, options, receipts = await self._restore_plan(checkpoint_ref, options, fields)
        return await self._launch(resolved, checkpoint_ref, options, admitting=admitting, inherited=receipts,
                                  name=name)

    async def restore_many(self, checkpoint_ref: str, count: int, options: SandboxOptions | None = None, *,
                           name: str | None = None, **fields: Any) -> builtins.list[Sandbox]:
        """``count`` sandboxes on one checkpoint, as :meth:`restore` makes one: the checkpoint is read
        and verified once, the sandboxes start together, and either all of them are running when
        this returns or none is left (those made are destroyed, the first failure is raised)."""
        resolved, options, receipts = await self._restore_plan(checkpoint_ref, options, fields)
        launches = asyncio.gather(*(self._launch(resolved, checkpoint_ref, options, admitting=True,
                                                 inherited=receipts, name=name) for _ in range(count)),
                                  return_exceptions=True)
        try:
            results = await asyncio.shield(launches)
        except asyncio.CancelledError:  # the caller left: finish, then take back what was made
            results = await launches
            await asyncio.to_thread(self._destroy_all, [r for r in results if isinstance(r, Sandbox)])
            raise
        made = [r for r in results if isinstance(r, Sandbox)]
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await asyncio.to_thread(self._destroy_all, made)
            raise failed[0]
        return made

    def _destroy_all(self, boxes: Sequence[Sandbox]) -> None:
        for box in boxes:
            with contextlib.suppress(SandboxNotFound):
                self.destroy(box.id)

    async def _restore_plan(self, checkpoint_ref: str, options: SandboxOptions | None, fields: Mapping[str, Any]
                            ) -> tuple[Resolved, SandboxOptions, builtins.list[dict[str, Any]]]:
        """A checkpoint verified against its bound digests and policy, the options to restore it with,
        and the receipts it carries (their chain and head checked)."""
        policy = options.policy_version if options is not None else fields.get("policy_version")
        async with await self._store() as store:
            resolved = await Snapshots(store, self.host).verify_bound(checkpoint_ref, policy_version=policy)
            if options is None:
                options = (await self.carried_options(resolved, store)).overlay(SandboxOptions(**fields), fields)
            receipts: builtins.list[dict[str, Any]] = []
            attached = (resolved.doc.get("attachments") or {}).get("receipts")
            if attached:
                doc = await store.get_doc(attached)
                receipts = list(doc.get("receipts", []))
                head = verify_receipt_chain(receipts, what=f"the receipts of checkpoint {checkpoint_ref}")
                if "head" in doc and doc["head"] != head:
                    raise ReceiptsBroken(f"the receipts of checkpoint {checkpoint_ref} end at {head}, but the "
                                         f"document names {doc['head']} as their last: records were cut off")
        return resolved, options, receipts

    async def carried_options(self, resolved: Resolved, store: Store | None = None) -> SandboxOptions:
        """The options a checkpoint's sandbox had (defaults for a checkpoint made before they were kept)."""
        digest = (resolved.doc.get("attachments") or {}).get("options")
        if not digest:
            return SandboxOptions()
        if store is None:
            async with await self._store() as opened:
                return await self.carried_options(resolved, opened)
        doc = await store.get_doc(digest)
        if doc.get("schema") != SCHEMA_OPTIONS:
            raise StateUnreadable(f"checkpoint {resolved.digest}: its options document is {doc.get('schema')!r}, "
                                  f"not {SCHEMA_OPTIONS}")
        try:
            return SandboxOptions.from_state(doc.get("options") or {})
        except InvalidField as exc:
            raise InvalidField(f"checkpoint.{exc.field}", exc.detail) from None

    def _join_job(self, options: SandboxOptions, admitting: bool) -> None:
        if options.job is not None:
            lease = self.leases.get(options.job)
            if lease is not None and lease.state != "active" and admitting:
                raise JobNotAdmitting(f"job {options.job!r} is {lease.state}; resume its run manifest first")
            self.leases.renew(options.job, options.lease_ttl)

    def adopt(self, sid: str, resolved: Resolved, options: SandboxOptions, *, name: str,
              admitting: bool = True, waited: float | None = None) -> Sandbox:
        """Sandbox ``sid``, started ahead of need for a ready pool (``layerbox.pool`` label, default
        options, no command run by anyone but the pool), becomes the sandbox a create of
        ``resolved`` with ``options`` would have made: its limits are set, env, workdir, user,
        labels and lifetimes are recorded, and its clock starts now.  A sandbox that is not such a
        pool sandbox of this very image, or options it cannot take, raise
        :class:`SandboxStateError` (the caller makes a new sandbox instead)."""
        _in_flight(sid)
        box = Sandbox(self, sid)
        st = box.state
        if POOL_LABEL not in st.labels or st.status != "running" or st.image_digest != resolved.digest:
            raise SandboxStateError(f"sandbox {sid} is not a ready sandbox of {resolved.digest} "
                                    f"(status {st.status}, image {st.image_digest})")
        if not options.fits_ready_sandbox():
            raise SandboxStateError(f"sandbox {sid}: these options need a sandbox of their own")
        if st.options.userns or st.network is not None or not st.options.fits_ready_sandbox():
            raise SandboxStateError(f"sandbox {sid} was not started with default options")
        self._join_job(options, admitting)
        limits = limits_of(options)
        if limits != limits_of(st.options):
            resources = limits.resources()
            resources.pop("devices")
            if self.layout.version == 1:
                resources["memory"].pop("swap")
            self.runtime.update(sid, resources, box.dir / "resources.json")
        env, cwd, uid, gid = self._process_defaults(box, resolved, options)
        now = time.time()
        with self._lock:
            st = box.state
            if st.status != "running":  # the reaper or a heal got to it meanwhile
                raise SandboxStateError(f"sandbox {sid} is {st.status}, not running")
            st = st.replace(ref=name, options=options, admitting=admitting, created=now, last_active=now,
                            env=env, cwd=cwd, uid=uid, gid=gid)
            self._write_state(st)
        box._receipt("create", ref=name, cpu=options.cpu, memory=options.memory, pids=options.pids,
                     disk=None, cpu_class=options.cpu_class, job=options.job, policy_version=None,
                     layer_digests=list(st.layer_digests), ready=True,
                     **({"waited_seconds": round(waited, 6)} if waited is not None else {}))
        return box

    async def _launch(self, resolved: Resolved, ref: str, options: SandboxOptions, *, admitting: bool,
                      inherited: Sequence[Mapping[str, Any]] = (), name: str | None = None) -> Sandbox:
        if options.userns:
            self._check_traversable()
        if options.is_vm:
            self.vms.check_options(options)
            await asyncio.to_thread(self.vms.prepare)  # a host without QEMU or guest assets: refused here
            if resolved.kind == "checkpoint" and resolved.disk is None:
                raise UnsupportedOption(f"{ref} is a container's checkpoint (files of an overlay): it restores "
                                        f"into a container, not a {options.isolation}")
            machine = ((resolved.doc.get("bound", {}).get("vm") or {}).get("machine")
                       if resolved.disk is not None else None)
            if machine is not None and machine != vm.MACHINES[options.isolation]:
                wanted = next(k for k, v in vm.MACHINES.items() if v == machine)
                raise UnsupportedOption(f"isolation: {ref} is a checkpoint of a {machine} VM: restore it with "
                                        f"isolation={wanted}")
        elif resolved.disk is not None:
            raise UnsupportedOption(f"{ref} is a VM's checkpoint (a disk): restore it with the isolation it had "
                                    "(microvm or vm)")
        self._join_job(options, admitting)
        layout = self.layout
        sid = new_sandbox_id()
        _in_flight(sid)
        box = Sandbox(self, sid)
        self.paths.ensure()
        box.dir.mkdir(mode=0o700)
        box.bundle.mkdir(mode=0o700)
        box.rootfs.mkdir()
        mapping: tuple[int, int] | None = None
        if options.userns:
            try:
                mapping = self.uid_ranges.allocate(sid)
                # crun enters the user namespace before it mounts the rootfs: the sandbox's root
                # (an unprivileged host uid) must be able to traverse every directory to it
                for d in (self.data_dir, self.root, self.boxes, box.dir):
                    d.chmod(d.stat().st_mode & 0o7777 | 0o001)
            except BaseException:
                self.uid_ranges.release(sid)
                shutil.rmtree(box.dir, ignore_errors=True)
                raise
        now = time.time()
        state = SandboxState(
            id=sid, status="creating", ref=name or ref, image_digest=resolved.digest, kind=resolved.kind, options=options,
            layer_digests=tuple(layer.digest for layer in resolved.layers), created=now, last_active=now,
            cgroups_path=f"/{self.cgroup_parent}/{sid}", admitting=admitting, userns=mapping)
        self._write_state(state)  # first: a crash from here on is reconciled
        for rec in inherited:  # the history of the checkpoint this sandbox continues
            self.receipt_logs.append(sid, {**rec, "inherited": True})
        if options.is_vm:
            return await self._launch_vm(box, resolved, state, name or ref)
        started = time.perf_counter()
        try:
            upper = None
            if options.disk is not None:
                mnt = await asyncio.to_thread(sbdisk.make_disk, box.dir / "disk.img", box.dir / "disk", options.disk)
                upper = str(mnt / "upper")
            if resolved.kind == "checkpoint":
                async with await self._store() as store:
                    await Snapshots(store, self.host).restore(ref, str(box.rootfs), upper=upper,
                                                              policy_version=options.policy_version,
                                                              verified=resolved)  # (by _restore_plan)
            else:
                await asyncio.to_thread(self.host.mount, resolved, box.rootfs, writable=True, upper=upper)
            if mapping is not None:  # on a thread: the overlay is made under a per-thread fsuid
                await asyncio.to_thread(self._remap_rootfs, box, mapping)
            mounted = time.perf_counter()
            netns = None
            if options.network is not None:  # default deny with these allow rules; None = loopback only
                # with a user namespace the network namespace must belong to it, or crun cannot
                # mount a sysfs for it and falls back to the host's /sys (host interface names)
                ns_fd = self._userns_fd(*mapping) if mapping is not None else None
                info = await asyncio.to_thread(self.net.create, sid, list(options.network), userns_fd=ns_fd)
                netns = str(info.path)
                state = state.replace(network={**info.to_dict(), "policy": self.net.policy(sid)})
            await asyncio.to_thread(self._start, box, resolved, state, layout, netns)
        except BaseException:
            with contextlib.suppress(Exception):
                self.destroy(sid)
            raise
        box._receipt("create" if resolved.kind != "checkpoint" else "restore", ref=name or ref, cpu=options.cpu,
                     memory=options.memory, pids=options.pids, disk=options.disk, cpu_class=options.cpu_class,
                     job=options.job, policy_version=options.policy_version,
                     layer_digests=list(state.layer_digests), mount_seconds=round(mounted - started, 6),
                     start_seconds=round(time.perf_counter() - mounted, 6),
                     **({"userns": list(mapping)} if mapping is not None else {}))
        return box

    async def _vm_template(self, resolved: Resolved, options: SandboxOptions, assets: vmassets.Assets
                           ) -> tuple[vm.Template, str]:
        """The template a new VM restores, and where it came from: ``host`` (this host has it),
        ``store`` (another host booted it: mounted lazily from the store) or ``boot`` (booted
        here now, then published so that no other host boots it)."""
        shape = self.vms.shape_for(resolved, options)
        key = await asyncio.to_thread(self.vms.template_key, resolved, shape, assets)
        local = self.vms.host_template(key)
        if local is not None:
            return local, "host"
        async with await self._store() as store:
            try:
                found = await vmstate.find_template(store, key)
                if found is not None:
                    return await asyncio.to_thread(self.vms.mount_template, key, found), "store"
            except (LayerstoreError, LazyfetchError, SnapshotError) as exc:  # a cache: boot it instead
                log.warning("template %s from %s: %s; booting it here", key, store.url, exc)
            template, made = await asyncio.to_thread(self.vms.boot_template, resolved, shape, assets)
            if not made:
                return template, "host"
            try:
                pub = await vmstate.publish_template(store, template.dir, ("memory", "state.bin", "template.json"),
                                                     template.doc, self.data_dir)
                log.info("template %s published as %s: %d bytes stored, %d uploaded in %.2f s", key, pub.digest,
                         pub.bytes_stored, pub.bytes_uploaded, pub.seconds)
            except (LayerstoreError, SnapshotError, OSError) as exc:
                log.warning("template %s: publishing it to %s failed (%s); other hosts boot their own", key,
                            store.url, exc)
            return template, "boot"

    async def _launch_vm(self, box: Sandbox, resolved: Resolved, state: SandboxState, ref: str) -> Sandbox:
        options = state.options
        try:
            t = time.perf_counter()
            template: vm.Template | None = None
            memory_why = None
            assets = await asyncio.to_thread(self.vms.assets_for, resolved, options)
            if resolved.doc.get("bound", {}).get("memory"):
                memory_why = self.vms.memory_mismatch(resolved, assets)
                if memory_why is not None:
                    log.warning("checkpoint %s: its memory does not load here (%s): only its disk is restored",
                                resolved.digest, memory_why)
            if resolved.doc.get("bound", {}).get("memory") and memory_why is None:
                source = "checkpoint"  # its own memory image: no template
            else:
                template, source = await self._vm_template(resolved, options, assets)
            template_seconds = time.perf_counter() - t
            record, network, timings = await asyncio.to_thread(self.vms.launch, box.id, box.dir, resolved, options,
                                                               state.cgroups_path, template, assets)
            state = state.replace(vm=record, pid=record["vmm_pid"], init_start=record["vmm_start"], status="starting",
                                  network=network)
            self._write_state(state)
            env, cwd, uid, gid = await asyncio.to_thread(self._process_defaults, box, resolved, options)
            state = state.replace(env=env, cwd=cwd, uid=uid, gid=gid, status="running")
            self._write_state(state)
        except BaseException:
            with contextlib.suppress(Exception):
                self.destroy(box.id)
            raise
        box._receipt("create" if resolved.kind != "checkpoint" else "restore", ref=ref, cpu=options.cpu,
                     memory=options.memory, pids=options.pids, disk=options.disk,
                     cpu_class=options.cpu_class, job=options.job, policy_version=options.policy_version,
                     layer_digests=list(state.layer_digests), isolation=options.isolation,
                     vm={k: record[k] for k in ("machine", "assets", "kernel", "kernel_from", "template", "accel",
                                                "qemu", "shape")},
                     template_seconds=round(template_seconds, 6), template_made=source == "boot",
                     template_source=source, start_seconds=timings["restore_seconds"],
                     **({"memory_restored": memory_why is None, "memory_lazy": bool(record.get("memory_lazy"))}
                        if resolved.doc.get("bound", {}).get("memory") else {}),
                     **({"memory_not_restored": memory_why} if memory_why else {}))
        return box

    def _check_traversable(self) -> None:
        """Refuse a user namespace when a directory above the data dir is closed to other uids."""
        for d in reversed(self.data_dir.parents):
            mode = d.stat().st_mode
            if not mode & 0o001:
                raise UnsupportedOption(
                    f"userns=True: {d} is mode {mode & 0o7777:04o}, so a sandbox's root (an unprivileged host "
                    f"uid) cannot reach its rootfs under {self.boxes}; crun enters the user namespace before "
                    f"it mounts the rootfs. `chmod o+x {d}` or use a data dir whose parents are searchable")

    def _userns_fd(self, host_base: int, size: int) -> int:
        """A user namespace fd mapping 0..size-1 to host_base.., made once per range and kept."""
        with self._lock:
            fd = self._userns_fds.get(host_base)
            if fd is None:
                fd = self._userns_fds[host_base] = idmap.userns_fd(host_base, size)
            return fd

    def _remap_rootfs(self, box: Sandbox, mapping: tuple[int, int]) -> None:
        base, size = mapping
        idmap.remap_rootfs(box.rootfs, base, size, ns_fd=self._userns_fd(base, size))

    def _start(self, box: Sandbox, resolved: Resolved, state: SandboxState, layout: CgroupLayout,
               netns: str | None) -> None:
        options, userns = state.options, state.userns
        merged_env, cwd, uid, gid = self._process_defaults(box, resolved, options)
        process = build_process(IDLE_INIT, env=merged_env, cwd="/", uid=0, gid=0)
        # a policed network namespace was made inside the manager's user namespace for this range:
        # the sandbox joins that one, so the network namespace is its own
        joined = f"/proc/{os.getpid()}/fd/{self._userns_fd(*userns)}" if userns and netns else None
        limits = limits_of(options)
        spec = build_spec(str(box.rootfs), process, hostname=box.id, cgroups_path=state.cgroups_path,
                          limits=limits, cgroup_version=layout.version, netns_path=netns, userns=userns,
                          userns_path=joined)
        replace_beneath(self.boxes, f"{box.id}/bundle/config.json", json.dumps(spec).encode())
        state = state.replace(env=merged_env, cwd=cwd, uid=uid, gid=gid, status="starting")
        self._write_state(state)
        self.runtime.create(box.id, box.bundle, pid_file=box.dir / "init.pid", sched_idle=limits.best_effort)
        pid = self._hold_rootfs(box)
        self._seal_root(box, pid, userns)
        self.runtime.start(box.id)
        state = state.replace(pid=pid, init_start=(proc_stat(pid) or (0, None))[1], status="running")
        if userns is not None:
            self._await_init_exec(box.id, pid)
        self._write_state(state)

    @staticmethod
    def _process_defaults(box: Sandbox, resolved: Resolved, options: SandboxOptions
                          ) -> tuple[dict[str, str], str, int, int]:
        """The env, workdir, uid and gid a command gets unless it says otherwise: the image's
        config under the sandbox's options."""
        cfg = resolved.config.get("config", resolved.config) or {}
        image_env = dict(e.split("=", 1) for e in cfg.get("Env") or [] if isinstance(e, str) and "=" in e)
        image_env.setdefault("PATH", DEFAULT_PATH)
        env = {**image_env, "HOME": image_env.get("HOME", "/root"), **options.env}
        uid, gid = _uid_gid(box.files, options.user if options.user is not None else cfg.get("User") or "")
        return env, options.workdir or cfg.get("WorkingDir") or "/", uid, gid

    def _crun_pid(self, box: Sandbox) -> int:
        """The init pid crun wrote (host side, in the sandbox's own directory)."""
        return int(read_beneath(self.boxes, f"{box.id}/init.pid").strip())

    def _hold_rootfs(self, box: Sandbox) -> int:
        """Hand the rootfs overlay to the created container (its init's mount namespace holds it)
        and take it out of the host's mount table: each create copies that table, so 1,000
        sandboxes' overlays in it made a create ~2x slower.  Returns the init's pid."""
        pid = self._crun_pid(box)
        try:
            self.host.detach(box.rootfs, pid)
        except MountError as exc:  # still correct while mounted here, only slower for later creates
            log.warning("sandbox %s: rootfs stays in the host's mount table: %s", box.id, exc)
        return pid

    def _seal_root(self, box: Sandbox, pid: int, userns: tuple[int, int] | None) -> None:
        """``nosuid,nodev`` on the sandbox's own ``/`` before its first command runs: crun re-binds
        the rootfs and remounts it with only its own flags, which drops the overlay's.  (A user
        namespace locks them; its sandboxes keep them anyway.)"""
        if userns is not None:
            return
        kmount.set_flags_in(pid, "/", kmount.MS_NOSUID | kmount.MS_NODEV)

    def _await_init_exec(self, sid: str, pid: int, limit: float = 10.0) -> None:
        """Return once the init has exec'd: ``crun start`` returns while it may still be crun, and a
        ``crun exec`` into a user-namespaced container then fails (setns EPERM: the process changed its
        credentials and is not dumpable until execve).  /proc offers no event for an exec, hence the poll."""
        runtime_comm = os.path.basename(self.runtime.binary)[:15]
        deadline = time.monotonic() + limit
        while True:
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() != runtime_comm:
                    return
            except OSError:
                raise RuntimeFailed(f"sandbox {sid}: init {pid} died while starting") from None
            if time.monotonic() > deadline:
                raise RuntimeFailed(f"sandbox {sid}: init {pid} did not exec its command within {limit}s")
            time.sleep(0.001)

    # -- the lazyfetch daemon died: restart what ran on it --------------------------------------------
    def _on_remount(self, mountpoint: str, phase: str) -> int | None:
        """A container keeps its own copy of the rootfs overlay, on layers of the dead daemon (every
        read fails with EIO).  Before the overlay is re-stacked, its container goes (so no two
        overlays use the upper at once); afterwards a new container starts on the same bundle:
        processes are lost, files are kept, like a reboot."""
        path = Path(mountpoint)
        if path.name != "rootfs" or path.parent.parent != self.boxes:
            return None
        try:
            box = Sandbox(self, path.parent.name)
            st = box.state
        except (SandboxNotFound, SandboxError):
            return None
        if phase == "detached":
            self._delete_container(box.id)
            return None
        if st.userns:
            self._remap_rootfs(box, st.userns)
        self.runtime.create(box.id, box.bundle, pid_file=box.dir / "init.pid",
                            sched_idle=st.options.cpu_class == "best-effort")
        pid = self._crun_pid(box)
        self._seal_root(box, pid, st.userns)
        self.runtime.start(box.id)
        if st.userns:
            self._await_init_exec(box.id, pid)
        box._update(pid=pid, init_start=(proc_stat(pid) or (0, None))[1], status="running")
        if st.status == "paused":
            box.pause()
        box._receipt("restarted", reason="the lazyfetch daemon restarted: the rootfs was remounted on it; "
                                         "processes were lost, files kept", was=st.status)
        log.warning("sandbox %s restarted on a new lazyfetch daemon (processes lost, files kept)", box.id)
        return pid  # HostMounts detaches the new overlay: this init holds it (called under its lock)

    def heal(self) -> int:
        """Make sure a lazyfetch daemon serves running sandboxes; how many layers had to be re-stacked.

        A daemon that died is replaced and takes its kernel state over from the holder: the
        sandboxes' reads waited and go on, nothing is restarted (0).  Only when that state is
        lost too (the holder died, a new generation) are rootfs re-stacked and containers
        restarted (see _on_remount).
        """
        if not any(st.live for st in self.list()):
            return 0
        health = self.host.client.health()
        if health is not None and not self._stale_layers(health["generation"]):
            return 0
        return self.host.remount()

    def _stale_layers(self, generation: str) -> bool:
        state_file = self.host.state_dir / "mounts.json"
        try:
            layers = json.loads(state_file.read_text()).get("layers", {})
        except (OSError, ValueError):
            return False
        return any(info.get("generation") != generation for info in layers.values())

    # -- jobs ---------------------------------------------------------------------------------------------
    def renew(self, job: str, ttl: float | None = None) -> dict[str, Any]:
        return asdict(self.leases.renew(job, ttl))

    def pause_job(self, job: str) -> builtins.list[str]:
        """Freeze every running sandbox of ``job`` (and reclaim their page cache)."""
        done = []
        for st in self.list(job=job):
            if st.status == "running":
                Sandbox(self, st.id).pause()
                done.append(st.id)
        return done

    def resume_job(self, job: str) -> builtins.list[str]:
        done = []
        for st in self.list(job=job):
            if st.status == "paused":
                Sandbox(self, st.id).resume()
                done.append(st.id)
        return done

    def reap(self, now: float | None = None) -> dict[str, builtins.list[str]]:
        """Destroy sandboxes past their TTL or lease; pause those idle past their idle timeout."""
        now = time.time() if now is None else now
        report: dict[str, builtins.list[str]] = {"destroyed": [], "paused": []}
        expired_jobs = {lease.job for lease in self.leases.all() if lease.expired(now)}
        for st in self.list():
            opts = st.options
            try:
                if st.status in ("creating", "starting"):
                    continue
                if (opts.ttl is not None and now - st.created > opts.ttl) or st.job in expired_jobs:
                    self.destroy(st.id)
                    report["destroyed"].append(st.id)
                elif (opts.idle_timeout is not None and st.status == "running"
                      and now - st.last_active > opts.idle_timeout and not self.inflight(st.id)):
                    Sandbox(self, st.id).pause()
                    report["paused"].append(st.id)
            except (SandboxError, MountError, OSError) as exc:  # one bad sandbox must not stop the reaper
                log.warning("reaper: sandbox %s: %s", st.id, exc)
        for job in expired_jobs:
            if not self.list(job=job):
                self.leases.drop(job)
        return report

    # -- destroy / reconcile ----------------------------------------------------------------------------
    def _delete_container(self, sid: str) -> None:
        try:  # `crun delete --force` of an unknown container succeeds: no state query first
            self.runtime.delete(sid, force=True)
        except RuntimeFailed:
            with contextlib.suppress(RuntimeFailed):
                self.runtime.resume(sid)  # a frozen init cannot die
            self.runtime.delete(sid, force=True)

    def destroy(self, sid: str) -> None:
        """Kill and delete the container, drop its rootfs (upper discarded), cgroups and state. Idempotent."""
        box = Sandbox(self, sid)
        known = (box.dir / "state.json").exists()
        for hook in builtins.list(self.on_destroy):
            try:
                hook(sid)
            except Exception:  # a hook must not keep a sandbox alive
                log.exception("sandbox %s: a destroy hook failed; destroying it anyway", sid)
        with self._lock:  # its running commands end with it, and their callers learn why
            for cancel in self._inflight.get(sid, {}).values():
                cancel.cancel("destroy")
        if (box.dir / "vm").exists():
            try:
                st: SandboxState | None = box.state
            except (SandboxNotFound, StateUnreadable):
                st = None
            self.vms.destroy(sid, box.dir, st, self.layout.dirs(f"/{self.cgroup_parent}/{sid}"))
        self._delete_container(sid)
        mounted_here = kmount.is_mountpoint(box.rootfs)
        try:
            self.host.umount(box.rootfs, discard=True)  # also forgets a stale record
        except MountError:  # no record: a rootfs mounted here without one is only detached
            if mounted_here:
                kmount.umount(box.rootfs, lazy=True, missing_ok=True)
        except KernelMountError as exc:
            # EBUSY: something still reads the rootfs or a layer only it used.  Detached now and
            # freed when that reader lets go; raising would leave the cgroups, network, state (and,
            # from close(), every other sandbox and the daemon) behind
            log.warning("sandbox %s: %s; detaching it lazily", sid, exc)
            self.host.umount(box.rootfs, discard=True, lazy=True)
        sbdisk.remove_disk(box.dir / "disk.img", box.dir / "disk")
        if (self.data_dir / "net").exists():
            self.net.destroy(sid)  # after the container: nothing holds the namespace any more
        self.layout.remove(f"/{self.cgroup_parent}/{sid}")
        self.uid_ranges.release(sid)  # after the container: no process of the range is left
        if known:
            self.receipt_logs.append(sid, {"id": uuid.uuid4().hex[:16], "sandbox": sid, "action": "destroy",
                                           "time": time.time()})
        self.receipt_logs.forget(sid)  # the log is complete: nothing more is appended to it here
        self._states.pop(sid, None)
        shutil.rmtree(box.dir, ignore_errors=True)
        if not self._ids():
            self.layout.remove(f"/{self.cgroup_parent}")

    def _remove_cgroups(self, path: str) -> None:
        self.layout.remove(path)

    def _stop_leftover_execs(self, box: Sandbox, st: SandboxState) -> builtins.list[str]:
        """Commands a dead manager started: kill each one's tree, record it as interrupted and
        remove its process document and pid file (a command must never run on unobserved)."""
        stopped: builtins.list[str] = []
        try:
            names = os.listdir(box.bundle)
        except FileNotFoundError:
            return stopped
        tags = sorted({n.rsplit(".", 1)[0] for n in names if n.startswith(EXEC_PREFIX)})
        for tag in tags:
            command: Any = None
            with contextlib.suppress(OSError, ValueError):
                command = json.loads(read_beneath(self.boxes, f"{box.id}/bundle/{tag}.json")).get("args")
            try:
                pid = int(read_beneath(self.boxes, f"{box.id}/bundle/{tag}.pid").strip())
            except (OSError, ValueError):
                pid = None
            if pid is not None and self.layout.holds(pid, st.cgroups_path):
                stat = proc_stat(pid)
                with contextlib.suppress(SandboxError):
                    kill_tree(self.runtime, box.id, box.init_pid(st), pid, stat[1] if stat else 0)
            for suffix in (".json", ".pid"):
                (box.bundle / f"{tag}{suffix}").unlink(missing_ok=True)
            started = self._started_of(box.id, tag) or {}
            box._receipt("exec", command=command, exit_code=None, signal=int(signal.SIGKILL), interrupted="restart",
                         timed_out=False, oom_killed=False,
                         **{k: started[k] for k in CARRIED if started.get(k) is not None})
            stopped.append(tag)
        return stopped

    def _started_of(self, sid: str, tag: str) -> dict[str, Any] | None:
        """The ``exec_started`` receipt of the exec ``tag`` (a keyed or background one names its tag)."""
        return next((r for r in reversed(self.receipt_logs.read(sid))
                     if r.get("action") == "exec_started" and r.get("tag") == tag), None)

    def reconcile(self) -> dict[str, builtins.list[str]]:
        """After a crash: adopt sandboxes that still run, clean up everything else we own.

        Warm-pool sandboxes (their pool died with the process), sandboxes whose state
        this version cannot read and containers without state are destroyed; the
        commands a dead manager left running in adopted sandboxes are killed and
        their receipts say ``interrupted: "restart"``.
        """
        report: dict[str, builtins.list[str]] = {"adopted": [], "destroyed": [], "orphans": [],
                                                  "interrupted": []}
        strays: builtins.list[str] = []
        ids = set(self._ids(strays=strays))
        for name in strays:  # not made by any manager of this version; nothing in it is read
            stray = self.boxes / name
            for mp in kmount.mounts_under(stray):
                kmount.umount(mp, lazy=True, missing_ok=True)
            if stray.is_dir() and not stray.is_symlink():
                shutil.rmtree(stray, ignore_errors=True)
            else:
                stray.unlink(missing_ok=True)
            report["orphans"].append(f"stray:{name}")
        containers = {c["id"]: c for c in self.runtime.list()} if self.runtime.root.exists() else {}
        mounted = set(self.host.status()["mounts"])
        for sid in sorted(ids | set(containers)):
            try:
                box = Sandbox(self, sid)
            except SandboxError:
                log.warning("crun container %r is not a sandbox id; left alone", sid)
                continue
            c = containers.get(sid)
            try:
                st: SandboxState | None = box.state
            except (SandboxNotFound, StateUnreadable) as exc:
                log.warning("reconcile: %s", exc)
                st = None
            if st is not None and st.options.is_vm and c is None:
                if st.live and POOL_LABEL not in st.labels and self.vms.alive(box.dir, st):
                    if (st.status == "running" and st.vm is not None and not st.vm.get("saved")
                            and self.vms.ensure_running(box.dir, st)):
                        # a manager that died in a pause to the store after the capture stopped the
                        # guest and before its state said paused: the guest runs on as if not paused
                        log.warning("sandbox %s: its guest was stopped by a pause that did not finish; "
                                    "running it on", sid)
                    report["adopted"].append(sid)  # its VMM runs on (or it is paused): reconnected on use
                    continue
                self.destroy(sid)  # the VMM died (killed, OOM, the host rebooted): nothing to adopt
                report["destroyed"].append(sid)
                continue
            ok = (st is not None and c is not None and c.get("status") in ("running", "paused")
                  and str(box.rootfs) in mounted and POOL_LABEL not in st.labels)
            if ok and st is not None and c is not None:
                try:
                    pid = int(c["pid"])
                    stat = proc_stat(pid)
                    if stat is None or not self.layout.holds(pid, st.cgroups_path):
                        raise SandboxStateError(f"sandbox {sid}: crun's init {pid} is not in its cgroup")
                    st = box._update(status=c["status"], pid=pid, init_start=stat[1])
                    report["interrupted"] += [f"{sid}/{t}" for t in self._stop_leftover_execs(box, st)]
                    report["adopted"].append(sid)
                    continue
                except (SandboxError, OSError, ValueError, KeyError, TypeError) as exc:
                    log.warning("reconcile: not adopting %s: %s", sid, exc)
            had_state = st is not None or (box.dir / "state.json").exists()
            self.destroy(sid)
            report["destroyed" if had_state else "orphans"].append(sid)
        # mounts of boxes whose state vanished
        for mp in self.host.status()["mounts"]:
            # boxes/<id>/rootfs, or a microvm's boxes/<id>/vm/disk-layer
            if (mp.startswith(str(self.boxes) + "/")
                    and Path(mp).relative_to(self.boxes).parts[0] not in report["adopted"]):
                self.host.umount(mp, discard=True)
                report["orphans"].append(mp)
        if (self.data_dir / "net").exists():
            for sid in self.net.list():
                if sid not in report["adopted"]:
                    self.net.destroy(sid)
                    report["orphans"].append(f"netns:{sid}")
        for sid in self.uid_ranges.owners():  # a range allocated by a manager that died before its state
            if sid not in report["adopted"]:
                self.uid_ranges.release(sid)
                report["orphans"].append(f"userns:{sid}")
        if report["adopted"]:
            self.heal()  # the daemon may have died with the manager: their rootfs reads would fail
        for sid in self.reap()["destroyed"]:  # TTLs and leases ran on while the manager was down
            report["destroyed"].append(sid)
            report["adopted"].remove(sid)
        if not report["adopted"]:
            self.layout.remove(f"/{self.cgroup_parent}")
        return report

    def close(self, *, stop_daemon: bool = True) -> None:
        """Destroy every sandbox and release this host's layer mounts, the daemon too.

        A sandbox that cannot be destroyed does not stop the others or the release: the
        first such error is raised once everything else is done."""
        failed: builtins.list[Exception] = []
        for sid in self._ids():
            try:
                self.destroy(sid)
            except (SandboxError, LazyfetchError, OSError) as exc:
                log.error("close: destroying sandbox %s failed: %s", sid, exc)
                failed.append(exc)
        self.vms.close()
        try:
            self.host.umount_all(stop_daemon=stop_daemon)
        finally:
            with self._lock:
                for fd in self._userns_fds.values():
                    os.close(fd)
                self._userns_fds.clear()
        if failed:
            raise failed[0]


def _sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` from blocking code (a request's worker thread, the CLI, the reaper)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise RuntimeError("a blocking sandbox call from inside an event loop: await its async form")


def _options(options: SandboxOptions | None, fields: Mapping[str, Any]) -> SandboxOptions:
    if options is not None and fields:
        raise TypeError(f"give a SandboxOptions or its fields, not both (got {sorted(fields)} too)")
    return options if options is not None else SandboxOptions(**fields)
