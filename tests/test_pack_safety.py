"""Nothing lost under concurrent, orphaned or multi-task packs (issue 12 items 1, 2, 3, 21 and
the overwrite and disk-full items): the output directory's lock, workers that die with their
parent, names read from pack state checked before any I/O, directory fsyncs, overwrites that
remove only what roxxel wrote.

The concurrency tests run real processes. Many trials run inside one fresh interpreter
(`_driver`, started with ``python -c``), which forks a pack per trial: no import per process,
and no thread of this test process is copied by a fork.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import roxxel
from roxxel.cli import main
from roxxel.format import atomic
from roxxel.ingest import parts

REPO = Path(__file__).resolve().parents[1]
FIELDS = ["--field", "id:int64", "--field", "tokens:int32[]"]

# A --map function for the tests: with ROXXEL_TEST_TELL_FD, record number ROXXEL_TEST_AT
# (default 1) of each process (of ROXXEL_TEST_TELL_ROLE, "main" or "worker", if set) writes
# "ROLE PID" there; then, with ROXXEL_TEST_WAIT_FD, it blocks until a byte (or EOF) arrives.
HARNESS = """
import multiprocessing, os

_seen = []

def fn(record):
    _seen.append(1)
    if len(_seen) == int(os.environ.get("ROXXEL_TEST_AT", "1")) and os.environ.get(
        "ROXXEL_TEST_TELL_FD"
    ):
        role = "main" if multiprocessing.parent_process() is None else "worker"
        if os.environ.get("ROXXEL_TEST_TELL_ROLE", role) == role:
            os.write(int(os.environ["ROXXEL_TEST_TELL_FD"]), f"{role} {os.getpid()}\\n".encode())
            if os.environ.get("ROXXEL_TEST_WAIT_FD"):
                os.read(int(os.environ["ROXXEL_TEST_WAIT_FD"]), 1)
    return record
"""


def _corpus(path: Path, n: int = 300, first_id: int = 0) -> Path:
    lines = (json.dumps({"id": first_id + i, "tokens": list(range(i % 23))}) for i in range(n))
    path.write_text("\n".join(lines) + "\n")
    return path


def _harness(tmp_path: Path) -> str:
    path = tmp_path / "harness.py"
    path.write_text(HARNESS)
    return f"{path}:fn"


def _pack_argv(src: Path, out: Path, harness: str, *extra: str) -> list[str]:
    """Units of 1 KiB (about 20 records); compressed, so each record goes to the unit's temp
    shard as it comes: a unit has its temp file open from its first record to its end."""
    return ["pack", str(src), "-o", str(out), "--map", harness, "--unit-bytes", "1K",
            "--compress", "tokens=zstd", "-q", *FIELDS, *extra]  # fmt: skip


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.glob("*.rxs"))}


def _read_line(fd: int, timeout: float = 60.0) -> str:
    """One line from a pipe (the harness's report), or '' at EOF."""
    data = b""
    while not data.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], timeout)
        assert ready, "no report from the pack within the time limit"
        chunk = os.read(fd, 1)
        if not chunk:
            return ""
        data += chunk
    return data.decode().strip()


def _wait_gone(pid: int, timeout: float = 60.0) -> None:
    """Wait until process ``pid`` (not necessarily a child) has exited."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
        assert ready, f"process {pid} still runs"
    finally:
        os.close(fd)


def _roxxel(*argv: str, env: dict[str, str] | None = None, fds: tuple[int, ...] = ()):
    return subprocess.Popen(
        [sys.executable, "-m", "roxxel.cli", *argv],
        env={**os.environ, **(env or {})},
        pass_fds=fds,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


def _run_driver(*args: object) -> dict:
    code = "import sys; from tests.test_pack_safety import _driver; _driver(sys.argv[1:])"
    done = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- the driver: many trials in one fresh interpreter --------------------------------------


def _driver(argv: list[str]) -> None:
    mode, root, num_trials = argv[0], Path(argv[1]), int(argv[2])
    trials = {"kill_rerun": _kill_rerun_trial, "tasks": _tasks_trial}[mode]
    print(json.dumps({"failures": [f for t in range(num_trials) if (f := trials(root, t))]}))


def _fork_main(argv: list[str], env: dict[str, str], log: Path, gate: int | None = None) -> int:
    """Fork a process that runs ``roxxel`` (after a byte on ``gate``, if given)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.environ.update(env)
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.dup2(fd, 2)
            if gate is not None:
                os.read(gate, 1)
            code = main(argv)
        finally:
            os._exit(code)
    return pid


