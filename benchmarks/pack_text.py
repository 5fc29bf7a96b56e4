"""Tokenizing and image packs (issue 14): ``roxxel pack --tokenizer`` and ``--image-size``.

    python -m benchmarks.pack_text [--text-mb 8] [--images 1500] [--repeats 3]
    python -m benchmarks.run --pack-text              # the same, from the suite's entry point

Rows, ratios taken within one run (same machine, same moment):

- tokens/s of ``roxxel pack --tokenizer tokenizer.json --workers 2`` (a new CLI process, from
  the JSONL file to fsynced shards) against a bare loop of ``tokenizer.encode_batch`` over
  the same texts already in memory, writing nothing (target >= 1.0x), and against HF
  ``datasets``: ``load_dataset("json") + .map(encode_batch, batched=True, num_proc=2) +
  save_to_disk`` in the ``hf`` peer venv (target >= 1.5x; a row says so when the venv or
  its ``tokenizers`` is missing);
- images/s of ``roxxel pack photos/ --image-size 64x64`` with ``--workers 2`` against
  ``--workers 1`` (target >= 1.5x) and against a bare Pillow decode + ``ImageOps.fit`` loop
  over the same files in 2 processes (target >= 0.8x).

Inputs are made here, deterministically: a JSONL corpus of Zipf-distributed English-like
words, a byte-level BPE of 8,192 ids trained on it, and an ImageFolder tree of 4 classes of
256x192 JPEGs. Medians of ``--repeats`` runs; nothing is tuned to the targets.
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import venvs

ROOT = Path(__file__).resolve().parent.parent
WORK = Path(__file__).resolve().parent / ".work" / "pack_text"
BATCH = 512
HF_SCRIPT = """
import sys, time
from datasets import load_dataset
from tokenizers import Tokenizer
src, tok_path, out, cache = sys.argv[1:5]
tok = Tokenizer.from_file(tok_path)
def encode(batch):
    return {"input_ids": [e.ids for e in tok.encode_batch(batch["text"], add_special_tokens=False)]}
start = time.perf_counter()
ds = load_dataset("json", data_files=src, split="train", cache_dir=cache)
ds = ds.map(encode, batched=True, num_proc=2, remove_columns=ds.column_names)
ds.save_to_disk(out)
print(time.perf_counter() - start)
"""


def _words(rng: np.random.Generator, num: int) -> list[str]:
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    weights = 1.0 / np.arange(1, 27)
    lengths = rng.integers(1, 10, num)
    return ["".join(rng.choice(letters, n, p=weights / weights.sum())) for n in lengths]


def make_corpus(path: Path, num_bytes: int, seed: int = 0) -> list[str]:
    """A JSONL corpus of about ``num_bytes`` of text; returns the texts."""
    rng = np.random.default_rng(seed)
    vocab = _words(rng, 5000)
    ranks = 1.0 / np.arange(1, len(vocab) + 1)
    texts, size = [], 0
    while size < num_bytes:
        words = rng.choice(len(vocab), int(rng.integers(50, 400)), p=ranks / ranks.sum())
        text = " ".join(vocab[w] for w in words) + ".\n"
        texts.append(text)
        size += len(text)
    with open(path, "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    return texts


def train_tokenizer(texts: list[str], path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=8192,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts[:2000], trainer)
    tok.save(str(path))


def make_images(root: Path, num: int, seed: int = 0) -> list[Path]:
    """An ImageFolder tree of ``num`` 256x192 JPEGs in 4 classes (smooth, with noise)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:192, 0:256]
    paths = []
    for i in range(num):
        folder = root / f"class{i % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        a, b, c = rng.uniform(0.01, 0.1, 3)
        base = np.stack([np.sin(a * xx), np.cos(b * yy), np.sin(c * (xx + yy))], -1)
        pixels = (base * 100 + 128 + rng.normal(0, 12, base.shape)).clip(0, 255)
        buf = io.BytesIO()
        Image.fromarray(pixels.astype(np.uint8)).save(buf, "JPEG", quality=90)
        path = folder / f"{i:06d}.jpg"
        path.write_bytes(buf.getvalue())
        paths.append(path)
    return paths


def _roxxel_pack(argv: list[str], out: Path) -> float:
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "roxxel.cli", "pack", *argv, "-o", str(out), "-q"]
    subprocess.run(cmd, check=True, env=env)
    return time.perf_counter() - start


