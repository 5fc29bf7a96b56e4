"""Batched reads: indices checked once, then gathered from one or many shards into buffers.

Fixed-shape fields are stacked to ``(B, *shape)``. Variable-length fields are padded with
zeros to ``(B, L, *inner)``, where L is the longest record of the batch (or the width of a
reused buffer, if wider), with their lengths in ``"<name>.length"``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from roxxel.format.column import Column
from roxxel.format.schema import Field, Schema

__all__ = ["Group", "RecordSource", "allocate", "gather", "normalize_indices"]

LENGTH_SUFFIX = ".length"
Batch = dict[str, np.ndarray]
# (columns of one shard, rows of the batch they fill (None: all, in order), local indices)
Group = tuple[Mapping[str, Column], "np.ndarray | None", np.ndarray]


class RecordSource:
    """What a shard and a dataset share: ``len()``, ``[i]`` with negative indices and a
    bounds check, and reusable buffers for ``get_batch``. A subclass sets ``path``,
    ``schema`` and ``_num`` and defines ``record(i)`` for ``0 <= i < len(self)``."""

    path: Path
    _num: int

    @property
    def schema(self) -> Schema:
        """The record schema (a subclass provides it)."""
        raise NotImplementedError

    @property
    def num_records(self) -> int:
        return self._num

    def __len__(self) -> int:
        return self._num

    def __getitem__(self, index: int) -> dict[str, Any]:
        i = int(index)
        if not -self._num <= i < self._num:
            raise IndexError(f"{self.path}: record {index} out of range for {self._num} records")
        return self.record(i + self._num if i < 0 else i)

    def record(self, i: int) -> dict[str, Any]:
        raise NotImplementedError

    def batch_buffers(self, batch_size: int, max_len: dict[str, int] | None = None) -> Batch:
        """Buffers to pass as ``out=`` to ``get_batch``, reused from call to call."""
        return allocate(self.schema.fields, batch_size, max_len or {})


def normalize_indices(indices: Any, size: int, where: object) -> np.ndarray:
    """Indices as int64 in [0, size): negative ones count from the end; IndexError outside.

    >>> normalize_indices([0, -1], 5, "ds").tolist()
    [0, 4]
    """
    idx = np.asarray(indices)
    if idx.dtype.kind not in "iu" and idx.size:
        raise TypeError(f"{where}: indices must be integers ({idx.dtype})")
    idx = idx.astype(np.int64, copy=False).reshape(-1)
    if idx.size and (int(idx.min()) < -size or int(idx.max()) >= size):
        raise IndexError(f"{where}: index out of range for {size} records")
    return np.where(idx < 0, idx + size, idx)


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


def gather(groups: Sequence[Group], fields: Sequence[Field], size: int, out: Batch | None) -> Batch:
    """Fill a batch of ``size`` rows from ``groups``; reuse the arrays of ``out`` that fit."""
    batch: Batch = out if out is not None else {}
    for field in fields:
        if field.is_variable:
            _gather_variable(groups, field, size, batch)
        else:
            dest = _buffer(batch, field.name, (size, *field.fixed_shape), field.dtype)
            for columns, rows, local in groups:
                column = columns[field.name]
                if rows is None:
                    column.take(local, dest)
                else:
                    dest[rows] = column.take(local)
    return batch


def _gather_variable(groups: Sequence[Group], field: Field, size: int, batch: Batch) -> None:
    lengths = _buffer(batch, field.name + LENGTH_SUFFIX, (size,), np.dtype(np.int64))
    for columns, rows, local in groups:
        lengths[slice(None) if rows is None else rows] = columns[field.name].lengths(local)
    width = int(lengths.max()) if size else 0
    held = batch.get(field.name)
    if held is not None and held.shape[0] == size and held.shape[1] >= width:
        width = held.shape[1]
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
