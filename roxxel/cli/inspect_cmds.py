"""``roxxel info``, ``verify``, ``cat`` and ``bench``: look at a packed dataset."""

from __future__ import annotations

import argparse
import base64
import json
import multiprocessing
import os
import signal
import time
from typing import Any

import numpy as np

from roxxel.cli.args import add_url_flags, storage_options, url_options
from roxxel.errors import ConfigError, FormatError, without_credentials
from roxxel.format.dataset import Dataset, open_dataset
from roxxel.format.reader import Corruption, Shard
from roxxel.ingest.pool import interrupts_held

__all__ = ["add_inspect_parsers"]

_RAW = argparse.RawDescriptionHelpFormatter


def add_inspect_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="schema, records, bytes, tokens, shards", formatter_class=_RAW,
                       description="Describe a dataset.", epilog="example:\n  roxxel info data/corpus --json")  # fmt: skip
    p.add_argument("dataset", metavar="DIR")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_url_flags(p)
    p.set_defaults(func=cmd_info)
    p = sub.add_parser("verify", help="check every checksum (exit 1 on corruption)", formatter_class=_RAW,
                       description="Check every record checksum of every shard, in parallel.",
                       epilog="example:\n  roxxel verify data/corpus --workers 4")  # fmt: skip
    p.add_argument("dataset", metavar="DIR")
    p.add_argument(
        "--workers", type=int, default=os.cpu_count() or 1, metavar="N", help="processes"
    )
    add_url_flags(p)
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("cat", help="print records", formatter_class=_RAW,
                       description="Print records by global index (negative counts from the end).",
                       epilog="example:\n  roxxel cat data/corpus 0 1 -1 --json")  # fmt: skip
    p.add_argument("dataset", metavar="DIR")
    p.add_argument("indices", nargs="+", type=int, metavar="INDEX")
    p.add_argument("--json", action="store_true", help="one JSON object per line (bytes as base64)")
    add_url_flags(p)
    p.set_defaults(func=cmd_cat)
    p = sub.add_parser("bench", help="measure read speed on this machine", formatter_class=_RAW,
                       description="Measure sequential and random batch read speed of a dataset.",
                       epilog="example:\n  roxxel bench data/corpus --batch-size 256 --num-batches 100")  # fmt: skip
    p.add_argument("dataset", metavar="DIR")
    p.add_argument("--batch-size", type=int, default=64, metavar="B")
    p.add_argument("--num-batches", type=int, default=100, metavar="N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    add_url_flags(p)
    p.set_defaults(func=cmd_bench)


def _elements(ds: Dataset) -> dict[str, int]:
    """Elements (tokens) of each uncompressed 1-D variable field, from every shard's index
    (at a URL its index alone is fetched, not its records), so a shard that disagrees with
    the manifest (M9) fails the command."""
    fields = [f for f in ds.schema if f.kind == "array" and f.is_variable and len(f.shape) == 1]
    if not fields:
        return {}

    def count(shard: Shard) -> dict[str, int | None]:  # None: compressed, no flat stream
        columns = shard.columns
        return {
            f.name: None if columns[f.name].compressed else shard.flat(f.name).size for f in fields
        }

    counts = ds.shard_indexes(count)
    return {
        f.name: sum(c[f.name] or 0 for c in counts)
        for f in fields
        if all(c[f.name] is not None for c in counts)
    }


def _open(args: argparse.Namespace) -> Dataset:
    """The dataset the command names; a URL's shards are cached in ``--cache-dir``."""
    options = storage_options(args.storage_options)
    return open_dataset(args.dataset, **url_options(args.dataset, args.cache_dir, options))


def cmd_info(args: argparse.Namespace) -> int:
    ds = _open(args)
    shards = [
        {"path": s.path, "num_records": s.num_records, "num_bytes": s.num_bytes}
        for s in ds.manifest.shards
    ]
    doc = {
        "path": str(ds.path) if ds.url is None else without_credentials(ds.url),  # logged
        "num_records": ds.num_records,
        "num_shards": ds.num_shards,
        "num_bytes": sum(s["num_bytes"] for s in shards),
        "fingerprint": ds.fingerprint,
        "schema": ds.schema.to_json(),
        "elements": _elements(ds),
        "metadata": ds.metadata,
        "shards": shards,
    }
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(
        f"{doc['path']}: {doc['num_records']} records, {doc['num_shards']} shards, {doc['num_bytes']} bytes"
    )
    print(f"fingerprint: {doc['fingerprint']}")
    for name, spec in doc["schema"].items():
        extra = f"  ({doc['elements'][name]} elements)" if name in doc["elements"] else ""
        print(f"  {name}: {spec}{extra}")
    _print_made(doc["metadata"])
    return 0


def _print_made(metadata: dict[str, Any]) -> None:
    """How ``roxxel pack`` made the tokens or pixels, from the manifest metadata."""
    tok = metadata.get("tokenizer")
    if isinstance(tok, dict):
        specials = ", ".join(
            f"{k} {tok.get(k)}" for k in ("bos_id", "eos_id") if tok.get(k) is not None
        )
        print(
            f"tokenizer: {tok.get('kind')} {tok.get('path')} sha256 {tok.get('sha256')} "
            f"(vocab {tok.get('vocab_size')}, field {tok.get('text_field')!r} -> "
            f"{tok.get('field')!r} {tok.get('dtype')}{', ' + specials if specials else ''})"
        )
    images = metadata.get("images")
    if isinstance(images, dict):
        labels = images.get("labels") or {}
        where = f", {len(labels)} labels in {images.get('label_field')!r}" if labels else ""
        how = "kept encoded" if images.get("keep_encoded") else images.get("fit")
        print(f"images: {images.get('field')!r} {images.get('spec')} ({how}{where})")


def _verify_shard(
    path: str, k: int, cache_dir: str | None, options: str | None
) -> list[Corruption]:
    try:
        where = url_options(path, cache_dir, storage_options(options))
        return open_dataset(path, **where).verify_shard(k)
    except FormatError as e:
        return [Corruption(path, -1, "", str(e))]


def _verify_in_processes(args: argparse.Namespace, ks: range) -> list[list[Corruption]]:
    """Each shard's corruptions, `args.workers` processes at a time. A Ctrl-C stops it with
    one line and ends the workers at once, with any download they wait for (its shard is
    fetched again next time, never published half): they ignore SIGINT, and one arriving
    while they start is held until they run (`interrupts_held`)."""
    ctx = multiprocessing.get_context("forkserver")
    with interrupts_held():
        pool = ctx.Pool(min(args.workers, len(ks)), initializer=_ignore_interrupts)
    with pool:  # leaving it terminates the workers
        jobs = [(args.dataset, k, args.cache_dir, args.storage_options) for k in ks]
        return pool.starmap(_verify_shard, jobs)


def _ignore_interrupts() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def cmd_verify(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise ConfigError(f"--workers: {args.workers} (expected >= 1)")
    ds = _open(args)
    ks = range(ds.num_shards)
    if args.workers <= 1 or ds.num_shards <= 1:
        found = [_verify_shard(args.dataset, k, args.cache_dir, args.storage_options) for k in ks]
    else:
        found = _verify_in_processes(args, ks)
    bad = [c for shard in found for c in shard]
    name = without_credentials(args.dataset)  # stdout ends up in logs
    for c in bad:
        if c.record >= 0:  # the message names the record and field
            line = f"{c.path}: {c.message}"
        else:  # a shard that does not map: its error names the file already
            line = c.message if c.message.startswith(c.path) else f"{c.path}: {c.message}"
        print(without_credentials(line))
    if bad:
        print(
            f"{name}: {_count(len(bad), 'corruption')} in {sum(1 for s in found if s)} of"
            f" {_count(ds.num_shards, 'shard')}"
        )
        return 1
    print(f"{name}: OK ({ds.num_records} records in {ds.num_shards} shards)")
    return 0


def _count(num: int, noun: str) -> str:
    """``1 shard``, ``2 shards``."""
    return f"{num} {noun}{'' if num == 1 else 's'}"


def _json_value(value: Any, kind: str) -> Any:
    if kind == "str":
        return value
    if kind == "bytes":
        return base64.b64encode(np.asarray(value, np.uint8).tobytes()).decode("ascii")
    array = np.asarray(value)
    if array.dtype.kind not in "biuf":  # bfloat16: no JSON number of its own
        array = array.astype(np.float32)
    return array.item() if array.ndim == 0 else array.tolist()


def _text_value(value: Any, kind: str, spec: str) -> str:
    if kind == "str":
        return repr(value)
    if kind == "bytes":
        data = np.asarray(value, np.uint8).tobytes()
        return f"bytes[{len(data)}] {data[:64]!r}{' ...' if len(data) > 64 else ''}"
    array = np.asarray(value)
    text = np.array2string(array, threshold=32, edgeitems=8, max_line_width=100)
    return text if array.ndim == 0 else f"{spec} shape {array.shape}: {text}"


def cmd_cat(args: argparse.Namespace) -> int:
    ds = _open(args)
    for index in args.indices:
        try:
            record = ds[index]
        except IndexError:
            expected = f"-{len(ds)} <= INDEX < {len(ds)}" if len(ds) else "none: it is empty"
            raise ConfigError(f"{args.dataset}: index {index} (expected {expected})") from None
        fields = {f.name: f for f in ds.schema}
        if args.json:
            doc = {n: _json_value(v, fields[n].kind) for n, v in record.items()}
            print(json.dumps({"index": index, **doc}))
        else:
            print(f"record {index}")
            for n, v in record.items():
                print(f"  {n}: {_text_value(v, fields[n].kind, fields[n].spec)}")
    return 0


def _timed(ds: Dataset, batches: list[np.ndarray]) -> tuple[float, float]:
    out = ds.get_batch(batches[0])  # warm up: map shards, allocate buffers
    num_bytes = 0
    start = time.perf_counter()
    for idx in batches:
        out = ds.get_batch(idx, out=out)
        num_bytes += sum(a.nbytes for a in out.values())
    elapsed = max(time.perf_counter() - start, 1e-9)
    return sum(len(b) for b in batches) / elapsed, num_bytes / elapsed / 1e6


def cmd_bench(args: argparse.Namespace) -> int:
    ds = _open(args)
    if len(ds) == 0 or args.batch_size < 1 or args.num_batches < 1:
        raise ConfigError(
            f"{args.dataset}: nothing to read (expected records, --batch-size and --num-batches >= 1)"
        )
    rng = np.random.default_rng(args.seed)
    b, n = args.batch_size, args.num_batches
    sequential = [np.arange(i * b, (i + 1) * b) % len(ds) for i in range(n)]
    random = [rng.integers(0, len(ds), b) for _ in range(n)]
    results = {}
    for name, batches in (("sequential", sequential), ("random", random)):
        records_s, mb_s = _timed(ds, batches)
        results[name] = {"records_per_s": round(records_s, 1), "mb_per_s": round(mb_s, 2)}
    if args.json:
        print(json.dumps({"batch_size": b, "num_batches": n, **results}))
    else:
        for name, r in results.items():
            print(
                f"{name:>10}: {r['records_per_s']:.0f} records/s, {r['mb_per_s']:.1f} MB/s (batch {b})"
            )
    return 0
