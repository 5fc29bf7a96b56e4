"""Tokenizing and image packs (issue 14): ``roxxel pack --tokenizer`` and ``--image-size``.

    python -m benchmarks.pack_text [--text-mb 32] [--images 6000] [--repeats 3]
    python -m benchmarks.run --pack-text              # the same, from the suite's entry point

Rows, ratios taken within one run (same machine, same moment):

- tokens/s of ``roxxel pack --tokenizer tokenizer.json --workers 2`` (a new CLI process, from
  the JSONL file to fsynced shards) against a bare loop of ``tokenizer.encode_batch`` over
  the same texts already in memory, writing nothing, in one fresh process with the
  library's own thread pool (a thread per core: target >= 1.0x); for scale, the same loop
  calling ``encode_batch_fast`` (the same ids without character offsets: what the pack
  calls, so its bound) and ``encode_batch`` in 2 forked processes of one thread each (the
  best layout for the tokenizer alone on 2 cores); and against HF
  ``datasets``: ``load_dataset("json") + .map(encode_batch, batched=True, num_proc=2) +
  save_to_disk`` in the ``hf`` peer venv (target >= 1.5x; a row says so when the venv or
  its ``tokenizers`` is missing);
- images/s of ``roxxel pack photos/ --image-size 64x64`` with ``--workers 2`` against
  ``--workers 1`` (target >= 1.5x) and against a bare Pillow decode + ``ImageOps.fit`` loop
  over the same files in 2 processes (target >= 0.8x).

Inputs are made here, deterministically, and kept under ``benchmarks/.work/pack_text`` for
the next run: a JSONL corpus of Zipf-distributed English-like words, a byte-level BPE of
8,192 ids trained on it, and an ImageFolder tree of 4 classes of 256x192 JPEGs. The sizes
are what a user would wait for (32 MB of text, 6,000 images: seconds, not a fraction of a
second that a new process's imports would dominate). Medians of ``--repeats`` runs; nothing
is tuned to the targets.
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
INPUTS_VERSION = 2  # bump when an input generator changes: cached inputs are made again
BARE_SCRIPT = """
import json, multiprocessing, os, sys, time
from tokenizers import Tokenizer
src, tok_path, batch, processes, method = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
with open(src) as f:
    texts = [json.loads(line)["text"] for line in f]
tok = Tokenizer.from_file(tok_path)
encode_batch = getattr(tok, method)
def encode(start):
    return sum(len(e.ids) for e in encode_batch(texts[start : start + batch], add_special_tokens=False))
starts = range(0, len(texts), batch)
t = time.perf_counter()
if processes == 1:
    num_tokens = sum(map(encode, starts))
