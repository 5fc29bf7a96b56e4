"""grain 0.2.18 over array-record 0.8.6 (runs in benchmarks/.venvs/grain).

Records are raw bytes, no pickle: an LM document is its int32 tokens; an image record is the
12,288 pixel bytes followed by the int64 label; token windows are pre-packed records of 2,049
tokens (grain has no window view over a token stream). Files are written uncompressed with
``group_size:1``, which ArrayRecordDataSource requires and random access prefers.

Settings: "defaults" is grain's ReadOptions() (16 threads, 500-element prefetch); "2-core" is
the best of a few thread counts for this 2-core machine; "mp_prefetch" adds 2 worker processes.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[2]))
import grain
from array_record.python import array_record_module  # noqa: F401

from benchmarks import datagen as dg
from benchmarks import measure as ms
from benchmarks import pack

SYSTEM = "grain"
WRITER_OPTIONS = "group_size:1,uncompressed"
READER_OPTIONS = "readahead_buffer_size:0,max_parallelism:0"  # array-record's random-access setting
IMG = dg.IMAGE_BYTES


def _spec(p: dict) -> dg.DataSpec:
    return dg.SPECS[p.get("spec", "small")]


def _writer(path: Path):
    from array_record.python.array_record_module import ArrayRecordWriter

    return ArrayRecordWriter(str(path), WRITER_OPTIONS)


def _write_records(path: Path, records) -> None:
    w = _writer(path)
    for rec in records:
        w.write(rec)
    w.close()


def _image_records(img: np.ndarray, lab: np.ndarray):
    for i in range(len(lab)):
        yield img[i].tobytes() + lab[i : i + 1].tobytes()


def ensure_data(spec: dg.DataSpec) -> dict[str, Path]:
    root = dg.data_dir(spec, SYSTEM)
    paths = {k: root / f"{k}.array_record" for k in ("lm", "windows", "images")}
    stamp = root / "done"
    if not (stamp.exists() and stamp.read_text() == spec.key()):
        _write_records(paths["lm"], (d.tobytes() for d in dg.iter_documents(spec)))
        _write_records(paths["windows"], (w.tobytes() for w in dg.iter_windows(spec)))
        img, lab = dg.images(spec, 0, spec.num_images)
        _write_records(paths["images"], _image_records(img, lab))
        stamp.write_text(spec.key())
    return paths


def _source(path: Path):

    return grain.sources.ArrayRecordDataSource(str(path))


def parse_image(rec: bytes) -> dict[str, np.ndarray]:
    return {
        "image": np.frombuffer(rec, np.uint8, IMG).reshape(dg.IMAGE_SHAPE),
        "label": np.frombuffer(rec, np.int64, 1, IMG)[0],
    }


def parse_window(rec: bytes) -> np.ndarray:
    return np.frombuffer(rec, np.int32)


def _sync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def w_write_lm(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    docs = [d.tobytes() for d in dg.iter_documents(spec)]
    mb = sum(map(len, docs)) / 1e6
    out = dg.data_dir(spec, SYSTEM) / "write-test.array_record"

    def run() -> None:
        _write_records(out, docs)
        _sync(out)

    rate = ms.median_rate(run, mb, ms.slow_repeats(p), 0)
    out.unlink(missing_ok=True)
    return [ms.metric("write_lm", f"ArrayRecordWriter({WRITER_OPTIONS}) +fsync", rate, "MB/s")]


def w_write_images(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    img, lab = dg.images(spec, 0, spec.num_images)
    recs = list(_image_records(img, lab))
    out = dg.data_dir(spec, SYSTEM) / "write-test.array_record"

    def run() -> None:
        _write_records(out, recs)
        _sync(out)

    rate = ms.median_rate(run, (img.nbytes + lab.nbytes) / 1e6, ms.slow_repeats(p), 0)
    out.unlink(missing_ok=True)
    return [ms.metric("write_images", f"ArrayRecordWriter({WRITER_OPTIONS}) +fsync", rate, "MB/s")]


def w_read_single(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    src = _source(ensure_data(spec)["images"])
    rate = ms.read_single_rate(p, spec.num_images, lambda i: parse_image(src[i])["image"])
    return [ms.metric("read_single", "ArrayRecordDataSource[i] + parse", rate, "records/s")]


def _batch_readers(path: Path):
    from array_record.python.array_record_module import ArrayRecordReader

    src = _source(path)
    reader = ArrayRecordReader(str(path), READER_OPTIONS)
    return {
        "ArrayRecordDataSource[i] per record": lambda idx: [src[i] for i in idx.tolist()],
        "ArrayRecordDataSource.__getitems__": lambda idx: src.__getitems__(idx.tolist()),
        "ArrayRecordReader.read(indices)": lambda idx: reader.read(idx.tolist()),
    }


def w_read_batch(p: dict, cold: bool) -> list[ms.Metric]:
    spec = _spec(p)
    path = ensure_data(spec)["images"]
    batches = [dg.random_indices(spec.num_images, dg.IMAGE_BATCH, 10 + k) for k in range(20)]
    buf = np.empty((dg.IMAGE_BATCH, *dg.IMAGE_SHAPE), np.uint8)
    wl = "read_batch_cold" if cold else "read_batch_warm"
    res = []
    for name, read in _batch_readers(path).items():
        times = []
        for b in batches[: 5 if cold else 20]:
            if cold:
                ms.drop_cache([path])
            else:
                read(b)
            t0 = time.perf_counter()
            for r, rec in enumerate(read(b)):
                buf[r] = np.frombuffer(rec, np.uint8, IMG).reshape(dg.IMAGE_SHAPE)
            times.append(time.perf_counter() - t0)
        res.append(ms.metric(wl, name, buf.nbytes / 1e9 / float(np.median(times)), "GB/s"))
    return res


def _pipeline(path: Path, parse, batch: int, read_options, mp_workers: int = 0):

    ds = grain.MapDataset.source(_source(path)).shuffle(seed=0).repeat().map(parse)
    it = ds.to_iter_dataset(read_options).batch(batch)
    if mp_workers:
        it = it.mp_prefetch(grain.multiprocessing.MultiprocessingOptions(num_workers=mp_workers))
    return it


def _rate(it_ds, n: int) -> float:
    it = iter(it_ds)
    next(it)
    rate = ms.median_rate(lambda: [next(it) for _ in range(n)], n, 3, 0)
    close = getattr(it, "close", None)
    if close:
        close()
    return rate


def _train(p: dict, workload: str, key: str, parse, batch: int) -> list[ms.Metric]:

    _parse_absl_flags()
    spec = _spec(p)
    path = ensure_data(spec)[key]
    n = int(p.get("batches", 30))
    res = [
        ms.metric(
            workload,
            "defaults: ReadOptions() (16 threads)",
            _rate(_pipeline(path, parse, batch, grain.ReadOptions()), n),
            "batches/s",
        )
    ]
    tuned = {
        t: _rate(
            _pipeline(
                path, parse, batch, grain.ReadOptions(num_threads=t, prefetch_buffer_size=2 * batch)
            ),
            n,
        )
        for t in (1, 2, 4)
    }
    best = max(tuned, key=tuned.__getitem__)
    res.append(
        ms.metric(
            workload,
            f"2-core: ReadOptions(num_threads={best}, prefetch={2 * batch})",
            tuned[best],
            "batches/s",
            notes=f"tried threads {sorted(tuned)}",
        )
    )
    try:
        ro = grain.ReadOptions(num_threads=best, prefetch_buffer_size=2 * batch)
        rate = _rate(_pipeline(path, parse, batch, ro, mp_workers=2), n)
        res.append(ms.metric(workload, "2-core + mp_prefetch(2 workers)", rate, "batches/s"))
    except Exception as e:
        res.append(
            ms.metric(
                workload,
                "2-core + mp_prefetch(2 workers)",
                None,
                "",
                notes=f"{type(e).__name__}: {e}"[:300],
            )
        )
    return res


def _parse_absl_flags() -> None:
    """mp_prefetch reads absl flags, which raise UnparsedFlagAccessError until parsed."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS(["grain_worker"])


