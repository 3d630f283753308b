"""Abstract meshes and metadata-only DTensors in one process: the mesh's metadata, the
dispatcher's decisions on them (against its decisions on data, for the validator's sample
calls of every op), the refusal of values, the predicted memory, and whole training steps
of the examples, up to a (64, 8) mesh. The MPI test ``tests/mpi/distributed/test_abstract_mesh.py``
checks the predicted collectives against a real run."""

from __future__ import annotations

import copy
import json
import pickle
from collections import Counter

import numpy as np
import pytest
from helpers.sim import dtensor_of

import dtensor as dt
from dtensor.dispatch import dispatcher as _dispatch
from dtensor.ops import OPS
from dtensor.validate import sample_calls
from launch.examples import _training as T
from placements.errors import DTensorError, MeshError, MetadataOnlyError

R, S = dt.Replicate(), dt.Shard


# -- the mesh -------------------------------------------------------------------------------------
@pytest.mark.mode_independent
def test_abstract_mesh_metadata():
    mesh = dt.AbstractMesh((64, 8), ("dp", "tp"))
    assert (mesh.shape, mesh.ndim, mesh.size(), mesh.size("tp"), mesh.size(0)) == (
        (64, 8), 2, 512, 8, 64)
    assert mesh.mesh_dim_names == ("dp", "tp") and mesh.get_coordinate() == (0, 0)
    assert mesh.get_local_rank("dp") == 0 and mesh.mesh.shape == (64, 8)
    assert mesh.mesh[63, 7] == 511
    tp = mesh["tp"]
    assert (tp.shape, tp.mesh_dim_names, tp.get_group(0).mesh_dim) == ((8,), ("tp",), 1)
    assert mesh._flatten().shape == (512,) and mesh._flatten().mesh_dim_names == ("dp_tp",)
    assert mesh == dt.AbstractMesh([64, 8], ["dp", "tp"]) and hash(mesh) == hash(
        dt.AbstractMesh((64, 8), ("dp", "tp")))
    assert mesh != dt.AbstractMesh((64, 8)) and mesh != dt.AbstractMesh((8, 64), ("dp", "tp"))
    assert pickle.loads(pickle.dumps(mesh)) == mesh
    assert repr(mesh) == "AbstractMesh((64, 8), mesh_dim_names=('dp', 'tp'))"
    real = dt.init_device_mesh((1,), mesh_dim_names=("dp",))
    like = dt.AbstractMesh.from_mesh(real)
    assert (like.shape, like.mesh_dim_names, like.device_type) == ((1,), ("dp",), "cpu")
    assert like != real and real != like
    for bad in ((), (0, 2), "x"):
        with pytest.raises(MeshError):
            dt.AbstractMesh(bad)
    with pytest.raises(MeshError):
        dt.AbstractMesh((2, 2), ("a", "a"))
    with pytest.raises(MeshError):
        mesh["pp"]


def test_a_coordinate_mesh_holds_its_shards_and_runs_kernels():
    g = np.arange(36, dtype=np.float32).reshape(6, 6)
    mesh = dt.AbstractMesh((2, 3), ("dp", "tp"), coord=(1, 2))
    assert (mesh.get_coordinate(), mesh.get_rank(), mesh.get_local_rank("tp")) == ((1, 2), 5, 2)
    assert (mesh["tp"].get_coordinate(), mesh["tp"].get_group(0).rank) == ((2,), 2)
    assert repr(mesh) == "AbstractMesh((2, 3), mesh_dim_names=('dp', 'tp'), coord=(1, 2))"
    # one mesh seen from another coordinate; an abstract mesh (no data) is another mesh
    other = dt.AbstractMesh((2, 3), ("dp", "tp"), coord=(0, 0))
    assert mesh == other and hash(mesh) == hash(other) and mesh != dt.AbstractMesh((2, 3))
    assert pickle.loads(pickle.dumps(mesh)).get_coordinate() == (1, 2)
    x = dt.distribute_tensor(g, mesh, [S(0), S(1)])
    assert type(x) is dt.DTensor
    np.testing.assert_array_equal(x.to_local().numpy(), g[3:, 4:])
    y = (x * 2).exp()  # the kernels run on this coordinate's block
    assert y.placements == (S(0), S(1))
    np.testing.assert_allclose(y.to_local().numpy(), np.exp(g[3:, 4:] * 2), rtol=1e-6)
    assert dt.ones((6, 6), device_mesh=mesh, placements=[S(0), S(1)]).to_local().shape == (3, 2)
    with pytest.raises(MeshError, match="redistribute: .*mesh dim 1.*needs a communicator"):
        x.redistribute(mesh, [S(0), R])  # an all-gather over "tp": no groups were given
    for bad in ({"coord": (2, 0)}, {"coord": (0,)}, {"groups": (None, None)},
                {"coord": (0, 0), "groups": (None,)}):
        with pytest.raises(MeshError):
            dt.AbstractMesh((2, 3), **bad)
    with pytest.raises(MeshError, match="without coord"):
        dt.abstract_tensor((6, 6), mesh)


