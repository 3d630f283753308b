"""``dt.auto_shard(..., pipeline=dt.pipelining.PipelineOptions(model))`` on an abstract mesh:
the pipeline and context degrees priced beside the placements (a budget that only a
pipeline meets chooses one; without it, one does not pay), the pricing formulas, and the
calibration's point-to-point constants (older files still load)."""

from __future__ import annotations

import pytest

import dtensor as dt
from dtensor.autoshard import Calibration
from dtensor.pipelining import PipelineOptions, bubble, in_flight, pipeline_seconds, ring_factor
from placements.errors import ArgumentError, PipelineError

R = dt.Replicate()
D, LAYERS, BATCH = 1024, 8, 64


class Stack(dt.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = dt.nn.ModuleList([dt.nn.Linear(D, D, bias=False) for _ in range(LAYERS)])


def _step(params, inputs):
    h = inputs["x"]
    for i in range(LAYERS):
        h = (h @ params[f"w{i}"]).relu()
    return (h * h).mean()


def _search(budget=None, **options):
    mesh = dt.AbstractMesh((8,), ("dp",))
    with dt.nn.abstract_parameters():
        model = Stack()
    params = {f"w{i}": dt.abstract_tensor((D, D), mesh, [R]) for i in range(LAYERS)}
    inputs = {"x": dt.abstract_tensor((BATCH, D), mesh, [R])}
    return dt.auto_shard(_step, params, inputs, mesh, budget, rounds=1, pairs=1, top_k=1,
                         candidates={n: [(R,)] for n in params},  # weights replicated only
                         pipeline=PipelineOptions(model, **options))


@pytest.mark.mode_independent  # metadata-only tensors never take the compiled front
def test_a_budget_only_a_pipeline_meets_chooses_one_and_none_without_it():
    # without an optimizer step (which pipelining divides among the stages), the bubble
    # and the point-to-point messages cost more than the stages save
    free = _search()
    assert free.pp_degree == 1 and free.cp_degree == 1 and free.microbatches == 1
    assert free.predicted_time == free.pipeline["time_s"]
    assert free.predicted_time == pytest.approx(free.prediction.time_s, rel=1e-9)
    assert free.predicted_peak_bytes <= free.prediction.peak_bytes
    replicated = free.prediction.persistent_bytes  # 8 weights and their gradients per rank
    budget = int(0.6 * free.predicted_peak_bytes)
    assert replicated > budget
    plan = _search(budget)
    assert plan.pp_degree > 1 and plan.predicted_peak_bytes <= budget
    v = plan.pipeline
    assert v["bubble_fraction"] == pytest.approx(bubble(v["schedule"], v["pp"],
                                                        v["microbatches"]))
    assert v["p2p_bytes"] > 0 and plan.predicted_time > free.predicted_time
    assert f"pp {plan.pp_degree} x {plan.microbatches} micro-batches" in str(plan)
    assert "pipeline: pp" in plan.table()
    assert all(c["fits"] == (c["peak_bytes"] <= budget) for c in plan.pipeline_candidates)
    with pytest.raises(ArgumentError, match="no plan or pipeline variant fits"):
        _search(1024)


def test_the_pricing_formulas():
    assert bubble("1f1b", 1, 8) == 0
    assert bubble("gpipe", 4, 4) == bubble("1f1b", 4, 4) == pytest.approx(3 / 7)
    assert bubble("interleaved", 4, 4, 2) == pytest.approx(3 / 11)
    assert pipeline_seconds(1.0, "1f1b", 4, 4) == pytest.approx((7.0, 3.0))
    assert pipeline_seconds(1.0, "interleaved", 4, 4, 2) == pytest.approx((5.5, 1.5))
    assert [in_flight("1f1b", 4, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight("gpipe", 4, 8, 3) == 8
    assert in_flight("interleaved", 2, 4, 0, 2) == pytest.approx(5 / 2)
    assert ring_factor(4) == 2.5 and ring_factor(4, causal=False) == 4
    with pytest.raises(PipelineError, match="stages_per_rank=2 needs the interleaved"):
        bubble("1f1b", 2, 2, 2)
    with pytest.raises(PipelineError, match="unknown schedule"):
        bubble("zigzag", 2, 2)
    with dt.nn.abstract_parameters():
        model = Stack()
    with pytest.raises(PipelineError, match="degrees"):
        PipelineOptions(model, degrees=(0,))
    with pytest.raises(PipelineError, match="dt.nn.Module"):
        PipelineOptions("model")
    opts = PipelineOptions(model, degrees=(1, 2), microbatches=(2, 3), cp_degrees=(1, 2))
    got = {(v["pp"], v["cp"], v["microbatches"]) for v in opts.variants(4, 2)}
    assert got == {(1, 1, 1), (1, 2, 1), (2, 1, 2), (2, 2, 2)}
    assert opts.width() == D
    with pytest.raises(ArgumentError, match="PipelineOptions"):
        dt.auto_shard(_step, {}, {}, dt.AbstractMesh((2,)), pipeline=object())


def test_calibrations_without_p2p_still_load_and_p2p_round_trips():
    cal = Calibration()
    old = cal.to_dict()
    del old["p2p"]
    assert Calibration.from_dict(old).p2p == {}
    with_p2p = Calibration(p2p={"alpha_s": 2e-6, "beta_bytes_per_s": 3e9})
    assert Calibration.from_dict(with_p2p.to_dict()).p2p == with_p2p.p2p
