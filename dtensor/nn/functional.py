"""``dt.nn.functional``: PyTorch's ``torch.nn.functional`` names over the op table.

Each function here *is* the public dispatching function of an op record (``dt.linear``,
``dt.layer_norm``...: :data:`dtensor.dispatch.entry_points.FUNCTIONS`), so it takes local
Tensors and DTensors alike, its sharding and its backward are the op's, and no op code
lives here. Their arguments are the records' (PyTorch's, less the deprecated
``size_average``/``reduce`` of the losses and the options the ops do not have, such as
``max_norm`` of ``embedding``); ``cross_entropy``'s options after ``weight`` are keyword
only. ``relu`` and ``silu`` add PyTorch's ``inplace`` flag.
"""

from __future__ import annotations

from typing import Any

from ..dispatch.entry_points import FUNCTIONS

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
_ATTENTION_PLUG: Any = None


def set_attention_plug(fn: Any) -> None:
    """Plug in ``fn``, called with :func:`scaled_dot_product_attention`'s arguments before
    the op: its result, or NotImplemented to run the op (``dtensor.ring_attention`` plugs in
    ring attention here at import). **Local**."""
    global _ATTENTION_PLUG
    _ATTENTION_PLUG = fn


def scaled_dot_product_attention(query: Any, key: Any, value: Any, attn_mask: Any = None,
                                 dropout_p: float = 0.0, is_causal: bool = False,
                                 scale: float | None = None, enable_gqa: bool = False) -> Any:
    """``dt.scaled_dot_product_attention`` (the op record's), except that query, key and
    value DTensors sharded on their sequence dim (dim -2) run ring attention, and so do
    local Tensors inside ``dt.context_parallel`` (:mod:`dtensor.ring_attention`).
    **Local**, or **Collective** over the mesh when sharded (as the op, or the ring)."""
    if _ATTENTION_PLUG is not None:
        out = _ATTENTION_PLUG(query, key, value, attn_mask, dropout_p, is_causal, scale,
                              enable_gqa)
        if out is not NotImplemented:
            return out
    return FUNCTIONS["scaled_dot_product_attention"](query, key, value, attn_mask, dropout_p,
                                                     is_causal, scale, enable_gqa)


def relu(input: Any, inplace: bool = False) -> Any:
    """``max(x, 0)`` elementwise (``dt.relu``; ``inplace``: ``input.relu_()``). **Local**
    (elementwise on each shard of a DTensor)."""
    return input.relu_() if inplace else FUNCTIONS["relu"](input)


def silu(input: Any, inplace: bool = False) -> Any:
    """``x * sigmoid(x)`` elementwise (``dt.silu``; ``inplace``: written into ``input``).
    **Local** (elementwise on each shard of a DTensor)."""
    out = FUNCTIONS["silu"](input)
    return input.copy_(out) if inplace else out
