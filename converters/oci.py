"""Image sources: OCI image layouts (directory or tar), ``docker save`` archives, registries.

An image reference uses skopeo's syntax::

    oci:DIR[:TAG]                 an OCI image layout directory
    oci-archive:FILE[:TAG]        the same layout inside a tar file (read in place, never unpacked)
    docker-archive:FILE[:REF]     a ``docker save`` tar; REF is ``name[:tag]`` or ``@N`` (N-th image)
    docker://HOST[:PORT]/REPO[:TAG|@DIGEST]
                                  an image in an OCI distribution registry (converters.registry)

As in skopeo, the path ends at the first ``:`` after the scheme.  A TAG is matched
against the ``org.opencontainers.image.ref.name`` annotation of the layout's
``index.json``; it may be left out when the index holds exactly one image.

What the documents mean (media types, descriptors, platforms, manifests,
configs, diff ids, chain ids) and every error raised here are defined once, in
:mod:`converters.ocispec`.  Each source is a :class:`converters.ocispec.BlobSource`
whose ``open_blob(desc)`` hands out a verifying reader (:class:`VerifyingReader`
over a file of a layout or archive, :class:`converters.registry.BlobStream`
over a download), so one function, :func:`_convert_layer`, converts the layers
of all four.  Every blob that is read (manifest, config, layer) is hashed while
it streams and compared with the digest and size its descriptor names; a
layer's check is the ``verify`` callback of :func:`converters.layer.convert_stream`,
followed by the check of its uncompressed tar against the config's
``rootfs.diff_ids``, so a corrupt layer never gets its final name.
``convert_image`` writes ``image.json`` last (temp file, fsync, rename), so a
directory holding an ``image.json`` holds a complete image.

Images from a registry are never copied to disk whole: each layer streams from
the registry straight into ``convert_stream``.
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Protocol

from converters.errors import BadArchive, ConvertError
from converters.layer import LayerResult, convert_stream
from converters.ocispec import (
    DIGEST_HEX,
    MAX_CONFIG_BYTES,
    MAX_INDEX_DEPTH,
    MAX_MANIFEST_BYTES,
    MT_DOCKER_CONFIG,
    MT_DOCKER_LAYER_GZIP,
    MT_DOCKER_LAYER_TAR,
    MT_OCI_LAYER_ZSTD,
    BlobCheck,
    BlobMismatch,
    BlobNotFound,
    BlobSource,
    Descriptor,
    DiffIdMismatch,
    ImageRefError,
    LayerDigestMismatch,
    ManifestNotFound,
    ManifestTooLarge,
    OciError,
    Platform,
    Reference,
    SourceNotFound,
    UnsupportedImage,
    VerifyingStream,
    chain_ids,
    check_digest,
    check_size,
    config_platform,
    diff_ids,
    index_entries,
    manifest_kind,
    parse_json,
    parse_manifest,
    parse_reference,
    select_platform,
    want_platform,
)
from converters.registry import RegistryImage, SyncRegistryClient

IMAGE_SCHEMA = "layerbox.converted-image.v1"
TRANSPORTS = ("oci", "oci-archive", "docker-archive", "docker")
READ_SIZE = 1 << 20
CORRUPT_HINT = "the archive is corrupt, export or download it again"

_HEX64_RE = re.compile(r"^[0-9a-f]{64}$")


# -- references --------------------------------------------------------------


@dataclass(frozen=True)
class ImageSource:
    """A parsed image reference: where the image is and which one of its images.

    ``reference`` is the tag (oci, oci-archive) or ``name[:tag]`` / ``@N``
    (docker-archive), ``None`` when the reference leaves it out; for a registry
    (docker) it is the digest or tag, ``path`` is ``None`` and ``remote`` the
    parsed registry reference.
    """

    transport: str
    path: Path | None
    reference: str | None
    remote: Reference | None = None

    def __str__(self) -> str:
        if self.remote is not None:
            return f"{self.transport}://{self.remote}"
        tail = f":{self.reference}" if self.reference is not None else ""
        return f"{self.transport}:{self.path}{tail}"


def parse_image_ref(ref: str) -> ImageSource:
    """Parse ``oci:DIR[:TAG]``, ``oci-archive:FILE[:TAG]``, ``docker-archive:FILE[:REF]``
    or ``docker://HOST[:PORT]/REPO[:TAG|@DIGEST]``.

    Raises :class:`ImageRefError` for an unknown scheme, an empty path or a
    malformed registry reference and :class:`SourceNotFound` when the directory
    or file does not exist.  Whether the tag exists is only known once the
    source is read (``convert_image``, ``inspect_image``).
    """
    transport, sep, rest = ref.partition(":")
    if not sep or transport not in TRANSPORTS:
        raise ImageRefError(
            f"{ref!r}: unknown image reference scheme {transport + sep!r}; "
            "use oci:DIR[:TAG], oci-archive:FILE[:TAG], docker-archive:FILE[:REF] "
            "or docker://HOST[:PORT]/REPO[:TAG|@DIGEST]"
        )
    if transport == "docker":
        if not rest.startswith("//"):
            raise ImageRefError(f"{ref!r}: expected docker://HOST[:PORT]/REPO[:TAG|@DIGEST]")
        try:
            remote = parse_reference(rest[2:])
        except ImageRefError as exc:
            raise ImageRefError(f"{ref!r}: {exc}") from None
        return ImageSource(transport, None, remote.digest or remote.tag, remote)
    path_text, sep, reference = rest.partition(":")
    if not path_text:
        raise ImageRefError(f"{ref!r}: the reference names no path")
    if sep and not reference:
        raise ImageRefError(f"{ref!r}: empty tag after ':'; leave out the ':' or name a tag")
    path = Path(path_text)
    want_dir = transport == "oci"
    if not (path.is_dir() if want_dir else path.is_file()):
        what = "directory" if want_dir else "file"
        found = " (it exists but is not a " + what + ")" if path.exists() else ""
        raise SourceNotFound(f"{ref!r}: no such {what}: {path}{found}")
    return ImageSource(transport, path, reference if sep else None)




# -- the resolved image ------------------------------------------------------


@dataclass(frozen=True)
class LayerBlob:
    """One layer as stored: ``path`` inside the source, its descriptor, and its config diff id.

    ``diff_id`` is the config's ``rootfs.diff_ids`` entry for this position:
    the sha256 the uncompressed tar must have.
    """

    path: str
    digest: str
    size: int
    media_type: str
    diff_id: str

    @property
    def descriptor(self) -> Descriptor:
        return Descriptor(self.media_type, self.digest, self.size)


@dataclass(frozen=True)
class ResolvedImage:
    """An image's manifest resolved to its config and ordered layers (lowest first).

    ``manifest_digest`` is ``None`` for a docker-archive, which stores no manifest blob.
    """

    source: str
    manifest_digest: str | None
    manifest_media_type: str | None
    config_digest: str
    config: Mapping[str, Any]
    layers: tuple[LayerBlob, ...]
    platform: str | None

    @property
    def chain_ids(self) -> tuple[str, ...]:
        """The chain id of each layer, lowest first (:func:`converters.ocispec.chain_ids`)."""
        return chain_ids([layer.diff_id for layer in self.layers])


def _blob_path(digest: str) -> str:
    alg, _, hexpart = digest.partition(":")
    return f"blobs/{alg}/{hexpart}"


# -- reading files from a directory or a tar, and verifying them -------------


class _Files(Protocol):
    """Read-only access to the files of a layout, by ``/``-separated relative name."""

    def open(self, name: str) -> BinaryIO:
        """Open ``name`` for reading; raises BlobNotFound when it is absent."""
        ...

    def exists(self, name: str) -> bool: ...

    def size(self, name: str) -> int:
        """The size of ``name`` in bytes; raises BlobNotFound when it is absent."""
        ...


def _normalise_name(name: str) -> str | None:
    """``a/./b`` -> ``a/b``; ``None`` for absolute names or names escaping the root."""
    parts: list[str] = []
    for part in PurePosixPath(name).parts:
        if part in ("", "."):
            continue
        if part == "/" or part == "..":
            return None
        parts.append(part)
    return "/".join(parts)


class _DirFiles:
    def __init__(self, root: Path, label: str) -> None:
        self._root = root
        self._label = label

    def _path(self, name: str) -> Path | None:
        norm = _normalise_name(name)
        return self._root / norm if norm else None

    def open(self, name: str) -> BinaryIO:
        path = self._path(name)
        if path is None or not path.is_file():
            raise BlobNotFound(f"{self._label}: {name} is missing from {self._root}")
        return path.open("rb")

    def size(self, name: str) -> int:
        path = self._path(name)
        if path is None or not path.is_file():
            raise BlobNotFound(f"{self._label}: {name} is missing from {self._root}")
        return path.stat().st_size

    def exists(self, name: str) -> bool:
        path = self._path(name)
        return path is not None and path.is_file()


class _TarFiles:
    """Members of an uncompressed tar opened in random-access mode (``r:``)."""

    def __init__(self, tar: tarfile.TarFile, label: str) -> None:
        self._tar = tar
        self._label = label
        self._members: dict[str, tarfile.TarInfo] = {}
        for info in tar.getmembers():
            norm = _normalise_name(info.name)
            if norm:
                self._members[norm] = info

    def _member(self, name: str) -> tarfile.TarInfo | None:
        norm = _normalise_name(name)
        info = self._members.get(norm) if norm else None
        return info if info is not None and (info.isfile() or info.issym() or info.islnk()) else None

    def open(self, name: str) -> BinaryIO:
        info = self._member(name)
        stream = None
        if info is not None:
            try:
                stream = self._tar.extractfile(info)
            except KeyError:  # a link whose target is not in the archive
                stream = None
        if stream is None:
            raise BlobNotFound(f"{self._label}: {name} is missing from the archive")
        return stream  # type: ignore[return-value]

    def size(self, name: str) -> int:
        with self.open(name) as stream:  # links resolved as extraction resolves them
            return stream.seek(0, io.SEEK_END)

    def exists(self, name: str) -> bool:
        return self._member(name) is not None


@contextmanager
def _open_files(source: ImageSource) -> Iterator[_Files]:
    label = str(source)
    if source.path is None:
        raise ImageRefError(f"{label}: not a local image source")
    if source.transport == "oci":
        yield _DirFiles(source.path, label)
        return
    try:
        tar = tarfile.open(source.path, "r:")
    except (tarfile.TarError, OSError) as exc:
        raise BadArchive(
            f"{label}: {source.path} is not a readable uncompressed tar ({exc}); "
            f"{source.transport} expects the plain tar that skopeo or docker save writes"
        ) from None
    with tar:
        try:
            files = _TarFiles(tar, label)
        except tarfile.TarError as exc:
            raise BadArchive(f"{label}: corrupt tar archive: {exc}") from None
        yield files


class VerifyingReader(VerifyingStream):
    """A :class:`converters.ocispec.BlobReader` over a file of a layout or archive.

    Counts and hashes what passes (:class:`converters.ocispec.BlobCheck`);
    ``problem()`` judges the bytes against the descriptor once they were all
    read.  Reads are serialised with a lock because the layer converter reads
    on its decompression thread while a failing caller may drain.
    """

    def __init__(self, raw: BinaryIO, check: BlobCheck) -> None:
        super().__init__()
        self._raw = raw
        self._check = check
        self._lock = threading.Lock()
        self._eof = False

    @property
    def count(self) -> int:
        return self._check.count

    @property
    def actual(self) -> str:
        return self._check.actual

    def read(self, size: int | None = -1) -> bytes:
        with self._lock:
            data = self._raw.read(-1 if size is None else size)
            if not data and size != 0:
                self._eof = True
            self._check.update(data)
            return data

    def problem(self) -> OciError | None:
        if not self._eof:
            return OciError(f"{self._check.what}: verified before its end ({self.count} bytes read)")
        return self._check.problem()

    def close(self) -> None:
        try:
            self._raw.close()
        finally:
            super().close()


class _FileBlobs:
    """The :class:`converters.ocispec.BlobSource` of a layout directory, layout tar or docker-archive.

    A layout names blobs by digest (``blobs/<alg>/<hex>``); a docker-archive
    stores them where its ``manifest.json`` says, given as ``paths``.
    """

    def __init__(self, files: _Files, label: str, paths: Mapping[str, str] | None = None) -> None:
        self.files = files
        self.label = label
        self.paths = paths

    def path(self, digest: str) -> str:
        if self.paths is None:
            return _blob_path(digest)
        try:
            return self.paths[digest]
        except KeyError:
            raise BlobNotFound(f"{self.label}: no blob {digest} in the archive's manifest.json") from None

    def open_blob(self, desc: Descriptor, what: str | None = None) -> VerifyingReader:
        """Open ``desc``'s blob; ``what`` names it in messages (default: ``<source>: blob <digest>``)."""
        stream = self.files.open(self.path(desc.digest))
        check = BlobCheck(desc, what or f"{self.label}: blob {desc.digest}", remedy=CORRUPT_HINT)
        return VerifyingReader(stream, check)


