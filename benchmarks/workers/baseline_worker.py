"""Baselines: machine limits and Megatron's `.bin`/`.idx` layout read through `np.memmap`.

Run as ``python benchmarks/workers/baseline_worker.py WORKLOAD '{"spec": "small"}'``; prints
one JSON line (see `benchmarks.measure.emit`). Needs numpy only (jax for the placement
variant of `train_tokens`, skipped with a note where jax is missing).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[2]))
from benchmarks import blend, pack
from benchmarks import datagen as dg
from benchmarks import measure as ms
from benchmarks.megatron import IndexedReader, write_indexed

SYSTEM = "megatron-memmap"


def _spec(p: dict) -> dg.DataSpec:
    return dg.SPECS[p.get("spec", "small")]


def _paths(spec: dg.DataSpec) -> tuple[Path, Path, Path]:
    root = dg.data_dir(spec, SYSTEM)
    return root / "lm", root / "images.u8", root / "labels.i64"


def ensure_data(spec: dg.DataSpec) -> None:
    """Write the Megatron LM pair and the raw image/label files once per spec."""
    lm, img, lab = _paths(spec)
    stamp = lm.parent / "done"
    if stamp.exists() and stamp.read_text() == spec.key():
        return
    write_indexed(lm, dg.iter_documents(spec))
    with open(img, "wb") as fi, open(lab, "wb") as fl:
        for im, la in dg.iter_images(spec):
            fi.write(im.tobytes())
            fl.write(la.tobytes())
    stamp.write_text(spec.key())


def _image_memmap(spec: dg.DataSpec) -> tuple[np.ndarray, np.ndarray]:
    _, img, lab = _paths(spec)
    return (
        np.memmap(img, np.uint8, "r", shape=(spec.num_images, *dg.IMAGE_SHAPE)),
        np.memmap(lab, np.int64, "r"),
    )


def w_write_lm(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    docs = list(dg.iter_documents(spec))
    payload = sum(d.nbytes for d in docs) / 1e6
    out = dg.data_dir(spec, SYSTEM) / "write-test"
    blob = np.concatenate(docs)

    def megatron() -> None:
        write_indexed(out, docs)
        _fsync(f"{out}.bin", f"{out}.idx")

    def plain() -> None:
        with open(f"{out}.raw", "wb") as f:
            f.write(memoryview(blob).cast("B"))
        _fsync(f"{out}.raw")

    reps = ms.write_repeats(p)
    res = [
        ms.metric(
            "write_lm",
            "Megatron .bin/.idx writer (+fsync)",
            ms.median_rate(megatron, payload, reps, 1),
            "MB/s",
        ),
        ms.metric(
            "write_lm",
            "plain f.write of the same bytes (+fsync)",
            ms.median_rate(plain, payload, reps, 1),
            "MB/s",
        ),
    ]
    for suffix in (".bin", ".idx", ".raw"):
        Path(f"{out}{suffix}").unlink(missing_ok=True)
    return res


def w_write_images(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    img, lab = dg.images(spec, 0, spec.num_images)
    out = dg.data_dir(spec, SYSTEM) / "write-test.raw"

    def plain() -> None:
        with open(out, "wb") as f:
            f.write(memoryview(img).cast("B"))
            f.write(memoryview(lab).cast("B"))
        _fsync(out)

    mb = (img.nbytes + lab.nbytes) / 1e6
    rate = ms.median_rate(plain, mb, ms.write_repeats(p), 1)
    out.unlink(missing_ok=True)
    return [ms.metric("write_images", "plain f.write of the same bytes (+fsync)", rate, "MB/s")]


def _fsync(*paths: str | Path) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def w_read_single(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    ensure_data(spec)
    img, _ = _image_memmap(spec)
    rate = ms.read_single_rate(p, spec.num_images, lambda i: img[i])
    return [ms.metric("read_single", "np.memmap slice + copy", rate, "records/s")]


def w_read_batch(p: dict, cold: bool) -> list[ms.Metric]:
    spec = _spec(p)
    ensure_data(spec)
    buf = np.empty((dg.IMAGE_BATCH, *dg.IMAGE_SHAPE), np.uint8)
    batches = [dg.random_indices(spec.num_images, dg.IMAGE_BATCH, 10 + k) for k in range(20)]
    files = [_paths(spec)[1]]
    times = []
    for b in batches[: int(p.get("batches", 20 if not cold else 5))]:
        # A fresh mapping per batch: pages a live mapping has touched stay cached (DONTNEED
        # skips mapped pages), so a cold read must not reuse one.
        img = _image_memmap(spec)[0]
        if cold:
            ms.drop_cache(files)
        else:
            np.take(img, b, axis=0, out=buf)
        t0 = time.perf_counter()
        np.take(img, b, axis=0, out=buf)
        times.append(time.perf_counter() - t0)
        del img
    wl = "read_batch_cold" if cold else "read_batch_warm"
    gbs = buf.nbytes / 1e9 / float(np.median(times))
    return [ms.metric(wl, "np.take on one np.memmap", gbs, "GB/s")]


def _aligned(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """An empty array at a 64-byte aligned address: jax.device_put on CPU then aliases it
    instead of copying, the same zero-copy placement as the Loader's aligned buffers."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def w_train_tokens(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    ensure_data(spec)
    toks = IndexedReader(_paths(spec)[0]).tokens
    out = _aligned((dg.TOKEN_BATCH, dg.SEQ_LEN + 1), np.int32)
    n = int(p.get("batches", 1000))  # as many as roxxel's Loader rows

    def gather(step: int) -> np.ndarray:
        for r, s in enumerate(dg.window_starts(spec, step).tolist()):
            out[r] = toks[s : s + dg.SEQ_LEN + 1]
        return out

    res = [
        ms.metric(
            "train_tokens",
            "bare numpy window gather (limit)",
            ms.median_rate(lambda: [gather(s) for s in range(n)], n, int(p.get("repeats", 5))),
            "batches/s",
        )
    ]
    try:
        import jax

        dev = jax.devices()[0]
        put = lambda: [jax.device_put(gather(s), dev).block_until_ready() for s in range(n)]  # noqa: E731
        res.append(
            ms.metric(
                "train_tokens",
                "bare numpy gather + jax.device_put",
                ms.median_rate(put, n, int(p.get("repeats", 5))),
                "batches/s",
            )
        )
    except ImportError as e:
        res.append(
            ms.metric(
                "train_tokens",
                "bare numpy gather + jax.device_put",
                None,
                "",
                notes=f"jax missing: {e}",
            )
        )
    return res


