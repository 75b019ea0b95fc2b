"""The storage interface every store backend implements.

A backend stores opaque objects under string keys.  It knows nothing of
chunks, packs or documents; those live above it (layerstore/objects.py).
Cross-cutting behaviour (retries, concurrency limits, fault injection in
tests) is added by wrappers that take a Backend and are a Backend
(layerstore/backends/wrappers.py), stacked in one place: ``open_backend``.

Contract (checked by tests/test_backend_conformance.py against every backend):

- Keys are ``/``-separated ASCII paths validated by :func:`check_key`.  A
  path component starting with ``.`` is reserved for the backends' own
  files (temporary files, lock files) and refused.  A key must not also be
  the directory of other keys (``a`` and ``a/b``): a POSIX store cannot hold
  both and refuses the second with :class:`InvalidKey` (S3 accepts both), so
  layouts keep objects at the leaves.
- ``get`` returns the whole object or ``data[start:end]`` (``start >= 0``,
  ``end`` ``None`` = to the end, checked by :func:`check_range`); a range
  past the end is clipped (like S3), ``end <= start`` or ``start >= size``
  gives ``b""``; a missing key raises :class:`ObjectNotFound` in every case.
- ``head`` returns the :class:`ObjectInfo` of an object, ``None`` if missing.
- Writes are atomic: a reader sees either no object or the complete object,
  never a partial one, also after a crash of the writer.  A write that
  raised (or was cancelled) may still have happened: after a
  :class:`TransientError` (a timeout, a reset connection) the outcome is
  unknown.
- ``put_if_absent`` writes only if no object has the key and reports whether
  it wrote.  Content-addressed objects use it, so a retry is harmless; after
  a retried transient failure it may report ``False`` for an object that its
  own earlier attempt wrote.
- ``put_conditional`` is compare-and-swap on an object's version tag
  (``ObjectInfo.etag``, also returned by ``put_conditional``): ``if_match=None``
  means "only if absent", otherwise "only if the current version is this
  one" (a missing object never matches).  It raises :class:`PreconditionFailed`
  when another writer got there first.  Refs use it.  Compare-and-swap is only
  atomic against other ``put_conditional`` calls: a key that is ever swapped
  should be written only with ``put_conditional`` (a plain ``put`` or
  ``delete`` racing with it is last-writer-wins on POSIX).  To
  read-modify-write, take the etag from ``head`` *before* ``get``: if the
  object changes in between, the swap fails and the loop re-reads.  If an
  attempt failed transiently and a retry then fails the precondition, the
  change may be our own write: re-read and compare.
- An etag changes whenever the content changes; equal etags of one key mean
  equal content.  Etags are opaque: do not compare them across backends.
- ``list`` yields every object whose key starts with ``prefix`` (a plain
  string prefix: ``"a"`` matches ``a``, ``a/x`` and ``ab``; ``"a/"`` only
  ``a/x``), sorted by key (byte order).  Objects written or deleted while a
  listing runs may or may not appear in it.
- ``delete`` of a missing key is not an error.
- ``sweep_leftovers(older_than)`` removes the backend's own debris of writes
  that were interrupted (POSIX temporary files, S3 incomplete multipart
  uploads) and last changed more than ``older_than`` seconds ago, and returns
  a description of each; ``dry_run`` only reports.  It never touches objects.
  A write still in progress whose debris is older than ``older_than`` fails
  (it never half-succeeds); callers pass a generous age.
- All methods are safe to call concurrently from one event loop, and (for
  the shared stores) from other processes and hosts on the same store.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass

from layerstore.errors import LayerstoreError

_KEY = re.compile(r"^[A-Za-z0-9._:@=+-]+(/[A-Za-z0-9._:@=+-]+)*$")


class BackendError(LayerstoreError):
    """A store operation failed; ``retryable`` says whether trying again may help."""

    retryable = False


class ObjectNotFound(BackendError, FileNotFoundError):
    """No object has this key."""

    def __init__(self, key: str, store: str) -> None:
        self.key = key
        self.store = store
        super().__init__(f"{store}: no object {key!r}")


class PreconditionFailed(BackendError):
    """A conditional write lost the race: the object changed (or appeared) meanwhile."""

    def __init__(self, key: str, store: str, detail: str = "") -> None:
        self.key = key
        self.store = store
        super().__init__(f"{store}: {key!r} was changed by another writer{': ' + detail if detail else ''}")


class TransientError(BackendError):
    """A failure worth retrying (5xx, throttling, timeout, connection reset)."""

    retryable = True


class CredentialsError(BackendError):
    """The store refused our identity; retrying will not help."""


class InvalidKey(BackendError, ValueError):
    """A key that the store layout does not allow."""


Leftovers = list[str]  # what sweep_leftovers found (a name: the classes define a ``list`` method)


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str  # opaque version tag, compared by put_conditional
    mtime: float  # seconds since the epoch; garbage collection's grace period uses it


def check_key(key: str) -> str:
    """Return ``key`` if it is a valid store key, else raise :class:`InvalidKey`."""
    if len(key) > 1000 or not _KEY.match(key) or any(part.startswith(".") for part in key.split("/")):
        raise InvalidKey(
            f"invalid store key {key!r}: use '/'-separated components of letters, digits "
            "and ._:@=+- (none empty or starting with '.'), at most 1000 characters"
        )
    return key


def check_prefix(prefix: str) -> str:
    """Return ``prefix`` if ``list`` accepts it: ``""`` or the start of a valid key."""
    if prefix == "":
        return prefix
    head, _, tail = prefix.rpartition("/")
    if head:
        check_key(head)
    if (tail and not _KEY.match(tail)) or len(prefix) > 1000:
        raise InvalidKey(f"invalid store key prefix {prefix!r}: see check_key for what keys may hold")
    return prefix


def check_range(start: int | None, end: int | None) -> None:
    """Refuse ranges ``get`` does not define: negative offsets (no suffix ranges)."""
    if (start is not None and start < 0) or (end is not None and end < 0):
        raise ValueError(f"byte range [{start}:{end}] has a negative offset")


class Backend(ABC):
    """Async object storage; see the module docstring for the contract."""

    url: str  # for messages: never carries credentials

    @abstractmethod
    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """The object's bytes, or ``data[start:end]`` clipped to its size."""

    @abstractmethod
    async def head(self, key: str) -> ObjectInfo | None:
        """Size, etag and mtime of the object, or ``None`` if there is none."""

    @abstractmethod
    async def put(self, key: str, data: bytes) -> None:
        """Create or replace (atomically)."""

    @abstractmethod
    async def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create only if absent; ``True`` if this call wrote the object."""

    @abstractmethod
    async def put_conditional(self, key: str, data: bytes, if_match: str | None) -> str:
        """Compare-and-swap; returns the new etag."""

    @abstractmethod
    def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """Objects whose key starts with ``prefix``, sorted by key (an async generator)."""

    @abstractmethod
    async def delete(self, key: str) -> None:
        """Remove the object; a missing one is not an error."""

    async def sweep_leftovers(self, older_than: float, *, dry_run: bool = False) -> Leftovers:
        """Remove debris of interrupted writes older than ``older_than`` seconds; what it found."""
        return []

    async def close(self) -> None:
        """Release connections and threads; the backend is unusable afterwards."""
        return None

    async def __aenter__(self) -> Backend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
