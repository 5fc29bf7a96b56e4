"""Work units for packing: which input bytes or rows one pack job reads.

An input file is cut into pieces (a byte range of a line file, a row range of an array file,
a range of row groups of a Parquet file, ...); consecutive pieces are grouped into work
units of about ``unit_bytes`` input bytes. The cut depends only on the inputs and
``unit_bytes``, so a rerun with the same arguments gives the same units in the same order:
that is what makes a pack resumable and splittable across tasks.
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from roxxel.errors import ConfigError

__all__ = [
    "BLOCK_BYTES",
    "MAX_BAD_KEPT",
    "BadRecords",
    "Block",
    "Input",
    "InputKind",
    "Piece",
    "RangeReader",
    "ReadOptions",
    "Record",
    "WorkUnit",
    "group_pieces",
    "not_a_regular_file",
    "row_location",
    "row_pieces",
    "special_file_kind",
]

Record = dict[str, Any]
MAX_BAD_KEPT = 5
BLOCK_BYTES = 8 << 20  # input bytes per Block an array reader yields


@dataclass(frozen=True, slots=True)
class Piece:
    """A half-open range [start, stop) of one input file.

    ``kind`` names the input kind (see `InputKind`). The unit of ``start``/``stop``
    depends on the kind: bytes for jsonl/text (a line
    belongs to the piece whose range holds its first byte), rows for npy/npz/arrow-stream/hf,
    row groups for parquet, record batches for arrow files, sequences for megatron;
    text-file pieces are whole files (0, 1).
    """

    path: str
    kind: str
    start: int
    stop: int
    num_bytes: int

    def describe(self) -> str:
        return f"{self.path}[{self.start}:{self.stop}]"


@dataclass(frozen=True, slots=True)
class Block:
    """Consecutive records of one piece of an array input, as whole columns.

    ``num`` records, whose ``columns[name]`` holds the values back to back: one row per
    record, or for a variable-length value ``lengths[name][i]`` rows for record i (a table
    input read for columns it does not have gives a block of none). A column the input cannot
    give as one array (strings, say) is a list with one value per record. ``first`` is the key (row,
    sequence) of the first record. A packer writes a block with one call where a record
    at a time would cost a Python loop per record. A reader may reuse a block's memory for
    its next block: use each block up before asking for the next.
    """

    piece: Piece
    first: int
    num: int
    columns: dict[str, Any]
    lengths: dict[str, np.ndarray] = field(default_factory=dict)

    def take(self, start: int, stop: int) -> Block:
        """Records [start, stop) of this block (views, no copy)."""
        columns = {}
        for name, values in self.columns.items():
            if name in self.lengths:
                skip = int(self.lengths[name][:start].sum())
                columns[name] = values[skip : skip + int(self.lengths[name][start:stop].sum())]
            else:
                columns[name] = values[start:stop]
        lengths = {name: n[start:stop] for name, n in self.lengths.items()}
        return Block(self.piece, self.first + start, stop - start, columns, lengths)

    def records(self) -> Iterator[tuple[Record, int]]:
        """Each record as ``{field: value}`` with its key, as a record reader yields them."""
        ends = {name: np.cumsum(n).tolist() for name, n in self.lengths.items()}
        for i in range(self.num):
            record = {}
            for name, values in self.columns.items():
                if name in ends:
                    stop = ends[name][i]
                    record[name] = values[stop - int(self.lengths[name][i]) : stop]
                else:
                    record[name] = values[i]
            yield record, self.first + i


class RangeReader:
    """Reads byte ranges of one file into one reused buffer, as arrays.

    For array inputs read a block at a time: one ``readinto`` per block costs about half
    of touching the same bytes through a memory map, page fault by page fault. Each array
    returned is valid until the next `read`. A context manager.
    """

    def __init__(self, path: str):
        self.path = path
        self.file = open(path, "rb", buffering=0)  # noqa: SIM115 (closed by close/__exit__)
        self.buffer = np.empty(0, np.uint8)

    def read(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        count = dtype.itemsize * math.prod(shape)
        if self.buffer.nbytes < count:
            self.buffer = np.empty(count, np.uint8)
        view = self.buffer[:count].data
        self.file.seek(offset)
        done = 0
        while done < count:
            got = self.file.readinto(view[done:])
            if not got:
                raise ConfigError(
                    f"{self.path}: offset {offset + done}: file ends (expected {count} bytes "
                    f"from offset {offset}: the input changed since planning)"
                )
            done += got
        return self.buffer[:count].view(dtype).reshape(shape)

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class WorkUnit:
    """Consecutive pieces read by one pack job; ``index`` is its place in the plan."""

    index: int
    pieces: tuple[Piece, ...]

    @property
    def num_bytes(self) -> int:
        return sum(p.num_bytes for p in self.pieces)

    def describe(self) -> str:
        return ";".join(p.describe() for p in self.pieces)

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "pieces": [self._piece_json(p) for p in self.pieces]}

    @staticmethod
    def _piece_json(p: Piece) -> list[Any]:
        return [p.path, p.kind, p.start, p.stop, p.num_bytes]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WorkUnit:
        pieces = tuple(Piece(str(a), b, int(c), int(d), int(e)) for a, b, c, d, e in data["pieces"])
        return cls(int(data["index"]), pieces)


@dataclass(frozen=True, slots=True)
class ReadOptions:
    """How readers turn input into records.

    Attributes:
        field: field name for input kinds whose records have one unnamed value (npy rows, text
            lines or files, megatron sequences); None means the kind's default.
        skip_bad: skip malformed records (counted in ``BadRecords``) instead of raising.
        columns: the only columns a table input (Parquet, Arrow, HF) is read for, so nulls
            and types of the others do not matter; None: every column.
    """

    field: str | None = None
    skip_bad: bool = False
    columns: tuple[str, ...] | None = None

    def field_for(self, default: str) -> str:
        return self.field or default


@dataclass(slots=True)
class BadRecords:
    """Count of skipped records and the locations and reasons of the first few."""

    count: int = 0
    first: list[str] = field(default_factory=list)

    def add(self, message: str) -> None:
        self.count += 1
        if len(self.first) < MAX_BAD_KEPT:
            self.first.append(message)

    def merge(self, other: BadRecords) -> None:
        self.count += other.count
        self.first.extend(other.first[: MAX_BAD_KEPT - len(self.first)])


RecordReader = Callable[[Piece, ReadOptions, BadRecords], Iterator[tuple[Record, int]]]
BlockReader = Callable[[Piece, ReadOptions, BadRecords], Iterator[Block]]


@dataclass(frozen=True, slots=True)
class Input:
    """One input file and its input kind (an HF directory expands to its Arrow files)."""

    path: str
    kind: str


def row_location(piece: Piece, key: int) -> str:
    """``"path: row N"``: where a record of a row-addressed input came from."""
    return f"{piece.path}: row {key}"


@dataclass(frozen=True, slots=True)
class InputKind:
    """One kind of input file ``roxxel pack`` reads (JSON Lines, Parquet, ...): what a kind's
    module declares and `roxxel.ingest.registry` lists.

    Attributes:
        name: the ``--format`` value and `Piece.kind`.
        extensions: lower-case file name endings (``".jsonl"``) that select this kind.
        cut: ``(path, unit_bytes) -> pieces``: how a file splits into work units.
        read: ``(piece, opts, bad) -> (record, key)...``: the record reader.
        read_blocks: ``(piece, opts, bad) -> blocks``, for array inputs; None: records only.
        locate: ``(piece, key) -> str``: where a record came from, for messages.
        resolve: ``path -> inputs``: what a named path (or a claimed directory) stands for
            (a Megatron ``.idx`` for its ``.bin``, an HF directory for its Arrow files);
            None: the path itself, of this kind.
        claims_directory: ``directory -> bool``: whether a directory is one input of this
            kind (an HF ``save_to_disk`` directory) rather than a folder to walk.
        fixed_arrays: records are rows of one array, so equal shapes are fixed shapes.
        schema: ``path -> {name: spec}`` read from the file's own metadata (exact types),
            or None when records must be sampled.
    """

    name: str
    extensions: tuple[str, ...]
    cut: Callable[[str, int], list[Piece]]
    read: RecordReader
    read_blocks: BlockReader | None = None
    locate: Callable[[Piece, int], str] = row_location
    resolve: Callable[[str], list[Input]] | None = None
    claims_directory: Callable[[str], bool] | None = None
    fixed_arrays: bool = False
    schema: Callable[[str], dict[str, str] | None] | None = None

    def inputs(self, path: str) -> list[Input]:
        """The inputs a path of this kind stands for."""
        return self.resolve(path) if self.resolve is not None else [Input(path, self.name)]


def row_pieces(path: str, kind: str, num_rows: int, unit_bytes: int) -> list[Piece]:
    """Cut ``num_rows`` rows of one file into pieces of about ``unit_bytes`` file bytes."""
    size = os.path.getsize(path)
    if num_rows == 0:
        return []
    per_row = max(size / num_rows, 1.0)
    rows = max(1, math.floor(unit_bytes / per_row)) if unit_bytes > 0 else 1
    return [
        Piece(
            path, kind, s, min(s + rows, num_rows), round(per_row * (min(s + rows, num_rows) - s))
        )
        for s in range(0, num_rows, rows)
    ]


def group_pieces(pieces: list[Piece], unit_bytes: int) -> list[WorkUnit]:
    """Group consecutive pieces into units of at most ``unit_bytes`` (one piece at least)."""
    units: list[WorkUnit] = []
    current: list[Piece] = []
    size = 0
    for piece in pieces:
        if current and size + piece.num_bytes > unit_bytes:
            units.append(WorkUnit(len(units), tuple(current)))
            current, size = [], 0
        current.append(piece)
        size += piece.num_bytes
    if current:
        units.append(WorkUnit(len(units), tuple(current)))
    return units


def check_range(piece: Piece, total: int, what: str) -> None:
    """Raise ConfigError when a piece's range is outside [0, total) (input changed)."""
    if not 0 <= piece.start <= piece.stop <= total:
        raise ConfigError(
            f"{piece.path}: {what} range [{piece.start}, {piece.stop}) out of bounds "
            f"({total} {what}s, expected the input unchanged since planning)"
        )


_SPECIAL_FILES = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def special_file_kind(mode: int) -> str:
    """What a file of ``mode`` (``st_mode``) that is not a regular file is, for messages.

    >>> special_file_kind(stat.S_IFIFO)
    'a FIFO'
    """
    return next((what for test, what in _SPECIAL_FILES if test(mode)), "not a regular file")


def not_a_regular_file(path: str) -> str | None:
    """What ``path`` is (`special_file_kind`: ``'a FIFO'``, ``'a directory'``) when, links
    followed, it is there but is no regular file; None for a regular file, or a path that
    does not stat (its ``open`` says why). Check before opening a file whose name a user
    gives: ``open`` of a FIFO waits for a writer, forever."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    return None if stat.S_ISREG(mode) else special_file_kind(mode)
