"""Compare two directory trees the way a faithful layer must reproduce one.

Walks both trees with bytes paths (names need not be UTF-8) and never follows
symlinks.  Compared per entry: presence, file type, full ``st_mode``
(including setuid/setgid/sticky), uid, gid, mtime in ns (optional), every
xattr (``trusted.*`` and ``security.*`` too), size and content of regular
files, symlink targets, ``st_rdev`` of devices, and hard-link identity (which
regular files share an inode).  Directories' ``st_size`` and ``st_nlink`` are
filesystem artefacts and are not compared.

Content is compared block by block (1 MiB), never loaded whole; ranges that
``SEEK_DATA`` reports as holes are not read at all, so multi-GiB sparse files
cost little on filesystems that report holes.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

_BLOCK = 1 << 20
_ZEROS = bytes(_BLOCK)
_MAX_REPORTED = 50

_TYPE_NAMES = {
    stat.S_IFDIR: "directory",
    stat.S_IFREG: "regular file",
    stat.S_IFLNK: "symlink",
    stat.S_IFCHR: "char device",
    stat.S_IFBLK: "block device",
    stat.S_IFIFO: "fifo",
    stat.S_IFSOCK: "socket",
}

Ignore = Callable[[bytes], bool]


def _show(rel: bytes) -> str:
    return "/" + rel.decode("utf-8", "backslashreplace")


def _join(root: bytes, rel: bytes) -> bytes:
    return root + b"/" + rel if rel else root


def _scan(root: bytes, ignore: Ignore | None) -> dict[bytes, os.stat_result]:
    """lstat of every entry, keyed by path relative to root (root itself is b"")."""
    entries = {b"": os.lstat(root)}
    pending = [b""] if stat.S_ISDIR(entries[b""].st_mode) else []
    while pending:
        rel = pending.pop()
        with os.scandir(_join(root, rel)) as it:
            for entry in it:
                child = rel + b"/" + entry.name if rel else entry.name
                if ignore is not None and ignore(child):
                    continue
                st = entry.stat(follow_symlinks=False)
                entries[child] = st
                if stat.S_ISDIR(st.st_mode):
                    pending.append(child)
    return entries


def _xattrs(path: bytes) -> dict[str, bytes]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return {}
        raise
    values: dict[str, bytes] = {}
    for name in names:
        try:
            values[name] = os.getxattr(path, name, follow_symlinks=False)
        except OSError as exc:
            if exc.errno != errno.ENODATA:  # removed between list and get
                raise
    return values


def _short(value: bytes) -> str:
    return repr(value if len(value) <= 64 else value[:64] + b"...")


def _compare_xattrs(where: str, exp_path: bytes, act_path: bytes) -> list[str]:
    exp, act = _xattrs(exp_path), _xattrs(act_path)
    diffs = []
    for name in sorted(exp.keys() | act.keys()):
        if name not in act:
            diffs.append(f"{where}: xattr {name} missing (expected {_short(exp[name])})")
        elif name not in exp:
            diffs.append(f"{where}: unexpected xattr {name} = {_short(act[name])}")
        elif exp[name] != act[name]:
            diffs.append(f"{where}: xattr {name} expected {_short(exp[name])}, "
                         f"actual {_short(act[name])}")
    return diffs


def _next_data(fd: int, offset: int, size: int) -> int:
    """First data offset at or after ``offset``; ``size`` if only a hole remains."""
    try:
        return min(os.lseek(fd, offset, os.SEEK_DATA), size)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            return size
        return offset  # no SEEK_DATA support: treat everything as data


def _read_exact(fd: int, offset: int, length: int) -> bytes:
    chunks = []
    while length > 0:
        chunk = os.pread(fd, length, offset)
        if not chunk:
            break  # file shrank under us; the comparison will show it
        chunks.append(chunk)
        offset += len(chunk)
        length -= len(chunk)
    return b"".join(chunks)


def _first_mismatch(a: bytes, b: bytes) -> int:
    # Bisect with slice comparisons (memcmp) instead of a per-byte Python loop.
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] != b[lo:mid]:
            hi = mid
        else:
            lo = mid
    return lo


def _content_mismatch(exp_path: bytes, act_path: bytes, size: int) -> int | None:
    """Offset of the first differing byte of two files of length ``size``, or None."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd_e = os.open(exp_path, flags)
    try:
        fd_a = os.open(act_path, flags)
        try:
            return _scan_blocks(fd_e, fd_a, size)
        finally:
            os.close(fd_a)
    finally:
        os.close(fd_e)


