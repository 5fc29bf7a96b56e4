"""The systems measured, the workloads each runs, and how one (system, workload) is run.

Every measurement is its own process: the system's python (the project's venv for roxxel and
the baselines, a peer's venv for a peer) running that system's worker script, which prints one
JSON line. A worker that crashes, times out or cannot be installed becomes failure rows.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from benchmarks import venvs
from benchmarks.table import Row, failure_rows

WORKERS = Path(__file__).resolve().parent / "workers"


@dataclasses.dataclass(frozen=True, slots=True)
class System:
    """One column of the comparison: a name, its worker script, its venv (None = ours)."""

    name: str
    worker: str
    workloads: tuple[str, ...]
    venv: str | None = None
    params: tuple[tuple[str, object], ...] = ()


ALL_WORKLOADS = (
    "write_lm",
    "write_images",
    "read_single",
    "read_batch_warm",
    "read_batch_cold",
    "train_tokens",
    "train_images",
    "resume",
    "resume_mix",
    "startup",
)

# Packing the JSONL corpus and the .npy images (issue 5): the writers, not HF datasets.
PACK = ("pack_lm", "pack_images")
# Cold-cache loader batches: roxxel against the plain memmap reader only (issue 3).
COLD_TRAIN = ("train_images_cold",)
# roxxel alone: a train step fed by the Loader, and memory over an epoch (issue 3).
TRAIN_ONLY = ("train_step", "train_memory", "train_first_pass", "train_host_threads")
# roxxel alone: the memory and verification claims of the format issue (2), and the pack's
# block path against its record path (5).
FORMAT_ONLY = ("open_memory", "verify_cost", "pack_paths")
BASELINE = System(
    "megatron-memmap",
    "baseline_worker.py",
    ("limits", *ALL_WORKLOADS, *PACK, *COLD_TRAIN),
)
ROXXEL = System(
    "roxxel", "roxxel_worker.py", (*ALL_WORKLOADS, *PACK, *COLD_TRAIN, *TRAIN_ONLY, *FORMAT_ONLY)
)
# roxxel alone: roxxel.train.fit with and without Orbax checkpoints (issue 6).
ROXXEL_FIT = System("roxxel", "train_worker.py", ("train_checkpoint",))
PEERS = (
    System("grain", "grain_worker.py", (*ALL_WORKLOADS, *PACK), venv="grain"),
    System("roxxel 0.9.14", "roxxel09_worker.py", (*ALL_WORKLOADS, *PACK), venv="roxxel09"),
    System("mosaicml-streaming", "streaming_worker.py", (*ALL_WORKLOADS, *PACK), venv="streaming"),
    System("hf-datasets", "hf_worker.py", ALL_WORKLOADS, venv="hf"),
)


def python_of(system: System) -> tuple[str | None, str]:
    """(python executable, "") for a runnable system, or (None, install error)."""
    if system.venv is None:
        return sys.executable, ""
    err = venvs.ensure_venv(system.venv)
    if err is not None:
        return None, f"install failed: {err}"
    return str(venvs.venv_python(system.venv)), ""


def run_one(
    system: System, workload: str, params: dict, timeout: float, log: Callable[[str], None] = print
) -> tuple[list[Row], dict[str, str]]:
    """Run one workload of one system in a fresh process; return its rows and versions."""
    python, err = python_of(system)
    if python is None:
        return failure_rows(system.name, [workload], err), {}
    args = {**dict(system.params), **params}
    cmd = [python, str(WORKERS / system.worker), workload, json.dumps(args)]
    log(f"[bench] {system.name}: {workload}")
    with tempfile.TemporaryDirectory(prefix="rxbench-") as cwd:  # keep the repo off sys.path
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd)
        except subprocess.TimeoutExpired:
            return failure_rows(system.name, [workload], f"timed out after {timeout:.0f} s"), {}
    return parse_output(system.name, workload, proc.stdout, proc.stderr, proc.returncode)


def parse_output(
    system: str, workload: str, stdout: str, stderr: str, returncode: int
) -> tuple[list[Row], dict[str, str]]:
    """Rows from a worker's output; a crash or a reported error becomes a failure row."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if not lines:
        tail = " ".join(stderr.strip().splitlines()[-3:])[-500:]
        return failure_rows(system, [workload], f"exit {returncode}: {tail or 'no output'}"), {}
    out = json.loads(lines[-1])
    versions = {k: str(v) for k, v in out.get("versions", {}).items()}
    if not out.get("ok"):
        return failure_rows(system, [workload], out.get("error") or "failed"), versions
    mem = out.get("memory", {})
    kids = mem.get("children_peak_rss_mib")
    extra = f"child processes' peak RSS {kids:,.0f} MiB" if kids else ""
    rows = []
    for m in out["metrics"]:
        notes = "; ".join(x for x in (m.get("notes", ""), extra) if x)
        rows.append(
            Row(
                system,
                m["workload"],
                m["variant"],
                m["value"],
                m["unit"],
                m["higher_is_better"],
                notes,
                m.get("error", ""),
                mem.get("peak_rss_mib"),
                mem.get("peak_anon_mib", mem.get("anon_mib")),
            )
        )
    return rows, versions
