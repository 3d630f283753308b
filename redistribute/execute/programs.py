"""Redistribute programs: each step of a plan compiled, for one (plan, source spec,
coordinate), into a runner that moves this rank's data.

This module owns the data movement of :func:`redistribute.plan.plan`'s steps: for every
step it computes from the layout math which block of the local shard goes to which peer
and where the blocks from the peers land (:class:`Slab`), then moves the data with the
buffer-based collectives of :mod:`redistribute.comm` (as bytes; reductions typed). A runner
has ``run(x, owned, comm, alloc) -> (output, owned)`` (``owned``: the output is a buffer of
this execution, not the caller's input, which later steps may overwrite) and, for the
communicating steps, ``start`` (the same as one MPI nonblocking collective).

- Uneven and empty shards use exact per-peer counts (no padding).
- Outputs, pack and staging buffers come from the caller's allocator.
- LocalChunk returns a view of its input and PartitionPartial the input itself (or the
  op's identity); nothing is copied.
- AllGather of an output up to ``_MAX_ALLGATHER_BYTES`` is one MPI all-gather (lowest
  latency), through a persistent request while persistent all-gathers are on
  (``redistribute.comm.HOOKS.persistent``). Larger gathers and every AllToAll are a peer
  exchange: the own block is copied locally and the peers' blocks move with one
  ``Alltoallw``: with MPICH it beats ``Allgather`` on large blocks and by far
  ``Allgatherv`` on uneven ones.
- A contiguous input is sent in place. Blocks to send that are not contiguous (a shard
  dim other than the outermost, or any non-contiguous input such as a transposed view) are
  packed with one numpy copy each: faster than derived send types.
- Blocks received into a non-contiguous place land there through a derived datatype (no
  unpack copy), unless their contiguous runs are shorter than ``_MIN_TYPED_RUN`` bytes:
  MPI handles tiny runs slower than numpy, so such blocks are staged and unpacked with one
  numpy copy each.
- Ranks on one node read each other's data directly (:mod:`redistribute.execute.shared`):
  for a global tensor of at least ``DTENSOR_SHM_MIN_BYTES`` (1 MiB), when every rank's
  input lives in a shared segment of the allocator, an exchange copies each peer's block
  (any strides) straight from the peer's memory into its output, a reduce-scatter reduces
  its slab of every rank's input, and an all-reduce is a reduce-scatter into the outputs
  followed by direct reads of the peers' reduced chunks. No pack is needed, so fewer bytes
  move than through MPI.
- A reduction of a dtype MPI has no datatype for (bfloat16,
  :data:`redistribute.comm.reduce.WIDENED`) runs the float32 program of its step on a widened
  copy and rounds the result once (:class:`WidenedRunner`), on every path (MPI, nonblocking,
  shared memory); the compiled executor leaves it to this one.
- The figures behind these choices are in ``BENCHMARKS.md`` (Redistribute).
- Programs are kept in a bounded cache (:data:`PROGRAMS`, ``redistribute.programs``,
  oldest first out): evicted or cleared programs free their datatypes, and the rest are
  freed at exit.
"""

from __future__ import annotations

import atexit
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from placements.cache import LRUCache
from placements.errors import ShardingError
from placements.layout import local_offsets, local_shape, partial_fill
from placements.types import short_placements

from .. import comm as _comm
from .. import worker as _worker
from ..comm.reduce import WIDENED, reduction
from ..plan import AllGather, AllReduce, AllToAll, LocalChunk, PartitionPartial, ReduceScatter
from .shared import peer_array, reduce_into, shared_table, shares, tally, tries_shared

__all__ = [
    "PROGRAMS",
    "AllReduceRunner",
    "Alloc",
    "ExchangeRunner",
    "LocalRunner",
    "ReduceScatterRunner",
    "Slab",
    "WidenedRunner",
    "contiguous",
    "copy",
    "get_program",
]

Alloc = Callable[[tuple, np.dtype], np.ndarray]

# Non-contiguous receive blocks with contiguous runs shorter than this (bytes) are staged
# and unpacked with numpy instead of received through a derived datatype.
_MIN_TYPED_RUN = 256

# Gathers up to this many bytes (output) use MPI's all-gather (lowest latency); larger ones
# exchange blocks peer to peer with an alltoallw, which MPICH runs about 2x faster than its
# Allgather at 16 MiB and far faster than its Allgatherv for uneven blocks.
_MAX_ALLGATHER_BYTES = 1 << 16


