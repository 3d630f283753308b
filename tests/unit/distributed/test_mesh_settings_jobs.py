"""Mesh creation in real 2-rank jobs: per-rank settings that must agree, and running out
of MPI communicators.

Each test starts an ``mpiexec`` job (MPICH's hydra; its MPMD form ``-n 1 -env VAR a python
job.py : -n 1 -env VAR b python job.py`` gives each rank its own environment) in a
subprocess of its own process group, killed when it outlives its limit, so a job that
hangs fails the test instead of hanging it:

- settings that choose which collectives run (``DTENSOR_SHM``, ``DTENSOR_SHM_MIN_BYTES``,
  ``DTENSOR_POOL_MIN_BYTES``, ``DTENSOR_CHECK_SPMD``, ``DTENSOR_COST_MODEL``) differ
  between the ranks: mesh creation raises ``ConfigError`` on every rank, naming each
  differing variable and its value on each rank (``DTENSOR_SHM_MIN_BYTES`` of 0 on one
  rank and 1 MiB on the other used to hang the first exchange of a size in between: one
  rank took the shared-memory path, the other MPI);
- the same settings written differently (unset and the default value) agree;
- when MPI has no communicator left, a mesh that needs a new one raises ``MeshError``
  saying how many mesh communicators and meshes the process holds, while identical meshes
  keep being created from the shared ones.
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.jobs import MPIEXEC, child_env, run_group

#: Hard limit of one job (a job that hangs is killed and the test fails).
LIMIT_S = 60

pytestmark = pytest.mark.skipif(not Path(MPIEXEC).exists(), reason="no mpiexec next to python")

# Every variable the tests set, removed from the inherited environment first.
SETTINGS = (
    "DTENSOR_SHM",
    "DTENSOR_SHM_MIN_BYTES",
    "DTENSOR_POOL_MIN_BYTES",
    "DTENSOR_CHECK_SPMD",
    "DTENSOR_COST_MODEL",
    "DTENSOR_WATCHDOG",
)

CREATE_MESH = """\
import sys
import numpy as np
from mpi4py import MPI
import dtensor as dt
from dtensor.errors import ConfigError

rank = MPI.COMM_WORLD.Get_rank()
try:
    mesh = dt.init_device_mesh((2,))
except ConfigError as e:
    text = str(e).replace("\\n", " | ")
    print(f"rank {rank} raised ConfigError: {text}\\n", end="", flush=True)  # one write
    sys.exit(0)
total = 0.0
for rows in (64, 512):  # 256 KiB, then 2 MiB: below and above the default shared-memory limit
    x = dt.distribute_tensor(np.ones((rows, 1024), np.float32), mesh, [dt.Shard(0)])
    total += float(x.redistribute(mesh, [dt.Shard(1)]).full_tensor().numpy().sum())
