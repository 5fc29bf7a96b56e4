"""Ranged GETs of an S3 object's signed URL with urllib3: the bytes move with the GIL let go.

s3fs reads a body through its asyncio event loop, a few dozen KiB at a time in Python, and
holds the GIL for most of that (about 2 ns a byte here): in a process that also runs the
Loader, downloads and batches take turns on one core. A signed URL (the store's own
``sign``: botocore's presigned GET, the same credentials, endpoint and region) read with
urllib3's ``readinto`` into one buffer copies the bytes in C with the GIL released, at about
a third of the CPU (``benchmarks/README.md``).

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
from collections.abc import Mapping
from typing import Any

__all__ = ["DirectReader", "NotDirect", "direct_reader"]

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
_TIMEOUT_S = 60.0  # botocore's default connect and read timeouts


class NotDirect(Exception):
    """The store answered what only its own library handles: read through fsspec instead;
    ``lasting``: for every later read of this store too (a redirect, a refusal, a trust
    store), not only this one (a missing object)."""

    def __init__(self, lasting: bool = True) -> None:
        super().__init__()
        self.lasting = lasting


class DirectReader:
    """Ranged GETs of signed URLs, through one pool of kept-alive connections (thread-safe)."""

    def __init__(self, fs: Any, options: Mapping[str, Any]) -> None:
        import urllib3  # with s3fs: botocore's own HTTP client

        config = options.get("config_kwargs") or {}
        timeout = urllib3.Timeout(
            connect=config.get("connect_timeout", _TIMEOUT_S),
            read=config.get("read_timeout", _TIMEOUT_S),
        )
        self._fs = fs
        self._pool = urllib3.PoolManager(
            maxsize=32, retries=False, timeout=timeout, cert_reqs="CERT_REQUIRED"
        )

    def read(self, path: str, start: int, stop: int) -> bytearray:
        """Bytes [start, stop) of the object at ``path`` (fewer when it ends first, none when
        it ends before ``start``). Raises ``ConnectionError`` for an outage (a retry may fix
        it) and `NotDirect` for any other answer but data."""
        import urllib3

        try:
            url = self._fs.sign(path, expiration=_SIGNED_FOR_S)
        except Exception:  # no credentials, say: fsspec's own call names it
            raise NotDirect from None
        try:
            response = self._pool.request(
                "GET",
                url,
                headers={"Range": f"bytes={start}-{stop - 1}"},
                preload_content=False,
                decode_content=False,  # the stored bytes, as botocore reads them
                redirect=False,
            )
        except urllib3.exceptions.SSLError:
            raise NotDirect from None  # a trust store only the library's own config names
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ConnectionError(_what(exc)) from None
        try:
            return _body(response, start, stop)
        except (urllib3.exceptions.HTTPError, OSError) as exc:  # the body broke off
            response.close()
            raise ConnectionError(_what(exc)) from None
        finally:
            response.release_conn()


def _body(response: Any, start: int, stop: int) -> bytearray:
    """The bytes of a response to a ranged GET (`DirectReader.read`); raises `NotDirect`, or
    ``_Outage`` (a ``ConnectionError`` of this module's own words)."""
    status = response.status
    if status == 416:  # the object ends before start
        response.drain_conn()
        return bytearray()
    if status >= 500 or status == 429:
        response.drain_conn()
        raise _Outage(f"HTTP {status} from the store")
    if status not in (200, 206) or (status == 200 and start > 0):
        response.drain_conn()
        raise NotDirect(lasting=status != 404)
    length = response.headers.get("Content-Length", "")
    if not length.isdigit():
        response.close()
        raise NotDirect
    size = min(int(length), stop - start)
    data = bytearray(size)
    view, got = memoryview(data), 0
    while got < size:
        num_read = response.readinto(view[got:])
        if not num_read:
            response.close()
            raise _Outage(f"the store closed the connection after {got} of {size} bytes")
        got += num_read
    if int(length) > size:  # a server that sent the whole object: do not reuse the socket
        response.close()
    return data


class _Outage(ConnectionError):
    """An outage this module names in its own words (no URL in them)."""


def _what(exc: BaseException) -> str:
    """A network error in words without its URL (a signed URL holds a signature): this
    module's own words, or the error's kind and the errno of the OS error under it."""
    if isinstance(exc, _Outage):
        return str(exc)
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return f"{type(exc).__name__}: {os.strerror(seen.errno)}"
        seen = seen.__cause__ or seen.__context__
    return type(exc).__name__


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
    except ImportError:  # urllib3 comes with botocore: only a broken install lacks it
        return None
