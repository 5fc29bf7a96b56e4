"""`roxxel pack` of array inputs through its block path against its record path (roxxel only).

Each input is packed twice by ``roxxel.cli.main`` in this process: as it is (whole columns per
block) and with ``--map`` of an identity function, which sends every record through the
per-record path and changes nothing else (the shards come out byte for byte the same). Inputs,
made once from the spec's data: the ``.npy`` image set of the pack workloads, the LM corpus's
first documents as a Megatron ``.bin/.idx`` pair, and the same tokens as a Parquet
``list<int32>`` column of 128-token rows (a tokenized HF-style corpus). Rated in MB/s of
payload, fsynced.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks import datagen as dg
from benchmarks import measure as ms
from benchmarks import pack
from benchmarks.megatron import write_indexed

ROW_TOKENS = 128
IDENTITY = "def identity(record):\n    return record\n"


def _inputs(spec: dg.DataSpec) -> dict[str, tuple[Path, list[str], int]]:
    """name -> (input path, schema flags, payload bytes); written once per spec."""
    inputs = pack.ensure_inputs(spec)
    root = dg.data_dir(spec, pack.INPUTS)
    stamp = root / "paths.json"
    if not stamp.exists() or json.loads(stamp.read_text()).get("key") != spec.key():
        docs = list(dg.iter_documents(spec, max_tokens=pack.pack_tokens(spec)))
        write_indexed(root / "lm", docs)
        _write_parquet(root / "lm.parquet", np.concatenate(docs).astype(np.int32))
        stamp.write_text(json.dumps({"key": spec.key()}))
    os.sync()  # no writeback of fresh inputs during the timed packs
    tokens = (root / "lm.bin").stat().st_size
    rows = tokens // 4 // ROW_TOKENS * ROW_TOKENS * 4
    return {
        ".npy images": (inputs.npy, ["--input-field", "image"], inputs.image_payload_bytes),
        "Megatron .bin/.idx": (root / "lm.bin", ["--field", "tokens:int32[]"], tokens),
        f"Parquet, {ROW_TOKENS}-token rows": (
            root / "lm.parquet",
            ["--field", "ids:int32[]"],
            rows,
        ),
    }


def _write_parquet(path: Path, tokens: np.ndarray) -> None:
    import pyarrow as pa  # the project's [arrow] extra
    import pyarrow.parquet as pq

    n = len(tokens) // ROW_TOKENS
    offsets = pa.array(np.arange(0, n * ROW_TOKENS + 1, ROW_TOKENS, dtype=np.int32))
    ids = pa.ListArray.from_arrays(offsets, pa.array(tokens[: n * ROW_TOKENS]))
    pq.write_table(pa.table({"ids": ids}), path, row_group_size=16384)


def pack_paths(p: dict) -> list[ms.Metric]:
    """Two rows per input: the block path and the record path."""
    spec = dg.SPECS[p.get("spec", "small")]
    root = dg.data_dir(spec, "roxxel")
    identity = root / "identity_map.py"
    identity.write_text(IDENTITY)
    rows = []
    inputs = _inputs(spec)
    src, schema, _ = next(iter(inputs.values()))
    warm_up = ["pack", str(src), *schema, "-q", "--overwrite", "-o", str(root / "pack-paths")]
    pack.run_in_process(warm_up)
    for name, (src, schema, payload) in inputs.items():
        rates = {}
        for path, extra in (("blocks", []), ("records", ["--map", f"{identity}:identity"])):
            args = ["pack", str(src), *schema, "--quiet", "--overwrite", *extra]
            write: Callable[[Path], None] = lambda out, a=args: pack.run_in_process(  # noqa: E731
                [*a, "-o", str(out)]
            )
            rates[path] = pack.rate_of(write, root / "pack-paths", payload, p)
        gain = f"the block path: {rates['blocks'] / rates['records']:.2f}x the record path"
        rows.append(ms.metric("pack_paths", f"{name}: blocks", rates["blocks"], "MB/s", notes=gain))
        records = f"{name}: records (--map identity)"
        rows.append(ms.metric("pack_paths", records, rates["records"], "MB/s"))
    return rows
