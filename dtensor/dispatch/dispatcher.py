"""The Python dispatcher of ops on DTensors and its propagation cache.

``dispatch(info, args, kwargs)`` serves one call of a table op (:mod:`dtensor.ops.table`)
whose arguments include a DTensor:

1. bind the call to the op's parameters (a per-op binder precomputed once);
2. build the cache key from metadata only: the op name, the default float dtype, one marker
   per tensor-like argument (a DTensor's spec, a python scalar's type, a 0-d value's dtype,
   ``None``) and the values of the op's decision-relevant static parameters;
3. on a miss, ask the op's sharding rule (:func:`placements.rules.propagate`) for the
   cheapest strategy under the redistribute cost model, then store a self-contained
   :class:`CacheEntry`: the redistribute plan of every input, the kernel to run and the
   output specs;
4. run the entry: redistribute the inputs per the stored plans, call the kernel on the local
   tensors and wrap the outputs with the stored specs.

Every input to the key and to the strategy choice is metadata that is identical on every
rank, so all ranks take the same decision and issue the same collectives. The cache is a
bounded LRU (``DTENSOR_PROP_CACHE_SIZE``, default 4096) with hit/miss/eviction counters,
registered with :mod:`placements.cache` like every other cache (:func:`clear_caches`).

The debug tools attach through :func:`add_listener` (they see every entry before it runs)
and :func:`current_op`; :func:`decide` gives a decision without running it. The compiled
front (:mod:`dtensor.dispatch.compiled`) serves repeated calls from compiled code and falls
back to :func:`lookup` and :func:`run_entry`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from placements import Placement, Replicate
from placements.cache import LRUCache, all_stats, clear_all
from placements.env import env_int
from placements.errors import (
    ConfigError,
    DimError,
    DTypeError,
    MeshError,
    NoRuleError,
    ShardingError,
    SignatureError,
)
from placements.layout import partial_fill
from placements.meta import dtype_kind
from placements.rules import ArgMeta, OpSchema, OpStrategy, propagate
from placements.spec import DTensorSpec
from placements.types import placement_list
from redistribute.cost import default_cost_model
from redistribute.execute import execute as _execute
from redistribute.plan import plan as _plan
from redistribute.plan import redistribute_cost

from ..distributed.abstract import ALIASES, AbstractMesh, EntryRunner
from ..distributed.dtensor import DTensor, allocator_for
from ..local import dtypes as _dtypes
from ..local.kernels.base import quiet_call
from ..local.tensor import Tensor, wrap_array
from ..ops.shard_kernels import kernel_op
from ..ops.table import MOVES_ONLY, OPS, OpInfo
from .index_args import (
    INDEX_PARAMS,
    INDEX_TENSOR_PARAMS,
    check_index_args,
    gather_dtensor_index,
    mask_fill,
    replicate_local_index,
)

__all__ = [
    "CacheEntry",
    "Redist",
    "add_listener",
    "cache_stats",
    "clear_caches",
    "clear_prop_cache",
    "current_op",
    "decide",
    "describe",
    "dispatch",
    "drop_front_entries",
    "execute_move",
    "keep_shards",
    "lookup",
    "move_input",
    "prop_cache_stats",
    "remove_listener",
    "run_entry",
    "set_prop_cache_size",
    "use_compiled_moves",
    "wrap_outputs",
]

#: The binder's marker of a parameter without a value (no default).
MISSING = object()
_new = DTensor.__new__
# Static-argument types that need _freeze to become (or to be refused as) key parts.
_COMPOUND = frozenset({list, tuple, slice, np.ndarray, Tensor, DTensor})
_PY_SCALARS = (bool, int, float, complex)
# Note: numpy scalars take part as python scalars of their kind (weak dtypes), as in the
# local kernels; a 0-d Tensor or ndarray is a 0-d tensor operand (its own dtype).
_SCALAR_KIND = {"b": bool, "i": int, "u": int, "f": float, "c": complex}
# Parameters that a method call may give as varargs (``x.view(2, 3)``, ``x.permute(1, 0)``)
# when they are required: an optional one (``roll``'s ``dims=None``) is an ordinary argument.
_SIZE_PARAMS = frozenset({"shape", "size", "sizes", "dims"})


# -- current op (read by dtensor.debug.CommDebugMode) ----------------------------------------
_current_op: str | None = None


def current_op() -> str | None:
    """The op whose inputs are being redistributed right now, or whose kernel runs a
    collective of its own (:func:`dtensor.ops.shard_kernels.kernel_op`), or None. **Local**."""
    return _current_op or kernel_op()


# -- listeners (the debug tools' way in) --------------------------------------------------------
Listener = Callable[["CacheEntry", bool, list, object], None]
_listeners: list[Listener] = []
_missed = False  # whether the last lookup missed the propagation cache


def add_listener(fn: Listener) -> None:
    """Call ``fn(entry, miss, values, mesh)`` before every dispatched op runs. **Local**.

    ``entry`` is the op's :class:`CacheEntry` (the chosen strategy, the stored redistribute
    plans, the output specs), ``miss`` whether the propagation cache missed for this call,
    ``values`` the call's bound arguments (DTensors not yet replaced by their local tensors;
    a listener must not modify them) and ``mesh`` the mesh. A listener may raise to stop the
    op before it communicates. While a listener is registered, every call of a table op on
    DTensors reaches :func:`run_entry`: the compiled front drops its entries and keeps none.
    """
    _listeners.append(fn)
    if _FRONT is not None:
        _FRONT.invalidate()


def remove_listener(fn: Listener) -> None:
    """Stop calling ``fn`` (added with :func:`add_listener`). **Local**."""
    try:
        _listeners.remove(fn)
    except ValueError:
        raise ConfigError(f"remove_listener: {fn!r} is not a registered listener") from None


# -- binding ---------------------------------------------------------------------------------
class _Binder:
    """How one op's calls bind to its parameters; built once per :class:`OpInfo`."""

    __slots__ = (
        "fill",
        "index",
        "info",
        "name",
        "nparams",
        "pack_idx",
        "params",
        "static_idx",
        "tensor_idx",
        "variadic_idx",
    )

    def __init__(self, info: OpInfo) -> None:
        params = tuple(info.params)
        self.info = info
        self.name = info.name
        self.params = params
        self.nparams = len(params)
        self.index = {p: i for i, p in enumerate(params)}
        self.fill = [info.defaults.get(p, MISSING) for p in params]
        self.tensor_idx = tuple(self.index[p] for p in info.tensor_params)
        self.static_idx = tuple(self.index[p] for p in info.static_params)
        self.variadic_idx = -1 if info.variadic is None else self.index[info.variadic]
        last = params[-1] if params else None
        foldable = (last in _SIZE_PARAMS and last not in info.defaults) or last == info.variadic
        self.pack_idx = self.nparams - 1 if foldable else -1

    def bind(self, args: Sequence[object], kwargs: Mapping[str, object]) -> list:
        """Values of every parameter in order (defaults filled in). **Local**."""
        n = len(args)
        nparams = self.nparams
        if n > nparams or (self.pack_idx >= 0 and n - 1 == self.pack_idx):
            args = self._pack(args)
            n = len(args)
        values = list(args)
        if n < nparams:
            values.extend(self.fill[n:])
        if kwargs:
            index = self.index
            for k, v in kwargs.items():
                i = index.get(k)
                if i is None:
                    raise SignatureError(f"{self.name}() got an unexpected keyword argument {k!r}")
                if i < n:
                    raise SignatureError(f"{self.name}() got multiple values for argument {k!r}")
                values[i] = v
        if n < nparams:
            for v in values[n:]:
                if v is MISSING:
                    missing = [p for p, v in zip(self.params, values) if v is MISSING]
                    raise SignatureError(
                        f"{self.name}() missing required arguments: {', '.join(missing)}"
                    )
        return values

    def _pack(self, args: Sequence[object]) -> tuple:
        """Fold trailing positional arguments into the last (variadic or size) parameter:
        ``einsum(eq, a, b)``, ``x.view(2, 3)``, ``x.view(-1)``; a single list or tuple is
        taken as the whole value."""
        last = self.pack_idx
        if last < 0:
            raise SignatureError(
                f"{self.name}() takes {self.nparams} positional arguments "
                f"({', '.join(self.params)}) but {len(args)} were given"
            )
        tail = args[last:]
        if len(tail) == 1 and isinstance(tail[0], (list, tuple)):
            return tuple(args)
        return (*args[:last], tuple(tail))


