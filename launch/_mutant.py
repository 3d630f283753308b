"""pytest plugin of ``python -m launch mutate``: one mutation applied in every test process.

Loaded with ``-p launch._mutant``. When ``DTENSOR_MUTATION`` names a mutation of
:mod:`launch.mutations`, the plugin applies it before any test runs, in every test process
(every MPI rank loads the plugin), and undoes it at the end. Without the variable the plugin
does nothing.

- A source mutation (:mod:`launch.source_mutations`) is installed when pytest imports the
  plugin, which it does (``-p``) before the conftest files and the tests: the import hook
  must be in place before the mutated module is first imported. The plugin therefore looks
  the name up in that table first, which imports nothing of the product.
- A rule or plan mutation is applied in :func:`pytest_configure`. The plugin imports
  ``dtensor`` first: the op records register the rules of the ops they declare (the unary
  ops), so the rule table is complete before a mutation wraps an entry of it and no later
  registration replaces the wrapper.

When ``DTENSOR_MUTATION_LOG`` names a file, each process appends to it (one short line per
write, so ranks may share the file):

- ``fired <pid>`` the first time the mutation changes a rule's answer or a plan, or runs its
  mutated source line (written at once, so it survives an ``MPI_Abort``), and
  ``count <pid> <n>`` at the end;
- ``error <pid> <message>`` when the mutation cannot be applied (an unknown name, a rule that
  is not registered, a snippet that is not in its module once); the run then stops with a
  usage error.

:func:`read_log` reads such a file back for the runner.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from . import source_mutations
from ._source import MutationError, SourcePatch

__all__ = ["LogSummary", "activate", "pytest_configure", "pytest_unconfigure", "read_log"]

#: Environment variables the plugin reads.
NAME_VAR = "DTENSOR_MUTATION"
LOG_VAR = "DTENSOR_MUTATION_LOG"

_state: dict[str, object] = {}


def _append(log: str | None, line: str) -> None:
    if log:
        with open(log, "a") as f:
            f.write(line + "\n")


class _Counter:
    """Counts the firings of a mutation; logs the first one at once."""

    def __init__(self, log: str | None) -> None:
        self.log = log
        self.n = 0

    def __call__(self) -> None:
        self.n += 1
        if self.n == 1:
            _append(self.log, f"fired {os.getpid()}")


def _install_source() -> None:
    """Install the import hook of the source mutation the environment names, if it names
    one (at the plugin's import: before the product is imported)."""
    name = os.environ.get(NAME_VAR)
    entry = source_mutations.BY_NAME.get(name or "")
    if entry is None:
        return
    log = os.environ.get(LOG_VAR)
    counter = _Counter(log)
    try:
        remove = entry.patch.install(counter)
    except MutationError as exc:
        _append(log, f"error {os.getpid()} {exc}")
        _state["error"] = str(exc)
        return
    _state.update(counter=counter, undo=remove)


_install_source()

# dtensor's op records register the rules of the unary ops: imported first, the rule table is
# complete before a mutation wraps it (an MPI run imports nothing of dtensor before its tests)
import dtensor  # noqa: F401
from placements.errors import ConfigError

from . import mutations


def activate(name: str, log: str | None = None) -> tuple[_Counter, object]:
    """Apply mutation ``name``; return its firing counter and its undo function. **Local**.

    Raises ConfigError or MutationError (after logging it) when the mutation cannot be
    applied. A source mutation is applied by installing its import hook: it changes the
    module's later imports only.
    """
    try:
        mutation = mutations.get(name)
        counter = _Counter(log)
        patch = mutation.patch
        undo = patch.install(counter) if isinstance(patch, SourcePatch) else patch.apply(counter)
    except (ConfigError, MutationError) as exc:
        _append(log, f"error {os.getpid()} {exc}")
        raise
    return counter, undo


def pytest_configure(config: pytest.Config) -> None:
    if "error" in _state:
        raise pytest.UsageError(str(_state["error"]))
    name = os.environ.get(NAME_VAR)
    if not name or "counter" in _state:  # none, or a source mutation already installed
        return
    try:
        counter, undo = activate(name, os.environ.get(LOG_VAR))
    except (ConfigError, MutationError) as exc:
        raise pytest.UsageError(str(exc)) from exc
    _state.update(counter=counter, undo=undo)


def pytest_unconfigure(config: pytest.Config) -> None:
    counter = _state.pop("counter", None)
    undo = _state.pop("undo", None)
    if counter is None:
        return
    undo()  # type: ignore[operator]
    _append(counter.log, f"count {os.getpid()} {counter.n}")  # type: ignore[attr-defined]


@dataclass(frozen=True)
class LogSummary:
    """What the processes of one or more runs logged: firings and errors."""

    fired: int  # total firings counted at the end (processes that ended normally)
    fired_processes: int  # processes that fired at least once
    errors: tuple[str, ...]


def read_log(path: str | os.PathLike[str]) -> LogSummary:
    """Read a mutation log written by this plugin (a missing file: nothing logged). **Local**."""
    fired: set[str] = set()
    counts: dict[str, int] = {}
    errors: list[str] = []
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        lines = []
    for line in lines:
        word, _, rest = line.partition(" ")
        if word == "fired":
            fired.add(rest)
        elif word == "count":
            pid, _, n = rest.partition(" ")
            counts[pid] = int(n)
            if int(n):
                fired.add(pid)
        elif word == "error":
            errors.append(rest.partition(" ")[2])
    return LogSummary(sum(counts.values()), len(fired), tuple(errors))
