"""Hugging Face datasets 5.2.0, map-style, Arrow files from save_to_disk (runs in .venvs/hf).

Features: LM documents ``List(int32)``; token windows pre-packed as ``List(int32, length=2049)``;
images ``Array3D((3,64,64), uint8)`` plus ``Value(int64)``. `with_format("numpy")` widens every
integer column to int64 unless told the dtype, so the tuned variants pass the column's dtype
(one formatted view per dtype). Shuffling is `Dataset.shuffle(seed)` (an indices mapping).
"""

from __future__ import annotations

import gc
import shutil
import sys
import time
from itertools import islice
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[2]))
import datasets
from datasets import Array3D, Dataset, Features, List, Value, load_from_disk

from benchmarks import datagen as dg
from benchmarks import measure as ms

SYSTEM = "hf"
datasets.disable_progress_bars()
IMAGE_FEATURES = Features({"image": Array3D(dg.IMAGE_SHAPE, "uint8"), "label": Value("int64")})
WINDOW_FEATURES = Features({"tokens": List(Value("int32"), length=dg.SEQ_LEN + 1)})
LM_FEATURES = Features({"tokens": List(Value("int32"))})


def _spec(p: dict) -> dg.DataSpec:
    return dg.SPECS[p.get("spec", "small")]


def _save(out: Path, features: Features, columns: dict, num_shards: int | None = None) -> None:
    shutil.rmtree(out, ignore_errors=True)
    ds = Dataset.from_dict(columns, features=features)
    ds.save_to_disk(str(out), num_shards=num_shards)


def _lm_columns(spec: dg.DataSpec) -> dict:
    return {"tokens": list(dg.iter_documents(spec))}


def ensure_data(spec: dg.DataSpec) -> dict[str, Path]:
    root = dg.data_dir(spec, SYSTEM)
    paths = {k: root / k for k in ("lm", "windows", "images")}
    stamp = root / "done"
    if not (stamp.exists() and stamp.read_text() == spec.key()):
        _save(paths["lm"], LM_FEATURES, _lm_columns(spec))
        wins = np.stack(list(dg.iter_windows(spec)))
        _save(paths["windows"], WINDOW_FEATURES, {"tokens": wins})
        img, lab = dg.images(spec, 0, spec.num_images)
        _save(paths["images"], IMAGE_FEATURES, {"image": img, "label": lab})
        stamp.write_text(spec.key())
    return paths


