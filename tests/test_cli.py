"""Tests for the ``roxxel`` command line: every command, resume, tasks, and the error paths."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import roxxel
from roxxel.cli import main

ROXXEL = Path(sys.executable).with_name("roxxel")
COMMANDS = ["pack", "merge", "info", "verify", "cat", "bench", "plan", "peek"]

MAP_SOURCE = '''
import os, signal

def double(record):
    """Drop odd ids, double the tokens; with ROXXEL_TEST_KILL_AT, SIGKILL this process there."""
    if str(record["id"]) == os.environ.get("ROXXEL_TEST_KILL_AT"):
        os.kill(os.getpid(), signal.SIGKILL)
    if record["id"] % 2:
        return None
    return {"id": record["id"], "tokens": [2 * t for t in record["tokens"]]}

def identity(record):
    if str(record["id"]) == os.environ.get("ROXXEL_TEST_KILL_AT"):
        os.kill(os.getpid(), signal.SIGKILL)
    return record

def broken(record):
    return 3
'''


def _corpus(folder: Path, num_files: int = 3, num_lines: int = 60) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(num_files):
        lines = [
            json.dumps({"id": f * 1000 + i, "tokens": list(range(i % 17)), "text": f"doc {i}"})
            for i in range(num_lines)
        ]
        (folder / f"part-{f}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _map_file(tmp_path: Path) -> str:
    path = tmp_path / "usermap.py"
    path.write_text(MAP_SOURCE)
    return str(path)


def _files(directory: Path) -> dict[str, bytes]:
    """Shards and manifest by name (the dataset's bytes; pack state excluded)."""
    return {
        p.name: p.read_bytes()
        for p in sorted(directory.iterdir())
        if p.suffix == ".rxs" or p.name == "manifest.json"
    }


def _run(*argv: str) -> int:
    return main([str(a) for a in argv])


PACK_FIELDS = ["--field", "id:int64", "--field", "tokens:int32[]", "--field", "text:str"]


# ---- help and usage ------------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_an_example(command, capsys):
    assert main([command, "--help"]) == 0
    assert "example" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["pack", "x.jsonl"],
        ["pack", "x.jsonl", "-o", "d", "--shard-bytes", "lots"],
        ["cat", "d", "zero"],
    ],
)
def test_usage_errors_exit_2(argv, capsys):
    assert main(argv) == 2
    assert "usage" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra",
    [
        ["--field", "tokens"],
        ["--field", "id:int64", "--schema", "s.toml"],
        ["--num-tasks", "2", "--task-index", "2"],
        ["--workers", "0"],
        ["--compress", "text"],
    ],
)
def test_bad_pack_flags_exit_2_with_one_line(tmp_path, extra, capsys):
    corpus = _corpus(tmp_path / "in")
    assert _run("pack", corpus, "-o", tmp_path / "out", *extra) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err


# ---- pack, info, cat, verify, bench --------------------------------------------------


def test_pack_infers_and_prints_schema_then_info_cat_verify(tmp_path, capsys):
    corpus = _corpus(tmp_path / "in")
    out = tmp_path / "ds"
    assert _run("pack", corpus, "-o", out) == 0
    printed = capsys.readouterr().out
    assert (
        "schema (inferred from the first 100 records): id:int64, tokens:int64[], text:str"
        in printed
    )
    assert "packed 180 records" in printed
    ds = roxxel.open_dataset(out)
    assert len(ds) == 180 and ds[61]["text"] == "doc 1" and ds[61]["tokens"].tolist() == [0]

    assert _run("info", out) == 0
    assert "180 records" in capsys.readouterr().out
    assert _run("info", out, "--json") == 0
    info = json.loads(capsys.readouterr().out)
    assert info["num_records"] == 180 and info["elements"]["tokens"] == 3 * sum(
        i % 17 for i in range(60)
    )
    assert info["schema"] == {"id": "int64", "tokens": "int64[]", "text": "str"}

    assert _run("cat", out, "2", "-1", "--json") == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines[0] == {"index": 2, "id": 2, "tokens": [0, 1], "text": "doc 2"}
    assert lines[1]["id"] == 2059
    assert _run("cat", out, "2") == 0
    assert "record 2" in capsys.readouterr().out

    assert _run("verify", out, "--workers", "1") == 0
    assert "OK (180 records" in capsys.readouterr().out
    assert _run("bench", out, "--num-batches", "3", "--json") == 0
    assert set(json.loads(capsys.readouterr().out)) >= {"sequential", "random"}


