"""The op table's entries: every op of the local tensor, with its kernel, how its arguments
bind, its decision-relevant static arguments and its sharding rule.

Each :class:`~dtensor.ops.table.OpInfo` is built here (at import) from the local kernel:
plain functions (``dtensor.local.kernels``) give their parameters by signature, keyword-only ones
are passed by a small adapter (the dispatcher calls ``kernel(*values_in_params_order)``);
Tensor methods with varargs (``view(*shape)``...) are described by hand.

Some ops compute differently on a shard than on the whole tensor; their ``local_fn``
returns, once per propagation-cache entry, the kernel to run for the chosen strategy
(it may read this rank's mesh coordinate from ``strategy.output_specs[0].mesh``):

- ``mean`` (and ``mse_loss(reduction='mean')``): the local sum times ``1 / N_global``, so
  a ``P(sum)`` of it is exact on uneven and empty shards;
- ``amax``/``amin``/``max``/``min`` over a sharded dim: an empty local shard contributes
  the reduction's identity (-inf / +inf, or the dtype's extremes) instead of raising;
- ``view``/``reshape``/``unflatten``/``expand``/``expand_as``/``squeeze``: the local
  kernel receives the LOCAL output shape (or explicit squeeze dims);
- ``embedding`` with a row-sharded weight: indices outside the local rows are masked to
  zero and the others shifted (PyTorch's MaskPartial), giving a ``P(sum)`` output;
- ``dropout`` on a sharded input: the mask is drawn for the global tensor's counters at
  the shard's global offsets, so the result equals the single-device one.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import numpy as np

from placements.errors import ArgumentError
from placements.layout import local_offsets, local_shape
from placements.rules import OpSchema, OpStrategy
from placements.rules._core import norm_dims

from ..local import kernels as _math
from ..local import rng as _random
from ..local.backend import array_module_of
from ..local.kernels import nn as _math_nn
from ..local.tensor import Tensor, _wrap
from .table import OPS as _OPS
from .table import OpInfo, register_op

__all__: list[str] = []

_KIND = inspect.Parameter


def _adapter(fn: Callable, npos: int, kwonly: tuple[str, ...]) -> Callable:
    """``kernel(*values)`` calling ``fn(*values[:npos], **{kwonly: values[npos:]})``."""
    if len(kwonly) == 1:
        (name,) = kwonly

        def kernel1(*values):
            return fn(*values[:npos], **{name: values[npos]})

        kernel1.__name__ = kernel1.__qualname__ = getattr(fn, "__name__", "kernel")
        return kernel1

    def kernel(*values):
        return fn(*values[:npos], **dict(zip(kwonly, values[npos:])))

    kernel.__name__ = kernel.__qualname__ = getattr(fn, "__name__", "kernel")
    return kernel


def _fn(
    name: str,
    fn: Callable,
    tensors: tuple[str, ...] = ("input",),
    static: tuple[str, ...] = (),
    *,
    sig: Callable | None = None,
    rule: str = "",
    variadic: str | None = None,
    local_fn: Callable | None = None,
    inplace: bool = False,
) -> None:
    """Register ``fn`` under ``name``; parameters and defaults come from the signature of
    ``sig`` (default ``fn``), keyword-only parameters through an adapter, ``out`` dropped."""
    params: list[str] = []
    defaults: dict[str, object] = {}
    kwonly: list[str] = []
    for p in inspect.signature(sig or fn).parameters.values():
        if p.name == "out":
            continue
        if p.kind == _KIND.VAR_POSITIONAL:
            if p.name != variadic:
                raise TypeError(f"op table: {name}'s *{p.name} needs a hand-written entry")
        elif p.kind == _KIND.KEYWORD_ONLY:
            kwonly.append(p.name)
        params.append(p.name)
        if p.default is not p.empty:
            defaults[p.name] = p.default
    kernel = _adapter(fn, len(params) - len(kwonly), tuple(kwonly)) if kwonly else fn
    register_op(
        OpInfo(name, kernel, tuple(params), tensors, static, defaults, rule, variadic, local_fn,
               inplace)
    )


def _method(
    name: str,
    kernel: Callable,
    params: tuple[str, ...],
    static: tuple[str, ...] = (),
    defaults: dict | None = None,
    tensors: tuple[str, ...] = ("input",),
    local_fn: Callable | None = None,
    inplace: bool = False,
) -> None:
    """Register a Tensor method (or a hand-described kernel)."""
    register_op(
        OpInfo(name, kernel, params, tensors, static, defaults or {}, "", None, local_fn,
               inplace)
    )


# -- strategy-dependent local kernels ---------------------------------------------------------
def _coord(strategy: OpStrategy) -> tuple[int, ...]:
    return strategy.output_specs[0].mesh.get_coordinate()


def _local_out_shape(strategy: OpStrategy) -> tuple[int, ...]:
    return strategy.output_specs[0].local_shape(_coord(strategy))


def _filled(like: Tensor, shape: tuple[int, ...], value: object, dtype: np.dtype) -> Tensor:
    """A new tensor of ``shape`` filled with ``value``, on ``like``'s array module."""
    return _wrap(array_module_of(like._arr).full(shape, value, dtype))


