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
scaled_dot_product_attention = FUNCTIONS["scaled_dot_product_attention"]


def relu(input: Any, inplace: bool = False) -> Any:
    """``max(x, 0)`` elementwise (``dt.relu``; ``inplace``: ``input.relu_()``). **Local**
    (elementwise on each shard of a DTensor)."""
    return input.relu_() if inplace else FUNCTIONS["relu"](input)


def silu(input: Any, inplace: bool = False) -> Any:
    """``x * sigmoid(x)`` elementwise (``dt.silu``; ``inplace``: written into ``input``).
    **Local** (elementwise on each shard of a DTensor)."""
    out = FUNCTIONS["silu"](input)
    return input.copy_(out) if inplace else out
