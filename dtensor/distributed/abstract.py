"""Abstract meshes and metadata-only DTensors: plans, collectives and memory of a mesh that
this process does not have.

This module owns :class:`AbstractMesh` (a mesh of shape and dim names only: no ranks, no
communicator, any size in one process), :class:`AbstractDTensor` (a DTensor on such a mesh
that holds no data: its spec, and the size of the block its largest local shard would
occupy), the factories :func:`abstract_tensor` and :func:`abstract_like`, how ops and
redistributions run on them (:class:`EntryRunner`, :func:`run_plan`) and the memory they
predict (:func:`abstract_memory_stats`, :func:`reset_abstract_peak`).

Every table op on an AbstractDTensor runs the dispatcher's own decision (rule -> cost model
-> strategy -> redistribute plans, cached as for any mesh); running the decision then calls
no kernel and no collective:

- each communicating step of an input's plan is reported to the observers of
  :mod:`redistribute.comm` with the kind and the bytes the real collective reports, on a
  stand-in of its mesh dim's communicator (:class:`AbstractGroup`), while the dispatcher
  names the op: ``CommDebugMode`` records it as it would on a real mesh;
- the outputs are new AbstractDTensors of the decision's output specs (an in-place op
  returns its first argument; the view ops' outputs share their input's block).

``redistribute`` (explicit, and the moves of gradients in backward) reports its plan's
collectives the same way. Backward formulas are ordinary ops, so autograd works unchanged.
What needs values (``to_local``, ``full_tensor``, ``item``, ``bool``, numpy conversion)
raises :class:`~placements.errors.MetadataOnlyError` naming the op.

``AbstractMesh(shape, coord=c)`` is the other use of the class: the mesh seen from one
coordinate, whose DTensors are ordinary ones holding that coordinate's data (ops run their
kernels; collectives run on the ``groups`` given, per mesh dim). The strategy validator and
one-process tests run kernels per coordinate on it.

Per-rank figures are those of mesh coordinate ``(0, ..., 0)``: under torch.chunk splits it
holds the largest block of every tensor (:func:`placements.layout.max_local_shape`), so
they are the worst rank's, and they equal what rank 0 (coordinate 0 of a row-major mesh)
records on a real run of the same program.

Memory: each AbstractDTensor's block counts its bytes while any DTensor (views, and the
tensors autograd saves for backward) refers to it, as the allocator's blocks do; the
redistributed inputs of an op count until the op returns. :func:`abstract_memory_stats`
gives the live bytes and the peak since :func:`reset_abstract_peak`. The model knows no
strides: ``reshape``/``contiguous`` count as views, other ops as new outputs, and staging
and pack buffers of the collectives are not counted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from placements import Placement, Replicate
from placements.errors import MeshError, MetadataOnlyError
from placements.spec import DTensorSpec, check_partial_dtype
from placements.types import placement_list
from redistribute import comm as _comm
from redistribute import hosts as _hosts
from redistribute.cost import WIDENED, buffer_bytes

from ..local import dtypes as _dtypes
from ..local.kernels.index import KthvalueResult, SortResult, TopkResult
from ..local.kernels.reduce import MaxResult, MinResult
from ..local.tensor import Tensor
from .dtensor import DTensor, _as_local_tensor, normalize_placements
from .mesh import DeviceMesh

__all__ = [
    "ALIASES",
    "AbstractDTensor",
    "AbstractGroup",
    "AbstractMesh",
    "EntryRunner",
    "abstract_like",
    "abstract_memory_stats",
    "abstract_tensor",
    "reset_abstract_peak",
    "run_plan",
]


# -- the mesh ------------------------------------------------------------------------------------
#: What a communicator (:class:`redistribute.comm.Comm`) has (its collectives and MPI state):
#: asking a stand-in for what it lacks of these raises (:meth:`AbstractGroup._refuse`).
_COMM_ONLY = frozenset(n for n in dir(_comm.Comm) if not n.startswith("__"))


class AbstractGroup:
    """Stands in for the communicator of one mesh dim of an :class:`AbstractMesh`: its mesh
    dim, size and the rank of the coordinate the mesh is seen from (what the observers of
    :mod:`redistribute.comm` and the redistribute executor read); no MPI.

    A collective on it (a :class:`~redistribute.comm.Comm` method, or a call of its ``mpi``)
    raises :class:`~placements.errors.MeshError` naming the op that asked for it.
    """

    __slots__ = ("mesh_dim", "rank", "size")
    async_op = False

    def __init__(self, mesh_dim: int, size: int, rank: int = 0) -> None:
        self.mesh_dim = mesh_dim
        self.size = size
        self.rank = rank

    @property
    def mpi(self) -> _NoMPI:
        """A stand-in of the MPI communicator whose calls raise (compiled moves keep it for
        the moves that communicate). **Local**."""
        return _NoMPI(self)

    def _refuse(self, call: str) -> MeshError:
        op = _comm.HOOKS.op_source() or "redistribute"
        return MeshError(
            f"{op}: {call} over mesh dim {self.mesh_dim} (size {self.size}, seen from rank "
            f"{self.rank}) needs a communicator, and an AbstractMesh has none: only "
            "AbstractMesh(..., coord=c, groups=...) communicates, through its groups"
        )

    def __getattr__(self, name: str) -> object:
        if name in _COMM_ONLY:
            raise self._refuse(name)
        raise AttributeError(f"'AbstractGroup' object has no attribute {name!r}")

    def __repr__(self) -> str:
        return f"AbstractGroup(mesh_dim={self.mesh_dim}, size={self.size}, rank={self.rank})"


class _NoMPI:
    """The ``mpi`` of an :class:`AbstractGroup`: every MPI call raises."""

    __slots__ = ("group",)

    def __init__(self, group: AbstractGroup) -> None:
        self.group = group

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(f"'_NoMPI' object has no attribute {name!r}")
        raise self.group._refuse(f"MPI {name}")


class AbstractMesh:
    """A mesh of shape and dim names only, with no ranks behind it.

    **Local** to construct, any size (``AbstractMesh((64, 8), ("dp", "tp"))`` is 512 ranks
    in one process). It serves wherever a :class:`DeviceMesh` serves as metadata: specs,
    sharding decisions, redistribute plans and their costs, ``explain``, and the DTensors
    of :func:`abstract_tensor` / ``distribute_tensor`` on it (metadata only). Seen from
    coordinate ``(0, ..., 0)`` (:meth:`get_coordinate`), whose shards are the largest.

    With ``coord``, it is a *coordinate mesh*: the mesh seen from that one coordinate, as a
    DeviceMesh is seen from its rank, whose DTensors hold data (that coordinate's shards):
    ``distribute_tensor`` takes the coordinate's block of the whole tensor (src_data_rank
    is ignored: nothing is sent), factories fill it, and ops run their kernels, in one
    process. A collective on it (a move that communicates, a kernel that all-reduces) runs
    on ``groups[m]`` for mesh dim ``m``; by default these are :class:`AbstractGroup`
    stand-ins that raise :class:`~placements.errors.MeshError` naming the op. The strategy
    validator runs every coordinate this way, one thread each, with simulated groups.

    Immutable and hashable. Equal to another AbstractMesh of the same shape, names, device
    type and kind (abstract, or coordinate mesh), never to a DeviceMesh; the coordinate and
    groups are where the mesh is seen from, not part of its identity (as the DeviceMeshes of
    one mesh on different ranks are one mesh). The dispatcher's decisions hold
    coordinate-dependent data (offsets, a Partial scalar's holder): a process that looks at
    one mesh from several coordinates in turn should ``dt.debug.clear_prop_cache()`` in
    between, unless each coordinate has its own mesh object (entries are cached per mesh
    object).

    Parameters
    ----------
    shape : sequence of int
        The mesh shape (every size at least 1).
    mesh_dim_names : sequence of str, optional
        One unique name per mesh dim, for ``mesh["tp"]``.
    device_type : str
        The device type the mesh stands for (``"cpu"``, ``"cuda"``); informative only
        without ``coord``; with it, where the shards are allocated.
    coord : sequence of int, optional
        The coordinate the mesh is seen from: a coordinate mesh (see above).
    groups : sequence, optional
        With ``coord`` only: one communicator per mesh dim (an object with the
        :class:`~redistribute.comm.Comm` methods the collectives call, and ``rank``,
        ``size``); default :class:`AbstractGroup` stand-ins.
    ranks_per_host : int, optional
        The ranks of one host, consecutive in row-major order (``AbstractMesh((64, 8),
        ranks_per_host=8)``: 64 hosts of 8). A mesh dim whose groups hold ranks of several
        hosts crosses the network (:attr:`dim_spans_hosts`) and the cost model prices its
        collectives with its ``inter_host`` tier. Default: one host.

    Raises
    ------
    MeshError
        A bad shape or names, a coordinate outside the shape, ``groups`` of the wrong length
        or without ``coord``.
    """

    __slots__ = ("_abstract", "_coord", "_dim_comms", "_hash", "_names", "_shape", "_spans",
                 "device_type")

    def __init__(
        self,
        shape: Sequence[int] | int,
        mesh_dim_names: Sequence[str] | None = None,
        *,
        device_type: str = "cpu",
        coord: Sequence[int] | None = None,
        groups: Sequence[object] | None = None,
        ranks_per_host: int | None = None,
    ) -> None:
        if groups is not None and coord is None:
            raise MeshError("AbstractMesh: groups= needs coord= (an abstract mesh communicates "
                            "nothing)")
        self._init(shape, mesh_dim_names, device_type, coord, groups)
        if ranks_per_host is not None:
            n = int(ranks_per_host) if isinstance(ranks_per_host, (int, np.integer)) else 0
            if n < 1:
                raise MeshError(f"AbstractMesh: ranks_per_host must be a positive int, got "
                                f"{ranks_per_host!r}")
            self._set_spans(_hosts.spans_of(self.mesh // n))

    def _set_spans(self, spans: tuple[bool, ...]) -> None:
        self._spans = tuple(bool(b) for b in spans)
        self._hash = hash(("AbstractMesh", self.device_type, self._shape, self._names,
                           self._abstract, self._spans))

    @property
    def dim_spans_hosts(self) -> tuple[bool, ...]:
        """Per mesh dim: whether its collectives cross hosts (``ranks_per_host``). **Local**."""
        return self._spans

    def _init(self, shape, names, device_type, coord, groups) -> None:
        if isinstance(shape, (int, np.integer)):
            shape = (shape,)
        try:
            shape = tuple(int(s) for s in shape)
        except (TypeError, ValueError):
            shape = ()
        if not shape or any(s < 1 for s in shape):
            raise MeshError(
                f"AbstractMesh: shape must be a non-empty sequence of positive ints, got {shape!r}"
            )
        names = None if names is None else tuple(names)
        if names is not None and (len(names) != len(shape) or len(set(names)) != len(names)):
            raise MeshError(
                f"AbstractMesh: mesh_dim_names {names} must be {len(shape)} unique names for a "
                f"mesh of shape {shape}"
            )
        self._abstract = coord is None  # (the test of distribute_tensor and the dispatcher)
        if coord is not None:
            try:
                coord = tuple(int(c) for c in coord)
            except (TypeError, ValueError):
                coord = ()
            if len(coord) != len(shape) or not all(0 <= c < s for c, s in zip(coord, shape)):
                raise MeshError(f"AbstractMesh: coord {coord!r} is not a coordinate of a mesh "
                                f"of shape {shape}")
        self._coord = (0,) * len(shape) if coord is None else coord
        if groups is None:
            groups = tuple(AbstractGroup(m, k, c) for m, (k, c) in
                           enumerate(zip(shape, self._coord)))
        elif len(groups) != len(shape):
            raise MeshError(f"AbstractMesh: groups must be {len(shape)}, one per mesh dim of "
                            f"shape {shape}, got {len(groups)}")
        self._shape = shape
        self._names = names
        self._dim_comms = tuple(groups)
        self.device_type = str(device_type)
        self._set_spans((False,) * len(shape))

    @classmethod
    def from_mesh(cls, mesh: object) -> AbstractMesh:
        """The abstract mesh of ``mesh``'s shape, dim names and device type. **Local**."""
        return cls(mesh.shape, mesh.mesh_dim_names, device_type=mesh.device_type)

    # -- metadata (all Local) ------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh shape. **Local**."""
        return self._shape

    @property
    def ndim(self) -> int:
        """Number of mesh dims. **Local**."""
        return len(self._shape)

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None:
        """The mesh dim names, or None. **Local**."""
        return self._names

    @property
    def mesh(self) -> np.ndarray:
        """The rank numbers a real mesh of this shape would have (row-major). **Local**."""
        return np.arange(math.prod(self._shape), dtype=np.int64).reshape(self._shape)

    def size(self, mesh_dim: int | str | None = None) -> int:
        """Number of ranks of the mesh, or along one mesh dim. **Local**."""
        if mesh_dim is None:
            return math.prod(self._shape)
        return self._shape[self._dim_index(mesh_dim)]

    def get_coordinate(self) -> tuple[int, ...]:
        """The coordinate the mesh is seen from: ``coord``, or ``(0, ..., 0)``, whose figures
        an abstract mesh gives. **Local**."""
        return self._coord

    # the same name and index resolution as a DeviceMesh's
    _dim_index = DeviceMesh._dim_index
    get_local_rank = DeviceMesh.get_local_rank

    def get_rank(self) -> int:
        """The rank of :meth:`get_coordinate` in a row-major mesh (0 without ``coord``).
        **Local**."""
        return int(np.ravel_multi_index(self._coord, self._shape))

    def get_group(self, mesh_dim: int | str = 0) -> AbstractGroup:
        """One mesh dim's communicator: its stand-in (no MPI), or ``groups``' entry.
        **Local**."""
        return self._dim_comms[self._dim_index(mesh_dim)]

    def get_all_groups(self) -> tuple[AbstractGroup, ...]:
        """One communicator (or :class:`AbstractGroup`) per mesh dim. **Local**."""
        return self._dim_comms

    def __getitem__(self, names: str | int | tuple) -> AbstractMesh:
        """Sub-mesh over one or several mesh dims (by name or index), in mesh order. Its
        groups keep the mesh dims of this mesh, as a DeviceMesh's sub-meshes keep their
        communicators. **Local**."""
        if not isinstance(names, tuple):
            names = (names,)
        dims = tuple(self._dim_index(n) for n in names)
        if len(set(dims)) != len(dims) or list(dims) != sorted(dims):
            raise MeshError(
                f"AbstractMesh: sub-mesh dims {names} must be distinct and in mesh order "
                f"(mesh_dim_names={self._names})"
            )
        if dims == tuple(range(self.ndim)):
            return self
        sub = AbstractMesh.__new__(AbstractMesh)
        sub._init(
            tuple(self._shape[d] for d in dims),
            None if self._names is None else tuple(self._names[d] for d in dims),
            self.device_type,
            None if self._abstract else tuple(self._coord[d] for d in dims),
            tuple(self._dim_comms[d] for d in dims),
        )
        sub._set_spans(tuple(self._spans[d] for d in dims))
        return sub

    def _flatten(self, mesh_dim_name: str | None = None) -> AbstractMesh:
        """A 1-D abstract mesh of all of this mesh's ranks (``DeviceMesh._flatten``), seen
        from this mesh's rank when it has a coordinate (its group a stand-in). **Local**."""
        name = mesh_dim_name
        if name is None and self._names is not None:
            name = "_".join(self._names)
        flat = AbstractMesh((self.size(),), None if name is None else (name,),
                            device_type=self.device_type,
                            coord=None if self._abstract else (self.get_rank(),))
        flat._set_spans((any(self._spans),))
        return flat

    def _distribute(self, tensor: object, placements: Sequence[Placement] | None) -> AbstractDTensor:
        """``distribute_tensor(tensor, self, placements)`` without ``coord``:
        :func:`abstract_like`. **Local**."""
        return abstract_like(tensor, self, placements)

    def _from_local(
        self, local: object, placements: Sequence[Placement] | None, shape: Sequence[int] | None
    ) -> AbstractDTensor:
        """``DTensor.from_local(local, self, placements, shape=shape)`` without ``coord``: an
        AbstractDTensor of ``shape`` (``local``'s when no placement is a Shard) and
        ``local``'s dtype. **Local**.

        Raises
        ------
        MetadataOnlyError
            Without ``shape`` when a placement is a Shard (the global shape would be
            gathered from ranks that do not exist), or for a ``local`` that requires grad.
        """
        placements = normalize_placements(placements, self, "DTensor.from_local")
        local = _as_local_tensor(local, "DTensor.from_local")
        if local.requires_grad:
            raise MetadataOnlyError(
                "DTensor.from_local: a local tensor that requires grad cannot make a DTensor "
                f"on an abstract mesh ({self!r}): no gradient could flow back to it"
            )
        if shape is None:
            if any(p.is_shard() for p in placements):
                raise MetadataOnlyError(
                    f"DTensor.from_local: give shape= on an abstract mesh ({self!r}) for "
                    f"placements {placement_list(placements)}: the global shape cannot be "
                    "gathered from ranks that do not exist"
                )
            shape = local.shape
        return abstract_tensor(shape, self, placements, dtype=local.dtype)

    # -- identity ------------------------------------------------------------------------------
    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, AbstractMesh):
            return NotImplemented if not isinstance(other, DeviceMesh) else False
        return (self._shape, self._names, self.device_type, self._abstract, self._spans) == (
            other._shape, other._names, other.device_type, other._abstract, other._spans)

    def __reduce__(self) -> tuple:
        """Pickled as its shape, names, device type and coordinate (the groups stay)."""
        return _rebuild, (self._shape, self._names, self.device_type,
                          None if self._abstract else self._coord, self._spans)

    def __repr__(self) -> str:
        names = "" if self._names is None else f", mesh_dim_names={self._names}"
        device = "" if self.device_type == "cpu" else f", device_type={self.device_type!r}"
        coord = "" if self._abstract else f", coord={self._coord}"
        spans = f", dim_spans_hosts={self._spans}" if any(self._spans) else ""
        return f"AbstractMesh({self._shape}{names}{device}{coord}{spans})"


