"""The ``layerbox`` command line: parse arguments, call one library function, print.

Library errors (``LayerboxError``) become their message on stderr, then their
``fix`` when the message does not already say it, and the error's exit code;
nothing below ``tools/`` prints or exits.

Every command is one row of :data:`VERBS` (a :class:`Verb`): its name, help, arguments and the
``cmd_*`` function that turns the parsed arguments into one library call and its output.
Adding a command is one function and one row; :func:`build_parser` only walks the table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import pathlib
import shutil
import stat
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from layerstore.errors import LayerboxError
from sandbox.core.sync import run_blocking

IMAGE_SCHEMES = ("oci:", "oci-archive:", "docker-archive:", "docker://")


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(t[:-1]) * units[t[-1]]
    return int(t)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be 1 or more")
    return value


def _env_pair(text: str) -> tuple[str, str]:
    name, eq, value = text.partition("=")
    if not eq or not name:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VALUE")
    return name, value


def _labels(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"layerbox: --label wants KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def _emit(args: argparse.Namespace, doc: Any, human: Callable[[], None]) -> None:
    if args.json:
        print(json.dumps(doc, indent=None if isinstance(doc, list) else 1, default=str))
    else:
        human()


def _emit_pairs(args: argparse.Namespace, doc: dict[str, str]) -> int:
    _emit(args, doc, lambda: print(" ".join(f"{k}={v}" for k, v in doc.items())))
    return 0


def _emit_json_line(args: argparse.Namespace, doc: Any) -> int:
    _emit(args, doc, lambda: print(json.dumps(doc)))
    return 0


def _emit_lines(args: argparse.Namespace, rows: list[str]) -> int:
    _emit(args, rows, lambda: print("\n".join(rows)))
    return 0


def _progress_bar(args: argparse.Namespace) -> Any:
    if args.json or not sys.stderr.isatty():
        return contextlib.nullcontext(None)
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    return Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), transient=True, console=None)


# -- local files: convert, inspect, demo -------------------------------------------------------


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


def _inspect_row(img: Any, path: bytes, node: Any) -> dict[str, object]:
    row: dict[str, object] = {
        "path": path.decode("utf-8", "surrogateescape"),
        "mode": stat.filemode(node.mode),
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
    return row


def cmd_inspect(args: argparse.Namespace) -> int:
    from layerstore.erofs.reader import ErofsImage

    img = ErofsImage.open(args.image)
    rows = [_inspect_row(img, path, node) for path, node in img.walk(args.path or "/")]
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


def cmd_gateway(args: argparse.Namespace) -> int:
    from sandbox.fleet.gateway import main as gateway_main

    return gateway_main(args.rest)


def cmd_fleet(args: argparse.Namespace) -> int:
    from tools.fleet import main as fleet_main

    return fleet_main(args.rest)


def cmd_edge(args: argparse.Namespace) -> int:
    # the same module objects as `python -m sandbox.edge` (and the tests): one entry point, two spellings
    from sandbox.edge.app import main as edge_main

    return edge_main(args.rest)


# -- store commands ------------------------------------------------------------------


def _open_store(args: argparse.Namespace) -> Any:
    from layerstore.store import Store

    opts: dict[str, Any] = {}
    if args.s3_endpoint:
        opts["s3_endpoint"] = args.s3_endpoint
    return Store.open(args.store, args.data_dir, **opts)


async def cmd_publish(args: argparse.Namespace) -> int:
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


async def cmd_compose(args: argparse.Namespace) -> int:
    parts = {k: v for k, v in (("base", args.base), ("workspace", args.workspace), ("toolkit", args.toolkit)) if v}
    async with await _open_store(args) as store:
        ref = await store.compose(args.name, parts)
        resolved = await store.resolve(ref.digest)
    _emit(args, {"name": ref.name, "digest": ref.digest, "layers": [x.digest for x in resolved.layers]},
          lambda: print(f"{ref.name} -> {ref.digest} ({len(resolved.layers)} layers)"))
    return 0


async def cmd_ls(args: argparse.Namespace) -> int:
    async with await _open_store(args) as store:
        refs = await store.list_refs(args.prefix or "")
    rows = [{"name": r.name, "digest": r.digest, "kind": r.kind} for r in refs]

    def human() -> None:
        for r in rows:
            print(f"{r['name']:<40} {r['kind']:<12} {r['digest']}")

    _emit(args, rows, human)
    return 0


async def cmd_show(args: argparse.Namespace) -> int:
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


async def cmd_verify(args: argparse.Namespace) -> int:
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


async def cmd_store_check(args: argparse.Namespace) -> int:
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


async def cmd_gc(args: argparse.Namespace) -> int:
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


async def cmd_tag(args: argparse.Namespace) -> int:
    async with await _open_store(args) as store:
        ref = await store.tag(args.ref, args.name)
    _emit(args, {"name": ref.name, "digest": ref.digest}, lambda: print(f"{ref.name} -> {ref.digest}"))
    return 0


async def _drop_cache(args: argparse.Namespace) -> str:
    async with await _open_store(args) as store:
        path = store.cache_path
    shutil.rmtree(path, ignore_errors=True)
    return str(path)


async def cmd_cache_drop(args: argparse.Namespace) -> int:
    return _emit_pairs(args, {"dropped": await _drop_cache(args)})


async def cmd_cache_rebuild(args: argparse.Namespace) -> int:
    doc = {"dropped": await _drop_cache(args)}
    async with await _open_store(args) as store:
        packs = await store.sync_index()
        refs = await store.list_refs()
        layers = 0
        for ref in refs:
            resolved = await store.resolve(ref.name, refresh=True)
            for layer in resolved.layers:
                await store.get_meta(layer.digest)
                layers += 1
    doc.update(packs=str(packs), refs=str(len(refs)), layers=str(layers))
    return _emit_pairs(args, doc)


async def _resolve(args: argparse.Namespace, ref: str) -> Any:
    async with await _open_store(args) as store:
        return await store.resolve(ref)


# -- host commands (lazyfetch) -----------------------------------------------------------


def _host(args: argparse.Namespace) -> Any:
    from layerstore.store import default_data_dir
    from lazyfetch.mounts import HostMounts

    opts: dict[str, Any] = {}
    for name in ("cache_size", "fetch_timeout", "trace_seconds", "data_path", "fill_below", "fill_bandwidth",
                 "fill_after_uses", "fill_after_seconds", "fill_max_busy", "fill_miss_bytes", "holder_grace",
                 "blob_io"):
        value = getattr(args, name, None)
        if value is not None:
            opts[name] = value
    return HostMounts(args.data_dir or default_data_dir(), args.store, s3_endpoint=args.s3_endpoint,
                      daemon_options=opts)


def _ensure_daemon(args: argparse.Namespace, host: Any) -> dict[str, Any]:
    health: dict[str, Any] = host.client.ensure_running(args.store, s3_endpoint=args.s3_endpoint,
                                                        **host.daemon_options)
    return health


def cmd_snapshotter(args: argparse.Namespace) -> int:
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


def cmd_mount(args: argparse.Namespace) -> int:
    resolved = run_blocking(_resolve(args, args.ref))
    result = _host(args).mount(resolved, args.mountpoint, writable=args.writable or bool(args.upper),
                               upper=args.upper)
    _emit(args, result.to_json(), lambda: print(
        f"{args.ref} ({result.digest}) mounted at {result.mountpoint}: {result.layers} layer(s), "
        f"{'writable, upper ' + str(result.upper) if result.writable else 'read-only'}, {result.seconds * 1000:.1f} ms"))
    return 0


def cmd_umount(args: argparse.Namespace) -> int:
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


def cmd_daemon_start(args: argparse.Namespace) -> int:
    h = _ensure_daemon(args, _host(args))
    _emit(args, h, lambda: print(f"lazyfetch daemon {h['pid']} serving {h['blobs']} through "
                                 f"{h['data_path']}" + (f" ({h['data_path_reason']})"
                                                        if h.get("data_path_reason") else "")))
    return 0


def cmd_daemon_stop(args: argparse.Namespace) -> int:
    stopped = _host(args).stop_daemon()
    _emit(args, {"stopped": stopped}, lambda: print("stopped" if stopped else "not running"))
    return 0


def cmd_daemon_status(args: argparse.Namespace) -> int:
    st = _host(args).status()

    def human() -> None:
        served = st.get("served", {})
        print(json.dumps({k: v for k, v in st.items() if k != "served"}, indent=1))
        if served:
            print(f"{'layer':<20} {'path':<8} {'present MB':>10} {'blob MB':>8} {'events':>8} "
                  f"{'store wait s':>12}  fill")
        for layer, row in served.items():
            print(f"{layer[:20]:<20} {row['data_path']:<8} {row['bytes_present'] / 1e6:>10.1f} "
                  f"{row['blob_bytes'] / 1e6:>8.1f} {row['events_served']:>8} "
                  f"{row['store_wait_seconds']:>12.3f}  {row['fill']}")

    _emit(args, st, human)
    return 0


def cmd_daemon_run(args: argparse.Namespace) -> int:
    from lazyfetch.daemon import main as daemon_main

    host = _host(args)
    argv = ["--data-dir", str(host.data_dir)]
    if args.store:
        argv += ["--store", args.store]
    if args.s3_endpoint:
        argv += ["--s3-endpoint", args.s3_endpoint]
    for name, value in host.daemon_options.items():
        argv += ["--" + name.replace("_", "-"), str(value)]
    return daemon_main(argv)


def cmd_prefetch(args: argparse.Namespace) -> int:
    resolved = run_blocking(_resolve(args, args.ref))
    host = _host(args)
    _ensure_daemon(args, host)
    reply = host.client.request("POST", "/prefetch", {"image": resolved.digest,
                                                       "layers": [x.to_json() for x in resolved.layers]})
    _emit(args, reply, lambda: print(f"{reply['fetched']} of {reply['chunks']} chunks fetched "
                                     "(the rest were cached)"))
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
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


def _sync_policy(args: argparse.Namespace) -> Any:
    """The eligibility policy the flags give, or None (every selected ref is copied)."""
    from layerstore.eligibility import Eligibility

    inline = bool(args.eligible_prefix or args.eligible_label)
    if not args.eligible_only:
        if inline or args.policy:
            raise SystemExit("layerbox sync: --policy, --eligible-prefix and --eligible-label apply with "
                             "--eligible-only; add it")
        return None
    if args.policy and inline:
        raise SystemExit("layerbox sync: give the policy as --policy FILE or as --eligible-prefix/"
                         "--eligible-label, not both")
    if args.policy:
        return Eligibility.load(args.policy)
    if not inline:
        raise SystemExit("layerbox sync: --eligible-only needs a policy: --policy FILE, or "
                         "--eligible-prefix P / --eligible-label KEY=VALUE (repeatable)")
    try:
        return Eligibility.from_flags(args.eligible_prefix, args.eligible_label, "layerbox sync")
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def _print_sync(report: Any) -> None:
    mb = 1e6
    counts = {s: len(report.with_status(s)) for s in ("copied", "moved", "unchanged", "ineligible", "conflict",
                                                      "failed")}
    print(f"{report.source} -> {report.destination}: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
          if any(counts.values()) else f"{report.source} -> {report.destination}: no refs selected")
    moved = ", ".join(f"{n} {k}" for k, n in report.moved.items() if n) or "nothing"
    print(f"  moved {moved}: {report.chunks_moved} chunks, {report.bytes_moved / mb:.1f} MB of "
          f"{report.bytes_total / mb:.1f} MB stored ({report.logical_bytes / mb:.1f} MB of file data)")
    print(f"  already there: {sum(report.skipped.values())} objects ({report.chunks_skipped} chunks); "
          f"{report.seconds:.2f} s")
    if report.chunks_redundant:
        print(f"  {report.chunks_redundant} chunks moved ({report.chunk_bytes_redundant / mb:.1f} MB) were in the "
              "destination's own packs already (a pack moves whole)")
    for ref in report.refs:
        print(f"  {ref.status:<10} {ref.name} {ref.digest}" + (f"\n             {ref.reason}" if ref.reason else ""))


async def cmd_sync(args: argparse.Namespace) -> int:
    from layerstore.replicate import replicate
    from layerstore.store import Store

    policy = _sync_policy(args)
    src_opts = {"s3_endpoint": args.s3_endpoint} if args.s3_endpoint else {}
    dst_endpoint = args.dst_s3_endpoint or args.s3_endpoint
    dst_opts = {"s3_endpoint": dst_endpoint} if dst_endpoint else {}
    async with await Store.open(args.src, args.data_dir, **src_opts) as src, \
            await Store.open(args.dst, args.data_dir, **dst_opts) as dst:
        with _progress_bar(args) as bar:
            callback = None
            if bar is not None:
                task = bar.add_task("moved", total=None)
                callback = lambda _kind, n: bar.advance(task, n)  # noqa: E731
            report = await replicate(src, dst, args.prefixes, policy=policy, force=args.force, jobs=args.jobs,
                                     progress=callback)
    _emit(args, report.to_json(), lambda: _print_sync(report))
    refused = report.with_status("conflict", "failed")
    for ref in refused:
        print(f"layerbox: sync: {ref.status} {ref.name}: {ref.reason}", file=sys.stderr)
    return 3 if refused else 0


# -- snapshots ------------------------------------------------------------------------------


async def cmd_checkpoint(args: argparse.Namespace) -> int:
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


async def cmd_restore(args: argparse.Namespace) -> int:
    from snapshots.checkpoint import Snapshots

    async with await _open_store(args) as store:
        result = await Snapshots(store, _host(args)).restore(args.ref, args.mountpoint, upper=args.upper,
                                                             policy_version=args.policy_version)
    _emit(args, result.to_json(), lambda: print(
        f"{args.ref} restored at {result.mountpoint} ({result.layers} layers, upper {result.upper}, "
        f"{result.seconds * 1000:.0f} ms)"))
    return 0


async def cmd_checkpoints(args: argparse.Namespace) -> int:
    from snapshots.checkpoint import Snapshots

    async with await _open_store(args) as store:
        rows = await Snapshots(store, _host(args)).list(args.prefix or "checkpoints/")

    def human() -> None:
        for r in rows:
            print(f"{r['name']:<40} {r['created'] or '':<21} layers {r['layers']:<3} {r['digest']}")

    _emit(args, rows, human)
    return 0


async def cmd_squash(args: argparse.Namespace) -> int:
    from snapshots.squash import squash

    async with await _open_store(args) as store:
        result = await squash(store, args.ref, name=args.name)
    _emit(args, result, lambda: print(f"{result['name']} -> {result['digest']}: "
                                      f"{result['squashed']} checkpoint layers in one"))
    return 0


# -- sandbox commands ------------------------------------------------------------------------


def _sandbox_manager(args: argparse.Namespace) -> Any:
    from layerstore.store import default_data_dir
    from sandbox.host.manager import SandboxManager

    return SandboxManager(args.data_dir or default_data_dir(), args.store)


def _sandbox_options(args: argparse.Namespace) -> Any:
    """The ``SandboxOptions`` that ``sandbox create``'s flags ask for (validated by the model)."""
    from sandbox.core import model

    given = {name: getattr(args, name) for name in _create_flags(model)}
    return model.SandboxOptions(**{**given, "env": dict(args.env)})


