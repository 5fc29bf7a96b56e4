"""``roxxel pack`` and ``roxxel merge``: inputs -> work units -> shards -> manifest."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import islice
from pathlib import Path
from typing import NoReturn

import numpy as np
from tqdm import tqdm

from roxxel.cli.args import (
    UsageError,
    parse_compress_flags,
    parse_field_flags,
    parse_size,
    read_schema_toml,
    storage_options,
)
from roxxel.errors import ConfigError
from roxxel.format.cache import CacheConfig, default_cache_dir
from roxxel.format.remote import RemoteStore, is_url
from roxxel.format.schema import Schema
from roxxel.format.upload import check_destination
from roxxel.format.writer import parse_compress
from roxxel.ingest.images import (
    ImageConfig,
    folder_labels,
    image_folder_inputs,
    parse_image_size,
    pillow,
    table_images,
)
from roxxel.ingest.inputs import (
    BadRecords,
    Input,
    ReadOptions,
    WorkUnit,
    cut_units,
    default_unit_bytes,
    expand_inputs,
    fixed_arrays,
    infer_schema,
    input_schema,
    kind_names,
    locate,
)
from roxxel.ingest.pack import (
    PackConfig,
    UnitResult,
    map_fingerprint,
    mapped_records,
    shuffle_units,
)
from roxxel.ingest.parts import (
    PackSpec,
    finalize,
    finalize_remote,
    find_remote_units,
    lock_output,
    merge,
    prepare_output,
    prepare_remote,
    remote_markers,
    upload_unit,
)
from roxxel.ingest.pool import START_METHODS, UnitPool
from roxxel.ingest.tokenize import (
    INTEGER_DTYPES,
    MAX_TOKEN_ID,
    TokenizeConfig,
    file_sha256,
    load_tokenizer,
    token_dtype,
    token_field_dtype,
)

__all__ = ["add_merge_parser", "add_pack_parser", "pack"]

SAMPLE_RECORDS = 100

PACK_EPILOG = """examples:
  roxxel pack corpus/*.jsonl -o data/corpus --field tokens:int32[] --workers 2
  roxxel pack images.npy -o data/images --input-field image
  roxxel pack corpus/*.jsonl -o data/web --tokenizer tok/tokenizer.json --append-eos --workers 8
  roxxel pack photos/ -o data/photos --image-size 64x64 --workers 8 --skip-bad
  roxxel pack docs.jsonl -o data/tok --map mytok:encode --workers 8 --compress text=zstd:3
  roxxel pack shards/ -o /shared/ds --num-tasks 4 --task-index $SLURM_ARRAY_TASK_ID
  roxxel pack shards/ -o /shared/ds --num-tasks 4 --finalize
  roxxel pack shards/ -o s3://bucket/ds --num-tasks 4 --task-index $SLURM_ARRAY_TASK_ID
Rerun the same command after an interruption: finished work units are kept. With -o URL each
task uploads its units as they finish and the last task to end writes the manifest (or run
--finalize); nothing opens at the URL before that."""

MERGE_EPILOG = """example:
  roxxel merge /scratch/task0 /scratch/task1 -o data/corpus"""


def pack(
    inputs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    quiet: bool = True,
    **options: object,
) -> None:
    """`roxxel pack INPUTS -o OUTPUT` from Python, each option named as its flag
    (``--tokenizer PATH``: ``tokenizer=PATH``; ``--append-eos``: ``append_eos=True``;
    ``--field`` and ``--keep-field``, which repeat: a list; ``--shard-bytes 64M``:
    ``shard_bytes="64M"`` or an int). Values are strings, paths or numbers, True or False
    for a switch; they are parsed as the command line parses them, and it does exactly what
    the command does (docs/cli.md).

    >>> import roxxel
    >>> roxxel.pack(["corpus/*.jsonl"], "data/web", tokenizer="tok.json", append_eos=True)
    ... # doctest: +SKIP

    Raises:
        ConfigError: an unknown option, a value of another type, or options the command
            line refuses (never SystemExit).
        RoxxelError, OSError: bad input, as the command reports it (file, line, rule).
    """
    if sys._getframe(1).f_globals.get("__name__") == "__mp_main__":
        raise ConfigError(
            "roxxel.pack: called while a pack worker process imports the main script (its "
            "name is __mp_main__ there: the workers start from a fresh interpreter once JAX "
            'is loaded); expected the call under `if __name__ == "__main__":`'
        )
    names = _input_names(inputs)
    if not isinstance(quiet, bool):
        raise ConfigError(f"roxxel.pack: quiet={quiet!r} (expected True or False)")
    parser = _RaisingParser(prog="roxxel")
    sub = parser.add_subparsers(dest="command")
    add_pack_parser(sub)
    actions = {a.dest: a for a in sub.choices["pack"]._actions}
    argv = ["pack", f"--output={_option_text('output', output)}"]
    for name, value in options.items():
        action = actions.get(name)
        if action is None or name in ("inputs", "output", "help", "quiet"):
            raise ConfigError(
                f"roxxel.pack: no option {name!r} (expected a `roxxel pack` flag's name,"
                " dashes as underscores, e.g. tokenizer, append_eos, image_size)"
            )
        flag = action.option_strings[-1]
        if action.nargs == 0:  # --append-eos and the like
            if not isinstance(value, bool):
                raise ConfigError(f"roxxel.pack: {name}={value!r} (expected True or False)")
            argv += [flag] if value else []
            continue
        if name == "storage_options" and isinstance(value, Mapping):
            value = json.dumps(value)  # the flag takes JSON text; Python callers hold a dict
        repeats = isinstance(action.default, list)  # --field, --keep-field, --compress
        values = list(value) if repeats and isinstance(value, list | tuple) else [value]
        argv += [f"{flag}={_option_text(name, v)}" for v in values]
    argv += ["-q"] if quiet else []
    argv += ["--", *(_option_text("inputs", n) for n in names)]
    args = parser.parse_args(argv)
    try:
        cmd_pack(args)
    except UsageError as e:
        raise ConfigError(f"roxxel.pack: {e}") from None


class _RaisingParser(argparse.ArgumentParser):
    """An argument parser that raises ConfigError where the command would print its usage
    and exit (`roxxel.pack` runs in the caller's interpreter)."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"roxxel.pack: {message}")


def _input_names(inputs: object) -> list[str]:
    """`roxxel.pack`'s inputs as the command line's: one path, or an iterable of paths."""
    if isinstance(inputs, str | os.PathLike):
        inputs = [inputs]
    if isinstance(inputs, bytes) or not isinstance(inputs, Iterable):
        raise _not_paths(inputs)
    names = list(inputs)
    for name in names:
        if not isinstance(name, str | os.PathLike):
            raise _not_paths(name)
    if not names:
        raise ConfigError("roxxel.pack: no inputs (expected a path, or a list of paths)")
    return [str(os.fspath(name)) for name in names]


def _not_paths(found: object) -> ConfigError:
    return ConfigError(
        f"roxxel.pack: inputs holds a {type(found).__name__} (expected a path, or a list of"
        " paths: files, directories or globs)"
    )


def _option_text(name: str, value: object) -> str:
    """An option's value as the command line has it: text, a path, or a number."""
    if isinstance(value, str | os.PathLike):
        return str(os.fspath(value))
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    shown = "" if name == "storage_options" else f"={value!r}"  # may hold credentials
    raise ConfigError(
        f"roxxel.pack: {name}{shown}: a {type(value).__name__} (expected a string, a path or a"
        " number, or a list of them for a repeated flag; storage_options: a dict or JSON)"
    )


def add_pack_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "pack",
        help="pack inputs into a dataset",
        description="Pack input files (jsonl, text, npy/npz, parquet, arrow, HF, Megatron) into shards.",
        epilog=PACK_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="files, directories or globs")
    p.add_argument(
        "-o", "--output", required=True, metavar="DIR", help="dataset directory, or a URL"
    )
    p.add_argument("--format", choices=kind_names(), help="input kind (default: from extension)")
    p.add_argument(
        "--field",
        action="append",
        default=[],
        metavar="NAME:SPEC",
        help="schema field, e.g. tokens:int32[]",
    )
    p.add_argument("--schema", metavar="FILE.toml", help="schema from a TOML [fields] table")
    p.add_argument("--input-field", metavar="NAME", help="field name for npy rows, text, megatron")
    p.add_argument("--int-dtype", default="int64", help="inferred dtype of integers (int64)")
    p.add_argument("--float-dtype", default="float64", help="inferred dtype of floats (float64)")
    p.add_argument("--map", metavar="MODULE:FUNCTION", help="per-record function; None drops")
    _add_tokenize_flags(p)
    _add_image_flags(p)
    p.add_argument("--workers", type=int, default=1, metavar="N", help="processes (default 1)")
    p.add_argument(
        "--start-method",
        choices=START_METHODS,
        default="auto",
        help="how workers start (default auto: fork when no other thread runs, else forkserver)",
    )
    p.add_argument("--compress", action="append", default=[], metavar="FIELD=zstd[:LEVEL]")
    p.add_argument(
        "--shard-bytes",
        type=parse_size,
        default=256 << 20,
        metavar="SIZE",
        help="shard data size (256M)",
    )
    p.add_argument(
        "--unit-bytes",
        type=parse_size,
        metavar="SIZE",
        help="input bytes per work unit (the inputs' / 32, from 8M up to --shard-bytes)",
    )
    p.add_argument(
        "--shuffle-input", type=int, metavar="SEED", help="shuffle units and records within them"
    )
    p.add_argument("--skip-bad", action="store_true", help="skip malformed records, report them")
    p.add_argument(
        "--num-tasks", type=int, default=1, metavar="T", help="split the work into T tasks"
    )
    p.add_argument("--task-index", type=int, default=0, metavar="I", help="this task (0..T-1)")
    p.add_argument("--finalize", action="store_true", help="check all units and write the manifest")
    p.add_argument("--overwrite", action="store_true", help="replace a different dataset in DIR")
    p.add_argument(
        "--storage-options", metavar="JSON", help="fsspec options of -o URL (a JSON object)"
    )
    p.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="-o URL: stage units in DIR/staging (default $ROXXEL_CACHE_DIR or ~/.cache/roxxel)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    p.set_defaults(func=cmd_pack)


def _add_tokenize_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tokenize text (extra roxxel[tokenizers])")
    g.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="tokenizer.json (HF), .model (SentencePiece) or a tiktoken ranks file",
    )
    g.add_argument("--text-field", default="text", metavar="NAME", help="text to tokenize (text)")
    g.add_argument("--append-eos", action="store_true", help="end each text with EOS")
    g.add_argument("--prepend-bos", action="store_true", help="start each text with BOS")
    g.add_argument(
        "--eos-id", type=int, metavar="N", help="end each text with N (implies --append-eos)"
    )
    g.add_argument(
        "--bos-id", type=int, metavar="N", help="start each text with N (implies --prepend-bos)"
    )
    g.add_argument(
        "--keep-field", action="append", default=[], metavar="NAME", help="also keep this field"
    )


def _add_image_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("images (extra roxxel[images])")
    g.add_argument(
        "--image-size", metavar="HxW", help="decode, resize, center-crop to uint8[3,H,W]"
    )
    g.add_argument("--channels-last", action="store_true", help="store [H,W,3]")
    g.add_argument("--image-pad", action="store_true", help="fit inside and pad, not crop")
    g.add_argument(
        "--keep-encoded", action="store_true", help="store the image bytes (checked to decode)"
    )


def add_merge_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "merge",
        help="gather pack task outputs and write the manifest",
        description="Validate the parts written by `pack --num-tasks` and write one dataset.",
        epilog=MERGE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("parts", nargs="+", metavar="DIR", help="task output directories")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="dataset directory")
    p.add_argument("--overwrite", action="store_true", help="replace a different dataset in DIR")
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=cmd_merge)


def _check_args(args: argparse.Namespace) -> None:
    _check_values(args)
    if args.num_tasks < 1 or not 0 <= args.task_index < args.num_tasks:
        raise UsageError(
            f"--task-index {args.task_index} --num-tasks {args.num_tasks}: expected 0 <= I < T"
        )
    if args.shuffle_input is not None and args.shuffle_input < 0:
        raise UsageError(f"--shuffle-input {args.shuffle_input}: expected a seed >= 0")
    if args.workers < 1:
        raise UsageError(f"--workers {args.workers}: expected at least 1")
    if args.field and args.schema:
        raise UsageError("--field and --schema: give the schema one way")
    if args.tokenizer is not None and (args.image_size or args.keep_encoded):
        raise UsageError("--tokenizer and --image-size/--keep-encoded: pack text or images")
    ids = args.eos_id is not None or args.bos_id is not None
    text_only = args.append_eos or args.prepend_bos or ids or args.keep_field
    if text_only and args.tokenizer is None:
        raise UsageError(
            "--append-eos/--prepend-bos/--eos-id/--bos-id/--keep-field: expected --tokenizer"
        )
    _check_image_flags(args)
    if args.field and args.keep_field:
        named = parse_field_flags(args.field)
        missing = [k for k in args.keep_field if k not in named]
        if missing:
            raise UsageError(
                f"--keep-field {missing[0]}: not among --field (expected --field"
                f" {missing[0]}:SPEC too, since --field gives the whole schema)"
            )
    if args.storage_options is not None and not is_url(args.output):
        raise UsageError(f"--storage-options with -o {args.output}: expected -o URL")
    if is_url(args.output):
        check_destination(args.output, "-o")
    else:
        _check_folder(args.output, "a local folder to pack into, or a URL")


def _check_folder(output: str, rule: str) -> None:
    """Refuse ``-o`` naming a URL (a local folder expected), a file, a link to nothing
    (dangling or a loop), or a path under one, before any work: the pack would plan it
    all, then fail at its first mkdir with a raw errno (`check_local_folder`)."""
    from roxxel.format.upload import check_local_folder

    if is_url(output):  # `merge -o file:///x` made the relative folder file:/x
        raise ConfigError(f"-o: {output!r} is a URL (expected {rule})")
    check_local_folder(output, "-o", rule)


def _check_image_flags(args: argparse.Namespace) -> None:
    if args.keep_encoded and args.image_size:
        raise UsageError("--keep-encoded and --image-size: keep the bytes or decode to pixels")
    for flag, given in (("--channels-last", args.channels_last), ("--image-pad", args.image_pad)):
        if given and args.keep_encoded:
            raise UsageError(f"{flag}: kept-encoded images have no pixels to lay out or pad")
        if given and not args.image_size:
            raise UsageError(f"{flag}: expected --image-size HxW")


def _check_values(args: argparse.Namespace) -> None:
    """Flag values that parse as their type but not as the flag: usage errors too (exit 2),
    as argparse's own."""
    for flag, value in (("--eos-id", args.eos_id), ("--bos-id", args.bos_id)):
        if value is not None and not 0 <= value <= MAX_TOKEN_ID:
            raise UsageError(f"{flag} {value}: expected a token id in [0, {MAX_TOKEN_ID}]")
    if args.image_size is not None:
        try:
            parse_image_size(args.image_size)
        except ConfigError as e:  # the library's word for it: here, the command line's
            raise UsageError(str(e)) from None


def _schema(
    args: argparse.Namespace, units: list[WorkUnit], config: PackConfig
) -> tuple[dict[str, str], str]:
    if args.field:
        return parse_field_flags(args.field), "from --field"
    if args.schema:
        return read_schema_toml(args.schema), f"from {args.schema}"
    own = input_schema(units) if args.map is None and config.tokenize is None else None
    if own is not None:
        return _transformed(own, config), "from the input's own types"
    records = (
        located
        for u in units
        for located in mapped_records(u, _untokenized(config), BadRecords(), [0])
    )
    located = list(islice(records, SAMPLE_RECORDS))
    samples = [r for r, _, _ in located]

    def where(i: int) -> str:  # sample i's file and line (or row), for messages
        return locate(*located[i][1:])

    if config.tokenize is not None:
        keep = TokenizeConfig.from_json(config.tokenize).keep_fields
        if not keep:
            return _transformed({}, config), "from --tokenizer"
        samples = [{k: r[k] for k in keep if k in r} for r in samples]
        _check_kept_nulls(samples, where)
    if config.images is not None:  # its spec is known: the other fields are inferred
        field = ImageConfig.from_json(config.images).field
        samples = [{k: v for k, v in r.items() if k != field} for r in samples]
    spec = infer_schema(
        samples,
        fixed_arrays=fixed_arrays(units),
        int_dtype=args.int_dtype,
        float_dtype=args.float_dtype,
        given=_transformed({}, config),
        where=where,
    )
    return _transformed(spec, config), f"inferred from the first {len(samples)} records"


def _check_kept_nulls(samples: list[dict[str, object]], where: Callable[[int], str]) -> None:
    """Refuse a --keep-field null in a sample, naming its record (``where``): no field type
    holds a null, so --field, which schema inference would ask for, cannot help."""
    for i, sample in enumerate(samples):
        name = next((k for k, v in sample.items() if v is None), None)
        if name is not None:
            raise ConfigError(
                f"{where(i)}: --keep-field {name}: null (expected a value in every record: no "
                f"field type holds a null; drop --keep-field {name}, or fill its nulls with "
                f"--map)"
            )


def _check_given_schema(
    args: argparse.Namespace, config: PackConfig, schema: dict[str, str]
) -> None:
    """A schema from --field or --schema holds what --tokenizer or --image-size make, as
    they make it: no field of theirs dropped, none another dtype than the metadata says,
    and (with --tokenizer) no field the records will not have. Raises UsageError for
    --field, ConfigError naming the --schema file."""
    problem = _schema_problem(config, schema)
    if problem is None:
        return
    name, rule = problem
    if args.field:
        given = f"--field {name}:{schema[name]}" if name in schema else f"--field: no {name!r}"
        raise UsageError(f"{given}: {rule}")
    given = f'{name} = "{schema[name]}"' if name in schema else f"no {name!r}"
    raise ConfigError(f"{args.schema}: {given}: {rule}", path=args.schema)


def _schema_problem(config: PackConfig, schema: dict[str, str]) -> tuple[str, str] | None:
    """(field, rule broken) for the first field of `schema` unlike what the pack makes."""
    if config.tokenize is not None:
        tokens = TokenizeConfig.from_json(config.tokenize)
        for name in schema:
            if name not in (tokens.out_field, *tokens.keep_fields):
                return name, (
                    f"not kept (expected --keep-field {name} too: a --tokenizer pack stores "
                    f"the token ids and the --keep-field fields)"
                )
    if config.images is not None:
        images = ImageConfig.from_json(config.images)
        if schema.get(images.field) != images.spec:
            return images.field, f"expected {images.field}:{images.spec}, the images as packed"
        if images.classes and schema.get(images.label_field) not in INTEGER_DTYPES:
            return images.label_field, (
                f"expected {images.label_field}:int64 (or another integer dtype) for the "
                f"class folders' labels"
            )
    return None


def _untokenized(config: PackConfig) -> PackConfig:
    """The config to sample the other fields with: the parent never encodes or decodes (the
    workers do; it starts no tokenizer threads, so the workers can still be forked)."""
    return dataclasses.replace(config, tokenize=None, images=None)


def _transformed(spec: dict[str, str], config: PackConfig) -> dict[str, str]:
    """An input's schema with the tokenized or decoded field's spec as packed."""
    if config.tokenize is not None:
        tokens = TokenizeConfig.from_json(config.tokenize)
        kept = {k: spec[k] for k in tokens.keep_fields if k in spec}
        return {tokens.out_field: f"{tokens.dtype}[]", **kept}
    if config.images is not None:
        images = ImageConfig.from_json(config.images)
        label = {images.label_field: "int64"} if images.classes else {}
        return {**spec, images.field: images.spec, **label}
    return spec


def _tokenize(args: argparse.Namespace) -> dict[str, object] | None:
    """The --tokenizer settings, checked now (file, extra, special tokens, the token field),
    not in a worker."""
    if args.tokenizer is None:
        return None
    sha256 = file_sha256(args.tokenizer)
    tok = load_tokenizer(args.tokenizer, sha256)
    highest = max(tok.vocab_size - 1, args.eos_id or 0, args.bos_id or 0)
    config = TokenizeConfig(
        path=args.tokenizer,
        sha256=sha256,
        dtype=_token_dtype(args, token_dtype(highest + 1)),
        text_field=args.text_field,
        append_eos=args.append_eos or args.eos_id is not None,
        prepend_bos=args.prepend_bos or args.bos_id is not None,
        eos_id=args.eos_id,
        bos_id=args.bos_id,
        keep_fields=tuple(args.keep_field),
    ).with_specials(tok)
    _check_special_ids(args, config)
    _note_past_vocabulary(args, tok.vocab_size, config.dtype)
    return dataclasses.asdict(config)


def _check_special_ids(args: argparse.Namespace, config: TokenizeConfig) -> None:
    """Refuse an EOS / BOS id the token dtype of --field or --schema cannot hold before any
    work: it is in every record, so the pack would stop at the first. A UsageError for
    --field, a ConfigError naming the --schema file (as `_token_dtype`)."""
    high = int(np.iinfo(config.dtype).max)
    for name, flag, value in (
        ("EOS", "--eos-id", config.eos_id),
        ("BOS", "--bos-id", config.bos_id),
    ):
        if value is None or value <= high:
            continue
        given = args.eos_id if flag == "--eos-id" else args.bos_id
        who = f"{flag} {value}" if given is not None else f"the tokenizer's {name} id {value}"
        field, wider = config.out_field, f"{token_dtype(value + 1)}[]"
        example = f"--field {field}:{wider}" if args.field else f'{field} = "{wider}"'
        rule = (
            f"{who} does not fit {config.dtype} (expected ids <= {high}: a wider dtype, e.g. "
            f"{example})"
        )
        if args.field:
            raise UsageError(f"--field {field}:{config.dtype}[]: {rule}")
        spec = f'{field} = "{config.dtype}[]"'
        raise ConfigError(f"{args.schema}: {spec}: {rule}", path=args.schema)


def _note_past_vocabulary(args: argparse.Namespace, vocab_size: int, dtype: str) -> None:
    """A note line (unless -q) for an --eos-id / --bos-id past the tokenizer's vocabulary:
    kept, since a model's vocabulary may be padded past the tokenizer's (and a tiktoken
    ranks file lacks the EOS its model uses), but said, with the dtype it may have widened."""
    for flag, value in (("--eos-id", args.eos_id), ("--bos-id", args.bos_id)):
        if value is not None and value >= vocab_size and not args.quiet:
            print(
                f"roxxel: note: {flag} {value} is outside the tokenizer's vocabulary of "
                f"{vocab_size} ids [0, {vocab_size}) (kept, as for a padded vocabulary; "
                f"tokens stored as {dtype})",
                file=sys.stderr,
            )


def _token_dtype(args: argparse.Namespace, default: str) -> str:
    """The token dtype --field or --schema gives, else ``default``. Either gives the whole
    schema, so one without the token field (or, for --schema, a kept field) is refused: the
    field would be dropped."""
    if not args.field and not args.schema:
        return default
    fields = parse_field_flags(args.field) if args.field else read_schema_toml(args.schema)
    if "tokens" not in fields and args.field:
        raise UsageError(
            f"--field: no field 'tokens' for the --tokenizer ids (expected --field"
            f" tokens:{default}[] too, since --field gives the whole schema)"
        )
    missing = [k for k in ("tokens", *args.keep_field) if k not in fields]
    if missing:  # only --schema gets here: _check_args refused a --keep-field --field lacks
        name = missing[0]
        what, spec = (
            ("'tokens' for the --tokenizer ids", f"{default}[]")
            if name == "tokens"
            else (f"for --keep-field {name}", "SPEC")
        )
        raise ConfigError(
            f'{args.schema}: no field {what} (expected {name} = "{spec}" too, since --schema'
            " gives the whole schema)",
            path=args.schema,
        )
    spec = fields["tokens"]
    if not args.field:
        return token_field_dtype(spec, f'{args.schema}: tokens = "{spec}"')
    try:
        return token_field_dtype(spec, f"--field tokens:{spec}")
    except ConfigError as e:  # the library's word for it: here, the command line's
        raise UsageError(str(e)) from None


_NO_BYTES = ("text", "text-file", "jsonl")  # input kinds whose records hold no bytes


def _images(args: argparse.Namespace, inputs: list[Input]) -> dict[str, object] | None:
    """The --image-size settings with the class folders' labels, or None."""
    found = [i.path for i in inputs if i.kind == "image"]
    if not args.image_size and not args.keep_encoded:
        if found:
            raise ConfigError(
                f"{found[0]}: an image input (expected --image-size HxW or --keep-encoded)",
                path=found[0],
            )
        return None
    textual = [i for i in inputs if i.kind in _NO_BYTES]
    if textual and args.map is None:  # a --map function may make image bytes of anything
        raise ConfigError(
            f"{textual[0].path}: a {textual[0].kind} input in an image pack (expected image "
            "files, or Parquet, Arrow or HF columns of image bytes)",
            path=textual[0].path,
        )
    height, width = parse_image_size(args.image_size) if args.image_size else (0, 0)
    folders = [a for a in args.inputs if os.path.isdir(a)]
    config = ImageConfig(
        height=height,
        width=width,
        field=args.input_field or "image",
        channels_last=args.channels_last,
        pad=args.image_pad,
        keep_encoded=args.keep_encoded or not args.image_size,
        classes=folder_labels(folders, found),
    )
    if config.classes and config.field == config.label_field:
        raise UsageError(
            f"--input-field {config.field}: the class folders' labels go to field "
            f"{config.label_field!r} (expected another name for the image field)"
        )
    # the image column checked before a schema is printed; HF ClassLabel names kept
    config = table_images(config, inputs, folders, args.map is not None)
    pillow()  # a missing extra fails here, not in a worker
    doc = dataclasses.asdict(config)
    if not config.class_names:  # left out, as before it existed: the same pack fingerprint
        del doc["class_names"]
    return doc


def _metadata(config: PackConfig) -> dict[str, object]:
    """The manifest metadata: the pack's fingerprint, and how tokens or pixels were made."""
    doc: dict[str, object] = {"roxxel_pack": config.fingerprint}
    if config.tokenize is not None:
        tokens = TokenizeConfig.from_json(config.tokenize)
        doc["tokenizer"] = tokens.metadata(load_tokenizer(tokens.path, tokens.sha256))
    if config.images is not None:
        doc["images"] = ImageConfig.from_json(config.images).metadata()
    # keys sorted at every level, as a local pack reads them back from its plan.json: a pack
    # to a URL then writes the same manifest (the same fingerprint) as a local one
    return json.loads(json.dumps(doc, sort_keys=True))


def _fingerprint(args: argparse.Namespace, units: list[WorkUnit], config: PackConfig) -> str:
    doc = {
        "units": [u.to_json() for u in units],
        "sizes": sorted({p.path: os.path.getsize(p.path) for u in units for p in u.pieces}.items()),
        "schema": config.schema,
        "compress": config.compress,
        "shard_bytes": config.shard_bytes,
        "map": map_fingerprint(args.map),
        "read": [config.read.field, config.read.skip_bad],
        "shuffle": config.shuffle_seed,
        **({"tokenize": config.tokenize} if config.tokenize is not None else {}),
        **({"images": config.images} if config.images is not None else {}),
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]


SKIPPED_LINES = 20  # the files passed over that are listed one by one; the rest counted


def _say_skipped(skipped: list[str]) -> None:
    for line in skipped[:SKIPPED_LINES]:
        print(f"roxxel: skipped {line}", file=sys.stderr)
    if len(skipped) > SKIPPED_LINES:
        more = len(skipped) - SKIPPED_LINES
        print(f"roxxel: skipped {more} more files (--quiet hides these lines)", file=sys.stderr)


def _config(args: argparse.Namespace, out_dir: str) -> tuple[PackConfig, list[WorkUnit]]:
    skipped: list[str] = []
    inputs = expand_inputs(args.inputs, args.format, skipped)
    if args.image_size or args.keep_encoded:  # other files in an image folder: passed over
        folders = [a for a in args.inputs if os.path.isdir(a)]
        inputs = image_folder_inputs(folders, inputs, skipped)
    if not args.quiet:
        _say_skipped(skipped)
    if args.input_field is not None and not (args.image_size or args.keep_encoded):
        _check_input_field(args.input_field, inputs)
    unit_bytes = args.unit_bytes or (  # --shuffle-input mixes records within a unit
        args.shard_bytes
        if args.shuffle_input is not None
        else default_unit_bytes(inputs, args.shard_bytes)
    )
    units = shuffle_units(cut_units(inputs, unit_bytes), args.shuffle_input)
    config = PackConfig(
        out_dir=out_dir,
        schema={},
        fingerprint="",
        read=ReadOptions(args.input_field, args.skip_bad),
        map_spec=args.map,
        compress=parse_compress_flags(args.compress),
        shard_bytes=args.shard_bytes,
        shuffle_seed=args.shuffle_input,
        tokenize=_tokenize(args),
        images=_images(args, inputs),
    )
    if config.tokenize is not None:  # its sample reads the text and kept fields only
        config = _reading(args, config, {})
    schema, source = _schema(args, units, config)
    if args.field or args.schema:
        _check_given_schema(args, config, schema)
    parse_compress(config.compress, Schema.parse(schema))  # fail now, not in a worker
    if not args.quiet:
        print(f"schema ({source}): " + ", ".join(f"{k}:{v}" for k, v in schema.items()))
    config = _reading(args, dataclasses.replace(config, schema=schema), schema)
    return dataclasses.replace(config, fingerprint=_fingerprint(args, units, config)), units


_ONE_FIELD = ("text", "text-file", "npy", "megatron")  # input kinds --input-field names


def _check_input_field(name: str, inputs: list[Input]) -> None:
    """Refuse ``--input-field`` where no input has the one field it names (an image pack
    names its image field with it, whatever the inputs: not checked here)."""
    if inputs and not any(i.kind in _ONE_FIELD for i in inputs):
        raise UsageError(
            f"--input-field {name}: names no field of a {inputs[0].kind} input "
            f"({inputs[0].path}; expected text, text-file, npy or megatron inputs, whose "
            f"records have one field, or an image pack)"
        )


def _reading(args: argparse.Namespace, config: PackConfig, schema: dict[str, str]) -> PackConfig:
    """``config`` reading only the input columns the pack uses: the schema's fields (but
    the token ids --tokenizer makes), the text and kept fields of --tokenizer, the image
    field (all of them with --map, whose function sees whole records)."""
    names = set(schema)
    if config.tokenize is not None:  # its token ids are made, not read
        tokenize = TokenizeConfig.from_json(config.tokenize)
        names = (names - {tokenize.out_field}) | {tokenize.text_field, *tokenize.keep_fields}
    if config.images is not None:
        names.add(ImageConfig.from_json(config.images).field)
    columns = None if args.map is not None else tuple(sorted(names))
    return dataclasses.replace(config, read=dataclasses.replace(config.read, columns=columns))


def cmd_pack(args: argparse.Namespace) -> int:
    _check_args(args)
    if is_url(args.output):
        return _pack_to_url(args)
    start = time.perf_counter()
    config, units = _config(args, args.output)
    out = Path(args.output)
    plan = PackSpec(config.fingerprint, len(units), config.schema, _metadata(config))
    # one task alone, or --finalize: the directory alone; a task of several: its share
    task = args.task_index if args.num_tasks > 1 and not args.finalize else None
    with lock_output(out, task) as lock:
        prepare_output(out, plan, args.overwrite, lock)
        if args.finalize:
            finalize(out)
            _say(args, f"{out}: manifest written for {len(units)} work units")
            return 0
        mine = units[args.task_index :: args.num_tasks]
        results = _run(args, config, mine, lock.fds)
        _report(args, results, mine, start)
        if args.num_tasks == 1:
            finalize(out)
            return 0
    _say(
        args,
        f"task {args.task_index}/{args.num_tasks} done; when all are: roxxel merge {out} -o {out}",
    )
    return 0


def _pack_to_url(args: argparse.Namespace) -> int:
    """``roxxel pack ... -o URL`` (docs/remote.md): every task computes the plan and agrees on
    it at the URL, packs its units in a local staging folder and uploads each unit's shards,
    then its marker, as the unit ends; the task that then finds every unit's marker (or
    ``--finalize``) checks them all and writes the manifest last."""
    start = time.perf_counter()
    store = RemoteStore(args.output, storage_options(args.storage_options))
    config, units = _config(args, str(_staging(args)))
    plan = PackSpec(config.fingerprint, len(units), config.schema, _metadata(config))
    if prepare_remote(store, plan, args.overwrite, create=not args.finalize):
        _say(args, f"{args.output}: already packed with these arguments (its manifest is there)")
        return 0
    if not args.finalize:
        mine = units[args.task_index :: args.num_tasks]
        there = find_remote_units(store, plan, (u.index for u in mine))
        todo = [u for u in mine if u.index not in there]
        results = _stage_and_upload(args, config, todo, store, plan) if todo else []
        _report(args, results, todo, start, len(mine) - len(todo))
        missing = plan.num_units - len(remote_markers(store, plan))
        if missing:
            _say(args, _waiting(args, len(there), missing))
            return 0
    # --finalize, or the last task to end (tasks ending together write the same bytes)
    num = finalize_remote(store, plan, args.num_tasks)
    _say(args, f"{args.output}: manifest written for {plan.num_units} work units ({num} shards)")
    return 0


def _waiting(args: argparse.Namespace, num_there: int, num_missing: int) -> str:
    return (
        f"task {args.task_index}/{args.num_tasks} done ({num_there} of its units were at "
        f"{args.output} already); {num_missing} work units of other tasks to come: the last "
        "task to end writes the manifest (or rerun with --finalize)"
    )


def _staging(args: argparse.Namespace) -> Path:
    """This task's local folder for ``-o URL``: under the cache dir, by URL and task."""
    from roxxel.format.cache import cache_root  # '' or '  ' refused, ~ expanded

    rule = "expected a folder, or no --cache-dir for $ROXXEL_CACHE_DIR or ~/.cache/roxxel"
    given = args.cache_dir
    base = default_cache_dir() if given is None else cache_root(given, "--cache-dir", rule)
    folder = CacheConfig(args.output, base).folder.name
    return base / "staging" / folder / f"task-{args.task_index}"


def _stage_and_upload(
    args: argparse.Namespace,
    config: PackConfig,
    units: list[WorkUnit],
    store: RemoteStore,
    plan: PackSpec,
) -> list[UnitResult]:
    """Pack ``units`` in the staging folder, uploading each as it ends; then remove the
    folder (kept after a failure: a rerun uploads what it holds without packing it again)."""
    stage = Path(config.out_dir)
    with lock_output(stage) as lock:
        prepare_output(stage, plan, True, lock)  # the folder is this task's: no other pack
        results = _run(
            args, config, units, lock.fds, lambda r: upload_unit(store, stage, plan, r.unit)
        )
    shutil.rmtree(stage)
    with contextlib.suppress(OSError):  # other tasks of this host may stage beside it
        stage.parent.rmdir()
    return results


def _run(
    args: argparse.Namespace,
    config: PackConfig,
    units: list[WorkUnit],
    lock_fds: list[int],
    on_result: Callable[[UnitResult], None] | None = None,
) -> list[UnitResult]:
    results: list[UnitResult] = []
    records = 0
    pool = UnitPool(config, units, args.workers, args.start_method, lock_fds)
    with pool, _bar(args, units) as bar:
        for result in pool.results():
            if on_result is not None:
                on_result(result)
            results.append(result)
            records += result.num_records
            bar.update(result.num_input_bytes)
            rate = records / max(bar.format_dict["elapsed"], 1e-9)
            postfix = {"records": _count(records), "records_s": _count(int(rate))}
            bar.set_postfix(postfix, refresh=False)
    return results


def _count(num: int) -> str:
    """A count as an integer, scaled past 9999 (tqdm's own postfix would print ``3e+4``).

    >>> _count(999), _count(30000), _count(1234567)
    ('999', '30.0k', '1.23M')
    """
    return str(num) if num < 10_000 else tqdm.format_sizeof(num)


class _Bar(tqdm):
    monitor_interval = 0  # no monitor thread: it would outlive the pack and rule out fork


def _bar(args: argparse.Namespace, units: list[WorkUnit]) -> tqdm:
    return _Bar(
        total=sum(u.num_bytes for u in units), unit="B", unit_scale=True, unit_divisor=1024,
        file=sys.stderr, disable=args.quiet or not sys.stderr.isatty(), desc="pack",
    )  # fmt: skip


def _report(
    args: argparse.Namespace,
    results: list[UnitResult],
    units: list[WorkUnit],
    start: float,
    uploaded: int = 0,
) -> None:
    """The summary line of the units packed now (``uploaded``: this task's units a URL held
    already, skipped)."""
    bad = BadRecords()
    for r in sorted(results, key=lambda r: r.unit):
        bad.merge(r.bad)
    if bad.count:
        print(
            f"roxxel: skipped {bad.count} bad records; first: " + " | ".join(bad.first),
            file=sys.stderr,
        )
    elapsed = max(time.perf_counter() - start, 1e-9)
    in_bytes = sum(u.num_bytes for u in units)
    records = sum(r.num_records for r in results)
    _say(
        args,
        f"packed {records} records into {sum(r.num_shards for r in results)} shards "
        f"({sum(r.num_output_bytes for r in results)} bytes) from {len(units)} work units "
        f"({sum(r.resumed for r in results)} kept from an earlier run, "
        f"{sum(r.num_dropped for r in results)} records dropped by --map) in {elapsed:.1f} s: "
        f"{records / elapsed:.0f} records/s, {in_bytes / elapsed / 1e6:.1f} MB/s input"
        + (f"; {uploaded} more work units were at the URL already" if uploaded else ""),
    )


def _say(args: argparse.Namespace, line: str) -> None:
    if not args.quiet:
        print(line)


def cmd_merge(args: argparse.Namespace) -> int:
    _check_folder(args.output, "a local folder to merge into")
    manifest = merge([Path(p) for p in args.parts], Path(args.output), args.overwrite)
    _say(args, f"{manifest}: written from {len(args.parts)} part directories")
    return 0
