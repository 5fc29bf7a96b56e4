"""How small a numpy call can be and still gain from a second thread on this machine.

Two free-running threads each make in-place ``np.add`` passes over an array of their own
(numpy releases the GIL for the add, and takes it back after), against one thread doing
both arrays' passes. When one call lasts about as long as handing the GIL from one thread
to the other, the second thread gains nothing. This is why `LoaderConfig(host_threads=N)`
gives each thread whole batches, not slices of one (`docs/loading.md`).

    python -m benchmarks.gil_handoff [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np

SIZES_KIB = (96, 384, 1536)  # one eighth, one slice of 3 MiB, half of 3 MiB
PASSES = 3


def _passes(array: np.ndarray, calls: int) -> None:
    for _ in range(calls // PASSES):
        for _ in range(PASSES):
            np.add(array, 1, out=array)


def speedup(kib: int, calls: int) -> tuple[float, float]:
    """(microseconds per call in one thread, two threads' speedup over one)."""
    arrays = [np.zeros(kib << 10, np.uint8) for _ in range(2)]
    t0 = time.perf_counter()
    for array in arrays:
        _passes(array, calls)
    one = time.perf_counter() - t0
    threads = [threading.Thread(target=_passes, args=(a, calls)) for a in arrays]
    t0 = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    two = time.perf_counter() - t0
    return 1e6 * one / (2 * calls), one / two


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=9000)
    args = parser.parse_args()
    print("| call size | us per call (1 thread) | 2 threads / 1, per repeat | median |")
    print("|---:|---:|---|---:|")
    for kib in SIZES_KIB:
        runs = [speedup(kib, args.calls) for _ in range(args.repeats)]
        ratios = [r for _, r in runs]
        print(
            f"| {kib} KiB | {statistics.median(u for u, _ in runs):.0f} | "
            f"{', '.join(f'{r:.2f}x' for r in ratios)} | {statistics.median(ratios):.2f}x |"
        )


if __name__ == "__main__":
    main()
