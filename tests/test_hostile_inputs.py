"""Hostile JSONL lines, mixture TOML and loader states (issue 12, "Done when"; manifests,
schemas and shard bytes are in tests/test_hostile.py, whose alarm and allocation bound this
file reuses).

Generated input goes through ``roxxel pack`` and ``roxxel plan`` in-process, and through
``Loader.restore``. Each must succeed, or end in one line on stderr with exit 1 or 2 (the CLI)
or a `RoxxelError` (the API): never another exception, a hang or an allocation above the bound.
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import roxxel
from roxxel import RoxxelError
from roxxel.cli import main
from roxxel.loader.loader import Loader, LoaderConfig
from tests.test_hostile import SETTINGS, bounded_allocation, no_hang

NUMBERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64, 1e39, 70000.0, True, False]),
)
JSON_VALUES = st.recursive(
    st.one_of(st.none(), NUMBERS, st.text(max_size=8)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=12,
)
FIELDS = st.sampled_from(
    [
        [],
        ["--field", "x:int32[]"],
        ["--field", "x:float16"],
        ["--field", "x:int64"],
        ["--field", "x:uint8[4]"],
        ["--field", "x:str"],
        ["--field", "x:bool"],
        ["--field", "x:uint8[4294967296,4294967296]"],
        ["--field", "x:nope"],
        ["--field", "y:int32"],
    ]
)


def run_cli(argv: list[str]) -> int:
    """In-process ``roxxel``: exit 0, or exit 1/2 with exactly one line on stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    text = err.getvalue()
    if code != 0:
        lines = [line for line in text.splitlines() if not line.startswith("roxxel: skipped")]
        assert code in (1, 2) and len(lines) == 1 and lines[0].startswith("roxxel"), (code, text)
        assert "Traceback" not in text
    return code


@given(
    lines=st.lists(
        st.one_of(
            st.dictionaries(st.sampled_from(["x", "y"]), JSON_VALUES, max_size=2).map(json.dumps),
            st.text(max_size=20),
            st.sampled_from(['{"x": 1, "x": 2}', '{"x": NaN}', "[1, 2]", "null", '{"x": 1e400}']),
        ),
        min_size=1,
        max_size=6,
    ),
    fields=FIELDS,
    skip_bad=st.booleans(),
)
@SETTINGS
def test_issue12_hostile_jsonl_lines_pack_or_fail_in_one_line(
    lines: list[str], fields: list[str], skip_bad: bool
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "in.jsonl"
        source.write_text("\n".join(lines) + "\n")
        argv = ["pack", str(source), "-o", str(Path(tmp) / "out"), *fields]
        with no_hang(), bounded_allocation():
            code = run_cli([*argv, *(["--skip-bad"] if skip_bad else [])])
        if code == 0:  # what was packed reads back, whole
            ds = roxxel.open_dataset(Path(tmp) / "out")
            assert ds.verify() == []
            for i in range(len(ds)):
                ds[i]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("toml")
    for name in ("web", "code"):
        with roxxel.DatasetWriter(root / name, {"tokens": "int32[]"}) as w:
            for i in range(20):
                w.write({"tokens": np.arange(i % 7 + 1, dtype=np.int32)})
    return root


TOML_VALUES = st.one_of(
    st.sampled_from(
        [
            "0",
            "-1",
            "1",
            "2",
            "64",
            "2e300",
            "1e-320",
            "9223372036854775807",
            "4611686018427387904",
            "nan",
            "inf",
            '"no"',
            '"web"',
            '"tokens"',
            "true",
            "[]",
            "{}",
            '"refill"',
            '"renormalize"',
        ]
    ),
    st.integers(min_value=-(2**64), max_value=2**64).map(str),
)
TOML_KEYS = st.sampled_from(
    [
        ("", "batch_size"),
        ("", "seed"),
        ("", "shuffle"),
        ("", "on_exhausted"),
        ("", "batch_sise"),
        ("sources.web", "path"),
        ("sources.web", "field"),
        ("sources.web", "seq_len"),
        ("sources.web", "epochs"),
        ("sources.web", "samples"),
        ("sources.web", "targets"),
        ("phase", "end_step"),
        ("phase", "batch_size"),
        ("phase", "seq_len"),
        ("phase", "weights"),
        ("phase.weights", "web"),
        ("phase.weights", "code"),
    ]
)


def _toml(overrides: list[tuple[tuple[str, str], str]]) -> str:
    """The documented two-source, two-phase mixture (docs/sampling.md) with some values
    replaced or added."""
    table: dict[str, dict[str, str]] = {
        "": {"batch_size": "4", "seed": "1"},
        "sources.web": {"path": '"web"', "field": '"tokens"', "seq_len": "4"},
        "sources.code": {"path": '"code"', "field": '"tokens"', "seq_len": "4"},
        "phase": {"end_step": "10"},
        "phase.weights": {"web": "0.7", "code": "0.3"},
    }
    for (section, key), value in overrides:
        table[section][key] = value
    out = [f"{k} = {v}" for k, v in table[""].items()]
    for source in ("web", "code"):
        out.append(f"[sources.{source}]")
        out.extend(f"{k} = {v}" for k, v in table[f"sources.{source}"].items())
    out.append("[[phases]]")
    out.extend(f"{k} = {v}" for k, v in table["phase"].items())
    if "weights" not in table["phase"]:
        out.append("[phases.weights]")
        out.extend(f"{k} = {v}" for k, v in table["phase.weights"].items())
    out.append("[[phases]]\nweights = { web = 0.5, code = 0.5 }")
    return "\n".join(out) + "\n"


@given(
    overrides=st.lists(st.tuples(TOML_KEYS, TOML_VALUES), max_size=3),
    steps=st.sampled_from([None, "1", "40", str(2**63), str(10**30), "-3"]),
)
@SETTINGS
def test_issue12_hostile_mixture_toml_plans_or_fails_in_one_line(
    datasets: Path, overrides: list[tuple[tuple[str, str], str]], steps: str | None
) -> None:
    config = datasets / "mix.toml"
    config.write_text(_toml(overrides))
    with no_hang(), bounded_allocation():
        run_cli(["plan", str(config), *(["--steps", steps] if steps else [])])


FOREVER = LoaderConfig(num_epochs=None)
STATE_VALUES = st.one_of(
    st.none(),
    NUMBERS,
    st.text(max_size=8),
    st.sampled_from([[], {}, "0" * 64, 2**61, 2**62, -(2**63)]),
)


@given(
    key=st.sampled_from(["step", "seed", "version", "fingerprint", "config", "order", "junk"]),
    value=STATE_VALUES,
    drop=st.booleans(),
)
@SETTINGS
def test_issue12_hostile_loader_states_restore_or_raise_a_roxxel_error(
    datasets: Path, key: str, value: Any, drop: bool
) -> None:
    ds = roxxel.open_dataset(datasets / "web")
    with Loader(ds, 4, config=FOREVER) as loader:
        state = json.loads(json.dumps(loader.state()))
    if drop:
        state.pop(key, None)
    else:
        state[key] = value
    with (
        no_hang(),
        bounded_allocation(),
        contextlib.suppress(RoxxelError),
        Loader(ds, 4, config=FOREVER) as loader,
    ):
        loader.restore(state)
        next(iter(loader))
