"""The VM backends: what the manager calls for a sandbox with ``isolation="microvm"`` (QEMU's
microvm machine) or ``isolation="vm"`` (a full q35 VM, optionally booting the image's own kernel).

The manager keeps owning state.json, receipts, leases and admission; this module starts,
reaches, pauses and stops the VMM (sandbox/backends/vm/qemu.py) and serves a VM's files through its
agent.  Host state per VM sandbox, under ``boxes/<id>/vm/`` (docs/FORMAT.md Part 5):
``disk.qcow2`` (its writes, over the template's disk), the VMM's sockets, ``vmm.log`` and
``console.log``; a VM paused with reclaim is a checkpoint with memory in the store and
nothing here but its record (``saved.bin``: a pause of a layerbox before that, resumed once).
Nothing in that directory is written by the guest except through QEMU's own devices.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from layerstore.errors import LayerstoreError
from layerstore.objects import LayerEntry, Resolved
from layerstore.store import Store
from lazyfetch import kmount
from lazyfetch.errors import LazyfetchError
from sandbox.backends.base import (
    Accounts,
    Attach,
    Box,
    Capabilities,
    Checkpointed,
    CheckpointRequest,
    Files,
    HostContext,
    LeftOver,
    Process,
    StateChanges,
    process_defaults,
    with_status,
)
from sandbox.backends.vm import assets as vmassets
from sandbox.backends.vm import qemu as vm
from sandbox.backends.vm.agent import (
    TERMINALS_SINCE,
    AgentConnection,
    AgentError,
    AgentMisbehaved,
    AgentTooOld,
    GuestProcess,
)
from sandbox.backends.vm.files import GuestFiles
from sandbox.backends.vm.record import VmRecord
from sandbox.core.errors import (
    HostUnsupported,
    SandboxError,
    SandboxStateError,
    StateUnreadable,
    UnsupportedOption,
)
from sandbox.core.model import SandboxOptions, SandboxState
from sandbox.core.sync import run_blocking
from sandbox.isolation.network import VM_GUEST_ADDRESS, VM_TAP_ADDRESS
from snapshots import vmstate
from snapshots.checkpoint import Snapshots
from snapshots.errors import SnapshotError

log = logging.getLogger("layerbox.sandbox")

MAX_DISK_CHAIN = 8  # deltas a checkpoint's disk may stand on; the next one is a whole disk again
MAX_PATH = 4096
# the guest's own figures (its /proc/meminfo: about 1.5 KiB): a "file" longer than this is a
# lie, answered as no figure, and one that takes longer to come is no figure either
GUEST_FIGURES_LIMIT = 64 << 10
GUEST_FIGURES_SECONDS = 5.0


def _mem_total() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _stop_and_switch(vmm: vm.Vmm, qmp: vm.Qmp, switch: Callable[[], None], out: Path, *, memory: bool,
                     keep_stopped: bool) -> float:
    """Stop the guest and switch its disk to the new overlay (with ``memory``, after RAM was copied
    live into ``out/vmstate.bin``); run it on after unless ``keep_stopped``.  Seconds it was stopped."""
    t = time.perf_counter()
    captured = False
    try:
        if memory:  # RAM copied live; the disk switched in the last pass's stop
            stopped = vmm.save(out / "vmstate.bin", mapped_ram=True, qmp=qmp, switchover=switch, durable=False)
            vm.exact_ram_image(out / "vmstate.bin")  # so a restore can map it (bound.vm.ram_image)
        else:
            qmp.execute("stop")  # also drains and flushes every block device
            switch()
        captured = True
    finally:
        try:
            if not (keep_stopped and captured):
                qmp.execute("cont")
        finally:
            qmp.close()
    return stopped if memory else time.perf_counter() - t


def _copy_frozen(sid: str, frozen: Sequence[tuple[str, str]], out: Path, *, whole: bool) -> str:
    """The frozen disk into ``out``: the overlay frozen last as ``delta.qcow2`` (exactly what was
    written since the chain's top), or ``whole``, the chain read through as a sparse raw ``disk.img``."""
    try:
        if not whole:
            subprocess.run(["cp", "--sparse=always", frozen[-1][0], str(out / "delta.qcow2")], check=True,
                           capture_output=True, text=True)
            return "delta.qcow2"
        # -U: the VMM holds the images' locks (it reads them, it writes only the new overlay)
        subprocess.run(["qemu-img", "convert", "-U", "--image-opts", vm.chain_image_opts(frozen),
                        "-O", "raw", "-S", "4k", str(out / "disk.img")], check=True, capture_output=True, text=True)
        return "disk.img"
    except subprocess.CalledProcessError as exc:
        raise SandboxStateError(f"sandbox {sid}: reading its disk failed: {exc.stderr.strip()}") from None


def _text(value: object) -> str | None:
    return None if value is None else str(value)


def _overlay_number(path: Path) -> int | None:
    m = re.fullmatch(r"disk-(\d+)\.qcow2", path.name)
    return int(m[1]) if m else None


def _overlay_numbers(vm_dir: Path) -> list[int]:
    """The numbers of the checkpoint overlays (``disk-<n>.qcow2``) in ``vm_dir``."""
    return [n for f in vm_dir.glob("disk-*.qcow2") if (n := _overlay_number(f)) is not None]


class VmBackend:
    """Every VM of one manager, microvm or q35: their VMMs, agent connections and this host's templates."""

    isolations: tuple[str, ...] = ("microvm", "vm")

    def __init__(self, ctx: HostContext, assets_root: Path | None = None) -> None:
        self.ctx = ctx
        self.templates_dir = ctx.data_dir / "vm" / "templates"
        self.host = ctx.mounts
        self.assets_root = assets_root or vmassets.DEFAULT_ROOT
        self._hv: vm.Hypervisor | None = None
        self._assets: vmassets.Assets | None = None
        self._conns: dict[str, AgentConnection] = {}
        self._misbehaved: dict[str, str] = {}  # sandbox id -> why its guest's agent was cut off
        self._accounts = Accounts()  # for guests restored from a template
        self._lock = threading.Lock()

    # -- the host ---------------------------------------------------------------------------------
    def prepare(self) -> tuple[vm.Hypervisor, vmassets.Assets]:
        """The hypervisor and guest assets, found once; HostUnsupported says what is missing."""
        with self._lock:
            if self._hv is None or self._assets is None:
                try:
                    assets = vmassets.find(self.assets_root)
                    self._hv, self._assets = vm.hypervisor(assets), assets
                except (HostUnsupported, vmassets.AssetsError) as exc:
                    raise HostUnsupported(f"isolation=microvm is not available on this host: {exc}") from None
            return self._hv, self._assets

    def capabilities(self, isolation: str = "microvm") -> Capabilities:
        """What ``isolation`` (microvm or vm) provides here."""
        try:
            hv, assets = self.prepare()
        except HostUnsupported as exc:
            return Capabilities(isolation, False,
                                reason=str(exc).replace("isolation=microvm", f"isolation={isolation}"))
        provides = ["exec", "files", "pause", "resume", "limits", "ttl", "leases", "templates", "templates_in_store",
                    "memory_checkpoint", "checkpoint", "restore", "fork", "network", "background"]
        lacks: list[str] = []
        # terminals and ports are the guest agent's (protocol 3): guest assets built before it lack them
        (provides if assets.agent_protocol >= TERMINALS_SINCE else lacks).extend(["interactive", "ports"])
        if isolation == "vm":
            provides.append("image_kernel")
            lacks += ["bootloader", "pmem_dax"]
        return Capabilities(isolation, True, tuple(provides), tuple(lacks), details={
            **hv.to_json(), "machine": vm.MACHINES[isolation], "guest_assets": assets.key,
            "agent_protocol": assets.agent_protocol,
            "kernel": assets.manifest.get("kernel_version")})

    def assets_for(self, resolved: Resolved, options: SandboxOptions) -> vmassets.Assets:
        """The guest assets a sandbox boots: layerbox's, or with ``kernel="image"`` a set around
        the image's own kernel and modules (built once per image from a read-only lazy mount
        of it, then kept beside the base set)."""
        _, base = self.prepare()
        if options.kernel != "image":
            return base
        digests = [x.digest for x in resolved.layers]
        found = vmassets.load_image_kernel(base, digests)
        if found is not None:
            return found
        key = vmassets.image_kernel_key(base, digests)
        self.templates_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with vm.template_lock(self.templates_dir, f"kernel-{key}"):
            target = self.templates_dir / f".kernel-{key}"
            target.mkdir(mode=0o700, exist_ok=True)
            if kmount.is_mountpoint(target):
                self.host.umount(target, discard=True)
            self.host.mount(Resolved(resolved.digest, "image", resolved.layers, {}, {}), target, trace=False,
                            fill=False)
            try:
                return vmassets.build_image_kernel(base, digests, target)
            except vmassets.AssetsError as exc:
                raise UnsupportedOption(f"kernel: {exc}") from None
            finally:
                self.host.umount(target, discard=True)
                with contextlib.suppress(OSError):
                    target.rmdir()

    def assets_by_key(self, key: str) -> vmassets.Assets:
        """The set a VM's record names, on this host (a resume, a restart)."""
        try:
            return vmassets.load_key(self.assets_root, key)
        except vmassets.AssetsError as exc:
            raise SandboxStateError(f"guest assets {key}: {exc}") from None

    # -- the VMM's jail ---------------------------------------------------------------------------
    def jail_of(self, owner: str) -> tuple[int, int]:
        """The host uid and gid the VMM of ``owner`` (a sandbox id, or a template boot's name)
        runs as: a uid of its own from the manager's jail pool (``Uids.jail``), the same again for
        the same owner (a resume), released with the sandbox (the manager's destroy and reconcile)."""
        uid = self.ctx.resources.uids.jail(owner)
        return uid, uid

    @contextlib.contextmanager
    def _template_jail(self, name: str) -> Iterator[tuple[int, int]]:
        try:
            yield self.jail_of(name)
        finally:
            self.ctx.resources.uids.release(name)

    # -- lifecycle --------------------------------------------------------------------------------
    def check_options(self, options: SandboxOptions) -> None:
        """What a microVM cannot be given, refused before anything is made (a 400 naming the field)."""
        cpus = os.cpu_count() or 1
        if vm.shape_of(options.cpu, options.memory, options.disk).vcpus > cpus:
            raise UnsupportedOption(f"cpu: {options.cpu:g} CPUs is more vCPUs than this host's {cpus}")
        if options.memory < vm.MIN_MEMORY:
            raise UnsupportedOption(f"memory: {options.memory} bytes of guest RAM is less than the "
                                    f"{vm.MIN_MEMORY >> 20} MiB a microVM's kernel needs")
        total = _mem_total()
        if total and options.memory > total:
            raise UnsupportedOption(f"memory: {options.memory} bytes of guest RAM is more than this host's "
                                    f"{total}")

    # -- templates --------------------------------------------------------------------------------
    def shape_for(self, resolved: Resolved, options: SandboxOptions) -> vm.Shape:
        if resolved.disk is not None:
            bound = resolved.doc.get("bound", {}).get("vm") or {}
            return vm.Shape(**bound["shape"])  # the disk's size is the checkpoint's
        return vm.shape_of(options.cpu, options.memory, options.disk, vm.MACHINES[options.isolation])

    def template_key(self, resolved: Resolved, shape: vm.Shape, assets: vmassets.Assets) -> str:
        hv, _ = self.prepare()
        return vm.template_key(hv, assets, [x.digest for x in resolved.layers], shape, mounted=_mounted(resolved))

    def host_template(self, key: str) -> vm.Template | None:
        """This host's template ``key``: booted here (``<key>/``) or mounted from the store
        (``<key>.store/``), else None."""
        return (vm.load_template(self.templates_dir / key, key)
                or vm.load_template(self.templates_dir / f"{key}.store", key))

    def boot_template(self, resolved: Resolved, shape: vm.Shape, assets: vmassets.Assets
                      ) -> tuple[vm.Template, list[vm.Template]]:
        """Boot and save the template of ``resolved``, ``shape`` and guest ``assets`` here (unless
        another call just did); the templates this call made (both kinds: vm.ensure_template)."""
        hv, _ = self.prepare()
        layers = [(f["meta"], f["blob"]) for f in self.host.layer_files(resolved)]
        return vm.ensure_template(self.templates_dir, hv, assets, layers, [x.digest for x in resolved.layers],
                                  shape, self._scratch_netns, self._template_jail, mounted=_mounted(resolved))

    def mount_template(self, key: str, found: Resolved) -> vm.Template:
        """The store's template ``key`` (``found``, its document) mounted lazily here: its VMs
        map its memory file, so what they touch is all that is fetched."""
        target = self.templates_dir / f"{key}.store"
        self.templates_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with vm.template_lock(self.templates_dir, key):
            template = self.host_template(key)
            if template is not None:
                return template
            if kmount.is_mountpoint(target):  # a mount whose template.json does not check out
                self.host.umount(target, discard=True)
            target.mkdir(mode=0o700, exist_ok=True)
            self.host.mount(found, target, trace=False)  # fill: a restored guest touches most of what is not zero
            template = vm.load_template(target, key)
            if template is None or not template.memory.is_file() or not template.state.is_file() or \
                    (template.mounted and not template.disk.is_file()):
                self.host.umount(target, discard=True)
                raise SandboxStateError(f"template document {found.digest}: its layer has no template {key} "
                                        "(template.json, memory, state.bin)")
            return template

    def vm_identity(self, assets_key: str) -> dict[str, Any]:
        """What a saved VM's state needs of the host it loads on (a checkpoint's ``bound.vm``)."""
        hv, _ = self.prepare()
        return {"assets": assets_key, "qemu": ".".join(map(str, hv.version)), "accel": hv.accel,
                "tsc_khz": hv.tsc_khz, "cpu": vm.cpu_flags() if hv.accel == "kvm" else ""}

    def memory_mismatch(self, resolved: Resolved, assets: vmassets.Assets) -> str | None:
        """Why the memory image of checkpoint ``resolved`` cannot load here with ``assets``
        (None: it can); only its disk is restored then."""
        bound = resolved.doc.get("bound", {}).get("vm") or {}
        have = self.vm_identity(assets.key)
        for field in ("assets", "qemu", "accel", "tsc_khz", "cpu"):
            if bound.get(field, "") != have[field]:
                return f"its {field} is {bound.get(field)!r}, this host's {have[field]!r}"
        return None

    def _start_vm(self, sid: str, box_dir: Path, resolved: Resolved, options: SandboxOptions,
               cgroups_path: str, template: vm.Template | None, assets: vmassets.Assets,
               prior: VmRecord | None = None
               ) -> tuple[VmRecord, dict[str, Any] | None, dict[str, float]]:
        """Start the VM of a sandbox: a restore of ``template`` with the sandbox's own disk:
        this host's empty ext4, or for a checkpoint its disk image, mounted lazily here (only
        the blocks the guest reads are fetched).  ``template`` None: the checkpoint's own
        memory image (its ``vmstate.bin``), so its processes go on where they were.  The VMM
        runs in the sandbox's network namespace: with ``network`` rules the policed one a
        container gets, its tap routed (sandbox.isolation.network), else one with nothing but the tap.
        ``prior``: the record of this sandbox's VM paused to the store, which this launch
        resumes: its network namespace and guest address stay as they are.
        Returns the VM record and network for state.json and the timings for the receipt."""
        hv, _ = self.prepare()
        chain = resolved.disk_chain
        shape = self.shape_for(resolved, options)
        files = self.host.layer_files(resolved)
        layers = [(f["meta"], f["blob"]) for f in files]
        t1 = time.perf_counter()
        vm_dir = box_dir / "vm"
        vm_dir.mkdir(mode=0o711, exist_ok=True)  # the VMM's chroot: it may traverse it, not list or change it
        jail = self.jail_of(sid)
        if chain:
            nodes = self._mount_disk_chain(resolved, chain, vm_dir)
        elif template is not None and template.mounted:  # the very disk its guest has mounted
            nodes = [(str(template.disk), "raw")]
        else:
            nodes = [(str(vm.pristine_disk(self.templates_dir, shape.disk)), "raw")]
        vm.sandbox_disk(nodes[-1][0], nodes[-1][1], vm_dir / "disk.qcow2", shape.disk, jail)
        nodes.append((str(vm_dir / "disk.qcow2"), "qcow2"))
        procs = self._cgroup(cgroups_path, options, shape)
        if prior is None:
            network, guest_net = self._network(sid, options)
        else:
            network, guest_net = None, prior.guest_net
        memory: tuple[Path, int] | None = None
        if template is None:
            state_file = vm_dir / f"disk-layer-{len(chain) - 1}" / "vmstate.bin"
            if not chain or not state_file.is_file():
                raise SandboxStateError(f"checkpoint {resolved.digest}: its disk layer has no vmstate.bin, "
                                        "though it is bound with memory")
            if (resolved.doc.get("bound", {}).get("vm") or {}).get("ram_image") == "exact":
                # its RAM mapped from the image (fetched as the guest touches it), the rest loaded
                try:
                    block = vm.device_state_of(state_file, vm_dir / "devices.bin")
                    memory, state_file = (state_file, block.pages_offset), vm_dir / "devices.bin"
                except vm.VmError as exc:
                    log.warning("checkpoint %s: %s; loading its RAM image whole", resolved.digest, exc)
        else:
            state_file = template.state
        vmm, conn = vm.start_from_template(vm_dir, hv, assets, template, layers, shape, state_file, nodes, procs,
                                           netns=self.ctx.resources.networks.manager.netns_path(sid), jail=jail, guest_net=guest_net,
                                           mapped_ram=template is None, memory=memory)
        (vm_dir / "devices.bin").unlink(missing_ok=True)
        self._keep_conn(sid, conn)
        record = VmRecord(
            machine=shape.machine, assets=assets.key, kernel=_text(assets.manifest.get("kernel_version")),
            kernel_from=str(assets.manifest.get("kernel_from", "layerbox")),
            template=template.key if template is not None else None, accel=hv.accel,
            qemu=".".join(map(str, hv.version)), shape=shape.to_json(), layers=tuple(layers), vmm_pid=vmm.pid,
            vmm_start=vmm.start, memory_lazy=memory is not None, disk_layer=chain[-1].digest if chain else None,
            disk_nodes=tuple(nodes), disk_chain=tuple(x.to_json() for x in chain) if chain else None,
            guest_net=guest_net)
        return record, network, {"restore_seconds": round(time.perf_counter() - t1, 6)}

    def _network(self, sid: str, options: SandboxOptions) -> tuple[dict[str, Any] | None,
                                                                   tuple[str, int, str] | None]:
        networks = self.ctx.resources.networks
        if options.network is None:
            networks.acquire_isolated(sid)
            return None, None
        info = networks.acquire(sid, options.network, vm=True, allow_protected=options.protected_egress)
        return {**info.to_dict(), "policy": networks.manager.policy(sid)}, (VM_GUEST_ADDRESS, 30, VM_TAP_ADDRESS)

    @contextlib.contextmanager
    def _scratch_netns(self, name: str) -> Iterator[Path]:
        networks = self.ctx.resources.networks
        path = networks.acquire_isolated(name)
        try:
            yield path
        finally:
            networks.release(name)

    def _mount_disk_chain(self, resolved: Resolved, chain: Sequence[LayerEntry], vm_dir: Path
                          ) -> list[tuple[str, str]]:
        """The checkpoint's disk layers mounted read-only under the VM's directory
        (``disk-layer-<i>``, base first): the base's one file is ``disk.img`` (raw), every
        other's ``delta.qcow2``.  Their (file, format) nodes, base first."""
        nodes = []
        for i, layer in enumerate(chain):
            target = vm_dir / f"disk-layer-{i}"
            target.mkdir(exist_ok=True)
            self.host.mount(Resolved(layer.digest, "image", (layer,), {}, {}), target, trace=False, fill=False)
            name, fmt = ("disk.img", "raw") if i == 0 else ("delta.qcow2", "qcow2")
            if not (target / name).is_file():
                raise SandboxStateError(f"checkpoint {resolved.digest}: its disk layer {layer.digest} has no {name}")
            nodes.append((str(target / name), fmt))
        return nodes

    def capture(self, sid: str, box_dir: Path, st: SandboxState, out: Path, *, memory: bool = False,
                on_snapshot: Callable[[VmRecord], None], keep_stopped: bool = False) -> tuple[float, str]:
        """Capture the VM's disk into ``out``: ``delta.qcow2``, the clusters written since the
        disk the VM's record says the store has (``disk_chain``), or with no such chain (a new
        sandbox's disk is this host's own) or a chain of :data:`MAX_DISK_CHAIN`, the whole
        disk as a sparse raw ``disk.img``.  With ``memory``, also its RAM and device state of
        the same instant in ``out/vmstate.bin`` (QEMU's mapped-ram image).

        The guest's page cache is synced, its vCPUs stopped, and its disk switched to a new
        overlay (``blockdev-add``, ``blockdev-snapshot``): what was written before is frozen, so it is
        read after the guest runs on.  ``on_snapshot(record)`` is called with the VM record
        of the new chain at once (its ``disk_chain`` None until the checkpoint lands).
        ``keep_stopped`` (a pause to the store): the guest is not run on after a capture that
        succeeded, and its overlays are not merged (:meth:`release` removes them).
        Returns the seconds the guest was stopped and which file was made."""
        rec = VmRecord.of(st)
        if st.status != "running":
            raise SandboxStateError(f"sandbox {sid} is {st.status}: its disk is captured while it runs")
        vm_dir = box_dir / "vm"
        nodes, chain, unrecorded = self._disk_nodes(sid, rec, vm_dir)
        # a name no file of this VM has had: a merge shortens the chain, never the numbering
        top = vm_dir / f"disk-{max([len(nodes), *_overlay_numbers(vm_dir)]) + 1}.qcow2"
        vm.sandbox_disk(nodes[-1][0], nodes[-1][1], top, int(rec.shape["disk"]), self.jail_of(sid))
        self.conn(sid, box_dir, st).sync()
        vmm = self.vmm_of(box_dir, st)
        qmp = vmm.qmp()
        frozen = list(nodes)
        # node names are unique in a VMM's life (a merge below removes one); a restarted VMM
        # names them d0..dn again (vm.disk_args); the active one is asked of the VMM when the
        # state may not know it
        active, overlay = rec.disk_top_node or f"d{len(nodes) - 1}", f"o{uuid.uuid4().hex[:12]}"
        if unrecorded:
            names = {n.get("file"): n["node-name"] for n in qmp.execute("query-named-block-nodes")
                     if n.get("drv") == "qcow2"}
            active = names.get(vm.qemu_path(nodes[-1][0], vm_dir), active)

        switched: list[VmRecord] = []  # the record once the disk switched

        def switch() -> None:  # the guest is stopped: its disk goes to the new overlay
            # the new overlay with the options disk_args gives a restarted VMM its top, then the switch
            qmp.execute("blockdev-add", **{"driver": "qcow2", "node-name": overlay, "discard": "unmap",
                                           "backing": None,
                                           "file": {"driver": "file", "filename": vm.qemu_path(top, top.parent)}})
            qmp.execute("blockdev-snapshot", node=active, overlay=overlay)
            switched.append(rec.replace(disk_nodes=(*frozen, (str(top), "qcow2")), disk_chain=None,
                                        disk_top_node=overlay))
            on_snapshot(switched[-1])

        stopped = _stop_and_switch(vmm, qmp, switch, out, memory=memory, keep_stopped=keep_stopped)
        made = _copy_frozen(sid, frozen, out, whole=not (chain and len(chain) < MAX_DISK_CHAIN))
        if not keep_stopped:
            self._merge_frozen(sid, box_dir, st, switched[-1], on_snapshot)
        return stopped, made

    @staticmethod
    def _disk_nodes(sid: str, rec: VmRecord, vm_dir: Path
                    ) -> tuple[list[tuple[str, str]], Sequence[Mapping[str, Any]] | None, list[int]]:
        """The VM's disk as QEMU has it (base first), the store's chain it stands on (None: this
        capture is a whole disk), and the overlays a crash left out of the record."""
        nodes = list(rec.disk_nodes or ())
        if not nodes:
            raise SandboxStateError(f"sandbox {sid}: its VM record predates disk chains; checkpoint it "
                                    "after a restart of its VM, or restore a checkpoint of it")
        chain = rec.disk_chain
        recorded = max((_overlay_number(Path(p)) or 0 for p, _ in nodes), default=0)
        unrecorded = sorted(n for n in _overlay_numbers(vm_dir) if n > recorded)
        for n in unrecorded:
            # an overlay a checkpoint switched the guest to before the state said so (a crash in
            # between): the guest writes there, so it is the top; what was written since the
            # store's chain now spans two files, so this capture is a whole disk
            nodes.append((str(vm_dir / f"disk-{n}.qcow2"), "qcow2"))
            chain = None
        return nodes, chain, unrecorded

    def _merge_frozen(self, sid: str, box_dir: Path, st: SandboxState, rec: VmRecord,
                      on_snapshot: Callable[[VmRecord], None]) -> None:
        """Keep the VM's own overlays at two however often it checkpoints: the one a checkpoint
        just froze is committed into the local overlay under it (``block-commit``, while the
        guest runs) and leaves the chain.  Only this VM's files in its directory are merged
        into; a checkpoint's mounted layers and this host's pristine ext4 never are.  A crash
        meanwhile leaves the frozen overlay in the state and on disk, and the chain reads the
        same through it (every cluster it has is also in the one under it, or not yet)."""
        nodes = list(rec.disk_nodes or ())
        vm_dir = box_dir / "vm"

        def local(path: str) -> bool:
            return Path(path).parent == vm_dir and Path(path).name.startswith("disk") and path.endswith(".qcow2")

        if len(nodes) < 3 or not (local(nodes[-2][0]) and local(nodes[-3][0])):
            return
        qmp = self.vmm_of(box_dir, st).qmp()
        try:
            names = {n.get("file"): n["node-name"] for n in qmp.execute("query-named-block-nodes")
                     if n.get("drv") == "qcow2"}
            top, base = names.get(vm.qemu_path(nodes[-2][0], vm_dir)), names.get(vm.qemu_path(nodes[-3][0], vm_dir))
            if top is None or base is None:
                log.warning("sandbox %s: its frozen overlay is not in its VMM's graph; left unmerged", sid)
                return
            job = f"merge-{uuid.uuid4().hex[:8]}"
            qmp.execute("block-commit", **{"job-id": job, "device": rec.disk_top_node, "top-node": top,
                                           "base-node": base, "auto-dismiss": False})
            deadline = time.monotonic() + 600
            while True:
                info = next((j for j in qmp.execute("query-jobs") if j["id"] == job), None)
                if info is None or info["status"] == "concluded":
                    break
                if time.monotonic() > deadline:
                    qmp.execute("job-cancel", id=job)
                    raise SandboxStateError(f"sandbox {sid}: merging its frozen overlay took over 600 s")
                time.sleep(0.01)
            if info is not None:
                qmp.execute("job-dismiss", id=job)
                if info.get("error"):
                    log.warning("sandbox %s: merging its frozen overlay failed: %s", sid, info["error"])
                    return
        finally:
            qmp.close()
        merged = nodes[-2][0]
        on_snapshot(rec.replace(disk_nodes=(*nodes[:-2], nodes[-1])))  # the state stops naming it first
        Path(merged).unlink(missing_ok=True)

    def _cgroup(self, cgroups_path: str, options: SandboxOptions, shape: vm.Shape) -> list[Path]:
        """The VMM's cgroup with the sandbox's limits: the guest's RAM plus the VMM's own, its
        CPU quota and class, and pids (the VMM's threads; the guest's processes are the guest's)."""
        layout = self.ctx.cgroups
        limits = {
            "memory": shape.memory + vm.VMM_OVERHEAD,
            "pids": max(64, options.pids),
            "cpu_quota": max(1000, int(options.cpu * 100_000)),
            "cpu_shares": 2 if options.cpu_class == "best-effort" else max(2, int(1024 * options.cpu)),
        }
        return layout.make(cgroups_path, limits)

    def vmm_of(self, box_dir: Path, st: SandboxState) -> vm.Vmm:
        rec = VmRecord.of(st)
        return vm.Vmm(box_dir / "vm", rec.vmm_pid, rec.vmm_start)

    def alive(self, box_dir: Path, st: SandboxState) -> bool:
        return st.vm is not None and (bool(VmRecord.of(st).saved) or self.vmm_of(box_dir, st).alive())

    def conn(self, sid: str, box_dir: Path, st: SandboxState) -> AgentConnection:
        """The agent of a running VM, reconnected when this manager did not make the connection;
        never that of a guest found breaking the protocol (AgentMisbehaved)."""
        with self._lock:
            conn = self._conns.get(sid)
            why = (self._misbehaved.get(sid) or (conn.misbehaved if conn is not None else None)
                   or (VmRecord.of(st).agent_misbehaved if st.vm is not None else None))
            if why is None and conn is not None and not conn.closed:
                return conn
        if why is not None:
            raise AgentMisbehaved(f"sandbox {sid}: its guest broke the agent protocol ({why}); the host no "
                                  "longer talks to its agent, so its commands and files are refused: destroy it")
        if st.status != "running":
            raise SandboxStateError(f"sandbox {sid} is {st.status}: its VM's agent is reachable only while it runs")
        vmm = self.vmm_of(box_dir, st)
        if not vmm.alive():
            raise SandboxStateError(f"sandbox {sid}: its VMM ({vmm.pid}) is gone; destroy it")
        try:
            conn = vm.connect_agent(vmm, timeout=10.0)
        except vm.VmError as exc:
            raise SandboxStateError(f"sandbox {sid}: its guest agent does not answer: {exc}") from None
        self._keep_conn(sid, conn)
        return conn

    def _keep_conn(self, sid: str, conn: AgentConnection) -> None:
        """``conn`` is the sandbox's agent from now on; a guest it finds breaking the protocol marks it."""
        with self._lock:
            self._conns[sid] = conn
        conn.watch(lambda why: self._agent_misbehaved(sid, why))

    def _agent_misbehaved(self, sid: str, why: str) -> None:
        """Mark sandbox ``sid`` (its VM record's ``agent_misbehaved``, an ``agent_misbehaved`` receipt):
        every later call that needs its agent answers AgentMisbehaved; destroy works as ever."""
        with self._lock:
            if sid in self._misbehaved:
                return
            self._misbehaved[sid] = why
        log.warning("sandbox %s: its guest broke the agent protocol (%s); the host no longer talks to it", sid, why)

        def marked(fresh: SandboxState) -> dict[str, Any]:
            if fresh.vm is None or VmRecord.of(fresh).agent_misbehaved is not None:
                return {}
            return {"vm": VmRecord.of(fresh).replace(agent_misbehaved=why).to_json()}

        box = self.ctx.box(sid)
        try:
            box.update_from(marked)
            box.receipt("agent_misbehaved", reason=why)
        except SandboxError as exc:  # destroyed meanwhile: nothing left to mark
            log.info("sandbox %s: not marked (%s)", sid, exc)

    def _drop_conn(self, sid: str) -> None:
        with self._lock:
            conn = self._conns.pop(sid, None)
        if conn is not None:
            conn.close()

    def _stop_vcpus(self, sid: str, box_dir: Path, st: SandboxState) -> None:
        """Stop the guest's vCPUs (a pause without reclaim: the VMM and its RAM stay)."""
        qmp = self.vmm_of(box_dir, st).qmp()
        try:
            qmp.execute("stop")
        finally:
            qmp.close()

    def ensure_running(self, box_dir: Path, st: SandboxState) -> bool:
        """Run on a guest the state says runs but whose vCPUs are stopped (a manager that died
        in a pause to the store, between the capture and its state write); whether it had to."""
        try:
            qmp = self.vmm_of(box_dir, st).qmp(timeout=5.0)
        except (vm.VmError, OSError, AgentError):
            return False
        try:
            if qmp.execute("query-status")["status"] in ("paused", "postmigrate"):
                qmp.execute("cont")
                return True
            return False
        except (vm.VmError, OSError):
            return False
        finally:
            qmp.close()

    def release(self, sid: str, box_dir: Path, st: SandboxState) -> VmRecord:
        """After a pause's checkpoint landed in the store: stop the VMM (its guest stopped since
        the capture) and remove the VM's disk files and mounts here; the VM record left."""
        rec = VmRecord.of(st)
        self._drop_conn(sid)
        if rec.vmm_pid:
            self.vmm_of(box_dir, st).quit()
        vm_dir = box_dir / "vm"
        self._unmount_disk_layers(vm_dir)
        for f in vm_dir.glob("disk*.qcow2"):
            f.unlink()
        return rec.replace(vmm_pid=0, vmm_start=0, disk_nodes=None, disk_top_node=None)

    def _run_on(self, sid: str, box_dir: Path, st: SandboxState, cgroups_path: str) -> tuple[VmRecord, float]:
        """Run a paused VM on: its vCPUs, or (a record of an older layerbox) its ``saved.bin``.
        A VM paused to the store is resumed by :meth:`_resume_from_store`."""
        rec = VmRecord.of(st)
        t = time.perf_counter()
        if not rec.saved:
            qmp = self.vmm_of(box_dir, st).qmp()
            try:
                qmp.execute("cont")
            finally:
                qmp.close()
            return rec, time.perf_counter() - t
        hv, _ = self.prepare()
        assets = self.assets_by_key(rec.assets)  # SandboxStateError: this host has no longer that set
        template = self.host_template(rec.template) if rec.template is not None else None
        if template is None and rec.template is not None:
            raise SandboxStateError(f"sandbox {sid} was saved over template {rec.template}, which this host "
                                    "no longer has: it cannot resume; destroy it")
        shape = vm.Shape(**rec.shape)
        layers = list(rec.layers)
        saved = box_dir / "vm" / "saved.bin"
        procs = self._cgroup(cgroups_path, st.options, shape)
        # a record of an older layerbox: its qcow2 names its backing file itself
        nodes = list(rec.disk_nodes or [(str(box_dir / "vm" / "disk.qcow2"), "qcow2")])
        recorded = max((_overlay_number(Path(p)) or 0 for p, _ in nodes), default=0)
        for n in sorted(x for x in _overlay_numbers(box_dir / "vm") if x > recorded):
            # an overlay a checkpoint switched to before the state said so (a crash in between): the
            # guest has written there since, so it goes on top (unused, it is an empty overlay)
            nodes.append((str(box_dir / "vm" / f"disk-{n}.qcow2"), "qcow2"))
        jail = self.jail_of(sid)
        vm_dir = box_dir / "vm"
        vm_dir.chmod(0o711)  # (a VM saved by a layerbox before the jail: its directory was 0700, its disks root's)
        for p, _ in nodes:
            if Path(p).parent == vm_dir:
                os.chown(p, *jail, follow_symlinks=False)
        vmm, conn = vm.start_from_template(box_dir / "vm", hv, assets, template, layers, shape, saved, nodes, procs,
                                           netns=self.ctx.resources.networks.manager.netns_path(sid), jail=jail,
                                           guest_net=rec.guest_net)
        self._keep_conn(sid, conn)
        saved.unlink()
        # disk_top_node: a new VMM's names (vm.disk_args)
        return rec.replace(saved=False, vmm_pid=vmm.pid, vmm_start=vmm.start, disk_nodes=tuple(nodes),
                           disk_top_node=f"d{len(nodes) - 1}"), time.perf_counter() - t

    def _destroy(self, sid: str, box_dir: Path, st: SandboxState | None, cgroup_dirs: Sequence[Path] = ()) -> None:
        """Stop the VMM and remove the VM's files.  The VMM is found by its record and, should the
        record be missing (a crash between its start and the state write), by the sandbox's cgroup,
        where nothing but the VMM runs."""
        self._drop_conn(sid)
        rec = None
        with contextlib.suppress(SandboxStateError, StateUnreadable):  # then found by its cgroup alone
            rec = VmRecord.of(st) if st is not None else None
        if rec is not None and rec.vmm_pid:
            vm.Vmm(box_dir / "vm", rec.vmm_pid, rec.vmm_start).kill()
        for d in cgroup_dirs:
            with contextlib.suppress(OSError, ValueError):
                for pid in {int(x) for x in (d / "cgroup.procs").read_text().split()}:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(pid, 0)
        vm_dir = box_dir / "vm"
        self._unmount_disk_layers(vm_dir)  # after the VMM: it read its backing files from there
        shutil.rmtree(vm_dir, ignore_errors=True)

    def _unmount_disk_layers(self, vm_dir: Path) -> None:
        for target in sorted(vm_dir.glob("disk-layer*")) if vm_dir.is_dir() else ():  # (disk-layer: older)
            with contextlib.suppress(LazyfetchError, OSError):
                self.host.umount(target, discard=True)
            if kmount.is_mountpoint(target):
                kmount.umount(target, lazy=True, missing_ok=True)
            with contextlib.suppress(OSError):
                target.rmdir()


    def prune_templates(self, keep: Sequence[str] = ()) -> list[str]:
        """Remove this host's templates but ``keep``, booted or mounted; a template is derived
        data, mounted from the store or booted again on demand."""
        removed = []
        if self.templates_dir.is_dir():
            for d in self.templates_dir.iterdir():
                key = d.name.removesuffix(".store")
                if not d.is_dir() or key in keep or key.startswith("."):
                    continue
                with vm.template_lock(self.templates_dir, key):
                    if kmount.is_mountpoint(d):
                        self.host.umount(d, discard=True)
                    shutil.rmtree(d, ignore_errors=True)
                removed.append(d.name)
        return removed



    # -- the Backend protocol -------------------------------------------------------------------------
    async def check(self, options: SandboxOptions, resolved: Resolved, ref: str) -> None:
        self.check_options(options)
        await asyncio.to_thread(self.prepare)  # a host without QEMU or guest assets: refused here
        if resolved.kind == "checkpoint" and resolved.disk is None:
            raise UnsupportedOption(f"{ref} is a container's checkpoint (files of an overlay): it restores "
                                    f"into a container, not a {options.isolation}")
        machine = ((resolved.doc.get("bound", {}).get("vm") or {}).get("machine")
                   if resolved.disk is not None else None)
        if machine is not None and machine != vm.MACHINES[options.isolation]:
            wanted = next(k for k, v in vm.MACHINES.items() if v == machine)
            raise UnsupportedOption(f"isolation: {ref} is a checkpoint of a {machine} VM: restore it with "
                                    f"isolation={wanted}")

    async def launch(self, box: Box, resolved: Resolved, ref: str) -> dict[str, Any]:
        st = box.state
        options = st.options
        t = time.perf_counter()
        template: vm.Template | None = None
        memory_why = None
        assets = await asyncio.to_thread(self.assets_for, resolved, options)
        bound_memory = bool(resolved.doc.get("bound", {}).get("memory"))
        if bound_memory:
            memory_why = self.memory_mismatch(resolved, assets)
            if memory_why is not None:
                log.warning("checkpoint %s: its memory does not load here (%s): only its disk is restored",
                            resolved.digest, memory_why)
        if bound_memory and memory_why is None:
            source = "checkpoint"  # its own memory image: no template
        else:
            template, source = await self._template(resolved, options, assets)
        template_seconds = time.perf_counter() - t
        record, network, timings = await asyncio.to_thread(self._start_vm, box.id, box.dir, resolved, options,
                                                           st.cgroups_path, template, assets)
        st = box.update(vm=record.to_json(), pid=record.vmm_pid, init_start=record.vmm_start, status="starting",
                        network=network)
        # a guest fresh from a template has run nothing of the sandbox's yet: its passwd is the document's
        accounts = self._accounts.of(resolved.digest) if template is not None else None
        defaults = await asyncio.to_thread(process_defaults, self.files(box, st), resolved, options, accounts)
        box.update(env=defaults.env, cwd=defaults.cwd, uid=defaults.uid, gid=defaults.gid, status="running")
        return {"isolation": options.isolation,
                "vm": {k: v for k, v in record.to_json().items()
                       if k in ("machine", "assets", "kernel", "kernel_from", "template", "accel", "qemu", "shape")},
                "template_seconds": round(template_seconds, 6), "template_made": source == "boot",
                "template_source": source, "start_seconds": timings["restore_seconds"],
                **({"memory_restored": memory_why is None, "memory_lazy": record.memory_lazy}
                   if bound_memory else {}),
                **({"memory_not_restored": memory_why} if memory_why else {})}

    async def _template(self, resolved: Resolved, options: SandboxOptions, assets: vmassets.Assets
                        ) -> tuple[vm.Template, str]:
        """The template a new VM restores, and where it came from: ``host`` (this host has it),
        ``store`` (another host booted it: mounted lazily from the store) or ``boot`` (booted
        here now, then published so that no other host boots it)."""
        shape = self.shape_for(resolved, options)
        key = await asyncio.to_thread(self.template_key, resolved, shape, assets)
        local = self.host_template(key)
        if local is not None:
            return local, "host"
        async with await self.ctx.open_store() as store:
            try:
                found = await vmstate.find_template(store, key)
                if found is not None:
                    return await asyncio.to_thread(self.mount_template, key, found), "store"
            except (LayerstoreError, LazyfetchError, SnapshotError) as exc:  # a cache: boot it instead
                log.warning("template %s from %s: %s; booting it here", key, store.url, exc)
            template, made = await asyncio.to_thread(self.boot_template, resolved, shape, assets)
            if not made:
                return template, "host"
            for each in made:  # (both kinds: a host that restores a checkpoint boots none either)
                await self._publish_template(store, each)
            return template, "boot"

    async def _publish_template(self, store: Store, template: vm.Template) -> None:
        files = ("memory", "state.bin", "template.json", *(("disk.raw",) if template.mounted else ()))
        try:
            pub = await vmstate.publish_template(store, template.dir, files, template.doc, self.ctx.data_dir)
            log.info("template %s published as %s: %d bytes stored, %d uploaded in %.2f s", template.key,
                     pub.digest, pub.bytes_stored, pub.bytes_uploaded, pub.seconds)
        except (LayerstoreError, SnapshotError, OSError) as exc:
            log.warning("template %s: publishing it to %s failed (%s); other hosts boot their own", template.key,
                        store.url, exc)

    def files(self, box: Box, st: SandboxState) -> Files:
        return GuestFiles(lambda: self.conn(box.id, box.dir, box.state))

    def spawn(self, box: Box, st: SandboxState, argv: Sequence[str], *, env: Mapping[str, str], cwd: str,
              uid: int, gid: int, tag: str, input_pipe: bool, attach: Attach | None = None) -> Process:
        """A command in the guest through its agent; its output arrives in OS pipes, so the
        manager's pump streams, caps and times it out as a container's.  A background command
        (``attach`` on pipes) gets its owner's input: the agent's stdin forwarder reads a copy
        of the owner's pipe.  On a terminal the guest agent makes the pty; its owner gets a pipe
        to write the keys to and the agent's resize request (``Attach.on_terminal``)."""
        terminal = attach.terminal if attach is not None else None
        stdin_fd = keys = None
        proc = None
        try:
            conn = self.conn(box.id, box.dir, st)
            if terminal is not None:
                stdin_fd, keys = os.pipe2(os.O_CLOEXEC)
            elif attach is not None:  # a copy: the owner closes its own once the runner holds it
                stdin_fd = os.dup(attach.stdin_fd) if attach.stdin_fd is not None else os.open(os.devnull, os.O_RDONLY)
            proc = conn.exec(list(argv), env=dict(env), cwd=cwd, uid=uid, gid=gid, stdin_fd=stdin_fd,
                             terminal=terminal)
        except AgentTooOld as exc:
            raise UnsupportedOption(f"sandbox {box.id}: {exc}") from None
        except AgentError as exc:
            raise SandboxStateError(f"sandbox {box.id}: its guest agent: {exc}") from None
        finally:
            if attach is not None:
                attach.spawned()
            if keys is not None and proc is None:  # no command reads them (exec closed the other end)
                os.close(keys)
        if attach is not None and keys is not None:
            attach.on_terminal(keys, proc.resize)
        return GuestCommand(proc, st.options.isolation)

    def connect_port(self, box: Box, st: SandboxState, port: int, timeout: float) -> socket.socket:
        """The guest agent connects to the guest's own ``127.0.0.1:<port>`` and relays the stream
        (whatever the sandbox's network: the connection never crosses its NIC)."""
        try:
            return self.conn(box.id, box.dir, st).connect_port(port, timeout)
        except AgentTooOld as exc:
            raise UnsupportedOption(f"ports: sandbox {box.id}: {exc}") from None
        except AgentError as exc:
            raise SandboxStateError(f"sandbox {box.id}: its guest agent: {exc}") from None

    def update_limits(self, box: Box, st: SandboxState, options: SandboxOptions) -> None:
        raise UnsupportedOption(f"sandbox {box.id} is a {st.options.isolation}: its limits are its VM's shape")

    # -- pause and resume ------------------------------------------------------------------------------
    def pause(self, box: Box, st: SandboxState, *, reclaim: bool, also: StateChanges | None = None) -> dict[str, Any]:
        """Without reclaim the guest's vCPUs stop (its VMM and RAM stay); with it, the VM goes to the
        store (:meth:`_pause_to_store`) and its VMM stops."""
        if reclaim:
            return run_blocking(self._pause_to_store(box, also))
        self._stop_vcpus(box.id, box.dir, st)
        box.update_from(with_status("paused", also))
        return {"reclaim": None, "isolation": st.options.isolation}

    async def _pause_to_store(self, box: Box, also: StateChanges | None) -> dict[str, Any]:
        """A checkpoint with memory of the VM (disk, RAM, device state of one instant) into the store,
        its guest left stopped after the capture; then its VMM stopped and its disk files and
        mounts here removed.  Its state keeps the checkpoint (``vm.paused_checkpoint``): a resume
        here, or a restore of it on any host, goes on from there."""
        st = box.state
        started = time.perf_counter()
        done = await self._checkpoint(box, st, box.checkpoint_request(memory=True), keep_stopped=True)
        box.receipt("checkpoint", **done.receipt_fields())
        ckpt = done.checkpoint
        # the state says paused first: a crash from here on leaves a sandbox to resume from the store
        box.update_from(lambda fresh: with_status("paused", also, vm=VmRecord.of(fresh).replace(
            saved="store", paused_checkpoint=ckpt.digest).to_json())(fresh))
        record = await asyncio.to_thread(self.release, box.id, box.dir, box.state)
        box.update(vm=record.to_json(), pid=None, init_start=None)
        reclaim = {"checkpoint": ckpt.name, "digest": ckpt.digest, "stopped_seconds": ckpt.freeze_seconds,
                   "bytes_uploaded": ckpt.bytes_uploaded, "save_seconds": round(time.perf_counter() - started, 6),
                   "page_cache": self.ctx.cgroups.reclaim(st.cgroups_path)}
        return {"reclaim": reclaim, "isolation": st.options.isolation}

    def resume(self, box: Box, st: SandboxState, *, also: StateChanges | None = None) -> dict[str, Any]:
        if VmRecord.of(st).paused_to_store:
            return run_blocking(self._resume_from_store(box, also))
        record, seconds = self._run_on(box.id, box.dir, st, st.cgroups_path)
        box.update_from(with_status("running", also, vm=record.to_json(), pid=record.vmm_pid,
                                    init_start=record.vmm_start))
        return {"isolation": st.options.isolation, "resume_seconds": round(seconds, 6)}

    async def _resume_from_store(self, box: Box, also: StateChanges | None) -> dict[str, Any]:
        """Resume a VM paused to the store: its checkpoint restored in place (the same sandbox,
        network and limits), the guest going on where the pause stopped it."""
        st = box.state
        prior = VmRecord.of(st)
        assert prior.paused_checkpoint is not None
        started = time.perf_counter()
        async with await self.ctx.open_store() as store:
            resolved = await store.resolve(prior.paused_checkpoint, refresh=True)
        await asyncio.to_thread(self.release, box.id, box.dir, st)  # what a crash in the pause left
        assets = await asyncio.to_thread(self.assets_by_key, prior.assets)
        why = self.memory_mismatch(resolved, assets)
        if why is not None:
            raise SandboxStateError(f"sandbox {box.id}: its paused memory does not load on this host ({why}); "
                                    f"restore {resolved.digest} on a host where it does")
        record, _, _ = await asyncio.to_thread(self._start_vm, box.id, box.dir, resolved, st.options,
                                               st.cgroups_path, None, assets, prior)
        record = record.replace(parent=resolved.digest, checkpoints=prior.checkpoints,
                                agent_misbehaved=prior.agent_misbehaved)  # the same guest goes on
        box.update_from(with_status("running", also, vm=record.to_json(), pid=record.vmm_pid,
                                    init_start=record.vmm_start))
        return {"isolation": st.options.isolation, "checkpoint": resolved.digest,
                "resume_seconds": round(time.perf_counter() - started, 6)}

    # -- checkpoint ------------------------------------------------------------------------------------
    def paused_capture(self, st: SandboxState) -> bool | None:
        # the guest's own page cache may hold writes its disk does not have yet: it runs for the
        # capture (a sync, then stopped again for the copy) and is paused again after, to the
        # store again when it was there
        return bool(VmRecord.of(st).saved)

    async def checkpoint(self, box: Box, st: SandboxState, request: CheckpointRequest) -> Checkpointed:
        return await self._checkpoint(box, st, request)

    async def _checkpoint(self, box: Box, st: SandboxState, request: CheckpointRequest, *,
                          keep_stopped: bool = False) -> Checkpointed:
        """The VM's whole disk, stopped and flushed, as the checkpoint's disk layer (chunks dedup
        against its parent's), and with ``memory`` its RAM image beside it; the chain is kept in
        its VM record."""
        record = VmRecord.of(st)
        seq = record.checkpoints + 1
        parent = record.parent or st.image_digest

        def on_snapshot(rec: VmRecord) -> None:  # the VM's disk chain changed: state says so at once
            box.update_from(lambda fresh: {"vm": VmRecord.of(fresh).replace(
                disk_nodes=rec.disk_nodes, disk_chain=None, disk_top_node=rec.disk_top_node).to_json()})

        async with await self.ctx.open_store() as store:
            ckpt = await Snapshots(store, self.host).checkpoint_disk(
                parent, lambda out: self.capture(box.id, box.dir, box.state, out, memory=request.memory,
                                                 on_snapshot=on_snapshot, keep_stopped=keep_stopped),
                ref_name=request.name or f"{request.prefix}checkpoints/{box.id}:{seq}", memory=request.memory,
                isolation=st.options.isolation, base=record.disk_chain or (),
                chunk_size=vmstate.VM_CHUNK_SIZE,
                vm={"machine": record.machine, "shape": dict(record.shape), **self.vm_identity(record.assets),
                    # its vmstate.bin's page region is the RAM itself (vm.exact_ram_image): mappable
                    **({"ram_image": "exact"} if request.memory else {})},
                labels=dict(request.labels), trajectory_offset=request.trajectory_offset,
                receipt_id=request.receipt_id, policy_version=request.policy_version,
                attach_docs=dict(request.attach_docs))
            chain = (await store.resolve(ckpt.digest)).disk_chain
        box.update_from(lambda fresh: {"vm": VmRecord.of(fresh).replace(
            parent=ckpt.digest, checkpoints=seq, disk_chain=tuple(x.to_json() for x in chain)).to_json()})
        return Checkpointed(ckpt, {"isolation": st.options.isolation, "disk_layer": ckpt.layer,
                                   "memory": request.memory})

    # -- usage, destroy, recovery ----------------------------------------------------------------------
    def usage(self, box: Box, st: SandboxState) -> dict[str, Any]:
        """What its qcow2 files hold on the host, and the guest's own view of its memory."""
        try:
            held: int | None = sum(f.stat().st_blocks * 512 for f in (box.dir / "vm").glob("disk*.qcow2"))
        except OSError:
            held = None
        limit = int(VmRecord.of(st).shape["disk"]) if st.vm is not None else None
        return {"disk": {"where": "vm-disk", "used": held, "free": None, "limit": limit, "partial": False},
                "guest_memory": self._guest_memory(box, st)}

    def _guest_memory(self, box: Box, st: SandboxState) -> dict[str, int] | None:
        """A running VM's own view (its /proc/meminfo: total, available, and used = the difference;
        with free-page reporting, what it frees goes back to the host); None when it does not run."""
        if st.status != "running":
            return None
        try:
            text = self.conn(box.id, box.dir, st).read(
                "/proc/meminfo", limit=GUEST_FIGURES_LIMIT,
                deadline=time.monotonic() + GUEST_FIGURES_SECONDS).decode(errors="replace")
        except (OSError, SandboxError):
            return None
        kb = {k: int(v.split()[0]) * 1024 for k, _, v in (ln.partition(":") for ln in text.splitlines())
              if v.strip() and v.split()[0].isdigit()}
        if "MemTotal" not in kb or "MemAvailable" not in kb:
            return None
        return {"total": kb["MemTotal"], "available": kb["MemAvailable"],
                "used": kb["MemTotal"] - kb["MemAvailable"]}

    def destroy(self, sid: str, st: SandboxState | None) -> None:
        box_dir = self.ctx.paths.box(sid)
        if (box_dir / "vm").exists():  # else it never got as far as a VM (or is not one)
            self._destroy(sid, box_dir, st, self.ctx.cgroups.dirs(self.ctx.resources.cgroups.path(sid)))
        with self._lock:
            self._misbehaved.pop(sid, None)  # its connection is closed: nothing marks it again

    def survivors(self) -> Mapping[str, Any]:
        return {}  # a VM is found by its record (its VMM's pid and start time), not by a runtime's list

    def adopt(self, box: Box, st: SandboxState, survivors: Mapping[str, Any]) -> list[LeftOver] | None:
        if not (st.live and self.alive(box.dir, st)):
            return None  # the VMM died (killed, OOM, the host rebooted): nothing to adopt
        if st.status == "running" and not VmRecord.of(st).saved and self.ensure_running(box.dir, st):
            # a manager that died in a pause to the store after the capture stopped the guest and
            # before its state said paused: the guest runs on as if not paused
            log.warning("sandbox %s: its guest was stopped by a pause that did not finish; running it on", box.id)
        return []  # its VMM runs on (or it is paused): reconnected on use

    def close(self) -> None:
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            conn.close()


class GuestCommand:
    """A command in the guest (:class:`~sandbox.backends.base.Process`) over its agent's channel."""

    def __init__(self, proc: GuestProcess, isolation: str) -> None:
        self._proc = proc
        self._isolation = isolation

    @property
    def stdout(self) -> IO[bytes]:
        return self._proc.stdout

    @property
    def stderr(self) -> IO[bytes]:
        return self._proc.stderr

    @property
    def stdin(self) -> IO[bytes] | None:
        return self._proc.stdin

    @property
    def tty(self) -> int | None:
        return None

    def poll(self) -> int | None:
        return self._proc.poll()

    def kill_tree(self) -> bool:
        self._proc.kill()  # the agent kills the command's whole process group
        return True

    def kill(self) -> None:
        self._proc.kill()

    def finish(self) -> int | None:
        if self._proc.poll() is None:
            self._proc.kill()
        try:
            return self._proc.wait(5.0)
        except TimeoutError:
            return None

    def oom_killed(self) -> bool:
        return False  # the guest's own OOM killer is the guest's business: the VMM's cgroup is its RAM

    def receipt(self) -> dict[str, Any]:
        return {"isolation": self._isolation}


def _mounted(resolved: Resolved) -> bool:
    """Whether a VM of ``resolved`` restores the template whose guest has its disk mounted: a new
    sandbox (its disk stands on that template's); a checkpoint brings a disk of its own."""
    return not resolved.disk_chain
