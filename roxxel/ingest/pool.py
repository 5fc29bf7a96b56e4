"""Pack work units in this process and N - 1 worker processes, taking units from one counter.

Every process (this one included) takes the next unit from a shared counter, packs it with
`pack_unit` and moves on, so the units balance over the processes and this process works
while the others start. Workers report each finished unit as one JSON message on a pipe;
nothing is pickled but the start arguments of a forkserver child.

Workers are forked when that is safe, which costs milliseconds: on Linux, with no other
Python thread running (a progress bar's monitor, say) and no JAX, PyTorch or TensorFlow
loaded. Otherwise a fork could copy a lock that another thread holds and never releases,
so the workers start from a forkserver instead (a fresh interpreter: about 0.3 s). Native
thread pools that handle a fork themselves (OpenBLAS's, under numpy) are not counted.

A worker never outlives the pack: on Linux it asks the kernel to SIGKILL it when its parent
ends (``PR_SET_PDEATHSIG``; the parent is the thread that made the pool, or the forkserver,
which ends with this process), and anywhere it stops when its pipe breaks. It also keeps a
copy of the output directory's locks (``lock_fds``), so the directory stays locked while any
process of the pack lives: an orphan can never write into a directory a new run owns.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from multiprocessing import reduction, resource_tracker
from multiprocessing.connection import Connection, wait
from typing import Any

from roxxel import errors
from roxxel.errors import ConfigError, RoxxelError
from roxxel.ingest.inputs import BadRecords, ReadOptions, WorkUnit
from roxxel.ingest.pack import PackConfig, UnitResult, pack_unit
from roxxel.ingest.tokenize import cores_shared

__all__ = ["START_METHODS", "UnitPool", "interrupts_held", "start_method"]

JOIN_SECONDS = 60.0  # a stopped worker ends its current unit first
START_SECONDS = 120.0  # a new worker (a fresh interpreter under load) says it runs by then
FORK_UNSAFE = ("jax", "torch", "tensorflow")  # their thread pools do not survive a fork
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
START_METHODS = ("auto", "fork", "forkserver", "spawn")


def start_method() -> str:
    """``fork`` on Linux when no other Python thread runs and no runtime that forbids forks
    (JAX, PyTorch, TensorFlow) is loaded; else ``forkserver``."""
    if sys.platform != "linux" or threading.active_count() > 1:
        return "forkserver"
    return "forkserver" if any(m in sys.modules for m in FORK_UNSAFE) else "fork"


class UnitPool:
    """Packs ``units`` with ``workers`` processes in all; iterate `results` as units end.

    The worker processes start in the constructor: make the pool before starting threads
    (a progress bar, say) so that they can be forked. ``method`` "auto" picks
    `start_method`; "fork", "forkserver" or "spawn" overrule it (the caller vouches that
    its threads survive a fork). ``lock_fds``, the output directory's locks
    (`roxxel.ingest.parts.PackLock.fds`), are held by every worker too. Use it as a context
    manager; leaving it early stops the workers after their current unit (finished units
    are kept).
    """

    def __init__(
        self,
        config: PackConfig,
        units: list[WorkUnit],
        workers: int,
        method: str = "auto",
        lock_fds: Sequence[int] = (),
    ):
        self.config, self.units, self.lock_fds = config, units, tuple(lock_fds)
        num_procs = max(0, min(workers, len(units)) - 1)
        self.num_processes = num_procs + 1  # each tokenizes with its share of the cores
        if method not in START_METHODS:
            raise ConfigError(f"start method {method!r} (expected one of {START_METHODS})")
        self.method = start_method() if method == "auto" else method
        ctx: Any = multiprocessing.get_context(self.method)
        if ctx.get_start_method() == "forkserver":
            # the workers' template process loads the packer (and the caller's main module,
            # which a --map function may live in) once
            ctx.set_forkserver_preload(["__main__", "roxxel.ingest.pool"])
        self.counter: Any = ctx.Value("q", 0)
        self.pipes: list[Connection] = []
        self.procs: list[Any] = []
        plan = json.dumps([u.to_json() for u in units])
        try:
            with interrupts_held(self.method != "fork"):
                for _ in range(num_procs):
                    self._start(ctx, _config_json(config), plan)
                for pipe in self.pipes:  # up, so a stop now finds them running
                    self._ready(pipe)
        except BaseException:
            self.close()
            raise

    def _start(self, ctx: Any, config_json: str, plan: str) -> None:
        receive, send = ctx.Pipe(duplex=False)
        # a forked child closes its copies of the earlier workers' read ends, so that a
        # worker whose main process is gone finds its pipe broken
        inherited = list(self.pipes) if self.method == "fork" else []
        held = [_HeldFd(fd) for fd in self.lock_fds]
        parent = None if self.method == "forkserver" else os.getpid()
        args = (config_json, plan, self.counter, send, inherited, held, parent, self.num_processes)
        proc = ctx.Process(target=_work, args=args)
        proc.start()
        send.close()
        self.pipes.append(receive)
        self.procs.append(proc)

    def results(self) -> Iterator[UnitResult]:
        """Each unit's result as it ends (this process's units and the workers')."""
        with cores_shared(self.num_processes):
            while (index := _take(self.counter, len(self.units))) is not None:
                yield pack_unit(self.config, self.units[index])
                yield from self._collect(block=False)
        while self.pipes:
            yield from self._collect(block=True)

    def _main_hint(self) -> str:
        """Where workers start by importing the caller's script (not forked), what an
        unguarded top-level `roxxel.pack` there does to them."""
        if self.method == "fork" or "__file__" not in vars(sys.modules["__main__"]):
            return ""
        return (
            "; workers not forked import the main script first, so a script calling "
            'roxxel.pack at its top level needs it under `if __name__ == "__main__":`'
        )

    def _ready(self, pipe: Connection) -> None:
        """Wait for a new worker's first word, that it runs."""
        if not wait([pipe], timeout=START_SECONDS):
            raise RoxxelError(f"pack: a worker process did not start in {START_SECONDS} s")
        try:
            pipe.recv_bytes()
        except EOFError:
            raise self._died() from None

    def _died(self) -> RoxxelError:
        self.stop()
        return RoxxelError(
            "pack: a worker process died; finished work units are kept (expected "
            f"none to die: rerun the same command to resume{self._main_hint()})"
        )

    def _collect(self, block: bool) -> Iterator[UnitResult]:
        for pipe in wait(self.pipes, timeout=None if block else 0):
            assert isinstance(pipe, Connection)
            try:
                message = json.loads(pipe.recv_bytes())
            except EOFError:
                raise self._died() from None
            if "result" in message:
                yield _result_from_json(message["result"])
            elif "error" in message:
                self.stop()
                raise _error_from_json(message)
            else:  # "done": the worker found no unit left
                self.pipes.remove(pipe)
                pipe.close()

    def stop(self) -> None:
        """Let no process take another unit."""
        with self.counter.get_lock():
            self.counter.value = len(self.units)

    def close(self) -> None:
        """Stop taking units and wait for the workers to end their current one."""
        self.stop()
        for proc in self.procs:
            proc.join(JOIN_SECONDS)
            if proc.is_alive():
                proc.terminate()
                proc.join()
        for pipe in self.pipes:
            pipe.close()
        self.pipes, self.procs = [], []

    def __enter__(self) -> UnitPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _take(counter: Any, num_units: int) -> int | None:
    with counter.get_lock():
        index = counter.value
        if index >= num_units:
            return None
        counter.value = index + 1
    return index


