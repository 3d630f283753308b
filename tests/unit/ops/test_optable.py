"""The op table drives everything per op: the public functions, Tensor and DTensor methods,
in-place forms, operators and statics come from one record each; the dispatcher's listener
API and the one call that clears every cache (one process)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.sim import data, dtensor_of

import dtensor as dt
from dtensor.dispatch import dispatcher as _dispatch
from dtensor.dispatch import entry_points as install
from dtensor.errors import ConfigError
from dtensor.ops import OPS
from placements import Partial, Shard
from placements.cache import all_stats
from placements.rules import rule_statics


def test_every_record_is_installed_as_it_declares():
    names = install.installed()
    for name, info in OPS.items():
        if info.function is not None:
            assert getattr(dt, name).__wrapped__ is info.function, name
            assert name in names["functions"]
        else:
            assert name not in names["functions"] or name in ("float", "int", "bool"), name
        if info.method is not None:
            for method in (name, *info.aliases):
                assert callable(getattr(dt.Tensor, method)), method
                assert method in vars(dt.DTensor), method
        for op in info.operators:
            assert op.dunder in vars(dt.Tensor) and hasattr(dt.DTensor, op.dunder), op
        assert info.static_params == rule_statics(name), name
    # the installed methods can be found: they are listed in the class docstrings
    for cls in (dt.Tensor, dt.DTensor):
        assert "Installed from the op table" in cls.__doc__
        assert "log10_" in cls.__doc__ and "__iadd__" in cls.__doc__


def test_in_place_records_follow_their_op():
    for name, info in OPS.items():
        base = OPS.get(name[:-1]) if name.endswith("_") else None
        if base is not None and info.inplace:
            assert info.params == base.params and info.tensor_params == base.tensor_params
            assert info.static_params == base.static_params and info.function is None


def test_a_new_unary_op_is_one_record():
    """``log10`` is declared by one ``unary(...)`` line: function, methods, in-place form,
    rule (float output, no Partial kept) and validator samples all come from it."""
    g = np.abs(data((4, 6))) + 0.5
    t = dt.tensor(g)
    np.testing.assert_allclose(dt.log10(t).numpy(), np.log10(g), rtol=1e-6)
    np.testing.assert_allclose(t.log10().numpy(), np.log10(g), rtol=1e-6)
    u = t.clone()
    assert u.log10_() is u
    np.testing.assert_allclose(u.numpy(), np.log10(g), rtol=1e-6)
    assert dt.log10(dt.tensor([1, 100])).dtype == dt.float32  # integers compute as floats
    with pytest.raises(dt.errors.DTypeError, match="Float can.t be cast to .* Long"):
        dt.tensor([1, 100]).log10_()
    mesh = dt.AbstractMesh((2,), coord=(0,))
    x = dtensor_of(g, mesh, [Shard(0)])
    y = x.log10()
    assert y.placements == (Shard(0),) and y.dtype == np.float32
    np.testing.assert_allclose(y.to_local().numpy(), np.log10(g[:2]), rtol=1e-6)
    entry, _, _ = _dispatch.decide(OPS["log10"], (dtensor_of(g, mesh, [Partial("max")]),), {})
    (target,) = entry.strategy.input_placements  # a Partial input is reduced first
    assert not any(p.is_partial() for p in (*target, *entry.out_specs[0].placements)), target
    assert OPS["log10"].samples == "unary" and OPS["log10_"].inplace


def test_listeners_see_every_dispatched_op_with_its_miss_flag():
    x = dtensor_of(data((4, 6)), dt.AbstractMesh((2,), coord=(0,)), [Shard(0)])
    seen = []

    def listen(entry, miss, values, mesh):
        seen.append((entry.name, miss, entry.out_specs[0].placements))

    _dispatch.clear_prop_cache()
    x + x  # an entry the compiled front keeps (when it is on)
    x + x
    _dispatch.add_listener(listen)
    try:
        for _ in range(3):
            x + x
        x.relu()
    finally:
        _dispatch.remove_listener(listen)
    assert seen == [("add", False, (Shard(0),))] * 3 + [("relu", True, (Shard(0),))]
    x + x
    assert len(seen) == 4  # removed: not called any more
    with pytest.raises(ConfigError, match="not a registered listener"):
        _dispatch.remove_listener(listen)


def test_a_listener_may_stop_an_op_before_it_runs():
    x = dtensor_of(data((4, 6)), dt.AbstractMesh((2,), coord=(0,)), [Shard(0)])

    def refuse(entry, miss, values, mesh):
        raise RuntimeError(f"refused {entry.name}")

    _dispatch.add_listener(refuse)
    try:
        with pytest.raises(RuntimeError, match="refused mul"):
            x * 2.0
    finally:
        _dispatch.remove_listener(refuse)
    np.testing.assert_allclose((x * 2.0).to_local().numpy(), x.to_local().numpy() * 2)


def test_clear_caches_empties_every_cache_and_changes_no_result():
    x = dtensor_of(data((6, 4)), dt.AbstractMesh((2,), coord=(0,)), [Shard(0)])
    before = (x.view(-1) * 3 + 1).sum(dim=0).to_local().numpy()
    stats = dt.debug.cache_stats()
    assert stats["dispatch.propagation"]["size"] > 0
    assert stats["placements.rules.results"]["size"] > 0
    dt.clear_caches()
    assert all(s["size"] == 0 and s["hits"] == 0 for s in all_stats().values()), all_stats()
    assert dt.debug.prop_cache_stats()["hits"] == 0
    after = (x.view(-1) * 3 + 1).sum(dim=0).to_local().numpy()
    np.testing.assert_array_equal(before, after)
