"""``roxxel pack --tokenizer`` (issue 14): every packed record is the tokenizer's own encode.

The tokenizers are built here, offline: a byte-level BPE trained with ``tokenizers``, a
SentencePiece model trained on a tiny text, and a tiktoken ranks file written from the BPE's
vocabulary (tiktoken loads it from the file; nothing is downloaded).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import roxxel
from roxxel.cli import main
from roxxel.errors import ConfigError
from roxxel.ingest import tokenize
from roxxel.ingest.tokenize import TIKTOKEN_PATTERN, load_tokenizer
from tests.cli_run import pack_in_subprocess

tokenizers = pytest.importorskip("tokenizers")
spm = pytest.importorskip("sentencepiece")
tiktoken = pytest.importorskip("tiktoken")
from tiktoken.load import load_tiktoken_bpe  # noqa: E402

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
    "hex",
    "jam",
]


def _texts(num: int) -> list[str]:
    rng = np.random.default_rng(0)
    return [
        " ".join(WORDS[j] for j in rng.integers(0, len(WORDS), int(rng.integers(1, 30))))
        + f" {i}. Ünïcödé ✓"
        for i in range(num)
    ]


def _bytes_of_unicode() -> dict[str, int]:
    """The inverse of the byte-level BPE's byte -> printable character table (GPT-2's)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


def train_bpe(texts: list[str], vocab_size: int) -> Any:
    """A byte-level BPE trained offline on ``texts``, with ``<|endoftext|>`` as a special."""
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    return bpe


@pytest.fixture(scope="module")
def toks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("toks")
    texts = _texts(400)
    bpe = train_bpe(texts, 500)
    bpe.save(str(folder / "tokenizer.json"))
    table = _bytes_of_unicode()
    with open(folder / "ranks.tiktoken", "w") as f:
        for token, rank in sorted(bpe.get_vocab().items(), key=lambda kv: kv[1]):
            if token != "<|endoftext|>":
                data = bytes(table[c] for c in token)
                f.write(f"{base64.b64encode(data).decode()} {rank}\n")
    (folder / "sp.txt").write_text("\n".join(texts))
    spm.SentencePieceTrainer.train(
        input=str(folder / "sp.txt"),
        model_prefix=str(folder / "sp"),
        vocab_size=120,
        model_type="bpe",
        minloglevel=2,
    )
    return {
        "hf": folder / "tokenizer.json",
        "sp": folder / "sp.model",
        "tiktoken": folder / "ranks.tiktoken",
    }


