"""Tests of roxxel.train.loop.fit and roxxel.train.metrics: resume, preemption, crashes, NaN, logging.

A tiny fake loader (batches are a pure function of the step) stands in for roxxel.Loader,
so these tests exercise only the loop. Runs that must die for real (kill -9, SIGTERM) run
this file as a subprocess worker: ``python tests/test_train.py OUT NUM_STEPS SAVE_EVERY GATE``.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import roxxel
from roxxel.errors import ConfigError, StateError
from roxxel.train.checkpoint import CheckpointConfig, Checkpointer
from roxxel.train.loop import TrainConfig, fit, split_step_output
from roxxel.train.metrics import MetricsLogger

W_TRUE = np.array([1.0, -2.0, 3.0, 0.5], np.float32)


class FakeLoader:
    """Batches as a pure function of the step; optional hooks at chosen steps.

    gate: at that step, print ``gate <step>`` and wait for a line on stdin (the test decides
    what happens to the process meanwhile). poison: at that step, the batch holds a NaN.
    odd: at that step, the batch has a different shape. signal_at: send SIGTERM to self.
    """

    def __init__(self, gate: int = -1, poison: int = -1, odd: int = -1, signal_at: int = -1):
        self.step = 0
        self.hooks = {"gate": gate, "poison": poison, "odd": odd, "signal": signal_at}

    def __iter__(self) -> FakeLoader:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        step, self.step = self.step, self.step + 1
        if step == self.hooks["gate"]:
            print(f"gate {step}", flush=True)
            sys.stdin.readline()
        if step == self.hooks["signal"]:
            os.kill(os.getpid(), signal.SIGTERM)
        rows = 5 if step == self.hooks["odd"] else 8
        x = np.random.default_rng(step).normal(size=(rows, 4)).astype(np.float32)
        if step == self.hooks["poison"]:
            x[0, 0] = np.nan
        return {"x": x, "y": x @ W_TRUE}

    def state(self) -> dict[str, Any]:
        return {"step": self.step}

    def restore(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def init_state() -> dict[str, jax.Array]:
    return {"w": jnp.zeros(4, jnp.float32), "n": jnp.zeros((), jnp.int32)}


def step_fn(state: dict[str, jax.Array], batch: dict[str, Any]) -> Any:
    if batch["x"].shape[0] != 8:
        raise ValueError(f"step: bad batch shape {batch['x'].shape}")

    def loss_fn(w: jax.Array) -> jax.Array:
        return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)

    loss, grad = jax.value_and_grad(loss_fn)(state["w"])
    new = {"w": state["w"] - 0.05 * grad, "n": state["n"] + 1}
    return new, (loss, {"batch_sum": jnp.sum(batch["x"]), "n": new["n"]})


def config(out: Path, **kw: Any) -> TrainConfig:
    return TrainConfig(**{"num_steps": 20, "out_dir": out, "log_every": 1, "console": False, **kw})


def read_log(out: Path) -> tuple[dict[int, list[dict[str, Any]]], list[dict[str, Any]]]:
    """Metric records by step (a step run twice appears twice) and event records."""
    steps: dict[int, list[dict[str, Any]]] = {}
    events = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        record.pop("time")
        if "event" in record:
            events.append(record)
        else:
            steps.setdefault(record["step"], []).append(record)
    return steps, events


# ---- loss unpacking ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("out", "expected"),
    [
        ((0, 1.5), {"loss": 1.5}),
        ((0, (1.5, 2.0)), {"loss": 1.5, "aux": 2.0}),
        ((0, (1.5, {"acc": 0.5})), {"loss": 1.5, "acc": 0.5}),
        ((0, (1.5, None)), {"loss": 1.5}),
        ((0, {"acc": 0.5, "loss": 1.5, "x": {"y": 1}}), {"loss": 1.5, "acc": 0.5, "x/y": 1}),
    ],
)
def test_split_step_output_accepts_every_form(out: Any, expected: dict[str, Any]) -> None:
    state, metrics = split_step_output(out)
    assert state == 0
    assert metrics == expected
    assert next(iter(metrics)) == "loss"


def test_split_step_output_rejects_bad_forms() -> None:
    with pytest.raises(TypeError, match="expected \\(state, loss\\)"):
        split_step_output(1.5)
    with pytest.raises(ConfigError, match="lack 'loss'"):
        split_step_output((0, {"acc": 1.0}))
    with pytest.raises(ConfigError, match="'loss' is not a scalar"):
        split_step_output((0, np.ones(3)))
    with pytest.raises(ConfigError, match="'aux/0' is not a scalar"):
        split_step_output((0, (1.0, [np.ones(2)])))


@pytest.mark.parametrize("form", ["loss", "tuple", "dict"])
def test_fit_logs_loss_and_aux_for_each_form(tmp_path: Path, form: str) -> None:
    def step(state: Any, batch: Any) -> Any:
        new, (loss, aux) = step_fn(state, batch)
        if form == "loss":
            return new, loss
        return new, (loss, aux) if form == "tuple" else {"loss": loss, **aux}

    result = fit(step, init_state(), FakeLoader(), config=config(tmp_path, num_steps=6))
    steps, _ = read_log(tmp_path)
    assert sorted(steps) == list(range(6))
    keys = {"step", "loss"} | (set() if form == "loss" else {"batch_sum", "n"})
    assert set(steps[5][0]) == keys
    assert steps[5][0]["loss"] == result.metrics["loss"]
    assert steps[0][0]["loss"] > steps[5][0]["loss"]


def test_config_rejects_bad_values(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="num_steps is negative"):
        TrainConfig(num_steps=-1, out_dir=tmp_path)
    with pytest.raises(ConfigError, match="log_every"):
        TrainConfig(num_steps=1, out_dir=tmp_path, log_every=0)
    with pytest.raises(ConfigError, match="on_nonfinite"):
        TrainConfig(num_steps=1, out_dir=tmp_path, on_nonfinite="ignore")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="max_to_keep"):
        TrainConfig(num_steps=1, out_dir=tmp_path, max_to_keep=0)


# ---- checkpoints and resume -------------------------------------------------------------


def test_fit_resumes_in_process_with_the_same_losses(tmp_path: Path) -> None:
    whole = fit(step_fn, init_state(), FakeLoader(), config=config(tmp_path / "a"))
    first = fit(step_fn, init_state(), FakeLoader(), config=config(tmp_path / "b", num_steps=7))
    assert (first.status, first.step) == ("completed", 7)
    second = fit(step_fn, init_state(), FakeLoader(), config=config(tmp_path / "b"))
    assert (second.start_step, second.step) == (7, 20)
    np.testing.assert_array_equal(whole.state["w"], second.state["w"])
    assert int(second.state["n"]) == 20
    assert read_log(tmp_path / "a")[0] == read_log(tmp_path / "b")[0]


def test_fit_keeps_max_to_keep_checkpoints(tmp_path: Path) -> None:
    cfg = config(tmp_path, num_steps=11, save_every=2, max_to_keep=2)
    result = fit(step_fn, init_state(), FakeLoader(), config=cfg)
    with Checkpointer(CheckpointConfig(result.checkpoint_dir)) as ckpt:
        assert ckpt.all_steps() == [10, 11]
    assert len(result.save_seconds) == 6
    assert all(s >= 0 for s in result.save_seconds)


def test_fit_of_a_finished_run_returns_at_once(tmp_path: Path) -> None:
    fit(step_fn, init_state(), FakeLoader(), config=config(tmp_path, num_steps=4))
    again = fit(step_fn, init_state(), FakeLoader(), config=config(tmp_path, num_steps=4))
    assert (again.status, again.start_step, again.step, again.save_seconds) == (
        "completed",
        4,
        4,
        (),
    )


def test_fit_without_resume_refuses_a_folder_with_checkpoints(tmp_path: Path) -> None:
    fit(step_fn, init_state(), FakeLoader(), config=config(tmp_path, num_steps=2))
    with pytest.raises(StateError, match="already holds checkpoints \\(\\[2\\]"):
        fit(step_fn, init_state(), FakeLoader(), config=config(tmp_path, resume=False))


def test_fit_stops_when_the_loader_ends(tmp_path: Path) -> None:
    class Short(FakeLoader):
        def __next__(self) -> dict[str, np.ndarray]:
            if self.step == 5:
                raise StopIteration
            return super().__next__()

    result = fit(step_fn, init_state(), Short(), config=config(tmp_path))
    assert (result.status, result.step) == ("exhausted", 5)
    with Checkpointer(CheckpointConfig(result.checkpoint_dir)) as ckpt:
        assert ckpt.latest_step() == 5


def test_fit_copies_a_leaf_that_appears_twice_before_donating(tmp_path: Path) -> None:
    zeros = jnp.zeros(4, jnp.float32)

    def step(state: Any, batch: Any) -> Any:
        new, (loss, _) = step_fn({"w": state["a"], "n": state["n"]}, batch)
        return {"a": new["w"], "b": state["b"] + 1, "n": new["n"]}, loss

    state = {"a": zeros, "b": zeros, "n": jnp.zeros((), jnp.int32)}
    result = fit(step, state, FakeLoader(), config=config(tmp_path, num_steps=3))
    np.testing.assert_array_equal(result.state["b"], np.full(4, 3.0))


# ---- preemption, crashes, NaN -----------------------------------------------------------


def test_sigterm_in_process_finishes_the_step_saves_and_returns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A signal while step 0 runs (here: while it is traced) lets it finish: stop at 1."""

    def signalled_step(state: dict[str, jax.Array], batch: dict[str, Any]) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)
        return step_fn(state, batch)

    cfg = config(tmp_path, console=True)
    result = fit(signalled_step, init_state(), FakeLoader(), config=cfg)
    assert (result.status, result.step) == ("preempted", 1)
    assert "roxxel: preempted by SIGTERM at step 1" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with Checkpointer(CheckpointConfig(result.checkpoint_dir)) as ckpt:
        assert ckpt.latest_step() == 1
        assert ckpt.restore(init_state()).loader_state == {"step": 1}


