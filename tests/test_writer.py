"""Writers: round trips, value checks, determinism, atomicity under failure and SIGKILL."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import roxxel
from roxxel import ConfigError, FormatError
from roxxel.format.schema import NUMERIC_DTYPES

ROOT = Path(__file__).resolve().parent.parent


def _dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


@st.composite
def field_specs(draw):
    kind = draw(st.sampled_from(["scalar", "fixed", "variable", "inner", "bytes", "str"]))
    if kind in ("bytes", "str"):
        return kind
    dtype = draw(st.sampled_from(NUMERIC_DTYPES))
    dims = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    return {
        "scalar": dtype,
        "fixed": f"{dtype}[{','.join(map(str, dims))}]",
        "variable": f"{dtype}[]",
        "inner": f"{dtype}[,{','.join(map(str, dims))}]",
    }[kind]


def value_for(field: roxxel.Field, rng: np.random.Generator, length: int):
    if field.kind == "str":
        return "".join(chr(c) for c in rng.integers(32, 0x2FFF, length))
    if field.kind == "bytes":
        return rng.bytes(length)
    shape = (length, *field.inner_shape) if field.is_variable else field.shape
    raw = rng.integers(0, 256, int(np.prod(shape)) * field.dtype.itemsize, dtype=np.uint8)
    values = raw.view(field.dtype).reshape(shape)
    return np.where(np.isnan(values), 0, values) if field.dtype.kind == "f" else values


def _stored(value: object) -> np.ndarray:
    """The value as a shard stores it: a bool's nonzero bytes become 1 (R18)."""
    array = np.asarray(value)
    return array.view(np.uint8) != 0 if array.dtype == np.bool_ else array


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    specs=st.dictionaries(st.sampled_from(list("abcdefg")), field_specs(), min_size=1, max_size=4),
    num=st.integers(0, 6),
    seed=st.integers(0, 2**32 - 1),
    zstd=st.booleans(),
    big=st.booleans(),
)
def test_round_trip_random_schemas_and_records(tmp_path, specs, num, seed, zstd, big) -> None:
    schema = roxxel.Schema.parse(specs)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, (1 << 20) // 64 if big else 9, (num, len(schema)))
    records = [
        {f.name: value_for(f, rng, int(n)) for f, n in zip(schema, row, strict=True)}
        for row in lengths
    ]
    compress = {f.name: "zstd:1" for f in schema if zstd and rng.random() < 0.7}
    path = tmp_path / "rt.rxs"
    roxxel.write_shard(path, records, schema, compress=compress)
    shard = roxxel.open_shard(path)
    assert len(shard) == num and shard.verify() == []
    for i, record in enumerate(records):
        got = shard[i]
        for f in schema:
            if f.kind == "str":
                assert got[f.name] == record[f.name]
            elif f.kind == "bytes":
                assert bytes(got[f.name]) == record[f.name]
            else:
                assert got[f.name].dtype == _dtype(f.dtype.name) or f.dtype.name == "bfloat16"
                assert got[f.name].tobytes() == _stored(record[f.name]).tobytes()
    batch = shard.get_batch(np.arange(num)[::-1])
    for f in schema:
        if not f.is_variable:
            expected = (
                np.stack([_stored(np.asarray(r[f.name], f.dtype)) for r in records[::-1]])
                if num
                else None
            )
            if num:
                assert batch[f.name].tobytes() == expected.tobytes()


RECORD = {"tokens": [1, 2], "image": np.zeros((2, 2), np.uint8), "label": 3, "text": "x"}
SCHEMA = {"tokens": "uint16[]", "image": "uint8[2,2]", "label": "int64", "text": "str"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tokens": [70000]}, "value 70000 does not fit uint16"),
        ({"tokens": [-1]}, "value -1 does not fit uint16"),
        ({"label": 0.5}, "got float64 values"),
        ({"label": 2**64 - 1}, "does not fit int64"),
        ({"image": np.zeros((2, 3), np.uint8)}, r"shape \(2, 3\)"),
        ({"text": b"x"}, "wants str"),
        ({"tokens": ["a"]}, "got string values"),
    ],
)
def test_write_rejects_values_that_would_change(tmp_path, change, message) -> None:
    with roxxel.ShardWriter(tmp_path / "s.rxs", SCHEMA) as writer:
        writer.write(RECORD)
        with pytest.raises(ConfigError, match=message) as info:
            writer.write({**RECORD, **change})
        assert "record 1" in str(info.value) and str(tmp_path / "s.rxs") in str(info.value)
        writer.write(RECORD)
    assert len(roxxel.open_shard(tmp_path / "s.rxs")) == 2


