"""The loader's host pipeline: reusable host buffers and a prefetch thread.

Two pieces, both independent of files, order and devices:

- `BufferPool` hands out preallocated, 64-byte aligned host batches and takes a buffer back
  only once nothing references the batch built in it any more: not the consumer, not a
  transform, and not JAX (on CPU `jax.device_put` aliases aligned numpy memory and keeps a
  reference to the numpy object it aliases until its device buffer is freed).
- `Prefetcher` runs ``produce(step)`` for consecutive steps in one background thread, into a
  bounded queue; ``get`` re-raises the thread's exception, with its traceback, in the
  consumer, and ``close`` joins the thread.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import queue
import threading
import weakref
from collections.abc import Callable, Mapping

import numpy as np

from roxxel.errors import ConfigError

__all__ = ["ALIGN", "BufferPool", "Prefetcher", "RowSpec"]

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

    Thread-safety: ``acquire`` from one thread; releases may come from any thread, even from
    inside garbage collection (a lock-free deque, no callbacks into user code).
    """

    def __init__(self, layout: RowSpec, num_rows: int, keep: int = 4) -> None:
        if num_rows < 0 or keep < 1:
            raise ConfigError(
                f"pipeline.BufferPool: rows {num_rows}, keep {keep} (expected >= 0, >= 1)"
            )
        self.layout = layout
        self.num_rows = num_rows
        self._keep = keep
        self._offsets, self._nbytes = _offsets(layout, num_rows)
        self._free: collections.deque[np.ndarray] = collections.deque()
        self.num_allocated = 0

    def acquire(self) -> dict[str, np.ndarray]:
        """A batch of writable arrays (rows first) over a buffer nobody else references."""
        try:
            raw = self._free.popleft()
        except IndexError:
            raw = self._allocate()
        lease = raw.view(_Lease)
        weakref.finalize(lease, self._release, raw).atexit = False
        batch = {}
        for (name, shape, dtype), offset in zip(self.layout.fields, self._offsets, strict=True):
            size = self.num_rows * math.prod(shape) * dtype.itemsize
            # slicing the lease (not np.ndarray(buffer=...), which bases on the raw block)
            # keeps it in every derived array's chain of bases
            view = lease[offset : offset + size].view(dtype).reshape((self.num_rows, *shape))
            batch[name] = view.view(np.ndarray)
        return batch

    def _allocate(self) -> np.ndarray:
        block = np.empty(self._nbytes + ALIGN, np.uint8)
        start = -block.ctypes.data % ALIGN
        self.num_allocated += 1
        return block[start : start + self._nbytes]

    def _release(self, raw: np.ndarray) -> None:
        if len(self._free) < self._keep:
            self._free.append(raw)


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

    Thread-safety: one consumer thread. ``close`` is idempotent and joins the thread; the
    thread holds no reference to whoever owns the Prefetcher, so owners can close it from
    ``__del__``.
    """

    def __init__(self, produce: Callable[[int], object | None], start: int, depth: int) -> None:
        if depth < 1:
            raise ConfigError(f"pipeline.Prefetcher: depth ({depth}, expected >= 1)")
        self._produce = produce
        self._queue: queue.Queue[object] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(
            target=self._run, args=(start,), name="roxxel-loader", daemon=True
        )
        self._thread.start()

    def get(self) -> tuple[int, object] | None:
        """The next ``(step, item)``; None once the stream ended or after ``close``."""
        while not self._done:
            try:
                entry = self._queue.get(timeout=0.1)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
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
        """Stop producing, drop what is queued, join the thread."""
        self._done = True
        self._stop.set()
        if threading.current_thread() is self._thread:
            return  # closed from inside produce (a transform dropped its owner): it exits now
        while self._thread.is_alive():
            self._drain()
            self._thread.join(timeout=0.05)
        self._drain()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _drain(self) -> None:
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            return

    def _run(self, step: int) -> None:
        try:
            while not self._stop.is_set():
                item = self._produce(step)
                if item is None:
                    break
                self._put((step, item))
                del item
                step += 1
            self._put(_END)
        except BaseException as error:  # handed to the consumer, never dropped
            self._put(_Failure(error))

    def _put(self, entry: object) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=0.1)
                return
            except queue.Full:
                continue