def test_sigterm_while_the_loader_makes_a_batch_stops_before_that_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A signal while the loop waits for batch 6 (a preemption notice gives seconds; a
    batch may wait for a store) ends that wait: the checkpoint is step 6, whose loader
    state gives batch 6 again on resume."""
    cfg = config(tmp_path, console=True)
    result = fit(step_fn, init_state(), FakeLoader(signal_at=6), config=cfg)
    assert (result.status, result.step) == ("preempted", 6)
    assert "roxxel: preempted by SIGTERM at step 6" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with Checkpointer(CheckpointConfig(result.checkpoint_dir)) as ckpt:
        assert ckpt.latest_step() == 6
        restored = ckpt.restore(init_state())
    assert restored.loader_state == {"step": 6} and int(restored.state["n"]) == 6


def test_exception_in_step_logs_traceback_after_all_queued_metrics(tmp_path: Path) -> None:
    cfg = config(tmp_path, metrics_lag=4, save_every=3)
    with pytest.raises(ValueError, match="bad batch shape"):
        fit(step_fn, init_state(), FakeLoader(odd=7), config=cfg)
    steps, events = read_log(tmp_path)
    assert sorted(steps) == list(range(7))
    assert events[-1]["event"] == "crash"
    assert "bad batch shape" in events[-1]["traceback"]
    assert "Traceback" in (tmp_path / "crash-p0.log").read_text()


def test_nonfinite_loss_stops_after_saving_the_last_good_state(tmp_path: Path) -> None:
    cfg = config(tmp_path / "bad", save_every=4, metrics_lag=3)
    with pytest.raises(FloatingPointError, match="not finite at step 9 \\(nan"):
        fit(step_fn, init_state(), FakeLoader(poison=9), config=cfg)
    good = fit(step_fn, init_state(), FakeLoader(), config=config(tmp_path / "good", num_steps=9))
    with Checkpointer(CheckpointConfig(tmp_path / "bad" / "checkpoints")) as ckpt:
        assert ckpt.all_steps() == [4, 8, 9]
        restored = ckpt.restore(init_state())
    assert restored.loader_state == {"step": 9}
    np.testing.assert_array_equal(restored.state["w"], good.state["w"])
    steps, events = read_log(tmp_path / "bad")
    assert sorted(steps) == list(range(9))
    assert [e["event"] for e in events][-2:] == ["nonfinite", "crash"]


def test_nonfinite_loss_is_skipped_when_asked(tmp_path: Path) -> None:
    cfg = config(tmp_path, on_nonfinite="skip")
    result = fit(step_fn, init_state(), FakeLoader(poison=3), config=cfg)
    assert (result.status, result.step, result.num_skipped) == ("completed", 20, 1)
    assert int(result.state["n"]) == 19
    assert np.all(np.isfinite(result.state["w"]))
    _, events = read_log(tmp_path)
    assert [e["step"] for e in events if e["event"] == "skipped"] == [3]


# ---- real processes: kill -9 and SIGTERM ------------------------------------------------


def start_worker(out: Path, gate: int = -1, num_steps: int = 30) -> subprocess.Popen[str]:
    root = str(Path(roxxel.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, __file__, str(out), str(num_steps), "5", str(gate)]
    return subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def run_worker(out: Path, gate: int = -1) -> dict[str, Any]:
    proc = start_worker(out, gate)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    return json.loads(stdout.splitlines()[-1])


def wait_for_gate(proc: subprocess.Popen[str], gate: int) -> None:
    """Reads the worker's stdout up to its ``gate N`` line (other libraries print too)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == f"gate {gate}":
            return
    pytest.fail(f"the worker exited (status {proc.wait()}) before reaching gate {gate}")


