"""Pack one work unit into shards: read, map, optionally shuffle, write.

Each work unit is packed by one process from its description alone (paths and ranges):
the process reads its input, applies the ``--map`` function, writes its own shards
``part-U-K.rxs`` through `ShardWriter` (temp file + rename) and then the unit's marker.
Records never cross processes, so N workers scale with cores, and a unit's bytes depend
only on the unit and the pack arguments, never on the worker count or timing.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from roxxel.errors import ConfigError, check_int
from roxxel.format.manifest import ShardInfo
from roxxel.format.schema import Ragged, Schema
from roxxel.format.writer import ShardWriter
from roxxel.ingest.images import ImageConfig, image_records
from roxxel.ingest.infer import max_record_bytes, project_record
from roxxel.ingest.inputs import (
    BadRecords,
    Block,
    Piece,
    ReadOptions,
    Record,
    WorkUnit,
    locate,
    read_unit,
    read_unit_blocks,
)
from roxxel.ingest.parts import load_unit, remove_unit_files, shard_name, write_unit_marker
from roxxel.ingest.tokenize import TokenizeConfig, tokenize_records

__all__ = [
    "PackConfig",
    "UnitResult",
    "load_map",
    "map_fingerprint",
    "mapped_records",
    "pack_unit",
    "shuffle_units",
]

MapFn = Callable[[Record], Any]  # checked per record: a dict or None
_MAPS: dict[str, MapFn] = {}
BATCH_RECORDS = 256  # records per ShardWriter.write_batch call


@dataclass(frozen=True, slots=True)
class PackConfig:
    """Everything a worker needs to pack a unit: plain values, sent to workers as JSON."""

    out_dir: str
    schema: dict[str, str]
    fingerprint: str
    read: ReadOptions = field(default_factory=ReadOptions)
    map_spec: str | None = None
    compress: dict[str, str] = field(default_factory=dict)
    shard_bytes: int = 256 << 20
    shuffle_seed: int | None = None
    tokenize: dict[str, Any] | None = None  # a TokenizeConfig as JSON
    images: dict[str, Any] | None = None  # an ImageConfig as JSON

    @property
    def records_only(self) -> bool:
        """Whether records pass through Python one at a time (no block reads)."""
        return any(
            x is not None for x in (self.map_spec, self.shuffle_seed, self.tokenize, self.images)
        )


@dataclass(frozen=True, slots=True)
class UnitResult:
    """What packing one unit did (``resumed``: it was already done and was kept)."""

    unit: int
    num_records: int
    num_dropped: int
    num_input_bytes: int
    num_output_bytes: int
    num_shards: int
    resumed: bool
    bad: BadRecords


def _split_spec(spec: str) -> tuple[str, str]:
    module, sep, name = spec.rpartition(":")
    if not sep or not module or not name.isidentifier():
        raise ConfigError(
            f"--map {spec!r}: bad spec (expected module:function or path.py:function)"
        )
    return module, name


def load_map(spec: str) -> MapFn:
    """Import ``module:function`` (``path/to/file.py:function`` works too), cached."""
    if spec in _MAPS:
        return _MAPS[spec]
    module_name, name = _split_spec(spec)
    try:
        if module_name.endswith(".py"):
            loader_spec = importlib.util.spec_from_file_location("roxxel_user_map", module_name)
            if loader_spec is None or loader_spec.loader is None:
                raise ImportError(f"cannot load {module_name}")
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())  # like `python -m`: modules beside the user
            module = importlib.import_module(module_name)
        fn = vars(module)[name]  # a lookup by the user's name, not a capability probe
    except KeyError:
        raise ConfigError(f"--map {spec!r}: {module_name} has no {name!r}") from None
    except (ImportError, OSError, SyntaxError) as e:
        raise ConfigError(f"--map {spec!r}: cannot import ({type(e).__name__}: {e})") from None
    if not callable(fn):
        raise ConfigError(
            f"--map {spec!r}: {type(fn).__name__} is not callable (expected a function)"
        )
    _MAPS[spec] = fn
    return fn


def map_fingerprint(spec: str | None) -> str:
    """The spec plus a hash of its source file, so editing the function changes the pack."""
    if spec is None:
        return ""
    module_name, _ = _split_spec(spec)
    origin = module_name
    if not module_name.endswith(".py"):
        found = importlib.util.find_spec(module_name)
        origin = found.origin if found and found.origin else ""
    digest = ""
    if origin and os.path.isfile(origin):
        with open(origin, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:16]
    return f"{spec}@{digest}"


def mapped_records(
    unit: WorkUnit, config: PackConfig, bad: BadRecords, dropped: list[int]
) -> Iterator[tuple[Record, Piece, int]]:
    """A unit's records after ``--map`` (None drops; counted in ``dropped[0]``), image
    decoding, tokenizing (batched), and shuffle."""
    records = read_unit(unit, config.read, bad)
    if config.map_spec is not None:
        records = _apply_map(records, config.map_spec, dropped)
    skip = config.read.skip_bad
    if config.images is not None:
        records = image_records(records, ImageConfig.from_json(config.images), bad, skip, locate)
    if config.tokenize is not None:
        tokens = TokenizeConfig.from_json(config.tokenize)
        records = tokenize_records(records, tokens, bad, skip, locate)
    if config.shuffle_seed is None:
        yield from records
        return
    buffered = list(records)
    rng = np.random.default_rng([config.shuffle_seed, unit.index])
    for i in rng.permutation(len(buffered)):
        yield buffered[i]


def _apply_map(
    records: Iterator[tuple[Record, Piece, int]], spec: str, dropped: list[int]
) -> Iterator[tuple[Record, Piece, int]]:
    fn = load_map(spec)
    for record, piece, key in records:
        try:
            out = fn(record)
        except (Exception, SystemExit) as e:  # the user's code: report where, hide nothing
            raise ConfigError(
                f"{locate(piece, key)}: --map {spec} raised {type(e).__name__}: {e}"
            ) from e
        if out is None:
            dropped[0] += 1
        elif isinstance(out, dict):
            yield out, piece, key
        else:
            raise ConfigError(
                f"{locate(piece, key)}: --map {spec} returned {type(out).__name__} (expected a dict or None)"
            )


def _strip_where(message: str, writer: ShardWriter) -> str:
    """The writer names its temp shard and record number; the input location says more."""
    prefix = f"{writer.path}: record {writer.num_records}: "
    return message.removeprefix(prefix)


class _UnitWriter:
    """Writes one unit's records into shards of about ``shard_bytes``; errors get locations.

    Uncompressed records go to `ShardWriter.write_batch` in batches that stop short of the
    shard limit (sizes over-estimated), so shards end at the same record as when written
    one by one; a batch the writer refuses is written again record by record, which names
    the bad record (or skips it with --skip-bad).
    """

    def __init__(self, config: PackConfig, unit: int, bad: BadRecords):
        self.config, self.unit, self.bad = config, unit, bad
        self.shards: list[ShardInfo] = []
        self.current: ShardWriter | None = None
        self.num_records = 0
        self.fields = {f.name: f for f in Schema.parse(config.schema)}
        self.batch = not config.compress
        self.pending: list[tuple[Record, Piece, int]] = []
        self.pending_bytes = 0

    def write(self, record: Record, piece: Piece, key: int) -> None:
        try:
            projected = project_record(record, self.fields)
        except ConfigError as e:
            self.flush()  # earlier records first: skipped places stay in input order
            self._refuse(piece, key, str(e))
            return
        size = max_record_bytes(projected, self.fields) if self.batch else None
        written = self.current.num_bytes if self.current is not None else 0
        if size is None or written + self.pending_bytes + size >= self.config.shard_bytes:
            self.flush()
            self._write_one(projected, piece, key)
            return
        self.pending.append((projected, piece, key))
        self.pending_bytes += size
        if len(self.pending) >= BATCH_RECORDS:
            self.flush()

    def write_block(self, block: Block) -> None:
        """Write an array input's block a shard's worth at a time, ending shards at the same
        records as `write` does; a part the writer refuses goes through `write` instead."""
        self.flush()
        sizes = self._record_bytes(block) if self.batch else None
        if sizes is None:
            for record, key in block.records():
                self.write(record, block.piece, key)
            self.flush()  # before the reader reuses the block's memory
            return
        ends, at = np.cumsum(sizes), 0
        while at < block.num:
            writer = self._writer()
            limit = (int(ends[at - 1]) if at else 0) + self.config.shard_bytes - writer.num_bytes
            stop = min(int(np.searchsorted(ends, limit, "left")) + 1, block.num)
            part = block.take(at, stop)
            try:
                writer.write_batch(
                    {n: Ragged(part.columns[n], part.lengths[n]) if n in part.lengths
                     else part.columns[n] for n in self.fields}
                )  # fmt: skip
            except (KeyError, TypeError, ValueError):  # ConfigError is a ValueError
                for record, key in part.records():
                    self.write(record, part.piece, key)
                self.flush()
            else:
                self.num_records += part.num
                if writer.num_bytes >= self.config.shard_bytes:
                    self.shards.append(writer.close())
                    self.current = None
            at = stop

    def _record_bytes(self, block: Block) -> np.ndarray | None:
        """Each record's bytes in a shard, or None unless every field of the schema is an
        array column of the block shaped like the field (else `write` takes each record,
        and names what is wrong, if anything is)."""
        sizes = np.zeros(block.num, np.int64)
        for name, field_ in self.fields.items():
            column = block.columns.get(name)
            if field_.kind != "array" or not isinstance(column, np.ndarray):
                return None
            if field_.is_variable != (name in block.lengths):
                return None
            lengths = block.lengths.get(name)
            sizes += field_.unit_bytes if lengths is None else lengths * field_.unit_bytes
        return sizes

    def flush(self) -> None:
        """Write the pending records as one batch (or one by one if the batch is refused)."""
        pending, self.pending, self.pending_bytes = self.pending, [], 0
        if not pending:
            return
        writer = self._writer()
        try:
            writer.write_batch({name: [r[name] for r, _, _ in pending] for name in self.fields})
        except (KeyError, TypeError, ValueError):  # ConfigError is a ValueError
            for record, piece, key in pending:
                self._write_one(record, piece, key)
            return
        self.num_records += len(pending)

    def _writer(self) -> ShardWriter:
        if self.current is None:
            path = Path(self.config.out_dir) / shard_name(self.unit, len(self.shards))
            self.current = ShardWriter(path, self.config.schema, self.config.compress)
        return self.current

    def _write_one(self, record: Record, piece: Piece, key: int) -> None:
        writer = self._writer()
        try:
            writer.write(record)
        except ConfigError as e:
            self._refuse(piece, key, _strip_where(str(e), writer))
            return
        self.num_records += 1
        if writer.num_bytes >= self.config.shard_bytes:
            self.shards.append(writer.close())
            self.current = None

    def _refuse(self, piece: Piece, key: int, why: str) -> None:
        message = f"{locate(piece, key)}: {why}"
        if not self.config.read.skip_bad:
            raise ConfigError(message) from None
        self.bad.add(message)

    def close(self) -> list[ShardInfo]:
        self.flush()
        if self.current is not None:
            if self.current.num_records:
                self.shards.append(self.current.close())
            else:
                self.current.abort()
            self.current = None
        return self.shards

    def abort(self) -> None:
        """Drop the shard in progress and the shards this writer published: nothing else
        (a file it did not create may belong to another process)."""
        if self.current is not None:
            self.current.abort()
            self.current = None
        for shard in self.shards:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(shard.path)
        self.shards = []


def pack_unit(config: PackConfig, unit: WorkUnit) -> UnitResult:
    """Pack one unit (or keep it, when a previous run finished it); write its marker.

    The caller owns the unit (it holds the output's lock, `roxxel.ingest.parts.lock_output`),
    so the files an earlier, dead attempt at it left are removed first.
    """
    out_dir = Path(config.out_dir)
    done = load_unit(out_dir, config.fingerprint, unit.index)
    if done is not None:
        return _result(unit, done, resumed=True)
    remove_unit_files(out_dir, unit.index)
    bad, dropped = BadRecords(), [0]
    writer = _UnitWriter(config, unit.index, bad)
    try:
        blocks = None if config.records_only else read_unit_blocks(unit, config.read, bad)
        if blocks is not None:
            for block in blocks:
                writer.write_block(block)
        else:
            for record, piece, key in mapped_records(unit, config, bad, dropped):
                writer.write(record, piece, key)
        shards = writer.close()
        doc = {
            "shards": [
                {
                    "name": s.path.name,
                    "num_records": s.num_records,
                    "num_bytes": s.num_bytes,
                    "checksum": s.checksum,
                }
                for s in shards
            ],
            "num_dropped": dropped[0],
            "bad": {"count": bad.count, "first": bad.first},
        }
        write_unit_marker(out_dir, config.fingerprint, unit.index, doc)
    except OSError as e:
        where = writer.current.path if writer.current is not None else out_dir
        writer.abort()
        if e.filename is None and e.errno:  # a full disk, say: name the file being written
            raise OSError(e.errno, e.strerror, str(where)) from e
        raise
    except BaseException:
        writer.abort()
        raise
    return _result(unit, doc, resumed=False)


def _result(unit: WorkUnit, doc: dict[str, Any], resumed: bool) -> UnitResult:
    shards = doc["shards"]
    bad = BadRecords(int(doc["bad"]["count"]), list(doc["bad"]["first"]))
    return UnitResult(
        unit=unit.index,
        num_records=sum(s["num_records"] for s in shards),
        num_dropped=int(doc["num_dropped"]),
        num_input_bytes=unit.num_bytes,
        num_output_bytes=sum(s["num_bytes"] for s in shards),
        num_shards=len(shards),
        resumed=resumed,
        bad=bad,
    )


def shuffle_units(units: list[WorkUnit], seed: int | None) -> list[WorkUnit]:
    """Units renumbered in a seeded order (their index is their place in the dataset)."""
    if seed is None:
        return units
    check_int("--shuffle-input", seed, low=0)
    order = np.random.default_rng([seed]).permutation(len(units))
    return [WorkUnit(i, units[int(j)].pieces) for i, j in enumerate(order)]
