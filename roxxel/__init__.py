"""roxxel: mmap-backed record shards and a zero-copy, deterministic data loader for JAX.

``import roxxel`` stays light: the format, reader and writer load eagerly; every name that
needs jax or orbax (and the higher layers) loads on first use through ``__getattr__``
(PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from roxxel.dataset import Dataset, open_dataset, write_manifest
from roxxel.dataset_writer import DatasetWriter
from roxxel.errors import ConfigError, FormatError, RoxxelError, StateError
from roxxel.reader import Corruption, Shard, open_shard
from roxxel.schema import Field, Ragged, Schema
from roxxel.version import __version__
from roxxel.writer import ShardInfo, ShardWriter, write_shard

if TYPE_CHECKING:  # the lazy names below, for type checkers and editors only
    from roxxel.device import batch_sharding
    from roxxel.loader import Loader, LoaderConfig
    from roxxel.mixture import Cap, Mixture, Phase
    from roxxel.order import KeyedPermutation
    from roxxel.views import Records, TokenWindows

# name -> module that defines it; loaded on first attribute access.
_LAZY = {
    "Loader": "roxxel.loader",
    "LoaderConfig": "roxxel.loader",
    "TokenWindows": "roxxel.views",
    "Records": "roxxel.views",
    "Mixture": "roxxel.mixture",
    "Phase": "roxxel.mixture",
    "Cap": "roxxel.mixture",
    "KeyedPermutation": "roxxel.order",
    "batch_sharding": "roxxel.device",
}
_SUBMODULES = ("train", "checkpoint", "cli", "device", "loader", "mixture", "order", "views")

__all__ = [  # Cap, KeyedPermutation, Loader, ... load on first use (see _LAZY)
    "Cap",
    "ConfigError",
    "Corruption",
    "Dataset",
    "DatasetWriter",
    "Field",
    "FormatError",
    "KeyedPermutation",
    "Loader",
    "LoaderConfig",
    "Mixture",
    "Phase",
    "Ragged",
    "Records",
    "RoxxelError",
    "Schema",
    "Shard",
    "ShardInfo",
    "ShardWriter",
    "StateError",
    "TokenWindows",
    "__version__",
    "batch_sharding",
    "open_dataset",
    "open_shard",
    "write_manifest",
    "write_shard",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"roxxel.{name}")
    raise AttributeError(f"module 'roxxel' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(__all__) | set(_SUBMODULES))
