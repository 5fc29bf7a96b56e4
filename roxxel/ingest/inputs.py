"""Input readers for ``roxxel pack``: find inputs, cut them into work units, read records.

Input kinds (see `roxxel.ingest.registry`): JSON Lines, plain text (a document per line or
per file), ``.npy``/``.npz``, Parquet, Arrow IPC/Feather, Hugging Face ``save_to_disk``
directories, Megatron ``.bin/.idx`` pairs. Each reader yields ``(record, key)``;
``locate(piece, key)`` names the file and line or row for error messages. Planning is
deterministic: the same inputs and ``unit_bytes`` give the same units, which is what lets a
pack resume or split into tasks.
"""

from __future__ import annotations

import errno
import glob
import os
import stat
from collections.abc import Iterator

from roxxel.errors import ConfigError
from roxxel.ingest.images import IMAGE, passed_over_in_image_folder
from roxxel.ingest.infer import infer_schema
from roxxel.ingest.registry import (
    directory_kind,
    get_kind,
    kind_names,
    kind_of_path,
    known_extensions,
)
from roxxel.ingest.units import (
    BadRecords,
    Block,
    Input,
    InputKind,
    Piece,
    ReadOptions,
    Record,
    WorkUnit,
    group_pieces,
    special_file_kind,
)

__all__ = [
    "BadRecords",
    "Block",
    "Input",
    "InputKind",
    "Piece",
    "ReadOptions",
    "Record",
    "WorkUnit",
    "cut_units",
    "default_unit_bytes",
    "detect_kind",
    "expand_inputs",
    "fixed_arrays",
    "infer_schema",
    "input_schema",
    "kind_names",
    "locate",
    "read_unit",
    "read_unit_blocks",
]


def detect_kind(path: str) -> str:
    """The input kind of a file from its extension.

    >>> detect_kind("corpus/part-0.jsonl")
    'jsonl'
    """
    kind = kind_of_path(path)
    if kind is None:
        ext = os.path.splitext(path)[1].lower()
        raise ConfigError(
            f"{path}: unknown input extension {ext!r} (expected one of "
            f"{known_extensions()}, or pass --format)",
            path=path,
        )
    return kind.name