async def cmd_sandbox_create(args: argparse.Namespace) -> int:
    box = await _sandbox_manager(args).create(args.ref, _sandbox_options(args))
    _emit(args, box.state.to_json(), lambda: print(box.id))
    return 0


def cmd_sandbox_exec(args: argparse.Namespace) -> int:
    from sandbox.core.model import UNCAPPED

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise SystemExit("layerbox sandbox exec: give a command after --")
    # a terminal gets everything the command prints; --json keeps the first output_cap bytes
    res = _sandbox_manager(args).get(args.id).exec(
        cmd, timeout=args.timeout, idempotency_key=args.idempotency_key,
        output_cap=args.output_cap if args.json else UNCAPPED, keep_output=args.json,
        on_stdout=None if args.json else sys.stdout.buffer.write,
        on_stderr=None if args.json else sys.stderr.buffer.write)
    if args.json:
        doc = {k: v.decode(errors="replace") if isinstance(v, bytes) else v for k, v in res.__dict__.items()}
        print(json.dumps(doc))
    return int(res.exit_code or 0) if not res.timed_out else 124


def cmd_sandbox_ls(args: argparse.Namespace) -> int:
    states = _sandbox_manager(args).list()
    _emit(args, [st.to_json() for st in states],
          lambda: print("\n".join(f"{st.id:<16} {st.status:<9} {st.ref}" for st in states)))
    return 0


