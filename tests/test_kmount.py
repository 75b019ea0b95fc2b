"""Real-kernel tests of lazyfetch.kmount and of the test harness itself.

Images come from Debian's mkfs.erofs, not from our own writer, so these tests
pin down the kernel side (file-backed EROFS with a blob device, overlayfs
with lowerdir+) independently of the format code.
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from support.erofs_tools import fsck_erofs, fsck_extract, mkfs_erofs
from support.proc import CommandFailed, CommandTimedOut, run
from support.treecmp import assert_trees_equal, compare_trees

from lazyfetch import kmount
from lazyfetch.errors import KernelMountError, LazyfetchError, MountArgumentError

if TYPE_CHECKING:
    from conftest import Mounts

CHUNK = 1 << 20
MIB = 1 << 20
NON_UTF8 = b"\xff\xfe"
BASE_NS = 1_600_000_000_123_456_789  # odd nanoseconds catch truncation to us or s


# --------------------------------------------------------------------------
# building trees and images


def _set_times(root: Path) -> None:
    """Give every entry a distinct nanosecond mtime, children before parents."""
    rootb = os.fsencode(root)
    paths: list[bytes] = []
    for dirpath, dirnames, filenames in os.walk(rootb):
        paths += [os.path.join(dirpath, n) for n in dirnames + filenames]
    # Deepest first, so setting a child's time never disturbs its parent's.
    for i, path in enumerate(sorted(paths, key=lambda p: p.count(b"/"), reverse=True)):
        ns = BASE_NS + i * 1_000_000_007
        os.utime(path, ns=(ns, ns), follow_symlinks=False)
    os.utime(rootb, ns=(BASE_NS - 7, BASE_NS - 7))


def build_source_tree(root: Path) -> Path:
    """Every kind of entry a layer must carry faithfully."""
    root.mkdir()
    (root / "regular").write_bytes(b"hello, layer\n")
    (root / "random-3m").write_bytes(os.urandom(3 * MIB))
    (root / "partial-chunk").write_bytes(os.urandom(MIB + 12345))
    (root / "empty").touch()
    (root / "symlink").symlink_to("regular")
    (root / "dangling").symlink_to("../nowhere/at/all")
    (root / "hard-a").write_bytes(b"shared inode\n")
    os.link(root / "hard-a", root / "hard-b")
    os.mknod(root / "chardev", stat.S_IFCHR | 0o620, os.makedev(1, 3))
    os.mkfifo(root / "fifo", 0o640)
    (root / "setuid").write_bytes(b"#!/bin/sh\n")
    os.chmod(root / "setuid", 0o4755)
    os.chown(root / "regular", 1234, 5678)
    os.setxattr(root / "regular", "user.layerbox", b"user value")
    sub = root / "dir"
    sub.mkdir()
    os.chmod(sub, 0o3775)  # setgid + sticky
    os.setxattr(sub, "trusted.layerbox", b"\x00trusted\xff")
    (sub / "nested").write_bytes(b"nested\n")
    with open(os.path.join(os.fsencode(root), NON_UTF8), "wb") as f:
        f.write(b"not utf-8 name\n")
    _set_times(root)
    return root


def make_image(src: Path, out: Path, name: str = "layer") -> tuple[Path, Path]:
    """mkfs.erofs ``src`` into chunk-based meta + blob and fsck the result."""
    meta, blob = out / f"{name}.erofs", out / f"{name}.blob"
    mkfs_erofs(src, meta, blob, CHUNK)
    fsck_erofs(meta, blob)
    return meta, blob


@pytest.fixture
def image(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(source tree, metadata image, blob) for the full-featured tree."""
    if os.geteuid() != 0:
        pytest.skip("building the source tree needs root (mknod, chown, trusted.* xattrs)")
    src = build_source_tree(tmp_path / "src")
    meta, blob = make_image(src, tmp_path)
    return src, meta, blob


def _whiteout(path: Path) -> None:
    os.mknod(path, stat.S_IFCHR | 0o000, os.makedev(0, 0))


