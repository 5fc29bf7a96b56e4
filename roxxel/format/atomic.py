"""Files that appear whole or not at all: temp file beside the target, fsync, rename, fsync.

Temp names are ``.<name>.<pid>.<hex>.tmp`` (see `roxxel.format.reader.TEMP_NAME`): hidden, unique
per writer, and never opened as shards, since a complete temp file is still unpublished. A new
directory is fsynced in its parent (`make_dirs`), so that a power cut cannot lose its entry
after files inside it were published. An `OSError` without a file name (a full disk, say) gets
the name of the file being written (`naming`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

from roxxel.errors import ConfigError

__all__ = ["AtomicFile", "fsync_dir", "make_dirs", "naming", "write_atomic"]


class AtomicFile:
    """A temp file beside ``final`` that becomes ``final`` atomically on `publish`."""

    def __init__(self, final: Path):
        self.final = final
        if final.is_dir():
            raise ConfigError(f"{final}: is a directory (expected a file path)")
        # Not mkstemp: its 0600 mode would survive the rename; 0666 honours the umask.
        name = final.parent / f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        with naming(final):
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        self.name = name
        self.file = os.fdopen(fd, "wb", buffering=1 << 20)

    def publish(self) -> None:
        with naming(self.final):
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.name, self.final)
            fsync_dir(self.final.parent)

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.name)


def write_atomic(final: Path, data: bytes) -> None:
    """Publish ``data`` as ``final`` (temp file, fsync, rename, fsync of the folder)."""
    tmp = AtomicFile(final)
    try:
        with naming(final):
            tmp.file.write(data)
        tmp.publish()
    except BaseException:
        tmp.discard()
        raise


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(folder: Path) -> None:
    """Create ``folder`` and its missing parents, each fsynced in its own parent."""
    missing: list[Path] = []
    while not folder.is_dir():
        missing.append(folder)
        if folder.parent == folder:
            break
        folder = folder.parent
    for new in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it: sync it anyway
            new.mkdir()
        fsync_dir(new.parent)


@contextlib.contextmanager
def naming(path: Path) -> Iterator[None]:
    """Give an `OSError` that names no file (ENOSPC from a write, say) the name ``path``."""
    try:
        yield
    except OSError as e:
        if e.filename is not None or not e.errno:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from e