# -- geometry -----------------------------------------------------------------------------


class Slab:
    """Elements ``[start, start + n)`` along ``dim`` of a C-contiguous array of ``shape``."""

    __slots__ = ("contiguous", "index", "offset", "pre", "row", "run", "shape", "size")

    def __init__(self, shape: tuple, dim: int, start: int, n: int, itemsize: int) -> None:
        pre = math.prod(shape[:dim])
        post = math.prod(shape[dim + 1 :])
        self.index = (slice(None),) * dim + (slice(start, start + n),)
        self.shape = shape[:dim] + (n,) + shape[dim + 1 :]
        self.offset = start * post * itemsize  # bytes from the array's start
        self.size = pre * n * post  # elements
        self.contiguous = self.size == 0 or pre == 1 or n == shape[dim]
        self.pre = pre
        self.run = n * post * itemsize  # bytes per contiguous piece
        self.row = shape[dim] * post * itemsize  # bytes between pieces


def _region(spec: Any, placements: Sequence[Any], coord: tuple) -> tuple[tuple, tuple]:
    """(global offsets, shape) of the block that ``coord`` holds under ``placements``."""
    return (
        local_offsets(spec.shape, spec.mesh_shape, placements, coord),
        local_shape(spec.shape, spec.mesh_shape, placements, coord),
    )


def _peers(coord: tuple, m: int, k: int) -> list[tuple]:
    return [coord[:m] + (j,) + coord[m + 1 :] for j in range(k)]


def _piece(spec: Any, dim: int, outer: tuple, inner: tuple) -> tuple[int, int]:
    """(start, length) along ``dim`` of the ``inner`` (placements, coord) block inside the
    ``outer`` one."""
    o_off, _ = _region(spec, *outer)
    off, shape = _region(spec, *inner)
    return off[dim] - o_off[dim], shape[dim]


def _pieces(spec: Any, step: Any, dim: int, outer: tuple, inner: list[tuple]) -> list[tuple]:
    """:func:`_piece` of each ``inner`` block; checks that they tile the outer block in order."""
    pieces = [_piece(spec, dim, outer, block) for block in inner]
    ends = [s + n for s, n in pieces]
    extent = _region(spec, *outer)[1][dim]
    if [s for s, _ in pieces] != [0] + ends[:-1] or ends[-1] != extent:
        raise ShardingError(
            f"redistribute: step {step!r} of {spec!r}: the blocks {pieces} along tensor dim "
            f"{dim} do not tile the local extent {extent}"
        )
    return pieces


# -- step runners -------------------------------------------------------------------------
# A runner is compiled for one (step, source spec, coordinate); run(x, owned, comm, alloc)
# returns (output, owned) where ``owned`` says the output is a buffer of this execution
# (not the caller's input), which later steps may overwrite.


