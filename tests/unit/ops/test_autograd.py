"""Autograd on local tensors: every backward formula of the op table, first and second
order, against central finite differences in float64 along random directions, on every one
of the validator's sample calls (a call is left out only for a stated reason), the op
table's coverage, the variants that record (functions, methods, operators, in place), grad
mode, accumulation, ``autograd.grad`` and PyTorch's errors."""

from __future__ import annotations

import weakref
from collections import Counter

import numpy as np
import pytest

import dtensor as dt
import fastpath
from dtensor.dispatch import tape as _tape
from dtensor.errors import AutogradError, DTensorError, SignatureError
from dtensor.ops import NOT_DIFFERENTIABLE, OPS
from dtensor.ops.samples import QUICK_SHAPES, Gen, cases
from dtensor.validate import sample_calls

#: Differentiable ops without a backward formula yet (recording them raises).
NO_FORMULA_YET: frozenset[str] = frozenset()

#: (op, float argument) pairs without a gradient (None): used for its shape or dtype only, or
#: not differentiable in PyTorch either (cross_entropy's weight), or not computed yet (a
#: probability target).
NO_GRAD_FOR = frozenset({("cross_entropy", "target"), ("cross_entropy", "weight"),
                         ("expand_as", "other"), ("type_as", "other")})

#: Sample calls whose derivative is not implemented (the error says so).
UNSUPPORTED: dict[str, tuple[str, ...]] = {}

#: Ops whose float and integer inputs are sampled positive (their domain, or away from a pole).
POSITIVE = frozenset({"log", "log2", "log10", "log1p", "sqrt", "rsqrt", "reciprocal", "pow",
                      "prod", "cumprod", "div", "remainder", "fmod", "addcdiv"})


def test_every_op_has_a_formula_or_is_marked():
    """An op is either given a formula, marked not differentiable, or listed here (an
    in-place op records with its out-of-place op's formula)."""
    missing = sorted(n for n, i in OPS.items() if i.backward is None)
    assert set(missing) == set(NO_FORMULA_YET), missing


#: Casts to a lower precision (finite differences would measure the rounding): checked in
#: test_accumulation_and_broadcasting.
LOWER_PRECISION = frozenset({"float", "half", "bfloat16"})


def _differentiable():
    return sorted(n for n, i in OPS.items()
                  if not i.inplace and i.backward is not None and n not in LOWER_PRECISION
                  and i.backward is not NOT_DIFFERENTIABLE)


def _inputs(name, values, rng):
    """The call's values as tensors: float arrays as float64 leaves that require grad."""
    leaves = []

    def conv(v, param):
        if isinstance(v, list):
            return [conv(e, param) for e in v]
        if not isinstance(v, np.ndarray):
            return v
        if name in POSITIVE and v.dtype.kind == "i":  # a base of pow(int, float) too
            v = np.abs(v) + 1
        if v.dtype.kind == "f":
            a = v.astype(np.float64)
            if name in POSITIVE:
                a = np.abs(a) + 0.5
            t = dt.from_numpy(a).requires_grad_()
            leaves.append((param, t))
            return t
        return dt.from_numpy(v.copy())

    return [conv(v, p) for v, p in zip(values, OPS[name].params)], leaves


def _intermediates(values):
    """The float leaves among ``values`` as intermediates of the graph (clones): a node
    keeps only a stand-in of an intermediate its formula does not declare in ``save``,
    so a formula that reads one undeclared gets zeros and fails the check."""
    def conv(v):
        if isinstance(v, list):
            return [conv(e) for e in v]
        return v.clone() if isinstance(v, dt.Tensor) and v.requires_grad else v

    return [conv(v) for v in values]


def _outputs(out):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [o for o in outs if isinstance(o, dt.Tensor) and o.dtype.kind == "f"]


def _run(info, values):
    """The op through the recorder (every variant passes it)."""
    return _tape.call(info, info.kernel, values, {})


#: Directions per float leaf of the directional-derivative check, its step and tolerance.
DIRECTIONS = 3
EPS = 1e-6
RTOL = 1e-6

#: Why a sample call may be left out of the check: every skipped call names one of these.
SKIP_REASONS = {
    "no float input": "integer or bool data only: nothing to differentiate",
    "no gradient by definition": "every float input is listed in NO_GRAD_FOR",
    "lower-precision output": "a cast below float64: finite differences measure rounding",
    "no float output": "integer or bool outputs only (a comparison, an index)",
    "non-finite input": "NaN or inf in the data on purpose: no derivative to difference "
                        "there (test_torch_differential checks those gradients against torch)",
    "gradient by definition": "a gradient the op defines instead of the derivative "
                              "(DEFINED_GRADIENTS; test_torch_differential checks it)",
    "non-finite output by definition": "finite data where the op's value is inf or NaN "
                                       "(NONFINITE_OUTPUTS; checked against torch there)",
}

