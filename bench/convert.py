"""Benchmark: layerbox's streaming converter against ``tar -x`` + ``mkfs.erofs``.

For every distinct layer of the inputs, in the same run and on the same disk:

* **layerbox**: ``converters.layer.convert_stream`` from the compressed layer
  file to a metadata image and a blob;
* **native**: what a user runs today, ``tar -x`` of the layer into a directory,
  then ``mkfs.erofs --chunksize=N --blobdev=BLOB META DIR`` (erofs-utils), each
  step also timed on its own;
* **floor**: read and decompress the layer, then blake3-hash and zstd-compress
  (level 3) all of its bytes in 1 MiB pieces on one thread: the least work any
  converter that stores hashed, compressed chunks has to do.

Each method runs ``--repeat`` times per layer (interleaved, with ``sync``
before every timed run so one run's writeback does not land in another's
timing); the median is reported.  The input is read once before timing so it
is in the page cache.  Temporary files live under ``--tmpdir`` (default
/var/tmp, a disk, not tmpfs) and are removed on exit, Ctrl-C or SIGTERM.

Run ``python bench/convert.py --help``; bench/README.md explains every number.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import platform
import re
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, Any, BinaryIO

import blake3
import zstandard

if __package__ in (None, ""):  # run as a script: import the checkout, installed or not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import (  # shared by the benchmarks
    BenchError,
    _f,
    _table,
    emit,
    rate,
    remove_tree,
    workspace,
)

from converters.errors import ConvertError  # noqa: E402
from converters.layer import check_chunk_size, convert_stream  # noqa: E402
from converters.oci import TRANSPORTS, LayerBlob, inspect_image, parse_image_ref  # noqa: E402

SCHEMA = "layerbox.bench.convert.v1"
READ_SIZE = 1 << 20
PIECE = 1 << 20  # floor: bytes hashed and compressed at a time
ZSTD_LEVEL = 3
MB = 1_000_000
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
FIXTURE_NAME = "debian-bookworm.oci.tar"
FIXTURE_TAGS = ("minbase", "python")
TOOL_TIMEOUT = 3600.0
GOAL_NATIVE_RATIO = 1.0  # native_seconds / layerbox_seconds must be at least this
GOAL_FLOOR_RATIO = 3.0  # layerbox_seconds / floor_seconds must be at most this
GOAL_EROFS18_RATIO = 1.0  # layerbox_seconds / erofs-utils 1.8 seconds must be at most this
PEER_SCRIPT = "bench/peers/erofs-utils.sh"
CHECKOUT = Path(__file__).resolve().parents[1]  # `python -m tools.cli` from here runs this checkout
DEFAULT_EROFS18 = Path(os.environ.get("LAYERBOX_PEERS_DIR", "/var/cache/layerbox/peers")) / "erofs-utils-1.8"



# -- inputs --------------------------------------------------------------------


@dataclass
class LayerInput:
    """One distinct layer blob, as stored (compressed), in a file on the bench disk."""

    label: str  # short name for the table: 12 hex of the digest, or the file name
    path: Path
    digest: str  # sha256 of the compressed blob (the OCI digest for image layers)
    compression: str  # "gzip", "zstd" or "tar", sniffed from the magic bytes
    compressed_bytes: int
    used_by: list[str] = field(default_factory=list)  # "REF layer N" or the file path


def sniff(path: Path) -> str:
    with path.open("rb") as f:
        head = f.read(4)
    if head.startswith(GZIP_MAGIC):
        return "gzip"
    if head.startswith(ZSTD_MAGIC):
        return "zstd"
    return "tar"


def _warm_sha256(path: Path) -> str:
    """Read the whole file (so timing starts on a warm page cache); return its sha256."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(READ_SIZE):
            h.update(block)
    return "sha256:" + h.hexdigest()


def _normalise(name: str) -> str:
    return "/".join(p for p in PurePosixPath(name).parts if p not in ("", ".", "/"))


def _copy_members(archive: Path, wanted: dict[str, Path]) -> None:
    """Copy members of an uncompressed tar (an oci-archive or docker-archive) to files."""
    try:
        with tarfile.open(archive, "r:") as tar:
            members = {_normalise(m.name): m for m in tar.getmembers()}
            for name, dest in wanted.items():
                info = members.get(_normalise(name))
                src = tar.extractfile(info) if info is not None else None
                if src is None:
                    raise BenchError(f"{archive}: layer blob {name} is missing from the archive")
                with src, dest.open("wb") as out:
                    shutil.copyfileobj(src, out, READ_SIZE)
    except (tarfile.TarError, OSError) as exc:
        raise BenchError(f"{archive}: cannot read the archive: {exc}") from None


def is_image_ref(text: str) -> bool:
    return text.partition(":")[0] in TRANSPORTS and ":" in text


