"""Mutations of the product, as data: sharding rules, redistribute plans and source lines.

This module owns the list that ``python -m launch mutate`` (:mod:`launch.mutate`) applies one
at a time to measure whether the test suite notices a bug. Each :class:`Mutation` names the
family it changes (a module of :mod:`placements.rules`, ``plan`` for
:mod:`redistribute.plan`, or for a source mutation the layer it hits), its kind
(:data:`KINDS`), the layer of ``DESIGN.md`` it belongs to (:data:`LAYERS`), the product module
it mutates and a patch. No mutation names its tests: the runner selects them from the mutated
module (:mod:`launch._select`). The pytest plugin :mod:`launch._mutant` applies the patch in
every test process (every MPI rank); product code has no test hook.

Three kinds of patch:

- :class:`~launch._source.SourcePatch` (the entries of :mod:`launch.source_mutations`): one
  exact snippet of a product module replaced, served by an import hook installed before the
  product is imported; it fires when the mutated statement runs.

How the rule and plan patches reach every path that decides placements:

- :class:`RulePatch` replaces ``placements.rules._core._RULES[op]`` for each op it names with a
  wrapper that transforms the rule's :class:`~placements.rules.RuleResult` (drop a candidate,
  map output placements, add a candidate). Every rule call goes through
  :func:`~placements.rules.get_rule`, which reads that table: the Python dispatcher, the
  strategy validator and the debug tools. The compiled front (``fastpath``) keeps no rule of
  its own: its misses go to the dispatcher's ``lookup``, which propagates through the rules,
  so one wrapper serves both modes (``DTENSOR_FASTPATH`` 0 and 1). An in-place twin ``op_``
  has its own entry: a mutation names it when it means it.
- :class:`PlanPatch` replaces ``redistribute.plan._search``, which :func:`redistribute.plan.plan`
  and :func:`~redistribute.plan.redistribute_cost` call through the module's global: every
  module that imported ``plan`` by name (the dispatcher, ``DTensor.redistribute``, explain,
  the benchmarks) reaches the patch without being rebound. The memoised search keeps the true
  plans; the wrapper transforms each answer and keeps the true plan's cost, so strategy choice
  is unchanged and only what runs is mutated.

Both clear every registered cache (:func:`placements.cache.clear_all`: rule results, plans,
the propagation cache and the compiled front's entries) when applied and when undone. A patch
calls ``fired()`` each time it changes an answer: a mutation that never fires changed nothing
the tests ran, and the runner reports it as invalid instead of counting it.

A test run (:class:`Run`) names test files (or node ids) relative to the ``tests`` folder;
the runner builds them from the selection.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from placements.cache import clear_all
from placements.errors import ConfigError
from placements.rules import Candidate, OpSchema, RuleResult, _core
from placements.types import Partial, Placement, Replicate, Shard

from ._source import SourcePatch
from .source_mutations import LAYERS as SOURCE_LAYERS
from .source_mutations import SOURCE_MUTATIONS

__all__ = [
    "FAMILIES",
    "KINDS",
    "LAYERS",
    "MUTATIONS",
    "Mutation",
    "PlanPatch",
    "RulePatch",
    "Run",
    "SourcePatch",
    "get",
]

#: Rule families (modules of placements/rules/) and the planner.
FAMILIES = ("pointwise", "reduction", "matmul", "view", "tensor", "nn", "index", "plan")
#: Kind -> what a mutation of that kind does. The first four change rules, ``step`` plans,
#: ``source`` a line of a product module.
KINDS = {
    "drop": "a candidate strategy dropped",
    "minmax": "a Partial(max)/Partial(min) output swapped, or claimed where it does not hold",
    "sum": "a Partial(sum) kept or claimed where the op does not preserve it",
    "shard": "a Shard dim of the output off by one",
    "step": "a step removed from redistribute plans",
    "source": "a one-line bug in a product module (wrong sign, off by one, wrong divisor...)",
}
#: Layers of DESIGN.md, for the per-layer table: the source layers, ``rules`` (the rule
#: mutations) and ``redistribute`` (plan mutations and redistribute source mutations).
LAYERS = {**SOURCE_LAYERS, "rules": "sharding rules (placements/rules)"}
RULE_KINDS = ("drop", "minmax", "sum", "shard")

Fired = Callable[[], None]
Undo = Callable[[], None]
Transform = Callable[[OpSchema, RuleResult], RuleResult]
Placements = tuple[Placement | None, ...]

R = Replicate()
PSUM, PAVG, PMAX, PMIN = Partial("sum"), Partial("avg"), Partial("max"), Partial("min")


@dataclass(frozen=True)
class Run:
    """One test process of a mutation's selection.

    ``paths`` are relative to the ``tests`` folder (``unit/placements/test_rules.py``, a node
    id ``unit/redistribute/test_plan.py::test_x``); ``ranks`` None runs one pytest process,
    else ``mpiexec -n ranks`` with ``--with-mpi``; ``validate`` names ops whose
    strategy-validator groups (``unit/ops/test_validator.py``) run first in a one-process run;
    ``lead`` marks the run of a suite's best-matching file alone, before the suite's others.
    """

    paths: tuple[str, ...]
    ranks: int | None = None
    validate: tuple[str, ...] = ()
    lead: bool = False

    @property
    def label(self) -> str:
        """A short name for reports: ``unit`` or ``mpi-2`` and the number of files (``lead``
        before it for a lead run)."""
        where = "unit" if self.ranks is None else f"mpi-{self.ranks}"
        extra = f" + validator[{','.join(self.validate)}]" if self.validate else ""
        files = "1 file" if len(self.paths) == 1 else f"{len(self.paths)} files"
        return f"{'lead ' if self.lead else ''}{where} ({files}{extra})"


@dataclass(frozen=True)
class RulePatch:
    """Replace the rules of ``ops`` by ``transform(schema, result)`` of their answers."""

    ops: tuple[str, ...]
    transform: Transform

    def apply(self, fired: Fired) -> Undo:
        """Install the wrappers; return the function that restores the rules. **Local**.

        Raises ConfigError when an op has no registered rule (nothing would change).
        """
        missing = [op for op in self.ops if op not in _core._RULES]
        if missing:
            raise ConfigError(f"mutation: no sharding rule registered for {missing}")
        originals = {op: _core._RULES[op] for op in self.ops}
        transform = self.transform

        def wrap(rule: Callable[[OpSchema], RuleResult]) -> Callable[[OpSchema], RuleResult]:
            def mutated(schema: OpSchema) -> RuleResult:
                result = rule(schema)
                out = transform(schema, result)
                if out is not result:
                    fired()
                return out

            return mutated

        for op, rule in originals.items():
            _core._RULES[op] = wrap(rule)
        clear_all()

        def undo() -> None:
            _core._RULES.update(originals)
            clear_all()

        return undo


StepFilter = Callable[[tuple], tuple]


@dataclass(frozen=True)
class PlanPatch:
    """Replace every redistribute plan ``steps`` by ``edit(steps)``."""

    edit: StepFilter

    def apply(self, fired: Fired) -> Undo:
        """Install the wrapper of the planner's search; return the undo function. **Local**."""
        # import_module: the package ``redistribute`` re-exports the function ``plan``, which
        # shadows the submodule of the same name as an attribute
        module = importlib.import_module("redistribute.plan")
        search = module._search
        edit = self.edit

        # one edited tuple per plan object, and the plan itself where the edit changes
        # nothing: the wrapper keeps the memoised search's identities (a cached plan is the
        # same object on every call until the caches are cleared)
        edited: dict[int, tuple[tuple, tuple]] = {}

        def mutated(src_spec, dst, model):
            steps, cost = search(src_spec, dst, model)
            hit = edited.get(id(steps))
            if hit is None or hit[0] is not steps:
                out = edit(steps)
                hit = edited[id(steps)] = (steps, steps if out == steps else out)
            if hit[1] is not steps:
                fired()
            return hit[1], cost

        module._search = mutated
        clear_all()

        def undo() -> None:
            module._search = search
            clear_all()

        return undo