def _is_whiteout(path: Path) -> bool:
    st = path.lstat()
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(0, 0)


# --------------------------------------------------------------------------
# file-backed EROFS


@pytest.mark.root("erofs")
def test_erofs_mount_reproduces_source_tree(
    image: tuple[Path, Path, Path], mounts: Mounts
) -> None:
    src, meta, blob = image
    mnt = mounts.erofs(meta, blob)
    # mkfs_erofs passes --preserve-mtime, so mtimes are compared to the ns.
    assert_trees_equal(src, mnt)
    info = [m for m in kmount.read_mountinfo() if m.mountpoint == str(mnt)]
    assert [(m.fstype, m.source) for m in info] == [("erofs", str(meta))]
    with pytest.raises(OSError, match="Read-only file system") as exc_info:
        (mnt / "new-file").write_bytes(b"x")
    assert exc_info.value.errno == errno.EROFS


@pytest.mark.root("erofs")
def test_fsck_extract_reproduces_file_data(image: tuple[Path, Path, Path], tmp_path: Path) -> None:
    src, meta, blob = image
    dest = tmp_path / "extracted"
    fsck_extract(meta, blob, dest)
    # fsck.erofs 1.5 drops xattrs, hard links and setuid when extracting, so
    # only the file data and symlinks are compared here.
    for name in ("regular", "random-3m", "partial-chunk", "empty", "dir/nested"):
        assert (dest / name).read_bytes() == (src / name).read_bytes(), name
    assert os.readlink(dest / "symlink") == "regular"


@pytest.mark.root("erofs")
def test_erofs_without_blob_is_refused(image: tuple[Path, Path, Path], mounts: Mounts) -> None:
    # The kernel itself would mount it and serve metadata bytes as file data.
    _, meta, _ = image
    with pytest.raises(MountArgumentError, match="extra device"):
        mounts.erofs(meta, None)


@pytest.mark.root("erofs")
def test_blob_path_with_comma_is_refused(
    image: tuple[Path, Path, Path], tmp_path: Path, mounts: Mounts
) -> None:
    _, meta, blob = image
    odd = tmp_path / "a,b.blob"
    os.link(blob, odd)
    with pytest.raises(MountArgumentError, match="comma") as exc_info:
        mounts.erofs(meta, odd)
    assert str(odd) in str(exc_info.value)
    assert isinstance(exc_info.value, ValueError)


@pytest.mark.root("erofs")
def test_non_erofs_file_raises_kernel_mount_error(tmp_path: Path, mounts: Mounts) -> None:
    bogus = tmp_path / "not-an-image.erofs"
    bogus.write_bytes(os.urandom(8192))
    with pytest.raises(KernelMountError) as exc_info:
        mounts.erofs(bogus, None)
    err = exc_info.value
    assert err.errno == errno.EINVAL
    assert isinstance(err, OSError)
    assert isinstance(err, LazyfetchError)
    assert str(bogus) in str(err)
    assert "erofs" in str(err)


@pytest.mark.root("erofs")
def test_missing_blob_file_names_it(
    image: tuple[Path, Path, Path], tmp_path: Path, mounts: Mounts
) -> None:
    _, meta, _ = image
    absent = tmp_path / "no-such.blob"
    with pytest.raises(KernelMountError) as exc_info:
        mounts.erofs(meta, absent)
    assert exc_info.value.errno == errno.ENOENT
    assert f"blob {str(absent)!r} does not exist" in str(exc_info.value)


# --------------------------------------------------------------------------
# unmounting and mount state


