"""The reaper's deadlines (sandbox/host/deadlines.py): which sandboxes are due, and when.

The states are real SandboxState records with real options; what the edge does with the due ones
is tested through the E2B SDK (tests/test_e2b_sandbox.py, an edge whose full round is 10 minutes
away still ends a timeout at its deadline)."""

from __future__ import annotations

import time

from sandbox.core.model import SandboxOptions, SandboxState
from sandbox.host.deadlines import Deadlines, deadline_of
from sandbox.host.sandbox import ACTIVE_GRAIN


def state(sid: str, *, status: str = "running", age: float = 0.0, ttl: float | None = None,
          idle: float | None = None, idle_for: float = 0.0) -> SandboxState:
    now = time.time()
    return SandboxState(id=sid, status=status, ref="img/python", image_digest="blake3:" + "0" * 64,  # type: ignore[arg-type]
                        kind="image", options=SandboxOptions(ttl=ttl, idle_timeout=idle), layer_digests=(),
                        created=now - age, last_active=now - idle_for, cgroups_path="")


def test_the_deadline_is_the_sooner_of_the_ttl_and_the_idle_timeout() -> None:
    st = state("lb-000000000001", age=10, ttl=30, idle=5, idle_for=2)
    assert deadline_of(st) == st.last_active + 5 + ACTIVE_GRAIN
    st = state("lb-000000000002", age=10, ttl=12, idle=60)
    assert deadline_of(st) == st.created + 12
    st = state("lb-000000000003", status="paused", ttl=5, idle=1, idle_for=100)
    assert deadline_of(st) == st.created + 5  # a paused sandbox is not idle
    assert deadline_of(state("lb-000000000004")) is None  # nothing to wait for
    assert deadline_of(state("lb-000000000005", status="creating", ttl=1)) is None  # noted again once running


def test_due_sandboxes_come_out_once_in_deadline_order_and_far_ones_wait_for_a_scan() -> None:
    woken: list[float] = []
    d = Deadlines(horizon=10)
    d.on_sooner = lambda: woken.append(time.monotonic())
    d.note(state("lb-00000000000a", ttl=5))        # in 5 s
    d.note(state("lb-00000000000b", ttl=2))        # in 2 s: sooner, wakes the reaper again
    d.note(state("lb-00000000000c", ttl=3))        # later than the soonest: no wake
    d.note(state("lb-00000000000d", ttl=3600))     # past the horizon: the next full scan's business
    d.note(state("lb-00000000000b", ttl=2.5))      # later than b's pending check: that check notes it again
    assert len(woken) == 2
    assert len(d) == 3
    soonest = d.soonest()
    assert soonest is not None
    assert time.time() + 1.5 < soonest <= time.time() + 2
    now = time.time()
    assert d.due(now) == []
    assert d.due(now + 3) == ["lb-00000000000b", "lb-00000000000c"]  # once each, soonest first
    assert d.due(now + 3) == []
    assert d.due(now + 6) == ["lb-00000000000a"]
    assert d.soonest() is None


def test_a_sooner_deadline_replaces_the_pending_one_and_a_recheck_waits() -> None:
    d = Deadlines(horizon=10)
    d.note(state("lb-00000000000e", ttl=5))
    d.note(state("lb-00000000000e", ttl=1))  # set_timeout shortened it: the earlier one counts
    now = time.time()
    assert d.due(now + 2) == ["lb-00000000000e"]
    assert d.due(now + 6) == []  # the stale later entry is not a second check
    # a sandbox checked and left (a command running past its idle timeout): not due again at once
    busy = state("lb-00000000000f", idle=1, idle_for=30)
    d.note(busy, if_past=now + 1)
    d.note(state("lb-000000000010", ttl=3), if_past=now + 1)  # not past: its own deadline stands
    assert d.due(now) == []
    assert d.due(now + 1) == ["lb-00000000000f"]
    assert d.due(now + 4) == ["lb-000000000010"]
