"""Benchmark: what a layerbox store holds and costs, against what a registry would hold.

One run publishes, into each backend (a ``file://`` store on disk and an
``s3://`` store on a moto server started for the run):

* the **fixture images** (``minbase`` and ``python`` of the shared OCI
  archive) and a **toolkit** image made of the ``python`` tag's python layer,
  or, when the fixture is absent, a small generated base and toolkit;
* **workspaces**: real source trees, one per Python package copied from this
  interpreter's site-packages (``workspace/<pkg>/...``), plus a few *versions*
  (each one the previous version plus one changed file, like commits of one
  repository), each published as ``ws/<pkg>[:vN]`` and composed with the base
  and the toolkit as ``env/<pkg>[:vN]``;

then measures the store's size (by listing it) against the gzip layers a
registry would hold and against the naive product (every environment as a
full image), publish throughput and requests, the cost of a one-file change
to a small and a large workspace (against publishing the same tree into an
empty store, and against re-tarring it for a registry), and a second host
resolving the environments with an empty cache, then a warm one.

Run ``python bench/store.py --help``; bench/README.md explains every number.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import hashlib
import io
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

import zstandard

if __package__ in (None, ""):  # run as a script: import the checkout, installed or not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import (  # shared by the benchmarks
    BenchError,
    _f,
    _table,
    aws_environment,
    emit,
    log,
    rate,
    remove_tree,
    workspace,
)

from converters.errors import ConvertError  # noqa: E402
from converters.oci import inspect_image  # noqa: E402
from converters.publish import PublishResult, publish  # noqa: E402
from layerstore.backend import Backend, ObjectInfo  # noqa: E402
from layerstore.errors import LayerstoreError  # noqa: E402
from layerstore.store import Store  # noqa: E402

SCHEMA = "layerbox.bench.store.v1"
MB = 1_000_000
READ_SIZE = 1 << 20
GZIP_LEVEL = 6  # `gzip`'s and `tar -z`'s default; Docker's default compression is the same level
S3_LIST_PAGE = 1000  # keys per ListObjectsV2 response
FIXTURE_NAME = "debian-bookworm.oci.tar"
# Real source trees, in the order they are picked (those missing from site-packages are skipped).
PACKAGES = (
    "rich", "botocore", "aiohttp", "hypothesis", "moto", "zstandard", "lmdb", "pygments",
    "boto3", "s3transfer", "yaml", "jinja2", "werkzeug", "flask", "click", "requests",
    "urllib3", "multidict", "yarl", "packaging", "jsonschema", "pyparsing", "networkx",
    "cryptography", "pydantic", "sympy",
)
LARGE_EDIT = "botocore"  # the one-file change in a large workspace (else the largest one)
SKIP = shutil.ignore_patterns("__pycache__", "*.pyc")  # a source tree, not an installed one



# -- what a registry would hold -------------------------------------------------------------


@dataclass
class RegistryLayer:
    """One distinct layer as a registry stores it: a gzip tarball."""

    key: str  # the OCI digest, or the name of the tree it was made from
    label: str
    gzip_bytes: int
    tar_bytes: int  # uncompressed tar stream
    gzip_seconds: float | None = None  # tar + gzip of the tree, when we made it


@dataclass
class Source:
    """Something the benchmark publishes."""

    name: str  # the ref in the store
    src: str  # what publish() gets
    kind: str  # "image", "workspace", "version" or "edit"
    layers: list[str]  # RegistryLayer keys: what a registry holds for it
    env: str = ""  # the composition of a workspace
    package: str = ""
    parent: str = ""  # versions and edits: the workspace they change
    changed_file: str = ""  # versions and edits: the file that differs from the parent
    changed_file_bytes: int = 0  # its size after the change
    role: str = ""  # edits: "small" or "large" workspace


@dataclass
class Inputs:
    fixture: str  # the archive's path, or "generated"
    layers: dict[str, RegistryLayer]
    images: list[Source]  # fixture images and the toolkit (or the generated two)
    base: str  # refs composed under / over every workspace
    toolkit: str
    base_layers: list[str]
    toolkit_layers: list[str]
    workspaces: list[Source]  # packages, then versions
    edits: list[Source] = field(default_factory=list)  # the timed one-file changes

    def gz(self, keys: Sequence[str]) -> int:
        return sum(self.layers[k].gzip_bytes for k in keys)

    def tar(self, keys: Sequence[str]) -> int:
        return sum(self.layers[k].tar_bytes for k in keys)

    def registry_bytes(self) -> int:
        """Distinct layers of everything published: a registry dedups equal layer digests only."""
        keys = {k for s in [*self.images, *self.workspaces] for k in s.layers}
        return self.gz(sorted(keys))

    def product_bytes(self) -> int:
        """Every environment as one full image (base + toolkit + workspace layers), none shared."""
        return sum(self.gz([*self.base_layers, *self.toolkit_layers, *w.layers]) for w in self.workspaces)


def tar_gzip_size(tree: Path, top: str) -> tuple[int, int, float]:
    """(tar bytes, gzip bytes, seconds) of ``tar -cz`` of ``tree/top``: the layer a registry holds.

    GNU tar writes the archive (sorted names, numeric root owner, as a
    reproducible image build would); zlib at gzip's default level compresses
    it here, which is what ``gzip -6`` does, without a second process.
    """
    argv = ["tar", "--sort=name", "--owner=0", "--group=0", "--numeric-owner", "-cf", "-",
            "-C", str(tree), top]
    comp = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    raw = packed = 0
    start = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=err, start_new_session=True)
        except OSError as exc:
            raise BenchError(f"cannot run tar: {exc.strerror} (apt-get install tar)") from None
        try:
            assert proc.stdout is not None
            with proc.stdout:
                while block := proc.stdout.read(READ_SIZE):
                    raw += len(block)
                    packed += len(comp.compress(block))
            packed += len(comp.flush())
            rc = proc.wait()
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        if rc != 0:
            err.seek(0)
            raise BenchError(f"{' '.join(argv)} failed ({rc}): {err.read()[-2000:].decode(errors='replace')}")
    return raw, packed, time.perf_counter() - start


def inflated_size(f: BinaryIO) -> int:
    """Bytes of the tar stream inside a gzip or zstd (or plain) layer blob."""
    head = f.read(4)
    f.seek(-len(head), io.SEEK_CUR)
    if head.startswith(b"\x1f\x8b"):
        with gzip.GzipFile(fileobj=f) as g:
            return sum(len(b) for b in iter(lambda: g.read(READ_SIZE), b""))
    if head.startswith(b"\x28\xb5\x2f\xfd"):
        with zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True) as z:
            return sum(len(b) for b in iter(lambda: z.read(READ_SIZE), b""))
    return sum(len(b) for b in iter(lambda: f.read(READ_SIZE), b""))


def _member_name(name: str) -> str:
    return "/".join(p for p in PurePosixPath(name).parts if p not in ("", ".", "/"))


def fixture_inputs(archive: Path, work: Path) -> tuple[dict[str, RegistryLayer], list[Source], Path]:
    """The fixture's layers as a registry holds them, its two images, and the toolkit layer file."""
    images = []
    blobs: dict[str, str] = {}  # digest -> path in the archive
    order: list[str] = []
    for tag in ("minbase", "python"):
        ref = f"oci-archive:{archive}:{tag}"
        try:
            resolved = inspect_image(ref)
        except ConvertError as exc:
            raise BenchError(f"{archive}: {exc}") from None
        digests = [layer.digest for layer in resolved.layers]
        for layer in resolved.layers:
            if layer.digest not in blobs:
                blobs[layer.digest] = layer.path
                order.append(layer.digest)
        images.append(Source(f"debian/{tag}", ref, "image", digests))
    base_digests = set(images[0].layers)
    toolkit_digest = next((d for d in images[1].layers if d not in base_digests), None)
    if toolkit_digest is None:
        raise BenchError(f"{archive}: the python tag has no layer of its own to use as the toolkit")
    toolkit_file = work / "toolkit-python.tar.gz"
    layers: dict[str, RegistryLayer] = {}
    with tarfile.open(archive, "r:") as tar:
        members = {_member_name(m.name): m for m in tar.getmembers()}
        for n, digest in enumerate(order, 1):
            member = members.get(_member_name(blobs[digest]))
            f = tar.extractfile(member) if member is not None else None
            if f is None:
                raise BenchError(f"{archive}: layer blob {blobs[digest]} is missing")
            with f:
                tar_bytes = inflated_size(f)
            layers[digest] = RegistryLayer(digest, f"fixture layer {n} {digest[7:19]}", member.size, tar_bytes)
        member = members[_member_name(blobs[toolkit_digest])]
        src = tar.extractfile(member)
        assert src is not None
        sha = hashlib.sha256()
        with src, toolkit_file.open("wb") as out:
            while block := src.read(READ_SIZE):
                sha.update(block)
                out.write(block)
    if "sha256:" + sha.hexdigest() != toolkit_digest:
        raise BenchError(f"{archive}: layer {toolkit_digest} does not match its digest; the archive is corrupt")
    toolkit = Source("toolkit/python", str(toolkit_file), "image", [toolkit_digest])
    return layers, [*images, toolkit], toolkit_file