#: Ops whose sample calls may give a non-finite value from finite data, and when.
NONFINITE_OUTPUTS = {
    "var": "a correction equal to the count divides by zero degrees of freedom",
    "std": "a correction equal to the count divides by zero degrees of freedom",
}

#: (op, label prefix) of sample calls whose gradient is a definition, not the derivative.
DEFINED_GRADIENTS = {
    ("embedding", "padding"): "the padding_idx row gets no gradient (PyTorch's definition)",
}


def _nonfinite(values):
    """Whether a float array among ``values`` (lists included) holds NaN or inf."""
    for v in values:
        if isinstance(v, list) and _nonfinite(v):
            return True
        if isinstance(v, np.ndarray) and v.dtype.kind == "f" and not np.isfinite(v).all():
            return True
    return False


#: Sample cases with float data that the op's kernel refuses (sample_calls leaves them out):
#: (op, label) -> why. Any other refused case with float data fails the check.
REFUSED_FLOAT_CASES = {
    ("stack", "legacy-empty"): "the join family's case of cat: stack takes one shape",
}


def _refused_float_cases(name, info, calls):
    """Labels of the op's sample cases with float data that the kernel refused."""
    def floats(v):
        if isinstance(v, list):
            return any(floats(e) for e in v)
        return isinstance(v, np.ndarray) and v.dtype.kind == "f"

    left = Counter(c.label for c in calls)
    out = []
    for case in cases(info, Gen(1), QUICK_SHAPES):  # as sample_calls(info, seed=1) draws them
        if left[case.label]:
            left[case.label] -= 1
        elif any(floats(v) for v in case.values.values()):
            out.append(case.label)
    return out


def _data_skip(name, call):
    """Why the call's data leaves it out (a key of SKIP_REASONS), or None."""
    if _nonfinite(call.values):
        return "non-finite input"
    if any(name == op and call.label.startswith(pre) for op, pre in DEFINED_GRADIENTS):
        return "gradient by definition"
    return None


def _skip_reason(name, leaves, ref):
    """Why the call is not checked (a key of SKIP_REASONS), or None."""
    if not leaves:
        return "no float input"
    if all((name, p) in NO_GRAD_FOR for p, _ in leaves):
        return "no gradient by definition"
    if not ref:
        return "no float output"
    if any(o.dtype != np.float64 for o in ref):
        return "lower-precision output"
    if name in NONFINITE_OUTPUTS and not all(np.isfinite(o.numpy()).all() for o in ref):
        return "non-finite output by definition"
    return None


def _central(base, x0, v, eps, f):
    """The central difference ``(f(x0 + eps v) - f(x0 - eps v)) / 2 eps``, writing the points
    into ``base`` (the leaf's array) and restoring ``x0`` after."""
    base[...] = x0 + eps * v
    up = float(f())
    base[...] = x0 - eps * v
    down = float(f())
    base[...] = x0
    return (up - down) / (2 * eps)


def _check_call(name, info, call, rng):
    """Check one sample call: None if checked, else the reason it was skipped.

    For each float leaf, ``<grad, v>`` against the central difference
    ``(L(x + eps v) - L(x - eps v)) / 2 eps`` of the loss ``L = sum(w * out)`` along
    DIRECTIONS random directions ``v`` covering every element (a wrong entry anywhere in
    the gradient shows in every direction, with probability one)."""
    reason = _data_skip(name, call)
    if reason is not None:
        return reason
    values, leaves = _inputs(name, call.values, rng)
    state = dt.get_rng_state()  # every evaluation draws the same random numbers
    with dt.no_grad():
        ref = _outputs(_run(info, values))
    reason = _skip_reason(name, leaves, ref)
    if reason is not None:
        return reason
    bad = [o for o in ref if not np.isfinite(o.numpy()).all()]
    assert not bad, f"{name} {call.label}: non-finite output at the sample point"
    weights = [dt.from_numpy(rng.standard_normal(tuple(o.shape))) for o in ref]

    def loss(vals):
        dt.set_rng_state(state)
        total = 0.0
        for o, w in zip(_outputs(_run(info, _intermediates(vals))), weights):
            total = (o * w).sum() + total
        return total

    if any(u in call.label for u in UNSUPPORTED.get(name, ())):
        with pytest.raises(AutogradError, match=name):
            loss(values).backward()
        return None
    loss(values).backward()
    for param, t in leaves:
        if (name, param) in NO_GRAD_FOR:
            continue
        assert t.grad is not None, f"{name} {call.label}: no gradient for {param}"
        got = t.grad.numpy()
        assert got.shape == tuple(t.shape), (
            f"{name} {call.label}: gradient of {param} has shape {got.shape}, input {t.shape}")
        base = t.detach().numpy()
        x0 = base.copy()
        for _ in range(DIRECTIONS):
            v = rng.standard_normal(base.shape)
            with dt.no_grad():
                want = _central(base, x0, v, EPS, lambda: loss(values))
            terms = got * v
            g = float(terms.sum())
            scale = 1.0 + float(np.abs(terms).sum()) + abs(want)
            assert abs(g - want) <= RTOL * scale, (
                f"{name} {call.label}: <d/d{param}, v> = {g}, finite differences {want}")
    return None


