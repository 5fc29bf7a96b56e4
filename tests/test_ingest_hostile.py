"""Hostile and unusual inputs for ``roxxel pack``: the input-kind registry (issue 11 point 4)
and the readers' hardening (issue 12 items 4, 5, 6, 11, 13, 16 and its clear errors; issue 13
items 6 and 8). Each test is named after the issue item it pins."""

from __future__ import annotations

import base64
import json
import os
import struct
import subprocess
import sys
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import roxxel
from roxxel.cli import main
from roxxel.errors import ConfigError
from roxxel.ingest import registry, text
from roxxel.ingest.infer import infer_schema
from roxxel.ingest.inputs import (
    BadRecords,
    Input,
    InputKind,
    Piece,
    ReadOptions,
    Record,
    cut_units,
    expand_inputs,
    read_unit,
)
from roxxel.ingest.megatron import MAGIC
from roxxel.ingest.npy import NPZ_WHOLE_MAX_BYTES


def write_table(table: pa.Table, path: Path) -> Path:
    """``table`` as a Parquet file, or an Arrow IPC file for any other suffix."""
    if path.suffix == ".parquet":
        pq.write_table(table, path)
    else:
        with pa.ipc.new_file(str(path), table.schema) as w:
            w.write_table(table)
    return path


def _run(*argv: object) -> int:
    return main([str(a) for a in argv])


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err


