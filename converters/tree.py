"""The in-memory tree of one layer, built entry by entry with OCI semantics.

Only metadata live here; regular-file data have already been streamed into
the blob by the time a node is added, and a node keeps just its chunk list.

Rules (docs/FORMAT.md, "Conversion rules"):
- A later entry for the same path replaces the earlier one.  A directory
  replacing a directory merges: it takes the new metadata and keeps the
  children (what ``tar -x`` does).  Anything replacing a directory drops the
  whole subtree.
- ``.wh.NAME`` becomes an overlayfs whiteout (character device 0/0) named
  NAME.  A whiteout never replaces a real entry of the same layer: OCI says
  whiteouts apply to lower layers only, and a real entry already hides those.
- ``.wh..wh..opq`` marks its directory opaque (``trusted.overlay.opaque=y``).
- Missing parent directories are created as 0755 root:root with mtime 0, as
  container runtimes do when they extract a layer.
- A hard link shares the node of its target, which must already exist in this
  layer and must not be a directory.
"""

from __future__ import annotations

import stat
from collections.abc import Iterator

from converters.errors import BadEntry
from converters.tarstream import KIND_DIR, KIND_HARDLINK, Entry

WHITEOUT_PREFIX = b".wh."
OPAQUE_MARKER = b".wh..wh..opq"
OPAQUE_XATTR = b"trusted.overlay.opaque"


class Node:
    """One inode of the layer."""

    __slots__ = (
        "mode", "uid", "gid", "mtime", "mtime_nsec", "xattrs", "size", "target", "rdev",
        "chunks", "children", "implicit", "whiteout", "nid", "ino", "links",
    )

    def __init__(self, mode: int, uid: int = 0, gid: int = 0, mtime: int = 0, mtime_nsec: int = 0) -> None:
        self.mode = mode
        self.uid = uid
        self.gid = gid
        self.mtime = mtime
        self.mtime_nsec = mtime_nsec
        self.xattrs: dict[bytes, bytes] = {}
        self.size = 0
        self.target = b""  # symlink target
        self.rdev = (0, 0)
        self.chunks: list[int] = []  # blob start block per chunk, NULL_ADDR for holes
        self.children: dict[bytes, Node] | None = {} if stat.S_ISDIR(mode) else None
        self.implicit = False
        self.whiteout = False
        self.nid = -1
        self.ino = 0
        self.links = 0

    @property
    def is_dir(self) -> bool:
        return self.children is not None


def node_from_entry(entry: Entry) -> Node:
    node = Node(entry.mode, entry.uid, entry.gid, entry.mtime, entry.mtime_nsec)
    node.xattrs = dict(entry.xattrs)
    node.size = entry.size
    node.target = entry.link
    node.rdev = entry.rdev
    return node


class Tree:
    """``oci_whiteouts``: interpret ``.wh.`` names (tar layers); directory
    sources pass False and keep such names literally."""

    def __init__(self, *, oci_whiteouts: bool = True) -> None:
        self.root = Node(stat.S_IFDIR | 0o755)
        self.root.implicit = True
        self.oci_whiteouts = oci_whiteouts

    # -- lookups ---------------------------------------------------------------
    def _parent(self, entry: Entry, path: tuple[bytes, ...]) -> Node:
        node = self.root
        for depth, comp in enumerate(path[:-1]):
            assert node.children is not None
            child = node.children.get(comp)
            if child is None or child.whiteout:
                child = Node(stat.S_IFDIR | 0o755)
                child.implicit = True
                node.children[comp] = child
            elif not child.is_dir:
                where = b"/".join(path[: depth + 1]).decode("utf-8", "replace")
                raise BadEntry(entry.name, entry.offset, f"parent {where!r} is not a directory in this layer")
            node = child
        return node

    def lookup(self, path: tuple[bytes, ...]) -> Node | None:
        node: Node | None = self.root
        for comp in path:
            if node is None or node.children is None:
                return None
            node = node.children.get(comp)
        return node

    # -- mutation --------------------------------------------------------------
    def add(self, entry: Entry, node: Node | None) -> None:
        """Place ``entry``; ``node`` is the prepared inode (None for hard links)."""
        path = entry.path
        if not path:
            if entry.kind != KIND_DIR:
                raise BadEntry(entry.name, entry.offset, "the root must be a directory")
            assert node is not None
            self._merge_dir(self.root, node)
            return
        name = path[-1]
        if self.oci_whiteouts and name == OPAQUE_MARKER:
            parent = self._parent(entry, path)
            parent.xattrs[OPAQUE_XATTR] = b"y"
            return
        if self.oci_whiteouts and name.startswith(WHITEOUT_PREFIX):
            target = name[len(WHITEOUT_PREFIX):]
            if not target or target in (b".", b".."):
                raise BadEntry(entry.name, entry.offset, "whiteout without a valid name")
            parent = self._parent(entry, path)
            assert parent.children is not None
            existing = parent.children.get(target)
            if existing is not None and not existing.whiteout:
                return  # the real entry of this layer already hides the lower one
            wh = Node(stat.S_IFCHR, entry.uid, entry.gid, entry.mtime, entry.mtime_nsec)
            wh.whiteout = True
            parent.children[target] = wh
            return
        parent = self._parent(entry, path)
        assert parent.children is not None
        if entry.kind == KIND_HARDLINK:
            node = self._link_target(entry)
        assert node is not None
        existing = parent.children.get(name)
        if existing is not None and existing.is_dir and node.is_dir:
            self._merge_dir(existing, node)
            return
        parent.children[name] = node

    def _merge_dir(self, existing: Node, new: Node) -> None:
        opaque = existing.xattrs.get(OPAQUE_XATTR)
        existing.mode, existing.uid, existing.gid = new.mode, new.uid, new.gid
        existing.mtime, existing.mtime_nsec = new.mtime, new.mtime_nsec
        existing.xattrs = dict(new.xattrs)
        if opaque is not None and OPAQUE_XATTR not in existing.xattrs:
            existing.xattrs[OPAQUE_XATTR] = opaque  # the marker may precede the dir entry
        existing.implicit = False

    def _link_target(self, entry: Entry) -> Node:
        target = self.lookup(entry.link_path)
        shown = b"/".join(entry.link_path).decode("utf-8", "replace")
        if target is None or target.whiteout:
            raise BadEntry(
                entry.name, entry.offset, f"hard link to {shown!r}, which is not in this layer before it",
                "a hard link must follow its target in the archive",
            )
        if target.is_dir:
            raise BadEntry(entry.name, entry.offset, f"hard link to directory {shown!r}")
        return target

    # -- traversal ---------------------------------------------------------------
    def walk(self) -> Iterator[tuple[tuple[bytes, ...], Node, Node]]:
        """(path, node, parent) depth-first, children in byte order; root first."""
        stack: list[tuple[tuple[bytes, ...], Node, Node]] = [((), self.root, self.root)]
        while stack:
            path, node, parent = stack.pop()
            yield path, node, parent
            if node.children:
                for name in sorted(node.children, reverse=True):
                    stack.append((path + (name,), node.children[name], node))
