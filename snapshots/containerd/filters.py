"""containerd's filter language, as far as snapshots use it.

A filter is selectors joined by ``,`` (all must hold); a list of filters
matches when any one does (containerd's ``filters.ParseAll``).  A selector is
a field path, optionally an operator (``==``, ``!=``, ``~=`` for a regular
expression) and a value; a path alone asks that the field be present and not
empty.  Components of a path are joined by ``.``; a component or a value may
be double-quoted (``labels."containerd.io/snapshot.ref"==sha256:...``).

Fields: ``name``, ``parent``, ``kind`` (view, active, committed) and
``labels.<key>``.  An unknown field matches nothing, as in containerd.
containerd's metadata store asks the backend exactly one filter, when a
remote layer answers ALREADY_EXISTS: ``labels."containerd.io/snapshot.ref"==<chain>,parent=="<parent>"``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from snapshots.containerd.errors import InvalidArgument

if TYPE_CHECKING:
    from snapshots.containerd.metadata import Snapshot

MAX_FILTER = 4096
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_OPS = ("==", "!=", "~=")


@dataclass(frozen=True)
class Selector:
    path: tuple[str, ...]
    op: str | None
    value: str


def _quoted(text: str, i: int, where: str) -> tuple[str, int]:
    out = []
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text):
            out.append(text[i + 1])
            i += 2
            continue
        if c == '"':
            return "".join(out), i + 1
        out.append(c)
        i += 1
    raise InvalidArgument(f"filters: unterminated quote in {where!r}")


def parse_filter(text: str) -> list[Selector]:
    if len(text) > MAX_FILTER:
        raise InvalidArgument(f"filters: a filter is at most {MAX_FILTER} characters")
    out: list[Selector] = []
    i = 0
    while i < len(text):
        path = []
        while True:
            if i < len(text) and text[i] == '"':
                part, i = _quoted(text, i, text)
            else:
                m = _IDENT.match(text, i)
                if not m:
                    raise InvalidArgument(f"filters: expected a field name at offset {i} of {text!r}")
                part, i = m.group(0), m.end()
            path.append(part)
            if i < len(text) and text[i] == ".":
                i += 1
                continue
            break
        op = None
        value = ""
        if text.startswith(_OPS, i):
            op, i = text[i:i + 2], i + 2
            if i < len(text) and text[i] == '"':
                value, i = _quoted(text, i, text)
            else:
                end = text.find(",", i)
                end = len(text) if end < 0 else end
                value, i = text[i:end], end
        out.append(Selector(tuple(path), op, value))
        if i < len(text):
            if text[i] != ",":
                raise InvalidArgument(f"filters: expected ',' at offset {i} of {text!r}")
            i += 1
    return out


def parse_filters(filters: list[str]) -> list[list[Selector]]:
    return [parse_filter(f) for f in filters if f.strip()]


def _field(snap: Snapshot, path: tuple[str, ...]) -> str | None:
    from snapshots.containerd.metadata import KIND_NAMES

    if path == ("name",):
        return snap.key
    if path == ("parent",):
        return snap.parent
    if path == ("kind",):
        return KIND_NAMES.get(snap.kind, "unknown")
    if len(path) >= 2 and path[0] == "labels":
        return snap.labels.get(".".join(path[1:]))
    return None


def _holds(sel: Selector, snap: Snapshot) -> bool:
    value = _field(snap, sel.path)
    if sel.op is None:
        return bool(value)
    if value is None:
        return False
    if sel.op == "==":
        return value == sel.value
    if sel.op == "!=":
        return value != sel.value
    try:
        return re.search(sel.value, value) is not None
    except re.error:
        raise InvalidArgument(f"filters: {sel.value!r} is not a regular expression") from None


def matches(filters: list[list[Selector]], snap: Snapshot) -> bool:
    return not filters or any(all(_holds(s, snap) for s in f) for f in filters)
