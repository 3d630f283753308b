"""CUDA glue of the local tensor: rank-to-GPU binding, DLPack interop, GPU collectives.

This module owns:

- binding an MPI rank to a GPU: :func:`select_device_for` (the pure rule: local rank
  modulo the number of visible devices, so several ranks may share one GPU),
  :func:`bind_device`, :func:`current_device` and :func:`device_count`;
- the collective-free GPU availability check that decides GPU test skips
  (:func:`gpu_unavailable_reason`): it reads only the installation and the driver, so it
  gives the same answer on every rank of a node and all ranks skip together;
- DLPack interop (:func:`from_dlpack`, :func:`to_dlpack`), zero-copy on both devices;
- the cupy side of device collectives: :func:`cupy_backend` (the array-module operations
  that :mod:`redistribute.staging` is written against), the process-wide pinned staging
  pool (:func:`pinned_pool`) and :func:`device_comm`, which wraps a mesh communicator for
  device buffers.

cupy is imported lazily, only when a function here needs it.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from placements.errors import ArgumentError, DTypeError, MeshError
from redistribute.staging import DeviceBackend, DeviceComm, PinnedPool, select_path

from ..local import backend as _backend
from ..local.factory import _from_array
from ..local.tensor import Tensor

__all__ = [
    "bind_device",
    "cupy_backend",
    "current_device",
    "device_comm",
    "device_count",
    "from_dlpack",
    "gpu_unavailable_reason",
    "pinned_pool",
    "select_device_for",
    "to_dlpack",
]

# DLPack device types (dlpack.h, DLDeviceType)
_KDL_CPU, _KDL_CUDA, _KDL_CUDA_HOST, _KDL_CUDA_MANAGED = 1, 2, 3, 13
_HOST_KINDS = (_KDL_CPU, _KDL_CUDA_HOST)
_CUDA_KINDS = (_KDL_CUDA, _KDL_CUDA_MANAGED)


# -- rank to GPU binding ------------------------------------------------------------------


def select_device_for(local_rank: int, count: int) -> int:
    """The GPU index a process of node-local rank ``local_rank`` uses.

    **Local** (pure). ``local_rank % count``: ranks fill the devices round robin, so with
    more ranks than GPUs several ranks share one.

    Raises
    ------
    MeshError
        For a negative ``local_rank`` or when no device is visible (``count < 1``).
    """
    if local_rank < 0:
        raise MeshError(f"select_device_for: local rank must be >= 0, got {local_rank}")
    if count < 1:
        raise MeshError(
            f"select_device_for: cannot bind local rank {local_rank}: no CUDA device is "
            f"visible (device count {count}; check CUDA_VISIBLE_DEVICES)"
        )
    return local_rank % count


def device_count() -> int:
    """Number of CUDA devices cupy sees; 0 without cupy, driver or device. **Local**."""
    try:
        cp = _backend._cupy()
    except ImportError:
        return 0
    try:
        return int(cp.cuda.runtime.getDeviceCount())
    except cp.cuda.runtime.CUDARuntimeError:
        return 0


def bind_device(local_rank: int) -> int:
    """Make GPU ``select_device_for(local_rank, device_count())`` this process's current
    device; ``device="cuda"`` then means it. Returns its index.

    **Local.** The caller computes ``local_rank`` (the rank among the processes of this
    node, from a shared-memory split of the world communicator).
    """
    index = select_device_for(local_rank, device_count())
    _backend._cupy().cuda.Device(index).use()
    return index


def current_device() -> int:
    """Index of this process's current CUDA device. **Local**. Needs cupy."""
    return int(_backend._cupy().cuda.Device().id)


def gpu_unavailable_reason() -> str | None:
    """Why GPU work cannot run here, or None when cupy imports and sees a device.

    **Local** and collective-free: it depends only on the installation and the driver, so
    every rank of a node gets the same answer (GPU tests skip on all ranks together).
    """
    try:
        _backend._cupy()
    except Exception as exc:  # noqa: BLE001 - a broken cupy install fails in many ways
        return f"cupy is not usable ({type(exc).__name__}: {exc})"
    if device_count() < 1:
        return "cupy sees no CUDA device"
    return None


# -- DLPack -------------------------------------------------------------------------------


def from_dlpack(ext: Any) -> Tensor:
    """A tensor sharing memory with a DLPack producer (cupy/numpy array, torch tensor...).

    **Local.** Host data (DLPack CPU or CUDA-host memory) becomes a numpy-backed tensor,
    device data a cupy-backed one; no copy either way. A :class:`Tensor` is accepted too
    (the result shares its memory).

    Raises
    ------
    DTypeError
        When ``ext`` does not implement the DLPack protocol.
    ArgumentError
        For memory on a device kind other than CPU or CUDA (a ValueError).
    """
    arr = ext._arr if isinstance(ext, Tensor) else ext
    if not (hasattr(arr, "__dlpack__") and hasattr(arr, "__dlpack_device__")):
        raise DTypeError(
            f"from_dlpack: expected an object with __dlpack__ and __dlpack_device__, got "
            f"{type(ext).__name__}"
        )
    kind, index = arr.__dlpack_device__()
    if kind in _HOST_KINDS:
        out = np.from_dlpack(arr)
    elif kind in _CUDA_KINDS:
        out = _backend._cupy().from_dlpack(arr)
    else:
        raise ArgumentError(
            f"from_dlpack: memory on DLPack device type {int(kind)} (index {index}) is not "
            f"supported; dtensor holds CPU (1) and CUDA (2) memory"
        )
    return _from_array(out, "from_dlpack")


def to_dlpack(tensor: Tensor, stream: Any = None) -> Any:
    """A DLPack capsule of ``tensor``'s data (no copy). **Local.**

    ``stream`` is passed to the array's ``__dlpack__`` (the consumer's CUDA stream, or None).
    """
    if not isinstance(tensor, Tensor):
        raise DTypeError(f"to_dlpack: expected a dt.Tensor, got {type(tensor).__name__}")
    return tensor._arr.__dlpack__(stream=stream)


# -- device collectives -------------------------------------------------------------------


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
