"""Text through a real tokenizer at pack time: ``roxxel pack --tokenizer PATH``.

The tokenizer is chosen by its file: an HF ``tokenizer.json`` (``tokenizers``), a
SentencePiece ``.model`` (``sentencepiece``), or else a tiktoken BPE ranks file (``tiktoken``,
loaded from the local file with the GPT-2 split pattern; nothing is downloaded). All three
are the optional extra ``roxxel[tokenizers]``, imported only when a tokenizer is loaded.

Each pack worker loads the tokenizer once, checks its file still has the hash planned, and
encodes a work unit's texts in batches (``encode_batch``), so the tokenizer runs in every
worker at once; within `cores_shared`, each process's tokenizer uses only its share of the
cores (all three libraries default to a thread per core in every process). A record ``{text_field: str, ...}`` becomes ``{field: ids, kept...}`` with
the ids as an array of the token dtype: the smallest unsigned type that holds the
vocabulary's highest id (`token_dtype`) unless the schema says otherwise (an integer dtype,
`token_field_dtype`). Special tokens are never added by the tokenizer itself, and a
document's text that spells one (``</s>``, ``<|endoftext|>``) is encoded as text by all
three libraries; ``append_eos`` / ``prepend_bos`` add the tokenizer's own (or ``eos_id`` /
``bos_id``).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import importlib
import itertools
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np

from roxxel.errors import ConfigError, check_int, load_json
from roxxel.ingest.units import BadRecords, Piece, Record, not_a_regular_file

__all__ = [
    "BATCH_TEXTS",
    "MAX_TOKEN_ID",
    "TIKTOKEN_PATTERN",
    "TokenizeConfig",
    "Tokenizer",
    "cores_shared",
    "encode_threads",
    "file_sha256",
    "load_tokenizer",
    "token_dtype",
    "token_field_dtype",
    "tokenize_records",
    "tokenizer_kind",
]

BATCH_TEXTS = 512  # texts per encode_batch call
INTEGER_DTYPES = ("uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64")
MAX_TOKEN_ID = (1 << 32) - 1  # the largest id `token_dtype` holds: --eos-id / --bos-id N
EXTRA = "pip install 'roxxel[tokenizers]'"
# GPT-2's pre-tokenizer split, the one tiktoken's own r50k/p50k encodings use
TIKTOKEN_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_EOS_NAMES = ("</s>", "<|endoftext|>", "<eos>", "<|eos|>", "[SEP]", "<|end_of_text|>")
_BOS_NAMES = ("<s>", "<|startoftext|>", "<bos>", "<|bos|>", "[CLS]", "<|begin_of_text|>")
TokenizerKind = Literal["hf", "sentencepiece", "tiktoken"]
Where = tuple[Piece, int]
_THREADS: list[int] = []  # this process's tokenizer threads while in cores_shared (a stack)


def tokenizer_kind(path: str) -> TokenizerKind:
    """Which library reads a tokenizer file, from its name.

    >>> tokenizer_kind("tok/tokenizer.json"), tokenizer_kind("sp.model"), tokenizer_kind("r.tiktoken")
    ('hf', 'sentencepiece', 'tiktoken')
    """
    ext = os.path.splitext(path)[1].lower()
    return "hf" if ext == ".json" else "sentencepiece" if ext == ".model" else "tiktoken"


def file_sha256(path: str) -> str:
    """The sha256 of a file (hex): a tokenizer's fingerprint. Raises ConfigError if missing,
    or not a regular file (a FIFO would block ``open`` forever)."""
    what = not_a_regular_file(path)
    if what is not None:
        raise ConfigError(
            f"--tokenizer {path}: not a regular file ({what}, expected a tokenizer file)",
            path=path,
        )
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as e:
        raise ConfigError(
            f"--tokenizer {path}: cannot read ({e.strerror}, expected a tokenizer.json, a "
            f"SentencePiece .model or a tiktoken ranks file)",
            path=path,
        ) from None


def token_dtype(vocab_size: int) -> str:
    """The smallest dtype holding ids [0, vocab_size).

    >>> token_dtype(50_257), token_dtype(65_536), token_dtype(65_537), token_dtype(200_019)
    ('uint16', 'uint16', 'uint32', 'uint32')
    """
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def token_field_dtype(spec: str, where: str) -> str:
    """The dtype of a token field's spec, which must be ``<integer dtype>[]``: a text's ids
    are whole numbers (a float or bool would change them), any number of them.

    >>> token_field_dtype("int32[]", "--field tokens:int32[]")
    'int32'

    Raises ConfigError naming ``where`` for any other spec (``float16[]``, ``int32[4]``).
    """
    dtype = spec.removesuffix("[]")
    if spec.endswith("[]") and dtype in INTEGER_DTYPES:
        return dtype
    raise ConfigError(
        f"{where}: not a token field ({spec}, expected a variable-length integer field such "
        f"as uint16[] or int32[]: a text's ids are whole numbers, any number of them)"
    )


@dataclass(frozen=True, slots=True)
class Tokenizer:
    """A loaded tokenizer: batch encoding and its own special tokens (None: it has none).

    ``vocab_size`` is one past its highest id (its ids lie in [0, vocab_size), gaps and all),
    not the number of its tokens: what `token_dtype` must hold.
    """

    kind: TokenizerKind
    vocab_size: int
    encode_batch: Callable[[list[str]], list[list[int]]]
    eos_id: int | None
    bos_id: int | None
    # why eos_id / bos_id is None when the tokenizer names a token its vocabulary lacks
    eos_missing: str | None = None
    bos_missing: str | None = None


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        raise ConfigError(
            f"--tokenizer: the {name.partition('.')[0]!r} package is not installed (expected the extra: {EXTRA})"
        ) from None


def _special(
    ids: dict[str, int], names: tuple[str, ...], config: dict[str, Any], key: str, where: str
) -> tuple[int | None, str | None]:
    """A special token's id: the one ``key`` of tokenizer_config.json (``where``) names, else
    the first of ``names`` in the vocabulary; (None, why) when the config names a token the
    vocabulary lacks, or none (``null``: never guessed then), an error only if the token is
    asked for: see `TokenizeConfig.specials`.
    """
    if key not in config:
        return next((ids[n] for n in names if n in ids), None), None
    configured = config[key]
    if isinstance(configured, dict):  # tokenizer_config.json: {"content": "</s>", ...}
        configured = configured.get("content")
    if not isinstance(configured, str):
        found = json.dumps(config[key])
        return None, f"{where}: {key} is {found}: the tokenizer names no such token"
    if configured in ids:
        return ids[configured], None
    return None, f"{where}: {key} {configured!r} is not a token of the tokenizer"


def _why_not_hf(path: str, error: Exception) -> str:
    """What is wrong with a file ``tokenizers`` does not load, in words: its JSON syntax
    (line and column), or what valid JSON lacks (serde's own message names a line and
    column even then: ``expected `,` or `}` at line 1 column 5`` for ``{"x":1}``)."""
    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read().decode("utf-8"))
    except UnicodeDecodeError as e:
        return f"not UTF-8 text: byte {e.start} ({e.reason}), expected JSON"
    except json.JSONDecodeError as e:
        return f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg[:1].lower()}{e.msg[1:]}"
    except (OSError, ValueError, RecursionError):
        return reason
    if not isinstance(doc, dict):
        return (
            f'valid JSON, but a {type(doc).__name__}: expected an object with a "model" '
            "entry, as the tokenizers library saves one"
        )
    if "model" not in doc:
        keys = sorted(doc)
        shown = f"{keys[:8]}{' ...' if len(keys) > 8 else ''}"
        return (
            f'valid JSON, but no "model" entry: its keys are {shown}, expected a '
            "tokenizer.json as the tokenizers library saves one"
        )
    return f"valid JSON, but the tokenizers library cannot load it ({reason})"


def _load_hf(path: str) -> Tokenizer:
    tokenizers = _import("tokenizers")
    version = str(tokenizers.__version__)
    if tuple(int(p) for p in re.findall(r"\d+", version)[:2]) < (0, 21):  # encode_batch_fast
        raise ConfigError(
            f"--tokenizer {path}: tokenizers {version} is too old (expected >= 0.21: {EXTRA})"
        )
    try:
        tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # the Rust side raises plain Exception for a bad file
        raise ConfigError(
            f"--tokenizer {path}: not an HF tokenizer.json ({_why_not_hf(path, e)})", path=path
        ) from None
    # a document's "</s>" is text, as in SentencePiece and tiktoken: specials come only from
    # append_eos / prepend_bos
    tok.encode_special_tokens = True
    beside = _config_path(path)
    extra = _read_config(beside) if os.path.isfile(beside) else {}
    ids = tok.get_vocab(with_added_tokens=True)

    def encode(texts: list[str]) -> list[list[int]]:
        # the same ids as encode_batch, without the character offsets nobody here reads
        return [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)]

    eos, eos_missing = _special(ids, _EOS_NAMES, extra, "eos_token", beside)
    bos, bos_missing = _special(ids, _BOS_NAMES, extra, "bos_token", beside)
    # one past the highest id, not the number of ids (get_vocab_size): a vocabulary may
    # have gaps
    size = max(ids.values(), default=-1) + 1
    return Tokenizer("hf", size, encode, eos, bos, eos_missing, bos_missing)


def _config_path(path: str) -> str:
    """The tokenizer_config.json beside an HF tokenizer.json: it names the EOS and BOS."""
    return os.path.join(os.path.dirname(path), "tokenizer_config.json")


def _read_config(path: str) -> dict[str, Any]:
    """A tokenizer_config.json's settings; ConfigError naming it unless a JSON object."""
    with open(path, "rb") as f:
        loaded = load_json(f.read(), path, ConfigError)
    if not isinstance(loaded, dict):
        found = json.dumps(loaded)
        raise ConfigError(
            f"{path}: not a JSON object ({found if len(found) <= 40 else found[:37] + '...'}, "
            f'expected an object of tokenizer settings such as {{"eos_token": "</s>"}})',
            path=path,
        )
    return loaded


