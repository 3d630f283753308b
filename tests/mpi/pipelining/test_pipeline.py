"""The pipeline schedules of ``dt.pipelining`` on the GPT tiny config (vocab 64, d 32; 2
layers for 2 stages, 4 for 4): GPipe, 1F1B, interleaved 1F1B and interleaved zero-bubble
at 2 and 4 stages with 1, 2, 4 and 8 micro-batches give the local model's losses and
gradients (float32, rtol 1e-5) step after step (SGD between steps); with FSDP or TP beside
the pipeline on 2x2 meshes; and the bad inputs raise ``PipelineError`` on every rank.

The oracle is the whole model run locally on every rank on the whole batch (the pipeline's
stages are pruned copies of it, so the same weights): the mean cross-entropy of the batch,
which the mean of the per-micro-batch losses must equal, and its gradients by name.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.mpi import sgd_step
from mpi4py import MPI

import dtensor as dt
from dtensor import pipelining as pp
from dtensor.errors import PipelineError
from launch.examples.gpt import GPT, GPTConfig, batch

WORLD = MPI.COMM_WORLD.Get_size()
F = dt.nn.functional
BATCH = 8
LR = 0.1
pytestmark = pytest.mark.mpi(min_size=1)

SCHEDULES = {
    "gpipe": pp.ScheduleGPipe,
    "1f1b": pp.Schedule1F1B,
    "interleaved": pp.ScheduleInterleaved1F1B,
    "zero_bubble": pp.ScheduleInterleavedZeroBubble,
}
SINGLE = ("gpipe", "1f1b")


def _cases():
    """(schedule, stages) runnable on this world as the pp mesh: single-stage schedules
    need stages == ranks, the interleaved ones a multiple of the ranks (2 and 4 stages,
    and at 3 ranks 3 and 6)."""
    out = []
    for name in SCHEDULES:
        for n in sorted({2, 4, WORLD, 2 * WORLD} - {1, 8}):
            if (n == WORLD) if name in SINGLE else (n % WORLD == 0):
                out.append((name, n))
    return out


def loss_fn(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _model(n_stages):
    dt.manual_seed(7)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=max(2, n_stages), n_head=4,
                         d_model=32))


def _build(name, n_stages, m, mesh):
    """The reference model and this rank's stages and schedule on the 1-D pp ``mesh``."""
    model = _model(n_stages)
    p, r = mesh.size(0), mesh.get_coordinate()[0]
    mods = pp.pipeline_split(model, n_stages, stages=range(r, n_stages, p))
    stages = [pp.PipelineStage(mods[s], s, n_stages, mesh) for s in sorted(mods)]
    sched = (SCHEDULES[name](stages[0], m, loss_fn) if name in SINGLE
             else SCHEDULES[name](stages, m, loss_fn))
    return model, mods, sched


def _step(sched, mods, x, y):
    """One pipeline step with the inputs where this rank's stages need them."""
    n = sched.num_stages
    args = (x,) if 0 in mods else ()
    target = y if n - 1 in mods else None
    losses = []
    out = sched.step(*args, target=target, losses=losses)
    return losses, out


def _check_grads(mods, model):
    for s, mod in mods.items():
        for name, p in mod.named_parameters():
            ref = model.get_parameter(name).grad
            np.testing.assert_allclose(
                p.grad.numpy(), ref.numpy(), rtol=1e-5, atol=1e-6,
                err_msg=f"stage {s} {name}")


def _run(name, n_stages, m, steps):
    mesh = dt.init_device_mesh((WORLD,), mesh_dim_names=("pp",))
    model, mods, sched = _build(name, n_stages, m, mesh)
    cfg = model.cfg
    for step in range(steps):
        x, y = batch(cfg, BATCH, step)
        losses, out = _step(sched, mods, x, y)
        ref = model(dt.tensor(x), dt.tensor(y))
        ref.backward()
        b = BATCH // m
        with dt.no_grad():
            ref_mb = [float(model(dt.tensor(x[i * b:(i + 1) * b]),
                                  dt.tensor(y[i * b:(i + 1) * b])).numpy()) for i in range(m)]
        got = [float(v.numpy()) for v in losses]
        np.testing.assert_allclose(got, ref_mb, rtol=1e-5)
        np.testing.assert_allclose(np.mean(got), float(ref.numpy()), rtol=1e-5)
        if n_stages - 1 in mods:
            with dt.no_grad():
                logits = model(dt.tensor(x))
            np.testing.assert_allclose(out.numpy(), logits.numpy(), rtol=1e-5, atol=1e-6)
        else:
            assert out is None
        _check_grads(mods, model)
        sgd_step(model.parameters(), LR)
        for mod in mods.values():
            sgd_step(mod.parameters(), LR)


@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize(("name", "n_stages"), _cases())
def test_schedule_matches_local_model(name, n_stages, m):
    _run(name, n_stages, m, steps=2)


@pytest.mark.parametrize(("name", "n_stages"), _cases()[-1:])
def test_ten_steps(name, n_stages):
    _run(name, n_stages, 4, steps=10)


@pytest.mark.mpi(min_size=2)
def test_tied_weights_stay_equal():
    """The head's copy on the last stage and the token embedding on the first get the same
    (summed) gradient, so they stay equal across updates."""
    mesh = dt.init_device_mesh((WORLD,), mesh_dim_names=("pp",))
    model, mods, sched = _build("interleaved", 2 * WORLD if WORLD <= 2 else WORLD, 2, mesh)
    for step in range(3):
        x, y = batch(model.cfg, BATCH, step)
        _step(sched, mods, x, y)
        for mod in mods.values():
            sgd_step(mod.parameters(), LR)
    n = sched.num_stages
    w = {s: mods[s].get_parameter("tok_emb.weight" if s == 0 else "head.weight").numpy()
         for s in (0, n - 1) if s in mods}
    comm = MPI.COMM_WORLD
    first = comm.bcast(w.get(0), root=0)
    last = comm.bcast(w.get(n - 1), root=(n - 1) % WORLD)
    np.testing.assert_array_equal(first, last)
    assert not np.array_equal(first, model.tok_emb.weight.numpy())  # it did train


