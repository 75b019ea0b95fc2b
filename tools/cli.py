"""The ``layerbox`` command line: parse arguments, call one library function, print.

Library errors (``LayerboxError``) become their message on stderr, then their
``fix`` when the message does not already say it, and the error's exit code;
nothing below ``tools/`` prints or exits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import pathlib
import stat
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from layerstore.errors import LayerboxError

IMAGE_SCHEMES = ("oci:", "oci-archive:", "docker-archive:", "docker://")


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(t[:-1]) * units[t[-1]]
    return int(t)


def _env_pair(text: str) -> tuple[str, str]:
    name, eq, value = text.partition("=")
    if not eq or not name:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VALUE")
    return name, value


def cmd_convert(args: argparse.Namespace) -> int:
    if args.src.startswith(IMAGE_SCHEMES):
        from converters.oci import convert_image

        if not args.out:
            raise SystemExit("layerbox convert: an image source needs --out DIR")
        image = convert_image(args.src, args.out, chunk_size=args.chunk_size)
        print(json.dumps(image.to_json(), indent=None if args.compact else 2))
        return 0
    from converters.layer import convert

    if not (args.meta and args.blob):
        raise SystemExit("layerbox convert: a tar or directory source needs --meta OUT.erofs and --blob OUT.blob")
    result = convert(args.src, args.meta, args.blob, chunk_size=args.chunk_size)
    print(json.dumps(result.to_json()))
    return 0


def _fmt_mode(mode: int) -> str:
    return stat.filemode(mode)


def cmd_inspect(args: argparse.Namespace) -> int:
    from layerstore.erofs.reader import ErofsImage

    img = ErofsImage.open(args.image)
    rows = []
    for path, node in img.walk(args.path or "/"):
        row: dict[str, object] = {
            "path": path.decode("utf-8", "surrogateescape"),
            "mode": _fmt_mode(node.mode),
            "uid": node.uid,
            "gid": node.gid,
            "size": node.size,
            "mtime": f"{node.mtime}.{node.mtime_nsec:09d}",
            "nlink": node.nlink,
            "nid": node.nid,
        }
        if stat.S_ISLNK(node.mode):
            row["target"] = img.readlink(node.nid).decode("utf-8", "surrogateescape")
        if stat.S_ISCHR(node.mode) or stat.S_ISBLK(node.mode):
            row["rdev"] = f"{node.rdev[0]}:{node.rdev[1]}"
            if node.is_whiteout:
                row["whiteout"] = True
        if node.xattrs:
            row["xattrs"] = {k.decode("utf-8", "surrogateescape"): v.hex() if not v.isascii() else v.decode()
                             for k, v in node.xattrs.items()}
        if stat.S_ISREG(node.mode):
            row["chunks"] = [
                {"offset": c.file_offset, "length": c.length,
                 "digest": "hole" if c.hole else (c.digest.hex() if c.digest else f"block:{c.block}")}
                for c in img.chunks(node.nid)
            ]
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for row in rows:
        extra = ""
        if "target" in row:
            extra = f" -> {row['target']}"
        elif "rdev" in row:
            extra = f" [{row['rdev']}]" + (" (whiteout)" if row.get("whiteout") else "")
        print(f"{row['mode']} {row['uid']:>5}:{row['gid']:<5} {row['size']:>12} {row['path']}{extra}")
        for k, v in (row.get("xattrs") or {}).items():  # type: ignore[attr-defined]
            print(f"{'':>38}xattr {k}={v}")
        chunks = row.get("chunks") or []
        for c in chunks:  # type: ignore[attr-defined]
            print(f"{'':>38}chunk @{c['offset']} +{c['length']} {c['digest']}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from tools.demo import main as demo_main

    return demo_main(args.rest)


# -- store commands ------------------------------------------------------------------


def _open_store(args: argparse.Namespace) -> Any:
    from layerstore.store import Store

    opts: dict[str, Any] = {}
    if args.s3_endpoint:
        opts["s3_endpoint"] = args.s3_endpoint
    return Store.open(args.store, args.data_dir, **opts)


def _emit(args: argparse.Namespace, doc: Any, human: Callable[[], None]) -> None:
    if args.json:
        print(json.dumps(doc, indent=None if isinstance(doc, list) else 1, default=str))
    else:
        human()


def _progress_bar(args: argparse.Namespace) -> Any:
    if args.json or not sys.stderr.isatty():
        return contextlib.nullcontext(None)
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    return Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), transient=True, console=None)


async def _publish(args: argparse.Namespace) -> int:
    from converters.publish import publish

    async with await _open_store(args) as store:
        with _progress_bar(args) as bar:
            callback = None
            if bar is not None:
                task = bar.add_task("new chunks", total=None)
                callback = lambda _kind, n: bar.advance(task, n)  # noqa: E731
            result = await publish(store, args.src, args.name, chunk_size=args.chunk_size,
                                   platform=args.platform, progress=callback)
    doc = result.to_json()

    def human() -> None:
        mb = 1e6
        print(f"{result.name} -> {result.digest}")
        print(f"  {result.layers} layer(s), {result.files} files, {result.bytes / mb:.1f} MB of file data")
        print(f"  new to the store {result.bytes_new / mb:.1f} MB ({result.chunks_new} chunks, "
              f"{result.bytes_uploaded / mb:.1f} MB compressed); already present {result.bytes_present / mb:.1f} MB "
              f"({result.chunks_present} chunks)")
        print(f"  {result.seconds:.2f} s (convert {result.convert_seconds:.2f} s, upload {result.upload_seconds:.2f} s), "
              f"{result.requests} store requests")

    _emit(args, doc, human)
    return 0


async def _compose(args: argparse.Namespace) -> int:
    parts = {k: v for k, v in (("base", args.base), ("workspace", args.workspace), ("toolkit", args.toolkit)) if v}
    async with await _open_store(args) as store:
        ref = await store.compose(args.name, parts)
        resolved = await store.resolve(ref.digest)
    _emit(args, {"name": ref.name, "digest": ref.digest, "layers": [x.digest for x in resolved.layers]},
          lambda: print(f"{ref.name} -> {ref.digest} ({len(resolved.layers)} layers)"))
    return 0


async def _ls(args: argparse.Namespace) -> int:
    async with await _open_store(args) as store:
        refs = await store.list_refs(args.prefix or "")
    rows = [{"name": r.name, "digest": r.digest, "kind": r.kind} for r in refs]

    def human() -> None:
        for r in rows:
            print(f"{r['name']:<40} {r['kind']:<12} {r['digest']}")

    _emit(args, rows, human)
    return 0


async def _show(args: argparse.Namespace) -> int:
    async with await _open_store(args) as store:
        resolved = await store.resolve(args.ref, refresh=True)
    doc = {"digest": resolved.digest, "kind": resolved.kind,
           "layers": [layer.to_json() for layer in resolved.layers], "config": resolved.config,
           "parts": resolved.doc.get("parts"), "source": resolved.doc.get("source")}

    def human() -> None:
        print(f"{args.ref}: {resolved.kind} {resolved.digest}")
        for i, layer in enumerate(resolved.layers, 1):
            print(f"  layer {i}: {layer.digest}  {layer.files} files, {layer.bytes / 1e6:.1f} MB, "
                  f"{layer.chunks} chunks in {len(layer.packs)} pack(s)")
        for role, part in (resolved.doc.get("parts") or {}).items():
            print(f"  {role}: {part['name'] or '-'} {part['digest']}")

    _emit(args, doc, human)
    return 0


async def _verify(args: argparse.Namespace) -> int:
    from layerstore.verify import verify

    async with await _open_store(args) as store:
        report = await verify(store, args.ref)

    def human() -> None:
        print(f"checked {report.checked} objects, {report.chunks} chunks, {report.bytes / 1e6:.1f} MB")
        for p in report.problems:
            print(f"BAD {p}")
        print("ok" if report.ok else f"{len(report.problems)} problem(s)")

    _emit(args, report.to_json(), human)
    return 0 if report.ok else 3


async def _store_check(args: argparse.Namespace) -> int:
    """What the store's server does with conditional writes, probed on scratch objects."""
    async with await _open_store(args) as store:
        found = await store.check_conditional_writes()
        support = found.support
        if support is None:
            doc: dict[str, Any] = {"store": store.url, "kind": found.kind, "problems": [],
                                   "note": "conditional writes are lock files and renames on this filesystem"}
        else:
            doc = {"store": store.url, "kind": found.kind, "endpoint": found.endpoint,
                   **dataclasses.asdict(support), "if_match_spelling": support.spelling,
                   "problems": support.problems()}
    unsupported = [p for p in doc["problems"] if "(unsupported" in p]

    def human() -> None:
        print(f"{doc['store']} ({doc['kind']}{', ' + doc['endpoint'] if 'endpoint' in doc else ''})")
        if doc["kind"] == "s3":
            for name in ("if_none_match", "if_match_quoted", "if_match_bare", "stale_quoted_refused",
                         "stale_bare_refused", "missing_if_match", "multipart_if_none_match", "multipart_etag"):
                print(f"  {name:26s} {doc[name]}")
            print(f"  {'if_match_spelling':26s} {doc['if_match_spelling']}")
        else:
            print(f"  {doc['note']}")
        for problem in doc["problems"]:
            print(f"  note: {problem}")
        print("ok" if not unsupported else f"{len(unsupported)} unsupported: refs or locks are not safe here")

    _emit(args, doc, human)
    return 3 if unsupported else 0


