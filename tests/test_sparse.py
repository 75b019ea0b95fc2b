"""Sparse files: holes reach the layer as chunk holes without being read (docs/FORMAT.md rules 16, 17, 19).

Files of several GiB are made with ``truncate``, so they cost nothing on
disk; the tests check what was read (``/proc/self/io`` ``rchar``) and never
read a hole themselves: :func:`content_digest` skips holes with
``SEEK_DATA``/``SEEK_HOLE``, which EROFS answers from its chunk index too.
"""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest

from converters.dirsource import walk_directory
from converters.erofs import BlobWriter
from converters.errors import ConvertError
from converters.layer import convert_directory, convert_stream
from converters.tarstream import KIND_REG, Hole, TarReader
from layerstore.erofs import format as F
from layerstore.erofs.reader import ErofsImage
from sandbox.host.manager import SandboxManager
from tests.support.erofs_tools import fsck_erofs
from tests.support.proc import run
from tests.support.sandboxes import assert_clean

GiB = 1 << 30
MiB = 1 << 20
BIG = 4 * GiB
CHUNK = MiB  # the default chunk size
# (offset, length) of the data written into the big sparse file: unaligned, one run across
# a chunk boundary, one ending at the very last byte
WRITES = [(12_345, 100), (5_000_003, 3000), (3 * MiB - 4321, 10_000), (2 * GiB + 1, 1), (BIG - 7, 7)]
READ_CAP = 64 * MiB  # no test file here holds more data; a reader of holes stops there, not at 4 GiB


def pattern(offset: int, length: int) -> bytes:
    """Reproducible non-zero bytes for a write at ``offset``."""
    out = bytearray()
    counter = 0
    while len(out) < length:
        out += blake3.blake3(f"{offset}:{counter}".encode()).digest()
        counter += 1
    return bytes(b | 1 for b in out[:length])


def make_sparse(path: Path, size: int, writes: Iterable[tuple[int, int]]) -> None:
    with path.open("wb") as f:
        f.truncate(size)
        for offset, length in writes:
            os.pwrite(f.fileno(), pattern(offset, length), offset)


def sparse_tree(root: Path) -> dict[str, tuple[int, list[tuple[int, int]]]]:
    """A directory of sparse and dense files; returns name -> (size, writes)."""
    files = {
        "big": (BIG, WRITES),
        "all-hole": (BIG + 3, []),
        "dense": (2 * MiB + 5, [(0, 2 * MiB + 5)]),
        "small": (10, [(0, 10)]),
    }
    root.mkdir()
    for name, (size, writes) in files.items():
        make_sparse(root / name, size, writes)
    return files


