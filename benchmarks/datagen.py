"""Deterministic benchmark data: an LM corpus of token-id documents and an image-like set.

Everything is a pure function of a `DataSpec` (seeded numpy, counter-style keys): the same
spec gives the same bytes on any machine, in any chunking, in any process. This module needs
numpy only, so the peers' venvs import it too.

>>> spec = SPECS["tiny"]
>>> lengths = lm_lengths(spec)
>>> int(lengths.sum()) == spec.lm_tokens
True
>>> bool(np.array_equal(lm_tokens(spec, 5, 9), lm_tokens(spec, 0, 20)[5:9]))
True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np

TOKEN_DTYPE = np.dtype(np.int32)
IMAGE_SHAPE = (3, 64, 64)
IMAGE_BYTES = 3 * 64 * 64
LABEL_DTYPE = np.dtype(np.int64)
_TOKEN_CHUNK = 1 << 20  # tokens per independently seeded chunk of the stream
_IMAGE_CHUNK = 256  # images per independently seeded chunk


@dataclasses.dataclass(frozen=True, slots=True)
class DataSpec:
    """Sizes and seed of one generated data set (LM corpus + images)."""

    name: str
    lm_tokens: int
    num_images: int
    seed: int = 0
    vocab: int = 50_257
    median_doc_tokens: float = 600.0
    doc_sigma: float = 1.0
    min_doc_tokens: int = 16
    max_doc_tokens: int = 1 << 16

    @property
    def lm_bytes(self) -> int:
        return self.lm_tokens * TOKEN_DTYPE.itemsize

    @property
    def image_bytes(self) -> int:
        return self.num_images * (IMAGE_BYTES + LABEL_DTYPE.itemsize)

    def key(self) -> str:
        """A short string that changes whenever any size or the seed changes."""
        f = dataclasses.astuple(self)
        return "-".join(str(x) for x in f)


SPECS: dict[str, DataSpec] = {
    "tiny": DataSpec("tiny", lm_tokens=1 << 20, num_images=640),  # smoke runs: 4 + 8 MiB
    "small": DataSpec("small", lm_tokens=16 << 20, num_images=4096),  # 64 MiB + 48 MiB
    "full": DataSpec("full", lm_tokens=256 << 20, num_images=16384),  # 1 GiB + 192 MiB
}


def lm_lengths(spec: DataSpec) -> np.ndarray:
    """Document lengths in tokens (int64), lognormal, clipped, summing to `spec.lm_tokens`."""
    rng = np.random.default_rng([spec.seed, 0])
    guess = int(spec.lm_tokens / spec.median_doc_tokens * 1.5) + 16
    raw = rng.lognormal(np.log(spec.median_doc_tokens), spec.doc_sigma, size=guess)
    lengths = np.clip(raw.astype(np.int64), spec.min_doc_tokens, spec.max_doc_tokens)
    while lengths.sum() < spec.lm_tokens:  # rare: extend deterministically
        lengths = np.concatenate([lengths, lengths])
    ends = np.cumsum(lengths)
    n = int(np.searchsorted(ends, spec.lm_tokens)) + 1
    lengths = lengths[:n].copy()
    lengths[-1] -= int(ends[n - 1]) - spec.lm_tokens
    if lengths[-1] <= 0:  # the cut fell exactly on a boundary
        lengths = lengths[:-1]
    return lengths


def lm_tokens(spec: DataSpec, start: int, stop: int) -> np.ndarray:
    """Token ids [start, stop) of the concatenated corpus (int32), same bytes in any chunking."""
    if not 0 <= start <= stop <= spec.lm_tokens:
        raise IndexError(f"lm_tokens: range [{start}, {stop}) outside [0, {spec.lm_tokens}]")
    out = np.empty(stop - start, TOKEN_DTYPE)
    first, last = start // _TOKEN_CHUNK, (stop - 1) // _TOKEN_CHUNK if stop > start else -1
    for c in range(first, last + 1):
        c0 = c * _TOKEN_CHUNK
        n = min(_TOKEN_CHUNK, spec.lm_tokens - c0)
        chunk = np.random.default_rng([spec.seed, 1, c]).integers(0, spec.vocab, n, np.int32)
        lo, hi = max(start, c0), min(stop, c0 + n)
        out[lo - start : hi - start] = chunk[lo - c0 : hi - c0]
    return out


def iter_documents(spec: DataSpec, max_tokens: int | None = None) -> Iterator[np.ndarray]:
    """Yield the corpus's documents in order (int32 arrays), up to `max_tokens` in total."""
    lengths = lm_lengths(spec)
    limit = spec.lm_tokens if max_tokens is None else min(max_tokens, spec.lm_tokens)
    buf_start, buf = 0, np.empty(0, TOKEN_DTYPE)
    pos = 0
    for n in lengths.tolist():
        if pos + n > limit:
            return
        if pos + n > buf_start + buf.size:
            buf_start, buf = pos, lm_tokens(spec, pos, min(spec.lm_tokens, pos + max(n, 1 << 22)))
        yield buf[pos - buf_start : pos - buf_start + n]
        pos += n


