"""After a crash of the manager: adopt the sandboxes that still run, take back everything else.

A sandbox is adopted when its state reads, it is not a warm-pool sandbox (its pool died with
the process), and its backend finds it still running (``Backend.adopt``: a container's init in
its cgroup, a VM's VMM alive); the commands the dead manager left running in it are killed and
their receipts say ``interrupted: "restart"``.  Everything else is destroyed: sandboxes whose
backend lost them, whose state this version cannot read, runtime leftovers without a state.
Then every host resource step releases what no adopted sandbox holds (a crash between a
resource's acquire and the state write leaves such owners), the reaper runs (TTLs and leases
ran on while the manager was down), and the daemon is healed for the adopted ones.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lazyfetch import kmount
from sandbox.core.errors import SandboxError, SandboxNotFound, StateUnreadable
from sandbox.core.model import POOL_LABEL, SandboxState
from sandbox.host.execs import interrupted_receipt
from sandbox.host.sandbox import Sandbox

if TYPE_CHECKING:
    from sandbox.host.manager import SandboxManager

log = logging.getLogger("layerbox.sandbox")


def reconcile(mgr: SandboxManager) -> dict[str, list[str]]:
    """Adopt, destroy and sweep; what was done, by sandbox (and ``<step>:<owner>`` for resources)."""
    report: dict[str, list[str]] = {"adopted": [], "destroyed": [], "orphans": [], "interrupted": []}
    strays: list[str] = []
    ids = set(mgr.ids(strays=strays))
    for name in strays:  # not made by any manager of this version; nothing in it is read
        _remove_stray(mgr, name)
        report["orphans"].append(f"stray:{name}")
    survivors = {id(b): b.survivors() for b in mgr.all_backends()}
    for sid in sorted(ids | {sid for found in survivors.values() for sid in found}):
        try:
            box = Sandbox(mgr, sid)
        except SandboxError:
            log.warning("runtime container %r is not a sandbox id; left alone", sid)
            continue
        try:
            st: SandboxState | None = box.state
        except (SandboxNotFound, StateUnreadable) as exc:
            log.warning("reconcile: %s", exc)
            st = None
        if st is not None and POOL_LABEL not in st.labels and _adopt(mgr, box, st, survivors, report):
            continue
        had_state = st is not None or (box.dir / "state.json").exists()
        mgr.destroy(sid)
        report["destroyed" if had_state else "orphans"].append(sid)
    report["orphans"] += mgr.resources.sweep(set(report["adopted"]))
    if report["adopted"]:
        mgr.heal()  # the daemon may have died with the manager: their rootfs reads would fail
    for sid in mgr.reap()["destroyed"]:  # TTLs and leases ran on while the manager was down
        report["destroyed"].append(sid)
        report["adopted"].remove(sid)
    if not report["adopted"]:
        mgr.resources.cgroups.release_parent(lambda: not mgr.holds_any())
    return report


def _adopt(mgr: SandboxManager, box: Sandbox, st: SandboxState, survivors: dict[int, Mapping[str, Any]],
           report: dict[str, list[str]]) -> bool:
    backend = mgr.backend(st.options.isolation)
    left = backend.adopt(box, st, survivors[id(backend)])
    if left is None:
        return False
    for leftover in left:  # a command must never run on unobserved: killed, and recorded so
        box.receipt("exec", **interrupted_receipt(mgr.started_of(box.id, leftover.tag), leftover.command))
        report["interrupted"].append(f"{box.id}/{leftover.tag}")
    report["adopted"].append(box.id)
    return True


def _remove_stray(mgr: SandboxManager, name: str) -> None:
    stray = mgr.boxes / name
    for mp in kmount.mounts_under(stray):
        kmount.umount(mp, lazy=True, missing_ok=True)
    if stray.is_dir() and not stray.is_symlink():
        shutil.rmtree(stray, ignore_errors=True)
    else:
        stray.unlink(missing_ok=True)
