"""Shard format v1 as code: constants, header and trailer, and the table checks.

This module is ``docs/format.md`` written in Python. Bytes in, values out, no I/O: the
reader hands it slices of the mapping, the writer asks it for the bytes to write. Every
check raises a `FormatError` that names the file, the byte offset and the rule (R-number).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from roxxel.errors import FormatError

__all__ = [
    "ALIGN",
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "MAGIC",
    "META_MAX_BYTES",
    "TRAILER_BYTES",
    "Trailer",
    "align",
    "check_offsets",
    "checksum",
    "fail",
    "index_checksum",
    "index_hasher",
    "pack_header",
    "pack_trailer",
    "parse_header",
    "parse_trailer",
    "seal",
]

MAGIC = b"\x89RXS\r\n\x1a\n"  # a high byte and CR LF ^Z LF catch text-mode transfers
TRAILER_MAGIC = b"RXS-END\n"
FORMAT_VERSION = 1
HEADER_BYTES = 64
TRAILER_BYTES = 64
ALIGN = 64
META_MAX_BYTES = 1 << 20
ZSTD_MAX_RATIO = 1 << 15  # a zstd block of >= 4 bytes decodes to at most 128 KiB
ZSTD_SLACK_BYTES = 1 << 10
CHECKSUM_KIND = "xxh3_64"

Buffer = bytes | bytearray | memoryview | np.ndarray
_HEADER = struct.Struct("<8sII48s")
_TRAILER = struct.Struct("<QQQQQ16s8s")
_TRAILER_SUM_AT = 32  # the index checksum covers the trailer bytes before this offset


def fail(path: object, offset: int, rule: str, what: str) -> FormatError:
    """A FormatError in the one message form every format check uses, carrying ``rule``,
    ``path`` and ``offset`` as attributes."""
    return FormatError(
        f"{path}: {what} at byte {offset} (rule {rule} of docs/format.md)",
        rule=rule,
        path=path,
        offset=offset,
    )


def align(offset: int) -> int:
    """The next multiple of ALIGN at or after ``offset``.

    >>> align(0), align(1), align(64), align(65)
    (0, 64, 64, 128)
    """
    return -(-offset // ALIGN) * ALIGN


def checksum(data: Buffer) -> int:
    """XXH3-64 (seed 0) of ``data``: the checksum of every record and of the index.

    >>> hex(checksum(b"roxxel"))
    '0x5a637923440ce8d4'
    """
    return xxhash.xxh3_64_intdigest(data)  # pyright: ignore[reportArgumentType]


def pack_header() -> bytes:
    """The 64 header bytes of every v1 shard."""
    return _HEADER.pack(MAGIC, FORMAT_VERSION, HEADER_BYTES, bytes(48))


@dataclass(frozen=True, slots=True)
class Trailer:
    """Where a shard's index lives: the last 64 bytes of the file, parsed."""

    num_records: int
    tables_offset: int
    meta_offset: int
    meta_bytes: int
    index_checksum: int


def pack_trailer(trailer: Trailer) -> bytes:
    """The 64 trailer bytes for these values."""
    return _TRAILER.pack(
        trailer.num_records,
        trailer.tables_offset,
        trailer.meta_offset,
        trailer.meta_bytes,
        trailer.index_checksum,
        bytes(16),
        TRAILER_MAGIC,
    )


def index_hasher(header: Buffer) -> xxhash.xxh3_64:
    """A running XXH3-64 over the index, started with the header bytes."""
    hasher = xxhash.xxh3_64()
    hasher.update(header)  # pyright: ignore[reportArgumentType]
    return hasher


def seal(hasher: xxhash.xxh3_64, trailer: Trailer) -> int:
    """Finish an index checksum that has run over header, tables and metadata (R8)."""
    hasher.update(pack_trailer(trailer)[:_TRAILER_SUM_AT])
    return hasher.intdigest()


