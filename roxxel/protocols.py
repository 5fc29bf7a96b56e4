"""What the loader, the sampler and the planner need from the objects they are given.

Capabilities are declared here, never discovered by probing attributes: a renamed member is
a type error where an object is passed as one of these, and the runtime checks are
``isinstance`` against these protocols (`typing.runtime_checkable`: they check that the
members exist, not their signatures).

* `Source`: what the loader reads from (`roxxel.Records`, `roxxel.TokenWindows`, ...).
* `RowSource`: a source whose ``read`` also takes ``rows=`` (item ``i`` into row
  ``rows[i]``); the built-in sources do, and the loader uses it only for them
  (`roxxel.sources.records.takes_rows`), since a signature cannot be checked at run time.
* `CountsTokens`: a sampled source that states how many tokens one sample feeds.
* `TokenSource`: token windows that can be re-cut to another ``seq_len`` (a phase's).
* `MixtureLike`: what the loader reads from a mixture (`roxxel.Mixture`), and `SpaceLike`
  what one of its sources draws from in one phase.

This module imports only numpy and typing: every layer may import it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = [
    "CountsTokens",
    "MixtureLike",
    "RowFields",
    "RowSource",
    "Source",
    "SpaceLike",
    "TokenSource",
]

RowFields = dict[str, tuple[tuple[int, ...], np.dtype]]
"""Field name -> (per-row shape, dtype) of what a source writes into a batch."""


@runtime_checkable
class Source(Protocol):
    """What the loader reads from.

    ``len()`` items; ``layout`` the per-row shape and dtype of each output field;
    ``read(indices, out)`` fills the first ``len(indices)`` rows of preallocated arrays;
    ``advise(indices)`` asks the kernel to read ahead the pages those items live on;
    ``fingerprint()`` is a hex string naming the content and parameters (resume checks).
    """

    @property
    def layout(self) -> RowFields: ...

    def __len__(self) -> int: ...

    def read(self, indices: np.ndarray, out: Mapping[str, np.ndarray]) -> None: ...

    def advise(self, indices: np.ndarray) -> None: ...

    def fingerprint(self) -> str: ...


class RowSource(Source, Protocol):
    """A `Source` that reads item ``indices[i]`` into row ``rows[i]`` of ``out`` when given
    ``rows`` (a mixture batch then needs no scratch block and no scatter)."""

    def read(
        self, indices: np.ndarray, out: Mapping[str, np.ndarray], rows: np.ndarray | None = None
    ) -> None: ...


@runtime_checkable
class CountsTokens(Protocol):
    """A source of ``len()`` samples that states the tokens one sample feeds to training."""

    def __len__(self) -> int: ...

    @property
    def tokens_per_sample(self) -> int: ...


@runtime_checkable
class TokenSource(CountsTokens, Protocol):
    """Token windows of ``seq_len`` that can be re-cut to another length: a mixture phase's
    ``seq_len`` reads ``with_seq_len(L)``, and a cap counts such a source in tokens."""

    @property
    def seq_len(self) -> int: ...

    def with_seq_len(self, seq_len: int) -> TokenSource: ...


@runtime_checkable
class SpaceLike(Protocol):
    """What one source of a mixture draws from in one phase: ``source`` is what the loader
    reads (the source itself, or its view at the phase's window length)."""

    @property
    def source(self) -> object: ...


@runtime_checkable
class MixtureLike(Protocol):
    """What the loader needs from a mixture: positions, phases and the record of each.

    A step's rows are positions ``[position_at(step), position_at(step) + batch_size_at(step))``
    and ``locate`` maps positions to (source id, record); ``spaces(phase)[k].source`` is what
    source ``k`` reads in that phase. Steps run from ``origin_step`` to ``end_step``
    (``None``: open-ended); the batch shape may change only at ``step_starts``.
    """

    @property
    def sources(self) -> Sequence[object]: ...

    @property
    def phases(self) -> Sequence[object]: ...

    @property
    def origin_step(self) -> int: ...

    @property
    def end_step(self) -> int | None: ...

    @property
    def step_starts(self) -> Sequence[int]: ...

    def batch_size_at(self, step: int) -> int: ...

    def phase_at(self, step: int) -> int: ...

    def position_at(self, step: int) -> int: ...

    def locate(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]: ...

    def spaces(self, phase: int) -> Sequence[SpaceLike]: ...

    def fingerprint(self) -> str: ...
