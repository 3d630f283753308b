"""``replicate``: data parallelism of a module by bucketed gradient all-reduces (PyTorch's
composable DDP, ``torch.distributed._composable.replicate``).

This module owns :func:`replicate` and the state it hangs on a module: the gradient
buckets, the post-accumulate-grad hooks that fill them and start their all-reduces during
backward, the end-of-backward callback that waits for them and writes the averaged
gradients back, and ``no_sync``.

How a step runs. Every rank holds the whole model as plain local tensors and runs it on its
own batch. During backward, the hook of a parameter runs once the parameter's ``.grad`` is
accumulated (:meth:`~dtensor.Tensor.register_post_accumulate_grad_hook`): it copies the
gradient into its bucket's flat buffer and, when that was the bucket's last parameter,
starts the bucket's all-reduce (a sum; buckets start in index order, the same on every
rank, so a later bucket that is ready first waits for the earlier ones). The first hook of
a pass queues a callback for the end of the backward pass
(:func:`~dtensor.local.grad_engine.queue_callback`) that starts the buckets left
incomplete, waits for every bucket and divides each gradient by the mesh size into its
``.grad``.

Parameters that got no gradient. A bucket carries, after the gradients, one count per
parameter: 1 where this rank has a gradient for it (from this pass or accumulated under
``no_sync``), 0 where not (its slot is zeros). After the sum, a parameter that some rank
had a gradient for gets the average on every rank (None on a rank that had none becomes
that average); one that no rank had a gradient for keeps ``.grad`` None everywhere, as
PyTorch's DDP does with ``find_unused_parameters=True``. Every rank must run backward
through the module when one does (an all-reduce waits for all).

The asynchronous all-reduce is the MPI nonblocking ``Iallreduce`` on the private duplicate
of the mesh communicator (:meth:`redistribute.comm.Comm.twin`), started in the backward's
thread (:func:`redistribute.worker.start`; the hooks of later parameters poll it so that
MPICH moves it along, :func:`redistribute.worker.poll`) or, with :data:`ASYNC_PATH` set to
``"submit"``, started and waited for by the worker thread (:func:`redistribute.worker.submit`),
which blocks in ``MPI_Wait`` and so moves it itself. Both make the same MPI calls, so ranks
may differ in the choice. BENCHMARKS.md measures both: ``start``, the default, hid as much or
more with one bucket per parameter and never lost by much with larger buckets, and needs no
thread spinning in MPI on the cores the ranks compute on. While a communication observer
(``CommDebugMode``) or a debug check is on, each bucket runs in the backward's thread before
its hook returns (the same calls, as asynchronous redistributes do): CommDebugMode counts one
``all_reduce (async)`` per bucket per step. A parameter whose gradient is accumulated again
after its bucket started (activation checkpointing can reach a parameter twice in one pass)
has its bucket summed once more at the end of the pass.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from placements.errors import ArgumentError, MeshError
from redistribute import worker
from redistribute.comm import HOOKS, Comm, world

from ..distributed.dtensor import DTensor
from ..distributed.mesh import DeviceMesh, init_device_mesh
from ..local.backend import array_module_of
from ..local.grad_engine import in_backward, queue_callback
from ..local.tensor import Tensor, wrap_array
from ..nn import Module

__all__ = ["ASYNC_PATH", "replicate"]

#: How a bucket's all-reduce runs asynchronously: ``"start"`` (the nonblocking collective
#: started in the backward's thread, polled by later hooks) or ``"submit"`` (started and
#: waited for on the worker thread). Read at each bucket's start, on every rank alike or not.
ASYNC_PATH = "start"

_MiB = 1 << 20

# Parameters that a replicated module hooks, by id: (weak reference, the module's name),
# so that replicating a module that shares one with a replicated module (its parent, its
# child) is refused.
_HOOKED: dict[int, tuple[weakref.ref, str]] = {}


def _claim(p: Any, name: str) -> None:
    key = id(p)
    _HOOKED[key] = (weakref.ref(p, lambda _: _HOOKED.pop(key, None)), name)


def _claimed_by(p: Any) -> str | None:
    entry = _HOOKED.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    return entry[1]


def _reduce_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype a bucket of ``dtype`` gradients is summed in: float32 for the dtypes MPI
    has no datatype for (bfloat16), else the gradients' own."""
    dtype = np.dtype(dtype)
    # isbuiltin: 1 for numpy's own types, 2 for registered ones such as ml_dtypes' bfloat16
    return dtype if dtype.isbuiltin == 1 else np.dtype(np.float32)