_BINDERS: dict[str, _Binder] = {}


def binder_of(info: OpInfo) -> _Binder:
    """How calls of ``info`` bind to its parameters (built once per record; rebuilt when the
    table entry of that name was replaced). **Local**."""
    b = _BINDERS.get(info.name)
    if b is None or b.info is not info:
        b = _BINDERS[info.name] = _Binder(info)
    return b


# -- the cache -------------------------------------------------------------------------------
class Redist:
    """One DTensor input's move to the strategy's placements: the redistribute plan
    (``steps``) from spec ``src`` to spec ``dst``; ``fast`` is the compiled front's entry of
    the move (made on first use, see :func:`use_compiled_moves`)."""

    __slots__ = ("dst", "fast", "src", "steps")

    def __init__(self, steps: tuple, src: DTensorSpec, dst: DTensorSpec) -> None:
        self.steps = steps
        self.src = src
        self.dst = dst
        self.fast = None


class _ScalarIdentity:
    """A scalar that this rank replaces by the identity of a Partial it is split into.

    ``Partial(sum)`` of a replicated value: the holder (coordinate 0 on each such mesh dim)
    keeps it, the other coordinates contribute 0, so the reduced value counts it once
    (:func:`placements.layout.partial_fill`).
    """

    __slots__ = ("identity",)

    def __init__(self, identity: int) -> None:
        self.identity = identity

    def apply(self, value: object) -> object:
        if isinstance(value, Tensor):
            arr = value._arr
            return wrap_array(np.full_like(arr, self.identity))
        return type(value)(self.identity)