def _rebuild(shape: tuple, names: tuple | None, device_type: str,
             coord: tuple | None = None, spans: tuple | None = None) -> AbstractMesh:
    mesh = AbstractMesh(shape, names, device_type=device_type, coord=coord)
    if spans is not None:
        mesh._set_spans(spans)
    return mesh


# -- memory ------------------------------------------------------------------------------------
class _Memory:
    """Live and peak bytes of the blocks of abstract tensors (coordinate 0's)."""

    __slots__ = ("live", "peak")

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0


_MEMORY = _Memory()


class _Block:
    """The memory one abstract shard would occupy on coordinate 0; views share it. Its bytes
    count from its creation until the last shard referring to it goes.

    It also stands for the shard's array where autograd keys its version counters (the
    owner of ``_local._arr``, or that array's ``base``: None here).
    """

    __slots__ = ("nbytes",)
    base = None

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        m = _MEMORY
        m.live += nbytes
        m.peak = max(m.peak, m.live)

    def __del__(self, _memory: _Memory = _MEMORY) -> None:
        _memory.live -= self.nbytes


#: The block of stand-ins (:meth:`AbstractDTensor.stand_in`): no bytes.
_NO_BLOCK = _Block(0)


class _MetaShard:
    """What an AbstractDTensor holds in place of a local tensor: coordinate 0's shard
    shape and dtype, and its block; no data."""

    __slots__ = ("_arr", "dtype", "shape")

    def __init__(self, block: _Block, shape: tuple[int, ...], dtype: np.dtype) -> None:
        self._arr = block  # (the name autograd's version counters read)
        self.shape = shape
        self.dtype = dtype

    @property
    def block(self) -> _Block:
        return self._arr

    def __repr__(self) -> str:
        return f"<no data: {self.dtype}{list(self.shape)}>"


