"""Harness of the MPI tests (run under ``mpiexec -n K python -m pytest tests/mpi --with-mpi``).

- A test that fails on one rank of a multi-rank run ends the whole job: the failure is
  printed to stderr with a ``[rank R]`` prefix, then ``MPI_Abort`` — the other ranks would
  otherwise wait forever in the test's next collective. Each rank leaves the launcher's
  start record (:func:`launch._rank.record_start`), so that the runner removes the MPI
  library's shared-memory files that such an abort leaves.
- Only rank 0 writes pytest's terminal report (the others would repeat it); failures on
  any rank are still shown by the abort above.
- Hypothesis draws the same examples on every rank (derandomized, no example database,
  and no time-based search for further bugs once one is found), so every rank runs the
  same collectives.
- Fixtures: ``comm`` (``MPI.COMM_WORLD``), ``seed`` (one integer per session, the same on
  every rank; ``DTENSOR_TEST_SEED`` fixes it) and ``rng`` (a numpy Generator seeded from
  ``seed`` and the test's id, identical on every rank) and ``folder`` (a fresh folder that
  every rank shares, removed after the test).

Skips must depend on the world size only (``@pytest.mark.mpi(min_size=N)``), so that
all ranks skip together; a skip whose reason ``tests/skips.py`` does not expect fails the
session, on every rank that skipped it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import tempfile
import zlib

import numpy as np
import pytest
import skips
from hypothesis import settings
from mpi4py import MPI

from launch._rank import record_start

#: The session seed, set in pytest_configure (the same value on every rank).
SEED: int = 0

settings.register_profile(
    "mpi", parent=settings(), derandomize=True, database=None, report_multiple_bugs=False
)
settings.load_profile("mpi")


def _rank_prefixed(text: str) -> str:
    prefix = f"[rank {MPI.COMM_WORLD.Get_rank()}] "
    return "".join(prefix + line + "\n" for line in text.splitlines())


def _abort(what: str, longrepr: str) -> None:
    world = MPI.COMM_WORLD
    sys.stderr.write(
        _rank_prefixed(
            f"{what}\n{longrepr}\naborting all {world.Get_size()} ranks (DTENSOR_TEST_SEED={SEED})"
        )
    )
    sys.stdout.flush()
    sys.stderr.flush()
    world.Abort(1)


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    global SEED
    world = MPI.COMM_WORLD
    SEED = world.bcast(int(os.environ.get("DTENSOR_TEST_SEED", secrets.randbits(32))), root=0)
    # as the launcher's rank bootstrap does: the stage's runner (python -m launch test)
    # then removes the MPI library's /dev/shm files when a failure aborts the stage
    record_start(world.Get_rank())
    skips.register(config, label=f"[rank {world.Get_rank()}] ")
    if world.Get_rank() != 0:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


def pytest_report_header() -> str:
    return f"MPI world size {MPI.COMM_WORLD.Get_size()}; DTENSOR_TEST_SEED={SEED}"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int) -> None:
    if exitstatus != 0:
        terminalreporter.write_line(f"to reproduce, set DTENSOR_TEST_SEED={SEED}")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed and MPI.COMM_WORLD.Get_size() > 1:
        _abort(f"FAILED {report.nodeid} ({report.when})", report.longreprtext)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed and MPI.COMM_WORLD.Get_size() > 1:
        _abort(f"ERROR collecting {report.nodeid}", report.longreprtext)


@pytest.fixture(scope="session")
def comm() -> MPI.Intracomm:
    """``MPI.COMM_WORLD``."""
    return MPI.COMM_WORLD


@pytest.fixture(scope="session")
def seed() -> int:
    """The session's random seed, identical on every rank."""
    return SEED


@pytest.fixture
def rng(seed: int, request: pytest.FixtureRequest) -> np.random.Generator:
    """A numpy Generator for this test, identical on every rank."""
    return np.random.default_rng([seed, zlib.crc32(request.node.nodeid.encode())])


@pytest.fixture
def folder():
    """A fresh folder shared by every rank (rank 0 makes it and removes it afterwards)."""
    world = MPI.COMM_WORLD
    path = world.bcast(tempfile.mkdtemp(prefix="dtensor-test-") if world.rank == 0 else None)
    yield path
    world.Barrier()
    if world.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