# -- decisions: those of the dispatcher on data -----------------------------------------------------
_LAYOUTS = ((S(0), R), (R, R), (R, S(-1)), (S(0), S(-1)))


def _layout(arr, k):
    if arr.ndim == 0:
        return (R, R)
    return tuple(S(p.dim % arr.ndim) if p.is_shard() else p for p in _LAYOUTS[k % 4])


def _convert(call, make):
    """The sample's values with each tensor argument made by ``make(array, k)``."""
    values = [list(v) if isinstance(v, list) else v for v in call.values]
    for k, (pi, ei) in enumerate(call.slots):
        holder, i = (values, pi) if ei < 0 else (values[pi], ei)
        if isinstance(holder[i], np.ndarray):
            holder[i] = make(holder[i], k)
    for i, v in enumerate(values):  # tensor-valued static arguments (indices): local tensors
        if isinstance(v, np.ndarray):
            values[i] = dt.from_numpy(v.copy())
    return values


def _outputs(out):
    return [out] if isinstance(out, dt.DTensor) else list(out)


@pytest.mark.mode_independent
def test_abstract_ops_take_the_dispatchers_decisions():
    """For the validator's sample calls of every op on a (2, 2) mesh: an op on abstract
    inputs gives outputs of the specs the dispatcher decides for the same metadata on data
    (or raises the same error type), in the structure (DTensor, tuple, namedtuple) its
    kernel returns."""
    sim, mesh = dt.AbstractMesh((2, 2), coord=(0, 0)), dt.AbstractMesh((2, 2))
    checked, structures = 0, 0
    for info in OPS.values():
        for n, call in enumerate(sample_calls(info)[:3]):
            real = _convert(call, lambda a, k, n=n: dtensor_of(a, sim, _layout(a, k + n)))
            fake = _convert(call, lambda a, k, n=n: dt.abstract_like(a, mesh, _layout(a, k + n)))
            try:
                entry, values, _ = _dispatch.decide(info, real, {})
            except DTensorError as e:
                with pytest.raises(type(e)):
                    _dispatch.dispatch(info, fake, {})
                continue
            out = _dispatch.dispatch(info, fake, {})
            got = [(o.shape, o.dtype, o.placements) for o in _outputs(out)]
            want = [(s.shape, s.dtype, s.placements) for s in entry.out_specs]
            assert got == want, (info.name, call.label)
            assert all(type(o) is dt.AbstractDTensor for o in _outputs(out)), info.name
            if info.inplace:
                assert out is fake[0], info.name
            elif not entry.comm:  # no collective: the real dispatcher runs on the sim mesh
                ran = _dispatch.run_entry(entry, values, sim)
                assert type(ran) is type(out) or (
                    isinstance(ran, dt.DTensor) and isinstance(out, dt.DTensor)), info.name
                structures += 1
            checked += 1
    assert checked > 300 and structures > 200, (checked, structures)


