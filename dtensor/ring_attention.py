"""Context parallelism: ring attention and :func:`context_parallel` (issue 34).

**Ring attention** is a strategy of the ``scaled_dot_product_attention`` op (its rule:
:mod:`placements.rules.nn`; its kernels: :mod:`dtensor.ops.ring`): on query, key and value
DTensors that are all ``Shard(seq)`` (``seq`` = ndim - 2) on the same mesh dim, with the
same placements elsewhere (Replicate, or a Shard of a batch/head dim), no ``attn_mask``,
no dropout and one batch shape, ``dt.scaled_dot_product_attention`` (and
``dt.nn.functional``'s, the same function) runs it instead of gathering key and value
where the cost model prices it lower (it moves what the gather does, in one message per
step and overlapped with compute: it is the cheaper candidate under the default model),
and ``dt.debug.explain`` lists it beside the gathering candidates. Each rank keeps its
queries; the key/value blocks travel around the ring of that mesh dim with an online
softmax; the output is ``Shard(seq)`` as the query. The backward (the op's formula calls
``scaled_dot_product_attention_backward``, whose rule has the ring too) passes the
key/value blocks around the ring again, their gradients one step behind.

**Layouts.** Outside :func:`context_parallel` a ``Shard(seq)`` DTensor has dtensor's layout
(``torch.chunk`` blocks of the sequence, uneven ones included); a causal mask is the
global one, blocks of keys wholly after a rank's queries are skipped. Inside
:func:`context_parallel` (PyTorch's default ``enable_load_balance``), the sequence is in
the *load-balanced* order: cut into ``2n`` chunks, rank ``r`` holds chunks ``r`` and
``2n-1-r`` (one early, one late chunk, so the causal work is about equal on every rank),
and the causal mask follows the original positions. When the length ``S`` is not a
multiple of ``2n``, rank ``r`` holds as many tokens as dtensor's ``Shard`` layout gives it
(``L_r``, the ``torch.chunk`` split of ``S`` over ``n``): its early chunk has
``ceil(L_r / 2)`` tokens, its late chunk the rest. Nothing is padded. Inside the context
the attention ops keep their sharded inputs' shards (only the ring reads that order
right: a gathering strategy is refused, as ``loss_parallel`` refuses one), so run the
backward inside the context too.

**Buffers.** As in PyTorch, :func:`context_parallel` takes local Tensors (the whole
sequence on every rank) and replaces each *in place* by this rank's shard (its two chunks
concatenated along the buffer's sequence dim); on exit it puts the whole sequence back
(except ``no_restore_buffers``). Model code runs unchanged on the local shards: every
token-wise op is local, and an attention call on local Tensors inside the context is ring
attention over the context's mesh (``dt.nn.functional.scaled_dot_product_attention``
wraps the shards as ``Shard(seq)`` DTensors and calls the op). A mean
loss on a rank is the mean over its own tokens: its part of the whole mean is that times
``L_r / S`` (``1 / n`` when ``n`` divides ``S``). Backward from those parts (the ring's
backward carries each rank's gradient into the other ranks' keys and values, so the
parts must be weighted before the backward) and sum the parameter gradients over the
mesh, as with data parallelism. Position ids must be one of the buffers, so that they
follow the load-balanced order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np

from placements.errors import ArgumentError, MeshError

from .dispatch.dispatcher import keep_shards
from .distributed.dtensor import DTensor
from .distributed.mesh import DeviceMesh
from .local.tensor import Tensor
from .ops.ring import RingContext, context, runs_len, sequence_positions, set_context

__all__ = ["context_parallel", "runs_len", "sequence_positions"]

_OP = "context_parallel"
#: The ops whose sharded inputs keep their shards inside the context (the ring's layout).
_ATTENTION_OPS = frozenset(("scaled_dot_product_attention",
                            "scaled_dot_product_attention_backward"))


def _balanced_index(seq_len: int, n: int, rank: int) -> np.ndarray:
    """The global positions of rank ``rank``'s load-balanced shard, in local order."""
    return np.concatenate([np.arange(s, s + m) for s, m in sequence_positions(seq_len, n, rank,
                                                                             True)])


# ------------------------------------------------------------------ context_parallel


