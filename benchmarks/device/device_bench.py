"""Device check for a lent H100/H200: host-to-device bandwidth and a loader-fed jitted step.

Measures, in a few minutes, and writes a markdown table to ``$OUT/device.md`` (+ ``.json``):
1. `jax.device_put` bandwidth from pageable numpy (a fresh array per call, and one array reused,
   as the loader's ring of preallocated buffers does), and through a pinned-host staging copy
   where the backend has one;
2. roxxel's Loader (images 256 x 3x64x64, token windows 64 x 2048) placing batches on the device;
3. a jitted step calibrated to take ~10x the loader's batch time, fed by the Loader versus fed
   from batches already resident on the device (issue 3's target: at least 0.95x);
4. issue 16's rows: `device_put` from pageable, page-locked (``cudaHostRegister``, as the
   Loader's pinned ring) and ``pinned_host`` memory at 0.5 / 3 / 9.6 / 38 MiB; the Loader ->
   device for 0.5 MiB token batches (64 x 2049 int32), 3 MiB (256 x 3x64x64) and 9.6 MiB
   (64 x 3x224x224) image batches, with its pinned ring and without (``pin_host=False``),
   against the pinned-host and pageable rates; a jitted step fed by the Loader vs fed from
   device-resident batches for steps of 2x and 8x the Loader's batch time, with the token
   and the 9.6 MiB image batches; each with the Loader's `stats()` (where its time went).

``--cpu-smoke`` runs the same code on the CPU backend with tiny sizes, in seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def _stub_zstandard() -> None:
    """The accelerator image lacks zstandard; these checks never compress, so stand in for it."""
    try:
        import zstandard  # noqa: F401
    except ImportError:
        mod = types.ModuleType("zstandard")

        class ZstdError(Exception):
            pass

        class _Missing:
            def __init__(self, *args, **kwargs) -> None:
                pass

            def __getattr__(self, name: str):
                raise ImportError("zstandard is not installed on this machine")

        mod.ZstdError, mod.ZstdCompressor, mod.ZstdDecompressor = ZstdError, _Missing, _Missing
        mod.frame_content_size = lambda frame: -1
        sys.modules["zstandard"] = mod


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cpu-smoke", action="store_true", help="CPU backend, tiny sizes")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default $OUT)")
    ap.add_argument("--seconds", type=float, default=2.0, help="target seconds per measurement")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also write a jax.profiler trace of each loader-fed step row (issue 16) to OUT/trace",
    )
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
        args.seconds = min(args.seconds, 0.2)
    default = os.environ.get("OUT") or str(REPO / "benchmarks" / ".work" / "device")
    args.out = args.out or Path(default)
    return args


def timed_rate(fn, seconds: float, min_iters: int = 3) -> tuple[float, int]:
    """Median seconds per call of `fn` over ~`seconds` (after one warm-up), and the call count."""
    fn()
    times: list[float] = []
    t_end = time.perf_counter() + seconds
    while len(times) < min_iters or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 10_000:
            break
    return statistics.median(times), len(times)


def h2d_rows(jax, dev, sizes: list[int], seconds: float) -> list[dict]:
    rows = []
    for nbytes in sizes:
        reused = np.ones(nbytes, np.uint8)

        def fresh(n: int = nbytes) -> None:
            jax.device_put(np.full(n, 1, np.uint8), dev).block_until_ready()

        def reuse(reused: np.ndarray = reused) -> None:
            jax.device_put(reused, dev).block_until_ready()

        for name, fn in (
            ("pageable, fresh array per call", fresh),
            ("pageable, one preallocated array reused", reuse),
        ):
            t, n = timed_rate(fn, seconds)
            rows.append(_row("h2d", name, nbytes, nbytes / t / 1e9, "GB/s", n))
        rows.append(_pinned_row(jax, dev, reused, seconds))
    return rows


def _pinned_row(jax, dev, host: np.ndarray, seconds: float) -> dict:
    """Host array staged once in pinned host memory, then copied to the device each call."""
    from jax.sharding import SingleDeviceSharding

    name = "pinned_host -> device (the pinned copy made once, untimed)"
    try:
        pinned = jax.device_put(host, SingleDeviceSharding(dev, memory_kind="pinned_host"))
        target = SingleDeviceSharding(dev, memory_kind="device")
        t, n = timed_rate(lambda: jax.device_put(pinned, target).block_until_ready(), seconds)
    except Exception as e:  # not every backend has a pinned_host memory space
        return _row("h2d", name, host.nbytes, None, "", 0, f"{type(e).__name__}: {e}"[:160])
    return _row("h2d", name, host.nbytes, host.nbytes / t / 1e9, "GB/s", n)


def _row(part: str, what: str, nbytes: int, value, unit: str, n: int, note: str = "") -> dict:
    return {
        "part": part,
        "what": what,
        "bytes": nbytes,
        "value": value,
        "unit": unit,
        "iters": n,
        "note": note,
    }


def make_datasets(root: Path, num_images: int, num_tokens: int):
    import roxxel
    from benchmarks import datagen as dg

    spec = dg.DataSpec("device", lm_tokens=num_tokens, num_images=num_images)
    img_schema = roxxel.Schema.parse({"image": "uint8[3,64,64]", "label": "int64"})
    with roxxel.DatasetWriter(root / "images", img_schema, overwrite=True) as w:
        for imgs, labs in dg.iter_images(spec):
            for i in range(len(labs)):
                w.write({"image": imgs[i], "label": labs[i]})
    with roxxel.DatasetWriter(
        root / "lm", roxxel.Schema.parse({"tokens": "int32[]"}), overwrite=True
    ) as w:
        for doc in dg.iter_documents(spec):
            w.write({"tokens": doc})
    return roxxel.open_dataset(root / "images"), roxxel.open_dataset(root / "lm")


def loader_rows(jax, dev, sources: dict, seconds: float) -> tuple[list[dict], dict]:
    """Loader batches/s placed on `dev`, per source; also the per-batch seconds."""
    from jax.sharding import SingleDeviceSharding

    import roxxel

    rows, per_batch = [], {}
    for name, (source, batch) in sources.items():
        loader = _loader(roxxel, source, batch, SingleDeviceSharding(dev))
        it = iter(loader)

        def step(it=it) -> None:
            jax.block_until_ready(next(it))

        t, n = timed_rate(step, seconds)
        loader.close()
        per_batch[name] = t
        nbytes = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in _shapes(source, batch))
        rows.append(
            _row(
                "loader",
                f"Loader -> device: {name}",
                nbytes,
                1 / t,
                "batches/s",
                n,
                f"{nbytes / t / 1e9:.2f} GB/s of batch data",
            )
        )
    return rows, per_batch


def _loader(roxxel, source, batch: int, sharding):
    config = roxxel.LoaderConfig(num_epochs=None)
    return roxxel.Loader(source, batch, seed=0, sharding=sharding, config=config)


def _shapes(source, batch: int):
    if hasattr(source, "width"):  # token windows
        return [((batch, source.width), np.int32)]
    return [((batch, 3, 64, 64), np.uint8), ((batch,), np.int64)]


def make_step(jax, dim: int):
    """A jitted step on an image batch: `reps` rounds of two bf16 matmuls, (B, 12288) x (12288,
    dim) and back; `reps` is a traced argument, so calibrating it compiles nothing new."""
    jnp = jax.numpy
    w = jnp.ones((3 * 64 * 64, dim), jnp.bfloat16) * 1e-3
    v = jnp.ones((dim, 3 * 64 * 64), jnp.bfloat16) * 1e-3

    @jax.jit
    def step(batch, reps):
        x = batch["image"].reshape(batch["image"].shape[0], -1).astype(jnp.bfloat16)
        x = jax.lax.fori_loop(0, reps, lambda _, x: jnp.tanh(x @ w) @ v, x)
        return x.astype(jnp.float32).mean() + batch["label"].astype(jnp.float32).mean()

    return step


def feed_rows(jax, dev, images, per_batch: float, seconds: float, smoke: bool) -> list[dict]:
    """Calibrate a step to ~10x the loader's batch time; compare loader-fed vs device-resident."""
    from jax.sharding import SingleDeviceSharding

    import roxxel

    sh = SingleDeviceSharding(dev)
    resident = [
        jax.device_put(images.get_batch(np.arange(k * 256, (k + 1) * 256) % len(images)), sh)
        for k in range(4)
    ]
    step, reps = make_step(jax, 256 if smoke else 4096), 1
    for _ in range(16):
        t_step, _ = timed_rate(lambda r=reps: step(resident[0], r).block_until_ready(), seconds / 4)
        if t_step >= 10 * per_batch:
            break
        reps *= 2
    k = [0]

    def on_device() -> None:
        k[0] += 1
        step(resident[k[0] % 4], reps).block_until_ready()

    t_dev, n_dev = timed_rate(on_device, seconds)
    loader = _loader(roxxel, images, 256, sh)
    it = iter(loader)
    t_fed, n_fed = timed_rate(lambda: step(next(it), reps).block_until_ready(), seconds)
    loader.close()
    note = f"step = {reps} x 2 bf16 matmuls, {t_dev / per_batch:.1f}x the loader's batch time"
    return [
        _row(
            "step", "jitted step, device-resident batches", 0, t_dev * 1e3, "ms/step", n_dev, note
        ),
        _row("step", "jitted step, fed by roxxel.Loader", 0, t_fed * 1e3, "ms/step", n_fed),
        _row(
            "step",
            "loader-fed speed / device-resident speed",
            0,
            t_dev / t_fed,
            "x",
            0,
            "issue 3 target: >= 0.95",
        ),
    ]


