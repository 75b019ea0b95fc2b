"""Disk limits: a sandbox with ``disk=N`` writes into its own N-byte ext4 file system.

The overlay's upper and work directories live on a sparse image file,
loop-mounted under the sandbox directory, so a disk fill ends with ENOSPC at
the limit and the host's data disk is untouched.  Measured on the test host:
``mkfs.ext4`` of a sparse image ~9 ms, loop mount ~7 ms.  The image holds no
journal: the upper directory is scratch space whose durable form is a
checkpoint, and a crash loses the sandbox anyway.

The upper holds whatever the sandbox wrote, setuid-root binaries and device
nodes included, so the file system is mounted ``nosuid,nodev,noexec`` (the
overlay on top still executes its files: overlayfs checks only its own
mount's flags), its root is 0700 and the image file 0600: no other local user
reaches or reads the upper, even through a sandbox directory opened for a
user namespace (see ``HostMounts.LAYER_FLAGS`` for the same choice on layers).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

from lazyfetch import kmount
from sandbox.core.errors import HostUnsupported, SandboxError

MIN_DISK = 16 << 20  # ext4 metadata alone needs a few MiB


def _run(argv: list[str], what: str) -> None:
    try:
        proc = subprocess.run(argv, capture_output=True, timeout=60)
    except FileNotFoundError:
        raise HostUnsupported(f"{argv[0]} is missing (apt-get install e2fsprogs mount)") from None
    if proc.returncode != 0:
        raise SandboxError(f"{what}: {' '.join(argv)} exited {proc.returncode}: "
                           f"{proc.stderr.decode(errors='replace').strip()}")


def make_disk(image: Path, mountpoint: Path, size: int) -> Path:
    """Create and mount an ext4 file system of ``size`` bytes; returns the directory for the upper."""
    if size < MIN_DISK:
        raise SandboxError(f"disk limit {size} bytes is below the minimum of {MIN_DISK} bytes")
    mountpoint.mkdir(parents=True, exist_ok=True)
    fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)  # sparse: the host pays only for what the sandbox writes
    finally:
        os.close(fd)
    _run(["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-m", "0",
          "-E", "nodiscard,lazy_itable_init=1", str(image)], f"formatting {image}")
    # util-linux sets up the loop device with autoclear: it goes with the umount
    _run(["mount", "-t", "ext4", "-o", "loop,nosuid,nodev,noexec", str(image), str(mountpoint)],
         f"mounting {image}")
    os.chmod(mountpoint, 0o700)  # the file system's root, not the directory it covers
    return mountpoint


def remove_disk(image: Path, mountpoint: Path) -> None:
    """Unmount and delete a sandbox's disk; idempotent."""
    if kmount.is_mountpoint(mountpoint):
        kmount.umount(mountpoint, missing_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(image)


def usage(mountpoint: Path) -> dict[str, int] | None:
    if not kmount.is_mountpoint(mountpoint):
        return None
    st = os.statvfs(mountpoint)
    return {"size": st.f_blocks * st.f_frsize, "free": st.f_bavail * st.f_frsize}
