"""Loader sources over a dataset: whole records, or token windows over a 1-D field.

A source is a `roxxel.protocols.Source`: ``len()`` (number of items), ``layout`` (per-row
shape and dtype of each field), ``read(indices, out)`` (fill preallocated arrays, rows first),
``advise(indices)`` (ask the kernel to read ahead the pages those items live on) and
``fingerprint()`` (a hex string naming the content and the parameters, for resume checks).
A source may also take ``read(indices, out, rows=rows)``: item ``indices[i]`` goes to row
``rows[i]`` of ``out`` (a mixture batch then needs no scratch block and no scatter).
`Records` and `TokenWindows` (`roxxel.sources.windows`) are the two built in;
`as_source` turns a `Dataset` into `Records`. Sources never import jax and hold no
per-batch state, so one pipeline thread can read them while another builds the order.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

import numpy as np

from roxxel.errors import ConfigError, check_int
from roxxel.format.dataset import Dataset
from roxxel.format.reader import Shard
from roxxel.protocols import RowSource, Source
from roxxel.sources.windows import (
    RowFields,
    TokenWindows,
    check_rows,
    dataset_of,
    fingerprint_of,
    merge_ranges,
)

__all__ = ["Records", "Source", "as_source", "fingerprint_of", "shard_starts_of", "takes_rows"]


def as_source(
    obj: Any, *, fields: Sequence[str] | None = None, max_len: Mapping[str, int] | None = None
) -> Source:
    """`obj` itself when it already is a source, else `Records` over it (a `Dataset`).

    Raises:
        ConfigError: `obj` is neither a source nor a dataset.
    """
    if isinstance(obj, Source):
        return obj
    if isinstance(obj, Dataset):
        return Records(obj, fields=fields, max_len=max_len)
    raise ConfigError(
        f"loader source: unsupported object ({type(obj).__name__}, expected a Dataset, "
        "Records, TokenWindows, Mixture or an object with layout/read/advise/fingerprint)"
    )


class Records:
    """Every record of a dataset, with all its fields or the ones named.

    Fixed-shape fields come out as ``(B, *shape)``. A variable field is padded with zeros to
    ``max_len[name]`` along its leading dimension, with ``"<name>.length"`` (int64) beside
    it; ``bytes`` and ``str`` fields are uint8 the same way (UTF-8 bytes for ``str``: the
    text of row i is ``bytes(b[name][i, :b[name + ".length"][i]]).decode()``). A variable
    field left out of ``max_len`` is padded to its longest record in the dataset (at least
    1), read from the offset tables once per dataset and field (O(records), no payload
    read). A record longer than its ``max_len`` is an error of the dataset reader, not
    truncated silently. ``dataset`` is a `Dataset` or its path.

    Raises:
        ConfigError: not a dataset, an unknown field, or a ``max_len`` that is not a
            positive int.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        fields: Sequence[str] | None = None,
        max_len: Mapping[str, int] | None = None,
    ) -> None:
        self.dataset = dataset = dataset_of(dataset, "views.Records")
        self.fields = dataset.schema.select(None if fields is None else list(fields))
        given = dict(max_len or {})
        self.max_len = {
            f.name: given[f.name] if f.name in given else longest_record(dataset, f.name)
            for f in self.fields
            if f.is_variable
        } | given
        self._layout = _record_layout(self.fields, self.max_len)

    @property
    def layout(self) -> RowFields:
        return dict(self._layout)

    def __len__(self) -> int:
        return int(self.dataset.num_records)

    @property
    def shard_starts(self) -> np.ndarray:
        """The first record of each shard, then ``len(self)`` (int64, num_shards + 1)."""
        return self.dataset.shard_starts.copy()

    def read(
        self, indices: np.ndarray, out: Mapping[str, np.ndarray], rows: np.ndarray | None = None
    ) -> None:
        """Fill ``out[name][:len(indices)]`` with the records at `indices` (global indices),
        or rows ``rows`` of ``out`` (one per index) when given: those go through one
        scratch block, since the dataset reads whole leading rows."""
        if rows is not None:
            check_rows(indices, rows, "views.Records")
            scratch = {
                name: np.empty((len(indices), *array.shape[1:]), array.dtype)
                for name, array in out.items()
            }
            self.read(indices, scratch)
            for name, array in out.items():
                array[rows] = scratch[name]
            return
        names = [f.name for f in self.fields]
        filled = self.dataset.get_batch(indices, names, out=dict(out))
        for name, array in out.items():
            if filled[name] is not array:
                raise ConfigError(
                    f"views.Records: field {name!r} does not fit its buffer ({filled[name].shape} "
                    f"read, expected {array.shape}; is a record longer than max_len?)"
                )

    def advise(self, indices: np.ndarray) -> None:
        """Read-ahead for these records: a dataset at a URL starts fetching their shards
        (`Dataset.prefetch`); then a hint (MADV_WILLNEED) for the pages of their fixed-shape
        fields in shards already mapped, one call per run of nearby records."""
        if not len(indices):
            return
        shard_ids, local = self.dataset.locate(np.asarray(indices, dtype=np.int64))
        self.dataset.prefetch(np.unique(shard_ids).tolist())  # in the order reads take them
        for field in [f for f in self.fields if not f.is_variable]:
            unit = field.unit_bytes
            for shard, lo, hi in merge_ranges(shard_ids, local * unit, (local + 1) * unit):
                if (mapped := self.dataset.shard_if_ready(shard)) is not None:
                    mapped.advise(field.name, lo, hi)

    def fingerprint(self) -> str:
        layout = _layout_json(self._layout)
        return fingerprint_of(
            {"kind": "records", "dataset": self.dataset.fingerprint, "layout": layout}
        )

    def __repr__(self) -> str:
        names = [f.name for f in self.fields]
        return (
            f"Records({self.dataset.where!r}, fields={names}, max_len={self.max_len}, "
            f"num_records={len(self)})"
        )