class CacheEntry:
    """Everything needed to run a propagation-cache hit, without the rule or the binder.

    Attributes
    ----------
    name : str
        The op.
    kernel : callable
        The local kernel, called with the bound values in parameter order (local tensors in
        place of DTensors).
    slots : tuple of (int, int)
        Where the tensor-like arguments are: (parameter index, element index or -1).
    moves : tuple
        Per slot: None (use as is), a redistribute plan (DTensor inputs) or a scalar
        replacement (a scalar split into a Partial on this rank).
    out_specs : tuple of DTensorSpec
        The outputs' specs.
    inplace : bool
        The op writes its first argument; the call returns that DTensor.
    comm : bool
        Whether running the entry issues collectives.
    direct : tuple of int or None
        When no input moves, the op is not in-place and has no variadic argument: the
        parameter indices whose DTensors just give their local tensors (the short path).
    quiet : bool
        The kernel must be run with numpy's floating-point errors ignored
        (:attr:`OpInfo.quiet`) and does not do it itself.
    strategy : OpStrategy
        The chosen strategy (for debugging tools).
    schema : OpSchema
        What the rule saw (for debugging tools).
    abstract : EntryRunner or None
        On an abstract mesh: how the entry runs without data
        (:class:`dtensor.distributed.abstract.EntryRunner`); ``direct`` is then None.
    """

    __slots__ = (
        "abstract",
        "comm",
        "direct",
        "inplace",
        "kernel",
        "moves",
        "name",
        "out_specs",
        "quiet",
        "schema",
        "slots",
        "strategy",
    )

    def __init__(
        self,
        name: str,
        kernel: Callable,
        slots: tuple[tuple[int, int], ...],
        moves: tuple,
        out_specs: tuple[DTensorSpec, ...],
        inplace: bool,
        strategy: OpStrategy,
        schema: OpSchema,
        quiet: bool = False,
    ) -> None:
        self.name = name
        self.schema = schema
        self.kernel = kernel
        self.quiet = quiet and not getattr(kernel, "quiet", False)
        self.slots = slots
        self.moves = moves
        self.out_specs = out_specs
        self.inplace = inplace
        self.comm = any(isinstance(m, Redist) and m.steps for m in moves)
        self.strategy = strategy
        plain = not inplace and all(m is None for m in moves) and all(e < 0 for _, e in slots)
        self.direct = tuple(p for p, _ in slots) if plain else None
        self.abstract = None

    def arguments(self, values: list) -> list:
        """The tensor-like arguments of a bound call, one per slot (what the rule saw)."""
        return [_slot_value(values, s) for s in self.slots]


def _flush_front() -> None:
    """Before the propagation cache evicts or clears: replay the compiled front's pending LRU
    touches, then drop its copies of the entries."""
    if _FRONT is not None:
        _FRONT.flush(_CACHE.data)
        _FRONT.invalidate()


def _env_cache_size() -> int:
    return env_int("DTENSOR_PROP_CACHE_SIZE", 4096, minimum=1)


_CACHE = LRUCache("dispatch.propagation", _env_cache_size(), on_clear=_flush_front)


def prop_cache_stats() -> dict[str, int]:
    """Counters of the propagation cache. **Local**.

    Returns
    -------
    dict
        ``hits`` (all paths), ``misses``, ``evictions`` (since the last
        :func:`clear_prop_cache`), ``size`` (entries now) and ``maxsize``; ``python_hits``
        and ``fast_hits`` split the hits by the path that served them (the compiled front
        serves repeated calls; its first sight of a signature is a Python-path hit or a miss).
    """
    c = _CACHE
    fast = _FRONT.stats()["hits"] if _FRONT is not None else 0
    return {
        "hits": c.hits + fast,
        "misses": c.misses,
        "size": len(c.data),
        "evictions": c.evictions,
        "maxsize": c.maxsize,
        "python_hits": c.hits,
        "fast_hits": fast,
    }


def clear_prop_cache() -> None:
    """Drop every cached sharding decision and reset the counters. **Local**.

    Call it on every rank (or none): ranks never diverge in their decisions either way,
    but the counters then agree.
    """
    _CACHE.clear()
    if _FRONT is not None:
        _FRONT.reset_stats()


