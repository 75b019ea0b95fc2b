"""Sandboxes on one host: an image's writable overlay run by crun, with exec, files,
pause/resume, checkpoint/restore, receipts, and cleanup that survives a crash.

Layout under ``<data-dir>/sandbox/``::

    runtime/             crun --root (its own container state)
    boxes/<id>/state.json  what the manager knows (written before anything it names exists)
    boxes/<id>/bundle/   config.json (+ per-exec process documents)
    boxes/<id>/rootfs/   the writable overlay (a HostMounts mount), mounted here only until the
                         container is created: then its init's mount namespace holds it and it
                         leaves the host's mount table (files go through /proc/<init>/root)
    boxes/<id>/disk.img, disk/  the sandbox's own ext4 (only with a disk limit; holds the upper)
    receipts/<id>.jsonl  append-only log of every action (kept after destroy)
    userns.json          host uid ranges of user-namespaced sandboxes (sandbox/idmap.py RangePool)
    <data-dir>/net/      network namespaces and address allocations (sandbox/network.py)
    leases.json          job leases and their admission state (sandbox/leases.py)

Store-facing calls (create, restore, checkpoint) are coroutines; runtime and
file calls are blocking and meant for a thread when the caller is async.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import blake3

from layerstore.objects import SCHEMA_RECEIPTS, Resolved
from layerstore.store import Store
from lazyfetch import kmount
from lazyfetch.mounts import HostMounts, MountError
from sandbox import disk as sbdisk
from sandbox import idmap
from sandbox.errors import (
    CommandInProgress,
    JobNotAdmitting,
    ReceiptsBroken,
    RuntimeFailed,
    SandboxError,
    SandboxNotFound,
    SandboxStateError,
    UnsupportedOption,
)
from sandbox.files import RootFiles
from sandbox.leases import Leases
from sandbox.network import NetworkManager, diff_counters
from sandbox.runtime import CgroupLayout, OciRuntime, preflight_cgroups
from sandbox.spec import DEFAULT_PATH, IDLE_INIT, Limits, build_process, build_spec
from snapshots.checkpoint import Checkpoint, Snapshots

log = logging.getLogger("layerbox.sandbox")

MiB = 1 << 20
READ_CHUNK = 64 << 10
PR_SET_CHILD_SUBREAPER = 36
# Output kept in the receipt of a command with an idempotency key, so a retry gets it back.
KEYED_OUTPUT_CAP = 256 << 10
CPU_CLASSES = ("latency", "best-effort")
# Host uids of user-namespaced sandboxes: 64 regions of USERNS_SLOTS ranges from 2^30, one region per
# data dir (like the subnet), so two managers on one machine rarely share a uid; far above the
# 100000.. ranges /etc/subuid hands to users.
USERNS_FIRST = 1 << 30
USERNS_SLOTS = 256


@dataclass(frozen=True)
class ExecResult:
    exit_code: int | None  # crun's exit status; 128+N when signal N ended the process
    signal: int | None
    stdout: bytes
    stderr: bytes
    truncated: bool  # output beyond output_cap was read and dropped
    duration: float
    timed_out: bool = False
    oom_killed: bool = False
    interrupted: str | None = None  # "preempt" or "disconnect": the manager stopped it early
    replayed: bool = False  # answered from the receipt of an earlier run with the same idempotency key


class Cancel(threading.Event):
    """Set it (with a reason) to stop a running exec: its process tree is killed."""

    reason = "cancelled"

    def cancel(self, reason: str) -> None:
        self.reason = reason
        self.set()


def become_subreaper() -> None:
    """For a long-lived manager service: orphans of crun land here, not on a slow PID 1."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise SandboxError(f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(ctypes.get_errno())}")


# -- /proc helpers --------------------------------------------------------------------------
def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(ppid, starttime ticks) of ``pid``, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), int(fields[19])


def _process_table() -> dict[int, tuple[int, int]]:
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _proc_stat(int(name))
            if st is not None:
                table[int(name)] = st
    return table


def _descendants(roots: set[int], table: Mapping[int, tuple[int, int]]) -> set[int]:
    found = set(r for r in roots if r in table)
    grew = True
    while grew:
        more = {pid for pid, (ppid, _) in table.items() if ppid in found and pid not in found}
        found |= more
        grew = bool(more)
    return found


def _uid_gid(files: RootFiles, user: str) -> tuple[int, int]:
    """An OCI ``User`` ("", "name", "uid", "uid:gid", "name:group") looked up in the rootfs."""
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
            if len(parts) > field and parts[0] == key:
                return int(parts[field])
        return None

    uid = lookup("/etc/passwd", name, 2)
    if uid is None:
        raise SandboxError(f"user {name!r} is not in the image's /etc/passwd")
    if group:
        gid = lookup("/etc/group", group, 2)
        if gid is None:
            raise SandboxError(f"group {group!r} is not in the image's /etc/group")
        return uid, gid
    if name.isdigit():
        return uid, uid
    gid = lookup("/etc/passwd", name, 3)
    return uid, gid if gid is not None else uid


def _replay(rec: Mapping[str, Any]) -> ExecResult:
    """The result an earlier run under the same idempotency key recorded."""
    if rec["action"] == "exec_started":  # the manager died or the job was preempted mid-command
        return ExecResult(None, None, b"", b"", False, 0.0, interrupted="unknown", replayed=True)
    return ExecResult(rec.get("exit_code"), rec.get("signal"), base64.b64decode(rec.get("stdout", "")),
                      base64.b64decode(rec.get("stderr", "")),
                      bool(rec.get("truncated")) or rec.get("stdout_bytes", 0) > KEYED_OUTPUT_CAP
                      or rec.get("stderr_bytes", 0) > KEYED_OUTPUT_CAP,
                      float(rec.get("duration", 0.0)), bool(rec.get("timed_out")), bool(rec.get("oom_killed")),
                      rec.get("interrupted"), replayed=True)


