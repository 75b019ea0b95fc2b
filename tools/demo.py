"""``layerbox demo``: the main job, end to end, on the local embedded store.

Build (once, then cached) a Debian 12 minbase root filesystem as a tar, convert it
into an EROFS layer (metadata image + chunked blob), mount that with the kernel, run
one command inside it through chroot, unmount, and report how long each step took
and what the layer looks like.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

from converters.layer import LayerResult, convert_stream
from layerstore.errors import LayerboxError
from lazyfetch import kmount

SUITE = "bookworm"
SAMPLE_NAME = f"debian-{SUITE}-minbase"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
CHUNK_SIZE = 1 << 20
GUEST_COMMAND = ("/bin/cat", "/etc/os-release")

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


# Prints one progress line; each step reports as it finishes so a slow build is visible.
Say = Callable[[str], None]


class DemoError(LayerboxError):
    """A demo step failed; the message says which and, where possible, what to do."""


# --- subprocesses ---------------------------------------------------------------------


def run(argv: list[str], *, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` with captured output; raise :class:`DemoError` unless it exits 0.

    The child leads its own process group so that a timeout or Ctrl-C stops everything
    it started (mmdebstrap runs apt and dpkg below it).  stdin is /dev/null because
    mmdebstrap reads sources.list lines from a stdin that is not a terminal.
    """
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    except FileNotFoundError:
        raise DemoError(f"{argv[0]}: command not found (run `make deps`)") from None
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop_group(proc)
        raise DemoError(f"`{shlex.join(argv)}` timed out after {timeout:.0f} s") from None
    except BaseException:  # Ctrl-C included: never leave the child running
        _stop_group(proc)
        raise
    if proc.returncode != 0:
        detail = _tail(err or out)
        raise DemoError(f"`{shlex.join(argv)}` exited with {proc.returncode}: {detail}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _stop_group(proc: subprocess.Popen[str]) -> None:
    for sig, wait in ((signal.SIGTERM, TERM_GRACE), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.communicate(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(text: str, lines: int = 8) -> str:
    kept = [line for line in text.strip().splitlines() if line.strip()][-lines:]
    return " | ".join(kept) if kept else "(no output)"


# --- locations ------------------------------------------------------------------------


def data_dir() -> Path:
    """Where layerbox keeps state: $LAYERBOX_DATA_DIR, /var/lib/layerbox as root,
    ~/.local/share/layerbox otherwise."""
    if env := os.environ.get("LAYERBOX_DATA_DIR"):
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/lib/layerbox")
    return Path.home() / ".local" / "share" / "layerbox"


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
    step_seconds: dict[str, float] = field(default_factory=dict)
    layer: dict[str, Any] = field(default_factory=dict)
    command: list[str] = field(default_factory=list)
    output: str = ""


def sample_path(data: Path) -> Path:
    return data / "samples" / f"{SAMPLE_NAME}.tar"


def preflight(data: Path, *, rebuild: bool) -> None:
    """Fail before doing anything slow, with the reason and the fix."""
    if os.geteuid() != 0:
        raise DemoError(
            "the demo mounts an EROFS image with mount(2) and needs root: run `sudo make demo`"
        )
    if not _kernel_has("erofs"):
        try:
            run(["modprobe", "erofs"], timeout=PROBE_TIMEOUT)
        except DemoError:
            pass  # built-in or absent: /proc/filesystems below has the final word
        if not _kernel_has("erofs"):
            raise DemoError(
                "the kernel has no EROFS support ('erofs' missing from /proc/filesystems "
                "after `modprobe erofs`); it needs CONFIG_EROFS_FS, and Linux 6.12 or newer "
                "for file-backed mounts"
            )
    if _kernel_version() < FILE_BACKED_EROFS:
        # Caught here rather than at mount time, after a build and a conversion.
        raise DemoError(
            f"kernel {platform.release()} cannot mount EROFS images from regular files "
            "(needs Linux 6.12+); on Debian 12 install the bookworm-backports kernel: "
            "apt-get install -t bookworm-backports linux-image-amd64"
        )
    tools = ["unshare", "chroot"]
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


def convert_sample(sample: Sample, out_dir: Path, report: Report, say: Say) -> LayerResult:
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = out_dir / f"{SAMPLE_NAME}.erofs"
    blob = out_dir / f"{SAMPLE_NAME}.blob"
    started = time.perf_counter()
    with open(sample.path, "rb") as src:
        result = convert_stream(src, meta, blob, chunk_size=CHUNK_SIZE, source=sample.path)
    seconds = report.step_seconds["convert"] = time.perf_counter() - started
    rate = sample.bytes / MB / seconds if seconds > 0 else float("inf")
    say(
        f"convert   {seconds:8.3f} s  {rate:.1f} MB/s of tar, {result.files} files -> {result.digest}"
    )
    return result


@contextmanager
def mounted(meta: str, blob: str, mountpoint: Path, report: Report, say: Say) -> Iterator[None]:
    """The layer mounted read-only at ``mountpoint`` for the duration of the block."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    while kmount.is_mountpoint(mountpoint):  # left over by a demo that was killed outright
        kmount.umount(mountpoint, lazy=True)
    started = time.perf_counter()
    kmount.mount_erofs(meta, mountpoint, blob)
    report.step_seconds["mount"] = time.perf_counter() - started
    say(f"mount     {report.step_seconds['mount']:8.3f} s  {mountpoint} (erofs, device={blob})")
    try:
        yield
    finally:  # also on Ctrl-C and failed commands: a leaked mount outlives the demo
        started = time.perf_counter()
        kmount.umount(mountpoint)
        report.step_seconds["unmount"] = time.perf_counter() - started
        say(f"unmount   {report.step_seconds['unmount']:8.3f} s")


def run_in_layer(mountpoint: Path, report: Report, say: Say) -> None:
    # A private mount namespace keeps whatever the command mounts away from the host.
    argv = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "chroot",
        str(mountpoint),
        *GUEST_COMMAND,
    ]
    started = time.perf_counter()
    proc = run(argv, timeout=COMMAND_TIMEOUT)
    report.step_seconds["command"] = time.perf_counter() - started
    report.command = list(GUEST_COMMAND)
    report.output = proc.stdout
    say(f"chroot    {report.step_seconds['command']:8.3f} s  {shlex.join(GUEST_COMMAND)}")
    for line in proc.stdout.splitlines():
        say(f"            {line}")


def layer_stats(result: LayerResult) -> dict[str, Any]:
    return {
        **result.to_json(),
        "meta_bytes": os.stat(result.meta_path).st_size,
        "blob_bytes": os.stat(result.blob_path).st_size,
    }


# --- output ---------------------------------------------------------------------------


def _mb(n: int) -> str:
    return f"{n / MB:.1f} MB"


def print_summary(report: Report, stream: TextIO) -> None:
    layer = report.layer
    dedup = layer["chunks"] / layer["unique_chunks"] if layer["unique_chunks"] else 1.0
    total = sum(report.step_seconds.values())
    lines = [
        "",
        f"layer     {layer['digest']}",
        f"  files   {layer['files']}, {_mb(layer['bytes'])} of file data",
        f"  chunks  {layer['chunks']} (<= {CHUNK_SIZE >> 20} MiB each), {layer['unique_chunks']} unique "
        f"holding {_mb(layer['unique_bytes'])} (dedup x{dedup:.2f})",
        f"  meta    {layer['meta_path']}  {_mb(layer['meta_bytes'])}",
        f"  blob    {layer['blob_path']}  {_mb(layer['blob_bytes'])}  {layer['blob_digest']}",
        f"total     {total:.2f} s ("
        + ", ".join(f"{k} {v:.3f}" for k, v in report.step_seconds.items())
        + ")",
    ]
    print("\n".join(lines), file=stream, flush=True)


# --- entry point ----------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="layerbox demo",
        description=(
            "Convert a Debian 12 minbase image into an EROFS layer, mount it with the kernel "
            "and run `cat /etc/os-release` inside it (root)."
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
    sample = ensure_sample(data, rebuild=rebuild, say=say)
    report = Report(data_dir=str(data), sample=sample)
    if sample.build_seconds is not None:
        report.step_seconds["build"] = sample.build_seconds
    result = convert_sample(sample, data / "demo", report, say)
    report.layer = layer_stats(result)
    mountpoint = data / "demo" / "mnt"
    with mounted(result.meta_path, result.blob_path, mountpoint, report, say):
        run_in_layer(mountpoint, report, say)
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    say: Say = functools.partial(print, file=sys.stderr if args.json else sys.stdout, flush=True)
    try:
        report = demo(data_dir(), rebuild=args.rebuild, say=say)
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
