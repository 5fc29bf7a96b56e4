"""``roxxel push DIR URL``: publish a local dataset at a URL, shards first, manifest last.

``roxxel pack ... -o DIR`` then ``roxxel push DIR s3://bucket/ds`` is how a pack lands in
object storage: a push that was killed leaves no manifest at the URL, so nothing opens there
until a later push completes (`roxxel.format.upload`).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from roxxel.cli.args import UsageError
from roxxel.cli.pull import storage_options
from roxxel.format.cache import CacheConfig, default_cache_dir
from roxxel.format.upload import upload_dataset

__all__ = ["add_push_parser", "pack_to_url"]

EPILOG = """example:
  roxxel push data/corpus s3://bucket/corpus --workers 8

Credentials and endpoints come from the protocol's usual places (environment, config files);
--storage-options passes fsspec options as JSON, e.g. '{"endpoint_url": "http://..."}'."""


def add_push_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "push",
        help="publish a local dataset at a URL (shards first, manifest last)",
        description="Upload every shard of DIR to URL in parallel, then its manifest.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dir", metavar="DIR")
    p.add_argument("url", metavar="URL")
    p.add_argument("--workers", type=int, default=8, metavar="N", help="parallel uploads")
    p.add_argument("--storage-options", metavar="JSON", help="fsspec options (a JSON object)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=cmd_push)


def cmd_push(args: argparse.Namespace) -> int:
    def progress(done: int, total: int) -> None:
        if not args.quiet:
            print(f"roxxel push: {done}/{total} shards", file=sys.stderr)

    num = upload_dataset(
        args.dir,
        args.url,
        storage_options=storage_options(args.storage_options),
        workers=args.workers,
        on_shard=progress,
    )
    print(f"{args.url}: {num} shards and the manifest uploaded")
    return 0


def pack_to_url(args: argparse.Namespace, pack: Callable[[argparse.Namespace], int]) -> int:
    """``roxxel pack ... -o URL``: pack into a staging folder, then push it (manifest last).

    The staging folder is ``<cache dir>/staging/<name of the URL's cache folder>``: a rerun
    after an interruption resumes the pack there, and it is removed once the push is done.
    Credentials and endpoints come from the protocol's usual places (environment, files).
    """
    if args.num_tasks > 1 or args.finalize:
        raise UsageError(
            f"-o {args.output}: one task packs to a URL (expected --num-tasks 1; pack a"
            " multi-task job to shared storage, then roxxel push)"
        )
    url = args.output
    stage = default_cache_dir() / "staging" / CacheConfig(url, Path()).folder.name
    status = pack(argparse.Namespace(**{**vars(args), "output": str(stage)}))
    if status != 0:
        return status
    num = upload_dataset(stage, url, workers=max(8, args.workers))
    shutil.rmtree(stage)
    if not args.quiet:
        print(f"{url}: {num} shards and the manifest uploaded")
    return 0
