"""The dependency direction of docs/DESIGN and docs/ARCHITECTURE.md, and the store's encapsulation,
checked on the source.

tools -> sandbox -> snapshots -> lazyfetch -> layerstore, and converters -> layerstore:
nothing imports upward.  Inside sandbox/, the rooms import one way (core <- isolation <-
backends <- host <- {pools, edge, fleet}; sdk on core alone); no module imports another's
private name; there is no import circle anywhere; no function in sandbox/ is 70 lines or more.  Outside layerstore nobody reaches into a Store's backend or
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


# -- inside sandbox/: rooms, one way down ----------------------------------------------------------------
# what each room of sandbox/ may import besides itself (docs/ARCHITECTURE.md): core <- isolation <-
# backends <- host <- {pools, edge, fleet}; sdk stands on core alone (it runs on any client)
ROOMS = ("core", "isolation", "backends", "host", "pools", "edge", "fleet", "sdk")
ROOM_ALLOWED = {
    "core": set(),
    "isolation": {"core"},
    "backends": {"core", "isolation"},
    "host": {"core", "isolation", "backends"},
    "pools": {"core", "isolation", "backends", "host"},
    "edge": {"core", "isolation", "backends", "host", "pools"},
    "fleet": {"core", "isolation", "backends", "host", "pools", "edge", "sdk"},
    "sdk": {"core"},
}
MAX_FUNCTION_LINES = 70  # in sandbox/: a longer function is several


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _type_checking_only(tree: ast.AST) -> set[int]:
    """Line numbers of imports under ``if TYPE_CHECKING:`` (annotations only: never imported at run time)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            lines |= {n.lineno for stmt in node.body for n in ast.walk(stmt) if isinstance(n, ast.ImportFrom | ast.Import)}
    return lines


def project_imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, names, line) of every import of a project module in ``path`` (TYPE_CHECKING ones left
    out; function-level ones counted: a lazy import is an import all the same)."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_only(tree)
    out = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] in ORDER]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in ORDER:
                out.append((node.module, [a.name for a in node.names], node.lineno))
    return out


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for package in ORDER for p in modules(package)}


def _resolve(target: str, names: list[str], known: dict[str, Path]) -> set[str]:
    """The project modules an import statement loads: ``from a.b import c`` is ``a.b.c`` when that is a module."""
    found = {target} if target in known else set()
    found |= {f"{target}.{n}" for n in names if f"{target}.{n}" in known}
    return found


def import_graph() -> dict[str, set[str]]:
    known = all_modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        edges: set[str] = set()
        for target, names, _ in project_imports(path):
            edges |= _resolve(target, names, known)
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def room_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "sandbox" and parts[1] in ROOMS else None


def test_sandbox_rooms_import_one_way() -> None:
    wrong = []
    for path in modules("sandbox"):
        mine = room_of(module_name(path))
        if mine is None:
            if path.name != "__init__.py":
                wrong.append(f"{path.relative_to(ROOT)} is in no room")
            continue
        for target, _, line in project_imports(path):
            theirs = room_of(target) or ("sandbox" if target.startswith("sandbox") else None)
            if theirs is None:
                continue  # another package: the package rules above
            if theirs == "sandbox" or (theirs != mine and theirs not in ROOM_ALLOWED[mine]):
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({mine}) imports {target}")
    assert wrong == []


def test_no_module_imports_a_private_name_of_another() -> None:
    wrong = []
    for name, path in all_modules().items():
        for target, names, line in project_imports(path):
            if target != name:
                wrong += [f"{path.relative_to(ROOT)}:{line}: {target}.{n}" for n in names
                          if n.startswith("_") and not n.endswith("__")]
    assert wrong == []


def test_no_import_circle_anywhere() -> None:
    assert cycles(import_graph()) == []


def test_no_function_in_sandbox_is_long() -> None:
    long = []
    for path in modules("sandbox"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines >= MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert long == []


def test_the_room_checks_see_what_they_look_for(tmp_path: Path) -> None:
    """The checks above find what they forbid: a circle, a private import, an upward import."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    probe = tmp_path / "probe.py"
    probe.write_text("from typing import TYPE_CHECKING\nfrom sandbox.host.manager import _options\n"
                     "if TYPE_CHECKING:\n    from sandbox.edge.app import SandboxService\n"
                     "def f():\n    from sandbox.edge import app\n")
    got = project_imports(probe)
    assert ("sandbox.host.manager", ["_options"], 2) in got
    assert not any(target == "sandbox.edge.app" for target, _, _ in got)  # under TYPE_CHECKING
    assert ("sandbox.edge", ["app"], 6) in got  # a function's import counts
    assert room_of("sandbox.backends.vm.qemu") == "backends"
    assert "backends" not in ROOM_ALLOWED["isolation"]