def rchar() -> int:
    """Bytes this process has read through read(2)-like calls, threads included."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise AssertionError("/proc/self/io has no rchar")


def content_digest(path: Path) -> tuple[int, str]:
    """(size, digest of the non-zero 4 KiB blocks and their indexes), reading data regions only.

    Two files with the same content get the same digest however their holes
    and data regions are laid out (a source file has 4 KiB data regions, an
    EROFS file whole chunks).
    """
    h = blake3.blake3()
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        pos = 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno != errno.ENXIO:
                    raise
                break  # no data after pos
            end = os.lseek(fd, start, os.SEEK_HOLE)
            block = start // F.BLOCK_SIZE * F.BLOCK_SIZE
            while block < end:
                data = os.pread(fd, F.BLOCK_SIZE, block)
                if data.strip(b"\0"):
                    h.update(block.to_bytes(8, "little") + data)
                block += F.BLOCK_SIZE
            pos = max(end, block)
    finally:
        os.close(fd)
    return size, h.hexdigest()


def collect(pieces: Iterable[bytes | memoryview | Hole]) -> list[bytes | memoryview | Hole]:
    """The pieces, failing as soon as they carry more data than any test file here holds."""
    out: list[bytes | memoryview | Hole] = []
    data = 0
    for piece in pieces:
        if not isinstance(piece, Hole):  # the tar reader's data are views, the directory's bytes
            data += len(piece)
            if data > READ_CAP:
                pytest.fail(f"more than {READ_CAP} bytes of data: holes are being read")
        out.append(piece)
    return out


def pieces_of(root: Path, name: str) -> list[bytes | Hole]:
    for entry, data in walk_directory(root):
        if entry.path == (name.encode(),):
            assert data is not None
            return collect(data())
    raise AssertionError(f"{name} not found under {root}")


def layout(pieces: Iterable[bytes | Hole]) -> Iterator[tuple[int, bytes | Hole]]:
    """(file offset, piece) for each piece."""
    pos = 0
    for piece in pieces:
        yield pos, piece
        pos += piece.length if isinstance(piece, Hole) else len(piece)


def expected_bytes(writes: list[tuple[int, int]], offset: int, length: int) -> bytes:
    out = bytearray(length)
    for at, n in writes:
        lo, hi = max(at, offset), min(at + n, offset + length)
        if lo < hi:
            out[lo - offset : hi - offset] = pattern(at, n)[lo - at : hi - at]
    return bytes(out)


_real_lseek = os.lseek


def _lseek_without_seek_data(fd: int, pos: int, how: int) -> int:
    """``os.lseek`` of a file system that does not know SEEK_DATA/SEEK_HOLE."""
    if how in (os.SEEK_DATA, os.SEEK_HOLE):
        raise OSError(errno.EINVAL, "Invalid argument")
    return _real_lseek(fd, pos, how)


# -- the directory reader ----------------------------------------------------------------------


def test_reader_yields_data_regions_and_holes(tmp_path: Path) -> None:
    files = sparse_tree(tmp_path / "src")
    size, writes = files["big"]
    before = rchar()
    pieces = pieces_of(tmp_path / "src", "big")
    read = rchar() - before
    data_bytes = sum(len(p) for p in pieces if isinstance(p, bytes))
    assert read <= data_bytes + 64 * 1024  # the rest is the directory walk, never a hole
    assert data_bytes <= len(WRITES) * 64 * 1024  # a few file-system blocks per write, not GiBs
    holes = [p for p in pieces if isinstance(p, Hole)]
    assert len(holes) >= len(WRITES) - 1
    assert all(h.length > 0 for h in holes)
    # in order, covering the file exactly, and every written byte inside a data piece
    spans = list(layout(pieces))
    assert sum(p.length if isinstance(p, Hole) else len(p) for _, p in spans) == size
    for offset, piece in spans:
        if isinstance(piece, Hole):  # no written byte inside it (asked of the writes: a hole is GiBs)
            assert not [(at, n) for at, n in writes if at < offset + piece.length and offset < at + n], offset
        else:
            assert piece == expected_bytes(writes, offset, len(piece))
    assert isinstance(spans[-1][1], bytes)  # the data at the very end


def test_reader_on_a_file_that_is_all_hole_and_one_without_holes(tmp_path: Path) -> None:
    files = sparse_tree(tmp_path / "src")
    assert pieces_of(tmp_path / "src", "all-hole") == [Hole(BIG + 3)]
    dense = pieces_of(tmp_path / "src", "dense")
    assert all(isinstance(p, bytes) for p in dense)
    assert b"".join(p for p in dense if isinstance(p, bytes)) == expected_bytes(files["dense"][1], 0, 2 * MiB + 5)


def test_reader_falls_back_to_reading_where_seek_data_is_unsupported(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    writes = [(100, 10), (3 * MiB, 5)]
    (tmp_path / "src").mkdir()
    make_sparse(tmp_path / "src" / "f", 5 * MiB, writes)
    monkeypatch.setattr(os, "lseek", _lseek_without_seek_data)
    pieces = pieces_of(tmp_path / "src", "f")
    assert all(isinstance(p, bytes) for p in pieces)
    assert b"".join(p for p in pieces if isinstance(p, bytes)) == expected_bytes(writes, 0, 5 * MiB)


def test_reader_refuses_a_file_that_shrinks_over_a_hole(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    path = tmp_path / "src" / "f"
    make_sparse(path, BIG, [(0, 10)])
    data = next(d for e, d in walk_directory(tmp_path / "src") if e.kind == KIND_REG)
    assert data is not None
    it = data()
    first = next(it)
    assert isinstance(first, bytes)
    assert first[:10] == pattern(0, 10)
    os.truncate(path, MiB)  # the hole that follows is never read: only the size tells
    with pytest.raises(ConvertError, match="shrank while being read"):
        list(it)


def test_reader_refuses_a_dense_file_that_shrinks_and_ignores_growth(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    path = tmp_path / "src" / "f"
    make_sparse(path, 3 * MiB, [(0, 3 * MiB)])
    data = next(d for e, d in walk_directory(tmp_path / "src") if e.kind == KIND_REG)
    assert data is not None
    it = data()
    next(it)
    os.truncate(path, MiB)
    with pytest.raises(ConvertError, match="shrank while being read"):
        list(it)
    make_sparse(path, 3 * MiB, [(0, 3 * MiB)])
    data = next(d for e, d in walk_directory(tmp_path / "src") if e.kind == KIND_REG)
    assert data is not None
    it = data()
    first = next(it)
    with path.open("ab") as f:
        f.write(b"grown")
    rest = [p for p in it if isinstance(p, bytes)]
    assert sum(map(len, [first, *rest])) == 3 * MiB  # read up to the size lstat gave, as before


# -- BlobWriter.add_file ----------------------------------------------------------------------------


class CountingWriter(BlobWriter):
    """Counts what reaches add_chunk: a chunk inside a hole must not."""

    def __init__(self, fd: int, chunk_size: int) -> None:
        super().__init__(fd, chunk_size)
        self.calls = 0
        self.chunk_bytes = 0

    def add_chunk(self, data: bytes | memoryview) -> int:
        self.calls += 1
        self.chunk_bytes += len(data)
        return super().add_chunk(data)


def _dense(pieces: list[bytes | Hole]) -> list[bytes | Hole]:
    return [bytes(p.length) if isinstance(p, Hole) else p for p in pieces]


def _write(tmp_path: Path, name: str, pieces: list[bytes | Hole], cs: int) -> tuple[list[int], bytes, CountingWriter]:
    path = tmp_path / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        writer = CountingWriter(fd, cs)
        size = sum(p.length if isinstance(p, Hole) else len(p) for p in pieces)
        blocks = writer.add_file(pieces, size)
    finally:
        os.close(fd)
    return blocks, path.read_bytes(), writer


CS = 16 << 10
NULL = F.NULL_ADDR


@pytest.mark.parametrize(("pieces", "expected", "calls"), [
    # data, a hole across three chunk boundaries, data inside the chunk the hole ends in, a hole to
    # the end: the chunk holding the hole's last 12 bytes is the only hole one add_chunk sees
    ([b"a" * 10, Hole(3 * CS - 10 + 5), b"b" * 7, Hole(2 * CS)], [0, NULL, NULL, 4, NULL, NULL], 3),
    ([Hole(5 * CS)], [NULL] * 5, 0),
    ([Hole(100), b"x", Hole(CS - 101), b"y" * CS], [0, 4], 2),
    ([b"z" * CS, Hole(CS), b"q" * (CS // 2)], [0, NULL, 4], 2),
    ([b"a" * CS, Hole(CS // 3)], [0, NULL], 2),  # a partial last chunk that is all hole
    ([b"r" * (CS + 3), Hole(CS - 3), b"r" * (CS + 3)], [0, 4, 0, 8], 4),  # a repeated chunk is stored once
])
def test_add_file_holes_match_the_dense_file(tmp_path: Path, pieces: list[bytes | Hole], expected: list[int],
                                             calls: int) -> None:
    blocks, blob, writer = _write(tmp_path, "sparse.blob", pieces, CS)
    dense_blocks, dense_blob, _ = _write(tmp_path, "dense.blob", _dense(pieces), CS)
    assert blocks == expected
    assert (blocks, blob) == (dense_blocks, dense_blob)
    assert writer.calls == calls  # a chunk wholly inside a hole never reaches add_chunk
    assert writer.stats.data_bytes == sum(len(p) for p in pieces if isinstance(p, bytes))


def test_add_file_skips_a_huge_hole_without_zero_buffers(tmp_path: Path) -> None:
    size = 1 << 40
    blocks, blob, writer = _write(tmp_path, "b", [Hole(size - 5), b"tail!"], MiB)
    assert blocks == [NULL] * (size // MiB - 1) + [0]
    assert (writer.calls, writer.chunk_bytes) == (1, MiB)  # only the chunk the data share
    assert blob == bytes(MiB - 5) + b"tail!"
    assert (writer.stats.holes, writer.stats.file_bytes, writer.stats.data_bytes) == (len(blocks) - 1, size, 5)


def test_add_file_refuses_pieces_that_do_not_cover_the_size(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "b", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        with pytest.raises(ConvertError, match="internal"):
            BlobWriter(fd, CS).add_file([b"x", Hole(CS)], CS)
    finally:
        os.close(fd)


# -- whole layers ---------------------------------------------------------------------------------


def test_sparse_layer_equals_the_layer_of_the_holes_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "src").mkdir()
    make_sparse(tmp_path / "src" / "f", 40 * MiB + 9, [(7, 3), (9 * MiB - 2, 5000), (40 * MiB + 1, 8)])
    make_sparse(tmp_path / "src" / "g", 3 * MiB, [])
    sparse = convert_directory(tmp_path / "src", tmp_path / "s.erofs", tmp_path / "s.blob")
    monkeypatch.setattr(os, "lseek", _lseek_without_seek_data)  # every hole read as zeros
    dense = convert_directory(tmp_path / "src", tmp_path / "d.erofs", tmp_path / "d.blob")
    assert (tmp_path / "s.erofs").read_bytes() == (tmp_path / "d.erofs").read_bytes()
    assert (tmp_path / "s.blob").read_bytes() == (tmp_path / "d.blob").read_bytes()
    assert sparse.bytes == dense.bytes == dense.data_bytes == 43 * MiB + 9
    assert sparse.data_bytes < 64 * 1024


@pytest.mark.root("erofs", "cmd:fsck.erofs")
def test_sparse_directory_layer_mounts_and_reads_back(mounts: Any, tmp_path: Path) -> None:
    files = sparse_tree(tmp_path / "src")
    before = rchar()
    result = convert_directory(tmp_path / "src", tmp_path / "l.erofs", tmp_path / "l.blob")
    read = rchar() - before
    assert read < 2 * MiB + 5 + 1 * MiB  # the dense file plus a few blocks per write: no hole was read
    assert result.bytes == sum(size for size, _ in files.values())
    assert result.data_bytes <= 2 * MiB + 5 + 10 + len(WRITES) * 64 * 1024
    # the big file's data touch 5 chunks (one run crosses a boundary: 6), the dense one 3
    assert result.unique_chunks == 6 + 3 + 1
    assert (tmp_path / "l.blob").stat().st_size <= 10 * MiB
    image = ErofsImage.open(tmp_path / "l.erofs")
    chunks = image.chunks(image.lookup("big"))
    data_chunks = sorted({(at + i) // CHUNK for at, n in WRITES for i in (0, n - 1)})
    assert [c.file_offset // CHUNK for c in chunks if not c.hole] == data_chunks
    assert all(c.hole for c in image.chunks(image.lookup("all-hole")))
    fsck_erofs(tmp_path / "l.erofs", tmp_path / "l.blob")
    mnt = mounts.erofs(tmp_path / "l.erofs", tmp_path / "l.blob")
    for name, (size, writes) in files.items():
        assert content_digest(mnt / name) == content_digest(tmp_path / "src" / name), name
        with (mnt / name).open("rb") as f:
            for at in sorted({0, size - 1, size // 2, *(a for a, _ in writes), *(a + n - 1 for a, n in writes)}):
                assert os.pread(f.fileno(), 1, at) == expected_bytes(writes, at, 1), (name, at)


@pytest.mark.parametrize("tar_format", ["gnu", "posix"])  # old GNU sparse headers and PAX sparse 1.0
@pytest.mark.root("erofs")
def test_gnu_sparse_members_pass_holes_on(mounts: Any, tmp_path: Path, tar_format: str) -> None:
    files = sparse_tree(tmp_path / "src")
    tar = tmp_path / "sparse.tar"
    run(["tar", "--sparse", f"--format={tar_format}", "-cf", str(tar), "-C", str(tmp_path / "src"), "big", "all-hole"],
        timeout=600)
    with tar.open("rb") as raw:
        reader = TarReader(raw, str(tar))
        try:
            for entry in reader:
                pieces = collect(reader.data())
                size, writes = files[entry.name]
                assert sum(p.length if isinstance(p, Hole) else len(p) for p in pieces) == size
                assert sum(len(p) for p in pieces if not isinstance(p, Hole)) <= len(writes) * 64 * 1024
        finally:
            reader.close()
    with tar.open("rb") as raw:
        result = convert_stream(raw, tmp_path / "l.erofs", tmp_path / "l.blob")
    assert result.bytes == 2 * BIG + 3
    assert result.data_bytes <= len(WRITES) * 64 * 1024
    mnt = mounts.erofs(tmp_path / "l.erofs", tmp_path / "l.blob")
    for name in ("big", "all-hole"):
        assert content_digest(mnt / name) == content_digest(tmp_path / "src" / name), name


# -- a sandbox checkpoint ---------------------------------------------------------------------------


@pytest.mark.usefixtures("need_root")
@pytest.mark.root("erofs", "overlay", "fuse", "cmd:crun")
def test_checkpoint_of_a_sparse_file_reads_and_counts_its_data(boxes: Any, store_url: str, tmp_path: Path) -> None:
    box = boxes()
    made = box.exec("truncate -s 4G /root/f; printf x | dd of=/root/f bs=1 seek=123456789 conv=notrunc; "
                    "printf end | dd of=/root/f bs=1 seek=4294967293 conv=notrunc")
    assert made.exit_code == 0, made.stderr
    before = rchar()
    ckpt = asyncio.run(box.checkpoint())
    read = rchar() - before
    assert read < 16 * MiB  # the data's chunks (uploaded from the blob) and metadata; 4 GiB before
    assert 4 <= ckpt.bytes_changed <= 64 * 1024  # the data, not the apparent 4 GiB
    assert ckpt.bytes_uploaded < MiB
    second = SandboxManager(tmp_path / "host2", store_url)
    try:
        restored = asyncio.run(second.restore(ckpt.name))
        try:
            out = restored.exec("stat -c %s /root/f; dd if=/root/f bs=1 skip=123456789 count=1 status=none; "
                                "dd if=/root/f bs=1 skip=4294967293 status=none; "
                                "dd if=/root/f bs=1 skip=123456788 count=1 status=none | od -An -tx1")
            assert out.exit_code == 0, out.stderr
            assert out.stdout.split() == [b"4294967296", b"xend", b"00"]
        finally:
            restored.destroy()
    finally:
        second.close()
    assert_clean(second)