def _jsonl(path: Path, rows: Sequence[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _records(inputs: list[Input], opts: ReadOptions | None = None) -> list[Record]:
    bad = BadRecords()
    units = cut_units(inputs, 1 << 20)
    return [r for u in units for r, _, _ in read_unit(u, opts or ReadOptions(), bad)]


# ---- issue 11 point 4: one registry of input kinds -------------------------------------


def _cut_tsv(path: str, unit_bytes: int) -> list[Piece]:
    del unit_bytes
    return [Piece(path, "tsv", 0, 1, os.path.getsize(path))]


def _read_tsv(piece: Piece, opts: ReadOptions, bad: BadRecords) -> Iterator[tuple[Record, int]]:
    del opts, bad
    with open(piece.path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            name, value = line.rstrip("\n").split("\t")
            yield {"name": name, "value": np.int32(value)}, i


TSV = InputKind("tsv", (".tsv",), _cut_tsv, _read_tsv)


def test_issue11_point4_a_kind_registered_in_one_line_is_found_cut_and_packed(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setitem(registry.KINDS, "tsv", TSV)
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "a.tsv").write_text("x\t1\ny\t2\n")
    (inputs / "b.tsv").write_text("z\t3\n")
    (inputs / "notes.md").write_text("not an input\n")
    found = expand_inputs([str(inputs)])
    assert found == [Input(str(inputs / "a.tsv"), "tsv"), Input(str(inputs / "b.tsv"), "tsv")]
    assert [u.pieces[0].kind for u in cut_units(found, 1)] == ["tsv", "tsv"]

    assert _run("pack", inputs, "-o", tmp_path / "ds") == 0
    assert "schema (inferred from the first 3 records): name:str, value:int32" in (
        capsys.readouterr().out
    )
    ds = roxxel.open_dataset(tmp_path / "ds")
    assert [ds[i]["name"] for i in range(3)] == ["x", "y", "z"]
    assert int(ds[2]["value"]) == 3
    # the CLI flag names the kind too, and an error names it where a record came from
    assert _run("pack", inputs / "a.tsv", "-o", tmp_path / "d2", "--format", "tsv", "-q") == 0
    (inputs / "bad.tsv").write_text("w\tnot-a-number\n")
    with pytest.raises(ValueError, match="not-a-number"):
        _records([Input(str(inputs / "bad.tsv"), "tsv")])


def test_issue11_point4_every_kind_is_declared_once_with_its_extensions():
    builtin = ["jsonl", "text", "text-file", "npy", "npz", "parquet", "arrow", "hf", "megatron"]
    assert [n for n in registry.kind_names() if n in builtin] == builtin
    extensions = [e for k in registry.KINDS.values() for e in k.extensions]
    assert len(extensions) == len(set(extensions))
    assert registry.kind_of_path("x/y.NDJSON") is registry.KINDS["jsonl"]
    assert registry.kind_of_path("c.idx") is registry.KINDS["megatron"]
    assert registry.kind_of_path("notes.md") is None
    with pytest.raises(ConfigError, match="unknown input kind"):
        registry.get_kind("csv")


# ---- issue 12 item 4: float casts that overflow ------------------------------------------


@pytest.mark.parametrize(
    ("value", "spec"), [(70000.0, "float16"), (1e39, "float32"), ([1.0, -1e39], "float32[]")]
)
def test_issue12_item4_jsonl_float_overflow_is_refused_with_line_and_field(
    tmp_path, capsys, value, spec
):
    first = [1.5] if isinstance(value, list) else 1.5
    src = _jsonl(tmp_path / "f.jsonl", [{"x": first}, {"x": value}])
    assert _run("pack", src, "-o", tmp_path / "ds", "--field", f"x:{spec}", "-q") == 1
    err = _one_line_error(capsys)
    assert f"{src}:2" in err and "field 'x'" in err and "does not fit" in err


def test_issue12_item4_rounding_and_given_infinities_are_kept(tmp_path):
    pq.write_table(pa.table({"x": pa.array([0.1, np.inf, -np.inf, 65504.0])}), tmp_path / "a.pq")
    assert _run("pack", tmp_path / "a.pq", "-o", tmp_path / "ds", "--field", "x:float16", "-q") == 0
    ds = roxxel.open_dataset(tmp_path / "ds")
    got = [float(ds[i]["x"]) for i in range(4)]
    assert got == [float(np.float16(0.1)), np.inf, -np.inf, 65504.0]


@pytest.mark.parametrize("skip_bad", [False, True])
def test_issue12_item4_parquet_float_overflow_is_refused_on_the_block_path(
    tmp_path, capsys, skip_bad
):
    table = pa.table({"x": pa.array([1.0, 2.0, 1e39, 4.0], pa.float64())})
    pq.write_table(table, tmp_path / "a.parquet")
    argv = ["pack", tmp_path / "a.parquet", "-o", tmp_path / "ds", "--field", "x:float32", "-q"]
    if not skip_bad:
        assert _run(*argv) == 1
        err = _one_line_error(capsys)
        assert "a.parquet: row 2" in err and "field 'x'" in err and "does not fit float32" in err
        return
    assert _run(*argv, "--skip-bad") == 0
    assert "skipped 1 bad records" in capsys.readouterr().err
    ds = roxxel.open_dataset(tmp_path / "ds")
    assert [float(ds[i]["x"]) for i in range(len(ds))] == [1.0, 2.0, 4.0]


# ---- issue 12 item 5: Megatron bounds that wrap ------------------------------------------


def _megatron(prefix: Path, lengths: list[int], pointers: list[int], bin_bytes: int) -> Path:
    with open(f"{prefix}.idx", "wb") as f:
        f.write(struct.pack("<9sQBQQ", MAGIC, 1, 4, len(lengths), len(lengths) + 1))
        f.write(np.asarray(lengths, "<i4").tobytes() + np.asarray(pointers, "<i8").tobytes())
        f.write(np.arange(len(lengths) + 1, dtype="<i8").tobytes())
    Path(f"{prefix}.bin").write_bytes(bytes(bin_bytes))
    return Path(f"{prefix}.bin")


@pytest.mark.parametrize("pointer", [2**63 - 8, 2**63 - 4, 2**62])
def test_issue12_item5_megatron_pointer_plus_length_past_int64_is_refused(
    tmp_path, capsys, pointer
):
    bin_path = _megatron(tmp_path / "c", [2, 10], [0, pointer], 8)
    with pytest.raises(ConfigError, match=r"sequence 1: pointer") as info:
        cut_units(expand_inputs([str(bin_path)]), 1 << 20)
    assert info.value.path == str(bin_path)
    assert _run("pack", bin_path, "-o", tmp_path / "ds", "-q") == 1
    assert str(bin_path) in _one_line_error(capsys)


# ---- issue 12 item 6: integers beyond 64 bits, booleans --------------------------------


def test_issue12_item6_inference_keeps_big_integers_exact_or_refuses(tmp_path, capsys):
    assert infer_schema([{"x": [3, 2**63]}, {"x": [2**64 - 1]}]) == {"x": "uint64[]"}
    assert infer_schema([{"x": 2**63}, {"x": 3}]) == {"x": "uint64"}
    with pytest.raises(ConfigError, match="ambiguous"):
        infer_schema([{"x": -1}, {"x": 2**63}])  # no 64-bit integer type holds both
    src = _jsonl(tmp_path / "big.jsonl", [{"x": 3}, {"x": 1180591620717411303425}])
    assert _run("pack", src, "-o", tmp_path / "ds") == 1
    assert "1180591620717411303425 does not fit a 64-bit integer" in _one_line_error(capsys)
    src2 = _jsonl(tmp_path / "u.jsonl", [{"x": 3}, {"x": 2**64 - 1}])
    assert _run("pack", src2, "-o", tmp_path / "u", "-q") == 0
    ds = roxxel.open_dataset(tmp_path / "u")
    assert ds.schema["x"].spec == "uint64" and int(ds[1]["x"]) == 2**64 - 1


def test_issue12_item6_big_integer_into_an_int64_field_says_it_does_not_fit(tmp_path, capsys):
    src = _jsonl(tmp_path / "big.jsonl", [{"x": 1}, {"x": 1180591620717411303425}])
    assert _run("pack", src, "-o", tmp_path / "ds", "--field", "x:int64", "-q") == 1
    err = _one_line_error(capsys)
    assert f"{src}:2" in err and "value 1180591620717411303425 does not fit int64" in err
    src2 = _jsonl(tmp_path / "l.jsonl", [{"x": [1, 1180591620717411303425]}])
    assert _run("pack", src2, "-o", tmp_path / "d2", "--field", "x:int64[]", "-q") == 1
    assert "does not fit int64" in _one_line_error(capsys)


@pytest.mark.parametrize("value", [True, [True, False]])
def test_issue12_clear_errors_json_true_into_an_int_field_is_refused(tmp_path, capsys, value):
    spec = "int32[]" if isinstance(value, list) else "int32"
    src = _jsonl(tmp_path / "b.jsonl", [{"x": value}])
    assert _run("pack", src, "-o", tmp_path / "ds", "--field", f"x:{spec}", "-q") == 1
    err = _one_line_error(capsys)
    assert f"{src}:1" in err and "JSON true" in err


@pytest.mark.parametrize(
    ("value", "spec"),
    [
        ([1, True, 3], "int32[]"),  # the typed fast path read true as 1
        ([5, 0, False], "int64[]"),
        ([2.5, False], "float32[]"),  # numpy read false as 0.0
        ([[1, 2], [3, True]], "int32[,2]"),  # nested lists take the checked path
    ],
)
def test_issue12_clear_errors_json_true_inside_a_list_of_numbers_is_refused(
    tmp_path, capsys, value, spec
):
    src = _jsonl(tmp_path / "b.jsonl", [{"x": value}])
    assert _run("pack", src, "-o", tmp_path / "ds", "--field", f"x:{spec}", "-q") == 1
    err = _one_line_error(capsys)
    assert f"{src}:1" in err and "JSON true" in err


def test_issue12_clear_errors_ones_and_zeros_in_a_list_are_numbers(tmp_path):
    src = _jsonl(tmp_path / "m.jsonl", [{"x": [1, 0, 1, 7]}, {"x": [0, 1.0]}])
    assert _run("pack", src, "-o", tmp_path / "ds", "--field", "x:float32[]", "-q") == 0
    ds = roxxel.open_dataset(tmp_path / "ds")
    assert ds[0]["x"].tolist() == [1, 0, 1, 7] and ds[1]["x"].tolist() == [0, 1]


# ---- issue 12 item 11: FIFOs, devices, symlink loops --------------------------------------


def test_issue12_item11_a_walk_reads_regular_files_and_says_what_it_skipped(tmp_path, capsys):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("hello")
    os.mkfifo(folder / "b.txt")  # opened, this would block forever
    os.symlink("/dev/zero", folder / "c.txt")  # read whole, this would never end
    os.symlink(folder / "d.txt", folder / "d.txt")  # a loop
    os.symlink(folder, folder / "e")
    out = tmp_path / "ds"
    assert _run("pack", folder, "-o", out, "--format", "text-file") == 0
    err = capsys.readouterr().err
    assert f"{folder / 'b.txt'}: a FIFO" in err
    assert f"{folder / 'c.txt'}: a character device" in err
    assert f"{folder / 'd.txt'}: a symlink loop" in err
    assert f"{folder / 'e'}: a symlink to a directory" in err
    ds = roxxel.open_dataset(out)
    assert len(ds) == 1 and ds[0]["text"] == "hello"


@pytest.mark.parametrize(
    ("name", "what"), [("fifo.txt", "a FIFO"), ("zero.txt", "a character device")]
)
def test_issue12_item11_a_named_special_file_is_an_error(tmp_path, capsys, name, what):
    path = tmp_path / name
    if name == "fifo.txt":
        os.mkfifo(path)
    else:
        os.symlink("/dev/zero", path)
    assert _run("pack", path, "-o", tmp_path / "ds", "--format", "text-file") == 1
    assert f"{path}: {what} (expected a regular file)" in _one_line_error(capsys)


def test_issue12_clear_errors_a_named_symlink_loop_is_a_config_error(tmp_path, capsys):
    loop = tmp_path / "loop.jsonl"
    os.symlink(loop, loop)
    with pytest.raises(ConfigError, match="a symlink loop") as info:
        expand_inputs([str(loop)])
    assert info.value.path == str(loop)
    assert _run("pack", loop, "-o", tmp_path / "ds") == 1
    assert "symlink loop" in _one_line_error(capsys)


# ---- issue 12 item 13: an input cut short while it is read ---------------------------------


def test_issue12_item13_jsonl_cut_short_while_read_is_an_error_not_sigbus(tmp_path):
    rows = [{"x": i, "pad": "y" * 100} for i in range(40000)]  # more than a read buffer
    src = _jsonl(tmp_path / "a.jsonl", rows)
    units = cut_units([Input(str(src), "jsonl")], 1 << 30)
    records = read_unit(units[0], ReadOptions(), BadRecords())
    assert next(records)[0]["x"] == 0
    os.truncate(src, 1000)  # under a memory map, touching the lost pages raised SIGBUS
    with pytest.raises(ConfigError, match="file ends") as info:
        for _ in records:
            pass
    assert info.value.path == str(src)


def test_issue12_item13_text_file_that_changed_size_since_planning_is_an_error(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("hello")
    units = cut_units([Input(str(src), "text-file")], 1 << 20)
    src.write_text("hello, and more")
    with pytest.raises(ConfigError, match="changed since planning"):
        list(read_unit(units[0], ReadOptions(), BadRecords()))


# ---- issue 12 item 16: .npz read from its headers, streamed ------------------------------


def _npz_with_header(path: Path, shape: tuple[int, ...]) -> None:
    """A .npz whose only member's header declares ``shape`` over 8 bytes of data."""
    header = {"descr": "<u1", "fortran_order": False, "shape": shape}
    text = repr(header).encode("latin1")
    text += b" " * (63 - (10 + len(text)) % 64) + b"\n"
    body = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text + bytes(8)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("x.npy", body)


def test_issue12_item16_npz_header_declaring_8_tib_is_refused_before_reading(tmp_path, capsys):
    path = tmp_path / "huge.npz"
    _npz_with_header(path, (1 << 20, 1 << 23))
    with pytest.raises(ConfigError, match="header declares shape") as info:
        cut_units(expand_inputs([str(path)]), 1 << 20)
    assert info.value.path == str(path)
    assert _run("pack", path, "-o", tmp_path / "ds") == 1
    assert "header declares shape (1048576, 8388608)" in _one_line_error(capsys)


def test_issue12_item16_npz_rows_stream_without_decompressing_the_whole_member(
    tmp_path, monkeypatch
):
    rows = np.arange(4000 * 64, dtype=np.int32).reshape(4000, 64)
    np.savez_compressed(tmp_path / "a.npz", tokens=rows, label=np.arange(4000, dtype=np.int16))
    reads: list[int] = []
    real_read = zipfile.ZipExtFile.read

    def spy(self, n=-1):
        reads.append(n)
        return real_read(self, n)

    monkeypatch.setattr(zipfile.ZipExtFile, "read", spy)
    monkeypatch.setattr("roxxel.ingest.npy.BLOCK_BYTES", 64 << 10)
    got = _records(expand_inputs([str(tmp_path / "a.npz")]))
    assert len(got) == 4000 and got[3999]["tokens"].tolist() == rows[3999].tolist()
    assert int(got[17]["label"]) == 17 and got[17]["label"].dtype == np.int16
    assert -1 not in reads and max(reads) <= 64 << 10  # never the whole member at once


def test_issue12_item16_fortran_npz_member_over_the_cap_is_refused(tmp_path, monkeypatch):
    np.savez(tmp_path / "f.npz", x=np.asfortranarray(np.zeros((8, 4), np.float32)))
    assert len(_records(expand_inputs([str(tmp_path / "f.npz")]))) == 8
    monkeypatch.setattr("roxxel.ingest.npy.NPZ_WHOLE_MAX_BYTES", 64)
    with pytest.raises(ConfigError, match="Fortran-ordered"):
        cut_units(expand_inputs([str(tmp_path / "f.npz")]), 1)
    assert NPZ_WHOLE_MAX_BYTES == 1 << 30


# ---- issue 12 clear errors ----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_issue12_clear_errors_a_null_row_is_skipped_and_counted_with_skip_bad(
    tmp_path, capsys, kind
):
    table = pa.table(
        {
            "x": pa.array([1, None, 3, 4, 5], pa.int32()),
            "t": pa.array([[1], [2], [None], [4], []], pa.list_(pa.int32())),
        }
    )
    path = write_table(table, tmp_path / f"n.{kind}")
    assert _run("pack", path, "-o", tmp_path / "ds", "-q") == 1
    assert "row 1: field 'x': null" in _one_line_error(capsys)
    assert _run("pack", path, "-o", tmp_path / "ds", "-q", "--skip-bad") == 0
    err = capsys.readouterr().err
    assert (
        "skipped 2 bad records" in err and "row 1: field" in err and "row 2: field 't': null" in err
    )
    ds = roxxel.open_dataset(tmp_path / "ds")
    assert [int(ds[i]["x"]) for i in range(len(ds))] == [1, 4, 5]
    assert ds[1]["t"].tolist() == [4]


def test_issue12_clear_errors_negative_shuffle_seed_is_a_usage_error(tmp_path, capsys):
    src = _jsonl(tmp_path / "a.jsonl", [{"x": 1}])
    assert _run("pack", src, "-o", tmp_path / "ds", "--shuffle-input", "-3") == 2
    assert "--shuffle-input -3" in _one_line_error(capsys)
    from roxxel.ingest.pack import shuffle_units

    with pytest.raises(ConfigError, match="--shuffle-input"):
        shuffle_units([], -3)


def test_issue12_clear_errors_system_exit_in_a_map_names_the_map_and_record(tmp_path, capsys):
    (tmp_path / "quitter.py").write_text("import sys\ndef f(r):\n    sys.exit(3)\n")
    src = _jsonl(tmp_path / "a.jsonl", [{"x": 1}])
    spec = f"{tmp_path / 'quitter.py'}:f"
    assert _run("pack", src, "-o", tmp_path / "ds", "--map", spec, "--field", "x:int32") == 1
    err = _one_line_error(capsys)
    assert f"{src}:1" in err and f"--map {spec} raised SystemExit" in err


# ---- issue 13 item 6: types kept as the source has them ---------------------------------


def test_issue13_item6_arrow_types_map_exactly(tmp_path, capsys):
    table = pa.table(
        {
            "f": pa.array([1.5, 2.5], pa.float32()),
            "h": pa.array([1.5, 2.5], pa.float16()),
            "v": pa.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]], pa.list_(pa.float32(), 4)),
            "m": pa.array(
                [[[1, 2, 3], [4, 5, 6]], [[7, 8, 9], [1, 2, 3]]],
                pa.list_(pa.list_(pa.uint8(), 3), 2),
            ),
            "r": pa.array([[[1, 2]], [[3, 4], [5, 6]]], pa.list_(pa.list_(pa.int16(), 2))),
            "s": pa.array([[1.0], []], pa.list_(pa.float32())),
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    assert _run("pack", tmp_path / "t.parquet", "-o", tmp_path / "ds") == 0
    out = capsys.readouterr().out
    assert (
        "schema (from the input's own types): f:float32, h:float16, v:float32[4], "
        "m:uint8[2,3], r:int16[,2], s:float32[]"
    ) in out
    ds = roxxel.open_dataset(tmp_path / "ds")
    assert ds[1]["v"].tolist() == [5.0, 6.0, 7.0, 8.0] and ds[1]["v"].dtype == np.float32
    assert ds[1]["m"].tolist() == [[7, 8, 9], [1, 2, 3]]
    assert ds[1]["r"].tolist() == [[3, 4], [5, 6]]


def test_issue13_item6_hf_array2d_keeps_dtype_and_shape(tmp_path, capsys):
    """An HF ``Array2D(shape=(2, 3), dtype="float32")`` column as ``datasets`` writes it:
    nested lists with the shape and dtype in the field's extension metadata."""
    meta = {
        b"ARROW:extension:name": b"datasets.features.features.Array2DExtensionType",
        b"ARROW:extension:metadata": json.dumps([[2, 3], "float32"]).encode(),
    }
    storage = pa.list_(pa.list_(pa.float32()))
    field = pa.field("a", storage, metadata=meta)
    values = [[[1, 2, 3], [4, 5, 6]], [[0.5, 0, 0], [0, 0, 0.25]]]
    table = pa.Table.from_arrays([pa.array(values, storage)], schema=pa.schema([field]))
    folder = tmp_path / "hf"
    folder.mkdir()
    with pa.ipc.new_stream(str(folder / "data-00000-of-00001.arrow"), table.schema) as w:
        w.write_table(table)
    state = {"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}
    (folder / "state.json").write_text(json.dumps(state))
    assert _run("pack", folder, "-o", tmp_path / "ds") == 0
    assert "a:float32[2,3]" in capsys.readouterr().out
    ds = roxxel.open_dataset(tmp_path / "ds")
    assert ds[1]["a"].dtype == np.float32 and ds[1]["a"].tolist() == values[1]


# ---- issue 13 item 8: a misspelt field lists the record's fields -------------------------


def test_issue13_item8_missing_field_lists_the_records_fields(tmp_path, capsys):
    src = _jsonl(tmp_path / "a.jsonl", [{"tokens": [1, 2], "id": 3}])
    assert _run("pack", src, "-o", tmp_path / "ds", "--field", "token:int32[]") == 1
    err = _one_line_error(capsys)
    assert f"{src}:1" in err and "'token'" in err and "['id', 'tokens']" in err


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ('{"_data_files": [{"filename": "../outside.arrow"}]}', "expected plain file names"),
        ('{"_data_files": [], "_data_files": []}', "duplicate key"),
        ("[1, 2]", "unreadable HF dataset state"),
    ],
)
def test_issue12_clear_errors_hf_state_is_parsed_strictly(tmp_path, state, message):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "state.json").write_text(state)
    with pytest.raises(ConfigError, match=message) as info:
        expand_inputs([str(folder)])
    assert info.value.path == str(folder / "state.json")


