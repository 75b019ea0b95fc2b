"""The in-flight journal: fanotify events a daemon has read, in memory that outlives it.

A pre-content event the daemon has read waits on the group's access list
until a response names its fd number; the kernel keeps no other record a
successor could ask for (fs/notify/fanotify/fanotify_user.c: the event is put
on the list only after its metadata and range were copied to the reader's
buffer, and ``process_access_response`` matches the response's fd against
``event->fd``).  So the daemon reads events straight into a slot of a memfd
that the holder also keeps: whatever the kernel put on the access list is in
the journal at that moment, with no window a SIGKILL could fall into.  After
answering an event the daemon overwrites its fd in the journal with -1, before
closing the fd (so no later event of the daemon can get that number while the
record still names it).  A successor takes the memfd back from the holder,
fills the range of every record still naming an fd and answers it ALLOW (or
EIO), then resets the journal.

Layout (docs/FORMAT.md, "In-flight journal"), little-endian, version 1::

    header (64 B at 0):   magic b"LBINFLT1", u32 slots, u32 slot_bytes, u32 buffer_bytes, u32 tags
    slot k at 4096 + k * slot_bytes:
      u32 state (0 free, 1 holds a read), u32 length (bytes the read returned; 0: not known yet)
      u64 pad, then u64 tag[tags]: the blob's inode number per event, in read order (0: not known)
      then the read buffer: the events exactly as read() returned them (fanotify_event_metadata
      + info records), fd at byte 16 of each event (-1 once answered)

A tag is written right after the read (the successor fills that blob's range);
an event killed before its tag is filled on every blob the range fits.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from lazyfetch.errors import JournalError
from lazyfetch.fanotify import Event, parse_events

MAGIC: Final = b"LBINFLT1"
NAME: Final = "layerbox-inflight"  # the memfd's name (/proc/PID/fd shows "/memfd:layerbox-inflight")
HEADER: Final = struct.Struct("<8sIIII")
SLOT_HEAD: Final = struct.Struct("<IIQ")
TAG: Final = struct.Struct("<Q")
FD: Final = struct.Struct("<i")
EVENT_LEN: Final = struct.Struct("<I")
SLOTS_AT: Final = 4096
SLOTS: Final = 512
BUFFER: Final = 8192  # one read: up to 170 range events
TAGS: Final = BUFFER // 24  # an event is at least its 24-byte metadata
_TAGS_AT: Final = SLOT_HEAD.size
_BUFFER_AT: Final = _TAGS_AT + TAGS * TAG.size
SLOT_BYTES: Final = -(-(_BUFFER_AT + BUFFER) // 4096) * 4096
FREE, HELD = 0, 1


@dataclass(frozen=True, slots=True)
class Pending:
    """An event a dead daemon read and did not answer: its fd number still names it."""

    at: int  # byte offset of the event in the journal
    fd: int
    offset: int
    count: int
    ino: int  # the blob's inode number, 0 when the daemon died before tagging it


class Journal:
    """One daemon's view of the journal; thread-safe (the reader takes slots, workers answer)."""

    def __init__(self, fd: int, mm: mmap.mmap) -> None:
        self.fd = fd
        self._mm = mm
        self._view = memoryview(mm)
        self._cond = threading.Condition()
        self._free = list(range(SLOTS - 1, -1, -1))  # a stack: the lowest slot is reused first
        self._left = [0] * SLOTS  # events of the slot still unanswered
        self._dirty = [(BUFFER, TAGS)] * SLOTS  # buffer bytes and tags its last read wrote (all: not known)

    @classmethod
    def create(cls) -> Journal:
        fd = os.memfd_create(NAME, os.MFD_CLOEXEC)
        try:
            return cls._init(fd)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def _init(cls, fd: int) -> Journal:
        os.ftruncate(fd, 0)  # (an adopted one of another layout: its pages go)
        os.ftruncate(fd, SLOTS_AT + SLOTS * SLOT_BYTES)
        mm = mmap.mmap(fd, SLOTS_AT + SLOTS * SLOT_BYTES)
        HEADER.pack_into(mm, 0, MAGIC, SLOTS, SLOT_BYTES, BUFFER, TAGS)
        return cls(fd, mm)

    @classmethod
    def adopt(cls, fd: int) -> tuple[Journal, list[Pending]]:
        """Map a journal got back from the holder; the events it still holds.

        A journal of another layout (or none: size 0) cannot be read: it is
        made afresh and the caller's sweep answers what it held (with EIO).
        """
        size = os.fstat(fd).st_size
        if size < SLOTS_AT + SLOTS * SLOT_BYTES:
            return cls._init(fd), []
        mm = mmap.mmap(fd, size)
        if HEADER.unpack_from(mm, 0) != (MAGIC, SLOTS, SLOT_BYTES, BUFFER, TAGS):
            mm.close()
            return cls._init(fd), []
        journal = cls(fd, mm)
        return journal, journal._pending()

    def _pending(self) -> list[Pending]:
        out = []
        for slot in range(SLOTS):
            base = SLOTS_AT + slot * SLOT_BYTES
            state, length, _ = SLOT_HEAD.unpack_from(self._mm, base)
            if state != HELD:
                continue
            start = base + _BUFFER_AT
            length = length or _extent(self._view[start : start + BUFFER])  # died before noting it
            for i, event in enumerate(_events(self._view[start : start + length], start)):
                if event.fd >= 0:
                    ino = TAG.unpack_from(self._mm, base + _TAGS_AT + i * TAG.size)[0] if i < TAGS else 0
                    out.append(Pending(event.at, event.fd, event.offset, event.count, ino))
        return out

    def reset(self) -> None:
        """Every slot free: call once the adopted events are answered, before reading any."""
        with self._cond:
            for slot in range(SLOTS):
                SLOT_HEAD.pack_into(self._mm, SLOTS_AT + slot * SLOT_BYTES, FREE, 0, 0)
            self._free = list(range(SLOTS - 1, -1, -1))
            self._left = [0] * SLOTS
            self._cond.notify_all()

    def forget(self, at: int) -> None:
        """The event at ``at`` is answered: its record no longer names an fd."""
        FD.pack_into(self._mm, at + 16, -1)

    def answered(self, at: int) -> None:
        """After the response to the event at ``at`` (one this daemon read) and before its fd is closed."""
        self.forget(at)
        slot = (at - SLOTS_AT) // SLOT_BYTES
        with self._cond:
            self._left[slot] -= 1
            if self._left[slot] == 0:
                self._release(slot)

    def _release(self, slot: int) -> None:
        SLOT_HEAD.pack_into(self._mm, SLOTS_AT + slot * SLOT_BYTES, FREE, 0, 0)
        self._free.append(slot)
        self._cond.notify()

    def read(self, reader: Callable[[memoryview], int], stopping: threading.Event,
             tag: Callable[[int], int]) -> list[Event]:
        """Read one batch of events into a free slot; [] when there were none.

        ``reader(buffer)`` is the group's read (returns bytes read, 0 for none);
        ``tag(event_fd)`` the blob inode number to record for an event.  Waits
        for a free slot while every slot holds unanswered events.
        """
        with self._cond:
            while not self._free:
                if stopping.is_set():
                    return []
                self._cond.wait(0.2)
            slot = self._free.pop()
        base = SLOTS_AT + slot * SLOT_BYTES
        start = base + _BUFFER_AT
        # zeros after what the next read writes: a successor finds where it ends even without
        # its length, and no tag of an older read is taken for one of its events
        used, tagged = self._dirty[slot]
        self._mm[start : start + used] = bytes(used)
        self._mm[base + _TAGS_AT : base + _TAGS_AT + tagged * TAG.size] = bytes(tagged * TAG.size)
        SLOT_HEAD.pack_into(self._mm, base, HELD, 0, 0)  # from here on, whatever read() takes is journalled
        try:
            n = reader(self._view[start : start + BUFFER])
        except BaseException:
            with self._cond:
                self._release(slot)
            raise
        events = _events(self._view[start : start + n], start) if n else []
        self._dirty[slot] = (n, min(len(events), TAGS))
        SLOT_HEAD.pack_into(self._mm, base, HELD, n, 0)
        count = 0
        for i, event in enumerate(events):
            if event.fd >= 0:
                count += 1
                if i < TAGS:
                    TAG.pack_into(self._mm, base + _TAGS_AT + i * TAG.size, tag(event.fd))
        with self._cond:
            self._left[slot] = count
            if count == 0:
                self._release(slot)
        return events

    def close(self) -> None:
        self._view.release()
        self._mm.close()
        os.close(self.fd)


def _extent(buf: memoryview) -> int:
    """Bytes of whole events at the start of a zeroed buffer a read may have filled."""
    pos = 0
    while pos + EVENT_LEN.size <= len(buf):
        (length,) = EVENT_LEN.unpack_from(buf, pos)
        if length < 24 or pos + length > len(buf):
            break
        pos += length
    return pos


def _events(buf: memoryview, base: int) -> list[Event]:
    try:
        return parse_events(buf, base)
    except OSError as exc:
        raise JournalError(f"in-flight journal: the read buffer at byte {base} does not parse: {exc}") from None
