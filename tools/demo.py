"""``layerbox demo``: the main job, end to end, on the local embedded store.

Build (once, then cached) a Debian 12 minbase root filesystem as a tar, publish it to
a store of the demo's own (``file://<data>/demo/store``; a second run shows the dedup:
nothing new to upload), then act as a fresh host with an empty cache: resolve the
image, start the lazyfetch daemon, mount the image writable (overlayfs on the lazily
fetched EROFS layer), run one command in it through chroot, write a file and show it in
the upper directory, and take everything down again.  Each step reports its time; the
lazy part also how little of the image it had to fetch.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import json
import os
import platform
import re
import selectors
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO
from urllib.parse import urlsplit

from converters.publish import PublishResult, publish
from layerstore.errors import LayerboxError
from layerstore.objects import Resolved, hex_digest
from layerstore.store import Store, default_data_dir
from lazyfetch import kmount
from lazyfetch.mounts import HostMounts
from sandbox.core.sync import run_blocking

SUITE = "bookworm"
SAMPLE_NAME = f"debian-{SUITE}-minbase"
IMAGE_NAME = f"demo/debian:{SUITE}"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
CHUNK_SIZE = 1 << 20
# The host's chroot (coreutils puts it in /usr/sbin on Debian) enters the mounted image.
CHROOT = "/usr/sbin/chroot"
GUEST_COMMAND = ("/bin/cat", "/etc/os-release")
WRITE_PATH = "/root/layerbox-demo.txt"
WRITE_TEXT = "written inside the sandbox by layerbox demo\n"
# What the lazy mount needs from the kernel, with the config option that provides it.
KERNEL_FILESYSTEMS = {
    "erofs": "CONFIG_EROFS_FS",
    "overlay": "CONFIG_OVERLAY_FS",
    "fuse": "CONFIG_FUSE_FS",
}

# A slow mirror can take many minutes for ~40 MB of packages; the guest command is instant.
BUILD_TIMEOUT = 30 * 60.0
COMMAND_TIMEOUT = 60.0
PROBE_TIMEOUT = 30.0
# mmdebstrap (root mode) mounts /proc and /dev in its chroot: give it time to undo that
# on SIGTERM before the process group is killed outright.
TERM_GRACE = 15.0

APT_SOURCES_LIST = Path("/etc/apt/sources.list")
APT_SOURCES_DIR = Path("/etc/apt/sources.list.d")

MB = 1_000_000
# File-backed EROFS mounts (a regular file as the source and as device=) arrived in 6.12.
FILE_BACKED_EROFS = (6, 12)
HOST_DIR = re.compile(r"host-(\d+)")


# Prints one progress line; each step reports as it finishes so a slow build is visible.
Say = Callable[[str], None]


class DemoError(LayerboxError):
    """A demo step failed; the message says which and, where possible, what to do."""


# --- subprocesses ---------------------------------------------------------------------


@dataclass(frozen=True)
class Ran:
    stdout: str
    stderr: str
    seconds: float  # from start to exit
    first_output: float | None  # from start to the first byte on stdout (None: no output)


def run(argv: list[str], *, timeout: float) -> Ran:
    """Run ``argv`` with captured output; raise :class:`DemoError` unless it exits 0.

    The child leads its own process group so that a timeout or Ctrl-C stops everything
    it started (mmdebstrap runs apt and dpkg below it).  stdin is /dev/null because
    mmdebstrap reads sources.list lines from a stdin that is not a terminal.  Output is
    read as it comes, so the time to the first byte of output is known.
    """
    started = time.perf_counter()
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except FileNotFoundError:
        raise DemoError(f"{argv[0]}: command not found (run `make deps`)") from None
    assert proc.stdout is not None
    assert proc.stderr is not None
    out, err = bytearray(), bytearray()
    first: float | None = None
    deadline = started + timeout
    with proc:
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(proc.stdout, selectors.EVENT_READ, out)
                sel.register(proc.stderr, selectors.EVENT_READ, err)
                while sel.get_map():
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        raise subprocess.TimeoutExpired(argv, timeout)
                    for key, _ in sel.select(left):
                        data = os.read(key.fd, 1 << 16)
                        if not data:
                            sel.unregister(key.fileobj)
                        elif key.data is out and first is None:
                            first = time.perf_counter() - started
                        key.data.extend(data)
            proc.wait(timeout=max(deadline - time.perf_counter(), 0.001))
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            raise DemoError(f"`{shlex.join(argv)}` timed out after {timeout:.0f} s") from None
        except BaseException:  # Ctrl-C included: never leave the child running
            _stop_group(proc)
            raise
    seconds = time.perf_counter() - started
    stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
    if proc.returncode != 0:
        detail = _tail(stderr or stdout)
        raise DemoError(f"`{shlex.join(argv)}` exited with {proc.returncode}: {detail}")
    return Ran(stdout, stderr, seconds, first)


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    for sig, wait in ((signal.SIGTERM, TERM_GRACE), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.communicate(timeout=wait)  # drains the pipes so that the child can exit
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(text: str, lines: int = 8) -> str:
    kept = [line for line in text.strip().splitlines() if line.strip()][-lines:]
    return " | ".join(kept) if kept else "(no output)"


# --- signals --------------------------------------------------------------------------

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Treat SIGTERM like Ctrl-C for the block, so the cleanup runs for both."""
    old = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM until the block ends, then raise KeyboardInterrupt.

    For the steps that must not stop halfway: a daemon that is still starting when the
    demo gives up has no pid the cleanup could find, a mount interrupted between the
    kernel call and the state file is unknown to ``umount_all``, and a cleanup must finish.
    """
    pending: list[int] = []
    old = {
        sig: signal.signal(sig, lambda signum, _frame: pending.append(signum)) for sig in _SIGNALS
    }
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if pending:
        raise KeyboardInterrupt


# --- locations ------------------------------------------------------------------------


def debian_mirror(
    sources_list: Path = APT_SOURCES_LIST, sources_dir: Path = APT_SOURCES_DIR
) -> str:
    """The Debian archive apt uses on this host, else deb.debian.org.

    Building through the host's own mirror keeps the demo working behind a proxy or
    an internal mirror, which is often the only Debian archive such hosts can reach.
    """
    files = [
        sources_list,
        *sorted(sources_dir.glob("*.list")),
        *sorted(sources_dir.glob("*.sources")),
    ]
    for path in files:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        entries = _deb822_entries(text) if path.suffix == ".sources" else _one_line_entries(text)
        for uri, suites, components in entries:
            if _is_debian_main(uri, suites, components):
                return uri.rstrip("/")
    return DEFAULT_MIRROR


Entry = tuple[str, list[str], list[str]]  # (uri, suites, components)


def _one_line_entries(text: str) -> Iterator[Entry]:
    for raw in text.splitlines():
        words = raw.split("#", 1)[0].split()
        if not words or words[0] != "deb":
            continue
        words = words[1:]
        if words and words[0].startswith("["):  # [arch=amd64 signed-by=...]
            while words and not words[0].endswith("]"):
                words.pop(0)
            words = words[1:]
        if len(words) >= 2:
            yield words[0], [words[1]], words[2:]


def _deb822_entries(text: str) -> Iterator[Entry]:
    for stanza in text.split("\n\n"):
        fields: dict[str, str] = {}
        key = ""
        for line in stanza.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            if line[0].isspace() and key:  # continuation line
                fields[key] += " " + line.strip()
            elif ":" in line:
                key, value = line.split(":", 1)
                key = key.strip().lower()
                fields[key] = value.strip()
        if fields.get("enabled", "yes").lower() == "no":
            continue
        if "deb" not in fields.get("types", "").split():
            continue
        suites = fields.get("suites", "").split()
        components = fields.get("components", "").split()
        for uri in fields.get("uris", "").split():
            yield uri, suites, components


def _is_debian_main(uri: str, suites: Iterable[str], components: Iterable[str]) -> bool:
    # A release suite ("bookworm", "stable"), not "-security"/"-updates"/"-backports",
    # and a Debian archive rather than Ubuntu's or a third-party repository.
    return (
        urlsplit(uri).scheme in ("http", "https", "file")
        and "debian" in uri
        and "security" not in uri
        and "main" in components
        and any("-" not in suite for suite in suites)
    )


# --- steps ----------------------------------------------------------------------------


@dataclass
class Sample:
    path: str
    bytes: int
    cached: bool
    build_seconds: float | None = None
    mirror: str | None = None


@dataclass
class Report:
    data_dir: str
    sample: Sample
    store: str = ""
    step_seconds: dict[str, float] = field(default_factory=dict)
    publish: dict[str, Any] = field(default_factory=dict)
    image: dict[str, Any] = field(default_factory=dict)
    host: dict[str, Any] = field(default_factory=dict)
    command: list[str] = field(default_factory=list)
    output: str = ""
    fetch: dict[str, Any] = field(default_factory=dict)
    write: dict[str, Any] = field(default_factory=dict)
    checkpoint: dict[str, Any] | None = None
    sandbox: dict[str, Any] = field(default_factory=dict)
    microvm: dict[str, Any] = field(default_factory=dict)
    fleet: dict[str, Any] = field(default_factory=dict)
    left_mounted: list[str] = field(default_factory=list)


def sample_path(data: Path) -> Path:
    return data / "samples" / f"{SAMPLE_NAME}.tar"


def preflight(data: Path, *, rebuild: bool) -> None:
    """Fail before doing anything slow, with the reason and the fix."""
    if os.geteuid() != 0:
        raise DemoError(
            "the demo mounts EROFS, FUSE and overlayfs file systems and needs root: "
            "run `sudo make demo`"
        )
    for fstype, option in KERNEL_FILESYSTEMS.items():
        if not _kernel_has(fstype):
            try:
                run(["modprobe", fstype], timeout=PROBE_TIMEOUT)
            except DemoError:
                pass  # built-in or absent: /proc/filesystems below has the final word
        if not _kernel_has(fstype):
            raise DemoError(
                f"the kernel has no {fstype} support ('{fstype}' missing from /proc/filesystems "
                f"after `modprobe {fstype}`); it needs {option}"
                + (", and Linux 6.12 or newer for file-backed mounts" if fstype == "erofs" else "")
            )
    if _kernel_version() < FILE_BACKED_EROFS:
        # Caught here rather than at mount time, after a build and a publish.
        raise DemoError(
            f"kernel {platform.release()} cannot mount EROFS images from regular files "
            "(needs Linux 6.12+); on Debian 12 install the bookworm-backports kernel: "
            "apt-get install -t bookworm-backports linux-image-amd64"
        )
    if not os.path.exists("/dev/fuse"):
        raise DemoError("/dev/fuse is missing: the lazyfetch daemon serves blobs through FUSE")
    tools = ["unshare", CHROOT]
    if rebuild or not sample_path(data).exists():
        tools.append("mmdebstrap")
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        raise DemoError(f"missing command(s): {', '.join(missing)} (run `sudo make deps`)")


def _kernel_version() -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", platform.release())
    return (int(match[1]), int(match[2])) if match else (0, 0)


def _kernel_has(fstype: str) -> bool:
    with open("/proc/filesystems") as f:
        return any(line.split()[-1:] == [fstype] for line in f)


def ensure_sample(data: Path, *, rebuild: bool, say: Say) -> Sample:
    """The cached sample tar, built with mmdebstrap on first use."""
    target = sample_path(data)
    if target.exists() and not rebuild:
        sample = Sample(path=str(target), bytes=target.stat().st_size, cached=True)
        say(f"sample    cached      {target}  {_mb(sample.bytes)}")
        return sample
    mirror = debian_mirror()
    say(f"sample    building    Debian {SUITE} minbase from {mirror} (takes a minute or two)")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Only a complete tar ever carries the final name: a killed build leaves a temp file
    # that the next build overwrites, never a truncated cache entry.
    tmp = target.with_name(f".{target.name}.tmp")
    started = time.perf_counter()
    try:
        argv = [
            "mmdebstrap",
            "--quiet",
            "--variant=minbase",
            "--format=tar",
            SUITE,
            str(tmp),
            mirror,
        ]
        run(argv, timeout=BUILD_TIMEOUT)
        _fsync(tmp)
        os.replace(tmp, target)
        _fsync(target.parent)
    finally:
        tmp.unlink(missing_ok=True)
    seconds = time.perf_counter() - started
    sample = Sample(
        str(target), target.stat().st_size, cached=False, build_seconds=seconds, mirror=mirror
    )
    say(f"sample    {seconds:8.3f} s  built {target}  {_mb(sample.bytes)}")
    return sample


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def exclusive(root: Path) -> Iterator[None]:
    """One demo at a time: a second one would remove the first one's host directory."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DemoError(
                f"another `layerbox demo` is running ({root / '.lock'} is locked)"
            ) from None
        yield


