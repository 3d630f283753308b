"""CommDebugMode: no hidden communication, and collectives attributed to their op."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers.mpi import data, dist, meshes
from mpi4py import MPI

import dtensor as dt

WORLD = MPI.COMM_WORLD
R, S, P = dt.Replicate(), dt.Shard, dt.Partial


@pytest.mark.mpi(min_size=1)
def test_matmul_without_communication():
    a, b = data((8, 6)), data((6, 4), 1)
    for mesh in meshes():
        rest = [R] * (mesh.ndim - 1)
        x0 = dist(a, mesh, [S(0), *rest])
        x1 = dist(a, mesh, [S(1), *rest])
        w = dist(b, mesh, [R] * mesh.ndim)
        w0 = dist(b, mesh, [S(0), *rest])
        with dt.debug.CommDebugMode() as mode:
            y = x0 @ w
            z = x1 @ w0
        assert mode.get_total_counts() == 0, mode.table()
        assert y.placements == (S(0), *rest)
        assert z.placements == (P("sum"), *rest)
        np.testing.assert_allclose(z.full_tensor().numpy(), a @ b, rtol=1e-4, atol=1e-5)


@pytest.mark.mpi(min_size=1)
def test_elementwise_on_equal_placements_without_communication():
    a, b = data((5, 6)), data((5, 6), 1)
    for mesh in meshes():
        rest = (R,) * (mesh.ndim - 1)
        for pl in [(S(0),) * mesh.ndim, (S(1), *rest), (R, *rest), (P("sum"),) * mesh.ndim]:
            x, y = dist(a, mesh, pl), dist(b, mesh, pl)
            with dt.debug.CommDebugMode() as mode:
                out = (x + y) - y * 2.0
            assert mode.get_total_counts() == 0, (pl, mode.table())
            assert out.placements == pl
            np.testing.assert_allclose(out.full_tensor().numpy(), a - b, rtol=1e-5, atol=1e-5)
        with dt.debug.CommDebugMode() as mode:
            x = dist(a, mesh, [S(0)] * mesh.ndim)
            x.relu().exp().sum(dim=1)
        assert mode.get_total_counts() == 0, mode.table()


@pytest.mark.mpi(min_size=2)
def test_shard_mismatch_costs_exactly_one_redistribution():
    a, b = data((8, 6)), data((8, 6), 1)
    mesh = dt.init_device_mesh((WORLD.size,))
    x, y = dist(a, mesh, [S(0)]), dist(b, mesh, [S(1)])
    with dt.debug.CommDebugMode() as mode:
        out = x + y
    assert mode.get_total_counts() == 1, mode.table()
    assert mode.get_comm_counts_by_op() == {"add": mode.get_comm_counts()}
    (kind,) = mode.get_comm_counts()
    assert kind in ("all_to_all", "all_gather")
    assert mode.records[0].mesh_dim == 0 and mode.records[0].nbytes > 0
    np.testing.assert_allclose(out.full_tensor().numpy(), a + b, rtol=1e-6)


@pytest.mark.mpi(min_size=2)
def test_partial_resolution_and_outside_ops_are_attributed():
    a = data((6, 4))
    mesh = dt.init_device_mesh((WORLD.size,))
    x = dist(a, mesh, [P("sum")])
    with dt.debug.CommDebugMode() as mode:
        y = x.exp()  # exp of a partial sum needs the sum first: one reduction
        x.redistribute(mesh, [S(0)])  # outside ops: counted under "redistribute"
    by_op = mode.get_comm_counts_by_op()
    (kind,) = by_op["exp"]  # reduce_scatter (to a Shard, the cheapest) or all_reduce
    assert kind in ("reduce_scatter", "all_reduce") and by_op["exp"][kind] == 1, mode.table()
    assert by_op["redistribute"] == {"reduce_scatter": 1}
    assert set(by_op) == {"exp", "redistribute"}
    assert not y.placements[0].is_partial()
    assert mode.get_total_counts() == sum(sum(v.values()) for v in by_op.values())
    np.testing.assert_allclose(y.full_tensor().numpy(), np.exp(a), rtol=1e-5)


@pytest.mark.mpi(min_size=4)
def test_mesh_dims_are_recorded_on_a_2d_mesh():
    mesh = dt.init_device_mesh((2, 2))
    a = data((8, 6))
    x = dist(a, mesh, [S(0), S(1)])
    y = dist(a, mesh, [S(0), P("sum")])
    with dt.debug.CommDebugMode() as mode:
        out = x + y  # the operands differ on mesh dim 1 only: communication there only
    assert mode.get_total_counts() >= 1
    assert {r.mesh_dim for r in mode.records} == {1}, mode.table()
    np.testing.assert_allclose(out.full_tensor().numpy(), a + a, rtol=1e-6)


@pytest.mark.mpi(min_size=1)
def test_table_and_json_report_the_counts():
    a = data((4, 4))
    mesh = dt.init_device_mesh((WORLD.size,))
    x = dist(a, mesh, [S(0)])
    with dt.debug.CommDebugMode() as mode:
        x.redistribute(mesh, [R])
        x.redistribute(mesh, [R])
    report = json.loads(mode.to_json())
    assert report["total_counts"] == mode.get_total_counts()
    assert report["by_kind"] == mode.get_comm_counts()
    assert report["by_op"] == mode.get_comm_counts_by_op()
    text = mode.table()
    assert text.splitlines()[0].split() == ["op", "collective", "mesh", "dim", "count", "bytes"]
    assert f"total: {mode.get_total_counts()} collectives" in text
    if WORLD.size > 1:
        assert report["by_op"] == {"redistribute": {"all_gather": 2}}
        assert "redistribute" in text and "all_gather" in text
    # the mode stops observing on exit
    x.redistribute(mesh, [R])
    assert json.loads(mode.to_json())["total_counts"] == report["total_counts"]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["sum", "avg", "max", "min"])
def test_indexing_and_fill_keep_a_partial_tensor_partial(kind):
    """Basic indexing of a Partial tensor is a view of each contribution, and ``fill_``
    places the value under the same Partial kind: neither communicates."""
    a = data((4, 6))
    mesh = dt.init_device_mesh((WORLD.size,))
    x = dist(a, mesh, [P(kind)])
    with dt.debug.CommDebugMode() as mode:
        views = {"x[1:3]": x[1:3], "x[:, ::2]": x[:, ::2], "x[2]": x[2]}
    assert mode.get_total_counts() == 0, mode.table()
    for what, want in zip(views, (a[1:3], a[:, ::2], a[2])):
        assert views[what].placements == (P(kind),), what
        np.testing.assert_allclose(views[what].full_tensor().numpy(), want, rtol=1e-5,
                                   atol=1e-5, err_msg=what)
    with dt.debug.CommDebugMode() as mode:
        x.fill_(3.0)
    assert mode.get_total_counts() == 0, mode.table()
    assert x.placements == (P(kind),)
    np.testing.assert_array_equal(x.full_tensor().numpy(), np.full((4, 6), 3.0, np.float32))


@pytest.mark.mpi(min_size=2)
def test_backward_collectives_are_attributed_to_the_op_whose_backward_issued_them():
    """A data-parallel step: the weight gradient's all-reduce counts under matmul's
    backward, marked backward, in CommDebugMode and in explain's trace; the forward's
    collective (the loss's reduction) is not."""
    mesh = dt.init_device_mesh((WORLD.size,))
    x = dt.distribute_tensor(data((8, 4)), mesh, [S(0)])
    w = dt.distribute_tensor(data((4, 3), 1), mesh, [R]).requires_grad_()

    def step():
        loss = (x @ w).tanh().sum()
        value = loss.full_tensor()  # forward: all-reduce of the P(sum) loss
        loss.backward()
        return value

    with dt.debug.CommDebugMode() as mode:
        step()
    assert mode.get_comm_counts() == {"all_reduce": 2}, mode.table()  # compatible totals
    assert mode.get_comm_counts_by_phase() == {"forward": {"all_reduce": 1},
                                               "backward": {"all_reduce": 1}}
    assert mode.get_comm_counts_by_op() == {"redistribute": {"all_reduce": 1},
                                            "matmul (backward)": {"all_reduce": 1}}
    fwd, bwd = mode.records
    assert (fwd.op, fwd.phase) == ("redistribute", "forward")
    assert (bwd.op, bwd.phase, bwd.nbytes) == ("matmul", "backward", 4 * 3 * 4)
    assert "matmul (backward)  all_reduce" in mode.table()
    doc = json.loads(mode.to_json())
    assert doc["by_phase"] == mode.get_comm_counts_by_phase()
    assert [r["phase"] for r in doc["rows"]] == ["forward", "backward"]
    # explain traces the backward too: the gradient's move is matmul's backward
    w.grad = None
    expl = dt.debug.explain(step)
    backward = [o for o in expl.ops if o.phase == "backward"]
    assert {o.backward_of for o in backward} >= {"matmul", "tanh", "sum"}
    assert all(o.phase == "forward" and o.backward_of is None
               for o in expl.ops[: expl.ops.index(backward[0])])
    moves = [o for o in backward if any(c.communicates for c in o.collectives)]
    assert [(o.op, o.backward_of) for o in moves] == [("redistribute", "matmul")]
    assert [c.kind for c in moves[0].collectives] == ["all_reduce"]
    assert "[backward of matmul]" in str(expl)
    assert f"({len(backward)} ops and gradient moves of backward)" in str(expl)
    np.testing.assert_allclose(w.grad.full_tensor().numpy(), mode_free_grad(x, w), rtol=1e-5)


def mode_free_grad(x, w):
    """The weight gradient of ``tanh(x @ w).sum()`` in numpy."""
    xa, wa = x.full_tensor().numpy(), w.detach().full_tensor().numpy()
    return xa.T @ (1 - np.tanh(xa @ wa) ** 2)