class ExchangeRunner:
    """Peer ``j`` gets ``x[send[j]]`` and this rank gets peer ``j``'s block in ``out[recv[j]]``
    (AllGather: every peer gets all of ``x``; AllToAll: one slab each). ``run`` and
    ``start`` are **Collective** over the mesh dim's communicator."""

    __slots__ = (
        "direct", "direct_displs", "gather_counts", "in_shape", "kind", "mesh_dim",
        "out_shape", "pack", "pack_displs", "peers", "pulls", "rcounts", "rdispls", "recv",
        "rtypes", "scounts", "self_recv", "self_send", "send", "stage_len", "stypes", "types",
        "unstage", "what",
    )  # fmt: skip

    def __init__(
        self,
        mesh_dim: int,
        me: int,
        in_shape: tuple,
        out_shape: tuple,
        itemsize: int,
        send: list[Slab],
        recv: list[Slab],
        gather: bool,
        pulls: list[tuple] | None = None,
    ) -> None:
        self.mesh_dim, self.in_shape, self.out_shape = mesh_dim, in_shape, out_shape
        # (peer, peer's input shape, index of its block for this rank in that input, where
        # the block lands in the output): the shared-memory exchange, or None
        self.pulls = pulls
        self.kind = "all_gather" if gather else "all_to_all"
        self.types: list[Any] = []
        self.send, self.recv = send, recv  # the slabs (for compiled_form)
        self.self_send, self.self_recv = send[me].index, recv[me].index
        peers = [j for j in range(len(send)) if j != me]
        self.peers = bool(peers)
        # A small gather is one MPI all-gather (rank-ordered blocks: straight into the
        # output when they are contiguous there, else staged). Other exchanges are an
        # alltoallw over the peers, the own block being copied locally.
        small = gather and math.prod(out_shape) * itemsize <= _MAX_ALLGATHER_BYTES
        staged = self._plan_staging(recv, peers, small)
        self.gather_counts = [s.size for s in recv] if small else None
        if small:
            self.pulls = None
            return
        self._plan_sends(send, me, peers, itemsize)
        self._plan_receives(recv, peers, staged, itemsize)

    def _plan_staging(self, recv: list[Slab], peers: list[int], small: bool) -> bool:
        """Whether received blocks land in a staging buffer, to be unpacked with numpy: all
        blocks of a small gather unless every one is contiguous in the output; the peers'
        blocks of an alltoallw when a strided one has runs shorter than ``_MIN_TYPED_RUN``.
        Sets ``unstage`` (output index, start, stop, shape of each staged block) and
        ``stage_len`` (elements of the staging buffer; None without staging)."""
        if small:
            staged = not all(s.contiguous for s in recv)
            staged_blocks = range(len(recv)) if staged else ()
        else:
            runs = [recv[j].run for j in peers if not recv[j].contiguous]
            staged = bool(runs) and min(runs) < _MIN_TYPED_RUN
            staged_blocks = peers if staged else ()
        self.unstage, pos = [], 0
        for j in staged_blocks:
            s = recv[j]
            self.unstage.append((s.index, pos, pos + s.size, s.shape))
            pos += s.size
        self.stage_len = pos if staged else None
        return staged

    def _plan_sends(self, send: list[Slab], me: int, peers: list[int], itemsize: int) -> None:
        """The alltoallw's sends: byte counts (nothing to this rank), and two sources: the
        input itself at ``direct_displs`` (``direct``: every peer's slab is contiguous; used
        when the input is C-contiguous), else a pack buffer holding each distinct slab once
        (``pack``: input index, start, stop and shape of each; ``pack_displs``)."""
        self.scounts = [s.size * itemsize if j != me else 0 for j, s in enumerate(send)]
        self.stypes = [_comm.BYTES] * len(send)
        self.direct = all(send[j].contiguous for j in peers)
        self.direct_displs = [s.offset for s in send]
        self.pack, self.pack_displs, packed, pos = [], [0] * len(send), {}, 0
        for j in peers:
            s = send[j]
            if (s.offset, s.size) not in packed:
                self.pack.append((s.index, pos, pos + s.size, s.shape))
                packed[s.offset, s.size] = pos
                pos += s.size
            self.pack_displs[j] = packed[s.offset, s.size] * itemsize

    def _plan_receives(
        self, recv: list[Slab], peers: list[int], staged: bool, itemsize: int
    ) -> None:
        """The alltoallw's receives (``rcounts``, ``rdispls``, ``rtypes``): into the staging
        buffer, else in place when contiguous, else through a derived datatype (kept in
        ``types`` to be freed with the program)."""
        self.rcounts, self.rdispls = [0] * len(recv), [0] * len(recv)
        self.rtypes = [_comm.BYTES] * len(recv)
        for j, (_, start, _, _) in zip(peers, self.unstage):
            self.rcounts[j], self.rdispls[j] = recv[j].size * itemsize, start * itemsize
        for j in peers if not staged else ():
            s = recv[j]
            if s.contiguous:
                self.rcounts[j], self.rdispls[j] = s.size * itemsize, s.offset
            else:
                # the slab as (pre) runs of (run) bytes, one every (row) bytes
                count, dtype = _comm.block_type((s.pre, s.run), (s.row, 1), 1)
                self.rcounts[j], self.rdispls[j], self.rtypes[j] = count, s.offset, dtype
                self.types.append(dtype)

    def run(self, x: np.ndarray, owned: bool, comm: _comm.Comm, alloc: Alloc) -> tuple:
        out = alloc(self.out_shape, x.dtype)
        if self.pulls is not None and type(x) is np.ndarray and shares(comm):
            ok = self._run_shared(x, out, comm)
            if tally(comm, self.kind, ok, max(x.nbytes, out.nbytes)):
                return out, True
        rbuf = out if self.stage_len is None else alloc((self.stage_len,), x.dtype)
        self._mpi(x, out, rbuf, comm, alloc, False)
        if self.unstage:
            self._unstage(out, rbuf)
        return out, True

    def start(self, x: np.ndarray, owned: bool, comm: _comm.Comm, alloc: Alloc) -> tuple:
        """The MPI path of :meth:`run` as one nonblocking collective: ``(output, request,
        finish)``: ``finish`` (None or a callable) completes the output once the request has
        completed."""
        out = alloc(self.out_shape, x.dtype)
        rbuf = out if self.stage_len is None else alloc((self.stage_len,), x.dtype)
        request = self._mpi(x, out, rbuf, comm, alloc, True)
        if self.unstage:
            return out, request, lambda: self._unstage(out, rbuf)
        return out, request, None

    def _mpi(
        self,
        x: np.ndarray,
        out: np.ndarray,
        rbuf: np.ndarray,
        comm: _comm.Comm,
        alloc: Alloc,
        start: bool,
    ) -> Any:
        """The exchange by MPI into ``rbuf`` (the output, or the staging buffer); with
        ``start`` nonblocking, returning its request (a small gather is then never
        persistent: a persistent request is started only once at a time)."""
        if self.gather_counts is not None:
            send = contiguous(x, alloc)
            if _comm.HOOKS.persistent and not start and type(comm) is _comm.Comm:  # host buffers
                comm.allgather_persistent(send, rbuf, self.gather_counts, self.what)
                return None
            return comm.allgatherv(send, rbuf, self.gather_counts, None, self.what, start)
        copy(out[self.self_recv], x[self.self_send])
        if not self.peers:
            return None
        if self.direct and x.flags.c_contiguous:
            sbuf, sdispls = x, self.direct_displs
        else:
            sbuf, sdispls = alloc((self.pack[-1][2],), x.dtype), self.pack_displs
            for index, begin, stop, shape in self.pack:
                copy(sbuf[begin:stop].reshape(shape), x[index])
        return comm.alltoallw(
            sbuf, self.scounts, sdispls, self.stypes,
            rbuf, self.rcounts, self.rdispls, self.rtypes,
            self.kind, self.what, max(x.nbytes, out.nbytes), start,
        )  # fmt: skip

    def _unstage(self, out: np.ndarray, rbuf: np.ndarray) -> np.ndarray:
        """Copy the staged blocks of ``rbuf`` to their places in ``out``; returns ``out``."""
        for index, begin, stop, shape in self.unstage:
            copy(out[index], rbuf[begin:stop].reshape(shape))
        return out

    def _run_shared(self, x: np.ndarray, out: np.ndarray, comm: _comm.Comm) -> bool:
        """Copy every peer's block straight out of its shared segment. **Collective**.

        Unless every rank's input is in a shared segment (or empty) all ranks return False
        and take the MPI path. After copying, no rank returns before every rank has finished
        reading (a rank that could not map a peer makes them all return False, and the MPI
        path then rewrites the output)."""
        copy(out[self.self_recv], x[self.self_send])  # first: while the peers catch up
        table = shared_table(comm, (x,), self.kind, self.what)
        if table is None:
            return False
        read = True
        for j, shape, index, dst in self.pulls:
            if out[dst].size == 0:
                continue
            src = peer_array(table[j], 0, shape, x.dtype)
            if src is None:
                read = False
                break
            np.copyto(out[dst], src[index])
        return comm.all_true(read, self.what)


