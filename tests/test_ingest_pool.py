"""The pack's process pool: fork when safe, units shared through one counter, JSON reports,
workers' errors surfaced, an early exit leaves no process behind (a dead worker: see
test_ingest_pack.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from roxxel.cli import main
from roxxel.errors import ConfigError, RoxxelError
from roxxel.ingest import parts
from roxxel.ingest import pool as ingest_pool
from roxxel.ingest.inputs import Input, cut_units
from roxxel.ingest.pack import PackConfig
from roxxel.ingest.pool import UnitPool, start_method
from roxxel.ingest.units import BadRecords, ReadOptions


def _corpus(path, n=300):
    rng = np.random.default_rng(0)
    rows = ({"tokens": rng.integers(0, 1000, rng.integers(1, 30)).tolist()} for _ in range(n))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _files(root):
    return {p.name: p.read_bytes() for p in sorted(root.glob("*.rxs"))}


def test_fork_is_chosen_only_without_other_threads():
    code = "from roxxel.ingest.pool import start_method; print(start_method())"
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert fresh.stdout.strip() == ("fork" if sys.platform == "linux" else "forkserver")
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert start_method() == "forkserver"
    finally:
        stop.set()
        thread.join()


def test_a_forked_cli_pack_gives_the_bytes_of_one_process(tmp_path):
    src = _corpus(tmp_path / "in.jsonl")
    args = ["pack", str(src), "--field", "tokens:int32[]", "--unit-bytes", "2K", "--quiet"]
    assert main([*args, "-o", str(tmp_path / "one")]) == 0
    cmd = [sys.executable, "-m", "roxxel.cli", *args, "-o", str(tmp_path / "two"), "--workers", "2"]
    subprocess.run(cmd, check=True, timeout=120)
    assert _files(tmp_path / "one") == _files(tmp_path / "two") != {}


def test_every_start_method_packs_each_unit_once(tmp_path, monkeypatch):
    src = _corpus(tmp_path / "in.jsonl")
    units = cut_units([Input(str(src), "jsonl")], 2048)
    for method in ("forkserver", "spawn"):
        monkeypatch.setattr(ingest_pool, "start_method", lambda m=method: m)
        out = tmp_path / method
        (out / ".roxxel-pack").mkdir(parents=True)  # what prepare_output makes
        config = PackConfig(str(out), {"tokens": "int32[]"}, "f" * 32, ReadOptions())
        with UnitPool(config, units, 3) as pool:
            results = list(pool.results())
        assert sorted(r.unit for r in results) == list(range(len(units))) and len(units) > 3
        assert sum(r.num_records for r in results) == 300
        assert all(isinstance(r.bad, BadRecords) for r in results)


# A --map that does `act` in a worker process; the main process waits (up to 30 s) until a
# worker has started a unit, so that it cannot pack every unit itself first.
WORKER_ONLY = """
import multiprocessing, os, time

def fn(record):
    if multiprocessing.parent_process() is not None:
        open({mark!r}, "w").close()
        {act}
    for _ in range(3000):
        if os.path.exists({mark!r}):
            break
        time.sleep(0.01)
    return record
