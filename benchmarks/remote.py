"""Datasets at a URL (issue 15): ratios against an S3 API server (moto's) on 127.0.0.1.

``python -m benchmarks.remote [--mib 64] [--shards 32]`` starts the server (its own process), uploads a
generated token dataset and prints, as ratios of one run on one machine:

- time to first batch from a cold cache / time to fetch only the shards that batch reads
  (the issue's limit: at most 1.5);
- an epoch's throughput through the Loader with the cache warming up (shuffled, then in
  order) / the server's bulk download rate of the same shards, 8 parallel GETs (at least 0.8).

MosaicML Streaming's ``StreamingDataset`` is not compared here (not installed in this
environment); docs/remote.md lists that as not done. Needs ``roxxel[s3]`` and ``moto[server]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

import roxxel
from roxxel.format.cache import CacheConfig, ShardCache
from roxxel.format.dataset import Dataset

BUCKET = "roxxel-bench"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _write(path: Path, mib: int, num_shards: int) -> None:
    rng = np.random.default_rng(0)
    tokens_per_record = 2048
    num_records = mib * (1 << 20) // (4 * tokens_per_record)
    shard_bytes = mib * (1 << 20) // num_shards
    with roxxel.DatasetWriter(path, {"tokens": "int32[2048]"}, shard_bytes=shard_bytes) as w:
        for start in range(0, num_records, 256):
            n = min(256, num_records - start)
            w.write_batch({"tokens": rng.integers(0, 50_000, (n, tokens_per_record), np.int32)})


def _open(url: str, cache: Path, options: dict[str, Any]) -> tuple[Dataset, ShardCache]:
    store = ShardCache(CacheConfig(url, cache, options, max_fetches=8))
    return Dataset(url, cache=store), store


def _bulk_seconds(fs: Any, names: list[str], prefix: str) -> float:
    """8 parallel whole-object GETs of these shards into memory."""
    start = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda n: len(fs.cat_file(f"{prefix}/{n}")), names))
    return time.perf_counter() - start


def _first_batch(url: str, cache: Path, options: dict, batch: int) -> tuple[float, float]:
    """(time to the first shuffled batch, time to fetch only that batch's shards), cold."""
    from roxxel.loader.loader import Loader, LoaderConfig

    dataset, store = _open(url, cache / "a", options)
    loader = Loader(dataset, batch, seed=1, config=LoaderConfig(readahead=2))
    start = time.perf_counter()
    with loader:
        picked = next(loader)
    first = time.perf_counter() - start
    del picked
    needed = Loader(dataset, batch, seed=1, config=LoaderConfig(provenance=True))
    with needed:
        records = next(needed)["record"]
    shard_ids = np.unique(dataset.locate(np.asarray(records))[0]).tolist()
    store.close()  # its queued read-ahead would compete with the next measurement
    alone, alone_store = _open(url, cache / "b", options)
    start = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: alone_store.fetch(alone.manifest.shards[k]), shard_ids))
    return first, time.perf_counter() - start


def _epoch_seconds(
    url: str, cache: Path, options: dict, batch: int, shuffle: bool, readahead: int = 2
) -> float:
    from roxxel.loader.loader import Loader, LoaderConfig

    dataset, _ = _open(url, cache, options)
    start = time.perf_counter()
    config = LoaderConfig(readahead=readahead)
    with Loader(dataset, batch, seed=2, shuffle=shuffle, config=config) as loader:
        for _ in loader:
            pass
    return time.perf_counter() - start


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until_up(fs: Any) -> None:
    for _ in range(300):
        try:
            fs.ls("")
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("the S3 server did not start in 30 s")


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Datasets at a URL: ratios against a local S3 server"
    )
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--shards", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    os.environ.update(CREDENTIALS)
    import fsspec

    port = _free_port()
    server = subprocess.Popen(  # its own process: the server does not share our GIL
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        options = {"endpoint_url": f"http://127.0.0.1:{port}"}
        fs = fsspec.filesystem("s3", **options)
        _wait_until_up(fs)
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            _write(root / "ds", args.mib, args.shards)
            fs.mkdir(BUCKET)
            fs.put(str(root / "ds"), f"{BUCKET}/ds", recursive=True)
            url = f"s3://{BUCKET}/ds"
            local = roxxel.open_dataset(root / "ds")
            names = [e.path for e in local.manifest.shards]
            total = sum(e.num_bytes for e in local.manifest.shards)
            bulk = _bulk_seconds(fs, names, f"{BUCKET}/ds")
            pairs = [_first_batch(url, root / f"c1-{r}", options, args.batch) for r in range(5)]
            first, needed = (statistics.median(p[i] for p in pairs) for i in (0, 1))
            ratio = statistics.median(p[0] / p[1] for p in pairs)
            shuffled = _epoch_seconds(url, root / "c2", options, args.batch, True)
            in_order = _epoch_seconds(url, root / "c3", options, args.batch, False)
            in_order_far = _epoch_seconds(url, root / "c4", options, args.batch, False, 64)
    finally:
        server.terminate()
        server.wait()
    result = {
        "dataset_mib": round(total / 2**20, 1),
        "num_shards": len(names),
        "bulk_mb_per_s": round(total / bulk / 1e6, 1),
        "first_batch_s": round(first, 3),
        "first_batch_shards_fetch_s": round(needed, 3),
        "first_batch_ratio (<= 1.5, median of 5)": round(ratio, 2),
        "epoch_shuffled_vs_bulk (>= 0.8)": round(bulk / shuffled, 2),
        "epoch_in_order_vs_bulk (>= 0.8)": round(bulk / in_order, 2),
        "epoch_in_order_readahead_64_vs_bulk": round(bulk / in_order_far, 2),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
