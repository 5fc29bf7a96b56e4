"""Pack state on disk: the lock, the plan, one marker per finished work unit, finalization.

A pack directory holds ``part-UUUUUU-KKKK.rxs`` shards (unit U, its K-th shard) and, under
``.roxxel-pack/``, ``plan.json`` (the fingerprint of the pack arguments, the number of units,
the schema), ``unit-UUUUUU.json`` markers written atomically after a unit's shards, and lock
files. A unit counts as done only when its marker matches the plan, names exactly the unit's
own shard files, and those shards open and match it, so a rerun keeps exactly the finished
units. ``manifest.json`` is written by `finalize` once every unit is done (or by `merge` from
several task directories).

One pack owns a directory at a time (`lock_output`): an ``flock`` on ``.roxxel-pack/lock``,
exclusive for a one-task pack, ``--finalize`` and `merge`, shared by the tasks of a
multi-task pack, each of which also holds ``task-I.lock`` exclusively. Worker processes
inherit the lock, so it stays held while any process of a run lives; whoever holds it may
remove what a dead run left behind, and nothing else. Every name read from a plan, marker or
manifest is checked before any file is touched.

A pack at a URL (``roxxel pack -o s3://...``, tasks on machines that share no disk) keeps the
same plan, shards and markers as objects there, without locks; `prepare_remote`,
`upload_unit`, `find_remote_units` and `finalize_remote` (the last section) are its steps.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import re
import secrets
import shutil
import socket
import stat
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from roxxel.errors import ConfigError, FormatError, RoxxelError, check_int, load_json
from roxxel.format.atomic import AtomicFile, fsync_dir, make_dirs, naming, write_atomic
from roxxel.format.dataset_writer import listed_shards, remove_shards, write_manifest
from roxxel.format.manifest import (
    MANIFEST_NAME,
    Manifest,
    ShardEntry,
    ShardInfo,
    checksum_text,
    json_object,
)
from roxxel.format.reader import TEMP_NAME, shard_infos
from roxxel.format.remote import RemoteStore, join_url
from roxxel.format.schema import Schema
from roxxel.format.upload import (
    list_objects,
    published_trailer,
    put_bytes,
    put_files,
    remove_object,
)

__all__ = [
    "STALE_WAIT_SECONDS",
    "STATE_DIR",
    "PackLock",
    "PackSpec",
    "finalize",
    "finalize_remote",
    "find_remote_units",
    "load_unit",
    "lock_output",
    "merge",
    "prepare_output",
    "prepare_remote",
    "read_plan",
    "remote_markers",
    "remove_unit_files",
    "shard_name",
    "upload_unit",
    "write_json_atomic",
    "write_unit_marker",
]

STATE_DIR = ".roxxel-pack"
STATE_MAX_BYTES = 16 << 20  # a plan or marker larger than this is not roxxel's
MAX_NUM_UNITS = 1 << 32
# A lock whose recorded holder is gone is still held by that run's last workers, which die
# with it (or finish their unit): wait this long for them before refusing.
STALE_WAIT_SECONDS = 10.0
_LOCK_NAMES = re.compile(r"^(lock|plan\.lock|task-[0-9]+\.lock)$")
_PART_NAME = re.compile(r"^part-[0-9]{6,}-[0-9]{4,}\.rxs$")
_MARKER_NAME = re.compile(r"^unit-([0-9]{6,})\.json$")
_PLAN_KEYS = {"fingerprint", "num_units", "schema", "metadata"}
_HOLDER_BYTES = 128


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
            # [name, spec] pairs: the plan is written with sorted keys, the fields keep
            # their order (the shards' and the manifest's)
            "schema": [[name, spec] for name, spec in self.schema.items()],
            "metadata": self.metadata,
        }

    @classmethod
    def from_json(cls, doc: Any, where: Path) -> PackSpec:
        """A plan read from disk, checked; raises FormatError naming ``where``."""
        if not isinstance(doc, dict) or set(doc) != _PLAN_KEYS:
            found = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
            raise FormatError(
                f"{where}: not a pack plan ({found}, expected keys {sorted(_PLAN_KEYS)})",
                path=where,
            )
        num = check_int(f"{where}: num_units", doc["num_units"], 0, MAX_NUM_UNITS, FormatError)
        pairs, metadata = doc["schema"], doc["metadata"]
        if isinstance(pairs, dict):  # a plan of roxxel 0.1 (fields in name order): resumable
            pairs = [list(item) for item in pairs.items()]
        fields = isinstance(pairs, list) and all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(v, str) for v in p)
            for p in pairs
        )
        if not (isinstance(doc["fingerprint"], str) and fields and isinstance(metadata, dict)):
            raise FormatError(
                f"{where}: bad plan values (expected a string fingerprint, a schema of "
                f"[name, spec] string pairs and a metadata object)",
                path=where,
            )
        return cls(doc["fingerprint"], num, dict(pairs), metadata)


def shard_name(unit: int, k: int) -> str:
    return f"part-{unit:06d}-{k:04d}.rxs"


# ---- the lock ------------------------------------------------------------------------------


class PackLock:
    """The lock of one pack directory, held until `release` (a context manager).

    ``fds`` are the descriptors of the directory's lock (``fd``) and of the task's: worker
    processes keep copies, so the locks stay held while any of them lives. Until `prepared`
    it also holds ``plan.lock``, so that processes starting together read and write the
    plan one at a time (and one of them may clear the directory for ``--overwrite``). Not
    thread-safe.
    """

    def __init__(self, out_dir: Path, task: int | None, fds: list[int], plan_fd: int):
        self.out_dir, self.task, self.fds = out_dir, task, fds
        self._plan_fd: int | None = plan_fd

    def prepared(self) -> None:
        """The plan is in place: let the next process starting here read it."""
        if self._plan_fd is not None:
            os.close(self._plan_fd)
            self._plan_fd = None

    @property
    def fd(self) -> int:
        return self.fds[0]

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        """Hold the directory alone for the block (a task's shared lock is made exclusive
        and shared again after); raises ConfigError if other tasks run there."""
        if self.task is None:
            yield
            return
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # a failed conversion may drop the shared lock (flock(2)): take it back first
            _acquire(self.fd, fcntl.LOCK_SH, self.out_dir, None, 0.0)
            holders = _run_holders(self.out_dir, mine=True)
            raise _busy(str(self.out_dir), holders, self.out_dir) from None
        try:
            yield
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_SH)

    def release(self) -> None:
        self.prepared()
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    def __enter__(self) -> PackLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lock_output(out_dir: Path, task: int | None = None) -> PackLock:
    """Lock ``out_dir`` for a pack (creating it): exclusively, or for task ``task`` of a
    multi-task pack (shared with the other tasks, exclusive for this task index).

    Fails at once with ConfigError "DIR is being packed by pid N" while another live process
    holds it; a lock held only by the workers of a run whose main process is gone is waited
    for (at most `STALE_WAIT_SECONDS`), since they die with it.
    """
    state = out_dir / STATE_DIR
    make_dirs(state)
    plan_fd = _open_lock(state / "plan.lock")
    fds = [plan_fd]
    try:
        _acquire_plan_lock(plan_fd, out_dir)
        fds = [_open_lock(state / "lock"), plan_fd]
        mode = fcntl.LOCK_EX if task is None else fcntl.LOCK_SH
        _acquire(fds[0], mode, out_dir, None, STALE_WAIT_SECONDS)
        if task is None:
            _record_holder(fds[0])
        else:
            fds.insert(1, _open_lock(state / f"task-{task}.lock"))
            _acquire(fds[1], fcntl.LOCK_EX, out_dir, task, STALE_WAIT_SECONDS)
            _record_holder(fds[1])
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return PackLock(out_dir, task, fds[:-1], plan_fd)


def _acquire_plan_lock(fd: int, out_dir: Path) -> None:
    """Wait for ``plan.lock``, which a process holds from its start until its plan is in
    place (milliseconds), at most `STALE_WAIT_SECONDS`."""
    deadline = time.monotonic() + STALE_WAIT_SECONDS
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise _busy(str(out_dir), _run_holders(out_dir), out_dir) from None
            time.sleep(0.001)


def _open_lock(path: Path) -> int:
    # O_CLOEXEC: a program the user's --map runs must not hold the lock; forked workers do
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)


def _acquire(fd: int, mode: int, out_dir: Path, task: int | None, stale_wait: float) -> None:
    """flock ``fd`` (the directory's lock, or task ``task``'s); if a live process holds it,
    or a dead run's workers hold it longer than ``stale_wait`` seconds, raise "DIR is being
    packed by pid N" (or "DIR: task I is being packed by pid N")."""
    deadline = time.monotonic() + stale_wait
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        what = str(out_dir) if task is None else f"{out_dir}: task {task}"
        holders = _run_holders(out_dir) if task is None else [_holder(fd)]
        alive: list[tuple[int, str] | None] = [h for h in holders if h and _alive(h)]
        if alive or time.monotonic() >= deadline:
            raise _busy(what, alive or holders, out_dir)
        time.sleep(0.01)  # a dead run's last workers are exiting


