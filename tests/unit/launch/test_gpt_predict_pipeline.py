"""The GPT step predictor's pipelined and context-parallel strategies (issue 34): the bubble
of each schedule, memory of 1F1B against GPipe, the point-to-point bytes and the model state
of one tiny config counted by hand, the 3-D layouts, and ``abstract_plan`` on a 512-rank
``PP x DP x TP`` mesh."""

from __future__ import annotations

import dataclasses
import time

import pytest

from launch.examples.gpt_predict import CONFIGS, layout, predict, stage_layers

TINY = CONFIGS["tiny"]  # vocab 256, seq 64, 2 blocks, 4 heads, d 64, no biases
FOUR = dataclasses.replace(TINY, n_layer=4)
B = 8


def test_one_stage_and_one_micro_batch_is_the_local_step():
    local = predict(TINY, "local", (1,), B)
    one = predict(TINY, "pp", (1,), B, microbatches=1)
    assert one.bubble_fraction == 0 and one.bubble_s == 0 and one.p2p_bytes == 0
    assert one.time_s == pytest.approx(local.time_s, rel=1e-9)
    assert one.params_bytes == local.params_bytes
    assert one.optimizer_bytes == local.optimizer_bytes


def test_gpipe_and_1f1b_take_one_time_and_1f1b_holds_fewer_activations():
    g = predict(FOUR, "pp", (2,), B, microbatches=4, schedule="gpipe")
    f = predict(FOUR, "pp", (2,), B, microbatches=4, schedule="1f1b")
    assert g.time_s == pytest.approx(f.time_s, rel=1e-12)
    assert g.bubble_fraction == f.bubble_fraction == pytest.approx(1 / 5)
    assert f.peak_bytes < g.peak_bytes
    # GPipe's worst rank holds 4 micro-batches' activations; under 1F1B rank 0 holds 2,
    # rank 1 one: at most half of GPipe's
    assert f.activation_bytes <= g.activation_bytes / 2 + 1


def test_more_micro_batches_and_interleaving_shrink_the_bubble():
    fracs = [predict(FOUR, "pp", (2,), B, microbatches=m).bubble_fraction for m in (1, 2, 4, 8)]
    assert fracs == pytest.approx([1 / 2, 1 / 3, 1 / 5, 1 / 9])
    plain = predict(FOUR, "pp", (2,), B, microbatches=4)
    inter = predict(FOUR, "pp", (2,), B, microbatches=4, schedule="interleaved",
                    stages_per_rank=2)
    assert inter.bubble_fraction == pytest.approx(1 / 9)
    assert inter.bubble_fraction < plain.bubble_fraction
    assert inter.stage_layers == (1, 1, 1, 1) and plain.stage_layers == (2, 2)
    assert inter.bubble_s < plain.bubble_s
    d = inter.to_dict()
    assert d["schedule"] == "interleaved" and d["stages_per_rank"] == 2 and d["pp"] == 2


def test_p2p_bytes_and_model_state_by_hand():
    p = predict(TINY, "pp", (2,), B, microbatches=4)
    assert p.stage_layers == stage_layers(TINY, 2) == (1, 1)
    # each stage sends its 4 micro-batches (2 sequences x 64 tokens x d 64, float32) once:
    # activations forward from stage 0, gradients backward from stage 1; and the tied
    # embedding's gradient (256 x 64 float32) between the two
    boundary = 2 * 64 * 64 * 4
    assert p.p2p_bytes == 4 * boundary + 256 * 64 * 4 == p.comm_bytes["p2p"]
    # each stage holds one block and the embeddings, the final norm and the tied head
    one_block = dataclasses.replace(TINY, n_layer=1).n_params() * 4
    assert p.params_bytes == p.grads_bytes == one_block
    assert p.optimizer_bytes == 2 * one_block  # AdamW's two moments
    # time: 5 slots of the slowest stage's micro-batch, the fill and drain messages, the
    # tied gradient's message and the optimizer
    assert p.time_s > p.bubble_s > 0


