"""`Loader`: batches of a source at each step, placed on a mesh, resumable at any step.

What the loader yields at step s is a pure function of (configuration, seed, s): the rows of
step s are positions ``[s * B, (s + 1) * B)``; a single source maps position p to record
``order.records_for_draws(n, p)`` (epoch p // n, shuffled per epoch); a `Mixture` maps
positions itself (``mixture.locate``). With a sharding, each process reads only the rows its
devices hold (`roxxel.loader.placement.RowPlacement`) and the batch is a global `jax.Array`; without one,
every row is read and the batch is numpy. A background thread (`roxxel.loader.host`) assembles
the next ``prefetch`` batches into reusable host buffers and places them.
"""

from __future__ import annotations

import dataclasses
import functools
import resource
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sized
from typing import Any, Literal, NoReturn, cast

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec, Sharding

from roxxel.errors import ConfigError, RoxxelError, StateError, check_int
from roxxel.format.cache import num_missing, num_queued
from roxxel.loader import placement as device
from roxxel.loader.host import (
    BufferPool,
    LoaderStats,
    Prefetcher,
    RowSpec,
    Spent,
    Timings,
)
from roxxel.loader.peek import Decode, PeekRow, peek_step
from roxxel.loader.pinned import Registrar, registrar_for
from roxxel.loader.steps import Pick, SinglePicker, StepPicker, past_bound, picker_for
from roxxel.protocols import MixtureLike
from roxxel.sampling.mixture import Mixture
from roxxel.sampling.order import MAX_POSITION  # step * batch_size stays below (int64 exact)
from roxxel.sources.records import Records, fingerprint_of
from roxxel.sources.windows import TokenWindows

__all__ = ["Loader", "LoaderConfig", "host_rng"]

STATE_VERSION = 1
STATE_KEYS = frozenset({"version", "step", "seed", "fingerprint"})
Batch = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class LoaderConfig:
    """Options of a `Loader` that are not its source, batch size, sharding, seed or start.

    Attributes:
        num_epochs: passes over a single source; None repeats forever (a Mixture has its
            own caps and ignores this).
        final_batch: "drop" a final partial batch, or "pad" it with zero rows and add a
            bool ``"valid"`` field (B,) that is False on padding.
        fields: the dataset fields to read (records sources; None = all).
        max_len: padded length of each variable-length field of a records source; a field
            left out is padded to its longest record in the dataset.
        provenance: add ``"source"`` (int32) and ``"record"`` per row; -1 on padding.
            ``"record"`` is int64 in numpy batches and, placed on devices, int32 unless
            ``jax_enable_x64`` is on (JAX's default has no 64-bit ints): with a sharding and
            32-bit ints, a source of more than 2**31 items is a ConfigError, never a wrap.
        prefetch: batches assembled and placed ahead of the consumer (>= 1).
        readahead: steps ahead whose pages get ``madvise(WILLNEED)`` while reads miss the
            page cache (the pipeline thread saw major page faults lately); 0 = never.
        host_transform: ``fn(batch, rng) -> batch`` on numpy host rows, once per batch, in
            the pipeline thread (or a host thread, below); ``rng`` is
            `host_rng(seed, step)`. With a sharding it sees this process's rows only.
            It returns a mapping of numpy arrays with those rows first (shape (rows, ...));
            placed on devices, of numeric or bool dtypes. Anything else is a ConfigError at
            that step naming the field, and so is a function that cannot be called as
            ``fn(batch, rng)``.
        host_threads: None or 1 reads and transforms each batch in the pipeline thread.
            N >= 2 runs N pipeline threads (``roxxel-host-*``): a free thread takes the
            next step and picks its rows (one thread at a time, in step order), then
            reads and transforms them while the others do theirs (numpy releases the GIL),
            and hands the batch straight to the consumer, which takes them in step order;
            a slow step holds up no other thread. The batches, their order and their
            errors are those of one thread, since each step's ``rng`` depends on the step
            alone. Up to ``prefetch + N`` steps are in the works or done, each in its own
            host buffer; the transform must allow calls from several threads at once.
        pin_host: stage batches bound for CUDA devices in page-locked host buffers (the
            gather writes into them; the copy to the device runs at the link's full rate);
            no effect on CPU, or where the CUDA runtime does not load. On an H100 it made
            the Loader 1.1-1.5x faster to the device (``benchmarks/device/run.sh``); turn
            it off where page-locked memory is scarce.
        device_transform: ``fn(batch, key) -> batch``, jitted, applied after placement;
            ``key`` is ``jax.random.fold_in(jax.random.key(seed), step)``.
        max_batch_bytes: the most host bytes one global batch may take (its rows times the
            bytes of a row, plus 16 bytes of bookkeeping a row), checked when the loader is
            built, before anything is allocated; default 4 GiB. Raise it for larger batches.
        shuffle_group_shards: None (the default) shuffles every epoch globally. An int G
            >= 1 keeps locality instead: each epoch shuffles the shards, then the records
            (or token windows) within each group of G consecutive shards of that list
            (`roxxel.sampling.order.ShardGroups`, rule S15 of docs/sampling.md), so only
            about G shards are read at a time: for a dataset whose shard cache is smaller
            than the dataset (docs/loading.md). A single Records or TokenWindows source only.

    Raises:
        ConfigError: on construction, for a value outside the ranges above.
    """

    num_epochs: int | None = 1
    final_batch: Literal["drop", "pad"] = "drop"
    fields: tuple[str, ...] | None = None
    max_len: Mapping[str, int] | None = None
    provenance: bool = False
    prefetch: int = 2
    readahead: int = 2
    host_transform: Callable[[Batch, np.random.Generator], Batch] | None = None
    host_threads: int | None = None
    pin_host: bool = True
    device_transform: Callable[[Batch, Any], Batch] | None = None
    max_batch_bytes: int = 1 << 32
    shuffle_group_shards: int | None = None

    def __post_init__(self) -> None:
        if self.num_epochs is not None and (not _is_int(self.num_epochs) or self.num_epochs < 1):
            _bad("num_epochs", self.num_epochs, "an int >= 1 or None")
        if self.final_batch not in ("drop", "pad"):
            _bad("final_batch", self.final_batch, "'drop' or 'pad'")
        if not _is_int(self.prefetch) or self.prefetch < 1:
            _bad("prefetch", self.prefetch, "an int >= 1")
        if not _is_int(self.readahead) or self.readahead < 0:
            _bad("readahead", self.readahead, "an int >= 0")
        check_int("loader: max_batch_bytes", self.max_batch_bytes, 1)
        if self.host_threads is not None:
            check_int("loader: host_threads", self.host_threads, 1, 256)
        if not isinstance(self.pin_host, bool):
            _bad("pin_host", self.pin_host, "True or False")
        if self.shuffle_group_shards is not None:
            check_int("loader: shuffle_group_shards", self.shuffle_group_shards, 1)
        _check_callable("host_transform", self.host_transform, "batch, rng")
        _check_callable("device_transform", self.device_transform, "batch, key")
        if self.fields is not None:
            object.__setattr__(self, "fields", tuple(self.fields))

    def order_json(self) -> dict[str, Any]:
        """The options that decide what each step contains (part of the fingerprint)."""
        options = {
            "num_epochs": self.num_epochs,
            "final_batch": self.final_batch,
            "provenance": self.provenance,
        }
        if self.shuffle_group_shards is not None:  # only when set: older states still match
            options["shuffle_group_shards"] = self.shuffle_group_shards
        return options


