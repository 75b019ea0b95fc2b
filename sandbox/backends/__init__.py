"""The backends, and the table that says which one runs each isolation.

Adding a backend (say gVisor's runsc) is a folder beside ``container/`` and ``vm/`` with a
class that implements :class:`~sandbox.backends.base.Backend`, plus one row in
:data:`TABLE` (and its isolation's name in :data:`sandbox.core.model.ISOLATIONS`);
docs/ARCHITECTURE.md walks through it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sandbox.backends.base import Backend, HostContext
from sandbox.backends.container.backend import ContainerBackend
from sandbox.backends.vm.backend import VmBackend

# isolation -> (the backend's name, how to make it from a host context and that name's options);
# isolations sharing a name share one instance (microvm and vm are one QEMU backend)
TABLE: dict[str, tuple[str, Callable[..., Backend]]] = {
    "container": ("container", ContainerBackend),
    "microvm": ("vm", VmBackend),
    "vm": ("vm", VmBackend),
}


def make_backends(ctx: HostContext, options: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Backend]:
    """One backend per row of :data:`TABLE` (made once per name): isolation -> backend.
    ``options`` maps a backend's name to its keyword arguments (``{"container": {"runtime": "crun"}}``)."""
    made: dict[str, Backend] = {}
    out: dict[str, Backend] = {}
    for isolation, (name, make) in TABLE.items():
        if name not in made:
            made[name] = make(ctx, **dict((options or {}).get(name, {})))
        out[isolation] = made[name]
    return out


__all__ = ["TABLE", "Backend", "HostContext", "make_backends"]
