"""`Dataset`: a directory of shards plus manifest.json, read as one index space.

The manifest is untrusted input: it is checked (M1-M6); every shard entry must name a
regular file inside the folder (M7, symlinks resolved), each file listed once (M5, compared
by device and inode, so hard links count), of the size listed (M8), whose trailer holds the
entry's record count and index checksum (M9, one 64-byte read per shard at open); and each
shard, when first mapped, must match its entry's count, checksum and schema (M9). Global
index -> (shard, local index) is a binary search over cumulative counts; shards are mapped
lazily, so opening a dataset costs an open, a stat and a 64-byte read per shard.

A dataset at a URL (``s3://``, ``gs://``, ``file://``, any fsspec URL; docs/remote.md) reads
its manifest from the store and maps each shard from a verified local cache
(`roxxel.format.cache`), fetched on first use or ahead through `Dataset.prefetch`.
"""

from __future__ import annotations

import bisect
import errno
import hashlib
import itertools
import os
import stat
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from roxxel.errors import ConfigError, FormatError, without_credentials
from roxxel.format.cache import DEFAULT_FETCHES, CacheConfig, ShardCache, cache_root
from roxxel.format.gather import (
    Batch,
    Group,
    RecordSource,
    gather,
    gather_rows,
    normalize_indices,
    read_cap,
)
from roxxel.format.manifest import (
    MANIFEST_MAX_BYTES,
    MANIFEST_NAME,
    Manifest,
    ShardEntry,
    checksum_text,
    parse_manifest,
)
from roxxel.format.reader import Corruption, Shard, read_trailer
from roxxel.format.remote import is_url, join_url
from roxxel.format.schema import Field, Schema

__all__ = ["Dataset", "open_dataset"]

# Every open dataset, so a forked child can replace locks another thread held at the fork.
_OPEN: weakref.WeakSet[Dataset] = weakref.WeakSet()
T = TypeVar("T")
# rows per shard of a batch up to which `gather_rows` copies row by row: a row's copy costs
# about a microsecond here, a shard's take and scatter (`gather`) about four
_ROWS_PER_SHARD = 4


