"""The interleave inside one phase: which source each position draws from.

Integers in, integers out. Source ``k`` has an integer weight ``w_k`` and may supply at most
``cap_k`` draws (``None``: no limit). In virtual time ``v`` each source accrues the fluid
share ``w_k * v``; its ``m``-th draw arrives when that share reaches ``m + 1/2``, that is at
``key(k, m) = (2m + 1) / (2 w_k)``. The stream is every draw ``(k, m)`` with ``m < cap_k``
sorted by ``(key, k)``: ties go to the lower source id. This is the Sainte-Laguë (Webster)
divisor sequence with caps. A source that reaches its cap simply has no more draws, so the
others go on in proportion to their weights: renormalization comes free.

The fluid position ``tau(v) = sum_k min(cap_k, w_k v)`` is piecewise linear with one
breakpoint per capped source; it is built once, exactly (`fractions.Fraction`). The counts
among the first ``n`` positions come from ``v = tau^-1(n)`` and at most ``K/2 + 1`` heap
corrections, so seeking costs O(K log K) exact operations whatever ``n`` is.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from roxxel.sampling.order import check_count

__all__ = ["Interleave", "PhaseStream", "sort_draws"]

_EXACT_INT64 = 1 << 63
_CLOSE = 1e-12


def _key(weight: int, draw: int) -> Fraction:
    return Fraction(2 * draw + 1, 2 * weight)


class Interleave:
    """The capped Sainte-Laguë merge of K sources (see the module docstring).

    >>> il = Interleave([2, 1], [None, 2])  # source 1 may supply 2 draws
    >>> il.window(0, 6)[0].tolist()
    [0, 1, 0, 0, 1, 0]
    >>> il.counts(5), il.counts(100)
    ([3, 2], [98, 2])

    Attributes:
        weights: the integer weights (0: the source takes no part).
        caps: the most draws of each source (``None``: unlimited).
        total: the stream length, ``None`` when some active source is unlimited.
        work: a running count of the exact steps `counts` took (breakpoints searched,
            sources evaluated, heap moves): instrumentation for the seek-cost tests.
    """

    def __init__(self, weights: Sequence[int], caps: Sequence[int | None]) -> None:
        self.weights, self.caps = tuple(weights), tuple(caps)
        self.active = tuple(
            k for k, (w, c) in enumerate(zip(weights, caps, strict=True)) if w > 0 and c != 0
        )
        limited = [k for k in self.active if self.caps[k] is not None]
        self.total = None if len(limited) < len(self.active) else sum(caps[k] or 0 for k in limited)
        self.work = 0
        ends = sorted((Fraction(caps[k] or 0, weights[k]), k) for k in limited)
        v, tau, rate = Fraction(0), Fraction(0), sum(self.weights[k] for k in self.active)
        self._seg_v, self._seg_tau, self._seg_rate = [v], [tau], [rate]
        for end, k in ends:
            tau, v, rate = tau + rate * (end - v), end, rate - self.weights[k]
            if self._seg_v[-1] == v:
                self._seg_tau[-1], self._seg_rate[-1] = tau, rate
            else:
                self._seg_v.append(v)
                self._seg_tau.append(tau)
                self._seg_rate.append(rate)

    def final_counts(self) -> list[int]:
        """The draws of each source once the stream is over (requires a finite total)."""
        return [(self.caps[k] or 0) if k in self.active else 0 for k in range(len(self.caps))]

    def virtual_time(self, n: int) -> Fraction:
        """The virtual time ``v`` at which the fluid position ``tau(v)`` equals ``n``."""
        i = bisect.bisect_right(self._seg_tau, n) - 1
        self.work += len(self._seg_tau).bit_length()
        if self._seg_rate[i] == 0:
            return self._seg_v[i]
        return self._seg_v[i] + (n - self._seg_tau[i]) / self._seg_rate[i]

    def fluid(self, n: int) -> list[Fraction]:
        """Each source's fluid share of the first ``n`` positions (the reference of the bound)."""
        v = self.virtual_time(n)
        shares = [Fraction(0)] * len(self.caps)
        for k in self.active:
            cap = self.caps[k]
            shares[k] = (
                self.weights[k] * v if cap is None else min(Fraction(cap), self.weights[k] * v)
            )
        return shares

    def counts(self, n: int) -> list[int]:
        """The draws of each source among the first ``n`` positions. O(K log K)."""
        if self.total is not None and n >= self.total:
            return self.final_counts()
        counts = [0] * len(self.caps)
        if n <= 0:
            return counts
        v = self.virtual_time(n)
        twice_num, twice_den = 2 * v.numerator, 2 * v.denominator
        for k in self.active:  # floor(w v + 1/2) in integers: the draws that have arrived
            arrived = (self.weights[k] * twice_num + v.denominator) // twice_den
            cap = self.caps[k]
            counts[k] = arrived if cap is None else min(cap, arrived)
        self.work += len(self.active)
        surplus = sum(counts) - n
        if surplus > 0:
            self._drop_latest(counts, surplus)
        elif surplus < 0:
            self._take_earliest(counts, -surplus)
        return counts

    def _drop_latest(self, counts: list[int], num: int) -> None:
        heap = [(-_key(self.weights[k], counts[k] - 1), -k) for k in self.active if counts[k]]
        heapq.heapify(heap)
        for _ in range(num):
            _, neg_k = heapq.heappop(heap)
            k = -neg_k
            counts[k] -= 1
            if counts[k]:
                heapq.heappush(heap, (-_key(self.weights[k], counts[k] - 1), neg_k))
        self.work += len(heap) + 2 * num

    def _take_earliest(self, counts: list[int], num: int) -> None:
        heap = [
            (_key(self.weights[k], counts[k]), k)
            for k in self.active
            if self.caps[k] is None or counts[k] < (self.caps[k] or 0)
        ]
        heapq.heapify(heap)
        for _ in range(num):
            _, k = heapq.heappop(heap)
            counts[k] += 1
            if self.caps[k] is None or counts[k] < (self.caps[k] or 0):
                heapq.heappush(heap, (_key(self.weights[k], counts[k]), k))
        self.work += len(heap) + 2 * num

    def position_of(self, source: int, draw: int) -> int:
        """The stream position of draw ``draw`` of ``source``: the draws sorted before it."""
        key = _key(self.weights[source], draw)
        position = 0
        for k in self.active:
            share = self.weights[k] * key - Fraction(1, 2)  # draws m with m < share come first
            before = math.floor(share) + 1 if k < source else math.ceil(share)
            cap = self.caps[k]
            position += max(0, before if cap is None else min(cap, before))
        return position

    def window(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Sources and draw indices of positions ``[start, stop)``, in stream order.

        O(stop - start) vectorized work plus two `counts` calls.

        Raises:
            ConfigError: a position past `roxxel.sampling.order.MAX_POSITION` (2**62).
        """
        start = check_count("Interleave: start", start)
        lo, hi = self.counts(start), self.counts(check_count("Interleave: stop", stop))
        sizes = np.subtract(hi, lo, dtype=np.int64)
        sources = np.repeat(np.arange(len(lo), dtype=np.int64), sizes)
        starts = np.repeat(np.asarray(lo, np.int64) - np.cumsum(sizes) + sizes, sizes)
        draws = np.arange(int(sizes.sum()), dtype=np.int64) + starts
        order = sort_draws(sources, draws, self.weights)
        return sources[order], draws[order]


def sort_draws(sources: np.ndarray, draws: np.ndarray, weights: Sequence[int]) -> np.ndarray:
    """The permutation that sorts draws by ``((2m + 1) / (2 w_k), k)``, exactly.

    Floats order the draws. Adjacent keys further apart than float rounding can move them
    (a relative ``_CLOSE``, a thousand times the error of one division of rounded
    integers) are in order for certain; the others are checked with exact integer
    cross-multiplication (a sequence is sorted iff each adjacent pair is), and the rare
    window where rounding swapped two nearly equal keys is sorted again exactly.
    """
    if not sources.size:
        return np.zeros(0, np.int64)
    numer = 2 * draws + 1
    weight_list = [max(w, 1) for w in weights]
    keys = numer / np.asarray([float(w) for w in weight_list])[sources]
    order = np.lexsort((sources, keys))
    a, b = order[:-1], order[1:]
    close = np.flatnonzero(keys[b] - keys[a] <= keys[b] * _CLOSE)
    a, b = a[close], b[close]
    if not close.size:
        return order
    if int(numer.max()) * max(weight_list) < _EXACT_INT64:
        denom = np.asarray(weight_list, np.int64)[sources]
        left, right = numer[a] * denom[b], numer[b] * denom[a]
    else:  # huge weights: check with Python integers
        denom = np.asarray(weight_list, object)[sources]
        left = numer[a].astype(object) * denom[b]
        right = numer[b].astype(object) * denom[a]
    in_order = (left < right) | ((left == right) & (sources[a] < sources[b]))
    if bool(np.all(in_order)):
        return order
    return _sort_exact(sources, numer, weight_list)


def _sort_exact(sources: np.ndarray, numer: np.ndarray, denoms: list[int]) -> np.ndarray:
    keys = [
        (Fraction(int(n), denoms[int(k)]), int(k))
        for n, k in zip(numer.tolist(), sources.tolist(), strict=True)
    ]
    return np.asarray(sorted(range(len(keys)), key=keys.__getitem__), np.int64)


class PhaseStream:
    """One phase: an `Interleave` over the remaining caps, then fresh cycles when refilling.

    With ``refill`` a phase whose sources all reach their caps starts over with each of its
    sources (weight > 0) allowed its full cap again; every such cycle is the same
    `Interleave`, so seeking into the n-th cycle is a `divmod`. Draws are counted from the
    start of the phase. ``length`` is the phase's positions (``None``: unbounded); the
    attribute ``length`` is what the sources can actually fill.
    """

    def __init__(
        self,
        weights: Sequence[int],
        remaining: Sequence[int | None],
        caps: Sequence[int | None],
        length: int | None,
        refill: bool,
    ) -> None:
        self.first = Interleave(weights, remaining)
        self.cycle: Interleave | None = None
        self._first_total = self.first.total or 0
        self._cycle_total = 0
        available = self.first.total
        if refill and available is not None:
            cycle = Interleave(
                weights, [c if w > 0 else 0 for w, c in zip(weights, caps, strict=True)]
            )
            if cycle.total:
                self.cycle, self._cycle_total, available = cycle, cycle.total, None
        if available is None:
            self.length = length
        else:
            self.length = available if length is None else min(length, available)

    @property
    def work(self) -> int:
        """Exact steps taken by seeks so far (see `Interleave.work`)."""
        return self.first.work + (self.cycle.work if self.cycle else 0)

    def counts(self, n: int) -> list[int]:
        """Draws of each source among the first ``n`` positions of the phase."""
        if self.length is not None:
            n = min(n, self.length)
        if self.cycle is None or n <= self._first_total:
            return self.first.counts(n)
        cycles, rest = divmod(n - self._first_total, self._cycle_total)
        base, full = self.first.final_counts(), self.cycle.final_counts()
        part = self.cycle.counts(rest)
        return [b + cycles * f + p for b, f, p in zip(base, full, part, strict=True)]

    def fluid(self, n: int) -> list[Fraction]:
        """Each source's fluid share of the first ``n`` positions of the phase."""
        if self.length is not None:
            n = min(n, self.length)
        if self.cycle is None or n <= self._first_total:
            return self.first.fluid(n)
        cycles, rest = divmod(n - self._first_total, self._cycle_total)
        base, full = self.first.final_counts(), self.cycle.final_counts()
        part = self.cycle.fluid(rest)
        return [b + cycles * f + p for b, f, p in zip(base, full, part, strict=True)]

    def window(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Sources and phase-relative draws of positions ``[start, stop)`` of the phase."""
        if self.length is not None:
            stop = min(stop, self.length)
        if self.cycle is None or stop <= self._first_total:
            return self.first.window(start, stop)
        parts = [self.first.window(start, self._first_total)] if start < self._first_total else []
        base = np.asarray(self.first.final_counts(), np.int64)
        full = np.asarray(self.cycle.final_counts(), np.int64)
        position = max(start, self._first_total)
        while position < stop:
            cycle, rest = divmod(position - self._first_total, self._cycle_total)
            end = min(rest + stop - position, self._cycle_total)
            sources, draws = self.cycle.window(rest, end)
            parts.append((sources, draws + base[sources] + cycle * full[sources]))
            position += end - rest
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
