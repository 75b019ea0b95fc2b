"""Receipt logs in bounded segments (sandbox/core/receipts.py).

One preview-URL mint is a 343-byte receipt and a client can mint ~50 a second; the log had no
bound, every read checked it whole, and it was kept for ever.  Here a log is a run of segments
(sealed past ``SEGMENT_RECORDS`` or ``SEGMENT_BYTES``, each opening with a ``segment`` record
naming the head and the count of what came before), a sandbox keeps ``KEEP_SEGMENTS`` of them,
the chain still verifies across them, a check is done once per content, a keyed command is found
in any segment kept, concurrent appenders lose nothing across rotations, and a destroyed
sandbox's log goes after ``RETENTION``.  The bounds are made small here so that rotations happen.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import stat
import time
from pathlib import Path
from typing import Any

import blake3
import pytest

from sandbox.core import receipts as receipts_module
from sandbox.core.errors import ReceiptsBroken
from sandbox.core.receipts import ReceiptLogs, receipt_line, records_before, verify_receipt_chain

SID, OTHER = "lb-0000000000aa", "lb-0000000000bb"


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch) -> None:
    """Segments of at most 5 records, 3 kept."""
    monkeypatch.setattr(receipts_module, "SEGMENT_RECORDS", 5)
    monkeypatch.setattr(receipts_module, "KEEP_SEGMENTS", 3)


def note(n: int, **more: Any) -> dict[str, Any]:
    return {"id": f"{n:016x}", "sandbox": SID, "action": "note", "time": 1.0, "n": n, **more}


def files(logs: ReceiptLogs) -> list[str]:
    return sorted(os.listdir(logs.dir))


def test_a_log_is_sealed_into_segments_and_keeps_a_bounded_number(tmp_path: Path, small: None) -> None:
    logs = ReceiptLogs(tmp_path / "receipts")
    for n in range(20):
        logs.append(SID, note(n))
    # 0-4 | seg 1: opening + 5-8 | seg 2: opening + 9-12 | seg 3: opening + 13-16 | seg 4 (live): opening + 17-19
    assert files(logs) == [f"{SID}.2.jsonl", f"{SID}.3.jsonl", f"{SID}.jsonl"]
    kept = logs.read(SID)
    assert [r["action"] for r in kept].count("segment") == 3
    assert [r["n"] for r in kept if r["action"] == "note"] == list(range(9, 20))
    opening = kept[0]
    assert (opening["segment"], opening["records_before"]) == (2, 10)
    live = logs.live(SID)
    assert (live[0]["segment"], records_before(live), [r.get("n") for r in live[1:]]) == (4, 20, [17, 18, 19])
    checked = logs.verify(SID)
    last_line = (logs.dir / f"{SID}.jsonl").read_bytes().splitlines()[-1]
    assert checked == {"records": 24, "head": blake3.blake3(last_line).hexdigest(), "last": note(19)["id"],
                       "segments": 3, "kept": 14}
    assert verify_receipt_chain(live, what="live") == checked["head"]  # a checkpoint's carried segment checks alone
    assert verify_receipt_chain(kept, what="kept") == checked["head"]  # and so do all the segments kept
    assert all(stat.S_IMODE((logs.dir / f).stat().st_mode) == 0o600 for f in files(logs))


def test_a_segment_is_sealed_by_bytes_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(receipts_module, "SEGMENT_BYTES", 4096)
    logs = ReceiptLogs(tmp_path)
    big = "x" * 3000
    for n in range(4):
        logs.append(SID, note(n, blob=big))
    sizes = [(tmp_path / f).stat().st_size for f in files(logs)]
    assert len(sizes) == 3  # each record past the first two went to a segment of its own
    assert max(sizes) < 4096 + 3200
    assert logs.verify(SID)["records"] == 6


def test_the_chain_runs_on_across_segments(tmp_path: Path, small: None) -> None:
    logs = ReceiptLogs(tmp_path)
    for n in range(14):
        logs.append(SID, note(n))
    logs.verify(SID)
    sealed = tmp_path / f"{SID}.2.jsonl"
    original = sealed.read_bytes()
    lines = original.splitlines(keepends=True)
    edited = json.loads(lines[2])
    edited["n"] = 99
    sealed.write_bytes(b"".join([*lines[:2], receipt_line(edited) + b"\n", *lines[3:]]))
    # 0-4 | 1: opening (record 5) + 5-8 | 2: opening (10) + 9-12 | live 3: opening (15) + 13
    with pytest.raises(ReceiptsBroken, match=r"record 13 \(id 000000000000000b"):
        logs.verify(SID)  # a sealed segment checked before is checked again once its bytes differ
    first = tmp_path / f"{SID}.1.jsonl"
    sealed.write_bytes(first.read_bytes())  # a segment in another's place
    with pytest.raises(ReceiptsBroken, match="segment 2 does not follow segment 1"):
        logs.verify(SID)
    sealed.write_bytes(original)
    assert logs.verify(SID)["records"] == 17
    first.unlink()  # the oldest kept goes (as the bound drops it): the next one anchors the chain
    assert logs.verify(SID)["records"] == 17
    sealed.write_bytes(first.parent.joinpath(f"{SID}.jsonl").read_bytes())
    with pytest.raises(ReceiptsBroken, match="segment 2 does not open with its segment record"):
        logs.verify(SID)


def test_a_check_is_done_once_per_content(tmp_path: Path, small: None, monkeypatch: pytest.MonkeyPatch) -> None:
    logs = ReceiptLogs(tmp_path)
    for n in range(12):
        logs.append(SID, note(n))
    logs.verify(SID)
    parsed: list[bytes] = []
    real = json.loads

    def counting(data: Any, **kw: Any) -> Any:
        parsed.append(data)
        return real(data, **kw)

    monkeypatch.setattr(receipts_module.json, "loads", counting)
    logs.verify(SID)
    assert len(parsed) <= 2  # the live segment's opening (its number), and the last id: no record again
    parsed.clear()
    logs.append(SID, note(12))
    logs.verify(SID)
    assert len(parsed) <= 3  # and the one record appended since


def test_a_keyed_record_is_found_in_any_segment_kept(tmp_path: Path, small: None) -> None:
    logs = ReceiptLogs(tmp_path)
    logs.append(SID, note(0, action="exec_started", idempotency_key="k1"))
    logs.append(SID, note(1, action="exec", idempotency_key="k1", exit_code=0))
    logs.append(SID, note(2, action="exec", idempotency_key='k"2', exit_code=3))
    for n in range(3, 9):
        logs.append(SID, note(n, command=['"idempotency_key": "k1"']))  # a look-alike is parsed, not taken
    assert len(files(logs)) == 2
    found = logs.keyed(SID, "k1")
    assert found is not None
    assert (found["action"], found["n"]) == ("exec", 1)  # the finished exec wins over the exec_started
    found = logs.keyed(SID, 'k"2')
    assert found is not None
    assert found["exit_code"] == 3
    for n in range(9, 20):
        logs.append(SID, note(n))
    assert logs.keyed(SID, "k1") is None  # beyond the segments kept: run out of the log


def _append_many(directory: str, worker: int, count: int) -> None:
    logs = ReceiptLogs(directory)
    for n in range(count):
        logs.append(SID, note(n, worker=worker))


def test_appenders_in_several_processes_lose_nothing_across_rotations(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(receipts_module, "SEGMENT_RECORDS", 16)
    monkeypatch.setattr(receipts_module, "KEEP_SEGMENTS", 1000)  # keep all, to count them
    ctx = multiprocessing.get_context("fork")
    workers = [ctx.Process(target=_append_many, args=(str(tmp_path), w, 150)) for w in range(4)]
    for p in workers:
        p.start()
    for p in workers:
        p.join(120)
        assert p.exitcode == 0
    logs = ReceiptLogs(tmp_path)
    kept = logs.read(SID)
    notes = [r for r in kept if r["action"] == "note"]
    assert sorted((r["worker"], r["n"]) for r in notes) == [(w, n) for w in range(4) for n in range(150)]
    for w in range(4):  # each process's records in its order
        assert [r["n"] for r in notes if r["worker"] == w] == list(range(150))
    checked = logs.verify(SID)
    assert checked["records"] == len(kept) == checked["kept"]
    assert all(len(open(tmp_path / f).read().splitlines()) <= 16 for f in files(logs))


def test_what_a_rotation_cut_short_leaves_is_read_and_taken_over(tmp_path: Path, small: None) -> None:
    logs = ReceiptLogs(tmp_path)
    for n in range(5):
        logs.append(SID, note(n))
    # a crash after the link (the live segment under its sealed name too) and a temp file left
    os.link(tmp_path / f"{SID}.jsonl", tmp_path / f"{SID}.0.jsonl")
    (tmp_path / f"{SID}.jsonl.tmp").write_text("half an opening")
    fresh = ReceiptLogs(tmp_path)  # another process: nothing cached
    assert [r["n"] for r in fresh.read(SID)] == list(range(5))
    fresh.append(SID, note(5))  # goes on from the crash: seals segment 0, whose name is already there
    assert files(fresh) == [f"{SID}.0.jsonl", f"{SID}.jsonl"]
    assert fresh.verify(SID)["records"] == 7
    assert [r.get("n") for r in fresh.read(SID)] == [0, 1, 2, 3, 4, None, 5]


def test_logs_of_sandboxes_gone_go_after_the_retention(tmp_path: Path, small: None) -> None:
    logs = ReceiptLogs(tmp_path)
    for sid in (SID, OTHER):
        for n in range(7):
            logs.append(sid, {**note(n), "sandbox": sid})
    (tmp_path / "not-a-log").write_text("")
    now = time.time()
    assert logs.expire(now, alive=lambda sid: False) == []  # within the retention
    old = now - receipts_module.RETENTION - 60
    for name in files(logs):
        os.utime(tmp_path / name, (old, old))
    assert logs.expire(now + 1, alive=lambda sid: False) == []  # at most once per EXPIRE_INTERVAL
    later = now + receipts_module.EXPIRE_INTERVAL + 1
    assert logs.expire(later, alive=lambda sid: sid == OTHER) == [SID]
    assert files(logs) == [f"{OTHER}.0.jsonl", f"{OTHER}.jsonl", "not-a-log"]
    assert logs.read(SID) == []