def test_pack_with_flags_schema_toml_and_compression(tmp_path, capsys):
    corpus = _corpus(tmp_path / "in", num_files=1)
    toml = tmp_path / "schema.toml"
    toml.write_text('[fields]\nid = "int32"\ntokens = "uint16[]"\ntext = "str"\n')
    out = tmp_path / "ds"
    argv = ["pack", corpus, "-o", out, "--schema", toml, "--compress", "text=zstd:3", "-q"]
    assert _run(*argv) == 0
    assert capsys.readouterr().out == ""
    ds = roxxel.open_dataset(out)
    assert ds.schema["tokens"].spec == "uint16[]" and ds[5]["text"] == "doc 5"
    assert ds[16]["tokens"].dtype == np.uint16 and ds[16]["tokens"].tolist() == list(range(16))


def test_pack_npy_gives_fixed_shape_field(tmp_path, capsys):
    images = np.arange(5 * 2 * 3, dtype=np.uint8).reshape(5, 2, 3)
    np.save(tmp_path / "images.npy", images)
    out = tmp_path / "ds"
    assert _run("pack", tmp_path / "images.npy", "-o", out, "--input-field", "image") == 0
    assert "image:uint8[2,3]" in capsys.readouterr().out
    ds = roxxel.open_dataset(out)
    np.testing.assert_array_equal(ds.get_batch([0, 1, 2, 3, 4])["image"], images)


def test_pack_parquet_and_megatron(tmp_path):
    table = pa.table({"tokens": pa.array([[1, 2], [3], []], pa.list_(pa.int32())), "y": [1, 2, 3]})
    pq.write_table(table, tmp_path / "t.parquet")
    assert _run("pack", tmp_path / "t.parquet", "-o", tmp_path / "pq", "-q") == 0
    assert roxxel.open_dataset(tmp_path / "pq")[2]["tokens"].tolist() == []

    seqs = [[5, 6, 7], [8], [9, 10]]
    lengths = np.array([len(s) for s in seqs], "<i4")
    pointers = np.array([0, 6, 8], "<i8")
    with open(tmp_path / "c.idx", "wb") as f:
        f.write(struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, 8, 3, 4))
        f.write(lengths.tobytes() + pointers.tobytes() + np.arange(4, dtype="<i8").tobytes())
    (tmp_path / "c.bin").write_bytes(np.concatenate([np.asarray(s, "<u2") for s in seqs]).tobytes())
    assert _run("pack", tmp_path / "c.idx", "-o", tmp_path / "mg", "-q") == 0
    ds = roxxel.open_dataset(tmp_path / "mg")
    assert ds.schema.to_json() == {"tokens": "uint16[]"} and ds[2]["tokens"].tolist() == [9, 10]


def test_map_in_worker_processes_drops_and_transforms(tmp_path):
    corpus = _corpus(tmp_path / "in")
    spec = _map_file(tmp_path) + ":double"
    one, two = tmp_path / "w1", tmp_path / "w2"
    common = [
        "--map",
        spec,
        "--unit-bytes",
        "2K",
        "-q",
        "--field",
        "id:int64",
        "--field",
        "tokens:int32[]",
    ]
    assert _run("pack", corpus, "-o", one, *common) == 0
    assert _run("pack", corpus, "-o", two, *common, "--workers", "2") == 0
    ds = roxxel.open_dataset(two)
    assert len(ds) == 90 and ds[3]["id"] == 6 and ds[3]["tokens"].tolist() == [0, 2, 4, 6, 8, 10]
    assert _files(one) == _files(two)


