"""Result rows and their markdown rendering (absolute numbers, ratio of each system to roxxel).

>>> rows = [Row("roxxel", "read_batch_warm", "256 x 12 KiB", 2.0, "GB/s"),
...         Row("grain", "read_batch_warm", "256 x 12 KiB", 0.5, "GB/s")]
>>> "| grain | 256 x 12 KiB | 0.5 GB/s | 0.25x |" in render_sections(rows)
True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

ROXXEL = "roxxel"

WORKLOADS: dict[str, str] = {
    "limits": "Machine limits (in-process)",
    "write_lm": "Pack/write: LM corpus (MB/s of payload)",
    "write_images": "Pack/write: images (MB/s of payload)",
    "pack_lm": "Pack: token-id JSONL corpus -> dataset, from the file (MB/s of int32 payload)",
    "pack_images": "Pack: .npy image set -> dataset, from the file (MB/s of pixel payload)",
    "pack_paths": "Pack of array inputs: the block path vs the record path (MB/s of payload)",
    "read_single": "Random single-record reads (image records, warm)",
    "read_batch_warm": "Batched random reads, warm cache (256 image records per batch)",
    "read_batch_cold": "Batched random reads, cold cache (posix_fadvise DONTNEED)",
    "train_tokens": "Shuffled training batches: token windows 64 x 2048 (int32)",
    "train_images": "Shuffled training batches: images 256 x 3x64x64 (uint8) + labels",
    "train_images_cold": "Shuffled image batches, cold cache: the first batches after eviction",
    "train_first_pass": "First pass over a mapped dataset vs the same batches with every page mapped",
    "train_host_threads": "A host transform as costly as the batch read: host_threads=2 vs 1",
    "train_step": "A jitted train step ~10x the loader's batch time: fed by the Loader vs a prebuilt array",
    "train_memory": "Resident memory over one epoch of image batches (jax.Array out)",
    "train_checkpoint": "roxxel.train.fit steady state: Orbax checkpoints every 50 steps vs none",
    "resume": "Time to first batch when resuming at step N (token windows 64 x 2048)",
    "resume_mix": "Time to first batch when resuming a 4-source mixture at step N",
    "startup": "Startup: open a 1,000-shard dataset and read one record",
    "open_memory": "Anonymous memory: open 10^7 records in 100 shards, then read",
    "verify_cost": "Checksum verification: reads with verify=True, and verify() throughput",
}


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    """One number in the report, or one failure (value None and `error` set)."""

    system: str
    workload: str
    variant: str
    value: float | None
    unit: str
    higher_is_better: bool = True
    notes: str = ""
    error: str = ""
    peak_rss_mib: float | None = None
    anon_mib: float | None = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Row:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


def failure_rows(system: str, workloads: Iterable[str], error: str, variant: str = "") -> list[Row]:
    """One failure row per workload, so a peer that cannot run is shown, never dropped."""
    return [Row(system, w, variant, None, "", error=error) for w in workloads]


def fmt_value(value: float | None, unit: str) -> str:
    """A number with 3 significant digits (thousands separated), followed by its unit."""
    if value is None:
        return "—"
    a = abs(value)
    if a >= 1000:
        s = f"{value:,.0f}"
    elif a >= 100:
        s = f"{value:.0f}"
    elif a >= 10:
        s = f"{value:.1f}"
    elif a >= 1 or a == 0:
        s = f"{value:.2f}"
    else:
        s = f"{value:.3g}"
    return f"{s} {unit}".strip()


def _reference(rows: list[Row], row: Row) -> Row | None:
    """The roxxel row a row is compared with: roxxel's first row of the workload (its main
    setting, or step 0), or, for another system, roxxel's row of the same variant if any."""
    mine = [r for r in rows if r.system == ROXXEL and r.workload == row.workload and r.value]
    same = [r for r in mine if r.variant == row.variant and row.system != ROXXEL]
    return (same or mine or [None])[0]


def ratio(rows: list[Row], row: Row) -> str:
    """`row.value / roxxel's value` as "0.25x" ("" when either side is missing)."""
    ref = _reference(rows, row)
    if ref is None or row.value is None or not ref.value or ref.unit != row.unit:
        return ""
    return f"{row.value / ref.value:.2f}x"


def _cell(text: str) -> str:
    return " ".join(str(text).replace("|", "/").split())


def _mem(v: float | None) -> str:
    return "" if v is None else f"{v:,.0f}"


def render_section(rows: list[Row], workload: str) -> str:
    """The markdown table of one workload (header, then one line per row, in given order)."""
    mine = [r for r in rows if r.workload == workload]
    if not mine:
        return ""
    lines = [
        f"### {WORKLOADS.get(workload, workload)}",
        "",
        "| system | variant | value | vs roxxel | peak RSS MiB | peak anon MiB | notes |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in mine:
        notes = f"FAILED: {r.error}" if r.error else r.notes
        cells = [
            r.system,
            r.variant,
            fmt_value(r.value, r.unit),
            ratio(rows, r),
            _mem(r.peak_rss_mib),
            _mem(r.anon_mib),
            notes,
        ]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def render_sections(rows: list[Row]) -> str:
    """Every workload's table: known workloads in report order, then any others."""
    order = list(WORKLOADS) + sorted({r.workload for r in rows} - set(WORKLOADS))
    return "\n".join(s for s in (render_section(rows, w) for w in order) if s)


def render_report(
    rows: list[Row], header: dict[str, str], versions: dict[str, str], summary: str = ""
) -> str:
    """The whole results page: title, run facts, `summary` (markdown), the tables, versions."""
    out = [f"# roxxel benchmarks: {header.get('date', '')}", ""]
    out += [f"- **{_cell(k)}**: {_cell(v)}" for k, v in header.items()]
    out += [
        "",
        "\"vs roxxel\" is each row's value divided by roxxel's main row of the same "
        "workload (or roxxel's row of the same variant): higher is better for rates, lower "
        "for seconds.",
        "",
    ]
    if summary:
        out += [summary, ""]
    out += ["## Results", "", render_sections(rows), "## Versions", ""]
    out += [f"- {_cell(k)}: {_cell(v)}" for k, v in sorted(versions.items())]
    return "\n".join(out).rstrip() + "\n"
