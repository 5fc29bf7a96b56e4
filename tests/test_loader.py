"""Loader: order and resume, final batches, pipeline threads and buffers, sharded placement.

Runs on 8 CPU devices (tests/conftest.py sets the flag before jax loads).
"""

from __future__ import annotations

import gc
import json
import sys
import threading
import time
import traceback

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import roxxel
from roxxel.errors import ConfigError, StateError
from roxxel.loader.host import BufferPool, Prefetcher, RowSpec
from roxxel.loader.loader import Loader, LoaderConfig, host_rng
from roxxel.loader.steps import SinglePicker, picker_for
from roxxel.sources.windows import TokenWindows

if jax.device_count() < 8:
    pytest.skip(f"needs 8 CPU devices ({jax.device_count()})", allow_module_level=True)

NUM_RECORDS = 37  # prime: batches never line up with epochs by accident


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("loader")
    schema = roxxel.Schema.parse({"tokens": "int32[]", "label": "int64", "image": "float32[4]"})
    rng = np.random.default_rng(1)
    with roxxel.DatasetWriter(path, schema, shard_bytes=600) as writer:
        for i in range(NUM_RECORDS):
            tokens = rng.integers(0, 1000, rng.integers(1, 50)).astype(np.int32)
            writer.write(
                {"tokens": tokens, "label": i, "image": np.arange(4, dtype=np.float32) + i}
            )
    return roxxel.open_dataset(path)


def _config(**kwargs) -> LoaderConfig:
    return LoaderConfig(fields=("label", "image"), **kwargs)


def _batches(loader, num_steps=None):
    with loader:
        out = []
        for batch in loader:
            out.append({k: np.array(v) for k, v in batch.items()})
            if num_steps is not None and len(out) == num_steps:
                break
        return out


