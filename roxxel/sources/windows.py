"""Token windows: fixed-length windows over the concatenation of a 1-D field of a dataset.

`TokenWindows` is one of the two loader sources built in (`roxxel.sources.records` has the protocol,
`Records` and `as_source`, and re-exports this class). `WindowBlend` reads the windows of
several of them, one source per row, in one pass (a mixture batch). Here also live the
helpers both sources share: `fingerprint_of`, `merge_ranges` (read-ahead byte ranges) and
`dataset_of` (a dataset or its path).
No jax, no per-batch state.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from roxxel.errors import ConfigError
from roxxel.format.dataset import Dataset, open_dataset

__all__ = [
    "RowFields",
    "TokenWindows",
    "WindowBlend",
    "blend_of",
    "check_rows",
    "dataset_of",
    "fingerprint_of",
    "merge_ranges",
]

Shape = tuple[int, ...]
RowFields = dict[str, tuple[Shape, np.dtype]]


def fingerprint_of(value: Any) -> str:
    """A short stable hex digest of a JSON-able value.

    >>> fingerprint_of({"a": 1}) == fingerprint_of({"a": 1})
    True
    """
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def merge_ranges(
    shards: np.ndarray, starts: np.ndarray, stops: np.ndarray, gap: int = 4096
) -> list[tuple[int, int, int]]:
    """Byte ranges per shard, sorted, with ranges less than `gap` apart merged into one.

    >>> merge_ranges(np.array([0, 0, 1, 0]), np.array([900, 0, 0, 9000]), np.array([1000, 100, 8, 9001]))
    [(0, 0, 1000), (0, 9000, 9001), (1, 0, 8)]
    """
    if not len(starts):
        return []
    order = np.lexsort((starts, shards))
    shards, starts, stops = shards[order], starts[order], stops[order]
    # the furthest byte reached so far within each shard (shards kept apart by a huge offset)
    lift = shards.astype(np.int64) << 44
    reach = np.maximum.accumulate(stops + lift) - lift
    new_run = np.ones(len(starts), dtype=bool)
    new_run[1:] = (shards[1:] != shards[:-1]) | (starts[1:] - reach[:-1] >= gap)
    first = np.flatnonzero(new_run)
    last = np.append(first[1:], len(starts)) - 1
    runs = zip(shards[first].tolist(), starts[first].tolist(), reach[last].tolist(), strict=True)
    return list(runs)


class _Stream:
    """Flat arrays side by side as one stream of elements: ``_starts`` (int64, one more
    than the arrays) says where each begins; a subclass's ``_load(k)`` maps array k. The
    arrays are kept in ``_flats`` unless ``_keeps`` is False: a view holds its shard's
    mapping, and under a cache limit the dataset must be able to let go of it."""

    _starts: np.ndarray
    _flats: list[np.ndarray | None]
    _keeps: bool = True

    def _locate(self, starts: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per window: its first shard, its start in that shard, whether it ends there."""
        shards = np.searchsorted(self._starts, starts, side="right") - 1
        local = starts - self._starts[shards]
        return shards, local, starts + width <= self._starts[shards + 1]

    def _copy_rows(
        self, starts: np.ndarray, dst: np.ndarray, shift: int, dest: list[int] | range
    ) -> None:
        """dst[dest[i]] = stream[starts[i] + shift :][: dst.shape[1]]: one slice per window
        inside a shard, the general path for the few that cross one."""
        width, flats = dst.shape[1], self._flats
        shards, local, inside = self._locate(starts + shift, width)
        rows = zip(dest, shards.tolist(), local.tolist(), inside.tolist(), strict=True)
        for i, (row, shard, lo, whole) in enumerate(rows):
            if whole:
                flat = flats[shard]
                if flat is None:
                    flat = self._flat(shard)
                dst[row] = flat[lo : lo + width]
            else:
                self._copy(int(starts[i]) + shift, dst[row])

    def _pieces(self, start: int, width: int) -> list[tuple[int, int, int]]:
        """(shard, local start, local stop) of each shard the window from `start` touches."""
        shard = int(np.searchsorted(self._starts, start, side="right")) - 1
        pieces, position, stop = [], start, start + width
        while position < stop:
            base, end = int(self._starts[shard]), int(self._starts[shard + 1])
            take = min(stop, end) - position
            if take > 0:
                pieces.append((shard, position - base, position - base + take))
                position += take
            shard += 1
        return pieces

    def _copy(self, start: int, dst: np.ndarray) -> None:
        filled = 0
        for shard, lo, hi in self._pieces(start, len(dst)):
            dst[filled : filled + hi - lo] = self._flat(shard)[lo:hi]
            filled += hi - lo

    def _flat(self, shard: int) -> np.ndarray:
        flat = self._flats[shard]
        if flat is None:
            flat = self._load(shard)
            if self._keeps:
                self._flats[shard] = flat
        return flat

    def _load(self, shard: int) -> np.ndarray:
        raise NotImplementedError


