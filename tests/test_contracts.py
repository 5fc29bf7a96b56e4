"""Contracts that check themselves: golden order vectors, the writer rules W1-W6 of
docs/format.md, and that every numbered rule of docs/format.md and docs/sampling.md has a
test named after it. Each checker is also shown to fail on a planted violation."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import struct
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import xxhash

import roxxel
from roxxel.errors import ConfigError, FormatError
from roxxel.sampling import order
from tests.test_docs import blocks

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
CHANGELOG = ROOT / "CHANGELOG.md"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "make_order_golden", ROOT / "tools" / "make_order_golden.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_order_golden", module)
    spec.loader.exec_module(module)
    return module


golden = _tool()


# ---------------------------------------------------------------- golden order vectors


@pytest.fixture(scope="module")
def golden_doc() -> dict:
    return json.loads(golden.GOLDEN.read_text())


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> dict:
    return golden.compute(tmp_path_factory.mktemp("order-golden"))


def test_golden_order_vectors_are_reproduced(golden_doc, fresh) -> None:
    diffs = golden.compare(golden_doc["configurations"], fresh)
    assert not diffs, f"{golden.BUMP} (then rerun tools/make_order_golden.py):\n" + "\n".join(diffs)


def test_golden_order_vectors_cover_the_documented_configurations(golden_doc) -> None:
    configs = golden_doc["configurations"]
    assert set(configs) == {
        "records_shuffled",
        "windows_across_shards",
        "mixture_renormalize",
        "mixture_refill",
        "continue_from",
    }
    for name in (
        "records_shuffled",
        "windows_across_shards",
        "mixture_renormalize",
        "mixture_refill",
    ):
        steps = configs[name]["steps"]
        assert {"0", "1", "2", str(10**6), str(10**12)} <= set(steps), name
        assert all(entry["state"]["fingerprint"] for entry in steps.values()), name
    assert {str(10**6), str(10**12)} <= set(configs["continue_from"]["steps"])


def test_golden_order_vectors_record_the_version_that_made_them(golden_doc) -> None:
    assert golden_doc["order_version"] == golden.ORDER_VERSION, golden.BUMP
    made, now = (
        tuple(int(x) for x in v.split(".")[:3])
        for v in (golden_doc["roxxel_version"], roxxel.__version__)
    )
    assert made <= now, f"order vectors from roxxel {made} are newer than roxxel {now}"
    assert golden_doc["writer"] == golden.WRITER
    assert f"order_version {golden.ORDER_VERSION}" in CHANGELOG.read_text(), golden.BUMP


def test_golden_comparison_reports_another_hash_personalization(
    golden_doc, monkeypatch, tmp_path
) -> None:
    """The planted violation: the personalization a file move nearly changed."""
    import hashlib

    def moved_key(seed: int, source: int | str, epoch: int) -> int:
        kind = "str" if isinstance(source, str) else "int"
        text = f"{seed}|{kind}:{source}|{epoch}".encode()
        digest = hashlib.blake2b(text, digest_size=8, person=b"roxxel.sampling").digest()
        return int.from_bytes(digest, "little")

    monkeypatch.setattr(order, "epoch_key", moved_key)
    order._epoch_permutation.cache_clear()
    try:
        diffs = golden.compare(golden_doc["configurations"], golden.compute(tmp_path))
    finally:
        monkeypatch.undo()
        order._epoch_permutation.cache_clear()
    changed = {d.split()[0].rstrip(":") for d in diffs}
    assert {"records_shuffled", "windows_across_shards", "mixture_refill"} <= changed
    assert any("rows" in d and "step 1000000000000" in d for d in diffs)


def test_golden_comparison_reports_a_moved_record_a_changed_state_and_a_lost_step(
    golden_doc,
) -> None:
    configs = json.loads(json.dumps(golden_doc["configurations"]))
    configs["records_shuffled"]["steps"]["2"]["rows"][0][1] += 1
    configs["mixture_refill"]["steps"]["1"]["state"]["fingerprint"] = "0" * 32
    del configs["continue_from"]["steps"][str(10**6)]
    diffs = golden.compare(golden_doc["configurations"], configs)
    was = golden_doc["configurations"]["mixture_refill"]["steps"]["1"]["state"]
    now = configs["mixture_refill"]["steps"]["1"]["state"]
    assert diffs == [
        "continue_from step 1000000: gone",
        f"mixture_refill step 1: state {now} (was {was})",
        "records_shuffled step 2: rows [0] differ",
    ]


# ---------------------------------------------------------------- writer rules W1-W6


def _shard(path: Path, records: list[dict], schema: dict[str, str] | None = None) -> roxxel.Shard:
    roxxel.write_shard(path, records, schema or {"tokens": "int32[]", "label": "int64"})
    return roxxel.open_shard(path)


def _records(num: int = 3) -> list[dict]:
    return [{"tokens": np.arange(i + 1, dtype=np.int32), "label": i} for i in range(num)]


def test_w1_a_value_that_would_change_is_refused_before_any_byte_is_written(tmp_path) -> None:
    path = tmp_path / "s.rxs"
    with roxxel.ShardWriter(path, {"small": "uint16", "f": "float32", "t": "int32[]"}) as w:
        for bad in ({"small": 70000}, {"small": -1}, {"t": np.array([0.5])}):
            with pytest.raises(ConfigError):
                w.write({"small": 1, "f": 0.0, "t": np.zeros(1, np.int32), **bad})
            assert w.num_records == 0 and w.num_bytes == 0
        w.write({"small": 7, "f": np.float64(0.1), "t": np.arange(2, dtype=np.int32)})
    shard = roxxel.open_shard(path)
    assert len(shard) == 1 and shard[0]["f"] == np.float32(0.1)


def test_w2_a_file_appears_only_by_rename_from_a_temp_beside_it(tmp_path) -> None:
    path = tmp_path / "s.rxs"
    writer = roxxel.ShardWriter(path, {"label": "int64"})
    writer.write({"label": 1})
    (temp,) = list(tmp_path.iterdir())
    assert not path.exists()
    assert re.fullmatch(rf"\.s\.rxs\.{os.getpid()}\.[0-9a-f]+\.tmp", temp.name)
    writer.close()
    assert [p.name for p in tmp_path.iterdir()] == ["s.rxs"]
    old = path.read_bytes()
    with pytest.raises(RuntimeError), roxxel.ShardWriter(path, {"label": "int64"}) as w:
        w.write({"label": 2})
        raise RuntimeError("killed mid-write")
    assert [p.name for p in tmp_path.iterdir()] == ["s.rxs"] and path.read_bytes() == old


def test_w2_a_temp_file_is_never_read_as_a_shard(tmp_path) -> None:
    writer = roxxel.ShardWriter(tmp_path / "s.rxs", {"label": "int64"})
    (temp,) = list(tmp_path.iterdir())
    with pytest.raises(FormatError) as err:
        roxxel.open_shard(temp)
    writer.abort()
    assert err.value.rule == "R1" or "R1" in str(err.value)


def test_w3_the_same_records_give_the_same_aligned_bytes(tmp_path) -> None:
    a, b = _shard(tmp_path / "a.rxs", _records()), _shard(tmp_path / "b.rxs", _records())
    data = (tmp_path / "a.rxs").read_bytes()
    assert data == (tmp_path / "b.rxs").read_bytes()
    for column in a.layout.columns:
        assert column.data.offset % 64 == 0 and column.checksums.offset % 64 == 0
    assert data[16:64] == bytes(48) and data[-64 + 40 : -64 + 56] == bytes(16)
    num, tables, meta_offset, meta_bytes = struct.unpack("<4Q", data[-64:-32])
    meta = data[meta_offset : meta_offset + meta_bytes]
    assert meta == json.dumps(json.loads(meta), sort_keys=True, separators=(",", ":")).encode()
    assert num == len(b) == 3 and tables % 64 == 0


def test_w4_a_nonzero_bool_byte_is_stored_as_one(tmp_path) -> None:
    raw = np.array([0, 2, 255, 1], np.uint8).view(bool)
    shard = _shard(tmp_path / "s.rxs", [{"flags": raw}], {"flags": "bool[4]"})
    extent = shard.layout.columns[0].data
    stored = (tmp_path / "s.rxs").read_bytes()[extent.offset : extent.end]
    assert stored == bytes([0, 1, 1, 1])
    assert shard.verify() == []


def test_w5_every_record_has_its_checksum_and_the_shard_verifies(tmp_path) -> None:
    shard = _shard(tmp_path / "s.rxs", _records(4))
    data = (tmp_path / "s.rxs").read_bytes()
    tokens = shard.layout.columns[0]
    assert tokens.field.name == "tokens" and tokens.offsets is not None
    offsets = np.frombuffer(data, "<u8", len(shard) + 1, tokens.offsets.offset)
    sums = np.frombuffer(data, "<u8", len(shard), tokens.checksums.offset)
    for i in range(len(shard)):
        record = data[
            tokens.data.offset + int(offsets[i]) : tokens.data.offset + int(offsets[i + 1])
        ]
        assert int(sums[i]) == xxhash.xxh3_64_intdigest(record)
    assert shard.verify() == []


def test_w6_the_manifest_is_written_last_and_overwrite_removes_it_first(tmp_path) -> None:
    path = tmp_path / "ds"
    writer = roxxel.DatasetWriter(path, {"label": "int64"}, shard_bytes=8)
    for i in range(3):
        writer.write({"label": i})
    assert not (path / "manifest.json").exists()
    writer.close()
    assert roxxel.open_dataset(path).num_records == 3
    again = roxxel.DatasetWriter(path, {"label": "int64"}, overwrite=True)
    assert not (path / "manifest.json").exists()
    with pytest.raises(FormatError):
        roxxel.open_dataset(path)
    again.write({"label": 9})
    again.close()
    assert roxxel.open_dataset(path).num_records == 1


# ---------------------------------------------------------------- rule coverage

RULE = re.compile(r"^\s*-\s+\*\*([A-Z])(\d+)\*\*", re.MULTILINE)
DOCS = {ROOT / "docs" / "format.md": "RMW", ROOT / "docs" / "sampling.md": "S"}


def numbered_rules(text: str) -> list[str]:
    """The rules a doc defines: list items that start with a bold rule name (``- **R7**``)."""
    return [f"{letter}{number}" for letter, number in RULE.findall(text)]


def collect_test_names(folder: Path) -> set[str]:
    names = set()
    for path in folder.glob("*.py"):
        names |= set(re.findall(r"^\s*(?:async\s+)?def (test_\w+)", path.read_text(), re.MULTILINE))
    return names


def untested(rules: list[str], names: set[str]) -> list[str]:
    """The rules no test name contains as ``test_<rule>_`` (case-insensitive)."""
    return [r for r in rules if not any(n.lower().startswith(f"test_{r.lower()}_") for n in names)]


def test_every_numbered_rule_has_a_test_named_after_it() -> None:
    names = collect_test_names(TESTS)
    for doc, letters in DOCS.items():
        rules = numbered_rules(doc.read_text())
        assert {r[0] for r in rules} == set(letters), doc.name
        assert len(rules) == len(set(rules)), f"{doc.name}: a rule is defined twice"
        assert untested(rules, names) == [], f"{doc.name}: rules without a test named after them"


def test_rule_coverage_reports_a_rule_no_test_names() -> None:
    fake = "# spec\n- **R1** a rule.\n- **Z99** a planted rule nobody tests.\n  - **W1** nested.\n"
    rules = numbered_rules(fake)
    assert rules == ["R1", "Z99", "W1"]
    assert untested(rules, collect_test_names(TESTS)) == ["Z99"]
    assert untested(["S1"], {"test_s10_refill"}) == ["S1"]  # S10's test does not cover S1


def test_format_md_json_examples_have_the_keys_the_writer_writes(tmp_path) -> None:
    text = (ROOT / "docs" / "format.md").read_text()
    shard_doc, manifest_doc = (json.loads(b.code) for b in blocks(text) if b.language == "json")
    with roxxel.DatasetWriter(tmp_path / "ds", {"tokens": "int32[]"}) as w:
        w.write({"tokens": np.arange(3, dtype=np.int32)})
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    data = (tmp_path / "ds" / manifest["shards"][0]["path"]).read_bytes()
    _, _, meta_offset, meta_bytes = struct.unpack("<4Q", data[-64:-32])
    meta = json.loads(data[meta_offset : meta_offset + meta_bytes])
    assert set(shard_doc) == set(meta) and set(shard_doc["fields"][0]) == set(meta["fields"][0])
    assert set(manifest_doc) == set(manifest)
    assert set(manifest_doc["shards"][0]) == set(manifest["shards"][0])


def test_golden_comparison_reports_a_perturbed_seed(golden_doc, monkeypatch, tmp_path) -> None:
    made = golden.configurations

    def reseeded(datasets):
        configs = made(datasets)
        source, batch_size, seed, extra = configs["records_shuffled"]()
        configs["records_shuffled"] = lambda: (source, batch_size, seed + 1, extra)
        return configs

    monkeypatch.setattr(golden, "configurations", reseeded)
    diffs = golden.compare(golden_doc["configurations"], golden.compute(tmp_path))
    assert diffs and all(d.startswith("records_shuffled step") for d in diffs)
    assert any("rows" in d for d in diffs)
