"""Checkpoints: :func:`save` and :func:`load` of nested states of DTensors, local tensors,
numpy arrays and python values, resharding on load.

A checkpoint is a folder of two files:

- ``metadata.json`` (readable): the format name and version, the world size and chunk size
  of the save, the state's structure (its python values included) and, per tensor, its
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

Crash safety: a save writes into ``.<name>.dtensor-tmp`` beside the target, syncs the data
(MPI_File_sync), the metadata and the folder, and only after every rank has finished
renames it into place: the previous checkpoint is first renamed to ``.<name>.dtensor-old``,
the new one to ``<name>``, and the old one is removed (each rank removes a share of its data
files). A save killed at any point leaves a loadable checkpoint: :func:`load` reads
``<name>``, or ``.<name>.dtensor-old`` where a crash came between the two renames; a
leftover temporary folder is never read and the next save replaces it.

Loading plans, per rank, which parts of which saved blocks its target shard needs
(:mod:`placements.layout`) and reads only the chunks that hold them, each verified against
its checksum; :func:`last_load_stats` reports the bytes this rank read.

Private test hook: with ``_DTENSOR_CHECKPOINT_KILL_RANK=r`` in the environment, rank ``r``
of a save kills itself (SIGKILL) right after writing its first block, to test that a save
killed mid-write leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
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
    box,
    dtype_from_name,
    dtype_name,
    fsync_path,
    reduce_partial,
    run_agreed,
    sibling,
    writer_coords,
)

__all__ = ["last_load_stats", "load", "save"]

FORMAT = "dtensor-checkpoint"
VERSION = 1
#: Checksum algorithms a checkpoint may name (``metadata.json``'s ``checksum``; each block
#: keeps its chunks' digests under that name) -> the digest of a buffer as an int.
CHECKSUMS = {"xxh3_64": xxhash.xxh3_64_intdigest, "crc32": zlib.crc32}
#: The algorithm a save uses: XXH3-64 runs about 7x faster than zlib's CRC-32 here.
CHECKSUM = "xxh3_64"
META = "metadata.json"
#: The data file of the blocks that world rank ``r`` writes: ``DATA.format(r)``.
DATA = "data-{:05d}.bin"
#: Default bytes per checksum chunk: a rank that needs part of a block reads whole chunks.
CHUNK_BYTES = 1 << 22
#: Blocks start at multiples of this many bytes in the data file.
ALIGN = 64
_KILL_ENV = "_DTENSOR_CHECKPOINT_KILL_RANK"

_last_stats: dict[str, Any] = {}


def _placements_of(texts: Sequence[str]) -> tuple:
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


def _prepare_dir(path: str, tmp: str) -> None:
    """Rank 0: refuse to overwrite what is not a checkpoint; a fresh temporary folder."""
    if os.path.lexists(path) and not (
        os.path.isdir(path) and (not os.listdir(path) or os.path.isfile(os.path.join(path, META)))
    ):
        raise CheckpointError(
            f"save: {path!r} exists and is not a dtensor checkpoint (no {META}); refusing to "
            "replace it"
        )
    if os.path.lexists(tmp):
        shutil.rmtree(tmp)  # a save that did not finish
    os.mkdir(tmp)


def _commit(path: str, tmp: str, meta: dict, sync: bool) -> None:
    """Rank 0: write (and sync) the metadata, then swap the folders (see the module doc);
    the previous checkpoint is left at ``.<name>.dtensor-old``, for the ranks to remove."""
    meta_path = os.path.join(tmp, META)
    with open(meta_path, "w") as fh:
        json.dump(meta, fh, indent=1)
        if sync:
            fh.flush()
            os.fsync(fh.fileno())
    if sync:
        fsync_path(tmp, directory=True)
    old = sibling(path, "old")
    if os.path.isdir(path):
        if os.path.lexists(old):
            shutil.rmtree(old)  # a swap that finished all but this removal: path is good
        os.rename(path, old)
    os.rename(tmp, path)
    if sync:
        fsync_path(os.path.dirname(path), directory=True)


def _share(folder: str, rank: int, size: int) -> list[str]:
    """This rank's share of the data files of checkpoint ``folder`` (none where it does not
    exist): those of writer ranks ``rank``, ``rank + size``, ..."""
    if not os.path.isdir(folder):
        return []
    out = []
    for name in os.listdir(folder):
        writer = re.fullmatch(r"data-(\d+)\.bin", name)
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
            fd = os.open(name, os.O_RDONLY)
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
    one is complete (see the module documentation).

    Parameters
    ----------
    state : dict, list, tuple, DTensor, Tensor, ndarray or python value
        Nested dicts (str keys), lists and tuples of DTensors, local Tensors, numpy arrays
        and scalars, and python values (None, bool, int, float, str).
    path : str or os.PathLike
        The checkpoint folder (created or replaced; its parent must exist).
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
        The ranks pass different structures, ``path`` exists and is not a checkpoint, or a
        file cannot be written.
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
    tmp = sibling(path, "tmp")
    run_agreed(comm, "save", lambda: comm.rank == 0 and _prepare_dir(path, tmp))
    # each chunk's checksum is set by its writer (the 64 bits as an int64), then summed
    sums = np.zeros(chunks, np.uint64)
    error, fh = None, None
    try:
        _uncache(_share(path, comm.rank, comm.size))
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
        files: dict[str, int] = {}
        for block in (b for e in entries for b in e["blocks"]):
            files[block["file"]] = max(files.get(block["file"], 0), block["offset"] + block["nbytes"])
        meta = {
            "format": FORMAT, "version": VERSION, "world_size": comm.size,
            "chunk_bytes": chunk_bytes, "checksum": CHECKSUM, "files": files,
            "structure": skeleton, "tensors": entries,
        }
    run_agreed(comm, "save", lambda: comm.rank == 0 and _commit(path, tmp, meta, sync))
    old = sibling(path, "old")
    # freeing a file's blocks takes time in proportion to its size: the ranks share it
    run_agreed(comm, "save", lambda: _remove(_share(old, comm.rank, comm.size)))
    run_agreed(comm, "save", lambda: comm.rank == 0 and os.path.lexists(old)
               and shutil.rmtree(old))


def _resolve(path: str) -> str:
    """The folder to read: ``path``, or its previous version where a save was killed
    between its two renames."""
    for folder in (path, sibling(path, "old")):
        if os.path.isfile(os.path.join(folder, META)):
            return folder
    raise CheckpointError(f"load: no checkpoint at {path!r} (no {META} there)")


def _read_meta(folder: str) -> tuple[dict, int]:
    meta_path = os.path.join(folder, META)
    with open(meta_path, "rb") as fh:
        raw = fh.read()
    try:
        meta = json.loads(raw)
    except ValueError as e:
        raise CheckpointError(f"load: {meta_path!r} is not valid JSON: {e}") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(
            f"load: {meta_path!r} holds format {meta.get('format')!r} version "
            f"{meta.get('version')!r}; this dtensor reads {FORMAT!r} version {VERSION}"
        )
    if meta.get("checksum") not in CHECKSUMS:
        raise CheckpointError(
            f"load: {meta_path!r} names checksum {meta.get('checksum')!r}; this dtensor "
            f"verifies {sorted(CHECKSUMS)}"
        )
    return meta, len(raw)


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


def _read_block_part(fh: File, target: _Target, block: dict, chunk: int, algorithm: str,
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
        got = digest(mv[i * chunk : (i + 1) * chunk])
        if got != stored[c]:
            raise CheckpointError(
                f"load: checksum mismatch in {where}, chunk {c}: stored {algorithm} "
                f"{stored[c]:#x}, read {got:#x} (checkpoint {folder!r})"
            )
    if not direct:
        region[...] = np.ndarray(sub, dtype, buf, first - r0, strides)


def _fill(comm, folder: str, meta: dict, targets: list[_Target], stats: dict) -> None:
    """Fill every target from the data files this rank needs (each opened by this rank
    alone). **Collective**: the ranks agree on the errors at the end."""
    chunk = int(meta["chunk_bytes"])
    by_file: dict[str, list] = {}
    for t in targets:
        for block in t.entry["blocks"] if t.fill is None else ():  # else it holds no data
            by_file.setdefault(block["file"], []).append((t, block))
    error = None
    try:
        for name, parts in sorted(by_file.items()):
            _read_file(os.path.join(folder, name), meta, parts, chunk, stats)
    except LOCAL_ERRORS as e:
        error = e
    agree(comm, error, "load")
    for t in targets:
        if t.fill is not None:
            t.dst[...] = t.fill


def _read_file(path: str, meta: dict, parts: list, chunk: int, stats: dict) -> None:
    """Read the ``(target, block)`` parts of one data file."""
    name = os.path.basename(path)
    held = sorted({e["key"] for e in meta["tensors"] for b in e["blocks"] if b["file"] == name})
    try:
        fh = File(None, path, "r", "load")
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
            _read_block_part(fh, t, block, chunk, meta["checksum"], os.path.dirname(path),
                             stats)
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
    hold its target shards; each chunk read is verified (see :func:`last_load_stats`).

    Parameters
    ----------
    state : dict, list, tuple or tensor, optional
        The state to fill (its structure as for :func:`save`; it may hold a subset of the
        checkpoint's keys). Pass the path alone to get the saved state.
    path : str or os.PathLike
        The checkpoint folder.

    Raises
    ------
    CheckpointError
        No checkpoint at ``path``; a missing, truncated or corrupt file (naming the file and
        the tensor); a key of ``state`` that the checkpoint lacks.
    ShardingError, DTypeError
        A tensor of ``state`` whose shape or dtype differs from the saved one.
    """
    if path is None:
        state, path = None, state
    comm = world()
    path = os.path.abspath(os.fspath(path))
    stats = {"path": path, "metadata_bytes": 0, "data_bytes": 0, "needed_bytes": 0}

    def plan() -> tuple:
        folder = _resolve(path)
        meta, nbytes = _read_meta(folder)
        stats.update(path=folder, metadata_bytes=nbytes)
        by_key = {e["key"]: e for e in meta["tensors"]}
        if state is None:
            return folder, meta, None, None
        _, leaves = _state.flatten(state, "load")
        targets = []
        for key, leaf in leaves:
            if key not in by_key:
                raise CheckpointError(
                    f"load: {key!r} of the state is not in checkpoint {folder!r} (it holds "
                    f"{sorted(by_key)[:20]})"
                )
            targets.append(_target_of(by_key[key], leaf, folder))
        return folder, meta, leaves, targets

    folder, meta, leaves, planned = run_agreed(comm, "load", plan)
    new = _materialize(meta, comm.size) if state is None else None
    targets = [x[1] for x in new] if state is None else planned
    _fill(comm, folder, meta, targets, stats)
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


def _materialize(meta: dict, world_size: int) -> list[tuple]:
    """``(kind, target, mesh, placements)`` of each tensor of ``load(path)``, its array new; creates
    the meshes (**Collective**, in the order of first use, the same on every rank)."""
    meshes: dict = {}
    out = []
    for entry in meta["tensors"]:
        mesh, placements, mesh_shape, coord = None, (), (), ()
        if entry["kind"] == "dtensor":
            saved = tuple(entry["mesh_shape"])
            if int(np.prod(saved)) == world_size:
                names = entry["mesh_dim_names"]
                key = (saved, None if names is None else tuple(names))
                placements = _placements_of(entry["placements"])
            else:
                key, placements = ((world_size,), None), (Replicate(),)
            if key not in meshes:
                meshes[key] = init_device_mesh(key[0], mesh_dim_names=key[1])
            mesh = meshes[key]
            mesh_shape, coord = mesh.shape, mesh.get_coordinate()
        target = _Target(entry, None, placements, mesh_shape, coord)
        target.dst = np.empty(target.lengths, dtype_from_name(entry["dtype"]))
        out.append((entry["kind"], target, mesh, placements))
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
