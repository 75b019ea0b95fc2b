"""Host-state tables (layerstore/hoststate.py).

The helper: the version is checked on every read, nothing is written unless the body
changed and the block ended normally, writers in several processes lose no update, and a
temp file left by a crash is never read.
"""

from __future__ import annotations

import fcntl
import json
import multiprocessing
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from layerstore.errors import LayerboxError
from layerstore.hoststate import HostStateError, HostTable


def counter_table(path: Path) -> HostTable:
    return HostTable(path, "layerbox.test", 1, empty=lambda: {"count": 0})


def written_table(path: Path, count: int) -> HostTable:
    """A counter table whose file holds ``count``."""
    table = counter_table(path)
    with table.locked() as body:
        body["count"] = count
    return table


def envelope(path: Path) -> dict[str, Any]:
    """The table's document, checked to open with the format and the version, in that order."""
    doc = json.loads(path.read_bytes())
    assert list(doc)[:2] == ["format", "version"]
    return dict(doc)


def unchanged_stamp(path: Path) -> tuple[int, int, bytes]:
    """Inode, mtime and bytes, the mtime first set far in the past so that a rewrite shows."""
    os.utime(path, ns=(10**18, 10**18))
    st = path.stat()
    return st.st_ino, st.st_mtime_ns, path.read_bytes()


def stamp(path: Path) -> tuple[int, int, bytes]:
    st = path.stat()
    return st.st_ino, st.st_mtime_ns, path.read_bytes()


# -- the helper ------------------------------------------------------------------------------------

def test_a_missing_table_reads_empty_and_is_written_once_changed(tmp_path: Path) -> None:
    path = tmp_path / "state" / "t.json"
    table = counter_table(path)
    assert table.read() == {"count": 0}
    with table.locked() as body:
        assert body == {"count": 0}
    assert not path.exists()  # nothing changed: nothing written
    with table.locked() as body:
        body["count"] = 1
    assert path.read_bytes() == b'{"format":"layerbox.test","version":1,"count":1}'
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == ["t.json", "t.json.lock"]


def test_an_unchanged_table_is_not_rewritten(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    table = written_table(path, 7)
    before = unchanged_stamp(path)
    for _ in range(3):
        with table.locked() as body:
            body["count"] = 7  # set to what it was
        assert table.read() == {"count": 7}
    assert stamp(path) == before
    with table.locked() as body:
        body["count"] = 8
    assert stamp(path)[0] != before[0]  # a changed body is a new file renamed over the table


@pytest.mark.parametrize(("doc", "found"), [
    ({"format": "layerbox.test", "version": 2, "count": 1}, "found layerbox.test version 2"),
    ({"format": "layerbox.test", "version": "1", "count": 1}, "found layerbox.test version '1'"),
    ({"format": "layerbox.test", "count": 1}, "found layerbox.test version None"),
    ({"format": "layerbox.leases", "version": 1, "leases": {}}, "found a 'layerbox.leases' table"),
    ({"count": 1}, "found a document without a format field"),
    ([1, 2], "found a JSON list, not an object"),
])
def test_a_table_of_another_version_or_format_is_refused(tmp_path: Path, doc: Any, found: str) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    before = stamp(path)
    table = counter_table(path)
    for attempt in (table.read, lambda: table.locked().__enter__()):
        with pytest.raises(HostStateError) as exc:
            attempt()
        message = str(exc.value)
        assert str(path) in message
        assert found in message
        assert "this layerbox reads layerbox.test version 1:" in message
        assert "move the file aside" in message
    assert stamp(path) == before
    assert isinstance(exc.value, LayerboxError)


def test_an_unreadable_table_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_bytes(b'{"format": "layerbox.test", "vers')  # what a torn write without fsync can leave
    with pytest.raises(HostStateError, match=r"t\.json: found no JSON \(.*move the file aside"):
        counter_table(path).read()
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(HostStateError, match="found no JSON"):
        counter_table(path).read()
    path.unlink()
    path.mkdir()
    with pytest.raises(HostStateError, match="found a file it cannot read"):
        counter_table(path).read()


def test_older_versions_are_upgraded_and_rewritten_on_the_next_change(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    seen: list[int | None] = []

    def upgrade(doc: dict[str, Any], version: int | None) -> dict[str, Any]:
        seen.append(version)
        return {"total": doc["count"]}

    path.write_bytes(b'{"format":"layerbox.test","version":1,"count":5}')
    table = HostTable(path, "layerbox.test", 2, reads=(1,), upgrade=upgrade)
    assert table.read() == {"total": 5}
    with table.locked() as body:
        assert body == {"total": 5}
    assert json.loads(path.read_bytes())["version"] == 1  # read, not changed: not rewritten
    with table.locked() as body:
        body["total"] += 1
    assert envelope(path) == {"format": "layerbox.test", "version": 2, "total": 6}
    assert seen == [1, 1, 1]
    path.write_bytes(b'{"count":5}')  # legacy: no envelope at all
    assert table.read() == {"total": 5}
    assert seen[-1] is None
    path.write_bytes(b'{"cuont":5}')
    with pytest.raises(HostStateError, match="found a legacy document it cannot upgrade .*KeyError"):
        table.read()
    with pytest.raises(ValueError, match="takes an upgrade"):
        HostTable(path, "layerbox.test", 2, reads=(1,))


def test_an_exception_in_the_block_writes_nothing_and_releases_the_lock(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    table = written_table(path, 1)
    before = stamp(path)

    def change_then_fail() -> None:
        with table.locked() as body:
            body["count"] = 2
            body["half"] = True
            raise RuntimeError("half way")

    with pytest.raises(RuntimeError, match="half way"):
        change_then_fail()
    assert stamp(path) == before
    assert not path.with_name("t.json.tmp").exists()
    with open(table.lock, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError if still held


def test_a_body_cannot_overwrite_the_envelope(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    table = counter_table(path)
    with pytest.raises(ValueError, match="envelope"), table.locked() as body:
        body["version"] = 9
    assert not path.exists()


def test_a_stale_temp_file_is_ignored_and_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    table = written_table(path, 1)
    tmp = path.with_name("t.json.tmp")
    tmp.write_bytes(b'{"format":"layerbox.test","version":1,"count":999}' + b" " * 100_000)  # a crash's
    assert table.read() == {"count": 1}
    with table.locked() as body:
        assert body["count"] == 1
        body["count"] = 2
    assert not tmp.exists()
    assert path.read_bytes() == b'{"format":"layerbox.test","version":1,"count":2}'


def _increment(path: str, times: int) -> None:
    table = counter_table(Path(path))
    for _ in range(times):
        with table.locked() as body:
            body["count"] += 1
            body["last"] = os.getpid()


def test_writers_in_several_processes_lose_no_update(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    processes, times = 4, 150
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no lock or fd inherited
    workers = [context.Process(target=_increment, args=(str(path), times)) for _ in range(processes)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert [w.exitcode for w in workers] == [0] * processes
    body = counter_table(path).read()
    assert body["count"] == processes * times
    assert body["last"] in {w.pid for w in workers}
