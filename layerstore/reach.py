"""What a set of documents keeps alive: the one walk gc, verify and replicate share.

From each root digest, follow the documents a document names (``objects.doc_references``:
a composition's parts, a checkpoint's parent and attachments, a run's checkpoints) and
collect every layer they store (``Resolved.stored_layers``: layers and a VM disk's chain).
What happens to each document and layer (check it, mark it, copy it) is the caller's;
how documents are loaded is too, so that verify can report an unreadable one and go on
where gc and replicate stop.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from layerstore.objects import LayerEntry, doc_references, hex_digest, resolve_document

# digest -> the document, or None when it cannot be used (the loader has said why)
LoadDoc = Callable[[str], Awaitable[Mapping[str, Any] | None]]


@dataclass
class Reached:
    """Documents (by ``blake3:`` digest, in the order first reached) and layers (by digest)."""

    docs: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    layers: dict[str, LayerEntry] = field(default_factory=dict)
    unreadable: list[str] = field(default_factory=list)  # digests the loader gave None for

    def merge(self, other: Reached) -> None:
        for digest, doc in other.docs.items():
            self.docs.setdefault(digest, doc)
        for digest, layer in other.layers.items():
            self.layers.setdefault(digest, layer)
        self.unreadable.extend(d for d in other.unreadable if d not in self.unreadable)


async def reach(roots: Iterable[str], load: LoadDoc) -> Reached:
    """Every document and layer the ``roots`` keep alive.

    ``load`` raises to stop the walk (gc, replicate) or returns None to skip a
    document it has reported (verify); a skipped document's references are not followed.
    Raises what ``load`` and ``resolve_document`` raise (``FormatError`` for a
    malformed document, ``BadName`` for a reference that is not a digest).
    """
    out = Reached()
    pending = list(roots)
    while pending:
        digest = "blake3:" + hex_digest(pending.pop())
        if digest in out.docs or digest in out.unreadable:
            continue
        doc = await load(digest)
        if doc is None:
            out.unreadable.append(digest)
            continue
        out.docs[digest] = doc
        pending.extend(doc_references(doc))
        for layer in resolve_document(digest, doc).stored_layers:
            out.layers.setdefault(layer.digest, layer)
    return out
