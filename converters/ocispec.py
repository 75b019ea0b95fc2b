"""The OCI image model, without I/O: media types, digests, descriptors, platforms,
manifests, indexes, image configs, chain ids, and the errors of everything OCI.

Every OCI source (a layout directory, a layout tar, a ``docker save`` archive,
a registry) parses what it reads with the functions here, so that one rule
decides what a digest, a manifest or a platform is, and one message style
reports what is wrong with it.  Parsing is bytes/JSON -> typed values; reading
the bytes is the caller's business (converters/oci.py, converters/registry.py).

A source hands out blobs through :class:`BlobSource`: ``open_blob(desc)``
returns a :class:`BlobReader`, which counts and hashes the bytes as they pass
(:class:`BlobCheck`) and reports at the end whether they are the blob the
descriptor names.
"""

from __future__ import annotations

import hashlib
import io
import json
import platform as _platform
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any, Literal, Protocol

from converters.errors import ConvertError, DigestMismatch

# -- media types -------------------------------------------------------------

MT_OCI_INDEX = "application/vnd.oci.image.index.v1+json"
MT_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
MT_OCI_LAYER_GZIP = MT_OCI_LAYER + "+gzip"
MT_OCI_LAYER_ZSTD = MT_OCI_LAYER + "+zstd"
MT_DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MT_DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
MT_DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
MT_DOCKER_LAYER_TAR = "application/vnd.docker.image.rootfs.diff.tar"
MT_DOCKER_LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"

INDEX_TYPES = frozenset({MT_OCI_INDEX, MT_DOCKER_LIST})
MANIFEST_TYPES = frozenset({MT_OCI_MANIFEST, MT_DOCKER_MANIFEST})
CONFIG_TYPES = frozenset({MT_OCI_CONFIG, MT_DOCKER_CONFIG})
LAYER_TYPES = frozenset(
    {
        MT_OCI_LAYER,
        MT_OCI_LAYER_GZIP,
        MT_OCI_LAYER_ZSTD,
        "application/vnd.oci.image.layer.nondistributable.v1.tar",
        "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
        "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
        MT_DOCKER_LAYER_TAR,
        MT_DOCKER_LAYER_GZIP,
        "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
    }
)
MANIFEST_ACCEPT = ", ".join([MT_OCI_INDEX, MT_OCI_MANIFEST, MT_DOCKER_LIST, MT_DOCKER_MANIFEST])
# Content-Type values that say nothing about which document a body is
_GENERIC_TYPES = frozenset({"application/json", "text/plain", "application/octet-stream"})

REF_NAME = "org.opencontainers.image.ref.name"
# manifests and indexes are small documents; configs can carry long histories
MAX_MANIFEST_BYTES = 4 << 20
MAX_CONFIG_BYTES = 64 << 20
MAX_INDEX_DEPTH = 4


# -- errors ------------------------------------------------------------------


class OciError(ConvertError):
    """Reading an OCI image failed; ``retryable`` says whether trying again may help.

    Messages name the source (layout, archive or registry and repository),
    the blob's digest or the field, and the fix where there is one.
    """

    retryable = False


class ImageRefError(OciError, ValueError):
    """An image reference is malformed or names nothing (scheme, repository, tag, platform)."""


class InvalidPlatform(ImageRefError):
    """A platform is not ``OS/ARCH[/VARIANT]``."""


class PlatformNotFound(ImageRefError, LookupError):
    """An image index has no image for the requested platform."""


class ManifestNotFound(ImageRefError, FileNotFoundError):
    """The source has no image for this tag or digest (a registry's 404, a layout's missing tag)."""


class SourceNotFound(OciError, FileNotFoundError):
    """The file or directory an image reference points at does not exist."""


class BlobNotFound(OciError, FileNotFoundError):
    """A blob a manifest names is not in the layout, the archive or the registry."""


class UnsupportedImage(OciError):
    """The source holds something that is not a container image layerbox can read."""


class ManifestTooLarge(UnsupportedImage):
    """A manifest, index or config is larger than its limit (4 MiB, 64 MiB for configs)."""


class RegistryError(OciError):
    """A registry answered something other than the content asked for (HTTP status, transport)."""


