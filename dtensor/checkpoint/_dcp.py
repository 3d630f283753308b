"""Checkpoints: :func:`save` and :func:`load` of nested states of DTensors, local tensors,
numpy arrays and python values, resharding on load.

A checkpoint is a folder of two files:

- ``metadata.json`` (readable): the format name and version, the save's random
  ``save_id``, the world size and chunk size of the save, the state's structure (its python values included) and, per tensor, its
  key, kind, global shape, dtype, mesh shape and dim names, the placements it was saved
  with (and those it had: Partial mesh dims are reduced to Replicate before the write), and
  its saved blocks: global offsets and lengths, the data file, the byte offset, the size,
  and one checksum per ``chunk_bytes`` of the block (XXH3-64; a checkpoint names its
  algorithm in ``checksum``, and one saved with CRC-32 is still read);
- ``data-<rank>.bin``, one per rank that writes: the blocks, C-ordered, each written once
  by one rank (a DTensor's distinct blocks by the ranks at mesh coordinate 0 of every
  non-sharding mesh dim; local tensors, numpy arrays and scalars by rank 0, as for every
  rank the same) with MPI-IO. A file per writer keeps the ranks' writes from contending for
  one file (a shared file's buffered writes serialise on its inode lock).

Each rank writes and syncs its data file in a worker thread while it computes the checksums
(MPI-IO and xxhash release the GIL), where the MPI library allows calls from a thread. Before
writing, each rank drops the cached pages of its share of the checkpoint being replaced
(``posix_fadvise``), so that the new files reuse that memory.

Crash safety: a save writes into ``.<name>.dtensor-tmp-<random>`` beside the target (a
name of its own: two saves never share a temporary folder), syncs the data (MPI_File_sync),
the metadata and the folder, and only after every rank has finished renames it into place:
the previous checkpoint is first renamed to ``.<name>.dtensor-old``, the new one to
``<name>``, and the old one is removed (each rank removes a share of its data files). A
save killed at any point leaves a loadable checkpoint: :func:`load` reads ``<name>``, or
``.<name>.dtensor-old`` where a crash came between the two renames; a leftover temporary
folder is never read and the next save to ``<name>`` removes it. A save that fails (a full
disk, a rank's error) removes its temporary folder and leaves the previous checkpoint as
it was. The new checkpoint keeps the permissions of the one it replaces (its folder's
and its files' modes, as ``np.save`` keeps a file's); a new one gets the default ones.
While the ranks write, the temporary folder is its owner's alone.

One save at a time: rank 0 holds ``.<name>.dtensor-lock`` beside the target (``flock``)
from the start of a save to its end. A save that finds it held fails at once on every rank
(a CheckpointError saying another save is in progress) and changes nothing, so two jobs
saving to one folder leave it holding the checkpoint of the one that got the lock.

A symbolic link at ``<name>`` (``latest -> step100``) is replaced, never written through:
the new checkpoint goes into a new folder ``<name>.dtensor-<random>`` beside the link, and
the link is swapped to it atomically (a new link renamed over it). The folder the link
pointed to is left as it was, unless it is such a folder, made by an earlier save to this
link, which is then removed.

Loading trusts nothing in ``metadata.json``: every field is checked (the format, the
chunk size, each tensor's kind, dtype, shape, mesh and placements, each block's box, data
file, offset, size and checksums, and that a tensor's blocks tile it with no gap and no
overlap) before anything is read or allocated, and a bad one raises a CheckpointError
naming the file and the field. Data files are the writers' names (``data-<rank>.bin``)
opened inside the checkpoint folder (relative to a descriptor of it, never through a
symbolic link), so that metadata cannot make a load read another file. A load that meets a
checkpoint replaced by another job's save while it reads (its ranks read different
metadata, or a rank's read fails and the metadata at ``path`` is not the one it read: each
save records a random ``save_id``) starts again once, then raises a CheckpointError saying
so, rather than a checksum mismatch that reads like corruption.

Private test hook: with ``_DTENSOR_CHECKPOINT_KILL_RANK=r`` in the environment, rank ``r``
of a save kills itself (SIGKILL) right after writing its first block, to test that a save
killed mid-write leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import itertools
import json
import math
import os
import re
import shutil
import signal
import stat
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import xxhash

from placements import Replicate, Shard
from placements.errors import CheckpointError, DTypeError, MeshError, ShardingError
from placements.layout import partial_fill
from redistribute.comm import world
from redistribute.fileio import File, threads_allowed

from ..distributed.dtensor import DTensor
from ..distributed.mesh import init_device_mesh
from ..local.factory import from_numpy
from . import _state
from ._common import (
    LOCAL_ERRORS,
    agree,
    bcast_json,
    box,
    dtype_from_name,
    dtype_name,
    fsync_path,
    mode_of,
    reduce_partial,
    run_agreed,
    sibling,
    token,
    writer_coords,
)

__all__ = ["last_load_stats", "load", "save"]

FORMAT = "dtensor-checkpoint"
VERSION = 1
#: Checksum algorithms a checkpoint may name (``metadata.json``'s ``checksum``; each block
#: keeps its chunks' digests under that name) -> the digest of a buffer as an int.
CHECKSUMS = {"xxh3_64": xxhash.xxh3_64_intdigest, "crc32": zlib.crc32}
#: The bits of each algorithm's digests.
CHECKSUM_BITS = {"xxh3_64": 64, "crc32": 32}
#: The algorithm a save uses: XXH3-64 runs about 7x faster than zlib's CRC-32 here.
CHECKSUM = "xxh3_64"
META = "metadata.json"
#: The data file of the blocks that world rank ``r`` writes: ``DATA.format(r)``.
DATA = "data-{:05d}.bin"
#: The names :data:`DATA` gives (the only files a load opens besides :data:`META`).
DATA_NAME = re.compile(r"data-(\d{5,})\.bin")
#: Default bytes per checksum chunk: a rank that needs part of a block reads whole chunks.
CHUNK_BYTES = 1 << 22
#: Blocks start at multiples of this many bytes in the data file.
ALIGN = 64
#: Limits a checkpoint's metadata must keep: bytes of a tensor, a block or a data file (so
#: that no offset arithmetic overflows int64), dims of a tensor or mesh (numpy's limit),
#: world size of the save.
MAX_BYTES = 1 << 62
MAX_NDIM = 64
MAX_WORLD = 1 << 31
KINDS = ("dtensor", "tensor", "ndarray", "scalar")
_KILL_ENV = "_DTENSOR_CHECKPOINT_KILL_RANK"
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)

_last_stats: dict[str, Any] = {}


def _placements_of(texts: Sequence[str]) -> tuple:
    """The placements a checkpoint's metadata names (checked by :func:`_check_meta`)."""
    return tuple(Replicate() if t == "R" else Shard(int(t[2:-1])) for t in texts)


def _describe(key: str, leaf: Any, world_size: int) -> dict[str, Any]:
    """The metadata of one tensor leaf, without its blocks."""
    kind = _state.kind_of(leaf)
    entry: dict[str, Any] = {"key": key, "kind": kind}
    if kind == "dtensor":
        mesh = leaf.device_mesh
        if mesh.size() != world_size:
            raise MeshError(
                f"save: {key!r} is on a mesh of shape {mesh.shape} ({mesh.size()} ranks); save "
                f"needs DTensors on meshes of all {world_size} ranks"
            )
        entry.update(
            mesh_shape=list(mesh.shape),
            mesh_dim_names=None if mesh.mesh_dim_names is None else list(mesh.mesh_dim_names),
            placements_given=[p.short() for p in leaf.placements],
        )
    entry.update(dtype=dtype_name(np.dtype(leaf.dtype)), shape=[int(s) for s in leaf.shape])
    return entry


