"""The real Loader on real multi-host jobs: 2 x 4 and 4 x 2 local processes x CPU devices.

Each process runs tests/loader_multihost_worker.py: the Loader over token windows with a
mesh sharding, each global batch gathered to every process. Here we check that the global
batches equal a single-process numpy run of the same configuration, and that every process
read exactly the windows of the rows its devices hold, once each, and nothing else.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import roxxel
from roxxel.loader import Loader

WORKER = Path(__file__).with_name("loader_multihost_worker.py")
REPO = WORKER.parent.parent
CLUSTERS = [(2, 4), (4, 2)]  # (processes, CPU devices each): 8 devices either way
DEADLINE_S = 90  # the whole group on 2 shared cores; a healthy run takes ~10 s

sys.path.insert(0, str(WORKER.parent))
import loader_multihost_worker as worker  # noqa: E402


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _write_corpus(path: Path) -> None:
    schema = roxxel.Schema.parse({"tokens": "int32[]"})
    rng = np.random.default_rng(2)
    with roxxel.DatasetWriter(path, schema, shard_bytes=2000) as writer:
        for _ in range(200):
            writer.write({"tokens": rng.integers(0, 30_000, rng.integers(0, 40)).astype(np.int32)})


def _run_workers(data_dir: Path, out_dir: Path, num_processes: int, local_devices: int) -> None:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={local_devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(REPO)) if p)
    port, procs, logs = _free_port(), [], []
    try:
        for pid in range(num_processes):
            log = open(out_dir / f"worker{pid}.log", "w")  # noqa: SIM115 (closed in finally)
            logs.append(log)
            argv = [sys.executable, str(WORKER), str(port), str(num_processes), str(pid)]
            argv += [str(data_dir), str(out_dir)]
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
        codes = _wait_all(procs)
    finally:
        for proc in procs:  # ours, by handle: a hung group never outlives the test
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    if codes != [0] * num_processes:
        logs_text = "\n".join(
            (out_dir / f"worker{i}.log").read_text()[-3000:] for i in range(num_processes)
        )
        pytest.fail(f"workers exited with {codes} (None: still running, so killed):\n{logs_text}")


def _wait_all(procs: list[subprocess.Popen]) -> list[int | None]:
    """Exit codes once all exit, as soon as one fails (its peers would block), or at the
    deadline (None for a worker still running)."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        for proc in procs:
            try:
                proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                continue
            if proc.returncode != 0:
                return [p.poll() for p in procs]
    return [p.poll() for p in procs]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("corpus")
    _write_corpus(data_dir)
    return data_dir


@pytest.fixture(scope="module", params=CLUSTERS, ids=lambda c: f"{c[0]}proc-x{c[1]}dev")
def run(request, corpus, tmp_path_factory):
    num_processes, local_devices = request.param
    data_dir, out_dir = corpus, tmp_path_factory.mktemp("out")
    _run_workers(data_dir, out_dir, num_processes, local_devices)
    reports = [dict(np.load(out_dir / f"{pid}.npz")) for pid in range(num_processes)]
    loader = Loader(
        worker.windows(str(data_dir)),
        worker.BATCH,
        seed=worker.SEED,
        start_step=worker.START_STEP,
        config=worker.CONFIG,
    )
    with loader:
        reference = [next(loader) for _ in range(worker.NUM_STEPS)]
    return reports, reference


def _rows_of(layout: str, process: int, num_processes: int) -> np.ndarray:
    if layout == "tp_across":
        return np.arange(worker.BATCH)
    per_process = worker.BATCH // num_processes
    return np.arange(process * per_process, (process + 1) * per_process)


@pytest.mark.parametrize("layout", worker.LAYOUTS)
def test_global_batches_equal_the_single_process_reference(run, layout):
    reports, reference = run
    for report in reports:
        for step, want in enumerate(reference):
            for name, value in want.items():
                np.testing.assert_array_equal(
                    report[f"{layout}/{step}/{name}"], value, err_msg=f"{layout} {name}"
                )


@pytest.mark.parametrize("layout", worker.LAYOUTS)
def test_each_process_reads_only_the_windows_of_its_rows(run, layout):
    reports, reference = run
    for pid, report in enumerate(reports):
        reads = report[f"{layout}/reads"]
        for step, want in enumerate(reference):
            rows = _rows_of(layout, pid, len(reports))
            np.testing.assert_array_equal(reads[step], want["record"][rows])
