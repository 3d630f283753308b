"""The communicator: :class:`Comm`, a thin wrapper over an mpi4py communicator whose
methods move data with the *buffer-based* collectives only.

This module owns :class:`Comm` (``Allgatherv``, ``Allreduce``, ``Reduce_scatter``,
``Alltoallv``/``Alltoallw``, ``Scatterv``, ``Bcast``; the pickling lower-case calls are
never used for data; data movement is dtype-agnostic, buffers travel as bytes, and
reductions are typed), :func:`world`, and the run of one collective under the hooks
(:func:`_traced`: the observers of :mod:`redistribute.comm.hooks`, then the checks of
:mod:`redistribute.comm.spmd`), including the checked exchange that ends a
``dt.debug.check_spmd()`` block (:func:`leave_check_block`).

A :class:`Comm` also holds the private duplicate that asynchronous redistributes run on
(:meth:`Comm.twin`), so that their collectives never meet the caller's in matching, the
nonblocking forms of the data collectives (``start=True``: ``Iallgather(v)``,
``Iallreduce``, ``Ireduce_scatter(_block)``, ``Ialltoallw``), which return their request
(:mod:`redistribute.worker` completes them), and its pool of persistent all-gathers
(:mod:`redistribute.comm.persistent`), and point-to-point messages between two ranks
(:meth:`Comm.isend`, :meth:`Comm.irecv`, :meth:`Comm.sendrecv`; pipeline stages and ring
attention), which bypass the collective checks.

Counts and displacements of :class:`Comm` methods are in *elements* of the buffers' dtype,
except :meth:`Comm.alltoallw`, which follows MPI (counts in units of each datatype,
displacements in bytes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from placements.errors import CommError

from .datatypes import BYTES, byte_counts, displacements
from .hooks import HOOKS, notify
from .persistent import PersistentGather, free_pool, pooled_gather
from .reduce import WIDENED, reduction
from .spmd import LEAVE, enter, forget, leave

__all__ = ["Comm", "leave_check_block", "world"]


def _traced(
    comm: Comm,
    kind: str,
    nbytes: int | None,
    what: object,
    detail: str,
    call: Callable[..., Any],
    *args: Any,
) -> Any:
    """Run ``call(*args)``, the MPI call of one collective of ``comm``, under the debug hooks;
    returns what it returns (the request of a nonblocking start).

    The observers are told ``(kind, nbytes)`` first (not when ``nbytes`` is None: an
    exchange they are not shown); then the debug checks enter the collective with the
    fingerprint ``(kind, what, detail)`` and leave it however the call ends. Every
    collective method runs its MPI call through here while an observer or a check is on,
    and calls it directly otherwise (``if HOOKS.traced: _traced(...) else: call``),
    so that the common case builds no description and pays no extra call: passing the call
    on, even as ``call(*args)``, costs a measurable share of a small collective. For a
    nonblocking start the checks cover the start (the watchdog does not watch its wait).
    """
    if HOOKS.observers and nbytes is not None:
        notify(kind, nbytes, comm)
    if HOOKS.checks:
        enter(comm, kind, what, detail)
    try:
        return call(*args)
    finally:
        if HOOKS.checks:
            leave()


class Comm:
    """A communicator with buffer-based collectives.

    Attributes
    ----------
    mpi : mpi4py.MPI.Comm
        The raw communicator (for users who call MPI directly).
    rank, size : int
        This process's rank in the communicator and the communicator's size.
    mesh_dim : int or None
        The mesh dim this communicator spans, or None for a base communicator.
    async_op : bool
        Whether this is the private duplicate that asynchronous redistributes run on
        (:meth:`twin`); observers see it on the communicator they are passed.
    pool : dict
        This communicator's persistent all-gathers by byte counts per rank
        (:meth:`persistent_gather`).
    """

    __slots__ = ("_twin", "async_op", "mesh_dim", "mpi", "pool", "rank", "shared", "size")

    # Every collective method takes ``what=``: a description of the caller's purpose (a
    # string, or a tuple of parts joined with spaces when needed) that the debug checks put
    # into the collective's fingerprint; it is only rendered while a check is on.

    def __init__(self, mpi_comm: Any, mesh_dim: int | None = None) -> None:
        if not isinstance(mpi_comm, MPI.Comm) or mpi_comm == MPI.COMM_NULL:
            raise CommError(f"Comm: expected an mpi4py communicator, got {mpi_comm!r}")
        self.mpi = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.mesh_dim = mesh_dim
        # whether the ranks can read each other's shared segments (redistribute.shm.probe);
        # None until a caller has asked
        self.shared: bool | None = None
        self.async_op = False
        self.pool: dict[tuple[int, ...], PersistentGather] = {}
        self._twin: Comm | None = None

    def __repr__(self) -> str:
        return f"Comm(rank={self.rank}, size={self.size}, mesh_dim={self.mesh_dim})"

    def free(self) -> None:
        """Release the underlying communicator (not COMM_WORLD/COMM_SELF). **Collective**."""
        free_pool(self.pool)
        if self._twin is not None:
            self._twin.free()
            self._twin = None
        if self.mpi not in (MPI.COMM_WORLD, MPI.COMM_SELF) and not MPI.Is_finalized():
            forget(self.mpi.handle)
            self.mpi.Free()

    def twin(self) -> Comm:
        """The private duplicate of this communicator that asynchronous redistributes run
        on (``async_op`` True, same ``mesh_dim``), made on first use and kept with this one.

        **Collective** the first time (``MPI_Comm_dup``), Local afterwards. Collectives on
        the twin never match the ones on this communicator, so work issued on it (in the
        same order on every rank, by whichever thread) may overlap with this communicator's.
        """
        if self._twin is None:
            twin = Comm(self.mpi.Dup(), self.mesh_dim)
            twin.async_op = True
            self._twin = twin
        return self._twin

    def persistent_gather(self, counts: tuple[int, ...]) -> PersistentGather:
        """This communicator's persistent all-gather of ``counts`` bytes per rank, from its
        pool. **Collective** when it is made, Local when the pool holds it (see
        :func:`redistribute.comm.persistent.pooled_gather`)."""
        return pooled_gather(self.pool, self.mpi, counts, self.rank)

    def allgatherv(
        self,
        send: np.ndarray,
        recv: np.ndarray,
        counts: Sequence[int],
        displs: Sequence[int] | None = None,
        what: object = None,
        start: bool = False,
    ) -> Any:
        """Gather every rank's ``send`` into ``recv``. **Collective**.

        Equal counts at the default displacements use ``Allgather``, other layouts
        ``Allgatherv``; with ``start``, their nonblocking forms (``Iallgather``,
        ``Iallgatherv``), whose request is returned (None otherwise): the buffers belong to
        MPI until it completes.

        Parameters
        ----------
        send : ndarray
            This rank's contiguous contribution (``counts[rank]`` elements).
        recv : ndarray
            Contiguous output; rank ``i``'s data lands at element ``displs[i]``.
        counts, displs : sequence of int
            Elements per rank and their offsets in ``recv`` (default: packed in rank order).
            Zero counts are legal.
        """
        isz = recv.itemsize
        counts = list(counts)
        mine = counts[self.rank] * isz
        send_spec = [send, mine, BYTES]
        # each variant returns from its own MPI call when no hook is on and the call blocks
        # (choosing the variant again after the hook test costs a small gather about 3%)
        if displs is None and counts.count(counts[self.rank]) == len(counts):
            recv_spec = [recv, mine, BYTES]  # counts per rank
            if not (HOOKS.traced or start):
                self.mpi.Allgather(send_spec, recv_spec)
                return None
            call = self.mpi.Iallgather if start else self.mpi.Allgather
        else:
            bdispls = byte_counts(displacements(counts) if displs is None else displs, isz)
            recv_spec = [recv, byte_counts(counts, isz), bdispls, BYTES]
            if not (HOOKS.traced or start):
                self.mpi.Allgatherv(send_spec, recv_spec)
                return None
            call = self.mpi.Iallgatherv if start else self.mpi.Allgatherv
        if not HOOKS.traced:
            return call(send_spec, recv_spec)
        nbytes = max(send.nbytes, sum(counts) * isz)
        detail = f"{isz}-byte items, counts {counts}"
        return _traced(self, "all_gather", nbytes, what, detail, call, send_spec, recv_spec)

    def allgather_persistent(
        self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int], what: object = None
    ) -> None:
        """:meth:`allgatherv` at the default displacements, for counts that repeat, through
        the persistent all-gather of this communicator's pool (:meth:`persistent_gather`).
        **Collective**; every rank of the communicator takes this form for the call (the
        redistribute executor does while :func:`persistent_enabled`). ``send`` and ``recv``
        are C-contiguous; observers see an ``all_gather`` as from :meth:`allgatherv`.
        """
        isz = recv.itemsize
        gather = self.persistent_gather(tuple([int(c) * isz for c in counts]))
        if HOOKS.traced:
            nbytes = max(send.nbytes, recv.nbytes)
            detail = f"{isz}-byte items, counts {list(counts)}, persistent"
            _traced(self, "all_gather", nbytes, what, detail, gather.run, send, recv)
        else:
            gather.run(send, recv)

    def allreduce(
        self,
        send: np.ndarray,
        recv: np.ndarray | None = None,
        op: str = "sum",
        what: object = None,
        start: bool = False,
    ) -> Any:
        """Reduce ``send`` over all ranks into ``recv`` (in place when ``recv`` is None).

        **Collective**. ``op`` is one of sum, avg (sum, then divide by the size), max, min,
        prod. Buffers are contiguous and of the same shape and dtype. With ``start``, the
        nonblocking ``Iallreduce`` is started and its request returned (None otherwise); the
        caller divides an avg once it has completed. bfloat16 data (blocking only) reduces
        widened to float32 and is rounded once (:data:`~redistribute.comm.reduce.WIDENED`).
        """
        if send.dtype in WIDENED and not start:
            wide = _widened(send)
            self.allreduce(wide, None, op, what)
            np.copyto(send if recv is None else recv, wide, casting="unsafe")
            return None
        mpi_type, mpi_op = reduction(send.dtype, op, "all_reduce", what)
        if recv is None:
            send_spec, recv_spec = MPI.IN_PLACE, [send, send.size, mpi_type]
            recv = send
        else:
            send_spec, recv_spec = [send, send.size, mpi_type], [recv, recv.size, mpi_type]
        if not (HOOKS.traced or start):
            self.mpi.Allreduce(send_spec, recv_spec, mpi_op)
        else:
            call = self.mpi.Iallreduce if start else self.mpi.Allreduce
            args = (send_spec, recv_spec, mpi_op)
            if HOOKS.traced:
                detail = f"{send.size} x {send.dtype}, op {op}"
                request = _traced(self, "all_reduce", send.nbytes, what, detail, call, *args)
            else:
                request = call(*args)
            if start:
                return request
        if op == "avg":
            np.divide(recv, self.size, out=recv)
        return None

    def reduce_scatter(
        self,
        send: np.ndarray,
        recv: np.ndarray,
        counts: Sequence[int],
        op: str = "sum",
        what: object = None,
        start: bool = False,
    ) -> Any:
        """Reduce ``send`` over all ranks; rank ``i`` gets the ``i``-th block. **Collective**.

        ``send`` holds ``sum(counts)`` elements, the blocks in rank order; ``recv`` gets
        ``counts[rank]`` elements. Zero counts are legal. ``op`` as in :meth:`allreduce`.
        Equal counts use ``Reduce_scatter_block``, others ``Reduce_scatter``; with ``start``
        their nonblocking forms, and bfloat16 data, as in :meth:`allreduce`.
        """
        if send.dtype in WIDENED and not start:
            wide = np.empty(recv.shape, WIDENED[send.dtype])
            self.reduce_scatter(_widened(send), wide, counts, op, what)
            np.copyto(recv, wide, casting="unsafe")
            return None
        mpi_type, mpi_op = reduction(send.dtype, op, "reduce_scatter", what)
        counts = [int(c) for c in counts]
        mine = counts[self.rank]
        even = counts.count(mine) == len(counts)
        send_spec = [send, mine if even else sum(counts), mpi_type]  # even: counts per block
        recv_spec = [recv, mine, mpi_type]
        if not (HOOKS.traced or start):
            if even:
                self.mpi.Reduce_scatter_block(send_spec, recv_spec, mpi_op)
            else:
                self.mpi.Reduce_scatter(send_spec, recv_spec, counts, mpi_op)
        else:
            mpi = self.mpi
            if even:
                call = mpi.Ireduce_scatter_block if start else mpi.Reduce_scatter_block
                args = (send_spec, recv_spec, mpi_op)
            else:
                call = mpi.Ireduce_scatter if start else mpi.Reduce_scatter
                args = (send_spec, recv_spec, counts, mpi_op)
            if HOOKS.traced:
                detail = f"{send.dtype}, counts {counts}, op {op}"
                request = _traced(self, "reduce_scatter", send.nbytes, what, detail, call, *args)
            else:
                request = call(*args)
            if start:
                return request
        if op == "avg":
            np.divide(recv, self.size, out=recv)
        return None

    def alltoallv(
        self,
        send: np.ndarray,
        send_counts: Sequence[int],
        send_displs: Sequence[int],
        recv: np.ndarray,
        recv_counts: Sequence[int],
        recv_displs: Sequence[int],
        what: object = None,
    ) -> None:
        """Send block ``j`` of ``send`` to rank ``j``; receive rank ``i``'s into ``recv``.

        **Collective**. Counts and displacements in elements; zero counts are legal.
        """
        isz = send.itemsize
        scounts, rcounts = byte_counts(send_counts, isz), byte_counts(recv_counts, isz)
        send_spec = [send, scounts, byte_counts(send_displs, isz), BYTES]
        recv_spec = [recv, rcounts, byte_counts(recv_displs, isz), BYTES]
        if HOOKS.traced:
            nbytes = max(sum(scounts), sum(rcounts))
            detail = f"{isz}-byte items"  # counts differ between ranks
            call = self.mpi.Alltoallv
            _traced(self, "all_to_all", nbytes, what, detail, call, send_spec, recv_spec)
        else:
            self.mpi.Alltoallv(send_spec, recv_spec)

    def alltoallw(
        self,
        send: np.ndarray,
        send_counts: Sequence[int],
        send_displs: Sequence[int],
        send_types: Sequence[Any],
        recv: np.ndarray,
        recv_counts: Sequence[int],
        recv_displs: Sequence[int],
        recv_types: Sequence[Any],
        kind: str = "all_to_all",
        what: object = None,
        nbytes: int | None = None,
        start: bool = False,
    ) -> Any:
        """Like :meth:`alltoallv` with one datatype per peer. **Collective**.

        Counts are in units of the peer's datatype (:data:`BYTES` or one from
        :func:`block_type`), displacements in bytes from the start of the buffer. ``kind``
        and ``nbytes`` are what observers are told: a caller that implements a larger
        collective with this exchange (an all-gather whose own block is copied locally)
        passes its kind and buffer size; by default the larger of the bytes sent and
        received. With ``start``, the nonblocking ``Ialltoallw`` is started and its request
        returned (None otherwise).
        """
        send_spec = [send, send_counts, send_displs, send_types]
        recv_spec = [recv, recv_counts, recv_displs, recv_types]
        if not (HOOKS.traced or start):
            return self.mpi.Alltoallw(send_spec, recv_spec)
        call = self.mpi.Ialltoallw if start else self.mpi.Alltoallw
        if HOOKS.traced:
            if nbytes is None:
                sent = sum(c * t.Get_size() for c, t in zip(send_counts, send_types))
                got = sum(c * t.Get_size() for c, t in zip(recv_counts, recv_types))
                nbytes = max(sent, got)
            detail = "alltoallw"  # counts and types differ between ranks
            return _traced(self, kind, nbytes, what, detail, call, send_spec, recv_spec)
        return call(send_spec, recv_spec)

    def scatterv(
        self,
        send: np.ndarray | None,
        counts: Sequence[int],
        displs: Sequence[int],
        recv: np.ndarray | None,
        root: int,
        what: object = None,
    ) -> None:
        """Rank ``i`` receives ``counts[i]`` elements of ``send`` (read on ``root`` only).

        **Collective**. ``recv=None`` on the root leaves the root's block in place (it is
        not copied); other ranks always pass a buffer (it may be empty).
        """
        if self.rank == root:
            isz = send.itemsize
            sendspec = [send, byte_counts(counts, isz), byte_counts(displs, isz), BYTES]
            recvspec = MPI.IN_PLACE if recv is None else [recv, recv.nbytes, BYTES]
        else:
            sendspec = None
            recvspec = [recv, recv.nbytes, BYTES]
        if HOOKS.traced:
            nbytes = send.nbytes if self.rank == root else recv.nbytes
            detail = f"root {root}, counts {list(counts)}"
            call = self.mpi.Scatterv
            _traced(self, "scatter", nbytes, what, detail, call, sendspec, recvspec, root)
        else:
            self.mpi.Scatterv(sendspec, recvspec, root)

    def bcast_array(self, arr: np.ndarray, root: int = 0, what: object = None) -> np.ndarray:
        """Broadcast the contiguous ``arr`` from ``root`` in place; returns it. **Collective**."""
        spec = [arr, arr.nbytes, BYTES]
        if HOOKS.traced:
            detail = f"root {root}, {arr.nbytes} bytes"
            _traced(self, "broadcast", arr.nbytes, what, detail, self.mpi.Bcast, spec, root)
        else:
            self.mpi.Bcast(spec, root)
        return arr

    def barrier(self, what: object = None) -> None:
        """Wait for every rank. **Collective**."""
        if HOOKS.traced:
            _traced(self, "barrier", 0, what, "no data", self.mpi.Barrier)
        else:
            self.mpi.Barrier()

    def allgather_ints(self, values: Sequence[int] | np.ndarray, what: object = None) -> np.ndarray:
        """Exchange a few int64 values; row ``i`` of the result is rank ``i``'s. **Collective**.

        Every rank must pass the same number of values. For metadata (shapes, coordinates,
        consistency checks), not for data.
        """
        mine = np.ascontiguousarray(values, dtype=np.int64).ravel()
        nbytes = self.size * mine.nbytes
        return self._gather_ints(mine, "all_gather_ints", what, f"{mine.size} values", nbytes)

    def _gather_ints(
        self, mine: np.ndarray, kind: str, what: object, detail: str, nbytes: int | None
    ) -> np.ndarray:
        """The all-gather of int64 values of :meth:`allgather_ints` and
        :meth:`shared_exchange`; ``nbytes`` None hides it from the observers."""
        out = np.empty((self.size, mine.size), dtype=np.int64)
        send_spec, recv_spec = [mine, MPI.INT64_T], [out, MPI.INT64_T]
        if HOOKS.traced:
            _traced(self, kind, nbytes, what, detail, self.mpi.Allgather, send_spec, recv_spec)
        else:
            self.mpi.Allgather(send_spec, recv_spec)
        return out

    def shared_exchange(
        self, values: Sequence[int], kind: str, what: object = None, detail: str = ""
    ) -> np.ndarray:
        """Exchange the descriptors of a shared-memory exchange of ``kind``. **Collective**.

        Like :meth:`allgather_ints`, but not shown to observers: the caller reports the
        exchange it stands for with :meth:`report` once it has run that way. ``detail``
        (the exchange's rank-invariant arguments, e.g. dtype and reduce op) joins the
        fingerprint of the SPMD check.
        """
        mine = np.ascontiguousarray(values, dtype=np.int64).ravel()
        return self._gather_ints(
            mine, kind, what, f"{detail}; shared descriptors, {mine.size} values", None
        )

    # -- point to point (pipeline stages, ring attention) ---------------------------------
    # These are not collectives: only the two ranks of a pair take part, so they bypass the
    # SPMD check and the collective watchdog; observers see them as ``send`` / ``recv`` with
    # the message's bytes (a ``recv`` is shown when it is posted).

    def _p2p_check(self, op: str, arr: np.ndarray, peer: int, tag: int) -> None:
        if not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous:
            kind = type(arr).__name__ if not isinstance(arr, np.ndarray) else "a strided array"
            raise CommError(f"Comm.{op}: needs a C-contiguous ndarray, got {kind}")
        if not isinstance(tag, (int, np.integer)) or not 0 <= int(tag) < 32768:
            raise CommError(f"Comm.{op}: tag {tag!r} must be an int in [0, 32767]")
        if not isinstance(peer, (int, np.integer)) or not 0 <= int(peer) < self.size:
            raise CommError(f"Comm.{op}: peer {peer!r} is not a rank of this communicator "
                            f"(size {self.size})")
        if int(peer) == self.rank:
            raise CommError(f"Comm.{op}: peer {peer} is this rank itself")

    def isend(self, arr: np.ndarray, dest: int, tag: int = 0, what: object = None) -> Any:
        """Start sending the C-contiguous ``arr`` to rank ``dest``; returns the request
        (complete it with :meth:`wait_all`; ``arr`` belongs to MPI until then).

        **Point-to-point**: only this rank and ``dest`` take part (``dest`` posts the
        matching :meth:`irecv` with the same ``tag`` and as many bytes). ``what`` describes
        the message for observers' purposes only (they read it with
        :func:`redistribute.comm.notified_what`).
        """
        self._p2p_check("isend", arr, dest, tag)
        if HOOKS.observers:
            notify("send", arr.nbytes, self, what)
        return self.mpi.Isend([arr, arr.nbytes, BYTES], int(dest), int(tag))

    def irecv(self, arr: np.ndarray, source: int, tag: int = 0, what: object = None) -> Any:
        """Start receiving ``arr.nbytes`` bytes from rank ``source`` into the C-contiguous
        ``arr``; returns the request (complete it with :meth:`wait_all`). **Point-to-point**
        (see :meth:`isend`). A message of another size than ``arr`` is an error at the wait.
        """
        self._p2p_check("irecv", arr, source, tag)
        if HOOKS.observers:
            notify("recv", arr.nbytes, self, what)
        return self.mpi.Irecv([arr, arr.nbytes, BYTES], int(source), int(tag))

    def sendrecv(
        self,
        send: np.ndarray,
        dest: int,
        recv: np.ndarray,
        source: int,
        tag: int = 0,
        what: object = None,
    ) -> None:
        """Send ``send`` to ``dest`` and receive ``recv`` from ``source`` at once (a ring
        step); blocks until both are done. **Point-to-point**."""
        self.wait_all([self.irecv(recv, source, tag, what), self.isend(send, dest, tag, what)])

    @staticmethod
    def wait_all(requests: Sequence[Any]) -> None:
        """Complete the requests of :meth:`isend` / :meth:`irecv` (None entries are
        skipped). **Local** (it waits for the peers' matching calls). A received message
        longer than its buffer raises :class:`CommError`."""
        live = [r for r in requests if r is not None]
        if not live:
            return
        try:
            MPI.Request.Waitall(live)
        except MPI.Exception as exc:
            raise CommError(f"Comm.wait_all: a point-to-point message failed: {exc}") from None

    @staticmethod
    def test_all(requests: Sequence[Any]) -> bool:
        """Whether every request of :meth:`isend` / :meth:`irecv` has completed (completing
        those that have). **Local**; never blocks."""
        live = [r for r in requests if r is not None]
        return not live or bool(MPI.Request.Testall(live))

    def report(self, kind: str, nbytes: int) -> None:
        """Tell the observers of a collective of ``kind`` over ``nbytes`` bytes that ran
        without an MPI call of that kind (a shared-memory exchange). **Local**."""
        notify(kind, nbytes, self)

    def all_true(self, flag: bool, what: object = None) -> bool:
        """Whether ``flag`` holds on every rank. **Collective**; not shown to observers (it
        ends a shared-memory exchange: no rank returns before every peer has read its data).
        """
        value = np.array([1 if flag else 0], np.int32)
        spec = [value, 1, MPI.INT]
        if HOOKS.traced:
            detail = "shared exchange done"
            call = self.mpi.Allreduce
            _traced(self, "all_reduce", None, what, detail, call, MPI.IN_PLACE, spec, MPI.MIN)
        else:
            self.mpi.Allreduce(MPI.IN_PLACE, spec, MPI.MIN)
        return bool(value[0])


def _widened(x: np.ndarray) -> np.ndarray:
    """A contiguous copy of ``x`` in the dtype its reductions run in (:data:`WIDENED`)."""
    return x.astype(WIDENED[x.dtype], order="C")


def world() -> Comm:
    """A :class:`Comm` over ``MPI.COMM_WORLD``. **Local**."""
    return Comm(MPI.COMM_WORLD)


def leave_check_block(exc: BaseException | None) -> None:
    """Agree on the exit of a ``dt.debug.check_spmd()`` block. **Collective** over
    ``COMM_WORLD`` while the SPMD check is on (a no-op otherwise).

    Every rank announces to every other how it leaves the block: normally (``exc`` None) or
    raising an exception of which type. Ranks that leave in different ways all raise
    :class:`CommError` here; a rank still inside the block meets the announcement at its
    next checked collective and raises there. ``exc`` that is not an :class:`Exception`
    (``KeyboardInterrupt``, ``SystemExit``) is announced without waiting for the others.
    """
    if not HOOKS.spmd:
        return
    detail = "no exception" if exc is None else f"raising {type(exc).__name__}"
    enter(Comm(MPI.COMM_WORLD), LEAVE, None, detail, exc is None or isinstance(exc, Exception))
    leave()
