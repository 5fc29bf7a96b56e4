"""Curriculum phases and caps: the configuration values of a mixture, and its step schedule.

A `Schedule` turns phases into arithmetic: the step and position where each phase starts,
with positions summed as steps x batch size of the earlier phases. A `Space` is what one
source draws from in one phase (its token windows at the phase's ``seq_len``), and a
`Ledger` what each source has drawn so far. Integers in, integers out; every invalid value
raises `ConfigError` naming the phase at fault.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence, Sized
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from roxxel.errors import ConfigError
from roxxel.protocols import CountsTokens, TokenSource
from roxxel.sampling.interleave import PhaseStream
from roxxel.sampling.order import MAX_POSITION, check_count

__all__ = ["Cap", "Ledger", "Phase", "Schedule", "Space", "phase_spaces", "source_space"]

Weight = float | int | Fraction


@dataclass(frozen=True, slots=True)
class Phase:
    """A curriculum phase: weights over the sources, until ``end_step`` (exclusive).

    Phases run back to back: a phase starts where the previous one ended (step 0 for the
    first) and ends at ``end_step``; only the last may leave it ``None`` (it runs until its
    sources are exhausted, or for ever). A last phase with an ``end_step`` ends the stream
    there. Sources left out of ``weights`` have weight 0. ``batch_size`` overrides the
    mixture's for this phase (``None``: inherit). ``seq_len`` is the token window length of
    this phase for every source that has one (a `roxxel.TokenWindows`): its windows are cut
    at this length, with a fresh shuffle of its own (``None``: each source's own length).
    """

    weights: Mapping[str, Weight]
    end_step: int | None = None
    batch_size: int | None = None
    seq_len: int | None = None

    def __repr__(self) -> str:
        """``Phase({'web': 0.7, 'code': 1/3}, end_step=10)``: the fields that are set."""
        fields = [("end_step", self.end_step), ("batch_size", self.batch_size)]
        fields.append(("seq_len", self.seq_len))
        rest = "".join(f", {name}={value!r}" for name, value in fields if value is not None)
        return f"Phase({weights_text(self.weights)}{rest})"


def weights_text(weights: object) -> str:
    """Weights as a short dict display, fractions as ``p/q``: ``{'a': 0.7, 'b': 1/3}``."""
    if not isinstance(weights, Mapping):
        return repr(weights)
    return "{" + ", ".join(f"{k!r}: {_number_text(w)}" for k, w in weights.items()) + "}"


def _number_text(value: object) -> str:
    return str(value) if isinstance(value, Fraction) else repr(value)


@dataclass(frozen=True, slots=True)
class Cap:
    """The most a source may supply over the whole run: ``epochs`` (fractional allowed) or
    ``samples``, exactly one. ``epochs`` means ``floor(epochs * len(source))`` samples."""

    epochs: Weight | None = None
    samples: int | None = None


def fail(where: str, what: str, found: object, rule: str) -> ConfigError:
    return ConfigError(f"{where}: {what} ({found!r}, expected {rule})")


MAX_WEIGHT_RATIO = 1 << 53
"""The largest weight of a phase is at most this times its smallest non-zero one."""
MAX_WEIGHT = 1 << 128
"""The weights of a phase as the smallest integers in their ratios stay at most this."""


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
    """The smallest integers in the ratios of ``weights``.

    Raises:
        ConfigError: all weights zero, a largest weight more than `MAX_WEIGHT_RATIO` times
            the smallest non-zero one, or integers past `MAX_WEIGHT` (weights whose common
            denominator is astronomically large).
    """
    if not any(weights):
        raise fail(where, "all weights are zero", [str(w) for w in weights], "a weight > 0")
    used = [w for w in weights if w]
    if max(used) > MAX_WEIGHT_RATIO * min(used):
        ratio = max(used) / min(used)  # exact; its log2 from the integers, never a float
        power = math.floor(math.log2(ratio.numerator) - math.log2(ratio.denominator))
        raise fail(where, "weights too far apart", f"max/min > 2**{power}", "max/min <= 2**53")
    scale = math.lcm(*(w.denominator for w in weights))
    ints = [int(w * scale) for w in weights]
    divisor = math.gcd(*ints)
    ints = [i // divisor for i in ints]
    if max(ints) > MAX_WEIGHT:
        found = f"{max(ints).bit_length()}-bit integer weights"
        rule = "a common denominator that keeps them <= 2**128"
        raise fail(where, "weights with too large a common denominator", found, rule)
    return tuple(ints)


def check_sources(sources: object) -> None:
    """Raise `ConfigError` unless ``sources`` maps non-empty names to non-empty sized objects."""
    if not isinstance(sources, Mapping) or not sources:
        raise fail("Mixture: sources", "no sources", sources, "a name -> source mapping")
    for name, source in sources.items():
        where = f"Mixture: sources[{name!r}]"
        if not isinstance(name, str) or not name:
            raise fail("Mixture: sources", "bad source name", name, "a non-empty str")
        if not isinstance(source, Sized):
            raise fail(where, "no length", type(source).__name__, "an object with __len__")
        if len(source) < 1:
            raise fail(where, "empty source", len(source), "at least 1 sample")


def cap_units(where: str, cap: Cap | Weight, num_records: int, unit: int = 1) -> int:
    """A cap in units (tokens of a token-window source, else samples): ``epochs`` means
    ``floor(epochs * num_records * unit)``, ``samples`` means ``samples * unit``.

    >>> cap_units("c", 1.5, 10), cap_units("c", Cap(epochs=0.55), 10, 4)
    (15, 22)
    """
    if not isinstance(cap, Cap):
        cap = Cap(epochs=cap)
    if (cap.epochs is None) == (cap.samples is None):
        raise fail(where, "a cap needs exactly one of epochs and samples", cap, "one")
    if cap.samples is not None:
        return check_count(f"{where}.samples", cap.samples) * unit
    units = math.floor(exact_number(f"{where}.epochs", cap.epochs) * num_records * unit)
    if units // unit > MAX_POSITION:
        found = f"{cap.epochs} epochs of {num_records}, {units // unit} samples"
        raise fail(
            f"{where}.epochs", "too large", found, "<= 2**62 samples, the limit of positions"
        )
    return units


def own_unit(source: object) -> int:
    """Tokens per sample of a source at its own window length; 1 for a source without one
    (one that is not a `roxxel.protocols.TokenSource`)."""
    if not isinstance(source, TokenSource):
        return 1
    length = source.seq_len
    return length if isinstance(length, int) and length > 0 else 1


@dataclass(frozen=True, slots=True)
class Space:
    """The samples one source draws from in one phase.

    Attributes:
        key: what its epoch permutations are keyed by: the source name at its own window
            length, ``"<name>|seq_len=<L>"`` at another length ``L``.
        size: its samples (windows at that length, or the source's records).
        unit: tokens per sample (the window length; 1 for a source without one).
        source: what the loader reads: the source, or its ``with_seq_len(L)`` view.
    """

    key: str
    size: int
    unit: int
    source: Any


def source_space(where: str, name: str, source: object, seq_len: int | None, views: dict) -> Space:
    """The `Space` of ``source`` under a phase's ``seq_len``; ``views`` caches the
    ``with_seq_len`` views by (name, length), so phases of one length share one view.

    Raises:
        ConfigError: a phase length for a source that states ``tokens_per_sample`` but
            cannot change its window length (it would be planned at the wrong length).
    """
    unit = own_unit(source)
    if not isinstance(source, TokenSource):
        stated = source.tokens_per_sample if isinstance(source, CountsTokens) else None
        if seq_len is not None and stated is not None and stated != seq_len:
            rule = "a source with with_seq_len, such as TokenWindows"
            raise fail(where, "cannot change its window length", type(source).__name__, rule)
        return Space(name, len(source), 1, source)  # type: ignore[arg-type]
    if seq_len is None or seq_len == unit:
        return Space(name, len(source), unit, source)  # type: ignore[arg-type]
    if (name, seq_len) not in views:
        views[name, seq_len] = source.with_seq_len(seq_len)
    view = views[name, seq_len]
    return Space(f"{name}|seq_len={seq_len}", len(view), seq_len, view)


def phase_spaces(
    phases: Sequence[Phase], weights: Sequence[Sequence[int]], sources: Mapping[str, object]
) -> list[tuple[Space, ...]]:
    """Each phase's `Space` of each source, by source id; phases of one length share views.

    Raises:
        ConfigError: as `source_space`, or a source the phase weights with no window at
            the phase's length.
    """
    views: dict = {}
    found = []
    for p, phase in enumerate(phases):
        where = f"Mixture: phases[{p}].seq_len"
        spaces = tuple(
            source_space(f"{where}: sources[{n!r}]", n, s, phase.seq_len, views)
            for n, s in sources.items()
        )
        for name, space, w in zip(sources, spaces, weights[p], strict=True):
            if w and space.size < 1:
                rule = "at least 1 window at this length"
                raise fail(f"{where}: sources[{name!r}]", "no samples", space.size, rule)
        found.append(spaces)
    return found


def refilled(
    stream: PhaseStream, allowance: list, caps: Sequence, units: Sequence, upto: int | None = None
) -> list:
    """Allowances (in units) after a phase, or after its first ``upto`` positions: each
    refill cycle begun adds the phase's cap, in whole samples of the phase's length, to
    each source the phase weights."""
    first, n = stream.first.total or 0, stream.length if upto is None else upto
    if stream.cycle is None or n is None or n <= first:
        return allowance
    rounds = -(-(n - first) // (stream.cycle.total or 1))
    weights = stream.first.weights
    return [
        a if a is None or cap is None or w == 0 else a + rounds * cap * u
        for a, cap, u, w in zip(allowance, caps, units, weights, strict=True)
    ]


def phase_caps(cap_units: Sequence, spaces: Sequence[Space]) -> tuple[list, list[int]]:
    """Each source's cap in samples at a phase's window lengths, and those lengths' units."""
    units = [s.unit for s in spaces]
    return [None if c is None else c // u for c, u in zip(cap_units, units, strict=True)], units


def refills_before(
    stream: PhaseStream, allowance: list, cap_units: Sequence, spaces: Sequence[Space], upto: int
) -> tuple[int, ...]:
    """The units refills have given each capped source in a phase's first ``upto``
    positions and before it (``allowance``: the phase's, at its start)."""
    after = refilled(stream, allowance, *phase_caps(cap_units, spaces), upto)
    return tuple(0 if c is None else a - c for a, c in zip(after, cap_units, strict=True))


@dataclass(frozen=True, slots=True)
class Ledger:
    """What each source has drawn so far, by source id: draws over all lengths, units
    (tokens, or samples) they cost, and draws per space key (a source's draws at one length).
    """

    draws: tuple[int, ...]
    units: tuple[int, ...]
    by_space: Mapping[str, int]

    @staticmethod
    def empty(num_sources: int) -> Ledger:
        return Ledger((0,) * num_sources, (0,) * num_sources, {})

    def after(self, spaces: Sequence[Space], counts: Sequence[int]) -> Ledger:
        """The ledger once each source ``k`` has drawn ``counts[k]`` more in ``spaces[k]``."""
        by_space = dict(self.by_space)
        for space, count in zip(spaces, counts, strict=True):
            if count:
                by_space[space.key] = by_space.get(space.key, 0) + int(count)
        return Ledger(
            tuple(d + int(c) for d, c in zip(self.draws, counts, strict=True)),
            tuple(u + int(c) * s.unit for u, c, s in zip(self.units, counts, spaces, strict=True)),
            by_space,
        )

    def bases(self, spaces: Sequence[Space]) -> np.ndarray:
        """Per source, the draws already made in its space (int64): where its next one falls."""
        return np.asarray([self.by_space.get(s.key, 0) for s in spaces], np.int64)


class Schedule:
    """Where each phase starts, in steps and in positions. O(P) to build, O(log P) to query.

    Args:
        phases: the validated order of phases; ``end_step`` must increase.
        batch_size: the default batch size (``None``: every phase must set one).
        origin_step: the first step (0, or where a continued schedule starts).
        origin_position: the position of ``origin_step``.

    Raises:
        ConfigError: no phases, unordered or overlapping phases, an open-ended phase that is
            not the last, a batch size or seq_len that is not a positive int, or a step,
            batch size or position past `roxxel.sampling.order.MAX_POSITION` (2**62).
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
                if position > MAX_POSITION:
                    found = f"{step} steps reach position {position}"
                    rule = "<= 2**62, the limit of steps and positions"
                    raise fail(f"Mixture: phases[{i}].end_step", "too many positions", found, rule)
        self.end_step: int | None = phases[-1].end_step

    @staticmethod
    def _check_phase(i: int, phase: Phase, batch_size: int | None, step: int) -> int:
        where = f"Mixture: phases[{i}]"
        if phase.batch_size is not None:
            check_count(f"{where}.batch_size", phase.batch_size, 1)
        if phase.seq_len is not None:
            check_count(f"{where}.seq_len", phase.seq_len, 1)
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
            if phase.end_step is not None and check_count(where, phase.end_step) <= step:
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
        step = check_count("Mixture: step", step, low=None)
        if step < self.origin_step or (self.end_step is not None and step >= self.end_step):
            rule = f"[{self.origin_step}, {self.end_step})"
            raise IndexError(f"Mixture: step out of range ({step}, expected {rule})")
        return bisect.bisect_right(self.step_starts, step) - 1

    def position_at(self, step: int) -> int:
        """The first position of ``step`` (``end_step`` allowed: the position after the last)."""
        p = len(self.step_starts) - 1 if step == self.end_step else self.phase_at(step)
        position = self.pos_starts[p] + (int(step) - self.step_starts[p]) * self.batch_sizes[p]
        if position > MAX_POSITION:
            rule = "<= 2**62, the limit of steps and positions"
            raise fail("Mixture: step", "past the last position", f"{step} at {position}", rule)
        return position

    def step_at(self, position: int) -> int:
        """The step whose batch holds ``position``."""
        position = self.check_position(position)
        p = bisect.bisect_right(self.pos_starts, position) - 1
        return self.step_starts[p] + (position - self.pos_starts[p]) // self.batch_sizes[p]

    def check_position(self, position: int) -> int:
        """``position`` as an int; `IndexError` if it lies before the origin, `ConfigError`
        past `roxxel.sampling.order.MAX_POSITION` (which a range's stop may equal)."""
        position = check_count("Mixture: position", position, low=None)
        if position < self.origin_position:
            rule = f">= {self.origin_position}"
            raise IndexError(f"Mixture: position before the origin ({position}, expected {rule})")
        return position
