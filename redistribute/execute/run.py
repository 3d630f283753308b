"""Running redistribute programs on this rank's shard: blocking (:func:`execute`) and
asynchronous (:func:`execute_async`).

This module owns both runs of a plan's program (:mod:`redistribute.execute.programs`). An
asynchronous redistribute whose plan is one collective by MPI (the other steps local)
starts it as an MPI nonblocking collective and completes it at ``wait``, with no thread;
other plans run on the worker thread of :mod:`redistribute.worker`. While a hook of
:mod:`redistribute.comm` traces collectives (``HOOKS.traced``: an observer or a debug
check), asynchronous work runs in the caller's thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from placements.errors import DTypeError, ShardingError

from .. import comm as _comm
from .. import worker as _worker
from .programs import Alloc, ExchangeRunner, LocalRunner, get_program

__all__ = ["execute", "execute_async"]


def execute(
    steps: Sequence[Any],
    local: np.ndarray,
    spec: Any,
    coord: Sequence[int],
    comms: Sequence[_comm.Comm],
    alloc: Alloc | None = None,
) -> np.ndarray:
    """Run a redistribute plan on this rank's shard.

    **Collective** over the communicators of the mesh dims the steps touch (every rank of
    the mesh runs the same plan); steps without communication (LocalChunk,
    PartitionPartial) are Local.

    Parameters
    ----------
    steps : sequence of Step
        The plan, from :func:`redistribute.plan.plan` for ``spec``.
    local : ndarray
        This rank's shard under ``spec`` (any strides; it is never written to).
    spec : DTensorSpec
        The source spec (mesh shape, placements, global shape, dtype).
    coord : sequence of int
        This rank's mesh coordinate.
    comms : sequence of Comm
        ``comms[m]`` is the communicator of mesh dim ``m`` (ordered by coordinate).
    alloc : callable, optional
        ``alloc(shape, dtype) -> C-contiguous ndarray`` for outputs and staging buffers;
        default ``numpy.empty``.

    Returns
    -------
    ndarray
        This rank's shard under the plan's target placements. An empty plan returns
        ``local``; a plan of local steps may return a view of it (no copy).
    """
    if not steps:
        return local
    coord = tuple(coord)
    program = get_program(tuple(steps), spec, coord)
    if local.shape != program[0].in_shape or local.dtype != spec.dtype:
        raise _bad_local(program, local, spec, coord)
    alloc = np.empty if alloc is None else alloc
    # the loop of _run, inline: one call less per execute
    x, owned = local, False
    for runner in program:
        x, owned = runner.run(x, owned, comms[runner.mesh_dim], alloc)
    return x


def _bad_local(program: tuple, local: np.ndarray, spec: Any, coord: tuple) -> Exception:
    """The error for a ``local`` shard that does not fit ``program``'s input."""
    err = DTypeError if local.shape == program[0].in_shape else ShardingError
    return err(
        f"redistribute: local shard {local.dtype} {local.shape} at mesh coordinate "
        f"{coord} does not match {spec!r} (expected {spec.dtype} {program[0].in_shape})"
    )


def _run(program: tuple, local: np.ndarray, comms: Sequence[Any], alloc: Alloc) -> np.ndarray:
    """Run the step runners of ``program`` on ``local``, each on its mesh dim's comm."""
    x, owned = local, False
    for runner in program:
        x, owned = runner.run(x, owned, comms[runner.mesh_dim], alloc)
    return x


def execute_async(
    steps: Sequence[Any],
    local: np.ndarray,
    spec: Any,
    coord: Sequence[int],
    comms: Sequence[_comm.Comm],
    alloc: Alloc | None = None,
) -> _worker.Started | _worker.Pending:
    """Start :func:`execute` of a plan; returns the handle of its output at once.

    **Collective** over the same communicators as :func:`execute` (every rank of the mesh
    starts the same plans in the same order). The plan is compiled and ``local`` checked
    here (errors raise at once). Its collectives run on the private duplicates
    (:meth:`Comm.twin <redistribute.comm.Comm.twin>`) of ``comms``, made here the first time
    (a collective over each). ``local`` must not be written until the handle's ``wait``
    returns.

    - A plan whose one communicating step runs by MPI (no shared-memory exchange) and whose
      other steps are local starts that step as one MPI nonblocking collective
      (``Iallgather(v)``, ``Ialltoallw``, ``Iallreduce``, ``Ireduce_scatter(_block)``) in
      this thread, the local steps before it run now and those after it at completion
      (:func:`redistribute.worker.start`); a plan without communication runs now.
    - Other plans (several collectives, or shared-memory exchanges) run on the worker thread
      of :mod:`redistribute.worker` with blocking collectives. Chaining their steps as
      nonblocking requests would start a later step only at a poll or wait, when the
      requests of plans started after it are already issued on the same communicator:
      issue orders would differ between ranks.
    - While the worker has jobs queued, the nonblocking start is queued behind them (the
      same calls, in submission order). While an observer or a debug check of
      :mod:`redistribute.comm` is on, the work runs in this thread before this returns (the
      same calls on the same duplicates, so ranks that differ in that still match); so it
      does for communicators that are not host :class:`Comm` s (device buffers).

    Returns
    -------
    redistribute.worker.Started or redistribute.worker.Pending
        ``wait()`` gives what :func:`execute` returns (and raises what it raises).
    """
    if not steps:
        return _worker.start(None, lambda: local)
    coord = tuple(coord)
    program = get_program(tuple(steps), spec, coord)
    if local.shape != program[0].in_shape or local.dtype != spec.dtype:
        raise _bad_local(program, local, spec, coord)
    alloc = np.empty if alloc is None else alloc
    host = all(type(c) is _comm.Comm for c in comms)
    twins = [c.twin() for c in comms] if host else list(comms)
    inline = not host or _comm.HOOKS.traced
    at = _nonblocking(program) if host else None
    if at is None:
        return _worker.submit(lambda: _run(program, local, twins, alloc), inline)
    if inline or not _worker.idle():
        job = lambda: _worker.Started(*_start(program, at, local, twins, alloc)).wait()
        return _worker.submit(job, inline)
    return _worker.start(*_start(program, at, local, twins, alloc))


def _nonblocking(program: tuple) -> int | None:
    """The position in ``program`` of its one communicating step when that step can run as
    one MPI nonblocking collective and every other step is local; ``len(program)`` when no
    step communicates; else None. The same on every rank of a communicator (the
    shared-memory choice depends on the global size only)."""
    found = len(program)
    for i, runner in enumerate(program):
        if type(runner) is LocalRunner:
            continue
        shm = runner.pulls is not None if type(runner) is ExchangeRunner else runner.shared
        if found != len(program) or shm:
            return None
        found = i
    return found


def _start(program: tuple, at: int, local: np.ndarray, comms: Sequence[Any], alloc: Alloc):
    """Run the local steps of ``program`` before ``at`` and start step ``at`` as a
    nonblocking collective: ``(request, finish)``, where ``finish()`` (once the request has
    completed) completes the step and runs the local steps after it, returning the output."""
    x, owned = local, False
    for runner in program[:at]:
        x, owned = runner.run(x, owned, comms[runner.mesh_dim], alloc)
    if at == len(program):
        return None, lambda: x
    runner = program[at]
    out, request, complete = runner.start(x, owned, comms[runner.mesh_dim], alloc)

    def finish() -> np.ndarray:
        if complete is not None:
            complete()
        y, owned = out, True
        for after in program[at + 1 :]:
            y, owned = after.run(y, owned, comms[after.mesh_dim], alloc)
        return y

    return request, finish
