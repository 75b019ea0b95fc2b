"""A pre-content handler process for tests: adopts the group and blob fd from the holder.

``python -m support.fanotify_handler SOCKET REAL_BLOB [--sweep] [--journal] [--stall-after N]``
fills the held blob fd (name ``blob``) from ``REAL_BLOB`` for every event of
the held group (name ``group``) and answers FAN_ALLOW.  It prints ``ready``
once it serves (after ``swept N`` with ``--sweep``); with ``--stall-after N``
it reads the batch after its first N answered events, prints ``stalled`` and
never answers it (so that SIGKILL leaves orphaned events).  With
``--journal`` it reads events through the in-flight journal
(lazyfetch/inflight.py) the holder keeps as ``inflight``, as the daemon does:
it first answers, with their bytes, the events a dead handler's journal
names, and prints ``replayed N``.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

from lazyfetch.fanotify import Event, Group
from lazyfetch.holder import Holder
from lazyfetch.inflight import Journal


def _journal(holder: Holder, held: dict, group: Group, fill: Callable[[int, int], None]) -> Journal:
    if "inflight" not in held:
        journal = Journal.create()
        holder.put("inflight", journal.fd)
        return journal
    journal, pending = Journal.adopt(held["inflight"][0])
    for p in pending:
        fill(p.offset, p.count)
        group.respond(p.fd, True)
        journal.forget(p.at)
    journal.reset()
    print("replayed", len(pending), flush=True)
    return journal


def main(argv: list[str]) -> int:
    socket_path, real_path = argv[0], argv[1]
    stall_after = int(argv[argv.index("--stall-after") + 1]) if "--stall-after" in argv else -1
    holder = Holder.connect(socket_path)
    assert holder is not None, f"no holder on {socket_path}"
    held = holder.get_all()
    group = Group.adopt(held["group"][0])
    blob_fd = held["blob"][0]
    real_fd = os.open(real_path, os.O_RDONLY)

    def fill(offset: int, count: int) -> None:
        os.pwrite(blob_fd, os.pread(real_fd, count, offset), offset)

    journal = _journal(holder, held, group, fill) if "--journal" in argv else None
    if "--sweep" in argv:
        print("swept", group.sweep(), flush=True)
    print("ready", flush=True)
    answered = 0
    never = threading.Event()
    while True:
        if 0 <= stall_after <= answered:
            time.sleep(0.5)  # let every reader queue an event: the stalled batch holds several
        events: list[Event] = (group.events() if journal is None
                               else journal.read(lambda buf: group.read_into(buf, None), never, lambda fd: 1))
        if 0 <= stall_after <= answered:
            print("stalled", len(events), flush=True)
            while True:
                time.sleep(3600)
        for event in events:
            fill(event.offset, event.count)
            group.respond(event.fd, True)
            if journal is not None:
                journal.answered(event.at)
            os.close(event.fd)
            answered += 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
