"""Which records each step of a loader reads: a pure function of (configuration, seed, step).

A `StepPicker` answers, for a step and the rows of the global batch this process holds, which
source and record fills each row (`pick`), then reads them into host buffers (`fill`). A
single source maps position p = step * B + row to ``order.records_for_draws(n, p)``; a
`Mixture` maps positions itself with ``locate``. Nothing here depends on earlier steps, so
any step costs the same to compute.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from roxxel.errors import ConfigError
from roxxel.loader.host import RowSpec
from roxxel.protocols import MixtureLike, Source
from roxxel.sampling import order
from roxxel.sources.records import as_source, shard_starts_of, takes_rows
from roxxel.sources.windows import blend_of

__all__ = ["Pick", "StepPicker", "past_bound", "picker_for"]

Extras = Mapping[str, tuple[tuple[int, ...], np.dtype]]


@dataclasses.dataclass(frozen=True, slots=True)
class Pick:
    """What one step reads.

    Attributes:
        num_valid: rows [0, num_valid) of the global batch hold data; the rest is padding.
        num_read: leading rows of this process's block that hold data.
        source_ids: int32 (num_read,), the source of each of those rows.
        records: int64 (num_read,), the record (item) index within its source.
        phase: the mixture phase of the step (its window length); 0 for a single source.
    """

    num_valid: int
    num_read: int
    source_ids: np.ndarray
    records: np.ndarray
    phase: int = 0


class StepPicker(Protocol):
    """The loader's view of its order (see the module docstring)."""

    def batch_size_at(self, step: int) -> int: ...

    def num_steps(self) -> int | None: ...

    def pick(self, step: int, rows: np.ndarray) -> Pick | None: ...

    def fill(self, pick: Pick, host: Mapping[str, np.ndarray]) -> None: ...

    def advise(self, pick: Pick) -> None: ...

    def prepare(self, step: int, rows: np.ndarray) -> None: ...

    def row_spec_at(self, step: int, extras: Extras) -> RowSpec: ...

    def shape_steps(self, start: int) -> list[int]: ...

    def fingerprint_json(self) -> dict[str, Any]: ...


def picker_for(
    source: Any,
    batch_size: int | None,
    config: Any,
    *,
    seed: int,
    shuffle: bool,
    group_shards: int | None = None,
) -> StepPicker:
    """The plan for a source (a Mixture or anything `views.as_source` accepts); with
    ``group_shards`` (``LoaderConfig.shuffle_group_shards``), a single source is shuffled
    within shard groups (`order.ShardGroups`).

    Raises:
        ConfigError: a bad batch size, mixture sources whose fields differ, or
            ``group_shards`` with ``shuffle=False``, a Mixture or a source without shards.
    """
    kwargs = {"fields": config.fields, "max_len": config.max_len}
    if group_shards is not None and not shuffle:
        raise ConfigError(
            f"loader: shuffle_group_shards with shuffle=False ({group_shards}, expected None: "
            "shard groups are a shuffle)"
        )
    if isinstance(source, MixtureLike):
        if group_shards is not None:
            raise ConfigError(
                f"loader: shuffle_group_shards with a Mixture ({group_shards}, expected None: "
                "a mixture orders its sources itself)"
            )
        if not shuffle:
            raise ConfigError(
                "loader: shuffle=False with a Mixture (False, expected the default: a "
                "mixture shuffles by its own shuffle option)"
            )
        sources = [as_source(s, **kwargs) for s in source.sources]
        return MixturePicker(source, sources, batch_size, drop=config.final_batch == "drop")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ConfigError(f"loader: batch_size ({batch_size!r}, expected an int >= 1)")
    single = as_source(source, **kwargs)
    groups = None
    if group_shards is not None:
        groups = order.ShardGroups(shard_starts_of(single, "loader"), group_shards)
    return SinglePicker(
        single, batch_size, config.num_epochs, config.final_batch == "drop", (seed, shuffle), groups
    )