def _assert_same(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def _live_loader_threads():
    return [t for t in threading.enumerate() if t.name == "roxxel-loader"]


# --- order and resume ---------------------------------------------------------------------


def test_each_epoch_reads_every_record_once_and_epochs_differ(dataset):
    loader = Loader(dataset, NUM_RECORDS, seed=3, config=_config(num_epochs=3))
    epochs = [b["label"] for b in _batches(loader)]
    assert len(epochs) == 3
    for labels in epochs:
        assert sorted(labels.tolist()) == list(range(NUM_RECORDS))
    assert epochs[0].tolist() != epochs[1].tolist() != epochs[2].tolist()


def test_without_shuffle_records_come_in_dataset_order(dataset):
    batches = _batches(Loader(dataset, 10, shuffle=False, config=_config(num_epochs=2)))
    labels = np.concatenate([b["label"] for b in batches])
    np.testing.assert_array_equal(labels, np.arange(70) % NUM_RECORDS)


@pytest.mark.parametrize("k", [0, 1, 2, 7, 9, 30])  # 9 * 4 = 36: the last step of epoch 0
def test_restore_continues_exactly_like_an_uninterrupted_run(dataset, k):
    config = _config(num_epochs=4, final_batch="pad", provenance=True)
    reference = _batches(Loader(dataset, 4, seed=11, config=config))
    first = Loader(dataset, 4, seed=11, config=config)
    _batches(first, num_steps=k) if k else None
    state = json.loads(json.dumps(first.state()))
    assert state["step"] == k
    resumed = Loader(dataset, 4, seed=11, config=config)
    resumed.restore(state)
    _assert_same(_batches(resumed), reference[k:])
    _assert_same(_batches(Loader(dataset, 4, seed=11, start_step=k, config=config)), reference[k:])


def test_a_huge_start_step_costs_nothing_and_matches_the_arithmetic(dataset):
    step = 10**12
    loader = Loader(dataset, 4, seed=5, start_step=step, config=_config(num_epochs=None))
    with loader:
        batch = next(loader)
        assert loader.state()["step"] == step + 1
    draws = step * 4 + np.arange(4)
    expected = roxxel.sampling.order.records_for_draws(
        NUM_RECORDS, draws, seed=5, source=0, shuffle=True
    )
    np.testing.assert_array_equal(batch["label"], expected)


def test_restore_in_the_middle_of_iteration_restarts_at_the_state(dataset):
    config = _config(num_epochs=None)
    reference = _batches(Loader(dataset, 5, config=config), num_steps=12)
    loader = Loader(dataset, 5, config=config)
    with loader:
        for _ in range(3):
            next(loader)
        saved = loader.state()
        for _ in range(5):
            next(loader)
        loader.restore(saved)
        got = [{k: np.array(v) for k, v in next(loader).items()} for _ in range(9)]
    _assert_same(got, reference[3:12])


@pytest.mark.parametrize(
    "change",
    [
        {"seed": 2},
        {"batch_size": 5},
        {"shuffle": False},
        {"config": LoaderConfig(fields=("label",))},
        {"config": LoaderConfig(fields=("label", "image"), num_epochs=2)},
    ],
)
def test_a_state_of_another_configuration_raises_and_changes_nothing(dataset, change):
    kwargs = {"batch_size": 4, "seed": 1, "shuffle": True, "config": _config()}
    state = Loader(dataset, **kwargs).state()
    other = Loader(dataset, **{**kwargs, **change, "start_step": 3})
    with pytest.raises(StateError):
        other.restore(state)
    assert other.step == 3


def test_malformed_states_and_other_datasets_raise_state_error(dataset, tmp_path):
    loader = Loader(dataset, 4, config=_config())
    good = loader.state()
    bad = [
        None,
        {},
        {**good, "step": -1},
        {**good, "step": "3"},
        {**good, "version": 99},
        {**good, "extra": 1},
    ]
    for state in bad:
        with pytest.raises(StateError):
            loader.restore(state)
    schema = roxxel.Schema.parse({"label": "int64", "image": "float32[4]"})
    with roxxel.DatasetWriter(tmp_path, schema) as writer:
        for i in range(NUM_RECORDS):
            writer.write({"label": i + 1, "image": np.zeros(4, np.float32)})
    with pytest.raises(StateError, match="fingerprint"):
        Loader(roxxel.open_dataset(tmp_path), 4, config=_config()).restore(good)
    assert loader.step == 0


# --- final batch ---------------------------------------------------------------------------


def test_a_final_partial_batch_is_dropped_by_default(dataset):
    loader = Loader(dataset, 10, config=_config())
    assert loader.num_steps == 3
    batches = _batches(loader)
    assert [len(b["label"]) for b in batches] == [10, 10, 10]
    assert "valid" not in batches[0]


def test_a_padded_final_batch_carries_a_validity_mask(dataset):
    loader = Loader(dataset, 10, config=_config(final_batch="pad", provenance=True))
    assert loader.num_steps == 4
    batches = _batches(loader)
    last = batches[-1]
    np.testing.assert_array_equal(last["valid"], np.arange(10) < 7)
    assert not last["image"][7:].any() and (last["record"][7:] == -1).all()
    labels = np.concatenate([b["label"][b["valid"]] for b in batches])
    assert sorted(labels.tolist()) == list(range(NUM_RECORDS))
    np.testing.assert_array_equal(
        np.concatenate([b["record"][b["valid"]] for b in batches]), labels
    )


# --- transforms ----------------------------------------------------------------------------


def _noisy(batch, rng):
    return {**batch, "noise": rng.normal(size=len(batch["label"])).astype(np.float32)}


def test_host_transform_randomness_comes_from_seed_and_step(dataset):
    config = _config(num_epochs=None, host_transform=_noisy)
    reference = _batches(Loader(dataset, 4, seed=9, config=config), num_steps=6)
    resumed = _batches(Loader(dataset, 4, seed=9, start_step=4, config=config), num_steps=2)
    _assert_same(resumed, reference[4:6])
    np.testing.assert_array_equal(
        reference[5]["noise"], host_rng(9, 5).normal(size=4).astype(np.float32)
    )


def test_device_transform_runs_jitted_on_the_placed_batch(dataset):
    mesh = Mesh(np.array(jax.devices()), ("data",))

    def double(batch, key):
        return {"image": batch["image"] * 2, "bits": jax.random.bits(key, (8,))}

    config = _config(num_epochs=None, device_transform=double)
    plain = _batches(
        Loader(dataset, 8, sharding=(mesh, P("data")), config=_config(num_epochs=None)), 3
    )
    got = _batches(Loader(dataset, 8, sharding=(mesh, P("data")), config=config), 3)
    for step, (a, b) in enumerate(zip(got, plain, strict=True)):
        np.testing.assert_array_equal(a["image"], b["image"] * 2)
        expected = jax.random.bits(jax.random.fold_in(jax.random.key(0), step), (8,))
        np.testing.assert_array_equal(a["bits"], np.asarray(expected))


# --- pipeline: threads, errors, buffers ----------------------------------------------------


def test_no_thread_is_left_after_close_break_exhaustion_or_garbage_collection(dataset):
    config = _config(num_epochs=None)
    loader = Loader(dataset, 4, config=config)
    next(loader)
    loader.close()
    assert not _live_loader_threads()
    for _ in Loader(dataset, 4, config=config):
        break
    assert not _live_loader_threads()
    _batches(Loader(dataset, 4, config=_config()))
    assert not _live_loader_threads()
    loader = Loader(dataset, 4, config=config)
    next(loader)
    del loader
    gc.collect()
    assert not _live_loader_threads()


def _fail_at_step_two(batch, rng):
    if batch["label"].shape and _fail_at_step_two.calls == 2:
        raise RuntimeError("boom in the pipeline")
    _fail_at_step_two.calls += 1
    return batch


def test_a_pipeline_exception_reaches_the_consumer_with_its_traceback(dataset):
    _fail_at_step_two.calls = 0
    loader = Loader(dataset, 4, config=_config(num_epochs=None, host_transform=_fail_at_step_two))
    got = []
    with pytest.raises(RuntimeError, match="boom in the pipeline") as info:
        for batch in loader:
            got.append(batch)
    assert len(got) == 2
    frames = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert "_fail_at_step_two" in frames
    assert not _live_loader_threads()
    assert loader.step == 2


@pytest.mark.parametrize("sharded", [False, True])
def test_held_batches_never_change_while_the_pipeline_reuses_buffers(dataset, sharded):
    # 16 int32 tokens = 64-byte rows: every device slice is aligned, so on CPU the placed
    # arrays alias the host buffers and only the release tracking keeps them intact
    windows = TokenWindows(dataset, "tokens", 16, targets=False)
    config = LoaderConfig(num_epochs=None, prefetch=2)
    sharding = (Mesh(np.array(jax.devices()), ("data",)), P("data")) if sharded else None
    copies = _batches(Loader(windows, 8, config=config), num_steps=20)
    with Loader(windows, 8, sharding=sharding, config=config) as loader:
        held = [next(loader) for _ in range(10)]
        for _ in range(10):  # dropped at once: their buffers get reused
            next(loader)
        pool = next(iter(loader._assembler._pools.values()))
        assert pool.num_allocated >= 10  # the held batches pinned their buffers
        _assert_same([{k: np.array(v) for k, v in b.items()} for b in held], copies[:10])
        if sharded:
            pointer = held[0]["tokens"].addressable_shards[0].data.unsafe_buffer_pointer()
            assert pointer % 64 == 0


def test_released_buffers_are_reused_so_memory_stays_flat(dataset):
    loader = Loader(dataset, 8, config=_config(num_epochs=None, prefetch=2))
    with loader:
        for _ in range(40):
            next(loader)
        pools = loader._assembler._pools
        assert sum(pool.num_allocated for pool in pools.values()) <= 2 + 3


def test_bad_options_raise_config_error(dataset):
    with pytest.raises(ConfigError):
        Loader(dataset, 0, config=_config())
    with pytest.raises(ConfigError):
        Loader(dataset, 4, seed=-1, config=_config())
    with pytest.raises(ConfigError):
        Loader(dataset, 4, config=LoaderConfig(max_len={"tokens": 0}))  # max_len >= 1
    with pytest.raises(ConfigError, match="device_transform"):
        Loader(dataset, 4, config=_config(device_transform=lambda b, k: b))
    for bad in ({"prefetch": 0}, {"num_epochs": 0}, {"final_batch": "keep"}, {"readahead": -1}):
        with pytest.raises(ConfigError):
            LoaderConfig(**bad)


# --- placement -----------------------------------------------------------------------------


def _mesh(shape, names):
    return Mesh(np.array(jax.devices()).reshape(shape), names)


LAYOUTS = {
    "dp": ((8,), ("data",), P("data")),
    "fsdp": ((2, 4), ("data", "fsdp"), P(("data", "fsdp"))),
    "dp_tp": ((4, 2), ("data", "model"), P("data")),
    "seq": ((4, 2), ("data", "seq"), P("data", "seq")),
    "one_device": ((1,), ("data",), P("data")),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sharded_batches_equal_the_numpy_batches(dataset, layout):
    shape, names, spec = LAYOUTS[layout]
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    mesh = Mesh(devices, names)
    windows = TokenWindows(dataset, "tokens", 8, document_structure=True, split_targets=True)
    config = LoaderConfig(num_epochs=None, final_batch="pad", provenance=True)
    expected = _batches(Loader(windows, 16, seed=4, config=config), num_steps=5)
    with Loader(windows, 16, seed=4, sharding=(mesh, spec), config=config) as loader:
        for want in expected:
            batch = next(loader)
            assert isinstance(batch["inputs"], jax.Array)
            assert batch["inputs"].sharding.spec == spec
            for key, value in want.items():
                np.testing.assert_array_equal(np.asarray(batch[key]), value, err_msg=key)
                for shard in batch[key].addressable_shards:  # replicas agree with the global
                    np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index])