class _Bucket:
    """Parameters whose gradients are summed by one all-reduce: their positions in
    ``_State.params``, their offsets in ``flat`` (the gradients, then one count per
    parameter), and this pass's progress."""

    __slots__ = ("flat", "handle", "index", "left", "members", "offsets", "stale")

    def __init__(self, index: int, members: list[int], sizes: list[int], dtype: Any,
                 xp: Any) -> None:
        self.index = index
        self.members = members
        self.offsets = [int(o) for o in np.cumsum([0, *sizes])]
        self.flat = xp.zeros(self.offsets[-1] + len(members), _reduce_dtype(dtype))
        self.left = len(members)  # parameters not ready yet in this pass
        self.handle: Any = None  # the started all-reduce's handle
        self.stale = False  # a gradient changed after the all-reduce started

    def counts(self) -> Any:
        """The per-parameter counts (1 where this rank has a gradient)."""
        return self.flat[self.offsets[-1]:]

    def slot(self, j: int, shape: tuple) -> Any:
        """Member ``j``'s gradient in ``flat``, shaped like the parameter."""
        return self.flat[self.offsets[j]:self.offsets[j + 1]].reshape(shape)


class _State:
    """What :func:`replicate` hangs on a module (``module._replicate_state``)."""

    def __init__(self, module: Module, comm: Any, params: list, buckets: list[_Bucket]) -> None:
        self.comm = comm
        self.host = type(comm) is Comm
        self.twin = comm.twin() if self.host else comm
        self.params = params
        self.buckets = buckets
        # position of each parameter: (bucket, member index)
        self.where: dict[int, tuple[_Bucket, int]] = {}
        for b in buckets:
            for j, i in enumerate(b.members):
                self.where[id(params[i])] = (b, j)
        self.sync = True  # False inside no_sync()
        self.sync_pass = True  # what the last forward saw: whether backward communicates
        self.queued = False  # the end-of-pass callback is queued
        self.next = 0  # the next bucket to start
        self.ready: set[int] = set()  # ids of the parameters ready in this pass
        # the last pass's wait for its all-reduces at the end (launch.bench.ddp_buckets)
        self.exposed_s = 0.0
        # the hooks hold this state weakly (the module holds it): a tensor's hooks are not
        # seen by the cycle collector, so a strong one would keep the model alive for good
        ref = weakref.ref(self)

        def hook(p: Tensor) -> None:
            state = ref()
            if state is not None:
                state._hook(p)

        for p in params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(hook)
        module.register_forward_pre_hook(self._pre_forward)

    # -- forward -------------------------------------------------------------------------
    def _pre_forward(self, module: Module, args: tuple) -> None:
        """Record whether the backward of this forward communicates (PyTorch reads
        ``no_sync`` at forward time) and recover from a pass that raised midway."""
        self.sync_pass = self.sync
        if self.queued and not in_backward():
            self._reset()

    # -- backward ------------------------------------------------------------------------
    def _hook(self, p: Tensor) -> None:
        """A parameter's gradient is accumulated: copy it into its bucket; start the buckets
        that are complete, in index order."""
        if not self.sync_pass:
            return
        if not self.queued:
            self.queued = True
            queue_callback(self._finish)
        b, j = self.where[id(p)]
        if b.handle is not None:  # already started: this pass accumulated into p again
            b.stale = True
            return
        _copy_in(b, j, p)
        if id(p) not in self.ready:
            self.ready.add(id(p))
            b.left -= 1
        if b.left == 0:
            self._start_ready()
        elif self.next and ASYNC_PATH == "start":
            worker.poll()  # let the started all-reduces progress (MPICH moves them here)

    def _start_ready(self) -> None:
        buckets = self.buckets
        while self.next < len(buckets) and buckets[self.next].left == 0:
            self._start(buckets[self.next])
            self.next += 1

    def _start(self, b: _Bucket) -> None:
        """Start bucket ``b``'s all-reduce (a sum). **Collective** over the mesh."""
        flat, what = b.flat, ("replicate: gradient bucket", b.index)
        if not self.host:  # device buffers: a blocking all-reduce, in this thread
            b.handle = worker.submit(lambda: self.comm.allreduce(flat, what=what), inline=True)
            return
        twin = self.twin
        if HOOKS.traced or ASYNC_PATH == "submit" or not worker.idle():
            job = lambda: worker.Started(twin.allreduce(flat, what=what, start=True),
                                         _nothing).wait()
            b.handle = worker.submit(job, inline=HOOKS.traced)
        else:
            b.handle = worker.start(twin.allreduce(flat, what=what, start=True), _nothing)

    def _finish(self) -> None:
        """End of a backward pass: start the incomplete buckets (zeros and count 0 for the
        parameters without a gradient in this pass, their accumulated ``.grad`` where they
        have one), wait for every bucket and write the averages into the ``.grad`` s.
        **Collective** over the mesh."""
        begin = time.perf_counter()
        try:
            for b in self.buckets[self.next:]:
                for j, i in enumerate(b.members):
                    p = self.params[i]
                    if id(p) not in self.ready:
                        _copy_in(b, j, p)
                b.left = 0
            self._start_ready()
            for b in self.buckets:
                b.handle.wait()
                if b.stale:  # the gradients changed after the start: sum them again
                    b.handle = None
                    for j, i in enumerate(b.members):
                        _copy_in(b, j, self.params[i])
                    self._start(b)
                    b.handle.wait()
            self.exposed_s = time.perf_counter() - begin
            size = self.comm.size
            for b in self.buckets:
                counts = b.counts()
                for j, i in enumerate(b.members):
                    if counts[j]:
                        _copy_out(b, j, self.params[i], size)
        finally:
            self._reset()

    def _reset(self) -> None:
        """Forget the pass: every bucket empty and not started."""
        for b in self.buckets:
            if b.handle is not None and not b.handle.done():
                b.handle.wait()  # a pass that raised: the ranks started the same buckets
            b.handle = None
            b.left = len(b.members)
            b.stale = False
        self.next = 0
        self.ready.clear()
        self.queued = False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        prev, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = prev


