"""Converter behaviour that needs no kernel: bad input, OCI rules, determinism, reader."""

from __future__ import annotations

import gzip
import io
import os
import stat
import tarfile
from pathlib import Path

import blake3
import pytest
import zstandard

from converters.errors import BadArchive, BadEntry, ConvertError
from converters.layer import convert, convert_stream
from layerstore.erofs import format as F
from layerstore.erofs.reader import ErofsImage
from tests.support.tarbuild import TarBuilder


def _convert_bytes(tmp_path: Path, data: bytes, chunk_size: int = 1 << 20) -> tuple[ErofsImage, Path, Path]:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    meta, blob = out / "l.erofs", out / "l.blob"
    convert_stream(io.BytesIO(data), meta, blob, chunk_size=chunk_size, source="test.tar")
    return ErofsImage.open(meta), meta, blob


def _assert_no_output(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert not out.exists() or list(out.iterdir()) == [], list(out.iterdir())


def _fail(tmp_path: Path, data: bytes, exc: type[Exception]) -> str:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    with pytest.raises(exc) as info:
        convert_stream(io.BytesIO(data), out / "l.erofs", out / "l.blob", source="test.tar")
    _assert_no_output(tmp_path)
    return str(info.value)


# -- hostile and broken input ------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("../evil", "escapes the root"),
        ("a/../../evil", "escapes the root"),
        ("/etc/passwd", "absolute"),
        ("ok/" + "x" * 256, "255-byte limit"),
    ],
)
def test_bad_paths_are_refused_with_entry_and_offset(tmp_path: Path, name: str, needle: str) -> None:
    t = TarBuilder(auto_parents=False)
    t.file("first", b"1")
    t.file(name, b"data")
    msg = _fail(tmp_path, t.bytes(), BadEntry)
    assert needle in msg
    assert repr(name)[:30].strip("'") in msg
    assert "at offset" in msg


def test_hard_link_to_missing_target(tmp_path: Path) -> None:
    t = TarBuilder()
    t.hardlink("link", "nowhere")
    msg = _fail(tmp_path, t.bytes(), BadEntry)
    assert "'link'" in msg
    assert "nowhere" in msg


def test_hard_link_escaping_root(tmp_path: Path) -> None:
    t = TarBuilder(auto_parents=False)
    t.file("a", b"x")
    t.hardlink("link", "../a")
    assert "escapes the root" in _fail(tmp_path, t.bytes(), BadEntry)


def test_hard_link_to_directory(tmp_path: Path) -> None:
    t = TarBuilder()
    t.dir("d")
    t.hardlink("link", "d")
    assert "directory" in _fail(tmp_path, t.bytes(), BadEntry)


def test_unsupported_entry_type(tmp_path: Path) -> None:
    t = TarBuilder(tarfile.GNU_FORMAT)
    t.file("a", b"x")
    t.raw_type("volume", b"V")
    msg = _fail(tmp_path, t.bytes(), BadEntry)
    assert "unsupported tar entry type" in msg
    assert "'volume'" in msg


def _big_tar() -> bytes:
    t = TarBuilder()
    for i in range(20):
        t.file(f"f{i}", os.urandom(50_000))
    return t.bytes()