def generated_layer(path: Path, seed: int, top: str, files: int) -> RegistryLayer:
    """A small deterministic layer (text and binary files) as a .tar.gz, when the fixture is absent."""
    rng = random.Random(seed)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(3000)]
    raw = path.with_suffix("")  # .tar
    with tarfile.open(raw, "w", format=tarfile.PAX_FORMAT) as tar:
        for i in range(files):
            if i % 10 == 9:
                data = rng.randbytes(rng.randint(16 << 10, 192 << 10))
                name = f"{top}/lib/d{i % 16:02d}/lib{i:04d}.so"
            else:
                data = (" ".join(rng.choices(words, k=rng.randint(100, 3000))) + "\n").encode()
                name = f"{top}/share/d{i % 16:02d}/doc{i:04d}.txt"
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
    start = time.perf_counter()
    with raw.open("rb") as f, gzip.GzipFile(path, "wb", compresslevel=GZIP_LEVEL, mtime=0) as out:
        shutil.copyfileobj(f, out, READ_SIZE)
    seconds = time.perf_counter() - start
    layer = RegistryLayer(path.name, f"generated {top}", path.stat().st_size, raw.stat().st_size, seconds)
    raw.unlink()
    return layer


def find_fixture(option: str | None) -> Path | None:
    if option == "none":
        return None
    if option:
        path = Path(option)
        if not path.is_file():
            raise BenchError(f"--fixture {option}: no such file (pass the oci-archive, or 'none')")
        return path
    here = Path(__file__).resolve().parents[1]
    for candidate in (here.parent / "shared" / "fixtures" / FIXTURE_NAME,
                      Path("/work/shared/fixtures") / FIXTURE_NAME):
        if candidate.is_file():
            return candidate
    return None


def python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if p.is_file() and not p.is_symlink())


