"""The loader's host pipeline: reusable host buffers and a prefetch thread.

Two pieces, both independent of files, order and devices:

- `BufferPool` hands out preallocated, 64-byte aligned host batches and takes a buffer back
  only once nothing references the batch built in it any more: not the consumer, not a
  transform, and not JAX (on CPU `jax.device_put` aliases aligned numpy memory and keeps a
  reference to the numpy object it aliases until its device buffer is freed).
- `Prefetcher` runs ``produce(step)`` for consecutive steps in one background thread, into a
  bounded queue; ``get`` re-raises the thread's exception, with its traceback, in the
  consumer, and ``close`` joins the thread.
- `SlicedTransform` runs a host transform over fixed slices of a batch's rows, in the calling
  thread and a small pool of helpers (numpy releases the GIL), with the same result for any
  number of threads.
- `Timings` adds up where each batch's time goes (`LoaderStats` is its summary).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import math
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, cast

import numpy as np

from roxxel.errors import ConfigError
from roxxel.loader.pinned import PAGE_BYTES, Registrar

__all__ = [
    "ALIGN",
    "HOST_SLICES",
    "BufferPool",
    "LoaderStats",
    "Prefetcher",
    "RowSpec",
    "SlicedTransform",
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
    one item waits between the two. The order and the errors are as with one thread.

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
    ) -> None:
        if depth < 1:
            raise ConfigError(f"pipeline.Prefetcher: depth ({depth}, expected >= 1)")
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
            self._handoff = queue.Queue(maxsize=1)
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
                return entry  # type: ignore[return-value]
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
                done = finish(step, item)
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


HOST_SLICES = 8  # a batch's rows in this many fixed slices, whatever the thread count
_HELPER = "roxxel-host"  # the helper threads' name prefix

Batch = dict[str, np.ndarray]


def slice_bounds(num_rows: int) -> list[tuple[int, int]]:
    """The fixed, non-empty [start, stop) row slices a sliced host transform sees.

    >>> slice_bounds(20)[:3], len(slice_bounds(20)), slice_bounds(2), slice_bounds(0)
    ([(0, 2), (2, 5), (5, 7)], 8, [(0, 1), (1, 2)], [(0, 0)])
    """
    edges = sorted({i * num_rows // HOST_SLICES for i in range(HOST_SLICES + 1)})
    return list(itertools.pairwise(edges)) or [(0, 0)]


class SlicedTransform:
    """The host work of a batch over its fixed row slices (`slice_bounds`), in the calling
    thread and ``num_threads - 1`` helpers: ``fill(start, stop, rows)`` (the gather of those
    rows, when given), then ``fn(rows, rng) -> rows`` (the transform, when there is one).

    Each thread takes a contiguous run of slices (`_groups`), reads their rows with one
    ``fill`` call, then transforms each slice with ``rng_for(first_row)`` (the slice's first
    row's global index), so every slice sees the same rows and generator for any number of
    threads and the joined batch is the same. Output fields that are the slice's own input
    arrays (a transform that works in place) stay in the batch buffer; any other output is
    joined with one copy (``np.concatenate``).

    Thread-safety: called from one thread (the pipeline's); ``close`` joins the helpers
    (idempotent; a later call starts new ones).

    Raises:
        ConfigError: the slices return different fields.
        Whatever ``fn`` raises, from the first slice (in row order) that raised, once every
        slice has finished with the batch buffer.
    """

    def __init__(
        self, fn: Callable[[Batch, np.random.Generator], Batch] | None, num_threads: int
    ) -> None:
        self._fn = fn
        self._num_threads = num_threads
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.read_share = 1.0  # of the last batch's thread time, the part spent reading

    def __call__(
        self,
        batch: Batch,
        rows: np.ndarray,
        rng_for: Callable[[int], np.random.Generator],
        fill: Callable[[int, int, Batch], None] | None = None,
    ) -> Batch:
        bounds = slice_bounds(len(rows))
        parts = [{name: array[a:b] for name, array in batch.items()} for a, b in bounds]
        firsts = [int(rows[a]) if a < len(rows) else a for a, _ in bounds]
        outs: list[Batch | None] = [None] * len(parts)
        errors: list[BaseException | None] = [None] * len(parts)
        groups = _groups(len(parts), self._num_threads)
        spent = [[0.0, 0.0] for _ in groups]  # seconds reading, transforming per thread

        def run(thread: int) -> None:
            ks = groups[thread]
            began = time.perf_counter()
            for k in ks:
                try:
                    if fill is not None and k == ks[0]:  # the thread's rows in one read
                        start, stop = bounds[ks[0]][0], bounds[ks[-1]][1]
                        fill(start, stop, {n: a[start:stop] for n, a in batch.items()})
                        spent[thread][0] = time.perf_counter() - began
                    fn = self._fn
                    outs[k] = parts[k] if fn is None else fn(parts[k], rng_for(firsts[k]))
                except BaseException as error:  # re-raised below, in slice order
                    errors[k] = error
            spent[thread][1] = time.perf_counter() - began - spent[thread][0]

        helpers = [self._helpers().submit(run, t) for t in range(1, len(groups))]
        run(0)
        concurrent.futures.wait(helpers)
        reading, transforming = (sum(column) for column in zip(*spent, strict=True))
        self.read_share = reading / max(reading + transforming, 1e-12)
        first_error = next((e for e in errors if e is not None), None)
        if first_error is not None:
            raise first_error
        if self._fn is None:
            return batch
        return _join(batch, parts, cast(list[Batch], outs), bounds)

    def _helpers(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=max(1, self._num_threads - 1), thread_name_prefix=_HELPER
            )
        return self._pool

    def close(self) -> None:
        """Join the helper threads (from one of them, as when garbage collection there
        drops the loader: stop them without joining, they exit once idle)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=not threading.current_thread().name.startswith(_HELPER))


def _groups(num_slices: int, num_threads: int) -> list[list[int]]:
    """Contiguous runs of slices, one per thread (at most one thread per slice).

    >>> _groups(8, 3), _groups(2, 4)
    ([[0, 1], [2, 3, 4], [5, 6, 7]], [[0], [1]])
    """
    n = min(num_slices, num_threads)
    return [list(range(t * num_slices // n, (t + 1) * num_slices // n)) for t in range(n)]


def _join(
    batch: Batch, parts: Sequence[Batch], outs: Sequence[Batch], bounds: Sequence[tuple[int, int]]
) -> Batch:
    names = list(outs[0])
    for out, (a, b) in zip(outs, bounds, strict=True):
        if list(out) != names:
            raise ConfigError(
                f"loader: host_transform fields for rows [{a}, {b}) ({sorted(out)}, expected "
                f"{sorted(names)}, the fields of the first slice)"
            )
    joined = {}
    for name in names:
        arrays = [out[name] for out in outs]
        in_place = all(a is part.get(name) for a, part in zip(arrays, parts, strict=True))
        if in_place:
            joined[name] = batch[name]
        else:
            joined[name] = np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
    return joined


@dataclasses.dataclass(frozen=True, slots=True)
class LoaderStats:
    """Where a loader's time went, in seconds per batch (means since it started).

    Attributes:
        num_batches: batches the pipeline produced.
        gather_s: reading the rows into the host buffer (page faults included).
        transform_s: the host transform.
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
    """Running totals behind `LoaderStats`. Each total is written by one thread (the
    pipeline's, or the consumer's for ``wait_producer``) and read by any: float adds under
    the GIL, no lock."""

    def __init__(self) -> None:
        self.num_batches = 0
        self.num_taken = 0
        self.totals: dict[Spent, float] = dict.fromkeys(
            ("gather", "transform", "place", "wait_consumer", "wait_producer"), 0.0
        )

    def add(self, what: Spent, seconds: float) -> None:
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