def _work(
    config_json: str,
    plan: str,
    counter: Any,
    pipe: Connection,
    inherited: list[Connection],
    held: list[_HeldFd],
    parent: int | None,
    num_processes: int,
) -> None:
    """A worker process: pack units until none is left, reporting each on ``pipe``.

    ``held`` (the output's locks) stay open until the process ends; ``parent`` is the pid
    of the parent process, or None when a forkserver started this one; ``num_processes``
    (the pack's, this one included) share the cores.
    """
    _die_with_parent(parent)
    for other in inherited:
        other.close()
    with contextlib.suppress(BrokenPipeError):
        pipe.send_bytes(b'{"ready": true}')
    units = [WorkUnit.from_json(u) for u in json.loads(plan)]
    try:
        config = _config_from_json(config_json)
        with cores_shared(num_processes):
            while (index := _take(counter, len(units))) is not None:
                result = dataclasses.asdict(pack_unit(config, units[index]))
                pipe.send_bytes(json.dumps({"result": result}).encode())
        pipe.send_bytes(b'{"done": true}')
    except BrokenPipeError:
        pass  # the main process is gone: nothing to report to
    except BaseException as e:  # reported to the main process, which raises it
        with counter.get_lock():
            counter.value = len(units)
        with contextlib.suppress(BrokenPipeError):
            pipe.send_bytes(json.dumps({"error": type(e).__name__, "message": str(e)}).encode())
    finally:
        pipe.close()


