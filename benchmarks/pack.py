"""The pack workloads (issue 5): turn a token-id JSONL corpus and an ``.npy`` image set into
each system's layout, from the same input files (stdlib + numpy only, so the peers' venvs
import it too).

Inputs, deterministic from the spec: ``lm.jsonl`` holds the first 2/7 of the LM corpus's
documents as ``{"tokens": [ids...]}`` lines (about 520 MB for --full, 33 MB small, 2 MB
tiny); ``images.npy`` the image set's pixels as one ``(n, 3, 64, 64)`` uint8 array. Every
system is timed from the input files to its fsynced output, and rated in MB/s of payload
(int32 token bytes, pixel bytes) so the rows compare with each other and with plain
``f.write`` of the same bytes. roxxel runs its real CLI (``python -m roxxel.cli pack``).

>>> spec = dg.SPECS["tiny"]
>>> pack_tokens(spec) == spec.lm_tokens * 2 // 7
True
>>> tokens_from_line(b'{"tokens": [1, 2, 50256]}').tolist()
[1, 2, 50256]
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from benchmarks import datagen as dg
from benchmarks import measure as ms

INPUTS = "pack-inputs"
LM_FIELD = "tokens"
BASELINE = "megatron-memmap"
UNITS = 4  # work units the roxxel CLI cuts the input into, so 1 and 2 workers both balance


@dataclasses.dataclass(frozen=True, slots=True)
class PackInputs:
    """The two input files of the pack workloads and their payload sizes."""

    jsonl: Path
    npy: Path
    lm_payload_bytes: int
    image_payload_bytes: int

    @property
    def jsonl_bytes(self) -> int:
        return self.jsonl.stat().st_size


def pack_tokens(spec: dg.DataSpec) -> int:
    """Tokens the JSONL input holds at most: 2/7 of the corpus (~520 MB of JSON, full)."""
    return spec.lm_tokens * 2 // 7


def tokens_from_line(line: bytes) -> np.ndarray:
    """The int32 token ids of one JSONL line (stdlib json, as a plain Python packer does)."""
    return np.asarray(json.loads(line)[LM_FIELD], dtype=np.int32)


def iter_jsonl_tokens(path: Path) -> Iterator[np.ndarray]:
    """Every document of a JSONL corpus as an int32 array, in file order."""
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                yield tokens_from_line(line)


def _write_jsonl(spec: dg.DataSpec, path: Path) -> int:
    """Write the corpus's first documents as JSON lines; return their payload bytes."""
    tmp = path.with_name(path.name + ".tmp")
    payload = 0
    with open(tmp, "w", encoding="ascii") as f:
        for doc in dg.iter_documents(spec, max_tokens=pack_tokens(spec)):
            f.write('{"tokens": [' + ", ".join(map(str, doc.tolist())) + "]}\n")
            payload += doc.nbytes
    os.replace(tmp, path)
    return payload


def ensure_inputs(spec: dg.DataSpec) -> PackInputs:
    """The JSONL corpus and the .npy image set of `spec`, generated once (stamped by key)."""
    root = dg.data_dir(spec, INPUTS)
    jsonl, npy, stamp = root / "lm.jsonl", root / "images.npy", root / "done.json"
    try:
        sizes = json.loads(stamp.read_text())
        fresh = sizes.get("key") == spec.key() and jsonl.exists() and npy.exists()
    except (OSError, ValueError):
        fresh = False
    if not fresh:
        lm = _write_jsonl(spec, jsonl)
        img, _ = dg.images(spec, 0, spec.num_images)
        np.save(npy, img)
        sizes = {"key": spec.key(), "lm": lm, "images": img.nbytes}
        stamp.write_text(json.dumps(sizes))
    return PackInputs(jsonl, npy, int(sizes["lm"]), int(sizes["images"]))


def fsync_tree(root: Path) -> None:
    """fsync every file below `root` (or `root` itself): the bytes are on disk, not cached."""
    for f in [root] if root.is_file() else ms.files_under(root):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def remove(path: Path) -> None:
    """Delete an output file or directory if present."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def rate_of(write: Callable[[Path], object], out: Path, payload_bytes: int, p: dict) -> float:
    """Median MB/s of payload of `write(out)` + fsync over the slow repeats; cleans up."""
    rates = []
    for _ in range(ms.slow_repeats(p)):
        remove(out)
        t0 = time.perf_counter()
        write(out)
        fsync_tree(out)
        rates.append(payload_bytes / 1e6 / (time.perf_counter() - t0))
    remove(out)
    return statistics.median(rates)


def input_note(inputs: PackInputs, kind: str) -> str:
    """What the row read: the input file and its size."""
    if kind == "lm":
        mb = inputs.jsonl_bytes / 1e6
        return f"from {mb:.0f} MB JSONL ({inputs.jsonl_bytes / inputs.lm_payload_bytes:.2f} B per payload B)"
    return f"from {inputs.image_payload_bytes / 1e6:.0f} MB .npy"


def pack_metric(
    kind: str, variant: str, write: Callable[[Path], object], p: dict, system: str
) -> ms.Metric:
    """One row of pack_lm / pack_images: `write(out)` reads this spec's input file itself."""
    spec = dg.SPECS[p.get("spec", "small")]
    inputs = ensure_inputs(spec)
    payload = inputs.lm_payload_bytes if kind == "lm" else inputs.image_payload_bytes
    out = dg.data_dir(spec, system) / f"pack-test-{kind}"
    rate = rate_of(write, out, payload, p)
    return ms.metric(f"pack_{kind}", variant, rate, "MB/s", notes=input_note(inputs, kind))


