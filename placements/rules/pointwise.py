"""Sharding rules of elementwise ops: unary, binary, ternary, casts, and in-place forms.

Every elementwise op shares one candidate builder (:func:`~._core.pointwise_candidates`);
a unary op's rule is made by :func:`unary_rule` from its dtype rule and its Partial
behaviour, and registered by the op's record (:mod:`dtensor.ops.pointwise`):
all-Replicate, Shard(d) on every output dim (an operand that broadcasts that dim is
Replicate there), and the Partial candidates the math allows:

- linear ops keep ``P(sum)``/``P(avg)``: ``add``/``sub`` ``[P, P, P]`` (a replicated
  operand, such as a python scalar, is split so that it counts once), ``mul``
  ``[P, P, R]``/``[P, R, P]``, ``div`` ``[P, P, R]``, ``neg``, ``lerp``, ``where``...;
- monotonic non-decreasing unary ops keep ``P(max)``/``P(min)`` (relu, exp, sigmoid, tanh,
  floor, ceil, clamp...), ``neg`` swaps them, ``add``/``sub`` of a replicated operand keeps
  them (``[P(max), P(max), R]``), ``maximum`` of ``P(max)`` operands is ``P(max)``;
- bool ``or``/``and`` behave as ``max``/``min``.

Output dtypes follow PyTorch's promotion (:func:`placements.meta.result_dtype`): python scalars
are weak, float ops on integers give the default float dtype, comparisons give bool.
An in-place op ``name_`` uses the rule of ``name`` with the output fixed to its first
argument's shape and dtype, and only candidates that keep that argument's placements.
"""

from __future__ import annotations

import numpy as np

from ..errors import DTypeError, ShardingError
from ..meta import (
    BOOL,
    INT64,
    as_dtype,
    bfloat16,
    broadcast_shapes,
    can_cast,
    dtype_kind,
    float_dtype,
    result_dtype,
)
from ._core import (
    ArgMeta,
    Candidate,
    OpSchema,
    RuleFn,
    RuleResult,
    pointwise_candidates,
    register_rule,
)

__all__ = ["UNARY_PARTIALS", "cast_partials", "elementwise_rule", "inplace_result", "unary_rule"]

# -- unary ops: a rule per op, made by unary_rule from its dtype rule and Partial behaviour ----
_ALL_KINDS = ("sum", "avg", "max", "min")
_IDENTITY = tuple((k, (k,)) for k in _ALL_KINDS)
_MONO = (("max", ("max",)), ("min", ("min",)))
_ANTI = (("min", ("max",)), ("max", ("min",)))


def _neg_partials(a: ArgMeta, schema: OpSchema) -> tuple:
    # Note: an integer P(max)/P(min) may hold its reduction's identity (INT64_MIN on an
    # empty shard), which neg would overflow: only floats map max <-> min
    anti = _ANTI if dtype_kind(a.dtype) in "fc" else ()
    return (("sum", ("sum",)), ("avg", ("avg",)), *anti)


def _leaky_relu_partials(a: ArgMeta, schema: OpSchema) -> tuple:
    return _MONO if float(schema.get("negative_slope", 0.01)) >= 0 else ()  # type: ignore[arg-type]


def _logical_not_partials(a: ArgMeta, schema: OpSchema) -> tuple:
    return _ANTI if a.dtype == BOOL else ()  # max <-> min on bools only (De Morgan)


#: How a unary op maps Partial inputs to Partial outputs, by name: ``copy`` keeps every kind
#: (a copy of the value); ``monotone`` keeps max and min (non-decreasing on the whole real
#: line: log/sqrt are not, a contribution outside their domain turns the reduction into
#: nan); ``anti`` swaps max and min (non-increasing: ``~x = -x - 1`` on integers);
#: ``linear`` keeps sum and avg and, on floats, swaps max and min (``neg``); ``none`` keeps
#: nothing (a Partial input is reduced first). Ops whose behaviour depends on an argument
#: have their own entry.
UNARY_PARTIALS: dict[str, object] = {
    "copy": _IDENTITY,
    "monotone": _MONO,
    "anti": _ANTI,
    "linear": _neg_partials,
    "none": (),
    "leaky_relu": _leaky_relu_partials,
    "logical_not": _logical_not_partials,
}

#: A unary op's output dtype from its input's, by dtype rule (the local kernel's ``kind``):
#: ``float`` computes integers and bools in the default float dtype, ``bool`` returns bool,
#: ``square`` squares bool to int64 (``pow(x, 2)``); the others keep the dtype.
_UNARY_DTYPES = {
    "float": lambda dt, default: float_dtype(dt, default),
    "bool": lambda dt, default: BOOL,
    "square": lambda dt, default: INT64 if dt == BOOL else dt,
}