class _HeldFd:
    """A file descriptor a worker keeps open for its whole life; pickled (spawn,
    forkserver) as a duplicate sent to the child, inherited as it is by a fork."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _rebuild_held, (reduction.DupFd(self.fd),)


def _rebuild_held(duplicate: Any) -> _HeldFd:
    return _HeldFd(duplicate.detach())


def _die_with_parent(parent: int | None) -> None:
    """Ask Linux to SIGKILL this process when its parent ends (SIGKILL: even a stopped
    process dies); exit now if the parent ended before the request took effect."""
    if sys.platform != "linux":
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent is not None and os.getppid() != parent:
        os._exit(1)


@contextlib.contextmanager
def interrupts_held(hold: bool = True) -> Iterator[None]:
    """A Ctrl-C held back while workers start from a fresh interpreter, then raised: SIGINT
    is blocked in this thread, so they (and a forkserver, which imports roxxel first)
    inherit the mask and never print a traceback of their own, and a SIGINT another thread
    takes is only noted (in the main thread) until every worker runs, so stopping them
    never finds one half started."""
    if not hold:
        yield
        return
    # multiprocessing's resource tracker unblocks SIGINT once it has started (the first
    # lock or queue a pool makes starts it): started now, it leaves the block below alone
    resource_tracker.ensure_running()
    noted: list[int] = []
    main = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGINT, lambda num, _: noted.append(num)) if main else None
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        if main:
            signal.signal(signal.SIGINT, before)
    if noted:
        raise KeyboardInterrupt


def _config_json(config: PackConfig) -> str:
    return json.dumps(dataclasses.asdict(config))


def _config_from_json(text: str) -> PackConfig:
    doc = json.loads(text)
    read = doc["read"]
    columns = None if read["columns"] is None else tuple(read["columns"])
    return PackConfig(**{**doc, "read": ReadOptions(**{**read, "columns": columns})})


def _result_from_json(doc: dict[str, Any]) -> UnitResult:
    return UnitResult(**{**doc, "bad": BadRecords(**doc["bad"])})


def _error_from_json(message: dict[str, str]) -> BaseException:
    """The worker's error as the same roxxel error class, or a RoxxelError naming it."""
    known = (RoxxelError, errors.ConfigError, errors.FormatError, errors.StateError)
    cls = {c.__name__: c for c in known}.get(message["error"])
    if cls is not None:
        return cls(message["message"])
    if message["error"] == "KeyboardInterrupt":
        return KeyboardInterrupt()
    return RoxxelError(f"pack: a worker process raised {message['error']}: {message['message']}")
