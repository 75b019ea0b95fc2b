"""The dependency direction of docs/DESIGN and the store's encapsulation, checked on the source.

tools -> sandbox -> snapshots -> lazyfetch -> layerstore, and converters -> layerstore:
nothing imports upward.  Outside layerstore nobody reaches into a Store's backend or
its metadata cache (``store.backend``, ``store.cache``): the Store's own methods say
what is asked (traces, chunk locations, pack ranges, the writer lock), so the key
layout stays the one docs/FORMAT.md gives layerstore/objects.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORDER = ["layerstore", "converters", "lazyfetch", "snapshots", "sandbox", "tools"]
# what each package may import (besides itself and the standard library / third parties)
ALLOWED = {
    "layerstore": set(),
    "converters": {"layerstore"},
    "lazyfetch": {"layerstore"},
    "snapshots": {"layerstore", "lazyfetch", "converters"},
    "sandbox": {"layerstore", "lazyfetch", "snapshots", "converters"},
    "tools": {"layerstore", "lazyfetch", "snapshots", "sandbox", "converters"},
}


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def imported(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def test_nothing_imports_upward() -> None:
    wrong = []
    for package in ORDER:
        for path in modules(package):
            for name in imported(path) & set(ORDER):
                if name != package and name not in ALLOWED[package]:
                    wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert wrong == []


def _reaches_into_a_store(node: ast.Attribute) -> bool:
    # store.backend, self.store.cache, s.backend ...: a name or attribute called like a store
    if node.attr not in ("backend", "cache"):
        return False
    value = node.value
    name = value.attr if isinstance(value, ast.Attribute) else value.id if isinstance(value, ast.Name) else ""
    return name in ("store", "s", "_store")


def test_no_package_but_layerstore_reaches_into_a_store() -> None:
    wrong = []
    for package in ORDER[1:]:
        for path in modules(package):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Attribute) and _reaches_into_a_store(node):
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    assert wrong == []


def test_the_checks_see_what_they_look_for() -> None:
    """The two checks above find the patterns they forbid (else they would pass vacuously)."""
    probe = ast.parse("from sandbox import manager\nx = store.backend\ny = self.store.cache.locate(d)\n")
    assert any(isinstance(n, ast.Attribute) and _reaches_into_a_store(n) for n in ast.walk(probe))
    assert sum(1 for n in ast.walk(probe) if isinstance(n, ast.Attribute) and _reaches_into_a_store(n)) == 2
    assert "layerstore" in imported(ROOT / "lazyfetch" / "daemon.py")


def _oci_constants(path: Path) -> list[str]:
    """Module-level names bound to OCI/Docker media type strings, or named ``MT_OCI_*``."""
    found = []
    for node in ast.parse(path.read_text(), str(path)).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        value = getattr(node, "value", None)
        for target in targets:
            if not isinstance(target, ast.Name):
                continue
            media_type = (
                isinstance(value, ast.Constant)
                and isinstance(value.value, str)
                and value.value.startswith(("application/vnd.oci.", "application/vnd.docker."))
            )
            if target.id.startswith("MT_OCI_") or media_type:
                found.append(f"{path}:{node.lineno}: {target.id}")
    return found


def test_oci_lives_in_converters() -> None:
    """Everything OCI is in one place (DESIGN.md): media types in converters/ocispec.py, the
    registry client beside the converters; layerstore knows no OCI."""
    assert not (ROOT / "layerstore" / "registry.py").exists()
    outside = [p for pkg in ORDER for p in modules(pkg) if pkg != "converters"]
    outside += sorted((ROOT / "bench").rglob("*.py"))
    assert [c for p in outside for c in _oci_constants(p)] == []
    # inside converters, once: every media type constant is ocispec's
    inside = [c for p in modules("converters") if p.name != "ocispec.py" for c in _oci_constants(p)]
    assert inside == []
    for package in ORDER:
        for path in modules(package):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module:
                    assert node.module != "layerstore.registry", path
                    assert not (node.module == "layerstore" and any(a.name == "registry" for a in node.names)), path


def test_the_oci_check_sees_what_it_looks_for(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text('MT_OCI_INDEX = "x"\nLAYER: str = "application/vnd.docker.image.rootfs.diff.tar"\nOTHER = 1\n')
    assert [c.split(": ")[1] for c in _oci_constants(probe)] == ["MT_OCI_INDEX", "LAYER"]
    assert len(_oci_constants(ROOT / "converters" / "ocispec.py")) >= 9
