"""dtensor tour: ``python -m launch -n 4 launch/demo.py``.

On 4 ranks the tour uses a 2x2 mesh (``dp`` x ``tp``); on any other number of ranks a 1-D
mesh. Rank 0 prints, the other ranks stay quiet:

1. the mesh;
2. one tensor distributed several ways, drawn with ``dt.debug.visualize_sharding``
   (uneven shards included);
3. a few ops and the placements their sharding rules inferred;
4. a redistribute with its ``dt.debug.explain`` plan, and what ``CommDebugMode`` counted;
5. a tensor-parallel MLP (column- then row-parallel) checked against numpy;
6. a latency table at two sizes, 8x8 and 512x512 (median microseconds per call, slowest
   rank), each row labelled with the placements that ran and the collectives issued.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

import dtensor as dt
from dtensor.debug import explain, visualize_sharding
from launch.bench._common import worst_rank_median_us

R, S = dt.Replicate(), dt.Shard
COMM = MPI.COMM_WORLD


def say(*lines: object) -> None:
    """Print on rank 0 only."""
    if COMM.rank == 0:
        print(*lines, sep="\n", flush=True)


def section(title: str) -> None:
    say("", f"== {title} " + "=" * max(0, 70 - len(title)))


def fmt(placements: object) -> str:
    """``[S(0), R]``: the short form of placements."""
    return "[" + ", ".join(p.short() for p in placements) + "]"


def make_mesh() -> dt.DeviceMesh:
    if COMM.size == 4:
        return dt.init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    return dt.init_device_mesh((COMM.size,), mesh_dim_names=("tp",))


def pl(*two_d: dt.Placement, mesh: dt.DeviceMesh) -> list[dt.Placement]:
    """The placements for a 2-D mesh, or the last one of them on a 1-D mesh."""
    return list(two_d) if mesh.ndim == 2 else [two_d[-1]]


def tour_layouts(mesh: dt.DeviceMesh, a: np.ndarray) -> dt.DTensor:
    section("one (6, 5) tensor, three layouts")
    if mesh.ndim == 2:
        layouts = [[S(0), R], [S(0), S(1)], [R, S(0)]]
    else:
        layouts = [[S(0)], [S(1)], [R]]
    x = None
    for placements in layouts:
        d = dt.distribute_tensor(a, mesh, placements)
        say(visualize_sharding(d), "")
        x = d if x is None else x
    return x


def tour_ops(mesh: dt.DeviceMesh, x: dt.DTensor) -> None:
    section("ops and their inferred placements")
    shown = {
        "x": x,
        "x @ x.T": x @ x.T,
        "(x @ x.T).relu().sum(dim=1)": (x @ x.T).relu().sum(dim=1),
        "x * 2.0 + 1.0": x * 2.0 + 1.0,
        "x.sum()": x.sum(),
        "dt.softmax(x, dim=1)": dt.softmax(x, dim=1),
    }
    width = max(map(len, shown))
    for expr, d in shown.items():
        say(f"{expr.ljust(width)}  {fmt(d.placements):16}  shape {tuple(d.shape)}")


def tour_redistribute(mesh: dt.DeviceMesh, x: dt.DTensor, a: np.ndarray) -> None:
    target = pl(R, S(1), mesh=mesh)
    section(f"redistribute {fmt(x.placements)} -> {fmt(target)}")
    say("plan (dt.debug.explain, before running):", str(explain(x, target)))
    with dt.debug.CommDebugMode() as mode:
        y = x.redistribute(mesh, target)
    say("", "what ran (CommDebugMode):", mode.table())
    np.testing.assert_array_equal(y.full_tensor().numpy(), a)


def tour_mlp(mesh: dt.DeviceMesh) -> None:
    section("tensor-parallel MLP: relu(x @ W1) @ W2, W1 column- and W2 row-parallel")
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((8, 16)).astype(np.float32)
    w1_np = rng.standard_normal((16, 32)).astype(np.float32) / 4
    w2_np = rng.standard_normal((32, 16)).astype(np.float32) / 6
    x = dt.distribute_tensor(x_np, mesh, pl(S(0), R, mesh=mesh))  # batch over dp
    w1 = dt.distribute_tensor(w1_np, mesh, pl(R, S(1), mesh=mesh))  # columns over tp
    w2 = dt.distribute_tensor(w2_np, mesh, pl(R, S(0), mesh=mesh))  # rows over tp
    with dt.debug.CommDebugMode() as mode:
        h = (x @ w1).relu()
        out = h @ w2
    say(
        f"x {fmt(x.placements)}, W1 {fmt(w1.placements)}, W2 {fmt(w2.placements)}",
        f"h = relu(x @ W1): {fmt(h.placements)}   out = h @ W2: {fmt(out.placements)}",
        f"collectives in the forward pass: {mode.get_total_counts()} (the partial sum stays "
        "pending until needed)",
    )
    got = out.full_tensor().numpy()
    expected = np.maximum(x_np @ w1_np, 0) @ w2_np
    err = float(np.max(np.abs(got - expected)))
    say(f"max |dtensor - numpy| = {err:.2e}")
    if err > 1e-4:
        raise AssertionError(f"the MLP differs from numpy by {err}")


LATENCY_SIZES = (8, 512)


def _what_runs(fn: Callable[[], object], inputs: list[dt.DTensor]) -> tuple[str, str]:
    """The placements ``fn`` maps (``[S(0)], [R] -> [S(0)]``) and the collectives it issues,
    read from one call."""
    with dt.debug.CommDebugMode() as mode:
        out = fn()
    if not isinstance(out, dt.DTensor):
        return "(numpy, this rank's shard)", ""
    placements = ", ".join(fmt(d.placements) for d in inputs) + f" -> {fmt(out.placements)}"
    return placements, ", ".join(mode.get_comm_counts()) or "none"


def _latency_cases(mesh: dt.DeviceMesh, n: int) -> list[tuple[str, Callable, list]]:
    """(expression, call, DTensor inputs) of the latency table's rows on n x n operands."""
    sharded, replicated = [S(0), *[R] * (mesh.ndim - 1)], [R] * mesh.ndim
    a = np.ones((n, n), np.float32)
    x = dt.distribute_tensor(a, mesh, sharded)
    w = dt.distribute_tensor(a, mesh, replicated)
    shard = x.to_local().numpy()
    return [
        ("x + x", lambda: x + x, [x, x]),
        ("x @ w", lambda: x @ w, [x, w]),
        ("x.sum(dim=0)", lambda: x.sum(dim=0), [x]),
        (f"x.redistribute({fmt(replicated)})", lambda: x.redistribute(mesh, replicated), [x]),
        ("shard + shard", lambda: shard + shard, []),
    ]


