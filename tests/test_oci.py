"""converters.oci: image references, layouts, platform selection, digests, image.json.

The real Debian fixture (an oci-archive with tags ``minbase`` and ``python``) is
converted through every transport; small synthetic layouts built here cover the
media types, compressions, indexes and corruptions the fixture does not have.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import tarfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import zstandard
from support.env import FIXTURE_IMAGE, in_ci, require
from support.proc import run

from converters.errors import BadArchive, ConvertError, DigestMismatch
from converters.oci import (
    IMAGE_SCHEMA,
    convert_image,
    inspect_image,
    parse_image_ref,
)
from converters.ocispec import (
    MT_DOCKER_CONFIG,
    MT_DOCKER_LAYER_GZIP,
    MT_DOCKER_LAYER_TAR,
    MT_DOCKER_LIST,
    MT_DOCKER_MANIFEST,
    MT_OCI_CONFIG,
    MT_OCI_INDEX,
    MT_OCI_MANIFEST,
    REF_NAME,
    BlobNotFound,
    DiffIdMismatch,
    ImageRefError,
    LayerDigestMismatch,
    SourceNotFound,
    UnsupportedImage,
    chain_id,
    chain_ids,
    host_platform,
)

FIXTURES = FIXTURE_IMAGE.parent
ARCHIVE = FIXTURES / "debian-bookworm.oci.tar"

MT_LAYER = "application/vnd.oci.image.layer.v1.tar"
MT_LAYER_GZIP = MT_LAYER + "+gzip"
MT_LAYER_ZSTD = MT_LAYER + "+zstd"




# -- helpers: synthetic layouts ------------------------------------------------


def tar_bytes(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            info.mtime = 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def compress(data: bytes, kind: str) -> bytes:
    if kind == "gzip":
        return gzip.compress(data, mtime=0)
    if kind == "zstd":
        return zstandard.ZstdCompressor().compress(data)
    return data


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Layout:
    """Writes an OCI image layout under ``root``, one blob at a time."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "blobs" / "sha256").mkdir(parents=True)
        (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')

    def blob(self, data: bytes, media_type: str, **extra: Any) -> dict[str, Any]:
        digest = sha256(data)
        (self.root / "blobs" / "sha256" / digest[7:]).write_bytes(data)
        return {"mediaType": media_type, "digest": digest, "size": len(data), **extra}

    def json_blob(self, doc: dict[str, Any], media_type: str, **extra: Any) -> dict[str, Any]:
        return self.blob(json.dumps(doc).encode(), media_type, **extra)

    def image(
        self,
        layers: list[tuple[bytes, str, str]],
        *,
        arch: str = "amd64",
        manifest_type: str = MT_OCI_MANIFEST,
        config_type: str = MT_OCI_CONFIG,
        diff_ids: list[str] | None = None,
    ) -> dict[str, Any]:
        """``layers`` are (uncompressed tar, compression, media type); returns the manifest descriptor.

        ``diff_ids`` replaces the config's (correct) ``rootfs.diff_ids``.
        """
        config = {
            "architecture": arch,
            "os": "linux",
            "config": {"Env": ["PATH=/usr/bin:/bin"], "Cmd": ["/bin/sh"], "WorkingDir": "/w"},
            "rootfs": {"type": "layers", "diff_ids": diff_ids or [sha256(t) for t, _, _ in layers]},
        }
        manifest = {
            "schemaVersion": 2,
            "mediaType": manifest_type,
            "config": self.json_blob(config, config_type),
            "layers": [self.blob(compress(t, kind), mt) for t, kind, mt in layers],
        }
        return self.json_blob(
            manifest, manifest_type, platform={"architecture": arch, "os": "linux"}
        )

    def index(self, manifests: list[dict[str, Any]], media_type: str = MT_OCI_INDEX) -> None:
        doc = {"schemaVersion": 2, "mediaType": media_type, "manifests": manifests}
        (self.root / "index.json").write_text(json.dumps(doc))

    def blob_path(self, desc: dict[str, Any]) -> Path:
        return self.root / "blobs" / "sha256" / desc["digest"][7:]


def tagged(desc: dict[str, Any], tag: str) -> dict[str, Any]:
    return {**desc, "annotations": {REF_NAME: tag}}


def layer_of(desc_or_doc: dict[str, Any], layout: Layout) -> list[dict[str, Any]]:
    return json.loads(layout.blob_path(desc_or_doc).read_bytes())["layers"]


def read_image_json(out: Path) -> dict[str, Any]:
    return json.loads((out / "image.json").read_text())


def left_behind(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())


TAR_A = tar_bytes({"etc/hello": b"hello from layer a\n", "bin/tool": b"\x7fELF" + b"x" * 5000})
TAR_B = tar_bytes({"etc/motd": b"layer b\n"})


# -- references ------------------------------------------------------------------


def test_parse_image_ref_forms(tmp_path: Path) -> None:
    archive = tmp_path / "img.tar"
    archive.write_bytes(b"")
    assert parse_image_ref(f"oci:{tmp_path}").reference is None
    src = parse_image_ref(f"oci:{tmp_path}:v1")
    assert (src.transport, src.path, src.reference) == ("oci", tmp_path, "v1")
    assert str(src) == f"oci:{tmp_path}:v1"
    src = parse_image_ref(f"oci-archive:{archive}:python")
    assert (src.transport, src.reference) == ("oci-archive", "python")
    # a docker reference keeps its own ':' (the path ends at the first one, as in skopeo)
    src = parse_image_ref(f"docker-archive:{archive}:python:latest")
    assert (src.transport, src.reference) == ("docker-archive", "python:latest")
    assert parse_image_ref(f"docker-archive:{archive}:@1").reference == "@1"


def test_unknown_scheme_is_named() -> None:
    with pytest.raises(ImageRefError, match=r"unknown image reference scheme 'dir:'.*oci-archive"):
        parse_image_ref("dir:/tmp/somewhere")
    with pytest.raises(ImageRefError, match="unknown image reference scheme"):
        parse_image_ref("just-a-path.tar")


def test_missing_file_or_directory(tmp_path: Path) -> None:
    with pytest.raises(SourceNotFound, match="no such file"):
        parse_image_ref(f"oci-archive:{tmp_path / 'nope.tar'}:x")
    with pytest.raises(SourceNotFound, match="no such directory"):
        parse_image_ref(f"oci:{tmp_path / 'nope'}")
    with pytest.raises(SourceNotFound, match="not a file"):
        parse_image_ref(f"docker-archive:{tmp_path}")
    assert issubclass(SourceNotFound, FileNotFoundError)


# -- synthetic OCI layouts ---------------------------------------------------------


def test_gzip_zstd_and_plain_layers(tmp_path: Path) -> None:
    lay = Layout(tmp_path / "layout")
    kinds = {"plain": MT_LAYER, "gzip": MT_LAYER_GZIP, "zstd": MT_LAYER_ZSTD}
    lay.index([tagged(lay.image([(TAR_A, kind, mt)]), kind) for kind, mt in kinds.items()])
    digests = set()
    for kind, media_type in kinds.items():
        out = tmp_path / kind
        result = convert_image(f"oci:{lay.root}:{kind}", out)
        doc = read_image_json(out)
        assert doc == result.to_json()
        (layer,) = doc["layers"]
        assert layer["oci"]["mediaType"] == media_type
        assert layer["oci"]["size"] == len(compress(TAR_A, kind))
        assert layer["stats"]["files"] >= 3
        assert layer["stats"]["bytes"] == 19 + 5004
        assert (out / layer["meta"]).is_file()
        assert (out / layer["blob"]).is_file()
        digests.add(layer["digest"])
    # the same tar, whatever its compression, is the same layer
    assert len(digests) == 1


def test_image_json_schema(tmp_path: Path) -> None:
    lay = Layout(tmp_path / "layout")
    desc = lay.image([(TAR_A, "gzip", MT_LAYER_GZIP), (TAR_B, "zstd", MT_LAYER_ZSTD)])
    lay.index([tagged(desc, "v1")])
    out = tmp_path / "out"
    ref = f"oci:{lay.root}:v1"
    result = convert_image(ref, out, chunk_size=1 << 16)
    doc = read_image_json(out)
    assert doc["schema"] == IMAGE_SCHEMA
    assert doc["source"] == {
        "ref": ref,
        "transport": "oci",
        "manifest_digest": desc["digest"],
        "manifest_media_type": MT_OCI_MANIFEST,
        "config_digest": result.config_digest,
        "platform": "linux/amd64",
    }
    assert doc["config"]["config"]["Cmd"] == ["/bin/sh"]
    assert doc["config"]["config"]["WorkingDir"] == "/w"
    oci_layers = layer_of(desc, lay)
    assert [entry["oci"]["digest"] for entry in doc["layers"]] == [d["digest"] for d in oci_layers]
    first, second = doc["layers"]
    assert first["meta"] == f"layers/001-{oci_layers[0]['digest'][7:19]}.erofs"
    assert second["blob"] == f"layers/002-{oci_layers[1]['digest'][7:19]}.blob"
    for entry in doc["layers"]:
        assert entry["digest"].startswith("blake3:")
        assert entry["blob_digest"].startswith("blake3:")
        assert set(entry["stats"]) == {
            "files", "bytes", "chunks", "unique_chunks", "unique_bytes", "seconds"
        }
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "temp files left behind"
    assert (out / "image.json").stat().st_mode & 0o777 == 0o644


def test_index_with_two_platforms(tmp_path: Path) -> None:
    lay = Layout(tmp_path / "layout")
    amd = lay.image([(TAR_A, "gzip", MT_LAYER_GZIP)], arch="amd64")
    arm = lay.image([(TAR_B, "gzip", MT_LAYER_GZIP)], arch="arm64")
    index = lay.json_blob({"schemaVersion": 2, "manifests": [amd, arm]}, MT_OCI_INDEX)
    lay.index([tagged(index, "multi")])
    ref = f"oci:{lay.root}:multi"

    result = convert_image(ref, tmp_path / "arm", platform="linux/arm64")
    assert result.platform == "linux/arm64"
    assert result.manifest_digest == arm["digest"]
    assert [x.oci_digest for x in result.layers] == [layer_of(arm, lay)[0]["digest"]]

    assert inspect_image(ref, platform="linux/amd64").manifest_digest == amd["digest"]
    host = host_platform()
    if host.architecture in ("amd64", "arm64"):  # the default is this host's platform
        want = amd if host.architecture == "amd64" else arm
        assert inspect_image(ref).manifest_digest == want["digest"]

    with pytest.raises(ImageRefError, match=r"linux/s390x.*available: linux/amd64, linux/arm64"):
        convert_image(ref, tmp_path / "none", platform="linux/s390x")
    assert not (tmp_path / "none" / "image.json").exists()
    with pytest.raises(ImageRefError, match="OS/ARCH"):
        inspect_image(ref, platform="amd64")


def test_untagged_platform_index_at_top_level(tmp_path: Path) -> None:
    lay = Layout(tmp_path / "layout")
    amd = lay.image([(TAR_A, "plain", MT_LAYER)], arch="amd64")
    arm = lay.image([(TAR_B, "plain", MT_LAYER)], arch="arm64")
    lay.index([amd, arm])
    image = inspect_image(f"oci:{lay.root}", platform="linux/arm64")
    assert image.manifest_digest == arm["digest"]


def test_docker_v2_media_types(tmp_path: Path) -> None:
    lay = Layout(tmp_path / "layout")
    desc = lay.image(
        [(TAR_A, "gzip", MT_DOCKER_LAYER_GZIP), (TAR_B, "plain", MT_DOCKER_LAYER_TAR)],
        manifest_type=MT_DOCKER_MANIFEST,
        config_type=MT_DOCKER_CONFIG,
    )
    mlist = lay.json_blob(
        {"schemaVersion": 2, "mediaType": MT_DOCKER_LIST, "manifests": [desc]}, MT_DOCKER_LIST
    )
    lay.index([tagged(mlist, "docker")])
    out = tmp_path / "out"
    result = convert_image(f"oci:{lay.root}:docker", out, platform="linux/amd64")
    doc = read_image_json(out)
    assert doc["source"]["manifest_media_type"] == MT_DOCKER_MANIFEST
    assert [x["oci"]["mediaType"] for x in doc["layers"]] == [MT_DOCKER_LAYER_GZIP, MT_DOCKER_LAYER_TAR]
    assert result.config["config"]["Env"] == ["PATH=/usr/bin:/bin"]


def test_identical_layers_are_converted_once(tmp_path: Path) -> None:
    lay = Layout(tmp_path / "layout")
    desc = lay.image([(TAR_A, "gzip", MT_LAYER_GZIP), (TAR_B, "gzip", MT_LAYER_GZIP),
                      (TAR_A, "gzip", MT_LAYER_GZIP)])
    lay.index([tagged(desc, "dup")])
    out = tmp_path / "out"
    result = convert_image(f"oci:{lay.root}:dup", out)
    first, second, third = result.layers
    # the same layer files and diff id; the chain id is the position's own (it covers the layers below)
    assert replace(first, chain_id=third.chain_id) == third
    chain1 = sha256(TAR_A)
    chain2 = sha256(f"{chain1} {sha256(TAR_B)}".encode())
    assert [first.chain_id, second.chain_id, third.chain_id] == [
        chain1, chain2, sha256(f"{chain2} {sha256(TAR_A)}".encode())
    ]
    assert first.meta.startswith("layers/001-")
    assert len(list((out / "layers").iterdir())) == 4  # two layers, meta + blob each


def test_missing_tag_lists_the_tags(tmp_path: Path) -> None:
    lay = Layout(tmp_path / "layout")
    desc = lay.image([(TAR_B, "plain", MT_LAYER)])
    lay.index([tagged(desc, "one"), tagged(desc, "two")])
    with pytest.raises(ImageRefError, match=r"no image tagged 'three'; available tags: one, two"):
        convert_image(f"oci:{lay.root}:three", tmp_path / "out")
    with pytest.raises(ImageRefError, match=r"holds 2 images; name one.*one, two"):
        inspect_image(f"oci:{lay.root}")
    lay.index([desc])  # a single untagged image needs no tag
    assert inspect_image(f"oci:{lay.root}").manifest_digest == desc["digest"]
    assert not (tmp_path / "out").exists() or not left_behind(tmp_path / "out")


def test_not_a_layout(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text("[]")
    with pytest.raises(UnsupportedImage, match="no oci-layout.*docker-archive"):
        inspect_image(f"oci:{tmp_path}")


def test_non_image_media_type_is_refused(tmp_path: Path) -> None:
    lay = Layout(tmp_path / "layout")
    config = lay.json_blob({}, MT_OCI_CONFIG)
    layer = lay.blob(b"{}", "application/vnd.example.sbom+json")
    manifest = lay.json_blob(
        {"schemaVersion": 2, "mediaType": MT_OCI_MANIFEST, "config": config, "layers": [layer]},
        MT_OCI_MANIFEST,
    )
    lay.index([tagged(manifest, "sbom")])
    with pytest.raises(UnsupportedImage, match="layer 1 has media type 'application/vnd.example.sbom"):
        inspect_image(f"oci:{lay.root}:sbom")


def test_missing_blob(tmp_path: Path) -> None:
    lay = Layout(tmp_path / "layout")
    desc = lay.image([(TAR_A, "gzip", MT_LAYER_GZIP)])
    lay.index([tagged(desc, "x")])
    lay.blob_path(layer_of(desc, lay)[0]).unlink()
    with pytest.raises(BlobNotFound, match="blobs/sha256/"):
        convert_image(f"oci:{lay.root}:x", tmp_path / "out")
    assert not (tmp_path / "out" / "image.json").exists()


# -- corruption ----------------------------------------------------------------------


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if offset is None else offset
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("kind", ["plain", "gzip", "zstd"])
def test_corrupt_layer_leaves_nothing(tmp_path: Path, kind: str) -> None:
    lay = Layout(tmp_path / "layout")
    mt = {"plain": MT_LAYER, "gzip": MT_LAYER_GZIP, "zstd": MT_LAYER_ZSTD}[kind]
    desc = lay.image([(TAR_B, kind, mt), (TAR_A, kind, mt)])
    lay.index([tagged(desc, "bad")])
    bad = layer_of(desc, lay)[1]
    # plain: inside a file's data, so the tar still parses and only the digest tells;
    # compressed: the decompressor fails first, and the digest is still what is reported
    flip_byte(lay.blob_path(bad), TAR_A.index(b"x" * 100) + 50 if kind == "plain" else None)
    out = tmp_path / "out"
    with pytest.raises(LayerDigestMismatch) as info:
        convert_image(f"oci:{lay.root}:bad", out)
    err = info.value
    assert (err.layer, err.expected) == (2, bad["digest"])
    assert err.actual != bad["digest"]
    msg = str(err)
    assert "layer 2 of 2" in msg
    assert bad["digest"] in msg
    assert err.actual in msg
    assert "corrupt" in msg
    # the converter's own complaint stays attached as the cause
    assert isinstance(err.__cause__, BadArchive) == (kind != "plain")
    assert left_behind(out) == [], "layer 1 files or image.json survived a failed conversion"


def independent_chain_ids(diff_ids: list[str]) -> list[str]:
    """The OCI image spec's ChainID, written out with hashlib (not the code under test)."""
    chain = [diff_ids[0]]
    for diff_id in diff_ids[1:]:
        chain.append("sha256:" + hashlib.sha256(f"{chain[-1]} {diff_id}".encode()).hexdigest())
    return chain


def test_chain_ids_of_a_known_image() -> None:
    # diff ids of a two-layer image, and the chain id sha256("<diff0> <diff1>") computed by hand
    a, b = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    top = "sha256:" + hashlib.sha256(("sha256:" + "a" * 64 + " sha256:" + "b" * 64).encode()).hexdigest()
    assert chain_ids([a, b]) == (a, top)
    assert chain_id([a]) == a
    assert chain_id([a, b]) == top
    assert chain_id([a, b, a]) == "sha256:" + hashlib.sha256(f"{top} {a}".encode()).hexdigest()
    with pytest.raises(ValueError, match="no layers"):
        chain_id([])


@pytest.mark.parametrize("kind", ["plain", "gzip", "zstd"])
def test_diff_ids_recorded_and_chain_ids_computed(tmp_path: Path, kind: str) -> None:
    lay = Layout(tmp_path / "layout")
    mt = {"plain": MT_LAYER, "gzip": MT_LAYER_GZIP, "zstd": MT_LAYER_ZSTD}[kind]
    lay.index([tagged(lay.image([(TAR_A, kind, mt), (TAR_B, kind, mt)]), "v")])
    out = tmp_path / "out"
    result = convert_image(f"oci:{lay.root}:v", out)
    diff = [sha256(TAR_A), sha256(TAR_B)]
    oci = [layer["oci"] for layer in read_image_json(out)["layers"]]
    assert [x["diff_id"] for x in oci] == [x.diff_id for x in result.layers] == diff
    assert [x["chain_id"] for x in oci] == [x.chain_id for x in result.layers] == independent_chain_ids(diff)
    if kind == "plain":
        assert [x["digest"] for x in oci] == diff  # an uncompressed layer's digest is its diff id


@pytest.mark.parametrize("kind", ["plain", "gzip", "zstd"])
def test_wrong_diff_id_is_refused_naming_the_layer(tmp_path: Path, kind: str) -> None:
    lay = Layout(tmp_path / "layout")
    mt = {"plain": MT_LAYER, "gzip": MT_LAYER_GZIP, "zstd": MT_LAYER_ZSTD}[kind]
    wrong = sha256(b"not the layer")
    desc = lay.image([(TAR_B, kind, mt), (TAR_A, kind, mt)], diff_ids=[sha256(TAR_B), wrong])
    lay.index([tagged(desc, "bad")])
    bad = layer_of(desc, lay)[1]
    out = tmp_path / "out"
    with pytest.raises(DiffIdMismatch) as info:
        convert_image(f"oci:{lay.root}:bad", out)
    err = info.value
    assert (err.layer, err.digest, err.expected, err.actual) == (2, bad["digest"], wrong, sha256(TAR_A))
    msg = str(err)
    assert "layer 2 of 2" in msg
    assert "rootfs.diff_ids[1]" in msg
    for named in (bad["digest"], wrong, sha256(TAR_A)):
        assert named in msg
    assert isinstance(err, DigestMismatch)
    assert left_behind(out) == [], "a layer with a wrong diff id left files behind"


def test_diff_ids_must_match_the_layer_count(tmp_path: Path) -> None:
    lay = Layout(tmp_path / "layout")
    lay.index([tagged(lay.image([(TAR_A, "gzip", MT_LAYER_GZIP)], diff_ids=[sha256(TAR_A)] * 2), "x")])
    with pytest.raises(UnsupportedImage, match=r"config sha256:[0-9a-f]{64}: rootfs.diff_ids lists 2 diff ids for 1 layers"):
        inspect_image(f"oci:{lay.root}:x")
    lay.index([tagged(lay.image([(TAR_A, "gzip", MT_LAYER_GZIP)], diff_ids=["md5:" + "0" * 32]), "y")])
    with pytest.raises(UnsupportedImage, match=r"rootfs.diff_ids\[0\]: malformed or unsupported digest 'md5:"):
        inspect_image(f"oci:{lay.root}:y")


def test_size_mismatch_is_an_error(tmp_path: Path) -> None:
    lay = Layout(tmp_path / "layout")
    desc = lay.image([(TAR_B, "gzip", MT_LAYER_GZIP)])
    manifest = json.loads(lay.blob_path(desc).read_bytes())
    manifest["layers"][0]["size"] += 1
    desc = lay.json_blob(manifest, MT_OCI_MANIFEST)
    lay.index([tagged(desc, "s")])
    out = tmp_path / "out"
    with pytest.raises(DigestMismatch, match=r"layer 1 of 1 .*expected \d+ bytes, read \d+"):
        convert_image(f"oci:{lay.root}:s", out)
    assert left_behind(out) == []


def test_corrupt_manifest_and_config(tmp_path: Path) -> None:
    lay = Layout(tmp_path / "layout")
    desc = lay.image([(TAR_B, "gzip", MT_LAYER_GZIP)])
    lay.index([tagged(desc, "m")])
    config_path = lay.blob_path(json.loads(lay.blob_path(desc).read_bytes())["config"])
    original = config_path.read_bytes()
    config_path.write_bytes(original.replace(b"/bin/sh", b"/bin/xx"))
    with pytest.raises(DigestMismatch, match=r"config sha256:[0-9a-f]{64}: expected digest .*corrupt"):
        inspect_image(f"oci:{lay.root}:m")
    config_path.write_bytes(original)
    flip_byte(lay.blob_path(desc), 30)
    with pytest.raises(DigestMismatch, match=rf"manifest {desc['digest']}: expected digest"):
        inspect_image(f"oci:{lay.root}:m")


# -- synthetic archives ----------------------------------------------------------------


def tar_directory(src: Path, dest: Path) -> None:
    with tarfile.open(dest, "w") as tar:
        tar.add(src, arcname=".")


def test_synthetic_oci_archive(tmp_path: Path) -> None:
    lay = Layout(tmp_path / "layout")
    lay.index([tagged(lay.image([(TAR_A, "zstd", MT_LAYER_ZSTD)]), "z")])
    archive = tmp_path / "img.tar"
    tar_directory(lay.root, archive)
    from_dir = convert_image(f"oci:{lay.root}:z", tmp_path / "a")
    from_tar = convert_image(f"oci-archive:{archive}:z", tmp_path / "b")
    assert [x.digest for x in from_tar.layers] == [x.digest for x in from_dir.layers]
    assert from_tar.transport == "oci-archive"
    archive.write_bytes(gzip.compress(archive.read_bytes()))
    with pytest.raises(BadArchive, match="not a readable uncompressed tar"):
        inspect_image(f"oci-archive:{archive}:z")


def docker_save_tar(dest: Path, tars: list[bytes], tags: list[str], *, legacy: bool) -> str:
    """A ``docker save`` archive; legacy: ``<id>/layer.tar``, else ``blobs/sha256/<hex>``."""
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Cmd": ["/bin/true"]},
            "rootfs": {"type": "layers", "diff_ids": [sha256(t) for t in tars]},
        }
    ).encode()
    files: dict[str, bytes] = {}
    config_name = f"{sha256(config)[7:]}.json" if legacy else f"blobs/sha256/{sha256(config)[7:]}"
    files[config_name] = config
    layer_names = []
    for i, data in enumerate(tars):
        name = f"{i:064x}/layer.tar" if legacy else f"blobs/sha256/{sha256(data)[7:]}"
        files[name] = data
        layer_names.append(name)
    manifest = [{"Config": config_name, "RepoTags": tags, "Layers": layer_names}]
    files["manifest.json"] = json.dumps(manifest).encode()
    dest.write_bytes(tar_bytes(files))
    return sha256(config)


