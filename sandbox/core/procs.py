"""Processes on the host: the one way this package starts one, and what /proc says of one.

Every command layerbox runs goes through :func:`spawn`: an argv list (never a shell), a new
session so that a timeout can kill its whole process group (:func:`kill_group`), stderr
captured.  :func:`proc_stat` tells a reused pid apart by its start time.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from sandbox.core.errors import HostUnsupported


def spawn(argv: Sequence[str], *, stdin: int | IO[Any] | None = subprocess.DEVNULL,
          stdout: int | IO[Any] | None = subprocess.PIPE,
          stderr: int | IO[Any] | None = subprocess.PIPE, sched_idle: bool = False) -> subprocess.Popen[bytes]:
    """Start ``argv`` (never through a shell) in its own session / process group.

    ``sched_idle`` puts the child under SCHED_IDLE before it execs (``chrt``: a
    ``preexec_fn`` would make ``subprocess`` fork the whole manager, ~10 ms, instead of
    vfork'ing it); the policy is inherited across fork and exec, so everything crun starts
    for it (the container process and its children) runs only when a CPU is idle.
    """
    try:
        return subprocess.Popen(["chrt", "--idle", "0", *argv] if sched_idle else list(argv), stdin=stdin,
                                stdout=stdout, stderr=stderr, start_new_session=True, close_fds=True)
    except FileNotFoundError as exc:
        raise HostUnsupported(f"{exc.filename or argv[0]}: not installed (apt-get install crun util-linux)") from exc


def wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> int:
    """``proc.wait(timeout)`` woken by the exit itself: Popen.wait with a timeout polls with
    sleeps of up to 50 ms, which added several ms to every crun command (measured)."""
    try:
        fd = os.pidfd_open(proc.pid)
    except OSError:  # already reaped, or no pidfd (Linux < 5.3)
        return proc.wait(timeout=timeout)
    try:
        if not _exits_within(fd, timeout):
            raise subprocess.TimeoutExpired(proc.args, timeout)
    finally:
        os.close(fd)
    return proc.wait()


def _exits_within(pidfd: int, timeout: float) -> bool:
    """Whether the process of ``pidfd`` exits within ``timeout`` seconds (woken by the exit)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(timeout * 1000))


def kill_exited(pid: int, start: int | None, timeout: float) -> bool:
    """SIGKILL ``pid`` (when its start time is still ``start``) and wait, at most ``timeout``
    seconds, for it to exit; True once it has (or was gone already), False when it did not
    exit in time or its start time is unknown (then it is not killed: the pid may be another's).

    For the init of a PID namespace, its exit means every other process of the namespace
    has died before it: the kernel kills and reaps them as the init exits.
    """
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        stat = proc_stat(pid)
        if stat is None:
            return True
        if start is None:
            return False
        if stat[1] != start:  # a reused pid: not ours to kill
            return True
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        return _exits_within(fd, timeout)
    finally:
        os.close(fd)


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process group ``spawn`` gave ``proc`` and reap ``proc``."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def proc_stat(pid: int) -> tuple[int, int] | None:
    """(ppid, starttime ticks) of ``pid``, or None when it is gone.  A zombie is gone: it has
    exited and only waits for its parent to reap it (a VMM that died under its manager)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[19])


def process_table() -> dict[int, tuple[int, int]]:
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = proc_stat(int(name))
            if st is not None:
                table[int(name)] = st
    return table


def descendants(roots: set[int], table: Mapping[int, tuple[int, int]]) -> set[int]:
    found = set(r for r in roots if r in table)
    grew = True
    while grew:
        more = {pid for pid, (ppid, _) in table.items() if ppid in found and pid not in found}
        found |= more
        grew = bool(more)
    return found


