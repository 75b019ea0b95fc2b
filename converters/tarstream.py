"""Read a (possibly compressed) tar stream as a sequence of normalised entries.

Compression is sniffed from the magic bytes, never from a file name, and
decompression runs on its own thread: zlib and zstd release the GIL, so on a
2-core host inflating overlaps with hashing and writing chunks.  Nothing is
unpacked to disk; regular-file data are handed to the caller as a reader over
the live stream.

Every error names the entry and the byte offset of its header in the
uncompressed tar stream, because that is what a user can look up with
``tar -tv --block-number``.
"""

from __future__ import annotations

import base64
import hashlib
import queue
import stat
import struct
import threading
import urllib.parse
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import zstandard

from converters.errors import BadArchive, BadEntry

READ_SIZE = 1 << 20
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# the decompressor thread may run this many READ_SIZE blocks ahead of the parser
QUEUE_DEPTH = 8


class _Decompressor:
    """A file-like ``read(n)`` over ``raw`` decompressed by a background thread.

    The thread always reads ``raw`` to its end, so a caller hashing ``raw``
    (an OCI layer digest) sees every byte even though tar stops at its
    end-of-archive marker.  Errors in the thread surface from ``read``.

    With ``hash_output`` the thread also hashes the decompressed bytes
    (sha256, the OCI diff id) as it hands them over; an uncompressed stream
    only with ``hash_plain`` (its bytes are ``raw``, which a caller may hash
    already).
    """

    def __init__(
        self, raw: BinaryIO, head: bytes, kind: str, source: str, *, hash_output: bool = False, hash_plain: bool = True
    ) -> None:
        self._raw = raw
        self._head = head
        self._kind = kind
        self.kind = kind
        self._source = source
        self._queue: queue.Queue[bytes | BaseException | None] = queue.Queue(QUEUE_DEPTH)
        self._buf = memoryview(b"")
        self._done = False
        self._stop = threading.Event()
        self.compressed_bytes = 0
        self._output_hash = hashlib.sha256() if hash_output and (hash_plain or kind != "tar") else None
        self._thread = threading.Thread(target=self._run, name="layerbox-inflate", daemon=True)
        self._thread.start()

    # -- producer -----------------------------------------------------------
    def _blocks(self) -> Iterator[bytes]:
        data = self._head
        while data:
            self.compressed_bytes += len(data)
            yield data
            data = self._raw.read(READ_SIZE)

    def _put(self, item: bytes | BaseException | None) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            if self._kind == "gzip":
                self._gunzip()
            elif self._kind == "zstd":
                self._unzstd()
            else:
                for block in self._blocks():
                    if self._output_hash is not None:
                        self._output_hash.update(block)
                    if not self._put(block):
                        return
            self._put(None)
        except BaseException as exc:  # handed to the reading thread, which raises it
            self._put(exc)

    def _gunzip(self) -> None:
        # a layer may be several concatenated gzip members (pigz, some registries),
        # and gzip writers may pad the last member with zeros
        self._inflate("gzip", lambda: zlib.decompressobj(16 + zlib.MAX_WBITS), zlib.error, zero_padding=True)

    def _unzstd(self) -> None:
        dctx = zstandard.ZstdDecompressor()
        self._inflate("zstd", dctx.decompressobj, zstandard.ZstdError, zero_padding=False)

    def _inflate(self, label: str, new: Callable[[], Any], error: type[Exception], *, zero_padding: bool) -> None:
        """Decompress every frame or member of the raw stream, one after another."""
        d = new()
        started = False
        for block in self._blocks():
            data = block
            while data:
                try:
                    out = d.decompress(data)
                except error as exc:
                    raise BadArchive(
                        f"{self._source}: corrupt {label} data near compressed byte "
                        f"{self.compressed_bytes - len(data)}: {exc}; the file is damaged, fetch it again"
                    ) from None
                started = True
                if out and self._output_hash is not None:
                    self._output_hash.update(out)  # releases the GIL, like the inflating
                if out and not self._put(out):
                    return
                if d.eof:
                    data = d.unused_data
                    d = new()
                    started = False
                    if zero_padding and data.strip(b"\0") == b"":
                        data = b""
                else:
                    data = b""
        if started and not d.eof:
            raise BadArchive(
                f"{self._source}: {label} stream is truncated after {self.compressed_bytes} compressed bytes; "
                "the file was cut short (incomplete download or copy)"
            )

    @property
    def output_digest(self) -> str | None:
        """``sha256:<hex>`` of the decompressed bytes (complete after ``drain``), if hashed."""
        return None if self._output_hash is None else "sha256:" + self._output_hash.hexdigest()

    # -- consumer -----------------------------------------------------------
    def next_block(self) -> bytes:
        """The next piece of the decompressed stream, as the thread made it; b"" at its end.

        Every byte of the uncompressed stream passes through here exactly
        once and in order (``read`` takes its bytes from here too), so this
        is the one place to observe the whole uncompressed tar, e.g. to
        digest it.  Blocks are whatever one decompress call returned (about
        1-10 MB), handed over without a copy.
        """
        if self._buf:  # what a read() left of its last block
            block = self._buf.tobytes()
            self._buf = memoryview(b"")
            return block
        if self._done:
            return b""
        item = self._queue.get()
        if item is None:
            self._done = True
            return b""
        if isinstance(item, BaseException):
            self._done = True
            raise item
        return item

    def read(self, n: int = -1) -> bytes:
        out: list[bytes] = []
        want = n if n >= 0 else 1 << 62
        while want > 0:
            if not self._buf:
                block = self.next_block()
                if not block:
                    break
                self._buf = memoryview(block)
            take = self._buf[:want]
            out.append(bytes(take))
            self._buf = self._buf[len(take) :]
            want -= len(take)
        return b"".join(out)

    def drain(self) -> None:
        """Consume the rest of the stream so the raw input is read to its end."""
        while self.next_block():
            pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def open_decompressed(raw: BinaryIO, source: str, *, hash_output: bool = False, hash_plain: bool = True) -> _Decompressor:
    head = raw.read(READ_SIZE)
    if head.startswith(GZIP_MAGIC):
        kind = "gzip"
    elif head.startswith(ZSTD_MAGIC):
        kind = "zstd"
    else:
        kind = "tar"
    return _Decompressor(raw, head, kind, source, hash_output=hash_output, hash_plain=hash_plain)