def _not_regular(path: str) -> str | None:
    """Why ``path`` is not a regular file or a directory (following symlinks), or None."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symlink loop"
        return "a dangling symlink" if os.path.islink(path) else f"unreadable ({e.strerror})"
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return special_file_kind(mode)


def _walk(directory: str, kind: InputKind | None, skipped: list[str]) -> list[str]:
    """Regular files under ``directory`` (sorted; hidden names left out) that ``kind``, or
    their extension, selects. What else was passed over goes to ``skipped``; files of
    unknown extensions only when the walk found image files (an image folder lists all its
    other files: the rest in `image_folder_inputs`), else they pass over without a word."""
    found: list[str] = []
    unknown: list[str] = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in dirs:  # os.walk does not follow them: say so
            if os.path.islink(os.path.join(root, name)):
                skipped.append(
                    f"{os.path.join(root, name)}: a symlink to a directory, not followed"
                )
        for name in sorted(files):
            path = os.path.join(root, name)
            if name.startswith("."):
                continue
            if kind is None and kind_of_path(name) is None:
                unknown.append(path)
                continue
            why = _not_regular(path)
            if why is None:
                found.append(path)
            else:
                skipped.append(f"{path}: {why} (expected a regular file)")
    if unknown and any(kind_of_path(f) is IMAGE for f in found):
        skipped += [_unknown_in_image_folder(p) for p in unknown]
    return found


def _unknown_in_image_folder(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    what = f"a file of unknown extension {ext!r}" if ext else "a file without an extension"
    return passed_over_in_image_folder(path, what)


def _expand_one(arg: str, kind: InputKind | None, skipped: list[str]) -> list[Input]:
    why = _not_regular(arg)
    if why == "a symlink loop":
        raise ConfigError(f"{arg}: a symlink loop (expected a file or directory)", path=arg)
    if os.path.isdir(arg):
        claimed = kind if kind is not None and kind.claims_directory else None
        claimed = claimed or (directory_kind(arg) if kind is None else None)
        if claimed is not None:
            return claimed.inputs(arg)
        # walked files are regular already: one stat each, not the checks of a named path
        return [i for f in _walk(arg, kind, skipped) for i in _inputs_of(f, kind)]
    if not os.path.lexists(arg):
        if glob.has_magic(arg):
            matches = sorted(glob.glob(arg, recursive=True))
            if not matches:
                raise ConfigError(f"{arg}: glob matches nothing (expected at least one input)")
            return [i for m in matches for i in _expand_one(m, kind, skipped)]
        raise ConfigError(f"{arg}: no such file or directory (expected an input path or glob)")
    if why is not None:
        raise ConfigError(f"{arg}: {why} (expected a regular file)", path=arg)
    return _inputs_of(arg, kind)


def _inputs_of(path: str, kind: InputKind | None) -> list[Input]:
    return (kind or get_kind(detect_kind(path))).inputs(path)


def expand_inputs(
    args: list[str], kind: str | None = None, skipped: list[str] | None = None
) -> list[Input]:
    """Resolve files, directories (walked in sorted order) and globs to inputs.

    A file named twice (``docs`` and ``docs/a.jsonl``, or ``./a`` and ``a``) is read once,
    in its first place. Only regular files are read: a FIFO, a device or a
    symlink loop found in a directory is passed over and described in ``skipped`` (when
    given); one named explicitly raises ConfigError. Raises ConfigError for a missing path,
    an empty glob, an unknown extension (without ``kind``), or when nothing is found.
    """
    chosen = None if kind is None else get_kind(kind)
    passed_over = [] if skipped is None else skipped
    seen: dict[str, Input] = {}  # by absolute path: "./docs" and "docs/a" name one file
    for arg in args:
        for item in _expand_one(arg, chosen, passed_over):
            seen.setdefault(os.path.abspath(item.path), item)
    if not seen:
        raise ConfigError(f"inputs {args}: no input files found (expected known extensions)")
    return list(seen.values())


UNITS_WANTED = 32  # a default cut: about this many units, so every --workers has work
MIN_UNIT_BYTES = 8 << 20  # and none below this (a unit costs a shard, a marker, fsyncs)


def default_unit_bytes(inputs: list[Input], shard_bytes: int) -> int:
    """``--unit-bytes`` when not given: the inputs' bytes over `UNITS_WANTED`, at least
    `MIN_UNIT_BYTES`, at most ``shard_bytes``. A function of the inputs alone, so the
    dataset never depends on ``--workers``; 130 MB of JPEGs cut into 16 units where one
    unit of ``--shard-bytes`` left a second worker idle.

    >>> default_unit_bytes([], 256 << 20) == MIN_UNIT_BYTES
    True
    """
    total = sum(os.path.getsize(i.path) for i in inputs)
    return max(min(shard_bytes, -(-total // UNITS_WANTED)), min(MIN_UNIT_BYTES, shard_bytes))


def cut_units(inputs: list[Input], unit_bytes: int) -> list[WorkUnit]:
    """Cut inputs into work units of about ``unit_bytes`` input bytes, in input order."""
    if unit_bytes <= 0:
        raise ConfigError(f"unit bytes {unit_bytes} (expected > 0)")
    pieces = [p for i in inputs for p in get_kind(i.kind).cut(i.path, unit_bytes)]
    return group_pieces(pieces, unit_bytes)


def read_unit(
    unit: WorkUnit, opts: ReadOptions, bad: BadRecords
) -> Iterator[tuple[Record, Piece, int]]:
    """Every record of a unit in order, with its piece and key (see ``locate``)."""
    for piece in unit.pieces:
        for record, key in get_kind(piece.kind).read(piece, opts, bad):
            yield record, piece, key


def read_unit_blocks(unit: WorkUnit, opts: ReadOptions, bad: BadRecords) -> Iterator[Block] | None:
    """A unit's records as `Block` s, when every piece's kind has a block reader."""
    readers = [get_kind(p.kind).read_blocks for p in unit.pieces]
    if any(r is None for r in readers):
        return None
    return (
        block
        for piece, read in zip(unit.pieces, readers, strict=True)
        if read is not None
        for block in read(piece, opts, bad)
    )


def locate(piece: Piece, key: int) -> str:
    """Where a record came from, for messages: ``file:line``, ``file: row N``, ...

    Line numbers cost a scan of the file up to the line: call this only on error.
    """
    return get_kind(piece.kind).locate(piece, key)


def fixed_arrays(units: list[WorkUnit]) -> bool:
    """Whether the records are rows of arrays (equal shapes are then fixed shapes)."""
    return bool(units) and get_kind(units[0].pieces[0].kind).fixed_arrays


def input_schema(units: list[WorkUnit]) -> dict[str, str] | None:
    """The schema the first input declares itself (Parquet, Arrow: types kept exactly), or
    None when its kind has none (its records are then sampled)."""
    if not units:
        return None
    piece = units[0].pieces[0]
    read_schema = get_kind(piece.kind).schema
    return None if read_schema is None else read_schema(piece.path)