def past_bound(picker: StepPicker, step: int) -> bool:
    """Whether `step`'s rows pass position 2**62 (`order.MAX_POSITION`, the end of the
    positions): a loader's stream ends before such a step (counted as ``step *
    batch_size``)."""
    return (step + 1) * picker.batch_size_at(step) > order.MAX_POSITION


def _end_or_valid(num_valid: int, batch_size: int, drop: bool) -> bool:
    """True when a step with `num_valid` real rows is past the end of the stream."""
    return num_valid == 0 or (drop and num_valid < batch_size)


def _zero_tail(host: Mapping[str, np.ndarray], names: tuple[str, ...], start: int) -> None:
    for name in names:
        host[name][start:] = 0


def _source_row_spec(source: Source, extras: Extras, where: str) -> RowSpec:
    spec = dict(source.layout)
    clash = sorted(set(spec) & set(extras))
    if clash:
        raise ConfigError(
            f"{where}: source fields clash with loader fields ({clash}, expected other names)"
        )
    return RowSpec.of({**spec, **extras})


_BLOCK_ROWS = 8192  # rows whose order one vectorized pass computes (amortizes numpy calls)


class _Blocks:
    """Per-step order computed for a block of consecutive steps at once, then sliced.

    ``compute(first, num_steps, rows)`` returns ``(steps covered, data)``; `get` returns
    ``(first, data)`` of a block that covers the step. Blocks start small and double while
    steps come in order (so the first batch after a start or a restore costs one step's
    work) up to ``max_steps``; the two latest blocks are kept, so the read-ahead of later
    steps does not evict the current one. `prepare` computes the block after the latest
    one ahead of time, from another thread: the host threads of a loader call it from a
    step's job, so the thread that begins steps (in order, one at a time) never holds the
    others up for a block's computation. Pure function of the step: a cache, not state.

    Thread-safety: any threads (a lock guards the blocks held; computing runs outside it,
    so two threads may compute one block: the same data).
    """

    def __init__(self, compute: Any, max_steps: int) -> None:
        self._compute, self._max = compute, max_steps
        self._held: list[tuple[np.ndarray, int, int, Any]] = []  # (rows, first, stop, data)
        self._span = 1
        self._lock = threading.Lock()
        self._preparing = False

    def get(self, step: int, rows: np.ndarray) -> tuple[int, Any]:
        with self._lock:
            for held_rows, first, stop, data in self._held:
                if first <= step < stop and _same_rows(held_rows, rows):
                    return first, data
            last = self._held[-1] if self._held else None
            in_order = last is not None and last[1] <= step <= last[2]
            self._span = span = min(self._max, 2 * self._span) if in_order else 1
        covered, data = self._compute(step, span, rows)
        self._hold(rows, step, step + covered, data)
        return step, data

    def prepare(self, step: int, rows: np.ndarray, ended: Callable[[int], bool]) -> None:
        """Compute the block that follows the latest one, if `step` is in that latest block
        (of these rows), the stream has not ended at its first step (`ended`: the loader
        reads no step from there on) and nobody computes it yet; else nothing."""
        with self._lock:
            last = self._held[-1] if self._held else None
            if (
                self._preparing
                or last is None
                or not last[1] <= step < last[2]
                or not _same_rows(last[0], rows)
                or ended(last[2])
            ):
                return
            self._preparing = True
            first = last[2]
            self._span = span = min(self._max, 2 * self._span)
        try:
            covered, data = self._compute(first, span, rows)
            self._hold(rows, first, first + covered, data)
        finally:
            with self._lock:
                self._preparing = False

    def _hold(self, rows: np.ndarray, first: int, stop: int, data: Any) -> None:
        with self._lock:
            if not any(f == first and _same_rows(r, rows) for r, f, _, _ in self._held):
                self._held = [*self._held[-1:], (rows, first, stop, data)]


def _same_rows(a: np.ndarray, b: np.ndarray) -> bool:
    return a is b or (len(a) == len(b) and bool(np.array_equal(a, b)))


