"""`Shard`: one shard file, mapped read-only, validated once, then read in O(1) per record.

Opening checks every rule of docs/format.md that does not need the record bytes (R1-R15),
vectorized; the record rules (R16-R18: checksums, UTF-8, bool bytes) are checked by
`verify` or, per read, with ``verify=True``. The mapping is read-only: writing into a returned view raises.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from roxxel.errors import FormatError
from roxxel.format.column import Column
from roxxel.format.gather import (
    Batch,
    RecordSource,
    check_read_bytes,
    gather,
    normalize_indices,
    read_cap,
)
from roxxel.format.layout import Layout, parse_layout
from roxxel.format.manifest import ShardInfo, checksum_text
from roxxel.format.schema import Schema
from roxxel.format.spec import (
    HEADER_BYTES,
    TRAILER_BYTES,
    Trailer,
    fail,
    index_checksum,
    parse_header,
    parse_trailer,
)

__all__ = ["TEMP_NAME", "Corruption", "Shard", "open_shard", "read_trailer", "shard_infos"]

# Writers write ".<name>.<pid>.<hex>.tmp" and rename it when complete; a file of that name
# may be whole yet unpublished (its writer was killed during fsync), so it is never a shard.
TEMP_NAME = re.compile(r"^\..+\.[0-9]+\.[0-9a-f]{8}\.tmp$")


@dataclass(frozen=True, slots=True)
class Corruption:
    """One record of one field whose bytes break a rule (R16-R18), and what is wrong."""

    path: str
    record: int
    field: str
    message: str


class Shard(RecordSource):
    """One shard file: ``len()``, ``[i]`` -> dict of arrays, `get_batch`, `verify`.

    Thread-safe for reads. Pickles as its path (another process maps the file itself, and
    refuses a file whose index changed meanwhile). `close` drops this object's references;
    live record views keep the mapping alive. One read decodes or allocates at most
    ``max_decoded_bytes`` (see `read_cap`), else ConfigError before any of it.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        verify: bool = False,
        max_decoded_bytes: int | None = None,
    ):
        self.path = Path(path)
        self.verify_reads = verify
        self.max_decoded_bytes = read_cap(max_decoded_bytes)
        self._mmap, self._buf = _map_file(self.path)
        self.layout, self.index_checksum = _parse(self._buf, self.path)
        self.columns = {
            c.field.name: Column(self._buf, c, self.layout.num_records, self.path)
            for c in self.layout.columns
        }
        self._columns = tuple(self.columns.values())
        self._compressed = tuple(c for c in self._columns if c.compressed)
        self._num = self.layout.num_records

    @property
    def schema(self) -> Schema:
        return self.layout.schema

    @property
    def metadata(self) -> dict[str, Any]:
        return self.layout.metadata

    @property
    def num_bytes(self) -> int:
        return self._buf.size

    def record(self, i: int) -> dict[str, Any]:
        """Record ``i`` (already in range): every field, views where uncompressed."""
        if self._compressed:
            nbytes = sum(c.decoded_nbytes(i) for c in self._compressed)
            check_read_bytes(self.path, f"record {i}", nbytes, self.max_decoded_bytes)
        verify = self.verify_reads
        return {c.name: c.record(i, verify) for c in self._columns}

    def get_batch(
        self, indices: Any, fields: Sequence[str] | None = None, out: Batch | None = None
    ) -> Batch:
        """Records ``indices`` stacked (fixed fields) or padded (variable ones); see batch."""
        idx = normalize_indices(indices, self._num, self.path)
        if self.verify_reads:
            for column in self._columns:
                column.verify_records(idx.tolist())
        fields_read = self.schema.select(fields)
        groups = [(self.columns, None, idx)]
        return gather(groups, fields_read, idx.size, out, self.max_decoded_bytes, self.path)

    def flat(self, field: str) -> np.ndarray:
        """Every record of an uncompressed variable-length field, concatenated (a view)."""
        column = self._stream_column(field)
        return column.flat

    def element_offsets(self, field: str) -> np.ndarray:
        """Record boundaries of ``field`` in elements along its variable dimension (N+1)."""
        column = self._stream_column(field)
        return column.offsets // np.uint64(column.unit)

    def advise(self, field: str, start_bytes: int, stop_bytes: int) -> None:
        """Ask the kernel to read ahead bytes [start, stop) of a field's column (MADV_WILLNEED)."""
        column = self.columns[field]
        at = column._data_at + start_bytes
        page = mmap.PAGESIZE
        begin = at - at % page
        length = min(column._data_at + stop_bytes, self._buf.size) - begin
        if length > 0:  # mmap.madvise exists on Linux since Python 3.8
            self._mmap.madvise(mmap.MADV_WILLNEED, begin, length)

    def verify(self) -> list[Corruption]:
        """Check every record of every field (R16-R18); [] when the shard is intact."""
        return [
            Corruption(str(self.path), i, c.name, f"record {i} {why}")
            for c in self._columns
            for i, why in c.bad_records()
        ]

    def _stream_column(self, field: str) -> Column:
        column = self.columns[field]
        if column.compressed or not column.field.is_variable or column.field.kind != "array":
            raise FormatError(f"{self.path}: field {field!r} is not an uncompressed variable array")
        return column

    def close(self) -> None:
        """Drop this shard's references to the mapping (views handed out keep it alive)."""
        self.columns = {}
        self._columns = ()

    def __reduce__(self) -> tuple[Any, ...]:
        state = (str(self.path), self.index_checksum, self.verify_reads, self.max_decoded_bytes)
        return (_reopen, state)

    def __repr__(self) -> str:
        return f"Shard({str(self.path)!r}, num_records={self._num}, fields={self.schema.to_json()})"