def host_rng(seed: int, step: int) -> np.random.Generator:
    """The host transform's generator for `step`: Philox keyed by (seed, step), no state
    (its ``bit_generator.seed_seq`` holds that key; it spawns no children).

    >>> int(host_rng(0, 5).integers(1 << 30)) == int(host_rng(0, 5).integers(1 << 30))
    True
    """
    # numpy's stubs name SeedSequence; Philox takes any ISeedSequence (numpy's docs)
    return np.random.Generator(np.random.Philox(cast(Any, _PhiloxKey(seed, step))))


class _PhiloxKey(np.random.bit_generator.ISeedSequence):
    """A seed sequence whose state is the Philox key ``(seed, step)`` itself: Philox built
    from it is the one ``Philox(key=...)`` builds, without the ~4 us that key path spends
    drawing OS entropy for a seed it then ignores (a host thread's GIL time per step)."""

    __slots__ = ("_key",)

    def __init__(self, seed: int, step: int) -> None:
        self._key = np.array([seed, step], dtype=np.uint64)

    def generate_state(self, n_words: int, dtype: Any = np.uint32) -> np.ndarray:
        if n_words != 2 or np.dtype(dtype) != np.uint64:
            raise ConfigError(
                f"host_rng: a key of {n_words} x {dtype} (expected Philox's 2 x uint64)"
            )
        return self._key.copy()