def cmd_sandbox_pause(args: argparse.Namespace) -> int:
    _emit(args, _sandbox_manager(args).get(args.id).pause(), lambda: None)
    return 0


def cmd_sandbox_resume(args: argparse.Namespace) -> int:
    _sandbox_manager(args).get(args.id).resume()
    return 0


async def cmd_sandbox_checkpoint(args: argparse.Namespace) -> int:
    ckpt = await _sandbox_manager(args).get(args.id).checkpoint(name=args.name)
    _emit(args, ckpt.to_json(), lambda: print(f"{ckpt.name} -> {ckpt.digest}"))
    return 0


async def cmd_sandbox_restore(args: argparse.Namespace) -> int:
    box = await _sandbox_manager(args).restore(args.ref)
    _emit(args, box.state.to_json(), lambda: print(box.id))
    return 0


def cmd_sandbox_rm(args: argparse.Namespace) -> int:
    mgr = _sandbox_manager(args)
    for sid in args.ids:
        mgr.destroy(sid)
    return 0


def cmd_sandbox_reconcile(args: argparse.Namespace) -> int:
    return _emit_json_line(args, _sandbox_manager(args).reconcile())


def cmd_sandbox_reap(args: argparse.Namespace) -> int:
    return _emit_json_line(args, _sandbox_manager(args).reap())


