"""The locality shuffle (issue 15): ``LoaderConfig(shuffle_group_shards=G)`` vs the global one.

``python -m benchmarks.locality [--shards 64] [--records 256] [--repeats 3]`` prints, as
ratios of one run on one machine (JSON):

- **quality**, from the order alone (no I/O), over a layout of 1024 shards of 1000 records
  and batches of 256: (1) the distinct shards a batch reads; (2) label mixing, the total
  variation distance between a batch's label histogram and the dataset's (16 labels), for
  two layouts: *sorted* (each shard holds one label, the worst case for locality: a corpus
  packed source by source, or sorted) and *mixed* (labels spread evenly over the shards).
  The global shuffle's distance is the sampling noise of a batch of 256; a grouped order
  can only add to it where shards are not alike.
- **speed**, through the `Loader`, over a ``file://`` dataset opened with ``cache_dir`` and
  ``cache_limit_bytes`` = 1/4 of the dataset (a fresh cache each run): shards fetched per
  epoch (as a multiple of the dataset) and epoch time, global vs grouped (``--groups``),
  the orders interleaved and each the median of ``--repeats`` runs; the ratios are global /
  grouped, the median of the per-repeat ratios. ``global_no_limit`` is the global shuffle
  with no cache limit (each shard fetched once): the floor both aim at. The loader's
  default ``readahead=2`` prefetches the next steps' shards; ``..._readahead_0`` is the
  first group size without it (then no shard fetched ahead is evicted before its use).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import roxxel
from roxxel.loader.loader import Loader, LoaderConfig
from roxxel.sampling.order import ShardGroups, records_for_draws

NUM_LABELS = 16
GROUPS = (1, 4, 8, 16, 64)


def _shards_per_batch(starts: np.ndarray, records: np.ndarray) -> float:
    shards = np.searchsorted(starts, records, side="right") - 1
    return float(np.mean([len(np.unique(row)) for row in shards]))


def _label_distance(labels: np.ndarray, records: np.ndarray) -> float:
    """Mean over batches of the total variation distance to the dataset's label mix."""
    overall = np.bincount(labels, minlength=NUM_LABELS) / len(labels)
    batch_labels = labels[records]
    counts = np.stack([np.bincount(row, minlength=NUM_LABELS) for row in batch_labels])
    mixes = counts / batch_labels.shape[1]
    return float(np.mean(0.5 * np.abs(mixes - overall).sum(axis=1)))


