"""SPMD divergence detection: ``dt.debug.check_spmd()``.

This module owns the user-facing switch of the SPMD check whose mechanism lives in
:mod:`redistribute.comm`: while it is on, every collective first makes the ranks of its
communicator agree on a fingerprint (collective kind, the op being dispatched, the
redistribute step and spec, counts, dtype, reduce op, a per-communicator call counter), and
a mismatch makes every rank raise :class:`dtensor.errors.CommError` showing all the ranks'
fingerprints instead of hanging. ``DTENSOR_CHECK_SPMD=1`` turns it on for a whole run.

Importing this module also tells :mod:`redistribute.comm` which op the dispatcher is
running, so fingerprints name it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from redistribute import comm as _comm

from ..dispatch import dispatcher as _dispatch

__all__ = ["check_spmd"]

_comm.set_op_source(_dispatch.current_op)


@contextmanager
def check_spmd(enabled: bool = True) -> Iterator[None]:
    """Check, before every collective in the block, that all ranks agree on it.

    **Local** to enter and leave (no communication), but every rank must enter and leave
    the block at the same point of the program, since the check adds a small collective
    (an all-gather of one int64) in front of each collective. Blocks nest; leaving one
    restores the setting it found. Cost: see the README (a few microseconds per
    collective at 2 ranks).

    Parameters
    ----------
    enabled : bool
        False turns the check off inside the block (e.g. in a hot loop of a run started
        with ``DTENSOR_CHECK_SPMD=1``).

    Raises
    ------
    CommError
        Inside the block, on every rank of a communicator whose ranks enter different
        collectives (or the same one with different counts, dtypes or reduce ops).

    Examples
    --------
    >>> with dt.debug.check_spmd():
    ...     y = (x @ w).sum()
    """
    prev = _comm.set_check_spmd(enabled)
    try:
        yield
    finally:
        _comm.set_check_spmd(prev)
