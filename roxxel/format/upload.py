"""Publish a finished local dataset at a URL: shards first, the manifest last.

Write side (the read side never imports it). The order is the publication protocol: the old
manifest at the URL (if any) is removed first, then every shard is uploaded (in parallel,
each upload retried, its size checked on the server), and the manifest goes up last, in one
PUT. So a dataset whose upload was killed mid-way has no manifest and never opens (rule M1);
a reader of an old manifest that meets a new shard refuses it (its checksums differ, M9).
Objects of an older dataset that the new manifest does not list are left where they are.
A ``file://`` URL that is the dataset's own folder is refused before anything is touched.

Every upload is bounded like a read (`RemoteStore`): on S3 its body goes out at once, without
``Expect: 100-continue``, whose "100 Continue" aiohttp would wait for with no timeout at all
(it starts the read timeout once the body is sent), so a store that stopped answering fails
after ``attempts`` read timeouts. Uploads run in daemon threads that only the caller waits
for: a failure or a Ctrl-C ends `put_files` at once, and the uploads left running are
abandoned (they end with their timeouts or the process; the manifest is never put after them).

The object helpers below (`put_files`, `put_bytes`, `remove_object`, `list_objects`,
`published_trailer`) are the same protocol in pieces, for ``roxxel pack -o URL`` whose tasks
upload their shards and markers separately (`roxxel.ingest.parts`).
"""

from __future__ import annotations

import errno
import os
import queue
import shutil
import stat
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from roxxel.errors import ConfigError, FormatError, check_int, without_credentials
from roxxel.format.dataset import Dataset
from roxxel.format.manifest import MANIFEST_NAME
from roxxel.format.remote import FetchPolicy, RemoteStore, fsspec_url, is_url, join_url
from roxxel.format.spec import HEADER_BYTES, TRAILER_BYTES, Trailer, fail, parse_trailer

__all__ = [
    "check_destination",
    "check_local_folder",
    "list_objects",
    "published_trailer",
    "put_bytes",
    "put_files",
    "remove_object",
    "upload_dataset",
]

Progress = Callable[[int, int], None]  # (shards uploaded, shards in all)

_POLL_S = 0.05  # how often a wait for uploads looks for a Ctrl-C (`_thread.interrupt_main`)


def upload_dataset(
    path: str | os.PathLike[str],
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    workers: int = 8,
    policy: FetchPolicy | None = None,
    on_shard: Progress | None = None,
) -> int:
    """Upload the dataset folder ``path`` to ``url`` (module docstring); returns its shards.

    The local dataset is opened first (M1-M9), so a broken one is refused before anything is
    uploaded. ``on_shard(done, total)`` is called after each shard, from this thread.

    Raises:
        FormatError: the local dataset breaks a rule (also a shard deleted or changed while
            it uploads: M7, M8, naming the local file).
        ConfigError: ``path`` is a URL, ``url`` is no URL of a bucket or folder (or is the
            dataset's own folder, or a file URL of another host), or ``workers`` < 1.
        ConnectionError: the store stayed unreachable (see `RemoteStore`); run again.
    """
    if is_url(path):
        raise ConfigError(
            f"upload_dataset: path {path!r} is a URL (expected a local dataset folder;"
            " `roxxel pull URL DIR` stages one)"
        )
    _check_place(url, "upload_dataset: url")
    check_int("workers", workers, 1, 256)
    dataset = Dataset(path)
    store = RemoteStore(url, storage_options, policy)
    _check_not_itself(store, dataset.path)
    fs, root = _filesystem(store)
    target = f"{root.rstrip('/')}/{MANIFEST_NAME}"
    manifest_url = join_url(url, MANIFEST_NAME)
    _make_folder(store, url, root)
    if store.retry(manifest_url, lambda: fs.exists(target)):
        store.retry(manifest_url, lambda: fs.rm_file(target))
    entries = dataset.manifest.shards
    files = [(e.path, e.num_bytes) for e in entries]
    put_files(store, dataset.path, files, workers=workers, on_file=on_shard)
    data = dataset.manifest.to_json()
    _written(store, manifest_url, lambda: fs.pipe_file(target, data))
    return len(entries)