def change_one_file(tree: Path, package: str, pick: int, note: str) -> tuple[str, int]:
    """Append a line to one .py file of the workspace: ``pick`` 0 is __init__.py (or the first)."""
    root = tree / "workspace" / package
    files = python_files(root)
    if not files:
        raise BenchError(f"{root}: no .py file to change")
    init = root / "__init__.py"
    target = init if pick == 0 and init in files else files[(pick * 7919) % len(files)]
    with target.open("a") as f:
        f.write(f"# layerbox bench: {note}\n")
    return str(target.relative_to(tree)), target.stat().st_size


def pick_packages(site: Path, count: int) -> list[str]:
    found = [p for p in PACKAGES if (site / p).is_dir() and python_files(site / p)]
    if len(found) < count:
        raise BenchError(f"{site} holds only {len(found)} of the packages this benchmark uses "
                         f"({', '.join(found)}); pass --workspaces {len(found)} or less")
    return found[:count]


def prepare_inputs(args: argparse.Namespace, work: Path) -> Inputs:
    inputs_dir = work / "inputs"
    inputs_dir.mkdir()
    fixture = find_fixture(args.fixture)
    if fixture is not None:
        log(f"fixture: {fixture} (reading its layers)")
        layers, images, _ = fixture_inputs(fixture, inputs_dir)
        base, toolkit = images[0], images[-1]
    else:
        log("fixture: absent; generating a small base and toolkit")
        base_layer = generated_layer(inputs_dir / "base.tar.gz", 1, "usr", 300)
        toolkit_layer = generated_layer(inputs_dir / "toolkit.tar.gz", 2, "opt/toolkit", 150)
        layers = {base_layer.key: base_layer, toolkit_layer.key: toolkit_layer}
        base = Source("base/generated", str(inputs_dir / "base.tar.gz"), "image", [base_layer.key])
        toolkit = Source("toolkit/generated", str(inputs_dir / "toolkit.tar.gz"), "image", [toolkit_layer.key])
        images = [base, toolkit]
    inputs = Inputs(fixture=str(fixture) if fixture else "generated", layers=layers, images=images,
                    base=base.name, toolkit=toolkit.name, base_layers=base.layers,
                    toolkit_layers=toolkit.layers, workspaces=[])

    site = Path(args.site_packages)
    packages = pick_packages(site, args.workspaces)
    trees = work / "trees"

    def add_tree(name: str, tree: Path, source: Source) -> None:
        tar_bytes, gz_bytes, seconds = tar_gzip_size(tree, "workspace")
        inputs.layers[name] = RegistryLayer(name, name, gz_bytes, tar_bytes, seconds)
        source.layers = [name]

    for package in packages:
        tree = trees / package
        shutil.copytree(site / package, tree / "workspace" / package, ignore=SKIP, symlinks=True)
        ws = Source(f"ws/{package}", str(tree), "workspace", [], env=f"env/{package}", package=package)
        add_tree(ws.name, tree, ws)
        inputs.workspaces.append(ws)
    log(f"workspaces: {len(packages)} source trees from {site}")

    # Versions: commits of one repository, each its parent plus one changed file.
    large = LARGE_EDIT if LARGE_EDIT in packages else max(
        packages, key=lambda p: inputs.layers[f"ws/{p}"].tar_bytes)
    small = next((p for p in packages if p != large), large)
    versioned = next((p for p in packages if p not in (small, large)), small)
    parent = next(w for w in inputs.workspaces if w.package == versioned)
    for v in range(2, 2 + args.versions):
        tree = trees / f"{versioned}-v{v}"
        shutil.copytree(parent.src, tree, symlinks=True)
        changed, size = change_one_file(tree, versioned, v, f"version {v}")
        ver = Source(f"ws/{versioned}:v{v}", str(tree), "version", [], env=f"env/{versioned}:v{v}",
                     package=versioned, parent=parent.name, changed_file=changed, changed_file_bytes=size)
        add_tree(ver.name, tree, ver)
        inputs.workspaces.append(ver)
        parent = ver

    # The timed one-file changes, prepared once so every backend publishes the same trees.
    for role, package in (("small", small), ("large", large)):
        if any(e.package == package for e in inputs.edits):
            continue
        tree = trees / f"{package}-edit"
        shutil.copytree(trees / package, tree, symlinks=True)
        changed, size = change_one_file(tree, package, 0, "one-file change")
        edit = Source(f"ws/{package}:edit", str(tree), "edit", [], env=f"env/{package}:edit",
                      package=package, parent=f"ws/{package}", changed_file=changed,
                      changed_file_bytes=size, role=role)
        add_tree(edit.name, tree, edit)
        inputs.edits.append(edit)
    return inputs


# -- counting the store calls -------------------------------------------------------------


class CountingBackend(Backend):
    """Counts the calls a Store makes (and the bytes they move); a listing counts one call
    per page of ``page`` keys, as S3 answers it."""

    def __init__(self, inner: Backend, page: int) -> None:
        self.inner = inner
        self.url = inner.url
        self.page = page
        self.calls: Counter[str] = Counter()
        self.bytes_in = 0
        self.bytes_out = 0
        self.sent: Counter[str] = Counter()  # bytes sent, by the key's first component

    def _send(self, key: str, data: bytes) -> None:
        self.bytes_out += len(data)
        self.sent[key.split("/", 1)[0]] += len(data)

    def snapshot(self) -> tuple[int, int, int]:
        return sum(self.calls.values()), self.bytes_in, self.bytes_out

    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        self.calls["get"] += 1
        data = await self.inner.get(key, start, end)
        self.bytes_in += len(data)
        return data

    async def head(self, key: str) -> ObjectInfo | None:
        self.calls["head"] += 1
        return await self.inner.head(key)

    async def put(self, key: str, data: bytes) -> None:
        self.calls["put"] += 1
        self._send(key, data)
        await self.inner.put(key, data)

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        self.calls["put_if_absent"] += 1
        self._send(key, data)
        return await self.inner.put_if_absent(key, data)

    async def put_conditional(self, key: str, data: bytes, if_match: str | None) -> str:
        self.calls["put_conditional"] += 1
        self._send(key, data)
        return await self.inner.put_conditional(key, data, if_match)

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        self.calls["list"] += 1
        n = 0
        async for info in self.inner.list(prefix):
            n += 1
            if n > self.page and n % self.page == 1:
                self.calls["list"] += 1
            yield info

    async def delete(self, key: str) -> None:
        self.calls["delete"] += 1
        await self.inner.delete(key)

    async def close(self) -> None:
        await self.inner.close()