def _scan_blocks(fd_e: int, fd_a: int, size: int) -> int | None:
    offset = 0
    data_e = data_a = -1  # next data offset on each side, refreshed lazily
    while offset < size:
        if data_e < offset:
            data_e = _next_data(fd_e, offset, size)
        if data_a < offset:
            data_a = _next_data(fd_a, offset, size)
        if data_e > offset and data_a > offset:
            offset = min(data_e, data_a)  # both sides are holes here: nothing to read
            continue
        length = min(_BLOCK, size - offset)
        # A side whose whole block is a hole reads as zeros without I/O.
        block_e = (_ZEROS[:length] if data_e >= offset + length
                   else _read_exact(fd_e, offset, length))
        block_a = (_ZEROS[:length] if data_a >= offset + length
                   else _read_exact(fd_a, offset, length))
        if block_e != block_a:
            return offset + _first_mismatch(block_e, block_a)
        offset += length
    return None


def _mode_text(mode: int) -> str:
    return f"{stat.S_IMODE(mode):#o} ({stat.filemode(mode)})"


def _compare_entry(
    rel: bytes,
    exp_root: bytes,
    act_root: bytes,
    exp: os.stat_result,
    act: os.stat_result,
    *,
    check_mtime: bool,
    check_meta: bool,
) -> list[str]:
    where = _show(rel)
    exp_type, act_type = stat.S_IFMT(exp.st_mode), stat.S_IFMT(act.st_mode)
    if exp_type != act_type:
        return [f"{where}: type expected {_TYPE_NAMES.get(exp_type, hex(exp_type))}, "
                f"actual {_TYPE_NAMES.get(act_type, hex(act_type))}"]
    exp_path, act_path = _join(exp_root, rel), _join(act_root, rel)
    diffs = []
    if check_meta:
        if exp.st_mode != act.st_mode:
            diffs.append(f"{where}: mode expected {_mode_text(exp.st_mode)}, "
                         f"actual {_mode_text(act.st_mode)}")
        if exp.st_uid != act.st_uid:
            diffs.append(f"{where}: uid expected {exp.st_uid}, actual {act.st_uid}")
        if exp.st_gid != act.st_gid:
            diffs.append(f"{where}: gid expected {exp.st_gid}, actual {act.st_gid}")
        if check_mtime and exp.st_mtime_ns != act.st_mtime_ns:
            diffs.append(f"{where}: mtime expected {exp.st_mtime_ns} ns, "
                         f"actual {act.st_mtime_ns} ns")
        diffs += _compare_xattrs(where, exp_path, act_path)
    if exp_type == stat.S_IFDIR:
        return diffs
    if exp.st_size != act.st_size:
        diffs.append(f"{where}: size expected {exp.st_size}, actual {act.st_size}")
    elif exp_type == stat.S_IFREG:
        offset = _content_mismatch(exp_path, act_path, exp.st_size)
        if offset is not None:
            diffs.append(f"{where}: content differs from byte {offset} (size {exp.st_size})")
    if exp_type == stat.S_IFLNK:
        exp_target, act_target = os.readlink(exp_path), os.readlink(act_path)
        if exp_target != act_target:
            diffs.append(f"{where}: symlink target expected {exp_target!r}, "
                         f"actual {act_target!r}")
    if exp_type in (stat.S_IFCHR, stat.S_IFBLK) and exp.st_rdev != act.st_rdev:
        diffs.append(
            f"{where}: device expected {os.major(exp.st_rdev)}:{os.minor(exp.st_rdev)}, "
            f"actual {os.major(act.st_rdev)}:{os.minor(act.st_rdev)}"
        )
    return diffs


