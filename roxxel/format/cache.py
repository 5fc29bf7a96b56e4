"""The verified local shard cache of a dataset at a URL: fetch once per host, map like local.

A shard is fetched into ``<cache_dir>/<dataset key>/`` as a temp file, checked completely
before it gets its name: its size against the manifest entry (M8), its header, trailer and
index (R1-R15, as opening any shard does), the entry's record count and index checksum (M9),
and every record checksum (R16-R18, `Shard.verify`). Together these cover every byte of the
file, so a shard that does not match is never published; it is refused with a `FormatError`
naming the rule and the shard's URL. Then ``os.replace`` publishes it.

Without an fsync: a process killed at any point loses nothing the kernel was given, and only
a crash of the host can lose written pages. So a shard published before the host last booted
(its mtime older than the boot, Linux's ``btime``) is checked completely again before it is
reused, then marked as checked by a new mtime; one published since is reused after the cheap
check (size, trailer, index checksum). Where the boot time is unknown, and for a folder given
to `ShardCache` (`roxxel pull`'s DIR, a dataset rather than a cache), each shard and the
folder are fsynced before and after the rename instead.

Between processes of one host: a fetch holds ``.<name>.lock`` (``fcntl.flock``, exclusive),
so each shard is fetched once and the others wait and reuse it; a process mapping a shard
holds a shared ``flock`` on the shard file itself for as long as the mapping lives; eviction
(``cache_limit_bytes``, least recently used first) removes only shards whose exclusive lock it
gets without waiting, i.e. that no process maps. Under a limit, a shard fetched ahead
(`prefetch`) is held the same way by the process that fetched it until it reads it (or
closes the cache), so no process evicts what another's next steps read; a fetch ahead gives
way when there is no other room, and a fetch of a shard needed now goes over the limit
rather than evict one. A file left by a fetcher killed mid-way is
``.<name>.part``, never a shard; the next fetch of that shard (under the same lock) writes
over it, so no fetch lists the folder.

Within a process: at most ``max_fetches`` downloads run at once for `prefetch`, and a
shard wanted now that is still queued is fetched at once, beside them. Every download runs in
a daemon thread and its callers only wait for it, so a download in flight never holds up the
interpreter's exit, and a caller can stop waiting: in `stoppable_waits`, a wait ends with
`FetchStopped` once the scope's event is set (a Loader closed, a pull stopped by Ctrl-C). The
download left behind goes on until it ends (its read timeouts bound it) or the process does;
either way only a shard that passed every check is published. A download is one ranged
read per ``chunk_bytes`` through fsspec, one streamed GET on S3's signed URLs
(`RemoteStore.read_into`); no size request first: the last read asks for one byte past the
entry's end, so an object longer or shorter than the manifest says shows in the reads. `num_missing` and
`num_queued` tell the Loader whether shards are still to be fetched and how many fetches wait,
so it reads ahead for the cache independently of page faults.

A shard's index alone (`fetch_index`: its tables, metadata and trailer, one or two ranged
reads from the object's end) gives every record's length without its records: sources that
need the lengths of the whole dataset up front (`TokenWindows`, padding to the longest
record) read those, so a first batch still waits only for its own shards.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import queue
import re
import tempfile
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping
from concurrent import futures
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from roxxel.errors import ConfigError, FormatError, check_int, without_credentials
from roxxel.format.column import WHY
from roxxel.format.getter import WriteFailed
from roxxel.format.manifest import (
    MANIFEST_MAX_BYTES,
    MANIFEST_NAME,
    Manifest,
    ShardEntry,
    checksum_text,
    parse_manifest,
)
from roxxel.format.reader import Shard, read_trailer
from roxxel.format.remote import FetchPolicy, RemoteStore, fsspec_url, join_url
from roxxel.format.spec import META_MAX_BYTES, TRAILER_BYTES, pack_header, parse_trailer

__all__ = [
    "DEFAULT_FETCHES",
    "MOST_FETCHES",
    "CacheConfig",
    "FetchStopped",
    "ShardCache",
    "cache_root",
    "default_cache_dir",
    "num_missing",
    "num_queued",
    "stoppable_waits",
]

_PART = ".part"
DEFAULT_FETCHES = 8  # downloads at once per process by default, as `roxxel pull --workers`
MOST_FETCHES = 256  # downloads at once one cache may ask for
# a shard's index is read from the object's end: this much first (the tables, metadata and
# trailer of shards of up to about 8,000 records), then the rest of its tables if any
_INDEX_TAIL_BYTES = 128 << 10
_NAME_MAX_BYTES = 255  # a file name's limit on Linux file systems
# Every cache object, so a forked child can drop its parent's fetch threads and locks, and
# `num_queued` can count their waiting fetches; guarded by _COUNTS_LOCK.
_OPEN: weakref.WeakSet[ShardCache] = weakref.WeakSet()
_COUNTS_LOCK = threading.Lock()
_Fetched = tuple[Path, int | None]  # a fetch's path, and a descriptor holding it if asked
_POLL_S = 0.05  # how often a stoppable wait looks at its scope's event


class FetchStopped(Exception):
    """A wait for a download ended because the scope it ran in was stopped
    (`stoppable_waits`); the download goes on in its own thread."""


class _Scope(threading.local):
    stop: threading.Event | None = None  # this thread's `stoppable_waits` event, if any


_SCOPE = _Scope()


@contextlib.contextmanager
def stoppable_waits(stop: threading.Event) -> Iterator[None]:
    """Within, this thread's waits for a download (`ShardCache.fetch`, `fetch_held`) raise
    `FetchStopped` once ``stop`` is set, within about 50 ms, instead of waiting for the
    download to end (up to ``attempts`` read timeouts of a store that stopped answering)."""
    outer, _SCOPE.stop = _SCOPE.stop, stop
    try:
        yield
    finally:
        _SCOPE.stop = outer


def _result(future: Future[_Fetched]) -> _Fetched:
    """``future.result()``, or `FetchStopped` once this thread's scope is stopped."""
    stop = _SCOPE.stop
    while stop is not None and not future.done():
        if stop.is_set():
            raise FetchStopped
        futures.wait([future], timeout=_POLL_S)
    return future.result()