# -- values are refused -------------------------------------------------------------------------------
@pytest.mark.mode_independent
def test_values_are_refused_naming_the_op():
    mesh = dt.AbstractMesh((4, 2), ("dp", "tp"))
    x = dt.abstract_tensor((8, 6), mesh, [S(0), R])
    one = x.sum()
    for op, call in {
        "to_local": x.to_local, "full_tensor": x.full_tensor, "item": one.item,
        "bool": lambda: bool(one), "float": lambda: float(one), "tolist": x.tolist,
        "numpy conversion": lambda: np.asarray(x), "numpy.mean": lambda: np.mean(x),
        "numpy.exp": lambda: np.exp(x),
    }.items():
        with pytest.raises(MetadataOnlyError, match=f"^{op}.*abstract mesh"):
            call()
    with pytest.raises(RuntimeError):  # also the builtin type
        x.full_tensor()
    assert repr(x) == (
        "AbstractDTensor(shape=(8, 6), dtype=float32, placements=[S(0), R], "
        "device_mesh=AbstractMesh((4, 2), mesh_dim_names=('dp', 'tp')))")
    assert x.device == "cpu" and x.numel() == 48 and len(x) == 8
    assert type(copy.deepcopy(x)) is dt.AbstractDTensor and type(copy.copy(x)) is dt.AbstractDTensor
    with pytest.raises(MeshError):
        dt.abstract_tensor((2,), dt.init_device_mesh((1,)))
    local = dt.ones(2, 6)
    made = dt.DTensor.from_local(local, mesh, [S(0), R], shape=(8, 6))
    assert type(made) is dt.AbstractDTensor and made.placements == (S(0), R)
    assert dt.DTensor.from_local(local, mesh).shape == (2, 6)
    with pytest.raises(MetadataOnlyError, match="give shape="):
        dt.DTensor.from_local(local, mesh, [S(0), R])
    with pytest.raises(MetadataOnlyError, match="requires grad"):
        dt.DTensor.from_local(local.requires_grad_(), mesh, shape=(2, 6))


# -- redistribute, autograd, memory -------------------------------------------------------------------
def test_redistribute_reports_its_collectives_and_memory():
    mesh = dt.AbstractMesh((4, 2))
    dt.reset_abstract_peak()
    base = dt.abstract_memory_stats()["live_bytes"]
    x = dt.abstract_tensor((8, 6), mesh, [S(0), R], dtype=dt.float64)  # 2 x 6 x 8 bytes
    assert dt.abstract_memory_stats()["live_bytes"] - base == 96
    with dt.debug.CommDebugMode() as mode:
        y = x.redistribute(mesh, [R, S(1)])
        v = y.view(8, 2, 3)  # a view: no new block
        same = y.redistribute(mesh, [R, S(1)], async_op=True)
    # chunk dim 1 first, then gather the (2, 3) blocks: never more than the target needs
    assert [(r.op, r.kind, r.mesh_dim, r.nbytes) for r in mode.records] == [
        ("redistribute", "all_gather", 0, 192)]
    assert same is y and type(v) is dt.AbstractDTensor and v.placements == (R, S(1))
    stats = dt.abstract_memory_stats()
    assert stats["live_bytes"] - base == 96 + 192  # y: 8 x 3 x 8 bytes
    del y, v, same
    assert dt.abstract_memory_stats()["live_bytes"] - base == 96
    assert stats["peak_bytes"] - base == 96 + 192
    with pytest.raises(MeshError):
        x.redistribute(dt.AbstractMesh((2, 4)), [R, R])


def test_autograd_moves_gradients_and_counts_saved_tensors():
    mesh = dt.AbstractMesh((2, 2))
    x = dt.abstract_tensor((8, 6), mesh, [S(0), R])
    w = dt.abstract_tensor((6, 4), mesh, [R, S(1)], requires_grad=True)
    dt.reset_abstract_peak()
    base = dt.abstract_memory_stats()["live_bytes"]
    # x @ w: 4 x 2 floats, gone after relu (whose node keeps only a stand-in of its input,
    # as on a real mesh); relu's output stays (its formula reads it)
    y = (x @ w).relu()
    assert dt.abstract_memory_stats()["live_bytes"] - base == 32
    assert dt.abstract_memory_stats()["peak_bytes"] - base == 2 * 32
    loss = y.sum()
    with dt.debug.CommDebugMode() as mode:
        loss.backward()
    assert w.grad.placements == (R, S(1)) and w.grad.shape == (6, 4)
    assert type(w.grad) is dt.AbstractDTensor and w.grad.grad_fn is None
    # the gradient of the data-parallel weight: a partial sum over mesh dim 0, reduced
    assert mode.get_comm_counts_by_phase() == {"backward": {"all_reduce": 1}}
    assert mode.records[0].nbytes == 6 * 2 * 4
    del loss, y
    assert dt.abstract_memory_stats()["live_bytes"] - base == 6 * 2 * 4  # w.grad