def _read_limited(stream: BinaryIO, limit: int, what: str) -> bytes:
    parts: list[bytes] = []
    got = 0
    while got <= limit and (part := stream.read(min(READ_SIZE, limit + 1 - got))):
        parts.append(part)
        got += len(part)
    if got > limit:
        raise ManifestTooLarge(f"{what} is larger than the {limit} byte limit; refusing to read it")
    return b"".join(parts)


def _read_plain_json(files: _Files, name: str, what: str) -> dict[str, Any]:
    """A file that is not content-addressed (``index.json``, ``manifest.json``, ``oci-layout``)."""
    with files.open(name) as stream:
        return parse_json(_read_limited(stream, MAX_MANIFEST_BYTES, what), what)


def _read_blob_json(blobs: _FileBlobs, desc: Descriptor, what: str, limit: int) -> dict[str, Any]:
    """A content-addressed JSON blob, verified against its descriptor."""
    check_size(desc.size, limit, what)
    with blobs.open_blob(desc, what) as reader:
        data = _read_limited(reader, limit, what)  # type: ignore[arg-type]
        reader.drain()
        reader.verify()
    return parse_json(data, what)


# -- OCI image layouts -------------------------------------------------------


def _check_layout(files: _Files, label: str) -> None:
    if files.exists("oci-layout"):
        layout = _read_plain_json(files, "oci-layout", f"{label}: oci-layout")
        version = layout.get("imageLayoutVersion")
        if not isinstance(version, str) or not version.startswith("1."):
            raise UnsupportedImage(
                f"{label}: unsupported imageLayoutVersion {version!r} (1.x is supported)"
            )
        return
    hint = (
        "; it looks like a docker-archive: use docker-archive:"
        if files.exists("manifest.json")
        else ""
    )
    raise UnsupportedImage(f"{label}: not an OCI image layout (no oci-layout file){hint}")