def _nothing() -> None:
    return None


def _copy_in(b: _Bucket, j: int, p: Tensor) -> None:
    """Member ``j``'s gradient into ``b.flat`` with count 1, or zeros and count 0."""
    g = p.grad
    slot = b.slot(j, tuple(p.shape))
    counts = b.counts()
    if g is None:
        slot.fill(0)
        counts[j] = 0
    else:
        array_module_of(slot).copyto(slot, g._arr, casting="unsafe")
        counts[j] = 1


def _copy_out(b: _Bucket, j: int, p: Tensor, size: int) -> None:
    """Member ``j``'s summed gradient divided by ``size`` into ``p.grad`` (in place; a new
    tensor where ``p`` has none)."""
    slot = b.slot(j, tuple(p.shape))
    xp = array_module_of(slot)
    g = p.grad
    if g is None:
        p.grad = wrap_array(xp.divide(slot, size).astype(p.dtype))
    else:
        xp.divide(slot, size, out=g._arr, casting="unsafe")


class _Replicated:
    """The methods a replicated module gains (its class becomes a subclass of this and of
    its own class, as ``fully_shard`` does in PyTorch)."""

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """``with module.no_sync():`` the backward of a forward run inside does not
        communicate: gradients accumulate locally into ``.grad``, and the next synchronized
        backward all-reduces the accumulated ones (the gradient of the micro-batches
        together). **Local**."""
        return self.__dict__["_replicate_state"].no_sync()


