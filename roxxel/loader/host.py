"""The loader's host pipeline: reusable host buffers and a prefetch thread.

Two pieces, both independent of files, order and devices:

- `BufferPool` hands out preallocated, 64-byte aligned host batches and takes a buffer back
  only once nothing references the batch built in it any more: not the consumer, not a
  transform, and not JAX (on CPU `jax.device_put` aliases aligned numpy memory and keeps a
  reference to the numpy object it aliases until its device buffer is freed).
- `Prefetcher` makes the items of consecutive steps in one or more background threads, into
  bounded queues, handed over in step order; ``get`` re-raises a thread's exception, with
  its traceback, in the consumer, and ``close`` joins the threads.
- `Timings` adds up where each batch's time goes (`LoaderStats` is its summary).
"""

from __future__ import annotations

import collections
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
from roxxel.format.cache import stoppable_waits
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


class _Channel:
    """A bounded FIFO between threads whose every wait is one C call: items and free
    places are two `queue.SimpleQueue`s (a `queue.Queue` runs a Python condition per put
    and get, which holds the GIL the host threads' numpy calls let go of)."""

    def __init__(self, size: int) -> None:
        self._items: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._room: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(size):
            self._room.put(None)

    def put(self, item: object, timeout: float) -> None:
        """Raises `queue.Empty` when no place was free within ``timeout`` seconds."""
        self._room.get(timeout=timeout)
        self._items.put(item)

    def get(self, timeout: float) -> object:
        """Raises `queue.Empty` when nothing came within ``timeout`` seconds."""
        item = self._items.get(timeout=timeout)
        self._room.put(None)
        return item

    def get_nowait(self) -> object:
        item = self._items.get_nowait()
        self._room.put(None)
        return item

    def empty(self) -> bool:
        return self._items.empty()


class _Failure:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()


