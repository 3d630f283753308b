"""The communicators of meshes: one per mesh dim, made by splitting a base communicator.

This module owns :func:`shared_mesh_comms` (what ``DeviceMesh`` uses: one communicator per
distinct group of world ranks, shared by every mesh that asks for it and kept until exit,
so identical meshes create no communicator; mesh creation starts with one all-gather in
which the ranks agree on the grid, on those cache decisions and on the settings that decide
which collectives run) and :func:`make_mesh_comms` (new communicators the caller owns).
Each mesh creation reads the debug settings from the environment again
(:func:`redistribute.comm.settings.configure_from_env`).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from placements.errors import ConfigError, MeshError

from ..hosts import note_hosts
from .hooks import HOOKS
from .persistent import make_channel
from .process import my_host, world_ranks
from .settings import configure_from_env
from .wrapper import Comm

__all__ = ["make_mesh_comms", "shared_mesh_comms"]

# The communicators of mesh dims, shared by every mesh whose dim groups the same world ranks
# in the same order: (mesh dim, its size, the dim's groups of world ranks in order of their
# first rank) -> this rank's Comm of that dim. Every rank of a group makes an entry in the
# same collective call, and no entry is dropped, so identical meshes split no communicator.
_shared_comms: dict[tuple[int, int, bytes], Comm] = {}
# The grids that got shared communicators, by (world ranks of the base communicator, grid
# shape, grid ranks), with what they derive locally (see _layout). Mesh creation looks them
# up instead of deriving them again.
_layouts: dict[tuple[bytes, tuple[int, ...], bytes], tuple] = {}
# A setting that could not be read on a rank (shown as "unreadable" when ranks differ)
_UNREADABLE = -(1 << 63)


def _as_grid(rank_grid: np.ndarray, what: str) -> np.ndarray:
    grid = np.asarray(rank_grid)
    if grid.dtype.kind not in "iu" or grid.ndim == 0:
        raise MeshError(
            f"{what}: rank_grid must be an integer array with at least one dim, "
            f"got dtype {grid.dtype} and shape {grid.shape}"
        )
    return np.ascontiguousarray(grid, dtype=np.int64)


def _grid_problem(base: Comm, grid: np.ndarray, full: bool) -> str | None:
    """Why ``grid`` is no mesh of ``base`` ranks (every rank of ``base`` when ``full``)."""
    flat = grid.ravel()
    if (
        flat.size == 0
        or np.unique(flat).size != flat.size
        or flat.min() < 0
        or flat.max() >= base.size
    ):
        return (
            f"rank_grid {grid.tolist()} must hold distinct ranks of a communicator of size "
            f"{base.size}"
        )
    if full and flat.size != base.size:
        return (
            f"rank_grid {grid.tolist()} must hold every rank of a communicator of size {base.size}"
        )
    return None


def _settings_text(name: str, column: np.ndarray, world: np.ndarray) -> str:
    """``NAME (world rank 0: a, world ranks [1, 2]: b)``: each value with its ranks."""
    groups: dict[int, list[int]] = {}
    for r, value in enumerate(column.tolist()):
        groups.setdefault(value, []).append(int(world[r]))
    parts = []
    for value, ranks in groups.items():
        who = f"world rank {ranks[0]}" if len(ranks) == 1 else f"world ranks {ranks}"
        parts.append(f"{who}: {'unreadable' if value == _UNREADABLE else value}")
    return f"{name} ({', '.join(parts)})"


def _digest(grid: np.ndarray) -> int:
    return zlib.crc32(np.asarray(grid.shape, dtype=np.int64).tobytes() + grid.tobytes())


def _agree_mesh(
    base: Comm,
    grid: np.ndarray,
    digest: int,
    hits: int,
    settings: Sequence[tuple[str, int | None]],
    what: str,
) -> int:
    """The agreement that starts every mesh creation. **Collective** over ``base``.

    One all-gather of this rank's grid ``digest`` (:func:`_digest`), the mask of the
    requested dims whose shared communicator it holds (``hits``, at most 64 dims), its
    values of ``settings`` (the SPMD check's first; None: unreadable on this rank) and its
    host (:func:`redistribute.hosts.note_hosts` records every rank's, for the link tiers). It is a
    plain MPI call, neither shown to observers nor checked, because the ranks' debug checks
    may still differ.

    Raises
    ------
    ConfigError
        On every rank when the ranks' settings differ (naming each and its values by rank).
    MeshError
        On every rank when the ranks passed different grids.

    Returns
    -------
    int
        The dims every rank holds (the AND of the masks).
    """
    named = [("DTENSOR_CHECK_SPMD", int(HOOKS.spmd)), *settings]
    values = [_UNREADABLE if v is None else int(v) for _, v in named]
    mine = [digest, hits & 0xFFFFFFFF, hits >> 32, *values, my_host()]
    table = np.empty((base.size, len(mine)), dtype=np.int64)
    base.mpi.Allgather([np.array(mine, dtype=np.int64), MPI.INT64_T], [table, MPI.INT64_T])
    note_hosts(world_ranks(base), table[:, -1].tolist())
    mine.pop()
    rows = [row[:-1] for row in table.tolist()]  # plain lists compare faster than arrays
    if all(row == mine for row in rows):
        return hits
    differ = [j for j in range(len(values)) if any(row[3 + j] != values[j] for row in rows)]
    if differ:
        world = world_ranks(base)
        texts = [_settings_text(named[j][0], table[:, 3 + j], world) for j in differ]
        raise ConfigError(
            f"{what}: the ranks differ in settings that decide which collectives run: "
            + "; ".join(texts)
            + ". Every rank must use the same value (an environment variable, or the call "
            "that overrides it in this process, such as set_check_spmd)."
        )
    if any(row[0] != digest for row in rows):
        raise MeshError(
            f"{what}: ranks passed different rank grids (this rank: shape "
            f"{grid.shape}, ranks {grid.ravel().tolist()})"
        )
    for row in rows:
        hits &= row[1] | row[2] << 32
    return hits


def _split(base: Comm, grid: np.ndarray, coord: tuple[int, ...] | None, m: int, what: str):
    """This rank's communicator of mesh dim ``m`` (None outside the grid). **Collective**."""
    if coord is None:
        color, key = MPI.UNDEFINED, 0
    else:
        rest = coord[:m] + coord[m + 1 :]
        rest_shape = grid.shape[:m] + grid.shape[m + 1 :]
        color = int(np.ravel_multi_index(rest, rest_shape)) if rest else 0
        key = coord[m]
    try:
        new = base.mpi.Split(color, key)
    except MPI.Exception as e:
        cause = str(e).strip().splitlines()[-1]
        raise MeshError(
            f"{what}: MPI could not create another communicator for mesh dim {m} of a mesh "
            f"of shape {grid.shape} ({cause}); this process holds {len(_shared_comms)} mesh "
            f"communicators for {len(_layouts)} distinct meshes (identical meshes "
            "share theirs; communicators that the program creates itself count against the "
            "same MPI limit)"
        ) from None
    return None if coord is None else Comm(new, mesh_dim=m)


def _coordinate(grid: np.ndarray, rank: int) -> tuple[int, ...] | None:
    hits = np.flatnonzero(grid.ravel() == rank)
    return tuple(int(c) for c in np.unravel_index(hits[0], grid.shape)) if hits.size else None


def make_mesh_comms(
    base: Comm, rank_grid: np.ndarray
) -> tuple[tuple[int, ...] | None, tuple[Comm, ...]]:
    """Split ``base`` into new communicators, one per mesh dim. **Collective** over ``base``.

    The caller owns (and frees) them; meshes use :func:`shared_mesh_comms` instead.

    Parameters
    ----------
    base : Comm
        The communicator whose ranks ``rank_grid`` holds.
    rank_grid : ndarray of int
        The mesh: ``rank_grid[coord]`` is the ``base`` rank at mesh coordinate ``coord``.
        Every rank must pass the same grid (checked); ranks of ``base`` missing from it take
        part in the splits but belong to no mesh.

    Returns
    -------
    (coord, comms)
        This rank's mesh coordinate and, for each mesh dim ``m``, a :class:`Comm` over the
        ranks that share every coordinate except the one along ``m``, ordered by that
        coordinate (so the comm rank is ``coord[m]``). Ranks outside the mesh get
        ``(None, ())``. Nothing is cached here.

    Raises
    ------
    MeshError
        On every rank for a bad or differing grid, or when MPI has no communicator left.
    ConfigError
        On every rank when the ranks differ in ``DTENSOR_CHECK_SPMD``.
    """
    what = "make_mesh_comms"
    configure_from_env()
    grid = _as_grid(rank_grid, what)
    _agree_mesh(base, grid, _digest(grid), 0, (), what)
    problem = _grid_problem(base, grid, full=False)
    if problem is not None:
        raise MeshError(f"{what}: {problem}")
    coord = _coordinate(grid, base.rank)
    comms = [_split(base, grid, coord, m, what) for m in range(grid.ndim)]
    return coord, tuple(c for c in comms if c is not None)


def shared_mesh_comms(
    base: Comm,
    rank_grid: np.ndarray,
    dims: Sequence[int] | None = None,
    settings: Sequence[tuple[str, int | None]] = (),
    what: str = "DeviceMesh",
) -> tuple[tuple[int, ...], tuple[Comm, ...]]:
    """The communicators of mesh dims, shared between meshes. **Collective** over ``base``.

    Like :func:`make_mesh_comms` for a grid that holds every rank of ``base``, but a mesh
    dim that groups the same world ranks in the same order as one asked for before (by
    any mesh, over any communicator) gets the same :class:`Comm`, so creating identical
    meshes again and again creates no communicator. The communicators live until exit:
    never free them.

    Every rank decides from its own cache, and the ranks agree on the decision in the
    all-gather that also compares their grids and ``settings``: a dim that some rank does
    not hold is split anew on every rank.

    Parameters
    ----------
    base : Comm
        The communicator whose ranks ``rank_grid`` holds.
    rank_grid : ndarray of int
        The mesh of ``base`` ranks, each exactly once; the same on every rank (checked).
    dims : sequence of int, optional
        The mesh dims to return communicators for (default: all, in order).
    settings : sequence of (name, int or None)
        Settings that must be equal on every rank (None: unreadable on this rank), checked
        together with ``DTENSOR_CHECK_SPMD``.
    what : str
        The caller, for error messages.

    Returns
    -------
    (coord, comms)
        This rank's mesh coordinate and one :class:`Comm` per dim of ``dims``.

    Raises
    ------
    ConfigError
        On every rank when the ranks' settings differ.
    MeshError
        On every rank for a bad or differing grid, or when MPI has no communicator left.
    """
    configure_from_env()
    grid = _as_grid(rank_grid, what)
    dims = tuple(range(grid.ndim)) if dims is None else tuple(int(d) for d in dims)
    name = (world_ranks(base).tobytes(), grid.shape, grid.tobytes())
    layout = _layouts.get(name)
    problem = None
    if layout is None:
        problem = _grid_problem(base, grid, full=True)
        if problem is None:
            layout = _layout(base, grid)
    hits = 0
    if layout is not None:
        for i, m in enumerate(dims):
            hits |= (layout[1][m] in _shared_comms) << i
    digest = _digest(grid) if layout is None else layout[2]
    held = _agree_mesh(base, grid, digest, hits, settings, what)
    if problem is not None:  # the grids agree: so do the problems
        raise MeshError(f"{what}: {problem}")
    coord, keys, _ = layout
    comms = []
    for i, m in enumerate(dims):
        if not held >> i & 1:
            _shared_comms[keys[m]] = _split(base, grid, coord, m, what)
        comms.append(_shared_comms[keys[m]])
    _layouts[name] = layout
    if base.size == MPI.COMM_WORLD.Get_size():
        make_channel()  # every rank is here: set_persistent's calls can meet from now on
    return coord, tuple(comms)


def _layout(base: Comm, grid: np.ndarray) -> tuple:
    """(this rank's coordinate, each dim's key in ``_shared_comms``, the grid's digest) for
    a grid of every rank of ``base``. A key is (dim, its size, the dim's groups of world
    ranks in order of their first rank). **Local**."""
    world = world_ranks(base)[grid]
    keys = []
    for m in range(grid.ndim):
        groups = np.moveaxis(world, m, -1).reshape(-1, world.shape[m])
        keys.append((m, world.shape[m], groups[np.argsort(groups[:, 0])].tobytes()))
    return _coordinate(grid, base.rank), tuple(keys), _digest(grid)