@pytest.mark.parametrize("legacy", [True, False])
def test_synthetic_docker_archive(tmp_path: Path, legacy: bool) -> None:
    archive = tmp_path / "saved.tar"
    config_digest = docker_save_tar(archive, [TAR_A, TAR_B], ["example.com/app:1.0", "tool:latest"],
                                    legacy=legacy)
    out = tmp_path / "out"
    result = convert_image(f"docker-archive:{archive}:tool", out)  # docker.io/library/tool:latest
    assert result.manifest_digest is None
    assert result.config_digest == config_digest
    doc = read_image_json(out)
    assert [x["oci"]["digest"] for x in doc["layers"]] == [sha256(TAR_A), sha256(TAR_B)]
    assert [x["oci"]["mediaType"] for x in doc["layers"]] == [MT_DOCKER_LAYER_TAR] * 2
    assert doc["config"]["config"]["Cmd"] == ["/bin/true"]
    assert inspect_image(f"docker-archive:{archive}:example.com/app:1.0").config_digest == config_digest
    assert inspect_image(f"docker-archive:{archive}:@0").config_digest == config_digest
    assert inspect_image(f"docker-archive:{archive}").config_digest == config_digest
    with pytest.raises(ImageRefError, match=r"no image tagged 'other'.*example.com/app:1.0, tool:latest"):
        inspect_image(f"docker-archive:{archive}:other")
    with pytest.raises(ImageRefError, match="no image @3"):
        inspect_image(f"docker-archive:{archive}:@3")