# ---------------------------------------------------------------------------

KIND_REG = "reg"
KIND_DIR = "dir"
KIND_SYMLINK = "lnk"
KIND_HARDLINK = "hardlink"
KIND_CHR = "chr"
KIND_BLK = "blk"
KIND_FIFO = "fifo"
KIND_SOCK = "sock"

_TYPE_KINDS = {
    b"0": KIND_REG,
    b"\0": KIND_REG,
    b"7": KIND_REG,  # contiguous file
    b"S": KIND_REG,  # GNU old-style sparse file
    b"5": KIND_DIR,
    b"D": KIND_DIR,  # GNU dump directory: a directory plus a listing we ignore
    b"2": KIND_SYMLINK,
    b"1": KIND_HARDLINK,
    b"3": KIND_CHR,
    b"4": KIND_BLK,
    b"6": KIND_FIFO,
}
_KIND_IFMT = {
    KIND_REG: stat.S_IFREG,
    KIND_DIR: stat.S_IFDIR,
    KIND_SYMLINK: stat.S_IFLNK,
    KIND_CHR: stat.S_IFCHR,
    KIND_BLK: stat.S_IFBLK,
    KIND_FIFO: stat.S_IFIFO,
    KIND_SOCK: stat.S_IFSOCK,
}


@dataclass
class Entry:
    """One archive entry, independent of where it came from (tar or directory)."""

    path: tuple[bytes, ...]  # normalised components; () is the root
    kind: str
    mode: int  # full st_mode (type bits included)
    uid: int
    gid: int
    mtime: int  # seconds
    mtime_nsec: int
    size: int = 0
    link: bytes = b""  # symlink target, verbatim
    link_path: tuple[bytes, ...] = ()  # hard-link target, normalised
    rdev: tuple[int, int] = (0, 0)
    xattrs: dict[bytes, bytes] = field(default_factory=dict)
    name: str = ""  # as written in the archive, for messages
    offset: int | None = None


@dataclass(frozen=True)
class Hole:
    """``length`` bytes of zeros a source knows it does not store (a sparse file's hole).

    Regular-file data arrive as a sequence of ``bytes`` and ``Hole`` pieces
    that together cover the file's size; a hole is never expanded, so a file
    of terabytes of holes costs nothing to pass on.
    """

    length: int


