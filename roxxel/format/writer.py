"""`ShardWriter`: one shard file, written beside its target and renamed into place whole.

Every file appears atomically: bytes go to a temp file in the same folder, which is
fsynced, renamed over the final name, and the folder fsynced. A writer that fails or is
killed leaves the old file (if any) untouched and no file that opens as a valid shard under
the final name. The manifest of a dataset is written last.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from array import array
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np
import xxhash
import zstandard

from roxxel.errors import ConfigError
from roxxel.format.atomic import AtomicFile
from roxxel.format.layout import ColumnLayout, Extent, Layout, layout_to_json
from roxxel.format.manifest import ShardInfo, checksum_text, json_object
from roxxel.format.schema import Codec, Field, Ragged, Schema, parse_codec
from roxxel.format.spec import (
    HEADER_BYTES,
    Trailer,
    align,
    checksum,
    index_hasher,
    pack_header,
    pack_trailer,
    seal,
)
from roxxel.version import __version__

__all__ = ["ShardInfo", "ShardWriter", "parse_compress", "write_shard"]

WRITER_VERSION = __version__  # recorded in every shard; the golden-file test pins it
SPOOL_BYTES = 64 << 20  # secondary columns stay in memory up to this size, then spill to disk
COPY_BYTES = 8 << 20


def parse_compress(compress: Mapping[str, str | Codec] | None, schema: Schema) -> dict[str, Codec]:
    """Codecs per field from ``{"text": "zstd:3"}``; fields not named are stored raw."""
    codecs = {name: Codec() for name in schema.names}
    for name, spec in (compress or {}).items():
        if name not in codecs:
            raise ConfigError(f"compress: unknown field {name!r} (expected one of {list(codecs)})")
        codecs[name] = parse_codec(spec, f"compress[{name!r}]")
    return codecs


class _Column:
    """One field's bytes while a shard is being written: data, offsets, checksums."""

    def __init__(self, field: Field, codec: Codec, sink: IO[bytes]):
        self.field, self.codec, self.sink = field, codec, sink
        self.nbytes = 0
        self.offsets = array("Q", [0]) if ColumnLayout.needs_offsets(field, codec) else None
        self.decoded = array("Q", [0]) if ColumnLayout.needs_decoded(field, codec) else None
        self.checksums = array("Q")
        self.zstd = (
            zstandard.ZstdCompressor(level=codec.level, write_content_size=True)
            if codec.name == "zstd"
            else None
        )

    def extend_fixed(self, raw: memoryview, num: int) -> None:
        """Append ``num`` raw fixed-size records in one write (no codec, no offsets)."""
        unit = raw.nbytes // num if num else 0
        self.sink.write(raw)
        digest, sums = xxhash.xxh3_64_intdigest, self.checksums
        sums.extend(digest(raw[i * unit : (i + 1) * unit]) for i in range(num))
        self.nbytes += raw.nbytes

    def extend_ragged(self, raw: memoryview, sizes: list[int]) -> None:
        """Append records lying back to back in ``raw`` (``sizes`` bytes each), one write."""
        if self.zstd is not None or self.offsets is None:
            view, at = raw.cast("B"), 0
            for size in sizes:
                self.append(view[at : at + size])
                at += size
            return
        self.sink.write(raw)
        ends = np.cumsum(sizes, dtype=np.int64)
        starts = (ends - np.asarray(sizes, np.int64)).tolist()
        view = raw.cast("B")
        digest = xxhash.xxh3_64_intdigest
        self.checksums.extend(digest(view[a:b]) for a, b in zip(starts, ends.tolist(), strict=True))
        self.offsets.extend((ends + self.nbytes).tolist())
        self.nbytes += raw.nbytes

    def extend(self, raws: list[memoryview]) -> None:
        """Append records given as their raw bytes (compressed here for a zstd field)."""
        if self.zstd is not None or self.offsets is None:
            for raw in raws:
                self.append(raw)
            return
        self.sink.writelines(raws)  # one copy into the buffer, no joined temporary
        self.checksums.extend(map(xxhash.xxh3_64_intdigest, raws))
        ends = np.cumsum([raw.nbytes for raw in raws], dtype=np.int64) + self.nbytes
        self.offsets.extend(ends.tolist())
        self.nbytes = int(ends[-1]) if raws else self.nbytes

    def append(self, raw: memoryview) -> None:
        stored = raw if self.zstd is None else self.zstd.compress(raw)
        self.sink.write(stored)
        self.nbytes += len(stored)
        self.checksums.append(checksum(stored))
        if self.offsets is not None:
            self.offsets.append(self.nbytes)
        if self.decoded is not None:
            self.decoded.append(self.decoded[-1] + raw.nbytes)