def test_truncated_tar_in_data(tmp_path: Path) -> None:
    data = _big_tar()
    msg = _fail(tmp_path, data[: len(data) // 2 + 100], BadArchive)
    assert "truncated" in msg


def test_truncated_tar_at_header_boundary(tmp_path: Path) -> None:
    data = _big_tar()
    # cut right after a complete member: tarfile alone would report a clean end
    t = TarBuilder()
    t.file("only", b"x" * 512)
    one = t.bytes()
    cut = one[: 512 * 3]  # pax header block? no: header + data + (no end marker)
    with tarfile.open(fileobj=io.BytesIO(one)) as tf:
        member = tf.getmembers()[0]
        cut = one[: member.offset_data + 512]
    msg = _fail(tmp_path, cut, BadArchive)
    assert "end-of-archive" in msg
    assert data  # the big tar is exercised by the other truncation tests


def test_garbage_header_mid_archive(tmp_path: Path) -> None:
    t = TarBuilder()
    t.file("a", b"x" * 10)
    data = bytearray(t.bytes())
    with tarfile.open(fileobj=io.BytesIO(bytes(data))) as tf:
        end = tf.getmembers()[-1].offset_data + 512
    data[end : end + 512] = b"\x55" * 512  # garbage where the end marker belongs
    assert "invalid tar header" in _fail(tmp_path, bytes(data), BadArchive)


def test_truncated_gzip(tmp_path: Path) -> None:
    data = gzip.compress(_big_tar())
    msg = _fail(tmp_path, data[: len(data) - 200], BadArchive)
    assert "truncated" in msg


def test_corrupt_gzip(tmp_path: Path) -> None:
    data = bytearray(gzip.compress(_big_tar(), compresslevel=1))
    for i in range(2000, 2100):
        data[i] ^= 0xFF
    msg = _fail(tmp_path, bytes(data), BadArchive)
    assert "gzip" in msg or "truncated" in msg or "corrupt" in msg


@pytest.mark.parametrize("checksum", [True, False])
def test_corrupt_zstd(tmp_path: Path, checksum: bool) -> None:
    data = bytearray(zstandard.ZstdCompressor(write_checksum=checksum).compress(_big_tar()))
    for i in range(300, 400):
        data[i] ^= 0xFF
    msg = _fail(tmp_path, bytes(data), BadArchive)
    assert "corrupt" in msg
    assert ("zstd" in msg or "tar" in msg)


def test_truncated_zstd(tmp_path: Path) -> None:
    data = zstandard.ZstdCompressor().compress(_big_tar())
    assert "truncated" in _fail(tmp_path, data[:-50], BadArchive)


def test_not_a_tar(tmp_path: Path) -> None:
    _fail(tmp_path, b"hello, this is not an archive" * 40, BadArchive)


def test_bad_chunk_size(tmp_path: Path) -> None:
    t = TarBuilder()
    t.file("a", b"x")
    for size in (1000, 4096 + 1, 2048):
        with pytest.raises(ConvertError, match="chunk size"):
            convert_stream(io.BytesIO(t.bytes()), tmp_path / "m", tmp_path / "b", chunk_size=size)
    assert list(tmp_path.iterdir()) == []


def test_failed_conversion_keeps_previous_outputs(tmp_path: Path) -> None:
    good = TarBuilder()
    good.file("a", b"first version")
    image, meta, blob = _convert_bytes(tmp_path, good.bytes())
    before = meta.read_bytes(), blob.read_bytes()
    bad = TarBuilder()
    bad.file("../x", b"y")
    with pytest.raises(BadEntry):
        convert_stream(io.BytesIO(bad.bytes()), meta, blob)
    assert (meta.read_bytes(), blob.read_bytes()) == before
    assert sorted(p.name for p in meta.parent.iterdir()) == ["l.blob", "l.erofs"]


def test_verify_callback_failure_leaves_nothing(tmp_path: Path) -> None:
    t = TarBuilder()
    t.file("a", b"x" * 10000)

    def verify() -> None:
        raise ConvertError("digest mismatch (test)")

    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ConvertError, match="digest mismatch"):
        convert_stream(io.BytesIO(t.bytes()), out / "m", out / "b", verify=verify)
    assert list(out.iterdir()) == []


def test_raw_stream_is_read_to_the_end(tmp_path: Path) -> None:
    t = TarBuilder()
    t.file("a", b"x")
    raw = io.BytesIO(gzip.compress(t.bytes() + bytes(10240)))
    seen: list[int] = []
    convert_stream(raw, tmp_path / "m", tmp_path / "b", verify=lambda: seen.append(raw.tell()))
    assert seen == [len(raw.getvalue())]


# -- OCI semantics, checked through the reader ---------------------------------------


def _tree(image: ErofsImage) -> dict[bytes, object]:
    return {path: node for path, node in image.walk()}


def test_whiteouts_and_opaque_directories(tmp_path: Path) -> None:
    t = TarBuilder()
    t.dir("etc")
    t.file("etc/.wh.motd")
    t.file("opt/.wh..wh..opq")
    t.dir("opt", mode=0o700)  # the marker may come before its directory's entry
    t.file(".wh.gone", uid=5)
    image, _, _ = _convert_bytes(tmp_path, t.bytes())
    motd = image.inode(image.lookup("etc/motd"))
    assert stat.S_ISCHR(motd.mode)
    assert motd.rdev == (0, 0)
    assert motd.is_whiteout
    assert image.inode(image.lookup("gone")).is_whiteout
    opt = image.inode(image.lookup("opt"))
    assert opt.xattrs == {b"trusted.overlay.opaque": b"y"}
    assert stat.S_IMODE(opt.mode) == 0o700
    names = {p for p, _ in image.walk()}
    assert not any(b".wh." in p for p in names), names


def test_later_entry_replaces_earlier(tmp_path: Path) -> None:
    t = TarBuilder()
    t.file("f", b"old")
    t.file("f", b"new!")
    t.dir("d")
    t.file("d/child", b"c")
    t.file("d", b"now a file")  # a file replaces a whole directory
    t.file("x", b"file first")
    t.dir("x")  # a directory replaces a file
    t.file("x/inside", b"i")
    t.dir("m", mode=0o700)
    t.file("m/keep", b"k")
    t.dir("m", mode=0o750)  # directory over directory merges
    t.file("w", b"real")
    t.file(".wh.w")  # a whiteout never hides a real entry of the same layer
    t.file(".wh.v")
    t.file("v", b"real after whiteout")
    image, _, _ = _convert_bytes(tmp_path, t.bytes())
    tree = _tree(image)
    assert tree[b"/f"].size == 4  # type: ignore[attr-defined]
    assert b"/d/child" not in tree
    assert stat.S_ISREG(tree[b"/d"].mode)
    assert stat.S_ISDIR(tree[b"/x"].mode)
    assert b"/x/inside" in tree
    assert stat.S_IMODE(tree[b"/m"].mode) == 0o750
    assert b"/m/keep" in tree
    assert stat.S_ISREG(tree[b"/w"].mode)
    assert stat.S_ISREG(tree[b"/v"].mode)


def test_hard_link_keeps_inode_of_its_time(tmp_path: Path) -> None:
    t = TarBuilder()
    t.file("a", b"original")
    t.hardlink("b", "a")
    t.file("a", b"replaced")  # b still names the original inode
    image, _, _ = _convert_bytes(tmp_path, t.bytes())
    a, b = image.lookup("a"), image.lookup("b")
    assert a != b
    assert image.inode(b).size == len(b"original")
    assert image.inode(b).nlink == 1


def test_implicit_parents(tmp_path: Path) -> None:
    t = TarBuilder(auto_parents=False)
    t.file("a/b/c/file", b"x")
    image, _, _ = _convert_bytes(tmp_path, t.bytes())
    for p in ("a", "a/b", "a/b/c"):
        node = image.inode(image.lookup(p))
        assert stat.S_ISDIR(node.mode)
        assert stat.S_IMODE(node.mode) == 0o755
        assert node.uid == 0


def test_unknown_xattr_namespace_is_an_error(tmp_path: Path) -> None:
    t = TarBuilder()
    t.file("a", b"x", xattrs={"system.nfs4_acl": "v"})
    assert "namespace" in _fail(tmp_path, t.bytes(), ConvertError)


# -- determinism, dedup and the reader -------------------------------------------------


def _sample_tar() -> bytes:
    t = TarBuilder()
    t.dir("d", mtime=1_600_000_000)
    t.file("d/a", os.urandom(300_000), pax={"mtime": "1600000000.123456789"})
    t.file("d/zero", bytes(200_000))
    t.symlink("d/l", "a")
    t.file("same1", b"dup" * 100_000)
    t.file("same2", b"dup" * 100_000)
    return t.bytes()


def test_output_is_deterministic(tmp_path: Path) -> None:
    data = _sample_tar()
    outs = []
    for n in range(2):
        d = tmp_path / str(n)
        d.mkdir()
        r = convert_stream(io.BytesIO(data), d / "m", d / "b", chunk_size=64 << 10)
        outs.append(((d / "m").read_bytes(), (d / "b").read_bytes(), r.digest))
    assert outs[0] == outs[1]
    assert outs[0][2] == "blake3:" + blake3.blake3(outs[0][0]).hexdigest()


def test_compressed_inputs_give_identical_layers(tmp_path: Path) -> None:
    data = _sample_tar()
    digests = set()
    for i, blob in enumerate((data, gzip.compress(data), zstandard.ZstdCompressor().compress(data))):
        d = tmp_path / str(i)
        d.mkdir()
        digests.add(convert_stream(io.BytesIO(blob), d / "m", d / "b").digest)
    assert len(digests) == 1


def test_reader_maps_files_to_chunk_digests(tmp_path: Path) -> None:
    data = _sample_tar()
    cs = 64 << 10
    image, _, blob = _convert_bytes(tmp_path, data, chunk_size=cs)
    blob_bytes = blob.read_bytes()
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        for member in tf.getmembers():
            if not member.isfile():
                continue
            content = tf.extractfile(member).read()  # type: ignore[union-attr]
            chunks = image.chunks(image.lookup(member.name))
            assert sum(c.length for c in chunks) == len(content)
            for c in chunks:
                piece = content[c.file_offset : c.file_offset + c.length]
                if c.hole:
                    assert piece == bytes(len(piece))
                    continue
                assert c.digest == blake3.blake3(piece).digest()
                start = c.block * F.BLOCK_SIZE
                assert blob_bytes[start : start + c.length] == piece
    # identical files share their chunks; the all-zero file is holes only
    same = [image.chunks(image.lookup(n)) for n in ("same1", "same2")]
    assert [c.block for c in same[0]] == [c.block for c in same[1]]
    assert all(c.hole for c in image.chunks(image.lookup("d/zero")))
    inode = image.inode(image.lookup("d/a"))
    assert (inode.mtime, inode.mtime_nsec) == (1_600_000_000, 123_456_789)
    assert image.readlink(image.lookup("d/l")) == b"a"


def test_stats_and_blob_map(tmp_path: Path) -> None:
    t = TarBuilder()
    t.file("a", b"A" * 5000)
    t.file("b", b"A" * 5000)
    t.file("c", b"")
    t.file("z", bytes(8192))
    (tmp_path / "in.tar").write_bytes(t.bytes())
    r = convert(str(tmp_path / "in.tar"), tmp_path / "m", tmp_path / "b", chunk_size=4096)
    assert (r.bytes, r.chunks, r.unique_chunks, r.unique_bytes) == (18192, 4, 2, 5000)
    image = ErofsImage.open(tmp_path / "m")
    assert [(rec.block, rec.length) for rec in image.blob_map] == [(0, 4096), (1, 904)]
    assert (tmp_path / "b").stat().st_size == 2 * 4096
    assert image.devices[0][0] == r.blob_digest.removeprefix("blake3:").encode()


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"uid": 1 << 32}, "uid"),
        ({"gid": 1 << 33}, "gid"),
    ],
)
def test_ids_that_do_not_fit_are_refused(tmp_path: Path, kw: dict[str, int], needle: str) -> None:
    t = TarBuilder()
    t.file("f", b"x", **kw)  # PAX carries any size; EROFS holds 32 bits
    assert needle in _fail(tmp_path, t.bytes(), ConvertError)


