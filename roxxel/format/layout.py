"""A shard's metadata block: the JSON that says where every column and table lives.

Bytes in, values out (no I/O). `layout_to_json` gives the writer its deterministic bytes;
`parse_layout` checks untrusted bytes against rules R9-R12 and R14 of docs/format.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from roxxel.errors import ConfigError, FormatError, load_json
from roxxel.format.schema import Codec, Field, Schema, parse_codec
from roxxel.format.spec import (
    ALIGN,
    CHECKSUM_KIND,
    FORMAT_VERSION,
    HEADER_BYTES,
    Trailer,
    align,
    fail,
)

__all__ = ["ColumnLayout", "Extent", "Layout", "layout_to_json", "parse_layout"]

FORMAT_NAME = "roxxel-shard"
_TOP_KEYS = {"checksum", "fields", "format", "format_version", "metadata", "num_records", "writer"}
_FIELD_KEYS = {"checksums", "codec", "data", "decoded", "name", "offsets", "type"}


@dataclass(frozen=True, slots=True)
class Extent:
    """A byte range [offset, offset + nbytes) of the file."""

    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True, slots=True)
class ColumnLayout:
    """Where one field's data column and its tables are."""

    field: Field
    codec: Codec
    data: Extent
    offsets: Extent | None  # u64 x (N+1) stored byte offsets: variable or compressed fields
    decoded: Extent | None  # u64 x (N+1) decoded byte offsets: variable compressed fields
    checksums: Extent  # u64 x N, XXH3-64 of each record's stored bytes

    @staticmethod
    def needs_offsets(field: Field, codec: Codec) -> bool:
        return field.is_variable or codec.name != "none"

    @staticmethod
    def needs_decoded(field: Field, codec: Codec) -> bool:
        return field.is_variable and codec.name != "none"

    def tables(self) -> tuple[Extent, ...]:
        return tuple(e for e in (self.offsets, self.decoded, self.checksums) if e is not None)


@dataclass(frozen=True, slots=True)
class Layout:
    """Everything the metadata block says about a shard."""

    num_records: int
    columns: tuple[ColumnLayout, ...]
    writer: str
    metadata: dict[str, Any]

    @property
    def schema(self) -> Schema:
        return Schema(tuple(c.field for c in self.columns))


def layout_to_json(layout: Layout) -> bytes:
    """The metadata bytes: compact JSON with sorted keys, so equal layouts give equal bytes."""
    fields = [
        {
            "name": c.field.name,
            "type": c.field.spec,
            "codec": c.codec.spec,
            "data": _pair(c.data),
            "offsets": _pair(c.offsets),
            "decoded": _pair(c.decoded),
            "checksums": _pair(c.checksums),
        }
        for c in layout.columns
    ]
    doc = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "num_records": layout.num_records,
        "checksum": CHECKSUM_KIND,
        "writer": layout.writer,
        "metadata": layout.metadata,
        "fields": fields,
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _pair(extent: Extent | None) -> list[int] | None:
    return None if extent is None else [extent.offset, extent.nbytes]


def parse_layout(meta: bytes, trailer: Trailer, path: object) -> Layout:
    """Parse and check the metadata block of a shard whose trailer says ``trailer``."""
    at = trailer.meta_offset
    try:
        doc = load_json(meta, "metadata")
    except FormatError as exc:
        raise fail(path, at, "R9", f"metadata is not strict UTF-8 JSON ({exc})") from None
    if not isinstance(doc, dict) or set(doc) != _TOP_KEYS:
        keys = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise fail(path, at, "R9", f"metadata keys {keys} (expected {sorted(_TOP_KEYS)})")
    expected = (FORMAT_NAME, FORMAT_VERSION, trailer.num_records, CHECKSUM_KIND)
    found = (doc["format"], doc["format_version"], doc["num_records"], doc["checksum"])
    exact = type(found[1]) is int and type(found[2]) is int  # 1.0 and true equal 1 in Python
    if found != expected or not exact or not isinstance(doc["writer"], str):
        raise fail(path, at, "R9", f"metadata header {found} (expected {expected})")
    if not isinstance(doc["metadata"], dict):
        raise fail(path, at, "R9", "user metadata is not a JSON object")
    fields = doc["fields"]
    if not isinstance(fields, list) or not fields:
        raise fail(path, at, "R10", "metadata has no fields")
    columns = tuple(_parse_column(f, trailer.num_records, (path, at)) for f in fields)
    names = [c.field.name for c in columns]
    if len(set(names)) != len(names):
        raise fail(path, at, "R10", f"duplicate field names {names}")
    _check_packing(columns, trailer, path)
    return Layout(trailer.num_records, columns, doc["writer"], doc["metadata"])