def test_write_rejects_missing_and_unknown_fields(tmp_path) -> None:
    with roxxel.ShardWriter(tmp_path / "s.rxs", SCHEMA) as writer:
        with pytest.raises(
            ConfigError, match=r"missing fields \['label'\], unknown fields \['lbl'\]"
        ):
            writer.write({"tokens": [1], "image": RECORD["image"], "lbl": 1, "text": ""})
        with pytest.raises(ConfigError, match="expected a dict"):
            writer.write([1, 2])  # type: ignore[arg-type]


def test_write_accepts_exact_conversions(tmp_path) -> None:
    schema = {"a": "uint8", "b": "float32[2]", "c": "int32[]", "d": "bool"}
    roxxel.write_shard(
        tmp_path / "s.rxs", [{"a": np.int64(255), "b": [0.1, 2], "c": [], "d": 1}], schema
    )
    record = roxxel.open_shard(tmp_path / "s.rxs")[0]
    assert record["a"] == 255 and record["b"].dtype == np.float32 and record["c"].size == 0


def test_same_records_give_identical_bytes(tmp_path) -> None:
    for name in ("a.rxs", "b.rxs"):
        roxxel.write_shard(tmp_path / name, [RECORD] * 5, SCHEMA, compress={"text": "zstd:3"})
    assert (tmp_path / "a.rxs").read_bytes() == (tmp_path / "b.rxs").read_bytes()


def test_an_exception_inside_the_writer_leaves_no_file_and_no_temp(tmp_path) -> None:
    with pytest.raises(RuntimeError), roxxel.ShardWriter(tmp_path / "s.rxs", SCHEMA) as writer:
        writer.write(RECORD)
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_rewrite_leaves_the_old_shard_intact(tmp_path) -> None:
    path = tmp_path / "s.rxs"
    roxxel.write_shard(path, [RECORD], SCHEMA)
    before = path.read_bytes()
    with pytest.raises(RuntimeError), roxxel.ShardWriter(path, SCHEMA) as writer:
        writer.write({**RECORD, "label": 9})
        raise RuntimeError("interrupted")
    assert path.read_bytes() == before and sorted(tmp_path.iterdir()) == [path]


def test_a_full_disk_raises_removes_the_temp_and_keeps_the_old_shard(tmp_path) -> None:
    path = tmp_path / "s.rxs"
    roxxel.write_shard(path, [RECORD], SCHEMA)
    before = path.read_bytes()
    script = f"""
        import resource, signal, sys, numpy as np, roxxel
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.RLIM_INFINITY))
        big = np.zeros(1 << 14, np.uint16)
        try:
            roxxel.write_shard({str(path)!r}, [{{**{RECORD_SRC}, "tokens": big}}] * 20, {SCHEMA!r})
        except OSError as exc:
            print("OSError", exc.errno)
        """
    result = _python(script)
    assert "OSError 27" in result.stdout, result.stderr  # EFBIG, as a full disk's ENOSPC
    assert path.read_bytes() == before and sorted(tmp_path.iterdir()) == [path]


RECORD_SRC = '{"image": np.zeros((2, 2), np.uint8), "label": 3, "text": "x"}'


def _python(script: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
        **kwargs,
    )


KILL_SCRIPT = """
    import sys, numpy as np, roxxel
    out = sys.argv[1]
    schema = {"tokens": "int32[]", "label": "int64"}
    with roxxel.DatasetWriter(out, schema, shard_bytes=1 << 16, overwrite=True) as w:
        for i in range(100000):
            w.write({"tokens": np.arange(i % 500, dtype=np.int32), "label": i})
            if i % 50 == 0:
                print(i, flush=True)
"""


@pytest.mark.parametrize("lines", [1, 7, 40, 200])
def test_sigkill_mid_write_leaves_nothing_that_opens_as_valid(tmp_path, lines) -> None:
    out = tmp_path / "ds"
    with roxxel.DatasetWriter(out, {"tokens": "int32[]", "label": "int64"}) as w:
        w.write({"tokens": [7], "label": -1})
    old_shard = (out / "shard-00000.rxs").read_bytes()
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(KILL_SCRIPT), str(out)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert child.stdout is not None
    for _ in range(lines):
        child.stdout.readline()
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=60)
    assert not (out / "manifest.json").exists()  # removed by overwrite, never rewritten
    with pytest.raises(FormatError, match="no manifest"):
        roxxel.open_dataset(out)
    for path in out.iterdir():
        if path.name.endswith(".tmp"):
            with pytest.raises(FormatError):
                roxxel.open_shard(path)
        else:
            shard = roxxel.open_shard(path)  # a finished shard is complete and intact
            assert shard.verify() == []
            if path.name == "shard-00000.rxs" and path.read_bytes() != old_shard:
                assert len(shard) > 1


