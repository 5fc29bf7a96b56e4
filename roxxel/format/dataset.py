"""`Dataset`: a directory of shards plus manifest.json, read as one index space.

The manifest is untrusted input: it is checked (M1-M6), every shard entry must name a
regular file inside the folder (M7, symlinks resolved) whose size matches (M8), and each
shard, when first mapped, must match its entry's count, checksum and schema (M9). Global
index -> (shard, local index) is a binary search over cumulative counts; shards are mapped
lazily, so opening a dataset costs a stat per shard and a few bytes per shard of memory.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import stat
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from roxxel.errors import ConfigError, FormatError
from roxxel.format.dataset_writer import publish_manifest
from roxxel.format.gather import Batch, Group, RecordSource, gather, normalize_indices
from roxxel.format.manifest import (
    MANIFEST_MAX_BYTES,
    MANIFEST_NAME,
    Manifest,
    ShardEntry,
    ShardInfo,
    checksum_text,
    parse_manifest,
)
from roxxel.format.reader import Corruption, Shard
from roxxel.format.schema import Schema
from roxxel.format.writer import json_object

__all__ = ["Dataset", "open_dataset", "write_manifest"]


class Dataset(RecordSource):
    """All records of a dataset directory: ``len()``, ``[i]``, `get_batch`, `verify`.

    Thread-safe for reads. Pickles as its path. ``verify=True`` checks the checksum of every
    record read (see docs/format.md for what that costs).
    """

    def __init__(self, path: str | os.PathLike[str], *, verify: bool = False):
        self.path = Path(path)
        self.verify_reads = verify
        self.manifest: Manifest = _read_manifest(self.path / MANIFEST_NAME)
        self._check_entries()
        counts = [s.num_records for s in self.manifest.shards]
        self.shard_starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(
            np.int64
        )
        self._starts = self.shard_starts.tolist()
        self._num = int(self.shard_starts[-1])
        self._shards: list[Shard | None] = [None] * len(counts)
        self._lock = threading.Lock()

    @property
    def schema(self) -> Schema:
        return self.manifest.schema

    @property
    def metadata(self) -> dict[str, Any]:
        return self.manifest.metadata

    @property
    def num_shards(self) -> int:
        return len(self._shards)

    @property
    def shards(self) -> tuple[Shard, ...]:
        """Every shard, mapping any not mapped yet."""
        return tuple(self.shard(k) for k in range(self.num_shards))

    @property
    def fingerprint(self) -> str:
        """A hex digest of the manifest: equal for datasets with the same shards and schema."""
        return hashlib.blake2b(self.manifest.to_json(), digest_size=16).hexdigest()

    def shard(self, k: int) -> Shard:
        """Shard ``k``, mapped and checked against its manifest entry on first use (M9)."""
        shard = self._shards[k]
        if shard is None:
            with self._lock:
                shard = self._shards[k]
                if shard is None:
                    shard = self._shards[k] = self._open_shard(k)
        return shard

    def record(self, i: int) -> dict[str, Any]:
        """Record ``i`` (already in range), from the shard that holds it."""
        k = bisect.bisect_right(self._starts, i) - 1
        return self.shard(k).record(i - self._starts[k])

    def locate(self, indices: Any) -> tuple[np.ndarray, np.ndarray]:
        """(shard ids, local indices) of global record ``indices`` (negatives from the end)."""
        idx = normalize_indices(indices, self._num, self.path)
        shard_ids = np.searchsorted(self.shard_starts, idx, side="right") - 1
        return shard_ids, idx - self.shard_starts[shard_ids]

    def get_batch(
        self, indices: Any, fields: Sequence[str] | None = None, out: Batch | None = None
    ) -> Batch:
        """Records ``indices`` stacked or padded into ``out`` (reused) or new arrays."""
        shard_ids, local = self.locate(indices)
        groups: list[Group] = []
        if shard_ids.size and shard_ids[0] == shard_ids[-1] and (shard_ids == shard_ids[0]).all():
            groups.append((self._columns(int(shard_ids[0]), local), None, local))
        else:
            order = np.argsort(shard_ids, kind="stable")
            cuts = np.flatnonzero(np.diff(shard_ids[order])) + 1
            for rows in np.split(order, cuts) if order.size else []:
                k = int(shard_ids[rows[0]])
                groups.append((self._columns(k, local[rows]), rows, local[rows]))
        return gather(groups, self.schema.select(fields), shard_ids.size, out)

    def num_elements(self, field: str) -> int:
        """Elements of a variable-length field over the whole dataset (maps every shard)."""
        return int(self.element_starts(field)[-1])

    def element_starts(self, field: str) -> np.ndarray:
        """Cumulative element counts of ``field`` per shard (num_shards + 1, int64)."""
        sizes = [self.shard(k).flat(field).size for k in range(self.num_shards)]
        return np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)

    def verify(self, workers: int | None = None) -> list[Corruption]:
        """Check every checksum of every shard, ``workers`` threads at a time."""
        with ThreadPoolExecutor(max_workers=workers or min(4, os.cpu_count() or 1)) as pool:
            found = pool.map(self._verify_shard, range(self.num_shards))
            return [c for shard in found for c in shard]

    def _verify_shard(self, k: int) -> list[Corruption]:
        try:
            return self.shard(k).verify()
        except FormatError as exc:
            return [Corruption(str(self.path / self.manifest.shards[k].path), -1, "", str(exc))]

    def _columns(self, k: int, local: np.ndarray) -> Any:
        shard = self.shard(k)
        if self.verify_reads:
            for column in shard.columns.values():
                column.verify_records(local.tolist())
        return shard.columns

    def _open_shard(self, k: int) -> Shard:
        entry = self.manifest.shards[k]
        shard = Shard(self.path / entry.path, verify=self.verify_reads)
        found = (len(shard), shard.num_bytes, checksum_text(shard.index_checksum))
        expected = (entry.num_records, entry.num_bytes, entry.checksum)
        if found != expected:
            raise FormatError(
                f"{shard.path}: (records, bytes, checksum) {found} disagree with"
                f" the manifest {expected} (rule M9 of docs/format.md)"
            )
        if shard.schema.to_json() != self.schema.to_json():
            raise FormatError(
                f"{shard.path}: schema {shard.schema.to_json()} differs from the"
                f" manifest's {self.schema.to_json()} (rule M9 of docs/format.md)"
            )
        return shard

    def _check_entries(self) -> None:
        """M7, M8: every entry a regular file inside the folder, of the size listed."""
        root = self.path.resolve()
        seen: set[Path] = set()
        for entry in self.manifest.shards:
            target = (self.path / entry.path).resolve()
            where = f"{self.path / entry.path}"
            if target.parent != root:
                raise FormatError(f"{where}: resolves to {target}, outside the dataset (rule M7)")
            if target in seen:
                raise FormatError(f"{where}: listed twice through links (rule M5)")
            seen.add(target)
            try:
                info = os.stat(target)
            except FileNotFoundError:
                raise FormatError(
                    f"{where}: shard listed in the manifest is missing (rule M7)"
                ) from None
            if not stat.S_ISREG(info.st_mode) or info.st_size != entry.num_bytes:
                raise FormatError(
                    f"{where}: {info.st_size} bytes or not a regular file"
                    f" (expected {entry.num_bytes} bytes, rule M8)"
                )

    def __reduce__(self) -> tuple[Any, ...]:
        return (open_dataset, (str(self.path),))

    def __repr__(self) -> str:
        return f"Dataset({str(self.path)!r}, num_records={self._num}, shards={self.num_shards})"


def open_dataset(path: str | os.PathLike[str], *, verify: bool = False) -> Dataset:
    """Open a dataset directory written by `DatasetWriter` (or ``roxxel pack``)."""
    return Dataset(path, verify=verify)


def _read_manifest(path: Path) -> Manifest:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FormatError(f"{path}: no manifest: not a roxxel dataset (rule M1)") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > MANIFEST_MAX_BYTES:
            raise FormatError(
                f"{path}: not a regular file of at most {MANIFEST_MAX_BYTES} bytes"
                " (rule M1 of docs/format.md)"
            )
        data = file.read(MANIFEST_MAX_BYTES + 1)
    return parse_manifest(data, path)


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