def images(spec: DataSpec, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """Images [start, stop) as uint8 (n, 3, 64, 64) and their int64 labels, chunk-invariant."""
    if not 0 <= start <= stop <= spec.num_images:
        raise IndexError(f"images: range [{start}, {stop}) outside [0, {spec.num_images}]")
    img = np.empty((stop - start, *IMAGE_SHAPE), np.uint8)
    lab = np.empty(stop - start, LABEL_DTYPE)
    for c in range(start // _IMAGE_CHUNK, (stop + _IMAGE_CHUNK - 1) // _IMAGE_CHUNK):
        c0 = c * _IMAGE_CHUNK
        n = min(_IMAGE_CHUNK, spec.num_images - c0)
        rng = np.random.default_rng([spec.seed, 2, c])
        ci = _smooth_images(rng, n)
        cl = rng.integers(0, 1000, n, dtype=np.int64)
        lo, hi = max(start, c0), min(stop, c0 + n)
        img[lo - start : hi - start] = ci[lo - c0 : hi - c0]
        lab[lo - start : hi - start] = cl[lo - c0 : hi - c0]
    return img, lab


def _smooth_images(rng: np.random.Generator, n: int) -> np.ndarray:
    """Image-like pixels: a per-image colour gradient plus noise (compressible, as photos are)."""
    base = rng.integers(0, 192, (n, 3, 1, 1), dtype=np.int16)
    ramp = np.arange(64, dtype=np.int16)[None, None, :, None] // 2
    noise = rng.integers(0, 32, (n, *IMAGE_SHAPE), dtype=np.int16)
    return (base + ramp + noise).clip(0, 255).astype(np.uint8)


def iter_images(spec: DataSpec, chunk: int = 1024) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield (images, labels) chunks covering the whole image set in order."""
    for s in range(0, spec.num_images, chunk):
        yield images(spec, s, min(spec.num_images, s + chunk))


def num_windows(spec: DataSpec, seq_len: int) -> int:
    """How many disjoint windows of seq_len + 1 tokens fit in the corpus."""
    return spec.lm_tokens // (seq_len + 1)


# The shapes every system is measured on (issue 7).
SEQ_LEN = 2048
TOKEN_BATCH = 64
IMAGE_BATCH = 256
RESUME_STEPS = (0, 10**4, 10**6, 10**8)
DATA_ROOT = Path(__file__).resolve().parent / ".data"


def data_dir(spec: DataSpec, system: str) -> Path:
    """Where `system` keeps its layout of `spec`'s data (created on demand)."""
    path = DATA_ROOT / spec.name / system
    path.mkdir(parents=True, exist_ok=True)
    return path


def random_indices(n: int, count: int, seed: int) -> np.ndarray:
    """`count` deterministic random indices in [0, n) (int64), the same for every system."""
    return np.random.default_rng([seed, 3]).integers(0, n, count, dtype=np.int64)


def window_starts(
    spec: DataSpec, step: int, batch: int = TOKEN_BATCH, seq_len: int = SEQ_LEN
) -> np.ndarray:
    """Token offsets of the shuffled windows of `step` for the bare-numpy baseline (int64)."""
    rng = np.random.default_rng([spec.seed, 4, step])
    return rng.integers(0, num_windows(spec, seq_len), batch, dtype=np.int64) * (seq_len + 1)


def step_label(step: int) -> str:
    """A short label for a resume step: 0, 1e4, 1e6, 1e8.

    >>> [step_label(s) for s in RESUME_STEPS]
    ['step 0', 'step 1e4', 'step 1e6', 'step 1e8']
    """
    if step == 0:
        return "step 0"
    exp = len(str(step)) - 1
    return f"step 1e{exp}" if step == 10**exp else f"step {step}"


def iter_windows(spec: DataSpec, seq_len: int = SEQ_LEN, chunk: int = 256) -> Iterator[np.ndarray]:
    """Yield the corpus cut into disjoint windows of seq_len + 1 tokens (pre-packed records).

    Peers without an O(1) window view over a token stream get the corpus in this layout, the
    usual pre-packing for them; window k is tokens [k * (seq_len+1), (k+1) * (seq_len+1)).
    """
    w = seq_len + 1
    n = num_windows(spec, seq_len)
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        block = lm_tokens(spec, s * w, e * w).reshape(e - s, w)
        yield from block
