"""Parse an EROFS metadata image without mounting it.

Used to list a layer's tree, map a file to its chunks (and, through the blob
map trailer, to chunk digests) and plan prefetch.  Parsing works on bytes
held in memory (metadata images are small) and never trusts a field: every
offset is bounds-checked and reported with the nid or byte offset it came
from.  Besides what layerbox writes, it reads the plain forms mkfs.erofs
produces (compact inodes, shared xattrs, block-map chunks), so images from
other tools can be inspected too; compressed layouts are refused.
"""

from __future__ import annotations

import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from layerstore.erofs import format as F
from layerstore.errors import FormatError

_COMPACT = struct.Struct("<HHHHIIIIHHI")  # compact (32-byte) inode
assert _COMPACT.size == F.INODE_COMPACT_SIZE


@dataclass(frozen=True)
class ChunkRef:
    """One chunk of a regular file."""

    file_offset: int
    length: int  # bytes of the file in this chunk
    device: int  # 0 = the metadata image itself, 1 = the blob
    block: int  # start block on that device, or NULL_ADDR for a hole
    digest: bytes | None  # from the blob map; None for holes or unmapped blocks

    @property
    def hole(self) -> bool:
        return self.block == F.NULL_ADDR


@dataclass
class Inode:
    nid: int
    mode: int
    uid: int
    gid: int
    size: int
    mtime: int
    mtime_nsec: int
    nlink: int
    ino: int
    layout: int
    i_u: int
    xattrs: dict[bytes, bytes] = field(default_factory=dict)
    data_offset: int = 0  # byte offset of what follows the inode core and xattrs

    @property
    def rdev(self) -> tuple[int, int]:
        if stat.S_ISCHR(self.mode) or stat.S_ISBLK(self.mode):
            return F.decode_rdev(self.i_u)
        return (0, 0)

    @property
    def is_whiteout(self) -> bool:
        return stat.S_ISCHR(self.mode) and self.rdev == (0, 0)


@dataclass(frozen=True)
class BlobRecord:
    digest: bytes
    block: int
    length: int


