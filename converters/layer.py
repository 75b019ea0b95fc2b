"""Convert one tar stream or directory into a layer (metadata image + blob).

Crash safety: both outputs are written under temporary names beside their
final paths and fsynced; then any old metadata image at the target path is
removed, the blob is renamed into place, and the metadata image last.  A
crash anywhere leaves at worst a blob without an image, never an image beside
a blob it was not made with.  On any error both temporaries are removed.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

import blake3

from converters.dirsource import walk_directory
from converters.erofs import BlobWriter, blob_id, build_image
from converters.errors import ConvertError
from converters.tarstream import KIND_HARDLINK, KIND_REG, DataFn, Entry, TarReader
from converters.tree import Node, Tree, node_from_entry
from layerstore.erofs import format as F

DEFAULT_CHUNK_SIZE = 1 << 20
MIN_CHUNK_SIZE = F.BLOCK_SIZE
MAX_CHUNK_SIZE = 1 << 30


@dataclass(frozen=True)
class LayerResult:
    digest: str  # "blake3:<hex>" of the metadata image: the layer's identity
    meta_path: str
    blob_path: str
    blob_digest: str  # "blake3:<hex>" over the blob map records (see docs/FORMAT.md)
    files: int  # inodes in the layer
    bytes: int  # regular-file bytes, holes included
    data_bytes: int  # regular-file bytes the source stored: ``bytes`` less the holes it reported
    chunks: int  # chunk references, holes excluded
    unique_chunks: int
    unique_bytes: int
    seconds: float

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def check_chunk_size(chunk_size: int) -> None:
    if chunk_size < MIN_CHUNK_SIZE or chunk_size > MAX_CHUNK_SIZE or chunk_size & (chunk_size - 1):
        raise ConvertError(
            f"chunk size {chunk_size} is invalid: use a power of two from {MIN_CHUNK_SIZE} to {MAX_CHUNK_SIZE}"
        )


class _Output:
    """A file written under a temporary name and renamed into place on commit."""

    def __init__(self, final: str | os.PathLike[str]) -> None:
        self.final = Path(final)
        self.tmp = self.final.with_name(f".{self.final.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
        self._sync: threading.Thread | None = None
        self._sync_error: OSError | None = None
        try:
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise ConvertError(f"cannot create {self.final}: {exc.strerror}") from None

    def start_sync(self) -> None:
        """Begin the fsync on a thread, for a file that is complete: its writeback (the
        blob's ~0.1 s per 200 MB) then overlaps the metadata image's build, which holds
        the GIL while fsync does not.  ``commit`` waits for it."""
        self._sync = threading.Thread(target=self._fsync, name="layerbox-fsync", daemon=True)
        self._sync.start()

    def _fsync(self) -> None:
        try:
            os.fsync(self.fd)
        except OSError as exc:  # raised by commit, in the converting thread
            self._sync_error = exc

    def _wait_sync(self) -> bool:
        """True when a started fsync succeeded; raises its error."""
        if self._sync is None:
            return False
        self._sync.join()
        self._sync = None
        if self._sync_error is not None:
            raise self._sync_error
        return True

    def commit(self) -> None:
        if not self._wait_sync():
            os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        os.rename(self.tmp, self.final)
        dfd = os.open(self.final.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self._wait_sync()  # never close the fd under a running fsync
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


def convert_entries(
    entries: Iterable[tuple[Entry, DataFn | None]],
    meta_path: str | os.PathLike[str],
    blob_path: str | os.PathLike[str],
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    finish: Callable[[], None] | None = None,
    oci_whiteouts: bool = True,
) -> LayerResult:
    """Build a layer from entries; ``finish`` runs after the last entry, before commit."""
    check_chunk_size(chunk_size)
    start = time.perf_counter()
    blob_out = _Output(blob_path)
    meta_out: _Output | None = None
    try:
        blob = BlobWriter(blob_out.fd, chunk_size)
        tree = Tree(oci_whiteouts=oci_whiteouts)
        # the node is kept so that its id cannot be reused by a later one
        stored: dict[int, tuple[Node, int]] = {}
        for entry, data in entries:
            if entry.kind == KIND_HARDLINK:
                tree.add(entry, None)
                continue
            node = node_from_entry(entry)
            if entry.kind == KIND_REG and entry.size:
                assert data is not None
                before = blob.stats.data_bytes
                node.chunks = blob.add_file(data(), entry.size)
                stored[id(node)] = (node, blob.stats.data_bytes - before)
            tree.add(entry, node)
        if finish is not None:
            finish()
        blob_out.start_sync()
        bid = blob_id(blob)
        image, inodes = build_image(tree, blob, blob_tag=bid.encode())
        meta_out = _Output(meta_path)
        view = memoryview(image)
        while view:
            view = view[os.write(meta_out.fd, view):]
        # an old image at meta_path would pair with the new blob after a crash
        # between the renames: remove it first, so a crash leaves no image at all
        with contextlib.suppress(FileNotFoundError):
            os.unlink(meta_path)
        blob_out.commit()
        meta_out.commit()
    except BaseException:
        blob_out.abort()
        if meta_out is not None:
            meta_out.abort()
        raise
    size, data_bytes = _regular_bytes(tree, stored)
    return LayerResult(
        digest="blake3:" + blake3.blake3(image).hexdigest(),
        meta_path=str(meta_path),
        blob_path=str(blob_path),
        blob_digest="blake3:" + bid,
        files=inodes,
        bytes=size,
        data_bytes=data_bytes,
        chunks=blob.stats.chunks,
        unique_chunks=blob.stats.unique_chunks,
        unique_bytes=blob.stats.unique_bytes,
        seconds=round(time.perf_counter() - start, 6),
    )


def _regular_bytes(tree: Tree, stored: Mapping[int, tuple[Node, int]]) -> tuple[int, int]:
    """(size, stored data) of the tree's regular files, each inode once; ``stored`` by node id."""
    seen: set[int] = set()
    total = data = 0
    for _, node, _ in tree.walk():
        if id(node) not in seen and stat.S_ISREG(node.mode):
            seen.add(id(node))
            total += node.size
            data += stored[id(node)][1] if id(node) in stored else 0
    return total, data


def convert_stream(
    raw: BinaryIO,
    meta_path: str | os.PathLike[str],
    blob_path: str | os.PathLike[str],
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    source: str = "-",
    verify: Callable[[], None] | None = None,
    diff_id: Callable[[str], None] | None = None,
    raw_sha256: str | None = None,
) -> LayerResult:
    """Convert one tar stream (plain, gzip or zstd, sniffed) into a layer.

    ``raw`` is read to its end, past the tar end-of-archive marker; then
    ``verify`` (if given) runs before the outputs get their final names, so a
    digest check that fails leaves nothing behind.  ``diff_id`` (if given) runs
    after ``verify``, with ``sha256:<hex>`` of the uncompressed tar (the OCI
    diff id), and may refuse it the same way.  The uncompressed bytes are
    hashed as they are decompressed; for an uncompressed stream they are
    ``raw`` itself, and ``raw_sha256`` (the digest ``verify`` checked ``raw``
    against, when it is a sha256) is passed on instead of hashing ``raw`` twice.
    """
    check_chunk_size(chunk_size)
    reader = TarReader(raw, source, hash_uncompressed=diff_id is not None, hash_plain=raw_sha256 is None)

    def entries() -> Iterator[tuple[Entry, DataFn | None]]:
        for entry in reader:
            yield entry, (reader.data if entry.kind == KIND_REG else None)

    def finish() -> None:
        reader.finish()
        if verify is not None:
            verify()
        if diff_id is not None:
            digest = reader.uncompressed_digest or raw_sha256
            assert digest is not None
            diff_id(digest)

    try:
        return convert_entries(entries(), meta_path, blob_path, chunk_size=chunk_size, finish=finish)
    finally:
        reader.close()


def convert_directory(
    src: str | os.PathLike[str],
    meta_path: str | os.PathLike[str],
    blob_path: str | os.PathLike[str],
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> LayerResult:
    return convert_entries(walk_directory(src), meta_path, blob_path, chunk_size=chunk_size, oci_whiteouts=False)


def convert(
    src: str,
    meta_path: str | os.PathLike[str],
    blob_path: str | os.PathLike[str],
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> LayerResult:
    """``src`` is a tar/tar.gz/tar.zst file, ``-`` for standard input, or a directory."""
    if src == "-":
        return convert_stream(sys.stdin.buffer, meta_path, blob_path, chunk_size=chunk_size, source="<stdin>")
    try:
        st = os.stat(src)
    except OSError as exc:
        raise ConvertError(f"{src}: {exc.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        return convert_directory(src, meta_path, blob_path, chunk_size=chunk_size)
    with open(src, "rb") as f:
        return convert_stream(f, meta_path, blob_path, chunk_size=chunk_size, source=src)
