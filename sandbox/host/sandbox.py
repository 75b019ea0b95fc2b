"""One sandbox, as its manager hands it out: commands, files, network, lifetime, pause, checkpoint.

A :class:`Sandbox` is a handle (an id and its manager), not the sandbox: every call reads
its state record, and what differs between kinds of isolation goes to its backend
(:mod:`sandbox.backends`).  It is also the :class:`~sandbox.backends.base.Box` a backend is
given: the one way a backend changes the state record or writes a receipt.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import blake3

from layerstore.objects import SCHEMA_RECEIPTS
from sandbox.backends.base import Attach, Backend, CheckpointRequest, Files, StateChanges, main_pid
from sandbox.core.errors import InvalidField, SandboxNotFound, SandboxStateError, UnsupportedOption
from sandbox.core.model import (
    DEFAULT_OUTPUT_CAP,
    SCHEMA_OPTIONS,
    EgressRule,
    ExecRequest,
    SandboxOptions,
    SandboxState,
    check_sandbox_id,
    project_namespace,
)
from sandbox.core.receipts import records_before, verify_receipt_chain
from sandbox.host.execs import Cancel, Cut, ExecResult, as_request
from snapshots.checkpoint import Checkpoint

if TYPE_CHECKING:
    from sandbox.host.manager import SandboxManager

# how stale last_active may be, in seconds: a receipt rewrites state.json for it only when it is
# older (every command writes one or two receipts), and the reaper allows the same slack before it
# calls a sandbox idle
ACTIVE_GRAIN = 1.0


class Sandbox:
    """One sandbox; get it from :class:`~sandbox.host.manager.SandboxManager` (``get``, ``create``)."""

    def __init__(self, manager: SandboxManager, sid: str) -> None:
        self.manager = manager
        self.id = check_sandbox_id(sid)
        self.dir = manager.paths.box(sid)

    @property
    def rootfs(self) -> Path:
        """Where a container's writable overlay is mounted while it is created."""
        return self.dir / "rootfs"

    @property
    def bundle(self) -> Path:
        """A container's OCI bundle (config.json, each running command's process document)."""
        base, rel = self.manager.paths.bundle(self.id)
        return base / rel

    @functools.cached_property
    def backend(self) -> Backend:
        """What runs this sandbox (its isolation never changes)."""
        return self.manager.backend(self.state.options.isolation)

    @functools.cached_property
    def files(self) -> Files:
        """The host's file API of this sandbox (a container's root, a VM's agent)."""
        return self.backend.files(self, self.state)

    # -- state and receipts (the Box protocol) ---------------------------------------------------------
    @property
    def state(self) -> SandboxState:
        return self.manager.states.read(self.id)

    def update(self, **changes: Any) -> SandboxState:
        return self.manager.states.update(self.id, **changes)

    def update_from(self, changes: Callable[[SandboxState], Mapping[str, Any]]) -> SandboxState:
        return self.manager.states.update_from(self.id, changes)

    def receipt(self, action: str, **fields: Any) -> dict[str, Any]:
        try:
            st: SandboxState | None = self.state
        except SandboxNotFound:
            st = None
        rec = {"id": uuid.uuid4().hex[:16], "sandbox": self.id, "action": action, "time": time.time(),
               "image": st.image_digest if st else None, "labels": dict(st.labels) if st else {}, **fields}
        self.manager.receipt_logs.append(self.id, rec)
        if st is not None and rec["time"] - st.last_active >= ACTIVE_GRAIN:
            with contextlib.suppress(SandboxNotFound):  # destroyed meanwhile: nothing is active
                self.update(last_active=rec["time"])
        return rec

    def receipts(self) -> builtins.list[dict[str, Any]]:
        return self.manager.receipts(self.id)

    def receipt_history(self) -> tuple[builtins.list[dict[str, Any]], dict[str, Any]]:
        """The receipts kept and their check (``head`` among it), from one read of the log."""
        return self.manager.receipt_logs.history(self.id)

    def checkpoint_request(self, *, name: str | None = None, labels: Mapping[str, str] | None = None,
                           trajectory_offset: int | None = None, policy_version: str | None = None,
                           memory: bool = False) -> CheckpointRequest:
        st = self.state
        logs = self.manager.receipt_logs
        logs.verify(self.id)  # never carry a broken log on
        # the live segment travels with the checkpoint (its first record names the head and count of
        # what came before): a restored sandbox knows its recent history and idempotency keys
        last = logs.live(self.id)
        head = verify_receipt_chain(last, what=f"sandbox {self.id}'s receipts")
        receipts = {"schema": SCHEMA_RECEIPTS, "sandbox": self.id, "receipts": last, "head": head}
        return CheckpointRequest(
            name=name, labels={**st.labels, **(labels or {})},
            trajectory_offset=trajectory_offset if trajectory_offset is not None else records_before(last) + len(last),
            receipt_id=last[-1]["id"] if last else None,
            policy_version=policy_version if policy_version is not None else st.policy_version,
            attach_docs={"receipts": receipts, "options": {"schema": SCHEMA_OPTIONS, "options": st.options.carried()}},
            prefix=project_namespace(st.project) if st.project else "", memory=memory)

    # -- the main process ------------------------------------------------------------------------------
    def init_pid(self, st: SandboxState | None = None) -> int:
        """The sandbox's main process (a container's init, a VM's VMM), checked: same start time as
        recorded and a task of this sandbox's own cgroup (a reused pid, or any other process, is refused)."""
        return main_pid(st or self.state, self.manager.layout)

    @property
    def pid(self) -> int:
        return self.init_pid()

    def connect_port(self, port: int, timeout: float) -> socket.socket:
        """A non-blocking socket connected to the sandbox's own ``127.0.0.1:<port>`` (blocking call;
        :meth:`Backend.connect_port <sandbox.backends.base.Backend.connect_port>`)."""
        return self.backend.connect_port(self, self.state, port, timeout)

    # -- commands --------------------------------------------------------------------------------------
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
        receipt needs.  On ``timeout`` or when ``cancel`` is set, the process and every
        process it started are killed (in a container, with every orphan it left to the
        init, under the freezer).

        ``attach`` (:mod:`sandbox.edge.commands`): the command's stdin stays open, or it
        runs on a terminal; an ``exec_started`` receipt is written before it runs, with
        the fields ``attach.started()`` gives (reconcile carries them into the receipt
        of a command a crash interrupted), and its ``exec`` receipt has ``attach.finished()``'s.

        With ``idempotency_key``, a command that already ran under that key in
        this sandbox (or in the checkpoint it was restored from) is not run
        again: its recorded result comes back with ``replayed`` set; with
        ``rerun_if_interrupted``, one whose run was cut short (``interrupted``) runs again.
        """
        req = as_request(cmd, env=env or {}, cwd=cwd, timeout=timeout, stdin=stdin, output_cap=output_cap,
                         idempotency_key=idempotency_key)
        return self.manager.execs.run(self, req, on_stdout=on_stdout, on_stderr=on_stderr, cancel=cancel,
                                      keep_output=keep_output, on_cut=on_cut, attach=attach)

    # -- files ---------------------------------------------------------------------------------------
    def read(self, path: str) -> bytes:
        data = self.files.read(path)
        self.receipt("read", path=path, bytes=len(data))
        return data

    def write(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self.files.write(path, data, mode)
        self.receipt("write", path=path, bytes=len(data), blake3=blake3.blake3(data).hexdigest())

    def upload(self, path: str, src: Any, mode: int = 0o644) -> int:
        n = self.files.upload(path, src, mode)
        self.receipt("upload", path=path, bytes=n)
        return n

    def download(self, path: str, dst: Any) -> int:
        n = self.files.download(path, dst)
        self.receipt("download", path=path, bytes=n)
        return n

    def list(self, path: str = "/") -> builtins.list[dict[str, Any]]:
        return self.files.list(path)

    def stat(self, path: str) -> os.stat_result:
        return self.files.stat(path)

    def remove(self, path: str, *, recursive: bool = False) -> None:
        self.files.remove(path, recursive=recursive)
        self.receipt("remove", path=path)

    # -- network ------------------------------------------------------------------------------------
    def set_network(self, rules: Sequence[EgressRule | Mapping[str, Any]]) -> dict[str, Any]:
        """Replace the egress allow rules while the sandbox runs (it must have been created with a network).

        A rule that would open a protected range raises ProtectedDestination (an InvalidField) and the
        rules in force stay, unless the sandbox was created allowed them (``protected_egress``)."""
        st = self.state
        if st.network is None:
            raise SandboxStateError(f"sandbox {self.id} was created without a network (loopback only); "
                                    "create it with network=[...] to police egress")
        options = st.options.replace(network=tuple(EgressRule.parse(r) for r in rules))
        assert options.network is not None
        policy = self.manager.net.set_policy(self.id, list(options.network),
                                             allow_protected=st.options.protected_egress)
        self.update(network={**st.network, "policy": policy}, options=options)
        self.receipt("network", version=policy.get("version"), rules=policy.get("rules"))
        return policy

    # -- lifetime -------------------------------------------------------------------------------------
    def set_ttl(self, seconds: float, *, max_lifetime: float | None = None) -> SandboxState:
        """Destroy the sandbox ``seconds`` from now rather than when its ttl said (longer or shorter).

        Kept as its options' ``ttl`` (its age at destruction, which the reaper compares), so the
        state's format is unchanged; ``max_lifetime`` bounds that age (an edge's ``Maxima.ttl``).
        """
        with self.manager.states.lock:  # read-modify-write of the options
            st = self.state
            if not st.live:
                raise SandboxStateError(f"sandbox {self.id} is {st.status}")
            ttl = self._ttl_from_now(st, seconds, max_lifetime)
            was = st.options.ttl
            st = self.update(options=st.options.replace(ttl=ttl))
        self.receipt("ttl", ttl=ttl, was=was, expires=round(st.created + ttl, 3))
        return st

    def _ttl_from_now(self, st: SandboxState, seconds: float, max_lifetime: float | None) -> float:
        """The ttl (an age) that ends the sandbox ``seconds`` from now, checked against ``max_lifetime``."""
        age = max(0.0, time.time() - st.created)
        ttl = round(age + seconds, 3)
        if max_lifetime is not None and ttl > max_lifetime:
            raise InvalidField("ttl", f"{seconds:g} s from now would make sandbox {self.id} {ttl:.0f} s old, "
                                      f"above this edge's maximum lifetime of {max_lifetime:g} s (at most "
                                      f"{max(0.0, max_lifetime - age):.0f} s more)")
        return ttl

    def set_label(self, key: str, value: str | None) -> SandboxState:
        """Set (or, with None, drop) one of the sandbox's labels: the service's own reserved ones
        too, so callers check tenants' keys before (``check_labels``)."""
        with self.manager.states.lock:  # read-modify-write of the options
            st = self.state
            labels = {k: v for k, v in st.options.labels.items() if k != key}
            if value is not None:
                labels[key] = value
            return self.update(options=st.options.replace(labels=labels))

    # -- pause / resume -----------------------------------------------------------------------------
    def pause(self, *, reclaim: bool = True, ttl: float | None = None,
              max_lifetime: float | None = None) -> dict[str, Any]:
        """Stop every process, and with ``reclaim`` give the host its memory back (a container's page
        cache pushed out; a VM saved to the store and its VMM stopped).

        ``ttl``: seconds from now to its end (as :meth:`set_ttl`, bounded by ``max_lifetime``), in
        the state's same write as ``paused``: a pause that waits for a resume (E2B's, the reaper's
        at a ttl) is never seen paused with the lifetime it had running, nor running with the one
        it has paused, and costs one write; its receipt then has ``ttl``, ``was`` and ``expires``
        as a ``ttl`` receipt does.  A pause that fails leaves the lifetime as it was."""
        st = self.state
        if st.status != "running":
            raise SandboxStateError(f"sandbox {self.id} is {st.status}, not running")
        also, lifetime = self._lifetime(st, ttl, max_lifetime)
        fields = self.backend.pause(self, st, reclaim=reclaim, also=also)
        rec = self.receipt("pause", **fields, **lifetime)
        return {"reclaim": fields.get("reclaim"), "receipt": rec["id"]}

    def resume(self, *, ttl: float | None = None, max_lifetime: float | None = None) -> None:
        """Run the paused sandbox on; ``ttl`` (seconds from now) as :meth:`pause` takes it."""
        st = self.state
        if st.status != "paused":
            raise SandboxStateError(f"sandbox {self.id} is {st.status}, not paused")
        also, lifetime = self._lifetime(st, ttl, max_lifetime)
        self.receipt("resume", **self.backend.resume(self, st, also=also), **lifetime)

    def _lifetime(self, st: SandboxState, ttl: float | None, max_lifetime: float | None
                  ) -> tuple[StateChanges | None, dict[str, Any]]:
        """A new lifetime as a backend writes it with a new status, and the receipt's fields for it
        (filled in by that write).  Checked first, so that a refusal changes nothing; counted from
        the write, so that a resume from the store (seconds) does not eat into it."""
        if ttl is None:
            return None, {}
        self._ttl_from_now(st, ttl, max_lifetime)
        written: dict[str, Any] = {}

        def also(fresh: SandboxState) -> dict[str, Any]:
            new = self._ttl_from_now(fresh, ttl, None)  # (bounded, not refused: the status is changing)
            new = new if max_lifetime is None else min(new, max_lifetime)
            written.update(ttl=new, was=fresh.options.ttl, expires=round(fresh.created + new, 3))
            return {"options": fresh.options.replace(ttl=new)}
        return also, written

    # -- checkpoint ---------------------------------------------------------------------------------
    async def checkpoint(self, *, name: str | None = None, labels: Mapping[str, str] | None = None,
                         trajectory_offset: int | None = None, policy_version: str | None = None,
                         memory: bool = False) -> Checkpoint:
        """Capture the sandbox's writes (processes stopped meanwhile) as a checkpoint in the store.

        ``name`` is the ref to move (default ``checkpoints/<record id>:<n>``, under its
        project's namespace for a project's sandbox); the checkpoint carries the sandbox's
        labels (its project among them) and receipts.  ``memory`` (VMs only): the VM's
        RAM and device state too, so a restore on a host of the same QEMU and guest assets
        goes on with the same processes.
        """
        st = self.state
        if not st.live:
            raise SandboxStateError(f"sandbox {self.id} is {st.status}")
        if memory and not self.backend.capabilities(st.options.isolation).has("memory_checkpoint"):
            raise UnsupportedOption(f"memory: sandbox {self.id} is a {st.options.isolation}: its checkpoints hold "
                                    "files, not processes (isolation=microvm or vm checkpoints memory too)")
        again = self.backend.paused_capture(st) if st.status == "paused" else None
        if again is not None:  # it runs for the capture, then is paused again the way it was
            self.checkpoint_request()  # the history checks out before anything changes
            await asyncio.to_thread(self.resume)
            try:
                return await self.checkpoint(name=name, labels=labels, trajectory_offset=trajectory_offset,
                                             policy_version=policy_version, memory=memory)
            finally:
                await asyncio.to_thread(self.pause, reclaim=again)
        request = self.checkpoint_request(name=name, labels=labels, trajectory_offset=trajectory_offset,
                                          policy_version=policy_version, memory=memory)
        done = await self.backend.checkpoint(self, st, request)
        self.receipt("checkpoint", **done.receipt_fields())
        return done.checkpoint

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

    # -- usage ----------------------------------------------------------------------------------------
    def usage(self) -> dict[str, Any]:
        """What the sandbox uses now: its cgroup's CPU seconds, memory (now and peak), pids; the bytes
        its writes take; and the resources its commands' receipts recorded (sandbox.core.receipts: the
        commands of the segments its log keeps)."""
        st = self.state
        layout, cg = self.manager.layout, st.cgroups_path
        commands = [r for r in self.manager.receipt_logs.find(self.id, "action", "exec") if not r.get("inherited")]
        spent = [float(c) for r in commands if isinstance(r.get("resources"), dict)
                 and isinstance(c := r["resources"].get("cpu_seconds"), (int, float))]
        last = commands[-1] if commands else None
        own = self.backend.usage(self, st)
        memory: dict[str, Any] = {"current": layout.memory_current(cg), "peak": layout.memory_peak(cg),
                                  "limit": st.options.memory}
        if "guest_memory" in own:
            memory["guest"] = own["guest_memory"]  # the VMM's cgroup above is the host's side
        return {
            "sandbox": self.id, "status": st.status, "time": time.time(),
            "cpu_seconds": layout.cpu_seconds(cg),
            "memory": memory,
            "pids": {"current": layout.pids_current(cg), "limit": st.options.pids},
            "disk": own["disk"],
            "commands": {"count": len(commands), "cpu_seconds": round(sum(spent), 6),
                         "last": None if last is None else {
                             "command": last.get("command"), "exit_code": last.get("exit_code"),
                             "time": last.get("time"), "duration": last.get("duration"),
                             "resources": last.get("resources")}},
        }

    def destroy(self) -> None:
        self.manager.destroy(self.id)