def _scaled_sum(total: Callable, n_global: int, out_dtype: np.dtype) -> Callable:
    """A kernel returning ``total(*values) / n_global`` in ``out_dtype``; its ``scale``
    attribute is the factor (the compiled front computes ``mean`` from it)."""
    inv = 1.0 / n_global if n_global else math.nan

    def kernel(*values):
        arr = total(*values)._arr  # a fresh array (0-d for a full reduction): scaled in place
        arr *= inv
        return _wrap(arr.astype(out_dtype, copy=False))

    kernel.scale = inv
    return kernel


def _mean_local(schema: OpSchema, strategy: OpStrategy) -> Callable:
    """mean: the local sum divided by the GLOBAL count of reduced elements."""
    rt = strategy.output_specs[0].dtype
    acc = np.dtype(np.float32) if rt == np.float16 else rt
    shape = schema.args[0].shape
    axes = norm_dims("mean", schema.get("dim"), len(shape))

    def total(input, dim, keepdim, dtype):
        return _math.sum(input, dim, keepdim, dtype=acc)

    return _scaled_sum(total, math.prod(shape[d] for d in axes), rt)


def _mse_local(schema: OpSchema, strategy: OpStrategy) -> Callable:
    """mse_loss(reduction='mean'): the local sum divided by the GLOBAL element count."""
    if schema.get("reduction", "mean") != "mean":
        return _math.mse_loss
    n = math.prod(np.broadcast_shapes(schema.args[0].shape, schema.args[1].shape))

    def total(input, target, reduction):
        return _math.mse_loss(input, target, "sum")

    return _scaled_sum(total, n, strategy.output_specs[0].dtype)


def _identity(kind: str, dtype: np.dtype) -> object:
    """The identity of a ``max`` (or ``min``) reduction in ``dtype``."""
    if dtype.kind == "b":
        return kind != "max"
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return info.min if kind == "max" else info.max
    return -np.inf if kind == "max" else np.inf


def _extreme_local(schema: OpSchema, strategy: OpStrategy) -> Callable:
    """amax/amin/max/min over a sharded dim: an empty local block gives the identity."""
    kernel = _OPS_KERNEL[schema.op]
    shape = schema.args[0].shape
    dim = schema.get("dim")
    if schema.op in ("max", "min") and dim is not None:
        return kernel  # (values, indices) along an unsharded dim
    axes = norm_dims(schema.op, dim, len(shape))
    if not any(p.is_shard() and p.dim in axes for p in strategy.input_placements[0]):
        return kernel
    out_shape = _local_out_shape(strategy)
    dtype = strategy.output_specs[0].dtype
    fill = _identity("max" if schema.op in ("amax", "max") else "min", dtype)

    def local(input, *rest):
        if any(input.shape[d] == 0 for d in axes):
            return _filled(input, out_shape, fill, dtype)
        return kernel(input, *rest)

    return local


def _shape_local(param: str) -> Callable:
    """local_fn of a view-like op whose ``param`` is the output shape: pass the local one."""

    def local_fn(schema: OpSchema, strategy: OpStrategy) -> Callable:
        kernel = _OPS_KERNEL[schema.op]
        if not strategy.output_specs[0].is_sharded():
            return kernel
        shape = _local_out_shape(strategy)
        if schema.op == "unflatten":  # the local sizes of the split dim
            d = schema.get("dim") % len(schema.args[0].shape)
            shape = shape[d : d + len(tuple(schema.get("sizes")))]
        idx = _OPS_PARAMS[schema.op].index(param)

        def local(*values):
            values = list(values)
            values[idx] = shape
            return kernel(*values)

        return local

    return local_fn


def _expand_as_local(schema: OpSchema, strategy: OpStrategy) -> Callable:
    """expand_as: expand to the local output shape (``other`` gives metadata only)."""
    shape = _local_out_shape(strategy)

    def local(input, other):
        return input.expand(shape)

    return local


def _squeeze_local(schema: OpSchema, strategy: OpStrategy) -> Callable:
    """squeeze: drop the GLOBAL size-1 dims only (a shard may have other size-1 dims)."""
    shape = schema.args[0].shape
    dim = schema.get("dim")
    cands = range(len(shape)) if dim is None else {
        d % len(shape) for d in (dim if isinstance(dim, (tuple, list)) else (dim,))
    }
    dims = tuple(sorted(d for d in cands if shape[d] == 1))

    def local(input, dim):
        return input.squeeze(dims)

    return local


