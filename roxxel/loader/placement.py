"""Placement of batch rows on a device mesh: which rows this process reads; the global `jax.Array`.

A `RowPlacement` says which rows of the global batch (dimension 0) this process's addressable
devices hold under a `jax.sharding.Sharding`, and which slice of the host block each device
takes. The loader reads exactly `plan.rows`, once each, even when several local devices hold
the same rows (a model axis that replicates the batch), and `place` turns that host block into
the global `jax.Array`. Every process computes its own plan from the same sharding, so the
global batch never depends on the number of processes.

On CPU, jax shares an aligned, contiguous numpy view's memory instead of copying it, so the
caller must not rewrite `host_rows` until JAX lets go: `place(on_release=f)` says when.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from roxxel.errors import ConfigError

__all__ = [
    "DeviceSlice",
    "RowPlacement",
    "aliases_host",
    "batch_sharding",
    "fit_sharding",
    "is_placeable",
    "is_ready",
    "place",
    "place_fields",
    "plan_fields",
    "union_rows",
]

Shape = tuple[int, ...]
AxisSpec = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceSlice:
    """The part of the host block one addressable device receives.

    Attributes:
        device: the `jax.Device`.
        start: first position in `RowPlacement.rows` order (not a global row index).
        stop: end of the position range, exclusive.
        inner: [start, stop) of each dimension 1.. (a sequence sharded along dimension 1).
        key: the device's index in the global array as (start, stop) pairs, as jax gives it.
    """

    device: Any  # a jax.Device (an alias pyright rejects as a type)
    start: int
    stop: int
    inner: tuple[tuple[int, int], ...]
    key: tuple

    @property
    def index(self) -> tuple[slice, ...]:
        """Index of this device's part in the host block."""
        return (slice(self.start, self.stop), *(slice(a, b) for a, b in self.inner))


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class RowPlacement:
    """Rows of a global batch this process needs, and how they spread over its devices.

    Build with `RowPlacement.for_sharding` (cached per sharding and shape) or `RowPlacement.full`.

    Attributes:
        sharding: the target sharding; None for a plan of every row in numpy mode.
        global_shape: shape of the global array (batch first).
        rows: sorted, unique global row indices (read-only np.int64) this process reads.
        slices: one `DeviceSlice` per addressable device, in the sharding's device order.
    """

    sharding: Sharding | None
    global_shape: Shape
    rows: np.ndarray
    slices: tuple[DeviceSlice, ...]

    @staticmethod
    def for_sharding(sharding: Sharding, global_shape: Sequence[int]) -> RowPlacement:
        """Plan for `sharding` over an array of `global_shape`: O(local devices), cached.

        Raises:
            ConfigError: a dimension (the global batch, a sequence length) is not a
                multiple of the number of shards along it, or the sharding has more
                dimensions than the shape.
        """
        return _plan(sharding, tuple(int(n) for n in global_shape))

    @staticmethod
    def full(global_batch: int) -> RowPlacement:
        """Plan that reads every row, for numpy mode (no sharding, no devices).

        >>> RowPlacement.full(3).rows.tolist()
        [0, 1, 2]
        """
        if global_batch < 1:
            raise ConfigError(f"device.RowPlacement: global batch ({global_batch}, expected >= 1)")
        rows = _readonly(np.arange(global_batch, dtype=np.int64))
        return RowPlacement(None, (global_batch,), rows, ())

    @property
    def num_rows(self) -> int:
        """Number of rows this process reads."""
        return len(self.rows)

    @property
    def local_shape(self) -> Shape:
        """Shape of the host block `place` expects: (num_rows, *global_shape[1:])."""
        return (self.num_rows, *self.global_shape[1:])