def input_path(p: dict, kind: str) -> Path:
    """The input file of a pack workload (generated on first use)."""
    inputs = ensure_inputs(dg.SPECS[p.get("spec", "small")])
    return inputs.jsonl if kind == "lm" else inputs.npy


# ---- roxxel: the real CLI -------------------------------------------------------------------


def cli_args(inputs: PackInputs, kind: str, out: Path, workers: int) -> list[str]:
    """``roxxel pack`` arguments for one input: explicit schema, UNITS work units."""
    size = inputs.jsonl_bytes if kind == "lm" else inputs.image_payload_bytes
    unit = max(1, -(-size // UNITS))
    src = inputs.jsonl if kind == "lm" else inputs.npy
    schema = ["--field", "tokens:int32[]"] if kind == "lm" else ["--input-field", "image"]
    return [
        "pack", str(src), "-o", str(out), *schema, "--workers", str(workers),
        "--unit-bytes", str(unit), "--quiet", "--overwrite",
    ]  # fmt: skip


def run_cli(args: list[str], python: str = sys.executable) -> None:
    """Run ``python -m roxxel.cli ARGS`` (the `roxxel` command); a failure raises with the CLI's last stderr line."""
    proc = subprocess.run([python, "-m", "roxxel.cli", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"roxxel pack exit {proc.returncode}: {tail}")


def run_in_process(args: list[str]) -> None:
    """The same command through ``roxxel.cli.main`` in this process (roxxel already imported,
    as the peers' libraries are when they are timed)."""
    from roxxel.cli import main  # the project's venv only: peers' workers never call this

    code = main(args)
    if code != 0:
        raise RuntimeError(f"roxxel pack exit {code} (see stderr)")


IN_PROCESS = "roxxel pack --workers 1, in process (roxxel.cli.main, imports warm)"
IN_PROCESS_2 = "roxxel pack --workers 2, in process (roxxel.cli.main, imports warm, forked)"


def roxxel_pack(p: dict, kind: str) -> list[ms.Metric]:
    """roxxel pack in process with 1 and 2 workers, then as a command with 1 and 2 workers;
    the pack fsyncs each shard before its rename, and fsync_tree finds nothing left to flush."""
    inputs = ensure_inputs(dg.SPECS[p.get("spec", "small")])
    in_process = lambda out: run_in_process(cli_args(inputs, kind, out, 1))  # noqa: E731
    rows = [pack_metric(kind, IN_PROCESS, in_process, p, "roxxel")]

    def in_process_2(out: Path) -> None:
        # forked, as the command's workers are ("auto" would see the memory sampler's thread)
        run_in_process([*cli_args(inputs, kind, out, 2), "--start-method", "fork"])

    rows.append(pack_metric(kind, IN_PROCESS_2, in_process_2, p, "roxxel"))
    for workers in (1, 2):

        def write(out: Path, w: int = workers) -> None:
            run_cli(cli_args(inputs, kind, out, w))

        variant = f"roxxel pack --workers {workers} (a new CLI process, {UNITS} work units)"
        rows.append(pack_metric(kind, variant, write, p, "roxxel"))
    return rows


# ---- plain baselines ------------------------------------------------------------------------


def _plain_write(out: Path, chunks: list[np.ndarray]) -> None:
    with open(out, "wb") as f:
        for c in chunks:
            f.write(c.data)


def _parse_and_write(src: Path, out: Path) -> None:
    with open(out, "wb") as f:
        for doc in iter_jsonl_tokens(src):
            f.write(doc.data)


def baseline_pack(p: dict, kind: str) -> list[ms.Metric]:
    """Plain f.write of the output bytes from memory (the disk's pace), and the cheapest
    stdlib pipeline from the same input file (json.loads / np.load, then f.write)."""
    src = input_path(p, kind)
    if kind == "lm":
        chunks = list(iter_jsonl_tokens(src))
        parse = "json.loads + np.asarray(int32) per line + f.write"
        pipeline: Callable[[Path], object] = lambda out: _parse_and_write(src, out)  # noqa: E731
    else:
        chunks = [np.load(src)]
        parse = "np.load + f.write"
        pipeline = lambda out: _plain_write(out, [np.load(src)])  # noqa: E731
    plain = "plain f.write of the output bytes (from memory) +fsync"
    return [
        pack_metric(kind, plain, lambda out: _plain_write(out, chunks), p, BASELINE),
        pack_metric(kind, f"{parse} +fsync", pipeline, p, BASELINE),
    ]
