"""Argument parsing helpers shared by the ``roxxel`` subcommands.

A `UsageError` is a mistake in how the command was called (exit status 2, with the usage
line); a `RoxxelError` is a problem with the data or configuration (exit status 1).
"""

from __future__ import annotations

import argparse
import re
import tomllib

from roxxel.errors import ConfigError
from roxxel.format.remote import is_url

__all__ = [
    "UsageError",
    "add_cache_dir_flag",
    "parse_compress_flags",
    "parse_field_flags",
    "parse_size",
    "read_schema_toml",
    "url_cache_dir",
]

_SIZE = re.compile(r"^(\d+)\s*([kmgt]?)i?b?$", re.IGNORECASE)
_SCALE = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class UsageError(Exception):
    """The command line itself is wrong: printed with the usage, exit status 2."""


def add_cache_dir_flag(p: argparse.ArgumentParser) -> None:
    """``--cache-dir DIR``: where the shards of a dataset at a URL are fetched to."""
    p.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="cache for datasets at a URL (default $ROXXEL_CACHE_DIR or ~/.cache/roxxel)",
    )


def url_cache_dir(path: str, cache_dir: str | None) -> str | None:
    """`open_dataset`'s ``cache_dir`` for ``path``: ``--cache-dir`` for a URL, None for a local
    directory, which is read in place (so one ``--cache-dir`` serves a mixture of both).

    >>> url_cache_dir("s3://bucket/ds", "/nvme/cache"), url_cache_dir("data/ds", "/nvme/cache")
    ('/nvme/cache', None)
    """
    return cache_dir if is_url(path) else None


def parse_size(text: str) -> int:
    """Bytes from ``"256M"``, ``"1GiB"``, ``"4096"`` (powers of 1024).

    >>> parse_size("256M"), parse_size("1GiB"), parse_size("4096")
    (268435456, 1073741824, 4096)
    """
    match = _SIZE.match(text.strip())
    if not match or int(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (expected e.g. 4096, 64M, 1G)")
    return int(match.group(1)) * _SCALE[match.group(2).lower()]


def parse_field_flags(flags: list[str]) -> dict[str, str]:
    """``["tokens:int32[]", "label:int64"]`` -> ``{"tokens": "int32[]", "label": "int64"}``."""
    fields: dict[str, str] = {}
    for flag in flags:
        name, sep, spec = flag.partition(":")
        if not sep or not name or not spec:
            raise UsageError(f"--field {flag!r}: expected NAME:SPEC, e.g. tokens:int32[]")
        if name in fields:
            raise UsageError(f"--field {flag!r}: field {name!r} given twice")
        fields[name] = spec
    return fields


def parse_compress_flags(flags: list[str]) -> dict[str, str]:
    """``["text=zstd:9"]`` -> ``{"text": "zstd:9"}`` (the codec itself is checked later)."""
    out: dict[str, str] = {}
    for flag in flags:
        name, sep, codec = flag.partition("=")
        if not sep or not name or not codec:
            raise UsageError(f"--compress {flag!r}: expected FIELD=zstd[:LEVEL]")
        out[name] = codec
    return out


def read_schema_toml(path: str) -> dict[str, str]:
    """Fields from a TOML file: a ``[fields]`` table, or top-level ``name = "spec"`` keys."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML ({e})") from None
    table = doc.get("fields", doc)
    if not isinstance(table, dict) or not table:
        raise ConfigError(f'{path}: no fields (expected a [fields] table of name = "spec")')
    bad = [k for k, v in table.items() if not isinstance(v, str)]
    if bad:
        raise ConfigError(f'{path}: fields {bad} are not strings (expected name = "int32[]")')
    return dict(table)
