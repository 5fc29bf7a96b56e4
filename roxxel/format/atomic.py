"""Files that appear whole or not at all: temp file beside the target, fsync, rename, fsync.

Temp names are ``.<name>.<pid>.<hex>.tmp`` (see `roxxel.format.reader.TEMP_NAME`): hidden, unique
per writer, and never opened as shards, since a complete temp file is still unpublished.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

from roxxel.errors import ConfigError

__all__ = ["AtomicFile", "fsync_dir"]


class AtomicFile:
    """A temp file beside ``final`` that becomes ``final`` atomically on `publish`."""

    def __init__(self, final: Path):
        self.final = final
        if final.is_dir():
            raise ConfigError(f"{final}: is a directory (expected a file path)")
        # Not mkstemp: its 0600 mode would survive the rename; 0666 honours the umask.
        name = final.parent / f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        self.name = name
        self.file = os.fdopen(fd, "wb", buffering=1 << 20)

    def publish(self) -> None:
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


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