def clear_caches() -> None:
    """Drop every cached decision of every layer: the propagation cache, the sharding
    rules' results, layout and redistribute plans, compiled redistribute programs... (every
    cache registered with :mod:`placements.cache`), and reset their counters. **Local**.

    Results never change, only the cost of the next calls. Call it on every rank (or none),
    so that the counters agree.
    """
    clear_all()
    if _FRONT is not None:
        _FRONT.reset_stats()


def cache_stats() -> dict[str, dict[str, int]]:
    """Counters of every cache registered with :mod:`placements.cache`, by name (``hits``,
    ``misses``, ``evictions``, ``size``, ``maxsize``); the propagation cache's are
    :func:`prop_cache_stats` (the compiled front's hits included). **Local**."""
    stats = all_stats()
    stats[_CACHE.name] = prop_cache_stats()
    return stats


def set_prop_cache_size(maxsize: int) -> None:
    """Change the bound of the propagation cache (evicting the oldest entries). **Local**."""
    if int(maxsize) < 1:
        raise ConfigError(f"set_prop_cache_size: maxsize must be at least 1, got {maxsize}")
    _CACHE.resize(maxsize)


# -- the compiled front (fastpath._dispatch, plugged in by dtensor.dispatch.compiled) -------------
_FRONT = None


def use_compiled_moves(move_local: Callable | None) -> None:
    """Run an op's one-step input moves by ``move_local(dtensor, move)`` (the compiled
    front's, which returns None for a move it does not run), or all by the executor (None).
    **Local**."""
    global _MOVE_LOCAL
    _MOVE_LOCAL = move_local


_MOVE_LOCAL = None


def attach_front(front: object) -> None:
    """Tell the dispatcher which compiled front serves repeated calls (its cache of entries
    must follow the propagation cache's evictions and clears). **Local**."""
    global _FRONT
    _FRONT = front


# -- the dispatcher --------------------------------------------------------------------------

def describe(v: object) -> str:
    """A short description of an op argument for messages (a DTensor's placements, shape
    and dtype; a Tensor's shape and dtype; the repr of anything else). **Local**."""
    if isinstance(v, DTensor):
        return f"DTensor({placement_list(v.placements)}, shape {v.shape}, {v.dtype})"
    if isinstance(v, Tensor):
        return f"Tensor(shape {tuple(v.shape)}, {v.dtype})"
    return repr(v)


def dispatch(info: OpInfo, args: Sequence[object], kwargs: Mapping[str, object]) -> object:
    """Run ``info``'s op on arguments of which at least one is a DTensor.

    **Collective** over the mesh when an input must be redistributed for the chosen
    strategy (every rank makes the same choice); **Local** otherwise.

    Parameters
    ----------
    info : OpInfo
        The op's table entry.
    args, kwargs
        The call's arguments, as for the local function.

    Returns
    -------
    DTensor, tuple of DTensor or the op's namedtuple of DTensors
        Outputs laid out per the chosen strategy; an in-place op returns its first argument.
    """
    binder = _BINDERS.get(info.name)
    if binder is None or binder.info is not info:
        binder = binder_of(info)
    values = binder.bind(args, kwargs)
    entry, _, mesh = lookup(info, values, args, kwargs)
    return run_entry(entry, values, mesh)


