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

        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
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
        (["--step", "0", "--batch-size", "8", "--all-values"], 2, "--all-values is for --json"),
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


# ---- fields of several dimensions, a dataset opened as ".", special tokens -------------

IMAGE = {"image": "uint8[3,16,24]", "boxes": "float32[,4]", "label": "int64"}


def _images(path: Path, num: int = 8) -> Path:
    with roxxel.DatasetWriter(path, IMAGE) as writer:
        for i in range(num):
            image = ((np.arange(3 * 16 * 24) + i) % 256).astype(np.uint8).reshape(3, 16, 24)
            boxes = np.arange(4 * (1 + i % 3), dtype=np.float32).reshape(-1, 4) + i
            writer.write({"image": image, "boxes": boxes, "label": i})
    return path


def test_peek_of_a_fixed_shape_field_of_several_dimensions_has_no_length(tmp_path):
    ds = roxxel.open_dataset(_images(tmp_path / "img"))
    config = _provenance(max_len={"boxes": 4})
    rows = roxxel.Loader(ds, 4, shuffle=False, config=config).peek(1, field="image")
    assert [row["length"] for row in rows] == [None] * 4  # 3 is its channels, not a length
    assert [row["values"].shape for row in rows] == [(3, 16, 24)] * 4
    assert all(row["text"] is None for row in rows)
    boxes = roxxel.Loader(ds, 4, shuffle=False, config=config).peek(1, field="boxes")
    assert [(row["length"], row["values"].shape) for row in boxes] == [
        (2, (2, 4)),
        (3, (3, 4)),
        (1, (1, 4)),
        (2, (2, 4)),
    ]


@pytest.mark.parametrize(
    ("field", "shown"),
    [
        (
            "image",
            "uint8[3,16,24]  [ 4  5  6  7  8  9 10 11 12 13 14 15 16 17 18 19] ... (1152 in all)",
        ),
        ("boxes", "length 2  float32[2,4]  [ 4.  5.  6.  7.  8.  9. 10. 11.]"),
        ("label", "length 1  4"),
    ],
)
def test_cli_peek_prints_a_field_of_several_dimensions_as_its_shape_and_first_values(
    tmp_path, capsys, field, shown
):
    path = _images(tmp_path / "img")
    argv = ["peek", path, "--step", "1", "--batch-size", "4", "--rows", "2", "--field", field]
    assert main([*map(str, argv), "--no-shuffle"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3  # the header, then one line per row
    assert lines[1] == f"row 0  source img  record 4  {shown}"


def test_cli_peek_json_of_a_field_of_several_dimensions_holds_its_head_not_every_value(
    tmp_path, capsys
):
    path = _images(tmp_path / "img")
    argv = [path, "--step", "0", "--batch-size", "2", "--no-shuffle", "--field", "image"]
    rows = _peek_json(capsys, *argv)
    assert [sorted(row) for row in rows] == [
        ["dtype", "field", "head", "length", "record", "row", "shape", "source", "text"]
    ] * 2
    assert rows[1]["shape"] == [3, 16, 24] and rows[1]["dtype"] == "uint8"
    assert rows[1]["head"] == list(range(1, 17)) and rows[1]["length"] is None
    every = _peek_json(capsys, *argv, "--all-values")
    image = roxxel.open_dataset(path)[1]["image"]
    assert every[1]["values"] == image.tolist() and every[1]["head"] == rows[1]["head"]
    tokens = _peek_json(capsys, _dataset(tmp_path / "ds"), "--step", 0, "--batch-size", 2)
    assert {(row["dtype"], len(row["values"])) for row in tokens} == {
        ("int32", row["shape"][0]) for row in tokens
    }
    assert all("head" not in row for row in tokens)  # rows of one dimension: every value


def test_peek_of_a_dataset_opened_as_dot_names_its_folder(tmp_path, capsys, monkeypatch):
    _dataset(tmp_path / "ds")
    monkeypatch.chdir(tmp_path / "ds")
    rows = roxxel.Loader(roxxel.open_dataset("."), 4, config=_provenance(max_len=MAX_LEN))
    assert {row["source"] for row in rows.peek(0)} == {"ds"}
    assert {row["source"] for row in _peek_json(capsys, ".", "--step", 0, "--batch-size", 2)} == {
        "ds"
    }
    assert main(["peek", ".", "--step", "0", "--batch-size", "2"]) == 0
    assert "source ds  record" in capsys.readouterr().out


def test_cli_peek_shows_the_special_tokens_a_row_holds(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[EOS]": 0, "[BOS]": 1, "hello": 2, "world": 3, "[UNK]": 4}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.add_special_tokens(["[EOS]", "[BOS]"])
    tokenizer.save(str(tmp_path / "tok.json"))
    with roxxel.DatasetWriter(
        tmp_path / "ds", {"tokens": "int32[]"}, metadata={"tokenizer": "../tok.json"}
    ) as writer:
        writer.write({"tokens": np.array([1, 2, 3, 0], np.int32)})
    argv = ["peek", tmp_path / "ds", "--step", "0", "--batch-size", "1"]
    assert main(list(map(str, argv))) == 0
    assert "length 4  '[BOS] hello world [EOS]'" in capsys.readouterr().out
