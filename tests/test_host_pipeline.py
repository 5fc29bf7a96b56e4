"""The loader's host pipeline at the hardware's speed: threaded host transforms (issue 14),
the pinned buffer ring and where each batch's time goes (issue 16).

Runs on 8 CPU devices (tests/conftest.py). CPU has no pinned memory kind, so the ring runs
with a fake registrar here, and the fallback (no registrar on CPU) is checked as such.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any, cast

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import roxxel
from roxxel.errors import ConfigError
from roxxel.loader import loader as loader_module
from roxxel.loader.host import BufferPool, LoaderStats, RowSpec
from roxxel.loader.loader import Loader, LoaderConfig, host_rng
from roxxel.loader.pinned import CudaRegistrar, Registrar, registrar_for

NUM_RECORDS = 53


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("host_pipeline")
    schema = roxxel.Schema.parse({"label": "int64", "image": "float32[6]"})
    with roxxel.DatasetWriter(path, schema, shard_bytes=900) as writer:
        for i in range(NUM_RECORDS):
            writer.write({"label": i, "image": np.arange(6, dtype=np.float32) * i})
    return roxxel.open_dataset(path)


def _run(dataset, num_steps, batch_size=16, **options):
    config = LoaderConfig(num_epochs=None, **options)
    with Loader(dataset, batch_size, seed=7, config=config) as loader:
        out = []
        for batch in loader:
            out.append({k: np.array(v) for k, v in batch.items()})
            if len(out) == num_steps:
                return out
    return out


def _host_threads():
    """The loader's threads still alive (other tests' fetch threads do not count)."""
    names = ("roxxel-host", "roxxel-loader", "roxxel-placer")
    return [t for t in threading.enumerate() if t.name.startswith(names)]


def _noisy_copy(batch, rng):
    """A row-wise transform that returns new arrays: noise per row from its slice's rng."""
    noise = rng.normal(size=batch["image"].shape).astype(np.float32)
    return {"image": batch["image"] + noise, "label": batch["label"] * 2}


def _noisy_in_place(batch, rng):
    batch["image"] += rng.normal(size=batch["image"].shape).astype(np.float32)
    return batch


# --- issue 14: parallel host transforms ----------------------------------------------------


@pytest.mark.parametrize("transform", [_noisy_copy, _noisy_in_place])
def test_issue14_host_threads_gives_the_batches_of_one_thread(dataset, transform):
    one = _run(dataset, 5, host_transform=transform)
    for threads in (1, 2, 3, 8):
        _assert_same(_run(dataset, 5, host_transform=transform, host_threads=threads), one)
    assert not _host_threads()


def test_issue14_host_threads_without_a_transform_reads_in_threads(dataset):
    plain = _run(dataset, 7)
    _assert_same(_run(dataset, 7, host_threads=3), plain)
    padded = LoaderConfig(final_batch="pad", provenance=True, host_threads=2)
    expected = LoaderConfig(final_batch="pad", provenance=True)
    got = [dict(b) for b in Loader(dataset, 16, seed=2, config=padded)]
    _assert_same(got, [dict(b) for b in Loader(dataset, 16, seed=2, config=expected)])
    assert not got[-1]["valid"].all()  # the padded last batch came from a host thread too


def test_issue14_a_mixture_is_assembled_as_by_one_thread(dataset):
    sources = {"a": roxxel.Records(dataset), "b": roxxel.Records(dataset)}
    mixture = roxxel.Mixture(sources, [roxxel.Phase({"a": 1, "b": 3})], batch_size=16, seed=4)
    one = LoaderConfig(provenance=True, host_transform=_noisy_copy)
    two = LoaderConfig(provenance=True, host_transform=_noisy_copy, host_threads=2)
    with Loader(mixture, config=one) as a, Loader(mixture, config=two) as b:
        _assert_same(
            [{k: np.array(v) for k, v in next(a).items()} for _ in range(4)],
            [{k: np.array(v) for k, v in next(b).items()} for _ in range(4)],
        )


