"""The worker thread of asynchronous redistributes, and the handles of their results.

This module owns one FIFO worker thread per process (a daemon, started on first use) and
:class:`Pending`, the handle of a job submitted to it. Jobs run one at a time, in the order
they were submitted: every rank submits the same collective jobs in the same order, so
their collectives are issued in the same order on every rank (MPI matches collectives by
order on a communicator). The jobs' collectives run on private duplicates of the callers'
communicators (:meth:`redistribute.comm.Comm.twin`), so they never meet the caller's own
collectives, which go on in the meantime (MPI is initialised with
``MPI_THREAD_MULTIPLE``).

Progress: the worker blocks in MPICH's blocking calls, which poll the progress engine
themselves; the caller's thread makes no MPI call for the job. The calls of mpi4py release
the GIL, as do numpy's large kernels, so the caller computes meanwhile. MPICH's own
progress thread (``MPIR_CVAR_ASYNC_PROGRESS=1``) is not needed (BENCHMARKS.md measures it).

When the caller must see the job's collectives in its own thread (a communication observer
or a debug check of :mod:`redistribute.comm` is on, or MPI lacks ``MPI_THREAD_MULTIPLE``),
:func:`submit` first waits for the jobs already queued and runs the job in the caller's
thread: the same collectives on the same communicators in the same order, so ranks that
differ in that choice still match.
"""

from __future__ import annotations

import atexit
import queue
import threading
from collections.abc import Callable
from typing import Any

from . import comm as _comm

__all__ = ["Pending", "drain", "pending_count", "submit"]

# Whether a job may run on the worker thread at all (the library's thread level)
_THREADS = _comm.thread_multiple()


class Pending:
    """The handle of a job submitted with :func:`submit`: its result once it has run."""

    __slots__ = ("_done", "_error", "_result")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether the job has finished (without waiting). **Local**."""
        return self._done.is_set()

    def wait(self) -> Any:
        """The job's result, after waiting for it to finish; raises what the job raised.

        **Collective** in effect: the job's collectives need every rank's matching job.
        """
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result

    def _finish(self, fn: Callable[[], Any]) -> None:
        try:
            self._result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter, who raises it
            self._error = exc
        finally:
            self._done.set()


_queue: queue.SimpleQueue = queue.SimpleQueue()
_thread: threading.Thread | None = None
_lock = threading.Lock()
_count = 0  # jobs submitted and not finished
_idle = threading.Condition(_lock)


def _loop() -> None:
    global _count
    while True:
        job = _queue.get()
        if job is None:
            return
        handle, fn = job
        handle._finish(fn)
        del job, handle, fn  # the result belongs to the handle's holder only
        with _lock:
            _count -= 1
            if _count == 0:
                _idle.notify_all()


def submit(fn: Callable[[], Any], inline: bool = False) -> Pending:
    """Run ``fn()`` after every job submitted before it; returns its handle at once.

    **Local** (the job itself is what it is). With ``inline`` (or without
    ``MPI_THREAD_MULTIPLE``) the job runs in this thread, after the queued jobs have
    finished, and the handle returned is already done.
    """
    global _thread, _count
    handle = Pending()
    if inline or not _THREADS:
        drain()
        handle._finish(fn)
        return handle
    with _lock:
        _count += 1
        if _thread is None:
            _thread = threading.Thread(target=_loop, name="dtensor-redistribute", daemon=True)
            _thread.start()
    _queue.put((handle, fn))
    return handle


def drain() -> None:
    """Wait until every submitted job has finished. **Local** (in effect collective, as
    :meth:`Pending.wait`)."""
    with _lock:
        while _count:
            _idle.wait()


def pending_count() -> int:
    """Jobs submitted and not finished yet. **Local**."""
    return _count


@atexit.register
def _stop() -> None:
    """Let the queued jobs finish (their collectives are matched by the other ranks' jobs)
    and stop the thread, before MPI finalizes (registered after mpi4py's finalizer)."""
    global _thread
    if _thread is not None:
        drain()
        _queue.put(None)
        _thread.join()
        _thread = None
