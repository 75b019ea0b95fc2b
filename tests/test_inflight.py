"""The in-flight journal's format (lazyfetch/inflight.py), without the kernel.

A reader function stands in for the group's read(): it writes fanotify events
into the slot it is given, as the kernel does.  What a successor finds after
each point a daemon may die at is checked by adopting a dup of the memfd;
tests/test_fanotify.py and tests/test_lazyfetch_crash.py do the same with the
real kernel and SIGKILL.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import pytest

from lazyfetch.fanotify import EVENT_METADATA, FAN_PRE_ACCESS, RANGE_INFO
from lazyfetch.inflight import HEADER, SLOTS, Journal, Pending

NEVER = threading.Event()


def _event(fd: int, offset: int, count: int) -> bytes:
    return (EVENT_METADATA.pack(48, 3, 0, 24, FAN_PRE_ACCESS, fd, 4242)
            + RANGE_INFO.pack(6, 0, RANGE_INFO.size, 0, offset, count))


def _reader(*events: bytes) -> Callable[[memoryview], int]:
    def read(buf: memoryview) -> int:
        data = b"".join(events)
        buf[: len(data)] = data
        return len(data)
    return read


def _successor(journal: Journal) -> tuple[Journal, list[Pending]]:
    return Journal.adopt(os.dup(journal.fd))


def test_a_successor_finds_exactly_the_unanswered_events_with_their_blob() -> None:
    journal = Journal.create()
    try:
        first = journal.read(_reader(_event(7, 0, 4096), _event(9, 65536, 8192)), NEVER, lambda fd: 1000 + fd)
        second = journal.read(_reader(_event(11, 4096, 4096)), NEVER, lambda fd: 1000 + fd)
        journal.answered(first[0].at)
        journal.answered(second[0].at)  # its slot is free again
        successor, pending = _successor(journal)
        assert [(p.fd, p.offset, p.count, p.ino) for p in pending] == [(9, 65536, 8192, 1009)]
        assert pending[0].at == first[1].at
        successor.forget(pending[0].at)
        successor.reset()
        assert Journal.adopt(os.dup(journal.fd))[1] == []
        successor.close()
    finally:
        journal.close()


def test_killed_between_the_read_and_its_tags_the_events_are_still_there_untagged() -> None:
    journal = Journal.create()

    def killed(fd: int) -> int:
        raise KeyboardInterrupt  # stands for the SIGKILL: nothing after the read runs

    try:
        with pytest.raises(KeyboardInterrupt):
            journal.read(_reader(_event(5, 0, 4096), _event(6, 8192, 4096)), NEVER, killed)
        _, pending = _successor(journal)
        assert [(p.fd, p.ino) for p in pending] == [(5, 0), (6, 0)]  # filled on every blob it fits
    finally:
        journal.close()


def test_a_read_of_nothing_and_a_slot_freed_leave_nothing_pending() -> None:
    journal = Journal.create()
    try:
        assert journal.read(lambda buf: 0, NEVER, lambda fd: 1) == []
        for _ in range(SLOTS + 5):  # more reads than slots: each one's slot comes back when answered
            (event,) = journal.read(_reader(_event(3, 0, 4096)), NEVER, lambda fd: 1)
            journal.answered(event.at)
        assert _successor(journal)[1] == []
    finally:
        journal.close()


def test_a_journal_of_another_layout_is_made_anew() -> None:
    fd = os.memfd_create("layerbox-inflight-test", os.MFD_CLOEXEC)
    journal, pending = Journal.adopt(fd)  # empty: what an older daemon's holder would not have
    try:
        assert pending == []
        assert HEADER.unpack_from(os.pread(fd, HEADER.size, 0))[0] == b"LBINFLT1"
    finally:
        journal.close()
