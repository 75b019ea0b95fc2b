"""Store layout and the documents layerbox keeps in a store.

Keys (docs/FORMAT.md, "Store layout"):

    packs/<xx>/<pack id>       packed zstd chunks (layerstore/packs.py)
    index/<xx>/<pack id>       the pack's index, copied out (derived data)
    meta/<xx>/<layer digest>   zstd of a layer's EROFS metadata image
    docs/<xx>/<doc digest>     JSON documents: image, composition, checkpoint
    refs/<repo>:<tag>          mutable name -> document digest, with history
    traces/<xx>/<digest>       a document's or a layer's access trace (parse_trace; written by lazyfetch)
    locks/<kind>-<id>          publish and gc locks (layerstore/locks.py)
    config                     the store's layout version and id (parse_store_config)

Every immutable object is named by the blake3 of its (uncompressed) content,
so a reader can always check what it got.  Documents are canonical JSON
(sorted keys, no spaces): the same content always has the same digest.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import blake3

from layerstore.errors import FormatError, LayerstoreError

SCHEMA_IMAGE = "layerbox.image.v1"
SCHEMA_COMPOSITION = "layerbox.composition.v1"
SCHEMA_REF = "layerbox.ref.v1"
SCHEMA_STORE = "layerbox.store"
STORE_LAYOUT = 1  # the key layout this code reads and writes (docs/FORMAT.md "The store config")
CONFIG_KEY = "config"
# Documents without layers, kept alive by the refs or checkpoints that name them.
SCHEMA_RECEIPTS = "layerbox.receipts.v1"
SCHEMA_OPTIONS = "layerbox.sandbox-options.v1"  # a checkpoint's sandbox options (sandbox.core.model)
SCHEMA_RUN = "layerbox.run.v1"
SCHEMA_VM_TEMPLATE = "layerbox.vm-template.v2"  # a saved VM: one layer, its memory and device state (sandbox.backends.vm.qemu)
SCHEMA_TRACE = "layerbox.trace.v1"  # not a document: mutable, kept while its document (or layer) is reachable
REF_HISTORY = 50
PART_ORDER = ("base", "workspace", "toolkit")  # lowest first: the mission's base + workspace + toolkit

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_REPO = re.compile(r"^[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
REF_NAME_MAX = 240


class BadName(LayerstoreError, ValueError):
    pass


class DigestMismatch(LayerstoreError):
    """An object's bytes do not hash to its name: never returned as data."""

    def __init__(self, key: str, store: str, actual: str) -> None:
        self.key = key
        self.store = store
        super().__init__(
            f"{store}: object {key!r} is corrupt (its content hashes to {actual}); "
            "run `layerbox verify` to list every damaged object, then re-publish the source"
        )


def hex_digest(digest: str | bytes) -> str:
    if isinstance(digest, bytes):
        return digest.hex()
    value = digest.removeprefix("blake3:")
    if not _HEX64.match(value):
        raise BadName(f"not a blake3 digest: {digest!r}")
    return value


def _fan(prefix: str, hexd: str) -> str:
    return f"{prefix}/{hexd[:2]}/{hexd}"


def pack_key(pack_id: str | bytes) -> str:
    return _fan("packs", hex_digest(pack_id))


def index_key(pack_id: str | bytes) -> str:
    return _fan("index", hex_digest(pack_id))


def meta_key(layer: str | bytes) -> str:
    return _fan("meta", hex_digest(layer))


def doc_key(digest: str | bytes) -> str:
    return _fan("docs", hex_digest(digest))


def trace_key(image: str | bytes) -> str:
    """The key of the access trace of ``image``: a document (an image, composition or checkpoint), or
    a layer (what mounts of any document read of it)."""
    return _fan("traces", hex_digest(image))


