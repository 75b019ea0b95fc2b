"""Host-state tables (layerstore/hoststate.py) and the tables kept in them.

The helper: the version is checked on every read, nothing is written unless the body
changed and the block ended normally, writers in several processes lose no update, and a
temp file left by a crash is never read.  The tables: each still reads the bytes an earlier
layerbox left on a host (written here by hand, as that code wrote them) and rewrites them in
the envelope on its next change.
"""

from __future__ import annotations

import fcntl
import json
import multiprocessing
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from layerstore.errors import LayerboxError
from layerstore.hoststate import HostRecords, HostStateError, HostTable, boot_time
from lazyfetch.mounts import HostMounts
from sandbox.core.leases import Leases
from sandbox.core.paths import read_beneath, replace_beneath
from sandbox.isolation.idmap import RANGE_SIZE, RangePool
from sandbox.isolation.network import NetworkManager

SID1, SID2 = "lb-000000000001", "lb-000000000002"


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


@pytest.mark.parametrize("torn", [b"", b'{"format": "layerbox.test", "vers', b"\0\0\0\0"])
def test_a_table_of_what_a_reboot_ends_torn_before_this_boot_reads_as_empty(tmp_path: Path, torn: bytes) -> None:
    # written without fsync: a power loss may leave it empty or torn, and what it described
    # (mounts) ended with that boot; torn since this boot it is refused as any table is
    path = tmp_path / "t.json"
    table = HostTable(path, "layerbox.test", 1, empty=lambda: {"count": 0}, durable=False)
    path.write_bytes(torn)
    with pytest.raises(HostStateError, match="move the file aside"):
        table.read()
    booted = boot_time()
    os.utime(path, (booted - 60, booted - 60))
    assert table.read() == {"count": 0}
    with table.locked() as body:
        body["count"] += 1
    assert table.read() == {"count": 1}
    assert envelope(path) == {"format": "layerbox.test", "version": 1, "count": 1}
    path.write_bytes(b'{"format": "layerbox.other", "version": 1}')  # whole, of another kind: never dropped
    os.utime(path, (booted - 60, booted - 60))
    with pytest.raises(HostStateError, match="layerbox.other"):
        table.read()
    durable = counter_table(tmp_path / "d.json")
    durable.path.write_bytes(torn)
    os.utime(durable.path, (booted - 60, booted - 60))
    with pytest.raises(HostStateError):
        durable.read()


def test_a_table_written_without_fsync_is_still_written_whole(tmp_path: Path) -> None:
    table = HostTable(tmp_path / "t.json", "layerbox.test", 1, empty=lambda: {"count": 0}, durable=False)
    for _ in range(3):
        with table.locked() as body:
            body["count"] += 1
    assert envelope(table.path) == {"format": "layerbox.test", "version": 1, "count": 3}
    assert HostMounts(tmp_path / "host").table.durable is False


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
    assert not table.spare.exists()
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
    tmp = table.spare
    assert tmp == path.with_name("t.json.lock.spare")  # (one per lock, beside it)
    tmp.write_bytes(b'{"format":"layerbox.test","version":1,"count":999}' + b" " * 100_000)  # a crash's
    assert table.read() == {"count": 1}
    with table.locked() as body:
        assert body["count"] == 1
        body["count"] = 2
    assert path.read_bytes() == b'{"format":"layerbox.test","version":1,"count":2}'
    # the names were exchanged: the crash's temp file now holds the version before, whole
    assert tmp.read_bytes() == b'{"format":"layerbox.test","version":1,"count":1}'


def test_rewrites_reuse_two_inodes(tmp_path: Path) -> None:
    """A rewrite exchanges the table with its temp file instead of renaming over it: no inode is
    freed or made per write (on ext4 without a journal each new inode skips every recently
    freed one), and a reader still sees one whole version."""
    path = tmp_path / "t.json"
    table = written_table(path, 1)
    inodes = set()
    for n in range(2, 12):
        with table.locked() as body:
            body["count"] = n
        inodes.add(path.stat().st_ino)
        assert table.read() == {"count": n}
    assert len(inodes) == 2
    names = {p.name for p in tmp_path.iterdir()}
    assert names == {"t.json", "t.json.lock", "t.json.lock.spare"}