def remove_old_demo_layer(root: Path, say: Say) -> None:
    """Earlier demos converted the sample next to the store and mounted it on ``mnt``;
    the layer now lives in the demo store, so those files are only taking space."""
    freed = 0
    for name in (f"{SAMPLE_NAME}.erofs", f"{SAMPLE_NAME}.blob"):
        path = root / name
        if path.is_file():
            freed += path.stat().st_size
            path.unlink()
    old_mnt = root / "mnt"
    if old_mnt.is_dir():
        while kmount.is_mountpoint(old_mnt):  # left by an old demo that was killed outright
            kmount.umount(old_mnt, lazy=True)
        with contextlib.suppress(OSError):
            old_mnt.rmdir()
    if freed:
        say(f"tidy      removed the converted layer an older demo left in {root} ({_mb(freed)})")


def publish_sample(
    sample: Sample, store_url: str, root: Path, report: Report, say: Say
) -> PublishResult:
    """Publish the sample tar as IMAGE_NAME; the second time, every chunk is already there.

    The publisher has a data dir of its own (its metadata cache), apart from the hosts'.
    """

    async def go() -> PublishResult:
        async with await Store.open(store_url, root / "publisher") as store:
            return await publish(
                store, sample.path, IMAGE_NAME, chunk_size=CHUNK_SIZE, work_dir=root
            )

    result = run_blocking(go())
    report.step_seconds["publish"] = result.seconds
    report.publish = result.to_json()
    rate = (
        sample.bytes / MB / result.convert_seconds if result.convert_seconds > 0 else float("inf")
    )
    say(f"publish   {result.seconds:8.3f} s  {result.name} -> {result.digest}")
    say(
        f"            convert {result.convert_seconds:.3f} s ({rate:.1f} MB/s of tar), "
        f"upload {result.upload_seconds:.3f} s, {result.requests} store requests"
    )
    say(
        f"            new to the store {_mb(result.bytes_new)} ({result.chunks_new} chunks, "
        f"{_mb(result.bytes_uploaded)} compressed); already present {_mb(result.bytes_present)} "
        f"({result.chunks_present} chunks)"
    )
    return result


