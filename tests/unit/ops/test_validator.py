"""The strategy validator over every op of the table (quick mode: two shapes per family and a
sample of the 2-D mesh combinations; ``python -m dtensor.validate`` runs the full set), and
checks that the validator itself catches wrong rules.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import dtensor as dt
from dtensor.debug import validate as V
from dtensor.ops import samples as S
from dtensor.ops.table import OPS, OpInfo, add_record
from placements import MeshShape, Partial, Replicate, Shard
from placements.rules import ArgMeta, Candidate, OpSchema, RuleResult, _core, get_rule, propagate

_NAMES = sorted(OPS)
_CHUNKS = 8
_GROUPS = [_NAMES[i::_CHUNKS] for i in range(_CHUNKS)]


def test_every_op_has_a_rule_and_sample_calls():
    for name, info in OPS.items():
        get_rule(info.rule)
        assert info.samples in S.FAMILIES, name


def test_sample_calls_are_bound_with_their_global_results():
    assert all(V.sample_calls(OPS[name]) for name in _NAMES)
    state = dt.get_rng_state().numpy().tobytes()
    V.sample_calls(OPS["dropout"])  # its kernel draws: the generator is left as it was
    assert dt.get_rng_state().numpy().tobytes() == state
    for name in ("add", "add_", "cat", "where", "dropout", "max", "getitem"):
        info = OPS[name]
        calls = V.sample_calls(info, seed=3)
        again = V.sample_calls(info, seed=3)
        assert [c.label for c in calls] == [c.label for c in again]
        for call, twin in zip(calls, again):
            assert call.info is info and len(call.values) == len(info.params)
            for slot in call.slots:
                v, w = call.arg(slot), twin.arg(slot)
                assert v is None or isinstance(v, (np.ndarray, bool, int, float)), (name, v)
                assert np.array_equal(v, w, equal_nan=v.dtype.kind == "f") if isinstance(
                    v, np.ndarray) else v == w
            dt.set_rng_state(call.rng_state)  # the kernel on the values gives ``want``
            out = info.kernel(*[V._as_kernel_value(v) for v in call.values])
            outs = [out] if isinstance(out, dt.Tensor) else list(out)
            for o, w in zip(outs, call.want, strict=True):
                np.testing.assert_array_equal(o.numpy(), w)
    tol = {c.label: c.tolerance for c in V.sample_calls(OPS["add"])}
    assert tol["float32(3, 2)(3, 2)same"] == 1e-4 and tol["int64(3, 2)(3, 2)same"] == 0.0
    assert V.sample_calls(OpInfo("no_samples", OPS["neg"].kernel, ("input",), ("input",))) == []


# the rules' check: the sharded simulation and its reference run the same local kernels, so
# the path DTENSOR_FASTPATH picks for them cannot change the outcome (tests/conftest.py)
@pytest.mark.mode_independent
@pytest.mark.parametrize("group", range(_CHUNKS))
def test_every_candidate_of_every_rule(group):
    report = V.validate(_GROUPS[group], quick=True)
    bad = [f"{r.name}: {m}" for r in report.ops for m in r.mismatches[:3]]
    assert not bad, "\n".join(bad)
    for r in report.ops:  # every op was exercised on data
        assert r.cases > 0 and r.strategies > 0, r


def _install(name: str, kernel, rule_fn, params=("input",), static=()):
    """Register a test-only op (drawing view samples) with its own rule; returns a cleanup
    function."""
    add_record(OpInfo(name, kernel, params, ("input",), static, {}, samples="view"))
    _core._RULES[name] = rule_fn

    def cleanup():
        OPS.pop(name, None)
        _core._RULES.pop(name, None)
        _core._RESULTS.clear()

    return cleanup


def test_validator_catches_a_wrong_partial():
    def bad_rule(schema):  # amax over a sharded dim claimed to be P(sum): wrong
        a = schema.args[0]
        cands = (Candidate((Replicate(), Replicate())), Candidate((Partial("sum"), Shard(0))))
        return RuleResult(((),), (a.dtype,), cands)

    cleanup = _install("test_bad_amax", lambda x: dt.amax(x), bad_rule)
    S.VIEW_CASES["test_bad_amax"] = (((5, 7), {}),)
    try:
        report = V.validate(["test_bad_amax"], meshes=((2,), (4,)))
        assert report.mismatches > 0
        assert any("P(sum),S(0)" in m and "values differ" in m for m in report.ops[0].mismatches)
    finally:
        cleanup()
        del S.VIEW_CASES["test_bad_amax"]


def test_validator_catches_a_wrong_local_shape():
    def bad_rule(schema):  # a view keeping S(0) on a non-exact merge of uneven rows
        a = schema.args[0]
        n = a.shape[0] * a.shape[1]
        cands = (Candidate((Replicate(), Replicate())), Candidate((Shard(0), Shard(0))))
        return RuleResult(((n,),), (a.dtype,), cands)

    cleanup = _install("test_bad_flatten", lambda x: x.reshape(-1), bad_rule)
    S.VIEW_CASES["test_bad_flatten"] = (((5, 3), {}),)
    try:
        report = V.validate(["test_bad_flatten"], meshes=((2,),))
        assert any("spec promises" in m for m in report.ops[0].mismatches)
    finally:
        cleanup()
        del S.VIEW_CASES["test_bad_flatten"]


def test_command_line(capsys):
    assert V.main(["--quick", "--op", "relu", "--op", "matmul"]) == 0
    out = capsys.readouterr().out
    assert "relu" in out and "matmul" in out
    assert "2 ops," in out and "0 mismatches" in out


def test_mean_over_uneven_shards_is_exact():
    """mean(dim=0) of 5 rows over 4 coordinates (2, 2, 1, 0 rows): the P(sum) of the local
    kernels equals the global mean (each scales its local sum by 1/5, the empty one gives 0)."""
    x = np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32)
    schema = OpSchema("mean", (ArgMeta((5, 7), x.dtype, (Shard(0),)),),
                      (("dim", 0), ("keepdim", False), ("dtype", None)), (4,))
    strategy = propagate(schema, MeshShape((4,)), lambda m, t: 0.0)
    assert strategy.output_specs[0].placements == (Partial("sum"),)
    total = np.zeros(7, np.float32)
    for c in range(4):
        mesh = dt.AbstractMesh((4,), coord=(c,))
        st = _core.strategy_of(schema, mesh, _core.rule_result(schema),
                             strategy.candidates_considered[-1][0], 0.0, ())
        kernel = OPS["mean"].local_fn(schema, st)
        lo, n = 2 * c, max(0, min(2, 5 - 2 * c))
        total += kernel(dt.from_numpy(x[lo:lo + n]), 0, False, None).numpy()
    np.testing.assert_allclose(total, x.mean(0), rtol=1e-6)


def test_collective_strategies_run_their_kernels_without_numpy_warnings():
    """The kernels of a strategy that communicates run one thread per coordinate, which does
    not inherit the caller's numpy error state: softmax of a class-sharded row holding inf
    (inf - inf) warned there, and failed under ``-W error``. They run quietly, as dispatch
    runs them."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = V.validate(["softmax"], meshes=((2,),), quick=True)
    assert not [m for r in report.ops for m in r.mismatches]
    assert report.ops[0].strategies > 0
