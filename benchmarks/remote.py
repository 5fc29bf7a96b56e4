"""Datasets at a URL (issue 15): ratios against an S3 API server (moto's) on 127.0.0.1.

``python -m benchmarks.remote [--mib 256] [--shards 128] [--repeats 3] [--mb-per-connection
16]`` starts the server (its own process) behind `benchmarks.throttle`, which gives each
connection at most ``--mb-per-connection`` MB/s, as an object store across a network does
(``0``: the server unpaced, sharing this machine's cores with the client: a measure of CPU per
byte rather than of downloading), uploads a generated token dataset (records of 2048 int32)
and prints medians over ``--repeats`` rounds, each round measuring every variant in turn (the
order rotates by round, so a change of load hits all of them alike):

- time to the first shuffled batch from a cold cache / time to fetch only the shards that batch
  reads, as raw GETs, 8 in parallel, with the faster of two clients (s3fs's ``cat_file``, and
  urllib3 on each object's signed URL, into memory or streamed and dropped) (the issue's
  limit: at most 1.5); also / the same
  shards through roxxel's cache (download + verify + rename), to show the Loader's own share,
  and the least a verified file cache pays: the same signed GETs streamed into files, hashed
  and renamed in bare code, / the raw GETs;
- an epoch through the Loader with the cache warming up (shuffled, shuffled within groups of
  4 shards, and in order) / the server's bulk rate: every shard as one whole-object GET, 8 in
  parallel, with the fastest of four clients in each round (s3fs, boto3's ``get_object`` and
  urllib3 on signed URLs into memory, and the last streamed through a reused buffer and
  dropped; each one's rate is printed) (at least 0.8); the
  cache alone (``Dataset.prefetch`` of every shard, no Loader) over the same bulk rate, and
  the shuffled epoch over s3fs's bulk rate (the baseline of runs before 2026-11-28);
- the bound on this machine's cores: a bare verified download of every shard (as above) and
  an epoch over the filled cache, their CPU seconds (this process, its download process and
  the server) over the cores, against the bulk time: what any design could reach here;
- MosaicML Streaming (``--streaming``, on by default when its venv from ``benchmarks.venvs``
  installs): the same records written as MDS (``ndarray:int32:2048``, uncompressed, shards of
  the same size) to the same server, read by ``StreamingDataset(remote=s3://..., local=<fresh
  dir>, shuffle=True, batch_size=32)`` in its own process, vs roxxel's ``open_dataset`` +
  ``Loader`` from a fresh cache dir: time to the first batch (at most 0.5x Streaming's) and
  shuffled batches per second over an epoch (at least 2x), both counted from opening.

Needs ``roxxel[s3]`` and ``moto[server]`` (and, for Streaming, ``python -m benchmarks.venvs
streaming``). Prints one JSON object; ``uptime`` is printed before and after.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

import roxxel
from benchmarks import venvs
from roxxel.format.cache import CacheConfig, ShardCache
from roxxel.format.dataset import Dataset

BUCKET = "roxxel-bench"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1",
}
TOKENS_PER_RECORD = 2048
GETS_IN_PARALLEL = 8

# Run by the streaming venv's python: `write NPY OUT SHARD_BYTES` or `read URL LOCAL BATCH`.
_STREAMING = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    from streaming import MDSWriter, StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    if sys.argv[1] == "write":
        tokens = np.load(sys.argv[2])
        columns = {"tokens": f"ndarray:int32:{tokens.shape[1]}"}
        limit = int(sys.argv[4])
        with MDSWriter(out=sys.argv[3], columns=columns, compression=None, size_limit=limit) as w:
            for row in tokens:
                w.write({"tokens": row})
        sys.exit(0)
    clean_stale_shared_memory()
    url, local, batch = sys.argv[2], sys.argv[3], int(sys.argv[4])
    start = time.perf_counter()
    dataset = StreamingDataset(remote=url, local=local, shuffle=True, batch_size=batch)
    first, num_batches, rows = None, 0, []
    for sample in dataset:
        rows.append(sample["tokens"])
        if len(rows) == batch:
            np.stack(rows)
            rows, num_batches = [], num_batches + 1
            if first is None:
                first = time.perf_counter() - start
    if rows:
        np.stack(rows)
        num_batches += 1
    print(json.dumps({"first_s": first, "epoch_s": time.perf_counter() - start,
                      "num_batches": num_batches}))
    """
)


