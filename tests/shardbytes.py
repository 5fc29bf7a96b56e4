"""Test helpers: golden files and named, self-consistent mutations of shard bytes."""

from __future__ import annotations

import importlib.util
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from roxxel.format.spec import TRAILER_BYTES, Trailer, index_checksum, parse_trailer

DATA = Path(__file__).resolve().parent / "data"
GOLDEN = DATA / "golden-v1.rxs"
GOLDEN_ZSTD = DATA / "golden-v1-zstd.rxs"


def make_golden_module() -> Any:
    """tools/make_golden.py as a module (its records and schema are the golden truth)."""
    path = Path(__file__).resolve().parent.parent / "tools" / "make_golden.py"
    spec = importlib.util.spec_from_file_location("make_golden", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def golden(path: Path = GOLDEN) -> bytearray:
    return bytearray(path.read_bytes())


def trailer(data: bytes | bytearray) -> Trailer:
    return parse_trailer(bytes(data[-TRAILER_BYTES:]), len(data), "test")


def put(data: bytearray, offset: int, fmt: str, value: int) -> bytearray:
    struct.pack_into("<" + fmt, data, offset, value)
    return data


def reseal(data: bytearray) -> bytearray:
    """Recompute the index checksum, so a mutation reaches the rules past R8."""
    at = len(data) - TRAILER_BYTES
    num, tables, meta, meta_bytes = struct.unpack_from("<QQQQ", data, at)
    end = meta + meta_bytes
    sealed = index_checksum(
        bytes(data[:64]), bytes(data[tables:end]), Trailer(num, tables, meta, meta_bytes, 0)
    )
    return put(data, at + 32, "Q", sealed)


def meta(data: bytes | bytearray) -> dict[str, Any]:
    t = trailer(data)
    return json.loads(bytes(data[t.meta_offset : t.meta_offset + t.meta_bytes]))


def edit_meta(
    data: bytearray, edit: Callable[[dict[str, Any]], Any], raw: bytes | None = None
) -> bytearray:
    """Rewrite the metadata (``edit`` changes the parsed dict, or ``raw`` replaces the bytes)."""
    t = trailer(data)
    doc = meta(data)
    edit(doc)
    body = (
        raw if raw is not None else json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    )
    out = bytearray(data[: t.meta_offset]) + body + bytearray(data[-TRAILER_BYTES:])
    put(out, len(out) - TRAILER_BYTES + 24, "Q", len(body))
    return reseal(out)


def field(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return next(f for f in doc["fields"] if f["name"] == name)


def extent(data: bytes | bytearray, name: str, key: str) -> tuple[int, int]:
    offset, nbytes = field(meta(data), name)[key]
    return offset, nbytes
