"""Publish a finished local dataset at a URL: shards first, the manifest last.

Write side (the read side never imports it). The order is the publication protocol: the old
manifest at the URL (if any) is removed first, then every shard is uploaded (in parallel,
each upload retried, its size checked on the server), and the manifest goes up last, in one
PUT. So a dataset whose upload was killed mid-way has no manifest and never opens (rule M1);
a reader of an old manifest that meets a new shard refuses it (its checksums differ, M9).
Objects of an older dataset that the new manifest does not list are left where they are.

The object helpers below (`put_files`, `put_bytes`, `remove_object`, `list_objects`,
`published_trailer`) are the same protocol in pieces, for ``roxxel pack -o URL`` whose tasks
upload their shards and markers separately (`roxxel.ingest.parts`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from roxxel.errors import ConfigError, check_int, without_credentials
from roxxel.format.dataset import Dataset
from roxxel.format.manifest import MANIFEST_NAME
from roxxel.format.remote import FetchPolicy, RemoteStore, is_url, join_url
from roxxel.format.spec import HEADER_BYTES, TRAILER_BYTES, Trailer, fail, parse_trailer

__all__ = [
    "list_objects",
    "published_trailer",
    "put_bytes",
    "put_files",
    "remove_object",
    "upload_dataset",
]

Progress = Callable[[int, int], None]  # (shards uploaded, shards in all)


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
        FormatError: the local dataset breaks a rule.
        ConfigError: ``url`` is not a URL, or ``workers`` < 1.
        ConnectionError: the store stayed unreachable (see `RemoteStore`); run again.
    """
    if not is_url(url):
        raise ConfigError(f"upload_dataset: {url!r} is not a URL (expected e.g. s3://bucket/ds)")
    check_int("workers", workers, 1, 256)
    dataset = Dataset(path)
    store = RemoteStore(url, storage_options, policy)
    fs, root = store.filesystem()
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


def put_files(
    store: RemoteStore,
    folder: Path,
    files: Sequence[tuple[str, int]],
    *,
    workers: int = 8,
    on_file: Progress | None = None,
) -> None:
    """Upload the files ``(name, num_bytes)`` of ``folder`` under the store's folder, in
    parallel, each retried and its size checked on the server.

    Raises:
        ConnectionError: the store stayed unreachable, or holds another size after a put.
    """
    with ThreadPoolExecutor(workers, "roxxel-upload") as pool:
        jobs = [pool.submit(_put, store, folder / name, name, size) for name, size in files]
        for done, job in enumerate(as_completed(jobs), 1):
            job.result()
            if on_file is not None:
                on_file(done, len(files))


def put_bytes(store: RemoteStore, name: str, data: bytes) -> None:
    """Write object ``name`` of the store's folder in one PUT (retried)."""
    fs, root = store.filesystem()
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
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    if protocols & {"file", "local"}:
        store.retry(where, lambda: fs.makedirs(folder, exist_ok=True))


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
    """Upload one shard and check the server holds all of its bytes."""
    fs, root = store.filesystem()
    remote = f"{root.rstrip('/')}/{name}"
    where = join_url(store.url, name)
    _written(store, where, lambda: fs.put_file(str(local), remote))
    size = store.size(name)
    if size != num_bytes:
        raise ConnectionError(  # not a RoxxelError, so masked here
            without_credentials(
                f"{where}: the server holds {size} bytes after the upload (expected {num_bytes})"
            )
        )