def test_issue13_item6_nested_lists_come_as_one_array_of_their_own_dtype():
    from roxxel.ingest.arrow import _batch_block

    storage = pa.list_(pa.list_(pa.float32()))
    rows = [[[1, 2, 3], [4, 5, 6]], [[7, 8, 9]], [[0, 0, 1], [1, 0, 0], [2, 2, 2]]]
    batch = pa.record_batch(
        [pa.array(rows, storage), pa.array([[[1], [2, 3]], [[4]], [[5]]], storage)],
        names=["a", "ragged"],
    ).slice(1, 2)
    block = _batch_block(pa, batch, Piece("x.arrow", "arrow", 0, 1, 0), 1)
    values = block.columns["a"]
    assert isinstance(values, np.ndarray) and values.dtype == np.float32
    assert values.shape == (4, 3) and block.lengths["a"].tolist() == [1, 3]
    got = [(r["a"].tolist(), key) for r, key in block.records()]
    assert got == [(rows[1], 1), (rows[2], 2)]
    # ragged inner lists have no one shape: one array per record, of the element type
    assert [r.dtype for r in block.columns["ragged"]] == [np.float32, np.float32]


def test_issue12_an_empty_nested_list_into_a_token_field_is_a_clear_error(tmp_path) -> None:
    """Found by tests/test_hostile_inputs.py: ``{"x": [[]]}`` with ``--field x:int32[]`` raised
    numpy's "argmax of an empty sequence" (a traceback from the CLI)."""
    import contextlib
    import io

    from roxxel.cli import main as cli_main

    source = tmp_path / "in.jsonl"
    source.write_text('{"x": [[]]}\n')
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli_main(["pack", str(source), "-o", str(tmp_path / "out"), "--field", "x:int32[]"])
    assert code == 1 and err.getvalue().count("\n") == 1, err.getvalue()
    assert "in.jsonl" in err.getvalue()


