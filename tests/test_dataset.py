"""Datasets: manifest rules M1-M9, global indexing, batched reads, verify, many readers."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

import roxxel
from roxxel import ConfigError, FormatError

SCHEMA = {"tokens": "int32[]", "image": "uint8[2,3]", "label": "int64", "text": "str"}


def record(i: int) -> dict:
    return {
        "tokens": np.arange(i % 5, dtype=np.int32) + i,
        "image": np.full((2, 3), i % 256, np.uint8),
        "label": i,
        "text": f"doc {i}",
    }


@pytest.fixture
def dataset_dir(tmp_path: Path) -> Path:
    out = tmp_path / "ds"
    with roxxel.DatasetWriter(out, SCHEMA, shard_bytes=200, metadata={"source": "test"}) as w:
        for i in range(40):
            w.write(record(i))
    return out


def test_global_indices_cross_shards(dataset_dir) -> None:
    ds = roxxel.open_dataset(dataset_dir)
    assert ds.num_shards > 3 and len(ds) == 40 and ds.metadata == {"source": "test"}
    for i in [0, 1, 17, 39, -1, -40]:
        got = ds[i]
        want = record(i % 40)
        assert int(got["label"]) == want["label"] and got["text"] == want["text"]
        np.testing.assert_array_equal(got["tokens"], want["tokens"])
    for bad in (40, -41):
        with pytest.raises(IndexError):
            ds[bad]


def test_get_batch_matches_records_and_reuses_buffers(dataset_dir) -> None:
    ds = roxxel.open_dataset(dataset_dir)
    indices = np.array([39, 0, 5, 5, 22, -2])
    out = ds.batch_buffers(len(indices), max_len={"tokens": 8, "text": 16})
    held = {k: v for k, v in out.items()}
    batch = ds.get_batch(indices, out=out)
    assert all(batch[k] is held[k] for k in held)
    for row, i in enumerate(indices):
        want = record(int(i) % 40)
        n = len(want["tokens"])
        assert batch["tokens.length"][row] == n
        np.testing.assert_array_equal(batch["tokens"][row, :n], want["tokens"])
        assert not batch["tokens"][row, n:].any()
        np.testing.assert_array_equal(batch["image"][row], want["image"])
        assert batch["label"][row] == want["label"]
        text = bytes(batch["text"][row, : batch["text.length"][row]]).decode()
        assert text == want["text"]


def test_get_batch_gathers_small_and_large_fields_alike(tmp_path) -> None:
    """A field of 4 KiB rows and one of 8 bytes gather the records, across shards, in the
    order asked, repeats included, into new arrays or the buffers given."""
    rng = np.random.default_rng(0)
    row = 4096
    big = rng.integers(0, 255, (64, row), dtype=np.uint8)
    small = np.arange(64, dtype=np.int64) * 3
    schema = roxxel.Schema.parse({"big": f"uint8[{row}]", "small": "int64"})
    with roxxel.DatasetWriter(tmp_path / "ds", schema, shard_bytes=10 * row) as w:
        for start in range(0, 64, 8):
            w.write_batch({"big": big[start : start + 8], "small": small[start : start + 8]})
    ds = roxxel.open_dataset(tmp_path / "ds")
    assert ds.num_shards > 1
    for idx in ([5, 63, 5, 0, 17], rng.integers(0, 64, 40).tolist()):
        got = ds.get_batch(idx)
        np.testing.assert_array_equal(got["big"], big[idx])
        np.testing.assert_array_equal(got["small"], small[idx])
        out = {"big": np.empty((len(idx), row), np.uint8), "small": np.empty(len(idx), np.int64)}
        again = ds.get_batch(idx, out=out)
        assert again["small"] is out["small"] and again["big"] is out["big"]
        np.testing.assert_array_equal(out["small"], small[idx])
        np.testing.assert_array_equal(out["big"], big[idx])


@pytest.mark.parametrize("compress", [None, {"image": "zstd:1"}])
@pytest.mark.parametrize("verify", [False, True])
def test_get_batch_of_rows_spread_over_many_shards(tmp_path, monkeypatch, compress, verify) -> None:
    """A batch whose rows come from about as many shards as rows (copied row by row) reads
    what one with many rows per shard (taken and scattered per shard) reads: the records
    asked, in order, repeats and negative indices included, into the buffers given."""
    from roxxel.format import dataset as dataset_module

    by_row = []
    gather_rows = dataset_module.gather_rows
    monkeypatch.setattr(
        dataset_module, "gather_rows", lambda *a: by_row.append(1) or gather_rows(*a)
    )
    rng = np.random.default_rng(1)
    images = rng.integers(0, 255, (120, 2, 3), dtype=np.uint8)
    schema = {"image": "uint8[2,3]", "label": "int64"}
    out_dir = tmp_path / "ds"
    with roxxel.DatasetWriter(out_dir, schema, shard_bytes=120, compress=compress) as w:
        for i in range(120):
            w.write({"image": images[i], "label": i})
    ds = roxxel.open_dataset(out_dir, verify=verify)
    assert ds.num_shards >= 12
    for idx in (rng.integers(-120, 120, 24).tolist(), [7, 7, -1, 0, 119], rng.integers(0, 8, 40)):
        want = np.asarray(idx) % 120
        got = ds.get_batch(idx)
        np.testing.assert_array_equal(got["image"], images[want])
        np.testing.assert_array_equal(got["label"], want)
        out = {"image": np.empty((len(want), 2, 3), np.uint8)}
        assert ds.get_batch(idx, fields=["image"], out=out)["image"] is out["image"]
        np.testing.assert_array_equal(out["image"], images[want])
        assert set(out) == {"image"}
    assert bool(by_row) == (compress is None and not verify)  # row by row where it may


def test_get_batch_selects_fields_and_pads_to_the_longest(dataset_dir) -> None:
    ds = roxxel.open_dataset(dataset_dir)
    batch = ds.get_batch([1, 4], fields=["tokens"])
    assert set(batch) == {"tokens", "tokens.length"} and batch["tokens"].shape == (2, 4)
    with pytest.raises(ConfigError, match="unknown fields"):
        ds.get_batch([1], fields=["nope"])
    with pytest.raises(ConfigError, match=r"unknown fields \[\['tokens'\]\]"):  # not a name
        ds.get_batch([1], fields=[["tokens"]])  # type: ignore[list-item]
    # an iterator of names is read once: it gave a batch of no fields
    assert set(ds.get_batch([1], fields=iter(["tokens"]))) == {"tokens", "tokens.length"}  # type: ignore[arg-type]
    with pytest.raises(IndexError):
        ds.get_batch([0, 40])
    with pytest.raises(TypeError):
        ds.get_batch([0.5])
    assert ds.get_batch([])["label"].shape == (0,)


def test_token_stream_access(dataset_dir) -> None:
    ds = roxxel.open_dataset(dataset_dir)
    starts = ds.element_starts("tokens")
    stream = np.concatenate([ds.shard(k).flat("tokens") for k in range(ds.num_shards)])
    assert starts[-1] == stream.size == ds.num_elements("tokens")
    expected = np.concatenate([record(i)["tokens"] for i in range(40)])
    np.testing.assert_array_equal(stream, expected)
    offsets = ds.shard(0).element_offsets("tokens")
    assert offsets[0] == 0 and offsets[-1] == ds.shard(0).flat("tokens").size
    with pytest.raises(FormatError, match="not an uncompressed variable array"):
        ds.shard(0).flat("label")


def test_dataset_and_shard_pickle_as_their_path(dataset_dir) -> None:
    ds = roxxel.open_dataset(dataset_dir)
    blob = pickle.dumps(ds)
    assert len(blob) < 300 and b"tokens" not in blob
    again = pickle.loads(blob)
    assert again.path == ds.path and int(again[7]["label"]) == 7
    shard = pickle.loads(pickle.dumps(ds.shard(1)))
    assert len(shard) == len(ds.shard(1))


def _sum_labels(ds: roxxel.Dataset) -> int:
    return int(sum(int(ds.get_batch(np.arange(len(ds)))["label"].sum()) for _ in range(3)))


def test_several_processes_read_one_dataset_at_once(dataset_dir) -> None:
    ds = roxxel.open_dataset(dataset_dir)
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        sums = pool.map(_sum_labels, [ds] * 6)
    assert sums == [3 * sum(range(40))] * 6


def test_verify_names_shard_record_and_field(dataset_dir) -> None:
    ds = roxxel.open_dataset(dataset_dir)
    assert ds.verify() == []
    shard = ds.shard(2)
    column = shard.columns["image"]
    at = column._data_at + 6  # record 1 of shard 2
    path = shard.path
    data = bytearray(path.read_bytes())
    data[at] ^= 1
    path.write_bytes(bytes(data))
    [problem] = roxxel.open_dataset(dataset_dir).verify()
    assert (problem.path, problem.record, problem.field) == (str(path), 1, "image")


def test_verify_reports_a_shard_whose_index_is_damaged(dataset_dir) -> None:
    path = dataset_dir / "shard-00001.rxs"
    data = bytearray(path.read_bytes())
    data[-100] ^= 1  # inside the metadata: index checksum fails, size and trailer unchanged
    path.write_bytes(bytes(data))
    problems = roxxel.open_dataset(dataset_dir).verify()
    assert [(p.path, p.record) for p in problems] == [(str(path), -1)]


def test_a_damaged_trailer_is_refused_when_the_dataset_opens(dataset_dir) -> None:
    path = dataset_dir / "shard-00001.rxs"
    data = bytearray(path.read_bytes())
    data[-40] ^= 1  # the trailer's metadata size: its extents no longer add up (R6)
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError) as info:
        roxxel.open_dataset(dataset_dir)
    assert (info.value.rule, info.value.path) == ("R6", str(path))


# Manifest rules ------------------------------------------------------------------------


def _edit_manifest(folder: Path, edit) -> None:
    path = folder / "manifest.json"
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def _expect(folder: Path, rule: str, first_read: bool = False) -> None:
    with pytest.raises(FormatError) as info:
        ds = roxxel.open_dataset(folder)
        if first_read:
            for i in range(len(ds)):
                ds[i]
    assert f"rule {rule}" in str(info.value) or f"({rule})" in str(info.value), str(info.value)


def test_m1_rejects_missing_oversized_or_non_json_manifests(dataset_dir, tmp_path) -> None:
    _expect(tmp_path, "M1")
    (dataset_dir / "manifest.json").write_bytes(b"\xff{")
    _expect(dataset_dir, "M1")


def test_m1_rejects_a_manifest_that_is_a_fifo(tmp_path) -> None:
    os.mkfifo(tmp_path / "manifest.json")
    _expect(tmp_path, "M1")


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d.update(extra=1),
        lambda d: d.update(format_version=2),
        lambda d: d.update(format="other"),
        lambda d: d.update(shards={}),
    ],
)
def test_m2_rejects_wrong_keys_format_or_version(dataset_dir, edit) -> None:
    _edit_manifest(dataset_dir, edit)
    _expect(dataset_dir, "M2")


def test_m2_names_a_newer_version(dataset_dir) -> None:
    _edit_manifest(dataset_dir, lambda d: d.update(format_version=9))
    with pytest.raises(FormatError, match="newer roxxel"):
        roxxel.open_dataset(dataset_dir)


def test_m3_rejects_a_schema_off_the_allow_list(dataset_dir) -> None:
    _edit_manifest(dataset_dir, lambda d: d["schema"].update(label="object"))
    _expect(dataset_dir, "M3")


@pytest.mark.parametrize(
    ("key", "value"), [("num_records", -1), ("num_bytes", "12"), ("checksum", "md5:00"), ("x", 1)]
)
def test_m4_rejects_malformed_shard_entries(dataset_dir, key, value) -> None:
    _edit_manifest(dataset_dir, lambda d: d["shards"][0].update({key: value}))
    _expect(dataset_dir, "M4")


@pytest.mark.parametrize(
    "name", ["/etc/passwd", "../ds/shard-00000.rxs", "..", "a/b.rxs", "manifest.json"]
)
def test_m5_rejects_paths_that_are_not_plain_names(dataset_dir, name) -> None:
    _edit_manifest(dataset_dir, lambda d: d["shards"][0].update(path=name))
    _expect(dataset_dir, "M5")


def test_m5_rejects_duplicate_entries(dataset_dir) -> None:
    _edit_manifest(dataset_dir, lambda d: d["shards"].append(d["shards"][0]))
    _expect(dataset_dir, "M5")


def test_m5_rejects_two_names_for_one_file(dataset_dir) -> None:
    os.symlink("shard-00000.rxs", dataset_dir / "alias.rxs")

    def alias(doc):
        doc["shards"].append({**doc["shards"][0], "path": "alias.rxs"})
        doc["num_records"] += doc["shards"][0]["num_records"]

    _edit_manifest(dataset_dir, alias)
    _expect(dataset_dir, "M5")


def test_m6_rejects_a_total_that_is_not_the_sum(dataset_dir) -> None:
    _edit_manifest(dataset_dir, lambda d: d.update(num_records=d["num_records"] + 1))
    _expect(dataset_dir, "M6")


def test_m7_rejects_symlinks_leading_out_and_missing_shards(dataset_dir, tmp_path) -> None:
    outside = tmp_path / "outside.rxs"
    (dataset_dir / "shard-00000.rxs").rename(outside)
    os.symlink(outside, dataset_dir / "shard-00000.rxs")
    _expect(dataset_dir, "M7")
    (dataset_dir / "shard-00000.rxs").unlink()
    _expect(dataset_dir, "M7")


def test_m8_rejects_a_size_that_disagrees(dataset_dir) -> None:
    _edit_manifest(
        dataset_dir, lambda d: d["shards"][0].update(num_bytes=d["shards"][0]["num_bytes"] + 1)
    )
    _expect(dataset_dir, "M8")


def test_m9_rejects_counts_or_checksums_that_disagree_with_the_shard(dataset_dir) -> None:
    def swap(doc):
        first, second = doc["shards"][0], doc["shards"][1]
        first["checksum"], second["checksum"] = second["checksum"], first["checksum"]

    _edit_manifest(dataset_dir, swap)
    _expect(dataset_dir, "M9", first_read=True)


def test_m9_rejects_a_shard_with_another_schema(dataset_dir) -> None:
    _add_a_shard_of_another_schema(dataset_dir)
    ds = roxxel.open_dataset(dataset_dir)
    with pytest.raises(FormatError, match="differs from the manifest"):
        ds[len(ds) - 1]


def _add_a_shard_of_another_schema(dataset_dir: Path) -> None:
    roxxel.write_shard(dataset_dir / "other.rxs", [{"label": 1}], {"label": "int64"})

    def add(doc):
        size = (dataset_dir / "other.rxs").stat().st_size
        info = roxxel.format.reader.shard_infos([dataset_dir / "other.rxs"])[0]
        doc["shards"].append(
            {"path": "other.rxs", "num_records": 1, "num_bytes": size, "checksum": info.checksum}
        )
        doc["num_records"] += 1

    _edit_manifest(dataset_dir, add)


# write_manifest --------------------------------------------------------------------------


def test_write_manifest_finishes_separately_written_shards(tmp_path) -> None:
    paths = []
    for part in range(3):
        path = tmp_path / f"part-{part}.rxs"
        roxxel.write_shard(path, [record(part * 10 + i) for i in range(4)], SCHEMA)
        paths.append(path)
    roxxel.write_manifest(tmp_path, paths, metadata={"parts": 3})
    ds = roxxel.open_dataset(tmp_path)
    assert len(ds) == 12 and int(ds[5]["label"]) == 11 and ds.metadata == {"parts": 3}


def test_write_manifest_refuses_outside_shards_and_mixed_schemas(tmp_path) -> None:
    (tmp_path / "d").mkdir()
    roxxel.write_shard(tmp_path / "out.rxs", [record(0)], SCHEMA)
    with pytest.raises(ConfigError, match="not directly inside"):
        roxxel.write_manifest(tmp_path / "d", [tmp_path / "out.rxs"])
    roxxel.write_shard(tmp_path / "d" / "a.rxs", [record(0)], SCHEMA)
    roxxel.write_shard(tmp_path / "d" / "b.rxs", [{"label": 1}], {"label": "int64"})
    with pytest.raises(ConfigError, match="differs"):
        roxxel.write_manifest(tmp_path / "d", [tmp_path / "d" / "a.rxs", tmp_path / "d" / "b.rxs"])


def test_fingerprint_follows_content(dataset_dir, tmp_path) -> None:
    first = roxxel.open_dataset(dataset_dir).fingerprint
    assert roxxel.open_dataset(dataset_dir).fingerprint == first
    with roxxel.DatasetWriter(tmp_path / "other", SCHEMA) as w:
        w.write(record(1))
    assert roxxel.open_dataset(tmp_path / "other").fingerprint != first


# Issue 11: the read side does not import the write side -------------------------------


def test_issue11_item3_write_manifest_lives_on_the_write_side() -> None:
    import ast

    from roxxel.format import dataset_writer

    assert roxxel.write_manifest is dataset_writer.write_manifest
    read_side = ["spec", "schema", "layout", "manifest", "column", "gather", "reader", "dataset"]
    for name in read_side:
        source = (Path(roxxel.__file__).parent / "format" / f"{name}.py").read_text()
        imported = {
            node.module or ""
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom)
        }
        write_side = {f"roxxel.format.{m}" for m in ("writer", "dataset_writer", "atomic")}
        assert not imported & write_side, name


# Issue 12 item 9: the manifest agrees with each shard's own count ----------------------


def test_issue12_item9_a_zero_count_entry_hiding_records_is_refused_at_open(dataset_dir) -> None:
    def hide(doc):
        doc["num_records"] -= doc["shards"][1]["num_records"]
        doc["shards"][1]["num_records"] = 0

    _edit_manifest(dataset_dir, hide)
    with pytest.raises(FormatError) as info:
        roxxel.open_dataset(dataset_dir)
    assert (info.value.rule, info.value.path) == ("M9", str(dataset_dir / "shard-00001.rxs"))


def test_issue12_item9_two_entries_hard_linked_to_one_file_are_refused(dataset_dir) -> None:
    os.link(dataset_dir / "shard-00000.rxs", dataset_dir / "alias.rxs")

    def alias(doc):
        doc["shards"].append({**doc["shards"][0], "path": "alias.rxs"})
        doc["num_records"] += doc["shards"][0]["num_records"]

    _edit_manifest(dataset_dir, alias)
    with pytest.raises(FormatError) as info:
        roxxel.open_dataset(dataset_dir)
    assert (info.value.rule, info.value.path) == ("M5", str(dataset_dir / "alias.rxs"))


def test_issue12_item9_info_fails_on_an_m9_mismatch(dataset_dir, capsys) -> None:
    from roxxel.cli import main

    _add_a_shard_of_another_schema(dataset_dir)
    assert main(["info", str(dataset_dir)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rule M9" in err and "other.rxs" in err


# Issue 12 item 10, issue 13 item 8: Python habits --------------------------------------


@pytest.mark.parametrize("bad", [2.5, "1", b"1", None, np.float64(1.0)])
def test_issue12_item10_non_integer_indices_are_type_errors(dataset_dir, bad) -> None:
    ds = roxxel.open_dataset(dataset_dir)
    for source in (ds, ds.shard(0)):
        with pytest.raises(TypeError, match="expected an int or a slice"):
            source[bad]
    assert int(ds[np.int64(3)]["label"]) == 3 and int(ds[np.uint8(2)]["label"]) == 2


def test_issue12_item10_unsigned_indices_past_int64_do_not_wrap(dataset_dir) -> None:
    ds = roxxel.open_dataset(dataset_dir)
    with pytest.raises(IndexError):
        ds.get_batch(np.array([2**64 - 1], np.uint64))  # -1 once cast to int64
    assert ds.get_batch(np.array([39], np.uint64))["label"].tolist() == [39]


def test_issue13_item10_the_package_ships_a_py_typed_marker() -> None:
    import tomllib

    assert (Path(roxxel.__file__).parent / "py.typed").is_file()
    pyproject = tomllib.loads((Path(roxxel.__file__).parent.parent / "pyproject.toml").read_text())
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["roxxel"]


def test_issue13_item8_a_field_name_index_says_how_to_get_a_column(dataset_dir) -> None:
    ds = roxxel.open_dataset(dataset_dir)
    with pytest.raises(TypeError, match=r"get_batch\(range\(len\(ds\)\), fields=\['tokens'\]\)"):
        ds["tokens"]
    labels = ds.get_batch(range(len(ds)), fields=["label"])["label"]
    assert labels.tolist() == list(range(40))


def test_issue13_item8_slices_give_lists_of_records(dataset_dir) -> None:
    ds = roxxel.open_dataset(dataset_dir)
    assert [int(r["label"]) for r in ds[0:3]] == [0, 1, 2]
    assert [int(r["label"]) for r in ds[-2:]] == [38, 39]
    assert [int(r["label"]) for r in ds[::13]] == [0, 13, 26, 39]
    assert ds[5:2] == [] and len(ds[30:100]) == 10
    shard = ds.shard(1)
    assert [r["text"] for r in shard[:]] == [shard[i]["text"] for i in range(len(shard))]


def test_issue13_item8_open_dataset_on_a_file_is_a_format_error(dataset_dir) -> None:
    with pytest.raises(FormatError) as info:
        roxxel.open_dataset(dataset_dir / "shard-00000.rxs")
    assert info.value.rule == "M1" and "not a directory" in str(info.value)


def test_issue13_item10_repr_names_path_records_and_fields(dataset_dir) -> None:
    ds = roxxel.open_dataset(dataset_dir)
    text = repr(ds)
    assert str(dataset_dir) in text and "num_records=40" in text and "'tokens': 'int32[]'" in text
    shard = ds.shard(0)
    text = repr(shard)
    assert str(shard.path) in text and f"num_records={len(shard)}" in text and "'label'" in text


# Issue 12 item 12: fork while a thread holds the lock ----------------------------------


def test_issue12_item12_a_fork_while_a_thread_holds_the_lock_does_not_deadlock(
    dataset_dir,
) -> None:
    import signal
    import threading
    import warnings

    ds = roxxel.open_dataset(dataset_dir)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with ds._lock:
            held.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads, on purpose
            pid = os.fork()
        if pid == 0:  # the child: its first lazy map takes the lock
            code = 3
            try:
                signal.alarm(30)  # a deadlocked child dies of SIGALRM instead of hanging
                code = 0 if int(ds[len(ds) - 1]["label"]) == 39 else 4
            finally:
                os._exit(code)
    finally:
        release.set()
        holder.join()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


# Issue 12 item 17: a cap on decoded bytes per read -------------------------------------


@pytest.fixture
def zstd_dir(tmp_path: Path) -> Path:
    """Records that decode to 1 MiB each from a few hundred bytes of zstd."""
    out = tmp_path / "z"
    schema = {"pixels": "uint8[1024,1024]", "text": "str"}
    with roxxel.DatasetWriter(out, schema, compress={"pixels": "zstd", "text": "zstd"}) as w:
        for i in range(3):
            w.write({"pixels": np.full((1024, 1024), i, np.uint8), "text": "x" * (i << 19)})
    return out


def test_issue12_item17_decoded_bytes_per_read_are_capped(zstd_dir) -> None:
    mib = 1 << 20
    ds = roxxel.open_dataset(zstd_dir, max_decoded_bytes=3 * mib)
    assert int(ds[2]["pixels"][0, 0]) == 2
    assert ds.get_batch([0, 1], fields=["pixels"])["pixels"].shape == (2, 1024, 1024)
    with pytest.raises(ConfigError, match="read cap of 3145728") as info:
        ds.get_batch([0] * 24)  # 24 MiB from one record
    assert "max_decoded_bytes" in str(info.value)
    with pytest.raises(ConfigError, match="read cap"):
        ds.get_batch([2, 1, 0, 0], fields=["text"])  # 1.5 MiB of text, padded to 4 x 1 MiB
    small = roxxel.open_dataset(zstd_dir, max_decoded_bytes=mib)
    with pytest.raises(ConfigError, match="record 2"):
        small[2]  # 1 MiB of pixels and 1 MiB of text
    assert pickle.loads(pickle.dumps(small)).max_decoded_bytes == mib


def test_issue12_item17_the_cap_comes_from_the_environment_by_default(
    zstd_dir, monkeypatch
) -> None:
    monkeypatch.setenv("ROXXEL_MAX_DECODED_BYTES", str(1 << 20))
    shard = roxxel.open_shard(zstd_dir / "shard-00000.rxs")
    assert shard.max_decoded_bytes == 1 << 20
    with pytest.raises(ConfigError, match="read cap"):
        shard.get_batch([0, 0], fields=["pixels"])
    monkeypatch.setenv("ROXXEL_MAX_DECODED_BYTES", "lots")
    with pytest.raises(ConfigError, match="ROXXEL_MAX_DECODED_BYTES"):
        roxxel.open_dataset(zstd_dir)
    with pytest.raises(ConfigError, match="max_decoded_bytes"):
        roxxel.open_dataset(zstd_dir, max_decoded_bytes=0)


# Issue 12 "clear errors": hostile manifests --------------------------------------------


def _edit_text(folder: Path, old: str, new: str) -> None:
    path = folder / "manifest.json"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def test_issue12_clear_errors_huge_counts_are_format_errors(dataset_dir) -> None:
    def huge(doc):
        doc["num_records"] += 10**30 - doc["shards"][0]["num_records"]
        doc["shards"][0]["num_records"] = 10**30

    _edit_manifest(dataset_dir, huge)
    with pytest.raises(FormatError) as info:
        roxxel.open_dataset(dataset_dir)
    assert info.value.rule == "M4"


def test_issue12_clear_errors_counts_summing_past_2_pow_63_are_refused(dataset_dir, capsys) -> None:
    from roxxel.cli import main

    def big(doc):
        for entry in doc["shards"][:3]:
            entry["num_records"] = 2**62
        doc["num_records"] = sum(e["num_records"] for e in doc["shards"])

    _edit_manifest(dataset_dir, big)
    with pytest.raises(FormatError) as info:
        roxxel.open_dataset(dataset_dir)
    assert info.value.rule == "M6"
    assert main(["info", str(dataset_dir)]) == 1
    assert "rule M6" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("old", "new", "rule"),
    [
        ('"metadata": {', '"metadata": {"k": 1e400, ', "M1"),
        ('"metadata": {', '"metadata": {"k": NaN, ', "M1"),
        ('"format_version": 1', '"format_version": 1.0', "M2"),
        ('"format_version": 1', '"format_version": true', "M2"),
        ('"format_version": 1', '"format_version": 1, "format_version": 1', "M1"),
        ('"num_records": 40', '"num_records": 40.0', "M6"),
    ],
)
def test_issue12_clear_errors_strict_manifest_json(dataset_dir, old, new, rule) -> None:
    _edit_text(dataset_dir, old, new)
    with pytest.raises(FormatError) as info:
        roxxel.open_dataset(dataset_dir)
    assert (info.value.rule, info.value.path) == (rule, str(dataset_dir / "manifest.json"))


def test_issue12_clear_errors_symlink_loops_are_format_errors(dataset_dir, tmp_path) -> None:
    os.symlink("loop.rxs", dataset_dir / "loop.rxs")
    _edit_manifest(dataset_dir, lambda d: d["shards"][0].update(path="loop.rxs"))
    with pytest.raises(FormatError) as info:
        roxxel.open_dataset(dataset_dir)
    assert info.value.rule == "M7"
    (tmp_path / "m").mkdir()
    os.symlink("manifest.json", tmp_path / "m" / "manifest.json")
    with pytest.raises(FormatError) as info:
        roxxel.open_dataset(tmp_path / "m")
    assert info.value.rule == "M1"
    os.symlink("self", tmp_path / "self")
    with pytest.raises(FormatError) as info:
        roxxel.open_dataset(tmp_path / "self")
    assert info.value.rule == "M1"


def test_issue12_clear_errors_a_manifest_that_is_a_directory(tmp_path) -> None:
    (tmp_path / "manifest.json").mkdir()
    with pytest.raises(FormatError) as info:
        roxxel.open_dataset(tmp_path)
    assert info.value.rule == "M1" and "not a regular file" in str(info.value)


def test_issue12_clear_errors_an_unpickled_dataset_checks_its_fingerprint(dataset_dir) -> None:
    ds = roxxel.open_dataset(dataset_dir)
    blob, shard_blob = pickle.dumps(ds), pickle.dumps(ds.shard(0))
    with roxxel.DatasetWriter(dataset_dir, SCHEMA, shard_bytes=200, overwrite=True) as w:
        for i in range(40):
            w.write(record(i + 1))
    with pytest.raises(FormatError, match="changed since it was pickled"):
        pickle.loads(blob)
    with pytest.raises(FormatError, match="changed since it was pickled"):
        pickle.loads(shard_blob)
