"""The real Debian image from ../shared/fixtures, converted layer by layer and run.

The `python` tag's three layers, mounted as EROFS and stacked with overlayfs
(lowest first), must show the deletions of its top layer, and programs from
the image must run in a chroot of the merged tree.  The minbase layer is also
compared byte for byte with what GNU tar extracts from the same layer blob.
"""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

import pytest

from converters.oci import convert_image
from tests.support.env import FIXTURE_IMAGE, in_ci
from tests.support.erofs_tools import fsck_erofs
from tests.support.proc import run
from tests.support.treecmp import assert_trees_equal

FIXTURE = FIXTURE_IMAGE

pytestmark = pytest.mark.usefixtures("need_root")


@pytest.fixture(scope="module")
def fixture_tar() -> Path:
    if not FIXTURE.exists():
        reason = f"{FIXTURE} is absent (the shared fixtures are not beside this checkout)"
        if in_ci():
            pytest.fail(reason)
        pytest.skip(reason)
    return FIXTURE


@pytest.fixture(scope="module")
def python_image(fixture_tar: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("python-image")
    convert_image(f"oci-archive:{fixture_tar}:python", out)
    return out


def _layers(image_dir: Path) -> list[tuple[Path, Path]]:
    doc = json.loads((image_dir / "image.json").read_text())
    return [(image_dir / layer["meta"], image_dir / layer["blob"]) for layer in doc["layers"]]


def _chroot(root: Path, *argv: str) -> str:
    result = run(["unshare", "--mount", "--propagation", "private", "/usr/sbin/chroot", str(root), *argv],
                 timeout=120, env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"})
    return result.stdout.decode()


def test_python_image_layers_stack_and_run(mounts, python_image: Path) -> None:
    layers = _layers(python_image)
    assert len(layers) == 3
    for meta, blob in layers:
        fsck_erofs(meta, blob)
    lowers = [mounts.erofs(meta, blob) for meta, blob in layers]
    merged = mounts.overlay(lowers)

    # the top layer deletes /usr/share/doc/* and /usr/share/man, replaces apt.conf.d
    assert (lowers[0] / "usr/share/man").is_dir()
    assert not (merged / "usr/share/man").exists()
    assert os.listdir(merged / "usr/share/doc") == []
    assert os.listdir(lowers[1] / "usr/share/doc")
    assert sorted(os.listdir(merged / "etc/apt/apt.conf.d")) != sorted(os.listdir(lowers[0] / "etc/apt/apt.conf.d"))
    calc = merged / "workspace/calc"
    assert calc.is_dir()
    assert os.lstat(calc).st_uid == 1000
    assert any(os.lstat(p).st_mode & 0o4000 for p in calc.rglob("*") if p.is_file())

    os_release = _chroot(merged, "/bin/cat", "/etc/os-release")
    assert 'VERSION_CODENAME=bookworm' in os_release
    tests_out = run(
        ["unshare", "--mount", "--propagation", "private", "/usr/sbin/chroot", str(merged),
         "/usr/bin/python3", "-B", "-m", "unittest", "discover", "-s", "/workspace/calc/tests"],
        timeout=120, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
    )
    assert b"OK" in tests_out.stderr, tests_out.stderr.decode()


def test_minbase_layer_equals_gnu_tar_extraction(mounts, fixture_tar: Path, tmp_path: Path) -> None:
    out = tmp_path / "minbase"
    convert_image(f"oci-archive:{fixture_tar}:minbase", out)
    (meta, blob), = _layers(out)
    doc = json.loads((out / "image.json").read_text())
    layer_digest = doc["layers"][0]["oci"]["digest"].split(":", 1)[1]
    # the oracle: GNU tar extracting the very same layer blob, as root, with all metadata
    with tarfile.open(fixture_tar) as outer:
        member = outer.getmember(f"./blobs/sha256/{layer_digest}")
        (tmp_path / "layer.tar.gz").write_bytes(outer.extractfile(member).read())  # type: ignore[union-attr]
    expected = tmp_path / "expected"
    expected.mkdir()
    run(["tar", "--xattrs", "--xattrs-include=*", "--numeric-owner", "-xpzf", str(tmp_path / "layer.tar.gz"),
         "-C", str(expected)], timeout=600)
    mnt = mounts.erofs(meta, blob)
    assert_trees_equal(expected, mnt)