def w_train_tokens(p: dict) -> list[ms.Metric]:
    return _train(p, "train_tokens", "windows", parse_window, dg.TOKEN_BATCH)


def w_train_images(p: dict) -> list[ms.Metric]:
    return _train(p, "train_images", "images", parse_image, dg.IMAGE_BATCH)


def _resume(p: dict, workload: str, num_sources: int) -> list[ms.Metric]:
    """O(1) resume of a MapDataset pipeline: set the iterator's next_index and read a batch."""

    spec = _spec(p)
    path = ensure_data(spec)["windows"]

    def first_batch(step: int) -> None:
        parts = [
            grain.MapDataset.source(_source(path)).shuffle(seed=k).repeat()
            for k in range(num_sources)
        ]
        ds = parts[0] if num_sources == 1 else grain.MapDataset.mix(parts, [0.4, 0.3, 0.2, 0.1])
        ds = ds.map(parse_window).batch(dg.TOKEN_BATCH)
        it = iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=2)))
        state = it.get_state()
        state["next_index"] = step
        it.set_state(state)
        next(it)

    notes = "MapDataset.batch + iterator set_state(next_index)"
    if num_sources > 1:
        notes += "; mix stops at the first exhausted source (repeat() first)"
    return ms.resume_series(
        workload, first_batch, dg.RESUME_STEPS, dg.step_label, ms.slow_repeats(p), notes
    )


