"""The sharding-rule framework: rules as data, one mesh dim at a time.

A *rule* is a pure function of metadata. Given an :class:`OpSchema` (the op name, one
:class:`ArgMeta` per positional tensor-like argument, and the decision-relevant static
arguments), it returns a :class:`RuleResult`: the global shape and dtype of every output and
the candidate strategies for ONE mesh dim, each a :class:`Candidate` whose ``placements``
list the outputs' placements first and then one placement per argument (``None`` for an
argument that is not tensor-like). The shared expander (:func:`propagate`) builds N-D
strategies from the 1-D candidates, asks the injected cost function what each costs and
returns the cheapest (ties: list order), identical on every rank because every input is.

Python scalars and 0-d values take part as 0-d *Replicate* arguments, so ``P(sum) + 2``
is the candidate ``[P(sum), P(sum), P(sum)]`` and the scalar's R -> P(sum) makes it count
once (the holder keeps it, the other coordinates add zero).

Conventions of candidates:

- ``None`` for a tensor argument means "any placement": the argument is used for its
  metadata only (``expand_as``'s ``other``) and is never redistributed.
- The first candidate of every rule is all-Replicate (always valid), so a strategy exists
  for any input placements.
- A rule whose validity depends on the whole N-D combination (a view that merges a sharded
  dim, nested sharding of uneven dims) sets :attr:`RuleResult.nd_check`.
- An in-place rule sets :attr:`RuleResult.inplace`: only candidates that keep the first
  argument's placements (output and input) survive, and no such candidate is an error.

This module also holds the metadata helpers the rule families share: PyTorch's dtype
promotion (:func:`result_dtype`), dim normalisation (:func:`norm_dim`, :func:`norm_dims`)
and broadcasting (:func:`broadcast_shapes`, :func:`pointwise_candidates`).
"""

from __future__ import annotations

import difflib
import itertools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import DimError, DTypeError, NoRuleError, ShardingError
from ..spec import DTensorSpec
from ..types import Partial, Placement, Replicate, Shard, short_placements

__all__ = [
    "ArgMeta",
    "Candidate",
    "OpSchema",
    "OpStrategy",
    "RuleResult",
    "get_rule",
    "nd_valid",
    "propagate",
    "register_rule",
    "rule_names",
]


_FLOAT32 = np.dtype(np.float32)


