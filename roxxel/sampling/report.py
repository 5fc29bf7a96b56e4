"""See a curriculum before spending a cluster on it: per-phase tables and a share plot.

`plan_report` prints, per phase and source, the samples, tokens and epochs the mixture will
draw and the step at which each capped source runs out. `plot_shares` draws each source's
share of the batch over the steps (matplotlib, the optional ``plot`` extra, is imported
only there). Both are exact: they seek the mixture, they never iterate it.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np

from roxxel.errors import ConfigError
from roxxel.protocols import CountsTokens
from roxxel.sampling.mixture import Mixture
from roxxel.sampling.order import check_count

__all__ = ["plan_report", "plot_shares", "share_curve"]


def _last_step(mixture: Mixture, num_steps: int | None, where: str) -> int:
    """The step after the last one planned: ``num_steps``, or where the stream ends."""
    if num_steps is not None:
        num_steps = check_count(f"{where}: num_steps", num_steps, mixture.origin_step + 1)
        return num_steps if mixture.end_step is None else min(num_steps, mixture.end_step)
    if mixture.num_positions is not None:
        return mixture.step_at(max(mixture.num_positions - 1, 0)) + 1
    if mixture.end_step is not None:
        return mixture.end_step
    raise ConfigError(
        f"{where}: the stream never ends (no end_step, no caps that stop it, expected num_steps)"
    )


def _tokens_per_sample(mixture: Mixture, phase: int, source: int) -> int | None:
    """The window length the source has in this phase, else its ``tokens_per_sample``."""
    space = mixture.spaces(phase)[source]
    if space.unit > 1:
        return space.unit
    if not isinstance(space.source, CountsTokens):
        return None
    value = space.source.tokens_per_sample
    return value if isinstance(value, int) else None


def _row(cells: list[str], widths: list[int]) -> str:
    padded = [
        c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    ]
    return "  ".join(padded).rstrip()


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [_row(r, widths) for r in rows]


def _phase_rows(
    mixture: Mixture, phase: int, span: tuple[int, int], runs_out: dict[str, int], tokens: list
) -> list[list[str]]:
    """The table rows of one phase; adds each source's tokens to ``tokens`` (None: unknown).
    Epochs are counted in the source's samples at the phase's window length."""
    first, last = span
    lo, hi = mixture.counts(mixture.position_at(first)), mixture.counts(mixture.position_at(last))
    weights = mixture.phases[phase].weights
    total = sum(float(w) for w in weights.values())
    rows = []
    for k, name in enumerate(mixture.names):
        samples = int(hi[k] - lo[k])
        per = _tokens_per_sample(mixture, phase, k)
        out = runs_out.get(name)
        if tokens[k] is not None and samples:
            tokens[k] = None if per is None else tokens[k] + samples * per
        rows.append(
            [
                f"  {name}",
                f"{100 * float(weights.get(name, 0)) / total:.2f}%",
                f"{samples:,}",
                "-" if per is None else f"{samples * per:,}",
                f"{samples / mixture.spaces(phase)[k].size:.3f}",
                f"{out:,}" if out is not None and first <= out < last else "",
            ]
        )
    return rows


def _exhausted_lines(mixture: Mixture) -> list[str]:
    """A line per capped source that runs dry, then one if the stream ends before its
    schedule does (before a later phase, or before the last phase's ``end_step``)."""
    policy = mixture.on_exhausted
    lines = [
        f"source {name!r} is exhausted at step {mixture.step_at(position - 1):,} (its cap, "
        f"{mixture.caps[mixture.names.index(name)]:,} samples; on_exhausted={policy})"
        for name, position in sorted(mixture.exhausted_at().items(), key=lambda item: item[1])
    ]
    end = mixture.num_positions
    if end is None or end == mixture.schedule.origin_position:
        return lines
    last = mixture.step_at(end - 1)  # the last step with data; it may be partial
    phase, rows = mixture.phase_at(last), end - mixture.position_at(last)
    batch = mixture.batch_size_at(last)
    partial = "" if rows == batch else f" (its last batch has {rows} of {batch} rows)"
    why = f"every source of phase {phase} is exhausted (on_exhausted={policy})"
    starts = mixture.schedule.step_starts
    if phase + 1 < len(starts):
        lines.append(
            f"the mixture ends at step {last + 1:,}{partial}, before phase {phase + 1} "
            f"(steps from {starts[phase + 1]:,}): {why}"
        )
    elif mixture.end_step is not None and last + 1 < mixture.end_step:
        lines.append(
            f"the mixture ends at step {last + 1:,}{partial}, before the end_step of phase "
            f"{phase} ({mixture.end_step:,}): {why}"
        )
    return lines


def plan_report(mixture: Mixture, num_steps: int | None = None) -> str:
    """A text table per phase and source: weight, samples, tokens, epochs, and the step at
    which each capped source runs out (its last draw under its cap). Lines before the
    tables name each source that runs dry and, when the stream ends before its schedule
    does (before a later phase or the last ``end_step``), the step where it ends.

    Tokens are samples times the source's window length in that phase (the phase's
    ``seq_len`` for token windows), else its ``tokens_per_sample`` attribute (``-`` when
    neither is known); epochs count samples at that length. ``num_steps`` limits the plan (exclusive); it is
    required when the stream never ends. O(P (K log K)) exact work, whatever the steps.

    Raises:
        ConfigError: an endless stream without ``num_steps``, or a bad ``num_steps``.
    """
    stop = _last_step(mixture, num_steps, "plan_report")
    end = mixture.num_positions
    runs_out = {n: mixture.step_at(p - 1) for n, p in mixture.exhausted_at().items()}
    lines = [
        f"mixture {mixture.fingerprint()}: {len(mixture.names)} sources, {len(mixture.phases)} phases, "
        f"seed {mixture.seed}, on_exhausted={mixture.on_exhausted}",
        f"stream: {'unbounded' if end is None else f'{end:,} positions'}; planned steps "
        f"[{mixture.origin_step:,}, {stop:,})",
        *_exhausted_lines(mixture),
    ]
    header = ["source", "weight", "samples", "tokens", "epochs", "runs out at step"]
    starts, tokens = mixture.schedule.step_starts, [0] * len(mixture.names)
    for p in range(len(mixture.phases)):
        first = starts[p]
        last = min(stop, starts[p + 1] if p + 1 < len(starts) else stop)
        if first >= stop:
            break
        batch, seq_len = mixture.schedule.batch_sizes[p], mixture.phases[p].seq_len
        length = "" if seq_len is None else f", seq_len {seq_len}"
        lines.append(f"phase {p}: steps [{first:,}, {last:,}), batch {batch}{length}")
        lines.extend(_table([header, *_phase_rows(mixture, p, (first, last), runs_out, tokens)]))
    total = mixture.counts(mixture.position_at(stop)) - mixture.counts(
        mixture.position_at(mixture.origin_step)
    )
    lines.append(
        "total: " + ", ".join(f"{n} {int(c):,}" for n, c in zip(mixture.names, total, strict=True))
    )
    known = [f"{n} {t:,}" for n, t in zip(mixture.names, tokens, strict=True) if t is not None]
    if known:
        lines.append("total tokens: " + ", ".join(known))
    return "\n".join(lines)


def share_curve(
    mixture: Mixture, num_steps: int | None = None, points: int = 256
) -> tuple[np.ndarray, np.ndarray]:
    """Steps ``(points + 1,)`` and each source's share of the positions between consecutive
    steps ``(K, points)``, exactly from `Mixture.counts`. O(points K log K)."""
    stop = _last_step(mixture, num_steps, "share_curve")
    steps = np.unique(np.linspace(mixture.origin_step, stop, points + 1).astype(np.int64))
    counts = np.stack([mixture.counts(mixture.position_at(int(s))) for s in steps], axis=1)
    drawn = np.diff(counts, axis=1).astype(np.float64)
    totals = drawn.sum(axis=0)
    return steps, np.divide(drawn, totals, out=np.zeros_like(drawn), where=totals > 0)


def plot_shares(mixture: Mixture, path: str | Path, num_steps: int | None = None) -> Path:
    """Draw each source's share of the batch over the steps (stacked) into an image file.

    Phase boundaries are dashed lines. Needs matplotlib (``pip install roxxel[plot]``).

    Raises:
        ConfigError: matplotlib is missing, or as `plan_report`.
    """
    try:  # the optional ``plot`` extra: loaded only here, never by ``import roxxel``
        matplotlib = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        plt = importlib.import_module("matplotlib.pyplot")
    except ImportError as error:
        raise ConfigError(
            "plot_shares: matplotlib is not installed (missing, expected `pip install roxxel[plot]`)"
        ) from error
    steps, shares = share_curve(mixture, num_steps)
    figure, axes = plt.subplots(figsize=(10, 4))
    axes.stackplot(steps[:-1], shares, labels=mixture.names, step="post")
    for start in mixture.schedule.step_starts[1:]:
        axes.axvline(start, color="black", linestyle="--", linewidth=0.8)
    axes.set(xlabel="step", ylabel="share of the batch", ylim=(0, 1), title="roxxel mixture shares")
    axes.legend(loc="upper right", fontsize="small")
    figure.tight_layout()
    figure.savefig(Path(path))
    plt.close(figure)
    return Path(path)
