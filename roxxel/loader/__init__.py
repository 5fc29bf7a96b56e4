"""The Loader: step reads (``steps``), the host pipeline (``host``), placement on a device mesh
(``placement``), and `Loader` itself (``loader``), the one part besides ``train`` that imports jax."""

from __future__ import annotations

from roxxel.loader.loader import Loader, LoaderConfig, host_rng

__all__ = ["Loader", "LoaderConfig", "host_rng"]