_LONGEST: weakref.WeakKeyDictionary[Any, dict[str, int]] = weakref.WeakKeyDictionary()


def longest_record(dataset: Dataset, field: str) -> int:
    """Elements along the variable dimension of the longest record of `field` (at least 1),
    from every shard's offset table (the decoded sizes of a compressed field): computed
    once per dataset and field."""
    known = _LONGEST.setdefault(dataset, {})
    if field not in known:

        def longest_in(shard: Shard) -> int:
            column = shard.columns[field]
            if not column.num_records:
                return 0
            return int(column.lengths(np.arange(column.num_records, dtype=np.int64)).max())

        # the shards' indexes: at a URL, their tables alone are fetched, not their records
        known[field] = max([1, *dataset.shard_indexes(longest_in)])
    return known[field]


def takes_rows(source: object) -> TypeGuard[RowSource]:
    """Whether ``source`` is a `RowSource` (its ``read`` takes ``rows=``): the built-in
    sources are; any other source is read through a block.

    >>> takes_rows(Records.__new__(Records)), takes_rows(object())
    (True, False)
    """
    return isinstance(source, Records | TokenWindows)


def shard_starts_of(source: Source, where: str) -> np.ndarray:
    """The first item of each shard of a built-in source, then ``len(source)``: what
    `roxxel.sampling.order.ShardGroups` groups by.

    Raises:
        ConfigError: a source other than `Records` and `TokenWindows` (no shard layout).
    """
    if isinstance(source, Records | TokenWindows):
        return source.shard_starts
    raise ConfigError(
        f"{where}: a source without a shard layout ({type(source).__name__}, expected "
        "Records, TokenWindows or a Dataset)"
    )


def _record_layout(fields: Sequence[Any], max_len: Mapping[str, int]) -> RowFields:
    layout: RowFields = {}
    for field in fields:
        if not field.is_variable:
            layout[field.name] = (tuple(field.shape), field.dtype)
            continue
        length = check_int(f"views.Records: max_len[{field.name!r}]", max_len[field.name], 1)
        layout[field.name] = ((length, *field.inner_shape), field.dtype)
        layout[f"{field.name}.length"] = ((), np.dtype(np.int64))
    return layout


def _layout_json(layout: RowFields) -> list[list[Any]]:
    return [[name, list(shape), dtype.str] for name, (shape, dtype) in layout.items()]