def _exit_code(pid: int) -> int:
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _kill_rerun_trial(root: Path, trial: int) -> str | None:
    """kill -9 a --workers 2 pack once a worker is inside a unit; rerun at once."""
    src, harness = root / "in.jsonl", f"{root / 'harness.py'}:fn"
    out, log = root / f"k{trial}", root / f"k{trial}.log"
    argv = _pack_argv(src, out, harness, "--workers", "2")
    tell_r, tell_w = os.pipe()
    env = {"ROXXEL_TEST_TELL_FD": str(tell_w), "ROXXEL_TEST_TELL_ROLE": "worker",
           "ROXXEL_TEST_AT": str(8 + trial % 5)}  # fmt: skip
    pid = _fork_main(argv, env, log)
    os.close(tell_w)
    _read_line(tell_r)  # a worker packs a unit now (or, at EOF, the pack is over)
    os.kill(pid, signal.SIGKILL)
    _exit_code(pid)
    os.close(tell_r)
    rerun = _exit_code(_fork_main(argv, {"ROXXEL_TEST_TELL_FD": ""}, log))
    if rerun != 0:
        return f"trial {trial}: rerun exit {rerun}: {log.read_text()[-500:]}"
    try:
        roxxel.open_dataset(out).verify()
    except roxxel.RoxxelError as e:
        return f"trial {trial}: {e}"
    if _files(out) != _files(root / "reference"):
        return f"trial {trial}: bytes differ from an uninterrupted pack"
    return None


def _tasks_trial(root: Path, trial: int) -> str | None:
    """Four tasks released at the same moment into one new directory (odd trials: with
    --overwrite, into a directory holding another dataset and a user's file), then
    --finalize."""
    src, out, log = root / "in.jsonl", root / f"s{trial}", root / f"s{trial}.log"
    argv = ["pack", str(src), "-o", str(out), "--unit-bytes", "1K", "-q", *FIELDS]
    if trial % 2:
        with roxxel.DatasetWriter(out, {"x": "int64"}, shard_bytes=8) as writer:
            for i in range(3):
                writer.write({"x": i})
        (out / "mine.rxs").write_text("a user's file")
        argv.append("--overwrite")
    gate_r, gate_w = os.pipe()
    tasks = ["--num-tasks", "4", "--task-index"]
    pids = [_fork_main([*argv, *tasks, str(i)], {}, log, gate_r) for i in range(4)]
    os.write(gate_w, b"4444")
    codes = [_exit_code(pid) for pid in pids]
    os.close(gate_r)
    os.close(gate_w)
    if codes != [0, 0, 0, 0]:
        return f"trial {trial}: task exit codes {codes}: {log.read_text()[-500:]}"
    final = _exit_code(_fork_main([*argv, "--num-tasks", "4", "--finalize"], {}, log))
    if final != 0:
        return f"trial {trial}: finalize exit {final}: {log.read_text()[-500:]}"
    same = (out / "manifest.json").read_bytes() == (root / "reference/manifest.json").read_bytes()
    mine = {"mine.rxs": b"a user's file"} if trial % 2 else {}
    if _files(out) != {**_files(root / "reference"), **mine} or not same:
        return f"trial {trial}: files differ from a one-task pack"
    return None


# ---- item 1: one pack per directory; orphans die; each process deletes its own files ------