def test_issue14_each_batch_draws_from_its_steps_stream(dataset):
    got = _run(dataset, 3, host_transform=_noisy_copy, host_threads=2)
    plain = _run(dataset, 3)
    for step in range(3):
        noise = host_rng(7, step).normal(size=(16, 6)).astype(np.float32)
        np.testing.assert_array_equal(got[step]["image"], plain[step]["image"] + noise)
        np.testing.assert_array_equal(got[step]["label"], plain[step]["label"] * 2)


@pytest.mark.parametrize("seed, step", [(3, 4), (0, 0), (2**63 + 5, 10**12), (1, 2**62)])
def test_issue14_host_rng_is_the_step_stream_of_before(seed, step):
    """host_rng(seed, step) is Philox keyed (seed, step) from its first draw, whatever the
    draws (64-bit, buffered 32-bit, floats), and two of them share nothing."""
    key = np.array([seed, step], dtype=np.uint64)
    legacy = np.random.Generator(np.random.Philox(key=key))
    rng = host_rng(seed, step)
    assert rng.integers(1 << 62) == legacy.integers(1 << 62)
    np.testing.assert_array_equal(
        rng.integers(9, size=5, dtype=np.uint32), legacy.integers(9, size=5, dtype=np.uint32)
    )
    np.testing.assert_array_equal(rng.normal(size=7), legacy.normal(size=7))
    other = host_rng(seed, step)
    rng.random(100)  # draws from one generator leave the next one's stream as it was
    assert other.integers(1 << 62) == host_rng(seed, step).integers(1 << 62)


def test_issue14_sharded_batches_equal_numpy_batches_with_host_threads(dataset):
    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharded = _run(dataset, 2, host_transform=_noisy_copy, host_threads=2)
    config = LoaderConfig(num_epochs=None, host_transform=_noisy_copy, host_threads=3)
    with Loader(dataset, 16, seed=7, sharding=(mesh, P("data")), config=config) as loader:
        placed = [{k: np.asarray(v) for k, v in next(loader).items()} for _ in range(2)]
    _assert_same(placed, sharded)


def test_issue14_close_break_and_exhaustion_join_every_host_thread(dataset):
    config = LoaderConfig(num_epochs=None, host_transform=_noisy_copy, host_threads=3)
    loader = Loader(dataset, 8, config=config)
    next(loader)
    assert any(t.name.startswith("roxxel-host") for t in threading.enumerate())
    loader.close()
    assert not _host_threads()
    for _ in Loader(dataset, 8, config=config):
        break
    gc.collect()
    assert not _host_threads()
    finite = LoaderConfig(host_transform=_noisy_copy, host_threads=2)
    assert len(list(Loader(dataset, 8, config=finite))) == NUM_RECORDS // 8
    assert not _host_threads()


def test_issue14_restore_restarts_the_host_threads_and_keeps_the_batches(dataset):
    config = LoaderConfig(num_epochs=None, host_transform=_noisy_copy, host_threads=2)
    reference = _run(dataset, 4, host_transform=_noisy_copy, host_threads=2)
    with Loader(dataset, 16, seed=7, config=config) as loader:
        next(loader)
        state = loader.state()
        next(loader)
        loader.restore(state)
        got = [{k: np.array(v) for k, v in next(loader).items()} for _ in range(3)]
    _assert_same(got, reference[1:])


def _fails_at_step_2(batch, rng):
    if batch["label"][0] == _fails_at_step_2.first_label:
        raise RuntimeError("transform failed")
    return batch


def test_issue14_a_transform_error_reaches_the_consumer_in_step_order(dataset):
    plain = _run(dataset, 3)
    _fails_at_step_2.first_label = plain[2]["label"][0]
    config = LoaderConfig(host_transform=_fails_at_step_2, host_threads=4)
    loader = Loader(dataset, 16, seed=7, config=config)
    _assert_same([dict(next(loader)), dict(next(loader))], plain[:2])  # steps before it
    with pytest.raises(RuntimeError, match="transform failed"):
        next(loader)
    del loader
    gc.collect()
    assert not _host_threads()