def w_train_images(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    ensure_data(spec)
    img, lab = _image_memmap(spec)
    bi = _aligned((dg.IMAGE_BATCH, *dg.IMAGE_SHAPE), np.uint8)
    bl = _aligned((dg.IMAGE_BATCH,), np.int64)
    n = int(p.get("batches", 300))  # as many as roxxel's Loader rows

    def run() -> None:
        for s in range(n):
            idx = dg.random_indices(spec.num_images, dg.IMAGE_BATCH, 1000 + s)
            np.take(img, idx, axis=0, out=bi)
            np.take(lab, idx, axis=0, out=bl)

    rate = ms.median_rate(run, n, int(p.get("repeats", 5)))
    res = [ms.metric("train_images", "bare np.take gather (limit)", rate, "batches/s")]
    variant = "bare np.take gather + jax.device_put"
    try:
        import jax
    except ImportError as e:
        return [*res, ms.metric("train_images", variant, None, "", notes=f"jax missing: {e}")]
    dev = jax.devices()[0]

    def put() -> None:  # the same placement as the Loader's: both fields, one device
        for s in range(n):
            idx = dg.random_indices(spec.num_images, dg.IMAGE_BATCH, 1000 + s)
            np.take(img, idx, axis=0, out=bi)
            np.take(lab, idx, axis=0, out=bl)
            jax.block_until_ready(jax.device_put([bi, bl], dev))

    return [
        *res,
        ms.metric(
            "train_images", variant, ms.median_rate(put, n, int(p.get("repeats", 5))), "batches/s"
        ),
    ]


def w_train_images_cold(p: dict) -> list[ms.Metric]:
    """The first batches of a shuffled epoch right after the files left the page cache."""
    spec = _spec(p)
    ensure_data(spec)
    bi = np.empty((dg.IMAGE_BATCH, *dg.IMAGE_SHAPE), np.uint8)
    bl = np.empty(dg.IMAGE_BATCH, np.int64)
    n = min(int(p.get("cold_batches", 10)), spec.num_images // dg.IMAGE_BATCH)
    rates = []
    for rep in range(ms.slow_repeats(p)):
        order = np.random.default_rng([rep, 5]).permutation(spec.num_images)
        img, lab = _image_memmap(spec)  # fresh mappings: see w_read_batch
        ms.drop_cache(list(_paths(spec)[1:]))
        t0 = time.perf_counter()
        for s in range(n):
            idx = order[s * dg.IMAGE_BATCH : (s + 1) * dg.IMAGE_BATCH]
            np.take(img, idx, axis=0, out=bi)
            np.take(lab, idx, axis=0, out=bl)
        rates.append(n / (time.perf_counter() - t0))
        del img, lab
    return [
        ms.metric(
            "train_images_cold",
            "np.memmap + np.take (kernel readahead only)",
            float(np.median(rates)),
            "batches/s",
            notes=f"first {n} batches",
        )
    ]


def w_resume(p: dict) -> list[ms.Metric]:
    """Megatron-style resume: a materialized shuffle index over the windows, then one batch."""
    spec = _spec(p)
    ensure_data(spec)
    w = dg.SEQ_LEN + 1

    def first_batch(step: int) -> np.ndarray:
        toks = IndexedReader(_paths(spec)[0]).tokens
        nwin = dg.num_windows(spec, dg.SEQ_LEN)
        order = np.random.default_rng(0).permutation(nwin)  # O(N) index, built on every start
        rows = order[(np.arange(dg.TOKEN_BATCH) + step * dg.TOKEN_BATCH) % nwin]
        return np.stack([toks[r * w : (r + 1) * w] for r in rows.tolist()])

    return ms.resume_series(
        "resume",
        first_batch,
        dg.RESUME_STEPS,
        dg.step_label,
        ms.slow_repeats(p),
        "O(N) shuffle index built per start",
    )


def w_resume_mix(p: dict) -> list[ms.Metric]:
    """Megatron's blended resume: the greedy blend index over every sample up to the step
    (built before the first batch), then one batch. Past 64 M samples it is extrapolated."""
    spec = _spec(p)
    ensure_data(spec)
    toks = IndexedReader(_paths(spec)[0]).tokens
    nwin, w = dg.num_windows(spec, dg.SEQ_LEN), dg.SEQ_LEN + 1
    weights = [0.4, 0.3, 0.2, 0.1]
    how = "compiled C loop" if blend.is_compiled() else "numpy loop (no C compiler)"
    res, per_sample = [], 0.0
    for step in dg.RESUME_STEPS:
        n = (step + 1) * dg.TOKEN_BATCH
        notes = f"greedy blend index over {n:,} samples ({how}), {10 * n / 2**20:,.0f} MiB"
        if n > 65 * 10**6:
            t = per_sample * n
            notes += "; extrapolated from the largest measured build"
        else:
            t0 = time.perf_counter()
            src, idx = blend.build_blend_index(weights, n)
            rows = (idx[-dg.TOKEN_BATCH :] * 7919 + src[-dg.TOKEN_BATCH :]) % nwin
            _ = np.stack([toks[r * w : (r + 1) * w] for r in rows.tolist()])
            t = time.perf_counter() - t0
            per_sample = t / n
            del src, idx
        res.append(
            ms.metric(
                "resume_mix", dg.step_label(step), t, "s", higher_is_better=False, notes=notes
            )
        )
    return res


def w_startup(p: dict) -> list[ms.Metric]:
    """Open 1,000 Megatron prefixes (one .bin/.idx pair each) and read one record."""
    spec = _spec(p)
    root = dg.data_dir(spec, SYSTEM) / "startup"
    root.mkdir(exist_ok=True)
    if not (root / "done").exists():
        docs = list(dg.iter_documents(spec, max_tokens=4000 * 1000))
        for k in range(1000):
            write_indexed(root / f"part-{k:04d}", docs[k * 4 : k * 4 + 4] or docs[:1])
        (root / "done").write_text("1")

    def run() -> None:
        readers = [IndexedReader(root / f"part-{k:04d}") for k in range(1000)]
        _ = np.array(readers[999][0])

    t = ms.median_seconds(run, ms.slow_repeats(p))
    return [
        ms.metric(
            "startup", "1,000 .bin/.idx prefixes via np.memmap", t, "s", higher_is_better=False
        )
    ]


def w_limits(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    ensure_data(spec)
    a = np.ones(64 << 20, np.uint8)
    b = np.empty_like(a)
    memcpy = ms.median_rate(lambda: np.copyto(b, a), a.nbytes / 1e9, 5)
    path = f"{_paths(spec)[0]}.bin"
    size = os.path.getsize(path)
    buf = bytearray(8 << 20)

    def seq_read() -> None:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass

    seq = ms.median_rate(seq_read, size / 1e9, 3)
    mm = np.memmap(path, np.uint8, "r")
    pages = dg.random_indices(size // 4096, 200_000, 7) * 4096
    touch = ms.median_rate(lambda: int(mm[pages].sum()), pages.size, 3)
    ra = ms.readahead_kb(Path(path))
    return [
        ms.metric("limits", "numpy memcpy (np.copyto 64 MiB)", memcpy, "GB/s"),
        ms.metric("limits", "sequential read, warm file (readinto 8 MiB)", seq, "GB/s"),
        ms.metric("limits", "random 4 KiB page touch of an mmap (warm)", touch, "pages/s"),
        ms.metric("limits", "disk readahead", ra, "KiB", notes="read_ahead_kb"),
    ]


def versions() -> dict[str, str]:
    return {"numpy": np.__version__, "python": sys.version.split()[0]}


WORKLOADS = {
    "limits": w_limits,
    "write_lm": w_write_lm,
    "write_images": w_write_images,
    "read_single": w_read_single,
    "read_batch_warm": lambda p: w_read_batch(p, cold=False),
    "read_batch_cold": lambda p: w_read_batch(p, cold=True),
    "train_tokens": w_train_tokens,
    "train_images": w_train_images,
    "train_images_cold": w_train_images_cold,
    "resume": w_resume,
    "resume_mix": w_resume_mix,
    "startup": w_startup,
    "pack_lm": lambda p: pack.baseline_pack(p, "lm"),
    "pack_images": lambda p: pack.baseline_pack(p, "images"),
}

if __name__ == "__main__":
    raise SystemExit(ms.worker_main(WORKLOADS, versions))
