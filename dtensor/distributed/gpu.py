"""Binding MPI ranks to GPUs, and the collective-free GPU availability check.

This module owns:

- binding an MPI rank to a GPU: :func:`select_device_for` (the pure rule: local rank
  modulo the number of visible devices, so several ranks may share one GPU),
  :func:`bind_device`, :func:`current_device` and :func:`device_count`;
- the collective-free GPU availability check that decides GPU test skips
  (:func:`gpu_unavailable_reason`): it reads only the installation and the driver, so it
  gives the same answer on every rank of a node and all ranks skip together.

cupy is imported lazily (:func:`dtensor.local.backend._cupy`), only when a function here
needs it.
"""

from __future__ import annotations

from placements.errors import MeshError

from ..local import backend as _backend

__all__ = [
    "bind_device",
    "current_device",
    "device_count",
    "gpu_unavailable_reason",
    "select_device_for",
]


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