def _embedding_local(schema: OpSchema, strategy: OpStrategy) -> Callable:
    """Row-sharded weight: local rows only, other indices give zeros (``P(sum)`` output);
    an index outside the GLOBAL rows raises as the unsharded embedding does."""
    w = schema.args[1]
    target = strategy.input_placements[1]
    if not any(p.is_shard(0) for p in target):
        return _math.embedding
    coord = _coord(strategy)
    start = local_offsets(w.shape, schema.mesh_shape, target, coord)[0]
    rows = local_shape(w.shape, schema.mesh_shape, target, coord)[0]
    out_shape = _local_out_shape(strategy)

    def local(input, weight, padding_idx):
        idx = input._arr
        _math_nn.check_index_range(idx, w.shape[0])
        outside = (idx < start) | (idx >= start + rows)
        if rows == 0:
            return _filled(weight, out_shape, 0, weight.dtype)
        shifted = idx - start
        shifted[outside] = 0
        out = _math.embedding(_wrap(shifted), weight)._arr
        out[outside] = 0
        return _wrap(out)

    return local


def _dropout_local(schema: OpSchema, strategy: OpStrategy) -> Callable:
    """Sharded dropout: the mask of the global counters at this shard's global offsets."""
    spec = strategy.output_specs[0]
    if not schema.get("training", True) or not spec.is_sharded():
        return _math.dropout
    coord = _coord(strategy)
    starts = spec.local_offsets(coord)
    numel = spec.numel()

    def local(input, p, training, inplace):
        if not 0.0 <= p <= 1.0:
            raise ArgumentError(f"dropout probability has to be between 0 and 1, but got {p}")
        a = _math_nn._float_input("dropout", input)
        if p == 0:
            return input
        seed, offset = _random._reserve(numel)
        out = a if inplace else None
        r = _math_nn._dropout_apply(a, p, seed, offset, spec.shape, starts, out=out)
        return input if inplace else _wrap(r)

    return local


# -- the table ---------------------------------------------------------------------------------
_UNARY = (
    "neg", "abs", "exp", "expm1", "log", "log1p", "log2", "sqrt", "rsqrt", "sin", "cos", "tan",
    "tanh", "sigmoid", "erf", "reciprocal", "relu", "silu", "sign", "floor", "ceil", "trunc",
    "logical_not", "isnan", "isinf", "isfinite", "bitwise_not", "square", "positive", "round",
    "gelu", "softplus",
)
_BINARY = (
    "add", "sub", "mul", "floor_divide", "remainder", "fmod", "pow", "maximum", "minimum",
    "atan2", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor",
    "bitwise_and", "bitwise_or", "bitwise_xor",
)
_REDUCE_STATIC = {
    "sum": ("dim", "keepdim", "dtype"), "prod": ("dim", "keepdim", "dtype"),
    "amax": ("dim", "keepdim"), "amin": ("dim", "keepdim"), "max": ("dim", "keepdim"),
    "min": ("dim", "keepdim"), "argmax": ("dim", "keepdim"), "argmin": ("dim", "keepdim"),
    "var": ("dim", "keepdim"), "std": ("dim", "keepdim"), "norm": ("dim", "keepdim", "dtype"),
    "any": ("dim", "keepdim"), "all": ("dim", "keepdim"), "logsumexp": ("dim", "keepdim"),
    "cumsum": ("dim", "dtype"), "cumprod": ("dim", "dtype"), "count_nonzero": ("dim",),
}
_EXTREMES = ("amax", "amin", "max", "min")


