# Quiet raw forms: what the front runs for an op that computes, it runs with numpy's
# floating-point errors ignored, as dtensor's kernels do (PyTorch gives inf and nan without
# a warning). numpy keeps its error state in a context variable; dtensor plugs in a context
# in which that state ignores them (set_quiet), shared by the short paths of every thread:
# entering it costs about one C call, and the caller's own error state, with whatever its
# own numpy code reports, is never touched. A context can be entered by one thread at a
# time: a thread that finds it entered runs dtensor's quiet_call (a context of its own).

cdef extern from "Python.h":
    int PyContext_Enter(object ctx) except -1
    int PyContext_Exit(object ctx) except -1

cdef object _quiet_ctx = None     # the shared quiet context (None: quiet_call only)
cdef object _quiet_call = None    # dtensor's quiet_call(fn, *args)


def set_quiet(ctx, quiet_call):
    """Plug in the shared context in which numpy ignores floating-point errors (or None)
    and ``quiet_call(fn, *args)``, which runs ``fn`` quietly in any case. **Local**."""
    global _quiet_ctx, _quiet_call
    _quiet_ctx, _quiet_call = ctx, quiet_call


cdef inline bint _quiet_enter() except -1:
    """Enter the shared quiet context: True, or False when it cannot be (another thread is
    in it, or there is none) and the caller must run through ``_quiet_call``."""
    if _quiet_ctx is None:
        return False
    try:
        PyContext_Enter(_quiet_ctx)
    except RuntimeError:
        return False
    return True
