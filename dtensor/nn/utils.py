"""``dt.nn.utils``: :func:`clip_grad_norm_` and :func:`get_total_norm` over the gradients of
local and distributed parameters."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from placements.errors import ArgumentError

from ..distributed.dtensor import DTensor
from ..local.factory import tensor as _tensor
from ..local.grad_engine import no_grad
from ..local.tensor import Tensor

__all__ = ["clip_grad_norm_", "get_total_norm"]


def _norm_of(g: Any, norm_type: float) -> float:
    """The ``norm_type``-norm of the whole (global) gradient ``g``, as a python float on
    every rank (**Collective** for a DTensor over its mesh).

    A DTensor's norm is reduced from its shards' (the sum of ``|g|^p`` or the largest
    ``|g|``: one reduction of a scalar, whatever the placements; a norm of the sharded
    tensor would gather it)."""
    a = g.detach().abs()
    if not isinstance(g, DTensor):
        n = a.amax() if math.isinf(norm_type) else g.detach().norm(norm_type)
        return float(n.numpy())
    if math.isinf(norm_type):
        return float(a.amax().full_tensor().numpy())
    s = (a * a if norm_type == 2 else a ** norm_type).sum(dtype=np.float64)
    return float(s.full_tensor().numpy()) ** (1.0 / norm_type)


def _norm_dtype(tensors: list) -> np.dtype:
    """The dtype of a total norm of ``tensors``, as PyTorch's: float64 when a tensor is
    float64, else float32 (also for none, integer and half-precision tensors)."""
    return np.dtype(np.float64 if any(t.dtype == np.float64 for t in tensors) else np.float32)


def get_total_norm(tensors: Iterable[Any] | Any, norm_type: float = 2.0,
                   error_if_nonfinite: bool = False) -> Tensor:
    """The ``norm_type``-norm of all ``tensors`` together (as if concatenated), as a 0-d
    local Tensor holding the same value on every rank: float64 when a tensor is float64,
    else float32.

    **Collective** when a tensor is a DTensor: every rank of its mesh must call it (the
    norm of each DTensor is reduced over its mesh; tensors on different meshes are
    allowed). An empty list gives 0.

    Raises
    ------
    ArgumentError
        For a ``norm_type`` that is not a positive number or inf, or, with
        ``error_if_nonfinite``, when the total is nan or inf.
    """
    if isinstance(tensors, (Tensor, DTensor)):
        tensors = [tensors]
    tensors = list(tensors)
    p = float(norm_type)
    if not (p > 0 or math.isinf(p)) or math.isnan(p):
        raise ArgumentError(f"get_total_norm: norm_type must be positive or inf, got {norm_type}")
    norms = [_norm_of(t, p) for t in tensors]
    if not norms:
        total = 0.0
    elif math.isinf(p):
        total = max(norms)
    else:
        total = float(np.sum(np.float64(norms) ** p) ** (1.0 / p))
    if error_if_nonfinite and not math.isfinite(total):
        raise ArgumentError(
            f"get_total_norm: the total norm of order {norm_type} of the gradients is "
            f"{total}; the gradients can not be clipped (error_if_nonfinite=True)"
        )
    return _tensor(_norm_dtype(tensors).type(total))


def clip_grad_norm_(parameters: Iterable[Any] | Any, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> Tensor:
    """Scale the gradients of ``parameters`` in place so that their total norm (as if all
    were one vector) is at most ``max_norm``, as PyTorch's ``torch.nn.utils.
    clip_grad_norm_``: each gradient is multiplied by ``min(1, max_norm / (total + 1e-6))``
    (NaN when the total norm is NaN, as PyTorch's clamp gives).
    Parameters without a gradient are skipped; ``foreach`` is accepted and ignored.

    **Collective** when a gradient is a DTensor (see :func:`get_total_norm`); the scaling
    itself moves no data (each rank scales its local shard or Partial contribution, so
    gradients of any placements, ``P(max)`` and ``P(min)`` included, are clipped).

    Returns
    -------
    Tensor
        The total norm before clipping, a 0-d local Tensor (float64 when a gradient is
        float64, else float32), the same on every rank.
    """
    if isinstance(parameters, (Tensor, DTensor)):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    total = get_total_norm(grads, norm_type, error_if_nonfinite)
    # the coefficient in the norm's precision, as PyTorch's (a float32 norm rounds it)
    kind = _norm_dtype(grads).type
    coef = float(kind(max_norm) / (kind(total.numpy()) + kind(1e-6)))
    # Note: PyTorch clamps with a NaN-propagating min, so a NaN norm scales every gradient
    # by NaN (python's min(1.0, nan) is 1.0 and would leave them unchanged).
    if not coef >= 1.0:
        with no_grad():
            for g in grads:
                # every shard and every Partial contribution (sum, avg, max, min alike) scales
                # by one positive factor: local whatever the placements (a dispatched mul_
                # finds no rule that keeps P(max) or P(min) under a scalar of unknown sign)
                (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
    return total