async def open_store(url: str, data_dir: Path) -> tuple[Store, CountingBackend, float]:
    """A Store whose calls are counted, and the seconds its first (uncounted) call took.

    That first call (a listing of ``locks/``) sets up the client: for S3,
    boto3's client and its first connection, ~0.1-0.3 s a process pays once,
    which would otherwise land in whichever measurement comes first.
    """
    store = await Store.open(url, data_dir)
    start = time.perf_counter()
    try:
        async for _ in store.backend.list("locks/"):
            pass
    except BaseException:
        await store.close()
        raise
    setup = time.perf_counter() - start
    counter = CountingBackend(store.backend, S3_LIST_PAGE if url.startswith("s3://") else 1 << 62)
    store.backend = counter
    return store, counter, setup


# -- one backend ------------------------------------------------------------------------------


def per_mb(count: int, nbytes: int) -> float | None:
    return count / (nbytes / MB) if nbytes > 0 else None


def ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


async def publish_row(store: Store, counter: CountingBackend, source: Source, inputs: Inputs,
                      work: Path) -> dict[str, Any]:
    calls0, in0, _ = counter.snapshot()
    sent0, ops0 = Counter(counter.sent), Counter(counter.calls)
    result: PublishResult = await publish(store, source.src, source.name, work_dir=work)
    calls1, in1, _ = counter.snapshot()
    sent, ops = counter.sent - sent0, counter.calls - ops0
    tar_bytes = inputs.tar(source.layers)
    return {
        "name": source.name, "kind": source.kind, "src": source.src, "digest": result.digest,
        "layers": result.layers, "files": result.files, "file_bytes": result.bytes, "tar_bytes": tar_bytes,
        "gzip_bytes": inputs.gz(source.layers),
        "seconds": result.seconds, "convert_seconds": result.convert_seconds,
        "upload_seconds": result.upload_seconds,
        "file_mb_per_s": rate(result.bytes, result.seconds), "tar_mb_per_s": rate(tar_bytes, result.seconds),
        "chunks_new": result.chunks_new, "chunks_present": result.chunks_present,
        "bytes_new": result.bytes_new, "bytes_present": result.bytes_present,
        "bytes_uploaded": result.bytes_uploaded, "requests": result.requests,
        "requests_per_mb": per_mb(result.requests, result.bytes),
        "calls": calls1 - calls0, "calls_per_mb": per_mb(calls1 - calls0, result.bytes),
        "calls_by_op": dict(sorted(ops.items())),
        "bytes_downloaded": in1 - in0,
        # every byte sent, also of objects the store already had (put-if-absent still sends them)
        "bytes_sent": {k: sent.get(k, 0) for k in ("packs", "index", "meta", "docs", "refs", "locks")},
    }


def sum_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("files", "file_bytes", "tar_bytes", "gzip_bytes", "seconds", "convert_seconds",
            "upload_seconds", "chunks_new", "chunks_present", "bytes_new", "bytes_present",
            "bytes_uploaded", "requests", "calls")
    out: dict[str, Any] = {"count": len(rows), **{k: sum(r[k] for r in rows) for k in keys}}
    for k in ("seconds", "convert_seconds", "upload_seconds"):
        out[k] = round(out[k], 3)
    out["file_mb_per_s"] = rate(out["file_bytes"], out["seconds"])
    out["tar_mb_per_s"] = rate(out["tar_bytes"], out["seconds"])
    out["requests_per_mb"] = per_mb(out["requests"], out["file_bytes"])
    out["calls_per_mb"] = per_mb(out["calls"], out["file_bytes"])
    return out


async def store_sizes(backend: Backend) -> dict[str, Any]:
    prefixes: dict[str, dict[str, int]] = {
        p: {"objects": 0, "bytes": 0} for p in ("packs", "index", "meta", "docs", "refs", "locks")}
    async for info in backend.list(""):
        slot = prefixes.setdefault(info.key.split("/", 1)[0], {"objects": 0, "bytes": 0})
        slot["objects"] += 1
        slot["bytes"] += info.size
    return {"by_prefix": prefixes, "objects": sum(p["objects"] for p in prefixes.values()),
            "bytes": sum(p["bytes"] for p in prefixes.values())}


async def compose(store: Store, counter: CountingBackend, inputs: Inputs, ws: Source) -> tuple[float, int]:
    calls0 = counter.snapshot()[0]
    start = time.perf_counter()
    await store.compose(ws.env, {"base": inputs.base, "workspace": ws.name, "toolkit": inputs.toolkit})
    return time.perf_counter() - start, counter.snapshot()[0] - calls0


