"""Image sources: OCI image layouts (directory or tar) and ``docker save`` archives.

An image reference uses skopeo's syntax::

    oci:DIR[:TAG]                 an OCI image layout directory
    oci-archive:FILE[:TAG]        the same layout inside a tar file (read in place, never unpacked)
    docker-archive:FILE[:REF]     a ``docker save`` tar; REF is ``name[:tag]`` or ``@N`` (N-th image)
    docker://HOST[:PORT]/REPO[:TAG|@DIGEST]
                                  an image in an OCI distribution registry (layerstore.registry)

As in skopeo, the path ends at the first ``:`` after the scheme.  A TAG is matched
against the ``org.opencontainers.image.ref.name`` annotation of the layout's
``index.json``; it may be left out when the index holds exactly one image.

Every blob that is read (manifest, config, layer) is hashed while it streams and
compared with the digest and size its descriptor names; a layer's check is the
``verify`` callback of :func:`converters.layer.convert_stream`, so a corrupt layer
never gets its final name.  ``convert_image`` writes ``image.json`` last
(temp file, fsync, rename), so a directory holding an ``image.json`` holds a
complete image.

Images from a registry are never copied to disk whole: each layer streams from
the registry (:class:`layerstore.registry.BlobStream`) straight into
``convert_stream``, and the stream's digest check is the ``verify`` callback.
"""

from __future__ import annotations

import hashlib
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
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Protocol

from converters.errors import BadArchive, ConvertError, DigestMismatch
from converters.layer import LayerResult, convert_stream
from layerstore.registry import (
    BlobDigestMismatch,
    BlobNotFound,
    InvalidPlatform,
    ManifestNotFound,
    Platform,
    PlatformNotFound,
    Reference,
    RegistryError,
    RegistryImage,
    RegistryReferenceError,
    SyncRegistryClient,
    UnsupportedManifest,
    host_platform,
    parse_reference,
)
from layerstore.registry import Descriptor as RegistryDescriptor

IMAGE_SCHEMA = "layerbox.converted-image.v1"
TRANSPORTS = ("oci", "oci-archive", "docker-archive", "docker")
REF_NAME = "org.opencontainers.image.ref.name"
# manifests and indexes are small documents; configs can carry long histories
MAX_MANIFEST_BYTES = 4 << 20
MAX_CONFIG_BYTES = 64 << 20
MAX_INDEX_DEPTH = 4
READ_SIZE = 1 << 20

MT_OCI_INDEX = "application/vnd.oci.image.index.v1+json"
MT_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MT_DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
MT_DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
MT_DOCKER_LAYER_TAR = "application/vnd.docker.image.rootfs.diff.tar"
MT_DOCKER_LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"
MT_OCI_LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"

INDEX_TYPES = frozenset({MT_OCI_INDEX, MT_DOCKER_LIST})
MANIFEST_TYPES = frozenset({MT_OCI_MANIFEST, MT_DOCKER_MANIFEST})
CONFIG_TYPES = frozenset({MT_OCI_CONFIG, MT_DOCKER_CONFIG})
LAYER_TYPES = frozenset(
    {
        "application/vnd.oci.image.layer.v1.tar",
        "application/vnd.oci.image.layer.v1.tar+gzip",
        MT_OCI_LAYER_ZSTD,
        "application/vnd.oci.image.layer.nondistributable.v1.tar",
        "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
        "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
        MT_DOCKER_LAYER_TAR,
        MT_DOCKER_LAYER_GZIP,
        "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
    }
)

_DIGEST_HEX = {"sha256": 64, "sha512": 128}
_DIGEST_RE = re.compile(r"^([a-z0-9]+(?:[+._-][a-z0-9]+)*):([a-zA-Z0-9=_-]+)$")
_HEX64_RE = re.compile(r"^[0-9a-f]{64}$")


# -- errors ------------------------------------------------------------------


