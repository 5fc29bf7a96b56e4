"""Publish a finished local dataset at a URL: shards first, the manifest last.

Write side (the read side never imports it). The order is the publication protocol: the old
manifest at the URL (if any) is removed first, then every shard is uploaded (in parallel,
each upload retried, its size checked on the server), and the manifest goes up last, in one
PUT. So a dataset whose upload was killed mid-way has no manifest and never opens (rule M1);
a reader of an old manifest that meets a new shard refuses it (its checksums differ, M9).
Objects of an older dataset that the new manifest does not list are left where they are.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from roxxel.errors import ConfigError, check_int
from roxxel.format.dataset import Dataset
from roxxel.format.manifest import MANIFEST_NAME
from roxxel.format.remote import FetchPolicy, RemoteStore, is_url, join_url

__all__ = ["upload_dataset"]

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
    store.retry(url, lambda: fs.makedirs(root, exist_ok=True))  # a folder for file://
    if store.retry(manifest_url, lambda: fs.exists(target)):
        store.retry(manifest_url, lambda: fs.rm_file(target))
    entries = dataset.manifest.shards
    with ThreadPoolExecutor(workers, "roxxel-upload") as pool:
        jobs = [
            pool.submit(_put, store, dataset.path / e.path, e.path, e.num_bytes) for e in entries
        ]
        for done, job in enumerate(as_completed(jobs), 1):
            job.result()
            if on_shard is not None:
                on_shard(done, len(entries))
    data = dataset.manifest.to_json()
    store.retry(manifest_url, lambda: fs.pipe_file(target, data))
    return len(entries)


def _put(store: RemoteStore, local: Path, name: str, num_bytes: int) -> None:
    """Upload one shard and check the server holds all of its bytes."""
    fs, root = store.filesystem()
    remote = f"{root.rstrip('/')}/{name}"
    where = join_url(store.url, name)
    store.retry(where, lambda: fs.put_file(str(local), remote))
    size = store.size(name)
    if size != num_bytes:
        raise ConnectionError(
            f"{where}: the server holds {size} bytes after the upload (expected {num_bytes})"
        )
