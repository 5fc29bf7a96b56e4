"""Megatron-LM ``.bin/.idx`` pairs (the ``MMIDIDX`` indexed dataset), read without Megatron.

The ``.idx`` file, little-endian: the 9-byte magic ``MMIDIDX\\x00\\x00``, a u64 version (1),
a u8 dtype code, a u64 sequence count S, a u64 document count D, then S int32 sequence
lengths (elements), S int64 sequence pointers (byte offsets into ``.bin``), D int64
document indices (sequence boundaries), and optionally S int8 sequence modes. The ``.bin``
file is the sequences' elements concatenated. Every count, length and pointer is checked
against the file sizes before anything is read through it. One record per sequence.
"""

from __future__ import annotations

import functools
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from roxxel.errors import ConfigError
from roxxel.ingest.units import (
    BLOCK_BYTES,
    BadRecords,
    Block,
    Input,
    InputKind,
    Piece,
    RangeReader,
    ReadOptions,
    Record,
    check_range,
    row_pieces,
)

__all__ = [
    "MEGATRON",
    "MegatronIndex",
    "megatron_pieces",
    "read_megatron",
    "read_megatron_blocks",
    "read_megatron_index",
]

MAGIC = b"MMIDIDX\x00\x00"
_HEAD = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype("<i2"),
    4: np.dtype("<i4"),
    5: np.dtype("<i8"),
    6: np.dtype("<f8"),
    7: np.dtype("<f4"),
    8: np.dtype("<u2"),
}


@dataclass(frozen=True, slots=True)
class MegatronIndex:
    """A validated ``.idx``: element dtype, per-sequence lengths and byte pointers."""

    dtype: np.dtype
    lengths: np.ndarray
    pointers: np.ndarray
    document_indices: np.ndarray


def idx_path(bin_path: str) -> str:
    return bin_path[: -len(".bin")] + ".idx" if bin_path.endswith(".bin") else bin_path + ".idx"


def read_megatron_index(bin_path: str) -> MegatronIndex:
    """Parse and validate the ``.idx`` beside ``bin_path``, once per version of the pair in
    this process (every work unit of a large corpus reads it: O(sequences) each time).

    Raises ConfigError naming the file, the byte offset or sequence, and the rule broken.
    """
    stamps = tuple(_stamp(p) for p in (bin_path, idx_path(bin_path)))
    return _read_index(bin_path, stamps)


def _stamp(path: str) -> tuple[int, ...]:
    """What changes when a file is rewritten: inode, size, modification and change times."""
    try:
        st = os.stat(path)
    except OSError:
        return ()  # the parse names the missing file
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@functools.lru_cache(maxsize=8)
def _read_index(bin_path: str, stamps: tuple) -> MegatronIndex:
    del stamps  # the cache key: a rewritten pair is parsed again
    path = idx_path(bin_path)
    data = np.memmap(path, np.uint8, mode="r") if os.path.getsize(path) else np.empty(0, np.uint8)
    if data.size < _HEAD.size:
        raise ConfigError(
            f"{path}: {data.size} bytes (expected at least a {_HEAD.size}-byte header)"
        )
    magic, version, code, num_seqs, num_docs = _HEAD.unpack(bytes(data[: _HEAD.size]))
    if magic != MAGIC:
        raise ConfigError(f"{path}: offset 0: magic {magic!r} (expected {MAGIC!r})")
    if version != 1:
        raise ConfigError(f"{path}: offset 9: version {version} (expected 1)")
    if code not in DTYPE_CODES:
        raise ConfigError(f"{path}: offset 17: dtype code {code} (expected one of 1..8)")
    base = _HEAD.size + 12 * num_seqs + 8 * num_docs
    if data.size not in (base, base + num_seqs):
        raise ConfigError(
            f"{path}: {data.size} bytes for {num_seqs} sequences and {num_docs} documents "
            f"(expected {base} or {base + num_seqs})"
        )
    lengths = np.frombuffer(data, "<i4", num_seqs, _HEAD.size)
    pointers = np.frombuffer(data, "<i8", num_seqs, _HEAD.size + 4 * num_seqs)
    docs = np.frombuffer(data, "<i8", num_docs, _HEAD.size + 12 * num_seqs)
    index = MegatronIndex(DTYPE_CODES[code], lengths, pointers, docs)
    _check_sequences(bin_path, index)
    return index


