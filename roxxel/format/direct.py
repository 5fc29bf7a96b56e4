"""Ranged GETs of an S3 object's signed URL with urllib3: the bytes move with the GIL let go.

s3fs reads a body through its asyncio event loop, a few dozen KiB at a time in Python, and
holds the GIL for most of that (about 2 ns a byte here): in a process that also runs the
Loader, downloads and batches take turns on one core. A signed URL (the store's own
``sign``: botocore's presigned GET, the same credentials, endpoint and region) read with
urllib3's ``readinto`` in 4 MiB pieces copies the bytes in C with the GIL released, at about
a third of the CPU (``benchmarks/README.md``). A shard's download goes further: once this
process's download process is ready (`getter.Getter`, started by the first download), it
GETs the URL and writes the bytes into the cache's file itself, so they never take this
process's GIL at all; until then, and if it ever ends, they are read here.

This path is taken only where it cannot read differently from fsspec's: S3 with storage
options that only name credentials, an endpoint, a region and timeouts, and no proxy in the
environment (see `direct_reader`). Any answer but data, an empty range or an outage raises
`NotDirect` (a redirect, a refusal, a missing object, a certificate this path's default
trust store does not know): the caller then reads through fsspec, whose own error (or data)
is the answer. The signed URL never appears in an error: messages are built here from the
error's kind and errno.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Mapping
from typing import Any

from roxxel.format.getter import (
    Getter,
    GetterGone,
    NotDirect,
    get_range,
    make_pool,
    stream_into,
)

__all__ = ["DirectReader", "direct_reader"]

# storage options that change nothing a signed GET reads: credentials, an endpoint, a region,
# timeouts, and fsspec's own caching of instances, listings and blocks
_OPTIONS = {
    "endpoint_url",
    "key",
    "secret",
    "token",
    "anon",
    "profile",
    "use_ssl",
    "cache_regions",
    "skip_instance_cache",
    "use_listings_cache",
    "listings_expiry_time",
    "max_paths",
    "default_block_size",
    "default_fill_cache",
    "default_cache_type",
    "max_concurrency",
}
_CLIENT_KWARGS = {"endpoint_url", "region_name"}
_CONFIG_KWARGS = {
    "retries",
    "connect_timeout",
    "read_timeout",
    "max_pool_connections",
    "region_name",
    "signature_version",
    "s3",
}
_PROXY = re.compile(r"^(https?|all)_proxy$", re.IGNORECASE)
_SIGNED_FOR_S = 3600


class DirectReader:
    """Ranged GETs of signed URLs (thread-safe): in this process, or, once it is ready, by
    the download process of this process (`getter.Getter`, one for every reader)."""

    def __init__(self, fs: Any, options: Mapping[str, Any]) -> None:
        config = options.get("config_kwargs") or {}
        self._timeout = (  # s3fs's own: its defaults (5 s, 15 s) unless the options say
            float(config.get("connect_timeout", fs.connect_timeout)),
            float(config.get("read_timeout", fs.read_timeout)),
        )
        self._fs = fs
        self._pool = make_pool(*self._timeout)

    def read(self, path: str, start: int, stop: int) -> bytes:
        """Bytes [start, stop) of the object at ``path``, read here (`getter.get_range`;
        copied once more: for small reads, a manifest or a trailer)."""
        return bytes(get_range(self._pool, self._sign(path), start, stop))

    def read_into(self, path: str, start: int, stop: int, file: str) -> int:
        """Bytes [start, stop) of the object at ``path`` written into the existing ``file``
        at offset ``start``, by the download process where it is ready; how many. Raises
        what `read` raises, and `getter.WriteFailed`."""
        url = self._sign(path)
        getter = _getter()
        if getter is not None:
            try:
                return getter.get_into(url, start, stop, file, self._timeout)
            except GetterGone:
                pass
        return stream_into(self._pool, url, start, stop, file)

    def _sign(self, path: str) -> str:
        try:
            return self._fs.sign(path, expiration=_SIGNED_FOR_S)
        except Exception:  # no credentials, say: fsspec's own call names it
            raise NotDirect from None


_GETTER: list[Getter | None] = []  # this process's download process (None: none could start)
_GETTER_LOCK = threading.Lock()


def _getter() -> Getter | None:
    """The download process, started on first use; None while it starts, or once it has
    gone (it is not started again)."""
    with _GETTER_LOCK:
        if not _GETTER:
            try:
                _GETTER.append(Getter())
            except OSError:  # no process to start here: every GET in this one, not asked again
                _GETTER.append(None)
        getter = _GETTER[0]
    return getter if getter is not None and getter.ready.is_set() and not getter.gone else None


def _forget_getter() -> None:
    """In a forked child: the parent's download process is the parent's."""
    global _GETTER_LOCK
    _GETTER_LOCK = threading.Lock()
    for getter in _GETTER:
        if getter is not None:
            getter.forget()
    _GETTER.clear()


os.register_at_fork(after_in_child=_forget_getter)


def direct_reader(protocol: str, fs: Any, options: Mapping[str, Any]) -> DirectReader | None:
    """A `DirectReader` for an S3 filesystem whose options and environment leave a signed GET
    reading what s3fs would (module docstring), else None."""
    if protocol not in ("s3", "s3a") or any(_PROXY.match(name) for name in os.environ):
        return None
    client = options.get("client_kwargs") or {}
    config = options.get("config_kwargs") or {}
    if not (
        set(options) <= _OPTIONS | {"client_kwargs", "config_kwargs"}
        and isinstance(client, Mapping)
        and set(client) <= _CLIENT_KWARGS
        and isinstance(config, Mapping)
        and set(config) <= _CONFIG_KWARGS
    ):
        return None
    try:
        return DirectReader(fs, options)
    except (ImportError, TypeError, ValueError):  # no urllib3 (a broken install), odd timeouts
        return None
