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


def test_get_batch_selects_fields_and_pads_to_the_longest(dataset_dir) -> None:
    ds = roxxel.open_dataset(dataset_dir)
    batch = ds.get_batch([1, 4], fields=["tokens"])
    assert set(batch) == {"tokens", "tokens.length"} and batch["tokens"].shape == (2, 4)
    with pytest.raises(ConfigError, match="unknown fields"):
        ds.get_batch([1], fields=["nope"])
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
    data[-40] ^= 1  # inside the trailer's numbers: index checksum fails, size unchanged
    path.write_bytes(bytes(data))
    problems = roxxel.open_dataset(dataset_dir).verify()
    assert [(p.path, p.record) for p in problems] == [(str(path), -1)]


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
    roxxel.write_shard(dataset_dir / "other.rxs", [{"label": 1}], {"label": "int64"})

    def add(doc):
        size = (dataset_dir / "other.rxs").stat().st_size
        info = roxxel.format.reader.shard_infos([dataset_dir / "other.rxs"])[0]
        doc["shards"].append(
            {"path": "other.rxs", "num_records": 1, "num_bytes": size, "checksum": info.checksum}
        )
        doc["num_records"] += 1

    _edit_manifest(dataset_dir, add)
    ds = roxxel.open_dataset(dataset_dir)
    with pytest.raises(FormatError, match="differs from the manifest"):
        ds[len(ds) - 1]


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
