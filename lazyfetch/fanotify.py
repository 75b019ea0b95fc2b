"""fanotify pre-content events: make reads of a sparse blob wait until it is filled.

A layer's blob is a sparse local file; a file-backed EROFS mount reads it.
With a ``FAN_PRE_ACCESS`` mark on the blob, every read of a range first
raises an event to our group and sleeps until the handler has written the
missing bytes there and answered ``FAN_ALLOW`` (or ``FAN_DENY_ERRNO(EIO)``,
which the reader gets as EIO).  shared/notes/fanotify-recipe.md
has the measurements this module relies on; the rules that follow from them:

* The blob's write fd must be opened **before** the mark: whether a file's
  I/O raises pre-content events is decided when it is opened, so an fd opened
  before the mark never does, and one opened after it always does (even from
  the handler's own process).  The same rule makes a mark added **after** the
  mount useless: the mount opened the blob without it and reads zeros.  So
  check :meth:`Group.watching` before and after each mount.
* If the last fd of the group closes, pending and later reads of holes return
  zeros with no error.  A separate holder process (lazyfetch/holder.py) keeps
  a dup; a restarted handler adopts it and must :meth:`Group.sweep` first.
* Responses name the event by the fd number ``read()`` installed in the
  handler's process (``process_access_response`` compares ``event->fd``, in
  whatever process the response is written), so events read by a handler
  that died are answered either from a record of them (the daemon reads into
  the in-flight journal, lazyfetch/inflight.py, with :meth:`Group.read_into`)
  or by writing a response for every fd number (the sweep, EIO).  Closing the
  group's last fd instead answers them FAN_ALLOW: zeros.
* A handler thread inside a process that reads the mount through mmap
  deadlocks (the faulting thread holds the GIL); read mounts from other
  processes.

Seen on 6.18 (tests/test_fanotify.py): ranges are page aligned (4 KiB to
256 KiB); writes through an fd opened after the mark raise FAN_PRE_ACCESS
too; readers of one file wait on one event; an event denied under readahead
is retried synchronously, so readers mostly get the right bytes, not EIO;
event fds (``O_RDWR`` here) raise no events, so a handler may fill through
them; a round trip costs ~40 us; sweeping 65,536 fd numbers ~0.07 s.

Nothing here prints; failures are :class:`FanotifyError` (an ``OSError``
with the errno and the path).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import functools
import os
import platform
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Final

from lazyfetch.errors import FanotifyError
from lazyfetch.holder import SWEEP_FDS, sweep

# <linux/fanotify.h>; Debian 12's headers predate the pre-content ones.
FAN_CLASS_PRE_CONTENT: Final = 0x8
FAN_CLOEXEC: Final = 0x1
FAN_UNLIMITED_QUEUE: Final = 0x10
FAN_PRE_ACCESS: Final = 0x00100000
FAN_Q_OVERFLOW: Final = 0x4000
FAN_MARK_ADD: Final = 0x1
FAN_MARK_REMOVE: Final = 0x2
FAN_MARK_IGNORED_SURV_MODIFY: Final = 0x40
FAN_MARK_IGNORE: Final = 0x400
FAN_ALLOW: Final = 0x1
FAN_DENY: Final = 0x2
FAN_DENY_EIO: Final = FAN_DENY | (errno.EIO << 24)  # FAN_DENY_ERRNO(EIO) = 0x05000002
FAN_NOFD: Final = -1
FANOTIFY_METADATA_VERSION: Final = 3
FAN_EVENT_INFO_TYPE_RANGE: Final = 6

_AT_FDCWD: Final = -100
_SYSCALLS: Final = {"x86_64": (300, 301), "aarch64": (262, 263)}  # fanotify_init, fanotify_mark
_SYSCALLS_ALIAS: Final = {"arm64": "aarch64"}

EVENT_METADATA: Final = struct.Struct("=IBBHQii")  # event_len vers reserved metadata_len mask fd pid
INFO_HEADER: Final = struct.Struct("=BBH")  # info_type pad len
RANGE_INFO: Final = struct.Struct("=BBHIQQ")  # header, pad, offset, count
RESPONSE: Final = struct.Struct("=iI")  # fd, response
assert EVENT_METADATA.size == 24
assert RANGE_INFO.size == 24
assert RESPONSE.size == 8

_READ_SIZE: Final = 64 * 1024  # ~1,300 events a read


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _numbers() -> tuple[int, int]:
    machine = platform.machine()
    numbers = _SYSCALLS.get(_SYSCALLS_ALIAS.get(machine, machine))
    if numbers is None:
        raise FanotifyError(errno.ENOSYS, f"fanotify syscall numbers unknown on {machine}")
    return numbers


def _init(flags: int, event_f_flags: int) -> int:
    ctypes.set_errno(0)
    fd = int(_libc().syscall(ctypes.c_long(_numbers()[0]), ctypes.c_long(flags),
                             ctypes.c_long(event_f_flags)))
    if fd < 0:
        err = ctypes.get_errno()
        hint = {
            errno.EINVAL: "this kernel has no pre-content events (Linux 6.14+ with "
                          "CONFIG_FANOTIFY_ACCESS_PERMISSIONS)",
            errno.EPERM: "fanotify pre-content groups need CAP_SYS_ADMIN: run as root",
        }.get(err, "")
        raise FanotifyError(err, "fanotify_init(FAN_CLASS_PRE_CONTENT)", hint=hint)
    return fd


def _kernel_dev(st_dev: int) -> int:
    # fdinfo prints the superblock's kernel dev_t (major << 20 | minor), not st_dev's encoding
    return (os.major(st_dev) << 20) | os.minor(st_dev)


@dataclass(frozen=True, slots=True)
class Event:
    """One pre-content event: the reader waits until it is answered.

    ``fd`` is an fd of the blob installed in the reading process by ``read()``
    (its I/O raises no events; close it after responding); ``offset`` and
    ``count`` the range the reader needs, page aligned on 6.18 (the whole file
    when the kernel sent no range record; none was seen on 6.18); ``pid`` the
    reading (or writing: writes raise FAN_PRE_ACCESS too) process.
    """

    fd: int
    pid: int
    offset: int
    count: int
    mask: int = FAN_PRE_ACCESS
    at: int = -1  # where the event starts in the buffer it was read into (plus the caller's base)


@dataclass(frozen=True, slots=True)
class Mark:
    """One inode mark as /proc/self/fdinfo shows it."""

    dev: int  # kernel dev_t
    ino: int
    mask: int
    ignored_mask: int
    flags: int


# The event nearly every read is: metadata and one range record, nothing else.
_RANGE_EVENT: Final = struct.Struct("=IBBHQiiBBHIQQ")
assert _RANGE_EVENT.size == EVENT_METADATA.size + RANGE_INFO.size


def parse_events(buf: bytes | memoryview, base: int = 0) -> list[Event]:
    """Decode one ``read()`` of a group: several events, each with its info records.

    Each event's ``at`` is ``base`` plus its offset in ``buf``.
    """
    if len(buf) % _RANGE_EVENT.size == 0:
        # the fast path (a daemon answers thousands a second): every event is metadata + range
        out = []
        at = base
        for (event_len, vers, _, meta_len, mask, fd, pid, info_type, _, info_len, _, offset,
             count) in _RANGE_EVENT.iter_unpack(buf):
            if (event_len != _RANGE_EVENT.size or vers != FANOTIFY_METADATA_VERSION
                    or meta_len != EVENT_METADATA.size or info_type != FAN_EVENT_INFO_TYPE_RANGE
                    or info_len != RANGE_INFO.size):
                break
            out.append(Event(fd=fd, pid=pid, mask=mask, offset=offset, count=count, at=at))
            at += _RANGE_EVENT.size
        else:
            return out
    return _parse_events(buf, base)  # not all of that shape: the batch in full


def _parse_events(buf: bytes | memoryview, base: int = 0) -> list[Event]:
    events: list[Event] = []
    view = memoryview(buf)
    pos = 0
    while pos + EVENT_METADATA.size <= len(view):
        event_len, vers, _, meta_len, mask, fd, pid = EVENT_METADATA.unpack_from(view, pos)
        if vers != FANOTIFY_METADATA_VERSION:
            raise FanotifyError(errno.EPROTO, f"fanotify metadata version {vers}, expected "
                                f"{FANOTIFY_METADATA_VERSION}")
        if event_len < meta_len or meta_len < EVENT_METADATA.size or pos + event_len > len(view):
            raise FanotifyError(errno.EPROTO, f"malformed fanotify event at byte {pos}: "
                                f"event_len {event_len}, metadata_len {meta_len}")
        offset, count = 0, -1
        info = pos + meta_len
        while info + INFO_HEADER.size <= pos + event_len:
            info_type, _, info_len = INFO_HEADER.unpack_from(view, info)
            if info_len < INFO_HEADER.size:
                raise FanotifyError(errno.EPROTO, f"fanotify info record of {info_len} bytes")
            if info_type == FAN_EVENT_INFO_TYPE_RANGE and info_len >= RANGE_INFO.size:
                _, _, _, _, offset, count = RANGE_INFO.unpack_from(view, info)
            info += info_len  # unknown records are skipped by their length
        if count < 0 and fd >= 0:
            count = os.fstat(fd).st_size  # no range: the whole file
        events.append(Event(fd=fd, pid=pid, mask=mask, offset=offset, count=max(count, 0), at=base + pos))
        pos += event_len
    return events


class Group:
    """One fanotify pre-content group (FAN_CLASS_PRE_CONTENT, unlimited queue).

    Event fds are opened ``O_RDWR``: an event fd raises no events itself, so
    a handler may also fill the blob through it (the recipe's choice).
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    @classmethod
    def create(cls) -> Group:
        flags = FAN_CLASS_PRE_CONTENT | FAN_CLOEXEC | FAN_UNLIMITED_QUEUE
        return cls(_init(flags, os.O_RDWR | os.O_LARGEFILE))

    @classmethod
    def adopt(cls, fd: int) -> Group:
        """Wrap a group fd got back from the holder; call :meth:`sweep` before :meth:`events`.

        Clears O_NONBLOCK, which a holder killed while its watchdog was
        denying leaves set on the shared open file.
        """
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        if flags & os.O_NONBLOCK:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
        return cls(fd)

    def _mark(self, flags: int, path: str, what: str) -> None:
        ctypes.set_errno(0)
        result = _libc().syscall(
            ctypes.c_long(_numbers()[1]), ctypes.c_long(self.fd), ctypes.c_long(flags),
            ctypes.c_uint64(FAN_PRE_ACCESS), ctypes.c_long(_AT_FDCWD),
            ctypes.c_char_p(os.fsencode(path)))
        if result != 0:
            err = ctypes.get_errno()
            hint = {
                errno.EOPNOTSUPP: "this file system has no pre-content events (tmpfs, overlayfs, "
                                  "FUSE); keep blobs on ext4, xfs or btrfs",
                errno.EINVAL: "the kernel refused FAN_PRE_ACCESS here (Linux 6.14+ needed; "
                              "only regular files)",
                errno.ENOENT: "the file does not exist" if what != "unignore"
                              else "no ignore mark to remove",
            }.get(err, "")
            raise FanotifyError(err, f"fanotify_mark({what}) of {path!r}", path=path, hint=hint)

    def watch(self, path: str) -> None:
        """Mark ``path``: from now on, files opened on it raise FAN_PRE_ACCESS per read."""
        self._mark(FAN_MARK_ADD, path, "watch")

    def unwatch(self, path: str) -> None:
        self._mark(FAN_MARK_REMOVE, path, "unwatch")

    def ignore(self, path: str) -> None:
        """The blob is complete: no more events (the mark stays, so :meth:`unignore` works)."""
        self._mark(FAN_MARK_ADD | FAN_MARK_IGNORE | FAN_MARK_IGNORED_SURV_MODIFY, path, "ignore")

    def unignore(self, path: str) -> None:
        """Before evicting a range: reads raise events again."""
        self._mark(FAN_MARK_REMOVE | FAN_MARK_IGNORE, path, "unignore")

    def marks(self) -> list[Mark]:
        """The group's inode marks, from /proc/self/fdinfo."""
        with open(f"/proc/self/fdinfo/{self.fd}") as f:
            lines = f.read().splitlines()
        found = []
        for line in lines:
            if not line.startswith("fanotify ino:"):
                continue
            fields = dict(part.split(":", 1) for part in line.split()[1:] if ":" in part)
            found.append(Mark(dev=int(fields["sdev"], 16), ino=int(fields["ino"], 16),
                              mask=int(fields["mask"], 16),
                              ignored_mask=int(fields.get("ignored_mask", "0"), 16),
                              flags=int(fields.get("mflags", "0"), 16)))
        return found

    def mark_of(self, st: os.stat_result) -> Mark | None:
        """Our FAN_PRE_ACCESS mark on the inode ``st`` describes (ignored or not), if any."""
        dev = _kernel_dev(st.st_dev)
        return next((m for m in self.marks() if m.dev == dev and m.ino == st.st_ino and m.mask & FAN_PRE_ACCESS),
                    None)

    def watching(self, path: str) -> bool:
        """Whether the inode now at ``path`` has our FAN_PRE_ACCESS mark, not ignored.

        The canary before and after a mount.  It cannot see a mark added
        after the mount opened the blob (that mount never raises events).
        """
        mark = self.mark_of(os.stat(path))
        return mark is not None and not mark.ignored_mask & FAN_PRE_ACCESS

    def read_into(self, buf: memoryview, timeout: float | None = None) -> int:
        """Read one batch of events into ``buf`` (the in-flight journal's slot); bytes read,
        0 after ``timeout`` seconds without any.  Once read, an event waits on the group's
        access list until answered: it is in ``buf`` by then (the kernel copies it first)."""
        if timeout is not None:
            if not self._poll.poll(timeout * 1000):
                return 0
        try:
            return os.readv(self.fd, [buf])
        except BlockingIOError:
            return 0  # another reader (the holder's watchdog) took them
        except OSError as exc:
            raise FanotifyError(exc.errno or errno.EIO, "read of the fanotify group") from None

    def events(self, timeout: float | None = None) -> list[Event]:
        """Read one batch of events; blocks, or returns [] after ``timeout`` seconds."""
        if timeout is not None:
            if not self._poll.poll(timeout * 1000):
                return []
        try:
            buf = os.read(self.fd, _READ_SIZE)
        except BlockingIOError:
            return []  # another reader (the holder's watchdog) took them
        except OSError as exc:
            raise FanotifyError(exc.errno or errno.EIO, "read of the fanotify group") from None
        return parse_events(buf)

    def respond(self, event_fd: int, allow: bool) -> None:
        """Answer one event: FAN_ALLOW or FAN_DENY_ERRNO(EIO); the caller then closes ``event_fd``."""
        try:
            os.write(self.fd, RESPONSE.pack(event_fd, FAN_ALLOW if allow else FAN_DENY_EIO))
        except OSError as exc:
            raise FanotifyError(exc.errno or errno.EIO,
                                f"response to the fanotify event of fd {event_fd}") from None

    def sweep(self, upto: int = SWEEP_FDS) -> int:
        """Deny (EIO) every event read but unanswered by a handler that died; how many.

        Call after :meth:`adopt` and before the first :meth:`events`: it would
        deny our own events too.  ``upto`` bounds the fd numbers tried (the
        dead handler's RLIMIT_NOFILE is enough: the daemon keeps its own below
        ``SWEEP_FDS``).  A number is tried again after each hit: handlers that
        died one after the other may have left two events of one number.
        """
        try:
            return sweep(self.fd, upto)
        except OSError as exc:
            raise FanotifyError(exc.errno or errno.EIO, "sweep of the group's unanswered events") from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------
# probe: does it work here, end to end?

_PROBE_READER: Final = "import sys; sys.stdout.buffer.write(open(sys.argv[1], 'rb').read())"


def _probe_bytes() -> bytes:
    # deterministic, with no zero chunk (the converter would make that a hole)
    out = bytearray()
    seed = b"layerbox-probe"
    while len(out) < 200_000:
        seed = bytes(b ^ 0x5A for b in seed) + len(out).to_bytes(4, "little")
        out += seed * 97
    return bytes(out[:200_000])


def _serve_from(group: Group, source_fd: int, target_fd: int, stop: threading.Event) -> None:
    while not stop.is_set():
        for event in group.events(timeout=0.1):
            ok = True
            try:
                data = os.pread(source_fd, event.count, event.offset)
                os.pwrite(target_fd, data, event.offset)
            except OSError:
                ok = False
            group.respond(event.fd, ok)
            os.close(event.fd)


def probe(workdir: str) -> str | None:
    """None when pre-content events work in ``workdir`` end to end, else the reason.

    Builds a tiny chunked layer (a metadata image and a blob device, as
    layerbox's layers are) in a temporary directory under ``workdir`` with
    ``mkfs.erofs`` (erofs-utils: lazyfetch does not depend on the converters),
    marks an empty sparse copy of its blob, mounts the
    metadata image on it, reads the file from a child process while a handler
    thread fills the blob from the real one, and compares the bytes.  Needs
    root (mounting and the group).  Everything it makes is removed.
    """
    from lazyfetch import kmount
    from lazyfetch.errors import LazyfetchError

    try:
        group = Group.create()
    except FanotifyError as exc:
        return str(exc)
    tmp = tempfile.mkdtemp(prefix=".fanotify-probe-", dir=workdir)
    mnt = os.path.join(tmp, "mnt")
    mounted = False
    stop = threading.Event()
    thread: threading.Thread | None = None
    fds: list[int] = []
    try:
        sparse = os.path.join(tmp, "sparse.blob")
        fds.append(os.open(sparse, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
        try:
            group.watch(sparse)
        except FanotifyError as exc:
            return str(exc)
        group.unwatch(sparse)
        src = os.path.join(tmp, "src")
        os.mkdir(src)
        os.mkdir(mnt)
        payload = _probe_bytes()
        with open(os.path.join(src, "file"), "wb") as f:
            f.write(payload)
        meta, real = os.path.join(tmp, "meta.erofs"), os.path.join(tmp, "real.blob")
        try:
            made = subprocess.run(["mkfs.erofs", f"--blobdev={real}", "--chunksize=65536", "-T0", meta, src],
                                  capture_output=True, timeout=60, check=False)
        except (FileNotFoundError, subprocess.TimeoutExpired) as exc:
            return f"cannot build the probe layer with mkfs.erofs (erofs-utils): {exc}"
        if made.returncode != 0:
            return f"mkfs.erofs failed: {made.stderr.decode('utf-8', 'replace').strip()[-300:]}"
        real_fd = os.open(real, os.O_RDONLY | os.O_CLOEXEC)
        fds.append(real_fd)
        os.ftruncate(fds[0], os.fstat(real_fd).st_size)
        group.watch(sparse)
        kmount.mount_erofs(meta, mnt, sparse)
        mounted = True
        if not group.watching(sparse):
            return f"the mark on {sparse!r} is not in the group's fdinfo after the mount"
        thread = threading.Thread(target=_serve_from, args=(group, real_fd, fds[0], stop),
                                  name="fanotify-probe", daemon=True)
        thread.start()
        try:
            result = subprocess.run([sys.executable, "-I", "-S", "-c", _PROBE_READER,
                                     os.path.join(mnt, "file")],
                                    capture_output=True, timeout=20, check=False)
        except subprocess.TimeoutExpired:
            return "a read through the mount did not finish in 20 s (events not answered?)"
        if result.returncode != 0:
            return ("a read through the mount failed: "
                    + result.stderr.decode("utf-8", "replace").strip().splitlines()[-1])
        if result.stdout != payload:
            zeros = result.stdout.count(0)
            return (f"a read through the mount returned wrong bytes ({len(result.stdout)} of "
                    f"{len(payload)}, {zeros} zero bytes): events are not raised here")
        return None
    except (LazyfetchError, OSError) as exc:
        return f"probe failed: {exc}"
    finally:
        stop.set()
        if thread is not None:
            thread.join(5)
        if mounted:
            with contextlib.suppress(LazyfetchError):
                kmount.umount(mnt, lazy=True, missing_ok=True)
        for fd in fds:
            os.close(fd)
        group.close()
        shutil.rmtree(tmp, ignore_errors=True)
