"""The EROFS on-disk structures layerbox writes and reads.

Only the subset layerbox produces is described here (docs/FORMAT.md gives the
byte tables): a 4 KiB-block image with extended (64-byte) inodes, inline
xattrs, plain or tail-packed directories and symlinks, chunk-based regular
files whose chunk indexes point into one extra device (the layer blob), and a
layerbox trailer holding the blob map.  Every layout is a ``struct.Struct``
whose size is checked at import so a typo cannot silently shift a field.
"""

from __future__ import annotations

import struct

EROFS_MAGIC = 0xE0F5E1E2
SUPER_OFFSET = 1024
BLOCK_BITS = 12
BLOCK_SIZE = 1 << BLOCK_BITS
SLOT_SIZE = 32  # nids count 32-byte slots from the start of the metadata area
NULL_ADDR = 0xFFFFFFFF  # chunk index startblk_lo meaning "hole, reads as zeros"

# feature_incompat bits we set
INCOMPAT_CHUNKED_FILE = 0x0004
INCOMPAT_DEVICE_TABLE = 0x0008
# bits a reader of our images accepts; anything else is refused rather than misread
SUPPORTED_INCOMPAT = INCOMPAT_CHUNKED_FILE | INCOMPAT_DEVICE_TABLE

# i_format: bit 0 = extended inode, bits 1..3 = data layout
FORMAT_EXTENDED = 1
LAYOUT_FLAT_PLAIN = 0
LAYOUT_FLAT_INLINE = 2
LAYOUT_CHUNK_BASED = 4
LAYOUT_SHIFT = 1

# chunk format word stored in i_u of a chunk-based inode
CHUNK_FORMAT_BLKBITS_MASK = 0x001F
CHUNK_FORMAT_INDEXES = 0x0020

# directory entry file types
FT_UNKNOWN = 0
FT_REG_FILE = 1
FT_DIR = 2
FT_CHRDEV = 3
FT_BLKDEV = 4
FT_FIFO = 5
FT_SOCK = 6
FT_SYMLINK = 7

# xattr name indexes: the prefix is stored as a number, the rest as bytes
XATTR_PREFIXES: tuple[tuple[int, bytes], ...] = (
    # longest match first: system.posix_acl_* must win over nothing (there is no "system." index)
    (2, b"system.posix_acl_access"),
    (3, b"system.posix_acl_default"),
    (1, b"user."),
    (4, b"trusted."),
    (6, b"security."),
)
XATTR_INDEX_TO_PREFIX = {index: prefix for index, prefix in XATTR_PREFIXES}

# superblock, 128 bytes at byte 1024
SUPERBLOCK = struct.Struct(
    "<I"  # magic
    "I"  # checksum (unused: feature_compat has no SB_CHKSUM)
    "I"  # feature_compat
    "B"  # blkszbits
    "B"  # sb_extslots
    "H"  # root_nid
    "Q"  # inos
    "Q"  # build_time
    "I"  # build_time_nsec
    "I"  # blocks
    "I"  # meta_blkaddr
    "I"  # xattr_blkaddr
    "16s"  # uuid
    "16s"  # volume_name
    "I"  # feature_incompat
    "H"  # available_compr_algs
    "H"  # extra_devices
    "H"  # devt_slotoff
    "B"  # dirblkbits
    "B"  # xattr_prefix_count
    "I"  # xattr_prefix_start
    "Q"  # packed_nid
    "B"  # xattr_filter_reserved
    "23s"  # reserved
)
assert SUPERBLOCK.size == 128

# extended inode, 64 bytes
INODE_EXTENDED = struct.Struct(
    "<H"  # i_format
    "H"  # i_xattr_icount
    "H"  # i_mode
    "H"  # i_nb (reserved, 0)
    "Q"  # i_size
    "I"  # i_u: raw_blkaddr | rdev | chunk format
    "I"  # i_ino
    "I"  # i_uid
    "I"  # i_gid
    "Q"  # i_mtime (seconds)
    "I"  # i_mtime_nsec
    "I"  # i_nlink
    "16s"  # reserved
)
assert INODE_EXTENDED.size == 64
INODE_COMPACT_SIZE = 32

# inline xattr body header, then (icount - 1) * 4 - 12 bytes of entries
XATTR_IBODY_HEADER = struct.Struct("<IB7s")
assert XATTR_IBODY_HEADER.size == 12
XATTR_ENTRY = struct.Struct("<BBH")  # name_len, name_index, value_size; then name, value
assert XATTR_ENTRY.size == 4

CHUNK_INDEX = struct.Struct("<HHI")  # startblk_hi, device_id, startblk_lo
assert CHUNK_INDEX.size == 8

DIRENT = struct.Struct("<QHBB")  # nid, nameoff, file_type, reserved
assert DIRENT.size == 12

DEVICE_SLOT = struct.Struct("<64sII56s")  # tag, blocks, mapped_blkaddr, reserved
assert DEVICE_SLOT.size == 128

# ---- the layerbox trailer: the blob map, after all EROFS metadata ----------
#
# The kernel never reads past what inodes reference, so the image can carry the
# blob map itself: the layer digest (blake3 of the metadata image) then commits
# to every chunk digest, and one object describes the whole layer.

TRAILER_MAGIC = b"LBXBMAP1"
TRAILER_VERSION = 1
# footer: the last 64 bytes of the image
TRAILER_FOOTER = struct.Struct(
    "<8s"  # magic
    "I"  # version
    "I"  # chunk_size_bits (the EROFS chunk size of regular files)
    "Q"  # blob map offset (bytes from image start, block aligned)
    "Q"  # number of blob map records
    "Q"  # blob size in bytes (block aligned)
    "24s"  # reserved, zero
)
assert TRAILER_FOOTER.size == 64
BLOB_RECORD = struct.Struct(
    "<32s"  # blake3 digest of the chunk's bytes (uncompressed, without padding)
    "I"  # start block in the blob
    "I"  # length in bytes
)
assert BLOB_RECORD.size == 40

MAX_NAME = 255


def blocks_for(size: int) -> int:
    return (size + BLOCK_SIZE - 1) >> BLOCK_BITS


def xattr_ibody_size(icount: int) -> int:
    return 0 if icount == 0 else XATTR_IBODY_HEADER.size + (icount - 1) * 4


def encode_rdev(major: int, minor: int) -> int:
    """Linux new_encode_dev: what the kernel decodes from i_u for device inodes."""
    return (minor & 0xFF) | ((major & 0xFFF) << 8) | ((minor & ~0xFF) << 12)


def decode_rdev(value: int) -> tuple[int, int]:
    major = (value & 0xFFF00) >> 8
    minor = (value & 0xFF) | ((value >> 12) & 0xFFF00)
    return major, minor


def split_xattr_name(name: bytes) -> tuple[int, bytes] | None:
    """(name index, suffix) for a full xattr name, or None if EROFS cannot store it."""
    for index, prefix in XATTR_PREFIXES:
        if index in (2, 3):
            if name == prefix:
                return index, b""
        elif name.startswith(prefix) and len(name) > len(prefix):
            return index, name[len(prefix) :]
    return None
