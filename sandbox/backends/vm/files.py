"""A VM's files, through its guest agent: the container's file API (RootFiles), the same calls,
answers and errors (the guest's errno as the OSError subclass the host's kernel would raise).

The guest says what a file holds, so nothing here holds more of it than the caller takes:
reads stream as the caller pulls (the agent's credit), ``read`` keeps at most its limit
(:data:`READ_LIMIT` unless the caller says less), a listing at most ``MAX_ENTRIES``.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from sandbox.backends.base import special_kind
from sandbox.backends.vm.agent import (
    AgentConnection,
    AgentError,
    GuestFileError,
    GuestProcess,
    entry_json,
)
from sandbox.core.errors import NotARegularFile

MAX_PATH = 4096
# what read() keeps of a file without a limit of its caller's: the guest's "file" may never end
READ_LIMIT = 256 << 20


def _guest_path(path: str) -> str:
    """A path the guest resolves inside the sandbox's root (its agent is chrooted there)."""
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path or len(path.encode()) > MAX_PATH:
        raise GuestFileError(errno.EINVAL, f"{path!r}: give an absolute path of at most {MAX_PATH} bytes")
    return path


def _os_error(exc: GuestFileError, path: str) -> OSError:
    """The guest's errno as the OSError subclass the host file API raises for it."""
    return OSError(exc.errno, f"{path}: {exc}", path)


class GuestFiles:
    """RootFiles' interface over a VM's agent: the same calls, answers and errors."""

    def __init__(self, conn: Callable[[], AgentConnection]) -> None:
        self._conn = conn

    @contextlib.contextmanager
    def _mapped(self, path: str) -> Iterator[None]:
        try:
            yield
        except GuestFileError as exc:
            if exc.errno != errno.ENOENT:
                # the agent refuses what is not a regular file (EINVAL, ENXIO for a socket to a read,
                # EISDIR to a write): a FIFO, socket or device answers as it does in a container
                kind = self._special(path)
                if kind is not None:
                    raise NotARegularFile(errno.EINVAL, path, kind) from None
            raise _os_error(exc, path) from None

    def _special(self, path: str) -> str | None:
        try:
            return special_kind(self._conn().stat(_guest_path(path)).mode)
        except (GuestFileError, AgentError):
            return None

    def iter_read(self, path: str, chunk: int = 0) -> Iterator[bytes]:
        with self._mapped(path):
            yield from self._conn().iter_read(_guest_path(path))

    def read(self, path: str, limit: int | None = None) -> bytes:
        with self._mapped(path):
            return self._conn().read(_guest_path(path), limit=READ_LIMIT if limit is None else limit)

    def download(self, path: str, dst: BinaryIO, chunk: int = 0) -> int:
        total = 0
        for data in self.iter_read(path):
            dst.write(data)
            total += len(data)
        return total

    def upload(self, path: str, src: BinaryIO, mode: int = 0o644, chunk: int = 256 << 10) -> int:
        def chunks() -> Iterator[bytes]:
            while data := src.read(chunk):
                yield data

        with self._mapped(path):
            return self._conn().write(_guest_path(path), chunks(), mode & 0o7777)

    def write(self, path: str, data: bytes, mode: int = 0o644) -> int:
        return self.upload(path, io.BytesIO(data), mode)

    def mkdir(self, path: str, mode: int = 0o755) -> None:
        with self._mapped(path):
            self._conn().mkdir(_guest_path(path), mode & 0o7777)

    def stat(self, path: str) -> os.stat_result:
        with self._mapped(path):
            return self._conn().stat(_guest_path(path)).to_stat_result()

    def list(self, path: str = "/") -> list[dict[str, Any]]:
        with self._mapped(path):
            return sorted((entry_json(e) for e in self._conn().list(_guest_path(path))), key=lambda e: e["name"])

    def remove(self, path: str, *, recursive: bool = False) -> None:
        if path.rstrip("/") in ("", "/."):
            raise OSError(errno.EINVAL, f"{path!r} does not name an entry inside the sandbox", path)
        with self._mapped(path):
            self._conn().remove(_guest_path(path), recursive=recursive)



    def watch_dir(self, path: str, *, recursive: bool, uid: int, gid: int) -> GuestProcess:
        """The guest's inotify on the directory ``path``, as ``uid``:``gid`` (AgentConnection.watch_dir)."""
        return self._conn().watch_dir(_guest_path(path), recursive=recursive, uid=uid, gid=gid)
