"""Batched reads: indices checked once, then gathered from one or many shards into buffers.

Fixed-shape fields are stacked to ``(B, *shape)``. Variable-length fields are padded with
zeros to ``(B, L, *inner)``, where L is the longest record of the batch (or the width of a
reused buffer, if wider), with their lengths in ``"<name>.length"``.

One read never materializes more than a cap of bytes (`read_cap`): a few KB of zstd records
may claim gigabytes decoded, and padding multiplies the longest record by the batch size. The
cap is checked from the tables before anything is allocated or decoded.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, SupportsIndex, overload

import numpy as np

from roxxel.errors import ConfigError, check_int
from roxxel.format.column import Column
from roxxel.format.schema import Field, Schema

__all__ = [
    "MAX_DECODED_BYTES",
    "MAX_DECODED_BYTES_ENV",
    "Group",
    "RecordSource",
    "allocate",
    "check_read_bytes",
    "gather",
    "gather_rows",
    "normalize_indices",
    "read_cap",
]

LENGTH_SUFFIX = ".length"
MAX_DECODED_BYTES = 4 << 30  # default cap on the bytes one read decodes or allocates
MAX_DECODED_BYTES_ENV = "ROXXEL_MAX_DECODED_BYTES"
Batch = dict[str, np.ndarray]
# (columns of one shard, rows of the batch they fill (None: all, in order), local indices)
Group = tuple[Mapping[str, Column], "np.ndarray | None", np.ndarray]


class RecordSource:
    """What a shard and a dataset share: ``len()``, ``[i]`` with negative indices and a
    bounds check, and reusable buffers for ``get_batch``. A subclass sets ``path``,
    ``schema`` and ``_num`` and defines ``record(i)`` for ``0 <= i < len(self)``.

    ``source[i]`` is one record (a dict of field -> array, ``str`` or bytes); ``source[a:b]``
    is a list of records, as slicing a Python sequence gives (not a dict of columns, as in
    HF datasets): use ``get_batch(range(a, b))`` for stacked or padded columns. An index
    that is not an integer (``2.5``, ``"1"``, a field name) is a TypeError.
    """

    path: Path
    _num: int

    @property
    def where(self) -> str:
        """What errors name this source by: its path (a dataset at a URL: the URL)."""
        return str(self.path)

    @property
    def schema(self) -> Schema:
        """The record schema (a subclass provides it)."""
        raise NotImplementedError

    @property
    def num_records(self) -> int:
        return self._num

    def __len__(self) -> int:
        return self._num

    @overload
    def __getitem__(self, index: SupportsIndex) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, index: SupportsIndex | slice) -> dict[str, Any] | list[dict[str, Any]]:
        try:
            i = operator.index(index)  # pyright: ignore[reportArgumentType]  (a slice: below)
        except TypeError:
            if isinstance(index, slice):
                return [self.record(i) for i in range(*index.indices(self._num))]
            raise _not_an_index(index, self) from None
        if not -self._num <= i < self._num:
            raise IndexError(f"{self.where}: record {i} out of range for {self._num} records")
        return self.record(i + self._num if i < 0 else i)

    def record(self, i: int) -> dict[str, Any]:
        raise NotImplementedError

    def batch_buffers(self, batch_size: int, max_len: dict[str, int] | None = None) -> Batch:
        """Buffers to pass as ``out=`` to ``get_batch``, reused from call to call."""
        return allocate(self.schema.fields, batch_size, max_len or {})


def _not_an_index(index: object, source: RecordSource) -> TypeError:
    """The TypeError for an index that is neither an int nor a slice, saying how to index."""
    hint = ""
    if isinstance(index, str) and index in source.schema:
        hint = (
            f"; for field {index!r} of every record use"
            f" get_batch(range(len(ds)), fields=[{index!r}])[{index!r}], or ds[i][{index!r}]"
        )
    return TypeError(
        f"{source.path}: record index {index!r:.80} is a {type(index).__name__}"
        f" (expected an int or a slice of ints){hint}"
    )


def read_cap(value: object = None) -> int:
    """The cap on bytes one read may decode or allocate: ``value`` if given, else the
    ``ROXXEL_MAX_DECODED_BYTES`` environment variable, else `MAX_DECODED_BYTES` (4 GiB).

    >>> read_cap(1 << 20)
    1048576
    """
    where = "max_decoded_bytes"
    if value is None:
        text = os.environ.get(MAX_DECODED_BYTES_ENV)
        if text is None:
            return MAX_DECODED_BYTES
        where = f"${MAX_DECODED_BYTES_ENV}"
        try:
            value = int(text)
        except ValueError:
            raise ConfigError(f"{where}: not an integer ({text!r:.40}, expected bytes)") from None
    return check_int(where, value, low=1)


def check_read_bytes(where: object, what: str, nbytes: int, cap: int) -> None:
    """ConfigError if a read of ``nbytes`` would pass ``cap``, before any of it is made."""
    if nbytes > cap:
        raise ConfigError(
            f"{where}: {what} is too large to read at once ({nbytes} bytes, expected at most"
            f" the read cap of {cap}; raise it with max_decoded_bytes= of open_dataset or"
            f" open_shard, or ${MAX_DECODED_BYTES_ENV})"
        )


def normalize_indices(indices: Any, size: int, where: object) -> np.ndarray:
    """Indices as int64 in [0, size): negative ones count from the end; IndexError outside.

    >>> normalize_indices([0, -1], 5, "ds").tolist()
    [0, 4]
    """
    idx = np.asarray(indices)
    if idx.dtype.kind not in "iu" and idx.size:
        raise TypeError(f"{where}: indices must be integers ({idx.dtype})")
    if idx.dtype.kind == "u" and idx.size and int(idx.max()) >= size:  # before int64 wraps it
        raise IndexError(f"{where}: index out of range for {size} records")
    idx = idx.astype(np.int64, copy=False).reshape(-1)
    if not idx.size:
        return idx
    low = int(idx.min())
    if low < -size or int(idx.max()) >= size:
        raise IndexError(f"{where}: index out of range for {size} records")
    return idx if low >= 0 else np.where(idx < 0, idx + size, idx)


def allocate(fields: Sequence[Field], batch_size: int, max_len: Mapping[str, int]) -> Batch:
    """Preallocated buffers for batches of ``batch_size`` (variable fields ``max_len`` wide)."""
    out: Batch = {}
    for field in fields:
        if field.is_variable:
            width = max_len.get(field.name, 0)
            out[field.name] = np.zeros((batch_size, width, *field.inner_shape), field.dtype)
            out[field.name + LENGTH_SUFFIX] = np.zeros(batch_size, np.int64)
        else:
            out[field.name] = np.empty((batch_size, *field.fixed_shape), field.dtype)
    return out


def gather(
    groups: Sequence[Group],
    fields: Sequence[Field],
    size: int,
    out: Batch | None,
    cap: int = MAX_DECODED_BYTES,
    where: object = "get_batch",
) -> Batch:
    """Fill a batch of ``size`` rows from ``groups``; reuse the arrays of ``out`` that fit.

    Raises ConfigError, before allocating or decoding anything, if the batch's arrays would
    hold more than ``cap`` bytes.
    """
    batch: Batch = out if out is not None else {}
    widths = {f.name: _lengths(groups, f, size, batch) for f in fields if f.is_variable}
    nbytes = sum(size * widths.get(f.name, 1) * f.unit_bytes for f in fields)
    check_read_bytes(where, f"a batch of {size} records", nbytes, cap)
    for field in fields:
        if field.is_variable:
            _gather_variable(groups, field, (size, widths[field.name]), batch)
        else:
            dest = _buffer(batch, field.name, (size, *field.fixed_shape), field.dtype)
            for columns, rows, local in groups:
                column = columns[field.name]
                if rows is None:
                    column.take(local, dest)
                else:
                    dest[rows] = column.take(local)
    return batch


def gather_rows(
    row_columns: Sequence[Mapping[str, Any]],
    local: Sequence[int],
    fields: Sequence[Field],
    out: Batch | None,
    cap: int = MAX_DECODED_BYTES,
    where: object = "get_batch",
) -> Batch:
    """`gather` of fixed-shape, uncompressed fields one row at a time: row i is record
    ``local[i]`` of the shard whose columns are ``row_columns[i]``. When a batch's rows are
    spread over about as many shards as rows, a copy per row costs less than `gather`'s
    take and scatter per shard."""
    size = len(local)
    batch: Batch = out if out is not None else {}
    nbytes = sum(size * f.unit_bytes for f in fields)
    check_read_bytes(where, f"a batch of {size} records", nbytes, cap)
    for field in fields:
        dest, name = _buffer(batch, field.name, (size, *field.fixed_shape), field.dtype), field.name
        for row, (columns, i) in enumerate(zip(row_columns, local, strict=True)):
            dest[row] = columns[name].flat[i]
    return batch


def _lengths(groups: Sequence[Group], field: Field, size: int, batch: Batch) -> int:
    """Fill ``"<name>.length"``; return the width the padded field will have."""
    lengths = _buffer(batch, field.name + LENGTH_SUFFIX, (size,), np.dtype(np.int64))
    for columns, rows, local in groups:
        lengths[slice(None) if rows is None else rows] = columns[field.name].lengths(local)
    width = int(lengths.max()) if size else 0
    held = batch.get(field.name)
    if held is not None and held.shape[0] == size and held.shape[1] >= width:
        width = held.shape[1]
    return width


def _gather_variable(
    groups: Sequence[Group], field: Field, rows_width: tuple[int, int], batch: Batch
) -> None:
    size, width = rows_width
    dest = _buffer(batch, field.name, (size, width, *field.inner_shape), field.dtype)
    for columns, rows, local in groups:
        if rows is None:
            columns[field.name].pad_into(local, dest)
        else:
            part = np.empty((len(local), width, *field.inner_shape), field.dtype)
            columns[field.name].pad_into(local, part)
            dest[rows] = part


def _buffer(batch: Batch, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    held = batch.get(name)
    if held is None or held.shape != shape or held.dtype != dtype:
        held = batch[name] = np.empty(shape, dtype)
    return held