async def _gc(args: argparse.Namespace) -> int:
    from layerstore.gc import collect

    async with await _open_store(args) as store:
        report = await collect(store, grace=args.grace, dry_run=args.dry_run,
                               stale_locks_after=args.stale_locks_after)

    def human() -> None:
        verb = "would delete" if report.dry_run else "deleted"
        print(f"{report.roots} refs reach {report.live_docs} documents, {report.live_layers} layers, "
              f"{report.live_chunks} chunks")
        print(f"{verb} {len(report.deleted)} objects, {report.deleted_bytes / 1e6:.1f} MB; "
              f"kept {report.kept_young} young unreferenced objects (grace {args.grace:.0f} s)")
        if report.partly_dead_packs:
            print(f"{report.partly_dead_packs} packs hold {report.dead_bytes_in_live_packs / 1e6:.1f} MB of dead chunks")
        for key in report.deleted if report.dry_run else []:
            print(f"  {key}")
        for what, keys in (("stale lock objects", report.stale_locks),
                           ("leftovers of interrupted writes", report.leftovers)):
            if keys:
                print(f"{verb} {len(keys)} {what}")
                for key in keys if report.dry_run else []:
                    print(f"  {key}")
        for key in report.unreadable_packs:
            print(f"KEPT {key}: its own index is unreadable (run `layerbox verify`)", file=sys.stderr)
        for key in report.disagreeing_index_copies:
            print(f"BAD {key}: differs from its pack's own index (run `layerbox verify`)", file=sys.stderr)

    _emit(args, report.to_json(), human)
    return 0


