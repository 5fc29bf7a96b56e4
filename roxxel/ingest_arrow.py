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
from roxxel.ingest_units import BadRecords, Piece, ReadOptions, Record, check_range, row_pieces

__all__ = ["arrow_pieces", "hf_files", "parquet_pieces", "read_arrow", "read_parquet"]


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
    del opts, bad
    pa = _pyarrow()
    reader = pa.parquet.ParquetFile(piece.path)
    meta = reader.metadata
    check_range(piece, meta.num_row_groups, "row group")
    first = sum(meta.row_group(g).num_rows for g in range(piece.start))
    for g in range(piece.start, piece.stop):
        for batch in reader.read_row_group(g).to_batches():
            yield from _batch_records(pa, batch, piece.path, first)
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
    del opts, bad
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
        yield from _batch_records(pa, batch, piece.path, first)
        first += batch.num_rows


def _batch_records(
    pa: ModuleType, batch: Any, path: str, first: int
) -> Iterator[tuple[Record, int]]:
    names = batch.schema.names
    columns = [
        _column(pa, batch.column(i), f"{path}: field {n!r}", first) for i, n in enumerate(names)
    ]
    for i in range(batch.num_rows):
        yield {n: c[i] for n, c in zip(names, columns, strict=True)}, first + i


def _column(pa: ModuleType, col: Any, where: str, first: int) -> Any:
    """Per-row values of one column: numpy scalars, 1-D views, str or bytes."""
    t = col.type
    if col.null_count:
        row = first + int(np.argmax(col.is_null().to_numpy(zero_copy_only=False)))
        raise ConfigError(f"{where}: row {row}: null (expected a value in every row)")
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
    if types.is_list(t) or types.is_large_list(t):
        child = t.value_type
        if (types.is_integer(child) or types.is_floating(child)) and col.values.null_count == 0:
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
