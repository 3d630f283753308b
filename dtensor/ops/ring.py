"""Ring attention's kernels: the strategy of ``scaled_dot_product_attention`` (and of its
fused backward) whose query, key, value and output are all ``Shard(seq)`` on one mesh dim
(the rules: :mod:`placements.rules.nn`; the public face and :func:`dtensor.context_parallel`:
:mod:`dtensor.ring_attention`).

**Forward.** Each rank keeps its queries; the key/value blocks travel around the ring of
that mesh dim (``Comm.isend`` / ``irecv``, key and value in one message, the next block's
transfer posted before the current block's compute so that the two overlap) and an online
softmax (running row maximum and sum; the log-sum-exp kept for the backward) combines the
blocks. The output is ``Shard(seq)`` as the query.

**Backward** (``scaled_dot_product_attention_backward``'s ring strategy, which the
forward's formula calls): the key/value blocks pass around the ring again, with the
partial key/value gradients of each block travelling one step behind it (sent once a
block's compute ends, received and added during the next one); a last step brings each
block's gradient home. It reads the forward's output and log-sum-exp, which the forward
kernel keeps per query block (:data:`_SAVED`, dropped with the query's array or when the
backward takes them); without them (a backward of other tensors, the strategy validator)
it runs the forward's ring first.

**Layouts.** A ``Shard(seq)`` DTensor has dtensor's layout (``torch.chunk`` blocks,
uneven ones included) unless :func:`context` says that a ``dt.context_parallel`` context
is active (:func:`set_context`, per thread): then the sequence is in the *load-balanced*
order of :func:`sequence_positions`. The kernels read it when they run (the propagation
cache keys do not hold it) and the backward uses the forward's. A causal mask is the
global one (blocks of keys wholly after a rank's queries are skipped).

On a GPU mesh the blocks go through host memory (the kernels are numpy's and
point-to-point messages take host buffers).
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from placements.errors import ArgumentError
from placements.layout import shard_range
from placements.rules import OpSchema, OpStrategy

from ..local.backend import array_module_of
from ..local.tensor import Tensor, wrap_array

__all__ = ["BLOCK_ROWS", "OVERLAP", "RingContext", "context", "ring_backward_local",
           "ring_dim", "ring_local", "runs_len", "sequence_positions", "set_context"]

_TAG_KV, _TAG_GRAD = 3401, 3402
#: Whether the ring's transfers overlap compute (True) or are completed as soon as posted
#: (False: communication and compute serial; the benchmark's reference, nothing else).
OVERLAP = True


@dataclass(frozen=True)
class RingContext:
    """An active ``dt.context_parallel``: its mesh and the whole sequence length."""

    mesh: object
    seq_len: int


_STATE = threading.local()


def context() -> RingContext | None:
    """The ``dt.context_parallel`` context active in this thread, or None. **Local**."""
    return getattr(_STATE, "ctx", None)


def set_context(ctx: RingContext | None) -> None:
    """Enter (``ctx``) or leave (None) a ``dt.context_parallel`` context in this thread.
    **Local**."""
    _STATE.ctx = ctx


def sequence_positions(seq_len: int, n: int, rank: int, balanced: bool) -> list[tuple[int, int]]:
    """The global positions rank ``rank`` of ``n`` holds of a sequence of ``seq_len``, as
    ``(start, length)`` runs in local order: one run (dtensor's ``Shard`` layout) or, load
    balanced, the early and the late chunk (:mod:`dtensor.ring_attention`'s notes).
    **Local**."""
    if not balanced:
        return [shard_range(seq_len, n, rank)]
    sizes = [shard_range(seq_len, n, j)[1] for j in range(n)]
    early = [-(-m // 2) for m in sizes]
    late = [m - e for m, e in zip(sizes, early)]
    start_early = sum(early[:rank])
    start_late = sum(early) + sum(late[rank + 1:])
    return [(start_early, early[rank]), (start_late, late[rank])]


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


# ------------------------------------------------------------------ the strategy's kernels


def ring_dim(placements, seq: int) -> int | None:
    """The mesh dim whose ``Shard(seq)`` is in ``placements`` (an input's target placements
    under a strategy), or None: the ring strategy's mesh dim when ``placements`` are a
    key's. **Local**."""
    if placements is None:
        return None
    for m, p in enumerate(placements):
        if p.is_shard() and p.dim in (seq, -2):  # Shard(-2) names the same dim
            return m
    return None


def _runs(comm, lq: int, lk: int, balanced: bool):
    """This rank's query runs and every rank's key runs."""
    n, r = comm.size, comm.rank
    return (sequence_positions(lq, n, r, balanced),
            [sequence_positions(lk, n, j, balanced) for j in range(n)])


def _array(t):
    """The host ndarray of a kernel argument (a local Tensor or an array)."""
    a = t._arr if isinstance(t, Tensor) else t
    return a if isinstance(a, np.ndarray) else array_module_of(a).asnumpy(a)


def _like(a: np.ndarray, t) -> Tensor:
    """``a`` as a local Tensor on ``t``'s device (the kernels run on the host)."""
    arr = t._arr if isinstance(t, Tensor) else t
    return wrap_array(a if isinstance(arr, np.ndarray) else array_module_of(arr).asarray(a))


def _scale(e: int, scale: float | None) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(e)


#: Per query array (by id; dropped when it dies): the forward results the backward reads,
#: ``[(key ref, value ref, causal, scale, (qrun, kruns, out, lse)), ...]``.
_SAVED: dict[int, list] = {}


def _keep(q, k, v, causal: bool, scale: float, payload: tuple) -> None:
    qa = q._arr if isinstance(q, Tensor) else q
    key = id(qa)
    entries = _SAVED.get(key)
    if entries is None:
        entries = _SAVED[key] = []
        weakref.finalize(qa, _SAVED.pop, key, None)
    ka = k._arr if isinstance(k, Tensor) else k
    va = v._arr if isinstance(v, Tensor) else v
    entries.append((weakref.ref(ka), weakref.ref(va), causal, scale, payload))


def _taken(q, k, v, causal: bool, scale: float) -> tuple | None:
    """The forward's kept results for these arrays (removed), or None."""
    entries = _SAVED.get(id(q._arr if isinstance(q, Tensor) else q))
    if not entries:
        return None
    ka = k._arr if isinstance(k, Tensor) else k
    va = v._arr if isinstance(v, Tensor) else v
    for i, (kr, vr, c, s, payload) in enumerate(entries):
        if kr() is ka and vr() is va and c == causal and s == scale:
            del entries[i]
            return payload
    return None


def _check(op: str, causal: bool, lq: int, lk: int, arrays) -> None:
    if causal and lq != lk:  # (the rules offer the ring only then: a direct call's check)
        raise ArgumentError(f"{op}: a causal ring attention needs as many queries as keys, "
                            f"got {lq} and {lk}")
    if any(a.dtype.kind != "f" or a.dtype != arrays[0].dtype for a in arrays):
        raise ArgumentError(f"{op}: query, key and value must share one floating dtype, got "
                            f"{[str(a.dtype) for a in arrays]}")


def ring_local(schema: OpSchema, strategy: OpStrategy) -> Callable | None:
    """``scaled_dot_product_attention``'s kernel under the ring strategy (the key is
    ``Shard(seq)``: the rule's ring candidate), or None for another strategy. **Local**;
    the kernel it returns is **Collective** over the ring's mesh dim (point-to-point)."""
    q, k = schema.args[0], schema.args[1]
    m = ring_dim(strategy.input_placements[1], len(q.shape) - 2)
    if m is None:
        return None
    mesh = strategy.output_specs[0].mesh
    lq, lk = q.shape[-2], k.shape[-2]

    def local(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        comm = mesh.get_group(m)
        causal = bool(is_causal)
        arrays = [_array(a) for a in (query, key, value)]
        _check("scaled_dot_product_attention", causal, lq, lk, arrays)
        qrun, kruns = _runs(comm, lq, lk, context() is not None)
        sc = _scale(arrays[0].shape[-1], scale)
        o, lse = _ring_forward(*arrays, comm, qrun, kruns, sc, causal)
        _keep(query, key, value, causal, sc, (qrun, kruns, o, lse))
        return _like(o, query)

    return local


def ring_backward_local(schema: OpSchema, strategy: OpStrategy) -> Callable | None:
    """``scaled_dot_product_attention_backward``'s kernel under the ring strategy (the key
    is ``Shard(seq)``), or None for another strategy: the forward's kept output and
    log-sum-exp, else the forward's ring run first. **Local**; the kernel it returns is
    **Collective** over the ring's mesh dim (point-to-point)."""
    q, k = schema.args[1], schema.args[2]
    m = ring_dim(strategy.input_placements[2], len(q.shape) - 2)
    if m is None:
        return None
    mesh = strategy.output_specs[0].mesh
    lq, lk = q.shape[-2], k.shape[-2]

    def local(grad, query, key, value, is_causal, scale, enable_gqa):
        comm = mesh.get_group(m)
        causal = bool(is_causal)
        arrays = [_array(a) for a in (query, key, value)]
        _check("scaled_dot_product_attention_backward", causal, lq, lk, arrays)
        sc = _scale(arrays[0].shape[-1], scale)
        kept = _taken(query, key, value, causal, sc)
        if kept is None:
            qrun, kruns = _runs(comm, lq, lk, context() is not None)
            o, lse = _ring_forward(*arrays, comm, qrun, kruns, sc, causal)
        else:
            qrun, kruns, o, lse = kept
        gq, gk, gv = _ring_backward(_array(grad), *arrays, o, lse, comm, qrun, kruns, sc,
                                    causal)
        return _like(gq._arr, query), _like(gk._arr, key), _like(gv._arr, value)

    return local
