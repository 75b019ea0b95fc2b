"""The metadata reader on images it did not write: mkfs.erofs output (compact inodes,
shared xattrs, block-map or index chunks) must read back as the source tree."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from layerstore.erofs.reader import ErofsImage
from layerstore.errors import FormatError
from tests.support.erofs_tools import mkfs_erofs


def _source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "d" / "sub").mkdir(parents=True)
    (src / "d" / "file").write_bytes(os.urandom(3 * 4096 + 5))
    (src / "empty").write_bytes(b"")
    os.symlink("d/file", src / "link")
    for i in range(300):
        (src / "d" / "sub" / f"n{i:03}").write_bytes(str(i).encode())
    os.setxattr(src / "d" / "file", "user.colour", b"blue")
    return src


def test_reads_mkfs_erofs_images(tmp_path: Path) -> None:
    src = _source(tmp_path)
    meta, blob = tmp_path / "m.erofs", tmp_path / "b.blob"
    mkfs_erofs(src, meta, blob, 4096)
    image = ErofsImage.open(meta)
    seen = {}
    for path, node in image.walk():
        seen[path] = node
    expected = {b"/"} | {b"/" + os.path.relpath(os.path.join(d, n), src).encode()
                         for d, dirs, files in os.walk(src) for n in dirs + files}
    assert set(seen) == expected
    for path, node in seen.items():
        st = os.lstat(src / path.decode().lstrip("/")) if path != b"/" else os.lstat(src)
        assert node.mode == st.st_mode, path
        if stat.S_ISREG(st.st_mode):
            assert node.size == st.st_size
    assert image.readlink(image.lookup("link")) == b"d/file"
    assert image.inode(image.lookup("d/file")).xattrs == {b"user.colour": b"blue"}
    chunks = image.chunks(image.lookup("d/file"))
    assert [c.length for c in chunks] == [4096, 4096, 4096, 5]
    data = blob.read_bytes()
    content = (src / "d" / "file").read_bytes()
    for c in chunks:
        assert data[c.block * 4096 : c.block * 4096 + c.length] == content[c.file_offset : c.file_offset + c.length]


def test_rejects_garbage_with_a_named_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.erofs"
    bad.write_bytes(os.urandom(8192))
    with pytest.raises(FormatError, match="bad EROFS magic"):
        ErofsImage.open(bad)
    bad.write_bytes(b"short")
    with pytest.raises(FormatError, match="too short"):
        ErofsImage.open(bad)


def test_truncated_image_is_reported_not_misread(tmp_path: Path) -> None:
    src = _source(tmp_path)
    meta, blob = tmp_path / "m.erofs", tmp_path / "b.blob"
    mkfs_erofs(src, meta, blob, 4096)
    data = meta.read_bytes()
    image = ErofsImage(data[: 4096 + 200], "cut.erofs")  # superblock intact, inodes cut
    with pytest.raises(FormatError, match="cut.erofs"):
        list(image.walk())
