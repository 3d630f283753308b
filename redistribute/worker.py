"""The handles of asynchronous redistributes: requests started in the caller's thread, and
jobs of the worker thread.

This module owns:

- :class:`Started`, the handle of work started as one MPI nonblocking collective in the
  caller's thread (:func:`start`): no thread is involved; the request completes at the
  handle's ``wait`` (or when a ``done`` poll finds it complete), which then runs the work's
  finishing step (unpacking staged blocks, dividing an average, the plan's local steps
  after the collective). Started handles are tracked until their request completes, so a
  handle dropped in flight keeps its buffers alive: :func:`poll` (each new start polls)
  completes the ones whose request has completed, :func:`drain` waits for all of them.
- one FIFO worker thread per process (a daemon, started on first use) and
  :class:`Pending`, the handle of a job submitted to it (:func:`submit`). Jobs run one at a
  time, in the order they were submitted.

Every rank starts the same collective work in the same order, on private duplicates of the
callers' communicators (:meth:`redistribute.comm.Comm.twin`), so it never meets the
caller's own collectives, which go on in the meantime (MPI is initialised with
``MPI_THREAD_MULTIPLE``). A caller starts work in its own thread only while the worker's
queue is empty (:func:`idle`); otherwise it submits the start to the worker, behind the
queued jobs, so the collectives of a communicator are issued in submission order whichever
thread issues them. Which MPI calls a piece of work makes (nonblocking or blocking) must not
depend on that choice: MPI does not match a nonblocking collective with a blocking one.

Progress (MPICH): a started request moves when this process calls MPI: at ``wait``, at a
``done`` poll or another start's :func:`poll`, or inside any other MPI call; between those
the caller computes and nothing moves. Small messages are sent eagerly at the start, so a
late peer's data is simply there at ``wait``; large ones wait for a poll. The worker thread
blocks in MPICH's blocking calls, which poll the progress engine themselves; the calls of
mpi4py release the GIL, as do numpy's large kernels, so the caller computes meanwhile.
MPICH's own progress thread (``MPIR_CVAR_ASYNC_PROGRESS=1``) is not needed (BENCHMARKS.md
measures these choices).

When the caller must see the work's collectives in its own thread (a communication
observer or a debug check of :mod:`redistribute.comm` is on, or MPI lacks
``MPI_THREAD_MULTIPLE``), :func:`submit` first waits for the jobs already queued and runs
the job in the caller's thread: the same collectives on the same communicators in the same
order, so ranks that differ in that choice still match.
"""

from __future__ import annotations

import atexit
import queue
import threading
from collections.abc import Callable
from typing import Any

from . import comm as _comm

__all__ = ["Pending", "Started", "drain", "idle", "pending_count", "poll", "start", "submit"]

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

    def _run(self, fn: Callable[[], Any]) -> None:
        """Run the job, keeping its result or error (the handle is not done yet)."""
        try:
            self._result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter, who raises it
            self._error = exc


class Started:
    """The handle of work started as one nonblocking MPI request in the caller's thread
    (made by :func:`start`): its result once the request has completed."""

    __slots__ = ("_error", "_finish", "_request", "_result")

    def __init__(self, request: Any, finish: Callable[[], Any]) -> None:
        self._request = request
        self._finish: Callable[[], Any] | None = finish
        self._result: Any = None
        self._error: BaseException | None = None
        if request is None:
            self._complete()

    def done(self) -> bool:
        """Whether the work has finished; polls the request once (``MPI_Test``), finishing
        the work when it has completed. **Local**."""
        if self._request is not None and self._request.Test():
            self._complete()
        return self._request is None

    def wait(self) -> Any:
        """The work's result, after waiting for its request to complete; raises what its
        finishing step raised. **Collective** in effect: the request needs every rank's
        matching start.
        """
        if self._request is not None:
            self._request.Wait()
            self._complete()
        if self._error is not None:
            raise self._error
        return self._result

    def _complete(self) -> None:
        self._request = None
        _started.pop(id(self), None)
        finish, self._finish = self._finish, None
        try:
            self._result = finish()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter, who raises it
            self._error = exc


def start(request: Any, finish: Callable[[], Any]) -> Started:
    """The tracked handle of ``request``, just started by the caller (None: nothing to wait
    for), whose result is ``finish()`` once it completes; polls the handles started before.
    **Local**. The caller starts work only while :func:`idle`."""
    if _started:
        poll()
    handle = Started(request, finish)
    if handle._request is not None:
        _started[id(handle)] = handle
    return handle


def poll() -> None:
    """Finish the started handles whose requests have completed (``MPI_Test`` each once),
    dropped ones included. **Local**."""
    for handle in list(_started.values()):
        handle.done()


# Started handles whose request is in flight, by id: they keep the buffers of a dropped
# handle until the request completes. Touched by the callers' thread only.
_started: dict[int, Started] = {}
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
        handle._run(fn)
        with _lock:  # counted out before its waiter wakes: idle() then holds for it
            _count -= 1
            if _count == 0:
                _idle.notify_all()
        handle._done.set()
        del job, handle, fn  # the result belongs to the handle's holder only


def submit(fn: Callable[[], Any], inline: bool = False) -> Pending:
    """Run ``fn()`` after every job submitted before it; returns its handle at once.

    **Local** (the job itself is what it is). With ``inline`` (or without
    ``MPI_THREAD_MULTIPLE``) the job runs in this thread, after the queued jobs have
    finished, and the handle returned is already done.
    """
    global _thread, _count
    handle = Pending()
    if inline or not _THREADS:
        _wait_idle()
        handle._run(fn)
        handle._done.set()
        return handle
    with _lock:
        _count += 1
        if _thread is None:
            _thread = threading.Thread(target=_loop, name="dtensor-redistribute", daemon=True)
            _thread.start()
    _queue.put((handle, fn))
    return handle


def drain() -> None:
    """Wait until every submitted job and every started request has finished. **Local** (in
    effect collective, as :meth:`Pending.wait`)."""
    _wait_idle()
    for handle in list(_started.values()):
        handle.wait()


def _wait_idle() -> None:
    with _lock:
        while _count:
            _idle.wait()


def idle() -> bool:
    """Whether the worker has no job queued or running (a start in the caller's thread
    then follows every collective submitted before it). **Local**."""
    return _count == 0


def pending_count() -> int:
    """Jobs submitted and requests started that have not finished yet. **Local**."""
    return _count + len(_started)


@atexit.register
def _stop() -> None:
    """Let the queued jobs and started requests finish (their collectives are matched by
    the other ranks') and stop the thread, before MPI finalizes (registered after mpi4py's
    finalizer)."""
    global _thread
    drain()
    if _thread is not None:
        _queue.put(None)
        _thread.join()
        _thread = None
