"""When the daemon fetches the rest of an image in the background: the default fill policy.

A mount fetches what its readers touch and, when the image has a stored
access trace (``trace`` in ``POST /layers``, the default), what earlier tasks of
the image read, at once, for every image.  The *rest* of an image is worth a
host's disk writes only when it will be read: filling every image in full made
one short sandbox write more than an eager pull of its image (issue 27: 646 MB
against 444 MB), and a burst of short tasks on a few images reads the same
chunks again and again.  So a layer is filled in full only

* when it still asks the store after its image came back: from the
  ``after_uses``-th mount of an image on this host (default 2) its layers are
  *armed*, and an armed layer whose reads then wait for ``miss_bytes`` (4 MiB)
  of chunks from the store starts its fill.  Repeated tasks that read what the
  first one read do not miss (or only the odd chunk a different kernel
  readahead asks for), so they never fill; tasks that read more each time do.
  ``after_uses`` 1 fills every image at its first mount, without waiting for
  a miss (the policy before issue 27);
* or when one of the image's layers is still mounted ``after_seconds`` after
  its first mount (default 300 s): a long-lived sandbox, which then reads at
  local-disk speed;
* and never when the image's blobs add up to more than ``below`` bytes
  (``--fill-below``; 0 turns the background fill off).

While it runs, the fill yields to readers waiting on the store (the fetcher's
foreground count), keeps to ``--fill-bandwidth`` and to 80 % of the cache, and
pauses while the blob cache's disk was busy for more than ``max_busy`` of the
last interval (:class:`DiskIdle`), so sandboxes writing their uppers are not
slowed by a fill nobody waits for.

Use counts live in the daemon's memory: a restarted daemon counts from zero,
so an image in use before the restart waits for its next mount or for
``after_seconds``.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from pathlib import Path

from lazyfetch.errors import LazyfetchError

DEFAULT_FILL_AFTER_USES = 2
DEFAULT_FILL_AFTER_SECONDS = 300.0
DEFAULT_FILL_MAX_BUSY = 0.5
DEFAULT_FILL_MISS_BYTES = 4 << 20


class FillPolicyError(LazyfetchError, ValueError):
    """A fill option out of range; the message names the option."""


@dataclass(frozen=True)
class FillPolicy:
    below: int  # images with more blob bytes are never filled in full (0: no background fill at all)
    after_uses: int = DEFAULT_FILL_AFTER_USES  # the mount of an image that starts its fill (1: the first)
    after_seconds: float = DEFAULT_FILL_AFTER_SECONDS  # ... or a layer mounted this long (0: never)
    max_busy: float = DEFAULT_FILL_MAX_BUSY  # the fill waits while the disk was busier than this
    miss_bytes: int = DEFAULT_FILL_MISS_BYTES  # an armed layer fills once its reads missed this much

    def __post_init__(self) -> None:
        if self.below < 0:
            raise FillPolicyError(f"--fill-below must be 0 or more bytes, not {self.below}")
        if self.after_uses < 1:
            raise FillPolicyError(f"--fill-after-uses must be at least 1, not {self.after_uses}")
        if self.after_seconds < 0:
            raise FillPolicyError(f"--fill-after-seconds must be 0 or more, not {self.after_seconds}")
        if not 0 < self.max_busy <= 1:
            raise FillPolicyError(f"--fill-max-busy must be in (0, 1], not {self.max_busy}")
        if self.miss_bytes < 1:
            raise FillPolicyError(f"--fill-miss-bytes must be at least 1, not {self.miss_bytes}")

    def too_large(self, blob_bytes: int) -> bool:
        return not self.below or blob_bytes > self.below

    def on_use(self, blob_bytes: int, uses: int) -> str:
        """What a mount (the ``uses``-th of the image on this host) does about the rest of it:
        ``"fill"`` now, ``"arm"`` (fill once reads miss ``miss_bytes``), ``"wait"`` for a later use or a long
        life, or ``"never"``."""
        if self.too_large(blob_bytes):
            return "never"
        if uses < self.after_uses:
            return "wait"
        return "fill" if self.after_uses == 1 else "arm"

    def waiting_reason(self, uses: int) -> str:
        """Why an image is not filled yet (for ``layerbox daemon status``)."""
        why = f"used {uses} time(s); armed at use {self.after_uses}"
        if self.after_seconds:
            why += f", or filled once mounted {self.after_seconds:.0f} s"
        return why


def add_policy_flags(p: argparse.ArgumentParser, *, defaults: bool) -> None:
    """``--fill-after-uses``, ``--fill-after-seconds``, ``--fill-max-busy``, ``--fill-miss-bytes``, for the daemon
    (``defaults``) and for the commands that start one (``None``: the daemon's default)."""
    flags = (("--fill-after-uses", int, DEFAULT_FILL_AFTER_USES,
              "fill an image in full once its N-th mount on this host misses (1: every image at its first mount)"),
             ("--fill-after-seconds", float, DEFAULT_FILL_AFTER_SECONDS,
              "... or once a layer of it stayed mounted this long (0: never)"),
             ("--fill-max-busy", float, DEFAULT_FILL_MAX_BUSY,
              "the fill waits while the blob disk was busy more than this fraction of the time"),
             ("--fill-miss-bytes", int, DEFAULT_FILL_MISS_BYTES,
              "an armed layer (its image came back) is filled once its reads missed this many bytes"))
    for flag, kind, default, text in flags:
        p.add_argument(flag, type=kind, default=default if defaults else None,
                       help=f"{text} (default {default})")


class DiskIdle:
    """How busy the block device under a directory was since the last look (``io_ticks``).

    ``/sys/dev/block/M:m/stat``'s tenth field counts the milliseconds the device
    had I/O in flight; its growth over wall time is the busy fraction.  A
    directory on no block device (tmpfs, overlay of one) reports 0: no signal,
    so the fill goes on, as before this policy.
    """

    def __init__(self, where: Path) -> None:
        self.stat = self._stat_file(where)
        self._at = time.monotonic()
        self._ticks = self._io_ticks()

    @staticmethod
    def _stat_file(where: Path) -> Path | None:
        dev = os.stat(where).st_dev
        path = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
        return path if path.exists() else None

    def _io_ticks(self) -> int:
        if self.stat is None:
            return 0
        try:
            return int(self.stat.read_text().split()[9])
        except (OSError, IndexError, ValueError):
            return 0

    def busy(self) -> float:
        """The fraction of the time since the last call the device was busy (0 to 1)."""
        now, ticks = time.monotonic(), self._io_ticks()
        elapsed = now - self._at
        used = (ticks - self._ticks) / 1000
        self._at, self._ticks = now, ticks
        if elapsed <= 0:
            return 0.0
        return min(max(used / elapsed, 0.0), 1.0)
