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
import queue
import stat
import tarfile
import threading
import urllib.parse
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

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
    """

    def __init__(self, raw: BinaryIO, head: bytes, kind: str, source: str) -> None:
        self._raw = raw
        self._head = head
        self._kind = kind
        self._source = source
        self._queue: queue.Queue[bytes | BaseException | None] = queue.Queue(QUEUE_DEPTH)
        self._buf = memoryview(b"")
        self._done = False
        self._stop = threading.Event()
        self.compressed_bytes = 0
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
                    if not self._put(block):
                        return
            self._put(None)
        except BaseException as exc:  # handed to the reading thread, which raises it
            self._put(exc)

    def _gunzip(self) -> None:
        # a layer may be several concatenated gzip members (pigz, some registries)
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        member_started = False
        for block in self._blocks():
            data = block
            while data:
                try:
                    out = d.decompress(data)
                except zlib.error as exc:
                    raise BadArchive(
                        f"{self._source}: corrupt gzip data near compressed byte "
                        f"{self.compressed_bytes - len(data)}: {exc}; the file is damaged, fetch it again"
                    ) from None
                member_started = True
                if out and not self._put(out):
                    return
                if d.eof:
                    data = d.unused_data
                    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
                    member_started = False
                    if data.strip(b"\0") == b"":  # trailing zero padding after the last member
                        data = b""
                else:
                    data = b""
        if member_started and not d.eof:
            raise BadArchive(
                f"{self._source}: gzip stream is truncated after {self.compressed_bytes} compressed bytes; "
                "the file was cut short (incomplete download or copy)"
            )

    def _unzstd(self) -> None:
        dctx = zstandard.ZstdDecompressor()
        d = dctx.decompressobj()
        in_frame = False
        for block in self._blocks():
            data = block
            while data:
                try:
                    out = d.decompress(data)
                except zstandard.ZstdError as exc:
                    raise BadArchive(
                        f"{self._source}: corrupt zstd data near compressed byte "
                        f"{self.compressed_bytes - len(data)}: {exc}; the file is damaged, fetch it again"
                    ) from None
                in_frame = True
                if out and not self._put(out):
                    return
                if d.eof:
                    data = d.unused_data
                    d = dctx.decompressobj()
                    in_frame = False
                else:
                    data = b""
        if in_frame and not d.eof:
            raise BadArchive(
                f"{self._source}: zstd stream is truncated after {self.compressed_bytes} compressed bytes; "
                "the file was cut short (incomplete download or copy)"
            )

    # -- consumer -----------------------------------------------------------
    def read(self, n: int = -1) -> bytes:
        out: list[bytes] = []
        want = n if n >= 0 else 1 << 62
        while want > 0:
            if not self._buf:
                if self._done:
                    break
                item = self._queue.get()
                if item is None:
                    self._done = True
                    break
                if isinstance(item, BaseException):
                    self._done = True
                    raise item
                self._buf = memoryview(item)
            take = self._buf[:want]
            out.append(bytes(take))
            self._buf = self._buf[len(take) :]
            want -= len(take)
        return b"".join(out)

    def drain(self) -> None:
        """Consume the rest of the stream so the raw input is read to its end."""
        while self.read(READ_SIZE):
            pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def open_decompressed(raw: BinaryIO, source: str) -> _Decompressor:
    head = raw.read(READ_SIZE)
    if head.startswith(GZIP_MAGIC):
        kind = "gzip"
    elif head.startswith(ZSTD_MAGIC):
        kind = "zstd"
    else:
        kind = "tar"
    return _Decompressor(raw, head, kind, source)


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
    tarfile.REGTYPE: KIND_REG,
    tarfile.AREGTYPE: KIND_REG,
    tarfile.CONTTYPE: KIND_REG,
    tarfile.GNUTYPE_SPARSE: KIND_REG,
    tarfile.DIRTYPE: KIND_DIR,
    tarfile.SYMTYPE: KIND_SYMLINK,
    tarfile.LNKTYPE: KIND_HARDLINK,
    tarfile.CHRTYPE: KIND_CHR,
    tarfile.BLKTYPE: KIND_BLK,
    tarfile.FIFOTYPE: KIND_FIFO,
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


def _fsencode(s: str) -> bytes:
    return s.encode("utf-8", "surrogateescape")


def _mtime(info: tarfile.TarInfo) -> tuple[int, int]:
    # tarfile turns PAX mtime into a float, losing nanoseconds; parse the text
    text = info.pax_headers.get("mtime")
    if text:
        whole, _, frac = text.partition(".")
        try:
            sec = int(whole)
            nsec = int((frac + "000000000")[:9]) if frac else 0
            if whole.startswith("-") and nsec:
                sec, nsec = sec - 1, 1_000_000_000 - nsec
            return sec, nsec
        except ValueError:
            pass
    return int(info.mtime), 0


def _xattrs(info: tarfile.TarInfo) -> dict[bytes, bytes]:
    out: dict[bytes, bytes] = {}
    for key, value in info.pax_headers.items():
        if key.startswith("SCHILY.xattr."):
            out[_fsencode(key[len("SCHILY.xattr.") :])] = _fsencode(value)
        elif key.startswith("LIBARCHIVE.xattr."):
            name = urllib.parse.unquote_to_bytes(key[len("LIBARCHIVE.xattr.") :])
            out[name] = base64.b64decode(value + "=" * (-len(value) % 4))
    return out


def _entry(info: tarfile.TarInfo) -> Entry:
    name = info.name
    offset = info.offset
    kind = _TYPE_KINDS.get(info.type)
    if kind is None:
        raise BadEntry(
            name, offset, f"unsupported tar entry type {info.type!r}",
            "layers may hold files, directories, links, devices and FIFOs only",
        )
    path = normalise_path(_fsencode(name), name, offset)
    sec, nsec = _mtime(info)
    entry = Entry(
        path=path,
        kind=kind,
        mode=info.mode & 0o7777,
        uid=info.uid,
        gid=info.gid,
        mtime=sec,
        mtime_nsec=nsec,
        size=info.size if kind == KIND_REG else 0,
        xattrs=_xattrs(info),
        name=name,
        offset=offset,
    )
    if kind == KIND_SYMLINK:
        entry.link = _fsencode(info.linkname)
        if not entry.link:
            raise BadEntry(name, offset, "symlink with an empty target")
    elif kind == KIND_HARDLINK:
        entry.link_path = normalise_path(_fsencode(info.linkname), name, offset, "hard-link target")
        if not entry.link_path:
            raise BadEntry(name, offset, "hard link to the root directory")
    elif kind in (KIND_CHR, KIND_BLK):
        entry.rdev = (info.devmajor, info.devminor)
    if kind != KIND_HARDLINK:
        entry.mode = kind_mode(kind, info.mode)
    return entry


def _recording_tarinfo() -> type[tarfile.TarInfo]:
    """A TarInfo class that remembers the last header block it was given.

    tarfile ends iteration silently on a short or invalid header anywhere but
    at offset 0; the last block tells a real end-of-archive marker (512 zero
    bytes) from a truncated or corrupt archive.
    """

    class RecordingTarInfo(tarfile.TarInfo):
        last_block: bytes = b""

        @classmethod
        def frombuf(cls, buf: bytes, encoding: str, errors: str) -> tarfile.TarInfo:  # type: ignore[override]
            cls.last_block = buf
            return super().frombuf(buf, encoding, errors)

    return RecordingTarInfo


class TarReader:
    """Iterate a tar stream's entries; ``data()`` reads the current regular file."""

    def __init__(self, raw: BinaryIO, source: str) -> None:
        self.source = source
        self._stream = open_decompressed(raw, source)
        self._info_cls = _recording_tarinfo()
        try:
            self._tar = tarfile.open(
                fileobj=self._stream,  # type: ignore[arg-type]
                mode="r|",
                bufsize=READ_SIZE,
                encoding="utf-8",
                errors="surrogateescape",
                tarinfo=self._info_cls,
            )
        except tarfile.ReadError as exc:
            self._stream.close()
            raise BadArchive(f"{source}: not a tar archive ({exc})") from None
        except BadArchive:
            self._stream.close()
            raise
        self._current: tarfile.TarInfo | None = None

    def __iter__(self) -> Iterator[Entry]:
        it = iter(self._tar)
        last = "the start of the archive"
        while True:
            try:
                info = next(it)
            except StopIteration:
                self._check_end(last)
                return
            except (tarfile.ReadError, EOFError) as exc:
                raise BadArchive(
                    f"{self.source}: broken tar header after {last}: {exc}; "
                    "the archive is truncated or corrupt"
                ) from None
            self._current = info
            last = f"entry {info.name!r} at offset {info.offset}"
            if info.type in (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME,
                             tarfile.GNUTYPE_LONGLINK):
                continue  # tarfile folds these into the next member already
            yield _entry(info)

    def _check_end(self, last: str) -> None:
        block = self._info_cls.last_block  # type: ignore[attr-defined]
        where = f"offset {self._tar.offset}"
        if len(block) < tarfile.BLOCKSIZE:
            raise BadArchive(
                f"{self.source}: tar stream ends at {where} without an end-of-archive marker "
                f"(after {last}); the archive is truncated"
            )
        if block.count(0) != tarfile.BLOCKSIZE:
            raise BadArchive(
                f"{self.source}: invalid tar header at {where} (after {last}): bad checksum or "
                "garbage; the archive is corrupt"
            )

    def data(self) -> Iterator[memoryview | bytes]:
        """Yield the current regular file's bytes in blocks of up to READ_SIZE."""
        info = self._current
        assert info is not None
        f = self._tar.extractfile(info)
        assert f is not None
        remaining = info.size
        while remaining > 0:
            try:
                block = f.read(min(READ_SIZE, remaining))
            except (tarfile.ReadError, EOFError, OSError) as exc:
                raise BadArchive(
                    f"{self.source}: entry {info.name!r} at offset {info.offset}: data ends early ({exc}); "
                    "the archive is truncated"
                ) from None
            if not block:
                raise BadArchive(
                    f"{self.source}: entry {info.name!r} at offset {info.offset}: data ends "
                    f"{remaining} bytes early; the archive is truncated"
                )
            remaining -= len(block)
            yield block

    def finish(self) -> None:
        """Read the input to its very end (after the tar end-of-archive marker)."""
        self._stream.drain()

    def close(self) -> None:
        self._stream.close()