def assert_same_steps(out: Path, reference: Path) -> None:
    steps, _ = read_log(out)
    ref, _ = read_log(reference)
    assert sorted(steps) == sorted(ref)
    for step, records in steps.items():
        assert all(r == ref[step][0] for r in records), step


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """An uninterrupted worker run: its folder and its summary."""
    out = tmp_path_factory.mktemp("reference")
    return out, run_worker(out)


def test_kill_9_mid_run_resumes_from_the_last_checkpoint_like_an_uninterrupted_run(
    tmp_path: Path, reference: tuple[Path, dict[str, Any]]
) -> None:
    proc = start_worker(tmp_path / "run", gate=14)
    wait_for_gate(proc, 14)
    proc.kill()
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    with Checkpointer(CheckpointConfig(tmp_path / "run" / "checkpoints")) as ckpt:
        last = ckpt.latest_step()
    assert last in (5, 10)  # 5 is committed before 10 starts; 10 may or may not be
    resumed = run_worker(tmp_path / "run")
    assert (resumed["start"], resumed["step"], resumed["status"]) == (last, 30, "completed")
    assert resumed["w"] == reference[1]["w"]
    assert_same_steps(tmp_path / "run", reference[0])


def test_sigterm_saves_exits_zero_and_a_restart_continues(
    tmp_path: Path, reference: tuple[Path, dict[str, Any]]
) -> None:
    proc = start_worker(tmp_path / "run", gate=12)
    wait_for_gate(proc, 12)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate("\n", timeout=60)
    assert proc.returncode == 0, stderr
    assert json.loads(stdout.splitlines()[-1])["status"] == "preempted"
    assert "roxxel: preempted by SIGTERM at step 12" in stderr  # it waited for batch 12
    resumed = run_worker(tmp_path / "run")
    assert (resumed["start"], resumed["step"]) == (12, 30)
    assert resumed["w"] == reference[1]["w"]
    assert_same_steps(tmp_path / "run", reference[0])