def _tag_list(descs: list[Descriptor]) -> str:
    tags = sorted({d.ref_name for d in descs if d.ref_name})
    return ", ".join(tags) if tags else "(none: the index has no ref.name annotations)"


def _select_tag(index: list[Descriptor], tag: str | None, label: str) -> list[Descriptor]:
    """The index entries a tag (or its absence) selects; several are platform variants."""
    if not index:
        raise ManifestNotFound(f"{label}: index.json lists no images")
    if tag is None:
        if len(index) == 1 or all(d.platform is not None and not d.ref_name for d in index):
            return index
        raise ImageRefError(
            f"{label}: the layout holds {len(index)} images; name one with :TAG "
            f"(available tags: {_tag_list(index)})"
        )
    chosen = [d for d in index if d.ref_name == tag]
    if not chosen:
        raise ManifestNotFound(f"{label}: no image tagged {tag!r}; available tags: {_tag_list(index)}")
    return chosen


def _resolve_oci(blobs: _FileBlobs, source: ImageSource, want: Platform) -> ResolvedImage:
    files, label = blobs.files, blobs.label
    _check_layout(files, label)
    index = _read_plain_json(files, "index.json", f"{label}: index.json")
    candidates = _select_tag(index_entries(index, f"{label}: index.json"), source.reference, label)
    chosen_platform: Platform | None = None
    for _depth in range(MAX_INDEX_DEPTH):
        desc = select_platform(candidates, want, label) if len(candidates) > 1 else candidates[0]
        chosen_platform = desc.platform or chosen_platform
        what = f"{label}: manifest {desc.digest}"
        doc = _read_blob_json(blobs, desc, what, MAX_MANIFEST_BYTES)
        media_type, kind = manifest_kind(doc, what, [desc.media_type])
        if kind == "manifest":
            return _manifest_image(blobs, desc, media_type, doc, chosen_platform)
        candidates = index_entries(doc, what)
        if not candidates:
            raise ManifestNotFound(f"{what}: the image index lists no manifests")
        if len(candidates) == 1 and candidates[0].platform is not None:
            candidates = [select_platform(candidates, want, what)]
    raise UnsupportedImage(f"{label}: image indexes nested more than {MAX_INDEX_DEPTH} deep")


