"""Writers: one shard file (`ShardWriter`) and a directory of shards (`DatasetWriter`).

Every file appears atomically: bytes go to a temp file in the same folder, which is
fsynced, renamed over the final name, and the folder fsynced. A writer that fails or is
killed leaves the old file (if any) untouched and no file that opens as a valid shard under
the final name. The manifest of a dataset is written last.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import sys
import tempfile
from array import array
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any

import zstandard

from roxxel.errors import ConfigError
from roxxel.format import HEADER_BYTES, Trailer, align, crc32, pack_header, pack_trailer, seal_crc
from roxxel.layout import ColumnLayout, Extent, Layout, layout_to_json
from roxxel.manifest import MANIFEST_NAME, Manifest, ShardEntry, ShardInfo, checksum_text
from roxxel.schema import Codec, Field, Schema, parse_codec
from roxxel.version import __version__

__all__ = ["DatasetWriter", "ShardInfo", "ShardWriter", "publish_manifest", "write_shard"]

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
        self.checksums = array("I")
        self.zstd = (
            zstandard.ZstdCompressor(level=codec.level, write_content_size=True)
            if codec.name == "zstd"
            else None
        )

    def append(self, raw: memoryview) -> None:
        stored = raw if self.zstd is None else self.zstd.compress(raw)
        self.sink.write(stored)
        self.nbytes += len(stored)
        self.checksums.append(crc32(stored))
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
        self._tmp = _TempFile(self.path)
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
        index = _CrcWriter(out, crc32(pack_header()))
        tables = [self._write_tables(index, c) for c in self._columns]
        meta_offset = index.pad()
        columns = tuple(
            ColumnLayout(c.field, c.codec, data[i], *tables[i]) for i, c in enumerate(self._columns)
        )
        layout = Layout(self.num_records, columns, f"roxxel {WRITER_VERSION}", self.metadata)
        meta = layout_to_json(layout)
        index.write(meta)
        trailer = Trailer(self.num_records, tables_offset, meta_offset, len(meta), 0)
        crc = seal_crc(index.crc, trailer)
        out.write(
            pack_trailer(Trailer(self.num_records, tables_offset, meta_offset, len(meta), crc))
        )
        num_bytes = out.tell()
        self._tmp.publish()
        return ShardInfo(self.path, self.num_records, num_bytes, checksum_text(crc))

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

    def _write_tables(self, out: _CrcWriter, column: _Column) -> tuple[Extent | None, ...]:
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


class DatasetWriter:
    """Writes a dataset directory: shards of about ``shard_bytes`` each, then the manifest.

    A context manager: leaving the block normally closes the last shard and writes
    ``manifest.json`` (atomically, last); leaving it with an exception drops the shard in
    progress and writes no manifest. A directory that already holds a dataset is refused
    unless ``overwrite=True``, which removes the old manifest before the first new shard.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        schema: Schema | Mapping[str, str],
        *,
        shard_bytes: int = 1 << 30,
        compress: Mapping[str, str | Codec] | None = None,
        overwrite: bool = False,
        metadata: Mapping[str, Any] | None = None,
        shard_prefix: str = "shard",
    ):
        self.path = Path(path)
        self.schema = Schema.parse(schema)
        if not (isinstance(shard_bytes, int) and shard_bytes > 0):
            raise ConfigError(f"{self.path}: shard_bytes {shard_bytes!r} (expected an int > 0)")
        self.shard_bytes = shard_bytes
        self.metadata = json_object(metadata, f"{self.path}: metadata")
        self._compress = parse_compress(compress, self.schema)
        self._prefix = shard_prefix
        manifest = self.path / MANIFEST_NAME
        if manifest.exists() and not overwrite:
            raise ConfigError(f"{self.path}: already holds a dataset (pass overwrite=True)")
        self.path.mkdir(parents=True, exist_ok=True)
        if manifest.exists():
            manifest.unlink()
        self.shards: list[ShardInfo] = []
        self._current: ShardWriter | None = None
        self._closed = False

    @property
    def num_records(self) -> int:
        done = sum(s.num_records for s in self.shards)
        return done + (self._current.num_records if self._current else 0)

    def write(self, record: Mapping[str, Any]) -> None:
        """Append one record, starting a new shard once the current one is full."""
        if self._closed:
            raise ConfigError(f"{self.path}: write after close")
        if self._current is None:
            name = f"{self._prefix}-{len(self.shards):05d}.rxs"
            self._current = ShardWriter(
                self.path / name, self.schema, self._compress, self.metadata
            )
        self._current.write(record)
        if self._current.num_bytes >= self.shard_bytes:
            self.shards.append(self._current.close())
            self._current = None

    def close(self) -> Path:
        """Close the last shard and write the manifest; returns the manifest's path."""
        if self._closed:
            raise ConfigError(f"{self.path}: closed twice")
        self._closed = True
        if self._current is not None:
            self.shards.append(self._current.close())
            self._current = None
        entries = [
            ShardEntry(s.path.name, s.num_records, s.num_bytes, s.checksum) for s in self.shards
        ]
        return publish_manifest(self.path, Manifest(self.schema, tuple(entries), self.metadata))

    def abort(self) -> None:
        """Drop the shard in progress; write no manifest."""
        self._closed = True
        if self._current is not None:
            self._current.abort()
            self._current = None

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.close()


def publish_manifest(folder: Path, manifest: Manifest) -> Path:
    """Write ``folder/manifest.json`` atomically (temp file, fsync, rename, fsync folder)."""
    target = folder / MANIFEST_NAME
    tmp = _TempFile(target)
    try:
        tmp.file.write(manifest.to_json())
        tmp.publish()
    except BaseException:
        tmp.discard()
        raise
    return target


class _TempFile:
    """A temp file beside ``final`` that becomes ``final`` atomically on `publish`."""

    def __init__(self, final: Path):
        self.final = final
        if final.is_dir():
            raise ConfigError(f"{final}: is a directory (expected a file path)")
        # Not mkstemp: its 0600 mode would survive the rename; 0666 honours the umask.
        name = final.parent / f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        self.name = name
        self.file = os.fdopen(fd, "wb", buffering=1 << 20)

    def publish(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.name, self.final)
        _fsync_dir(self.final.parent)

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.name)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _CrcWriter:
    """Writes through to a file while keeping a running CRC-32 of what went by."""

    def __init__(self, out: IO[bytes], crc: int):
        self.out, self.crc = out, crc

    def write(self, data: bytes | memoryview) -> None:
        self.out.write(data)
        self.crc = crc32(data, self.crc)

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
    return tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES, dir=path.parent)


def _primary(schema: Schema) -> Field:
    """The field streamed straight into the file: the first variable one, else the widest."""
    variable = [f for f in schema if f.is_variable]
    return variable[0] if variable else max(schema, key=lambda f: f.unit_bytes)


def json_object(value: Mapping[str, Any] | None, where: str) -> dict[str, Any]:
    """A copy of ``value`` as a dict, checked to be plain JSON (ConfigError otherwise)."""
    data = dict(value or {})
    try:
        json.dumps(data, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: not JSON-serializable ({exc})") from None
    return data