@pytest.mark.parametrize(("major", "minor"), [(4096, 1), (1, 1 << 20)])
def test_device_numbers_that_do_not_fit_are_refused(tmp_path: Path, major: int, minor: int) -> None:
    t = TarBuilder(tarfile.GNU_FORMAT)  # base-256 fields carry large numbers
    t.device("dev/x", "c", major, minor)
    assert f"{major}:{minor}" in _fail(tmp_path, t.bytes(), ConvertError)


def test_oversized_xattr_name_is_refused(tmp_path: Path) -> None:
    t = TarBuilder()
    t.file("f", b"x", xattrs={"user." + "n" * 251: "v"})  # 256 bytes with the prefix
    assert "too large" in _fail(tmp_path, t.bytes(), ConvertError)


def test_directory_sources_keep_whiteout_names_literally(tmp_path: Path) -> None:
    from converters.layer import convert_directory

    src = tmp_path / "src"
    src.mkdir()
    (src / ".wh.foo").write_bytes(b"a file that merely looks like a whiteout")
    (src / ".wh..wh..opq").write_bytes(b"")
    out = tmp_path / "out"
    out.mkdir()
    convert_directory(src, out / "m", out / "b")
    image = ErofsImage.open(out / "m")
    names = sorted(p for p, _ in image.walk())
    assert names == [b"/", b"/.wh..wh..opq", b"/.wh.foo"]
    assert image.inode(image.lookup("/")).xattrs == {}