async def _tag(args: argparse.Namespace) -> int:
    async with await _open_store(args) as store:
        ref = await store.tag(args.ref, args.name)
    _emit(args, {"name": ref.name, "digest": ref.digest}, lambda: print(f"{ref.name} -> {ref.digest}"))
    return 0


async def _cache(args: argparse.Namespace) -> int:
    import shutil

    async with await _open_store(args) as store:
        path = store.cache_path
    shutil.rmtree(path, ignore_errors=True)
    rebuilt = {"dropped": str(path)}
    if args.action == "rebuild":
        async with await _open_store(args) as store:
            packs = await store.sync_index()
            refs = await store.list_refs()
            layers = 0
            for ref in refs:
                resolved = await store.resolve(ref.name, refresh=True)
                for layer in resolved.layers:
                    await store.get_meta(layer.digest)
                    layers += 1
        rebuilt.update(packs=str(packs), refs=str(len(refs)), layers=str(layers))
    _emit(args, rebuilt, lambda: print(" ".join(f"{k}={v}" for k, v in rebuilt.items())))
    return 0


# -- host commands (lazyfetch) -----------------------------------------------------------


def _host(args: argparse.Namespace) -> Any:
    from layerstore.store import default_data_dir
    from lazyfetch.mounts import HostMounts

    opts: dict[str, Any] = {}
    for name in ("cache_size", "fetch_timeout", "trace_seconds", "data_path", "fill_below", "fill_bandwidth",
                 "holder_grace", "blob_io"):
        value = getattr(args, name, None)
        if value is not None:
            opts[name] = value
    return HostMounts(args.data_dir or default_data_dir(), args.store, s3_endpoint=args.s3_endpoint,
                      daemon_options=opts)


def _snapshotter(args: argparse.Namespace) -> int:
    import logging

    from layerstore.store import default_data_dir
    from snapshots.containerd.service import serve
    from snapshots.containerd.snapshotter import Snapshotter

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    host = _host(args)
    data_dir = args.data_dir or default_data_dir()
    root = args.root or str(pathlib.Path(data_dir) / "containerd")
    snapshotter = Snapshotter(root, host, store_url=args.store, data_dir=data_dir, publish=not args.no_publish,
                              from_registry=args.from_registry)
    serve(snapshotter, args.socket, ready=lambda: print(f"serving {args.socket}", flush=True))
    return 0


async def _resolve(args: argparse.Namespace, ref: str) -> Any:
    async with await _open_store(args) as store:
        return await store.resolve(ref)


def _mount(args: argparse.Namespace) -> int:
    resolved = asyncio.run(_resolve(args, args.ref))
    result = _host(args).mount(resolved, args.mountpoint, writable=args.writable or bool(args.upper),
                               upper=args.upper)
    _emit(args, result.to_json(), lambda: print(
        f"{args.ref} ({result.digest}) mounted at {result.mountpoint}: {result.layers} layer(s), "
        f"{'writable, upper ' + str(result.upper) if result.writable else 'read-only'}, {result.seconds * 1000:.1f} ms"))
    return 0


def _umount(args: argparse.Namespace) -> int:
    host = _host(args)
    if args.all:
        n = host.umount_all(stop_daemon=True)
        _emit(args, {"unmounted": n}, lambda: print(f"unmounted {n} mount(s), daemon stopped"))
        return 0
    if not args.mountpoint:
        raise SystemExit("layerbox umount: give a MOUNTPOINT or --all")
    host.umount(args.mountpoint, discard=args.discard, lazy=args.lazy)
    _emit(args, {"unmounted": args.mountpoint}, lambda: print(f"unmounted {args.mountpoint}"))
    return 0


def _daemon_cmd(args: argparse.Namespace) -> int:
    host = _host(args)
    if args.action == "start":
        h = host.client.ensure_running(args.store, s3_endpoint=args.s3_endpoint, **host.daemon_options)
        _emit(args, h, lambda: print(f"lazyfetch daemon {h['pid']} serving {h['blobs']} through "
                                     f"{h['data_path']}" + (f" ({h['data_path_reason']})"
                                                            if h.get("data_path_reason") else "")))
    elif args.action == "stop":
        stopped = host.stop_daemon()
        _emit(args, {"stopped": stopped}, lambda: print("stopped" if stopped else "not running"))
    elif args.action == "run":
        from lazyfetch.daemon import main as daemon_main

        argv = ["--data-dir", str(host.data_dir)]
        if args.store:
            argv += ["--store", args.store]
        if args.s3_endpoint:
            argv += ["--s3-endpoint", args.s3_endpoint]
        for name, value in host.daemon_options.items():
            argv += ["--" + name.replace("_", "-"), str(value)]
        return daemon_main(argv)
    else:
        st = host.status()
        _emit(args, st, lambda: print(json.dumps(st, indent=1)))
    return 0


