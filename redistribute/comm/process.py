"""What MPI says about this process: the library's thread level and CUDA support, the world
ranks of a communicator's ranks, this process's host and its place on it.

This module owns :func:`thread_multiple`, :func:`cuda_aware`, :func:`world_ranks`,
:func:`my_host` and :func:`local_rank`. They take any :class:`~redistribute.comm.Comm`
(they read its ``mpi``, ``rank`` and ``size``).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
from mpi4py import MPI

from ..hosts import host_id, simulated_host

__all__ = ["cuda_aware", "local_rank", "my_host", "thread_multiple", "world_ranks"]


def thread_multiple() -> bool:
    """Whether MPI was initialised with ``MPI_THREAD_MULTIPLE`` (any thread may call it at
    any time). **Local**."""
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def cuda_aware() -> bool:
    """Whether the loaded MPI library takes CUDA device buffers. **Local**.

    Asks ``MPIX_Query_cuda_support`` (MPICH, Open MPI, MVAPICH), found through mpi4py's
    extension module; False for a library without it.
    """
    try:
        query = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return False
    query.restype = ctypes.c_int
    return bool(query())


def my_host() -> int:
    """This process's host id (:func:`redistribute.hosts.host_id`: the machine, and the
    simulated host of ``DTENSOR_SIM_HOSTS``). **Local**."""
    world = MPI.COMM_WORLD
    return host_id(world.Get_rank(), world.Get_size())


def local_rank(base: Any) -> int:
    """This process's rank among the ranks of ``base`` on its host. **Collective** over
    ``base`` (a shared-memory split; under ``DTENSOR_SIM_HOSTS``, split again by simulated
    host)."""
    node = base.mpi.Split_type(MPI.COMM_TYPE_SHARED, base.rank)
    world = MPI.COMM_WORLD
    sim = simulated_host(world.Get_rank(), world.Get_size())
    try:
        if sim is None:
            return node.Get_rank()
        host = node.Split(sim, base.rank)
        try:
            return host.Get_rank()
        finally:
            host.Free()
    finally:
        node.Free()


def world_ranks(comm: Any) -> np.ndarray:
    """The COMM_WORLD rank of every rank of ``comm``, in ``comm``'s rank order. **Local**."""
    if comm.mpi == MPI.COMM_WORLD:
        return np.arange(comm.size, dtype=np.int64)
    group, world = comm.mpi.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        ranks = MPI.Group.Translate_ranks(group, list(range(comm.size)), world)
    finally:
        group.Free()
        world.Free()
    return np.array(ranks, dtype=np.int64)
