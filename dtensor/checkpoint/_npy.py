"""One standard ``.npy`` file read or written in parallel: :func:`from_npy` and
:func:`to_npy`, each rank moving its own block with collective MPI-IO (a subarray file
view per rank, ``MPI_File_read_all``/``write_all``)."""

from __future__ import annotations

import io
import os
from collections.abc import Sequence

import numpy as np

from placements import Placement
from placements.errors import CheckpointError, DTypeError, MeshError
from placements.layout import normalize_placements, partial_fill
from placements.meta import is_bfloat16
from redistribute.comm import world
from redistribute.fileio import File

from ..distributed.dtensor import DTensor
from ..distributed.mesh import DeviceMesh
from ..local.factory import from_numpy
from . import _state
from ._common import (
    LOCAL_ERRORS,
    agree,
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

__all__ = ["from_npy", "to_npy"]


def _header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The ``.npy`` header (magic, version, padded dict) of a C-ordered array."""
    d = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    out = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(out, d)
    except ValueError:  # a header of more than 64 KiB needs version 2.0
        out = io.BytesIO()
        np.lib.format.write_array_header_2_0(out, d)
    return out.getvalue()


def _read_header(path: str) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """(shape, fortran_order, dtype, data offset) of the ``.npy`` file ``path``."""
    try:
        with open(path, "rb") as fh:
            version = np.lib.format.read_magic(fh)
            read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                    else np.lib.format.read_array_header_2_0)
            shape, fortran, dtype = read(fh)
            offset = fh.tell()
    except OSError as e:
        raise CheckpointError(f"from_npy: cannot read {path!r}: {e.strerror or e}") from None
    except ValueError as e:
        raise CheckpointError(f"from_npy: {path!r} is not a .npy file: {e}") from None
    if dtype.hasobject:
        raise DTypeError(f"from_npy: {path!r} holds Python objects (dtype {dtype})")
    need = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    size = os.path.getsize(path)
    if size < need:
        raise CheckpointError(
            f"from_npy: {path!r} holds {size} bytes; its header (shape {shape}, dtype {dtype}) "
            f"needs {need}"
        )
    return tuple(shape), bool(fortran), dtype, offset


def from_npy(
    path: str | os.PathLike, mesh: DeviceMesh, placements: Sequence[Placement]
) -> DTensor:
    """A DTensor of the array in the ``.npy`` file ``path``, placed on ``mesh``.

    **Collective** over COMM_WORLD: every rank reads the (small) header, then its own block
    with one collective MPI-IO read. Fortran-ordered files and other byte orders are read
    too (the result is C-ordered and native). A Partial placement puts the value on the
    holding coordinates and the reduction's identity elsewhere, as ``distribute_tensor``.

    Parameters
    ----------
    path : str or os.PathLike
        A ``.npy`` file (format 1.0 or 2.0) readable by every rank.
    mesh : DeviceMesh
        The target mesh.
    placements : sequence of Placement
        One placement per mesh dim.

    Raises
    ------
    CheckpointError
        A missing, unreadable, truncated or malformed file.
    DTypeError
        A file of Python objects.
    PlacementError
        Placements that do not fit the array and the mesh.
    """
    comm = world()
    path = os.path.abspath(os.fspath(path))

    def plan() -> tuple:
        shape, fortran, dtype, disp = _read_header(path)
        return shape, fortran, dtype, disp, normalize_placements(placements, shape, mesh.shape)

    shape, fortran, dtype, disp, placements = run_agreed(comm, "from_npy", plan)
    coord = mesh.get_coordinate()
    offsets, lengths = box(shape, mesh.shape, placements, coord)
    if fortran:  # the file holds the transpose, C-ordered
        file_shape, offsets, lengths = shape[::-1], offsets[::-1], lengths[::-1]
    else:
        file_shape = shape
    buf = np.empty(lengths, dtype)
    fh = File(comm, path, "r", "from_npy")
    try:
        fh.read_block_all(disp, file_shape, offsets, lengths, buf)
    finally:
        fh.close()
    arr = np.ascontiguousarray(buf.T) if fortran else buf
    if not dtype.isnative:
        arr = arr.astype(native(dtype))
    fill = partial_fill(placements, coord)
    if fill is not None:
        arr[...] = fill
    return DTensor.from_local(from_numpy(arr), mesh, placements, shape=shape)


def to_npy(x: object, path: str | os.PathLike) -> None:
    """Write ``x`` as one standard ``.npy`` file that ``numpy.load`` reads.

    **Collective** over COMM_WORLD. Rank 0 writes the header; each distinct block of a
    DTensor is written once, by its holder, with one collective MPI-IO write (Partial mesh
    dims are reduced first). A local tensor or numpy array is written by rank 0. The file
    is written under a temporary name of its own beside ``path`` (``.<name>.dtensor-tmp-``
    and random letters, created exclusively, never through a link) and renamed into place
    once complete; a write that fails removes it and leaves ``path`` as it was. The file
    keeps the mode of the one it replaces, as with ``np.save``. A symbolic link at ``path``
    is replaced by the file (its target is left as it was).

    Parameters
    ----------
    x : DTensor, Tensor or ndarray
        What to write (a DTensor on a mesh of all ranks).
    path : str or os.PathLike
        The file (replaced if it exists).

    Raises
    ------
    DTypeError
        ``x`` is not a tensor, or holds Python objects.
    MeshError
        A DTensor on a mesh of fewer than all ranks.
    CheckpointError
        The file cannot be written.
    """
    comm = world()
    path = os.path.abspath(os.fspath(path))
    kind = _state.kind_of(x)

    def check() -> None:
        if kind is None:
            raise DTypeError(
                f"to_npy: expected a DTensor, Tensor or numpy array, got {type(x).__name__}"
            )
        if np.dtype(x.dtype).hasobject:
            raise DTypeError(f"to_npy: cannot write Python objects (dtype {x.dtype}) to {path!r}")
        if is_bfloat16(x.dtype):
            # Note: the .npy format has no bfloat16 (numpy would write it as 2 raw bytes,
            # "<V2", that np.load gives back as void): refused rather than written unreadable.
            raise DTypeError(
                f"to_npy: the .npy format has no bfloat16 type; write x.to(dt.float32) (exact) "
                f"to {path!r}, or keep bfloat16 in a checkpoint (dt.save)"
            )
        if kind == "dtensor" and x.device_mesh.size() != comm.size:
            raise MeshError(
                f"to_npy: a DTensor on a mesh of shape {x.device_mesh.shape} cannot be written "
                f"to {path!r}; it needs a mesh of all {comm.size} ranks"
            )

    run_agreed(comm, "to_npy", check)
    shape, dtype = tuple(int(s) for s in x.shape), np.dtype(x.dtype)
    if kind == "dtensor":
        x = reduce_partial(x)
        mesh, coord = x.device_mesh, x.device_mesh.get_coordinate()
        writes = coord in set(writer_coords(mesh.shape, x.placements))
        offsets, lengths = box(shape, mesh.shape, x.placements, coord)
        data = x.to_local().numpy(force=True)
    else:
        writes = comm.rank == 0
        offsets, lengths = (0,) * len(shape), shape
        data = x.numpy(force=True) if kind == "tensor" else np.asarray(x)
    if not writes:
        lengths = (0,) * len(shape)
        data = np.empty(0, dtype)
    data = np.ascontiguousarray(data)
    header = _header(dtype, shape)
    made: list = []  # rank 0: the temporary file (to remove where the write fails), its mode

    def start() -> None:
        if comm.rank == 0:
            fd, tmp, mode = create_temp(path)
            made.extend((tmp, mode))
            with os.fdopen(fd, "wb") as fh:
                fh.write(header)

    def commit() -> None:
        if comm.rank == 0:
            settle_mode(*made)
            os.replace(made[0], path)
            fsync_path(os.path.dirname(path), directory=True)

    try:
        run_agreed(comm, "to_npy", start)
        fh = File(comm, bcast_json(comm, made[0] if made else None), "w", "to_npy")
        error = None
        try:
            fh.write_block_all(len(header), shape, offsets, lengths, data)
            fh.sync()
        except LOCAL_ERRORS as e:
            error = e
        try:
            fh.close()
        except LOCAL_ERRORS as e:
            error = error or e
        agree(comm, error, "to_npy")
        run_agreed(comm, "to_npy", commit)
    except BaseException:
        if made:  # every rank has closed the file (errors are agreed after the close)
            remove_quietly(made[0])
        raise
