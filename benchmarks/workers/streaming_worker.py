"""mosaicml-streaming 0.13.0 reading local MDS shards (runs in benchmarks/.venvs/streaming).

Columns: LM documents as ``ndarray:int32`` (variable length); token windows pre-packed as
``ndarray:int32:2049`` (it has no window view over a token stream); images as
``ndarray:uint8:3,64,64`` plus an ``int64`` label. Uncompressed, default 64 MB shards. Training
batches go through its StreamingDataLoader, with 0 and 2 worker processes (best reported).
Shared-memory leftovers from earlier runs are cleaned first (a known pitfall of this library).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[2]))
import streaming  # noqa: F401  (imported once, outside the timings)

from benchmarks import datagen as dg
from benchmarks import measure as ms
from benchmarks import pack

SYSTEM = "streaming"
IMAGE_COLUMNS = {"image": "ndarray:uint8:3,64,64", "label": "int64"}
WINDOW_COLUMNS = {"tokens": f"ndarray:int32:{dg.SEQ_LEN + 1}"}
LM_COLUMNS = {"tokens": "ndarray:int32"}


def _spec(p: dict) -> dg.DataSpec:
    return dg.SPECS[p.get("spec", "small")]


def _clean() -> None:
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()


def _write(out: Path, columns: dict[str, str], samples) -> None:
    from streaming import MDSWriter

    shutil.rmtree(out, ignore_errors=True)
    with MDSWriter(out=str(out), columns=columns, compression=None) as w:
        for s in samples:
            w.write(s)
    for f in ms.files_under(out):
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def _image_samples(img: np.ndarray, lab: np.ndarray):
    for i in range(len(lab)):
        yield {"image": img[i], "label": int(lab[i])}


def ensure_data(spec: dg.DataSpec) -> dict[str, Path]:
    root = dg.data_dir(spec, SYSTEM)
    paths = {k: root / k for k in ("lm", "windows", "images")}
    stamp = root / "done"
    if not (stamp.exists() and stamp.read_text() == spec.key()):
        _write(paths["lm"], LM_COLUMNS, ({"tokens": d} for d in dg.iter_documents(spec)))
        _write(paths["windows"], WINDOW_COLUMNS, ({"tokens": w} for w in dg.iter_windows(spec)))
        _write(paths["images"], IMAGE_COLUMNS, _image_samples(*dg.images(spec, 0, spec.num_images)))
        for k in range(4):  # a mixture needs one local folder per stream: hard links
            dst = root / f"windows-{k}"
            if not dst.exists():
                shutil.copytree(paths["windows"], dst, copy_function=os.link)
        stamp.write_text(spec.key())
    return paths


def _dataset(path: Path, **kw):
    from streaming import StreamingDataset

    _clean()
    return StreamingDataset(local=str(path), **kw)


def w_write_lm(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    docs = list(dg.iter_documents(spec))
    out = dg.data_dir(spec, SYSTEM) / "write-test"
    mb = sum(d.nbytes for d in docs) / 1e6
    run = lambda: _write(out, LM_COLUMNS, ({"tokens": d} for d in docs))  # noqa: E731
    rate = ms.median_rate(run, mb, ms.slow_repeats(p), 0)
    shutil.rmtree(out, ignore_errors=True)
    return [ms.metric("write_lm", "MDSWriter(ndarray:int32, uncompressed) +fsync", rate, "MB/s")]


def w_write_images(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    img, lab = dg.images(spec, 0, spec.num_images)
    out = dg.data_dir(spec, SYSTEM) / "write-test"
    run = lambda: _write(out, IMAGE_COLUMNS, _image_samples(img, lab))  # noqa: E731
    rate = ms.median_rate(run, (img.nbytes + lab.nbytes) / 1e6, ms.slow_repeats(p), 0)
    shutil.rmtree(out, ignore_errors=True)
    return [ms.metric("write_images", "MDSWriter(uncompressed) +fsync", rate, "MB/s")]


def w_read_single(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    ds = _dataset(ensure_data(spec)["images"])
    rate = ms.read_single_rate(p, spec.num_images, lambda i: ds[i]["image"])
    return [ms.metric("read_single", "StreamingDataset[i] + copy", rate, "records/s")]


def w_read_batch(p: dict, cold: bool) -> list[ms.Metric]:
    spec = _spec(p)
    path = ensure_data(spec)["images"]
    ds = _dataset(path)
    files = ms.files_under(path)
    buf = np.empty((dg.IMAGE_BATCH, *dg.IMAGE_SHAPE), np.uint8)
    times = []
    for k in range(5 if cold else 20):
        b = dg.random_indices(spec.num_images, dg.IMAGE_BATCH, 10 + k).tolist()
        if cold:
            ms.drop_cache(files)
        t0 = time.perf_counter()
        for r, i in enumerate(b):  # no batched read API: one sample at a time
            buf[r] = ds[i]["image"]
        times.append(time.perf_counter() - t0)
    wl = "read_batch_cold" if cold else "read_batch_warm"
    return [
        ms.metric(
            wl, "loop of StreamingDataset[i]", buf.nbytes / 1e9 / float(np.median(times)), "GB/s"
        )
    ]


def _loader_rate(path: Path, batch: int, workers: int, n: int) -> float:
    from streaming import StreamingDataLoader

    ds = _dataset(path, shuffle=True, batch_size=batch)
    loader = StreamingDataLoader(
        ds, batch_size=batch, num_workers=workers, drop_last=True, persistent_workers=workers > 0
    )
    rates = []
    it = iter(loader)
    next(it)
    for _ in range(3):
        t0, got = time.perf_counter(), 0
        for _ in range(n):
            try:
                next(it)
            except StopIteration:  # one epoch ended: start the next
                it = iter(loader)
                next(it)
            got += 1
        rates.append(got / (time.perf_counter() - t0))
    del it, loader
    return float(np.median(rates))


def _train(p: dict, workload: str, key: str, batch: int) -> list[ms.Metric]:
    spec = _spec(p)
    path = ensure_data(spec)[key]
    n = int(p.get("batches", 30))
    res = []
    for workers in (0, 2):
        try:
            rate = _loader_rate(path, batch, workers, n)
            res.append(
                ms.metric(
                    workload,
                    f"StreamingDataLoader(num_workers={workers})",
                    rate,
                    "batches/s",
                    notes="torch tensors out",
                )
            )
        except Exception as e:
            res.append(
                ms.metric(
                    workload,
                    f"StreamingDataLoader(num_workers={workers})",
                    None,
                    "",
                    notes=f"{type(e).__name__}: {e}"[:300],
                )
            )
    return res


def _resume(p: dict, workload: str, num_sources: int) -> list[ms.Metric]:
    """Resume through load_state_dict(epoch, sample_in_epoch): it recomputes the epoch order."""
    from streaming import Stream
    from torch.utils.data import DataLoader

    spec = _spec(p)
    root = ensure_data(spec)["windows"].parent
    per_epoch = dg.num_windows(spec, dg.SEQ_LEN)

    def first_batch(step: int) -> None:
        if num_sources == 1:
            ds = _dataset(root / "windows", shuffle=True, batch_size=dg.TOKEN_BATCH)
        else:
            streams = [
                Stream(local=str(root / f"windows-{k}"), proportion=w)
                for k, w in enumerate((0.4, 0.3, 0.2, 0.1))
            ]
            ds = _dataset_streams(streams)
        epoch, sample = divmod(step * dg.TOKEN_BATCH, max(len(ds), 1))
        ds.load_state_dict(
            {
                "epoch": epoch,
                "sample_in_epoch": sample,
                "num_canonical_nodes": 1,
                "shuffle_seed": 9176,
                "initial_physical_nodes": 1,
            }
        )
        it = iter(DataLoader(ds, batch_size=dg.TOKEN_BATCH, num_workers=0))
        next(it)
        del it

    notes = f"epoch = {per_epoch} samples; epoch order recomputed, O(epoch)"
    if num_sources > 1:
        notes += "; Stream proportions upsample instead of exhausting"
    return ms.resume_series(
        workload, first_batch, dg.RESUME_STEPS, dg.step_label, ms.slow_repeats(p), notes
    )


def _dataset_streams(streams):
    from streaming import StreamingDataset

    _clean()
    return StreamingDataset(streams=streams, shuffle=True, batch_size=dg.TOKEN_BATCH)


def w_startup(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    root = dg.data_dir(spec, SYSTEM) / "startup-1000"
    if not (root / "done").exists():
        from streaming import MDSWriter

        docs = list(dg.iter_documents(spec, max_tokens=4000 * 1000))
        shutil.rmtree(root, ignore_errors=True)
        with MDSWriter(out=str(root), columns=LM_COLUMNS, size_limit=1 << 10) as w:
            for k in range(1000):  # ~one document per shard
                w.write({"tokens": docs[k % len(docs)][:200]})
        (root / "done").write_text("1")

    def run() -> None:
        ds = _dataset(root)
        _ = np.array(ds[len(ds) - 1]["tokens"])

    t = ms.median_seconds(run, ms.slow_repeats(p))
    n = len(list(root.glob("*.mds")))
    return [
        ms.metric(
            "startup",
            f"StreamingDataset({n} MDS shards) + 1 record",
            t,
            "s",
            higher_is_better=False,
        )
    ]


def w_pack(p: dict, kind: str) -> list[ms.Metric]:
    """The pack input files (JSONL parsed with stdlib json, .npy) into MDS shards."""
    src = pack.input_path(p, kind)

    def write(out: Path) -> None:
        if kind == "lm":
            _write(out, LM_COLUMNS, ({"tokens": d} for d in pack.iter_jsonl_tokens(src)))
        else:
            _write(out, {"image": IMAGE_COLUMNS["image"]}, ({"image": r} for r in np.load(src)))

    return [pack.pack_metric(kind, "MDSWriter(uncompressed) +fsync", write, p, SYSTEM)]


def versions() -> dict[str, str]:
    return ms.package_versions("mosaicml-streaming", "torch", "numpy")


WORKLOADS = {
    "write_lm": w_write_lm,
    "write_images": w_write_images,
    "read_single": w_read_single,
    "read_batch_warm": lambda p: w_read_batch(p, cold=False),
    "read_batch_cold": lambda p: w_read_batch(p, cold=True),
    "train_tokens": lambda p: _train(p, "train_tokens", "windows", dg.TOKEN_BATCH),
    "train_images": lambda p: _train(p, "train_images", "images", dg.IMAGE_BATCH),
    "resume": lambda p: _resume(p, "resume", 1),
    "resume_mix": lambda p: _resume(p, "resume_mix", 4),
    "startup": w_startup,
    "pack_lm": lambda p: w_pack(p, "lm"),
    "pack_images": lambda p: w_pack(p, "images"),
}

if __name__ == "__main__":
    raise SystemExit(ms.worker_main(WORKLOADS, versions))