@dataclass(frozen=True, slots=True)
class ArgMeta:
    """Metadata of one tensor-like argument: global shape, dtype and current placements.

    ``placements`` is None for a local/scalar argument (treated as Replicate), and
    ``is_scalar`` marks python scalars (0-d, weak dtype).
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    placements: tuple[Placement, ...] | None = None
    is_scalar: bool = False


@dataclass(frozen=True, slots=True)
class OpSchema:
    """What a rule sees: op name, argument metadata (None = not tensor-like), static args.

    ``static`` is a tuple of (name, value) pairs of the decision-relevant non-tensor
    arguments the op declares (dim, keepdim, a view's shape, an einsum equation...).
    ``mesh_shape`` lets a rule reason about divisibility (uneven shards).
    ``default_float`` is the default float dtype at the call (``int / int`` and float
    ops on integers produce it); it belongs to the propagation-cache key.
    """

    op: str
    args: tuple[ArgMeta | None, ...]
    static: tuple[tuple[str, object], ...]
    mesh_shape: tuple[int, ...]
    default_float: np.dtype = _FLOAT32

    def get(self, name: str, default: object = None) -> object:
        for k, v in self.static:
            if k == name:
                return v
        return default


@dataclass(frozen=True, slots=True)
class Candidate:
    """One 1-D strategy: ``placements = (*outputs, *args)``; ``None`` for non-tensor args."""

    placements: tuple[Placement | None, ...]


@dataclass(frozen=True, slots=True)
class RuleResult:
    """A rule's answer for one mesh dim.

    ``nd_check(combo)`` (optional) receives one :class:`Candidate` per mesh dim and says
    whether that N-D combination is exact; ``inplace`` marks an in-place op.
    """

    out_shapes: tuple[tuple[int, ...], ...]
    out_dtypes: tuple[np.dtype, ...]
    candidates: tuple[Candidate, ...]
    nd_check: Callable[[tuple[Candidate, ...]], bool] | None = field(default=None, compare=False)
    inplace: bool = False


@dataclass(frozen=True, slots=True)
class OpStrategy:
    """The chosen N-D strategy for one call signature (what the propagation cache stores).

    ``input_placements[i]`` is the target placements of argument i (None for non-tensor
    arguments); ``output_specs`` the outputs' specs; ``cost`` the estimated redistribution
    cost; ``candidates_considered`` lets debug tools show how the choice was made: the
    successive best combinations found (its :class:`Candidate` on each mesh dim, its cost).
    """

    output_specs: tuple[DTensorSpec, ...]
    input_placements: tuple[tuple[Placement, ...] | None, ...]
    cost: float
    candidates_considered: tuple[tuple[tuple[Candidate, ...], float], ...] = field(
        default=(), compare=False
    )


RuleFn = Callable[[OpSchema], RuleResult]
_RULES: dict[str, RuleFn] = {}


def register_rule(*ops: str) -> Callable[[RuleFn], RuleFn]:
    """Decorator: register ``fn`` as the rule of each op name in ``ops``. **Local**."""

    def deco(fn: RuleFn) -> RuleFn:
        for op in ops:
            _RULES[op] = fn
        return fn

    return deco


def rule_names() -> tuple[str, ...]:
    """Names of every op that has a rule, sorted. **Local**."""
    return tuple(sorted(_RULES))


def get_rule(op: str) -> RuleFn:
    """The rule of ``op``; raises NoRuleError naming the op and the closest supported one.

    **Local**.
    """
    fn = _RULES.get(op)
    if fn is None:
        close = difflib.get_close_matches(op, list(_RULES), n=1)
        hint = f"; the closest supported op is {close[0]!r}" if close else ""
        raise NoRuleError(f"{op}: no sharding rule for op {op!r}{hint}")
    return fn


# -- placement constants ------------------------------------------------------------------
R = Replicate()
_SHARDS = tuple(Shard(d) for d in range(64))
_PARTIALS = {op: Partial(op) for op in ("sum", "avg", "max", "min", "prod")}
# reduce ops that commute with each other (so mixing them over mesh dims is order-free)
_LINEAR = frozenset(("sum", "avg"))


def S(dim: int) -> Shard:
    """``Shard(dim)`` from a table (rules build many). **Local**."""
    return _SHARDS[dim] if dim < 64 else Shard(dim)


def P(op: str) -> Partial:
    """``Partial(op)`` from a table. **Local**."""
    return _PARTIALS[op]


# -- shared metadata helpers --------------------------------------------------------------
def norm_dim(dim: object, ndim: int, op: str | None = None) -> int:
    """A dim in ``[0, ndim)`` (a 0-d tensor accepts 0 and -1, as in PyTorch). **Local**.

    The one dim check of the package: the rules and the local tensor's ``_norm_dim`` use
    it, so a local Tensor and a DTensor raise the same error.

    Raises
    ------
    DimError
        PyTorch's wording after the op's name (no prefix when ``op`` is None):
        ``sum: Dimension out of range (expected to be in range of [-2, 1], but got 3)``.
    DTypeError
        If ``dim`` is not an integer (a TypeError).
    """
    where = f"{op}: " if op else ""
    try:
        d = operator.index(dim)  # type: ignore[arg-type]
    except TypeError:
        raise DTypeError(f"{where}dim must be an int, got {type(dim).__name__} ({dim!r})") from None
    n = ndim if ndim else 1
    if not -n <= d < n:
        raise DimError(
            f"{where}Dimension out of range (expected to be in range of [{-n}, {n - 1}], "
            f"but got {d})"
        )
    return d % n if ndim else 0


def norm_dims(op: str, dim: object, ndim: int) -> tuple[int, ...]:
    """A reduction's ``dim`` (None, int or sequence) as sorted axes; None or (): all.

    **Local**. Every given dim is checked (a 0-d tensor accepts 0 and -1 and has no axes).
    A dim given twice raises ShardingError; one out of range, :class:`DimError`.
    """
    if dim is None:
        return tuple(range(ndim))
    if isinstance(dim, (int, np.integer)) or not hasattr(dim, "__iter__"):
        d = norm_dim(dim, ndim, op)  # one dim (a DTypeError naming the op if not an int)
        return (d,) if ndim else ()
    axes = tuple(norm_dim(d, ndim, op) for d in dim)  # type: ignore[attr-defined]
    if len(set(axes)) != len(axes):
        raise ShardingError(f"{op}: dim {list(dim)} has a dim that appears multiple times")
    # Note: like PyTorch, an empty dim list reduces over every dim.
    return tuple(sorted(axes)) if axes and ndim else tuple(range(ndim))


def broadcast_shapes(op: str, shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """Broadcast shape of ``shapes`` (numpy/PyTorch rules). **Local**."""
    ndim = max((len(s) for s in shapes), default=0)
    out = [1] * ndim
    for s in shapes:
        for i, n in enumerate(s, ndim - len(s)):
            if n != 1:
                if out[i] == 1:
                    out[i] = n
                elif out[i] != n:
                    listed = " and ".join(str(tuple(t)) for t in shapes)
                    raise ShardingError(
                        f"{op}: shapes {listed} do not broadcast (size {out[i]} vs {n} at "
                        f"dimension {i - ndim})"
                    )
    return tuple(out)


_CATEGORY = {"b": 0, "u": 1, "i": 1, "f": 2, "c": 3}
BOOL = np.dtype(np.bool_)
INT64 = np.dtype(np.int64)


_PROMOTED: dict[tuple[np.dtype, np.dtype], np.dtype] = {}


def promote_types(a: np.dtype | None, b: np.dtype | None) -> np.dtype | None:
    """PyTorch's ``promote_types`` (None: no operand yet). **Local**.

    Within a category numpy's table is PyTorch's; across categories the higher category's
    dtype wins (``int64`` with ``float16`` is ``float16``), float with complex widens.
    Results are memoised: the local kernels call this on every op.
    """
    if a is None or a == b:
        return b
    if b is None:
        return a
    out = _PROMOTED.get((a, b))
    if out is None:
        ca, cb = _CATEGORY[a.kind], _CATEGORY[b.kind]
        out = np.promote_types(a, b) if ca == cb or min(ca, cb) >= 2 else (a if ca > cb else b)
        _PROMOTED[(a, b)] = out
    return out


def combine_categories(higher: np.dtype | None, lower: np.dtype | None) -> np.dtype | None:
    """Combine two promotion tiers, e.g. dimensioned tensors with 0-d ones (PyTorch's
    ``combine_categories``): the lower tier matters only when its category is higher.
    **Local**."""
    if higher is None:
        return lower
    if lower is None:
        return higher
    ch, cl = _CATEGORY[higher.kind], _CATEGORY[lower.kind]
    if ch == 3:
        return higher
    if cl == 3:
        return promote_types(higher, lower) if ch == 2 else lower
    if ch == 2:
        return higher
    if ch == 0 or cl == 2:
        return promote_types(higher, lower)
    return higher


def scalar_dtype(meta: ArgMeta, default_float: np.dtype) -> np.dtype:
    """The dtype of a python scalar as a "wrapped number": its kind's default dtype."""
    kind = meta.dtype.kind
    if kind == "f":
        return default_float
    if kind == "c":
        return np.dtype(np.complex128 if default_float == np.float64 else np.complex64)
    return BOOL if kind == "b" else INT64


def result_dtype(args: Sequence[ArgMeta | None], default_float: np.dtype) -> np.dtype:
    """PyTorch's result dtype of operands: dimensioned tensors, then 0-d ones, then scalars.

    **Local**. A 0-d tensor or a python scalar matters only when its category
    (bool < int < float < complex) is higher than the dimensioned tensors'.
    """
    dim = zero = wrapped = None
    for a in args:
        if a is None:
            continue
        if a.is_scalar:
            wrapped = promote_types(wrapped, scalar_dtype(a, default_float))
        elif a.shape:
            dim = promote_types(dim, a.dtype)
        else:
            zero = promote_types(zero, a.dtype)
    out = combine_categories(dim, combine_categories(zero, wrapped))
    return default_float if out is None else out


def can_cast(src: np.dtype, dst: np.dtype) -> bool:
    """PyTorch's ``canCast``: no complex->real, float->integral or non-bool->bool. **Local**."""
    return _CATEGORY[src.kind] <= _CATEGORY[dst.kind]


# Note: dtype strings follow PyTorch ("float" is float32, "int" is int32), not numpy (where
# np.dtype("float") is float64 and np.dtype("int") is int64). Any other string goes through
# numpy.dtype(). The local tensor's ``to_dtype`` uses this table too.
TORCH_DTYPE_NAMES = {
    "float": np.dtype(np.float32),
    "double": np.dtype(np.float64),
    "half": np.dtype(np.float16),
    "int": np.dtype(np.int32),
    "long": INT64,
    "short": np.dtype(np.int16),
    "char": np.dtype(np.int8),
    "byte": np.dtype(np.uint8),
    "bool": BOOL,
    "cfloat": np.dtype(np.complex64),
    "cdouble": np.dtype(np.complex128),
}


def as_dtype(value: object, default_float: np.dtype) -> np.dtype:
    """A ``dtype=`` argument as a numpy dtype (python ``float`` is the default float dtype,
    ``int`` int64, ``bool`` bool, as in PyTorch's TensorOptions; strings as in
    :data:`TORCH_DTYPE_NAMES`). **Local**.

    Raises DTypeError (as the local tensor's ``to_dtype``) for what is not a dtype.
    """
    if value is float:
        return default_float
    if value is complex:
        return np.dtype(np.complex128 if default_float == np.float64 else np.complex64)
    if value is int:
        return INT64
    if isinstance(value, str) and value in TORCH_DTYPE_NAMES:
        return TORCH_DTYPE_NAMES[value]
    try:
        return np.dtype(value)  # type: ignore[call-overload]
    except TypeError as exc:
        raise DTypeError(f"cannot interpret {value!r} as a dtype") from exc


def float_dtype(dtype: np.dtype, default_float: np.dtype) -> np.dtype:
    """``dtype`` if floating/complex, else the default float dtype (float ops on ints)."""
    return dtype if dtype.kind in "fc" else default_float


def pointwise_candidates(
    out_shape: tuple[int, ...],
    args: Sequence[ArgMeta | None],
    partials: Sequence[tuple[str, Sequence[str | None]]] = (),
    skip_dims: Sequence[int] = (),
) -> list[Candidate]:
    """Candidates of an elementwise op with broadcasting. **Local**.

    All-Replicate; then, per output dim ``d`` not in ``skip_dims``, Shard(d) on the output
    and on every argument that has that dim at full size (an argument that broadcasts it —
    missing or of size 1 — is Replicate there); then one candidate per entry of
    ``partials``: ``(out_op, arg_ops)`` with ``arg_ops[i]`` a reduce op (Partial) or None
    (Replicate) for argument i.
    """
    ndim = len(out_shape)
    none_or_r = tuple(None if a is None else R for a in args)
    out = [Candidate((R, *none_or_r))]
    for d in range(ndim):
        if d in skip_dims:
            continue
        pl: list[Placement | None] = [S(d)]
        for a in args:
            if a is None:
                pl.append(None)
                continue
            ad = d - ndim + len(a.shape)
            pl.append(S(ad) if ad >= 0 and a.shape[ad] == out_shape[d] else R)
        out.append(Candidate(tuple(pl)))
    for out_op, arg_ops in partials:
        out.append(
            Candidate(
                (
                    P(out_op),
                    *(
                        None if a is None else (R if k is None else P(k))
                        for a, k in zip(args, arg_ops)
                    ),
                )
            )
        )
    return out


def with_args(schema: OpSchema, n: int) -> tuple[ArgMeta | None, ...]:
    """The first ``n`` argument metadata of ``schema`` (missing ones are None). **Local**."""
    args = schema.args
    return args[:n] if len(args) >= n else args + (None,) * (n - len(args))


# -- the expander -------------------------------------------------------------------------
def _mixed_partials_ok(combo: Sequence[Candidate], n_out: int) -> bool:
    """An output may be Partial of non-commuting kinds on different mesh dims only when an
    argument already is (the op then maps one mixture to the other)."""
    npl = len(combo[0].placements)
    mixed_in = None
    for k in range(n_out):
        kinds = {c.placements[k].reduce_op for c in combo if c.placements[k].kind == "P"}
        if len(kinds) > 1 and not kinds <= _LINEAR:
            if mixed_in is None:
                mixed_in = False
                for i in range(n_out, npl):
                    ik = {
                        c.placements[i].reduce_op
                        for c in combo
                        if c.placements[i] is not None and c.placements[i].kind == "P"
                    }
                    if len(ik) > 1 and not ik <= _LINEAR:
                        mixed_in = True
                        break
            if not mixed_in:
                return False
    return True


def nd_valid(result: RuleResult, combo: Sequence[Candidate]) -> bool:
    """Whether one candidate per mesh dim forms a valid N-D strategy. **Local**.

    Checks the mixing of Partial kinds over mesh dims and the rule's own ``nd_check``.
    """
    n_out = len(result.out_shapes)
    if len(combo) > 1 and not _mixed_partials_ok(combo, n_out):
        return False
    return result.nd_check is None or result.nd_check(tuple(combo))


_MEMO: dict[tuple, RuleResult] = {}
_MEMO_MAX = 4096


def _rule_result(schema: OpSchema) -> RuleResult:
    """The rule's result for ``schema``, memoised on everything a rule may read.

    Rules are functions of the op, the arguments' shapes, dtypes and scalar flags, the
    static arguments, the mesh shape and the default float dtype -- never of the current
    placements (those are the expander's business) -- so one result serves every input
    layout of the same call signature.
    """
    key = (
        schema.op,
        tuple(None if a is None else (a.shape, a.dtype, a.is_scalar) for a in schema.args),
        schema.static,
        schema.mesh_shape,
        schema.default_float,
    )
    try:
        result = _MEMO.get(key)
    except TypeError:  # an unhashable static argument (a slice in an index...)
        return get_rule(schema.op)(schema)
    if result is None:
        result = get_rule(schema.op)(schema)
        if len(_MEMO) >= _MEMO_MAX:
            _MEMO.clear()
        _MEMO[key] = result
    return result


def _short(pl: Sequence[Placement] | None) -> str:
    return "local" if pl is None else "[" + short_placements(pl, ", ") + "]"


def _inplace_error(schema: OpSchema, m: int) -> ShardingError:
    a = schema.args[0]
    others = ", ".join(
        "None" if b is None else f"{_short(b.placements)} shape {b.shape}"
        for b in schema.args[1:]
    )
    return ShardingError(
        f"{schema.op}: no sharding strategy keeps the in-place output's placements "
        f"{_short(a.placements)} (shape {a.shape}) on mesh dim {m} of mesh "
        f"{schema.mesh_shape}; other inputs: {others or 'none'}. Redistribute the input "
        "first or use the out-of-place op"
    )


def propagate(
    schema: OpSchema,
    mesh: object,
    cost_fn: Callable[[ArgMeta, tuple[Placement, ...]], float],
) -> OpStrategy:
    """Choose the cheapest N-D strategy for ``schema`` on ``mesh``. **Local** and pure.

    ``cost_fn(arg_meta, target_placements)`` is the redistribution cost of one argument
    (the dispatcher passes one backed by the redistribute cost model).

    The search: per mesh dim, the rule's candidates minus those that would turn a tensor
    argument into a Partial kind that no argument holds on that mesh dim (that never saves
    communication; it only defers it). If a combination needs no redistribution at all it
    is taken (the first in candidate-list order). Otherwise combinations are visited in the
    order of a cheap per-mesh-dim estimate (elements of arguments that would move) and
    costed with a memo per (argument, target) and branch-and-bound over the arguments; the
    result is the cheapest valid combination, ties broken by candidate-list order (mesh
    dim 0 first). Scalars and local 0-d values cost nothing to split. The rule's result
    is memoised per call signature without placements.
    """
    result = _rule_result(schema)
    args = schema.args
    n_out = len(result.out_shapes)
    nm = len(schema.mesh_shape)
    cands = result.candidates
    # tensor arguments: (index into placements, meta, current placements, size)
    tensors = [
        (n_out + i, a, a.placements, math.prod(a.shape))
        for i, a in enumerate(args)
        if a is not None and a.placements is not None
    ]
    inplace = result.inplace
    dims: list[list[tuple[int, int, Candidate]]] = []
    zero: list[list[Candidate]] = []
    for m in range(nm):
        held = {cur[m].reduce_op for _, _, cur, _ in tensors if cur[m].kind == "P"}
        if inplace:
            first = args[0].placements[m] if args[0].placements is not None else R
        lst = []
        zlst = []
        for idx, c in enumerate(cands):
            pl = c.placements
            if inplace and (pl[0] != first or pl[n_out] != first):
                continue
            est = 0
            for j, _, cur, size in tensors:
                t = pl[j]
                if t is None or t == cur[m]:
                    continue
                if t.kind == "P" and t.reduce_op not in held:
                    break
                est += size + 1
            else:
                lst.append((est, idx, c))
                if est == 0:
                    zlst.append(c)
        if not lst:
            raise _inplace_error(schema, m)
        lst.sort()  # by estimate, then list order (indices are unique)
        dims.append(lst)
        zero.append(zlst)

    # 1. a combination without any redistribution (first valid one in list order)
    if all(zero):
        for cs in itertools.product(*zero):
            if nd_valid(result, cs):
                return _strategy(schema, mesh, result, cs, 0.0, ((cs, 0.0),))

    # 2. branch and bound over costed combinations, in estimate order
    combos = list(itertools.product(*dims))
    # per tensor argument, its target placements in every combination (same order)
    targets = [
        itertools.product(
            *[[cur[m] if e[2].placements[j] is None else e[2].placements[j] for e in dims[m]]
              for m in range(nm)]
        )
        for j, _, cur, _ in tensors
    ]
    memos: list[dict] = [{} for _ in tensors]
    best = None
    best_cost = math.inf
    best_idx: tuple[int, ...] = ()
    considered = []
    for combo, *tgts in zip(combos, *targets):
        cost = 0.0
        for (_, a, cur, _), target, memo in zip(tensors, tgts, memos):
            if target == cur:
                continue
            c_arg = memo.get(target)
            if c_arg is None:
                c_arg = memo[target] = float(cost_fn(a, target))
            cost += c_arg
            if cost > best_cost:
                break
        else:
            idx = tuple([e[1] for e in combo])
            if cost < best_cost or (cost == best_cost and idx < best_idx):
                cs = tuple([e[2] for e in combo])
                if nd_valid(result, cs):
                    best, best_cost, best_idx = cs, cost, idx
                    considered.append((cs, cost))
    if best is None:  # only reachable with a rule whose nd_check rejects everything
        raise ShardingError(
            f"{schema.op}: no valid sharding strategy on mesh {schema.mesh_shape} for inputs "
            + ", ".join(
                "None" if a is None else f"{_short(a.placements)} shape {a.shape}" for a in args
            )
        )
    return _strategy(schema, mesh, result, best, best_cost, tuple(considered))


def _strategy(
    schema: OpSchema,
    mesh: object,
    result: RuleResult,
    combo: tuple[Candidate, ...],
    cost: float,
    considered: tuple,
) -> OpStrategy:
    """Build the OpStrategy of one N-D combination (one candidate per mesh dim)."""
    n_out = len(result.out_shapes)
    mesh_shape = schema.mesh_shape
    outs = tuple(
        DTensorSpec._trusted(
            mesh,
            tuple(c.placements[k] for c in combo),
            result.out_shapes[k],
            result.out_dtypes[k],
            None,
            mesh_shape,
        )
        for k in range(n_out)
    )
    ins = []
    for i, a in enumerate(schema.args):
        if a is None:
            ins.append(None)
            continue
        j = n_out + i
        cur = a.placements
        ins.append(
            tuple(
                (R if cur is None else cur[m]) if c.placements[j] is None else c.placements[j]
                for m, c in enumerate(combo)
            )
        )
    return OpStrategy(outs, tuple(ins), cost, considered)