def quality(num_shards: int = 1024, per_shard: int = 1000, batch: int = 256) -> dict[str, Any]:
    """Distinct shards per batch and label mixing of an epoch, global vs grouped."""
    starts = np.arange(num_shards + 1, dtype=np.int64) * per_shard
    n = int(starts[-1])
    sorted_labels = np.arange(n) // (n // NUM_LABELS)  # a shard holds one label
    mixed_labels = np.random.default_rng(0).integers(0, NUM_LABELS, n)
    draws = np.arange(n // batch * batch)
    orders = {"global": records_for_draws(n, draws, seed=0, source=0, shuffle=True)}
    for g in GROUPS:
        orders[f"group_{g}"] = ShardGroups(starts, g).records(draws, seed=0, source=0)
    out: dict[str, Any] = {}
    for name, records in orders.items():
        rows = records.reshape(-1, batch)
        out[name] = {
            "shards_per_batch": round(_shards_per_batch(starts, rows), 1),
            "label_tv_sorted": round(_label_distance(sorted_labels, rows), 3),
            "label_tv_mixed": round(_label_distance(mixed_labels, rows), 3),
        }
    return out


def _write(path: Path, num_shards: int, per_shard: int, record_bytes: int) -> roxxel.Dataset:
    rng = np.random.default_rng(0)
    schema = {"x": f"uint8[{record_bytes}]", "label": "int64"}
    shard_bytes = per_shard * (record_bytes + 8)  # one write_batch fills a shard
    with roxxel.DatasetWriter(path, schema, shard_bytes=shard_bytes) as writer:
        for start in range(0, num_shards * per_shard, per_shard):
            x = rng.integers(0, 255, (per_shard, record_bytes), np.uint8)
            writer.write_batch({"x": x, "label": np.arange(start, start + per_shard)})
    return roxxel.open_dataset(path)


def _epoch(
    url: str, cache: Path, limit: int | None, batch: int, order: tuple[int | None, int]
) -> tuple[float, int, str | None]:
    """(seconds, shards fetched, the error that ended it or None) for one epoch, cold;
    ``order`` is (shuffle_group_shards, readahead)."""
    dataset = roxxel.open_dataset(url, cache_dir=cache, cache_limit_bytes=limit)
    if dataset.cache is None:
        raise RuntimeError(f"{url}: opened without a cache")
    config = LoaderConfig(shuffle_group_shards=order[0], readahead=order[1])
    error = None
    start = time.perf_counter()
    try:
        with Loader(dataset, batch, seed=2, config=config) as loader:
            for _ in loader:
                pass
    except roxxel.RoxxelError as failed:  # a cache too small for the shards in flight
        error = str(failed)
    finally:
        dataset.cache.close()
    return time.perf_counter() - start, dataset.cache.num_fetched, error


def _summary(values: list[tuple[float, int, str | None]], num_shards: int) -> dict[str, Any]:
    done = [v for v in values if v[2] is None]
    failed = [v[2] for v in values if v[2] is not None]
    out: dict[str, Any] = {"runs": len(values), "failed": len(failed)}
    if done:
        out["epoch_s (median)"] = round(statistics.median(v[0] for v in done), 3)
        out["fetched_x_dataset"] = round(statistics.median(v[1] for v in done) / num_shards, 2)
    if failed:
        out["error"] = failed[0]
    return out


def speed(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    local = _write(root / "ds", args.shards, args.records, args.record_bytes)
    total = sum(e.num_bytes for e in local.manifest.shards)
    num_shards = len(local.manifest.shards)
    url = f"file://{root / 'ds'}"
    limit = total // 4
    groups = {f"group_{g}": (g, 2) for g in args.groups}
    groups[f"group_{args.groups[0]}_readahead_0"] = (args.groups[0], 0)
    orders = {"global_no_limit": (None, 2), "global": (None, 2)} | groups
    runs: dict[str, list[tuple[float, int, str | None]]] = {name: [] for name in orders}
    for r in range(args.repeats):  # interleaved, so every order sees the same machine
        for name, values in runs.items():
            cache, room = root / f"cache-{name}-{r}", None if name.endswith("limit") else limit
            values.append(_epoch(url, cache, room, args.batch, orders[name]))
    out: dict[str, Any] = {
        "dataset_mib": round(total / 2**20, 1),
        "num_shards": num_shards,
        "cache_limit_mib": round(limit / 2**20, 1),
        "batch": args.batch,
        "load_average": os.getloadavg()[0],
    }
    out |= {name: _summary(values, num_shards) for name, values in runs.items()}
    for name in groups:  # the repeats where both orders finished their epoch
        pairs = [(a, b) for a, b in zip(runs["global"], runs[name], strict=True) if not a[2]]
        pairs = [(a, b) for a, b in pairs if not b[2]]
        if pairs:
            out[name]["global_over_group_epoch_time"] = round(
                statistics.median(a[0] / b[0] for a, b in pairs), 2
            )
            out[name]["global_over_group_fetched"] = round(
                statistics.median(a[1] / b[1] for a, b in pairs), 2
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="Locality shuffle vs global shuffle")
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--records", type=int, default=256, help="records per shard")
    parser.add_argument("--record-bytes", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--groups", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()
    result: dict[str, Any] = {"quality": quality()}
    with tempfile.TemporaryDirectory() as tmp:
        result["speed"] = speed(args, Path(tmp))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