def test_docker_archive_corrupt_layer(tmp_path: Path) -> None:
    archive = tmp_path / "saved.tar"
    docker_save_tar(archive, [TAR_B, TAR_A], ["app:1"], legacy=True)
    data = bytearray(archive.read_bytes())
    at = data.find(b"\x7fELFxxxx") + 100  # inside TAR_A's file data, inside the outer tar
    data[at] ^= 0x01
    archive.write_bytes(bytes(data))
    out = tmp_path / "out"
    with pytest.raises(LayerDigestMismatch, match="layer 2 of 2") as info:
        convert_image(f"docker-archive:{archive}:app:1", out)
    assert info.value.expected == sha256(TAR_A)
    assert left_behind(out) == []


# -- the real Debian fixture -----------------------------------------------------------------


@pytest.fixture(scope="module")
def archive() -> Path:
    if not ARCHIVE.is_file():
        reason = f"the Debian fixture {ARCHIVE} is not there"
        if in_ci():
            pytest.fail(f"CI=true but {reason}", pytrace=False)
        pytest.skip(reason)
    return ARCHIVE


def fixture_manifest(archive: Path, tag: str) -> tuple[str, dict[str, Any]]:
    """The manifest digest and document for ``tag``, read with tarfile alone."""
    with tarfile.open(archive) as tar:

        def member(name: str) -> bytes:
            f = tar.extractfile("./" + name)
            assert f is not None
            return f.read()

        index = json.loads(member("index.json"))
        (desc,) = [m for m in index["manifests"] if m["annotations"][REF_NAME] == tag]
        return desc["digest"], json.loads(member("blobs/sha256/" + desc["digest"][7:]))


