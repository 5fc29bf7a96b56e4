"""``roxxel push DIR URL``: publish a local dataset at a URL, shards first, manifest last.

``roxxel pack ... -o DIR`` then ``roxxel push DIR s3://bucket/ds`` is how a pack lands in
object storage: a push that was killed leaves no manifest at the URL, so nothing opens there
until a later push completes (`roxxel.format.upload`). Ctrl-C ends it at once (exit 130):
the uploads in flight are abandoned, and the manifest never goes up after them.
"""

from __future__ import annotations

import argparse
import sys

from roxxel.cli.args import storage_options
from roxxel.errors import ConfigError, without_credentials
from roxxel.format.remote import is_url
from roxxel.format.upload import check_destination, upload_dataset

__all__ = ["add_push_parser"]

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
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=cmd_push)


def cmd_push(args: argparse.Namespace) -> int:
    if is_url(args.dir):
        raise ConfigError(
            f"DIR: {args.dir!r} is a URL (expected a local dataset folder; `roxxel pull URL"
            " DIR` stages one)"
        )
    check_destination(args.url, "URL:")

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
    print(f"{without_credentials(args.url)}: {num} shards and the manifest uploaded")
    return 0