@pytest.mark.parametrize("name", _differentiable())
def test_formula_against_finite_differences(name):
    """Every sample call of the op (each dtype, shape, dim and option the validator
    samples), its float inputs in float64: the formula's gradient against central finite
    differences along random directions. A call is left out only for a reason of
    SKIP_REASONS, and at least one call is checked."""
    info = OPS[name]
    calls = sample_calls(info, seed=1)
    rng = np.random.default_rng(7)
    skipped: dict[str, list[str]] = {}
    checked = 0
    for call in calls:
        reason = _check_call(name, info, call, rng)
        if reason is None:
            checked += 1
        else:
            assert reason in SKIP_REASONS, reason
            skipped.setdefault(reason, []).append(call.label)
    assert checked, f"{name}: no sample call was checked of {len(calls)} ({skipped})"
    assert checked + sum(map(len, skipped.values())) == len(calls)
    refused = [c for c in _refused_float_cases(name, info, calls)
               if (name, c) not in REFUSED_FLOAT_CASES]
    assert not refused, f"{name}: the kernel refused the float sample calls {refused}"


def test_cat_gives_a_skipped_legacy_empty_input_an_empty_gradient():
    # found by the finite differences over every sample call: cat's formula split the
    # gradient as if a skipped 1-D empty input held a (0, 3) block, and the recorder failed
    # to shape it back to (0,)
    empty, x = _leaf(0), _leaf(4, 3, seed=1)
    w = np.random.default_rng(2).standard_normal((4, 3))
    (dt.cat([empty, x], dim=0) * dt.from_numpy(w)).sum().backward()
    assert tuple(empty.grad.shape) == (0,)
    np.testing.assert_array_equal(x.grad.numpy(), w)
    a, b = _leaf(0), _leaf(0, seed=1)  # only legacy empties: a plain 1-D cat
    dt.cat([a, b]).sum().backward()
    assert tuple(a.grad.shape) == (0,) and tuple(b.grad.shape) == (0,)


@pytest.mark.parametrize("mode", ["floor", "trunc"])
def test_div_with_a_rounding_mode_has_zero_gradients(mode):
    # found by the finite differences over every sample call: div's formula ignored
    # rounding_mode and gave the true quotient's gradient to a piecewise-constant result
    x, y = _leaf(3, 4), _leaf(4, seed=1)
    dt.div(x, y.abs() + 0.5, rounding_mode=mode).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), np.zeros((3, 4)))
    np.testing.assert_array_equal(y.grad.numpy(), np.zeros(4))


def _check_call_twice(name, info, call, rng):
    """The second-order check of one sample call: None if checked, else the reason it was
    skipped (as :func:`_check_call`).

    ``gv(x) = sum(grad(L)(x) * v)`` for a fixed random ``v`` per float leaf; its gradient
    (a Hessian-vector product, computed through ``create_graph=True``) is checked like a
    first derivative: ``<H v, u>`` against the central difference of ``gv`` along random
    directions ``u`` of each leaf."""
    reason = _data_skip(name, call)
    if reason is not None:
        return reason
    values, leaves = _inputs(name, call.values, rng)
    state = dt.get_rng_state()
    with dt.no_grad():
        ref = _outputs(_run(info, values))
    reason = _skip_reason(name, leaves, ref)
    if reason is not None or any(u in call.label for u in UNSUPPORTED.get(name, ())):
        return reason or "unsupported"
    assert all(np.isfinite(o.numpy()).all() for o in ref), f"{name} {call.label}: non-finite"
    ts = [t for p, t in leaves if (name, p) not in NO_GRAD_FOR]
    weights = [dt.from_numpy(rng.standard_normal(tuple(o.shape))) for o in ref]
    vs = [dt.from_numpy(rng.standard_normal(tuple(t.shape))) for t in ts]

    def gv(create):
        dt.set_rng_state(state)
        zero = dt.zeros((), dtype=np.float64)
        outs = _outputs(_run(info, _intermediates(values)))
        loss = sum(((o * w).sum() for o, w in zip(outs, weights)), zero)
        gs = dt.autograd.grad(loss, ts, create_graph=create, allow_unused=True)
        return sum(((g * v).sum() for g, v in zip(gs, vs) if g is not None), zero)

    out = gv(True)
    hv = (dt.autograd.grad(out, ts, allow_unused=True) if out.requires_grad
          else [None] * len(ts))
    for t, h in zip(ts, hv):
        base = t.detach().numpy()
        x0 = base.copy()
        got = np.zeros(base.shape) if h is None else h.numpy()
        for _ in range(DIRECTIONS - 1):
            u = rng.standard_normal(base.shape)
            want = _central(base, x0, u, EPS2, lambda: gv(False))
            terms = got * u
            assert abs(terms.sum() - want) <= RTOL2 * (1 + np.abs(terms).sum() + abs(want)), (
                f"{name} {call.label}: <H v, u> = {terms.sum()}, finite differences {want}")
    return None