def race(write: Callable[[int], None], read: Callable[[], int], seconds: float) -> list[int]:
    """``read()`` over and over for ``seconds`` while a thread calls ``write(n)`` for n = 2, 3, ...
    as fast as it can; the versions each read saw."""
    stop = threading.Event()

    def writer() -> None:
        n = 1
        while not stop.is_set():
            n += 1
            write(n)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        seen = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            seen.append(read())
    finally:
        stop.set()
        thread.join()
    assert seen == sorted(seen)
    assert len(set(seen)) > 10  # the writer did rewrite it while these reads ran
    return seen


def test_a_reader_never_sees_part_of_two_versions(tmp_path: Path) -> None:
    """swap_in reuses the inode of the version before for the next write: a reader that opened it
    just before an exchange must still get one whole version (read_settled), never a mix, an
    empty file or a prefix, while a writer rewrites the table as fast as it can."""
    table = written_table(tmp_path / "t.json", 1)

    def write(n: int) -> None:
        with table.locked() as body:
            body["count"] = n
            body["pad"] = "x" * (n % 7 * 3000)  # versions of different sizes: a mix shows

    def read() -> int:
        body = table.read()  # (a torn read raises HostStateError: no JSON)
        if body["count"] > 1:  # (the first version has no padding)
            assert body["pad"] == "x" * (body["count"] % 7 * 3000), body["count"]
        return int(body["count"])

    race(write, read, 3)


def test_a_state_file_read_beside_its_writer_is_always_one_version(tmp_path: Path) -> None:
    """The same for a sandbox's state.json (replace_beneath and read_beneath)."""
    (tmp_path / "box").mkdir()

    def write(n: int) -> None:
        replace_beneath(tmp_path, "box/state.json", json.dumps({"n": n, "pad": "y" * (n % 5 * 2000)}).encode())

    def read() -> int:
        doc = json.loads(read_beneath(tmp_path, "box/state.json"))
        assert doc["pad"] == "y" * (doc["n"] % 5 * 2000), doc["n"]
        return int(doc["n"])

    write(1)
    race(write, read, 2)


def test_records_share_one_spare_and_a_dropped_record_leaves_nothing_of_its_own(tmp_path: Path) -> None:
    records = HostRecords(tmp_path / "r", "layerbox.test", 1, durable=False)
    for n in range(3):
        records.put("one", {"n": n})
    assert records.get("one") == {"n": 2}
    assert records.all() == {"one": {"n": 2}}  # (the version before, at .spare, is no record)
    assert records.drop("one")
    assert [p.name for p in (tmp_path / "r").iterdir()] == [".spare"]  # (shared by every record)


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


# -- the four tables: what an earlier layerbox left on a host --------------------------------------

# lazyfetch/mounts.py wrote json.dumps(state, separators=(",", ":")); the oldest files had no
# "entries" or "holds" (and each mount carried its own entries)
HEX = "ab" * 32
LEGACY_MOUNTS = (
    b'{"layers":{"' + HEX.encode() + b'":{"mountpoint":"/nonexistent/layers/' + HEX.encode()
    + b'","generation":"g1","path":null,"users":["/nonexistent/mnt"],"meta":"/nonexistent/m.erofs",'
    b'"blob_io":"buffered"}},"mounts":{"/nonexistent/mnt":{"writable":false,"upper":null,"work":null,'
    b'"owned_upper":false,"digest":"sha256:' + HEX.encode() + b'","layers":["' + HEX.encode()
    + b'"],"kind":"image","entries":[{"digest":"sha256:' + HEX.encode() + b'"}]}}}'
)


