"""The sharding-rule framework: rules as data, one mesh dim at a time.

A *rule* is a pure function of metadata. Given an :class:`OpSchema` (the op name, one
:class:`ArgMeta` per positional tensor-like argument, and the decision-relevant static
arguments), it returns a :class:`RuleResult`: the global shape and dtype of every output and
the candidate strategies for ONE mesh dim, each a :class:`Candidate` whose ``placements``
list the outputs' placements first and then one placement per argument (``None`` for an
argument that is not tensor-like). The shared expander (:func:`propagate`) builds N-D
strategies from the 1-D candidates, asks the injected cost function what each costs and
returns the cheapest (ties: list order), identical on every rank because every input is.

Each registration declares the static parameters its rule reads
(``register_rule("sum", static=("dim", "keepdim", "dtype"))``; :func:`rule_statics` gives
them to the op table, in binding order: they form the propagation-cache key), and
:meth:`OpSchema.get` refuses a name the op did not declare.

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

This module also holds the candidate builder of elementwise ops
(:func:`pointwise_candidates`), which several families share. PyTorch's metadata semantics
(dims, broadcasting, dtype promotion, view shapes) live in :mod:`placements.meta`.
"""

from __future__ import annotations

import difflib
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..cache import LRUCache
from ..errors import ArgumentError, NoRuleError, ShardingError, SignatureError
from ..meta import dtype_kind
from ..spec import DTensorSpec
from ..types import Partial, Placement, Replicate, Shard, placement_list

