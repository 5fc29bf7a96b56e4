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
import resource
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import jax
import numpy as np

from roxxel.errors import ConfigError, StateError
from roxxel.loader import placement as device
from roxxel.loader.host import BufferPool, Prefetcher, RowSpec
from roxxel.loader.steps import Pick, StepPicker, picker_for
from roxxel.sources.records import fingerprint_of

__all__ = ["Loader", "LoaderConfig", "host_rng"]

STATE_VERSION = 1
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
        max_len: padded length of each variable-length field of a records source.
        provenance: add ``"source"`` (int32) and ``"record"`` (int64) per row; -1 on padding.
        prefetch: batches assembled and placed ahead of the consumer (>= 1).
        readahead: steps ahead whose pages get ``madvise(WILLNEED)`` while reads miss the
            page cache (the pipeline thread saw major page faults lately); 0 = never.
        host_transform: ``fn(batch, rng) -> batch`` on numpy host rows in the pipeline
            thread; ``rng`` is `host_rng(seed, step)`. With a sharding it sees this
            process's rows only.
        device_transform: ``fn(batch, key) -> batch``, jitted, applied after placement;
            ``key`` is ``jax.random.fold_in(jax.random.key(seed), step)``.

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
    device_transform: Callable[[Batch, Any], Batch] | None = None

    def __post_init__(self) -> None:
        if self.num_epochs is not None and (not _is_int(self.num_epochs) or self.num_epochs < 1):
            _bad("num_epochs", self.num_epochs, "an int >= 1 or None")
        if self.final_batch not in ("drop", "pad"):
            _bad("final_batch", self.final_batch, "'drop' or 'pad'")
        if not _is_int(self.prefetch) or self.prefetch < 1:
            _bad("prefetch", self.prefetch, "an int >= 1")
        if not _is_int(self.readahead) or self.readahead < 0:
            _bad("readahead", self.readahead, "an int >= 0")
        if self.fields is not None:
            object.__setattr__(self, "fields", tuple(self.fields))

    def order_json(self) -> dict[str, Any]:
        """The options that decide what each step contains (part of the fingerprint)."""
        return {
            "num_epochs": self.num_epochs,
            "final_batch": self.final_batch,
            "provenance": self.provenance,
        }


def host_rng(seed: int, step: int) -> np.random.Generator:
    """The host transform's generator for `step`: Philox keyed by (seed, step), no state.

    >>> int(host_rng(0, 5).integers(1 << 30)) == int(host_rng(0, 5).integers(1 << 30))
    True
    """
    return np.random.Generator(np.random.Philox(key=np.array([seed, step], dtype=np.uint64)))