else:
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        num_tokens = sum(pool.map(encode, starts, chunksize=4))
print(time.perf_counter() - t, num_tokens)
"""
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


def _make_image(job: tuple[Path, int, int]) -> None:
    from PIL import Image

    path, i, seed = job
    rng = np.random.default_rng([seed, i])
    yy, xx = np.mgrid[0:192, 0:256]
    a, b, c = rng.uniform(0.01, 0.1, 3)
    base = np.stack([np.sin(a * xx), np.cos(b * yy), np.sin(c * (xx + yy))], -1)
    pixels = (base * 100 + 128 + rng.normal(0, 12, base.shape)).clip(0, 255)
    buf = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(buf, "JPEG", quality=90)
    path.write_bytes(buf.getvalue())


def make_images(root: Path, num: int, seed: int = 0) -> list[Path]:
    """An ImageFolder tree of ``num`` 256x192 JPEGs in 4 classes (smooth, with noise),
    made by every core (image ``i`` depends on ``(seed, i)`` alone)."""
    paths = [root / f"class{i % 4}" / f"{i:06d}.jpg" for i in range(num)]
    for folder in {p.parent for p in paths}:
        folder.mkdir(parents=True, exist_ok=True)
    with multiprocessing.get_context("fork").Pool() as pool:
        pool.map(_make_image, [(p, i, seed) for i, p in enumerate(paths)], chunksize=64)
    return paths


def _roxxel_pack(argv: list[str], out: Path, root: Path = ROOT) -> float:
    """Seconds of ``python -m roxxel.cli pack ARGV`` (``root``: the checkout to import)."""
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(root)}
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "roxxel.cli", "pack", *argv, "-o", str(out), "-q"]
    subprocess.run(cmd, check=True, env=env)
    return time.perf_counter() - start


def bare_encode(
    src: Path, tok_path: Path, processes: int = 1, method: str = "encode_batch"
) -> tuple[float, int]:
    """Seconds of ``method`` (``encode_batch``, or ``encode_batch_fast``: the same ids
    without character offsets) over the corpus's texts in batches, and the tokens made.

    A fresh process reads the texts first (untimed). ``processes`` 1: one process, the
    tokenizer's own pool of a thread per core; more: forked processes of one thread each
    (``TOKENIZERS_PARALLELISM=false``) taking batches in turn, pool start timed.
    """
    env = dict(os.environ)
    env.pop("TOKENIZERS_PARALLELISM", None)
    if processes > 1:
        env["TOKENIZERS_PARALLELISM"] = "false"
    argv = [str(src), str(tok_path), str(BATCH), str(processes), method]
    done = subprocess.run(
        [sys.executable, "-c", BARE_SCRIPT, *argv], check=True, env=env, capture_output=True
    )
    seconds, num_tokens = done.stdout.split()
    return float(seconds), int(num_tokens)


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


def make_inputs(text_mb: float, num_images: int) -> tuple[Path, Path, list[Path]]:
    """The corpus, its tokenizer and the photos, made unless the last run left the same."""
    WORK.mkdir(parents=True, exist_ok=True)
    src, tok_path, photos = WORK / "corpus.jsonl", WORK / "tokenizer.json", WORK / "photos"
    stamp = WORK / "inputs.json"
    wanted = {"version": INPUTS_VERSION, "text_bytes": int(text_mb * 1e6), "images": num_images}
    made = json.loads(stamp.read_text()) if stamp.exists() else {}
    stamp.unlink(missing_ok=True)  # until both are made

    def kept(key: str) -> bool:
        return made.get("version") == INPUTS_VERSION and made.get(key) == wanted[key]

    if not kept("text_bytes"):
        train_tokenizer(make_corpus(src, wanted["text_bytes"]), tok_path)
    if num_images and not kept("images"):  # 0: no image rows (the photos are kept)
        shutil.rmtree(photos, ignore_errors=True)
        make_images(photos, num_images)
    stamp.write_text(json.dumps({**wanted, "images": num_images or made.get("images")}))
    return src, tok_path, sorted(photos.glob("*/*.jpg"))


def run(text_mb: float, num_images: int, repeats: int) -> list[tuple[str, str, str]]:
    """(row, rate, ratios) of this run."""
    src, tok_path, paths = make_inputs(text_mb, num_images)
    argv = [str(src), "--tokenizer", str(tok_path), "--workers", "2"]  # default units
    cores = len(os.sched_getaffinity(0))
    bare, fast, split, pack, hf = (
        f"bare encode_batch loop, 1 process, the tokenizer's pool of {cores} threads "
        "(texts in memory, writes nothing)",
        "bare encode_batch_fast loop (no offsets, what the pack calls), the same pool",
        "bare encode_batch loop, 2 forked processes of 1 thread (the same texts)",
        "roxxel pack --tokenizer --workers 2 (new process)",
        "HF datasets load_dataset + map(num_proc=2) + save_to_disk",
    )
    times: dict[str, list[float]] = {bare: [], fast: [], split: [], pack: [], hf: []}
    missing = ""
    num_tokens = 0
    for _ in range(repeats):
        seconds, num_tokens = bare_encode(src, tok_path)
        times[bare].append(seconds)
        times[fast].append(bare_encode(src, tok_path, method="encode_batch_fast")[0])
        times[split].append(bare_encode(src, tok_path, processes=2)[0])
        times[pack].append(_roxxel_pack(argv, WORK / "tok-ds"))
        got = missing or hf_pack(src, tok_path)
        if isinstance(got, str):
            missing = got
        else:
            times[hf].append(got)
    if missing:
        del times[hf]
    ratios = [
        (pack, bare, "target 1.0x"),
        (pack, fast, "no target: the bound"),
        (pack, split, "no target"),
        (pack, hf, "target 1.5x"),
    ]
    rows = _rows("tokenize", num_tokens, "tokens/s", times, ratios)
    if missing:
        rows.append((f"tokenize: {hf}", "missing", missing))
    if not num_images:
        return rows
    photos = WORK / "photos"
    one, two, pil = (
        "roxxel pack --image-size 64x64 --workers 1",
        "roxxel pack --image-size 64x64 --workers 2",
        "bare Pillow decode + ImageOps.fit, 2 processes",
    )
    times = {pil: [], one: [], two: []}
    for _ in range(repeats):
        times[pil].append(bare_images(paths))
        for workers, name in ((1, one), (2, two)):
            argv = [str(photos), "--image-size", "64x64", "--workers", str(workers)]
            times[name].append(_roxxel_pack(argv, WORK / "img-ds"))
    ratios = [(two, one, "target 1.5x"), (two, pil, "target 0.8x")]
    return rows + _rows("images", num_images, "images/s", times, ratios)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.pack_text", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--text-mb", type=float, default=32.0, help="JSONL text to tokenize (32)")
    ap.add_argument(
        "--images", type=int, default=6000, help="JPEGs to pack (6000; 0: no image rows)"
    )
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