def fresh_host(root: Path, store_url: str, say: Say) -> Path:
    """A new, empty host data dir ``host-<n>``, after taking down and removing older ones.

    Nothing is deleted while anything below it is still mounted: removing files through
    a live mount would delete what the mount shows, not the mount point.
    """
    numbered = {
        int(m[1]): path
        for path in root.glob("host-*")
        if path.is_dir() and (m := HOST_DIR.fullmatch(path.name))
    }
    removed = []
    for path in numbered.values():
        try:
            HostMounts(path, store_url).umount_all(stop_daemon=True)
        except LayerboxError as exc:
            raise DemoError(
                f"cannot take down the previous demo host {path} (is a process still running "
                f"inside its mount? a killed demo can leave its guest command behind): {exc}"
            ) from exc
        for mp in kmount.mounts_under(path):  # mounted, but unknown to its state file
            kmount.umount(mp, lazy=True, missing_ok=True)
        if left := kmount.mounts_under(path):
            raise DemoError(f"{path} still has mounts ({', '.join(left)}); not removing it")
        shutil.rmtree(path)
        removed.append(path.name)
    host = root / f"host-{max(numbered, default=0) + 1}"
    host.mkdir()
    note = f"; removed {', '.join(removed)}" if removed else ""
    say(f"host      {host}  (fresh: empty caches{note})")
    return host


def resolve_image(store_url: str, host: Path, report: Report, say: Say) -> Resolved:
    """The image's layers as a new host sees them: the ref and document read from the store."""

    async def go() -> Resolved:
        async with await Store.open(store_url, host) as store:
            return await store.resolve(IMAGE_NAME, refresh=True)

    started = time.perf_counter()
    resolved = run_blocking(go())
    seconds = report.step_seconds["resolve"] = time.perf_counter() - started
    layers = resolved.layers
    report.image = {
        "name": IMAGE_NAME,
        "digest": resolved.digest,
        "layers": [layer.digest for layer in layers],
        "files": sum(layer.files for layer in layers),
        "bytes": sum(layer.bytes for layer in layers),
        "chunks": sum(layer.chunks for layer in layers),
        "blob_bytes": sum(layer.blob_size for layer in layers),
        "meta_bytes": sum(layer.meta_size for layer in layers),
    }
    say(
        f"resolve   {seconds:8.3f} s  {IMAGE_NAME}: {len(layers)} layer(s), "
        f"{report.image['files']} files, {_mb(report.image['bytes'])} of file data"
    )
    return resolved


def start_daemon(mounts: HostMounts, store_url: str, report: Report, say: Say) -> None:
    started = time.perf_counter()
    with interrupts_held():
        health = mounts.start_daemon()
    seconds = report.step_seconds["daemon"] = time.perf_counter() - started
    report.host["daemon_pid"] = health["pid"]
    report.host["data_path"] = health["data_path"]
    why = f" ({health['data_path_reason']})" if health.get("data_path_reason") else ""
    say(f"daemon    {seconds:8.3f} s  lazyfetch pid {health['pid']}, blobs in {health['blobs']}, "
        f"served through {health['data_path']}{why}")


def mount_image(mounts: HostMounts, resolved: Resolved, report: Report, say: Say) -> None:
    mountpoint, upper = Path(report.host["mountpoint"]), Path(report.host["upper"])
    mountpoint.mkdir()
    started = time.perf_counter()
    # No access trace: the demo stops its daemon long before one would be stored, and
    # replaying one would prefetch what the lazy read below is meant to show; no background
    # fill either, for the same reason.
    with interrupts_held():
        mounts.mount(resolved, mountpoint, writable=True, upper=upper, trace=False, fill=False)
    seconds = report.step_seconds["mount"] = time.perf_counter() - started
    say(
        f"mount     {seconds:8.3f} s  {mountpoint}  (overlayfs, upper {upper}, on the lazy EROFS layer)"
    )


def in_sandbox(mountpoint: Path, *command: str) -> list[str]:
    # A private mount namespace keeps whatever the command mounts away from the host.
    return ["unshare", "--mount", "--propagation", "private", CHROOT, str(mountpoint), *command]


def run_in_image(report: Report, say: Say) -> None:
    argv = in_sandbox(Path(report.host["mountpoint"]), *GUEST_COMMAND)
    ran = run(argv, timeout=COMMAND_TIMEOUT)
    first = ran.first_output if ran.first_output is not None else ran.seconds
    report.step_seconds["first_output"] = first
    report.step_seconds["command"] = ran.seconds
    report.command = argv
    report.output = ran.stdout
    say(
        f"run       {first:8.3f} s  to first output ({ran.seconds:.3f} s to exit): {shlex.join(argv)}"
    )
    for line in ran.stdout.splitlines():
        say(f"            {line}")


def fetch_stats(mounts: HostMounts, report: Report, say: Say) -> None:
    """What the host read from the store so far, against the size of the image."""
    stats = mounts.client.request("GET", "/stats")
    image = report.image
    raw = stats["bytes_fetched_uncompressed"]
    report.fetch = {
        "bytes_fetched": stats["bytes_fetched"],
        "bytes_fetched_uncompressed": raw,
        "store_requests": stats["store_requests"],
        "chunks_fetched": stats["chunks_fetched"],
        "meta_bytes": image["meta_bytes"],
        "image_bytes": image["bytes"],
        "image_chunks": image["chunks"],
    }
    share = 100 * raw / image["bytes"] if image["bytes"] else 0.0
    say(
        f"fetched   {_mb(stats['bytes_fetched'])} of chunk data from the store "
        f"({stats['chunks_fetched']} of {image['chunks']} chunks, {_mb(raw)} uncompressed) in "
        f"{stats['store_requests']} requests: {share:.1f} % of the {_mb(image['bytes'])} image"
    )
    say(f"            plus the {_mb(image['meta_bytes'])} metadata image, read when mounting")