def batch_sharding(mesh: Mesh, spec: PartitionSpec | AxisSpec) -> NamedSharding:
    """A `NamedSharding` for a batch: `spec` is a PartitionSpec or the axes of dimension 0.

    `batch_sharding(mesh, "data")` is data parallel, `("data", "fsdp")` spreads the batch
    over both axes, `PartitionSpec("data", "seq")` also splits dimension 1. Mesh axes left
    out of the spec replicate the batch.

    Raises:
        ConfigError: the spec names an axis the mesh lacks.
    """
    pspec = spec if isinstance(spec, PartitionSpec) else PartitionSpec(spec)
    for axis in (axis for entry in pspec for axis in _entry_axes(entry)):
        if axis not in mesh.shape:
            raise ConfigError(
                f"device.batch_sharding: unknown mesh axis ({axis!r}, expected one of "
                f"{tuple(mesh.axis_names)})"
            )
    return NamedSharding(mesh, pspec)


def fit_sharding(sharding: Sharding, ndim: int) -> Sharding:
    """`sharding` for an array of `ndim` dimensions: a NamedSharding drops the spec
    entries past `ndim` (so labels (B,) follow tokens (B, L) sharded P("data", "seq"),
    replicated over "seq"); any other sharding is returned as is."""
    if isinstance(sharding, NamedSharding) and len(sharding.spec) > ndim:
        return NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[:ndim]))
    return sharding


def plan_fields(
    sharding: Sharding | Mapping[str, Sharding], shapes: Mapping[str, Sequence[int]]
) -> dict[str, RowPlacement]:
    """One `RowPlacement` per field: a single sharding is fitted to each field's rank
    (`fit_sharding`); a mapping must name every field.

    Raises:
        ConfigError: a field has no sharding, or `RowPlacement.for_sharding` rejects one.
    """
    plans = {}
    for name, shape in shapes.items():
        if isinstance(sharding, Sharding):
            field_sharding = fit_sharding(sharding, len(shape))
        elif name in sharding:
            field_sharding = sharding[name]
        else:
            raise ConfigError(
                f"device.plan_fields: field {name!r} has no sharding (given for "
                f"{sorted(sharding)}, expected every field)"
            )
        plans[name] = RowPlacement.for_sharding(field_sharding, shape)
    return plans


def union_rows(plans: Iterable[RowPlacement]) -> np.ndarray:
    """Sorted unique rows any of `plans` needs: what the loader reads when fields differ."""
    arrays = [plan.rows for plan in plans]
    if arrays and all(np.array_equal(arrays[0], other) for other in arrays[1:]):
        return arrays[0]  # the common case: every field shards its batch the same way
    return _readonly(np.unique(np.concatenate([np.zeros(0, np.int64), *arrays])))


def place(
    plan: RowPlacement,
    host_rows: np.ndarray,
    *,
    rows: np.ndarray | None = None,
    copy: bool = False,
    on_release: Callable[[], object] | None = None,
) -> jax.Array:
    """Assemble the global `jax.Array` from this process's host block.

    Args:
        plan: from `RowPlacement.for_sharding`.
        host_rows: the rows `plan.rows` in that order (or `rows`, a sorted unique superset,
            when fields share one block), with the full other dimensions.
        rows: global row index of each row of `host_rows`; default `plan.rows`.
        copy: copy each device's part in numpy first (once per distinct part, shared by
            replicas), so `host_rows` is free again when `place` returns. Worth it where
            `aliases_host(plan)` is true and the caller recycles its buffers: on CPU,
            `device_put(..., may_alias=False)` still shares memory (jax-ml/jax#37830).
        on_release: called once, with no arguments, when JAX no longer holds any part of
            `host_rows`: every device buffer that aliases it was deleted (the array and
            everything computed in place from it dropped) and every copy finished. Until
            then the caller must not rewrite `host_rows`. It runs on whichever thread drops
            the last reference, maybe inside garbage collection: it must be quick, must not
            raise and must not take a lock the consumer may hold.

    Cost: O(local devices) views and one batched `jax.device_put`; zero copy on CPU when
    `host_rows` is 64-byte aligned, each device's slice is contiguous and `copy` is False.

    Raises:
        ConfigError: `plan` has no sharding, or `host_rows` / `rows` do not match it.
    """
    positions = _positions(plan, host_rows, rows)
    return _place(plan, host_rows, positions, copy, on_release)


