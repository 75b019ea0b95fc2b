"""The host blob cache on a real filesystem: presence from the file, eviction, restarts, reboots."""

from __future__ import annotations

import os
import random
from pathlib import Path

import blake3
import pytest

from layerstore.erofs.reader import BlobRecord
from lazyfetch.blobcache import PAD, BlobCache, BlobCacheError, LayerBlob, charged, punch_hole

HEX = "ab" * 32


def make_records(n: int, seed: int = 0) -> tuple[list[BlobRecord], dict[bytes, bytes]]:
    """n chunks of odd sizes laid out block by block, as a blob map does."""
    rnd = random.Random(seed)
    records, chunks, block = [], {}, 0
    for _ in range(n):
        data = rnd.randbytes(rnd.randint(100, 70_000))
        digest = blake3.blake3(data).digest()
        chunks[digest] = data
        records.append(BlobRecord(digest, block, len(data)))
        block += (len(data) + 4095) // 4096
    return records, chunks


def blob_size(records: list[BlobRecord]) -> int:
    last = max(records, key=lambda r: r.block)
    return last.block * 4096 + last.length


def filled(cache: BlobCache, layer: LayerBlob, chunks: dict[bytes, bytes]) -> None:
    for digest, data in chunks.items():
        assert cache.fill(layer, digest, data)


def test_presence_is_read_from_the_file(tmp_path: Path) -> None:
    records, chunks = make_records(20)
    cache = BlobCache(tmp_path / "c", 1 << 30)
    layer = cache.add(HEX, blob_size(records), records)
    assert os.fstat(layer.fd).st_size % PAD == 0
    assert os.fstat(layer.fd).st_size >= blob_size(records)
    assert layer.missing(range(20)) == list(range(20))
    some = list(chunks.items())[:5]
    for digest, data in some:
        cache.fill(layer, digest, data)
    assert layer.missing(range(20)) == list(range(5, 20))
    for i in range(5):
        a, b = layer.span(i)
        assert layer.read(a, b - a) == records_data(records, chunks, i)
    # a hole made behind the cache's back counts, whatever memory says
    a, b = layer.span(2)
    punch_hole(layer.fd, a, charged(a, b - a))
    assert 2 in layer.missing(range(20))
    # a torn write (half a chunk) is not a chunk
    big = next(i for i in range(5, 20) if records[i].length > 8192)
    a, _ = layer.span(big)
    os.pwrite(layer.fd, chunks[records[big].digest][:4096], a)
    assert layer.missing([big]) == [big]
    cache.close()


def records_data(records: list[BlobRecord], chunks: dict[bytes, bytes], i: int) -> bytes:
    return chunks[records[i].digest]


def test_reopen_keeps_what_the_files_hold(tmp_path: Path) -> None:
    records, chunks = make_records(12)
    cache = BlobCache(tmp_path / "c", 1 << 30)
    layer = cache.add(HEX, blob_size(records), records)
    filled(cache, layer, dict(list(chunks.items())[:8]))
    used = cache.used
    cache.close()
    again = BlobCache(tmp_path / "c", 1 << 30)
    layer = again.add(HEX, blob_size(records), records)
    assert layer.missing(range(12)) == list(range(8, 12))
    assert again.used == used == sum(charged(layer.starts[i], records[i].length) for i in range(8))
    again.close()


def test_a_second_cache_on_the_same_dir_is_refused(tmp_path: Path) -> None:
    cache = BlobCache(tmp_path / "c", 1 << 30)
    with pytest.raises(BlobCacheError, match="in use by another process"):
        BlobCache(tmp_path / "c", 1 << 30)
    cache.close()