class Dataset(RecordSource):
    """All records of a dataset directory: ``len()``, ``[i]``, `get_batch`, `verify`.

    Thread-safe for reads, and fork-safe (a child gets fresh locks). Pickles as its path and
    fingerprint: unpickling maps the files again and refuses a dataset that changed.
    ``verify=True`` checks the checksum of every record read (see docs/format.md for what
    that costs); ``max_decoded_bytes`` caps what one read may decode or allocate
    (`roxxel.format.gather.read_cap`: 4 GiB unless ``$ROXXEL_MAX_DECODED_BYTES`` says else).
    Raises FormatError (with ``.rule`` and ``.path``) for a folder that breaks M1-M9.
    With ``cache`` (see `open_dataset`), ``path`` is ignored: the manifest comes from the
    cache's URL and ``self.path`` is the cache's folder for the dataset.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        verify: bool = False,
        max_decoded_bytes: int | None = None,
        cache: ShardCache | None = None,
    ):
        self.cache = cache
        self.url = None if cache is None else cache.config.url
        self.path = Path(path) if cache is None else cache.folder
        self.verify_reads = verify
        self.max_decoded_bytes = read_cap(max_decoded_bytes)
        if self.path.exists() and not self.path.is_dir():
            raise FormatError(
                f"{self.path}: not a directory (a dataset is a folder holding {MANIFEST_NAME},"
                " rule M1 of docs/format.md)",
                rule="M1",
                path=self.path,
            )
        if cache is None:
            self.manifest: Manifest = _read_manifest(self.path / MANIFEST_NAME)
            self._check_entries()
        else:  # M7-M9 are checked shard by shard as the cache fetches them
            self.manifest = cache.read_manifest()
        self._recent: OrderedDict[int, None] = OrderedDict()  # mapped cached shards, LRU first
        counts = [s.num_records for s in self.manifest.shards]
        self.shard_starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(
            np.int64
        )
        self._starts = self.shard_starts.tolist()
        self._num = int(self.shard_starts[-1])
        self._shards: list[Shard | None] = [None] * len(counts)
        self._lock = threading.Lock()
        _OPEN.add(self)

    @property
    def schema(self) -> Schema:
        return self.manifest.schema

    @property
    def where(self) -> str:
        """What messages call the dataset: its folder, or its URL with no password."""
        return str(self.path) if self.url is None else without_credentials(self.url)

    @property
    def name(self) -> str:
        """The dataset's own name: its folder's (``.`` resolved), or the last part of its URL."""
        if self.url is None:
            name = self.path.name
            return self.path.resolve().name if name in ("", "..") else name
        return self.url.rstrip("/").rsplit("/", 1)[-1]

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
            if self.cache is not None:  # outside the lock: fetches of other shards go on
                self.cache.fetch(self.manifest.shards[k])
            with self._lock:
                shard = self._shards[k]
                if shard is None:
                    shard = self._shards[k] = self._open_shard(k)
                    self._release_cold(k)
        if self.cache is not None and self.cache.config.cache_limit_bytes is not None:
            with self._lock:  # recency for `_release_cold`
                self._recent[k] = None
                self._recent.move_to_end(k)
        return shard

    def prefetch(self, shard_ids: Iterable[int]) -> None:
        """Start fetching these shards in the background, in this order (a dataset at a URL;
        a local one has nothing to fetch). Returns at once; never raises for a fetch (the
        read that needs the shard does).

        Raises:
            ConfigError: an id is no int in [0, num_shards) (nothing is fetched then).
        """
        ids = [self._shard_id(k) for k in shard_ids]
        if self.cache is None:
            return
        wanted = dict.fromkeys(k for k in ids if self._shards[k] is None)
        self.cache.prefetch(self.manifest.shards[k] for k in wanted)

    def _shard_id(self, k: object) -> int:
        """``k`` as a shard id, or a ConfigError naming it and the shard count."""
        num = self.num_shards
        if (
            isinstance(k, bool | np.bool_)
            or not isinstance(k, int | np.integer)
            or not 0 <= k < num
        ):
            raise ConfigError(
                f"{self.where}: shard id {k!r} (expected an int in [0, {num}): the dataset has"
                f" {num} shards)"
            )
        return int(k)

    def shard_if_ready(self, k: int) -> Shard | None:
        """Shard ``k`` if it can be mapped without waiting for the network, else None."""
        if self.cache is None:
            return self.shard(k)
        return self._shards[k]

    def record(self, i: int) -> dict[str, Any]:
        """Record ``i`` (already in range), from the shard that holds it."""
        k = bisect.bisect_right(self._starts, i) - 1
        return self.shard(k).record(i - self._starts[k])

    def locate(self, indices: Any) -> tuple[np.ndarray, np.ndarray]:
        """(shard ids, local indices) of global record ``indices`` (negatives from the end)."""
        idx = normalize_indices(indices, self._num, self.where)
        shard_ids = np.searchsorted(self.shard_starts, idx, side="right") - 1
        return shard_ids, idx - self.shard_starts[shard_ids]

    def get_batch(
        self, indices: Any, fields: Sequence[str] | None = None, out: Batch | None = None
    ) -> Batch:
        """Records ``indices`` stacked or padded into ``out`` (reused) or new arrays."""
        shard_ids, local = self.locate(indices)
        fields_read = self.schema.select(fields)
        groups: list[Group] = []
        if shard_ids.size and shard_ids[0] == shard_ids[-1] and (shard_ids == shard_ids[0]).all():
            groups.append((self._columns(int(shard_ids[0]), local), None, local))
        elif (by_row := self._row_columns(shard_ids, fields_read)) is not None:
            cap, where = self.max_decoded_bytes, self.where
            return gather_rows(by_row, local.tolist(), fields_read, out, cap, where)
        else:
            order = np.argsort(shard_ids, kind="stable")
            cuts = np.flatnonzero(np.diff(shard_ids[order])) + 1
            edges = [0, *cuts.tolist(), order.size] if order.size else []
            for a, b in itertools.pairwise(edges):  # one group per shard, in shard order
                rows = order[a:b]
                k = int(shard_ids[rows[0]])
                groups.append((self._columns(k, local[rows]), rows, local[rows]))
        return gather(groups, fields_read, shard_ids.size, out, self.max_decoded_bytes, self.where)

    def _row_columns(self, shard_ids: np.ndarray, fields: Sequence[Field]) -> list[Any] | None:
        """Each row's shard columns, when the rows are better copied one at a time
        (`gather_rows`): fixed-shape uncompressed fields, reads not verified, and at most
        `_ROWS_PER_SHARD` rows per shard on average; else None."""
        if self.verify_reads or any(f.is_variable for f in fields):
            return None
        ids = shard_ids.tolist()
        distinct = set(ids)
        if len(ids) > _ROWS_PER_SHARD * len(distinct):
            return None
        columns = {k: self.shard(k).columns for k in distinct}
        if any(columns[k][f.name].compressed for k in distinct for f in fields):
            return None
        return [columns[k] for k in ids]

    def num_elements(self, field: str) -> int:
        """Elements of a variable-length field over the whole dataset (maps every shard)."""
        return int(self.element_starts(field)[-1])

    def element_starts(self, field: str) -> np.ndarray:
        """Cumulative element counts of ``field`` per shard (num_shards + 1, int64), from
        the shards' indexes (`shard_indexes`: at a URL, no record is fetched)."""
        sizes = self.shard_indexes(lambda shard: shard.flat(field).size)
        return np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)

    def shard_indexes(self, read: Callable[[Shard], T]) -> list[T]:
        """``read(index)`` of every shard's index, in shard order: ``index`` is the shard
        itself when the dataset is local or the shard mapped or cached; at a URL otherwise
        its index alone (`ShardCache.fetch_index`: tables, metadata and trailer, not the
        records; ``max_fetches`` at once), checked against the manifest as `shard` checks a
        shard. ``read`` may use the index's tables (`Shard.element_offsets`,
        ``columns[f].lengths``, ``flat(f).size``), never its records, and keeps nothing of
        it: that index is closed once ``read`` returns."""
        if self.cache is None:
            return [read(self.shard(k)) for k in range(self.num_shards)]
        cache = self.cache

        def one(k: int) -> T:
            entry = self.manifest.shards[k]
            if self._shards[k] is not None or cache.is_current(entry):
                return read(self.shard(k))
            index = cache.fetch_index(entry, len(self.schema))
            try:
                if index.schema.to_json() != self.schema.to_json():
                    raise _m9(
                        join_url(self.where, entry.path),
                        f"schema {index.schema.to_json()} differs from the manifest's",
                        f"{self.schema.to_json()}",
                    )
                return read(index)
            finally:
                index.close()

        with ThreadPoolExecutor(max_workers=cache.config.max_fetches) as pool:
            return list(pool.map(one, range(self.num_shards)))

    def verify(self, workers: int | None = None) -> list[Corruption]:
        """Check every checksum of every shard, ``workers`` threads at a time."""
        with ThreadPoolExecutor(max_workers=workers or min(4, os.cpu_count() or 1)) as pool:
            found = pool.map(self.verify_shard, range(self.num_shards))
            return [c for shard in found for c in shard]

    def verify_shard(self, k: int) -> list[Corruption]:
        """Shard ``k``'s corruptions (`verify` of one shard). A dataset at a URL is checked
        where it lives: the shard is fetched again (its cached copy replaced by what the URL
        holds now), so neither a copy cached before the object changed or went, nor one
        damaged on this disk since, decides what is reported."""
        if self.cache is not None:
            with self._lock:
                self._shards[k] = None  # views of the old copy keep reading it
            self.cache.discard(self.manifest.shards[k])
        return self._corruptions(k)

    def _corruptions(self, k: int) -> list[Corruption]:
        try:
            return self.shard(k).verify()
        except FormatError as exc:
            return [Corruption(f"{self.where}/{self.manifest.shards[k].path}", -1, "", str(exc))]

    def _columns(self, k: int, local: np.ndarray) -> Any:
        shard = self.shard(k)
        if self.verify_reads:
            for column in shard.columns.values():
                column.verify_records(local.tolist())
        return shard.columns

    def _open_shard(self, k: int) -> Shard:
        entry = self.manifest.shards[k]
        path = self.path / entry.path
        if self.cache is None:
            shard = Shard(path, verify=self.verify_reads, max_decoded_bytes=self.max_decoded_bytes)
        else:
            shard = self._open_cached(entry)
            path = shard.path
        found = (len(shard), shard.num_bytes, checksum_text(shard.index_checksum))
        expected = (entry.num_records, entry.num_bytes, entry.checksum)
        if found != expected:
            raise _m9(path, f"(records, bytes, checksum) {found}", f"the manifest's {expected}")
        if shard.schema.to_json() != self.schema.to_json():
            raise _m9(
                path,
                f"schema {shard.schema.to_json()} differs from the manifest's",
                f"{self.schema.to_json()}",
            )
        return shard

    def _open_cached(self, entry: ShardEntry) -> Shard:
        """A fetched shard, mapped and held. A cached copy whose index fails its checksum
        was damaged on this disk after its fetch (a fetch checks every byte): it is fetched
        again, once; a second failure is raised."""
        assert self.cache is not None
        try:
            return self._map_held(entry)
        except FormatError:
            self.cache.discard(entry)
            return self._map_held(entry)

    def _map_held(self, entry: ShardEntry) -> Shard:
        assert self.cache is not None
        path, held = self.cache.fetch_held(entry)
        try:
            shard = Shard(path, verify=self.verify_reads, max_decoded_bytes=self.max_decoded_bytes)
        except BaseException:
            os.close(held)
            raise
        weakref.finalize(shard._mmap, os.close, held)  # held as long as the mapping (views too)
        return shard

    def _check_entries(self) -> None:
        """M5, M7-M9 from the file system: one open, stat and 64-byte read per shard."""
        root = self.path.resolve()
        seen: set[tuple[int, int]] = set()
        for entry in self.manifest.shards:
            info = _check_entry(self.path / entry.path, root, entry)
            if (info.st_dev, info.st_ino) in seen:
                raise FormatError(
                    f"{self.path / entry.path}: one file listed twice through links"
                    " (rule M5 of docs/format.md)",
                    rule="M5",
                    path=self.path / entry.path,
                )
            seen.add((info.st_dev, info.st_ino))

    def _release_cold(self, opened: int) -> None:
        """With a cache limit: let go of this dataset's least recently used mappings while
        the cache is over its limit, so eviction may remove them. Whoever still holds such a
        `Shard` (another thread's read, ``dataset.shards``) or a view of it keeps it mapped
        and readable; eviction passes it over until the last reference goes."""
        cache = self.cache
        if cache is None or cache.config.cache_limit_bytes is None:
            return
        while self._recent and cache.cached_bytes() > cache.config.cache_limit_bytes:
            k, _ = self._recent.popitem(last=False)
            shard = self._shards[k]
            if k != opened and shard is not None:
                self._shards[k] = None
                del shard  # unmapped now, unless held elsewhere
                cache.evict()

    def __reduce__(self) -> tuple[Any, ...]:
        config = None if self.cache is None else self.cache.config
        state = (str(self.path), self.fingerprint, self.verify_reads, self.max_decoded_bytes)
        return (_reopen, (*state, config))

    def __repr__(self) -> str:  # a repr ends up in logs: a URL's password is masked
        where = str(self.path) if self.url is None else without_credentials(self.url)
        return (
            f"Dataset({where!r}, num_records={self._num}, num_shards={self.num_shards},"
            f" fields={self.schema.to_json()})"
        )