@pytest.mark.parametrize("suffix", [".parquet", ".arrow"])
def test_issue14_a_table_without_the_asked_column_is_one_line_naming_file_and_row(
    tmp_path, capsys, suffix
):
    """A Parquet or Arrow input without the one column a pack reads (`--field nope:int64`)
    raised `RuntimeError: generator raised StopIteration` with a traceback: the block of
    no columns could not say how many rows it held."""
    src = write_table(pa.table({"body": [1, 2, 3]}), tmp_path / f"c{suffix}")
    assert _run("pack", src, "-o", tmp_path / "ds", "--field", "nope:int64") == 1
    err = _one_line_error(capsys)
    assert str(src) in err and "row 0" in err and "'nope'" in err
    assert not (tmp_path / "ds" / "manifest.json").exists()


@pytest.mark.parametrize("suffix", [".parquet", ".arrow"])
def test_issue14_a_missing_column_names_the_columns_the_file_has(tmp_path, capsys, suffix):
    """The error listed the columns read ("its fields: ['body']", or "[]" when none was
    there), not the file's: a misspelt --field showed no column to pick instead."""
    table = pa.table({"body": [1, 2, 3], "text": ["a", "b", "c"]})
    src = write_table(table, tmp_path / f"c{suffix}")
    argv = ["--field", "body:int64", "--field", "nope:int64"]
    assert _run("pack", src, "-o", tmp_path / "ds", *argv) == 1
    err = _one_line_error(capsys)
    assert str(src) in err and "'nope'" in err and "['body', 'text']" in err
    assert not (tmp_path / "ds" / "manifest.json").exists()