def test_per_field_shardings_place_each_field_its_own_way(dataset):
    mesh = _mesh((4, 2), ("data", "model"))
    shardings = {
        "label": NamedSharding(mesh, P("data")),
        "image": NamedSharding(mesh, P("data", "model")),
    }
    expected = _batches(Loader(dataset, 8, config=_config()), num_steps=2)
    got = _batches(Loader(dataset, 8, sharding=shardings, config=_config()), num_steps=2)
    _assert_same(got, expected)


def test_a_batch_the_mesh_cannot_split_is_a_config_error(dataset):
    with pytest.raises(ConfigError, match="divisible"):
        Loader(dataset, 6, sharding=(_mesh((8,), ("data",)), P("data")), config=_config())


# --- mixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def second(tmp_path_factory):
    path = tmp_path_factory.mktemp("second")
    schema = roxxel.Schema.parse({"label": "int64", "image": "float32[4]"})
    with roxxel.DatasetWriter(path, schema, shard_bytes=300) as writer:
        for i in range(11):
            writer.write({"label": 1000 + i, "image": np.full(4, -i, np.float32)})
    return roxxel.open_dataset(path)


def _mixture(dataset, second):
    phases = [
        roxxel.Phase({"a": 1, "b": 1}, end_step=5),
        roxxel.Phase({"a": 3, "b": 1}, end_step=9, batch_size=8),
        roxxel.Phase({"a": 1, "b": 2}, end_step=14),
    ]
    return roxxel.Mixture({"a": dataset, "b": second}, phases, batch_size=4, caps={"b": 2}, seed=7)


