"""Logging of dtensor's decisions through the standard ``logging`` module.

This module owns the ``"dtensor"`` logger's setup: :func:`configure_logging` (called at
import when ``DTENSOR_LOG`` names a level, e.g. ``DTENSOR_LOG=debug``) adds a stderr handler
whose lines carry the MPI rank, and, at DEBUG level, logs every propagation-cache hit and
miss of the Python dispatcher (a miss with the chosen strategy and the redistribute plan of
every moved input) and every collective with its op, kind, mesh dim and bytes.
"""

from __future__ import annotations

import logging
import os

from placements.errors import ConfigError
from placements.types import placement_list
from redistribute import comm as _comm
from redistribute.explain import explain_plan, format_seconds

from ..dispatch import dispatcher as _dispatch

__all__ = ["LOGGER_NAME", "configure_logging", "logger"]

LOGGER_NAME = "dtensor"
logger = logging.getLogger(LOGGER_NAME)

_handler: logging.Handler | None = None
_tapped = False


def _rank() -> int:
    return _comm.world().rank


def _on_entry(entry: _dispatch.CacheEntry, miss: bool, values: list, mesh: object) -> None:
    if not logger.isEnabledFor(logging.DEBUG):
        return
    strategy = entry.strategy
    outs = ", ".join(placement_list(s.placements) for s in strategy.output_specs)
    if not miss:
        logger.debug("prop cache hit: %s -> %s", entry.name, outs)
        return
    ins = ", ".join(
        "-" if p is None else placement_list(p) for p in strategy.input_placements
    )
    cost = format_seconds(strategy.cost)
    lines = [f"prop cache miss: {entry.name}: {outs} <- {ins} (redistribution ~{cost})"]
    for i, move in enumerate(entry.moves):
        if isinstance(move, _dispatch.Redist) and move.steps:
            plan = explain_plan(move.src, move.dst.placements)
            lines += [f"  input {i}: {line}" for line in plan.splitlines()]
    logger.debug("\n".join(lines))


def _on_collective(kind: str, nbytes: int, comm: object) -> None:
    if logger.isEnabledFor(logging.DEBUG):
        op = _dispatch.current_op() or "redistribute"
        mesh_dim = getattr(comm, "mesh_dim", None)
        logger.debug("collective %s (op %s, mesh dim %s, %d bytes)", kind, op, mesh_dim, nbytes)


def configure_logging(level: str | int | None = None) -> None:
    """Route the ``"dtensor"`` logger to stderr at ``level``. **Local**.

    Parameters
    ----------
    level : str or int, optional
        A ``logging`` level or its name, case-insensitive (``"debug"``, ``"INFO"``...);
        default the ``DTENSOR_LOG`` environment variable. ``None``/empty does nothing.
        At DEBUG the dispatcher's cache hits/misses and plans and every collective are
        logged (ops served by the compiled fast path bypass the Python dispatcher: run with
        ``DTENSOR_FASTPATH=0`` to log every op).

    Raises
    ------
    ConfigError
        When ``level`` is not a level name (a ``ValueError``).
    """
    global _handler, _tapped
    if level is None:
        level = os.environ.get("DTENSOR_LOG", "")
    if level == "":
        return
    if isinstance(level, str):
        value = logging.getLevelName(level.strip().upper())
        if not isinstance(value, int):
            raise ConfigError(
                f"DTENSOR_LOG={level!r} is not a logging level (debug, info, warning, error)"
            )
        level = value
    logger.setLevel(level)
    if _handler is None:
        _handler = logging.StreamHandler()
        fmt = f"[rank {_rank()}] %(name)s %(levelname)s: %(message)s"
        _handler.setFormatter(logging.Formatter(fmt))
        logger.addHandler(_handler)
    if level <= logging.DEBUG and not _tapped:
        _dispatch.add_listener(_on_entry)
        _comm.add_observer(_on_collective)
        _tapped = True


configure_logging()
