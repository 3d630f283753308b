"""The whole model's state of a pipelined model, for ``dt.save`` (and so for loading into
any other strategy).

Each stage module of :func:`dtensor.pipelining.pipeline_split` keeps full parameter names,
so *loading* needs nothing new: ``dt.load(stage.submod.state_dict(), path)`` on every rank
fills each stage from a checkpoint of any strategy (each rank asks for its own keys).
*Saving* needs every rank to pass the same structure to ``dt.save``: :func:`full_state_dict`
gathers it, every tensor whole on every rank (the memory of the whole model, as a
``full_state_dict`` of FSDP does).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from placements.errors import PipelineError

from ..distributed.dtensor import DTensor
from ..local.factory import from_numpy
from ..local.tensor import Tensor
from ._runtime import PipelineStage, _np_dtype

__all__ = ["full_state_dict"]


def full_state_dict(stages: PipelineStage | Sequence[PipelineStage]) -> dict[str, Tensor]:
    """The state of the whole model (every stage's parameters and buffers, under their full
    names, in the same order on every rank) as local Tensors on every rank. **Collective** over the pp mesh
    of ``stages`` (this rank's stages) and over the meshes of the stages' DTensors (their
    ``full_tensor``).

    Tied parameters appear under each of their names (as in the model's own
    ``state_dict``). Pass the result to ``dt.save`` on every rank.

    Raises
    ------
    PipelineError
        No stages, stages on different pp meshes.
    """
    stages = [stages] if isinstance(stages, PipelineStage) else list(stages)
    if not stages or any(s.comm is not stages[0].comm for s in stages):
        raise PipelineError("full_state_dict: needs this rank's PipelineStages, on one pp mesh")
    comm = stages[0].comm
    mine: list[tuple[str, np.ndarray]] = []
    for st in sorted(stages, key=lambda s: s.stage_index):
        for name, t in st.submod.state_dict().items():
            t = t.full_tensor() if isinstance(t, DTensor) else t
            mine.append((name, np.ascontiguousarray(t.numpy())))
    index = json.dumps([[n, str(a.dtype), list(a.shape)] for n, a in mine]).encode()
    sizes = comm.allgather_ints([len(index)], what="full_state_dict")[:, 0]
    out: dict[str, Tensor] = {}
    per_rank = []
    for r in range(comm.size):
        blob = np.frombuffer(index, np.uint8).copy() if r == comm.rank else np.empty(
            int(sizes[r]), np.uint8)
        comm.bcast_array(blob, root=r, what="full_state_dict names")
        per_rank.append(json.loads(blob.tobytes().decode()))
    arrays = dict(mine)
    first_stage = {r: min(s for s in range(stages[0].num_stages) if s % comm.size == r)
                   for r in range(comm.size)}
    for r in sorted(range(comm.size), key=lambda q: first_stage[q]):
        for name, dtype, shape in per_rank[r]:
            arr = arrays[name] if r == comm.rank else np.empty(shape, _np_dtype(dtype))
            comm.bcast_array(arr, root=r, what=f"full_state_dict {name}")
            out.setdefault(name, from_numpy(arr))
    return out