def _prefetch(args: argparse.Namespace) -> int:
    resolved = asyncio.run(_resolve(args, args.ref))
    host = _host(args)
    host.client.ensure_running(args.store, s3_endpoint=args.s3_endpoint, **host.daemon_options)
    reply = host.client.request("POST", "/prefetch", {"image": resolved.digest,
                                                       "layers": [x.to_json() for x in resolved.layers]})
    _emit(args, reply, lambda: print(f"{reply['fetched']} of {reply['chunks']} chunks fetched "
                                     "(the rest were cached)"))
    return 0


def _stats(args: argparse.Namespace) -> int:
    host = _host(args)
    if args.prometheus:
        print(host.client.request("GET", "/metrics"), end="")
        return 0
    st = host.client.request("GET", "/stats")

    def human() -> None:
        print(f"daemon {st['instance']} up {st['uptime']:.0f} s, {st['layers']} layer(s)")
        print(f"  hits {st['hits']}  misses {st['misses']}  store requests {st['store_requests']}  "
              f"fetched {st['bytes_fetched'] / 1e6:.1f} MB  served {st['bytes_served'] / 1e6:.1f} MB")
        print(f"  data path {st['data_path']}, blobs {st['cache'].get('bytes', 0) / 1e6:.1f} MB in "
              f"{st['cache'].get('chunks', 0)} chunks ({st['cache'].get('complete_layers', 0)} layers whole), "
              f"in flight {st['fetches_in_flight']}, corrupt {st['chunks_corrupt']}, EIO {st['read_errors']}")
        for image, n in st["bytes_fetched_per_image"].items():
            print(f"  {image}: {n / 1e6:.1f} MB fetched")

    _emit(args, st, human)
    return 0


# -- snapshots ------------------------------------------------------------------------------


def _labels(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"layerbox: --label wants KEY=VALUE, got {item!r}")
        out[key] = value
    return out


async def _checkpoint(args: argparse.Namespace) -> int:
    from snapshots.checkpoint import Snapshots

    async with await _open_store(args) as store:
        ckpt = await Snapshots(store, _host(args)).checkpoint(
            args.mountpoint, name=args.name, labels=_labels(args.label), trajectory_offset=args.trajectory_offset,
            receipt_id=args.receipt_id, policy_version=args.policy_version, caller=args.caller)
    _emit(args, ckpt.to_json(), lambda: print(
        f"{ckpt.name} -> {ckpt.digest}: {ckpt.entries} entries, {ckpt.bytes_changed / 1e6:.1f} MB changed, "
        f"{ckpt.bytes_uploaded / 1e6:.1f} MB uploaded, frozen {ckpt.freeze_seconds * 1000:.0f} ms, "
        f"total {ckpt.seconds:.2f} s"))
    return 0


async def _restore(args: argparse.Namespace) -> int:
    from snapshots.checkpoint import Snapshots

    async with await _open_store(args) as store:
        result = await Snapshots(store, _host(args)).restore(args.ref, args.mountpoint, upper=args.upper,
                                                             policy_version=args.policy_version)
    _emit(args, result.to_json(), lambda: print(
        f"{args.ref} restored at {result.mountpoint} ({result.layers} layers, upper {result.upper}, "
        f"{result.seconds * 1000:.0f} ms)"))
    return 0


async def _checkpoints(args: argparse.Namespace) -> int:
    from snapshots.checkpoint import Snapshots

    async with await _open_store(args) as store:
        rows = await Snapshots(store, _host(args)).list(args.prefix or "checkpoints/")

    def human() -> None:
        for r in rows:
            print(f"{r['name']:<40} {r['created'] or '':<21} layers {r['layers']:<3} {r['digest']}")

    _emit(args, rows, human)
    return 0


async def _squash(args: argparse.Namespace) -> int:
    from snapshots.squash import squash

    async with await _open_store(args) as store:
        result = await squash(store, args.ref, name=args.name)
    _emit(args, result, lambda: print(f"{result['name']} -> {result['digest']}: "
                                      f"{result['squashed']} checkpoint layers in one"))
    return 0