def _manifest_image(
    blobs: _FileBlobs,
    desc: Descriptor,
    media_type: str,
    doc: Mapping[str, Any],
    chosen: Platform | None,
) -> ResolvedImage:
    label = blobs.label
    manifest = parse_manifest(doc, f"{label}: manifest {desc.digest}")
    what = f"{label}: config {manifest.config.digest}"
    config = _read_blob_json(blobs, manifest.config, what, MAX_CONFIG_BYTES)
    ids = diff_ids(config, len(manifest.layers), what)
    layers = tuple(
        LayerBlob(_blob_path(d.digest), d.digest, d.size, d.media_type, diff_id)
        for d, diff_id in zip(manifest.layers, ids, strict=True)
    )
    platform = chosen or config_platform(config)
    return ResolvedImage(
        source=label,
        manifest_digest=desc.digest,
        manifest_media_type=media_type,
        config_digest=manifest.config.digest,
        config=config,
        layers=layers,
        platform=str(platform) if platform else None,
    )


# -- docker-archive (docker save) --------------------------------------------


def _normalise_docker_ref(ref: str) -> str:
    """``python`` -> ``docker.io/library/python:latest``, as docker and skopeo spell it."""
    name, at, digest = ref.partition("@")
    slash = name.find("/")
    first = name[:slash] if slash >= 0 else ""
    if slash < 0 or ("." not in first and ":" not in first and first != "localhost"):
        name = ("docker.io/library/" if slash < 0 else "docker.io/") + name
    if not at and ":" not in name.rsplit("/", 1)[-1]:
        name += ":latest"
    return name + at + digest


