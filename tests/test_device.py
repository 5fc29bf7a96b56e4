"""Tests for roxxel.loader.placement: row plans from shardings and global jax.Array assembly.

Runs on 8 CPU devices; the device-count flag must be set before jax makes its CPU client.
"""

from __future__ import annotations

import gc
import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from roxxel import device  # noqa: E402
from roxxel.errors import ConfigError  # noqa: E402
from roxxel.loader.placement import RowPlacement, batch_sharding, place  # noqa: E402

if jax.device_count() < 8:  # jax was initialised before this module set the flag
    pytest.skip(f"needs 8 CPU devices ({jax.device_count()}): set {_FLAG}", allow_module_level=True)


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def _reference(shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    return (np.arange(int(np.prod(shape))) % 251).reshape(shape).astype(dtype)


def _aligned(shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    num_bytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(num_bytes + 64, np.uint8)
    offset = -raw.ctypes.data % 64
    return raw[offset : offset + num_bytes].view(dtype).reshape(shape)


def _place_checked(
    sharding, shape: tuple[int, ...], dtype=np.float32
) -> tuple[RowPlacement, jax.Array]:
    """Plan, gather the planned rows from a reference batch, place, and compare everything."""
    ref = _reference(shape, dtype)
    plan = RowPlacement.for_sharding(sharding, shape)
    host = _aligned(plan.local_shape, dtype)
    host[...] = ref[plan.rows]
    arr = place(plan, host)
    assert arr.shape == shape and arr.dtype == dtype
    assert arr.sharding == sharding
    np.testing.assert_array_equal(np.asarray(arr), ref)
    for shard in arr.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), ref[shard.index])
    return plan, arr


def _replica_groups(arr: jax.Array) -> dict[tuple, list[np.ndarray]]:
    groups: dict[tuple, list[np.ndarray]] = {}
    for shard in arr.addressable_shards:
        key = tuple(s.indices(n)[:2] for s, n in zip(shard.index, arr.shape, strict=True))
        groups.setdefault(key, []).append(np.asarray(shard.data))
    return groups


def test_data_parallel_places_each_row_on_its_device():
    plan, arr = _place_checked(batch_sharding(_mesh((8,), ("data",)), "data"), (16, 3))
    assert plan.rows.tolist() == list(range(16))
    assert sorted((s.stop - s.start) for s in plan.slices) == [2] * 8
    assert len(_replica_groups(arr)) == 8


def test_fsdp_spreads_the_batch_over_two_axes():
    mesh = _mesh((2, 4), ("data", "fsdp"))
    plan, arr = _place_checked(batch_sharding(mesh, ("data", "fsdp")), (16, 4))
    assert plan.num_rows == 16
    assert len(_replica_groups(arr)) == 8


def test_model_axis_replicates_rows_read_once():
    mesh = _mesh((4, 2), ("data", "model"))
    plan, arr = _place_checked(batch_sharding(mesh, "data"), (8, 5))
    assert plan.num_rows == 8  # 8 devices hold 16 row slots; each row is read once
    groups = _replica_groups(arr)
    assert len(groups) == 4
    for copies in groups.values():
        assert len(copies) == 2
        np.testing.assert_array_equal(copies[0], copies[1])


def test_sequence_sharding_splits_dimension_one():
    mesh = _mesh((4, 2), ("data", "seq"))
    plan, arr = _place_checked(batch_sharding(mesh, P("data", "seq")), (8, 6), np.int32)
    assert plan.num_rows == 8
    assert {s.inner for s in plan.slices} == {((0, 3),), ((3, 6),)}
    assert {shard.data.shape for shard in arr.addressable_shards} == {(2, 3)}


def test_three_axis_mesh_with_batch_over_two_and_sequence_over_one():
    mesh = _mesh((2, 2, 2), ("data", "fsdp", "seq"))
    plan, _ = _place_checked(batch_sharding(mesh, P(("data", "fsdp"), "seq")), (4, 4, 2))
    assert plan.num_rows == 4


def test_single_device_sharding_takes_the_whole_batch():
    plan, arr = _place_checked(SingleDeviceSharding(jax.devices()[0]), (5, 2))
    assert plan.rows.tolist() == [0, 1, 2, 3, 4]
    assert len(plan.slices) == 1 and arr.devices() == {jax.devices()[0]}


def test_one_device_mesh_behaves_like_a_single_device():
    _place_checked(batch_sharding(_mesh((1,), ("data",)), "data"), (3, 2))


