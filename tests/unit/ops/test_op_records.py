"""An op wholly in its record (one process): the compute class autoshard prices it with is
the record's, and a unary op with its gradient is one line of ``dtensor/ops/pointwise.py``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TESTS

import dtensor as dt
from dtensor.autoshard._calibrate import CLASSES, op_class
from dtensor.ops import OPS

#: The installed dtensor package (copied, with one line added, by the one-line test).
PACKAGE = Path(dt.__file__).resolve().parent

#: The compute class of every op declared before the records held it (autoshard read it off
#: the op's sample family then: product -> matmul; nn, reduce, scan -> nn; view -> view).
CLASS_BEFORE = {
    "matmul": "addmm bmm dot einsum linear matmul mm outer",
    "nn": "all amax amin any argmax argmin count_nonzero cross_entropy cumprod cumsum dropout "
          "embedding layer_norm log_softmax logsumexp max mean min mse_loss norm prod softmax "
          "std sum var",
    "view": "chunk expand flatten flip getitem moveaxis movedim narrow permute repeat reshape "
            "roll select split squeeze swapaxes swapdims t tile transpose tril triu unbind "
            "unflatten unsqueeze view",
    "pointwise": "abs abs_ add add_ addcdiv addcdiv_ addcmul addcmul_ argsort atan2 bitwise_and "
                 "bitwise_and_ bitwise_not bitwise_not_ bitwise_or bitwise_or_ bitwise_xor "
                 "bitwise_xor_ bool byte cat ceil ceil_ char clamp clamp_ clip clip_ clone "
                 "concat contiguous copy_ cos cos_ detach div div_ double eq erf erf_ exp exp_ "
                 "expand_as expm1 expm1_ fill_ float floor floor_ floor_divide floor_divide_ "
                 "fmod fmod_ gather ge gelu gt half index_add index_add_ index_put index_put_ "
                 "index_select int isfinite isinf isnan kthvalue le leaky_relu lerp lerp_ log "
                 "log10 log10_ log1p log1p_ log2 log2_ log_ logical_and logical_not "
                 "logical_not_ logical_or logical_xor long lt masked_fill masked_fill_ maximum "
                 "minimum mul mul_ ne neg neg_ positive pow pow_ reciprocal reciprocal_ relu "
                 "relu_ remainder remainder_ round round_ rsqrt rsqrt_ scatter scatter_ "
                 "scatter_add scatter_add_ setitem short sigmoid sigmoid_ sign sign_ silu sin "
                 "sin_ softplus sort sqrt sqrt_ square square_ stack sub sub_ take_along_dim tan "
                 "tan_ tanh tanh_ to topk trunc trunc_ type_as where zero_",
}


@pytest.mark.mode_independent  # see tests/conftest.py
def test_every_op_keeps_its_compute_class():
    before = {name: cls for cls, names in CLASS_BEFORE.items() for name in names.split()}
    assert set(before) <= set(OPS), sorted(set(before) - set(OPS))
    changed = {n: (before[n], op_class(n)) for n in before if op_class(n) != before[n]}
    assert not changed, changed
    assert all(info.cost in CLASSES for info in OPS.values())
    assert op_class("redistribute") == op_class("no such op") == "view"


#: A new unary op with its gradient: the one line it takes, appended to a copy of
#: ``dtensor/ops/pointwise.py``.
NEW_OP = ('unary("exp2", np.exp2, "float", FLOATS, "monotone", inplace=True, '
          'grad=lambda g, out: g * out*_LN2)')

#: What the new op must come with, checked in a process that imports the copy.
CHECK_NEW_OP = """
import math
import numpy as np
import dtensor as dt
from helpers.sim import dtensor_of
from dtensor.autoshard._calibrate import op_class
from dtensor.ops import OPS
from dtensor.validate import validate
from placements import Partial, Shard

assert dt.__file__.startswith(COPY), dt.__file__
a = np.random.default_rng(0).standard_normal((5, 7))
want = np.exp2(a)
t = dt.from_numpy(a.copy())
np.testing.assert_allclose(dt.exp2(t).numpy(), want, rtol=1e-12)
np.testing.assert_allclose(t.exp2().numpy(), want, rtol=1e-12)
u = t.clone()
assert u.exp2_() is u
np.testing.assert_allclose(u.numpy(), want, rtol=1e-12)
assert dt.exp2(dt.tensor([1, 3])).dtype == dt.float32  # the "float" dtype rule

# DTensor: function and method; the rule keeps a shard, and P(max) (monotone)
mesh = dt.AbstractMesh((2,), coord=(0,))
for x, pl in ((dtensor_of(a, mesh, [Shard(0)]), Shard(0)),
              (dtensor_of(a, mesh, [Partial("max")]), Partial("max"))):
    for y in (dt.exp2(x), x.exp2()):
        assert y.placements == (pl,), y.placements
        np.testing.assert_allclose(y.to_local().numpy(), np.exp2(x.to_local().numpy()))
assert "exp2" in vars(dt.DTensor) and "exp2_" in vars(dt.DTensor)
report = validate(["exp2", "exp2_"], quick=True)  # every candidate of the rule, on data
assert report.mismatches == 0 and all(r.strategies for r in report.ops), report.table()
assert op_class("exp2") == "pointwise"

# the gradient, against the analytic one: Tensor and DTensor (on its shard)
w = np.random.default_rng(1).standard_normal(a.shape)
grad = w * np.exp2(a) * math.log(2.0)
t = dt.from_numpy(a.copy()).requires_grad_()
(dt.exp2(t) * dt.from_numpy(w)).sum().backward()
np.testing.assert_allclose(t.grad.numpy(), grad, rtol=1e-12)
x = dtensor_of(a, mesh, [Shard(0)]).requires_grad_()
(gx,) = dt.autograd.grad(x.exp2(), [x], [dtensor_of(w, mesh, [Shard(0)])])
assert gx.placements == (Shard(0),)
np.testing.assert_allclose(gx.to_local().numpy(), grad[:3], rtol=1e-12)
print("new op ok")
"""


def test_a_unary_op_with_its_gradient_is_one_line(tmp_path):
    """The line :data:`NEW_OP` in ``dtensor/ops/pointwise.py`` (of a copy of the package,
    imported by another process: the table here is left as it is) makes ``dt.exp2``, the
    Tensor and DTensor methods and in-place forms, the sharding rule (checked on data by the
    validator) and the gradient."""
    assert "\n" not in NEW_OP and len(NEW_OP) <= 100  # one line, as ruff wants it
    assert "exp2" not in OPS
    copy = tmp_path / "dtensor"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    pointwise = copy / "ops" / "pointwise.py"
    pointwise.write_text(pointwise.read_text() + NEW_OP + "\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(TESTS)]))
    run = subprocess.run([sys.executable, "-c", f"COPY = {str(copy)!r}\n" + CHECK_NEW_OP],
                         env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "new op ok" in run.stdout