def _busy(what: str, holders: list[tuple[int, str] | None], out_dir: Path) -> ConfigError:
    known = [h for h in holders if h is not None]
    who = "another process"
    if known:
        pid, host = known[0]
        who = f"pid {pid}" + ("" if host == socket.gethostname() else f" on {host}")
    return ConfigError(
        f"{what} is being packed by {who} (expected one pack, merge or finalize at a time: "
        f"wait for it to end, or stop it)",
        path=out_dir,
    )


def _record_holder(fd: int) -> None:
    line = f"{os.getpid()} {socket.gethostname()}\n".encode()
    os.pwrite(fd, line[:_HOLDER_BYTES].ljust(_HOLDER_BYTES), 0)


def _holder(fd: int) -> tuple[int, str] | None:
    words = os.pread(fd, _HOLDER_BYTES, 0).decode("utf-8", "replace").split()
    if len(words) != 2 or not words[0].isdigit():
        return None
    return int(words[0]), words[1]


def _run_holders(out_dir: Path, mine: bool = False) -> list[tuple[int, str] | None]:
    """Who holds the directory: the tasks holding their locks, then the last exclusive one."""
    state = out_dir / STATE_DIR
    found: list[tuple[int, str] | None] = []
    for path in sorted(state.glob("task-*.lock")):
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                if not (mine and holder is not None and holder[0] == os.getpid()):
                    found.append(holder)
            finally:
                os.close(fd)
    with contextlib.suppress(OSError):
        fd = os.open(state / "lock", os.O_RDONLY | os.O_CLOEXEC)
        try:
            found.append(_holder(fd))
        finally:
            os.close(fd)
    return found