class ReduceScatterRunner:
    """Reduce over the mesh dim; peer ``j`` keeps the ``j``-th slab along one tensor dim.
    ``run`` and ``start`` are **Collective** over the mesh dim's communicator."""

    __slots__ = (
        "counts", "direct", "in_shape", "mesh_dim", "op", "out_shape", "pack", "send", "shared",
        "types", "what",
    )  # fmt: skip

    def __init__(
        self,
        mesh_dim: int,
        in_shape: tuple,
        out_shape: tuple,
        send: list[Slab],
        op: str,
        shared: bool = False,
    ) -> None:
        self.mesh_dim, self.in_shape, self.out_shape, self.op = mesh_dim, in_shape, out_shape, op
        self.shared = shared  # try the shared-memory path
        self.types: list[Any] = []
        self.counts = [s.size for s in send]
        self.send = send  # the slabs (for compiled_form)
        # slabs tile the input in rank order: a C-contiguous input is already the send buffer
        # when every slab is contiguous
        self.direct = all(s.contiguous for s in send)
        starts = np.concatenate(([0], np.cumsum(self.counts, dtype=np.int64))).tolist()
        self.pack = [(s.index, starts[j], starts[j + 1], s.shape) for j, s in enumerate(send)]

    def run(self, x: np.ndarray, owned: bool, comm: _comm.Comm, alloc: Alloc) -> tuple:
        if self.shared and type(x) is np.ndarray:
            reduction(x.dtype, self.op, "reduce_scatter", self.what)  # refuse bad pairs
            if shares(comm):
                out = alloc(self.out_shape, x.dtype)
                if tally(comm, "reduce_scatter", self._run_shared(x, out, comm), x.nbytes):
                    return out, True
        sbuf = x if self.direct and x.flags.c_contiguous else self._pack(x, alloc)
        out = alloc(self.out_shape, x.dtype)
        comm.reduce_scatter(sbuf, out, self.counts, self.op, self.what)
        return out, True

    def start(self, x: np.ndarray, owned: bool, comm: _comm.Comm, alloc: Alloc) -> tuple:
        """The MPI path of :meth:`run` as one nonblocking collective (see
        :meth:`ExchangeRunner.start`)."""
        sbuf = x if self.direct and x.flags.c_contiguous else self._pack(x, alloc)
        out = alloc(self.out_shape, x.dtype)
        request = comm.reduce_scatter(sbuf, out, self.counts, self.op, self.what, True)
        return out, request, _averager(self.op, out, comm.size)

    def _pack(self, x: np.ndarray, alloc: Alloc) -> np.ndarray:
        """The slabs of ``x`` packed in rank order into a buffer of ``alloc`` (the send
        buffer unless ``x`` is C-contiguous and its slabs are)."""
        sbuf = alloc((self.pack[-1][2],), x.dtype)
        for index, start, stop, shape in self.pack:
            copy(sbuf[start:stop].reshape(shape), x[index])
        return sbuf

    def _run_shared(self, x: np.ndarray, out: np.ndarray, comm: _comm.Comm) -> bool:
        """Reduce this rank's slab of every rank's input, read from the shared segments.
        **Collective**; False (on every rank) when the MPI path must run instead."""
        table = shared_table(comm, (x,), "reduce_scatter", self.what, f"{x.dtype}, op {self.op}")
        if table is None:
            return False
        index = self.pack[comm.rank][0]
        views = [x if j == comm.rank else peer_array(table[j], 0, x.shape, x.dtype)
                 for j in range(comm.size)]  # fmt: skip
        read = all(v is not None for v in views)
        if read and out.size:
            reduce_into(out, [v[index] for v in views], self.op, comm.size)  # rank order
        return comm.all_true(read, self.what)


