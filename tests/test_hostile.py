"""Hostile inputs through the API and the CLI (issue 12, "Done when").

Generated manifests, schemas and shard bytes go through ``open_dataset``, reads, ``verify``
and through ``roxxel info``/``verify``/``cat`` in-process. Each must end in a `RoxxelError`
(for the CLI: exit 1 with one line on stderr, or ``verify``'s report of corrupt records),
never another exception, a hang (an alarm turns one into a failure) or an allocation above
`ALLOC_BOUND` (tracemalloc's peak over the API's reads, numpy buffers included; the CLI runs
the same reads under the same cap, given through ``$ROXXEL_MAX_DECODED_BYTES``, untraced to
keep the suite fast).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import shutil
import signal
import tempfile
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import roxxel
from roxxel import RoxxelError
from roxxel.cli import main

SCHEMA = {"tokens": "int32[]", "label": "int64", "text": "str", "image": "uint8[2,3]"}
ALLOC_BOUND = 64 << 20
READ_CAP = 8 << 20
SECONDS = 20
SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


class Hang(BaseException):
    """Raised by the alarm: a BaseException, so no `except OSError` or RoxxelError hides it."""


@contextlib.contextmanager
def no_hang() -> Iterator[None]:
    """Fail (not hang) when the block takes more than SECONDS."""

    def alarm(signum: int, frame: Any) -> None:
        raise Hang(f"no answer within {SECONDS} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(SECONDS)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def bounded_allocation() -> Iterator[None]:
    """Fail when the block's traced allocation peak passes ALLOC_BOUND."""
    tracemalloc.start()
    try:
        yield
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < ALLOC_BOUND, f"allocated {peak} bytes"


@pytest.fixture(scope="module", autouse=True)
def read_cap_for_the_cli() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ROXXEL_MAX_DECODED_BYTES", str(READ_CAP))
        yield


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hostile") / "ds"
    with roxxel.DatasetWriter(out, SCHEMA, shard_bytes=300, compress={"text": "zstd"}) as w:
        for i in range(12):
            w.write(
                {
                    "tokens": np.arange(i % 4, dtype=np.int32),
                    "label": i,
                    "text": "record " * i,
                    "image": np.full((2, 3), i, np.uint8),
                }
            )
    return out


@contextlib.contextmanager
def copy_of(clean: Path) -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "ds"
        shutil.copytree(clean, folder)
        yield folder


def read_everything(folder: Path) -> None:
    """Open and read as a user would; only a RoxxelError may stop it."""
    with contextlib.suppress(RoxxelError):
        ds = roxxel.open_dataset(folder, max_decoded_bytes=READ_CAP)
        repr(ds)
        count = min(len(ds), 40)
        for i in range(count):
            ds[i]
        ds[-count:]
        ds.get_batch(np.arange(count))
        ds.verify(workers=1)


