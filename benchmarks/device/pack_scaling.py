"""`roxxel pack --workers N` on a machine with more cores than the 2 of the development VM.

The lent accelerator machines have 16 cores; this packs the pack workloads' inputs (the
~520 MB token-id JSONL corpus and the 201 MB ``.npy`` image set of ``--full``) from a new
CLI process with 1, 2, 4 and 8 workers, median of ``--repeats`` runs each, and writes a
table to ``$OUT/pack-scaling.md``. Usage (from the repository root)::

    PYTHONPATH=$PWD python3 benchmarks/device/pack_scaling.py --out $OUT [--spec full]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import datagen as dg  # noqa: E402
from benchmarks import pack  # noqa: E402

UNITS = 16  # work units per input, so 8 workers still balance


def _args(inputs: pack.PackInputs, kind: str, out: Path, workers: int) -> list[str]:
    src = inputs.jsonl if kind == "lm" else inputs.npy
    unit = -(-src.stat().st_size // UNITS)
    schema = ["--field", "tokens:int32[]"] if kind == "lm" else ["--input-field", "image"]
    return [
        "pack", str(src), "-o", str(out), *schema, "--workers", str(workers),
        "--unit-bytes", str(unit), "--quiet", "--overwrite",
    ]  # fmt: skip


def _seconds(args: list[str], out: Path, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        pack.remove(out)
        t0 = time.perf_counter()
        pack.run_cli(args)
        times.append(time.perf_counter() - t0)
    pack.remove(out)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--spec", default="full", choices=sorted(dg.SPECS))
    ap.add_argument("--workers", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    inputs = pack.ensure_inputs(dg.SPECS[args.spec])
    made = time.perf_counter() - t0
    lines = [
        "# roxxel pack --workers N",
        "",
        f"- **cores**: {os.cpu_count()}; **spec**: {args.spec}; inputs made in {made:.0f} s",
        f"- **median of** {args.repeats} runs, each a new `python -m roxxel.cli pack` process, "
        f"{UNITS} work units per input, output fsynced",
        "",
        "| input | workers | seconds | MB/s of payload | vs 1 worker |",
        "|---|---:|---:|---:|---:|",
    ]
    for kind in ("lm", "images"):
        payload = inputs.lm_payload_bytes if kind == "lm" else inputs.image_payload_bytes
        out = Path(tempfile.mkdtemp(prefix="roxxel-pack-")) / kind
        one = None
        for workers in (int(w) for w in args.workers.split(",")):
            secs = _seconds(_args(inputs, kind, out, workers), out, args.repeats)
            one = one or secs
            name = "token JSONL" if kind == "lm" else ".npy images"
            lines.append(
                f"| {name} | {workers} | {secs:.2f} | {payload / 1e6 / secs:,.0f} | {one / secs:.2f}x |"
            )
            print(lines[-1], flush=True)
    plain = Path(tempfile.mkdtemp(prefix="roxxel-plain-")) / "images.bin"
    pixels = [np.load(inputs.npy)]
    rate = pack.rate_of(
        lambda out: pack._plain_write(out, pixels),
        plain,
        pixels[0].nbytes,
        {"repeats": args.repeats},
    )
    lines.append(f"| plain f.write of the .npy pixels from memory + fsync | | | {rate:,.0f} | |")
    print(lines[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pack-scaling.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