async def read_env(store: Store, counter: CountingBackend, env: str) -> dict[str, Any]:
    """What a host needs before it can mount an environment: the layer list, every layer's
    metadata image and the chunk locations (pack indexes) of its layers."""
    calls0, in0, _ = counter.snapshot()
    t0 = time.perf_counter()
    resolved = await store.resolve(env)
    t1 = time.perf_counter()
    for layer in resolved.layers:
        await store.get_meta(layer.digest)
    t2 = time.perf_counter()
    for layer in resolved.layers:
        await store.load_layer_locations(layer)
    t3 = time.perf_counter()
    calls1, in1, _ = counter.snapshot()
    return {"seconds": t3 - t0, "resolve_seconds": t1 - t0, "meta_seconds": t2 - t1,
            "index_seconds": t3 - t2, "calls": calls1 - calls0, "bytes_downloaded": in1 - in0,
            "layers": len(resolved.layers)}


async def second_host(url: str, data_dir: Path, inputs: Inputs) -> dict[str, Any]:
    store, counter, setup = await open_store(url, data_dir)
    async with store:
        rows = []
        for ws in inputs.workspaces:
            cold = await read_env(store, counter, ws.env)
            warm = await read_env(store, counter, ws.env)
            rows.append({"env": ws.env, "cold": cold, "warm": warm})

    def med(rows: list[dict[str, Any]], phase: str, key: str) -> float:
        return statistics.median(r[phase][key] for r in rows)

    rest = rows[1:] or rows
    summary = {
        "client_setup_seconds": setup,
        "first_cold": rows[0]["cold"],
        "other_cold_median": {k: med(rest, "cold", k) for k in ("seconds", "resolve_seconds", "calls",
                                                               "bytes_downloaded")},
        "warm_median": {k: med(rows, "warm", k) for k in ("seconds", "resolve_seconds", "calls",
                                                         "bytes_downloaded")},
    }
    return {"envs": rows, **summary}


async def bench_backend(kind: str, url: str, fresh_url: Callable[[], str], inputs: Inputs,
                        work: Path) -> dict[str, Any]:
    hosts = work / "hosts" / kind
    convert_dir = work / "convert"
    convert_dir.mkdir(exist_ok=True)
    store, counter, setup = await open_store(url, hosts / "publisher")
    async with store:
        images = []
        for source in inputs.images:
            log(f"[{kind}] publish {source.name}")
            images.append(await publish_row(store, counter, source, inputs, convert_dir))
        workspaces = []
        compose_seconds, compose_calls = [], []
        for ws in inputs.workspaces:
            row = await publish_row(store, counter, ws, inputs, convert_dir)
            seconds, calls = await compose(store, counter, inputs, ws)
            row["parent"], row["changed_file"] = ws.parent, ws.changed_file
            workspaces.append(row)
            compose_seconds.append(seconds)
            compose_calls.append(calls)
            log(f"[{kind}] publish {ws.name}: {row['file_bytes'] / MB:.1f} MB in {row['seconds']:.2f} s; "
                f"compose {ws.env}")
        sizes = await store_sizes(counter.inner)
        log(f"[{kind}] second host: resolving {len(inputs.workspaces)} environments")
        second = await second_host(url, hosts / "second", inputs)
        edits = []
        for edit in inputs.edits:
            log(f"[{kind}] one-file change: {edit.name}")
            row = await publish_row(store, counter, edit, inputs, convert_dir)
            row["compose_seconds"], row["compose_calls"] = await compose(store, counter, inputs, edit)
            edits.append(row)
        after = await store_sizes(counter.inner)
    for edit, row in zip(inputs.edits, edits, strict=True):
        log(f"[{kind}] the same tree into an empty store: {edit.name}")
        empty = fresh_url()
        fresh_store, fresh_counter, _ = await open_store(empty, hosts / f"fresh-{edit.package}")
        async with fresh_store:
            fresh = await publish_row(fresh_store, fresh_counter, edit, inputs, convert_dir)
        if empty.startswith("file://"):
            remove_tree(Path(empty.removeprefix("file://")))
        layer = inputs.layers[edit.name]
        row.update({
            "role": edit.role, "package": edit.package,
            "changed_file": edit.changed_file, "changed_file_bytes": edit.changed_file_bytes,
            "workspace_file_bytes": row["file_bytes"],
            "fresh": fresh,
            "edit_over_fresh": {k: ratio(row[k], fresh[k]) for k in
                                ("seconds", "convert_seconds", "upload_seconds", "bytes_new",
                                 "bytes_uploaded", "requests", "calls")},
            "registry": {"push_bytes": layer.gzip_bytes, "tar_gzip_seconds": layer.gzip_seconds,
                         "note": "a registry stores and a client pushes the whole re-made layer"},
        })
    registry, product = inputs.registry_bytes(), inputs.product_bytes()
    return {
        "url": url,
        "client_setup_seconds": setup,
        "store": sizes,
        "store_after_edits": after,
        "dedup": {
            "store_bytes": sizes["bytes"], "registry_bytes": registry, "product_bytes": product,
            "registry_over_store": ratio(registry, sizes["bytes"]),
            "product_over_store": ratio(product, sizes["bytes"]),
            "product_over_registry": ratio(product, registry),
        },
        "publish": {
            "images": images,
            "workspaces": workspaces,
            "totals": {
                "images": sum_rows(images),
                "workspaces": sum_rows([w for w in workspaces if w["kind"] == "workspace"]),
                "versions": sum_rows([w for w in workspaces if w["kind"] == "version"]),
                "all": sum_rows(images + workspaces),
            },
            "compose": {"count": len(compose_seconds), "seconds_total": sum(compose_seconds),
                        "seconds_median": statistics.median(compose_seconds),
                        "calls_median": statistics.median(compose_calls)},
        },
        "one_file_change": edits,
        "second_host": second,
    }