class RegistryAuthError(RegistryError, PermissionError):
    """The registry wants credentials we do not have, or rejected the ones we sent."""


class RegistryUnavailable(RegistryError, ConnectionError):
    """Connection errors or 5xx answers persisted through every retry."""

    retryable = True


class ClientNotOpen(OciError, RuntimeError):
    """A registry client used before it was opened or after it was closed.

    Also a ``RuntimeError``, which is what aiohttp and asyncio raise for a closed
    session or loop; the message names the client and the ``with`` form to use.
    """


class BlobMismatch(OciError, DigestMismatch):
    """A blob's bytes are not the ones its descriptor names.

    ``expected`` is the descriptor's digest, ``actual`` the digest of the bytes
    read (``None`` when the reading stopped before the end).
    """

    def __init__(self, message: str, *, expected: str, actual: str | None = None) -> None:
        super().__init__(message)
        self.expected = expected
        self.actual = actual


class BlobDigestMismatch(BlobMismatch):
    """A blob or manifest has the right size but does not hash to the digest naming it."""


class BlobSizeMismatch(BlobMismatch):
    """A blob's byte count differs from its descriptor's size."""


class BlobTruncated(BlobSizeMismatch):
    """A blob download ended (or the connection broke) before its last byte."""

    retryable = True


class LayerDigestMismatch(BlobMismatch):
    """A layer's bytes do not match its descriptor; ``layer`` is 1-based, lowest first."""

    def __init__(self, message: str, *, layer: int, expected: str, actual: str | None) -> None:
        super().__init__(message, expected=expected, actual=actual)
        self.layer = layer


class DiffIdMismatch(OciError, DigestMismatch):
    """A layer's uncompressed tar does not hash to the config's ``rootfs.diff_ids`` entry.

    ``layer`` is 1-based, ``digest`` the layer blob's digest, ``expected`` the
    config's diff id and ``actual`` the sha256 of the uncompressed tar.
    """

    def __init__(self, message: str, *, layer: int, digest: str, expected: str, actual: str) -> None:
        super().__init__(message)
        self.layer = layer
        self.digest = digest
        self.expected = expected
        self.actual = actual


# -- digests -----------------------------------------------------------------

DIGEST_HEX = {"sha256": 64, "sha512": 128}
_DIGEST_RE = re.compile(r"^(sha256|sha512):([0-9a-f]+)$")


def check_digest(digest: object, where: str) -> str:
    """Return ``digest`` if it is ``sha256:<64 hex>`` or ``sha512:<128 hex>`` (lowercase), else raise.

    The OCI image spec allows other algorithms in its grammar, but content
    layerbox cannot verify is content it does not read.  ``where`` names the
    document and field, e.g. ``"oci:/srv/img:v1: manifest sha256:…, layer 2"``.
    """
    m = _DIGEST_RE.match(digest) if isinstance(digest, str) else None
    if m is None or len(m.group(2)) != DIGEST_HEX[m.group(1)]:
        raise UnsupportedImage(
            f"{where}: malformed or unsupported digest {digest!r} (sha256:<64 hex> or sha512:<128 hex>)"
        )
    return str(digest)


def digest_of(data: bytes, algorithm: str = "sha256") -> str:
    return f"{algorithm}:{hashlib.new(algorithm, data).hexdigest()}"


def chain_ids(diff_ids: Sequence[str]) -> tuple[str, ...]:
    """The chain id of each layer, lowest first, from the config's ``rootfs.diff_ids``.

    As the OCI image spec defines it: ChainID(L0) = DiffID(L0);
    ChainID(Ln) = sha256(ChainID(Ln-1) + " " + DiffID(Ln)), written ``sha256:<hex>``.
    containerd names committed layer snapshots by these.
    """
    out: list[str] = []
    for diff_id in diff_ids:
        out.append(diff_id if not out else digest_of(f"{out[-1]} {diff_id}".encode()))
    return tuple(out)


def chain_id(diff_ids: Sequence[str]) -> str:
    """The chain id of the top layer of ``diff_ids`` (lowest first); see :func:`chain_ids`."""
    if not diff_ids:
        raise ValueError("chain_id of no layers")
    return chain_ids(diff_ids)[-1]


