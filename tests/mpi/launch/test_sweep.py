"""Strategy sweeps on tiny sizes: every strategy's result matches numpy, and the reported
communication matches each layout; every strategy runs at every world size (the 2-D ones on
``(n/2, 2)``, ``(n, 1)`` or ``(1, 1)`` meshes), a user's model (``--model
package.module:function``) included.

Run: ``mpiexec -n 4 python -m pytest tests/mpi/launch/test_sweep.py --with-mpi`` (1-3 ranks use a
1-D mesh for the three 1-D strategies of the forward sweep).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import dtensor as dt
from launch.experiments._families import resolve
from launch.experiments._sweep import (
    all_strategies,
    attention_block,
    format_table,
    mlp_block,
    run_sweep,
    standard_strategies,
)

WORLD = MPI.COMM_WORLD


def mesh_for_world():
    return dt.init_device_mesh((2, 2) if WORLD.size == 4 else (WORLD.size,))


def by_name(results):
    return {r["name"]: r for r in results}


@pytest.mark.mpi(min_size=1)
def test_mlp_sweep_all_strategies_match_numpy():
    mesh = mesh_for_world()
    model = mlp_block(batch=8, dim=8, hidden=16)
    strategies = standard_strategies(model, mesh.ndim)
    assert len(strategies) == (4 if mesh.ndim == 2 else 3)
    results = by_name(run_sweep(model, strategies, mesh, repeat=1, number=1))
    assert set(results) == set(strategies)
    for name, r in results.items():
        assert "error" not in r, r
        assert r["max_error"] < 1e-4, name
        assert r["time_us"] > 0
        assert len(r["peak_bytes"]) == WORLD.size
        assert r["comm_count"] == sum(v["count"] for v in r["comm"].values())
        assert (r["predicted_comm_us"] > 0) == (r["comm_count"] > 0 and WORLD.size > 1), name
    # layouts that never communicate in the forward pass
    assert results["replicated"]["comm_count"] == 0
    assert results["data-parallel"]["comm_count"] == 0
    if WORLD.size > 1:
        # Megatron TP: the row-parallel matmul leaves a partial sum, reduced once per mesh dim
        tp = results["tensor-parallel"]["comm"]
        assert set(tp) == {"all_reduce"} and tp["all_reduce"]["count"] == mesh.ndim
    if mesh.ndim == 2:
        assert results["2-D dp x tp"]["comm"] == {
            "all_reduce": {"count": 1, "bytes": results["2-D dp x tp"]["comm_bytes"]}
        }
    table = format_table(list(results.values()))
    assert all(name in table for name in strategies)
    json.dumps(list(results.values()))  # the report is JSON-serialisable


@pytest.mark.mpi(min_size=1)
def test_attention_sweep_matches_numpy():
    mesh = mesh_for_world()
    model = attention_block(seq=8, dim=8)
    results = run_sweep(model, standard_strategies(model, mesh.ndim), mesh, repeat=1, number=1)
    for r in results:
        assert "error" not in r, r
        assert r["max_error"] < 1e-4, r["name"]


@pytest.mark.mpi(min_size=2)
def test_every_combination_for_a_small_case():
    mesh = dt.init_device_mesh((WORLD.size,))
    model = mlp_block(batch=4, dim=4, hidden=8)
    strategies = all_strategies(model, mesh.ndim, limit=27)
    assert len(strategies) == 27  # {R, S(0), S(1)} for each of x, w1, w2
    results = run_sweep(model, strategies, mesh, repeat=1, number=1)
    for r in results:
        assert "error" not in r, r
        assert r["max_error"] < 1e-4, r["name"]


@pytest.mark.mpi(min_size=1)
def test_training_sweep_reports_phases_and_matches_local(tmp_path):
    """``strategy_sweep.py --train`` at a tiny size: every strategy's first loss equals the
    local run's; data parallelism communicates in backward only (one all-reduce per weight
    gradient, of its whole size), with a cost-model prediction beside it; the JSON holds
    every field."""
    from launch.experiments import strategy_sweep

    path = WORLD.bcast(str(tmp_path / "train.json"))
    assert strategy_sweep.main(["--train", "--size", "tiny", "--repeat", "1",
                                "--out", path]) == 0
    doc = json.loads(Path(path).read_text()) if WORLD.rank == 0 else None
    doc = WORLD.bcast(doc)
    assert doc["mode"] == "train" and doc["model"] == "mlp" and doc["ranks"] == WORLD.size
    results = by_name(doc["results"])
    assert list(results) == ["local", "dp", "tp", "2d"]  # every strategy at every size
    assert results["2d"]["mesh"] == list(strategy_sweep.two_d_mesh(WORLD.size))
    assert results["local"]["mesh"] is None and results["dp"]["mesh"] == [WORLD.size]
    phases = ["forward", "backward", "optimizer"]
    for name, r in results.items():
        assert r["loss_error"] < 1e-5, name
        assert r["step_us"] > 0 and all(r["phase_us"][p] > 0 for p in phases), name
        assert list(r["comm"]) == phases and len(r["peak_bytes"]) == WORLD.size
        assert r["predicted_comm_us"]["optimizer"] is None
        assert r["predicted_step_us"] is None  # the training models' predictor: collectives
        for p in phases:
            assert r["comm_count"][p] == sum(v["count"] for v in r["comm"][p].values())
    assert results["local"]["comm_count"] == {p: 0 for p in phases}
    dp = results["dp"]
    n_params = sum(np.prod(s) for s in doc["shapes"].values())
    if WORLD.size > 1:
        assert dp["comm"]["forward"] == {} and dp["comm"]["optimizer"] == {}
        assert dp["comm"]["backward"] == {"all_reduce": {"count": 4, "bytes": 4 * n_params}}
        assert dp["predicted_comm_us"]["backward"] > 0 == dp["predicted_comm_us"]["forward"]
        # Megatron: the row-parallel output's all-reduce; its backward moves nothing
        tp = results["tp"]["comm"]
        assert tp["forward"] == {"all_reduce": {"count": 1, "bytes": 8 * 16 * 4}}
        assert tp["backward"] == {}
        # clip_grad_norm_: one scalar (float64) reduction per sharded gradient, no gather
        assert tp["optimizer"] == {"all_reduce": {"count": 3, "bytes": 3 * 8}}
    else:
        assert all(r["comm_count"] == {p: 0 for p in phases} for r in results.values())


@pytest.mark.mpi(min_size=2)
@pytest.mark.mode_independent
def test_auto_sweep_sets_predictions_beside_measurements(tmp_path):
    """``strategy_sweep.py --train --auto``: at least ``--count`` strategies, each with a
    prediction, a measurement and the local run's loss; the chosen plan is measured first;
    the budget plan's predicted peak is within its budget; a Spearman figure and a chart."""
    from launch.experiments import strategy_sweep

    path = WORLD.bcast(str(tmp_path / "auto.json"))
    png = WORLD.bcast(str(tmp_path / "auto.png"))
    assert strategy_sweep.main(["--train", "--auto", "--size", "tiny", "--repeat", "1",
                                "--count", "4", "--solver", "bnb", "--fit", "--out", path, "--png", png,
                                "--calibration", str(_calibration(tmp_path))]) == 0
    doc = WORLD.bcast(json.loads(Path(path).read_text()) if WORLD.rank == 0 else None)
    assert doc["mode"] == "auto" and doc["mesh"] == [WORLD.size]
    rows = doc["results"]
    assert len(rows) >= 4 and rows[0]["name"] == "auto"
    assert len({json.dumps(r["placements"], sort_keys=True) for r in rows}) == len(rows)
    for r in rows:
        assert r["loss_error"] < 1e-5 and r["step_us"] > 0 and r["predicted_us"] > 0, r
        assert r["predicted_peak_bytes"] > 0 and r["peak_bytes"] >= 0
    assert -1 <= doc["spearman"] <= 1 and doc["chosen_over_best"] >= 1
    # the calibration was fitted to the step in 3-4 layouts, each measured again here
    fit = doc["step_fit"]
    assert 3 <= len(fit["layouts"]) <= 4 and min(fit["measured_us"]) > 0
    labels = [" ".join(f"{n}={','.join(p)}" for n, p in r["placements"].items()
                       if any(x != "R" for x in p)) or "all replicated" for r in rows]
    assert set(fit["layouts"]) <= set(labels)
    assert doc["unfitted_count"] == len(rows) - len(fit["layouts"])
    b = doc["budget"]
    assert b["predicted_peak_bytes"] <= b["bytes"] and b["loss_error"] < 1e-5
    assert b["respected"] == (b["measured_peak_bytes"] <= b["bytes"])
    if WORLD.rank == 0:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return
        assert Path(png).stat().st_size > 0