#: Step and tolerance of the second-order check (differences of gradients).
EPS2 = 1e-5
RTOL2 = 1e-5


@pytest.mark.parametrize("name", _differentiable())
def test_second_derivatives_against_finite_differences(name):
    """``create_graph=True``: every formula, run as recorded ops, differentiates again, on
    every sample call (float64), with the skips of the first-order check only."""
    info = OPS[name]
    calls = sample_calls(info, seed=1)
    rng = np.random.default_rng(8)
    reasons = [_check_call_twice(name, info, call, rng) for call in calls]
    assert set(reasons) - {None} <= set(SKIP_REASONS) | {"unsupported"}, reasons
    assert reasons.count(None), f"{name}: no sample call was checked ({reasons})"


def test_backward_create_graph_accumulates_a_gradient_with_a_graph():
    x = _leaf(5)
    (x * x * x).sum().backward(create_graph=True)
    gx = x.grad
    assert gx.grad_fn is not None
    np.testing.assert_allclose(gx.detach().numpy(), 3 * x.detach().numpy() ** 2)
    x.grad = None
    gx.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 6 * x.detach().numpy())
    (g,) = dt.autograd.grad((x * x).sum(), x)
    assert g.grad_fn is None and not g.requires_grad


# -- the variants -------------------------------------------------------------------------------
def _leaf(*shape, seed=0):
    rng = np.random.default_rng(seed)
    return dt.from_numpy(rng.standard_normal(shape)).requires_grad_()


def test_variants_record_functions_methods_operators():
    x = _leaf(3, 4)
    y = _leaf(3, 4, seed=1)
    outs = [dt.add(x, y), x.add(y), x + y, 2.0 * x, x.T.T, -x, x @ y.T, x[1:], x.exp()]
    for o in outs:
        assert o.requires_grad and o.grad_fn is not None and not o.is_leaf
    assert (x + y).grad_fn.name() == "AddBackward0"
    assert (x @ y.T).grad_fn.name() == "MatmulBackward0"
    z = sum((o.sum() for o in outs[:4]), dt.zeros(()))
    z.backward()
    # d/dx of (x+y) + (x+y) + (x+y) + 2x
    np.testing.assert_allclose(x.grad.numpy(), 5.0)
    np.testing.assert_allclose(y.grad.numpy(), 3.0)


def test_nodes_keep_only_what_their_formula_reads():
    """A node keeps the tensors its formula reads (``save``, declared with the formula);
    of the others it keeps a stand-in of their layout, so an input the formula does not
    need is freed once the program drops it, local and DTensor alike."""
    mesh = dt.init_device_mesh((1,))
    value = np.random.default_rng(3).standard_normal((4, 3))
    for x in (_leaf(4, 3), dt.distribute_tensor(value, mesh, [dt.Shard(0)]).requires_grad_()):
        w = x[:2] * 1.0
        unread = x @ w.T  # add's and sum's formulas read no input: freed
        read = x @ w.T  # sin's reads its input: kept
        local = (lambda t: t) if isinstance(x, dt.Tensor) else (lambda t: t.to_local())
        refs = weakref.ref(local(unread)._arr), weakref.ref(local(read)._arr)
        loss = (unread + 1.0).sum() + read.sin().sum() + unread[1:].sum(dim=0).mean()
        del unread, read
        assert refs[0]() is None and refs[1]() is not None
        loss.backward()
        xv = local(x).detach().numpy()
        wv = xv[:2]
        h = xv @ wv.T
        gh = 1.0 + np.cos(h) + np.r_[np.zeros((1, 2)), np.full((3, 2), 0.5)]
        gx = gh @ wv  # through x @ w.T ...
        gx[:2] += gh.T @ xv  # ... and through w = x[:2]
        got = x.grad if isinstance(x, dt.Tensor) else x.grad.full_tensor()
        np.testing.assert_allclose(got.numpy(), gx, atol=1e-12)


