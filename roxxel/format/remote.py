"""Datasets at a URL: which paths are URLs, the fsspec filesystem behind one, and bounded
retries that end in one clear error.

fsspec is imported only when a URL is opened (``pip install roxxel[remote]``, or
``roxxel[s3]`` / ``roxxel[gcs]`` for the protocol's package too), so ``import roxxel`` stays
light. Credentials and endpoints come from where each protocol looks (environment, config
files) or from ``storage_options``; nothing here logs or prints them. Every error raised here
names the URL with its user and password masked, and carries no library error as its cause or
context (its message, an endpoint with a token, say, would show in the traceback): the kind and
first line of that error go into the message, with each storage option value named instead.
"""

from __future__ import annotations

import errno
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from roxxel.errors import ConfigError, RoxxelError, check_int, without_credentials
from roxxel.format.direct import DirectReader, direct_reader
from roxxel.format.getter import NotDirect, Outage, WriteFailed, write_at

__all__ = ["FetchPolicy", "RemoteStore", "fsspec_url", "is_url", "join_url"]

T = TypeVar("T")

# a scheme of at least two letters, so "C:\\data" (a Windows drive) is not a URL; one slash
# after it ("file:/abs", read by fsspec as /abs) is a URL misspelt, that `fsspec_url` refuses
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:/")
_LOCAL_SCHEMES = ("file", "local")
# a URL of the local file system: its scheme, its host (up to the next "/"), its path
_FILE_URL = re.compile(r"^(file|local)://([^/]*)(.*)$", re.IGNORECASE | re.DOTALL)
# the extra that installs a protocol's package
_EXTRAS = {"s3": "roxxel[s3]", "s3a": "roxxel[s3]", "gs": "roxxel[gcs]", "gcs": "roxxel[gcs]"}
# errors no retry can fix: the object is not there (the caller names the rule), and errno
_MISSING_ERRNO = {
    FileNotFoundError: errno.ENOENT,
    IsADirectoryError: errno.EISDIR,
    NotADirectoryError: errno.ENOTDIR,
}
_MISSING = tuple(_MISSING_ERRNO)


def is_url(path: object) -> bool:
    """Whether ``path`` names a dataset through fsspec (``s3://``, ``gs://``, ``file://`` ...).
    Schemes are case-insensitive (RFC 3986). ``file:/abs`` (one slash) is a URL too, one that
    `fsspec_url` refuses: not a local folder named ``file:``.

    >>> is_url("s3://bucket/ds"), is_url("S3://bucket/ds"), is_url("data/ds")
    (True, True, False)
    >>> is_url("C:\\\\data"), is_url("file:/abs")
    (False, True)
    """
    return isinstance(path, str) and _URL.match(path) is not None


def fsspec_url(url: str) -> str:
    """``url`` as fsspec is to open it: its scheme in lower case (schemes are case-insensitive,
    RFC 3986) and a file URL without its host. In a file URL the part between ``file://`` and
    the next ``/`` is a host (RFC 8089), where fsspec would read the first folder of a path
    relative to the working one: empty or ``localhost`` is this machine and is dropped; any
    other (``file://ds``, a relative path, included) is refused. One slash after the scheme
    (``file:/abs``, which fsspec reads as ``/abs``) is refused, giving the two-slash spelling.

    >>> fsspec_url("file://localhost/data/ds"), fsspec_url("S3://bucket/ds")
    ('file:///data/ds', 's3://bucket/ds')

    Raises:
        ConfigError: a file URL naming another host or a relative path, or a URL with one
            slash after its scheme.
    """
    if not is_url(url):
        return url
    given, _, rest = url.partition(":")
    scheme = given.lower()
    if not rest.startswith("//"):
        local = scheme in _LOCAL_SCHEMES
        fix = f"{scheme}://{rest}" if local else f"{scheme}:/{rest}"
        meant = f", the URL of the absolute path {rest}" if local else ""
        raise ConfigError(
            f"{url}: one slash after {given}: where a URL has two (expected {fix}{meant})",
            path=url,
        )
    match = _FILE_URL.match(url)
    if match is None:
        return f"{scheme}:{rest}"
    _, host, path = match.groups()
    if host and host.lower() != "localhost":
        raise ConfigError(
            f"{url}: a host or a relative path after {scheme}:// (expected"
            f" {scheme}:///absolute/path or {scheme}://localhost/absolute/path on this"
            " machine)",
            path=url,
        )
    return f"{scheme}://{path or '/'}"


