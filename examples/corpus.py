"""Real text every machine has offline: Python's standard library, as two sources.

- ``code``: the standard library's ``.py`` sources (tests and demos left out).
- ``prose``: the docstrings of those modules, classes and functions (English prose about
  the code), plus the license texts in ``/usr/share/common-licenses`` when present.

Both are written as JSON Lines, one ``{"text": ...}`` document per line, for ``roxxel pack``.
The selection is deterministic (sorted paths, evenly spaced, up to a byte budget), so two
machines with the same Python build the same corpus. `train_bpe` trains a byte-level BPE
tokenizer on it, on the spot (``tokenizers``; a few seconds), for ``roxxel pack --tokenizer``.
"""

from __future__ import annotations

import ast
import json
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SKIP_DIRS = {"test", "tests", "idlelib", "turtledemo", "site-packages", "__pycache__"}
MAX_DOC_BYTES = 16_384
MIN_DOCSTRING_CHARS = 200
END_OF_DOCUMENT = "<|endoftext|>"  # id 0: the first special token


def stdlib_files() -> list[Path]:
    """The standard library's .py files, sorted, without tests, demos or site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not SKIP_DIRS.intersection(p.relative_to(root).parts)]
    return sorted(files)


def _spread(items: list[Path], count: int) -> list[Path]:
    """`count` items evenly spaced over `items` (all of them if fewer)."""
    if count >= len(items):
        return items
    return [items[i * len(items) // count] for i in range(count)]


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def code_documents(files: list[Path], budget_bytes: int) -> Iterator[str]:
    """Source files (each cut to MAX_DOC_BYTES at a line end) until the budget is spent."""
    spent = 0
    for path in _spread(files, max(1, budget_bytes // 6000)):
        text = _read(path)
        if not text:
            continue
        text = text[:MAX_DOC_BYTES].rsplit("\n", 1)[0] + "\n"
        spent += len(text.encode())
        yield text
        if spent >= budget_bytes:
            return


def docstrings(text: str) -> Iterator[str]:
    """The long docstrings (module, class, function) of one source file."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        try:
            tree = ast.parse(text)
        except SyntaxError:
            return
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for node in ast.walk(tree):
        if isinstance(node, kinds):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= MIN_DOCSTRING_CHARS:
                yield doc.strip() + "\n"


def prose_documents(files: list[Path], budget_bytes: int) -> Iterator[str]:
    """Docstrings of the standard library, then system license texts, until the budget."""
    spent = 0
    for path in _spread(files, max(1, budget_bytes // 1500)):
        for doc in docstrings(_read(path) or ""):
            spent += len(doc.encode())
            yield doc
        if spent >= budget_bytes:
            return
    licenses = Path("/usr/share/common-licenses")
    for path in sorted(licenses.glob("*")) if licenses.is_dir() else []:
        text = _read(path) if path.is_file() else None
        if text and spent < budget_bytes:
            spent += len(text.encode())
            yield text


def write_jsonl(path: Path, documents: Iterator[str]) -> tuple[int, int]:
    """Writes one ``{"text": ...}`` per line; returns (documents, UTF-8 bytes of text)."""
    num_docs = num_bytes = 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for text in documents:
            f.write(json.dumps({"text": text}) + "\n")
            num_docs += 1
            num_bytes += len(text.encode())
    return num_docs, num_bytes


def build(out_dir: Path, budget_bytes: int) -> dict[str, tuple[Path, int, int]]:
    """Writes ``code.jsonl`` and ``prose.jsonl``; returns name -> (path, docs, bytes)."""
    files = stdlib_files()
    sources = {"code": code_documents, "prose": prose_documents}
    result = {}
    for name, documents in sources.items():
        path = out_dir / f"{name}.jsonl"
        result[name] = (path, *write_jsonl(path, documents(files, budget_bytes)))
    return result


def _texts(paths: list[Path]) -> Iterator[str]:
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]


def train_bpe(paths: list[Path], out_path: Path, vocab_size: int) -> Path:
    """Trains a byte-level BPE of up to ``vocab_size`` ids on the texts of JSON Lines files
    (every byte has an id, so any text encodes; ``<|endoftext|>`` is id 0) and saves it as
    an HF ``tokenizer.json``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_DOCUMENT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_texts(paths), trainer)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_path))
    return out_path
