"""Host-state tables: the small JSON files a host keeps about its own mounts, leases and allocations.

Each table is one JSON object whose first two fields say what it is,
``{"format": "layerbox.leases", "version": 1, ...}``, followed by the table's own
fields.  It is changed only under an exclusive ``flock`` on a lock file beside it,
so the CLI, the service and the daemon on one host never lose each other's
updates, and replaced whole (temp file, fsync, an exchange of the two names, fsync of the
directory: :func:`swap_in`), so a reader never sees half of one.  docs/FORMAT.md, "Host-state tables", is the
format; :class:`HostTable` is its one reader and writer.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import os
import stat
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

from layerstore.errors import LayerstoreError

Body = dict[str, Any]
# (body, version) -> the current version's body; version None: a legacy document, written
# before tables had the envelope, passed whole
Upgrade = Callable[[Body, int | None], Body]

ENVELOPE = ("format", "version")

log = logging.getLogger("layerbox.hoststate")


class HostStateError(LayerstoreError):
    """A host-state table this layerbox cannot read: not a JSON object, another format, or
    another version; the message names the file, what it holds and what to do."""


# Host state is root's alone.  A lock file another local user can open is a lock that user can hold
# (flock needs only an fd, read-only will do) and so stall every writer behind it; a table another
# user can read tells them this host's jobs, sandboxes and addresses.  So lock and state files are
# 0600, and their directories give others no read or write (a search bit another user needs to
# reach a user-namespaced sandbox's rootfs may stay).  Files and directories an older layerbox
# made looser are tightened when next opened.
PRIVATE_FILE = 0o600
OTHERS_RW = 0o066  # group and other read and write: never on a host-state directory


def private_fd(fd: int) -> None:
    """Take back any permission group or others have on the open file ``fd`` (an older layerbox made it 0644)."""
    mode = stat.S_IMODE(os.fstat(fd).st_mode)
    if mode & 0o077:
        os.fchmod(fd, mode & 0o700)


def tightened(fd: int, *, owner_only: bool = True) -> int:
    """``fd`` after :func:`private_fd` (closed if that fails); ``owner_only=False``: a reader that
    is not the file's owner leaves it to the owner."""
    try:
        with contextlib.suppress(*(() if owner_only else (PermissionError,))):
            private_fd(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_private(path: str | os.PathLike[str]) -> int:
    """A read-write fd on ``path``, a file for its owner alone (a lock file, a database): made 0600
    if missing, tightened to it if looser, never through a symlink."""
    return tightened(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_FILE))


@contextlib.contextmanager
def flocked(path: str | os.PathLike[str], *, shared: bool = False) -> Iterator[int]:
    """The exclusive ``flock`` of the lock file ``path`` (:func:`open_private`: nobody else can
    open it, so nobody else can hold it), held for the block; ``shared``: a shared one."""
    fd = open_private(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)  # releases the flock