def lookup(
    info: OpInfo,
    values: list,
    args: Sequence[object] = (),
    kwargs: Mapping[str, object] | None = None,
) -> tuple[CacheEntry, tuple | None, object]:
    """The cache entry for bound ``values`` (propagating sharding on a miss). **Local**,
    except for the index check of ``x[idx]``, ``x[idx] = value`` and ``index_put``
    (:mod:`dtensor.dispatch.index_args`), **Collective** over the mesh when it runs.

    Counts the hit or miss. Returns ``(entry, key, mesh)``; ``key`` is None when the call
    cannot be cached (a tensor-valued static argument) or must reach this function each
    time (a checked index). ``args``/``kwargs`` (the original
    call) only serve error messages. Normalises ``values`` as the kernel needs them.
    """
    name = info.name
    binder = _BINDERS.get(name)
    if binder is None or binder.info is not info:
        binder = binder_of(info)
    vi = binder.variadic_idx
    key = [name, _dtypes._default_float]
    mesh = None
    try:
        for pi in binder.tensor_idx:
            v = values[pi]
            if pi == vi:
                v = values[pi] = list(v)
                key.append(len(v))
                for ei, e in enumerate(v):
                    m = _marker(name, e, v, ei)
                    if type(m) is DTensorSpec:
                        mesh = _same_mesh(name, mesh, m)
                    key.append(m)
                continue
            if type(v) is DTensor:
                m = v._spec
                if m.mesh is not mesh:
                    mesh = _same_mesh(name, mesh, m)
            else:
                m = _marker(name, v, values, pi)
                if type(m) is DTensorSpec:
                    mesh = _same_mesh(name, mesh, m)
            key.append(m)
    except _LocalOperand as e:
        if _implicit_replication and _replicate_locals(binder, values):
            return lookup(info, values, args, kwargs)
        if name in INDEX_TENSOR_PARAMS and replicate_local_index(
                name, values, binder.index[INDEX_TENSOR_PARAMS[name]],
                [values[pi] for pi in binder.tensor_idx]):
            return lookup(info, values, args, kwargs)[0], None, mesh or _mesh_of(values)
        raise _mixed_error(name, e.args[0], args or values, kwargs or {}) from None
    if mesh is None:
        params = ", ".join(binder.params[i] for i in binder.tensor_idx)
        raise DTypeError(f"{name}: no DTensor among the tensor arguments ({params})")
    checked = False
    if name in INDEX_PARAMS:
        pos = binder.index[INDEX_PARAMS[name]]
        if name == "setitem":  # x[mask] = scalar with a DTensor mask: masked_fill_
            mask = mask_fill(values[0], values[pos], values[2])
            if mask is not None:
                values[pos] = mask
                return lookup(OPS["masked_fill_"], values)[0], None, mesh
        # a DTensor in the index: gathered (then the same on every rank, unchecked)
        values[pos], checked = gather_dtensor_index(values[pos])
        # Ranks that pass different indices would decide differently: they raise first,
        # all of them (a checked call gets no key, so that the compiled front sends each
        # one here).
        checked = checked or check_index_args(
            name, values[pos], [values[pi] for pi in binder.tensor_idx], mesh)
    # Equal meshes built separately share no entry: outputs carry the inputs' mesh object.
    # (The entry's specs keep that mesh alive, so its id cannot be reused meanwhile.)
    key.append(id(mesh))
    if _kept_shards and name in _kept_shards:
        key.append(_KEEP_SHARDS)
    cache = _CACHE
    if _FRONT is not None:
        _FRONT.flush(cache.data)
    try:
        for si in binder.static_idx:
            s = values[si]
            key.append(_freeze(s) if type(s) in _COMPOUND else s)
        if name in _INDEXING:  # a list index is not the tuple of its entries
            key.append(tuple([type(values[si]) is list for si in binder.static_idx]))
        key = tuple(key)
        entry = cache.data.get(key)
    except _Uncacheable:
        # a tensor-valued static argument (an index tensor): decide for this call only
        cache.misses += 1
        entry = _build_entry(info, binder, values, mesh)
        return _heard(entry, mesh, True) if _listeners else (entry, None, mesh)
    if entry is None:
        cache.misses += 1
        entry = _build_entry(info, binder, values, mesh)
        cache.put(key, entry)
        if _listeners:
            return _heard(entry, mesh, True)
    else:
        cache.hits += 1
        cache.data.move_to_end(key)
        if _listeners:
            return _heard(entry, mesh, False)
    return entry, None if checked else key, mesh


def _heard(entry: CacheEntry, mesh: object, miss: bool) -> tuple:
    """lookup's answer while listeners are registered: no key, so that the compiled front
    keeps no copy and runs :func:`run_entry` every time; the miss is kept for them."""
    global _missed
    _missed = miss
    return entry, None, mesh


class _Uncacheable(Exception):
    """A static argument whose value cannot be part of a cache key."""


#: Ops whose static list and tuple of the same entries mean different things (``x[[0, 2]]``
#: is advanced indexing, ``x[0, 2]`` an element): their cache keys tell them apart.
_INDEXING = frozenset(("getitem", "setitem"))


def _freeze(v: object) -> object:
    """A hashable stand-in for a static argument (lists -> tuples, slices -> tuples)."""
    t = type(v)
    if t is list or t is tuple:
        return tuple(_freeze(e) if type(e) in _COMPOUND else e for e in v)
    if t is slice:
        return (slice, v.start, v.stop, v.step)
    raise _Uncacheable(v)


def _mesh_of(values: list) -> object:
    """The mesh of the first DTensor among ``values``."""
    return next(v._spec.mesh for v in values if isinstance(v, DTensor))


def _same_mesh(op: str, mesh: object, spec: DTensorSpec) -> object:
    m = spec.mesh
    if mesh is None or mesh is m:
        return m
    if mesh != m:
        raise MeshError(
            f"{op}: operands live on different meshes {mesh!r} and {m!r}; redistribute them "
            "onto one mesh first"
        )
    return mesh


class _LocalOperand(Exception):
    """A local (non 0-d) tensor among the operands of a DTensor op."""


