"""``dt.pipelining.pipeline_split`` on the GPT of ``launch/examples/gpt.py``: stage modules
keep full parameter names, hold exactly the units between the split points, run the
model's forward in a chain to the local model's logits, and the tied head becomes a group
of the first and last stage; the equal-cost split minimises the largest stage (checked
against every possible split)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import dtensor as dt
from dtensor import pipelining as pp
from dtensor.errors import PipelineError
from launch.examples.gpt import GPT, GPTConfig, batch

pytestmark = pytest.mark.mode_independent


def _gpt(n_layer=4):
    dt.manual_seed(3)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=n_layer, n_head=4, d_model=32))


def test_split_by_path_keeps_names_and_chains_to_the_model():
    model = _gpt()
    mods = pp.pipeline_split(model, split_points=["blocks.1", "blocks.3"])
    names = {s: {n for n, _ in m.named_parameters()} for s, m in mods.items()}
    everything = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    assert set().union(*names.values()) == everything
    assert {n.split(".")[1] for n in names[1]} == {"1", "2"}
    assert "head.weight" in names[2] and "tok_emb.weight" in names[0]
    for s, m in mods.items():
        for n, p in m.named_parameters():
            assert p.requires_grad and p is not model.get_parameter(n)
            np.testing.assert_array_equal(p.numpy(), model.get_parameter(n).numpy())
    x, _ = batch(model.cfg, 2, 0)
    h = dt.tensor(x)
    for s in range(3):
        h = mods[s](h)
    np.testing.assert_allclose(h.numpy(), model(dt.tensor(x)).numpy(), rtol=1e-6, atol=1e-6)
    assert pp.ties_of(mods[0]) == {"tok_emb.weight": {0: "tok_emb.weight", 2: "head.weight"}}
    assert pp.ties_of(mods[1]) == {}


def _brute(costs_pre, layers, costs_post, n):
    best = None
    for cut in itertools.combinations(range(1, len(layers)), n - 1):
        bounds = (0, *cut, len(layers))
        st = [sum(layers[a:b]) for a, b in itertools.pairwise(bounds)]
        st[0] += costs_pre
        st[-1] += costs_post
        best = max(st) if best is None else min(best, max(st))
    return best


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6])
def test_equal_cost_split_is_optimal(n):
    model = _gpt(6)
    d, v, s = 32, 64, 16
    layer = 2 * (model.cfg.n_params() - v * d - s * d - 2 * d) / 6  # flops per token
    pre, post = 0.0, 2 * (2 * d) + 2 * v * d  # embeddings: lookups; ln_f and the tied head
    points = pp.equal_cost_split_points(model, n)
    assert len(points) == n - 1
    idx = [0] + [int(p.split(".")[1]) for p in points] + [6]
    st = [layer * (b - a) for a, b in itertools.pairwise(idx)]
    st[0] += pre
    st[-1] += post
    assert max(st) == pytest.approx(_brute(pre, [layer] * 6, post, n))


def test_cost_moves_the_split():
    model = _gpt(4)
    # flops: 4 equal blocks; the tied head (2 V d per token) weighs on the last stage
    assert pp.equal_cost_split_points(model, 2, cost="flops") == ["blocks.2"]
    # a heavy embedding: the first stage takes one block only
    heavy_emb = pp.equal_cost_split_points(
        model, 2, cost=lambda m: 10.0 if isinstance(m, dt.nn.Embedding) else 1.0)
    assert heavy_emb == ["blocks.1"]
    # a heavy head: the last stage takes one block only
    assert pp.equal_cost_split_points(
        model, 2, cost=lambda m: 10.0 if m is model.head else 1.0) == ["blocks.3"]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"split_points": ["blocks.2", "blocks.1"]}, "stage 1 would be empty"),
    ({"split_points": ["tok_emb"]}, "stage 0 would be empty"),
    ({"num_stages": 5}, "5 stages of 4 layers"),
    ({"num_stages": 3, "split_points": ["blocks.1"]}, "make 2 stages, not num_stages=3"),
    ({"num_stages": 0}, "num_stages=0"),
    ({}, "give num_stages or split_points"),
    ({"num_stages": 2, "cost": "bytes"}, "cost must be"),
    ({"num_stages": 2, "stages": [2]}, r"stage 2 is not in \[0, 2\)"),
])
def test_bad_splits(kwargs, match):
    with pytest.raises(PipelineError, match=match):
        pp.pipeline_split(_gpt(), **kwargs)
