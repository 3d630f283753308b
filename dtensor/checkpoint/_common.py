"""What the checkpoint, ``.npy`` and HDF5 code share: agreeing on errors across ranks, the
writer ranks of a DTensor's distinct blocks, Partial reduction before a write, native dtypes,
dtype names in metadata (bfloat16 by name), durable renames (fsync of files and folders),
temporary files beside a target (random names, created exclusively, never through a link,
with the mode of the file they replace) and broadcasting their names.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from typing import TypeVar

import numpy as np

import placements.errors as _errors
from placements import Replicate
from placements.errors import CheckpointError, DTensorError
from placements.layout import local_offsets, local_shape
from placements.meta import bfloat16, is_bfloat16
from redistribute.comm import Comm

from ..distributed.dtensor import DTensor

T = TypeVar("T")

#: Errors a rank may meet alone (a file it alone reads, a check of its own data): the
#: ranks agree on them before the next collective, so that every rank raises instead of
#: leaving the others waiting in it. Any exception: a bug met by one rank must not hang.
LOCAL_ERRORS = (Exception,)


def agree(comm: Comm, error: BaseException | None, op: str) -> None:
    """Raise on every rank when ``error`` is set on any rank. **Collective** over ``comm``.

    The lowest failing rank's error (an error of another type than dtensor's becomes a
    CheckpointError naming ``op``) is sent to the others: each rank raises its type and
    message, followed by the failing rank where it is another one.
    """
    if error is not None and not isinstance(error, DTensorError):
        wrapped = CheckpointError(f"{op}: {type(error).__name__}: {error}")
        wrapped.__cause__ = error
        error = wrapped
    flag = np.array([comm.size if error is None else comm.rank], np.int64)
    comm.allreduce(flag, op="min", what=(op, "error agreement"))
    first = int(flag[0])
    if first == comm.size:
        return
    if comm.rank == first:
        # the nearest type of the catalogue (other ranks know those by name)
        kind = next(c for c in type(error).__mro__ if getattr(_errors, c.__name__, None) is c)
        text = f"{kind.__name__}\n{error}".encode()
        size = np.array([len(text)], np.int64)
    else:
        size = np.zeros(1, np.int64)
    comm.bcast_array(size, root=first, what=(op, "error size"))
    buf = np.frombuffer(text, np.uint8).copy() if comm.rank == first else np.empty(
        int(size[0]), np.uint8
    )
    comm.bcast_array(buf, root=first, what=(op, "error text"))
    if comm.rank == first:
        raise error
    name, _, message = buf.tobytes().decode().partition("\n")
    raise getattr(_errors, name)(f"{message} (raised on rank {first})")


def run_agreed(comm: Comm, op: str, fn: Callable[[], T]) -> T:
    """``fn()`` on this rank, its errors agreed on by every rank (:func:`agree`).
    **Collective** over ``comm``."""
    out, error = None, None
    try:
        out = fn()
    except LOCAL_ERRORS as e:
        error = e
    agree(comm, error, op)
    return out


def reduce_partial(x: DTensor) -> DTensor:
    """``x`` with each Partial mesh dim reduced to Replicate (Shard dims kept).
    **Collective** over ``x``'s mesh when a placement is Partial, else **Local**."""
    if not any(p.is_partial() for p in x.placements):
        return x
    return x.redistribute(x.device_mesh, [Replicate() if p.is_partial() else p
                                          for p in x.placements])


def writer_coords(mesh_shape: tuple[int, ...], placements: tuple) -> Iterator[tuple[int, ...]]:
    """The mesh coordinates that hold the distinct blocks of a tensor placed without
    Partial: coordinate 0 on every mesh dim that does not shard. **Local**."""
    for coord in np.ndindex(*mesh_shape):
        if all(c == 0 or p.is_shard() for c, p in zip(coord, placements)):
            yield tuple(int(c) for c in coord)