def test_issue12_item1_stopped_orphan_worker_cannot_damage_a_rerun(tmp_path):
    src, out, harness = _corpus(tmp_path / "in.jsonl"), tmp_path / "ds", _harness(tmp_path)
    argv = _pack_argv(src, out, harness, "--workers", "2")
    tell_r, tell_w = os.pipe()
    wait_r, wait_w = os.pipe()
    env = {"ROXXEL_TEST_TELL_FD": str(tell_w), "ROXXEL_TEST_WAIT_FD": str(wait_r),
           "ROXXEL_TEST_AT": "12"}  # fmt: skip
    first = _roxxel(*argv, env=env, fds=(tell_w, wait_r))
    os.close(tell_w)
    os.close(wait_r)
    worker = 0
    while not worker:  # main and worker each report, then wait inside a unit
        role, pid = _read_line(tell_r).split()
        worker = int(pid) if role == "worker" else 0
    os.kill(worker, signal.SIGSTOP)
    first.kill()
    first.wait()
    rerun = subprocess.run(
        [sys.executable, "-m", "roxxel.cli", *argv], capture_output=True, text=True, cwd=REPO
    )
    assert rerun.returncode == 0, rerun.stderr
    with contextlib.suppress(ProcessLookupError):  # it died with its parent
        os.kill(worker, signal.SIGCONT)
    os.close(wait_w)  # EOF: a waiting harness goes on
    _wait_gone(worker)
    roxxel.open_dataset(out).verify()
    assert main(_pack_argv(src, tmp_path / "clean", harness)) == 0
    assert _files(out) == _files(tmp_path / "clean") != {}
    os.close(tell_r)


def test_issue12_item1_a_second_pack_into_a_busy_directory_fails_at_once(tmp_path, capsys):
    src, out, harness = _corpus(tmp_path / "a.jsonl"), tmp_path / "ds", _harness(tmp_path)
    other = _corpus(tmp_path / "b.jsonl", first_id=10_000)
    tell_r, tell_w = os.pipe()
    wait_r, wait_w = os.pipe()
    env = {"ROXXEL_TEST_TELL_FD": str(tell_w), "ROXXEL_TEST_WAIT_FD": str(wait_r)}
    first = _roxxel(*_pack_argv(src, out, harness), env=env, fds=(tell_w, wait_r))
    os.close(tell_w)
    os.close(wait_r)
    assert _read_line(tell_r) == f"main {first.pid}"  # inside its first unit, nothing finished
    for argv in (_pack_argv(other, out, harness), _pack_argv(src, out, harness),
                 _pack_argv(other, out, harness, "--overwrite")):  # fmt: skip
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert f"{out} is being packed by pid {first.pid}" in err and err.count("\n") == 1
    assert main(["merge", str(out), "-o", str(out)]) == 1
    assert f"being packed by pid {first.pid}" in capsys.readouterr().err
    os.close(wait_w)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    ids = [int(r["id"]) for r in roxxel.open_dataset(out)]
    assert ids == list(range(300))
    os.close(tell_r)


def test_issue12_item1_immediate_rerun_after_kill_9_of_two_workers_succeeds(tmp_path):
    _corpus(tmp_path / "in.jsonl", n=200)  # about 10 units
    harness = _harness(tmp_path)
    assert main(_pack_argv(tmp_path / "in.jsonl", tmp_path / "reference", harness)) == 0
    assert _run_driver("kill_rerun", tmp_path, 20) == {"failures": []}


def test_issue12_item1_a_failing_unit_deletes_only_its_own_files(tmp_path, monkeypatch):
    """A unit that fails removes the shards it published, never another process's files."""
    src, out = _corpus(tmp_path / "in.jsonl"), tmp_path / "ds"
    out.mkdir()
    planted = [out / ".part-000000-0005.rxs.999999.0123abcd.tmp", out / "part-000000-0009.rxs"]

    def fail_after_shards(*args, **kwargs):
        for path in planted:  # another process's files appear while this unit runs
            path.write_bytes(b"theirs")
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr("roxxel.ingest.pack.write_unit_marker", fail_after_shards)
    assert main(["pack", str(src), "-o", str(out), "-q", "--shard-bytes", "1K", *FIELDS]) == 1
    assert all(p.read_bytes() == b"theirs" for p in planted)
    assert not (out / "part-000000-0000.rxs").exists()  # its own shard: removed


# ---- item 2: tasks started together ------------------------------------------------------


