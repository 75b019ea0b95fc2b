"""The exception root shared by every layerbox package.

Each package derives its own root from :class:`LayerboxError` (``ConvertError``,
``LayerstoreError``, ``LazyfetchError`` ...) so that ``tools/`` can turn any of
them into one line on stderr and an exit code, and callers can catch a whole
package's failures at once.  Messages name the object (path, entry, digest,
offset) and, where there is one, the fix.
"""

from __future__ import annotations


class LayerboxError(Exception):
    """Root of every error layerbox raises on purpose."""

    exit_code = 1


class LayerstoreError(LayerboxError):
    """A problem with stored objects or their formats."""


class FormatError(LayerstoreError):
    """An on-disk artefact (metadata image, blob map, document) is malformed.

    Raised by readers; the message names the artefact and the byte offset.
    """