def open_shard(
    path: str | os.PathLike[str], *, verify: bool = False, max_decoded_bytes: int | None = None
) -> Shard:
    """Map and validate one shard file. ``verify=True`` checks each record read;
    ``max_decoded_bytes`` caps what one read may decode or allocate (`read_cap`)."""
    return Shard(path, verify=verify, max_decoded_bytes=max_decoded_bytes)


def _reopen(path: str, index_checksum: int, verify: bool, max_decoded_bytes: int) -> Shard:
    """Unpickle a shard: map the file again and check it is still the same file's index."""
    shard = Shard(path, verify=verify, max_decoded_bytes=max_decoded_bytes)
    if shard.index_checksum != index_checksum:
        raise FormatError(
            f"{path}: shard changed since it was pickled (index checksum"
            f" {shard.index_checksum:016x}, expected {index_checksum:016x})",
            path=path,
        )
    return shard


def read_trailer(fd: int, file_bytes: int, path: object) -> Trailer:
    """The checked trailer (R1, R5-R7) of an open shard file of ``file_bytes`` bytes, from
    one 64-byte read: what a dataset compares with its manifest without mapping the file."""
    if file_bytes < HEADER_BYTES + TRAILER_BYTES:
        raise fail(path, file_bytes, "R1", f"file of {file_bytes} bytes is too short")
    data = os.pread(fd, TRAILER_BYTES, file_bytes - TRAILER_BYTES)
    if len(data) != TRAILER_BYTES:
        raise fail(path, file_bytes, "R1", "file shrank while it was read")
    return parse_trailer(data, file_bytes, path)


def _map_file(path: Path) -> tuple[mmap.mmap, np.ndarray]:
    """Map a regular file read-only, without ever blocking on a FIFO or device (R1)."""
    if TEMP_NAME.match(path.name):
        raise fail(path, 0, "R1", "a writer's temp file (it died before publishing it)")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise fail(path, 0, "R1", "not a regular file")
        if info.st_size < HEADER_BYTES + TRAILER_BYTES:
            raise fail(
                path,
                info.st_size,
                "R1",
                f"file of {info.st_size} bytes is too short"
                f" (at least {HEADER_BYTES + TRAILER_BYTES})",
            )
        mapping = mmap.mmap(fd, info.st_size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    return mapping, np.frombuffer(mapping, np.uint8)


def _parse(buf: np.ndarray, path: Path) -> tuple[Layout, int]:
    size = buf.size
    parse_header(buf[:HEADER_BYTES].tobytes(), path)
    trailer = parse_trailer(buf[size - TRAILER_BYTES :].tobytes(), size, path)
    meta_end = trailer.meta_offset + trailer.meta_bytes
    digest = index_checksum(buf[:HEADER_BYTES], buf[trailer.tables_offset : meta_end], trailer)
    if digest != trailer.index_checksum:
        raise fail(
            path,
            size - TRAILER_BYTES + 32,
            "R8",
            f"index checksum {digest:016x} (expected {trailer.index_checksum:016x})",
        )
    layout = parse_layout(buf[trailer.meta_offset : meta_end].tobytes(), trailer, path)
    _check_padding(buf, layout, trailer.tables_offset, path)
    return layout, digest


def _check_padding(buf: np.ndarray, layout: Layout, tables_offset: int, path: Path) -> None:
    """R11: the bytes between data columns (no checksum covers them) must be zero."""
    extents = sorted((c.data for c in layout.columns), key=lambda e: (e.offset, e.nbytes))
    stops = [e.offset for e in extents[1:]] + [tables_offset]
    for extent, stop in zip(extents, stops, strict=True):
        if buf[extent.end : stop].any():
            raise fail(path, extent.end, "R11", "padding bytes after a column are not zero")


def shard_infos(paths: Iterable[str | os.PathLike[str]]) -> list[ShardInfo]:
    """`ShardInfo` values of existing shard files (opened and validated), in order."""
    infos = []
    for path in paths:
        shard = Shard(path)
        infos.append(
            ShardInfo(shard.path, len(shard), shard.num_bytes, checksum_text(shard.index_checksum))
        )
    return infos