def test_a_mixture_source_yields_what_locate_says(dataset, second):
    mixture = _mixture(dataset, second)
    config = _config(provenance=True)
    batches = _batches(Loader(mixture, config=config))
    assert [len(b["label"]) for b in batches[:10]] == [4] * 5 + [8] * 4 + [4]
    position = 0
    for step, batch in enumerate(batches):
        assert mixture.position_at(step) == position
        sources, records = mixture.locate(position, position + len(batch["label"]))
        position += len(batch["label"])
        np.testing.assert_array_equal(batch["source"], sources)
        np.testing.assert_array_equal(batch["record"], records)
        np.testing.assert_array_equal(batch["label"], records + 1000 * sources)
    assert (np.concatenate([b["source"] for b in batches]) == 1).sum() == 22  # b's cap: 2 epochs


@pytest.mark.parametrize("batch_size", [4, 3])
@pytest.mark.parametrize("host_threads", [None, 2])
def test_issue14_a_mixture_at_the_position_bound_ends_after_its_last_step(
    dataset, second, batch_size, host_threads
):
    """A job computes the next block of a mixture's order ahead: at the position bound that
    block has no positions, and computing it failed the last steps (a red-team find). The
    stream ends before the first step whose rows pass 2**62, also where the batch size does
    not divide 2**62 (that step failed before, single source or mixture)."""
    mixture = roxxel.Mixture({"a": dataset, "b": second}, {"a": 1, "b": 1}, batch_size=batch_size)
    last = 2**62 // batch_size - 1  # (last + 1) * batch_size <= 2**62 < (last + 2) * ...
    config = _config(provenance=True, host_threads=host_threads)
    loader = Loader(mixture, start_step=last - 2, config=config)
    batches = _batches(loader)
    assert len(batches) == 3 and loader.step == last + 1
    for k, batch in enumerate(batches):
        position = mixture.position_at(last - 2 + k)
        _, records = mixture.locate(position, position + batch_size)
        np.testing.assert_array_equal(batch["record"], records)
    with pytest.raises(ConfigError, match=r"\(step \+ 1\) \* batch_size <= 2\*\*62"):
        Loader(mixture, start_step=last + 1, config=config)


