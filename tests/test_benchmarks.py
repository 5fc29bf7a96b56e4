"""The benchmark harness's pieces: data generation, Megatron layout, tables, failure rows.

Nothing here times anything or touches the network; the peers' venvs are never created.
"""

from __future__ import annotations

import dataclasses
import doctest
import json
import struct
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import roxxel
from benchmarks import (
    blend,
    datagen,
    measure,
    megatron,
    pack,
    pack_paths,
    run,
    steptime,
    systems,
    table,
    targets,
    throttle,
    venvs,
)

SMALL = datagen.DataSpec("unit", lm_tokens=50_000, num_images=40, seed=3)


@pytest.mark.parametrize("module", [datagen, megatron, table, blend, targets, pack, throttle])
def test_doctests_of_benchmark_modules_pass(module):
    assert doctest.testmod(module).failed == 0


def test_generator_same_seed_gives_same_bytes():
    again = dataclasses.replace(SMALL)
    assert np.array_equal(datagen.lm_lengths(SMALL), datagen.lm_lengths(again))
    assert datagen.lm_tokens(SMALL, 0, SMALL.lm_tokens).tobytes() == (
        datagen.lm_tokens(again, 0, again.lm_tokens).tobytes()
    )
    a, b = datagen.images(SMALL, 0, 40), datagen.images(again, 0, 40)
    assert a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes()


def test_generator_other_seed_gives_other_bytes():
    other = dataclasses.replace(SMALL, seed=4)
    assert not np.array_equal(datagen.lm_tokens(SMALL, 0, 1000), datagen.lm_tokens(other, 0, 1000))
    assert not np.array_equal(datagen.images(SMALL, 0, 5)[0], datagen.images(other, 0, 5)[0])


def test_generator_bytes_do_not_depend_on_chunking():
    spec = dataclasses.replace(SMALL, lm_tokens=(1 << 20) + 5000)  # spans two token chunks
    whole = datagen.lm_tokens(spec, 0, spec.lm_tokens)
    parts = [
        datagen.lm_tokens(spec, s, min(spec.lm_tokens, s + 333_333))
        for s in range(0, spec.lm_tokens, 333_333)
    ]
    assert np.array_equal(whole, np.concatenate(parts))
    imgs = np.concatenate([datagen.images(SMALL, s, min(40, s + 7))[0] for s in range(0, 40, 7)])
    assert np.array_equal(imgs, datagen.images(SMALL, 0, 40)[0])


def test_documents_cover_the_corpus_in_order():
    docs = list(datagen.iter_documents(SMALL))
    lengths = datagen.lm_lengths(SMALL)
    assert [d.size for d in docs] == lengths.tolist()
    assert lengths.min() >= 1 and int(lengths.sum()) == SMALL.lm_tokens
    assert np.array_equal(np.concatenate(docs), datagen.lm_tokens(SMALL, 0, SMALL.lm_tokens))
    assert all(d.dtype == np.int32 and d.min() >= 0 and d.max() < SMALL.vocab for d in docs)


def test_windows_are_disjoint_slices_of_the_stream():
    wins = list(datagen.iter_windows(SMALL, seq_len=99))
    assert len(wins) == datagen.num_windows(SMALL, 99) == SMALL.lm_tokens // 100
    assert np.array_equal(wins[7], datagen.lm_tokens(SMALL, 700, 800))


def test_images_have_the_documented_shape_and_dtypes():
    img, lab = datagen.images(SMALL, 3, 9)
    assert img.shape == (6, 3, 64, 64) and img.dtype == np.uint8
    assert lab.shape == (6,) and lab.dtype == np.int64 and lab.min() >= 0 and lab.max() < 1000


def test_megatron_index_has_the_mmidx_v1_layout(tmp_path):
    docs = [np.arange(5, dtype=np.int32), np.arange(3, dtype=np.int32) + 7]
    assert megatron.write_indexed(tmp_path / "c", docs) == 8
    raw = (tmp_path / "c.idx").read_bytes()
    magic, version, code, n, ndoc = struct.unpack_from("<9sQBQQ", raw)
    assert (magic, version, code, n, ndoc) == (b"MMIDIDX\x00\x00", 1, 4, 2, 3)
    lengths = np.frombuffer(raw, np.int32, 2, 34)
    pointers = np.frombuffer(raw, np.int64, 2, 42)
    assert lengths.tolist() == [5, 3] and pointers.tolist() == [0, 20]
    assert len(raw) == 34 + 2 * 4 + 2 * 8 + 3 * 8
    reader = megatron.IndexedReader(tmp_path / "c")
    assert [reader[i].tolist() for i in range(len(reader))] == [d.tolist() for d in docs]