def test_map_returning_a_non_dict_names_the_record(tmp_path, capsys):
    corpus = _corpus(tmp_path / "in", num_files=1)
    spec = _map_file(tmp_path) + ":broken"
    assert _run("pack", corpus, "-o", tmp_path / "ds", "--map", spec, *PACK_FIELDS) == 1
    assert "part-0.jsonl:1: --map" in capsys.readouterr().err


def test_shuffle_input_is_deterministic_and_a_permutation(tmp_path):
    corpus = _corpus(tmp_path / "in")
    ids = []
    for name in ("a", "b"):
        argv = ["pack", corpus, "-o", tmp_path / name, "--shuffle-input", "7", "--unit-bytes", "2K"]
        assert _run(*argv, "-q", *PACK_FIELDS) == 0
        ds = roxxel.open_dataset(tmp_path / name)
        ids.append([int(ds[i]["id"]) for i in range(len(ds))])
    assert ids[0] == ids[1] and sorted(ids[0]) == [
        f * 1000 + i for f in range(3) for i in range(60)
    ]
    assert ids[0] != sorted(ids[0])


# ---- bad input -----------------------------------------------------------------------


@pytest.mark.parametrize("workers", ["1", "2"])
def test_malformed_jsonl_names_file_and_line_and_writes_nothing(tmp_path, capsys, workers):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": 1, "tokens": [1], "text": "a"}\n{"id": 2, "tokens": [\n')
    other = _corpus(tmp_path / "in", num_files=1)
    out = tmp_path / "ds"
    argv = ["pack", other, path, "-o", out, "--workers", workers, "--unit-bytes", "1K"]
    assert _run(*argv, *PACK_FIELDS) == 1
    err = capsys.readouterr().err
    assert f"{path}:2: malformed JSON" in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (out / "manifest.json").exists()
    finished = {p.stem.split("-")[1] for p in (out / ".roxxel-pack").glob("unit-*.json")}
    assert all(p.name.split("-")[1] in finished for p in out.glob("*.rxs"))  # no half unit


def test_skip_bad_reports_count_and_first_locations(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"id": 1, "tokens": [1], "text": "a"})
    path.write_text(
        "\n".join([good, "{oops", good, "[1]", good, '{"id": 2, "tokens": [70000], "text": "b"}'])
    )
    out = tmp_path / "ds"
    argv = [
        "pack",
        path,
        "-o",
        out,
        "--skip-bad",
        "--field",
        "id:int64",
        "--field",
        "tokens:uint16[]",
    ]
    assert _run(*argv, "--field", "text:str") == 0
    err = capsys.readouterr().err
    assert "skipped 3 bad records" in err
    assert f"{path}:2:" in err and f"{path}:4:" in err and f"{path}:6:" in err
    assert len(roxxel.open_dataset(out)) == 3


@pytest.mark.parametrize(
    ("record", "fields", "message"),
    [
        (
            {"tokens": [1, 70000]},
            ["tokens:uint16[]"],
            "field 'tokens' value 70000 does not fit uint16",
        ),
        ({"image": [[1, 2]]}, ["image:uint8[2,2]"], "field 'image' has shape (1, 2)"),
        ({"a": 1}, ["a:int64", "b:int64"], "field 'b' missing from the record (its fields: ['a']"),
        ({"tokens": [0.5]}, ["tokens:int32[]"], "field 'tokens': value 0.5 does not fit int32"),
        ({"m": [[1, 2], [3]]}, ["m:int32[,2]"], "field 'm' holds ragged nested lists"),
    ],
)
def test_value_that_does_not_fit_names_record_and_field(tmp_path, capsys, record, fields, message):
    path = tmp_path / "in.jsonl"
    first = {"a": 1, "b": 2, "tokens": [1], "image": [[1, 2], [3, 4]], "m": [[1, 2]]}
    path.write_text(json.dumps(first) + "\n" + json.dumps(record) + "\n")
    flags = [x for f in fields for x in ("--field", f)]
    assert _run("pack", path, "-o", tmp_path / "ds", *flags) == 1
    err = capsys.readouterr().err
    assert f"{path}:2: " in err and message in err and "Traceback" not in err


