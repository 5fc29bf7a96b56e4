"""The ``roxxel`` command: parse arguments, call the library, print, return an exit status.

Exit status: 0 on success, 1 when roxxel refuses the data or configuration (one line on
stderr, no traceback), 2 for a wrong command line (with its usage), 130 on Ctrl-C, 141
(as for SIGPIPE) when the reader of stdout goes away, as ``roxxel cat ... | head`` does.
"""

from __future__ import annotations

import argparse
import os
import sys

from roxxel.cli.args import UsageError
from roxxel.cli.inspect_cmds import add_inspect_parsers
from roxxel.cli.pack import add_merge_parser, add_pack_parser
from roxxel.cli.peek import add_peek_parser
from roxxel.cli.plan import add_plan_parser
from roxxel.cli.pull import add_pull_parser
from roxxel.cli.push import add_push_parser
from roxxel.errors import RoxxelError, without_credentials
from roxxel.version import __version__

__all__ = ["build_parser", "main"]

BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a tool that a pipe ended

EPILOG = """examples:
  roxxel pack corpus/*.jsonl -o data/corpus --field tokens:int32[]
  roxxel info data/corpus
  roxxel verify data/corpus
  roxxel cat data/corpus 0 -1 --json
  roxxel peek data/corpus --step 0 --batch-size 8 --rows 4
  roxxel pull s3://bucket/corpus data/corpus
Run `roxxel COMMAND --help` for each command's options."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="roxxel",
        description="Pack data into roxxel shards, inspect datasets and the batches a loader reads.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"roxxel {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_pack_parser(sub)
    add_merge_parser(sub)
    add_inspect_parsers(sub)
    add_plan_parser(sub)
    add_peek_parser(sub)
    add_pull_parser(sub)
    add_push_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one ``roxxel`` command; returns its exit status (the entry point exits with it)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on bad usage, 0 for --help
        return e.code if isinstance(e.code, int) else 2
    try:
        status = int(args.func(args))
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return status
    except BrokenPipeError:
        _silence_stdout()
        return BROKEN_PIPE
    except UsageError as e:
        why = without_credentials(str(e))
        print(
            f"roxxel {args.command}: error: {why} (see roxxel {args.command} --help)",
            file=sys.stderr,
        )
        return 2
    except (RoxxelError, OSError) as e:
        print(f"roxxel {args.command}: error: {without_credentials(str(e))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"roxxel {args.command}: interrupted", file=sys.stderr)
        return 130


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush of what is still
    buffered does not fail again (the recipe of Python's `signal` documentation)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a non-file (a test's capture)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
