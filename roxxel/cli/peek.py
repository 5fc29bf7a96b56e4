"""``roxxel peek``: the rows a loader reads at one step, before training on them.

The source is a dataset directory (its records, or token windows with ``--seq-len``) or a
mixture TOML file (as ``roxxel plan`` reads it). Each row shows its source, its record, its
length and its first values, as text when they are bytes (a ``str`` field, uint8 tokens)
or when the dataset's metadata names a ``tokenizer`` file and the ``tokenizers`` package
is installed (special tokens shown). A field of several dimensions (an image) shows its
dtype and shape and its first values on one line. The rows are those `roxxel.Loader`
yields at that step with the same seed and batch size (`Loader.peek`); this command loads
jax, as the loader does.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from roxxel.cli.args import UsageError, add_url_flags, storage_options, url_options
from roxxel.cli.plan import open_plan_source
from roxxel.errors import ConfigError
from roxxel.format.dataset import Dataset, open_dataset
from roxxel.ingest.tokenize import file_sha256
from roxxel.sampling.mixture import Mixture
from roxxel.sources.records import Records
from roxxel.sources.windows import TokenWindows

__all__ = ["add_peek_parser"]

EPILOG = """examples:
  roxxel peek data/corpus --step 0 --batch-size 8 --rows 4 --field text
  roxxel peek data/web --step 1000 --batch-size 256 --seq-len 2048 --seed 1
  roxxel peek mixture.toml --step 5000 --rows 8 --json"""

SHOWN_VALUES = 16  # values printed per row, and a JSON row's "head" (see _json_row)
SHOWN_CHARS = 120  # characters of text printed per row


def add_peek_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "peek",
        help="show the rows a loader reads at one step",
        description="Print, per row of a step's batch, its source, record, length and first\n"
        "values (as text where they are bytes or a tokenizer is known).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("source", metavar="DATASET|MIXTURE.toml")
    p.add_argument("--step", type=int, required=True, metavar="N", help="the step to look at")
    p.add_argument("--rows", type=int, metavar="K", help="only the first K rows (default: all)")
    p.add_argument("--seed", type=int, help="the loader's seed (default: a mixture's own, else 0)")
    p.add_argument(
        "--batch-size", type=int, metavar="B", help="global batch size (a mixture has its own)"
    )
    p.add_argument("--seq-len", type=int, metavar="L", help="token windows of L over --field")
    p.add_argument("--field", metavar="F", help="the field to show (and to cut windows from)")
    p.add_argument("--no-shuffle", action="store_true", help="a dataset read in its order")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.add_argument(
        "--all-values",
        action="store_true",
        help="with --json: every value of a field of several dimensions, not just its head",
    )
    add_url_flags(p)
    p.set_defaults(func=cmd_peek)


def cmd_peek(args: argparse.Namespace) -> int:
    if args.all_values and not args.json:
        raise UsageError("--all-values is for --json (the printed rows show the first values)")
    source, datasets = _open(args)
    # jax loads here, for this command only: `import roxxel.cli` stays light
    from roxxel.loader.loader import Loader

    loader = Loader(source, args.batch_size, seed=args.seed, shuffle=not args.no_shuffle)
    decode = _tokenizer(datasets)
    field = None if args.seq_len is not None else args.field
    rows = loader.peek(args.step, args.rows, field=field, decode=decode)
    if not rows:
        end = "the end" if loader.num_steps is None else loader.num_steps
        raise ConfigError(
            f"peek: no batch at step {args.step} (past the end of the stream, expected a "
            f"step before {end})"
        )
    if args.json:
        for row in rows:
            print(json.dumps(_json_row(row, args.all_values)))
        return 0
    print(f"step {args.step}: {len(rows)} rows of {rows[0]['field']!r}")
    for row in rows:
        print(_line(row))
    return 0


def _line(row: dict[str, Any]) -> str:
    """One printed row; a field of several dimensions adds its dtype and shape, and a
    fixed shape (an image) has no length to print."""
    values = row["values"]
    length = "" if row["length"] is None else f"length {row['length']}  "
    shape = f"{_type_of(values)}  " if values.ndim > 1 else ""
    where = f"row {row['row']}  source {row['source']}  record {row['record']}"
    return f"{where}  {length}{shape}{_shown(row)}"


def _json_row(row: dict[str, Any], all_values: bool) -> dict[str, Any]:
    """A row as JSON: its ``dtype`` and ``shape`` beside the rest; every value of a row of
    one dimension (tokens, text), but of a field of several dimensions (an image) only a
    ``head`` of its first values in C order, and ``values`` too with `all_values`."""
    values = row["values"]
    shown: dict[str, Any] = {"dtype": str(values.dtype), "shape": list(values.shape)}
    if values.ndim > 1:
        shown["head"] = _json_values(values.reshape(-1)[:SHOWN_VALUES])
    if values.ndim < 2 or all_values:
        shown["values"] = _json_values(values)
    return {key: value for key, value in row.items() if key != "values"} | shown


def _type_of(values: np.ndarray) -> str:
    """`values`' dtype and shape as a schema writes them: ``uint8[3,16,24]``."""
    return f"{values.dtype}[{','.join(map(str, values.shape))}]"