def w_write_lm(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    cols = _lm_columns(spec)
    mb = sum(d.nbytes for d in cols["tokens"]) / 1e6
    out = dg.data_dir(spec, SYSTEM) / "write-test"
    rate = ms.median_rate(lambda: _save(out, LM_FEATURES, cols), mb, ms.slow_repeats(p), 0)
    shutil.rmtree(out, ignore_errors=True)
    return [
        ms.metric(
            "write_lm",
            "Dataset.from_dict + save_to_disk",
            rate,
            "MB/s",
            notes="no fsync of its own",
        )
    ]


def w_write_images(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    img, lab = dg.images(spec, 0, spec.num_images)
    out = dg.data_dir(spec, SYSTEM) / "write-test"
    run = lambda: _save(out, IMAGE_FEATURES, {"image": img, "label": lab})  # noqa: E731
    rate = ms.median_rate(run, (img.nbytes + lab.nbytes) / 1e6, ms.slow_repeats(p), 0)
    shutil.rmtree(out, ignore_errors=True)
    return [
        ms.metric(
            "write_images",
            "Dataset.from_dict + save_to_disk",
            rate,
            "MB/s",
            notes="no fsync of its own",
        )
    ]


def _image_views(path: Path):
    ds = load_from_disk(str(path))
    return (
        ds.with_format("numpy", columns=["image"], dtype=np.uint8),
        ds.with_format("numpy", columns=["label"]),
        ds.with_format("numpy"),
    )


def w_read_single(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    img_view, _, plain = _image_views(ensure_data(spec)["images"])
    views = (
        ("ds[i], with_format('numpy') (int64)", plain),
        ("ds[i], with_format('numpy', dtype=uint8)", img_view),
    )
    return [
        ms.metric(
            "read_single",
            name,
            ms.read_single_rate(p, spec.num_images, lambda i, v=view: v[i]["image"]),
            "records/s",
        )
        for name, view in views
    ]


def w_read_batch(p: dict, cold: bool) -> list[ms.Metric]:
    spec = _spec(p)
    path = ensure_data(spec)["images"]
    files = ms.files_under(path)
    buf = np.empty((dg.IMAGE_BATCH, *dg.IMAGE_SHAPE), np.uint8)
    times = []
    for k in range(5 if cold else 20):
        b = dg.random_indices(spec.num_images, dg.IMAGE_BATCH, 10 + k).tolist()
        img_view = _image_views(path)[0]  # fresh Arrow mappings (mapped pages stay cached)
        if cold:
            ms.drop_cache(files)
        else:
            buf[...] = img_view[b]["image"]
        t0 = time.perf_counter()
        buf[...] = img_view[b]["image"]
        times.append(time.perf_counter() - t0)
        del img_view
        gc.collect()
    wl = "read_batch_cold" if cold else "read_batch_warm"
    gbs = buf.nbytes / 1e9 / float(np.median(times))
    return [ms.metric(wl, "ds[indices], with_format('numpy', dtype=uint8)", gbs, "GB/s")]


def _rate(get_batch, n: int) -> float:
    get_batch(0)
    return ms.median_rate(lambda: [get_batch(s) for s in range(1, n + 1)], n, 3, 0)


def w_train_tokens(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    ds = load_from_disk(str(ensure_data(spec)["windows"])).shuffle(seed=0)
    n, b, total = int(p.get("batches", 30)), dg.TOKEN_BATCH, len(ds)
    res = []
    for name, view in (
        ("shuffle(0) + slices, with_format('numpy') (int64)", ds.with_format("numpy")),
        (
            "shuffle(0) + slices, with_format('numpy', dtype=int32)",
            ds.with_format("numpy", dtype=np.int32),
        ),
    ):

        def get(s: int, view=view) -> np.ndarray:
            start = (s * b) % max(total - b, 1)
            return view[start : start + b]["tokens"]

        res.append(ms.metric("train_tokens", name, _rate(get, n), "batches/s"))
    return res


def w_train_images(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    path = ensure_data(spec)["images"]
    ds = load_from_disk(str(path)).shuffle(seed=0)
    img_view = ds.with_format("numpy", columns=["image"], dtype=np.uint8)
    lab_view = ds.with_format("numpy", columns=["label"])
    plain = ds.with_format("numpy")
    n, b, total = int(p.get("batches", 30)), dg.IMAGE_BATCH, len(ds)

    def tuned(s: int):
        start = (s * b) % max(total - b, 1)
        return img_view[start : start + b]["image"], lab_view[start : start + b]["label"]

    def default(s: int):
        start = (s * b) % max(total - b, 1)
        return plain[start : start + b]

    return [
        ms.metric(
            "train_images",
            "shuffle(0) + slices, with_format('numpy') (int64)",
            _rate(default, n),
            "batches/s",
        ),
        ms.metric(
            "train_images",
            "shuffle(0) + slices, uint8 image view + label view",
            _rate(tuned, n),
            "batches/s",
        ),
    ]


def _resume(p: dict, workload: str, num_sources: int) -> list[ms.Metric]:
    spec = _spec(p)
    path = ensure_data(spec)["windows"]

    def first_batch(step: int) -> None:
        parts = [load_from_disk(str(path)) for _ in range(num_sources)]
        if num_sources == 1:
            ds = parts[0].shuffle(seed=0)
        else:
            shuffled = [d.shuffle(seed=k) for k, d in enumerate(parts)]
            ds = datasets.interleave_datasets(
                shuffled,
                probabilities=[0.4, 0.3, 0.2, 0.1],
                seed=0,
                stopping_strategy="all_exhausted",
            )
        ds = ds.with_format("numpy", dtype=np.int32)
        start = (step * dg.TOKEN_BATCH) % max(len(ds) - dg.TOKEN_BATCH, 1)
        _ = ds[start : start + dg.TOKEN_BATCH]["tokens"]

    notes = "map-style: load_from_disk + shuffle (O(N) indices) + slice at step mod epoch"
    if num_sources > 1:
        notes += "; interleave_datasets precomputes the whole index list"
    return ms.resume_series(
        workload, first_batch, dg.RESUME_STEPS, dg.step_label, ms.slow_repeats(p), notes
    )


ITER_STEPS = (0, 10, 100, 1000)  # measured; later steps follow from the per-step cost of skip(n)


def _iterable_first_batch(path: Path, step: int) -> list:
    """Streaming resume: to_iterable_dataset + shuffle buffer + repeat, then skip(n)."""
    ds = load_from_disk(str(path)).to_iterable_dataset(num_shards=8)
    ds = ds.shuffle(seed=0, buffer_size=1000).repeat(None).with_format("numpy")
    return list(islice(iter(ds.skip(step * dg.TOKEN_BATCH)), dg.TOKEN_BATCH))


def w_resume(p: dict) -> list[ms.Metric]:
    """Map-style resume (O(1) in the step) and IterableDataset.skip(n), which reads and drops
    every earlier example: measured at small steps, the rest extrapolated linearly."""
    rows = _resume(p, "resume", 1)
    path = ensure_data(_spec(p))["windows"]
    label = lambda s: f"IterableDataset.skip: {dg.step_label(s)}"  # noqa: E731
    notes = "to_iterable_dataset(8 shards).shuffle(buffer 1000).repeat(None).skip(step x 64)"
    measured = ms.resume_series(
        "resume",
        lambda s: _iterable_first_batch(path, s),
        ITER_STEPS,
        label,
        ms.slow_repeats(p),
        notes,
    )
    t0, t_last = measured[0]["value"], measured[-1]["value"]
    per_step = max(t_last - t0, 0.0) / ITER_STEPS[-1]
    extra = [
        ms.metric(
            "resume",
            label(s),
            t0 + per_step * s,
            "s",
            higher_is_better=False,
            notes=f"extrapolated: {per_step * 1e3:.2f} ms per step skipped, measured to step "
            f"{ITER_STEPS[-1]}",
        )
        for s in dg.RESUME_STEPS
        if s > ITER_STEPS[-1]
    ]
    return rows + measured + extra


def w_startup(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    root = dg.data_dir(spec, SYSTEM) / "startup-1000"
    if not (root / "done").exists():
        docs = list(dg.iter_documents(spec, max_tokens=4000 * 1000))
        cols = {"tokens": [docs[k % len(docs)] for k in range(1000)]}
        _save(root, LM_FEATURES, cols, num_shards=1000)
        (root / "done").write_text("1")

    def run() -> None:
        ds = load_from_disk(str(root)).with_format("numpy", dtype=np.int32)
        _ = ds[len(ds) - 1]["tokens"]

    t = ms.median_seconds(run, ms.slow_repeats(p))
    return [
        ms.metric(
            "startup",
            "load_from_disk(1,000 arrow shards) + 1 record",
            t,
            "s",
            higher_is_better=False,
        )
    ]


def versions() -> dict[str, str]:
    return ms.package_versions("datasets", "pyarrow", "numpy")


WORKLOADS = {
    "write_lm": w_write_lm,
    "write_images": w_write_images,
    "read_single": w_read_single,
    "read_batch_warm": lambda p: w_read_batch(p, cold=False),
    "read_batch_cold": lambda p: w_read_batch(p, cold=True),
    "train_tokens": w_train_tokens,
    "train_images": w_train_images,
    "resume": w_resume,
    "resume_mix": lambda p: _resume(p, "resume_mix", 4),
    "startup": w_startup,
}

if __name__ == "__main__":
    raise SystemExit(ms.worker_main(WORKLOADS, versions))