def tour_latency(mesh: dt.DeviceMesh) -> None:
    sizes = " and ".join(f"{n}x{n}" for n in LATENCY_SIZES)
    section(f"latency (median us per call, slowest rank; float32, {sizes})")
    rows: dict[tuple[str, str, str], dict[int, float]] = {}
    for n in LATENCY_SIZES:
        for expr, fn, inputs in _latency_cases(mesh, n):
            us = worst_rank_median_us(fn, COMM, budget_s=0.02)[0]
            rows.setdefault((expr, *_what_runs(fn, inputs)), {})[n] = us
    heads = ("op", "placements", "collectives", *(f"{n}x{n}" for n in LATENCY_SIZES))
    table = [heads] + [
        (*label, *(f"{times[n]:.1f}" if n in times else "-" for n in LATENCY_SIZES))
        for label, times in rows.items()
    ]
    widths = [max(len(r[i]) for r in table) for i in range(len(heads))]
    for r in table:
        say("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in
                      enumerate(zip(r, widths))).rstrip())


def main() -> None:
    t0 = time.perf_counter()
    mesh = make_mesh()
    section("mesh")
    say(
        f"{COMM.size} ranks, mesh shape {mesh.shape}, dim names {mesh.mesh_dim_names}",
        "ranks:",
        str(mesh.mesh),
    )
    a = np.arange(30, dtype=np.float32).reshape(6, 5)
    x = tour_layouts(mesh, a)
    tour_ops(mesh, x)
    tour_redistribute(mesh, x, a)
    tour_mlp(mesh)
    tour_latency(mesh)
    say("", f"tour done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
