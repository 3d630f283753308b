"""The settings of the communication layer's hooks that come from the environment.

This module owns :func:`configure_from_env`, which reads ``DTENSOR_CHECK_SPMD``
(:mod:`redistribute.comm.spmd`), ``DTENSOR_PERSISTENT``
(:mod:`redistribute.comm.persistent`), ``DTENSOR_WATCHDOG`` and
``DTENSOR_WATCHDOG_ABORT`` (:mod:`redistribute.comm.watchdog`); it runs when
:mod:`redistribute.comm` is imported and again at each mesh creation.
"""

from __future__ import annotations

from . import persistent, spmd, watchdog

__all__ = ["configure_from_env"]


def configure_from_env() -> None:
    """Read ``DTENSOR_CHECK_SPMD``, ``DTENSOR_PERSISTENT``, ``DTENSOR_WATCHDOG``,
    ``DTENSOR_WATCHDOG_ABORT``. **Local**.

    Called at import and at each mesh creation. ``DTENSOR_WATCHDOG`` is a timeout in
    seconds (unset, empty or 0: off); a forced setting (:func:`set_check_spmd`,
    :func:`set_persistent`) wins over the environment.
    """
    spmd.read_env()
    persistent.read_env()
    watchdog.read_env()