def _write_json(path: Path, doc: Mapping[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
    os.replace(tmp, path)


def receipt_line(rec: Mapping[str, Any]) -> bytes:
    """A receipt as its log stores it: canonical JSON (sorted keys, ASCII), no newline."""
    return json.dumps(rec, sort_keys=True).encode()


def verify_receipt_chain(records: Sequence[Mapping[str, Any]], *, what: str) -> str | None:
    """Check that each record's ``prev`` is the blake3 of the record before it (null for the
    first); return the hash of the last record (the log's head), None for no records.

    Records without ``prev`` are accepted only before the first chained one (logs written
    before the chain existed).  An edited, removed or reordered record breaks the chain at
    the record after it; a log cut at its end is caught only against a head kept elsewhere.
    """
    prev: str | None = None
    chained = False
    for i, rec in enumerate(records):
        if "prev" in rec:
            if rec["prev"] != prev:
                raise ReceiptsBroken(
                    f"{what}: record {i} (id {rec.get('id')}, {rec.get('action')}) follows a record hashing to "
                    f"{prev}, not {rec['prev']}: a record before it was edited, removed or reordered")
            chained = True
        elif chained:
            raise ReceiptsBroken(f"{what}: record {i} (id {rec.get('id')}) has no 'prev' after chained records")
        prev = blake3.blake3(receipt_line(rec)).hexdigest()
    return prev


def _last_line_hash(fd: int, size: int) -> str | None:
    """blake3 of the file's last line (read backwards; a line may hold 256 KiB of output)."""
    if size == 0:
        return None
    buf, pos = b"", size
    while pos > 0:
        step = min(1 << 16, pos)
        pos -= step
        buf = os.pread(fd, step, pos) + buf
        cut = buf.rfind(b"\n", 0, len(buf) - 1)
        if cut >= 0:
            return blake3.blake3(buf[cut + 1:].rstrip(b"\n")).hexdigest()
    return blake3.blake3(buf.rstrip(b"\n")).hexdigest()


class Sandbox:
    """One running sandbox; get it from :class:`SandboxManager`, not by constructing it."""

    def __init__(self, manager: SandboxManager, sid: str) -> None:
        self.manager = manager
        self.id = sid
        self.dir = manager.boxes / sid
        self.rootfs = self.dir / "rootfs"
        self.bundle = self.dir / "bundle"
        self._exec_seq = 0

    @functools.cached_property
    def files(self) -> RootFiles:
        """The host file API of this rootfs (idmap-aware when the sandbox has a user namespace)."""
        try:
            mapping = self.state.get("userns")
        except SandboxNotFound:
            mapping = None
        return RootFiles(self.rootfs, idmap=(int(mapping[0]), int(mapping[1])) if mapping else None,
                         open_root=self._open_root, no_xdev=True)

    def _open_root(self) -> int:
        """The rootfs on the host while it is mounted there (creating), else the container's root."""
        flags = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
        if kmount.is_mountpoint(self.rootfs):
            return os.open(self.rootfs, flags)
        st = self.state
        pid, start = st.get("pid"), st.get("init_start")
        if pid is None or start is None or st.get("status") not in ("running", "paused"):
            raise SandboxStateError(f"sandbox {self.id} is {st.get('status')}: its files are reachable only "
                                    "while it runs (or is paused)")
        try:
            fd = os.open(f"/proc/{pid}/root", flags)
        except OSError:
            fd = -1
        # opened first, checked after: a pid reused in between shows another start time
        if fd < 0 or (_proc_stat(int(pid)) or (0, -1))[1] != start:
            if fd >= 0:
                os.close(fd)
            raise SandboxStateError(f"sandbox {self.id}: its init ({pid}) is gone; destroy it or restore "
                                    "its last checkpoint")
        return fd

    # -- state ------------------------------------------------------------------------------------
    @property
    def state(self) -> dict[str, Any]:
        try:
            return dict(json.loads((self.dir / "state.json").read_text()))
        except FileNotFoundError:
            raise SandboxNotFound(f"sandbox {self.id}: no state under {self.manager.boxes}") from None

    def _update(self, **changes: Any) -> None:
        with self.manager._lock:  # read-modify-write: exec threads and preemption both write here
            st = self.state
            st.update(changes)
            _write_json(self.dir / "state.json", st)

    @property
    def pid(self) -> int:
        return int(self.state["pid"])

    def _receipt(self, action: str, **fields: Any) -> dict[str, Any]:
        st = self.state if (self.dir / "state.json").exists() else {}
        rec = {"id": uuid.uuid4().hex[:16], "sandbox": self.id, "action": action, "time": time.time(),
               "image": st.get("image_digest"), "labels": st.get("labels", {}), **fields}
        self.manager._append_receipt(self.id, rec)
        if st:
            self._update(last_active=time.time())
        return rec

    def receipts(self) -> builtins.list[dict[str, Any]]:
        return self.manager.receipts(self.id)

    def _require_running(self) -> None:
        st = self.state
        if st.get("status") != "running":
            raise SandboxStateError(f"sandbox {self.id} is {st.get('status')}, not running")

    # -- exec ---------------------------------------------------------------------------------------
    def exec(self, cmd: Sequence[str] | str, *, env: Mapping[str, str] | None = None, cwd: str | None = None,
             timeout: float | None = None, stdin: bytes | None = None, output_cap: int = MiB,
             on_stdout: Callable[[bytes], None] | None = None,
             on_stderr: Callable[[bytes], None] | None = None,
             idempotency_key: str | None = None, cancel: Cancel | None = None) -> ExecResult:
        """Run ``cmd`` (a string goes through ``/bin/sh -c``) and collect at most ``output_cap`` bytes per stream.

        Output past the cap is still read (so the command never blocks on a full
        pipe) but dropped, and ``truncated`` is set.  On ``timeout`` or when
        ``cancel`` is set, the process, every descendant and every orphan it
        left to the sandbox's init are SIGKILLed under the freezer.

        With ``idempotency_key``, a command that already ran under that key in
        this sandbox (or in the checkpoint it was restored from) is not run
        again: its recorded result comes back with ``replayed`` set.
        """
        cancel = cancel or Cancel()
        replay: ExecResult | None = None
        args = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        self._exec_seq += 1
        tag = f"exec-{os.getpid()}-{self._exec_seq}-{uuid.uuid4().hex[:6]}"
        with self.manager._lock:
            # admission and registration under one lock: preemption either sees this exec or refuses it
            self._require_running()
            st = self.state
            if not st.get("admitting", True):
                raise JobNotAdmitting(f"sandbox {self.id}: job {st.get('job')!r} is being preempted; "
                                      "retry after it is resumed")
            if idempotency_key is not None:
                if (self.id, idempotency_key) in self.manager._keys_running:
                    raise CommandInProgress(f"sandbox {self.id}: a command with idempotency key "
                                            f"{idempotency_key!r} is still running")
                earlier = self._keyed_receipt(idempotency_key)
                replay = _replay(earlier) if earlier is not None else None
                if replay is None:
                    self.manager._keys_running.add((self.id, idempotency_key))
            if replay is None:
                self.manager._inflight.setdefault(self.id, {})[tag] = cancel
        if replay is not None:
            for data, cb in ((replay.stdout, on_stdout), (replay.stderr, on_stderr)):
                if data and cb is not None:  # a streaming caller sees the answer the same way
                    cb(data)
            return replay
        try:
            if idempotency_key is not None:
                # a crash during the command leaves this behind: a retry then learns it was interrupted
                self._receipt("exec_started", command=args, idempotency_key=idempotency_key)
            return self._exec(tag, st, args, env, cwd, timeout, stdin, output_cap, on_stdout, on_stderr,
                              idempotency_key, cancel)
        finally:
            with self.manager._lock:
                running = self.manager._inflight.get(self.id, {})
                running.pop(tag, None)
                if not running:
                    self.manager._inflight.pop(self.id, None)
                if idempotency_key is not None:
                    self.manager._keys_running.discard((self.id, idempotency_key))

    def _keyed_receipt(self, key: str) -> dict[str, Any] | None:
        found = None
        for rec in self.receipts():
            if rec.get("idempotency_key") == key and rec.get("action") in ("exec", "exec_started"):
                if found is None or rec["action"] == "exec":
                    found = rec
        return found

    def _exec(self, tag: str, st: Mapping[str, Any], args: builtins.list[str], env: Mapping[str, str] | None,
              cwd: str | None, timeout: float | None, stdin: bytes | None, output_cap: int,
              on_stdout: Callable[[bytes], None] | None, on_stderr: Callable[[bytes], None] | None,
              idempotency_key: str | None, cancel: Cancel) -> ExecResult:
        merged = {**st["env"], **(env or {})}
        workdir = cwd or st["cwd"]
        process_file, pid_file = self.bundle / f"{tag}.json", self.bundle / f"{tag}.pid"
        _write_json(process_file, build_process(args, env=merged, cwd=workdir, uid=st["uid"], gid=st["gid"]))
        oom_before = self.manager._oom_kills(st)
        policed = st.get("network") is not None
        egress_before = self.manager.net.counters(self.id) if policed else None
        cpu_before = self.manager._cpu_usage(st)
        started = time.perf_counter()
        proc = self.manager.runtime.exec(self.id, process_file, pid_file=pid_file,
                                         stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                         sched_idle=st.get("cpu_class") == "best-effort")
        exec_start = _proc_stat(proc.pid)
        timed_out = False
        try:
            out, err, truncated, digests, sizes, timed_out = self._pump(
                proc, stdin, output_cap, timeout, on_stdout, on_stderr, pid_file,
                exec_start[1] if exec_start else 0, cancel)
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            process_file.unlink(missing_ok=True)
            pid_file.unlink(missing_ok=True)
        duration = time.perf_counter() - started
        rc = proc.returncode
        interrupted = cancel.reason if cancel.is_set() else None
        killed = timed_out or interrupted is not None
        sig = signal.SIGKILL.value if killed else (rc - 128 if rc is not None and 128 < rc <= 128 + 64 else None)
        oom = self.manager._oom_kills(st) > oom_before
        result = ExecResult(rc, sig, out, err, truncated, round(duration, 6), timed_out, oom, interrupted)
        keyed: dict[str, Any] = {}
        cpu_after = self.manager._cpu_usage(st)
        # the sandbox's cgroup over the command's span (background processes included)
        keyed["resources"] = {
            "cpu_seconds": round(cpu_after - cpu_before, 6) if cpu_before is not None and cpu_after is not None
            else None,
            "memory_peak": self.manager._memory_peak(st), "pids": self.manager._pids_current(st)}
        if egress_before is not None:  # what the network policy allowed and denied during the command
            keyed["egress"] = diff_counters(egress_before, self.manager.net.counters(self.id))
        if idempotency_key is not None:
            keyed = {"idempotency_key": idempotency_key,
                     "stdout": base64.b64encode(out[:KEYED_OUTPUT_CAP]).decode(),
                     "stderr": base64.b64encode(err[:KEYED_OUTPUT_CAP]).decode()}
        self._receipt("exec", command=args, cwd=workdir, exit_code=rc, signal=sig, timed_out=timed_out,
                      oom_killed=oom, interrupted=interrupted, stdout_bytes=sizes[0], stderr_bytes=sizes[1],
                      stdout_blake3=digests[0], stderr_blake3=digests[1], truncated=truncated,
                      duration=result.duration, cpu_class=st.get("cpu_class", "latency"),
                      policy_version=st.get("policy_version"), **keyed)
        return result

    def _pump(self, proc: subprocess.Popen[bytes], stdin: bytes | None, cap: int, timeout: float | None,
              on_stdout: Callable[[bytes], None] | None, on_stderr: Callable[[bytes], None] | None,
              pid_file: Path, since: int, cancel: Cancel
              ) -> tuple[bytes, bytes, bool, tuple[str, str], tuple[int, int], bool]:
        assert proc.stdout is not None
        assert proc.stderr is not None
        bufs = [bytearray(), bytearray()]
        hashes = [blake3.blake3(), blake3.blake3()]
        sizes = [0, 0]
        callbacks = [on_stdout, on_stderr]
        truncated = False
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ, 0)
        sel.register(proc.stderr, selectors.EVENT_READ, 1)
        pending = memoryview(stdin or b"")
        if proc.stdin is not None:
            os.set_blocking(proc.stdin.fileno(), False)
            if pending:
                sel.register(proc.stdin, selectors.EVENT_WRITE, 2)
            else:
                proc.stdin.close()
        deadline = time.monotonic() + timeout if timeout is not None else None
        exited_at: float | None = None
        kill_since: float | None = None  # when a cancel or the timeout asked for the kill
        timed_out = killed = False
        try:
            while sel.get_map():
                now = time.monotonic()
                if not killed and kill_since is None:
                    if cancel.is_set():
                        kill_since = now
                    elif deadline is not None and now >= deadline:
                        timed_out, kill_since = True, now
                if not killed and kill_since is not None:
                    # the command's pid is known only once crun has written it: until then (a
                    # cancel right after the start, a loaded host) keep trying, and after 5 s
                    # without one kill crun exec itself
                    if self._kill_exec(pid_file, since) or proc.poll() is not None or now - kill_since > 5.0:
                        if proc.poll() is None and now - kill_since > 5.0:
                            proc.kill()
                        killed = True
                        deadline = now + 5.0  # then give up on crun exec itself
                elif killed and deadline is not None and now >= deadline:
                    break
                if exited_at is None and proc.poll() is not None:
                    exited_at = now
                if exited_at is not None and now - exited_at > 1.0:
                    break  # background processes still hold the pipes: stop reading them
                wait = 0.2 if deadline is None else max(0.0, min(0.2, deadline - now))
                if kill_since is not None and not killed:
                    wait = 0.01
                for key, _ in sel.select(wait):
                    idx = key.data
                    if idx == 2:
                        assert proc.stdin is not None
                        try:
                            n = os.write(proc.stdin.fileno(), pending[:READ_CHUNK])
                        except BrokenPipeError:
                            n = len(pending)
                        pending = pending[n:]
                        if not pending:
                            sel.unregister(proc.stdin)
                            proc.stdin.close()
                        continue
                    data = os.read(key.fd, READ_CHUNK)
                    if not data:
                        sel.unregister(key.fileobj)
                        continue
                    sizes[idx] += len(data)
                    hashes[idx].update(data)
                    room = cap - len(bufs[idx])
                    if room < len(data):
                        truncated = True
                    if room > 0:
                        bufs[idx] += data[:room]
                    cb = callbacks[idx]
                    if cb is not None:
                        cb(data)
        finally:
            sel.close()
            for f in (proc.stdout, proc.stderr, proc.stdin):
                if f is not None and not f.closed:
                    f.close()
        return (bytes(bufs[0]), bytes(bufs[1]), truncated, (hashes[0].hexdigest(), hashes[1].hexdigest()),
                (sizes[0], sizes[1]), timed_out)

    def _kill_exec(self, pid_file: Path, since: int) -> bool:
        """SIGKILL an exec's process tree and the orphans it left to init, with the sandbox frozen.

        False when crun has not yet written the command's pid (nothing was killed).
        """
        try:
            root = int(pid_file.read_text().strip())
        except (OSError, ValueError):
            return False
        init = self.pid
        frozen = False
        try:
            with contextlib.suppress(RuntimeFailed):
                self.manager.runtime.pause(self.id)
                frozen = True
            for _ in range(5):
                table = _process_table()
                orphans = {pid for pid, (ppid, start) in table.items() if ppid == init and start >= since}
                victims = _descendants({root} | orphans, table) - {init}
                if not victims:
                    break
                for pid in victims:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                if frozen:  # killed tasks only die once thawed
                    self.manager.runtime.resume(self.id)
                    frozen = False
                time.sleep(0.05)
                with contextlib.suppress(RuntimeFailed):
                    self.manager.runtime.pause(self.id)
                    frozen = True
        finally:
            if frozen:
                self.manager.runtime.resume(self.id)
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
    def set_network(self, rules: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Replace the egress allow rules while the sandbox runs (it must have been created with a network)."""
        st = self.state
        if st.get("network") is None:
            raise SandboxStateError(f"sandbox {self.id} was created without a network (loopback only); "
                                    "create it with network=[...] to police egress")
        policy = self.manager.net.set_policy(self.id, [dict(r) for r in rules])
        options = {**st.get("options", {}), "network": [dict(r) for r in rules]}
        self._update(network={**st["network"], "policy": policy}, options=options)
        self._receipt("network", version=policy.get("version"), rules=policy.get("rules"))
        return policy

    # -- pause / resume -----------------------------------------------------------------------------
    def pause(self, *, reclaim: bool = True) -> dict[str, Any]:
        """Freeze every process, then push the sandbox's page cache out of memory."""
        self._require_running()
        self.manager.runtime.pause(self.id)
        self._update(status="paused")
        freed = self.manager._reclaim(self.state) if reclaim else None
        rec = self._receipt("pause", reclaim=freed)
        return {"reclaim": freed, "receipt": rec["id"]}

    def resume(self) -> None:
        if self.state.get("status") != "paused":
            raise SandboxStateError(f"sandbox {self.id} is {self.state.get('status')}, not paused")
        self.manager.runtime.resume(self.id)
        self._update(status="running")
        self._receipt("resume")

    @contextlib.contextmanager
    def _frozen(self) -> Iterator[None]:
        if self.state.get("status") == "paused":
            yield
            return
        self.manager.runtime.pause(self.id)
        try:
            yield
        finally:
            self.manager.runtime.resume(self.id)

    # -- checkpoint ---------------------------------------------------------------------------------
    async def checkpoint(self, *, name: str | None = None, labels: Mapping[str, str] | None = None,
                         trajectory_offset: int | None = None, policy_version: str | None = None) -> Checkpoint:
        """Capture the rootfs' writes (processes frozen meanwhile) as a checkpoint in the store."""
        st = self.state
        if st.get("status") not in ("running", "paused"):
            raise SandboxStateError(f"sandbox {self.id} is {st.get('status')}")
        last = self.manager.receipts(self.id)
        head = verify_receipt_chain(last, what=f"sandbox {self.id}'s receipts")  # never carry a broken log on
        async with await self.manager._store() as store:
            # receipts travel with the checkpoint: a restored sandbox knows its history and idempotency keys
            receipts = {"schema": SCHEMA_RECEIPTS, "sandbox": self.id, "receipts": last, "head": head}
            ckpt = await Snapshots(store, self.manager.host).checkpoint(
                str(self.rootfs), name=name, labels={**st.get("labels", {}), **(labels or {})},
                trajectory_offset=trajectory_offset if trajectory_offset is not None else len(last),
                receipt_id=last[-1]["id"] if last else None,
                policy_version=policy_version if policy_version is not None else st.get("policy_version"),
                freeze=self._frozen, attach_docs={"receipts": receipts})
        self._receipt("checkpoint", checkpoint=ckpt.name, digest=ckpt.digest, freeze_seconds=ckpt.freeze_seconds,
                      bytes_changed=ckpt.bytes_changed)
        return ckpt

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
        self.root = self.data_dir / "sandbox"
        self.boxes = self.root / "boxes"
        self.receipts_dir = self.root / "receipts"
        self.runtime = OciRuntime(self.root / "runtime", binary=runtime)
        self.host = HostMounts(self.data_dir, store_url)
        self.host.on_remount = self._on_remount
        self.leases = Leases(self.root / "leases.json")
        # one cgroup parent per data dir: two managers on one machine never share cgroups
        self.cgroup_parent = "layerbox-" + hashlib.sha256(str(self.data_dir).encode()).hexdigest()[:10]
        self._layout: CgroupLayout | None = None
        self._lock = threading.RLock()
        self._receipt_locks: dict[str, threading.Lock] = {}
        self._receipt_heads: dict[str, tuple[int, str]] = {}  # log size -> hash of its last line
        self._inflight: dict[str, dict[str, Cancel]] = {}  # sandbox -> running execs (this process)
        self._keys_running: set[tuple[str, str]] = set()
        self._net: NetworkManager | None = None
        # a /16 per data dir, so two managers (two tests, two "hosts" on one machine) never overlap
        self.subnet = subnet or f"10.{64 + int(hashlib.sha256(str(self.data_dir).encode()).hexdigest(), 16) % 64}.0.0/16"
        if userns_range is None:
            region = int(hashlib.sha256(str(self.data_dir).encode()).hexdigest(), 16) % 64
            userns_range = (USERNS_FIRST + region * USERNS_SLOTS * idmap.RANGE_SIZE, USERNS_SLOTS)
        self.uid_ranges = idmap.RangePool(self.root / "userns.json", *userns_range)
        self._userns_fds: dict[int, int] = {}  # host_base -> user namespace fd with that mapping (kept)

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

    def get(self, sid: str) -> Sandbox:
        box = Sandbox(self, sid)
        box.state  # noqa: B018  (raises SandboxNotFound)
        return box

    def list(self, *, job: str | None = None) -> list[dict[str, Any]]:
        out = []
        for path in sorted(self.boxes.glob("*/state.json")):
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                st = json.loads(path.read_text())
                if job is None or st.get("job") == job:
                    out.append(st)
        return out

    def inflight(self, sid: str) -> int:
        with self._lock:
            return len(self._inflight.get(sid, {}))

    # -- create / restore -----------------------------------------------------------------------------
    async def create(self, ref: str, **options: Any) -> Sandbox:
        """Start a sandbox on a writable overlay of ``ref``; returns once ``exec`` works.

        Options: ``cpu`` (CPUs of quota), ``memory`` and ``disk`` (bytes),
        ``pids``, ``cpu_class`` ("latency" or "best-effort"), ``env``,
        ``workdir``, ``user``, ``labels``, ``ttl`` and ``idle_timeout``
        (seconds), ``job`` and ``lease_ttl`` (the caller's lease),
        ``policy_version``, ``network`` (egress allow rules), ``userns``
        (run in a user namespace on its own host uid range: root inside is
        an unprivileged host uid; not with ``network`` yet).
        """
        async with await self._store() as store:
            resolved = await store.resolve(ref)
        if resolved.kind == "checkpoint":  # through restore: its bound digests and policy are checked first
            return await self.restore(ref, **options)
        return await self._launch(resolved, ref, **options)

    async def restore(self, checkpoint_ref: str, *, policy_version: str | None = None,
                      **options: Any) -> Sandbox:
        """A new sandbox whose rootfs is ``checkpoint_ref`` (made on this host or any other)."""
        async with await self._store() as store:
            resolved = await Snapshots(store, self.host).verify_bound(checkpoint_ref, policy_version=policy_version)
            receipts: builtins.list[dict[str, Any]] = []
            attached = (resolved.doc.get("attachments") or {}).get("receipts")
            if attached:
                doc = await store.get_doc(attached)
                receipts = list(doc.get("receipts", []))
                head = verify_receipt_chain(receipts, what=f"the receipts of checkpoint {checkpoint_ref}")
                if "head" in doc and doc["head"] != head:
                    raise ReceiptsBroken(f"the receipts of checkpoint {checkpoint_ref} end at {head}, but the "
                                         f"document names {doc['head']} as their last: records were cut off")
        return await self._launch(resolved, checkpoint_ref, policy_version=policy_version,
                                  inherited=receipts, **options)

    async def _launch(self, resolved: Resolved, ref: str, *, cpu: float = 1.0, memory: int = 512 * MiB,
                      pids: int = 256, disk: int | None = None, cpu_class: str = "latency",
                      env: Mapping[str, str] | None = None, workdir: str | None = None, user: str | None = None,
                      labels: Mapping[str, str] | None = None, ttl: float | None = None,
                      idle_timeout: float | None = None, job: str | None = None, lease_ttl: float | None = None,
                      policy_version: str | None = None, admitting: bool = True,
                      network: Sequence[Mapping[str, Any]] | None = None, userns: bool = False,
                      inherited: Sequence[Mapping[str, Any]] = ()) -> Sandbox:
        if cpu_class not in CPU_CLASSES:
            raise UnsupportedOption(f"cpu_class {cpu_class!r}: choose one of {CPU_CLASSES}")
        if userns:
            self._check_traversable()
        if job is not None:
            lease = self.leases.get(job)
            if lease is not None and lease.state != "active" and admitting:
                raise JobNotAdmitting(f"job {job!r} is {lease.state}; resume its run manifest first")
            self.leases.renew(job, lease_ttl)
        layout = self.layout
        sid = "lb-" + uuid.uuid4().hex[:12]
        box = Sandbox(self, sid)
        box.bundle.mkdir(parents=True)
        box.rootfs.mkdir()
        self.receipts_dir.mkdir(parents=True, exist_ok=True)
        limits = Limits(cpu=cpu, memory=memory, pids=pids, best_effort=cpu_class == "best-effort")
        options = {"cpu": cpu, "memory": memory, "pids": pids, "disk": disk, "cpu_class": cpu_class,
                   "ttl": ttl, "idle_timeout": idle_timeout, "workdir": workdir, "user": user,
                   "env": dict(env or {}), "network": [dict(r) for r in network] if network is not None else None}
        mapping: tuple[int, int] | None = None
        if userns:
            options["userns"] = True
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
        state: dict[str, Any] = {
            "id": sid, "status": "creating", "ref": ref, "image_digest": resolved.digest, "kind": resolved.kind,
            "labels": dict(labels or {}), "limits": asdict(limits), "ttl": ttl, "idle_timeout": idle_timeout,
            "created": time.time(), "last_active": time.time(), "cgroups_path": f"/{self.cgroup_parent}/{sid}",
            "pid": None, "job": job, "cpu_class": cpu_class, "disk": disk, "policy_version": policy_version,
            "admitting": admitting, "options": options,
            "layer_digests": [layer.digest for layer in resolved.layers],
        }
        if mapping is not None:
            state["userns"] = list(mapping)
        _write_json(box.dir / "state.json", state)  # first: a crash from here on is reconciled
        for rec in inherited:  # the history of the checkpoint this sandbox continues
            self._append_receipt(sid, {**rec, "inherited": True})
        started = time.perf_counter()
        try:
            upper = None
            if disk is not None:
                mnt = await asyncio.to_thread(sbdisk.make_disk, box.dir / "disk.img", box.dir / "disk", disk)
                upper = str(mnt / "upper")
            if resolved.kind == "checkpoint":
                async with await self._store() as store:
                    await Snapshots(store, self.host).restore(ref, str(box.rootfs), upper=upper,
                                                              policy_version=policy_version)
            else:
                await asyncio.to_thread(self.host.mount, resolved, box.rootfs, writable=True, upper=upper)
            if mapping is not None:  # on a thread: the overlay is made under a per-thread fsuid
                await asyncio.to_thread(self._remap_rootfs, box, mapping)
            mounted = time.perf_counter()
            netns = None
            if network is not None:  # default deny with these allow rules; None = loopback only
                # with a user namespace the network namespace must belong to it, or crun cannot
                # mount a sysfs for it and falls back to the host's /sys (host interface names)
                ns_fd = self._userns_fd(*mapping) if mapping is not None else None
                info = await asyncio.to_thread(self.net.create, sid, [dict(r) for r in network], userns_fd=ns_fd)
                netns = str(info.path)
                state["network"] = {**info.to_dict(), "policy": self.net.policy(sid)}
            await asyncio.to_thread(self._start, box, resolved, state, limits, layout, env, workdir, user, netns,
                                    mapping)
        except BaseException:
            with contextlib.suppress(Exception):
                self.destroy(sid)
            raise
        box._receipt("create" if resolved.kind != "checkpoint" else "restore", ref=ref, cpu=cpu, memory=memory,
                     pids=pids, disk=disk, cpu_class=cpu_class, job=job, policy_version=policy_version,
                     layer_digests=state["layer_digests"], mount_seconds=round(mounted - started, 6),
                     start_seconds=round(time.perf_counter() - mounted, 6),
                     **({"userns": list(mapping)} if mapping is not None else {}))
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

    def _start(self, box: Sandbox, resolved: Resolved, state: dict[str, Any], limits: Limits,
               layout: CgroupLayout, env: Mapping[str, str] | None, workdir: str | None, user: str | None,
               netns: str | None, userns: tuple[int, int] | None = None) -> None:
        cfg = resolved.config.get("config", resolved.config) or {}
        image_env = dict(e.split("=", 1) for e in cfg.get("Env") or [] if "=" in e)
        image_env.setdefault("PATH", DEFAULT_PATH)
        merged_env = {**image_env, "HOME": image_env.get("HOME", "/root"), **(env or {})}
        uid, gid = _uid_gid(box.files, user if user is not None else cfg.get("User") or "")
        cwd = workdir or cfg.get("WorkingDir") or "/"
        process = build_process(IDLE_INIT, env=merged_env, cwd="/", uid=0, gid=0)
        # a policed network namespace was made inside the manager's user namespace for this range:
        # the sandbox joins that one, so the network namespace is its own
        joined = f"/proc/{os.getpid()}/fd/{self._userns_fd(*userns)}" if userns and netns else None
        spec = build_spec(str(box.rootfs), process, hostname=box.id, cgroups_path=state["cgroups_path"],
                          limits=limits, cgroup_version=layout.version, netns_path=netns, userns=userns,
                          userns_path=joined)
        _write_json(box.bundle / "config.json", spec)
        state.update(env=merged_env, cwd=cwd, uid=uid, gid=gid, status="starting")
        _write_json(box.dir / "state.json", state)
        self.runtime.create(box.id, box.bundle, pid_file=box.dir / "init.pid", sched_idle=limits.best_effort)
        pid = self._hold_rootfs(box)
        self.runtime.start(box.id)
        state.update(pid=pid, init_start=(_proc_stat(pid) or (0, None))[1], status="running")
        if userns is not None:
            self._await_init_exec(box.id, state["pid"])
        _write_json(box.dir / "state.json", state)

    def _hold_rootfs(self, box: Sandbox) -> int:
        """Hand the rootfs overlay to the created container (its init's mount namespace holds it)
        and take it out of the host's mount table: each create copies that table, so 1,000
        sandboxes' overlays in it made a create ~2x slower.  Returns the init's pid."""
        pid = int((box.dir / "init.pid").read_text())
        try:
            self.host.detach(box.rootfs, pid)
        except MountError as exc:  # still correct while mounted here, only slower for later creates
            log.warning("sandbox %s: rootfs stays in the host's mount table: %s", box.id, exc)
        return pid

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
        box = Sandbox(self, path.parent.name)
        try:
            st = box.state
        except SandboxNotFound:
            return None
        if phase == "detached":
            try:
                self.runtime.delete(box.id, force=True)
            except RuntimeFailed:
                with contextlib.suppress(RuntimeFailed):
                    self.runtime.resume(box.id)
                self.runtime.delete(box.id, force=True)
            return None
        if st.get("userns"):
            self._remap_rootfs(box, (int(st["userns"][0]), int(st["userns"][1])))
        self.runtime.create(box.id, box.bundle, pid_file=box.dir / "init.pid",
                            sched_idle=st.get("cpu_class") == "best-effort")
        self.runtime.start(box.id)
        pid = int((box.dir / "init.pid").read_text())
        if st.get("userns"):
            self._await_init_exec(box.id, pid)
        box._update(pid=pid, init_start=(_proc_stat(pid) or (0, None))[1], status="running")
        if st.get("status") == "paused":
            box.pause()
        box._receipt("restarted", reason="the lazyfetch daemon restarted: the rootfs was remounted on it; "
                                         "processes were lost, files kept", was=st.get("status"))
        log.warning("sandbox %s restarted on a new lazyfetch daemon (processes lost, files kept)", box.id)
        return pid  # HostMounts detaches the new overlay: this init holds it (called under its lock)

    def heal(self) -> int:
        """If the lazyfetch daemon died under running sandboxes, start a new one and restart them."""
        if not any(st.get("status") in ("running", "paused") for st in self.list()):
            return 0
        health = self.host.client.health()
        if health is not None and not self._stale_layers(health["instance"]):
            return 0
        return self.host.remount()

    def _stale_layers(self, instance: str) -> bool:
        state_file = self.host.state_dir / "mounts.json"
        try:
            layers = json.loads(state_file.read_text()).get("layers", {})
        except (OSError, ValueError):
            return False
        return any(info.get("instance") != instance for info in layers.values())

    # -- jobs ---------------------------------------------------------------------------------------------
    def renew(self, job: str, ttl: float | None = None) -> dict[str, Any]:
        return asdict(self.leases.renew(job, ttl))

    def pause_job(self, job: str) -> builtins.list[str]:
        """Freeze every running sandbox of ``job`` (and reclaim their page cache)."""
        done = []
        for st in self.list(job=job):
            if st.get("status") == "running":
                Sandbox(self, st["id"]).pause()
                done.append(st["id"])
        return done

    def resume_job(self, job: str) -> builtins.list[str]:
        done = []
        for st in self.list(job=job):
            if st.get("status") == "paused":
                Sandbox(self, st["id"]).resume()
                done.append(st["id"])
        return done

    def reap(self, now: float | None = None) -> dict[str, builtins.list[str]]:
        """Destroy sandboxes past their TTL or lease; pause those idle past their idle timeout."""
        now = time.time() if now is None else now
        report: dict[str, builtins.list[str]] = {"destroyed": [], "paused": []}
        expired_jobs = {lease.job for lease in self.leases.all() if lease.expired(now)}
        for st in self.list():
            sid = st["id"]
            try:
                if st.get("status") in ("creating", "starting"):
                    continue
                if (st.get("ttl") is not None and now - st["created"] > st["ttl"]) or st.get("job") in expired_jobs:
                    self.destroy(sid)
                    report["destroyed"].append(sid)
                elif (st.get("idle_timeout") is not None and st.get("status") == "running"
                      and now - st["last_active"] > st["idle_timeout"] and not self.inflight(sid)):
                    Sandbox(self, sid).pause()
                    report["paused"].append(sid)
            except (SandboxError, MountError, OSError) as exc:  # one bad sandbox must not stop the reaper
                log.warning("reaper: sandbox %s: %s", sid, exc)
        for job in expired_jobs:
            if not self.list(job=job):
                self.leases.drop(job)
        return report

    # -- destroy / reconcile ----------------------------------------------------------------------------
    def destroy(self, sid: str) -> None:
        """Kill and delete the container, drop its rootfs (upper discarded), cgroups and state. Idempotent."""
        box = Sandbox(self, sid)
        known = (box.dir / "state.json").exists()
        try:  # `crun delete --force` of an unknown container succeeds: no state query first
            self.runtime.delete(sid, force=True)
        except RuntimeFailed:
            with contextlib.suppress(RuntimeFailed):
                self.runtime.resume(sid)  # a frozen init cannot die
            self.runtime.delete(sid, force=True)
        if kmount.is_mountpoint(box.rootfs):
            try:
                self.host.umount(box.rootfs, discard=True)
            except MountError:
                kmount.umount(box.rootfs, lazy=True, missing_ok=True)
        else:
            with contextlib.suppress(MountError):
                self.host.umount(box.rootfs, discard=True)  # forget a stale record
        sbdisk.remove_disk(box.dir / "disk.img", box.dir / "disk")
        if (self.data_dir / "net").exists():
            self.net.destroy(sid)  # after the container: nothing holds the namespace any more
        self._remove_cgroups(f"/{self.cgroup_parent}/{sid}")
        self.uid_ranges.release(sid)  # after the container: no process of the range is left
        if known:
            self._append_receipt(sid, {"id": uuid.uuid4().hex[:16], "sandbox": sid, "action": "destroy",
                                       "time": time.time()})
        with self._lock:  # the log is complete: nothing more is appended to it here
            self._receipt_heads.pop(sid, None)
            self._receipt_locks.pop(sid, None)
        shutil.rmtree(box.dir, ignore_errors=True)
        if not any(self.boxes.glob("*/state.json")):
            self._remove_cgroups(f"/{self.cgroup_parent}")

    def _remove_cgroups(self, path: str) -> None:
        for d in self.layout.dirs(path):
            if d.exists():
                deadline, pause = time.monotonic() + 5.0, 0.002
                while True:  # a killed init lingers a few ms (longer: a zombie of a slow PID 1, a loaded host)
                    try:
                        d.rmdir()
                        break
                    except FileNotFoundError:
                        break
                    except OSError:
                        if time.monotonic() > deadline:
                            break
                        time.sleep(pause)
                        pause = min(pause * 2, 0.05)
                if d.exists():
                    log.warning("cgroup %s still busy; left for the next reconcile", d)

    def reconcile(self) -> dict[str, builtins.list[str]]:
        """After a crash: adopt sandboxes that still run, clean up everything else we own."""
        report: dict[str, builtins.list[str]] = {"adopted": [], "destroyed": [], "orphans": []}
        states = {p.parent.name: p for p in self.boxes.glob("*/state.json")} if self.boxes.exists() else {}
        leftovers = {p.name for p in self.boxes.iterdir() if p.is_dir()} if self.boxes.exists() else set()
        containers = {c["id"]: c for c in self.runtime.list()} if self.runtime.root.exists() else {}
        mounted = set(self.host.status()["mounts"])
        for sid in sorted(set(states) | set(containers) | leftovers):
            box = Sandbox(self, sid)
            c = containers.get(sid)
            ok = (sid in states and c is not None and c.get("status") in ("running", "paused")
                  and str(box.rootfs) in mounted)
            if ok and c is not None:
                with contextlib.suppress(Exception):
                    pid = c.get("pid")
                    box._update(status=c["status"], pid=pid,
                                init_start=(_proc_stat(int(pid)) or (0, None))[1] if pid else None)
                    report["adopted"].append(sid)
                    continue
            self.destroy(sid)
            report["destroyed" if sid in states else "orphans"].append(sid)
        # mounts of boxes whose state vanished
        for mp in self.host.status()["mounts"]:
            if mp.startswith(str(self.boxes) + "/") and Path(mp).parent.name not in report["adopted"]:
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
            self._remove_cgroups(f"/{self.cgroup_parent}")
        return report

    def close(self, *, stop_daemon: bool = True) -> None:
        """Destroy every sandbox and release this host's layer mounts."""
        for st in self.list():
            self.destroy(st["id"])
        self.host.umount_all(stop_daemon=stop_daemon)
        with self._lock:
            for fd in self._userns_fds.values():
                os.close(fd)
            self._userns_fds.clear()

    # -- receipts and cgroup files ------------------------------------------------------------------
    def _append_receipt(self, sid: str, rec: Mapping[str, Any]) -> None:
        """Append one record, chained to the one before it (``prev``: blake3 of that line).

        Appends to one log serialise on a thread lock and an flock (a CLI and the service may
        share a data dir); the head's hash is kept per log and re-read from the file when
        another process appended meanwhile.
        """
        self.receipts_dir.mkdir(parents=True, exist_ok=True)
        with self._lock:
            lock = self._receipt_locks.setdefault(sid, threading.Lock())
        with lock:
            fd = os.open(self.receipts_dir / f"{sid}.jsonl", os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                         0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                size = os.fstat(fd).st_size
                head = self._receipt_heads.get(sid)
                prev = head[1] if head is not None and head[0] == size else _last_line_hash(fd, size)
                line = receipt_line({**rec, "prev": prev})
                os.write(fd, line + b"\n")
                self._receipt_heads[sid] = (size + len(line) + 1, blake3.blake3(line).hexdigest())
            finally:
                os.close(fd)

    def verify_receipts(self, sid: str) -> dict[str, Any]:
        """Check the sandbox's receipt log end to end: ``{"records": n, "head": hash of the last}``."""
        records = self.receipts(sid)
        return {"records": len(records), "head": verify_receipt_chain(records, what=f"sandbox {sid}'s receipts")}

    def receipts(self, sid: str) -> builtins.list[dict[str, Any]]:
        path = self.receipts_dir / f"{sid}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def _oom_kills(self, state: Mapping[str, Any]) -> int:
        d = self.layout.controller_dir("memory", state["cgroups_path"])
        name = "memory.events" if self.layout.version == 2 else "memory.oom_control"
        try:
            for line in (d / name).read_text().splitlines() if d else []:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except OSError:
            pass
        return 0

    def _cgroup_read(self, state: Mapping[str, Any], controller: str, v1: str, v2: str) -> str | None:
        d = self.layout.controller_dir(controller, state["cgroups_path"])
        try:
            return (d / (v2 if self.layout.version == 2 else v1)).read_text() if d else None
        except OSError:
            return None

    def _cpu_usage(self, state: Mapping[str, Any]) -> float | None:
        """CPU seconds the sandbox's cgroup has used so far."""
        text = self._cgroup_read(state, "cpuacct", "cpuacct.usage", "cpu.stat")
        if text is None:
            return None
        if self.layout.version == 1:
            return int(text) / 1e9
        fields = dict(line.split() for line in text.splitlines() if line.strip())
        return int(fields.get("usage_usec", 0)) / 1e6

    def _memory_peak(self, state: Mapping[str, Any]) -> int | None:
        text = self._cgroup_read(state, "memory", "memory.max_usage_in_bytes", "memory.peak")
        return int(text) if text and text.strip().isdigit() else None

    def _pids_current(self, state: Mapping[str, Any]) -> int | None:
        text = self._cgroup_read(state, "pids", "pids.current", "pids.current")
        return int(text) if text and text.strip().isdigit() else None

    def _reclaim(self, state: Mapping[str, Any]) -> dict[str, Any] | None:
        d = self.layout.controller_dir("memory", state["cgroups_path"])
        if d is None:
            return None
        usage_file = d / ("memory.current" if self.layout.version == 2 else "memory.usage_in_bytes")
        before = int(usage_file.read_text())
        try:
            if self.layout.version == 2:
                (d / "memory.reclaim").write_text(str(before))
            else:
                (d / "memory.force_empty").write_text("0")
        except OSError as exc:  # EAGAIN/EBUSY: reclaimed what it could
            log.info("reclaim of %s stopped early: %s", d, exc)
        return {"before": before, "after": int(usage_file.read_text())}
