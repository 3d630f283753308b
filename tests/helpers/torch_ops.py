"""The torch differential suite's oracle: every record of the op table
(:data:`dtensor.ops.OPS`) mapped to its torch counterpart, and the sample coverage each record
must have.

- :data:`TORCH`: op name -> a callable taking the call's bound values by parameter name
  (torch tensors in the tensor slots, torch dtypes for dtype arguments) and returning what
  the torch op returns. By default ``torch.<name>`` (or the method ``input.<name>``) with
  every argument that is not at its default passed by its (PyTorch) name; the entries
  written out translate names (``swapaxes``'s ``axis0``), forms (``expand(*sizes)``) or
  compose an op torch has only as autograd (``_layer_norm_backward``).
- :data:`NUMPY_ORACLE`: the ops without a torch equivalent, with the reason; their oracle is
  written here from torch/numpy pieces (dropout's mask is dtensor's own generator, read off
  ``dt.dropout`` of ones at the same generator state, the rest is torch).
- :data:`DIFFERENCES`: documented, intentional differences from torch, per op, and how the
  check takes them into account (ties among sort indices, dtensor's extensions torch
  refuses).
- :func:`requirements`: per record, which keyword arguments and branches its sample calls
  must cover (every defaulted parameter at a non-default value; reductions: ``dim=None``,
  a negative dim, a tuple, ``keepdim``; NaN/inf; integer dtypes; empty and size-1 dims;
  broadcasting; python scalars), derived from the record's parameters and family; where a
  requirement does not apply the tables say why (:data:`FLOAT_ONLY`: torch refuses integer
  inputs; :data:`NONFINITE_UNDEFINED`: the result is undefined for NaN and inf).

The tests (``tests/unit/ops/test_torch_differential.py``, ``tests/mpi/ops/
test_torch_differential_mpi.py``) import torch lazily through :func:`torch_module`.
"""

from __future__ import annotations

import inspect
import operator
import warnings
from collections.abc import Callable

import numpy as np

import dtensor as dt
from dtensor.ops import OPS, OpInfo
from dtensor.ops.samples import INT_CASTS

__all__ = [
    "DIFFERENCES", "FLOAT_ONLY", "NONFINITE_UNDEFINED", "NUMPY_ORACLE", "TIES", "TORCH",
    "call_dt", "call_torch", "missing_coverage", "requirements", "to_torch", "torch_module",
]


def torch_module():
    """torch (imported on first use: the tests that call this are marked ``torch``)."""
    import torch  # lazy: the oracle, a test dependency only

    return torch


def _torch_dtype(d: np.dtype):
    torch = torch_module()
    return getattr(torch, np.dtype(d).name)


def to_torch(v: object, f64: bool = False) -> object:
    """``v`` with numpy arrays as torch tensors (floats as float64 if ``f64``), numpy dtypes
    as torch dtypes, tuples and lists converted element by element."""
    torch = torch_module()
    if isinstance(v, np.ndarray):
        a = v.astype(np.float64) if f64 and v.dtype.kind == "f" else v.copy()
        return torch.from_numpy(a)  # (a copy is C-contiguous, 0-d stays 0-d)
    if isinstance(v, np.dtype) or (isinstance(v, type) and issubclass(v, np.generic)):
        return _torch_dtype(np.dtype(v))
    if isinstance(v, tuple):
        return tuple(to_torch(e, f64) for e in v)
    if isinstance(v, list):
        return [to_torch(e, f64) for e in v]
    return v


# -- calling dtensor ------------------------------------------------------------------------------
def _split(local: Callable, values: list) -> tuple[list, dict]:
    """Positional and keyword arguments for ``local``'s signature (keyword-only by keyword,
    ``*args`` unpacked)."""
    params = [p for p in inspect.signature(local).parameters.values() if p.name != "out"]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return list(values), {}
    args: list = []
    kwargs: dict = {}
    for p, v in zip(params, values):
        if p.kind is inspect.Parameter.KEYWORD_ONLY:
            kwargs[p.name] = v
        elif p.kind is inspect.Parameter.VAR_POSITIONAL and isinstance(v, (list, tuple)):
            args.extend(v)
        else:
            args.append(v)
    return args, kwargs