def _marker(op: str, v: object, holder: list, i: int) -> object:
    """The cache-key marker of one tensor-like argument (normalising 0-d values in
    ``holder[i]`` to local 0-d Tensors)."""
    t = type(v)
    if t is DTensor:
        return v._spec
    if t in _PY_SCALARS or v is None:
        return None if v is None else t
    if isinstance(v, DTensor):
        return v._spec
    if isinstance(v, np.generic):
        return _SCALAR_KIND[dtype_kind(v.dtype)]
    if isinstance(v, np.ndarray):
        v = wrap_array(v)
        if v.ndim == 0:
            holder[i] = v
    if isinstance(v, Tensor):
        if v.ndim == 0:
            return v.dtype
        raise _LocalOperand(v)
    raise DTypeError(f"{op}: unsupported argument of type {t.__name__}: {v!r}")


#: Depth of :func:`dtensor.implicit_replication` contexts: while positive, a local tensor
#: among a DTensor op's arguments takes part as a Replicate DTensor.
_implicit_replication = 0


def _replicate_locals(binder: _Binder, values: list) -> bool:
    """Under ``implicit_replication()``: replace every local (non 0-d) tensor argument in
    ``values`` by a Replicate DTensor on the mesh of the first DTensor argument (no copy, no
    communication). Returns whether one was replaced. **Local**."""
    slots = [(values, pi) for pi in binder.tensor_idx if pi != binder.variadic_idx]
    if binder.variadic_idx >= 0:
        v = values[binder.variadic_idx] = list(values[binder.variadic_idx])
        slots.extend((v, i) for i in range(len(v)))
    mesh = next((h[i]._spec.mesh for h, i in slots if isinstance(h[i], DTensor)), None)
    replaced = False
    for holder, i in slots:
        v = holder[i]
        if isinstance(v, np.ndarray):
            v = wrap_array(v)
        if isinstance(v, Tensor) and v.ndim and mesh is not None:
            spec = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tuple(v.shape), v.dtype)
            holder[i] = DTensor._make(v, spec)
            replaced = True
    return replaced


def _mixed_error(op: str, local: Tensor, args: Sequence[object], kwargs: Mapping) -> ShardingError:
    dtensors = [a for a in (*args, *kwargs.values()) if isinstance(a, DTensor)]
    for a in (*args, *kwargs.values()):
        if type(a) is list or type(a) is tuple:
            dtensors.extend(e for e in a if isinstance(e, DTensor))
    d = dtensors[0]
    return ShardingError(
        f"{op}: cannot mix a DTensor ({placement_list(d.placements)}, shape {d.shape}) with a local "
        f"Tensor of shape {tuple(local.shape)}; use DTensor.from_local or distribute_tensor"
    )


def _arg_meta(v: object) -> ArgMeta | None:
    if v is None:
        return None
    if isinstance(v, DTensor):
        s = v._spec
        return ArgMeta(s.shape, s.dtype, s.placements)
    if type(v) in _PY_SCALARS:
        return ArgMeta((), _dtypes.to_dtype(type(v)), None, True)
    if isinstance(v, np.generic):
        return ArgMeta((), _dtypes.to_dtype(_SCALAR_KIND[dtype_kind(v.dtype)]), None, True)
    return ArgMeta((), v.dtype, None)


def _slots(binder: _Binder, values: list) -> tuple[tuple[int, int], ...]:
    out = []
    for pi in binder.tensor_idx:
        if pi == binder.variadic_idx:
            out.extend((pi, ei) for ei in range(len(values[pi])))
        else:
            out.append((pi, -1))
    return tuple(out)


def _slot_value(values: list, slot: tuple[int, int]) -> object:
    pi, ei = slot
    return values[pi] if ei < 0 else values[pi][ei]


def _build_entry(info: OpInfo, binder: _Binder, values: list, mesh: object) -> CacheEntry:
    """Propagate sharding for one call signature and precompute how to run it. **Local**."""
    slots = _slots(binder, values)
    args = [_slot_value(values, s) for s in slots]
    metas = tuple(_arg_meta(v) for v in args)
    static = tuple((binder.params[i], values[i]) for i in binder.static_idx)
    schema = OpSchema(
        info.name, metas, static, tuple(mesh.shape), _dtypes.get_default_dtype()
    )
    specs = {id(m): v._spec for m, v in zip(metas, args) if isinstance(v, DTensor)}
    keep = bool(_kept_shards) and info.name in _kept_shards
    try:
        strategy = propagate(schema, mesh, _cost_fn(specs, mesh, keep))
    except (NoRuleError, ShardingError, DimError, DTypeError) as e:
        inputs = ", ".join(describe(v) for v in args)
        raise type(e)(f"{e} [op {info.name}; inputs: {inputs}; mesh {mesh.shape}]") from e
    if keep:
        _check_kept_shards(info.name, args, strategy.input_placements)
    moves = []
    coord = mesh.get_coordinate()
    for v, target in zip(args, strategy.input_placements):
        if isinstance(v, DTensor):
            src = v._spec
            if target is None or tuple(target) == src.placements:
                moves.append(None)
            else:
                dst = src.with_placements(target)
                moves.append(Redist(_plan(src, dst.placements), src, dst))
        else:
            moves.append(_scalar_move(target, coord))
    out_specs = tuple(strategy.output_specs)
    if info.inplace:
        _check_inplace(info.name, args, moves, out_specs)
    kernel = info.local_fn(schema, strategy) if info.local_fn is not None else info.kernel
    entry = CacheEntry(
        info.name, kernel, slots, tuple(moves), out_specs, info.inplace, strategy, schema,
        info.quiet,
    )
    if type(mesh) is AbstractMesh and mesh._abstract:  # metadata only: run_entry hands it on
        entry.abstract = EntryRunner(info.name,
                                     info.samples in MOVES_ONLY or info.name in ALIASES)
        entry.direct = None
    return entry