def _jsonl(path: Path, texts: list[str]) -> Path:
    with open(path, "w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"text": text, "url": f"https://x/{i}", "n": i}) + "\n")
    return path


def _pack(*argv: object) -> int:
    return main(["pack", *map(str, argv), "-q"])


def _tiktoken_encoding(path: Path) -> Any:
    return tiktoken.Encoding(
        "test",
        pat_str=TIKTOKEN_PATTERN,
        mergeable_ranks=load_tiktoken_bpe(str(path)),
        special_tokens={},
    )


@pytest.mark.parametrize("workers", [1, 2])
def test_issue14_hf_tokenizer_records_equal_its_encode_plus_eos(toks, tmp_path, workers):
    texts = _texts(300)
    src = _jsonl(tmp_path / "c.jsonl", texts)
    out = tmp_path / "ds"
    argv = [src, "-o", out, "--tokenizer", toks["hf"], "--append-eos", "--keep-field", "url"]
    assert _pack(*argv, "--workers", workers, "--unit-bytes", "4K") == 0
    tok = tokenizers.Tokenizer.from_file(str(toks["hf"]))
    eos = tok.token_to_id("<|endoftext|>")
    ds = roxxel.open_dataset(out)
    assert ds.schema.to_json() == {"tokens": "uint16[]", "url": "str"}
    assert ds.num_shards > 1
    assert len(ds) == len(texts)
    for i, text in enumerate(texts):
        record = ds[i]
        assert record["tokens"].tolist() == [*tok.encode(text, add_special_tokens=False).ids, eos]
        assert record["url"] == f"https://x/{i}"
    meta = ds.metadata["tokenizer"]
    digest = hashlib.sha256(toks["hf"].read_bytes()).hexdigest()
    assert (meta["kind"], meta["sha256"], meta["eos_id"], meta["dtype"]) == (
        "hf",
        digest,
        eos,
        "uint16",
    )


@pytest.mark.parametrize("workers", [1, 2])
def test_issue14_sentencepiece_records_equal_its_encode_with_bos_and_eos(toks, tmp_path, workers):
    texts = _texts(120)
    src = tmp_path / "c.txt"
    src.write_text("\n".join(texts) + "\n")
    out = tmp_path / "ds"
    argv = [src, "-o", out, "--tokenizer", toks["sp"], "--prepend-bos", "--append-eos"]
    assert _pack(*argv, "--workers", workers, "--unit-bytes", "2K") == 0
    sp = spm.SentencePieceProcessor(model_file=str(toks["sp"]))
    ds = roxxel.open_dataset(out)
    for i, text in enumerate(texts):
        want = [sp.bos_id(), *sp.encode(text), sp.eos_id()]
        assert ds[i]["tokens"].tolist() == want


@pytest.mark.parametrize("workers", [1, 2])
def test_issue14_tiktoken_ranks_file_records_equal_its_encode_with_eos_id(toks, tmp_path, workers):
    texts = _texts(150)
    src = pq.write_table(pa.table({"body": texts}), tmp_path / "c.parquet", row_group_size=40)
    del src
    out = tmp_path / "ds"
    argv = [tmp_path / "c.parquet", "-o", out, "--tokenizer", toks["tiktoken"], "--text-field"]
    assert _pack(*argv, "body", "--append-eos", "--eos-id", 0, "--workers", workers) == 0
    enc = _tiktoken_encoding(toks["tiktoken"])
    ds = roxxel.open_dataset(out)
    assert [ds[i]["tokens"].tolist() for i in range(len(texts))] == [
        [*enc.encode(t), 0] for t in texts
    ]


def test_issue14_text_files_one_document_each_and_field_dtype_override(toks, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    texts = _texts(5)
    for i, text in enumerate(texts):
        (docs / f"{i}.md").write_text(text + "\nsecond line\n")
    out = tmp_path / "ds"
    argv = [docs, "-o", out, "--format", "text-file", "--tokenizer", toks["hf"]]
    assert _pack(*argv, "--field", "tokens:int32[]") == 0
    tok = tokenizers.Tokenizer.from_file(str(toks["hf"]))
    ds = roxxel.open_dataset(out)
    assert ds.schema.to_json() == {"tokens": "int32[]"}
    for i, text in enumerate(texts):
        want = tok.encode(text + "\nsecond line\n", add_special_tokens=False).ids
        assert ds[i]["tokens"].tolist() == want


def test_issue14_info_prints_the_tokenizer_and_its_fingerprint(toks, tmp_path, capsys):
    src = _jsonl(tmp_path / "c.jsonl", _texts(20))
    assert _pack(src, "-o", tmp_path / "ds", "--tokenizer", toks["hf"], "--append-eos") == 0
    capsys.readouterr()
    assert main(["info", str(tmp_path / "ds")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("tokenizer:"))
    assert str(toks["hf"]) in line
    assert hashlib.sha256(toks["hf"].read_bytes()).hexdigest() in line


def test_issue14_changed_tokenizer_file_changes_the_pack_fingerprint(toks, tmp_path):
    src = _jsonl(tmp_path / "c.jsonl", _texts(20))
    tok = tmp_path / "tokenizer.json"
    shutil.copy(toks["hf"], tok)
    assert _pack(src, "-o", tmp_path / "a", "--tokenizer", tok) == 0
    tok.write_text(tok.read_text().replace('"quick"', '"quick" '))  # another file, same tokens
    assert _pack(src, "-o", tmp_path / "b", "--tokenizer", tok) == 0
    first, second = (roxxel.open_dataset(tmp_path / d).metadata for d in "ab")
    assert first["tokenizer"]["sha256"] != second["tokenizer"]["sha256"]
    assert first["roxxel_pack"] != second["roxxel_pack"]


def test_issue14_missing_tokenizer_file_is_one_line_naming_it(tmp_path, capsys):
    src = _jsonl(tmp_path / "c.jsonl", _texts(3))
    assert _pack(src, "-o", tmp_path / "ds", "--tokenizer", tmp_path / "nope.json") == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "nope.json" in err


def test_issue14_text_field_not_a_string_names_file_and_line(toks, tmp_path, capsys):
    src = tmp_path / "c.jsonl"
    src.write_text('{"text": "fine"}\n{"text": 7}\n{"text": "also fine"}\n')
    assert _pack(src, "-o", tmp_path / "ds", "--tokenizer", toks["hf"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"{src}:2" in err and "int" in err and "expected a string" in err
    assert _pack(src, "-o", tmp_path / "ds", "--tokenizer", toks["hf"], "--skip-bad") == 0
    assert len(roxxel.open_dataset(tmp_path / "ds")) == 2


def test_issue14_a_missing_text_field_lists_the_fields_the_record_has(toks, tmp_path, capsys):
    """`--text-field meta.text` said "field 'meta.text': missing" and no more (nested names
    are not looked into): the message lists the record's own fields."""
    src = tmp_path / "c.jsonl"
    src.write_text('{"meta": {"text": "x"}, "url": "u"}\n')
    argv = [src, "-o", tmp_path / "ds", "--tokenizer", toks["hf"], "--text-field", "meta.text"]
    assert _pack(*argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "['meta', 'url']" in err and "top-level" in err


def test_issue14_a_tiktoken_file_named_model_is_told_to_use_another_extension(toks, tmp_path):
    """Llama 3 ships its tiktoken ranks as `tokenizer.model`: read as SentencePiece, the
    error was a protobuf parse failure with no way out."""
    named = tmp_path / "tokenizer.model"
    shutil.copy(toks["tiktoken"], named)
    with pytest.raises(ConfigError, match=r"tokenizer\.model.*\.tiktoken"):
        load_tokenizer(str(named))


def test_issue14_append_eos_without_an_eos_token_asks_for_eos_id(toks, tmp_path, capsys):
    src = _jsonl(tmp_path / "c.jsonl", _texts(3))
    assert _pack(src, "-o", tmp_path / "ds", "--tokenizer", toks["tiktoken"], "--append-eos") == 1
    assert "--eos-id" in capsys.readouterr().err


def test_issue14_missing_extra_says_which_to_install(toks, tmp_path, monkeypatch):
    tok = tmp_path / "tokenizer.json"
    shutil.copy(toks["hf"], tok)
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ConfigError, match=r"roxxel\[tokenizers\]"):
        load_tokenizer(str(tok))


def test_issue14_a_tokenizers_too_old_for_the_extra_says_so(toks, tmp_path, monkeypatch):
    """tokenizers before 0.21 has no encode_batch_fast: a ConfigError naming the extra, not
    an AttributeError in the pack workers."""
    import tokenizers

    monkeypatch.setattr(tokenizers, "__version__", "0.19.1")
    with pytest.raises(ConfigError, match=r"0\.19\.1.*>= 0\.21.*roxxel\[tokenizers\]"):
        load_tokenizer(toks["hf"])


def test_issue14_token_id_beyond_the_field_dtype_names_the_record(toks, tmp_path, capsys):
    src = _jsonl(tmp_path / "c.jsonl", ["a", "the quick brown fox " * 3])
    argv = [src, "-o", tmp_path / "ds", "--tokenizer", toks["hf"], "--field", "tokens:uint8[]"]
    assert _pack(*argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"{src}:2" in err and "uint8" in err


@pytest.mark.parametrize(
    "flag",
    [["--append-eos"], ["--eos-id", "3"], ["--bos-id", "3"], ["--keep-field", "url"]],
)
def test_issue14_tokenizer_options_without_tokenizer_are_usage_errors(tmp_path, flag):
    src = _jsonl(tmp_path / "c.jsonl", _texts(3))
    assert _pack(src, "-o", tmp_path / "ds", *flag) == 2


def test_issue14_hf_save_to_disk_text_column_with_a_kept_field(toks, tmp_path):
    texts = _texts(40)
    d = tmp_path / "hf"
    d.mkdir()
    table = pa.table({"text": texts, "id": pa.array(range(40), pa.int32())})
    with pa.ipc.new_stream(str(d / "data-00000-of-00001.arrow"), table.schema) as w:
        w.write_table(table)
    (d / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]})
    )
    out = tmp_path / "ds"
    assert _pack(d, "-o", out, "--tokenizer", toks["hf"], "--keep-field", "id", "--workers", 2) == 0
    tok = tokenizers.Tokenizer.from_file(str(toks["hf"]))
    ds = roxxel.open_dataset(out)
    assert ds.schema.to_json() == {"tokens": "uint16[]", "id": "int32"}
    for i, text in enumerate(texts):
        assert ds[i]["tokens"].tolist() == tok.encode(text, add_special_tokens=False).ids
        assert ds[i]["id"] == i


def test_issue13_item11_peek_decodes_with_the_tokenizer_the_pack_recorded(toks, tmp_path, capsys):
    """`roxxel peek` of a dataset packed with --tokenizer prints each row as that tokenizer's
    text, and falls back to numbers once the tokenizer file changed."""
    texts = _texts(40)
    out = tmp_path / "ds"
    assert _pack(_jsonl(tmp_path / "c.jsonl", texts), "-o", out, "--tokenizer", toks["hf"]) == 0
    argv = ["peek", str(out), "--step", "0", "--batch-size", "2", "--no-shuffle", "--json"]
    capsys.readouterr()
    assert main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]
    tok = tokenizers.Tokenizer.from_file(str(toks["hf"]))
    assert [row["text"] for row in rows] == [tok.decode(tok.encode(t).ids) for t in texts[:2]]
    changed = tmp_path / "ds-tok.json"
    changed.write_bytes(toks["hf"].read_bytes() + b" ")
    meta_path = out / "manifest.json"
    doc = json.loads(meta_path.read_text())
    doc["metadata"]["tokenizer"]["path"] = str(changed)
    meta_path.write_text(json.dumps(doc))
    assert main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]
    assert all(row["text"] is None for row in rows)


@pytest.mark.parametrize("num_cores", [2, 8])
def test_issue14_speed_each_pack_process_tokenizes_with_its_share_of_the_cores(
    toks, tmp_path, monkeypatch, num_cores
):
    """HF tokenizers starts a thread per core in every process that encodes: 2 pack
    processes on 2 cores ran 4 threads, spinning on each other. Each process (the main one
    included) now encodes in its share: on 2 cores in its own thread (parallelism off), on
    8 with a pool of 4; the caller's environment is left as it was."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(num_cores)))
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)
    seen = tmp_path / "seen"
    seen.mkdir()
    real = tokenize._LOADERS["hf"]

    def spy(path: str) -> tokenize.Tokenizer:
        tok = real(path)

        def encode(texts: list[str]) -> list[list[int]]:
            env = [os.environ.get(k, "-") for k in ("TOKENIZERS_PARALLELISM", "RAYON_NUM_THREADS")]
            (seen / str(os.getpid())).write_text(" ".join(env))
            return tok.encode_batch(texts)

        return dataclasses.replace(tok, encode_batch=encode)

    monkeypatch.setitem(tokenize._LOADERS, "hf", spy)
    monkeypatch.setattr(tokenize, "_LOADED", {})
    src = _jsonl(tmp_path / "c.jsonl", _texts(300))
    argv = [src, "-o", tmp_path / "ds", "--tokenizer", toks["hf"], "--unit-bytes", "4K"]
    assert _pack(*argv, "--workers", 2, "--start-method", "fork") == 0
    expected = "false -" if num_cores == 2 else "- 4"
    assert [p.read_text() for p in seen.iterdir()] == [expected] * 2
    assert "TOKENIZERS_PARALLELISM" not in os.environ and "RAYON_NUM_THREADS" not in os.environ


def test_issue14_speed_token_ids_over_the_dtype_in_mid_batch_name_their_record(
    toks, tmp_path, capsys
):
    """The ids of a batch are converted and range-checked as one array; the record named is
    still the one holding the id (here the 300th of 400, with BOS and EOS around each)."""
    texts = ["a"] * 400
    texts[299] = "the quick brown fox " * 3
    src = _jsonl(tmp_path / "c.jsonl", texts)
    argv = [src, "-o", tmp_path / "ds", "--tokenizer", toks["hf"], "--field", "tokens:uint8[]"]
    assert _pack(*argv, "--eos-id", "0", "--append-eos") == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"{src}:300:" in err and "uint8" in err


def test_issue14_peek_finds_a_tokenizer_given_relative_to_where_the_pack_ran(
    toks, tmp_path, monkeypatch, capsys
):
    """The docs write `--tokenizer tok/tokenizer.json`: the manifest keeps that path as typed,
    and `roxxel peek`, run from the same folder, decodes with it."""
    texts = _texts(10)
    (tmp_path / "tok").mkdir()
    shutil.copy(toks["hf"], tmp_path / "tok" / "tokenizer.json")
    _jsonl(tmp_path / "c.jsonl", texts)
    monkeypatch.chdir(tmp_path)
    assert _pack("c.jsonl", "-o", "out/ds", "--tokenizer", "tok/tokenizer.json") == 0
    capsys.readouterr()
    argv = ["peek", "out/ds", "--step", "0", "--batch-size", "2", "--no-shuffle", "--json"]
    assert main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]
    tok = tokenizers.Tokenizer.from_file("tok/tokenizer.json")
    assert [row["text"] for row in rows] == [tok.decode(tok.encode(t).ids) for t in texts[:2]]


def test_issue14_keep_field_missing_from_field_flags_is_a_usage_error(toks, tmp_path, capsys):
    src = _jsonl(tmp_path / "c.jsonl", _texts(5))
    argv = [src, "-o", tmp_path / "ds", "--tokenizer", toks["hf"], "--field", "tokens:int32[]"]
    assert _pack(*argv, "--keep-field", "url") == 2
    assert "--keep-field url" in capsys.readouterr().err
    assert not (tmp_path / "ds").exists()
    assert _pack(*argv, "--field", "url:str", "--keep-field", "url") == 0
    ds = roxxel.open_dataset(tmp_path / "ds")
    assert ds[3]["url"] == "https://x/3"


def test_issue14_eos_id_alone_ends_each_text_with_it(toks, tmp_path):
    texts = _texts(6)
    src, out = _jsonl(tmp_path / "c.jsonl", texts), tmp_path / "ds"
    assert _pack(src, "-o", out, "--tokenizer", toks["hf"], "--eos-id", 7) == 0
    tok = tokenizers.Tokenizer.from_file(str(toks["hf"]))
    ds = roxxel.open_dataset(out)
    for i, text in enumerate(texts):
        assert ds[i]["tokens"].tolist() == [*tok.encode(text, add_special_tokens=False).ids, 7]
    assert ds.metadata["tokenizer"]["eos_id"] == 7


def test_issue14_pack_from_python_equals_the_command(toks, tmp_path):
    """`roxxel.pack` is the command from Python: same records, same manifest."""
    src = _jsonl(tmp_path / "c.jsonl", _texts(30))
    assert _pack(src, "-o", tmp_path / "cli", "--tokenizer", toks["hf"], "--append-eos") == 0
    roxxel.pack(
        [src],
        tmp_path / "py",
        tokenizer=toks["hf"],
        append_eos=True,
        keep_field="url",
        shard_bytes="1K",
        workers=2,
    )
    cli, py = roxxel.open_dataset(tmp_path / "cli"), roxxel.open_dataset(tmp_path / "py")
    assert py.num_shards > 1 and len(py) == len(cli) == 30
    for i in range(30):
        assert py[i]["tokens"].tolist() == cli[i]["tokens"].tolist()
        assert py[i]["url"] == f"https://x/{i}"
    assert py.metadata["tokenizer"]["sha256"] == cli.metadata["tokenizer"]["sha256"]


def test_issue14_pack_from_python_raises_what_the_command_reports(toks, tmp_path):
    src = _jsonl(tmp_path / "c.jsonl", _texts(3))
    with pytest.raises(ConfigError, match="no option 'tokeniser'"):
        roxxel.pack(src, tmp_path / "a", tokeniser=toks["hf"])
    with pytest.raises(ConfigError, match="expected --tokenizer"):
        roxxel.pack(src, tmp_path / "b", append_eos=True)
    with pytest.raises(roxxel.RoxxelError, match=r"missing\.json"):
        roxxel.pack(src, tmp_path / "c", tokenizer=tmp_path / "missing.json")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": 7}\n')
    with pytest.raises(roxxel.RoxxelError, match=r"bad\.jsonl:2"):
        roxxel.pack(bad, tmp_path / "d", tokenizer=toks["hf"])
    assert not any((tmp_path / n / "manifest.json").exists() for n in "abcd")


@pytest.mark.parametrize(
    "spec, rule",
    [(s, "integer") for s in ("float16[]", "bool[]", "bfloat16[]", "float64[]")]
    + [(s, "int32[]") for s in ("int32[4]", "int32[,2]", "int32", "str", "bytes")],
)
def test_issue14_a_token_field_not_of_integer_ids_is_refused_before_packing(
    toks, tmp_path, capsys, spec, rule
):
    """Ids cast to float16 or bool were packed silently changed (2049 -> 2048, 7 -> True),
    and `tokens:int32[4]` stopped in the worker with a TypeError traceback: the token field
    is one variable-length run of integers (`int32[]`), checked before any work (a usage
    error, as other --field conflicts)."""
    src = _jsonl(tmp_path / "c.jsonl", _texts(5))
    argv = [src, "-o", tmp_path / "ds", "--tokenizer", toks["hf"], "--field", f"tokens:{spec}"]
    assert _pack(*argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"tokens:{spec}" in err and rule in err
    assert not (tmp_path / "ds").exists()


def test_issue14_field_flags_without_the_token_field_are_a_usage_error(toks, tmp_path, capsys):
    """`--field url:str --keep-field url` packed only `url`: the token ids were dropped while
    the manifest still named the tokenizer. --field gives the whole schema, so the token field
    must be among it, as every kept field must."""
    src = _jsonl(tmp_path / "c.jsonl", _texts(5))
    argv = [src, "-o", tmp_path / "ds", "--tokenizer", toks["hf"], "--field", "url:str"]
    assert _pack(*argv, "--keep-field", "url") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--field tokens:uint16[]" in err
    assert not (tmp_path / "ds").exists()


def test_issue14_a_field_flag_not_kept_is_a_usage_error(toks, tmp_path, capsys):
    """`--field url:str` without `--keep-field url` planned the pack, then stopped it in a
    worker ("field 'url' missing from the record", which has one), leaving a pack folder."""
    src = _jsonl(tmp_path / "c.jsonl", _texts(5))
    argv = [src, "-o", tmp_path / "ds", "--tokenizer", toks["hf"], "--field", "tokens:int32[]"]
    assert _pack(*argv, "--field", "url:str") == 2
    err = capsys.readouterr().err.strip()
    assert "--field url" in err and "--keep-field url" in err
    assert not (tmp_path / "ds").exists()
    schema = tmp_path / "schema.toml"
    schema.write_text('[fields]\ntokens = "int32[]"\nurl = "str"\n')
    argv = [src, "-o", tmp_path / "ds", "--tokenizer", toks["hf"], "--schema", schema]
    assert _pack(*argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(schema) in err and "--keep-field url" in err
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize(
    "fields, named",
    [
        ('url = "str"', 'tokens = "uint16[]"'),  # no token field
        ('tokens = "uint16[]"', "--keep-field url"),  # as with --field: a kept field dropped
    ],
    ids=["without-tokens", "without-a-kept-field"],
)
def test_issue14_schema_file_missing_a_field_the_flags_need_is_refused(
    toks, tmp_path, capsys, fields, named
):
    schema = tmp_path / "schema.toml"
    schema.write_text(f"[fields]\n{fields}\n")
    src = _jsonl(tmp_path / "c.jsonl", _texts(5))
    argv = [src, "-o", tmp_path / "ds", "--tokenizer", toks["hf"], "--schema", schema]
    assert _pack(*argv, "--keep-field", "url") == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert str(schema) in err and named in err
    assert not (tmp_path / "ds").exists()


def test_issue14_schema_file_token_dtype_is_the_one_recorded(toks, tmp_path, capsys):
    """The manifest said `uint16` (the default) for ids packed as the schema file's `int32`."""
    schema = tmp_path / "schema.toml"
    schema.write_text('[fields]\ntokens = "int32[]"\nurl = "str"\n')
    texts = _texts(10)
    src, out = _jsonl(tmp_path / "c.jsonl", texts), tmp_path / "ds"
    argv = [src, "-o", out, "--tokenizer", toks["hf"], "--schema", schema, "--keep-field", "url"]
    assert _pack(*argv) == 0
    ds = roxxel.open_dataset(out)
    assert ds.schema.to_json() == {"tokens": "int32[]", "url": "str"}
    assert ds[0]["tokens"].dtype == np.int32
    assert ds.metadata["tokenizer"]["dtype"] == "int32"
    capsys.readouterr()
    assert main(["info", str(out)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("tokenizer:"))
    assert "'tokens' int32" in line


def _surrogate_map(tmp_path: Path) -> str:
    """A --map that puts a lone surrogate (not valid Unicode) where a text says BAD."""
    path = tmp_path / "surrogate.py"
    path.write_text(
        'def fn(record):\n    return {**record, "text": record["text"].replace("BAD", "\\ud800")}\n'
    )
    return f"{path}:fn"


@pytest.mark.parametrize("kind", ["hf", "sp", "tiktoken"])
def test_issue14_text_with_a_lone_surrogate_names_its_record(toks, tmp_path, capsys, kind):
    """HF and SentencePiece raised a TypeError for the whole batch, tiktoken replaced the
    character with U+FFFD: each now refuses the record, naming it (--skip-bad skips it)."""
    texts = _texts(700)
    texts[600] = "a BAD b"
    src, out = _jsonl(tmp_path / "c.jsonl", texts), tmp_path / "ds"
    argv = [src, "-o", out, "--tokenizer", toks[kind], "--map", _surrogate_map(tmp_path)]
    assert _pack(*argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"{src}:601:" in err and "surrogate" in err and "'text'" in err
    assert _pack(*argv, "--skip-bad") == 0
    ds = roxxel.open_dataset(out)
    assert len(ds) == 699
    tok = load_tokenizer(str(toks[kind]))
    kept = texts[:600] + texts[601:]
    assert [ds[i]["tokens"].tolist() for i in range(len(ds))] == tok.encode_batch(kept)


def test_issue14_tiktoken_ranks_without_every_single_byte_are_refused_at_load(tmp_path, capsys):
    """Ranks lacking single bytes passed planning, then the worker panicked in tiktoken's
    Rust code ("no entry found for key") on the first text holding such a byte."""
    ranks = tmp_path / "ranks.tiktoken"
    ranks.write_text("YQ== 0\nYg== 5\n")  # b"a" and b"b" only
    with pytest.raises(ConfigError, match=r"ranks\.tiktoken.*byte-level BPE.*254 of the 256"):
        load_tokenizer(str(ranks))
    src = _jsonl(tmp_path / "c.jsonl", ["ab", "abc"])
    assert _pack(src, "-o", tmp_path / "ds", "--tokenizer", ranks, "--eos-id", 0) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(ranks) in err


def test_issue14_a_rewritten_tiktoken_ranks_file_is_read_anew(tmp_path, monkeypatch):
    """tiktoken's loader reads a ranks file through a cache in the temp folder keyed by the
    path's name: a file rewritten at the same path still encoded with its old merges (and
    every ranks file was copied there). The pack reads the file it hashed."""
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.chdir(tmp_path)
    singles = "".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256))
    merges = "".join(
        f"{base64.b64encode(m).decode()} {256 + i}\n" for i, m in enumerate([b"th", b"the"])
    )
    Path("ranks.tiktoken").write_text(singles + merges)
    src = _jsonl(tmp_path / "c.jsonl", ["the the"])
    assert _pack(src, "-o", "a", "--tokenizer", "ranks.tiktoken") == 0
    Path("ranks.tiktoken").write_text(singles)  # the merges gone: one id per byte
    assert _pack(src, "-o", "b", "--tokenizer", "ranks.tiktoken") == 0
    assert roxxel.open_dataset("a")[0]["tokens"].tolist() == [257, 32, 257]
    assert roxxel.open_dataset("b")[0]["tokens"].tolist() == list(b"the the")
    assert roxxel.open_dataset("b").metadata["tokenizer"]["vocab_size"] == 256
    assert not list((tmp_path / "tmp").rglob("*")), "nothing copied into the temp folder"


@pytest.mark.parametrize(
    ("text", "rule"),
    [
        ("YQ== 0 1\n", "line 1"),
        ("YQ== 0\n!!!! 1\n", "line 2: '!!!!' is not base64"),
        ("YQ== zero\n", "line 1: 'zero' is not a rank"),
    ],
)
def test_issue14_a_bad_tiktoken_ranks_line_is_named(tmp_path, text, rule):
    ranks = tmp_path / "ranks.tiktoken"
    ranks.write_text(text)
    with pytest.raises(ConfigError, match=rf"ranks\.tiktoken.*{rule}"):
        load_tokenizer(str(ranks))


def test_issue14_hf_text_that_spells_a_special_token_stays_text(toks, tmp_path):
    """HF turned "</s>" written inside a document into the special id, SentencePiece and
    tiktoken kept it as text; now all three do: specials come only from the flags."""
    hf = tokenizers.Tokenizer.from_file(str(toks["hf"]))
    hf.add_special_tokens(["</s>"])
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    hf.save(str(path))
    eos, endoftext = hf.token_to_id("</s>"), hf.token_to_id("<|endoftext|>")
    texts = ["the fox </s> over <|endoftext|> dog", "</s>"]
    src, out = _jsonl(tmp_path / "c.jsonl", texts), tmp_path / "ds"
    assert _pack(src, "-o", out, "--tokenizer", path, "--append-eos") == 0
    ds = roxxel.open_dataset(out)
    for i, text in enumerate(texts):
        ids = ds[i]["tokens"].tolist()
        assert ids[-1] == eos and eos not in ids[:-1] and endoftext not in ids
        pieces = [hf.id_to_token(t) for t in ids[:-1]]
        assert "".join(pieces).replace("Ġ", " ") == text
    sp = load_tokenizer(str(toks["sp"])).encode_batch(["</s>"])[0]
    assert spm.SentencePieceProcessor(model_file=str(toks["sp"])).eos_id() not in sp


@pytest.mark.parametrize(
    ("config", "flag", "token"),
    [
        ({"eos_token": "<eos>"}, "--append-eos", "<eos>"),
        ({"eos_token": {"content": "<|im_end|>"}}, "--append-eos", "<|im_end|>"),
        ({"bos_token": "<bos>"}, "--prepend-bos", "<bos>"),
    ],
)
def test_issue14_tokenizer_config_special_missing_from_the_vocabulary_is_named(
    toks, tmp_path, capsys, config, flag, token
):
    """An `eos_token` of tokenizer_config.json that the vocabulary lacks fell back to
    `<|endoftext|>` silently; now the pack stops naming the file and the token, when the
    token is used (not with --eos-id, not without the flag)."""
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(toks["hf"], folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    src = _jsonl(tmp_path / "c.jsonl", _texts(5))
    argv = [src, "-o", tmp_path / "ds", "--tokenizer", folder / "tokenizer.json"]
    assert _pack(*argv, flag) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert str(folder / "tokenizer_config.json") in err and repr(token) in err
    assert not (tmp_path / "ds").exists()
    assert _pack(*argv) == 0
    if flag == "--append-eos":
        assert _pack(*argv, "--eos-id", 0, "--overwrite") == 0


@pytest.mark.parametrize("value", ["-1", "4294967296", "9223372036854775808"])
@pytest.mark.parametrize("flag", ["--eos-id", "--bos-id"])
def test_a_special_id_out_of_range_is_a_one_line_usage_error(toks, tmp_path, capsys, flag, value):
    """`--eos-id -1` exited 1, as for bad input, while other flag errors exit 2; an id past
    uint32 (the widest token dtype picked) stopped at the first record, or in a traceback
    past int64. The command line is wrong (docs/cli.md): one line naming flag and value."""
    src = _jsonl(tmp_path / "c.jsonl", _texts(3))
    assert _pack(src, "-o", tmp_path / "ds", "--tokenizer", toks["hf"], f"{flag}={value}") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{flag} {value}" in err
    assert not (tmp_path / "ds").exists()


def test_bos_id_starts_each_tiktoken_text_with_it(toks, tmp_path):
    """A tiktoken ranks file has no special tokens: `--prepend-bos` was impossible without a
    `--bos-id N`, the mirror of `--eos-id N` (it implies --prepend-bos)."""
    texts = _texts(20)
    src, out = _jsonl(tmp_path / "c.jsonl", texts), tmp_path / "ds"
    assert _pack(src, "-o", out, "--tokenizer", toks["tiktoken"], "--bos-id", 0) == 0
    enc = _tiktoken_encoding(toks["tiktoken"])
    ds = roxxel.open_dataset(out)
    assert [ds[i]["tokens"].tolist() for i in range(len(texts))] == [
        [0, *enc.encode(t)] for t in texts
    ]
    assert (ds.metadata["tokenizer"]["bos_id"], ds.metadata["tokenizer"]["eos_id"]) == (0, None)


def test_bos_id_from_python_starts_each_hf_text_with_it(toks, tmp_path):
    texts = _texts(20)
    src, out = _jsonl(tmp_path / "c.jsonl", texts), tmp_path / "ds"
    roxxel.pack(src, out, tokenizer=toks["hf"], bos_id=7, append_eos=True)
    tok = tokenizers.Tokenizer.from_file(str(toks["hf"]))
    eos = tok.token_to_id("<|endoftext|>")
    ds = roxxel.open_dataset(out)
    for i, text in enumerate(texts):
        assert ds[i]["tokens"].tolist() == [7, *tok.encode(text, add_special_tokens=False).ids, eos]
    assert (ds.metadata["tokenizer"]["bos_id"], ds.metadata["tokenizer"]["eos_id"]) == (7, eos)


def test_prepend_bos_without_a_bos_token_asks_for_bos_id(toks, tmp_path, capsys):
    src = _jsonl(tmp_path / "c.jsonl", _texts(3))
    assert _pack(src, "-o", tmp_path / "ds", "--tokenizer", toks["tiktoken"], "--prepend-bos") == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--bos-id N" in err and str(toks["tiktoken"]) in err


@pytest.mark.parametrize(
    ("key", "flag", "id_flag"),
    [("eos_token", "--append-eos", "--eos-id"), ("bos_token", "--prepend-bos", "--bos-id")],
)
def test_a_null_special_token_in_tokenizer_config_means_none(
    toks, tmp_path, capsys, key, flag, id_flag
):
    """`"eos_token": null` in tokenizer_config.json fell back to guessing `</s>` from the
    vocabulary: null says the tokenizer names none, so the flag asking for it stops the pack
    naming the file and the flag that gives the id."""
    hf = tokenizers.Tokenizer.from_file(str(toks["hf"]))
    hf.add_special_tokens(["<s>", "</s>"])  # what a guess would find
    folder = tmp_path / "tok"
    folder.mkdir()
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({key: None}))
    src = _jsonl(tmp_path / "c.jsonl", _texts(5))
    argv = [src, "-o", tmp_path / "ds", "--tokenizer", folder / "tokenizer.json"]
    assert _pack(*argv, flag) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert str(folder / "tokenizer_config.json") in err and f"{key} is null" in err
    assert f"{id_flag} N" in err
    assert not (tmp_path / "ds").exists()
    assert _pack(*argv, flag, id_flag, 3) == 0
    tokens = roxxel.open_dataset(tmp_path / "ds")[0]["tokens"].tolist()
    assert (tokens[-1] if flag == "--append-eos" else tokens[0]) == 3


@pytest.mark.parametrize("flag", ["--eos-id", "--bos-id"])
def test_a_special_id_past_the_vocabulary_is_kept_with_a_note(toks, tmp_path, capsys, flag):
    """`--eos-id 70000` with a vocabulary of 500 switched the tokens to uint32 silently. An id
    past the tokenizer's vocabulary is legitimate (a model's padded vocabulary; a tiktoken
    ranks file's EOS, which the file lacks): kept, with one note line (none with -q)."""
    texts = _texts(4)
    src, out = _jsonl(tmp_path / "c.jsonl", texts), tmp_path / "ds"
    argv = ["pack", str(src), "-o", str(out), "--tokenizer", str(toks["hf"]), flag, "70000"]
    assert main(argv) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "note" in line]
    vocab = tokenizers.Tokenizer.from_file(str(toks["hf"])).get_vocab_size()
    assert len(notes) == 1 and f"{flag} 70000" in notes[0]
    assert f"vocabulary of {vocab}" in notes[0] and "uint32" in notes[0]
    ds = roxxel.open_dataset(out)
    assert ds.schema.to_json() == {"tokens": "uint32[]"}
    assert 70000 in (ds[0]["tokens"][-1], ds[0]["tokens"][0])
    assert main([*argv, "--overwrite", "-q"]) == 0
    assert capsys.readouterr().err == ""


