"""Real multi-host runs of roxxel.loader.placement: 2 and 4 local processes joined by jax.distributed.

Each process runs tests/multihost_worker.py on its own CPU devices (gloo collectives). The
worker checks the assembled global batch against the single-process reference (its shards, a
gather to every process, a jitted sum across processes) and reports the rows it read; here we
check that every process read exactly the rows its devices hold and together they cover the
batch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cluster import run_group

WORKER = Path(__file__).with_name("multihost_worker.py")
CLUSTERS = [(2, 4), (4, 2)]  # (processes, CPU devices per process): 8 devices either way


def _run_cluster(num_processes: int, local_devices: int, tmp: Path) -> list[dict]:
    """Run the workers (each writes its report as JSON) and read their reports."""
    run_group(
        WORKER, num_processes, local_devices, tmp, lambda pid: [str(tmp / f"worker{pid}.json")]
    )
    return [json.loads((tmp / f"worker{i}.json").read_text()) for i in range(num_processes)]


@pytest.fixture(scope="module", params=CLUSTERS, ids=lambda c: f"{c[0]}proc-x{c[1]}dev")
def cluster(request, tmp_path_factory) -> tuple[int, int, list[dict]]:
    num_processes, local_devices = request.param
    tmp = tmp_path_factory.mktemp(f"cluster{num_processes}")
    return num_processes, local_devices, _run_cluster(num_processes, local_devices, tmp)


def _expected_rows(layout: str, process: int, num_processes: int, local_devices: int) -> list:
    batch = 2 * num_processes * local_devices  # two rows per device along the data axes
    if layout == "tp_across":
        return list(range(batch))
    if layout == "dp_strided":  # data shard k = i * num_processes + process
        shards = [i * num_processes + process for i in range(local_devices)]
        return sorted(row for k in shards for row in (2 * k, 2 * k + 1))
    per_process = batch // num_processes
    return list(range(process * per_process, (process + 1) * per_process))


LAYOUTS = ["dp", "dp_strided", "fsdp", "dp_tp", "seq", "tp_across"]


def test_every_process_joined_with_its_devices(cluster):
    num_processes, local_devices, reports = cluster
    assert [r["process_id"] for r in reports] == list(range(num_processes))
    assert {r["num_devices"] for r in reports} == {num_processes * local_devices}
    assert all(sorted(r["layouts"]) == sorted(LAYOUTS) for r in reports)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_global_batch_equals_the_single_process_reference(cluster, layout):
    _, _, reports = cluster
    for report in reports:
        result = report["layouts"][layout]
        assert result["local_ok"], f"process {report['process_id']}: a shard differs"
        assert result["gather_ok"], f"process {report['process_id']}: gathered batch differs"
        assert result["checksum_ok"], f"process {report['process_id']}: jitted sum differs"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_process_reads_only_its_rows_once(cluster, layout):
    num_processes, local_devices, reports = cluster
    covered: set[int] = set()
    for report in reports:
        result, pid = report["layouts"][layout], report["process_id"]
        assert result["rows"] == _expected_rows(layout, pid, num_processes, local_devices)
        assert result["rows_read"] == len(result["rows"])
        assert result["num_local_devices"] == local_devices
        covered.update(result["rows"])
    assert covered == set(range(2 * num_processes * local_devices))