@pytest.mark.root
def test_umount_of_non_mountpoint_raises(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(KernelMountError) as exc_info:
        kmount.umount(plain)
    assert exc_info.value.errno == errno.EINVAL
    assert str(plain) in str(exc_info.value)
    kmount.umount(plain, missing_ok=True)
    kmount.umount(tmp_path / "absent", missing_ok=True)


@pytest.mark.root("erofs")
def test_mount_state_from_mountinfo(
    image: tuple[Path, Path, Path], tmp_path: Path, mounts: Mounts
) -> None:
    _, meta, blob = image
    # Space, tab, newline and backslash appear as \040, \011, \012 and \134 in mountinfo.
    outer = tmp_path / "with space\tand\\backslash\nand newline"
    outer.mkdir()
    mounts.erofs(meta, blob, at=outer)
    alias = tmp_path / "alias"
    alias.symlink_to(outer)
    assert kmount.is_mountpoint(outer)
    assert kmount.is_mountpoint(alias)  # resolved before matching
    assert not kmount.is_mountpoint(outer / "dir")
    assert not kmount.is_mountpoint(tmp_path)
    assert kmount.mounts_under(tmp_path) == [str(outer)]
    assert kmount.mounts_under(outer) == [str(outer)]
    assert str(outer) in kmount.mountpoints()
    assert [m.mountpoint for m in kmount.read_mountinfo()] == kmount.mountpoints()


@pytest.mark.root
def test_is_mountpoint_sees_a_bind_mount_on_the_same_filesystem(tmp_path: Path) -> None:
    # same device and inode as before the mount: only the mount table (or statx's
    # mount-root attribute) can tell
    target = tmp_path / "self"
    target.mkdir()
    (target / "file").write_text("x")
    assert not kmount.is_mountpoint(target)
    subprocess.run(["mount", "--bind", str(target), str(target)], check=True)
    try:
        assert kmount.is_mountpoint(target)
        assert kmount.is_mountpoint(tmp_path / "self" / ".." / "self")
        assert not kmount.is_mountpoint(target / "file")
        assert not kmount.is_mountpoint(tmp_path / "absent")
        assert kmount.is_mountpoint("/")
    finally:
        subprocess.run(["umount", str(target)], check=True)
    assert not kmount.is_mountpoint(target)


@pytest.mark.root
def test_umount_mount_takes_off_only_the_mount_it_was_given(tmp_path: Path) -> None:
    # a detach unmounts the host's copy after its lock: whatever was stacked there since stays
    target = tmp_path / "target"
    target.mkdir()
    assert kmount.mount_id(target) is None
    subprocess.run(["mount", "-t", "tmpfs", "first", str(target)], check=True)
    try:
        first = kmount.mount_id(target)
        assert first is not None
        assert kmount.mount_id(target / ".") == first
        subprocess.run(["mount", "-t", "tmpfs", "second", str(target)], check=True)
        second = kmount.mount_id(target)
        assert second is not None
        assert second != first
        assert kmount.umount_mount(target, first) is False
        assert [m.source for m in kmount.read_mountinfo() if m.mountpoint == str(target)] == ["first", "second"]
        assert kmount.umount_mount(target, second) is True
        assert [m.source for m in kmount.read_mountinfo() if m.mountpoint == str(target)] == ["first"]
        assert kmount.umount_mount(target, second) is False  # gone: an id is not a path
        assert kmount.umount_mount(target, first) is True
        assert kmount.mount_id(target) is None
        assert kmount.umount_mount(tmp_path / "absent", first) is False
    finally:
        for _ in range(2):
            subprocess.run(["umount", "-l", str(target)], check=False, capture_output=True)


@pytest.mark.root("erofs", "overlay")
def test_mounts_under_lists_deepest_first(
    image: tuple[Path, Path, Path], tmp_path: Path, mounts: Mounts
) -> None:
    _, meta, blob = image
    upper, work = tmp_path / "upper", tmp_path / "work"
    upper.mkdir()
    work.mkdir()
    lower = mounts.erofs(meta, blob)
    top = tmp_path / "top"
    top.mkdir()
    mounts.overlay([lower], upper, work, at=top)
    (top / "inner").mkdir()
    mounts.erofs(meta, blob, at=top / "inner")
    assert kmount.mounts_under(tmp_path) == [str(top / "inner"), str(top)]
    assert (top / "inner" / "regular").read_bytes() == b"hello, layer\n"


@pytest.mark.root("erofs")
def test_mounts_fixture_unmounts_early_and_late(
    image: tuple[Path, Path, Path], mounts: Mounts
) -> None:
    _, meta, blob = image
    first = mounts.erofs(meta, blob)
    second = mounts.erofs(meta, blob)
    mounts.unmount(first)
    assert not kmount.is_mountpoint(first)
    assert kmount.is_mountpoint(second)  # the fixture's teardown unmounts it


# --------------------------------------------------------------------------
# overlayfs


def _layer(tmp_path: Path, name: str, build: Callable[[Path], None]) -> tuple[Path, Path]:
    src = tmp_path / f"{name}-src"
    src.mkdir()
    build(src)
    return make_image(src, tmp_path, name)


def _base_layer(src: Path) -> None:
    (src / "a").mkdir()
    (src / "a" / "keep").write_text("keep\n")
    (src / "a" / "gone").write_text("whited out\n")
    (src / "d").mkdir()
    (src / "d" / "old").write_text("hidden by opaque dir\n")
    (src / "d" / "sub").mkdir()
    (src / "d" / "sub" / "x").write_text("hidden too\n")
    (src / "f").write_text("lower\n")
    (src / "deleted-dir").mkdir()
    (src / "deleted-dir" / "y").write_text("y\n")


def _top_layer(src: Path) -> None:
    (src / "a").mkdir()
    _whiteout(src / "a" / "gone")
    (src / "d").mkdir()
    os.setxattr(src / "d", "trusted.overlay.opaque", b"y")
    (src / "d" / "new").write_text("only in the top layer\n")
    (src / "f").write_text("upper\n")


@pytest.mark.root("erofs", "overlay")
def test_overlay_honours_whiteouts_and_opaque_dirs(tmp_path: Path, mounts: Mounts) -> None:
    base = mounts.erofs(*_layer(tmp_path, "base", _base_layer))
    top = mounts.erofs(*_layer(tmp_path, "top", _top_layer))
    merged = mounts.overlay([base, top])
    assert sorted(os.listdir(merged / "a")) == ["keep"]
    assert sorted(os.listdir(merged / "d")) == ["new"]
    assert (merged / "f").read_text() == "upper\n"  # top of lowest-first list wins
    assert sorted(os.listdir(merged)) == ["a", "d", "deleted-dir", "f"]
    with pytest.raises(OSError, match="Read-only file system") as exc_info:
        (merged / "f").write_text("no upper, no writes")
    assert exc_info.value.errno == errno.EROFS


@pytest.mark.root("erofs", "overlay")
def test_writable_overlay_keeps_changes_in_upper(tmp_path: Path, mounts: Mounts) -> None:
    base = mounts.erofs(*_layer(tmp_path, "base", _base_layer))
    top = mounts.erofs(*_layer(tmp_path, "top", _top_layer))
    upper, work = tmp_path / "upper", tmp_path / "work"
    upper.mkdir()
    work.mkdir()
    merged = mounts.overlay([base, top], upper, work)
    (merged / "created").write_text("new\n")
    (merged / "f").write_text("changed\n")
    (merged / "a" / "keep").unlink()
    (merged / "deleted-dir" / "y").unlink()
    (merged / "deleted-dir").rmdir()
    assert sorted(os.listdir(merged)) == ["a", "created", "d", "f"]
    mounts.unmount(merged)
    assert (upper / "created").read_text() == "new\n"
    assert (upper / "f").read_text() == "changed\n"  # copied up
    assert _is_whiteout(upper / "a" / "keep")
    assert _is_whiteout(upper / "deleted-dir")
    assert (top / "f").read_text() == "upper\n"  # the layer itself is untouched


def _kernel_at_least(major: int, minor: int) -> bool:
    release = os.uname().release.split("-")[0].split(".")
    return (int(release[0]), int(release[1])) >= (major, minor)


@pytest.mark.root("overlay")
def test_overlay_of_40_long_lowers_exceeds_a_page(tmp_path: Path, mounts: Mounts) -> None:
    lowers = []
    for i in range(40):
        layer = tmp_path / (f"layer{i:02d}-" + "x" * 150)
        layer.mkdir()
        (layer / f"f{i:02d}").write_text(f"{i}\n")
        (layer / "top").write_text(f"{i}\n")
        lowers.append(layer)
    total = sum(len(os.fsencode(p)) + 1 for p in lowers)
    assert total > os.sysconf("SC_PAGE_SIZE"), "the test must exceed mount(2)'s one page"
    if not _kernel_at_least(6, 8):
        with pytest.raises(MountArgumentError):
            mounts.overlay(lowers)
        return
    merged = mounts.overlay(lowers)
    assert sorted(os.listdir(merged)) == sorted([f"f{i:02d}" for i in range(40)] + ["top"])
    assert (merged / "top").read_text() == "39\n"  # the last (highest) layer wins
    info = next(m for m in kmount.read_mountinfo() if m.mountpoint == str(merged))
    assert info.super_options.count("lowerdir+=") == 40


@pytest.fixture(params=["new mount API", "mount(2) fallback"])
def mount_api(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test through fsopen/lowerdir+ and again through the mount(2) fallback."""
    if request.param == "mount(2) fallback":
        # With no syscall numbers kmount sees ENOSYS, as on a kernel < 5.2.
        monkeypatch.setattr(kmount, "_SYSCALL_NUMBERS", {})
    return str(request.param)


@pytest.mark.root("overlay")
def test_overlay_paths_with_separators(tmp_path: Path, mounts: Mounts, mount_api: str) -> None:
    # ':' separates lowerdir= entries, ',' options and '\\' escapes: each
    # must reach the kernel literally on both paths.
    low, high = tmp_path / "low:colon,comma", tmp_path / "high\\backslash"
    upper, work = tmp_path / "up,per\\x:y", tmp_path / "wo:rk,z"
    for layer, text in ((low, "low\n"), (high, "high\n")):
        layer.mkdir()
        (layer / "f").write_text(text)
    (low / "only-low").touch()
    upper.mkdir()
    work.mkdir()
    merged = mounts.overlay([low, high], upper, work)
    assert (merged / "f").read_text() == "high\n"
    assert (merged / "only-low").exists()
    (merged / "written").write_text("w\n")
    info = next(m for m in kmount.read_mountinfo() if m.mountpoint == str(merged))
    expect_key = "lowerdir+=" if mount_api == "new mount API" else "lowerdir="
    assert expect_key in info.super_options
    mounts.unmount(merged)
    assert (upper / "written").read_text() == "w\n"


@pytest.mark.root("overlay")
def test_fallback_refuses_option_strings_over_a_page(
    tmp_path: Path, mounts: Mounts, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kmount, "_SYSCALL_NUMBERS", {})
    lowers = []
    for i in range(40):
        layer = tmp_path / (f"layer{i:02d}-" + "x" * 150)
        layer.mkdir()
        lowers.append(layer)
    with pytest.raises(MountArgumentError, match="accepts at most"):
        mounts.overlay(lowers)


@pytest.mark.root("overlay")
def test_overlay_rejections_carry_the_kernels_reason(tmp_path: Path, mounts: Mounts) -> None:
    lows = [tmp_path / "l0", tmp_path / "l1"]
    for layer in lows:
        layer.mkdir()
    with pytest.raises(KernelMountError) as exc_info:
        mounts.overlay(lows, options=["no_such_option=1"])
    assert exc_info.value.errno == errno.EINVAL
    assert "no_such_option" in str(exc_info.value)
    with pytest.raises(KernelMountError) as missing_info:
        mounts.overlay([lows[0], tmp_path / "absent"])
    assert missing_info.value.errno == errno.ENOENT
    assert "absent" in str(missing_info.value)
    with pytest.raises(MountArgumentError, match="at least two"):
        mounts.overlay(lows[:1])
    with pytest.raises(MountArgumentError, match="go together"):
        mounts.overlay(lows, upper=tmp_path / "u")


# --------------------------------------------------------------------------
# the tree comparison helper must be able to fail


def _twin_trees(tmp_path: Path) -> tuple[Path, Path]:
    """Two identical small trees (same content, modes, mtimes, xattrs, links)."""
    roots = []
    for name in ("left", "right"):
        root = tmp_path / name
        root.mkdir()
        (root / "file").write_bytes(b"0123456789")
        (root / "other").write_bytes(b"other")
        (root / "link1").write_bytes(b"linked")
        os.link(root / "link1", root / "link2")
        (root / "symlink").symlink_to("file")
        os.setxattr(root / "file", "user.k", b"v")
        with open(os.path.join(os.fsencode(root), NON_UTF8), "wb") as f:
            f.write(b"odd name")
        _set_times(root)
        roots.append(root)
    return roots[0], roots[1]


def _keeping_root_mtime(change: Callable[[Path], None]) -> Callable[[Path], None]:
    """Apply a change that touches the root directory, then restore its mtime."""
    def apply(root: Path) -> None:
        before = root.stat().st_mtime_ns
        change(root)
        os.utime(root, ns=(before, before))
    return apply


def _break_link(root: Path) -> None:
    st = (root / "link2").stat()
    (root / "link2").unlink()
    (root / "link2").write_bytes(b"linked")
    os.utime(root / "link2", ns=(st.st_atime_ns, st.st_mtime_ns))


def _same_size_content(root: Path) -> None:
    st = (root / "file").stat()
    (root / "file").write_bytes(b"0123x56789")
    os.utime(root / "file", ns=(st.st_atime_ns, st.st_mtime_ns))


def _retarget_symlink(root: Path) -> None:
    (root / "symlink").unlink()
    (root / "symlink").symlink_to("other")


def _rename_odd(root: Path) -> None:
    rootb = os.fsencode(root)
    os.rename(os.path.join(rootb, NON_UTF8), os.path.join(rootb, b"\xff\xfd"))


def _file_to_dir(root: Path) -> None:
    (root / "other").unlink()
    (root / "other").mkdir()


MUTATIONS: dict[str, tuple[Callable[[Path], None], str]] = {
    "mode": (lambda r: os.chmod(r / "file", 0o4644), "/file: mode expected 0o644"),
    "content of equal size": (_same_size_content, "/file: content differs from byte 4"),
    "broken hard link": (_keeping_root_mtime(_break_link), "/link1: hard links differ"),
    "missing xattr": (lambda r: os.removexattr(r / "file", "user.k"), "xattr user.k missing"),
    "xattr value": (lambda r: os.setxattr(r / "file", "user.k", b"w"), "xattr user.k expected"),
    "mtime": (lambda r: os.utime(r / "other", ns=(1, 2)), "/other: mtime expected"),
    "symlink target": (
        _keeping_root_mtime(_retarget_symlink), "/symlink: symlink target expected b'file'"
    ),
    "non-UTF-8 name": (_keeping_root_mtime(_rename_odd), "/\\xff\\xfe: missing regular file"),
    "type": (
        _keeping_root_mtime(_file_to_dir), "/other: type expected regular file, actual directory"
    ),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_compare_trees_detects(tmp_path: Path, mutation: str) -> None:
    left, right = _twin_trees(tmp_path)
    assert compare_trees(left, right) == []  # the baseline must pass
    change, expected = MUTATIONS[mutation]
    change(right)
    diffs = compare_trees(left, right)
    assert any(expected in d for d in diffs), diffs
    with pytest.raises(AssertionError, match="difference"):
        assert_trees_equal(left, right)


@pytest.mark.root
def test_compare_trees_detects_owner_rdev_and_trusted_xattr(tmp_path: Path) -> None:
    left, right = _twin_trees(tmp_path)
    for root in (left, right):
        os.mknod(root / "dev", stat.S_IFCHR | 0o600, os.makedev(1, 3))
        os.setxattr(root / "other", "trusted.t", b"1")
    assert compare_trees(left, right, check_mtime=False) == []
    os.chown(right / "file", 1, 2)
    (right / "dev").unlink()
    os.mknod(right / "dev", stat.S_IFCHR | 0o600, os.makedev(1, 5))
    os.removexattr(right / "other", "trusted.t")
    diffs = compare_trees(left, right, check_mtime=False)
    assert "/file: uid expected 0, actual 1" in diffs
    assert "/file: gid expected 0, actual 2" in diffs
    assert "/dev: device expected 1:3, actual 1:5" in diffs
    assert any("xattr trusted.t missing" in d for d in diffs), diffs


def test_compare_trees_finds_one_byte_in_sparse_gigabytes(tmp_path: Path) -> None:
    left, right = tmp_path / "left", tmp_path / "right"
    size = 8 << 30
    for root in (left, right):
        root.mkdir()
        with open(root / "sparse", "wb") as f:
            f.truncate(size)
            f.seek(5 << 30)
            f.write(b"data")
    assert compare_trees(left, right, check_mtime=False) == []
    with open(right / "sparse", "r+b") as f:
        f.seek(size - 3)
        f.write(b"!")
    diffs = compare_trees(left, right, check_mtime=False)
    assert diffs == [f"/sparse: content differs from byte {size - 3} (size {size})"]


def test_compare_trees_options(tmp_path: Path) -> None:
    left, right = _twin_trees(tmp_path)
    os.chmod(right, 0o700)
    os.utime(right / "other", ns=(1, 2))
    (right / "extra").touch()
    os.utime(right, ns=(1, 1))
    assert compare_trees(
        left, right, check_mtime=False, check_root_meta=False, ignore=lambda p: p == b"extra"
    ) == []
    diffs = compare_trees(left, right)
    assert "/extra: unexpected regular file" in diffs
    assert any(d.startswith("/: mode expected") for d in diffs)


def test_assert_trees_equal_caps_its_report(tmp_path: Path) -> None:
    left, right = tmp_path / "left", tmp_path / "right"
    left.mkdir()
    right.mkdir()
    for i in range(60):
        (left / f"f{i:02d}").touch()
    with pytest.raises(AssertionError) as exc_info:
        assert_trees_equal(left, right, check_mtime=False)
    message = str(exc_info.value)
    assert message.startswith("60 difference(s)")
    assert "... and 10 more" in message


# --------------------------------------------------------------------------
# the subprocess and erofs-utils helpers


def test_fsck_erofs_reports_a_corrupt_image(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(os.urandom(3 * MIB))
    meta, blob = make_image(src, tmp_path)
    with open(meta, "r+b") as f:
        f.seek(1024)  # the superblock's magic number
        f.write(b"\0\0\0\0")
    with pytest.raises(AssertionError, match="fsck.erofs exited with") as exc_info:
        fsck_erofs(meta, blob)
    assert "superblock" in str(exc_info.value)  # the tool's own words are included


def test_run_raises_with_stderr() -> None:
    with pytest.raises(CommandFailed) as exc_info:
        run(["sh", "-c", "echo to-stderr >&2; exit 3"], timeout=10)
    assert exc_info.value.returncode == 3
    assert "to-stderr" in str(exc_info.value)
    assert run(["sh", "-c", "exit 3"], timeout=10, check=False).returncode == 3


def test_run_timeout_kills_the_process_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild.pid"
    script = f"sleep 60 & echo $! > {pidfile}; echo started >&2; wait"
    with pytest.raises(CommandTimedOut, match="started"):
        run(["sh", "-c", script], timeout=1)
    grandchild = int(pidfile.read_text())
    assert _wait_gone(grandchild, 5.0), f"grandchild {grandchild} survived the timeout"


def _wait_gone(pid: int, seconds: float) -> bool:
    """Whether ``pid`` exits (or is a zombie) within ``seconds``; SIGKILL is asynchronous."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.01)
    return False
