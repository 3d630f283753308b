"""Context parallelism: ring attention and :func:`context_parallel` (issue 34).

**Ring attention.** ``dt.nn.functional.scaled_dot_product_attention`` on query, key and
value DTensors that are all ``Shard(seq)`` (``seq`` = ndim - 2) on the same mesh dim, with
the same placements elsewhere (Replicate, or a Shard of a batch/head dim), no
``attn_mask``, no dropout and (with ``enable_gqa``) as many key/value heads as query heads,
runs here instead of gathering key and value: each rank keeps its queries; the key/value
blocks travel around the ring of that mesh dim (``Comm.isend`` / ``irecv``, the next block's
transfer posted before the current block's compute so that the two overlap) and an online
softmax (running row maximum and sum; the log-sum-exp kept for the backward) combines the
blocks. The output is ``Shard(seq)`` as the query. The backward (one node, a custom
autograd Function) passes the key/value blocks around the ring again, with the partial
key/value gradients of each block travelling one step behind it (sent once a block's
compute ends, received and added during the next one); a last step brings each block's
gradient home. Any other call keeps the op record's behaviour (its sharding rule gathers
key and value).

**Layouts.** Outside :func:`context_parallel` a ``Shard(seq)`` DTensor has dtensor's layout
(``torch.chunk`` blocks of the sequence, uneven ones included); a causal mask is the
global one, blocks of keys wholly after a rank's queries are skipped. Inside
:func:`context_parallel` (PyTorch's default ``enable_load_balance``), the sequence is in
the *load-balanced* order: cut into ``2n`` chunks, rank ``r`` holds chunks ``r`` and
``2n-1-r`` (one early, one late chunk, so the causal work is about equal on every rank),
and the causal mask follows the original positions. When the length ``S`` is not a
multiple of ``2n``, rank ``r`` holds as many tokens as dtensor's ``Shard`` layout gives it
(``L_r``, the ``torch.chunk`` split of ``S`` over ``n``): its early chunk has
``ceil(L_r / 2)`` tokens, its late chunk the rest. Nothing is padded.

**Buffers.** As in PyTorch, :func:`context_parallel` takes local Tensors (the whole
sequence on every rank) and replaces each *in place* by this rank's shard (its two chunks
concatenated along the buffer's sequence dim); on exit it puts the whole sequence back
(except ``no_restore_buffers``). Model code runs unchanged on the local shards: every
token-wise op is local, and an attention call on local Tensors inside the context is ring
attention over the context's mesh (the shards wrapped as ``Shard(seq)`` DTensors). A mean
loss on a rank is the mean over its own tokens: its part of the whole mean is that times
``L_r / S`` (``1 / n`` when ``n`` divides ``S``). Backward from those parts (the ring's
backward carries each rank's gradient into the other ranks' keys and values, so the
parts must be weighted before the backward) and sum the parameter gradients over the
mesh, as with data parallelism. Position ids must be one of the buffers, so that they
follow the load-balanced order.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from placements import Replicate, Shard
from placements.errors import ArgumentError, MeshError
from placements.layout import shard_range

from .autograd import Function
from .distributed.dtensor import DTensor
from .distributed.mesh import DeviceMesh
from .local.tensor import Tensor, wrap_array
from .nn import functional as _F

__all__ = ["context_parallel", "ring_attention_applies", "sequence_positions"]

_OP = "context_parallel"
_TAG_KV, _TAG_GRAD = 3401, 3402
#: Whether the ring's transfers overlap compute (True) or are completed as soon as posted
#: (False: communication and compute serial; the benchmark's reference, nothing else).
OVERLAP = True


@dataclass(frozen=True)
class _Context:
    mesh: DeviceMesh
    seq_len: int  # the whole sequence length of the buffers


_STATE = threading.local()


def _active() -> _Context | None:
    return getattr(_STATE, "ctx", None)


# ------------------------------------------------------------------ layouts


def sequence_positions(seq_len: int, n: int, rank: int, balanced: bool) -> list[tuple[int, int]]:
    """The global positions rank ``rank`` of ``n`` holds of a sequence of ``seq_len``, as
    ``(start, length)`` runs in local order: one run (dtensor's ``Shard`` layout) or, load
    balanced, the early and the late chunk (the module's notes). **Local**."""
    if not balanced:
        return [shard_range(seq_len, n, rank)]
    sizes = [shard_range(seq_len, n, j)[1] for j in range(n)]
    early = [-(-m // 2) for m in sizes]
    late = [m - e for m, e in zip(sizes, early)]
    start_early = sum(early[:rank])
    start_late = sum(early) + sum(late[rank + 1:])
    return [(start_early, early[rank]), (start_late, late[rank])]


def _balanced_index(seq_len: int, n: int, rank: int) -> np.ndarray:
    """The global positions of rank ``rank``'s load-balanced shard, in local order."""
    return np.concatenate([np.arange(s, s + m) for s, m in sequence_positions(seq_len, n, rank,
                                                                             True)])


# ------------------------------------------------------------------ the ring kernels


#: Query rows per block of the ring kernels: a block's scores against a whole key run stay
#: a few MiB at the benchmark's sizes (8 heads, runs of 2k keys: 8 x 256 x 2048 floats).
BLOCK_ROWS = 256


def _pairs(qruns, kruns, causal: bool):
    """``(q slice, k slice, masked, first query position, first key position)`` for each
    block of :data:`BLOCK_ROWS` queries of each query run against each key run where it has
    weights: under ``causal`` only the keys up to the block's last query (a key run wholly
    after the block is skipped) and a block that meets the diagonal gets the mask."""
    q0 = 0
    for qs, ql in qruns:
        for b0 in range(0, ql, BLOCK_ROWS):
            bl = min(BLOCK_ROWS, ql - b0)
            k0 = 0
            for ks, kl in kruns:
                # causal: only the keys up to the block's last query (none: skipped)
                seen = min(kl, qs + b0 + bl - ks) if causal else kl
                if seen > 0:
                    masked = causal and ks + seen - 1 > qs + b0
                    yield (slice(q0 + b0, q0 + b0 + bl), slice(k0, k0 + seen), masked, qs + b0,
                           ks)
                k0 += kl
        q0 += ql


def _posted(comm, reqs: list) -> list:
    """``reqs`` to complete later, or completed now (and none left) without :data:`OVERLAP`."""
    if OVERLAP:
        return reqs
    comm.wait_all(reqs)
    return []


def _progress(comm, reqs: list) -> None:
    """Let MPI move the posted transfers on between two blocks of compute (without a
    progress thread, a large message advances only inside MPI calls). Never blocks."""
    if reqs:
        comm.test_all(reqs)


def _scores(q, k, masked: bool, qs: int, ks: int):
    s = q @ np.swapaxes(k, -1, -2)
    if masked:
        qn, kn = s.shape[-2], s.shape[-1]
        np.copyto(s, -np.inf, where=np.arange(ks, ks + kn) > np.arange(qs, qs + qn)[:, None])
    return s


def _ring_forward(q, k, v, comm, qrun, kruns, scale: float, causal: bool):
    """Out and log-sum-exp (acc dtype) of this rank's queries against every rank's keys."""
    n, r = comm.size, comm.rank
    acc = np.float64 if q.dtype == np.float64 else np.float32
    qs = np.multiply(q, acc(scale), dtype=acc)
    ek = k.shape[-1]
    lead = q.shape[:-2]
    m = np.full((*lead, q.shape[-2]), -np.inf, acc)
    total = np.zeros_like(m)
    o = np.zeros((*lead, q.shape[-2], v.shape[-1]), acc)
    kv = np.ascontiguousarray(np.concatenate([k.astype(acc), v.astype(acc)], axis=-1))
    for t in range(n):
        src = (r - t) % n
        reqs = []
        if t < n - 1:  # the next block arrives while this one is computed
            nxt_len = runs_len(kruns[(src - 1) % n])
            nxt = np.empty((*lead, nxt_len, kv.shape[-1]), acc)
            reqs = _posted(comm, [comm.irecv(nxt, (r - 1) % n, _TAG_KV, "ring attention K/V"),
                                  comm.isend(kv, (r + 1) % n, _TAG_KV, "ring attention K/V")])
        kb, vb = kv[..., :ek], kv[..., ek:]
        for qsl, ksl, masked, q0, k0 in _pairs(qrun, kruns[src], causal):
            s = _scores(qs[..., qsl, :], kb[..., ksl, :], masked, q0, k0)
            mb = m[..., qsl]
            new = np.maximum(mb, s.max(axis=-1))
            safe = np.where(new == -np.inf, 0, new)
            s -= safe[..., None]
            np.exp(s, out=s)
            alpha = np.exp(mb - safe)
            total[..., qsl] = total[..., qsl] * alpha + s.sum(axis=-1)
            o[..., qsl, :] = o[..., qsl, :] * alpha[..., None] + s @ vb[..., ksl, :]
            m[..., qsl] = new
            _progress(comm, reqs)
        comm.wait_all(reqs)
        if t < n - 1:
            kv = nxt
    seen = total > 0
    o /= np.where(seen, total, 1)[..., None]
    lse = np.where(seen, np.where(m == -np.inf, 0, m) + np.log(np.where(seen, total, 1)), np.inf)
    return o.astype(q.dtype), lse


def runs_len(runs) -> int:
    """The token count of ``(start, length)`` runs. **Local**."""
    return sum(length for _, length in runs)


def _ring_backward(g, q, k, v, o, lse, comm, qrun, kruns, scale: float, causal: bool):
    """The gradients of query, key and value (FlashAttention's ring backward)."""
    n, r = comm.size, comm.rank
    acc = lse.dtype.type
    qs = np.multiply(q, acc(scale), dtype=acc)
    ga = g.astype(acc)
    delta = np.einsum("...ij,...ij->...i", ga, o.astype(acc))  # rowsum(dO * O)
    ek, ev = k.shape[-1], v.shape[-1]
    lead = q.shape[:-2]
    gq = np.zeros(qs.shape, acc)
    kv = np.ascontiguousarray(np.concatenate([k.astype(acc), v.astype(acc)], axis=-1))
    pending = []  # the send of the previous block's gradient partial
    grad = None  # this step's block's gradient
    for t in range(n + 1):
        src = (r - t) % n
        if t == n:  # the last step: this rank's own block's gradient arrives
            if n == 1:
                got = grad
            else:
                got = np.empty((*lead, runs_len(kruns[r]), ek + ev), acc)
                comm.wait_all([comm.irecv(got, (r - 1) % n, _TAG_GRAD, "ring attention dK/dV"),
                               *pending])
            return (wrap_array((gq * acc(scale)).astype(q.dtype)),
                    wrap_array(np.ascontiguousarray(got[..., :ek]).astype(k.dtype)),
                    wrap_array(np.ascontiguousarray(got[..., ek:]).astype(v.dtype)))
        reqs = []
        if t < n - 1:
            nxt = np.empty((*lead, runs_len(kruns[(src - 1) % n]), ek + ev), acc)
            reqs = _posted(comm, [comm.irecv(nxt, (r - 1) % n, _TAG_KV, "ring attention K/V"),
                                  comm.isend(kv, (r + 1) % n, _TAG_KV, "ring attention K/V")])
        part = None
        if t > 0:  # the other ranks' part of this block's gradient, added after compute
            part = np.empty(kv.shape, acc)
            reqs += _posted(comm, [comm.irecv(part, (r - 1) % n, _TAG_GRAD,
                                              "ring attention dK/dV")])
        kb, vb = kv[..., :ek], kv[..., ek:]
        grad = np.zeros(kv.shape, acc)
        gk, gv = grad[..., :ek], grad[..., ek:]
        for qsl, ksl, masked, q0, k0 in _pairs(qrun, kruns[src], causal):
            s = _scores(qs[..., qsl, :], kb[..., ksl, :], masked, q0, k0)
            s -= lse[..., qsl, None]
            w = np.exp(s, out=s)  # the weights, in place of the scores
            gb = ga[..., qsl, :]
            gv[..., ksl, :] += np.swapaxes(w, -1, -2) @ gb
            ds = gb @ np.swapaxes(vb[..., ksl, :], -1, -2)
            ds -= delta[..., qsl, None]
            ds *= w
            gq[..., qsl, :] += ds @ kb[..., ksl, :]
            gk[..., ksl, :] += np.swapaxes(ds, -1, -2) @ qs[..., qsl, :]
            _progress(comm, reqs)
            _progress(comm, pending)
        comm.wait_all([*reqs, *pending])
        if part is not None:
            grad += part
        if n > 1:
            # completed at the next step's end (serial too: its receiver waits for it first)
            pending = [comm.isend(grad, (r + 1) % n, _TAG_GRAD, "ring attention dK/dV")]
        if t < n - 1:
            kv = nxt
    raise AssertionError("unreachable")  # pragma: no cover


# ------------------------------------------------------------------ the autograd node


def _ring_layout(x: DTensor) -> int | None:
    """The mesh dim whose Shard splits ``x``'s sequence dim (ndim - 2), when exactly one
    does and the others are Replicate or a Shard of a leading dim; else None."""
    seq = x.ndim - 2
    dims = []
    for m, p in enumerate(x.placements):
        if isinstance(p, Shard) and p.dim in (seq, -2):
            dims.append(m)
        elif not (isinstance(p, Replicate) or (isinstance(p, Shard) and 0 <= p.dim < seq)):
            return None
    return dims[0] if len(dims) == 1 else None


def ring_attention_applies(query, key, value, attn_mask=None, dropout_p: float = 0.0,
                           enable_gqa: bool = False) -> bool:
    """Whether ``scaled_dot_product_attention`` of these runs ring attention (the module's
    notes): three DTensors of at least 2 dims, on one CPU mesh (the ring kernels run on
    numpy arrays; a GPU mesh keeps the op's gathering rule), with equal placements that
    shard the sequence dim on one mesh dim, the same leading shape, no mask and no
    dropout. **Local**."""
    if not all(isinstance(a, DTensor) for a in (query, key, value)):
        return False
    if attn_mask is not None or dropout_p != 0 or query.ndim < 2:
        return False
    if not (query.device_mesh == key.device_mesh == value.device_mesh):
        return False
    if query.device_mesh.device_type != "cpu":  # the ring kernels are numpy's
        return False
    if not (query.placements == key.placements == value.placements):
        return False
    if not (query.ndim == key.ndim == value.ndim
            and tuple(query.shape[:-2]) == tuple(key.shape[:-2]) == tuple(value.shape[:-2])):
        return False
    return _ring_layout(query) is not None


class _RingAttention(Function):
    @staticmethod
    def forward(ctx, query, key, value, is_causal, scale):
        mdim = _ring_layout(query)
        mesh = query.device_mesh
        comm = mesh.get_group(mdim)
        balanced = _active() is not None
        n, r = comm.size, comm.rank
        qrun = sequence_positions(query.shape[-2], n, r, balanced)
        kruns = [sequence_positions(key.shape[-2], n, j, balanced) for j in range(n)]
        if is_causal and query.shape[-2] != key.shape[-2]:
            raise ArgumentError(
                f"ring attention: a causal attention needs as many queries as keys, got "
                f"{query.shape[-2]} and {key.shape[-2]} (placements {list(query.placements)})")
        sc = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
        q, k, v = (a.to_local().numpy() for a in (query, key, value))
        _check_float(q, k, v)
        o, lse = _ring_forward(q, k, v, comm, qrun, kruns, sc, is_causal)
        out = DTensor.from_local(wrap_array(o), mesh, query.placements,
                                 shape=(*query.shape[:-1], value.shape[-1]))
        ctx.save_for_backward(query, key, value, out)
        ctx.ring = (mdim, qrun, kruns, sc, is_causal, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out = ctx.saved_tensors
        mdim, qrun, kruns, sc, causal, lse = ctx.ring
        mesh = query.device_mesh
        comm = mesh.get_group(mdim)
        if grad.placements != out.placements:
            grad = grad.redistribute(mesh, out.placements)
        local = (a.to_local().numpy() for a in (grad, query, key, value, out))
        gq, gk, gv = _ring_backward(*local, lse, comm, qrun, kruns, sc, causal)
        return (DTensor.from_local(gq, mesh, query.placements, shape=tuple(query.shape)),
                DTensor.from_local(gk, mesh, key.placements, shape=tuple(key.shape)),
                DTensor.from_local(gv, mesh, value.placements, shape=tuple(value.shape)),
                None, None)


def _check_float(*arrays) -> None:
    for a in arrays:
        if a.dtype.kind != "f" or a.dtype != arrays[0].dtype:
            raise ArgumentError(
                f"ring attention: query, key and value must share one floating dtype, got "
                f"{[str(x.dtype) for x in arrays]}")


def _ring_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
    """The ``scaled_dot_product_attention`` plug: ring attention where it applies (on
    local Tensors inside :func:`context_parallel`: their shards), else NotImplemented."""
    ctx = _active()
    if ctx is not None and all(isinstance(a, Tensor) and not isinstance(a, DTensor)
                               for a in (query, key, value)):
        mesh = ctx.mesh
        pl = [Shard(query.ndim - 2)]
        n = mesh.size(0)
        r = mesh.get_local_rank(0)
        want = runs_len(sequence_positions(ctx.seq_len, n, r, True))
        for name, a in (("query", query), ("key", key), ("value", value)):
            have = a.shape[-2] if a.ndim >= 2 else 0
            if a.ndim < 2 or have != want:
                raise ArgumentError(
                    f"context_parallel: the attention's {name} has {have} positions on rank "
                    f"{r}, this rank's shard of the sequence of {ctx.seq_len} holds {want} "
                    f"(mesh {tuple(mesh.shape)})")
        d = [DTensor.from_local(a, mesh, pl, shape=(*a.shape[:-2], ctx.seq_len, a.shape[-1]))
             for a in (query, key, value)]
        if attn_mask is not None or dropout_p != 0 or not ring_attention_applies(*d):
            raise ArgumentError(
                f"context_parallel: ring attention takes no attn_mask and no dropout, and "
                f"query, key and value of one batch and head shape; got attn_mask "
                f"{'None' if attn_mask is None else tuple(attn_mask.shape)}, dropout_p "
                f"{dropout_p}, shapes {[tuple(a.shape) for a in (query, key, value)]}")
        return _RingAttention.apply(*d, bool(is_causal), scale).to_local()
    if not ring_attention_applies(query, key, value, attn_mask, dropout_p, enable_gqa):
        return NotImplemented
    if enable_gqa and not query.shape[-3:-2] == key.shape[-3:-2] == value.shape[-3:-2]:
        return NotImplemented
    return _RingAttention.apply(query, key, value, bool(is_causal), scale)


_F.set_attention_plug(_ring_sdpa)


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
    if _active() is not None:
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
    _STATE.ctx = _Context(mesh, seq if seq is not None else 0)
    try:
        yield
    finally:
        _STATE.ctx = None
        for b, whole in zip(buffers, saved):
            if not any(b is x for x in keep):
                _replace(b, whole)


def _replace(t: Tensor, arr) -> None:
    """Make ``t`` hold ``arr`` (PyTorch's in-place ``set_``): a buffer's identity stays."""
    t._arr = arr
    t._storage = None
    t._std = None
