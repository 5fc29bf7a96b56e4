"""NumPy inputs: ``.npy`` (one record per row of the leading dimension) and ``.npz``.

Always ``allow_pickle=False``: an object array is refused, never unpickled. A ``.npy`` file is
memory-mapped, so a piece reads only its rows. A ``.npz`` file is one piece; its arrays are
zipped by name into records and must share the leading dimension.
"""

from __future__ import annotations

import math
import os
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

import numpy as np

from roxxel.errors import ConfigError
from roxxel.ingest.units import (
    BLOCK_BYTES,
    BadRecords,
    Block,
    InputKind,
    Piece,
    RangeReader,
    ReadOptions,
    Record,
    check_range,
    row_pieces,
)

__all__ = [
    "NPY",
    "NPZ",
    "NPZ_WHOLE_MAX_BYTES",
    "npy_pieces",
    "npz_pieces",
    "read_npy",
    "read_npy_blocks",
    "read_npz",
    "read_npz_blocks",
]

# A Fortran-order .npz member cannot be read a row at a time: one is loaded whole, up to this
# many bytes (C-order members, what np.savez writes for C arrays, stream whatever their size).
NPZ_WHOLE_MAX_BYTES = 1 << 30


def _check_array(path: str, name: str, array: np.ndarray) -> None:
    _check_dtype(path, name, array.dtype, array.ndim)


def _check_dtype(path: str, name: str, dtype: np.dtype, ndim: int) -> None:
    if ndim == 0:
        raise ConfigError(f"{path}: array {name!r} is 0-d (expected a leading record dimension)")
    if dtype.kind not in "biuf" or dtype.fields is not None:
        raise ConfigError(f"{path}: array {name!r} has dtype {dtype} (expected bool/int/float)")


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


def read_npy_blocks(piece: Piece, opts: ReadOptions, bad: BadRecords) -> Iterator[Block]:
    """The rows of `read_npy` as blocks of about `BLOCK_BYTES`, read into one reused buffer
    (C-order files; a Fortran-order file gives views of its mapping)."""
    del bad  # no row is malformed on its own
    array = _load_npy(piece.path)
    check_range(piece, len(array), "row")
    name = opts.field_for("data")
    row_bytes = array[:1].nbytes
    step = max(1, BLOCK_BYTES // max(1, row_bytes))
    if not array.flags.c_contiguous or not row_bytes or not isinstance(array, np.memmap):
        rows = array.view(np.ndarray)
        for start in range(piece.start, piece.stop, step):
            stop = min(start + step, piece.stop)
            yield Block(piece, start, stop - start, {name: rows[start:stop]})
        return
    with RangeReader(piece.path) as reader:
        for start in range(piece.start, piece.stop, step):
            shape = (min(step, piece.stop - start), *array.shape[1:])
            rows = reader.read(array.offset + start * row_bytes, array.dtype, shape)
            yield Block(piece, start, len(rows), {name: rows})


def npz_pieces(path: str, unit_bytes: int) -> list[Piece]:
    """A ``.npz`` file is one piece (its members are compressed streams, not seekable rows).

    Its members' headers are checked here, so a bad archive fails at planning."""
    del unit_bytes
    _npz_members(path)
    return [Piece(path, "npz", 0, 1, os.path.getsize(path))]


@dataclass(frozen=True, slots=True)
class _Member:
    """One array of a ``.npz``, as its ``.npy`` header declares it."""

    name: str
    entry: str
    dtype: np.dtype
    shape: tuple[int, ...]
    fortran: bool

    @property
    def row_bytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape[1:])

    @property
    def num_bytes(self) -> int:
        return self.row_bytes * self.shape[0]


def _bad_npz(path: str, why: object) -> ConfigError:
    return ConfigError(
        f"{path}: not a readable .npz file ({why}, expected numeric arrays)", path=path
    )


def _npz_members(path: str) -> list[_Member]:
    """Every member's name, dtype and shape from its header alone (nothing decompressed but
    the header), checked: numeric, at least 1-d, one leading dimension, sizes that the
    archive can hold, a Fortran-order member within `NPZ_WHOLE_MAX_BYTES`."""
    try:
        with zipfile.ZipFile(path) as archive:
            members = [_member(path, archive, info) for info in archive.infolist()]
    except (ValueError, EOFError, OSError, zipfile.BadZipFile, zlib.error) as e:
        if isinstance(e, ConfigError):
            raise
        raise _bad_npz(path, e) from None
    if not members:
        raise ConfigError(f"{path}: no arrays (expected at least one)", path=path)
    lengths = {m.name: m.shape[0] for m in members}
    if len(set(lengths.values())) > 1:
        raise ConfigError(f"{path}: leading dimensions differ ({lengths}, expected all equal)")
    return members


