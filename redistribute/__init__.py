"""redistribute: moving a distributed tensor from one placement list to another.

The pure half lives here: the planner (:mod:`redistribute.plan`), the cost model
(:mod:`redistribute.cost`) and plan rendering (:mod:`redistribute.explain`). The MPI half
(:mod:`redistribute.comm`, :mod:`redistribute.execute`) is imported explicitly by its users,
so importing this package never imports mpi4py.
"""

from __future__ import annotations

from .cost import (
    COMM_KINDS,
    CostModel,
    default_cost_model,
    plan_cost,
    set_default_cost_model,
    step_bytes,
    step_cost,
)
from .explain import explain_plan
from .plan import (
    AllGather,
    AllReduce,
    AllToAll,
    LocalChunk,
    PartitionPartial,
    ReduceScatter,
    Step,
    plan,
    redistribute_cost,
)

__all__ = [
    "COMM_KINDS",
    "AllGather",
    "AllReduce",
    "AllToAll",
    "CostModel",
    "LocalChunk",
    "PartitionPartial",
    "ReduceScatter",
    "Step",
    "default_cost_model",
    "explain_plan",
    "plan",
    "plan_cost",
    "redistribute_cost",
    "set_default_cost_model",
    "step_bytes",
    "step_cost",
]
