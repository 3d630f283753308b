"""A tour of redistributions: ``python -m launch -n 4 launch/examples/redistribute_tour.py``.

For one (7, 5) tensor (uneven on 2, 3 and 4 ranks) it walks through the moves between
``Shard``, ``Replicate`` and ``Partial`` placements: for each, the plan that
``dt.debug.explain`` predicts, the collectives that ``CommDebugMode`` saw, and a check that
the data is intact. On 4 ranks it uses a 2x2 mesh, otherwise a 1-D mesh.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

import dtensor as dt
from dtensor.debug import explain

R, S, P = dt.Replicate(), dt.Shard, dt.Partial


def short(placements: list) -> str:
    return ",".join(p.short() for p in placements)


def moves(ndim: int) -> list[tuple[list, list]]:
    if ndim == 1:
        return [
            ([R], [S(0)]),
            ([S(0)], [R]),
            ([S(0)], [S(1)]),
            ([P("sum")], [R]),
            ([P("sum")], [S(1)]),
        ]
    return [
        ([R, R], [S(0), S(1)]),
        ([S(0), S(1)], [R, R]),
        ([S(0), R], [R, S(0)]),
        ([S(0), S(0)], [S(1), S(1)]),
        ([P("sum"), R], [R, S(1)]),
        ([P("sum"), P("sum")], [R, R]),
    ]


def main() -> None:
    comm = MPI.COMM_WORLD
    mesh = dt.init_device_mesh((2, 2) if comm.size == 4 else (comm.size,))
    a = np.arange(35, dtype=np.float32).reshape(7, 5)
    for src, dst in moves(mesh.ndim):
        if any(p.is_partial() for p in src):
            # Each coordinate holds a / k where k = number of Partial contributions.
            k = int(np.prod([mesh.size(m) for m, p in enumerate(src) if p.is_partial()]))
            x = dt.DTensor.from_local(dt.from_numpy(a / k), mesh, src)
        else:
            x = dt.distribute_tensor(a, mesh, src)
        plan = explain(x, dst)
        with dt.debug.CommDebugMode() as mode:
            y = x.redistribute(mesh, dst)
        np.testing.assert_allclose(y.full_tensor().numpy(), a, rtol=1e-6)
        if comm.size > 1:
            assert mode.get_comm_counts() == plan.comm_counts(), (mode.table(), str(plan))
        if comm.rank == 0:
            print(f"--- {short(src)} -> {short(dst)}")
            print(str(plan))
            print(f"observed: {mode.get_comm_counts() or 'no collectives'}")


if __name__ == "__main__":
    main()
