"""Megatron-style greedy blend index, the baseline for resuming a mixture.

Megatron builds, before the first batch, two arrays over every sample of the run: the source of
sample i (int16) and its index within that source (int64), choosing at each i the source with
the largest error ``w_d * max(i, 1) - count_d``. This is that loop, compiled here as C through
ctypes when a C compiler is at hand (as Megatron's own helper is C++), else run in numpy.

>>> src, idx = build_blend_index([0.5, 0.25, 0.25], 8)
>>> src.tolist(), idx.tolist()
([0, 1, 2, 0, 0, 1, 2, 0], [0, 0, 0, 1, 2, 1, 1, 3])
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
from pathlib import Path

import numpy as np

_C = r"""
#include <stdint.h>
void blend(const double *w, int32_t k, int64_t n, int16_t *src, int64_t *idx, int64_t *count) {
    for (int64_t i = 0; i < n; ++i) {
        double t = i > 1 ? (double)i : 1.0;
        int32_t best = 0;
        double best_err = w[0] * t - (double)count[0];
        for (int32_t d = 1; d < k; ++d) {
            double err = w[d] * t - (double)count[d];
            if (err > best_err) { best_err = err; best = d; }
        }
        src[i] = (int16_t)best;
        idx[i] = count[best]++;
    }
}
"""
_WORK = Path(__file__).resolve().parent / ".work"


def _compiled():
    """The C loop as a ctypes function, or None without a compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    lib = _WORK / f"blend-{hashlib.sha256(_C.encode()).hexdigest()[:12]}.so"
    if not lib.exists():
        _WORK.mkdir(parents=True, exist_ok=True)
        src = lib.with_suffix(".c")
        src.write_text(_C)
        try:
            subprocess.run(
                [cc, "-O2", "-shared", "-fPIC", str(src), "-o", str(lib)],
                check=True,
                capture_output=True,
            )
        except (OSError, subprocess.CalledProcessError):
            return None
    return ctypes.CDLL(str(lib)).blend


def build_blend_index(weights: list[float], n: int) -> tuple[np.ndarray, np.ndarray]:
    """(source per sample int16, index within its source int64) for `n` samples."""
    w = np.asarray(weights, np.float64) / float(np.sum(weights))
    src, idx = np.empty(n, np.int16), np.empty(n, np.int64)
    count = np.zeros(len(w), np.int64)
    fn = _compiled()
    if fn is not None:
        ptr = np.ctypeslib.as_ctypes
        fn(ptr(w), ctypes.c_int32(len(w)), ctypes.c_int64(n), ptr(src), ptr(idx), ptr(count))
        return src, idx
    for i in range(n):  # numpy fallback, much slower
        best = int(np.argmax(w * max(i, 1) - count))
        src[i], idx[i] = best, count[best]
        count[best] += 1
    return src, idx


def is_compiled() -> bool:
    """Whether `build_blend_index` runs the compiled loop."""
    return _compiled() is not None
