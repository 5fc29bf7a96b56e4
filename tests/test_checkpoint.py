"""Tests of roxxel.train.checkpoint: train state and loader state saved and restored together."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from roxxel.errors import ConfigError, StateError
from roxxel.train.checkpoint import CheckpointConfig, Checkpointer


def state(value: float) -> dict[str, Any]:
    return {
        "params": {"w": jnp.full((64, 32), value, jnp.float32), "b": jnp.zeros(3, jnp.int32)},
        "step": jnp.asarray(int(value), jnp.int32),
    }


def test_save_and_restore_round_trip_train_and_loader_state(tmp_path: Path) -> None:
    with Checkpointer(CheckpointConfig(tmp_path)) as ckpt:
        assert ckpt.latest_step() is None
        blocked = ckpt.save(7, state(1.5), {"step": 7, "fingerprint": "abc", "seed": 3})
        assert blocked >= 0
        ckpt.wait()
        restored = ckpt.restore(state(0.0))
    assert restored.step == 7
    assert restored.loader_state == {"step": 7, "fingerprint": "abc", "seed": 3}
    np.testing.assert_array_equal(restored.state["params"]["w"], np.full((64, 32), 1.5))
    assert restored.state["params"]["b"].dtype == jnp.int32
    assert int(restored.state["step"]) == 1


def test_a_fresh_checkpointer_finds_the_latest_step(tmp_path: Path) -> None:
    with Checkpointer(CheckpointConfig(tmp_path, max_to_keep=None)) as ckpt:
        for step in (2, 4, 6):
            ckpt.save(step, state(step), {"step": step})
    with Checkpointer(CheckpointConfig(tmp_path)) as ckpt:
        assert ckpt.all_steps() == [2, 4, 6]
        assert ckpt.latest_step() == 6
        assert ckpt.restore(state(0), step=4).loader_state == {"step": 4}


def test_max_to_keep_deletes_the_oldest(tmp_path: Path) -> None:
    with Checkpointer(CheckpointConfig(tmp_path, max_to_keep=2)) as ckpt:
        for step in range(1, 6):
            ckpt.save(step, state(step), {"step": step})
        ckpt.wait()
        assert ckpt.all_steps() == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["4", "5"]


def test_save_copies_before_returning_so_donated_buffers_can_be_reused(tmp_path: Path) -> None:
    bump = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)
    current = state(1.0)
    with Checkpointer(CheckpointConfig(tmp_path)) as ckpt:
        ckpt.save(1, current, {"step": 1})
        for _ in range(3):
            current = bump(current)
        ckpt.wait()
        restored = ckpt.restore(state(0.0))
    np.testing.assert_array_equal(restored.state["params"]["w"], np.full((64, 32), 1.0))
    np.testing.assert_array_equal(current["params"]["w"], np.full((64, 32), 4.0))


def test_saving_a_step_twice_is_refused(tmp_path: Path) -> None:
    with Checkpointer(CheckpointConfig(tmp_path)) as ckpt:
        ckpt.save(3, state(1), {"step": 3})
        ckpt.wait()
        with pytest.raises(StateError, match="step 3 already has a checkpoint"):
            ckpt.save(3, state(2), {"step": 3})


def test_restore_without_checkpoint_raises_state_error(tmp_path: Path) -> None:
    with Checkpointer(CheckpointConfig(tmp_path)) as ckpt:
        with pytest.raises(StateError, match="no checkpoint to restore"):
            ckpt.restore(state(0))
        ckpt.save(1, state(1), {"step": 1})
        ckpt.wait()
        with pytest.raises(StateError, match="step 9"):
            ckpt.restore(state(0), step=9)


def test_restore_into_another_structure_raises_state_error(tmp_path: Path) -> None:
    with Checkpointer(CheckpointConfig(tmp_path)) as ckpt:
        ckpt.save(1, state(1), {"step": 1})
        ckpt.wait()
        with pytest.raises(StateError, match="does not fit"):
            ckpt.restore({"other": jnp.zeros(2)})


def test_an_unfinished_save_directory_is_not_a_checkpoint(tmp_path: Path) -> None:
    with Checkpointer(CheckpointConfig(tmp_path)) as ckpt:
        ckpt.save(1, state(1), {"step": 1})
    (tmp_path / "2.orbax-checkpoint-tmp-123").mkdir()
    with Checkpointer(CheckpointConfig(tmp_path)) as ckpt:
        assert ckpt.all_steps() == [1]


def test_config_rejects_max_to_keep_below_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_to_keep is too small \\(0"):
        CheckpointConfig(tmp_path, max_to_keep=0)


def test_close_is_idempotent(tmp_path: Path) -> None:
    ckpt = Checkpointer(CheckpointConfig(tmp_path))
    ckpt.close()
    ckpt.close()


def test_restore_keeps_the_sharding_of_the_target(tmp_path: Path) -> None:
    devices = np.array(jax.devices())
    if devices.size < 2:
        pytest.skip("needs several devices (tests/conftest.py asks for 8 CPU devices)")
    mesh = jax.sharding.Mesh(devices, ("data",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    value = np.arange(devices.size * 4, dtype=np.float32).reshape(devices.size, 4)
    with Checkpointer(CheckpointConfig(tmp_path)) as ckpt:
        ckpt.save(1, {"w": jax.device_put(value, rows)}, {"step": 1})
        ckpt.wait()
        restored = ckpt.restore({"w": jax.device_put(np.zeros_like(value), rows)})
    assert restored.state["w"].sharding == rows
    np.testing.assert_array_equal(restored.state["w"], value)
