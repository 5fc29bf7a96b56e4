"""The block path of `roxxel pack` for array inputs (.npy, Megatron): whole columns per call,
the same bytes as packing record by record, and the same errors."""

from __future__ import annotations

import struct

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import roxxel
from roxxel.cli import main
from roxxel.errors import ConfigError
from roxxel.ingest import megatron as ingest_megatron
from roxxel.ingest import npy as ingest_numpy
from roxxel.ingest.megatron import MAGIC
from roxxel.ingest.units import Block, Piece, RangeReader
from tests.test_ingest import write_megatron


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Blocks of 1000 bytes, so a few KB of input give many blocks and shard cuts inside them."""
    monkeypatch.setattr(ingest_numpy, "BLOCK_BYTES", 1000)
    monkeypatch.setattr(ingest_megatron, "BLOCK_BYTES", 1000)


def _identity_map(tmp_path):
    """A --map that returns its record: it turns the block path off, nothing else."""
    path = tmp_path / "same.py"
    path.write_text("def fn(record):\n    return record\n")
    return f"{path}:fn"


def _pack(src, out, *extra):
    return main(["pack", str(src), "-o", str(out), "--quiet", *map(str, extra)])


def _files(root):
    return {p.name: p.read_bytes() for p in sorted(root.glob("*.rxs"))}


@pytest.mark.parametrize("shard_bytes", ["700", "5000", "1M"])
@pytest.mark.parametrize("fortran", [False, True])
def test_npy_blocks_write_the_bytes_of_the_record_path(tmp_path, shard_bytes, fortran):
    rows = np.random.default_rng(0).integers(0, 255, (300, 3, 5), dtype=np.uint8)
    src = tmp_path / "img.npy"
    np.save(src, np.asfortranarray(rows) if fortran else rows)
    args = ("--input-field", "image", "--shard-bytes", shard_bytes, "--unit-bytes", "2K")
    assert _pack(src, tmp_path / "blocks", *args) == 0
    assert _pack(src, tmp_path / "records", *args, "--map", _identity_map(tmp_path)) == 0
    blocks = _files(tmp_path / "blocks")
    assert blocks == _files(tmp_path / "records") and len(blocks) > 1
    got = roxxel.open_dataset(tmp_path / "blocks")
    assert len(got) == 300
    assert np.array_equal(got.get_batch(np.arange(300))["image"], rows)


@pytest.mark.parametrize("shard_bytes", ["300", "4K", "1M"])
@pytest.mark.parametrize("contiguous", [True, False])
def test_megatron_blocks_write_the_bytes_of_the_record_path(tmp_path, shard_bytes, contiguous):
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 50000, rng.integers(0, 90)).tolist() for _ in range(200)]
    seqs[5] = list(range(700))  # longer than a block on its own
    src = write_megatron(tmp_path / "c", seqs)
    if not contiguous:  # the same sequences, stored in reverse order in .bin
        _reverse_storage(tmp_path / "c", seqs)
    args = ("--field", "tokens:int32[]", "--shard-bytes", shard_bytes, "--unit-bytes", "3K")
    assert _pack(src, tmp_path / "blocks", *args) == 0
    assert _pack(src, tmp_path / "records", *args, "--map", _identity_map(tmp_path)) == 0
    blocks = _files(tmp_path / "blocks")
    assert blocks == _files(tmp_path / "records") and len(blocks) > 1
    got = roxxel.open_dataset(tmp_path / "blocks")
    assert [got[i]["tokens"].tolist() for i in range(len(got))] == seqs


def _reverse_storage(prefix, seqs):
    lengths = np.array([len(s) for s in seqs], "<i4")
    data = [np.asarray(s, "<i4").tobytes() for s in seqs]
    pointers, at = np.zeros(len(seqs), "<i8"), 0
    for i in reversed(range(len(seqs))):
        pointers[i] = at
        at += len(data[i])
    (prefix.parent / f"{prefix.name}.bin").write_bytes(b"".join(reversed(data)))
    docs = np.arange(len(seqs) + 1, dtype="<i8")
    with open(f"{prefix}.idx", "wb") as f:
        f.write(struct.pack("<9sQBQQ", MAGIC, 1, 4, len(seqs), len(docs)))
        f.write(lengths.tobytes() + pointers.tobytes() + docs.tobytes())


def test_a_value_that_does_not_fit_names_its_row_and_can_be_skipped(tmp_path, capsys):
    values = np.arange(400, dtype=np.int64).reshape(200, 2)
    values[150, 1] = 70000
    src = tmp_path / "v.npy"
    np.save(src, values)
    args = ("--field", "data:uint16[2]")
    assert _pack(src, tmp_path / "out", *args) == 1
    err = capsys.readouterr().err
    assert f"{src}: row 150" in err and "70000" in err
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert _pack(src, tmp_path / "skip", *args, "--skip-bad") == 0
    assert "skipped 1 bad records" in capsys.readouterr().err
    got = roxxel.open_dataset(tmp_path / "skip").get_batch(np.arange(199))["data"]
    assert np.array_equal(got, np.delete(values, 150, axis=0))


def test_a_schema_other_than_the_arrays_fields_gets_the_record_path_errors(tmp_path, capsys):
    src = tmp_path / "v.npy"
    np.save(src, np.zeros((10, 4), np.float32))
    assert _pack(src, tmp_path / "a", "--field", "data:float32[4]", "--field", "id:int64") == 1
    assert f"{src}: row 0" in capsys.readouterr().err
    assert _pack(src, tmp_path / "b", "--field", "data:float32[5]") == 1
    assert f"{src}: row 0" in capsys.readouterr().err


def test_block_take_and_records_split_variable_columns():
    piece = Piece("x.bin", "megatron", 10, 14, 0)
    block = Block(piece, 10, 4, {"t": np.arange(6)}, {"t": np.array([2, 0, 3, 1])})
    assert block.num == 4
    assert [(r["t"].tolist(), k) for r, k in block.records()] == [
        ([0, 1], 10),
        ([], 11),
        ([2, 3, 4], 12),
        ([5], 13),
    ]
    part = block.take(1, 3)
    assert part.first == 11 and part.columns["t"].tolist() == [2, 3, 4]
    assert part.lengths["t"].tolist() == [0, 3]


def test_range_reader_refuses_a_file_that_got_shorter(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(100)))
    with RangeReader(str(path)) as reader:
        assert reader.read(10, np.dtype(np.uint8), (2, 3)).tolist() == [[10, 11, 12], [13, 14, 15]]
        with pytest.raises(ConfigError, match=r"f\.bin: offset 100: file ends"):
            reader.read(96, np.dtype("<i4"), (2,))


# ---- Arrow family: one block per record batch --------------------------------------------


def _token_table(n=300):
    rng = np.random.default_rng(2)
    tokens = [rng.integers(0, 50000, rng.integers(0, 60)).tolist() for _ in range(n)]
    return pa.table(
        {
            "input_ids": pa.array(tokens, pa.large_list(pa.int32())),
            "text": [f"doc {i}" for i in range(n)],
            "label": pa.array(range(n), pa.int64()),
            "patch": pa.array([[i, -i] for i in range(n)], pa.list_(pa.int16(), 2)),
        }
    )


def _write_arrow_inputs(tmp_path, table):
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=70)
    with pa.ipc.new_file(str(tmp_path / "f.arrow"), table.schema) as w:
        for batch in table.to_batches(max_chunksize=50):
            w.write_batch(batch)
    with pa.ipc.new_stream(str(tmp_path / "s.arrow"), table.schema) as w:
        w.write_table(table.slice(7))  # a sliced table: list offsets start past 0
    return ["t.parquet", "f.arrow", "s.arrow"]


SCHEMAS = {
    "arrays": ("--field", "input_ids:int32[]", "--field", "label:int64"),
    "fixed": ("--field", "patch:int16[2]", "--field", "input_ids:int64[]"),
    "with a string": ("--field", "input_ids:int32[]", "--field", "text:str"),
}


@pytest.mark.parametrize("schema", sorted(SCHEMAS))
def test_arrow_blocks_write_the_bytes_of_the_record_path(tmp_path, schema):
    table = _token_table()
    for name in _write_arrow_inputs(tmp_path, table):
        src = tmp_path / name
        args = (*SCHEMAS[schema], "--shard-bytes", "3000", "--unit-bytes", "2K")
        assert _pack(src, tmp_path / f"{name}-blocks", *args) == 0
        ident = ("--map", _identity_map(tmp_path))
        assert _pack(src, tmp_path / f"{name}-records", *args, *ident) == 0
        blocks = _files(tmp_path / f"{name}-blocks")
        assert blocks == _files(tmp_path / f"{name}-records") and len(blocks) > 1, name
        got = roxxel.open_dataset(tmp_path / f"{name}-blocks")
        skip = 7 if name == "s.arrow" else 0
        want = table.column("input_ids").to_pylist()[skip:]
        assert [got[i]["input_ids"].tolist() for i in range(len(got))] == want, name


def test_arrow_block_errors_name_the_row(tmp_path, capsys):
    tokens = [[1, 2], [3, 70000], [4]]
    pq.write_table(pa.table({"t": pa.array(tokens, pa.list_(pa.int64()))}), tmp_path / "a.parquet")
    assert _pack(tmp_path / "a.parquet", tmp_path / "out", "--field", "t:uint16[]") == 1
    err = capsys.readouterr().err
    assert "a.parquet: row 1" in err and "70000" in err
    nulls = pa.table({"t": pa.array([[1], None, [2]], pa.list_(pa.int64()))})
    pq.write_table(nulls, tmp_path / "n.parquet")
    assert _pack(tmp_path / "n.parquet", tmp_path / "out2", "--field", "t:int64[]") == 1
    assert "row 1: field 't': null" in capsys.readouterr().err


def test_a_sliced_list_column_gives_only_its_own_values():
    from roxxel.ingest.arrow import _batch_block

    lists = pa.array([[1, 2], [3], [4, 5, 6]], pa.list_(pa.int32()))
    batch = pa.record_batch({"t": lists, "s": ["a", "b", "c"]}).slice(1)
    block = _batch_block(pa, batch, Piece("x.arrow", "arrow", 0, 1, 0), 1)
    assert block.columns["t"].tolist() == [3, 4, 5, 6] and block.lengths["t"].tolist() == [1, 3]
    assert block.columns["s"] == ["b", "c"]
    assert [(r["t"].tolist(), k) for r, k in block.records()] == [([3], 1), ([4, 5, 6], 2)]
