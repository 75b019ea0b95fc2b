"""Debian's erofs-utils (1.5) as an independent reference for our images.

``mkfs_erofs`` makes images that do not depend on our own writer, and
``fsck_erofs``/``fsck_extract`` check any image, ours included.  Each call
needs the program (``apt-get install erofs-utils``) and skips or fails the
test through ``require`` when it is absent.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from .env import require
from .proc import run

_TIMEOUT = 600.0  # seconds; generous for multi-GiB trees on a slow disk


def _checked(argv: list[str]) -> subprocess.CompletedProcess[bytes]:
    result = run(argv, timeout=_TIMEOUT, check=False)
    if result.returncode != 0:
        output = (result.stdout + result.stderr).decode("utf-8", "backslashreplace")
        raise AssertionError(
            f"{argv[0]} exited with {result.returncode}: {' '.join(argv)}\n{output}"
        )
    return result


def mkfs_erofs(
    src_dir: Path,
    meta: Path,
    blob: Path,
    chunk_size: int,
    *,
    extra_args: tuple[str, ...] = (),
) -> None:
    """Build ``meta`` from ``src_dir`` with every file's data in chunks on ``blob``.

    ``--preserve-mtime`` keeps each file's own mtime (with nanoseconds);
    mkfs.erofs creates ``blob`` itself.
    """
    require("cmd:mkfs.erofs")
    _checked([
        "mkfs.erofs",
        "--quiet",
        "--preserve-mtime",
        f"--chunksize={chunk_size}",
        f"--blobdev={blob}",
        *extra_args,
        str(meta),
        str(src_dir),
    ])


def _device_args(blob: Path | None) -> list[str]:
    return [] if blob is None else [f"--device={blob}"]


def fsck_erofs(meta: Path, blob: Path | None) -> None:
    """Run fsck.erofs on ``meta`` (and its ``blob``); AssertionError with its output on failure."""
    require("cmd:fsck.erofs")
    _checked(["fsck.erofs", *_device_args(blob), str(meta)])


def fsck_extract(meta: Path, blob: Path | None, dest: Path) -> None:
    """Check every file's data by extracting the image into ``dest`` (created if missing).

    Know what fsck.erofs 1.5 extraction keeps before comparing ``dest`` with
    a source tree: owners, permission bits and mtimes (ns) yes; xattrs no,
    hard links no (each link becomes its own file), setuid/setgid no (its
    chown after chmod clears them).
    """
    require("cmd:fsck.erofs")
    _checked(["fsck.erofs", *_device_args(blob), f"--extract={dest}", str(meta)])