def _select_docker_entry(
    entries: list[Mapping[str, Any]], reference: str | None, label: str
) -> Mapping[str, Any]:
    tags = [t for e in entries for t in (e.get("RepoTags") or []) if isinstance(t, str)]
    available = ", ".join(tags) if tags else "(no RepoTags; select with @N)"
    if reference is None:
        if len(entries) == 1:
            return entries[0]
        raise ImageRefError(
            f"{label}: the archive holds {len(entries)} images; name one with :REF or :@N "
            f"(available: {available})"
        )
    if reference.startswith("@"):
        try:
            n = int(reference[1:])
        except ValueError:
            n = -1
        if not 0 <= n < len(entries):
            raise ImageRefError(
                f"{label}: no image @{reference[1:]}; the archive holds {len(entries)} (@0..)"
            )
        return entries[n]
    want = _normalise_docker_ref(reference)
    for entry in entries:
        for tag in entry.get("RepoTags") or []:
            if isinstance(tag, str) and _normalise_docker_ref(tag) == want:
                return entry
    raise ImageRefError(f"{label}: no image tagged {reference!r}; available tags: {available}")


def _named_digest(path: str) -> str | None:
    """The sha256 a docker-archive file name carries (``<hex>.tar``, ``blobs/sha256/<hex>``)."""
    p = PurePosixPath(path)
    if len(p.parts) >= 3 and p.parts[-3] == "blobs" and p.parts[-2] in DIGEST_HEX:
        return f"{p.parts[-2]}:{p.name}"
    stem = p.name.split(".", 1)[0]
    return f"sha256:{stem}" if _HEX64_RE.match(stem) else None


def _sniff_media_type(files: _Files, path: str) -> str:
    with files.open(path) as stream:
        head = stream.read(4)
    if head.startswith(b"\x1f\x8b"):
        return MT_DOCKER_LAYER_GZIP
    if head.startswith(b"\x28\xb5\x2f\xfd"):
        return MT_OCI_LAYER_ZSTD
    return MT_DOCKER_LAYER_TAR


