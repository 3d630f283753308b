"""``dt.nn.functional``: PyTorch's ``torch.nn.functional`` names over the op table.

Each function here *is* the public dispatching function of an op record (``dt.linear``,
``dt.layer_norm``...: :data:`dtensor.dispatch.entry_points.FUNCTIONS`), so it takes local
Tensors and DTensors alike, its sharding and its backward are the op's, and no op code
lives here. Their arguments are the records' (PyTorch's, less the deprecated
``size_average``/``reduce`` of the losses and the options the ops do not have, such as
``max_norm`` of ``embedding``); ``cross_entropy``'s options after ``weight`` are keyword
only. ``relu`` and ``silu`` add PyTorch's ``inplace`` flag.

``rms_norm`` and ``scaled_dot_product_attention`` look their op up when called: they work
in a build whose op table has those records and raise ``UnavailableError`` otherwise.
"""

from __future__ import annotations

from typing import Any

from placements.errors import UnavailableError

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


def relu(input: Any, inplace: bool = False) -> Any:
    """``max(x, 0)`` elementwise (``dt.relu``; ``inplace``: ``input.relu_()``). **Local**
    (elementwise on each shard of a DTensor)."""
    return input.relu_() if inplace else FUNCTIONS["relu"](input)


def silu(input: Any, inplace: bool = False) -> Any:
    """``x * sigmoid(x)`` elementwise (``dt.silu``; ``inplace``: written into ``input``).
    **Local** (elementwise on each shard of a DTensor)."""
    out = FUNCTIONS["silu"](input)
    return input.copy_(out) if inplace else out


def _op(name: str) -> Any:
    """The dispatching function of op ``name``, looked up now."""
    fn = FUNCTIONS.get(name)
    if fn is None:
        raise UnavailableError(f"dt.nn.functional.{name}: the op {name!r} is not in this build")
    return fn


def rms_norm(input: Any, normalized_shape: Any, weight: Any = None,
             eps: float | None = None) -> Any:
    """Root-mean-square normalisation over the trailing ``normalized_shape`` dims, scaled
    by ``weight`` (``dt.rms_norm``; ``eps`` None: the dtype's machine epsilon).
    **Collective** when a normalized dim is sharded, **Local** otherwise.

    Raises
    ------
    UnavailableError
        When the op table of this build has no ``rms_norm``.
    """
    return _op("rms_norm")(input, normalized_shape, weight, eps)


def scaled_dot_product_attention(query: Any, key: Any, value: Any, attn_mask: Any = None,
                                 dropout_p: float = 0.0, is_causal: bool = False,
                                 scale: float | None = None, enable_gqa: bool = False) -> Any:
    """``softmax(q k^T * scale + mask) v`` over the last two dims
    (``dt.scaled_dot_product_attention``, PyTorch's arguments). **Collective** when the op's
    sharding rule must move an input, **Local** otherwise (e.g. heads sharded).

    Raises
    ------
    UnavailableError
        When the op table of this build has no ``scaled_dot_product_attention``.
    """
    return _op("scaled_dot_product_attention")(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
        scale=scale, enable_gqa=enable_gqa,
    )