def cmd_sandbox_receipts(args: argparse.Namespace) -> int:
    mgr = _sandbox_manager(args)
    if args.verify:  # the whole log's chain; a broken one is an error naming the record
        checked = mgr.verify_receipts(args.id)
        _emit(args, checked, lambda: print(f"{checked['records']} records, chain intact, head {checked['head']}"))
    else:
        rows = mgr.receipts(args.id)
        _emit(args, rows, lambda: print("\n".join(json.dumps(r, sort_keys=True) for r in rows)))
    return 0


def cmd_sandbox_renew(args: argparse.Namespace) -> int:
    lease = _sandbox_manager(args).renew(args.job, args.ttl)
    until = time.strftime('%H:%M:%S', time.localtime(lease['expires']))
    _emit(args, lease, lambda: print(f"{args.job} until {until}"))
    return 0


def cmd_sandbox_pause_job(args: argparse.Namespace) -> int:
    return _emit_lines(args, _sandbox_manager(args).pause_job(args.job))


def cmd_sandbox_resume_job(args: argparse.Namespace) -> int:
    return _emit_lines(args, _sandbox_manager(args).resume_job(args.job))


async def cmd_sandbox_preempt(args: argparse.Namespace) -> int:
    from sandbox.host.runs import preempt

    # without --grace, preempt's own default: the library owns that number
    grace = {} if args.grace is None else {"timeout": args.grace}
    run = await preempt(_sandbox_manager(args), args.job, **grace)
    _emit(args, run.to_json(), lambda: print(f"{run.ref} -> {run.digest} ({len(run.sandboxes)} sandboxes, "
                                             f"{run.seconds:.2f}s)"))
    return 0


async def cmd_sandbox_resume_run(args: argparse.Namespace) -> int:
    from sandbox.host.runs import resume_run

    run = await resume_run(_sandbox_manager(args), args.manifest)
    _emit(args, run.to_json(), lambda: print("\n".join(f"{old} -> {new}" for old, new in run.sandboxes.items())))
    return 0


# -- microVM guest --------------------------------------------------------------------------


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


def _host_templates(mgr: Any, used: dict[str, list[str]]) -> list[dict[str, Any]]:
    """This host's VM templates, booted here or mapped from the store, with the sandboxes on each."""
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
    return local


async def _stored_templates(mgr: Any) -> list[dict[str, Any]]:
    from snapshots.vmstate import TEMPLATE_PREFIX

    async with await mgr.open_store() as store:
        return [{"ref": r.name, "digest": r.digest} for r in await store.list_refs(TEMPLATE_PREFIX)]