def _member(path: str, archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> _Member:
    if not info.filename.endswith(".npy"):
        raise ConfigError(f"{path}: member {info.filename!r} (expected only .npy members)")
    name = info.filename.removesuffix(".npy")
    with archive.open(info) as f:
        shape, fortran, dtype = _read_header(f)
        header_bytes = f.tell()
    member = _Member(name, info.filename, np.dtype(dtype), tuple(shape), bool(fortran))
    _check_dtype(path, name, member.dtype, len(shape))
    if info.file_size != header_bytes + member.num_bytes:
        raise ConfigError(
            f"{path}: member {name!r} header declares shape {shape} of {member.dtype} "
            f"({member.num_bytes} bytes; the archive holds {info.file_size - header_bytes}, "
            f"expected equal)",
            path=path,
        )
    if member.fortran and len(shape) > 1 and member.num_bytes > NPZ_WHOLE_MAX_BYTES:
        raise ConfigError(
            f"{path}: member {name!r} is Fortran-ordered and {member.num_bytes} bytes "
            f"(expected C order, or at most NPZ_WHOLE_MAX_BYTES = {NPZ_WHOLE_MAX_BYTES}: "
            f"its rows cannot be streamed)",
            path=path,
        )
    return member


def _read_header(f: IO[bytes]) -> tuple[tuple[int, ...], bool, np.dtype]:
    """A ``.npy`` stream's (shape, fortran order, dtype); leaves ``f`` at the data."""
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(f)
    # 2.0 and 3.0 share the layout (3.0's UTF-8 only matters for field names)
    return np.lib.format.read_array_header_2_0(f)


def _member_rows(archive: zipfile.ZipFile, member: _Member, step: int) -> Iterator[np.ndarray]:
    """A member's rows, ``step`` at a time, decompressed as they are read."""
    num_rows, inner = member.shape[0], member.shape[1:]
    with archive.open(member.entry) as f:
        if member.fortran and inner:  # small (checked): loaded whole
            whole = np.asarray(np.lib.format.read_array(f, allow_pickle=False))
            for start in range(0, num_rows, step):
                yield np.ascontiguousarray(whole[start : start + step])
            return
        _read_header(f)
        for start in range(0, num_rows, step):
            rows = min(step, num_rows - start)
            data = f.read(rows * member.row_bytes)
            if len(data) != rows * member.row_bytes:
                raise ConfigError(
                    f"{archive.filename}: member {member.name!r} ends early (expected "
                    f"{member.num_bytes} bytes: the input changed since planning)"
                )
            yield np.frombuffer(data, member.dtype).reshape(rows, *inner)


def read_npz_blocks(piece: Piece, opts: ReadOptions, bad: BadRecords) -> Iterator[Block]:
    """The rows of every member zipped by name into blocks of about `BLOCK_BYTES`,
    decompressed as they are read: memory stays at a block, whatever the archive holds."""
    del opts, bad  # the member headers were checked: no row is malformed on its own
    members = _npz_members(piece.path)
    step = max(1, BLOCK_BYTES // max(1, sum(m.row_bytes for m in members)))
    try:
        with zipfile.ZipFile(piece.path) as archive:
            streams = [_member_rows(archive, m, step) for m in members]
            for first in range(0, members[0].shape[0], step):
                columns = {m.name: next(s) for m, s in zip(members, streams, strict=True)}
                yield Block(piece, first, len(columns[members[0].name]), columns)
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        raise _bad_npz(piece.path, e) from None


def read_npz(piece: Piece, opts: ReadOptions, bad: BadRecords) -> Iterator[tuple[Record, int]]:
    """Yield ``{name: array[i] for each array}`` per row i, with the row number."""
    for block in read_npz_blocks(piece, opts, bad):
        yield from block.records()


NPY = InputKind("npy", (".npy",), npy_pieces, read_npy, read_npy_blocks, fixed_arrays=True)
NPZ = InputKind("npz", (".npz",), npz_pieces, read_npz, read_npz_blocks, fixed_arrays=True)
