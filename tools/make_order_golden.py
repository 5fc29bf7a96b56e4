"""Write tests/data/order-golden.json, the pinned order vectors (run only by hand).

    python tools/make_order_golden.py            # rewrite tests/data/order-golden.json

For fixed configurations (one shuffled source; token windows crossing shard boundaries; a
4-source mixture with caps, phases that change batch size and seq_len, exhaustion with
renormalization and with refill; `Mixture.continue_from`) the file records the (source,
record) of every row of chosen steps, read through a `Loader` with provenance, and the
digest fields of `Loader.state()`. `tests/test_contracts.py` recomputes them and fails on
any difference: resume across roxxel versions is the promise, so a change to these vectors
is a roxxel version bump, a higher `ORDER_VERSION` and a CHANGELOG.md line. This script
refuses to rewrite changed vectors under the same `ORDER_VERSION`.

The datasets are built from deterministic content in a temporary folder; the shards record
the fixed writer name `WRITER` (not the running version), so a version bump alone does not
change a dataset's fingerprint.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import numpy as np

import roxxel
from roxxel.format import writer as writer_module
from roxxel.loader.loader import Loader, LoaderConfig
from roxxel.sampling.mixture import Cap, Mixture, Phase
from roxxel.sources.records import Records, TokenWindows

ORDER_VERSION = 1  # raise with any change to the vectors (and bump roxxel's version)
GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "data" / "order-golden.json"
WRITER = "0.1.0"  # the writer version the fixture shards record, whatever roxxel's is
STEPS = (0, 1, 2, 10**6, 10**12)
STATE_DIGESTS = ("version", "seed", "fingerprint")  # what a restore checks
BUMP = "this changes which record lands where: bump roxxel's version and add a CHANGELOG.md line"


@contextmanager
def pinned_writer() -> Iterator[None]:
    """Shards written inside record `WRITER` as their writer version."""
    old = writer_module.WRITER_VERSION
    writer_module.WRITER_VERSION = WRITER
    try:
        yield
    finally:
        writer_module.WRITER_VERSION = old


def _write(path: Path, docs: list[np.ndarray], shard_bytes: int) -> roxxel.Dataset:
    schema = {"tokens": "int32[]", "label": "int64"}
    with pinned_writer(), roxxel.DatasetWriter(path, schema, shard_bytes=shard_bytes) as w:
        for i, doc in enumerate(docs):
            w.write({"tokens": doc, "label": i})
    return roxxel.open_dataset(path)


def build_datasets(root: Path) -> dict[str, roxxel.Dataset]:
    """Four small datasets of deterministic content (no random generator involved)."""
    datasets = {}
    for k, name in enumerate(("web", "code", "math", "books")):
        num_docs = (37, 23, 11, 17)[k]
        docs = [
            (np.arange(1 + (7 * i + 3 * k) % 13, dtype=np.int32) + 1000 * k + 100 * i)
            for i in range(num_docs)
        ]
        datasets[name] = _write(root / name, docs, shard_bytes=96)
    return datasets


def _windows(ds: roxxel.Dataset, seq_len: int = 8) -> TokenWindows:
    return TokenWindows(ds, "tokens", seq_len, targets=False)


def _mixture(
    datasets: dict[str, roxxel.Dataset], on_exhausted: Literal["stop", "refill"]
) -> Mixture:
    sources = {name: _windows(ds) for name, ds in datasets.items()}
    phases = [
        Phase({"web": 4, "code": 2, "math": 1, "books": 1}, end_step=3),
        Phase({"web": 1, "code": 1, "math": 1, "books": 1}, end_step=6, batch_size=12, seq_len=4),
        Phase({"web": 1, "code": 3, "math": 2, "books": 1}, seq_len=6),
    ]
    caps: dict[str, Cap | float] = {"code": Cap(epochs=1), "math": Cap(samples=5), "books": 0.5}
    if on_exhausted == "refill":
        caps["web"] = Cap(epochs=2)
    return Mixture(sources, phases, batch_size=8, caps=caps, seed=11, on_exhausted=on_exhausted)


def _continued(datasets: dict[str, roxxel.Dataset]) -> Mixture:
    old = _mixture(datasets, "stop")
    phases = [
        Phase({"web": 1, "code": 1, "math": 0, "books": 2}, end_step=9, batch_size=6, seq_len=5),
        Phase({"web": 2, "books": 1}),
    ]
    return Mixture.continue_from(old, 4, phases, caps={"books": Cap(epochs=2)})


def configurations(datasets: dict[str, roxxel.Dataset]) -> dict[str, Callable[[], Any]]:
    """Name -> a function giving ``(source, batch_size, seed, extra steps)``."""
    web, code = datasets["web"], datasets["code"]
    return {
        "records_shuffled": lambda: (Records(web, fields=["label"]), 5, 3, ()),
        "windows_across_shards": lambda: (_windows(code, 5), 4, 7, ()),
        "mixture_renormalize": lambda: (_mixture(datasets, "stop"), None, 11, (3, 5, 6, 9, 40)),
        "mixture_refill": lambda: (_mixture(datasets, "refill"), None, 11, (3, 6, 25, 60)),
        "continue_from": lambda: (_continued(datasets), None, 11, (4, 5, 9, 10)),
    }


def _located(mixture: Mixture, step: int) -> dict[str, Any] | None:
    """A mixture step's rows from ``locate`` (a `Loader` cannot take a continued mixture
    yet: it asks for the batch size at step 0, before the origin)."""
    start = mixture.position_at(step)
    sources, records = mixture.locate(start, start + mixture.batch_size_at(step))
    if not len(sources):
        return None
    rows = np.stack([sources.astype(np.int64), records.astype(np.int64)], axis=1)
    return {"rows": rows.tolist(), "state": {}}


def _rows(source: Any, batch_size: int | None, seed: int, step: int) -> dict[str, Any] | None:
    if isinstance(source, Mixture) and source.origin_step:
        return _located(source, step)
    config = LoaderConfig(num_epochs=None, provenance=True)
    with Loader(source, batch_size, seed=seed, start_step=step, config=config) as loader:
        batch = next(iter(loader), None)
        state = loader.state()
    digests = {key: state[key] for key in STATE_DIGESTS}
    if batch is None:
        return None
    rows = np.stack([np.asarray(batch["source"]), np.asarray(batch["record"])], axis=1)
    return {"rows": rows.tolist(), "state": digests}


def compute(root: Path) -> dict[str, Any]:
    """The vectors of every configuration, over datasets built under `root`."""
    out: dict[str, Any] = {}
    for name, make in configurations(build_datasets(root)).items():
        source, batch_size, seed, extra = make()
        first = source.origin_step if isinstance(source, Mixture) else 0
        steps = sorted({first, first + 1, first + 2, *extra, *STEPS} - set(range(first)))
        entry: dict[str, Any] = {"steps": {}}
        if isinstance(source, Mixture):
            entry["mixture_fingerprint"] = source.fingerprint()
        for step in steps:
            if (
                isinstance(source, Mixture)
                and source.end_step is not None
                and step >= source.end_step
            ):
                continue
            got = _rows(source, batch_size, seed, step)
            if got is not None:
                entry["steps"][str(step)] = got
        out[name] = entry
    return out


def compare(golden: dict[str, Any], fresh: dict[str, Any]) -> list[str]:
    """Every difference between two vector sets, as 'config step: what' lines."""
    diffs = []
    for name in sorted(set(golden) | set(fresh)):
        old, new = golden.get(name), fresh.get(name)
        if old is None or new is None:
            diffs.append(f"{name}: configuration only in {'fresh' if old is None else 'golden'}")
            continue
        if old.get("mixture_fingerprint") != new.get("mixture_fingerprint"):
            diffs.append(f"{name}: mixture fingerprint {new.get('mixture_fingerprint')}")
        for step in sorted(set(old["steps"]) | set(new["steps"]), key=int):
            a, b = old["steps"].get(step), new["steps"].get(step)
            if a is None or b is None:
                diffs.append(f"{name} step {step}: {'new' if a is None else 'gone'}")
            elif a["rows"] != b["rows"]:
                bad = [
                    i for i, (x, y) in enumerate(zip(a["rows"], b["rows"], strict=False)) if x != y
                ]
                diffs.append(f"{name} step {step}: rows {bad or 'count'} differ")
            elif a["state"] != b["state"]:
                diffs.append(f"{name} step {step}: state {b['state']} (was {a['state']})")
    return diffs


def document(vectors: dict[str, Any]) -> dict[str, Any]:
    return {
        "order_version": ORDER_VERSION,
        "roxxel_version": roxxel.__version__,
        "writer": WRITER,
        "configurations": vectors,
    }


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        vectors = compute(Path(tmp))
    if GOLDEN.exists():
        old = json.loads(GOLDEN.read_text())
        if old["order_version"] == ORDER_VERSION and compare(old["configurations"], vectors):
            print(f"{GOLDEN}: vectors changed under order_version {ORDER_VERSION}; {BUMP}")
            return 1
    GOLDEN.write_text(json.dumps(document(vectors), indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
