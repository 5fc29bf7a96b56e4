"""Declared capabilities (roxxel.protocols): the built-in classes satisfy them, for the type
checker and at run time, and nothing in roxxel/ probes attributes instead (issue 11, point 2)."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import roxxel
from roxxel.protocols import (
    CountsTokens,
    MixtureLike,
    RowSource,
    Source,
    SpaceLike,
    TokenSource,
)
from roxxel.sampling.mixture import Mixture
from roxxel.sampling.phases import Space
from roxxel.sources.records import Records, TokenWindows, as_source, takes_rows

PACKAGE = Path(roxxel.__file__).resolve().parent
PYRIGHT = Path(sys.executable).parent / "pyright"


def _declared(
    records: Records, windows: TokenWindows, mixture: Mixture, space: Space
) -> tuple[Source, RowSource, Source, RowSource, TokenSource, MixtureLike, SpaceLike]:
    """Pyright checks these assignments: a renamed member of a class is an error here."""
    return records, records, windows, windows, windows, mixture, space


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    schema = roxxel.Schema.parse({"tokens": "int32[]", "label": "int64"})
    path = tmp_path_factory.mktemp("protocols")
    with roxxel.DatasetWriter(path, schema) as writer:
        for i in range(20):
            writer.write({"tokens": np.arange(i, i + 7, dtype=np.int32), "label": i})
    return roxxel.open_dataset(path)


def test_issue11_point2_builtin_classes_satisfy_their_protocols_at_run_time(dataset) -> None:
    records, windows = Records(dataset, max_len={"tokens": 8}), TokenWindows(dataset, "tokens", 4)
    mixture = Mixture({"r": records, "w": windows}, {"r": 1, "w": 1}, batch_size=2)
    assert isinstance(records, Source) and isinstance(windows, Source)
    assert isinstance(windows, TokenSource) and isinstance(windows, CountsTokens)
    assert not isinstance(records, CountsTokens)
    assert isinstance(mixture, MixtureLike) and isinstance(mixture.spaces(0)[0], SpaceLike)
    assert not isinstance(mixture, Source) and not isinstance(records, MixtureLike)
    assert mixture.step_starts == (0,)
    assert _declared(records, windows, mixture, mixture.spaces(0)[0])[0] is records
    assert takes_rows(records) and takes_rows(windows)
    assert isinstance(as_source(dataset, max_len={"tokens": 8}), Records)


class _Complete:
    """Every member of every runtime-checkable protocol of roxxel.protocols."""

    layout: dict = {}  # noqa: RUF012
    sources: tuple = ()
    phases: tuple = ()
    origin_step = 0
    end_step = None
    step_starts: tuple = ()
    seq_len = 4
    tokens_per_sample = 4
    source = None

    def __len__(self) -> int:
        return 1

    def read(self, indices, out) -> None: ...

    def advise(self, indices) -> None: ...

    def fingerprint(self) -> str:
        return ""

    def with_seq_len(self, seq_len: int) -> _Complete:
        return self

    def batch_size_at(self, step: int) -> int:
        return 1

    def phase_at(self, step: int) -> int:
        return 0

    def position_at(self, step: int) -> int:
        return 0

    def locate(self, start: int, stop: int):
        return np.zeros(0, np.int32), np.zeros(0, np.int64)

    def spaces(self, phase: int) -> tuple:
        return ()


MEMBERS = {  # what each runtime-checkable protocol requires
    Source: ["__len__", "advise", "fingerprint", "layout", "read"],
    CountsTokens: ["__len__", "tokens_per_sample"],
    TokenSource: ["__len__", "seq_len", "tokens_per_sample", "with_seq_len"],
    SpaceLike: ["source"],
    MixtureLike: [
        "batch_size_at",
        "end_step",
        "fingerprint",
        "locate",
        "origin_step",
        "phase_at",
        "phases",
        "position_at",
        "sources",
        "spaces",
        "step_starts",
    ],
}


@pytest.mark.parametrize("protocol", list(MEMBERS), ids=lambda p: p.__name__)
def test_issue11_point2_a_class_missing_one_member_is_rejected(protocol) -> None:
    assert isinstance(_Complete(), protocol)
    for name in MEMBERS[protocol]:
        members = {k: v for k, v in vars(_Complete).items() if k != name}
        assert not isinstance(type(f"Without_{name}", (), members)(), protocol), name


def test_issue11_point2_row_source_is_declared_for_the_builtin_sources_only() -> None:
    class Other(_Complete):
        def read(self, indices, out, rows=None) -> None: ...

    assert isinstance(Other(), Source) and not takes_rows(Other())  # read through a block


RENAMED = """
from roxxel.protocols import CountsTokens, TokenSource
from roxxel.sources.windows import TokenWindows


class Renamed:  # tokens_per_sample renamed
    def __len__(self) -> int:
        return 1

    @property
    def tokens_per_samples(self) -> int:
        return 1


def declared(windows: TokenWindows) -> TokenSource:
    return windows


def renamed() -> CountsTokens:
    return Renamed()  # the one error
"""


@pytest.mark.skipif(not PYRIGHT.exists(), reason="pyright is not installed")
def test_issue11_point2_a_renamed_member_is_a_type_error(tmp_path: Path) -> None:
    here = tmp_path / "declared.py"
    shutil.copy(__file__, here)
    bad = tmp_path / "renamed.py"
    bad.write_text(RENAMED)
    out = subprocess.run(
        [str(PYRIGHT), "--outputjson", "--pythonpath", sys.executable, str(here), str(bad)],
        capture_output=True,
        text=True,
        check=False,
    )
    found = json.loads(out.stdout)["generalDiagnostics"]
    errors = [
        (Path(d["file"]).name, d["range"]["start"]["line"] + 1)
        for d in found
        if d["severity"] == "error"
    ]
    line = RENAMED.splitlines().index("    return Renamed()  # the one error") + 1
    assert errors == [("renamed.py", line)], found


def _probes(path: Path) -> list[str]:
    """hasattr, getattr with a default, inspect.signature: capability probing in a module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else ""
        name = func.attr if isinstance(func, ast.Attribute) else name
        if name == "hasattr" or (name == "getattr" and len(node.args) == 3) or name == "signature":
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {name}")
    return found


def test_issue11_point2_no_capability_probing_in_the_package() -> None:
    found = [probe for path in sorted(PACKAGE.rglob("*.py")) for probe in _probes(path)]
    assert found == []