def _run_async(fn: Callable[[argparse.Namespace], Any]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        return int(asyncio.run(fn(args)))

    return run


def build_parser() -> argparse.ArgumentParser:
    from layerstore.store import default_data_dir

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--store", default=None,
                        help="store URL: file:///path or s3://bucket/prefix (default $LAYERBOX_STORE, "
                             "else the embedded file store)")
    common.add_argument("--data-dir", default=None,
                        help=f"host state: caches and mounts (default $LAYERBOX_DATA_DIR, else {default_data_dir()})")
    common.add_argument("--s3-endpoint", default=None, help="S3 endpoint URL (default $AWS_ENDPOINT_URL)")
    common.add_argument("--json", action="store_true", help="machine-readable output")

    p = argparse.ArgumentParser(prog="layerbox", description="EROFS layers and snapshots for agent sandboxes")
    sub = p.add_subparsers(dest="command", required=True)

    pub = sub.add_parser("publish", parents=[common], help="convert a source and publish it to the store")
    pub.add_argument("src", help="directory, tar/tar.gz/tar.zst, '-', oci:DIR[:TAG], oci-archive:FILE[:TAG], "
                                 "docker-archive:FILE, docker://HOST/REPO:TAG")
    pub.add_argument("--name", required=True, help="ref to create or move: REPO[:TAG]")
    pub.add_argument("--chunk-size", type=_size, default=1 << 20)
    pub.add_argument("--platform", default=None, help="os/arch[/variant] for multi-platform images")
    pub.set_defaults(func=_run_async(_publish))

    comp = sub.add_parser("compose", parents=[common], help="name a base + workspace + toolkit combination")
    comp.add_argument("name")
    comp.add_argument("--base", required=True)
    comp.add_argument("--workspace")
    comp.add_argument("--toolkit")
    comp.set_defaults(func=_run_async(_compose))

    ls = sub.add_parser("ls", parents=[common], help="list refs")
    ls.add_argument("prefix", nargs="?")
    ls.set_defaults(func=_run_async(_ls))

    show = sub.add_parser("show", parents=[common], help="show what a ref or digest resolves to")
    show.add_argument("ref")
    show.set_defaults(func=_run_async(_show))

    ver = sub.add_parser("verify", parents=[common], help="re-read objects and check every digest")
    ver.add_argument("ref", nargs="?")
    ver.set_defaults(func=_run_async(_verify))

    st = sub.add_parser("store", help="the store itself")
    sts = st.add_subparsers(dest="store_command", required=True)
    chk = sts.add_parser("check", parents=[common], help="probe what the store's server does with conditional "
                         "writes (S3: If-None-Match, If-Match spellings, multipart); exit 3 when refs are not safe")
    chk.set_defaults(func=_run_async(_store_check))

    gc = sub.add_parser("gc", parents=[common], help="delete objects no ref reaches")
    gc.add_argument("--dry-run", action="store_true")
    gc.add_argument("--grace", type=float, default=3600.0,
                    help="seconds an unreferenced object is kept (uploads in progress); also the age "
                         "of temporary files of interrupted writes that gc removes")
    gc.add_argument("--stale-locks-after", type=float, default=24 * 3600.0,
                    help="delete lock objects not refreshed for this many seconds (at least 900)")
    gc.set_defaults(func=_run_async(_gc))

    host = argparse.ArgumentParser(add_help=False)
    host.add_argument("--cache-size", type=_size, default=None, help="blob cache cap (daemon start)")
    host.add_argument("--data-path", choices=["auto", "fanotify", "fuse"], default=None,
                      help="how the kernel reads layer blobs (daemon start; default auto: fanotify "
                           "pre-content events where they work, else FUSE)")
    host.add_argument("--fill-below", type=_size, default=None,
                      help="fill images up to this size in the background after a mount (0: never)")
    host.add_argument("--fill-bandwidth", type=_size, default=None,
                      help="bytes per second the background fill may fetch")
    host.add_argument("--holder-grace", type=float, default=None,
                      help="seconds reads wait for a successor of a dead daemon before EIO")
    host.add_argument("--blob-io", choices=["buffered", "direct"], default=None,
                      help="EROFS reads blobs through the page cache (buffered, default) or with direct I/O "
                           "(direct: each byte cached once, as the file; slower re-reads)")
    host.add_argument("--fetch-timeout", type=float, default=None, help="seconds a read waits for the store")
    host.add_argument("--trace-seconds", type=float, default=None, help="access-trace window after a mount")

    mnt = sub.add_parser("mount", parents=[common, host], help="mount an image or composition lazily")
    mnt.add_argument("ref")
    mnt.add_argument("mountpoint")
    mnt.add_argument("--writable", action="store_true")
    mnt.add_argument("--upper", default=None, help="upper directory for writes (implies --writable)")
    mnt.set_defaults(func=_mount)

    um = sub.add_parser("umount", parents=[common, host], help="release a mount (and unused layers)")
    um.add_argument("mountpoint", nargs="?")
    um.add_argument("--all", action="store_true", help="every mount of this host, then stop the daemon")
    um.add_argument("--discard", action="store_true", help="also delete an upper directory layerbox created")
    um.add_argument("--lazy", action="store_true", help="detach even if busy")
    um.set_defaults(func=_umount)

    dmn = sub.add_parser("daemon", parents=[common, host], help="the host's lazyfetch daemon")
    dmn.add_argument("action", choices=["start", "stop", "status", "run"])
    dmn.set_defaults(func=_daemon_cmd)

    snr = sub.add_parser("snapshotter", parents=[common, host],
                         help="serve containerd's snapshots API (a proxy plugin) on layerbox layers")
    snr.add_argument("--socket", default="/run/layerbox/snapshotter.sock",
                     help="unix socket containerd's [proxy_plugins.layerbox] address names")
    snr.add_argument("--root", default=None,
                     help="snapshot metadata and directories (default DATA_DIR/containerd)")
    snr.add_argument("--no-publish", action="store_true",
                     help="do not publish layers containerd unpacks into the store")
    snr.add_argument("--from-registry", action="store_true",
                     help="convert a layer the store lacks straight from the registry stream (CRI pulls, "
                          "which name the image) instead of letting containerd download and unpack it")
    snr.set_defaults(func=_snapshotter)

    pf = sub.add_parser("prefetch", parents=[common, host], help="fetch a whole image into the host cache")
    pf.add_argument("ref")
    pf.set_defaults(func=_prefetch)

    stt = sub.add_parser("stats", parents=[common, host], help="daemon counters")
    stt.add_argument("--prometheus", action="store_true")
    stt.set_defaults(func=_stats)

    ck = sub.add_parser("checkpoint", parents=[common, host], help="checkpoint a writable mount")
    ck.add_argument("mountpoint")
    ck.add_argument("--name", default=None, help="ref for the checkpoint (default checkpoints/<id>:<n>)")
    ck.add_argument("--label", action="append", default=[], help="KEY=VALUE (repeatable)")
    ck.add_argument("--trajectory-offset", type=int, default=None)
    ck.add_argument("--receipt-id", default=None)
    ck.add_argument("--policy-version", default=None)
    ck.add_argument("--caller", default=None)
    ck.set_defaults(func=_run_async(_checkpoint))

    rs = sub.add_parser("restore", parents=[common, host], help="mount a checkpoint writable, on any host")
    rs.add_argument("ref")
    rs.add_argument("mountpoint")
    rs.add_argument("--upper", default=None)
    rs.add_argument("--policy-version", default=None, help="refuse unless the checkpoint was made under it")
    rs.set_defaults(func=_run_async(_restore))

    cks = sub.add_parser("checkpoints", parents=[common, host], help="list checkpoints")
    cks.add_argument("prefix", nargs="?")
    cks.set_defaults(func=_run_async(_checkpoints))

    sq = sub.add_parser("squash", parents=[common], help="merge a checkpoint chain into one layer")
    sq.add_argument("ref")
    sq.add_argument("--name", default=None, help="ref for the squashed checkpoint (default: move REF)")
    sq.set_defaults(func=_run_async(_squash))

    cache = sub.add_parser("cache", parents=[common], help="drop or rebuild this host's metadata cache")
    cache.add_argument("action", choices=["drop", "rebuild"])
    cache.set_defaults(func=_run_async(_cache))

    tag = sub.add_parser("tag", parents=[common], help="point NAME at what REF resolves to")
    tag.add_argument("ref")
    tag.add_argument("name")
    tag.set_defaults(func=_run_async(_tag))

    c = sub.add_parser("convert", help="convert a tarball, directory or OCI image into EROFS layers")
    c.add_argument("src", help="tar/tar.gz/tar.zst file, '-', a directory, or oci:DIR[:TAG] | "
                               "oci-archive:FILE[:TAG] | docker-archive:FILE")
    c.add_argument("--meta", help="output metadata image (tar or directory source)")
    c.add_argument("--blob", help="output blob (tar or directory source)")
    c.add_argument("--out", help="output directory (image source)")
    c.add_argument("--chunk-size", type=_size, default=1 << 20, help="chunk size in bytes (power of two)")
    c.add_argument("--compact", action="store_true", help="print image results on one line")
    c.set_defaults(func=cmd_convert)

    i = sub.add_parser("inspect", help="list a layer's tree from its metadata image")
    i.add_argument("image")
    i.add_argument("path", nargs="?")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_inspect)

    d = sub.add_parser("demo", help="the main job on the embedded store", add_help=False)
    d.add_argument("rest", nargs=argparse.REMAINDER)
    d.set_defaults(func=cmd_demo)
    _add_sandbox_parser(sub)
    vmp = sub.add_parser("vm", help="the microVM guest: its assets (kernel, initramfs, agent) on this host")
    vms = vmp.add_subparsers(dest="vm_command", required=True)
    va = vms.add_parser("assets", help="build (or find) the guest assets from Debian packages; prints their key")
    va.add_argument("--root", default=None, help="where they are kept (default $LAYERBOX_VM_ASSETS or "
                                                 "/var/cache/layerbox/vm)")
    va.add_argument("--offline", action="store_true", help="only find a set built before; no apt-get download")
    va.add_argument("--quiet", action="store_true", help="print nothing when the assets are already there")
    va.add_argument("--json", action="store_true")
    va.set_defaults(func=cmd_vm_assets)
    vt = vms.add_parser("templates", help="this host's templates (booted here or mapped from the store), which "
                                          "sandboxes use them, and the store's; --prune removes unused ones here")
    vt.add_argument("--data-dir", default=None, help="host state, sandboxes under DATA_DIR/sandbox")
    vt.add_argument("--store", default=None, help="store URL (default $LAYERBOX_STORE)")
    vt.add_argument("--prune", action="store_true",
                    help="remove this host's templates no sandbox uses (the store's stay: other hosts map them)")
    vt.add_argument("--json", action="store_true")
    vt.set_defaults(func=cmd_vm_templates)
    return p


