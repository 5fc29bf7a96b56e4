"""`DatasetWriter`: a directory of shards of about ``shard_bytes`` each, manifest last; and
`write_manifest`, which finishes a directory of shards written separately."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from roxxel.errors import ConfigError, FormatError
from roxxel.format.atomic import AtomicFile, make_dirs, naming
from roxxel.format.manifest import (
    MANIFEST_MAX_BYTES,
    MANIFEST_NAME,
    Manifest,
    ShardEntry,
    ShardInfo,
    checksum_text,
    json_object,
    parse_manifest,
)
from roxxel.format.reader import Shard
from roxxel.format.schema import Codec, Schema
from roxxel.format.writer import ShardWriter, parse_compress

__all__ = ["DatasetWriter", "publish_manifest", "write_manifest"]


class DatasetWriter:
    """Writes a dataset directory: shards of about ``shard_bytes`` each, then the manifest.

    A context manager: leaving the block normally closes the last shard and writes
    ``manifest.json`` (atomically, last); leaving it with an exception drops the shard in
    progress and writes no manifest. A directory that already holds a dataset is refused
    unless ``overwrite=True``, which removes the old manifest before the first new shard and,
    once the new manifest is published, the old shards it listed that the new one does not
    (files it did not list are never touched). A new directory is fsynced in its parent.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        schema: Schema | Mapping[str, str],
        *,
        shard_bytes: int = 1 << 30,
        compress: Mapping[str, str | Codec] | None = None,
        overwrite: bool = False,
        metadata: Mapping[str, Any] | None = None,
        shard_prefix: str = "shard",
    ):
        self.path = Path(path)
        self.schema = Schema.parse(schema)
        if not (isinstance(shard_bytes, int) and shard_bytes > 0):
            raise ConfigError(f"{self.path}: shard_bytes {shard_bytes!r} (expected an int > 0)")
        self.shard_bytes = shard_bytes
        self.metadata = json_object(metadata, f"{self.path}: metadata")
        self._compress = parse_compress(compress, self.schema)
        self._prefix = shard_prefix
        manifest = self.path / MANIFEST_NAME
        if manifest.exists() and not overwrite:
            raise ConfigError(f"{self.path}: already holds a dataset (pass overwrite=True)")
        self._old_shards = listed_shards(self.path)
        make_dirs(self.path)
        if manifest.exists():
            manifest.unlink()
        self.shards: list[ShardInfo] = []
        self._current: ShardWriter | None = None
        self._closed = False

    @property
    def num_records(self) -> int:
        done = sum(s.num_records for s in self.shards)
        return done + (self._current.num_records if self._current else 0)

    def write(self, record: Mapping[str, Any]) -> None:
        """Append one record, starting a new shard once the current one is full."""
        shard = self._shard()
        with naming(shard.path):
            shard.write(record)
        self._roll()

    def _shard(self) -> ShardWriter:
        if self._closed:
            raise ConfigError(f"{self.path}: write after close")
        if self._current is None:
            name = f"{self._prefix}-{len(self.shards):05d}.rxs"
            self._current = ShardWriter(
                self.path / name, self.schema, self._compress, self.metadata
            )
        return self._current

    def _roll(self) -> None:
        if self._current is not None and self._current.num_bytes >= self.shard_bytes:
            with naming(self._current.path):
                self.shards.append(self._current.close())
            self._current = None

    def write_batch(self, columns: Mapping[str, Any]) -> None:
        """Append many records given by field (see `ShardWriter.write_batch`).

        The batch goes into the current shard whole; the shard closes after the batch that
        fills it, so keep batches well below ``shard_bytes``.
        """
        shard = self._shard()
        with naming(shard.path):
            shard.write_batch(columns)
        self._roll()

    def close(self) -> Path:
        """Close the last shard and write the manifest; returns the manifest's path."""
        if self._closed:
            raise ConfigError(f"{self.path}: closed twice")
        self._closed = True
        if self._current is not None:
            with naming(self._current.path):
                self.shards.append(self._current.close())
            self._current = None
        entries = [
            ShardEntry(s.path.name, s.num_records, s.num_bytes, s.checksum) for s in self.shards
        ]
        target = publish_manifest(self.path, Manifest(self.schema, tuple(entries), self.metadata))
        remove_shards(self.path, set(self._old_shards) - {e.path for e in entries})
        return target

    def abort(self) -> None:
        """Drop the shard in progress; write no manifest."""
        self._closed = True
        if self._current is not None:
            self._current.abort()
            self._current = None

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.close()


def publish_manifest(folder: Path, manifest: Manifest) -> Path:
    """Write ``folder/manifest.json`` atomically (temp file, fsync, rename, fsync folder)."""
    target = folder / MANIFEST_NAME
    tmp = AtomicFile(target)
    try:
        with naming(target):
            tmp.file.write(manifest.to_json())
        tmp.publish()
    except BaseException:
        tmp.discard()
        raise
    return target


def write_manifest(
    path: str | os.PathLike[str],
    shards: Iterable[str | os.PathLike[str] | ShardInfo],
    schema: Schema | Mapping[str, str] | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Finish a dataset whose shards were written separately: write its manifest last.

    ``shards`` are shard files directly inside ``path`` (paths, or the `ShardInfo` a
    writer returned), in dataset order. Each is opened and checked; all must share one
    schema (``schema`` if given, else the first shard's). Returns the manifest's path.
    """
    folder = Path(path)
    entries: list[ShardEntry] = []
    for item in shards:
        shard = Shard(item.path if isinstance(item, ShardInfo) else item)
        if shard.path.resolve().parent != folder.resolve():
            raise ConfigError(f"{folder}: shard {shard.path} is not directly inside the dataset")
        if schema is None:
            schema = shard.schema
        if shard.schema.to_json() != Schema.parse(schema).to_json():
            raise ConfigError(
                f"{shard.path}: schema {shard.schema.to_json()} differs from"
                f" {Schema.parse(schema).to_json()}"
            )
        entry = ShardEntry(
            shard.path.name, len(shard), shard.num_bytes, checksum_text(shard.index_checksum)
        )
        entries.append(entry)
    if schema is None:
        raise ConfigError(f"{folder}: no shards and no schema: nothing to describe")
    manifest = Manifest(Schema.parse(schema), tuple(entries), json_object(metadata, "metadata"))
    return publish_manifest(folder, manifest)


def listed_shards(folder: Path) -> list[str]:
    """The shard names the manifest in ``folder`` lists (plain names, M5), or [] when there is
    no manifest or it breaks a rule: then nothing is known to be roxxel's."""
    try:
        fd = os.open(folder / MANIFEST_NAME, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return []
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > MANIFEST_MAX_BYTES:
            return []
        data = file.read(MANIFEST_MAX_BYTES + 1)
    try:
        return [entry.path for entry in parse_manifest(data, folder / MANIFEST_NAME).shards]
    except FormatError:
        return []


def remove_shards(folder: Path, names: Iterable[str]) -> None:
    """Delete these shards of an old dataset in ``folder`` (names already checked by M5)."""
    for name in sorted(names):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(folder / name)