@dataclass(frozen=True)
class Mutation:
    """One mutation: what it changes, how, and which test runs should catch it.

    ``note`` records the analysis of a mutation the suite does not catch: an equivalent
    mutant, or the gap and the test that would close it.
    """

    name: str
    family: str
    kind: str
    description: str
    patch: RulePatch | PlanPatch | SourcePatch
    note: str = ""

    @property
    def module(self) -> str:
        """The product module the mutation changes (its tests are selected from it)."""
        if isinstance(self.patch, SourcePatch):
            return self.patch.module
        if isinstance(self.patch, PlanPatch):
            return "redistribute.plan"
        return f"placements.rules.{self.family}"

    @property
    def layer(self) -> str:
        """The layer of DESIGN.md it hits (a key of :data:`LAYERS`)."""
        if isinstance(self.patch, SourcePatch):
            return self.family
        return "redistribute" if self.family == "plan" else "rules"

    @property
    def mode(self) -> str | None:
        """``"python"`` when its tests must run with ``DTENSOR_FASTPATH=0``, else None."""
        return self.patch.mode if isinstance(self.patch, SourcePatch) else None


# -- transforms of rule results --------------------------------------------------------------
Pred = Callable[[Placements], bool]


def _with(result: RuleResult, cands: Sequence[Candidate]) -> RuleResult:
    return replace(result, candidates=tuple(cands))