class ImageRefError(ConvertError, ValueError):
    """The image reference is malformed or names nothing (unknown scheme, tag, platform)."""


class SourceNotFound(ConvertError, FileNotFoundError):
    """The file or directory an image reference points at does not exist."""


class BlobMissing(ConvertError, FileNotFoundError):
    """A blob a manifest names is not in the layout or archive."""


class UnsupportedImage(ConvertError):
    """The source holds something that is not a container image layerbox can read."""


class LayerDigestMismatch(DigestMismatch):
    """A layer's bytes do not match its descriptor; ``layer`` is 1-based, lowest first."""

    def __init__(self, message: str, *, layer: int, expected: str, actual: str) -> None:
        super().__init__(message)
        self.layer = layer
        self.expected = expected
        self.actual = actual


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
        except RegistryReferenceError as exc:
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


# -- platforms ---------------------------------------------------------------


# Platform and host_platform live in layerstore.registry (which must not import
# converters), so that a layout and a registry choose the same image from an index.


def _want_platform(text: str | None) -> Platform:
    """The requested platform: ``OS/ARCH[/VARIANT]``, or this host's when ``None``."""
    if not text:
        return host_platform()
    try:
        return Platform.parse(text)
    except InvalidPlatform as exc:
        raise ImageRefError(str(exc)) from None


def _descriptor_platform(obj: Mapping[str, Any]) -> Platform | None:
    plat = obj.get("platform")
    if not isinstance(plat, dict) or not plat.get("os") or not plat.get("architecture"):
        return None
    return Platform(str(plat["os"]), str(plat["architecture"]), plat.get("variant") or None)


# -- descriptors and the resolved image --------------------------------------


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    platform: Platform | None = None
    annotations: Mapping[str, str] = field(default_factory=dict)

    @property
    def ref_name(self) -> str | None:
        return self.annotations.get(REF_NAME)


@dataclass(frozen=True)
class LayerBlob:
    """One layer as stored: ``path`` inside the source, the digest and size it must have."""

    path: str
    digest: str
    size: int | None
    media_type: str


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


def _check_digest(digest: object, where: str) -> str:
    if not isinstance(digest, str) or not (m := _DIGEST_RE.match(digest)):
        raise UnsupportedImage(f"{where}: malformed digest {digest!r}")
    alg, hexpart = m.groups()
    if alg not in _DIGEST_HEX:
        raise UnsupportedImage(
            f"{where}: digest algorithm {alg!r} is not supported (sha256 and sha512 are)"
        )
    if len(hexpart) != _DIGEST_HEX[alg] or not re.fullmatch(r"[0-9a-f]+", hexpart):
        raise UnsupportedImage(f"{where}: malformed {alg} digest {digest!r}")
    return digest


def _descriptor(obj: object, where: str) -> Descriptor:
    if not isinstance(obj, dict):
        raise UnsupportedImage(f"{where}: a descriptor must be a JSON object")
    size = obj.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise UnsupportedImage(f"{where}: descriptor has no valid 'size'")
    media_type = obj.get("mediaType")
    annotations = obj.get("annotations") or {}
    return Descriptor(
        media_type=media_type if isinstance(media_type, str) else "",
        digest=_check_digest(obj.get("digest"), where),
        size=size,
        platform=_descriptor_platform(obj),
        annotations={str(k): str(v) for k, v in annotations.items()}
        if isinstance(annotations, dict)
        else {},
    )


def _blob_path(digest: str) -> str:
    alg, _, hexpart = digest.partition(":")
    return f"blobs/{alg}/{hexpart}"


# -- reading files from a directory or a tar, and hashing them ---------------


class _Files(Protocol):
    """Read-only access to the files of a layout, by ``/``-separated relative name."""

    def open(self, name: str) -> BinaryIO:
        """Open ``name`` for reading; raises BlobMissing when it is absent."""
        ...

    def exists(self, name: str) -> bool: ...


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
            raise BlobMissing(f"{self._label}: {name} is missing from {self._root}")
        return path.open("rb")

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
            raise BlobMissing(f"{self._label}: {name} is missing from the archive")
        return stream  # type: ignore[return-value]

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


