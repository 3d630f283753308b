"""Sharding rules of reductions and scans.

One builder serves every reduction: all-Replicate; Shard(d) kept on every dim that is not
reduced (renumbered when ``keepdim`` is False); and, for reductions that can be finished by
a collective, a Shard on a reduced dim gives a Partial output:

- ``sum`` -> ``P(sum)``; ``mean`` -> ``P(sum)`` (its local kernel scales the local sum by
  ``1 / N_global``, exact on uneven shards); ``count_nonzero`` -> ``P(sum)``;
- ``amax``/``max`` (no dim) -> ``P(max)``; ``amin``/``min`` -> ``P(min)``; ``prod`` ->
  ``P(prod)``; ``any`` -> ``P(max)``, ``all`` -> ``P(min)`` (bool or/and).

Partial inputs pass through where the reduction commutes with their reduce op: ``sum`` and
``mean`` of ``P(sum)``/``P(avg)``, ``amax`` of ``P(max)``, ``amin`` of ``P(min)``, ``prod``
of ``P(prod)``, ``any``/``all`` of bool ``P(max)``/``P(min)``; other reductions need the
input replicated.

The others need the reduced dims unsharded (Shard kept on the other dims): ``max``/``min``
along a dim (values and indices), ``argmax``/``argmin`` (a flat index when ``dim`` is None:
every dim unsharded), ``var``, ``std``, ``norm``, ``logsumexp``, and the scans
``cumsum``/``cumprod`` (scanned dim unsharded; ``cumsum`` is linear, so it keeps
``P(sum)``/``P(avg)``).
"""

from __future__ import annotations

import numpy as np

from ..errors import DTypeError, NoRuleError
from ..meta import (
    BOOL,
    INT64,
    as_dtype,
    check_nonempty_reduction,
    dtype_kind,
    float_dtype,
    norm_dim,
    norm_dims,
    real_dtype,
    reduced_shape,
)
from ._core import Candidate, OpSchema, P, R, RuleResult, S, register_rule

__all__ = ["reduction_rule", "scan_rule"]

# op -> (Partial kind of a reduced Shard (or None), Partial kinds passed through)
_REDUCE = {
    "sum": ("sum", ("sum", "avg")),
    "mean": ("sum", ("sum", "avg")),
    "count_nonzero": ("sum", ()),
    "amax": ("max", ("max",)),
    "amin": ("min", ("min",)),
    "prod": ("prod", ("prod",)),
    "any": ("max", ()),
    "all": ("min", ()),
    "max": ("max", ("max",)),
    "min": ("min", ("min",)),
    "argmax": (None, ()),
    "argmin": (None, ()),
    "var": (None, ()),
    "std": (None, ()),
    "norm": (None, ()),
    "logsumexp": (None, ()),
}
_BOOL_PASS = {"any": ("max",), "all": ("min",)}
# reductions without an identity: an empty reduced dim is an error
_NO_IDENTITY = frozenset(("amax", "amin", "max", "min", "argmax", "argmin"))
# the static arguments each reduction reads
_STATIC = {
    op: ("dim",) if op == "count_nonzero"
    else ("dim", "keepdim", "dtype") if op in ("sum", "mean", "prod", "norm")
    else ("dim", "keepdim")
    for op in _REDUCE
}


def _out_dtype(op: str, schema: OpSchema) -> np.dtype:
    a = schema.args[0]
    dt = a.dtype  # type: ignore[union-attr]
    req = schema.get("dtype") if "dtype" in _STATIC[op] else None
    if op in ("sum", "prod"):
        if req is not None:
            return as_dtype(req, schema.default_float)
        return INT64 if dt.kind in "biu" else dt
    if op == "mean":
        rt = dt if req is None else as_dtype(req, schema.default_float)
        if dtype_kind(rt) not in "fc":
            # Note: like PyTorch (unlike numpy), the mean of an integer tensor raises.
            raise DTypeError(
                "mean(): could not infer output dtype. Input dtype must be either a floating "
                f"point or complex dtype. Got: {rt.name}"
            )
        return rt
    if op in ("argmax", "argmin", "count_nonzero"):
        return INT64
    if op in ("any", "all"):
        return BOOL
    if op in ("var", "std", "norm"):
        if op == "norm" and req is not None:
            dt = as_dtype(req, schema.default_float)
        return real_dtype(dt)
    if op == "logsumexp":
        return float_dtype(dt, schema.default_float)
    return dt


