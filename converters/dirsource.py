"""Read a directory tree as archive entries, without following symlinks.

Directories are taken literally: names are not interpreted as OCI whiteouts
(an overlayfs upper directory already holds kernel-style whiteouts, which are
character devices 0/0 and pass through as such).

A regular file with fewer allocated blocks than its size is read region by
region as ``SEEK_DATA``/``SEEK_HOLE`` report them: a hole goes on as a
``Hole`` marker and is never read, so a sparse file costs what it stores, not
its size (a checkpoint reads changed files while the sandbox is frozen).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterator

from converters.errors import ConvertError
from converters.tarstream import (
    KIND_BLK,
    KIND_CHR,
    KIND_DIR,
    KIND_FIFO,
    KIND_HARDLINK,
    KIND_REG,
    KIND_SOCK,
    KIND_SYMLINK,
    READ_SIZE,
    DataFn,
    Entry,
    Hole,
)


def _kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISREG, KIND_REG), (stat.S_ISDIR, KIND_DIR), (stat.S_ISLNK, KIND_SYMLINK),
        (stat.S_ISCHR, KIND_CHR), (stat.S_ISBLK, KIND_BLK), (stat.S_ISFIFO, KIND_FIFO),
        (stat.S_ISSOCK, KIND_SOCK),
    ):
        if test(mode):
            return kind
    raise ConvertError(f"unknown file type {oct(mode)}")


def _xattrs(path: bytes) -> dict[bytes, bytes]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return {}
    out = {}
    for name in names:
        try:
            out[os.fsencode(name)] = os.getxattr(path, name, follow_symlinks=False)
        except OSError:
            continue  # vanished between list and get
    return out


def _next_data(fd: int, pos: int, size: int) -> tuple[int, int]:
    """The next data region [start, end) at or after ``pos``, clipped to ``size``; (size, size) if none.

    What ``SEEK_DATA`` calls data may still hold zeros (add_file finds those);
    what it calls a hole reads as zeros and is never read.
    """
    try:
        start = os.lseek(fd, pos, os.SEEK_DATA)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # no data past pos (or the file shrank below it: read() checks)
            return size, size
        if exc.errno == errno.EINVAL:  # the file system cannot tell: read the rest like a dense file
            return pos, size
        raise
    if start >= size:
        return size, size
    try:
        end = os.lseek(fd, start, os.SEEK_HOLE)
    except OSError as exc:
        if exc.errno != errno.ENXIO:
            raise
        end = size  # shrank between the two calls: reading finds out
    if start < pos or end <= start:
        return pos, size  # answers no file system should give; never loop on them
    return start, min(end, size)


def _reader(path: bytes, size: int, sparse: bool) -> DataFn:
    """``sparse``: the file may have holes; without it the file is read straight through."""

    def read() -> Iterator[bytes | Hole]:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            pos = data_end = 0
            while pos < size:
                start, end = _next_data(fd, pos, size) if sparse else (pos, size)
                if start > pos:
                    yield Hole(start - pos)
                pos = start
                while pos < end:
                    block = os.pread(fd, min(READ_SIZE, end - pos), pos)
                    if not block:
                        raise _shrank(path)
                    pos += len(block)
                    yield block
                if end > start:
                    data_end = end
            # a hole is not read, so a file that shrank over its tail shows only in its size
            if data_end < size and os.fstat(fd).st_size < size:
                raise _shrank(path)
        finally:
            os.close(fd)

    return read


def _shrank(path: bytes) -> ConvertError:
    return ConvertError(f"{os.fsdecode(path)}: shrank while being read; retry on a quiet tree")


def walk_directory(
    root: str | os.PathLike[str],
    include: Callable[[tuple[bytes, ...], bool], bool] | None = None,
) -> Iterator[tuple[Entry, DataFn | None]]:
    """Entries of the tree under ``root``, parents first.

    ``include(path, is_dir)``, when given, selects entries; a directory it
    refuses is not descended into (snapshots select what changed).
    """
    base = os.fsencode(root)
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode):
        raise ConvertError(f"{os.fsdecode(base)}: not a directory")
    seen: dict[tuple[int, int], tuple[bytes, ...]] = {}
    stack: list[tuple[bytes, ...]] = [()]
    while stack:
        rel = stack.pop()
        full = os.path.join(base, *rel) if rel else base
        st = os.lstat(full)
        if rel and include is not None and not include(rel, stat.S_ISDIR(st.st_mode)):
            continue
        kind = _kind(st.st_mode)
        name = os.fsdecode(b"/".join(rel) or b".")
        entry = Entry(
            path=rel, kind=kind, mode=st.st_mode, uid=st.st_uid, gid=st.st_gid,
            mtime=st.st_mtime_ns // 1_000_000_000, mtime_nsec=st.st_mtime_ns % 1_000_000_000,
            xattrs=_xattrs(full), name=name,
        )
        data: DataFn | None = None
        if kind != KIND_DIR and st.st_nlink > 1:
            key = (st.st_dev, st.st_ino)
            if key in seen:
                entry.kind, entry.link_path, entry.xattrs = KIND_HARDLINK, seen[key], {}
                yield entry, None
                continue
            seen[key] = rel
        if kind == KIND_REG:
            entry.size = st.st_size
            # two lseeks per file add about a quarter to the walk of a tree of small files; a file
            # whose allocated blocks cover its size has no holes worth finding (at worst, blocks
            # preallocated past its end hide one, which is then read as zeros)
            data = _reader(full, st.st_size, st.st_blocks * 512 < st.st_size)
        elif kind == KIND_SYMLINK:
            entry.link = os.readlink(full)
        elif kind in (KIND_CHR, KIND_BLK):
            entry.rdev = (os.major(st.st_rdev), os.minor(st.st_rdev))
        yield entry, data
        if kind == KIND_DIR:
            names = sorted(os.listdir(full), reverse=True)
            stack.extend(rel + (n,) for n in names)
