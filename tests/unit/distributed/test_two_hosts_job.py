"""Four ranks as two hosts of two (``DTENSOR_SIM_HOSTS=2``, the test knob of
:mod:`redistribute.hosts`), in one real ``mpiexec`` job: the host tests (meshes know which
dims cross hosts; shared memory only within a host), the redistribute pairs on 1-D and 2x2
meshes, the op table and the checkpoint tests all pass when the ranks are split across
hosts (every exchange over the world goes through MPI, node-shared memory stays inside a
host, local ranks count within a host)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from helpers import TESTS
from helpers.jobs import MPIEXEC, child_env, run_group

LIMIT_S = 600

pytestmark = [
    pytest.mark.skipif(not Path(MPIEXEC).exists(), reason="no mpiexec next to python"),
    pytest.mark.mode_independent,  # hosts, collectives and files: below the dispatch
]

FILES = [
    "mpi/distributed/test_hosts_mpi.py",
    "mpi/redistribute/test_execute.py::test_all_pairs_1d",
    "mpi/redistribute/test_execute.py::test_all_pairs_2x2",
    "mpi/ops/test_optable_mpi.py",
    "mpi/features/test_checkpoint.py",
]


def test_four_ranks_as_two_hosts():
    cmd = [MPIEXEC, "-n", "4", sys.executable, "-m", "pytest", *FILES, "--with-mpi", "-q",
           "-p", "no:cacheprovider"]
    env = child_env({"DTENSOR_SIM_HOSTS": "2", "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"},
                    drop=["DTENSOR_MESH"])
    proc = run_group(cmd, TESTS, LIMIT_S, env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    counts = re.search(r"(\d+) passed", out)
    assert counts and int(counts.group(1)) >= 250 and "skipped" not in out, out[-2000:]
