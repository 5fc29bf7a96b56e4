"""Tests for the pack's batched unit writer and the projection of records onto a schema."""

from __future__ import annotations

import json

import numpy as np
import pytest

import roxxel
from roxxel.cli import main
from roxxel.errors import ConfigError
from roxxel.format.schema import Schema
from roxxel.ingest import pack as ingest_pack
from roxxel.ingest.infer import max_record_bytes, project_record
from roxxel.ingest.inputs import Input, default_unit_bytes
from tests.test_ingest_pool import WORKER_ONLY

FIELDS = ["--field", "id:int64", "--field", "tokens:uint16[]", "--field", "text:str"]


def _corpus(path, n=700, bad_line=None):
    rng = np.random.default_rng(0)
    lines = []
    for i in range(n):
        tokens = rng.integers(0, 60000, rng.integers(0, 40)).tolist()
        if i == bad_line:
            tokens = [1, 70000]
        text = "é" * int(rng.integers(0, 30)) + "x"
        lines.append(json.dumps({"id": i, "tokens": tokens, "text": text}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _pack(src, out, *extra):
    return main(["pack", str(src), "-o", str(out), *FIELDS, "--quiet", *map(str, extra)])


def _files(root):
    return {p.name: p.read_bytes() for p in sorted(root.glob("*.rxs"))}


@pytest.mark.parametrize("shard_bytes", ["2K", "64K", "256M"])
def test_batched_pack_equals_record_by_record_pack(tmp_path, monkeypatch, shard_bytes):
    src = _corpus(tmp_path / "in.jsonl")
    assert _pack(src, tmp_path / "batched", "--shard-bytes", shard_bytes) == 0
    monkeypatch.setattr(ingest_pack, "max_record_bytes", lambda record, fields: None)
    assert _pack(src, tmp_path / "single", "--shard-bytes", shard_bytes) == 0
    batched, single = _files(tmp_path / "batched"), _files(tmp_path / "single")
    assert batched == single and len(batched) >= (2 if shard_bytes != "256M" else 1)


def test_bad_record_inside_a_batch_is_named_by_line(tmp_path, capsys):
    src = _corpus(tmp_path / "in.jsonl", bad_line=300)
    assert _pack(src, tmp_path / "ds") == 1
    err = capsys.readouterr().err
    assert f"{src}:301: " in err and "70000" in err and "Traceback" not in err


def test_skip_bad_inside_a_batch_keeps_the_others_in_order(tmp_path, capsys):
    src = _corpus(tmp_path / "in.jsonl", bad_line=300)
    assert _pack(src, tmp_path / "ds", "--skip-bad") == 0
    assert f"{src}:301" in capsys.readouterr().err
    ds = roxxel.open_dataset(tmp_path / "ds")
    ids = [int(ds[i]["id"]) for i in range(len(ds))]
    assert ids == [i for i in range(700) if i != 300]


def test_project_converts_int_lists_exactly_or_leaves_them_to_the_writer():
    fields = {f.name: f for f in Schema.parse({"t": "uint16[]", "f": "float32[]"})}
    got = project_record({"t": [1, 65535], "f": [0.5], "other": 1}, fields)
    assert got["t"].dtype == np.uint16 and got["t"].tolist() == [1, 65535]
    assert set(got) == {"t", "f"}
    for bad in ([1, 70000], [-1]):
        kept = project_record({"t": bad, "f": []}, fields)["t"]
        assert not (isinstance(kept, np.ndarray) and kept.dtype == np.uint16)
    for bad in ([1, 2.5], [True, False]):  # refused here, naming the value (issue 12)
        with pytest.raises(ConfigError, match="field 't'"):
            project_record({"t": bad, "f": []}, fields)


def test_max_record_bytes_bounds_what_the_writer_stores():
    schema = Schema.parse({"t": "int32[]", "s": "str", "img": "uint8[2,3]", "n": "int64"})
    fields = {f.name: f for f in schema}
    record = {"t": np.arange(5, dtype=np.int32), "s": "é!", "img": np.zeros((2, 3)), "n": 3}
    assert max_record_bytes(record, fields) == 20 + 8 + 6 + 8
    assert max_record_bytes({**record, "t": [1, 2]}, fields) is None
    assert max_record_bytes({"t": record["t"]}, fields) is None


def test_workers_share_units_with_this_process_and_give_the_same_bytes(tmp_path):
    src = _corpus(tmp_path / "in.jsonl", n=400)
    assert _pack(src, tmp_path / "one", "--unit-bytes", "4K", "--workers", 1) == 0
    assert _pack(src, tmp_path / "three", "--unit-bytes", "4K", "--workers", 3) == 0
    assert _files(tmp_path / "one") == _files(tmp_path / "three") != {}
    manifest = "manifest.json"
    assert (tmp_path / "one" / manifest).read_bytes() == (
        tmp_path / "three" / manifest
    ).read_bytes()


def test_issue14_a_default_cut_gives_every_worker_units_of_a_mid_sized_input(tmp_path):
    """The default unit was --shard-bytes of input (256M): 130 MB of JPEGs, or this 24 MiB
    array, made one unit, so --workers 2 left a worker idle. It is now the input bytes over
    32, at least 8 MiB: several units here, the same whatever --workers (a shard each)."""
    src = tmp_path / "rows.npy"
    np.save(src, np.arange(3 << 20, dtype=np.int64).reshape(-1, 64))  # 24 MiB
    outs = [tmp_path / "one", tmp_path / "two"]
    for out, workers in zip(outs, ("1", "2"), strict=True):
        assert main(["pack", str(src), "-o", str(out), "--quiet", "--workers", workers]) == 0
    assert _files(outs[0]) == _files(outs[1]) and len(_files(outs[0])) >= 3
    assert len(roxxel.open_dataset(outs[0])) == 3 << 14
    # --shuffle-input mixes records within a unit: its default unit stays --shard-bytes
    shuffled = tmp_path / "shuffled"
    assert main(["pack", str(src), "-o", str(shuffled), "-q", "--shuffle-input", "5"]) == 0
    assert len(_files(shuffled)) == 1
    assert default_unit_bytes([Input(str(src), "npy")], 4 << 20) == 4 << 20  # <= shard bytes
    big = tmp_path / "big.jsonl"
    with open(big, "wb") as f:
        f.truncate(10 << 30)  # sparse: 10 GiB of input, units of at most --shard-bytes
    assert default_unit_bytes([Input(str(big), "jsonl")], 256 << 20) == 256 << 20
    assert default_unit_bytes([Input(str(big), "jsonl")], 1 << 30) == 10 << 25


def test_a_dead_worker_process_stops_the_pack_with_a_message(tmp_path, capsys):
    src = _corpus(tmp_path / "in.jsonl", n=400)
    killer = tmp_path / "killer.py"
    killer.write_text(WORKER_ONLY.format(mark=str(tmp_path / "mark"), act="os._exit(3)"))
    out = tmp_path / "ds"
    code = _pack(src, out, "--unit-bytes", "4K", "--workers", 2, "--map", f"{killer}:fn")
    assert code == 1 and "a worker process died" in capsys.readouterr().err
    assert not (out / "manifest.json").exists()


def test_a_map_naming_a_missing_function_is_a_config_error(tmp_path) -> None:
    (tmp_path / "usermap.py").write_text("def present(record):\n    return record\n")
    spec = f"{tmp_path / 'usermap.py'}:absent"
    with pytest.raises(ConfigError, match="has no 'absent'"):
        ingest_pack.load_map(spec)
    assert callable(ingest_pack.load_map(f"{tmp_path / 'usermap.py'}:present"))


def test_issue14_roxxel_pack_refuses_bad_arguments_with_config_errors(tmp_path):
    """`roxxel.pack` never exits the interpreter (argparse's SystemExit), never raises a bare
    TypeError, and never touches what the caller passed (an int is not a file descriptor)."""
    import os

    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": f"t{i}", "n": i}) + "\n" for i in range(5)))
    out = tmp_path / "o"
    bad = [
        (([], out), {}, r"INPUT|inputs"),
        ((src, out), {"workers": b"2"}, r"workers.*bytes"),
        ((src, out), {"skip_bad": "yes"}, r"skip_bad.*True or False"),
        ((src, out), {"shard_bytes": "64Q"}, r"64Q"),
        ((src, out), {"workers": "two"}, r"two"),
        ((src, out), {"field": [3.5]}, r"3\.5"),
        (([src, None], out), {}, r"NoneType"),
    ]
    for (inputs, output), options, match in bad:
        with pytest.raises(ConfigError, match=match):
            roxxel.pack(inputs, output, **options)
    with open(tmp_path / "log.txt", "w") as log:
        with pytest.raises(roxxel.RoxxelError):
            roxxel.pack(src, out, tokenizer=log.fileno())
        os.fstat(log.fileno())  # still open
    assert not (out / "manifest.json").exists()
    roxxel.pack(src, out, field=["n:int64"], shard_bytes=4096, workers=1, int_dtype="int32")
    assert [int(r["n"]) for r in roxxel.open_dataset(out)] == list(range(5))


def test_a_pack_plan_keeps_the_field_order_and_reads_a_plan_of_roxxel_0_1(tmp_path):
    """plan.json is written with sorted keys, which put the schema's fields in name order:
    a local pack's manifest then listed them unlike its shards (and a remote pack)."""
    from roxxel.ingest.parts import PackSpec

    spec = PackSpec("f" * 32, 3, {"tokens": "int32[]", "label": "int64"}, {})
    where = tmp_path / "plan.json"
    back = PackSpec.from_json(json.loads(json.dumps(spec.to_json(), sort_keys=True)), where)
    assert list(back.schema.items()) == [("tokens", "int32[]"), ("label", "int64")]
    old = {"fingerprint": "f" * 32, "num_units": 3, "schema": {"label": "int64"}, "metadata": {}}
    assert PackSpec.from_json(old, where).schema == {"label": "int64"}  # an interrupted pack


@pytest.mark.parametrize(
    ("inputs", "named"),
    [
        (None, "NoneType"),
        (5, "int"),
        (b"c.jsonl", "bytes"),
        ([5], "int"),
        (["c.jsonl", None], "NoneType"),
    ],
)
def test_pack_from_python_refuses_inputs_that_are_no_paths(tmp_path, inputs, named):
    """`roxxel.pack(None, ...)` raised a bare TypeError, and bytes were read as a list of
    numbers: "100: no such file or directory"."""
    with pytest.raises(ConfigError, match=rf"roxxel.pack: inputs.*{named}.*expected"):
        roxxel.pack(inputs, tmp_path / "ds")
    assert not (tmp_path / "ds").exists()


def test_pack_from_python_takes_storage_options_as_a_dict_and_never_shows_them(tmp_path):
    """`storage_options` had to be JSON text, and a dict was refused with its values, a
    secret included, in the message."""
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"x": i}) + "\n" for i in range(5)))
    url = f"file://{tmp_path}/ds"
    roxxel.pack(src, url, storage_options={"auto_mkdir": True})
    assert len(roxxel.open_dataset(url, cache_dir=tmp_path / "cache")) == 5
    with pytest.raises(ConfigError) as caught:
        roxxel.pack(src, url, storage_options=["SUPERSECRET123"])
    assert "SUPERSECRET123" not in str(caught.value) and "storage_options" in str(caught.value)
    with pytest.raises(ConfigError, match="quiet"):
        roxxel.pack(src, url, quiet="no")


@pytest.mark.parametrize("kind", ["jsonl", "txt", "text-file"])
def test_a_utf8_bom_at_the_start_of_a_file_is_dropped(tmp_path, kind):
    """A BOM (files saved on Windows) was refused in JSONL ("malformed JSON") but kept in a
    .txt, where a tokenizer then encoded it as three byte tokens: it is dropped in both."""
    from roxxel.cli import main

    bom = "\ufeff"
    src = tmp_path / f"a.{'jsonl' if kind == 'jsonl' else 'txt'}"
    if kind == "jsonl":
        src.write_text(bom + '{"text": "hello world"}\n{"text": "again"}\n', encoding="utf-8")
    else:
        src.write_text(bom + "hello world\nagain\n", encoding="utf-8")
    flags = ["--format", "text-file"] if kind == "text-file" else []
    assert main(["pack", str(src), "-o", str(tmp_path / "ds"), *flags, "-q"]) == 0
    first = roxxel.open_dataset(tmp_path / "ds")[0]["text"]
    assert first == ("hello world\nagain\n" if kind == "text-file" else "hello world")