def restart_under_a_reader(mounts: HostMounts, report: Report, say: Say) -> None:
    """SIGKILL the daemon while the sandbox reads every file; its successor serves the rest.

    The reader's reads wait meanwhile (the holder keeps the kernel state); nothing is
    re-stacked, so the sandbox's mount is the same one and its process never notices.
    """
    mountpoint = Path(report.host["mountpoint"])
    before = mounts.client.health() or {}
    fetched = mounts.client.request("GET", "/stats")["bytes_fetched"]
    argv = in_sandbox(mountpoint, "/bin/sh", "-c", "find / -xdev -type f -exec cat {} + | wc -c")
    started = time.perf_counter()
    reader = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        time.sleep(0.05)
        os.kill(int(before["pid"]), signal.SIGKILL)
        killed = time.perf_counter() - started
        with interrupts_held():
            restacked = mounts.remount()  # starts the successor: it takes the mounts over
        out, err = reader.communicate(timeout=COMMAND_TIMEOUT)
    except BaseException:
        _stop_group(reader)
        raise
    seconds = report.step_seconds["restart"] = time.perf_counter() - started
    after = mounts.client.health() or {}
    if reader.returncode != 0 or restacked or after.get("generation") != before.get("generation"):
        raise DemoError(f"daemon restart under a reader: exit {reader.returncode}, {restacked} layer(s) "
                        f"re-stacked, generation {before.get('generation')} -> {after.get('generation')}: "
                        f"{err.decode(errors='replace')[-400:]}")
    now = mounts.client.request("GET", "/stats")["bytes_fetched"]
    report.host["restart"] = {"killed_at": round(killed, 6), "seconds": round(seconds, 6),
                              "bytes_read": int(out.split()[0]), "bytes_fetched": now}
    say(f"restart   {seconds:8.3f} s  daemon SIGKILLed {killed * 1000:.0f} ms into reading every file of the "
        f"image ({int(out.split()[0]) / MB:.1f} MB); pid {before.get('pid')} -> {after.get('pid')}, "
        f"same mounts, nothing re-stacked, reader never saw an error; fetched {(now - fetched) / MB:.1f} MB more")


def write_in_image(mounts: HostMounts, resolved: Resolved, report: Report, say: Say) -> None:
    """A write inside the sandbox lands in the host-local upper dir; the layer is untouched."""
    mountpoint, upper = Path(report.host["mountpoint"]), Path(report.host["upper"])
    script = f"printf %s {shlex.quote(WRITE_TEXT)} > {shlex.quote(WRITE_PATH)}"
    ran = run(in_sandbox(mountpoint, "/bin/sh", "-c", script), timeout=COMMAND_TIMEOUT)
    report.step_seconds["write"] = ran.seconds
    rel = WRITE_PATH.lstrip("/")
    landed = upper / rel
    if not landed.is_file() or landed.read_text() != WRITE_TEXT:
        raise DemoError(f"{WRITE_PATH} written in {mountpoint} is not in the upper dir {landed}")
    layers = mounts.status()["layers"]
    in_layer = [
        info["mountpoint"]
        for layer in resolved.layers
        if (info := layers.get(hex_digest(layer.digest))) and Path(info["mountpoint"], rel).exists()
    ]
    if in_layer:
        raise DemoError(f"{WRITE_PATH} appeared in the read-only layer mount {in_layer[0]}")
    entries = sorted(
        str(p.relative_to(upper)) + ("/" if p.is_dir() else "") for p in upper.rglob("*")
    )
    report.write = {
        "path": WRITE_PATH,
        "upper_path": str(landed),
        "bytes": len(WRITE_TEXT),
        "upper_entries": entries,
    }
    say(
        f"write     {ran.seconds:8.3f} s  {WRITE_PATH} ({len(WRITE_TEXT)} bytes) inside the sandbox"
    )
    say(f"            -> {landed}; the layer does not have it")
    say(f"            upper dir now holds: {', '.join(entries)}")


def checkpoint_and_restore(
    mounts: HostMounts, resolved: Resolved, report: Report, say: Say
) -> None:
    """Checkpoint the sandbox's writes, restore them on a second fresh host, read them back.

    The second host has its own data dir, daemon and empty cache, like another
    machine sharing the store; it is taken down again before this returns.
    """
    from snapshots.checkpoint import Snapshots

    mountpoint = report.host["mountpoint"]
    store_url = report.store
    second = mounts.data_dir.with_name(mounts.data_dir.name + "-restore")
    if second.exists():
        HostMounts(second, store_url).umount_all(stop_daemon=True)
        shutil.rmtree(second, ignore_errors=True)
    target = second / "rootfs"
    target.mkdir(parents=True)

    async def take() -> Any:
        async with await Store.open(store_url, mounts.data_dir) as store:
            return await Snapshots(store, mounts).checkpoint(mountpoint, labels={"demo": "1"})

    started = time.perf_counter()
    ckpt = run_blocking(take())
    say(f"checkpoint {ckpt.seconds:7.3f} s  {ckpt.name} -> {ckpt.digest[:23]}...: {ckpt.entries} entries, "
        f"{ckpt.bytes_changed} bytes changed, {ckpt.bytes_uploaded / 1024:.1f} KiB uploaded, "
        f"frozen {ckpt.freeze_seconds * 1000:.1f} ms")
    host2 = HostMounts(second, store_url)

    async def bring_back() -> Any:
        async with await Store.open(store_url, second) as store:
            return await Snapshots(store, host2).restore(ckpt.name, str(target))

    try:
        restore_started = time.perf_counter()
        restored = run_blocking(bring_back())
        ran = run(in_sandbox(target, "/bin/cat", WRITE_PATH), timeout=COMMAND_TIMEOUT)
        restore_seconds = time.perf_counter() - restore_started
        if ran.stdout != WRITE_TEXT:
            raise DemoError(f"restored {WRITE_PATH} reads {ran.stdout!r}, expected {WRITE_TEXT!r}")
        stats = host2.client.request("GET", "/stats")
        say(f"restore   {restore_seconds:8.3f} s  on a second fresh host {second}: "
            f"{WRITE_PATH} reads back {len(ran.stdout)} bytes; fetched {stats['bytes_fetched'] / MB:.1f} MB")
        report.checkpoint = {
            **ckpt.to_json(), "restore_host": str(second), "restore_seconds": round(restore_seconds, 6),
            "restore_mount_seconds": restored.seconds, "restore_bytes_fetched": stats["bytes_fetched"],
        }
        report.step_seconds["checkpoint"] = ckpt.seconds
        report.step_seconds["restore"] = restore_seconds
    finally:
        host2.umount_all(stop_daemon=True)
        report.step_seconds.setdefault("checkpoint", time.perf_counter() - started)