def _alive(holder: tuple[int, str]) -> bool:
    pid, host = holder
    if host != socket.gethostname() or pid == os.getpid():
        return True  # another machine's process cannot be asked
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rpartition(b")")[2].split()[0] != b"Z"  # a zombie is gone
    return True


# ---- plan and markers ----------------------------------------------------------------------


def _read_state(path: Path) -> bytes | None:
    """A small regular file's bytes (never blocking on a FIFO), or None if there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > STATE_MAX_BYTES:
            raise FormatError(
                f"{path}: not a regular file of at most {STATE_MAX_BYTES} bytes", path=path
            )
        return file.read(STATE_MAX_BYTES + 1)


def read_plan(out_dir: Path) -> PackSpec:
    """The plan of the pack in ``out_dir``; raises ConfigError if there is none and
    FormatError if it is malformed."""
    path = out_dir / STATE_DIR / "plan.json"
    data = _read_state(path)
    if data is None:
        raise ConfigError(
            f"{out_dir}: no pack plan (expected a directory written by roxxel pack)",
            path=out_dir,
        )
    return PackSpec.from_json(load_json(data, path), path)


def _peek_plan(out_dir: Path) -> PackSpec | None:
    with contextlib.suppress(OSError, RoxxelError):
        return read_plan(out_dir)
    return None


def write_json_atomic(path: Path, doc: Any) -> None:
    """Publish ``doc`` as JSON at ``path`` (temp file, fsync, rename, fsync of the folder)."""
    write_atomic(path, json.dumps(doc, indent=2, sort_keys=True).encode())


def _marker_path(out_dir: Path, unit: int) -> Path:
    return out_dir / STATE_DIR / f"unit-{unit:06d}.json"


def write_unit_marker(out_dir: Path, fingerprint: str, unit: int, doc: dict[str, Any]) -> None:
    """Record a finished unit: its shards (name, records, bytes, checksum) and counts."""
    write_json_atomic(
        _marker_path(out_dir, unit), {**doc, "fingerprint": fingerprint, "unit": unit}
    )


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _marker_ok(doc: Any, fingerprint: str, unit: int) -> bool:
    """A marker of this unit of this pack, naming exactly the unit's own shard files."""
    if not isinstance(doc, dict) or doc.get("fingerprint") != fingerprint:
        return False
    shards, bad = doc.get("shards"), doc.get("bad")
    if doc.get("unit") != unit or type(doc.get("unit")) is not int or not isinstance(shards, list):
        return False
    if not (isinstance(bad, dict) and _count(bad.get("count")) and _count(doc.get("num_dropped"))):
        return False
    if not (isinstance(bad.get("first"), list) and all(isinstance(b, str) for b in bad["first"])):
        return False
    return all(
        isinstance(s, dict)
        and s.get("name") == shard_name(unit, k)
        and _count(s.get("num_records"))
        and _count(s.get("num_bytes"))
        and isinstance(s.get("checksum"), str)
        for k, s in enumerate(shards)
    )