def test_ambiguous_schema_asks_for_field(tmp_path, capsys):
    path = tmp_path / "in.jsonl"
    path.write_text('{"x": 1}\n{"x": "one"}\n')
    assert _run("pack", path, "-o", tmp_path / "ds") == 1
    assert "pass --field x:SPEC" in capsys.readouterr().err


def test_output_holding_another_dataset_is_refused_unless_overwrite(tmp_path, capsys):
    corpus = _corpus(tmp_path / "in", num_files=1)
    out = tmp_path / "ds"
    assert _run("pack", corpus, "-o", out, "-q", *PACK_FIELDS) == 0
    before = _files(out)
    assert (
        _run(
            "pack",
            corpus,
            "-o",
            out,
            "-q",
            "--field",
            "id:int32",
            "--field",
            "tokens:int32[]",
            "--field",
            "text:str",
        )
        == 1
    )
    assert "pass --overwrite" in capsys.readouterr().err and _files(out) == before
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert _run("pack", corpus, "-o", tmp_path / "other", "-q", *PACK_FIELDS) == 1
    assert (
        _run(
            "pack",
            corpus,
            "-o",
            out,
            "-q",
            "--overwrite",
            "--field",
            "id:int32",
            "--field",
            "tokens:int32[]",
            "--field",
            "text:str",
        )
        == 0
    )
    assert roxxel.open_dataset(out).schema["id"].spec == "int32"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["info", "{missing}"], "no manifest"),
        (["cat", "{ds}", "999"], "index 999"),
        (["verify", "{missing}"], "no manifest"),
        (["pack", "{missing}/x.jsonl", "-o", "{ds}2"], "no such file"),
        (["merge", "{missing}", "-o", "{ds}2"], "no pack plan"),
    ],
)
def test_library_errors_are_one_line_exit_1(tmp_path, capsys, argv, message):
    corpus = _corpus(tmp_path / "in", num_files=1)
    assert _run("pack", corpus, "-o", tmp_path / "ds", "-q", *PACK_FIELDS) == 0
    names = {"missing": tmp_path / "missing", "ds": tmp_path / "ds"}
    assert main([a.format(**names) for a in argv]) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


# ---- resume, tasks, merge, verify ----------------------------------------------------


def test_rerun_keeps_finished_units_and_repacks_damaged_ones(tmp_path, capsys):
    corpus = _corpus(tmp_path / "in")
    out = tmp_path / "ds"
    argv = ["pack", corpus, "-o", out, "--unit-bytes", "2K", *PACK_FIELDS]
    assert _run(*argv) == 0
    reference = _files(out)
    shards = sorted(out.glob("part-*.rxs"))
    shards[1].unlink()
    shards[2].write_bytes(shards[2].read_bytes()[:-10])
    (out / "manifest.json").unlink()
    capsys.readouterr()
    assert _run(*argv) == 0
    assert f"({len(shards) - 2} kept from an earlier run" in capsys.readouterr().out
    assert _files(out) == reference