def test_mounts_reads_the_unversioned_table_and_moves_its_mounts_to_records(tmp_path: Path) -> None:
    host = HostMounts(tmp_path / "data")
    state = tmp_path / "data" / "state"
    state.mkdir(parents=True)
    path = state / "mounts.json"
    path.write_bytes(LEGACY_MOUNTS)
    before = unchanged_stamp(path)
    assert host.has_stale_layers("g2")  # read without the lock: nothing is written
    assert not host.has_stale_layers("g1")
    assert stamp(path) == before
    assert host.holds() == {}  # the first locked operation moves each mount to a record of its own
    doc = envelope(path)
    assert (doc["format"], doc["version"], doc["holds"], doc["entries"]) == ("layerbox.mounts", 2, {}, {})
    assert "mounts" not in doc
    assert [(info["users"], info["mounts"]) for info in doc["layers"].values()] == [([], 1)]
    (record,) = (state / "mounts").iterdir()
    assert json.loads(record.read_bytes())["mountpoint"] == "/nonexistent/mnt"
    assert host.record("/nonexistent/mnt")["digest"] == f"sha256:{HEX}"
    assert not host.has_stale_layers("g1")
    # status() reconciles with the kernel: neither the mount nor its layer is there, so both are forgotten
    assert host.status()["mounts"] == {}
    assert envelope(path) == {"format": "layerbox.mounts", "version": 2, "layers": {}, "entries": {}, "holds": {}}
    assert not host.has_stale_layers("g2")
    assert sorted(p.name for p in state.iterdir()) == ["lock", "lock.spare", "mounts", "mounts.json"]
    assert list((state / "mounts").iterdir()) == []


def test_mounts_with_holds_rewritten_keeps_them(tmp_path: Path) -> None:
    host = HostMounts(tmp_path / "data")
    path = tmp_path / "data" / "state" / "mounts.json"
    path.parent.mkdir(parents=True)
    hold = {"digest": f"sha256:{HEX}", "layers": []}
    path.write_text(json.dumps({"layers": {}, "mounts": {}, "entries": {},
                                "holds": {"containerd:/c:1": hold, "containerd:/c:2": hold}},
                               separators=(",", ":")))
    assert set(host.holds()) == {"containerd:/c:1", "containerd:/c:2"}
    assert host.release("containerd:/c:1")
    doc = envelope(path)
    assert (doc["format"], doc["version"], doc["holds"]) == ("layerbox.mounts", 2, {"containerd:/c:2": hold})
    assert path.read_bytes().startswith(b'{"format":"layerbox.mounts","version":2,"layers":{}')  # compact


def test_has_stale_layers(tmp_path: Path) -> None:
    host = HostMounts(tmp_path / "data")
    assert not host.has_stale_layers("g1")  # no table yet: nothing mounted
    path = tmp_path / "data" / "state" / "mounts.json"
    path.parent.mkdir(parents=True)
    layer = {"mountpoint": "/x", "path": None, "users": [], "meta": "/m", "blob_io": "buffered"}
    layers = {"a" * 64: {**layer, "generation": "g1"}, "b" * 64: {**layer, "generation": "g1"}}
    doc = {"format": "layerbox.mounts", "version": 2, "layers": layers, "entries": {}, "holds": {}}
    path.write_text(json.dumps(doc))
    assert not host.has_stale_layers("g1")
    assert host.has_stale_layers("g2")
    layers["b" * 64]["generation"] = "g2"
    path.write_text(json.dumps(doc))
    assert host.has_stale_layers("g1")
    assert host.has_stale_layers("g2")
    path.write_text(json.dumps({**doc, "version": 3}))
    with pytest.raises(HostStateError, match="mounts.json: found layerbox.mounts version 3"):
        host.has_stale_layers("g1")


# sandbox/core/leases.py wrote json.dumps(table, indent=1, sort_keys=True): job -> lease
LEGACY_LEASES = b"""{
 "job-a": {
  "expires": 2000000000.0,
  "job": "job-a",
  "manifest": null,
  "state": "active",
  "ttl": 300.0
 },
 "job-b": {
  "expires": 1000.0,
  "job": "job-b",
  "manifest": "runs/job-b:1",
  "state": "preempted",
  "ttl": 60.0
 }
}"""