def closed_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` as a directory others cannot list or change: each missing component made 0700, an
    existing ``path`` stripped of group's and others' read and write (search bits stay: the way
    down to a user-namespaced sandbox must stay traversable for its uids)."""
    path = Path(path)
    make_private_dirs(path)
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & OTHERS_RW:
        os.chmod(path, mode & ~OTHERS_RW)
    return path


def make_private_dirs(path: str | os.PathLike[str]) -> None:
    """``mkdir -p`` with every directory it makes 0700, and nothing that exists changed."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except FileNotFoundError:
        make_private_dirs(Path(path).parent)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)


class HostTable:
    """The table at ``path``, named ``format``, written as ``version``.

    ``reads``: the older versions it also reads, each turned into the current one by
    ``upgrade``, which also gets a legacy document (one with no ``format`` field) with the
    version ``None``; without ``upgrade`` only the current version is read.  ``empty``
    makes the body of a table that has no file yet; with ``drop_empty`` such a body is no
    file: writing it removes the file.  ``lock`` is the file flocked by :meth:`locked`
    (default: ``<path>.lock``).  ``aside`` says what moving the file aside costs, for the
    fix an error names.  The table, its lock and the directory they are in are kept private
    (:func:`open_private`, :func:`closed_dir`), and tightened when found looser.

    ``durable=False`` is for a table of what a reboot ends anyway (mounts): written without
    fsync (the file's and its directory's, which its writers otherwise wait for under the lock),
    and so a file that does not decode and was last written before this boot (a power loss tore
    it) reads as empty, with a warning; one written since the boot is still an error.

    Safe across processes and threads (each :meth:`locked` takes the ``flock`` on a file
    description of its own), but not reentrant: a :meth:`locked` inside another on the same
    table waits for ever.  Every error reading the table is a :class:`HostStateError`.
    """

    def __init__(self, path: str | os.PathLike[str], format: str, version: int, *,
                 reads: Collection[int] = (), upgrade: Upgrade | None = None,
                 empty: Callable[[], Body] = dict, lock: str | os.PathLike[str] | None = None,
                 aside: str = "", drop_empty: bool = False, spare: str | os.PathLike[str] | None = None,
                 durable: bool = True) -> None:
        if upgrade is None and set(reads) - {version}:
            raise ValueError(f"{format}: reading versions {sorted(reads)} takes an upgrade to version {version}")
        self.path = Path(path)
        self.format = format
        self.version = version
        self.reads = frozenset({version, *reads})
        self.upgrade = upgrade
        self.empty = empty
        self.lock = Path(lock) if lock is not None else self.path.with_name(self.path.name + ".lock")
        self.aside = aside
        self.drop_empty = drop_empty
        self.durable = durable
        # The temp file a write fills and swap_in exchanges with the table, keeping the version
        # before for the next write: one per lock (its holder is the only writer) in the table's
        # directory (an exchange stays in one file system), so the tables of one lock (a project's
        # job leases) share it instead of one each.
        if spare is not None:
            self.spare = Path(spare)
        elif self.lock.parent == self.path.parent:
            self.spare = self.lock.with_name(self.lock.name + ".spare")
        else:
            self.spare = self.path.with_name(self.path.name + ".tmp")

    @contextlib.contextmanager
    def locked(self) -> Iterator[Body]:
        """The body under the exclusive lock, for the block to change; written back only when
        the block ends normally and the body encodes to other bytes than the file's."""
        closed_dir(self.path.parent)
        with flocked(self.lock):
            raw = self._raw()
            body, current = self._decode_or_torn(raw)
            # a file already in this version is compared as it lies, which spares a large table
            # (mounts.json) one encoding per operation
            before = raw if current else self._encode(body)
            yield body
            if self.drop_empty and body == self.empty():
                if raw is not None:
                    self.path.unlink()
                    if self.durable:
                        _fsync_dir(self.path.parent)
                return
            out = self._encode(body)
            if out != before:
                self._replace(out, durable=self.durable)

    def read(self) -> Body:
        """The body as it is now, without the lock and without writing anything: a rename
        replaces the file, so this sees one whole version of it, older or newer."""
        return self._decode_or_torn(self._raw())[0]

    # -- reading ------------------------------------------------------------------------------
    def _raw(self) -> bytes | None:
        def opened() -> int:
            return tightened(os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), owner_only=False)

        try:
            return read_settled(opened, lambda: os.stat(self.path, follow_symlinks=False))
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._refused(f"a file it cannot read ({exc.strerror})") from None

    def _decode_or_torn(self, raw: bytes | None) -> tuple[Body, bool]:
        try:
            return self._decode(raw)
        except HostStateError as exc:
            if self.durable or raw is None or _decodes(raw) or not _written_before_boot(self.path):
                raise
            log.warning("%s: %s; it was last written before this boot, by a host that lost power: read as "
                        "empty (what it described ended with that boot)", self.path, exc)
            return self.empty(), False

    def _decode(self, raw: bytes | None) -> tuple[Body, bool]:
        """The current version's body, and whether ``raw`` is already in that version."""
        if raw is None:
            return self.empty(), False
        try:
            doc = json.loads(raw)
        except ValueError as exc:  # UnicodeDecodeError is one too
            raise self._refused(f"no JSON ({exc})") from None
        if not isinstance(doc, dict):
            raise self._refused(f"a JSON {type(doc).__name__}, not an object")
        found = doc.get("format")
        version: int | None = None
        if isinstance(found, str):  # a legacy table may hold a key "format", but never a string there
            if found != self.format:
                raise self._refused(f"a {found!r} table", fix="point layerbox at its own file, or move the file aside")
            version = doc.get("version")
            if type(version) is not int or version not in self.reads:
                raise self._refused(f"{self.format} version {version!r}", fix=(
                    "a newer layerbox wrote it: run that one, or move the file aside"))
            doc = {k: v for k, v in doc.items() if k not in ENVELOPE}
            if version == self.version:
                return doc, True
        if self.upgrade is None:
            raise self._refused("a document without a format field")
        try:
            return self.upgrade(doc, version), False
        except (KeyError, TypeError, ValueError) as exc:
            what = "a legacy document" if version is None else f"{self.format} version {version}"
            raise self._refused(f"{what} it cannot upgrade ({type(exc).__name__}: {exc})") from None

    def _refused(self, found: str, fix: str = "move the file aside") -> HostStateError:
        versions = ", ".join(str(v) for v in sorted(self.reads))
        legacy = " and the layout before it" if self.upgrade is not None else ""
        cost = f" ({self.aside})" if self.aside else ""
        return HostStateError(f"host-state table {self.path}: found {found}; this layerbox reads "
                              f"{self.format} version {versions}{legacy}: {fix}{cost}")

    # -- writing ------------------------------------------------------------------------------
    def _encode(self, body: Body) -> bytes:
        clash = [k for k in ENVELOPE if k in body]
        if clash:
            raise ValueError(f"{self.path}: a {self.format} body cannot have the envelope's fields {clash}")
        # compact: mounts.json is rewritten on every mount and holds one record per sandbox
        return json.dumps({"format": self.format, "version": self.version, **body}, separators=(",", ":")).encode()

    def _replace(self, data: bytes, *, durable: bool = True) -> None:
        # One temp name per lock: only its holder writes, and a temp file a crash left behind is
        # simply truncated by the next writer.
        tmp = self.spare
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_FILE)
        try:
            private_fd(fd)  # a temp file an older layerbox left behind keeps its mode through O_CREAT
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            # without it a power loss can leave the renamed name on empty or partial data
            # (XFS, ext4 with noauto_da_alloc): a table nothing reads until moved aside by hand
            if durable:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        os.close(fd)
        swap_in(tmp, self.path)
        if durable:
            _fsync_dir(self.path.parent)


def _decodes(raw: bytes) -> bool:
    """Whether ``raw`` is a JSON object (whatever its content says)."""
    try:
        return isinstance(json.loads(raw), dict)
    except ValueError:
        return False


def boot_time() -> float:
    """When this host booted (seconds since the epoch, /proc/stat's ``btime``)."""
    with open("/proc/stat", "rb") as f:
        for line in f:
            if line.startswith(b"btime "):
                return float(line.split()[1])
    raise OSError(errno.ENOENT, "/proc/stat has no btime")


def _written_before_boot(path: Path) -> bool:
    try:
        return os.stat(path).st_mtime < boot_time()
    except OSError:
        return False


SETTLE_TRIES = 100  # reads of a file a writer keeps changing before read_settled gives up


def read_settled(open_file: Callable[[], int], stat_name: Callable[[], os.stat_result]) -> bytes:
    """The bytes of the version of a file :func:`swap_in` replaces that was at its name while they
    were read: the inode opened must be at the name (``stat_name``) in the middle of the read, and
    unchanged from before it to after it (size and change time, which an exchange moves too);
    else it is opened again, by name.  The inode a reader opened can meanwhile become the temp file
    of the next write, which truncates and fills it: without these checks the reader could see an
    empty file, part of an unpublished version, or parts of two.  A change that follows a ``stat``
    gets a fine-grained change time (ext4, XFS, btrfs and tmpfs since Linux 6.13)."""
    for _ in range(SETTLE_TRIES):
        fd = open_file()
        try:
            before = os.fstat(fd)
            chunks = []
            offset = 0
            while piece := os.pread(fd, max(before.st_size - offset, 0) + 4096, offset):
                chunks.append(piece)
                offset += len(piece)
            try:
                named = stat_name()
            except FileNotFoundError:
                named = None
            after = os.fstat(fd)
        finally:
            os.close(fd)
        same = (before.st_ino, before.st_size, before.st_ctime_ns) == (after.st_ino, after.st_size, after.st_ctime_ns)
        if same and offset == after.st_size and named is not None and \
                (named.st_dev, named.st_ino) == (after.st_dev, after.st_ino):
            return b"".join(chunks)
    raise OSError(errno.EAGAIN, f"changed by a writer at each of {SETTLE_TRIES} reads")


RENAME_EXCHANGE = 2  # renameat2(2)
_AT_FDCWD = -100
_renameat2: Any = None


def swap_in(tmp: str | os.PathLike[str], name: str | os.PathLike[str], *, dir_fd: int | None = None) -> None:
    """Put the file ``tmp`` at ``name`` atomically, as a rename does, by exchanging the two names
    (``RENAME_EXCHANGE``): the previous version is left at ``tmp``, whose inode the next write
    truncates and fills again.  Every rename over a file frees an inode and the next temp file
    allocates one; on ext4 without a journal each allocation then skips every inode freed in the
    last minutes (``recently_deleted``), and with a sandbox's state, its table rows and its mount
    record rewritten at each create that was 12% of the host's CPU while filling it to 3,200.
    A plain rename when ``name`` does not exist yet or the file system cannot exchange."""
    global _renameat2
    if _renameat2 is None:
        _renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
        _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fd = _AT_FDCWD if dir_fd is None else dir_fd
    if _renameat2(fd, os.fsencode(tmp), fd, os.fsencode(name), RENAME_EXCHANGE) == 0:
        return
    err = ctypes.get_errno()
    if err not in (errno.ENOENT, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        raise OSError(err, f"exchanging {os.fsdecode(tmp)} and {os.fsdecode(name)}: {os.strerror(err)}")
    os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise  # some network and FUSE filesystems cannot fsync a directory: nothing to do
    finally:
        os.close(fd)


class HostRecords:
    """A directory of host-state records of one format, one file each (``<key>.json``, in the
    envelope of :class:`HostTable`): for state with one record per sandbox, which as one table
    would be decoded and rewritten whole on every change (its cost growing with the sandboxes
    the host holds).

    Writers are serialised by the caller (the lock of the table the records go with: this
    class takes none, so it can be used inside :meth:`HostTable.locked`); a reader sees each
    record whole (every write is a temp file and a rename).  ``key`` is the caller's, checked
    to be a plain file name.

    ``durable=False`` is for records of what a reboot ends anyway (mounts): no fsync (two per
    write, the larger part of a mount's bookkeeping), and so a record a power loss left empty
    or torn is one :meth:`all` drops, with a warning, where a durable one is an error.
    """

    def __init__(self, directory: str | os.PathLike[str], format: str, version: int, *, aside: str = "",
                 durable: bool = True) -> None:
        self.dir = Path(directory)
        self.format = format
        self.version = version
        self.aside = aside
        self.durable = durable

    def _table(self, key: str) -> HostTable:
        if not key or "/" in key or key.startswith(".") or not key.isprintable():
            raise ValueError(f"{self.dir}: {key!r} is not a record key")
        # (the lock is the caller's: HostTable.locked is never used here; its writers share one spare)
        return HostTable(self.dir / f"{key}.json", self.format, self.version, aside=self.aside,
                         spare=self.dir / ".spare")

    def get(self, key: str) -> Body | None:
        """The record ``key``, None when there is none."""
        table = self._table(key)
        raw = table._raw()
        return None if raw is None else table._decode(raw)[0]

    def put(self, key: str, body: Body) -> None:
        closed_dir(self.dir)
        table = self._table(key)
        table._replace(table._encode(body), durable=self.durable)

    def drop(self, key: str) -> bool:
        """Remove the record ``key``; False when there was none.  (Not fsynced: a record that comes
        back after a power loss is one its owner's reconcile finds unmounted and forgets.)"""
        path = self._table(key).path
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        return True

    def all(self) -> dict[str, Body]:
        """Every record, by key (an O(records) scan: for reconcile and listings, not hot paths)."""
        try:
            names = sorted(os.listdir(self.dir))
        except FileNotFoundError:
            return {}
        out: dict[str, Body] = {}
        for name in names:
            if not name.endswith(".json") or name.startswith("."):
                continue
            key = name[:-len(".json")]
            try:
                body = self.get(key)
            except HostStateError as exc:
                if self.durable:
                    raise
                log.warning("dropping %s: %s (a power loss tore it; what it described ended with the host)",
                            self.dir / name, exc)
                self.drop(key)
                continue
            if body is not None:  # (removed meanwhile)
                out[key] = body
        return out