def load_unit(out_dir: Path, fingerprint: str, unit: int) -> dict[str, Any] | None:
    """The marker of a finished unit whose shards open and match it, else None."""
    path = _marker_path(out_dir, unit)
    try:
        data = _read_state(path)
        doc = None if data is None else load_json(data, path)
    except (OSError, RoxxelError):
        return None
    if not _marker_ok(doc, fingerprint, unit):
        return None
    assert isinstance(doc, dict)  # for the type checker: _marker_ok said so
    try:
        infos = shard_infos(out_dir / s["name"] for s in doc["shards"])
    except (OSError, RoxxelError):
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
    """Delete what an earlier, dead attempt at ``unit`` left: its marker, shards and temp
    files. Only for the unit's owner, holding the directory's lock (`lock_output`)."""
    with contextlib.suppress(FileNotFoundError):
        _marker_path(out_dir, unit).unlink()
    patterns = (
        str(out_dir / f"part-{unit:06d}-*.rxs"),
        str(out_dir / f".part-{unit:06d}-*.rxs.*.tmp"),
        str(out_dir / STATE_DIR / f".unit-{unit:06d}.json.*.tmp"),
    )
    for pattern in patterns:
        for path in glob.glob(pattern, include_hidden=True):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


# ---- preparing the output ------------------------------------------------------------------


def prepare_output(out_dir: Path, plan: PackSpec, overwrite: bool, lock: PackLock) -> bool:
    """Make ``out_dir`` (locked by ``lock``) ready for ``plan``; True when resuming it.

    An empty directory (or one holding only lock files) gets the plan; one holding the same
    pack resumes; anything else (another dataset, another pack, other files) is refused
    unless ``overwrite``, which removes what roxxel wrote there: the shards the old manifest
    lists, the old pack's shards and state, roxxel's temp files. Other files stay.
    """
    try:
        old = _peek_plan(out_dir)
        if old == plan:
            return True
        if not _is_fresh(out_dir):
            restart = old is not None and _nothing_finished(out_dir)
            if not overwrite and not restart:
                found = "a pack with other arguments" if old else "a dataset or other files"
                raise ConfigError(
                    f"{out_dir}: output directory holds {found} (expected an empty directory "
                    f"or the same pack arguments; pass --overwrite to replace it)",
                    path=out_dir,
                )
            with lock.alone():
                _remove_roxxel_files(out_dir)
        write_json_atomic(out_dir / STATE_DIR / "plan.json", plan.to_json())
    finally:
        lock.prepared()
    return False


def _is_fresh(out_dir: Path) -> bool:
    """Nothing there but roxxel's lock files (and temp files of a plan never published)."""
    names = [p.name for p in out_dir.iterdir() if p.name != STATE_DIR]
    state = [p.name for p in (out_dir / STATE_DIR).iterdir()]
    return not names and all(_LOCK_NAMES.match(n) or TEMP_NAME.match(n) for n in state)


def _nothing_finished(out_dir: Path) -> bool:
    """A pack that failed before finishing any unit: safe to start over without asking."""
    if (out_dir / MANIFEST_NAME).exists():
        return False
    return not glob.glob(str(out_dir / STATE_DIR / "unit-*.json"))


def _remove_roxxel_files(out_dir: Path) -> None:
    """What roxxel wrote in ``out_dir`` (the caller holds it alone); never the lock files."""
    state = out_dir / STATE_DIR
    state_names = [p.name for p in state.iterdir() if p.is_file()]
    was_pack = any(n == "plan.json" or _MARKER_NAME.match(n) for n in state_names)
    remove_shards(out_dir, listed_shards(out_dir))
    for path in out_dir.iterdir():
        ours = TEMP_NAME.match(path.name) or path.name == MANIFEST_NAME
        if (ours or (was_pack and _PART_NAME.match(path.name))) and path.is_file():
            path.unlink()
    for name in state_names:
        if not _LOCK_NAMES.match(name):
            (state / name).unlink()