@pytest.mark.parametrize("batch_size", [8, 3])
def test_issue14_a_single_source_at_the_position_bound_ends_after_its_last_step(
    dataset, batch_size
):
    last = 2**62 // batch_size - 1
    config = _config(num_epochs=None, host_threads=2)
    loader = Loader(dataset, batch_size, start_step=last - 1, config=config)
    assert [len(b["label"]) for b in _batches(loader)] == [batch_size, batch_size]
    assert loader.step == last + 1


def test_issue14_a_finite_mixture_with_host_threads_ends_as_with_one(dataset, second):
    """The host threads compute the next block of a mixture's order ahead (`prepare`): not
    past the mixture's end, where the mixture has no positions."""
    config = _config(final_batch="pad", provenance=True)
    reference = _batches(Loader(_mixture(dataset, second), config=config))
    threaded = _config(final_batch="pad", provenance=True, host_threads=2)
    _assert_same(_batches(Loader(_mixture(dataset, second), config=threaded)), reference)


@pytest.mark.parametrize("k", [0, 1, 5, 9, 12])  # phase boundaries at 5 and 9
def test_mixture_resume_matches_an_uninterrupted_run(dataset, second, k):
    config = _config(final_batch="pad", provenance=True)
    reference = _batches(Loader(_mixture(dataset, second), config=config))
    first = Loader(_mixture(dataset, second), config=config)
    _batches(first, num_steps=k) if k else None
    resumed = Loader(_mixture(dataset, second), config=config)
    resumed.restore(first.state())
    _assert_same(_batches(resumed), reference[k:])


def test_mixture_batches_place_on_the_mesh_when_the_batch_size_changes(dataset, second):
    mesh = _mesh((4, 2), ("data", "model"))
    config = _config(provenance=True)
    expected = _batches(Loader(_mixture(dataset, second), config=config), num_steps=11)
    got = _batches(Loader(_mixture(dataset, second), sharding=(mesh, P("data")), config=config), 11)
    _assert_same(got, expected)


def test_a_changed_mixture_refuses_the_old_state(dataset, second):
    state = Loader(_mixture(dataset, second), config=_config(), start_step=6).state()
    changed = roxxel.Mixture({"a": dataset, "b": second}, {"a": 1, "b": 1}, batch_size=4, seed=7)
    with pytest.raises(StateError):
        Loader(changed, config=_config()).restore(state)
    with pytest.raises(ConfigError, match="batch_size"):
        Loader(_mixture(dataset, second), 8, config=_config())
    with pytest.raises(ConfigError, match="shuffle"):
        Loader(_mixture(dataset, second), shuffle=False, config=_config())