def w_startup(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    root = dg.data_dir(spec, SYSTEM) / "startup-1000"
    root.mkdir(exist_ok=True)
    files = [root / f"part-{k:04d}.array_record" for k in range(1000)]
    if not (root / "done").exists():
        docs = list(dg.iter_documents(spec, max_tokens=4000 * 1000))
        for k, f in enumerate(files):
            _write_records(f, [docs[k % len(docs)].tobytes()])
        (root / "done").write_text("1")

    def run() -> None:

        src = grain.sources.ArrayRecordDataSource([str(f) for f in files])
        _ = parse_window(src[len(src) - 1])

    t = ms.median_seconds(run, ms.slow_repeats(p))
    return [
        ms.metric(
            "startup",
            "ArrayRecordDataSource(1,000 files) + 1 record",
            t,
            "s",
            higher_is_better=False,
        )
    ]


def w_pack(p: dict, kind: str) -> list[ms.Metric]:
    """The pack input files (JSONL parsed with stdlib json, .npy) into one array-record file."""
    src = pack.input_path(p, kind)

    def write(out: Path) -> None:
        if kind == "lm":
            _write_records(out, (d.tobytes() for d in pack.iter_jsonl_tokens(src)))
        else:
            _write_records(out, (row.tobytes() for row in np.load(src)))

    variant = f"ArrayRecordWriter({WRITER_OPTIONS}) +fsync"
    return [pack.pack_metric(kind, variant, write, p, SYSTEM)]


def versions() -> dict[str, str]:
    return ms.package_versions("grain", "array-record", "numpy")


WORKLOADS = {
    "write_lm": w_write_lm,
    "write_images": w_write_images,
    "read_single": w_read_single,
    "read_batch_warm": lambda p: w_read_batch(p, cold=False),
    "read_batch_cold": lambda p: w_read_batch(p, cold=True),
    "train_tokens": w_train_tokens,
    "train_images": w_train_images,
    "resume": lambda p: _resume(p, "resume", 1),
    "resume_mix": lambda p: _resume(p, "resume_mix", 4),
    "startup": w_startup,
    "pack_lm": lambda p: w_pack(p, "lm"),
    "pack_images": lambda p: w_pack(p, "images"),
}

if __name__ == "__main__":
    raise SystemExit(ms.worker_main(WORKLOADS, versions))