def test_context_parallel_divides_the_activations_and_rings_keys_and_values():
    local = predict(TINY, "local", (1,), B)
    cp = predict(TINY, "cp", (2,), B)
    assert cp.cp == 2 and cp.ranks == 2 and cp.local_batch == B
    # the ring's blocks: 2 layers x 3 x (c - 1) blocks of keys and values (8 x 32 x 64 each)
    assert cp.p2p_bytes == 2 * 3 * 1 * 2 * B * 32 * 64 * 4 == cp.comm_bytes["p2p"]
    assert cp.activation_bytes < 0.6 * local.activation_bytes
    assert cp.params_bytes == local.params_bytes  # the whole position table is counted
    both = predict(TINY, "dp_cp", (2, 2), B)
    assert (both.ranks, both.local_batch, both.cp) == (4, 4, 2)
    assert both.p2p_bytes == cp.p2p_bytes // 2


def test_layouts_of_the_pipelined_and_context_strategies():
    f = layout("pp_fsdp_tp", (8, 8, 8))
    assert (f.pp, f.ranks, f.n_data, f.shard, f.tp, f.inner, f.inner_mesh) == (
        8, 512, 8, 8, 8, "fsdp_tp", (8, 8))
    d = layout("pp_dp", (8, 8, 8))
    assert (d.pp, d.ranks, d.n_data, d.inner_mesh) == (8, 512, 64, (64,))
    assert layout("pp_tp", (8, 8, 8)).ranks == 64
    assert layout("pp", (4,)).ranks == 4 and layout("pp", (4,)).inner == "local"
    c = layout("dp_cp", (8, 8, 8))
    assert (c.cp, c.ranks, c.n_data) == (8, 512, 64)
    assert layout("fsdp", (8, 8, 8)) == layout("fsdp", (64, 8))
    with pytest.raises(ValueError, match="needs a 3-D mesh"):
        layout("pp_fsdp_tp", (2, 2))
    with pytest.raises(ValueError, match="needs a mesh of 2 or 3 dims"):
        layout("pp_dp", (2,))
    with pytest.raises(ValueError, match="do not split"):
        predict(TINY, "pp", (2,), B, microbatches=3)
    with pytest.raises(ValueError, match="stages_per_rank"):
        predict(TINY, "pp", (2,), B, microbatches=2, stages_per_rank=2)
    with pytest.raises(ValueError, match="stage would be empty"):
        predict(TINY, "pp", (4,), B)
    with pytest.raises(ValueError, match="not pipelined"):
        predict(TINY, "dp", (2,), B, microbatches=2)


@pytest.mark.mode_independent
def test_abstract_plan_on_a_512_rank_pp_dp_tp_mesh(capsys):
    from launch.bench import abstract_plan

    start = time.perf_counter()
    names = ("fsdp", "pp", "pp_dp", "pp_fsdp", "dp_cp")
    doc = abstract_plan.plan_gpt("gpt2-124m", (8, 8, 8), 512, 80 * 10**9,
                                 strategies=names)
    assert time.perf_counter() - start < 120  # about 10 s on a loaded 2-core machine
    rows = doc["strategies"]
    assert doc["choice"] in names and rows[doc["choice"]]["fits"]
    for name in ("pp_dp", "pp_fsdp"):
        r = rows[name]
        assert r["pp"] == 8 and r["ranks"] == 512 and r["microbatches"] == 8
        assert r["bubble_fraction"] == pytest.approx(7 / 15)
        assert r["comm_bytes"]["p2p"] == r["p2p_bytes"] > 0
    # the pure pipeline (8 ranks, the whole batch) tries p, 2p, 4p, 8p micro-batches
    assert [v["microbatches"] for v in rows["pp"]["variants"]] == [8, 16, 32, 64]
    assert rows["dp_cp"]["cp"] == 8
    text = abstract_plan.gpt_report({**doc, "model": "gpt2-124m", "mesh": [8, 8, 8],
                                     "batch": 512, "dtype": "float32",
                                     "memory_budget": 80 * 10**9})
    assert "pp_dp" in text and "8x8 1f1b" in text and "bubble" in text and "P2P" in text
    assert abstract_plan.parse_mesh("8x8x8") == (8, 8, 8)
    assert abstract_plan.microbatch_options(8, 8) == [8]
    assert abstract_plan.microbatch_options(4, 6) == [3]
