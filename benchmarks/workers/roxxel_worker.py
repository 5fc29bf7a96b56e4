"""roxxel's own numbers, through its public API only (open_dataset, get_batch, Loader, ...).

Each workload is a small function; one whose API has not landed yet (an import or attribute
error) reports "not available yet: <error>" instead of a number.
"""

from __future__ import annotations

import gc
import itertools
import sys
import time
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[2]))
from benchmarks import datagen as dg
from benchmarks import measure as ms
from benchmarks import pack, pack_paths

SYSTEM = "roxxel"
LM_SCHEMA = {"tokens": "int32[]"}
IMAGE_SCHEMA = {"image": "uint8[3,64,64]", "label": "int64"}


def _rx():
    """The roxxel package, or a clear 'not available yet' error."""
    try:
        import roxxel
    except Exception as e:
        raise RuntimeError(f"not available yet: {type(e).__name__}: {e}") from e
    return roxxel


def _api(name: str):
    try:
        return getattr(_rx(), name)
    except Exception as e:
        raise RuntimeError(f"not available yet: roxxel.{name}: {type(e).__name__}: {e}") from e


def _loader(source, batch: int, **kw):
    """roxxel.Loader repeating epochs for ever (the benchmarks run past one epoch)."""
    config = _api("LoaderConfig")(num_epochs=None)
    return _api("Loader")(source, batch, seed=0, config=config, **kw)


def _spec(p: dict) -> dg.DataSpec:
    return dg.SPECS[p.get("spec", "small")]


CHUNK = 1024  # records per write_batch call
# Batches per timed repeat: long enough (~0.3 s) that a repeat is not one scheduler blip.
TOKEN_BATCHES, IMAGE_BATCHES, WARMUP_BATCHES = 1000, 300, 20


def _write_lm(out: Path, spec: dg.DataSpec, docs=None, batched: bool = True) -> None:
    rx = _rx()
    schema = rx.Schema.parse(LM_SCHEMA)
    docs = docs if docs is not None else list(dg.iter_documents(spec))
    with rx.DatasetWriter(out, schema, shard_bytes=256 << 20, overwrite=True) as w:
        if batched:
            for s in range(0, len(docs), CHUNK):
                w.write_batch({"tokens": docs[s : s + CHUNK]})
        else:
            for doc in docs:
                w.write({"tokens": doc})


def _write_images(out: Path, img: np.ndarray, lab: np.ndarray, batched: bool = True) -> None:
    rx = _rx()
    schema = rx.Schema.parse(IMAGE_SCHEMA)
    with rx.DatasetWriter(out, schema, shard_bytes=256 << 20, overwrite=True) as w:
        if batched:
            for s in range(0, len(lab), CHUNK):
                w.write_batch({"image": img[s : s + CHUNK], "label": lab[s : s + CHUNK]})
        else:
            for i in range(len(lab)):
                w.write({"image": img[i], "label": lab[i]})


def ensure_data(spec: dg.DataSpec) -> tuple[Path, Path]:
    """The roxxel datasets of the LM corpus and the images, written once per spec."""
    root = dg.data_dir(spec, SYSTEM)
    stamp = root / "done"
    if not (stamp.exists() and stamp.read_text() == spec.key() and _opens(root)):
        _write_lm(root / "lm", spec)
        _write_images(root / "images", *dg.images(spec, 0, spec.num_images))
        stamp.write_text(spec.key())
    return root / "lm", root / "images"


def _still_opens(root: Path) -> bool:
    """Whether a cached dataset exists and still opens (the format may have changed)."""
    rx = _rx()
    try:
        ds = rx.open_dataset(root)
        _ = (ds[0], ds[len(ds) - 1])
    except (rx.RoxxelError, OSError, IndexError):
        return False
    return True


def _opens(root: Path) -> bool:
    """Whether the cached datasets still open (the format may change between versions)."""
    rx = _rx()
    try:
        for name in ("lm", "images"):
            ds = rx.open_dataset(root / name)
            _ = (ds[0], ds[len(ds) - 1])  # shards map lazily: touch the first and the last
    except (rx.RoxxelError, OSError):
        return False
    return True