def test_fully_replicated_gives_every_device_the_whole_batch():
    plan, arr = _place_checked(batch_sharding(_mesh((8,), ("data",)), P()), (4, 2))
    assert plan.num_rows == 4
    copies = _replica_groups(arr)[((0, 4), (0, 2))]
    assert len(copies) == 8


def test_bfloat16_rows_keep_their_dtype():
    _place_checked(batch_sharding(_mesh((8,), ("data",)), "data"), (8, 2), ml_dtypes.bfloat16)


def test_batch_not_divisible_by_data_shards_is_a_config_error():
    sharding = batch_sharding(_mesh((2, 4), ("data", "fsdp")), ("data", "fsdp"))
    with pytest.raises(ConfigError, match=r"global batch not divisible .*12 over 8 shards"):
        RowPlacement.for_sharding(sharding, (12, 3))


def test_sequence_not_divisible_names_the_dimension():
    sharding = batch_sharding(_mesh((4, 2), ("data", "seq")), P("data", "seq"))
    with pytest.raises(ConfigError, match=r"dimension 1 not divisible .*5 over 2 shards"):
        RowPlacement.for_sharding(sharding, (8, 5))


def test_spec_longer_than_the_array_is_a_config_error_and_fit_sharding_trims_it():
    sharding = batch_sharding(_mesh((4, 2), ("data", "seq")), P("data", "seq"))
    with pytest.raises(ConfigError, match="more dimensions than the array"):
        RowPlacement.for_sharding(sharding, (8,))
    fitted = device.fit_sharding(sharding, 1)
    assert isinstance(fitted, NamedSharding) and fitted.spec == P("data")
    _place_checked(fitted, (8,))


def test_scalar_shape_is_a_config_error():
    with pytest.raises(ConfigError, match="scalar"):
        RowPlacement.for_sharding(SingleDeviceSharding(jax.devices()[0]), ())


def test_batch_sharding_rejects_an_unknown_axis():
    with pytest.raises(ConfigError, match="unknown mesh axis"):
        batch_sharding(_mesh((8,), ("data",)), ("data", "model"))


def test_plan_is_cached_per_sharding_and_shape():
    sharding = batch_sharding(_mesh((8,), ("data",)), "data")
    assert RowPlacement.for_sharding(sharding, (8, 2)) is RowPlacement.for_sharding(
        sharding, [8, 2]
    )
    assert not RowPlacement.for_sharding(sharding, (8, 2)).rows.flags.writeable


def test_full_plan_reads_every_row_and_cannot_be_placed():
    plan = RowPlacement.full(4)
    assert plan.rows.tolist() == [0, 1, 2, 3] and plan.sharding is None
    with pytest.raises(ConfigError, match="no sharding"):
        place(plan, np.zeros((4,), np.float32))
    with pytest.raises(ConfigError, match="global batch"):
        RowPlacement.full(0)


def test_place_rejects_a_host_block_of_the_wrong_shape():
    plan = RowPlacement.for_sharding(batch_sharding(_mesh((8,), ("data",)), "data"), (8, 2))
    with pytest.raises(ConfigError, match=r"host block shape \(8, 3\)"):
        place(plan, np.zeros((8, 3), np.float32))
    with pytest.raises(TypeError):
        place(plan, [[0, 0]] * 8)  # type: ignore[arg-type]


class _ProcessView:
    """A sharding as one process of a multi-host job sees it: only `device_ids` addressable."""

    def __init__(self, sharding: NamedSharding, device_ids: set[int]) -> None:
        self._sharding, self._ids = sharding, device_ids

    def shard_shape(self, shape):
        return self._sharding.shard_shape(shape)

    def addressable_devices_indices_map(self, shape):
        index_map = self._sharding.devices_indices_map(shape)
        return {d: index for d, index in index_map.items() if d.id in self._ids}


def test_plan_reads_only_the_rows_of_addressable_devices():
    mesh = _mesh((4, 2), ("data", "model"))  # data shard k lives on devices 2k, 2k+1
    view = _ProcessView(batch_sharding(mesh, "data"), {0, 1, 4, 5})
    plan = RowPlacement.for_sharding(view, (16, 2))  # type: ignore[arg-type]
    assert plan.rows.tolist() == [0, 1, 2, 3, 8, 9, 10, 11]  # data shards 0 and 2, once each
    ref = _reference((16, 2))
    host = ref[plan.rows]
    index_map = view.addressable_devices_indices_map((16, 2))
    for s in plan.slices:
        np.testing.assert_array_equal(host[s.index], ref[index_map[s.device]])


