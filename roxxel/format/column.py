"""One field of an open shard: checked once, then O(1) record access and batch gathers.

Uncompressed records are read-only numpy views into the mapping; zstd records decode into
fresh arrays, with the decoded size known (and bounded) before anything is allocated.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import numpy as np
import xxhash
import zstandard

from roxxel.format.layout import ColumnLayout, Extent
from roxxel.format.spec import ZSTD_MAX_RATIO, ZSTD_SLACK_BYTES, check_offsets, fail

__all__ = ["Column"]

# one decompressor per thread: zstandard allows no two threads in one at once (the host
# threads of a Loader decode at the same time), and making one per record costs more
_LOCAL = threading.local()
WHY = {"R16": "checksum mismatch", "R17": "str is not UTF-8", "R18": "bool byte not 0 or 1"}


def _decompressor() -> zstandard.ZstdDecompressor:
    """The calling thread's zstd decompressor."""
    try:
        return _LOCAL.zstd
    except AttributeError:
        _LOCAL.zstd = zstandard.ZstdDecompressor()
        return _LOCAL.zstd


class Column:
    """Read access to one field of one shard; every table checked on construction (R13, R15)."""

    def __init__(self, buf: np.ndarray, layout: ColumnLayout, num_records: int, path: object):
        self.field = layout.field
        self.name = layout.field.name
        self.path = path
        self.compressed = layout.codec.name != "none"
        self.num_records = num_records
        self.data = _slice(buf, layout.data)
        self._data_at = layout.data.offset
        self._view = memoryview(self.data)  # pyright: ignore[reportArgumentType]
        self.checksums = _slice(buf, layout.checksums).view("<u8")
        self.offsets = self._table(buf, layout.offsets, layout.data.nbytes, self._stored_unit)
        self.decoded = None
        if layout.decoded is not None:
            self.decoded = _slice(buf, layout.decoded).view("<u8")
            self._check_decoded(self.decoded, layout.decoded.offset)
        elif self.compressed:
            self._check_fixed_ratio(layout.data.offset)
        field = self.field
        self.unit = field.unit_bytes
        self.inner = field.inner_shape
        if not self.compressed:
            flat = self.data.view(field.dtype)
            self.flat = (
                flat if field.is_variable else flat.reshape((num_records, *field.fixed_shape))
            )

    @property
    def _stored_unit(self) -> int:
        return self.field.unit_bytes if self.field.is_variable and not self.compressed else 1

    def _table(self, buf: np.ndarray, extent: Extent | None, limit: int, unit: int) -> Any:
        if extent is None:
            return None
        table = _slice(buf, extent).view("<u8")
        check_offsets(table, limit, unit, (self.path, extent.offset, self.name))
        return table

    def _check_decoded(self, decoded: np.ndarray, at: int) -> None:
        check_offsets(
            decoded,
            int(decoded[-1]) if decoded.size else 0,
            self.field.unit_bytes,
            (self.path, at, self.name),
        )
        self._check_ratio(np.diff(decoded.astype(np.int64)), at)

    def _check_fixed_ratio(self, at: int) -> None:
        self._check_ratio(np.full(self.num_records, self.field.unit_bytes, np.int64), at)

    def _check_ratio(self, decoded_sizes: np.ndarray, at: int) -> None:
        """R15: no record may claim to decode to more than zstd could produce from its bytes."""
        stored = np.diff(self.offsets.astype(np.int64))
        bad = np.flatnonzero(decoded_sizes > stored * ZSTD_MAX_RATIO + ZSTD_SLACK_BYTES)
        if bad.size:
            raise fail(
                self.path,
                at,
                "R15",
                f"field {self.name!r}: record {int(bad[0])} claims"
                f" {int(decoded_sizes[bad[0]])} decoded bytes from {int(stored[bad[0]])}",
            )

    def stored(self, i: int) -> np.ndarray:
        """The bytes of record ``i`` as stored (compressed for zstd fields)."""
        if self.offsets is None:
            return self.data[i * self.unit : (i + 1) * self.unit]
        return self.data[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def record(self, i: int, verify: bool = False) -> Any:
        """Record ``i`` of this field (``0 <= i < num_records``, checked by the caller)."""
        if verify:
            self.verify_record(i)
        if self.compressed:
            return self._decode(i)
        field = self.field
        if not field.is_variable:
            return self.flat[i, ...]
        start, stop = int(self.offsets[i]), int(self.offsets[i + 1])
        if field.kind == "str":
            return self._text(i, self.data[start:stop])
        if field.kind == "bytes":
            return self.data[start:stop]
        part = self.flat[start // field.dtype.itemsize : stop // field.dtype.itemsize]
        return part.reshape(-1, *self.inner) if self.inner else part

    def length(self, i: int) -> int:
        """Elements along the variable dimension of record ``i``."""
        table = self.decoded if self.decoded is not None else self.offsets
        return (int(table[i + 1]) - int(table[i])) // self.unit

    def decoded_nbytes(self, i: int) -> int:
        """Bytes record ``i`` of a zstd field decodes to, from the tables (nothing decoded)."""
        if self.decoded is None:
            return self.unit
        return int(self.decoded[i + 1]) - int(self.decoded[i])

    def lengths(self, indices: np.ndarray) -> np.ndarray:
        """Vectorized `length` (int64)."""
        table = self.decoded if self.decoded is not None else self.offsets
        return (table[indices + 1] - table[indices]).astype(np.int64) // self.unit

    def take(self, indices: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Stack fixed-shape records ``indices`` into ``out`` (or a new array)."""
        if not self.compressed:
            # Indices are range-checked by the caller; mode="raise" would buffer ``out``.
            return self.flat.take(indices, axis=0, out=out, mode="wrap")
        dest = (
            np.empty((len(indices), *self.field.fixed_shape), self.field.dtype)
            if out is None
            else out
        )
        for row, i in enumerate(indices.tolist()):
            dest[row] = self._decode(i)
        return dest

    def pad_into(self, indices: np.ndarray, out: np.ndarray) -> None:
        """Copy variable-length records into the rows of ``out``, zero past each record."""
        out[...] = 0
        for row, i in enumerate(indices.tolist()):
            value = self.record(i)
            if isinstance(value, str):
                value = np.frombuffer(value.encode(), np.uint8)
            out[row, : len(value)] = value

    def verify_record(self, i: int) -> None:
        """Raise FormatError (R16) if record ``i``'s stored bytes fail their checksum."""
        self.verify_records((i,))

    def verify_records(self, indices: Iterable[int]) -> None:
        """Raise FormatError for the first of ``indices`` that fails its checksum (R16) or,
        in a bool field, holds a byte other than 0 or 1 (R18)."""
        indices = list(indices)
        for rule, bad in (("R16", self.mismatches(indices)), ("R18", self.not_bool(indices))):
            if bad:
                i = bad[0]
                raise fail(self.path, self._stored_at(i), rule, f"record {i} {self._why(rule)}")

    def mismatches(self, indices: Iterable[int]) -> list[int]:
        """Those of ``indices`` whose stored bytes fail their checksum (a tight C-call loop)."""
        data, sums, unit, offsets = self._view, self.checksums, self.unit, self.offsets
        digest = xxhash.xxh3_64_intdigest
        if offsets is None:
            return [i for i in indices if digest(data[i * unit : (i + 1) * unit]) != sums[i]]
        return [i for i in indices if digest(data[offsets[i] : offsets[i + 1]]) != sums[i]]

    def not_bool(self, indices: Iterable[int]) -> list[int]:
        """Those of ``indices`` whose bytes are not all 0 or 1, in an uncompressed bool field
        (a compressed one is checked as it decodes); [] for any other field."""
        if self.field.dtype != np.bool_ or self.compressed:
            return []
        raw = self.data
        if self.offsets is None:
            return [
                i for i in indices if raw[i * self.unit : (i + 1) * self.unit].max(initial=0) > 1
            ]
        offsets = self.offsets
        return [i for i in indices if raw[offsets[i] : offsets[i + 1]].max(initial=0) > 1]

    def bad_records(self) -> list[tuple[int, str]]:
        """Every record that breaks R16, R17 or R18, with what is wrong, in record order."""
        everything = range(self.num_records)
        found: dict[int, list[str]] = {}
        for rule, bad in (
            ("R16", self.mismatches(everything)),
            ("R17", self._not_utf8()),
            ("R18", self.not_bool(everything)),
        ):
            for i in bad:
                found.setdefault(i, []).append(WHY[rule])
        return [(i, f"field {self.name!r}: {'; '.join(found[i])}") for i in sorted(found)]

    def _not_utf8(self) -> list[int]:
        if self.field.kind != "str" or self.compressed:
            return []  # a compressed str is checked as it decodes
        bad = []
        for i in range(self.num_records):
            try:
                bytes(self.stored(i)).decode("utf-8")
            except UnicodeDecodeError:
                bad.append(i)
        return bad

    def _why(self, rule: str) -> str:
        return f"field {self.name!r}: {WHY[rule]}"

    def _stored_at(self, i: int) -> int:
        """The file offset of record ``i``'s stored bytes, for error messages."""
        return self._data_at + (i * self.unit if self.offsets is None else int(self.offsets[i]))

    def _decode(self, i: int) -> Any:
        field = self.field
        expected = field.unit_bytes if self.decoded is None else self.length(i) * self.unit
        frame = self.stored(i).tobytes()
        try:
            if zstandard.frame_content_size(frame) != expected:
                raise zstandard.ZstdError("frame content size differs from the table")
            raw = _decompressor().decompress(frame, max_output_size=expected)
        except zstandard.ZstdError as exc:
            raise fail(
                self.path,
                self._stored_at(i),
                "R15",
                f"record {i} field {self.name!r}: zstd frame does not decode ({exc})",
            ) from None
        if field.kind == "str":
            return self._text(i, raw)
        if field.dtype == np.bool_ and np.frombuffer(raw, np.uint8).max(initial=0) > 1:
            raise fail(self.path, self._stored_at(i), "R18", f"record {i} {self._why('R18')}")
        array = np.frombuffer(raw, field.dtype)
        if field.kind == "bytes":
            return array
        return array.reshape(self.inner if not field.is_variable else (-1, *self.inner))

    def _text(self, i: int, raw: Any) -> str:
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise fail(
                self.path,
                self._stored_at(i),
                "R17",
                f"record {i} {self._why('R17')}",
            ) from None


def _slice(buf: np.ndarray, extent: Extent) -> np.ndarray:
    return buf[extent.offset : extent.end]
