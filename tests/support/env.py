"""What the test host can do, and what a test does when it cannot.

``require(feature)`` skips the test when a feature is missing, except under
CI (``CI=true``), where a missing feature means a broken runner and the test
fails instead: a green CI run must have exercised the kernel paths.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import pytest

from .proc import run

# ../shared beside this checkout (the shared fixtures and notes), wherever the checkout is
SHARED = Path(__file__).resolve().parents[3] / "shared"
FIXTURE_IMAGE = SHARED / "fixtures" / "debian-bookworm.oci.tar"

# Features that are programs, with the Debian package that provides them.
_PACKAGES = {
    "mkfs.erofs": "erofs-utils",
    "fsck.erofs": "erofs-utils",
    "dump.erofs": "erofs-utils",
    "modprobe": "kmod",
    "fusermount3": "fuse3",
    "faketime": "faketime",
}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def _filesystems() -> set[str]:
    with open("/proc/filesystems") as f:
        return {line.split()[-1] for line in f if line.strip()}


def _load_module(name: str) -> None:
    if shutil.which("modprobe") is None:
        return
    # Failure is expected on hosts without the module; the caller re-checks.
    run(["modprobe", name], timeout=30, check=False)


@functools.cache
def missing(feature: str) -> str | None:
    """Why ``feature`` is unavailable, or None when it is there.

    ``feature`` is ``"root"``, ``"cmd:<program>"``, or a filesystem type as
    listed in /proc/filesystems (``"erofs"``, ``"overlay"``, ``"fuse"``),
    which is loaded with modprobe first if needed.
    """
    if feature == "root":
        return None if os.geteuid() == 0 else "needs root (mounting needs CAP_SYS_ADMIN)"
    if feature.startswith("cmd:"):
        program = feature[4:]
        if shutil.which(program) is not None:
            return None
        package = _PACKAGES.get(program)
        fix = f" (apt-get install {package})" if package else ""
        return f"program {program!r} is not installed{fix}"
    if feature not in _filesystems():
        if os.geteuid() == 0:
            _load_module(feature)
        if feature not in _filesystems():
            return (f"the kernel has no {feature!r} filesystem in /proc/filesystems "
                    f"(modprobe {feature} failed or needs root)")
    if feature == "fuse" and not os.path.exists("/dev/fuse"):
        return "the fuse filesystem is registered but /dev/fuse is missing"
    return None


def unavailable(reason: str) -> None:
    """Skip the calling test for ``reason``; fail instead when CI=true (a green CI run has
    used the real part)."""
    if in_ci():
        pytest.fail(f"CI=true but {reason}", pytrace=False)
    pytest.skip(reason)


def require(feature: str) -> None:
    """Skip the calling test if ``feature`` is missing; fail instead when CI=true."""
    reason = missing(feature)
    if reason is not None:
        unavailable(reason)
