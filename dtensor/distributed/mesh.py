"""DeviceMesh: an N-D array of MPI ranks with optional dim names.

A mesh holds one communicator per mesh dim and caches sub-communicators for groups of dims
on first use. Those communicators come from :func:`redistribute.comm.shared_mesh_comms`:
every mesh whose dim groups the same world ranks in the same order shares one, so creating
identical meshes again and again creates no communicator. Creating a mesh is one
all-gather in which the ranks also agree on the settings that decide which collectives
its DTensors run (:func:`_path_settings`); ranks that differ raise ``ConfigError``.

A mesh is immutable and hashable, so it can be part of a
:class:`placements.spec.DTensorSpec` (the cache key of sharding decisions and redistribute
plans). Its identity is the device type, the dim names and the COMM_WORLD rank at each
mesh coordinate: meshes over communicators that order the ranks differently are unequal
(ops that mix them raise ``MeshError``), whatever ranks their own communicators number.

Ranks in ``mesh.mesh`` are ranks of the *root* communicator the mesh (or its parent) was
built on, as in PyTorch; a sub-mesh ``mesh["tp"]`` communicates over the cached
sub-communicator of that dim.
"""

from __future__ import annotations

import functools
import json
import os
import re
import zlib
from collections.abc import Sequence

import numpy as np

from placements.errors import ConfigError, MeshError, SignatureError
from redistribute import comm as _comm
from redistribute import hosts as _hosts
from redistribute import shm as _shm
from redistribute.cost import CostModel, default_cost_model

from ..local import allocator as _allocator
from . import device_comm as _devcomm
from . import gpu as _gpu

__all__ = ["DeviceMesh", "init_device_mesh"]


def _parse_mesh_env(value: str) -> tuple[int, ...]:
    """Parse ``DTENSOR_MESH`` ("2x2", "4", "2,2") into a shape tuple. **Local**."""
    parts = value.replace(",", "x").lower().split("x")
    try:
        shape = tuple(int(p) for p in parts if p.strip())
    except ValueError:
        raise MeshError(f"DTENSOR_MESH={value!r} is not a mesh shape like '2x2'") from None
    if not shape or any(s <= 0 for s in shape):
        raise MeshError(f"DTENSOR_MESH={value!r} is not a mesh shape like '2x2'")
    return shape