# -- registry references -------------------------------------------------

DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPOSITORY_RE = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
_TAG_RE = re.compile(r"^\w[\w.-]{0,127}$")
_HOST_RE = re.compile(
    r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
    r"|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?$"
)


@dataclass(frozen=True)
class Reference:
    """A parsed ``host[:port]/repository[:tag][@digest]``.

    ``registry`` is the name as written (``docker.io`` for Docker Hub);
    ``host`` is where the API lives.  A digest, when present, is what gets
    fetched; the tag is kept for messages.
    """

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @property
    def host(self) -> str:
        return DOCKER_HUB_API if self.registry == DOCKER_HUB else self.registry

    @property
    def reference(self) -> str:
        """The tag or digest the manifest is fetched by."""
        return self.digest or self.tag or "latest"

    @property
    def scope(self) -> str:
        """The token scope for reading this repository."""
        return f"repository:{self.repository}:pull"

    def with_digest(self, digest: str) -> Reference:
        return replace(self, digest=digest)

    def __str__(self) -> str:
        text = f"{self.registry}/{self.repository}"
        if self.tag is not None:
            text += f":{self.tag}"
        if self.digest is not None:
            text += f"@{self.digest}"
        return text


def parse_reference(text: str) -> Reference:
    """Parse ``host[:port]/repo[:tag|@digest]`` as docker and skopeo do.

    The first path component is a registry host when it contains ``.`` or
    ``:`` or is ``localhost``; otherwise the image is on Docker Hub
    (``docker.io``, with ``library/`` before one-component names).  A
    reference without tag or digest means ``:latest``.
    """
    if not text or text != text.strip():
        raise ImageRefError(f"image reference {text!r} is empty or has surrounding spaces")
    name, at, digest = text.partition("@")
    if at:
        try:
            check_digest(digest, f"image reference {text!r}")
        except UnsupportedImage as exc:
            raise ImageRefError(str(exc)) from None
    first, slash, rest = name.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        registry, remainder = first, rest
        if not _HOST_RE.match(registry):
            raise ImageRefError(f"image reference {text!r}: malformed registry host {registry!r}")
    else:
        registry, remainder = DOCKER_HUB, name
    if registry in ("index.docker.io", DOCKER_HUB_API):
        registry = DOCKER_HUB
    tag: str | None = None
    last_slash = remainder.rfind("/")
    colon = remainder.rfind(":")
    if colon > last_slash:
        remainder, tag = remainder[:colon], remainder[colon + 1 :]
        if not _TAG_RE.match(tag):
            raise ImageRefError(
                f"image reference {text!r}: malformed tag {tag!r} (letters, digits, '_', '.', '-'; "
                "at most 128 characters)"
            )
    if registry == DOCKER_HUB and "/" not in remainder:
        remainder = "library/" + remainder
    if not _REPOSITORY_RE.match(remainder):
        raise ImageRefError(
            f"image reference {text!r}: malformed repository {remainder!r} "
            "(lowercase letters, digits and separators; expected host[:port]/repo[:tag|@digest])"
        )
    if tag is None and not at:
        tag = "latest"
    return Reference(registry, remainder, tag, digest if at else None)


# -- platforms ---------------------------------------------------------------

_ARCH = {
    "x86_64": "amd64",
    "amd64": "amd64",
    "aarch64": "arm64",
    "arm64": "arm64",
    "armv7l": "arm",
    "armv6l": "arm",
    "i386": "386",
    "i686": "386",
    "ppc64le": "ppc64le",
    "s390x": "s390x",
    "riscv64": "riscv64",
}