def parse_ref(name: str, default_tag: str = "latest") -> tuple[str, str]:
    """``repo[:tag]`` -> (repo, tag), validated."""
    if ":" in name.rsplit("/", 1)[-1]:
        repo, tag = name.rsplit(":", 1)
    else:
        repo, tag = name, default_tag
    if not _REPO.match(repo):
        raise BadName(
            f"invalid name {repo!r}: use lowercase letters, digits and . _ - separated path components"
        )
    if not _TAG.match(tag):
        raise BadName(f"invalid tag {tag!r}: use letters, digits, '_', '.', '-' (at most 128)")
    # refs/<repo>:<tag> is a file in a POSIX store, next to its ".<name>.lock": its last component
    # and the tag share one file name, which NAME_MAX (255) bounds with that lock's 6 more
    if len(repo) > 512 or len(repo.rsplit("/", 1)[-1]) + 1 + len(tag) > REF_NAME_MAX:
        raise BadName(f"invalid name {name[:80]!r}...: the last path component with its tag is at most "
                      f"{REF_NAME_MAX} characters, the repository at most 512")
    return repo, tag


def ref_key(name: str) -> str:
    repo, tag = parse_ref(name)
    return f"refs/{repo}:{tag}"


def ref_name_from_key(key: str) -> str:
    return key.removeprefix("refs/")


