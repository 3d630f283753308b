"""DTensor: a local :class:`~dtensor.Tensor` plus a :class:`~placements.spec.DTensorSpec`.

This module owns the DTensor class, its construction (``distribute_tensor``,
``DTensor.from_local``) and its conversions (``to_local``, ``full_tensor``,
``redistribute``). Data movement is delegated to :mod:`redistribute` (plan, then execute on
the mesh's communicators); ops on DTensors are served by the dispatcher.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import numpy as np

import fastpath as _fp
from placements import Partial, Placement, Replicate, Shard
from placements.cache import LRUCache
from placements.errors import (
    AutogradError,
    ConfigError,
    DTypeError,
    MeshError,
    PlacementError,
    ShardDimError,
    ShardingError,
    SignatureError,
)
from placements.layout import local_shape as _layout_local_shape
from placements.meta import dtype_of_char, norm_dim
from placements.spec import DTensorSpec, check_partial_dtype
from placements.types import placement_list
from redistribute.execute import execute as _execute
from redistribute.execute import execute_async as _execute_async
from redistribute.execute import scatter_from as _scatter_from
from redistribute.plan import plan as _plan

from ..local import allocator as _allocator
from ..local import grad_engine as _ag
from ..local.factory import as_tensor
from ..local.strides import contiguous_strides
from ..local.tensor import (
    Tensor,
    check_one_element,
    deepcopy_check_leaf,
    deepcopy_leaf_state,
    wrap_array,
)
from .mesh import DeviceMesh, init_device_mesh

__all__ = [
    "DTensor",
    "PendingDTensor",
    "add_redistribute_listener",
    "allocator_for",
    "distribute_tensor",
    "normalize_placements",
    "record_redistribute",
    "redistribute_target",
    "remove_redistribute_listener",
]


def allocator_for(device: str):
    """The ``alloc(shape, dtype)`` callback the redistribute executor uses for a mesh's
    device (buffers from the caching allocator). **Local**."""
    cached = _ALLOCS.get(device)
    if cached is None:

        def cached(shape, dtype, _device=device):
            return _allocator.empty_array(shape, dtype, _device)

        _ALLOCS[device] = cached
    return cached


_ALLOCS: dict = {}

# (source spec, target placements, mesh id) -> (target spec, plan): a repeated redistribute
# skips building and hashing the target spec and the planner lookup. The mesh's identity is
# part of the key (specs compare meshes by value), so that the output keeps the input's mesh
# object; the entry's target spec keeps that mesh alive. Every redistribute reads it through
# the table's bound ``get`` and counts the hit itself, without a recency update: eviction is
# oldest first.
_TARGETS = LRUCache("distributed.redistribute_targets", 4096)
_find_target = _TARGETS.data.get


def redistribute_target(spec: DTensorSpec, placements: tuple[Placement, ...]) -> tuple:
    """``(spec.with_placements(placements), plan to it)``, cached. **Local**.

    Raises DTypeError (before anything is cached) for a ``Partial("avg")`` target of a
    dtype that is not floating (:func:`placements.spec.check_partial_dtype`).
    """
    key = (spec, placements, id(spec.mesh))
    hit = _find_target(key)
    if hit is None:
        _TARGETS.misses += 1
        dst = spec.with_placements(placements)
        check_partial_dtype("redistribute", dst.placements, dst.dtype)
        same = dst.placements == spec.placements
        hit = (dst, () if same else _plan(spec, dst.placements))
        _TARGETS.put(key, hit)
    else:
        _TARGETS.hits += 1
    return hit


def normalize_placements(
    placements: Sequence[Placement] | None, mesh: DeviceMesh, op: str
) -> tuple[Placement, ...]:
    """Placements as a tuple of the mesh's length (None means all Replicate). **Local**."""
    if placements is None:
        return (Replicate(),) * mesh.ndim
    placements = tuple(placements)
    for p in placements:
        if not isinstance(p, Placement):
            raise PlacementError(
                f"{op}: {p!r} is not a placement (expected Shard(dim), Replicate() or "
                f"Partial(op)); placements={placements!r}"
            )
    if len(placements) != mesh.ndim:
        raise PlacementError(
            f"{op}: {len(placements)} placements {placement_list(placements)} for a {mesh.ndim}-D mesh "
            f"of shape {mesh.shape}: give one placement per mesh dim"
        )
    return placements



def _as_local_tensor(data: object, op: str) -> Tensor:
    if isinstance(data, Tensor):
        return data
    if isinstance(data, DTensor):
        raise DTypeError(f"{op}: expected a local tensor or array, got a DTensor {data!r}")
    return as_tensor(data)


