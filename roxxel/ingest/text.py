"""Line-oriented inputs: JSON Lines, plain text (one document per line or per file).

Pieces of a line file are byte ranges; a line belongs to the piece that holds its first
byte, so any cut points give every line to exactly one piece. Readers yield
``(record, key)`` where key is the byte offset of the line; ``line_location`` turns it into
``file:line`` only when an error needs it.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator

from roxxel.errors import ConfigError
from roxxel.ingest.units import MAX_BAD_KEPT, BadRecords, InputKind, Piece, ReadOptions, Record

try:  # optional (roxxel[json]): parses about 2.5x faster; both refuse NaN and Infinity
    import orjson
except ImportError:  # pragma: no cover - depends on the environment
    orjson = None


_BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark, dropped where a file starts with one


def _loads(line: bytes) -> object:
    if orjson is not None:
        return orjson.loads(line)
    # decoded here: json.loads would guess UTF-16 or UTF-32 from the first bytes
    return json.loads(line.decode("utf-8"), parse_constant=_no_constants)


def _lossy(record: dict) -> bool:
    """Whether a top-level float of a record is one that orjson may have made of an integer
    literal no 64-bit type holds (the line is then parsed again, exactly)."""
    return any(type(v) is float and not -(2.0**63) <= v < 2.0**64 for v in record.values())


def _no_constants(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


__all__ = [
    "JSONL",
    "TEXT",
    "TEXT_FILE",
    "line_location",
    "line_pieces",
    "read_jsonl",
    "read_text",
    "read_text_file",
]

_COUNT_CHUNK = 1 << 24
_READ_BUFFER = 1 << 20
MAX_LINE_BYTES = 1 << 28  # a line (a record) longer than this is refused, never read whole


def line_pieces(path: str, kind: str, unit_bytes: int) -> list[Piece]:
    """Cut a line file into byte ranges of ``unit_bytes`` (whole file when 0)."""
    size = os.path.getsize(path)
    step = unit_bytes if unit_bytes > 0 else max(size, 1)
    return [
        Piece(path, kind, s, min(s + step, size), min(step, size - s)) for s in range(0, size, step)
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
    """(offset, line) for every line starting in [start, stop); a line keeps its newline
    (parsers skip it; a copy without it would cost more than the split).

    Read with buffered I/O, not a memory map: a file cut short while it is read must end in
    an error, not a SIGBUS. Raises ConfigError when the file ends before ``stop``.
    """
    if piece.stop <= piece.start:
        return
    pos = piece.start
    with open(piece.path, "rb", buffering=_READ_BUFFER) as f:
        if pos > 0:  # the line holding byte start - 1 belongs to the piece before
            f.seek(pos - 1)
            pos += len(f.readline()) - 1
        # readline with a cap (through C: a Python loop of calls costs twice `for line in f`)
        for line in iter(functools.partial(f.readline, MAX_LINE_BYTES + 1), b""):
            if pos >= piece.stop:
                return
            if len(line) > MAX_LINE_BYTES:
                raise ConfigError(
                    f"{piece.path}: offset {pos}: a line longer than {MAX_LINE_BYTES} bytes"
                    " (expected one record per line; is it a text file?)",
                    path=piece.path,
                )
            end = pos + len(line)
            if end < piece.stop and line[-1] != 10:  # no newline before stop: cut short
                break
            yield pos, line.removeprefix(_BOM) if pos == 0 else line
            pos = end
    if pos < piece.stop:
        raise _cut_short(piece, pos)


def _cut_short(piece: Piece, offset: int) -> ConfigError:
    return ConfigError(
        f"{piece.path}: offset {offset}: file ends (expected at least {piece.stop} bytes: the "
        f"input changed since planning)",
        path=piece.path,
        offset=offset,
    )


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
            _bad(piece, offset, _malformed(line, e), opts, bad)
            continue
        if not isinstance(value, dict):
            _bad(piece, offset, f"JSON {type(value).__name__} (expected a JSON object)", opts, bad)
            continue
        if float in map(type, value.values()) and orjson is not None and _lossy(value):
            value = json.loads(line, parse_constant=_no_constants)  # exact big integers
        yield value, offset


def _malformed(line: bytes, error: ValueError) -> str:
    """Why a JSON line does not parse: its bytes not UTF-8 (said as `read_text` says it),
    else the parser's words."""
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"invalid UTF-8 ({e}, expected UTF-8 text)"
    return f"malformed JSON ({error}, expected one JSON object per line)"


def read_text(piece: Piece, opts: ReadOptions, bad: BadRecords) -> Iterator[tuple[Record, int]]:
    """One record ``{field: line}`` per non-empty UTF-8 line (a trailing CR is dropped)."""
    name = opts.field_for("text")
    for offset, line in _lines(piece):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            _bad(piece, offset, f"invalid UTF-8 ({e}, expected UTF-8 text)", opts, bad)
            continue
        text = text.removesuffix("\n").removesuffix("\r")
        if text:
            yield {name: text}, offset


def read_text_file(
    piece: Piece, opts: ReadOptions, bad: BadRecords
) -> Iterator[tuple[Record, int]]:
    """One record ``{field: whole file}`` per UTF-8 text file.

    Reads at most the size the file had when planned (plus one byte, to notice growth):
    raises ConfigError when the size changed, so a device file never reads forever.
    """
    with open(piece.path, "rb") as f:
        data = f.read(piece.num_bytes + 1)
    if len(data) != piece.num_bytes:
        raise ConfigError(
            f"{piece.path}: {len(data)} bytes read (expected {piece.num_bytes}: the input "
            f"changed since planning)",
            path=piece.path,
        )
    try:
        text = data.removeprefix(_BOM).decode("utf-8")
    except UnicodeDecodeError as e:
        if not opts.skip_bad:
            raise ConfigError(f"{piece.path}: invalid UTF-8 ({e}, expected UTF-8 text)") from None
        bad.add(f"{piece.path}: invalid UTF-8 ({e})")
        return
    yield {opts.field_for("text"): text}, 0


def _jsonl_pieces(path: str, unit_bytes: int) -> list[Piece]:
    return line_pieces(path, "jsonl", unit_bytes)


def _text_pieces(path: str, unit_bytes: int) -> list[Piece]:
    return line_pieces(path, "text", unit_bytes)


def _text_file_pieces(path: str, unit_bytes: int) -> list[Piece]:
    del unit_bytes  # a document is never split
    return [Piece(path, "text-file", 0, 1, os.path.getsize(path))]


def _locate_line(piece: Piece, key: int) -> str:
    return line_location(piece.path, key)


def _locate_file(piece: Piece, key: int) -> str:
    del key
    return piece.path


JSONL = InputKind("jsonl", (".jsonl", ".ndjson"), _jsonl_pieces, read_jsonl, locate=_locate_line)
TEXT = InputKind("text", (".txt",), _text_pieces, read_text, locate=_locate_line)
TEXT_FILE = InputKind("text-file", (), _text_file_pieces, read_text_file, locate=_locate_file)