def _check_sequences(bin_path: str, index: MegatronIndex) -> None:
    """Every sequence an aligned range inside ``.bin``. No sum can wrap: a pointer is
    compared with the size before a length (< 2**31 elements) is added to it."""
    item = index.dtype.itemsize
    size = os.path.getsize(bin_path)
    pointers = index.pointers
    inside = (pointers >= 0) & (pointers <= size)
    ends = np.where(inside, pointers, 0) + index.lengths.astype(np.int64) * item
    bad = (index.lengths < 0) | ~inside | (pointers % item != 0) | (ends > size)
    if bad.any():
        i = int(np.argmax(bad))
        raise ConfigError(
            f"{bin_path}: sequence {i}: pointer {int(index.pointers[i])}, length "
            f"{int(index.lengths[i])} (expected an {item}-byte aligned range inside {size} bytes)",
            path=bin_path,
            offset=i,
        )
    docs = index.document_indices
    n = len(index.lengths)
    if docs.size and (np.any(np.diff(docs) < 0) or docs[0] < 0 or docs[-1] > n):
        raise ConfigError(
            f"{idx_path(bin_path)}: document indices not increasing within [0, {n}] "
            f"(expected sequence boundaries)"
        )


def megatron_inputs(path: str) -> list[Input]:
    """The pair a ``.bin`` or ``.idx`` path names, as one input (its ``.bin``)."""
    bin_path = path[: -len(".idx")] + ".bin" if path.endswith(".idx") else path
    for p in (bin_path, idx_path(bin_path)):
        if not os.path.isfile(p):
            raise ConfigError(f"{p}: missing (expected a Megatron .bin/.idx pair)", path=p)
    return [Input(bin_path, "megatron")]


def megatron_pieces(bin_path: str, unit_bytes: int) -> list[Piece]:
    """Sequence ranges of about ``unit_bytes`` bytes of ``.bin``."""
    return row_pieces(bin_path, "megatron", len(read_megatron_index(bin_path).lengths), unit_bytes)


def _open(piece: Piece) -> tuple[MegatronIndex, np.ndarray]:
    index = read_megatron_index(piece.path)
    check_range(piece, len(index.lengths), "sequence")
    if os.path.getsize(piece.path) == 0:
        return index, np.empty(0, index.dtype)
    return index, np.memmap(piece.path, index.dtype, mode="r").view(np.ndarray)


def read_megatron(piece: Piece, opts: ReadOptions, bad: BadRecords) -> Iterator[tuple[Record, int]]:
    """Yield ``{field: 1-D array}`` (default field ``tokens``) per sequence, with its number."""
    del bad  # a bad index is never skipped: it makes every later sequence suspect
    index, tokens = _open(piece)
    name = opts.field_for("tokens")
    item = index.dtype.itemsize
    for i in range(piece.start, piece.stop):
        start = int(index.pointers[i]) // item
        yield {name: tokens[start : start + int(index.lengths[i])]}, i


def read_megatron_blocks(piece: Piece, opts: ReadOptions, bad: BadRecords) -> Iterator[Block]:
    """The sequences of `read_megatron` as blocks of about `BLOCK_BYTES`, read into one
    reused buffer where the block's sequences lie back to back in ``.bin`` (the usual case),
    else gathered from its mapping."""
    del bad  # a bad index is never skipped
    index, tokens = _open(piece)
    name = opts.field_for("tokens")
    item = index.dtype.itemsize
    lengths = index.lengths[piece.start : piece.stop].astype(np.int64)
    pointers = index.pointers[piece.start : piece.stop]
    ends = np.cumsum(lengths) * item
    at = 0
    with RangeReader(piece.path) as reader:
        while at < len(lengths):
            base = int(ends[at - 1]) if at else 0
            stop = max(at + 1, int(np.searchsorted(ends, base + BLOCK_BYTES, "right")))
            lens, starts = lengths[at:stop], pointers[at:stop]
            if np.array_equal(starts[1:], starts[:-1] + lens[:-1] * item):
                values = reader.read(int(starts[0]), index.dtype, (int(lens.sum()),))
            else:
                firsts = (starts // item).tolist()
                values = np.concatenate(
                    [tokens[a : a + n] for a, n in zip(firsts, lens.tolist(), strict=True)]
                )
            yield Block(piece, piece.start + at, len(lens), {name: values}, {name: lens})
            at = stop


def _locate_sequence(piece: Piece, key: int) -> str:
    return f"{piece.path}: sequence {key}"


MEGATRON = InputKind(
    "megatron",
    (".bin", ".idx"),
    megatron_pieces,
    read_megatron,
    read_megatron_blocks,
    locate=_locate_sequence,
    resolve=megatron_inputs,
)