def drop(pred: Pred, k: int = 0) -> Transform:
    """Drop the ``k``-th candidate whose placements satisfy ``pred``."""

    def transform(schema: OpSchema, result: RuleResult) -> RuleResult:
        hits = [i for i, c in enumerate(result.candidates) if pred(c.placements)]
        if len(hits) <= k:
            return result
        cands = list(result.candidates)
        del cands[hits[k]]
        return _with(result, cands)

    return transform


def drop_several(pred: Pred) -> Transform:
    """Drop every candidate whose placements satisfy ``pred`` when several do."""

    def transform(schema: OpSchema, result: RuleResult) -> RuleResult:
        cands = [c for c in result.candidates if not pred(c.placements)]
        if len(result.candidates) - len(cands) < 2:
            return result
        return _with(result, cands)

    return transform


OutMap = Callable[[Placement, tuple[int, ...]], Placement]


def remap(pred: Pred, fn: OutMap) -> Transform:
    """Map the output placements of every candidate that satisfies ``pred`` with
    ``fn(placement, output shape)``."""

    def transform(schema: OpSchema, result: RuleResult) -> RuleResult:
        n_out = len(result.out_shapes)
        cands = []
        for c in result.candidates:
            pl = c.placements
            if pred(pl):
                outs = tuple(fn(p, s) for p, s in zip(pl[:n_out], result.out_shapes))
                if outs != pl[:n_out]:
                    c = replace(c, placements=outs + pl[n_out:])
            cands.append(c)
        if all(a is b for a, b in zip(cands, result.candidates)):
            return result
        return _with(result, cands)

    return transform


def put(pred: Pred, i: int, p: Placement) -> Transform:
    """Set position ``i`` (outputs first, then arguments) of every candidate that satisfies
    ``pred`` to ``p``."""

    def transform(schema: OpSchema, result: RuleResult) -> RuleResult:
        cands = [
            replace(c, placements=c.placements[:i] + (p,) + c.placements[i + 1 :])
            if pred(c.placements) and c.placements[i] != p else c
            for c in result.candidates
        ]
        if all(a is b for a, b in zip(cands, result.candidates)):
            return result
        return _with(result, cands)

    return transform


def add(out: Placement, *args: Placement) -> Transform:
    """Append the candidate ``[out, *args]`` (an absent argument stays None; arguments past
    ``args`` are Replicate), unless the rule already lists it."""

    def transform(schema: OpSchema, result: RuleResult) -> RuleResult:
        pls = [None if a is None else (args[i] if i < len(args) else R)
               for i, a in enumerate(schema.args)]
        cand = Candidate((out, *pls))
        if cand in result.candidates:
            return result
        return _with(result, (*result.candidates, cand))

    return transform


# predicates and output maps
def exactly(*pl: Placement | None) -> Pred:
    """The candidate's placements are exactly ``pl``."""
    return lambda c: c == pl


def out_is(p: Placement) -> Pred:
    """The first output is ``p``."""
    return lambda c: c[0] == p


