"""Tests for a look at a batch: `Loader.peek` (roxxel.loader.peek) and ``roxxel peek``."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import roxxel
from roxxel.cli import main
from roxxel.cli.plan import open_plan_source
from roxxel.errors import ConfigError

MAX_LEN = {"tokens": 16, "text": 32}

MIXTURE = """
seed = 7
batch_size = 6
[sources.web]
path = "web"
field = "tokens"
seq_len = 4
[sources.code]
path = "code"
field = "tokens"
seq_len = 4
epochs = 1
[[phases]]
weights = {web = 2, code = 1}
end_step = 5
[[phases]]
weights = {web = 1, code = 3}
seq_len = 8
"""


def _dataset(path: Path, num: int = 37, base: int = 0, metadata: dict | None = None) -> Path:
    schema = {"tokens": "int32[]", "text": "str", "id": "int64"}
    with roxxel.DatasetWriter(path, schema, metadata=metadata) as writer:
        for i in range(num):
            tokens = np.arange(base + i, base + i + 1 + i % 7, dtype=np.int32)
            writer.write({"tokens": tokens, "text": f"doc {i} é", "id": i})
    return path


def _mixture_dir(tmp_path: Path) -> Path:
    _dataset(tmp_path / "web", num=50)
    _dataset(tmp_path / "code", num=20, base=1000)
    (tmp_path / "mix.toml").write_text(MIXTURE)
    return tmp_path / "mix.toml"


def _provenance(**options) -> roxxel.LoaderConfig:
    return roxxel.LoaderConfig(provenance=True, **options)


def _assert_peek_is_the_batch(peeked: list[dict], batch: dict, field: str) -> None:
    valid = batch["record"] >= 0
    assert [row["record"] for row in peeked] == batch["record"][valid].tolist()
    for row in peeked:
        i = row["row"]
        length = int(batch[f"{field}.length"][i]) if f"{field}.length" in batch else None
        expected = batch[field][i] if length is None else batch[field][i][:length]
        np.testing.assert_array_equal(row["values"], expected)
        assert row["length"] == (1 if expected.ndim == 0 else len(expected))


def test_issue13_item11_peek_agrees_with_the_loader_on_a_dataset(tmp_path):
    ds = roxxel.open_dataset(_dataset(tmp_path / "ds"))
    config = _provenance(max_len=MAX_LEN, final_batch="pad")
    looked = roxxel.Loader(ds, 8, seed=3, config=config)
    peeks = {step: looked.peek(step) for step in (4, 0, 2, 1, 3)}  # any order: pure of step
    with roxxel.Loader(ds, 8, seed=3, config=config) as loader:
        batches = list(loader)
    assert len(batches) == 5  # 37 records: the last step is padded
    for step, batch in enumerate(batches):
        assert {row["source"] for row in peeks[step]} == {"ds"}
        assert batch["source"][batch["record"] >= 0].tolist() == [0] * len(peeks[step])
        _assert_peek_is_the_batch(peeks[step], batch, "tokens")
        for field in ("text", "id"):
            _assert_peek_is_the_batch(looked.peek(step, field=field), batch, field)
    assert len(peeks[4]) == 37 - 4 * 8
    assert looked.peek(5) == [] and looked.step == 0


def test_issue13_item11_peek_agrees_with_the_loader_on_a_toml_mixture(tmp_path):
    mixture = roxxel.Mixture.from_toml(_mixture_dir(tmp_path), open_plan_source)
    looked = roxxel.Loader(mixture, config=_provenance())
    with roxxel.Loader(mixture, config=_provenance()) as loader:
        batches = [next(loader) for _ in range(9)]  # across the phase boundary at step 5
    sources = set()
    for step, batch in enumerate(batches):
        peeked = looked.peek(step)
        assert [row["source"] for row in peeked] == [
            mixture.names[s] for s in batch["source"].tolist()
        ]
        _assert_peek_is_the_batch(peeked, batch, "tokens")
        assert {row["length"] for row in peeked} == {5 if step < 5 else 9}
        sources |= {row["source"] for row in peeked}
    assert sources == {"web", "code"}


def test_issue13_item11_peek_while_iterating_changes_nothing(tmp_path):
    ds = roxxel.open_dataset(_dataset(tmp_path / "ds"))
    config = _provenance(max_len=MAX_LEN, num_epochs=None, prefetch=3)
    with roxxel.Loader(ds, 4, seed=2, config=config) as plain:
        expected = [next(plain)["record"].tolist() for _ in range(15)]
    got, peeked = [], []
    with roxxel.Loader(ds, 4, seed=2, config=config) as loader:
        for step in range(12):  # the pipeline thread runs ahead while peek reads
            peeked.append([row["record"] for row in loader.peek(step + 3)])
            got.append(next(loader)["record"].tolist())
        assert loader.step == 12
    assert got == expected[:12] and peeked == expected[3:15]


def test_issue13_item11_peek_rows_are_the_leading_rows_of_the_step(tmp_path):
    ds = roxxel.open_dataset(_dataset(tmp_path / "ds"))
    loader = roxxel.Loader(ds, 8, seed=1, config=_provenance(max_len=MAX_LEN))
    every = loader.peek(2)
    first = loader.peek(2, rows=3)
    assert [r["record"] for r in first] == [r["record"] for r in every[:3]]
    assert len(loader.peek(2, rows=100)) == 8


def test_issue13_item11_peek_decodes_text_and_leaves_numbers_alone(tmp_path):
    ds = roxxel.open_dataset(_dataset(tmp_path / "ds"))
    loader = roxxel.Loader(ds, 4, shuffle=False, config=_provenance(max_len=MAX_LEN))
    texts = [row["text"] for row in loader.peek(1, field="text")]
    assert texts == ["doc 4 é", "doc 5 é", "doc 6 é", "doc 7 é"]
    assert all(row["text"] is None for row in loader.peek(1))  # int32 tokens, no decode
    decoded = loader.peek(1, rows=1, decode=lambda ids: " ".join(f"<{t}>" for t in ids))
    assert decoded[0]["text"] == "<4> <5> <6> <7> <8>"


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((-1,), {}), ((0,), {"rows": 0}), ((0,), {"field": "token"}), ((True,), {})],
)
def test_issue13_item11_peek_refuses_bad_arguments(tmp_path, args, kwargs):
    ds = roxxel.open_dataset(_dataset(tmp_path / "ds"))
    loader = roxxel.Loader(ds, 4, config=_provenance(max_len=MAX_LEN))
    with pytest.raises(ConfigError):
        loader.peek(*args, **kwargs)


# ---- roxxel peek ---------------------------------------------------------------------


def _peek_json(capsys, *argv) -> list[dict]:
    assert main(["peek", *map(str, argv), "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_issue13_item11_cli_peek_of_a_dataset_matches_the_loader(tmp_path, capsys):
    path = _dataset(tmp_path / "ds")
    rows = _peek_json(capsys, path, "--step", 3, "--batch-size", 8, "--seed", 5)
    loader = roxxel.Loader(
        roxxel.open_dataset(path), 8, seed=5, config=_provenance(max_len=MAX_LEN)
    )
    expected = loader.peek(3)
    assert [r["record"] for r in rows] == [r["record"] for r in expected]
    assert [r["values"] for r in rows] == [r["values"].tolist() for r in expected]
    assert rows[0]["source"] == "ds" and rows[0]["field"] == "tokens"


def test_issue13_item11_cli_peek_prints_source_record_length_and_text(tmp_path, capsys):
    path = _dataset(tmp_path / "ds")
    argv = ["peek", path, "--step", "1", "--rows", "2", "--batch-size", "4", "--field", "text"]
    assert main([*map(str, argv), "--no-shuffle"]) == 0
    out = capsys.readouterr().out
    assert "step 1" in out
    assert "source ds" in out and "record 4" in out and "record 5" in out
    assert "'doc 4 é'" in out and "length 8" in out
    assert out.count("row ") == 2


def test_issue13_item11_cli_peek_of_a_mixture_toml(tmp_path, capsys):
    toml = _mixture_dir(tmp_path)
    rows = _peek_json(capsys, toml, "--step", 6)
    mixture = roxxel.Mixture.from_toml(toml, open_plan_source)
    expected = roxxel.Loader(mixture, config=_provenance()).peek(6)
    assert [(r["source"], r["record"]) for r in rows] == [
        (r["source"], r["record"]) for r in expected
    ]
    assert {r["length"] for r in rows} == {9}


def test_issue13_item11_cli_peek_seq_len_reads_token_windows(tmp_path, capsys):
    path = _dataset(tmp_path / "ds")
    rows = _peek_json(capsys, path, "--step", 0, "--batch-size", 2, "--seq-len", 3, "--seed", 0)
    windows = roxxel.TokenWindows(roxxel.open_dataset(path), "tokens", 3)
    expected = roxxel.Loader(windows, 2, seed=0).peek(0)
    assert [r["values"] for r in rows] == [r["values"].tolist() for r in expected]
    assert [r["length"] for r in rows] == [4, 4]


def test_issue13_item11_cli_peek_decodes_with_the_datasets_tokenizer(tmp_path, capsys, monkeypatch):
    (tmp_path / "tok.json").write_text("{}")
    path = _dataset(tmp_path / "ds", metadata={"tokenizer": str(tmp_path / "tok.json")})

    class Tokenizer:  # the piece of `tokenizers.Tokenizer` that peek uses
        @staticmethod
        def from_file(file: str) -> Tokenizer:
            assert file == str(tmp_path / "tok.json")
            return Tokenizer()

        def decode(self, ids: list[int]) -> str:
            return "|".join(f"t{i}" for i in ids)

    monkeypatch.setitem(sys.modules, "tokenizers", types.SimpleNamespace(Tokenizer=Tokenizer))
    argv = ["peek", path, "--step", "0", "--batch-size", "2", "--no-shuffle"]
    assert main(list(map(str, argv))) == 0
    assert "'t0'" in capsys.readouterr().out
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # not installed: numbers only
    assert main(list(map(str, argv))) == 0
    assert "t0" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "status", "message"),
    [
        (["--step", "99", "--batch-size", "8"], 1, "past the end"),
        (["--step", "0"], 2, "--batch-size"),
        (["--step", "0", "--batch-size", "8", "--field", "token"], 1, "'tokens'"),
        (["--step", "-1", "--batch-size", "8"], 1, "too small"),
    ],
)
def test_issue13_item11_cli_peek_errors_are_one_line(tmp_path, capsys, extra, status, message):
    path = _dataset(tmp_path / "ds")
    assert main(["peek", str(path), *extra]) == status
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_issue13_item11_cli_peek_seq_len_with_a_mixture_is_a_usage_error(tmp_path, capsys):
    toml = _mixture_dir(tmp_path)
    assert main(["peek", str(toml), "--step", "0", "--seq-len", "4"]) == 2
    assert "seq_len" in capsys.readouterr().err