def test_issue12_item2_four_tasks_started_together_always_succeed(tmp_path):
    src = _corpus(tmp_path / "in.jsonl")
    argv = ["pack", str(src), "-o", str(tmp_path / "reference"), "--unit-bytes", "1K", "-q"]
    assert main([*argv, *FIELDS]) == 0
    assert _run_driver("tasks", tmp_path, 10) == {"failures": []}


def test_issue12_item2_a_task_runs_once_and_finalize_waits_for_all(tmp_path, capsys):
    src, out, harness = _corpus(tmp_path / "in.jsonl"), tmp_path / "ds", _harness(tmp_path)
    tasks = ["--num-tasks", "2", "--task-index"]
    tell_r, tell_w = os.pipe()
    wait_r, wait_w = os.pipe()
    env = {"ROXXEL_TEST_TELL_FD": str(tell_w), "ROXXEL_TEST_WAIT_FD": str(wait_r)}
    first = _roxxel(*_pack_argv(src, out, harness, *tasks, "0"), env=env, fds=(tell_w, wait_r))
    os.close(tell_w)
    os.close(wait_r)
    assert _read_line(tell_r) == f"main {first.pid}"
    assert main(_pack_argv(src, out, harness, *tasks, "0")) == 1
    assert f"task 0 is being packed by pid {first.pid}" in capsys.readouterr().err
    assert main(_pack_argv(src, out, harness, *tasks, "1")) == 0  # the other task: at once
    assert main(_pack_argv(src, out, harness, "--num-tasks", "2", "--finalize")) == 1
    assert f"being packed by pid {first.pid}" in capsys.readouterr().err
    os.close(wait_w)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert main(_pack_argv(src, out, harness, "--num-tasks", "2", "--finalize")) == 0
    assert [int(r["id"]) for r in roxxel.open_dataset(out)] == list(range(300))
    os.close(tell_r)


# ---- item 3: names from pack state are checked before any I/O ----------------------------


def _two_tasks(tmp_path: Path) -> tuple[Path, Path]:
    src = _corpus(tmp_path / "in.jsonl")
    for i in range(2):
        argv = ["pack", str(src), "-o", str(tmp_path / "parts" / f"t{i}"), "--unit-bytes", "1K"]
        assert main([*argv, "-q", *FIELDS, "--num-tasks", "2", "--task-index", str(i)]) == 0
    return tmp_path / "parts" / "t0", tmp_path / "parts" / "t1"


def test_issue12_item3_merge_never_writes_outside_its_output(tmp_path, capsys):
    t0, t1 = _two_tasks(tmp_path)
    marker = t1 / ".roxxel-pack" / "unit-000001.json"
    doc = json.loads(marker.read_text())
    shard = t1 / doc["shards"][0]["name"]
    shard.rename(tmp_path / "parts" / "notes.txt")  # a valid shard, reached through ".."
    doc["shards"][0]["name"] = "../notes.txt"
    marker.write_text(json.dumps(doc))
    (tmp_path / "out").mkdir()
    victim = tmp_path / "out" / "notes.txt"
    victim.write_text("mine")
    assert main(["merge", str(t0), str(t1), "-o", str(tmp_path / "out" / "m")]) == 1
    assert "not packed or damaged (units 1" in capsys.readouterr().err
    assert victim.read_text() == "mine"
    assert not (tmp_path / "out" / "m" / ".roxxel-pack" / "plan.json").exists()
    assert not list((tmp_path / "out" / "m").glob("*.rxs"))


def test_issue12_item3_a_tampered_unit_count_is_refused_before_any_write(tmp_path, capsys,
                                                                         monkeypatch):  # fmt: skip
    t0, t1 = _two_tasks(tmp_path)
    for part in (t0, t1):
        plan = part / ".roxxel-pack" / "plan.json"
        plan.write_text(json.dumps({**json.loads(plan.read_text()), "num_units": 10**9}))
    calls = []
    real = parts.load_unit

    def counted(*args):
        calls.append(1)
        if len(calls) > 1000:
            raise AssertionError("load_unit called per planned unit, not per marker")
        return real(*args)

    monkeypatch.setattr(parts, "load_unit", counted)
    out = tmp_path / "m"
    assert main(["merge", str(t0), str(t1), "-o", str(out)]) == 1
    assert "not packed or damaged" in capsys.readouterr().err and len(calls) < 1000
    assert not (out / ".roxxel-pack" / "plan.json").exists()
    assert main(["pack", str(tmp_path / "in.jsonl"), "-o", str(t0), "--finalize", "-q",
                 "--unit-bytes", "1K", "--num-tasks", "2", *FIELDS]) == 1  # fmt: skip
    assert len(calls) < 2000