def open_dataset(
    path: str | os.PathLike[str],
    *,
    verify: bool = False,
    max_decoded_bytes: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    cache_limit_bytes: int | None = None,
    max_fetches: int | None = None,
) -> Dataset:
    """Open a dataset directory written by `DatasetWriter` (or ``roxxel pack``), or at a URL.

    ``verify=True`` checks each record read; ``max_decoded_bytes`` caps what one read may
    decode or allocate (default 4 GiB or ``$ROXXEL_MAX_DECODED_BYTES``). A URL
    (``s3://bucket/ds``, any fsspec URL; docs/remote.md) is read through a verified local
    cache in ``cache_dir`` (default ``$ROXXEL_CACHE_DIR`` or ``~/.cache/roxxel``), shared by
    the processes of a host (``~`` expanded; an empty or blank one, or a ``~user`` with no
    home folder here, is a ConfigError);
    ``storage_options`` go to fsspec; ``cache_limit_bytes`` evicts least recently used shards
    no mapping holds; ``max_fetches`` downloads run at once (default 8). Cache options for a
    local path are a ConfigError.
    """
    if not is_url(path):
        given = (cache_dir, storage_options, cache_limit_bytes, max_fetches)
        if any(option is not None for option in given):
            raise ConfigError(
                f"open_dataset: cache options for the local path {str(path)!r} (expected a"
                " URL such as s3://bucket/ds with cache_dir, storage_options, cache_limit_bytes,"
                " max_fetches)"
            )
        return Dataset(path, verify=verify, max_decoded_bytes=max_decoded_bytes)
    config = CacheConfig(
        str(path),
        cache_root(cache_dir, "open_dataset: cache_dir"),  # '' or '  ' refused, ~ expanded
        {} if storage_options is None else storage_options,
        cache_limit_bytes,
        DEFAULT_FETCHES if max_fetches is None else max_fetches,
    )
    return Dataset(
        path, verify=verify, max_decoded_bytes=max_decoded_bytes, cache=ShardCache(config)
    )