def test_abstract_memory_frees_what_the_real_allocator_frees():
    """A node keeps stand-ins of the intermediates its formula does not read, so an
    abstract program holds the bytes a real one holds (the allocator's count is the
    oracle, on both recording paths); ``detach`` shares its input's block."""
    shape = (64, 256)  # 64 KiB float32 blocks, well above the allocator's small requests

    def program(a, b, c):
        h = (a * b) + c  # add's formula reads neither input: the product goes
        t = h.tanh()  # its node keeps its output; h goes
        g = t.detach()  # no new memory
        return (t + g).sum(), g  # the sum's formula reads only the shape of t + g

    rng = np.random.default_rng(0)
    real = [dt.tensor(rng.standard_normal(shape).astype(np.float32)).requires_grad_()
            for _ in range(3)]
    base = dt.memory_stats()["allocated_bytes"]
    out = program(*real)
    real_held = dt.memory_stats()["allocated_bytes"] - base
    assert real_held == 64 * 256 * 4  # t alone (the scalar is below the pool's minimum)
    del out
    mesh = dt.AbstractMesh((1,))
    abstract = [dt.abstract_tensor(shape, mesh, requires_grad=True) for _ in range(3)]
    base = dt.abstract_memory_stats()["live_bytes"]
    out = program(*abstract)
    assert dt.abstract_memory_stats()["live_bytes"] - base == real_held + 4  # + the scalar
    del out


def test_class_sharded_losses_report_the_all_reduces_of_their_kernels():
    """Cross entropy and softmax over a sharded class dim all-reduce the per-row maximum and
    sums inside their kernel: on an abstract mesh those collectives are reported with the
    bytes the kernel's arrays have (a float per row, then the stacked sums; bfloat16
    reductions widened to float32, as they run)."""
    mesh = dt.AbstractMesh((2, 2))
    target = dt.abstract_tensor((6,), mesh, [R, R], dtype="int64")
    rows = 6 * 4
    for dtype in (dt.float32, dt.bfloat16):
        logits = dt.abstract_tensor((6, 10), mesh, [R, S(1)], dtype=dtype, requires_grad=True)
        with dt.loss_parallel(), dt.debug.CommDebugMode() as mode:
            dt.nn.functional.cross_entropy(logits, target)
            logits.softmax(-1)
        got = [(r.op, r.kind, r.mesh_dim, r.nbytes) for r in mode.records]
        assert got == [
            ("cross_entropy", "all_reduce", 1, rows), ("cross_entropy", "all_reduce", 1, 2 * rows),
            ("softmax", "all_reduce", 1, rows), ("softmax", "all_reduce", 1, rows)], dtype
    with dt.debug.CommDebugMode() as mode:  # the class dim whole: no kernel all-reduce
        dt.nn.functional.cross_entropy(dt.abstract_tensor((6, 10), mesh, [S(0), R]), target)
    assert "all_reduce" not in mode.get_comm_counts()


# -- whole training steps -------------------------------------------------------------------------
def _step(model, params, batch, opt=None):
    loss = model.loss(params, batch)
    loss.backward()
    if opt is not None:
        opt.step()
    return loss


def test_examples_train_on_a_64x8_mesh():
    """The examples' ``place`` (``distribute_tensor``) and a whole training step, optimizer
    included, on an abstract (64, 8) mesh: 512 ranks in one process, traced by explain and
    counted by CommDebugMode alike."""
    mesh = dt.AbstractMesh((64, 8), ("dp", "tp"))
    for model in (T.mlp_model(), T.transformer_model()):
        params = T.place(model, "2d", mesh, model.init())
        batch = T.place(model, "2d", mesh, model.batch(0), batch=True)
        opt = T.make_optimizer("adam", list(params.values()), 0.01)
        dt.reset_abstract_peak()
        with dt.debug.CommDebugMode() as mode:
            trace = dt.debug.explain(_step, model, params, batch, opt)
        assert type(trace.result) is dt.AbstractDTensor and trace.result.shape == ()
        assert all(type(p.grad) is dt.AbstractDTensor for p in params.values()), model.name
        assert any(o.phase == "backward" for o in trace.ops)
        # explain lists what CommDebugMode counts, bytes included, but the explicit
        # redistributes of the forward pass
        listed = Counter((c.kind, c.mesh_dim, c.nbytes) for c in trace.collectives())
        counted = Counter((r.kind, r.mesh_dim, r.nbytes) for r in mode.records)
        dispatched = Counter((r.kind, r.mesh_dim, r.nbytes) for r in mode.records
                             if not (r.op == "redistribute" and r.phase == "forward"))
        assert listed and not listed - counted and not dispatched - listed, model.name
        stats = dt.abstract_memory_stats()
        assert stats["peak_bytes"] > stats["live_bytes"] > 0