def _forgets_to_return(batch, rng):
    batch["image"] += 1  # no return: the common slip


@pytest.mark.parametrize("threads", [None, 2])
@pytest.mark.parametrize("sharded", [False, True])
def test_issue14_a_host_transform_returning_none_is_an_error_not_the_end(dataset, threads, sharded):
    """A transform without `return batch` used to end the stream silently (None was taken for
    the end), or fail with an AttributeError when placed: a ConfigError naming the step."""
    config = LoaderConfig(num_epochs=None, host_transform=_forgets_to_return, host_threads=threads)
    sharding = (Mesh(np.array(jax.devices()), ("data",)), P("data")) if sharded else None
    expected = r"host_transform returned NoneType at step 0.*return batch"
    loader = Loader(dataset, 16, seed=7, sharding=sharding, config=config)
    with loader, pytest.raises(ConfigError, match=expected):
        next(loader)
    assert not _host_threads()


def _sets_field(value):
    def sets(batch, rng):
        batch = dict(batch)
        batch["n"] = value
        return batch

    return sets


def _two_devices():
    return (Mesh(np.array(jax.devices()[:2]), ("data",)), P("data"))


@pytest.mark.parametrize("threads", [None, 1, 2])
@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize(
    "value, found",
    [
        (3, "as int"),
        (np.float32(1), "as float32"),
        ([0] * 16, "as list"),
        (np.asarray(3), r"of shape \(\)"),
        (np.zeros(3), r"of shape \(3,\)"),
    ],
)
def test_a_host_transform_field_that_is_not_an_array_of_rows_names_step_and_field(
    dataset, threads, sharded, value, found
):
    """A python or numpy scalar, a list or an array without one row per batch row used to
    fail placement with a bare AttributeError / TypeError / a shape error naming neither the
    step nor the field, and passed silently into numpy batches: a ConfigError in both modes."""
    config = LoaderConfig(num_epochs=None, host_transform=_sets_field(value), host_threads=threads)
    loader = Loader(
        dataset, 16, seed=7, sharding=_two_devices() if sharded else None, config=config
    )
    expected = rf"host_transform returned field 'n' {found} at step 0 \(.*expected .*\(16, \.\.\.\)"
    with loader, pytest.raises(ConfigError, match=expected):
        next(loader)
    assert not _host_threads()


@pytest.mark.parametrize("threads", [None, 1, 2])
@pytest.mark.parametrize("value", [np.array(["a"] * 16), np.array([None] * 16, dtype=object)])
def test_a_host_transform_field_jax_cannot_hold_is_an_error_when_placed(dataset, threads, value):
    """Strings or objects used to fail with JAX's own TypeError, without step or field."""
    config = LoaderConfig(num_epochs=None, host_transform=_sets_field(value), host_threads=threads)
    expected = (
        rf"host_transform returned field 'n' of dtype {value.dtype} at step 0 \(.*numeric or bool"
    )
    loader = Loader(dataset, 16, seed=7, sharding=_two_devices(), config=config)
    with loader, pytest.raises(ConfigError, match=expected):
        next(loader)
    with Loader(dataset, 16, seed=7, config=config) as numpy_loader:  # numpy holds them
        assert next(numpy_loader)["n"].dtype == value.dtype


@pytest.mark.parametrize(
    "dtype", [bool, np.float16, np.complex64, np.uint8, "bfloat16", "float8_e4m3fn"]
)
def test_a_host_transform_may_return_any_numeric_or_bool_array_of_rows(dataset, dtype):
    dtype = jax.numpy.dtype(dtype)
    config = LoaderConfig(num_epochs=None, host_transform=_sets_field(np.ones((16, 2), dtype)))
    with Loader(dataset, 16, seed=7, sharding=_two_devices(), config=config) as loader:
        placed = next(loader)["n"]
    assert placed.shape == (16, 2) and placed.dtype == dtype