def cmd_vm_templates(args: argparse.Namespace) -> int:
    from snapshots.vmstate import TEMPLATE_PREFIX

    mgr = _sandbox_manager(args)
    used: dict[str, list[str]] = {}
    for st in mgr.list():
        if st.vm is not None and st.vm.get("template"):
            used.setdefault(str(st.vm["template"]), []).append(st.id)
    local = []
    vms = mgr.backend("microvm")
    root = vms.templates_dir
    for d in sorted(root.iterdir()) if root.is_dir() else ():
        key = d.name.removesuffix(".store")
        template = vms.host_template(key) if d.is_dir() and not key.startswith(".") else None
        if template is None or template.dir != d:
            continue
        mem = template.memory.stat()
        local.append({"key": key, "source": "store" if d.name.endswith(".store") else "boot", "dir": str(d),
                      "memory_bytes": mem.st_size, "memory_allocated": mem.st_blocks * 512,
                      "shape": template.doc.get("shape"), "sandboxes": used.get(key, [])})
    pruned = vms.prune_templates(keep=list(used)) if args.prune else []

    async def store_refs() -> list[dict[str, Any]]:
        async with await mgr.open_store() as store:
            return [{"ref": r.name, "digest": r.digest}
                    for r in await store.list_refs(TEMPLATE_PREFIX)]

    stored = asyncio.run(store_refs())
    if args.json:
        print(json.dumps({"host": local, "store": stored, "pruned": pruned}, indent=1))
        return 0
    for t in local:
        print(f"{t['key']}  {t['source']:<5}  {t['memory_allocated'] / 1e6:7.1f} MB of RAM image  "
              f"{len(t['sandboxes'])} sandbox(es)  {t['dir']}")
    for r in stored:
        print(f"store  {r['ref']}  {r['digest']}")
    for name in pruned:
        print(f"pruned {name}")
    return 0