# -- bad input: a PipelineError on every rank, no hang -------------------------------------
@pytest.mark.mpi(min_size=2)
def test_microbatches_not_dividing_batch():
    mesh = dt.init_device_mesh((WORLD,), mesh_dim_names=("pp",))
    model, mods, sched = _build("interleaved", 2 * WORLD, 4, mesh)
    x, y = batch(model.cfg, 6, 0)
    with pytest.raises(PipelineError, match=r"batch of 6 on stage 0 .* n_microbatches=4"):
        _step(sched, mods, x, y)
    losses, _ = _step(sched, mods, *batch(model.cfg, BATCH, 0))  # still usable
    assert len(losses) == 4


@pytest.mark.mpi(min_size=2)
def test_missing_input_on_first_stage():
    mesh = dt.init_device_mesh((WORLD,), mesh_dim_names=("pp",))
    model, mods, sched = _build("interleaved", WORLD, 2, mesh)
    _, y = batch(model.cfg, BATCH, 0)
    with pytest.raises(PipelineError, match=r"stage 0 \(pp rank 0\) needs its input"):
        sched.step(target=y if sched.num_stages - 1 in mods else None)


@pytest.mark.mpi(min_size=2)
def test_single_stage_schedule_with_more_stages_than_ranks():
    mesh = dt.init_device_mesh((WORLD,), mesh_dim_names=("pp",))
    model = _model(2 * WORLD)
    r = mesh.get_coordinate()[0]
    mod = pp.pipeline_split(model, 2 * WORLD, stages=[r])[r]
    stage = pp.PipelineStage(mod, r, 2 * WORLD, mesh)
    with pytest.raises(PipelineError, match=rf"Schedule1F1B: .*runs one stage per pp rank, "
                                            rf"but there are {2 * WORLD} stages"):
        pp.Schedule1F1B(stage, 2, loss_fn)


@pytest.mark.mpi(min_size=2)
def test_fewer_stages_than_ranks():
    mesh = dt.init_device_mesh((WORLD,), mesh_dim_names=("pp",))
    mod = pp.pipeline_split(_model(2), 1)[0]
    stage = pp.PipelineStage(mod, 0, 1, mesh)
    with pytest.raises(PipelineError, match=r"1 stages on a pp mesh of \d ranks"):
        pp.ScheduleGPipe(stage, 2, loss_fn)


@pytest.mark.mpi(min_size=2)
def test_stage_on_the_wrong_rank():
    mesh = dt.init_device_mesh((WORLD,), mesh_dim_names=("pp",))
    model = _model(WORLD)
    r = mesh.get_coordinate()[0]
    s = (r + 1) % WORLD
    stage = pp.PipelineStage(pp.pipeline_split(model, WORLD, stages=[s])[s], s, WORLD, mesh)
    with pytest.raises(PipelineError, match=r"stage s must be on pp rank s % pp_size"):
        pp.ScheduleGPipe(stage, 2, loss_fn)


def test_split_leaving_a_stage_empty():
    model = _model(2)
    with pytest.raises(PipelineError, match=r"stage 1 would be empty"):
        pp.pipeline_split(model, split_points=["blocks.1", "blocks.1"])
    with pytest.raises(PipelineError, match=r"3 stages of 2 layers .* a stage would be empty"):
        pp.pipeline_split(model, 3)
    with pytest.raises(PipelineError, match=r"'blocks.9' is not a unit of GPT"):
        pp.pipeline_split(model, split_points=["blocks.9"])


@pytest.mark.mpi(min_size=2)
def test_comm_debug_mode_sees_the_point_to_point_traffic():
    """Per 1F1B step a rank sends an activation per micro-batch downstream and a gradient
    upstream, the first and last stage swap the tied gradient, one all-gather of shapes
    and one broadcast of the losses; the first step adds one shape header per boundary."""
    mesh = dt.init_device_mesh((WORLD,), mesh_dim_names=("pp",))
    m = 4
    model, mods, sched = _build("1f1b", WORLD, m, mesh)
    r = mesh.get_coordinate()[0]
    x, y = batch(model.cfg, BATCH, 0)
    down, up = r < WORLD - 1, r > 0
    tie = r in (0, WORLD - 1)
    for step in range(2):
        with dt.debug.CommDebugMode() as mode:
            _step(sched, mods, x, y)
        counts = mode.get_comm_counts()
        head = 1 if step == 0 else 0
        assert counts.get("send", 0) == m * (down + up) + tie + head * down
        assert counts.get("recv", 0) == m * (down + up) + tie + head * up
        assert counts["all_gather_ints"] == 1 and counts["broadcast"] == 1


@pytest.mark.mpi(min_size=2)
def test_keyword_input_on_one_rank():
    mesh = dt.init_device_mesh((WORLD,), mesh_dim_names=("pp",))
    model, _, sched = _build("1f1b", WORLD, 2, mesh)
    x, y = batch(model.cfg, BATCH, 0)
    r = mesh.get_coordinate()[0]
    kw = {"mask": x} if r == 0 else {}
    with pytest.raises(PipelineError, match=r"keyword inputs are not supported \(given on "
                                            r"pp ranks \[0\]\)"):
        sched.step(*((x,) if r == 0 else ()), target=y if r == WORLD - 1 else None, **kw)