class HashingReader(io.RawIOBase):
    """A read-only stream that hashes and counts what passes through it.

    ``verify()`` compares the digest and byte count with what the descriptor
    promised and raises ``DigestMismatch`` (built by ``make_error``) on a
    difference.  Reads are serialised with a lock because the layer converter
    reads on its decompression thread while a failing caller may drain.
    """

    def __init__(
        self,
        raw: BinaryIO,
        digest: str,
        size: int | None,
        describe: str,
    ) -> None:
        super().__init__()
        self._raw = raw
        self.expected = digest
        self.expected_size = size
        self._alg = digest.partition(":")[0]
        self._hash = hashlib.new(self._alg)
        self._describe = describe
        self._lock = threading.Lock()
        self.count = 0

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        with self._lock:
            data = self._raw.read(-1 if size is None else size)
            self._hash.update(data)
            self.count += len(data)
            return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def readall(self) -> bytes:
        chunks = []
        while chunk := self.read(READ_SIZE):
            chunks.append(chunk)
        return b"".join(chunks)

    def drain(self) -> None:
        while self.read(READ_SIZE):
            pass

    @property
    def actual(self) -> str:
        return f"{self._alg}:{self._hash.hexdigest()}"

    def problem(self) -> str | None:
        """What is wrong with the bytes read so far, or ``None`` when they match."""
        if self.expected_size is not None and self.count != self.expected_size:
            return (
                f"expected {self.expected_size} bytes, read {self.count} "
                f"(digest {self.actual}, expected {self.expected})"
            )
        if self.actual != self.expected:
            return f"expected digest {self.expected}, got {self.actual}"
        return None

    def verify(self) -> None:
        problem = self.problem()
        if problem is not None:
            raise DigestMismatch(f"{self._describe}: {problem}; the archive is corrupt")


def _read_limited(stream: BinaryIO, limit: int, what: str) -> bytes:
    parts: list[bytes] = []
    got = 0
    while got <= limit and (part := stream.read(min(READ_SIZE, limit + 1 - got))):
        parts.append(part)
        got += len(part)
    if got > limit:
        raise UnsupportedImage(f"{what} is larger than {limit} bytes; refusing to parse it")
    return b"".join(parts)


