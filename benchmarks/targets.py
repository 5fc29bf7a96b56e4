"""The speed targets the issues set, checked against one run's rows (ratios from the same run).

A target is met, missed, or "—" when a row it needs is missing (a peer not run, an API not
landed). Rates compare as measured/reference >= threshold; a spread compares the largest of a
set of times to the smallest.

>>> from benchmarks.table import Row
>>> rows = [Row("roxxel", "read_batch_warm", "get_batch", 9.0, "GB/s"),
...         Row("megatron-memmap", "read_batch_warm", "np.take", 10.0, "GB/s")]
>>> "| 2 | get_batch of 256 random records vs bare np.take on one np.memmap | >= 0.8x | 0.90x | met |" in render_targets(rows)
True
"""

from __future__ import annotations

import dataclasses

from benchmarks.table import Row

Pick = tuple[str, str, str | None]  # system, workload, variant prefix (None: best row)


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    """`num / den >= threshold` (kind "ratio") or `max / min <= threshold` over `spread`;
    `den_best` makes the reference the best of several rows (the fastest peer). A
    `full_only` target is judged only in a --full run (the size its issue names)."""

    issue: int
    label: str
    threshold: float
    num: Pick | None = None
    den: Pick | None = None
    spread: tuple[Pick, ...] = ()
    den_best: tuple[Pick, ...] = ()
    full_only: bool = False


RX, MM = "roxxel", "megatron-memmap"
PACK_PEERS = ("grain", "roxxel 0.9.14", "mosaicml-streaming")
PACK_W1 = "roxxel pack --workers 1, in process"
PACK_W2 = "roxxel pack --workers 2, in process"


def _workers_targets(workload: str, name: str) -> tuple[Target, ...]:
    """Issue 5's near-linear --workers 2 speedup, from new CLI processes and in process."""
    label = f"roxxel pack of the {name}: --workers 2 vs --workers 1 (2 cores)"
    cli = ("roxxel pack --workers 2 (a new", "roxxel pack --workers 1 (a new")
    return tuple(
        Target(5, f"{label}, {how}", 1.8, (RX, workload, two), (RX, workload, one), full_only=True)
        for how, (two, one) in (("new CLI processes", cli), ("in process", (PACK_W2, PACK_W1)))
    )