# numpy ufuncs of python's binary operators -> (DTensor operator, reflected operator): numpy
# calls them for ``ndarray <op> DTensor`` (DTensor.__array_ufunc__).
_UFUNC_OPERATORS = {
    "add": ("__add__", "__radd__"),
    "subtract": ("__sub__", "__rsub__"),
    "multiply": ("__mul__", "__rmul__"),
    "true_divide": ("__truediv__", "__rtruediv__"),
    "divide": ("__truediv__", "__rtruediv__"),
    "floor_divide": ("__floordiv__", "__rfloordiv__"),
    "remainder": ("__mod__", "__rmod__"),
    "power": ("__pow__", "__rpow__"),
    "matmul": ("__matmul__", "__rmatmul__"),
    "bitwise_and": ("__and__", "__rand__"),
    "bitwise_or": ("__or__", "__ror__"),
    "bitwise_xor": ("__xor__", "__rxor__"),
    "less": ("__lt__", "__gt__"),
    "less_equal": ("__le__", "__ge__"),
    "greater": ("__gt__", "__lt__"),
    "greater_equal": ("__ge__", "__le__"),
    "equal": ("__eq__", "__eq__"),
    "not_equal": ("__ne__", "__ne__"),
}

_dnew = _fp.DTensorBase.__new__