@pytest.mark.parametrize("workers", ["1", "2"])
def test_kill_9_then_rerun_gives_the_uninterrupted_bytes(tmp_path, workers):
    corpus = _corpus(tmp_path / "in", num_files=4, num_lines=80)
    spec = _map_file(tmp_path) + ":identity"
    argv = [
        str(ROXXEL),
        "pack",
        str(corpus),
        "--map",
        spec,
        "--unit-bytes",
        "1K",
        "--workers",
        workers,
        "-q",
        *PACK_FIELDS,
    ]
    env = {**os.environ, "ROXXEL_TEST_KILL_AT": "2040"}  # file 2, line 41: mid-corpus
    killed = subprocess.run([*argv, "-o", str(tmp_path / "a")], env=env, capture_output=True)
    # with 2 workers either process may reach that record: the main one dies, or it reports
    # the forked worker's death
    died = b"a worker process died" in killed.stderr and killed.returncode == 1
    assert killed.returncode == -signal.SIGKILL or (workers == "2" and died), killed.stderr
    assert not (tmp_path / "a" / "manifest.json").exists() and list((tmp_path / "a").glob("*.rxs"))
    rerun = subprocess.run([*argv, "-o", str(tmp_path / "a")], capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr
    clean = subprocess.run([*argv, "-o", str(tmp_path / "b")], capture_output=True, text=True)
    assert clean.returncode == 0, clean.stderr
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    assert not list((tmp_path / "a").glob(".*.tmp"))


def test_two_tasks_plus_merge_equal_one_task(tmp_path, capsys):
    corpus = _corpus(tmp_path / "in")
    common = ["--unit-bytes", "2K", "-q", *PACK_FIELDS]
    assert _run("pack", corpus, "-o", tmp_path / "one", *common) == 0
    for i in range(2):
        assert (
            _run(
                "pack",
                corpus,
                "-o",
                tmp_path / f"t{i}",
                "--num-tasks",
                "2",
                "--task-index",
                i,
                *common,
            )
            == 0
        )
        assert not (tmp_path / f"t{i}" / "manifest.json").exists()
    assert _run("merge", tmp_path / "t0", "-o", tmp_path / "m") == 1
    assert "not packed" in capsys.readouterr().err
    assert _run("merge", tmp_path / "t0", tmp_path / "t1", "-o", tmp_path / "m", "-q") == 0
    assert _files(tmp_path / "m") == _files(tmp_path / "one")
    # tasks sharing one directory, then pack --finalize
    for i in range(2):
        assert (
            _run(
                "pack", corpus, "-o", tmp_path / "s", "--num-tasks", "2", "--task-index", i, *common
            )
            == 0
        )
    assert _run("pack", corpus, "-o", tmp_path / "s", "--finalize", *common) == 0
    assert _files(tmp_path / "s") == _files(tmp_path / "one")


def test_merge_refuses_parts_of_different_packs(tmp_path, capsys):
    corpus = _corpus(tmp_path / "in")
    assert _run("pack", corpus, "-o", tmp_path / "a", "-q", "--num-tasks", "2", *PACK_FIELDS) == 0
    assert (
        _run(
            "pack",
            corpus,
            "-o",
            tmp_path / "b",
            "-q",
            "--num-tasks",
            "3",
            "--unit-bytes",
            "1K",
            *PACK_FIELDS,
        )
        == 0
    )
    assert _run("merge", tmp_path / "a", tmp_path / "b", "-o", tmp_path / "m") == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'a'}, {tmp_path / 'b'}: parts of different packs" in err
    assert "PosixPath" not in err  # the folders as paths, not as Python reprs


def test_verify_names_shard_record_and_field_of_corruption(tmp_path, capsys):
    corpus = _corpus(tmp_path / "in")
    out = tmp_path / "ds"
    assert _run("pack", corpus, "-o", out, "--unit-bytes", "2K", "-q", *PACK_FIELDS) == 0
    shard = sorted(out.glob("part-*.rxs"))[1]
    ds = roxxel.open_dataset(out)
    start = int(ds.shard_starts[1])
    text = ds[start + 3]["text"].encode()
    data = bytearray(shard.read_bytes())
    at = data.find(text)
    data[at] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert _run("verify", out, "--workers", "2") == 1
    out_text = capsys.readouterr().out
    line = next(x for x in out_text.splitlines() if x.startswith(f"{shard}:"))
    # the record and field once (the line said `record 3, field 'text': record 3 field ...`)
    assert line.startswith(f"{shard}: record 3 field 'text': checksum mismatch")
    assert line.count("record 3") == 1
    assert "1 corruption in 1 of" in out_text  # not "1 corruptions"