def test_megatron_reader_rejects_a_foreign_index(tmp_path):
    (tmp_path / "x.idx").write_bytes(b"NOTMAGIC!" + bytes(25))
    (tmp_path / "x.bin").write_bytes(bytes(4))
    with pytest.raises(ValueError, match="MMIDIDX"):
        megatron.IndexedReader(tmp_path / "x")


def _rows() -> list[table.Row]:
    return [
        table.Row("roxxel", "train_images", "Loader", 100.0, "batches/s", peak_rss_mib=80.0),
        table.Row("grain", "train_images", "defaults", 25.0, "batches/s", anon_mib=60.5),
        table.Row("roxxel", "resume", "step 1e8", 0.02, "s", higher_is_better=False),
        table.Row("hf-datasets", "resume", "step 1e8", 0.5, "s", higher_is_better=False),
        *table.failure_rows("mosaicml-streaming", ["train_images"], "install failed: boom | x"),
    ]


def test_table_shows_absolute_values_and_ratios_to_roxxel():
    text = table.render_sections(_rows())
    assert "| grain | defaults | 25.0 batches/s | 0.25x |  | 60 |" in text
    assert "| roxxel | Loader | 100 batches/s | 1.00x | 80 |" in text
    assert "| hf-datasets | step 1e8 | 0.5 s | 25.00x |" in text
    assert text.index("### Shuffled training batches: images") < text.index("### Time to first")


def test_failed_peer_is_a_row_with_its_error_never_dropped():
    text = table.render_sections(_rows())
    line = next(ln for ln in text.splitlines() if ln.startswith("| mosaicml-streaming"))
    assert "FAILED: install failed: boom / x" in line and "| — |" in line


def test_ratio_is_blank_without_a_roxxel_number():
    rows = [
        table.Row("grain", "startup", "", 1.0, "s"),
        *table.failure_rows("roxxel", ["startup"], "not available yet"),
    ]
    assert table.ratio(rows, rows[0]) == ""


def test_fmt_value_keeps_three_significant_digits():
    assert table.fmt_value(12345.6, "records/s") == "12,346 records/s"
    assert table.fmt_value(0.0123456, "s") == "0.0123 s"
    assert table.fmt_value(None, "s") == "—"


def test_report_has_machine_versions_and_tables():
    header = {"date": "2026-01-01 00:00 UTC", "machine": "2 cores, 24 GiB RAM, CPU X"}
    text = table.render_report(_rows(), header, {"grain: grain": "0.2.18"})
    assert text.startswith("# roxxel benchmarks: 2026-01-01 00:00 UTC")
    assert "- **machine**: 2 cores, 24 GiB RAM, CPU X" in text
    assert "- grain: grain: 0.2.18" in text and "### Time to first batch" in text


def test_rows_round_trip_through_json():
    for row in _rows():
        assert table.Row.from_json(json.loads(json.dumps(row.to_json()))) == row


def test_worker_output_becomes_rows_with_memory():
    metric = measure.metric("read_single", "ds[i]", 5.0, "records/s", notes="n")
    out = {
        "ok": True,
        "metrics": [metric],
        "versions": {"x": "1"},
        "memory": {"peak_rss_mib": 10.0, "peak_anon_mib": 2.0, "children_peak_rss_mib": 30.0},
    }
    rows, versions = systems.parse_output(
        "grain", "read_single", "noise\n" + json.dumps(out), "", 0
    )
    assert versions == {"x": "1"}
    assert rows == [
        table.Row(
            "grain",
            "read_single",
            "ds[i]",
            5.0,
            "records/s",
            True,
            "n; child processes' peak RSS 30 MiB",
            "",
            10.0,
            2.0,
        )
    ]


def test_worker_crash_and_reported_error_become_failure_rows():
    rows, _ = systems.parse_output("hf", "resume", "", "Traceback\nSegfault here\n", -11)
    assert rows[0].value is None and rows[0].error.startswith("exit -11:")
    assert "Segfault here" in rows[0].error
    failed = json.dumps({"ok": False, "metrics": [], "error": "ImportError: no grain"})
    rows, _ = systems.parse_output("grain", "resume", failed, "", 1)
    assert rows == table.failure_rows("grain", ["resume"], "ImportError: no grain")


