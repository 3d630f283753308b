"""``copy.deepcopy`` of tensors, DTensors and modules: the copies come from the allocator
(``dt.memory_stats`` counts them), tensors that shared memory share the copy's at the same
offsets and strides (as PyTorch's deepcopy keeps storage sharing), a leaf keeps
``requires_grad`` and a copy of its ``.grad``, a tensor made by a recorded op raises; and
``pipeline_split`` copies only its stage's units."""

from __future__ import annotations

import copy

import numpy as np
import pytest

import dtensor as dt
from dtensor import pipelining as pp
from dtensor.errors import AutogradError
from launch.examples.gpt import GPT, GPTConfig


def _allocated() -> int:
    return dt.memory_stats()["allocated_bytes"]


def _clone_bytes(tensors) -> int:
    """What clones of ``tensors`` add to ``allocated_bytes`` (requests below the pool's
    minimum are not counted)."""
    before = _allocated()
    clones = [t.clone() for t in tensors]
    out = _allocated() - before
    del clones
    return out


def test_a_copy_is_counted_once_per_storage():
    x = dt.tensor(np.arange(64 * 64, dtype=np.float32).reshape(64, 64))
    views = [x, x[1:3], x.t(), x[:, 5::3]]
    before = _allocated()
    got = copy.deepcopy(views)
    # one copy of the 16 KiB storage for all four views (pool blocks may round up a little)
    assert 64 * 64 * 4 <= _allocated() - before < 2 * 64 * 64 * 4
    ptr = got[0].untyped_storage().data_ptr()
    assert ptr != x.untyped_storage().data_ptr()
    for orig, new in zip(views, got):
        assert new.untyped_storage().data_ptr() == ptr
        assert (new.shape, new.stride(), new.storage_offset()) == (
            orig.shape, orig.stride(), orig.storage_offset())
        np.testing.assert_array_equal(new.numpy(), orig.numpy())
    got[0].add_(1.0)  # a write through one copy is seen by the copied views, not the originals
    np.testing.assert_array_equal(got[2].numpy(), x.t().numpy() + 1)
    np.testing.assert_array_equal(x.numpy(), np.arange(64 * 64).reshape(64, 64))
    del got, orig, new
    assert _allocated() == before


def test_a_leaf_keeps_requires_grad_and_its_grad():
    p = dt.tensor([1.0, 2.0, 3.0], requires_grad=True)
    (p * 2).sum().backward()
    q = copy.deepcopy(p)
    assert q.requires_grad and q.is_leaf and q is not p
    np.testing.assert_array_equal(q.grad.numpy(), [2.0, 2.0, 2.0])
    assert q.grad.untyped_storage().data_ptr() != p.grad.untyped_storage().data_ptr()
    (q * 3).sum().backward()
    np.testing.assert_array_equal(q.grad.numpy(), [5.0, 5.0, 5.0])
    np.testing.assert_array_equal(p.grad.numpy(), [2.0, 2.0, 2.0])
    plain = copy.deepcopy(dt.ones(2))
    assert not plain.requires_grad and plain.grad is None


def test_a_tensor_made_by_an_op_raises():
    p = dt.ones(3, requires_grad=True)
    y = p * 2
    with pytest.raises(AutogradError, match=r"deepcopy: only leaf tensors .*\(3,\) float32 "
                                            r"tensor was made by MulBackward0"):
        copy.deepcopy(y)
    np.testing.assert_array_equal(copy.deepcopy(y.detach()).numpy(), [2.0, 2.0, 2.0])


def test_a_dtensor_copy_keeps_its_spec_and_leaf_state():
    mesh = dt.init_device_mesh((1,))
    x = dt.distribute_tensor(dt.arange(6 * 1024, dtype=dt.float32).reshape(6, 1024), mesh,
                             [dt.Shard(0)]).requires_grad_()
    before = _allocated()
    y = copy.deepcopy(x)
    assert _allocated() - before >= 6 * 1024 * 4
    assert isinstance(y, dt.DTensor) and y.placements == x.placements and y.requires_grad
    assert y.to_local().untyped_storage().data_ptr() != x.to_local().untyped_storage().data_ptr()
    np.testing.assert_array_equal(y.full_tensor().numpy(), x.full_tensor().numpy())
    with pytest.raises(AutogradError, match=r"only leaf DTensors can be deep-copied; this "
                                            r"\(6, 1024\) float32 DTensor \[S\(0\)\] was made "
                                            r"by MulBackward0"):
        copy.deepcopy(x * 2)


def test_module_copy_keeps_ties_and_is_counted():
    dt.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, d_model=32))
    nbytes = _clone_bytes(list(model.parameters()))  # the tied weight once
    assert nbytes > 0
    before = _allocated()
    twin = copy.deepcopy(model)
    assert _allocated() - before == nbytes
    assert twin.head.weight is twin.tok_emb.weight
    assert twin.head.weight is not model.head.weight


def test_pipeline_split_copies_only_its_stage():
    dt.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, d_model=32))
    total = _clone_bytes(list(model.parameters()))
    dt.reset_peak_memory_stats()
    before = _allocated()
    stage = pp.pipeline_split(model, 4, stages=[2])[2]
    grown, peak = _allocated() - before, dt.memory_stats()["peak_allocated_bytes"] - before
    own = _clone_bytes(list(stage.parameters()))
    assert 0 < own < total / 3
    assert grown == own
    assert peak == own  # the other stages' units were never copied
    for n, p in stage.named_parameters():
        assert isinstance(p, dt.nn.Parameter) and p.requires_grad
        np.testing.assert_array_equal(p.numpy(), model.get_parameter(n).numpy())


def test_a_parameters_copy_is_a_parameter():
    p = dt.nn.Parameter(dt.ones(4), requires_grad=False)
    q = copy.deepcopy(p)
    assert isinstance(q, dt.nn.Parameter) and not q.requires_grad
    assert not isinstance(copy.deepcopy(dt.ones(4)), dt.nn.Parameter)
    mesh = dt.init_device_mesh((1,))
    pd = dt.nn.Parameter(dt.distribute_tensor(dt.ones(4), mesh, [dt.Replicate()]))
    qd = copy.deepcopy(pd)
    assert isinstance(qd, dt.nn.Parameter) and qd.requires_grad and isinstance(qd, dt.DTensor)
    lin = dt.nn.Linear(4, 2)
    twin = copy.deepcopy(lin)
    twin.load_state_dict({"weight": dt.zeros(2, 4), "bias": dt.zeros(2)}, assign=True)
    assert isinstance(twin.weight, dt.nn.Parameter) and twin.weight.requires_grad
    assert float(lin.weight.abs().sum()) > 0  # the original untouched