def test_verify_names_a_broken_shard_once(tmp_path, capsys):
    """A shard that does not map printed its path twice ("x.rxs: shard: x.rxs: index...")."""
    corpus = _corpus(tmp_path / "in")
    out = tmp_path / "ds"
    assert _run("pack", corpus, "-o", out, "--unit-bytes", "2K", "-q", *PACK_FIELDS) == 0
    shard = sorted(out.glob("part-*.rxs"))[1]
    data = bytearray(shard.read_bytes())
    data[-200] ^= 0xFF  # inside the index, before the 64-byte trailer
    shard.write_bytes(bytes(data))
    assert _run("verify", out, "--workers", "1") == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if shard.name in line]
    assert len(lines) == 1 and lines[0].count(shard.name) == 1 and "rule R8" in lines[0]


# ---- the installed entry point -------------------------------------------------------


def test_installed_entry_point_runs(tmp_path):
    corpus = _corpus(tmp_path / "in", num_files=1)
    done = subprocess.run(
        [str(ROXXEL), "pack", str(corpus), "-o", str(tmp_path / "ds"), *PACK_FIELDS],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    info = subprocess.run(
        [str(ROXXEL), "info", str(tmp_path / "ds"), "--json"], capture_output=True, text=True
    )
    assert info.returncode == 0 and json.loads(info.stdout)["num_records"] == 60
    bad = subprocess.run(
        [str(ROXXEL), "info", str(tmp_path / "nope")], capture_output=True, text=True
    )
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    usage = subprocess.run([str(ROXXEL), "pack"], capture_output=True, text=True)
    assert usage.returncode == 2 and "usage" in usage.stderr


# ---- plan ----------------------------------------------------------------------------

MIXTURE = """
seed = 3
batch_size = 4
[sources.a]
path = "a"
epochs = 1
[sources.b]
path = "b"
field = "tokens"
seq_len = 4
[[phases]]
weights = {a = 1, b = 1}
end_step = 10
[[phases]]
weights = {a = 0, b = 1}
"""


def test_plan_prints_the_mixture_per_phase(tmp_path, capsys):
    corpus = _corpus(tmp_path / "in", num_files=1)
    for name in ("a", "b"):
        assert _run("pack", corpus, "-o", tmp_path / name, "-q", *PACK_FIELDS) == 0
    (tmp_path / "mix.toml").write_text(MIXTURE)
    assert _run("plan", tmp_path / "mix.toml", "--steps", "20") == 0
    report = capsys.readouterr().out
    assert "phase 0" in report and "phase 1" in report and "total:" in report
    (tmp_path / "bad.toml").write_text(MIXTURE.replace("seq_len = 4", "seq_len = 4\nwidth = 3"))
    assert _run("plan", tmp_path / "bad.toml", "--steps", "20") == 1
    assert "unknown keys ['width']" in capsys.readouterr().err


def test_plan_plot_needs_matplotlib_or_draws(tmp_path, capsys):
    corpus = _corpus(tmp_path / "in", num_files=1)
    for name in ("a", "b"):
        assert _run("pack", corpus, "-o", tmp_path / name, "-q", *PACK_FIELDS) == 0
    (tmp_path / "mix.toml").write_text(MIXTURE)
    rc = _run("plan", tmp_path / "mix.toml", "--steps", "20", "--plot", tmp_path / "s.png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert rc == 1 and "roxxel[plot]" in capsys.readouterr().err
    else:
        assert rc == 0 and (tmp_path / "s.png").exists()


def test_cat_prints_bytes_and_bfloat16(tmp_path, capsys):
    schema = {"blob": "bytes", "w": "bfloat16[2]"}
    with roxxel.DatasetWriter(tmp_path / "ds", schema) as writer:
        writer.write({"blob": b"\x00\xffab", "w": np.array([1.5, -2.0], np.float32)})
    assert _run("cat", tmp_path / "ds", "0", "--json") == 0
    assert json.loads(capsys.readouterr().out) == {"index": 0, "blob": "AP9hYg==", "w": [1.5, -2.0]}
    assert _run("cat", tmp_path / "ds", "0") == 0
    assert "bytes[4] b'\\x00\\xffab'" in capsys.readouterr().out


# ---- issue 13 item 10: polish --------------------------------------------------------


def test_issue13_item10_cat_into_a_closed_pipe_exits_quietly(tmp_path):
    """``roxxel cat ... | head -1``: no "[Errno 32] Broken pipe", no traceback."""
    with roxxel.DatasetWriter(tmp_path / "ds", {"text": "str"}) as writer:
        for i in range(2000):
            writer.write({"text": f"line {i} " + "x" * 100})
    indices = [str(i) for i in range(2000)]  # ~250 KB of output: more than a pipe holds
    proc = subprocess.Popen(
        [str(ROXXEL), "cat", str(tmp_path / "ds"), *indices],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline() == b"record 0\n"
    proc.stdout.close()  # what head does after its first line
    err = proc.stderr.read().decode()
    assert proc.wait() in (0, 141)
    assert err == "", err


class _Terminal:
    """A stderr that says it is a terminal, so the pack progress bar draws."""

    def __init__(self) -> None:
        self.text = []

    def write(self, text: str) -> int:
        self.text.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True


def test_issue13_item10_pack_progress_bar_shows_integer_record_counts(tmp_path, monkeypatch):
    folder = tmp_path / "in"
    folder.mkdir()
    for f in range(2):  # 10000 records per unit: tqdm's default postfix prints 1e+4, 2e+4
        lines = [json.dumps({"x": f * 10000 + i}) for i in range(10000)]
        (folder / f"part-{f}.jsonl").write_text("\n".join(lines) + "\n")
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    argv = [folder, "-o", tmp_path / "ds", "--field", "x:int64", "--workers", "1"]
    assert _run("pack", *argv) == 0
    drawn = "".join(terminal.text)
    assert "records=20000" in drawn or "records=20.0k" in drawn, drawn
    assert "e+" not in drawn, drawn


def test_issue13_item10_plan_plot_without_matplotlib_fails_before_the_report(
    tmp_path, capsys, monkeypatch
):
    corpus = _corpus(tmp_path / "in", num_files=1)
    for name in ("a", "b"):
        assert _run("pack", corpus, "-o", tmp_path / name, "-q", *PACK_FIELDS) == 0
    (tmp_path / "mix.toml").write_text(MIXTURE)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    rc = _run("plan", tmp_path / "mix.toml", "--steps", "20", "--plot", tmp_path / "s.png")
    out, err = capsys.readouterr()
    assert rc == 1 and out == ""
    assert "pip install 'roxxel[plot]'" in err and err.count("\n") == 1
    assert not (tmp_path / "s.png").exists()


def test_issue15_cat_of_an_empty_dataset_says_it_is_empty(tmp_path, capsys):
    """It said "expected -0 <= INDEX < 0"."""
    roxxel.DatasetWriter(tmp_path / "ds", {"x": "int64"}).close()
    assert main(["cat", str(tmp_path / "ds"), "0"]) == 1
    assert "index 0 (expected none: it is empty)" in capsys.readouterr().err


# ---- user sweep: schema inference places, -o a file, --input-field where it names nothing ----


def test_an_ambiguous_field_names_the_file_and_line_it_shows_in(tmp_path, capsys):
    """`schema inference: field 'x' is ambiguous (...)` named neither file nor line, though
    every other refusal of the pack's input does."""
    path = tmp_path / "a.jsonl"
    path.write_text('{"x": 1, "s": "a"}\n{"x": 2, "s": "b"}\n{"x": "three", "s": "c"}\n')
    assert _run("pack", str(path), "-o", str(tmp_path / "ds"), "-q") == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"{path}:3: schema inference: field 'x' is ambiguous (mixed kinds" in err
    assert err.endswith("e.g. --field x:int64 --field s:str)"), err
    nulls = tmp_path / "n.jsonl"
    nulls.write_text('{"s": "a", "u": "x"}\n{"s": "b", "u": null}\n')
    assert _run("pack", str(nulls), "-o", str(tmp_path / "ds"), "-q") == 1
    err = capsys.readouterr().err.strip()
    assert f"{nulls}:2: schema inference: field 'u' is null (expected a value" in err, err
    assert "--field s:str" in err and "--field u:" not in err and "--map" in err


@pytest.mark.parametrize("under", [False, True])
def test_pack_into_a_file_is_refused_up_front_naming_o(tmp_path, capsys, under):
    """`-o afile` (a file) said `[Errno 20] Not a directory: 'afile/.roxxel-pack'` after
    planning the pack; `roxxel pull` words the same case `DIR: 'x' is not a folder (...)`."""
    corpus = _corpus(tmp_path / "in", num_files=1, num_lines=3)
    afile = tmp_path / "afile"
    afile.write_text("x\n")
    out = afile / "sub" if under else afile
    # --input-field x alone would be refused (exit 2) once the inputs are read: -o is first
    assert _run("pack", corpus, "-o", out, "-q", "--input-field", "x") == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Errno" not in err, err
    assert err.startswith(f"roxxel pack: error: -o: {str(out)!r} is not a folder"), err
    assert "expected a local folder to pack into, or a URL)" in err
    assert afile.read_text() == "x\n"


def test_input_field_on_inputs_without_a_single_field_is_a_usage_error(tmp_path, capsys):
    """`--input-field foo` on a JSONL input was silently ignored: it names the one field of
    text, text-file, npy and megatron records (and the image field of an image pack)."""
    corpus = _corpus(tmp_path / "in", num_files=1, num_lines=3)
    out = tmp_path / "ds"
    assert _run("pack", corpus, "-o", out, "-q", "--input-field", "foo") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "--input-field foo" in err and "jsonl" in err and "text, text-file, npy" in err
    assert not out.exists()
    (tmp_path / "in" / "b.txt").write_text("one\ntwo\n")
    assert _run("pack", tmp_path / "in" / "b.txt", "-o", out, "-q", "--input-field", "foo") == 0
    assert roxxel.open_dataset(out)[1] == {"foo": "two"}


def test_merge_into_a_file_is_refused_naming_o(tmp_path, capsys):
    """`roxxel merge PART -o afile` said `[Errno 20] Not a directory: 'afile/.roxxel-pack'`,
    as `pack -o afile` did."""
    corpus = _corpus(tmp_path / "in", num_files=2, num_lines=3)
    part = tmp_path / "part"
    argv = ["pack", corpus, "-o", part, "-q", *PACK_FIELDS, "--unit-bytes", "1"]
    assert _run(*argv, "--num-tasks", "2", "--task-index", "0") == 0
    assert _run(*argv, "--num-tasks", "2", "--task-index", "1") == 0
    afile = tmp_path / "afile"
    afile.write_text("x\n")
    assert _run("merge", part, "-o", afile, "-q") == 1
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"roxxel merge: error: -o: {str(afile)!r} is not a folder (expected a local folder to merge into)"
    )
    assert afile.read_text() == "x\n"
    assert _run("merge", part, "-o", tmp_path / "ds", "-q") == 0


@pytest.mark.parametrize(
    ("line", "said"),
    [('{"url": "ab"}', "string"), ('{"url": ["a", "b"]}', "string")],
)
def test_a_value_of_the_wrong_kind_for_its_field_is_named_in_words(tmp_path, capsys, line, said):
    """`--field url:int64` over string values said `got <U2 values`: numpy's dtype code."""
    path = tmp_path / "in.jsonl"
    path.write_text(line + "\n")
    assert _run("pack", path, "-o", tmp_path / "out", "-q", "--field", "url:int64") == 1
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"in.jsonl:1: field 'url' got {said} values (expected int64)"), err