def _resolve_docker(files: _Files, source: ImageSource) -> tuple[ResolvedImage, _FileBlobs]:
    label = str(source)
    if not files.exists("manifest.json"):
        hint = "; it looks like an OCI layout: use oci-archive:" if files.exists("oci-layout") else ""
        raise UnsupportedImage(f"{label}: not a docker-archive (no manifest.json){hint}")
    with files.open("manifest.json") as stream:
        raw = _read_limited(stream, MAX_MANIFEST_BYTES, f"{label}: manifest.json")
    try:
        entries = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UnsupportedImage(f"{label}: manifest.json is not valid JSON: {exc}") from None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise UnsupportedImage(f"{label}: manifest.json is not a list of images")
    entry = _select_docker_entry(entries, source.reference, label)
    config_path, layer_paths = entry.get("Config"), entry.get("Layers")
    if not isinstance(config_path, str) or not isinstance(layer_paths, list):
        raise UnsupportedImage(f"{label}: manifest.json entry lacks 'Config' or 'Layers'")
    config_digest = _named_digest(config_path)
    if config_digest is None:
        raise UnsupportedImage(
            f"{label}: config file {config_path!r} is not named by its digest; cannot verify it"
        )
    # a docker-archive has no descriptors: digests come from file names (or the
    # config's diff ids), sizes from the archive, so every blob is still checked
    paths = {config_digest: config_path}
    blobs = _FileBlobs(files, label, paths)
    config_desc = Descriptor(MT_DOCKER_CONFIG, config_digest, files.size(config_path))
    what = f"{label}: config {config_digest}"
    config = _read_blob_json(blobs, config_desc, what, MAX_CONFIG_BYTES)
    ids = diff_ids(config, len(layer_paths), what)
    sources = entry.get("LayerSources") if isinstance(entry.get("LayerSources"), dict) else {}
    layers = []
    for i, (path, diff_id) in enumerate(zip(layer_paths, ids, strict=True)):
        if not isinstance(path, str):
            raise UnsupportedImage(f"{label}: manifest.json, layer {i + 1}: the path is not a string")
        # the stored file is either named by its digest, or an uncompressed tar whose
        # sha256 is the config's diff_id (legacy `<id>/layer.tar`)
        digest = check_digest(_named_digest(path) or diff_id, f"{label}: manifest.json, layer {i + 1}")
        described = sources.get(diff_id) if isinstance(sources, dict) else None
        media_type = (
            described["mediaType"]
            if isinstance(described, dict) and isinstance(described.get("mediaType"), str)
            else _sniff_media_type(files, path)
        )
        paths[digest] = path
        layers.append(LayerBlob(path, digest, files.size(path), media_type, diff_id))
    platform = config_platform(config)
    image = ResolvedImage(
        source=label,
        manifest_digest=None,
        manifest_media_type=None,
        config_digest=config_digest,
        config=config,
        layers=tuple(layers),
        platform=str(platform) if platform else None,
    )
    return image, blobs


# -- registries (docker://) --------------------------------------------------


def _remote_image(image: RegistryImage, source: ImageSource) -> ResolvedImage:
    what = f"{source}: config {image.config_digest}"
    ids = diff_ids(image.config, len(image.layers), what)
    path = f"/v2/{image.reference.repository}/blobs/"
    return ResolvedImage(
        source=str(source),
        manifest_digest=image.manifest_digest,
        manifest_media_type=image.manifest_media_type,
        config_digest=image.config_digest,
        config=image.config,
        layers=tuple(
            LayerBlob(path + d.digest, d.digest, d.size, d.media_type, diff_id)
            for d, diff_id in zip(image.layers, ids, strict=True)
        ),
        platform=str(image.platform) if image.platform else None,
    )


@contextmanager
def _opened(source: ImageSource, platform: str | None) -> Iterator[tuple[ResolvedImage, BlobSource]]:
    """The image ``source`` names, resolved for ``platform``, and where its blobs are."""
    want = want_platform(platform)
    if source.remote is not None:
        with SyncRegistryClient() as registry:
            image = _remote_image(registry.get_manifest(source.remote, want), source)
            yield image, registry.blobs(source.remote)
        return
    with _open_files(source) as files:
        if source.transport == "docker-archive":
            image, blobs = _resolve_docker(files, source)
        else:
            blobs = _FileBlobs(files, str(source))
            image = _resolve_oci(blobs, source, want)
        yield image, blobs


def inspect_image(ref: str, *, platform: str | None = None) -> ResolvedImage:
    """Read and verify an image's manifest and config without touching its layers."""
    with _opened(parse_image_ref(ref), platform) as (image, _blobs):
        return image


# -- conversion --------------------------------------------------------------


@dataclass(frozen=True)
class ImageLayer:
    """One converted layer of an image; file names are relative to the image directory.

    ``diff_id`` is the sha256 of the layer's uncompressed tar (checked against
    the config's ``rootfs.diff_ids``), ``chain_id`` the OCI chain id of the
    image's layers up to and including this one.
    """

    digest: str
    meta: str
    blob: str
    blob_digest: str
    oci_digest: str
    oci_media_type: str
    oci_size: int
    diff_id: str
    chain_id: str
    files: int
    bytes: int
    chunks: int
    unique_chunks: int
    unique_bytes: int
    seconds: float

    def to_json(self) -> dict[str, object]:
        return {
            "digest": self.digest,
            "meta": self.meta,
            "blob": self.blob,
            "blob_digest": self.blob_digest,
            "oci": {
                "digest": self.oci_digest,
                "mediaType": self.oci_media_type,
                "size": self.oci_size,
                "diff_id": self.diff_id,
                "chain_id": self.chain_id,
            },
            "stats": {
                "files": self.files,
                "bytes": self.bytes,
                "chunks": self.chunks,
                "unique_chunks": self.unique_chunks,
                "unique_bytes": self.unique_bytes,
                "seconds": round(self.seconds, 3),
            },
        }