def resolve_inputs(specs: Sequence[str], workdir: Path, log: Callable[[str], None]) -> list[LayerInput]:
    """Turn image references and tarball paths into distinct, verified, warm layer files.

    Layers that appear several times (shared by two tags, or repeated) are kept
    once, in order of first appearance.
    """
    layers: dict[str, LayerInput] = {}
    blobs = workdir / "inputs"
    blobs.mkdir()
    for spec in specs:
        if is_image_ref(spec):
            try:
                source = parse_image_ref(spec)
                if source.path is None:  # a registry: the benchmark reads local files only
                    raise BenchError(
                        f"{spec}: not a local image; copy it first (skopeo copy {spec} "
                        "oci-archive:IMAGE.tar:TAG) and pass oci-archive:IMAGE.tar:TAG"
                    )
                image = inspect_image(spec)
            except ConvertError as exc:
                raise BenchError(str(exc)) from None
            copies: dict[str, Path] = {}
            fresh: list[LayerBlob] = []
            for number, blob in enumerate(image.layers, start=1):
                where = f"{spec} layer {number}"
                if blob.digest in layers:
                    layers[blob.digest].used_by.append(where)
                    continue
                if source.transport == "oci":
                    path = source.path / blob.path
                else:
                    path = blobs / blob.digest.replace(":", "-")
                    copies[blob.path] = path
                layers[blob.digest] = LayerInput(
                    label=blob.digest.partition(":")[2][:12], path=path, digest=blob.digest,
                    compression="", compressed_bytes=0, used_by=[where],
                )
                fresh.append(blob)
            if copies:
                log(f"extracting {len(copies)} layer blob(s) from {source.path}")
                _copy_members(source.path, copies)
            for blob in fresh:
                layer = layers[blob.digest]
                if not layer.path.is_file():
                    raise BenchError(f"{spec}: layer blob {blob.path} is missing")
                actual = _warm_sha256(layer.path)
                if blob.digest.startswith("sha256:") and actual != blob.digest:
                    raise BenchError(f"{spec}: layer {blob.digest} hashes to {actual}; the image is corrupt")
                layer.compression = sniff(layer.path)
                layer.compressed_bytes = layer.path.stat().st_size
        else:
            path = Path(spec)
            if not path.is_file():
                raise BenchError(
                    f"{spec!r} is neither an image reference (oci:DIR[:TAG], oci-archive:FILE[:TAG], "
                    "docker-archive:FILE[:REF]) nor a .tar/.tar.gz/.tar.zst file"
                )
            digest = _warm_sha256(path)
            if digest in layers:
                layers[digest].used_by.append(spec)
                continue
            layers[digest] = LayerInput(
                label=path.name if len(path.name) <= 24 else path.name[:12], path=path, digest=digest, compression=sniff(path),
                compressed_bytes=path.stat().st_size, used_by=[spec],
            )
    return list(layers.values())


def default_inputs() -> list[str]:
    here = Path(__file__).resolve().parents[1]
    for fixtures in (here.parent / "shared" / "fixtures", Path("/work/shared/fixtures")):
        archive = fixtures / FIXTURE_NAME
        if archive.is_file():
            return [f"oci-archive:{archive}:{tag}" for tag in FIXTURE_TAGS]
    raise BenchError(
        "no inputs given and the fixture image (../shared/fixtures/"
        f"{FIXTURE_NAME}) is not here: pass --image oci-archive:PATH:TAG (or oci:DIR:TAG, "
        "docker-archive:PATH), or the path of a .tar/.tar.gz/.tar.zst layer"
    )


# -- external tools ------------------------------------------------------------


def run_tool(
    argv: Sequence[str | os.PathLike[str]], timeout: float = TOOL_TIMEOUT,
    stdin_from: Sequence[str | os.PathLike[str]] | None = None, cwd: Path | None = None,
) -> str:
    """Run a command; return its stdout.  The whole process group dies with us.

    The child gets its own session so that ``tar``'s decompressor child is
    killed too when the benchmark is interrupted or the command times out.
    ``stdin_from``: a producer whose stdout is the command's stdin (``zstd -dc
    LAYER | mkfs.erofs ...``); the two share a new process group (not a new
    session: a group can only be joined within its session); both must succeed.
    """
    args = [os.fspath(a) for a in argv]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        stdin: int | IO[bytes] | None = subprocess.DEVNULL
        if stdin_from is not None:
            producer = subprocess.Popen(
                [os.fspath(a) for a in stdin_from], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, process_group=0,  # a group of its own the command then joins
            )
            procs.append(producer)
            stdin = producer.stdout
        proc = subprocess.Popen(
            args, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
            process_group=procs[0].pid if procs else None, start_new_session=not procs,
        )
        procs.append(proc)
        if procs[0] is not proc and procs[0].stdout is not None:
            procs[0].stdout.close()  # the command holds the pipe now; EPIPE reaches the producer
    except OSError as exc:
        for started in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(started.pid, signal.SIGKILL)
            started.wait()
        raise BenchError(f"cannot run {exc.filename or args[0]}: {exc.strerror}") from None
    try:
        out, err = proc.communicate(timeout=timeout)
        if procs[0] is not proc:
            _, perr = procs[0].communicate(timeout=timeout)
            err += perr
    except BaseException as exc:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(procs[0].pid, signal.SIGKILL)
        for started in procs:
            started.wait()
        if isinstance(exc, subprocess.TimeoutExpired):
            raise BenchError(f"{shlex.join(args)} ran longer than {timeout:.0f} s; killed") from None
        raise
    for done in procs:
        if done.returncode != 0:
            tail = err.decode("utf-8", "replace")[-4000:].strip()
            shown = shlex.join(args)
            if stdin_from is not None:
                shown = shlex.join([os.fspath(a) for a in stdin_from]) + " | " + shown
            raise BenchError(f"{shown} failed with exit status {done.returncode}: {tail}")
    return out.decode("utf-8", "replace")


