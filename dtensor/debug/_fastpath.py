"""Which dispatch path serves DTensor ops, and switching it at runtime."""

from __future__ import annotations

import os

import fastpath

from ..dispatch.dispatcher import prop_cache_stats
from ..dispatch.entry_points import fastpath_active, set_fastpath

__all__ = ["fastpath_status", "set_fastpath"]


def fastpath_status() -> dict[str, object]:
    """Which path serves DTensor ops now, why, and the cache counters of each path. **Local**.

    Returns
    -------
    dict
        ``active`` (the compiled front serves ops now), ``path`` (``"compiled"`` or
        ``"python"``), ``available`` (the extension is built and enabled at import),
        ``built`` (the extension imports), ``env`` (``DTENSOR_FASTPATH`` or None),
        ``reason`` (why the Python path serves, or None), and the propagation cache's
        ``fast_hits``, ``python_hits`` and ``misses`` (misses always go to the Python path),
        ``fast_redistributes`` (redistributes the compiled path ran, by
        ``DTensor.redistribute`` and as ops' input moves: one-step plans of the kinds
        :func:`redistribute.execute.compiled_form` describes; 0 on the Python path),
        ``fast_redistribute_kinds`` (the same by kind: ``gather``, ``all_reduce``,
        ``reduce_scatter``, ``all_to_all``, ``local``) and ``fast_moved_ops`` (propagation
        cache hits whose input moves the compiled front ran itself, without the Python
        dispatcher).
    """
    active = fastpath_active()
    if active:
        reason = None
    elif not fastpath.AVAILABLE:
        reason = f"extension not built ({fastpath.IMPORT_ERROR})"
    elif not fastpath.ENABLED:
        reason = "DTENSOR_FASTPATH=0 at import"
    else:
        reason = "turned off by set_fastpath(False)"
    stats = prop_cache_stats()
    return {
        "active": active,
        "path": "compiled" if active else "python",
        "available": fastpath.ENABLED,
        "built": fastpath.AVAILABLE,
        "env": os.environ.get("DTENSOR_FASTPATH"),
        "reason": reason,
        "fast_hits": stats["fast_hits"],
        "python_hits": stats["python_hits"],
        "misses": stats["misses"],
        "fast_redistributes": fastpath.dispatch.stats()["redistributes"] if fastpath.ENABLED else 0,
        "fast_redistribute_kinds": fastpath.redist.redistribute_kinds() if fastpath.ENABLED else {},
        "fast_moved_ops": fastpath.dispatch.stats()["moved"] if fastpath.ENABLED else 0,
    }
