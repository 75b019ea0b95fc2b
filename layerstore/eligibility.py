"""Which images may leave their pool: an operator's eligibility policy, and its verdicts.

A policy (docs/FORMAT.md "Eligibility policy") lists ref-name prefixes and image labels.
``replicate`` copies only eligible refs when given one, and the fleet's placement asks
the same question before a create overflows to another pool, so both hold the policy
as this one typed value, stored as versioned JSON.

Verdicts (:class:`Judge`), by the kind of document a ref names:

- an image (or any other document with layers: a VM template) is eligible when a ref
  name that points at it starts with one of ``prefixes``, or its OCI config carries one
  of ``labels`` (``config.config.Labels``, recorded at publish time; directories and
  tarballs have no config and so no labels);
- a composition when every part is (a part counts the name it was composed from, and
  every ref that points at its digest);
- a checkpoint when its ``base`` is (the image or composition its sandbox started from:
  a checkpoint holds that image's layers, so it may go where the image may);
- a run manifest when every checkpoint it names is.

Prefixes and labels are alternatives: one match is enough.  A composition's own ref
name does not make it eligible (it would carry its parts' layers past the policy).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from layerstore.errors import FormatError, LayerstoreError
from layerstore.objects import BadName, hex_digest, ref_key, ref_name_from_key
from layerstore.store import Store

SCHEMA_ELIGIBILITY = "layerbox.eligibility.v1"
_FIELDS = {"schema", "prefixes", "labels"}


class PolicyError(LayerstoreError, ValueError):
    """An eligibility policy that is not well formed; the message names the field."""

    fix = "see docs/FORMAT.md \"Eligibility policy\" for the fields"


@dataclass(frozen=True)
class Eligibility:
    """Ref-name prefixes and image labels (``key: value``) that make an image eligible."""

    prefixes: tuple[str, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        prefixes, labels = self.prefixes, self.labels
        if isinstance(prefixes, str) or not all(isinstance(p, str) and p for p in prefixes):
            raise PolicyError(f"eligibility policy: 'prefixes' must be a list of non-empty strings, not {prefixes!r}")
        if not isinstance(labels, Mapping) or not all(
                isinstance(k, str) and k and isinstance(v, str) for k, v in labels.items()):
            raise PolicyError(f"eligibility policy: 'labels' must map non-empty label keys to strings, not {labels!r}")
        # frozen: set the normalised copies the way dataclasses allow
        object.__setattr__(self, "prefixes", tuple(dict.fromkeys(prefixes)))
        object.__setattr__(self, "labels", dict(labels))

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA_ELIGIBILITY, "prefixes": list(self.prefixes), "labels": dict(self.labels)}

    @classmethod
    def from_json(cls, obj: Any, what: str = "eligibility policy") -> Eligibility:
        """The policy in ``obj`` (parsed JSON), checked strictly; ``what`` names it in errors."""
        if not isinstance(obj, Mapping) or obj.get("schema") != SCHEMA_ELIGIBILITY:
            got = obj.get("schema") if isinstance(obj, Mapping) else type(obj).__name__
            raise PolicyError(f"{what}: want a JSON object with schema {SCHEMA_ELIGIBILITY!r}, got {got!r}")
        unknown = sorted(set(obj) - _FIELDS)
        if unknown:
            raise PolicyError(f"{what}: unknown field(s) {', '.join(map(repr, unknown))} "
                              f"(a newer layerbox may have written it)")
        prefixes, labels = obj.get("prefixes", []), obj.get("labels", {})
        if not isinstance(prefixes, list):
            raise PolicyError(f"{what}: 'prefixes' must be a list of strings, not {prefixes!r}")
        try:
            return cls(tuple(prefixes), labels)
        except PolicyError as exc:
            raise PolicyError(str(exc).replace("eligibility policy", what, 1)) from None

    @classmethod
    def from_flags(cls, prefixes: Iterable[str], labels: Iterable[str], what: str) -> Eligibility:
        """From command-line flags: prefixes, and labels as ``KEY=VALUE``; ``what`` names the
        command in errors."""
        pairs: dict[str, str] = {}
        for item in labels:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise PolicyError(f"{what}: --eligible-label wants KEY=VALUE, got {item!r}")
            pairs[key] = value
        return cls(tuple(prefixes), pairs)

    @classmethod
    def load(cls, path: str | Path) -> Eligibility:
        """A policy file (JSON); errors name the file."""
        try:
            obj = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise PolicyError(f"eligibility policy {path}: cannot read it as JSON ({exc})") from None
        return cls.from_json(obj, f"eligibility policy {path}")

    def describe(self) -> str:
        prefixes = ", ".join(repr(p) for p in self.prefixes) or "none"
        labels = ", ".join(f"{k}={v}" for k, v in self.labels.items()) or "none"
        return f"eligibility policy (prefixes: {prefixes}; labels: {labels})"

    def matching_name(self, names: Iterable[str]) -> str | None:
        return next((n for n in names if n.startswith(self.prefixes)), None) if self.prefixes else None

    def matching_label(self, labels: Mapping[str, Any]) -> str | None:
        return next((f"{k}={v}" for k, v in self.labels.items() if labels.get(k) == v), None)


def image_labels(doc: Mapping[str, Any]) -> Mapping[str, Any]:
    """The labels of an image document: its OCI config's ``config.Labels`` (``{}`` when none)."""
    inner = (doc.get("config") or {}).get("config") or {}
    labels = inner.get("Labels") if isinstance(inner, Mapping) else None
    return labels if isinstance(labels, Mapping) else {}


