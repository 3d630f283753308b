"""Internal package (a layer; its public names reach users through ``dtensor``): the op
table, one record per op (:mod:`.table`), declared by family.

Importing this package declares every built-in op (:mod:`.pointwise`, :mod:`.reduction`,
:mod:`.linalg`, :mod:`.nn`, :mod:`.tensor`, :mod:`.view`, :mod:`.index`), each family with
its backward formulas (pieces several families share: :mod:`._grad`); ops whose local
computation depends on the chosen strategy take their kernels from :mod:`.shard_kernels`
(ring attention's, the attention ops' ring strategy, from :mod:`.ring`). The
strategy validator's sample calls of each family are in :mod:`.samples`.
"""

from __future__ import annotations

from . import index, linalg, nn, pointwise, reduction, tensor, view  # noqa: F401  (declare the ops)
from .table import (
    NOT_DIFFERENTIABLE,
    OPS,
    Backward,
    Operator,
    OpInfo,
    add_record,
    declare,
    get_op,
)

__all__ = [
    "NOT_DIFFERENTIABLE",
    "OPS",
    "Backward",
    "OpInfo",
    "Operator",
    "add_record",
    "declare",
    "get_op",
]
