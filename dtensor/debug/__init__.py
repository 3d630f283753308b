"""Debugging tools: communication counting, explanations of decisions, strict mode, logging,
the SPMD check and watchdog, sharding visualisation, pipeline schedule timelines, the caches' statistics and the dispatch
path in use (compiled fast path or Python). They attach to the dispatcher through its
listener API (:func:`dtensor.dispatch.dispatcher.add_listener`) and to the collectives
through :func:`redistribute.comm.add_observer`."""

from __future__ import annotations

from ..dispatch.dispatcher import (
    cache_stats,
    clear_caches,
    clear_prop_cache,
    prop_cache_stats,
    set_prop_cache_size,
)
from ._comm_mode import CommDebugMode, CommRecord
from ._explain import Collective, Explanation, OpExplanation, PointToPoint, explain
from ._fastpath import fastpath_status, set_fastpath
from ._log import configure_logging
from ._schedule_viz import visualize_schedule
from ._spmd import check_spmd
from ._strict import ImplicitRedistributeError, no_implicit_redistribute
from ._visualize import shard_blocks, visualize_sharding
from ._watchdog import watchdog

__all__ = [
    "Collective",
    "CommDebugMode",
    "CommRecord",
    "Explanation",
    "ImplicitRedistributeError",
    "OpExplanation",
    "PointToPoint",
    "cache_stats",
    "check_spmd",
    "clear_caches",
    "clear_prop_cache",
    "configure_logging",
    "explain",
    "fastpath_status",
    "no_implicit_redistribute",
    "prop_cache_stats",
    "set_fastpath",
    "set_prop_cache_size",
    "shard_blocks",
    "visualize_schedule",
    "visualize_sharding",
    "watchdog",
]
