"""Tests for roxxel.ingest.inputs: input discovery, work units, every reader, schema inference."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from roxxel.errors import ConfigError
from roxxel.ingest import text as ingest_text
from roxxel.ingest.inputs import (
    BadRecords,
    Input,
    ReadOptions,
    cut_units,
    detect_kind,
    expand_inputs,
    infer_schema,
    locate,
    read_unit,
)
from roxxel.ingest.megatron import MAGIC


def _records(inputs, unit_bytes=1 << 20, opts=None, bad=None):
    opts = opts or ReadOptions()
    bad = bad if bad is not None else BadRecords()
    units = cut_units(inputs, unit_bytes)
    return [(r, locate(p, k)) for u in units for r, p, k in read_unit(u, opts, bad)]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_megatron(prefix, seqs, dtype_code=4, dtype="<i4", version=1):
    """A Megatron .bin/.idx pair written from the documented layout."""
    lengths = np.array([len(s) for s in seqs], "<i4")
    item = np.dtype(dtype).itemsize
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64) * item]).astype("<i8")
    docs = np.arange(len(seqs) + 1, dtype="<i8")
    with open(f"{prefix}.bin", "wb") as f:
        for s in seqs:
            f.write(np.asarray(s, dtype).tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(struct.pack("<9sQBQQ", MAGIC, version, dtype_code, len(seqs), len(docs)))
        f.write(lengths.tobytes() + pointers.tobytes() + docs.tobytes())
    return f"{prefix}.bin"


# ---- JSON Lines and text -------------------------------------------------------------


def test_issue14_a_file_named_twice_through_overlapping_inputs_is_read_once(tmp_path, monkeypatch):
    """`roxxel pack ./docs docs/a` names docs/a twice: it is packed once, in its first place."""
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    for name in ("a.jsonl", "sub/b.jsonl"):
        (tmp_path / "docs" / name).write_text('{"text": "x"}\n')
    monkeypatch.chdir(tmp_path)
    found = expand_inputs(
        ["./docs", "docs/a.jsonl", "docs/sub/../sub/b.jsonl", str(tmp_path / "docs")]
    )
    assert [os.path.normpath(i.path) for i in found] == ["docs/a.jsonl", "docs/sub/b.jsonl"]


def test_jsonl_records_and_line_locations(tmp_path):
    path = _write_jsonl(tmp_path / "a.jsonl", [{"x": i, "t": [i] * i} for i in range(5)])
    got = _records([Input(path, "jsonl")])
    assert [r["x"] for r, _ in got] == list(range(5))
    assert got[3][1] == f"{path}:4"


@pytest.mark.parametrize("unit_bytes", [1, 7, 20, 33, 1000])
def test_jsonl_any_cut_reads_every_line_once(tmp_path, unit_bytes):
    path = _write_jsonl(tmp_path / "a.jsonl", [{"x": i, "pad": "y" * (i % 7)} for i in range(40)])
    got = _records([Input(path, "jsonl")], unit_bytes=unit_bytes)
    assert [r["x"] for r, _ in got] == list(range(40))


def test_jsonl_without_trailing_newline_and_blank_lines(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"x": 1}\n\n  \n{"x": 2}')
    assert [r["x"] for r, _ in _records([Input(str(path), "jsonl")])] == [1, 2]


def test_malformed_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"x": 1}\n{"x": 2}\n{"x": \n{"x": 4}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:3: malformed JSON"):
        _records([Input(str(path), "jsonl")])


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_jsonl_refuses_nan_and_infinity_with_or_without_orjson(tmp_path, monkeypatch, constant):
    path = tmp_path / "c.jsonl"
    path.write_text(f'{{"x": 1}}\n{{"x": {constant}}}\n')
    for loads in {
        ingest_text._loads,
        lambda line: json.loads(line, parse_constant=ingest_text._no_constants),
    }:
        monkeypatch.setattr(ingest_text, "_loads", loads)
        with pytest.raises(ConfigError, match=r"c\.jsonl:2: malformed JSON"):
            _records([Input(str(path), "jsonl")])


def test_jsonl_line_that_is_not_an_object_is_refused(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"x": 1}\n[1, 2]\n')
    with pytest.raises(ConfigError, match=r"a\.jsonl:2: JSON list \(expected a JSON object\)"):
        _records([Input(str(path), "jsonl")])


def test_skip_bad_counts_and_keeps_first_locations(tmp_path):
    lines = [json.dumps({"x": i}) if i % 3 else "{oops" for i in range(30)]
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(lines) + "\n")
    bad = BadRecords()
    got = _records([Input(str(path), "jsonl")], opts=ReadOptions(skip_bad=True), bad=bad)
    assert len(got) == 20 and bad.count == 10
    assert len(bad.first) == 5 and bad.first[0].startswith(f"{path}:1:")
    assert bad.first[1].startswith(f"{path}:4:")


def test_text_lines_skip_empty_and_strip_cr(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"hello\r\n\nworld\n")
    got = _records([Input(str(path), "text")])
    assert [r for r, _ in got] == [{"text": "hello"}, {"text": "world"}]
    assert got[1][1] == f"{path}:3"


def test_text_invalid_utf8_is_an_error_or_skipped(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"ok\n\xff\xfe\n")
    with pytest.raises(ConfigError, match=r"a\.txt:2: invalid UTF-8"):
        _records([Input(str(path), "text")])
    bad = BadRecords()
    assert len(_records([Input(str(path), "text")], opts=ReadOptions(skip_bad=True), bad=bad)) == 1
    assert bad.count == 1


def test_text_file_is_one_document_per_file(tmp_path):
    (tmp_path / "d").mkdir()
    for name in ("b.md", "a.md"):
        (tmp_path / "d" / name).write_text(f"doc {name}\nline 2\n")
    inputs = expand_inputs([str(tmp_path / "d")], "text-file")
    got = _records(inputs, opts=ReadOptions(field="body"))
    assert [r["body"] for r, _ in got] == ["doc a.md\nline 2\n", "doc b.md\nline 2\n"]


# ---- numpy ---------------------------------------------------------------------------


def test_npy_rows_in_pieces(tmp_path):
    array = np.arange(60, dtype=np.uint8).reshape(10, 2, 3)
    np.save(tmp_path / "x.npy", array)
    inputs = expand_inputs([str(tmp_path / "x.npy")])
    units = cut_units(inputs, unit_bytes=20)
    assert len(units) > 1
    got = _records(inputs, unit_bytes=20, opts=ReadOptions(field="image"))
    np.testing.assert_array_equal(np.stack([r["image"] for r, _ in got]), array)
    assert got[7][1].endswith("x.npy: row 7")


def test_npy_object_array_is_refused_without_unpickling(tmp_path):
    np.save(tmp_path / "o.npy", np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    with pytest.raises(ConfigError, match=r"o\.npy: not a readable \.npy"):
        expand_inputs([str(tmp_path / "o.npy")]) and cut_units(
            expand_inputs([str(tmp_path / "o.npy")]), 100
        )


def test_npz_zips_arrays_by_name(tmp_path):
    np.savez(tmp_path / "d.npz", image=np.ones((4, 2), np.float32), label=np.arange(4))
    got = _records(expand_inputs([str(tmp_path / "d.npz")]))
    assert [int(r["label"]) for r, _ in got] == [0, 1, 2, 3]
    assert got[0][0]["image"].shape == (2,)


def test_npz_unequal_leading_dims_are_refused(tmp_path):
    np.savez(tmp_path / "d.npz", a=np.ones(3), b=np.ones(4))
    with pytest.raises(ConfigError, match="leading dimensions differ"):
        _records(expand_inputs([str(tmp_path / "d.npz")]))


# ---- Arrow family --------------------------------------------------------------------


def _table(n=6):
    return pa.table(
        {
            "tokens": pa.array([list(range(i)) for i in range(n)], pa.list_(pa.int32())),
            "text": [f"t{i}" for i in range(n)],
            "label": pa.array(range(n), pa.int16()),
        }
    )


def test_parquet_row_groups_become_pieces(tmp_path):
    pq.write_table(_table(), tmp_path / "a.parquet", row_group_size=2)
    inputs = expand_inputs([str(tmp_path / "a.parquet")])
    got = _records(inputs, unit_bytes=1)
    assert len(cut_units(inputs, 1)) == 3
    assert [r["text"] for r, _ in got] == [f"t{i}" for i in range(6)]
    np.testing.assert_array_equal(got[4][0]["tokens"], np.arange(4, dtype=np.int32))
    assert got[5][0]["label"].dtype == np.int16 and got[5][1].endswith("a.parquet: row 5")


def test_parquet_nulls_are_refused_with_row(tmp_path):
    pq.write_table(pa.table({"x": [1, None, 3]}), tmp_path / "n.parquet")
    with pytest.raises(ConfigError, match=r"row 1: field 'x': null"):
        _records(expand_inputs([str(tmp_path / "n.parquet")]))


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_issue14_nulls_in_columns_the_pack_does_not_read_are_ignored(tmp_path, kind, capsys):
    """Input fields the schema does not name are ignored (docs/cli.md), nulls in them too:
    HF datasets carry nullable metadata columns. A null in a field it reads is refused."""
    import roxxel
    from roxxel.cli import main
    from tests.test_ingest_hostile import write_table

    table = pa.table(
        {
            "text": ["a", "bb", None],
            "other": [1, None, 3],
            "meta": pa.array([{"k": 1}, None, {"k": None}]),
        }
    )
    path = write_table(table, tmp_path / f"t.{kind}")
    out = tmp_path / "ds"
    assert main(["pack", str(path), "-o", str(out), "--field", "other:int64", "-q"]) == 1
    assert "row 1: field 'other': null" in capsys.readouterr().err
    argv = ["pack", str(path), "-o", str(out), "--field", "text:str", "--skip-bad", "-q"]
    assert main(argv) == 0
    assert [r["text"] for r in roxxel.open_dataset(out)] == ["a", "bb"]  # row 2's own null


def test_arrow_file_and_stream(tmp_path):
    table = _table()
    with pa.ipc.new_file(str(tmp_path / "f.arrow"), table.schema) as w:
        for batch in table.to_batches(max_chunksize=2):
            w.write_batch(batch)
    with pa.ipc.new_stream(str(tmp_path / "s.arrow"), table.schema) as w:
        w.write_table(table)
    for name in ("f.arrow", "s.arrow"):
        got = _records(expand_inputs([str(tmp_path / name)]), unit_bytes=1)
        assert [r["text"] for r, _ in got] == [f"t{i}" for i in range(6)], name


def _hf_dir(tmp_path, indices=None):
    d = tmp_path / "hf"
    d.mkdir()
    table = _table()
    for i, part in enumerate((table.slice(0, 4), table.slice(4))):
        with pa.ipc.new_stream(str(d / f"data-0000{i}-of-00002.arrow"), table.schema) as w:
            w.write_table(part)
    files = [{"filename": f"data-0000{i}-of-00002.arrow"} for i in range(2)]
    state = {"_data_files": files, "_indices_data_files": indices}
    (d / "state.json").write_text(json.dumps(state))
    (d / "dataset_info.json").write_text("{}")
    return d


def test_hf_save_to_disk_directory_reads_without_datasets(tmp_path):
    d = _hf_dir(tmp_path)
    got = _records(expand_inputs([str(d)]))
    assert [r["text"] for r, _ in got] == [f"t{i}" for i in range(6)]


def test_hf_indices_mapping_and_dataset_dict_are_refused(tmp_path):
    d = _hf_dir(tmp_path, indices=[{"filename": "indices.arrow"}])
    with pytest.raises(ConfigError, match="flatten_indices"):
        expand_inputs([str(d)])
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "train").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    with pytest.raises(ConfigError, match=r"splits \['train'\]"):
        expand_inputs([str(tmp_path / "dd")])


# ---- Megatron ------------------------------------------------------------------------


def test_megatron_index_is_parsed_once_per_version_of_the_pair(tmp_path):
    from roxxel.ingest import megatron as ingest_megatron

    src = write_megatron(tmp_path / "c", [[1, 2], [3]])
    first = ingest_megatron.read_megatron_index(src)
    assert ingest_megatron.read_megatron_index(src) is first  # the units of one pack share it
    write_megatron(tmp_path / "c", [[1, 2], [3, 4, 5]])
    assert ingest_megatron.read_megatron_index(src).lengths.tolist() == [2, 3]


def test_megatron_pair_reads_sequences(tmp_path):
    seqs = [[1, 2, 3], [], [70000, 5]]
    write_megatron(tmp_path / "c", seqs)
    inputs = expand_inputs([str(tmp_path / "c.idx"), str(tmp_path / "c.bin")])
    assert inputs == [Input(str(tmp_path / "c.bin"), "megatron")]
    got = _records(inputs, unit_bytes=4)
    assert [r["tokens"].tolist() for r, _ in got] == seqs
    assert got[2][1].endswith("c.bin: sequence 2")


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b"XXIDIDX\x00\x00" + b[9:], "magic"),
        (lambda b: b[:9] + struct.pack("<Q", 2) + b[17:], "version 2"),
        (lambda b: b[:17] + bytes([9]) + b[18:], "dtype code 9"),
        (lambda b: b[:-3], "bytes for 2 sequences"),
        (lambda b: b[:10], "header"),
    ],
)
def test_megatron_bad_index_is_refused(tmp_path, mutate, message):
    write_megatron(tmp_path / "c", [[1, 2], [3]])
    idx = tmp_path / "c.idx"
    idx.write_bytes(mutate(idx.read_bytes()))
    with pytest.raises(ConfigError, match=message):
        cut_units(expand_inputs([str(tmp_path / "c.bin")]), 100)


def test_megatron_pointer_past_bin_end_is_refused(tmp_path):
    write_megatron(tmp_path / "c", [[1, 2], [3]])
    (tmp_path / "c.bin").write_bytes(b"\x00" * 8)  # 2 tokens, the index says 3
    with pytest.raises(ConfigError, match=r"sequence 1: pointer 8, length 1"):
        cut_units(expand_inputs([str(tmp_path / "c.bin")]), 100)


def test_megatron_missing_idx(tmp_path):
    (tmp_path / "c.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"c\.idx: missing"):
        expand_inputs([str(tmp_path / "c.bin")])


# ---- discovery and planning ----------------------------------------------------------


def test_expand_walks_directories_sorted_and_globs(tmp_path):
    for name in ("b/2.jsonl", "a/1.jsonl", "a/.hidden.jsonl", "a/notes.md"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text('{"x": 1}\n')
    got = expand_inputs([str(tmp_path)])
    assert [os.path.relpath(i.path, tmp_path) for i in got] == ["a/1.jsonl", "b/2.jsonl"]
    assert expand_inputs([str(tmp_path / "*" / "*.jsonl"), str(tmp_path / "a")]) == got


@pytest.mark.parametrize(
    ("arg", "message"),
    [("nope.jsonl", "no such file"), ("nope/*.jsonl", "glob matches nothing")],
)
def test_expand_refuses_missing_inputs(tmp_path, arg, message):
    with pytest.raises(ConfigError, match=message):
        expand_inputs([str(tmp_path / arg)])


def test_unknown_extension_asks_for_format():
    with pytest.raises(ConfigError, match="pass --format"):
        detect_kind("data.csv")
    with pytest.raises(ConfigError, match="--format 'csv'"):
        expand_inputs(["x"], "csv")


def test_plan_is_deterministic_and_covers_inputs(tmp_path):
    paths = [_write_jsonl(tmp_path / f"{i}.jsonl", [{"x": j} for j in range(50)]) for i in range(3)]
    inputs = expand_inputs(paths)
    a, b = cut_units(inputs, 100), cut_units(inputs, 100)
    assert a == b and [u.index for u in a] == list(range(len(a)))
    total = sum(p.num_bytes for u in a for p in u.pieces)
    assert total == sum(os.path.getsize(p) for p in paths)


def test_small_files_are_grouped_into_one_unit(tmp_path):
    paths = [_write_jsonl(tmp_path / f"{i}.jsonl", [{"x": i}]) for i in range(5)]
    units = cut_units(expand_inputs(paths), 1 << 20)
    assert len(units) == 1 and len(units[0].pieces) == 5


# ---- schema inference ----------------------------------------------------------------


def test_infer_python_values():
    recs = [{"t": [1, 2], "y": 1, "f": 1, "s": "a", "b": b"x", "m": [[1.0, 2.0]], "ok": True}]
    recs.append({"t": [], "y": 2, "f": 0.5, "s": "b", "b": b"", "m": [[3, 4], [5, 6]], "ok": False})
    assert infer_schema(recs) == {
        "t": "int64[]",
        "y": "int64",
        "f": "float64",
        "s": "str",
        "b": "bytes",
        "m": "float64[,2]",
        "ok": "bool",
    }
    assert infer_schema(recs[:1], int_dtype="int32")["t"] == "int32[]"


def test_infer_numpy_rows_fixed_or_variable():
    rows = [{"img": np.zeros((3, 4), np.uint8), "y": np.int16(2)} for _ in range(3)]
    assert infer_schema(rows, fixed_arrays=True) == {"img": "uint8[3,4]", "y": "int16"}
    assert infer_schema(rows) == {"img": "uint8[,4]", "y": "int16"}


@pytest.mark.parametrize(
    "records",
    [
        [{"x": 1}, {"x": "a"}],
        [{"x": []}],
        [{"x": 1}, {"y": 1}],
        [{"x": None}],
        [{"x": {"a": 1}}],
        [{"x": ["a"]}],
        [{"x": [1]}, {"x": [[1]]}],
        [{"x": [[1, 2], [3]]}],
        [{"x": np.zeros(2, np.int8)}, {"x": np.zeros(2, np.int16)}],
    ],
)
def test_infer_ambiguous_asks_for_field(records):
    with pytest.raises(ConfigError, match="pass --field"):
        infer_schema(records)


def test_infer_needs_records():
    with pytest.raises(ConfigError, match="no records"):
        infer_schema([])


# ---- user sweep: where schema inference saw the ambiguity; invalid UTF-8 in JSONL ----------


@pytest.mark.parametrize(
    ("records", "at", "example"),
    [
        ([{"u": "a"}, {"u": "b"}, {"u": 1}], 2, "--field u:str"),
        ([{"u": [1]}, {"u": [[1]]}], 1, "--field u:int64[]"),
        ([{"u": [1.5]}, {"u": "x"}], 1, "--field u:float64[]"),
        ([{"u": []}, {"u": []}], 0, "--field u:int64[]"),
        ([{"u": 1}, {"v": 1}], 1, "--field u:int64"),
    ],
)
def test_an_ambiguous_field_example_fits_its_values_and_names_the_sample(records, at, example):
    """The hint was always `e.g. --field url:int32[]`, even for a field of strings."""
    with pytest.raises(ConfigError) as e:
        infer_schema(records, where=lambda i: f"in.jsonl:{i + 1}")
    message = str(e.value)
    assert message.startswith(f"in.jsonl:{at + 1}: schema inference: field "), message
    assert "pass --field" in message and message.endswith(f"e.g. {example})"), message


def test_an_ambiguous_field_hint_lists_the_fields_the_pack_gives():
    with pytest.raises(ConfigError, match=r"e\.g\. --field tokens:uint16\[\] --field u:str\)$"):
        infer_schema([{"u": "a"}, {"u": 2}], given={"tokens": "uint16[]"})


@pytest.mark.parametrize("with_orjson", [True, False])
def test_jsonl_invalid_utf8_is_named_as_such(tmp_path, monkeypatch, with_orjson):
    """A JSONL line of bytes that are not UTF-8 said `malformed JSON (str is not valid UTF-8:
    surrogates not allowed ...)`; a .txt line of the same bytes says `invalid UTF-8 (...
    can't decode byte 0xff ...)`. Both say it that way now."""
    path = tmp_path / "badutf.jsonl"
    path.write_bytes(b'{"text":"ok"}\n\xff\xfe{"text":"x"}\n')
    if not with_orjson:
        monkeypatch.setattr(ingest_text, "orjson", None)
    with pytest.raises(ConfigError, match=r"badutf\.jsonl:2: invalid UTF-8 \(.*byte 0xff"):
        _records([Input(str(path), "jsonl")])
    bad = BadRecords()
    got = _records([Input(str(path), "jsonl")], opts=ReadOptions(skip_bad=True), bad=bad)
    assert [r for r, _ in got] == [{"text": "ok"}]
    assert bad.count == 1 and "invalid UTF-8" in bad.first[0]