class NativeTools:
    """The native pipeline: GNU ``tar -x`` then ``mkfs.erofs`` from erofs-utils."""

    def __init__(self, chunk_size: int) -> None:
        for program, package in (("tar", "tar"), ("mkfs.erofs", "erofs-utils")):
            if shutil.which(program) is None:
                raise BenchError(f"{program} is not installed: apt-get install {package}")
        self.chunk_size = chunk_size
        self.as_root = os.geteuid() == 0
        self.tar_version = run_tool(["tar", "--version"]).splitlines()[0].strip()
        # erofs-utils 1.5 prints --help on stderr; read both streams
        shown = subprocess.run(["mkfs.erofs", "--help"], capture_output=True, text=True, check=False)
        help_text = shown.stdout + shown.stderr
        for flag in ("--chunksize", "--blobdev"):
            if flag not in help_text:
                raise BenchError(f"this mkfs.erofs has no {flag}: erofs-utils 1.4 or later is needed")
        self.mkfs_extra = ["--preserve-mtime"] if "--preserve-mtime" in help_text else []
        self.mkfs_version = "unknown"

    def probe(self, workdir: Path) -> None:
        """Run mkfs.erofs once on an empty directory: learns its version, fails early."""
        probe = workdir / "probe"
        (probe / "root").mkdir(parents=True)
        out = run_tool(self.mkfs_argv(probe / "root", probe / "meta", probe / "blob", quiet=False))
        m = re.search(r"mkfs\.erofs\s+(\S+)", out)
        if m:
            self.mkfs_version = m.group(1)
        remove_tree(probe)

    def tar_argv(self, layer: Path, compression: str, dest: Path) -> list[str]:
        argv = ["tar", "-x", "-f", str(layer), "-C", str(dest)]
        argv += {"gzip": ["-z"], "zstd": ["--zstd"], "tar": []}[compression]
        if self.as_root:  # restore owners, modes and xattrs: the work a layer converter does
            argv += ["--numeric-owner", "--xattrs", "--xattrs-include=*", "-p"]
        return argv

    def mkfs_argv(self, root: Path, meta: Path, blob: Path, *, quiet: bool = True) -> list[str]:
        argv = ["mkfs.erofs"] + (["--quiet"] if quiet else [])
        argv += [f"--chunksize={self.chunk_size}", f"--blobdev={blob}", *self.mkfs_extra]
        return argv + [str(meta), str(root)]

    def describe(self) -> dict[str, str]:
        tar = shlex.join(self.tar_argv(Path("LAYER"), "tar", Path("DIR")))
        return {
            "tar": tar.replace(" -C DIR", " -C DIR [-z for gzip | --zstd for zstd]"),
            "tar_version": self.tar_version,
            "mkfs": shlex.join(self.mkfs_argv(Path("DIR"), Path("META"), Path("BLOB"))),
            "mkfs_version": self.mkfs_version,
            "mkfs_defaults": "-x2 (xattrs kept), no compression, build-time uuid",
        }


class Erofs18:
    """erofs-utils 1.8's ``mkfs.erofs --tar=f``: the tar stream converted in C, nothing extracted.

    Debian 12 has erofs-utils 1.5 (no ``--tar``); bench/peers/erofs-utils.sh
    unpacks Debian 13's 1.8 with its own loader and libraries under
    ``home``.  Two runs per layer: *chunked* (``--chunksize`` and
    ``--blobdev``, like for like with layerbox: chunk-based files, sha256 per
    chunk for dedup, data in a blob) and *inline* (the command the issue's
    0.78 s was measured with: file data in the image itself, no chunking, no
    hashing, no dedup).
    """

    def __init__(self, home: Path, chunk_size: int) -> None:
        fix = (f"fetch it with 'bash {PEER_SCRIPT}' (as root; 'make bench-peers' runs it), point "
               "--erofs18 at a copy it made, or pass --no-erofs18 to leave this peer out")
        command = home / "command"
        try:
            self.version = (home / "complete").read_text().strip()
            self.prefix = [line for line in command.read_text().splitlines() if line]
            self.packages = (home / "packages").read_text().split()
        except OSError:
            raise BenchError(f"erofs-utils 1.8 is not in {home}: {fix}") from None
        missing = [p for p in (self.prefix[0], self.prefix[-1]) if not Path(p).is_file()]
        if missing:
            raise BenchError(f"erofs-utils 1.8 in {home} is incomplete ({', '.join(missing)} missing): {fix}")
        self.home = home
        self.chunk_size = chunk_size
        shown = subprocess.run([*self.prefix, "--help"], capture_output=True, text=True, check=False)
        help_text = shown.stdout + shown.stderr
        for flag in ("--tar=", "--ungzip", "--aufs", "--chunksize", "--blobdev", "--preserve-mtime", "--quiet"):
            if flag not in help_text:
                raise BenchError(f"{self.prefix[-1]} has no {flag}: not erofs-utils 1.8? {fix}")

    def argv(self, layer: Path, compression: str, meta: Path, blob: Path | None) -> tuple[list[str], list[str] | None]:
        """(mkfs argv, producer argv or None).  gzip: ``--ungzip``; zstd (1.8 has no
        zstd filter): ``zstd -dc LAYER |`` into its stdin; a plain tar: the file."""
        argv = [*self.prefix, "--quiet", "--tar=f", "--aufs", "--preserve-mtime"]
        if compression == "gzip":
            argv.append("--ungzip")
        if blob is not None:
            argv += [f"--chunksize={self.chunk_size}", f"--blobdev={blob}"]
        argv.append(str(meta))
        if compression == "zstd":
            if shutil.which("zstd") is None:
                raise BenchError("zstd is not installed (apt-get install zstd): erofs-utils 1.8 reads "
                                 "zstd layers through 'zstd -dc LAYER |'")
            return argv, ["zstd", "-dc", str(layer)]
        return [*argv, str(layer)], None

    def describe(self) -> dict[str, Any]:
        chunked, _ = self.argv(Path("LAYER"), "gzip", Path("META"), Path("BLOB"))
        inline, _ = self.argv(Path("LAYER"), "gzip", Path("META"), None)
        short = {self.prefix[-1]: "mkfs.erofs-1.8"}
        loader = shlex.join(self.prefix[:-1])

        def show(argv: list[str]) -> str:
            return shlex.join([short.get(a, a) for a in argv[len(self.prefix) - 1 :]])

        return {
            "home": str(self.home),
            "version": self.version,
            "packages": self.packages,
            "run_as": f"{loader} {self.prefix[-1]}",
            "chunked": show(chunked),
            "inline": show(inline),
            "zstd_layers": "zstd -dc LAYER | mkfs.erofs-1.8 ... META (no --ungzip, no LAYER argument)",
        }