class Prefetcher:
    """Makes the items of step = start, start + 1, ... ahead of the consumer, in background
    threads.

    ``begin(step)`` returns None when the stream has ended, else the step's job: a callable
    that makes its item. ``begin`` runs in step order, one call at a time; the jobs run in
    ``threads`` producer threads: a thread that is free takes the next step (it calls
    ``begin``, then runs the job while the others run theirs), so a thread never waits on
    another's slower job to start its next one. Each item goes straight to the consumer (the
    loader's host threads: no thread in between). At most ``depth + threads`` steps are
    begun and not yet taken. ``get`` returns ``(step, item)`` in step order, None at the
    end, and raises the exception ``begin`` or a job raised (the original object, with its
    traceback), at the step it was raised for.

    With ``finish``, one more thread turns each item into ``finish(step, item)``, in step
    order, while the producers make the next ones (the loader's gather and its host-to-device
    copies overlap); up to ``handoff`` items wait between them.

    Thread-safety: one consumer thread. ``close`` is idempotent and joins the threads; they
    hold no reference to whoever owns the Prefetcher, so owners can close it from
    ``__del__``. A job waiting for a shard's download stops waiting on ``close``
    (`roxxel.format.cache.stoppable_waits`): a close never waits on the network.
    """

    def __init__(
        self,
        begin: Callable[[int], Callable[[], object] | None],
        start: int,
        depth: int,
        timings: Timings | None = None,
        finish: Callable[[int, Any], object] | None = None,
        handoff: int = 1,
        threads: int = 1,
    ) -> None:
        if depth < 1 or handoff < 1 or threads < 1:
            raise ConfigError(
                f"pipeline.Prefetcher: depth {depth}, handoff {handoff}, threads {threads}"
                " (expected >= 1 each)"
            )
        self._begin = begin
        self._timings = timings if timings is not None else Timings()
        self._stop = threading.Event()
        self._done = False
        self._turn = threading.Lock()  # held around begin: one call at a time, in step order
        self._next = start  # the step the next free producer begins (under _turn)
        self._over = False  # begin's stream ended, or a step failed: begin no further
        # a place per step begun and not yet taken: step s's entry goes to slot s % n, and a
        # producer takes a place before it begins a step, so those steps' slots all differ
        num_slots = (depth if finish is None else handoff) + threads
        self._slots: list[queue.SimpleQueue[object]] = [
            queue.SimpleQueue() for _ in range(num_slots)
        ]
        self._room: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(num_slots):
            self._room.put(None)
        self._taken = start  # the step taken next (by get, or by the finishing thread)
        self._queue: _Channel | None = None  # finish's output
        names = ["roxxel-loader"] if threads == 1 else [f"roxxel-host-{i}" for i in range(threads)]
        self._producers = [
            threading.Thread(target=self._run, name=name, daemon=True) for name in names
        ]
        self._threads = list(self._producers)
        if finish is not None:
            self._queue = _Channel(depth)
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
            self._timings.taken(time.perf_counter() - began)

    def _get(self) -> tuple[int, object] | None:
        if self._done:
            return None
        entry = self._take() if self._queue is None else self._take_finished()
        if entry is _END:
            self._done = True
            return None
        if isinstance(entry, _Failure):
            self.close()
            raise entry.error
        return cast(tuple[int, object], entry)

    def _take(self) -> object:
        """The next step's entry from the producers; _END once they are gone."""
        slot = self._slots[self._taken % len(self._slots)]
        while True:
            try:
                entry = slot.get(timeout=0.1)
            except queue.Empty:
                gone = not any(p.is_alive() for p in self._producers)
                if self._stop.is_set() or (gone and slot.empty()):
                    return _END  # a producer always hands over the end; belt and braces
                continue
            self._taken += 1
            self._room.put(None)
            return entry

    def _take_finished(self) -> object:
        out = cast(_Channel, self._queue)
        while True:
            try:
                return out.get(timeout=0.1)
            except queue.Empty:
                if self._stop.is_set() or (not self._threads[-1].is_alive() and out.empty()):
                    return _END
                continue

    def close(self) -> None:
        """Stop producing, drop what is queued, join the threads."""
        self._done = True
        self._stop.set()
        if threading.current_thread() in self._threads:
            return  # closed from inside a job (a transform dropped its owner): it exits now
        for thread in self._threads:
            while thread.is_alive():
                self._drain()
                thread.join(timeout=0.05)
        self._drain()

    @property
    def alive(self) -> bool:
        return any(thread.is_alive() for thread in self._threads)

    def _drain(self) -> None:
        for q in (*self._slots, self._queue):
            try:
                while q is not None:
                    q.get_nowait()
            except queue.Empty:
                continue

    def _run(self) -> None:
        with stoppable_waits(self._stop):  # close does not wait for a shard's download
            while self._produce_one():
                pass

    def _produce_one(self) -> bool:
        """Take a place, begin the next step and run its job; False once there is none
        (the end, a failure, or a stop). Errors go to the consumer at their step, never
        dropped."""
        began = time.perf_counter()
        while True:  # a place: a step taken by the consumer (or the first ones)
            try:
                self._room.get(timeout=0.1)
                break
            except queue.Empty:
                if self._stop.is_set() or self._over:
                    return False
        waited = time.perf_counter() - began
        with self._turn:
            if self._over or self._stop.is_set():
                return False
            step = self._next
            self._next += 1
            slot = self._slots[step % len(self._slots)]
            try:
                job = self._begin(step)
            except BaseException as error:
                self._over = True
                slot.put(_Failure(error))
                return False
            if job is None:
                self._over = True
                slot.put(_END)
                return False
        try:
            item = job()
        except BaseException as error:
            self._over = True  # the other producers begin no further step
            slot.put(_Failure(error))
            return False
        del job
        slot.put((step, item))
        if self._queue is None:
            self._timings.made(waited)
        return True

    def _finish(self, finish: Callable[[int, Any], object]) -> None:
        out = cast(_Channel, self._queue)
        while not self._stop.is_set():
            entry = self._take()
            if entry is _END or isinstance(entry, _Failure):
                self._put(out, entry)
                return
            step, item = cast(tuple[int, object], entry)
            del entry
            try:
                done = finish(step, item)
            except BaseException as error:  # handed to the consumer, never dropped
                self._put(out, _Failure(error))
                return
            del item
            began = time.perf_counter()
            self._put(out, (step, done))
            self._timings.made(time.perf_counter() - began)
            del done

    def _put(self, out: _Channel, entry: object) -> None:
        while not self._stop.is_set():
            try:
                out.put(entry, timeout=0.1)
                return
            except queue.Empty:
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

    def made(self, waited: float) -> None:
        """A batch produced, after ``waited`` seconds for room in the queue (several
        producer threads count at once)."""
        with self._lock:
            self.totals["wait_consumer"] += waited
            self.num_batches += 1

    def taken(self, waited: float) -> None:
        """A batch taken by the consumer, after ``waited`` seconds for it."""
        with self._lock:
            self.totals["wait_producer"] += waited
            self.num_taken += 1

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