def _parse_column(doc: Any, num: int, where: tuple[object, int]) -> ColumnLayout:
    path, at = where
    if not isinstance(doc, dict) or set(doc) != _FIELD_KEYS:
        raise fail(
            path, at, "R10", f"field entry {doc!r:.200} (expected keys {sorted(_FIELD_KEYS)})"
        )
    try:
        field = Field.parse(doc["name"], doc["type"])
        codec = parse_codec(doc["codec"])
    except (ConfigError, TypeError) as exc:
        raise fail(path, at, "R10", str(exc)) from None
    extents = {k: _extent(doc[k], k, where) for k in ("data", "offsets", "decoded", "checksums")}
    column = ColumnLayout(field, codec, **extents)  # type: ignore[arg-type]
    rule = f"field {field.name!r}"
    if (column.offsets is None) == ColumnLayout.needs_offsets(field, codec):
        raise fail(path, at, "R12", f"{rule}: offset table present={column.offsets is not None}")
    if (column.decoded is None) == ColumnLayout.needs_decoded(field, codec):
        raise fail(path, at, "R12", f"{rule}: decoded table present={column.decoded is not None}")
    sizes = [(column.checksums, 8 * num, "R14")]
    sizes += [(e, 8 * (num + 1), "R12") for e in (column.offsets, column.decoded) if e is not None]
    if column.offsets is None:
        sizes.append((column.data, num * field.unit_bytes, "R12"))
    for extent, nbytes, rule_id in sizes:
        if extent is not None and extent.nbytes != nbytes:
            raise fail(
                path,
                extent.offset,
                rule_id,
                f"{rule}: extent of {extent.nbytes} bytes (expected {nbytes} for {num} records)",
            )
    return column


def _extent(value: Any, key: str, where: tuple[object, int]) -> Extent | None:
    if value is None and key in ("offsets", "decoded"):
        return None
    ok = isinstance(value, list) and len(value) == 2
    ok = ok and all(type(v) is int and 0 <= v < 1 << 62 for v in value)  # pyright: ignore[reportOptionalIterable]
    if not ok or value is None:
        raise fail(
            where[0], where[1], "R11", f"{key} extent {value!r:.80} (expected [offset, nbytes])"
        )
    return Extent(value[0], value[1])


def _check_packing(columns: tuple[ColumnLayout, ...], trailer: Trailer, path: object) -> None:
    """R11: columns packed from byte 64, tables from tables_offset, each at the next 64."""
    data = sorted((c.data for c in columns), key=lambda e: (e.offset, e.nbytes))
    tables = sorted((t for c in columns for t in c.tables()), key=lambda e: (e.offset, e.nbytes))
    for extents, start, stop in (
        (data, HEADER_BYTES, trailer.tables_offset),
        (tables, trailer.tables_offset, trailer.meta_offset),
    ):
        cursor = start
        for extent in extents:
            if extent.offset != align(cursor):
                raise fail(
                    path,
                    extent.offset,
                    "R11",
                    f"extent at {extent.offset}"
                    f" (expected the next {ALIGN}-byte boundary after {cursor})",
                )
            cursor = extent.end
        if align(cursor) != stop and not (not extents and start == stop):
            raise fail(path, cursor, "R11", f"region ends at {cursor} (expected {stop})")
