"""roxxel.train.fit with and without Orbax checkpoints, side by side (issue 6, "Speed").

The model is a small byte-level transformer in plain JAX (2 pre-norm decoder layers, width
128, 4 heads, GELU MLP, tied embeddings, Adam; 0.43 M parameters, a 5.1 MB train state with
the moments), trained on 16 x 64-token windows of the benchmark corpus (token ids mod 256,
packed as uint8) read by a roxxel `Loader` over `TokenWindows`. On the project's 2 CPU cores
a step takes 55-90 ms (quiet to busy machine).

Each round runs `fit` twice in one process, once with ``save_every=50`` and once with
checkpoints only at the end (after the timed window), alternating which goes first; up to
``2 * repeats`` rounds (at most 10) while a time budget lasts (at least 3 when repeats > 1).
A run records when the loop asked for each batch; its steady-state rate covers iterations
``[WARMUP_STEPS, WARMUP_STEPS + MEASURED_STEPS)`` (compilation and the first steps
excluded; the window holds whole save intervals, so every save and the background write
after it fall inside). Rows: the median rate of each configuration; the time a save
blocked the loop (`FitResult.save_seconds`); and what each save cost the loop in all, from
the paired rates (that adds the wait for pending steps before a save and the background
write competing with the steps for the CPU).
"""

from __future__ import annotations

import math
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

sys.path.append(str(Path(__file__).resolve().parents[2]))
import roxxel
from benchmarks import datagen as dg
from benchmarks import measure as ms
from benchmarks import steptime
from roxxel.train import TrainConfig, fit

WORKLOAD = "train_checkpoint"
SEQ_LEN, BATCH, WIDTH, LAYERS, HEADS = 64, 16, 128, 2, 4
SAVE_EVERY = 50
WARMUP_STEPS = 10
MEASURED_STEPS = 2 * SAVE_EVERY
BUDGET_S = 140.0  # no new round after this (the harness kills a worker at 240 s)
CORPUS_TOKENS = 1 << 21


def init_state(key: jax.Array) -> dict[str, Any]:
    """Parameters and Adam moments of the transformer (a plain dict pytree)."""
    keys = iter(jax.random.split(key, 2 + 4 * LAYERS))

    def dense(fan_in: int, fan_out: int) -> jax.Array:
        return jax.random.normal(next(keys), (fan_in, fan_out)) / math.sqrt(fan_in)

    layers = [
        {
            "ln1": jnp.ones(WIDTH),
            "qkv": dense(WIDTH, 3 * WIDTH),
            "out": dense(WIDTH, WIDTH),
            "ln2": jnp.ones(WIDTH),
            "up": dense(WIDTH, 4 * WIDTH),
            "down": dense(4 * WIDTH, WIDTH),
        }
        for _ in range(LAYERS)
    ]
    params = {
        "embed": jax.random.normal(next(keys), (256, WIDTH)) * 0.02,
        "pos": jax.random.normal(next(keys), (SEQ_LEN, WIDTH)) * 0.02,
        "layers": layers,
    }
    mu = jax.tree.map(jnp.zeros_like, params)
    nu = jax.tree.map(jnp.zeros_like, params)
    return {"params": params, "mu": mu, "nu": nu, "step": jnp.zeros((), jnp.int32)}


def _norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def _block(x: jax.Array, layer: dict[str, jax.Array]) -> jax.Array:
    b, t, d = x.shape
    q, k, v = jnp.split(_norm(x, layer["ln1"]) @ layer["qkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, HEADS, d // HEADS) for a in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // HEADS)
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
    att = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
    x = x + att.reshape(b, t, d) @ layer["out"]
    return x + jax.nn.gelu(_norm(x, layer["ln2"]) @ layer["up"]) @ layer["down"]


def _loss(params: dict[str, Any], window: jax.Array) -> jax.Array:
    tokens = window.astype(jnp.int32)
    x = params["embed"][tokens[:, :-1]] + params["pos"]
    for layer in params["layers"]:
        x = _block(x, layer)
    logp = jax.nn.log_softmax(x @ params["embed"].T)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def step(state: dict[str, Any], batch: dict[str, jax.Array]) -> Any:
    """One Adam step (lr 1e-3); returns the new state and the loss."""
    loss, grads = jax.value_and_grad(_loss)(state["params"], batch["tokens"])
    n = state["step"] + 1
    mu = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, state["mu"], grads)
    nu = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, state["nu"], grads)

    def update(p: jax.Array, m: jax.Array, v: jax.Array) -> jax.Array:
        return p - 1e-3 * (m / (1 - 0.9**n)) / (jnp.sqrt(v / (1 - 0.999**n)) + 1e-8)

    params = jax.tree.map(update, state["params"], mu, nu)
    return {"params": params, "mu": mu, "nu": nu, "step": n}, loss


class TimedLoader:
    """A roxxel Loader that records when the training loop asked for each batch (wall
    clock, and the CPU time of the whole process: every thread, Orbax's writers included)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.times: list[float] = []
        self.cpu_times: list[float] = []

    def __iter__(self) -> Iterator[Any]:
        batches = iter(self.loader)
        while True:
            self.times.append(time.perf_counter())
            self.cpu_times.append(time.process_time())
            try:
                batch = next(batches)
            except StopIteration:
                return
            yield batch

    def state(self) -> dict[str, Any]:
        return self.loader.state()

    def restore(self, state: dict[str, Any]) -> None:
        self.loader.restore(state)


def ensure_corpus(spec: dg.DataSpec) -> Path:
    """The benchmark corpus's first 2 Mi tokens, mod 256, as a uint8 roxxel dataset."""
    root = dg.data_dir(spec, "roxxel") / "train-bytes"
    if not (root / "manifest.json").exists():
        schema = roxxel.Schema.parse({"tokens": "uint8[]"})
        docs = [(d % 256).astype(np.uint8) for d in dg.iter_documents(spec, CORPUS_TOKENS)]
        with roxxel.DatasetWriter(root, schema, overwrite=True) as w:
            for start in range(0, len(docs), 1024):
                w.write_batch({"tokens": docs[start : start + 1024]})
    return root


