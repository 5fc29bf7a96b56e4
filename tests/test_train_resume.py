"""Tests of resuming `roxxel.train.fit` after damage, on a mesh, and of runs that end early.

Checkpoints here are real Orbax checkpoints written by `fit`, then damaged the way a crash,
a full disk or a careless hand would: a file cut short, a folder emptied, a step renamed.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from roxxel.errors import StateError
from roxxel.train.checkpoint import CheckpointConfig, Checkpointer, DamagedCheckpointError
from roxxel.train.loop import fit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_train import FakeLoader, config, init_state, read_log, step_fn

BIG = 1 << 15  # float32s: far larger than any metadata file, so the largest file is an array


def big_state() -> dict[str, jax.Array]:
    big = np.random.default_rng(0).normal(size=BIG).astype(np.float32)
    return {**init_state(), "big": jnp.asarray(big)}


def big_step(state: dict[str, jax.Array], batch: dict[str, Any]) -> Any:
    new, out = step_fn({"w": state["w"], "n": state["n"]}, batch)
    return {**new, "big": state["big"] * 1.0}, out


def train(out: Path, num_steps: int, **kw: Any) -> Any:
    cfg = config(out, num_steps=num_steps, save_every=5, max_to_keep=None, **kw)
    return fit(big_step, big_state(), FakeLoader(), config=cfg)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    """The weights after 15 steps without any interruption."""
    return np.asarray(train(tmp_path_factory.mktemp("whole"), 15).state["w"])


def largest_file(folder: Path) -> Path:
    files = [p for p in folder.rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


def cut_largest_array_file(step_dir: Path) -> None:
    path = largest_file(step_dir / "state")
    assert path.stat().st_size > BIG  # an array's data, not a metadata file
    os.truncate(path, path.stat().st_size // 2)


def empty_step_folder(step_dir: Path) -> None:
    shutil.rmtree(step_dir)
    step_dir.mkdir()


def empty_state_folder(step_dir: Path) -> None:
    shutil.rmtree(step_dir / "state")
    (step_dir / "state").mkdir()


def cut_loader_state(step_dir: Path) -> None:
    path = step_dir / "loader" / "metadata"
    os.truncate(path, path.stat().st_size // 2)


DAMAGE = {
    "cut_array": cut_largest_array_file,
    "empty_step": empty_step_folder,
    "empty_state": empty_state_folder,
    "cut_loader": cut_loader_state,
}


# ---- issue 12 item 8: the loader state's step must be the checkpoint's ------------------


def test_issue12_item8_checkpoint_renamed_to_another_step_is_refused(tmp_path: Path) -> None:
    train(tmp_path, 10)
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "10").rename(checkpoints / "15")
    with pytest.raises(StateError, match=r"train step 15 .*\(10, expected 15") as info:
        train(tmp_path, 20)
    assert info.value.path == str(checkpoints / "15")


def test_issue12_item8_loader_state_at_another_step_is_refused(tmp_path: Path) -> None:
    train(tmp_path, 10)
    (tmp_path / "checkpoints" / "10" / "loader" / "metadata").write_text('{"step": 12}')
    with pytest.raises(StateError, match=r"train step 10 .*\(12, expected 10") as info:
        train(tmp_path, 20)
    assert info.value.path == str(tmp_path / "checkpoints" / "10")


def test_issue12_item8_a_loader_that_restores_elsewhere_is_refused(tmp_path: Path) -> None:
    class Off(FakeLoader):
        def restore(self, state: dict[str, Any]) -> None:
            self.step = int(state["step"]) + 1

    fit(step_fn, init_state(), FakeLoader(), config=config(tmp_path, num_steps=4))
    with pytest.raises(StateError, match=r"restored at another step \(5, expected 4"):
        fit(step_fn, init_state(), Off(), config=config(tmp_path, num_steps=8))


def test_issue12_item8_a_fresh_run_with_a_loader_past_step_0_is_refused(tmp_path: Path) -> None:
    loader = FakeLoader()
    loader.restore({"step": 3})  # e.g. Loader(..., start_step=3): fit would count from 0
    with pytest.raises(StateError, match=r"loader is at step 3 .*\(3, expected 0"):
        fit(step_fn, init_state(), loader, config=config(tmp_path, num_steps=8))


# ---- issue 12 item 19: resume after damage ----------------------------------------------


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_issue12_item19_damaged_newest_checkpoint_falls_back_to_the_previous_one(
    tmp_path: Path,
    damage: str,
    uninterrupted: np.ndarray,
    capsys: pytest.CaptureFixture[str],
) -> None:
    train(tmp_path, 10)
    DAMAGE[damage](tmp_path / "checkpoints" / "10")
    resumed = train(tmp_path, 15, console=True)
    assert (resumed.status, resumed.start_step, resumed.step) == ("completed", 5, 15)
    np.testing.assert_array_equal(resumed.state["w"], uninterrupted)
    _, events = read_log(tmp_path)
    skipped = [e for e in events if e["event"] == "skipped_checkpoint"]
    assert [e["step"] for e in skipped] == [10]
    assert "is damaged" in skipped[0]["reason"]
    assert "skipped damaged checkpoint 10" in capsys.readouterr().err
    assert (tmp_path / "checkpoints" / "10.damaged").is_dir()  # kept for inspection
    with Checkpointer(CheckpointConfig(tmp_path / "checkpoints")) as ckpt:
        assert ckpt.all_steps() == [5, 10, 15]  # step 10 saved again


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_issue12_item19_a_damaged_only_checkpoint_is_a_state_error_naming_its_folder(
    tmp_path: Path, damage: str
) -> None:
    train(tmp_path, 5)
    DAMAGE[damage](tmp_path / "checkpoints" / "5")
    with pytest.raises(DamagedCheckpointError, match=r"every checkpoint in .* is damaged") as info:
        train(tmp_path, 10)
    assert isinstance(info.value, StateError)
    assert info.value.path == str(tmp_path / "checkpoints")
    assert "TensorStore details" not in str(info.value)
    assert (tmp_path / "checkpoints" / "5").is_dir()  # nothing moved when nothing restores


def test_issue12_item19_checkpointer_restore_says_damaged_not_does_not_fit(
    tmp_path: Path,
) -> None:
    train(tmp_path, 5)
    cut_loader_state(tmp_path / "checkpoints" / "5")
    with (
        Checkpointer(CheckpointConfig(tmp_path / "checkpoints")) as ckpt,
        pytest.raises(DamagedCheckpointError, match=r"checkpoint 5 in .* is damaged") as info,
    ):
        ckpt.restore(big_state())
    assert "does not fit" not in str(info.value)
    assert info.value.path == str(tmp_path / "checkpoints" / "5")


# ---- issue 12 item 20: a torn last line of metrics.jsonl --------------------------------


def test_issue12_item20_resume_cuts_a_torn_metrics_line_before_appending(tmp_path: Path) -> None:
    fit(step_fn, init_state(), FakeLoader(), config=config(tmp_path, num_steps=4))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 0.12')  # killed mid-write
    fit(step_fn, init_state(), FakeLoader(), config=config(tmp_path, num_steps=8))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]  # every line parses
    assert [r["step"] for r in records if "event" not in r] == list(range(8))
    repaired = [r for r in records if r.get("event") == "repaired"]
    assert repaired[0]["num_bytes"] == len('{"step": 4, "loss": 0.12')


# ---- issue 13 item 2: resume on a mesh with an unplaced initial state -------------------


class MeshLoader(FakeLoader):
    """FakeLoader's batches with their rows split over a mesh."""

    def __init__(self, sharding: NamedSharding) -> None:
        super().__init__()
        self.sharding = sharding

    def __next__(self) -> dict[str, Any]:
        return {k: jax.device_put(v, self.sharding) for k, v in super().__next__().items()}