def call_dt(info: OpInfo, values: list) -> object:
    """Run ``info`` on ``values`` (one per parameter, tensors in the tensor slots) through its
    public form: ``dt.<name>``, else the method, else its python operator (``x[idx]``,
    ``x[idx] = v``, which returns ``x``). **Local** (collective where the op is, on
    DTensors)."""
    if info.function is not None:
        args, kwargs = _split(info.function, values)
        return getattr(dt, info.name)(*args, **kwargs)
    if info.method is not None:
        base = OPS.get(info.name[:-1]) if info.inplace else None
        sig = base.function if base is not None and base.function is not None else info.method
        if info.method_args is None:
            margs, mkwargs = _split(sig, values)
        else:
            margs, mkwargs = [None] * len(values), {}
            for i, j in enumerate(info.method_args):
                margs[j] = values[i]
        return getattr(margs[0], info.name)(*margs[1:], **mkwargs)
    for op in info.operators:
        if op.dunder == "__setitem__":
            values[0][values[1]] = values[2]
            return values[0]
        if op.dunder == "__getitem__":
            return operator.getitem(*values)
    raise AssertionError(f"{info.name}: no public form to call")


# -- the torch table ------------------------------------------------------------------------------
def _F():
    return torch_module().nn.functional


def _default_fn(name: str) -> Callable[[dict], object]:
    """``torch.<name>(**v)`` or ``v["input"].<name>(**rest)``; an in-place op runs its
    method on the first argument (a clone of it is made by the caller)."""

    def fn(v: dict) -> object:
        torch = torch_module()
        first, *rest = v
        if not name.endswith("_") and hasattr(torch, name):
            args = dict(v)
            if not isinstance(args[first], torch.Tensor) and first == "input":
                args[first] = torch.tensor(args[first])  # a python scalar first operand
            try:
                return getattr(torch, name)(**args)
            except TypeError:  # torch takes no python scalar there: a 0-d tensor (the same
                # promotion as a wrapped number for these dtypes)
                args = {k: torch.tensor(w) if isinstance(w, (bool, int, float)) else w
                        for k, w in args.items()}
                return getattr(torch, name)(**args)
        return getattr(v[first], name)(**{k: v[k] for k in rest})

    return fn


def _positional(name: str) -> Callable[[dict], object]:
    def fn(v: dict) -> object:
        torch = torch_module()
        target = getattr(torch, name) if hasattr(torch, name) else getattr(
            torch.Tensor, name)
        return target(*v.values())
    return fn


def _method_star(name: str, key: str) -> Callable[[dict], object]:
    """``input.<name>(*v[key])`` (``expand(*sizes)``, ``repeat``, ``view``)."""
    return lambda v: getattr(v["input"], name)(*v[key])


def _reduce_dim(name: str) -> Callable[[dict], object]:
    """torch's max/min/prod/argmax/... take ``dim=None`` only by leaving it out."""

    def fn(v: dict) -> object:
        torch = torch_module()
        kw = dict(v)
        x = kw.pop("input")
        dim = kw.pop("dim", None)
        if dim is None:
            if name in ("amax", "amin"):
                return getattr(torch, name)(x, dim=(), **kw)
            if name == "prod" and kw.get("keepdim"):
                out = getattr(torch, name)(x, **{k: w for k, w in kw.items() if k != "keepdim"})
                return out.reshape((1,) * x.ndim)
            # max/min(keepdim=True) without dim: torch has no such form; dtensor ignores
            # keepdim there as torch.max(input) has none
            if name in ("max", "min", "argmax", "argmin", "count_nonzero", "prod"):
                if name in ("max", "min", "prod"):
                    kw.pop("keepdim", None)
                return getattr(torch, name)(x, **kw)
            return getattr(torch, name)(x, dim=None, **kw)
        if name == "prod" and isinstance(dim, tuple):  # torch's prod takes one dim
            out = x
            for d in sorted((d % x.ndim for d in dim), reverse=True):
                out = torch.prod(out, dim=d, keepdim=kw.get("keepdim", False),
                                 dtype=kw.get("dtype"))
            return out
        return getattr(torch, name)(x, dim=dim, **kw)

    return fn