@pytest.mark.parametrize(
    "bad",
    [
        b'{"fingerprint": "x", "fingerprint": "y"}',
        b'{"fingerprint": NaN}',
        b"[]",
        b'{"fingerprint": "ab", "num_units": true, "schema": {}, "metadata": {}}',
    ],
)
def test_issue12_item3_a_malformed_plan_is_refused_by_merge(tmp_path, capsys, bad):
    t0, t1 = _two_tasks(tmp_path)
    (t0 / ".roxxel-pack" / "plan.json").write_bytes(bad)
    assert main(["merge", str(t0), str(t1), "-o", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err
    assert "plan.json" in err and err.count("\n") == 1
    assert not (tmp_path / "m").exists()


def test_issue12_item3_a_marker_of_another_unit_or_name_is_not_done(tmp_path):
    t0, _ = _two_tasks(tmp_path)
    plan = parts.read_plan(t0)
    assert parts.load_unit(t0, plan.fingerprint, 0) is not None
    marker = t0 / ".roxxel-pack" / "unit-000000.json"
    good = json.loads(marker.read_text())
    for doc in (
        {**good, "unit": 2},
        {**good, "shards": [{**good["shards"][0], "name": "part-000002-0000.rxs"}]},
        {**good, "shards": [{**good["shards"][0], "name": "/etc/passwd"}]},
        {**good, "shards": [{**good["shards"][0], "num_records": True}]},
    ):
        marker.write_text(json.dumps(doc))
        assert parts.load_unit(t0, plan.fingerprint, 0) is None


# ---- item 21: directory fsyncs -------------------------------------------------------------


def _record_fsyncs(monkeypatch) -> list[str]:
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


def test_issue12_item21_pack_state_renames_and_new_directories_are_fsynced(tmp_path,
                                                                           monkeypatch):  # fmt: skip
    src = _corpus(tmp_path / "in.jsonl")
    synced = _record_fsyncs(monkeypatch)
    out = tmp_path / "new" / "ds"
    assert main(["pack", str(src), "-o", str(out), "-q", "--unit-bytes", "1K", *FIELDS]) == 0
    state = str(out / ".roxxel-pack")
    assert str(tmp_path) in synced and str(tmp_path / "new") in synced  # new entries
    assert str(out) in synced  # shards, manifest, the state folder's entry
    num_markers = len(list((out / ".roxxel-pack").glob("unit-*.json")))
    assert synced.count(state) >= num_markers + 1 > 2  # each marker and plan.json


def test_issue12_item21_dataset_writer_fsyncs_a_new_directory_in_its_parent(tmp_path,
                                                                            monkeypatch):  # fmt: skip
    synced = _record_fsyncs(monkeypatch)
    with roxxel.DatasetWriter(tmp_path / "a" / "b", {"x": "int64"}) as writer:
        writer.write({"x": 1})
    assert str(tmp_path) in synced and str(tmp_path / "a") in synced


# ---- overwrite and disk full ---------------------------------------------------------------


def test_issue12_clear_errors_dataset_writer_overwrite_removes_old_listed_shards(tmp_path):
    out = tmp_path / "ds"
    with roxxel.DatasetWriter(out, {"x": "int64"}, shard_bytes=8) as writer:
        for i in range(5):
            writer.write({"x": i})
    (out / "notes.rxs").write_bytes(b"mine")  # not listed: not roxxel's to delete
    assert len(list(out.glob("shard-*.rxs"))) == 5
    with roxxel.DatasetWriter(out, {"x": "int64"}, shard_bytes=8, overwrite=True) as writer:
        writer.write({"x": 7})
    assert sorted(p.name for p in out.glob("*.rxs")) == ["notes.rxs", "shard-00000.rxs"]
    assert [int(r["x"]) for r in roxxel.open_dataset(out)] == [7]


def test_issue12_clear_errors_overwrite_of_a_broken_manifest_removes_no_shard(tmp_path):
    out = tmp_path / "ds"
    with roxxel.DatasetWriter(out, {"x": "int64"}, shard_bytes=8) as writer:
        for i in range(3):
            writer.write({"x": i})
    manifest = out / "manifest.json"
    manifest.write_text(manifest.read_text().replace("shard-00002.rxs", "../x.rxs"))  # M5
    with roxxel.DatasetWriter(out, {"x": "int64"}, overwrite=True) as writer:
        writer.write({"x": 7})
    assert len(list(out.glob("shard-*.rxs"))) == 3  # nothing it lists can be trusted


def test_issue12_clear_errors_pack_overwrite_deletes_only_what_roxxel_wrote(tmp_path):
    src, out = _corpus(tmp_path / "in.jsonl"), tmp_path / "ds"
    with roxxel.DatasetWriter(out, {"x": "int64"}, shard_bytes=8) as writer:
        for i in range(3):
            writer.write({"x": i})
    (out / "mine.rxs").write_bytes(b"a user's file")
    (out / "notes.txt").write_text("mine")
    assert main(["pack", str(src), "-o", str(out), "-q", "--overwrite", *FIELDS]) == 0
    assert not list(out.glob("shard-*.rxs"))
    assert (out / "mine.rxs").read_bytes() == b"a user's file"
    assert (out / "notes.txt").read_text() == "mine"
    assert len(roxxel.open_dataset(out)) == 300


def _disk_full_on(monkeypatch, suffix: str) -> None:
    real = os.fsync

    def fsync(fd: int) -> None:
        if suffix in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd)

    monkeypatch.setattr(atomic.os, "fsync", fsync)


def test_issue12_clear_errors_disk_full_names_the_file(tmp_path, monkeypatch, capsys):
    src = _corpus(tmp_path / "in.jsonl")
    _disk_full_on(monkeypatch, ".rxs.")
    assert main(["pack", str(src), "-o", str(tmp_path / "ds"), "-q", *FIELDS]) == 1
    err = capsys.readouterr().err
    assert "No space left on device" in err and "part-000000-0000.rxs" in err
    writer = roxxel.DatasetWriter(tmp_path / "w", {"x": "int64"})
    with pytest.raises(OSError, match="No space left") as caught, writer:
        writer.write({"x": 1})
    assert caught.value.filename == str(tmp_path / "w" / "shard-00000.rxs")


def test_issue12_item1_the_lock_names_the_holder_and_is_free_after_release(tmp_path):
    out = tmp_path / "ds"
    with parts.lock_output(out) as held:
        held.prepared()  # (prepare_output does this)
        with pytest.raises(roxxel.ConfigError, match=f"being packed by pid {os.getpid()}") as e:
            parts.lock_output(out)
        assert e.value.path == str(out) and held.fd >= 0
    taken = pytest.raises(roxxel.ConfigError, match="task 3 is being packed")
    with parts.lock_output(out, task=3) as three:
        three.prepared()
        with parts.lock_output(out, task=4) as four, taken:
            four.prepared()
            parts.lock_output(out, task=3)
    parts.lock_output(out).release()


# --- issue 15: -o naming a file, a dangling link or a link loop, as a path or a file:// URL --


def _bad_outputs(tmp_path: Path) -> dict[str, Path]:
    afile = tmp_path / "afile"
    afile.write_text("x\n")
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nothing-here")
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    return {"file": afile, "dangling": dangling, "loop": loop, "under-loop": loop / "sub"}


@pytest.mark.parametrize("kind", ["file", "dangling", "loop", "under-loop"])
@pytest.mark.parametrize("as_url", [False, True])
def test_issue15_pack_o_a_file_or_a_broken_link_is_one_line_naming_it(
    tmp_path, capsys, kind, as_url
):
    """`-o file:///afile` (an existing file), or `-o` a dangling link or a link loop (as a
    path or a file:// URL) said `[Errno 17] File exists` / `[Errno 40] Too many levels of
    symbolic links` / `[Errno 20] Not a directory` after planning the pack."""
    src = _corpus(tmp_path / "in.jsonl", n=20)
    out = _bad_outputs(tmp_path)[kind]
    given = f"file://{out}" if as_url else str(out)
    assert main(["pack", str(src), "-o", given, "-q", *FIELDS]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Errno" not in err, err
    assert err.startswith(f"roxxel pack: error: -o: {given!r}"), err
    assert ("link to nothing" if kind != "file" else "is not a folder") in err, err
    assert (tmp_path / "afile").read_text() == "x\n"
    assert not (tmp_path / "nothing-here").exists()


@pytest.mark.parametrize("kind", ["dangling", "loop", "under-loop"])
def test_issue15_merge_o_a_broken_link_is_one_line_naming_it(tmp_path, capsys, kind):
    src = _corpus(tmp_path / "in.jsonl", n=20)
    part = tmp_path / "part"
    assert main(["pack", str(src), "-o", str(part), "-q", *FIELDS]) == 0
    out = _bad_outputs(tmp_path)[kind]
    assert main(["merge", str(part), "-o", str(out), "-q"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Errno" not in err, err
    assert err.startswith(f"roxxel merge: error: -o: {str(out)!r}"), err
    assert "link to nothing" in err and "expected a local folder to merge into" in err, err


def test_issue15_merge_o_a_url_is_refused_not_made_a_local_folder(tmp_path, capsys, monkeypatch):
    """`roxxel merge PART -o file:///x` merged into the relative folder `file:/x`."""
    src = _corpus(tmp_path / "in.jsonl", n=20)
    part = tmp_path / "part"
    assert main(["pack", str(src), "-o", str(part), "-q", *FIELDS]) == 0
    monkeypatch.chdir(tmp_path)
    assert main(["merge", str(part), "-o", f"file://{tmp_path}/m", "-q"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is a URL" in err, err
    assert not (tmp_path / "file:").exists() and not (tmp_path / "m").exists()


@pytest.mark.parametrize("shape", ["one-long-name", "long-path"])
def test_issue15_pack_o_a_path_too_long_is_one_short_line_naming_the_rule(tmp_path, capsys, shape):
    """`-o` a 300-character name (or a 6,000-character path) said `[Errno 36] File name too
    long: 'eeee…'`, echoing the whole path, without `-o` or the rule: the check's own look at
    whether the path was a link raised again."""
    src = _corpus(tmp_path / "in.jsonl", n=20)
    long = "e" * 300 if shape == "one-long-name" else "/".join(["e" * 200] * 30)
    out = tmp_path / long
    assert main(["pack", str(src), "-o", str(out), "-q", *FIELDS]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Errno" not in err and "Traceback" not in err, err
    assert err.startswith(f"roxxel pack: error: -o: {str(out)[:100] + '...'!r} "), err
    assert "cannot be looked at (File name too long, expected a local folder" in err, err
    assert len(err) < 400, err


def test_issue15_pack_o_a_path_that_cannot_be_looked_at_names_the_reason(
    tmp_path, capsys, monkeypatch
):
    """A folder that denies a look (EACCES) said `[Errno 13] Permission denied: ...`: the
    look at whether it was a link raised again. (Root ignores modes: the denial is faked.)"""
    src = _corpus(tmp_path / "in.jsonl", n=20)
    locked = tmp_path / "locked"
    locked.mkdir()
    out = locked / "ds"
    real_stat = Path.stat

    def stat(self, *, follow_symlinks=True):
        if str(self).startswith(str(locked)):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_stat(self, follow_symlinks=follow_symlinks)

    monkeypatch.setattr(Path, "stat", stat)
    assert main(["pack", str(src), "-o", str(out), "-q", *FIELDS]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Errno" not in err and "Traceback" not in err, err
    assert err.startswith(f"roxxel pack: error: -o: {str(out)!r} cannot be looked at"), err
    assert "(Permission denied, expected a local folder to pack into" in err, err