def decide(info: OpInfo, args: Sequence[object], kwargs: Mapping[str, object]) -> tuple:
    """The decision the dispatcher would take for a call, without running it, caching it or
    counting it: ``(entry, values, mesh)`` (``values`` are the bound arguments). **Local**.

    Raises
    ------
    DTypeError
        When no DTensor is among the call's tensor arguments.
    """
    binder = binder_of(info)
    values = binder.bind(args, kwargs)
    if binder.variadic_idx >= 0:
        values[binder.variadic_idx] = list(values[binder.variadic_idx])
    for pi in binder.tensor_idx:
        v = values[pi]
        for e in v if pi == binder.variadic_idx else (v,):
            if isinstance(e, DTensor):
                mesh = e.device_mesh
                return _build_entry(info, binder, values, mesh), values, mesh
    raise DTypeError(f"explain: {info.name}() got no DTensor argument")


def _scalar_move(target: Sequence[Placement] | None, coord: tuple[int, ...]):
    """A scalar's replacement on this rank when the strategy splits it into a Partial."""
    fill = None if target is None else partial_fill(target, coord)
    return None if fill is None else _ScalarIdentity(fill)


def _check_inplace(op: str, args: list, moves: list, out_specs: tuple) -> None:
    self = args[0]
    if not isinstance(self, DTensor):
        raise ShardingError(
            f"{op}: the in-place op writes its first argument, which must be a DTensor when "
            f"any argument is one (got {describe(self)})"
        )
    src = self._spec
    out = out_specs[0]
    if moves[0] is not None or out.placements != src.placements or out.shape != src.shape:
        raise ShardingError(
            f"{op}: the in-place op would change its input from {placement_list(src.placements)} "
            f"shape {src.shape} to {placement_list(out.placements)} shape {out.shape} (inputs: "
            + ", ".join(describe(v) for v in args)
            + "); redistribute the input first or use the out-of-place op"
        )


def _cost_fn(
    specs: dict[int, DTensorSpec], mesh: object, keep: bool = False
) -> Callable[[ArgMeta, tuple], float]:
    """The cost function ``propagate`` asks: the planned redistribution cost of one input
    (0 for a local argument), or of metadata that is no argument (an all-reduce a
    candidate implies, placed on ``mesh``). With ``keep`` (:func:`keep_shards`), moving a
    sharded input off its shards costs infinitely much.

    Costs come from the redistribute planner (cached with its plans) under the process-wide
    cost model; after replacing that model (``redistribute.set_default_cost_model``) call
    :func:`clear_prop_cache` on every rank.
    """
    model = default_cost_model()

    def cost(meta: ArgMeta, target: tuple[Placement, ...]) -> float:
        spec = specs.get(id(meta))
        if keep and spec is not None and _unshards(spec.placements, target):
            return math.inf
        if spec is None:
            if meta.placements is None:
                return 0.0
            spec = DTensorSpec._trusted(mesh, meta.placements, meta.shape, meta.dtype)
        return redistribute_cost(spec, target, model)

    return cost


def _unshards(current: tuple, target: tuple | None) -> bool:
    """Whether moving from ``current`` to ``target`` placements gives up a Shard."""
    return target is not None and any(
        c.is_shard() and t != c for c, t in zip(current, target)
    )


def _check_kept_shards(name: str, args: list, targets: Sequence) -> None:
    """Raise unless the chosen strategy keeps every sharded DTensor input's shards (under
    :func:`keep_shards`)."""
    for v, target in zip(args, targets):
        if isinstance(v, DTensor) and _unshards(v._spec.placements, target):
            raise ShardingError(
                f"{name}: its sharded input must keep its shards here (loss_parallel), but "
                f"no strategy of its rule does: {describe(v)} would move to "
                f"{placement_list(tuple(target))}"
            )


#: Ops whose sharded DTensor inputs keep their shards (see :func:`keep_shards`).
_kept_shards: frozenset = frozenset()
#: The key part of a decision taken under :func:`keep_shards`.
_KEEP_SHARDS = object()