def test_issue14_dictionary_encoded_columns_pack_as_their_values(tmp_path):
    """pandas saves a categorical column dictionary-encoded; such a string or integer
    column was refused ("Arrow type dictionary<...>") where its plain twin packs."""
    table = pa.table(
        {
            "text": pa.array(["a", "b", "a", "c"]).dictionary_encode(),
            "label": pa.array([3, 1, 3, 2], pa.int16()).dictionary_encode(),
        }
    )
    for suffix in (".parquet", ".arrow"):
        src = write_table(table, tmp_path / f"c{suffix}")
        out = tmp_path / f"ds{suffix}"
        assert _run("pack", src, "-o", out) == 0
        ds = roxxel.open_dataset(out)
        assert [ds[i]["label"].item() for i in range(4)] == [3, 1, 3, 2]
        assert ds[3]["label"].dtype == np.int16
        assert [ds[i]["text"] for i in range(4)] == ["a", "b", "a", "c"]


@pytest.mark.parametrize("suffix", [".parquet", ".arrow"])
def test_issue14_invalid_utf8_in_a_string_column_is_named_or_skipped(tmp_path, capsys, suffix):
    """Writers that do not check UTF-8 (Spark, DuckDB, Rust) can leave bytes that are not
    text in a string column: the pack died with a `UnicodeDecodeError` traceback, also
    with --skip-bad. Now one line naming the file, field and row, or the row skipped."""
    text = pa.array([b"ok", b"bad\xff", b"x"]).view(pa.string())
    src = write_table(pa.table({"id": [1, 2, 3], "text": text}), tmp_path / f"u{suffix}")
    assert _run("pack", src, "-o", tmp_path / "ds", "-q") == 1
    err = _one_line_error(capsys)
    assert str(src) in err and "field 'text'" in err and "row 1" in err and "UTF-8" in err
    assert not (tmp_path / "ds" / "manifest.json").exists()
    assert _run("pack", src, "-o", tmp_path / "ds", "-q", "--skip-bad") == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "skipped 1 bad records" in err
    assert f"{src}: row 1: field 'text': invalid UTF-8" in err
    ds = roxxel.open_dataset(tmp_path / "ds")
    assert [(int(r["id"]), r["text"]) for r in ds] == [(1, "ok"), (3, "x")]


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_issue14_a_null_skipped_with_skip_bad_is_named_with_its_field(tmp_path, capsys, kind):
    """Without --skip-bad a null said its field; the places --skip-bad listed did not."""
    table = pa.table({"x": pa.array([1, None, 3], pa.int32()), "y": [4, 5, 6]})
    path = write_table(table, tmp_path / f"n.{kind}")
    assert _run("pack", path, "-o", tmp_path / "ds", "-q", "--skip-bad") == 0
    assert f"{path}: row 1: field 'x': null" in capsys.readouterr().err