def join_url(url: str, name: str) -> str:
    """``name`` inside the folder ``url``.

    >>> join_url("s3://bucket/ds/", "shard-0.rxl")
    's3://bucket/ds/shard-0.rxl'
    """
    return f"{url.rstrip('/')}/{name}"


@dataclass(frozen=True, slots=True)
class FetchPolicy:
    """How hard a read from the store tries: ``attempts`` tries per request, waiting
    ``backoff_s * 2**k`` seconds after the k-th failure; ``chunk_bytes`` per ranged read
    through fsspec (S3's signed GETs stream a whole shard: `RemoteStore.read_into`)."""

    attempts: int = 4
    backoff_s: float = 0.25
    chunk_bytes: int = 8 << 20

    def __post_init__(self) -> None:
        check_int("FetchPolicy.attempts", self.attempts, 1, 100)
        check_int("FetchPolicy.chunk_bytes", self.chunk_bytes, 1 << 12, 1 << 30)
        if not isinstance(self.backoff_s, int | float) or not 0 <= self.backoff_s <= 60:
            raise ConfigError(
                f"FetchPolicy.backoff_s: {self.backoff_s!r} (expected seconds in [0, 60])"
            )


class RemoteStore:
    """The folder ``url`` of an fsspec filesystem, read with bounded retries. A file URL
    naming a host other than this machine is a `ConfigError` at once (`fsspec_url`).

    Thread-safe (fsspec filesystems are; this object opens its filesystem once). Every read
    raises ``ConnectionError`` (an ``OSError``) naming the URL and the last failure once
    ``policy.attempts`` tries failed; a missing object raises ``FileNotFoundError`` at once,
    and a refusal to read (credentials) or any other error no retry fixes (a storage option
    the protocol does not take, say) a `ConfigError` naming the URL. None of them shows the
    URL's password or a storage option, nor chains the library's error (module docstring).
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        policy: FetchPolicy | None = None,
    ) -> None:
        self.url = url
        self._fsspec_url = fsspec_url(url)  # what fsspec opens; messages name `url`
        self.storage_options = dict(storage_options or {})
        self.policy = policy or FetchPolicy()
        self._lock = threading.Lock()
        self._fs: tuple[Any, str] | None = None
        self._direct: DirectReader | None = None
        self._pid = os.getpid()

    def filesystem(self) -> tuple[Any, str]:
        """(fsspec filesystem, path of the folder inside it), opened on first use and again
        in a forked child (a client's connections and event loop do not survive a fork)."""
        if self._pid != os.getpid():
            self._lock, self._fs, self._pid = threading.Lock(), None, os.getpid()
        with self._lock:
            if self._fs is None:
                self._fs = _filesystem(self._fsspec_url, self.storage_options)
                protocol = self._fsspec_url.split("://", 1)[0]
                self._direct = direct_reader(protocol, self._fs[0], self.storage_options)
            return self._fs

    def read(self, name: str, start: int = 0, stop: int | None = None) -> bytes:
        """Bytes [start, stop) of object ``name`` of the folder (to its end when stop is None;
        fewer when the object ends first, none when it ends before ``start``, on every
        protocol). One request per try."""
        fs, root = self.filesystem()
        path, where = f"{root.rstrip('/')}/{name}", join_url(self.url, name)
        direct = self._direct
        if direct is not None and stop is not None:
            try:
                return self.retry(where, lambda: direct.read(path, start, stop))
            except NotDirect as refused:  # the library answers: this read, or from now on
                if refused.lasting:
                    self._direct = None
        return self.retry(where, lambda: _cat(fs, path, start, stop))

    def read_into(self, name: str, start: int, stop: int, file: str) -> int:
        """Bytes [start, stop) of object ``name`` written into the existing local ``file``
        at their offsets; how many (fewer when the object ends first). Through fsspec, one
        read per ``policy.chunk_bytes`` (the last one up to ``stop``), each retried; on S3's
        signed GETs (`roxxel.format.direct`), one GET streamed in pieces, by the download
        process where it can, resumed where a broken one stopped; given up after
        ``policy.attempts`` tries in a row that moved no byte, or after as many tries as the
        chunked reads would have had. Raises what `read` raises, and `getter.WriteFailed`
        when the file cannot take them."""
        fs, root = self.filesystem()
        path, where = f"{root.rstrip('/')}/{name}", join_url(self.url, name)
        direct = self._direct
        if direct is not None:
            try:
                return self._streamed(direct, path, where, start, stop, file)
            except NotDirect as refused:  # the library answers: this read, or from now on
                if refused.lasting:
                    self._direct = None
        at, chunk = start, self.policy.chunk_bytes
        while at < stop:
            end = stop if stop - at <= chunk + 1 else at + chunk
            if direct is None:
                data = self.read(name, at, end)
            else:  # a signed GET was refused this once: not asked again
                data = self.retry(where, lambda at=at, end=end: _cat(fs, path, at, end))
            write_at(file, data, at)
            if len(data) < end - at:  # the object ended
                return at + len(data) - start
            at = end
        return at - start

    def _streamed(
        self, direct: DirectReader, path: str, where: str, start: int, stop: int, file: str
    ) -> int:
        offset = start

        def attempt() -> int:
            nonlocal offset
            try:
                offset += direct.read_into(path, offset, stop, file)
            except Outage as broken:  # the bytes before the break are in the file
                offset += broken.num_read
                raise
            return offset - start

        rounds = 1 + (stop - start) // self.policy.chunk_bytes  # the tries of chunked reads
        for round_ in range(rounds):
            before = offset
            try:
                return self.retry(where, attempt)
            except ConnectionError:
                if offset == before or round_ == rounds - 1:  # no byte moved, or tried enough
                    raise
        raise AssertionError("unreachable")

    def size(self, name: str) -> int:
        """Size in bytes of object ``name`` of the folder."""
        fs, root = self.filesystem()
        path = f"{root.rstrip('/')}/{name}"
        return int(self.retry(join_url(self.url, name), lambda: fs.size(path)))

    def retry(self, where: str, call: Callable[[], T]) -> T:
        """``call()``, tried up to ``policy.attempts`` times (see the class contract)."""
        attempt = 0
        while True:
            try:
                return call()
            except (RoxxelError, NotDirect, WriteFailed):
                raise
            except Exception as exc:  # judged below, outside this handler: no context
                failure = exc
            attempt += 1
            if attempt == self.policy.attempts or not _retryable(failure):
                raise _failure(where, failure, attempt, self.storage_options)
            time.sleep(self.policy.backoff_s * 2 ** (attempt - 1))

    def __repr__(self) -> str:  # storage options and a URL's password: never shown
        return f"RemoteStore({without_credentials(self.url)!r})"


def _retryable(exc: Exception) -> bool:
    """Whether another try may fix what ``call()`` raised: a network, server or client
    error, of Python's kinds or (by `_transient`) of a protocol's library."""
    if isinstance(exc, (*_MISSING, PermissionError)):
        return False
    return isinstance(exc, OSError | RuntimeError) or _transient(exc)


def _failure(where: str, exc: Exception, attempts: int, options: dict[str, Any]) -> Exception:
    """The error a read of ``where`` raises after ``attempts`` tries that ended in ``exc``
    (the class contract), built from scratch: ``exc`` and its message are not kept."""
    if isinstance(exc, _MISSING):  # fsspec's own names the URL as given, password and all
        code = next(c for kind, c in _MISSING_ERRNO.items() if isinstance(exc, kind))
        return OSError(code, os.strerror(code), without_credentials(where))
    if isinstance(exc, PermissionError):
        return ConfigError(
            f"{where}: access denied ({_masked(str(exc), options)}; expected credentials that"
            " may read it: the protocol's environment variables, config files or"
            " storage_options)",
            path=where,
        )
    if _retryable(exc):
        return ConnectionError(
            without_credentials(
                f"{where}: unreachable after {attempts} attempts"
                f" ({_told(exc, options)}, expected a reachable store)"
            )
        )
    return ConfigError(
        f"{where}: {_told(exc, options)} (expected storage options, credentials and an"
        " endpoint the protocol accepts)",
        path=where,
    )


def _cat(fs: Any, path: str, start: int, stop: int | None) -> bytes:
    try:
        return fs.cat_file(path, start=start, end=stop)
    except OSError as exc:  # s3fs: HTTP 416 as EINVAL (file://, memory://: b"")
        if exc.errno == errno.EINVAL and "range" in str(exc).lower():
            return b""
        raise


def _transient(exc: BaseException) -> bool:
    """Errors of a protocol's own library that a retry may fix (connection, timeout, 5xx,
    429: by the name of the kind, or an HTTP status it carries)."""
    name = type(exc).__name__
    status = _http_status(exc)
    if status is not None and (status >= 500 or status == 429):
        return True
    # "Connection" covers botocore's EndpointConnectionError; its EndpointResolutionError
    # (an endpoint that does not parse) is no outage
    return any(word in name for word in ("Connection", "Timeout", "ServerError"))


def _told(exc: BaseException, options: dict[str, Any]) -> str:
    """``"Kind: message"`` of a library's error (an `Outage`: its message, in those words
    already), on one line, shown as `_masked` says."""
    if isinstance(exc, Outage):
        return _masked(str(exc), options)
    return _masked(f"{type(exc).__name__}: {str(exc).strip().partition(chr(10))[0]}", options)


def _masked(text: str, options: dict[str, Any]) -> str:
    """``text`` with the value of every storage option in it named instead of shown (an
    endpoint may carry a token) and the password of every URL in it masked.

    >>> _masked("GET http://me:pw@h/x/b/k failed", {"endpoint_url": "http://me:pw@h/x/"})
    'GET <storage_options endpoint_url>b/k failed'
    """
    for name, value in _option_values(options):
        for shown in (value, value.rstrip("/")):  # a library may drop the trailing slash
            if len(shown) >= 4:
                text = text.replace(shown, f"<storage_options {name}>")
    return without_credentials(text)


def _option_values(options: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(dotted name, value) of every string in nested storage options."""
    for key, value in options.items() if isinstance(options, dict) else ():
        name = f"{prefix}{key}"
        if isinstance(value, str):
            yield name, value
        else:
            yield from _option_values(value, f"{name}.")


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status of an aiohttp response error (fsspec's http, gcsfs), else None."""
    try:
        from aiohttp import ClientResponseError  # optional: the protocols built on it
    except ImportError:
        return None
    return exc.status if isinstance(exc, ClientResponseError) else None


def _filesystem(url: str, options: dict[str, Any]) -> tuple[Any, str]:
    try:
        import fsspec.core  # optional: only a URL needs it
    except ImportError:
        raise ConfigError(
            f"{url}: reading a URL needs fsspec (not installed, expected"
            " `pip install roxxel[remote]`, or roxxel[s3] / roxxel[gcs])"
        ) from None
    s3 = url.split("://", 1)[0] in ("s3", "s3a")
    try:
        fs, path = fsspec.core.url_to_fs(url, **(_one_try(options) if s3 else options))
    except Exception as exc:  # unknown protocol, package missing or failing, bad option
        protocol = url.split("://", 1)[0]
        extra = _EXTRAS.get(protocol, "the package of its fsspec protocol")
        raise ConfigError(
            f"{url}: no filesystem for this URL ({_told(exc, options)}, expected an fsspec"
            f" protocol whose package is installed, for {protocol}:// {extra}, and options it"
            " accepts)"
        ) from None
    if s3:  # s3fs's own retry loop too (an instance of these options, which name ours)
        fs.retries = 1
    return fs, path


def _one_try(options: dict[str, Any]) -> dict[str, Any]:
    """s3: the options with each request tried once by botocore (unless they say
    otherwise): `FetchPolicy` is the one retry policy, so a store that went away is
    reported after its bounded tries, not after nested ones."""
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": 1})
    return {**options, "config_kwargs": config}