class TokenWindows(_Stream):
    """Fixed-length windows over the concatenation of a 1-D field across every shard.

    Window i covers elements ``[i * stride, i * stride + width)`` of the stream made by
    concatenating the field of every record in dataset order, where ``width`` is
    ``seq_len + 1`` with ``targets=True`` (inputs are ``w[:, :-1]``, targets ``w[:, 1:]``;
    consecutive windows share one token) and ``seq_len`` otherwise. ``stride`` defaults to
    ``seq_len``. With ``split_targets=True`` (needs ``targets``) a window comes out as two
    fields of ``seq_len``, ``"inputs"`` = ``w[:-1]`` and ``"targets"`` = ``w[1:]``, which
    split evenly when the sequence dimension is sharded; otherwise it is one field named like
    the dataset field. A window may cross record and shard boundaries; it is located in
    O(log S) through ``dataset.element_starts`` (S shards) and copied with one slice per
    shard it touches. The incomplete tail of the stream is not a window.

    With ``document_structure=True`` each window also has ``"segment_ids"`` (int32, 1 for the
    document the window, or its inputs when split, starts in, +1 at each document start
    inside it; 0 never occurs, so it can mean padding downstream) and ``"positions"`` (int32,
    0 at the window start and at each document start, +1 per token), the Megatron
    ``reset_position_ids`` convention. Empty documents leave no trace.

    ``dataset`` is a `Dataset` or the path of one (opened with `roxxel.open_dataset`).
    ``dtype`` declares the token dtype of the windows (default: the field's own): each
    window is cast as it is copied, so a uint16 corpus can join int32 ones in a `Mixture`
    without a repack. Only a dtype that holds every value of the field's dtype is accepted
    (``numpy.can_cast(..., "safe")``), so no token ever changes.

    Raises:
        ConfigError: an unknown field (the message lists the dataset's fields), a field that
            is not a 1-D variable-length numeric field, seq_len/stride not positive, or a
            dtype that cannot hold every value of the field's.
    """

    def __init__(
        self,
        dataset: Any,
        field: str,
        seq_len: int,
        *,
        targets: bool = True,
        document_structure: bool = False,
        stride: int | None = None,
        split_targets: bool = False,
        dtype: Any = None,
    ) -> None:
        dataset = dataset_of(dataset, "TokenWindows")
        self.dataset, self.field = dataset, field
        self.seq_len, self.targets, self.document_structure = seq_len, targets, document_structure
        self.stride = seq_len if stride is None else stride
        self._options: dict[str, Any] = {"targets": targets, "stride": stride}
        self._options |= {"document_structure": document_structure, "split_targets": split_targets}
        self._options["dtype"] = dtype
        self.width = seq_len + 1 if targets else seq_len
        self.split_targets = split_targets
        if split_targets and not targets:
            raise ConfigError(
                "views.TokenWindows: split_targets without targets (expected targets=True)"
            )
        self._doc_width = seq_len if split_targets else self.width
        self._stored = _check_token_field(dataset, field, seq_len, self.stride)
        self._declared = None if dtype is None else _check_cast(self._stored, dtype)
        self._dtype = self._stored if self._declared is None else self._declared
        self._starts = np.asarray(dataset.element_starts(field), dtype=np.int64)
        self._flats: list[np.ndarray | None] = [None] * (len(self._starts) - 1)
        self._offsets: list[np.ndarray | None] = [None] * (len(self._starts) - 1)
        self._keeps = dataset.cache is None or dataset.cache.config.cache_limit_bytes is None
        total = int(self._starts[-1])
        self._num_windows = 0 if total < self.width else (total - self.width) // self.stride + 1

    @property
    def layout(self) -> RowFields:
        names = ("inputs", "targets") if self.split_targets else (self.field,)
        width = self.seq_len if self.split_targets else self.width
        layout: RowFields = {name: ((width,), self._dtype) for name in names}
        for name in ("segment_ids", "positions") if self.document_structure else ():
            layout[name] = ((self._doc_width,), np.dtype(np.int32))
        return layout

    @property
    def tokens_per_sample(self) -> int:
        """Tokens one window feeds to training: ``seq_len``."""
        return self.seq_len

    def with_seq_len(self, seq_len: int) -> TokenWindows:
        """The same windows cut at another ``seq_len`` (``self`` when it is the same).

        Every option is kept; a stride left to its default follows the new length. A
        `roxxel.Mixture` calls this for a phase's ``seq_len``.
        """
        if seq_len == self.seq_len:
            return self
        return TokenWindows(self.dataset, self.field, seq_len, **self._options)

    def __len__(self) -> int:
        return self._num_windows

    @property
    def shard_starts(self) -> np.ndarray:
        """The first window of each shard, then ``len(self)`` (int64, num_shards + 1): a
        window belongs to the shard its first element is in (the order of
        ``LoaderConfig.shuffle_group_shards`` groups windows by it)."""
        firsts = -(-self._starts[:-1] // self.stride)  # the first window starting in each
        return np.append(np.minimum(firsts, self._num_windows), self._num_windows)

    @property
    def num_elements(self) -> int:
        return int(self._starts[-1])

    @property
    def dtype(self) -> np.dtype:
        """The dtype of the token fields of a window (declared, or the field's own)."""
        return self._dtype

    def fingerprint(self) -> str:
        found = {
            "field": self.field,
            "width": self.width,
            "stride": self.stride,
            "document_structure": self.document_structure,
            "split_targets": self.split_targets,
        }
        if self._declared is not None:  # only when given: earlier fingerprints stay the same
            found["dtype"] = self._declared.str
        return fingerprint_of(
            {"kind": "token_windows", "dataset": self.dataset.fingerprint, **found}
        )

    def __repr__(self) -> str:
        options = [f"{k}={v!r}" for k, v in self._options.items() if v and k != "dtype"]
        return (
            f"TokenWindows({self.dataset.where!r}, {self.field!r}, seq_len={self.seq_len}"
            f"{''.join(', ' + o for o in options)}, dtype={self._dtype.name!r}, "
            f"num_windows={self._num_windows})"
        )

    def read(
        self, indices: np.ndarray, out: Mapping[str, np.ndarray], rows: np.ndarray | None = None
    ) -> None:
        """Fill the first ``len(indices)`` rows of every `layout` field of ``out``, or rows
        ``rows`` (one per index, any order) when given: window ``indices[i]`` goes to row
        ``rows[i]``, each copied once, straight from the mapped shard.

        Raises:
            IndexError: an index outside ``[0, len(self))``, or a row outside ``out``.
            ConfigError: ``rows`` not one per index.
        """
        starts = self._window_starts(indices)
        if rows is None:
            dest: list[int] | range = range(len(starts))
        else:
            dest = check_rows(indices, rows, "views.TokenWindows").tolist()
        if self.split_targets:
            self._copy_rows(starts, out["inputs"], 0, dest)
            self._copy_rows(starts, out["targets"], 1, dest)
        else:
            self._copy_rows(starts, out[self.field], 0, dest)
        if self.document_structure:
            self._document_fields(starts, out["segment_ids"], out["positions"], rows)

    def advise(self, indices: np.ndarray) -> None:
        """Ask the kernel to read ahead the pages of these windows (advisory, never raises)."""
        itemsize = self._stored.itemsize  # bytes as stored, whatever the declared dtype
        starts = self._window_starts(indices)
        shards, local, inside = self._locate(starts, self.width)
        if not inside.all():  # rare: split the windows that cross a shard into pieces
            pieces = [
                p for start in starts[~inside].tolist() for p in self._pieces(start, self.width)
            ]
            extra = np.array(pieces, dtype=np.int64).reshape(-1, 3)
            shards = np.concatenate([shards[inside], extra[:, 0]])
            local = np.concatenate([local[inside], extra[:, 1]])
            stops = np.concatenate([local[: inside.sum()] + self.width, extra[:, 2]])
        else:
            stops = local + self.width
        self.dataset.prefetch(np.unique(shards).tolist())  # at a URL: fetch ahead, in order
        for shard, lo, hi in merge_ranges(shards, local * itemsize, stops * itemsize):
            if (mapped := self.dataset.shard_if_ready(shard)) is not None:
                mapped.advise(self.field, lo, hi)

    def _window_starts(self, indices: np.ndarray) -> np.ndarray:
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= self._num_windows):
            raise IndexError(
                f"views.TokenWindows: window index out of range ({indices.min()}..{indices.max()}, "
                f"expected [0, {self._num_windows}))"
            )
        return indices * self.stride

    def _load(self, shard: int) -> np.ndarray:
        return self.dataset.shard(shard).flat(self.field)

    def _doc_offsets(self, shard: int) -> np.ndarray:
        offsets = self._offsets[shard]
        if offsets is None:
            raw = self.dataset.shard(shard).element_offsets(self.field)
            offsets = np.asarray(raw, dtype=np.int64)
            if self._keeps:
                self._offsets[shard] = offsets
        return offsets

    def _document_fields(
        self,
        starts: np.ndarray,
        segment_ids: np.ndarray,
        positions: np.ndarray,
        rows: np.ndarray | None,
    ) -> None:
        n, width = len(starts), self._doc_width
        if rows is not None:  # computed for the windows' own rows, then put in place
            found = np.empty((2, n, width), np.int32)
            self._document_fields(starts, found[0], found[1], None)
            segment_ids[rows], positions[rows] = found[0], found[1]
            return
        marks = np.zeros((n, width), dtype=bool)
        for row, start in enumerate(starts.tolist()):
            marks[row, self._doc_starts(start) - start] = True
        marks[:, 0] = False
        np.cumsum(marks, axis=1, dtype=np.int32, out=segment_ids[:n])
        segment_ids[:n] += 1
        columns = np.arange(width, dtype=np.int32)
        last_start = np.where(marks, columns, 0)
        np.maximum.accumulate(last_start, axis=1, out=last_start)
        np.subtract(columns, last_start, out=positions[:n], casting="unsafe")

    def _doc_starts(self, start: int) -> np.ndarray:
        """Global element indices in [start, start + doc width) where a document begins."""
        found = []
        for shard, lo, hi in self._pieces(start, self._doc_width):
            offsets = self._doc_offsets(shard)
            first, last = np.searchsorted(offsets, [lo, hi], side="left")
            found.append(offsets[first:last] + self._starts[shard])
        return np.concatenate(found) if found else np.zeros(0, np.int64)


