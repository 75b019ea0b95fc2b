"""Write a layer: chunk file data into the blob, then lay out the EROFS metadata image.

The blob is written as data stream past (one pass, no staging copy): each
chunk of each regular file is hashed with blake3; an all-zero chunk becomes a
hole, and so does a chunk inside a hole the source reported (``Hole``),
without a zero byte being made or hashed; a chunk seen before in this layer
is referenced again; a new one is appended to the blob at the next block
boundary.  Once the whole archive has been read, :func:`build_image` lays out
the metadata image in three passes (directory sizes, inode placement,
serialisation).  The byte layout is documented in docs/FORMAT.md; keep the
two in step.
"""

from __future__ import annotations

import itertools
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass

import blake3

from converters.errors import ConvertError
from converters.tarstream import Hole
from converters.tree import Node, Tree
from layerstore.erofs import format as F

ZERO_BLOCK = bytes(F.BLOCK_SIZE)
_ZERO_CACHE: dict[int, bytes] = {}


def _is_zero(data: bytes | bytearray | memoryview) -> bool:
    n = len(data)
    if n == 0 or data[0] or data[-1]:
        return False
    zero = _ZERO_CACHE.get(n)
    if zero is None:
        zero = _ZERO_CACHE.setdefault(n, bytes(n))
    # a prefix of exactly n bytes: a memcmp, where memoryview == bytes compares item by item
    return zero.startswith(data)


@dataclass
class BlobStats:
    chunks: int = 0  # chunk references, holes excluded
    unique_chunks: int = 0
    unique_bytes: int = 0
    file_bytes: int = 0  # holes included
    data_bytes: int = 0  # arrived as bytes, not as Hole markers (zeros that were read included)
    holes: int = 0


class BlobWriter:
    """Appends unique chunks to the blob file, block aligned, and remembers them."""

    def __init__(self, fd: int, chunk_size: int) -> None:
        self._fd = fd
        self.chunk_size = chunk_size
        self.next_block = 0
        self.records: list[tuple[bytes, int, int]] = []  # digest, start block, length
        self._seen: dict[bytes, int] = {}
        self.stats = BlobStats()

    def add_chunk(self, data: bytes | bytearray | memoryview) -> int:
        """Store one chunk; return its start block, or NULL_ADDR for a hole."""
        self.stats.file_bytes += len(data)
        if _is_zero(data):
            self.stats.holes += 1
            return F.NULL_ADDR
        self.stats.chunks += 1
        digest = blake3.blake3(data).digest()
        block = self._seen.get(digest)
        if block is not None:
            return block
        block = self.next_block
        if block + F.blocks_for(len(data)) > 0xFFFFFFFF:
            raise ConvertError("layer data exceed 16 TiB, the largest blob this format addresses")
        self._seen[digest] = block
        self.records.append((digest, block, len(data)))
        pad = -len(data) % F.BLOCK_SIZE
        os.write(self._fd, data) if not pad else os.writev(self._fd, [data, ZERO_BLOCK[:pad]])
        self.next_block += F.blocks_for(len(data))
        self.stats.unique_chunks += 1
        self.stats.unique_bytes += len(data)
        return block

    def add_file(self, pieces: Iterable[bytes | memoryview | Hole], size: int) -> list[int]:
        """Chunk a file arriving as arbitrary blocks and holes; returns its chunk start blocks.

        A chunk wholly inside a hole is NULL_ADDR at once.  A chunk a hole
        shares with data is completed with zeros and stored like any other,
        so the output is the same as for the file with its holes read.

        Whole chunks inside a piece, and a file's last chunk, are stored
        straight from the piece; only a chunk that spans pieces is copied
        (once, into ``pending``).
        """
        cs = self.chunk_size
        out: list[int] = []
        pending = bytearray()
        total = 0
        for piece in pieces:
            if isinstance(piece, Hole):
                n = piece.length
                total += n
                if pending:
                    fill = min(n, cs - len(pending))
                    pending += bytes(fill)
                    n -= fill
                    if len(pending) == cs:
                        out.append(self.add_chunk(pending))
                        pending = bytearray()
                whole = n // cs
                out.extend(itertools.repeat(F.NULL_ADDR, whole))
                self.stats.holes += whole
                self.stats.file_bytes += whole * cs
                pending += bytes(n - whole * cs)
                continue
            n = len(piece)
            total += n
            self.stats.data_bytes += n
            view = memoryview(piece)
            start = 0
            if pending:
                start = min(n, cs - len(pending))
                pending += view[:start]
                if len(pending) < cs:
                    continue
                out.append(self.add_chunk(pending))
                pending = bytearray()
            while n - start >= cs or (start < n and total == size):
                end = min(start + cs, n)
                out.append(self.add_chunk(view[start:end]))
                start = end
            if start < n:
                pending += view[start:]
        if pending:
            out.append(self.add_chunk(pending))
        if total != size:
            raise ConvertError(f"internal: {total} bytes of data for a file of {size}")
        return out


