"""One process of a real multi-host run of `roxxel.Loader`, started by test_loader_multihost.py.

Usage: python loader_multihost_worker.py PORT NUM_PROCESSES PROCESS_ID DATA_DIR OUT_DIR, with
XLA_FLAGS (--xla_force_host_platform_device_count) and JAX_PLATFORMS=cpu set by the parent.

For every mesh layout the process runs the real Loader over token windows of DATA_DIR, with a
source wrapper that records every window index it reads. It gathers each global batch to
every process and saves, as ``OUT_DIR/<process>.npz``, the gathered batches and the indices
it read, for the parent to compare with a single-process run.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils

import roxxel
from roxxel.loader.loader import Loader, LoaderConfig
from roxxel.sources.windows import TokenWindows
from tests.cluster import joined, mesh_and_spec, worker_main

LAYOUTS = ("dp", "fsdp", "dp_tp", "seq", "tp_across")
BATCH, SEQ_LEN, START_STEP, NUM_STEPS, SEED = 16, 8, 3, 4, 5
CONFIG = LoaderConfig(num_epochs=None, final_batch="pad", provenance=True)


class CountingSource:
    """A source that delegates to another and records the indices of every read."""

    def __init__(self, inner: TokenWindows) -> None:
        self.inner = inner
        self.reads: list[np.ndarray] = []

    @property
    def layout(self):
        return self.inner.layout

    def __len__(self) -> int:
        return len(self.inner)

    def read(self, indices, out) -> None:
        self.reads.append(np.array(indices))
        self.inner.read(indices, out)

    def advise(self, indices) -> None:
        self.inner.advise(indices)

    def fingerprint(self) -> str:
        return self.inner.fingerprint()


def windows(data_dir: str) -> TokenWindows:
    ds = roxxel.open_dataset(data_dir)
    return TokenWindows(ds, "tokens", SEQ_LEN, document_structure=True, split_targets=True)


def run_layout(layout: str, num_processes: int, data_dir: str, out: dict) -> None:
    mesh, spec = mesh_and_spec(layout, num_processes)
    source = CountingSource(windows(data_dir))
    loader = Loader(
        source, BATCH, sharding=(mesh, spec), seed=SEED, start_step=START_STEP, config=CONFIG
    )
    with loader:
        for i in range(NUM_STEPS):
            batch = next(loader)
            for name, array in batch.items():
                out[f"{layout}/{i}/{name}"] = np.asarray(
                    multihost_utils.process_allgather(array, tiled=True)
                )
    out[f"{layout}/reads"] = np.stack(source.reads[:NUM_STEPS])  # later ones were prefetched


def main(argv: list[str]) -> int:
    port, num_processes, process_id = (int(a) for a in argv[:3])
    data_dir, out_dir = argv[3], argv[4]
    with joined(port, num_processes, process_id):
        out: dict[str, np.ndarray] = {}
        for layout in LAYOUTS:
            run_layout(layout, num_processes, data_dir, out)
        np.savez(f"{out_dir}/{jax.process_index()}.npz", **out)
    return 0


if __name__ == "__main__":
    worker_main(main)