class WindowBlend(_Stream):
    """Several `TokenWindows` of one layout read as one stream, their shards side by side:
    a mixture batch is one pass over its rows, whatever source each row comes from (no
    call, sort or scatter per source). `blend_of` says which sources allow it.

    Thread-safety: one reader thread at a time, like the sources.
    """

    def __init__(self, sources: Sequence[TokenWindows]) -> None:
        self._sources = list(sources)
        sizes = [source.num_elements for source in sources]
        self._bases = np.cumsum([0, *sizes[:-1]], dtype=np.int64)
        parts = [s._starts[:-1] + int(b) for s, b in zip(sources, self._bases, strict=True)]
        self._starts = np.concatenate([*parts, [sum(sizes)]]).astype(np.int64)
        self._owners = [(s, k) for s in sources for k in range(len(s._starts) - 1)]
        self._flats = [None] * len(self._owners)
        self._keeps = all(source._keeps for source in sources)
        self._strides = np.array([source.stride for source in sources], np.int64)
        self._sizes = np.array([len(source) for source in sources], np.int64)
        first = sources[0]
        names = ("inputs", "targets") if first.split_targets else (first.field,)
        self._fields = tuple(zip(names, (0, 1), strict=False))

    def read(self, source_ids: np.ndarray, indices: np.ndarray, out: Mapping[str, Any]) -> None:
        """Fill the first ``len(indices)`` rows of ``out``: row i with window ``indices[i]``
        of source ``source_ids[i]``, each copied once, straight from the mapped shard.

        Raises:
            IndexError: an index outside its source's ``[0, len(source))``.
        """
        ids, indices = np.asarray(source_ids, np.intp), np.asarray(indices, np.int64)
        sizes = self._sizes[ids]
        bad = np.flatnonzero((indices < 0) | (indices >= sizes))
        if len(bad):
            i = int(bad[0])
            raise IndexError(
                f"views.TokenWindows: window index out of range ({int(indices[i])} of source "
                f"{int(ids[i])}, expected [0, {int(sizes[i])}))"
            )
        starts = indices * self._strides[ids] + self._bases[ids]
        for name, shift in self._fields:
            self._copy_rows(starts, out[name], shift, range(len(starts)))

    def _load(self, shard: int) -> np.ndarray:
        source, own = self._owners[shard]
        return source._flat(own)