def bare_encode(tok_path: Path, texts: list[str]) -> tuple[float, int]:
    """Seconds of ``encode_batch`` over the texts in batches, and the tokens it made."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    start, num_tokens = time.perf_counter(), 0
    for i in range(0, len(texts), BATCH):
        num_tokens += sum(
            len(e.ids) for e in tok.encode_batch(texts[i : i + BATCH], add_special_tokens=False)
        )
    return time.perf_counter() - start, num_tokens


def hf_pack(src: Path, tok_path: Path) -> float | str:
    """Seconds of the HF datasets pipeline, or why it could not run."""
    err = venvs.ensure_venv("hf")
    if err is not None:
        return f"hf venv missing: {err}"
    python = str(venvs.venv_python("hf"))
    if subprocess.run([python, "-c", "import tokenizers"], capture_output=True).returncode:
        return "hf venv has no tokenizers (pip install tokenizers into benchmarks/.venvs/hf)"
    with tempfile.TemporaryDirectory(dir=WORK) as tmp:
        start = time.perf_counter()
        done = subprocess.run(
            [python, "-c", HF_SCRIPT, str(src), str(tok_path), f"{tmp}/out", f"{tmp}/cache"],
            capture_output=True,
            text=True,
            env={**os.environ, "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
        )
        if done.returncode:
            return f"hf run failed: {done.stderr.strip().splitlines()[-1:]}"
        return time.perf_counter() - start


def _fit_file(path: str) -> None:
    from PIL import Image, ImageOps

    with Image.open(path) as img:
        img.load()
        rgb = img.convert("RGB")
    np.asarray(ImageOps.fit(rgb, (64, 64), Image.Resampling.BILINEAR)).transpose(2, 0, 1).copy()


def bare_images(paths: list[Path]) -> float:
    """Seconds to decode and fit every file with Pillow in 2 processes (pool start included)."""
    start = time.perf_counter()
    with multiprocessing.get_context("fork").Pool(2) as pool:
        pool.map(_fit_file, [str(p) for p in paths], chunksize=32)
    return time.perf_counter() - start


def _rows(
    label: str,
    amount: int,
    unit: str,
    times: dict[str, list[float]],
    ratios: list[tuple[str, str, str]],
) -> list[tuple[str, str, str]]:
    """A row per variant (median rate), then each ratio as the median of per-repeat ratios
    (the variants of one repeat run back to back: on a shared machine the load moves)."""
    rows = []
    for name, ts in times.items():
        notes = []
        for a, b, target in ratios:
            if a == name and times.get(b):
                per = [tb / ta for ta, tb in zip(ts, times[b], strict=False)]
                notes.append(
                    f"{statistics.median(per):.2f}x {b} ({target}; repeats {', '.join(f'{r:.2f}' for r in per)})"
                )
        rate = amount / statistics.median(ts)
        rows.append((f"{label}: {name}", f"{rate:,.0f} {unit}", "; ".join(notes)))
    return rows


def run(text_mb: float, num_images: int, repeats: int) -> list[tuple[str, str, str]]:
    """(row, rate, ratios) of this run."""
    WORK.mkdir(parents=True, exist_ok=True)
    src, tok_path = WORK / "corpus.jsonl", WORK / "tokenizer.json"
    texts = make_corpus(src, int(text_mb * 1e6))
    train_tokenizer(texts, tok_path)
    unit = ["--unit-bytes", str(max(src.stat().st_size // 8, 1))]
    argv = [str(src), "--tokenizer", str(tok_path), "--workers", "2", *unit]
    bare, pack, hf = (
        "bare encode_batch loop (texts in memory, writes nothing)",
        "roxxel pack --tokenizer --workers 2 (new process)",
        "HF datasets load_dataset + map(num_proc=2) + save_to_disk",
    )
    times: dict[str, list[float]] = {bare: [], pack: [], hf: []}
    missing = ""
    num_tokens = 0
    for _ in range(repeats):
        seconds, num_tokens = bare_encode(tok_path, texts)
        times[bare].append(seconds)
        times[pack].append(_roxxel_pack(argv, WORK / "tok-ds"))
        got = missing or hf_pack(src, tok_path)
        if isinstance(got, str):
            missing = got
        else:
            times[hf].append(got)
    if missing:
        del times[hf]
    ratios = [(pack, bare, "target 1.0x"), (pack, hf, "target 1.5x")]
    rows = _rows("tokenize", num_tokens, "tokens/s", times, ratios)
    if missing:
        rows.append((f"tokenize: {hf}", "missing", missing))
    photos = WORK / "photos"
    shutil.rmtree(photos, ignore_errors=True)
    paths = make_images(photos, num_images)
    img_unit = ["--unit-bytes", str(max(sum(p.stat().st_size for p in paths) // 16, 1))]
    one, two, pil = (
        "roxxel pack --image-size 64x64 --workers 1",
        "roxxel pack --image-size 64x64 --workers 2",
        "bare Pillow decode + ImageOps.fit, 2 processes",
    )
    times = {pil: [], one: [], two: []}
    for _ in range(repeats):
        times[pil].append(bare_images(paths))
        for workers, name in ((1, one), (2, two)):
            argv = [str(photos), "--image-size", "64x64", "--workers", str(workers), *img_unit]
            times[name].append(_roxxel_pack(argv, WORK / "img-ds"))
    ratios = [(two, one, "target 1.5x"), (two, pil, "target 0.8x")]
    return rows + _rows("images", num_images, "images/s", times, ratios)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.pack_text", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--text-mb", type=float, default=8.0, help="JSONL text to tokenize (8)")
    ap.add_argument("--images", type=int, default=1500, help="JPEGs to pack (1500)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per row (median)")
    args = ap.parse_args(argv)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    rows = run(args.text_mb, args.images, args.repeats)
    print(f"load average at start: {load}; {os.cpu_count()} cores\n")
    print("| row | rate | ratio |\n|---|---|---|")
    for row in rows:
        print(f"| {' | '.join(row)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
