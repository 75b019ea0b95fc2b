"""converters.ocispec without I/O: the one digest rule, manifest kinds, platforms, BlobCheck."""

from __future__ import annotations

import hashlib

import pytest

from converters.errors import ConvertError, DigestMismatch
from converters.ocispec import (
    MT_DOCKER_LIST,
    MT_DOCKER_MANIFEST,
    MT_OCI_INDEX,
    MT_OCI_MANIFEST,
    BlobCheck,
    BlobDigestMismatch,
    BlobSizeMismatch,
    BlobTruncated,
    Descriptor,
    ImageRefError,
    ManifestNotFound,
    Platform,
    PlatformNotFound,
    UnsupportedImage,
    check_digest,
    diff_ids,
    manifest_kind,
    select_platform,
)

DATA = b"layer bytes\n" * 100


def desc(data: bytes = DATA, size: int | None = None) -> Descriptor:
    return Descriptor("x", "sha256:" + hashlib.sha256(data).hexdigest(), len(data) if size is None else size)


@pytest.mark.parametrize(
    "digest",
    ["sha256:" + "A" * 64, "sha256:" + "a" * 63, "sha512:" + "a" * 64, "md5:" + "a" * 32, "sha256" + "a" * 64, 7],
)
def test_one_digest_rule_names_the_field(digest: object) -> None:
    with pytest.raises(UnsupportedImage, match=r"^doc, layer 2: malformed or unsupported digest .*sha256:<64 hex>"):
        check_digest(digest, "doc, layer 2")


def test_digests_that_pass() -> None:
    for digest in ("sha256:" + "0" * 64, "sha512:" + "f" * 128):
        assert check_digest(digest, "x") == digest


def test_manifest_kind_rules() -> None:
    assert manifest_kind({"mediaType": MT_OCI_INDEX}, "m") == (MT_OCI_INDEX, "index")
    assert manifest_kind({}, "m", [MT_DOCKER_MANIFEST]) == (MT_DOCKER_MANIFEST, "manifest")
    # a Content-Type that says nothing is ignored; the shape decides
    assert manifest_kind({"manifests": []}, "m", ["application/json"]) == (MT_OCI_INDEX, "index")
    assert manifest_kind({"layers": []}, "m", [""]) == (MT_OCI_MANIFEST, "manifest")
    with pytest.raises(UnsupportedImage, match="m: the document is a .*manifest.list.*named as .*image.index"):
        manifest_kind({"mediaType": MT_DOCKER_LIST}, "m", [MT_OCI_INDEX])
    with pytest.raises(UnsupportedImage, match="schema 1"):
        manifest_kind({}, "m", ["application/vnd.docker.distribution.manifest.v1+prettyjws"])
    with pytest.raises(UnsupportedImage, match="'application/vnd.example.artifact.v1' is not an image manifest"):
        manifest_kind({"layers": []}, "m", ["application/vnd.example.artifact.v1"])


def test_platform_selection_and_its_errors() -> None:
    amd = Descriptor(MT_OCI_MANIFEST, "sha256:" + "1" * 64, 1, Platform("linux", "amd64"))
    arm = Descriptor(MT_OCI_MANIFEST, "sha256:" + "2" * 64, 1, Platform("linux", "arm64", "v8"))
    assert select_platform([amd, arm], Platform.parse("linux/arm64/v8"), "i") is arm
    with pytest.raises(PlatformNotFound, match=r"^i: no image for platform linux/s390x; available: linux/amd64, linux/arm64/v8"):
        select_platform([amd, arm], Platform.parse("linux/s390x"), "i")
    with pytest.raises(UnsupportedImage, match="i: the index lists no manifests"):
        select_platform([], Platform.parse("linux/amd64"), "i")
    # one tree: what names nothing is an ImageRefError, and a FileNotFoundError where it is missing
    assert issubclass(PlatformNotFound, ImageRefError)
    assert issubclass(PlatformNotFound, LookupError)
    assert issubclass(ManifestNotFound, ImageRefError)
    assert issubclass(ManifestNotFound, FileNotFoundError)
    assert issubclass(ImageRefError, ConvertError)
    assert issubclass(ImageRefError, ValueError)


def test_diff_ids_must_be_one_valid_digest_per_layer() -> None:
    good = "sha256:" + "3" * 64
    assert diff_ids({"rootfs": {"diff_ids": [good]}}, 1, "c") == (good,)
    with pytest.raises(UnsupportedImage, match="c: rootfs.diff_ids lists no diff ids for 1 layers"):
        diff_ids({}, 1, "c")
    with pytest.raises(UnsupportedImage, match=r"c, rootfs.diff_ids\[1\]: malformed"):
        diff_ids({"rootfs": {"diff_ids": [good, "sha256:xyz"]}}, 2, "c")


def test_blob_check_judges_size_and_digest() -> None:
    check = BlobCheck(desc(), "src: blob d")
    check.update(DATA[:500])
    short = check.problem()
    assert isinstance(short, BlobSizeMismatch)
    assert not isinstance(short, BlobTruncated)
    assert f"src: blob d: expected {len(DATA)} bytes, read 500" in str(short)
    check.update(DATA[500:])
    assert check.problem() is None
    assert check.actual == desc().digest

    other = DATA[:-1] + b"?"
    wrong = BlobCheck(desc(), "src: blob d")
    wrong.update(other)
    problem = wrong.problem()
    assert isinstance(problem, BlobDigestMismatch)
    assert isinstance(problem, DigestMismatch)
    assert (problem.expected, problem.actual) == (desc().digest, desc(other).digest)
    assert f"expected digest {desc().digest}, got {desc(other).digest}" in str(problem)

    download = BlobCheck(desc(), "registry r: repo blob d", short=BlobTruncated)
    download.update(DATA[:10])
    truncated = download.problem()
    assert isinstance(truncated, BlobTruncated)
    assert truncated.retryable
    with pytest.raises(BlobSizeMismatch, match="more than the 10 bytes its descriptor names"):
        BlobCheck(desc(size=10), "b").update(DATA)
