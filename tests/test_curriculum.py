"""Curriculum window lengths end to end: a Mixture whose phases change ``seq_len``, read by
the Loader over real TokenWindows, with and without a sharding (8 CPU devices)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import roxxel
from roxxel.errors import ConfigError
from roxxel.loader.loader import Loader, LoaderConfig
from roxxel.sampling.mixture import Cap, Mixture, Phase
from roxxel.sources.windows import TokenWindows

if jax.device_count() < 8:
    pytest.skip(f"needs 8 CPU devices ({jax.device_count()})", allow_module_level=True)

# phase 0: steps [0, 3) at each source's own 8; [3, 6) at 16 with batch 16; [6, 10) at 4
PHASES = [
    Phase({"web": 3, "code": 1}, end_step=3),
    Phase({"web": 1, "code": 1}, end_step=6, batch_size=16, seq_len=16),
    Phase({"web": 1, "code": 2}, end_step=10, seq_len=4),
]
WIDTHS = [8, 8, 8, 16, 16, 16, 4, 4, 4, 4]
BATCHES = [8, 8, 8, 16, 16, 16, 8, 8, 8, 8]


def _dataset(path, seed: int, num_docs: int):
    rng = np.random.default_rng(seed)
    schema = roxxel.Schema.parse({"tokens": "int32[]"})
    with roxxel.DatasetWriter(path, schema, shard_bytes=2000) as writer:
        for _ in range(num_docs):
            writer.write({"tokens": rng.integers(0, 30_000, rng.integers(1, 60)).astype(np.int32)})
    return roxxel.open_dataset(path)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("curriculum")
    return _dataset(root / "web", 1, 200), _dataset(root / "code", 2, 80)


def _mixture(datasets, phases=PHASES, **options) -> Mixture:
    web, code = (
        TokenWindows(ds, "tokens", 8, targets=False, split_targets=False, **options)
        for ds in datasets
    )
    return Mixture(
        {"web": web, "code": code}, phases, batch_size=8, seed=5, caps={"code": Cap(epochs=1)}
    )


def _batches(loader, num_steps=None):
    with loader:
        out = []
        for batch in loader:
            out.append({k: np.array(v) for k, v in batch.items()})
            if num_steps is not None and len(out) == num_steps:
                break
        return out


def _config(**kwargs):
    return LoaderConfig(provenance=True, **kwargs)


def test_each_phase_yields_its_own_window_length_and_the_windows_of_its_records(datasets):
    m = _mixture(datasets)
    batches = _batches(Loader(m, config=_config()))
    assert [b["tokens"].shape for b in batches] == list(zip(BATCHES, WIDTHS, strict=True))
    for step, batch in enumerate(batches):
        spaces = m.spaces(m.phase_at(step))
        for row in range(len(batch["tokens"])):
            source = spaces[int(batch["source"][row])].source
            assert source.seq_len == WIDTHS[step]
            want = {"tokens": np.zeros((1, WIDTHS[step]), np.int32)}
            source.read(batch["record"][row : row + 1], want)
            np.testing.assert_array_equal(batch["tokens"][row], want["tokens"][0])


def test_no_window_repeats_within_an_epoch_at_one_length(datasets):
    phases = [Phase({"web": 1, "code": 1}, end_step=40), Phase({"web": 1}, end_step=80, seq_len=16)]
    m = _mixture(datasets, phases)
    batches = _batches(Loader(m, config=_config()))
    seen: dict[str, list[int]] = {}
    for step, batch in enumerate(batches):
        spaces = m.spaces(m.phase_at(step))
        for s, r in zip(batch["source"].tolist(), batch["record"].tolist(), strict=True):
            seen.setdefault(spaces[s].key, []).append(r)
    sizes = {s.key: s.size for p in range(2) for s in m.spaces(p)}
    assert set(seen) == {"web", "code", "web|seq_len=16"}
    for key, records in seen.items():
        for e in range(0, len(records), sizes[key]):
            epoch = records[e : e + sizes[key]]
            assert len(set(epoch)) == len(epoch), key
    assert len(seen["code"]) <= sizes["code"]  # capped at one epoch, in tokens


@pytest.mark.parametrize("start", [0, 1, 3, 5, 6, 9])
def test_resuming_at_any_step_equals_the_uninterrupted_run(datasets, start):
    whole = _batches(Loader(_mixture(datasets), config=_config()))
    resumed = _batches(Loader(_mixture(datasets), start_step=start, config=_config()))
    assert len(resumed) == len(whole) - start
    for got, want in zip(resumed, whole[start:], strict=True):
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    with Loader(_mixture(datasets), config=_config()) as loader:
        for _ in range(start):
            next(loader)
        state = loader.state()
    fresh = Loader(_mixture(datasets), config=_config())
    fresh.restore(state)
    restored = _batches(fresh)
    assert len(restored) == len(whole) - start
    for got, want in zip(restored, whole[start:], strict=True):
        np.testing.assert_array_equal(got["tokens"], want["tokens"])


def test_a_state_from_another_phase_length_is_refused(datasets):
    loader = Loader(_mixture(datasets), config=_config())
    other = [*PHASES[:2], Phase({"web": 1, "code": 2}, end_step=10, seq_len=2)]
    with pytest.raises(roxxel.errors.StateError):
        Loader(_mixture(datasets, other), config=_config()).restore(loader.state())


LAYOUTS = {
    "dp": ((8,), ("data",), P("data")),
    "seq": ((4, 2), ("data", "seq"), P("data", "seq")),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sharded_batches_change_shape_at_the_phase_boundary(datasets, layout):
    shape, names, spec = LAYOUTS[layout]
    mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
    m = _mixture(datasets)
    expected = _batches(Loader(m, config=_config()))
    with Loader(_mixture(datasets), sharding=(mesh, spec), config=_config()) as loader:
        for step, want in enumerate(expected):
            batch = next(loader)
            assert isinstance(batch["tokens"], jax.Array)
            assert batch["tokens"].shape == (BATCHES[step], WIDTHS[step])
            for key, value in want.items():
                np.testing.assert_array_equal(np.asarray(batch[key]), value, err_msg=key)
                for shard in batch[key].addressable_shards:
                    np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index])


def test_a_later_phase_length_the_mesh_cannot_split_fails_at_construction(datasets):
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "seq"))
    phases = [*PHASES[:2], Phase({"web": 1, "code": 2}, end_step=10, seq_len=5)]
    with pytest.raises(ConfigError):
        Loader(_mixture(datasets, phases), sharding=(mesh, P("data", "seq")), config=_config())


def test_split_targets_follow_the_phase_length(datasets):
    web, code = (TokenWindows(ds, "tokens", 8, split_targets=True) for ds in datasets)
    m = Mixture({"web": web, "code": code}, PHASES, batch_size=8, seed=1)
    batches = _batches(Loader(m, config=_config()))
    for step, batch in enumerate(batches):
        assert batch["inputs"].shape == batch["targets"].shape == (BATCHES[step], WIDTHS[step])
        assert np.array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
