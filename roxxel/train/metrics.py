"""Training metrics: what a step reports, and crash-safe logs of it.

`split_step_output` turns a step's return value into a flat dict of scalar metrics.
`MetricsLogger` writes them to a JSON Lines file and a console progress line.

The training thread only enqueues plain dicts; one background thread writes them. The queue
is bounded, so a stalled disk slows the loop down instead of growing memory, and nothing is
ever dropped. When the loop raises, `MetricsLogger.crash` puts the traceback after every
record already queued, writes this process's crash file, and waits until all of it is on
disk before the exception continues.

Files in the log folder:

- ``metrics.jsonl``: one JSON object per line, ``{"step": 10, "loss": 2.3, "time": ...}``
  for metrics and ``{"event": "preempted", "step": 40, ...}`` for events. Written by
  process 0 only (``is_main``); appended to on resume, after cutting a torn last line (a
  process killed mid-write) back to the last complete one, so every line parses.
- ``crash-p<process>.log``: the traceback of a crash, written by every process.
"""

from __future__ import annotations

import json
import math
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from roxxel.errors import ConfigError

__all__ = ["MetricsLogger", "format_progress", "last_metrics", "split_step_output"]

_STOP = object()


def split_step_output(out: Any) -> tuple[Any, dict[str, Any]]:
    """Splits a step's return value into (new state, flat dict of scalar metrics).

    Accepted: ``(state, loss)``, ``(state, (loss, aux))`` and ``(state, {"loss": loss,
    ...})``; aux may be a scalar or any pytree of scalars (nested names joined with "/").
    Raises `TypeError` for another shape and `ConfigError` for a missing or non-scalar loss.

    >>> state, m = split_step_output((0, (1.5, {"acc": 0.5, "n": {"tokens": 8}})))
    >>> sorted(m.items())
    [('acc', 0.5), ('loss', 1.5), ('n/tokens', 8)]
    """
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(
            f"fit: step returned {type(out).__name__} (expected (state, loss), "
            "(state, (loss, aux)) or (state, {'loss': loss, ...}))"
        )
    state, rest = out
    if isinstance(rest, Mapping):
        if "loss" not in rest:
            raise ConfigError(
                f"fit: step metrics lack 'loss' (keys {sorted(rest)}, expected a 'loss' key)"
            )
        flat = _flatten(rest, "")
        metrics = {"loss": flat.pop("loss"), **flat}
    elif isinstance(rest, tuple) and len(rest) == 2:
        aux = rest[1]
        metrics = {"loss": rest[0], **_flatten(aux, "" if isinstance(aux, Mapping) else "aux")}
    else:
        metrics = {"loss": rest}
    for name, value in metrics.items():
        if np.ndim(value) != 0:
            raise ConfigError(
                f"fit: metric {name!r} is not a scalar (shape {np.shape(value)}, expected ())"
            )
    return state, metrics


def _flatten(tree: Any, prefix: str) -> dict[str, Any]:
    """Leaves of nested dicts, lists and tuples by path ("a/b", "aux/0"); None has none."""
    if tree is None:
        return {}
    if isinstance(tree, Mapping):
        items = sorted((str(k), v) for k, v in tree.items())
    elif isinstance(tree, list | tuple):
        items = [(str(i), v) for i, v in enumerate(tree)]
    else:
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in items:
        out.update(_flatten(value, f"{prefix}/{key}" if prefix else key))
    return out


def format_progress(record: Mapping[str, Any], num_steps: int | None, rate: float | None) -> str:
    """The one-line console summary of a metrics record.

    >>> format_progress({"step": 10, "loss": 2.5, "acc": 0.25, "time": 0.0}, 100, 12.5)
    'step 10/100  loss 2.5000  acc 0.2500  12.5 steps/s'
    """
    step = f"step {record['step']}" + (f"/{num_steps}" if num_steps else "")
    values = [
        f"{name} {_short(value)}"
        for name, value in record.items()
        if name not in ("step", "time", "event")
    ]
    speed = [f"{rate:.1f} steps/s"] if rate is not None else []
    return "  ".join([step, *values, *speed])


def _short(value: Any) -> str:
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.4f}"
    return str(value)


_TAIL_BYTES = 1 << 16


def _cut_torn_line(path: Path) -> int:
    """Truncates `path` after its last newline; returns the bytes dropped (0: none, no file).

    Reads only the tail: a torn line is at most one record long.
    """
    try:
        f = open(path, "r+b")  # noqa: SIM115 -- closed below
    except FileNotFoundError:
        return 0
    with f:
        size = f.seek(0, os.SEEK_END)
        end = size
        while end > 0:
            start = max(0, end - _TAIL_BYTES)
            f.seek(start)
            newline = f.read(end - start).rfind(b"\n")
            if newline >= 0:
                end = start + newline + 1
                break
            end = start
        if end < size:
            f.truncate(end)
        return size - end


def last_metrics(path: str | os.PathLike[str]) -> tuple[int, dict[str, float]] | None:
    """The step and metrics of the last metrics record in a ``metrics.jsonl``, or None.

    Reads the file from the end; events and unreadable lines are passed over.
    """
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - _TAIL_BYTES))
            tail = f.read()
    except FileNotFoundError:
        return None
    for line in reversed(tail.splitlines()):
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a torn or partial first line of the tail
        if isinstance(record, dict) and "event" not in record and "step" in record:
            step = record.pop("step")
            record.pop("time", None)
            return step, record
    return None