# -- temporary files -----------------------------------------------------------


def ext4_without_journal(device: str) -> bool:
    """True for an ext4 filesystem mounted without a journal (see ``discard``)."""
    try:
        task = Path("/sys/fs/ext4", os.path.basename(device), "journal_task").read_text()
    except OSError:
        return False
    return task.strip() == "<none>"


def filesystem_of(path: Path) -> tuple[str, str]:
    """(fstype, device) of the mount holding ``path``, from /proc/self/mounts."""
    real = os.path.realpath(path)
    best = ("", "?", "?")
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                point = parts[1].replace("\\040", " ")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best[0]):
                    best = (point, parts[2], parts[0])
    except OSError:
        pass
    return best[1], best[2]


def discard(path: Path, work: Path) -> None:
    """Move a run's output out of the way; the workspace's removal deletes it at exit.

    Not deleted between runs on purpose: ext4 without a journal (as on the
    hosts this was written on) skips inodes freed in the last 60 s (360 s while
    their inode-table block is dirty) when it allocates new ones
    (``recently_deleted`` in fs/ext4/ialloc.c), so deleting
    ~10k extracted files and extracting again at once made ``tar -x`` 3-6x
    slower, almost all of it system time.  A user's first extraction does not
    pay that, so neither does the benchmark.  Costs disk: ``repeat`` copies of
    every extracted layer until the end.
    """
    trash = work / "trash"
    trash.mkdir(exist_ok=True)
    path.rename(trash / f"{path.name}-{time.monotonic_ns()}")


CPU = tuple[float, float]  # user, system seconds


def _cpu(who: int) -> CPU:
    usage = resource.getrusage(who)
    return usage.ru_utime, usage.ru_stime


def _cpu_since(before: CPU, who: int) -> CPU:
    """CPU used since ``before``: RUSAGE_SELF covers all our threads, RUSAGE_CHILDREN
    the commands we waited for and every descendant they waited for (tar's gzip)."""
    after = _cpu(who)
    return after[0] - before[0], after[1] - before[1]


@dataclass
class LayerboxRun:
    seconds: float
    cpu: CPU
    digest: str
    files: int
    file_bytes: int
    chunks: int
    unique_chunks: int
    unique_bytes: int
    meta_bytes: int
    blob_bytes: int


def time_layerbox(layer: LayerInput, work: Path, chunk_size: int) -> LayerboxRun:
    out = work / "layerbox"
    out.mkdir()
    meta, blob = out / "layer.erofs", out / "layer.blob"
    os.sync()
    cpu = _cpu(resource.RUSAGE_SELF)
    start = time.perf_counter()
    with layer.path.open("rb") as f:
        result = convert_stream(f, meta, blob, chunk_size=chunk_size, source=str(layer.path))
    seconds = time.perf_counter() - start
    run = LayerboxRun(
        seconds=seconds, cpu=_cpu_since(cpu, resource.RUSAGE_SELF), digest=result.digest, files=result.files, file_bytes=result.bytes,
        chunks=result.chunks, unique_chunks=result.unique_chunks, unique_bytes=result.unique_bytes,
        meta_bytes=meta.stat().st_size, blob_bytes=blob.stat().st_size,
    )
    remove_tree(out)  # two files: too few freed inodes to slow the next run (see discard)
    return run


@dataclass
class PeerRun:
    seconds: float
    cpu: CPU
    meta_bytes: int
    blob_bytes: int  # 0 for the inline run: its data are in the image


def cli_argv(layer: Path, meta: Path, blob: Path, chunk_size: int) -> list[str]:
    """``layerbox convert`` of one layer file, as a user runs it (this checkout's code)."""
    return [sys.executable, "-m", "tools.cli", "convert", str(layer), "--meta", str(meta),
            "--blob", str(blob), "--chunk-size", str(chunk_size)]


def time_cli(layer: LayerInput, work: Path, chunk_size: int) -> PeerRun:
    """The same conversion through the command line: interpreter start-up and imports included."""
    out = work / "cli"
    out.mkdir()
    meta, blob = out / "layer.erofs", out / "layer.blob"
    return time_process(out, cli_argv(layer.path, meta, blob, chunk_size), meta, blob, cwd=CHECKOUT)