def _std_var(name: str) -> Callable[[dict], object]:
    def fn(v: dict) -> object:
        torch = torch_module()
        kw = dict(v)
        x = kw.pop("input")
        with warnings.catch_warnings():  # a correction >= the count is a sample (inf)
            warnings.filterwarnings("ignore", "var|std", UserWarning)
            return getattr(torch, name)(x, **kw)
    return fn


def _scatter(name: str) -> Callable[[dict], object]:
    def fn(v: dict) -> object:
        torch = torch_module()
        src = v["src"]
        if isinstance(src, torch.Tensor):  # torch differentiates only the block the index
            src = src[tuple(slice(0, n) for n in v["index"].shape)]  # covers (it reads no more)
        t = v["input"].clone() if name.endswith("_") else v["input"]
        if not isinstance(src, torch.Tensor):
            return getattr(t, name)(v["dim"], v["index"], value=src)
        return getattr(t, name)(v["dim"], v["index"], src)
    return fn


def _index_put(name: str) -> Callable[[dict], object]:
    def fn(v: dict) -> object:
        torch = torch_module()
        x = v["input"]
        vals = v["values"]
        if not isinstance(vals, torch.Tensor):
            vals = torch.tensor(vals, dtype=x.dtype)
        op = torch.ops.aten.index_put_ if name.endswith("_") else torch.ops.aten.index_put
        return op(x, list(v["indices"]), vals, v.get("accumulate", False))
    return fn


def _setitem(v: dict) -> object:
    x = v["input"]
    x[v["idx"]] = v["value"]
    return x


def _layer_norm_backward(v: dict) -> object:
    """``(grad_input, grad_weight)`` from torch's autograd of ``layer_norm`` (grad_weight:
    ``sum(grad * xhat)``, given a weight or not)."""
    torch = torch_module()
    x = v["input"].detach().requires_grad_()
    ns = v["normalized_shape"]
    ns = (ns,) if isinstance(ns, int) else tuple(ns)
    w = v.get("weight")
    w1 = (torch.ones(ns, dtype=x.dtype) if w is None else w.detach()).requires_grad_()
    with torch.enable_grad():
        out = _F().layer_norm(x, ns, w1, None, v.get("eps", 1e-5))
        gx, gw = torch.autograd.grad(out, (x, w1), v["grad"])
    return gx, gw


def _gelu_backward(v: dict) -> object:
    torch = torch_module()
    return torch.ops.aten.gelu_backward(v["grad"], v["input"],
                                        approximate=v.get("approximate", "none"))


