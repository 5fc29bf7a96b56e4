"""Write the golden shard files of tests/data/ (run only with a format-version bump).

    python tools/make_golden.py            # rewrite tests/data/golden-v1*.rxs

The test suite checks that today's writer reproduces these files byte for byte (with the
writer version they record) and that the reader reads them, forever.
"""

from __future__ import annotations

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import zstandard

import roxxel

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
SCHEMA = {
    "tokens": "int32[]",
    "image": "uint8[2,3]",
    "label": "int64",
    "score": "float32",
    "flag": "bool",
    "half": "float16[2]",
    "brain": "bfloat16[2]",
    "small": "int8",
    "wide": "uint64",
    "mat": "float64[,2]",
    "text": "str",
    "blob": "bytes",
}
FILES = {"golden-v1.rxs": None, "golden-v1-zstd.rxs": {"tokens": "zstd:3", "text": "zstd:1"}}


def golden_records() -> list[dict]:
    """Three records, the middle one with every variable field empty."""
    records = []
    for i in range(3):
        n = 0 if i == 1 else 2 + i
        records.append(
            {
                "tokens": np.arange(n, dtype=np.int32) * (i + 1) - 1,
                "image": np.arange(6, dtype=np.uint8).reshape(2, 3) + i,
                "label": -(10**12) * i + 7,
                "score": np.float32(0.5 * i),
                "flag": bool(i % 2),
                "half": np.array([i, -i], np.float16),
                "brain": np.array([1.5, -i], ml_dtypes.bfloat16),
                "small": -128 + i,
                "wide": np.uint64(2**64 - 1 - i),
                "mat": np.full((n, 2), i / 4, np.float64),
                "text": "" if n == 0 else "héllo wörld ✓" * i,
                "blob": bytes(range(n)),
            }
        )
    return records


def write(path: Path, compress: dict | None) -> None:
    # zstd's bytes may change between library versions: the test compares them only when
    # the installed zstandard is the one recorded here.
    metadata = {"golden": 1, "zstandard": zstandard.__version__}
    roxxel.write_shard(path, golden_records(), SCHEMA, compress=compress, metadata=metadata)


def main() -> int:
    for name, compress in FILES.items():
        write(DATA / name, compress)
        print(f"wrote {DATA / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