def _write_through_views(a, x, w):
    """In-place writes through views of a non-leaf (nested views, a transpose, a reshape, a
    multi-output view, ``__setitem__``), some after a view was taken: ``v`` is used after
    later writes to its base."""
    b = a.clone()
    b[0].mul_(2.0)
    v = b[:, 1]
    v.add_(x)
    rest = b[1:]
    rest[:, 2:].mul_((rest[:, :2] + 0.0).sin())
    b.t()[3].mul_(x)
    b.split(2, 1)[1].sub_(w[:, :2] * x[:1])
    b[2] = x[:1].expand(4) * 3.0
    b.reshape(-1)[::2].exp_()
    return (b * w).sum() + (v * v).sum()


def test_in_place_through_views_rewrites_the_base():
    """An in-place op on a view rewrites its base's history (PyTorch's CopySlices): the
    gradients through the base equal finite differences."""
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal(s) for s in ((3, 4), (3,), (3, 4))]
    a, x, w = (dt.from_numpy(v.copy()).requires_grad_() for v in arrays)
    _write_through_views(a, x, w).backward()
    assert a.grad_fn is None
    for t, base in zip((a, x, w), arrays):
        flat = base.reshape(-1)
        for k in range(flat.size):
            vals = []
            for eps in (1e-6, -1e-6):
                probe = [v.copy() for v in arrays]
                probe[[id(b) for b in arrays].index(id(base))].reshape(-1)[k] += eps
                with dt.no_grad():
                    vals.append(float(_write_through_views(*map(dt.from_numpy, probe))))
            want = (vals[0] - vals[1]) / 2e-6
            assert abs(t.grad.numpy().reshape(-1)[k] - want) <= 1e-5 * (1 + abs(want))
    b = a.clone()
    b[:, 1].mul_(2.0)
    assert b.grad_fn.name() == "CopySlicesBackward0"


def test_error_in_place_on_view_of_leaf():
    x = _leaf(3, 4)
    with pytest.raises(AutogradError, match="mul_: a view of a leaf Variable"):
        x[0].mul_(2.0)
    with pytest.raises(AutogradError, match="__setitem__: a view of a leaf Variable"):
        x.t()[1] = 0.0


def test_accumulation_and_broadcasting():
    x = _leaf(4)
    w = _leaf(3, 4, seed=2)
    (x * w).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), w.detach().numpy().sum(0))
    (x * w).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * w.detach().numpy().sum(0))
    x.grad = None
    assert x.grad is None
    x32 = dt.ones(3, requires_grad=True)  # float32 leaf, float64 computation
    (x32 * dt.ones(3, dtype=dt.float64)).sum().backward()
    assert x32.grad.dtype == dt.float32
    for cast in ("float", "half", "bfloat16"):
        x64 = _leaf(3)
        (getattr(x64, cast)() * 3).sum().backward()
        assert x64.grad.dtype == dt.float64 and np.all(x64.grad.numpy() == 3)


def test_grad_mode_and_detach():
    x = _leaf(3)
    with dt.no_grad():
        assert not dt.is_grad_enabled()
        y = x * 2
        with dt.enable_grad():
            assert (x * 2).requires_grad
    assert dt.is_grad_enabled()
    assert not y.requires_grad and y.grad_fn is None
    d = x.detach()
    assert not d.requires_grad and np.shares_memory(d.numpy(), x.detach().numpy())
    with dt.set_grad_enabled(False):
        assert not (x + 1).requires_grad

    @dt.no_grad()
    def f(t):
        return t * 3

    assert not f(x).requires_grad and dt.is_grad_enabled()


def test_factories_take_requires_grad():
    for t in (dt.zeros(2, 3, requires_grad=True), dt.ones(2, requires_grad=True),
              dt.full((2,), 1.5, requires_grad=True), dt.empty(2, requires_grad=True),
              dt.rand(2, requires_grad=True), dt.randn(2, requires_grad=True),
              dt.tensor([1.0, 2.0], requires_grad=True)):
        assert t.requires_grad and t.is_leaf and t.grad is None and t.grad_fn is None
    assert not dt.zeros(2).requires_grad
    with pytest.raises(AutogradError, match="floating point"):
        dt.zeros(2, dtype=dt.int64, requires_grad=True)