# ---------------------------------------------------------------------------
# metadata image


def _ftype(mode: int) -> int:
    fmt = stat.S_IFMT(mode)
    return {
        stat.S_IFREG: F.FT_REG_FILE,
        stat.S_IFDIR: F.FT_DIR,
        stat.S_IFCHR: F.FT_CHRDEV,
        stat.S_IFBLK: F.FT_BLKDEV,
        stat.S_IFIFO: F.FT_FIFO,
        stat.S_IFSOCK: F.FT_SOCK,
        stat.S_IFLNK: F.FT_SYMLINK,
    }[fmt]


def encode_xattrs(xattrs: dict[bytes, bytes], where: str) -> bytes:
    """Inline xattr body (header + entries), or b"" when there are none."""
    if not xattrs:
        return b""
    entries: list[tuple[int, bytes, bytes]] = []
    for name, value in xattrs.items():
        split = F.split_xattr_name(name)
        if split is None:
            raise ConvertError(
                f"{where}: xattr {name.decode('utf-8', 'replace')!r} has a namespace EROFS cannot store "
                "(only user., trusted., security. and system.posix_acl_*)"
            )
        if len(name) > 255 or len(value) > 0xFFFF:
            raise ConvertError(
                f"{where}: xattr {name!r} is too large (Linux allows names of 255 bytes and values of 65535)"
            )
        entries.append((split[0], split[1], value))
    entries.sort()
    body = bytearray(F.XATTR_IBODY_HEADER.pack(0, 0, b""))
    for index, suffix, value in entries:
        body += F.XATTR_ENTRY.pack(len(suffix), index, len(value)) + suffix + value
        body += bytes(-len(body) % 4)
    if (len(body) - F.XATTR_IBODY_HEADER.size) // 4 + 1 > 0xFFFF:
        raise ConvertError(f"{where}: {len(body)} bytes of xattrs exceed what one EROFS inode can hold")
    return bytes(body)


def _check_ranges(node: Node, where: str) -> None:
    """Refuse what EROFS cannot represent instead of silently truncating it."""
    for label, value in (("uid", node.uid), ("gid", node.gid)):
        if not 0 <= value <= 0xFFFFFFFF:
            raise ConvertError(f"{where}: {label} {value} does not fit 32 bits")
    if not -(1 << 63) <= node.mtime < (1 << 63):
        raise ConvertError(f"{where}: mtime {node.mtime} does not fit 64 bits")
    major, minor = node.rdev
    if not (0 <= major <= 0xFFF and 0 <= minor <= 0xFFFFF):
        raise ConvertError(f"{where}: device {major}:{minor} exceeds Linux's 12-bit major / 20-bit minor")


def _dir_blocks(entries: list[tuple[bytes, Node]]) -> list[list[tuple[bytes, Node]]]:
    """Split sorted entries into directory blocks (dirents first, then names)."""
    blocks: list[list[tuple[bytes, Node]]] = []
    current: list[tuple[bytes, Node]] = []
    used = 0
    for name, node in entries:
        need = F.DIRENT.size + len(name)
        if current and used + need > F.BLOCK_SIZE:
            blocks.append(current)
            current, used = [], 0
        current.append((name, node))
        used += need
    if current:
        blocks.append(current)
    return blocks


def _dir_size(blocks: list[list[tuple[bytes, Node]]]) -> int:
    last = blocks[-1]
    tail = sum(F.DIRENT.size + len(name) for name, _ in last)
    return (len(blocks) - 1) * F.BLOCK_SIZE + tail


def _encode_dir(blocks: list[list[tuple[bytes, Node]]]) -> bytes:
    out = bytearray()
    for i, block in enumerate(blocks):
        start = len(out)
        nameoff = F.DIRENT.size * len(block)
        for name, node in block:
            out += F.DIRENT.pack(node.nid, nameoff, _ftype(node.mode), 0)
            nameoff += len(name)
        for name, _ in block:
            out += name
        if i != len(blocks) - 1:
            out += bytes(F.BLOCK_SIZE - (len(out) - start))
    return bytes(out)