def _reopen(
    path: str,
    fingerprint: str,
    verify: bool,
    max_decoded_bytes: int,
    config: CacheConfig | None = None,
) -> Dataset:
    """Unpickle a dataset: open it again and check it is the dataset that was pickled."""
    cache = None if config is None else ShardCache(config)
    dataset = Dataset(path, verify=verify, max_decoded_bytes=max_decoded_bytes, cache=cache)
    if dataset.fingerprint != fingerprint:
        raise FormatError(
            f"{dataset.where}: dataset changed since it was pickled (fingerprint"
            f" {dataset.fingerprint}, expected {fingerprint})",
            path=dataset.where,
        )
    return dataset


def _renew_locks() -> None:
    """In a forked child: a lock held by a thread of the parent would never be released."""
    for dataset in list(_OPEN):
        dataset._lock = threading.Lock()


os.register_at_fork(after_in_child=_renew_locks)


def _m9(path: object, found: str, expected: str) -> FormatError:
    return FormatError(
        f"{path}: {found} disagree with {expected} (rule M9 of docs/format.md)",
        rule="M9",
        path=path,
    )


def _check_entry(path: Path, root: Path, entry: ShardEntry) -> os.stat_result:
    """M7-M9 for one entry, without mapping the file; returns its stat."""
    try:
        # M5 made the name a plain file name: only a link needs resolving (resolve() is
        # most of the cost of opening a dataset of many shards)
        linked = stat.S_ISLNK(os.lstat(path).st_mode)
        target = path.resolve() if linked else root / path.name
    except FileNotFoundError:
        raise _entry_error(path, "M7", "shard listed in the manifest is missing") from None
    except (RuntimeError, OSError) as exc:  # a symlink loop: RuntimeError before Python 3.13
        raise _entry_error(path, "M7", f"does not resolve ({exc})") from None
    if target.parent != root:
        raise _entry_error(path, "M7", f"resolves to {target}, outside the dataset")
    try:
        fd = os.open(target, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise _entry_error(path, "M7", "shard listed in the manifest is missing") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != entry.num_bytes:
            raise _entry_error(
                path,
                "M8",
                f"{info.st_size} bytes or not a regular file (expected {entry.num_bytes} bytes)",
            )
        trailer = read_trailer(fd, info.st_size, path)
    finally:
        os.close(fd)
    found = (trailer.num_records, checksum_text(trailer.index_checksum))
    if found != (entry.num_records, entry.checksum):
        raise _m9(
            path,
            f"trailer (records, checksum) {found}",
            f"the manifest's {(entry.num_records, entry.checksum)}",
        )
    return info


def _entry_error(path: Path, rule: str, what: str) -> FormatError:
    return FormatError(f"{path}: {what} (rule {rule} of docs/format.md)", rule=rule, path=path)


def _read_manifest(path: Path) -> Manifest:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise _entry_error(path, "M1", "no manifest: not a roxxel dataset") from None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise _entry_error(path, "M1", "a symlink loop, not a manifest") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MANIFEST_MAX_BYTES:
            raise _entry_error(
                path, "M1", f"not a regular file of at most {MANIFEST_MAX_BYTES} bytes"
            )
        data = _read_all(fd, MANIFEST_MAX_BYTES + 1)
    finally:
        os.close(fd)
    return parse_manifest(data, path)


def _read_all(fd: int, limit: int) -> bytes:
    """Up to ``limit`` bytes from ``fd``, to its end."""
    parts, total = [], 0
    while total < limit and (part := os.read(fd, min(limit - total, 1 << 20))):
        parts.append(part)
        total += len(part)
    return b"".join(parts)