_CLASSES: dict[type, type] = {}


def _replicated_class(cls: type) -> type:
    found = _CLASSES.get(cls)
    if found is None:
        found = _CLASSES[cls] = type(f"Replicate{cls.__name__}", (_Replicated, cls), {})
    return found


def _bucket_plan(params: list, cap_bytes: float,
                 first_cap_bytes: float | None = None) -> list[list[int]]:
    """Positions of ``params`` (those that require grad) grouped into buckets: in reverse
    order, one open bucket per dtype, closed before a parameter would take it past the cap
    and when it reaches the cap; a parameter larger than the cap is alone. The cap is
    ``first_cap_bytes`` (default ``cap_bytes``) until the first bucket closes, as PyTorch's
    DDP caps its first bucket (1 MiB) so that an all-reduce starts early in backward."""
    done: list[list[int]] = []
    open_: dict[Any, tuple[list[int], list[int]]] = {}
    first = cap_bytes if first_cap_bytes is None else first_cap_bytes
    for i in reversed(range(len(params))):
        p = params[i]
        if not p.requires_grad:
            continue
        cap = first if not done else cap_bytes
        nbytes = p.numel() * p.dtype.itemsize
        members, size = open_.setdefault(p.dtype, ([], [0]))
        if members and size[0] + nbytes > cap:
            done.append(members)
            cap = cap_bytes
            members, size = open_[p.dtype] = ([], [0])
        members.append(i)
        size[0] += nbytes
        if size[0] >= cap:
            done.append(members)
            del open_[p.dtype]
    done.extend(members for members, _ in open_.values())
    return done


def _broadcast(tensors: list, comm: Any) -> None:
    """Overwrite ``tensors`` with the mesh's first rank's values: one broadcast of their
    bytes packed together. **Collective** over ``comm``."""
    arrays = [t._arr for t in tensors if t.numel()]
    if not arrays or comm.size == 1:
        return
    xp = array_module_of(arrays[0])
    sizes = [a.nbytes for a in arrays]
    packed = xp.empty(sum(sizes), np.uint8)
    offsets = np.cumsum([0, *sizes])
    for a, lo, hi in zip(arrays, offsets[:-1], offsets[1:]):
        packed[lo:hi] = xp.ascontiguousarray(a).reshape(-1).view(np.uint8)
    comm.bcast_array(packed, 0, what="replicate: parameters and buffers")
    if comm.rank:
        for a, lo, hi in zip(arrays, offsets[:-1], offsets[1:]):
            a[...] = packed[lo:hi].view(a.dtype).reshape(a.shape)