class ShardWriter:
    """Writes records into one shard file, in one streaming pass; a context manager.

    Records are dicts of field name -> value (numpy array, scalar, ``bytes`` or ``str``),
    checked against the schema before any of their bytes are written. The file appears
    under ``path`` only when `close` succeeds; on an exception it never does.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        schema: Schema | Mapping[str, str],
        compress: Mapping[str, str | Codec] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ):
        self.path = Path(path)
        self.schema = Schema.parse(schema)
        self.metadata = json_object(metadata, f"{self.path}: metadata")
        codecs = parse_compress(compress, self.schema)
        self.num_records = 0
        self._tmp = AtomicFile(self.path)
        self._tmp.file.write(pack_header())
        primary = _primary(self.schema)
        self._columns = [
            _Column(f, codecs[f.name], self._tmp.file if f is primary else _spool(self.path))
            for f in self.schema
        ]
        self._closed = False
        self._info: ShardInfo | None = None

    @property
    def num_bytes(self) -> int:
        """Bytes of record data written so far (the file adds tables and metadata)."""
        return sum(c.nbytes for c in self._columns)

    def write(self, record: Mapping[str, Any]) -> None:
        """Append one record. Raises ConfigError (nothing written) if it breaks the schema."""
        if self._closed:
            raise ConfigError(f"{self.path}: write after close")
        where = f"{self.path}: record {self.num_records}"
        if not isinstance(record, Mapping):
            raise ConfigError(f"{where}: expected a dict of fields ({type(record).__name__})")
        if set(record) != set(self.schema.names):
            missing = sorted(set(self.schema.names) - set(record))
            extra = sorted(set(record) - set(self.schema.names))
            raise ConfigError(f"{where}: missing fields {missing}, unknown fields {extra}")
        raws = [c.field.to_bytes(record[c.field.name], where) for c in self._columns]
        for column, raw in zip(self._columns, raws, strict=True):
            column.append(raw)
        self.num_records += 1

    def write_batch(self, columns: Mapping[str, Any]) -> None:
        """Append many records given by field: ``{name: n values}`` (an array for fixed fields).

        Fixed-shape uncompressed fields are checked and written as one block each, which
        is much faster than `write` per record; a variable-length field may be given as a
        `roxxel.Ragged` (values back to back plus lengths), also written as one block. All values are checked before any byte of
        the batch is written; on error nothing of the batch is written.
        """
        where = f"{self.path}: records {self.num_records}.."
        num = self._batch_size(columns, where)
        encoded: list[Any] = []
        for column in self._columns:
            values, field = columns[column.field.name], column.field
            if column.offsets is None:
                encoded.append(field.batch_to_bytes(values, num, where))
            elif isinstance(values, Ragged):
                encoded.append(field.ragged_to_bytes(values, num, where))
            else:
                encoded.append(field.records_to_bytes(values, self.num_records, str(self.path)))
        for column, raw in zip(self._columns, encoded, strict=True):
            if isinstance(raw, list):
                column.extend(raw)
            elif isinstance(raw, tuple):
                column.extend_ragged(*raw)
            else:
                column.extend_fixed(raw, num)
        self.num_records += num

    def _batch_size(self, columns: Mapping[str, Any], where: str) -> int:
        if self._closed:
            raise ConfigError(f"{self.path}: write after close")
        if not isinstance(columns, Mapping) or set(columns) != set(self.schema.names):
            found = sorted(columns) if isinstance(columns, Mapping) else type(columns).__name__
            raise ConfigError(f"{where}: batch fields {found} (expected {list(self.schema.names)})")
        sizes = {name: len(values) for name, values in columns.items()}
        if len(set(sizes.values())) != 1:
            raise ConfigError(f"{where}: fields of a batch differ in length ({sizes})")
        return next(iter(sizes.values()))

    def close(self) -> ShardInfo:
        """Finish the file: columns, tables, metadata, trailer; fsync; rename into place."""
        if self._info is not None:
            return self._info
        if self._closed:
            raise ConfigError(f"{self.path}: closed after abort")
        self._closed = True
        try:
            self._info = self._finish()
        except BaseException:
            self.abort()
            raise
        return self._info

    def abort(self) -> None:
        """Drop everything written; the final path is left as it was."""
        self._closed = True
        for column in self._columns:
            if column.sink is not self._tmp.file:
                column.sink.close()
        self._tmp.discard()

    def _finish(self) -> ShardInfo:
        out = self._tmp.file
        data = self._write_columns(out)
        tables_offset = _pad_to(out, out.tell())
        index = _HashingWriter(out, index_hasher(pack_header()))
        tables = [self._write_tables(index, c) for c in self._columns]
        meta_offset = index.pad()
        columns = tuple(
            ColumnLayout(c.field, c.codec, data[i], *tables[i])  # pyright: ignore[reportArgumentType]
            for i, c in enumerate(self._columns)
        )
        layout = Layout(self.num_records, columns, f"roxxel {WRITER_VERSION}", self.metadata)
        meta = layout_to_json(layout)
        index.write(meta)
        trailer = Trailer(self.num_records, tables_offset, meta_offset, len(meta), 0)
        digest = seal(index.hasher, trailer)
        out.write(
            pack_trailer(Trailer(self.num_records, tables_offset, meta_offset, len(meta), digest))
        )
        num_bytes = out.tell()
        self._tmp.publish()
        return ShardInfo(self.path, self.num_records, num_bytes, checksum_text(digest))

    def _write_columns(self, out: IO[bytes]) -> list[Extent]:
        extents: dict[int, Extent] = {}
        order = sorted(range(len(self._columns)), key=lambda i: self._columns[i].sink is not out)
        position = HEADER_BYTES
        for i in order:
            column = self._columns[i]
            start = _pad_to(out, position) if column.sink is not out else HEADER_BYTES
            if column.sink is not out:
                column.sink.seek(0)
                shutil.copyfileobj(column.sink, out, COPY_BYTES)
                column.sink.close()
            extents[i] = Extent(start, column.nbytes)
            position = start + column.nbytes
        return [extents[i] for i in range(len(self._columns))]

    def _write_tables(self, out: _HashingWriter, column: _Column) -> tuple[Extent | None, ...]:
        found: list[Extent | None] = []
        for table in (column.offsets, column.decoded, column.checksums):
            if table is None:
                found.append(None)
                continue
            start = out.pad()
            if sys.byteorder != "little":
                table = array(table.typecode, table)
                table.byteswap()
            data = memoryview(table).cast("B")
            out.write(data)
            found.append(Extent(start, data.nbytes))
        return tuple(found)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.close()


def write_shard(
    path: str | os.PathLike[str],
    records: Iterable[Mapping[str, Any]],
    schema: Schema | Mapping[str, str],
    **options: Any,
) -> ShardInfo:
    """Write ``records`` into one shard at ``path``; options as for `ShardWriter`."""
    with ShardWriter(path, schema, **options) as writer:
        for record in records:
            writer.write(record)
        return writer.close()


class _HashingWriter:
    """Writes through to a file while a running XXH3-64 sees every byte that goes by."""

    def __init__(self, out: IO[bytes], hasher: xxhash.xxh3_64):
        self.out, self.hasher = out, hasher

    def write(self, data: bytes | memoryview) -> None:
        self.out.write(data)
        self.hasher.update(data)

    def tell(self) -> int:
        return self.out.tell()

    def pad(self) -> int:
        """Write zeros up to the next 64-byte boundary; return that offset."""
        here = self.out.tell()
        self.write(bytes(align(here) - here))
        return align(here)


def _pad_to(out: IO[bytes], position: int) -> int:
    out.write(bytes(align(position) - position))
    return align(position)


def _spool(path: Path) -> IO[bytes]:
    return tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES, dir=str(path.parent))


def _primary(schema: Schema) -> Field:
    """The field streamed straight into the file: the first variable one, else the widest."""
    variable = [f for f in schema if f.is_variable]
    return variable[0] if variable else max(schema, key=lambda f: f.unit_bytes)
