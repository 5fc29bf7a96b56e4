"""Pack state on disk: the plan, one marker per finished work unit, and finalization.

A pack directory holds ``part-UUUUUU-KKKK.rxs`` shards (unit U, its K-th shard) and, under
``.roxxel-pack/``, ``plan.json`` (the fingerprint of the pack arguments, the number of units,
the schema) and ``unit-UUUUUU.json`` markers written atomically after a unit's shards. A
unit counts as done only when its marker matches the plan and its shards open and match
the marker, so a rerun keeps exactly the finished units. ``manifest.json`` is written by
`finalize` once every unit is done (or by `merge` from several task directories).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from roxxel.errors import ConfigError, RoxxelError
from roxxel.format.dataset_writer import write_manifest
from roxxel.format.manifest import MANIFEST_NAME, ShardInfo
from roxxel.format.reader import shard_infos

__all__ = [
    "STATE_DIR",
    "PackSpec",
    "finalize",
    "load_unit",
    "merge",
    "prepare_output",
    "remove_unit_files",
    "shard_name",
    "write_json_atomic",
    "write_unit_marker",
]

STATE_DIR = ".roxxel-pack"


@dataclass(frozen=True, slots=True)
class PackSpec:
    """What every task of one pack agrees on; equal fingerprints mean equal arguments."""

    fingerprint: str
    num_units: int
    schema: dict[str, str]
    metadata: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "num_units": self.num_units,
            "schema": self.schema,
            "metadata": self.metadata,
        }


def shard_name(unit: int, k: int) -> str:
    return f"part-{unit:06d}-{k:04d}.rxs"


def write_json_atomic(path: Path, doc: Any) -> None:
    """Write JSON beside ``path`` and rename it into place (unique temp per process)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _read_plan(out_dir: Path) -> PackSpec | None:
    doc = _read_json(out_dir / STATE_DIR / "plan.json")
    try:
        return PackSpec(doc["fingerprint"], int(doc["num_units"]), doc["schema"], doc["metadata"])
    except (TypeError, KeyError, ValueError):
        return None


def _roxxel_files(out_dir: Path) -> list[Path]:
    names = [MANIFEST_NAME, STATE_DIR, "*.rxs", ".*.rxs.*.tmp"]
    return [Path(p) for n in names for p in glob.glob(str(out_dir / n), include_hidden=True)]


def prepare_output(out_dir: Path, plan: PackSpec, overwrite: bool) -> bool:
    """Make ``out_dir`` ready for ``plan``; returns True when resuming the same pack.

    An empty or missing directory is created; one holding the same pack resumes; anything
    else (another dataset, another pack, other files) is refused unless ``overwrite``, which
    removes roxxel's files there (other files stay).
    """
    old = _read_plan(out_dir)
    if old is not None and old.fingerprint == plan.fingerprint:
        return True
    if out_dir.exists() and any(out_dir.iterdir()):
        if not overwrite and not _nothing_finished(out_dir, old):
            found = "a pack with other arguments" if old else "a dataset or other files"
            raise ConfigError(
                f"{out_dir}: output directory holds {found} (expected an empty directory or "
                f"the same pack arguments; pass --overwrite to replace it)"
            )
        for path in _roxxel_files(out_dir):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    (out_dir / STATE_DIR).mkdir(parents=True, exist_ok=True)
    write_json_atomic(out_dir / STATE_DIR / "plan.json", plan.to_json())
    return False


def _nothing_finished(out_dir: Path, old: PackSpec | None) -> bool:
    """A pack that failed before finishing any unit: safe to start over without asking."""
    if old is None or (out_dir / MANIFEST_NAME).exists():
        return False
    return not glob.glob(str(out_dir / STATE_DIR / "unit-*.json"))


def _marker_path(out_dir: Path, unit: int) -> Path:
    return out_dir / STATE_DIR / f"unit-{unit:06d}.json"


def write_unit_marker(out_dir: Path, fingerprint: str, unit: int, doc: dict[str, Any]) -> None:
    """Record a finished unit: its shards (name, records, bytes, checksum) and counts."""
    write_json_atomic(
        _marker_path(out_dir, unit), {**doc, "fingerprint": fingerprint, "unit": unit}
    )