def canonical(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def digest_of(data: bytes) -> str:
    return "blake3:" + blake3.blake3(data).hexdigest()


def load_json(data: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{what}: not a JSON document ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("schema"), str):
        raise FormatError(f"{what}: a document must be a JSON object with a 'schema' field")
    return doc


def parse_ref_doc(data: bytes, key: str, what: str) -> dict[str, Any]:
    """The ref object stored under ``key``, checked strictly (docs/FORMAT.md "Refs").

    ``what`` names the store and key in messages.  Raises :class:`FormatError`
    for anything but a ``layerbox.ref.v1`` object whose ``name`` is the key's
    name, whose ``digest`` is a document digest, whose ``kind`` is a string and
    whose ``history`` is a list of objects with a ``digest``.
    """
    doc = load_json(data, what)
    if doc["schema"] != SCHEMA_REF:
        raise FormatError(f"{what}: schema {doc['schema']!r} is not {SCHEMA_REF!r} "
                          "(a newer layerbox may have written it, or the object is not a ref)")
    name = ref_name_from_key(key)
    if doc.get("name") != name:
        raise FormatError(f"{what}: names ref {doc.get('name')!r}, but its key says {name!r} "
                          "(copied or renamed by hand? move it with `layerbox tag`)")
    digest = doc.get("digest")
    if not isinstance(digest, str) or not _HEX64.match(digest.removeprefix("blake3:")) \
            or not digest.startswith("blake3:"):
        raise FormatError(f"{what}: 'digest' must be a document digest blake3:<64 hex>, not {digest!r}")
    if not isinstance(doc.get("kind", "image"), str):
        raise FormatError(f"{what}: 'kind' must be a string, not {doc.get('kind')!r}")
    history = doc.get("history", [])
    if not isinstance(history, list) or not all(
            isinstance(h, dict) and isinstance(h.get("digest"), str) for h in history):
        raise FormatError(f"{what}: 'history' must be a list of objects with a 'digest'")
    return doc


def parse_trace(doc: Any, image: str | bytes, what: str) -> dict[str, Any]:
    """An access trace of document (or layer) ``image``, checked (docs/FORMAT.md "Access traces").

    Returns a fresh ``{"schema", "image", "layers"}`` with every digest in its
    canonical spelling (``blake3:<hex>`` for the image and layers, bare hex
    for chunks).  Raises :class:`FormatError` naming ``what`` for anything else:
    another schema, an ``image`` other than ``image``, unknown fields, or
    ``layers`` that is not an object of layer digest -> list of chunk digests.
    """
    want = "blake3:" + hex_digest(image)
    if not isinstance(doc, Mapping) or doc.get("schema") != SCHEMA_TRACE:
        raise FormatError(f"{what}: not a {SCHEMA_TRACE!r} object")
    extra = sorted(set(doc) - {"schema", "image", "layers"})
    if extra:
        raise FormatError(f"{what}: unknown field(s) {', '.join(map(repr, extra))} in a {SCHEMA_TRACE}")
    got = doc.get("image")
    if not isinstance(got, str) or not _HEX64.match(got.removeprefix("blake3:")) \
            or got.removeprefix("blake3:") != want.removeprefix("blake3:"):
        raise FormatError(f"{what}: 'image' is {got!r}, but the trace is of {want}")
    layers = doc.get("layers")
    if not isinstance(layers, Mapping):
        raise FormatError(f"{what}: 'layers' must be an object of layer digest -> chunk digests")
    out: dict[str, list[str]] = {}
    for layer, chunks in layers.items():
        if not isinstance(layer, str) or not _HEX64.match(layer.removeprefix("blake3:")):
            raise FormatError(f"{what}: {layer!r} in 'layers' is not a layer digest blake3:<64 hex>")
        if not isinstance(chunks, list) or not all(isinstance(c, str) and _HEX64.match(c) for c in chunks):
            raise FormatError(f"{what}: 'layers' of {layer} must be a list of chunk digests (64 lowercase hex)")
        out["blake3:" + layer.removeprefix("blake3:")] = list(dict.fromkeys(chunks))
    return {"schema": SCHEMA_TRACE, "image": want, "layers": out}


class StoreVersionError(FormatError):
    """The store's layout is newer than this code understands."""

    fix = "upgrade layerbox on this host before using the store"


def new_store_config(store_id: str, created: str) -> dict[str, Any]:
    return {"schema": SCHEMA_STORE, "layout": STORE_LAYOUT, "id": store_id, "created": created}


def parse_store_config(data: bytes, what: str) -> dict[str, Any]:
    """The ``config`` object, checked; refuses a layout newer than ``STORE_LAYOUT``."""
    doc = load_json(data, what)
    layout = doc.get("layout")
    if doc["schema"] != SCHEMA_STORE or not isinstance(layout, int) or isinstance(layout, bool) \
            or layout < 1 or not isinstance(doc.get("id"), str):
        raise FormatError(f"{what}: not a layerbox store config (want schema {SCHEMA_STORE!r}, "
                          "an integer 'layout' and a string 'id')")
    if layout > STORE_LAYOUT:
        raise StoreVersionError(
            f"{what}: the store uses layout {layout}, this layerbox knows layouts up to "
            f"{STORE_LAYOUT}: upgrade layerbox on this host before using the store")
    return doc


# -- documents ----------------------------------------------------------------------


@dataclass(frozen=True)
class LayerEntry:
    """A layer as an image names it: the metadata image and where its chunks live."""

    digest: str  # blake3 of the metadata image
    packs: tuple[str, ...]  # hex ids of every pack holding one of its chunks
    meta_size: int
    blob_size: int
    chunk_size: int
    files: int
    bytes: int
    chunks: int
    source: Mapping[str, Any] = field(default_factory=dict)  # provenance, opaque here (docs/FORMAT.md)

    def to_json(self) -> dict[str, Any]:
        return {
            "digest": self.digest, "packs": list(self.packs), "meta_size": self.meta_size,
            "blob_size": self.blob_size, "chunk_size": self.chunk_size, "files": self.files,
            "bytes": self.bytes, "chunks": self.chunks, "source": dict(self.source),
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], what: str) -> LayerEntry:
        try:
            hex_digest(obj["digest"])
            return cls(
                digest=obj["digest"], packs=tuple(hex_digest(p) for p in obj["packs"]),
                meta_size=int(obj["meta_size"]), blob_size=int(obj["blob_size"]),
                chunk_size=int(obj["chunk_size"]), files=int(obj["files"]), bytes=int(obj["bytes"]),
                chunks=int(obj["chunks"]), source=dict(obj.get("source") or {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"{what}: malformed layer entry ({exc!r})") from None


@dataclass(frozen=True)
class ImageDoc:
    layers: tuple[LayerEntry, ...]  # lowest first
    config: Mapping[str, Any]  # the OCI image config (env, entrypoint, cmd, workdir, user)
    source: Mapping[str, Any]  # provenance: reference, manifest digest...

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA_IMAGE, "layers": [layer.to_json() for layer in self.layers],
                "config": dict(self.config), "source": dict(self.source)}


@dataclass(frozen=True)
class Part:
    role: str
    name: str  # the ref it was resolved from ("" when given by digest)
    digest: str  # image (or composition) document digest


@dataclass(frozen=True)
class CompositionDoc:
    parts: tuple[Part, ...]  # in PART_ORDER
    layers: tuple[LayerEntry, ...]  # the parts' layers, lowest first
    config: Mapping[str, Any]  # the base's config with the others' Env merged in

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA_COMPOSITION,
            "parts": {p.role: {"name": p.name, "digest": p.digest} for p in self.parts},
            "layers": [layer.to_json() for layer in self.layers],
            "config": dict(self.config),
        }