TARGETS: tuple[Target, ...] = (
    Target(
        2,
        "get_batch of 256 random records vs bare np.take on one np.memmap",
        0.8,
        (RX, "read_batch_warm", "get_batch"),
        (MM, "read_batch_warm", "np.take"),
    ),
    Target(
        2,
        "ds[i] of a two-field record within 3x the cost of a np.memmap slice",
        1 / 3,
        (RX, "read_single", None),
        (MM, "read_single", None),
    ),
    Target(
        2,
        "writing the LM corpus vs plain f.write of the same bytes",
        0.7,
        (RX, "write_lm", None),
        (MM, "write_lm", "plain f.write"),
    ),
    Target(
        2,
        "writing the images vs plain f.write of the same bytes",
        0.7,
        (RX, "write_images", None),
        (MM, "write_images", "plain f.write"),
    ),
    Target(
        3,
        "token windows, jax.Array out, vs bare numpy gather + the same placement",
        0.8,
        (RX, "train_tokens", "Loader, jax"),
        (MM, "train_tokens", "bare numpy gather +"),
    ),
    Target(
        3,
        "images, numpy out, vs bare np.take gather",
        0.8,
        (RX, "train_images", "Loader, numpy"),
        (MM, "train_images", "bare np.take"),
    ),
    Target(
        3,
        "images, jax.Array out, vs bare np.take gather + the same placement",
        0.8,
        (RX, "train_images", "Loader, jax"),
        (MM, "train_images", "bare np.take gather +"),
    ),
    Target(
        3,
        "token windows vs grain (its best setting)",
        3.0,
        (RX, "train_tokens", "Loader, jax"),
        ("grain", "train_tokens", None),
    ),
    Target(
        3,
        "images vs grain (its best setting)",
        3.0,
        (RX, "train_images", "Loader, jax"),
        ("grain", "train_images", None),
    ),
    Target(
        3,
        "token windows vs PyPI roxxel 0.9.14 stream",
        1.5,
        (RX, "train_tokens", "Loader, jax"),
        ("roxxel 0.9.14", "train_tokens", None),
    ),
    Target(
        3,
        "cold cache: shuffled image batches vs a plain np.memmap reader",
        2.0,
        (RX, "train_images_cold", None),
        (MM, "train_images_cold", None),
    ),
    Target(
        3,
        "time to first batch at steps 0, 1e6, 1e9, 1e12 within 1.5x of each other",
        1.5,
        spread=tuple((RX, "resume", f"step {s}") for s in ("0", "1e6", "1e9", "1e12")),
    ),
    Target(
        3,
        "jitted step ~10x the loader's batch time: fed by the Loader vs a prebuilt array",
        0.95,
        (RX, "train_step", "jitted step fed by the Loader"),
        (RX, "train_step", "jitted step fed by a prebuilt"),
    ),
    Target(
        3,
        "memory flat over an epoch: anon RSS at its start, middle, end within 1.05x",
        1.05,
        spread=tuple(
            (RX, "train_memory", f"anon RSS, epoch {at}") for at in ("start", "middle", "end")
        ),
    ),
    Target(
        4,
        "32 sources, 8 phases: first batch at step 1e9 within 1.5x of step 0",
        1.5,
        spread=(
            (RX, "resume_mix", "32 sources, 8 phases: step 0"),
            (RX, "resume_mix", "32 sources, 8 phases: step 1e9"),
        ),
    ),
    Target(
        4,
        "mixture of 4 sources: loader throughput at most 10% below one source",
        0.9,
        (RX, "train_tokens", "Loader(Mixture"),
        (RX, "train_tokens", "Loader(TokenWindows)"),
    ),
    Target(
        5,
        "roxxel pack of the JSONL corpus, 1 worker, vs the fastest peer writer",
        1.0,
        (RX, "pack_lm", PACK_W1),
        den_best=tuple((p, "pack_lm", None) for p in PACK_PEERS),
    ),
    Target(
        5,
        "roxxel pack of the .npy images, 1 worker, vs the fastest peer writer",
        1.0,
        (RX, "pack_images", PACK_W1),
        den_best=tuple((p, "pack_images", None) for p in PACK_PEERS),
    ),
    *_workers_targets("pack_lm", "JSONL corpus"),
    *_workers_targets("pack_images", ".npy images"),
    Target(
        14,
        "host transform as costly as the read: host_threads=2 vs 1 (2 cores)",
        1.6,
        (RX, "train_host_threads", "Loader, host transform, host_threads=2"),
        (RX, "train_host_threads", "Loader, host transform, host_threads=1"),
    ),
    *(
        Target(
            16,
            f"{what}: a first pass over a fresh mapping vs the same batches, pages mapped",
            0.8,
            (RX, "train_first_pass", f"{what}: first pass"),
            (RX, "train_first_pass", f"{what}: same batches"),
        )
        for what in ("token windows 64 x 2048", "images 256 x 3x64x64")
    ),
    Target(
        6,
        "fit with an Orbax checkpoint every 50 steps vs none: steady-state steps/s, same run",
        0.95,
        (RX, "train_checkpoint", "fit, Orbax checkpoint every"),
        (RX, "train_checkpoint", "fit, no checkpoint"),
    ),
)


def pick(rows: list[Row], sel: Pick) -> float | None:
    """The value of the first row matching (system, workload, variant prefix), or the best."""
    system, workload, prefix = sel
    got = [r for r in rows if r.system == system and r.workload == workload and r.value]
    if prefix is not None:
        got = [r for r in got if r.variant == prefix or r.variant.startswith(prefix)]
        return got[0].value if got else None
    if not got:
        return None
    best = max if got[0].higher_is_better else min
    return best(r.value for r in got if r.value is not None)


def best_of(rows: list[Row], sels: tuple[Pick, ...]) -> float | None:
    """The highest value among the rows `sels` pick (None when none of them ran)."""
    vals = [v for v in (pick(rows, s) for s in sels) if v is not None]
    return max(vals) if vals else None


def measure(rows: list[Row], target: Target) -> float | None:
    """The target's measured ratio (or spread), None when a row is missing."""
    if target.spread:
        vals = [pick(rows, s) for s in target.spread]
        if any(v is None for v in vals):
            return None
        return max(vals) / min(vals)  # type: ignore[type-var]
    num = pick(rows, target.num) if target.num else None
    den = pick(rows, target.den) if target.den else best_of(rows, target.den_best)
    return None if num is None or not den else num / den


def render_targets(rows: list[Row], spec: str = "full") -> str:
    """A markdown table: issue, target, threshold, measured, met / missed / — (a row is
    missing, or a `full_only` target in a run of another size)."""
    lines = ["| issue | target | needs | measured | verdict |", "|---:|---|---:|---:|---|"]
    for t in TARGETS:
        got = measure(rows, t)
        op = "<=" if t.spread else ">="
        ok = None if got is None else (got <= t.threshold if t.spread else got >= t.threshold)
        verdict = "—" if ok is None else ("met" if ok else "**missed**")
        if t.full_only and spec != "full":
            verdict = "— (judged at --full)"
        shown = "—" if got is None else f"{got:.2f}x"
        lines.append(f"| {t.issue} | {t.label} | {op} {t.threshold:.2g}x | {shown} | {verdict} |")
    return "\n".join(lines) + "\n"