"""


def test_a_workers_roxxel_error_keeps_its_class_and_message(tmp_path, capsys):
    src = _corpus(tmp_path / "in.jsonl")
    fails = tmp_path / "fails.py"
    fails.write_text(
        WORKER_ONLY.format(mark=str(tmp_path / "mark"), act="raise KeyError('only in a worker')")
    )
    out = tmp_path / "ds"
    args = ["pack", str(src), "-o", str(out), "--field", "tokens:int32[]", "--quiet"]
    code = main([*args, "--unit-bytes", "2K", "--workers", "2", "--map", f"{fails}:fn"])
    err = capsys.readouterr().err
    assert code == 1 and "raised KeyError: 'only in a worker'" in err and "in.jsonl:" in err
    assert not (out / "manifest.json").exists()


def test_an_unknown_start_method_is_refused(tmp_path, capsys):
    with pytest.raises(ConfigError, match="start method 'thread'"):
        UnitPool(PackConfig(str(tmp_path), {}, ""), [], 2, "thread")
    src = _corpus(tmp_path / "in.jsonl")
    code = main(["pack", str(src), "-o", str(tmp_path / "ds"), "--start-method", "thread"])
    assert code == 2 and "invalid choice: 'thread'" in capsys.readouterr().err


def test_errors_from_json_rebuild_roxxel_classes():
    err = ingest_pool._error_from_json({"error": "ConfigError", "message": "x.jsonl:3: bad"})
    assert type(err) is ConfigError and str(err) == "x.jsonl:3: bad"
    other = ingest_pool._error_from_json({"error": "MemoryError", "message": ""})
    assert type(other) is RoxxelError and "raised MemoryError" in str(other)


def test_leaving_the_pool_early_stops_and_joins_the_workers(tmp_path):
    src = _corpus(tmp_path / "in.jsonl", n=2000)
    units = cut_units([Input(str(src), "jsonl")], 1024)
    (tmp_path / ".roxxel-pack").mkdir()
    config = PackConfig(str(tmp_path), {"tokens": "int32[]"}, "f" * 32, ReadOptions())
    pool = UnitPool(config, units, 2)
    procs = list(pool.procs)
    with pool:
        next(iter(pool.results()))
    assert procs and not any(p.is_alive() for p in procs)


def test_a_pack_leaves_no_thread_behind(tmp_path):
    """No progress-bar monitor either: a second pack in this process may still fork."""
    src = _corpus(tmp_path / "in.jsonl")
    before = threading.active_count()
    assert main(["pack", str(src), "-o", str(tmp_path / "ds"), "--field", "tokens:int32[]"]) == 0
    assert threading.active_count() == before


# A --map whose first record in a worker process waits until the test opens the FIFO.
FIFO_GATE = """
import multiprocessing

_waited = []

def fn(record):
    if multiprocessing.parent_process() is not None and not _waited:
        _waited.append(1)
        with open({fifo!r}) as gate:
            gate.read()
    return record
"""


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_issue12_item1_workers_hold_the_output_lock_under_every_start_method(tmp_path, method):
    """A worker keeps the directory locked while it lives, whoever else let go of it."""
    src = _corpus(tmp_path / "in.jsonl")
    units = cut_units([Input(str(src), "jsonl")], 2048)
    fifo = tmp_path / "gate"
    os.mkfifo(fifo)
    (tmp_path / "gate.py").write_text(FIFO_GATE.format(fifo=str(fifo)))
    out = tmp_path / "ds"
    lock = parts.lock_output(out)
    lock.prepared()  # (prepare_output does this)
    config = PackConfig(
        str(out), {"tokens": "int32[]"}, "f" * 32, ReadOptions(), f"{tmp_path / 'gate.py'}:fn"
    )
    with UnitPool(config, units, 2, method, lock_fds=lock.fds) as pool:
        lock.release()  # the worker still holds it: it waits inside its first unit
        with pytest.raises(ConfigError, match="is being packed by pid"):
            parts.lock_output(out)
        with open(fifo, "w"):
            pass
        assert sorted(r.unit for r in pool.results()) == list(range(len(units)))
    parts.lock_output(out).release()  # every worker has ended: the directory is free


@pytest.mark.parametrize("guarded", [False, True])
def test_a_script_packing_at_its_top_level_is_told_to_guard_the_call(tmp_path, guarded):
    """Workers that start from a fresh interpreter (forkserver, as with JAX loaded) import
    the main script again: an unguarded `roxxel.pack` there packed again from inside the
    worker ("is being packed by pid N"), and the caller only read "a worker process died"."""
    _corpus(tmp_path / "c.jsonl")
    call = 'roxxel.pack("c.jsonl", "ds", workers=2, unit_bytes="2K", start_method="forkserver")'
    body = f'if __name__ == "__main__":\n    {call}\n' if guarded else call + "\n"
    (tmp_path / "script.py").write_text("import roxxel\n" + body)
    run = subprocess.run(
        [sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    if guarded:
        assert run.returncode == 0, run.stderr
        assert (tmp_path / "ds" / "manifest.json").exists()
        return
    assert run.returncode != 0
    assert 'if __name__ == "__main__":' in run.stderr.strip().splitlines()[-1]
    assert "is being packed by pid" not in run.stderr
    assert not (tmp_path / "ds" / "manifest.json").exists()


_INTERRUPTED_AT_START = """
import os, signal, sys, threading
from multiprocessing import forkserver
launch = forkserver.ForkServer.ensure_running
def interrupted(self):
    started = self._forkserver_pid is None
    launch(self)
    if started:  # Ctrl-C to the whole process group while the forkserver imports roxxel
        threading.Timer(float(os.environ["DELAY"]), os.killpg, (0, signal.SIGINT)).start()