def test_autograd_grad_leaves_grad_alone():
    x = _leaf(3)
    y = (x * x).sum()
    (g,) = dt.autograd.grad(y, x, retain_graph=True)
    np.testing.assert_allclose(g.numpy(), 2 * x.detach().numpy())
    assert x.grad is None
    h = x * 3
    (gh,) = dt.autograd.grad((h * h).sum(), [h])  # a non-leaf input
    np.testing.assert_allclose(gh.numpy(), 2 * h.detach().numpy())
    u = _leaf(2, seed=3)
    with pytest.raises(AutogradError, match="not have been used"):
        dt.autograd.grad((x * 2).sum(), [x, u])
    gx, gu = dt.autograd.grad((x * 2).sum(), [x, u], allow_unused=True)
    assert gu is None and np.allclose(gx.numpy(), 2)


def test_in_place_on_non_leaf_records():
    x = _leaf(3)
    y = x * 1.0
    y.mul_(x)  # y = x * x
    y.add_(1.0)
    assert y.grad_fn.name() == "AddBackward0"
    y.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * x.detach().numpy())


def test_setitem_records_and_bumps_the_version():
    x = _leaf(4)
    v = _leaf(2, seed=5)
    y = x * 2.0
    y[1:3] = v * 3.0
    assert y.grad_fn.name() == "SetitemBackward0"
    y.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [2.0, 0.0, 0.0, 2.0])
    np.testing.assert_allclose(v.grad.numpy(), 3.0)
    with pytest.raises(AutogradError, match="__setitem__: a leaf Variable"):
        x[0] = 1.0
    w = dt.ones(3, dtype=dt.float64)
    z = (x[:3] * w).sum()
    w[0] = 5.0
    with pytest.raises(AutogradError, match="mul: one of the variables"):
        z.backward()


def test_dropout_gradient_uses_the_forward_mask():
    x = _leaf(40)
    y = dt.dropout(x, 0.5)
    y.sum().backward()
    kept = y.detach().numpy() != 0
    np.testing.assert_allclose(x.grad.numpy(), np.where(kept, 2.0, 0.0))


def test_multi_output_and_views():
    x = _leaf(4, 6)
    a, _ = x.split(3, dim=1)
    (a * 2).sum().backward()
    want = np.zeros((4, 6))
    want[:, :3] = 2
    np.testing.assert_allclose(x.grad.numpy(), want)
    x.grad = None
    vals = x.max(dim=1).values
    vals.sum().backward()
    assert x.grad.numpy().sum() == 4


def test_sum_of_gradients_reaching_one_tensor():
    x = _leaf(3)
    h = x.exp()
    (h * h + h).sum().backward()
    e = np.exp(x.detach().numpy())
    np.testing.assert_allclose(x.grad.numpy(), 2 * e * e + e)


# -- PyTorch's errors ------------------------------------------------------------------------------
def test_error_backward_of_non_scalar_without_gradient():
    x = _leaf(3)
    with pytest.raises(AutogradError, match="implicitly created only for scalar outputs"):
        (x * 2).backward()
    (x * 2).backward(dt.ones(3, dtype=dt.float64))
    np.testing.assert_allclose(x.grad.numpy(), 2)


def test_error_grad_of_tensor_that_does_not_require_grad():
    with pytest.raises(AutogradError, match="does not require grad") as e:
        dt.ones(3).sum().backward()
    assert isinstance(e.value, RuntimeError) and isinstance(e.value, DTensorError)
    with pytest.raises(AutogradError, match="does not require grad"):
        dt.autograd.grad(_leaf(2).sum(), dt.ones(2))


def test_error_second_backward_without_retain_graph():
    x = _leaf(3)
    y = (x.exp() * x).sum()
    y.backward(retain_graph=True)
    y.backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * (np.exp(x.detach().numpy()) * (
        1 + x.detach().numpy())))
    with pytest.raises(AutogradError, match="backward through the graph a second time"):
        y.backward()


def test_error_in_place_on_leaf_that_requires_grad():
    x = _leaf(3)
    with pytest.raises(AutogradError, match="add_: a leaf Variable that requires grad"):
        x.add_(1.0)
    with pytest.raises(AutogradError, match="leaf Variable"):
        x += 1.0
    with dt.no_grad():
        x.add_(1.0)  # allowed without recording, as in PyTorch


def test_error_in_place_change_to_saved_tensor():
    x = _leaf(3)
    h = x * 1.0
    y = h.exp()  # saves its output
    y.mul_(2.0)
    with pytest.raises(AutogradError, match="exp: one of the variables needed for gradient"):
        y.sum().backward()
    w = dt.ones(3, dtype=dt.float64)
    view = w[:]  # another handle on w's memory
    z = (x * w).sum()  # mul saves w
    view.add_(1.0)
    assert w._version == 1
    with pytest.raises(AutogradError, match="mul: one of the variables.*is at version 1"):
        z.backward()
    k = (x + w).sum()  # add saves nothing: a later change is fine
    w.add_(1.0)
    k.backward()


