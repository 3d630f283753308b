"""Sharding rules of view/shape ops, through a dimension-map analysis.

Every view op is described by where each output dim comes from: an input dim unchanged
(permute, transpose, unsqueeze, a full slice...), a group of input dims merged or split
(view, reshape, flatten, unflatten), or nothing (a new or broadcast dim). Candidates:

- all-Replicate, and every Partial kind kept (a view selects or copies elements, which
  commutes with any reduction);
- a Shard on an input dim that maps to an output dim unchanged carries over;
- a Shard on the FIRST input dim of a merged/split group carries over to the group's
  first output dim only when it is exact: on every mesh coordinate, the local block viewed
  locally must be the torch.chunk shard of the new global shape. This is checked from the
  sizes and the mesh shape (including nested sharding over several mesh dims) by the
  rule's ``nd_check``; uneven shards often fail it, and the input is then redistributed
  (the view never raises where it would succeed on one device);
- any other dim (sliced by ``narrow``/``select``/``[...]``, split by ``split``/``chunk``/
  ``unbind``, broadcast by ``expand``, squeezed, a non-first dim of a group) must be
  unsharded.

The local kernels of ``view``/``reshape``/``flatten``/``unflatten``/``expand`` receive the
LOCAL output shape (the op table's ``local_fn`` computes it from the output spec).
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Sequence

from ..errors import ArgumentError, DimError, NoRuleError, ShardingError, ViewError
from ..layout import shard_range
from ._core import Candidate, OpSchema, P, R, RuleResult, S, norm_dim, register_rule

__all__ = ["infer_size", "reshape_groups", "view_rule"]

_KINDS = ("sum", "avg", "max", "min")


def infer_size(shape: Sequence[int], numel: int) -> tuple[int, ...]:
    """``shape`` with its one ``-1`` inferred for ``numel`` elements (PyTorch's errors)."""
    shape = tuple(operator.index(s) for s in shape)
    neg = [i for i, s in enumerate(shape) if s == -1]
    if len(neg) > 1:
        raise ViewError("only one dimension can be inferred")
    if any(s < -1 for s in shape):
        raise ViewError(f"invalid shape dimension {min(shape)}")
    known = math.prod(s for s in shape if s != -1)
    if neg and known and numel % known == 0:
        shape = shape[: neg[0]] + (numel // known,) + shape[neg[0] + 1 :]
    if -1 in shape or math.prod(shape) != numel:
        raise ViewError(f"shape '{list(shape)}' is invalid for input of size {numel}")
    return shape


def reshape_groups(
    a: tuple[int, ...], b: tuple[int, ...]
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Minimal groups ``(input dims, output dims)`` of equal products for ``a -> b``.

    Size-1 dims belong to no group. Needs ``prod(a) == prod(b) > 0``. **Local**.
    """
    ai = [i for i, n in enumerate(a) if n != 1]
    bj = [j for j, n in enumerate(b) if n != 1]
    groups = []
    p = q = 0
    while p < len(ai):
        gi, gj = [ai[p]], [bj[q]]
        f, t = a[ai[p]], b[bj[q]]
        p += 1
        q += 1
        while f != t:
            if f < t:
                f *= a[ai[p]]
                gi.append(ai[p])
                p += 1
            else:
                t *= b[bj[q]]
                gj.append(bj[q])
                q += 1
        groups.append((tuple(gi), tuple(gj)))
    return groups


@functools.lru_cache(maxsize=4096)
def _nested_exact(n_in: int, rest_in: int, n_out: int, rest_out: int, ks: tuple[int, ...]) -> bool:
    """Whether splitting ``n_in`` (times ``rest_in``) and ``n_out`` (times ``rest_out``) over
    the mesh dims of sizes ``ks`` (nested, in order) gives equal blocks everywhere."""
    blocks = [(n_in, n_out)]
    for k in ks:
        nxt = []
        for bi, bo in blocks:
            for c in range(k):
                li, lo = shard_range(bi, k, c)[1], shard_range(bo, k, c)[1]
                if li * rest_in != lo * rest_out:
                    return False
                nxt.append((li, lo))
        blocks = nxt
    return True


def _map_result(
    schema: OpSchema,
    out_shapes: tuple[tuple[int, ...], ...],
    dim_map: dict[int, int],
    extra: int = 0,
    nd_check=None,
) -> RuleResult:
    """Candidates of a view: Shard(d) -> Shard(dim_map[d]), all Partial kinds kept."""
    n_out = len(out_shapes)
    none = (None,) * extra
    cands = [Candidate((R,) * (n_out + 1) + none)]
    for d in sorted(dim_map):
        cands.append(Candidate((S(dim_map[d]),) * n_out + (S(d),) + none))
    for k in _KINDS:
        cands.append(Candidate((P(k),) * (n_out + 1) + none))
    dtype = schema.args[0].dtype  # type: ignore[union-attr]
    return RuleResult(out_shapes, (dtype,) * n_out, tuple(cands), nd_check)


def _reshape(schema: OpSchema, shape_in: tuple[int, ...], shape_out: tuple[int, ...]) -> RuleResult:
    """Rule of a reshape ``shape_in -> shape_out`` (equal numel)."""
    if math.prod(shape_in) == 0:
        return _map_result(schema, (shape_out,), {})
    groups = reshape_groups(shape_in, shape_out)
    dim_map: dict[int, int] = {}
    merged: dict[int, tuple[int, int, int]] = {}  # first input dim -> (out dim, rest_in, rest_out)
    for gi, gj in groups:
        dim_map[gi[0]] = gj[0]
        if len(gi) > 1 or len(gj) > 1:
            rest_in = math.prod(shape_in[d] for d in gi[1:])
            rest_out = math.prod(shape_out[d] for d in gj[1:])
            merged[gi[0]] = (gj[0], rest_in, rest_out)
    mesh_shape = schema.mesh_shape

    def nd_check(combo: tuple[Candidate, ...]) -> bool:
        for d, (o, rest_in, rest_out) in merged.items():
            sd = S(d)
            ks = tuple(mesh_shape[m] for m, c in enumerate(combo) if c.placements[1] == sd)
            if ks and not _nested_exact(shape_in[d], rest_in, shape_out[o], rest_out, ks):
                return False
        return True

    return _map_result(schema, (shape_out,), dim_map, nd_check=nd_check if merged else None)


def _permutation(schema: OpSchema, perm: Sequence[int]) -> RuleResult:
    shape = schema.args[0].shape  # type: ignore[union-attr]
    return _map_result(
        schema, (tuple(shape[d] for d in perm),), {d: j for j, d in enumerate(perm)}
    )


def _dims(value: object) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)  # type: ignore[arg-type]


def _keep_except(ndim: int, removed: Sequence[int], keep_dim: bool = False) -> dict[int, int]:
    """Dim map of an op that removes (or, with ``keep_dim``, only unshards) some dims."""
    out, j = {}, 0
    for d in range(ndim):
        if d in removed:
            j += keep_dim
            continue
        out[d] = j
        j += 1
    return out


def _full_slice(s: slice, n: int) -> bool:
    return (
        s.start in (None, 0) and (s.stop is None or s.stop >= n) and s.step in (None, 1)
    )


def _getitem(schema: OpSchema, key: object) -> RuleResult:
    shape = schema.args[0].shape  # type: ignore[union-attr]
    ndim = len(shape)
    items = key if isinstance(key, tuple) else (key,)
    consumed = 0
    for it in items:
        if isinstance(it, slice):
            consumed += 1
        elif it is None or it is Ellipsis:
            continue
        elif isinstance(it, bool) or not hasattr(it, "__index__"):
            raise NoRuleError(
                "__getitem__: advanced indexing (tensors, lists, bool masks) of a DTensor has "
                f"no sharding rule (index {key!r}); use basic indexing (ints, slices, None, "
                "...) or index the full_tensor()"
            )
        else:
            consumed += 1
    if consumed > ndim:
        raise DimError(f"__getitem__: too many indices for tensor of dimension {ndim}")
    if Ellipsis not in items:
        items = (*items, Ellipsis)
    out_shape: list[int] = []
    dim_map: dict[int, int] = {}
    src = 0
    for it in items:
        if it is None:
            out_shape.append(1)
        elif it is Ellipsis:
            for _ in range(ndim - consumed):
                dim_map[src] = len(out_shape)
                out_shape.append(shape[src])
                src += 1
        elif isinstance(it, slice):
            if it.step is not None and it.step <= 0:
                raise ArgumentError(f"__getitem__: step must be greater than zero (got {it.step})")
            n = shape[src]
            if _full_slice(it, n):
                dim_map[src] = len(out_shape)
            out_shape.append(len(range(*it.indices(n))))
            src += 1
        else:
            i, n = operator.index(it), shape[src]
            if not -n <= i < n:
                raise DimError(
                    f"__getitem__: index {i} is out of bounds for dimension {src} with size {n}"
                )
            src += 1
    return _map_result(schema, (tuple(out_shape),), dim_map)


def _split_sizes(op: str, schema: OpSchema, n: int) -> list[int]:
    if op == "unbind":
        return [1] * n
    if op == "chunk":
        chunks = operator.index(schema.get("chunks"))  # type: ignore[arg-type]
        if chunks <= 0:
            raise ViewError(f"chunk expects `chunks` to be greater than 0, got: {chunks}")
        if n == 0:
            return [0] * chunks
        size = -(-n // chunks)
    else:
        spec = schema.get("split_size_or_sections")
        if not isinstance(spec, (int,)) and hasattr(spec, "__iter__"):
            sizes = [operator.index(s) for s in spec]  # type: ignore[union-attr]
            if sum(sizes) != n or any(s < 0 for s in sizes):
                raise ViewError(
                    f"split_with_sizes expects split_sizes to sum exactly to {n}, but got "
                    f"split_sizes={sizes}"
                )
            return sizes
        size = operator.index(spec)  # type: ignore[arg-type]
        if size <= 0:
            if size == 0 and n == 0:
                return [0]
            raise ViewError(f"split expects split_size be positive, but got split_size={size}")
    count = max(-(-n // size), 1)
    return [size] * (count - 1) + [n - size * (count - 1)]


_VIEW_OPS = ("view", "reshape", "flatten", "unflatten", "permute", "transpose", "swapaxes",
             "swapdims", "t", "movedim", "moveaxis", "squeeze", "unsqueeze", "expand",
             "expand_as", "narrow", "select", "getitem", "split", "chunk", "unbind")


@register_rule(*_VIEW_OPS)
def view_rule(schema: OpSchema) -> RuleResult:
    """Rule of every view/shape op (see the module docstring). **Local**."""
    op = schema.op
    a = schema.args[0]
    shape = a.shape  # type: ignore[union-attr]
    ndim = len(shape)
    get = schema.get
    if op in ("view", "reshape"):
        return _reshape(schema, shape, infer_size(_dims(get("shape")), math.prod(shape)))
    if op == "flatten":
        if ndim == 0:
            return _reshape(schema, shape, (1,))
        s, e = norm_dim(get("start_dim", 0), ndim, op), norm_dim(get("end_dim", -1), ndim, op)
        if s > e:
            raise ViewError("flatten() has invalid args: start_dim cannot come after end_dim")
        return _reshape(schema, shape, shape[:s] + (math.prod(shape[s : e + 1]),) + shape[e + 1 :])
    if op == "unflatten":
        d = norm_dim(get("dim"), ndim, op)
        try:
            sizes = infer_size(_dims(get("sizes")), shape[d])
        except ViewError as exc:
            raise ViewError(
                f"unflatten: Provided sizes {list(_dims(get('sizes')))} don't multiply up to "
                f"the size of dim {d} ({shape[d]}) in the input tensor"
            ) from exc
        return _reshape(schema, shape, shape[:d] + sizes + shape[d + 1 :])
    if op == "permute":
        perm = [norm_dim(d, ndim, op) for d in _dims(get("dims"))]
        if sorted(perm) != list(range(ndim)):
            raise ViewError(f"permute(): dims {list(_dims(get('dims')))} are not a permutation "
                            f"of the {ndim} dims of the input")
        return _permutation(schema, perm)
    if op in ("transpose", "swapaxes", "swapdims"):
        perm = list(range(ndim))
        if ndim:
            d0, d1 = norm_dim(get("dim0"), ndim, op), norm_dim(get("dim1"), ndim, op)
            perm[d0], perm[d1] = perm[d1], perm[d0]
        return _permutation(schema, perm)
    if op == "t":
        if ndim > 2:
            raise ViewError(f"t() expects a tensor with <= 2 dimensions, but self is {ndim}D")
        return _permutation(schema, list(range(ndim))[::-1])
    if op in ("movedim", "moveaxis"):
        src = [norm_dim(d, ndim, op) for d in _dims(get("source"))]
        dst = [norm_dim(d, ndim, op) for d in _dims(get("destination"))]
        if len(src) != len(dst) or len(set(src)) != len(src) or len(set(dst)) != len(dst):
            raise ViewError(f"movedim: invalid source {src} or destination {dst} dims")
        order = [d for d in range(ndim) if d not in src]
        for d, s in sorted(zip(dst, src)):
            order.insert(d, s)
        return _permutation(schema, order)
    if op == "squeeze":
        dim = get("dim")
        dims = range(ndim) if dim is None else {norm_dim(d, ndim, op) for d in _dims(dim)}
        removed = [d for d in dims if ndim and shape[d] == 1]
        out = tuple(n for d, n in enumerate(shape) if d not in removed)
        return _map_result(schema, (out,), _keep_except(ndim, removed))
    if op == "unsqueeze":
        d = norm_dim(get("dim"), ndim + 1, op)
        out = shape[:d] + (1,) + shape[d:]
        return _map_result(schema, (out,), {i: i + (i >= d) for i in range(ndim)})
    if op in ("expand", "expand_as"):
        if op == "expand":
            sizes = tuple(operator.index(s) for s in _dims(get("sizes")))
        else:
            sizes = schema.args[1].shape  # type: ignore[union-attr]
        lead = len(sizes) - ndim
        if lead < 0:
            raise ViewError(
                f"expand: the number of sizes provided ({len(sizes)}) must be greater or equal "
                f"to the number of dimensions in the tensor ({ndim})"
            )
        out, dim_map = list(sizes), {}
        for d, n in enumerate(shape):
            t = sizes[lead + d]
            if t == -1 or t == n:
                out[lead + d] = n
                dim_map[d] = lead + d
            elif n != 1:
                raise ViewError(
                    f"The expanded size of the tensor ({t}) must match the existing size ({n}) "
                    f"at non-singleton dimension {lead + d}.  Target sizes: {list(sizes)}.  "
                    f"Tensor sizes: {list(shape)}"
                )
        if any(n < 0 for n in out):
            raise ViewError(f"expand: invalid sizes {list(sizes)} for a tensor of shape {shape}")
        return _map_result(schema, (tuple(out),), dim_map, extra=int(op == "expand_as"))
    if op == "narrow":
        d = norm_dim(get("dim"), ndim, op)
        start, length = operator.index(get("start")), operator.index(get("length"))  # type: ignore[arg-type]
        n = shape[d]
        if not -n <= start <= n or length < 0 or (start % n if n else 0) + length > n:
            raise ViewError(f"narrow(): start {start} and length {length} do not fit dimension "
                            f"{d} of size {n}")
        out = shape[:d] + (length,) + shape[d + 1 :]
        return _map_result(schema, (out,), _keep_except(ndim, [d], keep_dim=True))
    if op == "select":
        d = norm_dim(get("dim"), ndim, op)
        index = operator.index(get("index", 0))  # type: ignore[arg-type]
        if not -shape[d] <= index < shape[d]:
            raise DimError(f"select(): index {index} out of range for tensor of size "
                           f"{list(shape)} at dimension {d}")
        return _map_result(schema, (shape[:d] + shape[d + 1 :],), _keep_except(ndim, [d]))
    if op == "getitem":
        return _getitem(schema, get("idx"))
    # split / chunk / unbind
    if ndim == 0:
        raise ViewError(f"{op} expects at least a 1-dimensional tensor")
    d = norm_dim(get("dim", 0), ndim, op)
    sizes = _split_sizes(op, schema, shape[d])
    if op == "unbind":
        outs = tuple(shape[:d] + shape[d + 1 :] for _ in sizes)
        return _map_result(schema, outs, _keep_except(ndim, [d]))
    outs = tuple(shape[:d] + (n,) + shape[d + 1 :] for n in sizes)
    if not outs:
        raise ShardingError(f"{op}: no pieces for dimension {d} of shape {shape}")
    return _map_result(schema, outs, _keep_except(ndim, [d], keep_dim=True))
