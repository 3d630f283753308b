"""One HDF5 dataset read or written in parallel through h5py: :func:`from_h5` and
:func:`to_h5`.

h5py is optional (the ``hdf5`` extra) and its wheels are built without MPI, so the ranks
never write one file at the same time: a read opens the file read-only on every rank and
reads this rank's hyperslab straight into its shard; a write fills a temporary copy of
the file beside the target, the writing ranks taking turns (one open, one hyperslab write,
one close each), and renames it into place once complete. The turns were measured against
rank 0 writing the gathered tensor (``full_tensor``): at 2 ranks, 64 MiB and 512 MiB of
float32 took 0.22 s and 0.88 s in turns, 0.29 s and 1.63 s gathered (each with its fsync),
and the turns need no memory beyond the shards.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from typing import Any

import numpy as np

from placements import Placement
from placements.errors import (
    CheckpointError,
    DTypeError,
    MeshError,
    ShardingError,
    UnavailableError,
)
from placements.layout import normalize_placements, partial_fill
from redistribute.comm import world

from ..distributed.dtensor import DTensor
from ..distributed.mesh import DeviceMesh
from ..local.factory import from_numpy
from . import _state
from ._common import (
    bcast_json,
    box,
    create_temp,
    fsync_path,
    native,
    reduce_partial,
    remove_quietly,
    run_agreed,
    settle_mode,
    writer_coords,
)

__all__ = ["from_h5", "to_h5"]

#: numpy dtype kinds of the datasets a DTensor can hold: bool, ints, floats, complex.
_KINDS = "biufc"


def _h5py(op: str) -> Any:
    """The h5py module, or an UnavailableError naming ``op``."""
    # h5py is an optional dependency with a slow import: imported on first use, so that
    # ``import dtensor`` neither needs nor pays for it
    try:
        import h5py
    except ImportError as e:
        raise UnavailableError(
            f"{op}: HDF5 files need h5py, which is not installed (pip install h5py, or "
            "dtensor's hdf5 extra)"
        ) from e
    return h5py


def _selection(offsets: Sequence[int], lengths: Sequence[int]) -> tuple:
    """The hyperslab of a block (``()`` of a 0-d dataset)."""
    return tuple(slice(o, o + n) for o, n in zip(offsets, lengths))


def _open(h5py: Any, path: str, mode: str, op: str) -> Any:
    try:
        return h5py.File(path, mode)
    except OSError as e:
        raise CheckpointError(
            f"{op}: cannot open {path!r} as an HDF5 file ({'read' if mode == 'r' else 'write'}):"
            f" {e}"
        ) from None


def _dataset(f: Any, h5py: Any, path: str, name: str, op: str) -> Any:
    """The dataset ``name`` of the open file ``f``, or a CheckpointError naming the file."""
    node = f.get(name)
    if node is None:
        raise CheckpointError(
            f"{op}: {path!r} has no dataset {name!r} (its top level holds {sorted(f)[:20]})"
        )
    if not isinstance(node, h5py.Dataset):
        raise CheckpointError(f"{op}: {name!r} in {path!r} is a {type(node).__name__}, not a "
                              "dataset")
    return node


def _outside_storage(ds: Any) -> str | None:
    """What other files the dataset ``ds`` keeps its data in, in words, or None: HDF5
    *external raw storage* (the bytes live in files the dataset names, at any path) and
    *virtual datasets* (mapped from datasets of other files)."""
    external = ds.external
    if external:
        files = sorted({os.fsdecode(entry[0]) for entry in external})
        return f"external raw storage in {files[:5]}"
    if getattr(ds, "is_virtual", False):
        files = sorted({os.fsdecode(src.file_name) for src in ds.virtual_sources()})
        return f"a virtual dataset mapped from {files[:5]}"
    return None


def _check_dtype(dtype: np.dtype, what: str, op: str) -> None:
    if dtype.kind not in _KINDS or dtype.fields is not None:
        raise DTypeError(
            f"{op}: {what} has dtype {dtype}; dtensor reads and writes bool, integer, float "
            "and complex datasets"
        )


def from_h5(
    path: str | os.PathLike,
    dataset: str,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    *,
    allow_external: bool = False,
) -> DTensor:
    """A DTensor of the HDF5 dataset ``dataset`` of file ``path``, placed on ``mesh``.

    **Collective** over COMM_WORLD: every rank opens the file read-only and reads its own
    hyperslab into its shard (h5py's ``read_direct``); nothing else of the dataset is read
    (of a chunked dataset: the chunks that hold the hyperslab).
    Datasets of another byte order come back native. A dataset whose data lives in other
    files (HDF5 external raw storage, which may name any path on the machine, or a virtual
    dataset) is refused unless ``allow_external=True``: a file from elsewhere could
    otherwise make every rank read files it never named. A Partial placement puts the value on
    the holding coordinates and the reduction's identity elsewhere, as
    ``distribute_tensor``. Needs h5py.

    Parameters
    ----------
    path : str or os.PathLike
        An HDF5 file readable by every rank.
    dataset : str
        The dataset's path in the file (``"x"``, ``"model/w"``).
    mesh : DeviceMesh
        The target mesh.
    placements : sequence of Placement
        One placement per mesh dim.
    allow_external : bool, default False
        Read a dataset stored in other files (external raw storage, virtual datasets).

    Raises
    ------
    CheckpointError
        A missing or unreadable file, a file that is not HDF5, no dataset ``dataset``, or
        a dataset stored in other files without ``allow_external=True``.
    DTypeError
        A dataset of another dtype than bool, integers, floats and complex.
    PlacementError
        Placements that do not fit the dataset's shape and the mesh.
    UnavailableError
        h5py is not installed.
    """
    comm = world()
    path = os.path.abspath(os.fspath(path))

    def plan() -> tuple:
        h5py = _h5py("from_h5")
        with _open(h5py, path, "r", "from_h5") as f:
            ds = _dataset(f, h5py, path, dataset, "from_h5")
            shape, dtype = tuple(int(s) for s in ds.shape), np.dtype(ds.dtype)
            outside = None if allow_external else _outside_storage(ds)
        if outside is not None:
            raise CheckpointError(
                f"from_h5: dataset {dataset!r} of {path!r} keeps its data in other files "
                f"({outside}); refusing to follow them (pass allow_external=True to read it)"
            )
        _check_dtype(dtype, f"dataset {dataset!r} of {path!r}", "from_h5")
        return h5py, shape, dtype, normalize_placements(placements, shape, mesh.shape)

    h5py, shape, dtype, placements = run_agreed(comm, "from_h5", plan)
    coord = mesh.get_coordinate()
    offsets, lengths = box(shape, mesh.shape, placements, coord)
    arr = np.empty(lengths, native(dtype))
    fill = partial_fill(placements, coord)

    def read() -> None:
        if fill is not None or arr.size == 0:  # holds the identity, or nothing
            return
        with _open(h5py, path, "r", "from_h5") as f:
            ds = _dataset(f, h5py, path, dataset, "from_h5")
            ds.read_direct(arr, _selection(offsets, lengths) if shape else None)

    run_agreed(comm, "from_h5", read)
    if fill is not None:
        arr[...] = fill
    return DTensor.from_local(from_numpy(arr), mesh, placements, shape=shape)


def _copy_into(path: str, fd: int) -> None:
    """Copy the file ``path`` into the empty file open as ``fd`` (in the kernel where it
    can: ``sendfile``)."""
    with open(path, "rb") as src:
        size, sent = os.fstat(src.fileno()).st_size, 0
        try:
            while sent < size:
                n = os.sendfile(fd, src.fileno(), sent, size - sent)
                if n == 0:
                    break
                sent += n
        except (AttributeError, OSError):  # no sendfile between these files: a plain copy
            src.seek(sent)
            os.lseek(fd, sent, os.SEEK_SET)
            with os.fdopen(os.dup(fd), "wb") as out:
                shutil.copyfileobj(src, out, 1 << 22)


def _start(h5py: Any, path: str, dataset: str, shape: tuple, dtype: np.dtype) -> tuple:
    """Rank 0: a new temporary file beside ``path`` (:func:`create_temp`: a random name),
    a copy of ``path`` where it exists, with ``dataset`` of ``shape`` and ``dtype``
    (created, or checked where it exists); its name and the mode to give it once
    complete (``path``'s)."""
    exists = os.path.lexists(path)
    if exists and not h5py.is_hdf5(path):
        raise CheckpointError(f"to_h5: {path!r} exists and is not an HDF5 file; refusing to "
                              "replace it")
    fd, tmp, mode = create_temp(path)
    try:
        try:
            if exists:
                _copy_into(path, fd)
        finally:
            os.close(fd)
        with _open(h5py, tmp, "a" if exists else "w", "to_h5") as f:
            if dataset not in f:
                f.create_dataset(dataset, shape=shape, dtype=dtype)
                return tmp, mode
            ds = _dataset(f, h5py, path, dataset, "to_h5")
            outside = _outside_storage(ds)
            if outside is not None:
                raise CheckpointError(
                    f"to_h5: dataset {dataset!r} of {path!r} keeps its data in other files "
                    f"({outside}); refusing to write through it into them"
                )
            if tuple(ds.shape) != shape:
                raise ShardingError(
                    f"to_h5: dataset {dataset!r} of {path!r} has shape {tuple(ds.shape)}; "
                    f"cannot write a tensor of shape {shape} into it"
                )
            if np.dtype(ds.dtype) != dtype:
                raise DTypeError(
                    f"to_h5: dataset {dataset!r} of {path!r} has dtype {np.dtype(ds.dtype)}; "
                    f"cannot write a tensor of dtype {dtype} into it"
                )
    except BaseException:
        remove_quietly(tmp)
        raise
    return tmp, mode


def _write_block(h5py: Any, tmp: str, dataset: str, offsets, lengths, data: np.ndarray) -> None:
    with _open(h5py, tmp, "r+", "to_h5") as f:
        f[dataset].write_direct(data, None, _selection(offsets, lengths) if data.ndim else None)


def _commit(tmp: str, path: str, mode: int | None) -> None:
    """Rank 0: give the complete temporary file its mode, sync it and rename it into
    place."""
    settle_mode(tmp, mode)
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(os.path.dirname(path), directory=True)


def to_h5(x: object, path: str | os.PathLike, dataset: str) -> None:
    """Write ``x`` as the HDF5 dataset ``dataset`` of file ``path``.

    **Collective** over COMM_WORLD. Each distinct block of a DTensor is written once, by
    its holder (Partial mesh dims are reduced first); a local tensor or numpy array is
    written by rank 0. The writes go to a temporary copy of the file beside ``path`` (its
    other datasets kept), the writing ranks taking turns (h5py without MPI: see the module
    documentation), and the copy is synced and renamed into place once complete: a failed
    or killed write leaves ``path`` as it was (a failed one removes the copy). The copy has
    a name of its own (``.<name>.dtensor-tmp-`` and random letters, created exclusively,
    never through a link) and the mode of ``path``, which the new file keeps (as with
    ``np.save``); a symbolic link at ``path`` is replaced by the file. The dataset is
    created (contiguous, not compressed) or, where it exists, overwritten. Needs h5py.

    Parameters
    ----------
    x : DTensor, Tensor or ndarray
        What to write (a DTensor on a mesh of all ranks).
    path : str or os.PathLike
        The file (created, or a copy of it replaced).
    dataset : str
        The dataset's path in the file (``"x"``, ``"model/w"``: groups are created).

    Raises
    ------
    DTypeError
        ``x`` is not a tensor or has another dtype than bool, integers, floats and complex;
        or the existing dataset has another dtype.
    ShardingError
        The existing dataset has another shape.
    MeshError
        A DTensor on a mesh of fewer than all ranks.
    CheckpointError
        ``path`` exists and is not an HDF5 file, its dataset ``dataset`` keeps its data in
        other files (external raw storage, virtual), or a file cannot be written.
    UnavailableError
        h5py is not installed.
    """
    comm = world()
    path = os.path.abspath(os.fspath(path))
    kind = _state.kind_of(x)

    made: list = []  # rank 0: the temporary file (to remove where the write fails), its mode

    def start() -> Any:
        h5py = _h5py("to_h5")
        if kind is None:
            raise DTypeError(
                f"to_h5: expected a DTensor, Tensor or numpy array, got {type(x).__name__}"
            )
        _check_dtype(np.dtype(x.dtype), f"the tensor for {dataset!r} of {path!r}", "to_h5")
        if kind == "dtensor" and x.device_mesh.size() != comm.size:
            raise MeshError(
                f"to_h5: a DTensor on a mesh of shape {x.device_mesh.shape} cannot be written "
                f"to {path!r}; it needs a mesh of all {comm.size} ranks"
            )
        if comm.rank == 0:
            made.extend(_start(h5py, path, dataset, tuple(int(s) for s in x.shape),
                               np.dtype(x.dtype)))
        return h5py

    try:
        h5py = run_agreed(comm, "to_h5", start)
        tmp = bcast_json(comm, made[0] if made else None)
        shape = tuple(int(s) for s in x.shape)
        if kind == "dtensor":
            x = reduce_partial(x)
            mesh = x.device_mesh
            writers = [int(mesh._world[c]) for c in writer_coords(mesh.shape, x.placements)
                       if int(np.prod(box(shape, mesh.shape, x.placements, c)[1])) > 0]
            offsets, lengths = box(shape, mesh.shape, x.placements, mesh.get_coordinate())
            data = x.to_local().numpy(force=True)
        else:
            writers = [0] if int(np.prod(shape)) > 0 else []
            offsets, lengths = (0,) * len(shape), shape
            data = x.numpy(force=True) if kind == "tensor" else np.asarray(x)
        data = np.ascontiguousarray(data)
        writes = comm.rank in writers

        def turn(rank: int) -> None:
            if comm.rank == rank and writes:
                _write_block(h5py, tmp, dataset, offsets, lengths, data)
            if comm.rank == rank == 0:  # the last turn: every block is written
                _commit(tmp, path, made[1])

        for rank in [w for w in writers if w != 0] + [0]:
            run_agreed(comm, "to_h5", lambda r=rank: turn(r))
    except BaseException:
        if made:  # every rank has closed the file (each turn's errors are agreed)
            remove_quietly(made[0])
        raise