ENVELOPED_LEASES = json.dumps({"format": "layerbox.leases", "version": 1,
                               "leases": json.loads(LEGACY_LEASES)}).encode()


@pytest.mark.parametrize("legacy", [LEGACY_LEASES, ENVELOPED_LEASES], ids=["unversioned", "version-1"])
def test_leases_split_the_table_of_older_layerboxes_once(tmp_path: Path, legacy: bytes) -> None:
    root = tmp_path / "sandbox"
    root.mkdir()
    table = json.loads(legacy)
    table = table.get("leases", table)
    table["job-c"] = {**table["job-a"], "job": "job-c"}  # a name renewed, never a job of this host
    table["Not A Job"] = {**table["job-a"], "job": "Not A Job"}  # a name no sandbox could have had
    (root / "leases.json").write_text(json.dumps(table, indent=1, sort_keys=True))
    (root / "leases.json.lock").touch()
    asked: list[int] = []

    def members() -> dict[str, list[str]]:
        asked.append(1)
        return {"job-a": [SID1]}

    leases = Leases(root / "leases", legacy=root / "leases.json")
    assert leases.migrate(members) == 2
    assert not (root / "leases.json").exists()
    assert not (root / "leases.json.lock").exists()
    a, b = leases.get("job-a"), leases.get("job-b")
    assert a is not None
    assert b is not None
    assert (a.ttl, a.state, a.expires, a.sandboxes) == (300.0, "active", 2000000000.0, (SID1,))
    assert (b.state, b.manifest, b.sandboxes) == ("preempted", "runs/job-b:1", ())
    assert leases.get("job-c") is None
    assert sorted(os.listdir(root / "leases" / "_host")) == ["job-a.json", "job-b.json", "lock"]
    assert envelope(root / "leases" / "_host" / "job-b.json") == {
        "format": "layerbox.lease", "version": 1, **json.loads(LEGACY_LEASES)["job-b"], "sandboxes": []}
    assert leases.migrate(members) == 0
    assert asked == [1]  # the states are read only when there is a table to split
    # a split a crash cut short (the table still there) is done again; a lease already split is kept
    (root / "leases.json").write_bytes(legacy.replace(b"300.0", b"5.0"))
    assert leases.migrate(members) == 0
    assert leases.get("job-a") == a


def test_leases_refuse_a_newer_lease(tmp_path: Path) -> None:
    path = tmp_path / "leases" / "_host" / "job-a.json"
    path.parent.mkdir(parents=True)
    path.write_text('{"format":"layerbox.lease","version":2,"job":"job-a"}')
    with pytest.raises(HostStateError, match="reaper then treats the job as unleased"):
        Leases(tmp_path / "leases").get("job-a")
    legacy = tmp_path / "leases.json"
    legacy.write_text('{"format":"layerbox.leases","version":2,"leases":{}}')
    with pytest.raises(HostStateError, match="leases.json: found layerbox.leases version 2"):
        Leases(tmp_path / "leases", legacy=legacy).migrate(dict)


# RangePool wrote json.dumps({"version": 1, "first", "size", "sandboxes"}, indent=1, sort_keys=True)
FIRST = 1_000_000
LEGACY_USERNS = f"""{{
 "first": {FIRST},
 "sandboxes": {{
  "{SID1}": 1
 }},
 "size": 65536,
 "version": 1
}}""".encode()


