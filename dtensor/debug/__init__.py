"""Debugging tools: communication counting and the propagation cache's statistics."""

from __future__ import annotations

from .._dispatch import clear_prop_cache, prop_cache_stats, set_prop_cache_size
from ._comm_mode import CommDebugMode, CommRecord

__all__ = [
    "CommDebugMode",
    "CommRecord",
    "clear_prop_cache",
    "prop_cache_stats",
    "set_prop_cache_size",
]