class Loader:
    """Iterates the batches of `source` from `start_step`: dicts of `jax.Array` (numpy
    without a sharding).

    Args:
        source: a `Dataset` (its records), `Records`, `TokenWindows`, a `Mixture`, or any
            object with the source protocol of `roxxel.sources.records`.
        batch_size: the global batch size (a Mixture has its own: None, or the same).
        sharding: a `jax.sharding.Sharding` for every field (fitted to each field's rank),
            ``{field: Sharding}``, or ``(mesh, spec)`` for `device.batch_sharding`; a bare
            `PartitionSpec` inside ``with jax.sharding.set_mesh(mesh):`` means
            ``(mesh, spec)``. The batch arrays carry the mesh's axis types: on a mesh with
            Explicit axes (`jax.make_mesh`'s default in recent JAX) the sharding is part of
            each array's type and the step must be written for explicit sharding; make
            the mesh with ``axis_types=(jax.sharding.AxisType.Auto,)`` for a classic step.
        seed: keys the shuffle and the transforms' randomness (0 <= seed < 2**64). None
            (the default): a Mixture's own seed (it orders the data), else 0. A Mixture
            takes no other seed: set it with ``Mixture(seed=...)``.
        shuffle: a fresh keyed permutation per epoch; False reads in dataset order.
        start_step: the first step to yield (O(1), whatever its value; ``step *
            batch_size`` below 2**62).
        config: every other option (`LoaderConfig`); a Dataset's variable-length and str
            fields are padded to their longest record unless ``config.max_len`` says.

    ``len(loader)`` is the number of steps of a finite single source (`num_steps`); an
    infinite loader (``num_epochs=None`` or a Mixture) has no length (TypeError).

    Thread-safety: one consumer thread. `close` (also on `with` exit, garbage collection,
    and when a ``for`` loop over the loader ends or breaks) joins the pipeline thread; an
    exception there is raised by the next ``next()`` with its traceback.

    Raises:
        ConfigError: a bad option, a batch size the sharding cannot split, a loader that
            would yield no step, a batch over ``max_batch_bytes``, or a start step past
            the position bound.
    """

    _prefetcher: Prefetcher | None = None  # also when __init__ raised before setting it

    def __init__(
        self,
        source: Any,
        batch_size: int | None = None,
        *,
        sharding: Any = None,
        seed: int | None = None,
        shuffle: bool = True,
        start_step: int = 0,
        config: LoaderConfig | None = None,
    ) -> None:
        self.config = config if config is not None else LoaderConfig()
        self._source = source
        self._seed = _governing_seed(source, seed)
        self._step = check_int("loader: start_step", start_step, 0)
        if batch_size is not None:  # numpy ints too, like everywhere else
            batch_size = check_int("loader: batch_size", batch_size, 1)
        self._picker: StepPicker = picker_for(
            source,
            batch_size,
            self.config,
            seed=self._seed,
            shuffle=shuffle,
            group_shards=self.config.shuffle_group_shards,
        )
        _check_step(self._picker, self._step, "loader: start_step", ConfigError)
        self._sharding = _resolve_sharding(sharding)
        if self._sharding is None and self.config.device_transform is not None:
            _bad(
                "device_transform",
                self.config.device_transform,
                "a sharding to place batches first",
            )
        _check_sizes(self._picker, self._step, self.config)  # before anything is allocated
        _check_yields(self._picker, source)
        if self._sharding is not None and self.config.provenance:
            _check_provenance(self._picker, source)
        self._assembler = _Assembler(self._picker, self._sharding, self.config, self._seed)
        for step in self._picker.shape_steps(self._step):  # every phase's shape, up front
            self._assembler.check(step)
        order, options = self._picker.fingerprint_json(), self.config.order_json()
        self._fingerprint = fingerprint_of(
            {"version": STATE_VERSION, "order": order, "config": options}
        )
        self._description = _describe(source, self._picker, order, options)
        self._prefetcher: Prefetcher | None = None
        self._timings = Timings()
        self._assembler.timings = self._timings
        self._closed = False

    @property
    def step(self) -> int:
        """The step of the next batch this loader yields."""
        return self._step

    @property
    def num_steps(self) -> int | None:
        """Steps until the end of a finite single source; None when unbounded or a Mixture."""
        return self._picker.num_steps()

    def __len__(self) -> int:
        """The number of steps of a finite single source (`num_steps`).

        Raises:
            TypeError: the loader is infinite (``num_epochs=None``) or reads a Mixture.
        """
        num_steps = self.num_steps
        if num_steps is None:
            raise TypeError(
                "loader: no length (an infinite loader, expected a finite single source: "
                "num_epochs=None repeats forever, and a Mixture ends where its schedule and "
                "caps say; use mixture.end_step)"
            )
        return num_steps

    def __bool__(self) -> bool:
        return True  # a loader is truthy even when it has no length

    def __repr__(self) -> str:
        batch_size = self._picker.batch_size_at(self._step)
        sharding = "None" if self._sharding is None else type(self._sharding).__name__
        return (
            f"Loader({self._source!r}, batch_size={batch_size}, seed={self._seed}, "
            f"step={self._step}, num_steps={self.num_steps}, sharding={sharding})"
        )

    def state(self) -> dict[str, Any]:
        """Where the loader is (JSON-able): ``{"version", "step", "seed", "fingerprint",
        "config"}``, where ``config`` describes in words what the fingerprint digests
        (so a refused restore can name what differs)."""
        return {
            "version": STATE_VERSION,
            "step": self._step,
            "seed": self._seed,
            "fingerprint": self._fingerprint,
            "config": self._description,
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continue from `state` (from `state()`): O(1), whatever its step.

        Raises:
            StateError: the state is malformed (a value that is not an int where one is
                due), belongs to another seed, configuration or source (the message names
                the fields that differ), or its step is past the position bound; the
                loader is left unchanged. A state without ``config`` (before 0.2) restores.
        """
        legacy_seed = 0 if isinstance(self._source, Mixture) else None  # the old default
        step = _check_state(state, (self._seed, legacy_seed), self._fingerprint, self._description)
        try:
            _check_step(self._picker, step, "loader.restore: step", StateError)
        except ConfigError as error:  # the mixture's own bound on steps
            raise StateError(f"loader.restore: {error}") from None
        self._stop_pipeline()
        self._step = step

    def peek(
        self,
        step: int,
        rows: int | None = None,
        *,
        field: str | None = None,
        decode: Decode | None = None,
    ) -> list[PeekRow]:
        """What `step` reads, row by row (the first `rows`, or all): per row a dict of
        ``row``, ``source``, ``record``, ``length``, ``field``, ``values``, ``text``.

        The same rows the loader yields at `step` (before transforms); the loader's position
        does not move. See `roxxel.loader.peek.peek_step` (`decode`: token ids -> text).

        Raises:
            ConfigError: a negative step, ``rows`` < 1, or a field the batch does not have.
        """
        return peek_step(self._picker, step, rows, field=field, decode=decode)

    def __iter__(self) -> Iterator[Batch]:
        # a generator left open is closed at exit, maybe after module globals are gone:
        # keep what the check needs in the frame; the daemon pipeline thread dies anyway
        exiting = sys.is_finalizing
        try:
            while (batch := self._next_or_none()) is not None:
                yield batch
                del batch
        finally:
            if not exiting():
                self._stop_pipeline()

    def __next__(self) -> Batch:
        batch = self._next_or_none()
        if batch is None:
            raise StopIteration
        return batch

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop and join the pipeline thread and the host transform's threads, release
        (unpin) the free host buffers; the loader yields nothing afterwards."""
        self._closed = True
        self._stop_pipeline()
        self._assembler.close()

    def stats(self) -> LoaderStats:
        """Where the time of each batch went so far, in seconds per batch: gather,
        host transform, placement (dispatch), the pipeline waiting on the consumer, the
        consumer waiting on the pipeline (see `roxxel.loader.host.LoaderStats`). Cheap; any
        thread. When ``wait_producer_s`` is near zero the model is the bottleneck."""
        return self._timings.stats()

    def __del__(self) -> None:
        # at interpreter exit the modules it needs may be gone; daemon threads die anyway
        if self._prefetcher is not None and not sys.is_finalizing():
            self._stop_pipeline()

    def _next_or_none(self) -> Batch | None:
        if self._closed:
            return None
        if self._prefetcher is None:
            assembler = self._assembler
            apart = self._sharding is not None and places_apart(self._sharding)
            self._prefetcher = Prefetcher(
                functools.partial(assembler.produce, place=not apart),
                self._step,
                self.config.prefetch,
                self._timings,
                finish=assembler.place if apart else None,
                threads=self.config.host_threads or 1,
            )
        try:
            entry = self._prefetcher.get()
        except BaseException:
            self._stop_pipeline()
            raise
        if entry is None:
            self._stop_pipeline()
            return None
        step, batch = entry
        self._step = step + 1
        return batch  # type: ignore[return-value]

    def _stop_pipeline(self) -> None:
        prefetcher, self._prefetcher = self._prefetcher, None
        if prefetcher is not None:
            prefetcher.close()


class _Assembler:
    """Builds the batch of one step (runs in the pipeline thread; holds no Loader)."""

    def __init__(self, picker: StepPicker, sharding: Any, config: LoaderConfig, seed: int) -> None:
        self._picker, self._sharding, self._config, self._seed = picker, sharding, config, seed
        self._extras = _extras(config)
        self._pools: dict[tuple[int, RowSpec], BufferPool] = {}
        self._advised = -1
        self._cold_until: int | None = None  # advise while step < this; None: not started
        self._rows: dict[tuple[int, RowSpec], np.ndarray] = {}
        self._plans: dict[tuple[Any, ...], dict[str, device.RowPlacement]] = {}
        self._device_fn = jax.jit(config.device_transform) if config.device_transform else None
        self.timings = Timings()
        self._registrar: Registrar | None = None
        if sharding is not None and config.pin_host:
            self._registrar = registrar_for(_devices_of(sharding))

    def close(self) -> None:
        """Drop (unpin) the free host buffers."""
        for pool in self._pools.values():
            pool.close()

    def check(self, step: int) -> np.ndarray:
        """The rows this process reads at `step`'s batch size and layout (a mixture phase may
        change both; validates the sharding once per shape)."""
        key = (self._picker.batch_size_at(step), self._picker.row_spec_at(step, self._extras))
        rows = self._rows.get(key)
        if rows is not None:
            return rows
        if self._sharding is None:
            rows = np.arange(key[0], dtype=np.int64)
        else:
            shapes = {name: (key[0], *shape) for name, shape, _ in key[1].fields}
            rows = device.union_rows(device.plan_fields(self._sharding, shapes).values())
        self._rows[key] = rows
        return rows

    def __call__(self, step: int) -> Batch | None:
        """The batch of `step`, gathered and placed in the calling thread."""
        host = self.gather(step)
        if host is None or self._sharding is None:
            return host
        return self.place(step, host)

    def produce(self, step: int, place: bool) -> Callable[[], Batch] | None:
        """`step`'s job (see `begin`), placing the batch too if `place`; None at the end."""
        job = self.begin(step)
        if job is None or not place or self._sharding is None:
            return job
        return lambda: self.place(step, job())

    def gather(self, step: int) -> Batch | None:
        """The host batch of `step` (this process's rows, host-transformed); None at the end."""
        job = self.begin(step)
        return None if job is None else job()

    def begin(self, step: int) -> Callable[[], Batch] | None:
        """Pick `step`'s rows and take its buffer (the pipeline thread, in step order); the
        job that reads and transforms them (any thread). None at the end."""
        if past_bound(self._picker, step):  # the stream ends where positions would wrap
            return None
        batch_size = self._picker.batch_size_at(step)
        rows = self.check(step)
        pick = self._picker.pick(step, rows)
        if pick is None:
            return None
        began = time.perf_counter()
        self._advise(step, pick)
        host = self._pool(
            batch_size, len(rows), self._picker.row_spec_at(step, self._extras)
        ).acquire()
        self._add_extras(pick, rows, host)
        self._lap("gather", began)
        return functools.partial(self._read, step, pick, host, rows)

    def _read(self, step: int, pick: Pick, host: Batch, rows: np.ndarray) -> Batch:
        self._picker.prepare(step, rows)  # later steps' order, outside begin's turn
        began = time.perf_counter()
        num_rows = len(rows)
        faults = _major_faults()
        self._picker.fill(pick, host)
        cold = faults is None or _major_faults() != faults
        began = self._lap("gather", began)
        fn = self._config.host_transform
        if fn is not None:
            host = _transformed(fn, host, host_rng(self._seed, step), step)
            _check_transformed(host, step, num_rows, placed=self._sharding is not None)
        if cold:  # cold pages: keep reading ahead for a while
            self._cold_until = step + 1 + _COLD_STEPS * self._config.readahead
        self._lap("transform", began)
        return host

    def place(self, step: int, host: Batch) -> Batch:
        """`step`'s host batch on the devices of the sharding, device-transformed."""
        began = time.perf_counter()
        plans = self._plans_for(self._picker.batch_size_at(step), host)
        placed = device.place_fields(plans, host, rows=self.check(step))
        del host
        if self._device_fn is not None:
            key = jax.random.fold_in(jax.random.key(self._seed), step)
            placed = self._device_fn(placed, key)
        self._lap("place", began)
        return placed

    def _lap(self, what: Spent, began: float) -> float:
        now = time.perf_counter()
        self.timings.add(what, now - began)
        return now

    def _plans_for(self, batch_size: int, host: Batch) -> dict[str, device.RowPlacement]:
        shapes = {name: (batch_size, *array.shape[1:]) for name, array in host.items()}
        key = tuple(shapes.items())
        plans = self._plans.get(key)
        if plans is None:
            plans = self._plans[key] = device.plan_fields(self._sharding, shapes)
        return plans

    def _pool(self, batch_size: int, num_rows: int, layout: RowSpec) -> BufferPool:
        pool = self._pools.get((batch_size, layout))
        if pool is None:
            pool = self._pools[batch_size, layout] = BufferPool(
                layout, num_rows, keep=self._config.prefetch + 2, registrar=self._registrar
            )
        return pool

    def _add_extras(self, pick: Pick, rows: np.ndarray, host: Batch) -> None:
        valid = rows < pick.num_valid
        if "valid" in host:
            host["valid"][:] = valid
        if "source" in host:
            host["source"][:] = -1
            host["record"][:] = -1
            host["source"][: pick.num_read] = pick.source_ids
            host["record"][: pick.num_read] = pick.records

    def _advise(self, step: int, pick: Pick) -> None:
        """Read-ahead for the steps up to `step + readahead` not advised yet; on the first
        call that includes `step` itself, so its reads go to the disk at once, not one page
        fault after another. While a dataset at a URL has shards still to fetch
        (`num_missing`), it also goes on up to `_FETCH_STEPS * readahead` steps ahead until a
        few fetches wait for a download slot (`num_queued`), `_FETCH_BURST` steps a call at
        most, from the first step on: the downloads run ahead whether or not the reads
        fault."""
        ahead = self._config.readahead
        if self._cold_until is None:  # the first step: assume a cold cache
            self._cold_until = step + 1 + ahead
        fetching = ahead > 0 and num_missing() > 0
        if ahead == 0 or (step >= self._cold_until and not fetching):
            return
        if self._advised < step:
            self._picker.advise(pick)
            # a dataset at a URL counts its missing shards once asked for one: the first step
            fetching = fetching or num_missing() > 0
        target = max(step, self._advised) + 1
        far = min(step + _FETCH_STEPS * ahead, target + _FETCH_BURST - 1)
        while target <= step + ahead or (
            fetching and target <= far and num_queued() < _FETCH_QUEUED
        ):
            later = None if past_bound(self._picker, target) else self._pick_ahead(target)
            if later is None:  # the stream ends: nothing further to advise
                target = step + _FETCH_STEPS * ahead + 1
                break
            self._picker.advise(later)
            target += 1
        self._advised = max(self._advised, target - 1)

    def _pick_ahead(self, target: int) -> Pick | None:
        return self._picker.pick(target, self.check(target))


def places_apart(sharding: Any) -> bool:
    """Whether batches are placed in a thread of their own, overlapping the next gather:
    where placement is a real copy (a GPU or TPU), not on CPU, where it aliases host memory."""
    return any(d.platform != "cpu" for d in _devices_of(sharding))


_COLD_STEPS = 8  # read ahead this many times `readahead` steps after the last major fault
# fetching for a dataset at a URL: up to this many times `readahead` steps ahead (all of
# `max_fetches` busy while an in-order read waits for its next shard), at most
# _FETCH_BURST steps further per batch, while fewer than _FETCH_QUEUED downloads wait
_FETCH_STEPS, _FETCH_BURST, _FETCH_QUEUED = 128, 16, 2
_RUSAGE = resource.RUSAGE_THREAD if sys.platform.startswith("linux") else None


def _major_faults() -> int | None:
    """Major page faults of the calling thread so far; None where the OS does not say
    (then read-ahead stays on)."""
    return None if _RUSAGE is None else resource.getrusage(_RUSAGE).ru_majflt


def _extras(config: LoaderConfig) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    extras: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    if config.final_batch == "pad":
        extras["valid"] = ((), np.dtype(bool))
    if config.provenance:
        extras["source"] = ((), np.dtype(np.int32))
        extras["record"] = ((), np.dtype(np.int64))
    return extras


def _governing_seed(source: Any, seed: object) -> int:
    """The one seed that orders the data: a Mixture's own, else the loader's (default 0)."""
    if isinstance(source, Mixture):
        if seed is not None and seed != source.seed:
            raise ConfigError(
                f"loader: seed for a Mixture ({seed!r}, expected None or the mixture's own "
                f"seed {source.seed}: the mixture orders the data, so set its seed with "
                "Mixture(seed=...))"
            )
        return int(source.seed)
    return 0 if seed is None else check_int("loader: seed", seed, 0, (1 << 64) - 1)


def _check_transformed(batch: object, step: int, num_rows: int, *, placed: bool) -> None:
    """Refuse what the host transform returned at `step` unless the loader can yield it: a
    mapping of numpy arrays of `num_rows` rows each (dimension 0), of dtypes JAX holds if
    `placed`. O(fields), nothing read or copied: about a microsecond a field."""
    where = "loader: host_transform returned"
    if not isinstance(batch, Mapping):
        raise ConfigError(
            f"{where} {type(batch).__name__} at step {step} (expected the batch, a dict of "
            "arrays: does it end with `return batch`?)"
        )
    for name, value in batch.items():
        if not isinstance(value, np.ndarray):
            raise ConfigError(
                f"{where} field {name!r} as {type(value).__name__} at step {step} (expected "
                f"{_one_row_each(num_rows)}; for one value a batch, np.full({num_rows}, value))"
            )
        if value.shape[:1] != (num_rows,):
            raise ConfigError(
                f"{where} field {name!r} of shape {value.shape} at step {step} (expected "
                f"{_one_row_each(num_rows)})"
            )
        if placed and not device.is_placeable(value.dtype):
            raise ConfigError(
                f"{where} field {name!r} of dtype {value.dtype} at step {step} (expected a "
                "numeric or bool dtype JAX can place: text as uint8 bytes or token ids)"
            )


def _one_row_each(num_rows: int) -> str:
    return f"shape ({num_rows}, ...): a numpy array with one row per row of the batch"


def _check_step(picker: StepPicker, step: int, where: str, error: type[RoxxelError]) -> None:
    """Refuse a step whose rows pass position 2**62 (`past_bound`)."""
    batch_size = max(picker.batch_size_at(s) for s in picker.shape_steps(step))
    limit = MAX_POSITION // batch_size - 1
    if step > limit:
        raise error(
            f"{where}: past the position bound ({step}, expected (step + 1) * batch_size <="
            f" 2**62: a step <= {limit} at batch size {batch_size})"
        )


_ROW_BOOKKEEPING_BYTES = 16  # a row's record (int64) and row index (int64) in the order


def _check_sizes(picker: StepPicker, step: int, config: LoaderConfig) -> None:
    """Refuse a global batch of more than ``config.max_batch_bytes`` host bytes, in any
    phase from `step` on, before anything is allocated."""
    extras = _extras(config)
    for first in picker.shape_steps(step):
        batch_size = picker.batch_size_at(first)
        row_bytes = picker.row_spec_at(first, extras).row_bytes + _ROW_BOOKKEEPING_BYTES
        if batch_size * row_bytes > config.max_batch_bytes:
            raise ConfigError(
                f"loader: batch over max_batch_bytes ({batch_size} rows of {row_bytes} bytes "
                f"at step {first}, expected at most {config.max_batch_bytes} bytes: a smaller "
                "batch_size or max_len, or LoaderConfig(max_batch_bytes=...))"
            )


def _check_yields(picker: StepPicker, source: Any) -> None:
    """Refuse a loader that would yield no step at all, saying why."""
    if isinstance(source, MixtureLike):
        first = source.origin_step
        batch_size = picker.batch_size_at(first)
        if picker.pick(first, np.arange(batch_size, dtype=np.int64)) is None:
            raise ConfigError(
                f"loader: no step to yield ({source!r} ends before its first full batch of "
                f"{batch_size} at step {first}, expected at least one batch: larger caps, "
                "on_exhausted='refill' or final_batch='pad')"
            )
        return
    if picker.num_steps() != 0 or not isinstance(picker, SinglePicker):
        return
    if isinstance(source, TokenWindows) and len(source) == 0:
        why = (
            f"{source!r} has no window: its stream has {source.num_elements} tokens, fewer "
            f"than one window of {source.width}"
        )
        rule = "a seq_len shorter than the token stream"
    else:
        epochs = "forever" if picker.num_epochs is None else f"x {picker.num_epochs} epochs"
        why = (
            f"{picker.num_items} items {epochs}, fewer than one batch of {picker.batch_size} "
            "with final_batch='drop'"
        )
        rule = "at least one batch: a smaller batch_size, more num_epochs or final_batch='pad'"
    raise ConfigError(f"loader: no step to yield ({why}, expected {rule})")


def _check_provenance(picker: StepPicker, source: Any) -> None:
    """Refuse provenance records that 32-bit device ints cannot hold (JAX's default)."""
    if jax.config.read("jax_enable_x64"):
        return
    if isinstance(picker, SinglePicker):
        sizes = [picker.num_items]
    elif isinstance(source, MixtureLike):
        spaces = [space.source for p in range(len(source.phases)) for space in source.spaces(p)]
        sizes = [len(space) for space in spaces if isinstance(space, Sized)]
    else:
        sizes = []
    largest = max(sizes, default=0)
    if largest > np.iinfo(np.int32).max + 1:
        raise ConfigError(
            f"loader: provenance records past int32 on the devices (a source of {largest} "
            "items, expected at most 2**31 with JAX's 32-bit ints: enable "
            "jax.config.update('jax_enable_x64', True), or read provenance without a sharding)"
        )


def _describe(
    source: Any, picker: StepPicker, order: Mapping[str, Any], options: Mapping[str, Any]
) -> dict[str, Any]:
    """What the fingerprint digests, in words (JSON-able): kept in the state beside it."""
    described = {**order, **options}
    if isinstance(picker, SinglePicker):
        described |= {f"source.{k}": v for k, v in _source_words(picker.source).items()}
    if isinstance(source, Mixture):
        described |= {
            "names": list(source.names),
            "sizes": [int(n) for n in source.sizes],
            "seed": int(source.seed),
            "shuffle": bool(source.shuffle),
            "on_exhausted": source.on_exhausted,
            "num_phases": len(source.phases),
        }
    return described


def _source_words(source: Any) -> dict[str, Any]:
    """The parameters of a built-in source, in words (an empty dict for any other)."""
    if isinstance(source, TokenWindows):
        return {
            "dataset": source.dataset.fingerprint,
            "field": source.field,
            "seq_len": source.seq_len,
            "stride": source.stride,
            "targets": source.targets,
            "document_structure": source.document_structure,
            "split_targets": source.split_targets,
            "dtype": source.dtype.name,
        }
    if isinstance(source, Records):
        layout = {name: [list(shape), dtype.name] for name, (shape, dtype) in source.layout.items()}
        return {"dataset": source.dataset.fingerprint, "layout": layout}
    return {}


def _devices_of(sharding: Sharding | Mapping[str, Sharding]) -> set[Any]:
    shardings = sharding.values() if isinstance(sharding, Mapping) else [sharding]
    return {d for s in shardings for d in s.device_set}


def _resolve_sharding(sharding: Any) -> Any:
    """A Sharding, ``{field: Sharding}`` or None from what the user gave, or a ConfigError
    that says what to pass."""
    if sharding is None or isinstance(sharding, Sharding):
        return sharding
    if isinstance(sharding, tuple) and len(sharding) == 2 and isinstance(sharding[0], Mesh):
        return device.batch_sharding(*sharding)
    if isinstance(sharding, Mapping) and all(isinstance(v, Sharding) for v in sharding.values()):
        return dict(sharding)
    hint = ""
    if isinstance(sharding, PartitionSpec):
        mesh = _context_mesh()
        if mesh is not None:
            return device.batch_sharding(mesh, sharding)
        hint = "; a bare PartitionSpec needs `with jax.sharding.set_mesh(mesh):` around the Loader"
    elif isinstance(sharding, Mesh):
        hint = "; for a Mesh, pass (mesh, PartitionSpec('data'))"
    raise ConfigError(
        f"loader: sharding ({sharding!r}, expected a jax.sharding.Sharding for every field, "
        f"(mesh, spec) such as (mesh, PartitionSpec('data')), or {{field: Sharding}}{hint})"
    )


def _context_mesh() -> Mesh | None:
    """The mesh of an enclosing ``jax.sharding.set_mesh``, if this JAX has one."""
    try:
        get_mesh = jax.sharding.get_mesh
    except AttributeError:  # JAX < 0.6 has no mesh context (a version, not a capability)
        return None
    mesh = get_mesh()
    return mesh if isinstance(mesh, Mesh) and not mesh.empty else None


def _check_state(
    state: Any, seeds: tuple[int, int | None], fingerprint: str, description: Mapping[str, Any]
) -> int:
    """The step of `state` once it proves to be a state of this loader. ``seeds``: this
    loader's seed, and the seed an older state (without ``config``) may carry instead."""
    where = "loader.restore"
    if not isinstance(state, Mapping) or set(state) not in (STATE_KEYS, STATE_KEYS | {"config"}):
        found = sorted(map(str, state)) if isinstance(state, Mapping) else type(state).__name__
        raise StateError(
            f"{where}: malformed state ({found}, expected keys config (optional), fingerprint,"
            " seed, step, version)"
        )
    version = check_int(f"{where}: version", state["version"], error=StateError)
    if version != STATE_VERSION:
        raise StateError(f"{where}: state version ({version}, expected {STATE_VERSION})")
    step = check_int(f"{where}: step", state["step"], 0, error=StateError)
    seed = check_int(f"{where}: seed", state["seed"], 0, error=StateError)
    if state["fingerprint"] != fingerprint:
        differs = _differences(state.get("config"), description)
        raise StateError(
            f"{where}: state of another configuration or dataset (fingerprint "
            f"{state['fingerprint']!r}{differs}, expected {fingerprint!r})"
        )
    own, legacy = seeds
    if seed != own and not (seed == legacy and "config" not in state):
        raise StateError(f"{where}: state of another seed ({seed}, expected {own})")
    return step


def _differences(saved: object, now: Mapping[str, Any]) -> str:
    """``"; differs in a (old, now new), ..."`` between two descriptions; "" without one."""
    if not isinstance(saved, Mapping):
        return ""
    keys = sorted(set(map(str, saved)) | set(now))
    parts = [
        f"{k} ({saved.get(k)!r}, now {now.get(k)!r})" for k in keys if saved.get(k) != now.get(k)
    ]
    return f"; differs in {', '.join(parts)}" if parts else ""


def _check_callable(name: str, fn: object, params: str) -> None:
    """Refuse a transform that is not callable when it is configured, not at a batch."""
    if fn is not None and not callable(fn):
        _bad(name, fn, f"a function fn({params}) or None")


def _transformed(fn: Callable[..., Any], host: Batch, rng: np.random.Generator, step: int) -> Any:
    """``fn(host, rng)``; a call that fails before ``fn`` runs (it takes no ``(batch,
    rng)``, such as the ``lambda batch: batch`` of a ``map``) is a ConfigError at ``step``;
    a TypeError raised inside ``fn`` stays as it is."""
    try:
        return fn(host, rng)
    except TypeError as error:
        if error.__traceback__ is None or error.__traceback__.tb_next is not None:
            raise  # raised inside fn
        raise ConfigError(
            f"loader: host_transform {fn!r} cannot be called as fn(batch, rng) at step {step}"
            f" ({error}; expected two positional parameters, see docs/loading.md)"
        ) from None


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _bad(name: str, value: object, rule: str) -> NoReturn:
    raise ConfigError(f"loader: {name} ({value!r}, expected {rule})")