def test_issue14_a_parquet_without_the_text_column_is_one_line_naming_file_and_row(
    toks, tmp_path, capsys
):
    """`--text-field nope` on a Parquet file with no such column was a StopIteration
    traceback (only the text column is read, so its blocks had no columns at all); from
    Python a bare RuntimeError, not a RoxxelError."""
    src = tmp_path / "c.parquet"
    pq.write_table(pa.table({"body": ["a b", "c"]}), src)
    argv = [src, "-o", tmp_path / "ds", "--tokenizer", toks["hf"], "--text-field", "nope"]
    assert _pack(*argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert str(src) in err and "row 0" in err and "'nope'" in err
    with pytest.raises(roxxel.RoxxelError, match=r"c\.parquet.*row 0.*'nope'"):
        roxxel.pack(src, tmp_path / "py", tokenizer=toks["hf"], text_field="nope")


def _ranks_with(tmp_path: Path, last: str) -> Path:
    """A ranks file: the 256 single bytes (lines 1-256), b"th" (line 257), then ``last``."""
    singles = "".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256))
    ranks = tmp_path / "r.tiktoken"
    ranks.write_text(f"{singles}{base64.b64encode(b'th').decode()} 256\n{last}\n")
    return ranks


@pytest.mark.parametrize(
    ("last", "rule"),
    [
        ("dGhl 5", r"line 258: rank 5 given twice \(first on line 6; expected each rank once\)"),
        ("dGhl 5000000000", r"line 258: rank 5000000000 \(expected 0 <= rank < 2\*\*32\)"),
        ("dGhl -1", r"line 258: rank -1 \(expected 0 <= rank < 2\*\*32\)"),
        ("dGg= 257", r"line 258: token b'th' given twice \(first on line 257; expected each"),
    ],
    ids=["duplicate-rank", "rank-past-uint32", "negative-rank", "duplicate-token"],
)
def test_issue14_a_malformed_tiktoken_rank_is_one_line_naming_file_line_and_rule(
    tmp_path, capsys, last, rule
):
    """A rank given twice made tiktoken panic in Rust (a backtrace, then a PanicException: a
    BaseException, past `except Exception` around `roxxel.pack`); a rank past uint32 or below
    0 was an OverflowError traceback; a token given twice silently lost its first rank."""
    ranks = _ranks_with(tmp_path, last)
    src = _jsonl(tmp_path / "c.jsonl", ["the fox"])
    assert _pack(src, "-o", tmp_path / "ds", "--tokenizer", ranks, "--eos-id", 0) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("roxxel pack: error: ")
    assert re.search(rf"--tokenizer {re.escape(str(ranks))}: {rule}", err), err
    with pytest.raises(roxxel.RoxxelError, match=rf"r\.tiktoken: {rule}"):
        roxxel.pack(src, tmp_path / "py", tokenizer=ranks, eos_id=0)
    assert not (tmp_path / "ds").exists() and not (tmp_path / "py").exists()


