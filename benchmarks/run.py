"""Run the benchmark suite: ``python -m benchmarks.run --quick`` or ``--peers --small``.

--quick          roxxel and the in-process baselines on the small data (a few minutes).
--peers          also grain, the PyPI roxxel 0.9.14, mosaicml-streaming and HF datasets, each
                 in its own venv under benchmarks/.venvs/ (created on first use).
--small/--full   data size (64 MiB + 48 MiB, or 1 GiB + 192 MiB); --spec tiny for smoke runs.

Writes benchmarks/results/<date>.md for a --peers run, <date>-quick.md otherwise (+ .json with
every row), and refreshes the summary in benchmarks/README.md. A tiny smoke run, a partial run
(--systems/--workloads) or one given --out publishes nothing: it writes to --out, or under
benchmarks/.work/.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import datagen, measure, pack_text, systems
from benchmarks.table import Row, render_report, render_sections
from benchmarks.targets import render_targets

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"
MARK_START, MARK_END = "<!-- latest-results:start -->", "<!-- latest-results:end -->"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--quick", action="store_true", help="roxxel + in-process baselines only")
    ap.add_argument("--peers", action="store_true", help="also run every peer in its venv")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--small", dest="spec", action="store_const", const="small")
    size.add_argument("--full", dest="spec", action="store_const", const="full")
    size.add_argument("--spec", dest="spec", choices=sorted(datagen.SPECS))
    ap.add_argument("--systems", help="comma-separated system names to run (default: all chosen)")
    ap.add_argument("--workloads", help="comma-separated workloads to run (default: all)")
    ap.add_argument("--repeats", type=int, default=5, help="repeats per measurement (median)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per worker process")
    ap.add_argument("--out", type=Path, help="results file (default: results/<date>.md)")
    ap.add_argument("--install-only", action="store_true", help="create the peer venvs and exit")
    ap.add_argument(
        "--pack-text",
        action="store_true",
        help="run the tokenizing and image pack rows (benchmarks/pack_text.py) and exit",
    )
    args = ap.parse_args(argv)
    args.spec = args.spec or "small"
    return args


def chosen_systems(args: argparse.Namespace) -> list[systems.System]:
    picked = [systems.ROXXEL, systems.ROXXEL_FIT, systems.BASELINE]
    if args.peers and not args.quick:
        picked += list(systems.PEERS)
    if args.systems:
        names = {s.strip() for s in args.systems.split(",")}
        picked = [s for s in picked if s.name in names]
    return picked


def machine_info(spec: datagen.DataSpec) -> dict[str, str]:
    """Machine and run facts for the report header."""
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in _read("/proc/cpuinfo").splitlines()
            if ln.startswith("model name")
        ),
        platform.processor() or "unknown",
    )
    mem_kb = next(
        (
            int(ln.split()[1])
            for ln in _read("/proc/meminfo").splitlines()
            if ln.startswith("MemTotal")
        ),
        0,
    )
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{cores} cores, {mem_kb / 2**20:.1f} GiB RAM, {cpu}",
        "os": f"{platform.system()} {platform.release()}, Python {platform.python_version()}",
        "disk readahead": f"{measure.readahead_kb(datagen.DATA_ROOT.parent)} KiB",
        "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "data": (
            f"{spec.name}: LM {spec.lm_tokens:,} int32 tokens ({spec.lm_bytes / 2**20:.0f}"
            f" MiB, lognormal docs, median {spec.median_doc_tokens:.0f}), "
            f"{spec.num_images:,} images 3x64x64 uint8 + int64 label "
            f"({spec.image_bytes / 2**20:.0f} MiB), seed {spec.seed}"
        ),
        "git commit": _git_commit(),
    }


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=HERE,
            text=True,
            capture_output=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_all(args: argparse.Namespace) -> tuple[list[Row], dict[str, str]]:
    """Every chosen (system, workload), each in its own process; rows in report order."""
    only = set(args.workloads.split(",")) if args.workloads else None
    params = {"spec": args.spec, "repeats": args.repeats}
    rows: list[Row] = []
    versions: dict[str, str] = {}
    for system in chosen_systems(args):
        for wl in system.workloads:
            if only is None or wl in only:
                got, ver = systems.run_one(system, wl, params, args.timeout, _log)
                rows += got
                versions.update({f"{system.name}: {k}": v for k, v in ver.items()})
    return rows, versions


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def write_results(
    rows: list[Row], header: dict[str, str], versions: dict[str, str], out: Path
) -> None:
    """The markdown report and a JSON twin with every row."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_report(rows, header, versions, summary(rows, header)))
    raw = {"header": header, "versions": versions, "rows": [r.to_json() for r in rows]}
    out.with_suffix(".json").write_text(json.dumps(raw, indent=1) + "\n")


def summary(rows: list[Row], header: dict[str, str]) -> str:
    """The issues' speed targets, checked against this run."""
    spec = header["mode"].rpartition("--spec ")[2]
    return "## Targets from the issues\n\n" + render_targets(rows, spec)


def update_readme(rows: list[Row], header: dict[str, str], out: Path) -> None:
    """Replace the latest-results block of benchmarks/README.md with this run's tables."""
    if not README.exists():
        return
    text = README.read_text()
    if MARK_START not in text or MARK_END not in text:
        return
    rel = _rel(out)
    lines = [f"Latest: [{rel}]({rel}), {header['date']}, {header['mode']}, on {header['machine']}."]
    peers = sorted(p for p in (HERE / "results").glob("*.md") if not p.stem.endswith("-quick"))
    if "--peers" not in header["mode"] and peers:
        last = _rel(peers[-1])
        lines.append(f"The latest side-by-side run with the peers: [{last}]({last}).")
    tables = f"{summary(rows, header)}\n## Tables\n\n{render_sections(rows)}"
    block = f"{MARK_START}\n" + "\n".join(lines) + f"\n\n{tables}{MARK_END}"
    head, rest = text.split(MARK_START, 1)
    README.write_text(head + block + rest.split(MARK_END, 1)[1])


def _rel(path: Path) -> Path:
    return path.relative_to(HERE) if path.is_relative_to(HERE) else path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.pack_text:
        return pack_text.main([])
    if args.install_only:
        return sum(systems.python_of(s)[0] is None for s in systems.PEERS)
    spec = datagen.SPECS[args.spec]
    header = machine_info(spec)
    flags = [
        "--quick" if args.quick else "",
        "--peers" if args.peers else "",
        f"--spec {args.spec}",
    ]
    header["mode"] = " ".join(f for f in flags if f)
    t0 = time.perf_counter()
    rows, versions = run_all(args)
    header["duration"] = f"{time.perf_counter() - t0:.0f} s"
    # Only a whole run at a real size publishes: smoke runs, partial runs (--systems,
    # --workloads) and runs with their own --out leave results/ and the README alone.
    partial = bool(args.systems or args.workloads)
    publish = args.spec != "tiny" and not partial and args.out is None
    day = header["date"][:10]
    name = f"{day}.md" if args.peers and not args.quick else f"{day}-quick.md"
    out = args.out or (HERE / ("results" if publish else ".work") / name)
    write_results(rows, header, versions, out)
    if publish:
        update_readme(rows, header, out)
    print(render_sections(rows))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
