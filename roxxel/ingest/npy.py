"""NumPy inputs: ``.npy`` (one record per row of the leading dimension) and ``.npz``.

Always ``allow_pickle=False``: an object array is refused, never unpickled. A ``.npy`` file is
memory-mapped, so a piece reads only its rows. A ``.npz`` file is one piece; its arrays are
zipped by name into records and must share the leading dimension.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Iterator

import numpy as np

from roxxel.errors import ConfigError
from roxxel.ingest.units import (
    BLOCK_BYTES,
    BadRecords,
    Block,
    Piece,
    RangeReader,
    ReadOptions,
    Record,
    check_range,
    row_pieces,
)

__all__ = ["npy_pieces", "npz_pieces", "read_npy", "read_npy_blocks", "read_npz"]


def _check_array(path: str, name: str, array: np.ndarray) -> None:
    if array.ndim == 0:
        raise ConfigError(f"{path}: array {name!r} is 0-d (expected a leading record dimension)")
    if array.dtype.kind not in "biuf" or array.dtype.fields is not None:
        raise ConfigError(
            f"{path}: array {name!r} has dtype {array.dtype} (expected bool/int/float)"
        )


def _load_npy(path: str) -> np.ndarray:
    try:
        if os.path.getsize(path) == 0:
            raise ValueError("empty file")
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, EOFError) as e:
        raise ConfigError(
            f"{path}: not a readable .npy file ({e}, expected a numeric array)"
        ) from None
    if not isinstance(array, np.ndarray):
        raise ConfigError(f"{path}: not a .npy array (expected .npy; use --format npz for .npz)")
    _check_array(path, "array", array)
    return array


def npy_pieces(path: str, unit_bytes: int) -> list[Piece]:
    """Row ranges of about ``unit_bytes`` bytes."""
    return row_pieces(path, "npy", len(_load_npy(path)), unit_bytes)


def read_npy(piece: Piece, opts: ReadOptions, bad: BadRecords) -> Iterator[tuple[Record, int]]:
    """Yield ``{field: row}`` (default field ``data``) per row, with the row number."""
    del bad
    array = _load_npy(piece.path)
    check_range(piece, len(array), "row")
    name = opts.field_for("data")
    rows = array.view(np.ndarray)  # plain views of the mapping: np.memmap rows cost 3x more
    for i in range(piece.start, piece.stop):
        yield {name: rows[i]}, i


def read_npy_blocks(piece: Piece, opts: ReadOptions) -> Iterator[Block]:
    """The rows of `read_npy` as blocks of about `BLOCK_BYTES`, read into one reused buffer
    (C-order files; a Fortran-order file gives views of its mapping)."""
    array = _load_npy(piece.path)
    check_range(piece, len(array), "row")
    name = opts.field_for("data")
    row_bytes = array[:1].nbytes
    step = max(1, BLOCK_BYTES // max(1, row_bytes))
    if not array.flags.c_contiguous or not row_bytes or not isinstance(array, np.memmap):
        rows = array.view(np.ndarray)
        for start in range(piece.start, piece.stop, step):
            yield Block(piece, start, {name: rows[start : min(start + step, piece.stop)]})
        return
    with RangeReader(piece.path) as reader:
        for start in range(piece.start, piece.stop, step):
            shape = (min(step, piece.stop - start), *array.shape[1:])
            rows = reader.read(array.offset + start * row_bytes, array.dtype, shape)
            yield Block(piece, start, {name: rows})


def npz_pieces(path: str, unit_bytes: int) -> list[Piece]:
    """A ``.npz`` file is one piece (its members are compressed streams, not seekable rows)."""
    del unit_bytes
    return [Piece(path, "npz", 0, 1, os.path.getsize(path))]


def _load_npz(path: str) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except (ValueError, EOFError, OSError, zipfile.BadZipFile) as e:
        raise ConfigError(
            f"{path}: not a readable .npz file ({e}, expected numeric arrays)"
        ) from None
    if not arrays:
        raise ConfigError(f"{path}: no arrays (expected at least one)")
    for name, array in arrays.items():
        _check_array(path, name, array)
    lengths = {name: len(a) for name, a in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise ConfigError(f"{path}: leading dimensions differ ({lengths}, expected all equal)")
    return arrays


def read_npz(piece: Piece, opts: ReadOptions, bad: BadRecords) -> Iterator[tuple[Record, int]]:
    """Yield ``{name: array[i] for each array}`` per row i, with the row number."""
    del opts, bad
    arrays = _load_npz(piece.path)
    for i in range(len(next(iter(arrays.values())))):
        yield {name: a[i] for name, a in arrays.items()}, i