def test_rewriting_a_mapped_shard_leaves_the_reader_bytes_intact(tmp_path) -> None:
    path = tmp_path / "s.rxs"
    roxxel.write_shard(path, [{**RECORD, "label": 1}], SCHEMA)
    shard = roxxel.open_shard(path)
    view = shard[0]["image"]
    label = shard[0]["label"]
    roxxel.write_shard(path, [{**RECORD, "label": 2, "image": np.ones((2, 2), np.uint8)}], SCHEMA)
    assert int(label) == 1 and view.sum() == 0 and shard.verify() == []
    assert int(roxxel.open_shard(path)[0]["label"]) == 2


def test_dataset_writer_rolls_over_and_writes_the_manifest_last(tmp_path) -> None:
    out = tmp_path / "ds"
    with roxxel.DatasetWriter(out, {"tokens": "int32[]"}, shard_bytes=100) as writer:
        for i in range(10):
            writer.write({"tokens": np.arange(10, dtype=np.int32) + i})
            assert not (out / "manifest.json").exists()
    ds = roxxel.open_dataset(out)
    assert ds.num_shards == 4 and len(ds) == 10
    assert [int(ds[i]["tokens"][0]) for i in range(10)] == list(range(10))


def test_dataset_writer_refuses_an_existing_dataset_unless_overwrite(tmp_path) -> None:
    roxxel.write_shard(tmp_path / "x.rxs", [], {"a": "int8"})
    with roxxel.DatasetWriter(tmp_path, {"a": "int8"}) as writer:
        writer.write({"a": 1})
    with pytest.raises(ConfigError, match="already holds a dataset"):
        roxxel.DatasetWriter(tmp_path, {"a": "int8"})
    with roxxel.DatasetWriter(tmp_path, {"a": "int8"}, overwrite=True) as writer:
        writer.write({"a": 2})
        writer.write({"a": 3})
    assert len(roxxel.open_dataset(tmp_path)) == 2


def test_dataset_writer_error_writes_no_manifest(tmp_path) -> None:
    with pytest.raises(ConfigError), roxxel.DatasetWriter(tmp_path / "d", {"a": "int8"}) as writer:
        writer.write({"a": 1})
        writer.write({"a": 1000})
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"compress": {"zz": "zstd"}}, "unknown field 'zz'"),
        ({"compress": {"a": "lz4"}}, "unknown codec"),
        ({"compress": {"a": "zstd:99"}}, "unknown codec"),
        ({"shard_bytes": 0}, "shard_bytes"),
        ({"metadata": {"x": object()}}, "not JSON"),
    ],
)
def test_dataset_writer_rejects_bad_options(tmp_path, kwargs, message) -> None:
    with pytest.raises(ConfigError, match=message):
        roxxel.DatasetWriter(tmp_path, {"a": "int8"}, **kwargs)


@pytest.mark.parametrize(
    "spec",
    [
        "int128",
        "int32[0]",
        "int32[,]",
        "object",
        "str[]",
        "int32[2][3]",
        "float32[" + ",2" * 9 + "]",
    ],
)
def test_schema_rejects_specs_off_the_allow_list(spec) -> None:
    with pytest.raises(ConfigError, match="field 'x'"):
        roxxel.Schema.parse({"x": spec})


def test_files_get_ordinary_permissions(tmp_path) -> None:
    old = os.umask(0o022)
    try:
        roxxel.write_shard(tmp_path / "s.rxs", [], {"a": "int8"})
    finally:
        os.umask(old)
    assert (tmp_path / "s.rxs").stat().st_mode & 0o777 == 0o644