def test_eviction_punches_least_recently_read_chunks(tmp_path: Path) -> None:
    records, chunks = make_records(30, seed=3)
    cache = BlobCache(tmp_path / "c", 1 << 30, min_age=0)
    layer = cache.add(HEX, blob_size(records), records)
    filled(cache, layer, chunks)
    cache.touch(layer, range(0, 10))  # the first ten read most recently
    freed = cache.evict(cache.used // 2)
    assert freed > 0
    gone = layer.missing(range(30))
    assert gone
    assert all(i >= 10 for i in gone)
    assert cache.used == sum(charged(layer.starts[i], records[i].length) for i in range(30) if i not in gone)
    cache.close()


def test_recent_and_pinned_chunks_are_kept(tmp_path: Path) -> None:
    records, chunks = make_records(10, seed=4)
    cache = BlobCache(tmp_path / "c", 1 << 30, min_age=3600)
    layer = cache.add(HEX, blob_size(records), records)
    filled(cache, layer, chunks)
    assert cache.evict(0) == 0  # everything was read just now (an allowed read may be on its way)
    assert layer.missing(range(10)) == []
    cache.min_age = 0
    with cache.pinned(layer, [0, 1]):
        cache.evict(0)
        assert layer.missing(range(10)) == list(range(2, 10))
    cache.evict(0)
    assert layer.missing(range(10)) == list(range(10))
    assert cache.used == 0
    cache.close()


def test_a_complete_layer_hears_before_its_first_hole(tmp_path: Path) -> None:
    records, chunks = make_records(6, seed=5)
    cache = BlobCache(tmp_path / "c", 1 << 30, min_age=0)
    seen: list[tuple[str, list[int]]] = []
    cache.on_complete = lambda layer: seen.append(("complete", layer.missing(range(6))))
    cache.on_punch = lambda layer: seen.append(("punch", layer.missing(range(6))))
    layer = cache.add(HEX, blob_size(records), records)
    filled(cache, layer, chunks)
    assert cache.note_complete(layer)
    cache.evict(0)
    # the fanotify path drops its ignore mark while the file is still whole
    assert seen == [("complete", []), ("punch", [])]
    assert not layer.complete_hint
    assert layer.missing(range(6)) == list(range(6))
    cache.close()


def test_capacity_is_kept_by_filling(tmp_path: Path) -> None:
    records, chunks = make_records(40, seed=6)
    total = sum(charged(r.block * 4096, r.length) for r in records)
    cache = BlobCache(tmp_path / "c", total // 3, min_age=0)
    layer = cache.add(HEX, blob_size(records), records)
    filled(cache, layer, chunks)
    assert cache.used <= total // 3
    allocated = os.fstat(layer.fd).st_blocks * 512
    assert allocated <= total // 3 + 64 * 4096  # the file itself, not only the accounting
    cache.close()


def test_after_a_reboot_present_chunks_are_hashed_again(tmp_path: Path) -> None:
    records, chunks = make_records(8, seed=7)
    cache = BlobCache(tmp_path / "c", 1 << 30)
    layer = cache.add(HEX, blob_size(records), records)
    filled(cache, layer, chunks)
    a, _ = layer.span(3)
    os.pwrite(layer.fd, b"\0" * 64, a + 10)  # what a lost write after power loss can look like
    cache.close()
    (tmp_path / "c" / "boot_id").write_text("an-earlier-boot\n")
    again = BlobCache(tmp_path / "c", 1 << 30)
    assert (tmp_path / "c" / f"{HEX}.unverified").exists()
    layer = again.add(HEX, blob_size(records), records)
    assert layer.missing(range(8)) == [3]
    assert again.stats()["refused_at_verify"] == 1
    assert not (tmp_path / "c" / f"{HEX}.unverified").exists()
    again.close()


def test_names_that_are_not_digests_never_become_paths(tmp_path: Path) -> None:
    cache = BlobCache(tmp_path / "c", 1 << 30)
    for bad in ("../" + "a" * 61, "A" * 64, "a" * 63, "a" * 64 + "/x", ""):
        with pytest.raises(BlobCacheError, match="not a layer digest"):
            cache.blob_path(bad)
    cache.close()