# regular-file data: bytes, or read-only views of immutable blocks (valid as long as they are held)
DataFn = Callable[[], Iterator[bytes | memoryview | Hole]]


def kind_mode(kind: str, perm: int) -> int:
    return _KIND_IFMT[kind] | (perm & 0o7777)


def normalise_path(raw: bytes, name: str, offset: int | None, what: str = "path") -> tuple[bytes, ...]:
    """Split an archive path into safe components.

    Rule (docs/FORMAT.md, "Conversion rules"): ``.`` and empty components are
    dropped; a leading ``/`` or any ``..`` component is refused rather than
    silently rewritten, since either means the archive was not made as a
    container layer and guessing could place files outside the tree the user
    expects.
    """
    if raw.startswith(b"/"):
        raise BadEntry(name, offset, f"{what} is absolute", "layer archives hold paths relative to the root")
    parts: list[bytes] = []
    for comp in raw.split(b"/"):
        if comp in (b"", b"."):
            continue
        if comp == b"..":
            raise BadEntry(name, offset, f"{what} escapes the root through '..'", "refusing to convert")
        if len(comp) > 255:
            raise BadEntry(
                name, offset, f"name component of {len(comp)} bytes exceeds the 255-byte limit",
                "shorten the name",
            )
        if b"\0" in comp:
            raise BadEntry(name, offset, f"{what} contains a NUL byte")
        parts.append(comp)
    return tuple(parts)


# ---------------------------------------------------------------------------
# The tar parser.  Written for this converter rather than using tarfile: it
# needs exact header offsets for error messages, bytes names end to end, PAX
# nanosecond times and xattrs verbatim, strict end-of-archive detection
# (tarfile silently stops at a truncated or garbage header), and no per-entry
# copying of its read buffer (tarfile's stream mode copies the whole buffer on
# every small read, which dominated conversion of small-file layers).

BLOCK = 512
_SPARSE_ENTRY = struct.Struct("12s12s")


class _Input:
    """A forward-only byte source with exact offsets over the decompressed stream.

    It walks the decompressor's blocks in place: file data leave as
    memoryviews into them (no copy), headers as small ``bytes``.
    """

    def __init__(self, stream: _Decompressor) -> None:
        self._stream = stream
        self._buf = b""  # the current decompressed block
        self._view = memoryview(self._buf)
        self._pos = 0
        self.offset = 0  # absolute offset of _buf[0]

    def tell(self) -> int:
        return self.offset + self._pos

    def _next(self) -> bool:
        """Move on to the next block (the current one is used up); False at the end."""
        block = self._stream.next_block()
        if not block:
            return False
        self.offset += len(self._buf)
        self._buf, self._view, self._pos = block, memoryview(block), 0
        return True

    def take(self, n: int) -> bytes:
        """Exactly n bytes, or fewer only at the end of the stream."""
        end = self._pos + n
        if end <= len(self._buf):
            out = self._buf[self._pos : end]
            self._pos = end
            return out
        parts = [self._buf[self._pos :]]
        have = len(parts[0])
        self._pos = len(self._buf)
        while have < n and self._next():
            part = self._buf[: n - have]
            parts.append(part)
            have += len(part)
            self._pos = len(part)
        return b"".join(parts)

    def pieces(self, n: int) -> Iterator[memoryview]:
        """n bytes as views into the stream's blocks; stops short at EOF.

        A view stays valid (the block is immutable) but keeps its block alive.
        """
        while n > 0:
            if self._pos >= len(self._buf) and not self._next():
                return
            start = self._pos
            take = min(len(self._buf) - start, n)
            self._pos += take
            n -= take
            yield self._view[start : start + take]

    def skip(self, n: int) -> int:
        skipped = 0
        while n > 0:
            if self._pos >= len(self._buf) and not self._next():
                break
            take = min(len(self._buf) - self._pos, n)
            self._pos += take
            n -= take
            skipped += take
        return skipped


def _num(field: bytes, what: str) -> int:
    if field and field[0] & 0x80:  # GNU base-256 for values octal cannot hold
        value = int.from_bytes(field[1:], "big")
        if field[0] == 0xFF:
            value -= 1 << (8 * (len(field) - 1))
        return value
    text = field.split(b"\0", 1)[0].strip(b" ")
    if not text:
        return 0
    try:
        return int(text, 8)
    except ValueError:
        raise ValueError(f"bad octal number {text!r} in the {what} field") from None