@register_rule(static=_STATIC)
def reduction_rule(schema: OpSchema) -> RuleResult:
    """Rule of every reduction (``dim`` None/int/tuple, ``keepdim``). **Local**."""
    op = schema.op
    a = schema.args[0]
    ndim = len(a.shape)  # type: ignore[union-attr]
    dim = schema.get("dim")
    if op in ("var", "std") and isinstance(dim, (bool, np.bool_)):
        dim = None  # PyTorch's legacy var(input, unbiased)
    n_out = 1
    reduce_kind, passthrough = _REDUCE[op]
    if op in ("max", "min") and dim is not None:
        if not isinstance(dim, (int, np.integer)):
            raise NoRuleError(
                f"{op}: {op}(input, other) of DTensors has no rule here; use "
                f"{'maximum' if op == 'max' else 'minimum'}(input, other)"
            )
        n_out, reduce_kind, passthrough = 2, None, ()
    if op in ("argmax", "argmin") and dim is None:
        axes = tuple(range(ndim))
        keep_others = False  # a flat index: every dim unsharded
    else:
        axes = norm_dims(op, dim, ndim)
        keep_others = True
    if op in _NO_IDENTITY:  # on the global shape: an empty shard must not hide it
        whole = dim is None and op in ("max", "min", "argmax", "argmin")
        check_nonempty_reduction(op, a.shape, None if whole else axes)  # type: ignore
    # count_nonzero has no keepdim; max/min of the whole tensor ignore it (PyTorch)
    keepdim = (
        "keepdim" in _STATIC[op]
        and bool(schema.get("keepdim", False))
        and not (op in ("max", "min") and dim is None)
    )
    shape = reduced_shape(a.shape, axes if keep_others else None, keepdim)  # type: ignore
    dtype = _out_dtype(op, schema)
    if op in _BOOL_PASS and a.dtype == BOOL:  # type: ignore[union-attr]
        passthrough = _BOOL_PASS[op]
    outs = (shape,) * n_out
    dtypes = (dtype,) if n_out == 1 else (dtype, INT64)

    cands = [Candidate((R,) * (n_out + 1))]
    if keep_others:
        removed = 0
        for d in range(ndim):
            if d in axes:
                removed += 1
                continue
            od = d if keepdim else d - removed
            cands.append(Candidate((S(od),) * n_out + (S(d),)))
    if reduce_kind is not None:
        cands.extend(Candidate((P(reduce_kind), S(d))) for d in axes)
    cands.extend(Candidate((P(k), P(k))) for k in passthrough)
    return RuleResult(outs, dtypes, tuple(cands))


@register_rule("cumsum", "cumprod", static=("dim", "dtype"))
def scan_rule(schema: OpSchema) -> RuleResult:
    """Rule of ``cumsum``/``cumprod``: the scanned dim unsharded. **Local**."""
    a = schema.args[0]
    ndim = len(a.shape)  # type: ignore[union-attr]
    d_scan = norm_dim(schema.get("dim"), ndim, schema.op)
    req = schema.get("dtype")
    dt = a.dtype  # type: ignore[union-attr]
    if req is not None:
        dtype = as_dtype(req, schema.default_float)
    else:
        dtype = INT64 if dt.kind in "biu" else dt
    cands = [Candidate((R, R))]
    cands.extend(Candidate((S(d), S(d))) for d in range(ndim) if d != d_scan)
    if schema.op == "cumsum":
        cands.extend(Candidate((P(k), P(k))) for k in ("sum", "avg"))
    return RuleResult((a.shape,), (dtype,), tuple(cands))  # type: ignore[union-attr]
