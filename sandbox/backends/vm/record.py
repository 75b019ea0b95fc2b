"""The VM record: what a sandbox's state says of its VM (``state.json``'s ``vm``, docs/FORMAT.md Part 5).

A JSON object of schema ``layerbox.vm.v1``, written only by the VM backend through the
manager and read back here, strictly: a field of the wrong type, or another schema, is
:class:`~sandbox.core.errors.StateUnreadable` naming the field.  Optional fields an older
layerbox did not write (``disk_nodes``, ``guest_net``, ``parent``...) read as their defaults.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sandbox.core.errors import SandboxStateError, StateUnreadable
from sandbox.core.model import SandboxState

VM_RECORD = "layerbox.vm.v1"

Node = tuple[str, str]  # (file, format: raw or qcow2) of one image of the VM's disk, base first


@dataclass(frozen=True)
class VmRecord:
    machine: str  # QEMU's machine: microvm or q35
    assets: str  # the guest assets' key (kernel, initramfs, agent)
    kernel: str | None  # the guest kernel's version
    kernel_from: str  # "layerbox" or "image"
    template: str | None  # the template it was restored from (None: a checkpoint's own memory)
    accel: str  # tcg or kvm
    qemu: str  # QEMU's version
    shape: Mapping[str, Any]  # vCPUs, memory, disk (sandbox.backends.vm.qemu.Shape)
    layers: tuple[Node, ...]  # the image's layers as (metadata image, blob) files
    vmm_pid: int  # 0 while no VMM runs (paused to the store)
    vmm_start: int
    # False; "store": paused to the store (paused_checkpoint); True: an older layerbox's saved.bin
    saved: bool | str = False
    memory_lazy: bool = False  # its RAM is mapped from a checkpoint's image, fetched as touched
    disk_layer: str | None = None  # the checkpoint disk layer it was restored from
    # the disk as QEMU has it, base first, the last one written (None: a record of an older layerbox)
    disk_nodes: tuple[Node, ...] | None = None
    # the store's disk layers equal to all of disk_nodes but the last (None: this host's own files)
    disk_chain: tuple[Mapping[str, Any], ...] | None = None
    disk_top_node: str | None = None  # the QEMU node the guest writes (None: the VMM's own naming)
    guest_net: tuple[str, int, str] | None = None  # (address, prefix length, gateway) the guest was given
    parent: str | None = None  # the checkpoint its disk chain continues
    checkpoints: int = 0  # checkpoints taken of it
    paused_checkpoint: str | None = None  # the checkpoint a pause to the store made
    # why its guest was found breaking the agent protocol: the host no longer talks to its agent
    agent_misbehaved: str | None = None

    @classmethod
    def of(cls, st: SandboxState) -> VmRecord:
        """The record of ``st``'s VM; :class:`SandboxStateError` when it has none (yet)."""
        if st.vm is None:
            raise SandboxStateError(f"sandbox {st.id} has no VM record")
        return cls.from_json(st.vm, where=f"sandbox {st.id}'s VM record")

    def replace(self, **changes: Any) -> VmRecord:
        return dataclasses.replace(self, **changes)

    @property
    def paused_to_store(self) -> bool:
        return self.saved == "store"

    def to_json(self) -> dict[str, Any]:
        def listed(nodes: Sequence[Node] | None) -> list[list[str]] | None:
            return [list(n) for n in nodes] if nodes is not None else None

        return {
            "schema": VM_RECORD, "machine": self.machine, "assets": self.assets, "memory_lazy": self.memory_lazy,
            "kernel": self.kernel, "kernel_from": self.kernel_from, "template": self.template,
            "accel": self.accel, "qemu": self.qemu, "shape": dict(self.shape), "layers": listed(self.layers),
            "vmm_pid": self.vmm_pid, "vmm_start": self.vmm_start, "saved": self.saved,
            "disk_layer": self.disk_layer, "disk_nodes": listed(self.disk_nodes),
            "disk_chain": [dict(x) for x in self.disk_chain] if self.disk_chain is not None else None,
            "disk_top_node": self.disk_top_node,
            "guest_net": list(self.guest_net) if self.guest_net is not None else None,
            "parent": self.parent, "checkpoints": self.checkpoints, "paused_checkpoint": self.paused_checkpoint,
            "agent_misbehaved": self.agent_misbehaved,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], *, where: str) -> VmRecord:
        if doc.get("schema", VM_RECORD) != VM_RECORD:
            raise StateUnreadable(f"{where}: schema {doc.get('schema')!r}, this layerbox reads {VM_RECORD}")
        try:
            saved = doc.get("saved", False)
            if saved not in (False, True, "store"):
                raise ValueError(f"saved is {saved!r}")
            net = doc.get("guest_net")
            chain = doc.get("disk_chain")
            return cls(
                machine=_typed(doc, "machine", str), assets=_typed(doc, "assets", str),
                kernel=_optional(doc, "kernel", str), kernel_from=_typed(doc, "kernel_from", str, "layerbox"),
                template=_optional(doc, "template", str), accel=_typed(doc, "accel", str),
                qemu=_typed(doc, "qemu", str), shape=_typed(doc, "shape", dict), layers=_nodes(doc["layers"]),
                vmm_pid=_typed(doc, "vmm_pid", int), vmm_start=_typed(doc, "vmm_start", int), saved=saved,
                memory_lazy=_typed(doc, "memory_lazy", bool, False), disk_layer=_optional(doc, "disk_layer", str),
                disk_nodes=_nodes(doc["disk_nodes"]) if doc.get("disk_nodes") is not None else None,
                disk_chain=tuple(dict(x) for x in chain) if chain is not None else None,
                disk_top_node=_optional(doc, "disk_top_node", str),
                guest_net=(str(net[0]), int(net[1]), str(net[2])) if net is not None else None,
                parent=_optional(doc, "parent", str), checkpoints=_typed(doc, "checkpoints", int, 0),
                paused_checkpoint=_optional(doc, "paused_checkpoint", str),
                agent_misbehaved=_optional(doc, "agent_misbehaved", str))
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise StateUnreadable(f"{where}: {type(exc).__name__}: {exc}") from None


def _typed(doc: Mapping[str, Any], key: str, kind: type, *default: Any) -> Any:
    value = doc.get(key, *default) if default else doc[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"{key} is {type(value).__name__}, not {kind.__name__}")
    return value


def _optional(doc: Mapping[str, Any], key: str, kind: type) -> Any:
    return None if doc.get(key) is None else _typed(doc, key, kind)


def _nodes(value: Any) -> tuple[Node, ...]:
    return tuple((str(path), str(fmt)) for path, fmt in value)
