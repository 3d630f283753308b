"""Ring attention against attention with all-gathered keys and values.

Run as ``python -m launch -n 2 -m launch.bench.ring_attention [--seqs 1024,2048,4096,8192]
[--heads 8] [--head-dim 64] [--repeat 3] [--out FILE]``. Float32 query, key and value of
shape ``(1, heads, S, head_dim)``, ``Shard(2)`` (the sequence) on a 1-D mesh of every rank;
one step is a causal ``dt.nn.functional.scaled_dot_product_attention`` and its backward
(the gradient of the output all ones). Per sequence length:

- ``ring``: ring attention inside ``dt.context_parallel`` (the load-balanced layout; K/V
  blocks pass around the ring, each transfer posted before the block's compute);
- ``gathered``: key and value redistributed to ``Replicate`` first (one all-gather each;
  their gradients reduce-scattered back), then the op's rule for sharded queries against
  whole keys (dtensor's layout: rank 0 holds the early half of the queries);
- ``serial``: ring attention with each transfer completed before the compute it would
  overlap (``dtensor.ops.ring.OVERLAP = False``);
- ``comm``: the ring's transfers alone (the same messages, no compute);
- the fraction of communication hidden: ``(serial - ring) / comm``, clipped to [0, 1];
- memory per rank: the peak during one step above what was held before it, the worst
  rank's, for ``ring`` and ``gathered``: numpy's new allocations (``tracemalloc``) plus the
  peak of dtensor's allocator (whose cached blocks tracemalloc does not see again).

Times are the worst rank's median seconds per step; each sample starts after a barrier,
and the four take turns sample by sample (a drifting load on a shared machine hits all).
Output: JSON on stdout (``--out FILE`` too), then a table, from rank 0.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time
import tracemalloc

# Run as a script, this file's folder is sys.path[0], where the sibling benchmark
# ``redistribute.py`` would shadow the ``redistribute`` package.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import numpy as np
from mpi4py import MPI

import dtensor as dt
from dtensor.ops import ring
from launch.bench._common import Progress, bench_args, emit, environment, table, worst_rank

F = dt.nn.functional


def _ring_step(bufs, mesh, seq: int) -> None:
    q, k, v = (b.detach().requires_grad_() for b in bufs)
    shard = [dt.Shard(2)]
    d = [dt.DTensor.from_local(a, mesh, shard, shape=(*a.shape[:2], seq, a.shape[3]))
         for a in (q, k, v)]
    out = F.scaled_dot_product_attention(*d, is_causal=True)
    out.backward(dt.ones_like(out))


def _gathered_step(x, mesh) -> None:
    shard, rep = [dt.Shard(2)], [dt.Replicate()]
    q, k, v = (dt.distribute_tensor(a, mesh, shard).requires_grad_() for a in x)
    out = F.scaled_dot_product_attention(q, k.redistribute(mesh, rep), v.redistribute(mesh, rep),
                                         is_causal=True)
    out.backward(dt.ones_like(out))


def _comm_step(shape, comm) -> None:
    """The ring's messages without compute: forward n-1 K/V blocks, backward n-1 K/V blocks
    and n gradient blocks (shapes as the ring's: K and V, or dK and dV, packed)."""
    n, r = comm.size, comm.rank
    if n == 1:
        return
    send = np.ones(shape, np.float32)
    recv = np.empty(shape, np.float32)
    for _ in range(3 * (n - 1) + 1):
        comm.wait_all([comm.irecv(recv, (r - 1) % n, 7), comm.isend(send, (r + 1) % n, 7)])


def _timed(fn, world) -> float:
    world.Barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _peak_bytes(fn, world) -> int:
    """The worst rank's peak bytes during ``fn()`` above those held before: numpy's new
    allocations (``tracemalloc``) plus dtensor's allocator's peak of allocated bytes (its
    cached blocks, which tracemalloc does not see again after the warm-up)."""
    world.Barrier()
    held = dt.memory_stats()["allocated_bytes"]
    dt.reset_peak_memory_stats()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    pooled = dt.memory_stats()["peak_allocated_bytes"] - held
    return int(worst_rank(float(peak - base + pooled), world))


def main(argv: list[str] | None = None) -> dict:
    """Time ring attention and the gathered baseline; rank 0 prints the JSON.
    **Collective**."""
    args = bench_args(
        __doc__.splitlines()[0], argv, repeat=3,
        seqs={"default": "1024,2048,4096,8192", "help": "sequence lengths, comma separated"},
        heads={"type": int, "default": 8, "help": "attention heads"},
        head_dim={"type": int, "default": 64, "help": "the head dim"},
    )
    world = MPI.COMM_WORLD
    n = world.Get_size()
    mesh = dt.init_device_mesh((n,))
    comm = mesh.get_group(0)
    seqs = [int(s) for s in args.seqs.split(",")]
    progress = Progress("ring_attention", len(seqs), enabled=world.Get_rank() == 0
                        and not args.quiet)
    figures = []
    for seq in seqs:
        rng = np.random.default_rng(seq)
        x = [rng.standard_normal((1, args.heads, seq, args.head_dim)).astype(np.float32)
             for _ in range(3)]
        bufs = [dt.tensor(a) for a in x]
        local = -(-seq // n)
        packed = (1, args.heads, local, 2 * args.head_dim)
        samples: dict[str, list[float]] = {"ring": [], "serial": [], "gathered": [],
                                           "comm": []}
        memory = {}
        with dt.context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2]):
            steps = {"ring": functools.partial(_ring_step, bufs, mesh, seq),
                     "gathered": functools.partial(_gathered_step, x, mesh)}
            for name, step in steps.items():
                step()  # warm-up (and the propagation caches)
                memory[name] = _peak_bytes(step, world)
            steps["serial"] = steps["ring"]
            steps["comm"] = functools.partial(_comm_step, packed, comm)
            for _ in range(args.repeat):  # interleaved: a drifting load hits all alike
                for name, step in steps.items():
                    ring.OVERLAP = name != "serial"
                    try:
                        samples[name].append(_timed(step, world))
                    finally:
                        ring.OVERLAP = True
        med = {k: worst_rank(statistics.median(v), world) for k, v in samples.items()}
        hidden = (min(1.0, max(0.0, (med["serial"] - med["ring"]) / med["comm"]))
                  if n > 1 and med["comm"] > 0 else None)
        figures.append({"seq": seq, **{f"{k}_s": round(v, 4) for k, v in med.items()},
                        "hidden_fraction": None if hidden is None else round(hidden, 3),
                        "ring_peak_mib": round(memory["ring"] / 2**20, 1),
                        "gathered_peak_mib": round(memory["gathered"] / 2**20, 1)})
        progress(f"sequence {seq}: ring {med['ring']:.3f} s, gathered {med['gathered']:.3f} s")
    doc = {"ranks": n, "heads": args.heads, "head_dim": args.head_dim, "repeat": args.repeat,
           "environment": environment(), "figures": figures}
    if world.Get_rank() == 0:
        rows = [(f["seq"], f["ring_s"], f["gathered_s"], f["serial_s"], f["comm_s"],
                 "-" if f["hidden_fraction"] is None else f["hidden_fraction"],
                 f["ring_peak_mib"], f["gathered_peak_mib"]) for f in figures]
        emit(doc, args.out, table(
            ("seq", "ring s", "gathered s", "serial s", "comm s", "hidden", "ring MiB",
             "gathered MiB"), rows,
            title=f"causal attention forward + backward, (1, {args.heads}, S, "
                  f"{args.head_dim}) float32, {n} ranks (worst rank's median; peak MiB per "
                  f"rank)"))
    return doc


if __name__ == "__main__":
    main()
