"""``dt.auto_shard`` under MPI: the chosen plan runs and its loss and update equal the local
run's; its prediction is that of a trace of what runs; ``apply`` places DTensors and
arrays; the calibration fitted to the measured step prices it; explain's trace of a
tensor-parallel step prices the explicit all-reduce and predicts the collectives that run;
a memory budget is met (1-D mesh, and 2x2 at 4 ranks).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import dtensor as dt
from dtensor.autoshard import Calibration, predict_step
from dtensor.autoshard._predict import build_tensors, trace_step
from launch.examples._training import mlp_model

WORLD = MPI.COMM_WORLD
R, S = dt.Replicate(), dt.Shard
pytestmark = pytest.mark.mode_independent


def _mesh():
    return dt.init_device_mesh((2, 2) if WORLD.size == 4 else (WORLD.size,))


def _sgd(ps):
    return dt.optim.SGD(ps, lr=0.05, momentum=0.9)


@pytest.mark.mpi(min_size=2)
def test_chosen_plan_runs_like_the_local_step_is_predicted_honestly_and_meets_budgets():
    mesh = _mesh()
    model = mlp_model(batch=8, dim=8, hidden=16)
    params, batch = model.init(), model.batch(0)
    cal = Calibration()
    plan = dt.auto_shard(model.loss, params, batch, mesh, optimizer=_sgd, calibration=cal,
                         rounds=1, pairs=2, top_k=2, fit_step=True)
    if mesh.ndim == 2:  # candidates on both mesh dims were weighed
        assert any(p[0] != R and p[1] != R for c in plan.candidates
                   for p in c.placements.values())
    # the prediction is that of the chosen placements, traced again from scratch (priced
    # with the calibration fitted to the step)
    layouts = {**plan.placements, **plan.input_placements}
    again = predict_step(model.loss, params, batch, mesh, layouts, optimizer=_sgd,
                         calibration=plan.calibration)
    assert again.time_s == pytest.approx(plan.predicted_time, rel=1e-12)
    assert again.peak_bytes == plan.predicted_peak_bytes
    _check_step_fit(model, plan, cal, mesh)
    # the chosen plan, and the fastest candidate that shards something, run as locally
    sharded = next(c.placements for c in plan.candidates
                   if any(p != (R,) * mesh.ndim for p in c.placements.values()))
    for layouts in (plan, dt.autoshard.ShardingPlan(
            {n: sharded[n] for n in params}, {n: sharded[n] for n in batch}, plan.prediction,
            mesh=mesh)):
        _check_runs_like_local(model, layouts, mesh)
    # a budget of the smallest predicted peak weighed is met
    budget = min(c.prediction.peak_bytes for c in plan.candidates)
    small = dt.auto_shard(model.loss, params, batch, mesh, budget, optimizer=_sgd,
                          calibration=cal, rounds=1, pairs=0, top_k=1)
    assert small.predicted_peak_bytes <= budget
    # only fit layouts predicted within the budget ran: not the all-replicated one
    assert small.step_fit is None or all(
        any(p != (R,) * mesh.ndim for p in lay.values()) for lay in small.step_fit.layouts)
    assert all(c.fits == (c.prediction.peak_bytes <= budget) for c in small.candidates)


def _check_step_fit(model, plan, cal, mesh):
    """The fit ran on the real mesh: the layouts measured (the given one first, all
    replicated), their times the same on every rank, the fitted terms those of the plan's
    calibration (the given one otherwise unchanged), and each layout's fitted prediction
    that of a trace priced with it."""
    fit = plan.step_fit
    rep = (R,) * mesh.ndim
    assert fit is not None and 3 <= len(fit.layouts) <= 4
    assert all(p == rep for p in fit.layouts[0].values())
    assert min(fit.measured_s) > 0 and WORLD.allgather(fit.measured_s)[0] == fit.measured_s
    fitted = plan.calibration
    assert (fitted.compute_scale, fitted.entry_s, fitted.sync_s) == (
        fit.compute_scale, fit.entry_s, fit.sync_s)
    assert fitted.kernels == cal.kernels and fitted.cost_model == cal.cost_model
    params, batch = model.init(), model.batch(0)
    for layouts, before, after in zip(fit.layouts, fit.predicted_s, fit.fitted_s):
        for c, want in ((cal, before), (fitted, after)):
            got = predict_step(model.loss, params, batch, mesh, layouts, optimizer=_sgd,
                               calibration=c)
            assert got.time_s == pytest.approx(want, rel=1e-9)


def _check_runs_like_local(model, plan, mesh):
    """One SGD step in ``plan``'s placements: the loss and the updated parameters equal
    the local step's. ``apply`` takes DTensor parameters (leaves that require grad) and
    array inputs."""
    params, batch = model.init(), model.batch(0)
    start = {n: dt.distribute_tensor(a, mesh, [R] * mesh.ndim).requires_grad_()
             for n, a in params.items()}
    placed = plan.apply(start)
    ins = plan.apply_inputs(batch)
    for n, t in placed.items():
        assert t.placements == plan.placements[n] and t.is_leaf and t.requires_grad
    assert all(ins[n].placements == pl for n, pl in plan.input_placements.items())
    opt = _sgd(list(placed.values()))
    loss = model.loss(placed, ins)
    loss.backward()
    opt.step()
    local = {n: dt.from_numpy(a.copy()).requires_grad_() for n, a in params.items()}
    local_opt = _sgd(list(local.values()))
    want = model.loss(local, {n: dt.from_numpy(a) for n, a in batch.items()})
    want.backward()
    local_opt.step()
    got = loss.full_tensor().item() if isinstance(loss, dt.DTensor) else loss.item()
    assert got == pytest.approx(want.item(), rel=1e-5), str(plan)
    for n, t in placed.items():
        np.testing.assert_allclose(t.detach().full_tensor().numpy(),
                                   local[n].detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.mpi(min_size=2)
def test_trace_prices_explicit_redistributes_and_predicts_what_runs():
    mesh = dt.init_device_mesh((WORLD.size,))
    model = mlp_model(batch=8, dim=8, hidden=16)
    params, batch = model.init(), model.batch(0)
    tp = {n: (model.tp[n],) for n in params}
    tp.update({n: (R,) for n in batch})
    built = build_tensors(params, mesh, tp, True)
    ins = build_tensors(batch, mesh, tp, False)
    trace = trace_step(model.loss, built, ins, _sgd)
    expl = trace.explanation
    # the row-parallel output's all-reduce (an explicit redistribute) is in the forward
    forward = [o for o in expl.ops if o.phase == "forward" and o.op == "redistribute"]
    assert any(c.kind == "all_reduce" for o in forward for c in o.collectives)
    assert forward[0].local_inputs[0] == ((8, 8), "float32")
    # every collective that ran was predicted, and no other
    assert expl.comm_counts() == expl.issued
    mm = next(o for o in expl.ops if o.op == "matmul")
    assert mm.local_inputs[1] == ((8, 16 // WORLD.size + (16 % WORLD.size > 0)), "float32")
    pred = predict_step(model.loss, params, batch, mesh, tp, optimizer=_sgd)
    assert pred.comm_s > 0 and pred.collectives == sum(expl.comm_counts().values())


@pytest.mark.mpi(min_size=2)
def test_search_on_the_abstract_mesh_predicts_what_the_real_mesh_search_traces():
    """The same search on ``AbstractMesh.from_mesh(mesh)`` (metadata only, no data, one
    process could run it) weighs the same candidates with the same predictions as on the
    real mesh, and picks the same plan."""
    mesh = _mesh()
    model = mlp_model(batch=8, dim=8, hidden=16)
    params, batch = model.init(), model.batch(0)
    cal = Calibration()
    kwargs = {"optimizer": _sgd, "calibration": cal, "rounds": 1, "pairs": 2, "top_k": 2,
              "fit_step": False}  # nothing runs on the abstract mesh: no fit on either
    real = dt.auto_shard(model.loss, params, batch, mesh, **kwargs)
    amesh = dt.AbstractMesh.from_mesh(mesh)
    abstract_params = {n: dt.abstract_like(a, amesh) for n, a in params.items()}
    abstract = dt.auto_shard(model.loss, abstract_params, batch, amesh, **kwargs)

    def table(plan):
        return sorted((tuple(sorted(c.placements.items())), c.prediction.time_s,
                       c.prediction.peak_bytes, c.prediction.collectives)
                      for c in plan.candidates)

    assert table(abstract) == table(real)
    assert abstract.placements == real.placements
    assert abstract.predicted_time == real.predicted_time
    placed = abstract.apply(abstract_params)
    assert all(isinstance(t, dt.AbstractDTensor) and t.placements == abstract.placements[n]
               for n, t in placed.items())


@pytest.mark.mpi(min_size=1)
def test_calibrate_measures_the_copy_rate_and_the_slowdown_beside_gathers(tmp_path):
    """``calibrate`` stores ``copy_rate`` and, on more than one rank, ``overlap_slowdown``
    from a matmul timed alone and beside the worker thread's all-gathers (the same on every
    rank: the slowest rank's)."""
    from dtensor.autoshard import load_calibration
    from dtensor.autoshard._measure import measure_overlap

    mesh = _mesh()
    path = tmp_path / "cal.json" if WORLD.rank == 0 else None
    path = WORLD.bcast(path)
    cal = dt.autoshard.calibrate(mesh, path, sizes=(32, 96), repeat=2)
    assert cal.copy_rate > 1e7 and cal.points["copy_rate"] == cal.copy_rate
    if mesh.size() > 1:
        o = cal.points["overlap"]
        assert o["alone_s"] > 0 and o["beside_s"] > 0 and o["gather_s"] > 0
        assert cal.overlap_slowdown == max(o["beside_s"] / o["alone_s"], 1.0)
        alone, beside, gather = measure_overlap(mesh, 64, gather_bytes=1 << 20, repeat=2)
        values = WORLD.allgather((alone, beside, gather))
        assert all(v == values[0] for v in values) and min(values[0]) > 0
    else:
        assert cal.overlap_slowdown == 1.0 and "overlap" not in cal.points
    WORLD.Barrier()
    back = load_calibration(path)
    assert (back.copy_rate, back.overlap_slowdown) == (cal.copy_rate, cal.overlap_slowdown)