@dataclass(frozen=True)
class Platform:
    """``OS/ARCH[/VARIANT]`` as in OCI image indexes."""

    os: str
    architecture: str
    variant: str | None = None

    def __str__(self) -> str:
        return "/".join(p for p in (self.os, self.architecture, self.variant) if p)

    @classmethod
    def parse(cls, text: str) -> Platform:
        parts = text.split("/")
        if not 2 <= len(parts) <= 3 or not all(parts):
            raise InvalidPlatform(f"platform {text!r}: expected OS/ARCH[/VARIANT], e.g. linux/amd64")
        return cls(parts[0], parts[1], parts[2] if len(parts) == 3 else None)

    @classmethod
    def from_json(cls, obj: object) -> Platform | None:
        """The platform of a descriptor's ``platform`` object or an image config, if named."""
        if not isinstance(obj, Mapping):
            return None
        os_name, arch, variant = obj.get("os"), obj.get("architecture"), obj.get("variant")
        if not isinstance(os_name, str) or not isinstance(arch, str) or not os_name or not arch:
            return None
        return cls(os_name, arch, variant if isinstance(variant, str) and variant else None)

    def matches(self, other: Platform) -> bool:
        """Whether ``other`` (from a descriptor) satisfies this requested platform."""
        if (self.os, self.architecture) != (other.os, other.architecture):
            return False
        if self.variant is None:
            return True
        default = "v8" if self.architecture == "arm64" else None
        return self.variant == (other.variant or default)


def host_platform() -> Platform:
    """``linux/<GOARCH>`` of this host, e.g. ``linux/amd64`` on x86_64."""
    machine = _platform.machine().lower()
    return Platform("linux", _ARCH.get(machine, machine))


def want_platform(platform: Platform | str | None) -> Platform:
    """The requested platform: a :class:`Platform`, ``OS/ARCH[/VARIANT]``, or this host's."""
    if isinstance(platform, Platform):
        return platform
    return Platform.parse(platform) if platform else host_platform()


# -- descriptors, indexes, manifests, configs ---------------------------------


@dataclass(frozen=True)
class Descriptor:
    """What a manifest or index says about another blob: media type, digest, size."""

    media_type: str
    digest: str
    size: int
    platform: Platform | None = None
    annotations: Mapping[str, str] = field(default_factory=dict)

    @property
    def ref_name(self) -> str | None:
        return self.annotations.get(REF_NAME)

    @classmethod
    def from_json(cls, obj: object, where: str) -> Descriptor:
        if not isinstance(obj, Mapping):
            raise UnsupportedImage(f"{where}: a descriptor must be a JSON object")
        size = obj.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise UnsupportedImage(f"{where}: descriptor has no valid 'size'")
        media_type = obj.get("mediaType")
        annotations = obj.get("annotations")
        return cls(
            media_type=media_type if isinstance(media_type, str) else "",
            digest=check_digest(obj.get("digest"), f"{where}, 'digest'"),
            size=size,
            platform=Platform.from_json(obj.get("platform")),
            annotations={str(k): str(v) for k, v in annotations.items()}
            if isinstance(annotations, Mapping)
            else {},
        )


