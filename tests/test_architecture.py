"""The design, checked: which package may import which, the read side never importing the write
side, jax and orbax only where they belong, no import cycles, and a light ``import roxxel``.

`ALLOWED` is the dependency table of ``docs/architecture.md``. Every import form counts:
``import roxxel.a.b``, ``from roxxel.a import b``, ``from roxxel import a``, relative imports
(``from ..a import b``), imports inside functions, and ``roxxel.a`` attribute chains after a
plain ``import roxxel``. Each check runs on the real tree and, in its own test, on a planted
violation, so a checker that sees nothing cannot pass.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import roxxel

PACKAGE = Path(roxxel.__file__).resolve().parent

# package -> the packages it may import (besides itself). "roxxel" is the top-level __init__.
ALLOWED: dict[str, set[str]] = {
    "version": set(),
    "errors": set(),
    "protocols": {"errors"},
    "format": {"errors", "version"},
    "sources": {"errors", "protocols", "format"},
    "sampling": {"errors", "protocols"},
    "loader": {"errors", "protocols", "format", "sources", "sampling"},
    "train": {"errors", "protocols", "loader"},
    "ingest": {"errors", "version", "format"},
    "cli": {"errors", "version", "protocols", "format", "sources", "sampling", "loader", "ingest"},
    "roxxel": {
        "errors",
        "version",
        "protocols",
        "format",
        "sources",
        "sampling",
        "loader",
        "train",
        "ingest",
        "cli",
    },
}
# Inside format: the read side never imports the write side.
FORMAT_WRITE_SIDE = {"writer", "dataset_writer", "atomic", "upload"}
# Third-party frameworks and the only packages that may import them.
HEAVY: dict[str, set[str]] = {"jax": {"loader", "train"}, "orbax": {"train"}, "flax": set()}


def _module_name(path: Path) -> str:
    """``roxxel/format/reader.py`` -> ``roxxel.format.reader``; packages end in ``__init__``."""
    return ".".join(("roxxel", *path.relative_to(PACKAGE).with_suffix("").parts))


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names, relative levels resolved."""
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")[:-1]  # the importing module's package
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imported_modules(module: str, source: str) -> set[str]:
    """Every ``roxxel...`` or third-party module a module's source imports, absolute names."""
    found: set[str] = set()
    tree = ast.parse(source)
    plain_roxxel = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(alias.name)
                plain_roxxel |= alias.name == "roxxel" and alias.asname is None
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
            found.add(target)
            if target.startswith("roxxel"):  # `from roxxel.a import b`: b may be a module
                found.update(f"{target}.{alias.name}" for alias in node.names)
    if plain_roxxel:
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "roxxel"
            ):
                found.add(f"roxxel.{node.attr}")
    return found


def _package_of(module: str) -> str:
    """``roxxel.format.reader`` -> ``format``; ``roxxel`` and public names -> ``roxxel``."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in ALLOWED:
        return "roxxel"
    return parts[1]


def violations(sources: Mapping[str, str]) -> list[str]:
    """Every import in ``sources`` (module name -> source text) that breaks the design."""
    wrong = []
    for module, source in sorted(sources.items()):
        here = _package_of(module) if module != "roxxel.__init__" else "roxxel"
        for target in sorted(imported_modules(module, source)):
            wrong.extend(_check_edge(module, here, target))
    return wrong


def _check_edge(module: str, here: str, target: str) -> Iterable[str]:
    top = target.split(".")[0]
    if top in HEAVY and here not in HEAVY[top]:
        yield f"{module} imports {top} (only {sorted(HEAVY[top])} may)"
    if top != "roxxel" or target == "roxxel":
        return
    there = _package_of(target)
    if there == "roxxel":  # `from roxxel import Name`: the package front, lazily heavy
        if here != "roxxel":
            yield f"{module} imports the package front ({target}); import the defining module"
        return
    if there != here and there not in ALLOWED[here]:
        yield f"{module} -> {target} ({here} may import only {sorted(ALLOWED[here])})"
    if here == there == "format":
        mine, theirs = module.split(".")[2], target.split(".")[2] if target.count(".") > 1 else ""
        if mine not in FORMAT_WRITE_SIDE and theirs in FORMAT_WRITE_SIDE:
            yield f"{module} -> {target} (the format's read side never imports its write side)"


def _tree_sources() -> dict[str, str]:
    return {_module_name(p): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_belongs_to_a_package_of_the_table() -> None:
    stray = [m for m in _tree_sources() if m != "roxxel.__init__" and _package_of(m) == "roxxel"]
    assert stray == [], f"modules outside the packages of ALLOWED: {stray}"


def test_imports_follow_the_dependency_table() -> None:
    assert violations(_tree_sources()) == []


def test_the_table_catches_planted_bad_imports() -> None:
    planted = {
        "roxxel.sampling.mixture": "from roxxel.loader.loader import Loader\n",
        "roxxel.sampling.order": "from ..sources import windows\n",
        "roxxel.format.reader": "import roxxel.format.writer\n",
        "roxxel.format.dataset": "from .dataset_writer import publish_manifest\n",
        "roxxel.ingest.pack": "import roxxel\nx = roxxel.loader.Loader\n",
        "roxxel.sources.records": "import jax.numpy as jnp\n",
        "roxxel.loader.loader": "def f():\n    import orbax.checkpoint\n",
        "roxxel.format.schema": "from roxxel import Loader\n",
    }
    found = violations(planted)
    for module in planted:
        assert any(line.startswith(module + " ") for line in found), (module, found)
    fine = {"roxxel.loader.loader": "from ..sampling import order\nimport jax\n"}
    assert violations(fine) == []


def _module_graph() -> dict[str, set[str]]:
    sources = _tree_sources()
    names = set(sources)

    def own(target: str) -> str | None:
        for candidate in (target, f"{target}.__init__"):
            if candidate in names:
                return candidate
        return None

    graph: dict[str, set[str]] = {}
    for module, source in sources.items():
        if module == "roxxel.__init__":
            continue  # the front imports everything, lazily
        edges = {own(t) for t in imported_modules(module, source)}
        graph[module] = {e for e in edges if e and e != module and e != "roxxel.__init__"}
    return graph


def find_cycle(graph: Mapping[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (module -> modules it imports), or ``[]``."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node], _ = 1, stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node], _ = 2, stack.pop()
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def test_no_import_cycles_between_modules() -> None:
    graph = _module_graph()
    # a package's __init__ may re-export its own modules; that is not a cycle of concepts
    for module in list(graph):
        if module.endswith(".__init__"):
            graph[module] = set()
    assert find_cycle(graph) == []


def test_the_cycle_check_catches_a_planted_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_import_roxxel_does_not_load_jax_or_orbax() -> None:
    code = (
        "import sys, roxxel, roxxel.cli, roxxel.format, roxxel.sampling, roxxel.ingest\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'orbax'))\n"
        "print(heavy)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_public_names_resolve() -> None:
    for name in roxxel.__all__:
        assert getattr(roxxel, name) is not None, name


def test_submodule_names_of_0_1_still_resolve() -> None:
    for name in ("train", "checkpoint", "cli", "device", "loader", "mixture", "order", "views"):
        assert getattr(roxxel, name).__name__.startswith("roxxel."), name