def test_peer_that_failed_to_install_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(venvs, "VENV_ROOT", tmp_path)
    (tmp_path / "grain").mkdir()
    (tmp_path / "grain" / "install-error.txt").write_text("pip: No matching distribution\n")
    rows, versions = systems.run_one(systems.PEERS[0], "train_images", {}, 5, lambda _: None)
    assert versions == {}
    assert rows == table.failure_rows(
        "grain", ["train_images"], "install failed: pip: No matching distribution"
    )


def test_worker_main_reports_an_exception_as_json(monkeypatch, capsys):
    def boom(_params):
        raise RuntimeError("not available yet: roxxel.Mixture")

    monkeypatch.setattr(sys, "argv", ["w", "resume_mix", "{}"])
    assert measure.worker_main({"resume_mix": boom}, lambda: {"v": "1"}) == 1
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["ok"] is False and out["error"] == "not available yet: roxxel.Mixture"
    assert out["versions"] == {"v": "1"} and "peak_rss_mib" in out["memory"]


def test_resume_series_reports_seconds_per_step():
    calls = []
    got = measure.resume_series("resume", calls.append, [0, 10], lambda s: f"step {s}", 2)
    assert [m["variant"] for m in got] == ["step 0", "step 10"]
    assert all(m["unit"] == "s" and m["higher_is_better"] is False for m in got)
    assert calls == [0] + [0, 10] * 5


def test_readme_block_is_replaced_by_the_latest_tables(tmp_path, monkeypatch):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{run.MARK_START}\nold\n{run.MARK_END}\ntail\n")
    monkeypatch.setattr(run, "README", readme)
    header = {"date": "2026-01-01 00:00 UTC", "mode": "--quick", "machine": "m"}
    run.update_readme(_rows(), header, tmp_path / "results" / "2026-01-01.md")
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("tail\n") and "\nold\n" not in text
    assert "| grain | defaults | 25.0 batches/s | 0.25x |" in text


def test_quick_mode_runs_roxxel_and_baselines_only():
    args = run.parse_args(["--quick", "--peers"])
    # roxxel runs two workers: roxxel_worker.py, and train_worker.py for the fit workload
    assert [s.name for s in run.chosen_systems(args)] == ["roxxel", "roxxel", "megatron-memmap"]
    args = run.parse_args(["--peers", "--small", "--systems", "grain,roxxel"])
    assert [s.name for s in run.chosen_systems(args)] == ["roxxel", "roxxel", "grain"]
    assert args.spec == "small"


def test_every_peer_venv_is_pinned():
    for env in venvs.PEER_ENVS.values():
        pins = [a for step in env.steps for a in step if not a.startswith("-")]
        assert pins and all("==" in a for a in pins), env.name
    assert {s.venv for s in systems.PEERS} == set(venvs.PEER_ENVS)


def test_worker_scripts_exist_for_every_system():
    for system in (systems.ROXXEL, systems.BASELINE, *systems.PEERS):
        assert (Path(systems.WORKERS) / system.worker).is_file()


def test_roxxel_rows_compare_with_roxxels_first_row_of_the_workload():
    rows = [
        table.Row("roxxel", "resume", "step 0", 0.010, "s", higher_is_better=False),
        table.Row("roxxel", "resume", "step 1e8", 0.012, "s", higher_is_better=False),
        table.Row("grain", "resume", "step 1e8", 0.024, "s", higher_is_better=False),
    ]
    assert [table.ratio(rows, r) for r in rows] == ["1.00x", "1.20x", "2.00x"]


def test_blend_index_matches_the_greedy_rule_compiled_or_not(monkeypatch):
    weights = [0.5, 0.3, 0.15, 0.05]
    got = blend.build_blend_index(weights, 2000)
    monkeypatch.setattr(blend, "_compiled", lambda: None)
    slow = blend.build_blend_index(weights, 2000)
    assert np.array_equal(got[0], slow[0]) and np.array_equal(got[1], slow[1])
    counts = np.bincount(got[0], minlength=4)
    assert np.all(np.abs(counts - 2000 * np.array(weights)) <= 1)


def test_targets_are_met_missed_or_unknown():
    rows = [
        table.Row("roxxel", "resume", "step 0", 0.010, "s", higher_is_better=False),
        table.Row("roxxel", "resume", "step 1e6", 0.011, "s", higher_is_better=False),
        table.Row("roxxel", "resume", "step 1e9", 0.012, "s", higher_is_better=False),
        table.Row("roxxel", "resume", "step 1e12", 0.020, "s", higher_is_better=False),
        table.Row("roxxel", "train_tokens", "Loader, jax.Array out", 100.0, "batches/s"),
        table.Row("grain", "train_tokens", "defaults", 10.0, "batches/s"),
        table.Row("grain", "train_tokens", "2-core", 40.0, "batches/s"),
    ]
    text = targets.render_targets(rows)
    assert "| 3 | token windows vs grain (its best setting) | >= 3x | 2.50x | **missed** |" in text
    assert "within 1.5x of each other | <= 1.5x | 2.00x | **missed** |" in text
    assert "| 3 | token windows vs PyPI roxxel 0.9.14 stream | >= 1.5x | — | — |" in text