class DTensor(_fp.DTensorBase):
    """A distributed tensor: this rank's local shard plus the global spec.

    Attributes are metadata only; nothing in this class communicates unless its docstring
    says **Collective**. The slots ``_local`` and ``_spec`` live in the base (compiled when
    the fast path is enabled); one class serves both the compiled and the Python path.
    """

    __slots__ = ()

    # Lets numpy defer to our reflected operators (ndarray + DTensor -> DTensor.__radd__).
    __array_priority__ = 1000
    # True for the metadata-only DTensors of an abstract mesh (dtensor.distributed.abstract),
    # which redistribute through their own _planned.
    _abstract = False

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise SignatureError(
            "DTensor: use dt.distribute_tensor(...), DTensor.from_local(...) or a factory "
            "with device_mesh= and placements= to create one"
        )

    @classmethod
    def _make(cls, local: Tensor, spec: DTensorSpec) -> DTensor:
        """Wrap a local tensor with a spec, no checks. **Local**."""
        self = _dnew(cls)
        self._local = local
        self._spec = spec
        return self

    # -- metadata (Local) ------------------------------------------------------------------
    @property
    def placements(self) -> tuple[Placement, ...]:
        """The placement on each mesh dim. **Local**."""
        return self._spec.placements

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh this tensor is distributed over. **Local**."""
        return self._spec.mesh

    @property
    def shape(self) -> tuple[int, ...]:
        """The global shape. **Local**."""
        return self._spec.shape

    @property
    def dtype(self) -> np.dtype:
        """The element dtype. **Local**."""
        return self._spec.dtype

    @property
    def device(self) -> str:
        """The device of the local shard. **Local**."""
        return self._local.device

    @property
    def ndim(self) -> int:
        """Number of tensor dims. **Local**."""
        return len(self._spec.shape)

    def dim(self) -> int:
        """Number of tensor dims. **Local**."""
        return len(self._spec.shape)

    def size(self, dim: int | None = None):
        """Global size, or the global size of one dim. **Local**."""
        if dim is None:
            return self._spec.shape
        return self._spec.shape[norm_dim(dim, self.ndim, "size")]

    def numel(self) -> int:
        """Number of elements of the global tensor. **Local**."""
        return self._spec.numel()

    def stride(self, dim: int | None = None):
        """Global strides (row-major of the global shape unless given at creation). **Local**."""
        strides = self._spec.stride
        if strides is None:
            strides = contiguous_strides(self._spec.shape)
        if dim is None:
            return tuple(strides)
        return strides[norm_dim(dim, self.ndim, "stride")]

    def __len__(self) -> int:
        if not self._spec.shape:
            raise DTypeError("len() of a 0-d DTensor")
        return self._spec.shape[0]

    @property
    def spec(self) -> DTensorSpec:
        """The full spec (mesh, placements, global shape, dtype). **Local**."""
        return self._spec

    def __repr__(self) -> str:
        return (
            f"DTensor(local_tensor={self._local!r}, device_mesh={self._spec.mesh!r}, "
            f"placements={self._spec.placements!r}, shape={self._spec.shape})"
        )

    # -- python and numpy protocols (SPMD-safe) ---------------------------------------------
    # What may run on one rank only (repr, len, shapes, iteration over an unsharded dim)
    # never communicates. What needs the global values (truth value, item, float, int,
    # tolist, ``in``) is Collective and says so: every rank must call it, and every rank
    # gets the same value. Checks on the global metadata (one element?) raise on every
    # rank before any communication. numpy's protocols never gather implicitly: they raise
    # (a numpy call made on one rank would otherwise hang the job in a collective).
    # Note: DTensor has no ``__index__``: it would make every API that accepts an int
    # (slicing, ``range``, shapes) a hidden collective; use ``int(x)``.

    def item(self) -> bool | int | float | complex:
        """The value of a one-element DTensor as a python scalar, on every rank.

        **Collective** over the mesh (the value is gathered, or its Partial reduced; no
        communication when it is replicated already): call it on every rank.

        Raises
        ------
        ValueConversionError
            The global tensor has other than one element (on every rank, before any
            communication).
        """
        check_one_element(self._spec.numel(), "item")
        return self.full_tensor().item()

    def __bool__(self) -> bool:
        """Truth value of a one-element DTensor, the same on every rank. **Collective**
        (as :meth:`item`); a tensor of other than one element raises PyTorch's
        ValueConversionError on every rank without communicating."""
        check_one_element(self._spec.numel(), "bool")
        return bool(self.full_tensor().item())

    def __float__(self) -> float:
        """``float(x)`` of a one-element DTensor. **Collective** (as :meth:`item`)."""
        return float(self.item())

    def __int__(self) -> int:
        """``int(x)`` of a one-element DTensor. **Collective** (as :meth:`item`)."""
        return int(self.item())

    def __complex__(self) -> complex:
        """``complex(x)`` of a one-element DTensor. **Collective** (as :meth:`item`)."""
        return complex(self.item())

    def tolist(self) -> object:
        """The global values as nested python lists (a scalar for a 0-d tensor), on every
        rank. **Collective** over the mesh (``full_tensor().tolist()``)."""
        return self.full_tensor().tolist()

    def __contains__(self, element: object) -> bool:
        """``element in x``: whether any element equals ``element``, on every rank.
        **Collective** (``(x == element).any()``, then its value)."""
        return bool((self == element).any())

    def __iter__(self):
        """Iterate over dim 0: DTensors of the rows (``unbind(0)``), as PyTorch does.

        **Local**: dim 0 must not be sharded (rows of a sharded dim live on other ranks,
        so iterating would be a hidden collective).

        Raises
        ------
        DTypeError
            A 0-d DTensor, or one whose dim 0 is sharded (on every rank: the check reads
            the placements only). Redistribute dim 0 to Replicate first, or iterate
            ``x.full_tensor()`` (collective) or ``x.to_local()`` (this rank's shard).
        """
        spec = self._spec
        if not spec.shape:
            raise DTypeError("iteration over a 0-d DTensor")
        if any(p.is_shard(0) for p in spec.placements):
            raise DTypeError(
                f"iteration over a DTensor whose dim 0 is sharded ({placement_list(spec.placements)}, "
                f"shape {spec.shape}) would communicate: redistribute dim 0 to Replicate "
                "first, or iterate x.full_tensor() (collective) or x.to_local() (this rank's "
                "shard)"
            )
        return iter(self.unbind(0))

    def _host_error(self, what: str) -> DTypeError:
        return DTypeError(
            f"{what} of a DTensor ({placement_list(self._spec.placements)}, shape "
            f"{self._spec.shape}, {self._spec.dtype}) is not supported: it would gather the "
            "tensor implicitly (a collective that hangs when one rank calls it). Convert "
            "explicitly: x.full_tensor() (collective: the global tensor on every rank) or "
            "x.to_local() (this rank's shard), then use numpy on that"
        )

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        """Refused: numpy conversion never gathers implicitly. **Local** (raises
        DTypeError naming ``full_tensor()`` and ``to_local()``, on any rank, at once)."""
        raise self._host_error("numpy conversion (np.asarray, np.array)")

    def __array_function__(self, func, types, args, kwargs):
        """Refused: numpy functions on DTensors raise DTypeError naming ``full_tensor()``
        and ``to_local()`` (use the ``dt.*`` functions). **Local**."""
        raise self._host_error(f"numpy.{getattr(func, '__name__', func)}")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        """A numpy ufunc on a DTensor. **Local** unless it is a python operator.

        ``ndarray <op> DTensor`` (and ``np.add(a, x)``...: the ufuncs of python's binary
        operators, called plainly) runs the DTensor's operator (``x.__radd__(a)``), as
        ``__array_priority__`` makes numpy defer; that dispatches like ``a + x``. Every
        other ufunc call (``np.exp(x)``, ``np.add.reduce(x)``, ``out=``) raises DTypeError
        naming ``full_tensor()`` and ``to_local()``.
        """
        names = _UFUNC_OPERATORS.get(ufunc.__name__)
        if names is not None and method == "__call__" and not kwargs and len(inputs) == 2:
            # an ndarray operand takes part as a local Tensor (0-d: a scalar operand)
            a, b = (as_tensor(v) if isinstance(v, np.ndarray) else v for v in inputs)
            out = NotImplemented
            if a is self:
                out = getattr(self, names[0])(b)
            elif b is self:
                out = getattr(self, names[1])(a)
            if out is not NotImplemented:
                return out
        call = "" if method == "__call__" else f".{method}"
        raise self._host_error(f"numpy.{ufunc.__name__}{call}")

    def __reduce_ex__(self, protocol: object) -> object:
        """Refused: pickling a DTensor raises DTypeError. **Local**.

        A DTensor's spec holds its mesh, whose communicators belong to this job. Pickle
        ``x.to_local()`` with ``x.placements`` and ``x.shape`` (rebuild with
        ``DTensor.from_local(t, mesh, placements, shape=shape)``), or ``x.full_tensor()``
        (collective).
        """
        raise DTypeError(
            f"pickling a DTensor ({placement_list(self._spec.placements)}, shape "
            f"{self._spec.shape}) is not supported: its mesh holds this job's communicators. "
            "Pickle x.to_local() with x.placements and x.shape (rebuild with "
            "DTensor.from_local(t, mesh, placements, shape=shape)), or x.full_tensor() "
            "(collective)"
        )

    def __copy__(self) -> DTensor:
        """A new DTensor handle on the same local tensor and spec. **Local**."""
        return DTensor._make(self._local, self._spec)

    def __deepcopy__(self, memo: dict) -> DTensor:
        """A DTensor with a copy of the local shard (``copy.deepcopy`` of the local
        tensor: DTensors whose shards shared memory share the copy's) and the same spec
        (the mesh is shared, not copied). A leaf keeps ``requires_grad`` and gets a deep
        copy of its ``.grad``; a parameter's copy is a parameter. **Local**.

        Raises
        ------
        AutogradError
            A DTensor made by a recorded op (not a leaf), as PyTorch's.
        """
        deepcopy_check_leaf(self, "DTensor", f" {placement_list(self._spec.placements)}")
        out = memo[id(self)] = DTensor._make(copy.deepcopy(self._local, memo), self._spec)
        return deepcopy_leaf_state(self, out, memo)

    # -- conversions -----------------------------------------------------------------------
    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> Tensor:
        """This rank's shard (shares memory with the DTensor). **Local**.

        Differentiable: the gradient of the local tensor becomes the DTensor's gradient laid
        out as ``grad_placements`` (default: this tensor's placements), as PyTorch's.

        Raises
        ------
        PlacementError
            ``grad_placements`` not one placement per mesh dim.
        AutogradError
            ``grad_placements`` under which this rank's shard would not have the local
            tensor's shape.
        """
        if self._ag is None or not _ag.MODE.enabled:
            return self._local
        spec = self._spec
        mesh = spec.mesh
        target = spec if grad_placements is None else spec.with_placements(
            normalize_placements(grad_placements, mesh, "to_local"))
        local = self._local
        if target.local_shape(mesh._coord) != tuple(local.shape):
            raise AutogradError(
                f"to_local: grad_placements {placement_list(target.placements)} do not match "
                f"the local shard: shape {tuple(local.shape)} under "
                f"{placement_list(spec.placements)}, {target.local_shape(mesh._coord)} under "
                f"grad_placements (global shape {spec.shape})"
            )
        out = wrap_array(local._arr, local._storage)
        _ag.record("to_local", _to_local_backward, (_ag.edge_of(self),), (out,), target)
        return out

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        async_op: bool = False,
    ) -> DTensor:
        """The same global tensor with other placements.

        **Collective** over the mesh (the plan's collectives run on the mesh-dim
        communicators; a plan without communication, such as R -> S, is Local and returns a
        view of the local shard).

        Parameters
        ----------
        device_mesh : DeviceMesh, optional
            Must be this tensor's mesh (moving between meshes is not supported).
        placements : sequence of Placement, optional
            Target placements; None means Replicate on every mesh dim.
        async_op : bool
            Return at once a DTensor whose local shard is still being computed, on
            private duplicates of the mesh communicators
            (:func:`redistribute.execute.execute_async`): a plan whose one collective runs
            by MPI starts it as an MPI nonblocking collective, completed at first use;
            other plans run on a worker thread while this thread goes on. Any
            use of its data waits first (ops, ``to_local``, ``full_tensor``,
            ``redistribute``, repr: everything that reads its local shard); ``wait()``
            waits explicitly. Its metadata (placements, shape, dtype) is there at once.
            The input's data must not be written until then.

        Raises
        ------
        DTypeError
            A ``Partial("avg")`` target of a dtype that is not floating or complex.
        """
        out = self._redistribute(device_mesh, placements, async_op)
        m = self._ag
        if m is not None and out is not self and _ag.MODE.enabled and m.requires_grad:
            record_redistribute(self, out)
        return out

    def _redistribute(
        self, device_mesh: DeviceMesh | None, placements: Sequence[Placement] | None,
        async_op: bool,
    ) -> DTensor:
        """:meth:`redistribute` without recording it for autograd."""
        spec = self._spec
        mesh = spec.mesh
        if device_mesh is not None and device_mesh != mesh:
            raise MeshError(
                f"redistribute: moving a DTensor from {mesh!r} to another mesh "
                f"{device_mesh!r} is not supported; placements={placement_list(spec.placements)}"
            )
        dst, steps = redistribute_target(spec, normalize_placements(placements, mesh, "redistribute"))
        if dst.placements == spec.placements:
            return self
        if _move_listeners:
            for fn in tuple(_move_listeners):
                fn(self, dst.placements)
        if self._abstract:
            return self._planned(dst, steps)
        run = _execute_async if async_op else _execute
        out = run(
            steps,
            self._local._arr,
            spec,
            mesh._coord,
            mesh._dim_comms,
            allocator_for(mesh.device_type),
        )
        if async_op:
            pending = _dnew(PendingDTensor)
            _BASE_LOCAL.__set__(pending, out)
            pending._spec = dst
            return pending
        return DTensor._make(wrap_array(out), dst)

    def wait(self) -> DTensor:
        """This DTensor, once its data is there (see ``redistribute(async_op=True)``);
        a DTensor that is not pending returns at once. **Local** (it waits for collectives
        already issued on every rank)."""
        return self

    def full_tensor(self) -> Tensor:
        """The whole global tensor, on every rank. **Collective** over the mesh.
        Differentiable (a redistribute to Replicate, then ``to_local``)."""
        return self.redistribute(None, (Replicate(),) * self._spec.mesh.ndim).to_local()

    # -- autograd hooks (see dtensor.local.grad_engine.install_api) ------------------------------
    def _autograd_ones(self) -> DTensor:
        """Ones of this global shape, Replicate: the implicit gradient of a one-element
        DTensor (whatever its placements, Partial included)."""
        spec = self._spec
        local = self._local._autograd_ones().expand(spec.shape).contiguous()
        return DTensor._make(local, spec.with_placements((Replicate(),) * spec.mesh.ndim))

    def _grad_layout(self) -> DTensorSpec:
        """A DTensor leaf's gradient is laid out as the leaf (see :func:`_leaf_layout`)."""
        return self._spec

    @staticmethod
    def from_local(
        local_tensor: object,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        shape: Sequence[int] | None = None,
        stride: Sequence[int] | None = None,
        run_check: bool = False,
        grad_placements: Sequence[Placement] | None = None,
    ) -> DTensor:
        """Build a DTensor from each rank's local shard.

        **Local** when ``shape`` is given (or no placement is a Shard) and ``run_check`` is
        False. **Collective** otherwise: without ``shape``, the global shape is computed
        exactly from every rank's local shape (one small Allgather; uneven shards are never
        guessed), and the local shapes are checked to be the torch.chunk split of it; with
        ``run_check=True`` the local shapes and dtypes of all ranks are checked against the
        spec and a :class:`ShardingError` is raised on every rank on disagreement.

        Parameters
        ----------
        local_tensor : Tensor or array_like
            This rank's shard (shared, not copied).
        device_mesh : DeviceMesh
            The mesh; default a 1-D mesh over COMM_WORLD (collective to create).
        placements : sequence of Placement, optional
            Default Replicate on every mesh dim.
        shape, stride : sequence of int, optional
            The global shape (and strides). Give ``shape`` for exact uneven shards without
            communication.
        grad_placements : sequence of Placement, optional
            Differentiable when ``local_tensor`` requires grad: the DTensor's gradient is
            redistributed to these placements (default: ``placements`` with Partial taken as
            Replicate, since every contribution of a sum gets the sum's gradient) and this
            rank's shard of it is the local tensor's gradient.

        On an ``AbstractMesh`` the result is a metadata-only DTensor of ``shape`` (required
        when a placement is a Shard) and the local tensor's dtype (**Local**; a local tensor
        that requires grad is refused: the abstract DTensor has no data to flow back).

        Raises
        ------
        DTypeError
            If ``local_tensor`` is neither a tensor nor numeric data (a string, objects), or
            a placement is ``Partial("avg")`` and its dtype is not floating or complex.
        """
        if device_mesh is None:
            device_mesh = init_device_mesh()
        elif type(device_mesh) is not DeviceMesh and getattr(device_mesh, "_abstract", False):
            return device_mesh._from_local(local_tensor, placements, shape)
        try:
            local = _as_local_tensor(local_tensor, "DTensor.from_local")
        except DTypeError as e:
            raise DTypeError(
                "DTensor.from_local: local_tensor must be a Tensor or numeric array_like, got "
                f"a {type(local_tensor).__name__}: {e}"
            ) from e
        placements = normalize_placements(placements, device_mesh, "DTensor.from_local")
        if shape is None:
            shape = _infer_global_shape(local, device_mesh, placements)
            # inferring from Shard placements checked every rank's shape already; without
            # a Shard, the shape is this rank's own, which run_check compares across ranks
            run_check = run_check and not any(isinstance(p, Shard) for p in placements)
        spec = DTensorSpec(
            device_mesh, placements, tuple(int(s) for s in shape), local.dtype,
            None if stride is None else tuple(int(s) for s in stride),
        )
        if run_check:
            _check_local_shapes(local, spec)
        else:
            expected = spec.local_shape(device_mesh._coord)
            if tuple(local.shape) != expected:
                raise ShardingError(
                    f"DTensor.from_local: local shape {tuple(local.shape)} on mesh coordinate "
                    f"{device_mesh._coord} does not match the shard {expected} of global shape "
                    f"{spec.shape} under placements {placement_list(placements)}"
                )
        # after the collective checks, so that every rank took part in them
        check_partial_dtype("DTensor.from_local", spec.placements, spec.dtype)
        if local._ag is None or not _ag.MODE.enabled:
            return DTensor._make(local, spec)
        back = (_grad_target(spec.placements) if grad_placements is None
                else normalize_placements(grad_placements, device_mesh, "DTensor.from_local"))
        if spec.with_placements(back).local_shape(device_mesh._coord) != tuple(local.shape):
            raise AutogradError(
                f"DTensor.from_local: grad_placements {placement_list(back)} do not match the "
                f"local tensor of shape {tuple(local.shape)} (global shape {spec.shape})"
            )
        out = DTensor._make(wrap_array(local._arr, local._storage), spec)
        _ag.record("from_local", _from_local_backward, (_ag.edge_of(local),), (out,), back)
        return out


# -- autograd of the conversions ---------------------------------------------------------------
def _grad_target(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """The placements a gradient goes back to for an input of ``placements``: the same,
    except that the gradient of a Partial input is Replicate (each contribution to a sum
    gets the sum's gradient)."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def _to_local_backward(node: _ag.Node, grads: list) -> tuple:
    spec = node.ctx
    g = grads[0]
    out = DTensor._make(g, spec)
    if g.requires_grad and _ag.is_grad_enabled():  # create_graph: the wrap is recorded
        _ag.record("from_local", _from_local_backward, (_ag.edge_of(g),), (out,),
                   _grad_target(spec.placements))
    return (out,)


# Listeners of redistributes (dtensor.debug.explain's trace), called as fn(tensor, target
# placements) before a redistribute that changes the placements: an explicit one, full_tensor's
# and backward's moves of gradients alike.
_move_listeners: list = []


def add_redistribute_listener(fn: Callable[[DTensor, tuple], None]) -> None:
    """Call ``fn(x, placements)`` before every ``x.redistribute`` (run by the Python method)
    that changes ``x``'s placements: explicit calls, ``full_tensor`` and backward's moves of
    gradients back to an input's placements (redistribute's, from_local's and a leaf's
    layout). **Local**.

    The compiled ``redistribute`` defers to the Python method while a communication
    observer (:func:`redistribute.comm.add_observer`) is registered; a listener that must
    see every move registers one too."""
    _move_listeners.append(fn)


def remove_redistribute_listener(fn: Callable[[DTensor, tuple], None]) -> None:
    """Stop calling ``fn`` (added with :func:`add_redistribute_listener`). **Local**."""
    try:
        _move_listeners.remove(fn)
    except ValueError:
        raise ConfigError(f"remove_redistribute_listener: {fn!r} is not registered") from None


def _move_grad(g: DTensor, target: tuple) -> DTensor:
    """``g`` redistributed to ``target`` in backward. **Collective** when it moves."""
    return g.redistribute(g.device_mesh, target)


def _from_local_backward(node: _ag.Node, grads: list) -> tuple:
    return (_move_grad(grads[0], node.ctx).to_local(),)


def _redistribute_backward(node: _ag.Node, grads: list) -> tuple:
    return (_move_grad(grads[0], node.ctx),)


def record_redistribute(x: DTensor, out: DTensor) -> None:
    """Record ``out = x.redistribute(...)``: its backward redistributes the gradient back to
    ``x``'s placements (Partial as Replicate). **Local**."""
    _ag.record("redistribute", _redistribute_backward, (_ag.edge_of(x),), (out,),
               _grad_target(x._spec.placements))


def _leaf_layout(g: object, spec: DTensorSpec) -> object:
    """A DTensor leaf's gradient in the leaf's placements (Partial as Replicate).
    **Collective** when it must move."""
    if not isinstance(g, DTensor):
        return g
    target = _grad_target(spec.placements)
    return g if g._spec.placements == target else _move_grad(g, target)


_ag.install_api(DTensor)
_ag.set_leaf_layout(_leaf_layout)


# The base's slot of the local Tensor; a pending DTensor holds the handle of its output there
_BASE_LOCAL = _fp.DTensorBase._local


class PendingDTensor(DTensor):
    """A DTensor from ``redistribute(async_op=True)`` whose local shard is pending.

    Its base slot holds the handle of the pending work (:class:`redistribute.worker.Pending`
    for a worker job, :class:`redistribute.worker.Started` for a nonblocking collective
    started in this thread). It is not of type
    DTensor, so the compiled front, whose type checks ask for exactly DTensor, sends it to
    the Python dispatcher, which reads ``_local``: that waits, stores the Tensor and makes
    the object a plain DTensor again.
    """

    __slots__ = ()

    @property
    def _local(self) -> Tensor:
        return _settle(self)

    def wait(self) -> DTensor:
        """This DTensor once its data is there. **Local** (see :meth:`DTensor.wait`)."""
        _settle(self)
        return self

    def redistribute(self, *args: object, **kwargs: object) -> DTensor:
        _settle(self)
        return self.redistribute(*args, **kwargs)

    redistribute.__doc__ = DTensor.redistribute.__doc__


def _settle(d: PendingDTensor) -> Tensor:
    """Wait for ``d``'s pending shard; ``d`` becomes a plain DTensor holding it."""
    if type(d) is PendingDTensor:
        local = wrap_array(_BASE_LOCAL.__get__(d).wait())
        _BASE_LOCAL.__set__(d, local)
        d.__class__ = DTensor
        return local
    return _BASE_LOCAL.__get__(d)


_MAX_NDIM = 32


def _gather_local_meta(local: Tensor, mesh: DeviceMesh) -> np.ndarray:
    """Every rank's record (dtype char, ndim, shape padded with -1 to ``_MAX_NDIM``), as an
    array of shape ``mesh.shape + (2 + _MAX_NDIM,)`` in mesh grid order.

    **Collective** over the mesh. The record length is fixed, so ranks whose local ndim
    differs still take part and get reported instead of hanging the collective.
    """
    if local.ndim > _MAX_NDIM:
        raise ShardingError(f"DTensor.from_local: {local.ndim}-D tensors are not supported")
    if getattr(mesh, "_base", None) is None:  # a mesh seen from one coordinate (AbstractMesh)
        raise MeshError(
            f"DTensor.from_local: give shape= on {mesh!r}: its other coordinates' local shapes "
            "cannot be gathered"
        )
    mine = np.full(2 + _MAX_NDIM, -1, dtype=np.int64)
    mine[0] = ord(local.dtype.char)
    mine[1] = local.ndim
    mine[2 : 2 + local.ndim] = local.shape
    allmeta = mesh._base.allgather_ints(mine, "DTensor.from_local: local shapes").reshape(
        -1, mine.size
    )
    # rows come in communicator-rank order; the grid maps mesh coordinates to those ranks
    return allmeta[mesh._grid.ravel()].reshape(mesh.shape + (mine.size,))


def _infer_global_shape(
    local: Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> tuple[int, ...]:
    """Exact global shape from all ranks' local shapes. **Collective** when any placement
    is a Shard, Local otherwise."""
    if not any(isinstance(p, Shard) for p in placements):
        return tuple(local.shape)
    ndim = local.ndim
    for p in placements:
        if isinstance(p, Shard) and not -ndim <= p.dim < ndim:
            raise ShardDimError(
                f"DTensor.from_local: {p!r} is out of range for a {ndim}-D local tensor of "
                f"shape {tuple(local.shape)} (placements {placement_list(placements)})"
            )
    meta = _gather_local_meta(local, mesh)
    shape = []
    for d in range(ndim):
        mesh_dims = [
            m for m, p in enumerate(placements) if isinstance(p, Shard) and p.dim % ndim == d
        ]
        # sum the local sizes over the sub-grid of the mesh dims that shard d (others at 0)
        index = tuple(slice(None) if m in mesh_dims else 0 for m in range(mesh.ndim))
        shape.append(int(meta[index + (2 + d,)].sum()))
    spec = DTensorSpec(mesh, placements, tuple(shape), local.dtype)
    _raise_on_bad_meta(meta, spec, "from_local")
    return spec.shape


def _check_local_shapes(local: Tensor, spec: DTensorSpec) -> None:
    """Raise on every rank if any rank's local shape or dtype disagrees with ``spec``.
    **Collective** over the mesh."""
    _raise_on_bad_meta(_gather_local_meta(local, spec.mesh), spec, "from_local(run_check=True)")


def _raise_on_bad_meta(meta: np.ndarray, spec: DTensorSpec, op: str) -> None:
    """Compare gathered records with the spec; raise the same error on every rank.
    **Local** (works on already-gathered data)."""
    mesh = spec.mesh
    bad = []
    for coord in np.ndindex(*mesh.shape):
        rec = meta[coord]
        dtype_char, ndim = chr(int(rec[0])), int(rec[1])
        got = tuple(int(v) for v in rec[2 : 2 + ndim])
        want = _layout_local_shape(spec.shape, mesh.shape, spec.placements, coord)
        if dtype_char != spec.dtype.char or got != want:
            bad.append(
                f"coordinate {coord} (rank {int(mesh.mesh[coord])}): local "
                f"{np.dtype(dtype_char).name} {got}, expected {spec.dtype.name} {want}"
            )
    if bad:
        raise ShardingError(
            f"DTensor.{op}: local shards do not match global shape {spec.shape} under "
            f"placements {placement_list(spec.placements)} on mesh {mesh.shape}: " + "; ".join(bad)
        )


def distribute_tensor(
    tensor: object,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """Distribute a global tensor over a mesh.

    **Collective** over the mesh.

    Parameters
    ----------
    tensor : Tensor, ndarray or array_like, or None
        The global data. With ``src_data_rank=r`` only rank ``r`` needs it (others may pass
        None or anything of the right shape; its values are ignored): the source packs each
        rank's shard once and scatters it, so no other rank builds the global tensor. With
        ``src_data_rank=None`` every rank passes the same global data and keeps a view of its
        own shard (no communication, no copy).
    device_mesh : DeviceMesh or AbstractMesh, optional
        Default: a 1-D mesh over COMM_WORLD. On an ``AbstractMesh`` the result is a
        metadata-only DTensor of ``tensor``'s shape and dtype (**Local**; see
        :func:`dtensor.distributed.abstract.abstract_like`); on one with ``coord``, that
        coordinate's shard of ``tensor``, as with ``src_data_rank=None``.
    placements : sequence of Placement, optional
        Default: Replicate on every mesh dim. ``Partial("sum")`` places the value on mesh
        coordinate 0 of that dim and zeros elsewhere; other Partial kinds place it everywhere.
    src_data_rank : int or None
        Rank (in ``device_mesh.mesh`` numbering) that holds the data.

    Returns
    -------
    DTensor
        A leaf that requires grad when ``tensor`` does (as PyTorch's).

    Raises
    ------
    DTypeError
        A ``Partial("avg")`` placement of a dtype that is not floating or complex.
    """
    if device_mesh is None:
        device_mesh = init_device_mesh()
    mesh = device_mesh
    if type(mesh) is not DeviceMesh and hasattr(mesh, "_abstract"):  # an AbstractMesh
        if mesh._abstract:
            return mesh._distribute(tensor, placements)
        src_data_rank = None  # seen from one coordinate, which has the tensor: nothing is sent
    placements = normalize_placements(placements, mesh, "distribute_tensor")
    alloc = allocator_for(mesh.device_type)
    if src_data_rank is None:
        data = _as_local_tensor(tensor, "distribute_tensor").to(mesh.device_type)
        spec = DTensorSpec(mesh, placements, tuple(data.shape), data.dtype)
        check_partial_dtype("distribute_tensor", spec.placements, spec.dtype)
        src_spec = spec.with_placements((Replicate(),) * mesh.ndim)
        steps = _plan(src_spec, placements)
        out = _execute(steps, data._arr, src_spec, mesh._coord, mesh._dim_comms, alloc)
        same = data if data._ag is None else data.detach()
        out = DTensor._make(wrap_array(out) if out is not data._arr else same, spec)
        return out.requires_grad_() if data.requires_grad else out

    hits = np.argwhere(mesh.mesh == src_data_rank)
    if hits.size == 0:
        raise MeshError(
            f"distribute_tensor: src_data_rank={src_data_rank} is not in the mesh "
            f"{mesh.mesh.tolist()}"
        )
    src = int(mesh._grid[tuple(hits[0])])
    base = mesh._base
    is_src = base.rank == src
    data = _as_local_tensor(tensor, "distribute_tensor") if (is_src or tensor is not None) else None
    if is_src and data is None:
        raise ShardingError("distribute_tensor: the source rank passed no data")
    # Agree on (ndim, dtype, shape) from the source; every rank checks its own claim.
    meta = np.zeros(2 + _MAX_NDIM, dtype=np.int64)
    if is_src:
        if data.ndim > _MAX_NDIM:
            raise ShardingError(f"distribute_tensor: {data.ndim}-D tensors are not supported")
        meta[0] = data.ndim
        meta[1] = ord(data.dtype.char)
        meta[2 : 2 + data.ndim] = data.shape
    base.bcast_array(meta, src, "distribute_tensor: the source's shape and dtype")
    ndim = int(meta[0])
    shape = tuple(int(s) for s in meta[2 : 2 + ndim])
    dtype = dtype_of_char(chr(int(meta[1])))
    spec = DTensorSpec(mesh, placements, shape, dtype)
    # on every rank, now that the source's dtype is known here
    check_partial_dtype("distribute_tensor", spec.placements, spec.dtype)
    mismatch = data is not None and not is_src and (tuple(data.shape) != shape)
    flags = base.allgather_ints(
        np.array([int(mismatch)], dtype=np.int64), "distribute_tensor: shape check"
    )
    if flags.any():
        ranks = [int(mesh.mesh.ravel()[i]) for i in np.nonzero(flags.ravel())[0]]
        raise ShardingError(
            f"distribute_tensor: ranks {ranks} passed a tensor whose shape differs from the "
            f"source rank {src_data_rank}'s {shape} (placements {placement_list(placements)})"
        )
    out = _scatter_from(
        src, data.to(mesh.device_type)._arr if is_src else None, spec, mesh._coord, base, alloc
    )
    out = DTensor._make(wrap_array(out), spec)
    # the source's requires_grad decides (every rank must ask for the same)
    return out.requires_grad_() if data is not None and data.requires_grad else out