def test_recording_plan_and_saved_counts():
    """A positional call, recorded from compiled code on the compiled path and else bound
    through the op's plan (defaults filled in), makes the node a keyword call makes
    through the full bind: same edges and values, same gradients. A saved tensor's version
    is counted while its node lives: not after the node goes or a backward releases it, nor
    when the op fails."""
    from dtensor.local import grad_engine as _ag

    x, y = _leaf(3), _leaf(3)
    served = fastpath.dispatch.recorder_served() if fastpath.ENABLED else 0
    quick = x + y  # the compiled recorder's (on the compiled path)
    if fastpath.ENABLED:
        assert fastpath.dispatch.recorder_served() == served + 1
    # dtensor's recorder, which binds in full
    full = _tape.record(OPS["add"], OPS["add"].function, (x, y), {"alpha": 1}, None)
    if fastpath.ENABLED:
        assert fastpath.dispatch.recorder_served() == served + 1
    assert _tape._PLANS[OPS["add"]].quick <= 2
    assert type(quick.grad_fn) is type(full.grad_fn)
    assert quick.grad_fn.edges == full.grad_fn.edges == [x._ag, y._ag]
    assert quick.grad_fn.ctx[1] == full.grad_fn.ctx[1] == [x, y, 1]
    (gq,) = dt.autograd.grad(quick.sum(), [y])
    (gf,) = dt.autograd.grad(full.sum(), [y])
    np.testing.assert_array_equal(gq.numpy(), gf.numpy())
    w = dt.ones(3, dtype=dt.float64)
    key = id(_ag.owner(w))
    z = x * w  # mul saves w
    z2 = x * w
    assert _ag._VERSIONS[key][1] == 2
    del z
    assert _ag._VERSIONS[key][1] == 1
    z2.sum().backward()  # released
    assert key not in _ag._VERSIONS
    with pytest.raises(DTensorError):
        x * dt.ones(4, dtype=dt.float64)  # the op fails: no node holds what it saved
    assert id(_ag.owner(x)) not in _ag._VERSIONS


@pytest.mark.parametrize(("call", "args", "kwargs"), [
    ("add", 2, {"alpha": 2}),
    ("softmax", 1, {"dim": 0}),
    ("sum", 1, {"dim": 1, "keepdim": True}),
    ("mean", 1, {"keepdim": True, "dim": 0}),  # keywords out of order
    ("sum", 0, {"input": None, "dim": 0}),  # the tensor itself by keyword
], ids=["add-alpha", "softmax-dim", "sum-dim-keepdim", "mean-reordered", "sum-input-kw"])
def test_keyword_calls_record_like_dtensors_recorder(call, args, kwargs):
    """A call with keyword arguments is recorded from compiled code on the compiled path
    (a counter), into the node dtensor's recorder makes of the same call: same class,
    edges, bound values and gradients."""
    x, y = _leaf(3, 4), _leaf(3, 4)
    pos = (x, y)[:args]
    kw = {k: (x if v is None else v) for k, v in kwargs.items()}
    fn = getattr(dt, call)
    served = fastpath.dispatch.recorder_served() if fastpath.ENABLED else 0
    got = fn(*pos, **kw)
    if fastpath.ENABLED:
        assert fastpath.dispatch.recorder_served() == served + 1
    want = _tape.record(OPS[call], OPS[call].function, pos, kw, None)
    assert type(got.grad_fn) is type(want.grad_fn)
    assert got.grad_fn.edges == want.grad_fn.edges
    for a, b in zip(got.grad_fn.ctx[1], want.grad_fn.ctx[1], strict=True):
        assert a is b or a == b, (a, b)
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    for leaf in {id(t): t for t in (*pos, *kw.values()) if isinstance(t, dt.Tensor)}.values():
        (g1,) = dt.autograd.grad(got.sum(), [leaf], retain_graph=True)
        (g2,) = dt.autograd.grad(want.sum(), [leaf], retain_graph=True)
        np.testing.assert_array_equal(g1.numpy(), g2.numpy())


def test_keyword_calls_the_compiled_recorder_declines_raise_as_before():
    """An unknown keyword, a keyword that a positional argument already gave, or a missing
    parameter: nothing is recorded from compiled code, and the call raises a TypeError
    (dtensor's SignatureError when recording) as without autograd."""
    x, y = _leaf(3), _leaf(3)
    served = fastpath.dispatch.recorder_served() if fastpath.ENABLED else 0
    for call, words in [(lambda: dt.add(x, y, nope=1), "unexpected keyword argument 'nope'"),
                        (lambda: dt.add(x, y, other=y), "multiple values for argument 'other'"),
                        (lambda: dt.add(x, alpha=2), "missing .*other")]:
        with pytest.raises(SignatureError, match=words):
            call()
        with dt.no_grad(), pytest.raises(TypeError):
            call()
    if fastpath.ENABLED:
        assert fastpath.dispatch.recorder_served() == served