def abstract_memory_stats() -> dict[str, int]:
    """Predicted memory of the abstract tensors of this process, per rank. **Local**.

    Returns
    -------
    dict
        ``live_bytes``: the bytes their blocks hold on the worst rank (mesh coordinate 0)
        now; ``peak_bytes``: the most they held at once since :func:`reset_abstract_peak`
        (saved-for-backward tensors and the redistributed inputs of each op included).
    """
    return {"live_bytes": _MEMORY.live, "peak_bytes": _MEMORY.peak}


def reset_abstract_peak() -> None:
    """Start a new peak: ``peak_bytes`` becomes the live bytes now. **Local**."""
    _MEMORY.peak = _MEMORY.live


# -- metadata-only DTensors ------------------------------------------------------------------
def _nbytes(spec: DTensorSpec, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * spec.dtype.itemsize


class AbstractDTensor(DTensor):
    """A DTensor on an :class:`AbstractMesh`: metadata only, no data.

    Its metadata (``shape``, ``dtype``, ``placements``, ``device_mesh``, ``spec``,
    ``requires_grad``, ``grad``...) is a DTensor's; ops, ``redistribute`` and autograd run
    their decisions without data (see the module docstring). What needs values raises
    :class:`~placements.errors.MetadataOnlyError` naming the op. Make one with
    :func:`abstract_tensor`, :func:`abstract_like` or ``distribute_tensor`` on an abstract
    mesh.
    """

    __slots__ = ()
    _abstract = True

    @classmethod
    def _new(cls, spec: DTensorSpec, block: _Block | None = None) -> AbstractDTensor:
        """An AbstractDTensor of ``spec`` in ``block`` (a new block when None). **Local**."""
        shape = spec.local_shape(spec.mesh._coord)
        if block is None:
            block = _Block(_nbytes(spec, shape))
        self = DTensor.__new__(cls)
        self._local = _MetaShard(block, shape, spec.dtype)
        self._spec = spec
        return self

    @property
    def device(self) -> str:
        """The device type of the abstract mesh. **Local**."""
        return self._spec.mesh.device_type

    def __repr__(self) -> str:
        s = self._spec
        grad = ", requires_grad=True" if self.requires_grad else ""
        return (
            f"AbstractDTensor(shape={s.shape}, dtype={s.dtype}, "
            f"placements={placement_list(s.placements)}, device_mesh={s.mesh!r}{grad})"
        )

    def __copy__(self) -> AbstractDTensor:
        """A new handle on the same block and spec. **Local**."""
        return AbstractDTensor._new(self._spec, self._local.block)

    def __deepcopy__(self, memo: dict) -> AbstractDTensor:
        """A new AbstractDTensor of the same spec (a new block). **Local**."""
        out = memo[id(self)] = AbstractDTensor._new(self._spec)
        return out

    def _no_data(self, op: str) -> MetadataOnlyError:
        s = self._spec
        return MetadataOnlyError(
            f"{op}: a DTensor on an abstract mesh has no data ({placement_list(s.placements)}, "
            f"shape {s.shape}, {s.dtype}, {s.mesh!r}): only its metadata, sharding decisions, "
            "collectives and memory can be asked for; run on a DeviceMesh for values"
        )

    def _host_error(self, what: str) -> MetadataOnlyError:
        return self._no_data(what)

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> Tensor:
        """Refused: there is no local shard. **Local** (raises MetadataOnlyError)."""
        raise self._no_data("to_local")

    def full_tensor(self) -> Tensor:
        """Refused: there are no values. **Local** (raises MetadataOnlyError)."""
        raise self._no_data("full_tensor")

    def item(self) -> object:
        """Refused: there are no values. **Local** (raises MetadataOnlyError)."""
        raise self._no_data("item")

    def __bool__(self) -> bool:
        raise self._no_data("bool")

    def __float__(self) -> float:
        raise self._no_data("float")

    def __int__(self) -> int:
        raise self._no_data("int")

    def __complex__(self) -> complex:
        raise self._no_data("complex")

    def tolist(self) -> object:
        """Refused: there are no values. **Local** (raises MetadataOnlyError)."""
        raise self._no_data("tolist")

    def stand_in(self) -> AbstractDTensor:
        """A handle of this tensor's spec over no memory: what an autograd node keeps of an
        argument whose value its formula does not read (the layout, not the block), as the
        stand-ins of data-holding tensors hold one zero. **Local**."""
        return AbstractDTensor._new(self._spec, _NO_BLOCK)

    def _planned(self, dst: DTensorSpec, steps: tuple) -> AbstractDTensor:
        """``redistribute``'s move to ``dst`` along ``steps`` (:func:`run_plan`). **Local**."""
        return AbstractDTensor._new(dst, run_plan(steps, self._spec))

    def _autograd_ones(self) -> AbstractDTensor:
        """The implicit gradient of a one-element tensor: Replicate, of its shape."""
        spec = self._spec
        return AbstractDTensor._new(spec.with_placements((Replicate(),) * spec.mesh.ndim))


def run_plan(steps: Sequence, spec: DTensorSpec) -> _Block | None:
    """Run a redistribute plan of ``spec``'s abstract tensor: report each communicating step
    to the observers of :mod:`redistribute.comm` and count the buffers it would allocate.
    **Local** (nothing is communicated).

    A step over a mesh dim of size 1 moves nothing, as in the executor; a step that does not
    communicate is a view (LocalChunk) or the input itself (PartitionPartial on coordinate
    0, the holder). The bytes reported are :func:`redistribute.cost.buffer_bytes`: on
    coordinate 0, what the real collective reports there (the larger of its input and
    output blocks).

    Returns
    -------
    _Block or None
        The block of the result, or None when the result is a view of the input.
    """
    block = None
    groups = spec.mesh._dim_comms
    for step in steps:
        m = step.mesh_dim
        if not step.communicates or spec.mesh_shape[m] == 1:
            continue
        if _comm.HOOKS.observers:
            _comm.notify(step.kind, buffer_bytes(step, spec), groups[m])
        if block is None or step.kind != "all_reduce":  # an owned buffer reduces in place
            shape = spec.with_placements(step.after).local_shape(spec.mesh._coord)
            block = _Block(_nbytes(spec, shape))
    return block


def _kernel_collectives(entry: object) -> None:
    """Report the all-reduces the chosen strategy's kernel runs itself (its candidates that
    say :attr:`placements.rules.Candidate.collective`: a vocab-parallel loss, a mean loss's
    denominator) as the real kernel's collectives report them (a bfloat16 reduction widened
    to float32, as it runs). **Local**."""
    considered = entry.strategy.candidates_considered
    if not considered:
        return
    spec = entry.out_specs[0]
    groups = spec.mesh._dim_comms
    dtype = np.dtype(spec.dtype)
    itemsize = WIDENED.get(dtype, dtype).itemsize
    for m, c in enumerate(considered[-1][0]):  # the chosen combination: the last best found
        if c.collective and spec.mesh_shape[m] > 1:
            for n in c.reduces:
                _comm.notify("all_reduce", n * itemsize, groups[m])


#: Ops whose kernels return a namedtuple of (values, indices).
_NAMED = {"max": MaxResult, "min": MinResult, "sort": SortResult, "topk": TopkResult,
          "kthvalue": KthvalueResult}
#: Ops whose kernels return a tuple whatever the number of outputs.
_SEQUENCES = frozenset(("split", "chunk", "unbind"))
#: Ops whose output is their input's memory without being a view op: a new handle.
ALIASES = frozenset(("detach",))


class EntryRunner:
    """How a cache entry of the dispatcher runs on an abstract mesh (its ``abstract``).

    Called as ``runner(entry, args)`` with the entry's tensor-like arguments (one per slot)
    while the dispatcher names the op: runs the plans of the moved inputs
    (:func:`run_plan`) and returns the outputs, in the structure of the op's kernel (a
    DTensor, a tuple, or the kernel's namedtuple); an in-place op returns its first
    argument. ``view``: the outputs share the block of the first argument (after its move):
    view ops, and the ops of :data:`ALIASES`.
    """

    __slots__ = ("name", "view")

    def __init__(self, name: str, view: bool) -> None:
        self.name = name
        self.view = view

    def __call__(self, entry: object, args: list) -> object:
        moved = []
        for v, move in zip(args, entry.moves):
            steps = getattr(move, "steps", None)  # a Redist (an input's plan), or a scalar's
            moved.append(run_plan(steps, v._spec) if steps else None)
        if _comm.HOOKS.observers:
            _kernel_collectives(entry)
        if entry.inplace:
            return args[0]
        share = None
        if self.view and args and isinstance(args[0], DTensor):
            share = moved[0] if moved[0] is not None else args[0]._local.block
        outs = [AbstractDTensor._new(s, share) for s in entry.out_specs]
        named = _NAMED.get(self.name)
        if named is not None and len(outs) == 2:
            return named(*outs)
        if len(outs) == 1 and self.name not in _SEQUENCES:
            return outs[0]
        return tuple(outs)


# -- factories ----------------------------------------------------------------------------------
def abstract_tensor(
    shape: Sequence[int],
    mesh: AbstractMesh,
    placements: Sequence[Placement] | None = None,
    *,
    dtype: object = None,
    requires_grad: bool = False,
    memory: bool = True,
) -> AbstractDTensor:
    """A metadata-only DTensor of global ``shape`` laid out as ``placements`` on ``mesh``.

    **Local**; nothing is allocated (its block counts in :func:`abstract_memory_stats`,
    unless ``memory=False``).

    Parameters
    ----------
    shape : sequence of int
        The global shape.
    mesh : AbstractMesh
        Without ``coord`` (a coordinate mesh's DTensors hold data).
    placements : sequence of Placement, optional
        One per mesh dim; default Replicate everywhere.
    dtype : dtype-like, optional
        Default :func:`dtensor.get_default_dtype`.
    requires_grad : bool
        Make it a leaf that requires grad (a parameter).
    memory : bool
        False: a handle that holds no bytes (a view into memory that is counted elsewhere,
        e.g. a buffer whose own tensor a program drops when the real buffer is freed).

    Raises
    ------
    MeshError
        ``mesh`` is not an AbstractMesh, or has a coordinate.
    PlacementError, DTypeError
        As ``distribute_tensor`` for bad placements (and ``Partial("avg")`` of a dtype that
        is not floating).
    """
    if not isinstance(mesh, AbstractMesh) or not mesh._abstract:
        raise MeshError(
            f"abstract_tensor: mesh must be an AbstractMesh without coord, got {mesh!r} "
            "(AbstractMesh.from_mesh(mesh) makes one of a mesh's shape)"
        )
    placements = normalize_placements(placements, mesh, "abstract_tensor")
    dtype = _dtypes.get_default_dtype() if dtype is None else _dtypes.to_dtype(dtype)
    spec = DTensorSpec(mesh, placements, tuple(int(s) for s in shape), dtype)
    check_partial_dtype("abstract_tensor", spec.placements, spec.dtype)
    out = AbstractDTensor._new(spec, None if memory else _NO_BLOCK)
    return out.requires_grad_() if requires_grad else out


def abstract_like(
    value: object,
    mesh: AbstractMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    requires_grad: bool | None = None,
) -> AbstractDTensor:
    """A metadata-only DTensor of ``value``'s global shape and dtype. **Local**.

    Parameters
    ----------
    value : DTensor, Tensor, ndarray or array_like
        What to take the shape and dtype from (a DTensor's global shape); its values are
        not read.
    mesh : AbstractMesh, optional
        Default: a DTensor ``value``'s mesh if it is abstract, else the abstract mesh of its
        shape (:meth:`AbstractMesh.from_mesh`).
    placements : sequence of Placement, optional
        Default: a DTensor ``value``'s placements, else Replicate everywhere.
    requires_grad : bool, optional
        Default: whether ``value`` requires grad.
    """
    if isinstance(value, DTensor):
        if mesh is None:
            m = value.device_mesh
            mesh = m if getattr(m, "_abstract", False) else AbstractMesh.from_mesh(m)
        if placements is None:
            placements = value.placements
    elif not isinstance(value, Tensor):
        value = np.asarray(value)
    if requires_grad is None:
        requires_grad = bool(getattr(value, "requires_grad", False))
    return abstract_tensor(tuple(value.shape), mesh, placements, dtype=value.dtype,
                           requires_grad=requires_grad)