def test_device_script_runs_on_cpu_and_writes_its_table(tmp_path):
    import subprocess

    script = Path(systems.WORKERS).parent / "device" / "device_bench.py"
    cmd = [sys.executable, str(script), "--cpu-smoke", "--seconds", "0.01", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    table_md = (tmp_path / "device.md").read_text()
    assert "| h2d | pageable, fresh array per call |" in table_md
    assert "| step | loader-fed speed / device-resident speed |" in table_md
    assert json.loads((tmp_path / "device.json").read_text())["header"]["device"].startswith("cpu")


# ---- pack workloads (issue 5) --------------------------------------------------------------


@pytest.fixture
def pack_inputs(tmp_path, monkeypatch):
    monkeypatch.setattr(datagen, "DATA_ROOT", tmp_path / "data")
    return pack.ensure_inputs(SMALL)


def test_pack_inputs_hold_the_corpus_prefix_and_the_images(pack_inputs):
    docs = list(pack.iter_jsonl_tokens(pack_inputs.jsonl))
    want = list(datagen.iter_documents(SMALL, max_tokens=pack.pack_tokens(SMALL)))
    assert len(docs) == len(want) > 0
    assert all(
        np.array_equal(a, b) and a.dtype == np.int32 for a, b in zip(docs, want, strict=True)
    )
    assert pack_inputs.lm_payload_bytes == sum(d.nbytes for d in want)
    img, _ = datagen.images(SMALL, 0, SMALL.num_images)
    assert np.array_equal(np.load(pack_inputs.npy), img)
    assert pack_inputs.image_payload_bytes == img.nbytes


def test_pack_inputs_are_generated_once_per_spec(pack_inputs):
    before = pack_inputs.jsonl.stat().st_mtime_ns
    again = pack.ensure_inputs(SMALL)
    assert again == pack_inputs and again.jsonl.stat().st_mtime_ns == before


def test_pack_paths_inputs_hold_the_same_tokens(pack_inputs, monkeypatch):
    monkeypatch.setitem(datagen.SPECS, SMALL.name, SMALL)
    inputs = pack_paths._inputs(SMALL)
    want = np.concatenate(list(datagen.iter_documents(SMALL, max_tokens=pack.pack_tokens(SMALL))))
    megatron_bin, _, tokens = inputs["Megatron .bin/.idx"]
    assert np.array_equal(np.fromfile(megatron_bin, np.int32), want) and tokens == want.nbytes
    parquet, _, rows = next(v for k, v in inputs.items() if k.startswith("Parquet"))
    ids = pq.read_table(parquet).column("ids").combine_chunks()
    assert np.array_equal(ids.flatten().to_numpy(), want[: rows // 4]) and rows % 512 == 0
    metrics = pack_paths.pack_paths({"spec": SMALL.name, "repeats": 1})
    assert len(metrics) == 6 and all(m["value"] > 0 for m in metrics)
    assert metrics[0]["notes"].startswith("the block path: ")


@pytest.mark.parametrize("kind", ["lm", "images"])
def test_pack_cli_arguments_pack_every_record(pack_inputs, tmp_path, kind):
    out = tmp_path / "ds"
    pack.run_in_process(pack.cli_args(pack_inputs, kind, out, 1))
    ds = roxxel.open_dataset(out)
    if kind == "lm":
        docs = list(pack.iter_jsonl_tokens(pack_inputs.jsonl))
        assert len(ds) == len(docs) and np.array_equal(ds[len(ds) - 1]["tokens"], docs[-1])
        assert ds.num_elements("tokens") * 4 == pack_inputs.lm_payload_bytes
    else:
        img = np.load(pack_inputs.npy)
        assert len(ds) == len(img) and np.array_equal(ds[7]["image"], img[7])


def test_pack_rate_times_write_and_fsync_and_cleans_up(tmp_path):
    out = tmp_path / "out.bin"
    rate = pack.rate_of(lambda o: o.write_bytes(b"x" * 1000), out, 1000, {"repeats": 2})
    assert rate > 0 and not out.exists()


def test_pack_workloads_run_for_the_writers_and_baselines_not_hf():
    runs = {s.name for s in (systems.ROXXEL, systems.BASELINE, *systems.PEERS)
            if "pack_lm" in s.workloads and "pack_images" in s.workloads}  # fmt: skip
    assert runs == {"roxxel", "megatron-memmap", "grain", "roxxel 0.9.14", "mosaicml-streaming"}
    for s in (systems.ROXXEL, systems.BASELINE, *systems.PEERS):
        source = (Path(systems.WORKERS) / s.worker).read_text()
        assert ('"pack_lm"' in source) == (s.name in runs)


def test_pack_targets_compare_with_the_fastest_peer_and_the_speedup():
    mb = "MB/s"
    rows = [
        table.Row("roxxel", "pack_lm", pack.IN_PROCESS, 30.0, mb),
        table.Row("roxxel", "pack_lm", pack.IN_PROCESS_2, 36.0, mb),
        table.Row("roxxel", "pack_lm", "roxxel pack --workers 1 (a new CLI process)", 20.0, mb),
        table.Row("roxxel", "pack_lm", "roxxel pack --workers 2 (a new CLI process)", 38.0, mb),
        table.Row("grain", "pack_lm", "ArrayRecordWriter", 25.0, mb),
        table.Row("roxxel 0.9.14", "pack_lm", "Roxxel.write", 40.0, mb),
        table.Row("mosaicml-streaming", "pack_lm", "", None, "", error="boom"),
    ]
    text = targets.render_targets(rows)
    assert (
        "JSONL corpus, 1 worker, vs the fastest peer writer | >= 1x | 0.75x | **missed** |" in text
    )
    new_processes = "--workers 2 vs --workers 1 (2 cores), new CLI processes"
    assert f"JSONL corpus: {new_processes} | >= 1.8x | 1.90x | met |" in text
    assert (
        "JSONL corpus: --workers 2 vs --workers 1 (2 cores), in process | >= 1.8x | 1.20x |" in text
    )
    assert ".npy images, 1 worker, vs the fastest peer writer | >= 1x | — | — |" in text
    small = targets.render_targets(rows, "small")
    assert f"JSONL corpus: {new_processes} | >= 1.8x | 1.90x | — (judged at --full) |" in small
    assert "vs the fastest peer writer | >= 1x | 0.75x | **missed** |" in small


def test_steptime_doctests_pass():
    assert doctest.testmod(steptime).failed == 0


def test_window_rate_counts_the_saves_inside_the_window():
    times = [0.0, 5.0] + [5.0 + 0.1 * k + (0.5 if k >= 3 else 0.0) for k in range(1, 7)]
    assert steptime.window_rate(times, 1, 6) == pytest.approx(6 / 1.1)


def test_window_rate_rejects_a_window_past_the_timestamps():
    with pytest.raises(ValueError, match="does not fit"):
        steptime.window_rate([0.0, 1.0, 2.0], 1, 2)


def test_cost_per_save_is_zero_when_rates_are_equal_and_rejects_no_saves():
    assert steptime.cost_per_save(10.0, 10.0, 100, 2) == 0.0
    with pytest.raises(ValueError, match="saves"):
        steptime.cost_per_save(10.0, 9.0, 100, 0)


def test_paired_ratio_takes_the_median_of_round_ratios_and_rejects_unpaired():
    assert steptime.paired_ratio([1.0, 2.0, 30.0], [1.0, 1.0, 1.0]) == 2.0
    with pytest.raises(ValueError, match="pairs"):
        steptime.paired_ratio([1.0], [1.0, 2.0])


def test_train_checkpoint_is_a_roxxel_workload_with_an_issue_6_target():
    assert "train_checkpoint" in systems.ROXXEL_FIT.workloads
    assert systems.ROXXEL_FIT.name == "roxxel" and systems.ROXXEL_FIT.venv is None
    assert (systems.WORKERS / systems.ROXXEL_FIT.worker).exists()
    rows = [
        table.Row("roxxel", "train_checkpoint", "fit, no checkpoint (step time)", 10.0, "steps/s"),
        table.Row(
            "roxxel", "train_checkpoint", "fit, Orbax checkpoint every 50 steps", 9.6, "steps/s"
        ),
    ]
    assert "| 6 | fit with an Orbax checkpoint every 50 steps vs none" in (
        targets.render_targets(rows)
    )
    assert "| >= 0.95x | 0.96x | met |" in targets.render_targets(rows)