def clean_up(mounts: HostMounts, root: Path, report: Report, say: Say) -> list[str]:
    """Unmount the user mount and the layers, stop the daemon; return what went wrong.

    Runs after failures too, so it keeps going past an error and reports them all.
    """
    started = time.perf_counter()
    problems: list[str] = []
    host = mounts.data_dir
    mountpoint = Path(report.host["mountpoint"])
    if kmount.is_mountpoint(mountpoint):
        try:
            mounts.umount(mountpoint)
        except (LayerboxError, OSError) as exc:
            problems.append(f"umount {mountpoint}: {exc}")
    try:
        mounts.umount_all(stop_daemon=True)
    except (LayerboxError, OSError) as exc:
        problems.append(f"umount_all: {exc}")
    for mp in kmount.mounts_under(host):  # e.g. a mount its state never learnt about
        problems.append(f"{mp} was still mounted; detached it")
        kmount.umount(mp, lazy=True, missing_ok=True)
    report.left_mounted = kmount.mounts_under(root)
    problems += [f"{mp} is still mounted" for mp in report.left_mounted]
    seconds = report.step_seconds["cleanup"] = time.perf_counter() - started
    if not report.left_mounted:
        say(f"cleanup   {seconds:8.3f} s  unmounted, daemon stopped; nothing mounted under {root}")
    return problems