def test_plan_fields_fits_one_sharding_to_each_rank_and_places_together():
    sharding = batch_sharding(_mesh((4, 2), ("data", "seq")), P("data", "seq"))
    plans = device.plan_fields(sharding, {"tokens": (8, 4), "label": (8,)})
    rows = device.union_rows(plans.values())
    assert rows.tolist() == list(range(8))
    host = {"tokens": _reference((8, 4), np.int32), "label": np.arange(8, dtype=np.int64)}
    out = device.place_fields(plans, host, rows=rows)
    np.testing.assert_array_equal(np.asarray(out["tokens"]), host["tokens"])
    np.testing.assert_array_equal(np.asarray(out["label"]), host["label"])
    assert out["label"].sharding.spec == P("data")  # type: ignore[attr-defined]


def test_plan_fields_needs_a_sharding_for_every_field():
    sharding = batch_sharding(_mesh((8,), ("data",)), "data")
    with pytest.raises(ConfigError, match="field 'label' has no sharding"):
        device.plan_fields({"tokens": sharding}, {"tokens": (8, 2), "label": (8,)})
    with pytest.raises(ConfigError, match="missing from the host batch"):
        device.place_fields(device.plan_fields(sharding, {"x": (8,)}), {})


def test_place_with_a_superset_of_rows_takes_each_device_range():
    view = _ProcessView(batch_sharding(_mesh((4, 2), ("data", "model")), "data"), {0, 1, 4, 5})
    plan = RowPlacement.for_sharding(view, (16,))  # type: ignore[arg-type]
    full = np.arange(16, dtype=np.int64)
    positions = device._positions(plan, np.zeros(16), full)
    assert positions == [(0, 4), (0, 4), (8, 12), (8, 12)]
    with pytest.raises(ConfigError, match="rows lack the range"):
        device._positions(plan, np.zeros(15), np.delete(full, 9))


def test_on_release_waits_until_jax_drops_the_aliased_block():
    sharding = batch_sharding(_mesh((4, 2), ("data", "model")), "data")
    plan = RowPlacement.for_sharding(sharding, (8, 16))
    host = _aligned(plan.local_shape)
    host[...] = _reference((8, 16))
    released: list[int] = []
    arr = place(plan, host, on_release=lambda: released.append(1))
    doubled = jax.jit(lambda x: x * 2)(arr)
    gc.collect()
    host[0, 0] = -1.0  # a probe: CPU jax shares aligned host memory instead of copying
    aliased = float(arr.addressable_shards[0].data[0, 0]) == -1.0
    assert released == [] or not aliased
    del arr
    doubled.block_until_ready()
    gc.collect()
    assert released == [1]


def test_place_fields_releases_once_after_every_field():
    sharding = batch_sharding(_mesh((8,), ("data",)), "data")
    plans = device.plan_fields(sharding, {"a": (8, 16), "b": (8,)})
    host = {"a": _aligned((8, 16)), "b": _aligned((8,))}
    released: list[int] = []
    out = device.place_fields(plans, host, on_release=lambda: released.append(1))
    del out["a"]
    gc.collect()
    assert released == [] or len(released) == 1
    del out
    gc.collect()
    assert released == [1]


def test_is_ready_reports_finished_arrays():
    sharding = batch_sharding(_mesh((8,), ("data",)), "data")
    _, arr = _place_checked(sharding, (8, 2))
    arr.block_until_ready()
    assert device.is_ready({"x": arr, "n": 3})


def test_copy_frees_the_host_block_when_place_returns():
    sharding = batch_sharding(_mesh((4, 2), ("data", "model")), "data")
    plan = RowPlacement.for_sharding(sharding, (8, 16))
    assert device.aliases_host(plan)  # CPU devices share aligned host memory
    ref = _reference((8, 16))
    host = _aligned(plan.local_shape)
    host[...] = ref
    released: list[int] = []
    arr = place(plan, host, copy=True, on_release=lambda: released.append(1))
    assert released == [1]
    host[...] = -1.0  # the ring buffer is rewritten for the next batch
    np.testing.assert_array_equal(np.asarray(arr), ref)
    for copies in _replica_groups(arr).values():
        np.testing.assert_array_equal(copies[0], copies[1])


def test_a_strided_host_block_is_copied_and_placed():
    plan = RowPlacement.for_sharding(batch_sharding(_mesh((8,), ("data",)), "data"), (8, 3))
    ref = _reference((8, 3))
    wide = np.zeros((8, 6), np.float32)
    wide[:, ::2] = ref
    released: list[int] = []
    arr = place(plan, wide[:, ::2], on_release=lambda: released.append(1))
    arr.block_until_ready()
    gc.collect()
    assert released == [1]  # jax copied the strided parts, so the block is free already
    wide[...] = -1.0
    np.testing.assert_array_equal(np.asarray(arr), ref)