forkserver.ForkServer.ensure_running = interrupted
from roxxel.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_while_workers_start_is_one_line(tmp_path):
    """Ctrl-C reached the forkserver while it imported roxxel, and workers still being
    unpickled after the main process had stopped: tracebacks (KeyboardInterrupt in
    forkserver.py; SemLock._rebuild FileNotFoundError) around "roxxel pack: interrupted"."""
    for name in ("a", "b", "c"):
        _corpus(tmp_path / f"{name}.jsonl", n=30_000)  # packs for longer than the delays
    argv = ["pack", "a.jsonl", "b.jsonl", "c.jsonl", "-o", "ds", "--workers", "3"]
    argv += ["--start-method", "forkserver", "--unit-bytes", "64K", "-q"]
    for delay in (0.05, 0.1, 0.15, 0.2):  # while it imports roxxel, while workers start
        _assert_one_line_interrupted(_INTERRUPTED_AT_START, argv, delay, tmp_path)


_INTERRUPTED_AS_POOL_STARTS = """
import os, signal, sys, threading
from multiprocessing.pool import Pool
start = Pool.__init__
def interrupted(self, *args, **kwargs):  # the workers start now
    threading.Timer(float(os.environ["DELAY"]), os.killpg, (0, signal.SIGINT)).start()
    start(self, *args, **kwargs)
Pool.__init__ = interrupted
from roxxel.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_during_a_verify_in_processes_is_one_line(tmp_path):
    """Ctrl-C broke `verify --workers 2`'s process pool: "Exception in thread Thread-1 ...
    InvalidStateError: CANCELLED" around "roxxel verify: interrupted"."""
    for name in ("a", "b", "c"):  # a verify of ~0.4 s once the pool starts: the last delay
        _corpus(tmp_path / f"{name}.jsonl", n=60_000)  # lands in it (30,000 ended first once)
    pack = ["pack", "a.jsonl", "b.jsonl", "c.jsonl", "-o", "ds", "--unit-bytes", "256K", "-q"]
    assert subprocess.run([sys.executable, "-m", "roxxel.cli", *pack], cwd=tmp_path).returncode == 0
    for delay in (0.0, 0.02, 0.05, 0.2):  # while the workers start, as they begin to verify
        argv = ["verify", "ds", "--workers", "2"]
        _assert_one_line_interrupted(_INTERRUPTED_AS_POOL_STARTS, argv, delay, tmp_path)


def _assert_one_line_interrupted(script: str, argv: list[str], delay: float, cwd) -> None:
    """Run the command through `script` in a session of its own (Ctrl-C as a terminal sends
    it: SIGINT to the process group, `delay` seconds in): exit 130, one line said."""
    run = subprocess.run(
        [sys.executable, "-c", script, *argv],
        env={**os.environ, "DELAY": str(delay)},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert run.returncode == 130, run.stderr
    assert run.stderr.strip() == f"roxxel {argv[0]}: interrupted", run.stderr