@dataclass
class _Placed:
    node: Node
    path: bytes
    xattr_body: bytes
    layout: int
    inline: bytes  # directory/symlink tail stored after the inode
    data: bytes  # directory/symlink bytes stored in whole blocks
    dir_blocks: list[list[tuple[bytes, Node]]] | None
    size: int
    pos: int = 0
    raw_blkaddr: int = 0


def _align(value: int, to: int) -> int:
    return (value + to - 1) // to * to


def build_image(tree: Tree, blob: BlobWriter, *, blob_tag: bytes) -> tuple[bytes, int]:
    """Serialise ``tree`` (whose chunks live in ``blob``); returns (image, inode count)."""
    chunk_bits = blob.chunk_size.bit_length() - 1
    placed: list[_Placed] = []
    seen: set[int] = set()
    links: dict[int, int] = {}
    subdirs: dict[int, int] = {}
    max_mtime = 0

    # pass 1: collect inodes in depth-first order, count links, size directories
    for path, node, parent in tree.walk():
        links[id(node)] = links.get(id(node), 0) + 1
        if node.is_dir and node is not tree.root:
            subdirs[id(parent)] = subdirs.get(id(parent), 0) + 1
        if id(node) in seen:
            continue
        seen.add(id(node))
        max_mtime = max(max_mtime, node.mtime)
        shown = b"/" + b"/".join(path)
        where = shown.decode("utf-8", "replace")
        _check_ranges(node, where)
        xattr_body = encode_xattrs(node.xattrs, where)
        dir_blocks = None
        data = b""
        if node.is_dir:
            assert node.children is not None
            entries = sorted([(b".", node), (b"..", parent), *node.children.items()],
                             key=lambda e: e[0])
            dir_blocks = _dir_blocks(entries)
            size = _dir_size(dir_blocks)
        elif stat.S_ISLNK(node.mode):
            data = node.target
            size = len(data)
            if size > 4095:
                raise ConvertError(f"{where}: symlink target of {size} bytes exceeds PATH_MAX")
        elif stat.S_ISREG(node.mode):
            size = node.size
        else:
            size = 0
        placed.append(_Placed(node, shown, xattr_body, F.LAYOUT_FLAT_PLAIN, b"", data, dir_blocks, size))

    # pass 2: place inodes (nids) and decide inline tails
    pos = F.SUPER_OFFSET + F.SUPERBLOCK.size + F.DEVICE_SLOT.size  # = 1280, nid 40
    for p in placed:
        isize = F.INODE_EXTENDED.size + len(p.xattr_body)
        node = p.node
        extra = 0
        if stat.S_ISREG(node.mode) and node.size > 0:
            p.layout = F.LAYOUT_CHUNK_BASED
            # the chunk index array starts at the next 8-byte boundary after the xattrs
            extra = -isize % F.CHUNK_INDEX.size + len(node.chunks) * F.CHUNK_INDEX.size
        elif node.is_dir or stat.S_ISLNK(node.mode):
            tail = p.size % F.BLOCK_SIZE
            if tail and isize + tail <= F.BLOCK_SIZE:
                p.layout = F.LAYOUT_FLAT_INLINE
                extra = tail
        total = isize + extra
        # keep the inode, its xattrs and an inline tail inside one block: the
        # kernel refuses tails that cross a block boundary
        if total <= F.BLOCK_SIZE and pos // F.BLOCK_SIZE != (pos + total - 1) // F.BLOCK_SIZE:
            pos = _align(pos, F.BLOCK_SIZE)
        elif total > F.BLOCK_SIZE and pos % F.BLOCK_SIZE + isize > F.BLOCK_SIZE:
            pos = _align(pos, F.BLOCK_SIZE)
        p.pos = pos
        node.nid = pos // F.SLOT_SIZE
        pos = _align(pos + total, F.SLOT_SIZE)
    if placed[0].node.nid > 0xFFFF:
        raise ConvertError("internal: root nid does not fit the superblock")

    # pass 3: whole data blocks of directories and symlinks after the inodes
    block = _align(pos, F.BLOCK_SIZE) // F.BLOCK_SIZE
    data_blocks: list[bytes] = []
    for ino, p in enumerate(placed, start=1):
        p.node.ino = ino
    for p in placed:
        if p.dir_blocks is not None:
            encoded = _encode_dir(p.dir_blocks)
        elif stat.S_ISLNK(p.node.mode):
            encoded = p.data
        else:
            continue
        if p.layout == F.LAYOUT_FLAT_INLINE:
            whole = len(encoded) - len(encoded) % F.BLOCK_SIZE
            p.inline = encoded[whole:]
            encoded = encoded[:whole]
        if encoded:
            p.raw_blkaddr = block
            padded = encoded + bytes(-len(encoded) % F.BLOCK_SIZE)
            data_blocks.append(padded)
            block += len(padded) // F.BLOCK_SIZE

    meta_blocks = block
    image = bytearray(meta_blocks * F.BLOCK_SIZE)
    for p in placed:
        node = p.node
        if p.layout == F.LAYOUT_CHUNK_BASED:
            i_u = F.CHUNK_FORMAT_INDEXES | (chunk_bits - F.BLOCK_BITS)
        elif stat.S_ISCHR(node.mode) or stat.S_ISBLK(node.mode):
            i_u = F.encode_rdev(*node.rdev)
        else:
            i_u = p.raw_blkaddr
        icount = 0 if not p.xattr_body else 1 + (len(p.xattr_body) - F.XATTR_IBODY_HEADER.size) // 4
        nlink = links[id(node)] + (1 + subdirs.get(id(node), 0) if node.is_dir else 0)
        core = F.INODE_EXTENDED.pack(
            F.FORMAT_EXTENDED | (p.layout << F.LAYOUT_SHIFT),
            icount,
            node.mode & 0xFFFF,
            0,
            p.size,
            i_u,
            node.ino,
            node.uid,
            node.gid,
            node.mtime & 0xFFFFFFFFFFFFFFFF,
            node.mtime_nsec,
            nlink,
            b"",
        )
        body = core + p.xattr_body
        if p.layout == F.LAYOUT_CHUNK_BASED:
            body += bytes(-len(body) % F.CHUNK_INDEX.size)
            body += b"".join(
                F.CHUNK_INDEX.pack(0, 0 if b == F.NULL_ADDR else 1, b) for b in node.chunks
            )
        else:
            body += p.inline
        image[p.pos : p.pos + len(body)] = body
    offset = _align(pos, F.BLOCK_SIZE)
    for chunk in data_blocks:
        image[offset : offset + len(chunk)] = chunk
        offset += len(chunk)

    # the blob map trailer (records, then a footer ending the last block)
    records = b"".join(F.BLOB_RECORD.pack(d, b, n) for d, b, n in blob.records)
    trailer = records + bytes(-(len(records) + F.TRAILER_FOOTER.size) % F.BLOCK_SIZE)
    map_offset = len(image)
    footer = F.TRAILER_FOOTER.pack(
        F.TRAILER_MAGIC, F.TRAILER_VERSION, chunk_bits, map_offset, len(blob.records),
        blob.next_block * F.BLOCK_SIZE, b"",
    )
    image += trailer + footer

    # superblock and the one device slot (the blob)
    image[F.SUPER_OFFSET : F.SUPER_OFFSET + F.SUPERBLOCK.size] = F.SUPERBLOCK.pack(
        F.EROFS_MAGIC, 0, 0, F.BLOCK_BITS, 0, placed[0].node.nid, len(placed),
        max_mtime & 0xFFFFFFFFFFFFFFFF, 0, len(image) // F.BLOCK_SIZE, 0, 0,
        bytes(16), b"layerbox".ljust(16, b"\0"),
        F.INCOMPAT_CHUNKED_FILE | F.INCOMPAT_DEVICE_TABLE, 0, 1,
        (F.SUPER_OFFSET + F.SUPERBLOCK.size) // F.DEVICE_SLOT.size, 0, 0, 0, 0, 0, b"",
    )
    slot_at = F.SUPER_OFFSET + F.SUPERBLOCK.size
    image[slot_at : slot_at + F.DEVICE_SLOT.size] = F.DEVICE_SLOT.pack(
        blob_tag[:64].ljust(64, b"\0"), blob.next_block, 0, b""
    )
    # a deterministic volume uuid derived from the content, so two layers differ
    uuid = blake3.blake3(bytes(image)).digest()[:16]
    uuid_at = F.SUPER_OFFSET + 48
    image[uuid_at : uuid_at + 16] = uuid
    return bytes(image), len(placed)


def blob_id(blob: BlobWriter) -> str:
    """The blob's identity: blake3 over its blob map records.

    The records name every chunk's digest, place and length, so they determine
    the blob byte for byte; hashing them costs nothing, while hashing the blob
    itself would read every byte a second time.
    """
    h = blake3.blake3()
    for digest, block, length in blob.records:
        h.update(F.BLOB_RECORD.pack(digest, block, length))
    return h.hexdigest()