@dataclass(frozen=True)
class Resolved:
    """Any document that resolves to an ordered layer list."""

    digest: str
    kind: str  # "image", "composition", "checkpoint", "vm-template", ...
    layers: tuple[LayerEntry, ...]
    config: Mapping[str, Any]
    doc: Mapping[str, Any]

    @property
    def disk(self) -> LayerEntry | None:
        """A microVM checkpoint's disk: a layer holding one file, ``disk.img`` (the VM's whole
        block device, holes where nothing was written), not a layer of the root's overlay."""
        disk = self.doc.get("disk")
        return LayerEntry.from_json(disk, f"document {self.digest}: disk") if disk is not None else None

    @property
    def disk_chain(self) -> tuple[LayerEntry, ...]:
        """A microVM checkpoint's disk as the layers it stacks, base first: the base holds
        ``disk.img``, each later one ``delta.qcow2`` (the clusters written since the one
        before it); the last is :attr:`disk`.  Empty for any other document."""
        disk = self.disk
        if disk is None:
            return ()
        base = tuple(LayerEntry.from_json(x, f"document {self.digest}: disk_base")
                     for x in self.doc.get("disk_base") or ())
        return (*base, disk)

    @property
    def stored_layers(self) -> tuple[LayerEntry, ...]:
        """Every layer the document keeps alive in the store: its layers and its disk's chain."""
        return (*self.layers, *self.disk_chain)


def resolve_document(digest: str, doc: Mapping[str, Any]) -> Resolved:
    schema = doc.get("schema")
    what = f"document {digest}"
    kinds = {SCHEMA_IMAGE: "image", SCHEMA_COMPOSITION: "composition", SCHEMA_RECEIPTS: "receipts",
             SCHEMA_OPTIONS: "options", SCHEMA_RUN: "run", SCHEMA_VM_TEMPLATE: "vm-template"}
    kind = kinds.get(str(schema)) or ("checkpoint" if str(schema).startswith("layerbox.checkpoint.") else None)
    if kind is None:
        raise FormatError(f"{what}: unknown schema {schema!r} (a newer layerbox may have written it)")
    layers = tuple(LayerEntry.from_json(layer, what) for layer in doc.get("layers", []))
    return Resolved(digest, kind, layers, doc.get("config") or {}, doc)


def doc_references(doc: Mapping[str, Any]) -> list[str]:
    """Digests of the documents ``doc`` keeps alive (what gc follows besides layers)."""
    out = [part["digest"] for part in (doc.get("parts") or {}).values()]  # a composition's parts
    if doc.get("parent"):  # a checkpoint's parent
        out.append(doc["parent"])
    out.extend((doc.get("attachments") or {}).values())  # e.g. a checkpoint's receipts
    for entry in (doc.get("sandboxes") or {}).values():  # a run manifest's checkpoints
        out.append(entry["checkpoint_digest"])
    return [str(d) for d in out]