class ErofsImage:
    def __init__(self, data: bytes, name: str = "<image>") -> None:
        self.data = data
        self.name = name
        if len(data) < F.SUPER_OFFSET + F.SUPERBLOCK.size:
            raise FormatError(f"{name}: {len(data)} bytes is too short for an EROFS image")
        sb = F.SUPERBLOCK.unpack_from(data, F.SUPER_OFFSET)
        (magic, _csum, _compat, blkszbits, extslots, root_nid, inos, build_time, _bnsec, blocks,
         meta_blkaddr, xattr_blkaddr, uuid, _vol, incompat, _algs, extra_devices, devt_slotoff,
         *_rest) = sb
        if magic != F.EROFS_MAGIC:
            raise FormatError(f"{name}: bad EROFS magic {magic:#x} at byte {F.SUPER_OFFSET}: not an EROFS image")
        if incompat & ~F.SUPPORTED_INCOMPAT:
            raise FormatError(
                f"{name}: unsupported EROFS features {incompat & ~F.SUPPORTED_INCOMPAT:#x} "
                "(compressed or newer images cannot be read here)"
            )
        self.block_bits = blkszbits
        self.block_size = 1 << blkszbits
        if not 9 <= blkszbits <= 16:
            raise FormatError(f"{name}: implausible block size 2^{blkszbits}")
        self.root_nid = root_nid
        self.inode_count = inos
        self.build_time = build_time
        self.blocks = blocks
        self.meta_base = meta_blkaddr << blkszbits
        self.xattr_base = xattr_blkaddr << blkszbits
        self.uuid = uuid
        self.incompat = incompat
        self.devices: list[tuple[bytes, int]] = []
        for i in range(extra_devices):
            tag, dblocks, _mapped, _ = F.DEVICE_SLOT.unpack_from(data, devt_slotoff * F.DEVICE_SLOT.size + i * F.DEVICE_SLOT.size)
            self.devices.append((tag.rstrip(b"\0"), dblocks))
        self.volume_name = _vol.rstrip(b"\0")
        self._inodes: dict[int, Inode] = {}
        self.blob_map, self.chunk_bits_hint, self.blob_size = self._read_trailer()
        if self.volume_name == b"layerbox":
            # our images always carry the trailer and one device slot that agree
            if not self.blob_map and self.blob_size == 0 and self.devices and self.devices[0][1]:
                raise FormatError(f"{name}: layerbox image without a blob map trailer (truncated or damaged)")
            if self.devices and self.devices[0][1] * self.block_size != self.blob_size:
                raise FormatError(
                    f"{name}: blob map says the blob has {self.blob_size} bytes, "
                    f"the device table {self.devices[0][1]} blocks"
                )
        self._by_block = {r.block: r for r in self.blob_map}

    @classmethod
    def open(cls, path: str | Path) -> ErofsImage:
        p = Path(path)
        try:
            return cls(p.read_bytes(), str(p))
        except OSError as exc:
            raise FormatError(f"{p}: cannot read: {exc.strerror}") from None

    # -- low level -------------------------------------------------------------
    def _bytes(self, offset: int, size: int, what: str) -> bytes:
        if offset < 0 or offset + size > len(self.data):
            raise FormatError(f"{self.name}: {what} at byte {offset} (+{size}) lies outside the image")
        return self.data[offset : offset + size]

    def _read_trailer(self) -> tuple[list[BlobRecord], int, int]:
        if len(self.data) < F.TRAILER_FOOTER.size:
            return [], 0, 0
        magic, version, chunk_bits, offset, count, blob_size, _ = F.TRAILER_FOOTER.unpack_from(
            self.data, len(self.data) - F.TRAILER_FOOTER.size
        )
        if magic != F.TRAILER_MAGIC:
            return [], 0, 0  # not a layerbox image (e.g. from mkfs.erofs)
        if version != F.TRAILER_VERSION:
            raise FormatError(f"{self.name}: blob map version {version} is not supported")
        raw = self._bytes(offset, count * F.BLOB_RECORD.size, "blob map")
        records = [BlobRecord(*F.BLOB_RECORD.unpack_from(raw, i * F.BLOB_RECORD.size)) for i in range(count)]
        return records, chunk_bits, blob_size

    def inode(self, nid: int) -> Inode:
        cached = self._inodes.get(nid)
        if cached is not None:
            return cached
        pos = self.meta_base + nid * F.SLOT_SIZE
        head = self._bytes(pos, 2, f"inode nid {nid}")
        i_format = int.from_bytes(head, "little")
        layout = (i_format >> F.LAYOUT_SHIFT) & 0x7
        if i_format & 1:
            (_f, icount, mode, _nb, size, i_u, ino, uid, gid, mtime, nsec, nlink, _r) = (
                F.INODE_EXTENDED.unpack(self._bytes(pos, F.INODE_EXTENDED.size, f"inode nid {nid}"))
            )
            isize = F.INODE_EXTENDED.size
        else:
            (_f, icount, mode, nlink, size, mtime, i_u, ino, uid, gid, _r2) = _COMPACT.unpack(
                self._bytes(pos, F.INODE_COMPACT_SIZE, f"inode nid {nid}")
            )
            nsec = 0
            mtime = self.build_time if mtime == 0 else self.build_time + mtime
            isize = F.INODE_COMPACT_SIZE
        if mtime >= 1 << 63:
            mtime -= 1 << 64
        if layout not in (F.LAYOUT_FLAT_PLAIN, F.LAYOUT_FLAT_INLINE, F.LAYOUT_CHUNK_BASED):
            raise FormatError(f"{self.name}: inode nid {nid} uses data layout {layout} (compressed), not supported")
        xsize = F.xattr_ibody_size(icount)
        node = Inode(nid, mode, uid, gid, size, mtime, nsec, nlink, ino, layout, i_u,
                     data_offset=pos + isize + xsize)
        if xsize:
            node.xattrs = self._xattrs(nid, pos + isize, xsize)
        self._inodes[nid] = node
        return node

    def _xattr_entry(self, at: int, nid: int) -> tuple[bytes, bytes, int]:
        name_len, index, value_size = F.XATTR_ENTRY.unpack(self._bytes(at, 4, f"xattr of nid {nid}"))
        suffix = self._bytes(at + 4, name_len, f"xattr name of nid {nid}")
        value = self._bytes(at + 4 + name_len, value_size, f"xattr value of nid {nid}")
        prefix = F.XATTR_INDEX_TO_PREFIX.get(index)
        if prefix is None:
            raise FormatError(f"{self.name}: inode nid {nid} has an xattr with unknown prefix index {index}")
        size = 4 + name_len + value_size
        return prefix + suffix, value, size + (-size % 4)

    def _xattrs(self, nid: int, at: int, size: int) -> dict[bytes, bytes]:
        _filter, shared_count, _ = F.XATTR_IBODY_HEADER.unpack(self._bytes(at, 12, f"xattr header of nid {nid}"))
        out: dict[bytes, bytes] = {}
        for i in range(shared_count):
            ident = int.from_bytes(self._bytes(at + 12 + 4 * i, 4, "shared xattr id"), "little")
            name, value, _ = self._xattr_entry(self.xattr_base + ident * 4, nid)
            out[name] = value
        pos = at + 12 + 4 * shared_count
        end = at + size
        while pos < end:
            name, value, step = self._xattr_entry(pos, nid)
            out[name] = value
            pos += step
        return out

    def _flat_data(self, node: Inode) -> bytes:
        bs = self.block_size
        if node.layout == F.LAYOUT_FLAT_PLAIN:
            return self._bytes(node.i_u * bs, node.size, f"data of nid {node.nid}")
        whole = node.size - node.size % bs
        head = self._bytes(node.i_u * bs, whole, f"data of nid {node.nid}") if whole else b""
        tail = self._bytes(node.data_offset, node.size - whole, f"inline data of nid {node.nid}")
        if node.data_offset // bs != (node.data_offset + len(tail) - 1) // bs and tail:
            raise FormatError(f"{self.name}: inline data of nid {node.nid} crosses a block boundary")
        return head + tail

    # -- tree ------------------------------------------------------------------
    def readdir(self, nid: int) -> list[tuple[bytes, int, int]]:
        """(name, nid, file type) of a directory, '.' and '..' included, in on-disk order."""
        node = self.inode(nid)
        if not stat.S_ISDIR(node.mode):
            raise FormatError(f"{self.name}: nid {nid} is not a directory")
        data = self._flat_data(node)
        out: list[tuple[bytes, int, int]] = []
        bs = self.block_size
        for start in range(0, len(data), bs):
            block = data[start : start + bs]
            first_nid, first_off, _, _ = F.DIRENT.unpack_from(block, 0)
            count = first_off // F.DIRENT.size
            if first_off % F.DIRENT.size or count == 0 or first_off > len(block):
                raise FormatError(f"{self.name}: directory nid {nid} block {start // bs} has a bad first name offset")
            for i in range(count):
                child, off, ftype, _ = F.DIRENT.unpack_from(block, i * F.DIRENT.size)
                end = F.DIRENT.unpack_from(block, (i + 1) * F.DIRENT.size)[1] if i + 1 < count else len(block)
                if not first_off <= off < end <= len(block):
                    raise FormatError(f"{self.name}: directory nid {nid} entry {i} has a bad name offset {off}")
                name = block[off:end].rstrip(b"\0") if i + 1 == count else block[off:end]
                out.append((name, child, ftype))
        return out

    def children(self, nid: int) -> list[tuple[bytes, int]]:
        return [(n, c) for n, c, _ in self.readdir(nid) if n not in (b".", b"..")]

    def readlink(self, nid: int) -> bytes:
        node = self.inode(nid)
        if not stat.S_ISLNK(node.mode):
            raise FormatError(f"{self.name}: nid {nid} is not a symlink")
        return self._flat_data(node)

    def lookup(self, path: str | bytes) -> int:
        """nid of ``path`` (absolute or relative to the root); symlinks are not followed."""
        raw = path.encode("utf-8", "surrogateescape") if isinstance(path, str) else path
        nid = self.root_nid
        for comp in raw.split(b"/"):
            if comp in (b"", b"."):
                continue
            for name, child in self.children(nid):
                if name == comp:
                    nid = child
                    break
            else:
                raise FileNotFoundError(f"{self.name}: no {raw.decode('utf-8', 'replace')!r} in the image")
        return nid

    def walk(self, top: str | bytes = b"/") -> Iterator[tuple[bytes, Inode]]:
        """(absolute path, inode) depth first in name order, ``top`` first."""
        raw = top.encode("utf-8", "surrogateescape") if isinstance(top, str) else top
        start = self.lookup(raw)
        prefix = b"/" + b"/".join(c for c in raw.split(b"/") if c not in (b"", b"."))
        stack = [(prefix, start)]
        visited_dirs: set[int] = set()
        while stack:
            path, nid = stack.pop()
            node = self.inode(nid)
            yield path, node
            if stat.S_ISDIR(node.mode):
                if nid in visited_dirs:
                    raise FormatError(f"{self.name}: directory loop at nid {nid}")
                visited_dirs.add(nid)
                base = path.rstrip(b"/")
                for name, child in sorted(self.children(nid), reverse=True):
                    stack.append((base + b"/" + name, child))

    # -- data mapping --------------------------------------------------------------
    def chunks(self, nid: int) -> list[ChunkRef]:
        """The chunks of a regular file, in file order, with digests from the blob map."""
        node = self.inode(nid)
        if not stat.S_ISREG(node.mode):
            raise FormatError(f"{self.name}: nid {nid} is not a regular file")
        if node.size == 0:
            return []
        if node.layout != F.LAYOUT_CHUNK_BASED:
            return [ChunkRef(0, node.size, 0, node.i_u, None)]
        chunk_bits = self.block_bits + (node.i_u & F.CHUNK_FORMAT_BLKBITS_MASK)
        csize = 1 << chunk_bits
        count = (node.size + csize - 1) >> chunk_bits
        out = []
        if node.i_u & F.CHUNK_FORMAT_INDEXES:
            at = node.data_offset + (-node.data_offset % F.CHUNK_INDEX.size)
            raw = self._bytes(at, count * F.CHUNK_INDEX.size, f"chunk indexes of nid {nid}")
            for i in range(count):
                hi, device, lo = F.CHUNK_INDEX.unpack_from(raw, i * F.CHUNK_INDEX.size)
                block = F.NULL_ADDR if lo == F.NULL_ADDR else (hi << 32) | lo
                length = min(csize, node.size - i * csize)
                rec = self._by_block.get(block) if device == 1 else None
                out.append(ChunkRef(i * csize, length, device, block, rec.digest if rec else None))
        else:
            at = node.data_offset + (-node.data_offset % 4)
            raw = self._bytes(at, count * 4, f"block map of nid {nid}")
            for i in range(count):
                block = int.from_bytes(raw[4 * i : 4 * i + 4], "little")
                out.append(ChunkRef(i * csize, min(csize, node.size - i * csize), 0, block, None))
        return out
