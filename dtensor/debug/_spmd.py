"""SPMD divergence detection: ``dt.debug.check_spmd()``.

This module owns the user-facing switch of the SPMD check whose mechanism lives in
:mod:`redistribute.comm`: while it is on, every collective first makes the ranks of its
communicator agree on a fingerprint (collective kind, the op being dispatched, the
redistribute step and spec, counts, dtype, reduce op, a per-communicator call counter), and
a mismatch makes every rank raise :class:`dtensor.errors.CommError` showing all the ranks'
fingerprints instead of hanging. Leaving the block is checked the same way (normally, or
raising which exception type). ``DTENSOR_CHECK_SPMD=1`` turns the check on for a whole run.

Importing this module also tells :mod:`redistribute.comm` which op the dispatcher is
running, so fingerprints (and the watchdog's reports) name it, as ``CommDebugMode`` does:
a collective of a backward pass names the op whose backward issued it and the phase
(``"matmul (backward)"``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from redistribute import comm as _comm

from ..dispatch import dispatcher as _dispatch
from ..local import grad_engine as _ag

__all__ = ["check_spmd", "op_label"]


def op_label() -> str | None:
    """The op a collective issued now belongs to, as ``CommDebugMode`` labels it: the op
    being dispatched, or during a backward pass the op whose backward runs with
    `` (backward)`` (``"matmul (backward)"``; ``"redistribute (backward)"`` for a move
    outside any op); None outside ops. **Local**."""
    if _ag.in_backward():
        op = _ag.current_backward() or _dispatch.current_op() or "redistribute"
        return f"{op} (backward)"
    return _dispatch.current_op()


_comm.set_op_source(op_label)


@contextmanager
def check_spmd(enabled: bool = True) -> Iterator[None]:
    """Check, before every collective in the block and at its exit, that all ranks agree.

    **Local** to enter; **collective** over ``COMM_WORLD`` to leave while the check is on
    (every rank of ``COMM_WORLD`` must enter and leave the block at the same point of the
    program). Inside the block each collective is preceded by a small exchange of
    fingerprints with the other ranks of its communicator; leaving the block is itself a
    checked point where every rank tells the others whether it leaves normally or raising
    (and which exception type), so a rank that leaves through an exception while the others
    stay inside, or leave normally, makes every rank raise instead of leaving the others
    blocked. Blocks nest; leaving one restores the setting it found. Cost: see the README (a
    few microseconds per collective at 2 ranks).

    Parameters
    ----------
    enabled : bool
        False turns the check off inside the block (e.g. in a hot loop of a run started
        with ``DTENSOR_CHECK_SPMD=1``); the exit of such a block is not checked.

    Raises
    ------
    CommError
        Inside the block, on every rank of a communicator whose ranks enter different
        collectives (or the same one with different arguments), or on a rank that meets
        another's exit of the block at a collective; at the exit, on every rank when the
        ranks leave in different ways. Ranks that all leave raising the same exception type
        keep their own exceptions.

    Examples
    --------
    >>> with dt.debug.check_spmd():
    ...     y = (x @ w).sum()
    """
    prev = _comm.set_check_spmd(enabled)
    # calls served by the compiled front skip the dispatcher's checks that the SPMD check
    # adds (every index of x[idx] compared across ranks): it starts again from the
    # propagation cache
    _dispatch.drop_front_entries()
    try:
        yield
    except BaseException as exc:
        _comm.leave_check_block(exc)
        raise
    else:
        _comm.leave_check_block(None)
    finally:
        _comm.set_check_spmd(prev)
