"""Source mutations of ``python -m launch mutate``: realistic one-line bugs in product modules.

This module owns the table of :class:`launch._source.SourcePatch` mutations, one entry per
bug, grouped by the layer of ``DESIGN.md`` it hits (:data:`LAYERS`). Each is an exact snippet
of a module (it must occur exactly once) and its replacement: a wrong sign, an off-by-one, a
wrong divisor, a wrong axis, swapped arguments, a dropped term. It imports nothing of the
product, so that the test plugin can look a name up and install the import hook before any
product module is imported (:mod:`launch._mutant`).

Compiled kernels are not mutated (the Cython extension is built once): a kernel mutation
changes the array-module twin of a compiled loop or the Python code that feeds it; an entry
with ``mode="python"`` runs its tests with ``DTENSOR_FASTPATH=0`` because only that path runs
the mutated twin (or, for the redistribute programs, the Python executor: the compiled front
runs its own copy of the cached programs).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._source import SourcePatch

__all__ = ["BY_NAME", "LAYERS", "SOURCE_MUTATIONS", "SourceMutation"]

#: Layers of DESIGN.md that source mutations hit, with what each covers.
LAYERS = {
    "local": "the local strided tensor: strides, views, factories",
    "allocator": "the CPU allocator and its statistics",
    "kernels": "local kernels: array-module twins and the Python side of compiled loops",
    "index": "indexing writes: setitem, index_put, index_add, scatter on shards",
    "backward": "backward formulas of the op records (dtensor/ops)",
    "optim": "optimizers, learning-rate schedulers, gradient clipping",
    "checkpoint": "checkpoint metadata, file offsets and partial reads",
    "solver": "the auto-shard solver",
    "placements": "layout math and specs (placements/)",
    "redistribute": "redistribute programs and the collectives they call",
}


@dataclass(frozen=True)
class SourceMutation:
    """One source mutation: its name (``<layer>.source.<short>``), layer, what it breaks,
    the patch, and ``note`` (the analysis of a survivor: an equivalent mutant)."""

    name: str
    layer: str
    description: str
    patch: SourcePatch
    note: str = ""


def _m(layer: str, short: str, module: str, old: str, new: str, description: str,
       mode: str | None = None, note: str = "") -> SourceMutation:
    return SourceMutation(f"{layer}.source.{short}", layer, description,
                          SourcePatch(module, old, new, mode), note)


SOURCE_MUTATIONS: tuple[SourceMutation, ...] = (
    # -- local tensor engine --------------------------------------------------------------
    _m("local", "contiguous_strides", "dtensor.local.strides",
       "        if size > 1:\n            acc *= size",
       "        if size > 2:\n            acc *= size",
       "contiguous strides skip dims of size 2 (off by one in the size test)"),
    _m("local", "narrow_end", "dtensor.local.tensor",
       "(slice(start, start + length),)", "(slice(start, start + length + 1),)",
       "narrow takes one entry too many", mode="python"),
    _m("local", "unsqueeze_stride", "dtensor.local.tensor",
       "new_stride = shape[dim] * strides[dim] if dim < ndim else 1",
       "new_stride = strides[dim] if dim < ndim else 1",
       "unsqueeze gives the new dim the stride of the next dim (drops the size factor)"),
    _m("local", "view_strides", "dtensor.local.strides",
       "new_strides[view_d] = view_numel * chunk_base_stride",
       "new_strides[view_d] = view_numel + chunk_base_stride",
       "view strides add instead of multiply the chunk's base stride", mode="python"),
    # -- allocator ------------------------------------------------------------------------
    _m("allocator", "peak", "dtensor.local.allocator",
       "            self._peak_allocated = max(self._peak_allocated, self._allocated)\n"
       "            return Block(self, span, nbytes)",
       "            self._peak_allocated = max(self._peak_allocated, nbytes)\n"
       "            return Block(self, span, nbytes)",
       "peak_allocated_bytes tracks the largest request, not the allocated total"),
    _m("allocator", "split_tail", "dtensor.local.allocator",
       "tail = _Span(span.segment, span.address + size, rest)",
       "tail = _Span(span.segment, span.address + rest, rest)",
       "a split span's free tail starts at the wrong address (overlapping blocks)"),
    _m("allocator", "merge_prev", "dtensor.local.allocator",
       "            self._absorb(prv, span)\n            span = prv",
       "            self._absorb(prv, span)",
       "freeing after a merge with the previous span files the absorbed span"),
    _m("allocator", "free_stats", "dtensor.local.allocator",
       "        self._allocated -= span.size\n        segment = span.segment",
       "        self._allocated -= span.requested\n        segment = span.segment",
       "a free subtracts the requested, not the rounded, size from allocated_bytes"),
    # -- kernels --------------------------------------------------------------------------
    _m("kernels", "layer_norm_bw_twin", "dtensor.local.kernels.nn",
       "    gx -= xc * xp.mean(gh * xc, axis=axes, keepdims=True)\n",
       "    gx += xc * xp.mean(gh * xc, axis=axes, keepdims=True)\n",
       "the layer_norm backward twin adds the projection term instead of subtracting it",
       mode="python"),
    _m("kernels", "layer_norm_bw_twin_eps", "dtensor.local.kernels.nn",
       "    var += acc.type(eps)\n    rstd = xp.sqrt(var, out=var)",
       "    rstd = xp.sqrt(var, out=var)",
       "the layer_norm backward twin drops eps from the variance", mode="python"),
    _m("kernels", "gelu_bw_twin_pdf", "dtensor.local.kernels.pointwise",
       "        pdf *= work.type(-0.5)\n", "        pdf *= work.type(0.5)\n",
       "the gelu backward twin's Gaussian density loses the minus of its exponent",
       mode="python"),
    _m("kernels", "gelu_bw_twin_tanh", "dtensor.local.kernels.pointwise",
       "        d *= x2 * work.type(3 * 0.044715) + work.type(1)",
       "        d *= x2 * work.type(0.044715) + work.type(1)",
       "the tanh-gelu backward twin drops the factor 3 of the cubic term's derivative",
       mode="python"),
    _m("kernels", "softmax_shift", "dtensor.local.kernels.nn",
       "    z = xp.subtract(a, m, dtype=acc_dtype(a.dtype))\n",
       "    z = xp.subtract(a, m * 0, dtype=acc_dtype(a.dtype))\n",
       "softmax forgets to subtract the row maximum (overflow on large logits)",
       mode="python"),
    _m("kernels", "adam_bias_correction", "dtensor.optim._optimizers",
       "beta1, beta2, lr / (1 - beta1**t), math.sqrt(1 - beta2**t), eps)",
       "beta1, beta2, lr / (1 - beta1**t), math.sqrt(1 - beta2**(t - 1)), eps)",
       "the compiled Adam step gets the second moment's bias correction of the last step"),
    _m("kernels", "sharded_softmax", "dtensor.local.kernels.nn",
       "    z = _log_softmax_arr(x, d, shard)\n    if not take_log:",
       "    z = _log_softmax_arr(x, d, None)\n    if not take_log:",
       "the class-sharded (log_)softmax normalises over its own block only",
       note="runs only under MPI with class-sharded logits; mpi/ops/test_vocab_parallel.py "
       "kills it at once, but it comes 4th of the 13 MPI files the selection orders, after "
       "the MPI run's share of the budget: a limit of the order, not a gap"),
    # -- indexing writes ------------------------------------------------------------------
    _m("index", "local_slice_start", "dtensor.ops.shard_kernels",
       "    return slice(first - lo, last - lo + 1, step), slice(k0, k1)",
       "    return slice(first - lo + 1, last - lo + 1, step), slice(k0, k1)",
       "a sharded slice write starts one entry late in its block"),
    _m("index", "write_int_offset", "dtensor.ops.shard_kernels",
       "            key.append(v - lo)", "            key.append(v)",
       "x[i] = v on a sharded dim writes the global index into the block"),
    _m("index", "write_inside_upper", "dtensor.ops.shard_kernels",
       "            inside &= (a >= offs[k]) & (a < offs[k] + lens[k])",
       "            inside &= (a >= offs[k]) & (a <= offs[k] + lens[k])",
       "an advanced-index write keeps entries one past its block (off by one)"),
    _m("index", "index_add_offset", "dtensor.ops.shard_kernels",
       "return kernel(input, dim, wrap_array(idx[inside] - lo), rows, alpha)",
       "return kernel(input, dim, wrap_array(idx[inside] - n), rows, alpha)",
       "index_add on a sharded dim shifts by the block length, not its offset"),
    _m("index", "scatter_add_write", "dtensor.local.kernels.index",
       "        xp.add.at(out, where, xp.broadcast_to(vals, idx.shape))",
       "        out[where] = xp.broadcast_to(vals, idx.shape)",
       "scatter_add overwrites instead of adding"),
    _m("index", "index_put_accumulate", "dtensor.local.kernels.index",
       "    if not accumulate:\n        input[key] = values",
       "    if accumulate:\n        input[key] = values",
       "index_put_ inverts accumulate"),
    _m("index", "getitem_masked_block", "dtensor.ops.shard_kernels",
       "    inside = (arr >= lo) & (arr < hi)\n    return inside, np.where(inside, arr - lo, 0)",
       "    inside = (arr >= lo) & (arr < hi)\n    return inside, np.where(inside, arr, 0)",
       "advanced getitem on a sharded dim reads global positions inside the block"),
    # -- backward formulas ----------------------------------------------------------------
    _m("backward", "mean_divisor", "dtensor.ops.reduction",
       "return (_back(g, x.shape, dims, keepdim) / max(_count(x.shape, dims), 1),)",
       "return (_back(g, x.shape, dims, keepdim) / max(_count(x.shape, dims) - 1, 1),)",
       "mean's gradient divides by n - 1"),
    _m("backward", "var_factor", "dtensor.ops.reduction",
       "return (_back(g, x.shape, dims, keepdim) * centered * _over(2.0, n),)",
       "return (_back(g, x.shape, dims, keepdim) * centered * _over(1.0, n),)",
       "var's gradient drops the factor 2"),
    _m("backward", "matmul_transpose", "dtensor.ops.linalg",
       "        ga = g1 @ b1.mT\n", "        ga = g1 @ b1\n",
       "matmul's input gradient multiplies by b, not b transposed"),
    _m("backward", "linear_weight", "dtensor.ops.linalg",
       "        gw = g2.mT @ x2\n", "        gw = x2.mT @ g2\n",
       "linear's weight gradient has its operands swapped (transposed gradient)"),
    _m("backward", "softmax_term", "dtensor.ops.nn",
       "    return (o * (g - (g * o).sum(dim=dim, keepdim=True)),)",
       "    return (o * (g - g.sum(dim=dim, keepdim=True)),)",
       "softmax's gradient drops the output from the subtracted sum"),
    _m("backward", "log_softmax_sign", "dtensor.ops.nn",
       "    return (g - o.exp() * g.sum(dim=dim, keepdim=True),)",
       "    return (g + o.exp() * g.sum(dim=dim, keepdim=True),)",
       "log_softmax's gradient adds the softmax term"),
    _m("backward", "layer_norm_composite", "dtensor.ops.nn",
       "    gw = g * xhat if need[1] else None",
       "    gw = g * xc if need[1] else None",
       "layer_norm's recorded weight gradient uses the centred, not the normalised, input"),
    _m("backward", "cross_entropy_mean", "dtensor.ops.nn",
       "            denom = (wt * valid).sum() if wt is not None else valid.sum()",
       "            denom = (wt * valid).sum() if wt is not None else target.numel()",
       "cross_entropy's mean gradient counts ignored targets"),
    _m("backward", "sqrt_half", "dtensor.ops.pointwise",
       "grad=lambda g, out: g * 0.5 / out)", "grad=lambda g, out: g * 0.5 * out)",
       "sqrt's gradient multiplies by the output instead of dividing",
       note="unit/ops/test_autograd.py (every op's gradient against finite differences) "
       "kills it in seconds, but it is the 11th of the 12 unit files of the ops folder the "
       "selection orders by size, after the budget: a limit of the order, not a gap"),
    _m("backward", "cos_sign", "dtensor.ops.pointwise",
       "grad=lambda g, x: -(g * x.sin()))", "grad=lambda g, x: g * x.sin())",
       "cos's gradient loses its minus sign"),
    _m("backward", "mse_target", "dtensor.ops.nn",
       "    return (d if need[0] else None, -d if need[1] else None)",
       "    return (d if need[0] else None, d if need[1] else None)",
       "mse_loss's target gradient loses its minus sign"),
    _m("backward", "cumsum_reverse", "dtensor.ops.reduction",
       "    return (g.flip(d).cumsum(d).flip(d),)", "    return (g.cumsum(d),)",
       "cumsum's gradient is a forward, not a reversed, cumulative sum"),
    # -- optimizers -----------------------------------------------------------------------
    _m("optim", "sgd_dampening", "dtensor.optim._optimizers",
       "buf.mul_(momentum).add_(g, alpha=1 - group[\"dampening\"])",
       "buf.mul_(momentum).add_(g, alpha=group[\"dampening\"])",
       "SGD's momentum buffer adds dampening * g instead of (1 - dampening) * g"),
    _m("optim", "sgd_weight_decay", "dtensor.optim._optimizers",
       "        if wd != 0:\n            g = g.add(p, alpha=wd)\n        if momentum != 0:",
       "        if wd != 0:\n            g = g.add(p, alpha=-wd)\n        if momentum != 0:",
       "SGD's weight decay has the wrong sign"),
    _m("optim", "adam_second_moment", "dtensor.optim._optimizers",
       "v.mul_(beta2).addcmul_(g, g, value=1 - beta2)",
       "v.mul_(beta2).addcmul_(g, g, value=1 - beta1)",
       "Adam's second moment uses beta1", mode="python"),
    _m("optim", "adamw_decoupled", "dtensor.optim._optimizers",
       "0.0 if decoupled else wd, 1 - lr * wd if decoupled and wd != 0 else 1.0,",
       "0.0 if decoupled else wd, 1 - wd if decoupled and wd != 0 else 1.0,",
       "AdamW's decoupled decay forgets the learning rate (compiled step's input)"),
    _m("optim", "step_lr", "dtensor.optim.lr_scheduler",
       "if self.last_epoch == 0 or self.last_epoch % self.step_size != 0:",
       "if self.last_epoch == 0 or self.last_epoch % (self.step_size + 1) != 0:",
       "StepLR decays every step_size + 1 epochs"),
    _m("optim", "clip_coefficient", "dtensor.nn.utils",
       "coef = float(kind(max_norm) / (kind(total.numpy()) + kind(1e-6)))",
       "coef = float(kind(max_norm) / (kind(total.numpy()) ** 2 + kind(1e-6)))",
       "clip_grad_norm_ divides by the squared total norm"),
    # -- checkpoint -----------------------------------------------------------------------
    _m("checkpoint", "file_offset", "dtensor.checkpoint._dcp",
       "            offsets[writer] = offset + -(-nbytes // ALIGN) * ALIGN",
       "            offsets[writer] = offset + (nbytes // ALIGN) * ALIGN",
       "the next block's file offset rounds the block size down (blocks overlap)"),
    _m("checkpoint", "read_start", "dtensor.checkpoint._dcp",
       "    start = [lo - b for lo, b in zip(lo_g, block[\"offsets\"])]",
       "    start = [lo - b for lo, b in zip(lo_g, target.offsets)]",
       "a partial read measures its start from the target's box, not the saved block's"),
    _m("checkpoint", "read_last", "dtensor.checkpoint._dcp",
       "last = sum((s + n - 1) * st for s, n, st in zip(start, sub, strides)) + dtype.itemsize",
       "last = sum((s + n - 1) * st for s, n, st in zip(start, sub, strides))",
       "a partial read stops one element short"),
    _m("checkpoint", "block_box", "dtensor.checkpoint._dcp",
       "    hi_g = [min(a + n, b + m) for a, n, b, m in zip(target.offsets, target.lengths,",
       "    hi_g = [max(a + n, b + m) for a, n, b, m in zip(target.offsets, target.lengths,",
       "the overlap of a saved block and a target box takes the larger end"),
    # -- auto-shard solver ----------------------------------------------------------------
    _m("solver", "pair_cost", "dtensor.autoshard._solve",
       "            if choice[a] == ca and choice[b] == cb:\n                cost += value",
       "            if choice[a] == ca or choice[b] == cb:\n                cost += value",
       "a pair cost counts when either choice is taken, not both"),
    _m("solver", "bnb_prune", "dtensor.autoshard._solve",
       "if len(best) == k and cost + step_cost + low_cost >= -best[0][0] - 1e-12:",
       "if len(best) == k and cost + step_cost >= -best[0][0] - 1e-12:",
       "branch and bound prunes without the lower bound of the open variables"),
    _m("solver", "milp_product", "dtensor.autoshard._solve",
       "        row({y: 1.0, xa: -1.0, xb: -1.0}, -1.0, np.inf)",
       "        row({y: 1.0, xa: -1.0, xb: -1.0}, -2.0, np.inf)",
       "the integer program's pair term may be 0 when both choices are taken"),
    _m("solver", "bnb_heap", "dtensor.autoshard._solve",
       "                elif entry > best[0]:", "                elif entry < best[0]:",
       "branch and bound replaces its worst kept assignment by a worse one"),
    # -- placements -----------------------------------------------------------------------
    _m("placements", "chunk_size", "placements.layout",
       "    chunk = -(-n // k)\n", "    chunk = n // k\n",
       "shard sizes round down (floor) instead of torch.chunk's ceil"),
    _m("placements", "partial_fill_order", "placements.layout",
       "    for m in range(len(placements) - 1, -1, -1):",
       "    for m in range(len(placements)):",
       "partial_fill reads the mesh dims lowest first"),
    _m("placements", "box_offset", "placements.layout",
       "            offsets[p.dim] += start\n", "            offsets[p.dim] = start\n",
       "nested shards of one dim forget the outer block's offset"),
    # -- redistribute ---------------------------------------------------------------------
    _m("redistribute", "avg_divisor", "redistribute.execute.programs",
       "    return lambda: np.divide(out, k, out=out)",
       "    return lambda: np.divide(out, k - 1, out=out)",
       "a nonblocking avg reduction divides by k - 1",
       note="judged on the compiled path, where small nonblocking reductions take MPI's "
       "Iallreduce and finish here; the Python path's test stages send every exchange "
       "through node-shared memory (DTENSOR_SHM_MIN_BYTES=0), which never reaches this line"),
    _m("redistribute", "pack_order", "redistribute.execute.programs",
       "            copy(sbuf[start:stop].reshape(shape), x[index])",
       "            copy(sbuf[start:stop].reshape(shape)[::-1], x[index])",
       "the reduce-scatter pack reverses each slab", mode="python"),
)

BY_NAME = {m.name: m for m in SOURCE_MUTATIONS}