def num_missing() -> int:
    """Shards of the manifests read by the caches of this process that their cache has not
    published (or found current) yet, counting only caches that `prefetch` and are not
    closed: while some are, a reader reads ahead to fetch them. O(caches)."""
    return sum(cache._num_missing() for cache in _caches())


def num_queued() -> int:
    """Fetches queued by `ShardCache.prefetch` in this process that wait for a download slot
    (past each cache's ``max_fetches``): a reader reads ahead until a few wait, so every slot
    is busy and the downloads never run dry. O(caches)."""
    return sum(cache._num_waiting() for cache in _caches())


def _caches() -> list[ShardCache]:
    if not _OPEN:  # no dataset at a URL in this process: asked once a batch, answered at once
        return []
    with _COUNTS_LOCK:
        return list(_OPEN)


def default_cache_dir() -> Path:
    """``$ROXXEL_CACHE_DIR``, else ``~/.cache/roxxel`` (``~`` expanded; a blank one, or a
    ``~user`` with no home folder here, is a `ConfigError`: see `cache_root`)."""
    value = os.environ.get("ROXXEL_CACHE_DIR")
    if value:
        return _folder(
            value, "$ROXXEL_CACHE_DIR", "expected a folder, or unset for ~/.cache/roxxel"
        )
    return _folder("~/.cache/roxxel", "the default cache dir", "expected a home folder")


def cache_root(
    cache_dir: str | os.PathLike[str] | None,
    where: str = "cache_dir",
    rule: str = "expected a folder, or None for $ROXXEL_CACHE_DIR or ~/.cache/roxxel",
) -> Path:
    """The cache folder ``cache_dir`` names, ``~`` expanded; None: `default_cache_dir`. The
    one check of a cache dir given (`open_dataset`, ``roxxel pack -o URL --cache-dir``).

    Raises:
        ConfigError: naming ``where`` and the value: empty or blank (``Path('')`` is the
            working folder, ``'  '`` a folder named by spaces), or a ``~user`` that names
            no home folder here.
    """
    if cache_dir is None:
        return default_cache_dir()
    return _folder(os.fspath(cache_dir), where, rule)


