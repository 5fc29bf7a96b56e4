"""The input kinds ``roxxel pack`` reads, in one table.

Each kind's module declares an `InputKind` (its name, extensions, how a file splits into
work units, its record and block readers); adding a kind is that module and one line in
`KINDS`. Everything else (``--format`` choices, extension detection, directory inputs,
readers, locations) is looked up here, at call time.
"""

from __future__ import annotations

import os

from roxxel.errors import ConfigError
from roxxel.ingest.arrow import ARROW, HF, PARQUET
from roxxel.ingest.images import IMAGE
from roxxel.ingest.megatron import MEGATRON
from roxxel.ingest.npy import NPY, NPZ
from roxxel.ingest.text import JSONL, TEXT, TEXT_FILE
from roxxel.ingest.units import InputKind

__all__ = [
    "KINDS",
    "directory_kind",
    "get_kind",
    "kind_names",
    "kind_of_path",
    "known_extensions",
]

KINDS: dict[str, InputKind] = {
    kind.name: kind
    for kind in (
        JSONL,
        TEXT,
        TEXT_FILE,
        NPY,
        NPZ,
        PARQUET,
        ARROW,
        HF,
        MEGATRON,
        IMAGE,
    )
}


def kind_names() -> tuple[str, ...]:
    """The registered kinds' names, in table order (the ``--format`` choices)."""
    return tuple(KINDS)


def get_kind(name: str) -> InputKind:
    """The kind called ``name``; raises ConfigError for an unknown name."""
    if name not in KINDS:
        raise ConfigError(f"--format {name!r}: unknown input kind (expected one of {list(KINDS)})")
    return KINDS[name]


def _extensions() -> dict[str, InputKind]:
    return {ext: kind for kind in KINDS.values() for ext in kind.extensions}


def kind_of_path(path: str) -> InputKind | None:
    """The kind whose extension ends ``path`` (case-insensitive), or None.

    >>> kind_of_path("corpus/part-0.JSONL").name
    'jsonl'
    """
    ext = os.path.splitext(path)[1].lower()
    return _extensions().get(ext)


def known_extensions() -> list[str]:
    """Every registered extension, sorted (for messages)."""
    return sorted(_extensions())


def directory_kind(path: str) -> InputKind | None:
    """The kind that claims a directory as one input (an HF dataset), or None."""
    for kind in KINDS.values():
        if kind.claims_directory is not None and kind.claims_directory(path):
            return kind
    return None