__all__ = [
    "ArgMeta",
    "Candidate",
    "OpSchema",
    "OpStrategy",
    "RuleResult",
    "defers_partial",
    "get_rule",
    "nd_valid",
    "pass_cost",
    "propagate",
    "reduce_cost",
    "register_rule",
    "rule_names",
    "rule_result",
    "rule_statics",
    "strategy_of",
    "unshard_cost",
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
        """The value of the static argument ``name`` (``default`` when the call did not
        bind it).

        Raises
        ------
        SignatureError
            ``name`` is not one of the statics the op's rule declared
            (``register_rule(..., static=...)``): a rule reads only what it declares, so
            the op table binds it and the propagation cache keys on it.
        """
        declared = _STATICS.get(self.op, ())
        if name not in declared:
            raise SignatureError(
                f"{self.op}: its sharding rule reads the static argument {name!r}, which the "
                f"op does not declare (declared statics: {declared}); add it to "
                "register_rule(..., static=...)"
            )
        for k, v in self.static:
            if k == name:
                return v
        return default


@dataclass(frozen=True, slots=True)
class Candidate:
    """One 1-D strategy: ``placements = (*outputs, *args)``; ``None`` for non-tensor args.

    ``reduces`` lists the all-reduces over this mesh dim that the strategy implies beyond
    moving its inputs, by element count: those its local kernel runs (``collective``: the
    kernel then communicates over this mesh dim, e.g. a vocab-parallel loss), or the one
    a consumer will run on a Partial output the strategy creates from unreduced inputs
    (local indexing with masking). The expander adds their cost to the candidate's, so
    such a candidate wins only where it is cheaper than redistributing the inputs.

    ``passes`` lists the tensors the kernel passes around the ring of this mesh dim, by
    global element count: on each of the ``k - 1`` steps of a ring of ``k`` coordinates
    every coordinate sends its block of each to its successor and receives its
    predecessor's (ring attention's key/value blocks, one message per step): ``(k - 1) / k``
    of the tensor per rank, what an all-gather of it moves (:func:`pass_cost`). Such a
    candidate is ``collective``.
    """

    placements: tuple[Placement | None, ...]
    reduces: tuple[int, ...] = ()
    collective: bool = False
    passes: tuple[int, ...] = ()


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
# op -> the static parameter names its rule reads, in the op's binding order
_STATICS: dict[str, tuple[str, ...]] = {}


def register_rule(
    *ops: str, static: Sequence[str] | Mapping[str, Sequence[str]] = ()
) -> Callable[[RuleFn], RuleFn]:
    """Decorator: register ``fn`` as the rule of each op name in ``ops``, with the static
    parameters it reads. **Local**.

    Parameters
    ----------
    *ops : str
        The op names. May be omitted when ``static`` is a mapping: its keys are the ops.
    static : sequence of str, or mapping of op name to sequence of str
        The decision-relevant static arguments the rule reads with :meth:`OpSchema.get`
        (``("dim", "keepdim", "dtype")``), in the op's binding order: they are the op's
        ``static_params`` and, in this order, part of the propagation-cache key. One
        sequence serves every op; a mapping gives each op its own (an op of ``ops`` missing
        from it has none). Without ``static`` the ops have no statics.

    Raises
    ------
    ArgumentError
        ``static`` is a string, or a mapping names an op that is not in ``ops``.
    """
    if isinstance(static, str):
        raise ArgumentError(
            f"register_rule{ops}: static must be a sequence of parameter names, got the "
            f"string {static!r}"
        )
    if isinstance(static, Mapping):
        ops = ops or tuple(static)
        extra = [op for op in static if op not in ops]
        if extra:
            raise ArgumentError(f"register_rule{ops}: static names ops {extra} not registered")
        statics = {op: tuple(static.get(op, ())) for op in ops}
    else:
        statics = {op: tuple(static) for op in ops}

    def deco(fn: RuleFn) -> RuleFn:
        for op in ops:
            _RULES[op] = fn
            _STATICS[op] = statics[op]
        return fn

    return deco


def rule_statics(op: str) -> tuple[str, ...]:
    """The static parameter names the rule of ``op`` reads, in the op's binding order (what
    the op table binds and the propagation cache keys on). **Local**.

    Raises NoRuleError (as :func:`get_rule`) for an op without a rule.
    """
    get_rule(op)
    return _STATICS.get(op, ())


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


# -- candidate builders shared by rule families ----------------------------------------------
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


_BOOL = np.dtype(np.bool_)


def _dtype_valid(schema: OpSchema, result: RuleResult) -> RuleResult:
    """``result`` without the candidates that the dtypes make wrong. **Local**.

    - A bool tensor argument kept ``P(sum)``/``P(avg)`` while an output is not bool: a bool
      ``P(sum)`` reduces by logical or (several contributions may hold the same True), and
      an op that makes numbers of it (a cast to a number, ``x + 1``, ``sum``, ``cumsum``,
      ``where`` with a number operand...) would add those contributions up (True on two
      ranks giving 2). Such an input is reduced first, as for ``long()``, whose cast rule
      has no sum candidate. Where every output is bool (``x | y``, ``x & y``, ``where`` of
      bools) the or commutes with the op and the candidates stay. Python scalars are
      exempt: a replicated value split into ``P(sum)`` is held by one coordinate only.
    - An output ``P(avg)`` of a dtype that is not floating or complex (``sum(dtype=int64)``
      of a float ``P(avg)``): an average of integers has no exact value of their dtype, so
      no DTensor holds one (:func:`placements.spec.check_partial_dtype`).
    """
    n_out = len(result.out_shapes)
    bool_slots = () if all(d == _BOOL for d in result.out_dtypes) else [
        n_out + i
        for i, a in enumerate(schema.args)
        if a is not None and a.dtype == _BOOL and not a.is_scalar
    ]
    int_outs = [k for k, d in enumerate(result.out_dtypes) if dtype_kind(d) not in "fc"]
    if not bool_slots and not int_outs:
        return result

    def wrong(c: Candidate) -> bool:
        pl = c.placements
        return any(
            (p := pl[j]) is not None and p.kind == "P" and p.reduce_op in _LINEAR
            for j in bool_slots
        ) or any(pl[k].kind == "P" and pl[k].reduce_op == "avg" for k in int_outs)

    kept = tuple(c for c in result.candidates if not wrong(c))
    if len(kept) == len(result.candidates):
        return result
    return RuleResult(result.out_shapes, result.out_dtypes, kept, result.nd_check, result.inplace)


_RESULTS = LRUCache("placements.rules.results", 4096)


def rule_result(schema: OpSchema) -> RuleResult:
    """The rule's result for ``schema`` (less the candidates its dtypes make wrong,
    :func:`_dtype_valid`), memoised on everything a rule may read.

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
    data = _RESULTS.data  # the miss path of every dispatch: the table itself
    try:
        result = data.get(key)
    except TypeError:  # an unhashable static argument (a slice in an index...)
        return _dtype_valid(schema, get_rule(schema.op)(schema))
    if result is None:
        _RESULTS.misses += 1
        result = _dtype_valid(schema, get_rule(schema.op)(schema))
        _RESULTS.put(key, result)
    else:
        _RESULTS.hits += 1
        data.move_to_end(key)
    return result


def _short(pl: Sequence[Placement] | None) -> str:
    return "local" if pl is None else placement_list(pl)


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


# a tensor argument as the search sees it: (index into placements, meta, current
# placements, number of elements)
_Tensor = tuple[int, ArgMeta, tuple[Placement, ...], int]
# one mesh dim's admissible candidate: (estimate, index in the rule's list, candidate)
_Ranked = tuple[int, int, Candidate]


def _tensor_args(args: Sequence[ArgMeta | None], n_out: int) -> list[_Tensor]:
    """The arguments that hold placements (DTensors), with their slot in a candidate."""
    return [
        (n_out + i, a, a.placements, math.prod(a.shape))
        for i, a in enumerate(args)
        if a is not None and a.placements is not None
    ]


def defers_partial(pl: tuple, n_out: int, target: Placement, held: set) -> bool:
    """Whether moving an argument to ``target`` for a candidate with (one mesh dim's)
    placements ``pl`` only defers communication: ``target`` is a Partial kind that no
    argument holds there (``held``) and no argument of the candidate is sharded there (the
    Partial would come from linearity alone). **Local**."""
    return (target.kind == "P" and target.reduce_op not in held
            and not any(p is not None and p.kind == "S" for p in pl[n_out:]))


def _mesh_dim_candidates(
    schema: OpSchema, result: RuleResult, tensors: list[_Tensor], m: int
) -> tuple[list[_Ranked], list[Candidate]]:
    """The rule's candidates admissible on mesh dim ``m``, ranked, and those among them that
    move nothing (in list order).

    A candidate is dropped when it would turn a tensor argument into a Partial kind that no
    argument holds on mesh dim ``m`` and no argument of the candidate is sharded there (then
    the Partial comes from linearity alone, which never saves communication; it only defers
    it; with a sharded argument the Partial is the contraction's, and splitting a replicated
    addend into it, ``linear``'s bias, costs nothing),
    or, for an in-place op, when it does not keep the first argument's placement (output
    and input). The rank of a kept one is ``(estimate, list index)``: the estimate sums,
    over the tensor arguments it moves and the all-reduces it implies
    (:attr:`Candidate.reduces`), their element counts plus one.

    Raises ShardingError (in-place op) when no candidate is left.
    """
    n_out = len(result.out_shapes)
    held = {cur[m].reduce_op for _, _, cur, _ in tensors if cur[m].kind == "P"}
    inplace = result.inplace
    if inplace:
        cur0 = schema.args[0].placements  # type: ignore[union-attr]
        first = cur0[m] if cur0 is not None else R
    ranked: list[_Ranked] = []
    zero: list[Candidate] = []
    for idx, c in enumerate(result.candidates):
        pl = c.placements
        if inplace and (pl[0] != first or pl[n_out] != first):
            continue
        est = sum(c.reduces) + len(c.reduces) + sum(c.passes) + len(c.passes)
        for j, _, cur, size in tensors:
            t = pl[j]
            if t is None or t == cur[m]:
                continue
            if defers_partial(pl, n_out, t, held):
                break
            est += size + 1
        else:
            ranked.append((est, idx, c))
            if est == 0:
                zero.append(c)
    if not ranked:
        raise _inplace_error(schema, m)
    ranked.sort()  # by estimate, then list order (indices are unique)
    return ranked, zero


def _free_combo(
    result: RuleResult, zero: list[list[Candidate]]
) -> tuple[Candidate, ...] | None:
    """The first valid combination (in candidate-list order, mesh dim 0 first) that moves no
    argument on any mesh dim, or None."""
    if not all(zero):
        return None
    for cs in itertools.product(*zero):
        if nd_valid(result, cs):
            return cs
    return None


def _cheapest_combo(
    result: RuleResult,
    tensors: list[_Tensor],
    dims: list[list[_Ranked]],
    cost_fn: Callable[[ArgMeta, tuple[Placement, ...]], float],
    mesh_shape: tuple[int, ...],
) -> tuple[tuple[Candidate, ...] | None, float, list[tuple[tuple[Candidate, ...], float]]]:
    """Branch and bound over every combination of ranked candidates (one per mesh dim).

    Combinations are visited in rank order; each is costed argument by argument with
    ``cost_fn`` (memoised per argument and target placements) and abandoned as soon as it
    exceeds the best cost found; the all-reduces a candidate implies
    (:attr:`Candidate.reduces`) count as the move of a ``P(sum)`` vector of their size to
    Replicate on their mesh dim, the ring passes (:attr:`Candidate.passes`) as
    :func:`pass_cost` says, and a Shard output on a mesh dim where no argument is
    sharded as the gather that undoes it (:func:`unshard_cost`). Returns the cheapest valid
    combination (ties: the smaller tuple of list indices, mesh dim 0 first; None if
    nd_check rejects all), its cost and
    the successive best combinations with their costs.
    """
    nm = len(dims)
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
    reduce_memo: dict[tuple[int, int], float] = {}
    dtype = result.out_dtypes[0] if result.out_dtypes else _FLOAT32
    best = None
    best_cost = math.inf
    best_idx: tuple[int, ...] = ()
    considered = []
    sharded = [any(cur[m].is_shard() for _, _, cur, _ in tensors) for m in range(nm)]
    unshard_memo: dict[tuple[int, Candidate], float] = {}
    for combo, *tgts in zip(combos, *targets):
        cost = 0.0
        for m, e in enumerate(combo):
            for n in e[2].reduces:
                c_red = reduce_memo.get((m, n))
                if c_red is None:
                    c_red = reduce_memo[m, n] = reduce_cost(cost_fn, m, nm, n, dtype)
                cost += c_red
            for n in e[2].passes:
                c_red = reduce_memo.get((m, -n - 1))
                if c_red is None:
                    c_red = reduce_memo[m, -n - 1] = pass_cost(cost_fn, m, mesh_shape, n, dtype)
                cost += c_red
            if not sharded[m]:
                c_un = unshard_memo.get((m, e[2]))
                if c_un is None:
                    c_un = unshard_memo[m, e[2]] = unshard_cost(cost_fn, result, e[2], m, nm)
                cost += c_un
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
    return best, best_cost, considered


def unshard_cost(
    cost_fn: Callable[[ArgMeta, tuple[Placement, ...]], float],
    result: RuleResult,
    c: Candidate,
    m: int,
    nm: int,
) -> float:
    """The price of a sharding that candidate ``c`` introduces on mesh dim ``m``, where no
    argument of the call is sharded: what gathering its sharded outputs back to Replicate
    over that dim costs (``cost_fn`` of the move). The caller adds it only where no tensor
    argument holds a Shard on ``m``.

    Without it a greedy choice resolves a Partial input (a row-parallel matmul's output
    added to a replicated residual) by a reduce-scatter into a Shard, the cheaper move
    taken alone, and every later consumer that needs the whole tensor gathers it again
    (the sequence-parallel pattern by accident, one gather per consumer and a backward to
    match). Counted, the reduce-scatter plus its gather cost what the all-reduce does, so
    Megatron's all-reduce to Replicate wins; a sharding a user asks for (explicit
    redistribute, a sharded input) is unaffected."""
    cost = 0.0
    for k, p in enumerate(c.placements[: len(result.out_shapes)]):
        if p is None or not p.is_shard() or not result.out_shapes[k]:
            continue
        pl = tuple(p if q == m else R for q in range(nm))
        cost += float(cost_fn(ArgMeta(result.out_shapes[k], result.out_dtypes[k], pl),
                              (R,) * nm))
    return cost


def reduce_cost(
    cost_fn: Callable[[ArgMeta, tuple[Placement, ...]], float],
    m: int,
    nm: int,
    n: int,
    dtype: np.dtype,
) -> float:
    """What ``cost_fn`` says an all-reduce of ``n`` elements over mesh dim ``m`` costs: the
    move of a ``P(sum)`` vector (an argument the call does not hold) to Replicate."""
    pl = tuple(P("sum") if k == m else R for k in range(nm))
    return float(cost_fn(ArgMeta((n,), dtype, pl), (R,) * nm))


def pass_cost(
    cost_fn: Callable[[ArgMeta, tuple[Placement, ...]], float],
    m: int,
    mesh_shape: tuple[int, ...],
    n: int,
    dtype: np.dtype,
) -> float:
    """What ``cost_fn`` says a ring pass of a tensor of ``n`` elements over mesh dim ``m``
    costs (:attr:`Candidate.passes`): each rank sends ``k - 1`` blocks of it, ``(k - 1) / k``
    of the tensor, the traffic of an all-gather of it, priced as that move of an ``n``
    vector (the cost model has no point-to-point figure: the all-gather's latency and
    bandwidth; an MPI all-gather runs the same ``k - 1`` ring steps). 0 on a dim of one
    coordinate. **Local**.
    """
    nm = len(mesh_shape)
    if mesh_shape[m] == 1:
        return 0.0
    pl = tuple(S(0) if q == m else R for q in range(nm))
    return float(cost_fn(ArgMeta((n,), dtype, pl), (R,) * nm))


def propagate(
    schema: OpSchema,
    mesh: object,
    cost_fn: Callable[[ArgMeta, tuple[Placement, ...]], float],
) -> OpStrategy:
    """Choose the cheapest N-D strategy for ``schema`` on ``mesh``. **Local** and pure.

    ``cost_fn(arg_meta, target_placements)`` is the redistribution cost of one argument
    (the dispatcher passes one backed by the redistribute cost model); it is also asked
    about metadata of no argument of the call (the all-reduces of
    :attr:`Candidate.reduces`).

    The search: per mesh dim, the rule's admissible candidates (:func:`_mesh_dim_candidates`).
    If a combination needs no redistribution at all it is taken (the first in
    candidate-list order, :func:`_free_combo`). Otherwise the cheapest valid combination is
    found by branch and bound (:func:`_cheapest_combo`), ties broken by candidate-list order
    (mesh dim 0 first). Scalars and local 0-d values cost nothing to split. The rule's result
    is memoised per call signature without placements.
    """
    result = rule_result(schema)
    tensors = _tensor_args(schema.args, len(result.out_shapes))
    dims: list[list[_Ranked]] = []
    zero: list[list[Candidate]] = []
    for m in range(len(schema.mesh_shape)):
        ranked, free = _mesh_dim_candidates(schema, result, tensors, m)
        dims.append(ranked)
        zero.append(free)
    cs = _free_combo(result, zero)
    if cs is not None:
        return strategy_of(schema, mesh, result, cs, 0.0, ((cs, 0.0),))
    best, best_cost, considered = _cheapest_combo(result, tensors, dims, cost_fn,
                                                  tuple(schema.mesh_shape))
    if best is None:  # only reachable with a rule whose nd_check rejects everything
        raise ShardingError(
            f"{schema.op}: no valid sharding strategy on mesh {schema.mesh_shape} for inputs "
            + ", ".join(
                "None" if a is None else f"{_short(a.placements)} shape {a.shape}"
                for a in schema.args
            )
        )
    return strategy_of(schema, mesh, result, best, best_cost, tuple(considered))


def strategy_of(
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
