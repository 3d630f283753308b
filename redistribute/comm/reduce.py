"""Reduce ops: the mapping of dtensor's reduce ops (``sum``, ``avg``, ``max``, ``min``,
``prod``) and of a dtype to the MPI datatype and MPI op of a reducing collective.

This module owns :data:`REDUCE_OPS`, :func:`reduction` (checked and cached per (dtype, op)
in the ``redistribute.reductions`` cache), the NaN-propagating max/min ops of floating
data, and :data:`WIDENED` (defined in :mod:`redistribute.cost`, which counts the bytes of
such reductions widened): the dtypes MPI has no datatype for (ml_dtypes' ``bfloat16``),
which reduce as a wider dtype (float32) and are rounded once at the end.

Note: bfloat16 reductions widen to float32 rather than run a user-defined MPI op on 2-byte
units. A user op rounds to bfloat16 after every pairwise step (the error grows with the
ranks and depends on MPI's reduction order), runs a Python callback with three numpy
conversions per step and segment, and cannot run on a CUDA-aware MPI's device buffers.
Widening costs two cast passes and twice the bytes on the wire, uses MPI's own vectorised
float32 sum and the shared-memory path, and rounds once: the result is the float32 sum of
the bfloat16 contributions rounded to nearest even, what PyTorch's float32-accumulating
reductions and a numpy float32 reference give. Measured (MPICH, this 2-core machine, sum
all-reduce): at 2 ranks 14/223/3989 us widened against 15/243/5114 us with a user op for
1Ki/64Ki/1Mi elements; at 4 ranks 85/843/11251 against 87/1375/21237 us, where the user op
also left 32% of the elements one rounding off the float32 sum rounded once.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from placements.cache import LRUCache
from placements.errors import DTypeError

from ..cost import WIDENED
from .hooks import render

__all__ = ["REDUCE_OPS", "WIDENED", "reduction"]

REDUCE_OPS = ("sum", "avg", "max", "min", "prod")


_MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
# Note: on bool data, sum and max are logical or, prod and min logical and (PyTorch and
# numpy agree: True + True is True for bool tensors).
_BOOL_OPS = {"sum": MPI.LOR, "max": MPI.LOR, "min": MPI.LAND, "prod": MPI.LAND}


# Note: MPI's predefined MAX/MIN compare with ``>``/``<``, so a NaN survives or vanishes
# depending on which rank holds it. numpy and PyTorch propagate NaN through max and min:
# floating max/min use user-defined ops that reduce with np.maximum / np.minimum, which
# propagate NaN. One op per (op, dtype), created on first use and kept for the process.
_NAN_UFUNCS = {"max": np.maximum, "min": np.minimum}
_nan_ops: dict[tuple[str, str], Any] = {}


def _nan_propagating_op(op: str, dtype: np.dtype) -> Any:
    """The MPI op that reduces ``dtype`` data with ``op`` (max or min), NaN-propagating."""
    key = (op, dtype.char)
    found = _nan_ops.get(key)
    if found is None:
        ufunc = _NAN_UFUNCS[op]

        def reduce(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
            acc = np.frombuffer(inoutbuf, dtype)
            ufunc(np.frombuffer(inbuf, dtype), acc, out=acc)

        found = _nan_ops[key] = MPI.Op.Create(reduce, commute=True)
    return found


# (dtype, op) -> (MPI datatype, MPI op) of the valid pairs: about a hundred at most, so the
# bound is never reached and recency does not matter. Every reducing collective looks its
# pair up, so it reads the entries through their bound ``get`` (a method call would cost
# 2-4% of a small all-reduce) and counts the hit itself.
_reductions = LRUCache("redistribute.reductions", 256)
_find_reduction = _reductions.data.get


def reduction(dtype: np.dtype, op: str, kind: str, what: object) -> tuple[Any, Any]:
    """(MPI datatype, MPI op) for reducing ``dtype`` data with ``op``. **Local**.

    Raises
    ------
    DTypeError
        For an unknown op or a pair that cannot be reduced (the message names the
        collective ``kind`` and the caller's description ``what``).
    """
    found = _find_reduction((dtype, op))
    if found is None:
        where = kind if what is None else f"{kind} ({render(what)})"
        found = _check_reduction(dtype, op, where)
        _reductions.misses += 1
        _reductions.put((dtype, op), found)
    else:
        _reductions.hits += 1
    return found


def _check_reduction(dtype: np.dtype, op: str, where: str) -> tuple[Any, Any]:
    if op not in _MPI_OPS:
        raise DTypeError(f"{where}: unknown reduce op {op!r}; expected one of {REDUCE_OPS}")
    # mpi4py's own table of predefined types by typecode (float16 included); the
    # ``mpi4py.util.dtlib`` alternative returns duplicated types on which MPICH's predefined
    # ops are not defined. Non-native byte orders are not builtin and are refused.
    if dtype in WIDENED:
        raise DTypeError(
            f"{where}: MPI has no {dtype} datatype; reduce it widened to "
            f"{WIDENED[dtype]} (Comm's blocking reductions and redistribute do)"
        )
    mpi_type = MPI._typedict.get(dtype.char) if dtype.isbuiltin else None
    if mpi_type is None or dtype.kind not in "biufc":
        raise DTypeError(f"{where}: cannot reduce dtype {dtype} with op {op!r}")
    if dtype.kind == "b":
        if op == "avg":
            raise DTypeError(f"{where}: reduce op 'avg' needs a floating dtype, got bool")
        return mpi_type, _BOOL_OPS[op]
    # Note: 'avg' of integer or bool data is refused, not floor-divided (no exact result).
    if op == "avg" and dtype.kind not in "fc":
        raise DTypeError(f"{where}: reduce op 'avg' needs a floating or complex dtype, got {dtype}")
    # Note: complex data has no max/min (PyTorch refuses; numpy would order lexicographically).
    if op in ("max", "min") and dtype.kind == "c":
        raise DTypeError(f"{where}: reduce op {op!r} is not defined for complex dtype {dtype}")
    if op in _NAN_UFUNCS and dtype.kind == "f":
        return mpi_type, _nan_propagating_op(op, dtype)
    return mpi_type, _MPI_OPS[op]