def run_fit(corpus: Path, out: Path, num_steps: int, save_every: int) -> tuple[TimedLoader, Any]:
    """One fresh `fit` into an empty `out`; returns the timed loader and the result."""
    shutil.rmtree(out, ignore_errors=True)
    windows = roxxel.TokenWindows(roxxel.open_dataset(corpus), "tokens", SEQ_LEN)
    config = TrainConfig(
        num_steps=num_steps,
        out_dir=out,
        save_every=save_every,
        max_to_keep=2,
        handle_signals=False,
        console=False,
    )
    state = init_state(jax.random.key(0))
    loader_config = roxxel.LoaderConfig(num_epochs=None)
    with roxxel.Loader(windows, BATCH, seed=0, config=loader_config) as loader:
        timed = TimedLoader(loader)
        result = fit(step, state, timed, config=config)
    return timed, result


def w_train_checkpoint(p: dict) -> list[ms.Metric]:
    corpus = ensure_corpus(dg.SPECS[p.get("spec", "small")])
    max_rounds = max(1, min(10, 2 * int(p.get("repeats", 5))))  # --repeats 1: 2 rounds
    num_steps = WARMUP_STEPS + MEASURED_STEPS + 1
    rates: dict[int, list[float]] = {0: [], SAVE_EVERY: []}
    cpu: dict[int, list[float]] = {0: [], SAVE_EVERY: []}
    blocked: list[float] = []
    with tempfile.TemporaryDirectory(prefix="train-ckpt-", dir=corpus.parent) as tmp:
        start = time.perf_counter()
        run_fit(corpus, Path(tmp) / "warm", 6, 5)  # first compile, first Orbax save: untimed
        for r in range(max_rounds):
            if r >= 3 and time.perf_counter() - start > BUDGET_S:
                break
            for save_every in (0, SAVE_EVERY) if r % 2 == 0 else (SAVE_EVERY, 0):
                timed, result = run_fit(corpus, Path(tmp) / "run", num_steps, save_every)
                rate = steptime.window_rate(timed.times, WARMUP_STEPS, MEASURED_STEPS)
                rates[save_every].append(rate)
                cpu[save_every].append(
                    1 / steptime.window_rate(timed.cpu_times, WARMUP_STEPS, MEASURED_STEPS)
                )
                saves = " ".join(f"{1000 * x:.0f}" for x in result.save_seconds)
                print(
                    f"save_every={save_every}: {rate:.2f} steps/s; saves ms {saves}",
                    file=sys.stderr,
                )
                if save_every:
                    blocked += result.save_seconds[:-1]  # the last one is the final save
    return _rows(rates, cpu, blocked)


def _rows(
    rates: dict[int, list[float]], cpu: dict[int, list[float]], blocked: list[float]
) -> list[ms.Metric]:
    base, ckpt = statistics.median(rates[0]), statistics.median(rates[SAVE_EVERY])
    cpu_base, cpu_ckpt = (1000 * statistics.median(cpu[k]) for k in (0, SAVE_EVERY))
    rounds = len(rates[0])
    paired = steptime.paired_ratio(rates[SAVE_EVERY], rates[0])
    best = max(rates[SAVE_EVERY]) / max(rates[0])  # the least disturbed round of each
    num_saves = MEASURED_STEPS // SAVE_EVERY
    costs = [
        steptime.cost_per_save(b, c, MEASURED_STEPS, num_saves)
        for b, c in zip(rates[0], rates[SAVE_EVERY], strict=True)
    ]
    common = f"{MEASURED_STEPS} steps after {WARMUP_STEPS} warm-up, median of {rounds} rounds"
    return [
        ms.metric(
            WORKLOAD,
            "fit, no checkpoint (step time)",
            base,
            "steps/s",
            notes=f"{1000 / base:.0f} ms/step, CPU {cpu_base:.0f} ms/step; {common}",
        ),
        ms.metric(
            WORKLOAD,
            f"fit, Orbax checkpoint every {SAVE_EVERY} steps (async)",
            ckpt,
            "steps/s",
            notes=(
                f"{1000 / ckpt:.0f} ms/step, CPU {cpu_ckpt:.0f} ms/step "
                f"({cpu_ckpt / cpu_base:.3f}x); median of per-round ratios {paired:.3f}, "
                f"best round vs best round {best:.3f}"
            ),
        ),
        ms.metric(
            WORKLOAD,
            "a save blocks the loop (FitResult.save_seconds)",
            1000 * statistics.median(blocked),
            "ms",
            higher_is_better=False,
            notes=f"median of {len(blocked)} saves, max {1000 * max(blocked):.0f} ms",
        ),
        ms.metric(
            WORKLOAD,
            "each save's whole cost to the loop (from the paired rates)",
            1000 * statistics.median(costs),
            "ms",
            higher_is_better=False,
            notes="device sync + save + background write competing for the CPU",
        ),
    ]


def versions() -> dict[str, str]:
    return {"roxxel": roxxel.__version__, "jax": jax.__version__, "orbax": ocp.__version__}


if __name__ == "__main__":
    raise SystemExit(ms.worker_main({WORKLOAD: w_train_checkpoint}, versions))
