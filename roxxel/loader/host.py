"""The loader's host pipeline: reusable host buffers and a prefetch thread.

Two pieces, both independent of files, order and devices:

- `BufferPool` hands out preallocated, 64-byte aligned host batches and takes a buffer back
  only once nothing references the batch built in it any more: not the consumer, not a
  transform, and not JAX (on CPU `jax.device_put` aliases aligned numpy memory and keeps a
  reference to the numpy object it aliases until its device buffer is freed).
- `Prefetcher` runs ``produce(step)`` for consecutive steps in one background thread, into a
  bounded queue; ``get`` re-raises the thread's exception, with its traceback, in the
  consumer, and ``close`` joins the thread.
- `Timings` adds up where each batch's time goes (`LoaderStats` is its summary).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import math
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Literal, cast

import numpy as np

from roxxel.errors import ConfigError
from roxxel.loader.pinned import PAGE_BYTES, Registrar

__all__ = [
    "ALIGN",
    "BufferPool",
    "LoaderStats",
    "Prefetcher",
    "RowSpec",
    "Timings",
]

ALIGN = 64
Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class RowSpec:
    """Names, per-row shapes and dtypes of the fields of one host batch.

    >>> RowSpec.of({"x": ((2,), np.int32)}).row_bytes
    8
    """

    fields: tuple[tuple[str, Shape, np.dtype], ...]

    @staticmethod
    def of(spec: Mapping[str, tuple[Shape, np.dtype]]) -> RowSpec:
        """A layout from ``{name: (row_shape, dtype)}``."""
        return RowSpec(tuple((n, tuple(s), np.dtype(d)) for n, (s, d) in spec.items()))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.fields)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row over every field, before alignment."""
        return sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in self.fields)

    def spec(self) -> dict[str, tuple[Shape, np.dtype]]:
        return {name: (shape, dtype) for name, shape, dtype in self.fields}


class _Lease(np.ndarray):
    """The per-batch owner of a buffer's bytes.

    numpy collapses a chain of views to the first base of a different type, so every array
    cut from a batch (by the consumer, a transform, or JAX when it aliases) keeps this object
    alive; a finalizer on it says when the buffer is free again.
    """


class BufferPool:
    """Host batches of one layout and row count, each reused only after it is released.

    ``acquire`` returns a dict of arrays over one buffer. The buffer goes back to the pool
    when the last array derived from that dict is garbage, whichever thread drops it. When
    no buffer is free the pool allocates one, so a consumer that keeps old batches never
    blocks the pipeline and never sees them rewritten; at most ``keep`` free buffers are
    retained.

    With a ``registrar`` (`roxxel.loader.pinned`), every buffer is page-aligned and
    page-locked once, when it is allocated, so the gather writes straight into memory the
    device copies from at full speed; a buffer the pool drops (more than ``keep`` free, or
    after `close`) is unregistered first. A buffer the registrar refuses stays pageable.

    Thread-safety: ``acquire`` from one thread; releases may come from any thread, even from
    inside garbage collection (a lock-free deque, no callbacks into user code).
    """

    def __init__(
        self, layout: RowSpec, num_rows: int, keep: int = 4, registrar: Registrar | None = None
    ) -> None:
        if num_rows < 0 or keep < 1:
            raise ConfigError(
                f"pipeline.BufferPool: rows {num_rows}, keep {keep} (expected >= 0, >= 1)"
            )
        self.layout = layout
        self.num_rows = num_rows
        self._keep = keep
        self._registrar = registrar
        self._offsets, self._nbytes = _offsets(layout, num_rows)
        self._free: collections.deque[tuple[np.ndarray, bool]] = collections.deque()
        self.num_allocated = 0
        self.num_pinned = 0  # buffers page-locked now (allocated minus dropped)

    def acquire(self) -> dict[str, np.ndarray]:
        """A batch of writable arrays (rows first) over a buffer nobody else references."""
        try:
            raw, pinned = self._free.popleft()
        except IndexError:
            raw, pinned = self._allocate()
        lease = raw.view(_Lease)
        weakref.finalize(lease, self._release, raw, pinned).atexit = False
        batch = {}
        for (name, shape, dtype), offset in zip(self.layout.fields, self._offsets, strict=True):
            size = self.num_rows * math.prod(shape) * dtype.itemsize
            # slicing the lease (not np.ndarray(buffer=...), which bases on the raw block)
            # keeps it in every derived array's chain of bases
            view = lease[offset : offset + size].view(dtype).reshape((self.num_rows, *shape))
            batch[name] = view.view(np.ndarray)
        return batch

    def close(self) -> None:
        """Drop (and unregister) the free buffers; buffers still in use follow on release."""
        self._keep = 0
        while self._free:
            self._drop(*self._free.popleft())

    def __del__(self) -> None:
        # a pool dropped without close: unpin its free buffers before numpy frees them
        # (buffers in use hold the pool through their release callback)
        if self._registrar is not None and not sys.is_finalizing():
            self.close()

    def _allocate(self) -> tuple[np.ndarray, bool]:
        align = ALIGN if self._registrar is None else PAGE_BYTES
        block = np.empty(self._nbytes + align, np.uint8)
        start = -block.ctypes.data % align
        self.num_allocated += 1
        raw = block[start : start + self._nbytes]
        pinned = self._registrar is not None and self._registrar.register(raw)
        self.num_pinned += pinned
        return raw, pinned

    def _release(self, raw: np.ndarray, pinned: bool) -> None:
        if len(self._free) < self._keep:
            self._free.append((raw, pinned))
        else:
            self._drop(raw, pinned)

    def _drop(self, raw: np.ndarray, pinned: bool) -> None:
        if pinned and self._registrar is not None:
            self._registrar.unregister(raw)
            self.num_pinned -= 1