# Far more steps than the stop needs: the preemption notice travels through JAX's
# coordination service asynchronously, and on a loaded machine a short run could end first.
MULTIHOST_STEPS = 150


def start_multihost(out: Path, port: int, gates: list[int]) -> list[subprocess.Popen[str]]:
    root = str(Path(roxxel.__file__).resolve().parent.parent)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
        "JAX_PLATFORMS": "cpu",
    }
    procs = []
    for pid, gate in enumerate(gates):
        argv = [sys.executable, __file__, "multihost", str(port), str(len(gates)), str(pid)]
        argv += [str(gate), str(out)]
        procs.append(
            subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    return procs


def finish_all(procs: list[subprocess.Popen[str]]) -> list[tuple[dict[str, Any], str]]:
    """Each worker's summary and stderr; kills what is left if one fails."""
    results = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=120)
            assert proc.returncode == 0, stderr[-3000:]
            results.append((json.loads(stdout.splitlines()[-1]), stderr))
    finally:
        for proc in procs:  # ours, by handle
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_multihost_sigterm_to_one_process_stops_all_at_one_step(tmp_path: Path) -> None:
    procs = start_multihost(tmp_path, free_port(), gates=[-1, 12])
    try:
        wait_for_gate(procs[1], 12)
    except BaseException:
        for proc in procs:  # ours, by handle
            proc.kill()
            proc.communicate()
        raise
    procs[1].send_signal(signal.SIGTERM)
    assert procs[1].stdin is not None
    procs[1].stdin.write("\n")
    procs[1].stdin.flush()
    (first, err0), (second, _) = finish_all(procs)
    assert first["status"] == second["status"] == "preempted"
    stop = first["step"]
    assert second["step"] == stop and 13 <= stop < MULTIHOST_STEPS
    assert f"roxxel: preempted by a preemption notice at step {stop}" in err0
    steps, _ = read_log(tmp_path)
    assert all(len(records) == 1 for records in steps.values())  # process 0 writes alone
    (resumed, _), (other, _) = finish_all(start_multihost(tmp_path, free_port(), [-1, -1]))
    assert (resumed["start"], resumed["step"], resumed["status"]) == (
        stop,
        MULTIHOST_STEPS,
        "completed",
    )
    assert other["w"] == resumed["w"]


