"""Rule-level tests of the sharding rules and of the N-D expander ``propagate``.

Pure metadata: no data, no MPI (the data-level checks live in test_validator.py).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from placements import MeshShape, Partial, Replicate, Shard, local_shape, max_local_shape
from placements.cache import all_stats, clear_all, get_cache
from placements.errors import ArgumentError, DTypeError, NoRuleError, ShardingError, SignatureError
from placements.rules import (
    ArgMeta,
    OpSchema,
    RuleResult,
    _core,
    get_rule,
    nd_valid,
    propagate,
    register_rule,
    rule_names,
    rule_statics,
)
from placements.rules.matmul import parse_einsum
from placements.rules.view import reshape_groups

pytestmark = pytest.mark.mode_independent  # see tests/conftest.py

R = Replicate()
S = Shard
P = Partial
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)
I64 = np.dtype(np.int64)
I32 = np.dtype(np.int32)
BOOL = np.dtype(np.bool_)


def t(shape, dtype=F32, placements=None):
    return ArgMeta(tuple(shape), np.dtype(dtype), placements)


def scalar(value):
    dtype = {bool: BOOL, int: I64, float: F32}[type(value)]
    return ArgMeta((), dtype, None, True)


def rule(op, *args, mesh=(2,), **static):
    schema = OpSchema(op, tuple(args), tuple(static.items()), tuple(mesh))
    return get_rule(op)(schema)


def cands(result):
    return {tuple(c.placements) for c in result.candidates}


def choose(op, *args, mesh=(2,), cost=None, **static):
    schema = OpSchema(op, tuple(args), tuple(static.items()), tuple(mesh))
    return propagate(schema, MeshShape(mesh), cost or bytes_cost)


def bytes_cost(meta, target):
    """Elements of the argument times the number of mesh dims that change."""
    return sum(a != b for a, b in zip(meta.placements, target)) * (math.prod(meta.shape) + 1)


# -- shapes and dtypes ---------------------------------------------------------------------
def test_binary_broadcast_shape_and_promotion():
    r = rule("add", t((5, 1), I32), t((7,), F32))
    assert r.out_shapes == ((5, 7),) and r.out_dtypes == (F32,)
    # weak python scalars: float32 tensor + 2.5 is float32; int tensor + 2.5 is the default float
    assert rule("mul", t((3,), F32), scalar(2.5)).out_dtypes == (F32,)
    assert rule("mul", t((3,), I64), scalar(2.5)).out_dtypes == (F32,)
    assert rule("add", t((3,), I32), scalar(2)).out_dtypes == (I32,)
    assert rule("add", t((3,), BOOL), scalar(1)).out_dtypes == (I64,)
    # a 0-d tensor only matters when its category is higher
    assert rule("add", t((3,), I32), t((), F64)).out_dtypes == (F64,)
    assert rule("add", t((3,), F32), t((), F64)).out_dtypes == (F32,)


def test_division_comparison_and_default_float_dtypes():
    assert rule("div", t((3,), I64), t((3,), I64)).out_dtypes == (F32,)
    schema = OpSchema("div", (t((3,), I64), t((3,), I64)), (), (2,), F64)
    assert get_rule("div")(schema).out_dtypes == (F64,)
    assert rule("div", t((3,), I64), t((3,), I64), rounding_mode="floor").out_dtypes == (I64,)
    assert rule("lt", t((3,), F32), scalar(1)).out_dtypes == (BOOL,)
    assert rule("exp", t((3,), I64)).out_dtypes == (F32,)


def test_incompatible_shapes_raise_sharding_error():
    with pytest.raises(ShardingError, match=r"add: shapes \(2, 3\) and \(4,\) do not broadcast"):
        rule("add", t((2, 3)), t((4,)))
    with pytest.raises(ShardingError, match="broadcast shape"):
        rule("add_", t((3,)), t((2, 3)))


def test_reduction_shapes_and_dtypes():
    r = rule("sum", t((4, 5, 6), I32), dim=(0, 2), keepdim=True)
    assert r.out_shapes == ((1, 5, 1),) and r.out_dtypes == (I64,)
    assert rule("sum", t((4, 5), BOOL)).out_shapes == ((),)
    assert rule("sum", t((4, 5)), dtype=np.float64).out_dtypes == (F64,)
    assert rule("argmax", t((4, 5)), dim=-1).out_dtypes == (I64,)
    r = rule("max", t((4, 5)), dim=1, keepdim=False)
    assert r.out_shapes == ((4,), (4,)) and r.out_dtypes == (F32, I64)
    with pytest.raises(DTypeError, match="mean"):
        rule("mean", t((4, 5), I64))
    with pytest.raises(IndexError, match=r"range of \[-2, 1\], but got 2"):
        rule("sum", t((4, 5)), dim=2)


def test_product_shapes():
    assert rule("matmul", t((2, 1, 5, 4)), t((3, 4, 2))).out_shapes == ((2, 3, 5, 2),)
    assert rule("matmul", t((7,)), t((7,))).out_shapes == ((),)
    assert rule("matmul", t((5, 7)), t((7,))).out_shapes == ((5,),)
    assert rule("linear", t((2, 5, 4)), t((6, 4)), t((6,))).out_shapes == ((2, 5, 6),)
    assert rule("einsum", t((5, 7)), t((3, 7)), equation="ij,kj").out_shapes == ((5, 3),)
    assert parse_einsum("...ij,...jk->...ik", [3, 2]) == (["aij", "jk"], "aik")


def test_view_shapes():
    assert rule("view", t((4, 6)), shape=(2, -1)).out_shapes == ((2, 12),)
    assert rule("getitem", t((5, 7)), idx=(None, Ellipsis, 0)).out_shapes == ((1, 5),)
    assert rule("getitem", t((8, 12)), idx=(slice(None, None, 2), 3)).out_shapes == ((4,),)
    assert rule("split", t((5, 7)), split_size_or_sections=2, dim=0).out_shapes == (
        (2, 7), (2, 7), (1, 7))
    assert rule("chunk", t((3, 2)), chunks=4, dim=0).out_shapes == ((1, 2),) * 3
    assert rule("squeeze", t((5, 1, 7)), dim=None).out_shapes == ((5, 7),)
    with pytest.raises(RuntimeError, match=r"shape '\[3, 5\]' is invalid for input of size 8"):
        rule("view", t((2, 4)), shape=(3, 5))


def test_getitem_masks_every_dim_of_its_advanced_entries():
    # one candidate per dim of the advanced entries (arrays, a mask's dims, an int among
    # arrays), each deferring an all-reduce of the whole result; none for basic indexing
    def masked(idx, shape=(5, 7, 3)):
        res = rule("getitem", t(shape), idx=idx)
        return {c.placements[1]: c.reduces for c in res.candidates
                if c.placements[0] == P("sum") and c.placements[1].is_shard()}

    rows, cols = np.array([[4], [0]]), np.array([6, 1, 1])
    assert masked((rows, cols)) == {S(0): (6 * 3,), S(1): (6 * 3,)}
    assert masked((1, slice(None), np.array([2, 0]))) == {S(0): (2 * 7,), S(2): (2 * 7,)}
    assert masked((slice(None), np.ones((7, 3), bool))) == {S(1): (5 * 21,), S(2): (5 * 21,)}
    assert masked((1, slice(None), 2)) == {}
    st_ = choose("getitem", t((64, 8), placements=(S(0), S(1))), mesh=(2, 2),
                 idx=(np.array([3, 60]), np.array([7, 0])))
    assert st_.input_placements[0] == (S(0), S(1))  # nothing moved; two deferred reduces
    assert st_.output_specs[0].placements == (P("sum"), P("sum")) and st_.cost == 2 * (2 + 1)


# -- candidates ----------------------------------------------------------------------------------
def test_pointwise_partial_candidates():
    add = cands(rule("add", t((4, 6)), t((4, 6))))
    assert (P("sum"), P("sum"), P("sum")) in add
    assert (P("max"), P("max"), R) in add
    mul = cands(rule("mul", t((4, 6)), t((4, 6))))
    assert (P("sum"), P("sum"), R) in mul and (P("sum"), R, P("sum")) in mul
    assert (P("sum"), P("sum"), P("sum")) not in mul  # bilinear, not linear
    relu = cands(rule("relu", t((4, 6))))
    assert (P("max"), P("max")) in relu and (P("sum"), P("sum")) not in relu
    neg = cands(rule("neg", t((4, 6))))
    assert (P("min"), P("max")) in neg and (P("sum"), P("sum")) in neg
    assert not any(p.is_partial() for c in cands(rule("abs", t((4, 6)))) for p in c)
    assert (P("sum"), P("sum"), R) not in cands(
        rule("div", t((4, 6)), t((4, 6)), rounding_mode="trunc"))


def test_broadcast_dim_is_replicated_on_the_broadcasting_operand():
    c = cands(rule("add", t((4, 6)), t((1, 6))))
    assert (S(0), S(0), R) in c and (S(1), S(1), S(1)) in c
    c = cands(rule("add", t((4, 6)), scalar(2.0)))
    assert (S(1), S(1), R) in c


def test_reduction_candidates():
    c = cands(rule("sum", t((4, 6)), dim=0))
    assert (P("sum"), S(0)) in c and (S(0), S(1)) in c and (P("sum"), P("sum")) in c
    c = cands(rule("amax", t((4, 6)), dim=1, keepdim=True))
    assert (P("max"), S(1)) in c and (S(0), S(0)) in c and (P("max"), P("max")) in c
    c = cands(rule("var", t((4, 6)), dim=1))
    assert c == {(R, R), (S(0), S(0))}
    c = cands(rule("cumsum", t((4, 6)), dim=0))
    assert (S(1), S(1)) in c and (S(0), S(0)) not in c and (P("sum"), P("sum")) in c
    assert cands(rule("argmax", t((4, 6)))) == {(R, R)}  # flat index: all dims unsharded


def test_einsum_contraction_gives_partial_sum():
    c = cands(rule("matmul", t((8, 6)), t((6, 4))))
    assert (P("sum"), S(1), S(0)) in c  # contracted k
    assert (S(0), S(0), R) in c and (S(1), R, S(1)) in c
    assert (P("sum"), P("sum"), R) in c and (P("sum"), R, P("sum")) in c
    c = cands(rule("bmm", t((2, 8, 6)), t((2, 6, 4))))
    assert (S(0), S(0), S(0)) in c
    c = cands(rule("einsum", t((5, 7)), equation="ij->j"))
    assert (P("sum"), S(0)) in c and (S(0), S(1)) in c
    # a broadcast batch dim: the size-1 operand is Replicate there
    c = cands(rule("matmul", t((1, 5, 4)), t((3, 4, 2))))
    assert (S(0), R, S(0)) in c


def test_addmm_bias_follows_the_output():
    c = cands(rule("addmm", t((3,)), t((5, 7)), t((7, 3))))
    assert (S(1), S(0), R, S(1)) in c  # bias sharded like the output's columns
    assert (S(0), R, S(0), R) in c  # bias broadcast along rows: replicated
    assert (P("sum"), P("sum"), S(1), S(0)) in c  # contraction: bias split as P(sum)
    assert (P("sum"), P("sum"), R, R) not in c  # the product would count k times


def test_softmax_layer_norm_embedding_cross_entropy_candidates():
    c = cands(rule("softmax", t((4, 6)), dim=1))
    assert c == {(R, R), (S(0), S(0)), (S(1), S(1))}
    # the softmax dim sharded: the kernel all-reduces the 4 row maxima and sums
    (vocab,) = [c for c in rule("softmax", t((4, 6)), dim=1).candidates if c.collective]
    assert vocab.placements == (S(1), S(1)) and vocab.reduces == (4, 4)
    c = cands(rule("layer_norm", t((4, 6, 8)), t((8,)), t((8,)), normalized_shape=(8,)))
    assert (S(1), S(1), R, R) in c and not any(p == S(2) for x in c for p in x)
    c = cands(rule("embedding", t((5,), I64), t((10, 6))))
    assert (P("sum"), R, S(0)) in c and (S(1), R, S(1)) in c and (S(0), S(0), R) in c
    c = cands(rule("cross_entropy", t((5, 7)), t((5,), I64), None, reduction="sum"))
    assert (P("sum"), S(0), S(0), None) in c and (R, S(1), R, None) in c
    res = rule("cross_entropy", t((5, 7)), t((5,), I64), None, reduction="mean")
    assert cands(res) == {(R, R, R, None), (R, S(1), R, None), (P("sum"), S(0), S(0), None)}
    batch, vocab = [c for c in res.candidates if c.collective]
    # a batch-sharded mean all-reduces its denominator (one number); vocab-parallel
    assert batch.placements == (P("sum"), S(0), S(0), None) and batch.reduces == (1,)
    assert vocab.placements == (R, S(1), R, None) and vocab.reduces == (5, 10)
    # probability targets: the denominator is the sample count, nothing to reduce
    res = rule("cross_entropy", t((5, 7)), t((5, 7)), None, reduction="mean")
    (batch,) = [c for c in res.candidates if c.placements[0] == P("sum")]
    assert batch.placements == (P("sum"), S(0), S(0), None) and not batch.collective


def test_view_uneven_flatten_is_exact_only_when_chunks_match():
    mesh = (2,)
    even = rule("view", t((4, 3)), shape=(-1,), mesh=mesh)
    uneven = rule("view", t((5, 3)), shape=(-1,), mesh=mesh)
    cand = next(c for c in even.candidates if c.placements == (S(0), S(0)))
    assert nd_valid(even, (cand,))
    cand = next(c for c in uneven.candidates if c.placements == (S(0), S(0)))
    assert not nd_valid(uneven, (cand,))  # rows 3+2 -> 9+6 elements, chunks of 15 are 8+7
    # a sharded non-first dim of a merged group never carries over
    assert (S(0), S(1)) not in cands(rule("view", t((4, 3)), shape=(12,)))


def test_view_of_uneven_shards_requires_replicate_but_never_raises():
    st_ = choose("view", t((5, 3), placements=(S(0),)), shape=(-1,))
    assert st_.input_placements == ((R,),) and st_.output_specs[0].placements == (R,)
    assert st_.cost > 0
    st_ = choose("view", t((4, 3), placements=(S(0),)), shape=(-1,))
    assert st_.input_placements == ((S(0),),) and st_.cost == 0
    # (3, 2) over 4: rows 1,1,1,0 -> 2,2,2,0 elements = chunks of 6 over 4: exact
    st_ = choose("view", t((3, 2), placements=(S(0),)), shape=(6,), mesh=(4,))
    assert st_.output_specs[0].placements == (S(0),)


def test_view_nested_sharding_on_2d_mesh():
    ok = choose("view", t((8, 3), placements=(S(0), S(0))), shape=(24,), mesh=(2, 2))
    assert ok.output_specs[0].placements == (S(0), S(0)) and ok.cost == 0
    # 6 rows: 3,3 then 2,1,2,1 rows = 6,3,6,3 elements; 18 elements nest as 5,4,5,4
    bad = choose("view", t((6, 3), placements=(S(0), S(0))), shape=(18,), mesh=(2, 2))
    assert bad.output_specs[0].placements != (S(0), S(0)) and bad.cost > 0


@given(
    rows=st.integers(0, 12),
    cols=st.integers(1, 5),
    mesh=st.sampled_from([(2,), (3,), (4,), (2, 2), (2, 3)]),
)
def test_flatten_exactness_matches_layout(rows, cols, mesh):
    """nd_check accepts [S(0)] on every mesh dim exactly when each coordinate's flattened
    block is its torch.chunk shard of the flattened tensor."""
    result = rule("view", t((rows, cols)), shape=(rows * cols,), mesh=mesh)
    found = [c for c in result.candidates if c.placements == (S(0), S(0))]
    if not found:  # empty or size-1 rows: the rule keeps it Replicate (always correct)
        assert rows * cols == 0 or rows == 1
        return
    combo = (found[0],) * len(mesh)
    pl = (S(0),) * len(mesh)
    exact = all(
        local_shape((rows, cols), mesh, pl, coord)[0] * cols
        == local_shape((rows * cols,), mesh, pl, coord)[0]
        for coord in np.ndindex(*mesh)
    )
    assert nd_valid(result, combo) == exact


def test_reshape_groups():
    assert reshape_groups((2, 3, 4), (6, 4)) == [((0, 1), (0,)), ((2,), (1,))]
    assert reshape_groups((4, 6), (4, 2, 3)) == [((0,), (0,)), ((1,), (1, 2))]
    assert reshape_groups((5, 1, 7), (5, 7)) == [((0,), (0,)), ((2,), (1,))]


def test_cat_dim_must_be_unsharded():
    c = cands(rule("cat", t((4, 6)), t((2, 6)), dim=0))
    assert (S(1), S(1), S(1)) in c and not any(p == S(0) for x in c for p in x)
    c = cands(rule("stack", t((4, 6)), t((4, 6)), dim=1))
    assert (S(2), S(1), S(1)) in c and (S(0), S(0), S(0)) in c


# -- propagate ---------------------------------------------------------------------------------
def test_partial_sum_plus_scalar_adds_once():
    st_ = choose("add", t((4, 6), placements=(P("sum"),)), scalar(2.0))
    assert st_.output_specs[0].placements == (P("sum"),)
    assert st_.input_placements == ((P("sum"),), (P("sum"),))  # the scalar is split
    assert st_.cost == 0
    # multiplying by a scalar keeps it whole
    st_ = choose("mul", t((4, 6), placements=(P("sum"),)), scalar(2.0))
    assert st_.input_placements == ((P("sum"),), (R,)) and st_.cost == 0


@pytest.mark.parametrize("op, args, static", [
    ("float", (0,), {}),
    ("to", (0,), {"dtype": F32}),
    ("to", (0,), {"dtype": I32}),
    ("add", (0, 1), {}),
    ("mul", (0, 3), {}),
    ("sum", (0,), {}),
    ("mean", (0,), {"dtype": F32}),
    ("cumsum", (0,), {"dim": 0}),
    ("where", ("cond", 0, 0.5), {}),
])
def test_bool_partial_sum_made_numbers_is_reduced_first(op, args, static):
    # a bool P(sum) reduces by logical or: kept P(sum) through an op that makes numbers of
    # it, contributions holding the same True would add up
    x = t((4, 6), BOOL, (P("sum"),))
    metas = [x if a == 0 else t((4, 6), BOOL, (R,)) if a == "cond" else scalar(a) for a in args]
    st_ = choose(op, *metas, **static)
    assert st_.input_placements[args.index(0)] != (P("sum"),)
    assert st_.output_specs[0].placements != (P("sum"),)


def test_bool_partial_sum_kept_where_the_result_is_bool():
    x = t((4, 6), BOOL, (P("sum"),))
    # or of bools commutes with or, and, where of bools
    assert choose("add", x, x).output_specs[0].placements == (P("sum"),)
    assert choose("mul", x, t((4, 6), BOOL, (R,))).output_specs[0].placements == (P("sum"),)
    assert choose("to", x, dtype=BOOL).output_specs[0].placements == (P("sum"),)
    # a python bool added to a float P(sum) is held by one coordinate: it counts once
    st_ = choose("add", t((4, 6), F32, (P("sum"),)), scalar(True))
    assert st_.output_specs[0].placements == (P("sum"),) and st_.cost == 0


@pytest.mark.parametrize("op", ["sum", "cumsum"])
def test_no_rule_makes_an_integer_partial_avg(op):
    # an average of integers has no exact integer value: a float P(avg) made int64 is
    # reduced first; as a float, it stays
    x = t((4, 6), F32, (P("avg"),))
    static = {"dim": 0} if op == "cumsum" else {}
    st_ = choose(op, x, dtype=I64, **static)
    assert st_.output_specs[0].placements != (P("avg"),) and st_.input_placements[0] != (P("avg"),)
    assert choose(op, x, dtype=F64, **static).output_specs[0].placements == (P("avg"),)


def test_no_communication_when_placements_already_fit():
    st_ = choose("matmul", t((8, 6), placements=(S(0),)), t((6, 4), placements=(R,)))
    assert st_.cost == 0 and st_.output_specs[0].placements == (S(0),)
    st_ = choose("matmul", t((8, 6), placements=(S(1),)), t((6, 4), placements=(S(0),)))
    assert st_.cost == 0 and st_.output_specs[0].placements == (P("sum"),)
    st_ = choose("sum", t((8, 6), placements=(S(0), S(1))), mesh=(2, 2), dim=0)
    assert st_.cost == 0 and st_.output_specs[0].placements == (P("sum"), S(0))


def test_cost_based_choice_follows_the_cost_function():
    x, y = t((8, 6), placements=(S(0),)), t((8, 6), placements=(S(1),))

    def prefer(target_of_y):
        def cost(meta, target):
            if meta is y and target == target_of_y:
                return 1.0
            return 100.0
        return cost

    assert choose("add", x, y, cost=prefer((S(0),))).output_specs[0].placements == (S(0),)
    # moving x instead: y keeps S(1) when moving x is cheap
    def cheap_x(meta, target):
        return 1.0 if meta is x else 100.0

    assert choose("add", x, y, cost=cheap_x).output_specs[0].placements == (S(1),)


def test_ties_break_by_candidate_list_order():
    x, y = t((8, 6), placements=(S(0),)), t((8, 6), placements=(S(1),))
    st_ = choose("add", x, y, cost=lambda meta, target: 1.0)
    # every move costs the same: R-all (first in the list) moves both, S(0) moves one
    assert st_.output_specs[0].placements == (S(0),) and st_.cost == 1.0
    # identical results on every call (pure)
    first, again = choose("add", x, y), choose("add", x, y)
    assert first == again


def test_partial_kinds_are_not_mixed_by_an_op():
    r = rule("amax", t((8, 6)), dim=(0, 1), mesh=(2, 2))
    by = {c.placements: c for c in r.candidates}
    assert nd_valid(r, (by[(P("max"), S(0))], by[(P("max"), P("max"))]))  # same kind: ok
    # a row-sharded embedding (P(sum)) of a P(max) weight would give [P(sum), P(max)]
    r = rule("embedding", t((5,), I64), t((10, 6)), mesh=(2, 2))
    by = {c.placements: c for c in r.candidates}
    assert not nd_valid(r, (by[(P("sum"), R, S(0))], by[(P("max"), R, P("max"))]))
    r = rule("add", t((8, 6)), t((8, 6)), mesh=(2, 2))
    by = {c.placements: c for c in r.candidates}
    mixed = (by[(P("sum"), P("sum"), P("sum"))], by[(P("max"), P("max"), R)])
    assert nd_valid(r, mixed)  # the first argument already holds both kinds
    r = rule("neg", t((8, 6)), mesh=(2, 2))
    by = {c.placements: c for c in r.candidates}
    assert nd_valid(r, (by[(P("min"), P("max"))], by[(P("sum"), P("sum"))]))
    r = rule("mean", t((8, 6)), dim=0, mesh=(2, 2))
    by = {c.placements: c for c in r.candidates}
    assert nd_valid(r, (by[(P("sum"), S(0))], by[(P("avg"), P("avg"))]))  # sum/avg commute
    r = rule("matmul", t((8, 6)), t((6, 4)), mesh=(2, 2))
    by = {c.placements: c for c in r.candidates}
    # P(sum) and P(avg) outputs from different operands commute: allowed
    assert nd_valid(r, (by[(P("sum"), S(1), S(0))], by[(P("avg"), P("avg"), R)]))


def test_mixed_partial_output_needs_a_mixed_input():
    r = rule("maximum", t((8, 6)), t((8, 6)), mesh=(2, 2))
    by = {c.placements: c for c in r.candidates}
    # out [P(max), P(min)] from inputs [P(max), R] and [P(max), P(min)]: input 1 is mixed
    assert nd_valid(r, (by[(P("max"), P("max"), P("max"))], by[(P("min"), R, P("min"))]))


def test_inplace_keeps_the_first_argument_placements():
    st_ = choose("add_", t((8, 6), placements=(S(0),)), t((8, 6), placements=(R,)))
    assert st_.output_specs[0].placements == (S(0),)
    assert st_.input_placements == ((S(0),), (S(0),))
    st_ = choose("add_", t((8, 6), placements=(P("sum"),)), scalar(1.0))
    assert st_.input_placements == ((P("sum"),), (P("sum"),))
    with pytest.raises(ShardingError, match=r"relu_: .*in-place.*\[P\(sum\)\]"):
        choose("relu_", t((8, 6), placements=(P("sum"),)))


def test_no_rule_error_names_the_closest_op():
    with pytest.raises(NoRuleError, match=r"'addd'.*closest supported op is 'add'"):
        get_rule("addd")
    with pytest.raises(NotImplementedError):
        get_rule("no_such_op_at_all")


def test_output_specs_carry_mesh_shape_dtype():
    mesh = MeshShape((2, 2))
    schema = OpSchema("matmul", (t((8, 6), placements=(S(0), R)), t((6, 4), F32, (R, S(1)))),
                      (), (2, 2))
    st_ = propagate(schema, mesh, bytes_cost)
    spec = st_.output_specs[0]
    assert spec.mesh is mesh and spec.shape == (8, 4) and spec.dtype == F32
    assert spec.placements == (S(0), S(1))


def test_inplace_result_must_be_castable_to_the_input():
    with pytest.raises(DTypeError, match="div_: result type float32 can't be cast"):
        rule("div_", t((3,), I64), t((3,), I64))
    assert rule("add_", t((3,), F32), t((3,), I64)).out_dtypes == (F32,)


# -- statics ---------------------------------------------------------------------------------------
def test_every_op_with_a_rule_declares_its_statics():
    assert set(_core._RULES) == set(_core._STATICS) == set(rule_names())
    for op in rule_names():
        names = rule_statics(op)
        assert isinstance(names, tuple) and len(set(names)) == len(names), op
        assert all(isinstance(n, str) and n for n in names), op
    assert rule_statics("sum") == ("dim", "keepdim", "dtype")
    assert rule_statics("amax") == ("dim", "keepdim") and rule_statics("relu") == ()
    assert rule_statics("div_") == ("rounding_mode",)  # in-place forms read their op's
    with pytest.raises(NoRuleError, match="'summ'"):
        rule_statics("summ")


def test_a_rule_reading_an_undeclared_static_raises():
    seen = {}

    @register_rule("test_undeclared_static", static=("dim",))
    def reads_two(schema):
        seen["dim"] = schema.get("dim", 7)  # declared, not bound: the default
        schema.get("keepdim")  # not declared
        return RuleResult(((),), (F32,), ())

    try:
        msg = r"test_undeclared_static: .*'keepdim'.*\('dim',\)"
        with pytest.raises(SignatureError, match=msg):
            rule("test_undeclared_static", t((4,)))
        assert seen["dim"] == 7
        with pytest.raises(TypeError, match="'dtype'"):  # a real rule: amax has no dtype
            OpSchema("amax", (t((4,)),), (("dim", 0), ("keepdim", False)), (2,)).get("dtype")
        # register_rule(name) alone means "no statics"
        register_rule("test_undeclared_static")(reads_two)
        assert rule_statics("test_undeclared_static") == ()
        with pytest.raises(SignatureError, match="'dim'"):
            rule("test_undeclared_static", t((4,)), dim=0)
    finally:
        _core._RULES.pop("test_undeclared_static", None)
        _core._STATICS.pop("test_undeclared_static", None)


def test_register_rule_rejects_bad_static_declarations():
    with pytest.raises(ArgumentError, match="sequence of parameter names"):
        register_rule("test_bad_static", static="dim")
    with pytest.raises(ArgumentError, match=r"\['other'\]"):
        register_rule("test_bad_static", static={"other": ("dim",)})
    assert "test_bad_static" not in rule_names()


# -- caches ----------------------------------------------------------------------------------------
_PLACEMENTS_CACHES = (
    "placements.rules.results",
    "placements.rules.view.nested_exact",
    "placements.meta.promote_types",
    "placements.layout.normalized",
    "placements.layout.box",
    "placements.layout.max_local_shape",
)


def test_module_caches_are_registered_and_clear_all_empties_them():
    assert {n for n in all_stats() if n.startswith("placements.")} >= set(_PLACEMENTS_CACHES)
    # fill every one: a propagation (rule results, promotion, a nested reshape check) and
    # layout queries
    choose("view", t((8, 3), I32, (S(0), S(0))), shape=(24,), mesh=(2, 2))
    choose("add", t((8, 3), I32, (S(0), R)), t((), F64), mesh=(2, 2))
    local_shape((5, 3), (2,), (S(0),), (1,))
    max_local_shape((5, 3), (2,), (S(0),))
    sizes = {n: get_cache(n).stats()["size"] for n in _PLACEMENTS_CACHES}
    assert all(sizes.values()), sizes
    clear_all()
    sizes = {n: get_cache(n).stats() for n in _PLACEMENTS_CACHES}
    assert all(s["size"] == 0 and s["hits"] == s["misses"] == 0 for s in sizes.values()), sizes
    # clearing changes costs only: the same call gives the same strategy
    a = choose("add", t((8, 3), I32, (S(0), R)), t((), F64), mesh=(2, 2))
    assert a == choose("add", t((8, 3), I32, (S(0), R)), t((), F64), mesh=(2, 2))
    assert get_cache("placements.rules.results").stats()["hits"] == 1


def test_views_keep_shard_and_partial_candidates():
    """transpose moves each Shard to the swapped dim and keeps every Partial; basic indexing
    keeps a Shard of a dim it does not slice and every Partial (each contribution indexed
    alike): all without communication."""
    tr = cands(rule("transpose", t((4, 6)), dim0=0, dim1=1))
    assert {(S(1), S(0)), (S(0), S(1)), (P("sum"), P("sum")), (P("max"), P("max"))} <= tr
    assert (S(0), S(0)) not in tr
    gi = cands(rule("getitem", t((4, 6)), idx=(slice(1, 3),)))
    assert {(S(1), S(1)), (P("sum"), P("sum")), (P("avg"), P("avg")), (P("min"), P("min"))} <= gi


def test_fill_of_a_partial_sum_splits_a_partial_sum_value():
    """fill_ of a P(sum) tensor with a 0-d tensor value keeps P(sum) when the value is
    P(sum) too (each rank writes its contribution), without communication; a Shard or a
    P(max) keeps its placement with a replicated value."""
    fill = cands(rule("fill_", t((4, 6)), t(())))
    assert {(P("sum"), P("sum"), P("sum")), (S(0), S(0), R), (P("max"), P("max"), R)} <= fill
    assert (P("sum"), P("sum"), R) not in fill  # the value would count once per rank


def test_index_ops_keep_their_shard_candidates():
    """gather keeps a Shard of a dim the index has at full size (each rank gathers its rows,
    the index's rows of its block cut locally); index_add keeps the indexed dim sharded
    (each shard adds the source rows whose indices land in its block, masked) and another
    dim sharded with the source alike: all without communication."""
    ga = cands(rule("gather", t((4, 6)), t((4, 3), I64), dim=1))
    assert (S(0), S(0), R) in ga
    assert (S(1), S(1), R) not in ga  # the gathered dim
    ia = cands(rule("index_add", t((5, 6)), t((3,), I64), t((3, 6)), dim=0))
    assert {(S(0), S(0), R, R), (S(1), S(1), R, S(1))} <= ia
