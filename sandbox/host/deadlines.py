"""When the reaper is next needed: the sandboxes whose TTL or idle timeout falls soon.

The edge's reaper scans every sandbox each ``--reap-interval`` (5 s): a TTL could end up to that
much late, and a client that sets a sandbox's timeout to 5 s (E2B's ``set_timeout``) saw it
alive at 6.  Every state written (:class:`sandbox.core.states.States`) and every sandbox a scan
reads is noted here with its next deadline when that falls within :attr:`Deadlines.horizon`;
the reaper sleeps until the soonest and then looks at the sandboxes due only, not at all of
them (at 3,200 sandboxes a scan reads 3,200 state files).  Entries go stale when a TTL moves
later or a sandbox goes: the reaper reads a due sandbox's state again before it acts, so a
stale entry costs one read.  In memory only: after a restart the first scan notes them again.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable

from sandbox.core.model import SandboxState
from sandbox.host.sandbox import ACTIVE_GRAIN


def deadline_of(st: SandboxState) -> float | None:
    """When the reaper must next look at ``st`` (wall clock), or None."""
    if not st.live:
        return None
    out = None
    if st.options.ttl is not None:
        out = st.created + st.options.ttl
    if st.options.idle_timeout is not None and st.status == "running":
        idle = st.last_active + st.options.idle_timeout + ACTIVE_GRAIN
        out = idle if out is None else min(out, idle)
    return out


class Deadlines:
    """At most one pending deadline per sandbox, its earliest: a later one noted meanwhile (a busy
    sandbox's idle deadline moves with every command) waits until the pending one is checked,
    and the reaper notes the sandbox again after that check (:meth:`SandboxManager.reap`), so a
    busy sandbox costs one check per idle timeout, not one per state written."""

    def __init__(self, horizon: float = 10.0) -> None:
        self.horizon = horizon  # deadlines further away are left to the next full scan
        self.on_sooner: Callable[[], None] | None = None  # called (any thread) when the soonest moves earlier
        self._heap: list[tuple[float, str]] = []
        self._pending: dict[str, float] = {}  # sandbox -> its entry in the heap that counts
        self._lock = threading.Lock()

    def note(self, st: SandboxState, *, if_past: float | None = None) -> None:
        """``st``'s deadline, if it falls within the horizon; ``if_past``: when to look again if
        that deadline has passed already (a sandbox the reaper checked and left as it was, say
        with a command still running past its idle timeout, is not checked again at once)."""
        at = deadline_of(st)
        now = time.time()
        if at is None or at > now + self.horizon:
            return
        if if_past is not None and at <= now:
            at = if_past
        with self._lock:
            pending = self._pending.get(st.id)
            if pending is not None and pending <= at:
                return
            self._pending[st.id] = at  # (a later entry left in the heap is skipped when it comes up)
            sooner = not self._heap or at < self._heap[0][0]
            heapq.heappush(self._heap, (at, st.id))
        if sooner and self.on_sooner is not None:
            self.on_sooner()

    def soonest(self) -> float | None:
        with self._lock:
            return self._heap[0][0] if self._heap else None

    def due(self, now: float) -> list[str]:
        """The sandboxes due by ``now`` (each once), taken off."""
        out: list[str] = []
        with self._lock:
            while self._heap and self._heap[0][0] <= now:
                at, sid = heapq.heappop(self._heap)
                if self._pending.get(sid) == at:
                    del self._pending[sid]
                    out.append(sid)
        return out

    def __len__(self) -> int:
        return len(self._pending)