@pytest.mark.mpi(min_size=1)
def test_forward_sweep_runs_every_standard_strategy(tmp_path):
    """``strategy_sweep.py`` (forward) at any world size: the four standard layouts, the 2-D
    one on its own ``(n/2, 2)`` / ``(n, 1)`` mesh where the sweep's mesh is 1-D, each equal to
    numpy."""
    from launch.experiments import strategy_sweep

    path = WORLD.bcast(str(tmp_path / "forward.json"))
    assert strategy_sweep.main(["--size", "tiny", "--repeat", "1", "--out", path,
                                "--quiet"]) == 0
    doc = WORLD.bcast(json.loads(Path(path).read_text()) if WORLD.rank == 0 else None)
    results = by_name(doc["results"])
    assert set(results) == {"replicated", "data-parallel", "tensor-parallel", "2-D dp x tp"}
    assert doc["mesh"] == list(strategy_sweep.default_mesh(WORLD.size))
    two_d = doc["mesh"] if len(doc["mesh"]) == 2 else list(strategy_sweep.two_d_mesh(WORLD.size))
    assert results["2-D dp x tp"]["mesh"] == two_d
    for name, r in results.items():
        assert "error" not in r and r["max_error"] < 1e-4, name
        if name != "2-D dp x tp":
            assert r["mesh"] == doc["mesh"], name


