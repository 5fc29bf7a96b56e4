"""Shared test setup: eight fake CPU devices for every JAX test, set before jax loads; the
`ctrl_c` fixture."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture
def ctrl_c() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt here, and the processes started here take it as
    Python does, also where the suite runs with SIGINT ignored (a shell's background job)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