# ---- with the real roxxel.Loader -------------------------------------------------------


def token_loader(path: Path) -> Any:
    if not path.exists():
        schema = roxxel.Schema.parse({"tokens": "int32[]"})
        with roxxel.DatasetWriter(path, schema) as writer:
            for doc in range(40):
                writer.write({"tokens": np.arange(doc, doc + 7 + doc % 5, dtype=np.int32)})
    windows = roxxel.TokenWindows(roxxel.open_dataset(path), "tokens", seq_len=8)
    return roxxel.Loader(windows, 4, seed=1, config=roxxel.LoaderConfig(num_epochs=None))


def token_step(state: dict[str, jax.Array], batch: dict[str, Any]) -> Any:
    tokens = batch["tokens"].astype(jnp.float32)

    def loss_fn(w: jax.Array) -> jax.Array:
        return jnp.mean((tokens[:, :-1] * w - tokens[:, 1:]) ** 2)

    loss, grad = jax.value_and_grad(loss_fn)(state["w"])
    new = {"w": state["w"] - 1e-4 * grad}
    return new, {"loss": loss, "tokens_sum": jnp.sum(batch["tokens"])}


def test_real_loader_resumes_with_the_same_batches_and_losses(tmp_path: Path) -> None:
    def start() -> dict[str, jax.Array]:
        return {"w": jnp.zeros((), jnp.float32)}  # fresh each time: fit donates it

    with token_loader(tmp_path / "data") as loader:
        whole = fit(token_step, start(), loader, config=config(tmp_path / "a"))
    with token_loader(tmp_path / "data") as loader:
        cut = fit(token_step, start(), loader, config=config(tmp_path / "b", num_steps=9))
    assert cut.step == 9
    with token_loader(tmp_path / "data") as loader:
        resumed = fit(token_step, start(), loader, config=config(tmp_path / "b"))
        assert loader.state()["step"] == 20
    assert (resumed.start_step, resumed.step) == (9, 20)
    assert read_log(tmp_path / "a")[0] == read_log(tmp_path / "b")[0]
    assert float(whole.state["w"]) == float(resumed.state["w"])