def _load_sentencepiece(path: str) -> Tokenizer:
    spm = _import("sentencepiece")
    sp = spm.SentencePieceProcessor()
    try:
        sp.Load(path)
    except (OSError, RuntimeError) as e:
        raise ConfigError(
            f"--tokenizer {path}: not a SentencePiece model ({e}; a tiktoken ranks file named"
            f" .model, as Llama 3's tokenizer.model, is read under another extension, e.g."
            f" .tiktoken)",
            path=path,
        ) from None

    def encode(texts: list[str]) -> list[list[int]]:
        return sp.encode(texts, out_type=int, num_threads=_THREADS[-1] if _THREADS else -1)

    eos, bos = int(sp.eos_id()), int(sp.bos_id())
    return Tokenizer(
        "sentencepiece",
        int(sp.get_piece_size()),
        encode,
        eos if eos >= 0 else None,
        bos if bos >= 0 else None,
    )


def _load_tiktoken(path: str) -> Tokenizer:
    tiktoken = _import("tiktoken")
    ranks = _read_ranks(path)
    if not ranks:  # tiktoken would say "max() arg is an empty sequence"
        raise ConfigError(
            f"--tokenizer {path}: holds no ranks (empty or blank lines only, expected a "
            f"'<base64 token> <rank>' line per token: a tiktoken ranks file)",
            path=path,
        )
    try:
        enc = tiktoken.Encoding(
            f"roxxel:{os.path.basename(path)}",
            pat_str=TIKTOKEN_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={},
        )
    except ValueError as e:
        raise ConfigError(
            f"--tokenizer {path}: not a tiktoken ranks file ({e})", path=path
        ) from None
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:  # tiktoken panics on the first text holding such a byte
        raise ConfigError(
            f"--tokenizer {path}: not a byte-level BPE ({len(missing)} of the 256 single bytes "
            f"have no rank, e.g. {bytes(missing[:1])!r}; expected all 256, so any text encodes)",
            path=path,
        )

    def encode(texts: list[str]) -> list[list[int]]:
        for text in texts:  # tiktoken would encode a lone surrogate as U+FFFD: refuse it
            text.encode("utf-8")
        return enc.encode_ordinary_batch(texts, num_threads=_THREADS[-1] if _THREADS else 1)

    return Tokenizer("tiktoken", int(enc.n_vocab), encode, None, None)