def _readonly(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


_ZEROS: dict[int, np.ndarray] = {}


def _zeros_int32(num: int) -> np.ndarray:
    """A read-only int32 zeros array of length `num` (shared: source ids of one source)."""
    zeros = _ZEROS.get(num)
    if zeros is None:
        zeros = _ZEROS[num] = _readonly(np.zeros(num, np.int32))
    return zeros


def _is_prefix(rows: np.ndarray, num: int) -> bool:
    """Whether the first `num` of the sorted unique `rows` are exactly 0..num-1."""
    return num == 0 or int(rows[num - 1]) == num - 1


class SinglePicker:
    """One source, ``num_epochs`` passes (None: forever), a keyed shuffle per epoch."""

    def __init__(
        self,
        source: Source,
        batch_size: int,
        num_epochs: int | None,
        drop: bool,
        keys: tuple[int, bool],
        groups: order.ShardGroups | None = None,
    ) -> None:
        self.source, self.batch_size, self.groups = source, batch_size, groups
        self.num_epochs, self.drop = num_epochs, drop
        self.seed, self.shuffle = keys
        self.num_items = len(source)
        self._names = tuple(source.layout)
        self._layouts: dict[tuple[Any, ...], RowSpec] = {}
        self._blocks = _Blocks(self._records, max(1, _BLOCK_ROWS // max(1, batch_size)))
        self._num_steps_max = order.MAX_POSITION // batch_size  # steps whose positions fit

    def batch_size_at(self, step: int) -> int:
        return self.batch_size

    def num_steps(self) -> int | None:
        if self.num_epochs is None:
            return None if self.num_items else 0
        total = self.num_epochs * self.num_items
        return total // self.batch_size if self.drop else -(-total // self.batch_size)

    def pick(self, step: int, rows: np.ndarray) -> Pick | None:
        if not 0 <= step < self._num_steps_max:
            rule = f"[0, {self._num_steps_max}): positions stay <= 2**62 (order.MAX_POSITION)"
            raise ConfigError(f"loader: step out of range ({step}, expected {rule})")
        start = step * self.batch_size
        total = None if self.num_epochs is None else self.num_epochs * self.num_items
        if self.num_items == 0:
            return None
        num_valid = (
            self.batch_size if total is None else max(0, min(self.batch_size, total - start))
        )
        if _end_or_valid(num_valid, self.batch_size, self.drop):
            return None
        # rows: this process's sorted rows of the batch; all of them hold data in a full one
        full = num_valid == self.batch_size
        num_read = len(rows) if full else int(np.searchsorted(rows, num_valid))
        first, block = self._blocks.get(step, rows)
        records = block[step - first, :num_read]
        return Pick(num_valid, num_read, _zeros_int32(num_read), records)

    def _records(self, first: int, num_steps: int, rows: np.ndarray) -> tuple[int, np.ndarray]:
        """Records of `rows` at steps [first, first + num_steps): (num_steps, len(rows));
        fewer steps where they would pass `order.MAX_POSITION`."""
        num_steps = min(num_steps, self._num_steps_max - first)
        steps = np.arange(first, first + num_steps, dtype=np.int64)[:, None]
        draws = (steps * self.batch_size + rows.astype(np.int64)[None, :]).ravel()
        if self.groups is not None:  # LoaderConfig.shuffle_group_shards
            records = self.groups.records(draws, seed=self.seed, source=0)
        else:
            records = order.records_for_draws(
                self.num_items, draws, seed=self.seed, source=0, shuffle=self.shuffle
            )
        return num_steps, _readonly(np.asarray(records, np.int64).reshape(num_steps, len(rows)))

    def fill(self, pick: Pick, host: Mapping[str, np.ndarray]) -> None:
        self.source.read(pick.records, {name: host[name][: pick.num_read] for name in self._names})
        _zero_tail(host, self._names, pick.num_read)

    def advise(self, pick: Pick) -> None:
        self.source.advise(pick.records)

    def prepare(self, step: int, rows: np.ndarray) -> None:
        """Compute the order of the steps after `step`'s block now (any thread, while
        another picks): a host thread's job calls it, so no pick waits for a block."""
        self._blocks.prepare(step, rows, lambda first: past_bound(self, first))

    def row_spec_at(self, step: int, extras: Extras) -> RowSpec:
        """The batch layout (the same at every step), cached."""
        key = tuple(extras.items())
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = _source_row_spec(self.source, extras, "loader")
        return layout

    def shape_steps(self, start: int) -> list[int]:
        """The steps from `start` on where the batch shape may change: only `start`."""
        return [start]

    def fingerprint_json(self) -> dict[str, Any]:
        return {
            "kind": "single",
            "batch_size": self.batch_size,
            "num_items": self.num_items,
            "shuffle": self.shuffle,
            "num_epochs": self.num_epochs,
            "source": self.source.fingerprint(),
        }


class MixturePicker:
    """Sources blended by a `roxxel.Mixture`: positions map through ``mixture.locate``.

    Every source must have the same fields (names, per-row shapes, dtypes) in each phase.
    A phase's ``seq_len`` changes the token windows its sources read (`Mixture.spaces`), so
    the shapes may change at a phase boundary. Token windows are read in one pass over the
    rows (`windows.WindowBlend`); other sources each write their own rows of the batch.
    """

    def __init__(
        self, mixture: MixtureLike, sources: list[Source], batch_size: int | None, drop: bool
    ) -> None:
        self.mixture, self.sources, self.drop = mixture, sources, drop
        origin = mixture.origin_step
        first = mixture.batch_size_at(origin)
        if batch_size is not None and batch_size != first:
            raise ConfigError(
                f"loader: batch_size for a Mixture ({batch_size}, expected None or the "
                f"mixture's batch size at its first step {origin}, {first})"
            )
        self._groups = _phase_sources(mixture, sources)
        for group in self._groups:
            layouts = [RowSpec.of(s.layout) for s in group]
            if any(other != layouts[0] for other in layouts[1:]):
                found = [dict(lay.spec()) for lay in layouts]
                raise ConfigError(
                    f"loader: mixture sources have different fields ({found}, expected one layout)"
                )
        self._names = [tuple(group[0].layout) for group in self._groups]
        self._layouts: dict[tuple[Any, ...], RowSpec] = {}
        self._direct = [[takes_rows(s) for s in group] for group in self._groups]
        self._blends = [blend_of(group) for group in self._groups]
        self._blocks = _Blocks(self._locate, _BLOCK_ROWS)

    def batch_size_at(self, step: int) -> int:
        origin = self.mixture.origin_step
        if step < origin:
            raise ConfigError(
                f"loader: step before the mixture's first step ({step}, expected >= {origin})"
            )
        end = self.mixture.end_step
        return int(self.mixture.batch_size_at(step if end is None else min(step, end - 1)))

    def _phase_at(self, step: int) -> int:
        if len(self._groups) == 1:
            return 0
        end = self.mixture.end_step
        return int(self.mixture.phase_at(step if end is None else min(step, end - 1)))

    def shape_steps(self, start: int) -> list[int]:
        """`start` and the later phase starts: the steps where the batch shape may change."""
        end = self.mixture.end_step
        later = [s for s in self.mixture.step_starts if s > start]
        return [start] + [s for s in later if end is None or s < end]

    def num_steps(self) -> int | None:
        return None

    def pick(self, step: int, rows: np.ndarray) -> Pick | None:
        batch_size = self.batch_size_at(step)
        end = self.mixture.end_step
        if end is not None and step >= end:
            return None
        _, (block_start, block_ids, block_records) = self._blocks.get(step, rows)
        offset = int(self.mixture.position_at(step)) - block_start
        source_ids = block_ids[offset : offset + batch_size]
        num_valid = len(source_ids)
        if _end_or_valid(num_valid, batch_size, self.drop):
            return None
        num_read = int(np.searchsorted(rows, num_valid))
        records = block_records[offset : offset + num_valid]
        if _is_prefix(rows, num_read):  # every leading row: views of the block, no copies
            source_ids, records = source_ids[:num_read], records[:num_read]
        else:
            source_ids, records = source_ids[rows[:num_read]], records[rows[:num_read]]
        return Pick(num_valid, num_read, source_ids, records, self._phase_at(step))

    def _locate(self, first: int, num_steps: int, rows: np.ndarray) -> tuple[int, Any]:
        """`mixture.locate` over the positions of steps [first, first + num_steps), capped
        at `_BLOCK_ROWS` positions and the mixture's end: ``(steps, (start, ids, records))``."""
        end = self.mixture.end_step
        cap = max(1, _BLOCK_ROWS // self.batch_size_at(first))
        num_steps = max(1, min(num_steps, cap, num_steps if end is None else end - first))
        start = int(self.mixture.position_at(first))
        try:
            stop = int(self.mixture.position_at(first + num_steps))
        except ConfigError:  # a read-ahead past the last position there is: this step alone
            num_steps, stop = 1, int(self.mixture.position_at(first + 1))
        source_ids, records = self.mixture.locate(start, stop)
        ids = _readonly(np.asarray(source_ids, np.int32))
        return num_steps, (start, ids, _readonly(np.asarray(records, np.int64)))

    def fill(self, pick: Pick, host: Mapping[str, np.ndarray]) -> None:
        group, names = self._groups[pick.phase], self._names[pick.phase]
        ids, num, blend = pick.source_ids, pick.num_read, self._blends[pick.phase]
        if num and blend is not None:  # token windows: every row in one pass
            blend.read(ids, pick.records, {name: host[name][:num] for name in names})
        elif num and int(ids.min()) == int(ids.max()):
            only = group[int(ids[0])]
            only.read(pick.records, {name: host[name][:num] for name in names})
        elif num:  # rows grouped by source (one sort); each source writes its own rows
            by_source = np.argsort(ids, kind="stable")
            records, out = pick.records[by_source], {name: host[name] for name in names}
            at, direct = 0, self._direct[pick.phase]
            for source_id, count in enumerate(np.bincount(ids).tolist()):
                if count:
                    rows = by_source[at : at + count]
                    source, take = group[source_id], direct[source_id]
                    _read_rows(source, records[at : at + count], out, rows, take)
                    at += count
        _zero_tail(host, names, num)

    def prepare(self, step: int, rows: np.ndarray) -> None:
        """As `SinglePicker.prepare`, up to the mixture's end."""
        end = self.mixture.end_step
        self._blocks.prepare(
            step, rows, lambda first: (end is not None and first >= end) or past_bound(self, first)
        )

    def advise(self, pick: Pick) -> None:
        group = self._groups[pick.phase]
        for source_id in np.unique(pick.source_ids).tolist():
            group[source_id].advise(pick.records[pick.source_ids == source_id])

    def row_spec_at(self, step: int, extras: Extras) -> RowSpec:
        """The batch layout of `step`'s phase (its sources' window length), cached."""
        key = (self._phase_at(step), *extras.items())
        layout = self._layouts.get(key)
        if layout is None:
            group = self._groups[key[0]]
            layout = self._layouts[key] = _source_row_spec(group[0], extras, "loader (mixture)")
        return layout

    def fingerprint_json(self) -> dict[str, Any]:
        return {
            "kind": "mixture",
            "mixture": self.mixture.fingerprint(),
            "sources": [s.fingerprint() for s in self.sources],
        }


def _read_rows(source: Any, items: np.ndarray, out: dict, rows: np.ndarray, direct: bool) -> None:
    """Item ``items[i]`` of `source` into row ``rows[i]`` of `out`, through a block unless
    the source takes ``rows=`` (`views.takes_rows`)."""
    if direct:
        return source.read(items, out, rows=rows)
    block = {name: np.empty((len(rows), *a.shape[1:]), a.dtype) for name, a in out.items()}
    source.read(items, block)
    for name, array in out.items():
        array[rows] = block[name]


def _phase_sources(mixture: MixtureLike, sources: list[Source]) -> list[list[Source]]:
    """Per phase, the source each source id reads: its own, or its view at the phase's
    window length (`Mixture.spaces`)."""
    own = {id(given): source for given, source in zip(mixture.sources, sources, strict=True)}
    return [
        [own.get(id(s.source)) or as_source(s.source) for s in mixture.spaces(p)]
        for p in range(len(mixture.phases))
    ]
