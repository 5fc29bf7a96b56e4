"""The main job: pack real text with roxxel through a BPE tokenizer, then train a small
language model on it.

    .venv/bin/python examples/main.py --out runs/demo        # what `make demo` runs

1. Builds two text sources every machine has offline (`corpus.py`): Python standard library
   sources ("code") and the prose of their docstrings plus system license texts ("prose"),
   and trains a byte-level BPE tokenizer on both, on the spot (``OUT/tokenizer.json``).
2. Packs each with ``roxxel pack --tokenizer`` (`roxxel.cli.main`), tokenizing at pack time
   in the pack workers, with an end-of-document id after each text, into
   ``OUT/data/{code,prose}``.
3. Trains a small transformer (`tiny_lm.py`) with `roxxel.train.fit` on token windows of a
   two-source `roxxel.Mixture` with two curriculum phases: code-heavy, then prose-heavy.
   Checkpoints go to ``OUT/train/checkpoints``, metrics to ``OUT/train/metrics.jsonl``.

Run it again and it resumes from the newest checkpoint; Ctrl-C (or SIGTERM) saves and exits
cleanly, and the next run continues from there.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import jax
from corpus import build, train_bpe
from tiny_lm import ModelConfig, generate, init_state, make_step
from tokenizers import Tokenizer

import roxxel
import roxxel.cli
from roxxel.train import FitResult, TrainConfig, fit

HERE = Path(__file__).resolve().parent
SOURCES = ("code", "prose")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="output folder (runs/demo)")
    p.add_argument("--steps", type=int, default=300, help="training steps (300)")
    p.add_argument("--batch-size", type=int, default=16, help="windows per step (16)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per window (128)")
    p.add_argument("--vocab", type=int, default=2048, help="BPE vocabulary size (2048)")
    p.add_argument("--corpus-mb", type=float, default=3.0, help="text per source in MB (3)")
    p.add_argument("--save-every", type=int, default=100, help="checkpoint interval (100)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def pack(jsonl: Path, dataset: Path, tokenizer: Path) -> None:
    """``roxxel pack --tokenizer``: the BPE runs in the pack workers; EOS (id 0) ends a text."""
    argv = ["pack", str(jsonl), "-o", str(dataset), "--tokenizer", str(tokenizer)]
    argv += ["--append-eos", "--workers", "2", "--unit-bytes", "1M"]
    print("$ roxxel " + " ".join(argv), flush=True)
    status = roxxel.cli.main(argv)
    if status != 0:
        raise SystemExit(f"roxxel pack {jsonl} failed with exit status {status}")


def prepare_data(out: Path, corpus_bytes: int, vocab: int) -> tuple[dict[str, Path], Path]:
    """Builds the corpus, trains the BPE and packs both sources, unless an earlier run did."""
    datasets = {name: out / "data" / name for name in SOURCES}
    tokenizer = out / "tokenizer.json"
    done = [path / "manifest.json" for path in datasets.values()] + [tokenizer]
    if all(path.exists() for path in done):
        print(f"data: reusing {out / 'data'} and {tokenizer}", flush=True)
        return datasets, tokenizer
    print("corpus: collecting Python standard library sources and docstrings ...", flush=True)
    built = build(out / "corpus", corpus_bytes)
    for name, (path, num_docs, num_bytes) in built.items():
        print(f"corpus: {name}: {num_docs} documents, {num_bytes / 1e6:.1f} MB -> {path}")
    start = time.perf_counter()
    train_bpe([path for path, _, _ in built.values()], tokenizer, vocab)
    size = Tokenizer.from_file(str(tokenizer)).get_vocab_size()
    print(
        f"tokenizer: BPE of {size} ids trained in {time.perf_counter() - start:.1f} s -> {tokenizer}"
    )
    for name, (path, _, _) in built.items():
        pack(path, datasets[name], tokenizer)
    return datasets, tokenizer


def make_loader(datasets: dict[str, Path], args: argparse.Namespace) -> roxxel.Loader:
    """Token windows of both sources, mixed over two curriculum phases."""
    sources = {
        name: roxxel.TokenWindows(roxxel.open_dataset(path), "tokens", seq_len=args.seq_len)
        for name, path in datasets.items()
    }
    half = args.steps // 2
    phases = [
        roxxel.Phase(weights={"code": 0.8, "prose": 0.2}, end_step=half),
        roxxel.Phase(weights={"code": 0.2, "prose": 0.8}),  # open-ended: fit stops it
    ]
    mixture = roxxel.Mixture(
        sources, phases, batch_size=args.batch_size, seed=args.seed, on_exhausted="refill"
    )
    config = roxxel.LoaderConfig(provenance=True)
    return roxxel.Loader(mixture, seed=args.seed, config=config)


def summarize(result: FitResult, datasets: dict[str, Path]) -> None:
    """Prints where everything is and how the loss moved."""
    records = [json.loads(line) for line in Path(result.metrics_path).read_text().splitlines()]
    by_step = {r["step"]: r for r in records if "event" not in r}
    steps = sorted(by_step)
    first, tail = by_step[steps[0]], [by_step[s] for s in steps[-5:]]

    def mean(key: str) -> float:
        return sum(r[key] for r in tail) / len(tail)

    print(
        f"\nroxxel demo: {result.status} at step {result.step} (this run started at {result.start_step})"
    )
    where = f"mean of steps {steps[-len(tail)]}-{steps[-1]}"
    print(f"  loss  {first['loss']:.3f} at step {steps[0]} -> {mean('loss'):.3f} ({where})")
    for name in SOURCES:
        key = f"loss_{name}"
        if key in first:
            print(f"  {name:5} {first[key]:.3f} -> {mean(key):.3f}")
    if result.save_seconds:
        mean_ms = 1000 * sum(result.save_seconds) / len(result.save_seconds)
        print(
            f"  a save blocked the loop {mean_ms:.0f} ms on average ({len(result.save_seconds)} saves)"
        )
    for name, path in datasets.items():
        print(f"  data ({name}):{' ' * (7 - len(name))}{path}")
    print(f"  checkpoints:   {result.checkpoint_dir}")
    print(f"  metrics:       {result.metrics_path}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    datasets, tokenizer_path = prepare_data(args.out, int(args.corpus_mb * 1e6), args.vocab)
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    vocab = tokenizer.get_vocab_size()
    model = ModelConfig(seq_len=args.seq_len, vocab=vocab, total_steps=args.steps)
    state: Any = init_state(jax.random.key(args.seed), model)
    config = TrainConfig(
        num_steps=args.steps,
        out_dir=args.out / "train",
        save_every=args.save_every,
        max_to_keep=2,
        log_every=10,
    )
    print(
        f"train: {args.steps} steps of {args.batch_size} x {args.seq_len} tokens (vocab {vocab}) "
        f"on {jax.devices()[0].platform}",
        flush=True,
    )
    with make_loader(datasets, args) as loader:
        try:
            result = fit(make_step(model, SOURCES), state, loader, config=config)
        except roxxel.StateError as exc:
            print(f"{exc}\n{config.out_dir} holds a run with other settings: use another --out")
            return 1
    summarize(result, datasets)
    codec = (lambda text: tokenizer.encode(text).ids, tokenizer.decode)
    text = generate(result.state["params"], "def ", model, num_tokens=80, codec=codec)
    print(f"\nsample from the model after {result.step} steps (a tiny BPE model):\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
