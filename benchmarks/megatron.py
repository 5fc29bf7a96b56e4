"""Megatron's `.bin`/`.idx` layout (MMIDIDX v1), written and read here as the raw-speed baseline.

Written from the published layout, little-endian: magic ``MMIDIDX\\0\\0`` (9 bytes), u64 version
(1), u8 dtype code, u64 sequence count, u64 document-index count, then int32 sequence lengths
(elements), int64 sequence pointers (byte offsets into `.bin`), int64 document indices
(sequence boundaries, starting with 0). The `.bin` is the raw elements, concatenated.

>>> import tempfile, os
>>> d = tempfile.mkdtemp()
>>> write_indexed(os.path.join(d, "x"), [np.arange(3, dtype=np.int32), np.arange(2, dtype=np.int32)])
5
>>> ds = IndexedReader(os.path.join(d, "x"))
>>> len(ds), ds[1].tolist()
(2, [0, 1])
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, doc-index entries


def dtype_code(dtype: np.dtype) -> int:
    """The MMIDIDX code of a numpy dtype (ValueError when the layout has none)."""
    for code, dt in _CODES.items():
        if np.dtype(dt) == np.dtype(dtype):
            return code
    raise ValueError(f"megatron: dtype has no MMIDIDX code ({dtype}, expected one of {_CODES})")


def write_indexed(prefix: str | Path, docs: Iterable[np.ndarray], bufsize: int = 8 << 20) -> int:
    """Write `prefix.bin` and `prefix.idx` with one sequence per document; return elements written."""
    lengths: list[int] = []
    dtype = None
    with open(f"{prefix}.bin", "wb", buffering=bufsize) as f:
        for doc in docs:
            dtype = doc.dtype if dtype is None else dtype
            f.write(memoryview(np.ascontiguousarray(doc, dtype)).cast("B"))
            lengths.append(doc.size)
    dtype = np.dtype(np.int32) if dtype is None else np.dtype(dtype)
    lens = np.asarray(lengths, np.int32)
    pointers = np.zeros(len(lens), np.int64)
    np.cumsum(lens[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    doc_idx = np.arange(len(lens) + 1, dtype=np.int64)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(_HEADER.pack(MAGIC, 1, dtype_code(dtype), len(lens), len(doc_idx)))
        for arr in (lens, pointers, doc_idx):
            f.write(arr.tobytes())
    return int(lens.sum())


class IndexedReader:
    """Read-only view of a `.bin`/`.idx` pair through `np.memmap` (Megatron's reading path)."""

    def __init__(self, prefix: str | Path) -> None:
        idx = np.memmap(f"{prefix}.idx", np.uint8, mode="r")
        magic, version, code, n, ndoc = _HEADER.unpack_from(idx[: _HEADER.size].tobytes())
        if magic != MAGIC or version != 1 or code not in _CODES:
            raise ValueError(f"megatron: {prefix}.idx is not MMIDIDX v1 ({magic!r}, v{version})")
        off = _HEADER.size
        self.lengths = np.frombuffer(idx, np.int32, n, off)
        self.pointers = np.frombuffer(idx, np.int64, n, off + 4 * n)
        self.doc_idx = np.frombuffer(idx, np.int64, ndoc, off + 12 * n)
        self.dtype = np.dtype(_CODES[code])
        self.tokens = np.memmap(f"{prefix}.bin", self.dtype, mode="r")

    def __len__(self) -> int:
        return self.lengths.size

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.pointers[i]) // self.dtype.itemsize
        return self.tokens[start : start + int(self.lengths[i])]