# ---- issue 14: schema inference hints that can be followed; nulls and ragged lists said so --


@pytest.mark.parametrize("name", ["my url", "a:b", "-x", "é", "a\nb", "x" * 129])
def test_issue14_a_field_name_no_schema_takes_points_to_map_not_field(tmp_path, capsys, name):
    """`--field my url:int64[]` (and `a:b:`, `-x:`, non-ASCII, a newline, which split the
    error into two lines) was the hint for a field whose name no schema takes; a clear
    field of such a name said `field 'my url': bad name` naming no file."""
    src = _jsonl(tmp_path / "n.jsonl", [{"x": 1, name: [1]}, {"x": 2, name: "s"}])
    assert _run("pack", src, "-o", tmp_path / "ds", "-q") == 1
    err = _one_line_error(capsys)
    assert f"{src}:1: schema inference: field {name!r}" in err, err
    assert "--map" in err and f"--field {name}:" not in err, err
    assert "[A-Za-z_][A-Za-z0-9_.-]*" in err, err
    clear = _jsonl(tmp_path / "c.jsonl", [{"x": 1}, {"x": 2, name: 3}])
    assert _run("pack", clear, "-o", tmp_path / "ds", "-q") == 1
    err = _one_line_error(capsys)
    assert f"{clear}:2: schema inference: field {name!r}" in err and "--map" in err, err


