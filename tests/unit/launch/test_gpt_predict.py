"""The GPT step predictor (``launch/examples/gpt_predict.py``) in one process: how each
strategy uses a mesh; the collectives of FSDP, DDP and tensor parallelism against counts
and bytes computed by hand from a real model's parameter shapes; the model state of FSDP
against DTensor data parallelism at 2 ranks; and ``abstract_plan --model gpt2-124m --mesh
64x8`` (every field, the choice, a time bound). The comparison with real jobs at 1-4 ranks
is ``tests/mpi/features/test_gpt_predict.py``."""

from __future__ import annotations

import json
import math
import time

import pytest

import dtensor as dt
from launch.examples.gpt import GPT
from launch.examples.gpt_predict import ALL_STRATEGIES, CONFIGS, StepPrediction, layout, predict
from launch.examples.gpt_strategies import STRATEGIES

TINY = CONFIGS["tiny"]
B = 8


def _shapes(cfg):
    """The real model's parameters (the tied head once), in registration order."""
    dt.manual_seed(0)
    model = GPT(cfg)
    seen, out = set(), []
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append((name, tuple(p.shape)))
    return out


def _flat(shapes, n):
    """Elements per rank of a ``fully_shard`` group: rows padded to ``ceil(rows / n)``."""
    return sum(-(-s[0] // n) * math.prod(s[1:]) for _, s in shapes)


def _groups(cfg):
    shapes = _shapes(cfg)
    blocks = [[(n, s) for n, s in shapes if n.startswith(f"blocks.{i}.")]
              for i in range(cfg.n_layer)]
    root = [(n, s) for n, s in shapes if not n.startswith("blocks.")]
    return blocks, root


def test_layouts_say_how_each_strategy_uses_the_mesh():
    assert layout("fsdp", (4,)).shard == 4
    assert layout("dp", (64, 8)) == layout("dp", (512,))
    assert (layout("tp", (64, 8)).ranks, layout("tp", (64, 8)).tp) == (8, 8)
    f = layout("fsdp_tp", (64, 8))
    assert (f.ranks, f.n_data, f.shard, f.shard_dim, f.tp, f.tp_dim) == (512, 64, 64, 0, 8, 1)
    h = layout("hsdp", (64, 8))
    assert (h.n_data, h.shard, h.shard_dim, h.rep, h.rep_dim) == (512, 8, 1, 64, 0)
    assert layout("local", (64, 8)).ranks == 1
    with pytest.raises(ValueError, match="needs a 2-D mesh"):
        layout("hsdp", (4,))
    with pytest.raises(ValueError, match="even number"):
        layout("fsdp_int", (2,))
    with pytest.raises(ValueError, match="unknown strategy"):
        layout("ddp", (2,))
    with pytest.raises(ValueError, match="does not split"):
        predict(TINY, "fsdp", (3,), B)
    with pytest.raises(ValueError, match="n_head"):
        predict(CONFIGS["gpt2-124m"], "tp", (8,), 8)


@pytest.mark.parametrize("name,world", [("fsdp", 2), ("zero2", 2), ("fsdp", 3), ("hsdp", 4),
                                        ("fsdp_int", 4)])
def test_fsdp_collectives_are_the_groups_gathers_and_reduce_scatters(name, world):
    blocks, root = _groups(TINY)
    mesh = (2, 2) if name == "hsdp" else (world,)
    n = 2 if name == "hsdp" else world
    p = predict(TINY, name, mesh, 12 if world == 3 else B)
    flats = [_flat(g, n) for g in blocks]
    root_flat = _flat(root, n)
    gathers = sum(n * f * 4 for f in flats) + n * root_flat * 4  # forward: every group
    if name in ("fsdp", "hsdp"):
        gathers += sum(n * f * 4 for f in flats)  # again before each block's backward
    if name == "fsdp_int":  # within 2 ranks, from the 1/2 pieces of the unsharded buffer
        gathers += sum(2 * -(-sum(math.prod(s) for _, s in g) // 2) * 4 for g in blocks)
    regather = 0 if name == "zero2" else TINY.n_layer
    assert p.comm_counts["all_gather"] == TINY.n_layer + 1 + regather
    assert p.comm_bytes["all_gather"] == gathers
    assert p.comm_counts["reduce_scatter"] == TINY.n_layer + 1
    assert p.comm_bytes["reduce_scatter"] == sum(n * f * 4 for f in [*flats, root_flat])
    if name == "hsdp":
        assert p.comm_bytes["all_reduce"] == sum(f * 4 for f in [*flats, root_flat])
    else:
        assert "all_reduce" not in p.comm_bytes
    state = sum(-(-s[0] // n) * math.prod(s[1:]) for _, s in _shapes(TINY)) * 4
    assert p.params_bytes == state and p.state_bytes == 4 * state
    assert p.fsdp_buffer_bytes > 0 and p.peak_bytes > p.state_bytes + p.activation_bytes / 2


def test_replicate_all_reduces_its_buckets_and_tensor_parallelism_its_activations():
    params = sum(math.prod(s) for _, s in _shapes(TINY))
    p = predict(TINY, "replicate", (2,), B)
    # tiny fits the first 1 MiB bucket: the gradients and one count per parameter
    assert p.comm_counts == {"all_reduce": 1}
    assert p.comm_bytes == {"all_reduce": (params + len(_shapes(TINY))) * 4}
    assert p.untracked_bytes == p.comm_bytes["all_reduce"]
    bsd = B * TINY.block_size * TINY.d_model * 4
    L = TINY.n_layer
    tp = predict(TINY, "tp", (2,), B)
    # forward: wo's and proj's outputs; backward: the inputs of wq, wk, wv and fc
    assert tp.comm_counts == {"all_reduce": 6 * L}
    assert tp.comm_bytes == {"all_reduce": 6 * L * bsd}
    sp = predict(TINY, "tp_sp", (2,), B)
    assert sp.comm_counts == {"all_gather": 4 * L + 2, "reduce_scatter": 4 * L,
                              "all_reduce": 4 * L}
    assert sp.comm_bytes["all_gather"] == (4 * L + 2) * bsd
    assert sp.comm_bytes["reduce_scatter"] == 4 * L * bsd
    assert sp.comm_bytes["all_reduce"] == 4 * L * TINY.d_model * 4  # the norms' parameters
    # the TP rank holds its shards of the block linears (12 d^2 a block), the rest whole
    assert tp.params_bytes == (params - L * 12 * TINY.d_model ** 2 // 2) * 4
    assert tp.peak_bytes < predict(TINY, "local", (1,), B).peak_bytes


def test_fsdp_holds_at_most_0_6_of_data_parallel_model_state_at_2_ranks():
    dp = predict(TINY, "dp", (2,), B)
    assert dp.comm_counts["all_reduce"] >= len(_shapes(TINY))  # one per gradient, at least
    for name in ("fsdp", "zero2"):
        p = predict(TINY, name, (2,), B)
        assert p.state_bytes <= 0.6 * dp.state_bytes
        assert p.peak_bytes < dp.peak_bytes


def test_every_strategy_predicts_a_positive_step_and_a_json_ready_dict():
    for name in STRATEGIES:
        mesh = (2, 2) if name in ("fsdp_tp", "hsdp") else (4,)
        p = predict(TINY, name, mesh, B)
        assert isinstance(p, StepPrediction)
        assert p.time_s >= p.compute_s > 0 and p.flops > 0 and p.peak_bytes > p.state_bytes
        assert p.exposed_comm_s == pytest.approx(p.time_s - p.compute_s)
        d = json.loads(json.dumps(p.to_dict()))
        assert d["strategy"] == name and d["comm_total_bytes"] == p.comm_total_bytes


def test_the_predictions_leave_no_abstract_memory_behind():
    predict(TINY, "fsdp", (2,), B)
    import gc

    gc.collect()
    live = dt.abstract_memory_stats()["live_bytes"]
    a = predict(TINY, "fsdp", (2,), B)
    b = predict(TINY, "fsdp", (2,), B)
    gc.collect()
    assert a.peak_bytes == b.peak_bytes
    assert dt.abstract_memory_stats()["live_bytes"] <= live + 2**16


@pytest.mark.mode_independent
def test_abstract_plan_gpt2_on_64x8_reports_every_strategy_and_a_choice(tmp_path, capsys):
    from launch.bench import abstract_plan

    out = tmp_path / "gpt.json"
    start = time.perf_counter()
    abstract_plan.main(["--model", "gpt2-124m", "--mesh", "64x8", "--out", str(out)])
    seconds = time.perf_counter() - start
    assert seconds < 300  # 10-20 s on a loaded 2-core machine; the tool's target is 60 s
    text = capsys.readouterr().out
    assert "choice:" in text and "fsdp" in text
    doc = json.loads(out.read_text())
    assert doc["model"] == "gpt2-124m" and doc["mesh"] == [64, 8] and doc["batch"] == 512
    assert doc["memory_budget"] == 80 * 10**9
    rows = doc["strategies"]
    assert set(rows) == set(ALL_STRATEGIES)
    for name in ("pp", "pp_dp", "pp_fsdp", "pp_tp"):  # 64 stages of 12 blocks
        assert "stage would be empty" in rows[name]["error"]
    for name in ("tp", "tp_sp", "fsdp_tp"):  # 12 heads do not split over 8 ranks
        assert "n_head" in rows[name]["error"]
    for name in ("dp", "fsdp", "zero2", "hsdp", "replicate", "fsdp_int"):
        r = rows[name]
        assert r["ranks"] == 512 and r["local_batch"] == 1 and r["fits"]
        assert r["peak_bytes"] > r["state_bytes"] > 0 and r["time_s"] > 0
        assert sum(r["comm_bytes"].values()) == r["comm_total_bytes"] > 0
    assert not rows["local"]["fits"]  # 512 sequences of 1024 on one rank
    # FSDP shards the model state 512 ways; DTensor data parallelism keeps it whole
    assert rows["fsdp"]["state_bytes"] < rows["dp"]["state_bytes"] / 100
    fitting = [n for n, r in rows.items() if r.get("fits")]
    assert doc["choice"] == min(fitting, key=lambda n: rows[n]["time_s"])
    with pytest.raises(SystemExit, match="unknown --model"):
        abstract_plan.main(["--model", "gpt-9"])
    assert abstract_plan.parse_bytes("80GiB") == 80 * 2**30
    assert abstract_plan.parse_mesh("64x8") == (64, 8)


def test_the_1_3b_gpt_builds_without_memory():
    cfg = CONFIGS["gpt-1.3b"]
    before = dt.abstract_memory_stats()["live_bytes"]
    start = time.perf_counter()
    with dt.nn.abstract_parameters() as mesh:
        model = GPT(cfg)
    assert time.perf_counter() - start < 30
    params = list(model.parameters())
    assert all(isinstance(p, dt.AbstractDTensor) and p.device_mesh == mesh for p in params)
    assert sum(p.numel() for p in params) == cfg.n_params()
    held = dt.abstract_memory_stats()["live_bytes"] - before
    assert held == 4 * cfg.n_params()  # the blocks the parameters would hold, nothing more


def test_without_overlap_the_prefetched_gathers_take_the_clock():
    """``overlap=False`` (one core per rank): FSDP's prefetched all-gathers are priced in line,
    so the step is its compute plus all of its collectives; strategies without a second lane
    are priced alike either way."""
    cal = dt.autoshard.Calibration(ranks=2, mesh_shape=(2,))
    beside = predict(TINY, "fsdp", (2,), B, calibration=cal)
    inline = predict(TINY, "fsdp", (2,), B, calibration=cal, overlap=False)
    assert inline.comm_s == pytest.approx(beside.comm_s)
    assert inline.time_s == pytest.approx(inline.compute_s + inline.comm_s)
    assert beside.time_s < inline.time_s
    for name in ("local", "dp", "tp"):
        assert predict(TINY, name, (2,), B, calibration=cal, overlap=False).time_s == \
            pytest.approx(predict(TINY, name, (2,), B, calibration=cal).time_s)


def test_fsdp_copies_are_priced_at_the_calibrations_copy_rate():
    """In line (one core per rank) an FSDP step costs its copies at ``copy_rate``: per
    all-gather its packed shards and the gathered buffer copied out, per reduce-scatter its
    packed gradients and their shard copied out (bytes read + written); dp is unchanged."""
    blocks, root = _groups(TINY)
    n = 2
    total = [sum(math.prod(s) for _, s in g) for g in blocks]
    flats = [_flat(g, n) for g in blocks]
    root_flat, root_total = _flat(root, n), sum(math.prod(s) for _, s in root)
    copied = 4 * (root_flat + root_total  # the root: gathered once (it keeps its buffer)
                  + sum(2 * (f + t) for f, t in zip(flats, total))  # blocks: twice
                  + sum((n + 1) * f for f in [*flats, root_flat]))  # the reduce-scatters
    times = {}
    for rate in (1e9, 2e9):
        cal = dt.autoshard.Calibration(ranks=2, mesh_shape=(2,), copy_rate=rate)
        times[rate] = {s: predict(TINY, s, (2,), B, calibration=cal, overlap=False).time_s
                       for s in ("fsdp", "dp")}
    assert times[1e9]["fsdp"] - times[2e9]["fsdp"] == pytest.approx(2 * copied / 2e9)
    assert times[1e9]["dp"] == pytest.approx(times[2e9]["dp"])


def test_compute_beside_fsdp_gathers_is_slowed_by_the_calibrated_factor():
    """With overlap, the step grows by ``overlap_slowdown - 1`` times the second lane's busy
    seconds (the all-gathers with their copy-out); in line, and for dp, it does not change."""
    base = dt.autoshard.Calibration(ranks=2, mesh_shape=(2,))
    slow = dt.autoshard.Calibration(ranks=2, mesh_shape=(2,), overlap_slowdown=1.5)
    slower = dt.autoshard.Calibration(ranks=2, mesh_shape=(2,), overlap_slowdown=2.0)
    plain = predict(TINY, "fsdp", (2,), B, calibration=base)
    inline = predict(TINY, "fsdp", (2,), B, calibration=base, overlap=False)
    lane = predict(TINY, "fsdp", (2,), B, calibration=slower).time_s - plain.time_s
    # the second lane's seconds: some of the step's collective seconds, not all (the
    # reduce-scatters and the in-line copies block)
    assert 0 < lane < inline.comm_s
    slowed = predict(TINY, "fsdp", (2,), B, calibration=slow)
    assert slowed.time_s - plain.time_s == pytest.approx(0.5 * lane)
    assert predict(TINY, "fsdp", (2,), B, calibration=slow, overlap=False).time_s == \
        pytest.approx(inline.time_s)
    assert predict(TINY, "dp", (2,), B, calibration=slow).time_s == \
        pytest.approx(predict(TINY, "dp", (2,), B, calibration=base).time_s)
