"""``dt.auto_shard`` in one process: the solver against brute force (both backends), the
candidates, the calibration file, the fit of the calibration to measured steps, the plan
object and the memory-budget error."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

import dtensor as dt
from dtensor.autoshard import (
    Calibration,
    Prediction,
    Problem,
    candidate_placements,
    fit_to_steps,
    load_calibration,
    solve,
)
from dtensor.autoshard._calibrate import DEFAULT_COPY_RATE, op_class, op_work
from placements.errors import ArgumentError, ConfigError, DTypeError

R, S = dt.Replicate(), dt.Shard
pytestmark = pytest.mark.mode_independent


def brute_force(problem: Problem, k: int) -> list[tuple[float, float, tuple]]:
    """Every assignment, evaluated: the k cheapest that fit, as (cost, memory, choice)."""
    out = []
    for choice in itertools.product(*(range(len(c)) for c in problem.cost)):
        cost, mem = problem.evaluate(choice)
        if problem.fits(mem):
            out.append((cost, mem, choice))
    return sorted(out)[:k]


def random_problem(rng: np.random.Generator, budget: bool) -> Problem:
    nv = int(rng.integers(2, 6))
    sizes = [int(rng.integers(1, 5)) for _ in range(nv)]
    cost = [list(rng.normal(0, 1, n)) for n in sizes]
    memory = [list(rng.uniform(0, 10, n)) for n in sizes]
    pair_cost, pair_memory = {}, {}
    for a, b in itertools.combinations(range(nv), 2):
        for ca, cb in itertools.product(range(sizes[a]), range(sizes[b])):
            if rng.random() < 0.3:
                pair_cost[a, ca, b, cb] = float(rng.normal(0, 1))
            if rng.random() < 0.2:
                pair_memory[a, ca, b, cb] = float(rng.uniform(-3, 3))
    limit = None
    if budget:
        probe = Problem(cost, pair_cost, memory, pair_memory)
        mems = sorted(probe.evaluate(c)[1]
                      for c in itertools.product(*(range(n) for n in sizes)))
        limit = mems[len(mems) // 3]
    return Problem(cost, pair_cost, memory, pair_memory, limit, 0.0)


@pytest.mark.parametrize("backend", ["bnb", "milp"])
def test_solver_matches_brute_force_on_random_tables(backend):
    rng = np.random.default_rng(7)
    for trial in range(12):
        problem = random_problem(rng, budget=trial % 2 == 1)
        k = 1 + trial % 3
        want = brute_force(problem, k)
        got = solve(problem, k, backend)
        assert [round(s.cost, 9) for s in got] == [round(c, 9) for c, _, _ in want], trial
        for s in got:  # each reported solution is what its choice evaluates to, and fits
            assert problem.evaluate(s.choice) == pytest.approx((s.cost, s.memory))
            assert problem.fits(s.memory)
        assert len({s.choice for s in got}) == len(got)


@pytest.mark.parametrize("backend", ["bnb", "milp"])
def test_solver_reports_no_solution_when_nothing_fits(backend):
    problem = Problem([[1.0, 2.0], [0.0, 1.0]], memory=[[5.0, 3.0], [4.0, 5.0]], budget=6.0)
    assert solve(problem, 2, backend) == []
    fits = Problem([[1.0, 2.0], [0.0, 1.0]], memory=[[5.0, 3.0], [4.0, 5.0]], budget=7.0)
    (only,) = solve(fits, 3, backend)
    assert only.choice == (1, 0) and only.cost == 2.0 and only.memory == 7.0


def test_solver_rejects_bad_tables():
    with pytest.raises(ArgumentError, match="without choices"):
        Problem([[1.0], []])
    with pytest.raises(ArgumentError, match="outside the table"):
        Problem([[1.0], [2.0]], {(0, 0, 1, 3): 1.0})
    with pytest.raises(ArgumentError, match="unknown backend"):
        solve(Problem([[1.0]]), 1, "greedy")


def test_candidate_placements_are_legal_and_start_replicated():
    got = candidate_placements((4, 1), (2,))
    assert got == [(R,), (S(0),)]  # dim 1 (size 1) cannot be split over 2 ranks
    two = candidate_placements((4, 6), (2, 2))
    assert two[0] == (R, R) and (S(0), S(0)) in two and (S(1), S(0)) in two
    assert len(two) == 9
    assert (S(0), S(0)) not in candidate_placements((3, 6), (2, 2))  # 3 rows over 4 ranks
    assert candidate_placements((8, 8), (2,), dims=(0,)) == [(R,), (S(0),)]


def test_op_classes_and_work():
    assert [op_class(n) for n in ("matmul", "softmax", "add", "view", "redistribute")] == [
        "matmul", "nn", "pointwise", "view", "view"]
    blocks = (((4, 8), "float32"), ((8, 3), "float32"))
    assert op_work("matmul", blocks, (((4, 3), "float32"),)) == 2 * 4 * 3 * 8
    assert op_work("add", blocks[:1] * 2, blocks[:1]) == 3 * 4 * 8 * 4
    assert op_work("transpose", blocks[:1], blocks[:1]) == 0


def test_calibration_file_round_trip(tmp_path, monkeypatch):
    path = tmp_path / "cal.json"
    cal = Calibration({"alpha_s": 1e-5, "beta_bytes_per_s": 1e9},
                      {"matmul": {"alpha_s": 1e-6, "rate": 1e9},
                       "view": {"alpha_s": 2e-6, "rate": math.inf}},
                      ranks=2, mesh_shape=(2,), entry_s=3e-6, sync_s=4e-6)
    assert cal.save(path) == path
    back = load_calibration(path)
    assert back.kernels["matmul"] == {"alpha_s": 1e-6, "rate": 1e9}
    assert back.kernels["view"]["rate"] == math.inf  # stored as null
    assert (back.entry_s, back.sync_s, back.mesh_shape) == (3e-6, 4e-6, (2,))
    assert back.model().alpha_s == 1e-5
    blocks = (((4, 8), "float32"), ((8, 3), "float32"))
    assert back.kernel_seconds("matmul", blocks, (((4, 3), "float32"),)) == pytest.approx(
        1e-6 + 192 / 1e9)
    # the default path follows DTENSOR_CALIBRATION; a missing default file is no calibration
    monkeypatch.setenv("DTENSOR_CALIBRATION", str(tmp_path / "none.json"))
    assert load_calibration(ranks=2) is None
    with pytest.raises(ConfigError, match="no file"):
        load_calibration(tmp_path / "none.json")
    # a value that names no .json file is refused, as every DTENSOR_* setting is
    for bad in ("banana", str(tmp_path)):
        monkeypatch.setenv("DTENSOR_CALIBRATION", bad)
        with pytest.raises(ConfigError, match=f"DTENSOR_CALIBRATION={bad!r} is not the path"):
            load_calibration(ranks=2)
    monkeypatch.delenv("DTENSOR_CALIBRATION")
    path.write_text(json.dumps({"version": 1, "kernels": {"gemm": {"alpha_s": 1}}}))
    with pytest.raises(ConfigError, match="unknown op class 'gemm'"):
        load_calibration(path)


def test_calibration_fsdp_fields_round_trip_and_old_files_load(tmp_path):
    path = tmp_path / "cal.json"
    cal = Calibration(ranks=2, mesh_shape=(2,), overlap_slowdown=1.25, copy_rate=3e9)
    back = load_calibration(cal.save(path))
    assert (back.overlap_slowdown, back.copy_rate) == (1.25, 3e9)
    data = json.loads(path.read_text())
    for key in ("overlap_slowdown", "copy_rate"):  # a file written before the fields
        del data[key]
    path.write_text(json.dumps(data))
    old = load_calibration(path)
    assert (old.overlap_slowdown, old.copy_rate) == (1.0, DEFAULT_COPY_RATE)
    for key, bad in (("overlap_slowdown", 0.5), ("copy_rate", 0)):
        path.write_text(json.dumps({**data, key: bad}))
        with pytest.raises(ConfigError, match="overlap_slowdown must be >= 1 and copy_rate > 0"):
            load_calibration(path)


def _terms(work_s, entries, collectives, alpha_s=3e-4, model_comm_s=0.0):
    return Prediction(0.0, 0.0, 0.0, 0, 0, 0, collectives, entries=entries, alpha_s=alpha_s,
                      work_s=work_s, model_comm_s=model_comm_s)


def test_fit_to_steps_recovers_known_terms_and_keeps_what_no_step_shows():
    cal = Calibration(entry_s=1e-6, sync_s=2e-6)
    steps = [_terms(8e-4, 60, 0), _terms(6e-4, 60, 4, model_comm_s=1.5e-4),
             _terms(5e-4, 58, 12, model_comm_s=2e-4), _terms(5.5e-4, 61, 9, model_comm_s=9e-5)]

    def seconds(scale, entry, sync):
        return [p.alpha_s + scale * p.work_s + entry * p.entries + p.model_comm_s
                + sync * p.collectives for p in steps]

    assert [p.time_with(Calibration(entry_s=3e-6, sync_s=4e-6, compute_scale=2.0))
            for p in steps] == pytest.approx(seconds(2.0, 3e-6, 4e-6), rel=1e-12)

    fitted = fit_to_steps(cal, steps, seconds(1.7, 12e-6, 80e-6))
    assert (fitted.compute_scale, fitted.entry_s, fitted.sync_s) == pytest.approx(
        (1.7, 12e-6, 80e-6), rel=1e-9)
    assert fitted.kernels == cal.kernels and cal.compute_scale == 1.0  # a new calibration
    # the fit is priced as the prediction is: a trace's time with the fitted terms
    assert Calibration.from_dict(fitted.to_dict()).compute_scale == pytest.approx(1.7)
    # a term fitted below zero is 0 (non-negative least squares): collectives that cost
    # nothing beyond the cost model
    assert fit_to_steps(cal, steps, seconds(1.2, 9e-6, -5e-6)).sync_s == 0.0
    # no collective in any step: sync_s keeps its calibrated value
    no_comm = [_terms(8e-4, 60, 0), _terms(4e-4, 62, 0), _terms(6e-4, 50, 0)]
    got = fit_to_steps(cal, no_comm, [p.alpha_s + 2 * p.work_s + 1e-5 * p.entries
                                      for p in no_comm])
    assert (got.compute_scale, got.entry_s, got.sync_s) == pytest.approx((2, 1e-5, 2e-6))
    # fewer steps than terms: the calibration as it is
    assert fit_to_steps(cal, steps[:2], [1e-3, 2e-3]) is cal
    with pytest.raises(ConfigError, match="4 predictions and 3 measured"):
        fit_to_steps(cal, steps, [1e-3] * 3)


def _mlp_step(p, b):
    return ((b["x"] @ p["w1"]).relu() @ p["w2"]).square().mean()


def _mlp_arrays():
    rng = np.random.default_rng(0)
    params = {"w1": rng.standard_normal((8, 16)).astype(np.float32),
              "w2": rng.standard_normal((16, 4)).astype(np.float32)}
    return params, {"x": rng.standard_normal((6, 8)).astype(np.float32)}


def test_auto_shard_plan_object_on_one_rank():
    mesh = dt.init_device_mesh((1,))
    params, inputs = _mlp_arrays()
    plan = dt.auto_shard(_mlp_step, params, inputs, mesh, calibration=Calibration(),
                         optimizer=lambda ps: dt.optim.SGD(ps, lr=0.1, momentum=0.9),
                         solver="bnb", fit_step=True)
    assert set(plan.placements) == {"w1", "w2"} and set(plan.input_placements) == {"x"}
    assert plan.step_fit is None and plan.calibration == Calibration()  # one rank: no fit
    assert plan.predicted_time == plan.prediction.time_s > 0
    p = plan.prediction
    assert p.time_s == pytest.approx(p.compute_s + p.comm_s)
    assert p.time_s == pytest.approx(sum(p.phases.values()))
    assert p.phases["optimizer"] > 0 and p.phases["backward"] > 0
    # memory: parameters and gradients, momentum buffers, the input, activations
    assert p.persistent_bytes == (2 * (8 * 16 + 16 * 4) + (8 * 16 + 16 * 4) + 6 * 8) * 4
    assert plan.predicted_peak_bytes == p.persistent_bytes + p.activation_bytes
    table = plan.table()
    assert table.splitlines()[0].split()[:2] == ["predicted", "us"]
    assert "solver bnb" in table and "memory budget none" in table
    assert sum(line.startswith("*") for line in table.splitlines()) == 1
    times = [c.prediction.time_s for c in plan.candidates]
    assert times == sorted(times) and plan.candidates[0].sources
    assert "ShardingPlan(" in str(plan)
    placed = plan.apply(params)
    assert all(isinstance(v, dt.DTensor) for v in placed.values())
    np.testing.assert_array_equal(placed["w1"].full_tensor().numpy(), params["w1"])
    # DTensor parameters (leaves that require grad) are searched from their placements
    given = {n: dt.distribute_tensor(a, mesh, [S(1)]).requires_grad_() for n, a in params.items()}
    again = dt.auto_shard(_mlp_step, given, inputs, mesh, calibration=Calibration(), rounds=1)
    (start,) = [c for c in again.candidates if "start" in c.sources]
    assert dict(start.placements) == {"w1": (S(1),), "w2": (S(1),), "x": (R,)}
    np.testing.assert_array_equal(given["w1"].detach().full_tensor().numpy(), params["w1"])


def test_auto_shard_budget_no_plan_meets_names_the_smallest_peak():
    mesh = dt.init_device_mesh((1,))
    params, inputs = _mlp_arrays()
    with pytest.raises(ArgumentError) as err:
        dt.auto_shard(_mlp_step, params, inputs, mesh, memory_budget=100,
                      calibration=Calibration(), rounds=1)
    msg = str(err.value)
    assert "no plan fits memory_budget=100 bytes per rank" in msg
    smallest = int(msg.split("predicted peak of ")[1].split()[0])
    assert smallest > 100
    # a budget of exactly that peak is met
    plan = dt.auto_shard(_mlp_step, params, inputs, mesh, memory_budget=smallest,
                         calibration=Calibration(), rounds=1)
    assert plan.predicted_peak_bytes <= smallest
    with pytest.raises(ArgumentError, match="bytes per rank > 0"):
        dt.auto_shard(_mlp_step, params, inputs, mesh, memory_budget=0)
    with pytest.raises(ArgumentError, match="unknown solver"):
        dt.auto_shard(_mlp_step, params, inputs, mesh, solver="greedy")


def _deep_step(p, b):
    h = (b["x"] @ p["w1"]).relu()
    return ((h @ p["w2"]).relu() @ p["w3"]).square().mean()


@pytest.mark.parametrize("shape", [(2,), (4,)])
def test_auto_shard_budget_met_by_the_unconstrained_plan_returns_it_or_better(shape):
    # a budget between 1.0x and 1.1x of the peak of the plan found without one: the rounds
    # under the budget alone pruned their way to "no plan fits"
    mesh = dt.AbstractMesh(shape)
    params = {"w1": np.zeros((32, 64), np.float32), "w2": np.zeros((64, 64), np.float32),
              "w3": np.zeros((64, 8), np.float32)}
    inputs = {"x": np.zeros((1024, 32), np.float32)}
    kw = {"calibration": Calibration(), "optimizer": lambda ps: dt.optim.Adam(ps, lr=1e-3),
          "solver": "bnb"}
    free = dt.auto_shard(_deep_step, params, inputs, mesh, **kw)
    peak = free.predicted_peak_bytes
    for budget in (peak, int(peak * 1.05), int(peak * 1.1)):
        plan = dt.auto_shard(_deep_step, params, inputs, mesh, memory_budget=budget, **kw)
        assert plan.predicted_peak_bytes <= budget
        assert plan.predicted_time <= free.predicted_time


@pytest.mark.parametrize("budget,error,match", [
    (math.nan, ArgumentError, "finite number of bytes"),
    (math.inf, ArgumentError, "finite number of bytes"),
    (-5, ArgumentError, "finite number of bytes"),
    ("2GB", DTypeError, r"memory_budget='2GB' \(str\) must be a number of bytes"),
    (True, DTypeError, "must be a number of bytes"),
])
def test_auto_shard_refuses_a_bad_budget_up_front(budget, error, match):
    def never(p, b):
        raise AssertionError("the step ran before the budget was checked")

    mesh = dt.AbstractMesh((2,))
    with pytest.raises(error, match=match):
        dt.auto_shard(never, {"w": np.zeros((4, 4), np.float32)}, {}, mesh,
                      memory_budget=budget)