def cmd_vm_templates(args: argparse.Namespace) -> int:
    mgr = _sandbox_manager(args)
    used: dict[str, list[str]] = {}
    for st in mgr.list():
        if st.vm is not None and st.vm.get("template"):
            used.setdefault(str(st.vm["template"]), []).append(st.id)
    local = _host_templates(mgr, used)
    pruned = mgr.backend("microvm").prune_templates(keep=list(used)) if args.prune else []
    stored = run_blocking(_stored_templates(mgr))
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


# -- arguments shared by several verbs ----------------------------------------------------------

AddArguments = Callable[[argparse.ArgumentParser], None]


def arg(*flags: str, **options: Any) -> AddArguments:
    """One ``add_argument`` call, written in a row of :data:`VERBS` and made when the parser is."""

    def add(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(*flags, **options)

    return add


def _json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _store_flags(p: argparse.ArgumentParser) -> None:
    from layerstore.store import default_data_dir

    p.add_argument("--store", default=None, help="store URL: file:///path or s3://bucket/prefix (default "
                                                 "$LAYERBOX_STORE, else the embedded file store)")
    p.add_argument("--data-dir", default=None,
                   help=f"host state: caches and mounts (default $LAYERBOX_DATA_DIR, else {default_data_dir()})")
    p.add_argument("--s3-endpoint", default=None, help="S3 endpoint URL (default $AWS_ENDPOINT_URL)")
    _json_flag(p)


def _host_flags(p: argparse.ArgumentParser) -> None:
    """The lazyfetch daemon's options (``None``: the daemon's own default, or a running daemon's)."""
    from lazyfetch.fillpolicy import add_policy_flags

    p.add_argument("--cache-size", type=_size, default=None, help="blob cache cap (daemon start)")
    p.add_argument("--data-path", choices=["auto", "fanotify", "fuse"], default=None,
                   help="how the kernel reads layer blobs (daemon start; default auto: fanotify "
                        "pre-content events where they work, else FUSE)")
    p.add_argument("--fill-below", type=_size, default=None,
                   help="never fill images above this size in full (0: no background fill)")
    add_policy_flags(p, defaults=False)
    p.add_argument("--fill-bandwidth", type=_size, default=None,
                   help="bytes per second the background fill may fetch")
    p.add_argument("--holder-grace", type=float, default=None,
                   help="seconds reads wait for a successor of a dead daemon before EIO")
    p.add_argument("--blob-io", choices=["buffered", "direct"], default=None,
                   help="EROFS reads blobs through the page cache (buffered, default) or with direct I/O "
                        "(direct: each byte cached once, as the file; slower re-reads)")
    p.add_argument("--fetch-timeout", type=float, default=None, help="seconds a read waits for the store")
    p.add_argument("--trace-seconds", type=float, default=None, help="access-trace window after a mount")


def _sandbox_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", default=None, help="store URL (default $LAYERBOX_STORE)")
    p.add_argument("--data-dir", default=None, help="host state, sandboxes under DATA_DIR/sandbox")
    _json_flag(p)


def _model_defaults(cls: type) -> dict[str, Any]:
    """A dataclass's field defaults (factories called): the model is the one place they are written."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _create_flags(model: Any) -> dict[str, dict[str, Any]]:
    """``sandbox create``'s flags: each a ``SandboxOptions`` field of the same name (``--cpu-class``
    is ``cpu_class``).  The rest of the model (labels, network, policy) comes through the service."""
    return {
        "memory": {"type": _size, "help": "bytes, K/M/G suffixes allowed (default %(default)s)"},
        "cpu": {"type": float, "help": "CPUs' worth of quota (default %(default)s)"},
        "pids": {"type": int, "help": "most processes at once (default %(default)s)"},
        "disk": {"type": _size, "help": "size of the sandbox's own writable disk"},
        "cpu_class": {"choices": model.CPU_CLASSES, "help": "default %(default)s"},
        "job": {"help": "the job (lease) the sandbox belongs to"},
        "lease_ttl": {"type": float, "help": "seconds the job's lease lasts without renewal"},
        "ttl": {"type": float, "help": "destroy after this many seconds"},
        "idle_timeout": {"type": float, "help": "pause after this many idle seconds"},
        "userns": {"action": "store_true",
                   "help": "run in a user namespace: root inside is an unprivileged host uid (its own range)"},
        "env": {"type": _env_pair, "action": "append", "metavar": "NAME=VALUE",
                "help": "an environment variable of every command (repeatable)"},
        "workdir": {"help": "the working directory of every command"},
        "user": {"help": "user[:group] every command runs as (name or id)"},
        "isolation": {"choices": model.ISOLATIONS,
                      "help": "a crun container, a QEMU microvm, or a full q35 VM (each VM with its own guest "
                              "kernel; default %(default)s)"},
        "kernel": {"choices": model.KERNELS,
                   "help": "the kernel a VM boots: layerbox's, or the image's own /vmlinuz (--isolation vm; "
                           "default %(default)s)"},
    }


def _create_arguments(p: argparse.ArgumentParser) -> None:
    from sandbox.core import model

    default = _model_defaults(model.SandboxOptions)
    default["env"] = list(default["env"].items())  # --env appends NAME=VALUE pairs
    p.add_argument("ref")
    for name, options in _create_flags(model).items():
        p.add_argument("--" + name.replace("_", "-"), default=default[name], **options)


def _exec_arguments(p: argparse.ArgumentParser) -> None:
    from sandbox.core import model

    default = _model_defaults(model.ExecRequest)
    p.add_argument("id")
    p.add_argument("--timeout", type=float, default=default["timeout"])
    p.add_argument("--idempotency-key", default=default["idempotency_key"],
                   help="never run a command with this key twice")
    p.add_argument("--output-cap", type=_size, default=default["output_cap"],
                   help="bytes per stream kept with --json (default %(default)s)")
    p.add_argument("cmd", nargs=argparse.REMAINDER)


# -- the verb table -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Verb:
    """One command of ``layerbox``, or a group of them (``verbs``).

    ``run`` takes the parsed arguments and returns the exit code, or is a coroutine function
    whose result is (run on :func:`sandbox.core.sync.run_blocking`).  ``arguments`` are added in order: shared
    groups first, then the verb's own.
    """

    name: str
    help: str
    run: Callable[[argparse.Namespace], Any] | None = None
    arguments: tuple[AddArguments, ...] = ()
    verbs: tuple[Verb, ...] = ()
    # a group whose sub-verbs are the choices of one positional instead of sub-parsers, so that its
    # options go before or after the verb (`layerbox daemon --store URL start`), as scripts write them
    pick: bool = False
    add_help: bool = True

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.run)


STORE = (_store_flags,)
HOST = (_store_flags, _host_flags)
SANDBOX = (_sandbox_flags,)

SANDBOX_VERBS = (
    Verb("create", "start a sandbox on REF; prints its id", cmd_sandbox_create, (*SANDBOX, _create_arguments)),
    Verb("exec", "run a command: exec [--data-dir D --store URL --timeout S] ID -- CMD...", cmd_sandbox_exec,
         (*SANDBOX, _exec_arguments)),
    Verb("ls", "list sandboxes", cmd_sandbox_ls, SANDBOX),
    Verb("pause", "pause a sandbox", cmd_sandbox_pause, (*SANDBOX, arg("id"))),
    Verb("resume", "resume a sandbox", cmd_sandbox_resume, (*SANDBOX, arg("id"))),
    Verb("checkpoint", "checkpoint a sandbox's rootfs", cmd_sandbox_checkpoint,
         (*SANDBOX, arg("id"), arg("--name", default=None))),
    Verb("restore", "start a sandbox on a checkpoint", cmd_sandbox_restore, (*SANDBOX, arg("ref"))),
    Verb("rm", "destroy sandboxes", cmd_sandbox_rm, (*SANDBOX, arg("ids", nargs="+"))),
    Verb("reconcile", "adopt or clean up after a crashed manager", cmd_sandbox_reconcile, SANDBOX),
    Verb("reap", "destroy expired sandboxes (TTL, lease), pause idle ones", cmd_sandbox_reap, SANDBOX),
    Verb("receipts", "a sandbox's receipts, one JSON per line", cmd_sandbox_receipts, (
        *SANDBOX, arg("id"),
        arg("--verify", action="store_true", help="check the log's hash chain instead of printing it"))),
    Verb("renew", "renew a job's lease", cmd_sandbox_renew, (*SANDBOX, arg("job"), arg("--ttl", type=float, default=None))),
    Verb("pause-job", "pause every sandbox of a job", cmd_sandbox_pause_job, (*SANDBOX, arg("job"))),
    Verb("resume-job", "resume every sandbox of a job", cmd_sandbox_resume_job, (*SANDBOX, arg("job"))),
    Verb("preempt", "checkpoint a job into a run manifest, free the host", cmd_sandbox_preempt, (
        *SANDBOX, arg("job"),
        arg("--grace", type=float, default=None, help="seconds in-flight commands may still run (default: "
                                                      "sandbox.host.runs.preempt's)"))),
    Verb("resume-run", "restore a preempted job from its run manifest", cmd_sandbox_resume_run,
         (*SANDBOX, arg("manifest"))),
)

VM_VERBS = (
    Verb("assets", "build (or find) the guest assets from Debian packages; prints their key", cmd_vm_assets, (
        arg("--root", default=None, help="where they are kept (default $LAYERBOX_VM_ASSETS or /var/cache/layerbox/vm)"),
        arg("--offline", action="store_true", help="only find a set built before; no apt-get download"),
        arg("--quiet", action="store_true", help="print nothing when the assets are already there"),
        _json_flag)),
    Verb("templates", "this host's templates (booted here or mapped from the store), which sandboxes use them, "
                      "and the store's; --prune removes unused ones here", cmd_vm_templates, (
        *SANDBOX,
        arg("--prune", action="store_true",
            help="remove this host's templates no sandbox uses (the store's stay: other hosts map them)"))),
)

DAEMON_VERBS = (
    Verb("start", "start the daemon unless one runs, print its health", cmd_daemon_start),
    Verb("stop", "stop it (its holder keeps mounted layers' reads waiting)", cmd_daemon_stop),
    Verb("status", "its health and this host's mounts, layers and holds", cmd_daemon_status),
    Verb("run", "run it in the foreground", cmd_daemon_run),
)

CACHE_VERBS = (
    Verb("drop", "remove this host's metadata cache for the store", cmd_cache_drop),
    Verb("rebuild", "remove it and fill it again from the store's refs", cmd_cache_rebuild),
)

VERBS: tuple[Verb, ...] = (
    Verb("publish", "convert a source and publish it to the store", cmd_publish, (
        *STORE,
        arg("src", help="directory, tar/tar.gz/tar.zst, '-', oci:DIR[:TAG], oci-archive:FILE[:TAG], "
                        "docker-archive:FILE, docker://HOST/REPO:TAG"),
        arg("--name", required=True, help="ref to create or move: REPO[:TAG]"),
        arg("--chunk-size", type=_size, default=1 << 20),
        arg("--platform", default=None, help="os/arch[/variant] for multi-platform images"))),
    Verb("compose", "name a base + workspace + toolkit combination", cmd_compose, (
        *STORE, arg("name"), arg("--base", required=True), arg("--workspace"), arg("--toolkit"))),
    Verb("ls", "list refs", cmd_ls, (*STORE, arg("prefix", nargs="?"))),
    Verb("show", "show what a ref or digest resolves to", cmd_show, (*STORE, arg("ref"))),
    Verb("verify", "re-read objects and check every digest", cmd_verify, (*STORE, arg("ref", nargs="?"))),
    Verb("store", "the store itself", verbs=(
        Verb("check", "probe what the store's server does with conditional writes (S3: If-None-Match, "
                      "If-Match spellings, multipart); exit 3 when refs are not safe", cmd_store_check, STORE),)),
    Verb("gc", "delete objects no ref reaches", cmd_gc, (
        *STORE, arg("--dry-run", action="store_true"),
        arg("--grace", type=float, default=3600.0,
            help="seconds an unreferenced object is kept (uploads in progress); also the age "
                 "of temporary files of interrupted writes that gc removes"),
        arg("--stale-locks-after", type=float, default=24 * 3600.0,
            help="delete lock objects not refreshed for this many seconds (at least 900)"))),
    Verb("mount", "mount an image or composition lazily", cmd_mount, (
        *HOST, arg("ref"), arg("mountpoint"), arg("--writable", action="store_true"),
        arg("--upper", default=None, help="upper directory for writes (implies --writable)"))),
    Verb("umount", "release a mount (and unused layers)", cmd_umount, (
        *HOST, arg("mountpoint", nargs="?"),
        arg("--all", action="store_true", help="every mount of this host, then stop the daemon"),
        arg("--discard", action="store_true", help="also delete an upper directory layerbox created"),
        arg("--lazy", action="store_true", help="detach even if busy"))),
    Verb("daemon", "the host's lazyfetch daemon", arguments=HOST, verbs=DAEMON_VERBS, pick=True),
    Verb("snapshotter", "serve containerd's snapshots API (a proxy plugin) on layerbox layers", cmd_snapshotter, (
        *HOST,
        arg("--socket", default="/run/layerbox/snapshotter.sock",
            help="unix socket containerd's [proxy_plugins.layerbox] address names"),
        arg("--root", default=None, help="snapshot metadata and directories (default DATA_DIR/containerd)"),
        arg("--no-publish", action="store_true", help="do not publish layers containerd unpacks into the store"),
        arg("--from-registry", action="store_true",
            help="convert a layer the store lacks straight from the registry stream (CRI pulls, "
                 "which name the image) instead of letting containerd download and unpack it"))),
    Verb("prefetch", "fetch a whole image into the host cache", cmd_prefetch, (*HOST, arg("ref"))),
    Verb("stats", "daemon counters", cmd_stats, (*HOST, arg("--prometheus", action="store_true"))),
    Verb("checkpoint", "checkpoint a writable mount", cmd_checkpoint, (
        *HOST, arg("mountpoint"),
        arg("--name", default=None, help="ref for the checkpoint (default checkpoints/<id>:<n>)"),
        arg("--label", action="append", default=[], help="KEY=VALUE (repeatable)"),
        arg("--trajectory-offset", type=int, default=None), arg("--receipt-id", default=None),
        arg("--policy-version", default=None), arg("--caller", default=None))),
    Verb("restore", "mount a checkpoint writable, on any host", cmd_restore, (
        *HOST, arg("ref"), arg("mountpoint"), arg("--upper", default=None),
        arg("--policy-version", default=None, help="refuse unless the checkpoint was made under it"))),
    Verb("checkpoints", "list checkpoints", cmd_checkpoints, (*HOST, arg("prefix", nargs="?"))),
    Verb("squash", "merge a checkpoint chain into one layer", cmd_squash, (
        *STORE, arg("ref"), arg("--name", default=None, help="ref for the squashed checkpoint (default: move REF)"))),
    Verb("cache", "drop or rebuild this host's metadata cache", arguments=STORE, verbs=CACHE_VERBS, pick=True),
    Verb("tag", "point NAME at what REF resolves to", cmd_tag, (*STORE, arg("ref"), arg("name"))),
    Verb("sync", "copy refs (images, compositions, checkpoints) to another store, moving only the objects it "
                 "lacks; exit 3 when a ref was refused", cmd_sync, (
        arg("src", help="source store URL: file:///path, /path or s3://bucket/prefix"),
        arg("dst", help="destination store URL (the same forms)"),
        arg("prefixes", nargs="*", metavar="REF_PREFIX", help="copy refs whose name starts with one (default: all)"),
        arg("--eligible-only", action="store_true", help="copy only refs the eligibility policy allows"),
        arg("--eligible-prefix", action="append", default=[], metavar="P",
            help="policy: refs starting with P are eligible (repeatable)"),
        arg("--eligible-label", action="append", default=[], metavar="KEY=VALUE",
            help="policy: images whose OCI config carries this label are eligible (repeatable)"),
        arg("--policy", default=None, metavar="FILE", help="policy: a layerbox.eligibility.v1 JSON file"),
        arg("--force", action="store_true", help="move destination refs that name another document"),
        arg("--jobs", type=_positive, default=8, help="objects in transfer at once"),
        arg("--data-dir", default=None, help="host state: both stores' metadata caches"),
        arg("--s3-endpoint", default=None, help="S3 endpoint URL (default $AWS_ENDPOINT_URL)"),
        arg("--dst-s3-endpoint", default=None, help="the destination's S3 endpoint, when it differs"),
        _json_flag)),
    Verb("convert", "convert a tarball, directory or OCI image into EROFS layers", cmd_convert, (
        arg("src", help="tar/tar.gz/tar.zst file, '-', a directory, or oci:DIR[:TAG] | "
                        "oci-archive:FILE[:TAG] | docker-archive:FILE"),
        arg("--meta", help="output metadata image (tar or directory source)"),
        arg("--blob", help="output blob (tar or directory source)"),
        arg("--out", help="output directory (image source)"),
        arg("--chunk-size", type=_size, default=1 << 20, help="chunk size in bytes (power of two)"),
        arg("--compact", action="store_true", help="print image results on one line"))),
    Verb("inspect", "list a layer's tree from its metadata image", cmd_inspect, (
        arg("image"), arg("path", nargs="?"), arg("--json", action="store_true"))),
    # main() hands `demo ...` to the demo before parsing; the row lists it and keeps `layerbox -h` honest
    Verb("demo", "the main job on the embedded store", cmd_demo, (arg("rest", nargs=argparse.REMAINDER),),
         add_help=False),
    Verb("edge", "the edge service: the sandbox API of this host (python -m sandbox.edge; --help)", cmd_edge,
         (arg("rest", nargs=argparse.REMAINDER),), add_help=False),
    Verb("gateway", "a fleet's gateway: the API over many edges (--help)", cmd_gateway,
         (arg("rest", nargs=argparse.REMAINDER),), add_help=False),
    Verb("fleet", "a fleet: local fleet up/down, projects and keys, edges (--help)", cmd_fleet,
         (arg("rest", nargs=argparse.REMAINDER),), add_help=False),
    Verb("sandbox", "run sandboxes (crun) on images and checkpoints", verbs=SANDBOX_VERBS),
    Verb("vm", "the microVM guest: its assets (kernel, initramfs, agent) on this host", verbs=VM_VERBS),
)


# -- the parser, built from the table ---------------------------------------------------------


class _PickVerb(argparse.Action):
    """The positional of a ``pick`` group: keeps the name given and makes its sub-verb the one to run."""

    def __init__(self, *args: Any, verbs: tuple[Verb, ...], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.verbs = {v.name: v for v in verbs}

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.verb = self.verbs[values]


def _add_verbs(parser: argparse.ArgumentParser, dest: str, verbs: Sequence[Verb]) -> None:
    sub = parser.add_subparsers(dest=dest, required=True)
    for verb in verbs:
        p = sub.add_parser(verb.name, help=verb.help, add_help=verb.add_help)
        for add in verb.arguments:
            add(p)
        if verb.pick:
            p.add_argument("action", choices=[v.name for v in verb.verbs], action=_PickVerb, verbs=verb.verbs,
                           help="; ".join(f"{v.name}: {v.help}" for v in verb.verbs))
        elif verb.verbs:
            _add_verbs(p, f"{verb.name}_command", verb.verbs)
        else:
            p.set_defaults(verb=verb)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="layerbox", description="EROFS layers and snapshots for agent sandboxes")
    _add_verbs(p, "command", VERBS)
    return p


def run_verb(verb: Verb, args: argparse.Namespace) -> int:
    """Run one verb on its parsed arguments; a coroutine verb through the one async bridge."""
    assert verb.run is not None, f"{verb.name} is a group: argparse requires one of its verbs"
    result = verb.run(args)
    return int(run_blocking(result) if verb.is_async else result)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own = {"demo": cmd_demo, "edge": cmd_edge, "gateway": cmd_gateway, "fleet": cmd_fleet}
    if argv[:1] and argv[0] in own:
        # these own their options (argparse REMAINDER would swallow none of them)
        return own[argv[0]](argparse.Namespace(rest=argv[1:]))
    args = build_parser().parse_args(argv)
    try:
        return run_verb(args.verb, args)
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


if __name__ == "__main__":
    sys.exit(main())
