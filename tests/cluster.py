"""Local multi-host JAX jobs for tests: N processes joined by `jax.distributed` over gloo.

The parent side, `run_group`, starts a worker script in N processes, each with its own fake
CPU devices, and waits for all of them; a failed or hung group never outlives its test. The
worker side, `joined` and `worker_main`, joins the job and turns any exception into exit 1
with its traceback in the worker's log; `mesh_and_spec` builds the mesh layouts tested.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEADLINE_S = 90  # the whole group, on 2 shared cores; a healthy run takes ~10 s


def run_group(
    worker: Path,
    num_processes: int,
    local_devices: int,
    log_dir: Path,
    args: Callable[[int], list[str]],
) -> None:
    """Run ``worker PORT N PID *args(PID)`` in N processes; fail the test with the logs'
    ends unless every one exits 0."""
    import pytest

    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={local_devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(REPO)) if p)
    port, procs, logs = _free_port(), [], []
    try:
        for pid in range(num_processes):
            log = open(log_dir / f"worker{pid}.log", "w")  # noqa: SIM115 (closed in finally)
            logs.append(log)
            argv = [sys.executable, str(worker), str(port), str(num_processes), str(pid)]
            procs.append(
                subprocess.Popen(argv + args(pid), env=env, stdout=log, stderr=subprocess.STDOUT)
            )
        codes = _wait_all(procs)
    finally:
        for proc in procs:  # ours, by handle: a failed or hung group never outlives the test
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    if codes != [0] * num_processes:
        output = "\n".join(
            (log_dir / f"worker{i}.log").read_text()[-3000:] for i in range(num_processes)
        )
        pytest.fail(f"workers exited with {codes} (None: still running, so killed):\n{output}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_all(procs: list[subprocess.Popen]) -> list[int | None]:
    """Exit codes once all exit, as soon as one fails (its peers would block in a
    collective), or at the deadline (None for a worker still running)."""
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


@contextlib.contextmanager
def joined(port: int, num_processes: int, process_id: int) -> Iterator[None]:
    """This process inside the job on 127.0.0.1:PORT (gloo collectives), then out again."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{port}", num_processes, process_id, initialization_timeout=60
    )
    try:
        yield
    finally:
        jax.distributed.shutdown()


def worker_main(main: Callable[[list[str]], int]) -> None:
    """Exit with ``main(argv)``, or with 1 and the traceback on stderr."""
    try:
        sys.exit(main(sys.argv[1:]))
    except Exception:
        traceback.print_exc()
        sys.exit(1)


def mesh_and_spec(layout: str, num_processes: int) -> tuple[Any, Any]:
    """The (mesh, batch spec) of a named layout over every device of the job, ordered by
    process: dp, dp_strided, fsdp, dp_tp, seq or tp_across."""
    import jax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    total = devices.size
    if layout == "dp":
        return Mesh(devices, ("data",)), P("data")
    if layout == "dp_strided":  # data shards alternate between processes: rows with gaps
        return Mesh(devices.reshape(num_processes, -1).T.reshape(-1), ("data",)), P("data")
    if layout == "fsdp":
        return Mesh(devices.reshape(2, total // 2), ("data", "fsdp")), P(("data", "fsdp"))
    if layout == "dp_tp":  # the model axis pairs two devices of one process
        return Mesh(devices.reshape(total // 2, 2), ("data", "model")), P("data")
    if layout == "seq":
        return Mesh(devices.reshape(total // 2, 2), ("data", "seq")), P("data", "seq")
    # tp_across: the model axis spans the processes, so every process holds every row
    grid = devices.reshape(num_processes, total // num_processes).T
    return Mesh(grid, ("data", "model")), P("data")