def unary_rule(dtype: str, partials: str) -> RuleFn:
    """The sharding rule of a unary elementwise op (and of its in-place form ``op_``).

    **Local.** ``dtype`` is the op's dtype rule (``"same"``, ``"float"``, ``"floatonly"``,
    ``"integral"``, ``"round"``, ``"bool"`` or ``"square"``; see :data:`_UNARY_DTYPES`),
    ``partials`` how it treats Partial inputs (a key of :data:`UNARY_PARTIALS`). Candidates:
    all-Replicate, Shard(d) on every dim, and the Partial mappings.
    """
    to_dtype = _UNARY_DTYPES.get(dtype)
    keep = UNARY_PARTIALS[partials]

    def rule(schema: OpSchema) -> RuleResult:
        a = schema.args[0]
        out = a.dtype if to_dtype is None else to_dtype(a.dtype, schema.default_float)  # type: ignore[union-attr]
        kinds = keep(a, schema) if callable(keep) else keep
        cands = pointwise_candidates(a.shape, (a,), kinds)  # type: ignore[union-attr]
        result = RuleResult((a.shape,), (out,), tuple(cands))  # type: ignore[union-attr]
        return inplace_result(schema, result) if schema.op.endswith("_") else result

    rule.__name__ = rule.__qualname__ = f"unary_rule_{dtype}_{partials}"
    return rule


# -- binary ops -----------------------------------------------------------------------------
_ARITH = ("add", "sub", "mul", "floor_divide", "remainder", "fmod", "pow", "maximum",
          "minimum", "bitwise_and", "bitwise_or", "bitwise_xor")
_TRUE_DIV = ("atan2",)
_COMPARE = ("eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor")
_BINARY = (*_ARITH, *_TRUE_DIV, *_COMPARE, "div")

_LIN_ADD = (("sum", ("sum", "sum")), ("avg", ("avg", "avg")),
            ("max", ("max", None)), ("min", ("min", None)))
_LIN_MUL = (("sum", ("sum", None)), ("sum", (None, "sum")),
            ("avg", ("avg", None)), ("avg", (None, "avg")))
_MAX = (("max", ("max", "max")), ("min", ("min", None)), ("min", (None, "min")))
_MIN = (("min", ("min", "min")), ("max", ("max", None)), ("max", (None, "max")))
_BINARY_PARTIALS = {
    "add": _LIN_ADD,
    "sub": _LIN_ADD,
    "mul": _LIN_MUL,
    "maximum": _MAX,
    "minimum": _MIN,
}
# bool or/and are max/min
_BOOL_PARTIALS = {
    "logical_or": _MAX, "bitwise_or": _MAX, "logical_and": _MIN, "bitwise_and": _MIN,
}


def _binary_partials(op: str, args: tuple[ArgMeta | None, ...], schema: OpSchema) -> tuple:
    if op == "div":
        if schema.get("rounding_mode") is None:
            return (("sum", ("sum", None)), ("avg", ("avg", None)))
        return ()
    if op in _BOOL_PARTIALS:
        return _BOOL_PARTIALS[op] if all(a.dtype == BOOL for a in args) else ()  # type: ignore[union-attr]
    if op in ("add", "sub") and dtype_kind(_binary_dtype(op, args, schema)) not in "fc":
        # integer P(max)/P(min) may hold the identity (INT64_MIN/MAX on an empty shard):
        # adding a value to it would wrap around, so only the linear partials stay
        return _LIN_ADD[:2]
    return _BINARY_PARTIALS.get(op, ())


def _binary_dtype(op: str, args: tuple[ArgMeta, ...], schema: OpSchema) -> np.dtype:
    if op in _COMPARE:
        return BOOL
    dt = result_dtype(args, schema.default_float)
    if op in _TRUE_DIV or (op == "div" and schema.get("rounding_mode") is None):
        return float_dtype(dt, schema.default_float)
    return dt


# -- ternary ops ----------------------------------------------------------------------------
_TERNARY_PARTIALS = {
    # where(cond, a, b) selects per element: every reduce op commutes with it
    "where": tuple((k, (None, k, k)) for k in _ALL_KINDS),
    "clamp": (("max", ("max", None, None)), ("min", ("min", None, None))),
    "lerp": (("sum", ("sum", "sum", None)), ("avg", ("avg", "avg", None))),
    "addcmul": (("sum", ("sum", "sum", None)), ("sum", ("sum", None, "sum")),
                ("avg", ("avg", "avg", None)), ("avg", ("avg", None, "avg"))),
    "addcdiv": (("sum", ("sum", "sum", None)), ("avg", ("avg", "avg", None))),
}
_TERNARY = tuple(_TERNARY_PARTIALS)
_ALIASES = {"clip": "clamp"}


