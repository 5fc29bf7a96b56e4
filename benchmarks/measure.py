"""Timing, memory and page-cache helpers shared by every worker (stdlib + numpy only).

A worker is one process measuring one workload of one system; it reports through `emit`, one
JSON line on stdout that the driver (`benchmarks.run`) parses. Memory comes from
``/proc/self/status``: peak resident set (VmHWM) and anonymous resident memory (RssAnon, i.e.
RSS minus file-backed and shared pages).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import datagen as dg

Metric = dict[str, Any]


def write_repeats(params: dict) -> int:
    """Repeats for the write workloads: at least 5 (one write of the small data is ~50 ms,
    so fixed costs such as fsync and page-cache reclaim swing a single run)."""
    return max(5, int(params.get("repeats", 5)))


def slow_repeats(params: dict) -> int:
    """Repeats for the slow workloads (writes, resumes, startup): at most 3."""
    return max(1, min(3, int(params.get("repeats", 3))))


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of `fn` takes (perf_counter)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_rate(fn: Callable[[], object], units: float, repeats: int = 5, warmup: int = 1) -> float:
    """Median of `units / seconds` over `repeats` calls of `fn`, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    return statistics.median(units / max(timed(fn), 1e-9) for _ in range(repeats))


def package_versions(*names: str) -> dict[str, str]:
    """The installed version of each distribution (a worker's `versions`)."""
    from importlib.metadata import version

    return {name: version(name) for name in names}


def read_single_rate(p: dict, num_images: int, image_of: Callable[[int], object]) -> float:
    """Records/s of copying `image_of(i)` into one buffer, for the read_single workload's
    random indices (the same for every system)."""
    idx = dg.random_indices(num_images, int(p.get("count", 20000)), 1).tolist()
    buf = np.empty(dg.IMAGE_SHAPE, np.uint8)

    def one(i: int) -> None:
        buf[...] = image_of(i)

    return items_rate(one, idx, int(p.get("repeats", 5)))


def items_rate(
    fn: Callable[[int], object], items: list[int], repeats: int = 5, budget_s: float = 1.0
) -> float:
    """Median items/s of `fn(item)` over `repeats` passes, each stopping after ~`budget_s`."""
    rates = []
    for _ in range(repeats):
        t0, done = time.perf_counter(), 0
        for chunk in range(0, len(items), 256):
            for i in items[chunk : chunk + 256]:
                fn(i)
            done += len(items[chunk : chunk + 256])
            if time.perf_counter() - t0 > budget_s:
                break
        rates.append(done / (time.perf_counter() - t0))
    return statistics.median(rates)


def median_seconds(fn: Callable[[], object], repeats: int = 5, warmup: int = 0) -> float:
    """Median wall seconds of `repeats` calls of `fn`."""
    for _ in range(warmup):
        fn()
    return statistics.median(timed(fn) for _ in range(repeats))


_PEAK_ANON_KIB = [0]


def _anon_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


def start_anon_sampler(period_s: float = 0.02) -> None:
    """Track the peak of anonymous resident memory (the kernel keeps only the peak RSS)."""

    def loop() -> None:
        while True:
            try:
                _PEAK_ANON_KIB[0] = max(_PEAK_ANON_KIB[0], _anon_kib())
            except OSError:
                return
            time.sleep(period_s)

    threading.Thread(target=loop, name="anon-sampler", daemon=True).start()


def memory() -> dict[str, float]:
    """Peak RSS, current RSS, current and peak anonymous resident memory, in MiB."""
    fields = {"VmHWM": "peak_rss_mib", "VmRSS": "rss_mib", "RssAnon": "anon_mib"}
    out: dict[str, float] = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in fields:
                out[fields[key]] = round(int(rest.split()[0]) / 1024, 1)
    except OSError:
        pass
    try:
        peak_anon = max(_PEAK_ANON_KIB[0], _anon_kib())
        out["peak_anon_mib"] = round(peak_anon / 1024, 1)
    except OSError:
        pass
    try:  # worker processes a system started (grain mp_prefetch, torch DataLoader workers)
        import resource

        kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        if kids:
            out["children_peak_rss_mib"] = round(kids, 1)
    except (ImportError, OSError):
        pass
    return out