def _host(leaf: Any) -> np.ndarray:
    """The data of a non-distributed tensor leaf (or a DTensor's shard) as a C-ordered
    numpy array."""
    if isinstance(leaf, DTensor):
        leaf = leaf.to_local()
    if _state.kind_of(leaf) == "tensor":
        leaf = leaf.numpy(force=True)
    return np.ascontiguousarray(leaf)


def _nchunks(nbytes: int, chunk_bytes: int) -> int:
    return -(-nbytes // chunk_bytes)


def _plan_blocks(entries: list[dict], leaves: list, rank: int, chunk_bytes: int) -> tuple:
    """Add each entry's saved ``blocks`` (global box, file offset, size, writer rank).

    Returns ``(writes, first_chunk, chunks)``: this rank's writes ``(block, leaf)`` (into
    its own file), the
    index of each block's first checksum chunk (by ``id(block)``) in the numbering of all
    chunks of the checkpoint, and the number of chunks.
    """
    offsets: dict[int, int] = {}  # writer rank -> end of its file so far
    writes, first_chunk, chunks = [], {}, 0
    for entry, (_, leaf) in zip(entries, leaves):
        itemsize = dtype_from_name(entry["dtype"]).itemsize
        shape = tuple(entry["shape"])
        if entry["kind"] == "dtensor":
            mesh_shape, placements = leaf.device_mesh.shape, leaf.placements
            # world ranks of the coordinates (the mesh spans every rank: _describe checked)
            world_ranks = leaf.device_mesh._world
            holders = [(c, int(world_ranks[c])) for c in writer_coords(mesh_shape, placements)]
            entry["placements"] = [p.short() for p in placements]
        else:
            mesh_shape, placements, holders = (), (), [((), 0)]
        entry["blocks"] = []
        for coord, writer in holders:
            offs, lens = box(shape, mesh_shape, placements, coord)
            nbytes = int(np.prod(lens, dtype=np.int64)) * itemsize
            if nbytes == 0:
                continue  # an empty shard holds nothing
            offset = offsets.get(writer, 0)
            block = {"offsets": list(offs), "lengths": list(lens), "file": DATA.format(writer),
                     "offset": offset, "nbytes": nbytes, "writer": writer}
            entry["blocks"].append(block)
            if writer == rank:
                writes.append((block, leaf))
            first_chunk[id(block)] = chunks
            chunks += _nchunks(nbytes, chunk_bytes)
            offsets[writer] = offset + -(-nbytes // ALIGN) * ALIGN
    return writes, first_chunk, chunks


def _checksums(data: np.ndarray, chunk_bytes: int) -> list[int]:
    """The checksum (:data:`CHECKSUM`) of each ``chunk_bytes`` of the contiguous ``data``."""
    mv = memoryview(data.reshape(-1).view(np.uint8))
    digest = CHECKSUMS[CHECKSUM]
    return [digest(mv[i : i + chunk_bytes]) for i in range(0, len(mv), chunk_bytes)]


def _write(fh: File, data: list[tuple[dict, np.ndarray]], kill: bool, sync: bool) -> None:
    """Write this rank's blocks into its data file and sync it (when ``sync``)."""
    for block, arr in data:
        fh.write_at(block["offset"], arr)
        if kill:  # the private test hook of a save killed mid-write
            os.kill(os.getpid(), signal.SIGKILL)
    if sync:
        fh.sync()


def _is_checkpoint(folder: str) -> bool:
    """Whether a save may replace ``folder``: a checkpoint (it holds :data:`META`) or an
    empty folder."""
    return os.path.isdir(folder) and (
        not os.listdir(folder) or os.path.isfile(os.path.join(folder, META))
    )


def _remove_tree(path: str) -> None:
    """Remove ``path``: a folder with what it holds, or a file or link (never followed)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


class _Lock:
    """Rank 0's hold on ``.<name>.dtensor-lock`` beside the checkpoint it saves
    (``flock``)."""

    __slots__ = ("fd", "path")

    def __init__(self) -> None:
        self.fd: int | None = None
        self.path = ""

    def take(self, path: str) -> None:
        """Hold the lock of checkpoint ``path``, or raise a CheckpointError at once where
        another save holds it (never waits). A lock file that its holder removed while this
        save opened it is taken anew."""
        self.path = sibling(path, "lock")
        for _ in range(16):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | _CLOEXEC, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise CheckpointError(
                    f"save: another save to {path!r} is in progress (it holds the lock "
                    f"{self.path!r}); this save changed nothing"
                ) from None
            except BaseException:
                os.close(fd)
                raise
            try:
                now = os.stat(self.path, follow_symlinks=False)
            except FileNotFoundError:
                now = None
            held = os.fstat(fd)
            if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                self.fd = fd
                return
            os.close(fd)  # removed by a save that just finished: take the new one
        raise CheckpointError(f"save: could not take the lock {self.path!r} of {path!r}")

    def release(self) -> None:
        """Remove the lock file, then let it go (no-op where not held): a save that opened
        it meanwhile finds it gone once it holds it, and takes a new one."""
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


def _begin(path: str, lock: _Lock) -> dict[str, Any]:
    """Rank 0, before the ranks write: take the lock, refuse to replace what is not a
    checkpoint, remove what earlier saves to ``path`` left (temporary folders and links of
    saves that did not finish: only the lock's holder saves to ``path``), make this save's
    temporary folder.

    Returns the save's plan: ``tmp`` (the folder the ranks write into), ``token`` (its
    random part, also the checkpoint's ``save_id``), ``link`` (the text of the link at
    ``path``, None where it is no link), ``drop`` (the checkpoint whose data files this save
    removes once done, or None), ``dir_mode`` (the folder's mode once complete: the
    replaced checkpoint's, else the default) and ``file_mode`` (the replaced checkpoint's
    files' mode, None where there is none).
    """
    lock.take(path)
    parent, name = os.path.split(path)
    link = os.readlink(path) if os.path.islink(path) else None
    current = path if link is None else os.path.join(parent, link)
    if os.path.lexists(current) and not _is_checkpoint(current):
        through = "" if link is None else f" (a link to {link!r})"
        raise CheckpointError(
            f"save: {path!r}{through} exists and is not a dtensor checkpoint (no {META}); "
            "refusing to replace it"
        )
    leftover = re.compile(re.escape(f".{name}.dtensor-")
                          + r"(tmp|tmp-[0-9a-f]{16}|link-[0-9a-f]{16})")
    for entry in os.listdir(parent):
        if leftover.fullmatch(entry):
            _remove_tree(os.path.join(parent, entry))
    tok = token()
    tmp = sibling(path, f"tmp-{tok}")
    os.mkdir(tmp, 0o777)
    exists = os.path.isdir(current)
    # the folder's mode once complete: the replaced one's, else the default (umask's)
    dir_mode = mode_of(current if exists else tmp)
    os.chmod(tmp, stat.S_IRWXU)  # while the ranks write: the owner's alone
    meta_path = os.path.join(current, META)
    file_mode = stat.S_IMODE(os.lstat(meta_path).st_mode) if exists and os.path.isfile(
        meta_path) else None
    if link is None:
        drop = path if exists else None
    else:  # a folder that an earlier save to this link made; any other target is kept
        made = re.fullmatch(re.escape(name) + r"\.dtensor-[0-9a-f]{16}", link)
        drop = current if made and exists and not os.path.islink(current) else None
    return {"tmp": tmp, "token": tok, "link": link, "drop": drop, "dir_mode": dir_mode,
            "file_mode": file_mode}


def _commit(path: str, plan: dict[str, Any], meta: dict, sync: bool) -> str | None:
    """Rank 0: write (and sync) the metadata, give the files and the folder the modes of
    the checkpoint replaced, then put the new checkpoint in place (see the module doc).
    Returns the folder whose data files the ranks remove next (the previous checkpoint),
    or None."""
    tmp = plan["tmp"]
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC
    with os.fdopen(os.open(os.path.join(tmp, META), flags, 0o666), "w") as fh:
        json.dump(meta, fh, indent=1)
        if sync:
            fh.flush()
            os.fsync(fh.fileno())
    if plan["file_mode"] is not None:
        for name in (META, *meta["files"]):
            os.chmod(os.path.join(tmp, name), plan["file_mode"])
    os.chmod(tmp, plan["dir_mode"])
    if sync:
        fsync_path(tmp, directory=True)
    parent, name = os.path.split(path)
    if plan["link"] is not None:
        folder = os.path.join(parent, f"{name}.dtensor-{plan['token']}")
        new_link = sibling(path, f"link-{plan['token']}")
        os.rename(tmp, folder)
        try:
            os.symlink(os.path.basename(folder), new_link)
            os.replace(new_link, path)  # atomic: the link names the old or the new folder
        except BaseException:
            if os.path.lexists(new_link):
                os.unlink(new_link)
            os.rename(folder, tmp)  # removed by the caller, as after any failed save
            raise
        removed = plan["drop"]
    else:
        old = sibling(path, "old")
        if os.path.isdir(path):
            if os.path.lexists(old):
                shutil.rmtree(old)  # a swap that finished all but this removal: path is good
            os.rename(path, old)
        os.rename(tmp, path)
        removed = old if os.path.lexists(old) else None
    if sync:
        fsync_path(parent, directory=True)
    return removed


def _share(folder: str | None, rank: int, size: int) -> list[str]:
    """This rank's share of the data files of checkpoint ``folder`` (none where it does not
    exist): those of writer ranks ``rank``, ``rank + size``, ..."""
    if folder is None or not os.path.isdir(folder):
        return []
    out = []
    for name in os.listdir(folder):
        writer = DATA_NAME.fullmatch(name)
        if writer and int(writer[1]) % size == rank:
            out.append(os.path.join(folder, name))
    return out


def _remove(files: list[str]) -> None:
    for name in files:
        os.unlink(name)


def _uncache(files: list[str]) -> None:
    """Drop the cached pages of ``files`` (the checkpoint a save replaces: they are about to
    be removed), so that the new data files take their memory instead of evicting other
    cached data or asking the OS for memory it must first clear (on a virtual machine, host
    memory). Dirty pages (a checkpoint saved with ``sync=False`` less than the kernel's
    write-back delay ago) are not dropped but queued for writing. Advisory: a file that
    cannot be opened is skipped, and nothing is done where the OS has no ``posix_fadvise``."""
    if not hasattr(os, "posix_fadvise"):
        return
    for name in files:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | _CLOEXEC)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def save(
    state: Any, path: str | os.PathLike, *, chunk_bytes: int = CHUNK_BYTES, sync: bool = True
) -> None:
    """Save ``state`` as a checkpoint folder at ``path``. **Collective** over COMM_WORLD.

    Every rank passes the same structure (keys, tensor kinds, shapes, dtypes, meshes and
    placements); the python values and the non-distributed tensors are taken from rank 0.
    DTensors must live on meshes of all ranks; Partial mesh dims are reduced to Replicate
    before the write (one collective per such tensor) and saved as Replicate. Each distinct
    block is written once. An existing checkpoint at ``path`` stays loadable until the new
    one is complete, and keeps its permissions (see the module documentation). One save to
    ``path`` at a time: a save that finds another one in progress (any job) fails at once
    and changes nothing.

    Where ``path`` is a symbolic link (``latest -> step100``), the link is replaced, never
    written through: the checkpoint goes into a new folder ``<name>.dtensor-<random>``
    beside the link and the link is swapped to it atomically. The link's previous target
    is left as it was, unless it is a folder an earlier save to this link made (removed).

    Parameters
    ----------
    state : dict, list, tuple, DTensor, Tensor, ndarray or python value
        Nested dicts (str keys), lists and tuples of DTensors, local Tensors, numpy arrays
        and scalars, and python values (None, bool, int, float, str). The keys of the
        leaves (the path's parts joined by dots) must differ.
    path : str or os.PathLike
        The checkpoint folder (created or replaced; its parent must exist), or a symbolic
        link to one (replaced).
    chunk_bytes : int
        Bytes per checksum chunk: a load that needs part of a block reads the chunks that
        hold that part.
    sync : bool
        Sync the data files, the metadata and the folders to storage before and after the
        rename (``fsync``), so that the checkpoint survives a power loss or an OS crash.
        With False a save killed at any point still leaves a loadable checkpoint (the
        renames follow the writes), but a crash of the machine may not; the save is faster
        by the time the storage takes to write the data (PyTorch's ``sync_files``).

    Raises
    ------
    CheckpointError
        The ranks pass different structures, ``path`` exists and is not a checkpoint,
        another save to ``path`` is in progress, or a file cannot be written (the
        temporary files are removed; the previous checkpoint is kept).
    ArgumentError
        Two leaves of ``state`` with one key (``{"a.b": x, "a": {"b": y}}``).
    DTypeError
        A leaf of another type, or a dict key that is not a str.
    MeshError
        A DTensor on a mesh of fewer than all ranks.
    """
    comm = world()
    path = os.path.abspath(os.fspath(path))
    if int(chunk_bytes) < 1:
        raise CheckpointError(f"save: chunk_bytes must be >= 1, got {chunk_bytes} ({path!r})")
    chunk_bytes = int(chunk_bytes)

    def describe() -> tuple:
        skeleton, leaves = _state.flatten(state, "save")
        return skeleton, leaves, [_describe(k, leaf, comm.size) for k, leaf in leaves]

    skeleton, leaves, entries = run_agreed(comm, "save", describe)
    text = json.dumps(entries, sort_keys=True)
    digests = comm.allgather_ints([zlib.crc32(text.encode())], what="save: state digest")
    if len(set(digests[:, 0].tolist())) != 1:
        agree(comm, CheckpointError(
            f"save: the ranks pass different states (tensor keys, kinds, shapes, dtypes or "
            f"placements) for {path!r}; rank {comm.rank} passes {text[:400]}"
        ) if digests[comm.rank, 0] != digests[0, 0] else None, "save")
    leaves = [(k, reduce_partial(x) if isinstance(x, DTensor) else x) for k, x in leaves]
    writes, first_chunk, chunks = _plan_blocks(entries, leaves, comm.rank, chunk_bytes)
    lock, plan = _Lock(), {}
    try:
        run_agreed(comm, "save", lambda: comm.rank == 0 and plan.update(_begin(path, lock)))
        tmp, drop = bcast_json(comm, [plan.get("tmp"), plan.get("drop")])
        _write_all(comm, tmp, drop, writes, first_chunk, chunks, chunk_bytes, entries, sync)
        if comm.rank == 0:
            files: dict[str, int] = {}
            for block in (b for e in entries for b in e["blocks"]):
                end = block["offset"] + block["nbytes"]
                files[block["file"]] = max(files.get(block["file"], 0), end)
            meta = {
                "format": FORMAT, "version": VERSION, "save_id": plan["token"],
                "world_size": comm.size, "chunk_bytes": chunk_bytes, "checksum": CHECKSUM,
                "files": files, "structure": skeleton, "tensors": entries,
            }
        removed = run_agreed(comm, "save", lambda: comm.rank == 0 and _commit(
            path, plan, meta, sync) or None)
        removed = bcast_json(comm, removed)
        # freeing a file's blocks takes time in proportion to its size: the ranks share it
        run_agreed(comm, "save", lambda: _remove(_share(removed, comm.rank, comm.size)))
        run_agreed(comm, "save", lambda: comm.rank == 0 and removed is not None
                   and os.path.lexists(removed) and shutil.rmtree(removed))
    except BaseException:
        # every rank has closed its files (errors are agreed after the closes)
        if comm.rank == 0 and plan.get("tmp") and os.path.lexists(plan["tmp"]):
            shutil.rmtree(plan["tmp"], ignore_errors=True)
        raise
    finally:
        lock.release()


def _write_all(comm, tmp: str, drop: str | None, writes: list, first_chunk: dict, chunks: int,
               chunk_bytes: int, entries: list[dict], sync: bool) -> None:
    """Each rank writes its blocks into its data file in ``tmp`` and computes their
    checksums; rank 0 gets every block's digests into ``entries``. **Collective**: the
    ranks agree on the errors once every rank has closed its file."""
    # each chunk's checksum is set by its writer (the 64 bits as an int64), then summed
    sums = np.zeros(chunks, np.uint64)
    error, fh = None, None
    try:
        _uncache(_share(drop, comm.rank, comm.size))
        if writes:
            fh = File(None, os.path.join(tmp, DATA.format(comm.rank)), "w", "save")
            data = [(block, _host(leaf)) for block, leaf in writes]
            kill = os.environ.get(_KILL_ENV) == str(comm.rank)
            # the writes and the sync run beside the checksums (both release the GIL)
            with ThreadPoolExecutor(1) as pool:
                done = pool.submit(_write, fh, data, kill, sync) if threads_allowed() else None
                for block, arr in data:
                    first = first_chunk[id(block)]
                    n = _nchunks(block["nbytes"], chunk_bytes)
                    sums[first : first + n] = _checksums(arr, chunk_bytes)
                if done is None:
                    _write(fh, data, kill, sync)
                else:
                    done.result()
    except LOCAL_ERRORS as e:
        error = e
    if fh is not None:
        try:
            fh.close()
        except LOCAL_ERRORS as e:
            error = error or e
    agree(comm, error, "save")
    comm.allreduce(sums.view(np.int64), op="sum", what="save: checksums")
    if comm.rank == 0:
        for entry in entries:
            for block in entry["blocks"]:
                first = first_chunk[id(block)]
                n = _nchunks(block["nbytes"], chunk_bytes)
                block[CHECKSUM] = sums[first : first + n].tolist()


def _show(value: Any) -> str:
    """``repr(value)``, shortened for an error message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _tiling_gap(boxes: list[tuple], shape: list[int]) -> str | None:
    """Why the blocks ``boxes`` ((offsets, lengths), each inside ``shape`` and not empty)
    do not tile ``shape`` exactly, or None where they do: per dim their intervals must
    split the dim with no gap and no overlap, and the blocks must be every combination of
    those intervals, once each."""
    if math.prod(shape) == 0:
        return None  # an empty tensor: its blocks would be empty, and none passes the checks
    if len(boxes) == 1 and boxes[0] == ((0,) * len(shape), tuple(shape)):
        return None  # the whole tensor
    if len(set(boxes)) != len(boxes):
        twice = next(b for i, b in enumerate(boxes) if b in boxes[:i])
        return f"list the block at offsets {list(twice[0])} twice"
    parts = []
    for d in range(len(shape)):
        intervals = sorted({(o[d], n[d]) for o, n in boxes})
        end = 0
        for start, length in intervals:
            if start > end:
                return f"leave dim {d} from {end} to {start} uncovered"
            if start < end:
                return f"overlap in dim {d} from {start} to {min(end, start + length)}"
            end = start + length
        if end != shape[d]:
            return f"leave dim {d} from {end} to {shape[d]} uncovered"
        parts.append(intervals)
    if len(boxes) == math.prod(len(p) for p in parts):
        return None  # distinct blocks, each a combination of the intervals: all of them
    have = set(boxes)
    for combo in itertools.product(*parts):
        wanted = (tuple(o for o, _ in combo), tuple(n for _, n in combo))
        if wanted not in have:
            return (f"leave the part at offsets {list(wanted[0])} of lengths {list(wanted[1])} "
                    "uncovered")
    return None


def _check_meta(meta: Any, where: str) -> dict:
    """``meta``, the parsed ``metadata.json`` at ``where``, where every field holds what a
    save writes (within :data:`MAX_BYTES`, :data:`MAX_NDIM` and :data:`MAX_WORLD`); else a
    CheckpointError naming the file and the field. **Local**."""

    def bad(field: str, why: str) -> CheckpointError:
        return CheckpointError(f"load: {where!r}: {field} {why}")

    def integer(value: Any, field: str, lo: int, hi: int) -> int:
        if type(value) is not int or not lo <= value <= hi:
            raise bad(field, f"is {_show(value)}; expected an integer from {lo} to {hi}")
        return value

    def integers(value: Any, field: str, n: int | None, lo: int, hi: int) -> list[int]:
        if type(value) is list and len(value) == (len(value) if n is None else n) <= MAX_NDIM \
                and (not value or _ints_within(value, lo, hi)):
            return value
        if not isinstance(value, list) or len(value) != (len(value) if n is None else n) or (
                len(value) > MAX_NDIM):
            count = f"at most {MAX_NDIM}" if n is None else str(n)
            raise bad(field, f"is {_show(value)}; expected a list of {count} integers")
        for k, v in enumerate(value):
            integer(v, f"{field}[{k}]", lo, hi)
        return value

    if not isinstance(meta, dict):
        raise CheckpointError(f"load: {where!r} holds {type(meta).__name__}, not a JSON object")
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(
            f"load: {where!r} holds format {_show(meta.get('format'))} version "
            f"{_show(meta.get('version'))}; this dtensor reads {FORMAT!r} version {VERSION}"
        )
    algorithm = meta.get("checksum")
    if not isinstance(algorithm, str) or algorithm not in CHECKSUMS:
        raise CheckpointError(
            f"load: {where!r} names checksum {_show(algorithm)}; this dtensor verifies "
            f"{sorted(CHECKSUMS)}"
        )
    if not isinstance(meta.get("save_id", ""), str):
        raise bad("save_id", f"is {_show(meta['save_id'])}; expected a str")
    chunk = integer(meta.get("chunk_bytes"), "chunk_bytes", 1, MAX_BYTES)
    world_size = integer(meta.get("world_size"), "world_size", 1, MAX_WORLD)
    files = meta.get("files")
    if not isinstance(files, dict):
        raise bad("files", f"is {_show(files)}; expected an object of data file sizes")
    for name, size in files.items():
        writer = DATA_NAME.fullmatch(name)
        if not writer or DATA.format(int(writer[1])) != name or int(writer[1]) >= world_size:
            raise bad(f"files[{name!r}]", f"is not a data file of this checkpoint (data-NNNNN"
                      f".bin of a writer rank below its world size {world_size})")
        integer(size, f"files[{name!r}]", 0, MAX_BYTES)
    tensors = meta.get("tensors")
    if not isinstance(tensors, list):
        raise bad("tensors", f"is {_show(tensors)}; expected a list")
    keys: set[str] = set()
    for i, entry in enumerate(tensors):
        field = f"tensors[{i}]"
        if not isinstance(entry, dict):
            raise bad(field, f"is {_show(entry)}; expected an object")
        key = entry.get("key")
        if not isinstance(key, str) or key in keys:
            raise bad(f"{field}.key", f"is {_show(key)}; expected a str that no other tensor has")
        keys.add(key)
        field = f"{field} ({key!r})"
        kind = entry.get("kind")
        if kind not in KINDS:
            raise bad(f"{field}.kind", f"is {_show(kind)}; expected one of {list(KINDS)}")
        name = entry.get("dtype")
        try:
            dtype = dtype_from_name(name) if isinstance(name, str) else None
        except (TypeError, ValueError, SyntaxError):
            dtype = None
        if dtype is None or dtype.hasobject or dtype.itemsize == 0 or dtype.fields is not None \
                or dtype.subdtype is not None:
            raise bad(f"{field}.dtype", f"is {_show(name)}; expected the name of a numpy dtype "
                      "of fixed-size items without objects")
        shape = integers(entry.get("shape"), f"{field}.shape", None, 0, MAX_BYTES)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > MAX_BYTES:
            raise bad(f"{field}.shape", f"{shape} of {name} takes {nbytes} bytes; a checkpoint's "
                      f"tensor takes at most {MAX_BYTES}")
        if kind == "scalar" and shape:
            raise bad(f"{field}.shape", f"is {shape}; a scalar has shape []")
        if kind == "dtensor":
            mesh_shape = integers(entry.get("mesh_shape"), f"{field}.mesh_shape", None, 1,
                                  MAX_WORLD)
            if not mesh_shape or math.prod(mesh_shape) != world_size:
                raise bad(f"{field}.mesh_shape", f"is {mesh_shape}; a saved mesh holds all "
                          f"{world_size} ranks of the save")
            names = entry.get("mesh_dim_names")
            if names is not None and (
                not isinstance(names, list) or len(names) != len(mesh_shape)
                or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names)
            ):
                raise bad(f"{field}.mesh_dim_names", f"is {_show(names)}; expected None or "
                          f"{len(mesh_shape)} distinct str")
            for what, partial in (("placements", False), ("placements_given", True)):
                texts = entry.get(what)
                if not isinstance(texts, list) or len(texts) != len(mesh_shape) or not all(
                    isinstance(t, str) and -1 <= _placement_dim(t, partial) < len(shape)
                    for t in texts
                ):
                    raise bad(f"{field}.{what}", f"is {_show(texts)}; expected {len(mesh_shape)} "
                              f"of {'R, S(dim)' if what == 'placements' else 'R, S(dim), P(op)'}"
                              f" (dim below {len(shape)})")
        blocks = entry.get("blocks")
        if not isinstance(blocks, list):
            raise bad(f"{field}.blocks", f"is {_show(blocks)}; expected a list")
        top = (1 << CHECKSUM_BITS[algorithm]) - 1
        boxes = []
        for j, block in enumerate(blocks):
            if not _block_ok(block, shape, dtype.itemsize, files, algorithm, chunk, top):
                _block_error(block, f"{field}.blocks[{j}]", shape, dtype.itemsize, files,
                             algorithm, chunk, bad, integer, integers)
            boxes.append((tuple(block["offsets"]), tuple(block["lengths"])))
        gap = _tiling_gap(boxes, shape)
        if gap is not None:
            raise bad(f"{field}.blocks", f"do not tile the tensor of shape {shape}: they {gap}")
    _check_structure(meta.get("structure"), tensors, bad)
    return meta


def _block_ok(block: Any, shape: list[int], itemsize: int, files: dict, algorithm: str,
              chunk: int, top: int) -> bool:
    """Whether a saved block of a tensor of ``shape`` holds what a save writes (the fast
    test of :func:`_check_meta`; :func:`_block_error` says what is wrong)."""
    if type(block) is not dict:
        return False
    offsets, lengths = block.get("offsets"), block.get("lengths")
    if type(offsets) is not list or type(lengths) is not list or not (
            len(offsets) == len(lengths) == len(shape)):
        return False
    size = itemsize
    for o, n, s in zip(offsets, lengths, shape):
        if type(o) is not int or type(n) is not int or o < 0 or n < 1 or o + n > s:
            return False
        size *= n
    file, offset, nbytes = block.get("file"), block.get("offset"), block.get("nbytes")
    if type(file) is not str or file not in files or type(nbytes) is not int or nbytes != size:
        return False
    if "writer" in block and (type(block["writer"]) is not int
                              or _data_name(block["writer"]) != file):
        return False
    if type(offset) is not int or offset < 0 or offset + size > files[file]:
        return False
    sums = block.get(algorithm)
    if type(sums) is not list or len(sums) != _nchunks(size, chunk):
        return False
    return _ints_within(sums, 0, top)


@functools.lru_cache(maxsize=4096)
def _data_name(writer: int) -> str:
    return DATA.format(writer)


def _ints_within(values: list, lo: int, hi: int) -> bool:
    """Whether the non-empty list ``values`` holds ints (not bools) from ``lo`` to ``hi``."""
    return set(map(type, values)) == {int} and lo <= min(values) and max(values) <= hi


@functools.lru_cache(maxsize=256)
def _placement_dim(text: str, partial: bool) -> int:
    """The tensor dim of a placement's short form in metadata (``S(1)``: 1), -1 for ``R``
    (and ``P(op)`` where ``partial``), -2 for anything else."""
    m = re.fullmatch(r"R|S\(([0-9]+)\)|(P\([a-z]+\))", text)
    if m is None or (m[2] is not None and not partial):
        return -2
    return -1 if m[1] is None else int(m[1])


def _block_error(block: Any, bf: str, shape: list[int], itemsize: int, files: dict,
                 algorithm: str, chunk: int, bad: Any, integer: Any, integers: Any) -> None:
    """Raise the CheckpointError that names what is wrong with a block that
    :func:`_block_ok` refused (``bf``: its field)."""
    if not isinstance(block, dict):
        raise bad(bf, f"is {_show(block)}; expected an object")
    offsets = integers(block.get("offsets"), f"{bf}.offsets", len(shape), 0, MAX_BYTES)
    lengths = integers(block.get("lengths"), f"{bf}.lengths", len(shape), 1, MAX_BYTES)
    if any(o + n > s for o, n, s in zip(offsets, lengths, shape)):
        raise bad(bf, f"(offsets {offsets}, lengths {lengths}) reaches outside the tensor's "
                  f"shape {shape}")
    file = block.get("file")
    if not isinstance(file, str) or file not in files:
        raise bad(f"{bf}.file", f"is {_show(file)}; expected one of the checkpoint's data "
                  f"files {sorted(files)[:8]}")
    if "writer" in block and (type(block["writer"]) is not int
                              or DATA.format(block["writer"]) != file):
        raise bad(f"{bf}.writer", f"is {_show(block['writer'])}; its file is {file!r}")
    size = math.prod(lengths) * itemsize
    integer(block.get("nbytes"), f"{bf}.nbytes", size, size)
    offset = integer(block.get("offset"), f"{bf}.offset", 0, MAX_BYTES)
    if offset + size > files[file]:
        raise bad(f"{bf}.offset", f"{offset} plus its {size} bytes runs past the "
                  f"{files[file]} bytes of {file!r} (files)")
    sums = block.get(algorithm)
    if not isinstance(sums, list) or len(sums) != _nchunks(size, chunk):
        raise bad(f"{bf}.{algorithm}", f"is {_show(sums)}; expected {_nchunks(size, chunk)} "
                  f"checksums (one per chunk_bytes {chunk})")
    for k, v in enumerate(sums):
        integer(v, f"{bf}.{algorithm}[{k}]", 0, (1 << CHECKSUM_BITS[algorithm]) - 1)
    raise bad(bf, f"is {_show(block)}; not a block a save writes")


def _check_structure(node: Any, tensors: list[dict], bad: Any) -> None:
    """Check a checkpoint's ``structure``: the nodes :func:`_state.flatten` writes, each
    tensor referred to once under its key, every leaf's key distinct."""
    used: set[int] = set()
    leaves: set[str] = set()

    def walk(node: Any, key: str, field: str) -> None:
        if not isinstance(node, dict) or len(node) != 1:
            raise bad(field, f"is {_show(node)}; expected an object of one of dict, list, "
                      "tuple, tensor, value")
        (kind, value), = node.items()
        if kind == "dict" and isinstance(value, list):
            for n, item in enumerate(value):
                if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
                    raise bad(f"{field}.dict[{n}]", f"is {_show(item)}; expected [str, node]")
                walk(item[1], f"{key}.{item[0]}" if key else item[0], f"{field}.dict[{n}]")
            return
        if kind in ("list", "tuple") and isinstance(value, list):
            for n, item in enumerate(value):
                walk(item, f"{key}.{n}" if key else str(n), f"{field}.{kind}[{n}]")
            return
        if key in leaves:
            raise bad(field, f"is a second leaf with the key {key!r}")
        leaves.add(key)
        if kind == "tensor":
            if type(value) is not int or not 0 <= value < len(tensors) or value in used or (
                    tensors[value]["key"] != key):
                raise bad(field, f"is {_show(node)}; expected the index of the tensor with key "
                          f"{key!r}, once")
            used.add(value)
            return
        if kind == "value" and (
            isinstance(value, _state.VALUE_TYPES)
            or (isinstance(value, dict) and list(value) == ["float"]
                and value["float"] in ("inf", "-inf", "nan"))
        ):
            return
        raise bad(field, f"is {_show(node)}; expected an object of one of dict, list, tuple, "
                  "tensor, value")

    try:
        walk(node, "", "structure")
    except RecursionError:
        raise bad("structure", "nests too deep") from None
    if len(used) != len(tensors):
        missing = sorted(set(range(len(tensors))) - used)[:5]
        raise bad("structure", f"does not refer to tensors {missing}")


class _Folder:
    """A checkpoint folder open for a load: its path, a descriptor of it (its files are
    opened relative to that, so that a save that replaces ``path`` meanwhile cannot mix two
    checkpoints), and its metadata file's bytes."""

    __slots__ = ("fd", "path", "raw")

    def __init__(self, fd: int, path: str, raw: bytes) -> None:
        self.fd, self.path, self.raw = fd, path, raw

    @property
    def ident(self) -> int:
        """A digest of the metadata (which names the save's random ``save_id``), 63 bits:
        another save's checkpoint has another one."""
        return xxhash.xxh3_64_intdigest(self.raw) >> 1

    def open(self, name: str) -> int:
        """A descriptor of the regular file ``name`` of the folder, for reading; never
        through a symbolic link (and never waiting on a FIFO)."""
        where = os.path.join(self.path, name)
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
        try:
            fd = os.open(name, flags, dir_fd=self.fd)
        except OSError as e:
            why = ("it is a symbolic link (a checkpoint's files are never links)"
                   if e.errno in (errno.ELOOP, errno.EMLINK) else e.strerror or str(e))
            raise CheckpointError(f"load: cannot open {where!r} (read): {why}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CheckpointError(f"load: cannot open {where!r} (read): it is not a regular file")
        return fd

    def close(self) -> None:
        os.close(self.fd)


def _open_folder(path: str) -> _Folder:
    """The checkpoint to read: ``path``, or its previous version where a save was killed
    (or is) between its two renames; ``path`` again last (a save may have just finished)."""
    for folder in (path, sibling(path, "old"), path):
        try:
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
        except OSError:
            continue
        out = _Folder(fd, folder, b"")
        try:
            meta_fd = out.open(META)
        except CheckpointError:
            if os.path.lexists(os.path.join(folder, META)):  # a link, not a file: refused
                out.close()
                raise
            out.close()
            continue
        with os.fdopen(meta_fd, "rb") as fh:
            out.raw = fh.read()
        return out
    raise CheckpointError(f"load: no checkpoint at {path!r} (no {META} there)")


def _read_meta(folder: _Folder) -> dict:
    """The checked metadata of an open checkpoint (:func:`_check_meta`)."""
    where = os.path.join(folder.path, META)
    try:
        meta = json.loads(folder.raw)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"load: {where!r} is not valid JSON: {e}") from None
    return _check_meta(meta, where)


def _match(entry: dict, leaf: Any, folder: str) -> None:
    """Check that the state's leaf can take the saved tensor."""
    shape, dtype = tuple(entry["shape"]), dtype_from_name(entry["dtype"])
    if tuple(leaf.shape) != shape:
        raise ShardingError(
            f"load: {entry['key']!r} has shape {tuple(leaf.shape)} in the state but "
            f"{shape} in checkpoint {folder!r}"
        )
    if np.dtype(leaf.dtype) != dtype:
        raise DTypeError(
            f"load: {entry['key']!r} has dtype {np.dtype(leaf.dtype)} in the state but "
            f"{dtype} in checkpoint {folder!r}"
        )


class _Target:
    """One tensor to fill on this rank: the saved entry, the local array, its global box,
    and the value (a Partial identity) it holds instead, if any."""

    __slots__ = ("dst", "entry", "fill", "lengths", "offsets")

    def __init__(self, entry: dict, dst: np.ndarray, placements: tuple, mesh_shape, coord):
        self.entry = entry
        self.dst = dst
        self.offsets, self.lengths = box(entry["shape"], mesh_shape, placements, coord)
        self.fill = partial_fill(placements, coord) if placements else None


def _target_of(entry: dict, leaf: Any, folder: str) -> _Target:
    _match(entry, leaf, folder)
    if isinstance(leaf, DTensor):
        mesh = leaf.device_mesh
        return _Target(entry, leaf.to_local().numpy(), leaf.placements, mesh.shape,
                       mesh.get_coordinate())
    if isinstance(leaf, np.generic):
        leaf = np.empty((), leaf.dtype)
    dst = leaf.numpy() if _state.kind_of(leaf) == "tensor" else leaf
    return _Target(entry, dst, (), (), ())


def _read_block_part(fh: _DataFile, target: _Target, block: dict, chunk: int, algorithm: str,
                     folder: str, stats: dict) -> None:
    """Copy the part of saved ``block`` that ``target``'s box needs into its array,
    reading the checksum chunks that hold it and verifying them (``algorithm``, a key of
    :data:`CHECKSUMS`)."""
    lo_g = [max(a, b) for a, b in zip(target.offsets, block["offsets"])]
    hi_g = [min(a + n, b + m) for a, n, b, m in zip(target.offsets, target.lengths,
                                                     block["offsets"], block["lengths"])]
    if any(h <= lo for lo, h in zip(lo_g, hi_g)):
        return
    entry = target.entry
    dtype = dtype_from_name(entry["dtype"])
    lengths = block["lengths"]
    strides = [dtype.itemsize] * len(lengths)  # C-order byte strides of the block
    for d in range(len(lengths) - 2, -1, -1):
        strides[d] = strides[d + 1] * lengths[d + 1]
    start = [lo - b for lo, b in zip(lo_g, block["offsets"])]
    sub = [h - lo for lo, h in zip(lo_g, hi_g)]
    first = sum(s * st for s, st in zip(start, strides))
    last = sum((s + n - 1) * st for s, n, st in zip(start, sub, strides)) + dtype.itemsize
    c0, c1 = first // chunk, -(-last // chunk)
    r0, r1 = c0 * chunk, min(c1 * chunk, block["nbytes"])
    # the trailing Ellipsis keeps a 0-d region a view (an empty tuple gives a scalar)
    region = target.dst[(*(slice(lo - o, h - o) for lo, h, o in
                           zip(lo_g, hi_g, target.offsets)), ...)]
    direct = region.flags.c_contiguous and (r0, r1) == (first, last) and region.nbytes == r1 - r0
    buf = region if direct else np.empty(r1 - r0, np.uint8)
    got = fh.read_at(block["offset"] + r0, buf)
    stats["data_bytes"] += r1 - r0
    stats["needed_bytes"] += region.nbytes
    where = (f"{fh.path!r} bytes {block['offset'] + r0}..{block['offset'] + r1} of "
             f"{entry['key']!r} (saved block at {tuple(block['offsets'])} of shape "
             f"{tuple(lengths)})")
    if got < r1 - r0:
        raise CheckpointError(f"load: {where}: the file ends after {got} of these bytes")
    mv = memoryview(buf.reshape(-1).view(np.uint8))
    digest, stored = CHECKSUMS[algorithm], block[algorithm]
    for i, c in enumerate(range(c0, c1)):
        # Note: the digest of what was read is not shown (it would tell of the bytes read)
        if digest(mv[i * chunk : (i + 1) * chunk]) != stored[c]:
            raise CheckpointError(
                f"load: checksum mismatch in {where}, chunk {c}: stored {algorithm} "
                f"{stored[c]:#x}, the bytes read differ (checkpoint {folder!r})"
            )
    if not direct:
        region[...] = np.ndarray(sub, dtype, buf, first - r0, strides)


class _DataFile:
    """A data file of a checkpoint, open for reading at byte offsets (``preadv``, which
    releases the GIL)."""

    __slots__ = ("fd", "path")

    def __init__(self, fd: int, path: str) -> None:
        self.fd, self.path = fd, path

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def read_at(self, offset: int, buf: np.ndarray) -> int:
        """Fill the contiguous ``buf`` from byte ``offset``; returns the bytes read (fewer
        where the file ends early)."""
        mv = memoryview(buf.reshape(-1).view(np.uint8))
        got = 0
        try:
            while got < len(mv):
                n = os.preadv(self.fd, [mv[got : got + (1 << 30)]], offset + got)
                if n == 0:
                    break
                got += n
        except OSError as e:
            raise CheckpointError(
                f"load: reading {len(mv)} bytes at offset {offset} of {self.path!r} failed: "
                f"{e.strerror or e}"
            ) from None
        return got

    def close(self) -> None:
        os.close(self.fd)


def _fill(folder: _Folder, meta: dict, targets: list[_Target], stats: dict) -> Exception | None:
    """Fill every target from the data files this rank needs (each opened by this rank
    alone); returns this rank's error, or None. **Local**: the caller agrees on it."""
    chunk = meta["chunk_bytes"]
    by_file: dict[str, list] = {}
    for t in targets:
        for block in t.entry["blocks"] if t.fill is None else ():  # else it holds no data
            by_file.setdefault(block["file"], []).append((t, block))
    try:
        for name, parts in sorted(by_file.items()):
            _read_file(folder, name, meta, parts, chunk, stats)
    except LOCAL_ERRORS as e:
        return e
    for t in targets:
        if t.fill is not None:
            t.dst[...] = t.fill
    return None


def _read_file(folder: _Folder, name: str, meta: dict, parts: list, chunk: int,
               stats: dict) -> None:
    """Read the ``(target, block)`` parts of the data file ``name`` (a name that
    :func:`_check_meta` accepted) of ``folder``."""
    path = os.path.join(folder.path, name)
    held = sorted({e["key"] for e in meta["tensors"] for b in e["blocks"] if b["file"] == name})
    try:
        fh = _DataFile(folder.open(name), path)
    except CheckpointError as e:
        raise CheckpointError(f"{e}; it holds tensors {held}") from None
    try:
        size, need = fh.size(), meta["files"].get(name, 0)
        if size < need:
            late = sorted({t.entry["key"] for t, b in parts if b["offset"] + b["nbytes"] > size})
            raise CheckpointError(
                f"load: {path!r} holds {size} bytes, the checkpoint needs {need}; truncated "
                f"tensors {late or held}"
            )
        for t, block in parts:
            _read_block_part(fh, t, block, chunk, meta["checksum"], folder.path, stats)
    finally:
        fh.close()


def last_load_stats() -> dict[str, Any]:
    """What this rank read in its last :func:`load`. **Local**.

    Returns
    -------
    dict
        ``path`` (the folder read), ``metadata_bytes`` (the metadata file), ``data_bytes``
        (the bytes read from data files: whole checksum chunks), ``needed_bytes`` (the
        bytes of the target shards among them) and ``bytes_read`` (metadata plus data).
    """
    return dict(_last_stats)


def load(state: Any, path: str | os.PathLike | None = None) -> Any:
    """Load a checkpoint: ``load(state, path)`` fills ``state`` in place; ``load(path)``
    returns the saved state. **Collective** over COMM_WORLD.

    ``load(state, path)``: each tensor of ``state`` gets the saved tensor of its key,
    resharded to its own mesh and placements (a DTensor's local shard, a local tensor's or
    numpy array's whole data, written into the existing memory); python values in the
    state's dicts and lists, and numpy scalars there, are replaced by the saved ones. Keys
    of the checkpoint that the state lacks are not read. Any saved mesh and placements load
    onto any target mesh and placements at any world size.

    ``load(path)``: the saved structure with new leaves. A DTensor comes back on a new
    mesh of its saved shape and dim names with its saved placements (Partial ones reduced
    to Replicate) when the world size is the product of that shape, else as
    ``Replicate()`` on a 1-D mesh of all ranks; local tensors come back as Tensors, numpy
    arrays as arrays, numpy scalars as scalars, python values as saved (tuples as tuples).

    Every rank reads the metadata and, from the data file, only the checksum chunks that
    hold its target shards; each chunk read is verified (see :func:`last_load_stats`). The
    metadata is checked field by field before anything is read, and only the checkpoint's
    own data files are opened (see the module documentation). A checkpoint replaced by
    another save while it is read is read again once.

    Parameters
    ----------
    state : dict, list, tuple or tensor, optional
        The state to fill (its structure as for :func:`save`; it may hold a subset of the
        checkpoint's keys). Pass the path alone to get the saved state.
    path : str or os.PathLike
        The checkpoint folder (or a symbolic link to one).

    Raises
    ------
    CheckpointError
        No checkpoint at ``path``; a missing, truncated or corrupt file, a data file that is
        a link, or metadata with a bad field (naming the file and the field or tensor); a
        key of ``state`` that the checkpoint lacks; a checkpoint replaced by other saves
        during both reads.
    ShardingError, DTypeError
        A tensor of ``state`` whose shape or dtype differs from the saved one.
    ArgumentError
        Two leaves of ``state`` with one key.
    """
    if path is None:
        state, path = None, state
    comm = world()
    path = os.path.abspath(os.fspath(path))
    for _ in range(2):
        out = _load_once(comm, state, path)
        if out is not _REPLACED:
            return out
    raise CheckpointError(
        f"load: the checkpoint at {path!r} was replaced by another save while this load read "
        "it, twice; load it again once the saves have finished"
    )


#: What :func:`_load_once` returns where the checkpoint was replaced while it read it.
_REPLACED = object()


def _replaced(path: str, ident: int) -> bool:
    """Whether the checkpoint at ``path`` is now another than the one of identity
    ``ident`` (or gone)."""
    try:
        folder = _open_folder(path)
    except CheckpointError:
        return True
    try:
        return folder.ident != ident
    finally:
        folder.close()


def _load_once(comm, state: Any, path: str) -> Any:
    """One try of :func:`load`: the loaded state, or :data:`_REPLACED` (on every rank)
    where the ranks read different checkpoints or a rank's read failed while the checkpoint
    was being replaced. **Collective**."""
    stats = {"path": path, "metadata_bytes": 0, "data_bytes": 0, "needed_bytes": 0}
    opened: list[_Folder] = []

    def plan() -> tuple:
        folder = _open_folder(path)
        opened.append(folder)
        meta = _read_meta(folder)
        stats.update(path=folder.path, metadata_bytes=len(folder.raw))
        by_key = {e["key"]: e for e in meta["tensors"]}
        if state is None:
            return folder, meta, None, None
        _, leaves = _state.flatten(state, "load")
        targets = []
        for key, leaf in leaves:
            if key not in by_key:
                raise CheckpointError(
                    f"load: {key!r} of the state is not in checkpoint {folder.path!r} (it "
                    f"holds {sorted(by_key)[:20]})"
                )
            targets.append(_target_of(by_key[key], leaf, folder.path))
        return folder, meta, leaves, targets

    try:
        folder, meta, leaves, planned = run_agreed(comm, "load", plan)
        idents = comm.allgather_ints([folder.ident], what="load: checkpoint identity")
        if len(set(idents[:, 0].tolist())) != 1:
            return _REPLACED  # read while a save replaced it: every rank sees this
        if state is None:
            new = _materialize(meta, comm, os.path.join(folder.path, META))
            targets = [x[1] for x in new]
        else:
            targets = planned
        error = _fill(folder, meta, targets, stats)
        replaced = np.array([error is not None and _replaced(path, folder.ident)], np.int64)
        comm.allreduce(replaced, op="max", what="load: replaced")
        if replaced[0]:
            return _REPLACED
        agree(comm, error, "load")
    finally:
        for f in opened:
            f.close()
    stats["bytes_read"] = stats["metadata_bytes"] + stats["data_bytes"]
    _last_stats.clear()
    _last_stats.update(stats)
    saved_values = _state.values_by_key(meta["structure"])
    if state is None:
        return _state.build(meta["structure"], [_finish(*x) for x in new])
    scalars = {k: t.dst[()] for (k, leaf), t in zip(leaves, targets)
               if isinstance(leaf, np.generic)}
    _state.replace_values(state, {**saved_values, **scalars})
    return state


def _materialize(meta: dict, comm, where: str) -> list[tuple]:
    """``(kind, target, mesh, placements)`` of each tensor of ``load(path)``, its array new
    (a CheckpointError naming the tensor where it cannot be allocated, on every rank);
    creates the meshes (**Collective**, in the order of first use, the same on every rank:
    the ranks read one metadata)."""
    world_size = comm.size
    meshes: dict = {}
    out = []
    for entry in meta["tensors"]:
        mesh, placements, mesh_shape, coord = None, (), (), ()
        if entry["kind"] == "dtensor":
            saved = tuple(entry["mesh_shape"])
            if math.prod(saved) == world_size:
                names = entry.get("mesh_dim_names")
                key = (saved, None if names is None else tuple(names))
                placements = _placements_of(entry["placements"])
            else:
                key, placements = ((world_size,), None), (Replicate(),)
            if key not in meshes:
                meshes[key] = init_device_mesh(key[0], mesh_dim_names=key[1])
            mesh = meshes[key]
            mesh_shape, coord = mesh.shape, mesh.get_coordinate()
        out.append((entry["kind"], _Target(entry, None, placements, mesh_shape, coord), mesh,
                    placements))

    def allocate() -> None:
        for i, (_, target, _, _) in enumerate(out):
            dtype = dtype_from_name(target.entry["dtype"])
            try:
                target.dst = np.empty(target.lengths, dtype)
            except (MemoryError, ValueError) as e:
                raise CheckpointError(
                    f"load: {where!r}: tensors[{i}] ({target.entry['key']!r}).shape "
                    f"{target.entry['shape']} of {target.entry['dtype']}: this rank's part "
                    f"{list(target.lengths)} ({math.prod(target.lengths) * dtype.itemsize} "
                    f"bytes) cannot be allocated: {type(e).__name__}: {e}"
                ) from None

    run_agreed(comm, "load", allocate)
    return out


def _finish(kind: str, target: _Target, mesh: Any, placements: tuple) -> Any:
    """A loaded leaf of ``load(path)`` in the kind it was saved as."""
    if kind == "dtensor":
        return DTensor.from_local(from_numpy(target.dst), mesh, placements,
                                  shape=tuple(target.entry["shape"]))
    if kind == "tensor":
        return from_numpy(target.dst)
    if kind == "scalar":
        return target.dst[()]
    return target.dst