def replicate(module: Module, mesh: DeviceMesh | None = None, *,
              bucket_cap_mb: float = 25) -> Module:
    """Data parallelism of ``module`` over ``mesh`` (PyTorch's composable ``replicate``,
    the module form of ``DistributedDataParallel``).

    **Collective** over ``mesh``: every rank calls it with the same model. The parameters and
    buffers are broadcast from the mesh's first rank (so every rank starts equal) and stay
    plain local tensors; each rank runs the module on its own batch. Every backward through
    the module then all-reduces the gradients, averaged over the mesh, in buckets started
    as soon as their last gradient is ready, overlapped with the rest of backward (see the
    module docstring): after ``loss.backward()`` every rank's ``.grad`` is the mean of the
    ranks' gradients, and an optimizer step keeps the replicas equal. Buffers are broadcast
    here only (PyTorch's DDP broadcasts them before every forward too). The hooks sit on the
    parameter objects: convert dtypes (``Module.to``, which puts new parameters in place)
    before ``replicate``, and load state dicts in place (not ``assign=True``).

    The module's class becomes ``Replicate<Class>``, a subclass with ``no_sync()``: inside
    ``with module.no_sync():``, forwards run backward passes that do not communicate and
    gradients accumulate; the next synchronized backward all-reduces the accumulated ones.

    Parameters
    ----------
    module : Module
        The model, with local (not DTensor) parameters; changed in place and returned.
    mesh : DeviceMesh, optional
        A 1-D mesh of the data-parallel ranks (for a 2-D mesh, its dp dim); default a 1-D
        mesh of all ranks (``dt.init_device_mesh((world_size,))``, a collective).
    bucket_cap_mb : float
        The largest bucket in MiB (default 25, PyTorch's). Parameters are bucketed in
        reverse registration order (the order backward produces their gradients), one dtype
        per bucket; a parameter larger than the cap has a bucket of its own, and 0 gives
        one bucket (one all-reduce) per parameter. The first bucket (the last parameters)
        holds at most 1 MiB, as in PyTorch, so that its all-reduce starts early.

    Returns
    -------
    Module
        ``module``.

    Raises
    ------
    ArgumentError
        ``module`` is not a Module, ``bucket_cap_mb`` is negative, ``module`` (or a module
        sharing a parameter with it: a submodule, a parent) is replicated already, or a
        parameter or buffer is a DTensor (the module is under ``fully_shard`` or
        ``parallelize_module``); the message names the module path. Nothing has changed then.
    MeshError
        ``mesh`` is not a 1-D DeviceMesh that includes this rank.
    """
    if not isinstance(module, Module):
        raise ArgumentError(f"replicate: expected a dt.nn.Module, got {type(module).__name__}")
    if not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb < 0:
        raise ArgumentError(
            f"replicate: bucket_cap_mb must be a number >= 0 (MiB), got {bucket_cap_mb!r}"
        )
    name = type(module).__name__
    if mesh is None:
        mesh = init_device_mesh((world().size,))
    if not isinstance(mesh, DeviceMesh):
        raise MeshError(
            f"replicate({name}): the mesh must be a DeviceMesh that includes this rank "
            f"(a mesh of ranks, not a plan's AbstractMesh), got {mesh!r}"
        )
    if mesh.ndim != 1:
        raise MeshError(
            f"replicate({name}): data parallelism needs a 1-D mesh (pass mesh['dp'] of a "
            f"{mesh.ndim}-D mesh), got {mesh!r}"
        )
    for path, sub in module.named_modules():
        if "_replicate_state" in sub.__dict__:
            where = f"its submodule {path!r}" if path else "it"
            raise ArgumentError(
                f"replicate({name}): {where} is replicated already; apply replicate once, "
                "to the root module"
            )
    params = [p for _, p in module.named_parameters()]
    for kind, items in (("parameter", module.named_parameters()),
                        ("buffer", module.named_buffers())):
        for path, t in items:
            if isinstance(t, DTensor):
                raise ArgumentError(
                    f"replicate({name}): {kind} {path!r} is a DTensor {t.placements} on "
                    f"{t.device_mesh!r}: the module is already distributed (fully_shard or "
                    "parallelize_module); replicate takes a module of local tensors"
                )
            owner = _claimed_by(t) if kind == "parameter" else None
            if owner is not None:
                raise ArgumentError(
                    f"replicate({name}): parameter {path!r} belongs to the replicated module "
                    f"{owner} already (a parent or a submodule of this one was replicated); "
                    "apply replicate once, to the root module"
                )
    comm = mesh.get_group(0)
    _broadcast(params + [b for _, b in module.named_buffers()], comm)
    plan = _bucket_plan(params, bucket_cap_mb * _MiB, min(bucket_cap_mb, 1) * _MiB)
    xp = array_module_of(params[plan[0][0]]._arr) if plan else np
    buckets = [
        _Bucket(k, members, [params[i].numel() for i in members], params[members[0]].dtype, xp)
        for k, members in enumerate(plan)
    ]
    state = _State(module, comm, params, buckets)
    for p in params:
        _claim(p, name)
    object.__setattr__(module, "_replicate_state", state)
    module.__class__ = _replicated_class(type(module))
    return module
