"""A pre-content handler process for tests: adopts the group and blob fd from the holder.

``python -m support.fanotify_handler SOCKET REAL_BLOB [--sweep] [--stall-after N]``
fills the held blob fd (name ``blob``) from ``REAL_BLOB`` for every event of
the held group (name ``group``) and answers FAN_ALLOW.  It prints ``ready``
once it serves (after ``swept N`` with ``--sweep``); with ``--stall-after N``
it reads the batch after its first N answered events, prints ``stalled`` and
never answers it (so that SIGKILL leaves orphaned events).
"""

from __future__ import annotations

import os
import sys
import time

from lazyfetch.fanotify import Group
from lazyfetch.holder import Holder


def main(argv: list[str]) -> int:
    socket_path, real_path = argv[0], argv[1]
    stall_after = int(argv[argv.index("--stall-after") + 1]) if "--stall-after" in argv else -1
    holder = Holder.connect(socket_path)
    assert holder is not None, f"no holder on {socket_path}"
    held = holder.get_all()
    group = Group.adopt(held["group"][0])
    blob_fd = held["blob"][0]
    real_fd = os.open(real_path, os.O_RDONLY)
    if "--sweep" in argv:
        print("swept", group.sweep(), flush=True)
    print("ready", flush=True)
    answered = 0
    while True:
        if 0 <= stall_after <= answered:
            time.sleep(0.5)  # let every reader queue an event: the stalled batch holds several
        events = group.events()
        if 0 <= stall_after <= answered:
            print("stalled", len(events), flush=True)
            while True:
                time.sleep(3600)
        for event in events:
            data = os.pread(real_fd, event.count, event.offset)
            os.pwrite(blob_fd, data, event.offset)
            group.respond(event.fd, True)
            os.close(event.fd)
            answered += 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
