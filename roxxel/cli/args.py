"""Argument parsing helpers shared by the ``roxxel`` subcommands.

A `UsageError` is a mistake in how the command was called (exit status 2, with the usage
line); a `RoxxelError` is a problem with the data or configuration (exit status 1).
"""

from __future__ import annotations

import argparse
import re
import tomllib
from collections.abc import Mapping
from typing import Any

from roxxel.errors import ConfigError, load_json
from roxxel.format.remote import is_url

__all__ = [
    "UsageError",
    "add_url_flags",
    "parse_compress_flags",
    "parse_field_flags",
    "parse_size",
    "read_schema_toml",
    "storage_options",
    "url_options",
]

_SIZE = re.compile(r"^(\d+)\s*([kmgt]?)i?b?$", re.IGNORECASE)
_SCALE = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class UsageError(Exception):
    """The command line itself is wrong: printed with the usage, exit status 2."""


def add_url_flags(p: argparse.ArgumentParser) -> None:
    """``--cache-dir DIR`` (where the shards of a dataset at a URL are fetched to) and
    ``--storage-options JSON`` (its fsspec options: endpoint, credentials)."""
    p.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="cache for datasets at a URL (default $ROXXEL_CACHE_DIR or ~/.cache/roxxel)",
    )
    p.add_argument(
        "--storage-options",
        metavar="JSON",
        help="fsspec options of a URL, a JSON object (default: the protocol's own places)",
    )


def url_options(
    path: str, cache_dir: str | None, options: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """`open_dataset`'s keyword arguments for ``path``: the cache folder and storage options
    for a URL, none for a local directory, which is read in place (so one ``--cache-dir``
    serves a mixture of both).

    >>> url_options("s3://bucket/ds", "/nvme/cache"), url_options("data/ds", "/nvme/cache")
    ({'cache_dir': '/nvme/cache', 'storage_options': {}}, {})
    """
    if not is_url(path):
        return {}
    return {"cache_dir": cache_dir, "storage_options": dict(options or {})}


def storage_options(text: str | None) -> dict[str, Any]:
    """The fsspec options of ``--storage-options JSON`` (strict JSON, an object)."""
    if text is None:
        return {}
    try:  # the command line is wrong: exit status 2, as for any other bad flag
        options = load_json(text.encode(), "--storage-options", ConfigError)
    except ConfigError as error:
        raise UsageError(str(error)) from None
    if not isinstance(options, dict):
        raise UsageError(f"--storage-options: {type(options).__name__} (expected a JSON object)")
    return options


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