@dataclass(frozen=True)
class ImageResult:
    """What ``convert_image`` wrote; ``to_json()`` is the content of ``image.json``."""

    path: str
    source: str
    transport: str
    manifest_digest: str | None
    manifest_media_type: str | None
    config_digest: str
    platform: str | None
    config: Mapping[str, Any]
    layers: tuple[ImageLayer, ...]
    seconds: float

    def to_json(self) -> dict[str, object]:
        return {
            "schema": IMAGE_SCHEMA,
            "source": {
                "ref": self.source,
                "transport": self.transport,
                "manifest_digest": self.manifest_digest,
                "manifest_media_type": self.manifest_media_type,
                "config_digest": self.config_digest,
                "platform": self.platform,
            },
            "config": dict(self.config),
            "layers": [layer.to_json() for layer in self.layers],
        }


def _short(digest: str) -> str:
    return digest.partition(":")[2][:12]


def _layer_names(number: int, digest: str) -> tuple[str, str]:
    stem = f"layers/{number:03d}-{_short(digest)}"
    return f"{stem}.erofs", f"{stem}.blob"


def _convert_layer(
    blobs: BlobSource,
    image: ResolvedImage,
    number: int,
    layer: LayerBlob,
    out_dir: Path,
    chunk_size: int,
) -> tuple[LayerResult, int]:
    """Convert one layer, verifying its digest and size and then its diff id.

    Returns the converter's result and the number of blob bytes read.  A blob
    whose bytes are wrong raises :class:`LayerDigestMismatch`, an uncompressed
    tar that is not the config's diff id :class:`DiffIdMismatch`; a download
    that broke raises what the source raised (retryable ``BlobTruncated`` ...).
    """
    total = len(image.layers)
    describe = f"image {image.source}: layer {number} of {total} ({layer.digest})"
    meta, blob = _layer_names(number, layer.digest)

    def layer_error(problem: OciError) -> OciError:
        if isinstance(problem, BlobMismatch) and not problem.retryable:
            return LayerDigestMismatch(
                f"layer {number} of {total} is corrupt: {problem}",
                layer=number,
                expected=layer.digest,
                actual=problem.actual,
            )
        return problem

    def check_diff_id(actual: str) -> None:
        if actual != layer.diff_id:
            raise DiffIdMismatch(
                f"{describe}: the uncompressed layer hashes to {actual}, but the config's "
                f"rootfs.diff_ids[{number - 1}] is {layer.diff_id}; the config does not describe "
                "this layer (a corrupt or hand-edited image)",
                layer=number,
                digest=layer.digest,
                expected=layer.diff_id,
                actual=actual,
            )

    with blobs.open_blob(layer.descriptor) as stream:

        def verify() -> None:
            problem = stream.problem()
            if problem is not None:
                error = layer_error(problem)
                if error is problem:
                    raise problem
                raise error from problem

        try:
            result = convert_stream(
                stream,  # type: ignore[arg-type]
                out_dir / meta,
                out_dir / blob,
                chunk_size=chunk_size,
                source=describe,
                verify=verify,
                diff_id=check_diff_id,
                raw_sha256=layer.digest if layer.digest.startswith("sha256:") else None,
            )
        except (LayerDigestMismatch, DiffIdMismatch):
            raise
        except OciError as exc:  # the source failed while the converter read
            error = layer_error(exc)
            if error is exc:
                raise
            raise error from exc
        except ConvertError as exc:
            # damaged bytes usually break decompression before the digest is known:
            # read the rest, and when the digest is wrong say so, it is the cause
            try:
                stream.drain()
            except OciError:
                raise exc from None  # reading failed too; the converter saw it first
            problem = stream.problem()
            if problem is not None and problem is not (error := layer_error(problem)):
                raise error from exc
            raise
    return result, stream.count


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json_atomic(path: Path, doc: Mapping[str, object]) -> None:
    data = (json.dumps(doc, indent=2, sort_keys=False) + "\n").encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)  # mkstemp's 0600 would hide it from readers
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _image_layer(
    result: LayerResult, meta: str, blob: str, layer: LayerBlob, size: int, chain: str
) -> ImageLayer:
    return ImageLayer(
        digest=result.digest,
        meta=meta,
        blob=blob,
        blob_digest=result.blob_digest,
        oci_digest=layer.digest,
        oci_media_type=layer.media_type,
        oci_size=size,
        diff_id=layer.diff_id,
        chain_id=chain,
        files=result.files,
        bytes=result.bytes,
        chunks=result.chunks,
        unique_chunks=result.unique_chunks,
        unique_bytes=result.unique_bytes,
        seconds=result.seconds,
    )