def drop_front_entries() -> None:
    """Make the compiled front forget its entries, so that the next call of each op reaches
    :func:`lookup` (the propagation cache keeps them). **Local**."""
    if _FRONT is not None:
        _FRONT.invalidate()


def keep_shards(ops: frozenset) -> frozenset:
    """Make ``ops`` keep the shards of their sharded DTensor inputs (a strategy that would
    gather them is refused, whatever it costs); returns the previous set, to restore.
    **Local**. Decisions taken under it are cached apart (their key says so) and the
    compiled front's entries are dropped on every change, so no decision crosses over."""
    global _kept_shards
    prev, _kept_shards = _kept_shards, frozenset(ops)
    if _FRONT is not None:
        _FRONT.invalidate()
    return prev


def run_entry(entry: CacheEntry, values: list, mesh: object) -> object:
    """Run a cache entry on bound values: move inputs, call the kernel, wrap the outputs.

    **Collective** when the entry redistributes an input, **Local** otherwise. ``values``
    (the bound arguments) is modified: DTensors are replaced by their local tensors.
    Registered listeners (:func:`add_listener`) see the entry first.
    """
    if _listeners:
        _notify(entry, values, mesh)
    direct = entry.direct
    if direct is not None:
        for pi in direct:
            v = values[pi]
            if isinstance(v, DTensor):
                values[pi] = v._local
        out = quiet_call(entry.kernel, *values) if entry.quiet else entry.kernel(*values)
        if type(out) is Tensor:
            d = _new(DTensor)
            d._local = out
            d._spec = entry.out_specs[0]
            return d
        return wrap_outputs(out, entry.out_specs)
    global _current_op
    if entry.abstract is not None:
        return _run_abstract(entry, values)
    target = _slot_value(values, entry.slots[0]) if entry.inplace else None
    if entry.comm:
        prev = _current_op
        _current_op = entry.name
        try:
            _to_locals(entry, values, mesh)
        finally:
            _current_op = prev
    else:
        _to_locals(entry, values, mesh)
    out = quiet_call(entry.kernel, *values) if entry.quiet else entry.kernel(*values)
    if target is not None:
        return target
    return wrap_outputs(out, entry.out_specs)


def _run_abstract(entry: CacheEntry, values: list) -> object:
    """Run an entry of an abstract mesh (no kernel, no collective) while naming its op."""
    global _current_op
    prev = _current_op
    _current_op = entry.name
    try:
        return entry.abstract(entry, entry.arguments(values))
    finally:
        _current_op = prev


def _notify(entry: CacheEntry, values: list, mesh: object) -> None:
    for fn in tuple(_listeners):
        fn(entry, _missed, values, mesh)


def wrap_outputs(out: object, specs: tuple[DTensorSpec, ...]) -> object:
    """DTensors of the kernel's outputs, in the kernel's structure (Tensor, tuple,
    namedtuple). **Local**."""
    if isinstance(out, Tensor):
        return DTensor._make(out, specs[0])
    wrapped = [DTensor._make(o, s) for o, s in zip(out, specs)]
    if type(out) is tuple or type(out) is list:
        return tuple(wrapped)
    return type(out)(*wrapped)


def move_input(v: DTensor, move: Redist, mesh: object) -> Tensor:
    """This rank's local tensor of the DTensor input ``v`` moved as ``move``.

    **Collective** when the move communicates. A one-step move that compiled code runs
    (the compiled redistribute's forms, no observer on: see :func:`use_compiled_moves`)
    skips the executor, which runs everything else.
    """
    arr = None
    if _MOVE_LOCAL is not None and len(move.steps) == 1:
        arr = _MOVE_LOCAL(v, move)
    if arr is None:
        return execute_move(v, move, mesh)
    return wrap_array(arr)


def execute_move(v: DTensor, move: Redist, mesh: object) -> Tensor:
    """:func:`move_input` by the executor alone (the compiled front's fallback for a move
    it declined). **Collective** when the move communicates."""
    return wrap_array(
        _execute(
            move.steps,
            v._local._arr,
            move.src,
            mesh._coord,
            mesh._dim_comms,
            allocator_for(mesh.device_type),
        )
    )


def _to_locals(entry: CacheEntry, values: list, mesh: object) -> None:
    """Replace each tensor-like argument in ``values`` by what the kernel gets on this rank."""
    for (pi, ei), move in zip(entry.slots, entry.moves):
        holder, i = (values, pi) if ei < 0 else (values[pi], ei)
        v = holder[i]
        if isinstance(v, DTensor):
            local = v._local
            if move is not None:
                local = move_input(v, move, mesh)
            holder[i] = local
        elif move is not None:
            holder[i] = move.apply(v)