def check_destination(url: str, where: str = "URL:") -> None:
    """The command line's check of a URL to publish at (``roxxel push``, ``roxxel pack -o``):
    what `upload_dataset` checks (`_check_place`), and no store that lives only in this
    process (``memory://``), whose data would be gone when the command exits. Raises a
    `ConfigError` naming ``where``.

    >>> check_destination("s3://bucket/ds")
    >>> check_destination("memory://bucket/ds")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    roxxel.errors.ConfigError: URL: 'memory://bucket/ds': a memory:// store lives only ...
    """
    _check_place(url, where)
    if url.split("://", 1)[0].lower() == "memory":
        raise ConfigError(
            f"{where} {url!r}: a memory:// store lives only in this process (its data would be"
            " gone when the command exits, expected a store outside it, e.g. s3://bucket/ds"
            " or file:///absolute/path)"
        )


def _check_place(url: str, where: str) -> None:
    """Raise a `ConfigError` naming ``where`` unless ``url`` is a URL with a bucket or folder
    after its scheme (``s3://`` alone would put objects at ``s3:/<name>``, ``file:///`` in
    the root folder), and a file URL names this machine (`fsspec_url`).

    >>> _check_place("s3://", "url")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    roxxel.errors.ConfigError: url 's3://' names no bucket or folder (...)
    """
    if not is_url(url):
        raise ConfigError(f"{where} {url!r} is not a URL (expected e.g. s3://bucket/ds)")
    scheme, _, path = fsspec_url(url).partition("://")
    if not path.strip("/"):
        raise ConfigError(
            f"{where} {url!r} names no bucket or folder (expected a bucket or folder after"
            " the scheme, e.g. s3://bucket/ds)"
        )
    if scheme in ("file", "local"):
        check_local_folder(
            path, where, f"a folder at the {scheme}:// URL, or nothing there yet", url
        )


def check_local_folder(
    path: str | os.PathLike[str], where: str, rule: str, shown: str | None = None
) -> None:
    """Refuse, before any work, a local ``path`` to make or fill a folder at that is a file,
    a link to nothing (dangling, or a loop), or lies under one: the work would fail later
    with a raw ``[Errno 20] Not a directory``, ``[Errno 17] File exists`` or ``[Errno 40]
    Too many levels of symbolic links``. The `ConfigError` names ``where``, then ``shown``
    (default ``path``: a URL, say), then ``rule`` (what was expected)."""
    target = Path(path)
    label = f"{where.rstrip(':')}: {_shorten(str(path) if shown is None else shown)}"
    for place in (target, *target.parents):
        try:
            found = place.stat()
        except OSError as exc:
            if _is_link(place):
                broken = "dangling or a loop"
                said = (
                    f"is a link to nothing ({broken}"
                    if place == target
                    else f"is under a link to nothing ({_shorten(str(place))}: {broken}"
                )
                raise ConfigError(f"{label} {said}, expected {rule})", path=place) from None
            if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                continue  # not there yet, or under a file or a loop, met further up
            why = exc.strerror or type(exc).__name__
            under = "" if place == target else f" ({_shorten(str(place))})"
            raise ConfigError(
                f"{label}{under} cannot be looked at ({why}, expected {rule})", path=place
            ) from None
        if not stat.S_ISDIR(found.st_mode):
            under = "" if place == target else f"{_shorten(str(place))} is not one, "
            raise ConfigError(f"{label} is not a folder ({under}expected {rule})", path=place)
        return


_SHOWN_CHARS = 100  # a longer path is cut to its first 100 characters in a message


def _shorten(text: str) -> str:
    """``text`` as its repr, cut to its first 100 characters and ``...`` when longer (a
    path past the system's limit, say, is not echoed whole).

    >>> _shorten("a/b"), _shorten("e" * 300) == repr("e" * 100 + "...")
    ("'a/b'", True)
    """
    return repr(text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "...")


def _is_link(place: Path) -> bool:
    """Whether ``place`` is a symbolic link; False when even that cannot be looked at
    (``Path.is_symlink`` raises for a name too long or a folder denying a look)."""
    try:
        return stat.S_ISLNK(place.lstat().st_mode)
    except OSError:
        return False