@pytest.mark.parametrize("mixed", [False, True])
def test_picks_do_not_depend_on_the_order_steps_are_asked_in(dataset, second, mixed):
    # the plan computes the order of blocks of steps at once: a cache, never state
    config = _config(num_epochs=4)
    source = _mixture(dataset, second) if mixed else dataset

    def fresh(step, rows):
        return picker_for(source, None if mixed else 5, config, seed=2, shuffle=True).pick(
            step, rows
        )

    plan = picker_for(source, None if mixed else 5, config, seed=2, shuffle=True)
    steps = [*range(12), 3, 0, 11, 7, 7, 2, 13, 12, 20, 1, *range(4, 9)]
    for k, step in enumerate(steps):
        size = plan.batch_size_at(step)
        rows = np.arange(size, dtype=np.int64)[k % 2 :: 1 + k % 2]  # all rows, or every other
        got, expected = plan.pick(step, rows), fresh(step, rows)
        assert (got is None) == (expected is None), step
        if got is not None and expected is not None:
            assert (got.num_valid, got.num_read) == (expected.num_valid, expected.num_read)
            np.testing.assert_array_equal(got.source_ids, expected.source_ids)
            np.testing.assert_array_equal(got.records, expected.records)


# --- pipeline pieces -----------------------------------------------------------------------


def test_buffer_pool_takes_a_buffer_back_only_when_every_view_is_gone():
    pool = BufferPool(RowSpec.of({"x": ((3,), np.int32), "y": ((), np.float64)}), 5, keep=1)
    batch = pool.acquire()
    assert all(a.ctypes.data % 64 == 0 for a in batch.values())
    view = batch["x"][2:]
    del batch
    gc.collect()
    assert pool.acquire() is not None and pool.num_allocated == 2  # the first is still held
    del view
    gc.collect()
    again = pool.acquire()
    assert pool.num_allocated == 2 and again["x"].shape == (5, 3)


def test_prefetcher_yields_steps_in_order_then_none():
    prefetcher = Prefetcher(lambda step: (lambda: step * 10) if step < 4 else None, 1, depth=2)
    got = [prefetcher.get() for _ in range(4)]
    assert got == [(1, 10), (2, 20), (3, 30), None]
    prefetcher.close()
    assert not prefetcher.alive


def test_prefetcher_raises_the_original_exception_and_joins():
    def begin(step):
        if step == 2:
            raise KeyError("missing")
        return lambda: step

    prefetcher = Prefetcher(begin, start=0, depth=1)
    assert prefetcher.get() == (0, 0) and prefetcher.get() == (1, 1)
    with pytest.raises(KeyError, match="missing"):
        prefetcher.get()
    assert not prefetcher.alive
    assert prefetcher.get() is None


@pytest.mark.parametrize("threads", [2, 3])
def test_prefetcher_threads_hand_over_in_step_order_and_begin_in_step_order(threads):
    begun = []

    def begin(step):
        begun.append(step)
        if step == 11:
            return None

        def job():
            time.sleep(0.002 * (step % 3))  # later steps finish first, now and then
            return step * 10

        return job

    prefetcher = Prefetcher(begin, start=1, depth=2, threads=threads)
    got = [prefetcher.get() for _ in range(11)]
    assert got == [(s, s * 10) for s in range(1, 11)] + [None]
    assert begun == list(range(1, 12))  # once each, in order, never past the end
    prefetcher.close()
    assert not prefetcher.alive


