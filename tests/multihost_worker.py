"""One process of a real multi-host run of roxxel.loader.placement, started by tests/test_multihost.py.

Usage: python multihost_worker.py PORT NUM_PROCESSES PROCESS_ID OUT_JSON, with XLA_FLAGS
(--xla_force_host_platform_device_count) and JAX_PLATFORMS=cpu set by the parent.

Each process joins a `jax.distributed` job on localhost (CPU devices, gloo collectives). For
every layout it plans two fields, tokens (B, 8) and labels (B,), "reads" exactly the planned
rows from a deterministic generator (row r, column j holds r * 100 + j), places them, and
checks each global array three ways: its own shards against the reference, a gather of the
whole batch to every process, and a jitted sum across processes. It writes what it read and
what it found as JSON.
"""

from __future__ import annotations

import json

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from roxxel.loader.placement import batch_sharding, place_fields, plan_fields, union_rows
from tests.cluster import joined, mesh_and_spec, worker_main

LAYOUTS = ("dp", "dp_strided", "fsdp", "dp_tp", "seq", "tp_across")
WIDTH = 8  # columns per row; the sequence layout splits them over 2 devices


def reference_rows(rows: np.ndarray) -> np.ndarray:
    """The generator: any process computes any row on its own, as a reader would."""
    return (rows[:, None] * 100 + np.arange(WIDTH)).astype(np.float32)


def _check(arr: jax.Array, ref: np.ndarray, mesh: Mesh) -> dict[str, bool]:
    """The placed array against the reference: own shards, a gather, a jitted global sum."""
    local_ok = all(
        np.array_equal(np.asarray(shard.data), ref[shard.index]) for shard in arr.addressable_shards
    )
    gathered = np.asarray(multihost_utils.process_allgather(arr, tiled=True))
    total = jax.jit(lambda x: x.sum(), out_shardings=NamedSharding(mesh, P()))(arr)
    return {
        "local_ok": bool(local_ok),
        "gather_ok": bool(np.array_equal(gathered, ref)),
        "checksum_ok": float(total.addressable_data(0)) == float(ref.sum()),
    }


def run_layout(layout: str, num_processes: int) -> dict:
    """Plan, read and place two fields, tokens (B, WIDTH) and labels (B,), as the loader
    would, and check both; the result as plain JSON values."""
    mesh, spec = mesh_and_spec(layout, num_processes)
    batch = 2 * jax.device_count()
    shapes = {"tokens": (batch, WIDTH), "label": (batch,)}
    plans = plan_fields(batch_sharding(mesh, spec), shapes)
    rows = union_rows(plans.values())
    tokens = reference_rows(rows)  # the "read": exactly the planned rows, once each
    out = place_fields(plans, {"tokens": tokens, "label": rows.copy()}, rows=rows)
    tokens_ok = _check(out["tokens"], reference_rows(np.arange(batch)), mesh)
    labels_ok = _check(out["label"], np.arange(batch), mesh)
    return {
        "rows": rows.tolist(),
        "rows_read": len(tokens),
        "num_local_devices": len(plans["tokens"].slices),
        **{k: tokens_ok[k] and labels_ok[k] for k in tokens_ok},
    }


def main(argv: list[str]) -> int:
    port, num_processes, process_id = (int(a) for a in argv[:3])
    out_path = argv[3]
    with joined(port, num_processes, process_id):
        report = {"process_id": jax.process_index(), "num_devices": jax.device_count()}
        report["layouts"] = {name: run_layout(name, num_processes) for name in LAYOUTS}
        with open(out_path, "w") as f:
            json.dump(report, f)
    return 0


if __name__ == "__main__":
    worker_main(main)