# -- S3 -----------------------------------------------------------------------------------------


def run_s3(inputs: Inputs, work: Path) -> dict[str, Any]:
    try:
        from tests.support.moto import MotoServer
    except ImportError as exc:
        raise BenchError(f"the s3 backend needs moto and the test support code ({exc}); "
                         "pip install -e '.[test]' moto[server], or pass --backends file") from None
    log("[s3] starting moto_server on 127.0.0.1")
    try:
        server = MotoServer()
    except (OSError, RuntimeError) as exc:
        raise BenchError(f"cannot start moto_server: {exc}") from None
    try:
        with aws_environment(server.endpoint, work):
            url = f"s3://{server.new_bucket()}/layerbox"
            result = asyncio.run(bench_backend(
                "s3", url, lambda: f"s3://{server.new_bucket()}/layerbox", inputs, work))
            result["server"] = {"endpoint": server.endpoint, "kind": "moto_server"}
            return result
    finally:
        server.stop()


def run_file(inputs: Inputs, work: Path) -> dict[str, Any]:
    stores = work / "stores"
    stores.mkdir(exist_ok=True)
    fresh = iter(range(1_000_000))
    return asyncio.run(bench_backend(
        "file", f"file://{stores / 'file'}", lambda: f"file://{stores / f'fresh-{next(fresh)}'}", inputs, work))


# -- output -------------------------------------------------------------------------------------


def _mb(n: int | float) -> str:
    return f"{n / MB:.2f}"


def _kb(n: int | float) -> str:
    return f"{n / 1000:.1f}"