def _cstr(field: bytes) -> bytes:
    return field.split(b"\0", 1)[0]


def _checksum_ok(header: bytes) -> bool:
    try:
        stored = _num(header[148:156], "checksum")
    except ValueError:
        return False
    blanked = header[:148] + b"        " + header[156:]
    unsigned = sum(blanked)
    if stored == unsigned:
        return True
    # some old tars summed signed chars
    return stored == unsigned - 256 * sum(1 for b in blanked if b > 127)


def _parse_pax(data: bytes, at: int) -> list[tuple[bytes, bytes]]:
    records: list[tuple[bytes, bytes]] = []
    pos = 0
    while pos < len(data):
        if data[pos] == 0:
            break  # NUL padding after the last record
        space = data.find(b" ", pos)
        try:
            length = int(data[pos:space])
        except ValueError:
            raise ValueError(f"malformed PAX record at byte {pos} of the extended header at offset {at}") from None
        record = data[space + 1 : pos + length]
        if length <= 0 or pos + length > len(data) or not record.endswith(b"\n") or b"=" not in record:
            raise ValueError(f"malformed PAX record at byte {pos} of the extended header at offset {at}")
        key, _, value = record[:-1].partition(b"=")
        records.append((key, value))
        pos += length
    return records


def _pax_mtime(text: bytes) -> tuple[int, int]:
    whole, _, frac = text.partition(b".")
    sec = int(whole)
    nsec = int((frac + b"000000000")[:9]) if frac else 0
    if whole.startswith(b"-") and nsec:
        sec, nsec = sec - 1, 1_000_000_000 - nsec
    return sec, nsec


