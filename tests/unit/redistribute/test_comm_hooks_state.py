"""The one hook state of :mod:`redistribute.comm` (``HOOKS``, ``hooks_active()``).

Every function of the package that changes a hook setting is found from the sources (a
public function named ``set_*``/``add_*``/``remove_*``/``configure_*``, one with a
``global`` statement, or one that reaches ``hooks.update`` through functions of its own
module) and must be listed in :data:`SETTERS` with a way to turn its hook on and off: each
one must turn ``hooks_active()`` on and off again, so a hook added without going through the
state fails here. The compiled executor reads the same state: while a hook traces
collectives it leaves ``DTensor.redistribute`` to the Python executor.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil

import numpy as np
import pytest

import dtensor as dt
import fastpath
from redistribute import comm as C
from redistribute.comm import hooks as H
from redistribute.comm import persistent as CP
from redistribute.comm import spmd as CS
from redistribute.comm import watchdog as CW

pytestmark = pytest.mark.mode_independent  # see tests/conftest.py

needs_front = pytest.mark.skipif(
    not fastpath.ENABLED, reason="compiled fast path not enabled (not built or disabled)"
)

ENV = ("DTENSOR_CHECK_SPMD", "DTENSOR_PERSISTENT", "DTENSOR_WATCHDOG", "DTENSOR_WATCHDOG_ABORT")
PREFIXES = ("set_", "add_", "remove_", "configure_")


def _observer(kind, nbytes, comm):
    pass


def _op_source():
    return "op"


def _by_env(name, value, read):
    """``(on, off)``: set ``name`` to ``value`` in the environment (on) or unset it (off),
    then call ``read``."""

    def on(monkeypatch):
        monkeypatch.setenv(name, value)
        read()

    def off(monkeypatch):
        monkeypatch.delenv(name, raising=False)
        read()

    return on, off


def _by_calls(on, off):
    """``(on, off)`` of two calls."""
    return (lambda monkeypatch: on(), lambda monkeypatch: off())


OBSERVER = _by_calls(lambda: C.add_observer(_observer), lambda: C.remove_observer(_observer))

#: "module.function" -> (turn its hook on, turn it off, the field of HOOKS it sets); each
#: action takes pytest's monkeypatch.
SETTERS = {
    "hooks.add_observer": (*OBSERVER, "observers"),
    "hooks.remove_observer": (*OBSERVER, "observers"),
    "hooks.update": (*_by_calls(lambda: H.update(spmd=True), lambda: H.update(spmd=False)), "spmd"),
    "spmd.set_check_spmd": (
        *_by_calls(lambda: C.set_check_spmd(True), lambda: C.set_check_spmd(None)), "spmd"
    ),
    "spmd.read_env": (*_by_env("DTENSOR_CHECK_SPMD", "1", CS.read_env), "spmd"),
    "persistent.set_persistent": (
        *_by_calls(lambda: C.set_persistent(True), lambda: C.set_persistent(None)), "persistent"
    ),
    "persistent.read_env": (*_by_env("DTENSOR_PERSISTENT", "1", CP.read_env), "persistent"),
    "persistent.persistent_enabled": (
        *_by_env("DTENSOR_PERSISTENT", "1", C.persistent_enabled), "persistent"
    ),
    "watchdog.set_watchdog": (
        *_by_calls(lambda: C.set_watchdog(600.0), lambda: C.set_watchdog(None)), "watchdog"
    ),
    "watchdog.read_env": (*_by_env("DTENSOR_WATCHDOG", "600", CW.read_env), "watchdog"),
    "settings.configure_from_env": (
        *_by_env("DTENSOR_CHECK_SPMD", "1", C.configure_from_env), "spmd"
    ),
}
#: Setters that change a hook's content but turn none on.
NOT_A_SWITCH = {"hooks.set_op_source": "names the op in the fingerprints of the checks",
                "persistent.make_channel": "makes the channel where set_persistent's calls meet"}


def _setters_in(module: str, source: str) -> set[str]:
    """``module.function`` of each function of ``source`` that changes a hook setting (see
    the module docstring)."""
    funcs = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}

    def called(fn):
        return {n.func.id for n in ast.walk(fn) if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Name)}  # fmt: skip

    reaches = {name for name, fn in funcs.items() if "update" in called(fn)}
    while more := {name for name, fn in funcs.items() if called(fn) & reaches} - reaches:
        reaches |= more
    found = set()
    for name, fn in funcs.items():
        has_global = any(isinstance(n, ast.Global) for n in ast.walk(fn))
        if not name.startswith("_") and (
            name.startswith(PREFIXES) or has_global or name in reaches or name == "update"
        ):
            found.add(f"{module}.{name}")
    return found


def _all_setters() -> set[str]:
    found = set()
    for info in pkgutil.iter_modules(C.__path__):
        module = importlib.import_module(f"{C.__name__}.{info.name}")
        found |= _setters_in(info.name, inspect.getsource(module))
    return found


@pytest.fixture
def clean(monkeypatch, tmp_path):
    """No hook on, from the environment or forced; every setting restored afterwards."""
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DTENSOR_WATCHDOG_DIR", str(tmp_path / "watchdog"))
    spmd, persistent = C.set_check_spmd(None), C.set_persistent(None)
    observers = H.HOOKS.observers
    H.update(observers=())
    C.set_watchdog(None)
    C.configure_from_env()
    assert not C.hooks_active(), H.HOOKS
    yield monkeypatch
    C.set_watchdog(None)
    H.update(observers=observers)
    C.set_check_spmd(spmd)
    C.set_persistent(persistent)
    monkeypatch.undo()
    C.configure_from_env()


def test_every_setter_is_listed():
    found = _all_setters()
    assert found == set(SETTERS) | set(NOT_A_SWITCH), (
        "list each setter of redistribute.comm in SETTERS (how to turn its hook on and off) "
        f"or in NOT_A_SWITCH; unlisted: {sorted(found - set(SETTERS) - set(NOT_A_SWITCH))}, "
        f"gone: {sorted(set(SETTERS) | set(NOT_A_SWITCH) - found)}"
    )


def test_the_finder_sees_setters_that_bypass_the_state():
    source = (
        "FLAG = False\n"
        "def enable_flag():\n    global FLAG\n    FLAG = True\n"
        "def set_other(x):\n    pass\n"
        "def _private():\n    update(spmd=True)\n"
        "def refresh():\n    _private()\n"
        "def query():\n    return FLAG\n"
    )
    assert _setters_in("fake", source) == {"fake.enable_flag", "fake.set_other", "fake.refresh"}


@pytest.mark.parametrize("name", sorted(SETTERS))
def test_each_setter_flips_the_state(clean, name):
    on, off, field = SETTERS[name]
    on(clean)
    # persistent all-gathers need MPI 4's persistent collectives
    expected = CP._HAS_PERSISTENT if field == "persistent" else True
    assert C.hooks_active() is expected and bool(getattr(H.HOOKS, field)) is expected, name
    assert H.HOOKS.traced is (field != "persistent" and expected), name
    off(clean)
    assert not C.hooks_active(), (name, H.HOOKS)


def test_an_op_source_turns_nothing_on(clean):
    C.set_op_source(_op_source)
    try:
        assert H.HOOKS.op_source is _op_source and not C.hooks_active()
    finally:
        C.set_op_source(None)
    assert H.HOOKS.op_source() is None


@needs_front
@pytest.mark.parametrize("name", ["hooks.add_observer", "spmd.set_check_spmd",
                                  "watchdog.set_watchdog"])  # fmt: skip
def test_the_compiled_executor_leaves_traced_calls_to_python(clean, name):
    mesh = dt.init_device_mesh((1,))
    x = dt.distribute_tensor(np.arange(16.0).reshape(4, 4), mesh, [dt.Shard(0)])
    on, off, _ = SETTERS[name]

    def compiled_runs():
        before = dt.debug.fastpath_status()["fast_redistributes"]
        y = x.redistribute(mesh, [dt.Replicate()])
        np.testing.assert_array_equal(y.to_local().numpy(), np.arange(16.0).reshape(4, 4))
        return dt.debug.fastpath_status()["fast_redistributes"] - before

    assert compiled_runs() == 1
    on(clean)
    try:
        assert compiled_runs() == 0
    finally:
        off(clean)
    assert compiled_runs() == 1
