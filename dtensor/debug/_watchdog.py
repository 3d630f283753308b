"""The collective watchdog as a context manager: ``dt.debug.watchdog(seconds)``.

This module owns the user-facing switch of the watchdog of :mod:`redistribute.comm`
(``DTENSOR_WATCHDOG=seconds`` turns it on for a whole run): a daemon thread reports to
stderr any collective of this rank that has not returned after the timeout (kind,
communicator, mesh dim, fingerprint, how long, and where the other ranks of that
communicator on this node are), and optionally aborts the job. The ranks of a node share
their state through files in a private folder (mode 0700): the one ``python -m launch``
makes for the job (``DTENSOR_WATCHDOG_DIR``), else one of this user under the temporary
directory; a folder that someone else could have planted is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from redistribute import comm as _comm

__all__ = ["watchdog"]


@contextmanager
def watchdog(seconds: float, abort: bool = False) -> Iterator[None]:
    """Report collectives that block longer than ``seconds`` inside the block. **Local**.

    Parameters
    ----------
    seconds : float
        Timeout (> 0) after which a collective still running is reported on stderr.
    abort : bool
        After the report, abort the whole job (``MPI_Abort``) instead of waiting on.

    Raises
    ------
    ConfigError
        If ``seconds`` is not positive, or the folder for the watchdog's state is a
        symlink, someone else's, or open to other users.

    Notes
    -----
    Leaving the block stops the watchdog, or restarts the one configured by
    ``DTENSOR_WATCHDOG`` if the run has one.
    """
    _comm.set_watchdog(seconds, abort)
    try:
        yield
    finally:
        _comm.set_watchdog(None)
        _comm.configure_from_env()