def test_userns_reads_the_unversioned_table_and_rewrites_it_on_a_change(tmp_path: Path) -> None:
    path = tmp_path / "sandbox" / "userns.json"
    path.parent.mkdir()
    path.write_bytes(LEGACY_USERNS)
    before = unchanged_stamp(path)
    pool = RangePool(path, FIRST, 4)
    assert pool.owners() == {SID1: FIRST + RANGE_SIZE}
    assert pool.allocate(SID1) == (FIRST + RANGE_SIZE, RANGE_SIZE)  # it has one: the same again
    assert stamp(path) == before
    assert pool.allocate(SID2) == (FIRST, RANGE_SIZE)  # the lowest free slot
    assert envelope(path) == {"format": "layerbox.userns", "version": 1, "first": FIRST, "size": RANGE_SIZE,
                              "sandboxes": {SID1: 1, SID2: 0}}
    pool.release(SID1)
    assert RangePool(path, FIRST, 4).owners() == {SID2: FIRST}


def test_userns_refuses_an_unversioned_table_of_another_version(tmp_path: Path) -> None:
    path = tmp_path / "userns.json"
    path.write_bytes(LEGACY_USERNS.replace(b'"version": 1', b'"version": 2'))
    with pytest.raises(HostStateError, match="legacy document it cannot upgrade"):
        RangePool(path, FIRST, 4).owners()


@pytest.mark.root("cmd:ip", "cmd:nft")
def test_net_reads_the_unversioned_table_and_rewrites_it_on_a_change(tmp_path: Path) -> None:
    subnet = f"10.252.{os.getpid() % 200 + 20}.0/24"
    policy = {"sandbox": SID1, "version": "0" * 32, "rules": [], "set_at": 1.5}
    # NetworkManager wrote json.dumps({"version": 1, "subnet", "sandboxes"}, sort_keys=True)
    legacy = json.dumps({"version": 1, "subnet": subnet, "sandboxes": {
        SID1: {"index": 0, "host_if": "lbffff000000001", "policy": policy},
        SID2: {"index": 1, "host_if": "lbffff000000002", "policy": {**policy, "sandbox": SID2}}}},
        sort_keys=True).encode()
    path = tmp_path / "net.json"
    path.write_bytes(legacy)
    before = unchanged_stamp(path)
    net = NetworkManager(tmp_path, subnet=subnet)
    assert net.list() == [SID1, SID2]
    assert stamp(path) == before
    net.destroy(SID1)  # neither has a veth or a namespace: only the allocation goes
    assert envelope(path) == {"format": "layerbox.net", "version": 1, "subnet": subnet, "sandboxes": {
        SID2: {"index": 1, "host_if": "lbffff000000002", "policy": {**policy, "sandbox": SID2}}}}
    assert net.list() == [SID2]
    net.destroy(SID2)
    assert net.list() == []


def test_host_records_one_file_each_and_a_torn_one(tmp_path: Path) -> None:
    records = HostRecords(tmp_path / "recs", "layerbox.mount", 1, durable=False)
    assert (records.get("a1"), records.all(), records.drop("a1")) == (None, {}, False)
    records.put("a1", {"x": 1})
    records.put("b2", {"x": 2})
    assert json.loads((tmp_path / "recs" / "a1.json").read_bytes()) == {"format": "layerbox.mount", "version": 1,
                                                                        "x": 1}
    assert records.all() == {"a1": {"x": 1}, "b2": {"x": 2}}
    assert records.drop("a1")
    assert records.all() == {"b2": {"x": 2}}
    for bad in ("", "../x", ".hidden", "a/b"):
        with pytest.raises(ValueError, match="not a record key"):
            records.put(bad, {})
    (tmp_path / "recs" / "b2.json").write_bytes(b'{"format":"layerbox.mo')  # torn by a power loss
    with pytest.raises(HostStateError, match="b2.json: found no JSON"):
        records.get("b2")
    assert records.all() == {}  # what it described (a mount) ended with the host: dropped
    assert not (tmp_path / "recs" / "b2.json").exists()
    durable = HostRecords(tmp_path / "durable", "layerbox.x", 1)
    durable.put("k", {})
    (tmp_path / "durable" / "k.json").write_bytes(b"")
    with pytest.raises(HostStateError, match="k.json"):
        durable.all()
