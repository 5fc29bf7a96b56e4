"""The package's shape: light import, one-way module imports, small modules."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import roxxel

PACKAGE = Path(roxxel.__file__).resolve().parent
MAX_MODULE_LINES = 400

# Each module may import roxxel modules of strictly lower layers only (and the package
# itself only for its lazy names, from above the format layers).
LAYERS: list[set[str]] = [
    {"errors", "version"},
    {"format", "schema", "atomic", "order", "interleave", "ingest_units", "metrics"},
    {
        "layout",
        "manifest",
        "phases",
        "ingest_arrow",
        "ingest_megatron",
        "ingest_numpy",
        "ingest_schema",
        "ingest_text",
    },
    {"column", "mixture", "ingest"},
    {"batch", "plan", "mixture_toml"},
    {"reader", "writer"},
    {"dataset_writer"},
    {"dataset"},
    {"windows"},
    {"views", "ingest_parts", "device", "checkpoint", "pipeline"},
    {"steps", "ingest_pack"},
    {"ingest_pool"},
    {"loader", "train", "cli_args"},
    {"cli_inspect", "cli_pack", "cli_plan"},
    {"cli"},
]
JAX_MODULES = {"device", "checkpoint", "train", "loader"}


def _layer(name: str) -> int:
    for depth, layer in enumerate(LAYERS):
        if name in layer:
            return depth
    raise AssertionError(f"roxxel/{name}.py is in no layer of tests/test_package.py")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("roxxel."):
                found.add(node.module.split(".")[1])
            elif node.module == "roxxel":
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("roxxel."))
    return found


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.glob("*.py") if p.name != "__init__.py")


def test_imports_point_down_the_layers() -> None:
    wrong = []
    for path in _modules():
        name = path.stem
        for target in _imports(path):
            if target in {"__version__"}:
                continue
            if _layer(target) >= _layer(name):
                wrong.append(f"{name} -> {target}")
    assert wrong == []


def test_reader_and_writer_never_import_each_other() -> None:
    assert "writer" not in _imports(PACKAGE / "reader.py")
    assert "reader" not in _imports(PACKAGE / "writer.py")


def test_only_the_device_side_imports_jax_and_orbax() -> None:
    heavy = []
    for path in _modules():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n.split(".")[0] in ("jax", "orbax", "flax") for n in names):
                heavy.append(path.stem)
    assert set(heavy) <= JAX_MODULES


def test_import_roxxel_does_not_load_jax_or_orbax() -> None:
    code = (
        "import sys, roxxel, roxxel.cli\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'orbax'))\n"
        "print(heavy)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_modules_stay_small() -> None:
    sizes = {p.name: len(p.read_text().splitlines()) for p in PACKAGE.glob("*.py")}
    assert {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES} == {}


def test_public_names_resolve() -> None:
    for name in roxxel.__all__:
        assert getattr(roxxel, name) is not None, name
