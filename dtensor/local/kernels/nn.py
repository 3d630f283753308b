"""Neural-network local kernels: softmax, log_softmax, layer_norm, rms_norm, embedding,
cross_entropy, dropout and mse_loss (scaled_dot_product_attention: :mod:`.attention`).

All are **Local** plain functions with the names and arguments of
``torch.nn.functional``. Softmax-like kernels subtract the maximum first (numerically
stable); float16 and bfloat16 inputs compute in float32 and return their dtype. With the compiled
extension enabled, softmax and log_softmax along the last axis of a contiguous
float32/float64 host array, and layer_norm of a contiguous float32 host array, run one
compiled loop each (``fastpath._kernels``; its notes say how sums accumulate), as does
``layer_norm_backward`` (the fused gradient layer_norm's backward formula runs) on contiguous
float32/float64; the numpy code here serves everything else, and everything with
``DTENSOR_FASTPATH=0``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

import fastpath as _fp
from placements.errors import ArgumentError, DimError, DTypeError, ShardingError
from placements.meta import check_embedding_indices, is_floating
from placements.rules.nn import check_normalized_shape

from .. import rng as _random
from ..dtypes import to_dtype
from ..tensor import Tensor, _norm_dim, wrap_array
from .base import (
    FLOAT32,
    acc_dtype,
    as_array,
    broadcast_shapes,
    new_array,
    out_buffer,
    promote_types,
    tname,
    wrap,
    xp_of,
)

_REDUCTIONS = ("none", "mean", "sum")
# compiled softmax and layer_norm loops for contiguous float32/float64 host arrays
_KERNELS = _fp.kernels if _fp.ENABLED else None


def _float_input(op: str, input, dtype=None):
    """The input array (cast to ``dtype`` if given); it must be floating."""
    a = as_array(op, input)
    if dtype is not None:
        a = a.astype(to_dtype(dtype), copy=False)
    if not is_floating(a.dtype):
        raise DTypeError(f"{op}: expected a floating point tensor, got {tname(a.dtype)}")
    return a


class ClassShard(NamedTuple):
    """The block of classes a shard of logits holds: its first class, the number of classes
    in all, and ``reduce(array, op)``, which all-reduces an array (``op`` "max" or "sum")
    over the shards of the class dim and returns the result (collective)."""

    start: int
    total: int
    reduce: Callable


class BatchShard(NamedTuple):
    """The samples a shard of a mean loss holds, when its batch (or spatial) dims are
    sharded: ``samples``, the number of samples of the whole batch, and ``reduce(array)``,
    which sums an array over the batch shards (collective). The shard's loss is its own
    sum divided by the whole batch's denominator, so the shards' results add up to the
    mean (``P(sum)``)."""

    samples: int
    reduce: Callable


def _shifted(a, d: int, shard: ClassShard | None):
    """``(a - max, sum(exp(a - max)))`` along axis ``d`` (the max and the sum kept as dims
    of size 1, in ``acc_dtype(a.dtype)``), over every class of ``shard`` when given (its
    maximum reduced before the sum is taken; the sum is left to the caller to reduce)."""
    xp = xp_of(a)
    if a.shape[d] or shard is None:
        m = xp.max(a, axis=d, keepdims=True)
    else:  # an empty block of classes
        m = xp.full(a.shape[:d] + (1,) + a.shape[d + 1 :], -np.inf, a.dtype)
    if shard is not None:
        m = shard.reduce(xp.ascontiguousarray(m), "max")
    z = xp.subtract(a, m, dtype=acc_dtype(a.dtype))
    return z, xp.sum(xp.exp(z), axis=d, keepdims=True)


def _log_softmax_arr(a, d, shard: ClassShard | None = None):
    """log_softmax of array ``a`` along axis ``d``, in ``acc_dtype(a.dtype)`` (``a`` a
    block of the classes of ``shard`` when given: the result for its classes)."""
    z, total = _shifted(a, d, shard)
    if shard is not None:
        total = shard.reduce(total, "sum")
    z -= xp_of(a).log(total)
    return z


def sharded_softmax(input: Tensor, dim: int, dtype, take_log: bool, shard: ClassShard) -> Tensor:
    """(log_)softmax of the block ``input`` of a tensor sharded along ``dim`` as ``shard``
    says: the block of the whole tensor's result. **Collective** over the class shards."""
    op = "log_softmax" if take_log else "softmax"
    a = _float_input(op, input, dtype)
    x, d = _softmax_axis(op, a, dim)
    z = _log_softmax_arr(x, d, shard)
    if not take_log:
        xp_of(z).exp(z, out=z)
    return wrap(z.astype(a.dtype, copy=False).reshape(a.shape))