def box(shape, mesh_shape, placements, coord) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, lengths) of the block ``coord`` holds (:mod:`placements.layout`). **Local**."""
    return (
        local_offsets(shape, mesh_shape, placements, coord),
        local_shape(shape, mesh_shape, placements, coord),
    )


def native(dtype: np.dtype) -> np.dtype:
    """``dtype`` in this machine's byte order, as numpy's builtin type of its kind (the one
    MPI reductions know: ``newbyteorder("=")`` gives an equal but not builtin type). **Local**."""
    return np.dtype(dtype.char)


def dtype_name(dtype: np.dtype) -> str:
    """How a checkpoint's metadata names ``dtype``: numpy's ``str`` (``"<f4"``), and
    ``"bfloat16"`` for ml_dtypes' bfloat16 (whose ``str``, ``"<V2"``, says only "2 bytes").
    **Local**."""
    return "bfloat16" if is_bfloat16(dtype) else dtype.str


def dtype_from_name(name: str) -> np.dtype:
    """The dtype :func:`dtype_name` wrote as ``name``. **Local**."""
    return bfloat16() if name == "bfloat16" else np.dtype(name)


def sibling(path: str, tag: str) -> str:
    """``<parent>/.<name>.dtensor-<tag>``: a file or folder that belongs to checkpoint or
    file ``path``: its previous version (``old``), its lock (``lock``), a temporary one
    (``tmp-<token>``). **Local**."""
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}.dtensor-{tag}")


def token() -> str:
    """A fresh random name part (16 hex digits) of a temporary file or folder. **Local**."""
    return secrets.token_hex(8)


def mode_of(path: str) -> int | None:
    """The permission bits of the file or folder ``path`` (of a link's target), None where
    it does not exist: what a file that replaces it keeps, as ``np.save`` keeps a file's
    mode. **Local**."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return None


def create_temp(path: str) -> tuple[int, str, int | None]:
    """A new, empty temporary file ``.<name>.dtensor-tmp-<random>`` beside ``path``, opened
    for writing: ``(descriptor, name, mode)``. **Local**.

    Created exclusively (``O_EXCL | O_NOFOLLOW``: never a file or link that was there), with
    the default mode (``0o666`` less the umask) where ``path`` does not exist, else with
    ``path``'s mode (``mode``, None where there is none), readable and writable by its
    owner while it is written: the caller gives it ``mode`` itself (:func:`settle_mode`)
    once it is complete.
    """
    name = sibling(path, f"tmp-{token()}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(name, flags, 0o666)
    try:
        mode = mode_of(path)
        if mode is not None:
            os.fchmod(fd, mode | stat.S_IRUSR | stat.S_IWUSR)
    except BaseException:
        os.close(fd)
        os.unlink(name)
        raise
    return fd, name, mode


def settle_mode(name: str, mode: int | None) -> None:
    """Give the complete temporary file ``name`` the ``mode`` :func:`create_temp` kept
    (nothing where None). **Local**."""
    if mode is not None:
        os.chmod(name, mode)


def remove_quietly(path: str | None) -> None:
    """Remove the file ``path`` where it exists (cleanup after a failure: errors ignored).
    **Local**."""
    if path is None:
        return
    try:
        os.unlink(path)
    except OSError:
        pass


def bcast_json(comm: Comm, value: object, root: int = 0) -> object:
    """``value`` of rank ``root`` (any JSON value: names of temporary files) on every
    rank. **Collective** over ``comm``."""
    text = json.dumps(value).encode() if comm.rank == root else b""
    size = comm.bcast_array(np.array([len(text)], np.int64), root=root, what="names")
    buf = np.frombuffer(text, np.uint8).copy() if comm.rank == root else np.empty(
        int(size[0]), np.uint8)
    comm.bcast_array(buf, root=root, what="names")
    return json.loads(buf.tobytes().decode())


def fsync_path(path: str, directory: bool = False) -> None:
    """fsync a file, or a folder (its entries: renames and new files). **Local**."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