@pytest.mark.parametrize(
    ("rows", "line", "field", "what"),
    [
        ([{"a": 1, "b": 2}, {"a": 3}], 2, "b", "missing from some records"),
        ([{"a": 1, "b": 2}, {"a": "s", "b": 3}], 2, "a", "mixed kinds ['number', 'string']"),
        ([{"a": [1], "b": 2}, {"a": {"k": 1}, "b": 3}], 2, "a", "a dict value"),
    ],
)
def test_issue14_a_missing_or_mixed_field_points_to_map_and_its_field_hint_packs(
    tmp_path, capsys, rows, line, field, what
):
    """A field missing from some records, or of mixed kinds, asked only for `--field`,
    which then failed on the first record unlike it: the hint now says to fill or convert
    it with --map, or to skip those records (--skip-bad), and following it packs."""
    src = _jsonl(tmp_path / "m.jsonl", rows)
    assert _run("pack", src, "-o", tmp_path / "ds", "-q") == 1
    err = _one_line_error(capsys)
    assert f"{src}:{line}: schema inference: field {field!r}" in err and what in err, err
    assert "with --map" in err and "--skip-bad" in err, err
    flags = err.rstrip().rsplit("e.g. ", 1)[1].removesuffix(")").split()
    assert _run("pack", src, "-o", tmp_path / "ds", "-q", "--skip-bad", *flags) == 0
    assert len(roxxel.open_dataset(tmp_path / "ds")) == 1


@pytest.mark.parametrize("spec", ["int64", "int64[]", "float32[,2]", "str", "bytes"])
def test_issue14_a_null_into_a_given_field_says_null(tmp_path, capsys, spec):
    """`field 'b' got object values (expected int64)` (or `wants str (NoneType)`) for a
    JSON null: numpy's and Python's words for it."""
    src = _jsonl(tmp_path / "n.jsonl", [{"a": 1, "b": None}])
    assert (
        _run("pack", src, "-o", tmp_path / "ds", "--field", "a:int64", "--field", f"b:{spec}") == 1
    )
    err = _one_line_error(capsys)
    assert f"{src}:1: field 'b'" in err and "null" in err, err
    assert "object" not in err and "NoneType" not in err, err


@pytest.mark.parametrize("spec", [None, "int64[]", "int64[,2]", "float32[,2]"])
def test_issue14_ragged_nested_lists_name_file_line_field_and_the_rule(tmp_path, capsys, spec):
    """`[[1, 2], [3]]` said numpy's `setting an array element with a sequence. The requested
    array has an inhomogeneous shape after 1 dimensions...`; inference said only "ragged
    nested lists" and asked for a `--field a:SPEC` that no spec satisfies."""
    first = [1] if spec == "int64[]" else [[1, 2]]  # a record that fits: line 2 is named
    src = _jsonl(tmp_path / "r.jsonl", [{"a": first}, {"a": [[1, 2], [3]]}])
    flags = ["--field", f"a:{spec}"] if spec else []
    assert _run("pack", src, "-o", tmp_path / "ds", *flags) == 1
    err = _one_line_error(capsys)
    assert f"{src}:2: " in err and "field 'a'" in err and "ragged" in err, err
    assert "only a field's first dimension" in err, err
    assert "sequence" not in err and "inhomogeneous" not in err, err
    if spec is None:
        assert "--map" in err, err


def test_issue14_ragged_values_given_to_a_field_are_a_config_error_not_numpy_text():
    from roxxel.format.schema import Field

    for spec in ("int32[,2]", "int32[2,2]"):
        with pytest.raises(ConfigError) as e:
            Field.parse("a", spec).to_bytes(([1, 2], [3]), "rec 0")
        assert "rec 0: field 'a'" in str(e.value) and "ragged" in str(e.value), e.value
        assert "inhomogeneous" not in str(e.value)


def _byte_ranks(path: Path) -> Path:
    path.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    return path


@pytest.mark.parametrize("how", ["field", "schema"])
def test_issue14_an_eos_id_past_the_token_dtype_shows_the_fix_in_the_form_used(
    tmp_path, capsys, how
):
    """With the token dtype from --schema, the refusal's example was `--field` syntax
    (`e.g. tokens:uint16[]`); it is now the schema file's entry (`tokens = "uint16[]"`),
    and with --field a whole `--field tokens:uint16[]`."""
    pytest.importorskip("tiktoken")
    ranks = _byte_ranks(tmp_path / "bytes.tiktoken")
    src = _jsonl(tmp_path / "t.jsonl", [{"text": "ab"}])
    schema = tmp_path / "s.toml"
    schema.write_text('[fields]\ntokens = "uint8[]"\n')
    given = ["--field", "tokens:uint8[]"] if how == "field" else ["--schema", schema]
    argv = ["pack", src, "-o", tmp_path / "ds", "--tokenizer", ranks, "--eos-id", 300, *given]
    assert _run(*argv) in (1, 2)
    err = _one_line_error(capsys)
    assert "--eos-id 300 does not fit uint8" in err, err
    if how == "field":
        assert "--field tokens:uint8[]: " in err and "e.g. --field tokens:uint16[])" in err, err
    else:
        assert f'{schema}: tokens = "uint8[]": ' in err, err
        assert 'e.g. tokens = "uint16[]")' in err and "--field" not in err, err


