"""The thin training loop (``loop``), Orbax checkpoints of model and loader state (``checkpoint``),
and crash-safe metrics (``metrics``): the only part of roxxel that imports orbax."""

from __future__ import annotations

from roxxel.train.loop import FitResult, LoaderLike, TrainConfig, fit, split_step_output

__all__ = ["FitResult", "LoaderLike", "TrainConfig", "fit", "split_step_output"]