def lazy_run(mounts: HostMounts, root: Path, report: Report, say: Say) -> None:
    """Resolve, start the daemon, mount, run, write; always take it all down again."""
    resolved = resolve_image(report.store, mounts.data_dir, report, say)
    ok = False
    try:
        start_daemon(mounts, report.store, report, say)
        mount_image(mounts, resolved, report, say)
        run_in_image(report, say)
        fetch_stats(mounts, report, say)
        write_in_image(mounts, resolved, report, say)
        restart_under_a_reader(mounts, report, say)
        checkpoint_and_restore(mounts, resolved, report, say)
        ok = True
    finally:  # also on Ctrl-C and failed steps: a leaked mount outlives the demo
        with interrupts_held():
            problems = clean_up(mounts, root, report, say)
        if problems and ok:
            raise DemoError("cleanup: " + "; ".join(problems))
        for problem in problems:  # an earlier error is on its way out: keep it the headline
            print(f"layerbox demo: cleanup: {problem}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def two_fresh_hosts(root: Path, store_url: str, names: tuple[str, str], what: str) -> Iterator[tuple[Any, Any]]:
    """Two sandbox managers on fresh data dirs (what a killed demo left there taken down first),
    closed however the block ends, with nothing left mounted under them."""
    from sandbox.host.manager import SandboxManager

    hosts = [root / name for name in names]
    for path in hosts:
        if path.exists():
            SandboxManager(path, store_url).reconcile()
            SandboxManager(path, store_url).close()
            shutil.rmtree(path, ignore_errors=True)
    first, second = SandboxManager(hosts[0], store_url), SandboxManager(hosts[1], store_url)
    try:
        yield first, second
    finally:
        with interrupts_held():
            for mgr in (first, second):
                mgr.close()
        for path in hosts:
            if left := kmount.mounts_under(path):
                raise DemoError(f"{what} cleanup left mounts: {', '.join(left)}")


def sandbox_run(root: Path, store_url: str, report: Report, say: Say) -> None:
    """The same image as crun sandboxes: create to first command (cold, then warm), write,
    pause/resume, checkpoint, and restore on a second fresh host; everything is destroyed after."""
    out: dict[str, Any] = {}
    with two_fresh_hosts(root, store_url, ("sandbox-host", "sandbox-host-restore"), "sandbox") as (first, second):
        started = time.perf_counter()
        box = run_blocking(first.create(IMAGE_NAME, memory=256 << 20, pids=128))
        res = box.exec(list(GUEST_COMMAND))
        out["cold_create_to_first_exec"] = time.perf_counter() - started
        if res.exit_code != 0:
            raise DemoError(f"sandbox {box.id}: {shlex.join(GUEST_COMMAND)} exited {res.exit_code}: "
                            f"{res.stderr.decode(errors='replace')}")
        say(f"sandbox   {out['cold_create_to_first_exec']:8.3f} s  crun sandbox {box.id} created on a fresh host "
            f"and ran {shlex.join(GUEST_COMMAND)} (cold: daemon start and layer mounts included)")
        started = time.perf_counter()
        warm = run_blocking(first.create(IMAGE_NAME, memory=256 << 20, pids=128))
        warm.exec(["true"])
        out["warm_create_to_first_exec"] = time.perf_counter() - started
        say(f"sandbox   {out['warm_create_to_first_exec']:8.3f} s  a second sandbox {warm.id} to its first command "
            "(layers already mounted)")
        warm.destroy()
        box.exec(["/bin/sh", "-c", f"printf %s {shlex.quote(WRITE_TEXT)} > {shlex.quote(WRITE_PATH)}"])
        paused = time.perf_counter()
        box.pause()
        out["pause"] = time.perf_counter() - paused
        resumed = time.perf_counter()
        box.resume()
        out["resume"] = time.perf_counter() - resumed
        say(f"pause     {out['pause']:8.3f} s  frozen and page cache reclaimed; resume {out['resume']:.3f} s")
        ckpt = run_blocking(box.checkpoint(labels={"demo": "sandbox"}))
        out["checkpoint"] = ckpt.to_json()
        say(f"checkpoint {ckpt.seconds:7.3f} s  of the running sandbox (frozen {ckpt.freeze_seconds * 1000:.1f} ms, "
            f"{ckpt.bytes_uploaded / 1024:.1f} KiB uploaded) -> {ckpt.name}")
        restored, out["restore_to_first_exec"] = restore_reads_back(second, ckpt.name, WRITE_PATH, "sandbox")
        fetched = second.host.client.request("GET", "/stats")["bytes_fetched"]
        out["restore_bytes_fetched"] = fetched
        say(f"restore   {out['restore_to_first_exec']:8.3f} s  sandbox {restored.id} on a second fresh host reads "
            f"{WRITE_PATH} back; that host fetched {fetched / MB:.1f} MB from the store")
        out["receipts"] = len(box.receipts())
        out["sdk"] = run_blocking(sdk_run(first, say))
        out["e2b"] = run_blocking(e2b_run(first, say))
    report.sandbox = out
    for step, key in (("sandbox_cold", "cold_create_to_first_exec"), ("sandbox_warm", "warm_create_to_first_exec"),
                      ("sandbox_restore", "restore_to_first_exec")):
        report.step_seconds[step] = out[key]


def restore_reads_back(host: Any, ref: str, path: str, what: str) -> tuple[Any, float]:
    """Restore checkpoint ``ref`` on ``host`` and read ``path`` in the new sandbox: it and the
    seconds to that read; a DemoError unless it reads WRITE_TEXT."""
    started = time.perf_counter()
    box = run_blocking(host.restore(ref))
    back = box.exec(["/bin/cat", path])
    seconds = time.perf_counter() - started
    if back.stdout.decode() != WRITE_TEXT:
        raise DemoError(f"{what} {box.id} restored from {ref} reads {back.stdout!r} at {path}")
    return box, seconds


def microvm_run(root: Path, store_url: str, report: Report, say: Say) -> None:
    """The same image as QEMU microVMs: the first on a host boots its template, the next
    restores it; a write, a checkpoint of the VM's disk, and a restore on a second fresh host."""
    from sandbox.core.model import SandboxOptions

    with two_fresh_hosts(root, store_url, ("microvm-host", "microvm-host-restore"), "microvm") as (first, second):
        caps = first.backend("microvm").capabilities("microvm").to_json()
        if not caps["available"]:
            say(f"microvm   skipped: {caps['reason']}")
            report.microvm = {"skipped": caps["reason"]}
            return
        options = SandboxOptions(isolation="microvm", memory=256 << 20, disk=256 << 20)
        out: dict[str, Any] = {"accel": caps["accel"], "qemu": caps["qemu"], "guest_assets": caps["guest_assets"]}
        started = time.perf_counter()
        box = run_blocking(first.create(IMAGE_NAME, options))
        res = box.exec(list(GUEST_COMMAND))
        out["cold_create_to_first_exec"] = time.perf_counter() - started
        if res.exit_code != 0:
            raise DemoError(f"microvm {box.id}: {shlex.join(GUEST_COMMAND)} exited {res.exit_code}: "
                            f"{res.stderr.decode(errors='replace')}")
        made = box.receipts()[0].get("template_source")
        out["template_source"] = made
        how = {"boot": "booted its template (and published it)", "store": "mapped its template from the store",
               "host": "restored this host's template"}.get(str(made), f"template: {made}")
        say(f"microvm   {out['cold_create_to_first_exec']:8.3f} s  microVM {box.id} ({caps['accel']}, QEMU "
            f"{caps['qemu']}) {how} and ran {shlex.join(GUEST_COMMAND)} in guest kernel "
            f"{box.exec(['uname', '-r']).stdout.decode().strip()}")
        started = time.perf_counter()
        warm = run_blocking(first.create(IMAGE_NAME, options))
        warm.exec(["true"])
        out["warm_create_to_first_exec"] = time.perf_counter() - started
        say(f"microvm   {out['warm_create_to_first_exec']:8.3f} s  a second microVM {warm.id} restored from the "
            "template to its first command")
        warm.destroy()
        box.exec(["/bin/sh", "-c", f"printf %s {shlex.quote(WRITE_TEXT)} > {shlex.quote(WRITE_PATH)}"])
        ckpt = run_blocking(box.checkpoint(labels={"demo": "microvm"}))
        out["checkpoint"] = ckpt.to_json()
        say(f"checkpoint {ckpt.seconds:7.3f} s  of the microVM's disk (stopped {ckpt.freeze_seconds * 1000:.1f} ms, "
            f"{ckpt.bytes_uploaded / 1024:.1f} KiB uploaded) -> {ckpt.name}")
        restored, out["restore_to_first_exec"] = restore_reads_back(second, ckpt.name, WRITE_PATH, "microVM")
        out["restore_bytes_fetched"] = second.host.client.request("GET", "/stats")["bytes_fetched"]
        source = next(r for r in restored.receipts() if r["action"] == "restore" and not r.get("inherited"))
        say(f"restore   {out['restore_to_first_exec']:8.3f} s  microVM {restored.id} on a second fresh host "
            f"(template: {source.get('template_source')}) reads {WRITE_PATH} back; that host fetched "
            f"{out['restore_bytes_fetched'] / MB:.1f} MB (its daemon's background fill included)")
        restored.destroy()
        # memory too: what only the guest's RAM holds (a tmpfs) comes back on the other host
        box.exec(["/bin/sh", "-c", f"printf %s {shlex.quote(WRITE_TEXT)} > /dev/shm/demo"])
        mem = run_blocking(box.checkpoint(labels={"demo": "microvm"}, memory=True))
        out["memory_checkpoint"] = mem.to_json()
        say(f"checkpoint {mem.seconds:7.3f} s  of the microVM's disk and memory (stopped "
            f"{mem.freeze_seconds * 1000:.0f} ms, {mem.bytes_changed / MB:.1f} MB captured, "
            f"{mem.bytes_uploaded / MB:.1f} MB uploaded: the rest are its template's chunks)")
        before = second.host.client.request("GET", "/stats")["bytes_fetched"]
        moved, out["memory_restore_to_first_exec"] = restore_reads_back(second, mem.name, "/dev/shm/demo", "microVM")
        out["memory_restore_bytes_fetched"] = second.host.client.request("GET", "/stats")["bytes_fetched"] - before
        say(f"restore   {out['memory_restore_to_first_exec']:8.3f} s  microVM {moved.id} from that memory on the "
            f"second host: its RAM file /dev/shm/demo is back ({out['memory_restore_bytes_fetched'] / MB:.1f} MB "
            "fetched)")
        # the same image in a full VM (q35: PCI devices, SeaBIOS), its own template
        started = time.perf_counter()
        full = run_blocking(first.create(IMAGE_NAME, options.replace(isolation="vm")))
        pci = full.exec(["/bin/sh", "-c", "ls /sys/bus/pci/devices | wc -l"]).stdout.decode().strip()
        out["full_vm_create_to_first_exec"] = time.perf_counter() - started
        made = full.receipts()[0].get("template_source")
        say(f"full VM   {out['full_vm_create_to_first_exec']:8.3f} s  q35 VM {full.id} (template: {made}) sees {pci} "
            "PCI devices")
        full.destroy()
    report.microvm = out
    for step, key in (("microvm_cold", "cold_create_to_first_exec"), ("microvm_warm", "warm_create_to_first_exec"),
                      ("microvm_restore", "restore_to_first_exec"),
                      ("microvm_memory_restore", "memory_restore_to_first_exec"),
                      ("full_vm_create", "full_vm_create_to_first_exec")):
        report.step_seconds[step] = out[key]


async def sdk_run(manager: Any, say: Say) -> dict[str, float]:
    """The edge service on 127.0.0.1 over ``manager`` with a ready pool of the image, as an agent
    framework sees it through the SDK: create to the first command's exit (a ready sandbox
    adopted), a background command, and a fork of 2 that reads the source's file."""
    import secrets

    from sandbox.edge.app import AuthConfig, SandboxService
    from sandbox.edge.caps import ProjectCaps
    from sandbox.sdk import AsyncSandbox, LimitExceeded

    token = secrets.token_hex(16)
    # two commands at once per project: the third is refused, never queued behind them
    service = SandboxService(manager, AuthConfig.from_dict({"projects": {"demo": {"tokens": [token],
                                                                                  "max_sandboxes": 4}}}),
                             ready={IMAGE_NAME: 1}, caps=ProjectCaps(commands=2))
    out: dict[str, float] = {}
    async with _serving(service) as url:
        for pool in service.context.ready_pools.values():
            await pool.full()
        started = time.perf_counter()
        async with await AsyncSandbox.create(IMAGE_NAME, url=url, token=token, memory=256 << 20) as sb:
            res = await sb.commands.run(list(GUEST_COMMAND))
            out["ready_create_to_first_exit"] = time.perf_counter() - started
            if res.exit_code != 0:
                raise DemoError(f"sdk: sandbox {sb.sandbox_id}: {shlex.join(GUEST_COMMAND)} exited {res.exit_code}")
            adopted = any(r.details.get("ready") for r in await sb.receipts())
            say(f"sdk       {out['ready_create_to_first_exit']:8.3f} s  create to first exit through the edge "
                f"service and the SDK ({'a ready sandbox adopted' if adopted else 'a new sandbox'})")
            started = time.perf_counter()
            server = await sb.commands.run("sleep 600", background=True)
            listed = [c.id for c in await sb.commands.list()]
            if server.id not in listed:
                await server.kill()
                raise DemoError(f"sdk: background command {server.id} is not in the sandbox's list {listed}")
            out["background"] = time.perf_counter() - started
            say(f"sdk       {out['background']:8.3f} s  a background command {server.id} started and listed")
            second = await sb.commands.run("sleep 600", background=True)
            started = time.perf_counter()
            try:
                await sb.commands.run("true")
                refused = None
            except LimitExceeded as exc:
                refused = exc
            out["cap_refusal"] = time.perf_counter() - started
            await server.kill()
            await second.kill()
            if refused is None or refused.code != "project_limit" or not refused.retryable:
                raise DemoError(f"sdk: a third command beside two was not refused by the project's cap: {refused!r}")
            say(f"sdk       {out['cap_refusal']:8.3f} s  a third command at the project's cap of 2: {refused.status} "
                f"{refused.code} ({', '.join(refused.resources)}), retryable; both killed")
            await sb.files.write(WRITE_PATH, WRITE_TEXT)
            started = time.perf_counter()
            forked = await sb.fork(2)
            out["fork_2"] = time.perf_counter() - started
            try:
                seen = {await f.files.read(WRITE_PATH) for f in forked.sandboxes}
            finally:
                for f in forked.sandboxes:
                    await f.kill()
            if seen != {WRITE_TEXT}:
                raise DemoError(f"sdk: the forks read {seen} at {WRITE_PATH}")
            say(f"sdk       {out['fork_2']:8.3f} s  sb.fork(2): two sandboxes continuing from its files")
    return out


@contextlib.asynccontextmanager
async def _serving(service: Any) -> AsyncIterator[str]:
    """``service`` on 127.0.0.1 (a port of its own) for the block: its URL."""
    from aiohttp import web

    runner = web.AppRunner(service.app())
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def e2b_run(manager: Any, say: Say) -> dict[str, float]:
    """The same edge service as the stock ``e2b`` SDK sees it (its async client, configured with
    only a key and the edge's URL): the image as a template, create to the first command's output,
    a file written and read back through envd's routes, and the sandbox killed."""
    import secrets

    from e2b import AsyncSandbox as E2bSandbox

    from sandbox.edge.app import AuthConfig, SandboxService

    token = secrets.token_hex(16)
    service = SandboxService(manager, AuthConfig.from_dict({"projects": {"demo": {"tokens": [token],
                                                                                  "max_sandboxes": 4}}}))
    out: dict[str, float] = {}
    async with _serving(service) as url:
        started = time.perf_counter()
        sb = await E2bSandbox.create(IMAGE_NAME, timeout=120, allow_internet_access=False, api_key=token,
                                     api_url=url, sandbox_url=url)
        try:
            res = await sb.commands.run(shlex.join(GUEST_COMMAND))
            out["create_to_first_output"] = time.perf_counter() - started
            if "ID=" not in res.stdout:
                raise DemoError(f"e2b: sandbox {sb.sandbox_id}: {shlex.join(GUEST_COMMAND)} printed {res.stdout!r}")
            who = (await sb.commands.run("id -un")).stdout.strip()
            say(f"e2b       {out['create_to_first_output']:8.3f} s  create to first output through the stock e2b "
                f"SDK (E2B's REST API and envd's Connect process service on the edge; runs as {who!r}: "
                "the image has no E2B account 'user')")
            started = time.perf_counter()
            await sb.files.write(WRITE_PATH, WRITE_TEXT)
            back = await sb.files.read(WRITE_PATH)
            out["file_round_trip"] = time.perf_counter() - started
            if back != WRITE_TEXT:
                raise DemoError(f"e2b: read back {back!r} from {WRITE_PATH}")
            say(f"e2b       {out['file_round_trip']:8.3f} s  files.write and files.read of {WRITE_PATH}")
        finally:
            await sb.kill()
    return out


# --- output ---------------------------------------------------------------------------


def _api(method: str, url: str, token: str, body: Any = None) -> tuple[int, Any]:
    """One JSON request to a layerbox API: (status, decoded answer); HTTP errors are answers."""
    req = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    lines = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
    return status, lines[0] if len(lines) == 1 else lines


def fleet_run(root: Path, store_url: str, report: Report, say: Say) -> None:
    """A fleet on this machine (PostgreSQL, one gateway, two edges): a create placed on each edge,
    a command routed through the gateway by sandbox id, and the project's fleet quota refusing a third."""
    from sandbox.fleet import local

    where = root / "fleet"
    local.down(where)  # what an interrupted demo left
    started = time.perf_counter()
    state = local.up(local.Spec(where, store_url, {"default": 2}, gateways=1, max_sandboxes=2))
    out: dict[str, Any] = {"up": time.perf_counter() - started}
    try:
        gateway, token = state["gateways"][0]["url"], state["project"]["token"]
        say(f"fleet     {out['up']:8.3f} s  up: PostgreSQL, gateway {gateway}, edges "
            + ", ".join(e["id"] for e in state["edges"]) + " (layerbox fleet up)")
        placed, firsts = [], []
        for _ in range(2):
            begun = time.perf_counter()
            status, box = _api("POST", gateway + "/v1/sandboxes", token, {"image": IMAGE_NAME, "memory": 256 << 20})
            if status != 201:
                raise DemoError(f"fleet: a create through the gateway answered {status}: {box}")
            status, events = _api("POST", f"{gateway}/v1/sandboxes/{box['id']}/exec", token,
                                  {"cmd": "cat /etc/hostname"})
            firsts.append(time.perf_counter() - begun)
            if status != 200 or events[-1].get("exit_code") != 0:
                raise DemoError(f"fleet: a command routed to {box['id']} answered {status}: {events}")
            placed.append(box["id"])
        edges = {e["id"]: e for e in state["edges"]}
        on = {sid: next((name for name, e in edges.items() if sid in _edge_ids(where, e)), "?") for sid in placed}
        out.update(create_to_first_exec=firsts, placed=on)
        say(f"fleet     {min(firsts):8.3f} s  create to first command through the gateway (best of 2); placed "
            + ", ".join(f"{sid} on {edge}" for sid, edge in on.items()))
        status, refused = _api("POST", gateway + "/v1/sandboxes", token, {"image": IMAGE_NAME})
        code = refused.get("error", {}).get("code") if isinstance(refused, dict) else None
        if status != 429 or code != "quota_exceeded":
            raise DemoError(f"fleet: a third create past the project's fleet quota of 2 answered {status}: {refused}")
        out["quota_refusal"] = code
        say("fleet              a third create refused: 429 quota_exceeded (the project's quota holds fleet-wide)")
        for sid in placed:
            _api("DELETE", f"{gateway}/v1/sandboxes/{sid}", token)
    finally:
        local.down(where)
    report.fleet = out
    report.step_seconds["fleet_up"] = out["up"]


def _edge_ids(where: Path, edge: dict[str, Any]) -> list[str]:
    """The sandboxes an edge of the demo's fleet runs (its data dir's state: the edge is the truth)."""
    boxes = Path(edge["data_dir"]) / "sandbox" / "boxes"
    return sorted(p.name for p in boxes.iterdir()) if boxes.is_dir() else []


def _mb(n: int) -> str:
    return f"{n / MB:.1f} MB"


def print_summary(report: Report, stream: TextIO) -> None:
    image, pub, fetch, steps = report.image, report.publish, report.fetch, report.step_seconds
    lazy = ("resolve", "daemon", "mount", "first_output")
    to_first = sum(steps[k] for k in lazy)
    share = 100 * fetch["bytes_fetched_uncompressed"] / image["bytes"] if image["bytes"] else 0.0
    lines = [
        "",
        f"image     {image['name']} = {image['digest']}  in {report.store}",
        f"  layers  {len(image['layers'])}: {image['files']} files, {_mb(image['bytes'])} of file data, "
        f"{image['chunks']} chunks (<= {CHUNK_SIZE >> 20} MiB each), metadata {_mb(image['meta_bytes'])}",
        f"  publish new to the store {_mb(pub['bytes_new'])}, already present {_mb(pub['bytes_present'])}"
        + ("  (nothing uploaded twice)" if pub["bytes_new"] == 0 else ""),
        f"host      {report.host['data_dir']}",
        f"  start   {to_first:.3f} s from resolve to first output ("
        + ", ".join(f"{k.replace('_', ' ')} {steps[k]:.3f}" for k in lazy)
        + ")",
        f"  fetched {share:.1f} % of the image's data ({_mb(fetch['bytes_fetched_uncompressed'])}; "
        f"{_mb(fetch['bytes_fetched'])} compressed in {fetch['store_requests']} store requests)",
        f"  writes  {report.write['upper_path']}",
        f"  restart the daemon SIGKILLed under a reader of every file: {steps['restart']:.3f} s to the reader's "
        f"end, no error, no re-stack ({report.host['data_path']} data path)",
        f"sandbox   create to first command {steps['sandbox_cold']:.3f} s cold, {steps['sandbox_warm']:.3f} s warm; "
        f"restore on another host {steps['sandbox_restore']:.3f} s "
        f"({_mb(report.sandbox['restore_bytes_fetched'])} fetched)",
        f"sdk       create to first exit {report.sandbox['sdk']['ready_create_to_first_exit']:.3f} s from a ready "
        f"pool, through the edge service; fork of 2 {report.sandbox['sdk']['fork_2']:.3f} s",
        f"e2b       create to first output {report.sandbox['e2b']['create_to_first_output']:.3f} s through the stock "
        f"e2b SDK on the same edge; a file written and read back {report.sandbox['e2b']['file_round_trip']:.3f} s",
        (f"microvm   create to first command {steps['microvm_cold']:.3f} s on a fresh host (template: "
         f"{report.microvm.get('template_source')}), "
         f"{steps['microvm_warm']:.3f} s from the template ({report.microvm.get('accel')}); restore on another host "
         f"{steps['microvm_restore']:.3f} s ({_mb(report.microvm['restore_bytes_fetched'])} fetched), "
         f"with its memory {steps['microvm_memory_restore']:.3f} s"
         if "microvm_cold" in steps else f"microvm   skipped: {report.microvm.get('skipped')}"),
        (f"fleet     up {report.fleet['up']:.2f} s; create to first command through the gateway "
         f"{min(report.fleet['create_to_first_exec']):.3f} s; placed on "
         + ", ".join(sorted(set(report.fleet['placed'].values()))) + "; a third create refused "
         + str(report.fleet["quota_refusal"]) if report.fleet else "fleet     skipped"),
        # first_output is part of command: the total counts it once
        f"total     {sum(v for k, v in steps.items() if k != 'first_output'):.2f} s ("
        + ", ".join(f"{k} {v:.3f}" for k, v in steps.items() if k != "first_output")
        + ")",
    ]
    print("\n".join(lines), file=stream, flush=True)


# --- entry point ----------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="layerbox demo",
        description=(
            "Publish a Debian 12 minbase image to the demo's own store, mount it lazily and "
            "writable on a fresh host dir, run `cat /etc/os-release` inside it and write a "
            "file, checkpoint and restore it; then the same as crun sandboxes (root)."
        ),
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object (progress goes to stderr)"
    )
    parser.add_argument(
        "--rebuild", action="store_true", help="rebuild the cached sample image with mmdebstrap"
    )
    return parser.parse_args(argv)