def test_a_bad_host_transform_field_at_a_later_step_names_that_step(dataset):
    later = _run(dataset, 3)[2]["label"][0]

    def bad_at_step_2(batch, rng):
        return {**batch, "n": 3} if batch["label"][0] == later else batch

    config = LoaderConfig(num_epochs=None, host_transform=bad_at_step_2, host_threads=2)
    with Loader(dataset, 16, seed=7, sharding=_two_devices(), config=config) as loader:
        next(loader)
        next(loader)
        with pytest.raises(ConfigError, match="field 'n' as int at step 2"):
            next(loader)


def _takes_extra(batch, rng, extra):
    return batch


def _takes_keywords_only(batch, **options):
    return batch


@pytest.mark.parametrize("threads", [None, 2])
@pytest.mark.parametrize("fn", [lambda b: b, _takes_extra, _takes_keywords_only])
def test_a_host_transform_that_cannot_take_batch_and_rng_is_named(dataset, fn, threads):
    """`lambda b: b` (the habit of HF map / Grain) failed at the first next() with a bare
    TypeError naming neither the transform nor the rule."""
    config = LoaderConfig(host_transform=fn, host_threads=threads)
    named = r"host_transform .* fn\(batch, rng\) at step 0"
    with (
        Loader(dataset, 16, seed=0, config=config) as loader,
        pytest.raises(ConfigError, match=named),
    ):
        next(iter(loader))


def test_a_type_error_inside_a_host_transform_stays_as_it_is(dataset):
    def wrong_inside(batch, rng):
        return batch["image"] + "x"  # the user's own bug: their traceback, untouched

    config = LoaderConfig(host_transform=wrong_inside)
    with Loader(dataset, 16, seed=0, config=config) as loader, pytest.raises(TypeError) as caught:
        next(iter(loader))
    assert not isinstance(caught.value, ConfigError)


@pytest.mark.parametrize("option", ["host_transform", "device_transform"])
def test_a_transform_that_is_not_callable_is_refused_when_configured(option):
    with pytest.raises(ConfigError, match=rf"loader: {option} \('jitter', expected"):
        LoaderConfig(**{option: cast(Any, "jitter")})


class _Transform:
    def __call__(self, batch, rng):
        return batch

    def method(self, batch, rng):
        return batch


@pytest.mark.parametrize(
    "fn",
    [
        lambda batch, rng=None, scale=1: batch,
        lambda *args: args[0],
        lambda batch, rng, *, scale=1: batch,
        _Transform(),
        _Transform().method,
        jax.jit(lambda batch, key: batch),
        max,  # a builtin without a readable signature: accepted, the call will tell
    ],
)
def test_a_transform_that_takes_two_positional_arguments_is_accepted(fn):
    LoaderConfig(host_transform=fn)
    LoaderConfig(device_transform=fn)


def test_issue14_a_loader_dropped_on_a_host_thread_neither_raises_nor_hangs(dataset):
    box = {}

    def drops_the_loader(rows, rng):
        if threading.current_thread().name.startswith("roxxel-host") and "loader" in box:
            box.pop("loader").close()  # as garbage collection of the loader there would
        return rows

    config = LoaderConfig(num_epochs=None, host_transform=drops_the_loader, host_threads=2)
    box["loader"] = loader = Loader(dataset, 16, seed=7, config=config)
    it = iter(loader)
    next(it, None)  # a batch, or the end: the loader was closed while making it
    del loader, it
    deadline = time.monotonic() + 30
    while _host_threads() and time.monotonic() < deadline:
        time.sleep(0.01)  # told to stop: each exits once idle
    assert not _host_threads()


def test_issue14_host_threads_assemble_different_batches_at_once(dataset):
    # each call waits for a second one: only two steps transformed at once get past it
    met = threading.Barrier(2, timeout=10)

    def meets(rows, rng):
        met.wait()
        return rows

    config = LoaderConfig(num_epochs=None, host_transform=meets, host_threads=2)
    with Loader(dataset, 1, seed=7, config=config) as loader:
        labels = [int(next(loader)["label"][0]) for _ in range(4)]
    assert labels == [int(b["label"][0]) for b in _run(dataset, 4, batch_size=1)]


