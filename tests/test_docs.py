"""Docs that run: every fenced code block of README.md and docs/*.md, in a temp folder.

Each page runs in its own folder, its blocks in order: ``python`` blocks share one namespace
(like a doctest session), ``sh`` blocks run with bash with the venv's ``roxxel`` on PATH,
``json`` and ``toml`` blocks must parse (a ``toml NAME`` block is also saved as NAME for the
blocks after it), ``text`` blocks are output samples and skipped. A block tagged
``python no-run`` or ``sh no-run`` must say why on its first line (``# not run ...``); a
block without a language is an error. Fixtures create the small inputs each page assumes
(`INPUTS`), and `GIVEN` supplies the names a page says are the reader's own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import roxxel
from tests.test_ingest import _hf_dir, write_megatron

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(.*)$")
RUN = ("python", "sh")
SKIP = ("text",)
PARSE = ("json", "toml")


@dataclasses.dataclass(frozen=True)
class Block:
    language: str
    options: tuple[str, ...]
    code: str
    line: int  # of the opening fence, 1-based


def blocks(text: str) -> list[Block]:
    """The fenced code blocks of a markdown text (fences at the start of a line)."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        words = match.group(1).split()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
        code = "\n".join(lines[i + 1 : end]) + "\n"
        out.append(Block(words[0] if words else "", tuple(words[1:]), code, i + 1))
        i = end + 1
    return out


def run_page(text: str, name: str, cwd: Path, given: dict[str, Any]) -> list[str]:
    """Run every block of a page in `cwd`; a line per failing block."""
    namespace: dict[str, Any] = {"__name__": "__doc__", **given}
    failures = []
    for block in blocks(text):
        where = f"{name}:{block.line} ({block.language or 'untagged'})"
        problem = _run_block(block, cwd, namespace)
        if problem:
            failures.append(f"{where}: {problem}")
    return failures


def _run_block(block: Block, cwd: Path, namespace: dict[str, Any]) -> str | None:
    if block.language not in (*RUN, *SKIP, *PARSE):
        return "a block needs a language: python, sh, text, toml or json"
    if "no-run" in block.options:
        reason = block.code.lstrip().startswith("# not run")
        return None if reason else "a no-run block says why on its first line (# not run ...)"
    try:
        if block.language == "python":
            _run_python(block, cwd, namespace)
        elif block.language == "sh":
            return _run_sh(block.code, cwd)
        elif block.language == "json":
            json.loads(block.code)
        elif block.language == "toml":
            tomllib.loads(block.code)
            for file_name in block.options:
                (cwd / file_name).write_text(block.code)
    except Exception:  # any failure of a block is reported, with its traceback
        return traceback.format_exc(limit=-3)
    return None


def _run_python(block: Block, cwd: Path, namespace: dict[str, Any]) -> None:
    old = Path.cwd()
    os.chdir(cwd)
    try:
        exec(compile(block.code, f"<doc block at line {block.line}>", "exec"), namespace)
    finally:
        os.chdir(old)


def _run_sh(code: str, cwd: Path) -> str | None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode:
        return f"exit {done.returncode}: {done.stderr[-2000:]}"
    return None


# ---------------------------------------------------------------- inputs the pages assume


def _tokens_dataset(path: Path, num_docs: int, doc_len: int = 97) -> None:
    with roxxel.DatasetWriter(path, {"tokens": "int32[]"}) as w:
        for i in range(num_docs):
            w.write({"tokens": (np.arange(doc_len + i % 50) + i).astype(np.int32)})


def _corpus(cwd: Path) -> None:
    (cwd / "corpus").mkdir()
    for part in range(2):
        lines = [
            json.dumps({"id": i, "text": f"doc {i}", "tokens": list(range(i % 7, 60 + i))})
            for i in range(part * 40, part * 40 + 40)
        ]
        (cwd / "corpus" / f"part-{part}.jsonl").write_text("\n".join(lines) + "\n")


def _images(cwd: Path) -> None:
    with roxxel.DatasetWriter(
        cwd / "data" / "images", {"image": "uint8[3,32,32]", "label": "int64"}
    ) as w:
        for i in range(64):
            w.write({"image": np.full((3, 32, 32), i, np.uint8), "label": i % 10})


def _pack_inputs(cwd: Path) -> None:
    np.save(cwd / "images.npy", np.arange(8 * 3 * 4 * 4, dtype=np.uint8).reshape(8, 3, 4, 4))
    docs = [json.dumps({"text": f"document number {i}"}) for i in range(20)]
    (cwd / "docs.jsonl").write_text("\n".join(docs) + "\n")
    (cwd / "mytok.py").write_text(
        "import numpy as np\n\n\ndef encode(record):\n"
        '    codes = np.frombuffer(record["text"].encode(), np.uint8).astype(np.int32)\n'
        '    return {"tokens": codes, "text": record["text"]}\n'
    )
    shutil.move(_hf_dir(cwd), cwd / "hf_saved_dataset")
    (cwd / "megatron").mkdir()
    write_megatron(cwd / "megatron" / "web_text_document", [np.arange(500) + i for i in range(12)])
    _tokens_dataset(cwd / "data" / "code", 80)
    sampling = (ROOT / "docs" / "sampling.md").read_text()
    (toml,) = [b for b in blocks(sampling) if b.language == "toml"]
    (cwd / "mixture.toml").write_text(toml.code)