class TarReader:
    """Iterate a tar stream's entries; ``data()`` reads the current regular file."""

    def __init__(self, raw: BinaryIO, source: str, *, hash_uncompressed: bool = False, hash_plain: bool = True) -> None:
        self.source = source
        self._stream = open_decompressed(raw, source, hash_output=hash_uncompressed, hash_plain=hash_plain)
        self._in = _Input(self._stream)
        self._global: dict[bytes, bytes] = {}
        self._pending = 0  # bytes of the current member's data not yet consumed
        self._padding = 0
        self._current: Entry | None = None
        self._sparse: list[tuple[int, int]] | None = None
        self._real_size = 0

    def _bad(self, offset: int, problem: str) -> BadArchive:
        return BadArchive(f"{self.source}: {problem} at offset {offset}; the archive is truncated or corrupt")

    def _skip_pending(self) -> None:
        todo = self._pending + self._padding
        if todo:
            at = self._in.tell()
            if self._in.skip(todo) != todo:
                name = self._current.name if self._current else "?"
                raise self._bad(at, f"data of entry {name!r} end early (truncated)")
        self._pending = self._padding = 0

    def _member_data(self, size: int, offset: int, what: str) -> bytes:
        data = self._in.take(size)
        if len(data) != size:
            raise self._bad(offset, f"{what} ends early")
        self._in.skip(-size % BLOCK)
        return data

    def __iter__(self) -> Iterator[Entry]:
        long_name: bytes | None = None
        long_link: bytes | None = None
        pax: list[tuple[bytes, bytes]] = []
        ext_offset: int | None = None  # where the first header of this entry's chain started
        while True:
            self._skip_pending()
            offset = self._in.tell()
            header = self._in.take(BLOCK)
            if len(header) < BLOCK:
                if header or ext_offset is not None:
                    raise self._bad(offset, "tar header cut short")
                raise self._bad(offset, "tar stream ends without an end-of-archive marker")
            if header.count(0) == BLOCK:
                if ext_offset is not None:
                    raise self._bad(offset, "end-of-archive marker after an extended header")
                return
            if not _checksum_ok(header):
                what = "no valid tar header" if offset == 0 else "invalid tar header (bad checksum)"
                raise self._bad(offset, what)
            if ext_offset is None:
                ext_offset = offset
            typeflag = header[156:157]
            try:
                size = _num(header[124:136], "size")
            except ValueError as exc:
                raise self._bad(offset, str(exc)) from None
            if typeflag in (b"x", b"g", b"L", b"K"):
                data = self._member_data(size, offset, "extended header")
                if typeflag == b"L":
                    long_name = data.rstrip(b"\0")
                elif typeflag == b"K":
                    long_link = data.rstrip(b"\0")
                else:
                    try:
                        records = _parse_pax(data, offset)
                    except ValueError as exc:
                        raise self._bad(offset, str(exc)) from None
                    if typeflag == b"g":
                        self._global.update(records)
                    else:
                        pax.extend(records)
                continue
            entry = self._build(header, offset, typeflag, size, long_name, long_link, pax)
            entry.offset = ext_offset
            long_name = long_link = None
            pax = []
            ext_offset = None
            yield entry

    def _build(
        self, header: bytes, offset: int, typeflag: bytes, size: int,
        long_name: bytes | None, long_link: bytes | None, pax_records: list[tuple[bytes, bytes]],
    ) -> Entry:
        magic = header[257:263]
        name = _cstr(header[0:100])
        if magic == b"ustar\0":  # POSIX ustar: prefix field extends the name
            prefix = _cstr(header[345:500])
            if prefix:
                name = prefix + b"/" + name
        link = _cstr(header[157:257])
        pax = dict(self._global)
        sparse_pairs: list[int] = []
        for key, value in pax_records:
            if key in (b"GNU.sparse.offset", b"GNU.sparse.numbytes"):
                sparse_pairs.append(int(value))  # format 0.0 repeats these keys in order
            pax[key] = value
        if long_name is not None:
            name = long_name
        if long_link is not None:
            link = long_link
        name = pax.get(b"GNU.sparse.name", pax.get(b"path", name))
        link = pax.get(b"linkpath", link)
        shown = name.decode("utf-8", "replace")
        kind = _TYPE_KINDS.get(typeflag)
        if kind is None:
            # POSIX lets readers treat unknown types as regular files; guessing
            # wrong would silently corrupt the tree, so refuse instead
            raise BadEntry(
                shown, offset, f"unsupported tar entry type {typeflag.decode('latin-1')!r}",
                "layers may hold files, directories, links, devices and FIFOs only",
            )
        if kind == KIND_REG and typeflag in (b"0", b"\0") and name.endswith(b"/"):
            kind = KIND_DIR  # pre-POSIX archives mark directories with a trailing slash only
        try:
            mode = _num(header[100:108], "mode")
            uid = int(pax[b"uid"]) if b"uid" in pax else _num(header[108:116], "uid")
            gid = int(pax[b"gid"]) if b"gid" in pax else _num(header[116:124], "gid")
            if b"size" in pax:
                size = int(pax[b"size"])
            if b"mtime" in pax:
                mtime, nsec = _pax_mtime(pax[b"mtime"])
            else:
                mtime, nsec = _num(header[136:148], "mtime"), 0
            major = _num(header[329:337], "devmajor") if kind in (KIND_CHR, KIND_BLK) else 0
            minor = _num(header[337:345], "devminor") if kind in (KIND_CHR, KIND_BLK) else 0
        except ValueError as exc:
            raise BadEntry(shown, offset, str(exc)) from None
        path = normalise_path(name, shown, offset)
        entry = Entry(path=path, kind=kind, mode=mode & 0o7777, uid=uid, gid=gid, mtime=mtime,
                      mtime_nsec=nsec, name=shown, offset=offset)
        for key, value in pax.items():
            if key.startswith(b"SCHILY.xattr."):
                entry.xattrs[key[len(b"SCHILY.xattr."):]] = value
            elif key.startswith(b"LIBARCHIVE.xattr."):
                xname = urllib.parse.unquote_to_bytes(key[len(b"LIBARCHIVE.xattr."):])
                entry.xattrs[xname] = base64.b64decode(value + b"=" * (-len(value) % 4))
        self._sparse = None
        if kind == KIND_REG:
            entry.size = size
            if typeflag == b"S":
                self._sparse, entry.size = self._old_gnu_sparse(header, offset)
            elif b"GNU.sparse.major" in pax or b"GNU.sparse.map" in pax or sparse_pairs:
                entry.size = int(pax.get(b"GNU.sparse.realsize", pax.get(b"GNU.sparse.size", b"0")))
                if pax.get(b"GNU.sparse.major") == b"1":
                    self._sparse = []  # the map sits at the start of the data; read in data()
                else:
                    raw_map = pax.get(b"GNU.sparse.map")
                    nums = [int(x) for x in raw_map.split(b",")] if raw_map else sparse_pairs
                    self._sparse = list(zip(nums[0::2], nums[1::2], strict=True))
        elif kind == KIND_SYMLINK:
            entry.link = link
            if not link:
                raise BadEntry(shown, offset, "symlink with an empty target")
        elif kind == KIND_HARDLINK:
            entry.link_path = normalise_path(link, shown, offset, "hard-link target")
            if not entry.link_path:
                raise BadEntry(shown, offset, "hard link to the root directory")
        elif kind in (KIND_CHR, KIND_BLK):
            entry.rdev = (major, minor)
        if kind != KIND_HARDLINK:
            entry.mode = kind_mode(kind, mode)
        # hard links, symlinks, devices and directories may still carry data blocks (GNU dumpdir)
        self._pending = size
        self._padding = -size % BLOCK
        self._current = entry
        return entry

    def _old_gnu_sparse(self, header: bytes, offset: int) -> tuple[list[tuple[int, int]], int]:
        pairs: list[tuple[int, int]] = []

        def read_entries(area: bytes, count: int) -> None:
            for i in range(count):
                off, num = _SPARSE_ENTRY.unpack_from(area, i * 24)
                if off.strip(b"\0 ") or num.strip(b"\0 "):
                    pairs.append((_num(off, "sparse offset"), _num(num, "sparse size")))

        read_entries(header[386:482], 4)
        extended = header[482]
        real_size = _num(header[483:495], "sparse real size")
        while extended:
            ext = self._in.take(BLOCK)
            if len(ext) < BLOCK:
                raise self._bad(offset, "GNU sparse extension header cut short")
            read_entries(ext, 21)
            extended = ext[504]
        return pairs, real_size

    def data(self) -> Iterator[memoryview | Hole]:
        """Yield the current regular file's bytes, the holes of a sparse file as ``Hole``."""
        entry = self._current
        assert entry is not None
        if self._sparse is None:
            yield from self._raw_data(entry, self._pending)
            return
        sparse = self._sparse
        if not sparse and entry.size:  # PAX 1.0: decimal map at the start of the data
            sparse = self._sparse_map_1_0(entry)
        pos = 0
        for off, num in sparse:
            if off < pos or off + num > entry.size:
                raise BadEntry(entry.name, entry.offset, f"sparse map segment {off}+{num} out of order or size")
            if off > pos:
                yield Hole(off - pos)
            yield from self._raw_data(entry, num)
            pos = off + num
        if entry.size > pos:
            yield Hole(entry.size - pos)

    def _sparse_map_1_0(self, entry: Entry) -> list[tuple[int, int]]:
        # decimal lines (count, then offset/size pairs) padded to a whole
        # block, so the file data start at the block after the map
        text = b""
        while True:
            lines = text.split(b"\n")[:-1]
            if lines and len(lines) >= 1 + 2 * int(lines[0]):
                nums = [int(x) for x in lines[1 : 1 + 2 * int(lines[0])]]
                return list(zip(nums[0::2], nums[1::2], strict=True))
            block = self._in.take(min(BLOCK, self._pending))
            if len(block) < BLOCK:
                raise BadEntry(entry.name, entry.offset, "GNU sparse 1.0 map cut short")
            self._pending -= len(block)
            text += block

    def _raw_data(self, entry: Entry, n: int) -> Iterator[memoryview]:
        if n > self._pending:
            raise BadEntry(entry.name, entry.offset, "sparse map names more data than the entry holds")
        got = 0
        for piece in self._in.pieces(n):
            got += len(piece)
            self._pending -= len(piece)
            yield piece
        if got != n:
            raise BadArchive(
                f"{self.source}: entry {entry.name!r} at offset {entry.offset}: data end "
                f"{n - got} bytes early; the archive is truncated"
            )

    def finish(self) -> None:
        """Read the input to its very end (after the tar end-of-archive marker)."""
        self._stream.drain()

    @property
    def uncompressed_digest(self) -> str | None:
        """After ``finish``: ``sha256:<hex>`` of the decompressed tar, when it was hashed."""
        return self._stream.output_digest

    def close(self) -> None:
        self._stream.close()
