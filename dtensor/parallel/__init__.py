"""``dt.parallel``: tensor and sequence parallelism of ``dt.nn`` modules (PyTorch's
``torch.distributed.tensor.parallel``): :func:`parallelize_module` with the styles
:class:`ColwiseParallel`, :class:`RowwiseParallel`, :class:`SequenceParallel`,
:class:`PrepareModuleInput` and :class:`PrepareModuleOutput`, and :func:`loss_parallel`;
:func:`distribute_module` (parameters laid out by a function, the collectives left to the
dispatcher);
fully sharded data parallelism (FSDP2): :func:`fully_shard` with
:class:`MixedPrecisionPolicy`; data parallelism with bucketed gradient all-reduces,
:func:`replicate` (PyTorch's composable DDP). ``dtensor`` exports them all
(``dt.parallelize_module``...)."""

from __future__ import annotations

from ._api import distribute_module, parallelize_module
from ._fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from ._loss import loss_parallel
from ._replicate import replicate
from ._style import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = [
    "ColwiseParallel",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
    "distribute_module",
    "fully_shard",
    "loss_parallel",
    "parallelize_module",
    "replicate",
]
