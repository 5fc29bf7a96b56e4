"""Checkpoints of a train state and a loader state, saved together with Orbax.

The only module of roxxel that imports orbax. One checkpoint is one step directory holding
two items written by one asynchronous save: ``state`` (any pytree of arrays, Orbax
``StandardSave``) and ``loader`` (the loader's small JSON state, ``JsonSave``). Because they
are committed together, a restored run continues reading at exactly the step its weights
were saved at.

Orbax writes into a temporary directory and renames it when complete, so a process killed
mid-save leaves the previous checkpoint as the latest; half-written directories are ignored.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import orbax.checkpoint as ocp

from roxxel.errors import ConfigError, StateError

__all__ = ["CheckpointConfig", "Checkpointer", "Restored"]


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


@dataclass(frozen=True, slots=True)
class Restored:
    """A checkpoint read back: the step it was saved at, the train state, the loader state."""

    step: int
    state: Any
    loader_state: dict[str, Any]


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
            item_names=("state", "loader"),
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
        state works; its values are not read). Raises `StateError` when there is no
        checkpoint or its structure does not match `like`.
        """
        step = self.latest_step() if step is None else step
        if step is None or step not in self._manager.all_steps():
            raise StateError(
                f"Checkpointer.restore: no checkpoint to restore in {self.directory} "
                f"(step {step}, expected one of {self.all_steps()})"
            )
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(target), loader=ocp.args.JsonRestore()
        )
        try:
            items = self._manager.restore(step, args=args)
        except (ValueError, KeyError) as exc:
            raise StateError(
                f"Checkpointer.restore: checkpoint {step} in {self.directory} does not fit "
                f"the given state ({exc}, expected the same pytree structure and shapes)"
            ) from exc
        return Restored(step=step, state=items["state"], loader_state=dict(items["loader"]))

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
