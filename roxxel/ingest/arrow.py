"""Arrow-family inputs: Parquet, Arrow IPC / Feather files and streams, HF ``save_to_disk``.

pyarrow is an optional extra, imported only when one of these readers runs. A Parquet piece
is a range of row groups and an Arrow IPC file piece a range of record batches; an Arrow
stream (what ``datasets.Dataset.save_to_disk`` writes) is one piece. A Hugging Face dataset
directory is read from its ``state.json`` and Arrow files alone, without ``datasets``.
Nulls are refused (a null would otherwise become NaN or a missing value silently).
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numpy as np

from roxxel.errors import ConfigError
from roxxel.ingest.units import (
    BadRecords,
    Block,
    Piece,
    ReadOptions,
    Record,
    check_range,
    row_pieces,
)

__all__ = [
    "arrow_pieces",
    "hf_files",
    "parquet_pieces",
    "read_arrow",
    "read_arrow_blocks",
    "read_parquet",
    "read_parquet_blocks",
]


def _pyarrow() -> ModuleType:
    try:
        import pyarrow  # optional extra: only these readers need it
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise ConfigError(
            "pyarrow is not installed (needed for parquet/arrow/hf inputs: pip install roxxel[arrow])"
        ) from None
    return pyarrow


def parquet_pieces(path: str, unit_bytes: int) -> list[Piece]:
    """Ranges of row groups of about ``unit_bytes`` file bytes."""
    pa = _pyarrow()
    try:
        num_groups = pa.parquet.ParquetFile(path).metadata.num_row_groups
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"{path}: not a readable Parquet file ({e})") from None
    return row_pieces(path, "parquet", num_groups, unit_bytes)


def read_parquet(piece: Piece, opts: ReadOptions, bad: BadRecords) -> Iterator[tuple[Record, int]]:
    """Yield one record per row of the piece's row groups, with the row number in the file."""
    del bad
    for block in read_parquet_blocks(piece, opts):
        yield from block.records()


def read_parquet_blocks(piece: Piece, opts: ReadOptions) -> Iterator[Block]:
    """The rows of `read_parquet` as one `Block` per record batch."""
    del opts
    pa = _pyarrow()
    reader = pa.parquet.ParquetFile(piece.path)
    meta = reader.metadata
    check_range(piece, meta.num_row_groups, "row group")
    first = sum(meta.row_group(g).num_rows for g in range(piece.start))
    for g in range(piece.start, piece.stop):
        for batch in reader.read_row_group(g).to_batches():
            yield _batch_block(pa, batch, piece, first)
            first += batch.num_rows


def _open_file(pa: ModuleType, path: str) -> Any:
    """An Arrow IPC file reader, or None when the file is an IPC stream."""
    try:
        return pa.ipc.open_file(pa.memory_map(path))
    except pa.ArrowInvalid:
        return None


def arrow_pieces(path: str, unit_bytes: int) -> list[Piece]:
    """Ranges of record batches of an IPC file; one piece for an IPC stream."""
    pa = _pyarrow()
    reader = _open_file(pa, path)
    if reader is None:
        return [Piece(path, "arrow", 0, 1, os.path.getsize(path))]
    return row_pieces(path, "arrow", reader.num_record_batches, unit_bytes)


def read_arrow(piece: Piece, opts: ReadOptions, bad: BadRecords) -> Iterator[tuple[Record, int]]:
    """Yield one record per row, with the row number in the file."""
    del bad
    for block in read_arrow_blocks(piece, opts):
        yield from block.records()


