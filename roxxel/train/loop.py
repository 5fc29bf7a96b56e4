"""The training loop around a roxxel loader: jit, metrics, checkpoints, preemption.

`fit` runs a user step function ``step(state, batch) -> (state, out)`` for a number of steps,
where ``out`` is a scalar loss, ``(loss, aux)`` or ``{"loss": loss, ...}``. It compiles the
step with the state donated, fetches metrics from the device a few steps late (so the host
never waits on every step), saves the train state and the loader state together with Orbax,
resumes from the newest checkpoint, stops cleanly on SIGTERM/SIGINT, and stops (or skips)
on a non-finite loss without ever saving a poisoned state.

Steps are numbered like the loader's: step s consumes batch s, and the checkpoint of step s
holds the state before batch s, so a restored run continues with batch s.

A loader is anything that follows this protocol (`roxxel.Loader` does): an iterable of
batches (dicts of arrays) with ``state() -> dict`` (small, JSON-able) describing the position
of the next batch it will yield, with that batch's step under ``"step"``, and
``restore(state)`` to continue from such a position.

`fit` says why it ended, in `FitResult.message` and on the log's console channel: a loader
that ran out of batches before ``num_steps``, a stop signal, or a run that was already
complete (then it trains nothing and returns the last logged metrics).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from roxxel.errors import ConfigError, StateError
from roxxel.train.checkpoint import CheckpointConfig, Checkpointer, Restored
from roxxel.train.metrics import MetricsLogger, last_metrics, split_step_output

__all__ = ["FitResult", "LoaderLike", "TrainConfig", "fit", "split_step_output"]

Status = Literal["completed", "preempted", "exhausted"]


class LoaderLike(Protocol):
    """What `fit` needs from a loader: ``state()["step"]`` is the step of its next batch."""

    def __iter__(self) -> Any: ...
    def state(self) -> dict[str, Any]: ...
    def restore(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """Options of `fit`.

    Attributes:
        num_steps: train until this many steps are done (counting restored ones).
        out_dir: folder for ``checkpoints/``, ``metrics.jsonl`` and crash files.
        save_every: save every this many steps (0: only at the end or on a stop).
        max_to_keep: newest checkpoints kept (None keeps all).
        log_every: write metrics of every this-many-th step (the last step always).
        on_nonfinite: ``"stop"`` saves the last good state and raises
            `FloatingPointError`; ``"skip"`` drops the update of that step and goes on.
        metrics_lag: steps whose metrics may stay on the device before the host waits.
        handle_signals: SIGTERM/SIGINT finish the step (or end the wait for the next
            batch), save and return "preempted".
        resume: restore the newest checkpoint in ``out_dir`` if there is one; when False,
            an ``out_dir`` that holds checkpoints is refused (`StateError`).
        console: print a progress line at each logged step (process 0 only).
    """

    num_steps: int
    out_dir: str | os.PathLike[str]
    save_every: int = 0
    max_to_keep: int | None = 3
    log_every: int = 10
    on_nonfinite: Literal["stop", "skip"] = "stop"
    metrics_lag: int = 2
    handle_signals: bool = True
    resume: bool = True
    console: bool = True

    def __post_init__(self) -> None:
        counts = {
            "num_steps": self.num_steps,
            "save_every": self.save_every,
            "metrics_lag": self.metrics_lag,
        }
        for name, value in counts.items():
            if value < 0:
                raise ConfigError(f"TrainConfig: {name} is negative ({value}, expected >= 0)")
        if self.log_every < 1:
            raise ConfigError(f"TrainConfig: log_every is {self.log_every} (expected >= 1)")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ConfigError(
                f"TrainConfig: unknown on_nonfinite ({self.on_nonfinite!r}, "
                "expected 'stop' or 'skip')"
            )
        CheckpointConfig(self.out_dir, max_to_keep=self.max_to_keep)


@dataclass(frozen=True)
class FitResult:
    """How `fit` ended.

    Attributes:
        status: "completed" (num_steps reached), "preempted" (a signal) or "exhausted"
            (the loader ended first).
        step: steps done, i.e. the step of the final checkpoint.
        state: the final train state.
        start_step: the step this call started from (a restored checkpoint, or 0).
        metrics: the metrics of the last step run (empty if none ran).
        num_skipped: steps whose update was dropped for a non-finite loss.
        save_seconds: how long each save blocked the loop.
        checkpoint_dir: where the checkpoints are.
        metrics_path: the JSON Lines metrics file.
        message: why the run ended, in one line (also on the console and in the log):
            the loader ran out, a signal, or a run that was already complete (then
            ``start_step == step`` and `metrics` are the last ones logged, if any).
    """

    status: Status
    step: int
    state: Any
    start_step: int
    metrics: dict[str, float]
    num_skipped: int
    save_seconds: tuple[float, ...]
    checkpoint_dir: str
    metrics_path: str
    message: str = ""


def _compile(step_fn: Callable[..., Any], skip: bool) -> Callable[..., Any]:
    """Jits `step_fn` over a carry (state, halted) with the carry donated.

    A step whose loss is not finite leaves the state unchanged. Under "stop" the carry's
    `halted` flag then freezes every later step too, so however late the host sees the bad
    loss, the state it holds is the one before the first bad step.
    """

    def run(carry: tuple[Any, jax.Array], batch: Any) -> tuple[Any, dict[str, Any]]:
        state, halted = carry
        new_state, metrics = split_step_output(step_fn(state, batch))
        finite = jnp.isfinite(metrics["loss"])
        take = finite if skip else finite & ~halted
        state = jax.tree.map(lambda n, o: jax.lax.select(take, n, o), new_state, state)
        return (state, halted if skip else halted | ~finite), metrics

    return jax.jit(run, donate_argnums=0)


class _StopSignals:
    """Stop requests, checked between steps.

    One process: SIGTERM/SIGINT set a flag (a second SIGINT interrupts at once), and stop a
    wait for the next batch (`batch_wait`): a preemption notice gives seconds, and a batch
    may wait for a store's timeouts. Several processes (``jax.distributed``): JAX's
    preemption service owns SIGTERM, and `reached_preemption_sync_point` makes every
    process stop at the same step.
    """

    def __init__(self, enabled: bool) -> None:
        self.multihost = enabled and jax.process_count() > 1
        main_thread = threading.current_thread() is threading.main_thread()
        self.enabled = enabled and main_thread and not self.multihost
        self.received: str | None = None
        self._previous: dict[int, Any] = {}
        self._waiting = False

    @contextmanager
    def batch_wait(self) -> Iterator[None]:
        """A stop signal arriving inside raises `_StopWaiting` there (also one that arrived
        since `requested` was asked)."""
        self._waiting = True
        try:
            if self.received is not None:
                raise _StopWaiting
            yield
        finally:
            self._waiting = False

    def requested(self, step: int) -> bool:
        """Whether to stop before running `step` (all processes agree when several)."""
        if self.multihost and multihost_utils.reached_preemption_sync_point(step):
            self.received = "a preemption notice"
        return self.received is not None

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name
        if self._waiting:
            self._waiting = False
            raise _StopWaiting

    def __enter__(self) -> _StopSignals:
        if self.enabled:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class _StopWaiting(BaseException):
    """A stop signal ended the wait for a batch (a `BaseException`, as `KeyboardInterrupt`
    is, so that no ``except Exception`` in a loader takes it for its own error)."""


@dataclass
class _Pending:
    step: int
    metrics: dict[str, Any]
    loader_state: dict[str, Any]  # the loader's position before this step


@dataclass
class _Run:
    """The mutable bookkeeping of one `fit` call."""

    config: TrainConfig
    loader: LoaderLike
    logger: MetricsLogger
    checkpointer: Checkpointer
    step: int = 0
    loader_state: dict[str, Any] = field(default_factory=dict)
    pending: deque[_Pending] = field(default_factory=deque)
    saved: set[int] = field(default_factory=set)
    save_seconds: list[float] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    num_skipped: int = 0
    bad: tuple[int, float, dict[str, Any]] | None = None

    def fetch(self, force: bool) -> None:
        """Converts device metrics to Python numbers: ready ones, old ones, or all."""
        lag = self.config.metrics_lag
        while self.pending and (force or len(self.pending) > lag or _ready(self.pending[0])):
            entry = self.pending.popleft()
            values = {k: np.asarray(v).item() for k, v in jax.device_get(entry.metrics).items()}
            self.record(entry, values)

    def record(self, entry: _Pending, values: dict[str, float]) -> None:
        if self.bad is not None:
            return  # under "stop", steps after the bad one were no-ops
        loss = values["loss"]
        if not np.isfinite(loss):
            if self.config.on_nonfinite == "stop":
                self.bad = (entry.step, loss, entry.loader_state)
                return
            self.num_skipped += 1
            message = f"roxxel: skipped step {entry.step}: loss is {loss}"
            self.logger.event("skipped", entry.step, message, loss=loss)
        self.metrics = values
        last = entry.step == self.config.num_steps - 1
        if entry.step % self.config.log_every == 0 or last:
            self.logger.log(entry.step, values)

    def save(self, state: Any, step: int, loader_state: Mapping[str, Any]) -> None:
        if step in self.saved:
            return
        seconds = self.checkpointer.save(step, state, loader_state)
        self.saved.add(step)
        self.save_seconds.append(seconds)
        self.logger.event("checkpoint", step, blocked_s=seconds)

    def save_current(self, state: Any) -> None:
        """Saves at the current step once every earlier loss is known to be finite."""
        self.fetch(force=True)
        if self.bad is not None:
            self.stop_nonfinite(state)
        self.save(state, self.step, self.loader_state)

    def stop_nonfinite(self, state: Any) -> None:
        step, loss, loader_state = self.bad or (0, 0.0, {})
        self.save(state, step, loader_state)
        self.checkpointer.wait()
        message = (
            f"fit: loss is not finite at step {step} ({loss}, expected a finite number); "
            f"saved the state before it as checkpoint {step} in {self.checkpointer.directory}"
        )
        self.logger.event("nonfinite", step, message, loss=loss)
        raise FloatingPointError(message)


def _ready(entry: _Pending) -> bool:
    return all(leaf.is_ready() for leaf in jax.tree.leaves(entry.metrics))


def fit(
    step_fn: Callable[[Any, Any], Any],
    state: Any,
    loader: LoaderLike,
    *,
    config: TrainConfig,
) -> FitResult:
    """Trains `state` with `step_fn` on batches of `loader` until `config.num_steps`.

    Restores the newest checkpoint in ``config.out_dir/checkpoints`` (train state and loader
    position) when `config.resume` is set. The arrays of `state` are donated to the compiled
    step: use the returned `FitResult.state`, not the argument, afterwards.

    Returns normally when the steps are done, the loader ends, or SIGTERM/SIGINT arrived
    (after saving and waiting for the save). Raises `FloatingPointError` on a non-finite
    loss under ``on_nonfinite="stop"`` (after saving the last good state). Any exception
    is written, with its traceback, to the log files after every queued metric.
    """
    out_dir = Path(config.out_dir)
    logger = MetricsLogger(
        out_dir,
        process_index=jax.process_index(),
        console=sys.stderr if config.console else None,
        num_steps=config.num_steps,
    )
    ckpt_config = CheckpointConfig(out_dir / "checkpoints", max_to_keep=config.max_to_keep)
    with (
        logger,
        Checkpointer(ckpt_config) as checkpointer,
        _StopSignals(config.handle_signals) as stop,
    ):
        run = _Run(config, loader, logger, checkpointer)
        state = _resume(run, state)
        start = run.step
        try:
            status, state = _loop(
                run, _compile(step_fn, config.on_nonfinite == "skip"), state, stop
            )
        except BaseException as exc:
            _fetch_after_crash(run)
            logger.crash(exc, run.step)
            raise
        message = _report_end(run, status, start, stop.received)
        return FitResult(
            status=status,
            step=run.step,
            state=state,
            start_step=start,
            metrics=run.metrics,
            num_skipped=run.num_skipped,
            save_seconds=tuple(run.save_seconds),
            checkpoint_dir=checkpointer.directory,
            metrics_path=str(logger.path),
            message=message,
        )


def _report_end(run: _Run, status: Status, start: int, received: str | None) -> str:
    """Logs (and prints, with ``console``) why the run ended; returns that line."""
    where, step, num_steps = run.checkpointer.directory, run.step, run.config.num_steps
    if status == "preempted":
        message = (
            f"roxxel: preempted by {received} at step {step}; saved checkpoint "
            f"{step} in {where}; exiting cleanly"
        )
        run.logger.event("preempted", step, message, signal=received)
    elif status == "exhausted":
        message = (
            f"roxxel: the loader ran out of batches at step {step} of {num_steps}; saved "
            f"checkpoint {step} in {where} (a finite loader ends after its epochs: give it "
            "more, e.g. LoaderConfig(num_epochs=None), or ask for fewer num_steps)"
        )
        run.logger.event("exhausted", step, message, num_steps=num_steps)
    elif start >= num_steps:
        message = (
            f"roxxel: the run is already complete (checkpoint {start} in {where}, "
            f"num_steps={num_steps}); nothing to train: raise num_steps to train on"
        )
        run.logger.event("complete", step, message, num_steps=num_steps)
        found = last_metrics(run.logger.path) if run.logger.is_main else None
        run.metrics = found[1] if found is not None else {}
    else:
        message = f"roxxel: completed {num_steps} steps; saved checkpoint {step} in {where}"
    return message


def _unshare(state: Any) -> Any:
    """Copies leaves that occur twice: donating one buffer twice is an XLA error."""
    seen: set[int] = set()

    def once(leaf: Any) -> Any:
        if id(leaf) in seen:
            return jnp.array(leaf, copy=True)
        seen.add(id(leaf))
        return leaf

    return jax.tree.map(once, state)


def _resume(run: _Run, state: Any) -> Any:
    """Restores the newest intact checkpoint into `state` and the loader, or checks a fresh
    start; returns the state to train (leaves that occur twice copied)."""
    latest = run.checkpointer.latest_step()
    if latest is not None and not run.config.resume:
        raise StateError(
            f"fit: {run.checkpointer.directory} already holds checkpoints "
            f"({run.checkpointer.all_steps()}, expected none when resume=False)"
        )
    restored = run.checkpointer.restore_newest(state) if latest is not None else None
    if restored is not None:
        state = _apply(run, restored)
    run.loader_state = run.loader.state()
    found = run.loader_state.get("step")
    if restored is None and found != 0:
        raise StateError(
            f"fit: the loader is at step {found!r} but {run.checkpointer.directory} holds no "
            f"checkpoint to resume ({found!r}, expected 0: fit counts steps from 0 and pairs "
            "each checkpoint with the loader's step; start the loader at step 0)"
        )
    return _unshare(state)


def _apply(run: _Run, restored: Restored) -> Any:
    """Logs the damaged checkpoints passed over, positions the loader; returns the state."""
    for skipped in restored.skipped:
        message = (
            f"roxxel: skipped damaged checkpoint {skipped.step} ({skipped.reason}); "
            f"moved it to {skipped.moved_to}"
        )
        run.logger.event("skipped_checkpoint", skipped.step, message, reason=skipped.reason)
    _check_loader_step(run, restored, restored.loader_state.get("step"), "saved with")
    run.loader.restore(restored.loader_state)
    _check_loader_step(run, restored, run.loader.state().get("step"), "restored at")
    run.step = restored.step
    run.saved.add(restored.step)
    run.logger.event("restored", restored.step, f"roxxel: resumed from checkpoint {run.step}")
    return restored.state


def _check_loader_step(run: _Run, restored: Restored, found: object, how: str) -> None:
    """Refuses a checkpoint whose loader state is at another step than its train state."""
    exact = isinstance(found, int | np.integer) and not isinstance(found, bool)
    if exact and int(found) == restored.step:  # type: ignore[arg-type]
        return
    folder = os.path.join(run.checkpointer.directory, str(restored.step))
    raise StateError(
        f"fit: checkpoint {folder} pairs train step {restored.step} with a loader state "
        f"{how} another step ({found!r}, expected {restored.step}: resuming would train "
        "on other data under a wrong step count)",
        path=folder,
    )


def _loop(
    run: _Run, compiled: Callable[..., Any], state: Any, stop: _StopSignals
) -> tuple[Status, Any]:
    batches = iter(run.loader)
    try:
        status, state = _steps(run, compiled, state, batches, stop)
    finally:
        if batches is not run.loader and isinstance(batches, Generator):
            batches.close()  # a generator over the loader: stop its pipeline now
    run.save_current(state)
    run.checkpointer.wait()
    return status, state


def _steps(
    run: _Run, compiled: Callable[..., Any], state: Any, batches: Any, stop: _StopSignals
) -> tuple[Status, Any]:
    carry = (state, jnp.zeros((), dtype=bool))
    save_every = run.config.save_every
    while run.step < run.config.num_steps:
        if stop.requested(run.step):
            return "preempted", carry[0]
        try:
            with stop.batch_wait():
                batch = next(batches)
        except StopIteration:
            return "exhausted", carry[0]
        except _StopWaiting:  # no batch yet: the step before it is the one saved
            return "preempted", carry[0]
        carry, metrics = compiled(carry, batch)
        run.pending.append(_Pending(run.step, metrics, run.loader_state))
        run.step += 1
        run.loader_state = run.loader.state()
        run.fetch(force=False)
        if run.bad is not None:
            run.stop_nonfinite(carry[0])
        if save_every and run.step % save_every == 0:
            run.save_current(carry[0])
    return "completed", carry[0]


def _fetch_after_crash(run: _Run) -> None:
    """Logs the metrics still on the device, up to the first that cannot be fetched."""
    try:
        run.fetch(force=True)
    except Exception as exc:  # the original exception is the one raised
        run.logger.event("lost_metrics", run.step, error=repr(exc))