print(f"rank {rank} ran the exchanges: {total}", flush=True)
"""


def _mpmd(tmp_path: Path, body: str, envs: list[dict[str, str]]):
    """Run ``body`` as one rank per entry of ``envs`` (that rank's extra environment)."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    argv = [MPIEXEC]
    for i, env in enumerate(envs):
        argv += [":"] if i else []
        argv += ["-n", "1"]
        for name, value in env.items():
            argv += ["-env", name, value]
        argv += [sys.executable, str(script)]
    full_env = child_env({"OMP_NUM_THREADS": "1"}, drop=SETTINGS)
    return run_group(argv, tmp_path, LIMIT_S, full_env)


MODEL = '{"alpha_s": 0.001}'

RANK0 = {
    "DTENSOR_SHM_MIN_BYTES": "0",
    "DTENSOR_SHM": "0",
    "DTENSOR_POOL_MIN_BYTES": "0",
    "DTENSOR_CHECK_SPMD": "1",
    "DTENSOR_COST_MODEL": MODEL,
}
RANK1 = {"DTENSOR_SHM_MIN_BYTES": "1048576"}


def test_differing_settings_raise_config_error_on_every_rank(tmp_path):
    out = _mpmd(tmp_path, CREATE_MESH, [RANK0, RANK1])
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [ln for ln in out.stdout.splitlines() if "raised ConfigError" in ln]
    assert sorted(ln.split()[1] for ln in lines) == ["0", "1"], out.stdout + out.stderr
    for line in lines:
        assert "DTENSOR_SHM_MIN_BYTES (world rank 0: 0, world rank 1: 1048576)" in line
        assert "DTENSOR_SHM (world rank 0: 0, world rank 1: 1)" in line
        assert "DTENSOR_POOL_MIN_BYTES (world rank 0: 0, world rank 1: 4096)" in line
        assert "DTENSOR_CHECK_SPMD (world rank 0: 1, world rank 1: 0)" in line
        assert "DTENSOR_COST_MODEL" in line


def test_one_differing_setting_is_named_alone(tmp_path):
    out = _mpmd(tmp_path, CREATE_MESH, [{"DTENSOR_SHM_MIN_BYTES": "0"}, {}])
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [ln for ln in out.stdout.splitlines() if "raised ConfigError" in ln]
    assert len(lines) == 2, out.stdout + out.stderr
    for line in lines:
        assert "DTENSOR_SHM_MIN_BYTES (world rank 0: 0, world rank 1: 1048576)" in line
        assert "DTENSOR_SHM (" not in line and "DTENSOR_CHECK_SPMD" not in line


def test_equal_settings_written_differently_agree(tmp_path):
    explicit = {"DTENSOR_SHM_MIN_BYTES": "1048576", "DTENSOR_SHM": "1", "DTENSOR_CHECK_SPMD": "0"}
    out = _mpmd(tmp_path, CREATE_MESH, [explicit, {}])
    assert out.returncode == 0, out.stdout + out.stderr
    # the ranks' lines may reach mpiexec's output interleaved: match each report, not lines
    reports = re.findall(r"rank (\d) ran the exchanges: ([0-9.]+)", out.stdout)
    assert sorted(rank for rank, _ in reports) == ["0", "1"], out.stdout + out.stderr
    assert all(total == f"{(64 + 512) * 1024.0}" for _, total in reports), out.stdout


EXHAUST = """\
import sys
from mpi4py import MPI
import dtensor as dt
from dtensor.errors import MeshError

rank = MPI.COMM_WORLD.Get_rank()
dt.init_device_mesh((2,))
dt.init_device_mesh((2, 1))
held = []
try:  # take every communicator MPI has left
    while True:
        held.append(MPI.COMM_WORLD.Dup())
except MPI.Exception:
    pass
for _ in range(100):  # identical meshes still work: they share their communicators
    dt.init_device_mesh((2,))
    dt.init_device_mesh((2, 1))
print(f"rank {rank} created identical meshes after {len(held)} duplicates", flush=True)
try:
    dt.init_device_mesh((1, 2))  # a new layout needs new communicators
except MeshError as e:
    text = str(e).replace("\\n", " | ")
    print(f"rank {rank} raised MeshError: {text}\\n", end="", flush=True)
    sys.exit(0)
print(f"rank {rank} did not raise", flush=True)
sys.exit(3)
"""


def test_running_out_of_communicators_raises_mesh_error(tmp_path):
    out = _mpmd(tmp_path, EXHAUST, [{}, {}])
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("created identical meshes") == 2, out.stdout + out.stderr
    # each rank's report, wherever the other rank's lines arrived in between
    lines = re.findall(r"rank (\d) raised MeshError: ([^\n]*?)(?=rank \d |\n|$)", out.stdout)
    assert sorted(rank for rank, _ in lines) == ["0", "1"], out.stdout + out.stderr
    for _, line in lines:
        assert "init_device_mesh" in line or "DeviceMesh" in line
        assert "could not create another communicator" in line
        # (2,) and (2, 1) hold 2 communicators: (2, 1)'s first dim is (2,)'s
        assert "2 mesh communicators for 2 distinct meshes" in line