def drop_cache(paths: list[Path]) -> bool:
    """Evict files from the page cache with posix_fadvise(DONTNEED); False where unsupported."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            return False
        finally:
            os.close(fd)
    return True


def files_under(root: Path) -> list[Path]:
    """Every regular file below `root` (sorted), for cache eviction and size accounting."""
    return sorted(p for p in Path(root).rglob("*") if p.is_file())


def readahead_kb(path: Path) -> int | None:
    """The block-device readahead (KiB) of the disk holding `path`, or None if unknown."""
    st = os.stat(path)
    base = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    for cand in (
        base / "queue" / "read_ahead_kb",
        base.parent / "queue" / "read_ahead_kb",
        base / ".." / "queue" / "read_ahead_kb",
    ):
        try:
            return int(cand.read_text().strip())
        except (OSError, ValueError):
            continue
    return None


def metric(
    workload: str,
    variant: str,
    value: float | None,
    unit: str,
    *,
    higher_is_better: bool = True,
    notes: str = "",
) -> Metric:
    """One measured number, as a worker reports it."""
    return {
        "workload": workload,
        "variant": variant,
        "value": value,
        "unit": unit,
        "higher_is_better": higher_is_better,
        "notes": notes,
    }


def resume_series(
    workload: str,
    first_batch: Callable[[int], object],
    steps: Iterable[int],
    labels: Callable[[int], str],
    repeats: int = 5,
    notes: str = "",
) -> list[Metric]:
    """Median seconds to the first batch at each step, over at least 5 rounds that visit every
    step in turn (so a busy machine's drift hits all steps alike), after one untimed warm-up."""
    steps = list(steps)
    first_batch(steps[0])
    times: dict[int, list[float]] = {s: [] for s in steps}
    for _ in range(max(repeats, 5)):
        for s in steps:
            times[s].append(timed(lambda s=s: first_batch(s)))
    return [
        metric(
            workload,
            labels(s),
            statistics.median(times[s]),
            "s",
            higher_is_better=False,
            notes=notes,
        )
        for s in steps
    ]


def emit(ok: bool, metrics: list[Metric], versions: dict[str, str], error: str = "") -> None:
    """Print the worker's single JSON result line (the driver reads the last line)."""
    out = {"ok": ok, "metrics": metrics, "memory": memory(), "versions": versions, "error": error}
    sys.stdout.write("\n" + json.dumps(out) + "\n")
    sys.stdout.flush()


def worker_main(
    workloads: dict[str, Callable[[dict], list[Metric]]], versions: Callable[[], dict[str, str]]
) -> int:
    """Entry point of a worker: ``python -m ... WORKLOAD '{json params}'``."""
    name, params = sys.argv[1], json.loads(sys.argv[2] if len(sys.argv) > 2 else "{}")
    start_anon_sampler()
    if name not in workloads:
        emit(False, [], {}, f"unknown workload {name!r} (expected one of {sorted(workloads)})")
        return 2
    try:
        metrics = workloads[name](params)
    except Exception as e:  # a peer's failure is a result row, not a crash of the suite
        tb = traceback.format_exc(limit=3)
        print(tb, file=sys.stderr)
        msg = str(e) if str(e).startswith("not available yet") else f"{type(e).__name__}: {e}"
        emit(False, [], _safe(versions), msg.strip()[:600])
        return 1
    emit(True, metrics, _safe(versions))
    return 0


def _safe(versions: Callable[[], dict[str, str]]) -> dict[str, str]:
    try:
        return versions()
    except Exception as e:  # versions are informative only
        return {"error": f"{type(e).__name__}: {e}"}
