"""The split backward of zero-bubble pipelines (``grad_engine.backward_input``, then
``WeightWork.run``) on a GPT stage (blocks, final norm, tied head; hidden states in) under
FSDP, the Megatron TP plan and ``replicate``, at 2-4 ranks: the input gradient and every
``.grad`` equal a full backward's on an identical model; the collectives of the two halves
are those of one full backward (CommDebugMode counts per kind; FSDP's one fewer all-gather,
see the test), the gradient reductions of FSDP (reduce-scatter) and ``replicate``
(all-reduce) all in the weight half, once per group or bucket."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import dtensor as dt
from dtensor import pipelining as pp
from dtensor.local import grad_engine as _ag
from launch.examples.gpt import GPT, GPTConfig, tp_plan

WORLD = MPI.COMM_WORLD
F = dt.nn.functional
# 12 heads and a 192-wide MLP split evenly over 2, 3 and 4 tensor-parallel ranks
CFG = GPTConfig(vocab_size=48, block_size=8, n_layer=4, n_head=12, d_model=48)
pytestmark = pytest.mark.mpi(min_size=2)


def _stage(how):
    """The second of two stages, laid out as ``how`` says, over the whole world."""
    dt.manual_seed(3)
    mod = pp.pipeline_split(GPT(CFG), 2, stages=[1])[1]
    mesh = dt.init_device_mesh((WORLD.size,))
    if how == "fsdp":
        for block in mod.blocks:
            dt.fully_shard(block, mesh=mesh)
        dt.fully_shard(mod, mesh=mesh)
    elif how == "tp":
        dt.parallelize_module(mod, mesh, tp_plan())
    else:
        mod = dt.replicate(mod, mesh, bucket_cap_mb=0.01)
    return mod


def _counts(mode):
    out = {}
    for r in mode.records:
        out[r.kind] = out.get(r.kind, 0) + 1
    return out


def _loss(mod, xa, ya):
    x = dt.from_numpy(xa.copy()).requires_grad_()
    out = mod(x)
    return x, F.cross_entropy(out.reshape(-1, CFG.vocab_size), dt.from_numpy(ya).reshape(-1))


def _full(t):
    return (t.full_tensor() if isinstance(t, dt.DTensor) else t).numpy()


@pytest.mark.parametrize("how", ["fsdp", "tp", "replicate"])
def test_split_backward_equals_full_backward(how):
    rng = np.random.default_rng(WORLD.rank if how == "replicate" else 0)
    xa = rng.standard_normal((2, CFG.block_size, CFG.d_model)).astype(np.float32)
    ya = rng.integers(0, CFG.vocab_size, (2, CFG.block_size))
    ref = _stage(how)
    x_ref, loss = _loss(ref, xa, ya)
    with dt.debug.CommDebugMode() as full:
        loss.backward()
    mod = _stage(how)
    x, loss = _loss(mod, xa, ya)
    params = [p for p in mod.parameters() if p.requires_grad]
    with dt.debug.CommDebugMode() as first:
        (gx,), work = _ag.backward_input([loss], None, [x], params)
    assert all(p.grad is None for p in params)
    with dt.debug.CommDebugMode() as second:
        work.run()
    np.testing.assert_array_equal(gx.numpy(), x_ref.grad.numpy())
    for (name, p), q in zip(mod.named_parameters(), ref.parameters()):
        np.testing.assert_array_equal(_full(p.grad), _full(q.grad), err_msg=f"{how} {name}")
    c_full, c1, c2 = _counts(full), _counts(first), _counts(second)
    both = {k: c1.get(k, 0) + c2.get(k, 0) for k in set(c1) | set(c2)}
    if how == "fsdp":  # each group's gradients reduce-scattered once, in the weight half
        assert "reduce_scatter" not in c1
        assert c2["reduce_scatter"] == c_full["reduce_scatter"] == len(mod.blocks) + 1
        # the all-gathers: the full backward's less its last prefetch, of the root group,
        # which it had resharded already (the split keeps it gathered until W)
        assert both == {"reduce_scatter": len(mod.blocks) + 1, "all_gather": len(mod.blocks)}
        assert c_full["all_gather"] == len(mod.blocks) + 1
    else:
        assert both == c_full, (c_full, c1, c2)
    if how == "replicate":
        assert not any("all_reduce" in k for k in c1), c1
        assert any("all_reduce" in k for k in c2), c2
