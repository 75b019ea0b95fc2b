"""Pack objects: many zstd-compressed chunks in one store object.

A host never needs one request per tiny file: chunks are appended to a pack
until it reaches ``PACK_TARGET`` bytes, and a reader fetches one chunk (or a
run of adjacent chunks) with a ranged GET.  Layout (docs/FORMAT.md, "Packs"):

    frame_0 .. frame_n-1   each one zstd frame holding one chunk
    index                  n records of PACK_RECORD, in frame order
    footer                 PACK_FOOTER, the last 24 bytes

The pack id is the blake3 of the whole pack.  The index is also stored on its
own (``index/<pack id>``) so that hosts can learn chunk locations without
reading packs; that copy is derived data and can be rebuilt from the packs.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import blake3
import zstandard

from layerstore.errors import FormatError

PACK_MAGIC = b"LBXPACK1"
PACK_VERSION = 1
PACK_TARGET = 8 << 20
PACK_MAX_CHUNKS = 4096
ZSTD_LEVEL = 3

PACK_RECORD = struct.Struct("<32sQII")  # chunk digest, frame offset, frame length, raw length
assert PACK_RECORD.size == 48
PACK_FOOTER = struct.Struct("<8sIIQ")  # magic, version, record count, index offset
assert PACK_FOOTER.size == 24


@dataclass(frozen=True)
class ChunkLocation:
    pack: bytes  # 32-byte pack id
    offset: int
    length: int  # compressed frame length
    raw_length: int

    def encode(self) -> bytes:
        return self.pack + struct.pack("<QII", self.offset, self.length, self.raw_length)

    @classmethod
    def decode(cls, data: bytes) -> ChunkLocation:
        offset, length, raw = struct.unpack_from("<QII", data, 32)
        return cls(bytes(data[:32]), offset, length, raw)


def compress(data: bytes | memoryview) -> bytes:
    # one compressor per call: zstandard objects are not thread-safe and the
    # setup cost is small next to a chunk
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(data)


def decompress(frame: bytes, raw_length: int) -> bytes:
    """Decompress one frame that must hold at most ``raw_length`` bytes.

    zstandard ignores ``max_output_size`` when the frame header states its
    content size, so a hostile header could make us allocate anything: check
    the stated size first, and stream with a hard limit when there is none.
    """
    stated = zstandard.frame_content_size(frame)
    if stated > raw_length:
        raise FormatError(f"zstd frame claims {stated} bytes where at most {raw_length} are expected")
    if stated >= 0:
        return zstandard.ZstdDecompressor().decompress(frame, max_output_size=raw_length)
    # no stated size: read at most one byte past the bound, so a bomb costs raw_length + 1 bytes
    with zstandard.ZstdDecompressor().stream_reader(frame, read_across_frames=False) as reader:
        out = reader.read(raw_length + 1)
        while len(out) <= raw_length:
            more = reader.read(raw_length + 1 - len(out))
            if not more:
                break
            out += more
    if len(out) > raw_length:
        raise FormatError(f"zstd frame holds more than the {raw_length} bytes expected")
    return out


class PackBuilder:
    """Collects compressed chunks; ``finish`` returns (pack id, pack bytes, index bytes)."""

    def __init__(self) -> None:
        self._frames: list[bytes] = []
        self._records: list[tuple[bytes, int, int, int]] = []
        self._digests: set[bytes] = set()
        self.size = 0

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._digests

    def add(self, digest: bytes, frame: bytes, raw_length: int) -> None:
        if digest in self._digests:
            return
        self._records.append((digest, self.size, len(frame), raw_length))
        self._frames.append(frame)
        self._digests.add(digest)
        self.size += len(frame)

    @property
    def full(self) -> bool:
        return self.size >= PACK_TARGET or len(self._records) >= PACK_MAX_CHUNKS

    def finish(self) -> tuple[bytes, bytes, bytes, list[tuple[bytes, ChunkLocation]]]:
        index = b"".join(PACK_RECORD.pack(*r) for r in self._records)
        footer = PACK_FOOTER.pack(PACK_MAGIC, PACK_VERSION, len(self._records), self.size)
        pack = b"".join(self._frames) + index + footer
        pack_id = blake3.blake3(pack).digest()
        locations = [(d, ChunkLocation(pack_id, off, n, raw)) for d, off, n, raw in self._records]
        return pack_id, pack, index, locations


def parse_index(index: bytes, pack_id: bytes, name: str) -> list[tuple[bytes, ChunkLocation]]:
    if len(index) % PACK_RECORD.size:
        raise FormatError(f"{name}: pack index of {len(index)} bytes is not a whole number of records")
    out = []
    for i in range(0, len(index), PACK_RECORD.size):
        digest, off, n, raw = PACK_RECORD.unpack_from(index, i)
        out.append((digest, ChunkLocation(pack_id, off, n, raw)))
    return out


def parse_footer(footer: bytes, size: int, name: str) -> tuple[int, int]:
    """A pack's last ``PACK_FOOTER.size`` bytes -> (record count, index offset), checked
    against the pack's ``size``."""
    if size < PACK_FOOTER.size or len(footer) != PACK_FOOTER.size:
        raise FormatError(f"{name}: {size} bytes is too short for a pack")
    magic, version, count, index_at = PACK_FOOTER.unpack(footer)
    if magic != PACK_MAGIC or version != PACK_VERSION:
        raise FormatError(f"{name}: not a layerbox pack (magic {magic!r}, version {version})")
    if index_at + count * PACK_RECORD.size + PACK_FOOTER.size != size:
        raise FormatError(f"{name}: footer says {count} records at {index_at}, "
                          f"which does not fit a pack of {size} bytes")
    return count, index_at


def split_pack(pack: bytes, name: str) -> tuple[bytes, list[tuple[bytes, ChunkLocation]]]:
    """Check a whole pack's framing; returns (index bytes, records)."""
    count, index_at = parse_footer(pack[-PACK_FOOTER.size:], len(pack), name)
    index = pack[index_at : len(pack) - PACK_FOOTER.size]
    pack_id = blake3.blake3(pack).digest()
    return index, parse_index(index, pack_id, name)