def test_reconverting_removes_the_old_image_before_the_new_blob_lands(tmp_path: Path) -> None:
    """A crash between the two renames must not pair the old image with the new blob."""
    import converters.layer as layer_mod

    first = TarBuilder()
    first.file("a", b"one")
    image, meta, blob = _convert_bytes(tmp_path, first.bytes())
    second = TarBuilder()
    second.file("a", b"two!")
    seen: list[bool] = []
    real_commit = layer_mod._Output.commit

    def commit(self: layer_mod._Output) -> None:
        if self.final == blob:
            seen.append(meta.exists())  # state a crash right here would leave
        real_commit(self)

    layer_mod._Output.commit = commit  # type: ignore[method-assign]
    try:
        convert_stream(io.BytesIO(second.bytes()), meta, blob)
    finally:
        layer_mod._Output.commit = real_commit  # type: ignore[method-assign]
    assert seen == [False]
    assert ErofsImage.open(meta).inode(ErofsImage.open(meta).lookup("a")).size == 4


def test_root_entry_must_be_a_directory(tmp_path: Path) -> None:
    t = TarBuilder(auto_parents=False)
    t.file(".", b"")  # a regular file where the root directory belongs
    assert "root must be a directory" in _fail(tmp_path, t.bytes(), BadEntry)


