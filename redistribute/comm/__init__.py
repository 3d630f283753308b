"""MPI communicators for dtensor: with :mod:`redistribute.fileio` (MPI-IO files), the only
library code that imports mpi4py.

The package's modules, each owning one part:

- :mod:`~redistribute.comm.wrapper`: :class:`Comm`, the buffer-based collectives (and
  their nonblocking forms, the private duplicate of asynchronous work), :func:`world`;
- :mod:`~redistribute.comm.hooks`: :data:`HOOKS`, the one state that says which hooks are
  on (:func:`hooks_active`), read by the collectives and by both executors; the observers
  of the communication debug mode (:func:`add_observer`) and the op source of the checks;
- :mod:`~redistribute.comm.spmd`: the SPMD divergence check (:func:`set_check_spmd`) and
  the entry of every checked collective;
- :mod:`~redistribute.comm.watchdog`: the collective watchdog (:func:`set_watchdog`);
- :mod:`~redistribute.comm.persistent`: persistent all-gathers (:func:`set_persistent`,
  :class:`PersistentGather`, :func:`request_c_api`);
- :mod:`~redistribute.comm.reduce`: the reduce ops (:data:`REDUCE_OPS`) and their MPI
  datatypes and ops;
- :mod:`~redistribute.comm.datatypes`: raw bytes and derived datatypes of strided blocks
  (:func:`block_type`, :func:`free_types`);
- :mod:`~redistribute.comm.process`: the library's thread level and CUDA support, world
  ranks, node-local ranks;
- :mod:`~redistribute.comm.mesh`: the communicators of mesh dims
  (:func:`shared_mesh_comms`, :func:`make_mesh_comms`);
- :mod:`~redistribute.comm.settings`: the settings read from the environment at import and
  at each mesh creation (:func:`configure_from_env`).

This package's namespace is the public face listed in ``__all__``; the state of each part
lives in its module.
"""

from __future__ import annotations

from .datatypes import BYTES, block_type, free_types
from .hooks import (
    HOOKS,
    add_observer,
    hooks_active,
    notified_what,
    notify,
    remove_observer,
    set_op_source,
)
from .mesh import make_mesh_comms, shared_mesh_comms
from .persistent import PersistentGather, persistent_enabled, request_c_api, set_persistent
from .process import cuda_aware, local_rank, thread_multiple, world_ranks
from .reduce import REDUCE_OPS
from .settings import configure_from_env
from .spmd import check_spmd_enabled, set_check_spmd
from .watchdog import set_watchdog
from .wrapper import Comm, leave_check_block, world

__all__ = [
    "BYTES",
    "HOOKS",
    "REDUCE_OPS",
    "Comm",
    "PersistentGather",
    "add_observer",
    "block_type",
    "check_spmd_enabled",
    "configure_from_env",
    "cuda_aware",
    "free_types",
    "hooks_active",
    "leave_check_block",
    "local_rank",
    "make_mesh_comms",
    "notified_what",
    "notify",
    "persistent_enabled",
    "remove_observer",
    "request_c_api",
    "set_check_spmd",
    "set_op_source",
    "set_persistent",
    "set_watchdog",
    "shared_mesh_comms",
    "thread_multiple",
    "world",
    "world_ranks",
]

configure_from_env()