def render(doc: dict[str, Any]) -> str:
    s, env, inp = doc["settings"], doc["environment"], doc["inputs"]
    backends = list(doc["backends"])
    out = [
        f"layerbox store benchmark: {s['workspaces']} workspaces + {s['versions']} versions on base "
        f"{inp['base']} + toolkit {inp['toolkit']}; backends: {', '.join(backends)}; MB = 10^6 bytes",
        f"fixture: {inp['fixture']}",
        f"workspaces: {s['site_packages']}/<pkg> (no __pycache__), as workspace/<pkg>/...",
        f"workdir: {env['workdir']}; {env['cpus']} CPUs; Python {env['python']}",
        "",
        "Layers a registry would hold (gzip level 6)",
    ]
    rows = [[r["label"], r["kind"], _mb(r["tar_bytes"]), _mb(r["gzip_bytes"]),
             _f(r["gzip_seconds"], 3)] for r in inp["layers"]]
    out.append(_table(["layer", "used by", "tar MB", "gzip MB", "tar+gzip s"], rows, left=2))
    out.append("")

    out.append("Store size (after publishing every image and workspace, before the one-file changes)")
    rows = []
    for name in backends:
        b = doc["backends"][name]
        p = b["store"]["by_prefix"]
        d = b["dedup"]
        rows.append([name, *(f"{_mb(p[k]['bytes'])} ({p[k]['objects']})" for k in ("packs", "index", "meta", "docs", "refs")),
                     _mb(d["store_bytes"]), _mb(d["registry_bytes"]), _mb(d["product_bytes"]),
                     _f(d["registry_over_store"]), _f(d["product_over_store"])])
    out.append(_table(["backend", "packs MB (n)", "index", "meta", "docs", "refs", "store MB",
                       "registry MB", "product MB", "registry/store", "product/store"], rows))
    out.append("  registry = distinct gzip layers (a registry dedups equal layer digests, not chunks); "
               f"product = {len(inp['workspaces'])} full images, base+toolkit+workspace each")
    out.append("")

    out.append("Publish (convert = lock + index sync + conversion; upload = chunks, metadata, documents, ref)")
    rows = []
    for name in backends:
        pub = doc["backends"][name]["publish"]
        for r in pub["images"]:
            rows.append(_pub_row(name, r["name"], r))
        for label in ("workspaces", "versions", "all"):
            t = pub["totals"][label]
            if t["count"]:
                rows.append(_pub_row(name, f"{label} ({t['count']})", t))
    out.append(_table(["backend", "what", "file MB", "tar MB", "s", "convert s", "upload s", "file MB/s",
                       "tar MB/s", "new MB", "uploaded MB", "req", "req/MB", "calls", "calls/MB"], rows, left=2))
    for name in backends:
        c = doc["backends"][name]["publish"]["compose"]
        out.append(f"  [{name}] compose: {c['count']} environments, {_f(c['seconds_total'], 3)} s total, "
                   f"median {_f(c['seconds_median'] * 1000, 1)} ms and {c['calls_median']:.0f} calls each")
    out.append("  req = requests PublishResult counts (packs, indexes, metadata, documents, ref); calls = every "
               "store call incl. lock, index listing, ref read (a listing = one call per 1000 keys on S3)")
    out.append("")

    out.append("Workspaces (stored MB = zstd chunks + pack index + metadata image + documents it added; "
               "then seconds, MB/s, new chunk MB and calls per backend)")
    header = ["workspace", "files", "file MB", "gzip MB", "stored MB"]
    for name in backends:
        header += [f"{name} s", "MB/s", "new MB", "calls"]
    by_backend = {n: {r["name"]: r for r in doc["backends"][n]["publish"]["workspaces"]} for n in backends}
    rows = []
    for w in inp["workspaces"]:
        first = by_backend[backends[0]][w["name"]]
        row = [w["name"] + (f" (= {w['parent']} + 1 file)" if w["parent"] else ""), str(first["files"]),
               _mb(first["file_bytes"]), _mb(first["gzip_bytes"]), _mb(first["bytes_uploaded"])]
        for name in backends:
            r = by_backend[name][w["name"]]
            row += [_f(r["seconds"], 3), _f(r["file_mb_per_s"], 1), _mb(r["bytes_new"]), str(r["calls"])]
        rows.append(row)
    out.append(_table(header, rows))
    out.append("")

    out.append("One-file change (append a line to one .py file, re-publish, re-compose) vs. the same tree "
               "into an empty store, vs. a registry")
    rows = []
    for name in backends:
        for e in doc["backends"][name]["one_file_change"]:
            f = e["fresh"]
            rows.append([
                name, f"{e['package']} ({e['role']})", _mb(e["workspace_file_bytes"]), str(e["files"]),
                f"{e['changed_file_bytes']} B",
                f"{_f(e['seconds'], 3)} ({_f(e['convert_seconds'], 3)}+{_f(e['upload_seconds'], 3)})",
                _f(e["compose_seconds"], 3), str(e["bytes_new"]), _kb(e["bytes_uploaded"]),
                _kb(e["bytes_sent"]["packs"] + e["bytes_sent"]["index"]), _kb(e["bytes_sent"]["meta"]),
                str(e["calls"]),
                f"{_f(f['seconds'], 3)} ({_f(f['convert_seconds'], 3)}+{_f(f['upload_seconds'], 3)})",
                _kb(f["bytes_uploaded"]), str(f["calls"]),
                _f(e["edit_over_fresh"]["seconds"]), _f(e["edit_over_fresh"]["bytes_uploaded"], 4),
                _kb(e["registry"]["push_bytes"]), _f(e["registry"]["tar_gzip_seconds"], 3),
            ])
    out.append(_table(["backend", "workspace", "file MB", "files", "file", "edit s (conv+upl)", "compose s",
                       "new B", "upl KB", "packs+index", "meta", "calls", "fresh s (conv+upl)", "fresh upl KB", "calls",
                       "s edit/fresh", "upl edit/fresh", "registry push KB", "tar+gzip s"], rows, left=2))
    for e in doc["backends"][backends[0]]["one_file_change"]:
        out.append(f"  {e['package']}: changed {e['changed_file']}")
    g = doc["goals"]["one_file_change"]

    def met(flag: bool) -> str:
        return "MET" if flag else "MISSED"

    out.append(f"  goals (first backend), 'proportional to the change, not to the image': new chunk bytes <= "
               f"the changed file: {met(g['data_met'])}; large/small workspace: {_f(g['size_ratio'], 1)}x the "
               f"bytes, {_f(g.get('files_ratio'), 1)}x the files; edit upload large/small "
               f"{_f(g['upload_ratio'], 2)}x ({met(g['upload_met'])}, want <= {g['want']}x); edit time "
               f"large/small {_f(g['time_ratio'], 2)}x ({met(g['time_met'])}, want <= {g['want']}x)")
    out.append("")

    out.append("Second host (empty cache): resolve the environment + fetch its layers' metadata images "
               "+ load their pack indexes")
    rows = []
    for name in backends:
        h = doc["backends"][name]["second_host"]
        first, rest, warm = h["first_cold"], h["other_cold_median"], h["warm_median"]
        rows.append([name, f"first env, cold ({h['envs'][0]['env']})", _f(first["seconds"] * 1000, 1),
                     _f(first["resolve_seconds"] * 1000, 1), str(first["calls"]), _kb(first["bytes_downloaded"])])
        rows.append([name, "other envs, cold (median)", _f(rest["seconds"] * 1000, 1),
                     _f(rest["resolve_seconds"] * 1000, 1), f"{rest['calls']:.0f}", _kb(rest["bytes_downloaded"])])
        rows.append([name, "warm (median)", _f(warm["seconds"] * 1000, 1), _f(warm["resolve_seconds"] * 1000, 2),
                     f"{warm['calls']:.0f}", _kb(warm["bytes_downloaded"])])
    out.append(_table(["backend", "", "total ms", "resolve ms", "calls", "KB fetched"], rows, left=2))
    out.append("  other envs share base and toolkit with the first: only the workspace layer is new to the host; "
               "client setup (a first listing, not in the rows): " + ", ".join(
                   f"{name} {_f(doc['backends'][name]['second_host']['client_setup_seconds'] * 1000, 1)} ms"
                   for name in backends))
    return "\n".join(out)


def _pub_row(backend: str, what: str, r: Mapping[str, Any]) -> list[str]:
    return [backend, what, _mb(r["file_bytes"]), _mb(r["tar_bytes"]), _f(r["seconds"], 3),
            _f(r["convert_seconds"], 3), _f(r["upload_seconds"], 3), _f(r["file_mb_per_s"], 1),
            _f(r["tar_mb_per_s"], 1), _mb(r["bytes_new"]), _mb(r["bytes_uploaded"]), str(r["requests"]),
            _f(r["requests_per_mb"], 3), str(r["calls"]), _f(r["calls_per_mb"], 3)]


GOAL_EDIT_RATIO = 2.0  # the large workspace's edit may cost at most this many times the small one's