def read_arrow_blocks(piece: Piece, opts: ReadOptions) -> Iterator[Block]:
    """The rows of `read_arrow` as one `Block` per record batch."""
    del opts
    pa = _pyarrow()
    reader = _open_file(pa, piece.path)
    first = 0
    if reader is None:
        try:
            batches = iter(pa.ipc.open_stream(pa.memory_map(piece.path)))
        except pa.ArrowInvalid as e:
            raise ConfigError(f"{piece.path}: not an Arrow IPC file or stream ({e})") from None
    else:
        check_range(piece, reader.num_record_batches, "record batch")
        first = sum(reader.get_batch(b).num_rows for b in range(piece.start))
        batches = (reader.get_batch(b) for b in range(piece.start, piece.stop))
    for batch in batches:
        yield _batch_block(pa, batch, piece, first)
        first += batch.num_rows


def _batch_block(pa: ModuleType, batch: Any, piece: Piece, first: int) -> Block:
    """A record batch as a `Block`: lists of numbers as their values and lengths, numbers
    as arrays, any other column as `_column`'s per-row values."""
    columns: dict[str, Any] = {}
    lengths: dict[str, np.ndarray] = {}
    for i, name in enumerate(batch.schema.names):
        col = batch.column(i)
        if _is_number_list(pa, col):
            _check_nulls(col, f"{piece.path}: field {name!r}", first)
            offsets = col.offsets.to_numpy()
            flat = col.values.to_numpy(zero_copy_only=False)
            columns[name] = flat[int(offsets[0]) : int(offsets[-1])]
            lengths[name] = np.diff(offsets)
        else:
            columns[name] = _column(pa, col, f"{piece.path}: field {name!r}", first)
    return Block(piece, first, columns, lengths)


def _is_number_list(pa: ModuleType, col: Any) -> bool:
    types = pa.types
    if not (types.is_list(col.type) or types.is_large_list(col.type)):
        return False
    child = col.type.value_type
    return (types.is_integer(child) or types.is_floating(child)) and col.values.null_count == 0


def _check_nulls(col: Any, where: str, first: int) -> None:
    if col.null_count:
        row = first + int(np.argmax(col.is_null().to_numpy(zero_copy_only=False)))
        raise ConfigError(f"{where}: row {row}: null (expected a value in every row)")


def _column(pa: ModuleType, col: Any, where: str, first: int) -> Any:
    """Per-row values of one column: numpy scalars, 1-D views, str or bytes."""
    t = col.type
    _check_nulls(col, where, first)
    types = pa.types
    if types.is_integer(t) or types.is_floating(t) or types.is_boolean(t):
        return col.to_numpy(zero_copy_only=False)
    if (
        types.is_string(t)
        or types.is_large_string(t)
        or types.is_binary(t)
        or types.is_large_binary(t)
    ):
        return col.to_pylist()
    if _is_number_list(pa, col):
        offsets = col.offsets.to_numpy()
        flat = col.values.to_numpy(zero_copy_only=False)
        return [flat[a:b] for a, b in itertools.pairwise(offsets.tolist())]
    if types.is_list(t) or types.is_large_list(t) or types.is_fixed_size_list(t):
        return [np.asarray(v) for v in col.to_pylist()]
    raise ConfigError(
        f"{where}: Arrow type {t} (expected numbers, lists of numbers, string or binary)"
    )


def hf_files(directory: str) -> list[str]:
    """The Arrow files of a ``save_to_disk`` dataset directory, in dataset order."""
    state_path = os.path.join(directory, "state.json")
    if os.path.exists(os.path.join(directory, "dataset_dict.json")):
        splits = sorted(e.name for e in os.scandir(directory) if e.is_dir())
        raise ConfigError(
            f"{directory}: a DatasetDict with splits {splits} (expected one split: pass {directory}/<split>)"
        )
    try:
        with open(state_path, encoding="utf-8") as f:
            state = json.load(f)
        files = [os.path.join(directory, d["filename"]) for d in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"{state_path}: unreadable HF dataset state ({e!r}, expected _data_files)"
        ) from None
    if state.get("_indices_data_files"):
        raise ConfigError(
            f"{directory}: dataset has an indices mapping (expected none: call "
            f".flatten_indices() before save_to_disk)"
        )
    return files
