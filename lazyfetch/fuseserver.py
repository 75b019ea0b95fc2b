"""A FUSE server for one flat, read-only directory of layer blobs, on /dev/fuse directly.

The kernel protocol (include/uapi/linux/fuse.h) is spoken here without libfuse, for
two reasons: requests of up to 1 MiB (libfuse 2 stops at 128 KiB) with little work
per request, and a connection that outlives its server.  The FUSE connection lives as
long as any process holds an fd of its /dev/fuse open file; a *holder* process keeps
a dup, so when the server dies the mount stays up and readers wait.  The next server
takes the fd back (:func:`take_fd`: ``pidfd_getfd``) and calls
``serve(resumed=True)``, which first writes ``FUSE_NOTIFY_RESEND`` (Linux 6.9+): the
kernel then queues again every request the dead server had read but not answered
(with bit 63 set in their ``unique``, which the reply simply echoes; each is
logged at INFO).  The holder
must hold the *same open file* (a dup, ``pass_fds``, SCM_RIGHTS or ``pidfd_getfd``),
not a new open of /dev/fuse, and a resumed connection must have been INITed by
this module (``max_write`` is fixed here, not negotiated again).  Tested on Linux
6.18 (protocol 7.45): readers in the middle of reads when the server is SIGKILLed
see neither errors nor wrong bytes; without the RESEND they wait forever.

Interface::

    class BlobSource(Protocol):
        def names(self) -> list[str]          # current file names (64 lowercase hex)
        def size(self, name) -> int | None     # None: no such file; a name's size never changes
        def read(self, name, offset, size) -> bytes | memoryview
            # exactly min(size, file size - offset) bytes; may block (fetching);
            # raise OSError(errno.EIO, ...) (or another errno) to fail the read;
            # called from several threads at once; the buffer is used until
            # the reply is written, then dropped

    fd = open_and_mount(mountpoint, max_read=1 << 20)   # /dev/fuse fd; mounted, no server yet;
                                  # also raises the mount's readahead to max_read (the
                                  # kernel's 128 KiB default would cap READs there)
    server = FuseServer(source, fd, threads=8)
    server.serve(resumed=False)   # blocks; returns on unmount (or DESTROY) or stop()
    server.stop()                 # from another thread: serve() returns once the
                                  # requests being answered are answered
    fd = take_fd(holder_pid, holder_fd)  # a dup of another process's fd (pidfd_getfd)

The file system: the root directory (mode 0500, root) lists the source's names;
each is a regular file of mode 0400 owned by root (the mount has
``default_permissions``, so only root may read a blob), with ``st_size`` from
``source.size``.  Entries and attributes are cached by the kernel for a day;
``OPEN`` answers ``FOPEN_KEEP_CACHE``, so a blob's pages stay in the page cache
across opens and the file can be mmapped (QEMU does), and ``FOPEN_NOFLUSH``, so
closing a blob never waits for a server.

Node ids are derived from the name, so a restarted server knows the ids the
kernel holds without saved state: ``node_id(name) = int(name[:15], 16) + 2``
(60 bits; never 0 or 1, the root).  Two current names with the same 60-bit
prefix cannot be told apart by id: both are refused (``EIO``, logged), never
one served for the other.

Threads: ``threads`` workers each read requests from the one shared fd (the
kernel hands each read one request; the fd is put in non-blocking mode, which
its holder's dups share, and each worker sleeps in its own epoll with ``EPOLLEXCLUSIVE``, so a request wakes
one worker, and ``stop`` can wake them all).  Separate clone fds
(``FUSE_DEV_IOC_CLONE``) are not used on purpose: the kernel fails a clone's
unanswered requests when the clone is closed, which would turn a server's death
into read errors.

Errors: an ``OSError`` from the source is answered with its errno, anything
else with ``EIO``; either is logged once with the name and offset.  A source
read that returns the wrong number of bytes is an ``EIO`` too (a short reply
would make the kernel shrink the file).  Replies to requests the kernel has
dropped meanwhile (``ENOENT``: interrupted) are ignored.

Limitations: no write operations (the mount is read-only); no READDIRPLUS;
``INTERRUPT`` is ignored (a read in progress finishes); without
``FUSE_NOTIFY_RESEND`` (Linux < 6.9) a resumed server logs a warning and the
requests the dead server held are never answered, so their readers hang until
the connection is aborted.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import re
import select
import stat
import struct
import threading
from collections.abc import Sequence
from typing import Final, Protocol

from lazyfetch import kmount
from lazyfetch.errors import FuseServerError

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------
# the protocol (include/uapi/linux/fuse.h); every layout little-endian as on the host


_IN_HEADER: Final = struct.Struct("=IIQQIIIHH")  # len opcode unique nodeid uid gid pid extlen pad
_OUT_HEADER: Final = struct.Struct("=IiQ")  # len error unique
_INIT_IN: Final = struct.Struct("=IIII")  # major minor max_readahead flags; flags2 follows (7.36+)
_INIT_IN_FLAGS2: Final = struct.Struct("=I")
# major minor max_readahead flags max_background congestion_threshold max_write time_gran
# max_pages map_alignment flags2 max_stack_depth unused[6]
_INIT_OUT: Final = struct.Struct("=IIIIHHIIHHII24x")
# ino size blocks atime mtime ctime atimensec mtimensec ctimensec mode nlink uid gid rdev
# blksize flags
_ATTR: Final = struct.Struct("=QQQQQQIIIIIIIIII")
_ENTRY_OUT_HEAD: Final = struct.Struct("=QQQQII")  # nodeid generation entry_valid attr_valid nsecs
_ATTR_OUT_HEAD: Final = struct.Struct("=QII")  # attr_valid attr_valid_nsec dummy
_OPEN_IN: Final = struct.Struct("=II")  # flags open_flags
_OPEN_OUT: Final = struct.Struct("=QIi")  # fh open_flags backing_id
_READ_IN: Final = struct.Struct("=QQIIQII")  # fh offset size read_flags lock_owner flags pad
_KSTATFS: Final = struct.Struct("=QQQQQIIII24x")  # blocks bfree bavail files ffree bsize namelen frsize
_DIRENT_HEAD: Final = struct.Struct("=QQII")  # ino off namelen type
_SIZES: Final = {_IN_HEADER: 40, _OUT_HEADER: 16, _INIT_OUT: 64, _ATTR: 88, _ENTRY_OUT_HEAD: 40,
                 _ATTR_OUT_HEAD: 16, _OPEN_OUT: 16, _READ_IN: 40, _KSTATFS: 80, _DIRENT_HEAD: 24}
assert all(layout.size == size for layout, size in _SIZES.items())

_LOOKUP: Final = 1
_FORGET: Final = 2
_GETATTR: Final = 3
_OPEN: Final = 14
_READ: Final = 15
_STATFS: Final = 17
_RELEASE: Final = 18
_GETXATTR: Final = 22
_LISTXATTR: Final = 23
_FLUSH: Final = 25
_INIT: Final = 26
_OPENDIR: Final = 27
_READDIR: Final = 28
_RELEASEDIR: Final = 29
_ACCESS: Final = 34
_INTERRUPT: Final = 36
_DESTROY: Final = 38
_BATCH_FORGET: Final = 42

_NOTIFY_RESEND: Final = 7
_UNIQUE_RESEND: Final = 1 << 63  # the kernel's mark on a request it queued again

# INIT flags (flags2 holds bits 32..63, announced by FUSE_INIT_EXT)
_ASYNC_READ: Final = 1 << 0
_BIG_WRITES: Final = 1 << 5
_ASYNC_DIO: Final = 1 << 15
_PARALLEL_DIROPS: Final = 1 << 18
_MAX_PAGES: Final = 1 << 22
_INIT_EXT: Final = 1 << 30
_HAS_RESEND: Final = 1 << 39
_WANTED: Final = _ASYNC_READ | _BIG_WRITES | _ASYNC_DIO | _PARALLEL_DIROPS | _MAX_PAGES | _HAS_RESEND

_FOPEN_KEEP_CACHE: Final = 1 << 1
_FOPEN_NOFLUSH: Final = 1 << 5

_KERNEL_MAJOR: Final = 7
_OUR_MINOR: Final = 40  # the protocol these layouts follow (7.40 added FUSE_NOTIFY_RESEND)
_OLDEST_MINOR: Final = 31  # Linux 5.10; FUSE_MAX_PAGES is 7.28

_ROOT_ID: Final = 1
_PAGE: Final = 4096
_MAX_PAGES_WANTED: Final = 256  # 1 MiB requests; the mount's max_read may lower it
_MAX_READAHEAD: Final = 1 << 20
# Nothing writes to a read-only mount, but the kernel refuses a device read with a
# buffer smaller than max_write plus the WRITE headers; a server that resumes a
# connection does not see INIT, so this is fixed rather than negotiated.
_MAX_WRITE: Final = 128 << 10
_BUFSIZE: Final = _MAX_WRITE + _PAGE
_MAX_BACKGROUND: Final = 64  # background (readahead) requests in flight; the kernel default is 12
_CONGESTION_THRESHOLD: Final = 48
_TIMEOUT: Final = 86400  # seconds the kernel may cache entries and attributes

_ROOT_MODE: Final = stat.S_IFDIR | 0o500
_FILE_MODE: Final = stat.S_IFREG | 0o400
_DT_DIR: Final = 4
_DT_REG: Final = 8

_NAME: Final = re.compile(r"[0-9a-f]{64}\Z")

_PIDFD_GETFD: Final = 438  # the same number on every architecture (asm-generic)


class BlobSource(Protocol):
    """The files the server shows; see the module docstring for the contract."""

    def names(self) -> list[str]: ...

    def size(self, name: str) -> int | None: ...

    def read(self, name: str, offset: int, size: int) -> bytes | memoryview: ...


def node_id(name: str) -> int:
    """The FUSE node id of a (valid) name: stable across servers, never 0 or 1."""
    return int(name[:15], 16) + 2


def is_valid_name(name: str) -> bool:
    return _NAME.match(name) is not None


class DirectorySource:
    """A :class:`BlobSource` over the blob files of one local directory (tests, benchmarks).

    Files whose names are not 64 lowercase hex are not shown.  Each file is opened
    once and kept open until :meth:`close`.  A read returns a view of a buffer of
    the calling thread, valid until that thread's next read: allocating 1 MiB of
    bytes per read costs three times the copy itself.
    """

    def __init__(self, path: str) -> None:
        self._path = path
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._buffers = threading.local()

    def names(self) -> list[str]:
        return [n for n in os.listdir(self._path) if is_valid_name(n)]

    def size(self, name: str) -> int | None:
        try:
            return os.stat(os.path.join(self._path, name)).st_size
        except FileNotFoundError:
            return None

    def read(self, name: str, offset: int, size: int) -> memoryview:
        fd = self._fds.get(name)
        if fd is None:
            with self._lock:
                fd = self._fds.get(name)
                if fd is None:
                    fd = os.open(os.path.join(self._path, name), os.O_RDONLY | os.O_CLOEXEC)
                    self._fds[name] = fd
        buf: bytearray | None = getattr(self._buffers, "buf", None)
        if buf is None or len(buf) < size:
            buf = self._buffers.buf = bytearray(size)
        view = memoryview(buf)[:size]
        return view[:os.preadv(fd, [view], offset)]

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


# --------------------------------------------------------------------------
# mounting and taking over


def open_and_mount(mountpoint: str, *, max_read: int = 1 << 20) -> int:
    """Open /dev/fuse and mount its connection read-only on ``mountpoint``; return the fd.

    No server runs yet: requests wait until one calls :meth:`FuseServer.serve` on the fd.
    The mount's bdi readahead is raised to ``max_read`` (the kernel's default of
    128 KiB would cap sequential reads there whatever the requests could carry).
    """
    if max_read < _PAGE or max_read % _PAGE:
        raise ValueError(f"max_read must be a positive multiple of {_PAGE}, got {max_read}")
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    try:
        options = ("rootmode=40000,user_id=0,group_id=0,allow_other,default_permissions,"
                   f"max_read={max_read}")
        dev = kmount.mount_fuse(fd, mountpoint, options)
    except BaseException:
        os.close(fd)
        raise
    try:
        bdi = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
        with open(bdi, "w") as f:
            f.write(str(max_read // 1024))
    except OSError as exc:
        # the mount works without it, with 128 KiB readahead
        log.warning("could not raise readahead of the FUSE mount on %s: %s", mountpoint, exc)
    return fd


def take_fd(pid: int, fd: int) -> int:
    """A dup (close-on-exec) of process ``pid``'s fd ``fd``, via pidfd_getfd (Linux 5.6+).

    Needs ptrace rights over ``pid`` (root, or the same user with ptrace allowed).
    """
    pidfd = os.pidfd_open(pid)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        got = int(libc.syscall(ctypes.c_long(_PIDFD_GETFD), ctypes.c_long(pidfd),
                               ctypes.c_long(fd), ctypes.c_long(0)))
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"pidfd_getfd of fd {fd} of process {pid}: {os.strerror(err)}")
        return got
    finally:
        os.close(pidfd)


# --------------------------------------------------------------------------
# the server


class _Refused(Exception):
    """Answer the request with this errno."""

    def __init__(self, err: int) -> None:
        super().__init__(err)
        self.errno = err


class _Names:
    """Node id -> name, filled by lookups and, for ids an earlier server gave out, by
    listing the source; sizes cached (a blob never changes size)."""

    _AMBIGUOUS: Final = ""

    def __init__(self, source: BlobSource) -> None:
        self._source = source
        self._by_id: dict[int, str] = {}
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()

    def _refresh(self) -> None:
        by_id: dict[int, str] = {}
        for name in self._source.names():
            if not is_valid_name(name):
                continue
            nid = node_id(name)
            other = by_id.get(nid)
            by_id[nid] = name if other is None or other == name else self._AMBIGUOUS
        with self._lock:
            # merged: a name found by LOOKUP need not be listed (yet)
            self._by_id = {**self._by_id, **by_id}

    def _check(self, nid: int, name: str) -> None:
        known = self._by_id.get(nid)
        if known == self._AMBIGUOUS or (known is not None and known != name):
            log.error("blob names %s and another share node id %#x: refusing both", name, nid)
            with self._lock:
                self._by_id[nid] = self._AMBIGUOUS
            raise _Refused(errno.EIO)

    def lookup(self, name: str) -> tuple[int, int]:
        """(node id, size) of ``name``; ENOENT when the source has no such file."""
        if not is_valid_name(name):
            raise _Refused(errno.ENOENT)
        size = self._source.size(name)
        if size is None:
            raise _Refused(errno.ENOENT)
        nid = node_id(name)
        if nid not in self._by_id:
            self._refresh()  # the first sight of this name: look for a colliding one
        self._check(nid, name)
        with self._lock:
            self._by_id[nid] = name
            self._sizes[name] = size
        return nid, size

    def resolve(self, nid: int) -> tuple[str, int]:
        """(name, size) of a node id the kernel holds; ESTALE when it is gone."""
        name = self._by_id.get(nid)
        if name is None:
            self._refresh()  # an id an earlier server gave out
            name = self._by_id.get(nid)
        if name is None:
            raise _Refused(errno.ESTALE)
        if name == self._AMBIGUOUS:
            raise _Refused(errno.EIO)
        size = self._sizes.get(name)
        if size is None:
            size = self._source.size(name)
            if size is None:
                raise _Refused(errno.ESTALE)
            self._sizes[name] = size
        return name, size

    def listing(self) -> list[str]:
        """The valid names in directory order (by node id, i.e. by name)."""
        return sorted(n for n in self._source.names() if is_valid_name(n))


def _attr(nid: int, mode: int, size: int, nlink: int) -> bytes:
    blocks = (size + 511) // 512
    return _ATTR.pack(nid, size, blocks, 0, 0, 0, 0, 0, 0, mode, nlink, 0, 0, 0, _PAGE, 0)


def _root_attr() -> bytes:
    return _attr(_ROOT_ID, _ROOT_MODE, 0, 2)


def _dirent(nid: int, cookie: int, name: bytes, kind: int) -> bytes:
    raw = _DIRENT_HEAD.pack(nid, cookie, len(name), kind) + name
    return raw + b"\0" * (-len(raw) % 8)


_Reply = Sequence[bytes | memoryview]


class FuseServer:
    """Serve ``source`` on the FUSE connection of ``fd`` (see the module docstring).

    The fd stays the caller's: the server neither closes it nor dups it.
    ``serve`` may be called once.
    """

    def __init__(self, source: BlobSource, fd: int, *, threads: int = 8) -> None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self._source = source
        self._fd = fd
        self._threads = threads
        self._names = _Names(source)
        self._done = threading.Event()
        self._stopping = False
        self._failure: BaseException | None = None
        self._handlers = {
            _INIT: self._init,
            _LOOKUP: self._lookup,
            _GETATTR: self._getattr,
            _OPEN: self._open,
            _READ: self._read,
            _RELEASE: self._empty,
            _OPENDIR: self._opendir,
            _READDIR: self._readdir,
            _RELEASEDIR: self._empty,
            _STATFS: self._statfs,
            _ACCESS: self._empty,  # default_permissions: the kernel has checked already
            _DESTROY: self._destroy,
        }

    # -- running

    def serve(self, *, resumed: bool = False) -> None:
        """Answer requests until the file system is unmounted or :meth:`stop` is called.

        ``resumed``: an earlier server answered INIT on this connection; first ask the
        kernel to send again what that server had read and not answered.
        Raises :class:`FuseServerError` when the kernel's protocol is not ours and
        ``OSError`` when the device fails.
        """
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        fcntl.fcntl(self._fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
        if resumed:
            self._resend()
        wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)  # written once: all stop
        workers = [threading.Thread(target=self._work, args=(wake,), name=f"fuse-{i}",
                                    daemon=True)
                   for i in range(self._threads)]
        try:
            for worker in workers:
                worker.start()
            self._done.wait()
        finally:
            self._stopping = True
            os.eventfd_write(wake, 1)
            for worker in workers:
                if worker.ident is not None:
                    worker.join()
            os.close(wake)
        if self._failure is not None:
            raise self._failure

    def stop(self) -> None:
        """Make ``serve`` return; requests not yet read stay queued for the next server."""
        self._done.set()

    def _finish(self, failure: BaseException | None = None) -> None:
        if failure is not None and self._failure is None:
            self._failure = failure
        self._done.set()

    def _resend(self) -> None:
        try:
            os.write(self._fd, _OUT_HEADER.pack(_OUT_HEADER.size, _NOTIFY_RESEND, 0))
        except OSError as exc:
            # EINVAL: a kernel before 6.9 knows no FUSE_NOTIFY_RESEND
            log.warning("FUSE_NOTIFY_RESEND refused (%s): requests the previous server "
                        "had read are lost and their readers wait forever", exc)

    def _work(self, wake: int) -> None:
        buf = bytearray(_BUFSIZE)
        view = memoryview(buf)
        poller = select.epoll()
        try:
            poller.register(self._fd, select.EPOLLIN | select.EPOLLEXCLUSIVE)
            poller.register(wake, select.EPOLLIN)
            while not self._stopping:
                try:
                    n = os.readv(self._fd, [buf])
                except BlockingIOError:
                    poller.poll()
                    continue
                except OSError as exc:
                    if exc.errno in (errno.ENODEV, errno.ECONNABORTED):
                        self._finish()  # unmounted or aborted
                    elif exc.errno == errno.ENOENT:
                        continue  # the request was interrupted while being copied
                    else:
                        self._finish(exc)
                    return
                self._handle(view[:n])
        except BaseException as exc:  # re-raised by serve()
            self._finish(exc)
        finally:
            poller.close()

    # -- one request

    def _handle(self, request: memoryview) -> None:
        _, opcode, unique, nid, *_ = _IN_HEADER.unpack_from(request)
        if unique & _UNIQUE_RESEND:  # rare: only after a takeover
            log.info("request %#x (opcode %d, node %#x) resent by the kernel", unique, opcode, nid)
        if opcode in (_FORGET, _BATCH_FORGET, _INTERRUPT):
            return  # no reply; node ids are names, so there is nothing to forget
        handler = self._handlers.get(opcode)
        if handler is None:
            # FLUSH, GETXATTR, LISTXATTR, STATX, ...: ENOSYS also tells the kernel
            # not to send that opcode again
            self._reply(unique, -errno.ENOSYS, ())
            return
        try:
            parts = handler(nid, request[_IN_HEADER.size:])
        except _Refused as refusal:
            self._reply(unique, -refusal.errno, ())
            return
        except FuseServerError as exc:
            self._reply(unique, -errno.EPROTO, ())
            self._finish(exc)
            return
        except Exception:
            log.exception("FUSE opcode %d on node %#x failed", opcode, nid)
            self._reply(unique, -errno.EIO, ())
            return
        self._reply(unique, 0, parts)

    def _reply(self, unique: int, error: int, parts: _Reply) -> None:
        length = _OUT_HEADER.size + sum(len(p) for p in parts)
        try:
            os.writev(self._fd, [_OUT_HEADER.pack(length, error, unique), *parts])
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return  # the kernel dropped the request meanwhile (interrupted)
            if exc.errno in (errno.ENODEV, errno.ECONNABORTED):
                self._finish()
                return
            log.error("FUSE reply to request %#x (error %d, %d bytes) refused: %s",
                      unique, error, length, exc)

    # -- operations; each returns the reply's payload or raises _Refused

    def _init(self, nid: int, body: memoryview) -> _Reply:
        major, minor, max_readahead, flags = _INIT_IN.unpack_from(body)
        if major > _KERNEL_MAJOR:
            # the kernel retries INIT with the major version we name
            return [_INIT_OUT.pack(_KERNEL_MAJOR, _OUR_MINOR, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)]
        if major < _KERNEL_MAJOR or minor < _OLDEST_MINOR:
            raise FuseServerError(
                f"the kernel speaks FUSE {major}.{minor}; this server needs "
                f"{_KERNEL_MAJOR}.{_OLDEST_MINOR} or later (Linux 5.10+)")
        if flags & _INIT_EXT and len(body) >= _INIT_IN.size + _INIT_IN_FLAGS2.size:
            (flags2,) = _INIT_IN_FLAGS2.unpack_from(body, _INIT_IN.size)
            flags |= flags2 << 32
        chosen = flags & _WANTED
        if chosen >> 32:
            chosen |= _INIT_EXT
        log.info("FUSE %d.%d INIT: kernel offers %#x, we take %#x", major, minor, flags, chosen)
        return [_INIT_OUT.pack(
            _KERNEL_MAJOR, min(minor, _OUR_MINOR), _MAX_READAHEAD, chosen & 0xFFFFFFFF,
            _MAX_BACKGROUND, _CONGESTION_THRESHOLD, _MAX_WRITE, 1, _MAX_PAGES_WANTED, 0,
            chosen >> 32, 0)]

    def _destroy(self, nid: int, body: memoryview) -> _Reply:
        self._finish()
        return ()

    def _empty(self, nid: int, body: memoryview) -> _Reply:
        return ()

    def _lookup(self, nid: int, body: memoryview) -> _Reply:
        if nid != _ROOT_ID:
            raise _Refused(errno.ENOTDIR)
        raw = bytes(body).split(b"\0", 1)[0]
        try:
            name = raw.decode("ascii")
        except UnicodeDecodeError:
            raise _Refused(errno.ENOENT) from None
        child, size = self._names.lookup(name)
        head = _ENTRY_OUT_HEAD.pack(child, 0, _TIMEOUT, _TIMEOUT, 0, 0)
        return [head, _attr(child, _FILE_MODE, size, 1)]

    def _getattr(self, nid: int, body: memoryview) -> _Reply:
        head = _ATTR_OUT_HEAD.pack(_TIMEOUT, 0, 0)
        if nid == _ROOT_ID:
            return [head, _root_attr()]
        _, size = self._names.resolve(nid)
        return [head, _attr(nid, _FILE_MODE, size, 1)]

    def _open(self, nid: int, body: memoryview) -> _Reply:
        (flags, _) = _OPEN_IN.unpack_from(body)
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise _Refused(errno.EROFS)
        self._names.resolve(nid)
        # NOFLUSH: close() sends no FLUSH, which the kernel waits for uninterruptibly; with
        # no server running, a process closing a blob fd (or exec'ing with one open)
        # would hang until a server came back
        return [_OPEN_OUT.pack(0, _FOPEN_KEEP_CACHE | _FOPEN_NOFLUSH, 0)]

    def _read(self, nid: int, body: memoryview) -> _Reply:
        _, offset, size, *_ = _READ_IN.unpack_from(body)
        name, file_size = self._names.resolve(nid)
        want = max(0, min(size, file_size - offset))
        if want == 0:
            return ()
        try:
            data = self._source.read(name, offset, want)
        except OSError as exc:
            err = exc.errno or errno.EIO
            log.warning("read of blob %s at offset %d (%d bytes) failed: %s",
                        name, offset, want, exc)
            raise _Refused(err) from None
        except Exception:
            log.exception("read of blob %s at offset %d (%d bytes) failed", name, offset, want)
            raise _Refused(errno.EIO) from None
        if len(data) != want:
            log.error("read of blob %s at offset %d returned %d bytes, not %d",
                      name, offset, len(data), want)
            raise _Refused(errno.EIO)
        return [data]

    def _opendir(self, nid: int, body: memoryview) -> _Reply:
        if nid != _ROOT_ID:
            raise _Refused(errno.ENOTDIR)
        return [_OPEN_OUT.pack(0, 0, 0)]

    def _readdir(self, nid: int, body: memoryview) -> _Reply:
        # Cookies: 1 after ".", 2 after "..", node id + 1 after a name; resuming
        # after a name works however the listing changed meanwhile.
        _, offset, size, *_ = _READ_IN.unpack_from(body)
        entries: list[bytes] = []
        used = 0

        def add(entry: bytes) -> bool:
            nonlocal used
            if used + len(entry) > size:
                return False
            entries.append(entry)
            used += len(entry)
            return True

        if offset < 1 and not add(_dirent(_ROOT_ID, 1, b".", _DT_DIR)):
            return entries
        if offset < 2 and not add(_dirent(_ROOT_ID, 2, b"..", _DT_DIR)):
            return entries
        for name in self._names.listing():
            child = node_id(name)
            if child + 1 > offset and not add(_dirent(child, child + 1, name.encode(), _DT_REG)):
                break
        return entries

    def _statfs(self, nid: int, body: memoryview) -> _Reply:
        return [_KSTATFS.pack(0, 0, 0, 0, 0, _PAGE, 255, _PAGE)]