class Loader:
    """Iterates the batches of `source` from `start_step`: dicts of `jax.Array` (numpy
    without a sharding).

    Args:
        source: a `Dataset` (its records), `Records`, `TokenWindows`, a `Mixture`, or any
            object with the source protocol of `roxxel.sources.records`.
        batch_size: the global batch size (a Mixture: None, or its size at step 0).
        sharding: a `jax.sharding.Sharding` for every field (fitted to each field's rank),
            ``{field: Sharding}``, or ``(mesh, spec)`` for `device.batch_sharding`.
        seed: keys the shuffle and the transforms' randomness (0 <= seed < 2**64); a
            Mixture orders its positions with its own seed and shuffle option.
        shuffle: a fresh keyed permutation per epoch; False reads in dataset order.
        start_step: the first step to yield (O(1), whatever its value).
        config: every other option (`LoaderConfig`).

    Thread-safety: one consumer thread. `close` (also on `with` exit, garbage collection,
    and when a ``for`` loop over the loader ends or breaks) joins the pipeline thread; an
    exception there is raised by the next ``next()`` with its traceback.

    Raises:
        ConfigError: a bad option, or a batch size the sharding cannot split.
    """

    _prefetcher: Prefetcher | None = None  # also when __init__ raised before setting it

    def __init__(
        self,
        source: Any,
        batch_size: int | None = None,
        *,
        sharding: Any = None,
        seed: int = 0,
        shuffle: bool = True,
        start_step: int = 0,
        config: LoaderConfig | None = None,
    ) -> None:
        self.config = config if config is not None else LoaderConfig()
        if not _is_int(seed) or not 0 <= seed < 1 << 64:
            _bad("seed", seed, "an int in [0, 2**64)")
        if not _is_int(start_step) or start_step < 0:
            _bad("start_step", start_step, "an int >= 0")
        self._seed, self._step = int(seed), int(start_step)
        self._picker: StepPicker = picker_for(
            source, batch_size, self.config, seed=self._seed, shuffle=shuffle
        )
        self._sharding = _resolve_sharding(sharding)
        if self._sharding is None and self.config.device_transform is not None:
            _bad(
                "device_transform",
                self.config.device_transform,
                "a sharding to place batches first",
            )
        self._assembler = _Assembler(self._picker, self._sharding, self.config, self._seed)
        for step in self._picker.shape_steps(self._step):  # every phase's shape, up front
            self._assembler.check(step)
        self._fingerprint = fingerprint_of(
            {
                "version": STATE_VERSION,
                "order": self._picker.fingerprint_json(),
                "config": self.config.order_json(),
            }
        )
        self._prefetcher: Prefetcher | None = None
        self._closed = False

    @property
    def step(self) -> int:
        """The step of the next batch this loader yields."""
        return self._step

    @property
    def num_steps(self) -> int | None:
        """Steps until the end of a finite single source; None when unbounded or a Mixture."""
        return self._picker.num_steps()

    def state(self) -> dict[str, Any]:
        """Where the loader is: ``{"version", "step", "seed", "fingerprint"}`` (JSON-able)."""
        return {
            "version": STATE_VERSION,
            "step": self._step,
            "seed": self._seed,
            "fingerprint": self._fingerprint,
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continue from `state` (from `state()`): O(1), whatever its step.

        Raises:
            StateError: the state is malformed or belongs to another seed, configuration or
                source; the loader is left unchanged.
        """
        step = _check_state(state, self._seed, self._fingerprint)
        self._stop_pipeline()
        self._step = step

    def __iter__(self) -> Iterator[Batch]:
        try:
            while (batch := self._next_or_none()) is not None:
                yield batch
                del batch
        finally:
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
        """Stop and join the pipeline thread; the loader yields nothing afterwards."""
        self._closed = True
        self._stop_pipeline()

    def __del__(self) -> None:
        if self._prefetcher is not None:
            self._stop_pipeline()

    def _next_or_none(self) -> Batch | None:
        if self._closed:
            return None
        if self._prefetcher is None:
            self._prefetcher = Prefetcher(self._assembler, self._step, self.config.prefetch)
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
        batch_size = self._picker.batch_size_at(step)
        rows = self.check(step)
        pick = self._picker.pick(step, rows)
        if pick is None:
            return None
        self._advise(step, pick)
        host = self._pool(
            batch_size, len(rows), self._picker.row_spec_at(step, self._extras)
        ).acquire()
        faults = _major_faults()
        self._picker.fill(pick, host)
        if (
            faults is None or _major_faults() != faults
        ):  # cold pages: keep reading ahead for a while
            self._cold_until = step + 1 + _COLD_STEPS * self._config.readahead
        self._add_extras(pick, rows, host)
        if self._config.host_transform is not None:
            host = self._config.host_transform(host, host_rng(self._seed, step))
        if self._sharding is None:
            return host
        plans = self._plans_for(batch_size, host)
        placed = device.place_fields(plans, host, rows=rows)
        del host
        if self._device_fn is None:
            return placed
        return self._device_fn(placed, jax.random.fold_in(jax.random.key(self._seed), step))

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
                layout, num_rows, keep=self._config.prefetch + 2
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
        fault after another."""
        ahead = self._config.readahead
        if self._cold_until is None:  # the first step: assume a cold cache
            self._cold_until = step + 1 + ahead
        if ahead == 0 or step >= self._cold_until:
            return
        if self._advised < step:
            self._picker.advise(pick)
        for target in range(max(step + 1, self._advised + 1), step + ahead + 1):
            later = self._picker.pick(target, self.check(target))
            if later is None:
                break
            self._picker.advise(later)
        self._advised = step + ahead


_COLD_STEPS = 8  # read ahead this many times `readahead` steps after the last major fault
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


def _resolve_sharding(sharding: Any) -> Any:
    if isinstance(sharding, tuple) and len(sharding) == 2:
        return device.batch_sharding(*sharding)
    return sharding


def _check_state(state: Any, seed: int, fingerprint: str) -> int:
    where = "loader.restore"
    if not isinstance(state, Mapping) or set(state) != {"version", "step", "seed", "fingerprint"}:
        found = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        raise StateError(
            f"{where}: malformed state ({found}, expected keys fingerprint, seed, step, version)"
        )
    if state["version"] != STATE_VERSION:
        raise StateError(f"{where}: state version ({state['version']!r}, expected {STATE_VERSION})")
    if not _is_int(state["step"]) or state["step"] < 0:
        raise StateError(f"{where}: step ({state['step']!r}, expected an int >= 0)")
    if state["seed"] != seed:
        raise StateError(f"{where}: state of another seed ({state['seed']!r}, expected {seed})")
    if state["fingerprint"] != fingerprint:
        raise StateError(
            f"{where}: state of another configuration or dataset (fingerprint "
            f"{state['fingerprint']!r}, expected {fingerprint!r})"
        )
    return int(state["step"])


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _bad(name: str, value: object, rule: str) -> None:
    raise ConfigError(f"loader: {name} ({value!r}, expected {rule})")