def blend_of(sources: Sequence[Any]) -> WindowBlend | None:
    """A `WindowBlend` of `sources` when all are `TokenWindows` that cut one field the same
    way without document structure (strides may differ); None otherwise."""
    if not sources or not all(isinstance(source, TokenWindows) for source in sources):
        return None
    cuts = {(s.field, s.width, s.split_targets, s.document_structure, s._dtype) for s in sources}
    if len(cuts) > 1 or sources[0].document_structure:
        return None
    return WindowBlend(sources)


def check_rows(indices: np.ndarray, rows: np.ndarray, where: str) -> np.ndarray:
    """`rows` as an int64 array when it names one destination row per index.

    Raises:
        ConfigError: a count or shape that differs from the indices'.
    """
    rows = np.asarray(rows, dtype=np.int64)
    if rows.shape != np.shape(indices):
        raise ConfigError(
            f"{where}.read: rows {rows.shape} (expected one per index, {np.shape(indices)})"
        )
    return rows


def dataset_of(dataset: Any, where: str) -> Dataset:
    """`dataset` itself, or the dataset at a path (`open_dataset`).

    Raises:
        ConfigError: anything else, saying how to open one.
    """
    if isinstance(dataset, str | os.PathLike):
        return open_dataset(dataset)
    if not isinstance(dataset, Dataset):
        raise ConfigError(
            f"{where}: not a dataset ({type(dataset).__name__}, expected a Dataset or its path:"
            " open it first with roxxel.open_dataset(path))"
        )
    return dataset