def test_issue14_a_slow_step_does_not_hold_up_the_other_threads():
    """Thread i took steps i, i + N, ...: while step 0's job ran, the other thread made
    step 1, then waited for step 0's thread to begin step 2 before it could begin step 3.
    A free thread now takes the next step, up to depth + threads steps begun."""
    release, made = threading.Event(), []

    def begin(step):
        def job():
            if step == 0:
                assert release.wait(30)
            made.append(step)
            return step

        return job

    prefetcher = Prefetcher(begin, start=0, depth=2, threads=2)
    try:
        deadline = time.monotonic() + 30
        while len(made) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(made) == [1, 2, 3]  # step 0 still running: 4 begun, no more
    finally:
        release.set()
    assert [prefetcher.get() for _ in range(6)] == [(s, s) for s in range(6)]
    prefetcher.close()
    assert not prefetcher.alive


def test_issue14_host_threads_compute_the_next_block_of_picks_in_a_job(dataset, monkeypatch):
    """Picks are computed a block of steps at a time. The thread that began the first step
    past a block computed the next one inside `begin`, under the lock that keeps steps
    beginning in order, so the other host threads waited on it. A step's job now computes
    the block after its own (`StepPicker.prepare`), outside that lock; the batches stay
    those of one thread."""
    callers = []
    records = SinglePicker._records

    def recorded(self, first, num_steps, rows):
        frame, names = sys._getframe(1), set()
        while frame is not None:
            names.add(frame.f_code.co_name)
            frame = frame.f_back
        callers.append((first, "begin" in names, "_read" in names))
        return records(self, first, num_steps, rows)

    monkeypatch.setattr(SinglePicker, "_records", recorded)
    # a local dataset: no cache of an earlier test with shards to fetch makes `begin` pick ahead
    monkeypatch.setattr("roxxel.loader.loader.num_missing", lambda: 0)
    config = _config(num_epochs=None, host_transform=lambda batch, rng: batch, host_threads=2)
    threaded = _batches(Loader(dataset, 4, seed=3, config=config), num_steps=300)
    later = [c for c in callers if c[0] >= 8]  # past the first blocks (1, 2, 4 steps)
    assert later and all(in_job and not in_begin for _, in_begin, in_job in later), callers
    monkeypatch.setattr(SinglePicker, "_records", records)
    plain = _batches(Loader(dataset, 4, seed=3, config=_config(num_epochs=None)), num_steps=300)
    _assert_same(threaded, plain)


@pytest.mark.parametrize("where", ["begin", "job"])
def test_prefetcher_threads_raise_at_the_failing_step_and_join(where):
    def begin(step):
        if where == "begin" and step == 4:
            raise KeyError("missing")

        def job():
            if where == "job" and step == 4:
                raise KeyError("missing")
            return step

        return job

    prefetcher = Prefetcher(begin, start=0, depth=1, threads=3)
    assert [prefetcher.get() for _ in range(4)] == [(s, s) for s in range(4)]
    with pytest.raises(KeyError, match="missing"):
        prefetcher.get()
    assert not prefetcher.alive
    assert prefetcher.get() is None


def test_a_single_device_sharding_places_the_whole_batch_on_it(dataset):
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[3])
    expected = _batches(Loader(dataset, 8, config=_config()), num_steps=2)
    with Loader(dataset, 8, sharding=sharding, config=_config()) as loader:
        got = [next(loader) for _ in range(2)]
    assert got[0]["image"].devices() == {jax.devices()[3]}
    _assert_same([{k: np.asarray(v) for k, v in b.items()} for b in got], expected)


def test_iterating_again_after_break_continues_at_the_next_step(dataset):
    config = _config(num_epochs=None)
    reference = _batches(Loader(dataset, 4, config=config), num_steps=6)
    loader = Loader(dataset, 4, config=config)
    got = []
    for _ in range(2):
        for batch in loader:
            got.append({k: np.array(v) for k, v in batch.items()})
            if len(got) % 3 == 0:
                break
    loader.close()
    _assert_same(got, reference)
    assert loader.step == 6 and not _live_loader_threads()