def test_nothing_is_allocated():
    """A training step of a 1024-wide transformer on a (64, 8) mesh: gigabytes predicted per
    rank, none allocated (the factories of backward formulas, ``zeros_like``, included)."""
    mesh = dt.AbstractMesh((64, 8), ("dp", "tp"))
    model = T.transformer_model(batch=512, seq=128, dim=1024, heads=16, vocab=32000)
    params = {n: dt.abstract_tensor(s, mesh, T.layout(model, "2d", n), requires_grad=True)
              for n, s in model.shapes.items()}
    batch = {n: dt.abstract_like(a, mesh, [R, R] if n == "mask" else [S(0), R])
             for n, a in model.batch(0).items()}
    dt.reset_abstract_peak()
    dt.reset_peak_memory_stats()
    allocated = dt.memory_stats()["allocated_bytes"]
    _step(model, params, batch)
    zeros = dt.zeros_like(params["wte"]), dt.zeros((64, 8), device_mesh=mesh)  # 128 MiB, 2 KiB
    assert dt.memory_stats()["peak_allocated_bytes"] - allocated < 1 << 20
    assert all(type(z) is dt.AbstractDTensor for z in zeros)
    assert dt.abstract_memory_stats()["peak_bytes"] > 1 << 30



@pytest.mark.mode_independent  # metadata-only tensors never take the compiled front
def test_auto_shard_plans_a_512_rank_layout_from_metadata():
    """``dt.auto_shard`` on an abstract (64, 8) mesh: a 4096-wide MLP's training step
    searched in one process without allocating its data; the plan shards the weights
    (replicated, they alone would take 512 MiB per rank) and ``apply`` places abstract
    parameters."""
    mesh = dt.AbstractMesh((64, 8), ("dp", "tp"))
    model = T.mlp_model(batch=4096, dim=4096, hidden=4 * 4096)
    params = {n: dt.abstract_tensor(s, mesh, [R, R]) for n, s in model.shapes.items()}
    batch = {n: dt.abstract_tensor((4096, 4096), mesh, [R, R]) for n in ("x", "y")}
    dt.reset_peak_memory_stats()
    allocated = dt.memory_stats()["allocated_bytes"]
    plan = dt.auto_shard(model.loss, params, batch, mesh, rounds=1, pairs=2, top_k=1,
                         optimizer=lambda ps: dt.optim.SGD(ps, lr=0.1), fit_step=True)
    assert dt.memory_stats()["peak_allocated_bytes"] - allocated < 1 << 20
    assert plan.step_fit is None  # fit_step is ignored: nothing runs here
    replicated = next(c for c in plan.candidates
                      if all(p == (R, R) for p in c.placements.values()))
    assert plan.predicted_peak_bytes < replicated.prediction.peak_bytes
    assert plan.predicted_time < replicated.prediction.time_s
    assert any(p != (R, R) for n, p in plan.placements.items() if n in ("w1", "w2"))
    placed = plan.apply(params)
    assert all(type(t) is dt.AbstractDTensor and t.placements == plan.placements[n]
               for n, t in placed.items())


@pytest.mark.mode_independent  # metadata-only tensors never take the compiled front
def test_abstract_plan_benchmark_reports_traces_and_a_search(tmp_path):
    from launch.bench import abstract_plan

    out = tmp_path / "plan.json"
    abstract_plan.main(["--repeat", "1", "--models", "mlp", "--auto", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert set(doc["results"]) == {"mlp 2x2", "mlp 8x8", "mlp 64x8"}
    for row in doc["results"].values():
        assert row["step_s"] > 0 and row["collectives"] > 0 and row["peak_bytes"] > 0
    (search,) = doc["auto_shard"].values()
    assert search["candidates_traced"] > 1 and search["predicted_step_s"] > 0
    assert set(search["placements"]) == {"w1", "b1", "w2", "b2", "x", "y"}
    with pytest.raises(SystemExit, match="unknown models"):
        abstract_plan.main(["--models", "nope"])


def test_from_local_on_a_coordinate_mesh_needs_the_shape():
    mesh = dt.AbstractMesh((2,), coord=(1,))
    local = dt.ones(3, 2)
    with pytest.raises(dt.errors.MeshError, match="give shape="):
        dt.DTensor.from_local(local, mesh, [dt.Shard(0)])
    d = dt.DTensor.from_local(local, mesh, [dt.Shard(0)], shape=(6, 2))
    assert d.shape == (6, 2) and d.to_local().shape == (3, 2)