def _read_ranks(path: str) -> dict[bytes, int]:
    """A tiktoken ranks file, read here: tiktoken's own loader goes through a copy in the
    temp folder keyed by the path's name, so a file rewritten in place kept its old ranks.

    Each token and each rank once, every rank in [0, 2**32) (tiktoken's u32), or ConfigError
    naming the line: tiktoken panics on a rank given twice (a BaseException, past ``except
    Exception``), overflows on one out of range, and a dict keeps the last of a token given
    twice, losing its other rank silently.
    """
    ranks: dict[bytes, int] = {}
    token_lines: dict[bytes, int] = {}
    rank_lines: dict[int, int] = {}
    with open(path, "rb") as f:  # readable: file_sha256 read it
        lines = f.read().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():  # blank, or spaces only: no rank (nor "0 words")
            continue
        where = f"--tokenizer {path}: line {number}"
        token, rank = _rank_line(line, where, path)
        if not 0 <= rank <= MAX_TOKEN_ID:
            raise ConfigError(f"{where}: rank {rank} (expected 0 <= rank < 2**32)", path=path)
        if rank in rank_lines:
            raise ConfigError(
                f"{where}: rank {rank} given twice (first on line {rank_lines[rank]}; expected "
                f"each rank once)",
                path=path,
            )
        if token in token_lines:
            raise ConfigError(
                f"{where}: token {token!r} given twice (first on line {token_lines[token]}; "
                f"expected each token once)",
                path=path,
            )
        ranks[token], token_lines[token], rank_lines[rank] = rank, number, number
    return ranks