def w_write_lm(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    docs = list(dg.iter_documents(spec))
    mb = sum(d.nbytes for d in docs) / 1e6
    out = dg.data_dir(spec, SYSTEM) / "write-test-lm"
    rows = []
    for batched, how in ((True, "write_batch"), (False, "write per record")):
        rate = ms.median_rate(
            lambda b=batched: _write_lm(out, spec, docs, b), mb, ms.write_repeats(p), 1
        )
        rows.append(
            ms.metric("write_lm", f"DatasetWriter.{how} (atomic: fsync + rename)", rate, "MB/s")
        )
    # Token corpora often arrive as one array plus document lengths (as the baseline's blob):
    # prepared outside the timing, like that blob.
    chunks = [docs[s : s + CHUNK] for s in range(0, len(docs), CHUNK)]
    ragged = [_rx().Ragged(np.concatenate(c), np.array([d.size for d in c])) for c in chunks]

    def write_ragged() -> None:
        with _rx().DatasetWriter(out, LM_SCHEMA, shard_bytes=256 << 20, overwrite=True) as w:
            for chunk in ragged:
                w.write_batch({"tokens": chunk})

    rate = ms.median_rate(write_ragged, mb, ms.write_repeats(p), 1)
    variant = "DatasetWriter.write_batch of Ragged (values + lengths) (atomic: fsync + rename)"
    rows.append(ms.metric("write_lm", variant, rate, "MB/s"))
    return rows


def w_write_images(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    img, lab = dg.images(spec, 0, spec.num_images)
    out = dg.data_dir(spec, SYSTEM) / "write-test-images"
    mb = (img.nbytes + lab.nbytes) / 1e6
    rows = []
    for batched, how in ((True, "write_batch"), (False, "write per record")):
        rate = ms.median_rate(
            lambda b=batched: _write_images(out, img, lab, b), mb, ms.write_repeats(p), 1
        )
        rows.append(
            ms.metric("write_images", f"DatasetWriter.{how} (atomic: fsync + rename)", rate, "MB/s")
        )
    return rows


def w_read_single(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    ds = _rx().open_dataset(ensure_data(spec)[1])
    rate = ms.read_single_rate(p, spec.num_images, lambda i: ds[i]["image"])
    return [ms.metric("read_single", "ds[i] (two fields) + copy of the image", rate, "records/s")]


def w_read_batch(p: dict, cold: bool) -> list[ms.Metric]:
    spec = _spec(p)
    path = ensure_data(spec)[1]
    batches = [dg.random_indices(spec.num_images, dg.IMAGE_BATCH, 10 + k) for k in range(20)]
    out = _rx().open_dataset(path).get_batch(batches[0], fields=["image"])
    files = ms.files_under(path)
    times = []
    for b in batches[: 5 if cold else 20]:
        ds = _rx().open_dataset(path)  # a fresh mapping per batch (mapped pages stay cached)
        if cold:
            ms.drop_cache(files)
        else:
            ds.get_batch(b, fields=["image"], out=out)
        t0 = time.perf_counter()
        ds.get_batch(b, fields=["image"], out=out)
        times.append(time.perf_counter() - t0)
        del ds
    wl = "read_batch_cold" if cold else "read_batch_warm"
    gbs = out["image"].nbytes / 1e9 / float(np.median(times))
    return [ms.metric(wl, "get_batch(256 random, out=reused)", gbs, "GB/s")]


def _loader_rate(loader, n: int, repeats: int) -> float:
    it = iter(loader)
    for _ in range(WARMUP_BATCHES):  # fill the pipeline, first transfers, page cache
        next(it)

    def run() -> None:
        for _ in range(n):
            next(it)

    return ms.median_rate(run, n, repeats, 0)


def w_train_tokens(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    ds = _rx().open_dataset(ensure_data(spec)[0])
    windows = _api("TokenWindows")(ds, "tokens", dg.SEQ_LEN)
    n, reps = int(p.get("batches", TOKEN_BATCHES)), int(p.get("repeats", 5))
    res = []
    with _loader(windows, dg.TOKEN_BATCH) as loader:
        res.append(
            ms.metric(
                "train_tokens",
                "Loader(TokenWindows), numpy out",
                _loader_rate(loader, n, reps),
                "batches/s",
            )
        )
    res.append(_jax_variant("train_tokens", windows, dg.TOKEN_BATCH, n, reps))
    try:
        with _loader(_mixture(ds, 4, 1), dg.TOKEN_BATCH) as loader:
            rate = _loader_rate(loader, n, reps)
        res.append(
            ms.metric(
                "train_tokens",
                "Loader(Mixture of 4 TokenWindows), numpy out",
                rate,
                "batches/s",
                notes="issue 4: at most 10% below one source",
            )
        )
    except Exception as e:  # the mixture lands separately: keep the other numbers
        res.append(ms.metric("train_tokens", "Loader(Mixture of 4)", None, "", notes=_short(e)))
    return res


def _mixture(ds, num_sources: int, num_phases: int):
    """`num_sources` token-window views of one dataset, weights 1..K per phase, rotating."""
    win = _api("TokenWindows")
    sources = {f"s{k}": win(ds, "tokens", dg.SEQ_LEN) for k in range(num_sources)}
    phase = _api("Phase")
    phases = [
        phase(
            weights={f"s{k}": 1 + (k + i) % num_sources for k in range(num_sources)},
            end_step=None if i == num_phases - 1 else 10 ** (i + 3),
        )
        for i in range(num_phases)
    ]
    return _api("Mixture")(sources, phases, batch_size=dg.TOKEN_BATCH, seed=0)


def _jax_variant(workload: str, source, batch: int, n: int, reps: int) -> ms.Metric:
    """The same loader yielding jax.Arrays placed with a one-device sharding."""
    variant = "Loader, jax.Array out (1 device)"
    try:
        import jax
        from jax.sharding import SingleDeviceSharding

        sharding = SingleDeviceSharding(jax.devices()[0])
        with _loader(source, batch, sharding=sharding) as loader:
            rate = _loader_rate(loader, n, reps)
    except Exception as e:  # report the variant as missing, keep the numpy number
        return ms.metric(workload, variant, None, "", notes=_short(e))
    return ms.metric(workload, variant, rate, "batches/s")


def w_train_images(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    ds = _rx().open_dataset(ensure_data(spec)[1])
    n, reps = int(p.get("batches", IMAGE_BATCHES)), int(p.get("repeats", 5))
    out = ds.get_batch(np.arange(dg.IMAGE_BATCH))

    def by_hand() -> None:
        for s in range(n):
            ds.get_batch(dg.random_indices(spec.num_images, dg.IMAGE_BATCH, 1000 + s), out=out)

    by_hand_row = ms.metric(
        "train_images",
        "get_batch, random rows (no Loader)",
        ms.median_rate(by_hand, n, reps),
        "batches/s",
    )
    try:
        with _loader(ds, dg.IMAGE_BATCH) as loader:
            rate = _loader_rate(loader, n, reps)
        res = [ms.metric("train_images", "Loader, numpy out", rate, "batches/s")]
        res.append(_jax_variant("train_images", ds, dg.IMAGE_BATCH, n, reps))
    except Exception as e:  # the Loader lands separately: keep the get_batch number
        res = [ms.metric("train_images", "Loader", None, "", notes=_short(e))]
    res.append(by_hand_row)
    return res


def w_train_images_cold(p: dict) -> list[ms.Metric]:
    """The Loader's first batches right after the dataset's files left the page cache."""
    spec = _spec(p)
    path = ensure_data(spec)[1]
    files = ms.files_under(path)
    n = min(int(p.get("cold_batches", 10)), spec.num_images // dg.IMAGE_BATCH)
    rates = []
    loader_cls, config = _api("Loader"), _api("LoaderConfig")(num_epochs=None)
    with loader_cls(_rx().open_dataset(path), dg.IMAGE_BATCH, config=config) as warm:
        next(iter(warm))  # imports and first-use costs stay outside the timings
    for rep in range(ms.slow_repeats(p)):
        ds = _rx().open_dataset(path)  # opened before eviction, as the memmap baseline's file
        with loader_cls(ds, dg.IMAGE_BATCH, seed=rep + 1, config=config) as loader:
            ms.drop_cache(files)
            t0 = time.perf_counter()
            it = iter(loader)
            for _ in range(n):
                next(it)
            rates.append(n / (time.perf_counter() - t0))
        del ds, it, loader
        gc.collect()  # unmap this repeat's pages before the next eviction
    return [
        ms.metric(
            "train_images_cold",
            "Loader (readahead of the known order)",
            float(np.median(rates)),
            "batches/s",
            notes=f"first {n} batches",
        )
    ]


def _first_then_mapped(source_of, batch: int, n: int, reps: int) -> tuple[list[float], list[float]]:
    """Per repeat: the rate of `n` batches through a fresh mapping of the dataset (a first
    pass: every page is touched for the first time), then of the same `n` batches again
    through that mapping (every page they need already mapped). The file stays in the page
    cache throughout; only the mappings differ."""
    loader_cls, config = _api("Loader"), _api("LoaderConfig")(num_epochs=None)
    first, mapped = [], []
    for rep in range(reps):
        source = source_of()  # a new Dataset: new mmaps, no page of them mapped yet
        for rates in (first, mapped):
            with loader_cls(source, batch, seed=rep + 1, config=config) as loader:
                it = iter(loader)
                for _ in range(3):  # thread start, buffers, first-use costs: not timed
                    next(it)
                t0 = time.perf_counter()
                for _ in range(n):
                    next(it)
                rates.append(n / (time.perf_counter() - t0))
            del it, loader
        del source
        gc.collect()  # unmap this repeat's shards before the next one opens them again
    return first, mapped


def w_train_first_pass(p: dict) -> list[ms.Metric]:
    """Issue 16 part 1: a first pass over a mapped dataset vs the same batches once every
    page they need is mapped, for token windows and shuffled image records (warm cache)."""
    spec = _spec(p)
    lm, images = ensure_data(spec)
    rx, reps = _rx(), max(7, int(p.get("repeats", 5)))
    for path in (lm, images):  # the files in the page cache: only the mapping is cold
        for file in ms.files_under(path):
            file.read_bytes()
    # at most half of each file's bytes, so the pass never runs out of unmapped pages
    num_tokens = max(8, min(400, spec.lm_bytes // 2 // (dg.TOKEN_BATCH * (dg.SEQ_LEN + 1) * 4)))
    num_images = max(4, min(100, spec.num_images // 2 // dg.IMAGE_BATCH))
    cases = (
        (
            "token windows 64 x 2048",
            dg.TOKEN_BATCH,
            num_tokens,
            lambda: _api("TokenWindows")(rx.open_dataset(lm), "tokens", dg.SEQ_LEN),
        ),
        ("images 256 x 3x64x64", dg.IMAGE_BATCH, num_images, lambda: rx.open_dataset(images)),
    )
    rows = []
    for name, batch, n, source_of in cases:
        first, mapped = _first_then_mapped(source_of, batch, n, reps)
        ratios = [a / b for a, b in zip(first, mapped, strict=True)]
        note = (
            f"{n} batches after 3; ratio per repeat: median {np.median(ratios):.2f} of "
            + ", ".join(f"{r:.2f}" for r in ratios)
        )
        rows.append(
            ms.metric(
                "train_first_pass",
                f"{name}: first pass (fresh mapping)",
                float(np.median(first)),
                "batches/s",
                notes=note,
            )
        )
        rows.append(
            ms.metric(
                "train_first_pass",
                f"{name}: same batches, pages mapped",
                float(np.median(mapped)),
                "batches/s",
            )
        )
    return rows


def _busy_work(rounds: int):
    """A numpy host transform of `rounds` in-place passes over the images (GIL released)."""

    def transform(batch, rng):
        image = batch["image"]
        bump = rng.integers(0, 4, dtype=np.uint8)
        for _ in range(rounds):
            np.add(image, bump, out=image)
        return batch

    return transform


def w_train_host_threads(p: dict) -> list[ms.Metric]:
    """Issue 14: a host transform that costs about what the batch read costs, run with
    ``host_threads=2`` vs 1 (shuffled images, numpy out), interleaved repeats. Each host
    thread reads and transforms whole batches. The bound: the same numpy work (a take of
    the batch's rows from the mapped shard, then the passes) in 1 and 2 bare threads."""
    spec = _spec(p)
    ds = _rx().open_dataset(ensure_data(spec)[1])
    # 600 batches a repeat (~0.2-0.3 s): the calibrated passes and the ratio steadier
    n, reps = int(p.get("batches", IMAGE_BATCHES)) * 2, max(3, int(p.get("repeats", 5)))
    loader_cls, config_cls = _api("Loader"), _api("LoaderConfig")

    def loader(threads: int | None, rounds: int):
        config = config_cls(
            num_epochs=None, host_transform=_busy_work(rounds), host_threads=threads
        )
        return loader_cls(ds, dg.IMAGE_BATCH, seed=0, config=config)

    read_s = _steady_read_seconds(loader(None, 0))
    rounds = max(1, round(read_s / _pass_seconds((dg.IMAGE_BATCH, *ds.schema["image"].shape))))
    last = None
    rates: dict[int | None, list[float]] = {2: [], 1: [], None: []}
    bare: dict[int, list[float]] = {2: [], 1: []}
    flat = ds.shard(0).columns["image"].flat  # the images' mapped column
    for _ in range(reps):
        for threads in rates:
            with loader(threads, rounds) as timed:
                rates[threads].append(_loader_rate(timed, n, 1))
                if threads == 2:
                    last = timed.stats()
        for threads in bare:
            bare[threads].append(_bare_threads_rate(flat, dg.IMAGE_BATCH, rounds, threads, n))
    assert last is not None
    note = (
        f"transform = {rounds} in-place np.add passes, calibrated to one batch read "
        f"({1e3 * read_s:.2f} ms, one thread, warm); 2 threads: gather "
        f"{1e3 * last.gather_s:.2f} ms, transform {1e3 * last.transform_s:.2f} ms per batch"
    )
    return [
        ms.metric(
            "train_host_threads",
            f"Loader, host transform, host_threads={t}",
            float(np.median(r)),
            "batches/s",
            notes=note if t == 2 else "",
        )
        for t, r in rates.items()
    ] + [
        ms.metric(
            "train_host_threads",
            f"bare numpy: take a batch's rows, {rounds} np.add passes, {t} thread(s)",
            float(np.median(r)),
            "batches/s",
            notes="whole batches per thread, no Loader: the machine's bound" if t == 2 else "",
        )
        for t, r in bare.items()
    ]


def _steady_read_seconds(loader, warmup: int = 100, n: int = 600) -> float:
    """The loader's batch read (`LoaderStats.gather_s`) over `n` batches after `warmup`:
    the steady cost, without the first batches' page faults and thread start."""
    with loader:
        it = iter(loader)
        for _ in range(warmup):
            next(it)
        before = loader.stats()
        for _ in range(n):
            next(it)
        after = loader.stats()
    made = after.num_batches - before.num_batches
    return (after.gather_s * after.num_batches - before.gather_s * before.num_batches) / made


def _pass_seconds(shape: tuple[int, ...], repeats: int = 200) -> float:
    """One in-place np.add pass over a uint8 array of `shape` (a batch's images), median."""
    image = np.zeros(shape, np.uint8)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        np.add(image, 1, out=image)
        times.append(time.perf_counter() - began)
    return float(np.median(times))


def _bare_threads_rate(flat: np.ndarray, batch: int, rounds: int, threads: int, n: int) -> float:
    """Batches/s of `threads` threads that each take random rows of `flat` into a batch
    buffer of their own, then make `rounds` in-place passes over it: n batches in all."""
    import threading

    rng = np.random.default_rng(0)
    picks = [rng.integers(0, len(flat), batch) for _ in range(16)]

    def work(t: int) -> None:
        out = np.empty((batch, *flat.shape[1:]), flat.dtype)
        for k in range(t, n, threads):
            np.take(flat, picks[k % len(picks)], axis=0, out=out)
            for _ in range(rounds):
                np.add(out, 1, out=out)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return n / (time.perf_counter() - t0)


def w_train_step(p: dict) -> list[ms.Metric]:
    """Issue 3: a jitted step ~10x the loader's batch time, fed by the Loader (jax.Array
    out) vs fed one prebuilt device array, in the same process. XLA runs single-threaded
    (the stand-in for the device: one core), the loader's thread has the other core."""
    import os

    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
    )
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    spec = _spec(p)
    windows = _api("TokenWindows")(_rx().open_dataset(ensure_data(spec)[0]), "tokens", dg.SEQ_LEN)
    sharding = SingleDeviceSharding(jax.devices()[0])
    n = int(p.get("step_batches", 60))
    with _loader(windows, dg.TOKEN_BATCH, sharding=sharding) as loader:
        batch_s = 1 / _loader_rate(loader, 100, 3)
        it = iter(loader)
        prebuilt = next(it)["tokens"]
        step, iters = _calibrated_step(jax, jnp, prebuilt, 10 * batch_s)

        def fed(source) -> None:
            state = jnp.zeros((64, 256), jnp.float32)
            for tokens in itertools.islice(source, n):
                state = step(state, tokens)
            state.block_until_ready()

        rates: dict[str, list[float]] = {"loader": [], "prebuilt": []}
        for _ in range(int(p.get("step_rounds", 5))):  # interleaved: drift hits both alike
            rates["prebuilt"].append(n / ms.timed(lambda: fed(itertools.repeat(prebuilt))))
            rates["loader"].append(n / ms.timed(lambda: fed(b["tokens"] for b in it)))
    note = f"step {iters} matmul rounds = {1e3 * 10 * batch_s:.2f} ms, ~10x the loader's batch"
    return [
        ms.metric(
            "train_step",
            "jitted step fed by the Loader",
            float(np.median(rates["loader"])),
            "steps/s",
            notes=note,
        ),
        ms.metric(
            "train_step",
            "jitted step fed by a prebuilt device array",
            float(np.median(rates["prebuilt"])),
            "steps/s",
            notes="XLA single-threaded",
        ),
    ]


def _calibrated_step(jax, jnp, tokens, target_s: float):
    """A jitted ``step(state, tokens)`` taking about `target_s` seconds, and its rounds."""
    weights = jax.random.normal(jax.random.key(0), (256, 256), jnp.float32) / 16

    def make(rounds: int):
        def step(state, toks):
            state = state + toks[:, :256].astype(jnp.float32) * 1e-6
            body = lambda _, s: jnp.tanh(s @ weights)  # noqa: E731
            return jax.lax.fori_loop(0, rounds, body, state)

        return jax.jit(step)

    state, rounds = jnp.zeros((64, 256), jnp.float32), 64
    for _ in range(4):  # measure, rescale the rounds, measure again
        step = make(rounds)
        step(state, tokens).block_until_ready()
        took = ms.median_seconds(lambda s=step: s(state, tokens).block_until_ready(), 5)
        rounds = max(1, round(rounds * target_s / took))
    return make(rounds), rounds


def w_train_memory(p: dict) -> list[ms.Metric]:
    """Issue 3: resident memory over a whole epoch of shuffled image batches (jax.Array out,
    each batch dropped after use). One epoch warms up (the ring of host buffers fills), the
    next is sampled at its start, middle and end: anonymous RSS, and total RSS, which also
    counts the mapped dataset's pages as the epochs touch them."""
    import jax
    from jax.sharding import SingleDeviceSharding

    ds = _rx().open_dataset(ensure_data(_spec(p))[1])
    config = _api("LoaderConfig")(num_epochs=2)
    sharding = SingleDeviceSharding(jax.devices()[0])
    loader = _api("Loader")(ds, dg.IMAGE_BATCH, seed=3, sharding=sharding, config=config)
    num = (loader.num_steps or 2) // 2  # steps per epoch
    marks = {
        0: "first batch of the warm-up epoch",
        num: "epoch start",
        num + num // 2: "epoch middle",
        2 * num - 1: "epoch end",
    }
    samples: dict[str, tuple[float, float]] = {}
    with loader:
        for k, batch in enumerate(loader):
            jax.block_until_ready(batch)
            del batch
            if k in marks:
                samples[marks[k]] = (_anon_mib(), ms.memory().get("rss_mib", float("nan")))
    note = f"epoch of {num} batches of {dg.IMAGE_BATCH} images"
    rows = [
        ms.metric(
            "train_memory", f"anon RSS, {name}", anon, "MiB", higher_is_better=False, notes=note
        )
        for name, (anon, _) in samples.items()
    ]
    start, end = samples["epoch start"], samples["epoch end"]
    size = sum(f.stat().st_size for f in ms.files_under(ds.path)) / 2**20
    rows.append(
        ms.metric(
            "train_memory",
            "anon RSS growth over the epoch",
            end[0] - start[0],
            "MiB",
            higher_is_better=False,
        )
    )
    rows.append(
        ms.metric(
            "train_memory",
            "total RSS growth over the epoch (incl. mapped pages)",
            end[1] - start[1],
            "MiB",
            higher_is_better=False,
            notes=f"dataset files {size:.0f} MiB",
        )
    )
    return rows


def _short(e: Exception) -> str:
    msg = str(e) if str(e).startswith("not available yet") else f"{type(e).__name__}: {e}"
    return msg[:300]


def w_resume(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    path = ensure_data(spec)[0]

    def first_batch(step: int) -> None:
        ds = _rx().open_dataset(path)
        windows = _api("TokenWindows")(ds, "tokens", dg.SEQ_LEN)
        with _loader(windows, dg.TOKEN_BATCH, start_step=step) as loader:
            next(iter(loader))

    return ms.resume_series(
        "resume",
        first_batch,
        (*dg.RESUME_STEPS, 10**9, 10**12),  # issue 3 asks for 1e9 and 1e12 too
        dg.step_label,
        ms.slow_repeats(p),
        "open + Loader(start_step) + 1 batch",
    )


def w_resume_mix(p: dict) -> list[ms.Metric]:
    """A 4-source mixture over the LM corpus (the same dataset seen as four sources)."""
    spec = _spec(p)
    path = ensure_data(spec)[0]

    def first_batch(step: int, num_sources: int = 4, num_phases: int = 1) -> None:
        mix = _mixture(_rx().open_dataset(path), num_sources, num_phases)
        with _loader(mix, dg.TOKEN_BATCH, start_step=step) as loader:
            next(iter(loader))

    notes = "open + Mixture + Loader(start_step) + 1 batch"
    res = ms.resume_series(
        "resume_mix", first_batch, dg.RESUME_STEPS, dg.step_label, ms.slow_repeats(p), notes
    )
    big = lambda step: first_batch(step, 32, 8)  # noqa: E731  (issue 4's seek target)
    res += ms.resume_series(
        "resume_mix",
        big,
        (0, 10**9),
        lambda s: f"32 sources, 8 phases: {dg.step_label(s)}",
        ms.slow_repeats(p),
        notes,
    )
    return res


def w_startup(p: dict) -> list[ms.Metric]:
    spec = _spec(p)
    rx = _rx()
    root = dg.data_dir(spec, SYSTEM) / "startup-1000"
    if not _still_opens(root):
        docs = list(dg.iter_documents(spec, max_tokens=4000 * 1000))
        with rx.DatasetWriter(root, rx.Schema.parse(LM_SCHEMA), shard_bytes=1, overwrite=True) as w:
            for k in range(1000):  # shard_bytes=1: every record closes its own shard
                w.write({"tokens": docs[k % len(docs)]})

    def run() -> None:
        ds = rx.open_dataset(root)
        _ = np.array(ds[len(ds) - 1]["tokens"])

    t = ms.median_seconds(run, ms.slow_repeats(p))
    n = len(rx.open_dataset(root).shards)
    return [
        ms.metric(
            "startup", f"open_dataset ({n} shards) + 1 record", t, "s", higher_is_better=False
        )
    ]


def _anon_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def w_open_memory(p: dict) -> list[ms.Metric]:
    """Issue 2: anonymous memory of opening 10^7 records in 100 shards, and of reading them."""
    rx = _rx()
    spec = _spec(p)
    num, shards = (10**7, 100) if spec.name != "tiny" else (10**5, 100)
    root = dg.data_dir(spec, SYSTEM) / f"memory-{num}"
    if not _still_opens(root):
        per = num // shards
        with rx.DatasetWriter(
            root, {"label": "int64", "tokens": "int32[]"}, shard_bytes=per * 12
        ) as w:
            for start in range(0, num, per):
                labels = np.arange(start, start + per)
                w.write_batch({"label": labels, "tokens": [labels[:1].astype(np.int32)] * per})
    rng = np.random.default_rng(0)
    before = _anon_mib()
    ds = rx.open_dataset(root)
    opened = _anon_mib()
    for _ in range(200):
        ds.get_batch(rng.integers(0, len(ds), 256))
    for i in rng.integers(0, len(ds), 20000).tolist():
        ds[i]
    read = _anon_mib()
    for _ in range(2000):
        ds.get_batch(rng.integers(0, len(ds), 256))
    more = _anon_mib()
    note = f"{len(ds):,} records in {ds.num_shards} shards"
    return [
        ms.metric(
            "open_memory",
            "anon MiB added by open_dataset",
            opened - before,
            "MiB",
            higher_is_better=False,
            notes=note,
        ),
        ms.metric(
            "open_memory",
            "anon MiB added by mapping every shard + 70k reads",
            read - opened,
            "MiB",
            higher_is_better=False,
        ),
        ms.metric(
            "open_memory",
            "anon MiB added by 512k more reads",
            more - read,
            "MiB",
            higher_is_better=False,
        ),
    ]


def w_verify_cost(p: dict) -> list[ms.Metric]:
    """Issue 2: what checksum verification costs, on reads and for a whole dataset."""
    rx = _rx()
    images = ensure_data(_spec(p))[1]
    rng = np.random.default_rng(0)
    rows = []
    for verify in (False, True):
        ds = rx.open_dataset(images, verify=verify)
        out = ds.batch_buffers(256)
        batches = [rng.integers(0, len(ds), 256) for _ in range(64)]
        t = ms.median_seconds(
            lambda d=ds, o=out, bs=batches: [d.get_batch(b, out=o) for b in bs], 5
        )
        rows.append(
            ms.metric("verify_cost", f"get_batch(256 images), verify={verify}", 64 / t, "batches/s")
        )
    ds = rx.open_dataset(images)
    gb = sum(s.num_bytes for s in ds.shards) / 1e9
    t = ms.median_seconds(ds.verify, 3)
    rows.append(ms.metric("verify_cost", "Dataset.verify() of the image set", gb / t, "GB/s"))
    return rows


def versions() -> dict[str, str]:
    out = {"numpy": np.__version__}
    try:
        out["roxxel"] = _rx().__version__
    except Exception as e:
        out["roxxel"] = f"unavailable ({e})"[:120]
    return out


WORKLOADS = {
    "write_lm": w_write_lm,
    "write_images": w_write_images,
    "read_single": w_read_single,
    "read_batch_warm": lambda p: w_read_batch(p, cold=False),
    "read_batch_cold": lambda p: w_read_batch(p, cold=True),
    "train_tokens": w_train_tokens,
    "train_images": w_train_images,
    "train_images_cold": w_train_images_cold,
    "train_first_pass": w_train_first_pass,
    "train_host_threads": w_train_host_threads,
    "train_step": w_train_step,
    "train_memory": w_train_memory,
    "resume": w_resume,
    "resume_mix": w_resume_mix,
    "startup": w_startup,
    "open_memory": w_open_memory,
    "verify_cost": w_verify_cost,
    "pack_lm": lambda p: pack.roxxel_pack(p, "lm"),
    "pack_images": lambda p: pack.roxxel_pack(p, "images"),
    "pack_paths": pack_paths.pack_paths,
}

if __name__ == "__main__":
    raise SystemExit(ms.worker_main(WORKLOADS, versions))