def _parse_json(data: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UnsupportedImage(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise UnsupportedImage(f"{what} is not a JSON object")
    return doc


def _read_plain_json(files: _Files, name: str, what: str) -> dict[str, Any]:
    """A file that is not content-addressed (``index.json``, ``manifest.json``)."""
    with files.open(name) as stream:
        return _parse_json(_read_limited(stream, MAX_MANIFEST_BYTES, what), what)


def _read_blob_json(
    files: _Files, path: str, digest: str, size: int | None, what: str, limit: int
) -> dict[str, Any]:
    """A content-addressed JSON blob, verified against ``digest`` (and ``size``)."""
    if size is not None and size > limit:
        raise UnsupportedImage(f"{what} is {size} bytes, more than {limit}; refusing to read it")
    with files.open(path) as stream:
        reader = HashingReader(stream, digest, size, what)
        data = _read_limited(reader, limit, what)  # type: ignore[arg-type]
        reader.verify()
    return _parse_json(data, what)


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
        raise ImageRefError(f"{label}: index.json lists no images")
    if tag is None:
        if len(index) == 1 or all(d.platform is not None and not d.ref_name for d in index):
            return index
        raise ImageRefError(
            f"{label}: the layout holds {len(index)} images; name one with :TAG "
            f"(available tags: {_tag_list(index)})"
        )
    chosen = [d for d in index if d.ref_name == tag]
    if not chosen:
        raise ImageRefError(f"{label}: no image tagged {tag!r}; available tags: {_tag_list(index)}")
    return chosen


def _select_platform(descs: list[Descriptor], want: Platform, label: str) -> Descriptor:
    if len(descs) == 1 and descs[0].platform is None:
        return descs[0]
    for desc in descs:
        if desc.platform is not None and want.matches(desc.platform):
            return desc
    have = sorted({str(d.platform) for d in descs if d.platform is not None})
    raise ImageRefError(
        f"{label}: no image for platform {want}; available: {', '.join(have) or 'none named'} "
        "(pass platform='OS/ARCH' to choose one)"
    )


def _index_entries(doc: Mapping[str, Any], what: str) -> list[Descriptor]:
    manifests = doc.get("manifests")
    if not isinstance(manifests, list):
        raise UnsupportedImage(f"{what} has no 'manifests' list")
    return [_descriptor(m, f"{what}, manifests[{i}]") for i, m in enumerate(manifests)]


def _document_kind(desc: Descriptor, doc: Mapping[str, Any], what: str) -> str:
    """'index' or 'manifest', from the media types (or the shape when none is given)."""
    declared = doc.get("mediaType")
    if isinstance(declared, str) and desc.media_type and declared != desc.media_type:
        raise UnsupportedImage(
            f"{what}: descriptor says {desc.media_type!r} but the document says {declared!r}"
        )
    media_type = desc.media_type or (declared if isinstance(declared, str) else "")
    if media_type in INDEX_TYPES or (not media_type and "manifests" in doc):
        return "index"
    if media_type in MANIFEST_TYPES or (not media_type and "layers" in doc):
        return "manifest"
    raise UnsupportedImage(
        f"{what}: media type {media_type!r} is not an image manifest or index "
        "(artifacts and schema-1 manifests are not images layerbox can convert)"
    )


def _resolve_oci(files: _Files, source: ImageSource, want: Platform) -> ResolvedImage:
    label = str(source)
    _check_layout(files, label)
    entries = _index_entries(_read_plain_json(files, "index.json", f"{label}: index.json"), label)
    candidates = _select_tag(entries, source.reference, label)
    chosen_platform: Platform | None = None
    for _depth in range(MAX_INDEX_DEPTH):
        desc = _select_platform(candidates, want, label) if len(candidates) > 1 else candidates[0]
        chosen_platform = desc.platform or chosen_platform
        what = f"{label}: manifest {desc.digest}"
        doc = _read_blob_json(
            files, _blob_path(desc.digest), desc.digest, desc.size, what, MAX_MANIFEST_BYTES
        )
        if _document_kind(desc, doc, what) == "manifest":
            return _manifest_image(files, label, desc, doc, chosen_platform)
        candidates = _index_entries(doc, what)
        if not candidates:
            raise ImageRefError(f"{what}: the image index lists no manifests")
        if len(candidates) == 1 and candidates[0].platform is not None:
            candidates = [_select_platform(candidates, want, what)]
    raise UnsupportedImage(f"{label}: image indexes nested more than {MAX_INDEX_DEPTH} deep")


def _manifest_image(
    files: _Files,
    label: str,
    desc: Descriptor,
    doc: Mapping[str, Any],
    chosen: Platform | None,
) -> ResolvedImage:
    what = f"{label}: manifest {desc.digest}"
    if doc.get("schemaVersion") != 2:
        raise UnsupportedImage(f"{what}: schemaVersion {doc.get('schemaVersion')!r}, expected 2")
    config_desc = _descriptor(doc.get("config"), f"{what}, config")
    if config_desc.media_type not in CONFIG_TYPES:
        raise UnsupportedImage(
            f"{what}: config media type {config_desc.media_type!r} is not a container image config"
        )
    config = _read_blob_json(
        files,
        _blob_path(config_desc.digest),
        config_desc.digest,
        config_desc.size,
        f"{label}: config {config_desc.digest}",
        MAX_CONFIG_BYTES,
    )
    raw_layers = doc.get("layers")
    if not isinstance(raw_layers, list):
        raise UnsupportedImage(f"{what}: no 'layers' list")
    layers = []
    for i, obj in enumerate(raw_layers):
        layer = _descriptor(obj, f"{what}, layer {i + 1}")
        if layer.media_type not in LAYER_TYPES:
            raise UnsupportedImage(
                f"{what}: layer {i + 1} has media type {layer.media_type!r}, "
                "which is not a tar layer (plain, gzip or zstd)"
            )
        layers.append(LayerBlob(_blob_path(layer.digest), layer.digest, layer.size, layer.media_type))
    return ResolvedImage(
        source=label,
        manifest_digest=desc.digest,
        manifest_media_type=desc.media_type or str(doc.get("mediaType") or "") or None,
        config_digest=config_desc.digest,
        config=config,
        layers=tuple(layers),
        platform=str(chosen) if chosen else _config_platform(config),
    )


def _config_platform(config: Mapping[str, Any]) -> str | None:
    os_name, arch = config.get("os"), config.get("architecture")
    if not isinstance(os_name, str) or not isinstance(arch, str):
        return None
    variant = config.get("variant")
    return str(Platform(os_name, arch, variant if isinstance(variant, str) and variant else None))


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
    if len(p.parts) >= 3 and p.parts[-3] == "blobs" and p.parts[-2] in _DIGEST_HEX:
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


def _resolve_docker(files: _Files, source: ImageSource) -> ResolvedImage:
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
    config = _read_blob_json(
        files, config_path, config_digest, None, f"{label}: config {config_digest}", MAX_CONFIG_BYTES
    )
    rootfs = config.get("rootfs")
    diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if not isinstance(diff_ids, list) or len(diff_ids) != len(layer_paths):
        raise UnsupportedImage(
            f"{label}: config lists {len(diff_ids) if isinstance(diff_ids, list) else 'no'} "
            f"diff_ids for {len(layer_paths)} layers"
        )
    sources = entry.get("LayerSources") if isinstance(entry.get("LayerSources"), dict) else {}
    layers = []
    for i, (path, diff_id) in enumerate(zip(layer_paths, diff_ids, strict=True)):
        if not isinstance(path, str):
            raise UnsupportedImage(f"{label}: layer {i + 1} path is not a string")
        # the stored file is either named by its digest, or an uncompressed tar whose
        # sha256 is the config's diff_id (legacy `<id>/layer.tar`)
        digest = _check_digest(_named_digest(path) or diff_id, f"{label}: layer {i + 1}")
        described = sources.get(diff_id) if isinstance(sources, dict) else None
        media_type = (
            described["mediaType"]
            if isinstance(described, dict) and isinstance(described.get("mediaType"), str)
            else _sniff_media_type(files, path)
        )
        layers.append(LayerBlob(path, digest, None, media_type))
    return ResolvedImage(
        source=label,
        manifest_digest=None,
        manifest_media_type=None,
        config_digest=config_digest,
        config=config,
        layers=tuple(layers),
        platform=_config_platform(config),
    )


def _resolve(files: _Files, source: ImageSource, platform: str | None) -> ResolvedImage:
    if source.transport == "docker-archive":
        return _resolve_docker(files, source)
    return _resolve_oci(files, source, _want_platform(platform))


# -- registries (docker://) --------------------------------------------------


@contextmanager
def _registry_errors() -> Iterator[None]:
    """Map registry errors onto this module's contract where it has one.

    A tag, digest or platform the registry does not have is an ``ImageRefError``
    as it is for a layout, a missing blob ``BlobMissing``; a non-image manifest
    is ``UnsupportedImage``; a corrupt manifest or config is ``DigestMismatch``.
    Everything else (auth, unreachable registry, truncated download) stays a
    ``layerstore.registry.RegistryError``.
    """
    try:
        yield
    except (ManifestNotFound, PlatformNotFound, InvalidPlatform) as exc:
        raise ImageRefError(str(exc)) from exc
    except BlobNotFound as exc:
        raise BlobMissing(str(exc)) from exc
    except UnsupportedManifest as exc:
        raise UnsupportedImage(str(exc)) from exc
    except BlobDigestMismatch as exc:
        raise DigestMismatch(str(exc)) from exc


def _remote_image(image: RegistryImage, source: ImageSource) -> ResolvedImage:
    label = str(source)
    what = f"{label}: manifest {image.manifest_digest}"
    layers = []
    for i, desc in enumerate(image.layers):
        if desc.media_type not in LAYER_TYPES:
            raise UnsupportedImage(
                f"{what}: layer {i + 1} has media type {desc.media_type!r}, "
                "which is not a tar layer (plain, gzip or zstd)"
            )
        path = f"/v2/{image.reference.repository}/blobs/{desc.digest}"
        layers.append(LayerBlob(path, desc.digest, desc.size, desc.media_type))
    return ResolvedImage(
        source=label,
        manifest_digest=image.manifest_digest,
        manifest_media_type=image.manifest_media_type,
        config_digest=image.config_digest,
        config=image.config,
        layers=tuple(layers),
        platform=str(image.platform) if image.platform else None,
    )


def _resolve_remote(
    registry: SyncRegistryClient, source: ImageSource, platform: str | None
) -> ResolvedImage:
    assert source.remote is not None
    return _remote_image(registry.get_manifest(source.remote, _want_platform(platform)), source)


def inspect_image(ref: str, *, platform: str | None = None) -> ResolvedImage:
    """Read and verify an image's manifest and config without touching its layers."""
    source = parse_image_ref(ref)
    if source.remote is not None:
        with _registry_errors(), SyncRegistryClient() as registry:
            return _resolve_remote(registry, source, platform)
    with _open_files(source) as files:
        return _resolve(files, source, platform)


# -- conversion --------------------------------------------------------------


@dataclass(frozen=True)
class ImageLayer:
    """One converted layer of an image; file names are relative to the image directory."""

    digest: str
    meta: str
    blob: str
    blob_digest: str
    oci_digest: str
    oci_media_type: str
    oci_size: int
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
    files: _Files,
    image: ResolvedImage,
    number: int,
    layer: LayerBlob,
    out_dir: Path,
    chunk_size: int,
) -> tuple[LayerResult, int]:
    """Convert one layer; returns the converter's result and the blob's size as read."""
    total = len(image.layers)
    describe = f"image {image.source}: layer {number} of {total} ({layer.digest})"
    meta, blob = _layer_names(number, layer.digest)
    with files.open(layer.path) as stream:
        reader = HashingReader(stream, layer.digest, layer.size, describe)

        def verify() -> None:
            problem = reader.problem()
            if problem is not None:
                raise LayerDigestMismatch(
                    f"{describe}: {problem}; the archive is corrupt, export or download it again",
                    layer=number,
                    expected=layer.digest,
                    actual=reader.actual,
                )

        try:
            result = convert_stream(
                reader,  # type: ignore[arg-type]
                out_dir / meta,
                out_dir / blob,
                chunk_size=chunk_size,
                source=describe,
                verify=verify,
            )
        except DigestMismatch:
            raise
        except ConvertError as exc:
            # damaged bytes usually break decompression before the digest is known:
            # finish hashing, and when the digest is wrong say so, it is the cause
            reader.drain()
            if reader.problem() is not None:
                try:
                    verify()
                except LayerDigestMismatch as mismatch:
                    raise mismatch from exc
            raise
    return result, reader.count


def _convert_remote_layer(
    registry: SyncRegistryClient,
    remote: Reference,
    image: ResolvedImage,
    number: int,
    layer: LayerBlob,
    out_dir: Path,
    chunk_size: int,
) -> tuple[LayerResult, int]:
    """Convert one layer as it streams from the registry; returns the result and bytes read."""
    total = len(image.layers)
    describe = f"image {image.source}: layer {number} of {total} ({layer.digest})"
    meta, blob = _layer_names(number, layer.digest)
    assert layer.size is not None  # registry manifests always give sizes
    descriptor = RegistryDescriptor(layer.media_type, layer.digest, layer.size)

    def mismatch(exc: BlobDigestMismatch) -> LayerDigestMismatch:
        return LayerDigestMismatch(
            f"{describe}: {exc}", layer=number, expected=exc.expected, actual=exc.actual
        )

    with registry.open_blob(remote, descriptor) as stream:

        def verify() -> None:
            try:
                stream.verify()
            except BlobDigestMismatch as exc:
                raise mismatch(exc) from exc

        try:
            result = convert_stream(
                stream,  # type: ignore[arg-type]
                out_dir / meta,
                out_dir / blob,
                chunk_size=chunk_size,
                source=describe,
                verify=verify,
            )
        except DigestMismatch:
            raise
        except ConvertError as exc:
            # damaged bytes usually break decompression before the digest is known:
            # finish the download, and when the digest is wrong say so, it is the cause
            try:
                stream.drain()
            except RegistryError:
                raise exc from None  # the download failed too; the converter saw it first
            problem = stream.problem()
            if isinstance(problem, BlobDigestMismatch):
                raise mismatch(problem) from exc
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


def _image_layer(result: LayerResult, meta: str, blob: str, layer: LayerBlob, size: int) -> ImageLayer:
    return ImageLayer(
        digest=result.digest,
        meta=meta,
        blob=blob,
        blob_digest=result.blob_digest,
        oci_digest=layer.digest,
        oci_media_type=layer.media_type,
        oci_size=size,
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
    and the number of source bytes it read.
    """
    done: dict[str, ImageLayer] = {}
    layers = []
    for number, layer in enumerate(image.layers, start=1):
        if layer.digest not in done:
            meta, blob = _layer_names(number, layer.digest)
            fresh = [p for p in (out_dir / meta, out_dir / blob) if not p.exists()]
            result, size = convert_one(number, layer)
            created.extend(fresh)
            done[layer.digest] = _image_layer(result, meta, blob, layer, size)
        layers.append(done[layer.digest])
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
    defaults to ``linux/<host arch>``.

    On any failure the layer files this call created are removed, ``image.json``
    is not written, and the exception propagates: ``ImageRefError`` or
    ``SourceNotFound`` for references naming nothing, ``UnsupportedImage`` for
    non-image content, ``DigestMismatch`` (``LayerDigestMismatch`` for layers) for
    corrupt blobs, and the converter's ``BadArchive`` / ``BadEntry``.  From a
    registry also ``layerstore.registry.RegistryError`` (``RegistryAuthError``,
    ``RegistryUnavailable``, ``BlobTruncated``, ...).
    """
    started = time.monotonic()
    source = parse_image_ref(ref)
    out = Path(out_dir)
    created: list[Path] = []
    try:
        if source.remote is not None:
            remote = source.remote
            with _registry_errors(), SyncRegistryClient() as registry:
                image = _resolve_remote(registry, source, platform)
                (out / "layers").mkdir(parents=True, exist_ok=True)
                layers = _convert_layers(
                    lambda number, layer: _convert_remote_layer(
                        registry, remote, image, number, layer, out, chunk_size
                    ),
                    image,
                    out,
                    created,
                )
        else:
            with _open_files(source) as files:
                image = _resolve(files, source, platform)
                (out / "layers").mkdir(parents=True, exist_ok=True)
                layers = _convert_layers(
                    lambda number, layer: _convert_layer(
                        files, image, number, layer, out, chunk_size
                    ),
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