def _write(path: Path, mib: int, num_shards: int) -> np.ndarray:
    """A token dataset of ``mib`` MiB in ``num_shards`` shards; returns its tokens."""
    rng = np.random.default_rng(0)
    num_records = mib * (1 << 20) // (4 * TOKENS_PER_RECORD)
    tokens = rng.integers(0, 50_000, (num_records, TOKENS_PER_RECORD), np.int32)
    shard_bytes = mib * (1 << 20) // num_shards
    schema = {"tokens": f"int32[{TOKENS_PER_RECORD}]"}
    with roxxel.DatasetWriter(path, schema, shard_bytes=shard_bytes) as w:
        for start in range(0, num_records, 256):
            w.write_batch({"tokens": tokens[start : start + 256]})
    return tokens


def _open(url: str, cache: Path, options: dict[str, Any]) -> tuple[Dataset, ShardCache]:
    store = ShardCache(CacheConfig(url, cache, options, max_fetches=GETS_IN_PARALLEL))
    return Dataset(url, cache=store), store


def _timed(call: Callable[[], Any]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _gets(fs: Any, paths: list[tuple[str, int]]) -> float:
    """Seconds for one whole-object GET of each (path, size), 8 in parallel, into memory (a
    ranged GET of the whole object: s3fs's plain ``cat_file`` would ask for the size first)."""
    with ThreadPoolExecutor(GETS_IN_PARALLEL) as pool:
        return _timed(lambda: list(pool.map(lambda p: fs.cat_file(p[0], start=0, end=p[1]), paths)))


def _verified_gets(fs: Any, paths: list[tuple[str, int]], folder: Path) -> float:
    """Signed GETs streamed through a reused 4 MiB buffer into a file of ``folder`` each,
    checked (every record's hash, as the cache does) and renamed: what any verified file
    cache pays at the least, with the lightest client."""
    import threading

    import urllib3

    from roxxel.format.reader import Shard

    folder.mkdir(parents=True)
    pool = urllib3.PoolManager(maxsize=GETS_IN_PARALLEL, retries=False)
    buffers = threading.local()

    def fetch(path: str, size: int) -> None:
        name = path.rsplit("/", 1)[1]
        temp = folder / f".{name}"
        if getattr(buffers, "view", None) is None:
            buffers.view = memoryview(bytearray(4 << 20))
        view, got = buffers.view, 0
        response = pool.request("GET", fs.sign(path), preload_content=False)
        with open(temp, "wb", buffering=0) as out:
            while got < size:
                num_read = response.readinto(view[: min(len(view), size - got)])
                if not num_read:
                    raise RuntimeError(f"{path}: {got} of {size} bytes")
                out.write(view[:num_read])
                got += num_read
        response.release_conn()
        shard = Shard(temp)
        if shard.verify():
            raise RuntimeError(f"{path}: does not verify")
        shard.close()
        os.replace(temp, folder / name)

    with ThreadPoolExecutor(GETS_IN_PARALLEL) as threads:
        return _timed(lambda: list(threads.map(lambda p: fetch(*p), paths)))


def _signed_get(fs: Any, keep: bool = True) -> Callable[[str, int], bytearray | None]:
    """A whole-object GET of a path's signed URL with urllib3 (the bytes move with the GIL
    let go): into one buffer per object, or, without ``keep``, streamed through a 4 MiB
    buffer reused by the thread and dropped (no new memory to fault in: the least a client
    can do with the bytes)."""
    import threading

    import urllib3

    pool = urllib3.PoolManager(maxsize=GETS_IN_PARALLEL, retries=False)
    buffers = threading.local()

    def get(path: str, size: int) -> bytearray | None:
        response = pool.request("GET", fs.sign(path), preload_content=False)
        if keep:
            data = bytearray(size)
            view = memoryview(data)
        else:
            data = None
            if getattr(buffers, "view", None) is None:
                buffers.view = memoryview(bytearray(4 << 20))
            view = buffers.view
        got = 0
        while got < size:
            at = got % len(view) if data is None else got
            num_read = response.readinto(view[at : at + min(len(view) - at, size - got)])
            if not num_read:
                break
            got += num_read
        response.release_conn()
        if got != size:
            raise RuntimeError(f"{path}: {got} of {size} bytes")
        return data

    return get


def _signed_gets(fs: Any, paths: list[tuple[str, int]], keep: bool = True) -> float:
    """`_gets` with `_signed_get`."""
    get = _signed_get(fs, keep)
    with ThreadPoolExecutor(GETS_IN_PARALLEL) as pool:
        return _timed(lambda: list(pool.map(lambda p: get(*p), paths)))


def _boto_gets(client: Any, keys: list[str]) -> float:
    """The same with boto3's ``get_object`` (the client MosaicML Streaming uses)."""

    def get(key: str) -> int:
        return len(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())

    with ThreadPoolExecutor(GETS_IN_PARALLEL) as pool:
        return _timed(lambda: list(pool.map(get, keys)))


class Bench:
    """The server, the uploaded dataset and one fresh cache folder per measurement."""

    def __init__(self, fs: Any, url: str, root: Path, options: dict, batch: int) -> None:
        self.fs, self.url, self.root, self.options, self.batch = fs, url, root, options, batch
        self.manifest = roxxel.open_dataset(root / "ds").manifest
        prefix = url.removeprefix("s3://")
        self.paths = [(f"{prefix}/{e.path}", e.num_bytes) for e in self.manifest.shards]
        self._num_caches = 0

    def cache_dir(self) -> Path:
        self._num_caches += 1
        return self.root / f"cache-{self._num_caches}"

    def first_batch(self) -> dict[str, float]:
        """Cold: the Loader's first shuffled batch, then the same shards alone (raw GETs and
        through roxxel's cache)."""
        from roxxel.loader.loader import Loader, LoaderConfig

        dataset, store = _open(self.url, self.cache_dir(), self.options)
        loader = Loader(dataset, self.batch, seed=1, config=LoaderConfig(provenance=True))
        start = time.perf_counter()
        with loader:
            records = next(loader)["record"]
            first = time.perf_counter() - start
        store.close()  # its queued read-ahead would compete with the next measurement
        shard_ids = np.unique(dataset.locate(np.asarray(records))[0]).tolist()
        paths = [self.paths[k] for k in shard_ids]
        raw = min(
            _gets(self.fs, paths),
            _signed_gets(self.fs, paths),
            _signed_gets(self.fs, paths, keep=False),
        )
        verified = _verified_gets(self.fs, [self.paths[k] for k in shard_ids], self.cache_dir())
        alone, alone_store = _open(self.url, self.cache_dir(), self.options)
        entries = [alone.manifest.shards[k] for k in shard_ids]
        with ThreadPoolExecutor(GETS_IN_PARALLEL) as pool:
            fetched = _timed(lambda: list(pool.map(alone_store.fetch, entries)))
        alone_store.close()
        return {
            "first_s": first,
            "raw_s": raw,
            "verified_s": verified,
            "fetch_s": fetched,
            "shards": len(shard_ids),
        }

    def epoch(self, shuffle: bool, group_shards: int | None = None) -> float:
        """Seconds for an epoch through the Loader, the cache warming up (shuffled within
        groups of shards with `group_shards`)."""
        from roxxel.loader.loader import Loader, LoaderConfig

        dataset, store = _open(self.url, self.cache_dir(), self.options)
        config = LoaderConfig(shuffle_group_shards=group_shards)
        start = time.perf_counter()
        with Loader(dataset, self.batch, seed=2, shuffle=shuffle, config=config) as loader:
            for _ in loader:
                pass
        seconds = time.perf_counter() - start
        store.close()
        return seconds

    def prefetch_all(self) -> dict[str, float]:
        """Seconds for `Dataset.prefetch` of every shard (the cache alone: download, verify,
        publish; 8 at once), no Loader; then a shuffled epoch over the filled cache (the
        Loader alone, nothing left to fetch)."""
        from roxxel.loader.loader import Loader

        folder = self.cache_dir()
        dataset, store = _open(self.url, folder, self.options)
        start = time.perf_counter()
        dataset.prefetch(range(dataset.num_shards))
        store.wait()
        fetched = time.perf_counter() - start
        store.close()
        dataset, store = _open(self.url, folder, self.options)
        start, cpu = time.perf_counter(), time.process_time()
        with Loader(dataset, self.batch, seed=2) as loader:
            for _ in loader:
                pass
        warm, warm_cpu = time.perf_counter() - start, time.process_time() - cpu
        store.close()
        return {"s": fetched, "warm_epoch_s": warm, "warm_epoch_cpu": warm_cpu}

    def opened_epoch(self) -> dict[str, float]:
        """Streaming's counterpart: from `open_dataset` (a fresh cache) to the first shuffled
        batch and to the end of the epoch."""
        from roxxel.loader.loader import Loader

        start = time.perf_counter()
        dataset = roxxel.open_dataset(
            self.url, cache_dir=self.cache_dir(), storage_options=self.options
        )
        first, num_batches = None, 0
        with Loader(dataset, self.batch, seed=3) as loader:
            for _ in loader:
                num_batches += 1
                first = first or time.perf_counter() - start
        seconds = time.perf_counter() - start
        if dataset.cache is not None:
            dataset.cache.close()
        return {"first_s": first or 0.0, "epoch_s": seconds, "num_batches": num_batches}


def _upload_mds(
    fs: Any, root: Path, tokens: np.ndarray, bench: Bench, batch: int, port: int
) -> Callable[[], dict[str, float]]:
    """Write the same records as MDS shards of the same size, upload them beside the roxxel
    dataset; returns one Streaming measurement (a process of its own each time)."""
    python = venvs.venv_python("streaming")
    np.save(root / "tokens.npy", tokens)
    shard_bytes = max(e.num_bytes for e in bench.manifest.shards)
    write = [str(python), "-c", _STREAMING, "write", str(root / "tokens.npy")]
    subprocess.run([*write, str(root / "mds"), str(shard_bytes)], check=True)
    fs.put(str(root / "mds"), f"{BUCKET}/mds", recursive=True)
    url = f"s3://{BUCKET}/mds"
    return lambda: _streaming(python, url, bench.cache_dir(), batch, port)


def _streaming(python: Path, url: str, local: Path, batch: int, port: int) -> dict[str, float]:
    env = {**os.environ, **CREDENTIALS, "S3_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    args = [str(python), "-c", _STREAMING, "read", url, str(local), str(batch)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


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


def _uptime() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _median(rounds: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def _ratios(rounds: list[dict[str, float]], top: str, bottom: str) -> tuple[float, list[float]]:
    """The median of the per-round ratios, and each round's ratio."""
    each = [r[top] / r[bottom] for r in rounds]
    return round(statistics.median(each), 2), [round(x, 2) for x in each]


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _getter_cpu_s() -> float:
    """CPU seconds of this process's download process (`roxxel.format.getter`) so far, its
    work counted as this process's: 0 before it starts."""
    from roxxel.format import direct

    return sum(_cpu_s(g.pid) for g in direct._GETTER if g and g._process.poll() is None)


def _touch_free_pages(folder: Path, num_bytes: int) -> None:
    """Write and delete a file of ``num_bytes``: the kernel's free pages are then backed by
    the host again (see ``--warm-pages``)."""
    blob, block = folder / "warm-pages.bin", b"\0" * (4 << 20)
    with open(blob, "wb") as f:
        for _ in range(-(-num_bytes // len(block))):
            f.write(block)
    blob.unlink()


def _round(
    bench: Bench,
    boto: Any,
    keys: list[str],
    streaming: Callable | None,
    k: int,
    server: int,
    warm_pages: int,
) -> dict:
    """One round: every measurement once, in an order rotated by ``k``, with the CPU
    seconds it cost this process (with its download process, `_getter_cpu_s`) and the server
    (``<name>_cpu``, ``<name>_server_cpu``);
    with ``warm_pages``, that many bytes of free pages touched before each."""
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("bulk_s", lambda: _gets(bench.fs, bench.paths)),
        ("verified_bulk_s", lambda: _verified_gets(bench.fs, bench.paths, bench.cache_dir())),
        ("boto_s", lambda: _boto_gets(boto, keys)),
        ("signed_s", lambda: _signed_gets(bench.fs, bench.paths)),
        ("streamed_s", lambda: _signed_gets(bench.fs, bench.paths, keep=False)),
        ("first", bench.first_batch),
        ("shuffled_s", lambda: bench.epoch(True)),
        ("grouped_s", lambda: bench.epoch(True, group_shards=4)),
        ("in_order_s", lambda: bench.epoch(False)),
        ("prefetch", bench.prefetch_all),
    ]
    if streaming is not None:
        steps += [("streaming", streaming), ("roxxel", bench.opened_epoch)]
    k %= len(steps)
    result: dict[str, Any] = {}
    for name, call in steps[k:] + steps[:k]:
        gc.collect()  # the caches, loaders and mappings of the last measurement go first
        if warm_pages:
            _touch_free_pages(bench.root, warm_pages)
        cpu, server_cpu = time.process_time() + _getter_cpu_s(), _cpu_s(server)
        value = call()
        result[f"{name}_cpu"] = time.process_time() + _getter_cpu_s() - cpu
        result[f"{name}_server_cpu"] = _cpu_s(server) - server_cpu
        if isinstance(value, dict):
            result.update({f"{name}_{key}": v for key, v in value.items()})
        else:
            result[name] = value
    result["fastest_bulk_s"] = min(
        result["bulk_s"], result["boto_s"], result["signed_s"], result["streamed_s"]
    )
    for name in ("roxxel", "streaming"):
        if f"{name}_epoch_s" in result:
            result[f"{name}_rate"] = result[f"{name}_num_batches"] / result[f"{name}_epoch_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Datasets at a URL: ratios against a local S3 server"
    )
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--shards", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-streaming", dest="streaming", action="store_false")
    parser.add_argument(
        "--mb-per-connection",
        type=float,
        default=16.0,
        help="`benchmarks.throttle` in front of the server gives each connection at most this"
        " many MB/s, as from an object store across a network (every client measured goes"
        " through it); 0: the server unpaced",
    )
    parser.add_argument(
        "--warm-pages",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="before each measurement, write and delete 4x the dataset's bytes (the default):"
        " on a VM that hands free memory back to its host, new page-cache pages then cost what"
        " they cost on a machine of its own",
    )
    args = parser.parse_args()
    os.environ.update(CREDENTIALS)
    import boto3
    import fsspec

    load_before = _uptime()
    streaming_error = venvs.ensure_venv("streaming") if args.streaming else "not asked for"
    port = _free_port()
    server = subprocess.Popen(  # its own process: the server does not share our GIL
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    throttle = None
    if args.mb_per_connection:
        moto_port, port = port, _free_port()
        pace = [str(port), str(moto_port), str(args.mb_per_connection)]
        throttle = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.throttle", *pace], stdout=subprocess.PIPE
        )
        assert throttle.stdout is not None and throttle.stdout.readline().strip() == b"ready"
    try:
        options = {"endpoint_url": f"http://127.0.0.1:{port}"}
        fs = fsspec.filesystem("s3", **options)
        _wait_until_up(fs)
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            tokens = _write(root / "ds", args.mib, args.shards)
            fs.mkdir(BUCKET)
            fs.put(str(root / "ds"), f"{BUCKET}/ds", recursive=True)
            bench = Bench(fs, f"s3://{BUCKET}/ds", root, options, args.batch)
            streaming = None
            if streaming_error is None:
                streaming = _upload_mds(fs, root, tokens, bench, args.batch, port)
            boto = boto3.client("s3", endpoint_url=options["endpoint_url"])
            keys = [p.split("/", 1)[1] for p, _ in bench.paths]
            warm = 4 * sum(e.num_bytes for e in bench.manifest.shards) if args.warm_pages else 0
            rounds = [
                _round(bench, boto, keys, streaming, k, server.pid, warm)
                for k in range(args.repeats)
            ]
    finally:
        for process in (server, throttle):
            if process is not None:
                process.terminate()
                process.wait()
    report = _report(args, bench, rounds, streaming_error, load_before)
    print(
        "{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in report.items()) + "\n}"
    )


def _bound(rounds: list[dict[str, float]]) -> tuple[float, list[float]]:
    """A global shuffle's first batches read nearly every shard, so its epoch takes at least
    the download of them all, then the batches: bulk / (prefetch + warm epoch)."""
    each = [r["fastest_bulk_s"] / (r["prefetch_s"] + r["prefetch_warm_epoch_s"]) for r in rounds]
    return round(statistics.median(each), 2), [round(x, 2) for x in each]


def _cores_bound(rounds: list[dict[str, float]]) -> tuple[float, list[float]]:
    """What any design could reach on this machine's cores: an epoch with the cache warming
    up does at least the work of a bare verified download of every shard (this process and
    the server) and of an epoch over the filled cache, so it takes at least that CPU over
    the cores, and at least the bulk time: bulk / max(bulk, CPU / cores)."""
    cores = len(os.sched_getaffinity(0))
    each = []
    for r in rounds:
        cpu = r["verified_bulk_s_cpu"] + r["verified_bulk_s_server_cpu"]
        least = max(r["fastest_bulk_s"], (cpu + r["prefetch_warm_epoch_cpu"]) / cores)
        each.append(r["fastest_bulk_s"] / least)
    return round(statistics.median(each), 2), [round(x, 2) for x in each]


def _cpu_row(rounds: list[dict[str, float]], name: str, walls: tuple[str, ...]) -> str:
    client, server = _median(rounds, f"{name}_cpu"), _median(rounds, f"{name}_server_cpu")
    seconds = statistics.median(sum(r[w] for w in walls) for r in rounds)
    busy = (client + server) / (len(os.sched_getaffinity(0)) * seconds)
    return f"{client:.2f} + {server:.2f} CPU s in {seconds:.2f} s: {100 * busy:.0f}% busy"


def _report(args: Any, bench: Bench, rounds: list[dict], streaming_error: str | None, load: str):
    total = sum(e.num_bytes for e in bench.manifest.shards)
    report: dict[str, Any] = {
        "load (1, 5, 15 min) before / after": f"{load} / {_uptime()}",
        "dataset_mib": round(total / 2**20, 1),
        "num_shards": len(bench.manifest.shards),
        "repeats": args.repeats,
        "free pages touched before each measurement": args.warm_pages,
        "MB/s per connection (benchmarks.throttle)": args.mb_per_connection or "not paced",
        "bulk_MB_per_s (8 GETs, s3fs)": round(total / _median(rounds, "bulk_s") / 1e6, 1),
        "bulk_MB_per_s (8 GETs, boto3)": round(total / _median(rounds, "boto_s") / 1e6, 1),
        "bulk_MB_per_s (8 GETs, urllib3 on signed URLs)": round(
            total / _median(rounds, "signed_s") / 1e6, 1
        ),
        "bulk_MB_per_s (the same streamed through a reused 4 MiB buffer, bytes dropped)": round(
            total / _median(rounds, "streamed_s") / 1e6, 1
        ),
        "first_batch_s": round(_median(rounds, "first_first_s"), 3),
        "first_batch_shards": _median(rounds, "first_shards"),
        "first_batch_shards_raw_gets_s (the fastest of s3fs, signed and streamed GETs)": round(
            _median(rounds, "first_raw_s"), 3
        ),
        "first_batch / raw GETs of its shards (<= 1.5)": _ratios(
            rounds, "first_first_s", "first_raw_s"
        ),
        "first_batch / roxxel fetch of its shards": _ratios(
            rounds, "first_first_s", "first_fetch_s"
        ),
        "bare verified download of those shards (GET, write, hash, rename) / raw GETs": _ratios(
            rounds, "first_verified_s", "first_raw_s"
        ),
        "below, bulk": "the fastest of the four clients in each round",
        "epoch_shuffled / bulk (>= 0.8)": _ratios(rounds, "fastest_bulk_s", "shuffled_s"),
        "epoch_grouped (shuffle_group_shards=4) / bulk (>= 0.8)": _ratios(
            rounds, "fastest_bulk_s", "grouped_s"
        ),
        "epoch_in_order / bulk (>= 0.8)": _ratios(rounds, "fastest_bulk_s", "in_order_s"),
        "epoch_shuffled / s3fs bulk (the bulk of earlier runs)": _ratios(
            rounds, "bulk_s", "shuffled_s"
        ),
        "prefetch of every shard, no Loader / bulk": _ratios(
            rounds, "fastest_bulk_s", "prefetch_s"
        ),
        "shuffled epoch of the filled cache, no fetch (s)": round(
            _median(rounds, "prefetch_warm_epoch_s"), 3
        ),
        "bound for a global shuffle: bulk / (prefetch + that epoch)": _bound(rounds),
        "bare verified download of every shard (signed GETs, streamed) / bulk": _ratios(
            rounds, "fastest_bulk_s", "verified_bulk_s"
        ),
        "bound on these cores: bulk / max(bulk, (CPU of that download + of the warm epoch)"
        " / cores)": _cores_bound(rounds),
        "CPU s (this process and its download process + server) in wall s (prefetch: and the warm epoch)": {
            name: _cpu_row(rounds, name, wall)
            for name, wall in (
                ("bulk_s", ("bulk_s",)),
                ("signed_s", ("signed_s",)),
                ("verified_bulk_s", ("verified_bulk_s",)),
                ("prefetch", ("prefetch_s", "prefetch_warm_epoch_s")),
                ("shuffled_s", ("shuffled_s",)),
                ("grouped_s", ("grouped_s",)),
                ("in_order_s", ("in_order_s",)),
            )
        },
    }
    if streaming_error is not None:
        report["streaming"] = f"not measured: {streaming_error}"
        return report
    report.update(
        {
            "streaming_first_batch_s": round(_median(rounds, "streaming_first_s"), 3),
            "roxxel_first_batch_s (from open)": round(_median(rounds, "roxxel_first_s"), 3),
            "roxxel / streaming first batch (<= 0.5)": _ratios(
                rounds, "roxxel_first_s", "streaming_first_s"
            ),
            "streaming_epoch_s": round(_median(rounds, "streaming_epoch_s"), 3),
            "roxxel_epoch_s (from open)": round(_median(rounds, "roxxel_epoch_s"), 3),
            "batches per epoch (roxxel, streaming)": [
                _median(rounds, "roxxel_num_batches"),
                _median(rounds, "streaming_num_batches"),
            ],
            "roxxel / streaming shuffled batches per s (>= 2)": _ratios(
                rounds, "roxxel_rate", "streaming_rate"
            ),
        }
    )
    return report


if __name__ == "__main__":
    main()
