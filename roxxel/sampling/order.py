"""Keyed permutations and epochs: which record a source's d-th draw reads.

Integers in, integers out: no files, no jax. A source of ``n`` records is read in epochs;
draw ``d`` belongs to epoch ``d // n`` and reads record ``perm_e(d % n)``, where ``perm_e``
is a `KeyedPermutation` of ``[0, n)`` keyed by ``epoch_key(seed, source, e)``. No
permutation array is ever built: any draw maps to its record in O(1) memory.
"""

from __future__ import annotations

import functools
import hashlib
import math
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from roxxel.errors import ConfigError, check_int

__all__ = [
    "MAX_POSITION",
    "MAX_STEP",
    "KeyedPermutation",
    "ShardGroups",
    "check_count",
    "epoch_key",
    "group_key",
    "records_for_draws",
    "records_for_sources",
]

MAX_POSITION = 1 << 62
"""Positions, draws, steps, batch sizes and caps are at most this (a range's stop may equal
it): ``step * batch + row`` and every sum of two such values stay inside int64, so nothing
wraps. A step or position past it is a `ConfigError` naming the limit."""
MAX_STEP = MAX_POSITION
"""The largest step (exclusive end) a mixture or a loader may reach; see `MAX_POSITION`."""
_LIMIT = "2**62, the limit of steps and positions"

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_SHIFT27, _SHIFT30, _SHIFT31 = np.uint64(27), np.uint64(30), np.uint64(31)
_NUM_ROUNDS = 6  # even, so the two radices end where they started