def test_flax_nnx_model_and_optimizer_train_and_resume(tmp_path: Path) -> None:
    nnx = pytest.importorskip("flax.nnx")
    optax = pytest.importorskip("optax")

    def build() -> tuple[Any, Any]:
        model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)
        graphdef, state = nnx.split((model, optimizer))
        return graphdef, state

    graphdef, _ = build()

    def step(state: Any, batch: Any) -> Any:
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model: Any) -> jax.Array:
            return jnp.mean((model(batch["x"])[:, 0] - batch["y"]) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    whole = fit(step, build()[1], FakeLoader(), config=config(tmp_path / "a"))
    fit(step, build()[1], FakeLoader(), config=config(tmp_path / "b", num_steps=8))
    resumed = fit(step, build()[1], FakeLoader(), config=config(tmp_path / "b"))
    assert resumed.start_step == 8
    assert read_log(tmp_path / "a")[0] == read_log(tmp_path / "b")[0]
    assert steps_losses(tmp_path / "a")[-1] < steps_losses(tmp_path / "a")[0]
    model, _ = nnx.merge(graphdef, resumed.state)
    np.testing.assert_array_equal(
        model.kernel[...], nnx.merge(graphdef, whole.state)[0].kernel[...]
    )


def steps_losses(out: Path) -> list[float]:
    steps, _ = read_log(out)
    return [steps[s][0]["loss"] for s in sorted(steps)]


def test_the_example_main_job_runs_end_to_end_at_a_tiny_size(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parent.parent / "examples" / "main.py"
    if not example.exists():
        pytest.skip("examples/main.py is not in this checkout")
    root = str(Path(roxxel.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, str(example), "--out", str(tmp_path), "--steps", "6"]
    argv += ["--batch-size", "4", "--seq-len", "32", "--corpus-mb", "0.05", "--save-every", "3"]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "roxxel demo: completed at step 6" in done.stdout
    steps, _ = read_log(tmp_path / "train")
    assert sorted(steps) == [0, 5]
    assert {"loss", "loss_code", "loss_prose", "rows_code", "rows_prose"} <= set(steps[0][0])
    assert steps[0][0]["rows_code"] > steps[5][0]["rows_code"]  # the second phase is prose-heavy
    with Checkpointer(CheckpointConfig(tmp_path / "train" / "checkpoints")) as ckpt:
        assert ckpt.all_steps() == [3, 6]


# ---- the metrics logger on its own ------------------------------------------------------


def test_logger_writes_only_on_process_0_but_every_process_keeps_its_crash_file(
    tmp_path: Path,
) -> None:
    console = io.StringIO()
    with MetricsLogger(tmp_path, process_index=1, console=console) as logger:
        logger.log(0, {"loss": 1.0})
        logger.crash(RuntimeError("boom"), step=0)
    assert not (tmp_path / "metrics.jsonl").exists()
    assert "boom" in (tmp_path / "crash-p1.log").read_text()
    assert console.getvalue() == ""


def test_logger_flushes_a_full_queue_before_the_exception_continues(tmp_path: Path) -> None:
    console = io.StringIO()
    with (
        pytest.raises(KeyboardInterrupt),
        MetricsLogger(tmp_path, console=console, num_steps=500, queue_size=4) as logger,
    ):
        for step in range(500):
            logger.log(step, {"loss": 1.0 / (step + 1)})
        raise KeyboardInterrupt
    steps, events = read_log(tmp_path)
    assert sorted(steps) == list(range(500))
    assert events[-1]["event"] == "crash"
    assert "KeyboardInterrupt" in events[-1]["traceback"]
    assert console.getvalue().splitlines()[-2].startswith("step 499/500  loss 0.0020")


def test_logger_raises_a_write_error_in_the_caller_and_never_hangs(tmp_path: Path) -> None:
    (tmp_path / "bad" / "metrics.jsonl").mkdir(parents=True)
    with pytest.raises(IsADirectoryError):
        MetricsLogger(tmp_path / "bad", console=None)
    logger = MetricsLogger(tmp_path, console=None, queue_size=2)
    logger.log(0, {"loss": object()})  # not JSON: the writer keeps the error
    logger.flush()
    with pytest.raises(OSError, match=r"writing .*metrics\.jsonl failed"):
        for step in range(1, 10):
            logger.log(step, {"loss": 1.0})
    with pytest.raises(OSError):
        logger.close()


def worker_main(argv: list[str]) -> None:
    out, num_steps, save_every, gate = Path(argv[0]), *map(int, argv[1:])
    cfg = TrainConfig(
        num_steps=num_steps, out_dir=out, save_every=save_every, log_every=1, console=True
    )
    result = fit(step_fn, init_state(), FakeLoader(gate=gate), config=cfg)
    summary = {"status": result.status, "step": result.step, "start": result.start_step}
    print(json.dumps({**summary, "w": np.asarray(result.state["w"]).tolist()}), flush=True)


def multihost_worker_main(argv: list[str]) -> None:
    """One process of a data-parallel run: the batch is split over the processes, so every
    step has a cross-process reduction (gloo) and the processes run in step."""
    port, num_processes, process_id, gate = map(int, argv[:4])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{port}", num_processes, process_id, initialization_timeout=60
    )
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows, whole = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())

    def place(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    class GlobalLoader(FakeLoader):
        def __next__(self) -> Any:
            return {k: place(v, rows) for k, v in super().__next__().items()}

    state = {k: place(np.asarray(v), whole) for k, v in init_state().items()}
    cfg = TrainConfig(num_steps=MULTIHOST_STEPS, out_dir=Path(argv[4]), save_every=5, log_every=1)
    result = fit(step_fn, state, GlobalLoader(gate=gate), config=cfg)
    summary = {"status": result.status, "step": result.step, "start": result.start_step}
    print(json.dumps({**summary, "w": np.asarray(result.state["w"]).tolist()}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "multihost":
        multihost_worker_main(sys.argv[2:])
    else:
        worker_main(sys.argv[1:])