def load_unit(out_dir: Path, fingerprint: str, unit: int) -> dict[str, Any] | None:
    """The marker of a finished unit whose shards open and match it, else None."""
    doc = _read_json(_marker_path(out_dir, unit))
    if not isinstance(doc, dict) or doc.get("fingerprint") != fingerprint:
        return None
    try:
        infos = shard_infos(out_dir / s["name"] for s in doc["shards"])
    except (OSError, RoxxelError, KeyError, TypeError):
        return None
    for info, want in zip(infos, doc["shards"], strict=True):
        if [info.num_records, info.num_bytes, info.checksum] != [
            want["num_records"],
            want["num_bytes"],
            want["checksum"],
        ]:
            return None
    return doc


def remove_unit_files(out_dir: Path, unit: int) -> None:
    """Delete a unit's marker, shards and temp files (a previous, unfinished attempt)."""
    with contextlib.suppress(FileNotFoundError):
        _marker_path(out_dir, unit).unlink()
    for pattern in (f"part-{unit:06d}-*.rxs", f".part-{unit:06d}-*.rxs.*.tmp"):
        for path in glob.glob(str(out_dir / pattern), include_hidden=True):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def finalize(out_dir: Path) -> Path:
    """Check every unit of the pack in ``out_dir`` and write ``manifest.json``.

    Raises ConfigError naming the missing or damaged units.
    """
    plan = _read_plan(out_dir)
    if plan is None:
        raise ConfigError(f"{out_dir}: no pack plan (expected a directory written by roxxel pack)")
    docs = [load_unit(out_dir, plan.fingerprint, u) for u in range(plan.num_units)]
    missing = [u for u, d in enumerate(docs) if d is None]
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        raise ConfigError(
            f"{out_dir}: {len(missing)} of {plan.num_units} work units not packed or damaged "
            f"(units {shown}; expected all: run the remaining tasks, or rerun pack)"
        )
    infos = [
        ShardInfo(out_dir / s["name"], s["num_records"], s["num_bytes"], s["checksum"])
        for d in docs
        if d is not None
        for s in d["shards"]
    ]
    if not infos:
        raise ConfigError(f"{out_dir}: every work unit is empty (expected at least one record)")
    return write_manifest(out_dir, infos, plan.schema, plan.metadata)


def merge(part_dirs: list[Path], out_dir: Path, overwrite: bool) -> Path:
    """Gather the units of one pack, written by several tasks, into ``out_dir``; finalize.

    Every part must hold the same pack (equal plan fingerprints). Shards are hard-linked
    (copied across file systems) into ``out_dir`` unless already there.
    """
    plans: list[PackSpec] = []
    for d in part_dirs:
        found = _read_plan(d)
        if found is None:
            raise ConfigError(f"{d}: no pack plan (expected a directory written by roxxel pack)")
        plans.append(found)
    plan = plans[0]
    if any(p.fingerprint != plan.fingerprint for p in plans):
        raise ConfigError(
            f"{part_dirs}: parts of different packs (fingerprints differ, expected one pack's tasks)"
        )
    prepare_output(out_dir, plan, overwrite)
    for unit in range(plan.num_units):
        if load_unit(out_dir, plan.fingerprint, unit) is None:
            _copy_unit(part_dirs, out_dir, plan.fingerprint, unit)
    return finalize(out_dir)


def _copy_unit(part_dirs: list[Path], out_dir: Path, fingerprint: str, unit: int) -> None:
    for part in part_dirs:
        doc = load_unit(part, fingerprint, unit)
        if doc is None or part.resolve() == out_dir.resolve():
            continue
        remove_unit_files(out_dir, unit)
        for s in doc["shards"]:
            try:
                os.link(part / s["name"], out_dir / s["name"])
            except OSError:
                shutil.copyfile(part / s["name"], out_dir / s["name"])
        write_json_atomic(_marker_path(out_dir, unit), doc)
        return
