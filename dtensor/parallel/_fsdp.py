"""``fully_shard`` (FSDP2): parameters sharded on a data-parallel mesh dim, gathered per
module in one collective for its forward and backward, gradients reduce-scattered in one.

How a call runs (per module under ``fully_shard``, a *group*: its parameters that no
``fully_shard`` submodule manages):

* At rest every parameter is a ``Shard(0)`` DTensor on the FSDP mesh (``Replicate`` on the
  replicate dim of an HSDP mesh; beside the tensor-parallel placement on a 2-D
  ``(dp, tp)`` mesh). Optimizers, ``clip_grad_norm_``, ``state_dict`` and ``dt.save`` see
  these.
* Before its forward the group is *unsharded*: every rank packs its shards (cast to
  ``param_dtype``) into one flat buffer, padded per parameter to ``ceil(dim0 / n)`` rows,
  one all-gather fills a flat buffer of ``n`` such pieces, and each parameter is copied out
  into the group's :class:`~dtensor.local.allocator.ReleasableBuffer`. The module's
  parameters are replaced by views of that buffer for the forward (plain Tensors, or
  DTensors on the tensor-parallel mesh), made by one autograd node whose backward is the
  reduce-scatter.
* After its forward the group is *resharded* (``reshard_after_forward=True``: ZeRO-3): the
  buffer's pages are given back; the saved tensors of backward nodes keep pointing at the
  same addresses. The buffers are pooled (``ReleasableBuffer(pooled=True)``): released
  pages wait for the next group of the same size, which maps them at its own address in
  one system call, instead of faulting fresh zeroed pages in at every gather (a gpt-small
  step faulted 21,000 pages, 86 MB, and spent 60-120 ms of CPU more than with the pool on a
  loaded 2-core machine). No more pages are held than the most groups of a size unsharded
  at once (the running one, the prefetched one, in backward the one whose gradients are
  being reduced); ``DTENSOR_FSDP_POOL=0`` turns the pool off. ``False`` keeps the buffer to
  backward (ZeRO-2); an int ``k`` keeps a ``1/k``
  piece, gathered again within groups of ``k`` ranks.
* The outputs of the forward pass through a node whose backward unshards the group again
  (before any node of the module's backward runs) and starts the previous module's
  all-gather.
* The gather node's backward runs when every parameter's gradient is complete: the
  gradients (cast to ``reduce_dtype``) are packed like the parameters and reduce-scattered
  (averaged) in one collective (then all-reduced over the replicate dim of HSDP); each
  parameter's shard of it is its gradient, accumulated by the autograd engine. Then the
  buffer is released.
* Prefetch: the order in which groups ran forward is recorded; the next group's all-gather
  is started (on the asynchronous-redistribute worker, a private duplicate communicator)
  as a group begins its forward, and the previous one's as a group begins its backward.

Collectives: all-gathers run on the redistribute worker's thread (in the caller's thread
while CommDebugMode or a debug check watches), reduce-scatters in the caller's thread.
Every rank runs the same groups in the same order, so they match.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from placements import Partial, Placement, Replicate, Shard
from placements.errors import (
    ArgumentError,
    ConfigError,
    DTypeError,
    MeshError,
    UnavailableError,
)
from placements.layout import local_shape
from placements.meta import is_floating
from redistribute import comm as _comm
from redistribute import worker as _worker

from ..distributed.dtensor import DTensor
from ..distributed.mesh import DeviceMesh, init_device_mesh
from ..local import grad_engine as _ag
from ..local.allocator import ReleasableBuffer, empty_array
from ..local.dtypes import to_dtype
from ..local.tensor import Tensor, wrap_array
from ..nn import Module, Parameter

__all__ = ["FSDPModule", "MixedPrecisionPolicy", "fully_shard"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """How ``fully_shard`` casts (PyTorch's ``MixedPrecisionPolicy``). **Local**.

    ``param_dtype``: the dtype parameters are gathered in and forward/backward compute in
    (None: the parameters' own); ``reduce_dtype``: the dtype gradients are reduce-scattered
    in (None: ``param_dtype``); ``output_dtype``: floating outputs of the module's forward
    are cast to it (None: no cast); ``cast_forward_inputs``: floating tensor inputs of the
    forward are cast to ``param_dtype``. The sharded parameters (the optimizer's master
    weights) and their gradients keep the parameters' dtype.
    """

    param_dtype: Any = None
    reduce_dtype: Any = None
    output_dtype: Any = None
    cast_forward_inputs: bool = True


class _Param:
    """One parameter of a group: where it lives in the module tree, its sharded DTensor,
    the unsharded layout (shape, tensor-parallel mesh and placements) and its place in the
    group's flat buffers."""

    __slots__ = (
        "chunk",
        "full_shape",
        "global_rows",
        "global_shape",
        "global_stride",
        "local_shape",
        "numel",
        "offset",
        "padded_rows",
        "path",
        "rest",
        "sharded",
        "slots",
        "tp_mesh",
        "tp_placements",
    )

    def __init__(self) -> None:
        self.slots: list[tuple[Module, str]] = []

    def rank_rows(self, n: int) -> list[tuple[int, int]]:
        """(first row, rows) of dim 0 that each of ``n`` ranks holds (torch.chunk)."""
        pr = self.padded_rows
        out = []
        for r in range(n):
            start = min(r * pr, self.global_rows)
            out.append((start, min(pr, self.global_rows - start)))
        return out


class _Stats:
    """Seconds spent on all-gathers (on whichever thread ran them) and waiting for them on
    the caller's thread; their counts. ``module._fsdp_state.stats`` (benchmarks read it)."""

    __slots__ = ("gather_s", "gathers", "reduce_s", "reduces", "wait_s")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.gather_s = self.wait_s = self.reduce_s = 0.0
        self.gathers = self.reduces = 0


class _Context:
    """What the groups under one root share: the forward order of the last iteration (for
    prefetch) and the order of this one, and the backward pass's flags."""

    __slots__ = ("backward_queued", "order", "running", "stats")

    def __init__(self) -> None:
        self.order: list[_Group] = []
        self.running: list[_Group] = []
        self.backward_queued = False
        self.stats = _Stats()


def _pooled() -> bool:
    """Whether the gathered parameters' buffers take their pages from the page pool
    (``DTENSOR_FSDP_POOL``, default 1; 0 gives every released buffer's pages back to the
    system, and each gather faults them in again), read when a group is made."""
    value = os.environ.get("DTENSOR_FSDP_POOL", "1").strip()
    if value not in ("0", "1"):
        raise ConfigError(f"environment variable DTENSOR_FSDP_POOL={value!r} is not 0 or 1")
    return value == "1"


def _meshes_of(mesh: DeviceMesh) -> tuple[int, int | None]:
    """(the shard mesh dim, the replicate mesh dim or None) of an FSDP mesh."""
    if mesh.ndim == 1:
        return 0, None
    if mesh.ndim == 2:
        return 1, 0
    raise MeshError(f"fully_shard: the mesh must be 1-D (FSDP) or 2-D (HSDP), got {mesh!r}")


class _Group:
    """The FSDP state of one module (``module._fsdp_state``)."""

    def __init__(self, module: Module, path: str, mesh: DeviceMesh, params: list[_Param],
                 reshard_after_forward: bool | int, mp: MixedPrecisionPolicy,
                 dtype: Any) -> None:
        self.module = module
        self.path = path
        self.mesh = mesh
        self.params = params
        self.reshard_after_forward = reshard_after_forward
        self.mp = mp
        self.param_dtype = to_dtype(mp.param_dtype) if mp.param_dtype is not None else dtype
        self.reduce_dtype = (to_dtype(mp.reduce_dtype) if mp.reduce_dtype is not None
                             else self.param_dtype)
        self.dtype = dtype
        shard_dim, rep_dim = _meshes_of(mesh) if params else (0, None)
        self.comm = mesh.get_group(shard_dim) if params else None
        self.rep_comm = mesh.get_group(rep_dim) if rep_dim is not None else None
        self.n = self.comm.size if params else 1
        self.rank = self.comm.rank if params else 0
        self.flat = sum(p.chunk for p in params)  # elements per rank in the gathered buffer
        self.unsharded_numel = sum(p.numel for p in params)
        isz = self.param_dtype.itemsize
        self.buffer = (ReleasableBuffer(self.unsharded_numel * isz, pooled=_pooled())
                       if params else None)
        self.views: list[np.ndarray] = []
        if params:
            typed = self.buffer.array.view(self.param_dtype)
            start = 0  # the parameters packed in order
            for p in params:
                self.views.append(typed[start:start + p.numel].reshape(p.full_shape))
                start += p.numel
        self.unsharded = False  # the buffer holds the parameters
        self.pending: Any = None  # the handle of an all-gather in flight
        self.sub: tuple | None = None  # (comm, stash) of an int reshard_after_forward
        self.requires_gradient_sync = True
        self.acc: list | None = None  # unsharded gradients accumulated without sync
        self.is_root = False
        self.ctx: _Context | None = None
        self.swapped = False
        self.prefetch: list = [None, None]  # explicit forward / backward prefetch lists
        self.current: list | None = None  # the unsharded tensors of the last forward
        self.sub_comm = None
        if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
            k = reshard_after_forward
            color = self.rank // k
            self.sub_comm = _comm.Comm(self.comm.mpi.Split(color, self.rank))

    # -- gathering ----------------------------------------------------------------------
    def _pack_shards(self) -> np.ndarray:
        """This rank's piece of the all-gather: every shard cast to ``param_dtype`` at its
        padded offset (zeros in the padding)."""
        send = empty_array((self.flat,), self.param_dtype)
        for p in self.params:
            piece = send[p.offset:p.offset + p.chunk]
            local = p.sharded._local._arr.reshape(-1)
            m = local.size
            piece[:m] = local
            if m < p.chunk:
                piece[m:] = 0
        return send

    def _gather_job(self, send: np.ndarray, comm: Any, stash: bool) -> Any:
        """The all-gather and the copy-out into the buffer (run by the worker or inline)."""
        stats = self.ctx.stats if self.ctx is not None else None
        t0 = time.perf_counter()
        self.buffer.commit()
        if stash:  # the 1/k piece of the packed unsharded buffer, gathered within k ranks
            k = comm.size
            recv = empty_array((k * send.size,), self.param_dtype)
            comm.twin().allgatherv(send, recv, [send.size] * k, what="fully_shard")
            out = self.buffer.array.view(self.param_dtype)
            out[:] = recv[:out.size]
        else:
            recv = empty_array((self.n * self.flat,), self.param_dtype)
            comm.twin().allgatherv(send, recv, [self.flat] * self.n, what="fully_shard")
            pieces = recv.reshape(self.n, self.flat)
            for p, view in zip(self.params, self.views):
                rows2 = view.reshape(p.global_rows, -1) if p.numel else None
                for r, (start, m) in enumerate(p.rank_rows(self.n)):
                    if m:
                        rows2[start:start + m] = pieces[r, p.offset:p.offset + m * p.rest
                                                        ].reshape(m, p.rest)
        if stats is not None:
            stats.gather_s += time.perf_counter() - t0
            stats.gathers += 1
        return None

    def start_unshard(self) -> None:
        """Start the all-gather of this group (no-op when unsharded or in flight).
        **Collective** (every rank starts the same groups in the same order)."""
        if self.unsharded or self.pending is not None or not self.params:
            return
        if self.sub is not None:
            comm, send = self.sub
            self.sub = None
            job_args = (send, comm, True)
        else:
            job_args = (self._pack_shards(), self.comm, False)
        inline = _comm.HOOKS.traced
        self.pending = _worker.submit(lambda: self._gather_job(*job_args), inline)

    def unshard(self) -> None:
        """Gather the group's parameters into its buffer (waiting for a prefetch in
        flight). **Collective**."""
        if self.unsharded or not self.params:
            return
        self.start_unshard()
        stats = self.ctx.stats if self.ctx is not None else None
        t0 = time.perf_counter()
        self.pending.wait()
        if stats is not None:
            stats.wait_s += time.perf_counter() - t0
        self.pending = None
        self.unsharded = True

    def reshard(self, keep: int | None = None) -> None:
        """Give the buffer's memory back (``keep``: first keep this rank's ``1/keep`` piece
        of it, to gather within ``keep`` ranks later). **Local**."""
        if self.pending is not None:  # a prefetch in flight: let it land first
            self.unshard()
        if not self.unsharded:
            return
        if keep is not None and keep > 1 and self.sub_comm is not None:
            comm = self.sub_comm
            total = self.unsharded_numel
            c = -(-total // comm.size)
            flat = self.buffer.array.view(self.param_dtype)
            stash = empty_array((c,), self.param_dtype)
            start = min(comm.rank * c, total)
            m = min(c, total - start)
            stash[:m] = flat[start:start + m]
            stash[m:] = 0
            self.sub = (comm, stash)
        self.buffer.release()
        self.unsharded = False

    # -- the parameters the forward sees --------------------------------------------------
    def make_unsharded(self) -> list:
        """Fresh handles on the buffer, one per parameter, made by one recorded node (when
        a parameter requires grad and grad mode is on) whose backward reduce-scatters."""
        outs = []
        with _ag.no_grad():
            for p, view in zip(self.params, self.views):
                t = wrap_array(view)
                if p.tp_mesh is not None:
                    t = DTensor.from_local(t, p.tp_mesh, p.tp_placements,
                                           shape=p.global_shape, stride=p.global_stride)
                outs.append(t)
        edges = [_ag.edge_of(p.sharded) for p in self.params]
        if _ag.is_grad_enabled() and any(e is not None for e in edges):
            _ag.record("fsdp_all_gather", _post_backward, edges, outs, ctx=self)
        return outs

    def swap_in(self, tensors: list) -> None:
        for p, t in zip(self.params, tensors):
            for owner, name in p.slots:
                owner._parameters[name] = t
        self.swapped = True

    def swap_out(self) -> None:
        for p in self.params:
            for owner, name in p.slots:
                owner._parameters[name] = p.sharded
        self.swapped = False

    # -- reduce-scatter --------------------------------------------------------------------
    def reduce_grads(self, grads: list) -> list:
        """The sharded gradients of the group from the unsharded ones ``grads`` (None where a
        parameter got none): one reduce-scatter (and an all-reduce over HSDP's replicate
        dim). **Collective**."""
        local = []
        for p, g in zip(self.params, grads):
            if g is None:
                local.append(None)
                continue
            if isinstance(g, DTensor):
                g = g.redistribute(p.tp_mesh, p.tp_placements).to_local()
            local.append(g._arr)
        if self.acc is not None:  # gradients accumulated without sync
            local = [a if g is None else (g if a is None else a + g)
                     for a, g in zip(self.acc, local)]
            self.acc = None
        if not self.requires_gradient_sync:
            self.acc = [None if g is None else np.asarray(g, dtype=self.reduce_dtype)
                        for g in local]
            return [None] * len(grads)
        stats = self.ctx.stats if self.ctx is not None else None
        t0 = time.perf_counter()
        send = empty_array((self.n, self.flat), self.reduce_dtype)
        for p, g in zip(self.params, local):
            block = send[:, p.offset:p.offset + p.chunk]
            if g is None:
                block[...] = 0
                continue
            g2 = g.reshape(p.global_rows, p.rest)
            for r, (start, m) in enumerate(p.rank_rows(self.n)):
                block[r, :m * p.rest].reshape(m, p.rest)[...] = g2[start:start + m]
                block[r, m * p.rest:] = 0
        recv = empty_array((self.flat,), self.reduce_dtype)
        self.comm.reduce_scatter(send.reshape(-1), recv, [self.flat] * self.n, op="avg",
                                 what="fully_shard")
        if self.rep_comm is not None:
            self.rep_comm.allreduce(recv, op="avg", what="fully_shard")
        if stats is not None:
            stats.reduce_s += time.perf_counter() - t0
            stats.reduces += 1
        out = []
        for p, g in zip(self.params, local):
            if g is None:
                out.append(None)
                continue
            m = int(np.prod(p.local_shape))
            piece = recv[p.offset:p.offset + m].reshape(p.local_shape).astype(self.dtype)
            out.append(DTensor.from_local(wrap_array(piece), p.sharded.device_mesh,
                                          p.sharded.placements, shape=p.global_shape,
                                          stride=p.global_stride))
        return out


def _post_backward(node: Any, grads: list) -> list:
    """The formula of a group's gather node: reduce-scatter, then give the buffer back."""
    group: _Group = node.ctx
    out = group.reduce_grads(list(grads))
    if group.swapped:
        group.swap_out()
    group.reshard()
    return out


def _pre_backward(node: Any, grads: list) -> list:
    """The formula of the node on a module's outputs: unshard the group before its
    backward, and start the previous group's all-gather."""
    group: _Group = node.ctx
    ctx = group.ctx
    if ctx is not None and not ctx.backward_queued:
        ctx.backward_queued = True
        _ag.queue_callback(lambda: _finish_backward(ctx))
    group.unshard()
    if group.current is not None and not group.swapped:
        # the module's parameters are the forward's unsharded tensors again while its
        # backward runs: a checkpointed forward recomputed there reads them
        group.swap_in(group.current)
    if ctx is not None:
        for nxt in _next_groups(group, ctx, -1):
            nxt.start_unshard()
    return list(grads)


def _next_groups(group: _Group, ctx: _Context, step: int) -> list:
    """The groups whose all-gather ``group`` starts early: the explicit list of
    ``set_modules_to_forward_prefetch`` / ``..._backward_prefetch`` when set, else the group
    that ran after (``step`` +1, forward) or before (-1, backward) it in the last forward."""
    explicit = group.prefetch[0 if step > 0 else 1]
    if explicit is not None:
        return explicit
    order = ctx.order
    if group in order:
        i = order.index(group) + step
        if 0 <= i < len(order):
            return [order[i]]
    return []


def _finish_backward(ctx: _Context) -> None:
    """The end of a backward pass: every group sharded again, no gather left in flight."""
    for g in ctx.order:
        if g.pending is not None:
            g.unshard()
        if g.swapped:
            g.swap_out()
        g.current = None
        g.reshard()
    ctx.backward_queued = False


def _map(obj: Any, fn: Any) -> Any:
    """``obj`` with every tensor in it (in tuples, lists and dicts) replaced by ``fn(t)``."""
    if isinstance(obj, (Tensor, DTensor)):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(_map(o, fn) for o in obj)
    if isinstance(obj, list):
        return [_map(o, fn) for o in obj]
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    return obj


def _cast(obj: Any, dtype: Any) -> Any:
    """``obj`` with its floating tensors cast to ``dtype`` (recorded casts)."""
    return _map(obj, lambda t: t.to(dtype) if is_floating(t.dtype) and t.dtype != dtype else t)


def _pre_forward(module: Module, args: tuple, kwargs: dict) -> tuple:
    """The forward pre-hook: gather the group (a prefetch may be in flight), start the
    next group's gather, put the gathered parameters in the module, cast the inputs."""
    group: _Group = module._fsdp_state
    if group.ctx is None:  # the first forward under no running group: this is the root
        _lazy_init(group)
    ctx = group.ctx
    if group.is_root:
        ctx.running = []
    ctx.running.append(group)
    group.unshard()
    for nxt in _next_groups(group, ctx, +1):
        nxt.start_unshard()
    group.current = group.make_unsharded()
    group.swap_in(group.current)
    if group.mp.param_dtype is not None and group.mp.cast_forward_inputs:
        args = _cast(args, group.param_dtype)
        kwargs = _cast(kwargs, group.param_dtype)
    return args, kwargs


def _post_forward(module: Module, args: tuple, kwargs: dict, output: Any) -> Any:
    """The forward hook: the sharded parameters back in the module, the gathered ones
    freed as ``reshard_after_forward`` says, the outputs cast and passed through the node
    whose backward gathers the group again."""
    group: _Group = module._fsdp_state
    ctx = group.ctx
    group.swap_out()
    raf = group.reshard_after_forward
    if group.is_root:  # backward begins with the root: its parameters stay (for backward)
        ctx.order, ctx.running = ctx.running, []
        if not _ag.is_grad_enabled():
            group.reshard()
    elif raf is True:
        group.reshard()
    elif raf is not False and raf > 1:
        group.reshard(keep=raf)
    if group.mp.output_dtype is not None:
        output = _cast(output, to_dtype(group.mp.output_dtype))
    outs: list = []
    _map(output, lambda t: outs.append(t) if _ag.edge_of(t) is not None else None)
    if outs and _ag.is_grad_enabled():
        with _ag.no_grad():
            fresh = [t.detach() for t in outs]
        _ag.record("fsdp_pre_backward", _pre_backward, [_ag.edge_of(t) for t in outs], fresh,
                   ctx=group)
        swap = {id(t): f for t, f in zip(outs, fresh)}
        output = _map(output, lambda t: swap.get(id(t), t))
    return output


def _lazy_init(root: _Group) -> None:
    """The first forward of a group with no context: it is the root of every group below."""
    ctx = _Context()
    root.is_root = True
    for sub in root.module.modules():
        state = getattr(sub, "_fsdp_state", None)
        if state is not None and state.ctx is None:
            state.ctx = ctx


class _UnshardHandle:
    """What ``unshard(async_op=True)`` returns: ``wait()`` waits for the all-gather."""

    __slots__ = ("group",)

    def __init__(self, group: _Group) -> None:
        self.group = group

    def wait(self) -> None:
        """Wait for the all-gather to land in the module's parameters. **Collective**."""
        self.group.unshard()


class FSDPModule:
    """The methods ``fully_shard`` adds to a module (its class becomes ``FSDP<Class>``, as in
    PyTorch)."""

    def unshard(self, async_op: bool = False) -> Any:
        """Gather the module's parameters now. **Collective**. With ``async_op`` the
        all-gather is started and a handle with ``wait()`` returned."""
        group: _Group = self._fsdp_state
        if async_op:
            group.start_unshard()
            return _UnshardHandle(group)
        group.unshard()
        return None

    def reshard(self) -> None:
        """Free the module's gathered parameters. **Local**."""
        self._fsdp_state.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """Whether backward reduce-scatters gradients (False: they accumulate unsharded,
        locally, until a backward with sync; for gradient accumulation). **Local**."""
        mods = self.modules() if recurse else (self,)
        for m in mods:
            state = getattr(m, "_fsdp_state", None)
            if state is not None:
                state.requires_gradient_sync = bool(requires_gradient_sync)

    def set_modules_to_forward_prefetch(self, modules: list) -> None:
        """Start the all-gathers of ``modules`` (``fully_shard`` modules) as this module's
        forward begins, instead of the next module of the last forward's order; ``[]``
        turns forward prefetch off for this module. **Local**."""
        self._fsdp_state.prefetch[0] = [_state_of(m, "set_modules_to_forward_prefetch")
                                        for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list) -> None:
        """Start the all-gathers of ``modules`` as this module's backward begins, instead of
        the module before it in the last forward's order; ``[]`` turns backward prefetch off
        for this module. **Local**."""
        self._fsdp_state.prefetch[1] = [_state_of(m, "set_modules_to_backward_prefetch")
                                        for m in modules]

    def set_reshard_after_forward(self, reshard_after_forward: bool, *,
                                  recurse: bool = True) -> None:
        """Change ``reshard_after_forward`` (bool) of this module (and its FSDP
        submodules). **Local**."""
        mods = self.modules() if recurse else (self,)
        for m in mods:
            state = getattr(m, "_fsdp_state", None)
            if state is not None:
                state.reshard_after_forward = bool(reshard_after_forward)


def _state_of(module: Module, op: str) -> _Group:
    state = getattr(module, "_fsdp_state", None)
    if state is None:
        raise ArgumentError(f"{op}: {type(module).__name__} is not a fully_shard module")
    return state


def _combined_mesh(dp: DeviceMesh, tp: DeviceMesh, where: str) -> DeviceMesh:
    """The 2-D ``(tp, dp)`` mesh of the ranks of ``dp`` and ``tp`` (submeshes of one mesh):
    the sharded parameters' mesh under FSDP x TP, tensor-parallel dim first, so that
    ``(tp placement, Shard(0))`` shards the tensor-parallel shard along dp. **Collective**
    over those ranks only (each rank's dp row, then the rows over tp, then the new
    communicator of that block): the other ranks of a larger mesh (the other stages of a
    ``(pp, dp, tp)`` mesh, which shard other modules) take no part."""
    key = (dp, tp)
    cached = _COMBINED.get(key)
    if cached is not None:
        return cached
    world = _comm.world()
    me = np.array([world.rank, dp.size(), tp.size()], dtype=np.int64)
    row = dp.get_group().allgather_ints(me, what="fully_shard")
    rows = tp.get_group().allgather_ints(row.ravel(), what="fully_shard").reshape(
        tp.size(), dp.size(), 3)
    grid = rows[:, :, 0]
    if (rows[:, :, 1] != dp.size()).any() or (rows[:, :, 2] != tp.size()).any() or \
            len(set(grid.ravel().tolist())) != grid.size or \
            grid[tp.get_local_rank(), dp.get_local_rank()] != world.rank:
        raise MeshError(
            f"fully_shard({where}): the FSDP mesh {dp!r} and the parameters' mesh {tp!r} do "
            "not form one 2-D mesh"
        )
    group = world.mpi.Get_group()
    block = group.Incl(grid.ravel().tolist())
    comm = world.mpi.Create_group(block, _BLOCK_TAG)
    block.Free()
    group.Free()
    names = None
    if dp.mesh_dim_names and tp.mesh_dim_names:
        names = (tp.mesh_dim_names[0], dp.mesh_dim_names[0])
    mesh = DeviceMesh(dp.device_type, np.arange(grid.size).reshape(grid.shape),
                      mesh_dim_names=names, comm=comm)
    _COMBINED[key] = mesh
    return mesh


#: The tag of the creation of a ``(tp, dp)`` block's communicator (MPI_Comm_create_group).
_BLOCK_TAG = 3411
_COMBINED: dict = {}


def fully_shard(module: Module, *, mesh: DeviceMesh | None = None,
                reshard_after_forward: bool | int = True,
                mp_policy: MixedPrecisionPolicy | None = None) -> Module:
    """Shard ``module``'s parameters over ``mesh`` (PyTorch's FSDP2 ``fully_shard``).

    **Collective** over the mesh: call it on every rank, for the same modules in the same
    order (submodules first, then their parents, then the root).

    Parameters
    ----------
    module : Module
        Its parameters not already under a ``fully_shard`` submodule become one group:
        ``Shard(0)`` DTensors on ``mesh`` (uneven shards allowed), gathered in one
        all-gather before its forward and its backward, gradients reduce-scattered in one
        collective. Changed in place (its class becomes ``FSDP<Class>``, with
        :class:`FSDPModule`'s methods) and returned.
    mesh : DeviceMesh, optional
        1-D: FSDP; 2-D ``(replicate, shard)``: HSDP. Default all ranks. For FSDP x TP pass
        the dp dim of the 2-D mesh whose tp dim the module was parallelized on.
    reshard_after_forward : bool or int
        True: free the gathered parameters after forward (ZeRO-3); False: keep them to
        backward (ZeRO-2); int ``k``: keep a ``1/k`` piece, gathered again within groups of
        ``k`` ranks (``k`` divides the shard dim's size). The root keeps its own.
    mp_policy : MixedPrecisionPolicy, optional

    Raises
    ------
    ArgumentError
        ``fully_shard`` applied to the module before; a bad ``reshard_after_forward``.
    MeshError
        A mesh of more than 2 dims; parameters that live on a mesh that does not combine
        with ``mesh`` into one 2-D mesh; a parameter placement the FSDP mesh cannot take.
    DTypeError
        A parameter that is not floating; a mixed-precision dtype that is not floating.
    UnavailableError
        A parameter on a GPU (not supported yet).
    """
    name = type(module).__name__
    if not isinstance(module, Module):
        raise ArgumentError(f"fully_shard: expects a dt.nn.Module, got {type(module).__name__}")
    if getattr(module, "_fsdp_state", None) is not None:
        raise ArgumentError(
            f"fully_shard: {name} is already sharded (fully_shard was applied to it before)"
        )
    mp = mp_policy or MixedPrecisionPolicy()
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        value = getattr(mp, field)
        if value is not None and not is_floating(to_dtype(value)):
            raise DTypeError(
                f"fully_shard({name}): MixedPrecisionPolicy.{field}={value} is not a floating "
                "dtype"
            )
    raf = reshard_after_forward
    if mesh is None:
        mesh = init_device_mesh((_comm.world().size,))
    shard_dim, rep_dim = _meshes_of(mesh)
    shard_size = mesh.size(shard_dim)
    if not isinstance(raf, (bool, int)) or (not isinstance(raf, bool) and (
            raf < 1 or shard_size % raf)):
        raise ArgumentError(
            f"fully_shard({name}): reshard_after_forward must be True, False or an int that "
            f"divides the shard mesh dim's size {shard_size}, got {raf!r}"
        )
    # the parameters of this group: those no fully_shard submodule manages
    managed = set()
    for sub in module.modules():
        state = getattr(sub, "_fsdp_state", None)
        if state is not None:
            for p in state.params:
                managed.add(id(p.sharded))
    found: dict[int, _Param] = {}
    order: list[_Param] = []
    for mpath, sub in module.named_modules():
        for pname, t in sub._parameters.items():
            if t is None or id(t) in managed:
                continue
            if id(t) in found:
                found[id(t)].slots.append((sub, pname))
                continue
            full = f"{mpath}.{pname}" if mpath else pname
            if str(t.device) != "cpu":
                raise UnavailableError(
                    f"fully_shard({name}): parameter {full} is on {t.device}; fully_shard "
                    "keeps the gathered parameters in host memory it can give back, and runs "
                    "on CPU meshes only for now"
                )
            if not is_floating(t.dtype):
                raise DTypeError(
                    f"fully_shard({name}): parameter {full} has dtype {t.dtype}; only floating "
                    "parameters can be sharded"
                )
            p = _Param()
            p.path = full
            p.slots.append((sub, pname))
            p.sharded = t
            found[id(t)] = p
            order.append(p)
    dtypes = {np.dtype(p.sharded.dtype) for p in order}
    if len(dtypes) > 1:
        raise DTypeError(
            f"fully_shard({name}): parameters of different dtypes {sorted(map(str, dtypes))} "
            "in one group; cast the module first (module.to(dtype))"
        )
    dtype = dtypes.pop() if dtypes else np.dtype(np.float32)
    # the layout of each parameter (checked for all before anything changes)
    tp_meshes = {id(p.sharded.device_mesh): p.sharded.device_mesh
                 for p in order if isinstance(p.sharded, DTensor)}
    combined = None
    for p in order:
        t = p.sharded
        if isinstance(t, DTensor):
            if mesh.ndim != 1 or t.device_mesh.ndim != 1:
                raise MeshError(
                    f"fully_shard({name}): parameter {p.path} is a DTensor on {t.device_mesh!r}; "
                    "FSDP x TP needs a 1-D tensor-parallel mesh and a 1-D FSDP mesh"
                )
            if t.device_mesh == mesh:
                raise MeshError(
                    f"fully_shard({name}): parameter {p.path} already lives on the FSDP mesh "
                    f"{mesh!r} with placements {t.placements}"
                )
            if any(isinstance(pl, Partial) for pl in t.placements):
                raise MeshError(
                    f"fully_shard({name}): parameter {p.path} has a Partial placement "
                    f"{t.placements}"
                )
            p.tp_mesh = t.device_mesh
            p.tp_placements = tuple(t.placements)
            p.full_shape = tuple(t.to_local().shape)
        else:
            p.tp_mesh = None
            p.tp_placements = None
            p.full_shape = tuple(t.shape)
        p.global_shape = tuple(t.shape)
        p.global_stride = tuple(t.stride()) if len(t.shape) else ()
    if len(tp_meshes) > 1:
        raise MeshError(
            f"fully_shard({name}): parameters live on {len(tp_meshes)} different meshes"
        )
    if tp_meshes:
        combined = _combined_mesh(mesh, next(iter(tp_meshes.values())), name)
    # build the sharded parameters
    n = shard_size
    coord = mesh.get_local_rank(shard_dim)
    offset = 0
    for p in order:
        full = p.full_shape
        if not full:  # a 0-d parameter: shard a 1-element view
            raise ArgumentError(
                f"fully_shard({name}): parameter {p.path} is 0-d; FSDP shards dim 0"
            )
        rows = full[0]
        p.global_rows = rows
        p.padded_rows = -(-rows // n) if rows else 0
        rest = int(np.prod(full[1:])) if len(full) > 1 else 1
        p.rest = rest
        p.chunk = p.padded_rows * rest
        p.offset = offset
        offset += p.chunk
        p.numel = rows * rest
        start = min(coord * p.padded_rows, rows)
        m = min(p.padded_rows, rows - start)
        src = p.sharded.to_local() if isinstance(p.sharded, DTensor) else p.sharded
        # a copy of its own (a view would keep the whole parameter alive)
        piece = empty_array(src._arr[start:start + m].shape, src._arr.dtype)
        np.copyto(piece, src._arr[start:start + m])
        if p.tp_mesh is not None:
            dmesh = combined
            placements: tuple[Placement, ...] = p.tp_placements + (Shard(0),)
            dcoord = (p.tp_mesh.get_local_rank(), coord)
        elif combined is not None:  # beside tensor-parallel parameters: their mesh
            dmesh = combined
            placements = (Replicate(), Shard(0))
            dcoord = (next(iter(tp_meshes.values())).get_local_rank(), coord)
        elif rep_dim is not None:
            dmesh = mesh
            placements = (Replicate(), Shard(0))
            dcoord = tuple(mesh.get_coordinate())
        else:
            dmesh = mesh
            placements = (Shard(0),)
            dcoord = (coord,)
        want = local_shape(p.global_shape, dmesh.shape, placements, dcoord)
        if tuple(want) != piece.shape:
            raise MeshError(
                f"fully_shard({name}): parameter {p.path} of shape {p.global_shape} with "
                f"placements {placements} on {dmesh!r} holds {tuple(want)} here, not the "
                f"{piece.shape} FSDP shards; shard another dim by tensor parallelism"
            )
        p.local_shape = piece.shape
        requires = p.sharded.requires_grad
        with _ag.no_grad():
            d = DTensor.from_local(wrap_array(piece), dmesh, placements, shape=p.global_shape,
                                   stride=p.global_stride)
        p.sharded = Parameter(d, requires_grad=requires)
    # nothing raised: change the module
    for p in order:
        for owner, pname in p.slots:
            owner._parameters[pname] = p.sharded
    group = _Group(module, name, mesh, order, raf, mp, dtype)
    object.__setattr__(module, "_fsdp_state", group)
    module.register_forward_pre_hook(_pre_forward, prepend=True, with_kwargs=True)
    module.register_forward_hook(_post_forward, with_kwargs=True)
    cls = type(module)
    if not issubclass(cls, FSDPModule):
        new = _FSDP_CLASSES.get(cls)
        if new is None:
            new = _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        module.__class__ = new
    return module


_FSDP_CLASSES: dict[type, type] = {}
