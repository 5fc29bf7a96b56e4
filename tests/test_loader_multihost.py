"""The real Loader on real multi-host jobs: 2 x 4 and 4 x 2 local processes x CPU devices.

Each process runs tests/loader_multihost_worker.py: the Loader over token windows with a
mesh sharding, each global batch gathered to every process. Here we check that the global
batches equal a single-process numpy run of the same configuration, and that every process
read exactly the windows of the rows its devices hold, once each, and nothing else.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import roxxel
from roxxel.loader.loader import Loader
from tests import loader_multihost_worker as worker
from tests.cluster import run_group

WORKER = Path(__file__).with_name("loader_multihost_worker.py")
CLUSTERS = [(2, 4), (4, 2)]  # (processes, CPU devices each): 8 devices either way


def _write_corpus(path: Path) -> None:
    schema = roxxel.Schema.parse({"tokens": "int32[]"})
    rng = np.random.default_rng(2)
    with roxxel.DatasetWriter(path, schema, shard_bytes=2000) as writer:
        for _ in range(200):
            writer.write({"tokens": rng.integers(0, 30_000, rng.integers(0, 40)).astype(np.int32)})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("corpus")
    _write_corpus(data_dir)
    return data_dir


@pytest.fixture(scope="module", params=CLUSTERS, ids=lambda c: f"{c[0]}proc-x{c[1]}dev")
def run(request, corpus, tmp_path_factory):
    num_processes, local_devices = request.param
    data_dir, out_dir = corpus, tmp_path_factory.mktemp("out")
    run_group(
        WORKER, num_processes, local_devices, out_dir, lambda _: [str(data_dir), str(out_dir)]
    )
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
