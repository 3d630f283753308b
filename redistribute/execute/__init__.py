"""Running redistribute plans on this rank's shard, and scattering a tensor from one rank.

The package's modules, each owning one part:

- :mod:`~redistribute.execute.programs`: each step of a plan compiled into a runner (the
  counts, displacements and derived datatypes of its collective), kept in a bounded cache;
- :mod:`~redistribute.execute.run`: :func:`execute` and :func:`execute_async` of a plan;
- :mod:`~redistribute.execute.shared`: exchanges through node-shared memory;
- :mod:`~redistribute.execute.scatter`: :func:`scatter_from` (``distribute_tensor``);
- :mod:`~redistribute.execute.compiled`: :func:`compiled_form`, one-step plans as the
  compiled executor (``fastpath._redist``) runs them, and what that executor is plugged
  with (:func:`executor_plug`).

This package's namespace is the public face listed in ``__all__``.
"""

from __future__ import annotations

from .compiled import compiled_form, executor_plug
from .run import execute, execute_async
from .scatter import scatter_from

__all__ = ["compiled_form", "execute", "execute_async", "executor_plug", "scatter_from"]