# ---- finalize and merge --------------------------------------------------------------------


def _find_units(dirs: list[Path], plan: PackSpec) -> dict[int, tuple[Path, dict[str, Any]]]:
    """Each done unit of ``plan`` and the first of ``dirs`` holding it. Only the markers that
    exist are read, so the work is bounded by the files, never by ``plan.num_units``."""
    found: dict[int, tuple[Path, dict[str, Any]]] = {}
    for folder in dirs:
        with contextlib.suppress(FileNotFoundError):
            names = sorted(os.listdir(folder / STATE_DIR))
            for match in filter(None, map(_MARKER_NAME.match, names)):
                unit = int(match[1])
                if unit < plan.num_units and unit not in found:
                    doc = load_unit(folder, plan.fingerprint, unit)
                    if doc is not None:
                        found[unit] = (folder, doc)
    return found


def _refuse_missing(
    where: object, found: dict[int, Any], plan: PackSpec, num_tasks: int | None = None
) -> None:
    """Raise ConfigError naming the first missing units (and, given ``num_tasks``, the tasks
    they belong to: unit U is task U mod T's) unless every unit of ``plan`` is in ``found``."""
    missing_count = plan.num_units - len(found)
    if not missing_count:
        return
    missing: list[int] = []
    unit = 0
    while len(missing) < 10 and unit < plan.num_units:  # at most len(found) + 10 steps
        if unit not in found:
            missing.append(unit)
        unit += 1
    shown = ", ".join(map(str, missing)) + (" ..." if missing_count > 10 else "")
    if num_tasks is not None:
        tasks = sorted({u % num_tasks for u in missing})
        more = " ..." if missing_count > len(missing) else ""
        shown += f" of tasks {', '.join(map(str, tasks))}{more} of --num-tasks {num_tasks}"
    raise ConfigError(
        f"{where}: {missing_count} of {plan.num_units} work units not packed or damaged "
        f"(units {shown}; expected all: run the remaining tasks, or rerun pack)",
        path=where if isinstance(where, str | Path) else None,
    )


def finalize(out_dir: Path) -> Path:
    """Check every unit of the pack in ``out_dir`` and write ``manifest.json``.

    The caller holds the directory's lock. Raises ConfigError naming the missing or damaged
    units.
    """
    plan = read_plan(out_dir)
    found = _find_units([out_dir], plan)
    _refuse_missing(out_dir, found, plan)
    infos = [
        ShardInfo(out_dir / s["name"], s["num_records"], s["num_bytes"], s["checksum"])
        for unit in range(plan.num_units)
        for s in found[unit][1]["shards"]
    ]
    if not infos:
        raise ConfigError(f"{out_dir}: every work unit is empty (expected at least one record)")
    return write_manifest(out_dir, infos, plan.schema, plan.metadata)


def merge(part_dirs: list[Path], out_dir: Path, overwrite: bool) -> Path:
    """Gather the units of one pack, written by several tasks, into ``out_dir``; finalize.

    Every part must hold the same pack (equal plan fingerprints) and, together, every unit;
    both are checked before anything is written. Shards are hard-linked (copied across file
    systems) into ``out_dir`` through a temp name and a rename. Holds ``out_dir``'s lock.
    """
    plans = [read_plan(d) for d in part_dirs]
    plan = plans[0]
    if any(p.fingerprint != plan.fingerprint for p in plans):
        names = ", ".join(str(d) for d in part_dirs)
        raise ConfigError(
            f"{names}: parts of different packs (fingerprints differ, expected one pack's tasks)"
        )
    with lock_output(out_dir) as lock:
        here = [out_dir] if _peek_plan(out_dir) == plan else []
        dirs = [*here, *(d for d in part_dirs if d.resolve() != out_dir.resolve())]
        found = _find_units(dirs, plan)
        _refuse_missing(out_dir, found, plan)
        prepare_output(out_dir, plan, overwrite, lock)
        for unit in range(plan.num_units):
            part, doc = found[unit]
            if part is not out_dir:
                _copy_unit(part, out_dir, unit, doc)
        return finalize(out_dir)


