"""Line-oriented inputs: JSON Lines, plain text (one document per line or per file).

Pieces of a line file are byte ranges; a line belongs to the piece that holds its first
byte, so any cut points give every line to exactly one piece. Readers yield
``(record, key)`` where key is the byte offset of the line; ``line_location`` turns it into
``file:line`` only when an error needs it.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Iterator

from roxxel.errors import ConfigError
from roxxel.ingest.units import MAX_BAD_KEPT, BadRecords, Format, Piece, ReadOptions, Record

try:  # optional (roxxel[json]): parses about 2.5x faster; both refuse NaN and Infinity
    import orjson
except ImportError:  # pragma: no cover - depends on the environment
    orjson = None


def _loads(line: bytes) -> object:
    if orjson is not None:
        return orjson.loads(line)
    return json.loads(line, parse_constant=_no_constants)


def _no_constants(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


__all__ = ["line_location", "line_pieces", "read_jsonl", "read_text", "read_text_file"]

_COUNT_CHUNK = 1 << 24


def line_pieces(path: str, fmt: Format, unit_bytes: int) -> list[Piece]:
    """Cut a line file into byte ranges of ``unit_bytes`` (whole file when 0)."""
    size = os.path.getsize(path)
    step = unit_bytes if unit_bytes > 0 else max(size, 1)
    return [
        Piece(path, fmt, s, min(s + step, size), min(step, size - s)) for s in range(0, size, step)
    ]


def line_location(path: str, offset: int) -> str:
    """``"path:LINE"`` (1-based) for the line starting at byte ``offset``; O(offset)."""
    count = 0
    with open(path, "rb") as f:
        remaining = offset
        while remaining > 0:
            chunk = f.read(min(remaining, _COUNT_CHUNK))
            if not chunk:
                break
            count += chunk.count(b"\n")
            remaining -= len(chunk)
    return f"{path}:{count + 1}"


def _lines(piece: Piece) -> Iterator[tuple[int, bytes]]:
    """(offset, line without newline) for every line starting in [start, stop)."""
    if piece.stop <= piece.start:
        return
    with open(piece.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        size = len(mm)
        pos = piece.start
        if pos > 0:
            newline = mm.find(b"\n", pos - 1)
            pos = size if newline < 0 else newline + 1
        while pos < piece.stop and pos < size:
            end = mm.find(b"\n", pos)
            end = size if end < 0 else end
            yield pos, mm[pos:end]
            pos = end + 1


def _bad(piece: Piece, offset: int, what: str, opts: ReadOptions, bad: BadRecords) -> None:
    if not opts.skip_bad:
        raise ConfigError(f"{line_location(piece.path, offset)}: {what}")
    if bad.count < MAX_BAD_KEPT:
        bad.add(f"{line_location(piece.path, offset)}: {what}")
    else:
        bad.count += 1


def read_jsonl(piece: Piece, opts: ReadOptions, bad: BadRecords) -> Iterator[tuple[Record, int]]:
    """One record per JSON object line; blank lines are skipped.

    Raises ConfigError naming file and line for a malformed line, unless ``opts.skip_bad``.
    """
    for offset, line in _lines(piece):
        if not line.strip():
            continue
        try:
            value = _loads(line)
        except ValueError as e:
            _bad(
                piece, offset, f"malformed JSON ({e}, expected one JSON object per line)", opts, bad
            )
            continue
        if not isinstance(value, dict):
            _bad(piece, offset, f"JSON {type(value).__name__} (expected a JSON object)", opts, bad)
            continue
        yield value, offset


def read_text(piece: Piece, opts: ReadOptions, bad: BadRecords) -> Iterator[tuple[Record, int]]:
    """One record ``{field: line}`` per non-empty UTF-8 line (a trailing CR is dropped)."""
    name = opts.field_for("text")
    for offset, line in _lines(piece):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            _bad(piece, offset, f"invalid UTF-8 ({e}, expected UTF-8 text)", opts, bad)
            continue
        text = text.removesuffix("\r")
        if text:
            yield {name: text}, offset


def read_text_file(
    piece: Piece, opts: ReadOptions, bad: BadRecords
) -> Iterator[tuple[Record, int]]:
    """One record ``{field: whole file}`` per UTF-8 text file."""
    with open(piece.path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        if not opts.skip_bad:
            raise ConfigError(f"{piece.path}: invalid UTF-8 ({e}, expected UTF-8 text)") from None
        bad.add(f"{piece.path}: invalid UTF-8 ({e})")
        return
    yield {opts.field_for("text"): text}, 0
