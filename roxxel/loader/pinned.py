"""Page-locked (pinned) host buffers: what lets a batch cross to a GPU at the link's speed.

A GPU copies from page-locked host memory by DMA at the link's full rate; from pageable
memory the driver first copies through its own small pinned staging buffer (on an H100,
3 MiB batches move at ~5 GB/s pageable against ~10-16 GB/s pinned). The loader's buffer
ring (`roxxel.loader.host.BufferPool`) page-locks each buffer once, when it is allocated,
through a `Registrar`, and the gather writes straight into it: no extra host copy.

Which registrar a loader gets is decided once, from its devices (`registrar_for`): on CUDA
devices the CUDA runtime's ``cudaHostRegister`` (reached through ctypes from the library
jax's CUDA plugin already loaded, no new dependency); on CPU none (jax aliases the host
buffer there, nothing to copy), and the pool keeps today's pageable buffers. Tests pass a
fake registrar to exercise the ring on CPU.

Imports only the standard library and numpy (no jax).
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import mmap
import os
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["PAGE_BYTES", "CudaRegistrar", "Registrar", "registrar_for"]

PAGE_BYTES = mmap.PAGESIZE
_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, not just the current
_CUDART_NAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so")


@runtime_checkable
class Registrar(Protocol):
    """Page-locks host buffers for fast device copies.

    ``register(array)`` pins a C-contiguous, page-aligned array's memory and returns True,
    or returns False when it cannot (the buffer then stays pageable, which is still
    correct); ``unregister(array)`` undoes a successful ``register`` before the memory is
    freed. Both may be called from any thread, ``unregister`` even during garbage
    collection: they must not raise and must not take a lock.
    """

    def register(self, array: np.ndarray) -> bool: ...

    def unregister(self, array: np.ndarray) -> None: ...


class CudaRegistrar:
    """`Registrar` over the CUDA runtime's ``cudaHostRegister`` / ``cudaHostUnregister``.

    Build with `CudaRegistrar.load` (None where no CUDA runtime library loads).
    """

    def __init__(self, cudart: Any) -> None:
        self._register = cudart.cudaHostRegister
        self._register.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint)
        self._register.restype = ctypes.c_int
        self._unregister = cudart.cudaHostUnregister
        self._unregister.argtypes = (ctypes.c_void_p,)
        self._unregister.restype = ctypes.c_int

    @staticmethod
    def load() -> CudaRegistrar | None:
        """The registrar over the first CUDA runtime library that loads, else None."""
        for path in (*_CUDART_NAMES, *_plugin_cudarts()):
            try:
                return CudaRegistrar(ctypes.CDLL(path))
            except (OSError, AttributeError):
                continue
        return None

    def register(self, array: np.ndarray) -> bool:
        if array.nbytes == 0:
            return False
        return self._register(array.ctypes.data, array.nbytes, _PORTABLE) == 0

    def unregister(self, array: np.ndarray) -> None:
        self._unregister(array.ctypes.data)  # an error here leaves nothing to undo


def registrar_for(devices: Iterable[Any]) -> Registrar | None:
    """The registrar for buffers bound for `devices` (jax devices): CUDA's where every
    device is a CUDA GPU and the runtime loads; None (pageable buffers) otherwise, for
    example on CPU, where jax aliases host memory instead of copying it."""
    platforms = {device.platform for device in devices}
    if not platforms or not platforms <= {"gpu", "cuda"}:
        return None
    return CudaRegistrar.load()


def _plugin_cudarts() -> list[str]:
    """libcudart files shipped by the ``nvidia-cuda-runtime`` wheels jax's CUDA plugin uses."""
    spec = importlib.util.find_spec("nvidia")
    roots = [] if spec is None else list(spec.submodule_search_locations or [])
    found = []
    for root in roots:
        for pattern in ("cuda_runtime/lib/libcudart.so*", "cu*/lib/libcudart.so*"):
            found += sorted(glob.glob(os.path.join(root, pattern)), reverse=True)
    return found
