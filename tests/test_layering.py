"""The packages import in one direction, the one docs/ARCHITECTURE.md draws: no import of a
higher layer (type-only imports included: a lower layer that needs a higher one's shape owns a
protocol), no package the diagram does not place, no cycle between packages (a top-level module
counts as its own package) or between the modules of one, and analysis/ stays pure: records
in, DataFrames out.

Imports are read from the source (ast), function-local ones and those under
`if TYPE_CHECKING:` included: a type-only circle still ties two modules together (the shared
type moves down into a module of its own, as workloads/layer_cost.py).
"""

from __future__ import annotations

import ast
import collections
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "scalelab"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
# Outside the diagram: the entry point sits above everything, the package root (its
# __version__) below everything.
TOP, BOTTOM = {"__main__"}, {"__version__", "scalelab"}

# What analysis/ may never import: it reads records, it does not run or launch anything.
ANALYSIS_MUST_NOT_IMPORT = {"strategies", "comm", "cli", "orchestration", "runner", "train", "fast"}
# Planning code (partition, schedule simulation, trunk geometry) sits below the strategies.
PLANNING_MUST_NOT_IMPORT = {"strategies", "comm", "cli", "analysis", "orchestration", "run"}


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _module_name(path: Path, source: Path) -> tuple[str, bool]:
    parts = path.relative_to(source.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _targets(node: ast.AST, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [base] + [f"{base}.{a.name}" for a in node.names]


def read_imports(source: Path, type_only: bool = False) -> dict[str, set[str]]:
    """module -> the scalelab modules (or names in them) it imports at run time (type_only:
    also those under `if TYPE_CHECKING:`)."""
    out: dict[str, set[str]] = collections.defaultdict(set)
    for path in source.rglob("*.py"):
        module, is_package = _module_name(path, source)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped = set() if type_only else {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and _type_checking(node)
            for inner in ast.walk(node)
        }  # fmt: skip
        for node in ast.walk(tree):
            if id(node) not in skipped:
                out[module].update(
                    t for t in _targets(node, module, is_package) if t.startswith("scalelab.")
                )
    return out


@functools.cache
def module_imports() -> dict[str, set[str]]:
    """Every import, those under `if TYPE_CHECKING:` included: a type-only circle still means
    two modules that cannot be read, moved or tested one without the other."""
    return read_imports(SRC, type_only=True)


def package_of(module: str) -> str:
    """scalelab.strategies.split.batch -> strategies; scalelab.run.runner -> runner."""
    return module.split(".")[1] if "." in module else module


def package_edges(imports: dict[str, set[str]] | None = None) -> dict[tuple[str, str], set[str]]:
    """(importer package, imported package) -> the importing modules."""
    edges: dict[tuple[str, str], set[str]] = collections.defaultdict(set)
    for module, targets in (module_imports() if imports is None else imports).items():
        for target in targets:
            a, b = package_of(module), package_of(target)
            if a != b:
                edges[(a, b)].add(module)
    return edges


def cycles(edges: dict[tuple[str, str], set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one package (Tarjan)."""
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_packages():
    edges = package_edges()
    found = cycles(edges)
    detail = [
        f"{a} -> {b} ({', '.join(sorted(edges[(a, b)]))})"
        for component in found
        for a in component
        for b in component
        if (a, b) in edges
    ]
    assert not found, "import cycles between packages:\n" + "\n".join(detail)


def module_edges() -> dict[tuple[str, str], set[str]]:
    """(importer, imported module) for modules inside one package. An import of one's own
    ancestor package is left out: Python runs a package's __init__ before any of its modules
    anyway, so `from scalelab.fast import tuning` inside scalelab.fast is not a cycle."""
    known = set(module_imports()) | {"scalelab"}
    edges: dict[tuple[str, str], set[str]] = collections.defaultdict(set)
    for module, targets in module_imports().items():
        for target in targets:
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]  # a name inside a module -> the module
            if target == module or module.startswith(target + "."):
                continue
            if package_of(target) == package_of(module):
                edges[(module, target)].add(module)
    return edges


def test_no_import_cycle_between_modules_of_a_package():
    found = cycles(module_edges())
    assert not found, f"import cycles between modules: {found}"


@pytest.mark.parametrize(
    "package, forbidden",
    [("analysis", ANALYSIS_MUST_NOT_IMPORT), ("layout", PLANNING_MUST_NOT_IMPORT)],
)
def test_lower_packages_do_not_reach_up(package, forbidden):
    edges = package_edges()
    reached = {b: sorted(m) for (a, b), m in edges.items() if a == package and b in forbidden}
    assert not reached, f"{package}/ imports {reached}"


def test_the_checker_sees_a_cycle_and_a_type_checking_import(tmp_path):
    """The graph builder itself: a planted cycle is found, a TYPE_CHECKING import only when
    type-only imports are asked for (as the cycle and layer checks ask)."""
    pkg = tmp_path / "scalelab"
    (pkg / "a").mkdir(parents=True)
    (pkg / "b").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "b" / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("def f():\n    from scalelab.b.y import g\n")
    (pkg / "b" / "y.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from scalelab.a import x\n"
    )
    imports = read_imports(pkg)
    assert "scalelab.b.y.g" in imports["scalelab.a.x"]
    assert not any(t.startswith("scalelab.a") for t in imports["scalelab.b.y"])
    assert "scalelab.a.x" in read_imports(pkg, type_only=True)["scalelab.b.y"]
    (pkg / "b" / "y.py").write_text("from ..a import x\n")
    edges = collections.defaultdict(set)
    for module, targets in read_imports(pkg).items():
        for t in targets:
            if package_of(module) != package_of(t):
                edges[(package_of(module), package_of(t))].add(module)
    assert cycles(edges) == [["a", "b"]]


def diagram_layers(text: str) -> dict[str, int]:
    """package -> its layer (0 at the top) from the architecture page's first code block:
    a line starting with two spaces and a name holds a layer; its names end at the first run
    of two spaces (`data/ oracle/`, `config.py, config_sections.py`); deeper-indented lines
    continue a description; the rule line between the halves is no layer."""
    block = text.split("```", 2)[1]
    layers: dict[str, int] = {}
    for line in block.splitlines():
        if not line.startswith("  ") or line[2:3] in (" ", "─", ""):
            continue
        head = line[2:].split("  ", 1)[0]
        names = [
            n.strip().removesuffix("/").removesuffix(".py") for n in head.replace(",", " ").split()
        ]
        depth = len(set(layers.values()))
        layers.update({n: depth for n in names if n})
    return layers


def upward_imports(edges, layers: dict[str, int]) -> list[str]:
    """Each import of a higher layer, and each package the diagram does not place."""

    def level(pkg: str) -> float:
        if pkg in TOP:
            return -1
        return len(layers) + 1 if pkg in BOTTOM else layers.get(pkg, float("nan"))

    found = []
    for (a, b), modules in sorted(edges.items()):
        for pkg in (a, b):
            if level(pkg) != level(pkg):  # NaN: not in the diagram
                found.append(f"{pkg} is not in docs/ARCHITECTURE.md's diagram")
        if level(b) < level(a):
            found.append(f"{a} -> {b} goes up ({', '.join(sorted(modules))})")
    return sorted(set(found))


def test_every_import_goes_down_the_architecture_diagram():
    layers = diagram_layers(ARCHITECTURE.read_text(encoding="utf-8"))
    assert {"cli", "strategies", "train", "fast", "predict", "layout"} <= set(layers)
    found = upward_imports(package_edges(read_imports(SRC, type_only=True)), layers)
    assert not found, "imports against docs/ARCHITECTURE.md's layers:\n" + "\n".join(found)


def test_the_layer_check_sees_an_upward_type_only_import(tmp_path):
    """The checker itself: a TYPE_CHECKING import of a higher layer and an unplaced package
    are both reported; a downward import is not."""
    text = (
        "x\n```\n  top/     a\n           more\n  ─── rule\n  mid/ side.py   b\n  low.py  c\n```\n"
    )
    layers = diagram_layers(text)
    assert layers == {"top": 0, "mid": 1, "side": 1, "low": 2}
    pkg = tmp_path / "scalelab"
    (pkg / "mid").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "mid" / "__init__.py").write_text("")
    (pkg / "low.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from scalelab.mid import x\n"
    )
    (pkg / "top.py").write_text("from scalelab import low\nfrom scalelab import stray\n")
    found = upward_imports(package_edges(read_imports(pkg, type_only=True)), layers)
    assert found == [
        "low -> mid goes up (scalelab.low)",
        "stray is not in docs/ARCHITECTURE.md's diagram",
    ]
    assert upward_imports(package_edges(read_imports(pkg)), layers) == found[1:]