def _splitmix64(x: int) -> int:
    """One step of splitmix64 on a Python int (the round-key schedule)."""
    z = (x + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """The Feistel round function: splitmix64's finalizer of ``x ^ key`` (uint64, wraps)."""
    z = x ^ key
    z ^= z >> _SHIFT30
    z *= _MUL1
    z ^= z >> _SHIFT27
    z *= _MUL2
    z ^= z >> _SHIFT31
    return z


def _check_int(where: str, value: object, low: int, high: int | None = None) -> int:
    value = check_int(where, value)
    if value < low or (high is not None and value >= high):
        rule = f">= {low}" if high is None else f"in [{low}, {high})"
        raise ConfigError(f"{where}: out of range ({value}, expected {rule})")
    return value


def check_count(where: str, value: object, low: int | None = 0) -> int:
    """``value`` as an int in ``[low, MAX_POSITION]``: a step, position, batch size or cap
    (``low=None``: no lower bound, for a caller that raises `IndexError` below its range).

    >>> check_count("step", 2**62)
    4611686018427387904
    >>> check_count("step", 2**62 + 1)
    Traceback (most recent call last):
    ...
    roxxel.errors.ConfigError: step: too large (4611686018427387905, expected <= 2**62, the limit of steps and positions)
    """
    number = check_int(where, value, low)
    if number > MAX_POSITION:
        raise ConfigError(f"{where}: too large ({number}, expected <= {_LIMIT})")
    return number


def as_draws(where: str, draws: object) -> np.ndarray:
    """``draws`` as int64, each in ``[0, MAX_POSITION)``, checked before any cast can wrap.

    Raises:
        TypeError: draws that are not integers.
        IndexError: a negative draw.
        ConfigError: a draw at or past `MAX_POSITION`.
    """
    array = np.asarray(draws)
    if not array.size:
        return array.astype(np.int64)
    if array.dtype.kind not in "iuO":
        raise TypeError(f"{where}: draws of dtype {array.dtype} (expected integers)")
    lowest, highest = int(array.min()), int(array.max())
    if lowest < 0:
        raise IndexError(f"{where}: negative draw ({lowest}, expected >= 0)")
    if highest >= MAX_POSITION:
        raise ConfigError(f"{where}: draw too large ({highest}, expected < {_LIMIT})")
    return array.astype(np.int64)


class KeyedPermutation:
    """A keyed bijection of ``[0, num_items)``: a radix Feistel network with cycle walking.

    The network permutes the padded domain ``[0, a * b)`` with ``a = ceil(sqrt(n))`` and
    ``b = ceil(n / a)``, written as pairs ``(left mod a, right mod b)``; each round maps
    ``(L, R)`` to ``(R, (L + F_i(R)) mod a)`` and swaps the two radices (the FF1 layout of
    format-preserving encryption), with ``F_i`` splitmix64 keyed by round. Since
    ``n <= a * b < n + a``, at most ``a - 1 < sqrt(n)`` padded values lie outside
    ``[0, n)``, and never more than a quarter of the domain (``n = 3`` is the worst case).
    Cycle walking applies the network again until the value falls back inside; the network
    is a bijection of the padded domain, so the walk follows one cycle and returns within
    ``a * b - n + 1 <= a`` rounds. For a random key each round lands inside with probability
    ``n / (a * b) >= 3/4``, so the expected number of rounds is at most 4/3, and about
    ``1 + 1/sqrt(n)`` for large ``n``.

    Evaluating is O(len(positions)) vectorized numpy work and O(1) memory; any position
    maps directly. Thread-safe (immutable).

    >>> perm = KeyedPermutation(10, key=42)
    >>> sorted(perm(np.arange(10)).tolist()) == list(range(10))
    True
    >>> int(perm.inverse(perm(3)))
    3
    >>> int(KeyedPermutation(1, key=7)(0))
    0

    Raises:
        ConfigError: ``num_items < 1`` or a key outside ``[0, 2**64)``.
        IndexError: a position outside ``[0, num_items)``.
    """

    __slots__ = ("_keys", "_radix_a", "_radix_b", "num_items")

    def __init__(self, num_items: int, key: int) -> None:
        self.num_items = _check_int("KeyedPermutation: num_items", num_items, 1)
        key = _check_int("KeyedPermutation: key", key, 0, 1 << 64)
        radix_a = math.isqrt(self.num_items - 1) + 1
        self._radix_a = np.uint64(radix_a)
        self._radix_b = np.uint64(-(-self.num_items // radix_a))
        keys, state = [], key
        for _ in range(_NUM_ROUNDS):
            state = _splitmix64(state)
            keys.append(np.uint64(state))
        self._keys = tuple(keys)

    def __repr__(self) -> str:
        return f"KeyedPermutation(num_items={self.num_items})"

    def __call__(self, positions: object) -> np.ndarray:
        """The record at each position: ``perm(j)`` for every ``j`` (same shape)."""
        return self._walk(positions, backward=False)

    def inverse(self, records: object) -> np.ndarray:
        """The position of each record: ``perm.inverse(perm(j)) == j``."""
        return self._walk(records, backward=True)

    def _walk(self, values: object, backward: bool) -> np.ndarray:
        x = np.asarray(values)
        if x.dtype.kind not in "iu":
            raise IndexError(f"KeyedPermutation: positions of dtype {x.dtype} (expected integers)")
        n = self.num_items
        if x.size and (int(x.min()) < 0 or int(x.max()) >= n):
            raise IndexError(f"KeyedPermutation: position out of range (expected [0, {n}))")
        if n == 1:
            return np.zeros(x.shape, np.int64)
        network = _Network(self._radix_a, self._radix_b, self._keys, np.uint64(n))
        return network.walk(x.astype(np.uint64).ravel(), backward).astype(np.int64).reshape(x.shape)


class _Network:
    """The Feistel rounds over arrays; radices, keys and limits are scalars or per element."""

    def __init__(self, radix_a, radix_b, keys: Sequence, limit) -> None:
        self.radix_a, self.radix_b, self.keys, self.limit = radix_a, radix_b, keys, limit

    def subset(self, index: np.ndarray) -> _Network:
        def pick(value):
            return value[index] if isinstance(value, np.ndarray) else value

        keys = [pick(k) for k in self.keys]
        return _Network(pick(self.radix_a), pick(self.radix_b), keys, pick(self.limit))

    def walk(self, x: np.ndarray, backward: bool) -> np.ndarray:
        """Apply the network, then re-apply it where the value is out of range (cycle walking;
        it terminates, see `KeyedPermutation`)."""
        y = self.backward(x) if backward else self.forward(x)
        pending = np.flatnonzero(y >= self.limit)
        while pending.size:
            sub = self.subset(pending)
            y[pending] = sub.backward(y[pending]) if backward else sub.forward(y[pending])
            pending = pending[y[pending] >= sub.limit]
        return y

    def forward(self, x: np.ndarray) -> np.ndarray:
        left_radix, right_radix = self.radix_a, self.radix_b
        for key in self.keys:
            left, right = _divmod(x, right_radix)
            x = right * left_radix + _mod(left + _mod(_mix(right, key), left_radix), left_radix)
            left_radix, right_radix = right_radix, left_radix
        return x

    def backward(self, x: np.ndarray) -> np.ndarray:
        left_radix, right_radix = self.radix_a, self.radix_b  # even rounds: input layout
        for key in reversed(self.keys):
            right, new_right = _divmod(x, right_radix)  # the last round's (R, L + F(R))
            bump = _mod(_mix(right, key), right_radix)
            left = _mod(new_right + right_radix - bump, right_radix)
            x = left * left_radix + right
            left_radix, right_radix = right_radix, left_radix
        return x


def _divmod(x: np.ndarray, radix: Any) -> tuple[np.ndarray, np.ndarray]:
    """``np.divmod(x, radix)`` of uint64s. By one scalar radix, numpy's ``//`` divides
    through libdivide (a multiply and shifts) where its ``%`` and ``divmod`` divide each
    element in hardware, 6x slower: the remainder is then ``x - q * radix``, the same
    integers. Per-element radices (a mixture's sources) keep ``np.divmod``."""
    if isinstance(radix, np.ndarray):
        return np.divmod(x, radix)
    quotient = x // radix
    return quotient, x - quotient * radix


def _mod(x: np.ndarray, radix: Any) -> np.ndarray:
    return _divmod(x, radix)[1]


def epoch_key(seed: int, source: int | str, epoch: int) -> int:
    """The 64-bit permutation key of one epoch of one source: a stable hash, never `hash()`.

    The key is BLAKE2b (8-byte digest, personalized ``roxxel.order``) of the text
    ``"<seed>|<int|str>:<source>|<epoch>"``, so it is the same on every machine, process
    and Python version. A mixture keys its sources by name, so adding a source does not
    reshuffle the others.

    >>> epoch_key(0, "web", 0) == epoch_key(0, "web", 0) != epoch_key(0, "web", 1)
    True
    """
    seed = _check_int("epoch_key: seed", seed, 0)
    epoch = _check_int("epoch_key: epoch", epoch, 0)
    if isinstance(source, bool) or not isinstance(source, int | str):
        raise ConfigError(f"epoch_key: source ({source!r}, expected an int or a str)")
    kind = "str" if isinstance(source, str) else "int"
    text = f"{seed}|{kind}:{source}|{epoch}".encode()
    digest = hashlib.blake2b(text, digest_size=8, person=b"roxxel.order").digest()
    return int.from_bytes(digest, "little")


def records_for_draws(
    num_records: int, draws: object, *, seed: int, source: int | str, shuffle: bool
) -> np.ndarray:
    """The record each draw of a source reads: draw ``d`` -> ``perm_{d // n}(d % n)``.

    Epoch ``e`` is shuffled by ``KeyedPermutation(n, epoch_key(seed, source, e))``; with
    ``shuffle=False`` every epoch is the natural order ``d % n``. O(len(draws)) work plus
    one permutation per distinct epoch among the draws.

    >>> records_for_draws(3, [0, 1, 2, 3, 4], seed=0, source="a", shuffle=False).tolist()
    [0, 1, 2, 0, 1]
    >>> sorted(records_for_draws(5, range(5), seed=1, source="a", shuffle=True).tolist())
    [0, 1, 2, 3, 4]

    Raises:
        ConfigError: ``num_records < 1``, or a draw at or past `MAX_POSITION`.
        IndexError: a negative draw.
        TypeError: draws that are not integers.
    """
    n = _check_int("records_for_draws: num_records", num_records, 1)
    d = as_draws("records_for_draws", draws)
    epochs, positions = np.divmod(d, n)
    if not shuffle or n == 1 or not d.size:
        return positions
    first, last = int(epochs.min()), int(epochs.max())
    if first == last:  # the common case: one epoch, no masks
        return _epoch_permutation(n, seed, source, first)(positions)
    out = np.empty_like(positions)
    for epoch in np.unique(epochs).tolist():
        mask = epochs == epoch
        perm = _epoch_permutation(n, seed, source, epoch)
        out[mask] = perm(positions[mask])
    return out


@functools.lru_cache(maxsize=4096, typed=True)
def _epoch_permutation(
    num_items: int, seed: int, source: int | str, epoch: int
) -> KeyedPermutation:
    """The permutation of one epoch of one source; cached, as a batch meets few epochs."""
    return KeyedPermutation(num_items, epoch_key(seed, source, epoch))


def records_for_sources(
    sizes: Sequence[int],
    sources: np.ndarray,
    draws: np.ndarray,
    *,
    seed: int,
    names: Sequence[int | str],
    shuffle: bool,
) -> np.ndarray:
    """`records_for_draws` for draws of many sources at once, in one vectorized pass.

    ``sources[i]`` indexes ``sizes`` and ``names``; draw ``draws[i]`` of that source maps
    to the same record `records_for_draws` gives it. The per-element network costs
    the same however many sources and epochs are mixed, so a batch of a 32-source mixture
    takes one pass, not 32. O(len(draws)) work plus one key per distinct (source, epoch).
    """
    sources = np.asarray(sources, np.int64)
    d = as_draws("records_for_sources", draws)
    n = np.asarray([_check_int("records_for_sources: size", s, 1) for s in sizes], np.int64)[
        sources
    ]
    epochs, positions = np.divmod(d, n)
    if not shuffle or not d.size:
        return positions
    pair_epochs, pair_sources, inverse = _epoch_source_pairs(epochs, sources, len(sizes))
    perms = [
        _epoch_permutation(int(sizes[k]), seed, names[k], e)
        for e, k in zip(pair_epochs.tolist(), pair_sources.tolist(), strict=True)
    ]
    radix_a = np.asarray([p._radix_a for p in perms], np.uint64)[inverse]
    radix_b = np.asarray([p._radix_b for p in perms], np.uint64)[inverse]
    keys = np.asarray([p._keys for p in perms], np.uint64)[inverse]
    network = _Network(radix_a, radix_b, list(keys.T), n.astype(np.uint64))
    return network.walk(positions.astype(np.uint64), backward=False).astype(np.int64)


def _epoch_source_pairs(
    epochs: np.ndarray, sources: np.ndarray, num_sources: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct (epoch, source) pairs, and the pair of each element (``inverse``).

    One int64 key ``epoch * num_sources + source`` per element when that cannot wrap (a
    one-record source has an epoch per draw, so near `MAX_POSITION` it could), else rows.
    """
    if int(epochs.max()) < (1 << 63) // num_sources - 1:
        pairs, inverse = np.unique(epochs * num_sources + sources, return_inverse=True)
        pair_epochs, pair_sources = np.divmod(pairs, num_sources)
        return pair_epochs, pair_sources, inverse.ravel()
    pairs, inverse = np.unique(np.stack([epochs, sources]), axis=1, return_inverse=True)
    return pairs[0], pairs[1], inverse.ravel()


def group_key(seed: int, source: int | str, epoch: int, group: int | None) -> int:
    """The 64-bit key of the shard shuffle of one epoch (``group=None``), or of the records
    of one shard group of that epoch, under `ShardGroups` (rule S15 of docs/sampling.md).

    BLAKE2b (8-byte digest, personalized ``roxxel.groups``, so no key ever equals an
    `epoch_key`) of ``"<seed>|<int|str>:<source>|<epoch>|shards"`` or ``...|group=<g>``.

    >>> group_key(0, 0, 0, None) != group_key(0, 0, 0, 0) != group_key(0, 0, 0, 1)
    True
    """
    seed = _check_int("group_key: seed", seed, 0)
    epoch = _check_int("group_key: epoch", epoch, 0)
    if isinstance(source, bool) or not isinstance(source, int | str):
        raise ConfigError(f"group_key: source ({source!r}, expected an int or a str)")
    part = "shards" if group is None else f"group={_check_int('group_key: group', group, 0)}"
    kind = "str" if isinstance(source, str) else "int"
    text = f"{seed}|{kind}:{source}|{epoch}|{part}".encode()
    digest = hashlib.blake2b(text, digest_size=8, person=b"roxxel.groups").digest()
    return int.from_bytes(digest, "little")


class _EpochGroups:
    """One epoch's shard shuffle under `ShardGroups`, as O(num_shards) integer tables.

    Slot ``j`` of the shuffled list holds the shard whose first item is ``first[j]``; its
    items take epoch positions ``[starts[j], starts[j + 1])``, and shard group ``g`` takes
    ``[group_starts[g], group_starts[g + 1])``.
    """

    __slots__ = ("first", "group_starts", "starts")

    def __init__(self, first: np.ndarray, starts: np.ndarray, group_starts: np.ndarray) -> None:
        self.first, self.starts, self.group_starts = first, starts, group_starts


class ShardGroups:
    """A shuffle that keeps locality: shards shuffled per epoch, records within groups.

    Items ``[shard_starts[k], shard_starts[k + 1])`` of a source live in shard ``k``. In
    epoch ``e`` the shards that hold items are put in the order of
    ``KeyedPermutation(S, group_key(seed, source, e, None))``, that list is cut into groups
    of ``group_shards`` consecutive shards (the last may be smaller), and the epoch reads the
    groups one after the other, each in the order of ``KeyedPermutation(m_g, group_key(seed,
    source, e, g))`` over its ``m_g`` items (rule S15 of docs/sampling.md). So a stretch of
    draws inside one group touches only its ``group_shards`` shards, and every epoch still
    reads every item exactly once.

    Draw ``d`` -> record is a pure function of ``(seed, source, d)``, the shard layout and
    ``group_shards``: O(log S) per draw after an O(S) table per epoch (cached for the
    latest few epochs), never a replay; thread-safe.

    >>> groups = ShardGroups([0, 3, 3, 7, 10], group_shards=1)  # shard 1 holds no item
    >>> records = groups.records(np.arange(20), seed=0, source=0)
    >>> sorted(records[:10].tolist()) == sorted(records[10:].tolist()) == list(range(10))
    True
    >>> records[10:].tolist()  # epoch 1: shard 2, shard 0, shard 3, each shuffled
    [4, 5, 6, 3, 0, 1, 2, 8, 7, 9]

    Raises:
        ConfigError: ``shard_starts`` that do not start at 0 or decrease, or
            ``group_shards < 1``.
    """

    __slots__ = ("_first", "_lock", "_sizes", "_tables", "group_shards", "num_items")

    _NUM_TABLES = 4  # the epochs whose tables are kept: a batch meets one or two
    _FEW_GROUPS = 8  # up to this many groups among the draws: one permutation call each

    def __init__(self, shard_starts: Sequence[int] | np.ndarray, group_shards: int) -> None:
        starts = np.asarray(shard_starts)
        where = "ShardGroups: shard_starts"
        if starts.ndim != 1 or len(starts) < 1 or starts.dtype.kind not in "iu":
            raise ConfigError(f"{where}: not a 1-D integer array ({starts!r}, expected [0, ...])")
        starts = starts.astype(np.int64)
        if int(starts[0]) != 0 or (np.diff(starts) < 0).any() or int(starts[-1]) > MAX_POSITION:
            found = starts[:8].tolist()
            raise ConfigError(
                f"{where}: not item starts ({found}, expected 0, then non-decreasing, up to 2**62)"
            )
        self.group_shards = _check_int("ShardGroups: group_shards", group_shards, 1)
        sizes = np.diff(starts)
        held = np.flatnonzero(sizes)  # shards without items take no slot in a group
        self._first, self._sizes = starts[held], sizes[held]
        self.num_items = int(starts[-1])
        self._tables: dict[tuple[int, int | str, int], _EpochGroups] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"ShardGroups(num_items={self.num_items}, num_shards={len(self._sizes)}, "
            f"group_shards={self.group_shards})"
        )

    def records(self, draws: object, *, seed: int, source: int | str) -> np.ndarray:
        """The record each draw reads (same shape as ``draws``): see the class docstring.

        Raises:
            ConfigError: a source without items, or a draw at or past `MAX_POSITION`.
            IndexError: a negative draw.
            TypeError: draws that are not integers.
        """
        if not self.num_items:
            raise ConfigError("ShardGroups: no items to draw from (0, expected >= 1)")
        d = as_draws("ShardGroups.records", draws)
        shape, d = d.shape, d.ravel()
        if not d.size:
            return d.reshape(shape)
        epochs, positions = np.divmod(d, self.num_items)
        first, last = int(epochs.min()), int(epochs.max())
        if first == last:  # the common case: one epoch, no masks
            return self._epoch_records(seed, source, first, positions).reshape(shape)
        out = np.empty_like(positions)
        for epoch in np.unique(epochs).tolist():
            mask = epochs == epoch
            out[mask] = self._epoch_records(seed, source, epoch, positions[mask])
        return out.reshape(shape)

    def _epoch_records(
        self, seed: int, source: int | str, epoch: int, positions: np.ndarray
    ) -> np.ndarray:
        table = self._table(seed, source, epoch)
        bounds = table.group_starts
        groups = np.searchsorted(bounds, positions, side="right") - 1
        base = bounds[groups]
        first, last = int(groups.min()), int(groups.max())
        if last - first < self._FEW_GROUPS:  # the common case: a group per permutation call
            local = np.empty_like(positions)
            for g in range(first, last + 1):
                mask = groups == g
                perm = _group_permutation(int(bounds[g + 1] - bounds[g]), seed, source, epoch, g)
                local[mask] = perm(positions[mask] - bounds[g])
        else:
            local = self._local_many(bounds, groups, positions - base, (seed, source, epoch))
        shuffled = base + local  # a position among the group's shards, in list order
        slots = np.searchsorted(table.starts, shuffled, side="right") - 1
        return table.first[slots] + (shuffled - table.starts[slots])

    @staticmethod
    def _local_many(
        bounds: np.ndarray, groups: np.ndarray, local: np.ndarray, keys: tuple[int, int | str, int]
    ) -> np.ndarray:
        """Each position's place in its group's permutation: one network pass for all groups."""
        unique, inverse = np.unique(groups, return_inverse=True)
        perms = [
            _group_permutation(int(bounds[g + 1] - bounds[g]), *keys, g) for g in unique.tolist()
        ]
        inverse = inverse.ravel()
        radix_a = np.asarray([p._radix_a for p in perms], np.uint64)[inverse]
        radix_b = np.asarray([p._radix_b for p in perms], np.uint64)[inverse]
        round_keys = np.asarray([p._keys for p in perms], np.uint64)[inverse]
        sizes = (bounds[groups + 1] - bounds[groups]).astype(np.uint64)
        network = _Network(radix_a, radix_b, list(round_keys.T), sizes)
        return network.walk(local.astype(np.uint64), backward=False).astype(np.int64)

    def _table(self, seed: int, source: int | str, epoch: int) -> _EpochGroups:
        key = (seed, source, epoch)
        table = self._tables.get(key)
        if table is None:
            num_shards = len(self._sizes)
            shard_key = group_key(seed, source, epoch, None)
            slots = _epoch_permutation_keyed(num_shards, shard_key)(np.arange(num_shards))
            starts = np.concatenate([[0], np.cumsum(self._sizes[slots])])
            group_starts = starts[np.r_[0 : num_shards : self.group_shards, num_shards]]
            table = _EpochGroups(self._first[slots], starts, group_starts)
            with self._lock:
                while len(self._tables) >= self._NUM_TABLES:
                    self._tables.pop(next(iter(self._tables)))
                self._tables[key] = table
        return table


@functools.lru_cache(maxsize=64)
def _epoch_permutation_keyed(num_items: int, key: int) -> KeyedPermutation:
    """A permutation by its key (the shard shuffles of `ShardGroups`); cached."""
    return KeyedPermutation(num_items, key)


@functools.lru_cache(maxsize=4096, typed=True)
def _group_permutation(
    num_items: int, seed: int, source: int | str, epoch: int, group: int
) -> KeyedPermutation:
    """The record order inside one shard group of one epoch; cached (a batch meets few)."""
    return KeyedPermutation(num_items, group_key(seed, source, epoch, group))