def index_checksum(header: Buffer, index: Buffer, trailer: Trailer) -> int:
    """The checksum over header, tables, metadata and the trailer's own numbers (R8)."""
    hasher = index_hasher(header)
    hasher.update(index)  # pyright: ignore[reportArgumentType]
    return seal(hasher, trailer)


def parse_header(data: bytes | memoryview, path: object) -> None:
    """Check the 64 header bytes (R2-R4)."""
    magic, version, header_bytes, reserved = _HEADER.unpack(data)
    if magic != MAGIC:
        raise fail(
            path, 0, "R2", f"not a roxxel shard: magic {bytes(magic)!r} (expected {MAGIC!r})"
        )
    if version != FORMAT_VERSION:
        newer = " written by a newer roxxel; upgrade to read it" if version > FORMAT_VERSION else ""
        raise fail(path, 8, "R3", f"format version {version} (expected {FORMAT_VERSION}){newer}")
    if header_bytes != HEADER_BYTES or any(reserved):
        raise fail(path, 12, "R4", f"header size {header_bytes} or reserved bytes not zero")


def parse_trailer(data: bytes | memoryview, file_bytes: int, path: object) -> Trailer:
    """Parse and bound-check the trailer of a file of ``file_bytes`` bytes (R5-R7)."""
    at = file_bytes - TRAILER_BYTES
    num, tables, meta, meta_bytes, digest, reserved, magic = _TRAILER.unpack(data)
    if magic != TRAILER_MAGIC:
        raise fail(
            path,
            at + 56,
            "R5",
            f"trailer magic {magic!r} (expected {TRAILER_MAGIC!r}:"
            " file cut short, still being written, or bytes appended)",
        )
    if any(reserved):
        raise fail(path, at + 40, "R5", "reserved trailer bytes not zero")
    if meta_bytes > META_MAX_BYTES:
        raise fail(path, at + 24, "R7", f"metadata of {meta_bytes} bytes (cap {META_MAX_BYTES})")
    ends = (HEADER_BYTES <= tables <= meta, tables % ALIGN == 0, meta + meta_bytes == at)
    if not all(ends):
        raise fail(
            path,
            at + 8,
            "R6",
            f"index extents tables={tables} metadata={meta}+{meta_bytes}"
            f" do not end at the trailer ({at})",
        )
    # Every record owns an 8-byte checksum in the tables, which bounds the count.
    if num > (meta - tables) // 8 + 1:
        raise fail(path, at, "R6", f"record count {num} too large for {meta - tables} table bytes")
    return Trailer(num, tables, meta, meta_bytes, digest)


def check_offsets(
    offsets: np.ndarray, limit: int, unit: int, where: tuple[object, int, str]
) -> None:
    """Check an offset table in one vectorized pass (R13).

    ``offsets`` must start at 0, never decrease, end at ``limit`` and step in multiples
    of ``unit`` bytes. ``where`` is (path, byte offset of the table, field name).
    """
    path, at, name = where
    if offsets.size == 0 or int(offsets[0]) != 0:
        raise fail(path, at, "R13", f"field {name!r}: offset table does not start at 0")
    huge = np.flatnonzero(offsets >= np.uint64(1 << 62))
    if huge.size:
        raise fail(path, at + 8 * int(huge[0]), "R13", f"field {name!r}: offset past 2**62")
    steps = np.diff(offsets.astype(np.int64))
    bad = np.flatnonzero(steps < 0)
    if bad.size:
        raise fail(path, at + 8 * (int(bad[0]) + 1), "R13", f"field {name!r}: offsets decrease")
    if int(offsets[-1]) != limit:
        raise fail(
            path,
            at + 8 * (offsets.size - 1),
            "R13",
            f"field {name!r}: last offset {int(offsets[-1])} (expected column end {limit})",
        )
    if unit > 1 and steps.size:
        odd = np.flatnonzero(steps % unit)
        if odd.size:
            raise fail(
                path,
                at + 8 * (int(odd[0]) + 1),
                "R13",
                f"field {name!r}: record size not a multiple of {unit} bytes",
            )
