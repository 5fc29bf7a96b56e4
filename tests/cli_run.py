"""The CLI in a child process, for tests of inputs that used to hang: a hang fails the test
(a timeout) instead of stopping the suite."""

from __future__ import annotations

import subprocess
import sys


def pack_in_subprocess(*argv: object, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """`roxxel pack ARGV -q` in a child process; raises `subprocess.TimeoutExpired` after
    ``timeout`` seconds."""
    script = "import sys; from roxxel.cli import main; sys.exit(main(sys.argv[1:]))"
    args = [sys.executable, "-c", script, "pack", *map(str, argv), "-q"]
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout)