@pytest.mark.parametrize("k", [1, 2])
def test_restore_exactly_at_an_epoch_boundary(dataset, k):
    config = _config(num_epochs=3)
    reference = _batches(Loader(dataset, NUM_RECORDS, seed=2, config=config))
    resumed = Loader(dataset, NUM_RECORDS, seed=2, config=config)
    resumed.restore({**resumed.state(), "step": k})
    _assert_same(_batches(resumed), reference[k:])


class _AdviceSpy:
    """A records source that counts the read-ahead calls it gets."""

    def __init__(self, inner):
        self.inner, self.advised = inner, []

    layout = property(lambda self: self.inner.layout)

    def __len__(self):
        return len(self.inner)

    def read(self, indices, out):
        self.inner.read(indices, out)

    def advise(self, indices):
        self.advised.append(np.array(indices))
        self.inner.advise(indices)

    def fingerprint(self):
        return self.inner.fingerprint()


@pytest.mark.parametrize("cold", [True, False])
def test_read_ahead_runs_only_while_reads_miss_the_page_cache(dataset, monkeypatch, cold):
    ticks = iter(range(10**6))
    faults = (lambda: next(ticks)) if cold else (lambda: 0)
    monkeypatch.setattr(roxxel.loader.loader, "_major_faults", faults)
    # caches of datasets at a URL that earlier tests of this process left: not this loader's
    monkeypatch.setattr(roxxel.loader.loader, "num_missing", lambda: 0)
    spy = _AdviceSpy(roxxel.Records(dataset, fields=["label", "image"]))
    loader = Loader(spy, 4, config=LoaderConfig(num_epochs=None, readahead=2))
    for step in range(20):  # the assembler alone: no thread, so the count is exact
        loader._assembler(step)
    if cold:  # every step advised once, two steps ahead of its read
        assert len(spy.advised) == 22
        expected = roxxel.sampling.order.records_for_draws(
            NUM_RECORDS, np.arange(21 * 4, 22 * 4), seed=0, source=0, shuffle=True
        )
        np.testing.assert_array_equal(spy.advised[-1], expected)
    else:  # a warm cache: only the first steps, assumed cold until proven warm
        assert len(spy.advised) <= 5


class _Items:
    """An in-memory source: item i is the row [i, i * i]."""

    def __init__(self, num_items):
        self.num_items = num_items

    layout = property(lambda self: {"x": ((2,), np.dtype(np.int64))})

    def __len__(self):
        return self.num_items

    def read(self, indices, out):
        out["x"][:] = np.stack([indices, indices * indices], axis=1)

    def advise(self, indices):
        pass

    def fingerprint(self):
        return f"items-{self.num_items}"


@settings(max_examples=30, deadline=None)
@given(
    num_items=st.integers(1, 30),
    batch_size=st.integers(1, 12),
    num_epochs=st.integers(1, 3),
    pad=st.booleans(),
    seed=st.integers(0, 2**64 - 1),
    data=st.data(),
)
def test_any_start_step_matches_the_run_and_epochs_are_permutations(
    num_items, batch_size, num_epochs, pad, seed, data
):
    config = LoaderConfig(num_epochs=num_epochs, final_batch="pad" if pad else "drop")
    source = _Items(num_items)
    if not pad and num_epochs * num_items < batch_size:  # no step at all: refused up front
        with pytest.raises(ConfigError, match="no step"):
            Loader(source, batch_size, seed=seed, config=config)
        return
    reference = _batches(Loader(source, batch_size, seed=seed, config=config))
    assert len(reference) == Loader(source, batch_size, seed=seed, config=config).num_steps
    k = data.draw(st.integers(0, len(reference)))
    _assert_same(
        _batches(Loader(source, batch_size, seed=seed, start_step=k, config=config)), reference[k:]
    )
    items = np.concatenate(
        [b["x"][b["valid"], 0] if pad else b["x"][:, 0] for b in reference]
        or [np.zeros(0, np.int64)]
    )
    assert len(items) == (num_epochs * num_items if pad else len(reference) * batch_size)
    for epoch in range(len(items) // num_items):
        assert sorted(items[epoch * num_items : (epoch + 1) * num_items].tolist()) == list(
            range(num_items)
        )