def test_parent_that_is_not_a_directory(tmp_path: Path) -> None:
    t = TarBuilder(auto_parents=False)
    t.file("a", b"file")
    t.file("a/b", b"under a file")
    assert "not a directory" in _fail(tmp_path, t.bytes(), BadEntry)


def test_invalid_whiteout_names(tmp_path: Path) -> None:
    t = TarBuilder()
    t.file(".wh.", b"")
    assert "whiteout" in _fail(tmp_path, t.bytes(), BadEntry)


def test_empty_symlink_target(tmp_path: Path) -> None:
    t = TarBuilder()
    t.symlink("l", "")
    assert "empty target" in _fail(tmp_path, t.bytes(), BadEntry)


def test_legacy_entry_forms(tmp_path: Path) -> None:
    t = TarBuilder(tarfile.GNU_FORMAT, auto_parents=False)
    t.raw_type("contiguous", b"7", b"data of a contiguous file")
    t.raw_type("dumpdir", b"D", b"Nlisting\0\0")  # GNU dumpdir: a directory plus a listing
    t.raw_type("olddir/", b"0")  # pre-POSIX: a trailing slash marks a directory
    image, _, _ = _convert_bytes(tmp_path, t.bytes())
    assert image.inode(image.lookup("contiguous")).size == len(b"data of a contiguous file")
    assert stat.S_ISDIR(image.inode(image.lookup("dumpdir")).mode)
    assert stat.S_ISDIR(image.inode(image.lookup("olddir")).mode)


def test_libarchive_xattrs(tmp_path: Path) -> None:
    import base64

    t = TarBuilder()
    t.file("f", b"x", pax={"LIBARCHIVE.xattr.user.with%20space": base64.b64encode(b"\x00\x01v").decode().rstrip("=")})
    image, _, _ = _convert_bytes(tmp_path, t.bytes())
    assert image.inode(image.lookup("f")).xattrs == {b"user.with space": b"\x00\x01v"}


@pytest.mark.parametrize("version", ["0.0", "0.1"])
def test_pax_sparse_old_versions(tmp_path: Path, version: str) -> None:
    # a 1 MiB + 10 file holding "AB" at 4096 and "CD" at its very end
    real = (1 << 20) + 10
    stored = b"AB" + b"CD"
    pax: dict[str, str] = {"GNU.sparse.size": str(real), "GNU.sparse.name": "sparse", "GNU.sparse.realsize": str(real)}
    if version == "0.1":
        pax["GNU.sparse.map"] = f"4096,2,{real - 2},2"
        pax["GNU.sparse.numblocks"] = "2"
    t = TarBuilder()
    if version == "0.0":
        # 0.0 repeats offset/numbytes keys in order, which a dict cannot hold: write records by hand
        records = [("GNU.sparse.size", str(real)), ("GNU.sparse.numblocks", "2"),
                   ("GNU.sparse.offset", "4096"), ("GNU.sparse.numbytes", "2"),
                   ("GNU.sparse.offset", str(real - 2)), ("GNU.sparse.numbytes", "2"),
                   ("GNU.sparse.name", "sparse")]
        body = b""
        for k, v in records:
            rec = f" {k}={v}\n".encode()
            n = len(rec) + 1
            while len(str(n)) + len(rec) != n:
                n = len(str(n)) + len(rec)
            body += str(n).encode() + rec
        hdr = tarfile.TarInfo("PaxHeaders/sparse")
        hdr.type = tarfile.XHDTYPE
        hdr.size = len(body)
        t.tar.addfile(hdr, io.BytesIO(body))
        info = tarfile.TarInfo("GNUSparseFile.0/sparse")
        info.size = len(stored)
        info.mtime = 1
        t.tar.fileobj.write(info.tobuf(tarfile.USTAR_FORMAT))  # type: ignore[union-attr]
        t.tar.fileobj.write(stored + bytes(-len(stored) % 512))  # type: ignore[union-attr]
        t.tar.offset += 512 + 512
    else:
        t.file("GNUSparseFile.0/sparse", stored, pax=pax)
    image, _, blob = _convert_bytes(tmp_path, t.bytes(), chunk_size=4096)
    node = image.inode(image.lookup("sparse"))
    assert node.size == real
    content = bytearray(real)
    content[4096:4098] = b"AB"
    content[real - 2 :] = b"CD"
    data = blob.read_bytes()
    rebuilt = bytearray()
    for c in image.chunks(node.nid):
        rebuilt += bytes(c.length) if c.hole else data[c.block * 4096 : c.block * 4096 + c.length]
    assert bytes(rebuilt) == bytes(content)