class DeviceMesh:
    """An N-D mesh of MPI ranks.

    **Collective** to construct: every rank of ``comm`` must build the same mesh in the same
    order. Construction is one all-gather over ``comm`` (the ranks agree on the grid and on
    the settings of :func:`_path_settings`, raising ``MeshError`` or ``ConfigError`` on
    every rank when they differ), plus one communicator split per mesh dim whose ranks no
    earlier mesh grouped the same way.

    Parameters
    ----------
    device_type : str
        ``"cpu"`` or ``"cuda"``: where the local tensors of DTensors on this mesh live.
    mesh : array_like of int
        The ranks of ``comm`` laid out as an N-D array (each rank exactly once).
    mesh_dim_names : sequence of str, optional
        One unique name per mesh dim, for ``mesh["tp"]``.
    comm : mpi4py communicator or :class:`redistribute.comm.Comm`, optional
        The communicator the mesh spans; default ``MPI.COMM_WORLD``.
    """

    __slots__ = (
        "_base",
        "_coord",
        "_dim_comms",
        "_grid",
        "_group_comms",
        "_hash",
        "_names",
        "_root_grid",
        "_root_rank",
        "_spans",
        "_world",
        "device_type",
    )

    def __init__(
        self,
        device_type: str = "cpu",
        mesh: object = None,
        *,
        mesh_dim_names: Sequence[str] | None = None,
        comm: object = None,
    ) -> None:
        if not re.fullmatch(r"cpu|cuda(:\d+)?", str(device_type)):
            raise MeshError(
                f"DeviceMesh: unknown device_type {device_type!r}; expected 'cpu', 'cuda' or "
                "'cuda:N'"
            )
        base = _as_comm(comm)
        grid = np.arange(base.size) if mesh is None else np.asarray(mesh)
        if grid.dtype.kind not in "iu":
            raise MeshError(f"DeviceMesh: mesh must hold integer ranks, got dtype {grid.dtype}")
        grid = grid.astype(np.int64)
        if grid.ndim == 0:
            raise MeshError("DeviceMesh: mesh must have at least one dimension")
        if grid.size != base.size or sorted(grid.ravel().tolist()) != list(range(base.size)):
            raise MeshError(
                f"DeviceMesh: mesh of shape {tuple(grid.shape)} with ranks "
                f"{grid.ravel().tolist()} does not match the communicator of size {base.size} "
                f"(each rank 0..{base.size - 1} must appear exactly once)"
            )
        coord, dim_comms = _shared_comms(base, grid)
        world = _comm.world_ranks(base)[grid]
        if str(device_type).startswith("cuda"):
            base, dim_comms = _cuda_comms(base, dim_comms)
        self._init(device_type, grid, grid, world, mesh_dim_names, base, coord, dim_comms)

    def _init(self, device_type, grid, root_grid, world, names, base, coord, dim_comms) -> None:
        """Set the fields: ``grid`` numbers the ranks of ``base``, ``root_grid`` those of
        the root communicator (``mesh.mesh``), ``world`` those of COMM_WORLD."""
        names = None if names is None else tuple(names)
        if names is not None:
            if len(names) != grid.ndim:
                raise MeshError(
                    f"DeviceMesh: {len(names)} mesh_dim_names {names} for a {grid.ndim}-D mesh "
                    f"of shape {tuple(grid.shape)}"
                )
            if len(set(names)) != len(names):
                raise MeshError(f"DeviceMesh: mesh_dim_names {names} are not unique")
        grid, root_grid, world = (a.copy() for a in (grid, root_grid, world))
        for a in (grid, root_grid, world):
            a.flags.writeable = False
        self.device_type = str(device_type)
        self._grid = grid
        self._root_grid = root_grid
        self._world = world
        self._names = names
        self._base = base
        self._coord = coord
        self._dim_comms = dim_comms
        self._group_comms: dict[tuple[int, ...], _comm.Comm] = {}
        self._root_rank = int(root_grid[coord])
        self._spans = _hosts.spans_hosts(world)
        self._hash = hash((self.device_type, world.shape, tuple(world.ravel().tolist()), names))

    @classmethod
    def _submesh(cls, parent: DeviceMesh, dims: tuple[int, ...], comm: _comm.Comm) -> DeviceMesh:
        """Sub-mesh of ``parent`` over ``dims`` that contains this rank. **Local**."""
        index = tuple(slice(None) if d in dims else c for d, c in enumerate(parent._coord))
        root_grid = parent._root_grid[index]
        coord = tuple(parent._coord[d] for d in dims)
        grid = np.arange(root_grid.size, dtype=np.int64).reshape(root_grid.shape)
        if len(dims) == 1:
            dim_comms = (comm,)
        else:
            dim_comms = tuple(parent._dim_comms[d] for d in dims)
        names = None if parent._names is None else tuple(parent._names[d] for d in dims)
        self = cls.__new__(cls)
        world = parent._world[index]
        self._init(parent.device_type, grid, root_grid, world, names, comm, coord, dim_comms)
        return self

    # -- metadata (all Local) -------------------------------------------------------------
    @property
    def mesh(self) -> np.ndarray:
        """The ranks (of the root communicator) as a read-only N-D array. **Local**."""
        return self._root_grid

    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh shape. **Local**."""
        return self._grid.shape

    @property
    def ndim(self) -> int:
        """Number of mesh dims. **Local**."""
        return self._grid.ndim

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None:
        """The mesh dim names, or None. **Local**."""
        return self._names

    @property
    def dim_spans_hosts(self) -> tuple[bool, ...]:
        """Per mesh dim: whether its collectives cross hosts (some group of the dim holds
        ranks of more than one host; :mod:`redistribute.hosts`, ``DTENSOR_SIM_HOSTS``
        simulates hosts on one machine). The cost model prices such a dim with its
        ``inter_host`` link tier. **Local**."""
        return self._spans

    def size(self, mesh_dim: int | str | None = None) -> int:
        """Number of ranks in the mesh, or along one mesh dim. **Local**."""
        if mesh_dim is None:
            return int(self._grid.size)
        return self._grid.shape[self._dim_index(mesh_dim)]

    def get_coordinate(self) -> tuple[int, ...]:
        """This rank's coordinate in the mesh. **Local**."""
        return self._coord

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This rank's index along ``mesh_dim`` (required for meshes of more than 1 dim).

        **Local**.
        """
        if mesh_dim is None:
            if self.ndim != 1:
                raise MeshError(
                    f"get_local_rank: mesh_dim is required for a {self.ndim}-D mesh "
                    f"of shape {self.shape}"
                )
            mesh_dim = 0
        return self._coord[self._dim_index(mesh_dim)]

    def get_rank(self) -> int:
        """This rank in the root communicator (``mesh.mesh`` numbering). **Local**."""
        return self._root_rank

    def get_group(self, mesh_dim: int | str | None = None) -> _comm.Comm:
        """The communicator of one mesh dim (or the whole mesh when None). **Local**.

        ``.mpi`` of the result is the mpi4py communicator, for users who call MPI directly.
        A mesh dim's communicator is shared with every mesh whose dim groups the same ranks
        in the same order: never free it.
        """
        if mesh_dim is None:
            return self._base
        return self._dim_comms[self._dim_index(mesh_dim)]

    def get_all_groups(self) -> tuple[_comm.Comm, ...]:
        """One communicator per mesh dim, in mesh dim order. **Local**."""
        return self._dim_comms

    def _dim_index(self, mesh_dim: int | str) -> int:
        if isinstance(mesh_dim, str):
            if self._names is None or mesh_dim not in self._names:
                raise MeshError(
                    f"DeviceMesh: no mesh dim named {mesh_dim!r} (mesh_dim_names={self._names})"
                )
            return self._names.index(mesh_dim)
        nd = self.ndim
        if not isinstance(mesh_dim, (int, np.integer)) or not -nd <= mesh_dim < nd:
            raise MeshError(
                f"DeviceMesh: mesh dim {mesh_dim!r} is out of range for a {nd}-D mesh "
                f"of shape {self.shape}"
            )
        return int(mesh_dim) % nd

    # -- sub-meshes ------------------------------------------------------------------------
    def __getitem__(self, names: str | int | tuple) -> DeviceMesh:
        """Sub-mesh over one or several mesh dims (by name or index). **Local** on first use
        for a single dim; **Collective** over the mesh the first time a group of several dims
        is asked for (its communicator is created then, and cached)."""
        if not isinstance(names, tuple):
            names = (names,)
        dims = tuple(self._dim_index(n) for n in names)
        if len(set(dims)) != len(dims) or list(dims) != sorted(dims):
            raise MeshError(
                f"DeviceMesh: sub-mesh dims {names} must be distinct and in mesh order "
                f"(mesh_dim_names={self._names})"
            )
        if dims == tuple(range(self.ndim)):
            return self
        return DeviceMesh._submesh(self, dims, self._group_comm(dims))

    def _flatten(self, mesh_dim_name: str | None = None) -> DeviceMesh:
        """A 1-D mesh over all of this mesh's ranks, in row-major order of its grid (the
        dims merged into one, as PyTorch's ``mesh["dp", "tp"]._flatten()``).

        **Collective** over this mesh the first time its dims are merged (the communicator
        is created then; it comes from the shared cache of mesh communicators, so every
        mesh that groups the same ranks in the same order shares it); **Local** after that.
        A 1-D mesh returns itself (renamed when ``mesh_dim_name`` is given).

        Parameters
        ----------
        mesh_dim_name : str, optional
            The name of the flattened dim; default the dim names joined by ``"_"``
            (``"dp_tp"``), or no name when the mesh has none.
        """
        name = mesh_dim_name
        if name is None and self._names is not None:
            name = "_".join(self._names)
        if name is not None and not isinstance(name, str):
            raise MeshError(f"DeviceMesh._flatten: mesh_dim_name must be a str, got {name!r}")
        names = None if name is None else (name,)
        if self.ndim == 1 and names == self._names:
            return self
        comm = self._group_comm(tuple(range(self.ndim)))
        flat = DeviceMesh.__new__(DeviceMesh)
        coord = (int(np.ravel_multi_index(self._coord, self.shape)),)
        dim_comms = self._dim_comms if self.ndim == 1 else (comm,)
        # the grid numbers the ranks of the new base: the merged communicator's ranks are
        # the row-major positions in this grid
        grid = self._grid.reshape(-1) if self.ndim == 1 else np.arange(self._grid.size)
        flat._init(
            self.device_type,
            grid.astype(np.int64),
            self._root_grid.reshape(-1),
            self._world.reshape(-1),
            names,
            self._base if self.ndim == 1 else comm,
            coord,
            dim_comms,
        )
        return flat

    def _group_comm(self, dims: tuple[int, ...]) -> _comm.Comm:
        """Communicator over the ranks that share this rank's coordinates outside ``dims``.

        **Collective** over the whole mesh on first use for ``dims`` (then cached).
        """
        if len(dims) == 1:
            return self._dim_comms[dims[0]]
        cached = self._group_comms.get(dims)
        if cached is None:
            rest = tuple(d for d in range(self.ndim) if d not in dims)
            flat = self._grid.transpose(rest + dims).reshape(
                tuple(self.shape[d] for d in rest) + (-1,)
            )
            _, (cached,) = _shared_comms(self._base, flat, (flat.ndim - 1,))
            if self.device_type.startswith("cuda"):
                cached = _devcomm.device_comm(cached, _comm.cuda_aware())
            self._group_comms[dims] = cached
        return cached

    # -- identity --------------------------------------------------------------------------
    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, DeviceMesh):
            return NotImplemented
        return (
            self._hash == other._hash
            and self.device_type == other.device_type
            and self._names == other._names
            and np.array_equal(self._world, other._world)
        )

    def __repr__(self) -> str:
        """The root-communicator ranks, and the world ranks where they differ. **Local**."""
        names = "" if self._names is None else f", mesh_dim_names={self._names}"
        world = ""
        if not np.array_equal(self._world, self._root_grid):
            world = f", world_ranks={self._world.tolist()}"
        return f"DeviceMesh('{self.device_type}', {self._root_grid.tolist()}{names}{world})"


@functools.lru_cache(maxsize=8)
def _model_digest(model: CostModel) -> int:
    return zlib.crc32(json.dumps(model.to_dict(), sort_keys=True).encode())


def _path_settings() -> tuple[list[tuple[str, int | None]], list[ConfigError]]:
    """This process's settings that decide which collectives DTensors run. **Local**.

    Ranks that differ in them hang or exchange mismatched data: ``DTENSOR_SHM_MIN_BYTES``
    picks between a shared-memory exchange and an MPI collective; the cost model
    (``DTENSOR_COST_MODEL`` or ``set_default_cost_model``) picks the sharding strategy and
    so the redistributions; ``DTENSOR_SHM`` (the setting, not whether this process has
    turned shared segments off since) and ``DTENSOR_POOL_MIN_BYTES`` decide which buffers
    can be exchanged through shared memory; ``DTENSOR_PERSISTENT`` (or
    ``redistribute.comm.set_persistent``) between persistent and blocking all-gathers,
    which MPI never matches with each other. (``DTENSOR_CHECK_SPMD`` joins them in
    :func:`redistribute.comm.shared_mesh_comms`. ``DTENSOR_FASTPATH`` runs the same
    collectives on either path, and ``DTENSOR_GPU_COMM`` only how a rank stages its own
    buffers, so ranks may differ in those.)

    Returns
    -------
    (settings, errors)
        ``(name, value)`` pairs, the value None where reading it raised; and those errors.
    """
    errors: list[ConfigError] = []

    def read(fn) -> int | None:
        try:
            return int(fn())
        except ConfigError as e:
            errors.append(e)
            return None

    settings = [
        ("DTENSOR_SHM", read(_shm.requested)),
        ("DTENSOR_SHM_MIN_BYTES", _shm.MIN_BYTES),
        ("DTENSOR_POOL_MIN_BYTES", _allocator.POOL_MIN_BYTES),
        ("DTENSOR_COST_MODEL digest", read(lambda: _model_digest(default_cost_model()))),
        ("DTENSOR_PERSISTENT", read(_comm.persistent_enabled)),
    ]
    return settings, errors


def _shared_comms(base: _comm.Comm, grid: np.ndarray, dims: tuple[int, ...] | None = None):
    """:func:`redistribute.comm.shared_mesh_comms` with this process's settings.

    **Collective** over ``base``. A setting unreadable on every rank raises its error on
    every rank, after the agreement (a rank that raised before it would leave the others
    waiting there).
    """
    settings, errors = _path_settings()
    out = _comm.shared_mesh_comms(base, grid, dims, settings, "DeviceMesh")
    if errors:
        raise errors[0]
    return out


def _cuda_comms(base: _comm.Comm, dim_comms: tuple) -> tuple:
    """Bind this rank to its GPU and wrap the mesh's communicators for device buffers.

    **Collective** over ``base`` (the node-local rank comes from a shared-memory split).
    """
    _gpu.bind_device(_comm.local_rank(base))
    aware = _comm.cuda_aware()
    return _devcomm.device_comm(base, aware), tuple(_devcomm.device_comm(c, aware) for c in dim_comms)


def _as_comm(comm: object) -> _comm.Comm:
    if comm is None:
        return _comm.world()
    if isinstance(comm, _comm.Comm):
        return comm
    return _comm.Comm(comm)


def init_device_mesh(
    *args: object,
    mesh_dim_names: Sequence[str] | None = None,
    device: str = "cpu",
    comm: object = None,
    device_type: str | None = None,
    mesh_shape: Sequence[int] | int | None = None,
) -> DeviceMesh:
    """Create a mesh over all ranks of ``comm`` (default COMM_WORLD) in row-major order.

    **Collective**: every rank must call it with the same arguments.

    Call as ``init_device_mesh((2, 2), ("dp", "tp"))``, ``init_device_mesh((2, 2),
    mesh_dim_names=("dp", "tp"), device="cpu")`` or, PyTorch's order,
    ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))``.

    Parameters
    ----------
    mesh_shape : tuple of int, optional
        The mesh shape; its product must equal the communicator size. When omitted, the
        ``DTENSOR_MESH`` environment variable (``"2x2"``, set by ``python -m launch --mesh``)
        is used, else a 1-D mesh of all ranks.
    mesh_dim_names : sequence of str, optional
        Names of the mesh dims.
    device : str
        ``"cpu"`` or ``"cuda"`` (``device_type`` is an alias).
    comm : mpi4py communicator, optional
        The communicator to span; default COMM_WORLD.
    """
    args_list = list(args)
    if args_list and isinstance(args_list[0], str):
        device = args_list.pop(0)
    if args_list:
        mesh_shape = args_list.pop(0)
    if args_list:
        mesh_dim_names = args_list.pop(0)
    if args_list:
        raise SignatureError(f"init_device_mesh: unexpected positional arguments {args_list}")
    if device_type is not None:
        device = device_type
    base = _as_comm(comm)
    if mesh_shape is None:
        env = os.environ.get("DTENSOR_MESH")
        mesh_shape = _parse_mesh_env(env) if env else (base.size,)
    if isinstance(mesh_shape, (int, np.integer)):
        mesh_shape = (int(mesh_shape),)
    shape = tuple(int(s) for s in mesh_shape)
    if not shape or any(s <= 0 for s in shape) or int(np.prod(shape)) != base.size:
        raise MeshError(
            f"init_device_mesh: mesh shape {shape} needs {int(np.prod(shape)) if shape else 0} "
            f"ranks but the communicator has {base.size}"
        )
    grid = np.arange(base.size, dtype=np.int64).reshape(shape)
    return DeviceMesh(device, grid, mesh_dim_names=mesh_dim_names, comm=base)
