"""The compiled executor's side of redistribute: the forms of one-step plans that compiled
code runs itself, and what that code (``fastpath._redist``) is plugged with.

This module owns :func:`compiled_form` (what a one-step plan's program looks like as the
MPI call it makes and the byte copies around it) and :func:`executor_plug`: the one hook
state of :mod:`redistribute.comm` (:data:`~redistribute.comm.HOOKS`: the compiled executor
leaves every call to the Python one while an observer or a debug check is on, and runs
small gathers through persistent requests while those are on), ``MPI.BYTE`` and
:func:`~redistribute.comm.request_c_api`. redistribute and fastpath sit side by side and
import nothing of each other: dtensor's compiled glue (``dtensor.dispatch.compiled``), the
one module that talks to the extension, hands it these fields and the forms of DTensor
redistributes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from placements.errors import DTypeError

from .. import comm as _comm
from ..comm.datatypes import displacements
from ..comm.reduce import reduction
from ..plan import PartitionPartial
from .programs import (
    AllReduceRunner,
    ExchangeRunner,
    LocalRunner,
    Slab,
    WidenedRunner,
    get_program,
)

__all__ = ["compiled_form", "executor_plug"]


def executor_plug() -> tuple:
    """What the compiled executor (``fastpath._redist.install``) is plugged with: the hook
    state of :mod:`redistribute.comm`, ``MPI.BYTE`` and the MPI library's C functions of
    persistent requests (None where they are not found). **Local**."""
    return _comm.HOOKS, _comm.BYTES, _comm.request_c_api()


def _runs(s: Slab) -> tuple:
    """Where slab ``s`` lies in its C-contiguous array, in bytes: ``(offset, runs, bytes per
    run, bytes from one run to the next)``."""
    if s.contiguous:
        return s.offset, 1, s.pre * s.run, s.pre * s.run
    return s.offset, s.pre, s.run, s.row


def _flat(start: int, nbytes: int) -> tuple:
    """``nbytes`` contiguous bytes from byte ``start``, in :func:`_runs`' form."""
    return start, 1, nbytes, nbytes


def _blocks(pairs: list[tuple]) -> np.ndarray:
    """Copies as compiled code runs them: one int64 row ``(*source runs, *target runs)`` per
    block (the two sides in :func:`_runs`' form hold the same bytes in the same order)."""
    return np.array([src + dst for src, dst in pairs], np.int64).reshape(-1, 8)