def run_cli(argv: list[str]) -> None:
    """Run one command in-process: exit 0, or exit 1 with one line on stderr (or, from
    ``verify``, its report of corrupt records on stdout)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    if code == 0:
        return
    text = err.getvalue()
    if argv[0] == "verify" and not text:
        assert (
            code == 1
            and " in " in out.getvalue().splitlines()[-1]
            and "corruption" in out.getvalue().splitlines()[-1]
        )
        return
    assert code == 1 and text.count("\n") == 1 and text.startswith("roxxel "), (code, text)


def exercise(folder: Path) -> None:
    with no_hang():
        with bounded_allocation():
            read_everything(folder)
        run_cli(["info", str(folder)])
        run_cli(["verify", str(folder), "--workers", "1"])
        run_cli(["cat", str(folder), "0", "-1", "--json"])


# Manifests -------------------------------------------------------------------------------

HOSTILE_VALUES = st.one_of(
    st.sampled_from(
        [
            None,
            True,
            False,
            0,
            -1,
            1.0,
            2**62,
            2**63,
            2**64,
            10**30,
            1e308,
            "",
            "..",
            "../ds/shard-00000.rxs",
            "/etc/passwd",
            "manifest.json",
            "shard-00000.rxs",
            "xxh3:0000000000000000",
            "uint8[4294967296,4294967296]",
            [],
            {},
            {"x": "int64"},
            [1],
        ]
    ),
    st.integers(),
    st.text(max_size=12),
)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(doc, list):
        for index, value in enumerate(doc):
            yield from _paths(value, (*prefix, index))


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return doc


@st.composite
def hostile_manifests(draw: st.DrawFn, original: bytes) -> bytes:
    doc = json.loads(original)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(list(_paths(doc))))
        # a copy: sampled_from hands out the same {} or [1] each time, and a later _set
        # into it would change HOSTILE_VALUES itself (flaky data generation)
        doc = _set(doc, path, copy.deepcopy(draw(HOSTILE_VALUES)))
    shards = doc.get("shards") if isinstance(doc, dict) else None
    shards = shards if isinstance(shards, list) else []
    counts = [s.get("num_records") for s in shards if isinstance(s, dict)]
    if isinstance(doc, dict) and draw(st.booleans()) and all(type(c) is int for c in counts):
        doc["num_records"] = sum(counts)  # past M6, to reach the checks behind it
    text = json.dumps(doc).encode()
    if draw(st.booleans()):
        raw = draw(st.sampled_from([b"NaN", b"1e400", b"-0", b'"a":1,"a":2', b"\xff", b"{"]))
        at = draw(st.integers(0, len(text)))
        text = text[:at] + raw + text[at:]
    return text


@SETTINGS
@given(data=st.data())
def test_hostile_manifests_give_a_roxxel_error(clean, data) -> None:
    original = (clean / "manifest.json").read_bytes()
    with copy_of(clean) as folder:
        (folder / "manifest.json").write_bytes(data.draw(hostile_manifests(original)))
        exercise(folder)


# Schemas -------------------------------------------------------------------------------

DTYPES = ["bool", "int8", "uint8", "int32", "int64", "float16", "float64", "bfloat16"]
DIMS = st.one_of(st.integers(0, 4), st.sampled_from([2**20, 2**32, 2**32 + 1, 2**40, 2**64]))


@st.composite
def hostile_specs(draw: st.DrawFn) -> str:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.text(max_size=16))
    dtype = draw(st.sampled_from([*DTYPES, "str", "bytes", "object", "int128"]))
    if not draw(st.booleans()):
        return dtype
    dims = [str(d) for d in draw(st.lists(DIMS, max_size=9))]
    if draw(st.booleans()):
        dims = ["", *dims]
    return f"{dtype}[{','.join(dims)}]"


@SETTINGS
@given(
    schema=st.dictionaries(
        st.one_of(st.sampled_from(["tokens", "x", "a.b", ""]), st.text(max_size=8)),
        hostile_specs(),
        max_size=3,
    )
)
def test_hostile_schemas_give_a_roxxel_error(clean, schema) -> None:
    with copy_of(clean) as folder:
        with no_hang(), bounded_allocation(), contextlib.suppress(RoxxelError):
            roxxel.write_shard(folder / "extra.rxs", [], schema)
            shard = roxxel.open_shard(folder / "extra.rxs", max_decoded_bytes=READ_CAP)
            shard.get_batch(np.arange(0))
            roxxel.write_manifest(folder, [folder / "extra.rxs"])
        exercise(folder)  # the dataset of that one shard, or the clean one
    with copy_of(clean) as folder:
        doc = json.loads((folder / "manifest.json").read_text())
        doc["schema"] = schema
        (folder / "manifest.json").write_text(json.dumps(doc))
        exercise(folder)


# Shard bytes ---------------------------------------------------------------------------


@SETTINGS
@given(
    which=st.integers(0, 100),
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=4),
)
def test_hostile_shard_bytes_give_a_roxxel_error(clean, which, flips) -> None:
    with copy_of(clean) as folder:
        shards = sorted(folder.glob("*.rxs"))
        path = shards[which % len(shards)]
        data = bytearray(path.read_bytes())
        for position, mask in flips:
            data[position % len(data)] ^= mask
        path.write_bytes(bytes(data))
        exercise(folder)
