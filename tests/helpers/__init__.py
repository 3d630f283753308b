"""Helpers shared by the test folders, in one place (import them as ``helpers.<module>``).

- :mod:`helpers.sim`: simulated meshes for one-process dispatch tests (no MPI);
- :mod:`helpers.jobs`: subprocess jobs (launcher jobs, ``mpiexec`` programs) started by unit
  tests, with the installed packages first on their path;
- :mod:`helpers.mpi`: what the MPI tests build on every rank (the meshes to run on, data,
  DTensors with random Partial contributions); it imports mpi4py.

This package is importable because the ``tests`` folder is on ``sys.path``: it holds the
root ``conftest.py`` (pytest puts its folder first) and the test runner starts pytest there.
Nothing here may import the source tree by path: the tests run against the installed packages.

:data:`TESTS` is this ``tests`` folder and :data:`ROOT` the checkout that holds it (for the
tests that read the sources or run the checkout's scripts).
"""

from __future__ import annotations

from pathlib import Path

#: The ``tests`` folder.
TESTS = Path(__file__).resolve().parents[1]
#: The checkout (the folder that holds ``tests``).
ROOT = TESTS.parent