@pytest.mark.parametrize("threads", [0, -1, True, 1.5, 257])
def test_issue14_host_threads_out_of_range_is_a_config_error(threads):
    with pytest.raises(ConfigError, match="host_threads"):
        LoaderConfig(host_threads=threads)


@pytest.mark.parametrize("value", [None, 1, "yes"])
def test_issue16_pin_host_must_be_a_bool(value):
    with pytest.raises(ConfigError, match="pin_host"):
        LoaderConfig(pin_host=value)


# --- issue 16: the pinned ring -------------------------------------------------------------


class FakeRegistrar:
    """Records what a CUDA registrar would pin; refuses after `limit` registrations."""

    def __init__(self, limit: int = 1 << 30) -> None:
        self.pinned: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []
        self.limit = limit

    def register(self, array: np.ndarray) -> bool:
        address = array.ctypes.data
        self.calls.append(("register", address))
        if len(self.pinned) >= self.limit:
            return False
        assert address % 4096 == 0 and array.flags.c_contiguous  # what cudaHostRegister wants
        self.pinned[address] = array.nbytes
        return True

    def unregister(self, array: np.ndarray) -> None:
        self.calls.append(("unregister", array.ctypes.data))
        del self.pinned[array.ctypes.data]


LAYOUT = RowSpec.of({"x": ((3,), np.int32), "y": ((), np.float64)})


def test_issue16_ring_pins_each_buffer_once_and_reuses_it():
    fake = FakeRegistrar()
    pool = BufferPool(LAYOUT, 4, keep=2, registrar=fake)
    assert isinstance(fake, Registrar)
    for _ in range(5):
        batch = pool.acquire()
        batch["x"][:] = 1
        del batch
        gc.collect()
    assert pool.num_allocated == 1 and pool.num_pinned == 1
    assert [c for c, _ in fake.calls] == ["register"]


def test_issue16_ring_keeps_release_before_reuse_and_unpins_what_it_drops():
    fake = FakeRegistrar()
    pool = BufferPool(LAYOUT, 4, keep=1, registrar=fake)
    held = [pool.acquire() for _ in range(3)]  # a consumer keeping batches
    for value, batch in enumerate(held):
        batch["x"][:] = value
    again = pool.acquire()
    again["x"][:] = 99
    for value, batch in enumerate(held):
        np.testing.assert_array_equal(batch["x"], value)  # never rewritten while held
    assert pool.num_allocated == 4 and len(fake.pinned) == 4
    del held, again, batch
    gc.collect()
    assert len(fake.pinned) == 1  # keep=1: the other three were unpinned before freeing
    pool.close()
    assert not fake.pinned and pool.num_pinned == 0


def test_issue16_a_pool_dropped_without_close_unpins_its_buffers():
    fake = FakeRegistrar()
    pool = BufferPool(LAYOUT, 4, keep=2, registrar=fake)
    held = pool.acquire()
    free = pool.acquire()
    del free, pool
    gc.collect()
    assert len(fake.pinned) == 2  # a batch in use keeps its pool, and the pool its buffers
    del held
    gc.collect()
    assert not fake.pinned


def test_issue16_a_buffer_the_registrar_refuses_stays_pageable():
    fake = FakeRegistrar(limit=0)
    pool = BufferPool(LAYOUT, 4, keep=1, registrar=fake)
    batch = pool.acquire()
    batch["x"][:] = 5
    assert pool.num_pinned == 0 and not fake.pinned
    del batch
    gc.collect()
    pool.close()
    assert [c for c, _ in fake.calls] == ["register"]


def test_issue16_cpu_devices_get_no_registrar_and_the_loader_keeps_todays_path(dataset):
    assert registrar_for(jax.devices()) is None
    mesh = Mesh(np.array(jax.devices()), ("data",))
    config = LoaderConfig(num_epochs=None)
    with Loader(dataset, 16, seed=7, sharding=(mesh, P("data")), config=config) as loader:
        got = [{k: np.asarray(v) for k, v in next(loader).items()} for _ in range(3)]
        assert all(pool.num_pinned == 0 for pool in loader._assembler._pools.values())
    _assert_same(got, _run(dataset, 3))