def put_files(
    store: RemoteStore,
    folder: Path,
    files: Sequence[tuple[str, int]],
    *,
    workers: int = 8,
    on_file: Progress | None = None,
) -> None:
    """Upload the files ``(name, num_bytes)`` of ``folder`` under the store's folder,
    ``workers`` at a time, each retried and its size checked on the server; ``on_file(done,
    total)`` after each, from this thread.

    The uploads run in daemon threads and this thread only waits for them: the first failure
    or a Ctrl-C (KeyboardInterrupt) ends the call at once, no queued upload starts, and the
    running ones are abandoned (module docstring).

    Raises:
        ConnectionError: the store stayed unreachable, or holds another size after a put.
        FormatError: a local file was deleted or changed while it uploaded (M7, M8).
        ConfigError: the store has no place for a file, or the file at the URL is the
            local file itself.
    """
    todo: queue.SimpleQueue[tuple[str, int]] = queue.SimpleQueue()
    for item in files:
        todo.put(item)
    ended: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
    stop = threading.Event()

    def upload() -> None:
        while not stop.is_set():
            try:
                name, num_bytes = todo.get_nowait()
            except queue.Empty:
                return
            try:
                _put(store, folder / name, name, num_bytes)
            except BaseException as exc:  # raised in the caller's thread
                ended.put(exc)
                return
            ended.put(None)

    try:
        for _ in range(min(workers, len(files))):
            threading.Thread(target=upload, name="roxxel-upload", daemon=True).start()
        for done in range(1, len(files) + 1):
            failed = _next(ended)
            if failed is not None:
                raise failed
            if on_file is not None:
                on_file(done, len(files))
    finally:
        stop.set()


def _next(ended: queue.SimpleQueue[BaseException | None]) -> BaseException | None:
    """The next upload's outcome; a wait a Ctrl-C ends (a blocking get would wait for the
    upload first where no signal interrupts it: `_thread.interrupt_main`)."""
    while True:
        try:
            return ended.get(timeout=_POLL_S)
        except queue.Empty:
            continue


def put_bytes(store: RemoteStore, name: str, data: bytes) -> None:
    """Write object ``name`` of the store's folder in one PUT (retried)."""
    fs, root = _filesystem(store)
    target = f"{root.rstrip('/')}/{name}"
    where = join_url(store.url, name)
    if "/" in name:
        _make_folder(store, where, target.rsplit("/", 1)[0])
    _written(store, where, lambda: fs.pipe_file(target, data))


def _written(store: RemoteStore, where: str, put: Callable[[], object]) -> None:
    """``put()`` retried; a store that has no place for it (a bucket that does not exist)
    is a ConfigError naming ``where``."""
    try:
        store.retry(where, put)
    except FileNotFoundError:
        raise ConfigError(
            f"{where}: nowhere to write it (expected an existing bucket or folder: roxxel "
            f"creates no bucket)",
            path=where,
        ) from None


def _make_folder(store: RemoteStore, where: str, folder: str) -> None:
    """``folder`` made on a local file system (``file://``), where a file needs one. Object
    stores have no folders to make, and s3fs's ``makedirs`` creates a *bucket*: a typo in
    a bucket's name would quietly make a new one."""
    fs, _ = store.filesystem()
    if _is_local(fs):
        store.retry(where, lambda: fs.makedirs(folder, exist_ok=True))


def _is_local(fs: Any) -> bool:
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    return bool(protocols & {"file", "local"})


def _check_not_itself(store: RemoteStore, folder: Path) -> None:
    """Refuse a ``file://`` URL that is the dataset's own ``folder`` (also through a link or
    ``..``): the push would remove its manifest first, then copy each shard onto itself.
    A folder inside the other is no harm: shards and manifest are plain names (M5)."""
    fs, root = store.filesystem()
    if _is_local(fs) and Path(root).resolve() == folder.resolve():
        raise ConfigError(
            f"{store.url}: the dataset's own folder ({folder}, expected a URL outside the"
            " dataset pushed)",
            path=store.url,
        )


def _filesystem(store: RemoteStore) -> tuple[Any, str]:
    """The store's filesystem, set (on s3) to send a PUT's body at once (module docstring).
    Set on the client in use before each PUT: s3fs makes a new one after its session closed.
    """
    fs, root = store.filesystem()
    if store.url.split("://", 1)[0].lower() in ("s3", "s3a"):  # the client is made here
        store.retry(
            store.url,
            lambda: fs.s3.meta.events.register(
                "before-send.s3", _without_expect, unique_id="roxxel-upload-without-expect"
            ),
        )
    return fs, root