def place_fields(
    plans: Mapping[str, RowPlacement],
    host: Mapping[str, np.ndarray],
    *,
    rows: np.ndarray | None = None,
    copy: bool = False,
    on_release: Callable[[], object] | None = None,
) -> dict[str, jax.Array]:
    """`place` for every field of `plans`; `on_release` runs once, after all fields let go.

    Raises:
        ConfigError: a field of `plans` is missing from `host`, or `place` rejects one.
    """
    missing = sorted(set(plans) - set(host))
    if missing or not plans:
        raise ConfigError(
            f"device.place_fields: fields missing from the host batch ({missing}, expected "
            "every planned field, and at least one)"
        )
    positions = {name: _positions(plan, host[name], rows) for name, plan in plans.items()}
    release = _after(len(plans), on_release) if on_release is not None else None
    return {
        name: _place(plan, host[name], positions[name], copy, release)
        for name, plan in plans.items()
    }


def is_ready(tree: object) -> bool:
    """True when every `jax.Array` leaf of `tree` has finished computing (never blocks)."""
    return all(
        leaf.is_ready()  # pyright: ignore[reportAttributeAccessIssue]
        for leaf in jax.tree.leaves(tree)
        if isinstance(leaf, jax.Array)
    )


@functools.lru_cache(maxsize=64)
def is_placeable(dtype: np.dtype) -> bool:
    """Whether JAX holds arrays of `dtype`: numbers (ml_dtypes' bfloat16 and float8 too) and
    bool, not strings, bytes, objects or datetimes. Cached: a dict lookup once seen.

    >>> is_placeable(np.dtype(np.float16)), is_placeable(np.dtype("<U3"))
    (True, False)
    """
    return dtype.kind == "b" or bool(jax.numpy.issubdtype(dtype, np.number))


def aliases_host(plan: RowPlacement) -> bool:
    """True when `place` may share `host_rows` memory with the arrays it returns (a CPU
    device in the plan): the caller must then wait for `on_release`, or pass `copy=True`,
    before rewriting the block. Accelerators copy during the transfer."""
    return any(s.device.platform == "cpu" for s in plan.slices)


def _place(
    plan: RowPlacement,
    host_rows: np.ndarray,
    positions: list[tuple[int, int]],
    copy: bool,
    on_release: Callable[[], object] | None,
) -> jax.Array:
    sharding = cast(Sharding, plan.sharding)  # _positions rejected a plan without one
    owner = host_rows.view(_HostLease)
    if on_release is not None:
        weakref.finalize(owner, on_release).atexit = False
    parts = {  # jax's index of a device's part -> its view; replicas share one entry
        s.key: owner[(slice(a, b), *(slice(*ab) for ab in s.inner))]
        for s, (a, b) in zip(plan.slices, positions, strict=True)
    }
    if copy:  # np.array gives plain ndarrays, so the block is free once `place` returns
        parts = {key: np.array(view) for key, view in parts.items()}
    del owner  # from here only the views, and JAX's holds on them, pin the host block
    # make_array_from_callback takes jax's batched transfer path: ~4x faster than a
    # device_put per device followed by make_array_from_single_device_arrays
    return jax.make_array_from_callback(plan.global_shape, sharding, lambda i: parts[_key(i)])


class _HostLease(np.ndarray):
    """An ndarray subclass whose views keep it as their base, so a weakref on it tells when
    JAX (which holds the base of what it aliases) lets go of the memory."""


def _after(count: int, callback: Callable[[], object]) -> Callable[[], None]:
    """A tick that calls `callback` on the `count`-th call, from any thread: next() on a
    count is atomic under the GIL, and a lock could deadlock inside a GC pass."""
    ticks = itertools.count(1)

    def tick() -> None:
        if next(ticks) == count:
            callback()

    return tick


