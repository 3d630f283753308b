"""Running numpy with its floating-point errors ignored, at little cost.

PyTorch never warns when a kernel produces inf or nan (``1 / 0``, ``log(-1)``, an overflow
in a sum or a cast); numpy does. This module owns the contexts in which dtensor's kernels,
casts and copies run with numpy's floating-point errors ignored: :data:`QUIET`,
:func:`quiet_call`, :func:`quiet_run` and :func:`quiet_function`. It sits below
:mod:`dtensor.local.tensor`, so the Tensor's own casts use it too.
"""

from __future__ import annotations

import contextvars
import functools
import threading

import numpy as np

__all__ = ["QUIET", "quiet_call", "quiet_function", "quiet_run"]

# Note: PyTorch never warns when a kernel produces inf or nan (1 / 0, log(-1), overflow);
# numpy does. dtensor's kernels run with numpy's floating-point errors ignored, in contexts
# of their own (numpy >= 2 keeps its error state in a context variable): the caller's error
# state, and what its own numpy code reports, are untouched. Entering a context costs about
# one C call (``np.errstate`` costs microseconds): the short paths of the elementwise
# kernels run their numpy call in QUIET, and whole kernels in another context, each shared
# by every thread; a thread that finds one entered by another thread (which numpy lets run
# while it computes) uses a context of its own.
_IN_QUIET = contextvars.ContextVar("dtensor_quiet", default=False)


def _ignore_errors() -> None:
    np.seterr(all="ignore")
    _IN_QUIET.set(True)


def quiet_context() -> contextvars.Context | None:
    """A new context in which numpy ignores floating-point errors (and :func:`quiet_call`
    knows that it runs inside one), or None with numpy < 2, whose error state is not a
    context variable (quiet calls then use ``np.errstate``). **Local**."""
    before = np.geterr()
    ctx = contextvars.Context()
    ctx.run(_ignore_errors)
    if np.geterr() != before:  # numpy < 2 set its thread-wide state: undo it
        np.seterr(**before)
        return None
    return ctx


#: The quiet context of the short paths, shared by the threads (None with numpy < 2).
QUIET = quiet_context()
# ... and the one of whole kernels (which may run short paths inside: another context)
_KERNELS = quiet_context()


def _errstate_run(fn, *args, **kwargs):
    with np.errstate(all="ignore"):
        return fn(*args, **kwargs)


_kernels_run = _errstate_run if _KERNELS is None else _KERNELS.run


class _ThreadQuiet(threading.local):
    """``run``: the ``Context.run`` of this thread's own quiet context."""

    def __init__(self) -> None:
        ctx = quiet_context()
        self.run = _errstate_run if ctx is None else ctx.run


_THREAD = _ThreadQuiet()


def _busy(exc: RuntimeError) -> bool:
    """Whether ``exc`` says that a shared context is entered (by another thread)."""
    return str(exc).startswith("cannot enter context")


def quiet_call(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with numpy's floating-point errors ignored. **Local**.

    In the shared kernel context (this thread's own when another thread is in it); directly
    when a quiet call is running already."""
    if _IN_QUIET.get():
        return fn(*args, **kwargs)
    try:
        return _kernels_run(fn, *args, **kwargs)
    except RuntimeError as exc:
        if not _busy(exc):
            raise
    return _THREAD.run(fn, *args, **kwargs)


#: ``quiet_run(fn, *args)``: ``fn(*args)`` in the shared quiet context of the short paths of
#: the elementwise kernels, whose ``fn`` is one numpy call (nothing inside enters a context).
#: It raises RuntimeError when another thread is inside: then use :func:`quiet_call`.
quiet_run = quiet_call if QUIET is None else QUIET.run


def quiet_function(fn):
    """``fn`` made to run with numpy's floating-point errors ignored (a function, or a
    method when set on a class), marked ``quiet``; ``fn`` itself when it is marked already
    (a kernel that runs its numpy calls quietly itself). **Local**."""
    if getattr(fn, "quiet", False):
        return fn

    def quiet(*args, **kwargs):
        return quiet_call(fn, *args, **kwargs)

    functools.update_wrapper(quiet, fn)
    quiet.quiet = True
    return quiet