def test_error_requires_grad_on_non_leaf():
    y = _leaf(2) * 2
    with pytest.raises(AutogradError, match="leaf variables"):
        y.requires_grad_(False)


@pytest.mark.parametrize("fast", [
    pytest.param(True, marks=pytest.mark.skipif(
        not fastpath.ENABLED, reason="compiled fast path not enabled (not built or disabled)")),
    False,
])
def test_dtensor_ops_record_on_both_paths(fast):
    """Methods, operators (the compiled slots included) and functions of DTensors record on
    the compiled front and on the Python path alike."""
    mesh = dt.init_device_mesh((1,))
    value = np.random.default_rng(1).standard_normal((4, 3))
    dt.debug.set_fastpath(fast)
    try:
        x = dt.distribute_tensor(value, mesh, [dt.Shard(0)]).requires_grad_()
        y = (x * x + 2.0 * x - x.exp() / 3.0) @ x.T
        z = dt.relu(y).sum() + (-x).sum(dim=0).sum() + x.where(x > 0, 0.0).sum()
        z.backward()
        with dt.no_grad():
            assert not (x * 2.0).requires_grad and not x.exp().requires_grad
        h = x * 1.0
        h.mul_(x)  # in place on a non-leaf: records
        w = dt.distribute_tensor(np.ones((4, 3)), mesh, [dt.Shard(0)])
        k = (h * w).sum()  # mul saves w
        w.add_(1.0)  # in place without grad: counted all the same
        with pytest.raises(AutogradError, match="mul: one of the variables"):
            k.backward()
        (gh,) = dt.autograd.grad((h * 1.0).sum(), x)
        np.testing.assert_allclose(gh.full_tensor().numpy(), 2 * value)
    finally:
        dt.debug.set_fastpath(fastpath.ENABLED)
    lx = dt.from_numpy(value.copy()).requires_grad_()
    ly = (lx * lx + 2.0 * lx - lx.exp() / 3.0) @ lx.T
    (dt.relu(ly).sum() + (-lx).sum(dim=0).sum() + lx.where(lx > 0, 0.0).sum()).backward()
    np.testing.assert_allclose(x.grad.full_tensor().numpy(), lx.grad.numpy(), atol=1e-12)


def test_post_accumulate_grad_hook_sees_the_accumulated_grad_and_removes():
    w = dt.tensor([1.0, 2.0, 3.0]).requires_grad_()
    seen = []
    handle = w.register_post_accumulate_grad_hook(lambda t: seen.append(t.grad.numpy().copy()))
    (w * 2).sum().backward()
    (w * 3).sum().backward()
    np.testing.assert_array_equal(seen[0], [2.0, 2.0, 2.0])
    np.testing.assert_array_equal(seen[1], [5.0, 5.0, 5.0])  # after accumulation
    handle.remove()
    (w * 3).sum().backward()
    assert len(seen) == 2
    with pytest.raises(AutogradError, match="non-leaf"):
        (w * 2).register_post_accumulate_grad_hook(lambda t: None)
    with pytest.raises(AutogradError, match="non-leaf"):
        dt.tensor([1.0]).register_post_accumulate_grad_hook(lambda t: None)


def test_queue_callback_runs_after_the_last_node_in_order():
    from dtensor.local import grad_engine

    w = dt.tensor([1.0, 2.0]).requires_grad_()
    order = []

    def hook(t):
        order.append("hook")
        grad_engine.queue_callback(lambda: order.append(("first", t.grad.numpy().tolist())))
        grad_engine.queue_callback(lambda: grad_engine.queue_callback(
            lambda: order.append("queued by a callback")))

    w.register_post_accumulate_grad_hook(hook)
    (w * w).sum().backward()
    assert order == ["hook", ("first", [2.0, 4.0]), "queued by a callback"]
    with pytest.raises(AutogradError, match="no backward pass"):
        grad_engine.queue_callback(lambda: None)


def test_post_accumulate_grad_hooks_go_with_their_tensor():
    from dtensor.local import grad_engine

    before = len(grad_engine._POST_ACC)
    w = dt.tensor([1.0, 2.0]).requires_grad_()
    w.register_post_accumulate_grad_hook(lambda t: None)
    assert len(grad_engine._POST_ACC) == before + 1
    del w
    assert len(grad_engine._POST_ACC) == before
