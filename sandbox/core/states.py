"""The state records of one manager's sandboxes: ``boxes/<id>/state.json`` (docs/FORMAT.md, "Sandbox state").

Written only by the manager (and by a backend through the manager's handle), never read from
anywhere a sandbox can write.  Every read-modify-write goes through :meth:`States.update`
under one lock: exec threads, the reaper and preemption all write records.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sandbox.core.errors import SandboxNotFound, StateUnreadable
from sandbox.core.model import SandboxState, check_sandbox_id
from sandbox.core.paths import read_beneath, replace_beneath


class States:
    """Read, write and update the records under ``boxes``; each parsed once per content of its file."""

    def __init__(self, boxes: Path) -> None:
        self.boxes = boxes
        self.lock = threading.RLock()
        self._parsed: dict[str, tuple[bytes, SandboxState]] = {}  # the last parse of each state file
        self.on_write: Callable[[SandboxState], None] | None = None  # told of every state written

    def read(self, sid: str) -> SandboxState:
        """The sandbox's state, parsed and checked once per content of its file.

        The bytes are read every time and compared with those of the last parse (exact: no
        clock or inode number can make a stale parse pass), so listing 1,000 sandboxes is
        1,000 small reads, not 1,000 validations (~0.1 ms each).
        """
        sid = check_sandbox_id(sid)
        try:
            raw = read_beneath(self.boxes, f"{sid}/state.json", private=True)
        except FileNotFoundError:
            self._parsed.pop(sid, None)
            raise SandboxNotFound(f"sandbox {sid}: no such sandbox on this host ({self.boxes})") from None
        cached = self._parsed.get(sid)
        if cached is not None and cached[0] == raw:
            return cached[1]
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            raise StateUnreadable(f"{self.boxes}/{sid}/state.json: not JSON ({exc})") from None
        st = SandboxState.from_json(doc, where=f"{self.boxes}/{sid}/state.json")
        self._parsed[sid] = (raw, st)
        return st

    def write(self, st: SandboxState) -> None:
        replace_beneath(self.boxes, f"{st.id}/state.json", json.dumps(st.to_json(), sort_keys=True).encode())
        if self.on_write is not None:
            self.on_write(st)

    def update(self, sid: str, **changes: Any) -> SandboxState:
        with self.lock:
            st = self.read(sid).replace(**changes)
            self.write(st)
            return st

    def update_from(self, sid: str, changes: Callable[[SandboxState], Mapping[str, Any]]) -> SandboxState:
        with self.lock:
            current = self.read(sid)
            st = current.replace(**changes(current))
            self.write(st)
            return st

    def exists(self, sid: str) -> bool:
        return (self.boxes / check_sandbox_id(sid) / "state.json").exists()

    def forget(self, sid: str) -> None:
        self._parsed.pop(sid, None)

    def remove(self, sid: str) -> None:
        """The record goes, under the lock: an update in flight (a command's last receipt moving
        ``last_active``) ends first, and any later one finds no sandbox.  Removing the directory
        alone raced with it: the update's new file could land after ``rmtree`` listed the
        directory, which then stayed, and the sandbox was listed as running after its destroy."""
        with self.lock:
            self._parsed.pop(sid, None)
            (self.boxes / check_sandbox_id(sid) / "state.json").unlink(missing_ok=True)
