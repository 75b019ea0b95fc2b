"""The exception root shared by every layerbox package.

Each package derives its own root from :class:`LayerboxError` (``ConvertError``,
``LayerstoreError``, ``LazyfetchError`` ...) so that ``tools/`` can turn any of
them into a message on stderr and an exit code, and callers can catch a whole
package's failures at once.  Messages name the object (path, entry, digest,
offset) and, where there is one, the fix.
"""

from __future__ import annotations


class LayerboxError(Exception):
    """Root of every error layerbox raises on purpose.

    Every class carries three attributes (each subclass inherits or sets them):

    ``exit_code``
        The status ``layerbox`` exits with for it (1; a subclass may pick another).
    ``retryable``
        Whether the same call, unchanged, may succeed later: a busy or full
        resource, a transient store fault, a timeout.  False unless a class or
        the raise says so.
    ``fix``
        What the caller should do about it, in one sentence, or ``None`` when
        there is nothing to add to the message.  ``str(exc)`` stays complete on
        its own (it often says the fix too); ``fix`` is the same advice as a
        field, for a caller that shows or acts on it separately.

    A raise may set ``fix=`` and ``retryable=`` for its one instance; both are
    keyword-only, so subclasses whose constructors take other (positional)
    arguments keep them.
    """

    exit_code: int = 1
    retryable: bool = False
    fix: str | None = None

    def __init__(self, *args: object, fix: str | None = None, retryable: bool | None = None) -> None:
        super().__init__(*args)
        # only when given, so that a class's own value (RuntimeTimeout.retryable) stays the default
        if fix is not None:
            self.fix = fix
        if retryable is not None:
            self.retryable = retryable


class LayerstoreError(LayerboxError):
    """A problem with stored objects or their formats."""


class FormatError(LayerstoreError):
    """An on-disk artefact (metadata image, blob map, document) is malformed.

    Raised by readers; the message names the artefact and the byte offset.
    """