def parse_json(data: bytes, what: str) -> dict[str, Any]:
    """A JSON object, or :class:`UnsupportedImage` naming ``what``."""
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UnsupportedImage(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise UnsupportedImage(f"{what} is not a JSON object")
    return doc


def check_size(size: int, limit: int, what: str) -> None:
    """Refuse a document of ``size`` bytes when it is over ``limit`` (before reading it)."""
    if size > limit:
        raise ManifestTooLarge(f"{what} is {size} bytes, more than the {limit} byte limit; refusing to read it")


def _schema1(media_type: str) -> bool:
    return media_type.startswith("application/vnd.docker.distribution.manifest.v1+")


def manifest_kind(
    doc: Mapping[str, Any], what: str, named_by: Iterable[str] = ()
) -> tuple[str, Literal["index", "manifest"]]:
    """The media type of a manifest or index document and which of the two it is.

    ``named_by`` are the media types others gave it (the descriptor pointing
    here, a registry's Content-Type).  The document's own ``mediaType`` wins and
    must agree with every image type named elsewhere; without one, the first
    image type named elsewhere; without any, the document's shape decides.
    Schema-1 manifests and artifacts are refused.
    """
    declared = doc.get("mediaType") if isinstance(doc.get("mediaType"), str) else ""
    outside = [t for t in named_by if t and t not in _GENERIC_TYPES]
    known = INDEX_TYPES | MANIFEST_TYPES
    if any(_schema1(t) for t in (declared, *outside) if t):
        raise UnsupportedImage(
            f"{what}: Docker schema 1 manifests are not supported; push the image again with a "
            "current client (skopeo, docker >= 1.10)"
        )
    media_type = declared or next((t for t in outside if t in known), outside[0] if outside else "")
    if not media_type:
        if "manifests" in doc:
            media_type = MT_OCI_INDEX
        elif "layers" in doc:
            media_type = MT_OCI_MANIFEST
    if media_type not in known:
        raise UnsupportedImage(
            f"{what}: media type {media_type!r} is not an image manifest or index "
            "(artifacts are not images layerbox can convert)"
        )
    for other in outside:
        if other != media_type:
            raise UnsupportedImage(f"{what}: the document is a {media_type!r}, but it was named as {other!r}")
    return media_type, "index" if media_type in INDEX_TYPES else "manifest"


def index_entries(doc: Mapping[str, Any], where: str) -> list[Descriptor]:
    """The ``manifests`` of an index (or a layout's ``index.json``)."""
    manifests = doc.get("manifests")
    if not isinstance(manifests, list):
        raise UnsupportedImage(f"{where}: the index has no 'manifests' list")
    return [Descriptor.from_json(m, f"{where}, manifests[{i}]") for i, m in enumerate(manifests)]


def select_platform(entries: Sequence[Descriptor], want: Platform, where: str) -> Descriptor:
    """The first index entry whose platform matches ``want``.

    An index with a single entry that names no platform is taken as is.
    """
    if not entries:
        raise UnsupportedImage(f"{where}: the index lists no manifests")
    if len(entries) == 1 and entries[0].platform is None:
        return entries[0]
    for entry in entries:
        if entry.platform is not None and want.matches(entry.platform):
            return entry
    have = sorted({str(d.platform) for d in entries if d.platform is not None})
    raise PlatformNotFound(
        f"{where}: no image for platform {want}; available: {', '.join(have) or 'none named'} "
        "(pass platform='OS/ARCH' to choose one)"
    )


@dataclass(frozen=True)
class ImageManifest:
    """An image manifest's config descriptor and layer descriptors (lowest first)."""

    config: Descriptor
    layers: tuple[Descriptor, ...]


def parse_manifest(doc: Mapping[str, Any], what: str) -> ImageManifest:
    """Check an image manifest: schema version 2, an image config, tar layers."""
    if doc.get("schemaVersion") != 2:
        raise UnsupportedImage(f"{what}: schemaVersion {doc.get('schemaVersion')!r}, expected 2")
    config = Descriptor.from_json(doc.get("config"), f"{what}, config")
    if config.media_type not in CONFIG_TYPES:
        raise UnsupportedImage(
            f"{what}: config media type {config.media_type!r} is not a container image config "
            "(an artifact, not an image)"
        )
    raw_layers = doc.get("layers")
    if not isinstance(raw_layers, list):
        raise UnsupportedImage(f"{what}: no 'layers' list")
    layers = tuple(Descriptor.from_json(obj, f"{what}, layer {i + 1}") for i, obj in enumerate(raw_layers))
    for i, layer in enumerate(layers):
        if layer.media_type not in LAYER_TYPES:
            raise UnsupportedImage(
                f"{what}: layer {i + 1} has media type {layer.media_type!r}, "
                "which is not a tar layer (plain, gzip or zstd)"
            )
    return ImageManifest(config, layers)


def diff_ids(config: Mapping[str, Any], layers: int, what: str) -> tuple[str, ...]:
    """The config's ``rootfs.diff_ids``, one sha256 digest per layer, lowest first."""
    rootfs = config.get("rootfs")
    ids = rootfs.get("diff_ids") if isinstance(rootfs, Mapping) else None
    if not isinstance(ids, list) or len(ids) != layers:
        count = len(ids) if isinstance(ids, list) else "no"
        raise UnsupportedImage(f"{what}: rootfs.diff_ids lists {count} diff ids for {layers} layers")
    return tuple(check_digest(d, f"{what}, rootfs.diff_ids[{i}]") for i, d in enumerate(ids))


def config_platform(config: Mapping[str, Any]) -> Platform | None:
    """The platform an image config names (``os``, ``architecture``, ``variant``)."""
    return Platform.from_json(config)


# -- verifying blob streams ---------------------------------------------------


class BlobCheck:
    """Counts and hashes a blob's bytes as they pass and judges them against a descriptor.

    ``update`` raises :class:`BlobSizeMismatch` as soon as more bytes arrive
    than the descriptor's size; ``problem(ended=True)`` says what is wrong
    with all the bytes (too few: ``short`` — :class:`BlobTruncated` for a
    download, :class:`BlobSizeMismatch` for a file —, other content:
    :class:`BlobDigestMismatch`), ``None`` when they are the blob.  ``what``
    names the blob in messages (source and digest), ``remedy`` says what to do.
    """

    def __init__(
        self,
        desc: Descriptor,
        what: str,
        *,
        remedy: str = "the copy is corrupt: export or download the image again",
        short: type[BlobSizeMismatch] = BlobSizeMismatch,
    ) -> None:
        self.descriptor = desc
        self.what = what
        self.remedy = remedy
        self._short = short
        self._hash = hashlib.new(desc.digest.partition(":")[0])
        self.count = 0

    @property
    def actual(self) -> str:
        return f"{self._hash.name}:{self._hash.hexdigest()}"

    def update(self, data: bytes) -> None:
        self.count += len(data)
        if self.count > self.descriptor.size:
            raise BlobSizeMismatch(
                f"{self.what}: more than the {self.descriptor.size} bytes its descriptor names; {self.remedy}",
                expected=self.descriptor.digest,
            )
        self._hash.update(data)

    def problem(self) -> BlobMismatch | None:
        """What is wrong with the bytes counted so far as the whole blob, or ``None``."""
        desc = self.descriptor
        if self.count != desc.size:
            return self._short(
                f"{self.what}: expected {desc.size} bytes, read {self.count} (truncated; digest "
                f"{self.actual}, expected {desc.digest}); {self.remedy}",
                expected=desc.digest,
                actual=self.actual,
            )
        if self.actual != desc.digest:
            return BlobDigestMismatch(
                f"{self.what}: expected digest {desc.digest}, got {self.actual}; {self.remedy}",
                expected=desc.digest,
                actual=self.actual,
            )
        return None


class BlobReader(Protocol):
    """A blocking, file-like view of one blob that checks it against its descriptor.

    ``read(n)`` returns up to ``n`` bytes (``b""`` at the end) and raises the
    source's errors (a broken download, more bytes than the descriptor's
    size).  After the last byte, ``problem()`` is ``None`` when size and digest
    match, else the :class:`BlobMismatch` naming the digest; before it, an
    error saying so.  ``verify()`` raises that problem.  ``drain()`` reads the
    rest so that ``problem()`` can judge the whole blob.  ``count`` is the
    number of bytes handed out.  Nothing derived from a blob may be committed
    before ``verify()`` passed.
    """

    @property
    def count(self) -> int: ...

    def read(self, size: int = -1, /) -> bytes: ...

    def drain(self) -> None: ...

    def problem(self) -> OciError | None: ...

    def verify(self) -> None: ...

    def close(self) -> None: ...

    def __enter__(self) -> BlobReader: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


class VerifyingStream(io.RawIOBase):
    """What every :class:`BlobReader` shares: subclasses give ``read`` and ``problem``."""

    chunk = 1 << 20  # what readall and drain ask for at a time

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def readall(self) -> bytes:
        parts = []
        while data := self.read(self.chunk):
            parts.append(data)
        return b"".join(parts)

    def drain(self) -> None:
        """Read and discard the rest of the blob, so :meth:`problem` can judge all of it."""
        while self.read(self.chunk):
            pass

    def problem(self) -> OciError | None:
        raise NotImplementedError

    def verify(self) -> None:
        """Raise unless the whole blob was read and matched its size and digest."""
        problem = self.problem()
        if problem is not None:
            raise problem


class BlobSource(Protocol):
    """Where an image's blobs are: a layout directory or tar, a docker-archive, a registry."""

    def open_blob(self, desc: Descriptor) -> BlobReader:
        """Open the blob ``desc`` names; :class:`BlobNotFound` when the source lacks it."""
        ...