def _link_groups(entries: dict[bytes, os.stat_result]) -> dict[bytes, frozenset[bytes]]:
    """For each regular file, the set of paths in the tree that share its inode."""
    by_inode: dict[tuple[int, int], set[bytes]] = {}
    for rel, st in entries.items():
        if stat.S_ISREG(st.st_mode):
            by_inode.setdefault((st.st_dev, st.st_ino), set()).add(rel)
    return {rel: frozenset(group) for group in by_inode.values() for rel in group}


def _compare_links(
    common: list[bytes],
    exp_entries: dict[bytes, os.stat_result],
    act_entries: dict[bytes, os.stat_result],
) -> list[str]:
    exp_groups, act_groups = _link_groups(exp_entries), _link_groups(act_entries)
    diffs, seen = [], set()
    for rel in common:
        if rel not in exp_groups or rel not in act_groups:
            continue
        exp_group, act_group = exp_groups[rel], act_groups[rel]
        if exp_group == act_group or (exp_group, act_group) in seen:
            continue
        seen.add((exp_group, act_group))

        def names(group: frozenset[bytes], rel: bytes = rel) -> str:
            others = sorted(_show(p) for p in group if p != rel)
            return "[" + ", ".join(others) + "]" if others else "nothing"

        diffs.append(f"{_show(rel)}: hard links differ: expected linked with "
                     f"{names(exp_group)}, actual linked with {names(act_group)}")
    return diffs


def _presence(
    exp_entries: dict[bytes, os.stat_result], act_entries: dict[bytes, os.stat_result]
) -> list[str]:
    """Missing and extra entries, reporting a missing subtree once, at its top."""
    diffs = []
    for label, have, lack in (("missing", exp_entries, act_entries),
                              ("unexpected", act_entries, exp_entries)):
        absent = have.keys() - lack.keys()
        for rel in sorted(absent):
            parent = rel.rpartition(b"/")[0]
            if b"/" in rel and parent in absent:
                continue
            kind = _TYPE_NAMES.get(stat.S_IFMT(have[rel].st_mode), "entry")
            diffs.append(f"{_show(rel)}: {label} {kind}")
    return diffs


def compare_trees(
    expected: Path,
    actual: Path,
    *,
    check_mtime: bool = True,
    check_root_meta: bool = True,
    ignore: Ignore | None = None,
) -> list[str]:
    """Differences between two trees, one human-readable line each; [] when equal.

    ``ignore`` receives each entry's path relative to the root as bytes
    (``b"dir/name"``) and drops that entry, and a directory's whole subtree,
    from both sides.  ``check_root_meta=False`` skips the root directory's own
    mode, owner, mtime and xattrs (a mount point's root often differs).
    """
    exp_root, act_root = os.fsencode(expected), os.fsencode(actual)
    exp_entries, act_entries = _scan(exp_root, ignore), _scan(act_root, ignore)
    diffs = _presence(exp_entries, act_entries)
    common = sorted(exp_entries.keys() & act_entries.keys())
    for rel in common:
        diffs += _compare_entry(
            rel, exp_root, act_root, exp_entries[rel], act_entries[rel],
            check_mtime=check_mtime, check_meta=bool(rel) or check_root_meta,
        )
    diffs += _compare_links(common, exp_entries, act_entries)
    return diffs


def assert_trees_equal(
    expected: Path,
    actual: Path,
    *,
    check_mtime: bool = True,
    check_root_meta: bool = True,
    ignore: Ignore | None = None,
) -> None:
    """Raise AssertionError listing the first differences between the trees."""
    diffs = compare_trees(expected, actual, check_mtime=check_mtime,
                          check_root_meta=check_root_meta, ignore=ignore)
    if not diffs:
        return
    shown = "\n  ".join(diffs[:_MAX_REPORTED])
    more = f"\n  ... and {len(diffs) - _MAX_REPORTED} more" if len(diffs) > _MAX_REPORTED else ""
    raise AssertionError(
        f"{len(diffs)} difference(s) between {expected} (expected) and {actual} (actual):"
        f"\n  {shown}{more}"
    )