def _offsets(layout: RowSpec, num_rows: int) -> tuple[list[int], int]:
    offsets, position = [], 0
    for _, shape, dtype in layout.fields:
        offsets.append(position)
        size = num_rows * math.prod(shape) * dtype.itemsize
        position += -(-size // ALIGN) * ALIGN
    return offsets, max(position, ALIGN)


def _result(item: object) -> object:
    """The item, or the result of the future it is (raising what the work raised)."""
    return item.result() if isinstance(item, concurrent.futures.Future) else item


class _Failure:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()


class Prefetcher:
    """Calls ``produce(step)`` for step = start, start + 1, ... in a background thread.

    ``produce`` returns the item for a step, or None when the stream has ended. At most
    ``depth`` items wait in the queue. ``get`` returns ``(step, item)``, None at the end, and
    raises the exception ``produce`` raised (the original object, with its traceback).

    With ``finish``, a second thread turns each item into ``finish(step, item)`` while the
    first produces the next one (the loader's gather and its host-to-device copies overlap);
    up to ``handoff`` items wait between the two. The order and the errors are as with one
    thread.

    An item may be a `concurrent.futures.Future` (work ``produce`` handed to other threads):
    ``finish``, or else ``get``, waits for its result, in step order.

    Thread-safety: one consumer thread. ``close`` is idempotent and joins the threads; they
    hold no reference to whoever owns the Prefetcher, so owners can close it from
    ``__del__``.
    """

    def __init__(
        self,
        produce: Callable[[int], object | None],
        start: int,
        depth: int,
        timings: Timings | None = None,
        finish: Callable[[int, Any], object] | None = None,
        handoff: int = 1,
    ) -> None:
        if depth < 1 or handoff < 1:
            raise ConfigError(
                f"pipeline.Prefetcher: depth {depth}, handoff {handoff} (expected >= 1, >= 1)"
            )
        self._produce = produce
        self._timings = timings if timings is not None else Timings()
        self._queue: queue.Queue[object] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._threads = [
            threading.Thread(target=self._run, args=(start,), name="roxxel-loader", daemon=True)
        ]
        self._handoff: queue.Queue[object] | None = None
        if finish is not None:
            self._handoff = queue.Queue(maxsize=handoff)
            self._threads.append(
                threading.Thread(
                    target=self._finish, args=(finish,), name="roxxel-placer", daemon=True
                )
            )
        for thread in self._threads:
            thread.start()

    def get(self) -> tuple[int, object] | None:
        """The next ``(step, item)``; None once the stream ended or after ``close``."""
        began = time.perf_counter()
        try:
            return self._get()
        finally:
            self._timings.add("wait_producer", time.perf_counter() - began)
            self._timings.num_taken += 1

    def _get(self) -> tuple[int, object] | None:
        while not self._done:
            try:
                entry = self._queue.get(timeout=0.1)
            except queue.Empty:
                if not self._threads[-1].is_alive() and self._queue.empty():
                    self._done = True  # the thread always enqueues its end; belt and braces
                continue
            if entry is _END:
                self._done = True
            elif isinstance(entry, _Failure):
                self.close()
                raise entry.error
            else:
                step, item = cast(tuple[int, object], entry)
                del entry
                try:
                    return step, _result(item)
                except concurrent.futures.CancelledError:  # closed from another thread
                    self._done = True
                except BaseException:
                    self.close()
                    raise
        return None

    def close(self) -> None:
        """Stop producing, drop what is queued, join the threads."""
        self._done = True
        self._stop.set()
        if threading.current_thread() in self._threads:
            return  # closed from inside produce (a transform dropped its owner): it exits now
        for thread in self._threads:
            while thread.is_alive():
                self._drain()
                thread.join(timeout=0.05)
        self._drain()

    @property
    def alive(self) -> bool:
        return any(thread.is_alive() for thread in self._threads)

    def _drain(self) -> None:
        for q in (self._handoff, self._queue):
            try:
                while q is not None:
                    q.get_nowait()
            except queue.Empty:
                continue

    def _run(self, step: int) -> None:
        out = self._queue if self._handoff is None else self._handoff
        try:
            while not self._stop.is_set():
                item = self._produce(step)
                if item is None:
                    break
                began = time.perf_counter()
                self._put(out, (step, item))
                if self._handoff is None:
                    self._counted(began)
                del item
                step += 1
            self._put(out, _END)
        except BaseException as error:  # handed to the consumer, never dropped
            self._put(out, _Failure(error))

    def _finish(self, finish: Callable[[int, Any], object]) -> None:
        handoff = cast(queue.Queue, self._handoff)
        while not self._stop.is_set():
            try:
                entry = handoff.get(timeout=0.1)
            except queue.Empty:
                continue
            if entry is _END or isinstance(entry, _Failure):
                self._put(self._queue, entry)
                return
            step, item = cast(tuple[int, object], entry)
            del entry
            try:
                done = finish(step, _result(item))
            except BaseException as error:  # handed to the consumer, never dropped
                self._put(self._queue, _Failure(error))
                return
            del item
            began = time.perf_counter()
            self._put(self._queue, (step, done))
            self._counted(began)
            del done

    def _counted(self, began: float) -> None:
        self._timings.add("wait_consumer", time.perf_counter() - began)
        self._timings.num_batches += 1

    def _put(self, out: queue.Queue[object], entry: object) -> None:
        while not self._stop.is_set():
            try:
                out.put(entry, timeout=0.1)
                return
            except queue.Full:
                continue


@dataclasses.dataclass(frozen=True, slots=True)
class LoaderStats:
    """Where a loader's time went, in seconds per batch (means since it started).

    Attributes:
        num_batches: batches the pipeline produced.
        gather_s: reading the rows into the host buffer (page faults included).
        transform_s: the host transform. With ``host_threads`` these two are thread time:
            their sum may exceed the wall time of a batch.
        place_s: placement: dispatching the host-to-device copies (and a device transform),
            not waiting for them.
        wait_consumer_s: the pipeline waiting for room in the queue: the consumer (the
            model's step) is slower than the loader.
        wait_producer_s: the consumer waiting for a batch (per batch it took): the loader is
            slower than the consumer.
    """

    num_batches: int
    gather_s: float
    transform_s: float
    place_s: float
    wait_consumer_s: float
    wait_producer_s: float

    @property
    def bottleneck(self) -> str:
        """ "loader" when the consumer waited on batches more than the pipeline waited on
        the consumer, else "consumer"."""
        return "loader" if self.wait_producer_s > self.wait_consumer_s else "consumer"


Spent = Literal["gather", "transform", "place", "wait_consumer", "wait_producer"]


class Timings:
    """Running totals behind `LoaderStats`, added to by the loader's threads (the host
    threads of `LoaderConfig.host_threads` add at once) and read by any."""

    def __init__(self) -> None:
        self.num_batches = 0
        self.num_taken = 0
        self.totals: dict[Spent, float] = dict.fromkeys(
            ("gather", "transform", "place", "wait_consumer", "wait_producer"), 0.0
        )
        self._lock = threading.Lock()

    def add(self, what: Spent, seconds: float) -> None:
        with self._lock:
            self.totals[what] += seconds

    def stats(self) -> LoaderStats:
        made, taken = max(self.num_batches, 1), max(self.num_taken, 1)
        t = self.totals
        return LoaderStats(
            self.num_batches,
            t["gather"] / made,
            t["transform"] / made,
            t["place"] / made,
            t["wait_consumer"] / made,
            t["wait_producer"] / taken,
        )