def fixture_config(archive: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """The image config a manifest names, read with tarfile alone."""
    with tarfile.open(archive) as tar:
        f = tar.extractfile("./blobs/sha256/" + manifest["config"]["digest"][7:])
        assert f is not None
        return json.loads(f.read())


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("oci")
    yield path
    shutil.rmtree(path)  # about 1 GB of converted layers and archives: do not keep it around


@pytest.fixture(scope="module")
def minbase(archive: Path, work: Path) -> dict[str, Any]:
    convert_image(f"oci-archive:{archive}:minbase", work / "minbase")
    return read_image_json(work / "minbase")


@pytest.fixture(scope="module")
def python(archive: Path, work: Path) -> dict[str, Any]:
    convert_image(f"oci-archive:{archive}:python", work / "python")
    return read_image_json(work / "python")


@pytest.fixture(scope="module")
def unpacked(archive: Path, work: Path) -> Path:
    dest = work / "layout"
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    return dest


def test_fixture_minbase(archive: Path, minbase: dict[str, Any]) -> None:
    digest, manifest = fixture_manifest(archive, "minbase")
    assert minbase["source"]["manifest_digest"] == digest
    assert minbase["source"]["platform"] == "linux/amd64"
    (layer,) = minbase["layers"]
    (diff_id,) = fixture_config(archive, manifest)["rootfs"]["diff_ids"]
    assert layer["oci"] == {
        "digest": manifest["layers"][0]["digest"],
        "mediaType": manifest["layers"][0]["mediaType"],
        "size": manifest["layers"][0]["size"],
        "diff_id": diff_id,
        "chain_id": diff_id,  # ChainID(L0) = DiffID(L0)
    }
    assert layer["stats"]["files"] > 5000
    assert layer["stats"]["bytes"] > 100_000_000


def test_fixture_python(archive: Path, work: Path, minbase: dict[str, Any],
                        python: dict[str, Any]) -> None:
    digest, manifest = fixture_manifest(archive, "python")
    assert python["schema"] == IMAGE_SCHEMA
    assert python["source"]["ref"] == f"oci-archive:{archive}:python"
    assert python["source"]["manifest_digest"] == digest
    assert python["source"]["config_digest"] == manifest["config"]["digest"]
    config = python["config"]["config"]
    assert config["Cmd"] == ["/bin/bash"]
    assert any(env.startswith("PATH=/usr/local/sbin:") for env in config["Env"])
    layers = python["layers"]
    assert len(layers) == 3
    assert [x["oci"]["digest"] for x in layers] == [x["digest"] for x in manifest["layers"]]
    # the shared base layer converts to the same layer in both images
    assert layers[0]["digest"] == minbase["layers"][0]["digest"]
    assert layers[0]["blob_digest"] == minbase["layers"][0]["blob_digest"]
    assert len({x["digest"] for x in layers}) == 3
    for entry in layers:
        assert (work / "python" / entry["meta"]).stat().st_size > 0
        assert (work / "python" / entry["blob"]).is_file()
    # layer 3 is the small change layer: whiteouts, /workspace/calc
    assert layers[2]["stats"]["bytes"] < 10_000
    assert layers[2]["oci"]["size"] < 10_000


def test_fixture_diff_ids_and_chain_ids(archive: Path, python: dict[str, Any]) -> None:
    _, manifest = fixture_manifest(archive, "python")
    diff_ids = fixture_config(archive, manifest)["rootfs"]["diff_ids"]
    assert len(diff_ids) == 3
    oci = [x["oci"] for x in python["layers"]]
    assert [x["diff_id"] for x in oci] == diff_ids
    assert [x["chain_id"] for x in oci] == independent_chain_ids(diff_ids)
    # gzip layers: the diff id is of the uncompressed tar, not the blob
    assert all(x["diff_id"] != x["digest"] for x in oci)


def test_fixture_as_oci_directory(unpacked: Path, work: Path, python: dict[str, Any]) -> None:
    result = convert_image(f"oci:{unpacked}:python", work / "python-dir")
    assert result.manifest_digest == python["source"]["manifest_digest"]
    assert [x.digest for x in result.layers] == [x["digest"] for x in python["layers"]]


def test_fixture_as_docker_archive(archive: Path, work: Path, python: dict[str, Any]) -> None:
    require("cmd:skopeo")  # Debian's skopeo (apt-get install -y skopeo)
    saved = work / "python-docker.tar"
    run(
        ["skopeo", "--insecure-policy", "copy", "--quiet", f"oci-archive:{archive}:python",
         f"docker-archive:{saved}:python:latest"],
        timeout=600, env={**os.environ, "TMPDIR": str(work)},
    )
    out = work / "python-docker"
    result = convert_image(f"docker-archive:{saved}:python:latest", out)
    doc = read_image_json(out)
    assert result.manifest_digest is None
    assert doc["source"]["config_digest"] == python["source"]["config_digest"]
    assert doc["config"] == python["config"]
    diff_ids = python["config"]["rootfs"]["diff_ids"]
    # skopeo stores the layers uncompressed: their digests are the config's diff_ids
    assert [x["oci"]["digest"] for x in doc["layers"]] == diff_ids
    assert {x["oci"]["mediaType"] for x in doc["layers"]} == {MT_DOCKER_LAYER_TAR}
    # the same tar content, gzip or not, makes the same layers
    assert [x["digest"] for x in doc["layers"]] == [x["digest"] for x in python["layers"]]


def test_fixture_corrupt_layer(unpacked: Path, work: Path, python: dict[str, Any]) -> None:
    corrupt = work / "corrupt-layout"
    shutil.copytree(unpacked, corrupt, copy_function=os.link)  # hard links: no 86 MB copy
    bad = python["layers"][2]["oci"]["digest"]
    blob = corrupt / "blobs" / "sha256" / bad[7:]
    data = bytearray(blob.read_bytes())  # replaces the link, the shared copy stays intact
    data[len(data) // 2] ^= 0xFF
    blob.unlink()
    blob.write_bytes(bytes(data))
    out = work / "corrupt-out"
    with pytest.raises(LayerDigestMismatch) as info:
        convert_image(f"oci:{corrupt}:python", out)
    err = info.value
    assert isinstance(err, DigestMismatch)
    assert isinstance(err, ConvertError)
    assert (err.layer, err.expected) == (3, bad)
    msg = str(err)
    assert "layer 3 of 3" in msg
    assert bad in msg
    assert err.actual in msg
    assert "corrupt" in msg
    assert left_behind(out) == [], "a failed conversion left files behind"


def test_fixture_missing_tag(archive: Path) -> None:
    with pytest.raises(ImageRefError, match="no image tagged 'nope'; available tags: minbase, python"):
        inspect_image(f"oci-archive:{archive}:nope")
    with pytest.raises(ImageRefError, match="available tags: minbase, python"):
        inspect_image(f"oci-archive:{archive}")
    with pytest.raises(UnsupportedImage, match="not a docker-archive.*oci-archive:"):
        inspect_image(f"docker-archive:{archive}")