class MetricsLogger:
    """Writes metrics and events from a background thread; flushes everything on a crash.

    Thread-safety: `log`, `event` and `crash` may be called from any thread. `log` blocks
    while the queue is full (backpressure, never loss). A context manager: an exception
    leaving the block is recorded with `crash` before it propagates, and the thread is
    always joined. An error inside the writer thread (e.g. a full disk) is raised by the
    next `log`, `event` or `close`.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        process_index: int = 0,
        console: TextIO | None = sys.stderr,
        num_steps: int | None = None,
        queue_size: int = 1024,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process_index = process_index
        self.is_main = process_index == 0
        self.path = self.directory / "metrics.jsonl"
        self.crash_path = self.directory / f"crash-p{process_index}.log"
        self._console = console if self.is_main else None
        self._num_steps = num_steps
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self._error: BaseException | None = None
        self._last: tuple[int, float] | None = None
        self._closed = False
        self._crashed: BaseException | None = None
        # Opened here, so a bad path raises in the caller rather than killing the thread.
        num_torn = _cut_torn_line(self.path) if self.is_main else 0
        file = open(self.path, "a", encoding="utf-8") if self.is_main else None  # noqa: SIM115
        self._thread = threading.Thread(
            target=self._run, args=(file,), name="roxxel-metrics", daemon=True
        )
        self._thread.start()
        if num_torn:
            message = (
                f"roxxel: {self.path} ended with a torn line ({num_torn} bytes, "
                "a process killed mid-write); dropped it before appending"
            )
            self.event("repaired", None, message, num_bytes=num_torn)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Queues the metrics of `step` (plain Python numbers) for the file and console."""
        self._put({"step": int(step), **metrics, "time": time.time()})

    def event(self, name: str, step: int | None, message: str = "", **fields: Any) -> None:
        """Queues an event record; `message`, if given, is also printed on the console."""
        at = None if step is None else int(step)
        record = {"event": name, "step": at, **fields, "time": time.time()}
        if message:
            record["message"] = message
        self._put(record)

    def crash(self, exc: BaseException, step: int | None = None) -> None:
        """Records `exc` with its traceback, then waits until everything queued is written.

        Every process writes its own crash file (synchronously, first, so it exists even
        if the writer thread is stuck); process 0 also adds a ``crash`` event to the log.
        Recording the same exception again (e.g. on leaving the ``with`` block) is a no-op.
        """
        if exc is self._crashed:
            return
        self._crashed = exc
        text = "".join(traceback.format_exception(exc))
        with open(self.crash_path, "a", encoding="utf-8") as f:
            f.write(f"step {step}: {text}")
        record = {"event": "crash", "step": step, "error": repr(exc), "traceback": text}
        self._queue.put({**record, "time": time.time()})
        self.flush()

    def flush(self) -> None:
        """Blocks until every record queued so far is written to disk."""
        if self._thread.is_alive():
            self._queue.join()

    def close(self) -> None:
        """Writes everything queued, stops the thread. Idempotent."""
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
            self._thread.join()
        self._raise_writer_error()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        try:
            if exc is not None:
                self.crash(exc)
        finally:
            self.close()

    def _put(self, record: dict[str, Any]) -> None:
        self._raise_writer_error()
        self._queue.put(record)

    def _raise_writer_error(self) -> None:
        if self._error is not None:
            raise OSError(f"MetricsLogger: writing {self.path} failed") from self._error

    def _run(self, file: TextIO | None) -> None:
        try:
            while self._write_available(file):
                pass
        finally:
            if file is not None:
                file.close()

    def _write_available(self, file: TextIO | None) -> bool:
        """Writes one blocking record and whatever else is queued; False after the stop."""
        records = [self._queue.get()]
        while True:
            try:
                records.append(self._queue.get_nowait())
            except queue.Empty:
                break
        keep_going = True
        try:
            for record in records:
                if record is _STOP:
                    keep_going = False
                elif self._error is None:
                    self._write(file, record)
            if file is not None and self._error is None:
                file.flush()
        except Exception as exc:  # kept and raised in the caller's thread by the next call
            self._error = exc
        finally:
            for _ in records:
                self._queue.task_done()
        return keep_going

    def _write(self, file: TextIO | None, record: dict[str, Any]) -> None:
        if file is not None:
            file.write(json.dumps(record, allow_nan=True) + "\n")
        if self._console is None:
            return
        if record.get("event") == "crash":
            at = "" if record["step"] is None else f" at step {record['step']}"
            self._console.write(f"crashed{at}: {record['error']}\n")
        elif "event" in record:
            if not record.get("message"):
                return
            self._console.write(record["message"] + "\n")
        else:
            self._console.write(format_progress(record, self._num_steps, self._rate(record)) + "\n")
        self._console.flush()

    def _rate(self, record: Mapping[str, Any]) -> float | None:
        last, self._last = self._last, (record["step"], record["time"])
        if last is None or record["time"] <= last[1] or record["step"] <= last[0]:
            return None
        return (record["step"] - last[0]) / (record["time"] - last[1])