def test_issue16_loader_gathers_into_the_pinned_ring(dataset, monkeypatch):
    fake = FakeRegistrar()
    seen = []

    def fake_for(devices):
        seen.append({d.platform for d in devices})
        return fake

    monkeypatch.setattr(loader_module, "registrar_for", fake_for)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    config = LoaderConfig(num_epochs=None, pin_host=True)
    loader = Loader(dataset, 16, seed=7, sharding=(mesh, P("data")), config=config)
    with loader:
        got = [{k: np.asarray(v) for k, v in next(loader).items()} for _ in range(6)]
        assert fake.pinned and seen == [{"cpu"}]
    _assert_same(got, _run(dataset, 6))
    del loader, got
    gc.collect()
    assert not fake.pinned  # closed: every buffer unpinned once released
    unpinned = LoaderConfig(num_epochs=None, pin_host=False)
    Loader(dataset, 16, sharding=(mesh, P("data")), config=unpinned).close()
    assert len(seen) == 1


class _FakeFunction:
    def __init__(self, result: int) -> None:
        self.result, self.args = result, []

    def __call__(self, *args):
        self.args.append(args)
        return self.result


def test_issue16_cuda_registrar_calls_host_register_portable_and_reads_its_status():
    class FakeCudart:
        cudaHostRegister = _FakeFunction(0)
        cudaHostUnregister = _FakeFunction(0)

    registrar = CudaRegistrar(FakeCudart())
    array = np.zeros(4096, np.uint8)
    assert registrar.register(array)
    assert FakeCudart.cudaHostRegister.args == [(array.ctypes.data, 4096, 1)]
    registrar.unregister(array)
    assert FakeCudart.cudaHostUnregister.args == [(array.ctypes.data,)]
    FakeCudart.cudaHostRegister.result = 2  # cudaErrorMemoryAllocation
    assert not registrar.register(array)
    assert not registrar.register(np.zeros(0, np.uint8))


# --- issue 16: where the time goes ---------------------------------------------------------


def test_issue16_stats_count_every_batch_and_each_part_of_its_time(dataset):
    mesh = Mesh(np.array(jax.devices()), ("data",))
    config = LoaderConfig(num_epochs=None, host_transform=_noisy_copy, host_threads=2)
    with Loader(dataset, 16, sharding=(mesh, P("data")), config=config) as loader:
        assert loader.stats().num_batches == 0
        for _ in range(4):
            next(loader)
        stats = loader.stats()
    assert isinstance(stats, LoaderStats)
    assert stats.num_batches >= 4
    assert stats.gather_s > 0 and stats.transform_s > 0 and stats.place_s > 0
    assert stats.wait_consumer_s >= 0 and stats.wait_producer_s >= 0
    assert stats.bottleneck in ("loader", "consumer")


def test_issue16_stats_name_the_side_that_waited_less_as_the_bottleneck():
    slow_model = LoaderStats(10, 1e-3, 0.0, 1e-4, 5e-3, 1e-6)
    slow_loader = LoaderStats(10, 1e-3, 0.0, 1e-4, 1e-6, 5e-3)
    assert slow_model.bottleneck == "consumer"
    assert slow_loader.bottleneck == "loader"