def _rank_line(line: bytes, where: str, path: str) -> tuple[bytes, int]:
    """(token, rank) of a ranks file's ``<base64 token> <rank>`` line; ConfigError naming
    ``where`` for any other."""
    parts = line.split()
    if len(parts) != 2:
        raise ConfigError(
            f"{where}: {len(parts)} words (expected '<base64 token> <rank>': not a tiktoken "
            f"ranks file, or a .json / .model tokenizer)",
            path=path,
        )
    token, rank = parts
    try:
        return base64.b64decode(token, validate=True), int(rank)
    except binascii.Error:
        raise ConfigError(
            f"{where}: {token.decode(errors='replace')!r} is not base64", path=path
        ) from None
    except ValueError:
        raise ConfigError(
            f"{where}: {rank.decode(errors='replace')!r} is not a rank", path=path
        ) from None


_LOADERS: dict[TokenizerKind, Callable[[str], Tokenizer]] = {
    "hf": _load_hf,
    "sentencepiece": _load_sentencepiece,
    "tiktoken": _load_tiktoken,
}
_LOADED: dict[tuple[str, str, str | None], Tokenizer] = {}


def encode_threads(num_processes: int, num_cores: int | None = None) -> int:
    """Tokenizer threads for one of ``num_processes`` processes sharing ``num_cores`` (this
    process's CPU affinity by default): its share, at least one.

    >>> encode_threads(2, num_cores=2), encode_threads(2, num_cores=16), encode_threads(8, num_cores=2)
    (1, 8, 1)
    """
    check_int("processes", num_processes, low=1)
    cores = _num_cores() if num_cores is None else num_cores
    return max(1, cores // num_processes)


def _num_cores() -> int:
    """The cores this process may run on: its affinity on Linux (a container's or a
    ``taskset``'s share), else every core."""
    if sys.platform == "linux":
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _config_sha256(path: str) -> str | None:
    """The sha256 of the tokenizer_config.json beside an HF tokenizer.json; None for another
    kind of tokenizer or without one."""
    beside = _config_path(path)
    if tokenizer_kind(path) != "hf":
        return None
    what = not_a_regular_file(beside)
    if what is not None:  # a FIFO would block open forever; a folder is no settings file
        raise ConfigError(
            f"{beside}: not a regular file ({what}, expected the tokenizer settings of "
            f"--tokenizer {path}, or nothing of that name)",
            path=beside,
        )
    if not os.path.isfile(beside):
        return None
    with open(beside, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@contextlib.contextmanager
def cores_shared(num_processes: int) -> Iterator[int]:
    """Within: this process's tokenizers encode with `encode_threads` threads (yielded).

    Every library defaults to a thread per core in each process, so N pack processes would
    run N times as many threads as cores, spinning and waiting on each other. SentencePiece
    and tiktoken take the count per call; HF tokenizers reads the environment: one thread
    sets ``TOKENIZERS_PARALLELISM=false`` (the batch is encoded in the calling thread, no
    pool), more set ``RAYON_NUM_THREADS`` (obeyed when the process has not encoded in
    parallel yet). A variable the user set is kept; the ones set here are restored on exit.
    Not thread-safe: enter it before starting threads that encode.
    """
    threads = encode_threads(num_processes)
    # HF reads TOKENIZERS_PARALLELISM at every encode_batch, RAYON_NUM_THREADS once, when
    # its thread pool starts
    key, value = (
        ("TOKENIZERS_PARALLELISM", "false") if threads == 1 else ("RAYON_NUM_THREADS", str(threads))
    )
    added = key not in os.environ
    if added:
        os.environ[key] = value
    _THREADS.append(threads)
    try:
        yield threads
    finally:
        _THREADS.pop()
        if added:
            os.environ.pop(key, None)


def load_tokenizer(path: str, sha256: str | None = None) -> Tokenizer:
    """The tokenizer in ``path`` (cached per process by path, hash and the hash of the
    tokenizer_config.json beside an HF tokenizer.json, whose EOS / BOS it takes).

    Raises ConfigError for a missing or unreadable file, a missing extra, or (with
    ``sha256``) a file whose hash is not the one planned.
    """
    found = file_sha256(path)
    if sha256 is not None and found != sha256:
        raise ConfigError(
            f"--tokenizer {path}: sha256 {found[:16]}... (expected {sha256[:16]}...: the file "
            f"changed since planning)",
            path=path,
        )
    key = (path, found, _config_sha256(path))
    if key not in _LOADED:
        _LOADED[key] = _LOADERS[tokenizer_kind(path)](path)
    return _LOADED[key]


@dataclass(frozen=True, slots=True)
class TokenizeConfig:
    """How a pack tokenizes: plain values (they travel to workers as JSON).

    Attributes:
        path: the tokenizer file; ``sha256`` its hash when planned.
        text_field: the input field holding the text.
        out_field: the output field of token ids; ``dtype`` their dtype.
        append_eos / prepend_bos: add the tokenizer's own EOS / BOS ids;
        eos_id / bos_id: the EOS / BOS id to use instead of the tokenizer's own (as
            planned: `with_specials`), in [0, `MAX_TOKEN_ID`] (past the vocabulary too: a
            model's padded vocabulary).
        keep_fields: input fields copied to the output unchanged.
    """

    path: str
    sha256: str
    dtype: str
    text_field: str = "text"
    out_field: str = "tokens"
    append_eos: bool = False
    prepend_bos: bool = False
    eos_id: int | None = None
    bos_id: int | None = None
    keep_fields: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.dtype not in INTEGER_DTYPES:
            raise ConfigError(
                f"token dtype: {self.dtype!r} (expected an integer dtype: "
                f"{', '.join(INTEGER_DTYPES)})"
            )
        for flag, value in (("--eos-id", self.eos_id), ("--bos-id", self.bos_id)):
            if value is not None:
                check_int(flag, value, low=0, high=MAX_TOKEN_ID)
        if self.out_field in self.keep_fields:
            raise ConfigError(
                f"--keep-field {self.out_field}: the token field's name (expected another field)"
            )

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> TokenizeConfig:
        return cls(**{**doc, "keep_fields": tuple(doc["keep_fields"])})

    def specials(self, tok: Tokenizer) -> tuple[list[int], list[int]]:
        """(ids before, ids after) every text; raises ConfigError when one is missing."""
        eos = self.eos_id if self.eos_id is not None else tok.eos_id
        bos = self.bos_id if self.bos_id is not None else tok.bos_id
        if self.append_eos and eos is None:
            why = tok.eos_missing or f"{self.path} has no EOS token"
            raise ConfigError(f"--append-eos: {why} (expected one, or pass --eos-id N)")
        if self.prepend_bos and bos is None:
            why = tok.bos_missing or f"{self.path} has no BOS token"
            raise ConfigError(f"--prepend-bos: {why} (expected one, or pass --bos-id N)")
        before = [bos] if self.prepend_bos and bos is not None else []
        return before, [eos] if self.append_eos and eos is not None else []

    def with_specials(self, tok: Tokenizer) -> TokenizeConfig:
        """This config with the ids it adds as ``eos_id`` / ``bos_id``: the tokenizer's own
        as planned. Every worker then adds those, whatever the tokenizer_config.json beside
        an HF tokenizer.json says by then, and the pack's fingerprint holds them (another
        EOS is another pack). Raises ConfigError as `specials`.
        """
        before, after = self.specials(tok)
        return replace(
            self, bos_id=before[0] if before else None, eos_id=after[0] if after else None
        )

    def metadata(self, tok: Tokenizer) -> dict[str, Any]:
        """What the manifest records about how the tokens were made."""
        before, after = self.specials(tok)
        return {
            "path": self.path,
            "kind": tok.kind,
            "sha256": self.sha256,
            "vocab_size": tok.vocab_size,
            "text_field": self.text_field,
            "field": self.out_field,
            "dtype": self.dtype,
            "bos_id": before[0] if before else None,
            "eos_id": after[0] if after else None,
            "keep_fields": list(self.keep_fields),
        }


Located = tuple[Record, Piece, int]


def tokenize_records(
    records: Iterator[Located],
    config: TokenizeConfig,
    bad: BadRecords,
    skip_bad: bool,
    locate: Callable[[Piece, int], str],
) -> Iterator[Located]:
    """Records with their text replaced by token ids, encoded ``BATCH_TEXTS`` at a time.

    A record whose text field is missing, not a string or not valid Unicode (a lone
    surrogate) raises ConfigError naming its file and line or row (skipped and counted in
    ``bad`` with ``skip_bad``); so does one lacking a kept field. One holding an id the
    dtype cannot raises ConfigError naming it.
    """
    tok = load_tokenizer(config.path, config.sha256)
    specials = config.specials(tok)

    def refuse(where: Where, why: str) -> None:
        message = f"{locate(*where)}: {why}"
        if not skip_bad:
            raise ConfigError(message)
        bad.add(message)

    batch: list[Located] = []
    for located in records:
        why = _refusal(located[0], config)
        if why is not None:
            refuse(located[1:], why)
            continue
        batch.append(located)
        if len(batch) >= BATCH_TEXTS:
            yield from _encoded(_encode(batch, tok, config, refuse), config, specials, locate)
            batch = []
    yield from _encoded(_encode(batch, tok, config, refuse), config, specials, locate)


def _refusal(record: Record, config: TokenizeConfig) -> str | None:
    text = record.get(config.text_field)
    if not isinstance(text, str):
        if config.text_field not in record:
            fields = sorted(record)
            shown = f"{fields[:20]}{' ...' if len(fields) > 20 else ''}"
            return (
                f"field {config.text_field!r}: missing (the record's fields: {shown}; expected"
                f" --text-field to name a top-level field holding the text)"
            )
        found = type(text).__name__
        return f"field {config.text_field!r}: {found} (expected a string to tokenize)"
    missing = [k for k in config.keep_fields if k not in record]
    return f"--keep-field {missing}: missing (expected in every record)" if missing else None


def _encode(
    batch: list[Located],
    tok: Tokenizer,
    config: TokenizeConfig,
    refuse: Callable[[Where, str], None],
) -> tuple[list[Located], list[list[int]]]:
    """The batch's records that encode, with their ids.

    Text that is not valid Unicode (a lone surrogate, which a --map can make) fails the whole
    batch: HF and SentencePiece raise TypeError, tiktoken's ``encode`` UnicodeEncodeError.
    Only then is each text checked, the bad ones refused and the others encoded again.
    """
    texts = [r[config.text_field] for r, _, _ in batch]
    try:
        return batch, (tok.encode_batch(texts) if texts else [])
    except (TypeError, UnicodeEncodeError):
        whys = _not_unicode(texts, config.text_field)
        if not whys:
            raise
    for i, why in whys.items():
        refuse(batch[i][1:], why)
    kept = [located for i, located in enumerate(batch) if i not in whys]
    return kept, (tok.encode_batch([r[config.text_field] for r, _, _ in kept]) if kept else [])


def _not_unicode(texts: list[str], field: str) -> dict[int, str]:
    """Why each text UTF-8 cannot encode is refused, by its index in ``texts``."""
    whys: dict[int, str] = {}
    for i, text in enumerate(texts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            whys[i] = (
                f"field {field!r}: a lone surrogate {text[e.start]!r} at character {e.start} "
                f"(expected valid Unicode text, which UTF-8 encodes)"
            )
    return whys


def _encoded(
    encoded: tuple[list[Located], list[list[int]]],
    config: TokenizeConfig,
    specials: tuple[list[int], list[int]],
    locate: Callable[[Piece, int], str],
) -> Iterator[Located]:
    """The batch's records with their token ids: one array for the whole batch (one
    conversion from Python ints, one range check), each record's ids a view of it."""
    batch, rows = encoded
    if not batch:
        return
    before, after = specials
    if before or after:
        rows = [before + row + after for row in rows]
    ends = np.cumsum(np.fromiter(map(len, rows), np.int64, len(rows)))
    flat = np.fromiter(itertools.chain.from_iterable(rows), np.int64, int(ends[-1]))
    dtype = np.dtype(config.dtype)  # an integer dtype: TokenizeConfig checks it
    if flat.size and int(flat.max()) > np.iinfo(dtype).max:
        at = int(np.argmax(flat > np.iinfo(dtype).max))
        _, piece, key = batch[int(np.searchsorted(ends, at, "right"))]
        raise ConfigError(
            f"{locate(piece, key)}: token id {int(flat[at])} (expected <= "
            f"{np.iinfo(dtype).max}, the largest {config.dtype}: pick a wider dtype with "
            f"--field {config.out_field}:uint32[])"
        )
    ids = np.split(flat.astype(dtype), ends[:-1])
    for (record, piece, key), tokens in zip(batch, ids, strict=True):
        out = {config.out_field: tokens}
        out.update((k, record[k]) for k in config.keep_fields)
        yield out, piece, key