def out_shard(c: Placements) -> bool:
    """The first output is a Shard."""
    return c[0].kind == "S"


def reduced_to(p: Placement) -> Pred:
    """The output is ``p`` and the input a Shard (a reduced dim)."""
    return lambda c: c[0] == p and c[1] is not None and c[1].kind == "S"


def masked(c: Placements) -> bool:
    """A ``P(sum)`` output of a sharded input: local indexing with masking (getitem)."""
    return c[0] == PSUM and c[1] is not None and c[1].kind == "S"


def vocab(c: Placements) -> bool:
    """A Replicate output of logits sharded on the class dim (vocab-parallel loss)."""
    return c[0] == R and c[1] == S1


def to(p: Placement) -> OutMap:
    """Every mapped output becomes ``p``."""
    return lambda q, shape: p


def swap_minmax(q: Placement, shape: tuple[int, ...]) -> Placement:
    """P(max) <-> P(min); other placements unchanged."""
    return {PMAX: PMIN, PMIN: PMAX}.get(q, q)


def shift_shard(q: Placement, shape: tuple[int, ...]) -> Placement:
    """Shard(d) -> Shard(d + 1), or Shard(d - 1) on the last dim (the output's dims only)."""
    if q.kind != "S" or len(shape) < 2:
        return q
    return Shard(q.dim + 1) if q.dim + 1 < len(shape) else Shard(q.dim - 1)


# -- plan edits ------------------------------------------------------------------------------
def without(kind: str) -> StepFilter:
    """Remove every step of ``kind``."""
    return lambda steps: tuple(s for s in steps if s.kind != kind)


def _drop_first(steps: tuple) -> tuple:
    return steps[1:] if len(steps) > 1 else steps


def _drop_last(steps: tuple) -> tuple:
    return steps[:-1] if len(steps) > 1 else steps


# -- the list --------------------------------------------------------------------------------
def _rule(
    family: str, kind: str, name: str, ops: Sequence[str], transform: Transform,
    description: str, note: str = "",
) -> Mutation:
    return Mutation(
        f"{family}.{kind}.{name}", family, kind, description, RulePatch(tuple(ops), transform),
        note,
    )


def _plan(name: str, edit: StepFilter, description: str, note: str = "") -> Mutation:
    return Mutation(f"plan.step.{name}", "plan", "step", description, PlanPatch(edit), note)


S0, S1 = Shard(0), Shard(1)