def _convert_layers(
    convert_one: Callable[[int, LayerBlob], tuple[LayerResult, int]],
    image: ResolvedImage,
    out_dir: Path,
    created: list[Path],
) -> tuple[ImageLayer, ...]:
    """Convert each distinct layer once, lowest first; appends every new file to ``created``.

    ``convert_one(number, layer)`` converts one layer and returns the result
    and the number of source bytes it read.  A layer listed twice is the same
    layer files, but has a chain id of its own at each position.
    """
    done: dict[str, ImageLayer] = {}
    layers = []
    for number, (layer, chain) in enumerate(zip(image.layers, image.chain_ids, strict=True), start=1):
        if layer.digest not in done:
            meta, blob = _layer_names(number, layer.digest)
            fresh = [p for p in (out_dir / meta, out_dir / blob) if not p.exists()]
            result, size = convert_one(number, layer)
            created.extend(fresh)
            done[layer.digest] = _image_layer(result, meta, blob, layer, size, chain)
        first = done[layer.digest]
        if layer.diff_id != first.diff_id:
            raise DiffIdMismatch(
                f"image {image.source}: layer {number} of {len(image.layers)} ({layer.digest}) is the blob "
                f"of an earlier layer, whose uncompressed tar is {first.diff_id}, but the config's "
                f"rootfs.diff_ids[{number - 1}] is {layer.diff_id}",
                layer=number,
                digest=layer.digest,
                expected=layer.diff_id,
                actual=first.diff_id,
            )
        layers.append(replace(first, chain_id=chain))
    return tuple(layers)


def convert_image(
    ref: str,
    out_dir: str | os.PathLike[str],
    *,
    chunk_size: int = 1 << 20,
    platform: str | None = None,
) -> ImageResult:
    """Convert every layer of the image ``ref`` names and describe it in ``out_dir/image.json``.

    Layers go to ``out_dir/layers/NNN-<12 hex of the OCI digest>.erofs`` (metadata
    image) and ``.blob`` (data), NNN being the 1-based position of the layer's first
    occurrence, lowest first; a layer listed twice is converted once.  ``platform``
    (``OS/ARCH[/VARIANT]``) picks the image out of a multi-platform index and
    defaults to ``linux/<host arch>``.  Each layer's uncompressed tar must hash
    to the config's ``rootfs.diff_ids`` entry; ``image.json`` records it and
    the layer's chain id.

    On any failure the layer files this call created are removed, ``image.json``
    is not written, and the exception propagates: the errors of
    :mod:`converters.ocispec` (``ImageRefError`` and its ``ManifestNotFound``,
    ``PlatformNotFound`` for references naming nothing, ``SourceNotFound``,
    ``BlobNotFound``, ``UnsupportedImage`` for non-image content,
    ``LayerDigestMismatch`` / ``BlobDigestMismatch`` / ``BlobSizeMismatch`` for
    corrupt blobs, ``DiffIdMismatch``, and from a registry ``RegistryAuthError``,
    ``RegistryUnavailable``, ``BlobTruncated``, ...), and the converter's
    ``BadArchive`` / ``BadEntry``.
    """
    started = time.monotonic()
    source = parse_image_ref(ref)
    out = Path(out_dir)
    created: list[Path] = []
    try:
        with _opened(source, platform) as (image, blobs):
            (out / "layers").mkdir(parents=True, exist_ok=True)
            layers = _convert_layers(
                lambda number, layer: _convert_layer(blobs, image, number, layer, out, chunk_size),
                image,
                out,
                created,
            )
        result = ImageResult(
            path=str(out / "image.json"),
            source=ref,
            transport=source.transport,
            manifest_digest=image.manifest_digest,
            manifest_media_type=image.manifest_media_type,
            config_digest=image.config_digest,
            platform=image.platform,
            config=image.config,
            layers=layers,
            seconds=time.monotonic() - started,
        )
        _write_json_atomic(out / "image.json", result.to_json())
    except BaseException:
        for path in created:
            path.unlink(missing_ok=True)
        raise
    return result