def demo(data: Path, *, rebuild: bool, say: Say) -> Report:
    preflight(data, rebuild=rebuild)
    say(f"layerbox demo  (data dir {data})")
    root = data / "demo"
    with exclusive(root):
        sample = ensure_sample(data, rebuild=rebuild, say=say)
        report = Report(data_dir=str(data), sample=sample)
        if sample.build_seconds is not None:
            report.step_seconds["build"] = sample.build_seconds
        remove_old_demo_layer(root, say)
        report.store = f"file://{root / 'store'}"
        say(f"store     {report.store}  (the demo's own; your default store is not touched)")
        publish_sample(sample, report.store, root, report, say)
        host = fresh_host(root, report.store, say)
        report.host = {
            "data_dir": str(host),
            "mountpoint": str(host / "rootfs"),
            "upper": str(host / "upper"),
        }
        lazy_run(HostMounts(host, report.store), root, report, say)
        sandbox_run(root, report.store, report, say)
        microvm_run(root, report.store, report, say)
        fleet_run(root, report.store, report, say)
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    say: Say = functools.partial(print, file=sys.stderr if args.json else sys.stdout, flush=True)
    try:
        with sigterm_as_interrupt():
            report = demo(default_data_dir(), rebuild=args.rebuild, say=say)
    except KeyboardInterrupt:
        print("layerbox demo: interrupted", file=sys.stderr)
        return 130
    except (LayerboxError, OSError) as exc:
        print(f"layerbox demo: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 1)
    if args.json:
        json.dump(asdict(report), sys.stdout, indent=2)
        print()
    else:
        print_summary(report, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