MUTATIONS: tuple[Mutation, ...] = (
    # -- pointwise ----------------------------------------------------------------------------
    _rule("pointwise", "drop", "add_linear", ["add"], drop(exactly(PSUM, PSUM, PSUM)),
          "add loses [P(sum), P(sum), P(sum)]: P(sum) + scalar all-reduces"),
    _rule("pointwise", "drop", "mul_scaled", ["mul"], drop(exactly(PSUM, PSUM, R)),
          "mul loses [P(sum), P(sum), R]: P(sum) * scalar all-reduces"),
    _rule("pointwise", "drop", "relu_shard", ["relu"], drop(out_is(S0)),
          "relu loses its Shard(0) candidate"),
    _rule("pointwise", "drop", "neg_swap", ["neg"], drop(exactly(PMIN, PMAX)),
          "neg loses [P(min), P(max)]"),
    _rule("pointwise", "minmax", "relu", ["relu"], remap(exactly(PMAX, PMAX), swap_minmax),
          "relu maps P(max) to P(min)"),
    _rule("pointwise", "minmax", "neg", ["neg"], remap(exactly(PMIN, PMAX), swap_minmax),
          "neg keeps P(max) instead of swapping it to P(min)"),
    _rule("pointwise", "minmax", "maximum", ["maximum"],
          remap(exactly(PMAX, PMAX, PMAX), swap_minmax),
          "maximum of P(max) operands claims P(min)"),
    _rule("pointwise", "sum", "relu", ["relu"], add(PSUM, PSUM),
          "relu keeps P(sum)"),
    _rule("pointwise", "sum", "relu_inplace", ["relu_"], add(PSUM, PSUM),
          "relu_ (in place) keeps P(sum)"),
    _rule("pointwise", "sum", "exp", ["exp"], add(PSUM, PSUM),
          "exp keeps P(sum)"),
    _rule("pointwise", "sum", "abs", ["abs"], add(PSUM, PSUM),
          "abs keeps P(sum)"),
    _rule("pointwise", "sum", "mul_bilinear", ["mul"], add(PSUM, PSUM, PSUM),
          "mul of two P(sum) claims P(sum) (bilinear, not linear)"),
    _rule("pointwise", "shard", "add", ["add"], remap(out_is(S0), shift_shard),
          "add's Shard(0) output is Shard(1)"),
    _rule("pointwise", "shard", "exp", ["exp"], remap(out_is(S1), shift_shard),
          "exp's Shard(1) output is Shard(0) (2-D)"),
    # -- reduction ----------------------------------------------------------------------------
    _rule("reduction", "drop", "sum_reduced_shard", ["sum"], drop(reduced_to(PSUM)),
          "sum loses [P(sum), S(d)] over a reduced dim"),
    _rule("reduction", "drop", "sum_kept_shard", ["sum"], drop(out_shard),
          "sum loses the Shard of a kept dim"),
    _rule("reduction", "drop", "amax_passthrough", ["amax"], drop(exactly(PMAX, PMAX)),
          "amax loses [P(max), P(max)]"),
    _rule("reduction", "drop", "cumsum_partial", ["cumsum"], drop(exactly(PSUM, PSUM)),
          "cumsum loses [P(sum), P(sum)]"),
    _rule("reduction", "minmax", "amax", ["amax"], remap(reduced_to(PMAX), swap_minmax),
          "amax over a sharded dim gives P(min)"),
    _rule("reduction", "minmax", "amin", ["amin"], remap(reduced_to(PMIN), swap_minmax),
          "amin over a sharded dim gives P(max)"),
    _rule("reduction", "minmax", "any", ["any"], remap(reduced_to(PMAX), swap_minmax),
          "any over a sharded dim gives P(min) (an all)"),
    _rule("reduction", "sum", "amax", ["amax"], remap(reduced_to(PMAX), to(PSUM)),
          "amax over a sharded dim gives P(sum)"),
    _rule("reduction", "sum", "var", ["var"], add(PSUM, PSUM),
          "var keeps P(sum)"),
    _rule("reduction", "sum", "prod", ["prod"], remap(reduced_to(Partial("prod")), to(PSUM)),
          "prod over a sharded dim gives P(sum)"),
    _rule("reduction", "shard", "sum", ["sum"], remap(out_shard, shift_shard),
          "sum's Shard of a kept dim is off by one"),
    _rule("reduction", "shard", "mean", ["mean"], remap(out_shard, shift_shard),
          "mean's Shard of a kept dim is off by one"),
    # -- matmul -------------------------------------------------------------------------------
    _rule("matmul", "drop", "contraction", ["matmul"], drop(reduced_to(PSUM)),
          "matmul loses [P(sum), S(1), S(0)] (contracted dim)"),
    _rule("matmul", "drop", "row_shard", ["matmul"], drop(out_is(S0)),
          "matmul loses its first Shard(0) output"),
    _rule("matmul", "drop", "addmm_contraction", ["addmm"],
          drop(exactly(PSUM, PSUM, S1, S0)), "addmm loses the contraction candidate"),
    _rule("matmul", "drop", "bmm_batch", ["bmm"], drop(out_is(S0)),
          "bmm loses the batch-dim Shard"),
    _rule("matmul", "minmax", "matmul", ["matmul"], add(PMAX, PMAX, R),
          "matmul keeps P(max) of its first operand (it is not monotone)"),
    _rule("matmul", "minmax", "mm_min", ["mm"], add(PMIN, R, PMIN),
          "mm keeps P(min) of its second operand"),
    _rule("matmul", "sum", "bilinear", ["matmul"], add(PSUM, PSUM, PSUM),
          "matmul of two P(sum) claims P(sum)"),
    _rule("matmul", "sum", "addmm_bias", ["addmm"], add(PSUM, PSUM, R, R),
          "addmm with a P(sum) bias and replicated matrices claims P(sum)"),
    _rule("matmul", "shard", "matmul", ["matmul"], remap(out_is(S0), shift_shard),
          "matmul's Shard(0) output is Shard(1)"),
    _rule("matmul", "shard", "linear", ["linear"], remap(out_shard, shift_shard),
          "linear's Shard outputs are off by one"),
    # -- view ---------------------------------------------------------------------------------
    _rule("view", "drop", "view_shard", ["view"], drop(out_shard),
          "view loses its first Shard candidate"),
    _rule("view", "drop", "transpose_shard", ["transpose"], drop(out_shard),
          "transpose loses its first Shard candidate"),
    _rule("view", "drop", "getitem_partial", ["getitem"], drop(exactly(PSUM, PSUM)),
          "basic indexing loses [P(sum), P(sum)]"),
    _rule("view", "drop", "getitem_masked", ["getitem"], drop(masked),
          "advanced getitem loses local indexing with masking (P(sum)) on the indexed dim"),
    _rule("view", "minmax", "permute", ["permute"], remap(exactly(PMAX, PMAX), swap_minmax),
          "permute maps P(max) to P(min)"),
    _rule("view", "minmax", "reshape", ["reshape"], remap(exactly(PMIN, PMIN), swap_minmax),
          "reshape maps P(min) to P(max)"),
    _rule("view", "sum", "transpose", ["transpose"], remap(exactly(PMAX, PMAX), to(PSUM)),
          "transpose maps P(max) to P(sum)"),
    _rule("view", "sum", "unsqueeze", ["unsqueeze"], remap(exactly(PAVG, PAVG), to(PSUM)),
          "unsqueeze maps P(avg) to P(sum)"),
    _rule("view", "shard", "transpose", ["transpose"], remap(out_shard, shift_shard),
          "transpose's Shard outputs are off by one"),
    _rule("view", "shard", "unsqueeze", ["unsqueeze"], remap(out_shard, shift_shard),
          "unsqueeze's Shard outputs are off by one"),
    # -- tensor -------------------------------------------------------------------------------
    _rule("tensor", "drop", "cat_shard", ["cat"], drop(out_shard),
          "cat loses its Shard candidate"),
    _rule("tensor", "drop", "stack_shard", ["stack"], drop(out_shard),
          "stack loses its first Shard candidate"),
    _rule("tensor", "drop", "fill_sum", ["fill_"], drop(exactly(PSUM, PSUM, PSUM)),
          "fill_ of a P(sum) tensor loses its candidate"),
    _rule("tensor", "minmax", "cat", ["cat"], remap(out_is(PMAX), swap_minmax),
          "cat maps P(max) to P(min)"),
    _rule("tensor", "minmax", "flip", ["flip"], remap(exactly(PMIN, PMIN), swap_minmax),
          "flip maps P(min) to P(max)"),
    _rule("tensor", "sum", "tril", ["tril"], remap(exactly(PMAX, PMAX), to(PSUM)),
          "tril maps P(max) to P(sum)"),
    _rule("tensor", "sum", "fill_unsplit", ["fill_"], put(exactly(PSUM, PSUM, PSUM), 2, R),
          "fill_ of a P(sum) tensor writes the value on every coordinate (counted k times)"),
    _rule("tensor", "shard", "cat", ["cat"], remap(out_shard, shift_shard),
          "cat's Shard output is off by one"),
    _rule("tensor", "shard", "flip", ["flip"], remap(out_shard, shift_shard),
          "flip's Shard output is off by one"),
    # -- nn -----------------------------------------------------------------------------------
    _rule("nn", "drop", "embedding_rows", ["embedding"], drop(exactly(PSUM, R, S0)),
          "embedding loses the row-sharded weight candidate (MaskPartial)"),
    _rule("nn", "drop", "softmax_shard", ["softmax"], drop(out_shard),
          "softmax loses its Shard candidate"),
    _rule("nn", "drop", "cross_entropy_sum", ["cross_entropy"], drop(out_is(PSUM)),
          "cross_entropy(reduction='sum') loses [P(sum), S(0), S(0)]"),
    _rule("nn", "drop", "cross_entropy_vocab", ["cross_entropy"], drop(vocab),
          "cross_entropy loses the vocab-parallel candidate (the logits are gathered)"),
    _rule("nn", "sum", "cross_entropy_vocab", ["cross_entropy"], remap(vocab, to(PSUM)),
          "the vocab-parallel loss claims P(sum) (every shard holds the whole loss)"),
    _rule("nn", "minmax", "dropout", ["dropout"], remap(exactly(PMAX, PMAX), swap_minmax),
          "dropout maps P(max) to P(min)"),
    _rule("nn", "minmax", "embedding", ["embedding"], remap(exactly(PMAX, R, PMAX), swap_minmax),
          "embedding of a P(max) weight claims P(min)"),
    _rule("nn", "sum", "softmax", ["softmax"], add(PSUM, PSUM),
          "softmax keeps P(sum)"),
    _rule("nn", "sum", "layer_norm", ["layer_norm"], add(PSUM, PSUM),
          "layer_norm keeps P(sum) (weight and bias replicated)"),
    _rule("nn", "shard", "embedding", ["embedding"], remap(out_shard, shift_shard),
          "embedding's Shard outputs are off by one"),
    _rule("nn", "shard", "softmax", ["softmax", "log_softmax"], remap(out_shard, shift_shard),
          "softmax's Shard output moves onto the softmax dim"),
    # -- index --------------------------------------------------------------------------------
    _rule("index", "drop", "gather_shard", ["gather"], drop(out_shard),
          "gather loses its Shard candidates (kept dims)"),
    _rule("index", "minmax", "index_select", ["index_select"],
          remap(exactly(PMAX, PMAX, R), swap_minmax),
          "index_select of a P(max) input claims P(min)"),
    _rule("index", "sum", "masked_fill", ["masked_fill"], add(PSUM, PSUM, R, R),
          "masked_fill of a P(sum) input takes the fill value on every rank"),
    _rule("index", "shard", "index_select", ["index_select"], remap(out_shard, shift_shard),
          "index_select's Shard output is off by one"),
    _rule("index", "drop", "index_add_masked", ["index_add"], drop(exactly(S0, S0, R, R)),
          "index_add loses the sharded indexed dim (each shard adds its block's rows)"),
    _rule("index", "sum", "index_add", ["index_add"], add(PSUM, PSUM, R, R),
          "index_add of a P(sum) input and a replicated source claims P(sum)"),
    _rule("index", "minmax", "index_put", ["index_put"],
          remap(exactly(PMAX, PMAX, R), swap_minmax),
          "index_put of a P(max) input claims P(min)"),
    _rule("index", "shard", "index_add", ["index_add"], remap(out_shard, shift_shard),
          "index_add's Shard output is off by one"),
    _rule("index", "drop", "getitem_masked_several", ["getitem"], drop_several(masked),
          "advanced getitem indexing several dims (index arrays broadcasting together, a "
          "mask of several dims) loses local indexing with masking: the indexed dims gather"),
    # -- plan ---------------------------------------------------------------------------------
    _plan("all_reduce", without("all_reduce"), "plans lose their AllReduce steps"),
    _plan("all_gather", without("all_gather"), "plans lose their AllGather steps"),
    _plan("reduce_scatter", without("reduce_scatter"), "plans lose their ReduceScatter steps"),
    _plan("all_to_all", without("all_to_all"), "plans lose their AllToAll steps"),
    _plan("partition_partial", without("partition_partial"),
          "plans skip the PartitionPartial (R -> P) steps"),
    _plan("local_chunk", without("local_chunk"), "plans lose their LocalChunk (R -> S) steps"),
    _plan("first", _drop_first, "plans of several steps lose their first step"),
    _plan("last", _drop_last, "plans of several steps lose their last step"),
    # -- source lines, every layer ------------------------------------------------------------
    *(Mutation(m.name, m.layer, "source", m.description, m.patch, m.note)
      for m in SOURCE_MUTATIONS),
)

_BY_NAME = {m.name: m for m in MUTATIONS}


def get(name: str) -> Mutation:
    """The mutation called ``name``. **Local**.

    Raises ConfigError naming the known mutations when there is none.
    """
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ConfigError(
            f"mutation: no mutation named {name!r}; `python -m launch mutate --list` shows them"
        ) from None
