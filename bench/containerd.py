"""Benchmark: pull + first output of ``ctr run`` on an empty host, the layerbox snapshotter
against containerd's default overlayfs snapshotter and the stargz snapshotter (lazy pulling).

One run, one registry (Debian's docker-registry on 127.0.0.1), one ``file://`` store, containerd
2.x (its transfer service pulls and unpacks) with runc:

* **Images**: the fixture's ``minbase`` and ``python`` tags, and ``big``: minbase plus one gzip
  layer of ``--big-mb`` MB of generated files of mixed compressibility (random, 16-symbol and
  4-symbol data from a fixed seed, fixed owners and times: the same blob digest every run).  All
  are pushed to the registry with skopeo, and published into the store once, before any timing;
  for the stargz peer each is also converted to eStargz (``ctr-remote image convert --estargz
  --oci``) and pushed to the same registry as ``bench/NAME-esgz``.
* **Peers**, each on an empty host (a fresh containerd root and state, a fresh snapshotter root,
  a fresh layerbox data dir, so an empty cache):

  - ``overlayfs``: ``ctr image pull --plain-http IMAGE`` then ``ctr run --rm IMAGE``: containerd
    downloads every layer blob and unpacks it with its default snapshotter;
  - ``layerbox``: the same with ``--snapshotter layerbox`` and the image already in the store:
    the snapshotter answers each layer from the store, containerd downloads no layer blob, and
    the container's reads fetch chunks lazily;
  - ``layerbox-unpack``: ``--snapshotter layerbox`` on an empty store: containerd downloads and
    unpacks as with overlayfs, and the snapshotter publishes each committed layer in the
    background (how long until the image is in the store is reported too);
  - ``stargz``: ``ctr-remote image rpull --snapshotter stargz`` of the eStargz image, then
    ``ctr run --snapshotter stargz``: the stargz snapshotter (a proxy plugin, its own daemon,
    bench/peers/stargz.sh) mounts each layer with FUSE and fetches ranges of the blob from the
    registry as files are read.  Skipped, with the reason in ``skipped``, when its binaries
    are not installed.

* **Workload**: ``sh -c 'cat /etc/os-release; md5sum /bin/sh PROBE'`` (PROBE: a file of the
  image's top layer), timed from the pull's start to the first byte the container prints, split
  into the pull and the run.  Bytes: what the registry served (from its log: layer blobs, and
  manifests + configs), what the lazyfetch daemon fetched from the store (``/stats``), and what
  the host wrote to its disk (``du`` of the containerd root, snapshotter root and data dir
  after ``sync``, less what they held before the pull).  Then a second container of the same
  image reads every regular file of its rootfs (``find / -xdev -type f | xargs cat | wc -c``),
  timed from its first output to its exit, and the bytes and disk are measured again.

Everything (containerd, its shims, the snapshotter, the lazyfetch daemon, the registry, every
mount, the work directory) is removed at the end, on Ctrl-C, SIGTERM and SIGHUP, and on failure.

Run ``python bench/containerd.py --help``; bench/README.md explains every number.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import hashlib
import io
import json
import os
import platform
import random
import selectors
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

if __package__ in (None, ""):  # run as a script: import the checkout, installed or not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import MB, BenchError, _f, _table, emit, log  # shared by the benchmarks

from converters.oci import inspect_image  # noqa: E402
from converters.ocispec import (  # noqa: E402
    MT_OCI_CONFIG,
    MT_OCI_LAYER_GZIP,
    MT_OCI_MANIFEST,
    REF_NAME,
    digest_of,
)
from converters.publish import chain_ref  # noqa: E402
from lazyfetch import kmount  # noqa: E402
from lazyfetch.client import DaemonUnavailable  # noqa: E402
from lazyfetch.mounts import HostMounts  # noqa: E402
from tests.support.containerd import (  # noqa: E402
    CONTAINERD2,
    READY_TIMEOUT,
    Containerd,
    Snapshotter,
    short_dir,
)
from tests.support.hosts import publish_sync, resolve_sync  # noqa: E402
from tests.support.registry import (  # noqa: E402
    FIXTURE_ARCHIVE,
    REGISTRY_BIN,
    RegistryServer,
    push,
    running_registry,
)

SCHEMA = "layerbox.bench.containerd.v1"
PEERS = ("overlayfs", "layerbox", "layerbox-unpack", "stargz")
STARGZ = "stargz"
# Debian sid's stargz-snapshotter (ctr-remote) and the daemon built from its library, by
# bench/peers/stargz.sh (`make bench-peers`)
CTR_REMOTE = Path("/opt/layerbox/stargz-snapshotter/usr/bin/ctr-remote")
STARGZ_GRPC = Path("/opt/layerbox/stargz-grpc/bin/stargz-grpc")
BASELINE = "overlayfs"
FIXTURE_TAGS = ("minbase", "python")
BIG_SEED = 20261202
BIG_DIR = "bench-data"
BIG_SIZES = (4_000, 16_000_000)  # log-uniform file sizes of the big layer
BIG_EPOCH = 1_700_000_000  # every mtime in the big layer
RUN_TIMEOUT = 600.0
PUBLISH_TIMEOUT = 1800.0
PROBES = {"minbase": "/etc/passwd", "python": "/usr/lib/python3.11/os.py"}
PROBE_MIN = 1_000_000  # the big image's probe: its first file at least this large
# the whole-image read: every regular file of the rootfs, not /proc, /sys, /dev (other mounts)
READ_ALL = "echo reading; find / -xdev -type f -print0 | xargs -0 cat | wc -c"


def _terminate(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


# -- the images ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Image:
    """One image as the benchmark pulls it: its registry ref, its source for skopeo and publish."""

    name: str
    source: str  # oci-archive:... or oci:...: what skopeo pushes and layerbox publishes
    ref: str  # HOST/bench/NAME:latest
    layers: tuple[tuple[str, int], ...]  # (digest, size) of each layer blob, lowest first
    top_chain: str
    probe: str
    esgz_ref: str = ""  # the eStargz copy in the same registry (the stargz peer's)
    esgz_layers: tuple[tuple[str, int], ...] = ()
    esgz_seconds: float = 0.0  # the conversion and push, before any timing

    @property
    def layer_bytes(self) -> int:
        return sum(size for _, size in self.layers)

    def layers_of(self, peer: str) -> tuple[tuple[str, int], ...]:
        return self.esgz_layers if peer == STARGZ else self.layers

    @property
    def command(self) -> str:
        return f"cat /etc/os-release; md5sum /bin/sh {self.probe}"


class _Hashing(io.RawIOBase):
    """A write-only stream that hashes and counts what passes through to ``sink``."""

    def __init__(self, sink: IO[bytes] | io.RawIOBase | None) -> None:
        self.sink = sink
        self.sha = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.sha.update(view)
        self.size += len(view)
        if self.sink is not None:
            self.sink.write(view)
        return len(view)

    @property
    def digest(self) -> str:
        return "sha256:" + self.sha.hexdigest()


def _big_contents(total: int) -> Iterator[tuple[str, bytes]]:
    """(path, data) of the big layer's files: ``total`` bytes, a third each of random data, data
    of 16 symbols (gzip: ~1.7x) and of 4 symbols (~3.5x), from one seed."""
    rng = random.Random(BIG_SEED)
    text16 = bytes.maketrans(bytes(range(256)), bytes(b"abcdefghijklmnop"[i % 16] for i in range(256)))
    text4 = bytes.maketrans(bytes(range(256)), bytes(b"ACGT"[i % 4] for i in range(256)))
    lo, hi = BIG_SIZES
    written = number = 0
    while written < total:
        size = min(int(lo * (hi / lo) ** rng.random()), total - written)
        data = rng.randbytes(size)
        kind = number % 3
        if kind == 1:
            data = data.translate(text16)
        elif kind == 2:
            data = data.translate(text4)
        yield f"{BIG_DIR}/d{number % 16:02d}/f{number:05d}.bin", data
        written += size
        number += 1


def _write_big_layer(path: Path, total: int) -> tuple[str, int, str, str, int]:
    """Write the big layer's gzip tar to ``path``: (blob digest, blob size, diff id, the probe
    file's path and size: the first file of at least PROBE_MIN bytes, or the first file)."""
    first, first_size = "", 0
    with open(path, "wb") as out:
        blob = _Hashing(out)
        with gzip.GzipFile(fileobj=blob, mode="wb", compresslevel=6, mtime=0) as gz:
            tar_stream = _Hashing(cast(IO[bytes], gz))
            with tarfile.open(fileobj=tar_stream, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                dirs: set[str] = set()
                for name, data in _big_contents(total):
                    if not first or (first_size < PROBE_MIN <= len(data)):
                        first, first_size = name, len(data)
                    for parent in (BIG_DIR, name.rsplit("/", 1)[0]):
                        if parent not in dirs:
                            dirs.add(parent)
                            info = tarfile.TarInfo(parent)
                            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, BIG_EPOCH
                            tar.addfile(info)
                    info = tarfile.TarInfo(name)
                    info.size, info.mode, info.mtime = len(data), 0o644, BIG_EPOCH
                    tar.addfile(info, io.BytesIO(data))
    return blob.digest, blob.size, tar_stream.digest, "/" + first, first_size


def _build_big(layout: Path, total: int) -> tuple[str, int]:
    """An OCI layout at ``layout`` with tag ``big``: the fixture's minbase and one generated
    layer of ``total`` bytes of files on top.  Returns the probe file's path in the image and
    its size."""
    subprocess.run(["skopeo", "copy", "--quiet", f"oci-archive:{FIXTURE_ARCHIVE}:minbase",
                    f"oci:{layout}:minbase"], check=True, timeout=600, capture_output=True)
    blobs = layout / "blobs" / "sha256"
    index = json.loads((layout / "index.json").read_text())
    base_desc = next(m for m in index["manifests"] if m.get("annotations", {}).get(REF_NAME) == "minbase")
    manifest = json.loads((blobs / base_desc["digest"].split(":")[1]).read_bytes())
    config = json.loads((blobs / manifest["config"]["digest"].split(":")[1]).read_bytes())

    tmp = layout / "big-layer.tmp"
    digest, size, diff_id, probe, probe_size = _write_big_layer(tmp, total)
    tmp.rename(blobs / digest.split(":")[1])

    def put(doc: dict[str, Any], media_type: str) -> dict[str, Any]:
        data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        d = digest_of(data)
        (blobs / d.split(":")[1]).write_bytes(data)
        return {"mediaType": media_type, "digest": d, "size": len(data)}

    config["rootfs"]["diff_ids"].append(diff_id)
    config.setdefault("history", []).append({"created": "2023-11-14T22:13:20Z",
                                             "created_by": f"bench/containerd.py --big-mb {total // MB}"})
    manifest["config"] = put(config, MT_OCI_CONFIG)
    manifest["layers"].append({"mediaType": MT_OCI_LAYER_GZIP, "digest": digest, "size": size})
    desc = put(manifest, MT_OCI_MANIFEST)
    desc["annotations"] = {REF_NAME: "big"}
    index["manifests"].append(desc)
    (layout / "index.json").write_text(json.dumps(index))
    return probe, probe_size


def _image(name: str, source: str, host: str, probe: str) -> Image:
    resolved = inspect_image(source)
    return Image(name, source, f"{host}/bench/{name}:latest",
                 tuple((x.digest, x.size) for x in resolved.layers), resolved.chain_ids[-1], probe)


# -- the stargz peer: its daemon and the eStargz images ---------------------------------------


def stargz_missing() -> str | None:
    """Why the stargz peer cannot run here, or None."""
    missing = [str(p) for p in (CTR_REMOTE, STARGZ_GRPC) if not p.exists()]
    if missing:
        return (f"missing {', '.join(missing)}: `make bench-peers` (bash bench/peers/stargz.sh) installs "
                "Debian sid's ctr-remote and builds the snapshotter daemon from Debian's stargz library")
    return None


class StargzDaemon:
    """The stargz snapshotter (bench/peers/stargz-grpc) as containerd's proxy plugin ``stargz``:
    its socket, root (snapshots, caches, FUSE mount points) and config under ``base``."""

    def __init__(self, base: Path) -> None:
        self.socket = base / "sz.sock"
        self.root = base / "sz-root"
        self.config = base / "stargz.toml"
        self.log = base / "stargz.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        # the library's defaults (background fetch on, disk caches under the root, no keychain:
        # the registry on 127.0.0.1 needs none, and the library speaks plain HTTP to localhost)
        self.config.write_text("# bench/containerd.py: the stargz library's defaults\n")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([str(STARGZ_GRPC), "--address", str(self.socket), "--root",
                                          str(self.root), "--config", str(self.config)],
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"{STARGZ_GRPC} exited {self.proc.returncode}:\n{self.log_tail()}")
            if self.socket.is_socket() and b"serving on" in self.log.read_bytes():
                return
            time.sleep(0.05)
        raise BenchError(f"{STARGZ_GRPC} not serving in {READY_TIMEOUT:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM: it closes the snapshotter, which unmounts every layer; SIGKILL after 20 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def ctr_remote(cd: Containerd, *args: str, timeout: float = RUN_TIMEOUT) -> str:
    """``ctr-remote ARGS`` on ``cd``'s socket and namespace: its stdout."""
    argv = [str(CTR_REMOTE), *cd.ctr_argv(*args)[1:]]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, env=cd.env)
    if res.returncode != 0:
        raise BenchError(f"{' '.join(argv)} exited {res.returncode}:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    return res.stdout


def _manifest_layers(registry: RegistryServer, ref: str) -> tuple[tuple[str, int], ...]:
    """(digest, size) of each layer of ``ref``'s linux/amd64 manifest, as the registry serves it."""
    repo, tag = ref.split("/", 1)[1].rsplit(":", 1)
    accept = f"{MT_OCI_MANIFEST}, application/vnd.oci.image.index.v1+json"

    def get(reference: str) -> dict[str, Any]:
        request = urllib.request.Request(f"http://{registry.host}/v2/{repo}/manifests/{reference}",
                                         headers={"Accept": accept})
        with urllib.request.urlopen(request, timeout=30) as resp:
            return cast(dict[str, Any], json.load(resp))

    doc = get(tag)
    if "manifests" in doc:  # an index: the amd64 image
        wanted = [m for m in doc["manifests"] if m.get("platform", {}).get("architecture") == "amd64"]
        if not wanted:
            raise BenchError(f"{ref}: its index lists no linux/amd64 manifest")
        doc = get(wanted[0]["digest"])
    return tuple((layer["digest"], int(layer["size"])) for layer in doc["layers"])


def convert_esgz(base: Path, registry: RegistryServer, images: list[Image]) -> list[Image]:
    """Each image converted to eStargz (gzip level 9, no prioritized files: ``convert``, not
    ``optimize``, so the bench's own workload is not profiled into the image) by a throwaway
    containerd 2.x, and pushed to the registry beside the original."""
    base.mkdir()
    cd = Containerd(base, base / "no-snapshotter.sock", bin_dir=CONTAINERD2)
    out = []
    try:
        cd.start()
        for image in images:
            start = time.monotonic()
            esgz_ref = image.ref.replace(f"/{image.name}:", f"/{image.name}-esgz:")
            ctr_remote(cd, "image", "pull", "--plain-http", image.ref)
            ctr_remote(cd, "image", "convert", "--estargz", "--oci", image.ref, esgz_ref)
            ctr_remote(cd, "image", "push", "--plain-http", esgz_ref)
            layers = _manifest_layers(registry, esgz_ref)
            seconds = time.monotonic() - start
            log(f"{image.name}: eStargz {sum(s for _, s in layers) / MB:.1f} MB in {seconds:.1f} s")
            out.append(dataclasses.replace(image, esgz_ref=esgz_ref, esgz_layers=layers, esgz_seconds=seconds))
    finally:
        cd.teardown()
        shutil.rmtree(base, ignore_errors=True)
    return out


# -- one peer on one empty host --------------------------------------------------------------


def _du(paths: list[Path]) -> int:
    """Allocated bytes under ``paths`` on their own filesystem (not the mounts inside them)."""
    existing = [str(p) for p in paths if p.exists()]
    if not existing:
        return 0
    out = subprocess.run(["du", "-x", "-s", "-B1", "--total", *existing], capture_output=True, text=True,
                         timeout=600, check=False).stdout
    return int(out.strip().splitlines()[-1].split()[0])


def _sync() -> None:
    subprocess.run(["sync"], check=True, timeout=600)


def _run_until_output(cd: Containerd, args: list[str]) -> tuple[float, float, str]:
    """Run ``ctr ARGS``: (seconds to its first byte on stdout, seconds to its exit, stdout)."""
    start = time.monotonic()
    proc = subprocess.Popen(cd.ctr_argv(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=cd.env, start_new_session=True)
    assert proc.stdout is not None
    assert proc.stderr is not None
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    first: float | None = None
    chunks: dict[int, list[bytes]] = {out_fd: [], err_fd: []}
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(out_fd, selectors.EVENT_READ)
            sel.register(err_fd, selectors.EVENT_READ)
            deadline = start + RUN_TIMEOUT
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BenchError(f"ctr {' '.join(args)} did not end in {RUN_TIMEOUT:.0f} s")
                for key, _ in sel.select(timeout=left):
                    data = os.read(key.fd, 65536)
                    if not data:
                        sel.unregister(key.fd)
                    else:
                        if key.fd == out_fd and first is None:
                            first = time.monotonic() - start
                        chunks[key.fd].append(data)
        proc.wait(timeout=RUN_TIMEOUT)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    done = time.monotonic() - start
    stdout, stderr = (b"".join(chunks[fd]).decode(errors="replace") for fd in (out_fd, err_fd))
    if proc.returncode != 0 or first is None:
        raise BenchError(f"ctr {' '.join(args)} exited {proc.returncode}:\n{stdout}\n{stderr}\n"
                         f"containerd log:\n{cd.log_tail()}")
    return first, done, stdout


class Host:
    """An empty host under ``base``: containerd 2.x and the peer's snapshotter (layerbox's on
    ``store``, with a data dir; or the stargz daemon)."""

    def __init__(self, base: Path, store: str, peer: str) -> None:
        self.base = base
        base.mkdir()
        self.data_dir = base / "data"
        self.sn = Snapshotter(base, store, self.data_dir)
        self.sz = StargzDaemon(base) if peer == STARGZ else None
        proxies = {STARGZ: self.sz.socket} if self.sz else {}
        self.cd = Containerd(base, self.sn.socket, bin_dir=CONTAINERD2, proxies=proxies)
        self.disk = [self.cd.root, self.sz.root if self.sz else self.sn.root, self.data_dir]

    def start(self) -> None:
        if self.sz:
            self.sz.start()
        else:
            self.sn.start()
        self.cd.start()

    def stats(self) -> dict[str, Any] | None:
        """The lazyfetch daemon's counters; None when no daemon ran (nothing mounted from the store)."""
        try:
            return dict(HostMounts(self.data_dir).client.request("GET", "/stats"))
        except DaemonUnavailable:
            return None

    def log_tail(self) -> str:
        return self.sz.log_tail() if self.sz else self.sn.log_tail()

    def close(self) -> list[str]:
        """Stop everything and unmount what is left; then remove the host's directory."""
        problems: list[str] = []
        try:
            problems += self.cd.teardown()
        finally:  # each step even when the one before failed: no process may outlive the run
            try:
                self.sn.stop()
                if self.sz:
                    self.sz.stop()
            finally:
                if (self.data_dir / "state").exists():
                    HostMounts(self.data_dir).umount_all(stop_daemon=True)
        left = kmount.mounts_under(self.base)  # stargz's FUSE layers too, if its daemon did not
        problems += [f"left mounted: {mp}" for mp in left]
        for mp in left:
            kmount.umount(mp, lazy=True, missing_ok=True)
        shutil.rmtree(self.base, ignore_errors=True)
        return problems


def _snapshotter_args(peer: str) -> list[str]:
    if peer == "overlayfs":
        return []
    return ["--snapshotter", STARGZ if peer == STARGZ else "layerbox"]


def _pull(host: Host, image: Image, peer: str) -> None:
    if peer == STARGZ:  # the client-side pull that labels each layer for a remote mount
        ctr_remote(host.cd, "image", "rpull", "--plain-http", "--snapshotter", STARGZ, image.esgz_ref)
    else:
        host.cd.ctr("image", "pull", "--plain-http", *_snapshotter_args(peer), image.ref, timeout=RUN_TIMEOUT)


def _moved(host: Host, registry: RegistryServer, image: Image, peer: str, mark: int) -> dict[str, Any]:
    """Bytes from the registry since log offset ``mark`` and from the store, disk growth not yet."""
    layer_digests = {d for d, _ in image.layers_of(peer)}
    gets = [r for r in registry.responses(mark) if r.method == "GET" and r.status < 300]
    layer_bytes = sum(r.written for r in gets if r.digest in layer_digests)
    stats = host.stats()
    if stats is None and peer == "layerbox":
        raise BenchError(f"{image.name}: no lazyfetch daemon answers on {host.data_dir}")
    stats = stats or {}
    moved = {
        "registry_layer_bytes": layer_bytes,
        "registry_other_bytes": sum(r.written for r in gets) - layer_bytes,
        "registry_layer_blobs": sum(1 for r in gets if r.digest in layer_digests),
        "store_bytes_fetched": int(stats.get("bytes_fetched", 0)),
        "store_bytes_fetched_uncompressed": int(stats.get("bytes_fetched_uncompressed", 0)),
    }
    moved["transferred_bytes"] = (moved["registry_layer_bytes"] + moved["registry_other_bytes"]
                                  + moved["store_bytes_fetched"])
    return moved


def _read_all(host: Host, image: Image, peer: str) -> tuple[float, int]:
    """A second container reads every file of the image: (seconds from its first output to its
    exit, bytes read)."""
    ref = image.esgz_ref if peer == STARGZ else image.ref
    first, done, out = _run_until_output(host.cd, ["run", "--rm", *_snapshotter_args(peer), ref, "bench-read",
                                                   "sh", "-c", READ_ALL])
    lines = out.split()
    if len(lines) != 2 or lines[0] != "reading" or not lines[1].isdigit():
        raise BenchError(f"{peer} {image.name}: unexpected output of the whole-image read:\n{out}")
    return done - first, int(lines[1])


def trial(base: Path, registry: RegistryServer, image: Image, peer: str, store: str,
          problems: list[str]) -> dict[str, Any]:
    """One pull + run of ``image`` by ``peer`` on a fresh host, then a read of the whole image:
    its figures.  What its cleanup found (a shim still running, a mount left) is added to
    ``problems``."""
    own_store = peer != "layerbox"
    host = Host(base, f"file://{base}/store" if own_store else store, peer)
    try:
        host.start()
        _sync()
        before = _du(host.disk)
        mark = registry.log_path.stat().st_size
        start = time.monotonic()
        _pull(host, image, peer)
        pull = time.monotonic() - start
        ref = image.esgz_ref if peer == STARGZ else image.ref
        first, done, out = _run_until_output(host.cd, ["run", "--rm", *_snapshotter_args(peer), ref, "bench",
                                                       "sh", "-c", image.command])
        if "ID=debian" not in out or out.count("  /") != 2:
            raise BenchError(f"{peer} {image.name}: unexpected output:\n{out}")
        result: dict[str, Any] = {"pull_seconds": pull, "run_seconds": first, "total_seconds": pull + first,
                                  "run_exit_seconds": done, **_moved(host, registry, image, peer, mark)}
        _sync()
        result["disk_bytes"] = _du(host.disk) - before
        if peer == "layerbox-unpack":
            result.update(_wait_published(host, image, start, before))
        read_seconds, read_bytes = _read_all(host, image, peer)
        after = _moved(host, registry, image, peer, mark)
        _sync()
        result.update({"read_seconds": read_seconds, "read_bytes": read_bytes,
                       "transferred_bytes_after_read": after["transferred_bytes"],
                       "registry_layer_bytes_after_read": after["registry_layer_bytes"],
                       "store_bytes_fetched_after_read": after["store_bytes_fetched"],
                       "disk_bytes_after_read": _du(host.disk) - before})
        return result
    except BaseException:
        log(f"{peer} {image.name} failed; snapshotter log:\n{host.log_tail()}")
        raise
    finally:
        found = host.close()
        if found:
            log(f"{peer} {image.name}: cleanup found {found}")
            problems += [f"{peer} {image.name}: {x}" for x in found]


def _wait_published(host: Host, image: Image, start: float, before: int) -> dict[str, Any]:
    """Until the snapshotter has published the image's top layer: seconds from the pull's start."""
    deadline = time.monotonic() + PUBLISH_TIMEOUT
    while time.monotonic() < deadline:
        try:
            resolve_sync(host.sn.store, host.base / "reader", chain_ref(image.top_chain))
        except LookupError:
            time.sleep(0.5)
            continue
        seconds = time.monotonic() - start
        _sync()
        return {"publish_seconds": seconds, "store_bytes_uploaded": _du([host.base / "store"]),
                "disk_bytes_after_publish": _du(host.disk) - before}
    raise BenchError(f"{image.name} not published {PUBLISH_TIMEOUT:.0f} s after its pull:\n"
                     f"{host.sn.log_tail()}")


# -- the run ---------------------------------------------------------------------------------


def _version(argv: list[str]) -> str:
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except OSError as exc:
        return f"unavailable ({exc})"
    return (res.stdout or res.stderr).strip().splitlines()[0] if (res.stdout or res.stderr) else "?"


def check_tools() -> None:
    missing = [str(p) for p in (REGISTRY_BIN, CONTAINERD2 / "containerd", FIXTURE_ARCHIVE) if not p.exists()]
    missing += [t for t in ("skopeo", "runc", "du") if shutil.which(t) is None]
    if missing:
        raise BenchError(f"missing {', '.join(missing)}: `make deps` (containerd 2.x, docker-registry, "
                         "skopeo, runc) and the fixture (/work/shared/fixtures/README.md)")
    if os.geteuid() != 0:
        raise BenchError("containerd, overlayfs and EROFS mounts need root: run as root")


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [k for k in runs[0] if all(k in r for r in runs)]
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _prepare(base: Path, registry: RegistryServer, store: str, names: list[str], big_mb: int,
             with_stargz: bool) -> tuple[list[Image], list[dict[str, Any]]]:
    """Every image pushed to the registry and published into the store (and its eStargz copy
    pushed, ``with_stargz``): the images and their JSON description."""
    images: list[Image] = []
    probe_sizes: dict[str, int | None] = {}
    for name in names:
        start = time.monotonic()
        if name == "big":
            log(f"building the big image ({big_mb} MB of files over minbase)")
            probe, probe_bytes = _build_big(base / "big-layout", big_mb * MB)
            source = f"oci:{base / 'big-layout'}:big"
        else:
            probe, probe_bytes, source = PROBES[name], None, f"oci-archive:{FIXTURE_ARCHIVE}:{name}"
        image = _image(name, source, registry.host, probe)
        log(f"{name}: pushing to the registry and publishing into the store")
        push(source, image.ref)
        publish_sync(store, base / "publisher", source, f"bench/{name}")
        images.append(image)
        probe_sizes[name] = probe_bytes
        log(f"{name}: ready in {time.monotonic() - start:.1f} s")
    shutil.rmtree(base / "publisher", ignore_errors=True)
    if with_stargz:
        log("converting to eStargz (ctr-remote image convert --estargz --oci)")
        images = convert_esgz(base / "esgz", registry, images)
    described = [{"name": i.name, "ref": i.ref, "source": i.source, "layers": len(i.layers),
                  "layer_bytes": i.layer_bytes, "probe": i.probe, "probe_bytes": probe_sizes[i.name],
                  "command": i.command, "esgz_ref": i.esgz_ref or None,
                  "esgz_layer_bytes": sum(s for _, s in i.esgz_layers) if i.esgz_layers else None,
                  "esgz_seconds": i.esgz_seconds if i.esgz_layers else None}
                 for i in images]
    return images, described


def _results(images: list[Image], peers: list[str], runs: dict[tuple[str, str], list[dict[str, Any]]]
             ) -> list[dict[str, Any]]:
    results = []
    for image in images:
        medians = {peer: _median(runs[(image.name, peer)]) for peer in peers}
        base_m = medians.get(BASELINE, {})
        for peer in peers:
            m = medians[peer]
            results.append({
                "image": image.name, "peer": peer, **m,
                "ratios_to_overlayfs": {k: _ratio(m.get(k), base_m.get(k)) for k in (
                    "pull_seconds", "run_seconds", "total_seconds", "transferred_bytes", "disk_bytes",
                    "read_seconds", "transferred_bytes_after_read", "disk_bytes_after_read")},
                "runs": runs[(image.name, peer)],
            })
    return results


def bench(args: argparse.Namespace) -> dict[str, Any]:
    check_tools()
    names = list(args.image or FIXTURE_TAGS)
    if args.big_mb > 0:
        names.append("big")
    peers = [p for p in PEERS if p in (args.peer or PEERS)]
    skipped: dict[str, str] = {}
    if STARGZ in peers and (why := stargz_missing()):
        log(f"skipping the stargz peer: {why}")
        skipped[STARGZ] = why
        peers.remove(STARGZ)
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "settings": {"repeat": args.repeat, "big_mb": args.big_mb, "images": names, "peers": peers,
                     "fill_below": 0},
        "skipped": skipped,
        "environment": {
            "containerd": _version([str(CONTAINERD2 / "containerd"), "--version"]),
            "runc": _version(["runc", "--version"]),
            "registry": _version([str(REGISTRY_BIN), "--version"]),
            "stargz": None if STARGZ not in peers else _stargz_version(),
            "kernel": platform.release(), "cpus": os.cpu_count(),
        },
    }
    problems: list[str] = []
    with short_dir("lbcb-") as base, running_registry(base / "registry") as registry:
        workdir = base
        store = f"file://{base}/store"
        images, doc["images"] = _prepare(base, registry, store, names, args.big_mb, STARGZ in peers)
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for n in range(args.repeat):
            for image in images:
                for peer in peers:  # interleaved: a slow minute of the host hits every peer
                    log(f"round {n + 1}/{args.repeat}: {image.name} on {peer}")
                    result = trial(base / f"host-{n}-{image.name}-{peer}", registry, image, peer, store,
                                   problems)
                    log(f"  pull {result['pull_seconds']:.2f} s, first output {result['run_seconds']:.2f} s, "
                        f"whole image read {result['read_seconds']:.2f} s")
                    runs.setdefault((image.name, peer), []).append(result)

    left = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()
            if line.split()[1] == str(workdir) or line.split()[1].startswith(f"{workdir}/")]
    doc["cleanup"] = {"workdir": str(workdir), "workdir_removed": not workdir.exists(), "mounts_left": left,
                      "problems": problems}
    doc["results"] = _results(images, peers, runs)
    return doc


def _stargz_version() -> str:
    built = STARGZ_GRPC.parent.parent / "built-from"
    daemon = built.read_text().split() if built.exists() else ["?"]
    return f"ctr-remote {_version([str(CTR_REMOTE), '--version'])}; daemon built from {' '.join(daemon)}"


def render(doc: dict[str, Any]) -> str:
    env = doc["environment"]
    out = [f"containerd: {env['containerd']}; runc: {env['runc'].split(chr(10))[0]}; kernel {env['kernel']}, "
           f"{env['cpus']} CPUs; median of {doc['settings']['repeat']}"]
    if env.get("stargz"):
        out.append(f"stargz: {env['stargz']}")
    out += [f"skipped {peer}: {why}" for peer, why in doc["skipped"].items()]
    out.append("images: " + "; ".join(
        f"{i['name']} {i['layers']} layers {i['layer_bytes'] / MB:.1f} MB"
        + (f" (eStargz {i['esgz_layer_bytes'] / MB:.1f} MB)" if i.get("esgz_layer_bytes") else "")
        for i in doc["images"]))
    rows = []
    for r in doc["results"]:
        ratio = r["ratios_to_overlayfs"]
        rows.append([r["image"], r["peer"], _f(r["pull_seconds"]), _f(r["run_seconds"]), _f(r["total_seconds"]),
                     _f(r["registry_layer_bytes"] / MB, 1), _f(r["registry_other_bytes"] / MB, 3),
                     _f(r["store_bytes_fetched"] / MB, 1), _f(r["disk_bytes"] / MB, 1),
                     _f(ratio["total_seconds"]), _f(ratio["transferred_bytes"], 3), _f(ratio["disk_bytes"], 3),
                     _f(r.get("publish_seconds"), 1),
                     _f(r["disk_bytes_after_publish"] / MB, 1) if "disk_bytes_after_publish" in r else "-"])
    out.append(_table(["image", "peer", "pull s", "run s", "total s", "reg layers MB", "reg other MB",
                       "store MB", "disk MB", "total/ovl", "xfer/ovl", "disk/ovl", "published s",
                       "disk MB then"], rows, left=2))
    out.append("run s: ctr run start to the container's first output; total = pull + run; "
               "xfer = registry + store bytes; /ovl: ratio to overlayfs in the same run (< 1: less than overlayfs); "
               "published s: pull start to the image in the store (layerbox-unpack), disk MB then: its disk at that point")
    rows = []
    for r in doc["results"]:
        ratio = r["ratios_to_overlayfs"]
        rows.append([r["image"], r["peer"], _f(r["read_seconds"]), _f(r["read_bytes"] / MB, 1),
                     _f(r["registry_layer_bytes_after_read"] / MB, 1), _f(r["store_bytes_fetched_after_read"] / MB, 1),
                     _f(r["disk_bytes_after_read"] / MB, 1), _f(ratio["read_seconds"]),
                     _f(ratio["transferred_bytes_after_read"], 3), _f(ratio["disk_bytes_after_read"], 3)])
    out.append(_table(["image", "peer", "read s", "read MB", "reg layers MB", "store MB", "disk MB",
                       "read/ovl", "xfer/ovl", "disk/ovl"], rows, left=2))
    out.append("then a second container reads every file of the image: read s from its first output to its exit; "
               "read MB: bytes read (wc -c); reg layers, store, disk: totals since the pull's start")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", action="append", choices=FIXTURE_TAGS,
                        help="a fixture tag to measure (repeatable; default: both)")
    parser.add_argument("--peer", action="append", choices=PEERS,
                        help="a peer to run (repeatable; default: all; overlayfs is the ratios' baseline)")
    parser.add_argument("--big-mb", type=int, default=500,
                        help="MB of files in the big image's top layer (default 500; 0: no big image)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of every peer and image (median; default 3)")
    parser.add_argument("--json", action="store_true", help=f"one JSON document ({SCHEMA}) instead of the table")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.big_mb < 0:
        parser.error("--repeat must be >= 1 and --big-mb >= 0")
    old = {sig: signal.signal(sig, _terminate) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        doc = bench(args)
    except BenchError as exc:
        log(f"containerd bench: {exc}")
        return 1
    except KeyboardInterrupt:
        log("interrupted; cleaned up")
        return 130
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    emit(doc, args.json, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
