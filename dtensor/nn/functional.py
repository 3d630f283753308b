"""``dt.nn.functional``: PyTorch's ``torch.nn.functional`` names over the op table.

Each function here *is* the public dispatching function of an op record (``dt.linear``,
``dt.layer_norm``...: :data:`dtensor.dispatch.entry_points.FUNCTIONS`), so it takes local
Tensors and DTensors alike, its sharding and its backward are the op's, and no op code
lives here. Their arguments are the records' (PyTorch's, less the deprecated
``size_average``/``reduce`` of the losses and the options the ops do not have, such as
``max_norm`` of ``embedding``); ``cross_entropy``'s options after ``weight`` are keyword
only. ``relu`` and ``silu`` add PyTorch's ``inplace`` flag;
``scaled_dot_product_attention`` takes local shards inside ``dt.context_parallel``.
"""

from __future__ import annotations

from typing import Any

from placements import Shard
from placements.errors import ArgumentError

from ..dispatch.entry_points import FUNCTIONS
from ..distributed.dtensor import DTensor
from ..local.tensor import Tensor
from ..ops import ring

__all__ = [
    "cross_entropy",
    "dropout",
    "embedding",
    "gelu",
    "layer_norm",
    "linear",
    "log_softmax",
    "mse_loss",
    "relu",
    "rms_norm",
    "scaled_dot_product_attention",
    "silu",
    "softmax",
]

linear = FUNCTIONS["linear"]
embedding = FUNCTIONS["embedding"]
layer_norm = FUNCTIONS["layer_norm"]
dropout = FUNCTIONS["dropout"]
gelu = FUNCTIONS["gelu"]
softmax = FUNCTIONS["softmax"]
log_softmax = FUNCTIONS["log_softmax"]
cross_entropy = FUNCTIONS["cross_entropy"]
mse_loss = FUNCTIONS["mse_loss"]
rms_norm = FUNCTIONS["rms_norm"]
_sdpa = FUNCTIONS["scaled_dot_product_attention"]


def scaled_dot_product_attention(query: Any, key: Any, value: Any, attn_mask: Any = None,
                                 dropout_p: float = 0.0, is_causal: bool = False,
                                 scale: float | None = None, enable_gqa: bool = False) -> Any:
    """``dt.scaled_dot_product_attention`` (the op record's: on ``Shard(seq)`` query, key
    and value DTensors its rule's ring attention strategy, :mod:`dtensor.ring_attention`),
    except that local Tensors inside ``dt.context_parallel`` are this rank's shards of the
    context's sequence: they are wrapped as ``Shard(seq)`` DTensors on the context's mesh
    for the op, and the result's shard returned. **Local**, or **Collective** over the
    mesh when sharded (as the op).

    Raises
    ------
    ArgumentError
        Inside ``dt.context_parallel``, local Tensors whose sequence length is not this
        rank's shard's, or a call the ring does not take (a mask, dropout, query, key and
        value of different batch shapes).
    """
    ctx = ring.context()
    if ctx is None or not all(isinstance(a, Tensor) and not isinstance(a, DTensor)
                              for a in (query, key, value)):
        return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    mesh = ctx.mesh
    n, r = mesh.size(0), mesh.get_local_rank(0)
    want = ring.runs_len(ring.sequence_positions(ctx.seq_len, n, r, True))
    for name, a in (("query", query), ("key", key), ("value", value)):
        have = a.shape[-2] if a.ndim >= 2 else 0
        if a.ndim < 2 or have != want:
            raise ArgumentError(
                f"context_parallel: the attention's {name} has {have} positions on rank "
                f"{r}, this rank's shard of the sequence of {ctx.seq_len} holds {want} "
                f"(mesh {tuple(mesh.shape)})")
    if attn_mask is not None or dropout_p != 0 or not (
            query.ndim == key.ndim == value.ndim
            and tuple(query.shape[:-2]) == tuple(key.shape[:-2]) == tuple(value.shape[:-2])):
        raise ArgumentError(
            f"context_parallel: ring attention takes no attn_mask and no dropout, and "
            f"query, key and value of one batch and head shape; got attn_mask "
            f"{'None' if attn_mask is None else tuple(attn_mask.shape)}, dropout_p "
            f"{dropout_p}, shapes {[tuple(a.shape) for a in (query, key, value)]}")
    pl = [Shard(query.ndim - 2)]
    d = [DTensor.from_local(a, mesh, pl, shape=(*a.shape[:-2], ctx.seq_len, a.shape[-1]))
         for a in (query, key, value)]
    return _sdpa(*d, None, 0.0, is_causal, scale, enable_gqa).to_local()


def relu(input: Any, inplace: bool = False) -> Any:
    """``max(x, 0)`` elementwise (``dt.relu``; ``inplace``: ``input.relu_()``). **Local**
    (elementwise on each shard of a DTensor)."""
    return input.relu_() if inplace else FUNCTIONS["relu"](input)


def silu(input: Any, inplace: bool = False) -> Any:
    """``x * sigmoid(x)`` elementwise (``dt.silu``; ``inplace``: written into ``input``).
    **Local** (elementwise on each shard of a DTensor)."""
    out = FUNCTIONS["silu"](input)
    return input.copy_(out) if inplace else out