def _check_cast(stored: np.dtype, dtype: Any) -> np.dtype:
    try:
        declared = np.dtype(dtype)
    except TypeError:
        raise ConfigError(
            f"views.TokenWindows: dtype ({dtype!r}, expected a numpy dtype such as 'int32')"
        ) from None
    if not np.can_cast(stored, declared, "safe"):
        raise ConfigError(
            f"views.TokenWindows: dtype {declared.name} cannot hold every {stored.name} token "
            f"({dtype!r}, expected a dtype {stored.name} casts to safely, such as int64)"
        )
    return declared


def _check_token_field(dataset: Any, field: str, seq_len: int, stride: int) -> np.dtype:
    if field not in dataset.schema:
        raise ConfigError(
            f"views.TokenWindows: unknown field ({field!r}, expected one of "
            f"{list(dataset.schema.names)})"
        )
    spec = dataset.schema[field]
    if spec.kind != "array" or tuple(spec.shape) != (None,):
        raise ConfigError(
            f"views.TokenWindows: field {field!r} is {spec.spec} (expected a 1-D variable-length "
            "numeric field such as int32[])"
        )
    for name, value in (("seq_len", seq_len), ("stride", stride)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"views.TokenWindows: {name} ({value!r}, expected an int >= 1)")
    return np.dtype(spec.dtype)