def _copy_unit(part: Path, out_dir: Path, unit: int, doc: dict[str, Any]) -> None:
    remove_unit_files(out_dir, unit)
    for s in doc["shards"]:  # names checked by load_unit: this unit's own shard names
        _copy_file(part / s["name"], out_dir / s["name"])
    write_json_atomic(_marker_path(out_dir, unit), doc)


def _copy_file(source: Path, target: Path) -> None:
    """Hard-link (or copy) ``source`` to a temp name beside ``target``, then rename it."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    with naming(target):
        try:
            os.link(source, tmp)
        except OSError:  # another file system, or no hard links there
            copy = AtomicFile(target)
            try:
                with open(source, "rb") as f:
                    shutil.copyfileobj(f, copy.file, 8 << 20)
                copy.publish()
            except BaseException:
                copy.discard()
                raise
            return
        try:
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        fsync_dir(target.parent)


# ---- a pack at a URL -----------------------------------------------------------------------
#
# The same state as objects under the URL, for tasks on machines that share no disk: each
# task packs its units in a local staging folder, then uploads a unit's shards and, after
# them, its marker ``.roxxel-pack/unit-U.json``. There are no locks: the tasks own disjoint
# units, and what they write for the same unit is the same bytes. The plan is a pure function
# of the inputs and options, so every task computes it; ``.roxxel-pack/plan.json`` is written
# by whichever task finds none and read back, so tasks of another pack are refused.
# ``manifest.json`` goes up last, once every unit's marker and shards check out.

_REMOTE_PLAN = f"{STATE_DIR}/plan.json"


def _json_bytes(doc: Any) -> bytes:
    """The bytes `write_json_atomic` writes for ``doc``: equal documents, equal bytes."""
    return json.dumps(doc, indent=2, sort_keys=True).encode()


def _remote_marker(unit: int) -> str:
    return f"{STATE_DIR}/unit-{unit:06d}.json"


def _read_object(store: RemoteStore, name: str) -> bytes | None:
    try:
        return store.read(name, 0, STATE_MAX_BYTES + 1)
    except FileNotFoundError:
        return None


def _made_by(manifest: bytes, plan: PackSpec) -> bool:
    """Whether a manifest's metadata names this pack's fingerprint (as `finalize` writes)."""
    with contextlib.suppress(RoxxelError):
        doc = load_json(manifest, MANIFEST_NAME)
        metadata = doc.get("metadata") if isinstance(doc, dict) else None
        return isinstance(metadata, dict) and metadata.get("roxxel_pack") == plan.fingerprint
    return False


def prepare_remote(store: RemoteStore, plan: PackSpec, overwrite: bool, create: bool) -> bool:
    """Agree on ``plan`` at the store's URL; True when this pack's dataset is complete there.

    A manifest of another dataset is refused unless ``overwrite``, which deletes it before
    anything else is written (the old dataset stops opening). Without a plan there, one is
    written when ``create`` (a task), else refused (``--finalize``: no task ran); a plan of
    other arguments is refused unless ``overwrite`` and ``create``.

    Raises:
        ConfigError: naming the URL and what it holds.
        ConnectionError: the store stayed unreachable.
    """
    url, want = store.url, _json_bytes(plan.to_json())
    old = _read_object(store, _REMOTE_PLAN)
    manifest = _read_object(store, MANIFEST_NAME)
    if manifest is not None:
        if _made_by(manifest, plan):  # this pack's (a pack that staged it all, too)
            return True
        if not overwrite:
            raise _holds(url, "a dataset made otherwise")
        remove_object(store, MANIFEST_NAME)
    if old == want:
        return False
    if not create:
        found = "no pack plan" if old is None else "a pack with other arguments"
        raise ConfigError(
            f"{url}: {found} (expected the plan the tasks of this pack wrote: run them first)",
            path=url,
        )
    if old is not None and not overwrite:
        raise _holds(url, "a pack with other arguments")
    put_bytes(store, _REMOTE_PLAN, want)
    if _read_object(store, _REMOTE_PLAN) != want:  # a task of another pack wrote after us
        raise _holds(url, "a pack with other arguments, started at the same time")
    return False


def _holds(url: str, found: str) -> ConfigError:
    return ConfigError(
        f"{url}: holds {found} (expected an empty prefix or the same pack arguments; "
        f"pass --overwrite to replace it)",
        path=url,
    )


def upload_unit(store: RemoteStore, out_dir: Path, plan: PackSpec, unit: int) -> None:
    """Upload the finished ``unit`` of the local pack in ``out_dir``: its shards, then its
    marker; then remove its local files (the staging folder holds units in flight only).

    Raises:
        ConfigError: the unit is not finished in ``out_dir``.
        ConnectionError: the store stayed unreachable (the local files are kept: rerun).
    """
    doc = load_unit(out_dir, plan.fingerprint, unit)
    if doc is None:
        raise ConfigError(
            f"{out_dir}: unit {unit} has no valid marker (expected a packed unit to upload)",
            path=out_dir,
        )
    put_files(store, out_dir, [(s["name"], s["num_bytes"]) for s in doc["shards"]])
    put_bytes(store, _remote_marker(unit), _json_bytes(doc))
    remove_unit_files(out_dir, unit)


def remote_markers(store: RemoteStore, plan: PackSpec) -> set[int]:
    """The units of ``plan`` with a marker at the store's URL, from one listing (unchecked:
    a cheap test of whether `finalize_remote` can succeed yet)."""
    found = (_MARKER_NAME.match(name) for name in list_objects(store, STATE_DIR))
    return {int(m[1]) for m in found if m and int(m[1]) < plan.num_units}


def find_remote_units(
    store: RemoteStore, plan: PackSpec, units: Iterable[int] | None = None
) -> dict[int, dict[str, Any]]:
    """The units of ``plan`` (of ``units``, if given) done at the store's URL: a marker that
    matches the plan (as `load_unit` checks it) and, for each of its shards, an object of
    the marker's size whose trailer has its record count and index checksum (one ranged
    read each). A unit that fails a check is not done; its task packs it again.

    Raises:
        ConnectionError: the store stayed unreachable.
    """
    marked = remote_markers(store, plan)
    found = sorted(marked if units is None else marked.intersection(units))
    if not found:
        return {}
    sizes = list_objects(store)
    with ThreadPoolExecutor(min(16, len(found)), "roxxel-check") as pool:
        docs = list(pool.map(lambda u: _remote_unit(store, plan, u, sizes), found))
    return {u: doc for u, doc in zip(found, docs, strict=True) if doc is not None}


def _remote_unit(
    store: RemoteStore, plan: PackSpec, unit: int, sizes: dict[str, int]
) -> dict[str, Any] | None:
    name = _remote_marker(unit)
    data = _read_object(store, name)
    try:
        doc = None if data is None else load_json(data, join_url(store.url, name))
    except RoxxelError:
        return None
    if not _marker_ok(doc, plan.fingerprint, unit):
        return None
    assert isinstance(doc, dict)  # for the type checker: _marker_ok said so
    for s in doc["shards"]:
        if sizes.get(s["name"]) != s["num_bytes"]:
            return None
        try:
            trailer = published_trailer(store, s["name"], s["num_bytes"])
        except (FileNotFoundError, FormatError):
            return None
        if [trailer.num_records, checksum_text(trailer.index_checksum)] != [
            s["num_records"],
            s["checksum"],
        ]:
            return None
    return doc


def finalize_remote(
    store: RemoteStore,
    plan: PackSpec,
    num_tasks: int | None = None,
    found: dict[int, dict[str, Any]] | None = None,
) -> int:
    """Check every unit of ``plan`` at the store's URL (`find_remote_units`, unless ``found``
    holds its answer) and write ``manifest.json`` last; returns the number of shards.

    Raises:
        ConfigError: units are missing or damaged, named with their tasks when ``num_tasks``
            says how the units were split (unit U is task U mod T's).
    """
    found = find_remote_units(store, plan) if found is None else found
    _refuse_missing(store.url, found, plan, num_tasks)
    entries = [
        ShardEntry(s["name"], s["num_records"], s["num_bytes"], s["checksum"])
        for unit in range(plan.num_units)
        for s in found[unit]["shards"]
    ]
    if not entries:
        raise ConfigError(
            f"{store.url}: every work unit is empty (expected at least one record)",
            path=store.url,
        )
    metadata = json_object(plan.metadata, "metadata")
    manifest = Manifest(Schema.parse(plan.schema), tuple(entries), metadata)
    put_bytes(store, MANIFEST_NAME, manifest.to_json())
    return len(entries)
