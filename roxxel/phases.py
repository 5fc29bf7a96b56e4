"""Curriculum phases and caps: the configuration values of a mixture, and its step schedule.

A `Schedule` turns phases into arithmetic: the step and position where each phase starts,
with positions summed as steps x batch size of the earlier phases. Integers in, integers
out; every invalid value raises `ConfigError` naming the phase at fault.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from roxxel.errors import ConfigError

__all__ = ["Cap", "Phase", "Schedule"]

Weight = float | int | Fraction


@dataclass(frozen=True, slots=True)
class Phase:
    """A curriculum phase: weights over the sources, until ``end_step`` (exclusive).

    Phases run back to back: a phase starts where the previous one ended (step 0 for the
    first) and ends at ``end_step``; only the last may leave it ``None`` (it runs until its
    sources are exhausted, or for ever). A last phase with an ``end_step`` ends the stream
    there. Sources left out of ``weights`` have weight 0. ``batch_size`` and ``seq_len``
    override the mixture's for this phase (``None``: inherit).
    """

    weights: Mapping[str, Weight]
    end_step: int | None = None
    batch_size: int | None = None
    seq_len: int | None = None


@dataclass(frozen=True, slots=True)
class Cap:
    """The most a source may supply over the whole run: ``epochs`` (fractional allowed) or
    ``samples``, exactly one. ``epochs`` means ``floor(epochs * len(source))`` samples."""

    epochs: Weight | None = None
    samples: int | None = None


def fail(where: str, what: str, found: object, rule: str) -> ConfigError:
    return ConfigError(f"{where}: {what} ({found!r}, expected {rule})")


def check_int(where: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or int(value) < low:
        raise fail(where, "not a valid integer", value, f"an int >= {low}")
    return int(value)


def exact_number(where: str, value: object) -> Fraction:
    """A weight or epoch count as an exact rational: a float by its shortest decimal form."""
    if isinstance(value, bool) or not isinstance(value, int | float | Fraction | np.number):
        raise fail(where, "not a number", value, "a finite number >= 0")
    if isinstance(value, float | np.floating):
        if not math.isfinite(float(value)):
            raise fail(where, "not finite", value, "a finite number >= 0")
        value = Fraction(repr(float(value)))
    number = Fraction(value)  # type: ignore[arg-type]
    if number < 0:
        raise fail(where, "negative", str(number), "a finite number >= 0")
    return number


def integer_weights(where: str, weights: Sequence[Fraction]) -> tuple[int, ...]:
    if not any(weights):
        raise fail(where, "all weights are zero", [str(w) for w in weights], "a weight > 0")
    scale = math.lcm(*(w.denominator for w in weights))
    ints = [int(w * scale) for w in weights]
    divisor = math.gcd(*ints)
    return tuple(i // divisor for i in ints)


def cap_samples(where: str, cap: Cap | Weight, num_records: int) -> int:
    if not isinstance(cap, Cap):
        cap = Cap(epochs=cap)
    if (cap.epochs is None) == (cap.samples is None):
        raise fail(where, "a cap needs exactly one of epochs and samples", cap, "one")
    if cap.samples is not None:
        return check_int(f"{where}.samples", cap.samples, 0)
    return math.floor(exact_number(f"{where}.epochs", cap.epochs) * num_records)


class Schedule:
    """Where each phase starts, in steps and in positions. O(P) to build, O(log P) to query.

    Args:
        phases: the validated order of phases; ``end_step`` must increase.
        batch_size: the default batch size (``None``: every phase must set one).
        origin_step: the first step (0, or where a continued schedule starts).
        origin_position: the position of ``origin_step``.

    Raises:
        ConfigError: no phases, unordered or overlapping phases, an open-ended phase that is
            not the last, a batch size or seq_len that is not a positive int.
    """

    def __init__(
        self,
        phases: Sequence[Phase],
        batch_size: int | None,
        origin_step: int,
        origin_position: int,
    ) -> None:
        if not phases:
            raise fail("Mixture: phases", "no phases", [], "at least one Phase")
        self.origin_step, self.origin_position = origin_step, origin_position
        self.check_ends(phases)
        step, position = origin_step, origin_position
        self.step_starts: list[int] = []
        self.pos_starts: list[int] = []
        self.batch_sizes: list[int] = []
        for i, phase in enumerate(phases):
            batch = self._check_phase(i, phase, batch_size, step)
            self.step_starts.append(step)
            self.pos_starts.append(position)
            self.batch_sizes.append(batch)
            if phase.end_step is not None:
                position += (phase.end_step - step) * batch
                step = phase.end_step
        self.end_step: int | None = phases[-1].end_step

    @staticmethod
    def _check_phase(i: int, phase: Phase, batch_size: int | None, step: int) -> int:
        where = f"Mixture: phases[{i}]"
        for attr in ("batch_size", "seq_len"):
            if getattr(phase, attr) is not None:
                check_int(f"{where}.{attr}", getattr(phase, attr), 1)
        batch = phase.batch_size or batch_size
        if batch is None:
            raise fail(f"{where}.batch_size", "no batch size", None, "Phase or Mixture batch_size")
        return batch

    def check_ends(self, phases: Sequence[Phase]) -> None:
        """Raise `ConfigError` unless the phases' ``end_step`` values strictly increase."""
        step = self.origin_step
        for i, phase in enumerate(phases):
            where = f"Mixture: phases[{i}].end_step"
            if phase.end_step is None and i != len(phases) - 1:
                raise fail(where, "only the last phase may be open-ended", None, "an int")
            if phase.end_step is not None and check_int(where, phase.end_step, 0) <= step:
                rule = f"> {step}, where this phase starts"
                raise fail(where, "phases overlap or are out of order", phase.end_step, rule)
            step = phase.end_step if phase.end_step is not None else step

    def num_positions(self, phase: int) -> int | None:
        """The positions of phase ``phase`` (``None``: the open-ended last phase)."""
        end = self.end_step if phase + 1 == len(self.step_starts) else self.step_starts[phase + 1]
        if end is None:
            return None
        return (end - self.step_starts[phase]) * self.batch_sizes[phase]

    def phase_at(self, step: int) -> int:
        """The index of the phase that holds ``step``.

        Raises:
            IndexError: a step before the origin, or at or after the last ``end_step``.
        """
        step = int(step)
        if step < self.origin_step or (self.end_step is not None and step >= self.end_step):
            rule = f"[{self.origin_step}, {self.end_step})"
            raise IndexError(f"Mixture: step out of range ({step}, expected {rule})")
        return bisect.bisect_right(self.step_starts, step) - 1

    def position_at(self, step: int) -> int:
        """The first position of ``step`` (``end_step`` allowed: the position after the last)."""
        p = len(self.step_starts) - 1 if step == self.end_step else self.phase_at(step)
        return self.pos_starts[p] + (int(step) - self.step_starts[p]) * self.batch_sizes[p]

    def step_at(self, position: int) -> int:
        """The step whose batch holds ``position``."""
        position = self.check_position(position)
        p = bisect.bisect_right(self.pos_starts, position) - 1
        return self.step_starts[p] + (position - self.pos_starts[p]) // self.batch_sizes[p]

    def check_position(self, position: int) -> int:
        """``position`` as an int; `IndexError` if it lies before the origin."""
        position = int(position)
        if position < self.origin_position:
            rule = f">= {self.origin_position}"
            raise IndexError(f"Mixture: position before the origin ({position}, expected {rule})")
        return position