def _tokenizer_and_photos(cwd: Path) -> None:
    """tok/tokenizer.json (a BPE trained here) and photos/<class>/*.png for cli.md."""
    tokenizers = pytest.importorskip("tokenizers")
    image = pytest.importorskip("PIL.Image")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    bpe.train_from_iterator([f"doc {i}" for i in range(100)], trainer)
    (cwd / "tok").mkdir()
    bpe.save(str(cwd / "tok" / "tokenizer.json"))
    for i, name in enumerate(["cat", "cat", "dog", "dog"]):
        (cwd / "photos" / name).mkdir(parents=True, exist_ok=True)
        image.new("RGB", (40 + i, 30), (i * 60, 0, 0)).save(cwd / "photos" / name / f"{i}.png")


def _points(cwd: Path) -> None:
    with roxxel.DatasetWriter(cwd / "data" / "points", {"x": "float32[2]", "y": "float32"}) as w:
        for i in range(3200):
            x = np.array([i % 7, i % 3], np.float32) / 7
            w.write({"x": x, "y": float(2 * x[0] - x[1] + 0.5)})


INPUTS: dict[str, list[Callable[[Path], None]]] = {
    "README.md": [_corpus, lambda cwd: _tokens_dataset(cwd / "data" / "code", 80)],
    "cli.md": [_corpus, _pack_inputs, _tokenizer_and_photos],
    "format.md": [],
    # enough tokens for one batch of 256 windows of 2048 (the recipes read one epoch)
    "loading.md": [lambda cwd: _tokens_dataset(cwd / "data" / "web", 256, 2100), _images],
    "sampling.md": [
        lambda cwd: _tokens_dataset(cwd / "data" / "web", 120),
        lambda cwd: _tokens_dataset(cwd / "data" / "code", 80),
    ],
    "training.md": [_points],
}


def _given_loading(cwd: Path) -> dict[str, Any]:
    return {
        "train_step": lambda state, inputs, targets: state,
        "state": None,
        "should_save": lambda: False,
        "save": lambda state, loader_state: None,
        "num_steps": 3,
    }


def _given_training(cwd: Path) -> dict[str, Any]:
    def loss_fn(params, batch):
        guess = batch["x"] @ params["w"] + params["b"]
        return jnp.mean((guess - batch["y"]) ** 2)

    def update(state, grads):
        params = jax.tree.map(lambda p, g: p - 0.1 * g, state["params"], grads)
        return {"params": params}

    def global_norm(tree):
        return jnp.sqrt(sum(jnp.sum(x**2) for x in jax.tree.leaves(tree)))

    return {
        "source": roxxel.open_dataset(cwd / "data" / "points"),
        "init_state": {"params": {"w": jnp.zeros(2), "b": jnp.zeros(())}},
        "loss_fn": loss_fn,
        "update": update,
        "global_norm": global_norm,
    }


GIVEN: dict[str, Callable[[Path], dict[str, Any]]] = {
    "loading.md": _given_loading,
    "training.md": _given_training,
}


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_block_of_the_page_runs(page: Path, tmp_path: Path) -> None:
    for make in INPUTS.get(page.name, []):
        make(tmp_path)
    given = GIVEN.get(page.name, lambda cwd: {})(tmp_path)
    failures = run_page(page.read_text(), page.name, tmp_path, given)
    assert not failures, "\n".join(failures)


def test_a_failing_block_is_reported(tmp_path: Path) -> None:
    fake = "\n".join(
        [
            "# A page",
            "```python",
            "x = 1",
            "```",
            "```python",
            "assert x == 2, 'planted'",
            "```",
            "```sh",
            "roxxel info no/such/dataset",
            "```",
            "```",
            "untagged",
            "```",
            "```sh no-run",
            "make everything",
            "```",
            "```toml",
            "a = [",
            "```",
            "```json",
            '{"a": 1}',
            "```",
            "```text",
            "not run",
            "```",
        ]
    )
    failures = run_page(fake, "fake.md", tmp_path, {})
    assert [f.split(":")[1].split()[0] for f in failures] == ["5", "8", "11", "14", "17"]
    assert "planted" in failures[0] and "exit 1" in failures[1]
    assert "needs a language" in failures[2] and "says why" in failures[3]


def test_issue13_item5_the_fit_block_run_again_says_the_run_is_complete(tmp_path, capsys) -> None:
    """training.md: "Run it again with the same out_dir and it continues"; a finished run
    run again trains nothing and still reports its status, step and loss."""
    _points(tmp_path)
    (fit_block, *_) = blocks((ROOT / "docs" / "training.md").read_text())
    for _ in range(2):
        namespace = {"__name__": "__doc__", **_given_training(tmp_path)}
        _run_python(fit_block, tmp_path, namespace)
        result = namespace["result"]
        assert (result.status, result.step) == ("completed", 100)
        assert np.isfinite(result.metrics["loss"])
    assert "complete" in capsys.readouterr().out