def _softmax_axis(op, a, dim):
    """(array, axis) for a softmax along ``dim``; a 0-d input is seen as shape (1,)."""
    d = _norm_dim(dim, a.ndim, op)
    return (a.reshape(1), 0) if a.ndim == 0 else (a, d)


def _compiled_softmax(x, d: int, take_log: bool):
    """The compiled (log_)softmax of array ``x`` along ``d``, or None where the compiled
    loop does not serve it (not the last axis, not a contiguous float32/float64 host array,
    or the extension is off)."""
    if _KERNELS is None or d != x.ndim - 1:
        return None
    return _KERNELS.softmax_lastdim(x, take_log, out_buffer)


def _short_softmax(op: str, input, dim, take_log: bool):
    """The compiled (log_)softmax of ``input`` for the common call (an int ``dim`` naming
    the last axis of an array of at least one dim), as a Tensor; None otherwise."""
    a = as_array(op, input)
    if type(dim) is not int or not a.ndim or (dim != -1 and dim != a.ndim - 1):
        return None
    r = _compiled_softmax(a, a.ndim - 1, take_log)
    return None if r is None else wrap_array(r)


def softmax(input: Tensor, dim: int, dtype=None) -> Tensor:
    """``exp(x) / sum(exp(x))`` along ``dim``, computed stably. **Local**.

    Parameters
    ----------
    input : Tensor
        Floating tensor (or pass ``dtype``).
    dim : int
    dtype : dtype, optional
        Cast the input to this dtype first.

    Returns
    -------
    Tensor
        NaN along slices that are all ``-inf``.
    """
    if dtype is None and _KERNELS is not None:
        r = _short_softmax("softmax", input, dim, False)
        if r is not None:
            return r
    a = _float_input("softmax", input, dtype)
    x, d = _softmax_axis("softmax", a, dim)
    r = _compiled_softmax(x, d, False)
    if r is not None:
        return wrap(r.reshape(a.shape))
    xp = xp_of(x)
    if x.size == 0:
        return wrap(new_array(a.shape, a.dtype, a))
    m = xp.max(x, axis=d, keepdims=True)
    o = out_buffer(x.shape, a.dtype, x) if acc_dtype(a.dtype) == a.dtype else None
    e = xp.subtract(x, m, out=o, dtype=acc_dtype(a.dtype))
    xp.exp(e, out=e)
    e /= xp.sum(e, axis=d, keepdims=True)
    return wrap(e.astype(a.dtype, copy=False).reshape(a.shape))


def log_softmax(input: Tensor, dim: int, dtype=None) -> Tensor:
    """``x - log(sum(exp(x)))`` along ``dim``, computed stably. **Local**.

    Parameters
    ----------
    input : Tensor
        Floating tensor (or pass ``dtype``).
    dim : int
    dtype : dtype, optional
        Cast the input to this dtype first.

    Returns
    -------
    Tensor
    """
    if dtype is None and _KERNELS is not None:
        r = _short_softmax("log_softmax", input, dim, True)
        if r is not None:
            return r
    a = _float_input("log_softmax", input, dtype)
    x, d = _softmax_axis("log_softmax", a, dim)
    r = _compiled_softmax(x, d, True)
    if r is not None:
        return wrap(r.reshape(a.shape))
    if x.size == 0:
        return wrap(new_array(a.shape, a.dtype, a))
    return wrap(_log_softmax_arr(x, d).astype(a.dtype, copy=False).reshape(a.shape))


