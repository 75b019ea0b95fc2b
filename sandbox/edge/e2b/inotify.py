"""inotify's event bits as envd's watchers report them: a container's watch (:mod:`.files`) reads
the host kernel's, a microVM's (:mod:`.guestwatch`) the guest kernel's through its agent."""

from __future__ import annotations

import asyncio
from collections import deque

from connectrpc.errors import ConnectError
from e2b.envd.filesystem import filesystem_pb as pb

IN_MODIFY, IN_ATTRIB, IN_MOVED_FROM, IN_MOVED_TO = 0x2, 0x4, 0x40, 0x80
IN_CREATE, IN_DELETE, IN_DELETE_SELF, IN_MOVE_SELF = 0x100, 0x200, 0x400, 0x800
IN_UNMOUNT, IN_Q_OVERFLOW, IN_IGNORED, IN_ONLYDIR, IN_ISDIR = 0x2000, 0x4000, 0x8000, 0x1000000, 0x40000000
# (the guest agent's watch uses the same mask: sandbox/backends/vm/guest/agent.c WATCH_MASK)
WATCH_MASK = (IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF
              | IN_MOVE_SELF | IN_ONLYDIR)
# inotify's bits -> envd's events, in fsnotify's order (one inotify event may be several)
KINDS = ((IN_CREATE | IN_MOVED_TO, pb.EventType.CREATE), (IN_MOVED_FROM | IN_MOVE_SELF, pb.EventType.RENAME),
         (IN_ATTRIB, pb.EventType.CHMOD), (IN_MODIFY, pb.EventType.WRITE),
         (IN_DELETE | IN_DELETE_SELF, pb.EventType.REMOVE))
MAX_WATCH_DIRS = 1024  # directories one recursive watcher follows (the guest agent's MAX_WATCH_DIRS too)
MAX_EVENTS = 4096  # events a watcher keeps unread


def kinds(mask: int) -> list[pb.EventType]:
    """envd's events for one inotify event's ``mask``."""
    return [kind for bits, kind in KINDS if mask & bits]


def take_events(events: deque[tuple[str, pb.EventType]], wake: asyncio.Event,
                failed: ConnectError | None) -> list[tuple[str, pb.EventType]]:
    """A watch's events so far (its queue emptied); once none are left, the error that ended it."""
    taken = list(events)
    events.clear()
    wake.clear()
    if not taken and failed is not None:
        raise failed
    return taken
