"""Hosts and the two link tiers: the simulated-host test knob (``DTENSOR_SIM_HOSTS``), which
mesh dims span hosts, and the cost model's ``inter_host`` tier in plan prices and choices."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

import dtensor as dt
from placements import Replicate, Shard
from placements.errors import ConfigError, MeshError
from placements.spec import DTensorSpec
from redistribute import hosts
from redistribute.cost import CostModel, plan_cost, spans_hosts
from redistribute.plan import plan

R, S = Replicate(), Shard


def test_simulated_hosts_split_the_world_into_consecutive_groups(monkeypatch):
    monkeypatch.delenv(hosts.SIM_HOSTS_VAR, raising=False)
    assert hosts.simulated_host(3, 4) is None
    monkeypatch.setenv(hosts.SIM_HOSTS_VAR, "1")
    assert hosts.simulated_host(3, 4) is None
    monkeypatch.setenv(hosts.SIM_HOSTS_VAR, "2")
    assert [hosts.simulated_host(r, 4) for r in range(4)] == [0, 0, 1, 1]
    assert [hosts.simulated_host(r, 3) for r in range(3)] == [0, 0, 1]
    ids = [hosts.host_id(r, 4) for r in range(4)]
    assert ids[0] == ids[1] != ids[2] == ids[3] and all(0 <= i < 2**62 for i in ids)
    monkeypatch.setenv(hosts.SIM_HOSTS_VAR, "4")
    assert len({hosts.host_id(r, 4) for r in range(4)}) == 4
    for bad, words in (("0", "must be at least 1"), ("two", "is not an integer"),
                       ("-1", "must be at least 1")):
        monkeypatch.setenv(hosts.SIM_HOSTS_VAR, bad)
        with pytest.raises(ConfigError, match=f"DTENSOR_SIM_HOSTS={bad!r} {words}"):
            hosts.simulated_host(0, 4)
    monkeypatch.setenv(hosts.SIM_HOSTS_VAR, "5")
    with pytest.raises(ConfigError, match="5: more simulated hosts than the job's 4 ranks"):
        hosts.simulated_host(0, 4)


def test_which_mesh_dims_span_hosts():
    # 2 hosts of 4 ranks, mesh (2, 4) row-major: dim 0 crosses them, dim 1 stays inside
    host_grid = np.arange(8).reshape(2, 4) // 4
    assert hosts.spans_of(host_grid) == (True, False)
    assert hosts.spans_of(np.arange(8).reshape(4, 2) // 4) == (True, False)
    assert hosts.spans_of(np.arange(8).reshape(2, 4) // 2) == (True, True)
    assert hosts.spans_of(np.zeros((2, 2), int)) == (False, False)
    hosts.note_hosts([1000, 1001, 1002, 1003], [7, 7, 9, 9])
    assert hosts.spans_hosts(np.array([[1000, 1001], [1002, 1003]])) == (True, False)
    assert hosts.spans_hosts(np.array([[1000, 1002], [1001, 1003]])) == (False, True)
    assert hosts.spans_hosts(np.array([[1000, 5000]])) == (False, False)  # a host not known


def test_abstract_mesh_ranks_per_host():
    mesh = dt.AbstractMesh((4, 8), ("dp", "tp"), ranks_per_host=8)
    assert mesh.dim_spans_hosts == (True, False)
    assert mesh["tp"].dim_spans_hosts == (False,) and mesh["dp"].dim_spans_hosts == (True,)
    assert mesh._flatten().dim_spans_hosts == (True,)
    assert dt.AbstractMesh((4, 8)).dim_spans_hosts == (False, False)
    assert mesh != dt.AbstractMesh((4, 8), ("dp", "tp"))  # a different machine
    assert pickle.loads(pickle.dumps(mesh)) == mesh
    assert "dim_spans_hosts=(True, False)" in repr(mesh)
    assert dt.AbstractMesh((4, 8), ranks_per_host=2).dim_spans_hosts == (True, True)
    with pytest.raises(MeshError, match="ranks_per_host must be a positive int, got 0"):
        dt.AbstractMesh((4, 8), ranks_per_host=0)


def test_cost_model_prices_a_dim_that_spans_hosts_with_the_network_tier():
    model = CostModel(5e-6, 5e9, per_mesh_dim={2: {"default": {"alpha_s": 1e-6}}})
    assert model.inter_host == (2e-5, 1.25e9)  # the documented default
    assert model.params("all_gather", 0, inter_host=True) == (2e-5, 1.25e9)
    assert model.params("all_gather", 0) == (5e-6, 5e9)
    assert model.params("all_gather", 2, inter_host=True) == (1e-6, 5e9)  # named dim wins
    fast = CostModel(inter_host={"beta_bytes_per_s": 2.4e10})
    assert fast.inter_host == (2e-5, 2.4e10) and fast != CostModel()
    assert hash(fast) != hash(CostModel())
    assert CostModel.from_dict(json.loads(json.dumps(fast.to_dict()))) == fast
    with pytest.raises(ConfigError, match="inter_host"):
        CostModel(inter_host={"alpha_s": -1})

    hosts2 = dt.AbstractMesh((2, 4), ranks_per_host=4)
    one = dt.AbstractMesh((2, 4))
    spec = DTensorSpec(hosts2, (S(0), S(1)), (64, 64), np.float32)
    assert spans_hosts(hosts2, 0) and not spans_hosts(hosts2, 1)
    assert not spans_hosts(object(), 0)
    gather0, gather1 = plan(spec, (R, S(1))), plan(spec, (S(0), R))
    local = DTensorSpec(one, (S(0), S(1)), (64, 64), np.float32)
    nbytes = 64 * 16 * 4 // 2  # the all-gather on dim 0: (k-1)/k of the 64x16 gathered block
    assert plan_cost(gather0, spec) == pytest.approx(2e-5 + nbytes / 1.25e9)
    assert plan_cost(plan(local, (R, S(1))), local) == pytest.approx(5e-6 + nbytes / 5e9)
    assert plan_cost(gather1, spec) == plan_cost(plan(local, (S(0), R)), local)