def _folder(value: str, where: str, rule: str) -> Path:
    if not value.strip():
        raise ConfigError(f"{where}: {value!r} ({rule}; not an empty or blank name)")
    try:
        path = Path(value).expanduser()
    except RuntimeError:  # ~user of no user, or ~ with no $HOME nor user entry
        path = None
    if path is None or path.parts[0].startswith("~"):
        user = value.split("/", 1)[0]
        raise ConfigError(
            f"{where}: {value!r}: {user} names no home folder on this machine ({rule})",
            path=value,
        )
    return path


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Where a dataset at ``url`` is cached and how it is fetched.

    ``cache_limit_bytes``: evict least recently used shards no mapping holds once the cached
    shards of this dataset would exceed it (None: keep everything). ``max_fetches``: parallel
    downloads per process (an object store serves each connection at a rate of its own).
    ``storage_options`` go to fsspec (endpoint, credentials); they are never shown in a repr
    or message.
    """

    url: str
    cache_dir: Path
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False)
    cache_limit_bytes: int | None = None
    max_fetches: int = DEFAULT_FETCHES
    policy: FetchPolicy = field(default_factory=FetchPolicy)

    def __repr__(self) -> str:  # a URL's password and the storage options: never shown
        return (
            f"CacheConfig({without_credentials(self.url)!r}, {str(self.cache_dir)!r}, "
            f"cache_limit_bytes={self.cache_limit_bytes}, max_fetches={self.max_fetches})"
        )

    def __post_init__(self) -> None:
        object.__setattr__(self, "cache_dir", Path(self.cache_dir))
        if self.cache_limit_bytes is not None:
            check_int("cache_limit_bytes", self.cache_limit_bytes, 1)
        check_int("max_fetches", self.max_fetches, 1, MOST_FETCHES)
        if not isinstance(self.storage_options, Mapping):
            raise ConfigError(
                f"storage_options: {type(self.storage_options).__name__} (expected a mapping)"
            )
        object.__setattr__(self, "storage_options", dict(self.storage_options))  # a copy

    @property
    def folder(self) -> Path:
        """This dataset's folder in the cache: its last URL part and a digest of the URL
        (as fsspec opens it: ``file://localhost/p`` shares the folder of ``file:///p``)."""
        url = fsspec_url(self.url).rstrip("/")
        tail = re.sub(r"[^A-Za-z0-9._-]", "_", url.rsplit("/", 1)[-1])[:64] or "dataset"
        digest = hashlib.blake2b(url.encode(), digest_size=8).hexdigest()
        return self.cache_dir / f"{tail}-{digest}"


class ShardCache:
    """The local copies of one remote dataset's shards (see the module docstring).

    Thread-safe. `fetch` blocks until the shard is published (or raises); `prefetch` queues
    fetches and returns at once; `hold` pins a published shard against eviction. `close` stops
    queued fetches and waits for running ones.
    """

    def __init__(self, config: CacheConfig, folder: Path | None = None) -> None:
        self.config = config
        self.store = RemoteStore(config.url, config.storage_options, config.policy)
        self.folder = config.folder if folder is None else Path(folder)  # `roxxel pull`: DIR
        self._durable = folder is not None or _BOOT_TIME is None  # see the module docstring
        with _writing(self.folder):
            self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._turn = threading.Condition(self._lock)
        # the shards of the first `prefetch` (a loader's first step): later ones wait for them
        self._first: set[str] | None = None
        self._inflight: dict[str, Future[_Fetched]] = {}
        self._queue: queue.SimpleQueue[tuple[ShardEntry, Future[_Fetched]] | None] = (
            queue.SimpleQueue()
        )
        self._threads: list[threading.Thread] = []
        self._published: set[str] = set()  # names this object saw published: fetch returns
        # published by a prefetch and not read since: a descriptor holding each (evict)
        self._ahead: dict[str, int] = {}
        self._room_lock = threading.Lock()  # one eviction decision at a time in this process
        self._reserved = 0  # bytes of the downloads running in this process (not published)
        self._locks: set[int] = set()  # descriptors of the fetch locks held by its downloads
        self._num_shards = 0  # in the manifest read last: see num_missing
        with _COUNTS_LOCK:
            _OPEN.add(self)
        self.num_fetched = 0  # shards this object downloaded (not reused): for tests, progress

    def read_manifest(self) -> Manifest:
        """The dataset's manifest, read from the store and checked (M1-M6)."""
        where = join_url(self.config.url, MANIFEST_NAME)
        try:
            data = self.store.read(MANIFEST_NAME, 0, MANIFEST_MAX_BYTES + 1)
        except FileNotFoundError:
            raise FormatError(
                f"{where}: no manifest: not a roxxel dataset (rule M1 of docs/format.md;"
                " expected the URL of one: check the bucket, the prefix, and that its upload"
                " or pack ended)",
                rule="M1",
                path=where,
            ) from None
        manifest = parse_manifest(data, where)
        for entry in manifest.shards:  # ".<name>.lock" and ".<name>.part" are the cache's
            if entry.path.startswith("."):
                raise FormatError(
                    f"{where}: shard {entry.path!r:.300} (expected a name not starting with"
                    " '.', which a dataset at a URL leaves to its cache; rule M5 of"
                    " docs/format.md)",
                    rule="M5",
                    path=where,
                )
        with self._lock:
            self._num_shards = len(manifest.shards)
        return manifest

    def fetch(self, entry: ShardEntry) -> Path:
        """The local path of ``entry``'s shard, fetched and verified if it is not cached.

        A shard this object published (or found current) is returned without a look at the
        file: `hold` checks it again before it is mapped, and forgets it if it was evicted.
        """
        with self._lock:
            if entry.path in self._published:
                return self.folder / entry.path
        while True:
            _, future = self._claim(entry)
            try:
                return _result(future)[0]
            except (CancelledError, _NoRoom):  # taken over, or a prefetch gave way: again
                continue

    def fetch_index(self, entry: ShardEntry, num_fields: int) -> Shard:
        """``entry``'s shard with its index alone: header, tables, metadata and trailer, whose
        offset tables give every record's length; its records are not fetched. The end of
        the object is read (`_INDEX_TAIL_BYTES`), then the tables before it if they start
        earlier; the v1 header is every shard's. They are laid at their offsets in a sparse
        temporary file (unlinked once mapped) and checked as a fetched shard's index is: R1-R15
        and its index checksum, then its record count and checksum against the entry (M9);
        an object longer or shorter than the entry is M8, as in a fetch. The record bytes
        are holes that read as zeros: use the tables only, never a record. An index larger than ``num_fields`` fields' tables can be for the entry's
        record count (three tables of 8 bytes a record each at most, and the metadata) is
        refused before it is read (M9): a damaged trailer never makes this read a shard.

        Raises:
            FormatError: the index does not match the manifest (rule and URL named).
            ConnectionError: the store stays unreachable (`RemoteStore.read`).
        """
        url = join_url(self.config.url, entry.path)
        size = entry.num_bytes
        tail_at = max(0, size - _INDEX_TAIL_BYTES)
        # one byte past the entry's end, as a fetch reads: an object longer than it shows
        tail = self.store.read(entry.path, tail_at, size + 1)
        if len(tail) != size - tail_at:
            raise self._wrong_size(entry, tail_at, len(tail))
        try:
            trailer = parse_trailer(tail[-TRAILER_BYTES:], size, url)
        except FormatError as exc:
            raise _refused(url, exc.rule or "R5", _what(exc, url), exc.offset) from None
        most = 24 * (entry.num_records + 1) * num_fields + 256 * num_fields + META_MAX_BYTES
        if size - trailer.tables_offset > most + TRAILER_BYTES:
            raise _refused(
                url,
                "M9",
                f"an index of {size - trailer.tables_offset} bytes (expected at most {most}"
                f" for the manifest's {entry.num_records} records of {num_fields} fields)",
            )
        start = min(trailer.tables_offset, tail_at)
        head = self.store.read(entry.path, start, tail_at) if start < tail_at else b""
        if len(head) != tail_at - start:  # the object changed between the two reads
            raise self._wrong_size(entry, start, len(head))
        with tempfile.NamedTemporaryFile(prefix=".roxxel-index-", suffix=".rxs") as file:
            file.truncate(size)
            os.pwrite(file.fileno(), pack_header(), 0)
            os.pwrite(file.fileno(), head + tail, start)
            file.flush()
            try:
                shard = Shard(file.name)  # mapped: the mapping outlives the unlinked name
            except FormatError as exc:
                raise _refused(
                    url, exc.rule or "R1", _what(exc, Path(file.name)), exc.offset
                ) from None
        found = (len(shard), shard.num_bytes, checksum_text(shard.index_checksum))
        expected = (entry.num_records, entry.num_bytes, entry.checksum)
        if found != expected:
            shard.close()
            raise _refused(
                url,
                "M9",
                f"(records, bytes, checksum) {found} (expected the manifest's {expected})",
            )
        return shard

    def fetch_held(self, entry: ShardEntry) -> tuple[Path, int]:
        """`fetch`, then `hold`: the shard's path and a descriptor holding it. A shard this
        call fetches (or finds current) is held before its fetch lock is let go, so no
        eviction comes in between; one that another fetch published and an eviction took
        before this call could hold it is fetched again, by this call."""
        path = self.folder / entry.path
        while True:
            with self._lock:
                known = entry.path in self._published
            if known and (held := self.hold(entry)) is not None:
                return path, held
            mine, future = self._claim(entry, hold=True)
            try:
                _, held = _result(future)
            except (CancelledError, _NoRoom):  # taken over, or a prefetch gave way: again
                continue
            except BaseException:  # stopped (or Ctrl-C): a hold taken for this call is let go
                if mine:
                    future.add_done_callback(_let_go_held)
                raise
            if mine and held is not None:
                return path, held
            if (held := self.hold(entry)) is not None:
                return path, held

    def _claim(self, entry: ShardEntry, hold: bool = False) -> tuple[bool, Future[_Fetched]]:
        """(True, a new future) when no fetch of ``entry`` runs: a thread of its own now
        fetches it for this caller (taking over a prefetch still queued; with ``hold``, the
        shard held for this caller); else (False, the fetch already running)."""
        with self._lock:
            future = self._inflight.get(entry.path)
            if future is not None and not future.cancel():
                return False, future
            future = self._inflight[entry.path] = Future()
            future.set_running_or_notify_cancel()
        try:
            threading.Thread(
                target=self._run, args=(entry, future, hold), name="roxxel-fetch-now", daemon=True
            ).start()
        except RuntimeError:  # no thread to be had: fetched in this one
            self._run(entry, future, hold)
        return True, future

    def prefetch(self, entries: Iterable[ShardEntry]) -> None:
        """Queue fetches of these shards (at most ``max_fetches`` at once); returns at once.

        The shards of the first call (a loader's first step) go first: no later one starts
        until they are fetched, so the first batch does not share the bandwidth. A failed
        prefetch is dropped: the fetch that needs the shard tries again and raises.
        """
        with self._lock:
            if not self._threads:
                self._start_threads()
            queued = []
            for entry in entries:
                if entry.path in self._inflight or entry.path in self._published:
                    continue
                future: Future[_Fetched] = Future()
                self._inflight[entry.path] = future
                self._queue.put((entry, future))
                queued.append(entry.path)
            if self._first is None:
                self._first = set(queued)

    def _num_missing(self) -> int:
        with self._lock:  # a cache nobody prefetches through (or closed) is asked for nothing
            return self._num_shards - len(self._published) if self._threads else 0

    def _num_waiting(self) -> int:
        with self._lock:  # queued or running: those past `max_fetches` wait for a slot
            return max(0, len(self._inflight) - self.config.max_fetches) if self._threads else 0

    def is_current(self, entry: ShardEntry) -> bool:
        """Whether the cached file of ``entry`` exists with the entry's size and trailer, and,
        if it was published before the host last booted, passes every check again."""
        path = self.folder / entry.path
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            if not _matches(fd, entry):
                return False
            if self._durable or _since_boot(fd):
                return True
        finally:
            os.close(fd)
        try:
            self._check(entry, path)
        except FormatError:
            return False
        os.utime(path)  # checked in this boot
        return True

    def remove_lock_files(self, entries: Iterable[ShardEntry]) -> None:
        """Remove the lock files of these shards: only when no fetch can run (no process
        uses this folder, as at the end of `roxxel pull`)."""
        for entry in entries:
            _side(self.folder, entry.path, ".lock").unlink(missing_ok=True)

    def discard(self, entry: ShardEntry) -> None:
        """Remove ``entry``'s published copy, which failed a check when mapped (damaged on
        this disk since its fetch): the next `fetch` downloads it again. Mappings of the
        old file stay readable; a fetch of it running now finishes first."""
        path = self.folder / entry.path
        lock = os.open(
            _side(self.folder, entry.path, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        )
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            path.unlink(missing_ok=True)
        finally:
            os.close(lock)
        self._forget(entry.path)

    def hold(self, entry: ShardEntry) -> int | None:
        """A file descriptor holding a shared lock on the published shard (close it to let it
        go), or None when it is not there (evicted meanwhile: fetch again)."""
        path = self.folder / entry.path
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self._forget(entry.path)
            return None
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino and _matches(fd, entry):
                os.utime(path)  # recency for the LRU
                self._let_go(entry.path)  # read now: held by the reader from here on
                return fd
        except FileNotFoundError:
            pass  # evicted between open and lock
        os.close(fd)
        self._forget(entry.path)
        return None

    def _forget(self, name: str) -> None:
        """``name`` is gone or changed (another process evicted it): `fetch` looks again."""
        with self._lock:
            self._published.discard(name)
        self._let_go(name)

    def _let_go(self, name: str) -> None:
        """Stop holding ``name`` for the read ahead (read now, gone, or the cache closes)."""
        with self._lock:
            fd = self._ahead.pop(name, None)
        if fd is not None:
            os.close(fd)

    def cached_bytes(self) -> int:
        """Bytes of the shards published in this dataset's cache folder."""
        return sum(size for _, size, _ in _published(self.folder))

    def evict(self, room_bytes: int = 0) -> int:
        """Remove least recently used shards no process maps or holds fetched ahead until
        the cache plus ``room_bytes`` fits ``cache_limit_bytes``; returns the bytes removed,
        or -1 when it still does not fit."""
        limit = self.config.cache_limit_bytes
        if limit is None:
            return 0
        files = sorted(_published(self.folder), key=lambda f: f[2])
        total = sum(size for _, size, _ in files)
        removed = 0
        for path, size, _ in files:
            if total + room_bytes - removed <= limit:
                return removed
            if _remove_if_unused(path):
                removed += size
                self._forget(path.name)
        return removed if total + room_bytes - removed <= limit else -1

    def wait(self) -> None:
        """Block until the fetches queued or running now have ended (failed ones included)."""
        with self._lock:
            pending = list(self._inflight.values())
        futures.wait(pending)

    def close(self) -> None:
        """Cancel queued fetches, wait for running ones and join the fetch threads (a later
        `prefetch` starts new ones)."""
        with self._lock:
            threads, self._threads = self._threads, []
            self._first = set()
            self._turn.notify_all()
            for name, future in list(self._inflight.items()):
                if future.cancel():  # queued, never started
                    del self._inflight[name]
            for _ in threads:
                self._queue.put(None)
        for thread in threads:
            thread.join()
        for name in list(self._ahead):
            self._let_go(name)

    def __repr__(self) -> str:
        return f"ShardCache({without_credentials(self.config.url)!r}, folder={str(self.folder)!r})"

    def _start_threads(self) -> None:
        """Daemons (a download in flight never holds up an exit) that hold this cache only
        weakly: a cache nobody uses is collected and its threads end."""
        ref, jobs, num = weakref.ref(self), self._queue, self.config.max_fetches
        self._threads = [
            threading.Thread(target=_fetch_loop, args=(ref, jobs), name="roxxel-fetch", daemon=True)
            for _ in range(num)
        ]
        for thread in self._threads:
            thread.start()
        weakref.finalize(self, _stop_threads, jobs, num)

    def _queued(self, entry: ShardEntry, future: Future[_Fetched]) -> None:
        with self._turn:
            while self._first and entry.path not in self._first:
                self._turn.wait()
        if future.set_running_or_notify_cancel():  # else a caller took it over, or `close`
            self._run(entry, future, ahead=True)  # a failure is dropped unless waited for

    def _run(
        self, entry: ShardEntry, future: Future[_Fetched], hold: bool = False, ahead: bool = False
    ) -> None:
        """Fetch ``entry`` and settle ``future`` with what it got or raised (never raises:
        whoever waits for the future gets the error)."""
        try:
            fetched = self._fetch_once(entry, hold, ahead)
        except BaseException as exc:
            self._settled(entry, future, published=False)
            future.set_exception(exc)
            return
        self._settled(entry, future, published=True)
        future.set_result(fetched)

    def _settled(self, entry: ShardEntry, future: Future[_Fetched], published: bool) -> None:
        with self._lock:
            if self._inflight.get(entry.path) is future:
                del self._inflight[entry.path]
            if published:
                self._published.add(entry.path)
            if self._first:
                self._first.discard(entry.path)
                if not self._first:
                    self._turn.notify_all()

    def _fetch_once(
        self, entry: ShardEntry, hold: bool = False, ahead: bool = False
    ) -> tuple[Path, int | None]:
        """Under the shard's host-wide lock: reuse a current copy or download and publish;
        with `hold`, also take the shard's shared lock before that lock is let go. A fetch
        ahead (`ahead`) evicts no shard fetched ahead and not used since, and gives way
        (`_NoRoom`) when the cache has no room without that: it never pushes out what the
        next steps read for what later ones will."""
        path = self.folder / entry.path
        with _writing(self.folder):
            lock = os.open(
                _side(self.folder, entry.path, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
            )
        with self._lock:  # a forked child closes its copy: the lock stays this process's
            self._locks.add(lock)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self.is_current(entry):
                return path, _held(path) if hold else None
            with self._room_lock:  # the room of downloads still running counts as taken
                # shards fetched ahead and not read are held (by whichever process): a fetch
                # ahead gives way to them, one needed now goes over the limit instead
                if self.evict(entry.num_bytes + self._reserved) < 0 and ahead:
                    raise _NoRoom(entry.path)
                self._reserved += entry.num_bytes
            # one name per shard: the lock is ours, and a part left by a dead fetcher is reused
            temp = _side(self.folder, entry.path, _PART)
            try:
                self._download(entry, temp)
                self._check(entry, temp)
                if ahead and self.config.cache_limit_bytes is not None:  # held as it shows
                    spared = os.open(temp, os.O_RDONLY | os.O_CLOEXEC)
                    fcntl.flock(spared, fcntl.LOCK_SH)
                    with self._lock:
                        self._ahead[entry.path] = spared
                with _writing(path):
                    os.replace(temp, path)
            except BaseException:
                self._let_go(entry.path)
                raise
            finally:
                with self._room_lock:
                    self._reserved -= entry.num_bytes
                with _writing(temp):  # a folder in its place: the error its write had
                    temp.unlink(missing_ok=True)
            if self._durable:
                _fsync_dir(self.folder)
            with self._lock:
                self.num_fetched += 1
            return path, _held(path) if hold else None
        finally:
            with self._lock:
                self._locks.discard(lock)
                os.close(lock)  # releases the flock

    def _download(self, entry: ShardEntry, temp: Path) -> None:
        """The object into ``temp``, size-checked: ranged reads up to a byte past the entry's
        end (`RemoteStore.read_into`; module docstring)."""
        size = entry.num_bytes
        with _writing(temp):
            temp.write_bytes(b"")
        try:
            num_read = self.store.read_into(entry.path, 0, size + 1, str(temp))
        except FileNotFoundError:
            url = join_url(self.config.url, entry.path)
            raise _refused(url, "M7", "no such object (the manifest lists it)") from None
        except WriteFailed as failed:
            with _writing(temp):
                raise OSError(failed.errno, os.strerror(failed.errno)) from None
        if num_read != size:
            raise self._wrong_size(entry, 0, num_read)
        if self._durable:
            with _writing(temp):
                fd = os.open(temp, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def _wrong_size(self, entry: ShardEntry, offset: int, num_read: int) -> FormatError:
        """M8: a read from ``offset`` gave ``num_read`` bytes, not what the entry implies."""
        end = offset + num_read
        if end > entry.num_bytes:
            found = f"more than {entry.num_bytes}"
        else:
            found = str(end) if num_read else f"at most {offset}"
        return _refused(
            join_url(self.config.url, entry.path),
            "M8",
            f"object of {found} bytes (expected the manifest's {entry.num_bytes})",
        )

    def _check(self, entry: ShardEntry, temp: Path) -> None:
        """Every rule a published shard must meet (module docstring), or FormatError."""
        url = join_url(self.config.url, entry.path)
        try:
            shard = Shard(temp)
        except FormatError as exc:
            raise _refused(url, exc.rule or "R1", _what(exc, temp), exc.offset) from None
        try:
            found = (len(shard), shard.num_bytes, checksum_text(shard.index_checksum))
            expected = (entry.num_records, entry.num_bytes, entry.checksum)
            if found != expected:
                raise _refused(
                    url,
                    "M9",
                    f"(records, bytes, checksum) {found} (expected the manifest's {expected})",
                )
            bad = shard.verify()
            if bad:
                first = bad[0]
                rule = next((r for r, why in WHY.items() if why in first.message), "R16")
                raise _refused(
                    url, rule, f"{len(bad)} bad record(s), first: {first.message}", first.record
                )
        finally:
            shard.close()


def _fetch_loop(ref: weakref.ref[ShardCache], jobs: queue.SimpleQueue[Any]) -> None:
    while (item := jobs.get()) is not None:
        cache = ref()
        if cache is None:
            return
        cache._queued(*item)
        del cache


def _let_go_held(future: Future[_Fetched]) -> None:
    """The hold a fetch took for a caller that stopped waiting (`fetch_held`)."""
    if not future.cancelled() and future.exception() is None:
        held = future.result()[1]
        if held is not None:
            os.close(held)


def _stop_threads(jobs: queue.SimpleQueue[Any], num: int) -> None:
    for _ in range(num):
        jobs.put(None)


def _renew_after_fork() -> None:
    """In a forked child: no fetch thread of the parent runs here, and a lock one held at the
    fork would never be released."""
    for cache in list(_OPEN):
        for fd in [*cache._ahead.values(), *cache._locks]:  # the parent's holds and locks
            os.close(fd)  # (a download it left running would hold them here for ever)
        cache._ahead, cache._locks = {}, set()
        cache._lock, cache._threads, cache._inflight = threading.Lock(), [], {}
        cache._turn, cache._first = threading.Condition(cache._lock), set()
        cache._queue = queue.SimpleQueue()


os.register_at_fork(after_in_child=_renew_after_fork)


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
    """Local file operations of the cache: an OSError (a full disk, a read-only folder, a
    cache_dir that is a file) becomes a ConfigError naming the path. Reads from the store
    never run inside: their errors are the network's (`FetchPolicy`)."""
    try:
        yield
    except OSError as e:
        raise ConfigError(
            f"{path}: cannot write the shards there ({e.strerror or e}, expected a writable"
            " folder with room for them: free space there, or for a cache set"
            " cache_limit_bytes)",
            path=path,
        ) from None


def _what(exc: FormatError, temp: object) -> str:
    """A reader's message about the temp file, with the temp file's name and its rule taken
    out (`_refused` names the rule)."""
    text = str(exc).removesuffix(f" (rule {exc.rule} of docs/format.md)")
    return text.removeprefix(f"{temp}: ").replace(str(temp), "the shard")


def _refused(url: str, rule: str, what: str, offset: int | None = None) -> FormatError:
    return FormatError(
        f"{url}: refused, not published: {what} (rule {rule} of docs/format.md)",
        rule=rule,
        path=url,
        offset=offset,
    )


def _matches(fd: int, entry: ShardEntry) -> bool:
    """Size and trailer of an open file agree with the manifest entry (cheap: one read)."""
    size = os.fstat(fd).st_size
    if size != entry.num_bytes:
        return False
    try:
        trailer = read_trailer(fd, size, entry.path)
    except FormatError:
        return False
    return (trailer.num_records, checksum_text(trailer.index_checksum)) == (
        entry.num_records,
        entry.checksum,
    )


def _side(folder: Path, name: str, suffix: str) -> Path:
    """The cache's own file beside shard ``name``: ``.<name><suffix>`` (its lock, its
    download), or a digest of the name in its place where that would pass the 255 bytes a
    file name may have."""
    side = f".{name}{suffix}"
    if len(side.encode()) > _NAME_MAX_BYTES:
        side = f".{hashlib.blake2b(name.encode(), digest_size=16).hexdigest()}{suffix}"
    return folder / side


def _published(folder: Path) -> list[tuple[Path, int, float]]:
    """(path, bytes, last use) of each published shard of a cache folder."""
    found = []
    with os.scandir(folder) as entries:
        for item in entries:
            if item.name.startswith(".") or not item.is_file(follow_symlinks=False):
                continue
            try:
                info = item.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # evicted by another process meanwhile
            found.append((Path(item.path), info.st_size, info.st_mtime))
    return found


class _NoRoom(Exception):
    """A fetch ahead gave way: the cache is full of shards the next steps read."""


def _held(path: Path) -> int:
    """A descriptor with a shared lock on a shard published under its fetch lock, which the
    caller holds (so nobody can be evicting it); its use refreshes its recency."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_SH)
    os.utime(path)
    return fd


def _remove_if_unused(path: Path) -> bool:
    """Unlink a published shard if no process maps it and none fetches it right now."""
    lock = os.open(_side(path.parent, path.name, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # being fetched
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path.unlink(missing_ok=True)  # under the lock: a `hold` then sees it gone
            return True
        except BlockingIOError:
            return False  # mapped by some process
        finally:
            os.close(fd)
    finally:
        os.close(lock)


def _boot_time() -> float | None:
    """When the host booted (seconds since the epoch, Linux's /proc/stat), else None."""
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"btime "):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


_BOOT_TIME = _boot_time()


def _since_boot(fd: int) -> bool:
    """Whether an open file was last modified since the host booted (True if unknown)."""
    return _BOOT_TIME is None or os.fstat(fd).st_mtime >= _BOOT_TIME


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
