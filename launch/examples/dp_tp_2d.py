"""2-D data x tensor parallel MLP: ``python -m launch -n 4 launch/examples/dp_tp_2d.py``.

A ``dp x tp`` mesh (2x2 on 4 ranks; ``(n/2) x 2`` on an even number n of ranks, ``n x 1``
otherwise): the batch of ``x`` is sharded over ``dp`` (``[Shard(0), Replicate()]``), the
weights are replicated over ``dp`` and tensor-parallel over ``tp`` (``W1`` by columns,
``W2`` by rows). The forward pass communicates only over ``tp`` (one reduction of the
partial sum per data-parallel group); a loss (the mean of squares) then reduces over both
dims. Results are checked against numpy.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

import dtensor as dt

R, S = dt.Replicate(), dt.Shard


def main() -> None:
    n = MPI.COMM_WORLD.size
    shape = (n // 2, 2) if n % 2 == 0 else (n, 1)
    mesh = dt.init_device_mesh(shape, mesh_dim_names=("dp", "tp"))
    rng = np.random.default_rng(1)
    x_np = rng.standard_normal((12, 16)).astype(np.float32)
    w1_np = rng.standard_normal((16, 32)).astype(np.float32) / 4
    w2_np = rng.standard_normal((32, 16)).astype(np.float32) / 6

    x = dt.distribute_tensor(x_np, mesh, [S(0), R])
    w1 = dt.distribute_tensor(w1_np, mesh, [R, S(1)])
    w2 = dt.distribute_tensor(w2_np, mesh, [R, S(0)])

    with dt.debug.CommDebugMode() as mode:
        y = ((x @ w1).relu() @ w2).redistribute(mesh, [S(0), R])
        loss = (y * y).mean()
        loss_value = float(loss.full_tensor().item())
    y_np = np.maximum(x_np @ w1_np, 0) @ w2_np
    err = float(np.abs(y.full_tensor().numpy() - y_np).max())
    loss_err = abs(loss_value - float((y_np * y_np).mean()))
    if mesh.get_rank() == 0:
        print(f"mesh {mesh.shape} {mesh.mesh_dim_names}; y {y.placements}, loss {loss.placements}")
        print(mode.table())
        print(f"max |y error| {err:.2e}, |loss error| {loss_err:.2e}")
    tp_dims = {r.mesh_dim for r in mode.records if r.op == "redistribute"}
    assert err < 1e-4 and loss_err < 1e-4
    assert mesh.size(1) == 1 or 1 in tp_dims


if __name__ == "__main__":
    main()
