"""Checkpoints of a train state and a loader state, saved together with Orbax.

The only module of roxxel that imports orbax. One checkpoint is one step directory holding
two items written by one asynchronous save: ``state`` (any pytree of arrays, Orbax
``StandardSave``) and ``loader`` (the loader's small JSON state, ``JsonSave``). Because they
are committed together, a restored run continues reading at exactly the step its weights
were saved at.

Orbax writes into a temporary directory and renames it when complete, so a process killed
mid-save leaves the previous checkpoint as the latest; half-written directories are ignored.
A committed checkpoint damaged later (a file cut short, a folder emptied) is refused with
`DamagedCheckpointError`; `Checkpointer.restore_newest` then falls back to the newest one that
restores and sets the damaged ones aside as ``<step>.damaged`` (kept for inspection, no longer
a step, so the run can save that step again).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from roxxel.errors import ConfigError, StateError

__all__ = [
    "CheckpointConfig",
    "Checkpointer",
    "DamagedCheckpointError",
    "Restored",
    "Skipped",
]


@dataclass(frozen=True, slots=True)
class CheckpointConfig:
    """Where and how checkpoints are kept.

    Attributes:
        directory: folder holding one sub-folder per saved step (created when missing).
        max_to_keep: the newest checkpoints kept; older ones are deleted (None keeps all).
        async_save: write in a background thread; `save` then blocks only for the
            device-to-host copy.
    """

    directory: str | os.PathLike[str]
    max_to_keep: int | None = 3
    async_save: bool = True

    def __post_init__(self) -> None:
        if self.max_to_keep is not None and self.max_to_keep < 1:
            raise ConfigError(
                f"CheckpointConfig: max_to_keep is too small ({self.max_to_keep}, "
                "expected None or an integer >= 1)"
            )


class DamagedCheckpointError(StateError):
    """A checkpoint on disk cannot be read back: a file is cut short, missing or corrupt.

    ``path`` is the step folder (or the checkpoint folder when every step is damaged).
    """


@dataclass(frozen=True, slots=True)
class Skipped:
    """A damaged checkpoint that `Checkpointer.restore_newest` passed over.

    Attributes:
        step: its step.
        reason: why it did not restore (one line).
        moved_to: where it was set aside.
    """

    step: int
    reason: str
    moved_to: str


@dataclass(frozen=True, slots=True)
class Restored:
    """A checkpoint read back: the step it was saved at, the train state, the loader state."""

    step: int
    state: Any
    loader_state: dict[str, Any]
    skipped: tuple[Skipped, ...] = ()


class Checkpointer:
    """Saves and restores (train state, loader state) pairs with an Orbax CheckpointManager.

    Thread-safety: use from the training thread only. Every process of a multi-host run must
    make the same calls (Orbax synchronizes them). A context manager: leaving it waits for
    the save in flight and releases Orbax's threads.
    """

    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config
        self._closed = False
        options = ocp.CheckpointManagerOptions(
            max_to_keep=config.max_to_keep,
            enable_async_checkpointing=config.async_save,
            create=True,
            cleanup_tmp_directories=True,
        )
        self._manager = ocp.CheckpointManager(
            os.fspath(os.path.abspath(config.directory)),
            options=options,
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "loader": ocp.JsonCheckpointHandler(),
            },
        )

    @property
    def directory(self) -> str:
        """The absolute path of the checkpoint folder."""
        return os.fspath(self._manager.directory)

    def all_steps(self) -> list[int]:
        """The steps with a complete checkpoint on disk, oldest first."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest step with a complete checkpoint, or None when there is none."""
        return self._manager.latest_step()

    def save(self, step: int, state: Any, loader_state: Mapping[str, Any]) -> float:
        """Starts saving `state` and `loader_state` as the checkpoint of `step`.

        Returns once the arrays are copied off the device (and any earlier save has
        finished); the files are written in the background. Returns the seconds this call
        blocked. Raises `StateError` if `step` already has a checkpoint.
        """
        if step in self._manager.all_steps():
            raise StateError(
                f"Checkpointer.save: step {step} already has a checkpoint in "
                f"{self.directory} (found it on disk, expected a new step)"
            )
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            loader=ocp.args.JsonSave(dict(loader_state)),
        )
        start = time.perf_counter()
        self._manager.save(step, args=args, force=True)
        return time.perf_counter() - start

    def restore(self, like: Any, step: int | None = None) -> Restored:
        """Reads the checkpoint of `step` (default: the latest) into the structure of `like`.

        `like` is a pytree with the shapes, dtypes and shardings wanted (the initial train
        state works; its values are not read). A leaf that is an uncommitted `jax.Array`
        (made without a device or sharding, e.g. ``jnp.zeros``) comes back uncommitted too,
        so the compiled step may place it as it did in the run that saved it; a numpy leaf
        comes back as numpy. Raises `StateError` when there is no such checkpoint or its
        structure does not match `like`, and `DamagedCheckpointError` when its files
        cannot be read back.
        """
        step = self.latest_step() if step is None else step
        if step is None or step not in self._manager.all_steps():
            raise StateError(
                f"Checkpointer.restore: no checkpoint to restore in {self.directory} "
                f"(step {step}, expected one of {self.all_steps()})",
                path=self.directory,
            )
        loader_state = self._restore_loader(step)
        self._check_fits(like, step, self._state_metadata(step))
        state = self._restore_state(like, step)
        return Restored(step=step, state=state, loader_state=loader_state)

    def restore_newest(self, like: Any) -> Restored | None:
        """Restores the newest checkpoint that is not damaged, or None when there is none.

        Damaged newer checkpoints are renamed to ``<step>.damaged`` (by process 0; every
        process must call this together) and listed in `Restored.skipped`. Raises
        `DamagedCheckpointError` naming the folder when every checkpoint is damaged (then
        nothing is renamed), and `StateError` when one does not fit `like`.
        """
        damaged: list[tuple[int, DamagedCheckpointError]] = []
        for step in reversed(self.all_steps()):
            try:
                restored = self.restore(like, step)
            except DamagedCheckpointError as exc:
                damaged.append((step, exc))
                continue
            skipped = tuple(Skipped(s, str(exc), self._set_aside(s)) for s, exc in damaged)
            if skipped:
                self._manager.reload()
            return Restored(restored.step, restored.state, restored.loader_state, skipped)
        if damaged:
            reasons = "; ".join(str(exc) for _, exc in damaged)
            raise DamagedCheckpointError(
                f"Checkpointer.restore_newest: every checkpoint in {self.directory} is damaged "
                f"({reasons}, expected at least one that restores; move the damaged step "
                "folders away to start over)",
                path=self.directory,
            )
        return None

    def _step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def _damaged(self, step: int, what: str, exc: BaseException) -> DamagedCheckpointError:
        # Orbax's TensorStore errors run to 60 lines: keep their first sentence.
        first = str(exc).split("See full TensorStore details")[0].strip().splitlines()
        detail = f"{type(exc).__name__}: {first[0] if first else ''}".rstrip(": ")
        return DamagedCheckpointError(
            f"Checkpointer.restore: checkpoint {step} in {self.directory} is damaged "
            f"({what}: {detail}, expected a complete checkpoint as fit saved it)",
            path=self._step_dir(step),
        )

    def _restore_loader(self, step: int) -> dict[str, Any]:
        try:
            items = self._manager.restore(
                step, args=ocp.args.Composite(loader=ocp.args.JsonRestore())
            )
            loader_state = items["loader"]
        except Exception as exc:  # any failure to read a committed file is damage
            raise self._damaged(step, "its loader state does not read", exc) from exc
        if not isinstance(loader_state, Mapping):
            found = type(loader_state).__name__
            raise self._damaged(step, "its loader state is not a JSON object", TypeError(found))
        return dict(loader_state)

    def _state_metadata(self, step: int) -> Any:
        """The saved tree of array metadata (shapes, dtypes) of the state item."""
        try:
            metadata = self._manager.item_metadata(step)["state"]
        except Exception as exc:  # any failure to read a committed file is damage
            raise self._damaged(step, "its state metadata does not read", exc) from exc
        if metadata is None:
            error = FileNotFoundError(f"no state metadata in {self._step_dir(step)}")
            raise self._damaged(step, "its state folder is empty", error)
        return metadata.tree

    def _check_fits(self, like: Any, step: int, saved: Any) -> None:
        """Compares leaf count and shapes: what the metadata (read intact) can tell apart.

        Decided here rather than from Orbax's exception, since a cut array file and a
        mismatch both raise `ValueError` from inside the restore.
        """
        found = sorted(_saved_shape(leaf) for leaf in jax.tree.leaves(saved))
        wanted = sorted(tuple(np.shape(leaf)) for leaf in jax.tree.leaves(like))
        if found != wanted:
            raise StateError(
                f"Checkpointer.restore: checkpoint {step} in {self.directory} does not fit "
                f"the given state (saved leaf shapes {found}, expected the given state's "
                f"{wanted}: the same pytree structure and shapes)",
                path=self._step_dir(step),
            )

    def _restore_state(self, like: Any, step: int) -> Any:
        target = jax.tree.map(_restore_target, like)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(target))
        try:
            state = self._manager.restore(step, args=args)["state"]
        except Exception as exc:  # its metadata read and fit: the array files are at fault
            raise self._damaged(step, "its arrays do not read", exc) from exc
        return _uncommit_like(like, state)

    def _set_aside(self, step: int) -> str:
        """Renames a damaged step folder so that it is no longer a step; returns the new path."""
        source = self._step_dir(step)
        target, n = f"{source}.damaged", 1
        while os.path.exists(target):
            n += 1
            target = f"{source}.damaged-{n}"
        if jax.process_index() == 0:
            os.rename(source, target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"roxxel-set-aside-{step}")
        return target

    def wait(self) -> None:
        """Blocks until the save in flight (if any) is complete on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for the save in flight, then releases Orbax's threads. Idempotent."""
        if not self._closed:
            self._closed = True
            self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _saved_shape(leaf: Any) -> tuple[int, ...]:
    """The shape Orbax's metadata records for a leaf (() for a scalar or a string)."""
    if isinstance(leaf, ocp.metadata.ArrayMetadata):
        return tuple(leaf.shape)
    return ()


def _restore_target(leaf: Any) -> Any:
    """What Orbax restores a leaf of `like` into: host numpy for uncommitted or numpy leaves."""
    if isinstance(leaf, jax.Array) and leaf.committed:
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
    if isinstance(leaf, jax.Array | np.ndarray):
        return np.empty(leaf.shape, leaf.dtype)  # not written: only its type, shape, dtype
    return ocp.utils.to_shape_dtype_struct(leaf)


def _uncommit_like(like: Any, state: Any) -> Any:
    """`state` with each leaf whose `like` leaf is uncommitted made uncommitted too.

    An uncommitted array (what ``jnp.zeros`` makes) may be moved by the compiled step to the
    devices of the batch; a committed one may not. Restoring it committed to one device
    breaks a step that runs on a mesh (the first run worked because it was uncommitted).
    """
    like_leaves = jax.tree.leaves(like)
    if not any(isinstance(x, jax.Array) and not x.committed for x in like_leaves):
        return state
    leaves, treedef = jax.tree.flatten(state)
    placed = [
        jax.numpy.asarray(value) if isinstance(x, jax.Array) and not x.committed else value
        for x, value in zip(like_leaves, leaves, strict=True)
    ]
    return jax.tree.unflatten(treedef, placed)
