"""The PyPI `roxxel` 0.9.14 release (runs in benchmarks/.venvs/roxxel09; same import name as ours).

Its format is one dtype per file, cut into fixed-size blocks: the LM corpus is written as int32
documents (no separator) in its default 4,096-byte blocks; an image record is one block of
12,296 bytes (pixels, then the int64 label), since it has no multi-field records. Its `stream`
shuffles blocks with an O(N) permutation, makes one pass (no epochs), and yields jax.Arrays.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[2]))
from benchmarks import datagen as dg
from benchmarks import measure as ms
from benchmarks import pack

with contextlib.redirect_stdout(io.StringIO()):
    from roxxel import Roxxel

SYSTEM = "roxxel-0.9.14"
RECORD = dg.IMAGE_BYTES + 8


def _Roxxel():
    return Roxxel


def _spec(p: dict) -> dg.DataSpec:
    return dg.SPECS[p.get("spec", "small")]


def _quiet():
    """0.9.14 prints progress lines to stdout; keep them out of the JSON channel."""
    return contextlib.redirect_stdout(io.StringIO())


def _write(path: Path, items, **kw) -> None:
    path.unlink(missing_ok=True)  # its writer appends to an existing file
    with _quiet():
        _Roxxel()(str(path)).write(items, **kw)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def _image_items(img: np.ndarray, lab: np.ndarray):
    for i in range(len(lab)):
        yield img[i].tobytes() + lab[i : i + 1].tobytes()


def ensure_data(spec: dg.DataSpec) -> tuple[Path, Path]:
    root = dg.data_dir(spec, SYSTEM)
    lm, images = root / "lm.rox", root / "images.rox"
    stamp = root / "done"
    if not (stamp.exists() and stamp.read_text() == spec.key()):
        _write(lm, dg.iter_documents(spec), dtype="int32")
        img, lab = dg.images(spec, 0, spec.num_images)
        _write(images, _image_items(img, lab), block_size=RECORD, dtype="uint8")
        stamp.write_text(spec.key())
    return lm, images


def _open(path: Path):
    ds = _Roxxel()(str(path))
    ds.open()
    return ds


def w_write_lm(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    docs = list(dg.iter_documents(spec))
    out = dg.data_dir(spec, SYSTEM) / "write-test.rox"
    mb = sum(d.nbytes for d in docs) / 1e6
    rate = ms.median_rate(lambda: _write(out, iter(docs), dtype="int32"), mb, ms.slow_repeats(p), 0)
    out.unlink(missing_ok=True)
    return [ms.metric("write_lm", "Roxxel.write(docs, dtype=int32) +fsync", rate, "MB/s")]


def w_write_images(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    img, lab = dg.images(spec, 0, spec.num_images)
    out = dg.data_dir(spec, SYSTEM) / "write-test.rox"
    mb = (img.nbytes + lab.nbytes) / 1e6

    def run() -> None:
        _write(out, _image_items(img, lab), block_size=RECORD, dtype="uint8")

    rate = ms.median_rate(run, mb, ms.slow_repeats(p), 0)
    out.unlink(missing_ok=True)
    return [ms.metric("write_images", "Roxxel.write(block_size=12,296) +fsync", rate, "MB/s")]


def w_read_single(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    ds = _open(ensure_data(spec)[1])
    image = lambda i: ds[i][: dg.IMAGE_BYTES].reshape(dg.IMAGE_SHAPE)  # noqa: E731
    rate = ms.read_single_rate(p, spec.num_images, image)
    return [ms.metric("read_single", "ds[i] (memmap block) + copy", rate, "records/s")]


def w_read_batch(p: dict, cold: bool) -> list[ms.Metric]:
    spec = _spec(p)
    path = ensure_data(spec)[1]
    buf = np.empty((dg.IMAGE_BATCH, *dg.IMAGE_SHAPE), np.uint8)
    times = []

    def read(ds, b: list[int]) -> None:
        for r, i in enumerate(b):  # no batched read API: one record at a time
            buf[r] = ds[i][: dg.IMAGE_BYTES].reshape(dg.IMAGE_SHAPE)

    for k in range(5 if cold else 20):
        b = dg.random_indices(spec.num_images, dg.IMAGE_BATCH, 10 + k).tolist()
        ds = _open(path)  # a fresh mapping per batch (mapped pages stay cached)
        if cold:
            ms.drop_cache([path])
        else:
            read(ds, b)
        t0 = time.perf_counter()
        read(ds, b)
        times.append(time.perf_counter() - t0)
        ds.close()
    wl = "read_batch_cold" if cold else "read_batch_warm"
    gbs = buf.nbytes / 1e9 / float(np.median(times))
    return [ms.metric(wl, "loop of ds[i] (no batch API)", gbs, "GB/s")]


def _stream_rate(ds, seq_len: int, batch: int, dtype, n: int) -> tuple[float, str]:
    """Median rate over 3 fresh streams (it makes one pass, so each repeat starts anew)."""
    rates, total = [], 0
    for rep in range(3):
        with _quiet():
            stream = ds.stream(seq_len=seq_len, batch_size=batch, seed=rep, dtype=dtype)
        total = len(stream)
        k = min(n, total - 1)
        if k < 1:
            stream.close()
            raise RuntimeError(f"one pass holds {total} batch(es); the data set is too small")
        it = iter(stream)
        next(it).block_until_ready()
        t0 = time.perf_counter()
        for _ in range(k):
            next(it).block_until_ready()
        rates.append(k / (time.perf_counter() - t0))
        stream.close()
    return float(np.median(rates)), f"one pass = {total} batches; timed up to {n} per repeat"


def w_train_tokens(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    ds = _open(ensure_data(spec)[0])
    rate, note = _stream_rate(ds, dg.SEQ_LEN, dg.TOKEN_BATCH, np.int32, int(p.get("batches", 100)))
    return [
        ms.metric(
            "train_tokens",
            "stream(seq_len=2048, batch=64), jax.Array out",
            rate,
            "batches/s",
            notes=note,
        )
    ]


def w_train_images(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    ds = _open(ensure_data(spec)[1])
    rate, note = _stream_rate(ds, RECORD, dg.IMAGE_BATCH, np.uint8, int(p.get("batches", 50)))
    return [
        ms.metric(
            "train_images",
            "stream(seq_len=12,296 B, batch=256), jax.Array out",
            rate,
            "batches/s",
            notes=note + "; rows are raw records, unparsed",
        )
    ]


def _resume(p: dict, workload: str, num_sources: int) -> list[ms.Metric]:
    spec = _spec(p)
    path = ensure_data(spec)[0]

    def first_batch(step: int) -> None:
        ds = _open(path)
        extra = {f"s{k}": _open(path) for k in range(1, num_sources)}
        kw = {}
        if extra:
            kw = {"mix_datasets": extra, "weights": {"self": 0.4, "s1": 0.3, "s2": 0.2, "s3": 0.1}}
        with _quiet():
            stream = ds.stream(
                seq_len=dg.SEQ_LEN, batch_size=dg.TOKEN_BATCH, seed=0, start_step=step, **kw
            )
            for batch in stream:  # empty when step is past its single pass
                batch.block_until_ready()
                break
        stream.close()

    total = len(_open(path)) * 4096 // (dg.SEQ_LEN * 4 * dg.TOKEN_BATCH)
    notes = f"one pass = ~{total} steps: later steps yield nothing (time to learn that)"
    if num_sources > 1:
        notes += "; mixture replays every step from 0"
    return ms.resume_series(
        workload, first_batch, dg.RESUME_STEPS, dg.step_label, ms.slow_repeats(p), notes
    )


def w_startup(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    root = dg.data_dir(spec, SYSTEM) / "startup-1000"
    root.mkdir(exist_ok=True)
    if not (root / "done").exists():
        docs = list(dg.iter_documents(spec, max_tokens=4000 * 1000))
        for k in range(1000):
            _write(root / f"part_{k:04d}.rox", iter([docs[k % len(docs)]]), dtype="int32")
        (root / "done").write_text("1")

    def run() -> None:
        ds = _open(root)
        _ = np.array(ds[len(ds) - 1])

    t = ms.median_seconds(run, ms.slow_repeats(p))
    return [
        ms.metric(
            "startup", "Roxxel(dir of 1,000 .rox).open() + 1 record", t, "s", higher_is_better=False
        )
    ]


def w_pack(p: dict, kind: str) -> list[ms.Metric]:
    """The pack input files (JSONL parsed with stdlib json, .npy) into one .rox file."""
    src = pack.input_path(p, kind)

    def write(out: Path) -> None:
        if kind == "lm":
            _write(out, pack.iter_jsonl_tokens(src), dtype="int32")
        else:
            rows = (r.tobytes() for r in np.load(src))
            _write(out, rows, block_size=dg.IMAGE_BYTES, dtype="uint8")

    variant = "Roxxel.write(dtype=int32)" if kind == "lm" else "Roxxel.write(block_size=12,288)"
    return [pack.pack_metric(kind, variant + " +fsync", write, p, SYSTEM)]


def versions() -> dict[str, str]:
    return ms.package_versions("roxxel", "jax", "numpy")


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
