"""``roxxel pull URL DIR``: stage a whole dataset from object storage into a local folder.

Shards are fetched in parallel through the verified cache (`roxxel.format.cache`): each is
checked completely before it gets its name, so DIR never holds a shard that does not match.
A shard already in DIR with the manifest's size and trailer is kept (a pull that was stopped
resumes where it was). The manifest is written last, so DIR opens as a dataset only once every
shard is there. Progress goes to stderr, one line per shard.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from roxxel.cli.args import storage_options
from roxxel.errors import ConfigError, FormatError
from roxxel.format.cache import MOST_FETCHES, CacheConfig, ShardCache, stoppable_waits
from roxxel.format.dataset import open_dataset
from roxxel.format.manifest import MANIFEST_NAME, Manifest, ShardEntry
from roxxel.format.reader import Shard
from roxxel.format.remote import is_url
from roxxel.format.upload import check_local_folder

__all__ = ["add_pull_parser"]

EPILOG = """example:
  roxxel pull s3://bucket/corpus /local/nvme/corpus --workers 8

Credentials and endpoints come from the protocol's usual places (environment, config files);
--storage-options passes fsspec options as JSON, e.g. '{"endpoint_url": "http://..."}'."""


def add_pull_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "pull",
        help="stage a dataset at a URL into a local folder (parallel, verified, resumable)",
        description="Fetch every shard of a dataset at a URL into DIR, verified; manifest last.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("url", metavar="URL")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--workers", type=int, default=8, metavar="N", help="parallel downloads")
    p.add_argument("--storage-options", metavar="JSON", help="fsspec options (a JSON object)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=cmd_pull)


def cmd_pull(args: argparse.Namespace) -> int:
    if not is_url(args.url):
        raise ConfigError(f"URL: {args.url!r} is not a URL (expected e.g. s3://bucket/ds)")
    if is_url(args.dir):
        raise ConfigError(
            f"DIR: {args.dir!r} is a URL (expected a local folder; `roxxel push DIR URL` uploads)"
        )
    if not 1 <= args.workers <= MOST_FETCHES:
        raise ConfigError(f"--workers: {args.workers} (expected 1 to {MOST_FETCHES})")
    options = storage_options(args.storage_options)
    folder = Path(args.dir)
    check_local_folder(args.dir, "DIR:", "a local folder to pull into")  # links to nothing too
    config = CacheConfig(args.url, folder, options, max_fetches=args.workers)
    cache = ShardCache(config, folder=folder)
    manifest = cache.read_manifest()
    _check_destination(folder, manifest)
    _drop_damaged(cache, manifest)
    fetched = _fetch_all(cache, manifest, args.workers, not args.quiet)
    _publish_manifest(folder, manifest)
    dataset = open_dataset(folder)  # every rule of a local dataset (M1-M9) on what we wrote
    kept = dataset.num_shards - fetched
    print(
        f"{folder}: {dataset.num_records} records in {dataset.num_shards} shards"
        f" ({fetched} fetched, {kept} already there)"
    )
    return 0


def _check_destination(folder: Path, manifest: Manifest) -> None:
    """DIR may be empty, a stopped pull of this dataset, or this dataset pulled already:
    nothing in it but this dataset's files (and hidden ones: the cache's locks and parts)."""
    path = folder / MANIFEST_NAME
    if path.exists() and path.read_bytes() != manifest.to_json():
        raise ConfigError(
            f"{folder}: holds another dataset ({MANIFEST_NAME} differs, expected an empty"
            " folder or a pull of the same dataset)"
        )
    ours = {MANIFEST_NAME, *(entry.path for entry in manifest.shards)}
    others = sorted(n for n in os.listdir(folder) if not n.startswith(".") and n not in ours)
    if others:
        raise ConfigError(
            f"{folder}: holds {len(others)} files that are not this dataset's, e.g."
            f" {others[0]!r} (expected an empty folder or a pull of the same dataset)"
        )


def _drop_damaged(cache: ShardCache, manifest: Manifest) -> None:
    """Discard a shard a stopped pull left whose index no longer matches its checksum (its
    size and trailer, which a rerun looks at first, do): it is fetched again."""
    for entry in manifest.shards:
        if not cache.is_current(entry):
            continue
        try:
            Shard(cache.folder / entry.path).close()
        except FormatError:
            cache.discard(entry)


def _fetch_all(cache: ShardCache, manifest: Manifest, workers: int, progress: bool) -> int:
    """Fetch every shard, ``workers`` at a time; returns how many were downloaded. The first
    failure ends the pull: no queued fetch starts, the running ones end (what is fetched
    stays for a rerun); Ctrl-C ends it at once, not waiting for them (`stoppable_waits`)."""
    total = sum(e.num_bytes for e in manifest.shards)
    done_bytes = 0
    stop = threading.Event()

    def fetch(entry: ShardEntry) -> Path:
        with stoppable_waits(stop):
            return cache.fetch(entry)

    with ThreadPoolExecutor(workers, "roxxel-pull") as pool:
        jobs = {pool.submit(fetch, e): e for e in manifest.shards}
        try:
            for done, job in enumerate(as_completed(jobs), 1):
                job.result()
                done_bytes += jobs[job].num_bytes
                if progress:
                    print(
                        f"roxxel pull: {done}/{len(jobs)} shards, {done_bytes}/{total} bytes",
                        file=sys.stderr,
                    )
        except KeyboardInterrupt:  # Ctrl-C: the downloads that run are not waited for
            stop.set()
            pool.shutdown(cancel_futures=True)
            raise
        except BaseException:  # the first failure: no queued fetch starts, running ones end
            pool.shutdown(cancel_futures=True)
            raise
    cache.remove_lock_files(manifest.shards)  # no fetch runs now: they have done their work
    return cache.num_fetched


def _publish_manifest(folder: Path, manifest: Manifest) -> None:
    """Write the manifest beside the shards through a temp file and a rename, then fsync."""
    temp = folder / f".{MANIFEST_NAME}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        with open(temp, "wb") as out:
            out.write(manifest.to_json())
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, folder / MANIFEST_NAME)
    finally:
        temp.unlink(missing_ok=True)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