@contextlib.contextmanager
def context_parallel(
    mesh: DeviceMesh,
    *,
    buffers: Sequence[Tensor] | None = None,
    buffer_seq_dims: Sequence[int] | None = None,
    no_restore_buffers: set | None = None,
) -> Iterator[None]:
    """Shard the sequence dim of ``buffers`` over the 1-D ``mesh`` in place, load balanced,
    and run attention calls on sequence shards as ring attention (PyTorch's
    ``torch.distributed.tensor.experimental.context_parallel``). **Local** on entry and
    exit (every rank holds the whole buffers and keeps its part; no communication); the
    attention calls inside are **Collective** over ``mesh``.

    Parameters
    ----------
    mesh : DeviceMesh
        A 1-D mesh: the context-parallel ranks.
    buffers : sequence of Tensor
        Local Tensors (the same whole sequence on every rank: inputs, position ids,
        targets...), each replaced in place by this rank's shard: its early and late chunk
        of the sequence (the module's notes) concatenated. All have one sequence length.
    buffer_seq_dims : sequence of int
        The sequence dim of each buffer (one per buffer).
    no_restore_buffers : set of Tensor, optional
        Buffers left as shards on exit (the others get their whole sequence back).

    Raises
    ------
    MeshError
        ``mesh`` not 1-D.
    ArgumentError
        A buffer that is not a local Tensor, a missing or out-of-range sequence dim, buffers
        of different sequence lengths, a ``no_restore_buffers`` entry that is not a buffer.
        Every rank raises the same error (the checks read only what every rank has).
    """
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise MeshError(f"{_OP}: the mesh must be a 1-D DeviceMesh, got "
                        f"{getattr(mesh, 'shape', type(mesh).__name__)}")
    if context() is not None:
        raise ArgumentError(f"{_OP}: already inside a context_parallel context")
    buffers = list(buffers or ())
    dims = list(buffer_seq_dims or ())
    if len(dims) != len(buffers):
        raise ArgumentError(
            f"{_OP}: buffer_seq_dims must give one sequence dim per buffer: {len(buffers)} "
            f"buffers, {len(dims)} dims ({dims})")
    keep = list(no_restore_buffers or ())
    for b in keep:
        if not any(b is x for x in buffers):
            raise ArgumentError(f"{_OP}: a no_restore_buffers entry of shape "
                                f"{tuple(getattr(b, 'shape', ()))} is not one of the buffers")
    seq = None
    norm = []
    for i, (b, d) in enumerate(zip(buffers, dims)):
        if isinstance(b, DTensor) or not isinstance(b, Tensor):
            raise ArgumentError(f"{_OP}: buffer {i} must be a local dt.Tensor (the whole "
                                f"sequence on every rank), got {type(b).__name__}")
        if not isinstance(d, int) or not -b.ndim <= d < b.ndim:
            raise ArgumentError(f"{_OP}: buffer {i} of shape {tuple(b.shape)}: sequence dim "
                                f"{d} is out of range")
        d %= b.ndim
        if seq is None:
            seq = b.shape[d]
        elif b.shape[d] != seq:
            raise ArgumentError(
                f"{_OP}: buffer {i} of shape {tuple(b.shape)} has {b.shape[d]} positions on its "
                f"sequence dim {d}; buffer 0 has {seq}")
        norm.append(d)
    n, r = mesh.size(0), mesh.get_local_rank(0)
    saved = []
    if seq is not None:
        idx = _balanced_index(seq, n, r)
        for b, d in zip(buffers, norm):
            whole = b._arr
            saved.append(whole)
            _replace(b, np.ascontiguousarray(np.take(whole, idx, axis=d)))
    set_context(RingContext(mesh, seq if seq is not None else 0))
    prev = keep_shards(frozenset())
    keep_shards(prev | _ATTENTION_OPS)
    try:
        yield
    finally:
        keep_shards(prev)
        set_context(None)
        for b, whole in zip(buffers, saved):
            if not any(b is x for x in keep):
                _replace(b, whole)


def _replace(t: Tensor, arr) -> None:
    """Make ``t`` hold ``arr`` (PyTorch's in-place ``set_``): a buffer's identity stays."""
    t._arr = arr
    t._storage = None
    t._std = None