def test_issue13_item2_resume_on_a_4_device_mesh_from_an_unplaced_state(tmp_path: Path) -> None:
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (tests/conftest.py asks for 8 CPU devices)")
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    rows = NamedSharding(mesh, P("data"))
    # init_state() is uncommitted: it sits on the default device until the step moves it.
    whole = fit(step_fn, init_state(), MeshLoader(rows), config=config(tmp_path / "a", num_steps=8))
    first = fit(step_fn, init_state(), MeshLoader(rows), config=config(tmp_path / "b", num_steps=4))
    assert first.step == 4
    resumed = fit(
        step_fn, init_state(), MeshLoader(rows), config=config(tmp_path / "b", num_steps=8)
    )
    assert (resumed.start_step, resumed.step) == (4, 8)
    np.testing.assert_array_equal(resumed.state["w"], whole.state["w"])
    assert read_log(tmp_path / "a")[0] == read_log(tmp_path / "b")[0]


def test_issue13_item2_restore_keeps_an_uncommitted_leaf_uncommitted(tmp_path: Path) -> None:
    with Checkpointer(CheckpointConfig(tmp_path)) as ckpt:
        ckpt.save(1, {"w": jnp.arange(4.0)}, {"step": 1})
        ckpt.wait()
        restored = ckpt.restore({"w": jnp.zeros(4)}).state["w"]
    assert not restored.committed
    np.testing.assert_array_equal(restored, np.arange(4.0))


# ---- issue 13 items 4 and 5: say why a run ended ----------------------------------------


class Short(FakeLoader):
    """A finite loader: 6 batches, as one epoch of a small dataset."""

    def __next__(self) -> dict[str, np.ndarray]:
        if self.step == 6:
            raise StopIteration
        return super().__next__()


def test_issue13_item4_a_loader_that_ends_early_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = fit(
        step_fn, init_state(), Short(), config=config(tmp_path, num_steps=10, console=True)
    )
    assert (result.status, result.step) == ("exhausted", 6)
    assert "ran out of batches at step 6 of 10" in result.message
    assert result.message in capsys.readouterr().err
    _, events = read_log(tmp_path)
    assert [(e["event"], e["step"]) for e in events][-1] == ("exhausted", 6)


def test_issue13_item5_rerunning_a_finished_run_says_it_is_complete(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = fit(step_fn, init_state(), FakeLoader(), config=config(tmp_path, num_steps=4))
    again = fit(
        step_fn, init_state(), FakeLoader(), config=config(tmp_path, num_steps=4, console=True)
    )
    assert (again.status, again.start_step, again.step) == ("completed", 4, 4)
    assert "already complete" in again.message
    assert again.message in capsys.readouterr().err
    assert again.metrics["loss"] == first.metrics["loss"]  # was KeyError: 'loss'
