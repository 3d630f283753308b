"""The hooks of the communication layer: one state object that says which of them are on.

This module owns:

- :data:`HOOKS`, the one :class:`HookState` of the process, and :func:`update`, the only
  writer of its fields (each setter of :mod:`redistribute.comm` goes through it, so the
  derived flags ``checks``, ``traced`` and ``active`` always follow the settings);
  :func:`hooks_active` says whether any hook is on;
- the observer registry of the communication debug mode (:func:`add_observer`,
  :func:`remove_observer`, :func:`notify`, and :func:`notified_what`, the ``what=`` of the
  point-to-point message being notified);
- the op source of the debug checks' fingerprints (:func:`set_op_source`) and the text of a
  collective's description ``what=`` (:func:`render`).

The settings of the other hooks are kept here by the modules that own them: the SPMD check
(:mod:`redistribute.comm.spmd`), the collective watchdog (:mod:`redistribute.comm.watchdog`)
and persistent all-gathers (:mod:`redistribute.comm.persistent`).

Every path that runs collectives reads this one object instead of each hook's own state:
the collectives of :class:`~redistribute.comm.Comm`, the Python executor
(:mod:`redistribute.execute`) and the compiled executor (``fastpath._redist``, plugged in
with this object by :mod:`redistribute.execute.compiled`), which hands every call to the
Python executor while ``traced`` is on. A new hook is a new field here, set through
:func:`update`; ``tests/unit/redistribute/test_comm_hooks_state.py`` lists every setter of the package
and checks that each one moves this state.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from placements.errors import CommError

__all__ = [
    "HOOKS",
    "HookState",
    "add_observer",
    "hooks_active",
    "notified_what",
    "notify",
    "remove_observer",
    "render",
    "set_op_source",
    "update",
]


def _no_op() -> str | None:
    return None


class HookState:
    """Which hooks of the communication layer are on. Read its attributes anywhere; change
    them only with :func:`update`.

    Attributes
    ----------
    observers : tuple of callables
        The observers of :func:`add_observer`, in registration order.
    op_source : callable
        ``fn() -> op name or None``, asked by the debug checks (:func:`set_op_source`).
    spmd : bool
        Whether the SPMD divergence check is on (:mod:`redistribute.comm.spmd`).
    watchdog : object or None
        The running collective watchdog (:mod:`redistribute.comm.watchdog`), or None.
    persistent : bool
        Whether redistributes run their small all-gathers as persistent requests
        (:mod:`redistribute.comm.persistent`).
    checks : bool
        Derived: the SPMD check or the watchdog is on (collectives enter the checks).
    traced : bool
        Derived: an observer or a check is on (collectives run under the hooks, and the
        compiled executor leaves every call to the Python one).
    active : bool
        Derived: any hook is on (``traced`` or ``persistent``).
    """

    __slots__ = (
        "active", "checks", "observers", "op_source", "persistent", "spmd", "traced", "watchdog",
    )  # fmt: skip

    def __init__(self) -> None:
        self.observers: tuple[Callable[[str, int, Any], None], ...] = ()
        self.op_source: Callable[[], str | None] = _no_op
        self.spmd = False
        self.watchdog: Any = None
        self.persistent = False
        self.checks = self.traced = self.active = False


#: The hook state of this process (the one object every path reads).
HOOKS = HookState()


def update(**settings: Any) -> None:
    """Set fields of :data:`HOOKS` (``observers``, ``op_source``, ``spmd``, ``watchdog``,
    ``persistent``) and recompute its derived flags (``checks``, ``traced``, ``active``).
    **Local**."""
    for name, value in settings.items():
        setattr(HOOKS, name, value)
    HOOKS.checks = HOOKS.spmd or HOOKS.watchdog is not None
    HOOKS.traced = bool(HOOKS.observers) or HOOKS.checks
    HOOKS.active = HOOKS.traced or HOOKS.persistent


def hooks_active() -> bool:
    """Whether any hook of the communication layer is on: an observer, the SPMD check, the
    watchdog or persistent all-gathers (:data:`HOOKS` tells which). **Local**."""
    return HOOKS.active


def add_observer(fn: Callable[[str, int, Any], None]) -> None:
    """Register ``fn(kind, nbytes, comm)``, called before every collective. **Local**.

    ``kind`` is one of ``"all_gather"``, ``"all_reduce"``, ``"reduce_scatter"``,
    ``"all_to_all"``, ``"scatter"``, ``"broadcast"``, ``"barrier"`` and
    ``"all_gather_ints"`` (small metadata exchanges); ``nbytes`` is the larger of the bytes
    this rank passes into the collective and the bytes it gets out of it; ``comm`` is the
    :class:`~redistribute.comm.Comm` the collective runs on (``comm.mesh_dim`` tells the
    mesh dim).
    """
    update(observers=(*HOOKS.observers, fn))


def remove_observer(fn: Callable[[str, int, Any], None]) -> None:
    """Unregister an observer added with :func:`add_observer`. **Local**."""
    observers = list(HOOKS.observers)
    try:
        observers.remove(fn)
    except ValueError:
        raise CommError(f"remove_observer: {fn!r} is not a registered observer") from None
    update(observers=tuple(observers))


#: The ``what=`` of the message being notified, per thread (asynchronous redistributes
#: notify from a worker thread).
_NOTIFYING = threading.local()


def notify(kind: str, nbytes: int, comm: Any, what: object = None) -> None:
    """Tell the observers of a collective of ``kind`` over ``nbytes`` bytes on ``comm`` (a
    :class:`~redistribute.comm.Comm`, or a stand-in with its attributes such as dtensor's
    abstract mesh groups). **Local**; nothing while no observer is registered.

    ``what`` (the ``what=`` of a point-to-point message: a pipeline passes a record with
    its stage, micro-batch and direction) is what :func:`notified_what` returns to the
    observers while they run.
    """
    _NOTIFYING.what = what
    try:
        for fn in HOOKS.observers:
            fn(kind, int(nbytes), comm)
    finally:
        _NOTIFYING.what = None


def notified_what() -> object:
    """The ``what=`` of the message whose observers :func:`notify` is calling now on this
    thread (``Comm.isend`` / ``Comm.irecv`` pass theirs); None outside a notification or
    for a collective. **Local**."""
    return getattr(_NOTIFYING, "what", None)


def set_op_source(fn: Callable[[], str | None] | None) -> None:
    """Register ``fn() -> op name or None``, asked for the op being dispatched. **Local**.

    The debug checks put that name into each collective's fingerprint (importing
    ``dtensor.debug`` registers the dispatcher's "current op"); ``None`` unregisters. It
    turns no hook on by itself.
    """
    update(op_source=_no_op if fn is None else fn)


def render(what: object) -> str:
    """The text of a collective's description ``what=`` (a string, or a tuple of parts
    joined with spaces). **Local**."""
    if isinstance(what, tuple):
        return " ".join(str(w) for w in what)
    return str(what)
