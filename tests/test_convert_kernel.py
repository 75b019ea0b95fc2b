"""Layers from the converter, checked by independent parts: fsck.erofs and the kernel.

The oracle for "the mounted tree equals the source" is GNU tar extracting the
same archive as root (or the source directory itself), compared field by
field with tests/support/treecmp.py.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from converters.layer import LayerResult, convert, convert_directory
from tests.support.erofs_tools import fsck_erofs
from tests.support.proc import run
from tests.support.tarbuild import TarBuilder
from tests.support.treecmp import assert_trees_equal

pytestmark = pytest.mark.usefixtures("need_root")

CAP_NET_BIND = struct.pack("<IIIII", 0x02000001, 1 << 10, 0, 0, 0)


def gnu_extract(tar: Path, dest: Path) -> Path:
    dest.mkdir()
    run(["tar", "--xattrs", "--xattrs-include=*", "--numeric-owner", "-xpf", str(tar), "-C", str(dest)],
        timeout=600)
    return dest


def convert_and_mount(mounts, tmp_path: Path, src: Path, chunk_size: int = 1 << 20,
                      name: str = "layer") -> tuple[Path, LayerResult]:
    meta, blob = tmp_path / f"{name}.erofs", tmp_path / f"{name}.blob"
    result = convert(str(src), meta, blob, chunk_size=chunk_size)
    fsck_erofs(meta, blob)
    return mounts.erofs(meta, blob), result


def test_every_entry_type_roundtrips(mounts, tmp_path: Path) -> None:
    t = TarBuilder()
    t.dir(".", mode=0o755, mtime=1_650_000_000)
    t.dir("dirs", mode=0o750, uid=1000, gid=1000, pax={"mtime": "1650000000.5"})
    t.dir("dirs/sticky", mode=0o1777)
    t.dir("dirs/setgid", mode=0o2775, gid=50)
    t.file("files/plain", b"hello\n", pax={"mtime": "1650000001.123456789"})
    t.file("files/empty", b"")
    t.file("files/setuid", b"#!/bin/sh\n", mode=0o4755)
    t.file("files/setgid", b"x", mode=0o2711)
    t.file("files/big-ids", b"ids", uid=100_000, gid=200_000)
    t.file("files/caps", b"\x7fELF", mode=0o755,
           xattrs={"security.capability": CAP_NET_BIND, "user.note": "hello", "trusted.t": "v"})
    t.file("files/binary-xattr", b"b", xattrs={"user.bin": bytes(range(256))})
    t.symlink("links/rel", "../files/plain")
    t.symlink("links/abs", "/etc/passwd")
    t.symlink("links/dangling", "nowhere/at/all")
    t.symlink("links/long", "t" * 300)
    t.file("links/hard1", b"shared inode")
    t.hardlink("links/hard2", "links/hard1")
    t.hardlink("links/hard3", "links/hard1")
    t.device("dev/null", "c", 1, 3, mode=0o666)
    t.device("dev/big-minor", "c", 4, 300)
    t.device("dev/loop0", "b", 7, 0, mode=0o660, gid=6)
    t.fifo("dev/fifo", mode=0o600)
    t.file("names/" + "n" * 200, b"long name")
    t.file("names/" + "/".join(["deep"] * 40) + "/leaf", b"long path")
    t.file(b"names/caf\xe9-latin1", b"not utf-8")
    t.file("names/日本語", b"utf-8")
    t.symlink(b"names/bad-target", b"\xff\xfe")
    tar = t.write(tmp_path / "all.tar")
    mnt, result = convert_and_mount(mounts, tmp_path, tar)
    assert_trees_equal(gnu_extract(tar, tmp_path / "expected"), mnt)
    assert os.lstat(mnt / "links/hard1").st_nlink == 3
    assert os.getxattr(mnt / "files/caps", "security.capability") == CAP_NET_BIND
    inodes = {os.lstat(mnt).st_ino} | {p.lstat().st_ino for p in mnt.rglob("*")}
    assert result.files == len(inodes)  # hard links count once


def test_unsearchable_directory(mounts, tmp_path: Path) -> None:
    t = TarBuilder()
    t.dir("locked", mode=0o600, mtime=1_234_567_890, uid=7)
    t.file("locked/inner", b"i")
    tar = t.write(tmp_path / "locked.tar")
    mnt, _ = convert_and_mount(mounts, tmp_path, tar)
    st_ = os.lstat(mnt / "locked")
    assert (stat.S_IMODE(st_.st_mode), st_.st_mtime_ns, st_.st_uid) == (0o600, 1_234_567_890 * 10**9, 7)
    assert (mnt / "locked/inner").read_bytes() == b"i"  # root ignores the missing x bit


def test_gnu_long_names_and_links(mounts, tmp_path: Path) -> None:
    t = TarBuilder(tarfile.GNU_FORMAT)
    t.dir(".")
    t.file("g/" + "x" * 180, b"gnu longname")
    t.symlink("g/longlink", "y" * 250)
    t.file(b"g/\xff\xfe-raw", b"raw bytes name")
    t.file("g/target", b"t")
    t.hardlink("g/" + "h" * 150, "g/target")
    tar = t.write(tmp_path / "gnu.tar")
    mnt, _ = convert_and_mount(mounts, tmp_path, tar)
    assert_trees_equal(gnu_extract(tar, tmp_path / "expected"), mnt)


@pytest.mark.parametrize("chunk_size", [4096, 64 << 10])
def test_chunk_boundaries(mounts, tmp_path: Path, chunk_size: int) -> None:
    cs = chunk_size
    t = TarBuilder()
    t.dir(".")
    for size in (0, 1, 4095, 4096, 4097, cs - 1, cs, cs + 1, 2 * cs, 3 * cs + 17):
        t.file(f"size-{size}", os.urandom(size))
    block = os.urandom(cs)
    t.file("repeated", block * 3 + block[:100])  # one chunk stored once, referenced 4 times
    t.file("hole-in-middle", os.urandom(cs) + bytes(cs) + os.urandom(10))
    t.file("zeros-partial", bytes(cs + 5))
    tar = t.write(tmp_path / "sizes.tar")
    mnt, result = convert_and_mount(mounts, tmp_path, tar, chunk_size=cs)
    assert_trees_equal(gnu_extract(tar, tmp_path / "expected"), mnt)
    assert result.unique_chunks < result.chunks


@pytest.mark.slow
@pytest.mark.parametrize("tar_format", ["gnu", "posix"])  # old GNU sparse headers and PAX sparse 1.0
def test_multi_gib_sparse_file(mounts, tmp_path: Path, tar_format: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    size = 3 << 30
    with open(src / "sparse", "wb") as f:
        f.truncate(size)
        for at in (0, 1 << 30, size - 4096):
            f.seek(at)
            f.write(os.urandom(4096))
    (src / "small").write_bytes(b"x")
    for p in (src, src / "sparse", src / "small"):
        os.utime(p, ns=(0, 1_700_000_000 * 10**9))  # the gnu format keeps whole seconds only
    tar = tmp_path / "sparse.tar"
    run(["tar", "--sparse", f"--format={tar_format}", "-cf", str(tar), "-C", str(src), "."], timeout=600)
    assert tar.stat().st_size < 10 << 20  # the archive itself is sparse (GNU sparse entries)
    mnt, result = convert_and_mount(mounts, tmp_path, tar)
    assert result.bytes == size + 1
    assert result.unique_bytes <= 3 * (1 << 20) + 1
    assert (tmp_path / "layer.blob").stat().st_size <= 4 * (1 << 20)
    assert_trees_equal(src, mnt)


@pytest.mark.slow
def test_thirty_thousand_small_files(mounts, tmp_path: Path) -> None:
    # 30 directories of 1,000: 100,000 files took a minute of the suite's 20-minute budget
    t = TarBuilder()
    t.dir(".")
    for d in range(30):
        t.dir(f"d{d:03}")
        for i in range(1000):
            # a tenth of the files share content, to exercise dedup at scale
            data = b"common\n" if i % 10 == 0 else f"{d}/{i}\n".encode()
            t.file(f"d{d:03}/file-{i:04}.txt", data)
    tar = t.write(tmp_path / "many.tar")
    mnt, result = convert_and_mount(mounts, tmp_path, tar)
    assert result.files == 30_000 + 30 + 1
    assert result.unique_chunks == 27_000 + 1
    assert_trees_equal(gnu_extract(tar, tmp_path / "expected"), mnt)


def test_deep_and_wide_directories(mounts, tmp_path: Path) -> None:
    t = TarBuilder()
    t.dir(".")
    deep = "/".join(f"level{i}" for i in range(150))
    t.file(f"deep/{deep}/bottom", b"deep")
    # names sorting before and after "." and ".." must stay findable by the
    # kernel's binary search over many directory blocks
    names = [f"entry-{i:05}-{'w' * (i % 40)}" for i in range(4000)]
    names += ["!bang", "+plus", "-dash", ",comma", ".hidden", "..double", "...triple", "~tilde", "\x01ctl"]
    for n in names:
        t.file(f"wide/{n}", n.encode())
    tar = t.write(tmp_path / "shape.tar")
    mnt, _ = convert_and_mount(mounts, tmp_path, tar)
    assert_trees_equal(gnu_extract(tar, tmp_path / "expected"), mnt)
    for n in names:  # direct lookups, not readdir
        assert (mnt / "wide" / n).read_bytes() == n.encode()
    assert len(os.listdir(mnt / "wide")) == len(names)


def test_directory_source_with_socket_and_devices(mounts, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "file").write_bytes(os.urandom(100_000))
    os.link(src / "sub" / "file", src / "hardlink")
    os.symlink("sub/file", src / "symlink")
    os.mknod(src / "chr", stat.S_IFCHR | 0o644, os.makedev(5, 1))
    os.mknod(src / "blk", stat.S_IFBLK | 0o600, os.makedev(8, 1))
    os.mkfifo(src / "fifo")
    os.mknod(src / "whiteout", stat.S_IFCHR, 0)  # overlayfs-style whiteouts pass through
    os.setxattr(src / "sub", "trusted.overlay.opaque", b"y")
    os.setxattr(src / "sub" / "file", "user.k", b"v")
    os.chown(src / "sub" / "file", 1234, 5678)
    os.chmod(src / "sub", 0o3750)
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(src / "socket"))
    finally:
        sock.close()
    os.utime(src / "sub" / "file", ns=(1, 1_234_567_891_234_567_891))
    meta, blob = tmp_path / "d.erofs", tmp_path / "d.blob"
    convert_directory(src, meta, blob)
    fsck_erofs(meta, blob)
    mnt = mounts.erofs(meta, blob)
    assert stat.S_ISSOCK(os.lstat(mnt / "socket").st_mode)
    assert_trees_equal(src, mnt)


def test_whiteouts_and_opaque_dirs_as_overlay_lowers(mounts, tmp_path: Path) -> None:
    lower = TarBuilder()
    lower.dir(".")
    for p in ("etc/motd", "etc/keep", "opt/a/old1", "opt/a/old2", "usr/share/doc/x/README", "gone/file"):
        lower.file(p, p.encode())
    upper = TarBuilder()
    upper.dir(".")
    upper.file("etc/.wh.motd")
    upper.file("opt/a/.wh..wh..opq")
    upper.file("opt/a/new", b"new")
    upper.file("usr/share/.wh.doc")
    upper.file(".wh.gone")
    upper.file("etc/keep", b"changed")
    l1, l2 = lower.write(tmp_path / "l1.tar"), upper.write(tmp_path / "l2.tar")
    m1, _ = convert_and_mount(mounts, tmp_path, l1, name="l1")
    m2, _ = convert_and_mount(mounts, tmp_path, l2, name="l2")
    merged = mounts.overlay([m1, m2])
    seen = sorted(str(p.relative_to(merged)) for p in merged.rglob("*"))
    assert seen == ["etc", "etc/keep", "opt", "opt/a", "opt/a/new", "usr", "usr/share"]
    assert (merged / "etc/keep").read_bytes() == b"changed"


# -- property-based: random trees through tar, converter, kernel -----------------------------

_names = st.one_of(
    st.text(alphabet="abcxyz-_.", min_size=1, max_size=12).filter(
        lambda s: s not in (".", "..") and not s.startswith(".wh.")),
    st.binary(min_size=1, max_size=8).filter(lambda b: b"/" not in b and b"\0" not in b
                                             and b not in (b".", b"..") and not b.startswith(b".wh.")),
)


@st.composite
def trees(draw: st.DrawFn) -> list[tuple]:
    entries: list[tuple] = []
    dirs: list[bytes] = [b""]
    files: list[bytes] = []
    used: set[bytes] = set()
    for _ in range(draw(st.integers(1, 25))):
        parent = draw(st.sampled_from(dirs))
        raw = draw(_names)
        name = raw if isinstance(raw, bytes) else raw.encode()
        path = parent + b"/" + name if parent else name
        if path in used:
            continue
        used.add(path)
        kind = draw(st.sampled_from(["file", "file", "dir", "symlink", "hardlink", "fifo", "chr"]))
        meta = dict(
            mode=draw(st.sampled_from([0o644, 0o600, 0o755, 0o4755, 0o1777, 0o2750, 0o000])),
            uid=draw(st.integers(0, 70000)), gid=draw(st.integers(0, 70000)),
            pax={"mtime": f"{draw(st.integers(0, 2_000_000_000))}.{draw(st.integers(0, 999_999_999)):09d}"},
        )
        if draw(st.booleans()):
            meta["xattrs"] = {"user." + draw(st.text("abc", min_size=1, max_size=5)): draw(st.binary(max_size=40))}
        if kind == "hardlink" and not files:
            kind = "file"
        if kind == "file":
            size = draw(st.sampled_from([0, 1, 100, 4095, 4096, 4097, 9000, 12288]))
            fill = draw(st.sampled_from(["random", "zero", "pattern"]))
            data = os.urandom(size) if fill == "random" else (bytes(size) if fill == "zero" else b"ab" * (size // 2))
            entries.append(("file", path, data, meta))
            files.append(path)
        elif kind == "dir":
            # GNU tar (the oracle) leaves the extraction time on directories it
            # cannot search, so random directory modes stay owner-searchable;
            # test_unsearchable_directory covers the rest
            meta["mode"] |= 0o100
            entries.append(("dir", path, None, meta))
            dirs.append(path)
        elif kind == "symlink":
            entries.append(("symlink", path, draw(st.binary(min_size=1, max_size=60).filter(lambda b: b"\0" not in b)), meta))
        elif kind == "hardlink":
            entries.append(("hardlink", path, draw(st.sampled_from(files)), {}))
        elif kind == "fifo":
            entries.append(("fifo", path, None, meta))
        else:
            entries.append(("chr", path, (draw(st.integers(1, 300)), draw(st.integers(0, 70000))), meta))
    return entries


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=trees())
def test_random_trees_roundtrip(mounts, tmp_path_factory, tree: list[tuple]) -> None:
    tmp = tmp_path_factory.mktemp("prop")
    t = TarBuilder()
    t.dir(".", mode=0o755)
    # GNU tar (the oracle) sets a directory's times once it leaves it, so the
    # archive lists each directory's subtree contiguously, as real layers do
    tree = sorted(tree, key=lambda e: e[1].split(b"/"))
    order = {e[1]: i for i, e in enumerate(tree)}
    tree = [e for i, e in enumerate(tree) if e[0] != "hardlink" or order[e[2]] < i]
    for kind, path, data, meta in tree:
        if kind == "file":
            t.file(path, data, **meta)
        elif kind == "dir":
            t.dir(path, **meta)
        elif kind == "symlink":
            t.symlink(path, data, **{k: v for k, v in meta.items() if k != "mode"})
        elif kind == "hardlink":
            t.hardlink(path, data)
        elif kind == "fifo":
            t.fifo(path, **meta)
        else:
            t.device(path.decode("utf-8", "surrogateescape"), "c", *data, **meta)
    tar = t.write(tmp / "rand.tar")
    mnt, _ = convert_and_mount(mounts, tmp, tar, chunk_size=4096)
    try:
        assert_trees_equal(gnu_extract(tar, tmp / "expected"), mnt)
    finally:
        mounts.unmount(mnt)


def test_cli_convert_and_inspect(tmp_path: Path) -> None:
    t = TarBuilder()
    t.file("bin/tool", b"x" * 5000, mode=0o755)
    t.symlink("bin/alias", "tool")
    tar = t.write(tmp_path / "c.tar")
    layerbox = [str(Path(sys.executable).with_name("layerbox"))]
    out = subprocess.run([*layerbox, "convert", "-", "--meta", str(tmp_path / "m"), "--blob", str(tmp_path / "b")],
                         input=tar.read_bytes(), capture_output=True, check=True)
    doc = json.loads(out.stdout)
    assert set(doc) >= {"digest", "files", "bytes", "chunks", "unique_chunks", "seconds"}
    assert doc["files"] == 4
    assert doc["bytes"] == 5000
    listing = subprocess.run([*layerbox, "inspect", str(tmp_path / "m"), "/bin"], capture_output=True,
                             check=True, text=True).stdout
    assert "/bin/alias -> tool" in listing
    assert "/bin/tool" in listing
    assert "chunk @0 +5000" in listing
    bad = subprocess.run([*layerbox, "convert", str(tmp_path / "missing.tar"), "--meta", "m", "--blob", "b"],
                         capture_output=True, text=True)
    assert bad.returncode != 0
    assert "missing.tar" in bad.stderr
