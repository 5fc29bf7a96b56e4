"""Steady-state step time of a training loop from the moments it asked for each batch (pure).

A loop that asks its loader for batch s at ``times[s]`` spent ``times[s + 1] - times[s]`` on
iteration s: dispatching step s, any wait for the device, and the save that follows step s
when one does. Rates over a window of whole save intervals therefore include every cost of
checkpointing that lands inside the loop, also the background write competing for the CPU.

>>> times = [0.0, 2.0, 2.1, 2.4, 2.5, 2.6, 2.9, 3.0]  # compile, then 0.1 s steps
>>> round(window_rate(times, start=1, num_steps=6), 6)  # a save after every 3rd step
6.0
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

__all__ = ["cost_per_save", "paired_ratio", "window_rate"]


def _check(times: Sequence[float], start: int, num_steps: int) -> None:
    if start < 0 or num_steps < 1 or start + num_steps >= len(times):
        raise ValueError(
            f"steptime: window [{start}, {start + num_steps}] does not fit "
            f"({len(times)} timestamps, expected more than start + num_steps)"
        )


def window_rate(times: Sequence[float], start: int, num_steps: int) -> float:
    """Steps per second over iterations ``[start, start + num_steps)``."""
    _check(times, start, num_steps)
    return num_steps / (times[start + num_steps] - times[start])


def cost_per_save(base_rate: float, save_rate: float, num_steps: int, num_saves: int) -> float:
    """Seconds each save added to a window of `num_steps`, from the rates with and without.

    Counts everything saving costs the loop: the wait for pending steps before it, the
    blocking part of the save, and the background write slowing the steps after it.

    >>> round(cost_per_save(10.0, 9.0, num_steps=90, num_saves=2), 6)
    0.5
    """
    if num_saves < 1:
        raise ValueError(f"steptime: cost_per_save of {num_saves} saves (expected >= 1)")
    return num_steps * (1 / save_rate - 1 / base_rate) / num_saves


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """Median of ``num[i] / den[i]`` over rounds measured side by side.

    >>> paired_ratio([9.0, 10.0, 5.0], [10.0, 10.0, 10.0])
    0.9
    """
    if len(num) != len(den) or not num:
        raise ValueError(
            f"steptime: paired_ratio needs rounds in pairs ({len(num)} vs {len(den)}, "
            "expected equal, non-zero lengths)"
        )
    return statistics.median(n / d for n, d in zip(num, den, strict=True))