def time_process(
    out: Path, argv: list[str], meta: Path, blob: Path | None, *,
    stdin_from: list[str] | None = None, cwd: Path | None = None,
) -> PeerRun:
    """Time one command writing META (and BLOB) in ``out``, which is removed after (two files,
    too few freed inodes to slow the next run: see discard)."""
    os.sync()
    cpu = _cpu(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    run_tool(argv, stdin_from=stdin_from, cwd=cwd)
    seconds = time.perf_counter() - start
    run = PeerRun(seconds=seconds, cpu=_cpu_since(cpu, resource.RUSAGE_CHILDREN),
                  meta_bytes=meta.stat().st_size, blob_bytes=blob.stat().st_size if blob else 0)
    remove_tree(out)
    return run


@dataclass
class NativeRun:
    tar_seconds: float
    mkfs_seconds: float
    seconds: float  # tar + mkfs, measured end to end
    tar_cpu: CPU
    mkfs_cpu: CPU
    meta_bytes: int
    blob_bytes: int


def time_native(layer: LayerInput, work: Path, tools: NativeTools) -> NativeRun:
    out = work / "native"
    root = out / "rootfs"
    root.mkdir(parents=True)
    meta, blob = out / "meta.erofs", out / "data.blob"
    tar_argv = tools.tar_argv(layer.path, layer.compression, root)
    mkfs_argv = tools.mkfs_argv(root, meta, blob)
    os.sync()
    cpu = _cpu(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    run_tool(tar_argv)
    middle = time.perf_counter()
    tar_cpu = _cpu_since(cpu, resource.RUSAGE_CHILDREN)
    cpu = _cpu(resource.RUSAGE_CHILDREN)
    run_tool(mkfs_argv)
    end = time.perf_counter()
    run = NativeRun(
        tar_seconds=middle - start, mkfs_seconds=end - middle, seconds=end - start,
        tar_cpu=tar_cpu, mkfs_cpu=_cpu_since(cpu, resource.RUSAGE_CHILDREN),
        meta_bytes=meta.stat().st_size, blob_bytes=blob.stat().st_size,
    )
    discard(out, work)
    return run


def time_erofs18(layer: LayerInput, work: Path, peer: Erofs18, *, chunked: bool) -> PeerRun:
    out = work / "erofs18"
    out.mkdir()
    meta, blob = out / "meta.erofs", out / "data.blob"
    if chunked:
        blob.touch()  # 1.8 opens --blobdev without O_CREAT
    argv, producer = peer.argv(layer.path, layer.compression, meta, blob if chunked else None)
    return time_process(out, argv, meta, blob if chunked else None, stdin_from=producer)


def decompressed(f: BinaryIO, compression: str) -> Iterator[bytes]:
    """The layer's tar bytes, decompressed as the converter does (zlib, zstandard)."""
    if compression == "tar":
        while block := f.read(READ_SIZE):
            yield block
        return
    gzip = compression == "gzip"
    zctx = zstandard.ZstdDecompressor()

    def fresh() -> Any:
        return zlib.decompressobj(16 + zlib.MAX_WBITS) if gzip else zctx.decompressobj()

    d = fresh()
    while block := f.read(READ_SIZE):
        data = block
        while data:
            out = d.decompress(data)
            if out:
                yield out
            if not d.eof:
                break
            data = d.unused_data  # the next gzip member / zstd frame
            d = fresh()
            if not data.strip(b"\0"):
                break


@dataclass
class FloorRun:
    seconds: float
    cpu: CPU
    hash_seconds: float
    compress_seconds: float
    tar_bytes: int
    compressed_out_bytes: int

    @property
    def inflate_seconds(self) -> float:
        """Reading and decompressing: what is left of the total."""
        return max(0.0, self.seconds - self.hash_seconds - self.compress_seconds)


def time_floor(layer: LayerInput) -> FloorRun:
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    clock = time.perf_counter
    hashing = compressing = 0.0
    total = packed = 0
    pending = bytearray()

    def consume(final: bool) -> None:
        nonlocal hashing, compressing, packed
        usable = len(pending) if final else len(pending) - len(pending) % PIECE
        with memoryview(pending) as view:
            for offset in range(0, usable, PIECE):
                with view[offset : offset + PIECE] as piece:
                    t0 = clock()
                    blake3.blake3(piece).digest()
                    t1 = clock()
                    packed += len(cctx.compress(piece))
                    compressing += clock() - t1
                    hashing += t1 - t0
        del pending[:usable]

    cpu = _cpu(resource.RUSAGE_SELF)
    start = clock()
    with layer.path.open("rb") as f:
        for data in decompressed(f, layer.compression):
            total += len(data)
            pending += data
            if len(pending) >= PIECE:
                consume(final=False)
    consume(final=True)
    seconds = clock() - start
    return FloorRun(seconds, _cpu_since(cpu, resource.RUSAGE_SELF), hashing, compressing, total, packed)


# -- one layer, several runs -----------------------------------------------------


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def bench_layer(
    layer: LayerInput, work: Path, tools: NativeTools, peer: Erofs18 | None, chunk_size: int, repeat: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    ours: list[LayerboxRun] = []
    native: list[NativeRun] = []
    floor: list[FloorRun] = []
    e18: list[PeerRun] = []
    e18_inline: list[PeerRun] = []
    cli: list[PeerRun] = []
    for i in range(repeat):
        log(f"  run {i + 1}/{repeat}: layerbox")
        ours.append(time_layerbox(layer, work, chunk_size))
        log(f"  run {i + 1}/{repeat}: layerbox convert (command line)")
        cli.append(time_cli(layer, work, chunk_size))
        log(f"  run {i + 1}/{repeat}: tar -x + mkfs.erofs")
        native.append(time_native(layer, work, tools))
        if peer is not None:
            log(f"  run {i + 1}/{repeat}: erofs-utils 1.8 --tar, chunked")
            e18.append(time_erofs18(layer, work, peer, chunked=True))
            log(f"  run {i + 1}/{repeat}: erofs-utils 1.8 --tar, inline")
            e18_inline.append(time_erofs18(layer, work, peer, chunked=False))
        log(f"  run {i + 1}/{repeat}: floor")
        floor.append(time_floor(layer))
    if len({r.digest for r in ours}) != 1:
        log(f"  warning: layerbox produced different images across runs: {sorted({r.digest for r in ours})}")
    last, tar_bytes = ours[-1], floor[-1].tar_bytes
    runs = {
        "layerbox": [r.seconds for r in ours],
        "cli": [r.seconds for r in cli],
        "native": [r.seconds for r in native],
        "tar": [r.tar_seconds for r in native],
        "mkfs": [r.mkfs_seconds for r in native],
        "floor": [r.seconds for r in floor],
    }
    cpus = {
        "layerbox": [r.cpu for r in ours],
        "cli": [r.cpu for r in cli],
        "tar": [r.tar_cpu for r in native],
        "mkfs": [r.mkfs_cpu for r in native],
        "floor": [r.cpu for r in floor],
    }
    meta_bytes = {"layerbox": last.meta_bytes, "mkfs_erofs": native[-1].meta_bytes}
    blob_bytes = {"layerbox": last.blob_bytes, "mkfs_erofs": native[-1].blob_bytes}
    if peer is not None:
        for key, peer_runs in (("erofs18", e18), ("erofs18_inline", e18_inline)):
            runs[key] = [r.seconds for r in peer_runs]
            cpus[key] = [r.cpu for r in peer_runs]
            meta_bytes[key] = peer_runs[-1].meta_bytes
        blob_bytes["erofs18"] = e18[-1].blob_bytes
    seconds = {key: median(values) for key, values in runs.items()}
    return {
        "label": layer.label,
        "digest": layer.digest,
        "used_by": layer.used_by,
        "compression": layer.compression,
        "compressed_bytes": layer.compressed_bytes,
        "tar_bytes": tar_bytes,
        "file_bytes": last.file_bytes,
        "files": last.files,
        "chunks": last.chunks,
        "unique_chunks": last.unique_chunks,
        "unique_bytes": last.unique_bytes,
        "dedup_ratio": ratio(last.unique_bytes, last.file_bytes),
        "layerbox_digest": last.digest,
        "meta_bytes": meta_bytes,
        "blob_bytes": blob_bytes,
        "floor_zstd_bytes": floor[-1].compressed_out_bytes,
        "seconds": seconds,
        "floor_parts_seconds": {
            "read_inflate": median([r.inflate_seconds for r in floor]),
            "blake3": median([r.hash_seconds for r in floor]),
            "zstd": median([r.compress_seconds for r in floor]),
        },
        "mb_per_s": {k: rate(tar_bytes, v) for k, v in seconds.items()},
        **ratios(seconds),
        "cpu_seconds": {
            name: {"user": median([c[0] for c in values]), "system": median([c[1] for c in values])}
            for name, values in cpus.items()
        },
        "runs": runs,
    }


def ratios(seconds: dict[str, float]) -> dict[str, float | None]:
    """``ratio`` = native / layerbox (>= 1 good); the others layerbox / peer (<= 1 good)."""
    out = {
        "ratio": ratio(seconds["native"], seconds["layerbox"]),
        "floor_ratio": ratio(seconds["layerbox"], seconds["floor"]),
    }
    if "erofs18" in seconds:
        out["erofs18_ratio"] = ratio(seconds["layerbox"], seconds["erofs18"])
        out["erofs18_inline_ratio"] = ratio(seconds["layerbox"], seconds["erofs18_inline"])
        out["cli_erofs18_inline_ratio"] = ratio(seconds["cli"], seconds["erofs18_inline"])
    return out


def totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def total(key: str) -> int:
        return sum(r[key] for r in rows)

    def summed(field: str) -> dict[str, int]:
        return {k: sum(r[field][k] for r in rows) for k in rows[0][field]}

    tar_bytes = total("tar_bytes")
    seconds = {k: sum(r["seconds"][k] for r in rows) for k in rows[0]["seconds"]}
    return {
        "layers": len(rows),
        "compressed_bytes": total("compressed_bytes"),
        "tar_bytes": tar_bytes,
        "file_bytes": total("file_bytes"),
        "files": total("files"),
        "chunks": total("chunks"),
        "unique_chunks": total("unique_chunks"),
        "unique_bytes": total("unique_bytes"),
        "dedup_ratio": ratio(total("unique_bytes"), total("file_bytes")),
        "meta_bytes": summed("meta_bytes"),
        "blob_bytes": summed("blob_bytes"),
        "seconds": seconds,
        "mb_per_s": {k: rate(tar_bytes, v) for k, v in seconds.items()},
        **ratios(seconds),
    }


def goals(total: dict[str, Any]) -> dict[str, Any]:
    r, f = total["ratio"], total["floor_ratio"]
    out = {
        "native_over_layerbox": {"want": f">= {GOAL_NATIVE_RATIO}", "value": r,
                                 "met": r is not None and r >= GOAL_NATIVE_RATIO},
        "layerbox_over_floor": {"want": f"<= {GOAL_FLOOR_RATIO}", "value": f,
                                "met": f is not None and f <= GOAL_FLOOR_RATIO},
    }
    for key in ("erofs18", "erofs18_inline", "cli_erofs18_inline"):
        value = total.get(f"{key}_ratio")
        if f"{key}_ratio" in total:
            out[key.replace("cli_", "cli_over_") if key.startswith("cli_") else f"layerbox_over_{key}"] = {"want": f"<= {GOAL_EROFS18_RATIO}", "value": value,
                                          "met": value is not None and value <= GOAL_EROFS18_RATIO}
    return out


# -- output --------------------------------------------------------------------


def _mb(n: int) -> str:
    return f"{n / MB:.2f}"


def _kb(n: int) -> str:
    return f"{n / 1000:.1f}"


def render(doc: dict[str, Any]) -> str:
    s, env, native = doc["settings"], doc["environment"], doc["native"]
    peer = doc.get("erofs18")
    out = [
        f"layerbox convert benchmark: chunk size {s['chunk_size']} B, median of {s['repeat']} run(s); "
        "MB = 10^6 bytes; MB/s = uncompressed tar MB per second",
        f"inputs:  {'  '.join(s['inputs'])}",
        f"workdir: {env['workdir']} ({env['workdir_fs']} on {env['workdir_device']}); "
        f"{env['cpus']} CPUs; Python {env['python']}; blake3 {env['blake3']}; zstandard {env['zstandard']}; "
        f"load average {env['load_start']} at start, {env['load_end']} at end",
        f"native:  {native['tar']}   [{native['tar_version']}]",
        f"         {native['mkfs']}   [mkfs.erofs {native['mkfs_version']}; defaults otherwise: "
        f"{native['mkfs_defaults']}]",
        *([f"1.8:     chunked: {peer['chunked']}",
           f"         inline:  {peer['inline']}   (data in META: no chunks, no hashing, no dedup)",
           f"         [erofs-utils {peer['version']} from Debian 13, {peer['home']}, run as {peer['run_as']}; "
           "zstd layers: zstd -dc LAYER | ...]"]
          if peer else [f"1.8:     left out (--no-erofs18); fetch it with 'bash {PEER_SCRIPT}'"]),
        *([f"note:    {env['workdir_device']} is ext4 without a journal: file creation (tar -x) is slower "
           "for 1-6 min after any mass deletion on it; see bench/README.md"]
          if env.get("ext4_without_journal") else []),
        f"floor:   read + inflate (zlib/zstandard) + blake3 + zstd level {ZSTD_LEVEL}, "
        f"{PIECE >> 20} MiB pieces, one thread",
        "",
    ]
    rows, total = doc["layers"], doc["totals"]

    def size_row(name: str, r: dict[str, Any]) -> list[str]:
        cells = [
            name, r.get("compression", ""), _mb(r["compressed_bytes"]), _mb(r["tar_bytes"]),
            _mb(r["file_bytes"]), str(r["files"]), str(r["chunks"]), str(r["unique_chunks"]),
            _f(r["dedup_ratio"], 3), _kb(r["meta_bytes"]["layerbox"]), _kb(r["meta_bytes"]["mkfs_erofs"]),
        ]
        cells += [_kb(r["meta_bytes"]["erofs18"])] if peer else []
        cells += [_mb(r["blob_bytes"]["layerbox"]), _mb(r["blob_bytes"]["mkfs_erofs"])]
        return cells + ([_mb(r["blob_bytes"]["erofs18"]), _mb(r["meta_bytes"]["erofs18_inline"])] if peer else [])

    out.append("Layers")
    out.append(_table(
        ["layer", "comp", "comp MB", "tar MB", "file MB", "files", "chunks", "unique",
         "dedup", "meta KB ours", "meta KB mkfs", *(["meta KB 1.8"] if peer else []),
         "blob MB ours", "blob MB mkfs", *(["blob MB 1.8", "image MB 1.8 inline"] if peer else [])],
        [size_row(f"{i} {r['label']}", r) for i, r in enumerate(rows, 1)] + [size_row("total", total)],
        left=2,
    ))
    out.append("")
    for i, r in enumerate(rows, 1):
        out.append(f"  {i} {r['label']}: {r['digest']}  used by: {', '.join(r['used_by'])}")
    out.append("")

    methods = ("layerbox", "cli", "native", "tar", "mkfs", *(("erofs18", "erofs18_inline") if peer else ()), "floor")

    def time_row(name: str, r: dict[str, Any]) -> list[str]:
        cells = [name]
        for key in methods:
            cells += [_f(r["seconds"][key], 3), _f(r["mb_per_s"][key], 1)]
        cells += [_f(r["ratio"])]
        cells += [_f(r["erofs18_ratio"]), _f(r["erofs18_inline_ratio"]), _f(r["cli_erofs18_inline_ratio"])] if peer else []
        return cells + [_f(r["floor_ratio"])]

    out.append("Times (median seconds, MB/s)")
    out.append(_table(
        ["layer", "layerbox s", "MB/s", "CLI s", "MB/s", "native s", "MB/s", "tar -x s", "MB/s", "mkfs s", "MB/s",
         *(["1.8 s", "MB/s", "1.8 inline s", "MB/s"] if peer else []),
         "floor s", "MB/s", "native/layerbox",
         *(["layerbox/1.8", "layerbox/1.8 inline", "CLI/1.8 inline"] if peer else []),
         "layerbox/floor"],
        [time_row(f"{i} {r['label']}", r) for i, r in enumerate(rows, 1)] + [time_row("total", total)],
    ))
    out.append("")
    cpu_methods = ("layerbox", "cli", "tar", "mkfs", *(("erofs18", "erofs18_inline") if peer else ()), "floor")
    out.append("CPU (median user/system s; tar includes its gzip/zstd child)")
    out.append(_table(
        ["layer", "layerbox", "CLI", "tar -x", "mkfs", *(["1.8", "1.8 inline"] if peer else []), "floor"],
        [[f"{i} {r['label']}"] + [
            f"{_f(r['cpu_seconds'][k]['user'], 2)}/{_f(r['cpu_seconds'][k]['system'], 2)}"
            for k in cpu_methods
        ] for i, r in enumerate(rows, 1)],
    ))
    out.append("")
    out.append("floor parts (median s): " + "; ".join(
        f"{i} read+inflate {_f(p['read_inflate'], 3)} blake3 {_f(p['blake3'], 3)} zstd {_f(p['zstd'], 3)}"
        for i, p in enumerate((r["floor_parts_seconds"] for r in rows), 1)
    ))
    names = {"native_over_layerbox": "native/layerbox", "layerbox_over_floor": "layerbox/floor",
             "layerbox_over_erofs18": "layerbox/1.8", "layerbox_over_erofs18_inline": "layerbox/1.8 inline",
             "cli_over_erofs18_inline": "CLI/1.8 inline"}
    out.append("goals (totals): " + "; ".join(
        f"{names[key]} {g['want']}: {_f(g['value'])} {'MET' if g['met'] else 'MISSED'}"
        for key, g in doc["goals"].items()
    ))
    return "\n".join(out)


def _loadavg() -> str:
    """The 1/5/15-minute load averages: the host is shared, so every figure carries them."""
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


# -- command line ----------------------------------------------------------------


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)(?:i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 1M, 512K, 4096)")
    value = int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]
    try:
        check_chunk_size(value)
    except ConvertError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench/convert.py",
        description="Time layerbox's converter against tar -x + mkfs.erofs, and against the "
        "read+blake3+zstd floor, on every distinct layer of the inputs.",
    )
    p.add_argument("inputs", nargs="*", metavar="INPUT",
                   help="image reference or .tar/.tar.gz/.tar.zst layer (same as --image)")
    p.add_argument("--image", action="append", default=[], metavar="REF",
                   help="oci-archive:FILE[:TAG], oci:DIR[:TAG], docker-archive:FILE[:REF] or a "
                   "tarball path; repeatable (default: both tags of the fixture image)")
    p.add_argument("--chunk-size", type=parse_size, default=1 << 20, metavar="SIZE",
                   help="chunk size for both converters (default 1M)")
    p.add_argument("--repeat", type=int, default=3, metavar="N", help="runs per method and layer (default 3)")
    p.add_argument("--tmpdir", type=Path, default=Path("/var/tmp"), metavar="DIR",
                   help="where temporary files go; must be a disk, not tmpfs (default /var/tmp)")
    p.add_argument("--erofs18", type=Path, default=DEFAULT_EROFS18, metavar="DIR",
                   help=f"erofs-utils 1.8 as {PEER_SCRIPT} leaves it (default {DEFAULT_EROFS18}); "
                   "a missing one is an error")
    p.add_argument("--no-erofs18", action="store_true",
                   help="leave the erofs-utils 1.8 --tar peer out (it is measured by default)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.repeat < 1:
        print("bench/convert.py: --repeat must be at least 1", file=sys.stderr)
        return 2

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        specs = [*args.image, *args.inputs] or default_inputs()
        tools = NativeTools(args.chunk_size)
        peer = None if args.no_erofs18 else Erofs18(args.erofs18, args.chunk_size)
        load_start = _loadavg()
        fstype, device = filesystem_of(args.tmpdir)
        if fstype in ("tmpfs", "ramfs"):
            log(f"warning: {args.tmpdir} is on {fstype}: disk writes are not measured; pass --tmpdir DIR on a disk")
        nojournal = fstype == "ext4" and ext4_without_journal(device)
        # clean inode tables shorten ext4's recently-deleted window (see discard)
        with workspace(args.tmpdir, "layerbox-bench-", after_removal=os.sync) as work:
            tools.probe(work)
            layers = resolve_inputs(specs, work, log)
            if not layers:
                raise BenchError("the inputs hold no layers")
            rows = []
            for i, layer in enumerate(layers, 1):
                log(f"layer {i}/{len(layers)}: {layer.label} ({layer.compression}, "
                    f"{layer.compressed_bytes / MB:.1f} MB)")
                rows.append(bench_layer(layer, work, tools, peer, args.chunk_size, args.repeat, log))
            total = totals(rows)
            doc = {
                "schema": SCHEMA,
                "settings": {"chunk_size": args.chunk_size, "repeat": args.repeat, "inputs": specs,
                             "zstd_level": ZSTD_LEVEL, "floor_piece": PIECE},
                "environment": {
                    "workdir": str(work), "workdir_fs": fstype, "workdir_device": device,
                    "cpus": os.cpu_count(), "python": platform.python_version(),
                    "blake3": getattr(blake3, "__version__", "?"), "zstandard": zstandard.__version__,
                    "euid": os.geteuid(), "ext4_without_journal": nojournal,
                    "load_start": load_start, "load_end": _loadavg(),
                },
                "native": tools.describe(),
                **({"erofs18": peer.describe()} if peer is not None else {}),
                "layers": rows,
                "totals": total,
                "goals": goals(total),
            }
    except BenchError as exc:
        log(f"bench/convert.py: {exc}")
        return 1
    except ConvertError as exc:
        log(f"bench/convert.py: the layerbox converter failed: {exc}")
        return 1
    except KeyboardInterrupt:
        log("bench/convert.py: interrupted; temporary files removed")
        return 130
    emit(doc, args.json, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