def _hf_with_eos_tokens(toks: dict[str, Path], tmp_path: Path) -> tuple[Path, dict[str, int]]:
    """tok/tokenizer.json with both "</s>" and "<|endoftext|>", and the id of each."""
    hf = tokenizers.Tokenizer.from_file(str(toks["hf"]))
    hf.add_special_tokens(["</s>"])
    folder = tmp_path / "tok"
    folder.mkdir()
    hf.save(str(folder / "tokenizer.json"))
    ids = {t: hf.token_to_id(t) for t in ("</s>", "<|endoftext|>")}
    assert len(set(ids.values())) == 2
    return folder / "tokenizer.json", ids


def test_issue14_a_changed_tokenizer_config_is_seen_by_the_next_pack_in_the_process(toks, tmp_path):
    """Two `roxxel.pack(..., append_eos=True)` in one process, tokenizer_config.json's
    eos_token changed in between: the second pack ended each text with the first EOS and its
    manifest said so (the loaded tokenizer was cached by tokenizer.json's hash alone)."""
    path, ids = _hf_with_eos_tokens(toks, tmp_path)
    src = _jsonl(tmp_path / "c.jsonl", _texts(10))
    for token, eos in ids.items():
        (path.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": token}))
        out = tmp_path / f"ds-{eos}"
        roxxel.pack(src, out, tokenizer=path, append_eos=True)
        ds = roxxel.open_dataset(out)
        assert ds.metadata["tokenizer"]["eos_id"] == eos
        assert [int(ds[i]["tokens"][-1]) for i in range(len(ds))] == [eos] * len(ds)


def test_issue14_a_rerun_with_a_changed_tokenizer_config_is_another_pack(toks, tmp_path, capsys):
    """A rerun into the same output after tokenizer_config.json named another EOS was taken
    for the same pack and kept the units made with the old EOS: now it is a pack with other
    arguments (refused without --overwrite), and the fingerprint holds the EOS id."""
    path, ids = _hf_with_eos_tokens(toks, tmp_path)
    config = path.parent / "tokenizer_config.json"
    src, out = _jsonl(tmp_path / "c.jsonl", _texts(10)), tmp_path / "ds"
    argv = [src, "-o", out, "--tokenizer", path, "--append-eos"]
    config.write_text(json.dumps({"eos_token": "</s>"}))
    assert _pack(*argv) == 0
    first = roxxel.open_dataset(out).metadata["roxxel_pack"]
    config.write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    capsys.readouterr()
    assert _pack(*argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "other arguments" in err
    assert _pack(*argv, "--overwrite") == 0
    ds = roxxel.open_dataset(out)
    assert ds.metadata["roxxel_pack"] != first
    assert ds.metadata["tokenizer"]["eos_id"] == ids["<|endoftext|>"]
    assert int(ds[0]["tokens"][-1]) == ids["<|endoftext|>"]


@pytest.mark.parametrize("text", ["[1, 2]", '"</s>"', "null"])
def test_issue14_a_tokenizer_config_not_an_object_is_named(toks, tmp_path, capsys, text):
    """A tokenizer_config.json holding valid JSON but not an object (`[1, 2]`) was ignored
    silently: its eos_token / bos_token were never read and the EOS guessed."""
    path, _ = _hf_with_eos_tokens(toks, tmp_path)
    config = path.parent / "tokenizer_config.json"
    config.write_text(text)
    src = _jsonl(tmp_path / "c.jsonl", _texts(3))
    assert _pack(src, "-o", tmp_path / "ds", "--tokenizer", path, "--append-eos") == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"{config}: not a JSON object" in err and "eos_token" in err
    assert not (tmp_path / "ds").exists()


def _tiktoken_with_gap(toks: dict[str, Path], tmp_path: Path, token: bytes, rank: int) -> Path:
    lines = toks["tiktoken"].read_text().splitlines()
    coded = base64.b64encode(token).decode()
    moved = [f"{coded} {rank}" if line.split()[0] == coded else line for line in lines]
    assert moved != lines
    path = tmp_path / "gap.tiktoken"
    path.write_text("\n".join(moved) + "\n")
    return path


def _hf_with_gap(toks: dict[str, Path], tmp_path: Path, token: bytes, rank: int) -> Path:
    doc = json.loads(toks["hf"].read_text())
    name = token.decode().replace(" ", "Ġ")
    assert name in doc["model"]["vocab"]
    doc["model"]["vocab"][name] = rank
    path = tmp_path / "gap" / "tokenizer.json"
    path.parent.mkdir()
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("kind", ["hf", "tiktoken"])
def test_issue14_the_token_dtype_holds_the_highest_id_not_the_count(toks, tmp_path, kind):
    """The dtype came from the number of vocabulary entries: an HF tokenizer.json whose
    vocabulary has a gap (one token moved to id 70000, 500 entries) got uint16, and the pack
    then stopped at the first record holding that token ("token id 70000 (expected <=
    65535"). It comes from the highest id, as for a tiktoken ranks file."""
    make = _hf_with_gap if kind == "hf" else _tiktoken_with_gap
    path = make(toks, tmp_path, b" fox", 70_000)
    texts = _texts(20)
    src, out = _jsonl(tmp_path / "c.jsonl", texts), tmp_path / "ds"
    assert _pack(src, "-o", out, "--tokenizer", path) == 0
    ds = roxxel.open_dataset(out)
    assert ds.schema.to_json() == {"tokens": "uint32[]"}
    assert ds.metadata["tokenizer"]["vocab_size"] == 70_001
    tok = load_tokenizer(str(path))
    assert [ds[i]["tokens"].tolist() for i in range(len(ds))] == tok.encode_batch(texts)
    assert any(70_000 in ds[i]["tokens"] for i in range(len(ds)))


def test_issue14_a_token_field_flag_not_of_integer_ids_is_a_usage_error(toks, tmp_path, capsys):
    """`--field tokens:float32[]` exited 1 while every other --field conflict (a field not
    kept, no token field) is a usage error, exit 2; a --schema file's stays exit 1, naming
    the file, as for its other conflicts."""
    src = _jsonl(tmp_path / "c.jsonl", _texts(3))
    argv = [src, "-o", tmp_path / "ds", "--tokenizer", toks["hf"]]
    assert _pack(*argv, "--field", "tokens:float32[]") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--field tokens:float32[]" in err and "integer" in err
    schema = tmp_path / "schema.toml"
    schema.write_text('[fields]\ntokens = "float32[]"\n')
    assert _pack(*argv, "--schema", schema) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f'{schema}: tokens = "float32[]"' in err
    assert not (tmp_path / "ds").exists()


# ---- user sweep: special ids against the token dtype, empty ranks, kept-field inference ----


@pytest.mark.parametrize("flag", ["--eos-id", "--bos-id"])
def test_a_special_id_the_token_field_cannot_hold_is_refused_before_packing(
    toks, tmp_path, capsys, flag
):
    """`--field tokens:int16[] --eos-id 40000` printed a note (kept, tokens stored as int16),
    then stopped at record 1 (`token id 40000 (expected <= 32767 ...)`), leaving a
    `.roxxel-pack` folder. The special ids are known at planning: refused there, as the
    other --field conflicts (a usage error, exit 2), nothing written."""
    src, out = _jsonl(tmp_path / "c.jsonl", _texts(3)), tmp_path / "ds"
    argv = ["pack", str(src), "-o", str(out), "--tokenizer", str(toks["hf"])]
    assert main([*argv, "--field", "tokens:int16[]", flag, "40000"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "note" not in err, err
    assert f"{flag} 40000" in err and "tokens:int16[]" in err and "32767" in err
    assert not out.exists()
    schema = tmp_path / "s.toml"
    schema.write_text('[fields]\ntokens = "int16[]"\n')
    assert main([*argv, "--schema", str(schema), flag, "40000", "-q"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(schema) in err and f"{flag} 40000" in err
    assert not out.exists()


def test_the_tokenizers_own_eos_the_token_field_cannot_hold_is_refused(toks, tmp_path, capsys):
    """The same for the EOS a tokenizer_config.json names (id 500 here) and `uint8[]`."""
    path, ids = _hf_with_eos_tokens(toks, tmp_path)
    (path.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    src, out = _jsonl(tmp_path / "c.jsonl", _texts(3)), tmp_path / "ds"
    argv = [src, "-o", out, "--tokenizer", path, "--append-eos", "--field", "tokens:uint8[]"]
    assert _pack(*argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"EOS id {ids['</s>']}" in err and "255" in err, err
    assert not out.exists()


@pytest.mark.parametrize("text", ["", "\n\n"])
def test_an_empty_tiktoken_ranks_file_says_it_holds_no_ranks(tmp_path, capsys, text):
    """An empty ranks file said `not a tiktoken ranks file (max() arg is an empty
    sequence)`: tiktoken's own words for a dict with no entry."""
    ranks = tmp_path / "empty.tiktoken"
    ranks.write_text(text)
    src = _jsonl(tmp_path / "c.jsonl", ["the fox"])
    assert _pack(src, "-o", tmp_path / "ds", "--tokenizer", ranks) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "max()" not in err, err
    assert f"--tokenizer {ranks}: holds no ranks" in err
    with pytest.raises(ConfigError, match=r"empty\.tiktoken: holds no ranks"):
        load_tokenizer(str(ranks))


@pytest.mark.parametrize("text", ["\n\n  \n", " ", "\t\r\n\x0c\n"])
def test_issue14_a_tiktoken_ranks_file_of_blank_lines_says_it_holds_no_ranks(
    tmp_path, capsys, text
):
    """A ranks file of whitespace-only lines said `line 3: 0 words`, where an empty one
    says it holds no ranks: a blank line is skipped whatever its spaces."""
    ranks = tmp_path / "blank.tiktoken"
    ranks.write_bytes(text.encode())
    src = _jsonl(tmp_path / "c.jsonl", ["the fox"])
    assert _pack(src, "-o", tmp_path / "ds", "--tokenizer", ranks) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "words" not in err, err
    assert f"--tokenizer {ranks}: holds no ranks" in err, err


def test_issue14_a_bad_tiktoken_line_after_blank_ones_names_its_own_line(tmp_path):
    """Lines are counted in the file, blank ones too (an editor's line numbers)."""
    ranks = tmp_path / "ranks.tiktoken"
    ranks.write_bytes(b"YQ== 0\n  \n\r\nYg== 1\r\n\t\nYw== 1\n")
    with pytest.raises(
        ConfigError, match=r"ranks\.tiktoken: line 6: rank 1 given twice \(first on line 4;"
    ):
        load_tokenizer(str(ranks))


def test_a_null_kept_field_names_its_line_and_asks_to_drop_or_fill_it(toks, tmp_path, capsys):
    """`--keep-field url` over `{"text": "a", "url": null}` said `schema inference: field
    'url' is ambiguous (null values, ... e.g. --field url:int32[])`: no file, no line, and a
    hint that fails twice (--field then lacks tokens; no field type holds a null)."""
    src = tmp_path / "c.jsonl"
    src.write_text('{"text": "a", "url": "x"}\n{"text": "b", "url": null}\n')
    argv = [src, "-o", tmp_path / "ds", "--tokenizer", toks["hf"], "--keep-field", "url"]
    assert _pack(*argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "int32[]" not in err, err
    assert f"{src}:2: --keep-field url: null" in err and "--map" in err
    assert not (tmp_path / "ds").exists()


def test_an_ambiguous_kept_field_hint_lists_the_token_field_too(toks, tmp_path, capsys):
    """In a --tokenizer pack the hint `--field ids:SPEC` then failed: --field gives the whole
    schema, so it needs `tokens` (and every kept field) too. The hint lists them all, and
    following it packs."""
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": t, "ids": [], "n": 3}) + "\n" for t in "abc"))
    argv = [src, "-o", tmp_path / "ds", "--tokenizer", toks["hf"]]
    assert _pack(*argv, "--keep-field", "n", "--keep-field", "ids") == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"{src}:1: schema inference: field 'ids' is ambiguous" in err
    hint = "e.g. --field tokens:uint16[] --field n:int64 --field ids:int64[])"
    assert err.endswith(hint), err
    given = hint.removeprefix("e.g. ").removesuffix(")").split()
    assert _pack(*argv, *given, "--keep-field", "n", "--keep-field", "ids") == 0
    assert roxxel.open_dataset(tmp_path / "ds")[0]["n"] == 3


@pytest.mark.parametrize(
    ("content", "want"),
    [
        ('{"x": 1}', 'valid JSON, but no "model" entry'),
        ("[1, 2]", "valid JSON, but a list"),
        ('{"model": {}}', "valid JSON, but the tokenizers library cannot load it (data did not"),
        ('{"x":', "invalid JSON at line 1 column 6"),
        ('{\n  "model": {,\n}', "invalid JSON at line 2 column 13"),
    ],
)
def test_issue14_a_json_file_that_is_no_tokenizer_says_what_is_wrong(
    tmp_path, content, want, capsys
):
    """`{"x":1}` as --tokenizer said "not an HF tokenizer.json (expected `,` or `}` at line 1
    column 5)": a syntax error the file does not have. Valid JSON says what it lacks; a
    syntax error still names its line and column."""
    tok = tmp_path / "tok.json"
    tok.write_text(content)
    src = _jsonl(tmp_path / "c.jsonl", _texts(3))
    assert _pack(src, "-o", tmp_path / "ds", "--tokenizer", tok) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"--tokenizer {tok}: not an HF tokenizer.json (" in err and want in err, err
    if content.startswith(('{"x": 1}', "[")):
        assert "line 1 column" not in err


def test_issue14_a_null_text_in_parquet_names_the_row_before_the_field(toks, tmp_path, capsys):
    """A null said `null.parquet: field 'text': row 1: null ...`, where every other row error
    says `int.parquet: row 0: field 'text': ...`: now `file: row N: field 'text': ...`."""
    nulls, ints = tmp_path / "null.parquet", tmp_path / "int.parquet"
    pq.write_table(pa.table({"text": pa.array(["a", None], pa.string())}), nulls)
    pq.write_table(pa.table({"text": pa.array([1, 2], pa.int64())}), ints)
    assert _pack(nulls, "-o", tmp_path / "ds", "--tokenizer", toks["hf"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"{nulls}: row 1: field 'text': null (expected a value in every row)" in err, err
    assert _pack(ints, "-o", tmp_path / "ds", "--tokenizer", toks["hf"]) == 1
    assert f"{ints}: row 0: field 'text': " in capsys.readouterr().err


@pytest.mark.skipif(sys.platform == "win32", reason="needs FIFOs")
@pytest.mark.parametrize("name", ["fifo.json", "fifo.model", "fifo.tiktoken", "link.json"])
def test_issue14_a_tokenizer_that_is_no_regular_file_is_refused_not_waited_on(tmp_path, name):
    """`--tokenizer tok/fifo.json` (a FIFO, or a link to one) hung forever in `open()` while
    hashing the file: it is refused, one line naming it and what it is."""
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    fifo = tok_dir / "fifo"
    os.mkfifo(fifo)
    tok = tok_dir / name
    if name.startswith("link"):
        tok.symlink_to(fifo)
    else:
        fifo.rename(tok)
    src = _jsonl(tmp_path / "c.jsonl", _texts(3))
    done = pack_in_subprocess(src, "-o", tmp_path / "ds", "--tokenizer", tok)
    err = done.stderr.strip()
    assert done.returncode == 1, err
    assert len(err.splitlines()) == 1, err
    assert f"--tokenizer {tok}: not a regular file (a FIFO, expected a tokenizer file)" in err
    assert not (tmp_path / "ds").exists()


def test_issue14_a_tokenizer_that_is_a_directory_says_so(tmp_path, capsys):
    tok = tmp_path / "tok.json"
    tok.mkdir()
    src = _jsonl(tmp_path / "c.jsonl", _texts(3))
    assert _pack(src, "-o", tmp_path / "ds", "--tokenizer", tok) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"--tokenizer {tok}: not a regular file (a directory, expected a tokenizer file)" in err


@pytest.mark.skipif(sys.platform == "win32", reason="needs FIFOs")
def test_issue14_a_tokenizer_config_that_is_no_regular_file_is_refused(toks, tmp_path):
    """A FIFO named tokenizer_config.json beside the tokenizer.json was passed over without
    a word (its EOS / BOS silently not read): it is refused, naming it."""
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    tok = tok_dir / "tokenizer.json"
    shutil.copy(toks["hf"], tok)
    os.mkfifo(tok_dir / "tokenizer_config.json")
    src = _jsonl(tmp_path / "c.jsonl", _texts(3))
    done = pack_in_subprocess(src, "-o", tmp_path / "ds", "--tokenizer", tok)
    err = done.stderr.strip()
    assert done.returncode == 1 and len(err.splitlines()) == 1, err
    assert f"{tok_dir / 'tokenizer_config.json'}: not a regular file (a FIFO, " in err, err