def _register() -> None:
    m = _math
    for name in _UNARY:
        _fn(name, getattr(m, name))
    _fn("leaky_relu", m.leaky_relu, static=("negative_slope",))
    for name in _BINARY:
        _fn(name, getattr(m, name), ("input", "other"))
    _fn("div", m.div, ("input", "other"), ("rounding_mode",))
    _fn("where", m.where, ("condition", "input", "other"))
    for name in ("clamp", "clip"):
        _fn(name, getattr(m, name), ("input", "min", "max"))
    _fn("lerp", m.lerp, ("input", "end", "weight"))
    for name in ("addcmul", "addcdiv"):
        _fn(name, getattr(m, name), ("input", "tensor1", "tensor2"))
    # in-place forms: the out-of-place signature, the in-place kernel
    for name, kernel in m._INPLACE.items():
        info = _OPS[name[:-1]]
        _fn(name, kernel, info.tensor_params, info.static_params, sig=getattr(m, name[:-1]),
            inplace=True)
    # reductions and scans
    for name, static in _REDUCE_STATIC.items():
        _fn(name, getattr(m, name), static=static,
            local_fn=_extreme_local if name in _EXTREMES else None)
    _fn("mean", m.mean, static=("dim", "keepdim", "dtype"), local_fn=_mean_local)
    # products
    _fn("matmul", m.matmul, ("input", "other"))
    _fn("mm", m.mm, ("input", "mat2"))
    _fn("bmm", m.bmm, ("input", "mat2"))
    _fn("dot", m.dot, ("input", "other"))
    _fn("outer", m.outer, ("input", "vec2"))
    _fn("addmm", m.addmm, ("input", "mat1", "mat2"))
    _fn("linear", m.linear, ("input", "weight", "bias"))
    _fn("einsum", m.einsum, ("operands",), ("equation",), variadic="operands")
    # joining and copies
    for name in ("cat", "concat", "stack"):
        _fn(name, getattr(m, name), ("tensors",), ("dim",), variadic="tensors")
    _fn("flip", m.flip, static=("dims",))
    _fn("roll", m.roll, static=("dims",))
    _fn("tril", m.tril)
    _fn("triu", m.triu)
    _method("repeat", m.repeat, ("input", "sizes"), ("sizes",))
    _fn("tile", m.tile, static=("dims",))
    # nn
    for name in ("softmax", "log_softmax"):
        _fn(name, getattr(m, name), static=("dim", "dtype"))
    _fn("layer_norm", m.layer_norm, ("input", "weight", "bias"), ("normalized_shape",))
    _fn("embedding", m.embedding, ("input", "weight"), local_fn=_embedding_local)
    _fn("cross_entropy", m.cross_entropy, ("input", "target", "weight"), ("reduction",))
    _fn("mse_loss", m.mse_loss, ("input", "target"), ("reduction",), local_fn=_mse_local)
    _fn("dropout", m.dropout, static=("training",), local_fn=_dropout_local)
    # casts
    _method("to", lambda input, dtype: input.to(dtype), ("input", "dtype"), ("dtype",))
    _method("type_as", Tensor.type_as, ("input", "other"), tensors=("input", "other"))
    for name in ("float", "double", "half", "int", "long", "short", "char", "byte", "bool"):
        _method(name, getattr(Tensor, name), ("input",))
    for name in ("clone", "contiguous", "detach"):
        _method(name, getattr(Tensor, name), ("input",))
    _method("copy_", Tensor.copy_, ("input", "src"), tensors=("input", "src"), inplace=True)
    _method("fill_", Tensor.fill_, ("input", "value"), tensors=("input", "value"), inplace=True)
    _method("zero_", Tensor.zero_, ("input",), inplace=True)
    # views
    for name in ("view", "reshape"):
        _method(name, getattr(Tensor, name), ("input", "shape"), ("shape",),
                local_fn=_shape_local("shape"))
    _method("expand", Tensor.expand, ("input", "sizes"), ("sizes",),
            local_fn=_shape_local("sizes"))
    _method("expand_as", Tensor.expand_as, ("input", "other"), tensors=("input", "other"),
            local_fn=_expand_as_local)
    _method("flatten", Tensor.flatten, ("input", "start_dim", "end_dim"),
            ("start_dim", "end_dim"), {"start_dim": 0, "end_dim": -1})
    _method("unflatten", Tensor.unflatten, ("input", "dim", "sizes"), ("dim", "sizes"),
            local_fn=_shape_local("sizes"))
    _method("permute", Tensor.permute, ("input", "dims"), ("dims",))
    for name in ("transpose", "swapaxes", "swapdims"):
        _method(name, getattr(Tensor, name), ("input", "dim0", "dim1"), ("dim0", "dim1"))
    _method("t", Tensor.t, ("input",))
    for name in ("movedim", "moveaxis"):
        _method(name, getattr(Tensor, name), ("input", "source", "destination"),
                ("source", "destination"))
    _method("squeeze", Tensor.squeeze, ("input", "dim"), ("dim",), {"dim": None},
            local_fn=_squeeze_local)
    _method("unsqueeze", Tensor.unsqueeze, ("input", "dim"), ("dim",))
    _method("narrow", Tensor.narrow, ("input", "dim", "start", "length"),
            ("dim", "start", "length"))
    # index is static so that the rule checks it against the global size (before any
    # redistribution); one cache entry per index value
    _method("select", Tensor.select, ("input", "dim", "index"), ("dim", "index"))
    _method("getitem", Tensor.__getitem__, ("input", "idx"), ("idx",))
    _method("split", Tensor.split, ("input", "split_size_or_sections", "dim"),
            ("split_size_or_sections", "dim"), {"dim": 0})
    _method("chunk", Tensor.chunk, ("input", "chunks", "dim"), ("chunks", "dim"), {"dim": 0})
    _method("unbind", Tensor.unbind, ("input", "dim"), ("dim",), {"dim": 0})


_register()
_OPS_KERNEL = {name: info.kernel for name, info in _OPS.items()}
_OPS_PARAMS = {name: info.params for name, info in _OPS.items()}