def cmd_vm_assets(args: argparse.Namespace) -> int:
    from sandbox.backends.vm import assets as vmassets

    root = pathlib.Path(args.root) if args.root else vmassets.DEFAULT_ROOT
    t = time.perf_counter()
    assets = vmassets.find(root) if args.offline else vmassets.build(root)
    took = time.perf_counter() - t
    doc = {**assets.manifest, "dir": str(assets.dir), "seconds": round(took, 3)}
    if args.json:
        print(json.dumps(doc, indent=1))
    elif not (args.quiet and took < 5):
        print(f"guest assets {assets.key} in {assets.dir}: {assets.manifest.get('kernel_package')} "
              f"{assets.manifest.get('kernel_version')}, busybox {assets.manifest.get('busybox_version')} "
              f"({took:.1f} s)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:
        # the demo owns its options (argparse REMAINDER would swallow none of them)
        from tools.demo import main as demo_main

        return demo_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except LayerboxError as exc:
        print(f"layerbox: {exc}", file=sys.stderr)
        if exc.fix and exc.fix not in str(exc):  # many messages already end with their fix
            print(f"layerbox: fix: {exc.fix}", file=sys.stderr)
        return exc.exit_code
    except FileNotFoundError as exc:
        print(f"layerbox: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0



# -- sandbox commands ------------------------------------------------------------------------
def _sandbox_manager(args: argparse.Namespace) -> Any:
    from layerstore.store import default_data_dir
    from sandbox.host.manager import SandboxManager

    return SandboxManager(args.data_dir or default_data_dir(), args.store)


def _sandbox_cmd(args: argparse.Namespace) -> int:
    from sandbox.core.model import UNCAPPED, SandboxOptions

    mgr = _sandbox_manager(args)
    action = args.sandbox_command
    if action == "create":
        options = SandboxOptions(cpu=args.cpu, memory=args.memory, pids=args.pids, disk=args.disk,
                                 cpu_class=args.cpu_class, job=args.job, lease_ttl=args.lease_ttl, ttl=args.ttl,
                                 idle_timeout=args.idle_timeout, userns=args.userns, env=dict(args.env),
                                 workdir=args.workdir, user=args.user, isolation=args.isolation,
                                 kernel=args.kernel)
        box = asyncio.run(mgr.create(args.ref, options))
        _emit(args, box.state.to_json(), lambda: print(box.id))
    elif action == "exec":
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not cmd:
            raise SystemExit("layerbox sandbox exec: give a command after --")
        # a terminal gets everything the command prints; --json keeps the first output_cap bytes
        res = mgr.get(args.id).exec(cmd, timeout=args.timeout, idempotency_key=args.idempotency_key,
                                     output_cap=args.output_cap if args.json else UNCAPPED,
                                     keep_output=args.json,
                                     on_stdout=None if args.json else sys.stdout.buffer.write,
                                     on_stderr=None if args.json else sys.stderr.buffer.write)
        if args.json:
            doc = {k: v.decode(errors="replace") if isinstance(v, bytes) else v for k, v in res.__dict__.items()}
            print(json.dumps(doc))
        return int(res.exit_code or 0) if not res.timed_out else 124
    elif action == "ls":
        states = mgr.list()
        _emit(args, [st.to_json() for st in states],
              lambda: print("\n".join(f"{st.id:<16} {st.status:<9} {st.ref}" for st in states)))
    elif action == "pause":
        _emit(args, mgr.get(args.id).pause(), lambda: None)
    elif action == "resume":
        mgr.get(args.id).resume()
    elif action == "checkpoint":
        ckpt = asyncio.run(mgr.get(args.id).checkpoint(name=args.name))
        _emit(args, ckpt.to_json(), lambda: print(f"{ckpt.name} -> {ckpt.digest}"))
    elif action == "restore":
        box = asyncio.run(mgr.restore(args.ref))
        _emit(args, box.state.to_json(), lambda: print(box.id))
    elif action == "rm":
        for sid in args.ids:
            mgr.destroy(sid)
    elif action == "reconcile":
        report = mgr.reconcile()
        _emit(args, report, lambda: print(json.dumps(report)))
    elif action == "reap":
        report = mgr.reap()
        _emit(args, report, lambda: print(json.dumps(report)))
    elif action == "receipts":
        if args.verify:  # the whole log's chain; a broken one is an error naming the record
            checked = mgr.verify_receipts(args.id)
            _emit(args, checked, lambda: print(f"{checked['records']} records, chain intact, head {checked['head']}"))
        else:
            rows = mgr.receipts(args.id)
            _emit(args, rows, lambda: print("\n".join(json.dumps(r, sort_keys=True) for r in rows)))
    elif action == "renew":
        lease = mgr.renew(args.job, args.ttl)
        until = time.strftime('%H:%M:%S', time.localtime(lease['expires']))
        _emit(args, lease, lambda: print(f"{args.job} until {until}"))
    elif action in ("pause-job", "resume-job"):
        ids = mgr.pause_job(args.job) if action == "pause-job" else mgr.resume_job(args.job)
        _emit(args, ids, lambda: print("\n".join(ids)))
    elif action == "preempt":
        from sandbox.host.runs import preempt

        run = asyncio.run(preempt(mgr, args.job, timeout=args.grace))
        _emit(args, run.to_json(), lambda: print(f"{run.ref} -> {run.digest} ({len(run.sandboxes)} sandboxes, "
                                                 f"{run.seconds:.2f}s)"))
    elif action == "resume-run":
        from sandbox.host.runs import resume_run

        run = asyncio.run(resume_run(mgr, args.manifest))
        _emit(args, run.to_json(), lambda: print("\n".join(f"{old} -> {new}" for old, new in run.sandboxes.items())))
    return 0


def _add_sandbox_parser(sub: Any) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--store", default=None, help="store URL (default $LAYERBOX_STORE)")
    common.add_argument("--data-dir", default=None, help="host state, sandboxes under DATA_DIR/sandbox")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    sb = sub.add_parser("sandbox", help="run sandboxes (crun) on images and checkpoints")
    sbs = sb.add_subparsers(dest="sandbox_command", required=True)
    c = sbs.add_parser("create", parents=[common], help="start a sandbox on REF; prints its id")
    c.add_argument("ref")
    c.add_argument("--memory", type=_size, default=512 << 20)
    c.add_argument("--cpu", type=float, default=1.0)
    c.add_argument("--pids", type=int, default=256)
    c.add_argument("--disk", type=_size, default=None, help="size of the sandbox's own writable disk")
    c.add_argument("--cpu-class", choices=("latency", "best-effort"), default="latency")
    c.add_argument("--job", default=None, help="the job (lease) the sandbox belongs to")
    c.add_argument("--lease-ttl", type=float, default=None, help="seconds the job's lease lasts without renewal")
    c.add_argument("--ttl", type=float, default=None, help="destroy after this many seconds")
    c.add_argument("--idle-timeout", type=float, default=None, help="pause after this many idle seconds")
    c.add_argument("--userns", action="store_true",
                   help="run in a user namespace: root inside is an unprivileged host uid (its own range)")
    c.add_argument("--env", type=_env_pair, action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable of every command (repeatable)")
    c.add_argument("--workdir", default=None, help="the working directory of every command")
    c.add_argument("--user", default=None, help="user[:group] every command runs as (name or id)")
    c.add_argument("--isolation", choices=("container", "microvm", "vm"), default="container",
                   help="a crun container, a QEMU microvm, or a full q35 VM (each VM with its own guest kernel)")
    c.add_argument("--kernel", choices=("layerbox", "image"), default="layerbox",
                   help="the kernel a VM boots: layerbox's, or the image's own /vmlinuz (--isolation vm)")
    e = sbs.add_parser("exec", parents=[common], help="run a command: exec [--data-dir D --store URL --timeout S] ID -- CMD...")
    e.add_argument("id")
    e.add_argument("--timeout", type=float, default=None)
    e.add_argument("--idempotency-key", default=None, help="never run a command with this key twice")
    e.add_argument("--output-cap", type=_size, default=1 << 20, help="bytes per stream kept with --json")
    e.add_argument("cmd", nargs=argparse.REMAINDER)
    sbs.add_parser("ls", parents=[common], help="list sandboxes")
    for name in ("pause", "resume"):
        sbs.add_parser(name, parents=[common], help=f"{name} a sandbox").add_argument("id")
    ck = sbs.add_parser("checkpoint", parents=[common], help="checkpoint a sandbox's rootfs")
    ck.add_argument("id")
    ck.add_argument("--name", default=None)
    rs = sbs.add_parser("restore", parents=[common], help="start a sandbox on a checkpoint")
    rs.add_argument("ref")
    rm = sbs.add_parser("rm", parents=[common], help="destroy sandboxes")
    rm.add_argument("ids", nargs="+")
    sbs.add_parser("reconcile", parents=[common], help="adopt or clean up after a crashed manager")
    sbs.add_parser("reap", parents=[common], help="destroy expired sandboxes (TTL, lease), pause idle ones")
    sp = sbs.add_parser("receipts", parents=[common], help="a sandbox's receipts, one JSON per line")
    sp.add_argument("id")
    sp.add_argument("--verify", action="store_true", help="check the log's hash chain instead of printing it")
    rn = sbs.add_parser("renew", parents=[common], help="renew a job's lease")
    rn.add_argument("job")
    rn.add_argument("--ttl", type=float, default=None)
    for name in ("pause-job", "resume-job"):
        sbs.add_parser(name, parents=[common], help=f"{name.split('-')[0]} every sandbox of a job").add_argument("job")
    pe = sbs.add_parser("preempt", parents=[common], help="checkpoint a job into a run manifest, free the host")
    pe.add_argument("job")
    pe.add_argument("--grace", type=float, default=30.0, help="seconds in-flight commands may still run")
    rr = sbs.add_parser("resume-run", parents=[common], help="restore a preempted job from its run manifest")
    rr.add_argument("manifest")
    sb.set_defaults(func=_sandbox_cmd)

if __name__ == "__main__":
    sys.exit(main())