def render(rows: list[dict], header: dict[str, str]) -> str:
    from benchmarks.table import fmt_value

    out = ["# roxxel device check", ""] + [f"- **{k}**: {v}" for k, v in header.items()] + [""]
    out += ["| part | what | size | value | iterations | note |", "|---|---|---:|---:|---:|---|"]
    for r in rows:
        size = f"{r['bytes'] / 2**20:,.1f} MiB" if r["bytes"] else ""
        val = fmt_value(r["value"], r["unit"])
        out.append(f"| {r['part']} | {r['what']} | {size} | {val} | {r['iters']} | {r['note']} |")
    return "\n".join(out) + "\n"


MIB = 1 << 20
ISSUE16_SIZES = (MIB // 2, 3 * MIB, 9633792, 38 * MIB)  # 0.5, 3, 9.6 (64 x 3x224x224), 38


def h2d16_rows(jax, dev, seconds: float, smoke: bool) -> tuple[list[dict], dict]:
    """`device_put` GB/s per size from pageable, page-locked and pinned_host memory; also
    ``{(kind, nbytes): GB/s}`` for the Loader's ratios."""
    from roxxel.loader.pinned import PAGE_BYTES, registrar_for

    registrar = registrar_for([dev])
    rows, rates = [], {}
    for nbytes in ISSUE16_SIZES[:2] if smoke else ISSUE16_SIZES:
        block = np.ones(nbytes + PAGE_BYTES, np.uint8)
        start = -block.ctypes.data % PAGE_BYTES
        host = block[start : start + nbytes]
        t, n = timed_rate(lambda h=host: jax.device_put(h, dev).block_until_ready(), seconds)
        rates["pageable", nbytes] = nbytes / t / 1e9
        rows.append(_row("h2d16", "pageable, reused array", nbytes, nbytes / t / 1e9, "GB/s", n))
        locked = _locked_rate(jax, dev, registrar, host, seconds)
        rows.append(_row("h2d16", "page-locked numpy (cudaHostRegister)", nbytes, *locked))
        pinned = _pinned_row(jax, dev, host, seconds)
        rates["pinned", nbytes] = pinned["value"] or locked[0]
        rows.append({**pinned, "part": "h2d16"})
    return rows, rates


def _locked_rate(jax, dev, registrar, host: np.ndarray, seconds: float) -> tuple:
    if registrar is None:
        return None, "", 0, "no CUDA runtime for this device (the Loader falls back to pageable)"
    if not registrar.register(host):
        return None, "", 0, "cudaHostRegister refused"
    try:
        t, n = timed_rate(lambda: jax.device_put(host, dev).block_until_ready(), seconds)
    finally:
        registrar.unregister(host)
    return host.nbytes / t / 1e9, "GB/s", n, ""


def make_big_images(root: Path, num: int, side: int):
    """`num` uint8[3, side, side] images (random bytes) and int64 labels, one shard set."""
    import roxxel

    schema = roxxel.Schema.parse({"image": f"uint8[3,{side},{side}]", "label": "int64"})
    rng = np.random.default_rng(0)
    with roxxel.DatasetWriter(root / f"images{side}", schema, overwrite=True) as w:
        for at in range(0, num, 256):
            k = min(256, num - at)
            image = rng.integers(0, 256, (k, 3, side, side), dtype=np.uint8)
            w.write_batch({"image": image, "label": np.arange(at, at + k, dtype=np.int64)})
    return roxxel.open_dataset(root / f"images{side}")


def loader16_rows(jax, dev, cases: dict, rates: dict, seconds: float) -> tuple[list, dict]:
    """Loader -> device GB/s per case, with its pinned ring and with ``pin_host=False``, and
    the issue's ratios: >= 0.8x the pinned rate (3 MiB and more), >= 1.0x pageable (0.5 MiB)."""
    from jax.sharding import SingleDeviceSharding

    import roxxel

    rows, per_batch = [], {}
    variants = {  # name: (pin_host, placed in a thread of its own)
        "pinned ring": (True, True),
        "pinned ring, one thread (gather and placement in the pipeline thread)": (True, False),
        "pin_host=False": (False, True),
    }
    for name, (source, batch, nbytes, ref_size) in cases.items():
        got = {}
        for variant, (pin, apart) in variants.items():
            config = roxxel.LoaderConfig(num_epochs=None, pin_host=pin)
            sharding = SingleDeviceSharding(dev)
            with (
                _pipeline(apart),
                roxxel.Loader(source, batch, seed=0, sharding=sharding, config=config) as ld,
            ):
                it = iter(ld)
                t, n = timed_rate(lambda it=it: jax.block_until_ready(next(it)), seconds)
                stats = ld.stats()
            got[variant] = nbytes / t / 1e9
            what = f"Loader -> device: {name}, {variant}"
            rows.append(_row("loader16", what, nbytes, nbytes / t / 1e9, "GB/s", n, _said(stats)))
            if variant == "pinned ring":
                per_batch[name] = t
        got[True] = got["pinned ring"]
        kind, need = ("pinned", 0.8) if nbytes >= 3 * MIB else ("pageable", 1.0)
        ref = rates.get((kind, ref_size))
        ratio = None if not ref else got[True] / ref
        note = f"issue 16 target: >= {need}x the {kind} device_put rate of the same size"
        rows.append(_row("loader16", f"{name}: Loader / {kind} rate", nbytes, ratio, "x", 0, note))
    return rows, per_batch


@contextlib.contextmanager
def _pipeline(apart: bool):
    """The Loader placing batches in a thread of its own (apart, its default on a GPU) or in
    the pipeline thread, after the gather."""
    from roxxel.loader import loader as module

    saved = module.places_apart
    module.places_apart = lambda sharding: apart
    try:
        yield
    finally:
        module.places_apart = saved


def _said(stats) -> str:
    """The Loader's own account of a batch's time (`Loader.stats()`), in ms."""
    return (
        f"per batch: gather {stats.gather_s * 1e3:.2f}, place {stats.place_s * 1e3:.2f}, "
        f"waited on consumer {stats.wait_consumer_s * 1e3:.2f}, consumer waited "
        f"{stats.wait_producer_s * 1e3:.2f} ms: {stats.bottleneck} bound"
    )


def make_feature_step(jax, width: int, dim: int):
    """A jitted step on any batch: the main field's first `width` features through `reps`
    rounds of two bf16 matmuls, plus the mean of every field (so the whole batch is read)."""
    jnp = jax.numpy
    w = jnp.ones((width, dim), jnp.bfloat16) * 1e-3
    v = jnp.ones((dim, width), jnp.bfloat16) * 1e-3

    @jax.jit
    def step(batch, reps):
        main = next(iter(batch.values()))
        x = main.reshape(main.shape[0], -1)[:, :width].astype(jnp.bfloat16)
        x = jax.lax.fori_loop(0, reps, lambda _, x: jnp.tanh(x @ w) @ v, x)
        return x.astype(jnp.float32).mean() + sum(
            a.astype(jnp.float32).mean() for a in batch.values()
        )

    return step


def _calibrate(step, batch, target_s: float, seconds: float) -> tuple[int, float]:
    """Rounds so one step takes about `target_s`: doubling, then a linear interpolation."""
    reps, t = 1, timed_rate(lambda: step(batch, 1).block_until_ready(), seconds)[0]
    low = (0, 0.0)
    while t < target_s and reps < 1 << 20:
        low, reps = (reps, t), reps * 2
        t = timed_rate(lambda r=reps: step(batch, r).block_until_ready(), seconds)[0]
    if low[0] and t > low[1]:
        guess = low[0] + (target_s - low[1]) / (t - low[1]) * (reps - low[0])
        reps = max(1, round(guess))
        t = timed_rate(lambda r=reps: step(batch, r).block_until_ready(), seconds)[0]
    return reps, t


def step16_rows(
    jax, dev, cases: dict, per_batch: dict, seconds: float, smoke: bool, trace: Path | None
) -> list:
    """A jitted step fed by the Loader vs device-resident batches, steps of 2x and 8x the
    Loader's batch time; one step in flight, as a training loop runs (issue 16: >= 0.97x)."""
    from jax.sharding import SingleDeviceSharding

    import roxxel

    sh, rows = SingleDeviceSharding(dev), []
    for name in ("token windows 64 x 2049 int32", "images 64 x 3x224x224"):
        if name not in cases:
            continue
        source, batch = cases[name][:2]
        endless = roxxel.LoaderConfig(num_epochs=None)
        with roxxel.Loader(source, batch, seed=1, sharding=sh, config=endless) as ld:
            resident = [next(ld) for _ in range(4)]
        step = make_feature_step(jax, 256 if smoke else 2048, 256 if smoke else 2048)
        config = roxxel.LoaderConfig(num_epochs=None, pin_host=True)
        for times, apart in ((2, True), (8, True), (2, False), (8, False)):
            reps, _ = _calibrate(step, resident[0], times * per_batch[name], seconds / 4)
            t_dev = _in_flight(step, reps, lambda k, r=resident: r[k % 4], seconds)
            with (
                _pipeline(apart),
                roxxel.Loader(source, batch, seed=2, sharding=sh, config=config) as ld,
            ):
                it = iter(ld)
                t_fed = _in_flight(step, reps, lambda k, it=it: next(it), seconds)
                stats = ld.stats()
                if trace is not None:  # the device streams and the loader thread, side by side
                    with jax.profiler.trace(
                        str(trace / f"{name.split()[0]}-{times}x-apart{int(apart)}")
                    ):
                        _in_flight(step, reps, lambda k, it=it: next(it), min(seconds, 0.5))
            note = (
                f"step {t_dev / per_batch[name]:.1f}x the batch time ({reps} rounds); "
                f"device-resident {t_dev * 1e3:.2f} ms, fed {t_fed * 1e3:.2f} ms; " + _said(stats)
            )
            how = "placed apart" if apart else "one thread"
            what = f"{name}, step {times}x the batch, pinned, {how}: loader-fed / device-resident"
            rows.append(_row("step16", what, 0, t_dev / t_fed, "x", 0, note))
    return rows


def _in_flight(step, reps: int, batch_at, seconds: float) -> float:
    """Seconds per step with one step in flight (dispatch k + 1, then wait for k)."""
    k, prev = [0], [step(batch_at(0), reps)]

    def one() -> None:
        k[0] += 1
        out = step(batch_at(k[0]), reps)
        prev[0].block_until_ready()
        prev[0] = out

    t, _ = timed_rate(one, seconds)
    prev[0].block_until_ready()
    return t


def issue16_rows(
    jax, dev, root: Path, lm, seconds: float, smoke: bool, trace: Path | None = None
) -> list[dict]:
    import roxxel

    rows, rates = h2d16_rows(jax, dev, seconds, smoke)
    small = make_big_images(root, 1024 if smoke else 4096, 64)
    big = make_big_images(root, 256 if smoke else 2048, 224)
    tokens = roxxel.TokenWindows(lm, "tokens", 2048, targets=True)
    cases = {
        "token windows 64 x 2049 int32": (tokens, 64, 64 * 2049 * 4, MIB // 2),
        "images 256 x 3x64x64": (small, 256, 256 * (3 * 64 * 64 + 8), 3 * MIB),
        "images 64 x 3x224x224": (big, 64, 64 * (3 * 224 * 224 + 8), 9633792),
    }
    got, per_batch = loader16_rows(jax, dev, cases, rates, seconds)
    return rows + got + step16_rows(jax, dev, cases, per_batch, seconds, smoke, trace)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _stub_zstandard()
    import jax

    dev = jax.devices()[0]
    smoke = args.cpu_smoke
    header = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": f"{dev.platform}: {getattr(dev, 'device_kind', '?')}",
        "jax": jax.__version__,
        "numpy": np.__version__,
        "mode": "cpu smoke test (sizes tiny, numbers meaningless)" if smoke else "full",
    }
    print(f"[device] {header['device']}, jax {jax.__version__}", flush=True)
    sizes = [1 << 20, 8 << 20] if smoke else [1 << 20, 16 << 20, 64 << 20, 256 << 20]
    rows = h2d_rows(jax, dev, sizes, args.seconds)
    with tempfile.TemporaryDirectory(prefix="rxdev-") as tmp:
        images, lm = make_datasets(
            Path(tmp), 1024 if smoke else 8192, 200_000 if smoke else 8 << 20
        )
        import roxxel

        windows = roxxel.TokenWindows(lm, "tokens", 2048)
        sources = {"images 256 x 3x64x64": (images, 256), "token windows 64 x 2048": (windows, 64)}
        got, per_batch = loader_rows(jax, dev, sources, args.seconds)
        rows += got
        rows += feed_rows(jax, dev, images, per_batch["images 256 x 3x64x64"], args.seconds, smoke)
        trace = args.out / "trace" if args.profile else None
        rows += issue16_rows(jax, dev, Path(tmp), lm, args.seconds, smoke, trace)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "device.md").write_text(render(rows, header))
    (args.out / "device.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    print(render(rows, header), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
