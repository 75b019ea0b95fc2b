"""Shared pytest fixtures: host requirements and kernel mounts that never leak.

* ``need_root`` / ``@pytest.mark.root("erofs", "overlay")`` / ``require(...)``:
  skip when the host lacks a feature, fail instead when ``CI=true``.
* ``mounts``: mounts EROFS layers and overlays on fresh temp directories and
  unmounts them all, in reverse order, when the test ends however it ends.
* A session check fails the run if any mount is left under pytest's temp root.
* ``real_s3``: the session's real S3 (a Ceph RGW, or ``LAYERBOX_TEST_S3_ENDPOINT``);
  its boot begins in the background as soon as collection found a test marked
  ``real_s3`` (tests/support/real_s3.py).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from support.env import require

from lazyfetch import kmount
from lazyfetch.errors import KernelMountError
from tests.support import real_s3 as real_s3_support
from tests.support.hosts import hosts  # noqa: F401  (a fixture for every test module)
from tests.support.real_s3 import real_s3  # noqa: F401  (session scope: one RGW per run)
from tests.support.sandboxes import boxes, manager, store_url  # noqa: F401  (module scope: one per module)


@pytest.fixture
def need_root() -> None:
    """Skip (or under CI fail) unless running as root."""
    require("root")


def pytest_collection_finish(session: pytest.Session) -> None:
    # Boot the RGW while the first tests run; not for --collect-only.
    if not session.config.option.collectonly and any(map(real_s3_support.is_real_s3, session.items)):
        real_s3_support.boot_in_background()


def pytest_sessionfinish(session: pytest.Session) -> None:
    real_s3_support.shutdown()  # also when no test got as far as the fixture (-x, Ctrl-C)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    timings = real_s3_support.boot_timings()
    if timings:
        steps = ", ".join(f"{step} {seconds:.1f} s" for step, seconds in timings.items())
        terminalreporter.write_line(f"Ceph RGW boot (seconds since it began): {steps}")


def pytest_runtest_setup(item: pytest.Item) -> None:
    # @pytest.mark.root("erofs", "overlay"): root plus the named features.
    marker = item.get_closest_marker("root")
    if marker is not None:
        require("root")
        for feature in marker.args:
            require(feature)


class Mounts:
    """The mounts one test made, unmounted in reverse order by ``release``."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self._factory = factory
        self._mounted: list[Path] = []

    def _fresh_dir(self, kind: str) -> Path:
        return self._factory.mktemp(f"mnt-{kind}", numbered=True)

    def erofs(self, meta: Path, blob: Path | None = None, *, at: Path | None = None) -> Path:
        """Mount an EROFS image (file-backed, ``device=blob``); return the mount point.

        The mount point is a fresh temp directory unless ``at`` names one
        (e.g. inside another mount, to test nesting).
        """
        require("root")
        require("erofs")
        mountpoint = self._fresh_dir("erofs") if at is None else at
        kmount.mount_erofs(meta, mountpoint, blob)
        self._mounted.append(mountpoint)
        return mountpoint

    def overlay(
        self,
        lowers: Sequence[Path],
        upper: Path | None = None,
        work: Path | None = None,
        *,
        options: Sequence[str] = (),
        at: Path | None = None,
    ) -> Path:
        """Mount an overlay of ``lowers`` (lowest first); return the mount point.

        Read-only without ``upper``; ``upper`` and ``work`` go together.
        """
        require("root")
        require("overlay")
        mountpoint = self._fresh_dir("overlay") if at is None else at
        kmount.mount_overlay(lowers, mountpoint, upper=upper, work=work, options=options)
        self._mounted.append(mountpoint)
        return mountpoint

    def adopt(self, mountpoint: Path) -> None:
        """Unmount ``mountpoint``, mounted by other means (a FUSE server's), with the rest."""
        self._mounted.append(mountpoint)

    def fresh_dir(self, kind: str) -> Path:
        """A new empty directory to mount on."""
        return self._fresh_dir(kind)

    def unmount(self, mountpoint: Path) -> None:
        """Unmount one of our mounts before the test ends (to test what follows)."""
        kmount.umount(mountpoint)
        self._mounted.remove(mountpoint)

    def release(self) -> list[str]:
        """Unmount everything, newest first; return what could not be cleaned up."""
        problems = []
        while self._mounted:
            mountpoint = self._mounted.pop()
            try:
                kmount.umount(mountpoint, missing_ok=True)
            except KernelMountError as exc:
                # Usually an fd or cwd the test left open: detach so later
                # tests and pytest's temp cleanup are not blocked.
                warnings.warn(f"detaching busy mount lazily: {exc}", stacklevel=1)
                try:
                    kmount.umount(mountpoint, lazy=True, missing_ok=True)
                except KernelMountError as lazy_exc:
                    problems.append(str(lazy_exc))
            if kmount.is_mountpoint(mountpoint):
                problems.append(f"{mountpoint} is still mounted after unmounting")
        return problems


@pytest.fixture
def mounts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mounts]:
    """Mount helper whose mounts are all gone when the test ends (or the test errors)."""
    tracker = Mounts(tmp_path_factory)
    try:
        yield tracker
    finally:
        problems = tracker.release()
        if problems:
            pytest.fail("mounts left behind:\n" + "\n".join(problems), pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def _no_leaked_mounts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Fail the session loudly if a test left any mount under pytest's temp root."""
    yield
    root = os.path.realpath(tmp_path_factory.getbasetemp())
    below = root + "/"
    leaked = [m for m in kmount.read_mountinfo()
              if m.mountpoint == root or m.mountpoint.startswith(below)]
    if not leaked:
        return
    # Detach them so the host and pytest's removal of old temp roots survive.
    for mountpoint in kmount.mounts_under(root):
        try:
            kmount.umount(mountpoint, lazy=True, missing_ok=True)
        except KernelMountError:
            pass  # reported below anyway
    listing = "\n".join(f"  {m.fstype} {m.source} on {m.mountpoint}" for m in leaked)
    pytest.fail(
        f"{len(leaked)} mount(s) leaked under {root} (detached now); "
        f"use the `mounts` fixture for every mount:\n{listing}",
        pytrace=False,
    )