class AllReduceRunner:
    """Reduce over the mesh dim; every peer gets the result (in place on owned buffers).
    ``run`` and ``start`` are **Collective** over the mesh dim's communicator."""

    __slots__ = ("in_shape", "mesh_dim", "op", "out_shape", "shared", "types", "what")

    def __init__(self, mesh_dim: int, shape: tuple, op: str, shared: bool = False) -> None:
        self.mesh_dim, self.in_shape, self.out_shape, self.op = mesh_dim, shape, shape, op
        self.shared = shared  # try the shared-memory path
        self.types: list[Any] = []

    def run(self, x: np.ndarray, owned: bool, comm: _comm.Comm, alloc: Alloc) -> tuple:
        if self.shared and type(x) is np.ndarray:
            reduction(x.dtype, self.op, "all_reduce", self.what)  # refuse bad pairs
            if shares(comm):
                if not x.flags.c_contiguous:
                    x, owned = contiguous(x, alloc), True
                out = x if owned else alloc(x.shape, x.dtype)
                if tally(comm, "all_reduce", self._run_shared(x, out, comm), x.nbytes):
                    return out, True
        if x.flags.c_contiguous:
            if owned:
                comm.allreduce(x, None, self.op, self.what)
                return x, True
            out = alloc(x.shape, x.dtype)
            comm.allreduce(x, out, self.op, self.what)
            return out, True
        out = alloc(x.shape, x.dtype)
        copy(out, x)
        comm.allreduce(out, None, self.op, self.what)
        return out, True

    def start(self, x: np.ndarray, owned: bool, comm: _comm.Comm, alloc: Alloc) -> tuple:
        """The MPI path of :meth:`run` as one nonblocking collective (see
        :meth:`ExchangeRunner.start`): in place on an owned C-contiguous input, else into a new
        buffer."""
        if not x.flags.c_contiguous:
            x, owned = contiguous(x, alloc), True
        out = x if owned else alloc(x.shape, x.dtype)
        request = comm.allreduce(x, None if owned else out, self.op, self.what, True)
        return out, request, _averager(self.op, out, comm.size)

    def _run_shared(self, x: np.ndarray, out: np.ndarray, comm: _comm.Comm) -> bool:
        """All-reduce through the shared segments of C-contiguous ``x`` and ``out`` (which
        may be ``x``). **Collective**; False (on every rank, nothing written) when the MPI
        path must run instead.

        The flat range is cut into one chunk per rank; each rank reduces its chunk of every
        input into its output, and after a barrier copies the other chunks from the peers'
        outputs (reduce-scatter, then all-gather, both by direct reads). Every rank ends
        with the same bits, each chunk being reduced once, in rank order."""
        detail = f"{x.size} x {x.dtype}, op {self.op}"
        table = shared_table(comm, (x, out), "all_reduce", self.what, detail)
        if table is None:
            return False
        k, me = comm.size, comm.rank
        peers = [(None, None) if j == me else (
            peer_array(table[j], 0, x.shape, x.dtype), peer_array(table[j], 1, x.shape, x.dtype))
            for j in range(k)]  # fmt: skip
        mapped = all(a is not None and b is not None for j, (a, b) in enumerate(peers) if j != me)
        if not comm.all_true(mapped, self.what):
            return False
        n = x.size
        bounds = [n * i // k for i in range(k + 1)]
        mine = slice(bounds[me], bounds[me + 1])
        flat = [x.reshape(-1) if j == me else peers[j][0].reshape(-1) for j in range(k)]
        flat_out = out.reshape(-1)
        if bounds[me + 1] > bounds[me]:
            order = [me] + [j for j in range(k) if j != me]  # out may be x: own part first
            reduce_into(flat_out[mine], [flat[j][mine] for j in order], self.op, k)
        comm.all_true(True, self.what)  # every chunk reduced
        for j in range(k):
            if j != me and bounds[j + 1] > bounds[j]:
                chunk = slice(bounds[j], bounds[j + 1])
                np.copyto(flat_out[chunk], peers[j][1].reshape(-1)[chunk])
        comm.all_true(True, self.what)  # every peer has read this rank's chunk
        return True


def _averager(op: str, out: np.ndarray, k: int) -> Callable[[], Any] | None:
    """The finishing step of a nonblocking reduction into ``out`` over ``k`` ranks: an avg
    (run by MPI as a sum) is divided by ``k``; other ops need none."""
    if op != "avg":
        return None
    return lambda: np.divide(out, k, out=out)


class WidenedRunner:
    """A reducing step on data of a dtype MPI cannot reduce (bfloat16): ``inner``, the
    step's runner for the wider dtype (float32), runs on a widened copy of the input, and
    its result is rounded to the dtype once. ``run`` and ``start`` are **Collective** over
    the mesh dim's communicator, as ``inner``'s."""

    __slots__ = ("dtype", "in_shape", "inner", "mesh_dim", "out_shape", "shared", "types",
                 "what")  # fmt: skip

    def __init__(self, inner: Any, dtype: np.dtype) -> None:
        self.inner, self.dtype, self.what = inner, dtype, inner.what
        self.mesh_dim, self.in_shape, self.out_shape = (
            inner.mesh_dim, inner.in_shape, inner.out_shape)  # fmt: skip
        self.shared, self.types = inner.shared, inner.types

    def _widened(self, x: np.ndarray, alloc: Alloc) -> np.ndarray:
        wide = alloc(x.shape, WIDENED[self.dtype])
        copy(wide, x)
        return wide

    def run(self, x: np.ndarray, owned: bool, comm: _comm.Comm, alloc: Alloc) -> tuple:
        wide, _ = self.inner.run(self._widened(x, alloc), True, comm, alloc)
        out = alloc(self.out_shape, self.dtype)
        np.copyto(out, wide, casting="unsafe")
        return out, True

    def start(self, x: np.ndarray, owned: bool, comm: _comm.Comm, alloc: Alloc) -> tuple:
        """The inner step's nonblocking start; completing it rounds into the output."""
        wide, request, complete = self.inner.start(self._widened(x, alloc), True, comm, alloc)
        out = alloc(self.out_shape, self.dtype)

        def finish() -> None:
            if complete is not None:
                complete()
            np.copyto(out, wide, casting="unsafe")

        return out, request, finish


class LocalRunner:
    """A step without communication: a view of the input (LocalChunk), the input itself
    (PartitionPartial on a holder) or the op's identity (PartitionPartial on a non-holder).
    ``run`` is **Local**."""

    __slots__ = ("fill", "in_shape", "index", "mesh_dim", "out_shape", "types")

    def __init__(
        self,
        mesh_dim: int,
        in_shape: tuple,
        out_shape: tuple,
        index: tuple | None,
        fill: int | None,
    ) -> None:
        self.mesh_dim, self.in_shape, self.out_shape = mesh_dim, in_shape, out_shape
        self.index, self.fill, self.types = index, fill, []

    def run(self, x: np.ndarray, owned: bool, comm: _comm.Comm, alloc: Alloc) -> tuple:
        if self.fill is None:
            return (x if self.index is None else x[self.index]), owned
        out = alloc(self.out_shape, x.dtype)
        out.fill(self.fill)
        return out, True


# -- compiling steps ----------------------------------------------------------------------


def _compile_all_gather(step: Any, spec: Any, coord: tuple, isz: int) -> ExchangeRunner:
    m, d = step.mesh_dim, step.tensor_dim
    k = spec.mesh_shape[m]
    peers = _peers(coord, m, k)
    _, in_shape = _region(spec, step.before, coord)
    _, out_shape = _region(spec, step.after, coord)
    pieces = _pieces(spec, step, d, (step.after, coord), [(step.before, p) for p in peers])
    send = [Slab(in_shape, d, 0, in_shape[d], isz)] * k
    recv = [Slab(out_shape, d, s, n, isz) for s, n in pieces]
    pulls = None
    if tries_shared(spec, isz):
        pulls = [
            (j, _region(spec, step.before, p)[1], Ellipsis, recv[j].index)
            for j, p in enumerate(peers)
            if j != coord[m]
        ]
    return ExchangeRunner(m, coord[m], in_shape, out_shape, isz, send, recv, True, pulls)


def _compile_all_to_all(step: Any, spec: Any, coord: tuple, isz: int) -> ExchangeRunner:
    m, src, dst = step.mesh_dim, step.src_dim, step.dst_dim
    peers = _peers(coord, m, spec.mesh_shape[m])
    _, in_shape = _region(spec, step.before, coord)
    _, out_shape = _region(spec, step.after, coord)
    sends = _pieces(spec, step, dst, (step.before, coord), [(step.after, p) for p in peers])
    recvs = _pieces(spec, step, src, (step.after, coord), [(step.before, p) for p in peers])
    send = [Slab(in_shape, dst, s, n, isz) for s, n in sends]
    recv = [Slab(out_shape, src, s, n, isz) for s, n in recvs]
    pulls = None
    if tries_shared(spec, isz):
        pulls = []
        for j, p in enumerate(peers):
            if j != coord[m]:
                start, n = _piece(spec, dst, (step.before, p), (step.after, coord))
                index = (slice(None),) * dst + (slice(start, start + n),)
                pulls.append((j, _region(spec, step.before, p)[1], index, recv[j].index))
    return ExchangeRunner(m, coord[m], in_shape, out_shape, isz, send, recv, False, pulls)


def _compile_reduce_scatter(step: Any, spec: Any, coord: tuple, isz: int) -> ReduceScatterRunner:
    m, d = step.mesh_dim, step.tensor_dim
    peers = _peers(coord, m, spec.mesh_shape[m])
    _, in_shape = _region(spec, step.before, coord)
    _, out_shape = _region(spec, step.after, coord)
    pieces = _pieces(spec, step, d, (step.before, coord), [(step.after, p) for p in peers])
    send = [Slab(in_shape, d, s, n, isz) for s, n in pieces]
    return ReduceScatterRunner(m, in_shape, out_shape, send, step.reduce_op, tries_shared(spec, isz))


def _compile_all_reduce(step: Any, spec: Any, coord: tuple, isz: int) -> AllReduceRunner:
    shape = _region(spec, step.before, coord)[1]
    return AllReduceRunner(step.mesh_dim, shape, step.reduce_op, tries_shared(spec, isz))


def _compile_local_chunk(step: Any, spec: Any, coord: tuple, isz: int) -> LocalRunner:
    d = step.tensor_dim
    _, in_shape = _region(spec, step.before, coord)
    _, out_shape = _region(spec, step.after, coord)
    start, n = _piece(spec, d, (step.before, coord), (step.after, coord))
    index = (slice(None),) * d + (slice(start, start + n),)
    return LocalRunner(step.mesh_dim, in_shape, out_shape, index, None)


def _compile_partition_partial(step: Any, spec: Any, coord: tuple, isz: int) -> LocalRunner:
    m = step.mesh_dim
    _, shape = _region(spec, step.before, coord)
    # the rule of partial_fill on this mesh dim alone: the others are already in the input
    fill = partial_fill((step.after[m],), (coord[m],))
    return LocalRunner(m, shape, shape, None, fill)


_COMPILERS: dict[type, Callable[..., Any]] = {
    AllGather: _compile_all_gather,
    AllToAll: _compile_all_to_all,
    ReduceScatter: _compile_reduce_scatter,
    AllReduce: _compile_all_reduce,
    LocalChunk: _compile_local_chunk,
    PartitionPartial: _compile_partition_partial,
}


def _describe(i: int, steps: tuple, spec: Any) -> str:
    """What the debug checks of redistribute.comm show for a collective: its step in the
    plan (the same on every rank; the coordinate is not part of it)."""
    step = steps[i]
    return (
        f"redistribute step {i + 1}/{len(steps)} {short_placements(step.before)} "
        f"-> {short_placements(step.after)} of {spec!r}"
    )


def _compile(step: Any, spec: Any, coord: tuple, isz: int, what: str) -> Any:
    """The runner of one step. A collective over a mesh dim of size 1 moves nothing (this
    rank's block is already the whole group's), so it runs as the identity."""
    reduces = step.communicates and hasattr(step, "reduce_op")
    wide = WIDENED.get(spec.dtype) if reduces else None
    if step.communicates and spec.mesh_shape[step.mesh_dim] == 1:
        if reduces:  # the same dtype checks as on a larger group
            reduction(spec.dtype if wide is None else wide, step.reduce_op, step.kind, what)
        _, shape = _region(spec, step.before, coord)
        return LocalRunner(step.mesh_dim, shape, shape, None, None)
    runner = _COMPILERS[type(step)](step, spec, coord, isz if wide is None else wide.itemsize)
    if step.communicates:
        runner.what = what
    return runner if wide is None else WidenedRunner(runner, spec.dtype)


# -- program cache ------------------------------------------------------------------------


def _release(key: tuple, program: tuple) -> None:
    """Free the derived datatypes of an evicted or cleared program."""
    _comm.free_types([t for runner in program for t in runner.types])


# (steps, spec, coord) -> program; an entry holds its derived datatypes, freed when it
# leaves the cache (and at exit for the rest). Every execute looks its program up, so it
# reads the entries through their bound ``get`` and counts the hit itself, without a
# recency update (moving an entry hashes its key again, about half the cost of a small
# execute): eviction is oldest compiled first.
PROGRAMS = LRUCache("redistribute.programs", 512, on_evict=_release)
_find_program = PROGRAMS.data.get


@atexit.register
def _close() -> None:
    """At exit: let the asynchronous jobs finish, then free the programs' datatypes."""
    _worker.drain()
    PROGRAMS.clear()


def get_program(steps: tuple, spec: Any, coord: tuple) -> tuple:
    """The program of plan ``steps`` for ``spec`` at mesh coordinate ``coord``: one runner
    per step, compiled on first use and kept in :data:`PROGRAMS`. **Local**."""
    key = (steps, spec, coord)
    program = _find_program(key)
    if program is None:
        isz = spec.dtype.itemsize
        program = tuple(
            _compile(step, spec, coord, isz, _describe(i, steps, spec))
            for i, step in enumerate(steps)
        )
        PROGRAMS.misses += 1
        PROGRAMS.put(key, program)
    else:
        PROGRAMS.hits += 1
    return program


def copy(dst: Any, src: Any) -> None:
    """``dst[...] = src`` for numpy and cupy arrays alike (``np.copyto`` is numpy-only).
    **Local**."""
    dst[...] = src


def contiguous(x: np.ndarray, alloc: Alloc) -> np.ndarray:
    """``x`` itself when C-contiguous, else one packed copy from ``alloc``. **Local**."""
    if x.flags.c_contiguous:
        return x
    out = alloc(x.shape, x.dtype)
    copy(out, x)
    return out