def goals(backends: dict[str, Any]) -> dict[str, Any]:
    """'Proportional to the change, not to the image', on the first backend's numbers.

    * data: an edit stores no chunk bytes beyond the changed file's;
    * upload and time: the same one-line change to a workspace many times
      larger costs at most ``GOAL_EDIT_RATIO`` times as much.
    """
    edits = {e["role"]: e for e in next(iter(backends.values()))["one_file_change"]}
    small, large = edits.get("small"), edits.get("large")
    data_met = bool(edits) and all(e["bytes_new"] <= e["changed_file_bytes"] for e in edits.values())
    if not small or not large:
        return {"one_file_change": {"size_ratio": None, "upload_ratio": None, "time_ratio": None,
                                    "want": GOAL_EDIT_RATIO, "data_met": data_met,
                                    "upload_met": False, "time_met": False}}
    upload = ratio(large["bytes_uploaded"], small["bytes_uploaded"])
    seconds = ratio(large["seconds"], small["seconds"])
    return {"one_file_change": {
        "size_ratio": ratio(large["file_bytes"], small["file_bytes"]),
        "files_ratio": ratio(large["files"], small["files"]),
        "upload_ratio": upload, "time_ratio": seconds, "want": GOAL_EDIT_RATIO,
        "data_met": data_met,
        "upload_met": upload is not None and upload <= GOAL_EDIT_RATIO,
        "time_met": seconds is not None and seconds <= GOAL_EDIT_RATIO,
    }}


def describe_inputs(inputs: Inputs) -> dict[str, Any]:
    users: dict[str, list[str]] = {}
    for s in [*inputs.images, *inputs.workspaces, *inputs.edits]:
        for k in s.layers:
            users.setdefault(k, []).append(s.name)
    return {
        "fixture": inputs.fixture, "base": inputs.base, "toolkit": inputs.toolkit,
        "base_layers": inputs.base_layers, "toolkit_layers": inputs.toolkit_layers,
        "layers": [{"key": layer.key, "label": layer.label, "kind": ", ".join(users.get(layer.key, [])),
                    "tar_bytes": layer.tar_bytes, "gzip_bytes": layer.gzip_bytes,
                    "gzip_seconds": layer.gzip_seconds} for layer in inputs.layers.values()],
        "images": [{"name": s.name, "src": s.src, "layers": s.layers} for s in inputs.images],
        "workspaces": [{"name": s.name, "env": s.env, "kind": s.kind, "package": s.package,
                        "parent": s.parent, "changed_file": s.changed_file,
                        "changed_file_bytes": s.changed_file_bytes} for s in inputs.workspaces],
        "edits": [{"name": s.name, "env": s.env, "package": s.package, "parent": s.parent, "role": s.role,
                   "changed_file": s.changed_file, "changed_file_bytes": s.changed_file_bytes}
                  for s in inputs.edits],
    }


# -- command line ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench/store.py",
        description="Publish the fixture images and N workspaces (real source trees) to a file store "
        "and an S3 store; report store bytes against a registry's gzip layers, publish MB/s, "
        "requests per MB, the cost of a one-file change and a second host's cold and warm resolve.",
    )
    p.add_argument("--backends", default="file,s3", metavar="LIST",
                   help="comma-separated: file, s3 (default file,s3; s3 starts a moto server on 127.0.0.1)")
    p.add_argument("--workspaces", type=int, default=None, metavar="N",
                   help="distinct package source trees (default 20; 3 with --quick)")
    p.add_argument("--versions", type=int, default=None, metavar="V",
                   help="extra workspaces that are versions of one of them, each its parent plus one "
                   "changed file (default 3; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="3 workspaces and 1 version: a smoke test")
    p.add_argument("--fixture", default=None, metavar="PATH|none",
                   help=f"the oci-archive with tags minbase and python (default ../shared/fixtures/{FIXTURE_NAME} "
                   "if present); 'none' uses a small generated base and toolkit")
    p.add_argument("--site-packages", default=sysconfig.get_paths()["purelib"], metavar="DIR",
                   help="where the workspaces' packages are copied from (default: this interpreter's)")
    p.add_argument("--tmpdir", type=Path, default=Path("/var/tmp"), metavar="DIR",
                   help="where the stores, hosts' caches and trees go (default /var/tmp); removed at exit")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the tables")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workspaces is None:
        args.workspaces = 3 if args.quick else 20
    if args.versions is None:
        args.versions = 1 if args.quick else 3
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or any(b not in ("file", "s3") for b in backends) or len(set(backends)) != len(backends):
        print(f"bench/store.py: --backends {args.backends!r}: use file, s3 or file,s3", file=sys.stderr)
        return 2
    if args.workspaces < 2 or args.versions < 0:
        print("bench/store.py: --workspaces must be at least 2 and --versions at least 0", file=sys.stderr)
        return 2
    started = time.time()
    try:
        with workspace(args.tmpdir, "layerbox-bench-store-") as work:
            inputs = prepare_inputs(args, work)
            results: dict[str, Any] = {}
            for name in backends:
                results[name] = run_file(inputs, work) if name == "file" else run_s3(inputs, work)
            doc = {
                "schema": SCHEMA,
                "settings": {"backends": backends, "workspaces": args.workspaces, "versions": args.versions,
                             "quick": args.quick, "site_packages": args.site_packages,
                             "tmpdir": str(args.tmpdir), "gzip_level": GZIP_LEVEL},
                "environment": {"workdir": str(work), "cpus": os.cpu_count(),
                                "python": platform.python_version(), "zstandard": zstandard.__version__,
                                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
                                "wall_seconds": round(time.time() - started, 1)},
                "inputs": describe_inputs(inputs),
                "backends": results,
                "goals": goals(results),
            }
    except BenchError as exc:
        log(f"bench/store.py: {exc}")
        return 1
    except (ConvertError, LayerstoreError) as exc:
        log(f"bench/store.py: layerbox failed: {exc}")
        return 1
    except KeyboardInterrupt:
        log("bench/store.py: interrupted; stores, trees and the moto server removed")
        return 130
    emit(doc, args.json, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