# ---- issue 14: inference refusals name the file and line, and give a usable example ----


def _nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("depth", [9, 32, 64, 65, 200])
@pytest.mark.parametrize("line", [1, 2])
def test_issue14_lists_nested_past_the_rank_limit_name_the_line_and_depth(
    tmp_path, capsys, depth, line
):
    """`{"a": [[[...1...]]]}` nested 9..64 deep said `field 'a': rank 32 (expected at most
    8)`, no file or line; 65 deep and more (past numpy's 64 dimensions) `holds ragged nested
    lists`, which they are not."""
    rows = [{"a": _nested(depth)}] if line == 1 else [{"a": [1]}, {"a": _nested(depth)}]
    src = _jsonl(tmp_path / "deep.jsonl", rows)
    assert _run("pack", src, "-o", tmp_path / "ds", "-q") == 1
    err = _one_line_error(capsys)
    assert err.startswith(f"roxxel pack: error: {src}:{line}: schema inference: field 'a' "), err
    assert f"nested {depth} deep (expected at most 8 dimensions" in err, err
    assert "--map" in err and "ragged" not in err and "rank" not in err, err


def test_issue14_lists_nested_8_deep_are_still_inferred(tmp_path):
    src = _jsonl(tmp_path / "deep.jsonl", [{"a": _nested(8)}])
    assert _run("pack", src, "-o", tmp_path / "ds", "-q") == 0
    assert roxxel.open_dataset(tmp_path / "ds").schema["a"].spec == "int64[,1,1,1,1,1,1,1]"


@pytest.mark.parametrize("value", [[[]], [[], []], [[[]]]])
def test_issue14_only_empty_inner_lists_give_an_example_the_parser_takes(tmp_path, capsys, value):
    """`{"a": [[]]}` said `only empty lists ..., e.g. --field a:int64[,0]`, an example the
    parser then refused (`bad dimension '0' in [,0] (expected 1..2**32)`)."""
    src = _jsonl(tmp_path / "e.jsonl", [{"a": value, "b": 1}])
    assert _run("pack", src, "-o", tmp_path / "ds", "-q") == 1
    err = _one_line_error(capsys)
    assert err.startswith(f"roxxel pack: error: {src}:1: schema inference: field 'a' "), err
    assert "[,0" not in err and ",0]" not in err, err
    assert "empty inner lists" in err and "1..2**32" in err, err
    assert "--field a:int64[," in err and "N]" in err and "--field b:int64" in err, err


def test_issue14_an_empty_inner_list_beside_a_full_one_gives_the_full_ones_example(
    tmp_path, capsys
):
    src = _jsonl(tmp_path / "e.jsonl", [{"a": [[]]}, {"a": [[1, 2]]}])
    assert _run("pack", src, "-o", tmp_path / "ds", "-q") == 1
    err = _one_line_error(capsys)
    assert "e.g. --field a:int64[,2])" in err and "[,0]" not in err, err
    assert (
        _run("pack", src, "-o", tmp_path / "ds", "--field", "a:int64[,2]", "--skip-bad", "-q") == 0
    )


@pytest.mark.parametrize("rows", [[{}], [{}, {}], [{}, {"a": 1}]])
def test_issue14_a_record_with_no_fields_names_its_line(tmp_path, capsys, rows):
    """A JSONL file whose only line is `{}` said `schema: expected a non-empty mapping of
    name -> spec ({})`, no file or line."""
    src = _jsonl(tmp_path / "z.jsonl", rows)
    assert _run("pack", src, "-o", tmp_path / "ds", "-q") == 1
    err = _one_line_error(capsys)
    assert err.startswith(f"roxxel pack: error: {src}:1: schema inference: "), err
    assert "the record has no fields" in err and "non-empty mapping" not in err, err


def test_issue14_lists_nested_past_numpys_limit_under_a_given_field_say_how_deep(tmp_path, capsys):
    """With `--field a:int64[]`, a record nested 65+ deep said `holds ragged nested lists`."""
    src = _jsonl(tmp_path / "deep.jsonl", [{"a": [1]}, {"a": _nested(70)}])
    assert _run("pack", src, "-o", tmp_path / "ds", "--field", "a:int64[]", "-q") == 1
    err = _one_line_error(capsys)
    assert f"{src}:2: field 'a' holds lists nested 70 deep (expected int64[]" in err, err
    assert "ragged" not in err, err


def test_issue14_a_line_past_the_cap_is_refused_not_read_whole(tmp_path):
    """A sparse (all-NUL) 4 GiB .jsonl is one 4 GiB line: it was read whole, a giant
    allocation (a MemoryError traceback under a 2 GiB address-space limit, a red-team
    find). A line is read up to `text.MAX_LINE_BYTES` and refused past it, in one line."""
    src = tmp_path / "zeros.jsonl"
    with open(src, "wb") as f:
        f.truncate(4 << 30)
    script = (
        "import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30));"
        " from roxxel.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    argv = ["pack", str(src), "-o", str(tmp_path / "out"), "--field", "a:int64", "-q"]
    run = subprocess.run(
        [sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 1 and len(run.stderr.splitlines()) == 1, run.stderr[-2000:]
    assert f"zeros.jsonl: offset 0: a line longer than {text.MAX_LINE_BYTES} bytes" in run.stderr
