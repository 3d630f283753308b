"""A user-defined op with its own sharding rule: ``python -m launch -n 4 launch/examples/custom_rule.py``.

``row_rms_norm(x, eps)`` normalises each row of ``x`` by its root mean square (dtensor has a
built-in ``dt.rms_norm``; this one shows how a program adds its own op). Row-wise ops can
run on any sharding that keeps the last dim whole, so its rule (for one mesh dim) lists:

- ``[R <- R]``: everything replicated;
- ``[S(d) <- S(d)]`` for every dim ``d`` except the last: each rank normalises its rows.

``dt.register_op`` registers the local kernel (written with ``dt`` ops on local tensors) and
the rule; the returned function then works on local tensors and on DTensors: the dispatcher
expands the rule to the mesh, picks the cheapest strategy, redistributes inputs when needed
(a column-sharded ``x`` is first made row-sharded) and caches the decision. ``eps`` is not
decision-relevant, so it is neither a tensor nor a static parameter: changing it does not
miss the propagation cache.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

import dtensor as dt
from dtensor.debug import explain
from placements.rules import Candidate, OpSchema, RuleResult

R, S = dt.Replicate(), dt.Shard


def row_rms_norm_kernel(x: dt.Tensor, eps: float = 1e-6) -> dt.Tensor:
    """Local kernel: ``x / sqrt(mean(x**2, last dim) + eps)``."""
    return x * dt.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps)


def row_rms_norm_rule(schema: OpSchema) -> RuleResult:
    """Sharding rule for one mesh dim: output same shape/dtype; R, or S(d) off the last dim."""
    x = schema.args[0]
    ndim = len(x.shape)
    candidates = [Candidate((R, R))]
    candidates += [Candidate((S(d), S(d))) for d in range(ndim - 1)]
    return RuleResult((x.shape,), (x.dtype,), tuple(candidates))


row_rms_norm = dt.register_op("row_rms_norm", row_rms_norm_kernel, row_rms_norm_rule,
                              tensor_params=("x",))


def reference(a: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return a / np.sqrt((a * a).mean(axis=-1, keepdims=True) + eps)


def main() -> None:
    comm = MPI.COMM_WORLD
    mesh = dt.init_device_mesh((comm.size,))
    a = np.random.default_rng(2).standard_normal((6, 8)).astype(np.float32)

    local = row_rms_norm(dt.from_numpy(a))  # plain local tensors work too
    np.testing.assert_allclose(local.numpy(), reference(a), rtol=1e-5, atol=1e-6)

    rows = dt.distribute_tensor(a, mesh, [S(0)])
    cols = dt.distribute_tensor(a, mesh, [S(1)])
    with dt.debug.CommDebugMode() as mode:
        y_rows = row_rms_norm(rows)  # no communication: rows stay where they are
    assert mode.get_total_counts() == 0 and y_rows.placements == (S(0),)
    plan = explain(row_rms_norm, cols)  # before running: the column shards must move
    with dt.debug.CommDebugMode() as mode:
        y_cols = row_rms_norm(cols, eps=1e-5)
    assert mode.get_comm_counts() == plan.comm_counts()
    for y, eps in ((y_rows, 1e-6), (y_cols, 1e-5)):
        np.testing.assert_allclose(y.full_tensor().numpy(), reference(a, eps), rtol=1e-5, atol=1e-6)
    if comm.rank == 0:
        print("row_rms_norm on [S(0)]:", y_rows.placements, "- no collectives")
        print("explain(row_rms_norm, x on [S(1)]):")
        print(plan)
        print("observed:", mode.get_comm_counts() or "no collectives")


if __name__ == "__main__":
    main()