def compiled_form(steps: Sequence[Any], spec: Any, coord: Sequence[int], comms: Sequence[Any]):
    """The one-step plan ``steps`` as compiled code may run it itself, else None.

    **Local** (compiles the plan once, like :func:`~redistribute.execute.execute`). A caller that runs the form
    (the dispatcher's compiled ``redistribute``) issues the MPI call the executor issues for
    a C-contiguous host input, with the same buffers' bytes, so every rank may take either
    path for the same call and the outputs are bytewise the executor's. Plans that take the
    shared-memory path (:data:`redistribute.shm.MIN_BYTES`), a ``PartitionPartial`` (R -> P),
    a reduction of a widened dtype (bfloat16) and plans of several steps give None. Returns ``(kind, comm, out_shape, fields)``: the
    :class:`~redistribute.comm.Comm` of the step, the local output shape, and by ``kind``:

    - ``"gather"`` (a small all-gather, :data:`~redistribute.execute.programs._MAX_ALLGATHER_BYTES`): ``(send bytes, byte
      counts or None, byte displacements or None, staging bytes, unstage, byte counts per
      rank)``: ``Allgather`` (counts None) or ``Allgatherv`` into the output (staging bytes
      0) or into a staging buffer whose blocks ``unstage`` copies into the output; with
      persistent all-gathers on, through the persistent request of the byte counts
      (:meth:`Comm.allgather_persistent <redistribute.comm.Comm.allgather_persistent>`);
    - ``"all_reduce"``: ``(MPI datatype, MPI op, elements, avg)``: ``Allreduce`` into a new
      output (an avg is then divided by the group size);
    - ``"reduce_scatter"``: ``(MPI datatype, MPI op, elements received, element counts or
      None, elements sent, pack, pack bytes, avg)``: ``Reduce_scatter_block`` (counts
      None) or ``Reduce_scatter`` of the input, or of a buffer ``pack`` fills from it;
    - ``"all_to_all"``: ``(own, pack, pack bytes, send byte counts, send displacements,
      staging bytes, receive byte counts, receive displacements, datatypes, unstage)``: the
      own block copied by ``own``, then one ``Alltoallw`` of bytes from the input (pack
      None) or a packed buffer, into the output or a staging buffer (blocks that are not
      contiguous in the output are staged: the executor's derived datatypes are its own);
    - ``"local"``: ``(index,)``: the output is the input (index None) or its view
      ``x[index]``.

    Copies (``own``, ``pack``, ``unstage``) are :func:`_blocks` arrays of byte offsets from
    the start of their source and target buffers.
    """
    if len(steps) != 1 or type(steps[0]) is PartitionPartial:
        return None
    (runner,) = get_program(tuple(steps), spec, tuple(coord))
    comm = comms[runner.mesh_dim]
    isz = spec.dtype.itemsize
    kind = type(runner)
    if kind is LocalRunner:
        return "local", comm, runner.out_shape, (runner.index,)
    if kind is ExchangeRunner:
        if runner.pulls is not None:
            return None
        form = _gather_fields(runner, comm, isz) if runner.gather_counts is not None else (
            _all_to_all_fields(runner, comm, isz))  # fmt: skip
        return None if form is None else (form[0], comm, runner.out_shape, form[1])
    if runner.shared or kind is WidenedRunner:  # (a widened reduction: Python's own)
        return None
    try:
        mpi_type, mpi_op = reduction(spec.dtype, runner.op, "reduce", runner.what)
    except DTypeError:  # the executor raises it
        return None
    avg = runner.op == "avg"
    if kind is AllReduceRunner:
        fields = (mpi_type, mpi_op, math.prod(runner.in_shape), avg)
        return "all_reduce", comm, runner.out_shape, fields
    counts = runner.counts
    mine, total = counts[comm.rank], sum(counts)
    pack = None
    if not runner.direct:
        pack = _blocks([(_runs(s), _flat(start * isz, s.size * isz))
                        for s, (_, start, _, _) in zip(runner.send, runner.pack)])  # fmt: skip
    even = counts.count(mine) == len(counts)
    fields = (mpi_type, mpi_op, mine, None if even else list(counts), total, pack, total * isz, avg)
    return "reduce_scatter", comm, runner.out_shape, fields


def _gather_fields(runner: ExchangeRunner, comm: _comm.Comm, isz: int) -> tuple | None:
    counts = [c * isz for c in runner.gather_counts]
    mine = math.prod(runner.in_shape) * isz
    if mine != counts[comm.rank]:
        return None
    stage, unstage = 0, None
    if runner.unstage:
        stage = runner.stage_len * isz
        unstage = _blocks([(_flat(begin * isz, (stop - begin) * isz), _runs(runner.recv[j]))
                           for j, (_, begin, stop, _) in enumerate(runner.unstage)])  # fmt: skip
    if counts.count(mine) == len(counts):
        return "gather", (mine, None, None, stage, unstage, tuple(counts))
    return "gather", (mine, counts, displacements(counts), stage, unstage, tuple(counts))


def _all_to_all_fields(runner: ExchangeRunner, comm: _comm.Comm, isz: int) -> tuple:
    me, send, recv = comm.rank, runner.send, runner.recv
    k = len(send)
    peers = [j for j in range(k) if j != me]
    own = _blocks([(_runs(send[me]), _runs(recv[me]))])
    if runner.direct:
        pack, pack_len, sdispls = None, 0, list(runner.direct_displs)
    else:
        pack = _blocks([(_runs(send[j]), _flat(runner.pack_displs[j], send[j].size * isz))
                        for j in peers])  # fmt: skip
        pack_len, sdispls = runner.pack[-1][2] * isz, list(runner.pack_displs)
    rcounts, rdispls, stage, unstage = [0] * k, [0] * k, 0, []
    staged = not all(recv[j].contiguous for j in peers)
    for j in peers:
        n = recv[j].size * isz
        if staged:
            rcounts[j], rdispls[j] = n, stage
            unstage.append((_flat(stage, n), _runs(recv[j])))
            stage += n
        else:
            rcounts[j], rdispls[j] = n, recv[j].offset
    fields = (own, pack, pack_len, list(runner.scounts), sdispls, stage, rcounts, rdispls,
              [_comm.BYTES] * k, _blocks(unstage) if staged else None)  # fmt: skip
    return "all_to_all", fields