def canonical_name(name: str) -> str:
    """``name`` as refs spell it (``repo:tag``), or as given when it is not a ref name."""
    try:
        return ref_name_from_key(ref_key(name))
    except BadName:
        return name


async def judge_store(store: Store, policy: Eligibility) -> Judge:
    """A :class:`Judge` of ``store``'s documents: every ref naming a document counts for it."""
    names: dict[str, list[str]] = {}
    for state in await store.list_refs():
        names.setdefault(state.digest, []).append(state.name)
    return Judge(policy, store.get_doc, names)


async def why_not_eligible(store: Store, policy: Eligibility, ref: str) -> str | None:
    """None when ``policy`` lets ``ref`` (a ref name in ``store``) leave its pool, else the reason."""
    judge = await judge_store(store, policy)
    return await judge.why_not((await store.read_ref(ref)).digest, [ref])


class Judge:
    """Verdicts of one policy over one store's documents; each document is judged once.

    ``load`` returns a document by digest (``Store.get_doc``); ``names`` maps a
    document digest to the ref names that point at it.
    """

    def __init__(self, policy: Eligibility, load: Callable[[str], Awaitable[Mapping[str, Any]]],
                 names: Mapping[str, Iterable[str]]) -> None:
        self.policy = policy
        self._load = load
        self._names = {d: list(n) for d, n in names.items()}
        self._verdicts: dict[str, str | None] = {}

    async def why_not(self, digest: str, names: Iterable[str] = ()) -> str | None:
        """None when the document is eligible, else the reason it is not."""
        digest = "blake3:" + hex_digest(digest)
        extra = [canonical_name(n) for n in names if n]
        if digest in self._verdicts and (self._verdicts[digest] is None or not extra):
            return self._verdicts[digest]
        verdict = await self._judge(digest, [*self._names.get(digest, []), *extra])
        if not extra:
            self._verdicts[digest] = verdict
        return verdict

    async def _judge(self, digest: str, names: list[str]) -> str | None:
        doc = await self._load(digest)
        schema = str(doc.get("schema"))
        if schema.startswith("layerbox.composition."):
            for role, part in (doc.get("parts") or {}).items():
                why = await self.why_not(part["digest"], [part.get("name") or ""])
                if why is not None:
                    return f"its {role} part {part.get('name') or part['digest']} is not eligible: {why}"
            return None
        if schema.startswith("layerbox.checkpoint."):
            base = doc.get("base") or doc.get("parent")
            if not base:
                raise FormatError(f"checkpoint {digest}: names neither a base nor a parent")
            why = await self.why_not(base)
            return None if why is None else f"the image it started from ({base}) is not eligible: {why}"
        if schema.startswith("layerbox.run."):
            for entry in (doc.get("sandboxes") or {}).values():
                why = await self.why_not(entry["checkpoint_digest"])
                if why is not None:
                    return f"its checkpoint {entry['checkpoint_digest']} is not eligible: {why}"
            return None
        if self.policy.matching_name(names) or self.policy.matching_label(image_labels(doc)):
            return None
        named = f"refs {', '.join(sorted(set(names)))}" if names else "no ref"
        return f"{digest} ({named}) matches no prefix and carries no label of the {self.policy.describe()}"
