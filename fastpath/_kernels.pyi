"""Type stubs of fastpath._kernels (compiled local kernels for float32/float64 host arrays)."""

from collections.abc import Callable
from typing import Any, TypeAlias

__all__ = ["Unary", "adam_step", "fast_path", "gelu_backward", "layer_norm",
           "layer_norm_backward", "reduce_lastdim", "short_binary", "softmax_lastdim"]

class Unary:
    """An elementwise compiled loop (relu, erf, gelu, gelu_tanh) with its array-module twin."""

    name: str
    fallback: Callable[[Any, Any], Any]
    def __init__(self, kind: str, fallback: Callable[[Any, Any], Any]) -> None: ...
    def __call__(self, a: Any, out: Any = None) -> Any: ...

_Alloc: TypeAlias = Callable[[tuple[int, ...], Any, Any], Any]

def softmax_lastdim(a: Any, take_log: bool, alloc: _Alloc | None = None) -> Any | None: ...
def layer_norm(
    a: Any, normalized_shape: Any, weight: Any, bias: Any, eps: float,
    alloc: _Alloc | None = None,
) -> Any | None: ...
def reduce_lastdim(
    op: str, a: Any, dim: Any, keepdim: bool, dtype: Any, alloc: _Alloc | None = None
) -> Any | None: ...

def fast_path(fast: frozenset[Any], limit: int, a: Any, b: Any = None) -> bool: ...
def short_binary(ufunc: Any, fast: frozenset[Any], limit: int, a: Any, b: Any) -> Any | None: ...

def gelu_backward(grad: Any, a: Any, tanh_form: bool, alloc: _Alloc | None = None) -> Any | None: ...
def layer_norm_backward(
    grad: Any, a: Any, weight: Any, n: int, eps: float, want_weight: bool,
    alloc: _Alloc | None = None,
) -> tuple[Any, Any] | None: ...
def adam_step(
    p: Any, grad: Any, exp_avg: Any, exp_avg_sq: Any, sign: float, l2: float, decay: float,
    beta1: float, beta2: float, step: float, bc2_sqrt: float, eps: float,
) -> bool: ...
