"""roxxel: mmap-backed record shards and a zero-copy, deterministic data loader for JAX.

``import roxxel`` stays light: the format, reader and writer load eagerly; every name that
needs jax or orbax (and the higher layers) loads on first use through ``__getattr__``
(PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from roxxel.errors import ConfigError, FormatError, RoxxelError, StateError
from roxxel.format.dataset import Dataset, open_dataset
from roxxel.format.dataset_writer import DatasetWriter, write_manifest
from roxxel.format.reader import Corruption, Shard, open_shard
from roxxel.format.schema import Field, Ragged, Schema
from roxxel.format.writer import ShardInfo, ShardWriter, write_shard
from roxxel.version import __version__

if TYPE_CHECKING:  # the lazy names below, for type checkers and editors only
    from roxxel.cli.pack import pack
    from roxxel.loader.loader import Loader, LoaderConfig
    from roxxel.loader.placement import batch_sharding
    from roxxel.sampling.mixture import Cap, Mixture, Phase
    from roxxel.sampling.order import KeyedPermutation
    from roxxel.sources.records import Records
    from roxxel.sources.windows import TokenWindows

# name -> module that defines it; loaded on first attribute access.
_LAZY = {
    "Loader": "roxxel.loader.loader",
    "LoaderConfig": "roxxel.loader.loader",
    "TokenWindows": "roxxel.sources.windows",
    "Records": "roxxel.sources.records",
    "Mixture": "roxxel.sampling.mixture",
    "Phase": "roxxel.sampling.mixture",
    "Cap": "roxxel.sampling.mixture",
    "KeyedPermutation": "roxxel.sampling.order",
    "batch_sharding": "roxxel.loader.placement",
    "pack": "roxxel.cli.pack",
}
# Packages, and the module names 0.1 had at the top level (kept as attributes, loaded on use).
_SUBMODULES = {
    "cli": "roxxel.cli",
    "format": "roxxel.format",
    "ingest": "roxxel.ingest",
    "loader": "roxxel.loader",
    "sampling": "roxxel.sampling",
    "sources": "roxxel.sources",
    "train": "roxxel.train",
    "checkpoint": "roxxel.train.checkpoint",
    "device": "roxxel.loader.placement",
    "mixture": "roxxel.sampling.mixture",
    "order": "roxxel.sampling.order",
    "views": "roxxel.sources.records",
}

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
    "pack",
    "write_manifest",
    "write_shard",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(_SUBMODULES[name])
    raise AttributeError(f"module 'roxxel' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(__all__) | set(_SUBMODULES))
