"""Predicting one training step of the GPT of :mod:`launch.examples.gpt` under each strategy
of :mod:`launch.examples.gpt_strategies`, in one process, without data: per-rank peak
memory, the collectives' bytes by kind and the step time.

``predict(cfg, "fsdp", (64, 8), batch=512)`` answers for any mesh size (a 512-rank mesh in
one process); :func:`measure` runs the same step on the real mesh (**Collective**) for the
comparison (``launch/bench/gpt_predict.py``).

How a step is predicted
-----------------------
The GPT is built with metadata-only parameters (:func:`dtensor.nn.abstract_parameters`) and
one training step (forward, backward, ``AdamW.step()``; a first step before it makes the
optimizer's state) runs on :class:`~dtensor.AbstractDTensor` s: every op runs its sharding
decision and its backward formula without a kernel, and the abstract memory model counts
each block while a tensor (or a node of the graph) refers to it, as the allocator does
(:func:`dtensor.abstract_memory_stats`, the largest rank's: mesh coordinate 0). What the
strategies add is done as the implementations do it:

* ``dp`` (``Replicate()`` DTensor parameters, the batch ``Shard(0)``) is a DTensor program:
  it runs as it is on an :class:`~dtensor.AbstractMesh` of the data-parallel ranks, and its
  collectives are the dispatcher's own decisions (``CommDebugMode`` records them).
* Every other strategy runs each rank's local program (its share of the batch, on a 1-rank
  abstract mesh: the stand-in of local tensors) with hooks that reproduce the
  implementation's buffers and collectives:

  - ``fully_shard`` (``fsdp``, ``zero2``, ``fsdp_int``, ``hsdp``, the FSDP part of
    ``fsdp_tp``; :mod:`dtensor.parallel._fsdp`): per group (each block, then the root:
    the embeddings, the final norm and the tied head), the parameters are ``Shard(0)``
    leaves of the padded rows ``ceil(rows / n)``; before the group's forward, the packed
    shards (``flat`` elements), the group's unsharded buffer and the all-gather's receive
    buffer (``n x flat``), one all-gather of ``n x flat`` elements; the parameters the
    forward sees are views of the buffer (no memory of their own); after the forward the
    buffer is freed (ZeRO-3), kept (ZeRO-2, and the root), or a ``1/k`` piece kept and
    gathered again within ``k`` ranks; a node on the group's outputs gathers it again
    before its backward; when the group's gradients are complete, the reduce-scatter's
    send buffer (``n x flat`` in ``reduce_dtype``) and receive buffer (``flat``), one
    reduce-scatter (and an all-reduce of ``flat`` over HSDP's replicate dim), each
    parameter's sharded gradient, then the buffer is freed. Prefetch: a group's forward
    starts the next group's all-gather, a group's backward the previous one's (the order
    of the forward), as the implementation does; these all-gathers run beside the compute.
  - ``replicate`` (:mod:`dtensor.parallel._replicate`): the buckets of
    ``_bucket_plan`` (25 MiB, the first 1 MiB, in reverse parameter order); each bucket's
    all-reduce (its gradients and one count per parameter) starts when its last gradient
    is accumulated and runs beside the rest of the backward; the buckets are numpy arrays
    outside the allocator (``untracked_bytes``).
  - Tensor parallelism (``tp``, ``tp_sp``, the TP part of ``fsdp_tp``;
    :func:`launch.examples.gpt.tp_plan` on :mod:`dtensor.parallel._style`): the planned
    linears hold their local shards (colwise ``out / tp`` rows, rowwise ``in / tp``
    columns), so the attention runs ``n_head / tp`` heads; a rowwise output is all-reduced
    (a new buffer) in forward, a colwise input's gradient in backward, once per colwise
    linear. With sequence parallelism the residual stream and the norms hold ``S / tp``
    positions: an all-gather before the attention, the MLP and the final norm (a
    reduce-scatter of its gradient), a reduce-scatter after ``wo`` and ``proj`` (an
    all-gather of its gradient), an all-gather of the first block's input gradient, and an
    all-reduce of each sequence-parallel norm parameter's gradient.

Bytes per collective are what ``CommDebugMode`` records on the largest rank: the larger of
the buffers the rank passes in and gets out (the gathered output of an all-gather, the
input of a reduce-scatter, the block of an all-reduce).

Time: the traced entries priced as :func:`dtensor.autoshard.predict_step` prices them
(each op's kernel from the calibration's fitted throughput of its class on its local
blocks, ``Calibration.compute_scale``, ``entry_s``), the collectives by the calibration's
cost model (``alpha + traffic / beta`` per kind and mesh dim, plus ``sync_s``), on one
clock: blocking collectives add their time; FSDP's prefetched all-gathers and DDP's bucket
all-reduces run on a second lane (one at a time) from the point where they start, and the
compute waits for them only where the implementation waits (the group's forward or
backward, the end of backward). A flattened data-parallel mesh (all ranks of an
``(D, T)`` mesh) is priced with mesh dim 0's constants. ``fully_shard``'s own copies (its
shards packed, gathered parameters copied out, gradients packed for the reduce-scatter)
are priced at the calibration's ``copy_rate`` (the copy-out on the second lane with its
all-gather), and compute that runs beside a second-lane all-gather is slowed by the
calibration's ``overlap_slowdown`` (:func:`_fsdp_interference`).

Pipelines and context parallelism
---------------------------------
A pipelined strategy (:data:`PIPELINED`: ``pp``, ``pp_dp``, ``pp_fsdp``, ``pp_tp``,
``pp_fsdp_tp``) splits the blocks into ``p x v`` stages by ``pipeline_split``'s equal-cost
split (:func:`stage_layers`; the first stage embeds, the last holds the final norm and the
tied head, whose cost the split counts), stage ``s`` on pp rank ``s % p``, and runs the
inner strategy over the other mesh dims on each. Two traced steps of the inner strategy on
one micro-batch (``batch / n_data / m`` sequences per data-parallel replica), of GPTs of 1
and 2 blocks, give each quantity per block (the difference) and for the rest (embeddings,
final norm, head, loss): time to the end of the backward, the optimizer's time, the
parameters, gradients and optimizer state, the activations the forward leaves, the
collectives' bytes. A pp rank's figures are its blocks' plus the rest where it holds the
last stage (compute, activations) or the first or last (parameters: each holds a copy of
the tied embedding). The step: ``(m + p - 1) t`` for GPipe and 1F1B, ``(v m + p - 1) t / v``
interleaved, ``t`` the slowest rank's forward and backward of one micro-batch
(:func:`dtensor.pipelining.pipeline_seconds`; bubble ``(p - 1) / (m + p - 1)``,
``(p - 1) / (v m + p - 1)``), plus the point-to-point messages on the critical path (the
activation of the fill and the gradient of the drain: ``2 (p - 1)`` messages of ``mb x S x d``
elements at the calibration's ``p2p`` constants; the others run beside the compute), the
sum of the tied embedding's gradient between the first and the last stage, and the slowest
rank's optimizer step. The inner strategy's collectives run per micro-batch (its
gradients reduced in each backward, as the DTensor and FSDP implementations do). Peak
memory: the rank's model state, its activations times the micro-batches in flight
(:func:`dtensor.pipelining.in_flight`: ``m`` under GPipe, ``min(m, p - rank)`` under
1F1B), and the traces' transient buffers.

A context-parallel strategy (:data:`CONTEXT`: ``cp``, ``dp_cp``) runs ring attention over
the mesh's last dim (``c`` ranks; ``dp_cp`` data parallelism over the others), as
``launch/experiments/_gpt_pp.py`` runs it: one traced local step of a replica's sequences,
of ``S / c`` tokens each (each rank's tokens and activations are ``1 / c`` of a
sequence's), then each parameter's gradient all-reduced over every rank (one blocking
all-reduce per parameter), with the attention's kernels multiplied by
:func:`dtensor.pipelining.ring_factor` (causal, load balanced: ``1 + (c - 1) / 2`` blocks of
the trace's one), the ring's key/value blocks (``c - 1`` per layer in forward, twice that in
backward, at the ``p2p`` constants) beside the attention's compute (only what exceeds it
is exposed), and the position table's missing ``(S - S / c) x d`` rows with their
gradient and moments added to the memory.

Limits: kernels' internal scratch buffers, the allocator's rounding and its small requests
(below ``DTENSOR_POOL_MIN_BYTES``, which the allocator does not count) are not modelled;
a reshape that copies counts as a view (its input's block stays instead). Outputs that a
kernel has numpy allocate outside the pool (``masked_fill``'s; on the Python path also
``layer_norm``'s and others) are counted here but not by ``dt.memory_stats()``: there the
prediction lies above the allocator's figure (a few percent on the fast path, up to about
20 % on the Python path). Kernel-internal collectives (a class-sharded loss's all-reduces)
are counted in the bytes but not priced in the time.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

import dtensor as dt
from dtensor.autoshard import Calibration
from dtensor.autoshard._calibrate import op_class, op_work
from dtensor.dispatch import dispatcher as _dispatcher
from dtensor.local.dtypes import to_dtype
from dtensor.parallel._replicate import _bucket_plan, _reduce_dtype
from launch.examples.gpt import GPT, GPTConfig
from launch.examples.gpt import batch as make_batch
from launch.examples.gpt_strategies import STRATEGIES, build
from placements.errors import PipelineError
from redistribute.comm import notify
from redistribute.cost import WIDENED, default_cost_model, transfer_bytes, transfer_cost

__all__ = ["ALL_STRATEGIES", "CONFIGS", "CONTEXT", "PIPELINED", "SCHEDULES", "Layout",
           "StepPrediction", "layout", "measure", "predict", "stage_layers"]

#: Named sizes: the training example's (byte vocabulary, no biases) and GPT-2's.
CONFIGS = {
    "tiny": GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, d_model=64,
                      bias=False),
    "small": GPTConfig(vocab_size=256, block_size=256, n_layer=6, n_head=6, d_model=384,
                       bias=False),
    "gpt2-124m": GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12,
                           d_model=768, bias=True),
    "gpt-1.3b": GPTConfig(vocab_size=50257, block_size=2048, n_layer=24, n_head=16,
                          d_model=2048, bias=True),
}

_FSDP_RAF = {"fsdp": True, "zero2": False, "fsdp_int": 2, "fsdp_tp": True, "hsdp": True}
_LR, _WD = 1e-3, 0.1  # the AdamW of the training example (the values do not matter here)


# -- where a strategy runs ------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """How strategy ``name`` uses a mesh: ``ranks`` it runs on, ``n_data`` data-parallel
    replicas (each rank's batch is ``batch / n_data``), the FSDP shard group (``shard``
    ranks, on mesh dim ``shard_dim``), HSDP's replicate group (``rep`` ranks, ``rep_dim``;
    ``rep`` 0 without one), the tensor-parallel group (``tp`` ranks, ``tp_dim``)."""

    name: str
    mesh_shape: tuple[int, ...]
    ranks: int
    n_data: int
    shard: int = 1
    shard_dim: int = 0
    rep: int = 0
    rep_dim: int = 0
    tp: int = 1
    tp_dim: int = 0
    pp: int = 0
    cp: int = 0
    inner: str = ""
    inner_mesh: tuple[int, ...] = ()


#: Pipelined strategies: the name and the strategy each pipeline stage runs over the mesh
#: dims after the first (the ``pp`` dim): ``pp`` one rank per stage, ``pp_dp`` DTensor data
#: parallelism, ``pp_fsdp`` ``fully_shard``, ``pp_tp`` Megatron TP over the last dim,
#: ``pp_fsdp_tp`` FSDP over the middle and TP over the last dim of a 3-D mesh.
PIPELINED = {"pp": "local", "pp_dp": "dp", "pp_fsdp": "fsdp", "pp_tp": "tp",
             "pp_fsdp_tp": "fsdp_tp"}
#: Context-parallel strategies: ``cp`` (ring attention over the mesh's last dim, the whole
#: batch) and ``dp_cp`` (that, and data parallelism over the other dims).
CONTEXT = ("cp", "dp_cp")
#: Every strategy :func:`predict` prices.
ALL_STRATEGIES = (*STRATEGIES, *PIPELINED, *CONTEXT)
#: Pipeline schedules: GPipe, 1F1B (one stage per rank) and interleaved 1F1B (``v`` each).
SCHEDULES = ("gpipe", "1f1b", "interleaved")


def layout(name: str, mesh_shape: Sequence[int]) -> Layout:
    """The :class:`Layout` of strategy ``name`` on a mesh of ``mesh_shape``. **Local**.

    A 3-D mesh ``(P, D, T)`` runs the pipelined strategies of :data:`PIPELINED` with ``P``
    stages (on a 1-D or 2-D mesh the first dim is ``P``), the context-parallel ones of
    :data:`CONTEXT` with ring attention over ``T`` (``dp_cp``: data parallelism over the
    others), and every other strategy as on the 2-D mesh ``(P x D, T)``.

    A 1-D mesh ``(W,)`` runs every 1-D strategy on its ``W`` ranks (as
    :func:`launch.examples.gpt_strategies.build` at ``W`` ranks). A 2-D mesh ``(D, T)``
    (data-parallel x tensor-parallel, e.g. nodes x GPUs per node): ``dp``, ``replicate``,
    ``fsdp``, ``zero2`` and ``fsdp_int`` use all ``D x T`` ranks as one data-parallel
    group (priced as mesh dim 0); ``tp`` and ``tp_sp`` the ``T`` ranks of one node (the
    whole batch); ``fsdp_tp`` TP over ``T`` and FSDP over ``D``; ``hsdp`` shards over ``T``
    and replicates over ``D``; ``local`` one rank (the whole batch).

    Raises
    ------
    ValueError
        An unknown strategy, a mesh of more than 3 dims, ``fsdp_tp``/``hsdp`` on a 1-D
        mesh, ``pp_fsdp_tp`` on a mesh that is not 3-D, ``pp_dp``/``pp_fsdp``/``pp_tp``/
        ``dp_cp`` on a 1-D mesh, ``fsdp_int`` on a group that ``k = 2`` does not divide.
    """
    shape = tuple(int(s) for s in mesh_shape)
    if name not in ALL_STRATEGIES:
        raise ValueError(f"predict: unknown strategy {name!r}; choose from {ALL_STRATEGIES}")
    if not shape or len(shape) > 3 or min(shape) < 1:
        raise ValueError(f"predict: mesh shape {shape} must be 1-D, 2-D or 3-D of sizes >= 1")
    if name in PIPELINED:
        return _pipelined_layout(name, shape)
    if name in CONTEXT:
        c = shape[-1]
        if name == "dp_cp" and len(shape) < 2:
            raise ValueError(f"predict: dp_cp needs a mesh of 2 or 3 dims (.., dp, cp), got "
                             f"{shape}")
        d = math.prod(shape[:-1]) if name == "dp_cp" else 1
        return Layout(name, shape, d * c, d, cp=c, inner="dp", inner_mesh=(d * c,))
    if len(shape) == 3:  # (pp, dp, tp) without a pipeline: the first two dims data-parallel
        shape = (shape[0] * shape[1], shape[2])
    world = math.prod(shape)
    if name == "local":
        return Layout(name, shape, 1, 1)
    if name in ("fsdp_tp", "hsdp"):
        if len(shape) != 2:
            raise ValueError(f"predict: {name} needs a 2-D mesh (dp, tp), got {shape}")
        d, t = shape
        if name == "hsdp":
            return Layout(name, shape, world, world, shard=t, shard_dim=1, rep=d, rep_dim=0)
        return Layout(name, shape, world, d, shard=d, shard_dim=0, tp=t, tp_dim=1)
    if name in ("tp", "tp_sp"):
        t = shape[-1]
        return Layout(name, (t,), t, 1, tp=t, tp_dim=0)
    if name == "fsdp_int" and (world < 4 or world % 2):
        raise ValueError(f"predict: fsdp_int (reshard to 2 ranks) needs an even number of "
                         f">= 4 ranks, got {world}")
    shard = world if name in _FSDP_RAF else 1
    return Layout(name, (world,), world, world, shard=shard)


def _pipelined_layout(name: str, shape: tuple[int, ...]) -> Layout:
    """A pipelined strategy's layout: ``pp = shape[0]`` stages, each running
    ``PIPELINED[name]`` on ``inner_mesh`` (the other dims, see :data:`PIPELINED`); the
    group fields (``shard``, ``tp``...) are the inner strategy's, its mesh dims those of
    ``inner_mesh``."""
    inner = PIPELINED[name]
    rest = shape[1:]
    if inner == "local":
        inner_mesh: tuple[int, ...] = (1,)
    elif inner == "fsdp_tp":
        if len(shape) != 3:
            raise ValueError(f"predict: {name} needs a 3-D mesh (pp, dp, tp), got {shape}")
        inner_mesh = rest
    elif not rest:
        raise ValueError(f"predict: {name} needs a mesh of 2 or 3 dims (pp, ...), got {shape}")
    elif inner == "tp":
        inner_mesh = (rest[-1],)
    else:
        inner_mesh = (math.prod(rest),)
    lay = layout(inner, inner_mesh)
    return Layout(name, shape, shape[0] * lay.ranks, lay.n_data, lay.shard, lay.shard_dim,
                  lay.rep, lay.rep_dim, lay.tp, lay.tp_dim, pp=shape[0], inner=inner,
                  inner_mesh=inner_mesh)


# -- the result -----------------------------------------------------------------------------
@dataclass(frozen=True)
class StepPrediction:
    """The predicted figures of one training step on the largest rank.

    Memory (bytes): ``peak_bytes`` is what ``dt.memory_stats()["peak_allocated_bytes"]``
    would show over the step; ``params_bytes``, ``grads_bytes``, ``optimizer_bytes`` the
    rank's shards of the parameters, their gradients and AdamW's two moments (``state_bytes``
    their sum); ``activation_bytes`` what the forward leaves for the backward (the saved
    tensors, and the gathered parameters FSDP keeps); ``fsdp_buffer_bytes`` the most
    unsharded group buffers held at once (prefetch included); ``untracked_bytes`` memory
    outside the allocator (DDP's buckets); ``peak_phase`` where the peak falls.

    Communication: ``comm_bytes`` and ``comm_counts`` per collective kind (the bytes as
    ``CommDebugMode`` records them), ``comm_total_bytes``.

    Time (seconds): ``time_s`` the step; ``compute_s`` its kernels and per-entry costs;
    ``comm_s`` every collective's cost-model time; ``exposed_comm_s`` the part of it the
    step waits for (``time_s - compute_s``); ``flops`` the matmul-class work of the rank as
    the calibration prices it (``2 x output x K`` per product); ``ops_traced`` the entries
    of the traced step.
    """

    strategy: str
    mesh_shape: tuple[int, ...]
    ranks: int
    batch: int
    local_batch: int
    dtype: str
    peak_bytes: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    fsdp_buffer_bytes: int
    untracked_bytes: int
    peak_phase: str
    comm_bytes: dict[str, int]
    comm_counts: dict[str, int]
    time_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    flops: float
    ops_traced: int = 0
    pp: int = 1
    microbatches: int = 1
    schedule: str = ""
    stages_per_rank: int = 1
    stage_layers: tuple[int, ...] = ()
    bubble_fraction: float = 0.0
    bubble_s: float = 0.0
    p2p_bytes: int = 0
    cp: int = 1

    @property
    def state_bytes(self) -> int:
        """Parameters, gradients and optimizer state of the rank."""
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def comm_total_bytes(self) -> int:
        return sum(self.comm_bytes.values())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (and ``state_bytes``, ``comm_total_bytes``)."""
        d = asdict(self)
        d["mesh_shape"] = list(self.mesh_shape)
        d["stage_layers"] = list(self.stage_layers)
        d["state_bytes"] = self.state_bytes
        d["comm_total_bytes"] = self.comm_total_bytes
        return d


# -- the emulation's bookkeeping ---------------------------------------------------------------
_MESH1 = dt.AbstractMesh((1,))


class _Comm:
    """A stand-in communicator for :func:`redistribute.comm.notify` (what CommDebugMode
    reads of a collective's communicator)."""

    __slots__ = ("async_op", "mesh_dim", "size")

    def __init__(self, mesh_dim: int, size: int, async_op: bool = False) -> None:
        self.mesh_dim, self.size, self.async_op = mesh_dim, size, async_op


@dataclass
class _Event:
    """A collective of the emulation (or a wait for one) at a point of the traced program:
    ``pos`` dispatched ops ran before it."""

    what: str  # "sync", "async" (a second-lane start) or "wait"
    pos: int
    seconds: float = 0.0
    key: Any = None


class _Emulation:
    """The events, buffers and clock positions of one traced step."""

    def __init__(self, cost: Any, sync_s: float) -> None:
        self.cost, self.sync_s = cost, sync_s
        self.ops = 0
        self.events: list[_Event] = []
        self.buffers = 0  # bytes of FSDP group buffers held now
        self.buffers_max = 0
        self.untracked = 0
        self.cal: Calibration | None = None  # the calibration (FSDP's copies)
        self.end_of_backward: Callable[[], list] = list  # the keys the end of backward waits for
        # id of a parameter (leaf) -> the (size, mesh dim) of each mesh dim that shards it in
        # the real run: a sharded DTensor's norm is all-reduced over them (clip_grad_norm_)
        self.sharded: dict[int, list[tuple[int, int]]] = {}

    def listener(self, entry: Any, miss: bool, values: list, mesh: Any) -> None:
        self.ops += 1

    def comm(self, kind: str, nbytes: int, size: int, mesh_dim: int, lane: str = "sync",
             key: Any = None, moves: bool = False) -> None:
        """Report one collective to the observers (CommDebugMode) and to the clock.
        ``moves``: a redistribute's step, which a mesh dim of size 1 skips (the
        implementations' own collectives run on any communicator)."""
        if moves and size <= 1:
            return
        notify(kind, nbytes, _Comm(mesh_dim, size, lane == "async"))
        traffic = transfer_bytes(kind, size, nbytes, nbytes)
        seconds = transfer_cost(kind, mesh_dim, size, traffic, self.cost) + self.sync_s
        self.events.append(_Event(lane, self.ops, seconds, key))

    def wait(self, key: Any) -> None:
        self.events.append(_Event("wait", self.ops, 0.0, key))

    def hold(self, nbytes: int) -> None:
        self.buffers += nbytes
        self.buffers_max = max(self.buffers_max, self.buffers)


def _alloc(shape: Sequence[int] | int, dtype: Any) -> Any:
    """A block of the abstract memory model (a buffer of the emulated implementation)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return dt.abstract_tensor(shape, _MESH1, dtype=dtype)


def _view(shape: Sequence[int], dtype: Any) -> Any:
    """A tensor over memory counted elsewhere (a view of a buffer)."""
    return dt.abstract_tensor(tuple(shape), _MESH1, dtype=dtype, memory=False)


def _leaf(shape: Sequence[int], dtype: Any) -> Any:
    return dt.nn.Parameter(dt.abstract_tensor(tuple(shape), _MESH1, dtype=dtype,
                                              requires_grad=True))


def _nbytes(t: Any) -> int:
    return math.prod(t._local.shape) * np.dtype(t.dtype).itemsize


def _reduced_bytes(t: Any) -> int:
    """The bytes a reduction of ``t`` reports: bfloat16 reduces widened to float32."""
    dtype = np.dtype(t.dtype)
    return _nbytes(t) // dtype.itemsize * WIDENED.get(dtype, dtype).itemsize


# -- tensor parallelism: each rank's local program -------------------------------------------
class _Through(dt.autograd.Function):
    """Forward: ``fwd(x)``; backward: ``bwd(g)`` (the collectives of a TP hook)."""

    @staticmethod
    def forward(ctx: Any, x: Any, fwd: Callable, bwd: Callable) -> Any:
        ctx.bwd = bwd
        return fwd(x)

    @staticmethod
    def backward(ctx: Any, g: Any) -> tuple:
        return ctx.bwd(g), None, None


def _same(x: Any) -> Any:
    return x.detach()


class _TP:
    """The collectives of :func:`launch.examples.gpt.tp_plan` on the local program of one
    tensor-parallel rank (see the module docstring)."""

    def __init__(self, em: _Emulation, size: int, mesh_dim: int, sp: bool) -> None:
        self.em, self.k, self.dim, self.sp = em, size, mesh_dim, sp

    def all_reduce_fwd(self, x: Any) -> Any:  # P -> R of a rowwise output
        def fwd(y: Any) -> Any:
            out = _alloc(y.shape, y.dtype)
            self.em.comm("all_reduce", _reduced_bytes(y), self.k, self.dim, moves=True)
            return out
        return _Through.apply(x, fwd, _same)

    def all_reduce_bwd(self, x: Any) -> Any:  # a colwise input (or an SP norm parameter)
        def bwd(g: Any) -> Any:
            out = _alloc(g.shape, g.dtype)
            self.em.comm("all_reduce", _reduced_bytes(g), self.k, self.dim, moves=True)
            return out
        return _Through.apply(x, _same, bwd)

    def _gather(self, x: Any) -> Any:  # S(1) -> R: the full sequence, a new buffer
        b, s, d = x.shape
        out = _alloc((b, s * self.k, d), x.dtype)
        self.em.comm("all_gather", _nbytes(out), self.k, self.dim, moves=True)
        return out

    def _scatter(self, x: Any) -> Any:  # P -> S(1): a new buffer of the shard
        b, s, d = x.shape
        out = _alloc((b, s // self.k, d), x.dtype)
        self.em.comm("reduce_scatter", _reduced_bytes(x), self.k, self.dim, moves=True)
        return out

    def _chunk(self, x: Any) -> Any:  # R -> S(1) without communication: a view
        return x[:, : x.shape[1] // self.k]

    def gather_scatter(self, x: Any) -> Any:  # PrepareModuleInput S(1) -> R
        return _Through.apply(x, self._gather, self._scatter)

    def gather_chunk(self, x: Any) -> Any:  # ln_f's input S(1) -> R (local output)
        return _Through.apply(x, self._gather, self._chunk)

    def scatter_gather(self, x: Any) -> Any:  # rowwise output P -> S(1)
        return _Through.apply(x, self._scatter, self._gather)

    def chunk_gather(self, x: Any) -> Any:  # the first block's input R -> S(1)
        return _Through.apply(x, self._chunk, self._gather)


def _shard_linear(lin: Any, colwise: bool, tp: _TP) -> None:
    """A Linear's parameters replaced by this rank's shards (TP's local shapes)."""
    w, k = lin.weight, tp.k
    out_f, in_f = w.shape
    lin._parameters["weight"] = _leaf((out_f // k, in_f) if colwise else (out_f, in_f // k),
                                      w.dtype)
    tp.em.sharded[id(lin._parameters["weight"])] = [(k, tp.dim)]
    if lin._parameters.get("bias") is not None:
        lin._parameters["bias"] = _leaf((out_f // k,) if colwise else (out_f,), w.dtype)
        if colwise:
            tp.em.sharded[id(lin._parameters["bias"])] = [(k, tp.dim)]


def _parallelize(model: GPT, tp: _TP) -> None:
    """The local program of one TP rank: sharded linears and the hooks' collectives."""
    k, cfg = tp.k, model.cfg
    if cfg.n_head % k or cfg.d_model % k:
        raise ValueError(f"predict: tensor parallelism over {k} ranks needs n_head "
                         f"({cfg.n_head}) and d_model ({cfg.d_model}) divisible by {k}")
    if tp.sp and cfg.block_size % k:
        raise ValueError(f"predict: sequence parallelism over {k} ranks needs block_size "
                         f"({cfg.block_size}) divisible by {k}")
    for block in model.blocks:
        for lin in (block.attn.wq, block.attn.wk, block.attn.wv, block.mlp.fc):
            _shard_linear(lin, True, tp)
            if not tp.sp:
                lin.register_forward_pre_hook(lambda m, a: (tp.all_reduce_bwd(a[0]), *a[1:]))
        for lin in (block.attn.wo, block.mlp.proj):
            _shard_linear(lin, False, tp)
            lin.register_forward_hook(
                lambda m, a, out: tp.scatter_gather(out) if tp.sp else tp.all_reduce_fwd(out))
        if tp.sp:
            for sub in (block.attn, block.mlp):
                sub.register_forward_pre_hook(lambda m, a: (tp.gather_scatter(a[0]), *a[1:]))
            for norm in (block.ln1, block.ln2):
                _reduce_param_grads(norm, tp)
    if tp.sp:
        model.blocks[0].register_forward_pre_hook(lambda m, a: (tp.chunk_gather(a[0]), *a[1:]))
        model.ln_f.register_forward_pre_hook(lambda m, a: (tp.gather_chunk(a[0]), *a[1:]))


def _reduce_param_grads(module: Any, tp: _TP) -> None:
    """A sequence-parallel norm: its parameters' gradients (Partial) all-reduced to their
    Replicate layout."""
    names = [n for n, p in module._parameters.items() if p is not None]
    leaves = {}

    def pre(m: Any, args: tuple) -> None:
        for n in names:
            leaves[n] = m._parameters[n]
            m._parameters[n] = tp.all_reduce_bwd(leaves[n])

    def post(m: Any, args: tuple, out: Any) -> None:
        for n in names:
            m._parameters[n] = leaves[n]

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)


# -- fully_shard: groups, buffers, gathers and reduce-scatters --------------------------------
class _Param:
    __slots__ = ("chunk", "full_shape", "leaf", "local_shape", "numel", "slots")


class _Unshard(dt.autograd.Function):
    """The parameters a group's forward sees (views of its buffer); backward: the group's
    reduce-scatter (``_post_backward``)."""

    @staticmethod
    def forward(ctx: Any, group: Any, *leaves: Any) -> tuple:
        ctx.group = group
        return tuple(_view(p.full_shape, group.param_dtype) for p in group.params)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:
        return (None, *ctx.group.post_backward(grads))


class _PreBackward(dt.autograd.Function):
    """The node on a group's outputs: its backward gathers the group again (``_pre_backward``)."""

    @staticmethod
    def forward(ctx: Any, group: Any, x: Any) -> Any:
        ctx.group = group
        return x.detach()

    @staticmethod
    def backward(ctx: Any, g: Any) -> tuple:
        ctx.group.pre_backward()
        return None, g


class _FSDP:
    """What the groups under one root share: the forward order (prefetch), the clock."""

    def __init__(self, em: _Emulation) -> None:
        self.em = em
        self.order: list[_Group] = []


class _Group:
    """One ``fully_shard`` group of the local program (see the module docstring)."""

    def __init__(self, ctx: _FSDP, module: Any, params: list[_Param], n: int, dim: int,
                 rep: int, rep_dim: int, raf: bool | int, param_dtype: Any,
                 reduce_dtype: Any, root: bool) -> None:
        self.ctx, self.module, self.params = ctx, module, params
        self.n, self.dim, self.rep, self.rep_dim = n, dim, rep, rep_dim
        self.raf, self.root = raf, root
        self.param_dtype, self.reduce_dtype = np.dtype(param_dtype), np.dtype(reduce_dtype)
        self.flat = sum(p.chunk for p in params)
        self.total = sum(p.numel for p in params)
        self.buffer: Any = None
        self.stash: Any = None

    # the buffer
    def unshard(self, prefetch: bool = False) -> None:
        em = self.ctx.em
        if self.buffer is None and self.params:
            isz = self.param_dtype.itemsize
            if self.stash is not None:  # gathered again within k ranks from the 1/k pieces
                k, c = self.raf, self.stash.shape[0]
                self.buffer = _alloc(self.total, self.param_dtype)
                recv = _alloc(k * c, self.param_dtype)
                em.comm("all_gather", k * c * isz, k, self.dim, "async", self)
                _fsdp_copies(em, out_bytes=self.total * isz)
                del recv
                self.stash = None
            else:
                send = _alloc(self.flat, self.param_dtype)
                self.buffer = _alloc(self.total, self.param_dtype)
                recv = _alloc(self.n * self.flat, self.param_dtype)
                em.comm("all_gather", self.n * self.flat * isz, self.n, self.dim, "async", self)
                _fsdp_copies(em, inline_bytes=self.flat * isz, out_bytes=self.total * isz)
                del recv, send
            em.hold(self.total * isz)
        if not prefetch:
            em.wait(self)

    def reshard(self, keep: bool = False) -> None:
        if self.buffer is None:
            return
        if keep:
            k = self.raf
            self.stash = _alloc(-(-self.total // k), self.param_dtype)
            _fsdp_copies(self.ctx.em, inline_bytes=self.stash.shape[0] * self.param_dtype.itemsize)
        self.buffer = None
        self.ctx.em.buffers -= self.total * self.param_dtype.itemsize

    # the hooks
    def pre_forward(self, module: Any, args: tuple) -> None:
        self.unshard()
        order = self.ctx.order
        i = order.index(self)
        if i + 1 < len(order):
            order[i + 1].unshard(prefetch=True)
        views = _Unshard.apply(self, *[p.leaf for p in self.params])
        for p, v in zip(self.params, views):
            for owner, name in p.slots:
                owner._parameters[name] = v

    def post_forward(self, module: Any, args: tuple, out: Any) -> Any:
        for p in self.params:
            for owner, name in p.slots:
                owner._parameters[name] = p.leaf
        if not self.root:
            if self.raf is True:
                self.reshard()
            elif self.raf is not False and self.raf > 1:
                self.reshard(keep=True)
        return _PreBackward.apply(self, out)

    def pre_backward(self) -> None:
        self.unshard()
        order = self.ctx.order
        i = order.index(self) - 1
        if i >= 0:
            order[i].unshard(prefetch=True)

    def post_backward(self, grads: Sequence[Any]) -> list:
        em = self.ctx.em
        rsz = self.reduce_dtype.itemsize
        send = _alloc(self.n * self.flat, self.reduce_dtype)
        recv = _alloc(self.flat, self.reduce_dtype)
        em.comm("reduce_scatter", self.n * self.flat * rsz, self.n, self.dim)
        _fsdp_copies(em, inline_bytes=(self.n + 1) * self.flat * rsz)  # pack, shards out
        if self.rep:  # HSDP: over the replicate dim
            em.comm("all_reduce", self.flat * rsz, self.rep, self.rep_dim)
        out = [_alloc(p.local_shape, p.leaf.dtype) for p in self.params]
        del send, recv
        self.reshard()
        return out


# -- fully_shard's work beside its collectives ----------------------------------------------
def _fsdp_copies(em: _Emulation, inline_bytes: int = 0, out_bytes: int = 0) -> None:
    """The memory copies of :mod:`dtensor.parallel._fsdp` around a collective just reported
    to ``em``, priced at the calibration's ``copy_rate`` (bytes read + written, so twice
    the bytes copied; measured on copies of tens of MiB, out of the caches as these are, so
    the kernels' ``compute_scale`` is not applied): ``inline_bytes`` copied in the caller's thread (the shards packed for an
    all-gather, the gradients packed for the reduce-scatter and their shards copied out, a
    ``1/k`` piece kept), a blocking step of the clock; ``out_bytes`` copied out of the
    all-gather's receive buffer into the group's buffer by the job that ran the all-gather
    (on the second lane with it)."""
    cal = em.cal
    if cal is None:
        return
    scale = 1.0 / cal.copy_rate
    if out_bytes:
        em.events[-1].seconds += 2 * out_bytes * scale
    if inline_bytes:
        em.events.append(_Event("sync", em.ops, 2 * inline_bytes * scale))


def _fsdp_interference(events: Sequence[_Event], cal: Calibration, overlap: bool) -> float:
    """Seconds the compute of a ``fully_shard`` step loses to the all-gathers that run
    beside it: with ``overlap`` (the second lane beside the compute), each second-lane
    collective's seconds times ``overlap_slowdown - 1`` (the compute that runs meanwhile
    is that much slower: the gather's copies, MPI's progress loop and their memory traffic
    share the core and its caches; measured by ``dt.autoshard.calibrate``); without it the
    collectives already take the clock in line, and nothing is added."""
    if not overlap or cal.overlap_slowdown <= 1.0:
        return 0.0
    busy = sum(e.seconds for e in events if e.what == "async")
    return (cal.overlap_slowdown - 1.0) * busy


def _fully_shard(ctx: _FSDP, module: Any, managed: set, n: int, dim: int, rep: int,
                 rep_dim: int, raf: bool | int, param_dtype: Any, reduce_dtype: Any,
                 root: bool) -> _Group:
    """One group: the parameters of ``module`` no group below manages, in the order
    ``fully_shard`` finds them, replaced by their sharded leaves; the module's hooks."""
    found: dict[int, _Param] = {}
    params: list[_Param] = []
    for _, sub in module.named_modules():
        for pname, t in sub._parameters.items():
            if t is None or id(t) in managed:
                continue
            if id(t) in found:
                found[id(t)].slots.append((sub, pname))
                continue
            p = _Param()
            p.slots = [(sub, pname)]
            p.full_shape = tuple(t.shape)
            rows = p.full_shape[0]
            rest = math.prod(p.full_shape[1:])
            padded = -(-rows // n)
            p.chunk = padded * rest
            p.numel = rows * rest
            p.local_shape = (min(padded, rows), *p.full_shape[1:])
            p.leaf = _leaf(p.local_shape, t.dtype)
            ctx.em.sharded[id(p.leaf)] = [(n, dim), *ctx.em.sharded.get(id(t), [])]
            found[id(t)] = p
            params.append(p)
    for p in params:
        managed.add(id(p.leaf))
        for owner, pname in p.slots:
            managed.add(id(owner._parameters[pname]))
            owner._parameters[pname] = p.leaf
    group = _Group(ctx, module, params, n, dim, rep, rep_dim, raf,
                   param_dtype or params[0].leaf.dtype, reduce_dtype or param_dtype
                   or params[0].leaf.dtype, root)
    module.register_forward_pre_hook(group.pre_forward)
    module.register_forward_hook(group.post_forward)
    return group


def _shard_model(model: GPT, em: _Emulation, lay: Layout, param_dtype: Any,
                 reduce_dtype: Any) -> list:
    """``fully_shard`` on every block, then on the root (as ``gpt_strategies`` does)."""
    ctx = _FSDP(em)
    raf = _FSDP_RAF[lay.name]
    managed: set = set()
    blocks = [_fully_shard(ctx, b, managed, lay.shard, lay.shard_dim, lay.rep, lay.rep_dim,
                           raf, param_dtype, reduce_dtype, False) for b in model.blocks]
    root = _fully_shard(ctx, model, managed, lay.shard, lay.shard_dim, lay.rep, lay.rep_dim,
                        raf, param_dtype, reduce_dtype, True)
    ctx.order = [root, *blocks]  # the forward's order: the root's hook runs first
    return [p.leaf for g in ctx.order for p in g.params]


# -- replicate: the gradient buckets ---------------------------------------------------------
def _replicate(model: GPT, em: _Emulation, lay: Layout) -> None:
    """DDP's buckets: each one's all-reduce starts once its last gradient is accumulated
    (and every earlier bucket has started); the end of backward waits for all."""
    params = [p for _, p in model.named_parameters()]
    plan = _bucket_plan(params, 25 * 2**20, 2**20)
    where, sizes = {}, []
    for k, members in enumerate(plan):
        isz = _reduce_dtype(params[members[0]].dtype).itemsize  # bfloat16 sums in float32
        sizes.append((sum(params[i].numel() for i in members) + len(members)) * isz)
        for i in members:
            where[id(params[i])] = k
    em.untracked = sum(sizes)
    state: dict[str, Any] = {}

    def reset() -> None:
        state["left"] = [len(m) for m in plan]
        state["next"] = 0
        state["ready"] = set()

    def hook(p: Any) -> None:
        if id(p) in state["ready"]:
            return
        state["ready"].add(id(p))
        state["left"][where[id(p)]] -= 1
        while state["next"] < len(plan) and state["left"][state["next"]] == 0:
            b = state["next"]
            em.comm("all_reduce", sizes[b], lay.ranks, 0, "async", ("bucket", b))
            state["next"] += 1

    def end() -> list:
        reset()
        return [("bucket", b) for b in range(len(plan))]

    reset()
    for p in params:
        p.register_post_accumulate_grad_hook(hook)
    em.end_of_backward = end


# -- one traced step -------------------------------------------------------------------------
def _build(cfg: GPTConfig, name: str, lay: Layout, dtype: Any, em: _Emulation, batch: int,
           b: int) -> tuple:
    """The model of one rank's program, the optimizer's parameters and the inputs."""
    if name == "dp":
        mesh = dt.AbstractMesh((lay.ranks,))
        with dt.nn.abstract_parameters(mesh):
            model = GPT(cfg)
        if dtype is not None:
            model.to(dtype)
        shape = (batch, cfg.block_size)
        inputs = tuple(dt.abstract_tensor(shape, mesh, [dt.Shard(0)], dtype="int64")
                       for _ in range(2))
        return model, list(model.parameters()), inputs
    with dt.nn.abstract_parameters():
        model = GPT(cfg)
    fsdp = name in _FSDP_RAF
    if dtype is not None and not fsdp:
        model.to(dtype)
    if lay.tp > 1:
        _parallelize(model, _TP(em, lay.tp, lay.tp_dim, name == "tp_sp"))
    inputs = tuple(dt.abstract_tensor((b, cfg.block_size), _MESH1, dtype="int64")
                   for _ in range(2))
    if fsdp:
        leaves = _shard_model(model, em, lay, dtype, "float32" if dtype is not None else None)
        return model, leaves, inputs
    if name == "replicate":
        _replicate(model, em, lay)
    return model, list(model.parameters()), inputs


def _local_batch(name: str, lay: Layout, batch: int) -> int:
    if batch % lay.n_data:
        raise ValueError(f"predict: {name}: a batch of {batch} does not split over "
                         f"{lay.n_data} data-parallel ranks")
    return batch // lay.n_data


def _simulate(ops: Sequence[Any], events: list[_Event], cal: Calibration, cost: Any,
              group_size: int, overlap: bool = True, split_at: int | None = None,
              extras: dict[str, float] | None = None) -> tuple[float, float, float, float]:
    """(time, compute, all comm, matmul flops) of a traced step: entries and events on one
    clock, the second lane's collectives waited for where the program waits (without
    ``overlap``, they take the clock where they start, as blocking ones do).

    ``extras`` (a dict, filled): ``fb_s`` and ``fb_compute_s``, the clock and the compute
    before entry ``split_at`` (the end of the backward: a pipeline stage's work per
    micro-batch), and ``attn_s``, the seconds of the attention kernels (forward and
    backward), which ring attention multiplies."""
    clock = compute = comm = flops = 0.0
    marks = {"fb_s": None, "fb_compute_s": None, "attn_s": 0.0}
    lane_free = 0.0
    done: dict[Any, float] = {}
    ev = sorted(range(len(events)), key=lambda i: (events[i].pos, i))
    j = 0
    count = 0

    def run_events(upto: int) -> None:
        nonlocal j, clock, lane_free, comm
        while j < len(ev) and events[ev[j]].pos <= upto:
            e = events[ev[j]]
            j += 1
            if e.what == "async" and not overlap:
                clock += e.seconds
                comm += e.seconds
                done[e.key] = clock
            elif e.what == "async":
                start = max(clock, lane_free)
                lane_free = start + e.seconds
                done[e.key] = lane_free
                comm += e.seconds
            elif e.what == "wait":
                clock = max(clock, done.pop(e.key, clock))
            else:
                clock += e.seconds
                comm += e.seconds

    for o in ops:
        if o.op != "redistribute":
            run_events(count)
            if count == split_at:
                marks["fb_s"], marks["fb_compute_s"] = clock, compute
            count += 1
            alpha, work = cal.kernel_terms(o.op, o.local_inputs, o.local_outputs)
            seconds = alpha + cal.compute_scale * work + cal.entry_s
            compute += seconds
            clock += seconds
            if "attention" in o.op:
                marks["attn_s"] += seconds
            if op_class(o.op) == "matmul":
                flops += op_work(o.op, o.local_inputs, o.local_outputs)
        for c in o.collectives:
            if c.communicates and group_size > 1:
                traffic = transfer_bytes(c.kind, group_size, c.nbytes, c.nbytes)
                seconds = transfer_cost(c.kind, c.mesh_dim, group_size, traffic, cost)
                seconds += cal.sync_s
                clock += seconds
                comm += seconds
    run_events(count + len(events))
    for t in done.values():  # the end of the step waits for whatever is in flight
        clock = max(clock, t)
    if extras is not None:
        extras.update({k: (clock if v is None and k == "fb_s" else
                           compute if v is None else v) for k, v in marks.items()})
    return clock, compute, comm, flops


def _clip(leaves: Sequence[Any], em: _Emulation) -> None:
    """``clip_grad_norm_`` on the abstract gradients (its norm is a number the abstract step
    has not): each gradient's ``|g|^2`` summed, and for a gradient that is a sharded DTensor
    in the real run, the all-reduce of that float64 sum over each mesh dim that shards it
    (one blocking collective per gradient and dim); then each gradient scaled, as when the
    norm exceeds the limit."""
    grads = [(p, p.grad) for p in leaves if p.grad is not None]
    with dt.no_grad():
        for p, g in grads:
            a = g.detach().abs()
            (a * a).sum(dtype=np.float64)
            for size, dim in em.sharded.get(id(p), []):
                em.comm("all_reduce", 8, size, dim, moves=True)
        for _, g in grads:
            g.mul_(0.5)


def predict(cfg: GPTConfig, strategy: str, mesh_shape: Sequence[int], batch: int,
            dtype: Any = None, calibration: Calibration | None = None,
            optimizer: Callable[[list], Any] | None = None,
            clip: float | None = None, overlap: bool = True, *,
            microbatches: int | None = None, schedule: str = "1f1b",
            stages_per_rank: int = 1) -> StepPrediction:
    """Predict one training step (forward, backward, ``AdamW.step()``) of ``GPT(cfg)`` laid
    out as ``strategy`` on a mesh of ``mesh_shape`` (see :func:`layout`), for a global
    batch of ``batch`` sequences. **Local**: one process, no data, any mesh size.

    Parameters
    ----------
    cfg : GPTConfig
    strategy : str
        One of :data:`ALL_STRATEGIES`: those of
        :data:`launch.examples.gpt_strategies.STRATEGIES`, the pipelined ones of
        :data:`PIPELINED` and the context-parallel ones of :data:`CONTEXT` (see
        :func:`layout` and the section *Pipelines and context parallelism*).
    mesh_shape : sequence of int
        ``(W,)``, ``(D, T)`` or ``(P, D, T)``.
    batch : int
        Global batch in sequences (each data-parallel rank gets ``batch / n_data``).
    dtype : dtype, optional
        The compute dtype (``dt.bfloat16``): the parameters' dtype, or under FSDP the
        gather and compute dtype of a ``MixedPrecisionPolicy`` with float32 master weights
        and reductions (as :func:`launch.examples.gpt_strategies.build`).
    calibration : Calibration, optional
        Kernel throughputs and the collective cost model (default: built-in constants and
        the dispatcher's cost model).
    optimizer : callable, optional
        ``optimizer(parameters)``: the optimizer of the step (default: ``AdamW``, the
        training example's); its state's DTensors are ``optimizer_bytes``.
    clip : float, optional
        ``clip_grad_norm_(parameters, clip)`` before the optimizer's step: its kernels, and
        the all-reduce of the norm of each gradient that is a sharded DTensor in the real
        run (FSDP's, TP's sharded weights), as ``clip_grad_norm_`` reduces them one by one.
    overlap : bool
        Whether the second lane (FSDP's prefetched all-gathers, DDP's buckets) runs beside
        the compute. Those collectives progress in a worker thread (or in the caller's MPI
        calls), which needs a core of its own: where each rank has one core (or less), pass
        False and they take the step's clock where they start.

    microbatches : int, optional
        A pipelined strategy's micro-batch count ``m`` (default: the pipeline degree); it
        must divide the batch of a data-parallel replica.
    schedule : str
        A pipelined strategy's schedule, one of :data:`SCHEDULES`.
    stages_per_rank : int
        ``v``, stages per pp rank of the ``"interleaved"`` schedule (1 otherwise).

    Returns
    -------
    StepPrediction

    Raises
    ------
    ValueError
        A strategy that does not run on the mesh (:func:`layout`), a batch that does not
        split over the data-parallel ranks, sizes that tensor parallelism cannot split.
    """
    lay = layout(strategy, mesh_shape)
    cal = calibration or Calibration()
    dtype = None if dtype is None else to_dtype(dtype)
    if lay.pp:
        return _predict_pipelined(cfg, lay, int(batch), dtype, cal, optimizer, clip, overlap,
                                  microbatches, schedule, stages_per_rank)
    if microbatches not in (None, 1) or stages_per_rank != 1:
        raise ValueError(f"predict: {strategy} is not pipelined: microbatches="
                         f"{microbatches}, stages_per_rank={stages_per_rank} need a pp strategy")
    if lay.cp:
        return _predict_context(cfg, lay, int(batch), dtype, cal, optimizer, clip, overlap)
    return _traced(cfg, lay, int(batch), dtype, cal, optimizer, clip, overlap)[0]


def _traced(cfg: GPTConfig, lay: Layout, batch: int, dtype: Any, cal: Calibration,
            optimizer: Callable[[list], Any] | None, clip: float | None, overlap: bool
            ) -> tuple[StepPrediction, dict[str, float]]:
    """The traced step of a data/tensor strategy (:func:`predict`'s work), with the extras
    of :func:`_simulate` (the end of the backward, the attention's seconds)."""
    strategy = lay.name
    gc.collect()  # the blocks of earlier traces (in reference cycles) go first
    base = dt.abstract_memory_stats()["live_bytes"]
    cost = cal.model() if cal.cost_model else default_cost_model()
    em = _Emulation(cost, cal.sync_s)
    em.cal = cal  # FSDP's copies (_fsdp_copies)
    local_batch = _local_batch(strategy, lay, batch)
    model, leaves, (idx, tgt) = _build(cfg, strategy, lay, dtype, em, int(batch), local_batch)
    opt = (optimizer(leaves) if optimizer is not None
           else dt.optim.AdamW(leaves, lr=_LR, weight_decay=_WD))
    marks: dict[str, dict] = {}

    def step() -> None:
        loss = model(idx, tgt)
        marks["forward"] = dt.abstract_memory_stats()
        loss.backward()
        del loss
        marks["backward"] = dt.abstract_memory_stats()
        for key in em.end_of_backward():
            em.wait(key)
        marks["split"] = em.ops  # the optimizer's entries begin here
        if clip is not None:
            _clip(leaves, em)
        opt.step()
        opt.zero_grad()

    step()  # the optimizer's state (and warm caches)
    em.events.clear()
    em.buffers_max = em.buffers
    start = dt.abstract_memory_stats()["live_bytes"]
    dt.reset_abstract_peak()
    em.ops = 0
    _dispatcher.add_listener(em.listener)
    try:
        with dt.debug.CommDebugMode() as mode:
            expl = dt.debug.explain(step, top=0)
    finally:
        _dispatcher.remove_listener(em.listener)
    peak = dt.abstract_memory_stats()["peak_bytes"] - base
    fwd, bwd = marks["forward"], marks["backward"]
    phase = "forward" if fwd["peak_bytes"] - base >= peak else (
        "backward" if bwd["peak_bytes"] - base >= peak else "optimizer")
    params = sum(_nbytes(p) for p in leaves)
    state = sum(_nbytes(v) for s in opt.state.values() for v in s.values()
                if isinstance(v, dt.DTensor))
    counts: dict[str, int] = {}
    nbytes: dict[str, int] = {}
    for r in mode.records:
        counts[r.kind] = counts.get(r.kind, 0) + 1
        nbytes[r.kind] = nbytes.get(r.kind, 0) + r.nbytes
    group = lay.ranks if strategy == "dp" else 1
    extras: dict[str, float] = {}
    time_s, compute_s, comm_s, flops = _simulate(expl.ops, em.events, cal, cost, group,
                                                 overlap, marks["split"], extras)
    if strategy in _FSDP_RAF:
        time_s += _fsdp_interference(em.events, cal, overlap)
    return StepPrediction(
        strategy, lay.mesh_shape, lay.ranks, int(batch), local_batch,
        str(np.dtype(dtype)) if dtype is not None else "float32", int(peak), params, params,
        state, int(fwd["live_bytes"] - start), em.buffers_max, em.untracked, phase,
        nbytes, counts, time_s, compute_s, comm_s, time_s - compute_s, flops,
        len(expl.ops)), extras


# -- pipelines and context parallelism ---------------------------------------------------------
@functools.lru_cache(maxsize=64)
def stage_layers(cfg: GPTConfig, n_stages: int) -> tuple[int, ...]:
    """The blocks of each stage of ``pipeline_split``'s equal-cost split of ``GPT(cfg)`` into
    ``n_stages`` (the first stage also embeds, the last holds the final norm and the tied
    head, which the split counts). **Local**.

    Raises
    ------
    ValueError
        More stages than blocks.
    """
    with dt.nn.abstract_parameters():
        model = GPT(cfg)
    try:
        return tuple(dt.pipelining.stage_shares(model, n_stages)[2])
    except PipelineError as e:
        raise ValueError(f"predict: {e}") from None


def _p2p(cal: Calibration, cost: Any) -> tuple[float, float]:
    """The point-to-point ``(alpha_s, beta_bytes_per_s)``: the calibration's, else the cost
    model's defaults."""
    if cal.p2p:
        return float(cal.p2p["alpha_s"]), float(cal.p2p["beta_bytes_per_s"])
    return float(cost.alpha_s), float(cost.beta_bytes_per_s)


def _linear(a: float, b: float, layers: int, base: bool) -> float:
    """``x(layers)`` of a quantity traced at 1 (``a``) and 2 (``b``) blocks: ``b - a`` per
    block, ``2a - b`` (the embeddings, final norm, head and loss) where ``base``."""
    return max(0.0, layers * (b - a) + (2 * a - b if base else 0.0))


def _predict_pipelined(cfg: GPTConfig, lay: Layout, batch: int, dtype: Any, cal: Calibration,
                       optimizer: Any, clip: float | None, overlap: bool, m: int | None,
                       schedule: str, v: int) -> StepPrediction:
    """A pipelined strategy (see the module docstring, *Pipelines and context
    parallelism*)."""
    p, name = lay.pp, lay.name
    m = p if m is None else int(m)
    per_replica = _local_batch(name, lay, batch)
    try:
        frac = dt.pipelining.bubble(schedule, p, m, v)
    except PipelineError as e:
        raise ValueError(f"predict: {name}: {e}") from None
    if per_replica % m:
        raise ValueError(f"predict: {name}: {m} micro-batches do not split the {per_replica} "
                         f"sequences of a data-parallel replica (batch {batch} over "
                         f"{lay.n_data})")
    mb = per_replica // m
    layers = stage_layers(cfg, p * v)
    runs = [_traced(dataclasses.replace(cfg, n_layer=k), layout(lay.inner, lay.inner_mesh),
                    mb * lay.n_data, dtype, cal, optimizer, clip, overlap) for k in (1, 2)]
    (one, x1), (two, x2) = runs
    isz = np.dtype(dtype).itemsize if dtype is not None else 4

    def q(pred: StepPrediction, ex: dict) -> dict[str, float]:
        return {"fb": ex["fb_s"], "fbc": ex["fb_compute_s"], "opt": pred.time_s - ex["fb_s"],
                "state": pred.state_bytes, "params": pred.params_bytes,
                "opt_bytes": pred.optimizer_bytes, "act": pred.activation_bytes,
                "flops": pred.flops, "untracked": pred.untracked_bytes,
                **{f"b:{k}": v for k, v in pred.comm_bytes.items()},
                **{f"n:{k}": v for k, v in pred.comm_counts.items()}}

    a, b = q(one, x1), q(two, x2)
    keys = set(a) | set(b)
    last = p * v - 1
    ranks = []
    for r in range(p):
        chunks = range(r, p * v, p)
        n = sum(layers[c] for c in chunks)
        ends = 0 in chunks or last in chunks
        ranks.append({k: _linear(a.get(k, 0.0), b.get(k, 0.0), n,
                                 last in chunks if k in ("fb", "fbc", "act", "flops")
                                 else ends) for k in keys})
    transient = max(0.0, *(t.peak_bytes - t.state_bytes - t.activation_bytes
                           for t in (one, two)))
    peaks = [x["state"] + x["act"] * dt.pipelining.in_flight(schedule, p, m, r, v) + transient
             for r, x in enumerate(ranks)]
    worst = max(range(p), key=lambda r: peaks[r])
    stage_s = max(x["fb"] for x in ranks)
    pipe_s, bubble_s = dt.pipelining.pipeline_seconds(stage_s, schedule, p, m, v)
    cost = cal.model() if cal.cost_model else default_cost_model()
    alpha, beta = _p2p(cal, cost)
    boundary = mb * cfg.block_size * cfg.d_model * isz
    # the tied embedding's gradient (float32 master weights under FSDP), summed between the
    # first and the last stage
    tie = cfg.vocab_size * cfg.d_model * (4 if lay.inner in _FSDP_RAF else isz) // lay.shard
    sends = [m * boundary * sum((c < last) + (c > 0) for c in range(r, p * v, p))
             + (tie if p > 1 and r in (0, p - 1) else 0) for r in range(p)]
    p2p_s = (2 * (p - 1) * (alpha + boundary / beta)
             + (alpha + tie / beta if p > 1 else 0.0))  # the fill, the drain, the tied head
    opt_s = max(x["opt"] for x in ranks)
    time_s = pipe_s + p2p_s + opt_s
    compute_s = m * max(x["fbc"] for x in ranks) + opt_s
    w = ranks[worst]
    kinds = {k[2:]: int(m * w[k]) for k in keys if k.startswith("b:") and w[k] > 0}
    counts = {k[2:]: round(m * w[k]) for k in keys if k.startswith("n:") and w[k] > 0}
    if p > 1:
        kinds["p2p"] = int(max(sends))
        counts["p2p"] = 2 * m * v
    comm_s = time_s - compute_s - bubble_s
    return StepPrediction(
        name, lay.mesh_shape, lay.ranks, batch, per_replica,
        str(np.dtype(dtype)) if dtype is not None else "float32", int(peaks[worst]),
        int(w["params"]), int(w["params"]), int(w["opt_bytes"]),
        int(w["act"] * dt.pipelining.in_flight(schedule, p, m, worst, v)),
        two.fsdp_buffer_bytes, int(w["untracked"]), "pipeline", kinds, counts, time_s,
        compute_s, max(comm_s, 0.0), max(comm_s, 0.0), m * w["flops"],
        one.ops_traced + two.ops_traced, pp=p, microbatches=m, schedule=schedule,
        stages_per_rank=v, stage_layers=layers, bubble_fraction=frac, bubble_s=bubble_s,
        p2p_bytes=int(max(sends)) if p > 1 else 0)


def _predict_context(cfg: GPTConfig, lay: Layout, batch: int, dtype: Any, cal: Calibration,
                     optimizer: Any, clip: float | None, overlap: bool) -> StepPrediction:
    """A context-parallel strategy (see the module docstring, *Pipelines and context
    parallelism*)."""
    c, name, seq = lay.cp, lay.name, cfg.block_size
    if seq % (2 * c):
        raise ValueError(f"predict: {name}: a sequence of {seq} does not split into 2 x {c} "
                         f"load-balanced chunks")
    per_replica = _local_batch(name, lay, batch)
    sub = dataclasses.replace(cfg, block_size=seq // c)
    pred, ex = _traced(sub, layout("local", (1,)), per_replica, dtype, cal, optimizer, clip,
                       overlap)
    cost = cal.model() if cal.cost_model else default_cost_model()
    # every rank's parameter gradients summed over all ranks, one all-reduce each
    with dt.nn.abstract_parameters():
        sizes = [p.numel() * np.dtype(p.dtype).itemsize
                 for p in GPT(cfg).parameters()]
    reduce_s = reduce_b = 0.0
    if lay.ranks > 1:
        for nbytes in sizes:
            reduce_b += nbytes
            traffic = transfer_bytes("all_reduce", lay.ranks, nbytes, nbytes)
            reduce_s += transfer_cost("all_reduce", 0, lay.ranks, traffic, cost) + cal.sync_s
    isz = np.dtype(dtype).itemsize if dtype is not None else 4
    factor = dt.pipelining.ring_factor(c, causal=True)
    attn = ex["attn_s"] * factor  # the trace's one (S / c)^2 block per sequence, and the ring's
    alpha, beta = _p2p(cal, cost)
    kv = 2 * per_replica * (seq // c) * cfg.d_model * isz  # one key block and value block
    ring_s = cfg.n_layer * 3 * (c - 1) * (alpha + kv / beta)
    exposed = max(0.0, ring_s - attn) if c > 1 else 0.0
    p2p = cfg.n_layer * 3 * (c - 1) * kv
    # the trace's position table holds S / c rows: the rest, with its gradient and moments
    wpe = (seq - seq // c) * cfg.d_model * 4
    time_s = pred.time_s + attn - ex["attn_s"] + exposed + reduce_s
    kinds = dict(pred.comm_bytes)
    counts = dict(pred.comm_counts)
    if reduce_b:
        kinds["all_reduce"] = kinds.get("all_reduce", 0) + int(reduce_b)
        counts["all_reduce"] = counts.get("all_reduce", 0) + len(sizes)
    if c > 1:
        kinds["p2p"] = p2p
        counts["p2p"] = cfg.n_layer * 3 * (c - 1)
    return dataclasses.replace(
        pred, strategy=name, mesh_shape=lay.mesh_shape, ranks=lay.ranks, batch=batch,
        local_batch=per_replica, peak_bytes=pred.peak_bytes + 4 * wpe,
        params_bytes=pred.params_bytes + wpe, grads_bytes=pred.grads_bytes + wpe,
        optimizer_bytes=pred.optimizer_bytes + 2 * wpe, comm_bytes=kinds, comm_counts=counts,
        time_s=time_s, compute_s=pred.compute_s + attn - ex["attn_s"],
        comm_s=pred.comm_s + ring_s + reduce_s, exposed_comm_s=time_s - pred.compute_s - attn
        + ex["attn_s"], p2p_bytes=p2p, cp=c)


# -- the real step, for the comparison ---------------------------------------------------------
def measure(cfg: GPTConfig, strategy: str, batch: int, dtype: Any = None,
            seed: int = 0) -> dict[str, Any]:
    """Run the step :func:`predict` predicts on this job's ranks and measure it.
    **Collective** (every rank of ``COMM_WORLD``).

    Builds ``strategy`` (:func:`launch.examples.gpt_strategies.build`), runs two warm-up
    steps (the optimizer's state; FSDP's forward order), one step under
    ``CommDebugMode`` (the collectives of rank 0, mesh coordinate 0) and one without it
    (the peak: ``dt.memory_stats()["peak_allocated_bytes"]`` from the step's start, the
    largest over ranks; the model state: ``allocated_bytes`` after ``optimizer.step()``,
    parameters, gradients and AdamW's moments, largest over ranks). Both count from the
    bytes allocated before the model was built (after a garbage collection).

    Returns
    -------
    dict
        ``peak_bytes``, ``state_bytes``, ``comm_bytes`` and ``comm_counts`` by kind,
        ``step_s`` (the slowest rank's seconds of the peak step).
    """
    from mpi4py import MPI  # lazy: launch-side MPI for the comparison only

    world = MPI.COMM_WORLD
    gc.collect()  # earlier models (in reference cycles) go first
    base = dt.memory_stats()["allocated_bytes"]
    run = build(strategy, cfg, seed=seed, dtype=dtype)
    opt = dt.optim.AdamW(run.model.parameters(), lr=_LR, weight_decay=_WD)
    idx, tgt = make_batch(cfg, batch, seed)
    inputs = run.inputs(idx, tgt)
    after: dict[str, int] = {}

    def step() -> None:
        loss = run.model(*inputs)
        loss.backward()
        del loss
        opt.step()
        after["state"] = dt.memory_stats()["allocated_bytes"]
        opt.zero_grad()

    step()
    step()
    with dt.debug.CommDebugMode() as mode:
        step()
    counts: dict[str, int] = {}
    nbytes: dict[str, int] = {}
    for r in mode.records:
        counts[r.kind] = counts.get(r.kind, 0) + 1
        nbytes[r.kind] = nbytes.get(r.kind, 0) + r.nbytes
    counts, nbytes = world.bcast((counts, nbytes), root=0)
    world.Barrier()
    dt.reset_peak_memory_stats()
    t0 = time.perf_counter()
    step()
    seconds = time.perf_counter() - t0
    peak = dt.memory_stats()["peak_allocated_bytes"] - base
    return {
        "peak_bytes": int(world.allreduce(peak, op=MPI.MAX)),
        "state_bytes": int(world.allreduce(after["state"] - base, op=MPI.MAX)),
        "comm_bytes": nbytes,
        "comm_counts": counts,
        "step_s": float(world.allreduce(seconds, op=MPI.MAX)),
    }


def main(argv: list[str] | None = None) -> None:
    """``python launch/examples/gpt_predict.py [--model tiny] [--strategy fsdp] [--mesh 2]
    [--batch 8] [--microbatches M --schedule 1f1b]``: one prediction, as JSON. **Local**."""
    p = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(CONFIGS), default="tiny")
    p.add_argument("--strategy", choices=ALL_STRATEGIES, default="fsdp")
    p.add_argument("--mesh", default="2", help="W, DxT or PPxDPxTP")
    p.add_argument("--microbatches", type=int, help="a pipeline's micro-batches (default: p)")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="a pipeline's schedule")
    p.add_argument("--stages-per-rank", type=int, default=1, help="interleaved: stages per rank")
    p.add_argument("--batch", type=int, default=8, help="global batch in sequences")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = p.parse_args(argv)
    mesh = tuple(int(v) for v in args.mesh.lower().split("x"))
    dtype = dt.bfloat16 if args.dtype == "bfloat16" else None
    extra = ({"microbatches": args.microbatches, "schedule": args.schedule,
              "stages_per_rank": args.stages_per_rank} if args.strategy in PIPELINED else {})
    pred = predict(CONFIGS[args.model], args.strategy, mesh, args.batch, dtype=dtype, **extra)
    print(json.dumps(pred.to_dict(), indent=1))


if __name__ == "__main__":
    main()
