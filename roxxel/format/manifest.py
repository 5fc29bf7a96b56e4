"""A dataset's manifest.json: the list of shards, as values and as untrusted bytes.

Bytes in, values out (no I/O). Rules M1-M6 of docs/format.md; the dataset module adds the
checks that need the file system (M7-M9).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from roxxel.errors import ConfigError, FormatError, check_int, load_json
from roxxel.format.schema import Schema
from roxxel.format.spec import FORMAT_VERSION

__all__ = [
    "MANIFEST_MAX_BYTES",
    "MANIFEST_NAME",
    "Manifest",
    "ShardEntry",
    "ShardInfo",
    "json_object",
    "parse_manifest",
]

MANIFEST_NAME = "manifest.json"
MANIFEST_MAX_BYTES = 64 << 20
MAX_NUM_RECORDS = 1 << 62  # per shard entry and for the whole dataset: int64 arithmetic stays exact
FORMAT_NAME = "roxxel-dataset"
_KEYS = {"format", "format_version", "metadata", "num_records", "schema", "shards"}
_SHARD_KEYS = {"checksum", "num_bytes", "num_records", "path"}
_CHECKSUM = re.compile(r"^xxh3:[0-9a-f]{16}$")


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """What a finished shard file is: its path, record count, size and index checksum."""

    path: Path
    num_records: int
    num_bytes: int
    checksum: str


@dataclass(frozen=True, slots=True)
class ShardEntry:
    """One shard as the manifest lists it; ``path`` is a plain file name in the dataset."""

    path: str
    num_records: int
    num_bytes: int
    checksum: str  # "xxh3:<hex>" of the shard's index (its trailer's index checksum)


@dataclass(frozen=True, slots=True)
class Manifest:
    """The parsed manifest of a dataset."""

    schema: Schema
    shards: tuple[ShardEntry, ...]
    metadata: dict[str, Any]

    @property
    def num_records(self) -> int:
        return sum(s.num_records for s in self.shards)

    def to_json(self) -> bytes:
        """Deterministic bytes: keys and schema fields in a fixed order, two-space indent."""
        doc = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "schema": self.schema.to_json(),
            "num_records": self.num_records,
            "shards": [
                {
                    "path": s.path,
                    "num_records": s.num_records,
                    "num_bytes": s.num_bytes,
                    "checksum": s.checksum,
                }
                for s in self.shards
            ],
            "metadata": self.metadata,
        }
        return (json.dumps(doc, indent=2, allow_nan=False) + "\n").encode()


def checksum_text(index_checksum: int) -> str:
    """How a manifest spells a shard's index checksum."""
    return f"xxh3:{index_checksum:016x}"


def parse_manifest(data: bytes, path: object) -> Manifest:
    """Check a manifest's bytes against M1-M6 and return its values.

    Strict JSON (no NaN, no float overflow, no duplicate keys); counts are integers (never
    bools or floats) of at most `MAX_NUM_RECORDS`, each and in total. Raises FormatError
    with ``.rule`` and ``.path``.
    """
    if len(data) > MANIFEST_MAX_BYTES:
        raise _fail(path, "M1", f"{len(data)} bytes (cap {MANIFEST_MAX_BYTES})")
    try:
        doc = load_json(data, path)
    except FormatError as exc:
        raise _fail(path, "M1", f"not strict UTF-8 JSON ({exc})") from None
    if not isinstance(doc, dict) or set(doc) != _KEYS:
        raise _fail(
            path,
            "M2",
            f"keys {sorted(doc) if isinstance(doc, dict) else doc!r:.80}"
            f" (expected {sorted(_KEYS)})",
        )
    _check_version(doc["format"], doc["format_version"], path)
    try:
        schema = Schema.parse(doc["schema"])
    except ConfigError as exc:
        raise _fail(path, "M3", str(exc)) from None
    if not isinstance(doc["metadata"], dict) or not isinstance(doc["shards"], list):
        raise _fail(path, "M2", "metadata must be an object and shards a list")
    shards = tuple(_entry(e, i, path) for i, e in enumerate(doc["shards"]))
    names = [s.path for s in shards]
    if len(set(names)) != len(names):
        raise _fail(path, "M5", f"duplicate shard entries in {names[:10]}")
    manifest = Manifest(schema, shards, doc["metadata"])
    total = manifest.num_records
    if total > MAX_NUM_RECORDS:
        raise _fail(path, "M6", f"shards hold {total} records in all (cap {MAX_NUM_RECORDS})")
    if type(doc["num_records"]) is not int or doc["num_records"] != total:
        raise _fail(
            path, "M6", f"num_records {doc['num_records']!r} (expected the shards' sum {total})"
        )
    return manifest


def _check_version(name: Any, version: Any, path: object) -> None:
    """M2: this format's name and version, the version an int (``1.0`` and ``true`` are not)."""
    if name == FORMAT_NAME and type(version) is int and version == FORMAT_VERSION:
        return
    newer = type(version) is int and version > FORMAT_VERSION
    hint = "; written by a newer roxxel, upgrade to read it" if newer else ""
    raise _fail(
        path,
        "M2",
        f"format {name!r:.80} version {version!r:.80} (expected {FORMAT_NAME!r} {FORMAT_VERSION}){hint}",
    )


def _entry(doc: Any, index: int, path: object) -> ShardEntry:
    where = f"shards[{index}]"
    if not isinstance(doc, dict) or set(doc) != _SHARD_KEYS:
        raise _fail(path, "M4", f"{where} is {doc!r:.120} (expected keys {sorted(_SHARD_KEYS)})")
    name, crc = doc["path"], doc["checksum"]
    try:
        num = check_int(f"{where}.num_records", doc["num_records"], 0, MAX_NUM_RECORDS, FormatError)
        size = check_int(f"{where}.num_bytes", doc["num_bytes"], 0, (1 << 62) - 1, FormatError)
    except FormatError as exc:
        raise _fail(path, "M4", str(exc)) from None
    if not isinstance(crc, str) or not _CHECKSUM.match(crc):
        raise _fail(path, "M4", f"{where}: checksum {crc!r:.80} (expected xxh3:<16 hex digits>)")
    if not _plain_name(name):
        raise _fail(
            path, "M5", f"{where}: path {name!r:.300} (expected a file name inside the dataset)"
        )
    return ShardEntry(name, num, size, crc)


def _plain_name(name: Any) -> bool:
    """A file name with no directory part: no '/', no '..', not absolute, no NUL."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..", MANIFEST_NAME)
        and not any(c in name for c in "/\\\0")
        and len(name) <= 255
    )


def json_object(value: Mapping[str, Any] | None, where: str) -> dict[str, Any]:
    """A copy of ``value`` as a dict, checked to be plain JSON (ConfigError otherwise).

    Shared by both sides: writers check user metadata with it before writing anything.

    >>> json_object({"source": "web"}, "metadata")
    {'source': 'web'}
    """
    data = dict(value or {})
    try:
        json.dumps(data, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ConfigError(f"{where}: not JSON-serializable ({exc})") from None
    return data


def _fail(path: object, rule: str, what: str) -> FormatError:
    return FormatError(f"{path}: {what} (rule {rule} of docs/format.md)", rule=rule, path=path)
