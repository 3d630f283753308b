"""A tap on the dispatcher: listeners see every dispatched op's cache entry.

This module owns the listener registry used by the debugging tools that must see each
dispatched op's decision (``explain`` of a function, strict mode, ``DTENSOR_LOG``). While
at least one listener is registered, the dispatcher's ``lookup``, ``run_entry`` and
``_build_entry`` are wrapped, and the compiled front (when plugged in) is re-plugged with
the wrappers and kept from serving calls on its own, so every call of a table op on
DTensors reaches ``run_entry``. Before an entry runs, every listener is called as
``fn(entry, miss, values, mesh)`` with the :class:`dtensor.dispatch.dispatcher.CacheEntry` (the
chosen strategy, the stored redistribute plans and output specs), whether the propagation
cache missed for this call, the call's bound arguments (DTensors not yet replaced by their
local tensors; listeners must not modify them) and the mesh. A listener may raise to stop
the op before it communicates. With no listener the dispatcher is untouched.
"""

from __future__ import annotations

from collections.abc import Callable

from ..dispatch import dispatcher as _dispatch

__all__ = ["add_listener", "remove_listener"]

Listener = Callable[["_dispatch.CacheEntry", bool, list, object], None]

_listeners: list[Listener] = []
_originals: dict[str, Callable] = {}
_missed = False


def _build_entry(*args: object) -> _dispatch.CacheEntry:
    global _missed
    _missed = True
    return _originals["_build_entry"](*args)


def _lookup(*args: object) -> tuple:
    entry, _key, mesh = _originals["lookup"](*args)
    # No key: the compiled front then runs the entry through run_entry and keeps no copy.
    return entry, None, mesh


def _run_entry(entry: _dispatch.CacheEntry, values: list, mesh: object) -> object:
    global _missed
    miss, _missed = _missed, False
    for fn in tuple(_listeners):
        fn(entry, miss, values, mesh)
    return _originals["run_entry"](entry, values, mesh)


_WRAPPERS = {"_build_entry": _build_entry, "lookup": _lookup, "run_entry": _run_entry}


def _replug() -> None:
    """Hand the current functions to the compiled front and drop its own entries."""
    if _dispatch._FRONT is not None:
        _dispatch.plug_fastpath()
        _dispatch._FRONT.invalidate()


def add_listener(fn: Listener) -> None:
    """Call ``fn(entry, miss, values, mesh)`` before every dispatched op runs. **Local**."""
    if not _listeners:
        for name, wrapper in _WRAPPERS.items():
            _originals[name] = getattr(_dispatch, name)
            setattr(_dispatch, name, wrapper)
        _replug()
    _listeners.append(fn)


def remove_listener(fn: Listener) -> None:
    """Stop calling ``fn``; the last removal restores the dispatcher. **Local**."""
    _listeners.remove(fn)
    if not _listeners:
        for name, original in _originals.items():
            setattr(_dispatch, name, original)
        _originals.clear()
        _replug()