def layer_norm(
    input: Tensor,
    normalized_shape,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """Normalise over the trailing ``normalized_shape`` dims, then scale and shift. **Local**.

    ``(x - mean) / sqrt(var + eps) * weight + bias`` with the biased variance.

    Parameters
    ----------
    input : Tensor
        Floating, of shape ``(*, *normalized_shape)``.
    normalized_shape : int or sequence of int
    weight, bias : Tensor, optional
        Of shape ``normalized_shape``.
    eps : float

    Returns
    -------
    Tensor
    """
    if _KERNELS is not None:
        a = as_array("layer_norm", input)
        w = None if weight is None else as_array("layer_norm", weight)
        b = None if bias is None else as_array("layer_norm", bias)
        r = _KERNELS.layer_norm(a, normalized_shape, w, b, eps, out_buffer)
        if r is not None:
            return wrap_array(r)
    a = _float_input("layer_norm", input)
    ns = check_normalized_shape("layer_norm", a.shape, normalized_shape)
    xp = xp_of(a)
    axes = tuple(range(a.ndim - len(ns), a.ndim))
    acc = acc_dtype(a.dtype)
    c = xp.subtract(a, xp.mean(a, axis=axes, keepdims=True, dtype=acc), dtype=acc)
    var = xp.mean(c * c, axis=axes, keepdims=True)
    var += acc.type(eps)
    c /= xp.sqrt(var, out=var)
    if weight is not None:
        c *= _affine_param("layer_norm", "weight", weight, ns)
    if bias is not None:
        c += _affine_param("layer_norm", "bias", bias, ns)
    return wrap(c.astype(a.dtype, copy=False))


def _layer_norm_backward_twin(g, a, ns: tuple, w, eps: float):
    """The array-module twin of ``fastpath._kernels.layer_norm_backward``: ``(grad_input,
    grad_weight)`` in ``acc_dtype(a.dtype)``, the row statistics taken once."""
    xp = xp_of(a)
    acc = acc_dtype(a.dtype)
    axes = tuple(range(a.ndim - len(ns), a.ndim))
    rows = tuple(range(a.ndim - len(ns)))
    if a.size == 0:
        return xp.zeros(a.shape, acc), xp.zeros(ns, acc)
    xc = xp.subtract(a, xp.mean(a, axis=axes, keepdims=True, dtype=acc), dtype=acc)
    var = xp.mean(xc * xc, axis=axes, keepdims=True)
    var += acc.type(eps)
    rstd = xp.sqrt(var, out=var)
    xp.reciprocal(rstd, out=rstd)
    xc *= rstd  # xhat
    gf = g.astype(acc, copy=False)
    gh = gf * w.astype(acc, copy=False) if w is not None else gf
    gw = xp.sum(gf * xc, axis=rows) if rows else gf * xc
    gx = gh - xp.mean(gh, axis=axes, keepdims=True)
    gx -= xc * xp.mean(gh * xc, axis=axes, keepdims=True)
    gx *= rstd
    return gx, gw


def layer_norm_backward(grad: Tensor, input: Tensor, normalized_shape,
                        weight: Tensor | None = None, eps: float = 1e-5):
    """``(grad_input, grad_weight)`` of :func:`layer_norm` at output gradient ``grad``,
    ``grad_weight`` (of shape ``normalized_shape``: ``grad * xhat`` summed over the leading
    dims) computed whether or not ``weight`` is given. **Local**.

    Each row's mean and rstd are taken once, as the forward takes them (the compiled loop:
    the forward's own float32 sums), then the gradient in one fused pass per row: a
    contiguous float32/float64 host ``input`` and ``grad`` of one dtype (and such a weight)
    run ``fastpath._kernels.layer_norm_backward`` with the extension enabled; everything
    else its array-module twin.
    """
    g = _float_input("layer_norm_backward", grad)
    a = _float_input("layer_norm_backward", input)
    ns = check_normalized_shape("layer_norm_backward", a.shape, normalized_shape)
    if g.shape != a.shape:
        raise ShardingError(f"layer_norm_backward: grad of shape {list(g.shape)} does not "
                            f"match input of shape {list(a.shape)}")
    w = None if weight is None else _affine_param("layer_norm_backward", "weight", weight, ns)
    if _KERNELS is not None:
        r = _KERNELS.layer_norm_backward(g, a, w, math.prod(ns), eps, True, out_buffer)
        if r is not None:
            gx, gw = r
            return wrap_array(gx), wrap(gw.astype(a.dtype).reshape(ns))
    gx, gw = _layer_norm_backward_twin(g, a, ns, w, eps)
    return wrap(gx.astype(a.dtype, copy=False)), wrap(gw.astype(a.dtype, copy=False))


def _affine_param(op: str, name: str, p, ns: tuple):
    arr = as_array(op, p)
    if tuple(arr.shape) != ns:
        raise ShardingError(
            f"{op}: {name} of shape {list(arr.shape)} does not match normalized_shape "
            f"{list(ns)}"
        )
    return arr


def rms_eps(dtype, eps: float | None) -> float:
    """The ``eps`` of an ``rms_norm`` of ``dtype`` data: ``eps``, or when None the machine
    epsilon of the dtype it computes in (float32 for float16, as PyTorch). **Local**."""
    return float(np.finfo(acc_dtype(np.dtype(dtype))).eps) if eps is None else eps


def rms_norm(input: Tensor, normalized_shape, weight: Tensor | None = None,
             eps: float | None = None) -> Tensor:
    """Root-mean-square normalisation over the trailing ``normalized_shape`` dims. **Local**.

    ``x / sqrt(mean(x ** 2) + eps) * weight`` (PyTorch's ``rms_norm``): the normalised
    value is computed in float32 for float16 input and cast to the input's dtype, then
    multiplied by ``weight`` (so the result has the promoted dtype of both).

    Parameters
    ----------
    input : Tensor
        Floating, of shape ``(*, *normalized_shape)``.
    normalized_shape : int or sequence of int
    weight : Tensor, optional
        Of shape ``normalized_shape``.
    eps : float, optional
        Added to the mean square; None: the machine epsilon of the computing dtype
        (``torch.finfo(dtype).eps``).

    Returns
    -------
    Tensor
    """
    a = _float_input("rms_norm", input)
    ns = check_normalized_shape("rms_norm", a.shape, normalized_shape)
    w = None if weight is None else _affine_param("rms_norm", "weight", weight, ns)
    xp = xp_of(a)
    acc = acc_dtype(a.dtype)
    x = a.astype(acc, copy=False)
    ms = xp.mean(x * x, axis=tuple(range(a.ndim - len(ns), a.ndim)), keepdims=True)
    ms += acc.type(rms_eps(a.dtype, eps))
    r = xp.divide(x, xp.sqrt(ms, out=ms)).astype(a.dtype, copy=False)
    return wrap(r if w is None else xp.multiply(r, w))


def check_index_range(idx, n: int) -> None:
    """Raise DimError unless every embedding index in array ``idx`` lies in ``[0, n)``.

    **Local** (a distributed embedding passes the GLOBAL ``num_embeddings``)."""
    if idx.size:
        xp = xp_of(idx)
        lo, hi = int(xp.min(idx)), int(xp.max(idx))
        if lo < 0 or hi >= n:
            raise DimError(
                f"embedding: index {lo if lo < 0 else hi} out of range in self "
                f"(num_embeddings {n})"
            )


def embedding(input: Tensor, weight: Tensor, padding_idx=None) -> Tensor:
    """Rows of ``weight`` selected by the integer tensor ``input``. **Local**.

    Parameters
    ----------
    input : Tensor
        Integer indices in ``[0, num_embeddings)``, any shape.
    weight : Tensor
        ``(num_embeddings, embedding_dim)``.
    padding_idx : int, optional
        Accepted for compatibility (it only matters for gradients); validated.

    Returns
    -------
    Tensor
        ``input.shape + (embedding_dim,)``.

    Raises
    ------
    DTypeError
        For indices of a non-integer dtype.
    DimError
        For an index out of range (an IndexError).
    """
    idx, w = as_array("embedding", input), as_array("embedding", weight)
    check_embedding_indices(idx.dtype)
    if w.ndim != 2:
        raise ShardingError(f"embedding: weight must be 2-D, got {w.ndim}-D")
    n = w.shape[0]
    if padding_idx is not None and not -n <= padding_idx < n:
        raise DimError(f"embedding: padding_idx {padding_idx} must be within num_embeddings {n}")
    check_index_range(idx, n)
    xp = xp_of(w)
    o = new_array(tuple(idx.shape) + (w.shape[1],), w.dtype, w)
    return wrap(xp.take(w, idx, axis=0, out=o))


def _check_reduction(op: str, reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ArgumentError(f"{op}: {reduction!r} is not a valid value for reduction")


def cross_entropy(
    input: Tensor,
    target: Tensor,
    weight: Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    """Cross-entropy loss between logits and class indices or class probabilities. **Local**.

    Parameters
    ----------
    input : Tensor
        Logits ``(C,)``, ``(N, C)`` or ``(N, C, d1, ...)`` (class dim 1, or 0 when 1-D).
    target : Tensor
        Class indices (integer, shape of ``input`` without the class dim; entries equal
        to ``ignore_index`` are skipped) or class probabilities (floating, shape of
        ``input``).
    weight : Tensor, optional
        Per-class weights ``(C,)``.
    ignore_index : int
    reduction : {'mean', 'sum', 'none'}
        ``'mean'`` over class indices divides by the summed weights of the non-ignored
        targets (NaN when all are ignored); over probabilities by the number of samples.
    label_smoothing : float
        In ``[0, 1]``: the target is mixed with the uniform distribution.

    Returns
    -------
    Tensor
    """
    return sharded_cross_entropy(input, target, weight, ignore_index, reduction,
                                 label_smoothing, None)


def sharded_cross_entropy(
    input: Tensor,
    target: Tensor,
    weight: Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    shard: ClassShard | None,
    batch: BatchShard | None = None,
) -> Tensor:
    """:func:`cross_entropy` of logits ``input`` that hold the block of classes ``shard``
    describes (None: all of them), and of the block of samples ``batch`` describes when
    given (None: the whole batch). **Collective** over the class shards when ``shard`` is
    given (two all-reduces of per-sample vectors: the maximum, then the sums), and with
    ``batch`` and ``reduction='mean'`` over the batch shards: the block's summed loss is
    divided by the whole batch's denominator (class indices: one all-reduce of one number,
    the summed weights of the non-ignored targets; probabilities: ``batch.samples``, no
    communication), so the blocks' results add up to the mean. Else **Local**.

    The loss of a sample is ``log(sum(exp(z))) - z[target]`` with ``z`` its logits less
    their maximum; the sum and the picked logit (zero on the shards that do not hold the
    target class) add up over the shards, as do the weighted sums of ``z`` that label
    smoothing and probability targets need. ``target`` is whole for class indices (each
    shard picks its classes) and a block like ``input``'s for probabilities; ``weight``
    is whole.
    """
    _check_reduction("cross_entropy", reduction)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ArgumentError(
            f"cross_entropy: label_smoothing must be between 0.0 and 1.0, got {label_smoothing}"
        )
    x = _float_input("cross_entropy", input)
    t = as_array("cross_entropy", target)
    cdim = 1 if x.ndim >= 2 else 0
    lo, n_local = 0 if shard is None else shard.start, x.shape[cdim]
    n_classes = n_local if shard is None else shard.total
    xp = xp_of(x)
    w = None if weight is None else as_array("cross_entropy", weight)
    if w is not None and tuple(w.shape) != (n_classes,):
        raise ShardingError(
            f"cross_entropy: weight of shape {list(w.shape)}, expected [{n_classes}]"
        )
    z, sumexp = _shifted(x, cdim, shard)
    sumexp = sumexp.squeeze(cdim)
    acc = z.dtype
    # Class weights of this block, shaped to broadcast along the class dim.
    wb = None if w is None else (
        w[lo : lo + n_local].astype(acc).reshape((-1,) + (1,) * (x.ndim - 1 - cdim)))
    # Note: class-index targets may be of any integer dtype (PyTorch requires int64).
    if is_floating(t.dtype):
        if t.shape != x.shape:
            raise ShardingError(
                f"cross_entropy: probability target of shape {list(t.shape)} must match "
                f"input shape {list(x.shape)}"
            )
        p = t.astype(acc)
        if label_smoothing:
            p = p * (1.0 - label_smoothing) + label_smoothing / n_classes
        if wb is not None:
            p = p * wb
        sums = [sumexp, xp.sum(p * z, axis=cdim), xp.sum(p, axis=cdim)]
        sumexp, pz, psum = _summed(sums, shard, xp)
        loss = xp.log(sumexp) * psum - pz
        denom = loss.size if batch is None else batch.samples
    else:
        loss, denom = _nll(x, t, z, sumexp, wb, w, cdim, ignore_index, label_smoothing, lo,
                           n_classes, shard, xp)
        if batch is not None and reduction == "mean":
            denom = batch.reduce(xp.asarray(denom, dtype=acc).reshape(1))[0]
    if reduction == "none":
        r = loss
    else:
        r = xp.sum(loss)
        if reduction == "mean":
            r = r / denom
    return wrap(xp.asarray(r).astype(x.dtype, copy=False))


def _summed(parts: list, shard: ClassShard | None, xp) -> list:
    """Per-sample partial sums over this block's classes, summed over every shard (one
    all-reduce for all of them)."""
    if shard is None:
        return parts
    total = shard.reduce(xp.ascontiguousarray(xp.stack(parts)), "sum")
    return list(total)


def _nll(x, t, z, sumexp, wb, w, cdim, ignore_index, label_smoothing, lo, n_classes, shard,
         xp):
    """Per-element loss of class-index targets, and the denominator of its mean (``z``:
    the logits less their maximum, ``sumexp`` this block's sum of their exponentials)."""
    expected = tuple(x.shape[:cdim]) + tuple(x.shape[cdim + 1:])
    if t.dtype.kind not in "iu" or tuple(t.shape) != expected:
        raise ShardingError(
            f"cross_entropy: expected a class-index target of an integer dtype and shape "
            f"{list(expected)} (or probabilities of shape {list(x.shape)}), got "
            f"{tname(t.dtype)} of shape {list(t.shape)}"
        )
    valid = t != ignore_index
    bad = valid & ((t < 0) | (t >= n_classes))
    if xp.any(bad):
        raise DimError(f"cross_entropy: target {int(t[bad][0])} is out of bounds "
                         f"(classes 0..{n_classes - 1})")
    tc = xp.where(valid, t, 0).astype(np.int64)
    n_local = x.shape[cdim]
    inside = (tc >= lo) & (tc < lo + n_local)
    if n_local:
        pos = xp.expand_dims(xp.where(inside, tc - lo, 0), cdim)
        picked = xp.where(inside, xp.take_along_axis(z, pos, axis=cdim).squeeze(cdim), 0)
    else:
        picked = xp.zeros(tc.shape, z.dtype)
    parts = [sumexp, picked]
    if label_smoothing:
        parts.append(xp.sum(z if wb is None else z * wb, axis=cdim))
    parts = _summed(parts, shard, xp)
    log_s = xp.log(parts[0])
    wt = valid.astype(z.dtype) if w is None else xp.where(valid, w.astype(z.dtype)[tc], 0)
    loss = xp.where(valid, (log_s - parts[1]) * wt, 0)
    denom = xp.sum(wt)
    if label_smoothing:
        w_all = n_classes if w is None else xp.sum(w.astype(z.dtype))
        smooth = xp.where(valid, log_s * w_all - parts[2], 0)
        loss = loss * (1.0 - label_smoothing) + smooth * (label_smoothing / n_classes)
    return loss, denom


def _dropout_apply(a, p: float, seed: int, offset: int, global_shape: tuple, starts: tuple,
                   out=None):
    """Dropout of the block ``a`` at ``starts`` of a tensor of ``global_shape``.

    The keep mask depends only on ``(seed, offset + global element index)``, so a shard of
    a distributed tensor gets the mask of the matching slice of the whole tensor.
    """
    xp = xp_of(a)
    u = _random.random_block("uniform", global_shape, starts, a.shape, FLOAT32, seed, offset,
                             xp)
    scale = a.dtype.type(0.0 if p == 1 else 1.0 / (1.0 - p))
    noise = (u >= FLOAT32.type(p)).astype(a.dtype)
    noise *= scale
    return xp.multiply(a, noise, out=out)


def dropout(input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:
    """Zero each element with probability ``p`` and scale the rest by ``1 / (1 - p)``.

    **Local.** Random bits come from the global counter-based generator
    (``dt.manual_seed``); ``training=False`` (or ``p == 0``) returns ``input`` itself.

    Parameters
    ----------
    input : Tensor
        Floating tensor.
    p : float
        In ``[0, 1]``.
    training : bool
    inplace : bool
        Write the result into ``input`` and return it.

    Returns
    -------
    Tensor
    """
    if not 0.0 <= p <= 1.0:
        raise ArgumentError(f"dropout probability has to be between 0 and 1, but got {p}")
    a = _float_input("dropout", input)
    if not training or p == 0:
        return input
    seed, offset = _random._reserve(a.size)
    if inplace:
        _dropout_apply(a, p, seed, offset, a.shape, (0,) * a.ndim, out=a)
        return input
    o = out_buffer(a.shape, a.dtype, a)
    return wrap(_dropout_apply(a, p, seed, offset, a.shape, (0,) * a.ndim, out=o))


def mse_loss(input: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    """Mean squared error ``(input - target) ** 2``, reduced. **Local**.

    Parameters
    ----------
    input, target : Tensor
        Floating; they broadcast.
    reduction : {'mean', 'sum', 'none'}

    Returns
    -------
    Tensor
    """
    _check_reduction("mse_loss", reduction)
    x, y = _float_input("mse_loss", input), _float_input("mse_loss", target)
    broadcast_shapes("mse_loss", x.shape, y.shape)
    dt = promote_types(x.dtype, y.dtype)
    xp = xp_of(x)
    d = xp.subtract(x, y, dtype=acc_dtype(dt))
    d *= d
    if reduction == "none":
        return wrap(d.astype(dt, copy=False))
    r = xp.sum(d) if reduction == "sum" else xp.mean(d)
    return wrap(xp.asarray(r).astype(dt))
