"""Errors raised while turning archives and directories into layers."""

from __future__ import annotations

from layerstore.errors import LayerboxError


class ConvertError(LayerboxError):
    """The source could not be converted; no output was left behind."""

    exit_code = 2


class BadEntry(ConvertError):
    """One archive entry is unacceptable (escaping path, missing link target...).

    ``entry`` is the path as written in the archive, ``offset`` the byte offset
    of its header in the uncompressed tar stream (``None`` for directories).
    """

    def __init__(self, entry: str, offset: int | None, problem: str, remedy: str = "") -> None:
        self.entry = entry
        self.offset = offset
        self.problem = problem
        where = f"entry {entry!r}" + (f" at offset {offset}" if offset is not None else "")
        msg = f"{where}: {problem}"
        if remedy:
            msg += f" ({remedy})"
        super().__init__(msg, fix=remedy or None)


class BadArchive(ConvertError):
    """The archive stream itself is broken: truncated, corrupt compression, bad header."""


class DigestMismatch(ConvertError):
    """A blob's content does not hash to the digest its manifest names."""