def _open(args: argparse.Namespace) -> tuple[Any, list[Dataset]]:
    """The loader's source and the datasets under it."""
    options = storage_options(args.storage_options)
    if Path(args.source).is_file():  # a mixture TOML
        if args.seq_len is not None:
            raise UsageError("--seq-len is for a dataset (a mixture's sources set seq_len)")
        opener = functools.partial(
            open_plan_source, cache_dir=args.cache_dir, storage_options=options
        )
        mixture = Mixture.from_toml(args.source, opener)
        return mixture, _datasets(mixture)
    dataset = open_dataset(args.source, **url_options(args.source, args.cache_dir, options))
    if args.batch_size is None:
        raise UsageError("a dataset needs --batch-size (the loader's global batch size)")
    if args.seq_len is None:
        return dataset, [dataset]
    field = args.field if args.field is not None else _token_field(dataset)
    return TokenWindows(dataset, field, args.seq_len), [dataset]


def _token_field(dataset: Dataset) -> str:
    """The dataset's only 1-D variable-length numeric field (what --seq-len cuts)."""
    names = [
        f.name for f in dataset.schema if f.kind == "array" and f.is_variable and len(f.shape) == 1
    ]
    if len(names) != 1:
        raise ConfigError(
            f"{dataset.path}: --seq-len needs --field ({names}, expected one 1-D "
            "variable-length field or --field naming it)"
        )
    return names[0]


def _datasets(mixture: Mixture) -> list[Dataset]:
    found = []
    for source in mixture.sources:
        if isinstance(source, Dataset):
            found.append(source)
        elif isinstance(source, Records | TokenWindows) and isinstance(source.dataset, Dataset):
            found.append(source.dataset)
    return found


def _tokenizer(datasets: list[Dataset]) -> Any:
    """``decode`` of the tokenizer the datasets' metadata names (one file for all), when
    it exists unchanged and the optional ``tokenizers`` package is installed; else None.

    The name is either a path (relative to the dataset) or what ``roxxel pack --tokenizer``
    records: ``{"kind": "hf", "path": ..., "sha256": ...}``, its path as typed (relative to
    where the pack ran, or else to the dataset); only an HF ``tokenizer.json`` decodes here,
    and only while its sha256 is still the one it packed with.
    """
    files = set()
    for dataset in datasets:
        named = dataset.metadata.get("tokenizer")
        if isinstance(named, dict):
            if named.get("kind") != "hf" or not isinstance(named.get("path"), str):
                return None
            # as typed at the pack (from where it ran, or absolute), else next to the dataset
            found = [
                file
                for file in (Path(named["path"]), dataset.path / named["path"])
                if file.is_file() and named.get("sha256") == file_sha256(str(file))
            ]
            if not found:
                return None
            files.add(found[0].resolve())
        elif isinstance(named, str) and named:
            files.add(dataset.path / named)
    if len(files) != 1 or not (file := files.pop()).is_file():
        return None
    try:  # optional: a look at a batch works without it
        tokenizers = importlib.import_module("tokenizers")
    except ImportError:
        return None
    # special ids (an appended EOS, a BOS) shown: a peek is for seeing what training reads
    decode = tokenizers.Tokenizer.from_file(str(file)).decode
    return functools.partial(decode, skip_special_tokens=False)


def _json_values(values: np.ndarray) -> Any:
    if values.dtype.kind not in "biuf":  # bfloat16: no JSON number of its own
        values = values.astype(np.float32)
    return values.tolist()


def _shown(row: dict[str, Any]) -> str:
    text = row["text"]
    if text is not None:
        return repr(text[:SHOWN_CHARS]) + (" ..." if len(text) > SHOWN_CHARS else "")
    values = row["values"]
    if values.ndim == 0:
        return str(values)
    flat = values.reshape(-1)  # an image's first values, in C order, on one line
    head = np.array2string(flat[:SHOWN_VALUES], max_line_width=10_000, threshold=10_000)
    return head + (f" ... ({flat.size} in all)" if flat.size > SHOWN_VALUES else "")
