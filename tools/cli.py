"""The ``layerbox`` command line: parse arguments, call one library function, print.

Library errors (``LayerboxError``) become one line on stderr and the error's
exit code; nothing below ``tools/`` prints or exits.
"""

from __future__ import annotations

import argparse
import json
import stat
import sys
from collections.abc import Sequence

from layerstore.errors import LayerboxError

IMAGE_SCHEMES = ("oci:", "oci-archive:", "docker-archive:")


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(t[:-1]) * units[t[-1]]
    return int(t)


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="layerbox", description="EROFS layers and snapshots for agent sandboxes")
    sub = p.add_subparsers(dest="command", required=True)

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
    return p


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
        return exc.exit_code
    except FileNotFoundError as exc:
        print(f"layerbox: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
