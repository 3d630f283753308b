"""``dt.nn.init``: PyTorch's parameter initialisations, the same global values on any layout.

Every function fills its tensor in place under ``no_grad`` and returns it, with PyTorch's
names, arguments, fan and gain computations (:func:`calculate_gain`). Random values come
from the mesh-aware random factories (``dt.rand_like``/``dt.randn_like``): counter-based
from each element's *global* index, so a DTensor's shard holds exactly its slice of what a
local tensor of the global shape gets for the same seed (``dt.manual_seed``), on any mesh
and any placements, and every rank draws the same counters (call the functions on every
rank in the same order). Fans are computed from the global shape. Nothing communicates.

:func:`trunc_normal_` is PyTorch's inverse-CDF method (a uniform draw mapped through the
inverse error function, then clamped), so no value depends on a rejection loop or on the
layout. The inverse error function is Giles's single-precision approximation
("Approximating the erfinv function", GPU Computing Gems, 2011; relative error below
4e-7 for the draws of a float32 tensor), composed of elementwise dt ops.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from placements.errors import ArgumentError

from ..distributed.factory import FACTORIES
from ..local.grad_engine import no_grad

__all__ = [
    "calculate_gain",
    "constant_",
    "kaiming_normal_",
    "kaiming_uniform_",
    "normal_",
    "ones_",
    "trunc_normal_",
    "uniform_",
    "xavier_normal_",
    "xavier_uniform_",
    "zeros_",
]

_LINEAR = ("linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
           "conv_transpose3d", "sigmoid")


def calculate_gain(nonlinearity: str, param: float | None = None) -> float:
    """The recommended gain for a nonlinearity (PyTorch's table): 1 for linear/conv/sigmoid,
    5/3 for tanh, sqrt(2) for relu, sqrt(2 / (1 + slope^2)) for leaky_relu (``param`` the
    negative slope, default 0.01), 3/4 for selu. **Local**.

    Raises
    ------
    ArgumentError
        An unknown nonlinearity or a slope that is not a number.
    """
    if nonlinearity in _LINEAR:
        return 1
    if nonlinearity == "tanh":
        return 5.0 / 3
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        if param is None:
            slope = 0.01
        elif isinstance(param, (int, float)) and not isinstance(param, bool):
            slope = param
        else:
            raise ArgumentError(f"negative_slope {param} not a valid number")
        return math.sqrt(2.0 / (1 + slope**2))
    if nonlinearity == "selu":
        return 3.0 / 4
    raise ArgumentError(f"Unsupported nonlinearity {nonlinearity}")


def _calculate_fan_in_and_fan_out(tensor: Any) -> tuple[int, int]:
    """``(fan_in, fan_out)`` of a weight of global shape ``(out, in, *receptive field)``."""
    shape = tuple(tensor.shape)
    if len(shape) < 2:
        raise ArgumentError(
            "Fan in and fan out can not be computed for tensor with fewer than 2 dimensions"
        )
    receptive = math.prod(shape[2:])
    return shape[1] * receptive, shape[0] * receptive


def _fan(tensor: Any, mode: str) -> int:
    mode = mode.lower()
    if mode not in ("fan_in", "fan_out"):
        raise ArgumentError(f"Mode {mode} not supported, please use one of ['fan_in', 'fan_out']")
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    return fan_in if mode == "fan_in" else fan_out


def _fill(tensor: Any, values: Any) -> Any:
    with no_grad():
        tensor.copy_(values)
    return tensor


def _draw(kind: str, tensor: Any) -> Any:
    """Random values laid out like ``tensor`` (``rand`` or ``randn``), of its dtype."""
    return FACTORIES[f"{kind}_like"](tensor)


def uniform_(tensor: Any, a: float = 0.0, b: float = 1.0) -> Any:
    """Fill ``tensor`` with values uniform in ``[a, b)``; returns it. **Local**."""
    return _fill(tensor, _draw("rand", tensor) * (b - a) + a)


def normal_(tensor: Any, mean: float = 0.0, std: float = 1.0) -> Any:
    """Fill ``tensor`` with values from N(mean, std^2); returns it. **Local**."""
    return _fill(tensor, _draw("randn", tensor) * std + mean)


def constant_(tensor: Any, val: float) -> Any:
    """Fill ``tensor`` with ``val``; returns it. **Local**."""
    with no_grad():
        tensor.fill_(val)
    return tensor


def ones_(tensor: Any) -> Any:
    """Fill ``tensor`` with ones; returns it. **Local**."""
    return constant_(tensor, 1.0)


def zeros_(tensor: Any) -> Any:
    """Fill ``tensor`` with zeros; returns it. **Local**."""
    with no_grad():
        tensor.zero_()
    return tensor


# Giles's erfinv: w = -log(1 - x^2); w < 5: p(w - 2.5), else q(sqrt(w) - 3); erfinv = x * p.
_ERFINV_CENTRAL = (2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06,
                   0.00021858087, -0.00125372503, -0.00417768164, 0.246640727, 1.50140941)
_ERFINV_TAIL = (-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844,
                0.00573950773, -0.0076224613, 0.00943887047, 1.00167406, 2.83297682)


def _horner(w: Any, coefs: tuple[float, ...]) -> Any:
    p = w * coefs[0] + coefs[1]
    for c in coefs[2:]:
        p = p * w + c
    return p


def _erfinv(x: Any) -> Any:
    """The inverse error function of ``x`` in [-1, 1], elementwise (±inf at ±1)."""
    w = -((1.0 - x) * (x + 1.0)).log()
    p = _horner(w - 2.5, _ERFINV_CENTRAL).where(w < 5.0, _horner(w.sqrt() - 3.0, _ERFINV_TAIL))
    return (p * x).where(x.abs() < 1.0, x * math.inf)


def trunc_normal_(tensor: Any, mean: float = 0.0, std: float = 1.0, a: float = -2.0,
                  b: float = 2.0) -> Any:
    """Fill ``tensor`` with values from N(mean, std^2) truncated to ``[a, b]``; returns it.

    **Local.** PyTorch's method: a uniform draw between the normal CDF's values at ``a``
    and ``b``, mapped through the inverse CDF, clamped to ``[a, b]``. Warns (as PyTorch)
    when ``mean`` is more than 2 std outside ``[a, b]``.
    """
    if mean < a - 2 * std or mean > b + 2 * std:
        warnings.warn(
            "mean is more than 2 std from [a, b] in nn.init.trunc_normal_. The distribution "
            "of values may be incorrect.",
            stacklevel=2,
        )
    lo = (1.0 + math.erf((a - mean) / std / math.sqrt(2.0))) / 2.0
    hi = (1.0 + math.erf((b - mean) / std / math.sqrt(2.0))) / 2.0
    x = _draw("rand", tensor) * (2.0 * (hi - lo)) + (2.0 * lo - 1.0)
    return _fill(tensor, (_erfinv(x) * (std * math.sqrt(2.0)) + mean).clamp(a, b))


def _xavier_std(tensor: Any, gain: float) -> float:
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    return gain * math.sqrt(2.0 / float(fan_in + fan_out))


def xavier_uniform_(tensor: Any, gain: float = 1.0) -> Any:
    """Glorot uniform: ``U(-t, t)`` with ``t = gain * sqrt(6 / (fan_in + fan_out))``;
    returns ``tensor``. **Local**.

    Raises
    ------
    ArgumentError
        A tensor of fewer than 2 dims.
    """
    bound = math.sqrt(3.0) * _xavier_std(tensor, gain)
    return uniform_(tensor, -bound, bound)


def xavier_normal_(tensor: Any, gain: float = 1.0) -> Any:
    """Glorot normal: ``N(0, std^2)`` with ``std = gain * sqrt(2 / (fan_in + fan_out))``;
    returns ``tensor``. **Local**.

    Raises
    ------
    ArgumentError
        A tensor of fewer than 2 dims.
    """
    return normal_(tensor, 0.0, _xavier_std(tensor, gain))


def _kaiming_std(tensor: Any, a: float, mode: str, nonlinearity: str) -> float | None:
    """``gain / sqrt(fan)``, or None (with PyTorch's warning) for a zero-element tensor."""
    if 0 in tuple(tensor.shape):
        warnings.warn("Initializing zero-element tensors is a no-op", stacklevel=3)
        return None
    return calculate_gain(nonlinearity, a) / math.sqrt(_fan(tensor, mode))


def kaiming_uniform_(tensor: Any, a: float = 0, mode: str = "fan_in",
                     nonlinearity: str = "leaky_relu") -> Any:
    """He uniform: ``U(-bound, bound)`` with ``bound = gain * sqrt(3 / fan)`` (``fan`` per
    ``mode``, ``gain = calculate_gain(nonlinearity, a)``); returns ``tensor``. **Local**.

    Raises
    ------
    ArgumentError
        A tensor of fewer than 2 dims, an unknown mode or nonlinearity.
    """
    std = _kaiming_std(tensor, a, mode, nonlinearity)
    if std is None:
        return tensor
    bound = math.sqrt(3.0) * std
    return uniform_(tensor, -bound, bound)


def kaiming_normal_(tensor: Any, a: float = 0, mode: str = "fan_in",
                    nonlinearity: str = "leaky_relu") -> Any:
    """He normal: ``N(0, std^2)`` with ``std = gain / sqrt(fan)``; returns ``tensor``.
    **Local**.

    Raises
    ------
    ArgumentError
        A tensor of fewer than 2 dims, an unknown mode or nonlinearity.
    """
    std = _kaiming_std(tensor, a, mode, nonlinearity)
    return tensor if std is None else normal_(tensor, 0.0, std)
