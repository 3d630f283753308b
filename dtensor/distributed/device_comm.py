"""The cupy side of device collectives: the array-module operations that
:mod:`redistribute.staging` is written against (:func:`cupy_backend`), the process-wide
pinned host staging pool (:func:`pinned_pool`) and :func:`device_comm`, which wraps a mesh
communicator so that its collectives take cupy buffers (CUDA-aware or staged through host
memory).

cupy is imported lazily, only when a function here needs it.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from redistribute.staging import DeviceBackend, DeviceComm, PinnedPool, select_path

from ..local import backend as _backend

__all__ = ["cupy_backend", "device_comm", "pinned_pool"]


def _is_cuda_array(obj: Any) -> bool:
    return hasattr(obj, "__cuda_array_interface__")


def _synchronize() -> None:
    # dtensor issues its kernels and copies on the current stream: waiting for it covers
    # both the kernels that produced a buffer and the staging copies.
    _backend._cupy().cuda.get_current_stream().synchronize()


_lock = threading.Lock()
_state: dict[str, Any] = {}


def cupy_backend() -> DeviceBackend:
    """The cupy operations the device collectives use. **Local**."""
    with _lock:
        be = _state.get("backend")
        if be is None:
            be = _state["backend"] = DeviceBackend(
                name="cupy",
                is_device=_is_cuda_array,
                to_host=lambda dev, host: dev.get(out=host),
                to_device=lambda host, dev: dev.set(host),
                synchronize=_synchronize,
            )
        return be


def _alloc_pinned(nbytes: int) -> np.ndarray:
    import cupyx  # ships with cupy

    return cupyx.empty_pinned((nbytes,), np.uint8)


def pinned_pool() -> PinnedPool:
    """The process-wide pool of page-locked host staging buffers. **Local**."""
    with _lock:
        pool = _state.get("pool")
        if pool is None:
            pool = _state["pool"] = PinnedPool(_alloc_pinned)
        return pool


def device_comm(comm: Any, cuda_aware: bool, path: str | None = None) -> DeviceComm:
    """Wrap a mesh communicator so that its collectives take cupy buffers. **Local**.

    Parameters
    ----------
    comm : redistribute.comm.Comm
        The host communicator.
    cuda_aware : bool
        Whether the loaded MPI accepts device pointers.
    path : str, optional
        Forces ``"cuda-aware"`` or ``"staged"``; default from ``DTENSOR_GPU_COMM``, else
        from ``cuda_aware`` (see :func:`redistribute.staging.select_path`).
    """
    return DeviceComm(comm, cupy_backend(), select_path(cuda_aware, path), pinned_pool())
