"""Tensor-parallel MLP (Megatron style): ``python -m launch -n 4 launch/examples/tp_mlp.py``.

``y = relu(x @ W1) @ W2`` on a 1-D mesh of all ranks: ``W1`` is sharded by columns
(``Shard(1)``) and ``W2`` by rows (``Shard(0)``), ``x`` is replicated. The first matmul needs
no communication and gives a column-sharded hidden layer; relu keeps it; the second matmul
gives a ``Partial(sum)`` output, and one all-reduce makes it replicated. CommDebugMode
confirms that the forward pass issues exactly that one collective.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

import dtensor as dt

R, S = dt.Replicate(), dt.Shard


def main() -> None:
    mesh = dt.init_device_mesh((MPI.COMM_WORLD.size,), mesh_dim_names=("tp",))
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((8, 16)).astype(np.float32)
    w1_np = rng.standard_normal((16, 64)).astype(np.float32) / 4
    w2_np = rng.standard_normal((64, 16)).astype(np.float32) / 8

    x = dt.distribute_tensor(x_np, mesh, [R])
    w1 = dt.distribute_tensor(w1_np, mesh, [S(1)])  # column parallel
    w2 = dt.distribute_tensor(w2_np, mesh, [S(0)])  # row parallel

    with dt.debug.CommDebugMode() as mode:
        h = (x @ w1).relu()  # [S(1)]: each rank holds some hidden units
        y = h @ w2  # [P(sum)]: each rank holds a partial sum
        y = y.redistribute(mesh, [R])  # one all-reduce
    expected = np.maximum(x_np @ w1_np, 0) @ w2_np
    err = float(np.abs(y.to_local().numpy() - expected).max())
    if mesh.get_rank() == 0:
        print(f"h: {h.placements}, y before the reduction: {(h @ w2).placements}")
        print(mode.table())
        print(f"max |error| against numpy: {err:.2e}")
    assert h.placements == (S(1),)
    if mesh.size() > 1:
        assert mode.get_comm_counts() == {"all_reduce": 1}, mode.table()
    assert err < 1e-4


if __name__ == "__main__":
    main()
