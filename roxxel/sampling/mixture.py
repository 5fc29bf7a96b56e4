"""Mixtures: weighted sources, curriculum phases, caps and exhaustion, as pure integers.

A `Mixture` maps every stream position (``step * batch + row``, arithmetic across phases
of different batch sizes) to a source and a record of that source. Nothing is stored per
position: inside each phase the sources interleave as a capped Sainte-Laguë sequence
(`roxxel.sampling.interleave`), and each source's draws map to records through its per-epoch keyed
permutation (`roxxel.sampling.order`) of the phase's record space: a token-window source's windows
at the phase's ``seq_len`` (`roxxel.sampling.phases.Space`). Seeking anywhere costs O(K log K)
exact integer work.
No files, no jax. The exact semantics are in ``docs/sampling.md``.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Mapping, Sequence, Sized
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np

from roxxel.errors import ConfigError, check_int, without_credentials
from roxxel.sampling.from_toml import OpenSource, looks_like_url, mixture_args, read_toml
from roxxel.sampling.interleave import PhaseStream
from roxxel.sampling.order import check_count, records_for_sources
from roxxel.sampling.phases import (
    Cap,
    Ledger,
    Phase,
    Schedule,
    Space,
    Weight,
    cap_units,
    check_sources,
    exact_number,
    fail,
    integer_weights,
    own_unit,
    phase_caps,
    phase_spaces,
    refilled,
    refills_before,
    weights_text,
)

__all__ = ["Cap", "Mixture", "OnExhausted", "Phase"]

OnExhausted = Literal["stop", "refill"]


@dataclass(frozen=True, slots=True)
class _Options:
    batch_size: int | None
    caps: Mapping[str, Cap | Weight]
    seed: int
    shuffle: bool
    on_exhausted: OnExhausted


@dataclass(frozen=True, slots=True)
class _Origin:
    step: int
    position: int
    ledger: Ledger | None
    parent: str
    refills: tuple[int, ...] | None = None  # units refills gave each source before it


class Mixture:
    """Weighted sources over curriculum phases, with caps, as a pure function of position.

    Args:
        sources: name -> any object with ``__len__`` (records, token windows, ...); a
            source's id is its index in this mapping's order. A source with ``seq_len``
            and ``with_seq_len`` (`roxxel.TokenWindows`) follows each phase's ``seq_len``
            and counts its caps in tokens.
        phases: a sequence of `Phase`, or one weights mapping (a single open-ended phase).
        batch_size: the global batch size of the phases that do not set their own.
        caps: name -> `Cap`, or a number of epochs; sources left out are unlimited.
        seed: keys every epoch permutation (with the source name and the epoch).
        shuffle: ``False`` reads every source's epochs in natural order.
        on_exhausted: ``"stop"``: when every source of the current phase is at its cap,
            the stream ends. ``"refill"``: those sources get their caps again and go on
            drawing where they stopped (the next records of their shuffled epochs).

    Thread-safety: read-only after construction, but for the ``seek_work`` counters.

    >>> m = Mixture({"a": range(10), "b": range(5)}, {"a": 2, "b": 1}, batch_size=3)
    >>> m.draws(0, 9)[0].tolist()  # source ids of the first three steps
    [0, 1, 0, 0, 1, 0, 0, 1, 0]
    >>> m.counts(9).tolist(), m.counts(3 * 10**12).tolist()
    ([6, 3], [2000000000000, 1000000000000])

    Raises:
        ConfigError: any invalid value, naming the phase or source at fault.
    """

    def __init__(
        self,
        sources: Mapping[str, Sized],
        phases: Sequence[Phase] | Mapping[str, Weight],
        *,
        batch_size: int | None = None,
        caps: Mapping[str, Cap | Weight] | None = None,
        seed: int = 0,
        shuffle: bool = True,
        on_exhausted: OnExhausted = "stop",
    ) -> None:
        options = _Options(batch_size, dict(caps or {}), seed, shuffle, on_exhausted)
        self._setup(sources, phases, options, _Origin(0, 0, None, ""))

    @classmethod
    def continue_from(
        cls,
        old: Mixture,
        step: int,
        phases: Sequence[Phase] | Mapping[str, Weight],
        *,
        caps: Mapping[str, Cap | Weight] | None = None,
        on_exhausted: OnExhausted | None = None,
    ) -> Mixture:
        """A new schedule from ``step`` on, each source continuing from the draws it had made.

        The new mixture keeps ``old``'s sources, seed, shuffle and default batch size; its
        phases' ``end_step`` are absolute steps after ``step``. Its first position is
        ``old.position_at(step)`` and each source's next draw is the one ``old`` would have
        made next, so across the switch no draw repeats and none is skipped (at each window
        length). Caps count every draw since step 0, beyond what refills gave back before
        ``step``. Steps before ``step`` are not part of the new mixture.
        """
        step = check_count("Mixture.continue_from: step", step, old.origin_step)
        position = old.position_at(step)
        if old.num_positions is not None and position > old.num_positions:
            rule = f"a step starting at or before position {old.num_positions}"
            raise fail("Mixture.continue_from: step", "after the old stream's end", step, rule)
        new_caps = old._options.caps if caps is None else dict(caps)
        policy = old.on_exhausted if on_exhausted is None else on_exhausted
        options = _Options(old.batch_size, new_caps, old.seed, old.shuffle, policy)
        new = cls.__new__(cls)
        p = old._stream_at(position)  # refills carry over: caps count draws beyond them
        at = (old._cap_units, old._spaces[p], position - old._pos_starts[p])
        refills = refills_before(old._streams[p], old._allowances[p], *at)
        origin = _Origin(step, position, old.ledger_at(position), old.fingerprint(), refills)
        new._setup(dict(zip(old.names, old.sources, strict=True)), phases, options, origin)
        return new

    @classmethod
    def from_toml(cls, path: str | Path, open_source: OpenSource) -> Mixture:
        """The mixture a TOML file describes (schema: ``docs/sampling.md`` §9).

        ``open_source(name, spec)`` opens each ``[sources.NAME]`` table: ``spec`` is the
        table without its cap keys (``epochs``, ``samples``), with ``path`` resolved against
        the file's folder. `roxxel.cli.plan.open_plan_source` is the one ``roxxel plan``
        uses (a dataset's records, or token windows with ``field`` and ``seq_len``).

        Raises:
            ConfigError: invalid TOML, a missing or unknown key, a value of the wrong type
                or any invalid value; the message names the file and the table at fault.
            OSError: the file cannot be read.
        """
        config = read_toml(path)
        path = Path(path)
        return cls.from_config(config, open_source, base_dir=path.parent, where=str(path))

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        open_source: OpenSource,
        *,
        base_dir: Path | None = None,
        where: str = "mixture",
    ) -> Mixture:
        """`from_toml` for an already parsed document (a dict); ``base_dir`` resolves
        relative source paths and ``where`` prefixes error messages."""
        args = mixture_args(
            config, _naming_urls(open_source, where), base_dir=base_dir, where=where
        )
        try:
            return cls(args.sources, args.phases, **args.options)
        except ConfigError as error:
            path = where if base_dir is not None else error.path  # the file, from from_toml
            raise ConfigError(f"{where}: {error}", rule=error.rule, path=path) from None

    def _setup(self, sources, phases, options: _Options, origin: _Origin) -> None:
        self._validate_sources(sources)
        self._validate_options(options)
        self.phases = (Phase(weights=phases),) if isinstance(phases, Mapping) else tuple(phases)
        self._origin = origin
        self._weights = [self._phase_weights(i, p) for i, p in enumerate(self.phases)]
        self.schedule = Schedule(self.phases, self.batch_size, origin.step, origin.position)
        self._spaces = phase_spaces(
            self.phases, self._weights, dict(zip(self.names, self.sources, strict=True))
        )
        self._pos_starts = self.schedule.pos_starts
        self.end_step = self.schedule.end_step
        self._build_streams()

    def _validate_sources(self, sources: Mapping[str, Sized]) -> None:
        check_sources(sources)
        self.names: tuple[str, ...] = tuple(sources)
        self.sources = tuple(sources.values())
        self.sizes = tuple(len(s) for s in self.sources)
        self._units = tuple(own_unit(s) for s in self.sources)

    def _validate_options(self, options: _Options) -> None:
        if options.batch_size is not None:
            check_count("Mixture: batch_size", options.batch_size, 1)
        check_int("Mixture: seed", options.seed, 0)
        if not isinstance(options.shuffle, bool):
            raise fail("Mixture: shuffle", "not a bool", options.shuffle, "True or False")
        if options.on_exhausted not in (policies := get_args(OnExhausted)):
            rule = " or ".join(policies)
            raise fail("Mixture: on_exhausted", "unknown policy", options.on_exhausted, rule)
        caps: list[int | None] = [None] * len(self.names)
        for name, cap in options.caps.items():
            k = self._source_id(f"Mixture: caps[{name!r}]", name)
            where = f"Mixture: caps[{name!r}]"
            caps[k] = cap_units(where, cap, self.sizes[k], self._units[k])
        self._cap_units = tuple(caps)
        self.caps = tuple(
            None if c is None else c // u for c, u in zip(caps, self._units, strict=True)
        )
        self._options = options
        self.batch_size, self.seed, self.shuffle = options.batch_size, options.seed, options.shuffle
        self.on_exhausted: OnExhausted = options.on_exhausted

    def _source_id(self, where: str, name: object) -> int:
        if name not in self.names:
            raise fail(where, "unknown source", name, f"one of {', '.join(self.names)}")
        return self.names.index(name)  # type: ignore[arg-type]

    def _phase_weights(self, index: int, phase: Phase) -> tuple[int, ...]:
        where = f"Mixture: phases[{index}]"
        if not isinstance(phase, Phase) or not isinstance(phase.weights, Mapping):
            raise fail(where, "not a Phase with a weights mapping", phase, "Phase(weights=...)")
        exact = [Fraction(0)] * len(self.names)
        for name, weight in phase.weights.items():
            k = self._source_id(f"{where}.weights", name)
            exact[k] = exact_number(f"{where}.weights[{name!r}]", weight)
        return integer_weights(f"{where}.weights", exact)

    def _build_streams(self) -> None:
        ledger = self._origin.ledger or Ledger.empty(len(self.names))
        refills = self._origin.refills or (0,) * len(self.names)
        caps_now = zip(self._cap_units, refills, strict=True)
        allowance = [None if c is None else c + r for c, r in caps_now]
        refill = self.on_exhausted == "refill"
        self._streams: list[PhaseStream] = []
        self._ledgers: list[Ledger] = []
        self._allowances: list[list[int | None]] = []  # each phase's, at its start
        self.num_positions: int | None = None
        for p, weights in enumerate(self._weights):
            length = self.schedule.num_positions(p)
            caps, units = phase_caps(self._cap_units, self._spaces[p])
            remaining = [
                None if a is None else max(0, a - c) // u
                for a, c, u in zip(allowance, ledger.units, units, strict=True)
            ]
            stream = PhaseStream(weights, remaining, caps, length, refill)
            self._streams.append(stream)
            self._ledgers.append(ledger)
            self._allowances.append(allowance)
            if stream.length is None:
                return
            allowance = refilled(stream, allowance, caps, units)
            ledger = ledger.after(self._spaces[p], stream.counts(stream.length))
            if stream.length != length or p + 1 == len(self.phases):
                self.num_positions = self._pos_starts[p] + stream.length
                return

    # --- steps and positions (see `roxxel.sampling.phases.Schedule`) -------------------------------

    @property
    def origin_step(self) -> int:
        """The first step of this mixture: 0, or the step `continue_from` started at."""
        return self._origin.step

    @property
    def step_starts(self) -> tuple[int, ...]:
        """The first step of each phase: where the batch shape may change."""
        return tuple(self.schedule.step_starts)

    def phase_at(self, step: int) -> int:
        """The index of the phase that holds ``step``. O(log P)."""
        return self.schedule.phase_at(step)

    def batch_size_at(self, step: int) -> int:
        """The global batch size of ``step``."""
        return self.schedule.batch_sizes[self.schedule.phase_at(step)]

    def seq_len_at(self, step: int) -> int | None:
        """The phase's ``seq_len`` override at ``step`` (``None``: the source's own)."""
        return self.phases[self.schedule.phase_at(step)].seq_len

    def spaces(self, phase: int) -> tuple[Space, ...]:
        """Each source's record space in phase ``phase``, by source id: the object the
        loader reads (``space.source``), its size, tokens per sample and permutation key."""
        return self._spaces[phase]

    def position_at(self, step: int) -> int:
        """The first position of ``step`` (``end_step`` allowed: the position after the last)."""
        return self.schedule.position_at(step)

    def step_at(self, position: int) -> int:
        """The step whose batch holds ``position``."""
        return self.schedule.step_at(position)

    # --- seeking ----------------------------------------------------------------------------

    @property
    def seek_work(self) -> int:
        """Exact steps spent seeking so far (instrumentation; independent of the position)."""
        return sum(s.work for s in self._streams)

    def _stream_at(self, position: int) -> int:
        position = self.schedule.check_position(position)
        return min(bisect.bisect_right(self._pos_starts, position), len(self._streams)) - 1

    def counts(self, stop: int) -> np.ndarray:
        """Draws each source has made before position ``stop`` (int64, by source id).

        Includes draws made before a `continue_from` origin; past the end of the stream it
        is the final count. O(K log K + log P) exact work for any ``stop``.
        """
        return np.asarray(self.ledger_at(stop).draws, np.int64)

    def ledger_at(self, stop: int) -> Ledger:
        """What each source has drawn before position ``stop``: draws, units (tokens of a
        token-window source, else samples) and draws per window length. As `counts`."""
        p = self._stream_at(stop)
        local = self._streams[p].counts(int(stop) - self._pos_starts[p])
        return self._ledgers[p].after(self._spaces[p], local)

    def shares(self, stop: int) -> list[Fraction]:
        """The fluid (ideal) draws of each source before ``stop``: the reference of the bound."""
        p = self._stream_at(stop)
        fluid = self._streams[p].fluid(int(stop) - self._pos_starts[p])
        return [c + f for c, f in zip(self._ledgers[p].draws, fluid, strict=True)]

    def draws(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Source ids (int32) and draw indices (int64) of positions ``[start, stop)``.

        Shorter than ``stop - start`` only where the stream ends. O(stop - start) vectorized
        work plus O(K log K) per phase the range touches; never proportional to ``start``.
        """
        parts = [
            (s, d + np.asarray(self._ledgers[p].draws, np.int64)[s])
            for p, s, d in self._parts(start, stop)
        ]
        return _joined(parts)

    def locate(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Source ids (int32) and record indices (int64) of positions ``[start, stop)``.

        In each phase a source's draws at the phase's window length are counted over the
        run (`ledger_at`), and the j-th maps to a sample of its `spaces` through
        `roxxel.sampling.order.records_for_draws`, keyed by (seed, space key, epoch). A range that
        spans phases of different lengths mixes their spaces. Same cost as `draws`.
        """
        parts = []
        for p, sources, draws in self._parts(start, stop):
            spaces, keys = self._spaces[p], {"seed": self.seed, "shuffle": self.shuffle}
            sizes, names = [max(s.size, 1) for s in spaces], [s.key for s in spaces]
            draws = draws + self._ledgers[p].bases(spaces)[sources]
            parts.append((sources, records_for_sources(sizes, sources, draws, names=names, **keys)))
        return _joined(parts)

    def _parts(self, start: int, stop: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Per phase that ``[start, stop)`` touches: (phase, sources, phase-relative draws)."""
        start, stop = self.schedule.check_position(start), int(stop)
        if stop < start:
            raise IndexError(f"Mixture: reversed range ({start}, {stop}), expected start <= stop")
        stop = self.schedule.check_position(stop)
        if self.num_positions is not None:
            start, stop = min(start, self.num_positions), min(stop, self.num_positions)
        p, parts = self._stream_at(start), []
        while start < stop:
            end = stop if p + 1 >= len(self._streams) else min(stop, self._pos_starts[p + 1])
            base = self._pos_starts[p]
            parts.append((p, *self._streams[p].window(start - base, end - base)))
            start, p = end, p + 1
        return parts

    def exhausted_at(self) -> dict[str, int]:
        """Capped source name -> the position just after its last draw within its cap.

        Only sources that reach their cap inside the stream appear (the first time, when
        refilling). O(P K) exact work.
        """
        found: dict[str, int] = {}
        for p, stream in enumerate(self._streams):
            final = None if stream.length is None else stream.counts(stream.length)
            for k in stream.first.active:
                cap = stream.first.caps[k]
                if cap is None or self.names[k] in found or (final is not None and final[k] < cap):
                    continue
                found[self.names[k]] = (
                    self._pos_starts[p] + stream.first.position_of(k, cap - 1) + 1
                )
        return found

    def fingerprint(self) -> str:
        """A hex digest of all that decides the stream: names, sizes, weights, phases, caps,
        seed, shuffle, policy, batch sizes and any continuation origin."""
        phases = [
            {"weights": w, "end_step": ph.end_step, "batch_size": b, "seq_len": ph.seq_len}
            for w, ph, b in zip(self._weights, self.phases, self.schedule.batch_sizes, strict=True)
        ]
        origin = self._origin
        draws = dict(zip(self.names, origin.ledger.draws, strict=True)) if origin.ledger else {}
        config = {
            "version": 1,
            "names": self.names,
            "sizes": self.sizes,
            "caps": self.caps,
            "phases": phases,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "on_exhausted": self.on_exhausted,
            "origin": [origin.step, origin.position, sorted(draws.items()), origin.parent],
        }
        names = [n for spaces in self._spaces for n in self.names]
        if any(s.key != n for s, n in zip(sum(self._spaces, ()), names, strict=True)):
            lengths = [[[s.key, s.size, s.unit] for s in spaces] for spaces in self._spaces]
            config["lengths"] = {"cap_units": self._cap_units, "spaces": lengths}
        text = json.dumps(config, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def __repr__(self) -> str:
        """Sources with their sizes, the weights (or the phases), batch size and seed; caps,
        policy and origin when they are not the defaults."""
        sizes = ", ".join(f"{n!r}: {size}" for n, size in zip(self.names, self.sizes, strict=True))
        if len(self.phases) == 1 and self.phases[0] == Phase(self.phases[0].weights):
            schedule = f"weights={weights_text(self.phases[0].weights)}"
        else:
            shown = ", ".join(repr(p) for p in self.phases[:3])
            more = f", ... {len(self.phases) - 3} more" if len(self.phases) > 3 else ""
            schedule = f"phases=[{shown}{more}]"
        extra = ""
        if any(c is not None for c in self.caps):
            caps = zip(self.names, self.caps, strict=True)
            extra += ", caps={" + ", ".join(f"{n!r}: {c}" for n, c in caps if c is not None) + "}"
        if self.on_exhausted != "stop":
            extra += f", on_exhausted={self.on_exhausted!r}"
        if self.origin_step:
            extra += f", origin_step={self.origin_step}"
        return (
            f"Mixture(sources={{{sizes}}}, {schedule}, batch_size={self.batch_size}, "
            f"seed={self.seed}{extra})"
        )


def _naming_urls(open_source: OpenSource, where: str) -> OpenSource:
    """``open_source`` whose refusal of a source's URL (``file://host/x``, say: a message
    that starts with the URL) also names the file (``where``) and the source."""

    def opened(name: str, spec: Mapping[str, Any]) -> Sized:
        try:
            return open_source(name, spec)
        except ConfigError as error:
            url = spec.get("path")
            if not isinstance(url, str) or not looks_like_url(url):
                raise
            if not str(error).startswith(without_credentials(url)):
                raise
            raise ConfigError(
                f"{where}: sources.{name}.path: {error}", rule=error.rule, path=error.path
            ) from None

    return opened


def _joined(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    if not parts:
        return np.zeros(0, np.int32), np.zeros(0, np.int64)
    sources = np.concatenate([s for s, _ in parts]).astype(np.int32)
    return sources, np.concatenate([np.asarray(d, np.int64) for _, d in parts])
