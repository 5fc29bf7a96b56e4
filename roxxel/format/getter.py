"""Ranged GETs of plain (signed) HTTP URLs, in this process or in a process of its own.

`get_range` reads bytes [start, stop) of a URL with urllib3's ``readinto`` into one buffer: the
bytes move in C with the GIL let go. That still takes the GIL back after every socket read, so
the downloads of a cache and the Loader's batches in one process slow each other down (an
epoch over a filled cache took 5-7x as long while 8 threads downloaded beside it; with the
downloads in another process, only the CPU is shared: ``benchmarks/README.md``). `Getter` runs
the same GETs in a process of its own that writes them into the cache's files: the parent
only waits for the answer.

The process is this file run as a script (``python -P getter.py``: standard library and
urllib3, nothing of roxxel, so it starts in about 80 ms) and talks JSON lines over its
stdin and stdout (no pickle): first ``{"threads": n}``, answered by ``{"ready": true}``;
then requests ``{"id", "url", "start", "stop", "path", "timeout": [connect, read]}``, each
answered by ``{"id", "num_read"}`` (the bytes written into the existing file ``path`` at
offset ``start``) or ``{"id", "error": kind, ...}`` with kind ``outage`` (and a
``message``, and the ``num_read`` bytes written before it broke off), ``not_direct`` (and ``lasting``) or ``write`` (and an ``errno``). It prints
nothing else, and ends when its stdin does (the parent exited, even by ``kill -9``). A
parent whose process died or never answered reads in its own process instead (`GetterGone`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["Getter", "GetterGone", "NotDirect", "WriteFailed", "get_range", "what"]

_THREADS = 256  # GETs at once in the process, shared by every cache of the parent: as many
# as one cache's `max_fetches` may ask for (cache.MOST_FETCHES; threads start when there is
# work for them)
_PIECE = 4 << 20  # bytes of a range held in memory at once


class NotDirect(Exception):
    """The store answered what only its own library handles: read through fsspec instead;
    ``lasting``: for every later read of this store too (a redirect, a refusal, a trust
    store), not only this one (a missing object)."""

    def __init__(self, lasting: bool = True) -> None:
        super().__init__()
        self.lasting = lasting


class WriteFailed(Exception):
    """Writing what was read into the local file failed (``errno``: a full disk, say)."""

    def __init__(self, code: int) -> None:
        super().__init__(code, os.strerror(code))
        self.errno = code


class GetterGone(Exception):
    """The download process ended or never started: read in this process instead."""


class Outage(ConnectionError):
    """An outage in this module's own words (no URL in them: a signed URL holds a
    signature); ``num_read``: the bytes of the range delivered before it broke off."""

    def __init__(self, message: str, num_read: int = 0) -> None:
        super().__init__(message)
        self.num_read = num_read


def make_pool(connect_s: float, read_s: float) -> Any:
    """A urllib3 pool of kept-alive connections: no retries or redirects of its own (the
    caller's `FetchPolicy` retries), certificates checked."""
    import urllib3

    timeout = urllib3.Timeout(connect=connect_s, read=read_s)
    return urllib3.PoolManager(
        maxsize=32, retries=False, timeout=timeout, cert_reqs="CERT_REQUIRED"
    )


def get_range(pool: Any, url: str, start: int, stop: int) -> bytearray:
    """Bytes [start, stop) of ``url`` (fewer when the object ends first, none when it ends
    before ``start``), in one buffer: for small reads (a manifest, a trailer)."""
    data = bytearray()
    stream_range(pool, url, start, stop, lambda piece, _: data.extend(piece))
    return data


def stream_range(
    pool: Any, url: str, start: int, stop: int, sink: Callable[[memoryview, int], None]
) -> int:
    """Bytes [start, stop) of ``url`` handed to ``sink(piece, offset)`` in pieces of at most
    `_PIECE` bytes, in order; how many (fewer when the object ends first, none when it ends
    before ``start``). Raises `Outage` for what a retry may fix (a refused or broken
    connection, HTTP 5xx or 429; its ``num_read``: the bytes the sink took before) and
    `NotDirect` for any other answer but data."""
    import urllib3

    try:
        response = pool.request(
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
        raise Outage(what(exc)) from None
    done = [0]
    try:
        return _body(response, start, stop, sink, done)
    except (urllib3.exceptions.HTTPError, OSError) as exc:  # the body broke off
        response.close()
        raise Outage(what(exc), done[0]) from None
    finally:
        response.release_conn()


def _body(
    response: Any, start: int, stop: int, sink: Callable[[memoryview, int], None], done: list
) -> int:
    status = response.status
    if status == 416:  # the object ends before start
        response.drain_conn()
        return 0
    if status >= 500 or status == 429:
        response.drain_conn()
        raise Outage(f"HTTP {status} from the store")
    if status not in (200, 206) or (status == 200 and start > 0):
        response.drain_conn()
        raise NotDirect(lasting=status != 404)
    length = response.headers.get("Content-Length", "")
    if not length.isdigit():
        response.close()
        raise NotDirect
    size = min(int(length), stop - start)
    buffer = memoryview(bytearray(min(size, _PIECE)))
    while done[0] < size:
        piece = buffer[: min(len(buffer), size - done[0])]
        got = 0
        try:
            while got < len(piece):
                num_read = response.readinto(piece[got:])
                if not num_read:
                    response.close()
                    raise Outage(
                        f"the store closed the connection after {done[0] + got} of {size} bytes"
                    )
                got += num_read
        finally:  # what arrived counts, also before a break: a retry goes on from there
            if got:
                sink(piece[:got], start + done[0])
                done[0] += got
    if int(length) > size:  # a server that sent the whole object: do not reuse the socket
        response.close()
    return size


def what(exc: BaseException) -> str:
    """A network error in words without its URL: this module's own words; the error's kind
    and the errno of the OS error under it; a timeout's kind and first line past its
    connection's name (``ReadTimeoutError: Read timed out. (read timeout=15)``); or its kind."""
    import urllib3

    if isinstance(exc, Outage):
        return str(exc)
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return f"{type(exc).__name__}: {os.strerror(seen.errno)}"
        seen = seen.__cause__ or seen.__context__
    if isinstance(exc, urllib3.exceptions.TimeoutError):  # "<connection>: <what>": no URL
        told = str(exc).strip().partition("\n")[0].partition(": ")[2]
        return f"{type(exc).__name__}: {told}" if told else type(exc).__name__
    return type(exc).__name__


def write_at(path: str, data: bytes | bytearray | memoryview, offset: int) -> None:
    """``data`` into the existing file ``path`` from ``offset``; `WriteFailed` if it cannot."""
    with _opened(path) as fd:
        _write_at(fd, data, offset)


def stream_into(pool: Any, url: str, start: int, stop: int, path: str) -> int:
    """`stream_range` into the existing file ``path``, each piece at its offset in the
    object; how many bytes. Raises what `stream_range` and `write_at` raise."""
    with _opened(path) as fd:
        return stream_range(pool, url, start, stop, lambda piece, at: _write_at(fd, piece, at))


@contextlib.contextmanager
def _opened(path: str) -> Iterator[int]:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise WriteFailed(exc.errno or 5) from None
    try:
        yield fd
    finally:
        os.close(fd)


def _write_at(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    view = memoryview(data)
    try:
        while view:
            num = os.pwrite(fd, view, offset)
            if not num:
                raise WriteFailed(28)  # ENOSPC: no byte written
            view, offset = view[num:], offset + num
    except OSError as exc:
        raise WriteFailed(exc.errno or 5) from None


class Getter:
    """The download process (module docstring), started at once, used once it is ready.

    Thread-safe. `get_into` raises what `get_range` and `write_at` raise, or `GetterGone`
    when the process is not (or no longer) there to answer. The pipes are plain file
    descriptors (no file objects): a forked child closes its copies (`forget`) and nothing
    closes them twice.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # writes to the process, the id counter, `_waiting`
        self._waiting: dict[int, Future[dict[str, Any]]] = {}
        self._ids = itertools.count()
        self.ready = threading.Event()
        self.gone = False
        self.num_answered = 0
        theirs_in, self._to_process = os.pipe()
        self._from_process, theirs_out = os.pipe()
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-P", __file__],
                stdin=theirs_in,
                stdout=theirs_out,
                stderr=subprocess.DEVNULL,
            )
        except BaseException:
            for fd in (self._to_process, self._from_process):
                os.close(fd)
            raise
        finally:
            os.close(theirs_in)
            os.close(theirs_out)
        self._send({"threads": _THREADS})
        threading.Thread(target=self._answers, name="roxxel-getter", daemon=True).start()

    @property
    def pid(self) -> int:
        return self._process.pid

    def get_into(self, url: str, start: int, stop: int, path: str, timeout: tuple) -> int:
        """Bytes [start, stop) of ``url`` written into the file ``path`` at offset ``start``
        by the process; how many (see `get_range`)."""
        future: Future[dict[str, Any]] = Future()
        with self._lock:
            if not self.ready.is_set() or self.gone:
                raise GetterGone
            key = next(self._ids)
            self._waiting[key] = future
        request = {"url": url, "start": start, "stop": stop, "path": path, "timeout": timeout}
        try:
            self._send({"id": key, **request})
        except OSError:  # the process is gone: `_answers` ends every wait
            self._end()
        answer = future.result()
        kind = answer.get("error")
        if kind is None:
            return int(answer["num_read"])
        if kind == "not_direct":
            raise NotDirect(lasting=bool(answer["lasting"]))
        if kind == "write":
            raise WriteFailed(int(answer["errno"]))
        raise Outage(str(answer["message"]), int(answer.get("num_read", 0)))

    def close(self) -> None:
        """End the process (it ends with its stdin) and wait for it."""
        with self._lock, contextlib.suppress(OSError):
            os.close(self._to_process)
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def forget(self) -> None:
        """In a forked child: close this child's copies of the pipes, so the process still
        ends with its parent, and use it no more."""
        self.gone = True
        for fd in (self._to_process, self._from_process):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _send(self, message: dict[str, Any]) -> None:
        view = memoryview(json.dumps(message).encode() + b"\n")
        with self._lock:
            while view:
                view = view[os.write(self._to_process, view) :]

    def _answers(self) -> None:
        try:
            with os.fdopen(self._from_process, "rb", closefd=True) as answers:
                for line in answers:
                    answer = json.loads(line)
                    if answer.get("ready"):
                        self.ready.set()
                        continue
                    with self._lock:
                        future = self._waiting.pop(answer["id"], None)
                        self.num_answered += 1
                    if future is not None:
                        future.set_result(answer)
        except (OSError, ValueError, KeyError):  # a broken pipe or line: the process is gone
            pass
        self._end()

    def _end(self) -> None:
        with self._lock:
            self.gone = True
            waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(GetterGone())


def _serve() -> None:
    """The process's side (module docstring)."""
    import urllib3  # noqa: F401 (fails here, before "ready", if it is missing)

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    config = json.loads(stdin.readline())
    pools: dict[tuple[float, float], Any] = {}
    lock = threading.Lock()

    def answer(message: dict[str, Any]) -> None:
        with lock:
            stdout.write(json.dumps(message).encode() + b"\n")
            stdout.flush()

    def run(request: dict[str, Any]) -> None:
        key = request["id"]
        try:
            timeout = tuple(request["timeout"])
            with lock:
                pool = pools.get(timeout) or pools.setdefault(timeout, make_pool(*timeout))
            num_read = stream_into(
                pool, request["url"], request["start"], request["stop"], request["path"]
            )
            answer({"id": key, "num_read": num_read})
        except NotDirect as exc:
            answer({"id": key, "error": "not_direct", "lasting": exc.lasting})
        except WriteFailed as exc:
            answer({"id": key, "error": "write", "errno": exc.errno})
        except Outage as exc:
            answer({"id": key, "error": "outage", "message": str(exc), "num_read": exc.num_read})
        except Exception as exc:  # anything unforeseen: retried, then named
            answer({"id": key, "error": "outage", "message": what(exc)})

    with ThreadPoolExecutor(int(config["threads"])) as pool_threads:
        answer({"ready": True})
        for line in stdin:
            pool_threads.submit(run, json.loads(line))
        os._exit(0)  # the parent is gone: running GETs are of no use to anyone


if __name__ == "__main__":
    _serve()
