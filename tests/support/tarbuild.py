"""Build tar archives entry by entry for tests (independent of the code under test)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path


class TarBuilder:
    """Adds entries in order; missing parent directories get explicit entries
    first (0755, root, a fixed mtime) like real layers have, unless
    ``auto_parents`` is False."""

    def __init__(self, fmt: int = tarfile.PAX_FORMAT, auto_parents: bool = True) -> None:
        self.auto_parents = auto_parents
        self._dirs: set[str] = set()
        self.buf = io.BytesIO()
        self.tar = tarfile.open(fileobj=self.buf, mode="w", format=fmt, encoding="utf-8",
                                errors="surrogateescape")

    def _info(self, name: str | bytes, type_: bytes, mode: int, **kw: object) -> tarfile.TarInfo:
        if isinstance(name, bytes):
            name = name.decode("utf-8", "surrogateescape")
        parts = name.strip("/").split("/")
        if self.auto_parents:
            for i in range(1, len(parts)):
                parent = "/".join(parts[:i])
                if parent not in self._dirs and parent not in (".", ""):
                    self._dirs.add(parent)
                    self.tar.addfile(self._info(parent, tarfile.DIRTYPE, 0o755))
        if type_ == tarfile.DIRTYPE:
            self._dirs.add(name.strip("/"))
        info = tarfile.TarInfo(name)
        info.type = type_
        info.mode = mode
        info.uid = int(kw.pop("uid", 0))  # type: ignore[call-overload]
        info.gid = int(kw.pop("gid", 0))  # type: ignore[call-overload]
        info.mtime = kw.pop("mtime", 1_700_000_000)  # type: ignore[assignment]
        pax = dict(kw.pop("pax", {}))  # type: ignore[call-overload]
        xattrs = kw.pop("xattrs", {})
        for k, v in xattrs.items():  # type: ignore[attr-defined]
            if isinstance(v, bytes):
                v = v.decode("utf-8", "surrogateescape")
            pax["SCHILY.xattr." + k] = v
        info.pax_headers = pax
        for k, v in kw.items():
            setattr(info, k, v)
        return info

    def file(self, name: str | bytes, data: bytes = b"", mode: int = 0o644, **kw: object) -> None:
        info = self._info(name, tarfile.REGTYPE, mode, **kw)
        info.size = len(data)
        self.tar.addfile(info, io.BytesIO(data))

    def dir(self, name: str | bytes, mode: int = 0o755, **kw: object) -> None:
        self.tar.addfile(self._info(name, tarfile.DIRTYPE, mode, **kw))

    def symlink(self, name: str | bytes, target: str | bytes, **kw: object) -> None:
        if isinstance(target, bytes):
            target = target.decode("utf-8", "surrogateescape")
        self.tar.addfile(self._info(name, tarfile.SYMTYPE, 0o777, linkname=target, **kw))

    def hardlink(self, name: str | bytes, target: str | bytes, **kw: object) -> None:
        if isinstance(target, bytes):
            target = target.decode("utf-8", "surrogateescape")
        self.tar.addfile(self._info(name, tarfile.LNKTYPE, 0o644, linkname=target, **kw))

    def device(self, name: str, kind: str, major: int, minor: int, mode: int = 0o600, **kw: object) -> None:
        t = tarfile.CHRTYPE if kind == "c" else tarfile.BLKTYPE
        self.tar.addfile(self._info(name, t, mode, devmajor=major, devminor=minor, **kw))

    def fifo(self, name: str, mode: int = 0o644, **kw: object) -> None:
        self.tar.addfile(self._info(name, tarfile.FIFOTYPE, mode, **kw))

    def raw_type(self, name: str, type_: bytes, data: bytes = b"") -> None:
        info = self._info(name, type_, 0o644)
        info.size = len(data)
        self.tar.addfile(info, io.BytesIO(data))

    def bytes(self) -> bytes:
        self.tar.close()
        return self.buf.getvalue()

    def write(self, path: Path) -> Path:
        path.write_bytes(self.bytes())
        return path