def _assert_same(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


# --- issue 16 (measured on an H100): reads in threads, placement overlapping the gather ------


def _sharded_run(dataset, num_steps, **options):
    mesh = Mesh(np.array(jax.devices()), ("data",))
    config = LoaderConfig(num_epochs=None, **options)
    with Loader(dataset, 16, seed=7, sharding=(mesh, P("data")), config=config) as loader:
        return [{k: np.asarray(v) for k, v in next(loader).items()} for _ in range(num_steps)]


def test_issue16_placing_apart_gives_the_batches_of_one_thread(dataset, monkeypatch):
    reference = _sharded_run(dataset, 6)
    monkeypatch.setattr(loader_module, "places_apart", lambda sharding: True)
    placed = _sharded_run(dataset, 6)
    _assert_same(placed, reference)
    assert not _host_threads()  # the loader and the placer threads are joined


def test_issue16_cpu_places_in_the_pipeline_thread(dataset):
    mesh = Mesh(np.array(jax.devices()), ("data",))
    assert not loader_module.places_apart(loader_module.device.batch_sharding(mesh, P("data")))
    with Loader(dataset, 16, sharding=(mesh, P("data"))) as loader:
        next(loader)
        assert not [t for t in threading.enumerate() if t.name == "roxxel-placer"]


def _raises_on_device(batch, key):
    raise RuntimeError("placement failed")


def test_issue16_a_placement_error_reaches_the_consumer_and_no_thread_is_left(dataset, monkeypatch):
    monkeypatch.setattr(loader_module, "places_apart", lambda sharding: True)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    config = LoaderConfig(device_transform=_raises_on_device)
    loader = Loader(dataset, 16, sharding=(mesh, P("data")), config=config)
    with pytest.raises(RuntimeError, match="placement failed"):
        next(loader)
    loader.close()
    gc.collect()
    assert not _host_threads()


def test_issue16_break_and_exhaustion_join_the_placer(dataset, monkeypatch):
    monkeypatch.setattr(loader_module, "places_apart", lambda sharding: True)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    for _ in Loader(dataset, 8, sharding=(mesh, P("data")), config=LoaderConfig(num_epochs=None)):
        break
    gc.collect()
    assert not _host_threads()
    finite = Loader(dataset, 8, sharding=(mesh, P("data")))
    assert len(list(finite)) == NUM_RECORDS // 8
    assert not _host_threads()


def test_an_iterator_left_open_at_exit_prints_nothing(tmp_path):
    """A script that leaves a Loader's iterator half-way and exits: its generator is
    finalized while the interpreter tears modules down; that must be silent (no
    "Exception ignored ... TypeError" on stderr)."""
    import subprocess
    import sys

    script = tmp_path / "left_open.py"
    script.write_text(
        "import numpy as np, roxxel\n"
        f"with roxxel.DatasetWriter({str(tmp_path / 'ds')!r}, {{'t': 'int32[]'}}) as w:\n"
        "    for _ in range(4): w.write({'t': np.arange(5000, dtype=np.int32)})\n"
        f"ds = roxxel.open_dataset({str(tmp_path / 'ds')!r})\n"
        "src = roxxel.TokenWindows(ds, 't', 16)\n"
        "ld = roxxel.Loader(src, 4, seed=0, config=roxxel.LoaderConfig(num_epochs=None))\n"
        "it = iter(ld)\n"
        "for _ in range(3): next(it)\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    assert done.stderr == ""


def test_issue14_host_threads_read_zstd_fields_as_one_thread_does(tmp_path):
    """Every thread decoded zstd records with one shared `ZstdDecompressor`, which zstandard
    does not allow from two threads at once: with host_threads >= 2 a compressed field
    failed with R15 ("Data corruption detected") at a random record."""
    rng = np.random.default_rng(0)
    path = tmp_path / "z"
    with roxxel.DatasetWriter(path, {"tokens": "int32[]"}, compress={"tokens": "zstd:1"}) as w:
        for _ in range(300):
            w.write({"tokens": rng.integers(0, 1000, rng.integers(1, 3000)).astype(np.int32)})
    dataset = roxxel.open_dataset(path)

    def tokens(threads: int | None) -> list[np.ndarray]:
        config = LoaderConfig(host_threads=threads, num_epochs=3, max_len={"tokens": 3000})
        with Loader(dataset, 8, seed=0, config=config) as loader:
            return [np.array(batch["tokens"]) for batch in loader]

    expected = tokens(None)
    for threads in (2, 4):
        got = tokens(threads)
        assert len(got) == len(expected)
        for a, b in zip(got, expected, strict=True):
            np.testing.assert_array_equal(a, b)