def _sdpa_reference(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False, keep=None):
    """PyTorch's documented reference of ``scaled_dot_product_attention`` in torch ops,
    with the dropout keep-mask ``keep`` given."""
    torch = torch_module()
    n_q, n_k = q.shape[-2], k.shape[-2]
    s = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    bias = torch.zeros(n_q, n_k, dtype=q.dtype)
    if is_causal:
        bias = bias.masked_fill(~torch.ones(n_q, n_k, dtype=torch.bool).tril(0), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            bias = bias.masked_fill(~attn_mask, float("-inf"))
        else:
            bias = bias + attn_mask
    if enable_gqa:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    w = torch.softmax(q @ k.transpose(-2, -1) * s + bias, dim=-1)
    w = torch.nan_to_num(w, nan=0.0)  # a row without any key: zeros (dtensor and torch)
    if dropout_p > 0:
        w = w * keep.to(w.dtype) / (1 - dropout_p)
    return w @ v


def _sdpa(v: dict) -> object:
    if v.get("dropout_p", 0.0) > 0:
        return _sdpa_reference(*[v.get(k) for k in ("query", "key", "value")],
                               **{k: w for k, w in v.items()
                                  if k not in ("query", "key", "value")})
    kw = {k: w for k, w in v.items() if k not in ("query", "key", "value")}
    return _F().scaled_dot_product_attention(v["query"], v["key"], v["value"], **kw)


def _sdpa_backward(v: dict) -> object:
    torch = torch_module()
    q, k, val = (v[n].detach().requires_grad_() for n in ("query", "key", "value"))
    kw = {n: v[n] for n in ("is_causal", "scale", "enable_gqa") if n in v}
    with torch.enable_grad():
        out = _F().scaled_dot_product_attention(q, k, val, **kw)
        return torch.autograd.grad(out, (q, k, val), v["grad"])


def _topk(v: dict) -> object:
    """torch's topk; with ``sorted=False`` (torch: the k entries in an unspecified order,
    dtensor: sorted, see :data:`DIFFERENCES`) sorted as dtensor returns them."""
    torch = torch_module()
    out = torch.topk(**v)
    if v.get("sorted", True):
        return out
    dim = v.get("dim", -1)
    order = torch.sort(out.values.detach(), dim=dim, descending=v.get("largest", True),
                       stable=True).indices
    return out.values.gather(dim, order), out.indices.gather(dim, order)


def _nan_kept(x, out):
    """``out`` with ``x``'s NaNs where ``x`` has them (sign: see :data:`DIFFERENCES`)."""
    x = x.detach()  # (sign's gradient is 0 everywhere)
    return out.where(~x.isnan(), x) if x.is_floating_point() else out


def _dropout(v: dict) -> object:
    """``input * keep / (1 - p)`` with ``keep`` given (read off dtensor's generator)."""
    p = v.get("p", 0.5)
    if not v.get("training", True) or p == 0:
        return v["input"]
    return v["input"] * v["keep"].to(v["input"].dtype) / (1 - p)


def _ce(v: dict) -> object:
    kw = {k: w for k, w in v.items() if k not in ("input", "target")}
    return _F().cross_entropy(v["input"], v["target"], **kw)


def _functional(name: str) -> Callable[[dict], object]:
    return lambda v: getattr(_F(), name)(**v)


def _cast(name: str) -> Callable[[dict], object]:
    return lambda v: getattr(v["input"], name)()


def _inplace_method(name: str) -> Callable[[dict], object]:
    """The in-place method on the (cloned) first argument; returns it."""

    def fn(v: dict) -> object:
        torch = torch_module()
        first, *rest = v
        x = v[first]
        kw = {k: v[k] for k in rest}
        try:
            out = getattr(x, name)(**kw)
        except TypeError:  # torch takes no python scalar beside a tensor there (clamp_'s
            # min and max): a 0-d tensor of x's dtype
            out = getattr(x, name)(**{k: torch.tensor(w, dtype=x.dtype) if isinstance(
                w, (bool, int, float)) else w for k, w in kw.items()})
        assert out is x
        return x
    return fn


#: Every op with a torch counterpart: the callable taking the bound values by name (default
#: arguments left out, see :func:`call_torch`).
TORCH: dict[str, Callable[[dict], object]] = {}

_SPECIAL: dict[str, Callable[[dict], object]] = {
    "swapaxes": _positional("swapaxes"),
    "dot": _positional("dot"),
    "outer": _positional("outer"),
    "bmm": _positional("bmm"),
    "mm": _positional("mm"),
    "expand": _method_star("expand", "sizes"),
    "repeat": _method_star("repeat", "sizes"),
    "view": lambda v: v["input"].view(v["shape"]),
    "contiguous": lambda v: v["input"].contiguous(),
    "t": lambda v: v["input"].t(),
    "getitem": lambda v: v["input"][v["idx"]],
    "setitem": _setitem,
    "einsum": lambda v: torch_module().einsum(v["equation"], *v["operands"]),
    "split": lambda v: torch_module().split(v["input"], v["split_size_or_sections"],
                                            v.get("dim", 0)),
    "gelu": _functional("gelu"),
    "silu": _functional("silu"),
    "leaky_relu": _functional("leaky_relu"),
    "softplus": _functional("softplus"),
    "linear": _functional("linear"),
    "embedding": _functional("embedding"),
    "layer_norm": _functional("layer_norm"),
    "rms_norm": lambda v: _F().rms_norm(**{
        **v, "normalized_shape": (v["normalized_shape"],) if isinstance(
            v["normalized_shape"], int) else v["normalized_shape"]}),
    "pow": lambda v: torch_module().pow(v["input"], v["other"]),
    "pow_": lambda v: v["input"].pow_(v["other"]),
    "mse_loss": _functional("mse_loss"),
    "cross_entropy": _ce,
    "scaled_dot_product_attention": _sdpa,
    "scaled_dot_product_attention_backward": _sdpa_backward,
    "_layer_norm_backward": _layer_norm_backward,
    "_gelu_backward": _gelu_backward,
    "std": _std_var("std"),
    "var": _std_var("var"),
    "index_put": _index_put("index_put"),
    "index_put_": _index_put("index_put_"),
    "scatter": _scatter("scatter"),
    "scatter_": _scatter("scatter_"),
    "scatter_add": _scatter("scatter_add"),
    "scatter_add_": _scatter("scatter_add_"),
    "expand_as": lambda v: v["input"].expand_as(v["other"]),
    "type_as": lambda v: v["input"].type_as(v["other"]),
    "to": lambda v: v["input"].to(v["dtype"]),
    "fill_": lambda v: v["input"].fill_(v["value"]),
    "zero_": lambda v: v["input"].zero_(),
    "copy_": lambda v: v["input"].copy_(v["src"]),
    "topk": _topk,
    "sign": lambda v: _nan_kept(v["input"], torch_module().sign(v["input"])),
    "sign_": lambda v: _nan_kept(v["input"].clone(), v["input"].sign_()),
}
for _n in ("amax", "amin", "max", "min", "prod", "argmax", "argmin", "all", "any",
           "count_nonzero", "sum", "mean", "logsumexp", "norm"):
    _SPECIAL[_n] = _reduce_dim(_n)
for _n in ("bfloat16", "bool", "byte", "char", "double", "float", "half", "int", "long",
           "short"):
    _SPECIAL[_n] = _cast(_n)

#: Ops without a torch equivalent: the reason, and the oracle used instead (composed here).
NUMPY_ORACLE: dict[str, str] = {
    "dropout": "dropout's keep mask comes from dtensor's counter-based generator, which torch "
               "cannot draw: the mask is read off dt.dropout of ones at the same generator "
               "state, and the oracle is input * keep / (1 - p) in torch",
}


def _build() -> None:
    for name, info in OPS.items():
        if name in _SPECIAL:
            TORCH[name] = _SPECIAL[name]
        elif name == "dropout":
            TORCH[name] = _dropout
        elif info.inplace:
            TORCH[name] = _inplace_method(name)
        else:
            TORCH[name] = _default_fn(name)


_build()

#: The ops whose index outputs among ties torch leaves unspecified (see :data:`DIFFERENCES`).
TIES = frozenset(("sort", "argsort", "topk", "kthvalue", "max", "min"))

#: Documented, intentional differences from torch (op -> what differs; the check adapts).
DIFFERENCES: dict[str, str] = {
    # ties: torch documents the index of tied elements as unspecified (sort without
    # stable=True, topk, kthvalue, max/min with dim): the check compares the values, and
    # that the indices point at those values
    **{n: "index outputs among ties are unspecified in torch: values compared, indices "
          "checked to point at equal values" for n in TIES},
    "sign": "sign(NaN) is NaN (numpy's; torch gives 0, pytorch/pytorch#41245 calls numpy's "
            "the expected answer): the oracle keeps the input's NaNs",
    "topk": "index outputs among ties are unspecified in torch (compared as for sort); "
            "sorted=False: torch returns the k entries in an unspecified order, dtensor "
            "sorted (which torch allows): the oracle sorts torch's entries",
}

#: Ops torch refuses bool inputs of and dtensor takes (as numpy does): the oracle runs torch
#: on the bool values as uint8 and casts a uint8 output back to bool.
BOOL_AS_UINT8: dict[str, str] = {
    **{n: "torch has no bool kernel for rounding; dtensor returns the bools (numpy)"
       for n in ("ceil", "floor", "round", "trunc")},
    **{n: "torch refuses bool input; dtensor takes it (numpy)" for n in ("argmax", "argmin")},
}

#: Ops dtensor marks not differentiable whose gradient torch records as zeros: the outputs'
#: ``requires_grad`` differs (checked: torch's gradient is zero), and the in-place form
#: refuses a tensor that requires grad.
ZERO_GRAD_IN_TORCH: dict[str, str] = {
    "floor_divide": "piecewise constant: dtensor records no gradient, torch a zero one",
    "logical_not": "a bool result: dtensor records no gradient (torch's in-place form "
                   "writes 0/1 into a float tensor that requires grad)",
}

#: (op, parameter) gradients that differ from torch's by design, with the reason; the check
#: compares them where :func:`grad_mask` says.
GRAD_DIFFERS: dict[tuple[str, str], str] = {
    ("scatter", "src"): "dtensor gives gradient only to the src entries whose value was "
                        "kept (duplicate indices: one wins); torch gathers for every entry",
    ("pow", "other"): "an integer base of 0: dtensor gives 0 (the limit, torch's own value "
                      "for a float base); torch gives inf for an integer base",
    ("abs", "input"): "at a NaN input dtensor's gradient is NaN (g * sign(x), sign(NaN) being "
                      "NaN, see DIFFERENCES['sign']); torch's is 0: compared elsewhere",
}

#: Indexing where dtensor follows numpy and torch differs: an int together with an array
#: index separated by a slice (numpy: the int is an advanced index, its broadcast dims go
#: first; torch: the int selects first). The check asserts numpy's result for these.
NUMPY_INDEXING = "getitem: an int and an array separated by a slice follow numpy, not torch"


def grad_mask(call, param: str, dt_grad: np.ndarray) -> np.ndarray | None:
    """Where a gradient listed in :data:`GRAD_DIFFERS` is compared with torch's (None: all of
    it)."""
    name = call.info.name.rstrip("_")
    v = dict(zip(call.info.params, call.values))
    if (name, param) == ("pow", "other") and isinstance(v["input"], np.ndarray) \
            and v["input"].dtype.kind in "iu":
        return np.broadcast_to(v["input"] != 0, dt_grad.shape)
    if (name, param) == ("abs", "input"):
        return np.broadcast_to(~np.isnan(v["input"]), dt_grad.shape)
    if (name, param) == ("scatter", "src"):
        index, dim = v["index"], v["dim"]
        ids = np.arange(index.size).reshape(index.shape)
        landed = np.full(v["input"].shape, -1)
        np.put_along_axis(landed, index, ids, dim)  # numpy: the last write wins
        keep = np.zeros(dt_grad.shape, bool)
        keep[tuple(slice(0, n) for n in index.shape)] = np.isin(ids, landed)
        return keep | (dt_grad != 0)
    return None


#: Ops torch defines for floating inputs only (no integer sample required), with the reason.
FLOAT_ONLY: dict[str, str] = {
    **{n: "torch refuses integer input (no integer kernel: 'not implemented for Long')"
       for n in ("gelu", "silu", "leaky_relu", "softplus")},
    **{n: "torch refuses integer input (mean: 'could not infer output dtype'; std and var "
          "'only support floating point'; norm: 'Expected a floating point tensor')"
       for n in ("mean", "std", "var", "norm")},
    **{n: "the in-place form of an op with a float result: torch refuses an integer tensor "
          "('result type Float can't be cast to the desired output type Long')"
       for n in ("cos_", "erf_", "exp_", "expm1_", "log10_", "log1p_", "log2_", "log_",
                 "reciprocal_", "rsqrt_", "sigmoid_", "sin_", "sqrt_", "tan_", "tanh_")},
}

#: Ops whose result is undefined for NaN and inf inputs (no NaN/inf sample required): the
#: casts to an integer dtype (C's float-to-int conversion of a non-finite value is undefined;
#: torch documents the result as undefined).
NONFINITE_UNDEFINED: dict[str, str] = {
    n: "a cast to an integer dtype: undefined for NaN and inf" for n in INT_CASTS
}


def call_torch(info: OpInfo, values: list, f64: bool = False, keep=None) -> object:
    """Run ``info``'s torch counterpart on ``values`` (numpy arrays; floats as float64 if
    ``f64``, the tensors that require grad given as torch tensors already). Arguments at
    their default are left out. An in-place op runs on a clone of its first argument."""
    torch = torch_module()
    v: dict[str, object] = {}
    for p, x in zip(info.params, values):
        if p in info.defaults and _is_default(x, info.defaults[p]):
            continue
        v[p] = x if isinstance(x, torch.Tensor) else to_torch(x, f64)
    if info.variadic and info.variadic in v:
        v[info.variadic] = [e if isinstance(e, torch.Tensor) else to_torch(e, f64)
                            for e in v[info.variadic]]
    if info.inplace:
        first = info.params[0]
        v[first] = v[first].clone()
    if keep is not None:
        v["keep"] = keep
    return TORCH[info.name](v)


def _is_default(x: object, d: object) -> bool:
    if x is d:
        return True
    if isinstance(x, np.ndarray) or isinstance(d, np.ndarray):
        return False
    try:
        return type(x) is type(d) and bool(x == d)
    except Exception:  # noqa: BLE001 - not comparable: not the default
        return False


#: Coverage the sample families do not have yet: op -> the requirements its samples miss
#: (empty: every record's samples cover its requirements). The coverage test fails for any
#: other gap, and for an entry that no longer holds (a filled gap must leave this table), so
#: a new op cannot land without full sample coverage.
COVERAGE_GAPS: dict[str, tuple[str, ...]] = {}


# -- coverage -------------------------------------------------------------------------------------
_NAN_FAMILIES = frozenset(("unary", "binary", "ternary", "reduce", "scan", "cast"))
_INT_FAMILIES = frozenset(("unary", "binary", "reduce", "scan", "view", "cast", "index",
                           "join", "product", "write"))
#: Reductions that take one int dim (torch has no tuple form).
_ONE_DIM = frozenset(("max", "min", "argmax", "argmin", "kthvalue"))


def _tensors(values: dict, info: OpInfo) -> list[np.ndarray]:
    out = []
    for p in info.tensor_params:
        x = values.get(p)
        for e in (x if isinstance(x, list) else [x]):
            if isinstance(e, np.ndarray):
                out.append(e)
    return out


def requirements(info: OpInfo) -> dict[str, Callable[[dict], bool]]:
    """What ``info``'s sample calls must cover, by name: each predicate takes one call's
    values by parameter name and says whether that call covers it; every requirement needs
    one call that does. Derived from the record: every defaulted parameter at a non-default
    value; a reduction's ``dim=None``, a negative dim, a tuple of dims (ops taking one dim
    excepted) and ``keepdim``, ``dim=None`` only where the op has a default dim; any op's int
    ``dim`` negative; NaN and inf in a float input (computing families, except the ops
    undefined for them, :data:`NONFINITE_UNDEFINED`); an integer input (unless torch defines
    the op for floats only, :data:`FLOAT_ONLY`); empty and size-1 dims; binary and ternary ops: broadcasting and a
    python scalar operand."""
    req: dict[str, Callable[[dict], bool]] = {}
    fam = info.samples
    for p, d in info.defaults.items():
        if p == "inplace" or (fam == "write"):
            continue
        req[f"{p}!=default"] = (lambda v, p=p, d=d: p in v and not _is_default(v[p], d))
    if "dim" in info.params and fam in ("reduce", "scan", "index", "nn", "join", "view"):
        req["dim<0"] = lambda v: isinstance(v.get("dim"), int) and v["dim"] < 0
        if fam == "reduce" and "dim" in info.defaults:  # (logsumexp: torch requires a dim)
            req["dim=None"] = lambda v: "dim" in v and v["dim"] is None
            if info.name not in _ONE_DIM:
                req["dim=tuple"] = lambda v: isinstance(v.get("dim"), tuple)
    if "keepdim" in info.params:
        req["keepdim=True"] = lambda v: v.get("keepdim") is True
        req["keepdim=False"] = lambda v: v.get("keepdim") is False
    if (fam in _NAN_FAMILIES or info.name in ("softmax", "log_softmax")) \
            and info.name not in NONFINITE_UNDEFINED:
        req["nan"] = lambda v: any(a.dtype.kind == "f" and np.isnan(a).any()
                                   for a in _tensors(v, info))
        req["inf"] = lambda v: any(a.dtype.kind == "f" and np.isinf(a).any()
                                   for a in _tensors(v, info))
    if fam in _INT_FAMILIES and info.name not in FLOAT_ONLY:
        req["int"] = lambda v: any(a.dtype.kind in "iu" for a in _tensors(v, info))
    req["empty"] = lambda v: any(0 in a.shape for a in _tensors(v, info))
    req["size-1"] = lambda v: any(1 in a.shape for a in _tensors(v, info))
    if fam in ("binary", "ternary"):
        req["broadcast"] = lambda v: len({a.shape for a in _tensors(v, info)}) > 1
    if fam == "binary":
        req["scalar"] = lambda v: any(isinstance(v.get(p), (bool, int, float))
                                      for p in info.tensor_params)
    return req


def missing_coverage(info: OpInfo, calls: list[dict]) -> list[str]:
    """The requirements of ``info`` (:func:`requirements`) that none of ``calls`` (values by
    parameter name) covers; NaN/inf are required only of an op with a float sample."""
    req = requirements(info)
    if not any(a.dtype.kind == "f" for v in calls for a in _tensors(v, info)):
        req.pop("nan", None)
        req.pop("inf", None)
    return [k for k, pred in req.items() if not any(pred(v) for v in calls)]


#: (op, float parameter) pairs torch gives no gradient for (used for its shape or dtype only,
#: or torch does not differentiate it): left out of the backward check.
NO_GRAD: frozenset[tuple[str, str]] = frozenset({
    ("cross_entropy", "target"), ("cross_entropy", "weight"), ("expand_as", "other"),
    ("type_as", "other"),
})


def same_values_at(call, got: np.ndarray, want: np.ndarray) -> bool:
    """Whether index outputs ``got`` and ``want`` of a sort/topk/kthvalue/max/min call point
    at equal values of the input (ties: torch leaves their order unspecified)."""
    v = dict(zip(call.info.params, call.values))
    x = v["input"]
    dim = v.get("dim", -1)
    if dim is None:
        return False
    dim %= max(x.ndim, 1)
    g, w = got, want
    if g.ndim < x.ndim:  # reduced without keepdim
        g, w = np.expand_dims(g, dim), np.expand_dims(w, dim)
    with np.errstate(all="ignore"):
        a = np.take_along_axis(x, g, dim)
        b = np.take_along_axis(x, w, dim)
    return bool(np.array_equal(a, b, equal_nan=x.dtype.kind == "f"))


def keep_mask(call) -> object:
    """The dropout keep mask (a torch float64 tensor) the call draws from dtensor's generator,
    read off ``dt.dropout`` of ones at the call's generator state, or None for a call that
    draws none."""
    torch = torch_module()
    v = dict(zip(call.info.params, call.values))
    name = call.info.name.rstrip("_")
    if name == "dropout":
        if not v.get("training", True) or v.get("p", 0.5) == 0:
            return None
        shape, p = v["input"].shape, v.get("p", 0.5)
    elif name == "scaled_dot_product_attention" and v.get("dropout_p", 0.0) > 0:
        q, k, val = v["query"], v["key"], v["value"]
        heads = (q.shape[:-2],)
        mask = v.get("attn_mask")
        batch = np.broadcast_shapes(*heads, k.shape[:-3] + q.shape[-3:-2] if k.ndim > 2
                                    and v.get("enable_gqa") else k.shape[:-2], val.shape[:-2],
                                    *(() if mask is None else (mask.shape[:-2],)))
        shape, p = (*batch, q.shape[-2], k.shape[-2]), v["dropout_p"]
    else:
        return None
    state = dt.get_rng_state()
    dt.set_rng_state(call.rng_state)
    ones = dt.dropout(dt.ones(shape, dtype=np.float32), p)
    dt.set_rng_state(state)
    return torch.from_numpy((ones.numpy() != 0).astype(np.float64))
