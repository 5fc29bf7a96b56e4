"""Input readers for ``roxxel pack``: find inputs, cut them into work units, read records.

Formats: JSON Lines, plain text (a document per line or per file), ``.npy``/``.npz``,
Parquet, Arrow IPC/Feather, Hugging Face ``save_to_disk`` directories, Megatron
``.bin/.idx`` pairs. Each reader yields ``(record, key)``; ``locate(piece, key)`` names the
file and line or row for error messages. Planning is deterministic: the same inputs and
``unit_bytes`` give the same units, which is what lets a pack resume or split into tasks.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from roxxel.errors import ConfigError
from roxxel.ingest.arrow import (
    arrow_pieces,
    hf_files,
    parquet_pieces,
    read_arrow,
    read_arrow_blocks,
    read_parquet,
    read_parquet_blocks,
)
from roxxel.ingest.infer import infer_schema
from roxxel.ingest.megatron import idx_path, megatron_pieces, read_megatron, read_megatron_blocks
from roxxel.ingest.npy import npy_pieces, npz_pieces, read_npy, read_npy_blocks, read_npz
from roxxel.ingest.text import line_location, line_pieces, read_jsonl, read_text, read_text_file
from roxxel.ingest.units import (
    FORMATS,
    BadRecords,
    Block,
    Format,
    Piece,
    ReadOptions,
    Record,
    WorkUnit,
    group_pieces,
)

__all__ = [
    "FORMATS",
    "BadRecords",
    "Block",
    "Format",
    "Input",
    "Piece",
    "ReadOptions",
    "Record",
    "WorkUnit",
    "cut_units",
    "detect_format",
    "expand_inputs",
    "infer_schema",
    "locate",
    "read_unit",
    "read_unit_blocks",
]

EXTENSIONS: dict[str, Format] = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".txt": "text",
    ".npy": "npy",
    ".npz": "npz",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
    ".bin": "megatron",
    ".idx": "megatron",
}

Reader = Callable[[Piece, ReadOptions, BadRecords], Iterator[tuple[Record, int]]]
READERS: dict[str, Reader] = {
    "jsonl": read_jsonl,
    "text": read_text,
    "text-file": read_text_file,
    "npy": read_npy,
    "npz": read_npz,
    "parquet": read_parquet,
    "arrow": read_arrow,
    "megatron": read_megatron,
}

BLOCK_READERS: dict[str, Callable[[Piece, ReadOptions], Iterator[Block]]] = {
    "npy": read_npy_blocks,
    "megatron": read_megatron_blocks,
    "parquet": read_parquet_blocks,
    "arrow": read_arrow_blocks,
}


@dataclass(frozen=True, slots=True)
class Input:
    """One input file and its format (an HF directory expands to its Arrow files)."""

    path: str
    format: Format


def detect_format(path: str) -> Format:
    """The format of a file from its extension.

    >>> detect_format("corpus/part-0.jsonl")
    'jsonl'
    """
    ext = os.path.splitext(path)[1].lower()
    if ext not in EXTENSIONS:
        raise ConfigError(
            f"{path}: unknown input extension {ext!r} (expected one of "
            f"{sorted(EXTENSIONS)}, or pass --format)"
        )
    return EXTENSIONS[ext]


def _is_hf_dir(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, n)) for n in ("state.json", "dataset_dict.json"))


def _walk(directory: str, fmt: Format | None) -> list[str]:
    found: list[str] = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if name.startswith("."):
                continue
            if fmt is not None or os.path.splitext(name)[1].lower() in EXTENSIONS:
                found.append(os.path.join(root, name))
    return found


def _expand_one(arg: str, fmt: Format | None) -> list[Input]:
    if os.path.isdir(arg):
        if fmt == "hf" or (fmt is None and _is_hf_dir(arg)):
            return [Input(f, "arrow") for f in hf_files(arg)]
        return [i for f in _walk(arg, fmt) for i in _expand_one(f, fmt)]
    if not os.path.exists(arg):
        if glob.has_magic(arg):
            matches = sorted(glob.glob(arg, recursive=True))
            if not matches:
                raise ConfigError(f"{arg}: glob matches nothing (expected at least one input)")
            return [i for m in matches for i in _expand_one(m, fmt)]
        raise ConfigError(f"{arg}: no such file or directory (expected an input path or glob)")
    chosen: Format = "arrow" if fmt == "hf" else fmt or detect_format(arg)
    if chosen == "megatron":
        bin_path = arg[: -len(".idx")] + ".bin" if arg.endswith(".idx") else arg
        for p in (bin_path, idx_path(bin_path)):
            if not os.path.isfile(p):
                raise ConfigError(f"{p}: missing (expected a Megatron .bin/.idx pair)")
        return [Input(bin_path, "megatron")]
    return [Input(arg, chosen)]


def expand_inputs(args: list[str], fmt: Format | None = None) -> list[Input]:
    """Resolve files, directories (walked in sorted order) and globs to inputs.

    Duplicates keep their first place. Raises ConfigError for a missing path, an empty
    glob, an unknown extension (without ``fmt``), or when nothing is found.
    """
    if fmt is not None and fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r} (expected one of {list(FORMATS)})")
    seen: dict[Input, None] = {}
    for arg in args:
        for item in _expand_one(arg, fmt):
            seen.setdefault(item, None)
    if not seen:
        raise ConfigError(f"inputs {args}: no input files found (expected known extensions)")
    return list(seen)


_PIECES: dict[str, Callable[[str, int], list[Piece]]] = {
    "jsonl": lambda p, u: line_pieces(p, "jsonl", u),
    "text": lambda p, u: line_pieces(p, "text", u),
    "text-file": lambda p, u: [Piece(p, "text-file", 0, 1, os.path.getsize(p))],
    "npy": npy_pieces,
    "npz": npz_pieces,
    "parquet": parquet_pieces,
    "arrow": arrow_pieces,
    "megatron": megatron_pieces,
}


def cut_units(inputs: list[Input], unit_bytes: int) -> list[WorkUnit]:
    """Cut inputs into work units of about ``unit_bytes`` input bytes, in input order."""
    if unit_bytes <= 0:
        raise ConfigError(f"unit bytes {unit_bytes} (expected > 0)")
    pieces = [p for i in inputs for p in _PIECES[i.format](i.path, unit_bytes)]
    return group_pieces(pieces, unit_bytes)


def read_unit(
    unit: WorkUnit, opts: ReadOptions, bad: BadRecords
) -> Iterator[tuple[Record, Piece, int]]:
    """Every record of a unit in order, with its piece and key (see ``locate``)."""
    for piece in unit.pieces:
        for record, key in READERS[piece.format](piece, opts, bad):
            yield record, piece, key


def read_unit_blocks(unit: WorkUnit, opts: ReadOptions) -> Iterator[Block] | None:
    """A unit's records as `Block` s, when every piece's format has a block reader."""
    if not all(p.format in BLOCK_READERS for p in unit.pieces):
        return None
    return (block for p in unit.pieces for block in BLOCK_READERS[p.format](p, opts))


def locate(piece: Piece, key: int) -> str:
    """Where a record came from, for messages: ``file:line``, ``file: row N``, ...

    Line numbers cost a scan of the file up to the line: call this only on error.
    """
    if piece.format in ("jsonl", "text"):
        return line_location(piece.path, key)
    if piece.format == "text-file":
        return piece.path
    if piece.format == "megatron":
        return f"{piece.path}: sequence {key}"
    return f"{piece.path}: row {key}"