@functools.lru_cache(maxsize=256)
def _plan(sharding: Sharding, shape: Shape) -> RowPlacement:
    _check_divisible(sharding, shape)
    index_map = sharding.addressable_devices_indices_map(shape)
    bounds = {dev: _bounds(index, shape) for dev, index in index_map.items()}
    ranges = {b[0] for b in bounds.values()}  # replicas share a range: each row read once
    rows = np.unique(np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in ranges]))
    slices = []
    for dev, ((first, end), *inner) in bounds.items():
        start = int(np.searchsorted(rows, first))
        key = _key(index_map[dev])
        slices.append(DeviceSlice(dev, start, start + end - first, tuple(inner), key))
    return RowPlacement(sharding, shape, _readonly(rows), tuple(slices))


def _bounds(index: tuple[slice, ...] | None, shape: Shape) -> tuple[tuple[int, int], ...]:
    index = (*(index or ()), *[slice(None)] * (len(shape) - len(index or ())))
    out = []
    for dim, (sl, size) in enumerate(zip(index, shape, strict=True)):
        start, stop, step = sl.indices(size)
        if step != 1:
            raise ConfigError(
                f"device.RowPlacement: strided device slice on dimension {dim} ({sl})"
            )
        out.append((start, stop))
    return tuple(out)


def _key(index: tuple[slice, ...] | None) -> tuple:
    return () if index is None else tuple((sl.start, sl.stop) for sl in index)


def _check_divisible(sharding: Sharding, shape: Shape) -> None:
    if not shape:
        raise ConfigError(
            "device.RowPlacement: scalar global shape ((), expected a batch dimension)"
        )
    if not isinstance(sharding, NamedSharding):
        try:
            sharding.shard_shape(shape)
        except ValueError as err:
            raise ConfigError(
                f"device.RowPlacement: shape {shape} does not split ({err})"
            ) from None
        return
    if len(sharding.spec) > len(shape):
        raise ConfigError(
            f"device.RowPlacement: sharding has more dimensions than the array ({sharding.spec} "
            f"for shape {shape}, expected at most {len(shape)} entries; see fit_sharding)"
        )
    for dim, entry in enumerate(sharding.spec):
        axes = _entry_axes(entry)
        shards = math.prod(sharding.mesh.shape[a] for a in axes)
        if shape[dim] % shards:
            what = "global batch" if dim == 0 else f"dimension {dim}"
            raise ConfigError(
                f"device.RowPlacement: {what} not divisible by its shards ({shape[dim]} over "
                f"{shards} shards of mesh axes {axes}, expected a multiple of {shards})"
            )


def _positions(
    plan: RowPlacement, host: np.ndarray, rows: np.ndarray | None
) -> list[tuple[int, int]]:
    if plan.sharding is None:
        raise ConfigError(
            "device.place: plan has no sharding (RowPlacement.full, expected numpy mode)"
        )
    if not isinstance(host, np.ndarray):
        raise TypeError(f"device.place: host block is a {type(host).__name__}, expected ndarray")
    rows = plan.rows if rows is None else np.asarray(rows)
    if host.shape != (len(rows), *plan.global_shape[1:]):
        raise ConfigError(
            f"device.place: host block shape {host.shape} (expected "
            f"{(len(rows), *plan.global_shape[1:])}: the planned rows by the global shape)"
        )
    if rows is plan.rows:
        return [(s.start, s.stop) for s in plan.slices]
    return [_locate(plan, rows, s) for s in plan.slices]


def _locate(plan: RowPlacement, rows: np.ndarray, s: DeviceSlice) -> tuple[int, int]:
    first, last = int(plan.rows[s.start]), int(plan.rows[s.stop - 1])
    start = int(np.searchsorted(rows, first))
    stop = start + s.stop - s.start
    if stop > len(rows) or rows[start] != first or rows[stop - 1] != last:
        raise ConfigError(
            f"device.place: rows lack the range [{first}, {last + 1}) of device "
            f"{s.device} (expected a sorted unique superset of plan.rows)"
        )
    return start, stop


def _readonly(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


def _entry_axes(entry: AxisSpec) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