def _ternary_dtype(op: str, args: tuple[ArgMeta | None, ...], schema: OpSchema) -> np.dtype:
    if op == "where":
        return result_dtype(args[1:], schema.default_float)
    return result_dtype(args, schema.default_float)


# -- casts ----------------------------------------------------------------------------------
_CAST_METHODS = {
    "float": np.float32, "double": np.float64, "half": np.float16, "bfloat16": None,
    "int": np.int32,
    "long": np.int64, "short": np.int16, "char": np.int8, "byte": np.uint8, "bool": np.bool_,
}  # (None: bfloat16, resolved on use, which imports ml_dtypes)


def _cast_target(op: str, schema: OpSchema) -> np.dtype:
    if op in _CAST_METHODS:
        target = _CAST_METHODS[op]
        return bfloat16() if target is None else np.dtype(target)
    a = schema.args[0]
    if op == "type_as":
        return schema.args[1].dtype  # type: ignore[union-attr]
    dtype = schema.get("dtype")
    return a.dtype if dtype is None else as_dtype(dtype, schema.default_float)  # type: ignore[union-attr]


def cast_partials(src: np.dtype, dst: np.dtype) -> tuple:
    if dst == src:
        return _IDENTITY
    out = ()
    dk = dtype_kind(dst)
    if dk in "fc":  # exact enough to commute with sums
        out += (("sum", ("sum",)), ("avg", ("avg",)))
    if src.kind != "c" and (dk == "f" or (dk in "iu" and np.can_cast(src, dst))):
        out += _MONO  # monotone: to a float, or to an int that holds every value
    return out


# -- the rule ---------------------------------------------------------------------------------
# the static arguments the rule reads (the in-place forms read their op's)
_STATIC = {"div": ("rounding_mode",), "to": ("dtype",)}


@register_rule(
    *_BINARY, *_TERNARY, *_ALIASES, *_CAST_METHODS, "to", "type_as",
    *(f"{op}_" for op in (*_BINARY, *_TERNARY, *_ALIASES)),
    static={**_STATIC, **{f"{op}_": names for op, names in _STATIC.items() if op != "to"}},
)
def elementwise_rule(schema: OpSchema) -> RuleResult:
    """Rule of every elementwise op (and its in-place form ``op_``). **Local**."""
    name = schema.op
    inplace = name.endswith("_")
    op = name[:-1] if inplace else name
    op = _ALIASES.get(op, op)
    args = schema.args
    if op in _CAST_METHODS or op in ("to", "type_as"):
        a = args[0]
        dtype = _cast_target(op, schema)
        partials = cast_partials(a.dtype, dtype)
        shape = a.shape
        if op == "type_as":  # other gives its dtype only: never moved
            cands = pointwise_candidates(shape, (a,), partials)
            return RuleResult(
                (shape,), (dtype,), tuple(Candidate((*c.placements, None)) for c in cands)
            )
    else:
        n = 2 if op in _BINARY else 3
        args = args[:n] if len(args) >= n else args + (None,) * (n - len(args))
        present = [a for a in args if a is not None]
        shape = broadcast_shapes(name, [a.shape for a in present])
        if op in _BINARY:
            dtype, partials = _binary_dtype(op, args, schema), _binary_partials(op, args, schema)
        else:
            dtype, partials = _ternary_dtype(op, args, schema), _TERNARY_PARTIALS[op]
    result = RuleResult((shape,), (dtype,), tuple(pointwise_candidates(shape, args, partials)))
    return inplace_result(schema, result) if inplace else result


def inplace_result(schema: OpSchema, result: RuleResult) -> RuleResult:
    """The in-place form of an out-of-place result: output = first argument. **Local**.

    Raises ShardingError (as PyTorch does) when broadcasting would grow the first argument.
    """
    a = schema.args[0]
    if a is None or result.out_shapes[0] != a.shape:
        raise ShardingError(
            f"{schema.op}: output with shape {list(a.shape) if a else None} doesn't match the "
            f"broadcast shape {list(result.out_shapes[0])}"
        )
    rt = result.out_dtypes[0]
    if not can_cast(rt, a.dtype):
        raise DTypeError(
            f"{schema.op}: result type {rt.name} can't be cast to the desired output type "
            f"{a.dtype.name}"
        )
    return RuleResult(
        result.out_shapes, (a.dtype, *result.out_dtypes[1:]), result.candidates,
        result.nd_check, True,
    )