def test_write_batch_equals_writing_record_by_record(tmp_path) -> None:
    schema = {"image": "uint8[2,2]", "label": "int64", "tokens": "int32[]", "text": "str"}
    records = [
        {
            "image": np.full((2, 2), i, np.uint8),
            "label": i,
            "tokens": np.arange(i, dtype=np.int32),
            "text": "t" * i,
        }
        for i in range(7)
    ]
    roxxel.write_shard(tmp_path / "one.rxs", records, schema, compress={"text": "zstd:2"})
    with roxxel.ShardWriter(tmp_path / "many.rxs", schema, compress={"text": "zstd:2"}) as writer:
        for part in (records[:3], records[3:3], records[3:]):
            writer.write_batch(
                {
                    "image": np.stack([r["image"] for r in part])
                    if part
                    else np.zeros((0, 2, 2), np.uint8),
                    "label": [r["label"] for r in part],
                    "tokens": [r["tokens"] for r in part],
                    "text": [r["text"] for r in part],
                }
            )
    assert (tmp_path / "one.rxs").read_bytes() == (tmp_path / "many.rxs").read_bytes()


def test_write_batch_checks_everything_before_writing(tmp_path) -> None:
    schema = {"image": "uint8[2]", "tokens": "uint16[]"}
    with roxxel.ShardWriter(tmp_path / "s.rxs", schema) as writer:
        with pytest.raises(ConfigError, match="does not fit uint16"):
            writer.write_batch({"image": np.zeros((2, 2), np.uint8), "tokens": [[1], [70000]]})
        with pytest.raises(ConfigError, match="batch of shape"):
            writer.write_batch({"image": np.zeros((2, 3), np.uint8), "tokens": [[1], [2]]})
        with pytest.raises(ConfigError, match="differ in length"):
            writer.write_batch({"image": np.zeros((2, 2), np.uint8), "tokens": [[1]]})
        assert writer.num_records == 0
    assert len(roxxel.open_shard(tmp_path / "s.rxs")) == 0


def test_dataset_writer_write_batch_rolls_over_between_batches(tmp_path) -> None:
    with roxxel.DatasetWriter(tmp_path / "d", {"x": "int64"}, shard_bytes=80) as writer:
        for start in range(0, 40, 10):
            writer.write_batch({"x": np.arange(start, start + 10)})
    ds = roxxel.open_dataset(tmp_path / "d")
    assert ds.num_shards == 4 and ds.get_batch(np.arange(40))["x"].tolist() == list(range(40))


def test_write_batch_of_ragged_values_equals_record_by_record(tmp_path) -> None:
    schema = {"tokens": "int32[]", "pairs": "float32[,2]", "label": "int64"}
    lengths = [3, 0, 5, 1]
    tokens = np.arange(sum(lengths), dtype=np.int32)
    pairs = np.arange(2 * sum(lengths), dtype=np.float32).reshape(-1, 2)
    cuts = np.cumsum([0, *lengths])
    records = [
        {"tokens": tokens[a:b], "pairs": pairs[a:b], "label": i}
        for i, (a, b) in enumerate(itertools.pairwise(cuts))
    ]
    for compress in (None, {"tokens": "zstd:1"}):
        roxxel.write_shard(tmp_path / "one.rxs", records, schema, compress=compress)
        with roxxel.ShardWriter(tmp_path / "ragged.rxs", schema, compress=compress) as writer:
            writer.write_batch(
                {
                    "tokens": roxxel.Ragged(tokens.astype(np.int64), np.array(lengths)),
                    "pairs": roxxel.Ragged(pairs, np.array(lengths)),
                    "label": np.arange(4),
                }
            )
        assert (tmp_path / "one.rxs").read_bytes() == (tmp_path / "ragged.rxs").read_bytes()


@pytest.mark.parametrize(
    ("lengths", "values", "message"),
    [
        ([2, 2], np.arange(3), "summing"),
        ([2, -1, 2], np.arange(3), "summing"),
        ([1, 1], np.array([1, 70000]), "does not fit uint16"),
        ([1.0, 1.0], np.arange(2), "summing"),
    ],
)
def test_write_batch_rejects_bad_ragged_values(tmp_path, lengths, values, message) -> None:
    with roxxel.ShardWriter(tmp_path / "s.rxs", {"t": "uint16[]", "b": "bytes"}) as writer:
        with pytest.raises(ConfigError, match=message):
            n = len(lengths)
            writer.write_batch({"t": roxxel.Ragged(values, np.array(lengths)), "b": [b""] * n})
        with pytest.raises(ConfigError, match="takes Ragged values"):
            writer.write_batch(
                {"t": [[1]], "b": roxxel.Ragged(np.zeros(1, np.uint8), np.array([1]))}
            )
        assert writer.num_records == 0