def _without_expect(request: Any, **_: Any) -> None:
    """botocore's ``before-send`` hook: no ``Expect: 100-continue`` (a header SigV4 does not
    sign), so aiohttp sends the body and its read timeout bounds the wait for the answer."""
    request.headers.pop("Expect", None)


def remove_object(store: RemoteStore, name: str) -> None:
    """Delete object ``name`` of the store's folder; one that is not there is fine."""
    fs, root = store.filesystem()
    target = f"{root.rstrip('/')}/{name}"
    try:
        store.retry(join_url(store.url, name), lambda: fs.rm_file(target))
    except FileNotFoundError:
        return


def list_objects(store: RemoteStore, folder: str = "") -> dict[str, int]:
    """The objects directly in ``folder`` of the store's folder: name -> size in bytes, as
    the server lists them now (fsspec's listing cache is dropped first); {} if none."""
    fs, root = store.filesystem()
    path = f"{root.rstrip('/')}/{folder}".rstrip("/")
    where = join_url(store.url, folder) if folder else store.url

    def listing() -> list[dict[str, Any]]:
        fs.invalidate_cache(path)
        return fs.ls(path, detail=True)

    try:
        entries = store.retry(where, listing)
    except FileNotFoundError:
        return {}
    return {
        str(e["name"]).rstrip("/").rsplit("/", 1)[-1]: int(e["size"])
        for e in entries
        if e.get("type") == "file"
    }


def published_trailer(store: RemoteStore, name: str, num_bytes: int) -> Trailer:
    """The trailer of the shard object ``name`` of ``num_bytes`` bytes, from one ranged read:
    what a finished pack compares with a unit's marker before the manifest names the shard.

    Raises:
        FormatError: the object's last bytes are no shard trailer (R1, R5-R7), named by URL.
    """
    where = join_url(store.url, name)
    if num_bytes < HEADER_BYTES + TRAILER_BYTES:
        raise fail(where, num_bytes, "R1", f"file of {num_bytes} bytes is too short")
    data = store.read(name, num_bytes - TRAILER_BYTES, num_bytes)
    if len(data) != TRAILER_BYTES:
        raise fail(where, num_bytes, "R1", f"{len(data)} trailer bytes read (file changed)")
    return parse_trailer(data, num_bytes, where)


def _put(store: RemoteStore, local: Path, name: str, num_bytes: int) -> None:
    """Upload one shard and check the server holds all of its bytes. A failure is first
    laid at the local file's door if it changed (`_changed`), never taken for an outage."""
    fs, root = _filesystem(store)
    remote = f"{root.rstrip('/')}/{name}"
    where = join_url(store.url, name)

    def put() -> None:
        try:
            fs.put_file(str(local), remote)
        except shutil.SameFileError:  # file://: the object is this file (a hard link, say)
            raise ConfigError(
                f"{where}: the same file as {local} (expected a URL outside the dataset pushed)",
                path=where,
            ) from None
        except Exception:
            changed = _changed(local, num_bytes)
            if changed is not None:
                raise changed from None
            raise

    _written(store, where, put)
    size = store.size(name)
    if size != num_bytes:
        changed = _changed(local, num_bytes)
        if changed is not None:
            raise changed
        raise ConnectionError(  # not a RoxxelError, so masked here
            without_credentials(
                f"{where}: the server holds {size} bytes after the upload (expected {num_bytes})"
            )
        )


def _changed(local: Path, num_bytes: int) -> FormatError | None:
    """The error of a local shard deleted (M7) or resized (M8) since the push checked it;
    None while it is there with its ``num_bytes``."""
    try:
        found = local.stat().st_size
    except FileNotFoundError:
        what, rule = "shard listed in the manifest is missing (deleted while it uploaded", "M7"
    else:
        if found == num_bytes:
            return None
        what, rule = f"changed while it uploaded ({found} bytes, expected {num_bytes}", "M8"
    return FormatError(f"{local}: {what}; rule {rule} of docs/format.md)", rule=rule, path=local)