@pytest.mark.mpi(min_size=1)
def test_training_sweep_of_a_users_model(tmp_path, capsys):
    """``--train --model launch.examples.sweep_model:build``: a model the sweep knows only
    through its function (step_fn, params, inputs, tp) runs under local, dp, tp and 2d with
    the local run's first loss; rank 0 prints one progress line per strategy on stderr."""
    from launch.experiments import strategy_sweep

    path = WORLD.bcast(str(tmp_path / "user.json"))
    assert strategy_sweep.main(["--train", "--model", "launch.examples.sweep_model:build",
                                "--size", "tiny", "--repeat", "1", "--out", path]) == 0
    doc = WORLD.bcast(json.loads(Path(path).read_text()) if WORLD.rank == 0 else None)
    assert doc["model"] == "launch.examples.sweep_model:build"
    assert set(doc["shapes"]) == {"norm.g", "w1", "b1", "w2", "head"}
    results = by_name(doc["results"])
    assert list(results) == ["local", "dp", "tp", "2d"]
    for name, r in results.items():
        assert r["loss_error"] < 1e-5 and r["step_us"] > 0, name
    if WORLD.size > 1:  # dp all-reduces every gradient in backward; tp moves activations
        assert results["dp"]["comm_count"]["backward"] > 0
        assert results["tp"]["comm_count"]["forward"] > 0
    out, err = capsys.readouterr()
    if WORLD.rank == 0:
        for i, name in enumerate(results, 1):
            assert f"strategy_sweep: [{i}/4] {name} (" in err, err
        assert "training step of launch.examples.sweep_model:build" in out
    else:
        assert "strategy_sweep:" not in err and out == ""


@pytest.mark.mpi(min_size=1)
@pytest.mark.mode_independent
def test_auto_sweep_on_a_2d_mesh_measures_every_named_layout(tmp_path):
    """``--train --auto --mesh a,b`` on a 2-D mesh (``(n/2, 2)``, ``(n, 1)`` for odd n):
    replicated, dp (the batch over both mesh dims), tp (each weight over both) and 2d are
    measured beside the search's plans, each with the local run's first loss."""
    from launch.experiments import strategy_sweep

    path = WORLD.bcast(str(tmp_path / "auto2d.json"))
    mesh = ",".join(map(str, strategy_sweep.two_d_mesh(WORLD.size)))
    assert strategy_sweep.main(["--train", "--auto", "--size", "tiny", "--repeat", "1",
                                "--count", "5", "--solver", "bnb", "--mesh", mesh, "--quiet",
                                "--out", path, "--calibration", str(_calibration(tmp_path))]
                               ) == 0
    doc = WORLD.bcast(json.loads(Path(path).read_text()) if WORLD.rank == 0 else None)
    assert doc["mesh"] == list(strategy_sweep.two_d_mesh(WORLD.size))
    assert doc["calibration"]["source"] == "stored"
    rows = by_name(doc["results"])
    family = resolve("mlp", "tiny")
    shape = strategy_sweep.two_d_mesh(WORLD.size)
    named = family.named_layouts(dt.AbstractMesh(shape))
    assert list(named) == ["replicated", "dp", "tp", "2d"]
    for name, lay in named.items():
        short = {n: [p.short() for p in pl] for n, pl in lay.items()}
        # measured under its name, or it is the plan auto_shard chose (measured as "auto")
        assert rows.get(name, rows["auto"])["placements"] == short, name
    assert named["2d"]["w1"] == (dt.Replicate(), dt.Shard(1))
    assert named["dp"]["x"] == (dt.Shard(0), dt.Shard(0))
    assert named["tp"]["w2"] == (dt.Shard(0), dt.Shard(0))
    for r in rows.values():
        assert r["loss_error"] < 1e-5 and r["step_us"] > 0, r["name"]


def _calibration(tmp_path):
    """A calibration file with the built-in constants (nothing measured: fast)."""
    path = Path(WORLD.bcast(str(tmp_path / "cal.json")))
    if WORLD.rank == 0:
        dt.autoshard.Calibration(ranks=WORLD.size).save(path)
    WORLD.Barrier()
    return path
